/* Weight-only int8 and int4 products for bf16_kernel.c, which includes this file in its AVX2 pass
   (AVX-512 hosts run quant_avx512.c's one-row kernels and tiles instead, with the same bits, and
   the rest of this file). Activations stay float32 inside (bfloat16 outside); only the weights
   are integers. common/quant.py quantizes and lays the weights out (LAYOUT there names the
   layouts below: a change here changes that name).

   int8 (per output column symmetric): panels of 32 columns, P[panel][k][32] int8 in column order,
   scales s[n] float32; y[c] = s[c] * sum over k in order of x[k] * q[c][k], one float32
   accumulator per column (on a CPU with AVX-512 VNNI and VBMI, integer dot products instead:
   int_dot.c).

   int4 (groups of `group` inputs along k, group a multiple of 8, symmetric: q in [-8, 7] stored as
   u = q + 8): panels of 32 columns, for each 8 inputs of a panel 32 words W[c] holding column c's
   8 nibbles, input k0 + j at bits 4j; scales s[panel][k / group][32] bfloat16. Its products are
   integer dot products (int_dot.c).

   MXFP4 (OCP microscaling, gpt-oss's experts; common/mxfp4.py): int4's words and scale layout,
   groups of 32 inputs. The FP4 E2M1 codes are re-encoded once at load so that code c means
   t[c] = 2 v + 12 in [0, 24] (v the FP4 value, t[0] = 0), and each scale holds 2^(e - 128), half
   the block's power of two. Nibble N's code, masked to the low half of byte N / 2 (the odd ones
   shifted down first), is looked up in place (a byte shuffle; the other bytes look up t[0] = 0),
   which gives t * 2^(8 (N / 2)) exactly, and x is scaled by 2^(-8 (N / 2)) to match. Per group,
   a = sum of x[k] * t in k order, then s * (a - 12 sum(x)) = s * sum(2 v x) is added to the
   column's total, groups in order.

   Each row's arithmetic is the same whichever kernel (1 or 2 rows, or a tile of many_rows)
   computes it: a row's bits do not depend on its batch-mates. */

#define Q8_AHEAD 2048 /* bytes of a panel prefetched ahead, as AHEAD rows of bfloat16 panels are */
/* ... and by the row kernels, which stream weights from memory at batch 1: 8192 made one-row int4
   and MXFP4 products 1.2-1.4x faster at gpt-oss-20b's expert shapes on AVX2 (host B), int8 no
   slower; the tiles, compute-bound, keep 2048. A step of int4's 8 inputs reads two cache lines
   of each panel, and both are prefetched: with only the first, one-row int4 products of weights
   streamed from memory ran 1.2x slower and 2-row ones 1.7x on host B */
#define ROW_AHEAD 8192

/* The bytes on from input i of a panel (k inputs of `step` bytes) to prefetch, `ahead`, where
   that is past the panel's end `next` bytes further: into the panel the kernel reads next, so
   each of its streams starts fetched */
static inline long ahead_of(long i, long k, long step, long ahead, long next) {
    return ahead + (i * step + ahead >= k * step ? next : 0);
}

TARGET static void many_rows(int format, const float *x, const void *p, const void *s, uint16_t *y,
                             long ldy, long m, long k, long group, const float *bias);

/* R rows of x [R][k] against P int8 panels from p (k * 32 bytes apart) into y */
#define Q8KERNEL(R, P)                                                                          \
    TARGET static void q8_##R##_##P(const float *x, const int8_t *p, const float *s,            \
                                    uint16_t *y, long ldy, long k, long group,                  \
                                    const float *bias) {                                        \
        (void)group; /* one scale a row */                                                      \
        __m256 acc[R][4 * P];                                                                   \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4 * P; j++) acc[r][j] = _mm256_setzero_ps();                    \
        for (long i = 0; i < k; i++) {                                                          \
            long ahead = ahead_of(i, k, PANEL, ROW_AHEAD, (P - 1) * k * PANEL);                 \
            for (int q = 0; q < P; q++) {                                                       \
                const int8_t *at = p + (q * k + i) * PANEL;                                     \
                _mm_prefetch((const char *)at + ahead, _MM_HINT_T0);                            \
                __m256 w[4];                                                                    \
                for (int j = 0; j < 4; j++)                                                     \
                    w[j] = _mm256_cvtepi32_ps(                                                  \
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at + 8 * j))));  \
                for (int r = 0; r < R; r++) {                                                   \
                    __m256 xr = _mm256_set1_ps(x[r * k + i]);                                   \
                    for (int j = 0; j < 4; j++)                                                 \
                        acc[r][q * 4 + j] = _mm256_fmadd_ps(xr, w[j], acc[r][q * 4 + j]);       \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 2 * P; j++) { /* 16 columns at a time */                        \
                vec v = vmul((vec){acc[r][2 * j], acc[r][2 * j + 1]}, vloadf(s + j * 16));       \
                if (bias) v = vadd(v, vloadf(bias + j * 16));                                   \
                vstore_bf16(y + r * ldy + j * 16, v);                                           \
            }                                                                                   \
    }
