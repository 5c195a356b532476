/* A float32 decode step of one sequence's token through every layer in one call, for
   bf16_kernel.c, which includes this file after moe_sgemm_rows and the attention kernels.

   float32 must give transformers' tokens to the last bit, so every operation here gives the bits
   of the torch op the op-by-op path runs (the engine checks a whole step against that path
   before it trusts this one: router_service/engine/model.py):
   - products: MKL's sgemm, as F.linear and float32.py's split call it (`split` says which; the
     split's one-row products sgemv4.c's, where MKL sums as it does);
   - attention and the experts' combine: the op-by-op path's own kernels;
   - sums (RMSNorm's mean, the top-k weights'): torch's cascade over 8-lane vectors, or over
     single values below one vector (SumKernel.cpp), repeated lane by lane (SUM_LANES);
   - softmax and SiLU: torch's vectorised formulas, exp from the Sleef function torch calls
     (passed in), a scalar tail through libm's expf as torch's scalar loop does;
   - elementwise arithmetic in the same order (the file builds with -ffp-contract=off).
   Between products, a step op by op is some 60 torch calls a layer, each tens of microseconds once
   the weights streamed through the caches: at one sequence, more than a third of its time. */

typedef __m256 (*expf8_fn)(__m256);

typedef struct { /* the model; ctypes mirrors it (router_service/engine/fused_f32.py) */
    long layers, hidden, heads, kv_heads, head_dim, experts, top_k, inter, vocab;
    long num_blocks, block_size;
    int renorm, qk_norm; /* routing; 1: per-head q/k norm (Qwen3) */
    int lanes; /* torch's float32 vector width here, 8 (AVX2) or 16 (AVX-512): its softmax's */
    int split;         /* products split over the threads (float32.py), a bit each: F32_* */
    float eps, scale;
    void *sgemm, *set_threads, *expf8; /* MKL's sgemm_ and thread count; Sleef's expf8_u10 */
    const float *embed, *first_norm, *lm_head;
    const float *const *qkv, *const *o, *const *router; /* [layers]: [out][in] */
    const float *const *post_norm, *const *next_norm;   /* [layers] */
    const float *const *q_norm, *const *k_norm;         /* [layers] with qk_norm */
    void *const *cache_k, *const *cache_v;              /* [layers]: [kv_heads][blocks][bs][hd] */
    const float *const *gate_up, *const *down;          /* [layers * experts]: [out][in] */
    const float *const *up; /* NULL; or gate_up the gates alone, apart from these ups */
} moe_model_f32;

enum { F32_QKV = 1, F32_O = 2, F32_ROUTER = 4, F32_GATE_UP = 8, F32_DOWN = 16, F32_HEAD = 32,
       F32_HALVES = 64 /* gate and up apart: a product each, [inter][hidden] */ };

/* y [out] = w [out][k] · x: split over the threads as float32.py splits it, else F.linear's own
   call on `threads` MKL threads */
static void f32_product(const moe_model_f32 *m, int split, const float *w, const float *x,
                        float *y, long out, long k, int threads) {
    if (split) {
        moe_sgemm_rows(m->sgemm, m->set_threads, x, w, y, 1, out, k, threads);
        return;
    }
    int rows = (int)out, cols = 1, depth = (int)k;
    float one = 1.0f, zero = 0.0f;
    int before = ((threads_fn)m->set_threads)(threads);
    ((sgemm_fn)m->sgemm)("T", "N", &rows, &cols, &depth, &one, w, &depth, x, &depth, &zero, y,
                         &rows);
    ((threads_fn)m->set_threads)(before);
}

static long ceil_log2(long x) { /* c10's CeilLog2 */
    long bits = 0;
    if (x <= 2) return 1;
    for (x -= 1; x; x >>= 1) bits++;
    return bits;
}

/* The lanes of torch's sums on AVX2 and AVX-512 hosts alike: ATen builds its AVX-512 kernels
   only where a file asks, and SumKernel.cpp does not, so there torch.sum runs the AVX2 kernel
   (host C: a 16-lane cascade differed from torch.sum in about half of 100 sums of 8-4096
   values, an 8-lane one in none), while softmax and SiLU run 16-lane ones (`lanes`). */
#define SUM_LANES 8

/* torch's cascade (SumKernel.cpp) over `vectors` vectors of W lanes: four at a time into the
   first of four levels of partial sums, each level carried up every 2^power steps, then the
   leftover vectors into the first of the four and the other three added to it: its lanes */
