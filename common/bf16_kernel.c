/* bfloat16 linear layers, gated FFNs and RMSNorm for CPUs without native bfloat16 arithmetic
   (AVX-512F/BW or AVX2+FMA is enough), the products over bfloat16 weights or int8 and int4 ones
   (quant_kernel.c); a layer's expert grouping and combine, RoPE, the KV-cache write and decode
   attention over the paged cache in bfloat16 and float32.

   y[M][N] = x[M][K] . W^T, all bfloat16, with W [N][K] held in panels of 32 output columns
   whose steps go in pairs: P[panel][K / 2][32][2], column c's steps 2t and 2t + 1 side by side
   in one 32-bit word (for an odd K, the last step alone after them, P[panel][K - 1][32]). A
   bfloat16 is a float32's upper half, so a word shifted left by 16 is step 2t's weight as a
   float32 and the word with its low half cleared is step 2t + 1's: no arithmetic, and a
   register's lanes are consecutive columns whatever its width. The same words are AMX's VNNI
   order, so the tiles (amx_kernel.c) load them as they are.

   Every output element sums x[m][k] * W[n][k] over k in order, one float32 accumulator each:
   a row's result does not depend on the other rows of the batch (expert services merge callers),
   and is as accurate as a float32-accumulating GEMM rounded to bfloat16 once at the end.

   The vector kernels are written once, over 16 float32 lanes (`vec`), and compiled twice: this
   file includes itself once for AVX-512 (a vec is one register) and once for AVX2+FMA (two), and
   each entry point picks by the CPU it runs on (moe_bf16_supported). A lane's arithmetic and the
   order of every sum are the same in both, so both give the same bits; only the linear kernels'
   register blocking differs (32 registers or 16). */

#ifndef ISA /* the part that does not depend on the instruction set, read once */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PANEL 32
/* Panel rows prefetched ahead (2 KiB): the hardware prefetcher alone left one- and two-row
   products at 20 GB/s on 256 MiB of weights, this at 25 (prefetches past the end never fault) */
#define AHEAD 32

static int tiles_granted(void); /* amx_kernel.c */

/* What this CPU runs: 3 AVX-512F/BW and AMX's bfloat16 tiles, 2 AVX-512F/BW, 1 AVX2+FMA, 0
   neither (only the scalar kernels: pack, group, rope, kv_write). */
int moe_bf16_supported(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return tiles_granted() ? 3 : 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int level_cap = 3;
/* Run no higher than `level` (MOE_MESH_MAX_ISA, and tests: the AVX2 kernels on an AVX-512 host
   too; 2 also leaves out int8's integer dot products, whose bits are the CPU's own: int_dot.c) */
void moe_bf16_limit(int level) { level_cap = level; }

static int avx512(void) { return level_cap >= 2 && moe_bf16_supported() >= 2; }
#define PICK(name) (avx512() ? name##_avx512 : name##_avx2)

/* w [N][K] -> out [N / 32][K / 2][32][2] (and an odd K's last step [32]); N a multiple of 32.
   common/bf16.py names this layout (LAYOUT): a change here changes that name, or packed-weight
   cache files of the old layout look valid. */
void moe_bf16_pack(const uint16_t *w, uint16_t *out, long n, long k) {
    for (long panel = 0; panel < n / PANEL; panel++)
        for (long i = 0; i < k; i++)
            for (int c = 0; c < PANEL; c++) {
                long pair = i - i % 2, at = i + 1 < k || i % 2 ? pair * PANEL + 2 * c + i % 2
                                                              : i * PANEL + c;
                out[panel * k * PANEL + at] = w[(panel * PANEL + c) * k + i];
            }
}

static inline float bf16_value(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_round(float f) { /* to the nearest bfloat16, ties to even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return bf16_value(0x7FC0);
    return bf16_value((uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16));
}

/* The index of the largest of v [n] (bfloat16), as engine/sampling.py's greedy picks it from
   their float32 values: NaN never wins, infinities count as the largest and smallest finite
   values (nan_to_num), the first of equals wins. A burst's greedy token (engine/fused.py): its
   torch ops ran cold after a step's weights went through the caches, 0.1-0.2 ms a token. */
int moe_argmax_bf16(const uint16_t *v, long n) {
    long best = 0;
    float top = 0.0f;
    for (long i = 0; i < n; i++) {
        float x = bf16_value(v[i]);
        if (x != x)
            x = -INFINITY;
        else if (isinf(x))
            x = x > 0 ? FLT_MAX : -FLT_MAX;
        if (i == 0 || x > top) top = x, best = i;
    }
    return (int)best;
}

/* bfloat16 x [n] widened to float32 out: a bfloat16 is a float32's upper half */
static void widen(const uint16_t *x, float *out, long n) {
    for (long i = 0; i < n; i++) ((uint32_t *)out)[i] = (uint32_t)x[i] << 16;
}

/* Weight formats (common/quant.py): bfloat16 panels (moe_bf16_pack), int8, int4, FP8 or MXFP4
   panels with their scales (quant_kernel.c); bfloat16 panels whose products may run on AMX tiles
   (amx_kernel.c: a row's bits then depend on its product's row count) */
enum { FORMAT_BF16, FORMAT_INT8, FORMAT_INT4, FORMAT_FP8, FORMAT_MXFP4, FORMAT_BF16_TILES };

static long block_bytes(int format, long k) { /* a 64-column block's weights */
    return format == FORMAT_BF16 || format == FORMAT_BF16_TILES ? 128 * k
           : format == FORMAT_INT4 || format == FORMAT_MXFP4 ? 32 * k
                                                               : 64 * k;
}

#define ISA 512
#include "bf16_kernel.c" /* itself, once per instruction set */
#undef ISA
#define ISA 256
#include "bf16_kernel.c" /* itself, once per instruction set */
#undef ISA
#include "amx_kernel.c"

typedef void (*block_fn)(const float *x, const void *w, const void *scales, uint16_t *y, long ldy,
                         long m, long k, long group, const float *bias);

static block_fn pick_block(int format) {
    return format == FORMAT_INT8   ? (avx512() ? int8_block_dot512 : int8_block)
           : format == FORMAT_INT4 ? (vnni() ? int4_block512 : int4_block)
           : format == FORMAT_FP8  ? fp8_block
           : format == FORMAT_MXFP4 ? (avx512() ? mxfp4_block512 : mxfp4_block)
                                   : PICK(bf16_block); /* FORMAT_BF16 and _TILES */
}

static long block_scale_bytes(int format, long k, long group) { /* and its scales */
    return format == FORMAT_INT8   ? 64 * 4
           : format == FORMAT_INT4 || format == FORMAT_MXFP4 ? 64 * (k / group) * 2
           : format == FORMAT_FP8  ? 2 * (k / group) * 4
                                   : 0;
}

/* Whether `format`'s blocks read rows prepared by block_rows, not the widened floats */
static int prepared(int format, long k) {
    return format == FORMAT_INT4 || (format == FORMAT_INT8 && q8_dot(k));
}

/* Rows xf [m][k], widened, made what `format`'s blocks read: int4's and int8's prepared in place
   where their products are integer dot products (int_dot.c) */
static void block_rows(int format, long group, float *xf, long m, long k) {
    if (format == FORMAT_INT4) q4_prepare(xf, m, k, group);
    if (format == FORMAT_INT8) q8_prepare(xf, m, k);
}

/* The inputs a group of `format`'s rows of k holds once block_rows prepared them; 0 where they
   stay floats */
static long prepared_group(int format, long group, long k) {
    if (format == FORMAT_INT4) return dot_groups(k, group) ? group : 0;
    return prepared(format, k) ? q8_group(k) : 0;
}

/* Inputs c0 to c0 + width of row xf [k], whole groups of prepared_group, prepared as block_rows
   prepares them but into row out [k] */
static void block_span(int format, long group, const float *xf, float *out, long k, long c0,
                       long width) {
    if (format == FORMAT_INT4) q4_prepare_span(xf, out, k, group, c0, width);
    if (format == FORMAT_INT8) q8_prepare_span(xf, out, k, c0, width);
}

/* x [m][k] bfloat16, w a weight [n][k] in `format` (scales with it, NULL for bfloat16), bias [n]
   float32 or NULL, y [m][n] bfloat16; n a multiple of 64. Columns are split over `threads` OpenMP
   threads. x is widened to float32 once, here (every column block reads it); -1 when there is
   no memory for that. */
int moe_linear(int format, long group, const uint16_t *x, const void *w, const void *scales,
               const float *bias, uint16_t *y, long m, long n, long k, int threads) {
    if (tiles_take(format, m, k)) return tile_linear(x, w, bias, y, m, n, k, threads);
    float *xf = malloc(sizeof(float) * m * k);
    if (!xf) return -1;
    block_fn block = pick_block(format);
    long wb = block_bytes(format, k), sb = block_scale_bytes(format, k, group);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < m; r++) {
            widen(x + r * k, xf + r * k, k);
            block_rows(format, group, xf + r * k, 1, k);
        }
#pragma omp for schedule(static)
        for (long c = 0; c < n / 64; c++)
            block(xf, (const char *)w + c * wb, scales ? (const char *)scales + c * sb : 0,
                  y + c * 64, n, m, k, group, bias ? bias + c * 64 : 0);
    }
    free(xf);
    return 0;
}

/* y [m][n] = x [m][k] . W^T (+ bias [n]), all float32, W [n][k] as stored, k a multiple of 8:
   blocks of W's rows split over `threads` OpenMP threads (f32_kernel.c) */
void moe_f32_linear(const float *x, const float *w, const float *bias, float *y, long m, long n,
                    long k, int threads) {
    long width = m == 1 ? 8 : 4, blocks = n / width;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < blocks; c++)
        f32_block(x, w + c * width * k, bias ? bias + c * width : 0, y + c * width, n, m, k);
    for (long j = blocks * width; j < n; j++)
        for (long r = 0; r < m; r++)
            f32_1_1(x + r * k, w + j * k, bias ? bias + j : 0, y + r * n + j, n, k);
}

