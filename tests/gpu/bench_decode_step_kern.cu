// bench_decode_step_kern.cu — see bench_decode_step_kern.h.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "bench_decode_step_kern.h"
#include "cuda_ops.cuh"

static __device__ __forceinline__ uint64_t mix64(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static __device__ __forceinline__ uint16_t f2bf(float f) // round to nearest even (finite inputs)
{
    uint32_t u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__global__ void ds_fill_bf16(uint16_t *w, size_t n, float scale, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + i);
        const float u = (float)(r >> 40) * (1.0f / 16777216.0f); // [0, 1)
        w[i] = f2bf(scale * (2.0f * u - 1.0f));
    }
}

__global__ void ds_fill_f32(float *x, size_t n, float value)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = value;
}

__global__ void ds_rope(float *out, const float *in, int n_pairs_total, int half, long pos, double theta)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_pairs_total) return;
    const int p = i % half; // pair index within the head
    const double inv = pow(theta, -2.0 * p / (2.0 * half)), ang = (double)pos * inv;
    double s, c;
    sincos(ang, &s, &c);
    const double a = in[2 * (size_t)i], b = in[2 * (size_t)i + 1];
    out[2 * (size_t)i] = (float)(a * c - b * s);
    out[2 * (size_t)i + 1] = (float)(a * s + b * c);
}

__global__ void ds_f16_put(uint16_t *k16, uint16_t *v16, const float *k, const float *v, int B, int H, int D, size_t cap, size_t pos)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * H * D) return;
    const int b = i / (H * D), h = (i / D) % H, d = i % D;
    const size_t o = (((size_t)b * H + h) * cap + pos) * D + d;
    const float kk = fminf(fmaxf(k[i], -65504.0f), 65504.0f), vv = fminf(fmaxf(v[i], -65504.0f), 65504.0f);
    k16[o] = __half_as_ushort(__float2half_rn(kk));
    v16[o] = __half_as_ushort(__float2half_rn(vv));
}

__global__ void ds_add(float *x, const float *y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] += y[i];
}

static unsigned blocks(size_t n, unsigned per) { size_t b = (n + per - 1) / per; return (unsigned)(b > 4096 ? 4096 : b ? b : 1); }

extern "C" int kvq_ds_fill_bf16(uint16_t *w, size_t n, float scale, uint64_t seed)
{
    ds_fill_bf16<<<blocks(n, 256), 256>>>(w, n, scale, seed);
    return (int)cudaGetLastError();
}
extern "C" int kvq_ds_fill_f32(float *x, size_t n, float value)
{
    ds_fill_f32<<<blocks(n, 256), 256>>>(x, n, value);
    return (int)cudaGetLastError();
}
extern "C" int kvq_ds_rope(float *out, const float *in, int n_rows, int n_heads, int head_dim, long pos, double theta)
{
    const int n = n_rows * n_heads * (head_dim / 2);
    ds_rope<<<(n + 127) / 128, 128>>>(out, in, n, head_dim / 2, pos, theta);
    return (int)cudaGetLastError();
}
extern "C" int kvq_ds_f16_put(uint16_t *k16, uint16_t *v16, const float *k, const float *v, int B, int H, int D, size_t cap, size_t pos)
{
    ds_f16_put<<<(B * H * D + 255) / 256, 256>>>(k16, v16, k, v, B, H, D, cap, pos);
    return (int)cudaGetLastError();
}
extern "C" int kvq_ds_add(float *x, const float *y, size_t n)
{
    ds_add<<<blocks(n, 256), 256>>>(x, y, n);
    return (int)cudaGetLastError();
}
extern "C" int kvq_ds_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps)
{
    return (int)kvq_cu_rmsnorm(out, x, g, T, dim, eps, 0);
}
extern "C" int kvq_ds_swiglu(float *out, const float *gate, const float *up, size_t n) { return (int)kvq_cu_swiglu(out, gate, up, n, 0); }
extern "C" int kvq_ds_to_bf16(uint16_t *dst, const float *src, size_t n) { return (int)kvq_cu_to_bf16(dst, src, n, 0); }
extern "C" int kvq_ds_embed_bf16(float *x, const uint16_t *E, const int *tok, int T, int dim)
{
    return (int)kvq_cu_embed_bf16(x, E, tok, T, dim, 0);
}
extern "C" int kvq_ds_nonfinite(const float *x, size_t n, int *flag_dev) { return (int)kvq_cu_nonfinite(x, n, flag_dev, 0); }
