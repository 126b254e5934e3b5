/* A 24576 x 1536 bf16 weight (75 MB packed) streamed by lean_cpu.c's linear_rows for 1-4 activation rows on two
 * threads: GB/s of weights, best and mean of REPS calls (docs/reports/2026-12-03-fused-step.md). Build against a
 * version of the kernel source:
 *     gcc -O3 -march=native -fopenmp -fno-math-errno -DLEAN_SRC='"/path/to/lean_cpu.c"' -o /tmp/lin \
 *         docs/reports/2026-12-03-linear-stream.c -lm && /tmp/lin 30
 * (the passes of 2 of revision 26: -DSPLIT_PASSES=1 with revision 27 or later, which is also 2-row 1 + 1.)
 */
#include LEAN_SRC
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv){
  int out = 24576, in = 1536, reps = atoi(argv[1]);
  size_t psz = lean_rows4_packed_size(out, in);
  bf16 *w = malloc(sizeof(bf16) * (size_t)out * in), *wp = aligned_alloc(64, sizeof(bf16) * psz);
  for (size_t i = 0; i < (size_t)out * in; ++i) w[i] = (bf16)(0x3c00 + (i % 97));
  lean_pack_rows4(w, out, in, wp);
  bf16 x[4 * 1536]; for (int i = 0; i < 4 * 1536; ++i) x[i] = 0x3f80;
  bf16 *y = malloc(sizeof(bf16) * 4 * out);
  for (int n = 1; n <= 4; ++n) {
    double best = 1e9, tot = 0;
    for (int r = 0; r < reps; ++r) {
      double t0 = now();
#pragma omp parallel num_threads(2)
      linear_rows(wp, x, n, out, in, y, NULL, OUT_BF16);
      double t = now() - t0; tot += t; if (t < best) best = t;
    }
    printf("n=%d  %.1f GB/s (best)  %.1f GB/s (mean)\n", n, psz * 2 / best / 1e9, psz * 2 * reps / tot / 1e9);
  }
}
