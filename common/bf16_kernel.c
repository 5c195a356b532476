/* bfloat16 linear layers, gated FFNs and RMSNorm for CPUs without native bfloat16 arithmetic
   (AVX-512F/BW is enough); a layer's expert grouping and combine, RoPE, the KV-cache write and
   decode attention over the paged cache in bfloat16 and float32.

   y[M][N] = x[M][K] . W^T, all bfloat16, with W [N][K] held in panels of 32 output columns:
   P[panel][k][32]. A bfloat16 is a float32's upper half, so unpacking a 64-byte row of a
   panel with zeros (unpacklo/unpackhi) yields its columns as float32 with no arithmetic; pack()
   permutes each row so that the two halves come out as columns 0-15 and 16-31.

   Every output element sums x[m][k] * W[n][k] over k in order, one float32 accumulator each:
   a row's result does not depend on the other rows of the batch (expert services merge callers),
   and is as accurate as a float32-accumulating GEMM rounded to bfloat16 once at the end. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define ROWS 6 /* x rows per pass: 6 x 4 accumulators + 4 weight vectors fit the 32 registers */
/* Panel rows prefetched ahead (2 KiB): the hardware prefetcher alone left one- and two-row
   products at 20 GB/s on 256 MiB of weights, this at 25 (prefetches past the end never fault) */
#define AHEAD 32

static int column(int p) { /* word p of a panel row -> the column stored there */
    int lane = p / 8, q = p % 8;
    return q < 4 ? lane * 4 + q : 16 + lane * 4 + (q - 4);
}

int moe_bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* w [N][K] -> out [N / 32][K][32]; N a multiple of 32 */
void moe_bf16_pack(const uint16_t *w, uint16_t *out, long n, long k) {
    for (long panel = 0; panel < n / PANEL; panel++)
        for (long i = 0; i < k; i++)
            for (int p = 0; p < PANEL; p++)
                out[(panel * k + i) * PANEL + p] = w[(panel * PANEL + column(p)) * k + i];
}

/* 16 float32 -> 16 bfloat16, rounded to nearest even (NaN stays a quiet NaN), as torch rounds */
__attribute__((target("avx512f,avx512bw"))) static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* rows x[0..R) (float32) against two panels (64 columns) into y (bfloat16, row stride ldy),
   + bias when given */
#define KERNEL(R)                                                                               \
    __attribute__((target("avx512f,avx512bw"))) static void kernel_##R(                         \
        const float *x, const uint16_t *p0, const uint16_t *p1, uint16_t *y, long ldy, long k,  \
        const float *bias) {                                                                    \
        __m512 acc[R][4];                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                        \
        const __m512i zero = _mm512_setzero_si512();                                            \
        for (long i = 0; i < k; i++) {                                                          \
            _mm_prefetch((const char *)(p0 + (i + AHEAD) * PANEL), _MM_HINT_T0);                \
            _mm_prefetch((const char *)(p1 + (i + AHEAD) * PANEL), _MM_HINT_T0);                \
            __m512i a = _mm512_loadu_si512(p0 + i * PANEL);                                     \
            __m512i b = _mm512_loadu_si512(p1 + i * PANEL);                                     \
            __m512 w[4] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)),                 \
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)),                 \
                           _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, b)),                 \
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, b))};                \
            for (int r = 0; r < R; r++) {                                                       \
                __m512 xr = _mm512_set1_ps(x[r * k + i]);                                       \
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(xr, w[j], acc[r][j]);   \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < 4; j++) {                                                       \
                __m512 v = acc[r][j];                                                           \
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));                 \
                _mm256_storeu_si256((__m256i *)(y + r * ldy + j * 16), to_bf16(v));             \
            }                                                                                   \
    }
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

typedef void (*kernel)(const float *, const uint16_t *, const uint16_t *, uint16_t *, long, long,
                       const float *);
static const kernel kernels[ROWS + 1] = {0, kernel_1, kernel_2, kernel_3,
                                         kernel_4, kernel_5, kernel_6};

/* x [m][k] bfloat16, packed from moe_bf16_pack, bias [n] float32 or NULL, y [m][n] bfloat16;
   n a multiple of 64. Columns are split over `threads` OpenMP threads. x is widened to float32
   once, here (every column block reads it); -1 when there is no memory for that. */
int moe_bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                    long m, long n, long k, int threads) {
    uint32_t *wide = malloc(sizeof(float) * m * k);
    if (!wide) return -1;
    for (long i = 0; i < m * k; i++) wide[i] = (uint32_t)x[i] << 16;
    const float *xf = (const float *)wide;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < n / 64; c++) {
        const uint16_t *p0 = packed + 2 * c * k * PANEL, *p1 = p0 + k * PANEL;
        for (long r = 0; r < m; r += ROWS) {
            long rows = m - r < ROWS ? m - r : ROWS;
            kernels[rows](xf + r * k, p0, p1, y + r * n + c * 64, n, k, bias ? bias + c * 64 : 0);
        }
    }
    free(wide);
    return 0;
}