Q8KERNEL(1, 2)
Q8KERNEL(2, 1)

/* One 64-column block of m rows into y: many_rows from 3 rows on (there each weight, converted
   once, serves up to six rows, twelve on AVX-512: 1.2x the row pairs at 3 rows, 1.4x at 8 on
   AVX2), else the rows in pairs against the first panel, then the second (TWO_ONE, a panel
   PANEL_BYTES and its scales SCALE_BYTES after the first), and a last odd row against both
   panels at once (ONE_TWO) */
#define BLOCK(NAME, FORMAT, TWO_ONE, ONE_TWO, PANEL_BYTES, SCALE_BYTES)                           \
    TARGET static void NAME(const float *x, const void *p, const void *s, uint16_t *y, long ldy,  \
                            long m, long k, long group, const float *bias) {                     \
        if (m >= 3) return many_rows(FORMAT, x, p, s, y, ldy, m, k, group, bias);                 \
        for (int q = 0; q < 2; q++)                                                               \
            for (long r = 0; r + 1 < m; r += 2)                                                   \
                TWO_ONE(x + r * k, (const void *)((const char *)p + q * (PANEL_BYTES)),           \
                        (const void *)((const char *)s + q * (SCALE_BYTES)), y + r * ldy + q * 32, \
                        ldy, k, group, bias ? bias + q * 32 : 0);                                 \
        if (m % 2) ONE_TWO(x + (m - 1) * k, p, s, y + (m - 1) * ldy, ldy, k, group, bias);        \
    }
BLOCK(int8_block, FORMAT_INT8, q8_2_1, q8_1_2, k * PANEL, PANEL * sizeof(float))

/* input i + N of every column of the P panels (words from at[q]) times x, into acc: the code,
   looked up in place, times x scaled to match, so each product is as rounded as a plain one.
   Input by input over all R * 4P accumulators, the words read again from L1 for each input: held
   in registers across the eight inputs, as a panel at a time held them, they left the
   accumulators no room and GCC spilled them (one-row products 22% slower on AVX2). A macro, so
   that masks are constants. */
#define Q4STEP(N, WEIGHT, SCALE)                                                             \
    __asm__("" ::: "memory"); /* the words are read again, not kept in registers */           \
    for (int r = 0; r < rows; r++) xr[r] = _mm256_set1_ps(x[r * k + i + N] * (SCALE));       \
    for (int q = 0; q < panels; q++)                                                         \
        for (int j = 0; j < 4; j++) {                                                        \
            __m256i word = shifted && N % 2 ? odd[q][j] : _mm256_loadu_si256(at[q] + j);     \
            __m256 f = WEIGHT;                                                               \
            for (int r = 0; r < rows; r++)                                                   \
                acc[r][q * 4 + j] = _mm256_fmadd_ps(xr[r], f, acc[r][q * 4 + j]);            \
        }
/* MXFP4's nibble N as a float, t * 2^(8 (N / 2)) */
#define MX_LOOKUP(N, V)                                                                         \
    _mm256_cvtepi32_ps(_mm256_shuffle_epi8(                                                    \
        MX_TABLE, _mm256_and_si256(V, _mm256_set1_epi32(15 << (8 * (N / 2))))))
