// kvcache_cuda_kivi_fast.cuh — kivi_fast, the KIVI decode kernel on the tensor cores, with its shared memory layout
// (fast_smem) and its instance pickers (fast_pick; the extern template declarations the Makefile's instance units
// follow). Part of kvcache_cuda_kivi.cuh, which includes it after KivP, the PTX helpers and the generic kernels.
#ifndef KVQ_KVCACHE_CUDA_KIVI_FAST_CUH
#define KVQ_KVCACHE_CUDA_KIVI_FAST_CUH

namespace kv {
// ---- fast: post-RoPE keys, 2/4-bit codes, G in {16, 32, 64, 128} (G = 16 << LG), on the tensor cores.
//
// KIVI dequantizes arithmetically: key x̂ = min_{γ,c} + s_{γ,c}·code (per channel c and G-token group γ), value
// x̂ = min_{t,γ} + s_{t,γ}·code (per token t and G-channel group γ). So
//   score_t = Σ_c (q_c·s_{γ,c})·code_{t,c} + Σ_c q_c·min_{γ,c}
//   out_c   = Σ_t (p_t·s_{t,γ})·code_{t,c} + Σ_t p_t·min_{t,γ}
// The first sums are mma.m16n8k16 with the codes as A (converted exactly to fp16: a code field OR-ed into the
// mantissa of 1024.0, then one fma.f16x2 by a power of two and the offset) and the scaled queries / weights as
// B, each split into an fp16 high and low part (x = hi + lo to ~2^-22) in two B columns, so the products
// keep fp32 precision; 8 columns = up to 4 query heads × (hi, lo). The bias sums run in fp32.
// Scores: a warp tile is 16 positions; row g of A = position 2g, row g + 8 = position 2g + 1 (lane 4g + t
// loads one 8-byte pair of the tile's code words per word it needs; tiles [capq/16][kw][16]); k-slots of lane t map to dims of the
// words it loaded (4-bit: words 8w + 2t, 8w + 2t + 1 of each 64-dim word group w; 2-bit: word 4w + t):
// field f of a word = (low-half dim, high-half dim) = (f, f + 4) at 4 bits, (f, f + 8) at 2 bits. The B
// fragments (q·s, hi/lo) of every key group of the chunk are built once per block in shared memory in that
// order.
// P·V: A = value codes, rows = 16 dims of one channel group (the weights p·s differ per group), k = positions:
// row g / g + 8 of m-tile (γ, i) = the two dims of pair γ·G/2 + g·G/16 + i (so a lane loads one word per
// row and group; two, as one 8-byte load, at 4-bit G = 128), positions (2t, 2t+1) and (2t+8, 2t+9) merged
// per register with one PRMT; B = p·s of the tile's 16 positions per group (hi, lo), built in shared memory
// after the softmax.
// The integer path (imma_path: 2-bit or 4-bit keys and values, G = head_dim = 128 with GQ <= 2, or G = head_dim = 64
// with GQ <= 4 in two n-tiles of B columns) runs both sums as
// mma.m16n8k32 on u8 codes (a field masked in place: code·4^f; 4-bit: a nibble, code·16^f, and P·V as mma.m16n8k16 per
// tile) and byte digits of the fixed-point q·s·4^-m (16^-m) and p·s, with exact s32 sums (formats/KVCACHE.md "Decode
// attention (GPU)"; the IM branches below). It takes fewer instructions per position than the fp16 path where it
// applies (the fp16 path stays for the other configurations); the P·V digits are combined per warp in registers (one
// stage value per head and channel instead of four).
// threads per block: 128 (4 warps) at G = 128, else 256 (8 warps): on the H200 128 threads were faster at G = 128 and
// slower at G = 32 and 64 (also on the integer path at head_dim 64)
__host__ __device__ constexpr int fast_threads(int G) { return G == 128 ? 128 : 256; }
// resident blocks per SM the launch bounds allow: 768 threads (3 blocks of 256, 6 of 128) at G >= 32, else 512; 7 of 128
// (72 registers) for 2-bit keys and values at G = 128, the fastest on the H200 (at 4 bits 7 blocks were slower than 6, and
// 8 blocks, 64 registers, spilled and were slower for both)
__host__ __device__ constexpr int fast_blocks(int G, int bk, int bv)
{
    return G == 128 && bk == 2 && bv == 2 ? 7 : (G >= 32 ? 768 : 512) / fast_threads(G);
}

// (Reading a field masked in place as an fp16 subnormal would save the fma.f16x2, but the H200 tensor cores keep such
// products to ~2^-14 relative.)
// fp16 pair of code fields: the field (bits under mask m of x >> sh, a power-of-two multiple e of the code in
// each half) as exact fp16 integers: (x | 1024.0) · (1/e) − 1024/e; the mask and the OR are one LOP3
__device__ __forceinline__ uint32_t dq_field(uint32_t x, int sh, uint32_t m, uint32_t inv_e, uint32_t off)
{
    return kvq_hfma2(kvq_andor(x >> sh, m, 0x64006400u), inv_e, off);
}
// fp16 pairs of 1/4^k and -1024/4^k
__device__ __forceinline__ uint32_t inv4(int k) { return k == 0 ? 0x3C003C00u : k == 1 ? 0x34003400u : k == 2 ? 0x2C002C00u : 0x24002400u; }
__device__ __forceinline__ uint32_t off4(int k) { return k == 0 ? 0xE400E400u : k == 1 ? 0xDC00DC00u : k == 2 ? 0xD400D400u : 0xCC00CC00u; }
// key field f of word x: 4-bit dims (f, f + 4) of the word, 2-bit dims (f, f + 8)
template <int BK> __device__ __forceinline__ uint32_t key_field(uint32_t x, int f)
{
    if (BK == 4) return dq_field(x, 8 * (f >> 1), 0x000F000Fu << (4 * (f & 1)), inv4(2 * (f & 1)), off4(2 * (f & 1)));
    return dq_field(x, 8 * (f >> 2), 0x00030003u << (2 * (f & 3)), inv4(f & 3), off4(f & 3));
}
// the dims of key field f, lane t, k-slice j of word group wg (see above)
template <int BK> __device__ __forceinline__ void key_dims(int wg, int t, int j, int r, int *dl, int *dh)
{
    if (BK == 4) {
        const int W = 8 * wg + 2 * t + (j >> 1), f = 2 * (j & 1) + r;
        *dl = 8 * W + f;
        *dh = *dl + 4;
    } else {
        const int W = 4 * wg + t, f = 2 * j + r;
        *dl = 16 * W + f;
        *dh = *dl + 8;
    }
}

// kivi_fast on the integer tensor cores (the IM path below): 2-bit or 4-bit keys and values (equal widths), G = head_dim
// = 128 with up to 2 query heads per block (one n-tile of 8 B columns), or G = head_dim = 64 with up to 4 (two n-tiles
// at 3 or 4); the fp16 tensor-core path otherwise
__host__ __device__ constexpr bool imma_path(int bk, int bv, int G, int D, int gq)
{
    return (bk == 2 || bk == 4) && bv == bk && G == D && ((D == 128 && gq <= 2) || (D == 64 && gq <= 4));
}

// the integer path's B columns (digits d < 4 of query heads j < gq): 4 gq in one n-tile of 8 at gq <= 2, column 4j + d
// (lane t's accumulators: digits 2 (t & 1), 2 (t & 1) + 1 of head t / 2); two n-tiles at 3 or 4 heads, column
// 8 (d >> 1) + 2j + (d & 1), so lane t's accumulators of the two n-tiles hold all four digits of head t
__host__ __device__ constexpr int imma_cols(int gq) { return gq <= 2 ? 4 * gq : 16; }
__host__ __device__ constexpr int imma_col(int gq, int j, int d) { return gq <= 2 ? 4 * j + d : 8 * (d >> 1) + 2 * j + (d & 1); }
// column c (of imma_cols(gq)) holds a digit
__host__ __device__ constexpr bool imma_col_used(int gq, int c) { return gq <= 2 ? c < 4 * gq : ((c & 7) >> 1) < gq; }
// the integer P·V's A rows (2-bit values, head_dim DI = 128 or 64): lane 4g + t's m-tile m takes byte pv_byte(m) of the
// byte-transposed value words, field pv_field(g, m) (row g) and the next field (row g + 8), i.e. channels
// pv_channel(g, m) and pv_channel(g, m) + 1 (word 16·w + byte 4·i + field f; w = g, or g & 3 at 64 where lanes g and
// g + 4 read the same word). 4-bit values (tile4): channels (DI / 8)·g + 2m and the next (low and high nibble)
template <int DI> __host__ __device__ constexpr int pv_byte(int m) { return DI == 128 ? m >> 1 : m; }
template <int DI> __host__ __device__ constexpr int pv_field(int g, int m) { return DI == 128 ? 2 * (m & 1) : 2 * (g >> 2); }
template <int BV, int DI> __host__ __device__ constexpr int pv_channel(int g, int m)
{
    return BV == 4 ? (DI / 8) * g + 2 * m : 16 * (DI == 128 ? g : g & 3) + 4 * pv_byte<DI>(m) + pv_field<DI>(g, m);
}

// shared memory layout (offsets in floats, each region 16-byte aligned)
struct FastSmem {
    // kbias: [ngc][gq], then [ngc] (kinv); vbias: [NG][gq], then [NG] floats (vinv), [NG + 2] ints (max value
    // scales, max |q|, spare); wsum: IM, per warp [warps][2][gq] (Σ p·min, Σ p); stage: [warps][gq][D] floats; bfr: uint2
    // fragments
    int qv, sc, red, stat, wsum, kbias, vbias, stage, bfr, total;
};
__host__ __device__ inline FastSmem fast_smem(int gq, int D, int G, int bk, int bv, int chunk)
{
    auto up = [](int x) { return (x + 3) & ~3; };
    const int ngc = (chunk + G - 1) / G, NG = D / G, ks4 = 4 * ((D + 63) / 64);
    const bool im = imma_path(bk, bv, G, D, gq);
    FastSmem m;
    m.qv = 0;
    m.sc = m.qv + up(gq * D);
    m.red = m.sc + up(gq * chunk);
    m.stat = m.red + up(8 * gq);
    m.wsum = m.stat + up(4 * gq);
    m.kbias = m.wsum + up(2 * (fast_threads(G) / 32) * gq);
    m.vbias = m.kbias + up(ngc * gq + ngc);
    m.stage = m.vbias + up(NG * gq + 2 * NG + 2);
    m.bfr = m.stage + up(fast_threads(G) / 32 * gq * D);
    // uint2 fragments: fp16 keys [ngc][k-slice][2 gq][4], values [chunk/16][NG][2 gq][4]; IM keys [ngc][D/32][nci][4],
    // values [chunk/32][nci][4], nci = imma_cols(gq) B columns
    const int nci = imma_cols(gq);
    const int nk = im ? ngc * (D / 32) * nci * 4 : ngc * ks4 * 2 * gq * 4, nv = im ? (chunk + 31) / 32 * nci * 4 : (chunk / 16) * NG * 2 * gq * 4;
    m.total = m.bfr + 2 * (nk > nv ? nk : nv);
    return m;
}

// 2^S with m·2^S in [2^(top-1), 2^top), S clamped to [-lim, lim] so the factor stays finite (m <= 0 or not finite: 1).
// Defaults, the fp16 operands: m·2^S in [2^13, 2^14) keeps their high and low parts in fp16's normal range (down to
// 2^-14) for values down to m·2^-27 (lim 100: for m < 2^-86 the operands just lose their low bits). The IM path's
// fixed-point operands use top 30 (keys) and 8 (values), lim 126
__device__ __forceinline__ float pow2_scale(float m, int top = 14, int lim = 100)
{
    if (!(m > 0.f) || !(m < INFINITY)) return 1.f;
    int e;
    frexpf(m, &e);
    return ldexpf(1.f, max(-lim, min(lim, top - e)));
}

// 4 x 4 byte transpose: byte r of t[i] = byte i of x[r] (8 PRMT)
__device__ __forceinline__ void byte_transpose(const uint32_t *x, uint32_t (&t)[4])
{
    const uint32_t p01 = __byte_perm(x[0], x[1], 0x5140), q01 = __byte_perm(x[0], x[1], 0x7362);
    const uint32_t p23 = __byte_perm(x[2], x[3], 0x5140), q23 = __byte_perm(x[2], x[3], 0x7362);
    t[0] = __byte_perm(p01, p23, 0x5410);
    t[1] = __byte_perm(p01, p23, 0x7632);
    t[2] = __byte_perm(q01, q23, 0x5410);
    t[3] = __byte_perm(q01, q23, 0x7632);
}

// steps [b, e) over NS register sets used in turn, no copies: set u % NS is loaded (load(set)) NS - 1 steps before
// step u uses it (use(set, u)); loads and uses each in step order. ring_prologue loads the first NS - 1 sets (it may run
// well before ring_loop, so those loads overlap other work), ring_loop the steps
template <int NS, class X, class L> __device__ __forceinline__ void ring_prologue(X (&xs)[NS], int b, int e, L &&load)
{
#pragma unroll
    for (int u = 0; u + 1 < NS; u++)
        if (b + u < e) load(xs[u]);
}
template <int NS, class X, class L, class F> __device__ __forceinline__ void ring_loop(X (&xs)[NS], int b, int e, L &&load, F &&use)
{
    for (int i = b; i < e; i += NS) {
#pragma unroll
        for (int u = 0; u < NS; u++) {
            if (i + u + NS - 1 < e) load(xs[(u + NS - 1) % NS]);
            if (i + u < e) use(xs[u], i + u);
        }
    }
}

// 768 threads per SM (fast_blocks: 3 blocks of 256 threads, 6 of 128 at G = 128, 7 for k2/v2; <= 80 registers) at G >= 32, else 2
// blocks of 256 (G = 16). 3 blocks of 256 were faster than 2 on the H200 at B >= 8 although ptxas may spill a few bytes
// (at B = 1 a little slower); 4 at G = 32 were slower at B = 32. The plan (kv::plan) counts on them only with at least 8
// blocks per split
template <int BK, int BV, int GQ, int LG, int NW>
__global__ void __launch_bounds__(fast_threads(16 << LG), fast_blocks(16 << LG, BK, BV)) kivi_fast(KivP p)
{
    constexpr int PPL = 1 << LG, G = 16 << LG, NC = 2 * GQ; // dim pairs per lane per value group, group size, B columns
    constexpr int NTF = fast_threads(G), NWF = NTF / 32;   // threads, warps
    KVQ_DYN_SMEM(float4, sm4);
    float *smf = (float *)sm4;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    // grid (H·qgroups, B, splits): blocks start in x-fastest order, so the splits start in order and the short last ones
    // (kv::fast_plan) last; the blocks that start together read the same key-scale rows ([B][ngk][H·D]). (Edits of
    // this kernel move ptxas' schedule, and its time, by up to ±2%: docs/BENCHMARKS.md)
    const int split = blockIdx.z, s = blockIdx.y, h = blockIdx.x / p.qgroups, qg = blockIdx.x % p.qgroups;
    const int gq0 = qg * GQ, gn = min(GQ, p.g - gq0);
    // NWG: 64-dim word groups per head; a compile-time constant for NW > 0 (fast_nw), which folds the score loop's
    // guards and the dead loads and pointers away (faster than a run-time count on the H200)
    // the integer path (below) runs only at head_dim = 64·NW (kv::imma_path); at 64 head_dim is then a compile-time
    // constant (faster there; at 128 ptxas spilled more and it was slower, so not there)
    constexpr bool IM = (NW == 1 || NW == 2) && imma_path(BK, BV, G, 64 * NW, GQ);
    const int D = IM && NW == 1 ? 64 : p.D, C = p.H * D, NWG = NW ? NW : (D + 63) >> 6, KS4 = 4 * NWG, NG = D / G;
    const int q0 = split < p.nlong ? split * p.chunk : p.nlong * p.chunk + (split - p.nlong) * p.chunk2;
    const int q1 = min(q0 + (split < p.nlong ? p.chunk : p.chunk2), p.qf[s]);
    float *part0 = p.part + ((size_t)(s * p.n_heads + h * p.g + gq0) * p.nslots + split) * (D + 2);
    const size_t pstride = (size_t)p.nslots * (D + 2);
    if (q0 >= q1) {
        empty_partials(part0, pstride, gn, D);
        return;
    }
    const int n = q1 - q0, ntile = n >> 4, ngc = (n + G - 1) / G; // n is a multiple of 16
    const FastSmem L = fast_smem(GQ, D, G, BK, BV, p.chunk);
    // the integer tensor-core path (G = 64·NW makes head_dim G: 128 at NW = 2, 64 at NW = 1): key B column
    // imma_col(GQ, j, d) = digit d of query head j, value B columns likewise, in NTI n-tiles of 8 columns; DI = head_dim,
    // KSI key k-steps of 32 channels per tile, MTI value m-tiles of 16 channels
    constexpr int NCK = imma_cols(GQ), NCV = NCK, DI = IM ? 64 * NW : 128, KSI = DI / 32, NTI = (4 * GQ + 7) / 8, MTI = DI / 16;
    // IM: register sets of key tiles and of value k-steps used in turn (KPF - 1 and VPF - 1 ahead); the counts below
    // were the fastest measured on the H200 (with the rings primed before the operand builds), an L2 prefetch
    // (cp.async.bulk.prefetch) of the code tiles ahead slower
    // 4-bit (IM): a tile is 4 uint2 per lane, so 3 register sets; values by tiles of 16 positions (VPF4 sets, below)
    // KX uint2 per lane and tile: words t + 4k of positions 2g, 2g + 1, k < KX = kw / 4 (2-bit: 2 at head_dim 128, 1 at
    // 64; 4-bit: 4, 2)
    // 2-bit at head_dim 64 (one uint2 per tile): 8 sets (faster than 5 there)
    constexpr int KPF = BK == 4 ? 3 : DI == 64 ? 8 : 5, VPF = 2, KX = DI * BK / 128;
    float *qv = smf + L.qv, *sc = smf + L.sc, *red = smf + L.red, *stat = smf + L.stat, *wsum = smf + L.wsum, *kbias = smf + L.kbias,
          *vbias = smf + L.vbias, *stage = smf + L.stage;
    float *kinv = kbias + ngc * GQ;                // [ngc] 1 / (the key operands' scale) per key group
    float *vinv = vbias + NG * GQ;                 // [NG] 1 / (the value operands' scale) per value group
    int *vmx = (int *)(vinv + NG), *mxi = vmx + NG; // [NG] max value scale per group, [2] max |q| (float bits), spare
    uint2 *bfr = (uint2 *)(smf + L.bfr);
    const float2 *ksb = p.kscale + ((size_t)s * p.ngk + q0 / G) * C + h * D; // key group gi of the chunk at + gi·C
    const float2 *vsb = p.vscale + (((size_t)s * p.H + h) * p.capq + q0) * NG; // position t2 of the chunk, group ga at t2·NG + ga

    // IM: the score phase's key ring (KPF register sets, the warp's tiles [tb, te)) is primed here, so its first tiles'
    // loads overlap the key operands' build; the value ring likewise before the value operands' build (below)
    // key tiles [capq/16][kw][16]: a tile of 16 positions is 16·kw contiguous words (q0 is a multiple of 16); warp w
    // scores the contiguous tiles [tb, te)
    const uint32_t *kc = p.kcodes + (size_t)(s * p.H + h) * p.kw * p.capq + (size_t)(q0 >> 4) * p.kw * 16;
    const int tb = warp * ((ntile + NWF - 1) / NWF), te = min(ntile, tb + (ntile + NWF - 1) / NWF);
    [[maybe_unused]] const uint2 *kq2 = (const uint2 *)(kc + (size_t)t * 16 + 2 * g) + (size_t)tb * 32 * KX;
    [[maybe_unused]] uint2 XK[KPF][KX];
    auto kload = [&](uint2 (&x)[KX]) { // words t + 4k of positions 2g, 2g + 1 (word W of a tile at 16 W)
#pragma unroll
        for (int k = 0; k < KX; k++) x[k] = __ldcs(kq2 + 32 * k);
        kq2 += 32 * KX;
    };
    if constexpr (IM) ring_prologue(XK, tb, te, kload);
    // IM: the P·V phase's k-steps [vkb, vke) of 32 positions per warp (below)
    [[maybe_unused]] const int npair = (ntile + 1) >> 1, vper = (npair + NWF - 1) / NWF, vkb = warp * vper, vke = min(npair, vkb + vper);
    // IM: the key operand build's lane mapping (see there): LPG lanes per group, lane kbl of its group, its byte 0's
    // channel kcw. Its first group's key scales (kz) and the chunk's value scales (vz, for the largest: F_v's, without a
    // pass after the softmax) are loaded before the query fill, so their latency hides behind it and its barrier; vz is
    // reduced after the key operands. VZ·NTF covers chunks up to 2048 positions (longer ones: a loop after). With each
    // step of the build loading the next step's key scales and the heads' bias sums interleaved (below): faster than
    // loading the scales where used
    constexpr int LPG = 8 * KSI, KGS = NWF * (32 / LPG), VZ = 2048 / NTF; // lanes per group, groups per step of the block
    [[maybe_unused]] const int kbl = lane & (LPG - 1), kbs = kbl >> 3, kbt = (kbl >> 1) & 3, kbh = kbl & 1;
    [[maybe_unused]] const int kbm = BK == 4 ? kbs & 1 : DI == 64 ? 2 * kbs + kbh : kbs;
    [[maybe_unused]] const int kcw = BK == 4 ? 8 * (8 * (kbs >> 1) + 4 * kbh + kbt) + kbm : DI == 64 ? 16 * kbt + kbm : 16 * (4 * kbh + kbt) + kbm;
    [[maybe_unused]] float vz[VZ];
    [[maybe_unused]] float2 kz[4];
    [[maybe_unused]] auto kzload = [&](int g0) { // the key scales of channels kcw + (4 or 2)·b of group g0 + lane / LPG
        const int gi = g0 + lane / LPG;
#pragma unroll
        for (int b = 0; b < 4; b++) kz[b] = gi < ngc ? __ldg(&ksb[(size_t)gi * C + kcw + (BK == 4 ? 2 : 4) * b]) : make_float2(0.f, 0.f);
    };
    if constexpr (IM) {
        const float *vzp = (const float *)(vsb + tid) + 1; // the scales (.y) of positions tid + k·NTF: one pointer,
        const int nr = n - tid;                            // compile-time offsets
#pragma unroll
        for (int k = 0; k < VZ; k++) vz[k] = k * NTF < nr ? __ldg(vzp + 2 * k * NTF) : 0.f;
        kzload(warp * (32 / LPG));
    }
    for (int i = tid; i < GQ * D; i += NTF) {
        const int j = i / D, d = i % D;
        qv[i] = j < gn ? p.q[((size_t)s * p.n_heads + h * p.g + gq0 + j) * D + d] * p.scale : 0.f;
    }
    for (int i = tid; i < NG * GQ; i += NTF) vbias[i] = 0.f;
    for (int i = tid; i < NG + 2; i += NTF) vmx[i] = 0;
    for (int i = tid; i < GQ; i += NTF) stat[GQ + i] = 0.f; // Σ p, by shared atomics in the pass after the scores
    __syncthreads();
    if constexpr (IM) {
        // integer key operands, a warp per group γ of the chunk: x = q_{j,c}·s_{γ,c}·e as fixed-point integers
        // X = rint(x·F_γ), F_γ = pow2_scale(max |q·s|, 30, 126) (1/F_γ in kinv), split into four signed bytes (balanced
        // digits, X = Σ_d 256^d·digit_d), one B column each; Σ q·min per head (kbias). Lane = 8ks + 2t + hf builds
        // register hf (b0, b1) of k-step ks for lane t, b = byte (KVCACHE.md "Code words"): 2-bit, field m = ks of
        // byte b of word 4 hf + t, channel 16 (4 hf + t) + 4b + m, A bytes code·4^m, e = 4^-m; 4-bit, nibble
        // m = ks & 1 of byte b of word 8 (ks >> 1) + 4 hf + t, channel 8 (8 (ks >> 1) + 4 hf + t) + 2b + m, A bytes
        // code·16^m, e = 16^-m. Head_dim 64 (KSI = 2 k-steps): a half-warp per group (lanes 16.. the next group), 2-bit
        // field m = 2ks + hf of byte b of word t (a2, a3 hold the next field of the same words), channel 16t + 4b + m;
        // 4-bit as at 128, ks < 2. B fragments [γ][ks][column][t]
        // (LPG lanes per group: 32, or 16 at head_dim 64, two groups per warp at a time.) Each step loads the next
        // step's key scales (kz) before it uses its own
        uint32_t *bw = (uint32_t *)bfr;
        const int kl = kbl, ks = kbs, tt = kbt, hf = kbh, m = kbm, cw = kcw;
        const float e4 = BK == 4 ? (m ? 0.0625f : 1.f) : m == 0 ? 1.f : m == 1 ? 0.25f : m == 2 ? 0.0625f : 0.015625f;
        for (int g0 = warp * (32 / LPG); g0 < ngc; g0 += KGS) {
            const int gi = g0 + lane / LPG;
            const bool gact = gi < ngc; // (lanes past the last group take part in the shuffles only)
            float2 zc[4];
#pragma unroll
            for (int b = 0; b < 4; b++) zc[b] = kz[b];
            if (g0 + KGS < ngc) kzload(g0 + KGS);
            float mx = 0.f, pb[GQ], qs[GQ][4]; // q·s of channel b, head j
#pragma unroll
            for (int j = 0; j < GQ; j++) pb[j] = 0.f;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int ch = cw + (BK == 4 ? 2 : 4) * b;
                const float2 z = zc[b];
#pragma unroll
                for (int j = 0; j < GQ; j++) {
                    const float qc = qv[j * D + ch];
                    qs[j][b] = qc * z.y;
                    mx = fmaxf(mx, fabsf(qs[j][b]));
                    pb[j] = fmaf(qc, z.x, pb[j]);
                }
            }
            for (int o = LPG / 2; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float F = pow2_scale(mx, 30, 126), Fm = F * e4;
            // (log2 units: the softmax takes 2^(s - m)) non-finite q·s: NaN scores, as on the fp16 path
            if (kl == 0 && gact) kinv[gi] = mx < INFINITY ? 1.4426950408889634f * __frcp_rn(F) : NAN; // (1/F exact)
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                // channel b's balanced digits as the bytes of one word: X = Σ_d 256^d·s_d with s_0..s_2 in [-128, 128) and
                // s_3 = the rest (|X| < 2^30: |s_3| <= 64); X + 0x808080 has bytes s_d + 128 (d < 3) and s_3, so the XOR
                // leaves the bytes s_d mod 256. Then a 4 x 4 byte transpose: w[d] = digit d of channels b = 0..3
                uint32_t u[4], w[4];
#pragma unroll
                for (int b = 0; b < 4; b++) u[b] = (uint32_t)(__float2int_rn(qs[j][b] * Fm) + 0x808080) ^ 0x808080u;
                byte_transpose(u, w);
#pragma unroll
                for (int d = 0; d < 4; d++)
                    if (gact) bw[(((gi * KSI + ks) * NCK + imma_col(GQ, j, d)) * 4 + tt) * 2 + hf] = w[d];
            }
#pragma unroll
            for (int o = LPG / 2; o; o >>= 1) // the heads' sums interleaved (independent shuffle chains)
#pragma unroll
                for (int j = 0; j < GQ; j++) pb[j] += __shfl_xor_sync(0xffffffffu, pb[j], o);
            if (kl == 0 && gact)
#pragma unroll
                for (int j = 0; j < GQ; j++) kbias[gi * GQ + j] = pb[j] * 1.4426950408889634f;
        }
        float mv = 0.f;
#pragma unroll
        for (int k = 0; k < VZ; k++) mv = fmaxf(mv, fabsf(vz[k]));
        for (int t2 = tid + VZ * NTF; t2 < n; t2 += NTF) mv = fmaxf(mv, fabsf(__ldg(&vsb[t2]).y)); // chunks past VZ·NTF
        for (int o = 16; o; o >>= 1) mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, o));
        if (lane == 0) atomicMax(&vmx[0], __float_as_int(mv));
    } else {
        { // max |q| over the block's query heads (the integer path takes max |q·s| per group instead)
            float mq = 0.f;
            for (int i = tid; i < GQ * D; i += NTF) mq = fmaxf(mq, fabsf(qv[i]));
            atomicMax(&mxi[0], __float_as_int(mq)); // non-negative floats order as their bits
        }
        __syncthreads();
    // key operands, a warp per group γ of the chunk: the power-of-two scale fk_γ = pow2_scale(max |q| · max_c s_{γ,c})
    // (its inverse in kinv), the B fragments [group][k-slice][column][t] (b0, b1) and Σ q·min per head (kbias). A lane
    // per (k-slice, t) item (two at head_dim > 128) loads the scales of its 4 dims once for all columns
        const float qmax = __int_as_float(mxi[0]);
        const int NI = 16 * NWG; // items per group
        for (int gi = warp; gi < ngc; gi += NWF) {
            int dd[2][4];
            float2 z[2][4];
            float mk = 0.f;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int it = lane + 32 * r, tt = it & 3, kk = it >> 2; // items past NI give dims >= D
                key_dims<BK>(kk >> 2, tt, kk & 3, 0, &dd[r][0], &dd[r][1]);
                key_dims<BK>(kk >> 2, tt, kk & 3, 1, &dd[r][2], &dd[r][3]);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    z[r][k] = dd[r][k] < D ? __ldg(&ksb[(size_t)gi * C + dd[r][k]]) : make_float2(0.f, 0.f);
                    mk = fmaxf(mk, fabsf(z[r][k].y));
                }
            }
            for (int o = 16; o; o >>= 1) mk = fmaxf(mk, __shfl_xor_sync(0xffffffffu, mk, o));
            const float fk = pow2_scale(qmax * mk);
            if (lane == 0) kinv[gi] = 1.f / fk;
            float pb[GQ];
