/* int4 and int8 products as integer dot products, for bf16_kernel.c, which includes this file
   after quant_avx512.c in its AVX2 pass.

   Converting each weight to float and multiplying it in costs a conversion and a multiply-add
   (int4: and an AND) for 16 weights: on a 2-core AMX host that held one-row int4 products below
   what memory gives two cores, and int8's at it only while the cores gave their most. Here the
   inputs are made integers instead, once per row (q4_prepare, q8_prepare), and the weights stay
   bytes.

   A group's inputs become multiples of 2^(e - 22), e the exponent of the group's largest
   magnitude (|x| < 2^e), rounded to the nearest: N = x * 2^(22 - e), |N| <= 2^22, exact for a
   bfloat16 input at most 2^14 times smaller than that largest one (the rest rounded to within
   2^-22 of it, about what a float32 sum of the products rounds away anyway; a group whose
   largest input is below 2^-100 is held on 2^-122's grid). int4's groups are its scales'; int8,
   one scale a column, takes groups of q8_group(k) inputs.
   Each N is split into three signed bytes, N = b0 + 2^8 b1 + 2^16 b2. Per group, column and
   digit d, T_d = sum of b_d * q over the group's inputs is an exact int32 however it is summed:
   sum(b_d * u) by byte products, u = q + Z the weight as an unsigned byte (int4: the stored
   nibble, Z = 8; int8: the byte's sign bit flipped, Z = 128), started at the offset -Z sum(b_d).
   Then, each step a float32 operation rounded once: a = T_1 * 2^8 + T_0, a = T_2 * 2^16 + a, a *
   2^(e - 22), added to the column's total, groups in order (int4: times the group's scale; int8:
   the total times the column's scale at the end).

   int4: VNNI's vpdpbusd (64 byte products an instruction) or AVX2's vpmaddubsw and vpmaddwd, and
   as the integer sums are exact, each kernel gives a row the same bits, independent of its
   batch-mates and of the CPU. On that host (VNNI), a one-row product from L2 read 1.5x the float
   kernel's weights a second, and a decode step's int4 weights stream at bfloat16's share of the
   bandwidth (docs/performance.md, host C, stop 65).

   int8: VNNI only, where the CPU also has VBMI's two-table byte permute (vpermt2b) to gather a
   column's 4 inputs from int8's panels, which hold 32 columns of one input together; the AVX2
   equivalent (vpmaddubsw saturates at int8's products, so 7-bit digits, and four unpacks per 128
   weights) would cost the float kernel's work or more. Every int8 kernel on such a CPU (1 or 2
   rows) gives a row the same bits, independent of its batch-mates; they differ in the last bits
   from the float kernels other CPUs run (moe_bf16_limit(2) runs those here). */

#define DOT_HEADER 16 /* a group's: the unit 2^(e - 22), float; the offsets -Z sum(b_d), 3 int32 */

static long dot_group_bytes(long group) { return DOT_HEADER + 3 * group; }

