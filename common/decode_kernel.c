/* A decode step of one token of each of n sequences through every layer in one call, for
   bf16_kernel.c, which includes this file once the kernels of both instruction sets are defined.

   At small batches a step reads each weight it uses about once, so its time is the weights'
   bytes over the memory bandwidth plus whatever runs between the products. Op by op, that is a
   few hundred torch and ctypes calls, each waking the thread team anew: on 2 cores about a third
   of a step at batch 1, and a second sequence cost more than it added. Here one OpenMP team runs
   the whole step, its phases separated by barriers: the products split their 64-column blocks
   (of every routed expert at once) over the threads, RoPE and the cache write split the tokens,
   attention their KV heads (and their query heads where there are more threads than KV heads),
   the combine its columns, and the small serial work (norms, routing, grouping) runs on one
   thread while the others wait at the barrier; for a lone token every thread does that work
   itself instead (solo_state), and prepares the int8/int4 inputs it wrote.

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

typedef struct { /* the step's tokens, one of each of `count` sequences */
    long count;
    const uint16_t *const *embedding, *const *cos, *const *sin; /* [count]: its embedding row; RoPE
                                                                   at its position */
    const int64_t *tables;          /* [count][width]: the block tables */
    long width;
    const int64_t *lengths, *slots; /* [count]: its context, itself included; its cache slot */
} moe_token;

/* The k most probable of probs [experts] into chosen[k], most probable first (ties: the lower
   expert first) */
static void top_k(const float *probs, long experts, long k, int64_t *chosen) {
    char taken[experts];
    memset(taken, 0, sizeof taken);
    for (long j = 0; j < k; j++) {
        long best = -1;
        for (long e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        chosen[j] = best;
        if (best >= 0) taken[best] = 1;
    }
}

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
    top_k(probs, experts, k, chosen);
    for (long j = 0; j < k; j++) total += w[j] = probs[chosen[j]];
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

/* logits [experts] of x [hidden] over the router's rows w [experts][hidden], those from `first`
   to `last`: each a bfloat16 product, as the layer's output, four rows at a time */
static void router_logits(const uint16_t *x, const uint16_t *w, long hidden, long first,
                          long last, float *logits) {
    long e = first;
    for (; e + 4 <= last; e += 4) PICK(dot4)(x, w + e * hidden, hidden, logits + e);
    for (; e < last; e++) logits[e] = PICK(dot)(x, w + e * hidden, hidden);
    for (e = first; e < last; e++) logits[e] = bf16_round(logits[e]);
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
            router_logits(x + t * hidden, w, hidden, 0, experts, logits);
            route_token(logits, logits + experts, experts, k, renorm, weights_bf16,
                        (char *)weights + t * k * (weights_bf16 ? 2 : 4), chosen + t * k);
        }
        free(logits);
    }
    return failed ? -1 : 0;
}

/* 64-column block c of the product of n rows xf [n][k] by W^T into y [n][ldy], W [.][k] in
   `format` */
static void product(int format, long group, const float *xf, const void *w, const void *scales,
                    uint16_t *y, long ldy, long k, long c, long n) {
    const char *s = scales ? (const char *)scales + c * block_scale_bytes(format, k, group) : 0;
    pick_block(format)(xf, (const char *)w + c * block_bytes(format, k), s, y + c * 64, ldy, n, k,
                       group, 0);
}

static const void *at(const void *const *array, long i) { return array ? array[i] : 0; }

/* product(), or with xt (the rows laid out by tile_rows) on AMX tiles where it ran */
static void dense(int format, long group, const float *xf, const uint16_t *xt, const void *w,
                  const void *scales, uint16_t *y, long ldy, long k, long c, long n) {
    if (xt)
        tile_columns(xt, (const uint16_t *)w + c * 64 * k, y + c * 64, ldy, n, k, 0);
    else
        product(format, group, xf, w, scales, y, ldy, k, c, n);
}