static void cascade(const float *x, long vectors, int W, float *lanes) {
    long size = vectors / 4;
    float acc[4][4][16] = {{{0}}}; /* [level][row][lane] */
    if (size) {
        long power = ceil_log2(size) / 4 < 4 ? 4 : ceil_log2(size) / 4;
        long step = 1L << power, mask = step - 1, i = 0;
        while (i + step <= size) {
            for (long j = 0; j < step; j++, i++)
                for (int r = 0; r < 4; r++)
                    for (int l = 0; l < W; l++) acc[0][r][l] += x[(i * 4 + r) * W + l];
            for (int j = 1; j < 4; j++) {
                for (int r = 0; r < 4; r++)
                    for (int l = 0; l < W; l++) acc[j][r][l] += acc[j - 1][r][l], acc[j - 1][r][l] = 0;
                if (i & (mask << (j * power))) break;
            }
        }
        for (; i < size; i++)
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < W; l++) acc[0][r][l] += x[(i * 4 + r) * W + l];
        for (int j = 1; j < 4; j++)
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < W; l++) acc[0][r][l] += acc[j][r][l];
    }
    for (long i = size * 4; i < vectors; i++)
        for (int l = 0; l < W; l++) acc[0][0][l] += x[i * W + l];
    for (int r = 1; r < 4; r++)
        for (int l = 0; l < W; l++) acc[0][0][l] += acc[0][r][l];
    memcpy(lanes, acc[0][0], sizeof(float) * W);
}

/* torch's float32 sum of n contiguous values: from a whole vector of W lanes on, the cascade
   over the whole vectors, then from 0 the scalar tail and the lanes in order
   (vectorized_inner_sum); below, the cascade over single values (scalar_inner_sum) */
static float torch_sum(const float *x, long n) {
    const int W = SUM_LANES;
    float lanes[SUM_LANES];
    if (n < W) {
        cascade(x, n, 1, lanes);
        return lanes[0];
    }
    long vectors = n / W;
    cascade(x, vectors, W, lanes);
    float total = 0.0f;
    for (long i = vectors * W; i < n; i++) total += x[i];
    for (int l = 0; l < W; l++) total += lanes[l];
    return total;
}

/* y = weight * F.rms_norm(x): x times 1/sqrt(mean(x²) + eps), then times the weight; sq is
   scratch [n] */
