// cuda_reduce.cuh — warp/block reductions and grid sizing shared by the CUDA
// kernels (internal to kernels/*.cu). Block reductions assume blockDim.x ==
// kThreads (8 warps) and broadcast the result to every thread.
#ifndef KVQ_CUDA_REDUCE_CUH
#define KVQ_CUDA_REDUCE_CUH

#include <cuda_runtime.h>
#include <stddef.h>

namespace {

constexpr int kThreads = 256;

// max (MAX) or min over the warp, xor-shuffle tree; result in every lane
template <bool MAX>
__device__ __forceinline__ float warp_extreme(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, u) : fminf(v, u);
    }
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide reductions for blockDim.x == kThreads (8 warps); result broadcast to all threads.
__device__ __forceinline__ double block_sum_d(double v, double *sh)
{
    v = warp_sum_d(v);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    double r = 0;
    for (int i = 0; i < kThreads / 32; i++) r += sh[i];
    return r;
}
template <bool MAX>
__device__ __forceinline__ float block_extreme(float v, float *sh)
{
    v = warp_extreme<MAX>(v);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    float r = sh[0];
    for (int i = 1; i < kThreads / 32; i++) r = MAX ? fmaxf(r, sh[i]) : fminf(r, sh[i]);
    return r;
}

inline unsigned grid_for(size_t n, unsigned per_block)
{
    size_t b = (n + per_block - 1) / per_block;
    if (b < 1) b = 1;
    if (b > 65535u * 32u) b = 65535u * 32u;
    return (unsigned)b;
}

} // namespace

#endif
