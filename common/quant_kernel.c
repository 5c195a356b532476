/* Weight-only int8 and int4 products for bf16_kernel.c, which includes this file in its AVX2 pass
   (so it runs on AVX-512 hosts too). Activations stay float32 inside (bfloat16 outside); only the
   weights are integers. common/quant.py quantizes and lays the weights out (LAYOUT there names the
   layouts below: a change here changes that name).

   int8 (per output column symmetric): panels of 32 columns, P[panel][k][32] int8 in column order,
   scales s[n] float32; y[c] = s[c] * sum over k in order of x[k] * q[c][k], one float32
   accumulator per column.

   int4 (groups of `group` inputs along k, group a multiple of 8, symmetric: q in [-8, 7] stored as
   u = q + 8): panels of 32 columns, for each 8 inputs of a panel 32 words W[c] holding column c's
   8 nibbles, input k0 + j at bits 4j; scales s[panel][k / group][32] bfloat16. A nibble is
   masked in place and converted to float exactly (u * 2^4j, the matching x scaled by 2^-4j, also
   exact): per group, a = sum of x[k] * u in k order, then the group's share s * (a - 8 sum(x))
   = s * sum(x * q) is added to the column's total, groups in order.

   Each row's arithmetic is the same whichever kernel (1 or 2 rows) computes it: a row's bits do
   not depend on its batch-mates. */

#define Q8_AHEAD 2048 /* bytes of a panel prefetched ahead, as AHEAD rows of bfloat16 panels are */
/* From this many rows on, a block's weights are decoded once into float32 and every row reads
   them there (many_rows) instead of each row pair decoding them again: the same products, the
   same sums in the same order, so the same bits */
#define MANY_ROWS 4

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
        for (long i = 0; i < k; i++)                                                            \
            for (int q = 0; q < P; q++) {                                                       \
                const int8_t *at = p + (q * k + i) * PANEL;                                     \
                _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                         \
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
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 2 * P; j++) { /* 16 columns at a time */                        \
                vec v = vmul((vec){acc[r][2 * j], acc[r][2 * j + 1]}, vloadf(s + j * 16));       \
                if (bias) v = vadd(v, vloadf(bias + j * 16));                                   \
                vstore_bf16(y + r * ldy + j * 16, v);                                           \
            }                                                                                   \
    }
Q8KERNEL(1, 2)
Q8KERNEL(2, 1)

/* One 64-column block of m rows into y: many_rows from MANY_ROWS rows on, else the second panel's
   rows in pairs after the first's (TWO_ONE, a panel PANEL_BYTES and its scales SCALE_BYTES after
   the first), and a last odd row against both panels at once (ONE_TWO) */
#define BLOCK(NAME, FORMAT, TWO_ONE, ONE_TWO, PANEL_BYTES, SCALE_BYTES)                           \
    TARGET static void NAME(const float *x, const void *p, const void *s, uint16_t *y, long ldy,  \
                            long m, long k, long group, const float *bias) {                     \
        if (m >= MANY_ROWS) return many_rows(FORMAT, x, p, s, y, ldy, m, k, group, bias);         \
        for (int q = 0; q < 2; q++)                                                               \
            for (long r = 0; r + 1 < m; r += 2)                                                   \
                TWO_ONE(x + r * k, (const void *)((const char *)p + q * (PANEL_BYTES)),           \
                        (const void *)((const char *)s + q * (SCALE_BYTES)), y + r * ldy + q * 32, \
                        ldy, k, group, bias ? bias + q * 32 : 0);                                 \
        if (m % 2) ONE_TWO(x + (m - 1) * k, p, s, y + (m - 1) * ldy, ldy, k, group, bias);        \
    }
BLOCK(int8_block, FORMAT_INT8, q8_2_1, q8_1_2, k * PANEL, PANEL * sizeof(float))

/* input i + N of every column of the P panels (words from at[q]) times x, into acc. The nibble is
   masked in place, u * 2^(4N), and converted to float exactly; x is scaled by 2^(-4N) (exact too)
   to match, so each product is x * u, as rounded as a plain one. The top nibble is shifted down
   instead (in place it would read as a negative int32). Input by input over all R * 4P
   accumulators, the words read again from L1 for each input: held in registers across the eight
   inputs, as a panel at a time held them, they left the accumulators no room and GCC spilled them
   (one-row products 22% slower on AVX2). A macro, so that masks are constants. */
