/* One-pass kernels of bf16-pure's ``split`` and ``kahan`` rungs (ampkit/step/policies/native.py).

   Each function is bitwise the eager reference in ladder.py (split_fp32, join_split, kahan_split,
   kahan_join); native.py checks that on a probe of edge cases when it loads the library and falls
   back to the eager passes otherwise. No torch headers: plain C99, compiled on first use. The
   fused Adam/AdamW step at the end (ampkit_adam) is checked against torch's own fused kernel
   instead (native_adam.py).

   ``nan``: the bf16 bits torch's fp32 -> bf16 conversion gives every NaN (0xFFFF on x86 builds),
   read from torch at load time. Integer arithmetic is unsigned (wraps like torch's int32 ops).

   Threads: compiled with -fopenmp where the compiler can, each kernel splits a large tensor into one
   slice per thread (``nt``: torch.get_num_threads() of the caller). Torch's Linux wheels load
   libgomp.so.1 already, so the dynamic loader resolves this library's libgomp to that one: the kernels
   run on torch's own OpenMP threads. Without OpenMP the pragmas are ignored (one thread). */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* below this many elements a kernel runs on the calling thread (waking threads costs more) */
#define GRAIN 65536

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(AMPKIT_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
/* the stochastic kernel's hash multiplies 64-bit lanes: AVX-512 has them (vpmullq), AVX2 emulates */
#define CLONES64 __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
/* the fused Adam kernel's: x86-64-v3 is AVX2 with FMA (its fmaf one instruction; an "avx2" clone
   calls libm's fmaf per element and does not vectorize: 3-11x slower than the generic step) */
#define CLONES_FMA __attribute__((target_clones("arch=x86-64-v3", "default")))
#define CLONES64_FMA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#define CLONES64
#define CLONES_FMA
#define CLONES64_FMA
#endif

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline int is_nan(uint32_t u) { return (int32_t)(u & 0x7FFFFFFFu) > 0x7F800000; }

/* torch's fp32 -> bf16: round to nearest even; NaN -> ``nan`` */
static inline uint16_t to_bf16(uint32_t u, uint16_t nan) {
    return is_nan(u) ? nan : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* split: weight = high half + (low half >= 0x8000), remainder = low half as int16 */
static CLONES void split_range(const uint32_t *restrict x, uint16_t *restrict hi, uint16_t *restrict rem,
                         int64_t n, uint16_t nan) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = x[i], r = (u + 0x8000u) & 0xFFFF0000u;
        rem[i] = (uint16_t)u;
        hi[i] = is_nan(r) ? nan : (uint16_t)(r >> 16);
    }
}

/* join: (weight << 16) + sign-extended remainder */
static CLONES void join_range(const uint16_t *restrict hi, const int16_t *restrict rem, uint32_t *restrict out,
                        int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = ((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)rem[i];
}

/* kahan split: weight = bf16(x), compensation = bf16(x - weight) (the difference exact in fp32) */
static CLONES void kahan_split_range(const uint32_t *restrict x, uint16_t *restrict hi, uint16_t *restrict comp,
                               int64_t n, uint16_t nan) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = x[i];
        uint16_t h = to_bf16(u, nan);
        hi[i] = h;
        comp[i] = to_bf16(as_bits(as_float(u) - as_float((uint32_t)h << 16)), nan);
    }
}

/* kahan join: weight + compensation in fp32; a NaN operand comes back quieted, the compensation's
   first (torch's add computes b * alpha + a) */
static CLONES void kahan_join_range(const uint16_t *restrict hi, const uint16_t *restrict comp,
                              uint32_t *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)hi[i] << 16, b = (uint32_t)comp[i] << 16;
        uint32_t s = as_bits(as_float(a) + as_float(b));
        uint32_t mb = 0u - (uint32_t)is_nan(b), ma = (0u - (uint32_t)is_nan(a)) & ~mb;  /* masks: branch-free */
        out[i] = (s & ~(ma | mb)) | ((b | 0x00400000u) & mb) | ((a | 0x00400000u) & ma);
    }
}

/* The exported kernels take k tensors at once: the fp32 side is one contiguous run (the chunk's
   buffer: tensor s at offset n[0] + ... + n[s-1]), the 16-bit halves are k separate tensors. The
   n[0] + ... + n[k-1] elements are cut into one equal slice per thread (16-element aligned); each
   thread runs the one-tensor loop over the parts of the tensors its slice covers. */