/* xf [n][hidden], h widened, made what reads it next: layer l's qkv, or past the last layer the
   LM head */
static void next_rows(const moe_model *m, long l, float *xf, long n) {
    if (l < m->layers)
        block_rows(m->dense_format, m->dense_group, xf, n, m->hidden);
    else if (m->lm_head)
        block_rows(m->head_format, m->head_group, xf, n, m->hidden);
}

/* The step's attention after the qkv product, moe_decode_step_attention's work, for token i's KV
   head h: with Qwen3's per-head q/k norm first where the model has it, RoPE of the head's g
   queries and its key and the key's and value's cache write (`prepare`), then the head's attention
   (`attend`). A job of token and KV head does both, each head as the whole token's call does it.
   qkv [n][ld], normed and qk [n][rotated * hd] are the step's rows. */
static void prepare(const moe_model *m, const moe_token *t, long i, long l, long h,
                    const uint16_t *qkv, uint16_t *normed, uint16_t *qk) {
    long hd = m->head_dim, g = m->heads / m->kv_heads, rotated = m->heads + m->kv_heads;
    long ld = (rotated + m->kv_heads) * hd, q = h * g * hd, k = (m->heads + h) * hd;
    long per_head = m->num_blocks * m->block_size;
    qkv += i * ld, normed += i * rotated * hd, qk += i * rotated * hd;
    const uint16_t *source = qkv;
    if (m->qk_norm) {
        PICK(rms_norm)(qkv + q, 0, 0, m->q_norm[l], normed + q, g, hd, m->eps, 1);
        PICK(rms_norm)(qkv + k, 0, 0, m->k_norm[l], normed + k, 1, hd, m->eps, 1);
        source = normed;
    }
    moe_rope_bf16(source + q, rotated * hd, t->cos[i], t->sin[i], qk + q, 1, g, hd);
    moe_rope_bf16(source + k, rotated * hd, t->cos[i], t->sin[i], qk + k, 1, 1, hd);
    moe_kv_write(1, qk + k, rotated * hd, qkv + (rotated + h) * hd, ld, t->slots + i, 1, 1, hd,
                 hd, per_head, (uint16_t *)m->cache_k[l] + h * per_head * hd,
                 (uint16_t *)m->cache_v[l] + h * per_head * hd);
}

/* Token i's KV head h: `rows` of its g query heads from the r0-th over the token's context
   (decode attention of one sequence and one KV head: the cache's head h as a cache of one; each
   query row's arithmetic its own, so any split of the heads gives the same bits), into out and
   widened into xf (the token's rows) */
static int attend(const moe_model *m, const moe_token *t, long i, long l, long h, long r0,
                  long rows, const uint16_t *qk, uint16_t *out, float *xf) {
    long hd = m->head_dim, q = (h * (m->heads / m->kv_heads) + r0) * hd;
    long per_head = m->num_blocks * m->block_size * hd;
    int failed = PICK(decode_attention)(1, qk + q, (m->heads + m->kv_heads) * hd,
                                        (const uint16_t *)m->cache_k[l] + h * per_head,
                                        (const uint16_t *)m->cache_v[l] + h * per_head,
                                        t->tables + i * t->width, t->width, t->lengths + i, 1, 1,
                                        rows, hd, hd, m->num_blocks, m->block_size, m->scale,
                                        out + q, 1);
    widen(out + q, xf + q, rows * hd);
    return failed;
}

/* Parts to split each KV head's query heads into: 1 where the step's tokens give every thread a
   KV head; else the most that divide them, keep a part per thread and, where o's inputs are
   prepared in groups of `og`, hold whole groups (a 16-thread step of one token of 4 KV heads ran
   4 jobs). A part reads its head's keys and values again. */
static long query_parts(const moe_model *m, long n, int threads, long og) {
    long g = m->heads / m->kv_heads;
    for (long parts = g; parts > 1; parts--)
        if (g % parts == 0 && n * m->kv_heads * parts <= threads &&
            (!og || g / parts * m->head_dim % og == 0))
            return parts;
    return 1;
}

