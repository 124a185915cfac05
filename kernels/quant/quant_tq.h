/* quant_tq.h — vLLM's TurboQuant KV cache (kv_cache_dtype turboquant_k8v4,
 * turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc): quantize -> dequantize
 * reference primitives for one (token, KV head) vector of head_dim d (a power of two).
 *
 * Source (vllm-project/vllm): vllm/model_executor/layers/quantization/turboquant/
 * config.py (TQ_PRESETS, packed sizes), centroids.py (solve_lloyd_max),
 * vllm/v1/attention/ops/triton_turboquant_store.py (triton_turboquant_store and its
 * kernels) and triton_turboquant_decode.py (_tq_decode_stage1, _tq_full_dequant_kv);
 * the rotation Pi = PiT = the normalised Sylvester Hadamard matrix of order d (the
 * backend's _build_hadamard), applied to the whole head.
 *
 * Keys, MSE presets (b = 3 or 4 bits), float32 as the store computes:
 *   norm = ||k||_2,  x = k / (norm + 1e-8),  y = x · H
 *   idx_j = #{ m in midpoints : y_j >= m }     (binary search; ties go up)
 *   stored: idx (b bits each), fp16(norm)
 *   read:   c_j = centroid[idx_j]; with norm correction ("_nc"): c = c / sqrt(Σ c_j² + 1e-16);
 *           k̂ = fp16(norm) · c · Hᵀ     (vLLM rotates q instead: q·H · (norm c) = q · k̂)
 * centroid[] = the Lloyd–Max quantizer of N(0, 1/d) as solve_lloyd_max computes it (start
 * uniform on ±3.5σ, edges ±10.5σ, trapezoid rule with 200 intervals, at most 200
 * iterations, stop when no centroid moves by 1e-10 — the last iterate is discarded, as
 * vLLM's loop breaks before assigning it), in double, then rounded to float32;
 * midpoints = (c_i + c_{i+1}) / 2 in float32.
 * Keys, turboquant_k8v4: FP8 E4M3FN of k with no scale and no rotation (Hopper+ "e4nv";
 * Ampere/Ada GPUs use Triton's fp8e4b15 instead, not simulated), saturating.
 * Values, every preset (vb = 3 or 4 bits, no rotation):
 *   lo = min v, scale = (max v - lo) / (2^vb - 1), scale = 1e-8 unless > 1e-8,
 *   q = min(max(int32((v - lo) / scale + 0.5), 0), 2^vb - 1)  (round half up)
 *   stored fp16(scale), fp16(lo); read: q · fp16(scale) + fp16(lo).
 * Differences from vLLM: it rotates with a cuBLAS fp32 GEMM (kvq: float64 butterflies,
 * rounded once) and reads K/V in the model dtype (bf16/fp16; kvq: float32 inputs).
 *
 * Stored bits per element (config.py): keys b + 16/d (MSE indices + the fp16 norm) or 8
 * (FP8), values vb + 32/d (fp16 scale and zero); the slot's rounding to an even number
 * of bytes adds nothing when d is a multiple of 8.
 */
#ifndef KVQ_QUANT_TQ_H
#define KVQ_QUANT_TQ_H

#include <stdbool.h>
#include <stddef.h>

#include "status.h"

#define KVQ_TQ_MAX_BITS 4

/* The 2^bits Lloyd–Max centroids of N(0, 1/d), ascending (solve_lloyd_max). bits 1..4, d >= 1. */
void kvq_tq_centroids(size_t d, int bits, float *centroids);

/* One key vector k[d] -> its read-back kh[d] (kh may equal k); mse_bits 3..4 with the
 * centroids of (d, mse_bits), or 8 = FP8 E4M3FN. nc: norm correction. d a power of two. */
void kvq_tq_key(const float *k, float *kh, size_t d, int mse_bits, const float *centroids, bool nc);

/* One value vector v[d] -> its read-back vh[d] (may alias); bits 3 or 4 (any 1..8 works). */
void kvq_tq_value(const float *v, float *vh, size_t d, int bits);

#endif
