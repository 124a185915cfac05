// kvcache_cuda_dec.cuh — the NUQ split-K decode kernels (v4: 2-, 3- and 4-bit codes, P·V on the tensor
// cores; v5, the default: v4 with pv_mma3_v5 for 3-bit values) of kvcache_cuda.cu, with the exact-region
// and combine kernels they share. Included by kvcache_cuda.cu; tests/gpu/emu/emu_kvcache_dec.cc compiles the
// same source on the host (KVQ_EMU: one std::thread per CUDA thread) to check the index arithmetic
// against the CPU reference without a GPU. See formats/KVCACHE.md "Decode attention (GPU)".
// The kernel templates' instances are compiled in translation units of their own, written by the Makefile
// (build/gen/kvcache_cuda_inst_*.cu; see kvcache_cuda_nuq.cuh and kvcache_cuda_kivi_fast.cuh), which define
// KVQ_KVCACHE_CUDA_INST: the kernels that are not templates (exact_decode, combine, and KIVI's kivi_generic,
// kivi_tail, combine_par, combine_par_wide) and the __device__ functions that are neither templates nor inline (whose
// host-side stubs would be defined twice) are then left out, so that they are defined once, in kvcache_cuda.cu.
#ifndef KVQ_KVCACHE_CUDA_DEC_CUH
#define KVQ_KVCACHE_CUDA_DEC_CUH

#include <cstdint>

// KVQ_ONE_UNIT marks the kernels and __device__ functions that are neither templates nor inline (defined once, in
// kvcache_cuda.cu): internal linkage, so that libkvq.a exports no short C++ names (make check-symbols) and a program
// that includes these headers (the host emulator) never meets them at link time.
#define KVQ_ONE_UNIT [[maybe_unused]] static

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
// hint: bring [p, p + bytes) into L2 with Hopper's bulk prefetch (the copy engine fetches it; no registers, no shared
// memory, nothing waits), in pieces of at most 64 KB, the range widened to 16-byte boundaries
__device__ __forceinline__ void kvq_prefetch_l2(const void *p, size_t bytes)
{
    if (!bytes) return;
    const size_t a = (size_t)p & ~(size_t)15, e = ((size_t)p + bytes + 15) & ~(size_t)15;
    for (size_t x = a; x < e; x += 65536) {
        const uint32_t sz = (uint32_t)(e - x < 65536 ? e - x : 65536);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x), "r"(sz) : "memory");
    }
}
__device__ __forceinline__ float h2f(uint32_t bits) { return __half2float(__ushort_as_half((unsigned short)(bits & 0xffff))); }
// fp16 pair (lo, hi) from two floats, round to nearest even, as one 32-bit register
__device__ __forceinline__ uint32_t kvq_h2pack(float lo, float hi)
{
    return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | (uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16;
}
// D = A·B + C on the tensor cores, m16n8k16, fp16 inputs, fp32 accumulation (PTX ISA "Matrix fragments for
// mma.m16n8k16 with floating point type"): lane = 4g + t holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1],
// a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g] (lower column / row
// in the low half); c = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}
__device__ __forceinline__ void kvq_mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

template <int B> struct U {
    static constexpr int C = B == 2 ? 16 : B == 3 ? 32 : 8; // channels per unit
    static constexpr int W = B == 3 ? 3 : 1;                // words per unit
    static constexpr int NL = 1 << B;
    static constexpr int MAXU = (KVQ_KVCACHE_MAX_HEAD_DIM + C - 1) / C;
};

struct DecP {
    const uint32_t *kcodes, *vcodes, *krow, *vrow, *kent, *vent;
    const float *vscale, *klut, *vlevels;
    const uint8_t *kz, *vz;
    const float2 *rlo, *rhi;
    const uint16_t *k16, *v16;
    const float *q;
    float *part;
    const int *len;
    int H, D, dpad, np, n_heads, g, qgroups, kw, vw, capq, n_exact, n_splits, chunk, nhb_max, ent_cap, nslots, prof;
    float scale;
};

// the split-K partial (m, l, acc) of a block without positions, for query heads 0..gn-1 at part0 + j·pstride:
// m = -inf, l = acc = 0 (combine gives it no weight)
__device__ inline void empty_partials(float *part0, size_t pstride, int gn, int D)
{
    for (int j = 0; j < gn; j++)
        for (int d = threadIdx.x; d < D + 2; d += blockDim.x) part0[j * pstride + d] = d == 0 ? -INFINITY : 0.f;
}

// per-query block reduction (up to 8 warps): v[gg] <- op over the block's threads of v[gg], in every thread
// (warp xor-tree, then lane 0 of each warp to red[gg * 8 + warp]; the caller separates reuses of red by a barrier)
template <int GQ, class Op>
__device__ __forceinline__ void block_reduce(float (&v)[GQ], float *red, Op op)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        for (int o = 16; o; o >>= 1) v[gg] = op(v[gg], __shfl_xor_sync(0xffffffffu, v[gg], o));
        if (lane == 0) red[gg * 8 + warp] = v[gg];
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        float r = red[gg * 8];
        for (int w = 1; w < nw; w++) r = op(r, red[gg * 8 + w]);
        v[gg] = r;
    }
}

// block-wide softmax statistics of sc[gg][0..n): sc <- exp(sc - m); returns m, l per query (up to 8 warps)
template <int GQ>
__device__ void chunk_softmax(float *sc, int chunk, int n, float *red, float *mo, float *lo)
{
    const int tid = threadIdx.x;
    float m[GQ], l[GQ];
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        m[gg] = -INFINITY;
        for (int t = tid; t < n; t += blockDim.x) m[gg] = fmaxf(m[gg], sc[gg * chunk + t]);
    }
    block_reduce<GQ>(m, red, [](float a, float b) { return fmaxf(a, b); });
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) {
        mo[gg] = m[gg];
        l[gg] = 0;
        for (int t = tid; t < n; t += blockDim.x) {
            float e = expf(sc[gg * chunk + t] - m[gg]);
            sc[gg * chunk + t] = e;
            l[gg] += e;
        }
    }
    block_reduce<GQ>(l, red, [](float a, float b) { return a + b; });
#pragma unroll
    for (int gg = 0; gg < GQ; gg++) lo[gg] = l[gg];
}

#ifndef KVQ_KVCACHE_CUDA_INST // a kernel of kvcache_cuda.cu alone (see the head of this file)
// exact region (fp16, post-RoPE keys): one block per (query head, sequence); the last partial slot
KVQ_ONE_UNIT __global__ void exact_decode(DecP p)
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
#endif

// partial slots a combine reads of the nslots per (query head, sequence): the exact region's partial is the last slot,
// written only when there is an exact region (n_exact > 0; without one exact_decode is not launched)
__host__ __device__ inline int combine_slots(size_t nslots, size_t n_exact) { return (int)(n_exact ? nslots : nslots - 1); }

