/* A decode step of one sequence through every layer in one call, for bf16_kernel.c, which
   includes this file once the kernels of both instruction sets are defined.

   At batch 1 a step reads each weight once, so its time is the weights' bytes over the memory
   bandwidth plus whatever runs between the products. Op by op, that is a few hundred torch and
   ctypes calls, each waking the thread team anew: on 2 cores about a third of a step. Here one
   OpenMP team runs the whole step, its phases separated by barriers: the products split their
   64-column blocks over the threads, the small serial work between them (norms, RoPE, attention
   of one query, routing, combine) runs on one thread while the others wait at the barrier.

   Every phase calls the function the op-by-op path calls (moe_linear's block, moe_silu_ffns'
   phases, rms_norm, combine, rope, kv_write, decode attention, route_token), in the same order on
   the same values, so the step's bits are the op-by-op path's (tested). */

typedef struct { /* a model the step runs; ctypes mirrors it (router_service/engine/fused.py) */
    long layers, hidden, heads, kv_heads, head_dim, experts, top_k, inter, vocab;
    long num_blocks, block_size; /* the KV cache's geometry */
    long group, dense_group, head_group; /* the scale groups of experts, attention, LM head */
    int format, dense_format, head_format; /* their formats (bf16_kernel.c's FORMAT_*) */
    int renorm, weights_bf16, qk_norm;     /* routing; 1: per-head q/k norm */
    float eps, scale;                      /* RMSNorm's epsilon; attention's scale */
    const void *const *qkv, *const *o;     /* [layers]: panels */
    const uint16_t *const *post_norm, *const *next_norm; /* [layers]: after attention, after it */
    const uint16_t *const *q_norm, *const *k_norm;       /* [layers] with qk_norm */
    const uint16_t *const *router;                       /* [layers]: [experts][hidden] rows */
    void *const *cache_k, *const *cache_v;               /* [layers]: [kv_heads][blocks][bs][hd] */
    const void *const *gate_up, *const *gate_up_scales;  /* [layers * experts]: panels */
    const void *const *down, *const *down_scales;
    const uint16_t *first_norm; /* the first layer's input norm */
    const void *lm_head;        /* panels [vocab][hidden], or NULL: the caller applies it */
    const void *const *qkv_scales, *const *o_scales, *head_scales; /* NULL for bfloat16 */
} moe_model;

typedef struct { /* the step's token */
    const uint16_t *embedding, *cos, *sin; /* its row of the embeddings; RoPE at its position */
    const int64_t *table;                  /* its block table [width] */
    long width, length, slot;              /* its context, itself included; its cache slot */
} moe_token;

/* One token's routing from its logits [experts] (bfloat16 values): softmax in float32, the k
   most probable (ties: the lower expert first), optionally renormalised to sum to 1, as float32
   or rounded to bfloat16 into weights[k]; probs is scratch [experts]. */