/* y [m][n] = x [m][k] . W^T, all float32, W [n][k] as stored, m 1 or 2 to 15, k a multiple of
   16: MKL's sums for such a product on AVX-512 (f32_lanes.c), blocks of W's rows split over
   `threads` OpenMP threads. -1 where the CPU lacks AVX-512 or the shape is not one of those. */
int moe_sgemm_lanes16(const float *x, const float *w, float *y, long m, long n, long k,
                      int threads) {
    if (!avx512() || m < 1 || m > 15 || k < 16 || k % 16) return -1;
    if (m == 1) { /* sgemv's order, 8 rows of W a block */
        long rows = n / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long c = 0; c < rows; c++) gemv16_8_avx512(x, w + c * 8 * k, y + c * 8, k);
        for (long j = rows * 8; j < n; j++) gemv16_1_avx512(x, w + j * k, y + j, k);
        return 0;
    }
    long blocks = n / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < blocks; c++)
        lanes16_block_avx512(x, w + c * 4 * k, y + c * 4, n, m, k,
                             c + 1 < blocks ? (const char *)(w + (c + 1) * 4 * k) : 0);
    for (long j = blocks * 4; j < n; j++)
        for (long r = 0; r < m; r++)
            lanes16_1_1_avx512(x + r * k, w + j * k, y + r * n + j, n, k, 0);
    return 0;
}

/* RMSNorm of rows x [m][h] by weight [h] into y, all bfloat16, h a multiple of 16, computed as
   transformers computes it: in float32, the normalised row rounded to bfloat16, then multiplied
   by the weight and rounded again. One call instead of the eight torch ops of that recipe.
   With `delta`, the row normalised is x + delta (rounded, as torch's add rounds), written to
   `sum`: a residual addition and the norm after it in one call. */
void moe_bf16_rms_norm(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *w,
                       uint16_t *y, long m, long h, float eps, int threads) {
    PICK(rms_norm)(x, delta, sum, w, y, m, h, eps, threads);
}

/* A layer's tokens grouped by routed expert (a stable counting sort): experts [n][k] (int64, each
   below num_experts) -> order [n*k], the flat choices t*k + j sorted by expert with ties in
   choice order, tokens [n*k] = order / k, counts [num_experts]. -1 for an expert id out of
   range, or without memory. */
