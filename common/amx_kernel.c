/* bfloat16 products on AMX tiles, for bf16_kernel.c, which includes this file after its vector
   kernels. Only for FORMAT_BF16_TILES weights (a router's, never an expert service's): AMX sums a
   tile's products in its own order, not one after another as the vector kernels do (on host C
   2,236 of 2,368 sums differed in their last bits), so a row's bits depend on whether its product
   had TILE_ROWS rows or more, and an expert service's rows must not see their batch-mates.
   Products of fewer rows, and a k that is not a multiple of 32, take the vector kernels.

   The caller lays x's rows out for the tiles once a product (tile_rows: x is read once, not once
   per 64 columns), then each 64-column block (tile_columns) runs 32 rows at a time: four
   accumulator tiles (2 x 2 of 16 rows by 16 columns), two of x, two of the panel; 16 rows or
   fewer run both panels at once, an accumulator tile per 16 columns. A weight tile's row t holds
   its columns' steps 2t and 2t + 1 side by side, as the panels hold them (moe_bf16_pack), so the
   tiles load from the panels as they lie. On host C (docs/performance.md, stop 71), the Qwen3
   slice's products from memory on two threads: 19-26 GB/s at 8 rows (the vector kernel 15-21),
   16-22 at 32 (7-8.5); each 32-row group made its weight tiles from the panels before, and that
   held 8 rows below the vector kernel, 16 and 32 to 15-19 GB/s. */

#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 8
#define TILE_AHEAD 64 /* panel rows prefetched ahead (4 KiB) */