#pragma unroll
            for (int j = 0; j < GQ; j++) pb[j] = 0.f;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int it = lane + 32 * r, tt = it & 3, kk = it >> 2;
                if (r == 1 && NI <= 32) break;
#pragma unroll
                for (int j = 0; j < GQ; j++) {
                    float x[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) x[k] = dd[r][k] < D ? qv[j * D + dd[r][k]] : 0.f;
                    pb[j] += x[0] * z[r][0].x + x[1] * z[r][1].x + x[2] * z[r][2].x + x[3] * z[r][3].x;
                    float y[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) y[k] = x[k] * z[r][k].y * fk;
                    const uint32_t h0 = kvq_h2pack(y[0], y[1]), h1 = kvq_h2pack(y[2], y[3]);
                    const uint32_t l0 = kvq_h2pack(y[0] - h2f(h0), y[1] - h2f(h0 >> 16)), l1 = kvq_h2pack(y[2] - h2f(h1), y[3] - h2f(h1 >> 16));
                    if (it < NI) {
                        bfr[((gi * KS4 + kk) * NC + 2 * j) * 4 + tt] = make_uint2(h0, h1);
                        bfr[((gi * KS4 + kk) * NC + 2 * j + 1) * 4 + tt] = make_uint2(l0, l1);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                for (int o = 16; o; o >>= 1) pb[j] += __shfl_xor_sync(0xffffffffu, pb[j], o);
                if (lane == 0) kbias[gi * GQ + j] = pb[j];
            }
        }
    }
    __syncthreads();

    // ---- scores: warp w takes the contiguous tiles [tb, te); the next tile's code words are loaded meanwhile
    {
        constexpr int XW = BK == 4 ? 2 : 1, XM = 4 * XW; // uint2 per word group, at most 4 word groups (head_dim 256)
        const int kstep = 8 * p.kw;
        // a pointer per word the lane reads (words past the head's last one read that one: their B rows are zero), advanced
        // one tile (kstep uint2) per step
        const uint2 *kp[XM];
#pragma unroll
        for (int k = 0; k < XM; k++) {
            const int wg = k / XW, W = BK == 4 ? 8 * wg + 2 * t + k % XW : 4 * wg + t;
            kp[k] = (const uint2 *)(kc + (size_t)min(W, p.kw - 1) * 16 + 2 * g) + (size_t)tb * kstep;
        }
        auto load = [&](uint2 (&X)[XM]) {
#pragma unroll
            for (int k = 0; k < XM; k++) {
                if (k / XW < NWG) X[k] = __ldcs(kp[k]);
                kp[k] += kstep;
            }
        };
        // k2/v2 and k4/v4 at G >= 64: the B fragments of the current key group's first 128 dims, its bias and scale stay
        // in registers while the warp's tiles are in that group (4 or 8 tiles) instead of 8 shared-memory loads per tile
        // (at 4 bits this needs the compile-time word-group count, else ptxas spills; at G = 32, a group every 2 tiles, it
        // was slower)
        constexpr bool BC = BK == BV && LG >= 2;
        uint2 bc[BC ? 8 : 1]; // KSI·NTI (4) on the IM path: bc[nt·KSI + k]
        int cgi = -1;
        float ckb = 0.f, cik = 0.f, smx = -INFINITY; // the lane's largest score
        auto score = [&](const uint2 (&X)[XM], int tile) {
            const int gi = tile >> LG;
            if constexpr (IM) {
                // KSI k-steps of 32 channels: A = field m of the lane's words t (a0, a1) and 4 + t (a2, a3) of positions
                // 2g (row g) and 2g + 1 (row g + 8) as bytes code·4^m, one AND each (4-bit: nibble k & 1 of words
                // 8 (k >> 1) + t and 8 (k >> 1) + 4 + t, code·16^(k & 1); 2-bit at head_dim 64: fields 2k (a0, a1) and
                // 2k + 1 (a2, a3) of word t); the group's B fragments (digits of q·s·e) stay in bc (b0, b1 of k-step k,
                // n-tile nt in bc[nt·KSI + k]) with the group's bias and 1/F_γ. Columns 8nt + 2t, 8nt + 2t + 1: digits 0, 1
                // (t even) or 2, 3 (t odd) of head 2nt + t / 2, combined in s32 as 256·c1 + c0 and then in fp32
                // (two n-tiles: lane t holds all four digits of head t, imma_col)
                const int hj0 = NTI > 1 ? t : t >> 1;
                if (gi != cgi) {
                    cgi = gi;
#pragma unroll
                    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
                        for (int k = 0; k < KSI; k++)
                            bc[nt * KSI + k] = imma_col_used(GQ, 8 * nt + g) ? bfr[((gi * KSI + k) * NCK + 8 * nt + g) * 4 + t] : make_uint2(0u, 0u);
                    cik = kinv[gi];
                    if (hj0 < GQ) ckb = kbias[gi * GQ + hj0];
                }
                int acc[NTI][4];
#pragma unroll
                for (int nt = 0; nt < NTI; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
#pragma unroll
                for (int k = 0; k < KSI; k++) {
                    uint32_t a0, a1, a2, a3;
                    if (BK == 2 && DI == 64) {
                        const uint32_t M0 = 0x03030303u << (4 * k), M1 = M0 << 2;
                        a0 = X[0].x & M0, a1 = X[0].y & M0, a2 = X[0].x & M1, a3 = X[0].y & M1;
                    } else {
                        const int x0 = BK == 4 ? 2 * (k >> 1) : 0;
                        const uint32_t M = BK == 4 ? 0x0F0F0F0Fu << (4 * (k & 1)) : 0x03030303u << (2 * k);
                        a0 = X[x0].x & M, a1 = X[x0].y & M, a2 = X[x0 + 1].x & M, a3 = X[x0 + 1].y & M;
                    }
#pragma unroll
                    for (int nt = 0; nt < NTI; nt++) kvq_imma_us(acc[nt], a0, a1, a2, a3, bc[nt * KSI + k].x, bc[nt * KSI + k].y);
                }
                if constexpr (NTI > 1) { // digits 0, 1 in n-tile 0, 2, 3 in n-tile 1: no shuffle, lanes t < GQ write
                    const int y0 = acc[0][1] * 256 + acc[0][0], y1 = acc[0][3] * 256 + acc[0][2]; // |.| < 2^30
                    const int u0 = acc[1][1] * 256 + acc[1][0], u1 = acc[1][3] * 256 + acc[1][2];
                    const float s0 = fmaf(fmaf((float)u0, 65536.f, (float)y0), cik, ckb), s1 = fmaf(fmaf((float)u1, 65536.f, (float)y1), cik, ckb);
                    smx = fmaxf(smx, fmaxf(s0, s1)); // (lanes t >= GQ: not read)
                    if (t < GQ) *(float2 *)(sc + t * p.chunk + tile * 16 + 2 * g) = make_float2(s0, s1);
                } else {
                    const int y0 = acc[0][1] * 256 + acc[0][0], y1 = acc[0][3] * 256 + acc[0][2]; // |.| < 2^30
                    const int u0 = __shfl_xor_sync(0xffffffffu, y0, 1), u1 = __shfl_xor_sync(0xffffffffu, y1, 1); // digits 2, 3
                    if (!(t & 1) && hj0 < GQ) {
                        float *o = sc + hj0 * p.chunk + tile * 16 + 2 * g;
                        o[0] = fmaf(fmaf((float)u0, 65536.f, (float)y0), cik, ckb);
                        o[1] = fmaf(fmaf((float)u1, 65536.f, (float)y1), cik, ckb);
                        smx = fmaxf(smx, fmaxf(o[0], o[1]));
                    }
                }
                return;
            }
            if (BC && gi != cgi) {
                cgi = gi;
#pragma unroll
                for (int k = 0; k < (BC ? 8 : 1); k++) bc[k] = g < NC && k < KS4 ? bfr[((gi * KS4 + k) * NC + g) * 4 + t] : make_uint2(0u, 0u);
                if (t < GQ) {
                    ckb = kbias[gi * GQ + t];
                    cik = kinv[gi];
                }
            }
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int wg = 0; wg < 4; wg++) {
                if (wg >= NWG) break;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint2 x = X[wg * XW + (BK == 4 ? j >> 1 : 0)];
                    const int f0 = BK == 4 ? 2 * (j & 1) : 2 * j;
                    const uint2 b = BC && wg < 2 ? bc[BC ? 4 * wg + j : 0]
                                    : g < NC       ? bfr[((gi * KS4 + 4 * wg + j) * NC + g) * 4 + t]
                                                   : make_uint2(0u, 0u);
                    kvq_mma16816(acc, key_field<BK>(x.x, f0), key_field<BK>(x.y, f0), key_field<BK>(x.x, f0 + 1),
                                 key_field<BK>(x.y, f0 + 1), b.x, b.y);
                }
            }
            // rows g, g + 8 = positions 2g, 2g + 1; columns 2t, 2t + 1 = query head t (hi, lo)
            if (t < GQ) {
                const float kbv = BC ? ckb : kbias[gi * GQ + t], ik = BC ? cik : kinv[gi];
                const float s0 = fmaf(acc[0] + acc[1], ik, kbv), s1 = fmaf(acc[2] + acc[3], ik, kbv);
                sc[t * p.chunk + tile * 16 + 2 * g] = s0;
                sc[t * p.chunk + tile * 16 + 2 * g + 1] = s1;
                smx = fmaxf(smx, fmaxf(s0, s1));
            }
        };
        if constexpr (IM) {
            // KPF register sets used in turn (KPF - 1 tiles ahead); kw = KX·4 words, so one pointer and
            // compile-time offsets (words t + 4k of positions 2g, 2g + 1; 32·KX uint2 per tile)
            auto kuse = [&](const uint2 (&x)[KX], int i) {
                uint2 x4[XM];
#pragma unroll
                for (int k = 0; k < XM; k++) x4[k] = k < KX ? x[k] : make_uint2(0u, 0u);
                score(x4, i);
            };
            ring_loop(XK, tb, te, kload, kuse);
        } else {
            // tiles in pairs, two register sets used in turn (written out: through ring_prologue / ring_loop it was slower
            // at 4 bits)
            uint2 Xa[XM], Xb[XM];
            if (tb < te) load(Xa);
            for (int tile = tb; tile < te; tile += 2) {
                if (tile + 1 < te) load(Xb);
                score(Xa, tile);
                if (tile + 2 < te) load(Xa);
                if (tile + 1 < te) score(Xb, tile + 1);
            }
        }
        // the warp's largest score per head j into red[warp][j] (the softmax's maximum without a pass): lanes g = 0 with
        // t = 2j on the IM path with one n-tile (odd t hold none), t = j with two and on the fp16 path
        for (int o = 4; o < 32; o <<= 1) smx = fmaxf(smx, __shfl_xor_sync(0xffffffffu, smx, o));
        const bool one = IM && NTI == 1;
        const int hj = one ? t >> 1 : t;
        if (g == 0 && (!one || !(t & 1)) && hj < GQ) red[warp * GQ + hj] = smx;
    }
    __syncthreads();
    // no softmax pass: the chunk's maximum comes from the score loop (each warp's in red), and exp(s - m) and Σ p are
    // taken in the next pass over the scores (IM: the value operands'; else the first group's value statistics, which
    // writes p back): one pass over the scores fewer

    // IM: the P·V phase's value ring (VPF register sets, k-steps [vkb, vke) of 32 positions) is primed before the value
    // operands are built
    // 2-bit: VWI = vw words per position (8 at head_dim 128, 4 at 64); lane 4g + t loads word g (at 64: g & 3, lanes g
    // and g + 4 the same word) of positions 4r + t
    constexpr int VWI = DI * BV / 32;
    [[maybe_unused]] const uint32_t *lp = p.vcodes + ((size_t)(s * p.H + h) * p.capq + q0 + t + 32 * vkb) * VWI + (g & (VWI - 1));
    [[maybe_unused]] int kl = vkb; // the next k-step to load
    // value-code prefetch into L1, VPD steps ahead of the ring's loads (k-steps of 32 positions at 2 bits; tiles of 16 at
    // 4, twice as many steps: the same positions), where it helped and only with at least two waves of blocks (p.vpref):
    // lane l < VNL asks for 128-byte line l of step k (positions VSP·k + l·32 / VWI..). The largest stall of the P·V loop
    // is its value loads, one k-step ahead in registers (more sets spill); the prefetch shortens it. It did not help at
    // 2-bit values with head_dim 128, nor with one wave of blocks; into L2 it was no better, 4 k-steps ahead slower
    constexpr bool VPX = IM && (DI == 64 || BV == 4);
    constexpr int VPD = BV == 4 ? 4 : 2, VSP = BV == 4 ? 16 : 32, VNL = VWI * VSP / 32;
    const bool vpx = VPX && p.vpref && lane < VNL;
    [[maybe_unused]] const uint32_t *vpf = p.vcodes + ((size_t)(s * p.H + h) * p.capq + q0) * VWI + 32 * lane;
    [[maybe_unused]] auto vpref = [&](int k, int kend) {
        if (vpx && k < kend && VSP * k + lane * 32 / VWI < n) {
#ifndef KVQ_EMU
            asm volatile("prefetch.global.L1 [%0];" ::"l"(vpf + (size_t)k * VSP * VWI));
#endif
        }
    };
    auto vload = [&](uint32_t (&w)[8]) {
        vpref(kl + VPD, vke);
        const bool two = 2 * kl + 1 < ntile; // the last k-step's second tile may lie past the chunk: zeros
#pragma unroll
        for (int r = 0; r < 4; r++) {
            w[r] = __ldcs(lp + 4 * VWI * r); // position 4r + t: the 4 lanes t of a load read 4·VWI·4 contiguous bytes
            w[4 + r] = two ? __ldcs(lp + 16 * VWI + 4 * VWI * r) : 0u;
        }
        lp += 32 * VWI;
        kl++;
    };
    [[maybe_unused]] uint32_t XV[VPF][8];
    // 4-bit: tiles [vtb, vte) of 16 positions, lane 4g + t loading words 2g, 2g + 1 (one uint2; at head_dim 64 word g,
    // in .x) of positions 4r + t (each load's 32 lanes read 256 (128) contiguous bytes); VPF4 register sets used in turn
    // (5 at head_dim 64, where a set is 4 registers: faster than 3 there; for 2-bit values 3 sets of k-steps were slower
    // than 2)
    constexpr int VPF4 = DI == 64 ? 5 : 3;
    [[maybe_unused]] const int vtb = 2 * vkb, vte = min(ntile, 2 * vke);
    [[maybe_unused]] const uint32_t *lp4 = p.vcodes + ((size_t)(s * p.H + h) * p.capq + q0 + t + 16 * vtb) * VWI + (DI == 128 ? 2 * g : g);
    [[maybe_unused]] int kl4 = vtb; // the next tile to load (4-bit)
    auto vload4 = [&](uint2 (&w)[4]) {
        vpref(kl4 + VPD, vte);
        kl4++;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            if (DI == 128) w[r] = __ldcs((const uint2 *)lp4 + 32 * r);
            else w[r].x = __ldcs(lp4 + 32 * r);
        }
        lp4 += 16 * VWI;
    };
    [[maybe_unused]] uint2 XV4[VPF4][4];
    if constexpr (VPX) // the steps up to VPD ahead of the prologue's (whose loads prefetch the next ones)
        for (int k = 1; k < VPD; k++) BV == 4 ? vpref(vtb + k, vte) : vpref(vkb + k, vke);
    if constexpr (IM && BV == 4) ring_prologue(XV4, vtb, vte, vload4);
    else if constexpr (IM) ring_prologue(XV, vkb, vke, vload);

    // ---- value statistics per group: max s (the operands' scale fv = pow2_scale(max s), as p <= 1) and the bias
    // Σ p·min, warp sums then shared atomics (IM: max s before, Σ p·min with the operands below)
    float mc[GQ]; // the chunk's largest score per head (softmax maximum; IM: in log2 units, as its scores)
    if constexpr (IM) {
        // thread j < GQ takes head j's over the warps into red[j] (its own column of red), read by all after the barrier
        // below; the partial's statistic in natural-log units
        if (tid < GQ) {
            float m = -INFINITY;
#pragma unroll
            for (int w = 0; w < NWF; w++) m = fmaxf(m, red[w * GQ + tid]);
            red[tid] = m;
            stat[tid] = m * 0.693147180559945309f;
        }
    } else {
#pragma unroll
        for (int j = 0; j < GQ; j++) {
            mc[j] = -INFINITY;
#pragma unroll
            for (int w = 0; w < NWF; w++) mc[j] = fmaxf(mc[j], red[w * GQ + j]);
            if (tid == 0) stat[j] = mc[j];
        }
    }
    for (int ga = 0; ga < (IM ? 0 : NG); ga++) {
        float mv = 0.f, pz[GQ], ls[GQ];
#pragma unroll
        for (int j = 0; j < GQ; j++) pz[j] = ls[j] = 0.f;
#pragma unroll 4
        for (int t2 = tid; t2 < n; t2 += NTF) { // 4 loads in flight
            const float2 z = __ldg(&vsb[(size_t)t2 * NG + ga]);
            mv = fmaxf(mv, fabsf(z.y));
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                float pp = sc[j * p.chunk + t2];
                if (ga == 0) { // the first group's pass exponentiates (the thread's own positions in every pass)
                    pp = expf(pp - mc[j]);
                    sc[j * p.chunk + t2] = pp;
                    ls[j] += pp;
                }
                pz[j] = fmaf(pp, z.x, pz[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < GQ; j++) {
            for (int o = 16; o; o >>= 1) pz[j] += __shfl_xor_sync(0xffffffffu, pz[j], o);
            if (lane == 0) atomicAdd(&vbias[ga * GQ + j], pz[j]);
            if (ga == 0) {
                for (int o = 16; o; o >>= 1) ls[j] += __shfl_xor_sync(0xffffffffu, ls[j], o);
                if (lane == 0) atomicAdd(&stat[GQ + j], ls[j]);
            }
        }
        for (int o = 16; o; o >>= 1) mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, o));
        if (lane == 0) atomicMax(&vmx[ga], __float_as_int(mv));
    }
    __syncthreads();
    if constexpr (IM) {
        // integer value operands over the key fragments: x = p·s·F_v, F_v = pow2_scale(max s, 8, 126) (x < 256 as p <= 1 and
        // s >= 0: KIVI's scales), as four unsigned bytes, x ≈ Σ_d 256^-d·d_d (the bytes of rint(x·2^24)), to 2^-25
        // absolute (three bytes, 2^-17, were not enough: Σ p·s·code and Σ p·min nearly cancel, and the emulator's
        // Llama-like 2/2 checks reached 1.4e-5 relative against ~1e-6 on the fp16 path). A thread per (k-step kp of 32 positions, t): b0 = rows 4t..4t+3
        // (positions 32 kp + 4i + t), b1 = rows 16 + 4t.. (positions 32 kp + 16 + 4i + t), column imma_col(GQ, j, d); [kp][column][t].
        // Positions past n (the last k-step's second tile) get 0
        const float Fv = pow2_scale(__int_as_float(vmx[0]), 8, 126);
        float pz[GQ], ls[GQ]; // Σ p·min, Σ p
#pragma unroll
        for (int j = 0; j < GQ; j++) {
            pz[j] = ls[j] = 0.f;
            mc[j] = red[j];
        }
        for (int i = tid; i < ((ntile + 1) >> 1) * 4; i += NTF) {
            const int tt = i & 3, kp = i >> 2;
            // (the scores are in log2 units: p = 2^(s - m). Positions past n, in the last k-step's second tile, read the
            // scores' buffer past the chunk's scores (within its capacity) and get p = 0)
            float2 zs[8];
            float sv[8]; // s·F_v·2^24
            const float *sp = sc + kp * 32 + tt;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int pa = kp * 32 + 16 * (k >> 2) + 4 * (k & 3) + tt;
                zs[k] = pa < n ? __ldg(&vsb[pa]) : make_float2(0.f, 0.f);
                sv[k] = zs[k].y * Fv * 16777216.f; // (in this order: F_v·2^24 may overflow)
            }
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                // x·2^24 rounded to an unsigned integer (x < 256: no overflow) has the digits as its bytes, the integer part
                // (digit 0) in byte 3; a 4 x 4 byte transpose per tile gives w[.][3 - d] = digit d of the 4 positions
                uint32_t u[8], w[2][4];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    const int pa = kp * 32 + 16 * (k >> 2) + 4 * (k & 3) + tt;
                    const float e = kvq_ex2(sp[j * p.chunk + 16 * (k >> 2) + 4 * (k & 3)] - mc[j]), pp = pa < n ? e : 0.f;
                    ls[j] += pp;
                    pz[j] = fmaf(pp, zs[k].x, pz[j]);
                    u[k] = __float2uint_rn(pp * sv[k]);
                }
                byte_transpose(u, w[0]);
                byte_transpose(u + 4, w[1]);