static void route_token(const float *logits, float *probs, long experts, long k, int renorm,
                        int weights_bf16, void *weights, int64_t *chosen) {
    float top = -__builtin_inff(), sum = 0.0f;
    for (long e = 0; e < experts; e++) top = logits[e] > top ? logits[e] : top;
    for (long e = 0; e < experts; e++) sum += probs[e] = expf(logits[e] - top);
    for (long e = 0; e < experts; e++) probs[e] /= sum;
    float w[k], total = 0.0f;
    for (long j = 0; j < k; j++) {
        long best = -1;
        for (long e = 0; e < experts; e++) {
            int taken = 0;
            for (long i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        chosen[j] = best;
        total += w[j] = probs[best];
    }
    for (long j = 0; j < k; j++) {
        float v = renorm ? w[j] / total : w[j];
        if (weights_bf16) {
            float r = bf16_round(v);
            uint32_t bits;
            memcpy(&bits, &r, sizeof bits);
            ((uint16_t *)weights)[j] = (uint16_t)(bits >> 16);
        } else {
            ((float *)weights)[j] = v;
        }
    }
}

static float router_logit(const uint16_t *x, const uint16_t *w, long hidden) {
    return bf16_round(PICK(dot)(x, w, hidden)); /* a bfloat16 product, as the layer's output */
}

/* The router of n tokens x [n][hidden] over weight [experts][hidden] (bfloat16, hidden a
   multiple of 16): route_token of each token's logits into weights [n][k] and chosen [n][k],
   the tokens split over `threads`. The op-by-op path's routing, so that both give the same
   experts and weights. -1 without memory. */
int moe_route(const uint16_t *x, const uint16_t *w, long n, long hidden, long experts, long k,
              int renorm, int weights_bf16, void *weights, int64_t *chosen, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (n * experts * hidden >= 1 << 20)
    {
        float *logits = malloc(sizeof(float) * 2 * experts);
        if (!logits) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            if (!logits) continue;
            for (long e = 0; e < experts; e++)
                logits[e] = router_logit(x + t * hidden, w + e * hidden, hidden);
            route_token(logits, logits + experts, experts, k, renorm, weights_bf16,
                        (char *)weights + t * k * (weights_bf16 ? 2 : 4), chosen + t * k);
        }
        free(logits);
    }
    return failed ? -1 : 0;
}

/* 64-column block c of the one-row product xf . W^T into y (n columns), W [n][k] in `format` */
static void product(int format, long group, const float *xf, const void *w, const void *scales,
                    uint16_t *y, long n, long k, long c) {
    const char *s = scales ? (const char *)scales + c * block_scale_bytes(format, k, group) : 0;
    pick_block(format)(xf, (const char *)w + c * block_bytes(format, k), s, y + c * 64, n, 1, k,
                       group, 0);
}

static const void *at(const void *const *array, long i) { return array ? array[i] : 0; }

/* The step's attention after the qkv product, moe_decode_step_attention's work: with Qwen3's
   per-head q/k norm first where the model has it, RoPE of q and k and the cache write (`prepare`,
   on one thread), then each KV head's attention (`attend`, one job each) into out [heads][hd]. */
static void prepare(const moe_model *m, const moe_token *t, long l, const uint16_t *qkv,
                    uint16_t *normed, uint16_t *qk) {
    long hd = m->head_dim, rotated = m->heads + m->kv_heads, ld = (rotated + m->kv_heads) * hd;
    const uint16_t *source = qkv;
    if (m->qk_norm) {
        PICK(rms_norm)(qkv, 0, 0, m->q_norm[l], normed, m->heads, hd, m->eps, 1);
        PICK(rms_norm)(qkv + m->heads * hd, 0, 0, m->k_norm[l], normed + m->heads * hd,
                       m->kv_heads, hd, m->eps, 1);
        source = normed;
    }
    moe_rope_bf16(source, rotated * hd, t->cos, t->sin, qk, 1, rotated, hd);
    int64_t slot = t->slot;
    moe_kv_write(1, qk + m->heads * hd, rotated * hd, qkv + rotated * hd, ld, &slot, 1,
                 m->kv_heads, hd, hd, m->num_blocks * m->block_size, m->cache_k[l],
                 m->cache_v[l]);
}

/* KV head h's g query heads over the context (decode attention of one sequence and one KV
   head: the cache's head h as a cache of one), into out and widened into xf */
static int attend(const moe_model *m, const moe_token *t, long l, long h, const uint16_t *qk,
                  uint16_t *out, float *xf) {
    long hd = m->head_dim, g = m->heads / m->kv_heads;
    long per_head = m->num_blocks * m->block_size * hd;
    int64_t length = t->length;
    int failed = PICK(decode_attention)(1, qk + h * g * hd, (m->heads + m->kv_heads) * hd,
                                        (const uint16_t *)m->cache_k[l] + h * per_head,
                                        (const uint16_t *)m->cache_v[l] + h * per_head, t->table,
                                        t->width, &length, 1, 1, g, hd, hd, m->num_blocks,
                                        m->block_size, m->scale, out + h * g * hd, 1);
    widen(out + h * g * hd, xf + h * g * hd, g * hd);
    return failed;
}

/* The step of token t: x [hidden] ends as the residual stream, h [hidden] as it normed by the
   final norm, logits [vocab] (with lm_head) as the LM head's bfloat16 product, chosen
   [layers][top_k] as each layer's experts in routing order. -1 without memory. */
int moe_decode_step(const moe_model *m, const moe_token *t, uint16_t *x, uint16_t *h,
                    uint16_t *logits, int64_t *chosen, int threads) {
    long hidden = m->hidden, hd = m->head_dim, k = m->top_k, inter = m->inter;
    long qkv_cols = (m->heads + 2 * m->kv_heads) * hd, attended = m->heads * hd;
    long widest = hidden > attended ? hidden : attended;
    /* the float32 inputs; qkv; normed and rotated q|k; attention; a product's output; logits and
       probabilities; weights; gate|up, gated and widened per choice; the experts' outputs */
    size_t floats = widest + 2 * m->experts + k + k * inter;
    size_t halves = qkv_cols + 2 * (m->heads + m->kv_heads) * hd + attended + hidden +
                    k * 3 * inter + k * hidden;
    char *work = malloc(sizeof(float) * floats + sizeof(uint16_t) * halves);
    if (!work) return -1;
    float *xf = (float *)work, *logit = xf + widest, *probs = logit + m->experts;
    float *weights = probs + m->experts, *gf = weights + k;
    uint16_t *qkv = (uint16_t *)(gf + k * inter), *normed = qkv + qkv_cols;
    long rotated = (m->heads + m->kv_heads) * hd;
    uint16_t *qk = normed + rotated, *out = qk + rotated;
    uint16_t *delta = out + attended, *gu = delta + hidden, *gated = gu + k * 2 * inter;
    uint16_t *ys = gated + k * inter;
    void (*norm)(const uint16_t *, const uint16_t *, uint16_t *, const uint16_t *, uint16_t *,
                 long, long, float, int) = PICK(rms_norm);
    long up_blocks = 2 * inter / 64, down_blocks = hidden / 64;
    int f = m->format, df = m->dense_format;
    long g = m->group, dg = m->dense_group;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        {
            memcpy(x, t->embedding, sizeof(uint16_t) * hidden);
            norm(x, 0, 0, m->first_norm, h, 1, hidden, m->eps, 1);
            widen(h, xf, hidden);
        }
        for (long l = 0; l < m->layers; l++) {
            int64_t *routed = chosen + l * k;
            long first = l * m->experts; /* the layer's experts' weights and scales */
            const void *const *up = m->gate_up + first, *const *dn = m->down + first;
#pragma omp for schedule(static)
            for (long c = 0; c < qkv_cols / 64; c++)
                product(df, dg, xf, m->qkv[l], at(m->qkv_scales, l), qkv, qkv_cols, hidden, c);
#pragma omp single
            prepare(m, t, l, qkv, normed, qk);
#pragma omp for schedule(static)
            for (long kv = 0; kv < m->kv_heads; kv++)
                if (attend(m, t, l, kv, qk, out, xf)) {
#pragma omp atomic write
                    failed = 1;
                }
#pragma omp for schedule(static)
            for (long c = 0; c < hidden / 64; c++)
                product(df, dg, xf, m->o[l], at(m->o_scales, l), delta, hidden, attended, c);
#pragma omp single
            norm(x, delta, x, m->post_norm[l], h, 1, hidden, m->eps, 1);
#pragma omp for schedule(static)
            for (long e = 0; e < m->experts; e++)
                logit[e] = router_logit(h, m->router[l] + e * hidden, hidden);
#pragma omp single
            {
                route_token(logit, probs, m->experts, k, m->renorm, m->weights_bf16, weights,
                            routed);
                widen(h, xf, hidden);
            }
#pragma omp for schedule(static)
            for (long b = 0; b < k * up_blocks; b++) {
                long j = b / up_blocks, c = b % up_blocks, e = routed[j];
                product(f, g, xf, up[e], at(m->gate_up_scales, first + e), gu + j * 2 * inter,
                        2 * inter, hidden, c);
            }
#pragma omp for schedule(static)
            for (long j = 0; j < k; j++) {
                PICK(silu_mul)(gu + j * 2 * inter, gated + j * inter, inter);
                widen(gated + j * inter, gf + j * inter, inter);
            }
#pragma omp for schedule(static)
            for (long b = 0; b < k * down_blocks; b++) {
                long j = b / down_blocks, c = b % down_blocks, e = routed[j];
                product(f, g, gf + j * inter, dn[e], at(m->down_scales, first + e),
                        ys + j * hidden, hidden, inter, c);
            }
#pragma omp single
            {
                const void *rows[k];
                for (long j = 0; j < k; j++) rows[j] = ys + j * hidden;
                PICK(combine)(rows, 1, weights, m->weights_bf16, 1, k, hidden, 1, delta, 1);
                norm(x, delta, x, m->next_norm[l], h, 1, hidden, m->eps, 1);
                widen(h, xf, hidden);
            }
        }
        if (m->lm_head) {
#pragma omp for schedule(static)
            for (long c = 0; c < m->vocab / 64; c++)
                product(m->head_format, m->head_group, xf, m->lm_head, m->head_scales, logits,
                        m->vocab, hidden, c);
        }
    }
    free(work);
    return failed ? -1 : 0;
}
