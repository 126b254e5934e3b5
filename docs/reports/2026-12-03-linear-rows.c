/* What 1 and 4 activation rows cost the linear layers' bf16 dot products on two threads, outside the model
 * (docs/reports/2026-12-03-verify-roofline.md). The kernel is lean_cpu.c's scheme reduced to its core (blocks
 * of O weight rows packed side by side per 32 inputs, one vdpbf16ps per weight vector and activation row, each
 * output's own accumulator, the weights prefetched 8 KB ahead into L1), for O x R register tiles:
 *
 *     gcc -O3 -march=native -fopenmp -o /tmp/linear-rows docs/reports/2026-12-03-linear-rows.c
 *     /tmp/linear-rows tiles 30      a 24576 x 1536 weight (75 MB): tiles 4x1, 4x4 (the kernel's), 6x4, 8x3
 *     /tmp/linear-rows shapes 20     30 distinct weights of one shape (gate_up's 3072 x 576, down's 576 x 1536)
 *     /tmp/linear-rows forward 20    the forward's sequence: per layer qkv 960 x 576, o 576 x 576, gate_up, down;
 *                                    and again with each thread's first 8 KB of the next weight prefetched
 *
 * Prints the best time of REPS calls (each variant once per round, in turn) and the weights' GB/s. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef unsigned short bf16;
#define PF 8192

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* y[r][o] = x[r] . w[o] for a weight of `out` rows packed in blocks of O ([blocks][in/32][O][32]), R rows */
#define KERNEL(NAME, O, R)                                                                                    \
    static void NAME(const bf16 *wp, const bf16 *x, int out, int in, float *y) {                             \
        int blocks = out / O, kb = in / 32;                                                                   \
        _Pragma("omp for schedule(static)") for (int b = 0; b < blocks; ++b) {                               \
            const bf16 *wb = wp + (size_t)b * kb * 32 * O;                                                    \
            __m512 acc[R][O];                                                                                 \
            for (int r = 0; r < R; ++r)                                                                       \
                for (int c = 0; c < O; ++c) acc[r][c] = _mm512_setzero_ps();                                  \
            for (int k = 0; k < kb; ++k) {                                                                    \
                const bf16 *p = wb + (size_t)k * 32 * O;                                                      \
                for (int l = 0; l < 64 * O; l += 64) _mm_prefetch((const char *)p + PF + l, _MM_HINT_T0);     \
                __m512bh w[O];                                                                                \
                for (int c = 0; c < O; ++c) w[c] = (__m512bh)_mm512_loadu_si512(p + 32 * c);                 \
                for (int r = 0; r < R; ++r) {                                                                 \
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)r * in + 32 * k);                  \
                    for (int c = 0; c < O; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xv);            \
                }                                                                                             \
            }                                                                                                 \
            for (int r = 0; r < R; ++r)                                                                       \
                for (int c = 0; c < O; ++c) y[(size_t)r * out + b * O + c] = _mm512_reduce_add_ps(acc[r][c]); \
        }                                                                                                     \
    }
KERNEL(tile4x1, 4, 1)
KERNEL(tile4x4, 4, 4)
KERNEL(tile6x4, 6, 4)
KERNEL(tile8x3, 8, 3)

typedef void (*Kernel)(const bf16 *, const bf16 *, int, int, float *);

static bf16 *weight(size_t n) { /* values of a bf16 around 1 (the products' values do not matter here) */
    bf16 *w = aligned_alloc(64, (n * sizeof(bf16) + 63) / 64 * 64);
    for (size_t i = 0; i < n; ++i) w[i] = (bf16)(0x3c00 + (i % 97));
    return w;
}

/* seconds of the best of reps calls of run(variant) for each variant, the variants in turn each round */
static void best_of(int reps, int variants, void (*run)(int), double *best) {
    for (int v = 0; v < variants; ++v) best[v] = 1e9;
    for (int r = 0; r < reps; ++r)
        for (int v = 0; v < variants; ++v) {
            double t0 = now();
            run(v);
            double t = now() - t0;
            if (t < best[v]) best[v] = t;
        }
}