#pragma unroll
                for (int d = 0; d < 4; d++) bfr[(kp * NCV + imma_col(GQ, j, d)) * 4 + tt] = make_uint2(w[0][3 - d], w[1][3 - d]);
            }
        }
        // the warp's sums into wsum[warp] (the output loop adds the warps': no shared atomics, which are compare-and-swap
        // loops on floats)
#pragma unroll
        for (int o = 16; o; o >>= 1)
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                pz[j] += __shfl_xor_sync(0xffffffffu, pz[j], o);
                ls[j] += __shfl_xor_sync(0xffffffffu, ls[j], o);
            }
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                wsum[2 * warp * GQ + j] = pz[j];
                wsum[(2 * warp + 1) * GQ + j] = ls[j];
            }
        if (tid == 0) vinv[0] = __int_as_float(vmx[0]) < INFINITY ? 1.f / Fv : NAN;
    } else {
    // value B fragments p·s·fv per (tile, group) (hi, lo) over the key fragments: a thread per (tile, group, t) loads
    // its 4 positions' scales once for all columns
#pragma unroll 2
    for (int i = tid; i < ntile * NG * 4; i += NTF) {
        const int tt = i & 3, ga = (i >> 2) % NG, kt = (i >> 2) / NG;
        const float fv = pow2_scale(__int_as_float(vmx[ga]));
        int pa[4];
        float2 z[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            pa[k] = kt * 16 + 2 * tt + 8 * (k >> 1) + (k & 1);
            z[k] = __ldg(&vsb[(size_t)pa[k] * NG + ga]);
        }
#pragma unroll
        for (int j = 0; j < GQ; j++) {
            float y[4];
#pragma unroll
            for (int k = 0; k < 4; k++) y[k] = sc[j * p.chunk + pa[k]] * z[k].y * fv;
            const uint32_t h0 = kvq_h2pack(y[0], y[1]), h1 = kvq_h2pack(y[2], y[3]);
            bfr[((kt * NG + ga) * NC + 2 * j) * 4 + tt] = make_uint2(h0, h1);
            bfr[((kt * NG + ga) * NC + 2 * j + 1) * 4 + tt] =
                make_uint2(kvq_h2pack(y[0] - h2f(h0), y[1] - h2f(h0 >> 16)), kvq_h2pack(y[2] - h2f(h1), y[3] - h2f(h1 >> 16)));
        }
    }
    for (int ga = tid; ga < NG; ga += NTF) vinv[ga] = 1.f / pow2_scale(__int_as_float(vmx[ga]));
    }
    __syncthreads();

    // ---- P·V: warp w takes the contiguous k-tiles [kb, ke); passes of 4 m-tiles (8 at G = 128), the pass's number of
    // groups a compile-time constant (pv_pass), so the k-tile loop carries no group test and its accumulators stay in
    // place. Per k-tile a lane loads the words of all the pass's groups at once (rows 2t, 2t+1, 2t+8, 2t+9), the next
    // k-tile's meanwhile (two register sets used in turn: no copies)
    if constexpr (IM) {
        // ---- P·V on the integer tensor cores: warp w takes the contiguous k-steps [kb, ke) of 32 positions (two
        // tiles). Lane 4g + t loads word g (channels 16g..16g+15) of positions t, 4 + t, 8 + t, 12 + t of both tiles
        // (k-rows 4t + i of the fragment = position 4i + t, so each load's 4 lanes t read 128 contiguous bytes); a byte
        // transpose (8 PRMT) makes T_i = byte i of those 4 words, and field f of T_i (one AND) is the A register of
        // channel 16g + 4i + f over the 4 positions, as code·4^f: m-tile m, row g = channel 16g + 4(m/2) + 2(m%2), row
        // g + 8 the next channel. The s32 sums stay exact over the whole chunk (|Σ| <= 192·255·chunk/warps < 2^31
        // for chunks up to 2^16; 4-bit: 240·255·chunk/warps), scaled once at the end: 256^-d for digit d (column
        // imma_col) into the stage, 4^-f (4-bit: 16^-f) and 1/F_v in the output loop
        // 2 bits: VWI words per position (8 at head_dim 128, 4 at 64), so one pointer per lane and compile-time offsets;
        // VPF register sets used in turn (VPF - 1 k-steps ahead)
        // head_dim 64 (2-bit): lane 4g + t's word is g & 3, and its m-tile m (byte i = m of the transpose) takes fields
        // 2(g >> 2) (row g) and the next (row g + 8): channels 16 (g & 3) + 4m + 2 (g >> 2) (+ 1). With 3 or 4 query
        // heads, digits 2, 3 in the second n-tile (imma_col)
        int acc[MTI][NTI][4];
#pragma unroll
        for (int m = 0; m < MTI; m++)
#pragma unroll
            for (int nt = 0; nt < NTI; nt++) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0;
        auto kstep = [&](const uint32_t (&w)[8], int kp) {
            uint2 b[NTI];
#pragma unroll
            for (int nt = 0; nt < NTI; nt++) b[nt] = imma_col_used(GQ, 8 * nt + g) ? bfr[(kp * NCV + 8 * nt + g) * 4 + t] : make_uint2(0u, 0u);
            uint32_t T[2][4]; // T[0][i] (first tile), T[1][i] (second): byte r = byte i of position 4r + t's word
            byte_transpose(w, T[0]);
            byte_transpose(w + 4, T[1]);
#pragma unroll
            for (int m = 0; m < MTI; m++) {
                const int i = pv_byte<DI>(m), f = pv_field<DI>(g, m);
                const uint32_t M0 = 0x03030303u << (2 * f), M1 = M0 << 2;
#pragma unroll
                for (int nt = 0; nt < NTI; nt++) kvq_imma_uu(acc[m][nt], T[0][i] & M0, T[0][i] & M1, T[1][i] & M0, T[1][i] & M1, b[nt].x, b[nt].y);
            }
        };
        // 4-bit: per tile of 16 positions, mma.m16n8k16 (b0 of the k-step's B fragment for its first tile, b1 for the
        // second); the byte transpose of words 2g (hw 0) and 2g + 1 (hw 1) gives T_i = byte i over the 4 positions, and
        // its low / high nibbles (one AND each) are the A registers of m-tile 4 hw + i: row g = channel 16g + 8hw + 2i
        // (code), row g + 8 = the next channel (code·16); at head_dim 64 word g alone (hw 0): channel 8g + 2i
        auto tile4 = [&](const uint2 (&w)[4], int kt) {
            uint32_t b[NTI];
#pragma unroll
            for (int nt = 0; nt < NTI; nt++)
                b[nt] = imma_col_used(GQ, 8 * nt + g) ? ((const uint32_t *)bfr)[(((kt >> 1) * NCV + 8 * nt + g) * 4 + t) * 2 + (kt & 1)] : 0u;
#pragma unroll
            for (int hw = 0; hw < DI / 64; hw++) {
                const uint32_t x[4] = {hw ? w[0].y : w[0].x, hw ? w[1].y : w[1].x, hw ? w[2].y : w[2].x, hw ? w[3].y : w[3].x};
                uint32_t T[4];
                byte_transpose(x, T);
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int nt = 0; nt < NTI; nt++) kvq_imma16_uu(acc[4 * hw + i][nt], T[i] & 0x0F0F0F0Fu, T[i] & 0xF0F0F0F0u, b[nt]);
            }
        };
        if constexpr (BV == 4) ring_loop(XV4, vtb, vte, vload4, tile4);
        else ring_loop(XV, vkb, vke, vload, kstep);
        // One n-tile: c0, c1: row g, columns 2t, 2t + 1 (digits 2 (t & 1), 2 (t & 1) + 1 of head t / 2); c2, c3: row
        // g + 8. Two (imma_col): n-tile 0's c0, c1 digits 0, 1 of head t, n-tile 1's digits 2, 3. The four digits' sums
        // Σ_d 256^-d·c_d in fp32 (lane t's pair, then the other pair: its neighbour t ^ 1's by a shuffle, or its own second
        // n-tile's) into the stage [warps][gq][D], one value per (head, channel)