/* Token i's combine of its k experts' outputs (choice s's the row place[s] of ys) over `width`
   columns from c0: the combine is column by column, so any split of a row gives the row's bits.
   The rows were written by every thread; one thread reading them all waited on each line. */
static void combine_span(const moe_model *m, const uint16_t *ys, const int64_t *place,
                         const void *weights, long i, long c0, long width, uint16_t *delta) {
    long k = m->top_k, hidden = m->hidden;
    const void *r[k];
    for (long j = 0; j < k; j++) r[j] = ys + place[i * k + j] * hidden + c0;
    PICK(combine)(r, 1, (const char *)weights + i * k * (m->weights_bf16 ? 2 : 4),
                  m->weights_bf16, 1, k, width, 1, delta + i * hidden + c0, 1);
}

/* Column block c of layer l's gate|up product for the expert group grp (expert, first row,
   rows), its inputs xe [slots][hidden] (one row for all, n == 1) */
static void gate_up(const moe_model *m, long l, const long *grp, const float *xe, uint16_t *gu,
                    long c, long n) {
    long e = l * m->experts + grp[0], h = m->hidden, width = 2 * m->inter;
    product(m->format, m->group, xe + (n > 1) * grp[1] * h, m->gate_up[e], at(m->gate_up_scales, e),
            gu + grp[1] * width, width, h, c, grp[2]);
}

/* Column block c of layer l's down product for the expert group grp, its inputs gin
   [slots][inter] */
static void down(const moe_model *m, long l, const long *grp, const float *gin, uint16_t *ys,
                 long c) {
    long e = l * m->experts + grp[0];
    product(m->format, m->group, gin + grp[1] * m->inter, m->down[e], at(m->down_scales, e),
            ys + grp[1] * m->hidden, m->hidden, m->inter, c, grp[2]);
}

/* Columns c0 to c0 + width of a choice's gate|up row gu [2][inter] gated into `gated` and
   widened into gf, and where `prepared` is given, made there what down reads (whole groups):
   each column's own arithmetic, so any split of the row gives its bits */
static void gate(int format, long group, long inter, const uint16_t *gu, uint16_t *gated,
                 float *gf, float *prepared, long c0, long width) {
    PICK(silu_mul)(gu + c0, gu + inter + c0, gated + c0, width);
    widen(gated + c0, gf + c0, width);
    if (prepared) block_span(format, group, gf, prepared, inter, c0, width);
}

/* The layer's routed choices [n][k] grouped by expert (moe_group's stable counting sort: ties in
   choice order): order [n*k] the choices t*k + j so sorted, at [n*k] each choice's place in it,
   and the groups (expert, first place, rows) that have rows, returned as their number; next is
   scratch [experts] */
static long group_choices(const int64_t *routed, long slots, long experts, int64_t *next,
                          int64_t *order, int64_t *at, long *groups) {
    long count = 0;
    memset(next, 0, sizeof(int64_t) * experts);
    for (long s = 0; s < slots; s++) next[routed[s]]++;
    for (long e = 0, first = 0; e < experts; e++) {
        long rows = next[e];
        if (rows) {
            groups[3 * count] = e, groups[3 * count + 1] = first, groups[3 * count + 2] = rows;
            count++;
        }
        next[e] = first, first += rows;
    }
    for (long s = 0; s < slots; s++) order[next[routed[s]]] = s, at[s] = next[routed[s]]++;
    return count;
}

/* A build with MOE_STEP_PHASES (common/kernel_build.py builds one where MOE_MESH_STEP_PHASES=1)
   adds each phase's seconds on thread 0, its barrier's wait included, to moe_step_phases[phase]:
   bench/step_phases.py reads them, in this order. */