// merge the partials pp[i·(D + 2) ...], i < nuse, of one (query head, sequence) into o[0, D) with the block's threads
// (D <= 4·blockDim.x); sm: COMBINE_SMEM floats of shared memory, not in use by other threads on entry. The slots'
// maxima are read by all threads at once; per tile of 256 slots the weights e^{m_i − M} go to shared memory; for
// D <= blockDim / 2 the threads form nsl = blockDim / D slices that sum every nsl-th slot of a dim (else each thread
// sums its up to 4 dims over all slots), the loads of 8 slots in flight; slots with m = −∞ (empty) weigh 0. The
// partials are read past L1 (__ldcg): when kivi_generic's last block merges, other blocks wrote them during the same
// kernel. (A thread looping over all slots of its dims is latency-bound at a few tens of slots: hence the slices.)
constexpr int COMBINE_SMEM = 256 + 32 + 256;
// the statistics half of a combine (combine_one, kivi's combine_wide), all nt threads of the block: M = the largest
// slot maximum m_i (through red[32]), then per tile of TS slots the weights e^{m_i − M} into wt[TS] (0 for empty
// slots), L += w·l_i over the thread's slots, and accumulate(i0, ni) once the tile's weights are in place. Returns M
template <int TS, class F>
__device__ __forceinline__ float combine_tiles(const float *pp, int nuse, size_t st, int nt, float *wt, float *red, float &L, F &&accumulate)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (nt + 31) >> 5;
    float M = -INFINITY;
    for (int i = tid; i < nuse; i += nt) M = fmaxf(M, __ldcg(pp + i * st));
    for (int k = 16; k; k >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, k));
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = red[0];
    for (int w = 1; w < nw; w++) M = fmaxf(M, red[w]);
    for (int i0 = 0; i0 < nuse; i0 += TS) {
        const int ni = min(TS, nuse - i0);
        __syncthreads(); // red read, the previous tile's weights used
        for (int i = tid; i < ni; i += nt) {
            const float m = __ldcg(pp + (i0 + i) * st);
            const float w = m == -INFINITY ? 0.f : expf(m - M);
            wt[i] = w;
            L = w != 0.f ? fmaf(w, __ldcg(pp + (i0 + i) * st + 1), L) : L;
        }
        __syncthreads();
        accumulate(i0, ni);
    }
    return M;
}
#ifndef KVQ_KVCACHE_CUDA_INST // kvcache_cuda.cu alone (see the head of this file)
KVQ_ONE_UNIT __device__ void combine_one(const float *pp, float *o, int D, int nuse, float *sm)
{
    constexpr int TS = 256;
    float *wt = sm, *red = sm + TS, *ss = red + 32; // weights [256], reduction [32], slice sums [nsl·D <= 256]
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = (nt + 31) >> 5;
    const int nsl = 2 * D <= nt && D * (nt / D) <= 256 ? nt / D : 1, q = nsl > 1 ? tid / D : 0, d0 = nsl > 1 ? tid % D : tid;
    const size_t st = (size_t)D + 2;
    float L = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    const float M = combine_tiles<TS>(pp, nuse, st, nt, wt, red, L, [&](int i0, int ni) {
        if (q < nsl) {
#pragma unroll 8
            for (int i = q; i < ni; i += nsl) {
                const float w = wt[i], *x = pp + (i0 + i) * st + 2 + d0;
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (d0 + k * nt < D && (k == 0 || nsl == 1)) {
                        const float xv = __ldcg(x + k * nt);
                        acc[k] = w != 0.f ? fmaf(w, xv, acc[k]) : acc[k];
                    }
            }
        }
    });
    for (int k = 16; k; k >>= 1) L += __shfl_xor_sync(0xffffffffu, L, k);
    __syncthreads();
    if (lane == 0) red[warp] = L;
    if (nsl > 1 && q < nsl) ss[q * D + d0] = acc[0];
    __syncthreads();
    L = 0.f;
    for (int w = 0; w < nw; w++) L += red[w];
    if (nsl > 1) {
        if (tid < D) {
            float x = 0.f;
            for (int j = 0; j < nsl; j++) x += ss[j * D + tid];
            o[tid] = M == -INFINITY ? 0.f : x / L;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; k++)
        if (tid + k * nt < D) o[tid + k * nt] = M == -INFINITY ? 0.f : acc[k] / L;
}
#endif

// merge the partials of slots [0, nuse) of nslots (the last ones unused: no exact region) per (query head, sequence),
// one block each (NUQ and the fp16 baseline; KIVI merges with combine_one: kv::combine_par, or kivi_generic's last
// block when kivi_generic runs alone). Each thread loops over the
// slots for its dims: with combine_one here NUQ at SmolLM2 heads B = 1 was slower on the H200
#ifndef KVQ_KVCACHE_CUDA_INST // a kernel of kvcache_cuda.cu alone (see the head of this file)
KVQ_ONE_UNIT __global__ void combine(const float *part, float *out, int n_heads, int D, int nslots, int nuse)
{
    const int qh = blockIdx.x, s = blockIdx.y;
    const float *pp = part + (size_t)(s * n_heads + qh) * nslots * (D + 2);
    float M = -INFINITY;
    for (int i = 0; i < nuse; i++) M = fmaxf(M, pp[i * (D + 2)]);
    float L = 0;
    if (M != -INFINITY)
        for (int i = 0; i < nuse; i++) L += pp[i * (D + 2)] == -INFINITY ? 0.f : expf(pp[i * (D + 2)] - M) * pp[i * (D + 2) + 1];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0;
        if (M != -INFINITY)
            for (int i = 0; i < nuse; i++)
                if (pp[i * (D + 2)] != -INFINITY) a += expf(pp[i * (D + 2)] - M) * pp[i * (D + 2) + 2 + d];
        out[((size_t)s * n_heads + qh) * D + d] = M == -INFINITY ? 0.f : a / L;
    }
}
#endif