#pragma unroll
        for (int m = 0; m < MTI; m++) {
            float x[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if constexpr (NTI > 1) {
                    x[r] = fmaf((float)acc[m][0][2 * r + 1], 0x1p-8f, (float)acc[m][0][2 * r]) +
                           fmaf((float)acc[m][NTI - 1][2 * r + 1], 0x1p-8f, (float)acc[m][NTI - 1][2 * r]) * 0x1p-16f;
                } else {
                    x[r] = fmaf((float)acc[m][0][2 * r + 1], 0x1p-8f, (float)acc[m][0][2 * r]) * (t & 1 ? 0x1p-16f : 1.f);
                    x[r] += __shfl_xor_sync(0xffffffffu, x[r], 1);
                }
            }
            const int j = NTI > 1 ? t : t >> 1;
            if ((NTI > 1 || !(t & 1)) && j < GQ)
#pragma unroll
                for (int r = 0; r < 2; r++) stage[(warp * GQ + j) * D + pv_channel<BV, DI>(g, m) + r] = x[r];
        }
    } else {
        const uint32_t *vc = p.vcodes + ((size_t)(s * p.H + h) * p.capq + q0) * p.vw;
        const int per = (ntile + NWF - 1) / NWF, kb = warp * per, ke = min(ntile, kb + per);
        // passes of MT m-tiles (64 dims; 128 at G = 128, whose groups are 8 m-tiles): GPP groups per pass, NWL words per
        // row and group
        constexpr int MT = PPL > 4 ? PPL : 4, GPP = MT / PPL, NWL = BV * 2 * PPL > 32 ? 2 : 1, GW = G * BV / 32;
        // the lane's first dim pair of a group sits at bit lo0 of a word (the same in every group: G·BV is a multiple of
        // 32); 0 when a lane's pairs fill whole words (LZ), else all its pairs lie in one word (wk = 0)
        constexpr bool LZ = (BV * 2 * PPL) % 32 == 0;
        const int lo0 = LZ ? 0 : (BV * 2 * g * PPL) & 31;
        const size_t step = (size_t)16 * p.vw;
        for (int ga0 = 0; ga0 < NG; ga0 += GPP) {
            auto pv_pass = [&](auto ngl_c) {
                constexpr int NGL = decltype(ngl_c)::v, NX = NGL * 4 * NWL;
                float acc[NGL * PPL][4];
#pragma unroll
                for (int m = 0; m < NGL * PPL; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
                // rows g / g + 8 of m-tile (ga, mi): dims 2P, 2P + 1, P = ga·G/2 + g·PPL + mi; columns 2t, 2t+1: head t.
                // The accumulators go to the warp's stage (fp32, first = store) every 8 k-tiles and at the end, and are
                // reset: the tensor cores' fp32 accumulation truncates: chains of 39 k-tiles drifted to 1.8e-5 relative,
                // of 16 to 1.35e-5, of 8 to 7e-6 (H200, 5000 positions in one chunk)
                auto flush = [&](bool first) {
                    if (t < gn) {
#pragma unroll
                        for (int gl = 0; gl < NGL; gl++) {
                            const int ga = ga0 + gl;
                            const float vi = vinv[ga];
#pragma unroll
                            for (int mi = 0; mi < PPL; mi++) {
                                // pair P = ga·G/2 + g·PPL + mi at slot ga·G/2 + mi·8 + g: the 8 lanes g of a store
                                // hit consecutive pairs (at g·PPL: 4-way bank conflicts at G = 128)
                                float *st = stage + (warp * GQ + t) * D + 2 * (ga * (G / 2) + mi * 8 + g);
                                const float v0 = (acc[gl * PPL + mi][0] + acc[gl * PPL + mi][1]) * vi;
                                const float v1 = (acc[gl * PPL + mi][2] + acc[gl * PPL + mi][3]) * vi;
                                st[0] = first ? v0 : st[0] + v0;
                                st[1] = first ? v1 : st[1] + v1;
                            }
                        }
                    }
#pragma unroll
                    for (int m = 0; m < NGL * PPL; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
                };
                // a pointer per row (2t, 2t+1, 2t+8, 2t+9 of the k-tile) at the lane's first word of group ga0; group
                // ga0 + gl is GW words further (a compile-time offset); advanced one k-tile per load
                const uint32_t *rp[4];
#pragma unroll
                for (int r = 0; r < 4; r++)
                    rp[r] = vc + (size_t)(kb * 16 + 2 * t + (r & 1) + 8 * (r >> 1)) * p.vw + ((2 * g * PPL * BV) >> 5) + ga0 * GW;
                auto load = [&](uint32_t (&x)[NX]) {
#pragma unroll
                    for (int gl = 0; gl < NGL; gl++)
#pragma unroll
                        for (int r = 0; r < 4; r++)
                            if (NWL == 2) { // 4-bit, G = 128: the lane's two words are 8-byte aligned (an even word offset)
                                const uint2 w2 = __ldcs((const uint2 *)(rp[r] + gl * GW));
                                x[(gl * 4 + r) * NWL] = w2.x;
                                x[(gl * 4 + r) * NWL + NWL - 1] = w2.y;
                            } else {
                                x[(gl * 4 + r) * NWL] = __ldcs(rp[r] + gl * GW);
                            }
#pragma unroll
                    for (int r = 0; r < 4; r++) rp[r] += step;
                };
                auto tile = [&](const uint32_t (&x)[NX], int kt) {
#pragma unroll
                    for (int gl = 0; gl < NGL; gl++) {
                        const uint2 b = g < NC ? bfr[((kt * NG + ga0 + gl) * NC + g) * 4 + t] : make_uint2(0u, 0u);
#pragma unroll
                        for (int mi = 0; mi < PPL; mi++) {
                            const int o = lo0 + 2 * BV * mi, wk = LZ ? o >> 5 : 0, by = (o >> 3) & 3;
                            const uint32_t sel = (uint32_t)(by | by << 4 | (4 + by) << 8 | (4 + by) << 12);
                            const uint32_t *xg = x + gl * 4 * NWL;
                            const uint32_t y0 = __byte_perm(xg[0 * NWL + wk], xg[1 * NWL + wk], sel),
                                           y1 = __byte_perm(xg[2 * NWL + wk], xg[3 * NWL + wk], sel);
                            uint32_t a0, a1, a2, a3;
                            if (BV == 4) { // low nibble: dim 2P (row g), high nibble: dim 2P + 1 (row g + 8)
                                a0 = dq_field(y0, 0, 0x000F000Fu, 0x3C003C00u, 0xE400E400u);
                                a1 = dq_field(y0, 0, 0x00F000F0u, 0x2C002C00u, 0xD400D400u);
                                a2 = dq_field(y1, 0, 0x000F000Fu, 0x3C003C00u, 0xE400E400u);
                                a3 = dq_field(y1, 0, 0x00F000F0u, 0x2C002C00u, 0xD400D400u);
                            } else if (LZ) { // o a compile-time constant: the pair's nibble masked where it lies (4k
                                // bits up, k = o/4 & 1), no shift: fields 1024 + 4^(2k)·code and 1024 + 4^(2k+1)·code
                                const int k = (o >> 2) & 1;
                                a0 = dq_field(y0, 0, 0x00030003u << (4 * k), inv4(2 * k), off4(2 * k));
                                a1 = dq_field(y0, 0, 0x000C000Cu << (4 * k), inv4(2 * k + 1), off4(2 * k + 1));
                                a2 = dq_field(y1, 0, 0x00030003u << (4 * k), inv4(2 * k), off4(2 * k));
                                a3 = dq_field(y1, 0, 0x000C000Cu << (4 * k), inv4(2 * k + 1), off4(2 * k + 1));
                            } else { // the pair's nibble (4 (o/4 & 1) bits up): 2-bit codes of dims 2P, 2P + 1
                                const int sh = 4 * ((o >> 2) & 1);
                                a0 = dq_field(y0, sh, 0x00030003u, 0x3C003C00u, 0xE400E400u);
                                a1 = dq_field(y0, sh, 0x000C000Cu, 0x34003400u, 0xDC00DC00u);
                                a2 = dq_field(y1, sh, 0x00030003u, 0x3C003C00u, 0xE400E400u);
                                a3 = dq_field(y1, sh, 0x000C000Cu, 0x34003400u, 0xDC00DC00u);
                            }
                            kvq_mma16816(acc[gl * PPL + mi], a0, a1, a2, a3, b.x, b.y);
                        }
                    }
                };
                // blocks of 8 k-tiles (the flush interval), k-tiles in pairs (xa, xb); a block's last load fetches the
                // next block's first k-tile
                uint32_t xa[NX], xb[NX];
                if (kb < ke) load(xa);
                for (int k0 = kb; k0 < ke; k0 += 8) {
                    const int k1 = min(ke, k0 + 8);
                    for (int kt = k0; kt < k1; kt += 2) {
                        if (kt + 1 < k1) load(xb);
                        tile(xa, kt);
                        if (kt + 2 < ke) load(xa);
                        if (kt + 1 < k1) tile(xb, kt + 1);
                    }
                    flush(k0 == kb);
                }
                if (kb >= ke) flush(true); // zeros for a warp without k-tiles
            };
            const int ngl = min(GPP, NG - ga0);
            if (ngl == GPP) pv_pass(KI<GPP>{});
            else if (GPP > 1 && ngl == 1) pv_pass(KI<1>{});
            else if (GPP > 2 && ngl == 2) pv_pass(KI<(GPP > 2 ? 2 : 1)>{});
            else if (GPP > 3) pv_pass(KI<(GPP > 3 ? 3 : 1)>{});
        }
    }
    __syncthreads();
    for (int i = tid; i < gn * (D + 2); i += NTF) {
        const int j = i / (D + 2), d = i % (D + 2);
        float v;
        if (IM && d) { // Σ p (d = 1), Σ p·min (the bias) over the warps' sums
            float b = 0.f;
#pragma unroll
            for (int w = 0; w < NWF; w++) b += wsum[(2 * w + (d == 1)) * GQ + j];
            v = b;
            if (d > 1) { // channel d - 2: field (d - 2) % 4 of its byte, so the A operands were code·4^((d - 2) % 4) (4-bit:
                // nibble (d - 2) % 2, code·16^((d - 2) % 2))
                const int ch = d - 2;
                float x = 0.f;
#pragma unroll
                for (int w = 0; w < NWF; w++) x += stage[(w * GQ + j) * D + ch];
                const int f = BV == 4 ? ch & 1 : ch & 3;
                v = fmaf(x, vinv[0] * (BV == 4 ? (f ? 0.0625f : 1.f) : f == 0 ? 1.f : f == 1 ? 0.25f : f == 2 ? 0.0625f : 0.015625f), b);
            }
        } else if (d < 2) v = stat[d * GQ + j];
        else {
            v = vbias[((d - 2) / G) * GQ + j];
            const int P = (d - 2) >> 1, rem = P % (G / 2), slot = P - rem + (rem % PPL) * 8 + rem / PPL; // the flush's slot
#pragma unroll
            for (int w = 0; w < NWF; w++) v += stage[(w * GQ + j) * D + 2 * slot + ((d - 2) & 1)];
        }
        part0[j * pstride + d] = v;
    }
}
typedef void (*FastFn)(KivP);
// the kivi_fast word-group count for head_dim D: 1 (D <= 64) or 2 (D <= 128) as a compile-time constant, 0 (read at
// run time) above
__host__ __device__ constexpr int fast_nw(int D) { return D <= 64 ? 1 : D <= 128 ? 2 : 0; }
template <int BK, int BV, int GQ, int NW> FastFn fast_pick_lg(int lg)
{
    // G = 128 needs head_dim >= 128, so NW = 1 has no lg = 3 instantiation
    return lg == 0 ? kivi_fast<BK, BV, GQ, 0, NW> : lg == 1 ? kivi_fast<BK, BV, GQ, 1, NW> : lg == 2 ? kivi_fast<BK, BV, GQ, 2, NW>
                                                                                               : kivi_fast<BK, BV, GQ, 3, NW == 1 ? 0 : NW>;
}
template <int BK, int BV, int NW> FastFn fast_pick_gq(int gq, int lg)
{
    return gq == 1 ? fast_pick_lg<BK, BV, 1, NW>(lg) : gq == 2 ? fast_pick_lg<BK, BV, 2, NW>(lg) : gq == 3 ? fast_pick_lg<BK, BV, 3, NW>(lg) : fast_pick_lg<BK, BV, 4, NW>(lg);
}
template <int BK, int BV> FastFn fast_pick_nw(int gq, int lg, int nw)
{
    return nw == 1 ? fast_pick_gq<BK, BV, 1>(gq, lg) : nw == 2 ? fast_pick_gq<BK, BV, 2>(gq, lg) : fast_pick_gq<BK, BV, 0>(gq, lg);
}
// kivi_fast's instances are compiled in translation units of their own, one per (bk, bv) (the 44 kernels of
// fast_pick_nw<bk, bv>), written by the Makefile (KVC_INST: build/gen/kvcache_cuda_inst_kivi_<bk>_<bv>.cu instantiates
// fast_pick_nw<bk, bv> after these declarations), so that make -jN compiles them in parallel; no other unit
// instantiates them (fast_pick below would, in every unit that includes this file). The emulator (KVQ_EMU)
// instantiates them all in its own unit.
#ifndef KVQ_EMU
extern template FastFn fast_pick_nw<2, 2>(int, int, int);
extern template FastFn fast_pick_nw<2, 4>(int, int, int);
extern template FastFn fast_pick_nw<4, 2>(int, int, int);
extern template FastFn fast_pick_nw<4, 4>(int, int, int);
#endif
// kivi_fast for 2/4-bit keys (bk) and values (bv), gq (1..4) query heads per block, group 16 << lg (lg 0..3), word
// groups nw = fast_nw(head_dim)
inline FastFn fast_pick(int bk, int bv, int gq, int lg, int nw)
{
    if (bk == 2) return bv == 2 ? fast_pick_nw<2, 2>(gq, lg, nw) : fast_pick_nw<2, 4>(gq, lg, nw);
    return bv == 2 ? fast_pick_nw<4, 2>(gq, lg, nw) : fast_pick_nw<4, 4>(gq, lg, nw);
}
} // namespace kv

#endif