static int64_t total(int64_t k, const int64_t *n) {
    int64_t t = 0;
    for (int64_t s = 0; s < k; s++) t += n[s];
    return t;
}

#ifdef _OPENMP
/* the calling thread's [lo, hi) of N elements */
static void slice(int64_t N, int64_t *lo, int64_t *hi) {
    int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
    int64_t step = ((N + k - 1) / k + 15) & ~(int64_t)15, a = t * step, b = a + step;
    *lo = a < N ? a : N;
    *hi = b < N ? b : N;
}
#endif

/* for each tensor s overlapping [lo, hi): i = its first element there, m = how many, f = i + its offset */
#define SEGMENTS(k, n, lo, hi, body)                                          \
    {                                                                         \
        int64_t off_ = 0;                                                     \
        for (int64_t s = 0; s < (k) && off_ < (hi); off_ += (n)[s], s++) {    \
            int64_t a_ = (lo) > off_ ? (lo) : off_;                           \
            int64_t b_ = (hi) < off_ + (n)[s] ? (hi) : off_ + (n)[s];         \
            if (a_ < b_) { int64_t i = a_ - off_, m = b_ - a_, f = a_; body; } \
        }                                                                     \
    }

#ifdef _OPENMP
#define PARALLEL(nt, k, n, body)                                                    \
    {                                                                               \
        int64_t N = total(k, n);                                                    \
        if ((nt) > 1 && N >= GRAIN) {                                               \
            _Pragma("omp parallel num_threads(nt)")                                 \
            { int64_t l_, h_; slice(N, &l_, &h_); SEGMENTS(k, n, l_, h_, body) }    \
        } else SEGMENTS(k, n, 0, N, body)                                           \
    }
#else
#define PARALLEL(nt, k, n, body) { (void)(nt); SEGMENTS(k, n, 0, total(k, n), body) }
#endif

void ampkit_split(int64_t k, const int64_t *n, const uint32_t *x, uint16_t *const *hi, uint16_t *const *rem,
                  uint16_t nan, int nt) {
    PARALLEL(nt, k, n, split_range(x + f, hi[s] + i, rem[s] + i, m, nan))
}

void ampkit_join(int64_t k, const int64_t *n, uint32_t *out, const uint16_t *const *hi,
                 const int16_t *const *rem, int nt) {
    PARALLEL(nt, k, n, join_range(hi[s] + i, rem[s] + i, out + f, m))
}

void ampkit_kahan_split(int64_t k, const int64_t *n, const uint32_t *x, uint16_t *const *hi,
                        uint16_t *const *comp, uint16_t nan, int nt) {
    PARALLEL(nt, k, n, kahan_split_range(x + f, hi[s] + i, comp[s] + i, m, nan))
}

void ampkit_kahan_join(int64_t k, const int64_t *n, uint32_t *out, const uint16_t *const *hi,
                       const uint16_t *const *comp, int nt) {
    PARALLEL(nt, k, n, kahan_join_range(hi[s] + i, comp[s] + i, out + f, m))
}

/* Stochastic rounding fp32 -> bf16 (the stochastic rung's weights, bf16 optimizer states): the 16
   random bits r of an element are added to its fp32 bits and the top 16 kept (rounds up with
   probability equal to the dropped fraction); a NaN gives ``nan``. The bits are a counter-based
   stream: element g of a call (counted across its tensors) takes 16-bit part g % 4 (the lowest
   first) of splitmix64(key + (g / 4 + 1) * GAMMA), so they are a function of (key, g) alone --
   bitwise the same on any thread count, and the eager reference (pure/eager.py) computes them
   with torch's int64 ops. */
#define GAMMA 0x9E3779B97F4A7C15ull

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint16_t sround(uint32_t u, uint32_t r, uint16_t nan) {
    return is_nan(u) ? nan : (uint16_t)((u + r) >> 16);
}

/* elements [0, m) of x / out, the first one element g of the call: per block, the block's words
   first (one hash per 4 elements, a loop over 64-bit lanes), then the elements, each taking its
   16-bit part of the words read as uint16 (little-endian: the lowest part first) */