// ---- v4: 2-, 3- and 4-bit keys and values ---------------------------------------------------------
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
// into the low byte of the table's (256-aligned) shared address, so a lookup is PRMT + LDS. 3-bit keys: a
// per-channel table of 8 floats, the unit's 3 words taken one at a time (see the key pass), a lookup is
// SHF + LOP3 + LDS.
// RoPE: w = conj(q̄)·e^{i p θ} per pair; the warp composes w at its tile's first position from the
// two-level table (e^{ipθ} = hi[p >> 6]·lo[p & 63], in fp32), a lane multiplies it by e^{i 8L θ} (per-block
// table) and steps to its next 7 positions with one complex multiply and then the Chebyshev recurrence
// w_{k+1} = 2cos θ·w_k − w_{k−1} (two FMAs per step). Score contribution of a pair: Re(w·k̂) = w.x·k0 − w.y·k1.
// Sparse key outliers (after the dense pass): the chunk's entries are expanded into a table entry ->
// position (a thread takes 8 consecutive positions and loads their 9 row pointers at once), then one thread
// per entry (4 entries' loads in flight per thread) adds its correction to the score atomically; the dense
// value at the zero code comes from the shared key table.
// Softmax statistics per block. Phase 3 (P·V) on the tensor cores (pv_mma): mma.m16n8k16 with the value levels
// (fp16, from a per-lane replicated byte table) as A (16 dims × 16 positions) and p·r (fp16) as B, fp32
// accumulators; Σ p·zp is added once per query head. Per-warp outputs are staged in the dead phase-1 tables
// and summed into the block's partial, to which the sparse value corrections are added with red.global.add
// (shared-memory float atomics are CAS loops on sm_90). Exactness: the value levels are fp16 numbers (both caches
// round them so: formats/KVCACHE.md) and p·r is split into two fp16 parts (high, low ·2^11, scaled by a power of two
// into fp16's normal range) that go in as B columns 0..3 and 4..7 of the same mma, so P·V matches the CPU cache's
// double arithmetic to ~1e-6 relative (a single fp16 p·r parted from it by ~3e-4, which greedy decoding amplified
// through later layers' code flips into logits 1-2 apart). 3-bit values: pv_mma3 (16-dim half-unit slots, a 6-bit
// index per dim and position pair).
// The RoPE step from the warp's tile start to a lane's first position, e^{i 8L θ}, is a per-block table.
// Phase 1's tables span at most 32 banks (16 words, or 16 float2), so no lookup pattern conflicts; phase
// 3's table is replicated per lane (entry stride 128 bytes), so neither does it.
#ifndef KVQ_PROF
#define KVQ_PROF 0 // profiling builds only: 1 skips the dense key pass, 2 the sparse key pass, 4 the dense P·V, 8 the sparse values
#endif
// a phase is skipped when its bit is set in KVQ_PROF or in p.prof (kvq_kvcache_cuda_attend sets p.prof from the
// environment variable KVQ_DEC_PROF, for the benchmark's time breakdown; the outputs are then wrong); 16 leaves out the
// L2 prefetches (the outputs stay right)
#define KVQ_SKIP(p, bit) ((KVQ_PROF | (p).prof) & (bit))
namespace v4 {
constexpr int NT4 = 256, NW4 = 8, TILE = 256, SPP = 2048; // threads, warps, positions per warp tile, sparse entries per piece

// dynamic shared memory (bytes): rho [npk] float4, r8 [npk][32] float2, qs [GQ][npk] float2, qt [NW4][GQ][npk]
// float2, sc [GQ][chunk], red [GQ][8], stat [3 GQ] (m, l, Σp·zp; floats), etok [SPP] u16,
// pr16 [2][GQ][chunk + 16] fp16 (p·r·S per position, high and low parts, zero past the chunk's last position). Static: tabs, 32 KB.
// (Phase 3 stages NW4·GQ·D floats of per-warp outputs over r8, qs and qt: 256·npk >= 128·D >= 32·GQ·D bytes
// because npk (key pairs, padded) >= D/2 and GQ <= 4, so head_dim adds nothing here.)
__host__ __device__ inline size_t smem_bytes(int gq, int npk, int chunk)
{
    return (size_t)16 * npk + (size_t)256 * npk + (size_t)8 * gq * npk * (1 + NW4) +
           (size_t)4 * ((size_t)gq * chunk + gq * 8 + 3 * gq) + 2 * SPP + (size_t)4 * gq * (chunk + 16);
}

// launch plan: chunk (a multiple of TILE) and splits for nq quantized positions and `per` blocks per split.
// Wave model: with b blocks resident per SM (launch bounds, shared memory incl. the 32 KB static table and the
// 1 KB the driver reserves per block), `per`·splits blocks run in ⌈per·splits / (n_sm·b)⌉ waves of
// (chunk/TILE + 1) tile-times each (+1: a block's fixed cost — tables, softmax, sparse pieces); the plan
// minimises that over chunks of at most 2048 positions (longer ones were slower on the H200), fewer splits on
// ties. max_splits > 0 caps the splits (and lifts the 2048 cap); if nothing fits the shared-memory budget the
// chunk is halved until it does.
inline void plan(size_t nq, size_t per, size_t n_sm, size_t max_splits, int gq, int npk, size_t smem_max,
                 size_t *chunk_out, size_t *splits_out)
{
    const size_t cmax = 65536 - TILE; // positions within a chunk are 16-bit (etok)
    const size_t ntiles = nq ? (nq + TILE - 1) / TILE : 1, smax = max_splits && max_splits < ntiles ? max_splits : ntiles;
    const size_t bmax = gq <= 2 ? 3 : 2, sm_bytes = 228 * 1024;
    size_t best_chunk = 0, best_cost = 0;
    for (size_t sp = 1; sp <= smax; sp++) {
        const size_t ct = (ntiles + sp - 1) / sp, chunk = ct * TILE, se = (ntiles + ct - 1) / ct;
        if (chunk > cmax || (chunk > 2048 && !max_splits)) continue; // longer chunks cost occupancy (measured)
        const size_t sm = smem_bytes(gq, npk, (int)chunk);
        if (sm > smem_max) continue;
        size_t b = sm_bytes / (sm + 32768 + 1024);
        if (b > bmax) b = bmax;
        if (b == 0) continue;
        const size_t waves = (per * se + n_sm * b - 1) / (n_sm * b), cost = waves * (ct + 1);
        if (!best_chunk || cost < best_cost) { best_chunk = chunk; best_cost = cost; }
    }
    size_t chunk = best_chunk;
    if (!chunk) { // nothing within the budget at <= max_splits splits: the largest chunk that fits
        chunk = ntiles * TILE < cmax ? ntiles * TILE : cmax / TILE * TILE;
        while (chunk > TILE && smem_bytes(gq, npk, (int)chunk) > smem_max) chunk = (chunk / 2 + TILE - 1) / TILE * TILE;
    }
    *chunk_out = chunk;
    *splits_out = nq ? (nq + chunk - 1) / chunk : 1;
}

// positions of the chunk's sparse entries (pieces of SPP entries), then apply(load(entry, position)) per entry:
// a thread loads SB entries' data before it applies any, so their memory latencies overlap
template <class L, class A>
__device__ __forceinline__ void sparse_pass(const uint32_t *row, int n, uint16_t *etok, L load, A apply)
{
    constexpr int SB = 4;
    const uint32_t E0 = __ldg(row), E1 = __ldg(row + n);
    for (uint32_t pb = E0; pb < E1; pb += SPP) {
        const uint32_t pe = min(pb + (uint32_t)SPP, E1);
        // a thread takes 8 consecutive positions and loads their 9 row pointers at once (a loop over positions
        // with one load pair per step would wait for memory at every step)
        for (int t0 = 8 * threadIdx.x; t0 < n; t0 += 8 * NT4) {
            uint32_t r[9];
#pragma unroll
            for (int k = 0; k < 9; k++) r[k] = __ldg(row + min(t0 + k, n));
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t a = max(r[k], pb), b = min(r[k + 1], pe);
                for (uint32_t e = a; e < b; e++) etok[e - pb] = (uint16_t)(t0 + k);
            }
        }
        __syncthreads();
        for (uint32_t e0 = pb + threadIdx.x; e0 < pe; e0 += SB * NT4) {
            decltype(load(0u, 0)) v[SB];
#pragma unroll
            for (int k = 0; k < SB; k++) {
                const uint32_t e = min(e0 + (uint32_t)(k * NT4), pe - 1);
                v[k] = load(e, (int)etok[e - pb]);
            }
#pragma unroll
            for (int k = 0; k < SB; k++)
                if (e0 + (uint32_t)(k * NT4) < pe) apply(v[k]);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ float2 cmul(float2 a, float2 b) { return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }

// Phase 3 (P·V) on the tensor cores: out[query][d] += Σ_t (p_t·r_t)·level[code_t,d] as mma.m16n8k16 with
// A = the value levels transposed (16 dims × 16 positions, fp16) and B = p·r (16 positions × 8 query columns,
// fp16; columns past gn are zero), fp32 accumulators. Per k-tile of 16 positions lane 4g + t reads, of the
// value rows 2t, 2t+1, 2t+8, 2t+9, the BPT bytes [pass·8·BPT + g·BPT, +BPT) (token-major rows: the 8 lanes of
// a row read 8·BPT contiguous bytes). The codes of positions 2t and 2t+1 are merged per dim into one byte
// (4-bit: the two positions' codes of one dim; 2-bit: of two dims), which indexes a table replicated per lane
// that returns the A fragment register(s) directly: fp16 (level at 2t, level at 2t+1) of one dim (2-bit: of
// two dims). A-row g of m-tile j is the dim pair of byte pass·8·BPT + g·BPT + j (2-bit: two m-tiles per
// byte), so the lane that holds row g's outputs knows their dims without any exchange.
// tabs: 4-bit [256 bytes][32 lanes] fp16x2, 2-bit [256 bytes][16 lanes] 2 × fp16x2: entry stride 128 bytes,
// a lane reads only its own bank(s), no conflicts.
// the P·V accumulators' low parts (B columns 4..7: lane t + 2's 2t + 4, 2t + 5) folded into the high parts (columns
// 0..3: lane t's 2t, 2t + 1) and descaled: (hi + lo·2^-11)·inv_s (see nuq_decode's phase 3); every lane takes part
template <int MT> __device__ __forceinline__ void pv_fold(float (&acc)[MT][4], float inv_s)
{
#pragma unroll
    for (int j = 0; j < MT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = (acc[j][i] + __shfl_xor_sync(0xffffffffu, acc[j][i], 2) * (1.f / 2048.f)) * inv_s;
}

// the 3-bit P·V's stage write (pv_mma3, pv_mma3_v5): A-row g of m-tile j is dim 16·sl + 2j (+1 for row g + 8),
// columns 2t, 2t + 1 query heads; every (query < gn, dim < D) of the warp's slice wst [query][dim]
__device__ __forceinline__ void pv_stage3(const float (&acc)[8][4], int sl, int t, int D, int gn, float *wst)
{
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int d = 16 * sl + 2 * j + (i >> 1), qq = 2 * t + (i & 1);
            if (d < D && qq < gn) wst[qq * D + d] = acc[j][i];
        }
}

template <int BV, int BPT>
__device__ __forceinline__ void pv_mma(const DecP &p, int s, int h, int q0, int n, int gn, const uint32_t *pr16w, const uint32_t *prlo,
                                       int chpw, const uint32_t *tabs, float *stage, int gstride, float inv_s)
{
    constexpr int MT = BV == 4 ? BPT : 2 * BPT; // m-tiles (16 dims) per pass
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int D = p.D, rowb = 4 * p.vw, npass = (rowb + 8 * BPT - 1) / (8 * BPT), nkt = (n + 15) >> 4;
    const unsigned char *vc = (const unsigned char *)(p.vcodes + (size_t)(s * p.H + h) * p.capq * p.vw);
    const uint32_t lanea = BV == 4 ? (uint32_t)lane * 4u : (uint32_t)(lane & 15) * 8u;
    const char *tb = (const char *)tabs;
    // B columns 0..3: the high fp16 parts of p·r·S of query heads 0..3 (pr16w), columns 4..7 their low parts ·2^11
    // (prlo; see nuq_decode's phase 3), so one mma gives both; the lanes of columns 4..7 hand theirs over at the end
    const int gc = g & 3;
    const bool bq = gc < gn;
    const uint32_t *prb = g < 4 ? pr16w : prlo;
    for (int pass = 0; pass < npass; pass++) {
        const int byte0 = pass * 8 * BPT + g * BPT;
        const bool has = byte0 < rowb;
        float acc[MT][4];
#pragma unroll
        for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        // code bytes of rows 2t, 2t+1, 2t+8, 2t+9 of k-tile kt (positions past the chunk read allocated rows; their
        // p·r is 0)
        constexpr int NWW = (BPT + 3) / 4;
        auto load = [&](int kt, uint32_t (&dst)[4][NWW]) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const bool ok = has && kt < nkt;
                const size_t row = (size_t)(q0 + kt * 16 + 2 * t + (r & 1) + 8 * (r >> 1));
                const unsigned char *src = vc + row * rowb + byte0;
                if (BPT == 8) {
                    const uint2 x = ok ? __ldcs((const uint2 *)src) : make_uint2(0u, 0u);
                    dst[r][0] = x.x;
                    dst[r][NWW - 1] = x.y;
                } else if (BPT == 4) {
                    dst[r][0] = ok ? __ldcs((const uint32_t *)src) : 0u;
                } else {
                    dst[r][0] = ok ? (uint32_t)__ldcs((const unsigned short *)src) : 0u;
                }
            }
        };
        // warp w takes the contiguous k-tiles [kb, ke); the next two k-tiles' bytes are in flight meanwhile
        const int per = (nkt + NW4 - 1) / NW4, kb = warp * per, ke = min(nkt, kb + per);
        uint32_t wn[4][NWW], wn2[4][NWW];
        load(kb < ke ? kb : nkt, wn);
        load(kb + 1 < ke ? kb + 1 : nkt, wn2);
#pragma unroll 1
        for (int kt = kb; kt < ke; kt++) {
            const int k0 = kt * 16;
            const uint32_t b0 = bq ? prb[gc * chpw + (k0 >> 1) + t] : 0u, b1 = bq ? prb[gc * chpw + (k0 >> 1) + t + 4] : 0u;
            uint32_t w[4][NWW];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int i = 0; i < NWW; i++) {
                    w[r][i] = wn[r][i];
                    wn[r][i] = wn2[r][i];
                }
            load(kt + 2 < ke ? kt + 2 : nkt, wn2);
            // combine the codes of the two positions of a fragment register per dim: byte b of c[0] / c[1] holds
            // (position 2t, 2t+1)'s codes of dims 2b / 2b+1 (4-bit) or dims 4b, 4b+1 / 4b+2, 4b+3 (2-bit) of the
            // word; c[2], c[3] the same for positions 2t+8, 2t+9: one lookup per byte gives fragment registers
#pragma unroll
            for (int wi = 0; wi < NWW; wi++) {
                const uint32_t c[4] = {(w[0][wi] & 0x0F0F0F0Fu) | ((w[1][wi] << 4) & 0xF0F0F0F0u),
                                       ((w[0][wi] >> 4) & 0x0F0F0F0Fu) | (w[1][wi] & 0xF0F0F0F0u),
                                       (w[2][wi] & 0x0F0F0F0Fu) | ((w[3][wi] << 4) & 0xF0F0F0F0u),
                                       ((w[2][wi] >> 4) & 0x0F0F0F0Fu) | (w[3][wi] & 0xF0F0F0F0u)};
#pragma unroll
                for (int b4 = 0; b4 < (BPT < 4 ? BPT : 4); b4++) {
                    const int bb = 4 * wi + b4, sh = 8 * b4;
                    uint32_t off[4];
#pragma unroll
                    for (int r = 0; r < 4; r++) off[r] = ((sh >= 7 ? (c[r] >> (sh - 7)) : (c[r] << 7)) & 0x7F80u) | lanea;
                    if (BV == 4) {
                        // A rows g / g+8: dims 2·byte / 2·byte + 1; columns 2t, 2t+1 / 2t+8, 2t+9
                        kvq_mma16816(acc[bb], *(const uint32_t *)(tb + off[0]), *(const uint32_t *)(tb + off[1]),
                                     *(const uint32_t *)(tb + off[2]), *(const uint32_t *)(tb + off[3]), b0, b1);
                    } else {
                        const uint2 y0 = *(const uint2 *)(tb + off[0]), y1 = *(const uint2 *)(tb + off[1]);
                        const uint2 y2 = *(const uint2 *)(tb + off[2]), y3 = *(const uint2 *)(tb + off[3]);
                        kvq_mma16816(acc[2 * bb], y0.x, y0.y, y2.x, y2.y, b0, b1);     // dims 4·byte, 4·byte + 1
                        kvq_mma16816(acc[2 * bb + 1], y1.x, y1.y, y3.x, y3.y, b0, b1); // dims 4·byte + 2, + 3
                    }
                }
            }
        }
        // rows g / g+8 of m-tile j: dims 2·byte, 2·byte + 1 (4-bit, byte = byte0 + j); 4·byte + 2(j & 1) (+1) (2-bit,
        // byte = byte0 + j/2); columns 2t, 2t+1: query heads. Every warp writes every (query < gn, dim < D) of its
        // stage slice [warp][query][dim] (plain stores; the caller sums the warps)
        pv_fold(acc, inv_s);
        if (has) {
#pragma unroll
            for (int j = 0; j < MT; j++) {
                const int d0 = BV == 4 ? 2 * (byte0 + j) : 4 * (byte0 + (j >> 1)) + 2 * (j & 1);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int d = d0 + (i >> 1), qq = 2 * t + (i & 1);
                    if (d < D && qq < gn) stage[warp * gstride + qq * D + d] = acc[j][i];
                }
            }
        }
    }
}

