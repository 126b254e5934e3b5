/* Throughput of bf16 dot-product steps (vdpbf16ps, 512 bits) on one core against the number of independent
 * accumulators (docs/reports/2026-12-03-fused-step.md):
 *     for c in 4 8 12 16 24; do gcc -O2 -march=native -DC=$c -o /tmp/dp$c docs/reports/2026-12-03-dot-latency.c && /tmp/dp$c; done
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define BAR(i) __asm__ volatile("" : "+v"(a[i]))
int main(){
  __m512 a[C]; for(int i=0;i<C;i++) a[i]=_mm512_setzero_ps();
  __m512bh x=(__m512bh)_mm512_set1_epi16(0x3f80), y=(__m512bh)_mm512_set1_epi16(0x3f80);
  long N=400000000/C;
  double t0=now();
  for(long i=0;i<N;i++){
    for(int k=0;k<C;k++) { a[k]=_mm512_dpbf16_ps(a[k],x,y); BAR(k); }
  }
  double t=now()-t0;
  float s=0; for(int k=0;k<C;k++) s+=_mm512_reduce_add_ps(a[k]);
  printf("chains %d: dp/ns %.2f (%g)\n", C, N*C/t/1e9, s);
}
