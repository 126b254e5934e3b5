/* The lean engine's decode forward for Llama-family models in bfloat16 on x86 CPUs, in one call.
 *
 * Why: a decode step of a 30-layer, 576-wide model under PyTorch is ~40 small ops per layer, each
 * paying Python and dispatcher overhead (about a third of the step here), and oneDNN's bf16 GEMV
 * streams small weights (1-4 MB) at about half the machine's bandwidth. This file does a whole
 * forward of n <= a few dozen rows in C: fused RMSNorm, RoPE + cache write, attention over the
 * cache with the tree mask, SiLU*up, and its own GEMV, threaded with OpenMP (the one PyTorch loaded).
 *
 * Numerics. Every output element is computed by the same sequence of operations whatever the
 * number of rows n and the number of threads: a tree row gives bit-for-bit the result the same
 * token gets alone in a one-row step (the tree's visible keys are summed in slot order, which is
 * the order the accepted nodes have after compaction). Rounding to bf16 follows PyTorch (round to
 * nearest even) at the same places as the PyTorch path of engine.py: linear outputs, RoPE's two
 * products and their sum, SiLU and its product with up, RMSNorm before its weight and after it,
 * each residual sum. Dot products accumulate in float32 (AVX-512 BF16 dot instructions where the
 * CPU has them, a scalar float32 loop otherwise).
 *
 * Layouts: weights W [out, in] repacked once (lean_pack_rows4: blocks of 4 output rows streamed as one
 * contiguous run; lean_pack_amx for the tile path); row-major, contiguous: activations [n, width]; the KV cache
 * [layers, kv_heads, capacity, head_dim]; cos/sin tables [capacity, head_dim] with rotate_half's
 * sign folded into sin (sin[j] negated for j < D/2), as engine.py builds them.
 *
 * AMX. On CPUs with AMX-BF16 (and a kernel that grants the tile state), the linear layers run on the
 * tile unit instead: weights repacked once into 16 x 32 tiles ([out/16][in/32][16][32], zero padded),
 * up to 16 activation rows per tile product, float32 accumulation in the tile, one tile product per
 * 16 x 32 weight block whatever the number of rows. So a verify of up to 16 rows streams the weights
 * once at about the cost of one row, and (every output element still computed by the same sequence
 * of tile products, whatever the rows beside it) a tree row stays bit-for-bit its one-row step.
 * Both paths round and add residuals identically; they differ from each other in the low bits of the
 * float32 sums, so one process uses one of them for all its decode steps.
 *
 * Q4_1. A layer may hold its linear weights as GGUF Q4_1 blocks instead (LeanLayer's *_q4), with the logits
 * projection as Q8_0 (LeanModel's lm_head_q8): integer dot products against activations quantised per block of
 * 32, every output again summed in one order whatever the rows beside it (see the Q4_1 section).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LEAN_AVX512BF16 1
#else
#define LEAN_AVX512BF16 0
#endif
/* the Q4_1 / Q8_0 block products' vector paths: AVX2 (with FMA and F16C), and vpdpbusd on top where the CPU has
 * AVX512-VNNI; the portable loop elsewhere */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LEAN_QX_AVX2 1
#else
#define LEAN_QX_AVX2 0
#endif
#if LEAN_QX_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LEAN_QX_VNNI 1
#else
#define LEAN_QX_VNNI 0
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LEAN_AMX_BUILD 1
#define AMX_FN __attribute__((target("amx-tile,amx-bf16")))
#else
#define LEAN_AMX_BUILD 0
#endif

typedef uint16_t bf16;

static inline float bf2f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2bf(float f) { /* round to nearest even, NaN -> canonical quiet NaN (as c10) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFF + ((u >> 16) & 1);
    return (bf16)(u >> 16);
}

int lean_has_avx512bf16(void) { return LEAN_AVX512BF16; }
/* How the Q4_1 / Q8_0 block products sum bytes: 2 AVX512-VNNI (vpdpbusd), 1 AVX2 (maddubs, madd), 0 the portable
 * loop (the same integers and float32 chain on every path) */
int lean_int8_dot_path(void) { return LEAN_QX_VNNI ? 2 : LEAN_QX_AVX2; }

/* ------------------------------------------------------------------ dot products */

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen8(const bf16 *p) { /* 8 bf16 -> 8 float32 (exact) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) { /* one fixed pattern of adds */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sum_k a[k] b[k] over `len` bf16 pairs, float32 accumulation, fixed order */
static inline float dot_bf16(const bf16 *a, const bf16 *b, int len) {
#if LEAN_AVX512BF16
    __m512 acc = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= len; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
    if (k < len) {
        __mmask32 m = (__mmask32)((1ull << (len - k)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + k),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, b + k));
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= len; k += 8)
        acc = _mm256_fmadd_ps(widen8(a + k), widen8(b + k), acc);
    float tail = 0.f;
    for (; k < len; ++k) tail += bf2f(a[k]) * bf2f(b[k]);
    return hsum8(acc) + tail;
#else
    float acc = 0.f;
    for (int k = 0; k < len; ++k) acc += bf2f(a[k]) * bf2f(b[k]);
    return acc;
#endif
}

#if LEAN_AVX512BF16
/* Software prefetch of the packed weights, ROWS4_PREFETCH bytes ahead (into L1 by default: ROWS4_HINT), for calls
 * of ROWS4_PREFETCH_FROM rows or more: 1 (every call), except on Zen 4 where the build sets 2, 16 KB and into L2.
 * Why: from 2 rows on the dot products take longer than the weights' transfer, and a software prefetch keeps the
 * stream ahead of them on every CPU measured; for one row it pays on Zen 5, while on Zen 4 the hardware prefetcher
 * alone streams best; 8 KB into L1 beat 16 KB into L2 where both were tried, and two distances at once did not
 * help (docs/reports/prefetch-l1.md, docs/reports/lockstep.md; 2 rows: see linear_rows). */
#ifndef ROWS4_PREFETCH
#define ROWS4_PREFETCH 8192
#endif
#ifndef ROWS4_HINT
#define ROWS4_HINT _MM_HINT_T0
#endif

/* the sums of four accumulators [sum a0, sum a1, sum a2, sum a3], by one fixed pattern of adds */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* four weight rows against R activation rows (R <= 4): out[r][c] = dot(x row r, w row c), each with its
 * own accumulator over k in the same order as dot_bf16, so results do not depend on R. wb: the block's
 * packed weights (lean_pack_rows4: per 32 inputs, the 4 rows' 32 values side by side, zero padded), so the
 * block streams as one contiguous run; the activations' last partial 32 are loaded masked (zeros, as the
 * padding). Called with a constant R, so the 4 x R accumulators stay in registers; each weight load
 * serves R rows. */
static inline __attribute__((always_inline)) void dot4xr_bf16(const bf16 *wb, int in, const bf16 *x, int R,
                                                             int prefetch, float out[4][4]) {
    __m512 acc[4][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        const bf16 *b = wb + (size_t)k * 4;  /* [4][32] */
        if (ROWS4_PREFETCH > 0 && prefetch)  /* may run past the end: prefetches never fault */
            for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)b + ROWS4_PREFETCH + line, ROWS4_HINT);
        __m512bh wv[4];
        for (int c = 0; c < 4; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(b + 32 * c);
        for (int r = 0; r < R; ++r) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)r * in + k);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    if (k < in) {  /* the last partial 32: padded weights, masked activations */
        const bf16 *b = wb + (size_t)k * 4;
        __mmask32 m = (__mmask32)((1ull << (in - k)) - 1);
        __m512bh wv[4];
        for (int c = 0; c < 4; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(b + 32 * c);
        for (int r = 0; r < R; ++r) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)r * in + k);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(out[r], reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* exp of 16 floats: Cephes' expf scheme (2^n times a degree-6 polynomial on [-ln2/2, ln2/2]),
 * element-wise, so a value's result does not depend on its lane */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

static inline __m512 load16_bf16(const bf16 *p) {  /* 16 bf16 -> 16 float32 (exact) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 widen16(__m256i h) {  /* 16 bf16 in a register -> 16 float32 (exact) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_bf16_masked(__mmask16 m, const bf16 *p) {  /* lanes outside m: 0 */
    return widen16(_mm256_maskz_loadu_epi16(m, p));
}

/* 16 float32 -> 16 bf16, round to nearest even (what f2bf does for every finite value this forward meets) */
static inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* v rounded to bf16 and back to float32: bf2f(f2bf(v)) for 16 lanes */
static inline __m512 round16(__m512 v) { return widen16(narrow16(v)); }
#endif

/* exp over an array in place; -inf (a masked score) gives exactly 0 */
static void exp_inplace(float *v, int len) {
    int j = 0;
#if LEAN_AVX512BF16
    for (; j + 16 <= len; j += 16) {
        __m512 x = _mm512_loadu_ps(v + j);
        __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        _mm512_storeu_ps(v + j, _mm512_maskz_mov_ps(live, exp16(x)));
    }
    if (j < len) {
        __mmask16 m = (__mmask16)((1u << (len - j)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(m, v + j);
        __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & m;
        _mm512_mask_storeu_ps(v + j, m, _mm512_maskz_mov_ps(live, exp16(x)));
    }
#else
    for (; j < len; ++j) v[j] = v[j] == -INFINITY ? 0.f : expf(v[j]);
#endif
}

/* ------------------------------------------------------------------ linear layers */

enum { OUT_BF16 = 0, OUT_BF16_RESIDUAL = 1, OUT_F32 = 2, OUT_BF16_BIAS = 3 }; /* output kinds, see linear_rows */

/* output element `at` (column `col`) of a linear layer from its float32 sum v */
static inline void store_out(void *y, const bf16 *r, int kind, size_t at, int col, float v) {
    if (kind == OUT_F32)
        ((float *)y)[at] = v;
    else if (kind == OUT_BF16)
        ((bf16 *)y)[at] = f2bf(v);
    else if (kind == OUT_BF16_BIAS)
        ((bf16 *)y)[at] = f2bf(v + bf2f(r[col]));
    else
        ((bf16 *)y)[at] = f2bf(bf2f(r[at]) + bf2f(f2bf(v)));
}

static inline int pad_to(int v, int m) { return (v + m - 1) / m * m; }

#if LEAN_AVX512BF16
/* 4 bf16 -> 4 float32 (exact) */
static inline __m128 widen4(const bf16 *p) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)p)), 16));
}

/* f2bf of 4 floats, bit for bit (the same integer rounding, NaN -> 0x7FC0), in the low 64 bits */
static inline __m128i f2bf4(__m128 v) {
    __m128i u = _mm_castps_si128(v);
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7FFF), _mm_and_si128(_mm_srli_epi32(u, 16),
                                                                                      _mm_set1_epi32(1))));
    r = _mm_srli_epi32(r, 16);
    __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(r, r);
}

/* store_out for the 4 adjacent outputs at..at+3 (columns col..col+3) of one row, from their sums v */
static inline void store_out4(void *y, const bf16 *r, int kind, size_t at, int col, __m128 v) {
    if (kind == OUT_F32) {
        _mm_storeu_ps((float *)y + at, v);
        return;
    }
    if (kind == OUT_BF16_BIAS)
        v = _mm_add_ps(v, widen4(r + col));
    else if (kind == OUT_BF16_RESIDUAL) {
        __m128i vb = f2bf4(v);
        v = _mm_add_ps(widen4(r + at), _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(vb), 16)));
    }
    _mm_storel_epi64((__m128i *)((bf16 *)y + at), f2bf4(v));
}
#endif

/* Elements of W [out, in] in the AVX-512 path's layout: [ceil(out/4)][ceil(in/32)][4][32], zero padded. */
size_t lean_rows4_packed_size(int out, int in) { return (size_t)pad_to(out, 4) * (size_t)pad_to(in, 32); }

/* W [out, in] -> packed, once per weight: block b (outputs 4b..4b+3), inputs k..k+31 at
 * packed[(b * kb_n + k / 32) * 128 + 32 c + (i - k)] = W[4b + c][i]. Read in place, four rows side by side at
 * the row stride, the weights streamed ~25 % below the machine's bandwidth, and more so with each row of
 * activations added; packed, a block is one contiguous run that the hardware prefetcher follows. */
void lean_pack_rows4(const bf16 *w, int out, int in, bf16 *packed) {
    int kb_n = pad_to(in, 32) / 32, blocks = pad_to(out, 4) / 4;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b)
        for (int kb = 0; kb < kb_n; ++kb)
            for (int c = 0; c < 4; ++c)
                for (int t = 0; t < 32; ++t) {
                    int o = 4 * b + c, i = 32 * kb + t;
                    packed[((size_t)b * kb_n + kb) * 128 + 32 * c + t] = (o < out && i < in) ? w[(size_t)o * in + i] : 0;
                }
}

#ifndef SPLIT_PASSES  /* 1: Zen 4's pass shapes, calls of 2 rows as 1 + 1 and of 3-4 rows as 2 + 1 / 2 + 2 passes
                         over each weight block (see linear_rows_pf) */
#define SPLIT_PASSES 0
#endif

#ifndef ROWS4_PREFETCH_FROM  /* the fewest rows a call prefetches the weights for (see ROWS4_PREFETCH) */
#define ROWS4_PREFETCH_FROM 1
#endif

/* row c of packed block wb (lean_pack_rows4) . x, a float32 sum in input order (the path without AVX-512 BF16) */
static inline float dot_packed_scalar(const bf16 *wb, int in, const bf16 *x, int c) {
    float acc = 0.f;
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__) /* whole blocks of 32 in 8 lanes, then the tail in input order */
    __m256 v = _mm256_setzero_ps();
    for (; k + 32 <= in; k += 32)
        for (int t = 0; t < 32; t += 8)
            v = _mm256_fmadd_ps(widen8(wb + (size_t)(k / 32) * 128 + 32 * c + t), widen8(x + k + t), v);
    acc = hsum8(v);
#endif
    for (; k < in; ++k) acc += bf2f(wb[(size_t)(k / 32) * 128 + 32 * c + k % 32]) * bf2f(x[k]);
    return acc;
}

/* y = x W^T for x [n, in] and W packed by lean_pack_rows4. Output kinds: bf16 (rounded), bf16 plus a
 * residual (y = bf16(r + bf16(x W^T)), y may alias r), float32 (unrounded, for logits), or bf16 with a bias
 * (y = bf16(x W^T + b), r = b [out]: a linear layer with bias, summed in float32 and rounded once).
 * Called from inside a parallel region: the output rows are shared out in blocks of 4. */
static void linear_rows_pf(const bf16 *wp, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                           int prefetch) {
    int blocks = (out + 3) / 4, kb_n = pad_to(in, 32) / 32;
    /* Activation rows per pass over a weight block: up to 4, all of a call's rows in one pass; on Zen 4
     * (SPLIT_PASSES, set by the build for AMD family 25) calls of 3 or 4 rows take passes of 2 (2+1, 2+2; the
     * block is re-read from L1 for the second) and calls of 2 rows passes of 1, which streamed faster there (why
     * one pass of several rows streams slower on Zen 4 is not understood; the prefetch distance made no
     * difference). Elsewhere one pass of up to 4 rows is best: a bf16 dot-product step's latency (~4.5 ns on
     * Zen 5) means the 8 accumulator chains of a pass of 2 cannot keep two cores' memory stream busy, and one pass
     * of 4 keeps 16 chains going (docs/reports/verify-rows.md). Results do not depend on the passes (each output is
     * summed in the same order whatever R is). */
    int rows_per_pass = SPLIT_PASSES ? (n == 2 ? 1 : n <= 4 ? 2 : 4) : 4;
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; ++b) {
        int o0 = 4 * b, cnt = out - o0 < 4 ? out - o0 : 4;
        const bf16 *wb = wp + (size_t)b * kb_n * 128;
        for (int i = 0; i < n;) {
            float d[4][4];
            int R = n - i < rows_per_pass ? n - i : rows_per_pass;
#if LEAN_AVX512BF16
            switch (R) {  /* constant R per call: the compiler unrolls each case */
                case 4: dot4xr_bf16(wb, in, x + (size_t)i * in, 4, prefetch, d); break;
                case 3: dot4xr_bf16(wb, in, x + (size_t)i * in, 3, prefetch, d); break;
                case 2: dot4xr_bf16(wb, in, x + (size_t)i * in, 2, prefetch, d); break;
                default: dot4xr_bf16(wb, in, x + (size_t)i * in, 1, prefetch, d); break;
            }
#else
            (void)prefetch;
            for (int rr = 0; rr < R; ++rr)  /* float32 sums in input order */
                for (int c = 0; c < cnt; ++c) d[rr][c] = dot_packed_scalar(wb, in, x + (size_t)(i + rr) * in, c);
#endif
#if LEAN_AVX512BF16
            if (cnt == 4) { /* a whole block: the four outputs of each row at once, the same bits as store_out */
                for (int rr = 0; rr < R; ++rr) store_out4(y, r, kind, (size_t)(i + rr) * out + o0, o0, _mm_loadu_ps(d[rr]));
                i += R;
                continue;
            }
#endif
            for (int rr = 0; rr < R; ++rr)
                for (int c = 0; c < cnt; ++c) store_out(y, r, kind, (size_t)(i + rr) * out + o0 + c, o0 + c, d[rr][c]);
            i += R;
        }
    }
}

static void linear_rows(const bf16 *wp, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind) {
    linear_rows_pf(wp, x, n, out, in, y, r, kind, n >= ROWS4_PREFETCH_FROM);
}

/* ------------------------------------------------------------------ Q4_1 weights (GGUF blocks)
 *
 * A linear layer whose weight is GGUF's Q4_1: per row, blocks of 32 weights w_j = d q_j + m (q_j in 0..15, d and m
 * fp16), 20 bytes a block, qs[j] holding q_j in its low nibble and q_{j+16} in its high one (a step streams 0.625
 * bytes a weight instead of bf16's 2). The logits projection beside them is GGUF's Q8_0: w_j = d q_j (q_j int8),
 * 34 bytes a block. The activations meet them as llama.cpp's Q4_1 x Q8_1 product does: each row of x is quantised
 * per block of 32 (dx = max|x| / 127, qx = round(x / dx), sx = dx sum qx), and
 *     y[r, o] = sum_b ( dw_b dx_b sum_j q_j qx_j  +  m_b sx_b )            (Q8_0: no m term)
 * with the inner sums exact in integers. Each output element is the same float32 chain whatever the rows beside
 * it: acc = fma(isum_b, dw_b dx_b, acc) and accm = fma(m_b, sx_b, accm) over the blocks in input order, then
 * acc + accm; so a tree row or a batch row gives bit for bit its one-row step, and the portable loop the AVX2 one.
 *
 * The kernels read the blocks repacked by groups of 8 output rows (lean_pack_q4_1, lean_pack_q8_0; the same bytes
 * as the file's): per block b of a group, the 8 rows' d (and m), then their quants row after row. One pass over a
 * group's block unpacks its nibbles once for up to 4 activation rows, and one horizontal-add tree leaves the 8
 * rows' exact integer sums in one register, so the scales are applied 8 outputs at a time. */

