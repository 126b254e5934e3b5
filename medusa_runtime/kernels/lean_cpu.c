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
 * Layouts (all row-major, contiguous): weights W [out, in]; activations [n, width]; the KV cache
 * [layers, kv_heads, capacity, head_dim]; cos/sin tables [capacity, head_dim] with rotate_half's
 * sign folded into sin (sin[j] negated for j < D/2), as engine.py builds them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LEAN_AVX512BF16 1
#else
#define LEAN_AVX512BF16 0
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

/* ------------------------------------------------------------------ dot products */

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
#else
    float acc = 0.f;
    for (int k = 0; k < len; ++k) acc += bf2f(a[k]) * bf2f(b[k]);
    return acc;
#endif
}

#if LEAN_AVX512BF16
#define PREFETCH_ROWS 8 /* prefetch distance in weight rows (may run past the end: prefetches never fault) */

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
 * own accumulator over k in the same order as dot_bf16, so results do not depend on R. Called with a
 * constant R, so the 4 x R accumulators stay in registers; each weight load serves R rows. */
static inline __attribute__((always_inline)) void dot4xr_bf16(const bf16 *w, int in, const bf16 *x, int R,
                                                             float out[4][4]) {
    __m512 acc[4][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        __m512bh wv[4];
        for (int c = 0; c < 4; ++c) {  /* the block two ahead (rows 8..11) on its way into L1 meanwhile */
            _mm_prefetch((const char *)(w + (size_t)(c + PREFETCH_ROWS) * in + k), _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_loadu_si512(w + (size_t)c * in + k);
        }
        for (int r = 0; r < R; ++r) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)r * in + k);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
        }
    }
    if (k < in) {
        __mmask32 m = (__mmask32)((1ull << (in - k)) - 1);
        __m512bh wv[4];
        for (int c = 0; c < 4; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (size_t)c * in + k);
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

/* y = x W^T for x [n, in], W [out, in]. Output kinds: bf16 (rounded), bf16 plus a residual
 * (y = bf16(r + bf16(x W^T)), y may alias r), or float32 (unrounded, for logits).
 * Called from inside a parallel region: the output rows are shared out in blocks of 4. */
enum { OUT_BF16 = 0, OUT_BF16_RESIDUAL = 1, OUT_F32 = 2 };

static inline void store_out(void *y, const bf16 *r, int kind, size_t at, float v) {
    if (kind == OUT_F32)
        ((float *)y)[at] = v;
    else if (kind == OUT_BF16)
        ((bf16 *)y)[at] = f2bf(v);
    else
        ((bf16 *)y)[at] = f2bf(bf2f(r[at]) + bf2f(f2bf(v)));
}

static void linear_rows(const bf16 *w, const bf16 *x, int n, int out, int in, void *y, const bf16 *r, int kind) {
    int blocks = (out + 3) / 4;
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; ++b) {
        int o0 = 4 * b, cnt = out - o0 < 4 ? out - o0 : 4;
        const bf16 *wb = w + (size_t)o0 * in;
        for (int i = 0; i < n;) {
            float d[4][4];
            int R = n - i < 4 ? n - i : 4;
#if LEAN_AVX512BF16
            if (cnt == 4) {
                switch (R) {  /* constant R per call: the compiler unrolls each case */
                    case 4: dot4xr_bf16(wb, in, x + (size_t)i * in, 4, d); break;
                    case 3: dot4xr_bf16(wb, in, x + (size_t)i * in, 3, d); break;
                    case 2: dot4xr_bf16(wb, in, x + (size_t)i * in, 2, d); break;
                    default: dot4xr_bf16(wb, in, x + (size_t)i * in, 1, d); break;
                }
            } else
#endif
                for (int rr = 0; rr < R; ++rr)
                    for (int c = 0; c < cnt; ++c) d[rr][c] = dot_bf16(wb + (size_t)c * in, x + (size_t)(i + rr) * in, in);
            for (int rr = 0; rr < R; ++rr)
                for (int c = 0; c < cnt; ++c) store_out(y, r, kind, (size_t)(i + rr) * out + o0 + c, d[rr][c]);
            i += R;
        }
    }
}

/* the same as a standalone call (the heads' projections, the logits) */
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
        float ss = 0.f;
        for (int k = 0; k < h; ++k) ss += bf2f(xi[k]) * bf2f(xi[k]);
        float r = 1.0f / sqrtf(ss / (float)h + eps);
        for (int k = 0; k < h; ++k) y[(size_t)i * h + k] = f2bf(bf2f(w[k]) * bf2f(f2bf(bf2f(xi[k]) * r)));
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
        float e[16];
        for (int c = 0; c < len; ++c) e[c] = -bf2f(g[c]);
        exp_inplace(e, len);
        for (int c = 0; c < len; ++c) {
            float s = bf2f(f2bf(bf2f(g[c]) / (1.0f + e[c])));
            act[(size_t)i * inter + j0 + c] = f2bf(s * bf2f(u[c]));
        }
    }
}