#define MXF(N) MX_LOOKUP(N, N % 2 ? _mm256_srli_epi32(word, 4) : word)
#define MXF_SHIFTED(N) MX_LOOKUP(N, word) /* the odd nibbles' words shifted already */
#define MX_TABLE                                                                                \
    _mm256_setr_epi8(0, 4, 6, 8, 9, 10, 11, 12, 12, 13, 14, 15, 16, 18, 20, 24, 0, 4, 6, 8, 9, 10, \
                     11, 12, 12, 13, 14, 15, 16, 18, 20, 24)

/* The sum of x[0..n), n a multiple of 8, in eight lanes then across them: an MXFP4 group's sum of
   inputs, the same in every kernel (a scalar chain of 64 additions cost as much as the group's
   products) */
TARGET static inline float group_sum(const float *x, long n) {
    __m256 acc = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(h) + _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1));
}

/* R rows of x [R][k] against P MXFP4 (F MXF_SHIFTED, ZERO 12) panels from p
   (k * 16 bytes apart), their scales from s ((k / group) * 32 apart), into y; x scaled by
   SHIFT(N) for nibble N. ODD_SHIFTED: the words shifted down a nibble once per 8 inputs, into
   `odd`, for the odd nibbles to read (MXFP4: 1.07x its one-row products on AVX2) */
#define NIBBLE_KERNEL(NAME, R, P, F, SHIFT, ZERO, ODD_SHIFTED)                                  \
    TARGET static void NAME##_##R##_##P(const float *x, const uint32_t *p, const uint16_t *s,   \
                                    uint16_t *y, long ldy, long k, long group,                  \
                                    const float *bias) {                                        \
        const int rows = R, panels = P, shifted = ODD_SHIFTED; /* what Q4STEP reads */         \
        long groups = k / group;                                                                \
        __m256 total[R][4 * P];                                                                 \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4 * P; j++) total[r][j] = _mm256_setzero_ps();                  \
        for (long g = 0; g < groups; g++) {                                                     \
            __m256 acc[R][4 * P];                                                               \
            for (int r = 0; r < R; r++)                                                         \
                for (int j = 0; j < 4 * P; j++) acc[r][j] = _mm256_setzero_ps();                \
            for (long i = g * group; i < (g + 1) * group; i += 8) {                             \
                const __m256i *at[P]; /* 32 words per 8 inputs */                               \
                for (int q = 0; q < P; q++) {                                                   \
                    at[q] = (const __m256i *)(p + (q * k + i) * 4);                             \
                    _mm_prefetch((const char *)at[q] + ROW_AHEAD, _MM_HINT_T0);                 \
                    _mm_prefetch((const char *)at[q] + ROW_AHEAD + 64, _MM_HINT_T0);            \
                }                                                                               \
                __m256 xr[R];                                                                   \
                __m256i odd[P][4];                                                              \
                for (int q = 0; q < P && shifted; q++)                                          \
                    for (int j = 0; j < 4; j++)                                                 \
                        odd[q][j] = _mm256_srli_epi32(_mm256_loadu_si256(at[q] + j), 4);        \
                Q4STEP(0, F(0), SHIFT(0))                                                       \
                Q4STEP(1, F(1), SHIFT(1))                                                       \
                Q4STEP(2, F(2), SHIFT(2))                                                       \
                Q4STEP(3, F(3), SHIFT(3))                                                       \
                Q4STEP(4, F(4), SHIFT(4))                                                       \
                Q4STEP(5, F(5), SHIFT(5))                                                       \
                Q4STEP(6, F(6), SHIFT(6))                                                       \
                Q4STEP(7, F(7), SHIFT(7))                                                       \
            }                                                                                   \
            for (int r = 0; r < R; r++) {                                                       \
                float sum = group_sum(x + r * k + g * group, group);                            \
                __m256 shift = _mm256_set1_ps(ZERO * sum); /* the codes' offset */              \
                for (int q = 0; q < P; q++)                                                     \
                    for (int j = 0; j < 4; j++) {                                               \
                        const uint16_t *sc = s + (q * groups + g) * PANEL + j * 8;              \
                        __m256 a = _mm256_sub_ps(acc[r][q * 4 + j], shift);                     \
                        total[r][q * 4 + j] = _mm256_fmadd_ps(                                  \
                            widen8(_mm_loadu_si128((const __m128i *)sc)), a,                    \
                            total[r][q * 4 + j]);                                               \
                    }                                                                           \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 2 * P; j++) {                                                   \
                vec v = {total[r][2 * j], total[r][2 * j + 1]};                                 \
                if (bias) v = vadd(v, vloadf(bias + j * 16));                                   \
                vstore_bf16(y + r * ldy + j * 16, v);                                           \
            }                                                                                   \
    }