typedef struct {
    uint16_t d, m;
    uint8_t qs[16];
} BlockQ4_1;

typedef struct {
    uint16_t d;
    int8_t qs[32];
} BlockQ8_0;

/* a group of 8 rows' block b: d and m in the lane order the add tree leaves the Q4_1 sums in (LANE8), the nibbles
 * of rows 0..7 in row order (rows 2k and 2k+1 as one 32-byte load) */
typedef struct {
    uint16_t d[8], m[8];
    uint8_t qs[8][16];
} BlockQ4_1x8;

typedef struct { /* Q8_0's: d in row order */
    uint16_t d[8];
    int8_t qs[8][32];
} BlockQ8_0x8;

static const int LANE8[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* Q4_1 lane l holds row LANE8[l] of its group */

static inline float h2f(uint16_t h) { /* IEEE half -> float32 (exact) */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (e == 0x1F) u = sign | 0x7F800000 | (man << 13);
    else if (e) u = sign | ((e + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        e = 113;
        while (!(man & 0x400)) { man <<= 1; --e; }
        u = sign | (e << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* bytes of a weight [out, in] of GGUF blocks repacked by groups of 8 rows (out padded with zero blocks) */
size_t lean_q4_1_packed_bytes(int out, int in) { return (size_t)((out + 7) / 8) * (in / 32) * sizeof(BlockQ4_1x8); }
size_t lean_q8_0_packed_bytes(int out, int in) { return (size_t)((out + 7) / 8) * (in / 32) * sizeof(BlockQ8_0x8); }

void lean_pack_q4_1(const void *src, int out, int in, void *dst) {
    const BlockQ4_1 *s = (const BlockQ4_1 *)src;
    int nb = in / 32;
    memset(dst, 0, lean_q4_1_packed_bytes(out, in));
    for (int g = 0; g < (out + 7) / 8; ++g)
        for (int b = 0; b < nb; ++b) {
            BlockQ4_1x8 *t = (BlockQ4_1x8 *)dst + (size_t)g * nb + b;
            for (int l = 0; l < 8; ++l) {
                int o = 8 * g + LANE8[l], k = 8 * g + l;
                if (o < out) { t->d[l] = s[(size_t)o * nb + b].d; t->m[l] = s[(size_t)o * nb + b].m; }
                if (k < out) memcpy(t->qs[l], s[(size_t)k * nb + b].qs, 16);
            }
        }
}

void lean_pack_q8_0(const void *src, int out, int in, void *dst) {
    const BlockQ8_0 *s = (const BlockQ8_0 *)src;
    int nb = in / 32;
    memset(dst, 0, lean_q8_0_packed_bytes(out, in));
    for (int g = 0; g < (out + 7) / 8; ++g)
        for (int b = 0; b < nb; ++b) {
            BlockQ8_0x8 *t = (BlockQ8_0x8 *)dst + (size_t)g * nb + b;
            for (int l = 0; l < 8 && 8 * g + l < out; ++l) {
                t->d[l] = s[(size_t)(8 * g + l) * nb + b].d;
                memcpy(t->qs[l], s[(size_t)(8 * g + l) * nb + b].qs, 32);
            }
        }
}

/* bytes of the activation blocks for n rows of width `in` (a multiple of 32): dx and sx per block, then the int8s */
size_t lean_q8_scratch_bytes(int n, int in) { return (size_t)n * (in / 32) * 2 * sizeof(float) + (size_t)n * in; }

/* rows x [n, in] bf16 -> dx, sx [n][in / 32], xq [n, in] (see above; ties to even). Inside a parallel region: the
 * rows are shared out, and the barrier after them makes every row's blocks visible to the product. */
static void quantize_q8_rows(const bf16 *x, int n, int in, float *dx, float *sx, int8_t *xq) {
    int nb = in / 32;
#pragma omp for schedule(static)
    for (int r = 0; r < n; ++r)
        for (int b = 0; b < nb; ++b) {
            const bf16 *xb = x + (size_t)r * in + 32 * b;
            int8_t *qb = xq + (size_t)r * in + 32 * b;
            int sum = 0;
            float d;
#if defined(__AVX2__) && defined(__FMA__) /* the same values as the loop below, 8 lanes at a time */
            const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            __m256 v[4], m = _mm256_setzero_ps();
            for (int t = 0; t < 4; ++t) m = _mm256_max_ps(m, _mm256_and_ps(v[t] = widen8(xb + 8 * t), nosign));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            d = amax / 127.0f;
            __m256 inv = _mm256_set1_ps(d > 0.f ? 127.0f / amax : 0.f);
            __m256i q[4];
            for (int t = 0; t < 4; ++t) /* nearest, ties to even, as nearbyintf in the default rounding mode */
                q[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[t], inv), _MM_FROUND_TO_NEAREST_INT |
                                                                                      _MM_FROUND_NO_EXC));
            __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
            /* int32 -> int8 in order: the packs interleave the 128-bit halves, the permute puts them back */
            __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            __m256i p8 = _mm256_packs_epi16(p16, p16b);
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)qb, p8);
#else
            float amax = 0.f;
            for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(bf2f(xb[j])));
            d = amax / 127.0f;
            float inv = d > 0.f ? 127.0f / amax : 0.f;
            for (int j = 0; j < 32; ++j) {
                int q = (int)nearbyintf(bf2f(xb[j]) * inv);
                qb[j] = (int8_t)q;
                sum += q;
            }
#endif
            dx[(size_t)r * nb + b] = d;
            sx[(size_t)r * nb + b] = d * (float)sum;
        }
}

#if LEAN_QX_AVX2
/* Per int32 lane, the sum of 4 adjacent products of unsigned bytes u and signed bytes s (exact where every
 * adjacent pair of products fits in int16); with AVX512-VNNI one vpdpbusd, else maddubs into int16 pairs and
 * madd against ones. The second form adds u1 x s1 (exact where the int16 pair sums of both still fit). */
static inline __m256i sum4_u8i8(__m256i u, __m256i s) {
#if LEAN_QX_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i sum4_u8i8_2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if LEAN_QX_VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}

/* 4 vectors of 8 int32 partial sums (v_k: rows 2k and 2k+1, 4 each) -> the 8 rows' totals in LANE8 order (exact) */
static inline __m256i sum8_lane8(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}
#endif

/* One group of 8 Q4_1 rows (nb blocks) against R activation rows (R <= 4, `stride` bytes apart in xq, nb blocks
 * apart in dx and sx) -> out[rr][lane] (lanes in LANE8 order). */
static inline __attribute__((always_inline)) void dot_q4_1x8(const BlockQ4_1x8 *w, int nb, const int8_t *xq,
                                                             const float *dx, const float *sx, size_t stride, int R,
                                                             float out[4][8]) {
#if LEAN_QX_AVX2
    __m256 acc[4], accm[4];
    for (int rr = 0; rr < 4; ++rr) acc[rr] = accm[rr] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; ++b) {
        const BlockQ4_1x8 *t = w + b;
        __m256i lo[4], hi[4];
        for (int k = 0; k < 4; ++k) { /* rows 2k | 2k+1: q_0..15 in lo, q_16..31 in hi */
            __m256i q = _mm256_loadu_si256((const __m256i *)t->qs[2 * k]);
            lo[k] = _mm256_and_si256(q, low);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t->d));
        __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t->m));
        for (int rr = 0; rr < R; ++rr) {
            const int8_t *xb = xq + rr * stride + 32 * (size_t)b;
            __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
            __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
            __m256i v[4];
            for (int k = 0; k < 4; ++k) /* |pair sums| <= 2 * 15 * 127, twice that after the add: no saturation */
                v[k] = sum4_u8i8_2(lo[k], xl, hi[k], xh);
            __m256 isum = _mm256_cvtepi32_ps(sum8_lane8(v[0], v[1], v[2], v[3]));
            size_t at = (size_t)rr * nb + b;
            acc[rr] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(dx[at])), acc[rr]);
            accm[rr] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[at]), accm[rr]);
        }
    }
    for (int rr = 0; rr < R; ++rr) _mm256_storeu_ps(out[rr], _mm256_add_ps(acc[rr], accm[rr]));
#else
    for (int rr = 0; rr < R; ++rr)
        for (int l = 0; l < 8; ++l) {
            int k = LANE8[l];
            float acc = 0.f, accm = 0.f;
            for (int b = 0; b < nb; ++b) {
                const uint8_t *q = w[b].qs[k];
                const int8_t *xb = xq + rr * stride + 32 * (size_t)b;
                int sum = 0;
                for (int j = 0; j < 16; ++j) sum += (q[j] & 0x0F) * xb[j] + (q[j] >> 4) * xb[j + 16];
                size_t at = (size_t)rr * nb + b;
                acc = fmaf((float)sum, h2f(w[b].d[l]) * dx[at], acc);
                accm = fmaf(h2f(w[b].m[l]), sx[at], accm);
            }
            out[rr][l] = acc + accm;
        }
#endif
}

/* The same for a group of 8 Q8_0 rows -> out[rr][row] (row order). */
static inline __attribute__((always_inline)) void dot_q8_0x8(const BlockQ8_0x8 *w, int nb, const int8_t *xq,
                                                             const float *dx, size_t stride, int R, float out[4][8]) {
#if LEAN_QX_AVX2
    __m256 acc[4];
    for (int rr = 0; rr < 4; ++rr) acc[rr] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ8_0x8 *t = w + b;
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t->d));
        for (int rr = 0; rr < R; ++rr) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + rr * stride + 32 * (size_t)b));
            __m256i v[8];
            for (int k = 0; k < 8; ++k) { /* |q| as unsigned bytes, its sign moved onto x */
                __m256i q = _mm256_loadu_si256((const __m256i *)t->qs[k]);
                v[k] = sum4_u8i8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
            }
            __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
            __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                         _mm256_permute2x128_si256(h0, h1, 0x31)); /* rows 0..7 */
            acc[rr] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx[(size_t)rr * nb + b])),
                                      acc[rr]);
        }
    }
    for (int rr = 0; rr < R; ++rr) _mm256_storeu_ps(out[rr], acc[rr]);
#else
    for (int rr = 0; rr < R; ++rr)
        for (int k = 0; k < 8; ++k) {
            float acc = 0.f;
            for (int b = 0; b < nb; ++b) {
                const int8_t *xb = xq + rr * stride + 32 * (size_t)b;
                int sum = 0;
                for (int j = 0; j < 32; ++j) sum += w[b].qs[k][j] * xb[j];
                acc = fmaf((float)sum, h2f(w[b].d[k]) * dx[(size_t)rr * nb + b], acc);
            }
            out[rr][k] = acc;
        }
#endif
}

/* y = x W^T for W repacked by lean_pack_q4_1 (q4) or lean_pack_q8_0, `in` a multiple of 32, the output kinds of
 * linear_rows (Q8_0: OUT_F32). q8: the activation blocks' scratch, lean_q8_scratch_bytes(n, in). Inside a
 * parallel region: the groups of 8 rows are shared out, each against the rows 4 at a time. */
static void linear_qx8_rows(const void *wq, int q4, const bf16 *x, int n, int out, int in, void *y, const bf16 *r,
                            int kind, void *q8) {
    int nb = in / 32;
    float *dx = (float *)q8, *sx = dx + (size_t)n * nb;
    int8_t *xq = (int8_t *)(sx + (size_t)n * nb);
    quantize_q8_rows(x, n, in, dx, sx, xq);
#pragma omp for schedule(static)
    for (int g = 0; g < (out + 7) / 8; ++g) {
        const BlockQ4_1x8 *w4 = (const BlockQ4_1x8 *)wq + (size_t)g * nb;
        const BlockQ8_0x8 *w8 = (const BlockQ8_0x8 *)wq + (size_t)g * nb;
        for (int i = 0; i < n; i += 4) {
            int R = n - i < 4 ? n - i : 4;
            float d[4][8];
            const int8_t *xr = xq + (size_t)i * in;
            const float *dr = dx + (size_t)i * nb, *sr = sx + (size_t)i * nb;
            switch (q4 ? R : 4 + R) { /* constant R per case: the compiler unrolls each */
                case 4: dot_q4_1x8(w4, nb, xr, dr, sr, in, 4, d); break;
                case 3: dot_q4_1x8(w4, nb, xr, dr, sr, in, 3, d); break;
                case 2: dot_q4_1x8(w4, nb, xr, dr, sr, in, 2, d); break;
                case 1: dot_q4_1x8(w4, nb, xr, dr, sr, in, 1, d); break;
                case 8: dot_q8_0x8(w8, nb, xr, dr, in, 4, d); break;
                case 7: dot_q8_0x8(w8, nb, xr, dr, in, 3, d); break;
                case 6: dot_q8_0x8(w8, nb, xr, dr, in, 2, d); break;
                default: dot_q8_0x8(w8, nb, xr, dr, in, 1, d); break;
            }
            for (int l = 0; l < 8; ++l) {
                int o = 8 * g + (q4 ? LANE8[l] : l);
                if (o < out)
                    for (int rr = 0; rr < R; ++rr) store_out(y, r, kind, (size_t)(i + rr) * out + o, o, d[rr][l]);
            }
        }
    }
}

/* The standalone calls (the logits projection, tests, the profile's bandwidth check), on weights repacked as above */
void lean_linear_q8_0(const void *wq, const bf16 *x, int n, int out, int in, float *y, void *q8, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_qx8_rows(wq, 0, x, n, out, in, y, NULL, OUT_F32, q8);
}

void lean_linear_q4_1(const void *wq, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                      void *q8, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_qx8_rows(wq, 1, x, n, out, in, y, r, kind, q8);
}


/* ------------------------------------------------------------------ AMX linear layers */

#define TILE_K 32  /* bf16 per tile row (64 bytes) */
#define TILE_M 16  /* rows per tile */
#define AMX_GROUP 2 /* output blocks of 16 sharing one activation tile, packed side by side */
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 8 /* prefetch distance in kb steps of a group (2 KB of weights each), into L2 */
#endif

/* Elements of a packed weight: [ceil(out/64)][ceil(in/32)][4 blocks][16 k-pairs][16 outputs][2], zero padded. */
size_t lean_amx_packed_size(int out, int in) {
    return (size_t)pad_to(out, TILE_M * AMX_GROUP) * (size_t)pad_to(in, TILE_K);
}

/* W [out, in] -> packed tiles, once per weight. Tile (group, kb, j) is the B operand of the tile product for
 * outputs (4 group + j) * 16 .. + 15 and inputs kb * 32 .. + 31, in the pair-interleaved layout the tile
 * product reads: B[kk][m][p] = W[o0 + m][k0 + 2 kk + p]. For a group, the 4 tiles of one kb lie side by
 * side and the kb follow each other: the weights stream in one contiguous pass. */
void lean_pack_amx(const bf16 *w, int out, int in, bf16 *packed) {
    int kb_n = pad_to(in, TILE_K) / TILE_K, groups = pad_to(out, TILE_M * AMX_GROUP) / (TILE_M * AMX_GROUP);
#pragma omp parallel for schedule(static)
    for (int gi = 0; gi < groups; ++gi)
        for (int kb = 0; kb < kb_n; ++kb)
            for (int j = 0; j < AMX_GROUP; ++j) {
                bf16 *tile = packed + (((size_t)gi * kb_n + kb) * AMX_GROUP + j) * TILE_M * TILE_K;
                for (int kk = 0; kk < 16; ++kk)
                    for (int m = 0; m < 16; ++m)
                        for (int p = 0; p < 2; ++p) {
                            int o = (gi * AMX_GROUP + j) * TILE_M + m, c = kb * TILE_K + 2 * kk + p;
                            tile[(kk * 16 + m) * 2 + p] = (o < out && c < in) ? w[(size_t)o * in + c] : 0;
                        }
            }
}

#if LEAN_AMX_BUILD
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_state = -1; /* -1 unknown, 0 unavailable, 1 granted */

/* 1 when the CPU has AMX-BF16 and the kernel grants this process the tile data state (Linux asks for it
 * once per process: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
int lean_amx_available(void) {
    if (amx_state >= 0) return amx_state;
    unsigned a, b, c, d;
    amx_state = 0;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        int tile = (d >> 24) & 1, bf = (d >> 22) & 1;
        if (tile && bf && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0)
            amx_state = 1;
    }
    return amx_state;
}

/* tiles 0-3: C (16 activation rows x 16 outputs, float32), 4-5: A (16 activation rows x 32 inputs),
 * 6-7: B (16 input pairs x 16 outputs x 2); the attention's q . k uses 0, 4 and 5 */
AMX_FN static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x [n, in] -> xa [chunks of 16 rows][in/32][16 rows][32]: the A operand, zero padded (rows past n, inputs
 * past in), so that a tile load never reads outside the scratch */
static void amx_pack_rows(const bf16 *x, int n, int in, bf16 *xa) {
    int kb_n = pad_to(in, TILE_K) / TILE_K, chunks = (n + 15) / 16;
#pragma omp for schedule(static)
    for (int t = 0; t < chunks * 16; ++t) {  /* one activation row (real or padding) per task */
        int ch = t / 16, r = t % 16, row = ch * 16 + r;
        for (int kb = 0; kb < kb_n; ++kb) {
            bf16 *dst = xa + (((size_t)ch * kb_n + kb) * 16 + r) * TILE_K;
            int len = row < n ? (in - kb * TILE_K < TILE_K ? in - kb * TILE_K : TILE_K) : 0;
            if (len > 0) memcpy(dst, x + (size_t)row * in + kb * TILE_K, (size_t)len * sizeof(bf16));
            if (len < TILE_K) memset(dst + len, 0, (size_t)(TILE_K - len) * sizeof(bf16));
        }
    }
}