int moe_group(const int64_t *experts, long n, long k, long num_experts, int64_t *order,
              int64_t *tokens, int64_t *counts) {
    long total = n * k;
    int64_t *next = calloc(num_experts ? num_experts : 1, sizeof *next);
    if (!next) return -1;
    memset(counts, 0, num_experts * sizeof *counts);
    for (long s = 0; s < total; s++) {
        if (experts[s] < 0 || experts[s] >= num_experts) {
            free(next);
            return -1;
        }
        counts[experts[s]]++;
    }
    for (long e = 1; e < num_experts; e++) next[e] = next[e - 1] + counts[e - 1];
    for (long s = 0; s < total; s++) {
        int64_t at = next[experts[s]]++;
        order[at] = s;
        tokens[at] = s / k;
    }
    free(next);
    return 0;
}

/* A layer's expert combine: y[t] = sum over j < k of weights[t*k + j] * (the output row of choice
   j of token t), choices in order, as torch computes it from the expert outputs (groups[g]:
   rows [sizes[g]][h], float32 or bfloat16, row r holding slot slots[g][r] = t*k + j): each
   product in the product's dtype (bfloat16 only when rows and weights both are), summed in
   float32 from 0, then y (float32 or bfloat16) rounded once. h a multiple of 16. -1 when the
   slots are not every one of n*k exactly once (nothing is written), or without memory. */
int moe_combine(const void *const *groups, const long *const *slots, const long *sizes, long count,
                int rows_bf16, const void *weights, int weights_bf16, long n, long k, long h,
                int y_bf16, void *y, int threads) {
    long total = n * k;
    const void **row = calloc(total ? total : 1, sizeof *row);
    if (!row) return -1;
    long seen = 0;
    for (long g = 0; g < count; g++)
        for (long r = 0; r < sizes[g]; r++) {
            long s = slots[g][r];
            if (s < 0 || s >= total || row[s]) {
                free(row);
                return -1;
            }
            row[s] = (const char *)groups[g] + r * h * (rows_bf16 ? 2 : 4);
            seen++;
        }
    if (seen == total)
        PICK(combine)(row, rows_bf16, weights, weights_bf16, n, k, h, y_bf16, y, threads);
    free(row);
    return seen == total ? 0 : -1;
}

/* Experts' FFNs, down(silu(gate) * up) with gate|up = gate_up(x), both weights in `format` (as
   moe_linear takes them; the scale arrays NULL for bfloat16), for `count` experts of one layer in one call (SGLang's CPU fused_experts, the combine left to
   moe_combine): expert g's rows x[g] [m[g]][hidden] through its weights gate_up[g] and down[g]
   into y[g]. Every intermediate is rounded to bfloat16 where torch's ops round it (the product,
   silu, the gated product), so rows are what the op-by-op recipe gives to within a rounding,
   and independent of their batch-mates and of the other experts. One thread team for the whole
   layer: each phase's work is every expert's 64-column blocks together, so the threads share
   it however few rows each expert has, instead of splitting each small product in turn. -1
   when there is no memory for the intermediates. */
int moe_silu_ffns(int format, long group, const uint16_t *const *x, const void *const *gate_up,
                  const void *const *gate_up_scales, const void *const *down,
                  const void *const *down_scales, uint16_t *const *y, const long *m, long count,
                  long inter, long hidden, int threads) {
    long *start = malloc(sizeof(long) * (count + 1)); /* expert g's rows: [start[g], start[g+1]) */
    if (!start) return -1;
    start[0] = 0;
    for (long g = 0; g < count; g++) start[g + 1] = start[g] + m[g];
    long rows = start[count];
    float *xf = malloc(sizeof(float) * rows * hidden);     /* the inputs, widened */
    uint16_t *h = malloc(sizeof(uint16_t) * rows * 3 * inter); /* gate|up, then gated */
    float *gf = malloc(sizeof(float) * rows * inter);      /* the gated product, widened */
    if (!xf || !h || !gf) {
        free(start), free(xf), free(h), free(gf);
        return -1;
    }
    uint16_t *gated = h + rows * 2 * inter;
    block_fn block = pick_block(format);
    long up_bytes = block_bytes(format, hidden), up_scales = block_scale_bytes(format, hidden, group);
    long down_bytes = block_bytes(format, inter);
    long down_scales_bytes = block_scale_bytes(format, inter, group);
    void (*silu_mul)(const uint16_t *, const uint16_t *, uint16_t *, long) = PICK(silu_mul);
    long up_blocks = 2 * inter / 64, down_blocks = hidden / 64;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long g = 0; g < count; g++) {
            widen(x[g], xf + start[g] * hidden, m[g] * hidden);
            block_rows(format, group, xf + start[g] * hidden, m[g], hidden);
        }
#pragma omp for schedule(static)
        for (long b = 0; b < count * up_blocks; b++) {
            long g = b / up_blocks, c = b % up_blocks;
            if (m[g])
                block(xf + start[g] * hidden, (const char *)gate_up[g] + c * up_bytes,
                      gate_up_scales ? (const char *)gate_up_scales[g] + c * up_scales : 0,
                      h + start[g] * 2 * inter + c * 64, 2 * inter, m[g], hidden, group, 0);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            silu_mul(h + r * 2 * inter, h + r * 2 * inter + inter, gated + r * inter, inter);
            widen(gated + r * inter, gf + r * inter, inter);
            block_rows(format, group, gf + r * inter, 1, inter);
        }
#pragma omp for schedule(static)
        for (long b = 0; b < count * down_blocks; b++) {
            long g = b / down_blocks, c = b % down_blocks;
            if (m[g])
                block(gf + start[g] * inter, (const char *)down[g] + c * down_bytes,
                      down_scales ? (const char *)down_scales[g] + c * down_scales_bytes : 0,
                      y[g] + c * 64, hidden, m[g], inter, group, 0);
        }
    }
    free(start), free(xf), free(h), free(gf);
    return 0;
}

/* RoPE of x [n][heads][d] (tokens ldx elements apart, heads d apart) by cos, sin [n][d] into
   out [n][heads][d]: x * cos + rotate_half(x) * sin, where rotate_half(x) is (-x2, x1). Each
   product and the sum round as torch's three ops round them: no fused multiply-add (the file is
   built with -ffp-contract=off), and in bfloat16 a rounding after each. */
void moe_rope_f32(const float *x, long ldx, const float *cos, const float *sin, float *out,
                  long n, long heads, long d) {
    long half = d / 2;
    for (long t = 0; t < n; t++)
        for (long h = 0; h < heads; h++) {
            const float *v = x + t * ldx + h * d, *c = cos + t * d, *s = sin + t * d;
            float *o = out + (t * heads + h) * d;
            for (long i = 0; i < half; i++) o[i] = v[i] * c[i] + (-v[i + half]) * s[i];
            for (long i = half; i < d; i++) o[i] = v[i] * c[i] + v[i - half] * s[i];
        }
}