#define Q4STEP(N, BITS, SCALE)                                                               \
    __asm__("" ::: "memory"); /* the words are read again, not kept in registers */           \
    for (int r = 0; r < rows; r++) xr[r] = _mm256_set1_ps(x[r * k + i + N] * (SCALE));       \
    for (int q = 0; q < panels; q++)                                                         \
        for (int j = 0; j < 4; j++) {                                                        \
            __m256i word = _mm256_loadu_si256(at[q] + j);                                    \
            __m256 f = _mm256_cvtepi32_ps(BITS);                                             \
            for (int r = 0; r < rows; r++)                                                   \
                acc[r][q * 4 + j] = _mm256_fmadd_ps(xr[r], f, acc[r][q * 4 + j]);            \
        }
#define NIB(N) _mm256_and_si256(word, _mm256_set1_epi32(15 << (4 * N)))

/* The sum of x[0..n), n a multiple of 8, in eight lanes then across them: an int4 group's sum of
   inputs, the same in every kernel (a scalar chain of 64 additions cost as much as the group's
   products) */
TARGET static inline float group_sum(const float *x, long n) {
    __m256 acc = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(h) + _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1));
}

/* R rows of x [R][k] against P int4 panels from p (k * 16 bytes apart), their scales from s
   ((k / group) * 32 apart), into y */
#define Q4KERNEL(R, P)                                                                          \
    TARGET static void q4_##R##_##P(const float *x, const uint32_t *p, const uint16_t *s,       \
                                    uint16_t *y, long ldy, long k, long group,                  \
                                    const float *bias) {                                        \
        const int rows = R, panels = P; /* what Q4STEP reads */                                \
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
                    _mm_prefetch((const char *)at[q] + Q8_AHEAD, _MM_HINT_T0);                  \
                }                                                                               \
                __m256 xr[R];                                                                   \
                Q4STEP(0, NIB(0), 0x1p-0f)                                                      \
                Q4STEP(1, NIB(1), 0x1p-4f)                                                      \
                Q4STEP(2, NIB(2), 0x1p-8f)                                                      \
                Q4STEP(3, NIB(3), 0x1p-12f)                                                     \
                Q4STEP(4, NIB(4), 0x1p-16f)                                                     \
                Q4STEP(5, NIB(5), 0x1p-20f)                                                     \
                Q4STEP(6, NIB(6), 0x1p-24f)                                                     \
                Q4STEP(7, _mm256_srli_epi32(word, 28), 1.0f)                                    \
            }                                                                                   \
            for (int r = 0; r < R; r++) {                                                       \
                float sum = group_sum(x + r * k + g * group, group);                            \
                __m256 shift = _mm256_set1_ps(8.0f * sum); /* u = q + 8 */                      \
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
Q4KERNEL(1, 2)
Q4KERNEL(2, 1)
#undef Q4STEP
#undef NIB

BLOCK(int4_block, FORMAT_INT4, q4_2_1, q4_1_2, k * PANEL / 2, k / group * PANEL * sizeof(uint16_t))

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
                    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                     \
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

/* Inputs [i0, i0 + n) of a 64-column block (two panels from p) as float32 into w [n][64], each
   weight as the row kernels multiply it: int8 q; int4 u * 2^(4 (i % 8)), x being scaled to match;
   FP8 its value * 2^-8 */
F8TARGET static void decode(int format, const void *p, long k, long i0, long n, float *w) {
    for (int q = 0; q < 2; q++)
        for (long i = i0; i < i0 + n; i++) {
            float *row = w + (i - i0) * 64 + q * 32;
            if (format == FORMAT_INT8) {
                const int8_t *at = (const int8_t *)p + (q * k + i) * PANEL;
                for (int j = 0; j < 4; j++)
                    _mm256_storeu_ps(row + 8 * j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                      _mm_loadl_epi64((const __m128i *)(at + 8 * j)))));
            } else if (format == FORMAT_INT4) {
                const uint32_t *at = (const uint32_t *)p + (q * k + i / 8 * 8) * 4;
                int shift = 4 * (int)(i % 8);
                __m256i mask = _mm256_set1_epi32(15 << shift), low = _mm256_set1_epi32(15);
                for (int j = 0; j < 4; j++) {
                    __m256i words = _mm256_loadu_si256((const __m256i *)at + j);
                    __m256i nibble = shift == 28 ? _mm256_and_si256(_mm256_srli_epi32(words, 28), low)
                                                 : _mm256_and_si256(words, mask);
                    _mm256_storeu_ps(row + 8 * j, _mm256_cvtepi32_ps(nibble));
                }
            } else {
                const uint8_t *at = (const uint8_t *)p + (q * k + i) * PANEL;
                __m128i zero = _mm_setzero_si128();
                __m128i lo = _mm_loadu_si128((const __m128i *)at);
                __m128i hi = _mm_loadu_si128((const __m128i *)at + 1);
                _mm256_storeu_ps(row, f8_widen(_mm_unpacklo_epi8(zero, lo)));
                _mm256_storeu_ps(row + 8, f8_widen(_mm_unpackhi_epi8(zero, lo)));
                _mm256_storeu_ps(row + 16, f8_widen(_mm_unpacklo_epi8(zero, hi)));
                _mm256_storeu_ps(row + 24, f8_widen(_mm_unpackhi_epi8(zero, hi)));
            }
        }
}