#define MXSHIFT(N) (1.0f / (1 << (8 * (N / 2))))
NIBBLE_KERNEL(mx, 1, 2, MXF_SHIFTED, MXSHIFT, 12.0f, 1)
#undef Q4STEP

/* MXFP4: many_rows from 2 rows on (2.2x the row-pair kernel it replaced at 2 rows, 1.9x at 3, on
   AVX2: that kernel's accumulators lived on the stack) */
TARGET static void mxfp4_block(const float *x, const void *p, const void *s, uint16_t *y,
                               long ldy, long m, long k, long group, const float *bias) {
    if (m >= 2) return many_rows(FORMAT_MXFP4, x, p, s, y, ldy, m, k, group, bias);
    mx_1_2(x, p, s, y, ldy, k, group, bias);
}

/* FP8 e4m3 as published (DeepSeek-V3's layout): panels of 32 columns, P[panel][k][32] bytes in
   column order (as int8), scales s[panel][k / group][1] float32, the weight_scale_inv of the block
   the panel's rows and those inputs lie in. An e4m3 byte b placed in a half's top byte and shifted
   right by one (arithmetic), bit 14 cleared, is the float16 of its value times 2^-8, subnormals
   included, which F16C widens exactly; the 2^8 goes into the scale. Per group, a = sum of x[k] *
   that in k order, then s * 2^8 * a is added to the column's total, groups in order. */
#define F8TARGET __attribute__((target("avx2,fma,f16c")))