/* The tile products of one group (2 output blocks of 16) for one or two 16-row chunks of activations:
 * C[ch][j] [16 rows x 16 outputs] = sum over kb of A[ch]_kb B_{kb,j}. a0, a1: the A operands of kb = 0 for the
 * two chunks (a1 NULL: one chunk), a_kb their distance to the next kb, a_stride their row stride in bytes (the
 * packed rows: 512, 64; the activation rows in place: 32, 2 in). Every C element sees the same products in the
 * same order however many chunks run beside it. Tiles: 0-3 C, 4-5 A, 6-7 B. */
AMX_FN static void amx_group(const bf16 *wg, int kb_n, const bf16 *a0, const bf16 *a1, size_t a_kb, int a_stride,
                             float c[2][AMX_GROUP][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < kb_n; ++kb) {
        const bf16 *b = wg + (size_t)kb * AMX_GROUP * 512;
        /* the weights AMX_PREFETCH kb steps ahead on their way into the caches meanwhile; past the end of this
         * group it is the next group's, which this thread takes next (prefetches never fault) */
        const char *ahead = (const char *)(b + (size_t)AMX_PREFETCH * AMX_GROUP * 512);
        for (int line = 0; line < AMX_GROUP * 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
        _tile_loadd(4, a0 + (size_t)kb * a_kb, a_stride);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (a1) {
            _tile_loadd(5, a1 + (size_t)kb * a_kb, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0][0], 64);
    _tile_stored(1, c[0][1], 64);
    if (a1) {
        _tile_stored(2, c[1][0], 64);
        _tile_stored(3, c[1][1], 64);
    }
}

/* 16 float32 sums -> y[0..len) as store_out does for each (bf16 by round to nearest even, plus a residual) */
static inline void store16(void *y, const bf16 *r, int kind, size_t at, int col, const float *v, int len) {
#if LEAN_AVX512BF16
    if (len == 16 && kind != OUT_F32) {
        __m512 sum = _mm512_loadu_ps(v);
        if (kind == OUT_BF16_BIAS) sum = _mm512_add_ps(sum, load16_bf16(r + col));
        __m256i h = (__m256i)_mm512_cvtneps_pbh(sum);  /* round to nearest even */
        if (kind == OUT_BF16_RESIDUAL) {
            __m512 res = _mm512_add_ps(load16_bf16(r + at), widen16(h));
            h = (__m256i)_mm512_cvtneps_pbh(res);
        }
        _mm256_storeu_si256((__m256i *)((bf16 *)y + at), h);
        return;
    }
    if (len == 16) {
        _mm512_storeu_ps((float *)y + at, _mm512_loadu_ps(v));
        return;
    }
#endif
    for (int m = 0; m < len; ++m) store_out(y, r, kind, at + m, col + m, v[m]);
}

/* y = x W^T on the tile unit (wp: lean_pack_amx of W [out, in]). x_padded: x has rows up to a multiple of 16
 * (their values unused: an output row depends on its own input row only) and in is a multiple of 32, so the
 * tiles load the rows where they are; else they are first copied, zero padded, into xa (room for
 * amx_pack_rows of x). Called inside a parallel region whose threads have loaded the tile configuration. */
static void linear_rows_amx(const bf16 *wp, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                            bf16 *xa, int x_padded) {
    int kb_n = pad_to(in, TILE_K) / TILE_K, chunks = (n + 15) / 16;
    int groups = pad_to(out, TILE_M * AMX_GROUP) / (TILE_M * AMX_GROUP);
    int direct = x_padded && in % TILE_K == 0;
    if (!direct) amx_pack_rows(x, n, in, xa); /* ends with the barrier of its omp for */
#pragma omp for schedule(static)
    for (int gi = 0; gi < groups; ++gi) {
        float c[2][AMX_GROUP][256]; /* [chunk][block][activation row * 16 + output] */
        const bf16 *wg = wp + (size_t)gi * kb_n * AMX_GROUP * 512;
        for (int ch = 0; ch < chunks; ch += 2) { /* two chunks of rows per pass over the group's weights */
            int pair = ch + 1 < chunks;
            if (direct)
                amx_group(wg, kb_n, x + (size_t)ch * 16 * in, pair ? x + (size_t)(ch + 1) * 16 * in : NULL, TILE_K,
                          2 * in, c);
            else
                amx_group(wg, kb_n, xa + (size_t)ch * kb_n * 512, pair ? xa + (size_t)(ch + 1) * kb_n * 512 : NULL,
                          512, 64, c);
            for (int u = 0; u <= pair; ++u) {
                int c0 = ch + u, rows = n - c0 * 16 < 16 ? n - c0 * 16 : 16;
                for (int j = 0; j < AMX_GROUP; ++j) {
                    int o0 = (gi * AMX_GROUP + j) * TILE_M, len = out - o0 < 16 ? out - o0 : 16;
                    if (len <= 0) break;
                    for (int rr = 0; rr < rows; ++rr)
                        store16(y, r, kind, (size_t)(c0 * 16 + rr) * out + o0, o0, c[u][j] + rr * 16, len);
                }
            }
        }
    }
}

AMX_FN static void amx_release(void) { _tile_release(); }

/* the tile version of lean_linear: wp packed by lean_pack_amx, xa scratch of lean_amx_scratch_size(n, in)
 * bf16. Returns 0, or -2 where the tile unit is unavailable (nothing computed). */
int lean_linear_amx(const bf16 *wp, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                    bf16 *xa, int nthreads) {
    if (!lean_amx_available()) return -2;
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure();
        linear_rows_amx(wp, x, n, out, in, y, r, kind, xa, 0);
        amx_release();
    }
    return 0;
}
#else
int lean_amx_available(void) { return 0; }
int lean_linear_amx(const bf16 *wp, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                    bf16 *xa, int nthreads) {
    (void)wp; (void)x; (void)n; (void)out; (void)in; (void)y; (void)r; (void)kind; (void)xa; (void)nthreads;
    return -2;
}
#endif

/* bf16 elements of the row scratch the tile path needs for n rows of width `in` */
size_t lean_amx_scratch_size(int n, int in) { return (size_t)((n + 15) / 16) * pad_to(in, TILE_K) * 16; }

/* linear_rows as a standalone call (the heads' projections, the logits): w packed by lean_pack_rows4 */
void lean_linear(const bf16 *w, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind,
                 int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_rows(w, x, n, out, in, y, r, kind);
}

/* ------------------------------------------------------------------ element-wise pieces */

/* transformers' LlamaRMSNorm in bf16: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) */
static void rmsnorm_rows(const bf16 *x, const bf16 *w, int n, int h, float eps, bf16 *y) {
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) {
        const bf16 *xi = x + (size_t)i * h;
        bf16 *yi = y + (size_t)i * h;
        int k = 0;
#if LEAN_AVX512BF16
        __m512 acc = _mm512_setzero_ps();
        for (; k + 16 <= h; k += 16) {
            __m512 v = load16_bf16(xi + k);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
#else
        float ss = 0.f;
#endif
        for (int t = k; t < h; ++t) ss += bf2f(xi[t]) * bf2f(xi[t]);
        float r = 1.0f / sqrtf(ss / (float)h + eps);
        k = 0;
#if LEAN_AVX512BF16
        for (; k + 16 <= h; k += 16) {
            __m512 v = round16(_mm512_mul_ps(load16_bf16(xi + k), _mm512_set1_ps(r)));
            _mm256_storeu_si256((__m256i *)(yi + k), narrow16(_mm512_mul_ps(load16_bf16(w + k), v)));
        }
#endif
        for (; k < h; ++k) yi[k] = f2bf(bf2f(w[k]) * bf2f(f2bf(bf2f(xi[k]) * r)));
    }
}

/* RoPE on q and k of qkv [n, (nh + 2 nkv) D]: q -> qo [n, nh, D]; k, v -> the cache slots start..start+n-1.
 * x_rot[j] = bf16(bf16(x[j] cos[j]) + bf16(x[(j + D/2) % D] sin[j])), cos/sin rows taken at pos[i]. */
static void rope_rows(const bf16 *qkv, int n, int nh, int nkv, int d, const int64_t *pos, const bf16 *cos_t,
                      const bf16 *sin_t, bf16 *qo, bf16 *kc, bf16 *vc, int cap, int start) {
    int rows = n * (nh + 2 * nkv), half = d / 2, width = (nh + 2 * nkv) * d;
#pragma omp for schedule(static)
    for (int t = 0; t < rows; ++t) {
        int i = t / (nh + 2 * nkv), hd = t % (nh + 2 * nkv);
        const bf16 *x = qkv + (size_t)i * width + (size_t)hd * d;
        bf16 *dst;
        if (hd < nh)
            dst = qo + ((size_t)i * nh + hd) * d;
        else if (hd < nh + nkv)
            dst = kc + ((size_t)(hd - nh) * cap + start + i) * d;
        else {  /* v: copied as is */
            memcpy(vc + ((size_t)(hd - nh - nkv) * cap + start + i) * d, x, (size_t)d * sizeof(bf16));
            continue;
        }
        const bf16 *c = cos_t + (size_t)pos[i] * d, *s = sin_t + (size_t)pos[i] * d;
#if LEAN_AVX512BF16
        if (half % 16 == 0) {
            for (int j = 0; j < d; j += 16) {
                int jp = (j + half) % d;  /* the rotated half: a 16-lane block never straddles it */
                __m512 a = round16(_mm512_mul_ps(load16_bf16(x + j), load16_bf16(c + j)));
                __m512 b = round16(_mm512_mul_ps(load16_bf16(x + jp), load16_bf16(s + j)));
                _mm256_storeu_si256((__m256i *)(dst + j), narrow16(_mm512_add_ps(a, b)));
            }
            continue;
        }
#endif
        for (int j = 0; j < d; ++j) {
            float a = bf2f(f2bf(bf2f(x[j]) * bf2f(c[j])));
            float b = bf2f(f2bf(bf2f(x[(j + half) % d]) * bf2f(s[j])));
            dst[j] = f2bf(a + b);
        }
    }
}

/* act [n, I] = bf16(bf16(silu(gate)) * up) for gu [n, 2I] = [gate | up]; silu(g) = g / (1 + exp(-g)) */
static void silu_mul_rows(const bf16 *gu, int n, int inter, bf16 *act) {
    int chunks = (inter + 15) / 16, tasks = n * chunks;
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        int i = t / chunks, j0 = (t % chunks) * 16, len = inter - j0 < 16 ? inter - j0 : 16;
        const bf16 *g = gu + (size_t)i * 2 * inter + j0, *u = g + inter;
        bf16 *out = act + (size_t)i * inter + j0;
#if LEAN_AVX512BF16
        if (len == 16) {
            __m512 gv = load16_bf16(g);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_storeu_si256((__m256i *)out, narrow16(_mm512_mul_ps(sv, load16_bf16(u))));
            continue;
        }
#endif
        float e[16];
        for (int c = 0; c < len; ++c) e[c] = -bf2f(g[c]);
        exp_inplace(e, len);
        for (int c = 0; c < len; ++c) {
            float s = bf2f(f2bf(bf2f(g[c]) / (1.0f + e[c])));
            out[c] = f2bf(s * bf2f(u[c]));
        }
    }
}

/* ------------------------------------------------------------------ attention */

#if LEAN_AVX512BF16
/* which of the slots j..j+cnt-1 row i sees (see attention_rows), as a mask of cnt bits */
static inline __mmask16 seen16(int j, int cnt, int start, int i, int n, const uint8_t *tree) {
    unsigned all = cnt == 16 ? 0xffffu : (1u << cnt) - 1;
    if (j + cnt <= start) return (__mmask16)all;
    unsigned m = 0;
    for (int c = 0; c < cnt; ++c) {
        int slot = j + c, a = slot - start;
        if (slot < start || (tree ? tree[(size_t)i * n + a] : a <= i)) m |= 1u << c;
    }
    return (__mmask16)m;
}
#endif

#if LEAN_AVX512BF16
/* f2bf of 16 floats, bit for bit (see f2bf4), stored at y */
static inline void store16_f2bf(bf16 *y, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(r));
}

/* q . k for H query heads sharing a kv head (qs[h], rows of d = 64 bf16; H <= 3, a constant per call) and the 16
 * keys k[0..cnt) (rows of 64 bf16): each key's two dot-product steps in one accumulator, then reduce4's adds, whose
 * pattern is the same for every key of a group of 4, so a key's score does not depend on its place in the block
 * (the property that lets a tree row equal its one-row step, where the same key sits in another slot) nor on how
 * many heads share the call. Each key is loaded once for the H heads. Against one key at a time (dot_bf16, a
 * horizontal sum per key) this is about a fifth of the instructions. out[h]: lanes from cnt on are undefined. */
static inline __attribute__((always_inline)) void scores16_heads_d64(const bf16 *const *qs, const int H,
                                                                    const bf16 *k, int cnt, __m512 *out) {
    __m512bh q0[3], q1[3];
    for (int h = 0; h < H; ++h) {
        q0[h] = (__m512bh)_mm512_loadu_si512(qs[h]);
        q1[h] = (__m512bh)_mm512_loadu_si512(qs[h] + 32);
    }
    __m128 s[3][4];
    for (int g = 0; g < 4; ++g) {
        __m512bh k0[4], k1[4];
        for (int c = 0; c < 4; ++c) {
            const bf16 *kr = k + (size_t)(4 * g + c) * 64;
            int have = 4 * g + c < cnt;
            k0[c] = (__m512bh)(have ? _mm512_loadu_si512(kr) : _mm512_setzero_si512());
            k1[c] = (__m512bh)(have ? _mm512_loadu_si512(kr + 32) : _mm512_setzero_si512());
        }
        for (int h = 0; h < H; ++h) {
            __m512 a[4];
            for (int c = 0; c < 4; ++c)
                a[c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0[h], k0[c]), q1[h], k1[c]);
            s[h][g] = reduce4(a[0], a[1], a[2], a[3]);
        }
    }
    for (int h = 0; h < H; ++h) {
        __m512 o = _mm512_castps128_ps512(s[h][0]);
        o = _mm512_insertf32x4(o, s[h][1], 1);
        o = _mm512_insertf32x4(o, s[h][2], 2);
        out[h] = _mm512_insertf32x4(o, s[h][3], 3);
    }
}

/* Row i's softmax numerators for H heads sharing a kv head over the slots [0, end): p[h end + j] = exp(q_h . k_j
 * scale - max_h) for the slots the row sees (see attention_rows), 0 for the others, and pb the same rounded to
 * bf16 (the weights of the values' sum). The keys 32 slots ahead are prefetched into L1 and the values of the
 * same slots into L2 for the weighted sum that follows: a layer's cache comes from DRAM (the weights streamed
 * since evicted it), and without the prefetch one row's attention waits on it. */
static inline __attribute__((always_inline)) void probs_heads_d64(const bf16 *const *qs, const int H,
                                                                 const bf16 *kh, const bf16 *vh, int i, int n,
                                                                 int start, int end, const uint8_t *tree,
                                                                 float scale, float *p, bf16 *pb) {
    __m512 vmx[3], vs = _mm512_set1_ps(scale);
    for (int h = 0; h < H; ++h) vmx[h] = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < end; j += 16) { /* 16 keys at a time; unseen and missing lanes -inf */
        int cnt = end - j < 16 ? end - j : 16;
        for (int l = 0; l < 16 * 64 * (int)sizeof(bf16); l += 64) { /* prefetches never fault */
            if (j + 32 < end) _mm_prefetch((const char *)(kh + (size_t)(j + 32) * 64) + l, _MM_HINT_T0);
            _mm_prefetch((const char *)(vh + (size_t)j * 64) + l, _MM_HINT_T1);
        }
        __m512 sc[3];
        scores16_heads_d64(qs, H, kh + (size_t)j * 64, cnt, sc);
        __mmask16 seen = seen16(j, cnt, start, i, n, tree), live = (__mmask16)(cnt == 16 ? 0xffffu : (1u << cnt) - 1);
        for (int h = 0; h < H; ++h) {
            __m512 v = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(sc[h], vs));
            _mm512_mask_storeu_ps(p + (size_t)h * end + j, live, v);
            vmx[h] = _mm512_max_ps(vmx[h], v);
        }
    }
    for (int h = 0; h < H; ++h) { /* exp(x - max), 0 where x is -inf, and its bf16 copy */
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[h]));
        float *ph = p + (size_t)h * end;
        bf16 *bh = pb + (size_t)h * end;
        for (int j = 0; j < end; j += 16) {
            __mmask16 m = (__mmask16)(end - j >= 16 ? 0xffffu : (1u << (end - j)) - 1);
            __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, ph + j), mx);
            __mmask16 on = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & m;
            __m512 e = _mm512_maskz_mov_ps(on, exp16(x));
            _mm512_mask_storeu_ps(ph + j, m, e);
            _mm256_mask_storeu_epi16(bh + j, m, narrow16(e));
        }
    }
}

/* dims of a pair product's four accumulators (see pair_dp) back in order: acc0 holds dims 8L + t, acc1 dims
 * 8L + 4 + t of the first 32 (lane 4L + t, L the 128-bit lane), acc2 / acc3 the same of the second 32 */
static inline void unpair_store(bf16 *o, __m512 acc0, __m512 acc1, __m512 acc2, __m512 acc3, __m512 sum) {
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    store16_f2bf(o, _mm512_div_ps(_mm512_permutex2var_ps(acc0, lo, acc1), sum));
    store16_f2bf(o + 16, _mm512_div_ps(_mm512_permutex2var_ps(acc0, hi, acc1), sum));
    store16_f2bf(o + 32, _mm512_div_ps(_mm512_permutex2var_ps(acc2, lo, acc3), sum));
    store16_f2bf(o + 48, _mm512_div_ps(_mm512_permutex2var_ps(acc2, hi, acc3), sum));
}

/* the values of two keys (rows of 64 bf16) interleaved per dim, as vdpbf16ps pairs them: w[0] = (v0[8L + t],
 * v1[8L + t]) for lane 4L + t, w[1] the dims 8L + 4 + t, w[2] / w[3] the same 32 dims on */
static inline void pair_values(const bf16 *v0, const bf16 *v1, __m512bh w[4]) {
    __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v1);
    __m512i b0 = _mm512_loadu_si512(v0 + 32), b1 = _mm512_loadu_si512(v1 + 32);
    w[0] = (__m512bh)_mm512_unpacklo_epi16(a0, a1);
    w[1] = (__m512bh)_mm512_unpackhi_epi16(a0, a1);
    w[2] = (__m512bh)_mm512_unpacklo_epi16(b0, b1);
    w[3] = (__m512bh)_mm512_unpackhi_epi16(b0, b1);
}