#define SBLOCK 1024
static CLONES64 void stochastic_range(const uint32_t *restrict x, uint16_t *restrict out, int64_t m,
                                    uint64_t key, int64_t g, uint16_t nan) {
    uint64_t h[SBLOCK / 4 + 1];
    uint16_t bits[SBLOCK + 4]; /* h's 16-bit parts, copied (reading h through a uint16_t* would
                                  break C's aliasing rule) */
    for (int64_t i = 0; i < m; i += SBLOCK) {
        int64_t len = m - i < SBLOCK ? m - i : SBLOCK, a = (g + i) & 3, words = (a + len + 3) >> 2;
        uint64_t c = (uint64_t)((g + i) >> 2) + 1;
        for (int64_t w = 0; w < words; w++) h[w] = mix64(key + (c + (uint64_t)w) * GAMMA);
        memcpy(bits, h, (size_t)words * sizeof(uint64_t));
        const uint16_t *r = bits + a;
        const uint32_t *xs = x + i;
        uint16_t *os = out + i;
        for (int64_t j = 0; j < len; j++) os[j] = sround(xs[j], r[j], nan);
    }
}

/* k tensors: x[s] (fp32) into out[s] (bf16), n[s] elements each; the counter runs across them */
void ampkit_stochastic(int64_t k, const int64_t *n, const uint32_t *const *x, uint16_t *const *out,
                       uint64_t key, uint16_t nan, int nt) {
    PARALLEL(nt, k, n, stochastic_range(x[s] + i, out[s] + i, m, key, f, nan))
}

/* The CPU finite check (step/gradcheck.py): 1 if any element is inf or NaN, i.e. has every exponent
   bit set (fp32 0x7F800000, bf16 0x7F80, fp16 0x7C00, fp64 0x7FF0000000000000), else 0. Each tensor is
   read once, in blocks whose flags are OR-ed branch-free (so the loop vectorizes) with an early exit
   between blocks. (Tried, not faster here: a max over the magnitude bits, 64 accumulators, an
   x86-64-v4 clone; the loop runs at the cache's bandwidth, docs/benchmarks.md.) */
static CLONES int nonfinite32(const uint32_t *restrict x, int64_t n) {
    int64_t i = 0;
    for (; i + 512 <= n; i += 512) {
        uint32_t a = 0;
        for (int j = 0; j < 512; j++) a |= (x[i + j] & 0x7F800000u) == 0x7F800000u;
        if (a) return 1;
    }
    uint32_t a = 0;
    for (; i < n; i++) a |= (x[i] & 0x7F800000u) == 0x7F800000u;
    return a != 0;
}

static CLONES int nonfinite16(const uint16_t *restrict x, int64_t n, uint16_t e) {
    int64_t i = 0;
    for (; i + 1024 <= n; i += 1024) {
        uint16_t a = 0;
        for (int j = 0; j < 1024; j++) a |= (uint16_t)((x[i + j] & e) == e);
        if (a) return 1;
    }
    uint16_t a = 0;
    for (; i < n; i++) a |= (uint16_t)((x[i] & e) == e);
    return a != 0;
}

static CLONES int nonfinite64(const uint64_t *restrict x, int64_t n) {
    const uint64_t e = 0x7FF0000000000000u;
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        uint64_t a = 0;
        for (int j = 0; j < 256; j++) a |= (x[i + j] & e) == e;
        if (a) return 1;
    }
    uint64_t a = 0;
    for (; i < n; i++) a |= (x[i] & e) == e;
    return a != 0;
}

/* elements [i, i + m) of x, of width w (0: fp32, 1: bf16, 2: fp16, 3: fp64) */
static int nonfinite_part(const void *x, int32_t w, int64_t i, int64_t m) {
    switch (w) {
    case 0: return nonfinite32((const uint32_t *)x + i, m);
    case 1: return nonfinite16((const uint16_t *)x + i, m, 0x7F80u);
    case 2: return nonfinite16((const uint16_t *)x + i, m, 0x7C00u);
    default: return nonfinite64((const uint64_t *)x + i, m);
    }
}

/* k tensors packed in one array a of 3k int64 (one ctypes array per call: the step's cheapest
   call): a[s] elements at address a[k + s], of width a[2k + s]. With nt > 1 threads (and at least
   GRAIN elements in all) the a[0] + ... + a[k-1] elements are cut into one slice per thread, as the
   ladder kernels are; each thread stops at its own slice's first non-finite block. */