F8TARGET static inline __m256 f8_widen(__m128i halves) { /* 8 bytes, each the top of a half */
    __m128i h = _mm_and_si128(_mm_srai_epi16(halves, 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

/* R rows of x [R][k] against P FP8 panels from p (k * 32 bytes apart), scales from s */
#define F8KERNEL(R, P)                                                                          \
    F8TARGET static void f8_##R##_##P(const float *x, const uint8_t *p, const float *s,         \
                                      uint16_t *y, long ldy, long k, long group,                \
                                      const float *bias) {                                      \
        long groups = k / group;                                                                \
        const __m128i zero = _mm_setzero_si128();                                               \
        __m256 total[R][4 * P];                                                                 \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4 * P; j++) total[r][j] = _mm256_setzero_ps();                  \
        for (long g = 0; g < groups; g++) {                                                     \
            __m256 acc[R][4 * P];                                                               \
            for (int r = 0; r < R; r++)                                                         \
                for (int j = 0; j < 4 * P; j++) acc[r][j] = _mm256_setzero_ps();                \
            for (long i = g * group; i < (g + 1) * group; i++)                                  \
                for (int q = 0; q < P; q++) {                                                   \
                    const uint8_t *at = p + (q * k + i) * PANEL;                                \
                    _mm_prefetch((const char *)at + ROW_AHEAD, _MM_HINT_T0);                    \
                    __m128i lo = _mm_loadu_si128((const __m128i *)at);                          \
                    __m128i hi = _mm_loadu_si128((const __m128i *)at + 1);                      \
                    __m256 w[4] = {f8_widen(_mm_unpacklo_epi8(zero, lo)),                       \
                                   f8_widen(_mm_unpackhi_epi8(zero, lo)),                       \
                                   f8_widen(_mm_unpacklo_epi8(zero, hi)),                       \
                                   f8_widen(_mm_unpackhi_epi8(zero, hi))};                      \
                    for (int r = 0; r < R; r++) {                                               \
                        __m256 xr = _mm256_set1_ps(x[r * k + i]);                               \
                        for (int j = 0; j < 4; j++)                                             \
                            acc[r][q * 4 + j] = _mm256_fmadd_ps(xr, w[j], acc[r][q * 4 + j]);   \
                    }                                                                           \
                }                                                                               \
            for (int q = 0; q < P; q++) {                                                       \
                __m256 scale = _mm256_set1_ps(s[q * groups + g] * 256.0f);                      \
                for (int r = 0; r < R; r++)                                                     \
                    for (int j = 0; j < 4; j++)                                                 \
                        total[r][q * 4 + j] =                                                   \
                            _mm256_fmadd_ps(scale, acc[r][q * 4 + j], total[r][q * 4 + j]);     \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 2 * P; j++) {                                                   \
                vec v = {total[r][2 * j], total[r][2 * j + 1]};                                 \
                if (bias) v = vadd(v, vloadf(bias + j * 16));                                   \
                vstore_bf16(y + r * ldy + j * 16, v);                                           \
            }                                                                                   \
    }
F8KERNEL(1, 2)
F8KERNEL(2, 1)

BLOCK(fp8_block, FORMAT_FP8, f8_2_1, f8_1_2, k * PANEL, k / group * sizeof(float))
#undef BLOCK

/* Rows of x at a time in many_rows: 6 x 2 accumulators and the weights of one input for 16
   columns fill AVX2's 16 registers, so each weight, converted once, serves 6 rows */
#define TILE_ROWS 6

/* Tiles: R rows of x (row stride ldx) against 16 columns of a panel (p: the panel's first input
   of the chunk, at the columns' offset) over n inputs. Each of the R x 16 sums starts from `from`
   (row stride 64; zero without it), adds x[i] * w[i] for i in order, each weight as the row
   kernels multiply it, and goes to `to`. Named accumulators, not an array: GCC kept an array's
   on the stack and stored it every input. */
#define TILE_ROW(r, DO)                                                                          \
    if (rows > r) {                                                                            \
        DO(r, a##r##0, a##r##1)                                                                \
    }
#define TILE_EACH(DO)                                                                            \
    TILE_ROW(0, DO) TILE_ROW(1, DO) TILE_ROW(2, DO) TILE_ROW(3, DO) TILE_ROW(4, DO) TILE_ROW(5, DO)
#define TILE_LOAD(r, lo, hi)                                                                     \
    lo = from ? _mm256_loadu_ps(from + r * 64) : _mm256_setzero_ps();                           \
    hi = from ? _mm256_loadu_ps(from + r * 64 + 8) : _mm256_setzero_ps();
#define TILE_FMA(r, lo, hi)                                                                      \
    {                                                                                          \
        __m256 b = _mm256_broadcast_ss(x + r * ldx + i);                                       \
        lo = _mm256_fmadd_ps(b, w0, lo);                                                       \
        hi = _mm256_fmadd_ps(b, w1, hi);                                                       \
    }
#define TILE_STORE(r, lo, hi)                                                                    \
    _mm256_storeu_ps(to + r * 64, lo);                                                         \
    _mm256_storeu_ps(to + r * 64 + 8, hi);
/* NAME##_R for R = 1..6: per input i (STEP at a time), WEIGHTS sets w0, w1 and FMAs */
#define TILE(NAME, R, STEP, WEIGHTS)                                                            \
    F8TARGET static void NAME##_##R(const float *x, long ldx, const void *p, long n,            \
                                    const float *from, float *to) {                             \
        const int rows = R; /* what TILE_ROW reads */                                           \
        __m256 a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51, w0, w1;              \
        TILE_EACH(TILE_LOAD)                                                                    \
        for (long i0 = 0; i0 < n; i0 += STEP) {                                                 \
            WEIGHTS                                                                             \
        }                                                                                       \
        TILE_EACH(TILE_STORE)                                                                   \
    }

/* int8: 8 bytes a vector */
#define Q8_WEIGHTS                                                                              \
    long i = i0;                                                                                \
    const int8_t *at = (const int8_t *)p + i * PANEL;                                           \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));       \
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at + 8)))); \
    TILE_EACH(TILE_FMA)
/* FP8: 16 bytes, each the top of a half */
#define F8_WEIGHTS                                                                              \
    long i = i0;                                                                                \
    const uint8_t *at = (const uint8_t *)p + i * PANEL;                                         \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    __m128i bytes = _mm_loadu_si128((const __m128i *)at);                                       \
    w0 = f8_widen(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes));                               \
    w1 = f8_widen(_mm_unpackhi_epi8(_mm_setzero_si128(), bytes));                               \
    TILE_EACH(TILE_FMA)