/* acc[c] += p0 v0 + p1 v1 over the four blocks of dims, pp = the two weights (bf16) in one 32-bit word */
static inline void pair_dp(__m512 acc[4], const __m512bh w[4], uint32_t pp) {
    __m512bh b = (__m512bh)_mm512_set1_epi32((int)pp);
    for (int c = 0; c < 4; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], w[c], b);
}

/* the float32 sum of the numerators p over a row's seen sequence (the prefix's slots [0, start), then its tree
 * slots tidx[0..tcnt)), as 16 lanes of seen positions 16c + l summed over c (a run that reaches the tree slots
 * gathered, zero beyond the sequence's end), then the lanes by one fixed pattern of adds: a function of the seen
 * sequence alone, whatever slots it sits in (see attend_heads_d64). Vector lanes instead of two scalar sums per
 * pair of slots make the hot attention a few per cent faster (docs/reports/verify-roofline.md). */
static inline float seen_sum16(const float *p, int start, const int *tidx, int tcnt) {
    __m512 acc = _mm512_setzero_ps();
    int total = start + tcnt, c = 0;
    for (; c + 16 <= start; c += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + c));
    for (; c < total; c += 16) {
        float g[16];
        for (int l = 0; l < 16; ++l) {
            int a = c + l;
            g[l] = a >= total ? 0.f : a < start ? p[a] : p[tidx[a - start]];
        }
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(g));
    }
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* Row i, heads hd0..hd0+H-1 (H <= 3, a constant per call; one kv head), d = 64: out = sum_j p_j v_j / sum_j p_j
 * over the slots the row sees, p_j the softmax numerators in float32 and, as weights of the sum, rounded to bf16
 * (as PyTorch's CPU flash attention rounds them for bf16 values); the sum of the weights stays float32
 * (seen_sum16). The seen slots, in order (the cached prefix [0, start), seen by every row, then the row's own tree
 * slots), go in pairs (2m, 2m + 1), each pair one dot-product step (p_a v_a + p_b v_b in each output lane) into
 * set m % 2 of a head's accumulators (then set 0 + set 1); an odd last slot pairs with a zero weight. So a head
 * adds the same terms in the same order whatever slots they sit in and whichever heads or rows share its call: a
 * tree row equals its one-row step. The H heads share each pair's loads and interleaving. p: H * end floats; pb:
 * H * end bf16; tidx: n ints (scratch). */
static inline __attribute__((always_inline)) void attend_heads_d64(const bf16 *q, const bf16 *kh, const bf16 *vh,
                                                                  int i, int hd0, const int H, int nh, int n,
                                                                  int start, int end, const uint8_t *tree,
                                                                  float scale, float *p, bf16 *pb, int *tidx,
                                                                  bf16 *out) {
    const bf16 *qs[3];
    for (int h = 0; h < H; ++h) qs[h] = q + ((size_t)i * nh + hd0 + h) * 64;
    probs_heads_d64(qs, H, kh, vh, i, n, start, end, tree, scale, p, pb);
    int tcnt = 0;
    for (int a = 0; a < n; ++a)
        if (tree ? tree[(size_t)i * n + a] : a <= i) tidx[tcnt++] = start + a;
    __m512 acc[3][2][4]; /* [head][set][dims block] */
    for (int h = 0; h < H; ++h)
        for (int t = 0; t < 2; ++t)
            for (int c = 0; c < 4; ++c) acc[h][t][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 4 <= start; k += 4) { /* prefix pairs (k, k + 1), set 0, and (k + 2, k + 3), set 1 */
        for (int t = 0; t < 2; ++t) {
            __m512bh w[4];
            pair_values(vh + (size_t)(k + 2 * t) * 64, vh + (size_t)(k + 2 * t + 1) * 64, w);
            for (int h = 0; h < H; ++h) {
                uint32_t pp;
                memcpy(&pp, pb + (size_t)h * end + k + 2 * t, 4);
                pair_dp(acc[h][t], w, pp);
            }
        }
    }
    static const bf16 zeros[64];
    int total = start + tcnt;
    for (int a = k; a < total; a += 2) { /* the rest of the seen sequence: the prefix's last slots, then the tree's */
        int sa = a < start ? a : tidx[a - start];
        int sb = a + 1 >= total ? -1 : a + 1 < start ? a + 1 : tidx[a + 1 - start];
        __m512bh w[4];
        pair_values(vh + (size_t)sa * 64, sb < 0 ? zeros : vh + (size_t)sb * 64, w);
        int t = (a / 2) % 2;
        for (int h = 0; h < H; ++h) {
            const bf16 *bh = pb + (size_t)h * end;
            pair_dp(acc[h][t], w, (uint32_t)bh[sa] | (sb < 0 ? 0u : (uint32_t)bh[sb] << 16));
        }
    }
    for (int h = 0; h < H; ++h) {
        __m512 sum = _mm512_set1_ps(seen_sum16(p + (size_t)h * end, start, tidx, tcnt));
        __m512 c[4];
        for (int b = 0; b < 4; ++b) c[b] = _mm512_add_ps(acc[h][0][b], acc[h][1][b]);
        unpair_store(out + ((size_t)i * nh + hd0 + h) * 64, c[0], c[1], c[2], c[3], sum);
    }
}
#endif

/* float32 scratch per thread and cache slot of the attention: three heads' softmax numerators, their bf16 copies
 * (the weights of the values' sum), the row's seen tree slots */
#define ATT_SCRATCH 6

/* a call's attention tasks share a kv head's keys and values among up to 3 of its heads when that leaves at
 * least this many tasks per thread (else one head a task). 1: a plain step of the default model (3 kv heads) runs
 * 3 tasks on 2 threads rather than 9 one-head tasks, since the heads' shared loads of the keys and values cost
 * less than the balance the smaller tasks would give. */
#ifndef HEADS_MIN_TASKS
#define HEADS_MIN_TASKS 1
#endif

/* floats of lean_forward's / lean_decode's scratch for rows rows over a cache of cap slots: the attention's per
 * thread, and with the tile path every query's scores q . k after them */
size_t lean_scratch_size(int nthreads, int rows, int nh, int cap, int amx) {
    return ((size_t)ATT_SCRATCH * nthreads + (amx ? (size_t)rows * nh : 0)) * (size_t)cap;
}

/* Row i (query at cache slot start + i) sees slots [0, start) and the tree slots start + a with
 * tree[i, a] (tree: [n, n] bytes; NULL = causal, slots [0, start + i]). Out [n, nh * D] bf16.
 * Scores, softmax and the weighted sum in float32, every key's terms added in the order of the slots the row
 * sees (the softmax sum in lanes of those positions, seen_sum16), so a row's result depends only on the keys it
 * sees, not on where the other rows' keys are. scratch holds
 * ATT_SCRATCH (start + n) floats per thread. */
static void attention_rows(const bf16 *q, const bf16 *kc, const bf16 *vc, int n, int nh, int nkv, int d, int cap,
                           int start, const uint8_t *tree, float scale, float *scratch, const float *scores,
                           bf16 *out) {
    int group = nh / nkv, tasks = n * nh, end = start + n;
    float *sc = scratch + (size_t)omp_get_thread_num() * ATT_SCRATCH * end; /* see ATT_SCRATCH */
#if LEAN_AVX512BF16
    if (d == 64 && !scores) { /* tasks: a row and up to 3 heads of one kv head; below: other widths, AMX */
        int hg = group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1, nt = omp_get_num_threads();
        if (HEADS_MIN_TASKS * nt > n * nh / hg) hg = 1; /* too few tasks to share between the threads */
        int chunks = nh / hg;
        float *pp = sc;
        bf16 *pb = (bf16 *)(sc + 3 * end);
        int *tidx = (int *)(sc + 5 * end);
#pragma omp for schedule(static)
        for (int t = 0; t < n * chunks; ++t) { /* a kv head's tasks together: a thread reads fewer kv heads */
            int i = t % n, hd0 = (t / n) * hg;
            const bf16 *kh = kc + (size_t)(hd0 / group) * cap * 64, *vh = vc + (size_t)(hd0 / group) * cap * 64;
            if (hg == 3)
                attend_heads_d64(q, kh, vh, i, hd0, 3, nh, n, start, end, tree, scale, pp, pb, tidx, out);
            else if (hg == 2)
                attend_heads_d64(q, kh, vh, i, hd0, 2, nh, n, start, end, tree, scale, pp, pb, tidx, out);
            else
                attend_heads_d64(q, kh, vh, i, hd0, 1, nh, n, start, end, tree, scale, pp, pb, tidx, out);
        }
        return;
    }
#endif
#if LEAN_AVX512BF16
    int *seen_idx = (int *)(sc + end);
#endif
    float acc[256];
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        int i = t / nh, hd = t % nh;
        const bf16 *qi = q + ((size_t)i * nh + hd) * d;
        const bf16 *kh = kc + (size_t)(hd / group) * cap * d, *vh = vc + (size_t)(hd / group) * cap * d;
        const float *given = scores ? scores + (size_t)t * end : NULL; /* q . k from the tile unit */
        float mx = -INFINITY;
        int j = 0;
#if LEAN_AVX512BF16
        if (given) { /* the cached prefix is seen by every row: 16 scores at a time */
            __m512 vmx = _mm512_set1_ps(-INFINITY), vs = _mm512_set1_ps(scale);
            for (; j + 16 <= start; j += 16) {
                __m512 v = _mm512_mul_ps(_mm512_loadu_ps(given + j), vs);
                _mm512_storeu_ps(sc + j, v);
                vmx = _mm512_max_ps(vmx, v);
            }
            mx = _mm512_reduce_max_ps(vmx);
        }
#endif
        for (; j < end; ++j) {
            int seen = j < start || (tree ? tree[(size_t)i * n + (j - start)] : j - start <= i);
            sc[j] = seen ? (given ? given[j] : dot_bf16(qi, kh + (size_t)j * d, d)) * scale : -INFINITY;
            if (sc[j] > mx) mx = sc[j];
        }
        for (j = 0; j < end; ++j) sc[j] -= mx;  /* -inf stays -inf */
        exp_inplace(sc, end);
        float sum = 0.f;
        int summed = 0;
        for (int k = 0; k < d; ++k) acc[k] = 0.f;
#if LEAN_AVX512BF16
        if (d == 64) {
            /* the weighted sum in registers, two sets taking the seen keys in turn (the k-th seen key goes to
             * set k % 2, whatever its slot, so a tree row and its one-row step add the same terms in the same
             * order), then set 0 + set 1 */
            int cnt = 0;
            const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (j = 0; j < end; j += 16) { /* the seen slots' indices in order, 16 at a time */
                int len = end - j < 16 ? end - j : 16;
                __mmask16 m = (__mmask16)(len == 16 ? 0xffffu : (1u << len) - 1);
                __mmask16 nz = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, sc + j), _mm512_setzero_ps(), _CMP_NEQ_UQ) & m;
                __m512i idx = _mm512_maskz_compress_epi32(nz, _mm512_add_epi32(_mm512_set1_epi32(j), iota));
                int got = __builtin_popcount((unsigned)nz);
                _mm512_mask_storeu_epi32(seen_idx + cnt, (__mmask16)((1u << got) - 1), idx);
                cnt += got;
            }
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            float s0 = 0.f, s1 = 0.f;
            int k = 0;
            for (; k + 2 <= cnt; k += 2) {
                const bf16 *v0 = vh + (size_t)seen_idx[k] * d, *v1 = vh + (size_t)seen_idx[k + 1] * d;
                float p0 = sc[seen_idx[k]], p1 = sc[seen_idx[k + 1]];
                __m512 q0 = _mm512_set1_ps(p0), q1 = _mm512_set1_ps(p1);
                s0 += p0;
                s1 += p1;
                a0 = _mm512_fmadd_ps(q0, load16_bf16(v0), a0);
                b0 = _mm512_fmadd_ps(q1, load16_bf16(v1), b0);
                a1 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 16), a1);
                b1 = _mm512_fmadd_ps(q1, load16_bf16(v1 + 16), b1);
                a2 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 32), a2);
                b2 = _mm512_fmadd_ps(q1, load16_bf16(v1 + 32), b2);
                a3 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 48), a3);
                b3 = _mm512_fmadd_ps(q1, load16_bf16(v1 + 48), b3);
            }
            if (k < cnt) { /* an odd last key: set 0's turn */
                const bf16 *v0 = vh + (size_t)seen_idx[k] * d;
                float p0 = sc[seen_idx[k]];
                __m512 q0 = _mm512_set1_ps(p0);
                s0 += p0;
                a0 = _mm512_fmadd_ps(q0, load16_bf16(v0), a0);
                a1 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 16), a1);
                a2 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 32), a2);
                a3 = _mm512_fmadd_ps(q0, load16_bf16(v0 + 48), a3);
            }
            sum = s0 + s1;
            _mm512_storeu_ps(acc, _mm512_add_ps(a0, b0));
            _mm512_storeu_ps(acc + 16, _mm512_add_ps(a1, b1));
            _mm512_storeu_ps(acc + 32, _mm512_add_ps(a2, b2));
            _mm512_storeu_ps(acc + 48, _mm512_add_ps(a3, b3));
            summed = 1;
        }
#endif
        for (j = 0; j < end && !summed; ++j) {
            float p = sc[j];
            if (p == 0.f) continue;
            sum += p;
            const bf16 *vj = vh + (size_t)j * d;
#if LEAN_AVX512BF16
            if (d % 16 == 0) {
                __m512 pv = _mm512_set1_ps(p);
                for (int k = 0; k < d; k += 16)
                    _mm512_storeu_ps(acc + k, _mm512_fmadd_ps(pv, load16_bf16(vj + k), _mm512_loadu_ps(acc + k)));
                continue;
            }
#endif
            for (int k = 0; k < d; ++k) acc[k] = fmaf(p, bf2f(vj[k]), acc[k]);
        }
        bf16 *oi = out + (size_t)i * nh * d + (size_t)hd * d;
        for (int k = 0; k < d; ++k) oi[k] = f2bf(acc[k] / sum);
    }
}

#if LEAN_AMX_BUILD
/* q . k for every query (row i, head hd) and key slot j < start + n, on the tile unit: scores[i * nh + hd][j].
 * Per kv head and block of 16 of its queries (the group's heads, row after row): C [16 keys x 16 queries] =
 * sum over the head dim in blocks of 32 of A (16 keys straight from the cache) times B (the queries' dims
 * in pairs). Each score depends on its query and key alone, so a tree row's scores are its one-row step's.
 * Needs d a multiple of 32 (the caller checks). */
AMX_FN static void attention_scores_amx(const bf16 *q, const bf16 *kc, int n, int nh, int nkv, int d, int cap,
                                        int start, float *scores) {
    int group = nh / nkv, end = start + n, kb_n = d / 32, nq = n * group, qblocks = (nq + 15) / 16;
    int kblocks = (end + 15) / 16;
#pragma omp for schedule(static)
    for (int t = 0; t < nkv * qblocks; ++t) {
        int g = t / qblocks, q0 = (t % qblocks) * 16;
        bf16 b[8][512]; /* [kb][16 dim pairs][16 queries][2] */
        int qidx[16];   /* row * nh + head of each query in the block, -1 past the last */
        for (int c = 0; c < 16; ++c) {
            int qq = q0 + c;
            qidx[c] = qq < nq ? (qq / group) * nh + g * group + qq % group : -1;
        }
        for (int kb = 0; kb < kb_n; ++kb)
            for (int kk = 0; kk < 16; ++kk)
                for (int c = 0; c < 16; ++c)
                    for (int p = 0; p < 2; ++p)
                        b[kb][(kk * 16 + c) * 2 + p] = qidx[c] < 0 ? 0 : q[(size_t)qidx[c] * d + kb * 32 + 2 * kk + p];
        const bf16 *kh = kc + (size_t)g * cap * d;
        bf16 tail[16 * 256]; /* the last key block, zero padded, when 16 slots would run past the cache */
        float c[256];
        for (int jb = 0; jb < kblocks; ++jb) {
            int j0 = jb * 16, keys = end - j0 < 16 ? end - j0 : 16;
            const bf16 *a = kh + (size_t)j0 * d;
            if (j0 + 16 > cap) {
                memset(tail, 0, sizeof tail);
                memcpy(tail, a, (size_t)keys * d * sizeof(bf16));
                a = tail;
            }
            _tile_zero(0);
            for (int kb = 0; kb < kb_n; ++kb) {
                _tile_loadd(4, a + kb * 32, 2 * d);
                _tile_loadd(5, b[kb], 64);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, c, 64);
            for (int cq = 0; cq < 16 && qidx[cq] >= 0; ++cq)
                for (int kk = 0; kk < keys; ++kk) scores[(size_t)qidx[cq] * end + j0 + kk] = c[kk * 16 + cq];
        }
    }
}
#endif

/* ------------------------------------------------------------------ the forward */

/* One layer's weights, as addresses (bf16 unless noted). A linear layer whose Q4_1 address (qkv_q4, ...) is set
 * reads those GGUF blocks, repacked by lean_pack_q4_1 (linear_qx8_rows), and not its bf16 weight, which may then
 * be NULL. */
typedef struct {
    const bf16 *ln1, *qkv, *o, *ln2, *gate_up, *down;
    const void *qkv_q4, *o_q4, *gate_up_q4, *down_q4;
} LeanLayer;

void lean_argmax_rows(const void *x, int rows, int len, int bf16_in, int64_t *out);

/* one linear layer on the path chosen for the call (w: packed when amx). padded: x holds n rows rounded up
 * to 16 and is read in place by the tile path (the forward's activations); else the tile path copies the n
 * rows into xv first (the heads' few rows) */
static inline void linear_any(int amx, const bf16 *w, const bf16 *x, int n, int out, int in, void *y, const bf16 *r,
                              int kind, bf16 *xv, int padded) {
#if LEAN_AMX_BUILD
    if (amx) {
        linear_rows_amx(w, x, n, out, in, y, r, kind, xv, padded);
        return;
    }
#else
    (void)amx; (void)xv; (void)padded;
#endif
    linear_rows(w, x, n, out, in, y, r, kind);
}

/* a layer's linear layer: its Q4_1 blocks where it has them (q8: their activation scratch), else linear_any */
static inline void layer_linear(int amx, const bf16 *w, const void *q4, const bf16 *x, int n, int out, int in,
                                void *y, const bf16 *r, int kind, bf16 *xv, void *q8) {
    if (q4)
        linear_qx8_rows(q4, 1, x, n, out, in, y, r, kind, q8);
    else
        linear_any(amx, w, x, n, out, in, y, r, kind, xv, 1);
}

