// cuda_attn_tc.cu — the bf16 tensor-core attention forward of the KVQ_CUDA_BF16 math mode
// (kvq_cu_attention with a->bf16_tc; forward_cuda.h, "Math modes"). Same semantics as cuda_ops.cu attn_k
// (causal GQA, the prefix of P keys seen by every query, the sliding window, the per-row log-sum-exp), not
// its arithmetic: FlashAttention-2's forward (Dao 2023, Alg. 1) with S = Q Kᵀ and O = P V on tensor cores
// (mma.sync m16n8k16, bf16 inputs, fp32 accumulation) and the online softmax in fp32.
//
// Block: 4 warps, 64 queries of one query head (16 rows per warp), keys in tiles of 64.
//  - Q: each warp's 16 x head_dim rows, times scale * log2(e), rounded to bf16 straight into the
//    A-operand registers (scores in base 2: exp2 below).
//  - K / V tile: copied as fp32 from the [T][n_kv_heads][head_dim] buffers (prefix keys from pk / pv)
//    into a shared-memory staging area with cp.async, the next tile's copy in flight while the warps
//    work on the current one; then rounded to bf16 within shared memory: K row-major [key][channel]
//    (the B operand of Q Kᵀ is Kᵀ in column-major order), V transposed [channel][key] (the B operand of
//    P V). Rows padded by 8 bf16 so that the fragment loads of a warp hit 32 different banks. 103 KB of
//    shared memory per block at head_dim 128 (two blocks per H100 multiprocessor).
//  - Per tile and warp: S (16 x 64, fp32 registers) = Q Kᵀ; the mask (causal, window, rows past T) only
//    on tiles that need it; row max over the 4 lanes that share a row; rescale of the running sum and
//    of O; P = exp2(S - max) rounded to bf16 and fed from the accumulator registers to the A operand of
//    P V (the C layout of m16n8k16 is its A layout); the running sum adds the fp32 P.
//  - Tiles before the block's window are skipped; a warp skips a tile none of its rows can see (past
//    its causal edge or before its window).
// The scores of a row differ from attn_k's by the bf16 rounding of q and k (relative 2^-9 each), the
// output also by the rounding of P and V: ~4e-3 relative L2 and ~1e-2 in the log-sum-exp on random data
// with scores of standard deviation 2 (gpu_check --attn checks it; the bounds are in forward_cuda.h).
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_attn_tile.cuh"

namespace {

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (low half) = lo
    return *reinterpret_cast<uint32_t *>(&v);
}

// d += a b: A 16x16 row-major (4 regs of 2 bf16), B 16x8 column-major (2 regs), C/D 16x8 fp32 (4 regs).
// Lane l, g = l / 4, t = l % 4: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8, +9),
// a3 (row g+8, cols 2t+8, +9); b0 (rows 2t, 2t+1 of column g), b1 (rows 2t+8, +9); d0, d1 (row g, cols 2t,
// 2t+1), d2, d3 (row g+8).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Row jj of [prefix | window] keys (or values) of kv head kvh, fp32.
__device__ __forceinline__ const float *kv_row(const kvq_cu_attn &a, const float *pre, const float *win, int kvh, int jj)
{
    return jj < a.P ? pre + ((size_t)jj * a.n_kv_heads + kvh) * a.head_dim
                    : win + ((size_t)(jj - a.P) * a.n_kv_heads + kvh) * a.head_dim;
}

// 16-byte asynchronous copy global -> shared (L2 only), and its completion by this thread.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

constexpr int TC_BQ = 64, TC_BK = 64, TC_THREADS = 128;

// Shared memory of attn_tc_k<HD>: fp32 staging of K and V [BK][HD + 4], bf16 K [BK][HD + 8], bf16 Vᵀ [HD][BK + 8].
template <int HD>
constexpr size_t tc_smem_bytes()
{
    return 2 * (size_t)TC_BK * (HD + 4) * sizeof(float) + ((size_t)TC_BK * (HD + 8) + (size_t)HD * (TC_BK + 8)) * 2;
}

