/* One-pass kernels of bf16-pure's ``split`` and ``kahan`` rungs (ampkit/step/policies/native.py).

   Each function is bitwise the eager reference in ladder.py (split_fp32, join_split, kahan_split,
   kahan_join); native.py checks that on a probe of edge cases when it loads the library and falls
   back to the eager passes otherwise. No torch headers: plain C99, compiled on first use.

   ``nan``: the bf16 bits torch's fp32 -> bf16 conversion gives every NaN (0xFFFF on x86 builds),
   read from torch at load time. Integer arithmetic is unsigned (wraps like torch's int32 ops). */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(AMPKIT_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline int is_nan(uint32_t u) { return (int32_t)(u & 0x7FFFFFFFu) > 0x7F800000; }

/* torch's fp32 -> bf16: round to nearest even; NaN -> ``nan`` */
static inline uint16_t to_bf16(uint32_t u, uint16_t nan) {
    return is_nan(u) ? nan : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* split: weight = high half + (low half >= 0x8000), remainder = low half as int16 */
CLONES void ampkit_split(const uint32_t *restrict x, uint16_t *restrict hi, uint16_t *restrict rem,
                         int64_t n, uint16_t nan) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = x[i], r = (u + 0x8000u) & 0xFFFF0000u;
        rem[i] = (uint16_t)u;
        hi[i] = is_nan(r) ? nan : (uint16_t)(r >> 16);
    }
}

/* join: (weight << 16) + sign-extended remainder */
CLONES void ampkit_join(const uint16_t *restrict hi, const int16_t *restrict rem, uint32_t *restrict out,
                        int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = ((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)rem[i];
}

/* kahan split: weight = bf16(x), compensation = bf16(x - weight) (the difference exact in fp32) */
CLONES void ampkit_kahan_split(const uint32_t *restrict x, uint16_t *restrict hi, uint16_t *restrict comp,
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
CLONES void ampkit_kahan_join(const uint16_t *restrict hi, const uint16_t *restrict comp,
                              uint32_t *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)hi[i] << 16, b = (uint32_t)comp[i] << 16;
        uint32_t s = as_bits(as_float(a) + as_float(b));
        uint32_t mb = 0u - (uint32_t)is_nan(b), ma = (0u - (uint32_t)is_nan(a)) & ~mb;  /* masks: branch-free */
        out[i] = (s & ~(ma | mb)) | ((b | 0x00400000u) & mb) | ((a | 0x00400000u) & ma);
    }
}
