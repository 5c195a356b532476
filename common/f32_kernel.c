/* float32 products over a weight as stored, w [n][k] row-major (a view of the checkpoint's file),
   for bf16_kernel.c, which includes this file in its AVX2 pass (AVX-512 hosts run it too).

   What they are for: an expert service merges its callers' rows, so a row's result must not
   depend on its batch-mates (MKL's small-batch kernels' do), and oneDNN's layout, which keeps
   that, is a copy per process. These read the file's own pages, which every process on a host
   shares. Every output is a dot product of two rows: 8 float32 lanes, lane l summing
   x[k] * w[k] over k = l mod 8 in order with fused multiply-adds from 0, the lanes then added in
   one fixed tree (hsum8), then the bias. Every kernel below does exactly that, so a row's bits do
   not depend on which one computes it, nor on its batch-mates. k is a multiple of 8. */

/* R rows of x [R][k] against J weight rows from w (k apart) into y [R][ldy] (+ bias [J]) */
#define F32KERNEL(R, J)                                                                        \
    TARGET static void f32_##R##_##J(const float *x, const float *w, const float *bias,        \
                                     float *y, long ldy, long k) {                             \
        __m256 acc[R][J];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();                       \
        for (long i = 0; i < k; i += 8) {                                                      \
            /* the J rows are J * k floats back to back, read as J streams: fetch the next   \
               J rows, as one stream, a step's share at a time (32 J bytes) */                 \
            const char *ahead = (const char *)(w + J * k) + i * 4 * J;                         \
            for (int l = 0; l < 32 * J; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);          \
            __m256 wv[J];                                                                      \
            for (int j = 0; j < J; j++) wv[j] = _mm256_loadu_ps(w + j * k + i);               \
            for (int r = 0; r < R; r++) {                                                      \
                __m256 xv = _mm256_loadu_ps(x + r * k + i);                                    \
                for (int j = 0; j < J; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < J; j++) {                                                      \
                float s = hsum8(acc[r][j]);                                                    \
                y[r * ldy + j] = bias ? s + bias[j] : s;                                       \
            }                                                                                  \
    }
F32KERNEL(1, 8) /* one row: 8 weight rows streamed at once */
F32KERNEL(2, 4)
F32KERNEL(3, 4) /* 12 sums, 4 weight vectors: AVX2's 16 registers */
F32KERNEL(1, 1) /* the weight rows past the last whole block */
#undef F32KERNEL

/* m rows of x against J = 8 (m == 1) or 4 weight rows from w into y: 3 rows at a time, or 2
   where 3 would leave one alone (4 = 2 + 2), so no row is left over */
TARGET static void f32_block(const float *x, const float *w, const float *bias, float *y, long ldy,
                             long m, long k) {
    if (m == 1) {
        f32_1_8(x, w, bias, y, ldy, k);
        return;
    }
    long r = 0;
    while (m - r >= 2) {
        long take = m - r == 2 || m - r == 4 ? 2 : 3;
        if (take == 3)
            f32_3_4(x + r * k, w, bias, y + r * ldy, ldy, k);
        else
            f32_2_4(x + r * k, w, bias, y + r * ldy, ldy, k);
        r += take;
    }
}