/* MXFP4 (F: MXF): 8 inputs a step from two vectors of words (kept in memory:
   registers are full), nibble N converted as the row kernels convert it (x scaled to match by the
   caller) */
#define NIBBLE(N, F)                                                                            \
    {                                                                                           \
        long i = i0 + N;                                                                        \
        __asm__("" ::: "memory"); /* the words are read again, not kept in registers */         \
        __m256i word = _mm256_loadu_si256(at);                                                  \
        w0 = F(N);                                                                              \
        word = _mm256_loadu_si256(at + 1);                                                      \
        w1 = F(N);                                                                              \
        TILE_EACH(TILE_FMA)                                                                     \
    }
#define NIBBLES(F)                                                                              \
    const __m256i *at = (const __m256i *)((const uint32_t *)p + i0 / 8 * PANEL);                  \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    NIBBLE(0, F) NIBBLE(1, F) NIBBLE(2, F) NIBBLE(3, F) NIBBLE(4, F) NIBBLE(5, F) NIBBLE(6, F)  \
    NIBBLE(7, F)
#define MX_WEIGHTS NIBBLES(MXF)

/* MXFP4, 2 rows against a whole panel (32 columns): 8 accumulators, where a tile of 2 rows
   and 16 columns has 4 and waits on the multiply-adds' latency (1.2-1.4x that tile). `to` as a
   tile's. */
#define PAIR_COLUMNS(j, N, F)                                                                   \
    {                                                                                           \
        __m256i word = _mm256_loadu_si256(at + j);                                              \
        __m256 w = F(N);                                                                        \
        a0##j = _mm256_fmadd_ps(b0, w, a0##j);                                                  \
        a1##j = _mm256_fmadd_ps(b1, w, a1##j);                                                  \
    }
#define PAIR_NIBBLE(N, F)                                                                       \
    {                                                                                           \
        __asm__("" ::: "memory"); /* the words are read again, not kept in registers */         \
        __m256 b0 = _mm256_broadcast_ss(x + i0 + N), b1 = _mm256_broadcast_ss(x + ldx + i0 + N); \
        PAIR_COLUMNS(0, N, F) PAIR_COLUMNS(1, N, F) PAIR_COLUMNS(2, N, F) PAIR_COLUMNS(3, N, F) \
    }
#define PAIR(NAME, F)                                                                           \
    F8TARGET static void NAME(const float *x, long ldx, const void *p, long n, float *to) {     \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;                      \
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;                                      \
        for (long i0 = 0; i0 < n; i0 += 8) {                                                    \
            const __m256i *at = (const __m256i *)((const uint32_t *)p + i0 / 8 * PANEL);          \
            _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                             \
            _mm_prefetch((const char *)at + Q8_AHEAD + 64, _MM_HINT_T0);                        \
            PAIR_NIBBLE(0, F) PAIR_NIBBLE(1, F) PAIR_NIBBLE(2, F) PAIR_NIBBLE(3, F)             \
            PAIR_NIBBLE(4, F) PAIR_NIBBLE(5, F) PAIR_NIBBLE(6, F) PAIR_NIBBLE(7, F)             \
        }                                                                                       \
        __m256 sums[2][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};                       \
        for (int r = 0; r < 2; r++)                                                             \
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(to + r * 64 + 8 * j, sums[r][j]);      \
    }
PAIR(mx_pair, MXF)
#undef PAIR_COLUMNS
#undef PAIR_NIBBLE
#undef PAIR