#define NF_PTR(a, k, s) ((const void *)(uintptr_t)(a)[(k) + (s)])
#define NF_WIDTH(a, k, s) ((int32_t)(a)[2 * (k) + (s)])
int ampkit_nonfinite(int64_t k, const int64_t *a, int nt) {
    const int64_t *n = a;
    int bad = 0;
#ifdef _OPENMP
    if (nt > 1 && total(k, n) >= GRAIN) {
        int64_t N = total(k, n);
        _Pragma("omp parallel num_threads(nt) reduction(|:bad)")
        {
            int64_t l_, h_;
            slice(N, &l_, &h_);
            SEGMENTS(k, n, l_, h_, { (void)f; if (!bad) bad |= nonfinite_part(NF_PTR(a, k, s), NF_WIDTH(a, k, s), i, m); })
        }
        return bad;
    }
#else
    (void)nt;
#endif
    for (int64_t s = 0; s < k && !bad; s++) bad = nonfinite_part(NF_PTR(a, k, s), NF_WIDTH(a, k, s), 0, n[s]);
    return bad;
}

/* 1 when compiled with OpenMP (native.py reports it) */
int ampkit_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Fused Adam/AdamW on the ladder's own storage (native_adam.py): one pass per element reads the
   rung's weight (bf16 + int16 remainder for ``split``, bf16 for ``stochastic``, the fp32 master for
   ``fp32``), the fp32 gradient and the states (bf16 or fp32), steps them as torch's CPU fused kernel
   does (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, the fp32 path) and writes the rung's form back:
   the split, stochastic rounding (weights: key ``kw``, element counter ``wofs[s] + i``; states: key
   ``ks``, exp_avg at ``sofs[s] + i``, exp_avg_sq at ``sofs[s] + n[s] + i``, the streams of
   ``ampkit_stochastic``) or the master and its bf16 copy. Bitwise the widen -> torch fused step ->
   round-back path only where torch's binary computes what this one does: the operation order and
   FMA contractions below are those found in torch 2.13's x86-64 build (its GCC contracted
   ``a * b + c`` into one rounding); native_adam.py checks the kernel against torch's own kernel at
   load and never uses it otherwise. -ffp-contract=off here: every fused multiply-add is an
   explicit fmaf.

   Per element, with torch's scalars (doubles rounded to float, as torch does): g = grad; Adam with
   weight decay: g = fma(p, wd, g); AdamW: p = p * (1 - lr wd); m = fma(coeff, g - m, base)
   (torch's lerp: coeff, base = w, m when |w| < 0.5 else w - 1, g; -(1 - w) in the tail; w =
   1 - beta1); v: fma(c2 g, g, v beta2) in torch's vector loop, fma(v, beta2, c2 g g) in its
   scalar tail (the last n % vl elements of each tensor); denom = sqrt(v) / sqrt(bc2) + eps;
   p = p + (-step_size m) / denom. Where two NaNs meet in one operation, the one torch's binary
   returns (nan2). */
#include <math.h>

typedef struct {
    float nss, dec, wd, w, coeff, tcoeff, c2, b2, bc2s, eps;
    uint32_t small, adam_wd; /* all ones or zero: masks of sel */
} adam_k;

/* torch's scalars of one tensor: hp = lr, beta1, beta2, eps, weight_decay, step (doubles); flags
   bit 0: AdamW (decoupled decay; never ``maximize``: native_adam.covers); dfma: 1 - lr * wd as one
   fused multiply-add */
static adam_k adam_scalars(const double *hp, int32_t flags, int dfma) {
    double lr = hp[0], beta1 = hp[1], beta2 = hp[2], eps = hp[3], wd = hp[4], step = hp[5];
    double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
    adam_k c;
    c.nss = (float)(-(lr / bc1));
    c.dec = (flags & 1) && wd != 0 ? (float)(dfma ? fma(-lr, wd, 1.0) : 1 - lr * wd) : 1.0f;
    c.wd = (float)wd;
    c.w = (float)(1 - beta1);
    c.small = fabsf(c.w) < 0.5f ? ~0u : 0u;
    c.coeff = c.small ? c.w : c.w - 1.0f;
    c.tcoeff = c.small ? c.w : -(1.0f - c.w); /* the tail's g - (g - m)(1 - w): -0 where w = 1 */
    c.c2 = (float)(1 - beta2);
    c.b2 = (float)beta2;
    c.bc2s = (float)sqrt(bc2);
    c.eps = (float)eps;
    c.adam_wd = !(flags & 1) && wd != 0 ? ~0u : 0u;
    return c;
}