void moe_rope_bf16(const uint16_t *x, long ldx, const uint16_t *cos, const uint16_t *sin,
                   uint16_t *out, long n, long heads, long d) {
    long half = d / 2;
    if (d % 32 == 0 && level_cap >= 1 && moe_bf16_supported() >= 1) { /* vectors: same bits */
        for (long t = 0; t < n; t++)
            PICK(rope_rows)(x + t * ldx, cos + t * d, sin + t * d, out + t * heads * d, heads, d);
        return;
    }
    for (long t = 0; t < n; t++)
        for (long h = 0; h < heads; h++) {
            const uint16_t *v = x + t * ldx + h * d, *c = cos + t * d, *s = sin + t * d;
            uint16_t *o = out + (t * heads + h) * d;
            for (long i = 0; i < d; i++) {
                float turned = i < half ? -bf16_value(v[i + half]) : bf16_value(v[i - half]);
                float a = bf16_round(bf16_value(v[i]) * bf16_value(c[i]));
                float b = bf16_round(turned * bf16_value(s[i]));
                float sum = bf16_round(a + b);
                uint32_t bits;
                memcpy(&bits, &sum, sizeof bits);
                o[i] = (uint16_t)(bits >> 16);
            }
        }
}

/* Decode attention straight from the paged KV cache: one new query token per sequence, so no
   gathered copy of the contexts and no SDPA call per layer (together ~200 us a layer at batch 1).
   q [d][kv_heads][g][hd] (the g query heads sharing a KV head; sequences ldq apart), the layer's
   cache k [kv_heads][num_blocks][bs][hd] and v [...][vd], block tables [d][width], context
   lengths [d] (each >= 1); out [d][kv_heads][g][vd]. `bf`: q, the cache and out are bfloat16,
   else float32; hd and vd multiples of 16.

   Computed as torch's CPU flash-attention kernel computes a context of up to 512 keys: scores in
   float32 times `scale`, softmax against the row's maximum, in bfloat16 the probabilities
   rounded to bfloat16 before they weight the values, the weighted sum divided by the sum of the
   unrounded exponentials. Torch's exp there is a 20-bit approximation and its dot products and
   sums run in another order, so results may differ from SDPA's in the last bit. */
int moe_decode_attention(int bf, const void *q, long ldq, const void *kc, const void *vc,
                         const int64_t *tables, long width, const int64_t *lengths, long d,
                         long kv_heads, long g, long hd, long vd, long num_blocks, long bs,
                         float scale, void *out, int threads) {
    return PICK(decode_attention)(bf, q, ldq, kc, vc, tables, width, lengths, d, kv_heads, g, hd,
                                  vd, num_blocks, bs, scale, out, threads);
}

/* Store n tokens' new keys k [n][kv_heads][hd] and values v [...][vd] (tokens ldk and ldv
   elements apart, heads contiguous) at their cache slots (block * bs + offset) of one layer's
   cache k [kv_heads][num_blocks * bs][hd] and v: what index_copy_ does, without its transposes. */
void moe_kv_write(int bf, const void *k, long ldk, const void *v, long ldv, const int64_t *slots,
                  long n, long kv_heads, long hd, long vd, long slots_per_head, void *kc,
                  void *vc) {
    size_t size = bf ? 2 : 4;
    for (long t = 0; t < n; t++)
        for (long h = 0; h < kv_heads; h++) {
            long at = h * slots_per_head + slots[t];
            memcpy((char *)kc + at * hd * size, (const char *)k + (t * ldk + h * hd) * size,
                   hd * size);
            memcpy((char *)vc + at * vd * size, (const char *)v + (t * ldv + h * vd) * size,
                   vd * size);
        }
}

/* A decode-only step's whole attention after the qkv product, in one call: RoPE of q and k
   (qkv [d][heads + 2 * kv_heads][hd], rows ldqkv apart; cos, sin [d][hd]) into qk, the keys and
   values written to their cache slots, then decode attention of the rotated queries into out
   [d][heads][hd]. qk is scratch [d][heads + kv_heads][hd]. Returns what the attention returns. */
int moe_decode_step_attention(int bf, const void *qkv, long ldqkv, const void *cos,
                              const void *sin, void *qk, const int64_t *slots, void *kc, void *vc,
                              const int64_t *tables, long width, const int64_t *lengths, long d,
                              long heads, long kv_heads, long hd, long num_blocks, long bs,
                              float scale, void *out, int threads) {
    long rotated = heads + kv_heads, size = bf ? 2 : 4;
    if (bf)
        moe_rope_bf16(qkv, ldqkv, cos, sin, qk, d, rotated, hd);
    else
        moe_rope_f32(qkv, ldqkv, cos, sin, qk, d, rotated, hd);
    const char *k = (const char *)qk + heads * hd * size;
    const char *v = (const char *)qkv + rotated * hd * size;
    moe_kv_write(bf, k, rotated * hd, v, ldqkv, slots, d, kv_heads, hd, hd, num_blocks * bs, kc, vc);
    return moe_decode_attention(bf, qk, rotated * hd, kc, vc, tables, width, lengths, d, kv_heads,
                                heads / kv_heads, hd, hd, num_blocks, bs, scale, out, threads);
}

/* The BLAS sgemm torch's F.linear calls (MKL's `sgemm_`, Fortran arguments), and MKL's
   MKL_Set_Num_Threads_Local (its C name: the lower-case one takes a pointer), found by the caller */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                         const float *, const float *, const int *, const float *, const int *,
                         const float *, float *, const int *);
typedef int (*threads_fn)(int);

#include "sgemv4.c" /* one-row products summed as MKL sums them off Intel's kernels */

/* y [n][out] = x [n][k] · wᵀ, w [out][k] float32, out a multiple of 64: F.linear's products
   split over `threads`, each thread calling `sgemm` on one thread for its share of w's rows,
   in 64-row blocks. MKL mostly gives an output the same bits whichever 64-aligned block of rows
   computes it (common/float32.py checks each shape before it relies on that); alone, it runs a
   product of a few rows on one thread, at half the host's read bandwidth on 2 cores. One-row
   products go to moe_sgemv4 instead where common/float32.py found MKL summing as it does: every
   block starts a multiple of 64 rows in, so at the whole weight's alignment, which sets its
   head. */