// the 3-bit code at bit b of a 64-bit stream (hi:lo), shifted left by SH and masked to its three bits (b a
// compile-time constant after unrolling: one shift and one mask, a funnel shift where the code straddles the words)
template <int SH> __device__ __forceinline__ uint32_t code3_sh(uint32_t lo, uint32_t hi, int b)
{
    uint32_t v;
    if (b + 3 <= 32) v = SH >= b ? lo << (SH - b) : lo >> (b - SH);
    else if (b >= 32) v = SH >= b - 32 ? hi << (SH - (b - 32)) : hi >> (b - 32 - SH);
    else v = (uint32_t)((((uint64_t)hi << 32) | lo) >> b) << SH;
    return v & (7u << SH);
}

// Phase 3 for 3-bit values, as pv_mma: a 32-channel unit is 3 words (96 bits) of a token-major row, so lane group g
// takes the 16-dim slot sl = pass·8 + g (half a unit: bits [48·(sl & 1), +48) of unit sl / 2), two word loads per row
// (words 3·(sl/2) + (sl & 1) and the next). The codes of positions 2t and 2t+1 of a dim form a 6-bit index into a
// table replicated per lane (64 entries × 32 lanes of fp16x2 (level at 2t, level at 2t+1): entry stride 128 bytes,
// a lane reads only its own bank). A-row g of m-tile j = dim 16·sl + 2j, row g + 8 = dim 16·sl + 2j + 1.
__device__ __forceinline__ void pv_mma3(const DecP &p, int s, int h, int q0, int n, int gn, const uint32_t *pr16w, const uint32_t *prlo,
                                        int chpw, const uint32_t *tabs, float *stage, int gstride, float inv_s)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int D = p.D, vw = p.vw, nsl = 2 * (vw / 3), npass = (nsl + 7) / 8, nkt = (n + 15) >> 4;
    const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * vw;
    const char *tb = (const char *)tabs;
    const uint32_t lanea = (uint32_t)lane * 4u;
    // B columns 0..3: the high fp16 parts of p·r·S of query heads 0..3 (pr16w), columns 4..7 their low parts ·2^11
    // (prlo; see nuq_decode's phase 3), so one mma gives both; the lanes of columns 4..7 hand theirs over at the end
    const int gc = g & 3;
    const bool bq = gc < gn;
    const uint32_t *prb = g < 4 ? pr16w : prlo;
    for (int pass = 0; pass < npass; pass++) {
        const int sl = pass * 8 + g, hf = sl & 1;
        const bool has = sl < nsl;
        const int wo = has ? 3 * (sl >> 1) + hf : 0;
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        // the two words of rows 2t, 2t+1, 2t+8, 2t+9 of k-tile kt (positions past the chunk read allocated rows; their
        // p·r is 0)
        auto load = [&](int kt, uint32_t (&dst)[4][2]) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const bool ok = has && kt < nkt;
                const uint32_t *src = vc + (size_t)(q0 + kt * 16 + 2 * t + (r & 1) + 8 * (r >> 1)) * vw + wo;
                dst[r][0] = ok ? __ldcs(src) : 0u;
                dst[r][1] = ok ? __ldcs(src + 1) : 0u;
            }
        };
        const int per = (nkt + NW4 - 1) / NW4, kb = warp * per, ke = min(nkt, kb + per);
        uint32_t wn[4][2], wn2[4][2];
        load(kb < ke ? kb : nkt, wn);
        load(kb + 1 < ke ? kb + 1 : nkt, wn2);