/* the 16 random bits of elements [g, g + len) of a stochastic stream into r[0..len) */
static inline void random16(uint64_t key, int64_t g, int64_t len, uint16_t *r, uint64_t *h) {
    int64_t a = g & 3, words = (a + len + 3) >> 2;
    uint64_t c = (uint64_t)(g >> 2) + 1;
    for (int64_t w = 0; w < words; w++) h[w] = mix64(key + (c + (uint64_t)w) * GAMMA);
    uint16_t tmp[4 * (SBLOCK / 4 + 1)];
    memcpy(tmp, h, (size_t)words * sizeof(uint64_t));
    memcpy(r, tmp + a, (size_t)len * sizeof(uint16_t));
}

/* a where the mask is all ones, else b (branch-free: the loop stays one vector loop) */
static inline float sel(uint32_t mask, float a, float b) {
    return as_float((as_bits(a) & mask) | (as_bits(b) & ~mask));
}

/* ``r`` = op(a, b), or where a and b are both NaN, the first of them quieted: which NaN an x86
   operation returns depends on its operands' order in the instruction, which the compiler picks;
   these fix torch's (found by probing it with NaNs of distinct payloads in every input) */
#define NAN2(r, a, b) (exact ? nan2(r, a, b) : (r))
static inline float nan2(float r, float a, float b) {
    uint32_t ua = as_bits(a), ub = as_bits(b), ma = 0u - (uint32_t)is_nan(ua);
    uint32_t mb = (0u - (uint32_t)is_nan(ub)) & ~ma;
    uint32_t q = ((ua | 0x00400000u) & ma) | ((ub | 0x00400000u) & mb);
    return as_float((as_bits(r) & ~(ma | mb)) | q);
}

/* weight kinds: 0 the fp32 master (+ its bf16 copy), 1 split (bf16 + int16 remainder), 2 stochastic
   (bf16); state kinds: 0 fp32, 1 bf16 (stochastic) */
static inline __attribute__((always_inline)) void adam_block(
    const adam_k *c, const int tail, const int exact, const int wk, const int sk, int64_t len,
    void *w, void *wx, const float *restrict g, void *m, void *v, const uint16_t *restrict rw,
    const uint16_t *restrict rm, const uint16_t *restrict rv, uint16_t nan) {
    const adam_k k = *c; /* (locals: the stores below cannot alias them) */
    for (int64_t j = 0; j < len; j++) {
        uint32_t pu;
        if (wk == 0) pu = as_bits(((const float *)w)[j]);
        else if (wk == 1)
            pu = ((uint32_t)((const uint16_t *)w)[j] << 16) +
                 (uint32_t)(int32_t)((const int16_t *)wx)[j];
        else pu = (uint32_t)((const uint16_t *)w)[j] << 16;
        float p = as_float(pu), gr = g[j], mm, vv;
        if (sk == 0) { mm = ((const float *)m)[j]; vv = ((const float *)v)[j]; }
        else {
            mm = as_float((uint32_t)((const uint16_t *)m)[j] << 16);
            vv = as_float((uint32_t)((const uint16_t *)v)[j] << 16);
        }
        gr = sel(k.adam_wd, NAN2(fmaf(p, k.wd, gr), p, gr), gr);
        p = p * k.dec; /* (1 unless AdamW decays: exact, and a NaN stays itself) */
        float d = NAN2(gr - mm, gr, mm), base = sel(k.small, mm, gr);
        mm = NAN2(fmaf(tail ? k.tcoeff : k.coeff, d, base), d, base);
        float gs = k.c2 * gr;
        if (tail) { float gg = gs * gr; vv = NAN2(fmaf(vv, k.b2, gg), vv, gg); }
        else { float vb = vv * k.b2; vv = NAN2(fmaf(gs, gr, vb), gs, vb); }
        float denom = sqrtf(vv) / k.bc2s + k.eps, num = k.nss * mm;
        float t = NAN2(num / denom, num, denom);
        p = tail ? NAN2(p + t, p, t) : NAN2(p + t, t, p);
        uint32_t u = as_bits(p);
        if (wk == 0) { ((float *)w)[j] = p; ((uint16_t *)wx)[j] = to_bf16(u, nan); }
        else if (wk == 1) {
            uint32_t r = (u + 0x8000u) & 0xFFFF0000u;
            ((uint16_t *)wx)[j] = (uint16_t)u;
            ((uint16_t *)w)[j] = is_nan(r) ? nan : (uint16_t)(r >> 16);
        } else ((uint16_t *)w)[j] = sround(u, rw[j], nan);
        if (sk == 0) { ((float *)m)[j] = mm; ((float *)v)[j] = vv; }
        else {
            ((uint16_t *)m)[j] = sround(as_bits(mm), rm[j], nan);
            ((uint16_t *)v)[j] = sround(as_bits(vv), rv[j], nan);
        }
    }
}

