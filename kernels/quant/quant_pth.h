/* quant_pth.h — vLLM's calibration-free per-token-head KV caches
 * (kv_cache_dtype int8_per_token_head, fp8_per_token_head, int4_per_token_head):
 * every (token, KV head) vector gets its own scale, computed when the token is
 * written; quantize -> dequantize reference primitives.
 *
 * Layout: x[n_tokens][n_kv_heads][head_dim] row-major float32 (quant.h);
 * out may equal in. The first n_sink tokens are copied exact (kvq's +sink).
 *
 * Source (vllm-project/vllm):
 *   int8 / fp8: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py,
 *     _reshape_cache_per_token_head: per (token, head), in float32,
 *       scale = max(absmax(x) / QMAX, 1e-6)          (stored float32)
 *       q     = clamp(x * (1 / scale), QMIN, QMAX)   then tl.store into the cache dtype
 *     int8: QMAX 127, QMIN -128; tl.store's float -> int8 conversion truncates toward
 *       zero (Triton fptosi; vLLM's tests note "INT8 Triton stores truncate"). kvq
 *       truncates likewise ((int)v in C). fp8: QMAX / QMIN = +-448 (E4M3FN on NVIDIA),
 *       the store rounds to nearest even (kernels/quant/quant_fp8.h kvq_fp8_encode).
 *     Read back: q * scale (float32).
 *   int4: vllm/v1/attention/ops/int4_per_token_head.py (reshape_and_cache_int4):
 *     the head vector is first rotated by a randomised Hadamard transform over the
 *     whole head (single_rht: y = H_d (s ⊙ x), H_d the unnormalised Sylvester matrix,
 *     s fixed +-1 signs; head_dim a power of two), then per (token, head), float32:
 *       scale = max((max(y) - min(y)) / 15, 1e-6)
 *       zp    = clamp(round_half_away(-min(y) / scale), 0, 15)
 *       q     = clamp(round_half_away(y * (1 / scale) + zp), 0, 15)   two per byte
 *     the 4-bit zp is hidden in the low 4 mantissa bits of the float32 scale
 *     (bits & ~15 | zp), so the read-back scale is the truncated one:
 *       ŷ = (q - zp) * scale_trunc,   x̂ = s ⊙ (H_d ŷ) / d   (vLLM un-rotates the attention output).
 *     Differences from vLLM: the signs are kvq_rht_sign(0x9E3779B9, d) (hadamard.h), not
 *     torch's CPU bernoulli generator seeded 0x9E3779B9 (another fixed +-1 vector, the same
 *     distribution); vLLM rounds the rotated K/V to the model dtype (bf16) before
 *     quantizing and its CUDA path (hadacore) rotates in bf16; kvq rotates in float32.
 *
 * Stored bits (what vLLM's cache holds per (token, head)): int8 8 + 32/head_dim, fp8
 * 8 + 32/head_dim, int4 4 + 32/head_dim (one float32 scale each; int4's zero point
 * lives inside it).
 */
#ifndef KVQ_QUANT_PTH_H
#define KVQ_QUANT_PTH_H

#include <stddef.h>
#include <stdint.h>

#include "quant.h"
#include "status.h"

#define KVQ_PTH_RHT_SEED 0x9E3779B9ULL /* vLLM's _get_rht_signs seed (round 0), used as kvq's sign seed */

typedef enum { KVQ_PTH_INT8 = 0, KVQ_PTH_FP8 = 1, KVQ_PTH_INT4 = 2 } kvq_pth_kind;

/* Round trip of x[n_tokens][n_kv_heads][head_dim] through the per-token-head cache of
 * kind k. Counts (c may be NULL): n_elems += all, n_sink += the sink tokens'. Errors
 * (KVQ_EINVAL): empty sizes, an unknown kind, int4 with a head_dim that is not a
 * power of two in 2..KVQ_HADAMARD_MAX (vLLM's RHT needs one). */
kvq_status kvq_quant_pth(kvq_pth_kind k, float *out, const float *in, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                         size_t n_sink, kvq_quant_counts *c, kvq_err *err);

/* One int8 / fp8 head vector: codes (int8 values, or fp8 E4M3FN codes) and the float32
 * scale, as the cache stores them (exposed for tests). */
float kvq_pth_int8_encode(const float *x, size_t n, int8_t *q);
float kvq_pth_fp8_encode(const float *x, size_t n, uint8_t *q);
/* One already-rotated int4 head vector y[n]: nibbles q[n] (0..15) and the stored float32
 * scale word (zp in its low 4 mantissa bits). */
float kvq_pth_int4_encode(const float *y, size_t n, uint8_t *q);

#endif
