/* int8, MXFP4 and FP8 products in AVX-512 (int4's, and int8's on VNNI and VBMI: int_dot.c), for
   bf16_kernel.c, which includes this file after quant_kernel.c in its AVX2 pass: one-row kernels
   (pick_block takes these blocks where the CPU has AVX-512) and many_rows' tiles (wide_tiles).

   A decode step at batch 1 reads each weight once, and the AVX2 row kernels convert a weight a
   lane on 8 lanes: on a 2-core AMX host int4's read 11 GB/s of weights where int8's read 23 and
   the host 30. These do a column's arithmetic on 16 lanes instead of 8 and nothing else: each
   column's sums, products and roundings are quant_kernel.c's row kernels' (the same scaled x,
   the same codes, the same group_sum, in the same order), so a row's bits do not depend on which
   kernel computed it, nor on the CPU. */

#define Q512TARGET __attribute__((target("avx512f,avx512bw,avx2,fma")))

/* 64 columns (two panels, 2 vectors each) of one row into y, the scaled totals rounded once */
Q512TARGET static inline void store_row512(const __m512 total[4], uint16_t *y,
                                           const float *bias) {
    for (int j = 0; j < 4; j++) {
        __m512 v = bias ? _mm512_add_ps(total[j], _mm512_loadu_ps(bias + j * 16)) : total[j];
        vstore_bf16_avx512(y + j * 16, v);
    }
}

/* int8: per input, each panel's 32 bytes as two vectors of 16 columns */
Q512TARGET static void q8_row512(const float *x, const int8_t *p, const float *s, uint16_t *y,
                                 long k, const float *bias) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (long i = 0; i < k; i++) {
        long ahead = ahead_of(i, k, PANEL, ROW_AHEAD, k * PANEL);
        __m512 xr = _mm512_set1_ps(x[i]);
        for (int q = 0; q < 2; q++) {
            const int8_t *at = p + (q * k + i) * PANEL;
            _mm_prefetch((const char *)at + ahead, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(at + 16 * h));
                __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                acc[q * 2 + h] = _mm512_fmadd_ps(xr, w, acc[q * 2 + h]);
            }
        }
    }
    for (int j = 0; j < 4; j++) acc[j] = _mm512_mul_ps(acc[j], _mm512_loadu_ps(s + j * 16));
    store_row512(acc, y, bias);
}

/* MXFP4: nibble N of a vector of words (16 columns) as a float, as MXF_SHIFTED (the odd nibbles
   from words shifted down a nibble, once per 8 inputs) */
#define MXF512(word, N)                                                                         \
    _mm512_cvtepi32_ps(_mm512_shuffle_epi8(                                                    \
        _mm512_broadcast_i32x4(_mm256_castsi256_si128(MX_TABLE)),                              \
        _mm512_and_si512(word, _mm512_set1_epi32(15 << (8 * (N / 2))))))
#define STEP512(N, F, SHIFT, ODD)                                                               \
    {                                                                                           \
        __m512 xr = _mm512_set1_ps(x[i + N] * SHIFT(N));                                        \
        for (int j = 0; j < 4; j++)                                                             \
            acc[j] = _mm512_fmadd_ps(xr, F((ODD && N % 2 ? odd[j] : word[j]), N), acc[j]);     \
    }

/* one row against the two panels of a 64-column block, as NIBBLE_KERNEL's NAME_1_2: per group,
   a = sum of x * weight in order, then s * (a - ZERO sum(x)) added to the column's total */
