/* half.h — IEEE binary16 ("fp16") and bfloat16 conversions, the one copy used
 * everywhere in kvq (dumps, safetensors, GGUF dequantization, quantizers).
 *
 *   kvq_f32_to_f16   binary32 → binary16 bits: round to nearest, ties to even;
 *                    subnormals kept; |x| >= 65520 (the halfway point above
 *                    65504) → ±Inf; NaN → quiet NaN with the sign and the top
 *                    payload bits kept (IEEE 754-2008 §5.4.2, as numpy).
 *   kvq_f16_to_f32   binary16 → binary32, exact for every finite value and
 *                    infinity; NaNs keep sign and payload with the quiet bit
 *                    set (as x86 F16C, ggml and numpy do).
 *   kvq_f32_to_bf16  binary32 → bfloat16 bits: round to nearest even; NaN kept
 *                    quiet.
 *   kvq_bf16_to_f32  bfloat16 → binary32 (bits << 16; exact).
 * Pure functions of their argument; no state. */
#ifndef KVQ_HALF_H
#define KVQ_HALF_H

#include <stdint.h>

uint16_t kvq_f32_to_f16(float x);
float kvq_f16_to_f32(uint16_t h);
uint16_t kvq_f32_to_bf16(float x);
float kvq_bf16_to_f32(uint16_t h);

#endif
