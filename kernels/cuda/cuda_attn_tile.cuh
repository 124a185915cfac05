// cuda_attn_tile.cuh — the key/value tile loader shared by the attention kernels
// (forward: cuda_ops.cu attn_k; backward and statistics: cuda_bwd_ops.cu). Internal.
#ifndef KVQ_CUDA_ATTN_TILE_CUH
#define KVQ_CUDA_ATTN_TILE_CUH

#include "cuda_ops.cuh"

namespace {

// Sum of v over the TPQ consecutive lanes of a thread group (TPQ a power of two <= 32), xor-shuffle tree;
// every lane of the warp must call it (full-warp shuffles). The attention kernels split a head_dim row
// over such a group, so a dot product is a per-lane fma chain followed by this.
template <int TPQ>
__device__ __forceinline__ float group_sum(float v)
{
#pragma unroll
    for (int o = TPQ / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sliding window (attention.h kvq_attn_key_lo): whether key jj of the sequence [prefix | window] is
// inside window query i's window (always true without a window). Prefix key j sits at position j,
// window key j at pos0 + j.
__device__ __forceinline__ bool win_vis(const kvq_cu_attn &a, int i, int jj)
{
    if (a.window <= 0) return true;
    const long kp = jj < a.P ? (long)jj : (long)a.pos0 + (jj - a.P);
    return (long)a.pos0 + i - kp < (long)a.window;
}

// The first key of [prefix | window] that query i can see (0 without a window): every key before it is
// masked for query i and for every later query, so a block of queries starting at i may skip them.
__device__ __forceinline__ int win_first_key(const kvq_cu_attn &a, int i)
{
    if (a.window <= 0) return 0;
    long p = (long)a.pos0 + i - a.window + 1, w = (long)i - a.window + 1;
    if (p < a.P) return p < 0 ? 0 : (int)p;
    return a.P + (w < 0 ? 0 : (int)w);
}

// Keys k0 .. k0+BK-1 of the sequence [prefix | window] of kv head kvh into shared
// memory, [BK][HD] each: Ks (and Vs when WANT_V), and with ALT the alternative
// representation Kq (Vq) — the primary one where the alternative is absent and for
// prefix keys. Rows at or past n_keys are zero. 128 threads cooperate (float4 each).
template <int HD, int BK, bool ALT, bool WANT_V>
__device__ __forceinline__ void load_kv_tile(const kvq_cu_attn &a, int kvh, int k0, int n_keys, int tid, float *Ks, float *Vs,
                                             float *Kq, float *Vq)
{
    constexpr int HD4 = HD / 4;
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int idx = tid; idx < BK * HD4; idx += 128) {
        int r = idx / HD4, c = (idx % HD4) * 4, jj = k0 + r;
        float4 kk = z4, vv = z4, kq = z4, vq = z4;
        if (jj < n_keys) {
            if (jj < a.P) {
                size_t off = ((size_t)jj * a.n_kv_heads + kvh) * HD + c;
                kk = *reinterpret_cast<const float4 *>(a.pk + off);
                if (WANT_V) vv = *reinterpret_cast<const float4 *>(a.pv + off);
                kq = kk;
                vq = vv;
            } else {
                size_t off = ((size_t)(jj - a.P) * a.n_kv_heads + kvh) * HD + c;
                kk = *reinterpret_cast<const float4 *>(a.k + off);
                if (WANT_V) vv = *reinterpret_cast<const float4 *>(a.v + off);
                if (ALT) {
                    kq = a.kq ? *reinterpret_cast<const float4 *>(a.kq + off) : kk;
                    if (WANT_V) vq = a.vq ? *reinterpret_cast<const float4 *>(a.vq + off) : vv;
                }
            }
        }
        *reinterpret_cast<float4 *>(Ks + r * HD + c) = kk;
        if (WANT_V) *reinterpret_cast<float4 *>(Vs + r * HD + c) = vv;
        if (ALT) *reinterpret_cast<float4 *>(Kq + r * HD + c) = kq;
        if (ALT && WANT_V) *reinterpret_cast<float4 *>(Vq + r * HD + c) = vq;
    }
}

} // namespace

#endif