/* the NaN-ordered loop, one per kind (x86-64-v3 at most: it runs on blocks with a non-finite input
   and on the tails only, and fewer clones keep the first compile short) */
#define ADAM_EXACT(WK, SK)                                                                          \
    static CLONES_FMA __attribute__((noinline)) void adam_exact_##WK##SK(                               \
        const adam_k *c, int tail, int64_t len, void *w, void *wx, const float *g, void *m,         \
        void *v, const uint16_t *rw, const uint16_t *rm, const uint16_t *rv, uint16_t nan) {       \
        if (tail) adam_block(c, 1, 1, WK, SK, len, w, wx, g, m, v, rw, rm, rv, nan);                \
        else adam_block(c, 0, 1, WK, SK, len, w, wx, g, m, v, rw, rm, rv, nan);                     \
    }
ADAM_EXACT(0, 0)
ADAM_EXACT(0, 1)
ADAM_EXACT(1, 0)
ADAM_EXACT(1, 1)
ADAM_EXACT(2, 0)
ADAM_EXACT(2, 1)

typedef void (*adam_exact_fn)(const adam_k *, int, int64_t, void *, void *, const float *, void *,
                              void *, const uint16_t *, const uint16_t *, const uint16_t *, uint16_t);
static const adam_exact_fn adam_exacts[3][2] = {
    {adam_exact_00, adam_exact_01}, {adam_exact_10, adam_exact_11}, {adam_exact_20, adam_exact_21}};

/* whether elements [0, len) hold an infinity or a NaN in any input (bf16: exponent 0x7F80; the
   split pair: the joined fp32 value's, since a NaN whose low half is >= 0x8000 and whose other
   mantissa bits are all set splits into a weight of +-0 or 0x8000): only then can two different
   NaNs meet in one operation (the NaNs the arithmetic makes itself, inf - inf and the like, are
   all x86's one default NaN) */
static inline __attribute__((always_inline)) int block_nonfinite(
    const int wk, const int sk, int64_t len, const void *w, const void *wx,
    const float *restrict g, const void *m, const void *v) {
    uint32_t bad = 0;
    for (int64_t j = 0; j < len; j++) {
        uint32_t e = (as_bits(g[j]) & 0x7F800000u) == 0x7F800000u;
        if (wk == 0) e |= (((const uint32_t *)w)[j] & 0x7F800000u) == 0x7F800000u;
        else if (wk == 1)
            e |= ((((uint32_t)((const uint16_t *)w)[j] << 16) +
                   (uint32_t)(int32_t)((const int16_t *)wx)[j]) & 0x7F800000u) == 0x7F800000u;
        else e |= (((const uint16_t *)w)[j] & 0x7F80u) == 0x7F80u;
        if (sk == 0)
            e |= ((((const uint32_t *)m)[j] & 0x7F800000u) == 0x7F800000u) |
                 ((((const uint32_t *)v)[j] & 0x7F800000u) == 0x7F800000u);
        else
            e |= ((((const uint16_t *)m)[j] & 0x7F80u) == 0x7F80u) |
                 ((((const uint16_t *)v)[j] & 0x7F80u) == 0x7F80u);
        bad |= e;
    }
    return bad != 0;
}

#define AB 512 /* elements per block (the random bits of a block sit on the stack) */