void moe_sgemm_rows(void *sgemm, void *set_threads, const float *x, const float *w, float *y,
                    long n, long out, long k, int threads) {
    long blocks = out / 64;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1 || n < 1 || k < 1) return;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        long first = blocks * t / threads * 64, rows = blocks * (t + 1) / threads * 64 - first;
        if (n == 1 && sgemv4_on) {
            moe_sgemv4(x, w + first * k, y + first, rows, k);
            continue;
        }
        int m = (int)rows, cols = (int)n, depth = (int)k, ldc = (int)out;
        float one = 1.0f, zero = 0.0f;
        int before = ((threads_fn)set_threads)(1); /* MKL's own threads stay out of the team */
        ((sgemm_fn)sgemm)("T", "N", &m, &cols, &depth, &one, w + first * k, &depth, x, &depth,
                          &zero, y + first, &ldc);
        ((threads_fn)set_threads)(before);
    }
}

#include "decode_kernel.c" /* a whole decode step in one call */
#include "f32_step.c"      /* and a float32 one, with torch's bits */
#include "f32_experts.c"   /* a layer's float32 experts, with F.linear's bits */

#else /* ISA is 512 or 256: the vector kernels, for that instruction set */

/* Both passes define these helpers: each gets its pass's suffix (FN) */
#define vec FN(vec)
#define vset FN(vset)
#define vloadf FN(vloadf)
#define vstoref FN(vstoref)
#define vwiden FN(vwiden)
#define vbf16 FN(vbf16)
#define vhalves FN(vhalves)
#define vfirst FN(vfirst)
#define vround FN(vround)
#define vscale FN(vscale)
#define vadd FN(vadd)
#define vsub FN(vsub)
#define vmul FN(vmul)
#define vdiv FN(vdiv)
#define vmin FN(vmin)
#define vmax FN(vmax)
#define vfma FN(vfma)
#define vfnma FN(vfnma)
#define vload FN(vload)
#define vstore_bf16 FN(vstore_bf16)
#define hsum8 FN(hsum8)
#define vsum FN(vsum)
#define load_any FN(load_any)
#define vexp FN(vexp)