static inline int32_t dot_word(const char *p) { /* the prepared bytes, read as they were written */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot_unit(const char *head) {
    float v;
    memcpy(&v, head, sizeof v);
    return v;
}

/* Groups g0 to g1 of a row x [k] prepared for the products below into the row `out` (x's own
   place, or another k floats long): group g at byte g * dot_group_bytes, its header, then per 8
   inputs 24 bytes in two halves of four inputs, each half digit 0's four bytes, 1's, then 2's.
   int4's halves are inputs 0, 2, 4, 6 and 1, 3, 5, 7 (a column's word's low nibbles, then its
   high ones: `order`), int8's 0-3 and 4-7; `zero` is their Z. In place, a group's bytes end
   where the next group's floats begin at the latest (groups hold 32 inputs or more), and are
   written once its floats are read. A group holding a NaN or an infinity gets a NaN unit, so its
   columns come out NaN. */
TARGET static inline void dot_prepare_groups(const float *x, char *out, long g0, long g1,
                                             long group, __m256i order, int zero) {
    /* each lane's low byte into the low 4 bytes of its half */
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           -1, -1);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int8_t digits[3 * 128]; /* the callers take groups of 32, 64 and 128 (dot_groups) */
    for (long g = g0; g < g1; g++) {
        const float *v = x + g * group;
        __m256 top = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (long i = 0; i < group; i += 8) {
            __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude);
            /* NaN compares false */
            __m256 bounded = _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ);
            finite = _mm256_and_ps(finite, bounded);
            top = _mm256_max_ps(top, a);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
        int ok = _mm256_movemask_ps(finite) == 0xFF, e = 0;
        frexpf(_mm_cvtss_f32(t), &e);
        e = e < -100 ? -100 : e; /* 2^(22 - e) finite: tinier groups on 2^-122's grid */
        __m256 up = _mm256_set1_ps(ok ? ldexpf(1.0f, 22 - e) : 0.0f);
        __m256i sum[3] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (long i = 0; i < group; i += 8) {
            /* N to the nearest, split into b0 + 2^8 b1 + 2^16 b2, each a signed byte */
            __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), up));
            n = _mm256_permutevar8x32_epi32(n, order);
            __m256i d[3];
            d[0] = _mm256_srai_epi32(_mm256_slli_epi32(n, 24), 24);
            __m256i n1 = _mm256_srai_epi32(_mm256_sub_epi32(n, d[0]), 8);
            d[1] = _mm256_srai_epi32(_mm256_slli_epi32(n1, 24), 24);
            d[2] = _mm256_srai_epi32(_mm256_sub_epi32(n1, d[1]), 8);
            for (int j = 0; j < 3; j++) {
                sum[j] = _mm256_add_epi32(sum[j], d[j]);
                __m256i b = _mm256_shuffle_epi8(d[j], bytes);
                int32_t low = _mm256_extract_epi32(b, 0), high = _mm256_extract_epi32(b, 4);
                memcpy(digits + i * 3 + 4 * j, &low, 4);
                memcpy(digits + i * 3 + 12 + 4 * j, &high, 4);
            }
        }
        int32_t head[4];
        float unit = ok ? ldexpf(1.0f, e - 22) : NAN;
        memcpy(head, &unit, sizeof unit);
        for (int j = 0; j < 3; j++) {
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum[j]),
                                      _mm256_extracti128_si256(sum[j], 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            head[1 + j] = -zero * _mm_cvtsi128_si32(h);
        }
        char *at = out + g * dot_group_bytes(group);
        memcpy(at, head, DOT_HEADER);
        memcpy(at + DOT_HEADER, digits, 3 * group);
    }
}

/* Groups other than 32, 64 and 128 are left unprepared (common/quant.py admits no other;
   q8_group picks no other): digits[] holds 128 */
static int dot_groups(long k, long group) {
    return group >= 32 && group <= 128 && group % 8 == 0 && k % group == 0;
}

/* Inputs c0 to c0 + width of row x [k], whole groups, prepared for int4's products into row out
   (k floats long; x itself for in place): threads that each hold some of a row's inputs prepare
   their own (decode_kernel.c) */
TARGET static void q4_prepare_span(const float *x, float *out, long k, long group, long c0,
                                   long width) {
    if (dot_groups(k, group))
        dot_prepare_groups(x, (char *)out, c0 / group, (c0 + width) / group, group,
                           _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), 8);
}

/* Rows x [m][k] prepared in place, each still k floats apart */
TARGET static void q4_prepare(float *x, long m, long k, long group) {
    for (long r = 0; r < m; r++) q4_prepare_span(x + r * k, x + r * k, k, group, 0, k);
}

/* a, the group's T_0..T_2 combined as the top comment says, times `unit` */
#define DOT_COMBINE(CVT, FMA, MUL, SET, T0, T1, T2, UNIT)                                       \
    MUL(FMA(CVT(T2), SET(65536.0f), FMA(CVT(T1), SET(256.0f), CVT(T0))), UNIT)

/* AVX2: two steps' words (w0, then w1 8 inputs on) as their low and high nibbles, bytes */
typedef struct {
    __m256i lo0, hi0, lo1, hi1;
} q4_nibbles;

TARGET static inline q4_nibbles q4_unpack(__m256i w0, __m256i w1) {
    const __m256i low = _mm256_set1_epi8(15);
    return (q4_nibbles){_mm256_and_si256(w0, low), _mm256_and_si256(_mm256_srli_epi16(w0, 4), low),
                        _mm256_and_si256(w1, low), _mm256_and_si256(_mm256_srli_epi16(w1, 4), low)};
}

/* digit d's byte products of those two steps with the digits at x (the first step's), summed per
   column in int32: summed in 16 bits first (|each sum| <= 4 * 2 * 15 * 128), then widened */
