/* bfloat16 products on AMX tiles, for bf16_kernel.c, which includes this file after its vector
   kernels. Only for FORMAT_BF16_TILES weights (a router's, never an expert service's): AMX sums a
   tile's products in its own order, not one after another as the vector kernels do (on host C
   2,236 of 2,368 sums differed in their last bits), so a row's bits depend on whether its product
   had TILE_ROWS rows or more, and an expert service's rows must not see their batch-mates.
   Products of fewer rows, and a k that is not a multiple of 32, take the vector kernels. On
   host C, 256 MiB of [4096][1024] weights on two threads: 17.7, 17.8, 10.4 and 7.4 GB/s at 16,
   32, 64 and 128 rows against the vector kernel's 12.5, 7.8, 4.6 and 2.5 (oneDNN's AMX products
   about 18, 16, 14 and 10); `small` decoded 32 sequences 7% faster and prefilled a 480-token
   prompt in 290 ms against 355 (oneDNN's layout: 165 ms, its experts' products on tiles too).

   The caller lays x's rows out for the tiles once a product (tile_rows: x is read once, not once
   per 64 columns), then each 64-column block (tile_columns) makes its two panels into weight
   tiles and runs 32 rows at a time: four accumulator tiles (2 x 2 of 16 rows by 16 columns), two
   of x, two of the panel. A weight tile's row t holds its columns'
   steps 2t and 2t + 1 side by side, which unpacklo/unpackhi of the panel's rows 2t and 2t + 1
   give (the lo half columns 0-15, in the order moe_bf16_pack wrote them). */

#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16
#define TILE_AHEAD 64 /* panel rows prefetched ahead */

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

/* A panel's 32 rows from `at` as two weight tiles (columns 0-15, then 16-31) into `tiles` */
TILE_TARGET static inline void make_tiles(const uint16_t *at, uint16_t *tiles) {
    for (int t = 0; t < 16; t++, at += 2 * PANEL) {
        _mm_prefetch((const char *)(at + TILE_AHEAD * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(at + (TILE_AHEAD + 1) * PANEL), _MM_HINT_T0);
        __m512i even = _mm512_loadu_si512(at), odd = _mm512_loadu_si512(at + PANEL);
        _mm512_storeu_si512(tiles + t * 32, _mm512_unpacklo_epi16(even, odd));
        _mm512_storeu_si512(tiles + 512 + t * 32, _mm512_unpackhi_epi16(even, odd));
    }
}

/* One 64-column block (the two panels from p) of the m rows xt (tile_rows' layout) into y
   (bfloat16, row stride ldy), + bias when given. -1 without memory for the weight tiles. */
TILE_TARGET static int tile_columns(const uint16_t *xt, const uint16_t *p, uint16_t *y, long ldy,
                                    long m, long k, const float *bias) {
    /* More than 32 rows read each weight tile more than once: made once into a buffer of the
       thread's (kept: malloc maps and faults in a fresh one this size). Up to 32, each is made
       as it is used (2 KB on the stack): 9.9 GB/s at 32 rows with the buffer, 16 without. */
    static __thread uint16_t *buffer;
    static __thread long held;
    uint16_t one[1024] __attribute__((aligned(64)));
    int reused = m > 32;
    if (reused && held < 64 * k) {
        uint16_t *grown = realloc(buffer, sizeof(uint16_t) * 64 * k);
        if (!grown) return -1;
        buffer = grown, held = 64 * k;
    }
    if (reused)
        for (long i = 0; i < 2 * k; i += 32) make_tiles(p + i * PANEL, buffer + i / 32 * 1024);
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    float sums[32 * 32] __attribute__((aligned(64)));
    long steps = k / 32;
    for (long r0 = 0; r0 < m; r0 += 32) {
        const uint16_t *rows32 = xt + (r0 / 32) * steps * 1024;
        for (int q = 0; q < 2; q++) {
            const uint16_t *panel = reused ? buffer + q * steps * 1024 : 0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long s = 0; s < steps; s++) {
                const uint16_t *w = panel ? panel + s * 1024 : one;
                if (!panel) make_tiles(p + (q * k + s * 32) * PANEL, one);
                __asm__ volatile("" ::: "memory"); /* tileloadd reads what the stores wrote */
                _tile_loadd(4, rows32 + s * 1024, 64);
                _tile_loadd(6, w, 64);
                _tile_loadd(7, w + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (m - r0 > 16) { /* rows 16-31 of these 32, else zeros past m */
                    _tile_loadd(5, rows32 + s * 1024 + 512, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums, 128);
            _tile_stored(1, sums + 16, 128);
            _tile_stored(2, sums + 16 * 32, 128);
            _tile_stored(3, sums + 16 * 32 + 16, 128);
            for (long r = 0; r < 32 && r0 + r < m; r++)
                for (int j = 0; j < 32; j += 16) {
                    __m512 v = _mm512_load_ps(sums + r * 32 + j);
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + q * 32 + j));
                    vstore_bf16_avx512(y + (r0 + r) * ldy + q * 32 + j, v);
                }
        }
    }
    _tile_release(); /* back to the initial state: another library configures its own */
    return 0;
}

/* moe_linear's product on tiles: x [m][k] bfloat16 laid out once, the blocks split over
   `threads`. -1 without memory. */
static int tile_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                       long m, long n, long k, int threads) {
    uint16_t *xt = malloc(sizeof(uint16_t) * tile_rows_size(m, k));
    if (!xt) return -1;
    tile_rows(x, m, k, xt);
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : failed)
    for (long c = 0; c < n / 64; c++)
        failed |= tile_columns(xt, w + c * 64 * k, y + c * 64, n, m, k, bias ? bias + c * 64 : 0);
    free(xt);
    return failed ? -1 : 0;
}
#else
static int tile_columns(const uint16_t *xt, const uint16_t *p, uint16_t *y, long ldy, long m,
                        long k, const float *bias) {
    (void)xt, (void)p, (void)y, (void)ldy, (void)m, (void)k, (void)bias;
    return -1;
}

static int tile_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                       long m, long n, long k, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