#if ISA == 512 /* a vec is one 64-byte register */
#define FN(name) name##_avx512
#define TARGET __attribute__((target("avx512f,avx512bw")))
typedef __m512 vec;
#define LIFT2(name, op) \
    TARGET static inline vec name(vec a, vec b) { return _mm512_##op##_ps(a, b); }
#define LIFT3(name, op) \
    TARGET static inline vec name(vec a, vec b, vec c) { return _mm512_##op##_ps(a, b, c); }

TARGET static inline vec vset(float f) { return _mm512_set1_ps(f); }
TARGET static inline vec vloadf(const float *p) { return _mm512_loadu_ps(p); }
TARGET static inline void vstoref(float *p, vec v) { _mm512_storeu_ps(p, v); }

TARGET static inline vec vwiden(__m256i v) { /* 16 bfloat16 -> 16 float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* 16 float32 -> 16 bfloat16, rounded to nearest even (NaN stays a quiet NaN), as torch rounds */
TARGET static inline __m256i vbf16(vec v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

TARGET static inline __m256 vhalves(vec v) { /* lanes 0-7 + lanes 8-15 */
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

TARGET static inline vec vfirst(vec v, long count) { /* lanes from `count` on zeroed */
    return _mm512_maskz_mov_ps((__mmask16)((1u << count) - 1), v);
}

TARGET static inline vec vround(vec v) { /* to the nearest integer, ties to even */
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

TARGET static inline vec vscale(vec p, vec n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */

#else /* a vec is two 32-byte registers, lanes 0-7 and 8-15 */
#define FN(name) name##_avx2
#define TARGET __attribute__((target("avx2,fma")))
typedef struct {
    __m256 lo, hi;
} vec;
#define LIFT2(name, op)                                                                       \
    TARGET static inline vec name(vec a, vec b) {                                             \
        return (vec){_mm256_##op##_ps(a.lo, b.lo), _mm256_##op##_ps(a.hi, b.hi)};             \
    }
#define LIFT3(name, op)                                                                       \
    TARGET static inline vec name(vec a, vec b, vec c) {                                      \
        return (vec){_mm256_##op##_ps(a.lo, b.lo, c.lo), _mm256_##op##_ps(a.hi, b.hi, c.hi)}; \
    }

TARGET static inline vec vset(float f) { return (vec){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
TARGET static inline vec vloadf(const float *p) {
    return (vec){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
TARGET static inline void vstoref(float *p, vec v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}

TARGET static inline __m256 widen8(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

TARGET static inline vec vwiden(__m256i v) {
    return (vec){widen8(_mm256_castsi256_si128(v)), widen8(_mm256_extracti128_si256(v, 1))};
}

TARGET static inline __m256i round8(__m256 v) { /* 8 bfloat16 in the low halves of 8 words */
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

TARGET static inline __m256i vbf16(vec v) { /* packus interleaves 128-bit lanes: put back */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round8(v.lo), round8(v.hi)), 0xD8);
}

TARGET static inline __m256 vhalves(vec v) { return _mm256_add_ps(v.lo, v.hi); }

TARGET static inline vec vfirst(vec v, long count) {
    __m256 n = _mm256_set1_ps((float)count);
    __m256 lo = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), n, _CMP_LT_OQ);
    __m256 hi = _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), n, _CMP_LT_OQ);
    return (vec){_mm256_and_ps(v.lo, lo), _mm256_and_ps(v.hi, hi)};
}

TARGET static inline vec vround(vec v) {
    return (vec){_mm256_round_ps(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

/* p * 2^n for integral n in [-150, 128], rounded once as scalef rounds: p * 2^(n>>1) is exact
   (p near 1), then * 2^(n - (n>>1)) rounds into subnormals or overflows as the product does */
TARGET static inline __m256 scale8(__m256 p, __m256 n) {
    __m256i e = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(e, 1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256i rest = _mm256_add_epi32(_mm256_sub_epi32(e, half), bias);
    return _mm256_mul_ps(_mm256_mul_ps(p, a), _mm256_castsi256_ps(_mm256_slli_epi32(rest, 23)));
}

TARGET static inline vec vscale(vec p, vec n) {
    return (vec){scale8(p.lo, n.lo), scale8(p.hi, n.hi)};
}
#endif

LIFT2(vadd, add)
LIFT2(vsub, sub)
LIFT2(vmul, mul)
LIFT2(vdiv, div)
LIFT2(vmin, min)
LIFT2(vmax, max)
LIFT3(vfma, fmadd)   /* a * b + c, rounded once */
LIFT3(vfnma, fnmadd) /* c - a * b, rounded once */
#undef LIFT2
#undef LIFT3

TARGET static inline vec vload(const uint16_t *p) {
    return vwiden(_mm256_loadu_si256((const __m256i *)p));
}

TARGET static inline void vstore_bf16(uint16_t *p, vec v) {
    _mm256_storeu_si256((__m256i *)p, vbf16(v));
}

/* the sum of 8 lanes, in the last three levels of vsum's tree */
TARGET static inline float hsum8(__m256 t) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

/* the sum of the 16 lanes, in the tree GCC's _mm512_reduce_add_ps adds them in */
TARGET static inline float vsum(vec v) { return hsum8(vhalves(v)); }

/* 16 lanes of a float32 (bf 0) or bfloat16 (bf 1) row from element i */
TARGET static inline vec load_any(const void *p, long i, int bf) {
    return bf ? vload((const uint16_t *)p + i) : vloadf((const float *)p + i);
}

/* ===== the kernels, written once over vec ===== */

/* w[0..3]: a step's columns c0..c3 of the panel rows at p0..p3 as float32, by the ISA's EVEN,
   ODD or LAST: an even step's from a pair row's words (shifted), an odd one's (masked), or an odd
   k's last step (bfloat16 in order) */
#define STEP_WEIGHTS(w, last, odd, p0, c0, p1, c1, p2, c2, p3, c3)                              \
    do {                                                                                       \
        if (last)                                                                              \
            w[0] = LAST(p0, c0), w[1] = LAST(p1, c1), w[2] = LAST(p2, c2), w[3] = LAST(p3, c3);\
        else if (odd)                                                                          \
            w[0] = ODD(p0, c0), w[1] = ODD(p1, c1), w[2] = ODD(p2, c2), w[3] = ODD(p3, c3);    \
        else                                                                                   \
            w[0] = EVEN(p0, c0), w[1] = EVEN(p1, c1), w[2] = EVEN(p2, c2), w[3] = EVEN(p3, c3);\
    } while (0)

#if ISA == 512
#define ROWS 6 /* x rows per pass: 6 x 4 accumulators + 4 weight vectors fit the 32 registers */
/* 16 columns of a step from column c (STEP_WEIGHTS). The kernels take a step a pass, as before
   the pairs: written as two steps a pass, GCC kept their accumulators on the stack (products of 8
   rows and more 2x slower). */
#define EVEN(at, c) _mm512_slli_epi32(_mm512_loadu_si512((at) + 2 * (c)), 16)
#define ODD(at, c)                                                                             \
    _mm512_and_si512(_mm512_loadu_si512((at) + 2 * (c)), _mm512_set1_epi32((int)0xFFFF0000))
#define LAST(at, c)                                                                            \
    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((at) + (c)))), 16)
/* rows x[0..R) (float32) against two panels (64 columns) into y (bfloat16, row stride ldy),
   + bias when given */
#define KERNEL(R)                                                                              \
    TARGET static void kernel_##R(const float *x, const uint16_t *p0, const uint16_t *p1,      \
                                  uint16_t *y, long ldy, long k, const float *bias) {          \
        __m512 acc[R][4];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (long i = 0; i < k; i++) {                                                         \
            long row = i - i % 2, last = i % 2 == 0 && i + 1 == k;                              \
            const uint16_t *a = p0 + row * PANEL, *b = p1 + row * PANEL;                       \
            if (i % 2 == 0) {                                                                  \
                _mm_prefetch((const char *)(a + AHEAD * PANEL), _MM_HINT_T0);                  \
                _mm_prefetch((const char *)(a + AHEAD * PANEL + 32), _MM_HINT_T0);             \
                _mm_prefetch((const char *)(b + AHEAD * PANEL), _MM_HINT_T0);                  \
                _mm_prefetch((const char *)(b + AHEAD * PANEL + 32), _MM_HINT_T0);             \
            }                                                                                  \
            __m512i w[4];                                                                      \
            STEP_WEIGHTS(w, last, i % 2, a, 0, a, 16, b, 0, b, 16);                            \
            for (int r = 0; r < R; r++) {                                                      \
                __m512 xr = _mm512_set1_ps(x[r * k + i]);                                      \
                for (int j = 0; j < 4; j++)                                                    \
                    acc[r][j] = _mm512_fmadd_ps(xr, _mm512_castsi512_ps(w[j]), acc[r][j]);     \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) {                                                      \
                __m512 v = acc[r][j];                                                          \
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));                \
                vstore_bf16(y + r * ldy + j * 16, v);                                          \
            }                                                                                  \
    }
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

/* one 64-column block (the two panels from p) of m rows x [m][k] into y */
TARGET static void FN(columns)(const float *x, const uint16_t *p, uint16_t *y, long ldy, long m,
                               long k, const float *bias) {
    typedef void (*kernel)(const float *, const uint16_t *, const uint16_t *, uint16_t *, long,
                           long, const float *);
    static const kernel kernels[ROWS + 1] = {0,        kernel_1, kernel_2, kernel_3,
                                             kernel_4, kernel_5, kernel_6};
    for (long r = 0; r < m; r += ROWS) {
        long rows = m - r < ROWS ? m - r : ROWS;
        kernels[rows](x + r * k, p, p + k * PANEL, y + r * ldy, ldy, k, bias);
    }
}
#undef ROWS
#undef KERNEL
#undef EVEN
#undef ODD
#undef LAST

#else
/* 8 columns of a step from column c (STEP_WEIGHTS) */
#define EVEN(at, c) _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)((at) + 2 * (c))), 16)
#define ODD(at, c)                                                                             \
    _mm256_and_si256(_mm256_loadu_si256((const __m256i *)((at) + 2 * (c))),                   \
                     _mm256_set1_epi32((int)0xFFFF0000))
#define LAST(at, c)                                                                            \
    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((at) + (c)))), 16)
/* rows x[0..R) (float32) against P panels from p (k * 32 apart) into y (bfloat16, row stride
   ldy), + bias when given. 16 registers: 8 accumulators (2 rows or 2 panels), the 4 weight
   vectors, the rows' x (with 3 rows GCC kept two accumulators on the stack) */
#define KERNEL(R, P)                                                                           \
    TARGET static void kernel_##R##_##P(const float *x, const uint16_t *p, uint16_t *y,        \
                                        long ldy, long k, const float *bias) {                 \
        __m256 acc[R][4 * P];                                                                  \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4 * P; j++) acc[r][j] = _mm256_setzero_ps();                   \
        for (long i = 0; i < k; i++) {                                                         \
            long row = i - i % 2, last = i % 2 == 0 && i + 1 == k;                              \
            for (int q = 0; q < P; q++) {                                                      \
                const uint16_t *at = p + (q * k + row) * PANEL;                                \
                if (i % 2 == 0) {                                                              \
                    _mm_prefetch((const char *)(at + AHEAD * PANEL), _MM_HINT_T0);             \
                    _mm_prefetch((const char *)(at + AHEAD * PANEL + 32), _MM_HINT_T0);        \
                }                                                                              \
                __m256i w[4]; /* columns 0-7, 8-15, 16-23, 24-31 */                            \
                STEP_WEIGHTS(w, last, i % 2, at, 0, at, 8, at, 16, at, 24);                    \
                for (int r = 0; r < R; r++) {                                                  \
                    __m256 xr = _mm256_set1_ps(x[r * k + i]);                                  \
                    for (int j = 0; j < 4; j++)                                                \
                        acc[r][q * 4 + j] = _mm256_fmadd_ps(xr, _mm256_castsi256_ps(w[j]),     \
                                                            acc[r][q * 4 + j]);                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 2 * P; j++) { /* 16 columns at a time */                       \
                vec v = {acc[r][2 * j], acc[r][2 * j + 1]};                                    \
                if (bias) v = vadd(v, vloadf(bias + j * 16));                                  \
                vstore_bf16(y + r * ldy + j * 16, v);                                          \
            }                                                                                  \
    }
KERNEL(1, 2)
KERNEL(2, 1)

/* one 64-column block (the two panels from p) of m rows x [m][k] into y */
TARGET static void FN(columns)(const float *x, const uint16_t *p, uint16_t *y, long ldy, long m,
                               long k, const float *bias) {
    for (int q = 0; q < 2; q++) /* a panel at a time, so that it stays cached for every pair */
        for (long r = 0; r + 1 < m; r += 2)
            kernel_2_1(x + r * k, p + q * k * PANEL, y + r * ldy + q * 32, ldy, k,
                       bias ? bias + q * 32 : 0);
    if (m % 2) /* the last row against both panels: 8 independent sums hide the FMA latency */
        kernel_1_2(x + (m - 1) * k, p, y + (m - 1) * ldy, ldy, k, bias);
}
#undef KERNEL
#undef EVEN
#undef ODD
#undef LAST
#endif
#undef STEP_WEIGHTS

/* columns() as a block_fn: bfloat16 panels have no scales or groups */
TARGET static void FN(bf16_block)(const float *x, const void *p, const void *scales, uint16_t *y,
                                  long ldy, long m, long k, long group, const float *bias) {
    (void)scales, (void)group;
    FN(columns)(x, p, y, ldy, m, k, bias);
}

#if ISA == 256
#include "quant_kernel.c" /* int8 and int4 weights: AVX2 code, which AVX-512 hosts run too */
#include "quant_avx512.c" /* ... and their AVX-512 versions */
#include "int_dot.c"      /* int4's and int8's products, as integer dot products */
#include "f32_kernel.c"   /* float32 weights as stored, likewise */
#else
#include "f32_lanes.c" /* float32 products of a few rows with MKL's AVX-512 bits */
#endif

TARGET static void FN(rms_norm)(const uint16_t *x, const uint16_t *delta, uint16_t *sum,
                                const uint16_t *w, uint16_t *y, long m, long h, float eps,
                                int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m >= 64)
    for (long r = 0; r < m; r++) {
        const uint16_t *xr = x + r * h;
        uint16_t *yr = y + r * h;
        if (delta) {
            for (long i = 0; i < h; i += 16)
                vstore_bf16(sum + r * h + i, vadd(vload(xr + i), vload(delta + r * h + i)));
            xr = sum + r * h;
        }
        vec squares = vset(0.0f);
        for (long i = 0; i < h; i += 16) {
            vec v = vload(xr + i);
            squares = vadd(squares, vmul(v, v));
        }
        float mean = vsum(squares) / (float)h;
        vec scale = vset(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps))));
        for (long i = 0; i < h; i += 16) {
            vec normed = vwiden(vbf16(vmul(vload(xr + i), scale)));
            vstore_bf16(yr + i, vmul(vload(w + i), normed));
        }
    }
}

/* moe_combine's arithmetic, the row of each choice found: row[t * k + j] */
TARGET static void FN(combine)(const void **row, int rows_bf16, const void *weights,
                               int weights_bf16, long n, long k, long h, int y_bf16, void *y,
                               int threads) {
    int round_products = rows_bf16 && weights_bf16;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * k * h >= 1 << 16)
    for (long t = 0; t < n; t++) {
        for (long i = 0; i < h; i += 16) {
            vec acc = vset(0.0f);
            for (long j = 0; j < k; j++) {
                long s = t * k + j;
                float w = weights_bf16 ? bf16_value(((const uint16_t *)weights)[s])
                                       : ((const float *)weights)[s];
                vec p = vmul(load_any(row[s], i, rows_bf16), vset(w));
                if (round_products) p = vwiden(vbf16(p));
                acc = vadd(acc, p);
            }
            if (y_bf16)
                vstore_bf16((uint16_t *)y + t * h + i, acc);
            else
                vstoref((float *)y + t * h + i, acc);
        }
    }
}

