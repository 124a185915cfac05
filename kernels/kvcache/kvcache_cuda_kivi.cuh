// kvcache_cuda_kivi.cuh — the KIVI decode kernels of kvcache_cuda.cu (formats/KVCACHE.md "KIVI" and
// "Decode attention (GPU)"). Included after kvcache_cuda_dec.cuh (block_reduce, chunk_softmax, kvq_mma16816,
// kvq_h2pack); tests/gpu/emu/emu_kvcache_dec.cc compiles the same source on the host.
//
// Per sequence s the positions n_exact + q, q < nq, are split three ways: q < qf (qf = min(kq, vq) rounded
// down to 16, only when the tensor-core kernel applies) by kivi_fast; qf <= q < nq by kivi_tail beside it, or
// by kivi_generic when kivi_fast does not apply (keys from the code words for q < kq, else the fp16 residual
// ring; values likewise with vq); the exact region by exact_decode. Each writes split-K partials (m, l, acc)
// that combine_par / combine_par_wide (or kivi_generic's last block per row) merge.
// Instance units (KVQ_KVCACHE_CUDA_INST, see kvcache_cuda_dec.cuh) leave out what is neither a template nor inline.
#ifndef KVQ_KVCACHE_CUDA_KIVI_CUH
#define KVQ_KVCACHE_CUDA_KIVI_CUH