#pragma unroll 1
        for (int kt = kb; kt < ke; kt++) {
            const int k0 = kt * 16;
            const uint32_t b0 = bq ? prb[gc * chpw + (k0 >> 1) + t] : 0u, b1 = bq ? prb[gc * chpw + (k0 >> 1) + t + 4] : 0u;
            uint32_t lo[4], hi[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                // the slot's 48 bits as (hi:lo)
                lo[r] = hf ? (wn[r][0] >> 16) | (wn[r][1] << 16) : wn[r][0];
                hi[r] = hf ? wn[r][1] >> 16 : wn[r][1];
                wn[r][0] = wn2[r][0];
                wn[r][1] = wn2[r][1];
            }
            load(kt + 2 < ke ? kt + 2 : nkt, wn2);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                uint32_t a[4];
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int k = 2 * j + (x & 1), r = 2 * (x >> 1); // a0: dim 2j rows r0 r1, a1: dim 2j+1, a2/a3: rows r2 r3
                    const uint32_t off = code3_sh<7>(lo[r], hi[r], 3 * k) | code3_sh<10>(lo[r + 1], hi[r + 1], 3 * k) | lanea;
                    a[x] = *(const uint32_t *)(tb + off);
                }
                kvq_mma16816(acc[j], a[0], a[1], a[2], a[3], b0, b1);
            }
        }
        pv_fold(acc, inv_s);
        if (has) pv_stage3(acc, sl, t, D, gn, stage + warp * gstride);
    }
}

// a 32-bit word of shared memory at shared address a
__device__ __forceinline__ uint32_t kvq_ldsu(uint32_t a)
{
#ifdef KVQ_EMU
    const float f = kvq_lds(a);
    uint32_t v;
    memcpy(&v, &f, 4);
    return v;
#else
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
#endif
}
// funnel shift right: bits [s, s + 32) of the 64-bit (hi:lo), s in [0, 32)
__device__ __forceinline__ uint32_t kvq_shf_r(uint32_t lo, uint32_t hi, uint32_t s)
{
#ifdef KVQ_EMU
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (s & 31));
#else
    return __funnelshift_r(lo, hi, s);
#endif
}