#define NIBBLE_ROW512(NAME, F, SHIFT, ZERO, ODD)                                                \
    Q512TARGET static void NAME(const float *x, const uint32_t *p, const uint16_t *s,           \
                                uint16_t *y, long k, long group, const float *bias) {           \
        long groups = k / group;                                                                \
        __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),       \
                           _mm512_setzero_ps()};                                                \
        for (long g = 0; g < groups; g++) {                                                     \
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),     \
                             _mm512_setzero_ps()};                                              \
            for (long i = g * group; i < (g + 1) * group; i += 8) {                             \
                long ahead = ahead_of(i, k, 16, ROW_AHEAD, k * 16);                             \
                __m512i word[4], odd[4]; /* a panel's 32 words: columns 0-15, then 16-31 */     \
                for (int q = 0; q < 2; q++) {                                                   \
                    const uint32_t *at = p + (q * k + i) * 4;                                   \
                    _mm_prefetch((const char *)at + ahead, _MM_HINT_T0);                        \
                    _mm_prefetch((const char *)at + ahead + 64, _MM_HINT_T0);                   \
                    word[q * 2] = _mm512_loadu_si512(at);                                       \
                    word[q * 2 + 1] = _mm512_loadu_si512(at + 16);                              \
                }                                                                               \
                for (int j = 0; j < 4 && ODD; j++) odd[j] = _mm512_srli_epi32(word[j], 4);      \
                STEP512(0, F, SHIFT, ODD) STEP512(1, F, SHIFT, ODD)                             \
                STEP512(2, F, SHIFT, ODD) STEP512(3, F, SHIFT, ODD)                             \
                STEP512(4, F, SHIFT, ODD) STEP512(5, F, SHIFT, ODD)                             \
                STEP512(6, F, SHIFT, ODD) STEP512(7, F, SHIFT, ODD)                             \
            }                                                                                   \
            __m512 shift = _mm512_set1_ps(ZERO * group_sum(x + g * group, group));              \
            for (int j = 0; j < 4; j++) {                                                       \
                const uint16_t *sc = s + ((j / 2) * groups + g) * PANEL + (j % 2) * 16;         \
                __m512 scale = vwiden_avx512(_mm256_loadu_si256((const __m256i *)sc));          \
                total[j] = _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[j], shift), total[j]);      \
            }                                                                                   \
        }                                                                                       \
        store_row512(total, y, bias);                                                           \
    }
NIBBLE_ROW512(mx_row512, MXF512, MXSHIFT, 12.0f, 1)
#undef NIBBLE_ROW512
#undef STEP512

/* int8_block and mxfp4_block with their one-row products on these */
Q512TARGET static void int8_block512(const float *x, const void *p, const void *s, uint16_t *y,
                                     long ldy, long m, long k, long group, const float *bias) {
    if (m != 1) return int8_block(x, p, s, y, ldy, m, k, group, bias);
    q8_row512(x, p, s, y, k, bias);
}
Q512TARGET static void mxfp4_block512(const float *x, const void *p, const void *s, uint16_t *y,
                                      long ldy, long m, long k, long group, const float *bias) {
    if (m != 1) return mxfp4_block(x, p, s, y, ldy, m, k, group, bias);
    mx_row512(x, p, s, y, k, group, bias);
}

/* many_rows' tiles (quant_kernel.c's TILE) on 16 lanes: R rows of x (row stride ldx, nibble
   formats' x scaled by the caller) against 16 columns of a panel over n inputs, each sum from
   `from` (row stride 64; zero without it) on in input order, to `to`. A column's arithmetic is
   the AVX2 tile's; one weight vector, converted once, serves up to WIDE_ROWS rows where AVX2's
   registers held 6. */
#define TILE512(NAME, R, STEP, WEIGHTS)                                                          \
    Q512TARGET static void NAME##_##R(const float *x, long ldx, const void *p, long n,          \
                                      const float *from, float *to) {                           \
        const int rows = R; /* what FMA512 reads */                                            \
        __m512 a[R];                                                                            \
        for (int r = 0; r < R; r++)                                                             \
            a[r] = from ? _mm512_loadu_ps(from + r * 64) : _mm512_setzero_ps();                 \
        for (long i0 = 0; i0 < n; i0 += STEP) {                                                 \
            WEIGHTS                                                                             \
        }                                                                                       \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(to + r * 64, a[r]);                        \
    }
