/* quant_ggml.h — llama.cpp KV-cache block formats (`-ctk/-ctv`) as exact
 * quantize -> dequantize primitives: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL.
 *
 * Quantization reproduces ggml's reference quantizers bit for bit
 * (ggml/src/ggml-quants.c, ggml-org/llama.cpp: quantize_row_q8_0_ref,
 * quantize_row_q4_0_ref, quantize_row_q4_1_ref, quantize_row_q5_0_ref,
 * quantize_row_q5_1_ref, and quantize_row_iq4_nl_ref, i.e.
 * quantize_row_iq4_nl_impl(32, 32, 16 values, ..., quant_weights = NULL,
 * ntry = -1)); every float operation is done in float32 in ggml's order (no
 * fused multiply-add, see ggml_dequant.c), fp16 block scales are rounded to
 * nearest even (GGML_FP32_TO_FP16). Dequantization is formats/ggml_dequant
 * (bit-identical to gguf.quants.dequantize). Block layouts: ggml_dequant.h.
 *
 * Per 32-element block x[0..31] (all in float32):
 *   Q8_0   d = amax/127; q = roundf(x/d) (half away from zero)     y = d*q
 *   Q4_0   d = m/-8, m = the first x of largest |x|;
 *          q = min(15, trunc(x*(1/d) + 8.5))                       y = d*(q-8)
 *   Q5_0   as Q4_0 with 16, 16.5, 31                              y = d*(q-16)
 *   Q4_1   d = (max-min)/15; q = min(15, trunc((x-min)*(1/d) + 0.5)) y = d*q + min
 *   Q5_1   as Q4_1 with 31                                         y = d*q + min
 *   IQ4_NL d0 = m/-127 (m as Q4_0); l_j = nearest kvalues_iq4nl entry to
 *          x_j/d0 (ties to the larger entry); d = sum w q x / sum w q^2 with
 *          w = x^2 (the least-squares scale for those indices);
 *          a block with amax < 1e-15 is all zero             y = d*kvalues[l]
 *   (1/d is taken as 0 when d == 0, as ggml does.)
 * Where the engine may differ: ggml-cpu's SIMD Q8_0 path rounds half to even
 * instead of half away; ties are measure-zero on real activations. The CUDA
 * cpy kernels (cpy-utils.cuh) use the same formulas as the references.
 *
 * KV layout: a K or V block is [n_tokens][n_kv_heads][head_dim] float32,
 * row-major, one token's n_kv_heads*head_dim values contiguous, as llama.cpp
 * stores a cache row; blocks of 32 run along head_dim, so with head_dim a
 * multiple of 32 no block straddles two heads. llama.cpp refuses a quantized
 * cache whose head size is not a multiple of the block size (and a quantized
 * V cache needs flash attention); kvq reports KVQ_EUNSUPPORTED for such
 * head_dim.
 *
 * Inputs must be finite (KVQ_ENUMERIC otherwise). For finite inputs whose
 * block scale overflows fp16 (|x| above ~65504*127 for Q8_0) the format
 * itself produces inf/NaN on dequantization, exactly as ggml does.
 */
#ifndef KVQ_QUANT_GGML_H
#define KVQ_QUANT_GGML_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "status.h"

#define KVQ_GGML_KV_BLOCK 32

/* Whether t is one of the KV-cache block formats quantized here
 * (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL). */
int kvq_ggml_can_quantize(kvq_ggml_type t);

/* Quantize n float32 values (n a multiple of 32) into dst (dst_bytes
 * available; n/32 blocks of the type's block size, see kvq_ggml_nbytes).
 * Errors: KVQ_EUNSUPPORTED for another type; KVQ_EINVAL when n is not a
 * multiple of 32 or dst is too small; KVQ_ENUMERIC for a NaN/Inf input (its
 * index is named). Pure, thread-safe. */
kvq_status kvq_ggml_quantize(kvq_ggml_type t, const float *src, size_t n, void *dst, size_t dst_bytes,
                             kvq_err *err);

/* Round trip of a K or V block x[n_tokens][n_kv_heads][head_dim] through
 * format t: y = dequantize(quantize(x)). y may equal x (in place). Blocks of
 * 32 along head_dim. Errors: KVQ_EUNSUPPORTED when head_dim % 32 != 0
 * ("llama.cpp refuses such caches") or for a type not handled here;
 * KVQ_EINVAL for zero sizes; KVQ_ENOMEM on size overflow; KVQ_ENUMERIC for a
 * non-finite input. Parallel over tokens (OpenMP), results independent of
 * thread count. */
kvq_status kvq_ggml_kv_roundtrip(kvq_ggml_type t, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                 size_t head_dim, kvq_err *err);

/* Effective storage bits per cached element of format t: block bytes * 8 /
 * 32 (the fp16 scale, and min where present, amortised over the block).
 * From the block structs in ggml-common.h: Q8_0 34 B -> 8.5, Q4_0 18 B ->
 * 4.5, Q4_1 20 B -> 5.0, Q5_0 22 B -> 5.5, Q5_1 24 B -> 6.0, IQ4_NL 18 B ->
 * 4.5. Returns 0 for a type not handled here. */
double kvq_ggml_kv_bits_per_element(kvq_ggml_type t);

#endif
