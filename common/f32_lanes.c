/* float32 products of 1 and 2-15 rows with the bits MKL's sgemm gives them on AVX-512, for
   bf16_kernel.c, which includes this file in its AVX-512 pass (TARGET, FN).

   Why: float32 must give transformers' tokens, so its products must be F.linear's to the bit,
   and F.linear is MKL's sgemm; but MKL's kernel for a few rows reads 10 GB/s of weights at 8 rows
   on a 2-core AMX host whose one-row products read 20. Probed with FPRev's trick (x all ones,
   w[0] = 2^40, w[j] = -2^40, the rest ones: the output counts the terms added after 0 and j
   met), its sum for an output of a 2-15-row product is 16 lanes, lane l summing
   x[k] * w[k] over k = l mod 16 in order with fused multiply-adds from 0, the lanes' four
   quarters then added as vectors ((q0 + q1) + q2) + q3, and that quarter's lanes as
   (g0 + g1) + (g2 + g3). Every shape tried (k 768 to 14336) and one or two threads summed so;
   common/float32.py checks each shape against F.linear before it relies on these. */

/* the quarters, then their lanes, as MKL adds them */
TARGET static inline float FN(mkl_reduce)(__m512 a) {
    __m128 q = _mm_add_ps(_mm512_extractf32x4_ps(a, 0), _mm512_extractf32x4_ps(a, 1));
    q = _mm_add_ps(_mm_add_ps(q, _mm512_extractf32x4_ps(a, 2)), _mm512_extractf32x4_ps(a, 3));
    float g[4];
    _mm_storeu_ps(g, q);
    return (g[0] + g[1]) + (g[2] + g[3]);
}

/* R rows of x [R][k] against J weight rows from w (k apart) into y [R][ldy]; `ahead`, where not
   NULL, the next block's weights, fetched meanwhile (the hardware prefetcher stops at each row's
   page) */
#define LANES16(R, J)                                                                          \
    TARGET static void FN(lanes16_##R##_##J)(const float *x, const float *w, float *y, long ldy, \
                                             long k, const char *ahead) {                      \
        __m512 acc[R][J];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (long i = 0; i < k; i += 16) {                                                     \
            if (ahead)                                                                         \
                for (int l = 0; l < 64 * J; l += 64)                                           \
                    _mm_prefetch(ahead + i * 4 * J + l, _MM_HINT_T0);                          \
            __m512 wv[J];                                                                      \
            for (int j = 0; j < J; j++) wv[j] = _mm512_loadu_ps(w + j * k + i);               \
            for (int r = 0; r < R; r++) {                                                      \
                __m512 xv = _mm512_loadu_ps(x + r * k + i);                                    \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < J; j++) y[r * ldy + j] = FN(mkl_reduce)(acc[r][j]);            \
    }
LANES16(1, 4)
LANES16(2, 4)
LANES16(3, 4)
LANES16(4, 4)
LANES16(5, 4) /* 20 sums and 4 weight vectors of 32 registers */
LANES16(1, 1) /* the weight rows past the last whole block */
#undef LANES16

/* One row (MKL's sgemv) sums in another order, probed the same way and checked bit for bit
   against F.linear at k from 33 to 14336 on one and two threads: x[0] * w[0], rounded, starts
   lane 0; 16 lanes take inputs 1 to 16 m (m = (k - 1) / 16) with fused multiply-adds; the lanes
   fold in halves (lane l + lane l + 8, then + 4, + 2, + 1); the last (k - 1) % 16 inputs are
   then fused multiply-added onto a vector of that sum in lane 0 and zeros, which folds again. */
TARGET static inline float FN(fold16)(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

/* x [k] against J weight rows from w (k apart) into y (no prefetches: fetching the next block
   ahead, as LANES16 does, read 20-23 GB/s on host C where the hardware's own prefetcher read 27-32,
   MKL's sgemv 26-34) */
#define GEMV16(J)                                                                              \
    TARGET static void FN(gemv16_##J)(const float *x, const float *w, float *y, long k) {      \
        long m = (k - 1) / 16, tail = (k - 1) % 16;                                            \
        __m512 acc[J];                                                                         \
        for (int j = 0; j < J; j++)                                                            \
            acc[j] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(x[0] * w[j * k]));                  \
        for (long t = 0; t < m; t++) {                                                         \
            __m512 xv = _mm512_loadu_ps(x + 1 + 16 * t);                                       \
            for (int j = 0; j < J; j++)                                                        \
                acc[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + j * k + 1 + 16 * t), acc[j]); \
        }                                                                                      \
        __mmask16 last = (__mmask16)((1u << tail) - 1);                                        \
        __m512 xt = _mm512_maskz_loadu_ps(last, x + 1 + 16 * m);                               \
        for (int j = 0; j < J; j++) {                                                          \
            float sum = FN(fold16)(acc[j]);                                                    \
            if (tail)                                                                          \
                sum = FN(fold16)(_mm512_fmadd_ps(                                              \
                    xt, _mm512_maskz_loadu_ps(last, w + j * k + 1 + 16 * m),                   \
                    _mm512_maskz_mov_ps(1, _mm512_set1_ps(sum))));                             \
            y[j] = sum;                                                                        \
        }                                                                                      \
    }
GEMV16(8)
GEMV16(1)
#undef GEMV16

typedef void (*lanes16_fn)(const float *, const float *, float *, long, long, const char *);

/* m rows against the 4 weight rows from w: in groups of at most 5 rows, as even as they go (a
   group reads the block from L1 after the first fetched it) */
TARGET static void FN(lanes16_block)(const float *x, const float *w, float *y, long ldy, long m,
                                     long k, const char *ahead) {
    static const lanes16_fn by_rows[6] = {0,
                                          FN(lanes16_1_4),
                                          FN(lanes16_2_4),
                                          FN(lanes16_3_4),
                                          FN(lanes16_4_4),
                                          FN(lanes16_5_4)};
    for (long r = 0, groups = (m + 4) / 5; r < m; groups--) {
        long take = (m - r + groups - 1) / groups;
        by_rows[take](x + r * k, w, y + r * ldy, ldy, k, r ? 0 : ahead);
        r += take;
    }
}
