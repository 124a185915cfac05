/* hadamard.h — the orthonormal Walsh–Hadamard rotation of cached key / value
 * vectors (the `+hadamard` and `+rht` scheme modifiers, kernels/schemes/scheme.h),
 * as a fast in-place transform, O(d log d) per vector.
 *
 * Layout: one layer's keys or values x[n_tokens][kv_dim] row-major float32,
 * kv_dim = n_kv_heads * head_dim, channel c = h * head_dim + d. Every head
 * vector x[t][h][0..head_dim) is split into contiguous blocks of `block`
 * channels and each block b (a row vector) is replaced by
 *     hadamard:  b · H_n                 (H_n symmetric, H_n · H_n = I)
 *     rht:       (b ⊙ s) · H_n           (s = ±1 signs, one per channel d of head_dim)
 * and the inverse by
 *     hadamard:  y · H_n                 (H_n is its own inverse)
 *     rht:       (y · H_n) ⊙ s
 * H_n = the Sylvester Hadamard matrix of order n (a power of two), scaled by
 * 1/sqrt(n): H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2), i.e.
 * H_n[i][j] = (-1)^popcount(i & j) / sqrt(n), natural (Sylvester) order.
 *
 * Source and what kvq matches: llama.cpp's KV-cache rotation (ggml-org/llama.cpp
 * PR #21038, src/llama-kv-cache.cpp: ggml_gen_hadamard builds exactly this
 * normalised Sylvester matrix; llama_mul_mat_hadamard reshapes each head's
 * rows into blocks of nrot and multiplies by it; build_input_k_rot /
 * build_input_v_rot choose nrot). llama.cpp rotates a side only when its cache
 * type is quantized and head_dim % 64 == 0; the key block is the largest
 * power of two (>= 64) dividing head_dim, the value block is always 64
 * ("smaller rotation matrices for V seem beneficial"). kvq uses the same
 * blocks whenever head_dim % 64 == 0 (kvq_hadamard_block). Where llama.cpp
 * would not rotate (head_dim % 64 != 0) kvq still rotates, as an extension:
 * key block = the largest power of two dividing head_dim, value block = the
 * smaller of that and 64; a head_dim without a factor 2 is refused (no
 * rotation exists). llama.cpp rotates q and the post-RoPE k (and v, then
 * un-rotates the attention output); since H is orthonormal that equals
 * caching Q(x·H) and reading back Q(x·H)·Hᵀ, which is what kvq simulates.
 * The random-sign variant (`+rht`) is QuaRot's randomised Hadamard
 * (Ashkboos et al., arXiv 2404.00456, §3: H·diag(s)), as TurboQuant-style
 * caches rotate: signs s_d from a 64-bit seed (kvq_rht_sign), the same for
 * every layer, KV head and side.
 *
 * Numerics: butterflies in double from the float32 inputs, scaled by
 * 1/sqrt(n) and rounded once to float32 (quant.h "Numerics"). Rotation adds
 * no stored bits: the matrix is fixed and the signs are a seed.
 */
#ifndef KVQ_HADAMARD_H
#define KVQ_HADAMARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* The largest block (and head_dim) the fast transform takes. */
#define KVQ_HADAMARD_MAX 4096

typedef enum {
    KVQ_ROT_NONE = 0,
    KVQ_ROT_HADAMARD = 1, /* +hadamard: llama.cpp's orthonormal Walsh–Hadamard blocks */
    KVQ_ROT_RHT = 2,      /* +rht[<seed>]: random signs then the same blocks (QuaRot) */
} kvq_rot_kind;

/* A rotation of cached vectors; {KVQ_ROT_NONE, 0} (all zero) is none. */
typedef struct {
    kvq_rot_kind kind;
    uint64_t seed; /* KVQ_ROT_RHT: the seed of the signs (0 when written as plain "+rht") */
} kvq_rotation;

/* In-place orthonormal fast Walsh–Hadamard transform of x[n]: x ← x · H_n.
 * n must be a power of two in 1..KVQ_HADAMARD_MAX (unchecked). */
void kvq_fwht(float *x, size_t n);

/* Block size along head_dim for side 'k' or 'v' (see the header); 0 when
 * head_dim has no factor 2 or exceeds KVQ_HADAMARD_MAX (no rotation). */
size_t kvq_hadamard_block(size_t head_dim, char side);

/* The sign s_d (+1 or -1) of channel d under seed (splitmix64 of seed and d). */
int kvq_rht_sign(uint64_t seed, size_t d);

/* Rotate (inverse = false) or un-rotate (inverse = true) every head vector of
 * x[n_tokens][kv_dim] in place (layout above). KVQ_ROT_NONE leaves x as it
 * is. Errors (KVQ_EINVAL): head_dim 0 or not dividing kv_dim, no block
 * (kvq_hadamard_block == 0), side not 'k' / 'v', an unknown kind. */
kvq_status kvq_rotation_apply(const kvq_rotation *r, float *x, size_t n_tokens, size_t kv_dim, size_t head_dim, char side,
                              bool inverse, kvq_err *err);

/* Check that the rotation applies to head_dim (the rule named in the error:
 * "+hadamard: head_dim 30 has no power-of-two block >= 2 ..."). */
kvq_status kvq_rotation_check(const kvq_rotation *r, size_t head_dim, kvq_err *err);

/* The spec modifier: "+hadamard", "+rht" (seed 0) or "+rht<seed>"; "" for none. */
void kvq_rotation_spec(const kvq_rotation *r, char *buf, size_t n);
/* The artifact's kvq.rotation value: "none", "hadamard" or "rht". */
const char *kvq_rotation_kind_name(kvq_rot_kind k);
/* The inverse of kvq_rotation_kind_name; false for an unknown name. */
bool kvq_rotation_kind_parse(const char *name, kvq_rot_kind *out);
/* Same rotation (kind, and the seed for rht)? */
bool kvq_rotation_equal(const kvq_rotation *a, const kvq_rotation *b);
/* For messages: "unrotated", "hadamard-rotated", "rht-rotated (seed 7)". */
void kvq_rotation_describe(const kvq_rotation *r, char *buf, size_t n);

#endif