static bf16 x[4 * 1536];
static float y[4 * 24576];
static bf16 *big;
static bf16 *layers[30][4];
static const int shape[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* qkv, o, gate_up, down */

static void run_tiles(int v) {
    static const Kernel k[4] = {tile4x1, tile4x4, tile6x4, tile8x3};
#pragma omp parallel num_threads(2)
    k[v](big, x, 24576, 1536, y);
}

static void run_shapes(int v) { /* v: shape 2 or 3 (gate_up, down) x 1 or 4 rows */
    int s = v / 2 == 0 ? 2 : 3;
#pragma omp parallel num_threads(2)
    for (int l = 0; l < 30; ++l) (v % 2 ? tile4x4 : tile4x1)(layers[l][s], x, shape[s][0], shape[s][1], y);
}

/* this thread's first 8 KB of a weight of out x in packed in blocks of 4, under the static schedule */
static void ramp(const bf16 *w, int out, int in) {
    int blocks = out / 4, nt = omp_get_num_threads(), t = omp_get_thread_num();
    int q = blocks / nt, rem = blocks % nt, b0 = t * q + (t < rem ? t : rem);
    const char *p = (const char *)(w + (size_t)b0 * in * 4);
    for (int l = 0; l < PF; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
}

static void run_forward(int v) { /* v: 1 or 4 rows, x without or with the next weight's start prefetched */
#pragma omp parallel num_threads(2)
    for (int l = 0; l < 30; ++l)
        for (int s = 0; s < 4; ++s) {
            (v % 2 ? tile4x4 : tile4x1)(layers[l][s], x, shape[s][0], shape[s][1], y);
            int nl = s == 3 ? l + 1 : l, ns = (s + 1) % 4;
            if (v >= 2 && nl < 30) ramp(layers[nl][ns], shape[ns][0], shape[ns][1]);
        }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s tiles|shapes|forward REPS\n", argv[0]);
        return 2;
    }
    int reps = atoi(argv[2]);
    for (int i = 0; i < 4 * 1536; ++i) x[i] = 0x3f80;
    double best[4];
    if (!strcmp(argv[1], "tiles")) {
        size_t n = (size_t)24576 * 1536;
        big = weight(n);
        best_of(reps, 4, run_tiles, best);
        const char *names[4] = {"4 outputs x 1 row ", "4 outputs x 4 rows", "6 outputs x 4 rows", "8 outputs x 3 rows"};
        for (int v = 0; v < 4; ++v)
            printf("%s: %.3f ms, %.1f GB/s\n", names[v], best[v] * 1e3, n * sizeof(bf16) / best[v] / 1e9);
        return 0;
    }
    size_t bytes[4];
    for (int s = 0; s < 4; ++s) bytes[s] = (size_t)shape[s][0] * shape[s][1] * sizeof(bf16) * 30;
    for (int l = 0; l < 30; ++l)
        for (int s = 0; s < 4; ++s) layers[l][s] = weight((size_t)shape[s][0] * shape[s][1]);
    if (!strcmp(argv[1], "shapes")) {
        best_of(reps, 4, run_shapes, best);
        for (int s = 0; s < 2; ++s)
            printf("%d x %d, 30 weights: 1 row %.3f ms (%.1f GB/s), 4 rows %.3f ms (%.1f GB/s), 4 / 1 %.3f\n",
                   shape[2 + s][0], shape[2 + s][1], best[2 * s] * 1e3, bytes[2 + s] / best[2 * s] / 1e9,
                   best[2 * s + 1] * 1e3, bytes[2 + s] / best[2 * s + 1] / 1e9, best[2 * s + 1] / best[2 * s]);
        return 0;
    }
    if (!strcmp(argv[1], "forward")) {
        best_of(reps, 4, run_forward, best);
        size_t all = bytes[0] + bytes[1] + bytes[2] + bytes[3];
        for (int p = 0; p < 2; ++p)
            printf("the forward's linear layers, 30 x (qkv, o, gate_up, down)%s: 1 row %.3f ms (%.1f GB/s), 4 rows "
                   "%.3f ms (%.1f GB/s), 4 / 1 %.3f\n", p ? ", the next weight's start prefetched" : "",
                   best[2 * p] * 1e3, all / best[2 * p] / 1e9, best[2 * p + 1] * 1e3, all / best[2 * p + 1] / 1e9,
                   best[2 * p + 1] / best[2 * p]);
        return 0;
    }
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
}
