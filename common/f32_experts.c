/* A layer's float32 SiLU experts in one call, for bf16_kernel.c, which includes this file after
   f32_step.c: down(silu(x · gate^T) * (x · up^T)) of each expert's rows, with the bits expert_ffn
   gives them op by op. Each product sums as MKL sums a product of its row count on AVX-512
   (f32_lanes.c: one row as its sgemv, 2-15 as its sgemm), SiLU as torch computes it
   (f32_step.c's f32_silu_mul); common/float32_ffns.py holds every product to F.linear's bits
   (float32.lanes_agree) before it calls this, and takes only the experts whose SiLU torch
   computes in one piece.

   Op by op, a decode step of 8 sequences on the Qwen3-30B-A3B slice made some 600 products of one
   or two rows, each a call that woke the threads anew: its one-row products read 20 GB/s where
   the same products back to back read 27-32 (host C). Here one OpenMP team runs the layer's
   experts, phase by phase: the gate and up products' 8-column blocks of every expert split over
   the threads, then SiLU row by row, then the down products' blocks. */

/* Columns 0-7 of x [m][k] · w^T into y (row stride ldy), w the first of those 8 rows, m 1-15 */
static void f32_eight(const float *x, const float *w, float *y, long ldy, long m, long k) {
    if (m == 1) {
        gemv16_8_avx512(x, w, y, k);
        return;
    }
    lanes16_block_avx512(x, w, y, ldy, m, k, (const char *)(w + 4 * k));
    lanes16_block_avx512(x, w + 4 * k, y + 4, ldy, m, k, 0);
}

/* Expert g's rows x[g] [m[g]][hidden] into y[g] [m[g]][hidden]: gate[g] [inter][hidden] and
   up[g] likewise, or with `up` NULL gate[g] the two joined [2 * inter][hidden] (transformers' one
   product); down[g] [hidden][inter]. m[g] from 0 to 15; hidden and inter multiples of 16, inter
   of 2 * lanes (torch's SiLU then has no scalar tail in a row); expf8 Sleef's expf8_u10 and lanes
   torch's float32 vector width, as f32_step.c takes them. -1 without memory, -2 without AVX-512. */
int moe_silu_ffns_f32(const float *const *x, const float *const *gate, const float *const *up,
                      const float *const *down, float *const *y, const long *m, long count,
                      long inter, long hidden, void *expf8, int lanes, int threads) {
    if (!avx512()) return -2;
    long *start = malloc(sizeof(long) * (count + 1)); /* expert g's rows: [start[g], start[g+1]) */
    if (!start) return -1;
    start[0] = 0;
    for (long g = 0; g < count; g++) start[g + 1] = start[g] + m[g];
    long rows = start[count], width = 2 * inter;
    float *gu = malloc(sizeof(float) * rows * width);          /* a row's gate, then its up */
    float *gated = malloc(sizeof(float) * rows * 2 * inter); /* SiLU's output, then scratch */
    if (!gu || !gated) {
        free(start), free(gu), free(gated);
        return -1;
    }
    long up_blocks = width / 8, down_blocks = hidden / 8;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long b = 0; b < count * up_blocks; b++) {
            long g = b / up_blocks, c = b % up_blocks * 8;
            const float *w = up && c >= inter ? up[g] + (c - inter) * hidden : gate[g] + c * hidden;
            if (m[g]) f32_eight(x[g], w, gu + start[g] * width + c, width, m[g], hidden);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            f32_silu_mul((expf8_fn)expf8, lanes, gu + r * width, gu + r * width + inter,
                         gated + r * inter, gated + (rows + r) * inter, inter);
#pragma omp for schedule(static)
        for (long b = 0; b < count * down_blocks; b++) {
            long g = b / down_blocks, c = b % down_blocks * 8;
            if (m[g])
                f32_eight(gated + start[g] * inter, down[g] + c * inter, y[g] + c, hidden, m[g],
                          inter);
        }
    }
    free(start), free(gu), free(gated);
    return 0;
}