#ifndef KVQ_EMU
// (x & m) | c as one LOP3 (written as `&` and `|`, ptxas emits two when m and c are both immediates)
__device__ __forceinline__ uint32_t kvq_andor(uint32_t x, uint32_t m, uint32_t c)
{
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "r"(m), "r"(c));
    return d;
}
// d = a·b + c on fp16 pairs (round to nearest even)
__device__ __forceinline__ uint32_t kvq_hfma2(uint32_t a, uint32_t b, uint32_t c)
{
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// 2^x (ex2.approx.ftz: relative error ~2^-22, results below 2^-126 flushed to 0)
__device__ __forceinline__ float kvq_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// c += a·b on the integer tensor cores, mma.m16n8k32 (PTX ISA "Matrix fragments for mma.m16n8k32"), s32 accumulators
// (exact): lane 4g + t holds a0 = A[g][4t..4t+3], a1 = A[g+8][4t..4t+3], a2 = A[g][16+4t..16+4t+3], a3 = A[g+8][16+4t..]
// (byte i = column 4t + i), b0 = B[4t..4t+3][g], b1 = B[16+4t..16+4t+3][g]; c as kvq_mma16816. A unsigned bytes, B
// signed (kvq_imma_us) or unsigned (kvq_imma_uu) bytes
__device__ __forceinline__ void kvq_imma_us(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kvq_imma_uu(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// c += a·b as mma.m16n8k16 on unsigned bytes (PTX ISA "Matrix fragments for mma.m16n8k16" with .u8): lane 4g + t holds
// a0 = A[g][4t..4t+3], a1 = A[g+8][4t..4t+3], b0 = B[4t..4t+3][g]; c as kvq_mma16816
__device__ __forceinline__ void kvq_imma16_uu(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0)
{
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}
#endif

struct KivP {
    const uint32_t *kcodes, *vcodes;  // [B][H][capq/16][kw][16] tiles of 16 positions, [B][H][capq][vw] token-major
    const float2 *kscale, *vscale;    // [B][ngk][C] (min, scale) per key group and channel; [B][H][capq][D/G] per head, token and channel group
    const uint16_t *kring, *vring;    // [B][ring][C] fp16 residual (quantization domain)
    const float2 *rlo, *rhi;          // RoPE tables (pre-RoPE keys), as DecP
    const float *q;
    float *part, *out;                // partials [B][n_heads][nslots][D + 2]; output [B][n_heads][D]
    int *tick;                        // [B][n_heads] kivi_generic's finished splits (0 between decodes)
    const int *len, *kq, *vq, *qf;    // per sequence: positions, quantized key / value positions, kivi_fast's range
    int H, D, G, kb, vb, np, n_heads, g, qgroups, kw, vw, capq, ngk, n_exact, ring, nslots, slot0, chunk, post_rope, use_qf;
    int nlong, chunk2; // kivi_fast's splits: [0, nlong) of chunk positions each, then splits of chunk2 <= chunk (kv::FastPlan)
    int gchunk; // kivi_generic's chunk
    int nuse;   // partial slots the combine reads (nslots, or nslots - 1 without an exact region)
    int vpref;  // kivi_fast: prefetch the value codes ahead (at least two waves of its blocks)
    float scale;
};

namespace kv {
// code of channel d from a (token, head)'s unit words w[0], w[stride], ... (any of 2, 3, 4 bits; KVCACHE.md "Code words")
__device__ __forceinline__ uint32_t code_at(const uint32_t *w, size_t stride, int d, int bits)
{
    const int cpu = bits == 2 ? 16 : bits == 3 ? 32 : 8, W = bits == 3 ? 3 : 1;
    const int bit = bits * (d % cpu), wi = (d / cpu) * W + (bit >> 5), o = bit & 31;
    uint32_t x = w[(size_t)wi * stride] >> o;
    if (o + bits > 32) x |= w[(size_t)(wi + 1) * stride] << (32 - o);
    return x & ((1u << bits) - 1);
}

// code_at for 2 or 4 bits only (a unit is one word: no code straddles words)
__device__ __forceinline__ uint32_t code_at24(const uint32_t *w, size_t stride, int d, int bits)
{
    const int cpu = 32 / bits, o = bits * (d % cpu);
    return (w[(size_t)(d / cpu) * stride] >> o) & ((1u << bits) - 1);
}

// a compile-time int as a value (for generic lambdas)
template <int N> struct KI {
    static constexpr int v = N;
};
// the fp16 values at p as one T (uint32_t: a pair, low half first; uint2: four), p aligned to sizeof(T)
template <class T> __device__ __forceinline__ T ld_hv(const uint16_t *p)
{
#ifdef KVQ_EMU
    if ((uintptr_t)p & (sizeof(T) - 1)) abort();
    T w;
    memcpy(&w, p, sizeof(T));
    return w;
#else
    return *(const T *)p;
#endif
}

// ---- generic: any bits, group, RoPE placement; fp32. One block of NTG threads per (split, query head, sequence),
// positions [qf, nq) of each sequence (use_qf; else [0, nq)) in chunks of gchunk; dynamic shared memory
// generic_smem floats: q, scores, reduction, statistics, P·V slice sums.
// Scores: a warp per position, lane l over the dim pairs (2i, 2i+1), i = l + 32j (RoPE rotates a pair within a lane),
// GPW positions per warp at a time with their residual-ring words loaded together, an xor-sum per position. P·V: VD
// consecutive dims per thread (4 when head_dim % 4 == 0, else 2), the block's threads in nsl = NTG / ⌈D / VD⌉ slices
// over positions, 8 positions' ring words in flight per thread, the slices summed through shared memory. Ring slots
// advance by addition (no division per position). This range is the fp16 residual ring (the last R..2R positions)
// and a few codes when kivi_fast runs, and everything when it does not; then (alone) the last split of a (query head,
// sequence) to finish merges its partials (combine_one). (A thread per position over all dims, then a thread per dim
// over all positions, makes long chains of dependent, uncoalesced loads; a separate combine kernel costs a launch.)
constexpr int NTG = 128, GPW = 4;
// dynamic shared memory of kivi_generic and kivi_tail (floats): q [D], scores [gchunk], reduction [8], statistics [4],
// P·V slice sums [nsl][D] (nsl·D <= NTG·VD <= 8·NTG; combine_one's COMBINE_SMEM there after them)
__host__ __device__ inline size_t generic_smem(int D, int gchunk) { return (size_t)D + gchunk + 12 + (8 * NTG > COMBINE_SMEM ? 8 * NTG : COMBINE_SMEM); }
#ifndef KVQ_KVCACHE_CUDA_INST // the generic and tail kernels with their helpers (see kvcache_cuda_dec.cuh)
// a generic / tail partial's set-up: positions [*a, *b) of split `split` (from first, the range's start), its partial
// slot *part; false (the empty partial written) when the range is empty, else the scaled query in qv[D] after a barrier
KVQ_ONE_UNIT __device__ bool part_begin(const KivP &p, int split, int qh, int s, int first, float *qv, int *a, int *b, float **part)
{
    const int D = p.D, nq = max(0, p.len[s] - p.n_exact);
    *a = first + split * p.gchunk;
    *b = min(*a + p.gchunk, nq);
    *part = p.part + ((size_t)(s * p.n_heads + qh) * p.nslots + p.slot0 + split) * (D + 2);
    if (*a >= *b) {
        empty_partials(*part, 0, 1, D);
        return false;
    }
    for (int d = threadIdx.x; d < D; d += NTG) qv[d] = p.q[((size_t)s * p.n_heads + qh) * D + d] * p.scale;
    __syncthreads();
    return true;
}
// ... and its write-out: the P·V slice sums pv[nsl][D] (complete: a barrier first) and the statistics (m, l)
KVQ_ONE_UNIT __device__ void part_end(float *part, const float *pv, int nsl, int D, const float *stat)
{
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += NTG) {
        float x = 0.f;
        for (int q = 0; q < nsl; q++) x += pv[q * D + d];
        part[2 + d] = x;
    }
    if (threadIdx.x == 0) { part[0] = stat[0]; part[1] = stat[1]; }
}
// one generic partial: split `split` of query head qh of sequence s (block size NTG); sm: generic_smem floats
KVQ_ONE_UNIT __device__ void generic_part(const KivP &p, int split, int qh, int s, float *sm)
{
    float *qv = sm, *sc = qv + p.D, *red = sc + p.gchunk, *stat = red + 8, *pv = stat + 4;
    const int h = qh / p.g, D = p.D, C = p.H * D, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, R = p.ring;
    const int kq = p.kq[s], vq = p.vq[s];
    int a, b;
    float *part;
    if (!part_begin(p, split, qh, s, p.use_qf ? p.qf[s] : 0, qv, &a, &b, &part)) return;
    const int n = b - a;
    const uint32_t *kc = p.kcodes + (size_t)(s * p.H + h) * p.kw * p.capq;
    const uint16_t *kring = p.kring + (size_t)s * R * C + h * D, *vring = p.vring + (size_t)s * R * C + h * D;
    const int npair = (D + 1) >> 1, nj = (npair + 31) >> 5;
    for (int t0 = a + warp * GPW; t0 < b; t0 += NTG / 32 * GPW) {
        const int slot0 = (p.n_exact + t0) % R;
        float acc[GPW];
#pragma unroll
        for (int u = 0; u < GPW; u++) acc[u] = 0.f;
        for (int j0 = 0; j0 < nj; j0 += 2) { // two pairs per lane per step: one step up to head_dim 128
            uint32_t rw[2][GPW]; // ring words of positions t0 + u (0 for quantized keys, positions past b and pairs past D)
#pragma unroll
            for (int jj = 0; jj < 2; jj++)
#pragma unroll
                for (int u = 0; u < GPW; u++) {
                    const int t = t0 + u, i = lane + 32 * (j0 + jj), d = 2 * i;
                    int sl = slot0 + u;
                    while (sl >= R) sl -= R;
                    const uint16_t *kr = kring + (size_t)sl * C + d;
                    rw[jj][u] = t < b && t >= kq && i < npair ? (!(D & 1) ? ld_hv<uint32_t>(kr) : kr[0] | (d + 1 < D ? (uint32_t)kr[1] << 16 : 0u)) : 0u;
                }
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                const int i = lane + 32 * (j0 + jj), d = 2 * i;
                if (i >= npair) break;
                const float q0 = qv[d], q1 = d + 1 < D ? qv[d + 1] : 0.f;
#pragma unroll
                for (int u = 0; u < GPW; u++) {
                    const int t = t0 + u, pos = p.n_exact + t;
                    if (t >= b) break;
                    float k0, k1 = 0.f;
                    if (t < kq) {
                        const float2 *ks = p.kscale + ((size_t)s * p.ngk + t / p.G) * C + h * D;
                        const float2 m0 = ks[d];
                        const uint32_t *kt = kc + (size_t)(t >> 4) * p.kw * 16 + (t & 15); // key tiles [capq/16][kw][16]
                        k0 = m0.y == 0.f ? m0.x : fmaf((float)code_at(kt, 16, d, p.kb), m0.y, m0.x);
                        if (d + 1 < D) {
                            const float2 m1 = ks[d + 1];
                            k1 = m1.y == 0.f ? m1.x : fmaf((float)code_at(kt, 16, d + 1, p.kb), m1.y, m1.x);
                        }
                    } else {
                        k0 = h2f(rw[jj][u]);
                        k1 = h2f(rw[jj][u] >> 16);
                    }
                    if (!p.post_rope) { // RoPE after dequantization: e^{i pos θ} = hi[pos >> 6]·lo[pos & 63] (pairs past rope_dim: 1)
                        const float2 r = p.rhi[(size_t)(pos >> 6) * p.np + i], l = p.rlo[i * 64 + (pos & 63)];
                        const float ex = r.x * l.x - r.y * l.y, ey = r.x * l.y + r.y * l.x;
                        const float x0 = k0 * ex - k1 * ey, x1 = k0 * ey + k1 * ex;
                        k0 = x0;
                        k1 = x1;
                    }
                    acc[u] = fmaf(q1, k1, fmaf(q0, k0, acc[u]));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < GPW; u++) {
            for (int o = 16; o; o >>= 1) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], o);
            if (lane == u && t0 + u < b) sc[t0 + u - a] = acc[u];
        }
    }
    __syncthreads();
    chunk_softmax<1>(sc, p.gchunk, n, red, stat, stat + 1);
    __syncthreads();
    // P·V: slice sl of the threads takes positions a + sl, a + sl + nsl, ...; U of them per step
    const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * p.vw;
    const float2 *vs = p.vscale + ((size_t)s * p.H + h) * p.capq * (D / p.G);
    auto pv_slices = [&](auto vd_c) {
        constexpr int VD = decltype(vd_c)::v, U = 8;
        const int npv = (D + VD - 1) / VD, nsl = NTG / npv, sl = tid / npv, d0 = (tid % npv) * VD, ng = D / p.G;
        const int dsl = nsl % R; // ring-slot step between a slice's positions
        float acc[VD];
#pragma unroll
        for (int k = 0; k < VD; k++) acc[k] = 0.f;
        if (sl < nsl) {
            int slot = (p.n_exact + a + sl) % R; // ring slot of position t1
            for (int t1 = a + sl; t1 < b; t1 += U * nsl) {
                uint32_t rw[U][VD / 2]; // ring words of the U positions (0 for quantized ones and past b)
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int t = t1 + u * nsl;
                    const uint16_t *vr = vring + (size_t)slot * C + d0;
#pragma unroll
                    for (int w = 0; w < VD / 2; w++) rw[u][w] = 0;
                    if (t < b && t >= vq) {
                        if (VD == 4) { // head_dim % 4 == 0: 8-byte aligned
                            const uint2 x = ld_hv<uint2>(vr);
                            rw[u][0] = x.x;
                            rw[u][VD / 2 - 1] = x.y;
                        } else {
                            rw[u][0] = !(D & 1) ? ld_hv<uint32_t>(vr) : vr[0] | (d0 + 1 < D ? (uint32_t)vr[1] << 16 : 0u);
                        }
                    }
                    slot = slot + dsl >= R ? slot + dsl - R : slot + dsl;
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const int t = t1 + u * nsl;
                    if (t >= b) break;
                    const float w = sc[t - a];
#pragma unroll
                    for (int k = 0; k < VD; k++) {
                        const int d = d0 + k;
                        if (d >= D) break;
                        float v;
                        if (t < vq) {
                            const float2 ms = vs[(size_t)t * ng + d / p.G];
                            v = ms.y == 0.f ? ms.x : fmaf((float)code_at(vc + (size_t)t * p.vw, 1, d, p.vb), ms.y, ms.x);
                        } else {
                            v = h2f(rw[u][k >> 1] >> (16 * (k & 1)));
                        }
                        acc[k] = fmaf(w, v, acc[k]);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < VD; k++)
                if (d0 + k < D) pv[sl * D + d0 + k] = acc[k];
        }
        part_end(part, pv, nsl, D, stat);
    };
    if (D % 4 == 0) pv_slices(KI<4>{});
    else pv_slices(KI<2>{});
}

// the 8 fp16 values of a 16-byte ring load, converted and dotted with / added into 8 floats
__device__ __forceinline__ float dot8(const float (&q)[8], uint4 w, float acc)
{
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; e++) acc = fmaf(q[2 * e + 1], h2f(x[e] >> 16), fmaf(q[2 * e], h2f(x[e]), acc));
    return acc;
}

// kivi_tail's partial (generic_part's result for the launch beside kivi_fast, whose conditions hold: post-RoPE keys, 2
// or 4 bits, head_dim a multiple of 16, G >= 16 a power of two). The tail is mostly the fp16 residual ring, and its
// cost beside kivi_fast (issue-bound) is its instruction count, so 8 dims per 16-byte load: scores by a half-warp per
// position (lane l of the half: dims 8l.., 8(l + 16).., 4 positions per half-warp in flight, a 4-step xor sum), P·V by
// D / 8 threads per position (8 dims each, 4 positions in flight) in slices summed through shared memory. Quantized
// positions (keys t < kq, values t < vq: at most a group's worth here) dequantize their 8 dims from the codes
KVQ_ONE_UNIT __device__ void tail_part(const KivP &p, int split, int qh, int s, float *sm)
{
    constexpr int PP = 4, U = 4; // positions per half-warp in the scores, per thread in P·V
    float *qv = sm, *sc = qv + p.D, *red = sc + p.gchunk, *stat = red + 8, *pv = stat + 4;
    const int h = qh / p.g, D = p.D, C = p.H * D, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, R = p.ring;
    const int kq = p.kq[s], vq = p.vq[s], lgG = __ffs(p.G) - 1;
    int a, b;
    float *part;
    if (!part_begin(p, split, qh, s, p.qf[s], qv, &a, &b, &part)) return;
    const int n = b - a;
    const uint32_t *kc = p.kcodes + (size_t)(s * p.H + h) * p.kw * p.capq;
    const uint16_t *kring = p.kring + (size_t)s * R * C + h * D, *vring = p.vring + (size_t)s * R * C + h * D;
    {
        const int hw = lane >> 4, l16 = lane & 15;
        bool dj[2];
        float qr[2][8];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            dj[j] = 8 * (l16 + 16 * j) < D;
#pragma unroll
            for (int e = 0; e < 8; e++) qr[j][e] = dj[j] ? qv[8 * (l16 + 16 * j) + e] : 0.f;
        }
        // half-warp 2w + hw takes positions a + 2w + hw + 8k (the loop bound warp-uniform: the sums shuffle over the warp)
        for (int tw = a + 2 * warp; tw < b; tw += 8 * PP) {
            const int t0 = tw + hw;
            uint4 kw4[PP][2];
            int sl = (p.n_exact + t0) % R;
#pragma unroll
            for (int u = 0; u < PP; u++) {
                const int t = t0 + 8 * u;
#pragma unroll
                for (int j = 0; j < 2; j++)
                    kw4[u][j] = t < b && t >= kq && dj[j] ? ld_hv<uint4>(kring + (size_t)sl * C + 8 * (l16 + 16 * j)) : make_uint4(0u, 0u, 0u, 0u);
                sl += 8;
                while (sl >= R) sl -= R;
            }
            float acc[PP];
#pragma unroll
            for (int u = 0; u < PP; u++) {
                const int t = t0 + 8 * u;
                acc[u] = 0.f;
                if (t < b && t < kq) { // quantized key: its 8 dims from the codes
                    const float2 *ks = p.kscale + ((size_t)s * p.ngk + (t >> lgG)) * C + h * D;
                    const uint32_t *kt = kc + (size_t)(t >> 4) * p.kw * 16 + (t & 15);
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        if (dj[j])
#pragma unroll
                            for (int e = 0; e < 8; e++) {
                                const int d = 8 * (l16 + 16 * j) + e;
                                const float2 m = ks[d];
                                acc[u] = fmaf(qr[j][e], m.y == 0.f ? m.x : fmaf((float)code_at24(kt, 16, d, p.kb), m.y, m.x), acc[u]);
                            }
                } else {
#pragma unroll
                    for (int j = 0; j < 2; j++) acc[u] = dot8(qr[j], kw4[u][j], acc[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < PP; u++) {
                for (int o = 8; o; o >>= 1) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], o);
                if (l16 == 0 && t0 + 8 * u < b) sc[t0 + 8 * u - a] = acc[u];
            }
        }
    }
    __syncthreads();
    chunk_softmax<1>(sc, p.gchunk, n, red, stat, stat + 1);
    __syncthreads();
    const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * p.vw;
    const float2 *vs = p.vscale + ((size_t)s * p.H + h) * p.capq * (D >> lgG);
    const int npv = D >> 3, nsl = NTG / npv, sl = tid / npv, d0 = (tid % npv) * 8, ng = D >> lgG, dsl = nsl % R;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.f;
    if (sl < nsl) {
        int slot = (p.n_exact + a + sl) % R; // ring slot of position t1
        for (int t1 = a + sl; t1 < b; t1 += U * nsl) {
            uint4 vw4[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int t = t1 + u * nsl;
                vw4[u] = t < b && t >= vq ? ld_hv<uint4>(vring + (size_t)slot * C + d0) : make_uint4(0u, 0u, 0u, 0u);
                slot = slot + dsl >= R ? slot + dsl - R : slot + dsl;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int t = t1 + u * nsl;
                if (t >= b) break;
                const float w = sc[t - a];
                if (t < vq) { // quantized value: one (min, scale) for the 8 dims (G >= 16)
                    const float2 ms = vs[(size_t)t * ng + (d0 >> lgG)];
                    const uint32_t *vt = vc + (size_t)t * p.vw;
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        acc[e] = fmaf(w, ms.y == 0.f ? ms.x : fmaf((float)code_at24(vt, 1, d0 + e, p.vb), ms.y, ms.x), acc[e]);
                } else {
                    const uint32_t x[4] = {vw4[u].x, vw4[u].y, vw4[u].z, vw4[u].w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        acc[2 * e] = fmaf(w, h2f(x[e]), acc[2 * e]);
                        acc[2 * e + 1] = fmaf(w, h2f(x[e] >> 16), acc[2 * e + 1]);
                    }
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++) pv[sl * D + d0 + e] = acc[e];
    }
    part_end(part, pv, nsl, D, stat);
}

// the p.nuse partial slots of (query head qh, sequence s) merged into p.out (combine_one; sm: COMBINE_SMEM floats)
KVQ_ONE_UNIT __device__ void merge_row(const KivP &p, int qh, int s, float *sm)
{
    const size_t row = (size_t)s * p.n_heads + qh;
    combine_one(p.part + row * p.nslots * (p.D + 2), p.out + row * p.D, p.D, p.nuse, sm);
}

// generic partials; with p.tick (kivi_generic alone, without kivi_fast), the last split of each (query head, sequence)
// to finish then merges all of its slots (the exact region's was written by the kernel launched before this one) into
// out: the combine without a launch of its own (tick counts finished splits; the merging block resets it). Beside
// kivi_fast (another stream, p.tick null) the combine kernel merges after both
KVQ_ONE_UNIT __global__ void __launch_bounds__(NTG, 8) kivi_generic(KivP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    KVQ_STATIC_SMEM(int, last, 1, 4);
    float *sm = (float *)sm4;
    const int qh = blockIdx.y, s = blockIdx.z;
    generic_part(p, blockIdx.x, qh, s, sm);
    if (!p.tick) return; // the combine kernel merges (kivi_generic beside kivi_fast)
    __threadfence(); // this block's partial before its tick
    __syncthreads();
    if (threadIdx.x == 0) {
        int *tk = p.tick + (size_t)s * p.n_heads + qh;
        *last = atomicAdd(tk, 1) == (int)gridDim.x - 1;
        if (*last) *tk = 0;
    }
    __syncthreads();
    if (*last) {
        __threadfence();
        merge_row(p, qh, s, sm + p.D + p.gchunk + 12); // over the P·V slice sums, done
    }
}

// the tail's partials beside kivi_fast (tail_part; no merge: combine_par follows). The tail's cost is the SM slots its
// blocks take from kivi_fast's and its blocks' latency (docs/BENCHMARKS.md), hence the lean kernel
KVQ_ONE_UNIT __global__ void __launch_bounds__(NTG, 8) kivi_tail(KivP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    tail_part(p, blockIdx.x, blockIdx.y, blockIdx.z, (float *)sm4);
}

// the combine after kivi_fast and kivi_generic (kivi_attend; COMBINE_SMEM floats of dynamic shared memory, 128
// threads): combine_one per (query head blockIdx.x, sequence blockIdx.y); faster than the per-thread slot loops of
// `combine` at SmolLM2-like heads, as fast at Llama-like heads
KVQ_ONE_UNIT __global__ void __launch_bounds__(128) combine_par(KivP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    merge_row(p, blockIdx.x, blockIdx.y, (float *)sm4);
}
#endif

// combine_wide's block: CW_NT threads; its dynamic shared memory (floats): weights [CW_TS], reduction [32], warp sums
// [CW_NT / 32][D] (D <= 256)
constexpr int CW_NT = 512, CW_TS = 512;
__host__ __device__ inline size_t combine_wide_smem(int D) { return (size_t)CW_TS + 32 + (size_t)(CW_NT / 32) * D; }
// combine_par's choice: the wide block when there are fewer (query head, sequence) rows than 4 per SM, where one row's
// merge latency is the cost (with more rows combine_par's smaller blocks were as fast or faster)
__host__ __device__ inline bool combine_use_wide(size_t rows, size_t n_sm) { return rows < 4 * n_sm; }
#ifndef KVQ_KVCACHE_CUDA_INST // combine_wide and its kernel (see kvcache_cuda_dec.cuh)
// combine_one with the slots spread over warps: warp w takes slots w, w + 16, ... of each tile of CW_TS, lane l the
// dims l, l + 32, ... (coalesced 128-byte rows), 4 slots' loads in flight per lane, then the 16 warps' sums added
// through shared memory; the statistics by combine_tiles, as combine_one. The same sums in another order
KVQ_ONE_UNIT __device__ void combine_wide(const float *pp, float *o, int D, int nuse, float *sm)
{
    constexpr int NW = CW_NT / 32, SU = 4; // warps, slots per batch
    float *wt = sm, *red = sm + CW_TS, *ws = red + 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, KD = (D + 31) >> 5;
    const size_t st = (size_t)D + 2;
    float L = 0.f, acc[8];
#pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.f;
    const float M = combine_tiles<CW_TS>(pp, nuse, st, CW_NT, wt, red, L, [&](int i0, int ni) {
        for (int i = warp; i < ni; i += NW * SU) {
            float x[SU][8];
#pragma unroll
            for (int u = 0; u < SU; u++)
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    const int j = i + u * NW, d = lane + 32 * k;
                    x[u][k] = k < KD && j < ni && d < D ? __ldcg(pp + (i0 + j) * st + 2 + d) : 0.f;
                }
#pragma unroll
            for (int u = 0; u < SU; u++) {
                const int j = i + u * NW;
                const float w = j < ni ? wt[j] : 0.f;
#pragma unroll
                for (int k = 0; k < 8; k++) acc[k] = w != 0.f ? fmaf(w, x[u][k], acc[k]) : acc[k];
            }
        }
    });
    for (int k = 16; k; k >>= 1) L += __shfl_xor_sync(0xffffffffu, L, k);
    __syncthreads();
    if (lane == 0) red[warp] = L;
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (k < KD && lane + 32 * k < D) ws[warp * D + lane + 32 * k] = acc[k];
    __syncthreads();
    L = 0.f;
    for (int w = 0; w < NW; w++) L += red[w];
    for (int d = tid; d < D; d += CW_NT) {
        float x = 0.f;
        for (int w = 0; w < NW; w++) x += ws[w * D + d];
        o[d] = M == -INFINITY ? 0.f : x / L;
    }
}
KVQ_ONE_UNIT __global__ void __launch_bounds__(CW_NT) combine_par_wide(KivP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    const size_t row = (size_t)blockIdx.y * p.n_heads + blockIdx.x;
    combine_wide(p.part + row * p.nslots * (p.D + 2), p.out + row * p.D, p.D, p.nuse, (float *)sm4);
}
#endif

// the combine in one round trip to memory: every load of the row's partials (the nuse slots' statistics and P·V sums)
// issued at once, then M, the weights and L from registers, then the weighted sums. Threads: NT, in ng = NT / D groups
// of D (a group's thread d takes dim d of slots group, group + ng, ...: K = ceil(nuse / ng) <= KMAX loads each);
// dynamic shared memory combine1_smem(NT, D) floats: weights [64], reduction [32], group sums [ng][D]. Only where
// combine_row_takes(NT, KMAX, nuse, D) (else combine_par / combine_par_wide)
__host__ __device__ inline int combine1_slots(int nt, int kmax, int D) { return (nt / D) * kmax < 64 ? (nt / D) * kmax : 64; }
__host__ __device__ inline bool combine_row_takes(int nt, int kmax, int nuse, int D) { return D <= 128 && nuse <= combine1_slots(nt, kmax, D); }
__host__ __device__ inline size_t combine1_smem(int nt, int D) { return (size_t)64 + 32 + (size_t)(nt / D) * D; }
// the combine kernel after kivi_fast and kivi_tail: combine_row (512 threads with fewer rows than 4 per SM, else 128)
// when it takes the row's nuse slots at head_dim <= 128 (one round trip to memory: it was faster than the two below
// where it applies), else combine_par_wide / combine_par (combine_use_wide)
enum CombineKind { COMBINE_ROW512, COMBINE_ROW128, COMBINE_WIDE, COMBINE_PAR };
__host__ __device__ inline CombineKind combine_pick(size_t rows, size_t n_sm, int nuse, int D)
{
    const bool wide = combine_use_wide(rows, n_sm);
    if (wide && combine_row_takes(512, 16, nuse, D)) return COMBINE_ROW512;
    if (!wide && combine_row_takes(128, 24, nuse, D)) return COMBINE_ROW128;
    return wide ? COMBINE_WIDE : COMBINE_PAR;
}
template <int NT, int KMAX> __global__ void __launch_bounds__(NT) combine_row(KivP p)
{
    KVQ_DYN_SMEM(float4, sm4);
    float *wt = (float *)sm4, *red = wt + 64, *gs = red + 32;
    const int D = p.D, n = p.nuse, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ng = NT / D, grp = tid / D, d = tid % D;
    const size_t row = (size_t)blockIdx.y * p.n_heads + blockIdx.x, st = (size_t)D + 2;
    const float *pp = p.part + row * p.nslots * st;
    float x[KMAX], m = -INFINITY, l = 0.f;
    if (tid < n) { m = __ldcg(pp + tid * st); l = __ldcg(pp + tid * st + 1); }
#pragma unroll
    for (int k = 0; k < KMAX; k++) {
        const int j = grp + k * ng;
        x[k] = grp < ng && j < n ? __ldcg(pp + j * st + 2 + d) : 0.f;
    }
    float M = m;
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = red[0];
    for (int w = 1; w < NT / 32; w++) M = fmaxf(M, red[w]);
    const float w = m == -INFINITY ? 0.f : expf(m - M);
    if (tid < n) wt[tid] = w;
    float L = w * l;
    for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    __syncthreads(); // red's maxima read
    if (lane == 0) red[warp] = L;
    __syncthreads();
    float a = 0.f;
#pragma unroll
    for (int k = 0; k < KMAX; k++) {
        const int j = grp + k * ng;
        if (grp < ng && j < n && wt[j] != 0.f) a = fmaf(wt[j], x[k], a);
    }
    if (grp < ng) gs[grp * D + d] = a;
    L = 0.f;
    for (int w2 = 0; w2 < NT / 32; w2++) L += red[w2];
    __syncthreads();
    if (tid < D) {
        float y = 0.f;
        for (int g2 = 0; g2 < ng; g2++) y += gs[g2 * D + tid];
        p.out[row * D + tid] = M == -INFINITY ? 0.f : y / L;
    }
}
} // namespace kv

// kivi_fast (the tensor-core kernel, its shared memory layout, its instance pickers) and the launch schedule of the
// three kernels, in files of their own
#include "kvcache_cuda_kivi_fast.cuh"
#include "kvcache_cuda_kivi_plan.cuh"

#endif