/* ------------------------------------------------------------------ attention */

/* Row i (query at cache slot start + i) sees slots [0, start) and the tree slots start + a with
 * tree[i, a] (tree: [n, n] bytes; NULL = causal, slots [0, start + i]). Out [n, nh * D] bf16.
 * Scores, softmax and the weighted sum in float32, every key's terms added in slot order (so a row's
 * result depends only on the keys it sees, not on where the other rows' keys are). scratch holds
 * `start + n` floats per thread. */
static void attention_rows(const bf16 *q, const bf16 *kc, const bf16 *vc, int n, int nh, int nkv, int d, int cap,
                           int start, const uint8_t *tree, float scale, float *scratch, bf16 *out) {
    int group = nh / nkv, tasks = n * nh, end = start + n;
    float *sc = scratch + (size_t)omp_get_thread_num() * end;
    float acc[256];
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        int i = t / nh, hd = t % nh;
        const bf16 *qi = q + ((size_t)i * nh + hd) * d;
        const bf16 *kh = kc + (size_t)(hd / group) * cap * d, *vh = vc + (size_t)(hd / group) * cap * d;
        float mx = -INFINITY;
        for (int j = 0; j < end; ++j) {
            int seen = j < start || (tree ? tree[(size_t)i * n + (j - start)] : j - start <= i);
            sc[j] = seen ? dot_bf16(qi, kh + (size_t)j * d, d) * scale : -INFINITY;
            if (sc[j] > mx) mx = sc[j];
        }
        for (int j = 0; j < end; ++j) sc[j] -= mx;  /* -inf stays -inf */
        exp_inplace(sc, end);
        float sum = 0.f;
        for (int k = 0; k < d; ++k) acc[k] = 0.f;
        for (int j = 0; j < end; ++j) {
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

/* ------------------------------------------------------------------ the forward */

/* One layer's weights, as addresses (bf16 unless noted). */
typedef struct {
    const bf16 *ln1, *qkv, *o, *ln2, *gate_up, *down;
} LeanLayer;

/* x [n, H] (embedded input, overwritten with the last layer's residual stream) -> hidden [n, H], the
 * final RMSNorm applied. work: bf16 scratch of n * (H + (nh + 2 nkv) D + nh D + nh D + 3 I) elements;
 * scratch: float32, nthreads * (start + n). Returns 0, or -1 if a head_dim is over 256. */
int lean_forward(const LeanLayer *layers, int num_layers, int hsz, int nh, int nkv, int d, int inter, float eps,
                 const bf16 *norm_w, bf16 *x, int n, const int64_t *pos, int start, bf16 *kcache, bf16 *vcache,
                 int cap, const uint8_t *tree, const bf16 *cos_t, const bf16 *sin_t, bf16 *work, float *scratch,
                 bf16 *hidden, int nthreads) {
    if (d > 256) return -1;
    int qkv_w = (nh + 2 * nkv) * d;
    bf16 *h = work, *qkv = h + (size_t)n * hsz, *q = qkv + (size_t)n * qkv_w, *att = q + (size_t)n * nh * d,
         *gu = att + (size_t)n * nh * d, *act = gu + (size_t)n * 2 * inter;
    float scale = 1.0f / sqrtf((float)d);
    size_t layer_kv = (size_t)nkv * cap * d;
#pragma omp parallel num_threads(nthreads)
    {
        for (int l = 0; l < num_layers; ++l) {
            const LeanLayer *w = layers + l;
            bf16 *kc = kcache + l * layer_kv, *vc = vcache + l * layer_kv;
            rmsnorm_rows(x, w->ln1, n, hsz, eps, h);
            linear_rows(w->qkv, h, n, qkv_w, hsz, qkv, NULL, OUT_BF16);
            rope_rows(qkv, n, nh, nkv, d, pos, cos_t, sin_t, q, kc, vc, cap, start);
            attention_rows(q, kc, vc, n, nh, nkv, d, cap, start, tree, scale, scratch, att);
            linear_rows(w->o, att, n, hsz, nh * d, x, x, OUT_BF16_RESIDUAL);
            rmsnorm_rows(x, w->ln2, n, hsz, eps, h);
            linear_rows(w->gate_up, h, n, 2 * inter, hsz, gu, NULL, OUT_BF16);
            silu_mul_rows(gu, n, inter, act);
            linear_rows(w->down, act, n, hsz, inter, x, x, OUT_BF16_RESIDUAL);
        }
        rmsnorm_rows(x, norm_w, n, hsz, eps, hidden);
    }
    return 0;
}
