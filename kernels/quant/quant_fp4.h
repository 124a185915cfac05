/* quant_fp4.h — FP4 (E2M1) block formats of KV caches as exact
 * quantize -> dequantize primitives: NVFP4, OCP MXFP4 and SGLang's
 * fp4_mx_block16.
 *
 * Element format E2M1 (OCP Microscaling Formats (MX) v1.0, 2023, §5.3.3,
 * Table "FP4 E2M1"; same bit patterns as ml_dtypes float4_e2m1fn and
 * PyTorch float4_e2m1fn_x2), code = s ee m, bias 1, no inf, no NaN:
 *   magnitudes 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6 for codes 0..7,
 *   max normal 6, min normal 1, min subnormal 0.5; code 8 is -0.
 *
 * Formats (blocks of consecutive values along head_dim of one token and one
 * KV head; no block straddles two heads: head_dim must be a multiple of the
 * block, KVQ_EUNSUPPORTED otherwise):
 *
 *  NVFP4 (NVIDIA; TensorRT-LLM / ModelOpt; FlashInfer's KV-cache kernel
 *  flashinfer/csrc/fp4_kv_quantization.cu `quantize_fp16_to_e2m1_with_scaling`,
 *  which SGLang's NVFP4 KV cache calls (sglang srt/layers/quantization/
 *  kvfp4_tensor.py NVFP4KVQuantizeUtil)): blocks of 16, one E4M3 block scale
 *  each, one float32 per-tensor ("global") scale g per layer and K/V, stored
 *  in the dequantization direction (the checkpoint's k_scale / v_scale =
 *  amax / (448 * 6), SGLang fp4_kv_cache_quant_method.py). Per block, in
 *  float32, with vmax = max |x|:
 *      sf   = (1/g) * (vmax * (1/6))
 *      sf8  = e4m3(sf)  (round to nearest even, saturating at 448:
 *             __nv_fp8_e4m3(float) = kvq_fp8_encode(KVQ_FP8_E4M3FN, .))
 *      os   = vmax != 0 ? 1 / (dec(sf8) * g) : 0
 *      code = e2m1(x * os)  (cvt.rn.satfinite.e2m1x2.f32: nearest even, |.| >= 6 -> 6)
 *      y    = dec(code) * (dec(sf8) * g)
 *  Differences from the GPU kernel: the kernel's reciprocals are
 *  rcp.approx.ftz.f32 (within 1 ulp; kvq divides exactly), its inputs are
 *  bf16/fp16 (kvq quantizes the float32 values; no bf16 rounding of y). A
 *  block whose E4M3 scale underflows to 0 (vmax < 6 * 2^-10 * g) stores
 *  codes 0 and reads back 0 (the kernel computes x * inf there; its codes
 *  are then meaningless but still read back as 0 * code = 0).
 *
 *  MXFP4 (OCP MX v1.0 §6.3, "Conversion from vectors of FP32 to MX"):
 *  blocks of 32, one E8M0 scale X = 2^(floor(log2(amax)) - emax_elem) with
 *  emax_elem = 2 (E2M1's largest exponent), clamped to E8M0's range
 *  2^-127 .. 2^127 (an all-zero block takes 2^-127, code 0), elements
 *  e2m1(x / X) with round-to-nearest-even and saturation to +-6 (values in
 *  [6, 8) * X clip: the OCP rule maps amax to [4, 8) * X). The same as
 *  torchao's to_mx (ScaleCalculationMode.FLOOR; f32_to_f4_unpacked rounds to
 *  nearest even after clamping to +-6). microsoft/microxcaling's default
 *  round="nearest" rounds half away from zero instead (ties only).
 *
 *  fp4_mx_block16 (SGLang --kv-cache-dtype fp4_mx_block16, formerly
 *  fp4_e2m1; sglang kvfp4_tensor.py FP4MXBlock16KVQuantizeUtil): blocks of
 *  16, one uint8 exponent scale 2^e with e = ceil(log2(max(amax / 6, 1e-10)))
 *  stored as e + 127, elements |x| / 2^e compared with the bounds
 *  0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (the magnitude code is the number of
 *  bounds <= |x| / 2^e: ties round UP, away from zero, not to even), sign
 *  bit from x / 2^e < 0. Because 2^e >= amax / 6 nothing saturates.
 *  kvq computes ceil(log2(.)) exactly on the float32 value (SGLang runs
 *  torch.log2 in the KV dtype).
 *
 * Inputs must be finite (KVQ_ENUMERIC names the element otherwise).
 * KV layout: [n_tokens][n_kv_heads][head_dim] float32, row-major.
 */