enum {
    PHASE_EMBED, PHASE_QKV, PHASE_KV_PREPARE, PHASE_ATTENTION, PHASE_O_TILES, PHASE_O_INPUTS,
    PHASE_O, PHASE_POST_NORM, PHASE_ROUTER, PHASE_ROUTE, PHASE_EXPERT_INPUTS, PHASE_GATE_UP,
    PHASE_SILU, PHASE_DOWN, PHASE_COMBINE, PHASE_NEXT_NORM, PHASE_LM_HEAD, STEP_PHASES
};
#ifdef MOE_STEP_PHASES
double moe_step_phases[STEP_PHASES];
long moe_step_phase_count(void) { return STEP_PHASES; }
#define PHASES_START double phase_mark = omp_get_wtime()
#define PHASE(p)                                                                               \
    if (omp_get_thread_num() == 0) {                                                           \
        double phase_now = omp_get_wtime();                                                    \
        moe_step_phases[p] += phase_now - phase_mark, phase_mark = phase_now;                  \
    }
#else
#define PHASES_START
#define PHASE(p)
#endif

/* A lone token's state where every thread keeps its own copy (a solo step): the residual
   stream, it normed, the experts' combined update, the next product's input; routing's
   probabilities, weights and grouping. Each thread computing these itself, from the same values
   with the same calls, takes the place of one thread computing them while the rest wait at a
   barrier, and of the barrier. */
typedef struct {
    int64_t *chosen, *order, *place, *next;
    long *groups, used;
    float *xf, *probs, *weights;
    uint16_t *x, *h, *delta;
} solo_state;

/* bytes of a thread's solo_state arrays, in 64-byte lines */
static size_t solo_bytes(const moe_model *m) {
    size_t k = m->top_k, words = 3 * k + m->experts + 3 * k;
    size_t bytes = 8 * words + 4 * (m->hidden + m->experts + k) + 2 * 3 * m->hidden;
    return (bytes + 63) / 64 * 64;
}

static solo_state solo_at(const moe_model *m, char *own) {
    solo_state s;
    long k = m->top_k, hidden = m->hidden;
    s.chosen = (int64_t *)own, s.order = s.chosen + k, s.place = s.order + k;
    s.next = s.place + k, s.groups = (long *)(s.next + m->experts), s.used = 0;
    s.xf = (float *)(s.groups + 3 * k), s.probs = s.xf + hidden, s.weights = s.probs + m->experts;
    s.x = (uint16_t *)(s.weights + k), s.h = s.x + hidden, s.delta = s.h + hidden;
    return s;
}

/* `stmt` on every thread of a solo step (each on its own state), else on one while the rest
   wait */
#define EACH_OR_ONE(stmt)                                                                      \
    if (solo) {                                                                                \
        stmt;                                                                                  \
    } else {                                                                                   \
        _Pragma("omp single") { stmt; }                                                        \
    }

/* The step of the tokens t: x [n][hidden] ends as the residual stream, h [n][hidden] as it normed
   by the final norm, logits [n][vocab] (with lm_head) as the LM head's bfloat16 product, chosen
   [layers][n][top_k] as each layer's experts in routing order. -1 without memory. */