/* exp of float32 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p its degree-7 Taylor
   polynomial (truncation error 5e-9: a few float32 roundings, far inside a bfloat16 one) */
TARGET static inline vec vexp(vec x) {
    x = vmax(vmin(x, vset(89.0f)), vset(-104.0f));
    vec n = vround(vmul(x, vset(1.44269504f)));
    vec r = vfnma(n, vset(0.693359375f), x);
    r = vfnma(n, vset(-2.12194440e-4f), r);
    static const float c[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                               1.0f / 6,    0.5f,       1.0f,       1.0f};
    vec p = vset(c[0]);
    for (int i = 1; i < 8; i++) p = vfma(p, r, vset(c[i]));
    return vscale(p, n);
}

/* out[i] = silu(gate[i]) * up[i] for i < n, n a multiple of 16 */
TARGET static void FN(silu_mul)(const uint16_t *gate, const uint16_t *up, uint16_t *out, long n) {
    for (long i = 0; i < n; i += 16) {
        vec g = vload(gate + i);
        vec e = vexp(vsub(vset(0.0f), g));
        vec act = vwiden(vbf16(vdiv(g, vadd(vset(1.0f), e))));
        vstore_bf16(out + i, vmul(act, vload(up + i)));
    }
}

/* the dot product of bfloat16 rows a, b [n] (n a multiple of 16): 16 float32 lanes of fused
   products in order, then summed as vsum sums them (the router's logits, decode_kernel.c) */
