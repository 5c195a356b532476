/* One-row float32 products with the bits MKL's sgemv gives them on a CPU it does not run its
   Intel kernels on, for bf16_kernel.c, which includes this file before moe_sgemm_rows.

   float32 must give F.linear's bits, and F.linear is MKL's sgemm. On host E (AMD EPYC, Zen 4;
   MKL 2024.0) MKL reads a one-row product at 16-17 GB/s on one thread or two, and
   common/f32_lanes.c's kernels, which repeat its sums on Intel's AVX-512, do not give its bits.
   Probed with FPRev's trick (x all ones, w[0] = 2^40, w[j] = -2^40, the rest ones: the output
   counts the terms added after 0 and j met) and then checked bit for bit against F.linear on
   random rows, MKL sums an output there in 4 lanes without fused multiply-adds:
   - a head: x[0] * w[0], rounded, then x[i] * w[i] added one by one (each product rounded) for
     i < head, head = (k - 1 - a) % 4 + 1, where a is the call's weight address in floats mod 4
     (the whole weight's, which every 64-row block shares: 64 rows are a multiple of 16 bytes);
   - lane l (0-3) sums x[i] * w[i] for i = head + l, head + 4 + l, ... over whole groups of 4,
     each product rounded then added; the head's sum starts lane 0, the others start at 0;
   - the lanes as (l0 + l2) + (l1 + l3);
   - then the inputs past the last whole group, added one by one.
   Rows are independent, so 8 run at once (8 sums in flight hide the add's latency).
   common/float32.py checks that MKL sums so here before it lets moe_sgemm_rows use this. */

static int sgemv4_on; /* moe_sgemm_rows computes one-row products here, not through MKL */

void moe_sgemv4_use(int on) { sgemv4_on = on; }

static inline __attribute__((always_inline)) void sgemv4_rows(const float *x, const float *w,
                                                               float *y, long k, long head,
                                                               long body, int R) {
    __m128 acc[8];
    for (int r = 0; r < R; r++) {
        const float *row = w + r * k;
        float s = x[0] * row[0];
        for (long i = 1; i < head; i++) s = s + x[i] * row[i]; /* -ffp-contract=off: no FMA */
        acc[r] = _mm_set_ss(s);
    }
    for (long i = head; i < body; i += 4) {
        __m128 xv = _mm_loadu_ps(x + i);
        for (int r = 0; r < R; r++)
            acc[r] = _mm_add_ps(acc[r], _mm_mul_ps(xv, _mm_loadu_ps(w + r * k + i)));
    }
    for (int r = 0; r < R; r++) {
        float l[4];
        _mm_storeu_ps(l, acc[r]);
        float t = (l[0] + l[2]) + (l[1] + l[3]);
        for (long i = body; i < k; i++) t = t + x[i] * w[r * k + i];
        y[r] = t;
    }
}

/* y [out] = w [out][k] · x [k], each output summed as described above */
void moe_sgemv4(const float *x, const float *w, float *y, long out, long k) {
    if (k < 1) {
        memset(y, 0, sizeof(float) * (size_t)(out > 0 ? out : 0));
        return;
    }
    long a = (long)((uintptr_t)w / sizeof(float) % 4);
    long head = ((k - 1 - a) % 4 + 4) % 4 + 1;
    if (head > k) head = k;
    long body = head + (k - head) / 4 * 4, r = 0;
    for (; r + 8 <= out; r += 8) sgemv4_rows(x, w + r * k, y + r, k, head, body, 8);
    for (; r < out; r++) sgemv4_rows(x, w + r * k, y + r, k, head, body, 1);
}
