/* simd.h — internal helpers for the hot loops of kernels/ (not a public API).
 *
 * KVQ_HOT compiles a function for several ISAs (GCC target_clones, chosen at
 * load time by the CPU). The build uses -std=c17, which implies
 * -ffp-contract=off: every clone performs the same fp32 operations in the same
 * order (no FMA contraction, no reassociation), so results are bit-identical
 * on every CPU. kvq_v16 is 16 floats (GCC/Clang vector extension); narrower
 * ISAs split it. Loads and stores go through memcpy (unaligned, alias-safe);
 * vector values are passed through macros, never as function arguments
 * (avoids ABI differences between clones).
 *
 * exp: Cephes expf (S. L. Moshier, Cephes Math Library, expf.c): x = n ln2 + r
 * with a Cody-Waite split of ln2, exp(r) by a degree-7 polynomial, 2^n through
 * the exponent bits; about 1 ulp. Arguments are clamped to [-87, 88] (no
 * denormals or overflow: exp(-87) ~ 1.6e-38 stands in for smaller values).
 * The scalar and vector forms perform identical operations. */
#ifndef KVQ_SIMD_H
#define KVQ_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVQ_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_HOT
#endif

typedef float kvq_v16 __attribute__((vector_size(64)));
typedef int32_t kvq_v16i __attribute__((vector_size(64)));
#define V16_LOAD(dst, p) memcpy(&(dst), (p), sizeof(kvq_v16))
#define V16_STORE(p, src) memcpy((p), &(src), sizeof(kvq_v16))

#define KVQ_EXP_LO -87.0f
#define KVQ_EXP_HI 88.0f

/* y = exp(r-reduced x) body shared by scalar and vector forms; x already clamped */
#define KVQ_EXP_BODY(x, n, r, z, y)                                                                                   \
    r = x * 1.44269504088896341f;                                                                                      \
    n = (r + 12582912.0f) - 12582912.0f; /* round to nearest (|r| < 2^22) */                                         \
    r = x - n * 0.693359375f;                                                                                          \
    r = r - n * -2.12194440e-4f;                                                                                       \
    z = r * r;                                                                                                         \
    y = r * 1.9875691500e-4f + 1.3981999507e-3f;                                                                       \
    y = y * r + 8.3334519073e-3f;                                                                                      \
    y = y * r + 4.1665795894e-2f;                                                                                      \
    y = y * r + 1.6666665459e-1f;                                                                                      \
    y = y * r + 5.0000001201e-1f;                                                                                      \
    y = y * z + r;                                                                                                     \
    y = y + 1.0f;

static inline float kvq_exp_s(float x)
{
    if (x != x) return x;
    x = x < KVQ_EXP_LO ? KVQ_EXP_LO : x;
    x = x > KVQ_EXP_HI ? KVQ_EXP_HI : x;
    float n, r, z, y, p2;
    KVQ_EXP_BODY(x, n, r, z, y)
    int32_t e = ((int32_t)n + 127) * (1 << 23);
    memcpy(&p2, &e, sizeof p2);
    return y * p2;
}

/* out = exp(in) lane-wise (kvq_v16 lvalues); NaN lanes stay NaN. */
#define KVQ_V16_EXP(out, in)                                                                                          \
    do {                                                                                                               \
        kvq_v16 x_ = (in), lo_ = {0}, hi_ = {0}, n_, r_, z_, y_, p2_;                                                 \
        lo_ += KVQ_EXP_LO;                                                                                             \
        hi_ += KVQ_EXP_HI;                                                                                             \
        kvq_v16i mlo_ = x_ < lo_, mhi_ = x_ > hi_, mnan_ = x_ != x_, xi_, li_, hi2_, xin_;                             \
        memcpy(&xi_, &x_, sizeof xi_);                                                                                 \
        xin_ = xi_;                                                                                                    \
        memcpy(&li_, &lo_, sizeof li_);                                                                                \
        memcpy(&hi2_, &hi_, sizeof hi2_);                                                                              \
        xi_ = (xi_ & ~mlo_) | (li_ & mlo_);                                                                            \
        xi_ = (xi_ & ~mhi_) | (hi2_ & mhi_);                                                                           \
        xi_ &= ~mnan_; /* NaN lanes computed as exp(0), then NaN again below: no NaN→int conversion */                 \
        memcpy(&x_, &xi_, sizeof x_);                                                                                  \
        KVQ_EXP_BODY(x_, n_, r_, z_, y_)                                                                               \
        kvq_v16i e_ = (__builtin_convertvector(n_, kvq_v16i) + 127) * (1 << 23);                                      \
        memcpy(&p2_, &e_, sizeof p2_);                                                                                 \
        y_ = y_ * p2_;                                                                                                 \
        memcpy(&e_, &y_, sizeof e_);                                                                                   \
        e_ = (e_ & ~mnan_) | (xin_ & mnan_); /* exp(NaN) = NaN */                                                      \
        memcpy(&(out), &e_, sizeof e_);                                                                                \
    } while (0)

#endif