/* elements [i, i + cnt) of tensor s, of n elements (its tail from n - n % vl) */
static inline __attribute__((always_inline)) void adam_part(
    const adam_k *c, const int wk, const int sk, int64_t i, int64_t cnt, int64_t n, int vl,
    void *w, void *wx, const float *g, void *m, void *v, int64_t wofs, int64_t sofs,
    uint64_t kw, uint64_t ks, uint16_t nan) {
    uint16_t rw[AB], rm[AB], rv[AB];
    uint64_t h[AB / 4 + 1];
    int64_t t0 = n - n % vl, end = i + cnt;
    size_t ws = wk == 0 ? 4 : 2, ss = sk == 0 ? 4 : 2;
    while (i < end) {
        int tail = i >= t0;
        int64_t stop = tail || end <= t0 ? end : t0, len = stop - i < AB ? stop - i : AB;
        if (wk == 2) random16(kw, wofs + i, len, rw, h);
        if (sk == 1) { random16(ks, sofs + i, len, rm, h); random16(ks, sofs + n + i, len, rv, h); }
        char *wp = (char *)w + (size_t)i * ws, *xp = wx ? (char *)wx + (size_t)i * 2 : NULL;
        char *mp = (char *)m + (size_t)i * ss, *vp = (char *)v + (size_t)i * ss;
        /* the NaN order only where a block has a non-finite input, and in the short tails: there
           one loop for every kind (rare: kept out of the specialized clones, for compile time) */
        if (tail || block_nonfinite(wk, sk, len, wp, xp, g + i, mp, vp))
            adam_exacts[wk][sk](c, tail, len, wp, xp, g + i, mp, vp, wk == 2 ? rw : NULL,
                                sk ? rm : NULL, sk ? rv : NULL, nan);
        else adam_block(c, 0, 0, wk, sk, len, wp, xp, g + i, mp, vp, rw, rm, rv, nan);
        i += len;
    }
}

#define ADAM_KIND(WK, SK) \
    static CLONES64_FMA void adam_##WK##SK(const adam_k *c, int64_t i, int64_t cnt, int64_t n, int vl, \
        void *w, void *wx, const float *g, void *m, void *v, int64_t wofs, int64_t sofs,          \
        uint64_t kw, uint64_t ks, uint16_t nan) {                                                 \
        adam_part(c, WK, SK, i, cnt, n, vl, w, wx, g, m, v, wofs, sofs, kw, ks, nan);             \
    }
ADAM_KIND(0, 0)
ADAM_KIND(0, 1)
ADAM_KIND(1, 0)
ADAM_KIND(1, 1)
ADAM_KIND(2, 0)
ADAM_KIND(2, 1)

typedef void (*adam_fn)(const adam_k *, int64_t, int64_t, int64_t, int, void *, void *, const float *,
                        void *, void *, int64_t, int64_t, uint64_t, uint64_t, uint16_t);

/* k tensors of n[s] elements: w/wx the weight's parts (wx: the remainders for split, the bf16 model
   weight for the fp32 master, unused for stochastic), g the fp32 gradients, m/v the states; hp six
   doubles and flags one int per tensor (adam_scalars); wk/sk the kinds; vl torch's vector width */
void ampkit_adam(int64_t k, const int64_t *n, void *const *w, void *const *wx, const float *const *g,
                 void *const *em, void *const *ev, const double *hp, const int32_t *flags,
                 const int64_t *wofs, const int64_t *sofs, int32_t wk, int32_t sk, uint64_t kw,
                 uint64_t ks, int32_t vl, int32_t dfma, uint16_t nan, int nt) {
    static const adam_fn fns[3][2] = {{adam_00, adam_01}, {adam_10, adam_11}, {adam_20, adam_21}};
    adam_fn fn = fns[wk][sk];
    PARALLEL(nt, k, n, {
        (void)f;
        adam_k c = adam_scalars(hp + 6 * s, flags[s], dfma);
        fn(&c, i, m, n[s], vl, w[s], wx ? wx[s] : NULL, g[s], em[s], ev[s], wofs[s], sofs[s], kw, ks,
           nan);
    })
}

/* Which of ampkit_adam's loops runs on this CPU: 2 the x86-64-v4 (AVX-512) clone, 1 x86-64-v3 (AVX2
   and FMA), 0 none with a fused multiply-add instruction (each fmaf a libm call: slower than the
   generic step; native_adam.faster) */
int ampkit_adam_isa(void) {
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(AMPKIT_NO_CLONES)
    __builtin_cpu_init();
#if !defined(__clang__) && __GNUC__ >= 12
    return __builtin_cpu_supports("x86-64-v4") ? 2 : __builtin_cpu_supports("x86-64-v3") ? 1 : 0;
#else
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#endif
#elif defined(__AVX512F__) && defined(__AVX512VL__)
    return 2;
#elif defined(__FMA__) || defined(__FP_FAST_FMAF)
    return 1;
#else
    return 0;
#endif
}