int moe_decode_step(const moe_model *m, const moe_token *t, uint16_t *x, uint16_t *h,
                    uint16_t *logits, int64_t *chosen, int threads) {
    long n = t->count, hidden = m->hidden, hd = m->head_dim, k = m->top_k, inter = m->inter;
    long qkv_cols = (m->heads + 2 * m->kv_heads) * hd, attended = m->heads * hd;
    long widest = hidden > attended ? hidden : attended, rotated = (m->heads + m->kv_heads) * hd;
    long slots = n * k;
    /* per token: the float32 inputs, attention's output prepared for o; logits and
       probabilities; weights. Per choice: the expert's input, gate|up widened after gating and
       that prepared for down; the grouping. Halves per token: qkv, normed and rotated q|k,
       attention, a product's output; per choice: gate|up, gated, output */
    size_t floats = n * (widest + attended + 2 * m->experts + k) + slots * (hidden + 2 * inter);
    floats += hidden; /* a lone token's expert input, widened */
    size_t halves = n * (qkv_cols + 2 * rotated + attended + hidden) + slots * (3 * inter + hidden);
    /* order and at per choice, the groups, the sort's counters: 8 bytes */
    size_t words = 2 * slots + 3 * slots + m->experts;
    char *work = malloc(sizeof(float) * floats + sizeof(uint16_t) * halves + 8 * words);
    if (!work) return -1;
    /* the dense products' rows on AMX tiles (FORMAT_BF16_TILES, amx_kernel.c), each product
       where moe_linear would take them, so that the step keeps op by op's bits */
    int qkv_tiles = tiles_take(m->dense_format, n, hidden);
    int o_tiles = tiles_take(m->dense_format, n, attended);
    int head_tiles = m->lm_head && tiles_take(m->head_format, n, hidden);
    long tiled = qkv_tiles || head_tiles ? hidden : 0;
    if (o_tiles && attended > tiled) tiled = attended;
    uint16_t *xt = tiled ? malloc(sizeof(uint16_t) * tile_rows_size(n, tiled)) : 0;
    if (!xt) qkv_tiles = o_tiles = head_tiles = 0; /* no memory for them: the vector kernel's */
    int solo = n == 1 && !xt; /* each thread keeps a solo_state; 4 barriers a layer fewer */
    char *solos = solo ? aligned_alloc(64, threads * solo_bytes(m)) : 0;
    if (solo && !solos) {
        free(work), free(xt);
        return -1;
    }
    int64_t *order = (int64_t *)work, *place = order + slots;
    long *groups = (long *)(place + slots);
    int64_t *next = (int64_t *)(groups + 3 * slots);
    float *xf = (float *)(next + m->experts), *xo = xf + n * widest, *logit = xo + n * attended;
    float *probs = logit + n * m->experts, *weights = probs + n * m->experts;
    float *xe = weights + n * k, *gf = xe + slots * hidden, *gp = gf + slots * inter;
    float *xw = gp + slots * inter;
    uint16_t *qkv = (uint16_t *)(xw + hidden), *normed = qkv + n * qkv_cols;
    uint16_t *qk = normed + n * rotated, *out = qk + n * rotated, *delta = out + n * attended;
    uint16_t *gu = delta + n * hidden, *gated = gu + slots * 2 * inter, *ys = gated + slots * inter;
    void (*norm)(const uint16_t *, const uint16_t *, uint16_t *, const uint16_t *, uint16_t *,
                 long, long, float, int) = PICK(rms_norm);
    long up_blocks = 2 * inter / 64, down_blocks = hidden / 64, routed_groups = 0;
    long ex = m->experts, quads = (ex + 3) / 4;
    int f = m->format, df = m->dense_format, failed = 0;
    long g = m->group, dg = m->dense_group;
    /* Inputs prepared (int4, int8) by the threads that wrote them, where each holds whole groups,
       into rows of their own: o's by the attention jobs, down's by the gate|up jobs (which then
       take a gate block and its up block at once, and gate them). A phase of its own read every
       thread's writes from one, 20-26 us a layer at 16 threads (host D). */
    long og = prepared_group(df, dg, attended);
    long parts = query_parts(m, n, threads, og), share = m->heads / m->kv_heads / parts;
    int o_jobs = og && share * hd % og == 0;
    long gg = prepared_group(f, g, inter), unit = 64;
    while (gg && unit % gg) unit += 64; /* lcm(64, gg): whole blocks of whole groups */
    long units = inter % unit ? 0 : inter / unit;
    /* A lone token's expert input (every choice's) is made once, in spans of whole groups beside
       the router's logits, widened into xw first where it is then prepared */
    long ig = prepared_group(f, g, hidden), iunit = ig ? ig : 16;
    long ispan = (hidden / iunit + threads - 1) / threads * iunit;
    long inputs = n == 1 ? (hidden + ispan - 1) / ispan : 0;
    /* the combine's spans of columns, whole vectors: about a thread's share of the tokens' */
    long spans = n >= threads ? 1 : (threads + n - 1) / n;
    long span = (hidden / 16 + spans - 1) / spans * 16;
    spans = (hidden + span - 1) / span;
#pragma omp parallel num_threads(threads)
    {
        PHASES_START;
        /* the state this thread reads and writes: its own in a solo step, else the shared one */
        solo_state s = {0, order, place, next, groups, 0, xf, probs, weights, x, h, delta};
        if (solo) s = solo_at(m, solos + omp_get_thread_num() * solo_bytes(m));
        long *used_by = solo ? &s.used : &routed_groups;
        EACH_OR_ONE({
            for (long i = 0; i < n; i++)
                memcpy(s.x + i * hidden, t->embedding[i], sizeof(uint16_t) * hidden);
            norm(s.x, 0, 0, m->first_norm, s.h, n, hidden, m->eps, 1);
            widen(s.h, s.xf, n * hidden);
            next_rows(m, 0, s.xf, n);
            if (qkv_tiles) tile_rows(s.h, n, hidden, xt);
        });
        PHASE(PHASE_EMBED);
        for (long l = 0; l < m->layers; l++) {
            int64_t *routed = chosen + l * slots;
#pragma omp for schedule(static)
            for (long c = 0; c < qkv_cols / 64; c++)
                dense(df, dg, s.xf, qkv_tiles ? xt : 0, m->qkv[l], at(m->qkv_scales, l), qkv,
                      qkv_cols, hidden, c, n);
            PHASE(PHASE_QKV);
            if (parts > 1) {
#pragma omp for schedule(static)
                for (long job = 0; job < n * m->kv_heads; job++) {
                    long i = job / m->kv_heads, kh = job % m->kv_heads;
                    prepare(m, t, i, l, kh, qkv, normed, qk);
                }
                PHASE(PHASE_KV_PREPARE);
            }
#pragma omp for schedule(static)
            for (long job = 0; job < n * m->kv_heads * parts; job++) {
                long i = job / (m->kv_heads * parts), kh = job / parts % m->kv_heads;
                if (parts == 1) /* the head's whole: prepared by the job that attends */
                    prepare(m, t, i, l, kh, qkv, normed, qk);
                long r0 = job % parts * share, q0 = (kh * (m->heads / m->kv_heads) + r0) * hd;
                if (attend(m, t, i, l, kh, r0, share, qk + i * rotated, out + i * attended,
                           xf + i * attended)) {
#pragma omp atomic write
                    failed = 1;
                }
                if (o_jobs) block_span(df, dg, xf + i * attended, xo + i * attended, attended, q0,
                                       share * hd);
            }
            PHASE(PHASE_ATTENTION);
            if (o_tiles) {
#pragma omp single
                tile_rows(out, n, attended, xt);
                PHASE(PHASE_O_TILES);
            }
            if (prepared(df, attended) && !o_jobs) {
#pragma omp for schedule(static)
                for (long i = 0; i < n; i++) block_rows(df, dg, xf + i * attended, 1, attended);
                PHASE(PHASE_O_INPUTS);
            }
#pragma omp for schedule(static)
            for (long c = 0; c < hidden / 64; c++)
                dense(df, dg, o_jobs ? xo : xf, o_tiles ? xt : 0, m->o[l], at(m->o_scales, l),
                      delta, hidden, attended, c, n);
            PHASE(PHASE_O);
            EACH_OR_ONE(norm(s.x, delta, s.x, m->post_norm[l], s.h, n, hidden, m->eps, 1));
            PHASE(PHASE_POST_NORM);
#pragma omp for schedule(static)
            for (long job = 0; job < n * quads + inputs; job++) {
                if (job < n * quads) { /* a token's experts, four a job */
                    long i = job / quads, e = job % quads * 4, last = e + 4 < ex ? e + 4 : ex;
                    router_logits(s.h + i * hidden, m->router[l], hidden, e, last, logit + i * ex);
                } else { /* a span of a lone token's expert input */
                    long c0 = (job - n * quads) * ispan;
                    long width = hidden - c0 < ispan ? hidden - c0 : ispan;
                    widen(s.h + c0, (ig ? xw : xe) + c0, width);
                    if (ig) block_span(f, g, xw, xe, hidden, c0, width);
                }
            }
            PHASE(PHASE_ROUTER);
            EACH_OR_ONE({
                int64_t *picked = solo ? s.chosen : routed;
                for (long i = 0; i < n; i++)
                    route_token(logit + i * ex, s.probs + i * ex, ex, k, m->renorm,
                                m->weights_bf16,
                                (char *)s.weights + i * k * (m->weights_bf16 ? 2 : 4),
                                picked + i * k);
                *used_by = group_choices(picked, slots, ex, s.next, s.order, s.place, s.groups);
                if (solo && omp_get_thread_num() == 0) memcpy(routed, picked, sizeof(int64_t) * k);
            });
            PHASE(PHASE_ROUTE);
            long used = *used_by; /* groups of routed rows, in s.groups */
            if (n > 1) {
#pragma omp for schedule(static)
                for (long p = 0; p < slots; p++) { /* each choice's input: its token's row */
                    widen(h + order[p] / k * hidden, xe + p * hidden, hidden);
                    block_rows(f, g, xe + p * hidden, 1, hidden);
                }
                PHASE(PHASE_EXPERT_INPUTS);
            }
            if (units) {
                /* a job: `chunk` columns of an expert's gate and up, gated; the fewest jobs that
                   give each thread two, so that a thread reads long runs of each panel (host C's
                   2 threads ran 4-10% slower in jobs of 128 columns) */
                long chunks = 1;
                while (chunks < units && (units % chunks || used * chunks < 2 * threads)) chunks++;
                long chunk = units / chunks * unit;
#pragma omp for schedule(static)
                for (long job = 0; job < used * chunks; job++) {
                    long *grp = s.groups + 3 * (job / chunks), c0 = job % chunks * chunk;
                    for (long half = 0; half < 2; half++) /* gate's blocks, then up's */
                        for (long c = c0 / 64; c < (c0 + chunk) / 64; c++)
                            gate_up(m, l, grp, xe, gu, c + half * inter / 64, n);
                    for (long r = grp[1]; r < grp[1] + grp[2]; r++)
                        gate(f, g, inter, gu + r * 2 * inter, gated + r * inter, gf + r * inter,
                             gg ? gp + r * inter : 0, c0, chunk);
                }
                PHASE(PHASE_GATE_UP);
            } else {
#pragma omp for schedule(static)
                for (long b = 0; b < used * up_blocks; b++)
                    gate_up(m, l, s.groups + 3 * (b / up_blocks), xe, gu, b % up_blocks, n);
                PHASE(PHASE_GATE_UP);
#pragma omp for schedule(static)
                for (long r = 0; r < slots; r++) {
                    gate(f, g, inter, gu + r * 2 * inter, gated + r * inter, gf + r * inter, 0, 0,
                         inter);
                    block_rows(f, g, gf + r * inter, 1, inter);
                }
                PHASE(PHASE_SILU);
            }
            const float *gin = units && gg ? gp : gf; /* down's inputs */
#pragma omp for schedule(static)
            for (long b = 0; b < used * down_blocks; b++)
                down(m, l, s.groups + 3 * (b / down_blocks), gin, ys, b % down_blocks);
            PHASE(PHASE_DOWN);
            if (solo) { /* the whole row, on each thread */
                combine_span(m, ys, s.place, s.weights, 0, 0, hidden, s.delta);
            } else {
#pragma omp for schedule(static)
                for (long job = 0; job < n * spans; job++) {
                    long c0 = job % spans * span;
                    combine_span(m, ys, place, weights, job / spans, c0,
                                 hidden - c0 < span ? hidden - c0 : span, delta);
                }
            }
            PHASE(PHASE_COMBINE);
            EACH_OR_ONE({
                norm(s.x, s.delta, s.x, m->next_norm[l], s.h, n, hidden, m->eps, 1);
                widen(s.h, s.xf, n * hidden);
                next_rows(m, l + 1, s.xf, n);
                if (qkv_tiles || (head_tiles && l == m->layers - 1)) tile_rows(s.h, n, hidden, xt);
            });
            PHASE(PHASE_NEXT_NORM);
        }
        if (m->lm_head) {
#pragma omp for schedule(static)
            for (long c = 0; c < m->vocab / 64; c++)
                dense(m->head_format, m->head_group, s.xf, head_tiles ? xt : 0, m->lm_head,
                      m->head_scales, logits, m->vocab, hidden, c, n);
            PHASE(PHASE_LM_HEAD);
        }
        if (solo && omp_get_thread_num() == 0) { /* the step's outputs */
            memcpy(x, s.x, sizeof(uint16_t) * hidden);
            memcpy(h, s.h, sizeof(uint16_t) * hidden);
        }
    }
    free(work), free(xt), free(solos);
    return failed ? -1 : 0;
}