TARGET static inline __m256i q4_dot(q4_nibbles n, const char *x, int d) {
    __m256i s0 = _mm256_add_epi16(
        _mm256_maddubs_epi16(n.lo0, _mm256_set1_epi32(dot_word(x + 4 * d))),
        _mm256_maddubs_epi16(n.hi0, _mm256_set1_epi32(dot_word(x + 12 + 4 * d))));
    __m256i s1 = _mm256_add_epi16(
        _mm256_maddubs_epi16(n.lo1, _mm256_set1_epi32(dot_word(x + 24 + 4 * d))),
        _mm256_maddubs_epi16(n.hi1, _mm256_set1_epi32(dot_word(x + 36 + 4 * d))));
    return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
}

/* AVX2: one prepared row against one panel (32 columns, 4 vectors of 8 words) into out [32]:
   scales s and weights p of that panel, two steps at a time (q4_dot: 1.1x one at a time from
   L2) */
TARGET static void q4_panel(const char *row, long k, long group, const uint32_t *p,
                            const uint16_t *s, float *out) {
    __m256 total[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
    for (long g = 0; g < k / group; g++) {
        const char *head = row + g * dot_group_bytes(group);
        __m256i acc[3][4];
        for (int d = 0; d < 3; d++)
            for (int j = 0; j < 4; j++) acc[d][j] = _mm256_set1_epi32(dot_word(head + 4 + 4 * d));
        for (long i = g * group; i < (g + 1) * group; i += 16) { /* two steps */
            const __m256i *at = (const __m256i *)(p + i * 4);
            const char *x = head + DOT_HEADER + (i - g * group) * 3;
            for (int t = 0; t < 2; t++) {
                _mm_prefetch((const char *)(at + 4 * t) + ROW_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)(at + 4 * t) + ROW_AHEAD + 64, _MM_HINT_T0);
            }
            for (int j = 0; j < 4; j++) {
                __m256i w0 = _mm256_loadu_si256(at + j), w1 = _mm256_loadu_si256(at + 4 + j);
                q4_nibbles n = q4_unpack(w0, w1);
                for (int d = 0; d < 3; d++)
                    acc[d][j] = _mm256_add_epi32(acc[d][j], q4_dot(n, x, d));
            }
        }
        __m256 unit = _mm256_set1_ps(dot_unit(head));
        for (int j = 0; j < 4; j++) {
            __m256 a = DOT_COMBINE(_mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_mul_ps,
                                  _mm256_set1_ps, acc[0][j], acc[1][j], acc[2][j], unit);
            __m256 scale = widen8(_mm_loadu_si128((const __m128i *)(s + g * PANEL + j * 8)));
            total[j] = _mm256_fmadd_ps(scale, a, total[j]);
        }
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, total[j]);
}

/* AVX2, 2 prepared rows (k floats apart) against 8 columns (words `col` of each 8 inputs' 32 in a
   panel) into out [2][64] at the columns' place, the nibbles unpacked once for both rows, two
   steps at a time (q4_dot: 1.1x one at a time). The rows' 6 sums and two steps' words fill the 16
   registers (3 rows spilled, as did 4 steps). */