#define FMA512(i, w)                                                                            \
    for (int r = 0; r < rows; r++)                                                              \
        a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + (i)]), w, a[r]);
#define Q8_WEIGHTS512                                                                           \
    const int8_t *at = (const int8_t *)p + i0 * PANEL;                                          \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));  \
    FMA512(i0, w)
/* FP8: each byte the top of a half, as f8_widen's */
#define F8_WEIGHTS512                                                                           \
    const uint8_t *at = (const uint8_t *)p + i0 * PANEL;                                        \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    __m128i bytes = _mm_loadu_si128((const __m128i *)at);                                       \
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);                              \
    h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF));           \
    __m512 w = _mm512_cvtph_ps(h);                                                              \
    FMA512(i0, w)
#define NIBBLE512(N, F)                                                                         \
    {                                                                                           \
        __m512 w = F;                                                                           \
        FMA512(i0 + N, w)                                                                       \
    }
#define NIBBLES512(F0, F1, F2, F3, F4, F5, F6, F7)                                              \
    const uint32_t *at = (const uint32_t *)p + i0 / 8 * PANEL;                                  \
    _mm_prefetch((const char *)at + Q8_AHEAD, _MM_HINT_T0);                                     \
    __m512i word = _mm512_loadu_si512(at);                                                      \
    __m512i odd = _mm512_srli_epi32(word, 4); /* MXFP4's odd nibbles */                        \
    NIBBLE512(0, F0) NIBBLE512(1, F1) NIBBLE512(2, F2) NIBBLE512(3, F3)                         \
    NIBBLE512(4, F4) NIBBLE512(5, F5) NIBBLE512(6, F6) NIBBLE512(7, F7)
#define MX_WEIGHTS512                                                                           \
    NIBBLES512(MXF512(word, 0), MXF512(odd, 1), MXF512(word, 2), MXF512(odd, 3),                \
               MXF512(word, 4), MXF512(odd, 5), MXF512(word, 6), MXF512(odd, 7))
#define TILES512(NAME, STEP, WEIGHTS)                                                           \
    TILE512(NAME, 1, STEP, WEIGHTS) TILE512(NAME, 2, STEP, WEIGHTS)                             \
    TILE512(NAME, 3, STEP, WEIGHTS) TILE512(NAME, 4, STEP, WEIGHTS)                             \
    TILE512(NAME, 5, STEP, WEIGHTS) TILE512(NAME, 6, STEP, WEIGHTS)                             \
    TILE512(NAME, 7, STEP, WEIGHTS) TILE512(NAME, 8, STEP, WEIGHTS)                             \
    TILE512(NAME, 9, STEP, WEIGHTS) TILE512(NAME, 10, STEP, WEIGHTS)                            \
    TILE512(NAME, 11, STEP, WEIGHTS) TILE512(NAME, 12, STEP, WEIGHTS)                           \
    static const tile_fn NAME[WIDE_ROWS + 1] = {                                                \
        0,         NAME##_1, NAME##_2, NAME##_3,  NAME##_4,  NAME##_5,  NAME##_6,              \
        NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11, NAME##_12};
TILES512(q8_tiles512, 1, Q8_WEIGHTS512)
TILES512(f8_tiles512, 1, F8_WEIGHTS512)
TILES512(mx_tiles512, 8, MX_WEIGHTS512)

static const tile_fn *wide_tiles(int format) {
    return format == FORMAT_INT8    ? q8_tiles512
           : format == FORMAT_MXFP4 ? mx_tiles512
                                    : f8_tiles512;
}
#undef TILES512
#undef TILE512
#undef FMA512
#undef Q8_WEIGHTS512
#undef F8_WEIGHTS512
#undef NIBBLE512
#undef NIBBLES512
#undef MX_WEIGHTS512
#undef MXF512
#undef WIDE_ROWS
