/* One-pass kernels of bf16-pure's ``split`` and ``kahan`` rungs (ampkit/step/policies/native.py).

   Each function is bitwise the eager reference in ladder.py (split_fp32, join_split, kahan_split,
   kahan_join); native.py checks that on a probe of edge cases when it loads the library and falls
   back to the eager passes otherwise. No torch headers: plain C99, compiled on first use.

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
#else
#define CLONES
#define CLONES64
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

/* k tensors: x[s] holds n[s] elements of width[s]. With nt > 1 threads (and at least GRAIN elements
   in all) the n[0] + ... + n[k-1] elements are cut into one slice per thread, as the ladder kernels
   are; each thread stops at its own slice's first non-finite block. */
int ampkit_nonfinite(int64_t k, const int64_t *n, const void *const *x, const int32_t *width, int nt) {
    int bad = 0;
#ifdef _OPENMP
    if (nt > 1 && total(k, n) >= GRAIN) {
        int64_t N = total(k, n);
        _Pragma("omp parallel num_threads(nt) reduction(|:bad)")
        {
            int64_t l_, h_;
            slice(N, &l_, &h_);
            SEGMENTS(k, n, l_, h_, { (void)f; if (!bad) bad |= nonfinite_part(x[s], width[s], i, m); })
        }
        return bad;
    }
#else
    (void)nt;
#endif
    for (int64_t s = 0; s < k && !bad; s++) bad = nonfinite_part(x[s], width[s], 0, n[s]);
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
