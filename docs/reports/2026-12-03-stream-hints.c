/* One 75 MB packed weight (24576 x 1536) streamed by lean_cpu.c's linear_rows for 1, 2 and 4 activation rows on two
 * threads, the row counts alternated per rep; prints each one's GB/s (median) and the median of 4 rows' time over
 * one row's (docs/reports/2026-12-03-prefetch-l1.md). Build against a kernel source, with the prefetch settings
 * to compare as defines, and run the builds alternately:
 *     S=medusa_runtime/kernels/lean_cpu.c
 *     for v in "t1 -DROWS4_HINT=_MM_HINT_T1 -DROWS4_PREFETCH=16384" "t0 -DROWS4_HINT=_MM_HINT_T0 -DROWS4_PREFETCH=8192"; do
 *       set -- $v; gcc -O3 -march=native -fopenmp -fno-math-errno -DLEAN_SRC="\"$PWD/$S\"" -DTAG="\"$1\"" $2 $3 \
 *           -o /tmp/s_$1 docs/reports/2026-12-03-stream-hints.c -lm; done
 *     for i in 1 2 3; do /tmp/s_t1 15; /tmp/s_t0 15; done
 */
#include LEAN_SRC
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc, char **argv){
  int reps = atoi(argv[1]); int out = 24576, in = 1536;
  size_t psz = lean_rows4_packed_size(out, in);
  bf16 *w = malloc(sizeof(bf16) * (size_t)out * in), *wp = aligned_alloc(64, sizeof(bf16) * psz);
  for (size_t i = 0; i < (size_t)out * in; ++i) w[i] = (bf16)(0x3c00 + (i % 97));
  lean_pack_rows4(w, out, in, wp);
  bf16 *x = malloc(2*4*in); for (int i = 0; i < 4 * in; ++i) x[i] = 0x3f80;
  bf16 *y = malloc(sizeof(bf16) * 4 * out);
  double t1[1000], t4[1000], t2[1000], rr[1000];
  for (int r = 0; r < reps; ++r) {
    double t0;
    int ns[3]={1,2,4}; double *ts[3]={t1,t2,t4};
    for (int q=0;q<3;++q){ int n=ns[(q+r)%3];
      t0 = now();
#pragma omp parallel num_threads(2)
      linear_rows(wp, x, n, out, in, y, NULL, OUT_BF16);
      ts[(q+r)%3][r] = now()-t0; }
    rr[r] = t4[r]/t1[r];
  }
  qsort(t1,reps,8,cmp); qsort(t4,reps,8,cmp); qsort(rr,reps,8,cmp); qsort(t2,reps,8,cmp);
  printf("%-10s 1 row %.1f GB/s  2 rows %.1f  4 rows %.1f  ratio4/1 median %.3f\n", TAG, psz*2/t1[reps/2]/1e9, psz*2/t2[reps/2]/1e9, psz*2/t4[reps/2]/1e9, rr[reps/2]);
}