static inline int widest_input(int hsz, int nh, int d, int inter) {
    int w = hsz > inter ? hsz : inter;
    return w > nh * d ? w : nh * d;
}

/* bf16 elements of lean_forward's work for n rows (the layout layers_in_team carves out of it): h, qkv, q, att,
 * gate_up, act, each for n rows (rounded up to 16 on the tile path), then the Q4_1 layers' activation blocks */
static size_t forward_q8_elems(int n, int hsz, int nh, int d, int inter) {
    return (lean_q8_scratch_bytes(n, pad_to(widest_input(hsz, nh, d, inter), 32)) + 1) / 2;
}

size_t lean_forward_work_size(int n, int hsz, int nh, int nkv, int d, int inter, int amx) {
    size_t rows = amx ? (size_t)(n + 15) / 16 * 16 : (size_t)n;
    return rows * (size_t)(hsz + (nh + 2 * nkv) * d + 2 * nh * d + 3 * inter) + forward_q8_elems(n, hsz, nh, d, inter);
}

/* One sequence of a forward: its n rows (queries at cache slots start..start+n-1), its cache ([layers, kv heads,
 * cap, D] keys and values) and its tree mask ([n, n] bytes; NULL: causal rows). */
typedef struct {
    int n, start, cap;
    bf16 *kcache, *vcache;
    const uint8_t *tree;
} LeanSeq;

/* The layers and the final norm, inside the caller's parallel region: x [n, H] (embedded input, overwritten
 * with the last layer's residual stream; the sequences' rows one after another, n in all) -> hidden [n, H].
 * The linear layers, norms and activations take all n rows at once (each row's result is the same whatever rows
 * share the call); RoPE, the cache writes and attention go sequence by sequence, each in its own cache, so a row's
 * result is the one its sequence alone would give. See lean_forward for the buffers. */
static void layers_in_team(const LeanLayer *layers, int num_layers, int hsz, int nh, int nkv, int d, int inter,
                           float eps, const bf16 *norm_w, bf16 *x, int n, const int64_t *pos, const LeanSeq *seqs,
                           int nseq, const bf16 *cos_t, const bf16 *sin_t, bf16 *work, float *scratch, bf16 *hidden,
                           int nthreads, int amx, bf16 *xv) {
    int qkv_w = (nh + 2 * nkv) * d, rows = amx ? (n + 15) / 16 * 16 : n; /* the tile path reads 16-row blocks */
    bf16 *h = work, *qkv = h + (size_t)rows * hsz, *q = qkv + (size_t)rows * qkv_w, *att = q + (size_t)rows * nh * d,
         *gu = att + (size_t)rows * nh * d, *act = gu + (size_t)rows * 2 * inter;
    void *q8 = act + (size_t)rows * inter; /* float-aligned: every width above is even */
    float scale = 1.0f / sqrtf((float)d);
    for (int l = 0; l < num_layers; ++l) {
        const LeanLayer *w = layers + l;
        rmsnorm_rows(x, w->ln1, n, hsz, eps, h);
        layer_linear(amx, w->qkv, w->qkv_q4, h, n, qkv_w, hsz, qkv, NULL, OUT_BF16, xv, q8);
        for (int s = 0, at = 0; s < nseq; at += seqs[s++].n) {
            const LeanSeq *sq = seqs + s;
            size_t layer_kv = (size_t)nkv * sq->cap * d;
            bf16 *kc = sq->kcache + l * layer_kv, *vc = sq->vcache + l * layer_kv, *qs = q + (size_t)at * nh * d;
            int end = sq->start + sq->n;
            rope_rows(qkv + (size_t)at * qkv_w, sq->n, nh, nkv, d, pos + at, cos_t, sin_t, qs, kc, vc, sq->cap,
                      sq->start);
            /* the tile path also takes q . k from the tile unit: [n * nh][start + n] floats after the softmax rows */
            float *scores = amx && d % 32 == 0 ? scratch + (size_t)ATT_SCRATCH * nthreads * end : NULL;
#if LEAN_AMX_BUILD
            if (scores) attention_scores_amx(qs, kc, sq->n, nh, nkv, d, sq->cap, sq->start, scores);
#endif
            attention_rows(qs, kc, vc, sq->n, nh, nkv, d, sq->cap, sq->start, sq->tree, scale, scratch, scores,
                           att + (size_t)at * nh * d);
        }
        layer_linear(amx, w->o, w->o_q4, att, n, hsz, nh * d, x, x, OUT_BF16_RESIDUAL, xv, q8);
        rmsnorm_rows(x, w->ln2, n, hsz, eps, h);
        layer_linear(amx, w->gate_up, w->gate_up_q4, h, n, 2 * inter, hsz, gu, NULL, OUT_BF16, xv, q8);
        silu_mul_rows(gu, n, inter, act);
        layer_linear(amx, w->down, w->down_q4, act, n, hsz, inter, x, x, OUT_BF16_RESIDUAL, xv, q8);
    }
    rmsnorm_rows(x, norm_w, n, hsz, eps, hidden);
}

/* The layers on the sequences' rows in one parallel region (see layers_in_team). */
static int forward_seqs(const LeanLayer *layers, int num_layers, int hsz, int nh, int nkv, int d, int inter, float eps,
                        const bf16 *norm_w, bf16 *x, int n, const int64_t *pos, const LeanSeq *seqs, int nseq,
                        const bf16 *cos_t, const bf16 *sin_t, bf16 *work, float *scratch, bf16 *hidden, int nthreads,
                        int amx, bf16 *xv) {
    if (d > 256) return -1;
    if (amx && !lean_amx_available()) return -2; /* no tile unit, or the kernel refused its state */
#pragma omp parallel num_threads(nthreads)
    {
#if LEAN_AMX_BUILD
        if (amx) amx_configure();
#endif
        layers_in_team(layers, num_layers, hsz, nh, nkv, d, inter, eps, norm_w, x, n, pos, seqs, nseq, cos_t, sin_t,
                       work, scratch, hidden, nthreads, amx, xv);
#if LEAN_AMX_BUILD
        if (amx) amx_release();
#endif
    }
    return 0;
}

/* x [n, H] (embedded input, overwritten with the last layer's residual stream) -> hidden [n, H], the
 * final RMSNorm applied. work: bf16, lean_forward_work_size(n, ...) elements; scratch: float32, lean_scratch_size(nthreads, n, nh,
 * start + n, amx). amx: the layers' weights are packed (lean_pack_amx) and the linear layers (and q . k) run on
 * the tile unit (xv: lean_amx_scratch_size(n, max(H, I, nh D)) bf16, used where a width is not a multiple of
 * 32; otherwise the activations are read in place).
 * Returns 0, or -1 if a head_dim is over 256. */
int lean_forward(const LeanLayer *layers, int num_layers, int hsz, int nh, int nkv, int d, int inter, float eps,
                 const bf16 *norm_w, bf16 *x, int n, const int64_t *pos, int start, bf16 *kcache, bf16 *vcache,
                 int cap, const uint8_t *tree, const bf16 *cos_t, const bf16 *sin_t, bf16 *work, float *scratch,
                 bf16 *hidden, int nthreads, int amx, bf16 *xv) {
    LeanSeq seq = {n, start, cap, kcache, vcache, tree};
    return forward_seqs(layers, num_layers, hsz, nh, nkv, d, inter, eps, norm_w, x, n, pos, &seq, 1, cos_t, sin_t,
                        work, scratch, hidden, nthreads, amx, xv);
}

/* A decode step as one call: what lean_forward does for the tree's (or the plain step's) n tokens, with the
 * embedding before it and the logits and each row's argmax after it, in one parallel region (no Python, no
 * thread hand-over between the pieces). The constant part of the call (weights, shapes, cache, buffers) is
 * a LeanModel the engine fills once per cache; see lean_decode_work_size for its buffers. */
typedef struct {
    const LeanLayer *layers;
    int num_layers, hsz, nh, nkv, d, inter, vocab;
    float eps;
    const bf16 *norm_w, *embed, *lm_head; /* lm_head packed like the layers (lean_pack_rows4 or lean_pack_amx) */
    const bf16 *cos_t, *sin_t;             /* RoPE tables [rope_len, D] (sign of the rotation in sin) */
    int rope_len, cap, nthreads, amx;
    bf16 *kcache, *vcache;                 /* [layers, kv heads, cap, D] each */
    bf16 *work, *xv;                       /* lean_decode_work_size(n) bf16; the tile path's copies (amx) */
    float *scratch;                        /* lean_scratch_size(nthreads, n, nh, cap, amx) float32 */
    /* the greedy steps' int8 screen of lm_head (see screen_argmax_in_team; NULL: none): q
     * [ceil(vocab/64)][ceil(hsz/2)][64][2], per vocabulary row s_v, e_v, c_v and max |w_v| */
    const int8_t *screen_q;
    const float *screen_scale, *screen_err, *screen_csum, *screen_maxw;
    const void *lm_head_q8; /* the logits projection as Q8_0 blocks packed by lean_pack_q8_0 (NULL: lm_head); set
                             * with Q4_1 layers */
} LeanModel;

/* bf16 elements of lean_decode's work for n rows: the embedded rows, then lean_forward's work, then the screen's
 * rows in int16 pairs (at an offset of a multiple of 8) */
static size_t decode_screen_at(int n, int hsz, int nh, int nkv, int d, int inter, int amx) {
    size_t rows = amx ? (size_t)(n + 15) / 16 * 16 : (size_t)n;
    return (rows * (size_t)hsz + lean_forward_work_size(n, hsz, nh, nkv, d, inter, amx) + 7) / 8 * 8;
}

size_t lean_decode_work_size(int n, int hsz, int nh, int nkv, int d, int inter, int amx) {
    return decode_screen_at(n, hsz, nh, nkv, d, inter, amx) + 2 * (size_t)n * hsz;
}

/* ------------------------------------------------------------------ greedy logits: an int8 screen, exact candidates
 *
 * A greedy step needs each row's argmax of the logits, not the logits: the lm_head (49,152 x 576 for the default
 * model, 57 MB in bf16, a fifth of a step's bytes) is read for it in an int8 copy instead, half the bytes, and only
 * the rows that can still be the argmax are computed in bf16, exactly as the full projection computes them. Per
 * vocabulary row v a scale s_v = max|w_v| / 127, q_v = round(w_v / s_v) (int8, [ceil(V/64)][ceil(in/2)][64][2]:
 * per pair of inputs the 64 rows of a block side by side), e_v >= ||w_v - s_v q_v||_2 (the residual's norm) and
 * c_v >= s_v |q_v|_1, both rounded up from float64. An activation row x (bf16, finite) is taken in int16,
 * t = max|x| / 16383, x16 = round(x / t) (so |x - t x16| <= 0.51 t), and
 *     a_v = t s_v sum_k x16_k q_vk   (the sum exact in int32: |sum| <= 576 16384 127 < 2^31; then two roundings)
 *     x . w_v = t s_v sum_k x16_k q_vk + s_v sum_k (x_k - t x16_k) q_vk + x . (w_v - s_v q_v)
 * so, with Cauchy-Schwarz on the last term and the float32 error of the bf16 projection's own sum (m terms:
 * <= m 2^-24 sum |terms|, taken twice over, |terms| <= |x|_1 max|w_v|),
 *     |exact_v - a_v| <= b_v = (||x||_2 e_v + 0.51 t c_v + 2 in 2^-23 |x|_1 max|w_v|)(1 + 2^-10) + 2^-20 |a_v|
 *                             + 1e-30 (1 + max|w_v|)
 * exact_v being the float32 the bf16 projection gives (the last term covers its flushed denormals, the one
 * before a_v's roundings). With L = max_v (a_v - b_v), a row v with a_v + b_v < L has exact_v < L <= exact_u for
 * the u that sets L: neither the argmax nor tied with it. The remaining candidates (a few: 3 median, 57 at most
 * over 512 positions of the default model's greedy answers to 8 MT-Bench questions, where the estimates' error
 * reached 0.21 of its bound) are computed as the full projection does (dot4xr_bf16
 * on the packed bf16 block, the same bits whatever the rows beside it) and the first of the largest taken: the
 * argmax lean_argmax_rows would take of the full logits, bit for bit the same choice. Rows with a non-finite
 * value, a non-finite bound or candidate, more rows than SCREEN_MAX_ROWS or threads than SCREEN_MAX_THREADS take
 * the full projection. */

/* rows a call takes through the screen at most. Its int8 pass streams half the bytes, but its int16 dot products
 * cost a fixed time per row, where the full projection's rows up to 8 hide under its stream: up to about 4 rows
 * the screen costs what one row does, and past 5 rows the full projection is cheaper (in one pass of 8 rows the
 * screen's sums run out of vector registers; docs/reports/logit-screen.md). */
#define SCREEN_MAX_ROWS 5
#define SCREEN_MAX_THREADS 64
#define SCREEN_BLOCK 64 /* vocabulary rows per int8 block */
#ifndef SCREEN_PREFETCH
#define SCREEN_PREFETCH 8192 /* bytes ahead the int8 screen prefetches into L1, as the bf16 weights (ROWS4_PREFETCH) */
#endif
#define SCREEN_X_MAX 16383 /* |x16| (see above) */

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define SCREEN_VNNI 1
/* a[r][v] = t_r s_v sum_k x16[r][k] q_vk for the 64 rows v of block qb (from v0), R rows (a constant per call) of
 * x16 in pairs (xp: in2 int32 per row, two int16 each): each pair of inputs' 64 x 2 weights widened to int16 once
 * for the R rows, one dot-product step of pairs per 16 rows; one row keeps two sets of accumulators over alternate
 * pairs (8 chains), more rows one set each; integer sums, exact in any order */
static inline __attribute__((always_inline)) void screen_block_rows(const int8_t *qb, const float *scale,
                                                                   const int32_t *xp, const float *t, const int R,
                                                                   int in2, int vocab, int v0, float *a) {
    const int sets = R == 1 ? 2 : 1;
    __m512i acc[SCREEN_MAX_ROWS][2][4];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < sets; ++u)
            for (int c = 0; c < 4; ++c) acc[r][u][c] = _mm512_setzero_si512();
    for (int kp = 0; kp < in2; ++kp) {
        const int8_t *qk = qb + (size_t)kp * 2 * SCREEN_BLOCK;
        const int u = sets == 2 ? kp & 1 : 0;
        _mm_prefetch((const char *)qk + SCREEN_PREFETCH, _MM_HINT_T0); /* two 64-byte lines per pair of inputs */
        _mm_prefetch((const char *)qk + SCREEN_PREFETCH + 64, _MM_HINT_T0);
        __m512i w[4];
        for (int c = 0; c < 4; ++c) w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qk + 32 * c)));
        for (int r = 0; r < R; ++r) {
            __m512i xb = _mm512_set1_epi32(xp[(size_t)r * in2 + kp]);
            for (int c = 0; c < 4; ++c) acc[r][u][c] = _mm512_dpwssd_epi32(acc[r][u][c], xb, w[c]);
        }
    }
    for (int c = 0; c < 4; ++c) {
        int v = v0 + 16 * c;
        if (v >= vocab) break;
        __mmask16 m = (__mmask16)(vocab - v >= 16 ? 0xffffu : (1u << (vocab - v)) - 1);
        __m512 sv = _mm512_maskz_loadu_ps(m, scale + v);
        for (int r = 0; r < R; ++r) {
            __m512i sum = sets == 2 ? _mm512_add_epi32(acc[r][0][c], acc[r][1][c]) : acc[r][0][c];
            _mm512_mask_storeu_ps(a + (size_t)r * vocab + v, m,
                                  _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sv, _mm512_set1_ps(t[r]))));
        }
    }
}
#else
#define SCREEN_VNNI 0
#endif

/* a[r][v] = t_r s_v sum_k x16[r][k] q_vk for the rows v of blocks [b0, b1), R <= SCREEN_MAX_ROWS rows */
static void screen_blocks(const int8_t *q, const float *scale, const int32_t *xp, const float *t, int R, int in2,
                          int vocab, int b0, int b1, float *a) {
    for (int b = b0; b < b1; ++b) {
        const int8_t *qb = q + (size_t)b * in2 * 2 * SCREEN_BLOCK;
        int v0 = b * SCREEN_BLOCK;
#if SCREEN_VNNI
        switch (R) { /* a constant R per call: the accumulators stay in registers */
            case 1: screen_block_rows(qb, scale, xp, t, 1, in2, vocab, v0, a); break;
            case 2: screen_block_rows(qb, scale, xp, t, 2, in2, vocab, v0, a); break;
            case 3: screen_block_rows(qb, scale, xp, t, 3, in2, vocab, v0, a); break;
            case 4: screen_block_rows(qb, scale, xp, t, 4, in2, vocab, v0, a); break;
            default: screen_block_rows(qb, scale, xp, t, 5, in2, vocab, v0, a); break;
        }
#else
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < SCREEN_BLOCK && v0 + c < vocab; ++c) {
                int32_t sum = 0;
                for (int kp = 0; kp < in2; ++kp) {
                    int32_t pair = xp[(size_t)r * in2 + kp];
                    sum += (int32_t)(int16_t)(pair & 0xffff) * qb[((size_t)kp * SCREEN_BLOCK + c) * 2]
                         + (int32_t)(int16_t)((uint32_t)pair >> 16) * qb[((size_t)kp * SCREEN_BLOCK + c) * 2 + 1];
                }
                a[(size_t)r * vocab + v0 + c] = (float)sum * (scale[v0 + c] * t[r]);
            }
#endif
    }
}

/* the exact float32 logits of the 4 vocabulary rows of packed block wb (lean_pack_rows4) for one bf16 row x, as
 * linear_rows computes them */
static void exact_block(const bf16 *wb, int in, const bf16 *x, float out[4]) {
#if LEAN_AVX512BF16
    float d[4][4];
    dot4xr_bf16(wb, in, x, 1, 0, d);
    for (int c = 0; c < 4; ++c) out[c] = d[0][c];
#else
    for (int c = 0; c < 4; ++c) out[c] = dot_packed_scalar(wb, in, x, c);
#endif
}

/* b_v of the screen (see above) from a_v, e_v, c_v, max|w_v| and the row's ||x||_2, 0.51 t and 2 in 2^-23 |x|_1
 * (rounded up) */
static inline float screen_bound(float av, float e, float cv, float mw, float xn2, float hx, float g) {
    return (xn2 * e + hx * cv + g * mw) * (1.0f + 0x1p-10f) + 0x1p-20f * fabsf(av) + 1e-30f * (1.0f + mw);
}

