/* bench_decode_step_kern.h — the small device kernels of tests/gpu/bench_decode_step.c (bench_decode_step_kern.cu),
 * and C entry points to the CUDA forward's ops (kernels/cuda/cuda_ops.cuh, C++ linkage) that it reuses. Everything
 * runs on the legacy default stream (that of kvq_kvcache_cuda_append / _attend) and returns the cudaError_t of the
 * launch (cudaGetLastError) as an int. Row-major fp32 activations; bf16 / fp16 as uint16_t bits. */
#ifndef KVQ_BENCH_DECODE_STEP_KERN_H
#define KVQ_BENCH_DECODE_STEP_KERN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* w[i] = bf16 of a pseudo-random value uniform in [-scale, scale) (hash of seed and i) */
int kvq_ds_fill_bf16(uint16_t *w, size_t n, float scale, uint64_t seed);
/* x[i] = value */
int kvq_ds_fill_f32(float *x, size_t n, float value);
/* out[r][h][:] = RoPE of in[r][h][:] at position pos (kvcache.h kvq_rope: interleaved pairs (2i, 2i+1),
 * i < D/2, angle pos · theta^(-2i/D), cos/sin and the rotation in double, rounded once to float, as
 * kvq_rope_rotate); rows r < n_rows, heads h < n_heads; out may equal in */
int kvq_ds_rope(float *out, const float *in, int n_rows, int n_heads, int head_dim, long pos, double theta);
/* fp16 cache rows: k16/v16 [B][H][cap][D] half bits; position pos of every sequence b gets k[b][h][:] (post-RoPE)
 * and v[b][h][:] rounded to fp16 (round to nearest even; beyond ±65504 saturated) */
int kvq_ds_f16_put(uint16_t *k16, uint16_t *v16, const float *k, const float *v, int B, int H, int D, size_t cap, size_t pos);
/* x[i] += y[i] */
int kvq_ds_add(float *x, const float *y, size_t n);
/* kvq_cu_rmsnorm, kvq_cu_swiglu, kvq_cu_to_bf16, kvq_cu_embed_bf16, kvq_cu_nonfinite (cuda_ops.cuh) */
int kvq_ds_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps);
int kvq_ds_swiglu(float *out, const float *gate, const float *up, size_t n);
int kvq_ds_to_bf16(uint16_t *dst, const float *src, size_t n);
int kvq_ds_embed_bf16(float *x, const uint16_t *E, const int *tok, int T, int dim);
int kvq_ds_nonfinite(const float *x, size_t n, int *flag_dev);

#ifdef __cplusplus
}
#endif

#endif