TARGET static float FN(dot)(const uint16_t *a, const uint16_t *b, long n) {
    vec acc = vset(0.0f);
    for (long i = 0; i < n; i += 16) acc = vfma(vload(a + i), vload(b + i), acc);
    return vsum(acc);
}

/* moe_rope_bf16 of one token's `heads` rows x [heads][d] (d a multiple of 32) into out, 16
   elements at a time, each rounded as that rounds it */
TARGET static void FN(rope_rows)(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                                 uint16_t *out, long heads, long d) {
    long half = d / 2;
    for (long h = 0; h < heads; h++) {
        const uint16_t *v = x + h * d;
        uint16_t *o = out + h * d;
        for (long i = 0; i < half; i += 16) {
            vec lo = vload(v + i), hi = vload(v + half + i);
            vec turned = vsub(vset(-0.0f), hi); /* -hi, -0 for +0 */
            vec a = vwiden(vbf16(vmul(lo, vload(cos + i))));
            vstore_bf16(o + i, vadd(a, vwiden(vbf16(vmul(turned, vload(sin + i))))));
            a = vwiden(vbf16(vmul(hi, vload(cos + half + i))));
            vstore_bf16(o + half + i, vadd(a, vwiden(vbf16(vmul(lo, vload(sin + half + i))))));
        }
    }
}

/* dot of a with each of the 4 rows b [4][n] into out [4], each as dot sums it: four chains in
   flight, where one waits on each of its fused products in turn */
TARGET static void FN(dot4)(const uint16_t *a, const uint16_t *b, long n, float *out) {
    vec s0 = vset(0.0f), s1 = s0, s2 = s0, s3 = s0;
    for (long i = 0; i < n; i += 16) {
        vec x = vload(a + i);
        s0 = vfma(x, vload(b + i), s0), s1 = vfma(x, vload(b + n + i), s1);
        s2 = vfma(x, vload(b + 2 * n + i), s2), s3 = vfma(x, vload(b + 3 * n + i), s3);
    }
    out[0] = vsum(s0), out[1] = vsum(s1), out[2] = vsum(s2), out[3] = vsum(s3);
}

/* moe_decode_attention's work, for this instruction set */
TARGET static int FN(decode_attention)(int bf, const void *q, long ldq, const void *kc,
                                       const void *vc, const int64_t *tables, long width,
                                       const int64_t *lengths, long d, long kv_heads, long g,
                                       long hd, long vd, long num_blocks, long bs, float scale,
                                       void *out, int threads) {
    long most = 0;
    for (long s = 0; s < d; s++) most = lengths[s] > most ? lengths[s] : most;
    long stride = (most + 15) / 16 * 16; /* a row of scores: whole vectors */
    int failed = 0;
#pragma omp parallel num_threads(threads) if (d * kv_heads >= 4)
    {
        /* the g query rows of a KV head together: each key and value is read once for all */
        float *scores = malloc(sizeof(float) * g * (stride + 1)); /* g rows, then their g sums */
        float *acc = malloc(sizeof(float) * g * vd);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long job = 0; job < d * kv_heads; job++) {
            if (!scores || !acc) continue;
            long s = job / kv_heads, h = job % kv_heads, n = lengths[s];
            const int64_t *table = tables + s * width;
            long row = s * ldq + h * g * hd; /* this head's first query row */
            float *sums = scores + g * stride;
            for (long j = 0; j < n; j++) {
                long slot = (h * num_blocks + table[j / bs]) * bs + j % bs;
                for (long r = 0; r < g; r++) {
                    vec dot = vset(0.0f);
                    for (long i = 0; i < hd; i += 16)
                        dot = vfma(load_any(q, row + r * hd + i, bf),
                                   load_any(kc, slot * hd + i, bf), dot);
                    scores[r * stride + j] = vsum(dot) * scale;
                }
            }
            for (long r = 0; r < g; r++) { /* softmax numerators, 16 at a time; the sum apart */
                float *sc = scores + r * stride, top = -__builtin_inff();
                for (long j = 0; j < n; j++) top = sc[j] > top ? sc[j] : top;
                vec sum = vset(0.0f);
                for (long j = 0; j < n; j += 16) {
                    vec e = vexp(vsub(vloadf(sc + j), vset(top)));
                    if (n - j < 16) e = vfirst(e, n - j); /* past the context: nothing */
                    sum = vadd(sum, e);
                    if (bf) e = vwiden(vbf16(e));
                    vstoref(sc + j, e);
                }
                sums[r] = vsum(sum);
            }
            for (long i = 0; i < g * vd; i++) acc[i] = 0.0f;
            for (long j = 0; j < n; j++) {
                long slot = (h * num_blocks + table[j / bs]) * bs + j % bs;
                for (long i = 0; i < vd; i += 16) {
                    vec v = load_any(vc, slot * vd + i, bf);
                    for (long r = 0; r < g; r++)
                        vstoref(acc + r * vd + i,
                                vfma(vset(scores[r * stride + j]), v, vloadf(acc + r * vd + i)));
                }
            }
            for (long r = 0; r < g; r++) {
                vec sum = vset(sums[r]);
                long at = (job * g + r) * vd;
                for (long i = 0; i < vd; i += 16) {
                    vec o = vdiv(vloadf(acc + r * vd + i), sum);
                    if (bf)
                        vstore_bf16((uint16_t *)out + at + i, o);
                    else
                        vstoref((float *)out + at + i, o);
                }
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
}

#undef FN
#undef TARGET
#endif