#if LEAN_AVX512BF16
static inline __m512 screen_bound16(__m512 av, __m512 e, __m512 cv, __m512 mw, __m512 xn2, __m512 hx, __m512 g) {
    __m512 r = _mm512_mul_ps(_mm512_fmadd_ps(xn2, e, _mm512_fmadd_ps(hx, cv, _mm512_mul_ps(g, mw))),
                             _mm512_set1_ps(1.0f + 0x1p-10f));
    r = _mm512_fmadd_ps(_mm512_set1_ps(0x1p-20f), _mm512_abs_ps(av), r);
    return _mm512_fmadd_ps(_mm512_set1_ps(1e-30f), _mm512_add_ps(mw, _mm512_set1_ps(1.0f)), r);
}
#endif

typedef struct {
    float lmax, best; /* a thread's max of a - b over its rows v; its largest exact candidate */
    int at, bad;      /* that candidate's index (-1: none); a non-finite value seen */
} ScreenPart;

typedef struct {
    float xn2, hx, g, t; /* a row's ||x||_2, 0.51 t and 2 in 2^-23 |x|_1 (rounded up), and t (see above) */
    int ok;              /* every value finite */
} ScreenRow;

/* Inside the caller's parallel region, every thread: each row's argmax of hidden [n, hsz] lm_head^T through the
 * screen, into pred. Returns 1 when done, 0 (every thread alike) when the full projection must run instead.
 * a: [n, vocab] floats (the logits buffer, left holding the a_v); xp: n ceil(hsz/2) int32 (x16 in pairs); rows and
 * part ([SCREEN_MAX_THREADS][SCREEN_MAX_ROWS]) shared by the team. The vocabulary's blocks of 64 are split in
 * equal runs between the threads; each pass reads its own run. */
static int screen_argmax_in_team(const LeanModel *m, const bf16 *hidden, int n, float *a, int32_t *xp,
                                 ScreenRow *rows, ScreenPart (*part)[SCREEN_MAX_ROWS], int64_t *pred) {
    int nt = omp_get_num_threads(), t = omp_get_thread_num(), in = m->hsz, in2 = (m->hsz + 1) / 2, V = m->vocab;
    if (!m->screen_q || m->amx || n > SCREEN_MAX_ROWS || nt > SCREEN_MAX_THREADS) return 0;
    int blocks = pad_to(V, SCREEN_BLOCK) / SCREEN_BLOCK;
    int b0 = (int)((long)blocks * t / nt), b1 = (int)((long)blocks * (t + 1) / nt);
    int v0 = b0 * SCREEN_BLOCK, v1 = b1 * SCREEN_BLOCK < V ? b1 * SCREEN_BLOCK : V;
#pragma omp for schedule(static)
    for (int r = 0; r < n; ++r) { /* each row in int16 pairs, its norms */
        const bf16 *xr = hidden + (size_t)r * in;
        double l1 = 0.0, l2 = 0.0;
        float mx = 0.f;
        int finite = 1;
        for (int k = 0; k < in; ++k) {
            float v = bf2f(xr[k]);
            finite &= isfinite(v) != 0;
            mx = fmaxf(mx, fabsf(v));
            l1 += fabs((double)v);
            l2 += (double)v * v;
        }
        float scale = mx / (float)SCREEN_X_MAX;
        for (int kp = 0; kp < in2; ++kp) {
            int32_t lo = 0, hi = 0;
            if (finite && scale > 0.f) {
                lo = (int32_t)nearbyintf(bf2f(xr[2 * kp]) / scale);
                hi = 2 * kp + 1 < in ? (int32_t)nearbyintf(bf2f(xr[2 * kp + 1]) / scale) : 0;
            }
            xp[(size_t)r * in2 + kp] = (int32_t)(((uint32_t)hi << 16) | ((uint32_t)lo & 0xffffu));
        }
        rows[r].xn2 = (float)(sqrt(l2) * (1.0 + 1e-6));
        rows[r].hx = (float)(0.51 * (double)scale * (1.0 + 1e-6));
        rows[r].g = (float)(2.0 * in * 0x1p-23 * l1 * (1.0 + 1e-6));
        rows[r].t = scale;
        rows[r].ok = finite && isfinite(rows[r].xn2) && isfinite(rows[r].g);
    }
    float tr[SCREEN_MAX_ROWS] = {0};
    for (int r = 0; r < n; ++r) {
        if (!rows[r].ok) return 0;
        tr[r] = rows[r].t;
    }
    screen_blocks(m->screen_q, m->screen_scale, xp, tr, n, in2, V, b0, b1, a);
    for (int r = 0; r < n; ++r) { /* L's part: max (a - b) over this thread's run */
        const float *ar = a + (size_t)r * V;
        float xn2 = rows[r].xn2, hx = rows[r].hx, g = rows[r].g, lmax = -INFINITY;
        int bad = 0, v = v0;
#if LEAN_AVX512BF16
        __m512 vl = _mm512_set1_ps(-INFINITY), vx = _mm512_set1_ps(xn2), vh = _mm512_set1_ps(hx),
               vg = _mm512_set1_ps(g);
        __mmask16 odd = 0;
        for (; v + 16 <= v1; v += 16) {
            __m512 av = _mm512_loadu_ps(ar + v);
            __m512 lo = _mm512_sub_ps(av, screen_bound16(av, _mm512_loadu_ps(m->screen_err + v),
                                                         _mm512_loadu_ps(m->screen_csum + v),
                                                         _mm512_loadu_ps(m->screen_maxw + v), vx, vh, vg));
            odd |= _mm512_cmp_ps_mask(_mm512_mul_ps(lo, _mm512_setzero_ps()), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            vl = _mm512_max_ps(vl, lo);
        }
        lmax = _mm512_reduce_max_ps(vl);
        bad = odd != 0;
#endif
        for (; v < v1; ++v) {
            float lo = ar[v] - screen_bound(ar[v], m->screen_err[v], m->screen_csum[v], m->screen_maxw[v], xn2, hx, g);
            bad |= !isfinite(lo);
            lmax = fmaxf(lmax, lo);
        }
        part[t][r].lmax = lmax;
        part[t][r].bad = bad;
    }
#pragma omp barrier
    float L[SCREEN_MAX_ROWS];
    for (int r = 0; r < n; ++r) {
        L[r] = -INFINITY;
        for (int u = 0; u < nt; ++u) {
            if (part[u][r].bad) return 0;
            L[r] = fmaxf(L[r], part[u][r].lmax);
        }
    }
#pragma omp barrier /* every thread has read lmax and bad before any writes its candidates' part */
    for (int r = 0; r < n; ++r) { /* the candidates of this thread's run, exactly */
        const float *ar = a + (size_t)r * V;
        const bf16 *xr = hidden + (size_t)r * in;
        float xn2 = rows[r].xn2, hx = rows[r].hx, g = rows[r].g, best = -INFINITY, ex[4];
        int at = -1, bad = 0, done_block = -1, kb_n = pad_to(in, 32) / 32;
        for (int v = v0; v < v1; ++v) {
#if LEAN_AVX512BF16
            if ((v - v0) % 16 == 0 && v + 16 <= v1) { /* skip runs of 16 without a candidate */
                __m512 av = _mm512_loadu_ps(ar + v);
                __m512 hi = _mm512_add_ps(av, screen_bound16(av, _mm512_loadu_ps(m->screen_err + v),
                                                             _mm512_loadu_ps(m->screen_csum + v),
                                                             _mm512_loadu_ps(m->screen_maxw + v), _mm512_set1_ps(xn2),
                                                             _mm512_set1_ps(hx), _mm512_set1_ps(g)));
                if (!_mm512_cmp_ps_mask(hi, _mm512_set1_ps(L[r]), _CMP_GE_OQ)) {
                    v += 15;
                    continue;
                }
            }
#endif
            if (ar[v] + screen_bound(ar[v], m->screen_err[v], m->screen_csum[v], m->screen_maxw[v], xn2, hx, g) < L[r])
                continue;
            if (v / 4 != done_block) {
                done_block = v / 4;
                exact_block(m->lm_head + (size_t)done_block * kb_n * 128, in, xr, ex);
            }
            float e = ex[v % 4];
            bad |= !isfinite(e);
            if (e > best || at < 0) best = e, at = v;
        }
        part[t][r].best = best;
        part[t][r].at = at;
        part[t][r].bad = bad;
    }
#pragma omp barrier
    int ok = 1;
    for (int r = 0; r < n; ++r) { /* the first of the largest: runs in vocabulary order, a later one wins if larger */
        float best = -INFINITY;
        int at = -1;
        for (int u = 0; u < nt; ++u) {
            ok &= !part[u][r].bad;
            if (part[u][r].at >= 0 && (at < 0 || part[u][r].best > best)) best = part[u][r].best, at = part[u][r].at;
        }
        ok &= at >= 0;
        if (t == 0) pred[r] = at;
    }
    return ok;
}

/* The rows of seqs (n in all, ids and RoPE positions pos one after another, each sequence its own cache and tree
 * mask) through the embedding, the layers, then either each row's argmax through the screen (argmax_only, where
 * the model has one and the rows fit it) or the logits and, with pred, their argmax: one parallel region. The
 * model's work, xv and scratch are sized for n rows and caches of m->cap positions at most. */
static void decode_seqs(const LeanModel *m, const int64_t *ids, int n, const int64_t *pos, const LeanSeq *seqs,
                        int nseq, bf16 *hidden, float *logits, int64_t *pred, int argmax_only) {
    size_t rows = m->amx ? (size_t)(n + 15) / 16 * 16 : (size_t)n;
    bf16 *x = m->work, *work = x + rows * m->hsz;
    for (int i = 0; i < n; ++i) memcpy(x + (size_t)i * m->hsz, m->embed + (size_t)ids[i] * m->hsz, (size_t)m->hsz * sizeof(bf16));
    int32_t *xp = (int32_t *)(m->work + decode_screen_at(n, m->hsz, m->nh, m->nkv, m->d, m->inter, m->amx));
    ScreenRow rows_info[SCREEN_MAX_ROWS];
    ScreenPart part[SCREEN_MAX_THREADS][SCREEN_MAX_ROWS];
#pragma omp parallel num_threads(m->nthreads)
    {
#if LEAN_AMX_BUILD
        if (m->amx) amx_configure();
#endif
        layers_in_team(m->layers, m->num_layers, m->hsz, m->nh, m->nkv, m->d, m->inter, m->eps, m->norm_w, x, n, pos,
                       seqs, nseq, m->cos_t, m->sin_t, work, m->scratch, hidden, m->nthreads, m->amx, m->xv);
        /* the argmax alone through the screen, else the logits: hidden is read from its n rows (the tile path
         * copies them into xv first) */
        int screened = argmax_only && pred && screen_argmax_in_team(m, hidden, n, logits, xp, rows_info, part, pred);
        if (!screened && m->lm_head_q8) /* its activation blocks where the layers' were (work's tail) */
            linear_qx8_rows(m->lm_head_q8, 0, hidden, n, m->vocab, m->hsz, logits, NULL, OUT_F32,
                            work + lean_forward_work_size(n, m->hsz, m->nh, m->nkv, m->d, m->inter, m->amx) -
                                forward_q8_elems(n, m->hsz, m->nh, m->d, m->inter));
        else if (!screened)
            linear_any(m->amx, m->lm_head, hidden, n, m->vocab, m->hsz, logits, NULL, OUT_F32, m->xv, 0);
#if LEAN_AMX_BUILD
        if (m->amx) amx_release();
#endif
        if (pred && !screened) {
#pragma omp for schedule(static)
            for (int i = 0; i < n; ++i) lean_argmax_rows(logits + (size_t)i * m->vocab, 1, m->vocab, 0, pred + i);
        }
    }
}

/* ids [n] at cache slots start..start+n-1, RoPE positions start + offsets[i] (offsets NULL: start + i), tree
 * [n, n] ancestor bytes or NULL (causal rows) -> hidden [n, H] bf16, logits [n, V] float32 (unrounded), and
 * pred [n] (NULL: none), each row's argmax as lean_argmax_rows takes it. Every value is the one lean_forward
 * and the logits' lean_linear give for the same rows. argmax_only (with pred): only pred is wanted, which the
 * model's screen gives where it has one (logits then holds its int8 estimates, not the logits).
 * Returns 0; -1 head_dim over 256, -2 no tile unit, -3 a token outside the vocabulary, -4 a position outside
 * the RoPE table or a slot outside the cache. */
int lean_decode(const LeanModel *m, const int64_t *ids, int n, const int64_t *offsets, int start, const uint8_t *tree,
                bf16 *hidden, float *logits, int64_t *pred, int argmax_only) {
    if (m->d > 256) return -1;
    if (m->amx && !lean_amx_available()) return -2;
    if (start < 0 || start + n > m->cap) return -4;
    int64_t pos[n > 0 ? n : 1];
    for (int i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= m->vocab) return -3;
        pos[i] = start + (offsets ? offsets[i] : i);
        if (pos[i] < 0 || pos[i] >= m->rope_len) return -4;
    }
    LeanSeq seq = {n, start, m->cap, m->kcache, m->vcache, tree};
    decode_seqs(m, ids, n, pos, &seq, 1, hidden, logits, pred, argmax_only);
    return 0;
}

/* lean_decode for several sequences in one call (a step of batched decoding): seqs[s] takes rows at..at+n_s-1 of
 * ids, pos (absolute RoPE positions) and the outputs, the sequences' rows one after another, each sequence with
 * its own cache (m->kcache and m->vcache are not read); m->cap is the largest cache the scratch is sized for. A
 * row's hidden state, logits and argmax are bit for bit those of its sequence's own lean_decode, and through the
 * screen (argmax_only, at most SCREEN_MAX_ROWS rows in all) the same argmax. Returns lean_decode's codes, and -5
 * when the sequences' rows do not add up to n. */
int lean_decode_rows(const LeanModel *m, const int64_t *ids, int n, const int64_t *pos, const LeanSeq *seqs,
                     int nseq, bf16 *hidden, float *logits, int64_t *pred, int argmax_only) {
    if (m->d > 256) return -1;
    if (m->amx && !lean_amx_available()) return -2;
    int total = 0;
    for (int s = 0; s < nseq; ++s) {
        if (seqs[s].n < 1 || seqs[s].start < 0 || seqs[s].start + seqs[s].n > seqs[s].cap || seqs[s].cap > m->cap)
            return -4;
        total += seqs[s].n;
    }
    if (total != n) return -5;
    for (int i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= m->vocab) return -3;
        if (pos[i] < 0 || pos[i] >= m->rope_len) return -4;
    }
    decode_seqs(m, ids, n, pos, seqs, nseq, hidden, logits, pred, argmax_only);
    return 0;
}

/* ------------------------------------------------------------------ int8 projections (the heads' draft vocabulary)
 *
 * The heads' projection onto their draft vocabulary (4,096 rows of 576 for the shipped heads, 4.7 MB in bf16) is
 * read once per tree level, and from DRAM after every verify forward: most of the heads' time. In int8 (per output
 * row a scale sw = max|w| / 127, q = round(w / sw)) it is half the bytes, which stay in the two cores' L2 between
 * the levels of a step where a core's L2 holds its 1.2 MB half (2 MB a core; with 1 MB, the levels after the first
 * read it from L3). Activations are quantised per row alike (sx = max|x| / 127, x8 = round(x / sx), ties to
 * even), the products summed exactly in int32, and
 *     logit[r, o] = bf16( float(sum_k x8[r, k] q[o, k]) * (sx[r] * sw[o]) )
 * which PyTorch computes bit for bit the same (medusa_runtime.heads.medusa.Int8Projection: the integer sums are exact in
 * float32 too, |sum| <= 576 * 127 * 127 < 2^24), so calibration and the PyTorch path score what this does. */

#ifndef HEADS_PREFETCH
#define HEADS_PREFETCH 1 /* the heads' few rows prefetch their weights into L2 (see head_linear) */
#endif

/* Bytes of a packed int8 weight: [ceil(out/16)][ceil(in/4)][16 outputs][4 inputs], zero padded: the dot-product
 * instruction's layout, a 64-byte run holds 4 consecutive inputs of 16 outputs. */
size_t lean_i8_packed_size(int out, int in) { return (size_t)pad_to(out, 16) * (size_t)pad_to(in, 4); }

void lean_pack_i8(const int8_t *q, int out, int in, int8_t *packed) {
    int kg_n = pad_to(in, 4) / 4, blocks = pad_to(out, 16) / 16;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b)
        for (int g = 0; g < kg_n; ++g)
            for (int c = 0; c < 16; ++c)
                for (int t = 0; t < 4; ++t) {
                    int o = 16 * b + c, i = 4 * g + t;
                    packed[(((size_t)b * kg_n + g) * 16 + c) * 4 + t] = (o < out && i < in) ? q[(size_t)o * in + i] : 0;
                }
}

/* x [n, in] bf16 -> xq [n, in4] uint8 holding x8 + 128 (in4 = in rounded up to 4, zero padded: x8 = 0), sx [n] */
static void quantize_rows(const bf16 *x, int n, int in, uint8_t *xq, float *sx) {
    int in4 = pad_to(in, 4);
    for (int r = 0; r < n; ++r) {
        const bf16 *xr = x + (size_t)r * in;
        uint8_t *qr = xq + (size_t)r * in4;
        float m = 0.f;
        int k = 0;
#if LEAN_AVX512BF16
        /* 16 at a time, the same operations: |x|'s maximum, an IEEE division, rounding to nearest even */
        __m512 vm = _mm512_setzero_ps();
        for (; k + 16 <= in; k += 16) vm = _mm512_max_ps(vm, _mm512_abs_ps(load16_bf16(xr + k)));
        m = _mm512_reduce_max_ps(vm);
#endif
        for (; k < in; ++k) m = fmaxf(m, fabsf(bf2f(xr[k])));
        float scale = m / 127.0f;
        sx[r] = scale;
        k = 0;
#if LEAN_AVX512BF16
        if (scale > 0.f) {
            __m512 vs = _mm512_set1_ps(scale);
            for (; k + 16 <= in; k += 16) {
                __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16_bf16(xr + k), vs),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm_storeu_si128((__m128i *)(qr + k),
                                 _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128))));
            }
        }
#endif
        for (; k < in4; ++k)
            qr[k] = (uint8_t)(128 + (k < in && scale > 0.f ? (int)nearbyintf(bf2f(xr[k]) / scale) : 0));
    }
}