// Phase 3 for 3-bit values in v5: pv_mma3's fragments, table and mma, with the 6-bit table index of a dim built from
// both positions' words at once. Per row pair (positions 2t, 2t+1; 2t+8, 2t+9) the slot's fields 0-9 (bits 0-29: L)
// and 10-15 (bits 30-47: Hh) of the two rows are merged with one LOP3 each into words whose 6-bit fields are
// (code of the first row | code of the second row << 3): even fields in place (first row's bits under EM, the second
// row's shifted up by 3 into the odd fields' bits), odd fields shifted down by 3; then a dim's index costs one shift
// and one LOP3 (mask and the lane's table column) instead of two of each. The table index and entries are pv_mma3's,
// so the results are bit-identical.
__device__ __forceinline__ void pv_mma3_v5(const DecP &p, int s, int h, int q0, int n, int gn, const uint32_t *pr16w,
                                           const uint32_t *prlo, int chpw, const uint32_t *tabs, float *stage, int gstride,
                                           float inv_s)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int D = p.D, vw = p.vw, nsl = 2 * (vw / 3), npass = (nsl + 7) / 8, nkt = (n + 15) >> 4;
    const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * vw;
    const uint32_t tl = kvq_saddr(tabs) | (uint32_t)lane * 4u; // tabs: 8192-byte aligned (the index ORs into bits 7-12)
    constexpr uint32_t EM = 0x071C71C7u; // fields 0, 2, 4, 6, 8 (bits 3k..3k+2, k even)
    // B columns 0..3 high parts of p·r·S (pr16w), 4..7 low parts (prlo), as pv_mma
    const int gc = g & 3;
    const bool bq = gc < gn;
    const int per = (nkt + NW4 - 1) / NW4, kb = warp * per, ke = min(nkt, kb + per);
    for (int pass = 0; pass < npass; pass++) {
        const int sl = pass * 8 + g, hf = sl & 1;
        const bool has = sl < nsl;
        const int wo = has ? 3 * (sl >> 1) + hf : 0;
        const uint32_t sh = 16u * (uint32_t)hf;
        float acc[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        // row r of k-tile kt: src[r] + kt·16·vw (rows 2t, 2t+1, 2t+8, 2t+9; positions past the chunk read allocated rows,
        // their p·r is 0); the k-tile two ahead is in flight
        const uint32_t *src[4];
#pragma unroll
        for (int r = 0; r < 4; r++) src[r] = vc + (size_t)(q0 + kb * 16 + 2 * t + (r & 1) + 8 * (r >> 1)) * vw + wo;
        const size_t kstep = (size_t)16 * vw;
        uint32_t wn[4][2], wn2[4][2];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const bool ok0 = has && kb < ke, ok1 = has && kb + 1 < ke;
            wn[r][0] = ok0 ? __ldcs(src[r]) : 0u;
            wn[r][1] = ok0 ? __ldcs(src[r] + 1) : 0u;
            wn2[r][0] = ok1 ? __ldcs(src[r] + kstep) : 0u;
            wn2[r][1] = ok1 ? __ldcs(src[r] + kstep + 1) : 0u;
            src[r] += 2 * kstep;
        }
        const uint32_t *pb = (g < 4 ? pr16w : prlo) + (bq ? gc : 0) * chpw + kb * 8 + t; // p·r of query gc, positions 2t, 2t+1 of k-tile kb
#pragma unroll 1
        for (int kt = kb; kt < ke; kt++, pb += 8) {
            const uint32_t b0 = bq ? pb[0] : 0u, b1 = bq ? pb[4] : 0u;
            uint32_t L[4], Hh[4];
            const bool ok = has && kt + 2 < ke;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                L[r] = kvq_shf_r(wn[r][0], wn[r][1], sh);    // slot bits 0-31
                Hh[r] = kvq_shf_r(L[r], wn[r][1] >> sh, 30); // slot bits 30-47 (fields 10-15) at 0-17
                wn[r][0] = wn2[r][0];
                wn[r][1] = wn2[r][1];
                wn2[r][0] = ok ? __ldcs(src[r]) : 0u;
                wn2[r][1] = ok ? __ldcs(src[r] + 1) : 0u;
                src[r] += kstep;
            }
            // z[rp][0..3]: fields 0-9 even / odd, 10-15 even / odd of row pair rp (rows 2rp, 2rp + 1)
            uint32_t z[2][4];
#pragma unroll
            for (int rp = 0; rp < 2; rp++) {
                const int ra = 2 * rp, rb = ra + 1;
                z[rp][0] = (L[ra] & EM) | ((L[rb] << 3) & ~EM);
                z[rp][1] = ((L[ra] >> 3) & EM) | (L[rb] & ~EM);
                z[rp][2] = (Hh[ra] & EM) | ((Hh[rb] << 3) & ~EM);
                z[rp][3] = ((Hh[ra] >> 3) & EM) | (Hh[rb] & ~EM);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                uint32_t a[4];
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int k = 2 * j + (x & 1), rp = x >> 1;
                    const int w = (k >= 10 ? 2 : 0) + (k & 1), b = k >= 10 ? 3 * ((k - 10) & ~1) : 3 * (k & ~1); // index at bits b..b+5
                    const uint32_t zz = z[rp][w];
                    a[x] = kvq_ldsu(((b >= 7 ? zz >> (b - 7) : zz << (7 - b)) & 0x1F80u) | tl);
                }
                kvq_mma16816(acc[j], a[0], a[1], a[2], a[3], b0, b1);
            }
        }
        pv_fold(acc, inv_s);
        if (has) pv_stage3(acc, sl, t, D, gn, stage + warp * gstride);
    }
}

