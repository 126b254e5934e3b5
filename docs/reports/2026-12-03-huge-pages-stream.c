/* A 270 MB packed weight (88000 x 1536) streamed by lean_cpu.c's linear_rows for 1 and 4 rows on two threads, from
 * ordinary 4 KiB pages and from a 2 MiB-aligned buffer advised for transparent huge pages (MADV_HUGEPAGE before the
 * packing touches it), the two alternated per rep; prints the process's AnonHugePages and the median ms of each
 * (docs/reports/2026-12-03-prefetch-l1.md):
 *     gcc -O3 -march=native -fopenmp -fno-math-errno -DLEAN_SRC="\"$PWD/medusa_runtime/kernels/lean_cpu.c\"" \
 *         -o /tmp/thp docs/reports/2026-12-03-huge-pages-stream.c -lm && /tmp/thp 30
 */
#include LEAN_SRC
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static bf16 *mk(int out, int in, int huge){ size_t psz = lean_rows4_packed_size(out, in);
  size_t bytes = (sizeof(bf16) * psz + (2u<<20) - 1) & ~(size_t)((2u<<20)-1);
  bf16 *w = malloc(sizeof(bf16) * (size_t)out * in), *wp = aligned_alloc(2u<<20, bytes);
  if (huge) madvise(wp, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < (size_t)out * in; ++i) w[i] = (bf16)(0x3c00 + (i % 97));
  lean_pack_rows4(w, out, in, wp); free(w); return wp; }
int main(int argc, char **argv){
  int reps = atoi(argv[1]); int out = 88000, in = 1536;
  bf16 *W[2] = {mk(out, in, 0), mk(out, in, 1)};
  bf16 *x = calloc(4*in, 2); for (int i = 0; i < 4 * in; ++i) x[i] = 0x3f80;
  bf16 *y = malloc(sizeof(bf16) * 4 * out);
  { char cmd[100]; sprintf(cmd, "grep AnonHuge /proc/%d/smaps_rollup", getpid()); system(cmd); }
  double t[2][2][200];
  for (int r = 0; r < reps; ++r) for (int h = 0; h < 2; ++h) for (int q = 0; q < 2; ++q) {
      int n = q ? 4 : 1; double t0 = now();
#pragma omp parallel num_threads(2)
      linear_rows(W[(h + r) % 2], x, n, out, in, y, NULL, OUT_BF16);
      t[(h + r) % 2][q][r] = now() - t0; }
  for (int h = 0; h < 2; ++h) { for (int q = 0; q < 2; ++q) qsort(t[h][q], reps, 8, cmp);
    printf("%s  1 row %.2f ms  4 rows %.2f ms  (%.3f)\n", h ? "huge " : "4KiB ", t[h][0][reps/2]*1e3, t[h][1][reps/2]*1e3, t[h][1][reps/2]/t[h][0][reps/2]); }
}