template <int HD>
__global__ void __launch_bounds__(TC_THREADS) attn_tc_k(kvq_cu_attn a, float qscale)
{
    constexpr int BQ = TC_BQ, BK = TC_BK, LDF = HD + 4, LDK = HD + 8, LDV = BK + 8, KC = HD / 16, NS = BK / 8, NO = HD / 8;
    constexpr int HD4 = HD / 4;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    float *Kf = reinterpret_cast<float *>(tc_smem), *Vf = Kf + BK * LDF;
    __nv_bfloat16 *Ks = reinterpret_cast<__nv_bfloat16 *>(Vf + BK * LDF), *Vt = Ks + BK * LDK;
    const int h = blockIdx.y, kvh = h / (a.n_heads / a.n_kv_heads);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ; // heaviest (latest) query tiles first
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int w0 = q0 + warp * 16, i0 = w0 + g, i1 = i0 + 8; // the warp's first row, this lane's two rows
    uint32_t qa[KC][4];
    {
        const float *r0 = a.q + ((size_t)min(i0, a.T - 1) * a.n_heads + h) * HD;
        const float *r1 = a.q + ((size_t)min(i1, a.T - 1) * a.n_heads + h) * HD;
        const float s0 = i0 < a.T ? qscale : 0.0f, s1 = i1 < a.T ? qscale : 0.0f;
#pragma unroll
        for (int kc = 0; kc < KC; kc++) {
            const int c = kc * 16 + 2 * t4;
            const float2 x00 = *reinterpret_cast<const float2 *>(r0 + c), x01 = *reinterpret_cast<const float2 *>(r0 + c + 8);
            const float2 x10 = *reinterpret_cast<const float2 *>(r1 + c), x11 = *reinterpret_cast<const float2 *>(r1 + c + 8);
            qa[kc][0] = pack_bf16(x00.x * s0, x00.y * s0);
            qa[kc][1] = pack_bf16(x10.x * s1, x10.y * s1);
            qa[kc][2] = pack_bf16(x01.x * s0, x01.y * s0);
            qa[kc][3] = pack_bf16(x11.x * s1, x11.y * s1);
        }
    }
    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int q_last = min(a.T, q0 + BQ) - 1;
    const int n_keys = a.P + q_last + 1;
    const int k_first = win_first_key(a, q0) / BK * BK;
    const bool w_active = w0 < a.T;
    const int w_key_last = a.P + min(w0 + 15, a.T - 1);        // the last key any row of the warp sees
    const int w_key_first = w_active ? win_first_key(a, w0) : 0; // keys before it: masked for every row of the warp
    // the fp32 rows of tile k0 (keys at or past n_keys: not copied, zeroed at conversion) into Kf / Vf
    auto issue = [&](int k0) {
        for (int idx = tid; idx < BK * HD4; idx += TC_THREADS) {
            const int r = idx / HD4, c = (idx % HD4) * 4, jj = k0 + r;
            if (jj < n_keys) {
                cp_async16(Kf + r * LDF + c, kv_row(a, a.pk, a.k, kvh, jj) + c);
                cp_async16(Vf + r * LDF + c, kv_row(a, a.pv, a.v, kvh, jj) + c);
            }
        }
        cp_async_commit();
    };
    if (k_first < n_keys) issue(k_first);
    for (int k0 = k_first; k0 < n_keys; k0 += BK) {
        cp_async_wait_all();
        __syncthreads(); // tile k0 staged; every warp done with the previous Ks / Vt
        // K: [key][channel] bf16, one float4 per thread and step
        for (int idx = tid; idx < BK * HD4; idx += TC_THREADS) {
            const int r = idx / HD4, c = (idx % HD4) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (k0 + r < n_keys) x = *reinterpret_cast<const float4 *>(Kf + r * LDF + c);
            *reinterpret_cast<uint2 *>(Ks + r * LDK + c) = make_uint2(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w));
        }
        // V transposed: [channel][key]; a warp takes 8 key pairs x 4 float4 columns per step
        for (int idx = tid; idx < (BK / 2) * HD4; idx += TC_THREADS) {
            constexpr int PG = BK / 16; // groups of 8 key pairs
            const int rest = idx >> 5, p = (rest % PG) * 8 + (idx & 7), c = ((rest / PG) * 4 + ((idx >> 3) & 3)) * 4;
            const int j0 = k0 + 2 * p;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f), y = x;
            if (j0 < n_keys) x = *reinterpret_cast<const float4 *>(Vf + 2 * p * LDF + c);
            if (j0 + 1 < n_keys) y = *reinterpret_cast<const float4 *>(Vf + (2 * p + 1) * LDF + c);
            uint32_t *vt = reinterpret_cast<uint32_t *>(Vt + c * LDV + 2 * p);
            vt[0] = pack_bf16(x.x, y.x);
            vt[LDV / 2] = pack_bf16(x.y, y.y);
            vt[LDV] = pack_bf16(x.z, y.z);
            vt[3 * LDV / 2] = pack_bf16(x.w, y.w);
        }
        __syncthreads(); // Ks / Vt ready, the staging area free: the next tile's copy runs during the products
        if (k0 + BK < n_keys) issue(k0 + BK);
        if (w_active && k0 <= w_key_last && k0 + BK > w_key_first) {
            float s[NS][4];
#pragma unroll
            for (int n = 0; n < NS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
#pragma unroll
                for (int n = 0; n < NS; n++) {
                    const __nv_bfloat16 *kr = Ks + (n * 8 + g) * LDK + kc * 16 + 2 * t4;
                    mma_bf16(s[n], qa[kc], *reinterpret_cast<const uint32_t *>(kr), *reinterpret_cast<const uint32_t *>(kr + 8));
                }
            }
            // the mask, unless every key of the tile is visible to every row of the warp
            if (a.window > 0 || k0 + BK - 1 > a.P + w0 || w0 + 15 >= a.T) {
#pragma unroll
                for (int n = 0; n < NS; n++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int i = e < 2 ? i0 : i1, jj = k0 + n * 8 + 2 * t4 + (e & 1);
                        if (!(i < a.T && jj <= a.P + i && win_vis(a, i, jj))) s[n][e] = -INFINITY;
                    }
                }
            }
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < NS; n++) {
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // a row with nothing visible yet keeps max -inf: subtract 0 then (exp2(-inf) = 0, no NaN)
            const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
            const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
            m0 = mn0;
            m1 = mn1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                o[n][2] *= c1;
                o[n][3] *= c1;
            }