/* m rows of x [m][k] against a 64-column block of `format`, the weights decoded a group (int8:
   64 inputs) at a time, each row then summing its products from there: the arithmetic of the row
   kernels above, step for step. */
TARGET static void many_rows(int format, const float *x, const void *p, const void *s, uint16_t *y,
                             long ldy, long m, long k, long group, const float *bias) {
    float w[128 * 64] __attribute__((aligned(32))); /* a group of at most 128 inputs */
    long chunk = format == FORMAT_INT8 ? 64 : group; /* int4, FP8: group divides k */
    float *total = calloc(m * 64, sizeof(float)); /* int8: the running sums */
    /* int4: x scaled as Q4STEP scales it (the top nibble is shifted down, not scaled) */
    static const float shifts[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
    static const float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    const float *unit = format == FORMAT_INT4 ? shifts : ones;
    if (!total) { /* no memory for the sums: the row kernels need none */
        for (long r = 0; r < m; r += MANY_ROWS - 1) {
            long rows = m - r < MANY_ROWS - 1 ? m - r : MANY_ROWS - 1;
            (format == FORMAT_INT8   ? int8_block
             : format == FORMAT_INT4 ? int4_block
                                     : fp8_block)(x + r * k, p, s, y + r * ldy, ldy, rows, k,
                                                  group, bias);
        }
        return;
    }
    for (long g = 0; g * chunk < k; g++) {
        long n = k - g * chunk < chunk ? k - g * chunk : chunk;
        decode(format, p, k, g * chunk, n, w);
        for (long r = 0; r < m; r++) {
            const float *xr = x + r * k + g * chunk;
            float *t = total + r * 64;
            __m256 acc[8];
            for (int j = 0; j < 8; j++)
                acc[j] = format == FORMAT_INT8 ? _mm256_loadu_ps(t + 8 * j) : _mm256_setzero_ps();
            for (long i = 0; i < n; i++) {
                __m256 b = _mm256_set1_ps(xr[i] * unit[i % 8]);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + i * 64 + 8 * j), acc[j]);
            }
            if (format == FORMAT_INT8) {
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(t + 8 * j, acc[j]);
                continue;
            }
            float sum = format == FORMAT_INT4 ? group_sum(xr, n) : 0.0f;
            for (int j = 0; j < 8; j++) {
                long q = j / 4, groups_k = k / group;
                __m256 scale, a = acc[j];
                if (format == FORMAT_INT4) {
                    const uint16_t *sc = (const uint16_t *)s + (q * groups_k + g) * PANEL + (j % 4) * 8;
                    scale = widen8(_mm_loadu_si128((const __m128i *)sc));
                    a = _mm256_sub_ps(a, _mm256_set1_ps(8.0f * sum));
                } else {
                    scale = _mm256_set1_ps(((const float *)s)[q * groups_k + g] * 256.0f);
                }
                _mm256_storeu_ps(t + 8 * j, _mm256_fmadd_ps(scale, a, _mm256_loadu_ps(t + 8 * j)));
            }
        }
    }
    for (long r = 0; r < m; r++)
        for (int j = 0; j < 4; j++) {
            vec v = vloadf(total + r * 64 + 16 * j);
            if (format == FORMAT_INT8) v = vmul(v, vloadf((const float *)s + 16 * j));
            if (bias) v = vadd(v, vloadf(bias + 16 * j));
            vstore_bf16(y + r * ldy + 16 * j, v);
        }
    free(total);
}

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