typedef struct { /* greedy decode steps of one sequence (moe_decode_burst); ctypes mirrors it */
    long token, start, steps;   /* the first step's input, its position; at most this many steps */
    const uint16_t *embed;      /* the embedding [embed_rows][hidden] */
    long embed_rows;
    const uint16_t *cos, *sin;  /* RoPE's [positions][head_dim], past start + steps - 1 */
    const int64_t *table;       /* the sequence's block table [width], covering those positions */
    long width, block_size;
    const int64_t *ending;      /* [endings]: tokens that end the sequence */
    long endings;
    const volatile int *halt;   /* set (by another thread): end at the next token */
    double deadline;            /* CLOCK_MONOTONIC seconds, time.monotonic()'s clock; 0: none */
} moe_burst;

static double monotonic(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

/* Up to b->steps decode steps of one sequence, each step's input the argmax of the last one's
   logits (moe_argmax_bf16; the LM head in the call): tokens [steps], and each layer's experts
   over the steps, chosen [layers][steps][top_k]. The steps Python called one by one, without
   the interpreter's 0.2 ms between them (its code and data cold once a step's weights went
   through the caches). After the first step it ends once halt is set or the deadline passed;
   after a token that ends the sequence or that the embedding lacks (the caller's next step
   refuses it). Returns the tokens made, -1 where a step had no memory. */
int moe_decode_burst(const moe_model *m, const moe_burst *b, uint16_t *x, uint16_t *h,
                     uint16_t *logits, int64_t *chosen, int64_t *tokens, int threads) {
    long token = b->token, made = 0, hd = m->head_dim, k = m->top_k;
    int64_t length, slot, step[m->layers * k];
    const uint16_t *embedding, *cos, *sin;
    moe_token t = {1, &embedding, &cos, &sin, b->table, b->width, &length, &slot};
    for (long i = 0; i < b->steps; i++) {
        if (i && (*b->halt || (b->deadline > 0 && monotonic() >= b->deadline))) break;
        long position = b->start + i;
        length = position + 1;
        slot = b->table[position / b->block_size] * b->block_size + position % b->block_size;
        embedding = b->embed + token * m->hidden;
        cos = b->cos + position * hd, sin = b->sin + position * hd;
        if (moe_decode_step(m, &t, x, h, logits, step, threads)) return -1;
        for (long l = 0; l < m->layers; l++)
            memcpy(chosen + (l * b->steps + i) * k, step + l * k, sizeof(int64_t) * k);
        tokens[made++] = token = moe_argmax_bf16(logits, m->vocab);
        int ends = token >= b->embed_rows;
        for (long e = 0; e < b->endings; e++) ends |= token == b->ending[e];
        if (ends) break;
    }
    return (int)made;
}