/* y [n, out] bf16 = the int8 projection of the quantised rows (see above); wp packed by lean_pack_i8, sw [out] the
 * rows' scales, wsum [out] the sums of each row's q (the uint8 offset of 128 is taken back out with them). Called
 * from inside a parallel region: the output blocks of 16 are shared out. */
static void linear_i8_rows(const int8_t *wp, const float *sw, const int32_t *wsum, const uint8_t *xq, const float *sx,
                           int n, int out, int in, bf16 *y) {
    int kg_n = pad_to(in, 4) / 4, in4 = 4 * kg_n, blocks = pad_to(out, 16) / 16;
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int8_t *wb = wp + (size_t)b * kg_n * 64;
        int o0 = 16 * b, cnt = out - o0 < 16 ? out - o0 : 16;
        for (int i = 0; i < n; i += 4) {
            int R = n - i < 4 ? n - i : 4;
            int32_t acc[4][16];
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
            /* four partial sums per row, over every 4th group of inputs: four independent chains of dot-product
             * instructions (one chain waits on each instruction's latency); integer sums, so their order does
             * not change the result */
            __m512i a[4][4];
            for (int rr = 0; rr < 4; ++rr)
                for (int u = 0; u < 4; ++u) a[rr][u] = _mm512_setzero_si512();
            for (int g0 = 0; g0 < kg_n; g0 += 4) {
                if (HEADS_PREFETCH && i == 0)  /* 16 KB ahead into L2, on the first pass over the block */
                    for (int u = 0; u < 4; ++u) _mm_prefetch((const char *)(wb + (size_t)(g0 + u) * 64) + 16384, _MM_HINT_T1);
                for (int u = 0; u < 4 && g0 + u < kg_n; ++u) {
                    int g = g0 + u;
                    __m512i w = _mm512_loadu_si512((const void *)(wb + (size_t)g * 64));
                    for (int rr = 0; rr < R; ++rr) {
                        int32_t x4;
                        memcpy(&x4, xq + (size_t)(i + rr) * in4 + 4 * g, 4);
                        a[rr][u] = _mm512_dpbusd_epi32(a[rr][u], _mm512_set1_epi32(x4), w);
                    }
                }
            }
            for (int rr = 0; rr < R; ++rr)
                _mm512_storeu_si512((void *)acc[rr], _mm512_add_epi32(_mm512_add_epi32(a[rr][0], a[rr][1]),
                                                                      _mm512_add_epi32(a[rr][2], a[rr][3])));
#else
            for (int rr = 0; rr < R; ++rr)
                for (int c = 0; c < 16; ++c) {
                    int32_t sum = 0;
                    for (int g = 0; g < kg_n; ++g)
                        for (int t = 0; t < 4; ++t)
                            sum += (int32_t)xq[(size_t)(i + rr) * in4 + 4 * g + t] * (int32_t)wb[((size_t)g * 16 + c) * 4 + t];
                    acc[rr][c] = sum;
                }
#endif
            for (int rr = 0; rr < R; ++rr)
                for (int c = 0; c < cnt; ++c) {
                    int32_t dot = acc[rr][c] - 128 * wsum[o0 + c];
                    float scale = sx[i + rr] * sw[o0 + c];
                    y[(size_t)(i + rr) * out + o0 + c] = f2bf((float)dot * scale);
                }
        }
    }
}

/* The int8 projection as a standalone call (tests): xq scratch of n * in4 bytes, sx of n floats. */
void lean_linear_i8(const int8_t *wp, const float *sw, const int32_t *wsum, const bf16 *x, int n, int out, int in,
                    bf16 *y, uint8_t *xq, float *sx, int nthreads) {
    quantize_rows(x, n, in, xq, sx);
#pragma omp parallel num_threads(nthreads)
    linear_i8_rows(wp, sw, wsum, xq, sx, n, out, in, y);
}

/* A projection of the heads: bf16 weights (packed for the call's path, scale NULL), or int8 (lean_pack_i8) with
 * per-row scales and sums. */
typedef struct {
    const void *w;
    const float *scale;
    const int32_t *sum;
} LeanProj;

/* ------------------------------------------------------------------ Medusa heads, one tree level */

#define HEAD_MAX_BLOCKS 8

/* One root-conditioned head's weights (bf16, packed when the call runs on the tile unit). */
typedef struct {
    const bf16 *root_w;   /* U_j [H, H]: the root token's embedding into the first block */
    const bf16 *parent_w; /* P_j [H, H] (path-conditioned heads j >= 1), else NULL */
    const bf16 *w[HEAD_MAX_BLOCKS], *b[HEAD_MAX_BLOCKS]; /* residual blocks: W [H, H], b [H] */
    /* the root's and a parent's terms for every token of the draft vocabulary, [S, H] (NULL: computed each time):
     * bf16(e U^T) and bf16(e P^T) by this file's own linear layer, so a row read equals the row computed, bit for
     * bit, and a step reads 1 KB instead of U's and P's 0.6 MB each */
    const bf16 *root_table, *parent_table;
} LeanHead;

/* out_i = bf16(x_in[i / per] + bf16(silu(z[i / per]))) for rows i of width h (z may be bf16(z + extra[i]) first,
 * extra NULL: none): per = 1 row by row (out may be x_in), per > 1 an input row and its z shared by `per` rows
 * (one step's hidden state under each of its tree's parents, or a request's in a batched step). Shared
 * out in pieces of 64 columns, 16 at a time with the forward's exp16 (a chain's levels have one row, which one
 * thread took 4-6 us a block for with expf per value). */
static void silu_residual_rows(bf16 *out, const bf16 *x_in, const bf16 *z, const bf16 *extra, int rows, int per,
                               int h) {
    const int pieces = (h + 63) / 64;
#pragma omp for schedule(static)
    for (int t = 0; t < rows * pieces; ++t) {
        const int i = t / pieces, k0 = (t % pieces) * 64, k1 = k0 + 64 < h ? k0 + 64 : h;
        const bf16 *xi = x_in + (size_t)(i / per) * h, *zi = z + (size_t)(i / per) * h;
        const bf16 *ei = extra ? extra + (size_t)i * h : NULL;
        bf16 *o = out + (size_t)i * h;
#if LEAN_AVX512BF16
        for (int k = k0; k < k1; k += 16) {
            const __mmask16 m = k1 - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k1 - k)) - 1);
            __m512 zz = load16_bf16_masked(m, zi + k);
            if (ei) zz = round16(_mm512_add_ps(zz, load16_bf16_masked(m, ei + k)));
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), zz));
            __m512 sv = round16(_mm512_div_ps(zz, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_mask_storeu_epi16(o + k, m, narrow16(_mm512_add_ps(load16_bf16_masked(m, xi + k), sv)));
        }
#else
        for (int k = k0; k < k1; ++k) {
            float zz = bf2f(zi[k]);
            if (ei) zz = bf2f(f2bf(zz + bf2f(ei[k])));
            float sv = bf2f(f2bf(zz / (1.0f + expf(-zz))));
            o[k] = f2bf(bf2f(xi[k]) + sv);
        }
#endif
    }
}

/* The k best of v [len] (largest first; equal values: the lower index first) and the largest softmax
 * probability 1 / sum exp(v - max), both of the bf16 logits as float32. */
static inline void topk_offer(float x, int i, int k, float *best, int32_t *idx, int *n) {
    if (*n == k && !(x > best[k - 1])) return;  /* ties keep the earlier index */
    int p = *n < k ? (*n)++ : k - 1;
    while (p > 0 && x > best[p - 1]) {
        best[p] = best[p - 1];
        idx[p] = idx[p - 1];
        --p;
    }
    best[p] = x;
    idx[p] = i;
}

static void topk_row(const bf16 *v, int len, int k, int32_t *idx, float *top1) {
    float best[64];
    int n = 0, i = 0;
#if LEAN_AVX512BF16
    /* 16 values at a time: once k are held, a run none of whose values beats the k-th best is passed over whole
     * (the same comparison as topk_offer's, so the same result; docs/reports/heads-call.md) */
    for (; i + 16 <= len; i += 16) {
        if (n == k && !_mm512_cmp_ps_mask(load16_bf16(v + i), _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ)) continue;
        for (int j = i; j < i + 16; ++j) topk_offer(bf2f(v[j]), j, k, best, idx, &n);
    }
#endif
    for (; i < len; ++i) topk_offer(bf2f(v[i]), i, k, best, idx, &n);
    float mx = best[0];
    i = 0;
#if LEAN_AVX512BF16
    __m512 acc = _mm512_setzero_ps(), vm = _mm512_set1_ps(mx);
    for (; i + 16 <= len; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(load16_bf16(v + i), vm)));
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < len; ++i) sum += expf(bf2f(v[i]) - mx);
    *top1 = 1.0f / sum;
#else
    double sum = 0.0; /* in double: one float chain over a vocabulary row would drift by about len ulps */
    for (; i < len; ++i) sum += expf(bf2f(v[i]) - mx);
    *top1 = (float)(1.0 / sum);
#endif
}

size_t lean_heads_work_size(int hsz, int vocab, int parents);

/* topk_row over `rows` rows of v [rows, len] (tests): idx [rows, k], top1 [rows]. Returns -3 for k out of 1..64. */
int lean_topk_rows(const bf16 *v, int rows, int len, int k, int32_t *idx, float *top1) {
    if (k < 1 || k > 64 || k > len) return -3;
    for (int r = 0; r < rows; ++r) topk_row(v + (size_t)r * len, len, k, idx + (size_t)r * k, top1 + r);
    return 0;
}


/* A linear layer of the heads: right after a verify forward their weights come from DRAM, and a one-row pass
 * without software prefetch streams them at what one core's own outstanding misses allow; with it, the L2
 * fetches ahead (the tile path, where a caller asks for it, as linear_any) */
static inline void head_linear(int amx, const bf16 *w, const bf16 *x, int n, int out, int in, void *y, const bf16 *r,
                               int kind, bf16 *xa) {
    if (amx)
        linear_any(amx, w, x, n, out, in, y, r, kind, xa, 0);
    else
        linear_rows_pf(w, x, n, out, in, y, r, kind, HEADS_PREFETCH);
}

/* One tree level of root-conditioned (optionally path-conditioned) shared-format heads, as the decoder's
 * PyTorch path computes it in bf16 (each op rounded to bf16 where PyTorch rounds):
 *   e_p = bf16(bf16(root U^T) + bf16(parent_p P^T))          (e = bf16(root U^T) without parents)
 *   x_p = bf16(h + bf16(silu(bf16(bf16(h W_0^T + b_0) + e_p))))   then for blocks l >= 1:
 *   x_p = bf16(x_p + bf16(silu(bf16(x_p W_l^T + b_l))))
 *   logits_p = bf16(x_p proj^T) over the draft vocabulary [S] (or the int8 projection of x_p, see above);
 *   top-k indices and top-1 probability.
 * rows = max(1, parents). Called by every thread of an OpenMP parallel region (its loops are worksharing
 * loops; it returns with the threads in step). work: lean_heads_work_size(hsz, vocab, parents) bf16. */
static void heads_level_in_team(const LeanHead *head, int blocks, int hsz, int vocab, const LeanProj *proj,
                                const bf16 *hidden, const bf16 *root_e, int root_row, const bf16 *parent_e,
                                const int32_t *parent_rows, int parents, int k, int32_t *top, float *top1, bf16 *work,
                                int amx) {
    int rows = parents > 0 ? parents : 1;
    bf16 *er = work, *ep = er + hsz, *z = ep + (size_t)rows * hsz, *x = z + (size_t)rows * hsz,
         *logits = x + (size_t)(rows + 1) * hsz, *xa = logits + (size_t)rows * vocab;
    /* the int8 projection's quantised rows and their scales, after the tile path's scratch */
    float *sx = (float *)(xa + lean_amx_scratch_size(rows, hsz) + 2);
    sx = (float *)(((uintptr_t)sx + 63) & ~(uintptr_t)63);
    uint8_t *xq = (uint8_t *)(sx + rows + 16);
    /* e: the root's term, plus each parent's (from the tables where the tokens are in the draft vocabulary:
     * root_row >= 0, parent_rows given) */
    if (head->root_table && root_row >= 0)
        er = (bf16 *)head->root_table + (size_t)root_row * hsz;
    else
        head_linear(amx, head->root_w, root_e, 1, hsz, hsz, er, NULL, OUT_BF16, xa);
    if (parents > 0 && head->parent_w) {
        if (head->parent_table && parent_rows) {
#pragma omp for schedule(static)
            for (int p = 0; p < parents; ++p)
                memcpy(ep + (size_t)p * hsz, head->parent_table + (size_t)parent_rows[p] * hsz, (size_t)hsz * sizeof(bf16));
        } else {
            head_linear(amx, head->parent_w, parent_e, parents, hsz, hsz, ep, NULL, OUT_BF16, xa);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < parents; ++p)
            for (int i = 0; i < hsz; ++i) ep[(size_t)p * hsz + i] = f2bf(bf2f(er[i]) + bf2f(ep[(size_t)p * hsz + i]));
    } else {
#pragma omp for schedule(static)
        for (int p = 0; p < rows; ++p) memcpy(ep + (size_t)p * hsz, er, (size_t)hsz * sizeof(bf16));
    }
    /* block 0 on the step's hidden state (one row, the same for every parent), then with each e_p */
#pragma omp single
    memcpy(x, hidden, (size_t)hsz * sizeof(bf16)); /* row 0: h; rows 1..: the parents' states */
    head_linear(amx, head->w[0], x, 1, hsz, hsz, z, head->b[0], OUT_BF16_BIAS, xa);
    silu_residual_rows(x + hsz, x, z, ep, rows, rows, hsz); /* every row from row 0's h and z */
    bf16 *xs = x + hsz; /* [rows, H] */
    for (int l = 1; l < blocks; ++l) {
        head_linear(amx, head->w[l], xs, rows, hsz, hsz, z, head->b[l], OUT_BF16_BIAS, xa);
        silu_residual_rows(xs, xs, z, NULL, rows, 1, hsz);
    }
    if (proj->scale) {
#pragma omp single
        quantize_rows(xs, rows, hsz, xq, sx);
        linear_i8_rows((const int8_t *)proj->w, proj->scale, proj->sum, xq, sx, rows, vocab, hsz, logits);
    } else {
        head_linear(amx, (const bf16 *)proj->w, xs, rows, vocab, hsz, logits, NULL, OUT_BF16, xa);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < rows; ++i) topk_row(logits + (size_t)i * vocab, vocab, k, top + (size_t)i * k, top1 + i);
}

/* One tree level (see heads_level_in_team) in a parallel region of its own. work: bf16,
 * lean_heads_work_size(hsz, vocab, parents) elements. amx: weights and proj packed by lean_pack_amx.
 * Returns 0, -2 without the tile unit, -3 for k or the block count out of range. */
int lean_heads_level(const LeanHead *head, int blocks, int hsz, int vocab, const LeanProj *proj, const bf16 *hidden,
                     const bf16 *root_e, const bf16 *parent_e, int parents, int k, int32_t *top, float *top1,
                     bf16 *work, int amx, int nthreads) {
    if (k < 1 || k > 64 || blocks < 1 || blocks > HEAD_MAX_BLOCKS) return -3;
    if (amx && !lean_amx_available()) return -2;
#pragma omp parallel num_threads(nthreads)
    {
#if LEAN_AMX_BUILD
        if (amx) amx_configure();
#endif
        heads_level_in_team(head, blocks, hsz, vocab, proj, hidden, root_e, -1, parent_e, NULL, parents, k, top, top1,
                            work, amx);
#if LEAN_AMX_BUILD
        if (amx) amx_release();
#endif
    }
    return 0;
}

/* Level d >= 1 of a tree for path-conditioned heads: head d-1 scores each parent node of level d-1 (the
 * root alone for d = 1: parents = 0) and child c is its parent's rank-th candidate. Node ids as the
 * decoder's (node 0 the root). */
typedef struct {
    int parents;                    /* P (0 for level 1: the root) */
    const int64_t *parent_nodes;    /* [P] node ids of level d-1 with children */
    int children;                   /* C */
    const int64_t *child_nodes;     /* [C] node ids of level d */
    const int64_t *child_parent;    /* [C] index into parent_nodes (0 for level 1) */
    const int64_t *child_rank;      /* [C] rank in the parent's top-k */
} LeanLevel;

/* A whole tree's candidates in one call: every level of lean_heads_level in one parallel region, each
 * level's parents' input embeddings gathered from `embed` [V, H] by the tokens the level above placed, each
 * candidate row mapped to its token (draft_ids [S], NULL: the row is the token), placed at its node:
 * nodes [N] int64 (nodes[0] = root). chain[d] = the top-1 probability of level d+1's first parent (the top-1
 * chain a confidence gate reads). With gate > 0 the levels stop after the first whose chain product (float32,
 * as treesearch.replay.gated_depth) is below the gate: the decoder cuts the tree there, so deeper levels are
 * never verified. What stays the same from step to step is in a LeanTreeCall, built once, so that a step's call
 * passes five values (right after a verify forward every Python and ctypes operation runs on cold caches: the
 * wrapper of the twenty-argument call this replaced took 0.05-0.07 ms there before reaching C). Returns the number of levels computed, -2 without the tile unit, -3 for
 * k or the block count out of range, -4 for a root outside the embeddings. */
typedef struct {
    const LeanHead *heads;
    const LeanLevel *levels;
    int depth, blocks, hsz, vocab;  /* vocab: the projection's rows S */
    const LeanProj *proj;
    const bf16 *embed;        /* [V, H] the model's input embeddings */
    int64_t embed_rows;       /* V */
    const int64_t *draft_ids; /* [S] each projection row's token, NULL: the row is the token */
    const int32_t *draft_row; /* [V] each token's row of the draft vocabulary (-1: none), for the heads' tables;
                               * NULL: none */
    int32_t *rows;            /* scratch, N + max parents: each node's row, then a level's parents' rows */
    int k;
    float *chain;             /* [depth] out */
    bf16 *work;               /* lean_heads_tree_work_size(hsz, vocab, max parents, k) bf16 */
    int amx, nthreads;
} LeanTreeCall;

