// kvcache_cuda_dec.cuh — the NUQ split-K decode kernels (v4) of kvcache_cuda.cu, with the exact-region
// and combine kernels they share. Included by kvcache_cuda.cu; tests/gpu/emu_kvcache_dec.cc compiles the
// same source on the host (KVQ_EMU: one std::thread per CUDA thread) to check the index arithmetic
// against the CPU reference without a GPU. See formats/KVCACHE.md "Decode attention (GPU)".
#ifndef KVQ_KVCACHE_CUDA_DEC_CUH
#define KVQ_KVCACHE_CUDA_DEC_CUH

#include <cstdint>

#ifndef KVQ_EMU
#include <cuda_fp16.h>
#define KVQ_DYN_SMEM(T, name) extern __shared__ T name[]
#define KVQ_STATIC_SMEM(T, name, n, al) __shared__ __align__(al) T name[n]
__device__ __forceinline__ uint32_t kvq_saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float kvq_lds(uint32_t a)
{
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ float2 kvq_lds2(uint32_t a)
{
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ float h2f(uint32_t bits) { return __half2float(__ushort_as_half((unsigned short)(bits & 0xffff))); }
#endif

template <int B> struct U {
    static constexpr int C = B == 2 ? 16 : B == 3 ? 32 : 8; // channels per unit
    static constexpr int W = B == 3 ? 3 : 1;                // words per unit
    static constexpr int NL = 1 << B;
    static constexpr int MAXU = (KVQ_KVCACHE_MAX_HEAD_DIM + C - 1) / C;
};

struct DecP {
    const uint32_t *kcodes, *vcodes, *krow, *vrow, *kent, *vent;
    const float *vscale, *klut, *klutr, *vlevels;
    const uint8_t *kz, *vz;
    const float2 *rlo, *rhi;
    const uint16_t *k16, *v16;
    const float *q;
    float *part;
    const int *len;
    int H, D, dpad, np, n_heads, g, qgroups, kw, vw, capq, n_exact, n_splits, chunk, nhb_max, ent_cap, nslots;
    float scale;
};

// block-wide softmax statistics of sc[gg][0..n): sc <- exp(sc - m); returns m, l per query (up to 8 warps)
template <int GQ>
__device__ void chunk_softmax(float *sc, int chunk, int n, float *red, float *mo, float *lo)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        float m = -INFINITY;
        for (int t = tid; t < n; t += blockDim.x) m = fmaxf(m, sc[gg * chunk + t]);
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) red[gg * 8 + warp] = m;
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        float m = red[gg * 8];
        for (int w = 1; w < nw; w++) m = fmaxf(m, red[gg * 8 + w]);
        mo[gg] = m;
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        float l = 0;
        for (int t = tid; t < n; t += blockDim.x) {
            float e = expf(sc[gg * chunk + t] - mo[gg]);
            sc[gg * chunk + t] = e;
            l += e;
        }
        for (int o = 16; o; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) red[gg * 8 + warp] = l;
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        float l = 0;
        for (int w = 0; w < nw; w++) l += red[gg * 8 + w];
        lo[gg] = l;
    }
}

// exact region (fp16, post-RoPE keys): one block per (query head, sequence); the last partial slot
__global__ void exact_decode(DecP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    float *sm = (float *)sm4;
    const int qh = blockIdx.x, s = blockIdx.y, h = qh / p.g, D = p.D, tid = threadIdx.x;
    const int ne = min(p.len[s], p.n_exact);
    float *part = p.part + ((size_t)(s * p.n_heads + qh) * p.nslots + p.nslots - 1) * (D + 2);
    float *qv = sm, *sc = sm + D;
    for (int d = tid; d < D; d += blockDim.x) qv[d] = p.q[((size_t)s * p.n_heads + qh) * D + d] * p.scale;
    __syncthreads();
    const uint16_t *k = p.k16 + (size_t)(s * p.H + h) * p.n_exact * D, *v = p.v16 + (size_t)(s * p.H + h) * p.n_exact * D;
    for (int t = tid; t < ne; t += blockDim.x) {
        float a = 0;
        for (int d = 0; d < D; d++) a += qv[d] * h2f(k[(size_t)t * D + d]);
        sc[t] = a;
    }
    __syncthreads();
    float m = -INFINITY, l = 0;
    for (int t = 0; t < ne; t++) m = fmaxf(m, sc[t]);
    for (int t = 0; t < ne; t++) l += expf(sc[t] - m);
    for (int d = tid; d < D; d += blockDim.x) {
        float a = 0;
        for (int t = 0; t < ne; t++) a += expf(sc[t] - m) * h2f(v[(size_t)t * D + d]);
        part[2 + d] = a;
    }
    if (tid == 0) { part[0] = ne ? m : -INFINITY; part[1] = l; }
}

