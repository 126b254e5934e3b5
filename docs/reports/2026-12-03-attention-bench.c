/* The C forward's attention alone, hot in cache, on the default model's shapes (9 heads, 3 kv heads, d = 64),
 * rows 1-4 at one context, and a hash of its outputs (equal hashes: the same bits)
 * (docs/reports/2026-12-03-head-groups.md).
 *
 *   gcc -O3 -march=native -fopenmp -fno-math-errno -DSRC="\"$PWD/medusa_runtime/kernels/lean_cpu.c\"" \
 *       -o /tmp/attention-bench docs/reports/2026-12-03-attention-bench.c -lm
 *   /tmp/attention-bench CONTEXT REPEATS COLD      (COLD=1 walks 64 MB between calls)
 */
#include SRC
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float uniform(void) { return rand() / (float)RAND_MAX - 0.5f; }

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s CONTEXT REPEATS COLD\n", argv[0]);
        return 2;
    }
    int nh = 9, nkv = 3, d = 64, start = atoi(argv[1]), reps = atoi(argv[2]), cold = atoi(argv[3]);
    int cap = start + 16;
    size_t kvn = (size_t)nkv * cap * d, big = (size_t)64 << 20;
    bf16 *kc = malloc(kvn * 2), *vc = malloc(kvn * 2), *q = malloc(16 * nh * d * 2), *out = malloc(16 * nh * d * 2);
    float *scratch = malloc(lean_scratch_size(2, 16, nh, cap, 0) * sizeof(float));
    char *junk = malloc(big);
    srand(1);
    for (size_t i = 0; i < kvn; ++i) {
        kc[i] = f2bf(uniform());
        vc[i] = f2bf(uniform());
    }
    for (int i = 0; i < 16 * nh * d; ++i) q[i] = f2bf(2 * uniform());
    memset(junk, 1, big);
    for (int n = 1; n <= 4; ++n) {
        uint8_t tree[16 * 16];
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j) tree[i * n + j] = j <= i;
        double best = 1e9;
        for (int r = 0; r < reps; ++r) {
            if (cold)
                for (size_t i = 0; i < big; i += 64) junk[i]++;
            double t0 = now();
#pragma omp parallel num_threads(2)
            attention_rows(q, kc, vc, n, nh, nkv, d, cap, start, tree, 0.125f, scratch, NULL, out);
            double t = now() - t0;
            if (t < best) best = t;
        }
        unsigned h = 0;
        for (int i = 0; i < n * nh * d; ++i) h = h * 31 + out[i];
        printf("rows %d context %d: best %.2f us (%.2f ns a key, head and row on each of 2 threads), outputs %08x\n",
               n, start, best * 1e6, best * 1e9 * 2 / (n * nh * (start + n)), h);
    }
    return 0;
}