typedef struct { /* what ldtilecfg reads: palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Compilers without AMX's intrinsics (GCC before 11, clang before 12) build the rest without
   tiles, rather than fail the whole library */
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif

/* Whether this process may use AMX's bfloat16 tiles: built with them, the CPU has them (CPUID 7:
   AMX-BF16 and AMX-TILE) and Linux granted the tile data state (arch_prctl
   ARCH_REQ_XCOMP_PERM). Settled when the library loads (bf16.py reads the level), before any
   thread calls it. The caller checked AVX-512F/BW. */
static int tiles_granted(void) {
    static int granted = -1;
    if (granted < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        granted = HAVE_TILES && (d >> 22 & 1) && (d >> 24 & 1) &&
                  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                          18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return granted;
}

/* Whether a product of m rows by k of FORMAT_BF16_TILES weights runs on tiles here */
static int tiles_take(int format, long m, long k) {
    return format == FORMAT_BF16_TILES && m >= TILE_ROWS && k % 32 == 0 && level_cap >= 3 &&
           moe_bf16_supported() >= 3;
}

static long tile_rows_size(long m, long k) { return (m + 31) / 32 * 32 * k; } /* bfloat16s */

/* x [m][k] bfloat16 into xt [m / 32 rounded up][k / 32][32][32]: each 32-step of 32 rows as two
   tiles of 64-byte rows, one after the other, rows past m zero (x's own rows, k * 2 bytes apart,
   would map a tile to two of L1's sets) */
static void tile_rows(const uint16_t *x, long m, long k, uint16_t *xt) {
    for (long r = 0; r < (m + 31) / 32 * 32; r++)
        for (long i = 0; i < k; i += 32) {
            uint16_t *at = xt + ((r / 32) * (k / 32) + i / 32) * 1024 + (r % 32) * 32;
            if (r < m)
                memcpy(at, x + r * k + i, 64);
            else
                memset(at, 0, 64);
        }
}

#if HAVE_TILES
#define TILE_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

TILE_TARGET static inline void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* accumulators 0-3 into sums [32][32]: 0 and 1 its rows 0-15, 2 and 3 rows 16-31 */
TILE_TARGET static inline void store_sums(float *sums) {
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
}

/* Rows sums [rows][32 at a stride of 32] + bias (when given) into y's 32 columns (bfloat16, row
   stride ldy) */
TILE_TARGET static inline void put_rows(const float *sums, long rows, uint16_t *y, long ldy,
                                        const float *bias) {
    for (long r = 0; r < rows; r++)
        for (int j = 0; j < 32; j += 16) {
            __m512 v = _mm512_load_ps(sums + r * 32 + j);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
            vstore_bf16_avx512(y + r * ldy + j, v);
        }
}

/* the 2 KiB of a panel's 32-step TILE_AHEAD panel rows after w */
static inline void prefetch_step(const uint16_t *w) {
    for (int line = 0; line < 32; line++)
        _mm_prefetch((const char *)(w + TILE_AHEAD * PANEL) + 64 * line, _MM_HINT_T0);
}

/* One 64-column block (the two panels from p) of the m rows xt (tile_rows' layout) into y
   (bfloat16, row stride ldy), + bias when given. A panel's 16 pair rows of a 32-step (2 KiB) are
   its two weight tiles as they lie, columns 0-15 and 16-31 at 128-byte strides. Up to 16 rows,
   both panels at once (two streams of weights, not one after the other: 1.1-1.3x at 8 and 16
   rows on host C). */
TILE_TARGET static void tile_columns(const uint16_t *xt, const uint16_t *p, uint16_t *y, long ldy,
                                     long m, long k, const float *bias) {
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    float sums[32 * 32] __attribute__((aligned(64)));
    long steps = k / 32;
    for (long r0 = 0; r0 < m; r0 += 32) {
        const uint16_t *rows32 = xt + (r0 / 32) * steps * 1024;
        uint16_t *yr = y + r0 * ldy;
        if (m - r0 <= 16) { /* both panels at once: accumulators 0-3 hold columns 0-63 */
            const uint16_t *p0 = p, *p1 = p + k * PANEL;
            zero_sums();
            for (long s = 0; s < steps; s++) {
                const uint16_t *w0 = p0 + s * 32 * PANEL, *w1 = p1 + s * 32 * PANEL;
                prefetch_step(w0);
                prefetch_step(w1);
                _tile_loadd(4, rows32 + s * 1024, 64);
                _tile_loadd(6, w0, 128);
                _tile_loadd(7, w0 + 32, 128);
                _tile_loadd(5, w1, 128);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, w1 + 32, 128);
                _tile_dpbf16ps(3, 4, 6);
            }
            store_sums(sums); /* rows 0-15 of sums columns 0-31, rows 16-31 columns 32-63 */
            put_rows(sums, m - r0, yr, ldy, bias);
            put_rows(sums + 16 * 32, m - r0, yr + 32, ldy, bias ? bias + 32 : 0);
            continue;
        }
        for (int q = 0; q < 2; q++) {
            const uint16_t *panel = p + q * k * PANEL;
            zero_sums();
            for (long s = 0; s < steps; s++) {
                const uint16_t *w = panel + s * 32 * PANEL;
                prefetch_step(w);
                _tile_loadd(4, rows32 + s * 1024, 64);
                _tile_loadd(6, w, 128);
                _tile_loadd(7, w + 32, 128);
                _tile_loadd(5, rows32 + s * 1024 + 512, 64); /* rows 16-31, zeros past m */
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            store_sums(sums);
            put_rows(sums, m - r0 < 32 ? m - r0 : 32, yr + q * 32, ldy, bias ? bias + q * 32 : 0);
        }
    }
    _tile_release(); /* back to the initial state: another library configures its own */
}

/* moe_linear's product on tiles: x [m][k] bfloat16 laid out once, the blocks split over
   `threads`. -1 without memory. */
static int tile_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                       long m, long n, long k, int threads) {
    uint16_t *xt = malloc(sizeof(uint16_t) * tile_rows_size(m, k));
    if (!xt) return -1;
    tile_rows(x, m, k, xt);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < n / 64; c++)
        tile_columns(xt, w + c * 64 * k, y + c * 64, n, m, k, bias ? bias + c * 64 : 0);
    free(xt);
    return 0;
}
#else /* tiles_take is 0 without them: never called */
static void tile_columns(const uint16_t *xt, const uint16_t *p, uint16_t *y, long ldy, long m,
                         long k, const float *bias) {
    (void)xt, (void)p, (void)y, (void)ldy, (void)m, (void)k, (void)bias;
}

static int tile_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                       long m, long n, long k, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