// merge the partials of every slot: one block per (query head, sequence)
__global__ void combine(const float *part, float *out, int n_heads, int D, int nslots)
{
    const int qh = blockIdx.x, s = blockIdx.y;
    const float *pp = part + (size_t)(s * n_heads + qh) * nslots * (D + 2);
    float M = -INFINITY;
    for (int i = 0; i < nslots; i++) M = fmaxf(M, pp[i * (D + 2)]);
    float L = 0;
    if (M != -INFINITY)
        for (int i = 0; i < nslots; i++) L += pp[i * (D + 2)] == -INFINITY ? 0.f : expf(pp[i * (D + 2)] - M) * pp[i * (D + 2) + 1];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0;
        if (M != -INFINITY)
            for (int i = 0; i < nslots; i++)
                if (pp[i * (D + 2)] != -INFINITY) a += expf(pp[i * (D + 2)] - M) * pp[i * (D + 2) + 2 + d];
        out[((size_t)s * n_heads + qh) * D + d] = M == -INFINITY ? 0.f : a / L;
    }
}

// ---- v4: 2- and 4-bit keys and values ------------------------------------------------------------
// One block of NT4 = 256 threads per (sequence, KV head, query group, chunk of positions); chunks are
// multiples of the 256-position warp tile.
//
// Phase 1 (scores): lanes along positions. A warp takes a tile of 256 positions, lane L the 8
// consecutive positions 8L..8L+7 of it: for each key code word it loads the 8 positions' words as two
// 16-byte loads (codes are token-minor), so at any instant the 32 lanes work on the same channels of
// different positions. The key table is therefore read without replication and without bank conflicts:
// 4-bit keys: a per-channel table of 16 floats (the dequantized key, klut), 2-bit keys: a per-pair table
// of 16 float2 indexed by the pair's nibble. Code extraction works on bytes: two shift+mask operations
// per word put every code (times the entry size) in a byte, and one PRMT per lookup moves that byte
// into the low byte of the table's (256-aligned) shared address, so a lookup is PRMT + LDS.
// RoPE: w = conj(q̄)·e^{i p θ} per pair; the warp composes w at its tile's first position from the
// two-level table (e^{ipθ} = hi[p >> 6]·lo[p & 63], in fp32), a lane multiplies it by e^{i 8L θ} (per-block
// table) and steps to its next 7 positions with one complex multiply and then the Chebyshev recurrence
// w_{k+1} = 2cos θ·w_k − w_{k−1} (two FMAs per step). Score contribution of a pair: Re(w·k̂) = w.x·k0 − w.y·k1.
// Sparse key outliers (after the dense pass): the chunk's entries are expanded into a table entry ->
// position (one thread per position writes the positions of its entries), then one thread per entry adds
// its correction to the score atomically.
// Softmax statistics as v3. Phase 3 (P·V): lanes along the code words of a value row, 4-8 rows in flight
// per lane; the same byte extraction; 2-bit values: one float2 lookup per nibble (two levels), 4-bit: one
// float per code; acc += (p·r)·level and Σ p·zp added once at the end; sparse value outliers as for keys.
// The RoPE step from the warp's tile start to a lane's first position, e^{i 8L θ}, is a per-block table.
// Every table a lookup reads spans at most 32 banks (16 words, or 16 float2), so no lookup pattern conflicts:
// the L1/shared pipe (one 128-byte wavefront per clock) is what bounds these kernels.
namespace v4 {
constexpr int NT4 = 256, NW4 = 8, TILE = 256, SPP = 2048; // threads, warps, positions per warp tile, sparse entries per piece

// dynamic shared memory (bytes): rho [npk] float4, r8 [npk][32] float2, qs [GQ][npk] float2, qt [NW4][GQ][npk]
// float2, sc [GQ][chunk], oacc [GQ][D], red [GQ][8], stat [2 GQ] (floats), etok [SPP] u16
__host__ __device__ inline size_t smem_bytes(int gq, int npk, int chunk, int D)
{
    return (size_t)16 * npk + (size_t)256 * npk + (size_t)8 * gq * npk * (1 + NW4) +
           (size_t)4 * ((size_t)gq * chunk + (size_t)gq * D + gq * 8 + 2 * gq) + 2 * SPP;
}

// launch plan: chunk (a multiple of TILE, at most 2048 unless max_splits forces more, within smem_max)
// and splits for nq quantized positions and `per` blocks per split; enough blocks for 4 per SM
inline void plan(size_t nq, size_t per, size_t n_sm, size_t max_splits, int gq, int npk, int D, size_t smem_max,
                 size_t *chunk_out, size_t *splits_out)
{
    size_t splits = (4 * n_sm + per - 1) / per;
    if (splits < 1) splits = 1;
    if (max_splits && splits > max_splits) splits = max_splits;
    size_t chunk = nq ? (nq + splits - 1) / splits : TILE;
    chunk = (chunk + TILE - 1) / TILE * TILE;
    if (chunk > 2048 && !max_splits) chunk = 2048;
    const size_t cmax = 65536 - TILE; // positions within a chunk are 16-bit (etok)
    if (chunk > cmax) chunk = cmax;
    while (chunk > TILE && smem_bytes(gq, npk, (int)chunk, D) > smem_max) chunk = (chunk / 2 + TILE - 1) / TILE * TILE;
    *chunk_out = chunk;
    *splits_out = nq ? (nq + chunk - 1) / chunk : 1;
}

// positions of the chunk's sparse entries (pieces of SPP entries), then f(entry, position) per entry
template <class F>
__device__ __forceinline__ void sparse_pass(const uint32_t *row, int n, uint16_t *etok, F f)
{
    const uint32_t E0 = __ldg(row), E1 = __ldg(row + n);
    for (uint32_t pb = E0; pb < E1; pb += SPP) {
        const uint32_t pe = min(pb + (uint32_t)SPP, E1);
        for (int t = threadIdx.x; t < n; t += NT4) {
            const uint32_t a = max(__ldg(row + t), pb), b = min(__ldg(row + t + 1), pe);
            for (uint32_t e = a; e < b; e++) etok[e - pb] = (uint16_t)t;
        }
        __syncthreads();
        for (uint32_t e = pb + threadIdx.x; e < pe; e += NT4) f(e, (int)etok[e - pb]);
        __syncthreads();
    }
}

__device__ __forceinline__ float2 cmul(float2 a, float2 b) { return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }

template <int BK, int BV, int GQ>
__global__ void __launch_bounds__(256, (GQ <= 2 ? 3 : 2)) nuq_decode(DecP p)
{
    constexpr int CK = BK == 2 ? 16 : 8, PK = CK / 2, NLK = 1 << BK, NLV = 1 << BV, CV = BV == 2 ? 16 : 8;
    static_assert((BK == 2 || BK == 4) && (BV == 2 || BV == 4), "v4: 2- and 4-bit codes");
    // key table: 4-bit [channel][16] float, 2-bit [pair][16] float2 (<= 16 KB at head_dim 256); value table:
    // 2-bit [byte] float4 (4 levels), 4-bit [byte] float2 (2 levels)
    KVQ_STATIC_SMEM(float, ktab, 4096, 256);
    KVQ_STATIC_SMEM(float, vtab, 32, 256);
    KVQ_DYN_SMEM(float4, sm4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.z, h = blockIdx.y / p.qgroups, qg = blockIdx.y % p.qgroups;
    const int gq0 = qg * GQ, gn = min(GQ, p.g - gq0);
    const int D = p.D, np = p.np, nuk = p.kw, npk = nuk * PK;
    const int nq = max(0, p.len[s] - p.n_exact);
    const int q0 = blockIdx.x * p.chunk, q1 = min(q0 + p.chunk, nq);
    float *part0 = p.part + ((size_t)(s * p.n_heads + h * p.g + gq0) * p.nslots + blockIdx.x) * (D + 2);
    const size_t pstride = (size_t)p.nslots * (D + 2);
    if (q0 >= q1) {
        for (int j = 0; j < gn; j++)
            for (int d = tid; d < D + 2; d += NT4) part0[j * pstride + d] = d == 0 ? -INFINITY : 0.f;
        return;
    }
    const int n = q1 - q0;
    float4 *rho = sm4;                                // [npk] (e^{iθ}, 2 cos θ, 0)
    float2 *r8 = (float2 *)(rho + npk);               // [npk][32] e^{i 8m θ}
    float2 *qs = r8 + 32 * npk;                       // [GQ][npk] conj(q̄)·scale
    float2 *qt = qs + GQ * npk;                       // [NW4][GQ][npk] conj(q̄)·scale·e^{i p θ} at the warp's tile start
    float *sc = (float *)(qt + NW4 * GQ * npk);       // [GQ][chunk]
    float *oacc = sc + GQ * p.chunk;                  // [GQ][D]
    float *red = oacc + GQ * D;                       // [GQ][8]
    float *stat = red + GQ * 8;                       // m[GQ], l[GQ]
    uint16_t *etok = (uint16_t *)(stat + 2 * GQ);     // [SPP]

    // ---- tables
    {
        const float *kl = p.klut + (size_t)h * D * NLK;
        if (BK == 4) {
            for (int i = tid; i < nuk * 8 * 16; i += NT4) {
                const int ch = i >> 4;
                ktab[i] = ch < D ? __ldg(kl + ch * 16 + (i & 15)) : 0.f;
            }
        } else {
            for (int i = tid; i < npk * 16; i += NT4) {
                const int c0 = 2 * (i >> 4), c1 = c0 + 1, nib = i & 15;
                ((float2 *)ktab)[i] = make_float2(c0 < D ? __ldg(kl + c0 * 4 + (nib & 3)) : 0.f, c1 < D ? __ldg(kl + c1 * 4 + (nib >> 2)) : 0.f);
            }
        }
        // value table (16 words, conflict-free for any lookup pattern): 2-bit [nibble] float2 (the levels of
        // the nibble's two codes), 4-bit [code] float
        const float *vl = p.vlevels + h * NLV;
        if (tid < 16) {
            if (BV == 2) ((float2 *)vtab)[tid] = make_float2(__ldg(vl + (tid & 3)), __ldg(vl + (tid >> 2)));
            else vtab[tid] = __ldg(vl + tid);
        }
        for (int x = tid; x < npk * 32; x += NT4) {
            const int i = x >> 5, m8 = 8 * (x & 31);
            r8[x] = i < np ? cmul(__ldg(p.rhi + (size_t)(m8 >> 6) * np + i), __ldg(p.rlo + i * 64 + (m8 & 63))) : make_float2(1.f, 0.f);
        }
        for (int i = tid; i < npk; i += NT4) {
            const float2 r = i < np ? __ldg(p.rlo + i * 64 + 1) : make_float2(1.f, 0.f);
            rho[i] = make_float4(r.x, r.y, 2.f * r.x, 0.f);
        }
        for (int x = tid; x < GQ * npk; x += NT4) {
            const int j = x / npk, i = x % npk;
            float qa = 0.f, qb = 0.f;
            if (j < gn && i < np) {
                const float *qv = p.q + ((size_t)s * p.n_heads + h * p.g + gq0 + j) * D;
                qa = qv[2 * i] * p.scale;
                qb = 2 * i + 1 < D ? qv[2 * i + 1] * p.scale : 0.f;
            }
            qs[x] = make_float2(qa, -qb);
        }
        for (int i = tid; i < GQ * D; i += NT4) oacc[i] = 0.f;
    }
    __syncthreads();

    // ---- phase 1: dense scores, lanes along positions
    {
        const uint32_t kt = kvq_saddr(ktab);
        const int ntile = (n + TILE - 1) / TILE;
        const uint32_t *kc = p.kcodes + (size_t)(s * p.H + h) * nuk * p.capq;
        for (int tile = warp; tile < ntile; tile += NW4) {
            const int g0 = q0 + tile * TILE + lane * 8;
            const bool live = g0 < q1;
            // the warp's anchors: w at its tile's first position for every pair and query head
            float2 *qw = qt + warp * GQ * npk;
            {
                const int pt = p.n_exact + q0 + tile * TILE;
                __syncwarp();
                for (int i = lane; i < npk; i += 32) {
                    const int ic = min(i, np - 1);
                    const float2 e = cmul(__ldg(p.rhi + (size_t)(pt >> 6) * np + ic), __ldg(p.rlo + ic * 64 + (pt & 63)));
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) qw[gg * npk + i] = cmul(qs[gg * npk + i], e);
                }
                __syncwarp();
            }
            float sp[GQ][8];
#pragma unroll
            for (int gg = 0; gg < GQ; gg++)
#pragma unroll
                for (int k = 0; k < 8; k++) sp[gg][k] = 0.f;
            uint4 a0 = make_uint4(0, 0, 0, 0), a1 = a0;
            if (live) {
                a0 = __ldcs((const uint4 *)(kc + g0));
                a1 = __ldcs((const uint4 *)(kc + g0 + 4));
            }
#pragma unroll 1
            for (int u = 0; u < nuk; u++) {
                uint4 b0 = make_uint4(0, 0, 0, 0), b1 = b0; // the next word's codes, in flight
                if (live && u + 1 < nuk) {
                    b0 = __ldcs((const uint4 *)(kc + (size_t)(u + 1) * p.capq + g0));
                    b1 = __ldcs((const uint4 *)(kc + (size_t)(u + 1) * p.capq + g0 + 4));
                }
                const uint32_t x[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                uint32_t me[8], mo[8];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    if (BK == 4) { me[k] = (x[k] << 2) & 0x3C3C3C3Cu; mo[k] = (x[k] >> 2) & 0x3C3C3C3Cu; } // code*4 per byte
                    else { me[k] = (x[k] << 3) & 0x78787878u; mo[k] = (x[k] >> 1) & 0x78787878u; }        // nibble*8 per byte
                }
                // table address of this word's entries: 4-bit channel 8u at kt + u*512, 2-bit pair 8u at kt + u*1024
                const uint32_t kb = kt + (uint32_t)u * (BK == 4 ? 512u : 1024u);
#pragma unroll
                for (int jj = 0; jj < PK; jj++) {
                    const int i = u * PK + jj;
                    const float2 e = r8[i * 32 + lane]; // e^{i 8 lane θ}: from the tile start to the lane's first position
                    const float4 r4 = rho[i];
                    float ka[8], kb2[8];
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        if (BK == 4) {
                            ka[k] = kvq_lds(__byte_perm(me[k], kb, 0x7650 + jj) + jj * 128);
                            kb2[k] = kvq_lds(__byte_perm(mo[k], kb, 0x7650 + jj) + jj * 128 + 64);
                        } else {
                            const float2 v = kvq_lds2(__byte_perm((jj & 1) ? mo[k] : me[k], kb, 0x7650 + (jj >> 1)) + jj * 128);
                            ka[k] = v.x;
                            kb2[k] = v.y;
                        }
                    }
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) {
                        float2 wp = cmul(qw[gg * npk + i], e), wc = cmul(wp, make_float2(r4.x, r4.y));
                        sp[gg][0] = fmaf(-kb2[0], wp.y, fmaf(ka[0], wp.x, sp[gg][0]));
                        sp[gg][1] = fmaf(-kb2[1], wc.y, fmaf(ka[1], wc.x, sp[gg][1]));
#pragma unroll
                        for (int k = 2; k < 8; k++) {
                            const float2 wn = make_float2(fmaf(r4.z, wc.x, -wp.x), fmaf(r4.z, wc.y, -wp.y));
                            wp = wc;
                            wc = wn;
                            sp[gg][k] = fmaf(-kb2[k], wc.y, fmaf(ka[k], wc.x, sp[gg][k]));
                        }
                    }
                }
                a0 = b0;
                a1 = b1;
            }
            if (live) {
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) {
                    float4 *o = (float4 *)(sc + gg * p.chunk + (g0 - q0));
                    o[0] = make_float4(sp[gg][0], sp[gg][1], sp[gg][2], sp[gg][3]);
                    o[1] = make_float4(sp[gg][4], sp[gg][5], sp[gg][6], sp[gg][7]);
                }
            }
        }
    }
    __syncthreads();
    // sparse key outliers
    {
        const uint32_t *kent = p.kent + ((size_t)s * p.H + h) * p.ent_cap;
        const float *kl = p.klut + (size_t)h * D * NLK;
        const int kzc = p.kz[h];
        sparse_pass(p.krow + ((size_t)s * p.H + h) * (p.capq + 1) + q0, n, etok, [&](uint32_t e, int t) {
            const uint32_t en = __ldg(kent + e);
            const int d = en >> 16, i = d >> 1, pos = p.n_exact + q0 + t;
            const float corr = h2f(en) - __ldg(kl + d * NLK + kzc);
            const float2 ep = cmul(__ldg(p.rhi + (size_t)(pos >> 6) * np + i), __ldg(p.rlo + i * 64 + (pos & 63)));
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                const float2 w = cmul(qs[gg * npk + i], ep);
                atomicAdd(&sc[gg * p.chunk + t], (d & 1) ? -corr * w.y : corr * w.x);
            }
        });
    }
    chunk_softmax<GQ>(sc, p.chunk, n, red, stat, stat + GQ);
    __syncthreads();

    // ---- phase 3: P·V, lanes along the code words of a value row, rows across lanes and warps
    {
        const int nuv = p.vw, tpw = 32 / nuv, unit = lane % nuv, tsub = lane / nuv;
        if (tsub < tpw) {
            float acc[GQ][CV], pz[GQ];
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                pz[gg] = 0.f;
#pragma unroll
                for (int j = 0; j < CV; j++) acc[gg][j] = 0.f;
            }
            const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * nuv + unit;
            const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq;
            const uint32_t vb = kvq_saddr(vtab);
            constexpr int VT = (BV == 2 && GQ <= 2) ? 4 : 8; // rows per batch (fewer where registers are short); the next batch's loads are in flight during a batch
            const int st = NW4 * tpw, tb0 = q0 + warp * tpw + tsub;
            uint32_t w[VT];
            float2 zr[VT];
#pragma unroll
            for (int k = 0; k < VT; k++) {
                const int t = tb0 + k * st;
                w[k] = t < q1 ? __ldcs(vc + (size_t)t * nuv) : 0u;
                zr[k] = t < q1 ? __ldg(vs + t) : make_float2(0.f, 0.f);
            }
#pragma unroll 1
            for (int tb = tb0; tb < q1; tb += VT * st) {
                uint32_t wn[VT];
                float2 zn[VT];
#pragma unroll
                for (int k = 0; k < VT; k++) {
                    const int t = tb + (VT + k) * st;
                    wn[k] = t < q1 ? __ldcs(vc + (size_t)t * nuv) : 0u;
                    zn[k] = t < q1 ? __ldg(vs + t) : make_float2(0.f, 0.f);
                }
#pragma unroll
                for (int k = 0; k < VT; k++) {
                    const int t = tb + k * st;
                    // rows past the chunk have w = 0 and zr = 0: their p is read from a valid row (0) and
                    // multiplied by zero scales, so no test is needed inside the batch
                    const int ti = t < q1 ? t - q0 : 0;
                    float pr[GQ];
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) {
                        const float pp = sc[gg * p.chunk + ti];
                        pr[gg] = pp * zr[k].y;
                        pz[gg] += pp * zr[k].x;
                    }
                    const uint32_t x = w[k];
                    // byte b of me / mo: the even / odd nibble (2-bit: two codes, times 8) or code (4-bit, times 4)
                    // of byte b of the word
                    const uint32_t me = BV == 2 ? (x << 3) & 0x78787878u : (x << 2) & 0x3C3C3C3Cu;
                    const uint32_t mo = BV == 2 ? (x >> 1) & 0x78787878u : (x >> 2) & 0x3C3C3C3Cu;
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        if (BV == 2) {
                            const float2 La = kvq_lds2(__byte_perm(me, vb, 0x7650 + b)), Lb = kvq_lds2(__byte_perm(mo, vb, 0x7650 + b));
#pragma unroll
                            for (int gg = 0; gg < GQ; gg++) {
                                acc[gg][4 * b] = fmaf(pr[gg], La.x, acc[gg][4 * b]);
                                acc[gg][4 * b + 1] = fmaf(pr[gg], La.y, acc[gg][4 * b + 1]);
                                acc[gg][4 * b + 2] = fmaf(pr[gg], Lb.x, acc[gg][4 * b + 2]);
                                acc[gg][4 * b + 3] = fmaf(pr[gg], Lb.y, acc[gg][4 * b + 3]);
                            }
                        } else {
                            const float La = kvq_lds(__byte_perm(me, vb, 0x7650 + b)), Lb = kvq_lds(__byte_perm(mo, vb, 0x7650 + b));
#pragma unroll
                            for (int gg = 0; gg < GQ; gg++) {
                                acc[gg][2 * b] = fmaf(pr[gg], La, acc[gg][2 * b]);
                                acc[gg][2 * b + 1] = fmaf(pr[gg], Lb, acc[gg][2 * b + 1]);
                            }
                        }
                    }
                }