/* 16 bfloat16 -> 16 float32 */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

__attribute__((target("avx512f,avx512bw"))) static inline __m512 load(const uint16_t *p) {
    return widen(_mm256_loadu_si256((const __m256i *)p));
}

/* RMSNorm of rows x [m][h] by weight [h] into y, all bfloat16, h a multiple of 16, computed as
   transformers computes it: in float32, the normalised row rounded to bfloat16, then multiplied
   by the weight and rounded again. One call instead of the eight torch ops of that recipe.
   With `delta`, the row normalised is x + delta (rounded, as torch's add rounds), written to
   `sum`: a residual addition and the norm after it in one call. */
__attribute__((target("avx512f,avx512bw"))) void moe_bf16_rms_norm(const uint16_t *x,
                                                                     const uint16_t *delta,
                                                                     uint16_t *sum,
                                                                     const uint16_t *w,
                                                                     uint16_t *y, long m, long h,
                                                                     float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m >= 64)
    for (long r = 0; r < m; r++) {
        const uint16_t *xr = x + r * h;
        uint16_t *yr = y + r * h;
        if (delta) {
            for (long i = 0; i < h; i += 16)
                _mm256_storeu_si256((__m256i *)(sum + r * h + i),
                                    to_bf16(_mm512_add_ps(load(xr + i), load(delta + r * h + i))));
            xr = sum + r * h;
        }
        __m512 squares = _mm512_setzero_ps();
        for (long i = 0; i < h; i += 16) {
            __m512 v = load(xr + i);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        float mean = _mm512_reduce_add_ps(squares) / (float)h;
        __m512 scale = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps))));
        for (long i = 0; i < h; i += 16) {
            __m512 normed = widen(to_bf16(_mm512_mul_ps(load(xr + i), scale)));
            _mm256_storeu_si256((__m256i *)(yr + i), to_bf16(_mm512_mul_ps(load(w + i), normed)));
        }
    }
}

