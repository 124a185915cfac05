/* quant_fp8.h — FP8 KV-cache formats (E4M3FN, E5M2) as exact
 * quantize -> dequantize primitives, scaled per tensor or per KV head as
 * vLLM's FP8 cache does, plus scale calibration helpers.
 *
 * Formats (OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, 2023;
 * same bit patterns as ml_dtypes float8_e4m3fn / float8_e5m2 and PyTorch
 * torch.float8_e4m3fn / torch.float8_e5m2), code = s eeee mmm / s eeeee mm:
 *   E4M3FN bias 7, no infinities, NaN = s.1111.111 (0x7F/0xFF), max finite
 *          448 (0x7E), min normal 2^-6, subnormals m*2^-9 (min 2^-9).
 *   E5M2   bias 15, IEEE-like: inf = s.11111.00, NaN = s.11111.{01,10,11},
 *          max finite 57344 (0x7B), min normal 2^-14, subnormals m*2^-16.
 *
 * Encoding (fp32 -> 8 bit), as vLLM's cache writes it: round to nearest,
 * ties to even, of the float32 value; magnitudes beyond the largest finite
 * value saturate to +-448 / +-57344 (vLLM clamps to +-max before the cast,
 * or converts with CUDA __NV_SATFINITE; a plain PyTorch `.to(float8_*)` or
 * ml_dtypes cast would give NaN (E4M3FN) / inf (E5M2) instead). Consequently
 * a finite input never gives NaN or inf, +-inf saturates to +-max, and a NaN
 * input gives the NaN code (0x7F E4M3FN, 0x7E E5M2, sign kept). Signed
 * zeros are kept (-0.0 -> 0x80); underflow keeps the sign.
 * Decoding is exact (every code is a float32 value).
 *
 * Scaling (vLLM csrc/quantization/fp8 quant_utils "Convention of the scale":
 * FP8 = Quantize(HP / scale), HP = Dequant(FP8) * scale): the quotient x/s
 * is computed in float32 and then encoded; the dequantized value is
 * decode(code) * s in float32 (vLLM then converts it to the model dtype, a
 * rounding kvq does not model). Scale 1.0 everywhere is the engine default
 * (`kv_cache_dtype="fp8"` without calibrated scales).
 *
 * KV layout: [n_tokens][n_kv_heads][head_dim] float32, row-major.
 */
#ifndef KVQ_QUANT_FP8_H
#define KVQ_QUANT_FP8_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
    KVQ_FP8_E4M3FN = 0, /* vLLM kv_cache_dtype "fp8" / "fp8_e4m3" on NVIDIA */
    KVQ_FP8_E5M2 = 1    /* vLLM kv_cache_dtype "fp8_e5m2" */
} kvq_fp8_format;

/* Largest finite magnitude: 448 (E4M3FN), 57344 (E5M2). */
float kvq_fp8_max(kvq_fp8_format f);
/* The smallest |x / s| that saturates: the rounding midpoint above the largest
 * finite value (448 + 32/2 = 464 for E4M3FN, 57344 + 8192/2 = 61440 for E5M2);
 * below it round-to-nearest gives the largest value anyway. */
float kvq_fp8_saturation_edge(kvq_fp8_format f);
/* How many elements of x[n_tokens][n_kv_heads][head_dim] a round trip with
 * scales (1 or n_kv_heads) saturates: |x / s_h| >= kvq_fp8_saturation_edge. */
uint64_t kvq_fp8_count_saturated(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim,
                                 const float *scales, size_t n_scales);
/* "e4m3fn" / "e5m2" */
const char *kvq_fp8_name(kvq_fp8_format f);

/* Encode one float32 (round to nearest even, saturating; see above). */
uint8_t kvq_fp8_encode(kvq_fp8_format f, float x);
/* Decode one code exactly (NaN codes -> quiet NaN with the code's sign,
 * E5M2 inf codes -> +-inf). */
float kvq_fp8_decode(kvq_fp8_format f, uint8_t code);

/* Per-tensor (n_scales == 1) or per-KV-head (n_scales == n_kv_heads) scale
 * granularity of the round-trip below. */

/* Round trip of a K or V block x[n_tokens][n_kv_heads][head_dim]:
 * y = decode(encode(x / s_h)) * s_h with s_h = scales[0] (n_scales 1) or
 * scales[h] (n_scales == n_kv_heads). y may equal x. Errors: KVQ_EINVAL for
 * empty sizes, n_scales not 1 or n_kv_heads, a scale that is not finite and
 * > 0 (its index named); KVQ_ENOMEM on size overflow. NaN inputs stay NaN
 * (they are passed through the NaN code, never rejected). */
kvq_status kvq_fp8_kv_roundtrip(kvq_fp8_format f, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, const float *scales, size_t n_scales, kvq_err *err);

/* The same, producing the stored codes codes[n_tokens][n_kv_heads][head_dim]
 * (what the engine's cache holds) instead of the dequantized values. */
kvq_status kvq_fp8_kv_quantize(kvq_fp8_format f, const float *x, uint8_t *codes, size_t n_tokens,
                               size_t n_kv_heads, size_t head_dim, const float *scales, size_t n_scales,
                               kvq_err *err);

/* Effective storage bits per cached element with n_scales float32 scales
 * for one K (or V) tensor of n_tokens*n_kv_heads*head_dim elements:
 * 8 + 32*n_scales / (n_tokens*n_kv_heads*head_dim). vLLM stores k_scale /
 * v_scale as float32 (one per layer, or [n_kv_heads]); the scale overhead
 * is amortised over the cached tokens (0 when n_tokens is 0: returns 8). */
double kvq_fp8_bits_per_element(size_t n_scales, size_t n_tokens, size_t n_kv_heads, size_t head_dim);

/* ---- scale calibration (pure functions over x[n_tokens][n_kv_heads][head_dim]) ----
 * scale = stat(|x|) / fmt_max, so that the statistic maps to the largest
 * finite FP8 value (448 for E4M3FN); this is llm-compressor's / vLLM's
 * calculate_kv_scales absmax rule (amax / 448). A statistic of 0 (all-zero
 * data) gives scale 1.0 (the engine default) rather than 0. NaNs are
 * rejected (KVQ_ENUMERIC), infinities too.
 *
 * percentile: 100 -> absmax; p in (0, 100) -> the p-th percentile of |x|
 * over the reduced set (per tensor or per head), linear interpolation
 * between order statistics at rank (p/100)*(n-1) (numpy's default
 * "linear" method); values above it then saturate. */

/* The statistic itself (absmax or percentile of |x| over the whole tensor),
 * with the same checks; NVFP4's per-tensor scale is stat / (448 * 6)
 * (quant_fp4.h). */
kvq_status kvq_fp8_calib_stat(const float *x, size_t n_tokens, size_t n_kv_heads, size_t head_dim, double percentile,
                              double *stat, kvq_err *err);
/* One scale for the whole tensor: *scale. */
kvq_status kvq_fp8_calib_tensor(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, double percentile, float *scale, kvq_err *err);
/* One scale per KV head: scales[n_kv_heads]. */
kvq_status kvq_fp8_calib_heads(kvq_fp8_format f, const float *x, size_t n_tokens, size_t n_kv_heads,
                               size_t head_dim, double percentile, float *scales, kvq_err *err);

#endif