#ifndef KVQ_QUANT_FP4_H
#define KVQ_QUANT_FP4_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
    KVQ_FP4_NVFP4 = 0,   /* 16-value blocks, E4M3 block scale, float32 per-tensor scale */
    KVQ_FP4_MXFP4 = 1,   /* OCP MXFP4: 32-value blocks, E8M0 scale */
    KVQ_FP4_MX16_SGL = 2 /* SGLang fp4_mx_block16: 16-value blocks, exponent scale (ceil rule), ties up */
} kvq_fp4_format;

#define KVQ_FP4_N_FORMATS 3

/* Values per block: 16, 32, 16. */
size_t kvq_fp4_block(kvq_fp4_format f);
/* "nvfp4", "mxfp4", "fp4_mx_block16" */
const char *kvq_fp4_name(kvq_fp4_format f);

/* E2M1: round to nearest, ties to even code, saturating (|x| >= 6 -> 6);
 * the sign of x (also of -0.0 and of values rounding to 0) is kept. NaN gives
 * code 7 (6.0) with its sign (no NaN in E2M1; the round trips reject NaN). */
uint8_t kvq_e2m1_encode(float x);
/* SGLang's encoder: magnitude = number of bounds <= |x| (ties up), sign = x < 0. */
uint8_t kvq_e2m1_encode_ties_up(float x);
/* Exact value of a 4-bit code (the low 4 bits of c). */
float kvq_e2m1_decode(uint8_t c);
/* Value of an E8M0 code: 2^(c - 127), NaN for 0xFF. */
float kvq_e8m0_decode(uint8_t c);

/* One block of kvq_fp4_block(f) values: codes[n] (one code per byte),
 * *scale_code (E4M3 byte for NVFP4, E8M0 / biased exponent byte otherwise),
 * y[n] the dequantized values (y may equal x; codes/scale_code may be NULL).
 * g: NVFP4's per-tensor scale (finite, > 0; ignored by the other formats).
 * Returns the number of elements that saturated (|x| scaled at or beyond 7,
 * the rounding midpoint above 6) — counted before rounding. Inputs finite. */
size_t kvq_fp4_block_roundtrip(kvq_fp4_format f, const float *x, float g, uint8_t *codes, uint8_t *scale_code, float *y);

/* Round trip of a K or V block x[n_tokens][n_kv_heads][head_dim]. y may
 * equal x. *n_clipped (may be NULL) receives the saturated count. Errors:
 * KVQ_EINVAL for empty sizes or a g that is not finite and > 0;
 * KVQ_EUNSUPPORTED when head_dim is not a multiple of the format's block;
 * KVQ_ENUMERIC for a non-finite input (token, head, dim named); KVQ_ENOMEM
 * on size overflow. Parallel over tokens, results independent of threads. */
kvq_status kvq_fp4_kv_roundtrip(kvq_fp4_format f, const float *x, float *y, size_t n_tokens, size_t n_kv_heads,
                                size_t head_dim, float g, uint64_t *n_clipped, kvq_err *err);

/* Effective storage bits per cached element: 4 + scale bits / block (8 / 16
 * = 0.5 for NVFP4 and fp4_mx_block16, 8 / 32 = 0.25 for MXFP4) plus, for
 * NVFP4, one float32 per-tensor scale amortised over the n_elems elements of
 * the layer's K (or V) cache (0 elements: not counted). */
double kvq_fp4_bits_per_element(kvq_fp4_format f, size_t n_elems);

/* NVFP4's per-tensor scale from a calibration statistic of |x| (absmax or a
 * percentile): stat / (448 * 6), the amax that maps the largest block to
 * E4M3's 448 and E2M1's 6 (ModelOpt's KV scale, SGLang's checkpoint k_scale);
 * a statistic of 0 gives 1.0. */
float kvq_nvfp4_global_scale(double stat);

#endif