#pragma unroll
                for (int k = 0; k < VT; k++) {
                    w[k] = wn[k];
                    zr[k] = zn[k];
                }
            }
#pragma unroll
            for (int j = 0; j < CV; j++) {
                const int d = unit * CV + j;
                if (d < D)
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) atomicAdd(&oacc[gg * D + d], acc[gg][j] + pz[gg]);
            }
        }
    }
    // sparse value outliers (the first sync of the pass also orders the dense accumulation before them)
    {
        const uint32_t *vent = p.vent + ((size_t)s * p.H + h) * p.ent_cap;
        const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq + q0;
        const float lz = __ldg(p.vlevels + h * NLV + p.vz[h]);
        __syncthreads();
        sparse_pass(p.vrow + ((size_t)s * p.H + h) * (p.capq + 1) + q0, n, etok, [&](uint32_t e, int t) {
            const uint32_t en = __ldg(vent + e);
            const int d = en >> 16;
            const float2 zr = __ldg(vs + t);
            const float corr = h2f(en) - (lz * zr.y + zr.x);
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) atomicAdd(&oacc[gg * D + d], sc[gg * p.chunk + t] * corr);
        });
    }
    __syncthreads();
    for (int i = tid; i < gn * (D + 2); i += NT4) {
        const int j = i / (D + 2), d = i % (D + 2);
        part0[j * pstride + d] = d == 0 ? stat[j] : d == 1 ? stat[GQ + j] : oacc[j * D + d - 2];
    }
}
} // namespace v4

#endif
