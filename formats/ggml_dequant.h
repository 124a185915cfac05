/* ggml_dequant.h — dequantize ggml tensor data (as stored in GGUF) to fp32.
 *
 * Supported types (block elements / block bytes, little-endian):
 *   F32  1/4   F16  1/2 (IEEE binary16)   BF16 1/2 (upper half of a binary32)
 *   Q4_0 32/18  {f16 d; u8 qs[16]}                      y = d*(q-8)
 *   Q4_1 32/20  {f16 d, m; u8 qs[16]}                   y = d*q + m
 *   Q5_0 32/22  {f16 d; u8 qh[4]; u8 qs[16]}            y = d*(q-16)
 *   Q5_1 32/24  {f16 d, m; u8 qh[4]; u8 qs[16]}         y = d*q + m
 *   Q8_0 32/34  {f16 d; i8 qs[32]}                      y = d*q
 *   IQ4_NL 32/18 {f16 d; u8 qs[16]}                     y = d*kvalues_iq4nl[q]
 *               (kvalues_iq4nl = {-127,-104,-83,-65,-49,-35,-22,-10,1,13,25,38,53,69,89,113})
 *   Q2_K 256/84  {u8 scales[16]; u8 qs[64]; f16 d, dmin}
 *   Q3_K 256/110 {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}
 *   Q4_K 256/144 {f16 d, dmin; u8 scales[12]; u8 qs[128]}
 *   Q5_K 256/176 {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
 *   Q6_K 256/210 {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
 *   Q8_K 256/292 {f32 d; i8 qs[256]; i16 bsums[16]}     y = d*q
 * In the 32-element types, byte j of qs holds element j (low nibble) and
 * element j+16 (high nibble); qh bit j is the 5th bit of element j.
 * Source: ggml ggml-common.h (block_* structs) and ggml-quants.c
 * (dequantize_row_*), and the numpy port in the `gguf` PyPI package
 * (gguf/quants.py, dequantize_blocks). Each output value is computed with the
 * same float32 operations in the same order as gguf.quants.dequantize
 * (e.g. Q4_1: (d*q) + m rounded twice, never fused), so results are
 * bit-identical to it; tests/test_dequant.c checks this for every type.
 *
 * Layout: a tensor with GGUF shape ne[0..3] is ne[1]*ne[2]*ne[3] rows of
 * ne[0] elements; rows are stored back to back, each a whole number of blocks.
 */
#ifndef KVQ_GGML_DEQUANT_H
#define KVQ_GGML_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "status.h"


/* Whether kvq can dequantize type t. */
int kvq_ggml_can_dequantize(kvq_ggml_type t);

/* Bytes that n elements of type t occupy. KVQ_EFORMAT when n is not a
 * multiple of the block size, KVQ_EUNSUPPORTED for an unknown type;
 * `what` (e.g. the tensor name) prefixes the message. */
kvq_status kvq_ggml_nbytes(kvq_ggml_type t, size_t n, size_t *nbytes, const char *what, kvq_err *err);

/* Dequantize n elements of type t from src (src_bytes available, any
 * alignment) into dst[n]. Errors: KVQ_EUNSUPPORTED naming `what` and the type
 * for a type kvq cannot dequantize (e.g. Q8_1); KVQ_EFORMAT when n is not a
 * whole number of blocks or src_bytes is too small. Thread-safe (no state). */
kvq_status kvq_ggml_dequantize(kvq_ggml_type t, const void *src, size_t src_bytes, float *dst, size_t n,
                               const char *what, kvq_err *err);

/* Dequantize a whole GGUF tensor into dst[t->n_elements] (row-major: the
 * element (i0, i1, i2, i3) lands at dst[((i3*ne2 + i2)*ne1 + i1)*ne0 + i0]),
 * in parallel over rows (OpenMP). Errors name the file and the tensor. */
kvq_status kvq_gguf_tensor_dequantize(const kvq_gguf *g, const kvq_gguf_tensor *t, float *dst, kvq_err *err);

#endif