// VER 4: the v4 kernel; 5: v5 (see the head of v4: the same kernel with pv_mma3_v5 for 3-bit values)
template <int BK, int BV, int GQ, int VER = 4>
__global__ void __launch_bounds__(256, (GQ <= 2 ? 3 : 2)) nuq_decode(DecP p)
{
    constexpr int CK = BK == 2 ? 16 : BK == 3 ? 32 : 8, PK = CK / 2, NLK = 1 << BK, NLV = 1 << BV, WK = BK == 3 ? 3 : 1;
    static_assert(BK >= 2 && BK <= 4 && BV >= 2 && BV <= 4, "v4: 2-, 3- and 4-bit codes");
    // phase 1: the key table ktab = tabs[0, 4096): 4-bit [channel][16] float, 2-bit [pair][16] float2 (<= 16 KB at
    // head_dim 256); phase 3: the value table replicated per lane (32 KB, pv_mma)
    KVQ_STATIC_SMEM(float, tabs, 8192, 256);
    float *ktab = tabs;
    KVQ_DYN_SMEM(float4, sm4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.z, h = blockIdx.y / p.qgroups, qg = blockIdx.y % p.qgroups;
    const int gq0 = qg * GQ, gn = min(GQ, p.g - gq0);
    const int D = p.D, np = p.np, nuk = p.kw / WK, npk = nuk * PK; // nuk: key units
    const int nq = max(0, p.len[s] - p.n_exact);
    const int q0 = blockIdx.x * p.chunk, q1 = min(q0 + p.chunk, nq);
    float *part0 = p.part + ((size_t)(s * p.n_heads + h * p.g + gq0) * p.nslots + blockIdx.x) * (D + 2);
    const size_t pstride = (size_t)p.nslots * (D + 2);
    if (q0 >= q1) {
        empty_partials(part0, pstride, gn, D);
        return;
    }
    const int n = q1 - q0;
    // the chunk's sparse row pointers, value scales and sparse entries into L2 now, so that the sparse passes (latency-
    // bound: row pointers, then entries, then their corrections) find them there after the key pass; the last warp
    // (its lane 0 waits for the four row pointers that bound the entries)
    if (!KVQ_SKIP(p, 16) && tid == NT4 - 32) {
        const size_t hb = (size_t)s * p.H + h;
        const uint32_t *kr = p.krow + hb * (p.capq + 1) + q0, *vr = p.vrow + hb * (p.capq + 1) + q0;
        kvq_prefetch_l2(kr, (size_t)(n + 1) * 4);
        kvq_prefetch_l2(vr, (size_t)(n + 1) * 4);
        kvq_prefetch_l2((const float2 *)p.vscale + (size_t)s * p.capq + q0, (size_t)n * 8);
        const uint32_t k0 = __ldg(kr), k1 = __ldg(kr + n), v0 = __ldg(vr), v1 = __ldg(vr + n);
        kvq_prefetch_l2(p.kent + hb * p.ent_cap + k0, (size_t)(k1 - k0) * 4);
        kvq_prefetch_l2(p.vent + hb * p.ent_cap + v0, (size_t)(v1 - v0) * 4);
    }
    float4 *rho = sm4;                                // [npk] (e^{iθ}, 2 cos θ, 0)
    float2 *r8 = (float2 *)(rho + npk);               // [npk][32] e^{i 8m θ}
    float2 *qs = r8 + 32 * npk;                       // [GQ][npk] conj(q̄)·scale
    float2 *qt = qs + GQ * npk;                       // [NW4][GQ][npk] conj(q̄)·scale·e^{i p θ} at the warp's tile start
    float *sc = (float *)(qt + NW4 * GQ * npk);       // [GQ][chunk]
    float *red = sc + GQ * p.chunk;                   // [GQ][8]
    float *stat = red + GQ * 8;                       // m[GQ], l[GQ], Σ p·zp [GQ]
    uint16_t *etok = (uint16_t *)(stat + 3 * GQ);     // [SPP]
    const int chpw = (p.chunk + 16) / 2;              // pr16 row stride in words (≡ 8 mod 32 words: no bank conflicts)
    uint32_t *pr16w = (uint32_t *)(etok + SPP);       // [GQ][chunk + 16] fp16

    // ---- tables
    {
        const float *kl = p.klut + (size_t)h * D * NLK;
        if (BK == 3) {
            for (int i = tid; i < nuk * 32 * 8; i += NT4) ktab[i] = (i >> 3) < D ? __ldg(kl + i) : 0.f;
        } else if (BK == 4) {
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
    }
    __syncthreads();

    // ---- phase 1: dense scores, lanes along positions
    if (!KVQ_SKIP(p, 1)) {
        const uint32_t kt = kvq_saddr(ktab);
        const int ntile = (n + TILE - 1) / TILE;
        const uint32_t *kc = p.kcodes + (size_t)(s * p.H + h) * p.kw * p.capq;
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
            // score contributions of key pair i at the lane's 8 positions (ka / kb2: its two channels' dequantized keys)
            auto pair_fma = [&](int i, const float (&ka)[8], const float (&kb2)[8]) {
                const float2 e = r8[i * 32 + lane]; // e^{i 8 lane θ}: from the tile start to the lane's first position
                const float4 r4 = rho[i];
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
            };
            if constexpr (BK == 3) {
                // 3-bit: a unit is 3 words (32 channels, channel c at bits [3c, 3c+3) of the 96-bit stream); the words
                // are taken one at a time (the lane's 8 positions' word as two 16-byte loads, the next word in flight),
                // the previous word kept for the channels that straddle (10 and 21). Word x of a unit completes the
                // pairs [0, 5), [5, 10), [10, 16). Table: ktab [channel][8] float (32 bytes per channel), so a lookup is
                // (the channel's 32-byte-aligned address | code·4): one shift and one LOP3, then LDS
                uint32_t pw[8], cw[8];
                {
                    uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
                    if (live) {
                        x0 = __ldcs((const uint4 *)(kc + g0));
                        x1 = __ldcs((const uint4 *)(kc + g0 + 4));
                    }
                    cw[0] = x0.x; cw[1] = x0.y; cw[2] = x0.z; cw[3] = x0.w; cw[4] = x1.x; cw[5] = x1.y; cw[6] = x1.z; cw[7] = x1.w;
#pragma unroll
                    for (int k = 0; k < 8; k++) pw[k] = 0u;
                }
#pragma unroll 1
                for (int u = 0; u < nuk; u++) {
#pragma unroll
                    for (int x = 0; x < 3; x++) {
                        const int wnext = 3 * u + x + 1;
                        uint4 b0 = make_uint4(0, 0, 0, 0), b1 = b0; // the next word, in flight
                        if (live && wnext < 3 * nuk) {
                            b0 = __ldcs((const uint4 *)(kc + (size_t)wnext * p.capq + g0));
                            b1 = __ldcs((const uint4 *)(kc + (size_t)wnext * p.capq + g0 + 4));
                        }
                        const uint32_t cb = kt + (uint32_t)u * 1024u; // channel 32u of the table
#pragma unroll
                        for (int jj = (x == 0 ? 0 : x == 1 ? 5 : 10); jj < (x == 0 ? 5 : x == 1 ? 10 : 16); jj++) {
                            float ka[8], kb2[8];
#pragma unroll
                            for (int c2 = 0; c2 < 2; c2++) {
                                const int c = 2 * jj + c2, bit = 3 * c - 32 * (x - 1); // bit of the code in (cw:pw)
#pragma unroll
                                for (int k = 0; k < 8; k++) {
                                    const uint32_t code4 = code3_sh<2>(pw[k], cw[k], bit);
                                    const float v = kvq_lds((cb + (uint32_t)c * 32u) | code4);
                                    if (c2) kb2[k] = v;
                                    else ka[k] = v;
                                }
                            }
                            pair_fma(u * PK + jj, ka, kb2);
                        }
                        const uint32_t nx[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                        for (int k = 0; k < 8; k++) {
                            pw[k] = cw[k];
                            cw[k] = nx[k];
                        }
                    }
                }
            } else {
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
                    pair_fma(u * PK + jj, ka, kb2);
                }
                a0 = b0;
                a1 = b1;
            }
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
    // the value rows of this warp's phase-3 k-tiles (pv_mma / pv_mma3: the contiguous k-tiles [kb, ke)) into L2 as the
    // warp leaves the key pass, to arrive during the sparse key pass and the softmax
    if (!KVQ_SKIP(p, 16) && lane == 0) {
        const int nkt = (n + 15) >> 4, per = (nkt + NW4 - 1) / NW4, kb = warp * per, ke = min(nkt, kb + per);
        if (kb < ke)
            kvq_prefetch_l2(p.vcodes + ((size_t)(s * p.H + h) * p.capq + q0 + 16 * kb) * p.vw, (size_t)16 * (ke - kb) * p.vw * 4);
    }
    __syncthreads();
    // sparse key outliers
    if (!KVQ_SKIP(p, 2)) {
        const uint32_t *kent = p.kent + ((size_t)s * p.H + h) * p.ent_cap;
        const int kzc = p.kz[h];
        struct KE { int t, d; float corr; float2 ep; };
        sparse_pass(p.krow + ((size_t)s * p.H + h) * (p.capq + 1) + q0, n, etok, [&](uint32_t e, int t) {
            const uint32_t en = __ldg(kent + e);
            const int d = en >> 16, i = d >> 1, pos = p.n_exact + q0 + t;
            KE x;
            x.t = t;
            x.d = d;
            // the dense value at the zero code from the shared key table (4-bit: [channel][code], 2-bit: [pair][nibble])
            x.corr = h2f(en) - (BK == 4 ? ktab[d * 16 + kzc] : BK == 3 ? ktab[d * 8 + kzc] : ktab[2 * (i * 16 + (kzc | kzc << 2)) + (d & 1)]);
            x.ep = cmul(__ldg(p.rhi + (size_t)(pos >> 6) * np + i), __ldg(p.rlo + i * 64 + (pos & 63)));
            return x;
        }, [&](const KE &x) {
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                const float2 w = cmul(qs[gg * npk + (x.d >> 1)], x.ep);
                atomicAdd(&sc[gg * p.chunk + x.t], (x.d & 1) ? -x.corr * w.y : x.corr * w.x);
            }
        });
    }
    chunk_softmax<GQ>(sc, p.chunk, n, red, stat, stat + GQ);
    __syncthreads();

    // ---- phase 3: P·V on the tensor cores (pv_mma); the value table replaces the key table in tabs
    {
        const float *vl = p.vlevels + h * NLV;
        // v5, 3-bit values: the table (8 KB) at the first 8192-byte boundary in tabs (32 KB, 256-byte aligned), so that
        // pv_mma3_v5 ORs index and lane into its address
        uint32_t *tw = (uint32_t *)tabs + (VER >= 5 && BV == 3 ? ((8192u - (kvq_saddr(tabs) & 8191u)) & 8191u) / 4 : 0u);
        for (int i = tid; i < (BV == 3 ? 2048 : 8192); i += NT4) {
            const int e = i >> 5;
            // e = the combined byte of two positions (pv_mma): 4-bit (code of the first, of the second) -> their
            // levels; 2-bit: bits 0-1 / 2-3 the first position's codes of two dims, bits 4-5 / 6-7 the second's ->
            // (dim 0 of both positions, dim 1 of both positions)
            // (dim 0 of both positions, dim 1 of both positions); 3-bit (pv_mma3): bits 0-2 the first position's code,
            // bits 3-5 the second's
            if (BV == 4) tw[i] = kvq_h2pack(__ldg(vl + (e & 15)), __ldg(vl + (e >> 4)));
            else if (BV == 3) tw[i] = kvq_h2pack(__ldg(vl + (e & 7)), __ldg(vl + (e >> 3)));
            else tw[i] = (i & 1) ? kvq_h2pack(__ldg(vl + ((e >> 2) & 3)), __ldg(vl + (e >> 6)))
                                 : kvq_h2pack(__ldg(vl + (e & 3)), __ldg(vl + ((e >> 4) & 3)));
        }
        // p·r·S per position as two fp16 parts, hi = fp16(a) and lo = fp16((a - hi)·2^11) (zero up to the next multiple
        // of 16; a - hi is exact in fp32), S = 2^(14 - e) with the chunk's largest r < 2^e, so that a = p·r·S < 2^14
        // stays in fp16's normal range (p <= 1); Σ p·zp per query head in fp32. The levels are fp16 numbers (the
        // caches round them so), so the mma's products are exact and P·V is exact to ~2^-22 relative.
        const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq + q0;
        const int n16 = (n + 15) & ~15;
        float rmx[1] = {0.f};
        for (int t2 = tid; t2 < n; t2 += NT4) rmx[0] = fmaxf(rmx[0], fabsf(__ldg(vs + t2).y));
        block_reduce<1>(rmx, red, [](float a, float b) { return fmaxf(a, b); });
        int ex;
        frexpf(rmx[0], &ex);
        ex = 14 - ex < 126 ? 14 - ex : 126;
        const float sa = ldexpf(1.f, ex), inv_s = ldexpf(1.f, -ex);
        __syncthreads(); // red is reused below
        uint32_t *prlo = pr16w + GQ * chpw;
        float pzl[GQ];
#pragma unroll
        for (int gg = 0; gg < GQ; gg++) pzl[gg] = 0.f;
        for (int t2 = 2 * tid; t2 < n16; t2 += 2 * NT4) {
            const float2 z0 = t2 < n ? __ldg(vs + t2) : make_float2(0.f, 0.f), z1 = t2 + 1 < n ? __ldg(vs + t2 + 1) : make_float2(0.f, 0.f);
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                const float e0 = t2 < n ? sc[gg * p.chunk + t2] : 0.f, e1 = t2 + 1 < n ? sc[gg * p.chunk + t2 + 1] : 0.f;
                const float a0 = e0 * z0.y * sa, a1 = e1 * z1.y * sa;
                const uint32_t hw = kvq_h2pack(a0, a1);
                pr16w[gg * chpw + (t2 >> 1)] = hw;
                prlo[gg * chpw + (t2 >> 1)] = kvq_h2pack((a0 - h2f(hw)) * 2048.f, (a1 - h2f(hw >> 16)) * 2048.f);
                pzl[gg] += e0 * z0.x + e1 * z1.x;
            }
        }
        block_reduce<GQ>(pzl, red, [](float a, float b) { return a + b; });
        if (tid == 0)
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) stat[2 * GQ + gg] = pzl[gg];
        const int rowb = 4 * p.vw;
        // per-warp partial outputs in the dead phase-1 tables (r8, qs, qt: at least NW4·GQ·D floats, as npk >= D/2)
        float *stage = (float *)r8;
        if (KVQ_SKIP(p, 4)) {
            for (int i = tid; i < NW4 * GQ * D; i += NT4) stage[i] = 0.f;
        } else if constexpr (BV == 3) {
            if constexpr (VER >= 5) pv_mma3_v5(p, s, h, q0, n, gn, pr16w, prlo, chpw, tw, stage, GQ * D, inv_s);
            else pv_mma3(p, s, h, q0, n, gn, pr16w, prlo, chpw, tw, stage, GQ * D, inv_s);
        } else if (BV == 4 && rowb >= 64 && rowb % 8 == 0) pv_mma<BV, 8>(p, s, h, q0, n, gn, pr16w, prlo, chpw, tw, stage, GQ * D, inv_s);
        else if (rowb >= 32) pv_mma<BV, 4>(p, s, h, q0, n, gn, pr16w, prlo, chpw, tw, stage, GQ * D, inv_s);
        else pv_mma<BV, 2>(p, s, h, q0, n, gn, pr16w, prlo, chpw, tw, stage, GQ * D, inv_s);
        __syncthreads();
        // the block's partial: (m, l, Σ_warps stage + Σ p·zp); the sparse value corrections are added to it below
        for (int i = tid; i < gn * (D + 2); i += NT4) {
            const int j = i / (D + 2), d = i % (D + 2);
            float v;
            if (d < 2) v = stat[d * GQ + j];
            else {
                v = stat[2 * GQ + j];
#pragma unroll
                for (int w2 = 0; w2 < NW4; w2++) v += stage[w2 * GQ * D + j * D + d - 2];
            }
            part0[j * pstride + d] = v;
        }
    }
    // sparse value outliers, added to the partial in global memory (red.global.add: native, unlike a float atomic on
    // shared memory); the first sync of the pass orders the plain stores above before them
    if (!KVQ_SKIP(p, 8)) {
        const uint32_t *vent = p.vent + ((size_t)s * p.H + h) * p.ent_cap;
        const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq + q0;
        const float lz = __ldg(p.vlevels + h * NLV + p.vz[h]);
        __syncthreads();
        struct VE { int t, d; float corr; };
        sparse_pass(p.vrow + ((size_t)s * p.H + h) * (p.capq + 1) + q0, n, etok, [&](uint32_t e, int t) {
            const uint32_t en = __ldg(vent + e);
            const float2 zr = __ldg(vs + t);
            VE x;
            x.t = t;
            x.d = en >> 16;
            x.corr = h2f(en) - (lz * zr.y + zr.x);
            return x;
        }, [&](const VE &x) {
#pragma unroll
            for (int gg = 0; gg < gn; gg++) atomicAdd(&part0[gg * pstride + 2 + x.d], sc[gg * p.chunk + x.t] * x.corr);
        });
    }
}
} // namespace v4

#endif