int lean_heads_tree(const LeanTreeCall *c, const bf16 *hidden, int64_t root, float gate, int64_t *nodes) {
    const LeanHead *heads = c->heads;
    const LeanLevel *levels = c->levels;
    const int depth = c->depth, blocks = c->blocks, hsz = c->hsz, vocab = c->vocab, k = c->k, amx = c->amx;
    const LeanProj *proj = c->proj;
    const bf16 *embed = c->embed;
    const int64_t *draft_ids = c->draft_ids;
    int32_t *rows = c->rows;
    float *chain = c->chain;
    bf16 *work = c->work;
    if (k < 1 || k > 64 || blocks < 1 || blocks > HEAD_MAX_BLOCKS) return -3;
    if (amx && !lean_amx_available()) return -2;
    if (root < 0 || root >= c->embed_rows) return -4; /* it indexes the embeddings */
    const int root_row = c->draft_row ? c->draft_row[root] : -1;
    int max_rows = 1;
    for (int d = 0; d < depth; ++d) max_rows = levels[d].parents > max_rows ? levels[d].parents : max_rows;
    bf16 *pe = work, *level_work = pe + (size_t)max_rows * hsz; /* pe [P, H]: the parents' embeddings */
    size_t level_size = lean_heads_work_size(hsz, vocab, max_rows);
    int32_t *top = (int32_t *)(level_work + level_size + ((uintptr_t)(level_work + level_size) & 2 ? 1 : 0));
    float *top1 = (float *)(top + (size_t)max_rows * k);
    const bf16 *root_e = embed + (size_t)root * hsz;
    int done = 0, node_count = 1;
    for (int d = 0; d < depth; ++d) node_count += levels[d].children;
    int32_t *prow = rows + node_count; /* a level's parents' rows */
    nodes[0] = root;
    rows[0] = root_row;
#pragma omp parallel num_threads(c->nthreads)
    {
#if LEAN_AMX_BUILD
        if (amx) amx_configure();
#endif
        float product = 1.0f;
        for (int d = 0; d < depth; ++d) {
            const LeanLevel *lv = &levels[d];
            /* the parents' rows of the draft vocabulary (tables), else their input embeddings gathered */
            int tables = heads[d].parent_table != NULL && draft_ids != NULL;
            for (int p = 0; p < lv->parents && tables; ++p) tables = rows[lv->parent_nodes[p]] >= 0;
            if (tables) {
#pragma omp single
                for (int p = 0; p < lv->parents; ++p) prow[p] = rows[lv->parent_nodes[p]];
            } else {
#pragma omp for schedule(static)
                for (int p = 0; p < lv->parents; ++p)
                    memcpy(pe + (size_t)p * hsz, embed + (size_t)nodes[lv->parent_nodes[p]] * hsz, (size_t)hsz * sizeof(bf16));
            }
            heads_level_in_team(&heads[d], blocks, hsz, vocab, proj, hidden, root_e, draft_ids ? root_row : -1,
                                lv->parents ? pe : NULL, tables ? prow : NULL, lv->parents, k, top, top1, level_work,
                                amx);
            for (int c = 0; c < lv->children; ++c) { /* every thread places the same values: no barrier needed */
                int32_t row = top[lv->child_parent[c] * k + lv->child_rank[c]];
                if (omp_get_thread_num() == 0) {
                    nodes[lv->child_nodes[c]] = draft_ids ? draft_ids[row] : row;
                    rows[lv->child_nodes[c]] = draft_ids ? row : -1;
                }
            }
            product *= top1[0]; /* each thread the same float32 product */
            if (omp_get_thread_num() == 0) {
                chain[d] = top1[0];
                done = d + 1;
            }
#pragma omp barrier
            if (gate > 0.0f && product < gate) break;
        }
#if LEAN_AMX_BUILD
        if (amx) amx_release();
#endif
    }
    return done;
}

/* bf16 elements of lean_heads_level's work for `parents` parents (0: the root level) */
size_t lean_heads_work_size(int hsz, int vocab, int parents) {
    int rows = parents > 0 ? parents : 1;
    /* + the int8 projection's quantised rows (bytes) and scales, aligned (see heads_level_in_team) */
    return (size_t)(3 * rows + 2) * hsz + (size_t)rows * vocab + lean_amx_scratch_size(rows, hsz) + 2 + 32 +
           (size_t)2 * (rows + 16) + ((size_t)rows * pad_to(hsz, 4) + 1) / 2;
}

/* bf16 elements of lean_heads_tree's work: a level's work for the widest level, the parents' embeddings,
 * and the top-k rows (int32) and top-1 probabilities (float32) of a level, aligned */
size_t lean_heads_tree_work_size(int hsz, int vocab, int max_parents, int k) {
    int rows = max_parents > 0 ? max_parents : 1;
    return (size_t)rows * hsz + lean_heads_work_size(hsz, vocab, rows) + 1 + (size_t)rows * (2 * k + 2);
}

/* bf16 elements of heads_levels_in_team's work: R requests of `per` rows each */
static size_t heads_levels_work_size(int hsz, int vocab, int reqs, int per) {
    size_t rows = (size_t)reqs * per;
    return (size_t)reqs * hsz + 3 * rows * hsz + rows * vocab + lean_amx_scratch_size((int)rows, hsz) + 2 + 32 +
           (size_t)2 * (rows + 16) + (rows * pad_to(hsz, 4) + 1) / 2;
}

/* One tree level of heads_level_in_team for R requests at once, each with its own hidden state, root and
 * parents (the same count P each; rows = R * max(1, P), request r's rows r*per .. r*per + per - 1): every
 * weight is read once for all of them, and each row gets the bits a call for its request alone gives it (the
 * linear layers, the int8 quantisation and the top-k are row by row). root_rows [R]: each root's row of the
 * draft vocabulary's tables (-1: computed from roots_e [R] rows of the embeddings). */
static void heads_levels_in_team(const LeanHead *head, int blocks, int hsz, int vocab, const LeanProj *proj, int reqs,
                                 const bf16 *hidden, const bf16 *embed, const int64_t *roots, const int32_t *root_rows,
                                 const bf16 *parent_e, const int32_t *parent_rows, int parents, int k, int32_t *top,
                                 float *top1, bf16 *work, int amx) {
    const int per = parents > 0 ? parents : 1, rows = reqs * per;
    bf16 *er = work, *ep = er + (size_t)reqs * hsz, *z = ep + (size_t)rows * hsz, *x = z + (size_t)rows * hsz,
         *logits = x + (size_t)rows * hsz, *xa = logits + (size_t)rows * vocab;
    float *sx = (float *)(xa + lean_amx_scratch_size(rows, hsz) + 2);
    sx = (float *)(((uintptr_t)sx + 63) & ~(uintptr_t)63);
    uint8_t *xq = (uint8_t *)(sx + rows + 16);
    /* each request's root term: its table row, else its embedding through U (one row, as a call of its own) */
#pragma omp for schedule(static)
    for (int r = 0; r < reqs; ++r)
        if (head->root_table && root_rows[r] >= 0)
            memcpy(er + (size_t)r * hsz, head->root_table + (size_t)root_rows[r] * hsz, (size_t)hsz * sizeof(bf16));
    for (int r = 0; r < reqs; ++r)
        if (!(head->root_table && root_rows[r] >= 0))
            head_linear(amx, head->root_w, embed + (size_t)roots[r] * hsz, 1, hsz, hsz, er + (size_t)r * hsz, NULL,
                        OUT_BF16, xa);
    if (parents > 0 && head->parent_w) {
        if (head->parent_table && parent_rows) {
#pragma omp for schedule(static)
            for (int p = 0; p < rows; ++p)
                memcpy(ep + (size_t)p * hsz, head->parent_table + (size_t)parent_rows[p] * hsz, (size_t)hsz * sizeof(bf16));
        } else {
            head_linear(amx, head->parent_w, parent_e, rows, hsz, hsz, ep, NULL, OUT_BF16, xa);
        }
#pragma omp for schedule(static)
        for (int p = 0; p < rows; ++p) {
            const bf16 *e = er + (size_t)(p / per) * hsz;
            for (int i = 0; i < hsz; ++i) ep[(size_t)p * hsz + i] = f2bf(bf2f(e[i]) + bf2f(ep[(size_t)p * hsz + i]));
        }
    } else {
#pragma omp for schedule(static)
        for (int p = 0; p < rows; ++p) memcpy(ep + (size_t)p * hsz, er + (size_t)(p / per) * hsz, (size_t)hsz * sizeof(bf16));
    }
    /* block 0 on each request's hidden state (one row per request), then with each row's e */
    head_linear(amx, head->w[0], hidden, reqs, hsz, hsz, z, head->b[0], OUT_BF16_BIAS, xa);
    silu_residual_rows(x, hidden, z, ep, rows, per, hsz); /* each request's h and z shared by its rows */
    for (int l = 1; l < blocks; ++l) {
        head_linear(amx, head->w[l], x, rows, hsz, hsz, z, head->b[l], OUT_BF16_BIAS, xa);
        silu_residual_rows(x, x, z, NULL, rows, 1, hsz);
    }
    if (proj->scale) {
#pragma omp single
        quantize_rows(x, rows, hsz, xq, sx);
        linear_i8_rows((const int8_t *)proj->w, proj->scale, proj->sum, xq, sx, rows, vocab, hsz, logits);
    } else {
        head_linear(amx, (const bf16 *)proj->w, x, rows, vocab, hsz, logits, NULL, OUT_BF16, xa);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < rows; ++i) topk_row(logits + (size_t)i * vocab, vocab, k, top + (size_t)i * k, top1 + i);
}

/* bf16 elements of lean_heads_trees' work for R requests (max_parents: the tree's widest level) */
size_t lean_heads_trees_work_size(int hsz, int vocab, int max_parents, int k, int reqs) {
    size_t rows = (size_t)reqs * (max_parents > 0 ? max_parents : 1);
    /* the parents' embeddings, the open requests' states, a level's work, its top-k (int32) and top-1 (float32),
     * the open requests' roots (int64), aligned */
    return rows * hsz + (size_t)reqs * hsz + heads_levels_work_size(hsz, vocab, reqs, max_parents > 0 ? max_parents : 1) +
           1 + rows * (2 * (size_t)k + 2) + (size_t)reqs * 4 + 16;
}

/* lean_heads_tree for R requests in one call (a batched step's rows): every level's weights read once for all
 * of them. hidden [R, H] bf16, roots [R]; nodes [R, N] int64, chains [R, depth] float32 and done [R] (the levels
 * each request's gate let through, as lean_heads_tree returns) out; work: lean_heads_trees_work_size bf16;
 * rows: int32 scratch of R * (N + max parents + 3). Each request gets the nodes and chain lean_heads_tree gives it
 * alone. A request whose gate stops it takes no part in deeper levels; the call ends when every request has
 * stopped. The LeanTreeCall's own scratch (rows, chain, work) is not touched. Returns 0, or lean_heads_tree's
 * codes (-4: a root outside the embeddings). */
int lean_heads_trees(const LeanTreeCall *c, int reqs, const bf16 *hidden, const int64_t *roots, float gate,
                     int64_t *nodes, float *chains, int32_t *done, bf16 *work, int32_t *rows) {
    const LeanHead *heads = c->heads;
    const LeanLevel *levels = c->levels;
    const int depth = c->depth, blocks = c->blocks, hsz = c->hsz, vocab = c->vocab, k = c->k, amx = c->amx;
    const int64_t *draft_ids = c->draft_ids;
    if (k < 1 || k > 64 || blocks < 1 || blocks > HEAD_MAX_BLOCKS || reqs < 1) return -3;
    if (amx && !lean_amx_available()) return -2;
    for (int r = 0; r < reqs; ++r)
        if (roots[r] < 0 || roots[r] >= c->embed_rows) return -4;
    int max_rows = 1, node_count = 1;
    for (int d = 0; d < depth; ++d) {
        max_rows = levels[d].parents > max_rows ? levels[d].parents : max_rows;
        node_count += levels[d].children;
    }
    const size_t most = (size_t)reqs * max_rows;
    bf16 *pe = work, *hid = pe + most * hsz, *level_work = hid + (size_t)reqs * hsz; /* parents' embeddings, states */
    size_t level_size = heads_levels_work_size(hsz, vocab, reqs, max_rows);
    int32_t *top = (int32_t *)(level_work + level_size + ((uintptr_t)(level_work + level_size) & 2 ? 1 : 0));
    float *top1 = (float *)(top + most * k);
    int64_t *open_roots = (int64_t *)(((uintptr_t)(top1 + most) + 7) & ~(uintptr_t)7);
    int32_t *node_rows = rows, *prow = rows + (size_t)reqs * node_count, *open_root_rows = prow + most;
    int32_t *open = open_root_rows + reqs; /* the requests still going, in order */
    float *product = (float *)(open + reqs);
    int n_open = reqs;
    for (int r = 0; r < reqs; ++r) {
        open[r] = r;
        product[r] = 1.0f;
        done[r] = 0;
        nodes[(size_t)r * node_count] = roots[r];
        node_rows[(size_t)r * node_count] = c->draft_row ? c->draft_row[roots[r]] : -1;
    }
#pragma omp parallel num_threads(c->nthreads)
    {
#if LEAN_AMX_BUILD
        if (amx) amx_configure();
#endif
        for (int d = 0; d < depth && n_open > 0; ++d) {
            const LeanLevel *lv = &levels[d];
            const int per = lv->parents > 0 ? lv->parents : 1, level_rows = n_open * per;
            /* the open requests' states and roots, then their parents' rows (tables) or embeddings */
#pragma omp for schedule(static)
            for (int o = 0; o < n_open; ++o) {
                memcpy(hid + (size_t)o * hsz, hidden + (size_t)open[o] * hsz, (size_t)hsz * sizeof(bf16));
                open_roots[o] = roots[open[o]];
                open_root_rows[o] = draft_ids ? node_rows[(size_t)open[o] * node_count] : -1;
            }
            int tables = heads[d].parent_table != NULL && draft_ids != NULL;
            for (int o = 0; o < n_open && tables; ++o)
                for (int p = 0; p < lv->parents && tables; ++p)
                    tables = node_rows[(size_t)open[o] * node_count + lv->parent_nodes[p]] >= 0;
#pragma omp for schedule(static)
            for (int i = 0; i < (lv->parents ? level_rows : 0); ++i) {
                const int o = i / per, p = i % per;
                const size_t base = (size_t)open[o] * node_count;
                if (tables)
                    prow[i] = node_rows[base + lv->parent_nodes[p]];
                else
                    memcpy(pe + (size_t)i * hsz, c->embed + (size_t)nodes[base + lv->parent_nodes[p]] * hsz,
                           (size_t)hsz * sizeof(bf16));
            }
            heads_levels_in_team(&heads[d], blocks, hsz, vocab, c->proj, n_open, hid, c->embed, open_roots,
                                 open_root_rows, lv->parents ? pe : NULL, tables ? prow : NULL, lv->parents, k, top,
                                 top1, level_work, amx);
#pragma omp barrier
#pragma omp single
            {
                int still = 0;
                for (int o = 0; o < n_open; ++o) {
                    const int r = open[o];
                    const size_t base = (size_t)r * node_count;
                    for (int ch = 0; ch < lv->children; ++ch) {
                        int32_t row = top[((size_t)o * per + lv->child_parent[ch]) * k + lv->child_rank[ch]];
                        nodes[base + lv->child_nodes[ch]] = draft_ids ? draft_ids[row] : row;
                        node_rows[base + lv->child_nodes[ch]] = draft_ids ? row : -1;
                    }
                    const float p0 = top1[(size_t)o * per];
                    chains[(size_t)r * depth + d] = p0;
                    product[r] *= p0;
                    done[r] = d + 1;
                    if (!(gate > 0.0f && product[r] < gate)) open[still++] = r;
                }
                n_open = still;
            } /* single's barrier: every thread sees the new open list */
        }
#if LEAN_AMX_BUILD
        if (amx) amx_release();
#endif
    }
    return 0;
}

/* out[r] = the index of the largest element of row r of x [rows, len] (bf16 when bf16_in, else float32): the
 * first of tied maxima, and a NaN counts as larger than any number (the first NaN wins), as NumPy's argmax on
 * the float32 values */
static inline float load_any(const void *x, int bf16_in, size_t i) {
    return bf16_in ? bf2f(((const bf16 *)x)[i]) : ((const float *)x)[i];
}

void lean_argmax_rows(const void *x, int rows, int len, int bf16_in, int64_t *out) {
    for (int r = 0; r < rows; ++r) {
        size_t base = (size_t)r * len;
        int i = 0, best = 0, nan = 0;
        float top = load_any(x, bf16_in, base);
#if LEAN_AVX512BF16
        if (len >= 16) {
            const bf16 *vb = (const bf16 *)x + base;
            const float *vf = (const float *)x + base;
            __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), at = lane;
            __m512 vmax = bf16_in ? load16_bf16(vb) : _mm512_loadu_ps(vf);
            __mmask16 odd = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
            for (i = 16; i + 16 <= len; i += 16) { /* each lane keeps its first maximum */
                __m512 xv = bf16_in ? load16_bf16(vb + i) : _mm512_loadu_ps(vf + i);
                __mmask16 gt = _mm512_cmp_ps_mask(xv, vmax, _CMP_GT_OQ);
                odd |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
                vmax = _mm512_mask_mov_ps(vmax, gt, xv);
                at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(i)));
            }
            nan = odd != 0;
            top = _mm512_reduce_max_ps(vmax);
            best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ), at);
        }
#endif
        for (int j = i; j < len && !nan; ++j) { /* the rest (all of a short row) in order */
            float xj = load_any(x, bf16_in, base + j);
            if (xj != xj) nan = 1;
            else if (xj > top || j == 0) top = xj, best = j;
        }
        for (int j = 0; nan && j < len; ++j) /* the first NaN */
            if (load_any(x, bf16_in, base + j) != load_any(x, bf16_in, base + j)) {
                best = j;
                break;
            }
        out[r] = best;
    }
}

/* Cache compaction after a verify: for every plane (layer x kv head) of keys and values [planes, cap, row]
 * (row: bytes per slot), slot start + path[i] moves to slot start + i. path is a root-to-node path of the
 * tree, so its node ids increase and each source lies at or after its destination: copying in order never
 * reads a slot it has already overwritten. */
void lean_compact(void *keys, void *values, int planes, int cap, int row, int start, const int64_t *path, int len) {
    for (int t = 0; t < 2; ++t) {
        char *base = (char *)(t ? values : keys);
        for (int p = 0; p < planes; ++p) {
            char *plane = base + (size_t)p * cap * row;
            for (int i = 0; i < len; ++i)
                if (path[i] != i) memcpy(plane + (size_t)(start + i) * row, plane + (size_t)(start + path[i]) * row, row);
        }
    }
}