static void f32_rms_norm(const float *x, const float *weight, float *y, float *sq, long n,
                         float eps) {
    for (long i = 0; i < n; i++) sq[i] = x[i] * x[i];
    float r = 1.0f / sqrtf(torch_sum(sq, n) / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = weight[i] * (x[i] * r);
}

static float lane_op(float a, float b, int max) { return max ? (a > b ? a : b) : a + b; }

/* vec::reduce_all over n values: a vector's lanes accumulated over the whole vectors (the tail's
   lanes masked in), then folded in halves; below one vector, lane 0 sequentially */
static float reduce_all(const float *x, long n, int W, int max) {
    float acc[16];
    if (n < W) {
        float total = x[0];
        for (long i = 1; i < n; i++) total = lane_op(total, x[i], max);
        return total;
    }
    memcpy(acc, x, sizeof(float) * W);
    long d = W;
    for (; d < n - n % W; d += W)
        for (int l = 0; l < W; l++) acc[l] = lane_op(acc[l], x[d + l], max);
    for (long l = 0; l < n - d; l++) acc[l] = lane_op(acc[l], x[d + l], max);
    for (int half = W / 2; half; half /= 2) {
        float next[16];
        for (int l = 0; l < W; l++) next[l] = lane_op(acc[l], acc[l ^ half], max);
        memcpy(acc, next, sizeof(float) * W);
    }
    return acc[0];
}

/* y[i] = exp(x[i]) for n values by Sleef's expf8_u10 (per value, as in any vector width) */
__attribute__((target("avx2,fma"))) static void sleef_exp(expf8_fn expf8, const float *x,
                                                           float *y, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, expf8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float in[8] = {0}, out[8];
        memcpy(in, x + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(out, expf8(_mm256_loadu_ps(in)));
        memcpy(y + i, out, sizeof(float) * (n - i));
    }
}

/* torch.softmax of n logits into p: max, exp(x - max), their sum, times its reciprocal */
static void f32_softmax(const moe_model_f32 *m, const float *x, float *p, long n) {
    float top = reduce_all(x, n, m->lanes, 1);
    for (long i = 0; i < n; i++) p[i] = x[i] - top;
    sleef_exp((expf8_fn)m->expf8, p, p, n);
    float r = 1.0f / reduce_all(p, n, m->lanes, 0);
    for (long i = 0; i < n; i++) p[i] *= r;
}

/* F.silu(gate) * up over n values: x / (1 + exp(-x)) through Sleef for the whole pairs of
   vectors torch's loop takes, libm's expf for its scalar tail; neg is scratch [n] */
static void f32_silu_mul(expf8_fn expf8, int lanes, const float *gate, const float *up, float *y,
                         float *neg, long n) {
    long vectorised = n - n % (2 * lanes);
    for (long i = 0; i < n; i++) neg[i] = -gate[i];
    sleef_exp(expf8, neg, neg, vectorised);
    for (long i = vectorised; i < n; i++) neg[i] = expf(neg[i]);
    for (long i = 0; i < n; i++) y[i] = gate[i] / (1.0f + neg[i]) * up[i];
}

/* The softmax router's choice of token h: the top k by probability (ties: the lower expert),
   renormalised by their torch sum where the model does, into chosen[k] and weights[k] */
static void f32_route(const moe_model_f32 *m, const float *logits, float *probs,
                      int64_t *chosen, float *weights) {
    long e = m->experts, k = m->top_k;
    f32_softmax(m, logits, probs, e);
    top_k(probs, e, k, chosen);
    for (long j = 0; j < k; j++) weights[j] = probs[chosen[j]];
    if (m->renorm) {
        float total = torch_sum(weights, k);
        for (long j = 0; j < k; j++) weights[j] /= total;
    }
}

/* The step of `token` at the cache slot `slot` (its context `length` tokens, itself included;
   block table `table` [width]; RoPE cos, sin [head_dim] at its position): x [hidden] ends as
   the residual stream, h as it normed by the final norm, logits [vocab], chosen [layers][top_k]
   each layer's experts in routing order. -1 without memory, or from attention. */
int moe_decode_step_f32(const moe_model_f32 *m, long token, const float *cos, const float *sin,
                        const int64_t *table, long width, long length, long slot, float *x,
                        float *h, float *logits, int64_t *chosen, int threads) {
    long hidden = m->hidden, hd = m->head_dim, k = m->top_k, inter = m->inter;
    long qkv_cols = (m->heads + 2 * m->kv_heads) * hd, attended = m->heads * hd;
    long rotated = (m->heads + m->kv_heads) * hd, widest = hidden > inter ? hidden : inter;
    size_t floats = qkv_cols + rotated + attended + hidden + 2 * m->experts + k +
                    2 * inter + 2 * widest + k * hidden;
    float *work = malloc(sizeof(float) * floats);
    if (!work) return -1;
    float *qkv = work, *qk = qkv + qkv_cols, *out = qk + rotated, *delta = out + attended;
    float *logit = delta + hidden, *probs = logit + m->experts, *weights = probs + m->experts;
    float *gu = weights + k, *gated = gu + 2 * inter, *scratch = gated + widest;
    float *ys = scratch + widest;
    int64_t lengths[1] = {length}, slots[1] = {slot};
    int failed = 0, s = m->split;
    memcpy(x, m->embed + token * hidden, sizeof(float) * hidden);
    f32_rms_norm(x, m->first_norm, h, scratch, hidden, m->eps);
    for (long l = 0; l < m->layers && !failed; l++) {
        f32_product(m, s & F32_QKV, m->qkv[l], h, qkv, qkv_cols, hidden, threads);
        for (long j = 0; m->qk_norm && j < m->heads + m->kv_heads; j++) /* in place, head by head */
            f32_rms_norm(qkv + j * hd, j < m->heads ? m->q_norm[l] : m->k_norm[l], qkv + j * hd,
                         scratch, hd, m->eps);
        failed = moe_decode_step_attention(0, qkv, qkv_cols, cos, sin, qk, slots, m->cache_k[l],
                                           m->cache_v[l], table, width, lengths, 1, m->heads,
                                           m->kv_heads, hd, m->num_blocks, m->block_size,
                                           m->scale, out, threads);
        f32_product(m, s & F32_O, m->o[l], out, delta, hidden, attended, threads);
        for (long i = 0; i < hidden; i++) x[i] += delta[i];
        f32_rms_norm(x, m->post_norm[l], h, scratch, hidden, m->eps);
        f32_product(m, s & F32_ROUTER, m->router[l], h, logit, m->experts, hidden, threads);
        int64_t *routed = chosen + l * k;
        f32_route(m, logit, probs, routed, weights);
        for (long j = 0; j < k; j++) {
            long e = l * m->experts + routed[j];
            if (m->up) { /* as the checkpoint stores them: F.linear's bits over [gate; up] */
                f32_product(m, s & F32_HALVES, m->gate_up[e], h, gu, inter, hidden, threads);
                f32_product(m, s & F32_HALVES, m->up[e], h, gu + inter, inter, hidden, threads);
            } else
                f32_product(m, s & F32_GATE_UP, m->gate_up[e], h, gu, 2 * inter, hidden, threads);
            f32_silu_mul((expf8_fn)m->expf8, m->lanes, gu, gu + inter, gated, scratch, inter);
            f32_product(m, s & F32_DOWN, m->down[e], gated, ys + j * hidden, hidden, inter,
                        threads);
        }
        const void *rows[16]; /* top_k <= 16 (fused.unfit_model) */
        for (long j = 0; j < k; j++) rows[j] = ys + j * hidden;
        PICK(combine)(rows, 0, weights, 0, 1, k, hidden, 0, delta, 1); /* the op-by-op path's */
        for (long i = 0; i < hidden; i++) x[i] += delta[i];
        f32_rms_norm(x, m->next_norm[l], h, scratch, hidden, m->eps);
    }
    if (!failed) f32_product(m, s & F32_HEAD, m->lm_head, h, logits, m->vocab, hidden, threads);
    free(work);
    return failed ? -1 : 0;
}