TARGET static void q4_columns_2(const float *x, long k, long group, const uint32_t *p,
                                const uint16_t *s, int col, float *out) {
    enum { R = 2 };
    __m256 total[R];
    for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps();
    for (long g = 0; g < k / group; g++) {
        const char *head[R];
        __m256i acc[R][3];
        for (int r = 0; r < R; r++) {
            head[r] = (const char *)(x + r * k) + g * dot_group_bytes(group);
            for (int d = 0; d < 3; d++)
                acc[r][d] = _mm256_set1_epi32(dot_word(head[r] + 4 + 4 * d));
        }
        for (long i = g * group; i < (g + 1) * group; i += 16) { /* two steps */
            const __m256i *at = (const __m256i *)(p + i * 4) + col;
            q4_nibbles n = q4_unpack(_mm256_loadu_si256(at), _mm256_loadu_si256(at + PANEL / 8));
            long at_x = DOT_HEADER + (i - g * group) * 3;
            for (int r = 0; r < R; r++)
                for (int d = 0; d < 3; d++)
                    acc[r][d] = _mm256_add_epi32(acc[r][d], q4_dot(n, head[r] + at_x, d));
        }
        __m256 scale = widen8(_mm_loadu_si128((const __m128i *)(s + g * PANEL + col * 8)));
        for (int r = 0; r < R; r++) {
            __m256 unit = _mm256_set1_ps(dot_unit(head[r]));
            __m256 a = DOT_COMBINE(_mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_mul_ps,
                                  _mm256_set1_ps, acc[r][0], acc[r][1], acc[r][2], unit);
            total[r] = _mm256_fmadd_ps(scale, a, total[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * 64, total[r]);
}

/* int4's block_fn: x its m rows prepared (q4_prepare), k floats apart. One row streams both
   panels (q4_panel); more go 2 rows at a time, 8 columns at a time. */
TARGET static void int4_block(const float *x, const void *p, const void *s, uint16_t *y, long ldy,
                              long m, long k, long group, const float *bias) {
    float out[2 * 64];
    for (long r0 = 0, rows; r0 < m; r0 += rows) {
        rows = m - r0 >= 2 ? 2 : 1;
        const float *xr = x + r0 * k;
        for (int q = 0; q < 2; q++) {
            const uint32_t *panel = (const uint32_t *)p + q * k * 4;
            const uint16_t *scales = (const uint16_t *)s + q * (k / group) * PANEL;
            for (int c = 0; c < 4 && rows > 1; c++)
                q4_columns_2(xr, k, group, panel, scales, c, out + q * 32 + c * 8);
            if (rows == 1) q4_panel((const char *)xr, k, group, panel, scales, out + q * 32);
        }
        for (long r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) {
                vec v = vloadf(out + r * 64 + 16 * j);
                if (bias) v = vadd(v, vloadf(bias + 16 * j));
                vstore_bf16(y + (r0 + r) * ldy + 16 * j, v);
            }
    }
}

#define Q4VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

static int vnni(void) { return avx512() && __builtin_cpu_supports("avx512vnni"); }

/* Bytes of a panel the VNNI kernels prefetch ahead: as the bfloat16 kernels' AHEAD, where the AVX2
   row kernels' ROW_AHEAD is 8192. On host C (docs/performance.md, stop 66) a Qwen3-slice decode
   with every layer in int8 ran 99.2 tok/s against 95.6 with 8192 (six alternations), int4 199.2
   against 194.1 (three). */
#define DOT_AHEAD 2048

/* acc + the byte products of u (unsigned) and b (signed), as _mm512_dpbusd_epi32; written out
   because around the intrinsic GCC copied each accumulator out and back every step (int8: 12
   moves beside 6 vpdpbusd, a one-row product from L2 1.3x slower) */
Q4VNNI static inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(b));
    return acc;
}

/* VNNI: group g's header in each of R prepared rows (k floats apart), and each digit's sums of 4
   vectors of 16 columns started at its offset */
#define DOT_START512(R, x, k, g, group, head, acc)                                              \
    for (int r = 0; r < R; r++) {                                                               \
        head[r] = (const char *)(x + r * k) + g * dot_group_bytes(group);                       \
        for (int d = 0; d < 3; d++)                                                             \
            for (int j = 0; j < 4; j++)                                                         \
                acc[r][d][j] = _mm512_set1_epi32(dot_word(head[r] + 4 + 4 * d));                \
    }

/* VNNI: R prepared rows (k floats apart) against both panels of a 64-column block, the nibbles
   of 16 columns unpacked once for the R rows */
#define Q4_ROWS512(R)                                                                           \
    Q4VNNI static void q4_rows512_##R(const float *x, long k, const uint32_t *p,               \
                                      const uint16_t *s, uint16_t *y, long ldy, long group,    \
                                      const float *bias) {                                      \
        const __m512i low = _mm512_set1_epi8(15);                                               \
        long groups = k / group;                                                                \
        __m512 total[R][4];                                                                     \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4; j++) total[r][j] = _mm512_setzero_ps();                      \
        for (long g = 0; g < groups; g++) {                                                     \
            const char *head[R];                                                                \
            __m512i acc[R][3][4];                                                               \
            DOT_START512(R, x, k, g, group, head, acc)                                          \
            for (long i = g * group; i < (g + 1) * group; i += 8) {                             \
                long ahead = ahead_of(i, k, 16, DOT_AHEAD, k * 16);                             \
                long at_x = DOT_HEADER + (i - g * group) * 3;                                   \
                for (int q = 0; q < 2; q++) {                                                   \
                    const uint32_t *at = p + (q * k + i) * 4;                                   \
                    _mm_prefetch((const char *)at + ahead, _MM_HINT_T0);                        \
                    _mm_prefetch((const char *)at + ahead + 64, _MM_HINT_T0);                   \
                    for (int h = 0; h < 2; h++) { /* columns 0-15 of the panel, then 16-31 */   \
                        __m512i w = _mm512_loadu_si512(at + 16 * h);                            \
                        __m512i lo = _mm512_and_si512(w, low);                                  \
                        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);            \
                        for (int r = 0; r < R; r++) {                                           \
                            const char *xd = head[r] + at_x;                                    \
                            for (int d = 0; d < 3; d++) {                                       \
                                __m512i *a = &acc[r][d][q * 2 + h];                             \
                                __m512i b0 = _mm512_set1_epi32(dot_word(xd + 4 * d));           \
                                __m512i b1 = _mm512_set1_epi32(dot_word(xd + 12 + 4 * d));      \
                                *a = dpbusd512(dpbusd512(*a, lo, b0), hi, b1);                  \
                            }                                                                   \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int r = 0; r < R; r++) {                                                       \
                __m512 unit = _mm512_set1_ps(dot_unit(head[r]));                                \
                for (int j = 0; j < 4; j++) {                                                   \
                    __m512 a = DOT_COMBINE(_mm512_cvtepi32_ps, _mm512_fmadd_ps, _mm512_mul_ps,  \
                                          _mm512_set1_ps, acc[r][0][j], acc[r][1][j],           \
                                          acc[r][2][j], unit);                                  \
                    const uint16_t *sc = s + ((j / 2) * groups + g) * PANEL + (j % 2) * 16;     \
                    __m512 scale = vwiden_avx512(_mm256_loadu_si256((const __m256i *)sc));      \
                    total[r][j] = _mm512_fmadd_ps(scale, a, total[r][j]);                       \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++) store_row512(total[r], y + r * ldy, bias);                  \
    }
Q4_ROWS512(1)
Q4_ROWS512(2)
#undef Q4_ROWS512

/* int4_block on VNNI: rows in pairs, a last odd one alone */
Q4VNNI static void int4_block512(const float *x, const void *p, const void *s, uint16_t *y,
                                 long ldy, long m, long k, long group, const float *bias) {
    long r = 0;
    for (; r + 1 < m; r += 2)
        q4_rows512_2(x + r * k, k, p, s, y + r * ldy, ldy, group, bias);
    if (r < m) q4_rows512_1(x + r * k, k, p, s, y + r * ldy, ldy, group, bias);
}

/* int8: the input groups, the largest of 128, 64 and 32 inputs dividing k; 0, none */
static long q8_group(long k) {
    return k % 128 == 0 ? 128 : k % 64 == 0 ? 64 : k % 32 == 0 ? 32 : 0;
}

/* int8's products are integer dot products here: the CPU has VNNI and VBMI, the level allows
   (moe_bf16_limit(2) holds int8 to the float kernels, which give AVX2's bits) and k has groups */
static int q8_dot(long k) {
    return level_cap >= 3 && vnni() && __builtin_cpu_supports("avx512vbmi") && q8_group(k);
}

/* q8_dot, for tests: whose bits int8's products of k inputs give here */
int moe_int8_dot(long k) { return q8_dot(k); }

/* int8's q4_prepare_span, where its products are integer dot products (q8_dot) */
TARGET static void q8_prepare_span(const float *x, float *out, long k, long c0, long width) {
    long group = q8_group(k);
    if (q8_dot(k))
        dot_prepare_groups(x, (char *)out, c0 / group, (c0 + width) / group, group,
                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), 128);
}

TARGET static void q8_prepare(float *x, long m, long k) {
    for (long r = 0; r < m; r++) q8_prepare_span(x + r * k, x + r * k, k, 0, k);
}

#define Q8DOT __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma")))

/* VNNI: R prepared rows (k floats apart) against both int8 panels of a 64-column block (p; scales
   s), each panel's 4 inputs' 128 bytes gathered once for the R rows into two vectors of 16
   columns whose byte 4c + j is input j's of column c (vpermt2b), their sign bits flipped (u = q +
   128). Both panels stream at once, as quant_avx512.c's row kernels read them: a panel at a time
   read 64 MiB of weights at one row 0.8x as fast on two threads. */
#define Q8_ROWS512(R)                                                                           \
    Q8DOT static void q8_rows512_##R(const float *x, long k, const int8_t *p, const float *s,  \
                                     uint16_t *y, long ldy, const float *bias) {                \
        long group = q8_group(k);                                                               \
        /* byte 4c + j: 32j + c (dword c: 0x60402000 + c * 0x01010101), then those + 16 */      \
        const __m512i first = _mm512_add_epi32(                                                 \
            _mm512_set1_epi32(0x60402000),                                                      \
            _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, \
                                                 14, 15),                                       \
                               _mm512_set1_epi32(0x01010101)));                                 \
        const __m512i gather[2] = {first, _mm512_add_epi8(first, _mm512_set1_epi8(16))};        \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                      \
        __m512 total[R][4];                                                                     \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4; j++) total[r][j] = _mm512_setzero_ps();                      \
        for (long g = 0; g < k / group; g++) {                                                  \
            const char *head[R];                                                                \
            __m512i acc[R][3][4];                                                               \
            DOT_START512(R, x, k, g, group, head, acc)                                          \
            for (long i = g * group; i < (g + 1) * group; i += 4) {                             \
                long ahead = ahead_of(i, k, PANEL, DOT_AHEAD, k * PANEL);                       \
                long at_x = DOT_HEADER + (i - g * group) / 8 * 24 + (i % 8 ? 12 : 0);           \
                __m512i w[4];                                                                   \
                for (int q = 0; q < 2; q++) {                                                   \
                    const int8_t *at = p + (q * k + i) * PANEL;                                 \
                    _mm_prefetch((const char *)at + ahead, _MM_HINT_T0);                        \
                    _mm_prefetch((const char *)at + ahead + 64, _MM_HINT_T0);                   \
                    __m512i two = _mm512_loadu_si512(at), next = _mm512_loadu_si512(at + 64);   \
                    for (int h = 0; h < 2; h++)                                                 \
                        w[2 * q + h] = _mm512_xor_si512(                                        \
                            _mm512_permutex2var_epi8(two, gather[h], next), flip);              \
                }                                                                               \
                for (int r = 0; r < R; r++)                                                     \
                    for (int d = 0; d < 3; d++) {                                               \
                        __m512i b = _mm512_set1_epi32(dot_word(head[r] + at_x + 4 * d));        \
                        for (int j = 0; j < 4; j++)                                             \
                            acc[r][d][j] = dpbusd512(acc[r][d][j], w[j], b);                    \
                    }                                                                           \
            }                                                                                   \
            for (int r = 0; r < R; r++) {                                                       \
                __m512 unit = _mm512_set1_ps(dot_unit(head[r]));                                \
                for (int j = 0; j < 4; j++)                                                     \
                    total[r][j] = _mm512_add_ps(                                                \
                        total[r][j],                                                            \
                        DOT_COMBINE(_mm512_cvtepi32_ps, _mm512_fmadd_ps, _mm512_mul_ps,         \
                                   _mm512_set1_ps, acc[r][0][j], acc[r][1][j], acc[r][2][j],    \
                                   unit));                                                      \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++) {                                                           \
            for (int j = 0; j < 4; j++)                                                         \
                total[r][j] = _mm512_mul_ps(total[r][j], _mm512_loadu_ps(s + 16 * j));          \
            store_row512(total[r], y + r * ldy, bias);                                          \
        }                                                                                       \
    }
Q8_ROWS512(1)
Q8_ROWS512(2)
#undef Q8_ROWS512

/* int8's block_fn where the CPU has AVX-512: x prepared (q8_prepare) where q8_dot(k), its rows
   in pairs and a last odd one alone; else quant_avx512.c's float kernels. AVX-512F's target, not
   Q8DOT's: on a CPU without VNNI or VBMI the float kernels run from here, and GCC may inline them
   with the instructions its target allows. */
Q512TARGET static void int8_block_dot512(const float *x, const void *p, const void *s,
                                         uint16_t *y, long ldy, long m, long k, long group,
                                         const float *bias) {
    if (!q8_dot(k)) return int8_block512(x, p, s, y, ldy, m, k, group, bias);
    long r = 0;
    for (; r + 1 < m; r += 2) q8_rows512_2(x + r * k, k, p, s, y + r * ldy, ldy, bias);
    if (r < m) q8_rows512_1(x + r * k, k, p, s, y + r * ldy, ldy, bias);
}