typedef void (*tile_fn)(const float *, long, const void *, long, const float *, float *);
#define TILES(NAME, STEP, WEIGHTS)                                                              \
    TILE(NAME, 1, STEP, WEIGHTS)                                                                \
    TILE(NAME, 2, STEP, WEIGHTS)                                                                \
    TILE(NAME, 3, STEP, WEIGHTS)                                                                \
    TILE(NAME, 4, STEP, WEIGHTS)                                                                \
    TILE(NAME, 5, STEP, WEIGHTS)                                                                \
    TILE(NAME, 6, STEP, WEIGHTS)                                                                \
    static const tile_fn NAME[TILE_ROWS + 1] = {0,         NAME##_1, NAME##_2, NAME##_3,        \
                                               NAME##_4, NAME##_5, NAME##_6};
TILES(q8_tiles, 1, Q8_WEIGHTS)
TILES(f8_tiles, 1, F8_WEIGHTS)
TILES(mx_tiles, 8, MX_WEIGHTS)
#undef TILES
#undef TILE
#undef TILE_ROW
#undef TILE_EACH
#undef TILE_LOAD
#undef TILE_FMA
#undef TILE_STORE
#undef Q8_WEIGHTS
#undef F8_WEIGHTS
#undef MX_WEIGHTS
#undef NIBBLES
#undef NIBBLE

/* quant_avx512.c's tiles of up to WIDE_ROWS rows for `format`, where the CPU has AVX-512 */
#define WIDE_ROWS 12
static const tile_fn *wide_tiles(int format);

/* m rows of x [m][k] against a 64-column block of `format`, in tiles of up to 6 rows and 16
   columns (on AVX-512, quant_avx512.c's tiles of up to WIDE_ROWS rows: at 32 rows on a 2-core
   AMX host quantized experts decoded 1.12x bfloat16's speed, 0.79x on the AVX2 tiles; MXFP4's 2
   rows: its pair kernel; int4: int_dot.c), each chunk of inputs at a time (int8: 64, the others a
   group): the arithmetic of the row kernels, step for step. A row's 64 sums run in float32
   (`total`; all but int8 add each group's sums into it, scaled, as the row kernels do). */
TARGET static void many_rows(int format, const float *x, const void *p, const void *s, uint16_t *y,
                             long ldy, long m, long k, long group, const float *bias) {
    float total[WIDE_ROWS * 64], part[WIDE_ROWS * 64]; /* a tile's rows: all sums, a group's */
    /* MXFP4: a group's x, scaled (groups of 32) */
    float scaled[WIDE_ROWS * 128] __attribute__((aligned(32)));
    const tile_fn *wide = avx512() ? wide_tiles(format) : 0;
    const tile_fn *tiles = wide                     ? wide
                           : format == FORMAT_INT8  ? q8_tiles
                           : format == FORMAT_MXFP4 ? mx_tiles
                                                    : f8_tiles;
    long most = wide ? WIDE_ROWS : TILE_ROWS;
    int nibbles = format == FORMAT_MXFP4; /* words of 8 inputs */
    float zero = 12.0f;                    /* their codes' offset */
    long chunk = format == FORMAT_INT8 ? 64 : group; /* MXFP4, FP8: group divides k */
    long groups_k = format == FORMAT_INT8 ? 1 : k / group; /* int8's group is 0 */
    int carried = format == FORMAT_INT8; /* one sum across the chunks, no group's */
    /* MXFP4: x scaled as the row kernels scale it for nibble N (MXSHIFT) */
    const __m256 shifts = _mm256_setr_ps(MXSHIFT(0), MXSHIFT(1), MXSHIFT(2), MXSHIFT(3),
                                         MXSHIFT(4), MXSHIFT(5), MXSHIFT(6), MXSHIFT(7));
    long blocks = (m + most - 1) / most; /* rows spread evenly: 8 as 4 + 4 on AVX2 */
    for (long b = 0, r0 = 0, rows; b < blocks; b++, r0 += rows) {
        rows = m / blocks + (b < m % blocks);
        memset(total, 0, sizeof total);
        for (long g = 0; g * chunk < k; g++) {
            long n = k - g * chunk < chunk ? k - g * chunk : chunk, i0 = g * chunk;
            const float *xr = x + r0 * k + i0;
            long ldx = k;
            if (nibbles) {
                for (long r = 0; r < rows; r++)
                    for (long i = 0; i < n; i += 8)
                        _mm256_store_ps(scaled + r * n + i,
                                        _mm256_mul_ps(_mm256_loadu_ps(xr + r * k + i), shifts));
                xr = scaled, ldx = n;
            }
            const char *panel[2]; /* the chunk's first input in each panel */
            for (int q = 0; q < 2; q++)
                panel[q] = (const char *)p + (q * k + i0) * block_bytes(format, 1) / 2;
            int pair = nibbles && rows == 2;
            for (int q = 0; q < 2 && pair; q++)
                mx_pair(xr, ldx, panel[q], n, part + q * 32);
            for (int c = 0; c < 4 && !pair; c++) /* 16 columns: a panel's first or second half */
                tiles[rows](xr, ldx, panel[c / 2] + c % 2 * (nibbles ? 64 : 16), n,
                            carried ? total + c * 16 : 0, carried ? total + c * 16 : part + c * 16);
            for (long r = 0; r < rows && !carried; r++) {
                float sum = nibbles ? group_sum(x + (r0 + r) * k + i0, n) : 0.0f;
                for (int j = 0; j < 8; j++) {
                    long q = j / 4;
                    __m256 scale, a = _mm256_loadu_ps(part + r * 64 + 8 * j);
                    if (nibbles) {
                        const uint16_t *sc =
                            (const uint16_t *)s + (q * groups_k + g) * PANEL + (j % 4) * 8;
                        scale = widen8(_mm_loadu_si128((const __m128i *)sc));
                        a = _mm256_sub_ps(a, _mm256_set1_ps(zero * sum));
                    } else {
                        scale = _mm256_set1_ps(((const float *)s)[q * groups_k + g] * 256.0f);
                    }
                    float *t = total + r * 64 + 8 * j;
                    _mm256_storeu_ps(t, _mm256_fmadd_ps(scale, a, _mm256_loadu_ps(t)));
                }
            }
        }
        for (long r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) {
                vec v = vloadf(total + r * 64 + 16 * j);
                if (format == FORMAT_INT8) v = vmul(v, vloadf((const float *)s + 16 * j));
                if (bias) v = vadd(v, vloadf(bias + 16 * j));
                vstore_bf16(y + (r0 + r) * ldy + 16 * j, v);
            }
    }
}
#undef TILE_ROWS

/* w [n][k] (bfloat16 where bf, else float32) quantized by common/quant.py's rule into the layouts
   above: int8 (scheme 1) or int4 in groups of `group` (scheme 2), each output row independently,
   rows split over `threads`. n a multiple of 32, k of 8 and of group. */
void moe_quantize(int scheme, long group, const void *w, int bf, long n, long k, void *data,
                  void *scales, int threads) {
    long groups = scheme == 1 ? 1 : k / group, size = scheme == 1 ? k : group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < n; c++) {
        long panel = c / PANEL, col = c % PANEL;
        for (long g = 0; g < groups; g++) {
            float v[128], extreme = 0.0f, top = 0.0f; /* int4 groups hold at most 128 */
            for (long i = 0; i < size && scheme == 2; i++) {
                long at = c * k + g * size + i;
                v[i] = bf ? bf16_value(((const uint16_t *)w)[at]) : ((const float *)w)[at];
                if (__builtin_fabsf(v[i]) > top) top = __builtin_fabsf(v[i]), extreme = v[i];
            }
            if (scheme == 1) {
                for (long i = 0; i < k; i++) {
                    long at = c * k + i;
                    float x = bf ? bf16_value(((const uint16_t *)w)[at]) : ((const float *)w)[at];
                    top = __builtin_fabsf(x) > top ? __builtin_fabsf(x) : top;
                }
                float s = top / 127.0f, safe = s > 0.0f ? s : 1.0f;
                ((float *)scales)[c] = s;
                for (long i = 0; i < k; i++) {
                    long at = c * k + i;
                    float x = bf ? bf16_value(((const uint16_t *)w)[at]) : ((const float *)w)[at];
                    float q = __builtin_nearbyintf(x / safe);
                    q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
                    ((int8_t *)data)[(panel * k + i) * PANEL + col] = (int8_t)q;
                }
                continue;
            }
            float s = bf16_round(extreme / -8.0f), safe = s != 0.0f ? s : 1.0f;
            uint32_t bits;
            memcpy(&bits, &s, sizeof bits);
            ((uint16_t *)scales)[(panel * groups + g) * PANEL + col] = (uint16_t)(bits >> 16);
            uint32_t *words = (uint32_t *)data + panel * (k / 8) * PANEL + col;
            for (long i = 0; i < group; i += 8) {
                uint32_t word = 0;
                for (int j = 0; j < 8; j++) {
                    float q = __builtin_nearbyintf(v[i + j] / safe);
                    q = q < -8.0f ? -8.0f : q > 7.0f ? 7.0f : q;
                    word |= (uint32_t)((int)q + 8) << (4 * j);
                }
                words[((g * group + i) / 8) * PANEL] = word;
            }
        }
    }
}