#pragma unroll
            for (int n = 0; n < NS; n++) {
                s[n][0] = exp2f(s[n][0] - b0);
                s[n][1] = exp2f(s[n][1] - b0);
                s[n][2] = exp2f(s[n][2] - b1);
                s[n][3] = exp2f(s[n][3] - b1);
                l0 += s[n][0] + s[n][1];
                l1 += s[n][2] + s[n][3];
            }
#pragma unroll
            for (int kc = 0; kc < BK / 16; kc++) {
                const uint32_t pa[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]), pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                                        pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                        pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
                for (int n = 0; n < NO; n++) {
                    const __nv_bfloat16 *vr = Vt + (n * 8 + g) * LDV + kc * 16 + 2 * t4;
                    mma_bf16(o[n], pa, *reinterpret_cast<const uint32_t *>(vr), *reinterpret_cast<const uint32_t *>(vr + 8));
                }
            }
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    constexpr float LN2 = 0.6931471805599453f;
    if (i0 < a.T) {
        const float inv = 1.0f / l0;
        float *out = a.out + ((size_t)i0 * a.n_heads + h) * HD + 2 * t4;
#pragma unroll
        for (int n = 0; n < NO; n++) *reinterpret_cast<float2 *>(out + n * 8) = make_float2(o[n][0] * inv, o[n][1] * inv);
        if (a.lse && t4 == 0) a.lse[(size_t)h * a.T + i0] = (m0 + log2f(l0)) * LN2;
    }
    if (i1 < a.T) {
        const float inv = 1.0f / l1;
        float *out = a.out + ((size_t)i1 * a.n_heads + h) * HD + 2 * t4;
#pragma unroll
        for (int n = 0; n < NO; n++) *reinterpret_cast<float2 *>(out + n * 8) = make_float2(o[n][2] * inv, o[n][3] * inv);
        if (a.lse && t4 == 0) a.lse[(size_t)h * a.T + i1] = (m1 + log2f(l1)) * LN2;
    }
}

template <int HD>
cudaError_t attn_tc_launch(const kvq_cu_attn *a, cudaStream_t st)
{
    dim3 grid((unsigned)((a->T + TC_BQ - 1) / TC_BQ), (unsigned)a->n_heads);
    const float qscale = 1.4426950408889634f / sqrtf((float)HD); // 1/sqrt(head_dim) * log2(e)
    constexpr size_t smem = tc_smem_bytes<HD>();
    cudaError_t e = cudaFuncSetAttribute(attn_tc_k<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    attn_tc_k<HD><<<grid, TC_THREADS, smem, st>>>(*a, qscale);
    return cudaGetLastError();
}

} // namespace

int kvq_cu_attn_tc_supported(const kvq_cu_attn *a)
{
    return (a->head_dim == 64 || a->head_dim == 128) && !a->kq && !a->vq;
}

cudaError_t kvq_cu_attention_tc(const kvq_cu_attn *a, cudaStream_t st)
{
    if (!kvq_cu_attn_tc_supported(a)) return cudaErrorInvalidValue;
    if (a->T <= 0) return cudaSuccess;
    return a->head_dim == 64 ? attn_tc_launch<64>(a, st) : attn_tc_launch<128>(a, st);
}