static inline float bf16_value(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
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

/* 16 lanes of a float32 (bf 0) or bfloat16 (bf 1) row from element i */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 load_any(const void *p, long i,
                                                                          int bf) {
    return bf ? load((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

/* A layer's expert combine: y[t] = sum over j < k of weights[t*k + j] * (the output row of choice
   j of token t), choices in order, as torch computes it from the expert outputs (groups[g]:
   rows [sizes[g]][h], float32 or bfloat16, row r holding slot slots[g][r] = t*k + j): each
   product in the product's dtype (bfloat16 only when rows and weights both are), summed in
   float32 from 0, then y (float32 or bfloat16) rounded once. h a multiple of 16. -1 when the
   slots are not every one of n*k exactly once (nothing is written), or without memory. */
__attribute__((target("avx512f,avx512bw"))) int moe_combine(
    const void *const *groups, const long *const *slots, const long *sizes, long count,
    int rows_bf16, const void *weights, int weights_bf16, long n, long k, long h, int y_bf16,
    void *y, int threads) {
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
    if (seen != total) {
        free(row);
        return -1;
    }
    int round_products = rows_bf16 && weights_bf16;
#pragma omp parallel for schedule(static) num_threads(threads) if (total * h >= 1 << 16)
    for (long t = 0; t < n; t++) {
        for (long i = 0; i < h; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (long j = 0; j < k; j++) {
                long s = t * k + j;
                float w = weights_bf16 ? bf16_value(((const uint16_t *)weights)[s])
                                       : ((const float *)weights)[s];
                __m512 p = _mm512_mul_ps(load_any(row[s], i, rows_bf16), _mm512_set1_ps(w));
                if (round_products) p = widen(to_bf16(p));
                acc = _mm512_add_ps(acc, p);
            }
            if (y_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + t * h + i), to_bf16(acc));
            else
                _mm512_storeu_ps((float *)y + t * h + i, acc);
        }
    }
    free(row);
    return 0;
}

/* exp of float32 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p its degree-7 Taylor
   polynomial (truncation error 5e-9: a few float32 roundings, far inside a bfloat16 one) */
__attribute__((target("avx512f,avx512bw"))) static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    static const float c[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                               1.0f / 6,    0.5f,       1.0f,       1.0f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* out[i] = silu(g[i]) * u[i] for one row g|u [2][n], n a multiple of 16 */
__attribute__((target("avx512f,avx512bw"))) static void silu_mul(const uint16_t *gu, uint16_t *out,
                                                                  long n) {
    for (long i = 0; i < n; i += 16) {
        __m512 g = load(gu + i);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 act = widen(to_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
        _mm256_storeu_si256((__m256i *)(out + i), to_bf16(_mm512_mul_ps(act, load(gu + n + i))));
    }
}

/* An expert's FFN on rows x [m][hidden]: down(silu(gate) * up) with gate|up = gate_up(x), both
   weights packed. Every intermediate is rounded to bfloat16 where torch's ops round it (the
   product, silu, the gated product), so rows are what the op-by-op recipe gives to within a
   rounding, and independent of their batch-mates. -1 when there is no memory for the
   intermediates. */
int moe_bf16_silu_ffn(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                      uint16_t *y, long m, long inter, long hidden, int threads) {
    uint16_t *h = malloc(sizeof(uint16_t) * m * 3 * inter); /* gate|up, then the gated product */
    if (!h) return -1;
    uint16_t *gated = h + m * 2 * inter;
    int failed = moe_bf16_linear(x, gate_up, 0, h, m, 2 * inter, hidden, threads);
    if (!failed) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m * inter >= 1 << 16)
        for (long r = 0; r < m; r++) silu_mul(h + r * 2 * inter, gated + r * inter, inter);
        failed = moe_bf16_linear(gated, down, 0, y, m, hidden, inter, threads);
    }
    free(h);
    return failed;
}

static inline float bf16_round(float f) { /* to the nearest bfloat16, ties to even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return bf16_value(0x7FC0);
    return bf16_value((uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16));
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
   else float32.

   Computed as torch's CPU flash-attention kernel computes a context of up to 512 keys: scores in
   float32 times `scale`, softmax against the row's maximum, in bfloat16 the probabilities
   rounded to bfloat16 before they weight the values, the weighted sum divided by the sum of the
   unrounded exponentials. Torch's exp there is a 20-bit approximation and its dot products and
   sums run in another order, so results may differ from SDPA's in the last bit. */
__attribute__((target("avx512f,avx512bw"))) int moe_decode_attention(
    int bf, const void *q, long ldq, const void *kc, const void *vc, const int64_t *tables,
    long width, const int64_t *lengths, long d, long kv_heads, long g, long hd, long vd,
    long num_blocks, long bs, float scale, void *out, int threads) {
    long most = 0;
    for (long s = 0; s < d; s++) most = lengths[s] > most ? lengths[s] : most;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (d * kv_heads >= 4)
    {
        /* the g query rows of a KV head together: each key and value is read once for all */
        float *scores = malloc(sizeof(float) * g * (most + 1)); /* g rows of n scores + their sum */
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
            for (long j = 0; j < n; j++) {
                long slot = (h * num_blocks + table[j / bs]) * bs + j % bs;
                for (long r = 0; r < g; r++) {
                    __m512 dot = _mm512_setzero_ps();
                    for (long i = 0; i < hd; i += 16)
                        dot = _mm512_fmadd_ps(load_any(q, row + r * hd + i, bf),
                                              load_any(kc, slot * hd + i, bf), dot);
                    scores[r * (n + 1) + j] = _mm512_reduce_add_ps(dot) * scale;
                }
            }
            for (long r = 0; r < g; r++) { /* softmax numerators, 16 at a time; the sum last */
                float *sc = scores + r * (n + 1), top = -__builtin_inff();
                for (long j = 0; j < n; j++) top = sc[j] > top ? sc[j] : top;
                __m512 sum = _mm512_setzero_ps();
                for (long j = 0; j < n; j += 16) {
                    __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
                    __m512 x = _mm512_maskz_loadu_ps(live, sc + j);
                    __m512 e = exp_ps(_mm512_sub_ps(x, _mm512_set1_ps(top)));
                    e = _mm512_maskz_mov_ps(live, e);
                    sum = _mm512_add_ps(sum, e);
                    if (bf) e = widen(to_bf16(e));
                    _mm512_mask_storeu_ps(sc + j, live, e);
                }
                sc[n] = _mm512_reduce_add_ps(sum);
            }
            for (long i = 0; i < g * vd; i++) acc[i] = 0.0f;
            for (long j = 0; j < n; j++) {
                long slot = (h * num_blocks + table[j / bs]) * bs + j % bs;
                for (long i = 0; i < vd; i += 16) {
                    __m512 v = load_any(vc, slot * vd + i, bf);
                    for (long r = 0; r < g; r++)
                        _mm512_storeu_ps(acc + r * vd + i,
                                         _mm512_fmadd_ps(_mm512_set1_ps(scores[r * (n + 1) + j]), v,
                                                         _mm512_loadu_ps(acc + r * vd + i)));
                }
            }
            for (long r = 0; r < g; r++) {
                __m512 sum = _mm512_set1_ps(scores[r * (n + 1) + n]);
                long at = (job * g + r) * vd;
                for (long i = 0; i < vd; i += 16) {
                    __m512 o = _mm512_div_ps(_mm512_loadu_ps(acc + r * vd + i), sum);
                    if (bf)
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + i), to_bf16(o));
                    else
                        _mm512_storeu_ps((float *)out + at + i, o);
                }
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
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
