// kvcache_cuda_nuq.cuh — the NUQ split-K decode kernel v3 (3-bit keys or values; 2- and 4-bit codes use
// v4::nuq_decode, kvcache_cuda_dec.cuh) and nuq_kernel, the choice among the NUQ decode kernels. Included by
// kvcache_cuda.cu after kvcache_cuda_dec.cuh. See formats/KVCACHE.md "Decode attention (GPU)".
//
// The kernels of each key width are compiled in a translation unit of their own, written by the Makefile (KVC_INST:
// build/gen/kvcache_cuda_inst_nuq_<bk>.cu instantiates nuq_kernel<bk> after the extern template declarations at the
// end of this file), so that make -jN compiles them in parallel; no other unit instantiates them.
#ifndef KVQ_KVCACHE_CUDA_NUQ_CUH
#define KVQ_KVCACHE_CUDA_NUQ_CUH

// code j of a unit (j a compile-time constant after unrolling)
template <int B> __device__ __forceinline__ uint32_t getc(const uint32_t *w, int j)
{
    const int bit = j * B, wi = bit >> 5, off = bit & 31;
    uint32_t v = w[wi] >> off;
    if (off + B > 32) v |= w[wi + 1] << (32 - off);
    return v & ((1u << B) - 1);
}

// ---- NUQ split-K decode -------------------------------------------------------------
// code j of a unit shifted left by SH (the byte offset of a table entry when entries are 2^SH bytes
// apart); one shift and one mask when the code does not straddle words
template <int B, int SH> __device__ __forceinline__ uint32_t code_sh(const uint32_t *w, int j)
{
    const int bit = j * B, wi = bit >> 5, off = bit & 31;
    if (off + B > 32) return getc<B>(w, j) << SH;
    const uint32_t v = off >= SH ? w[wi] >> (off - SH) : w[wi] << (SH - off);
    return v & (((1u << B) - 1) << SH);
}

// Shared memory (floats): [0, 32) value table (2-bit: 16 float2 = the levels of a nibble's two codes;
// 3/4-bit: the levels), [32, 32 + CK·NLK·32) key LUT replicated per lane (entry (j, code) of lane L's
// unit at word (j·NLK + code)·32 + L: lane L always reads bank L, so the random lookups never conflict),
// then qh [GQ][nhb_max][np] float2 (scaled query conj-rotated to each quantized index 64·(tb0 + b),
// tb0 = q0 / 64), sc [GQ][chunk], oacc [GQ][D], red [GQ][8], stat [2GQ], rsc [4 warps][8][33]
// (score reduction for lane counts that are not powers of two), rows [chunk + 1] (sparse row
// pointers of the chunk).
//
// Phase 1 (scores): lanes along the key units of a token (nuk lanes per token), 32/nuk streams per
// warp; each stream takes a contiguous run of positions and loads 8 tokens per unit word as two
// 16-byte loads (codes are token-minor), the next 8 in flight while these are computed. The RoPE
// factor w = conj(q̄)·e^{i p θ} of each pair is kept in registers and advanced one position by a
// complex multiply with e^{iθ} (exact re-anchor from qh at every quantized index that is a multiple
// of 64, which is always the start of an 8-token step: the token loop has no branches), so each key
// element costs one conflict-free LUT load and one FMA (+ the rotation, 2 FMA-equivalents per
// element and query head). The nuk partial sums of a token: shuffle reduce-scatter (power-of-two
// nuk) or shared memory. Sparse key outliers: a separate pass, one thread per entry, corrections
// added atomically to the scores.
template <int BK, int BV, int GQ>
__global__ void __launch_bounds__(128) nuq_decode(DecP p)
{
    typedef U<BK> UK;
    typedef U<BV> UV;
    constexpr int CK = UK::C, NLK = UK::NL, WK = UK::W, PK = CK / 2;
    extern __shared__ float4 sm4[];
    float *sm = (float *)sm4;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.z, h = blockIdx.y / p.qgroups, qg = blockIdx.y % p.qgroups;
    const int gq0 = qg * GQ, gn = min(GQ, p.g - gq0);
    const int D = p.D, np = p.np;
    const int nq = max(0, p.len[s] - p.n_exact);
    const int q0 = blockIdx.x * p.chunk, q1 = min(q0 + p.chunk, nq);
    float *part0 = p.part + ((size_t)(s * p.n_heads + h * p.g + gq0) * p.nslots + blockIdx.x) * (D + 2);
    const size_t pstride = (size_t)p.nslots * (D + 2);
    if (q0 >= q1) {
        empty_partials(part0, pstride, gn, D);
        return;
    }
    const int n = q1 - q0;
    // RoPE anchors at quantized indices 64·(tb0 + b): qh[b] = conj(q̄)·e^{i (n_exact + 64 (tb0 + b)) θ}
    const int tb0 = q0 >> 6, nhb = ((q1 - 1) >> 6) - tb0 + 1;
    float *vl = sm;                                   // [32]
    float *lutk = sm + 32;                            // [CK][NLK][32]
    float2 *qh = (float2 *)(lutk + CK * NLK * 32);    // [GQ][nhb_max][np]
    float *sc = (float *)(qh + GQ * p.nhb_max * np);  // [GQ][chunk]
    float *oacc = sc + GQ * p.chunk;                  // [GQ][D]
    float *red = oacc + GQ * D;                       // [GQ][8]
    float *stat = red + GQ * 8;                       // m[GQ], l[GQ]
    float *rsc = stat + 2 * GQ;                       // [4][8][33]
    uint32_t *rows = (uint32_t *)(rsc + 4 * 8 * 33);   // [chunk + 1] sparse row pointers of the chunk
    const int nuk = (D + CK - 1) / CK, tpk = 32 / nuk;
    {
        const float4 *kr = (const float4 *)(p.klutr + (size_t)h * CK * NLK * 32);
#pragma unroll 4
        for (int i = tid; i < CK * NLK * 8; i += 128) ((float4 *)lutk)[i] = __ldg(kr + i);
        const float *vlev = p.vlevels + h * UV::NL;
        if (BV == 2) {
            if (tid < 16) { vl[2 * tid] = vlev[tid & 3]; vl[2 * tid + 1] = vlev[tid >> 2]; }
        } else if (tid < UV::NL) vl[tid] = vlev[tid];
    }
    for (int jp = tid; jp < GQ * np; jp += blockDim.x) {
        const int j = jp / np, pi = jp % np;
        float qa = 0, qb = 0;
        if (j < gn) {
            const float *qv = p.q + ((size_t)s * p.n_heads + h * p.g + gq0 + j) * D;
            qa = qv[2 * pi] * p.scale;
            qb = 2 * pi + 1 < D ? qv[2 * pi + 1] * p.scale : 0.f;
        }
        const float2 l0 = __ldg(p.rlo + pi * 64 + (p.n_exact & 63));
        const int hb = tb0 + (p.n_exact >> 6);
#pragma unroll 4
        for (int b = 0; b < nhb; b++) {
            const float2 hi = __ldg(p.rhi + (size_t)(hb + b) * np + pi);
            const float2 e = make_float2(hi.x * l0.x - hi.y * l0.y, hi.x * l0.y + hi.y * l0.x);
            qh[(j * p.nhb_max + b) * np + pi] = make_float2(qa * e.x + qb * e.y, qa * e.y - qb * e.x);
        }
    }
    for (int i = tid; i < GQ * D; i += blockDim.x) oacc[i] = 0.f;
    __syncthreads();

    // phase 1: dense scores
    {
        const int u = lane % nuk, st = lane / nuk;
        const bool kact = st < tpk;
        const int S = 4 * tpk, Ls = ((n + S - 1) / S + 7) & ~7;
        const int sb = q0 + (warp * tpk + (kact ? st : 0)) * Ls, se = min(sb + Ls, q1);
        const uint32_t *kc = p.kcodes + ((size_t)(s * p.H + h) * p.kw + (size_t)u * WK) * p.capq;
        float2 rho[PK], w[GQ][PK];
#pragma unroll
        for (int jj = 0; jj < PK; jj++) {
            const int i = u * PK + jj;
            rho[jj] = i < np ? __ldg(p.rlo + i * 64 + 1) : make_float2(1.f, 0.f);
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) w[gg][jj] = make_float2(0.f, 0.f);
        }
        if (kact && sb < se) {
            const int b = (sb >> 6) - tb0;
#pragma unroll
            for (int jj = 0; jj < PK; jj++) {
                const int i = u * PK + jj;
                if (i < np) {
                    const float2 e = __ldg(p.rlo + i * 64 + (sb & 63));
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) {
                        const float2 a = qh[(gg * p.nhb_max + b) * np + i];
                        w[gg][jj] = make_float2(a.x * e.x - a.y * e.y, a.x * e.y + a.y * e.x);
                    }
                }
            }
        }
        const char *lbase = (const char *)(lutk) + lane * 4;
        float *rw = rsc + warp * 8 * 33;
        // power-of-two lanes per token: reduce-scatter with shuffles (NH halving steps, then full adds)
        const int pow2 = (nuk & (nuk - 1)) == 0;
        const int nh = nuk >= 8 ? 3 : nuk == 4 ? 2 : nuk == 2 ? 1 : 0;
        uint4 a[WK][2];
#pragma unroll
        for (int x = 0; x < WK; x++) {
            const bool live = kact && sb < se;
            a[x][0] = live ? __ldcs((const uint4 *)(kc + (size_t)x * p.capq + sb)) : make_uint4(0, 0, 0, 0);
            a[x][1] = live ? __ldcs((const uint4 *)(kc + (size_t)x * p.capq + sb + 4)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll 1
        for (int it = 0; it < Ls; it += 8) {
            const int t0 = sb + it;
            uint4 an[WK][2]; // the next 8 tokens' codes, in flight while these are computed
            {
                const bool live = kact && t0 + 8 < se;
#pragma unroll
                for (int x = 0; x < WK; x++) {
                    an[x][0] = live ? __ldcs((const uint4 *)(kc + (size_t)x * p.capq + t0 + 8)) : make_uint4(0, 0, 0, 0);
                    an[x][1] = live ? __ldcs((const uint4 *)(kc + (size_t)x * p.capq + t0 + 12)) : make_uint4(0, 0, 0, 0);
                }
            }
            if (it > 0 && (t0 & 63) == 0) { // exact anchor at each 64-token block (t0 is a multiple of 8)
                const int b = (t0 >> 6) - tb0;
                if (b < nhb) {
#pragma unroll
                    for (int jj = 0; jj < PK; jj++) {
                        const int i = u * PK + jj;
                        if (i < np)
#pragma unroll
                            for (int gg = 0; gg < GQ; gg++) w[gg][jj] = qh[(gg * p.nhb_max + b) * np + i];
                    }
                }
            }
            float part[GQ][8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t wd[WK];
#pragma unroll
                for (int x = 0; x < WK; x++) {
                    const uint4 &v = a[x][k >> 2];
                    wd[x] = (k & 3) == 0 ? v.x : (k & 3) == 1 ? v.y : (k & 3) == 2 ? v.z : v.w;
                }
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) part[gg][k] = 0.f;
#pragma unroll
                for (int jj = 0; jj < PK; jj++) {
                    const float ka = *(const float *)(lbase + code_sh<BK, 7>(wd, 2 * jj) + (2 * jj) * NLK * 128);
                    const float kb = *(const float *)(lbase + code_sh<BK, 7>(wd, 2 * jj + 1) + (2 * jj + 1) * NLK * 128);
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) part[gg][k] += ka * w[gg][jj].x - kb * w[gg][jj].y;
                }
                // advance w to the next position (no branch: the 8 tokens' work interleaves)
#pragma unroll
                for (int jj = 0; jj < PK; jj++)
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) {
                        const float2 o = w[gg][jj];
                        w[gg][jj] = make_float2(o.x * rho[jj].x - o.y * rho[jj].y, o.x * rho[jj].y + o.y * rho[jj].x);
                    }
            }
#pragma unroll
            for (int x = 0; x < WK; x++) { a[x][0] = an[x][0]; a[x][1] = an[x][1]; }
            if (pow2) {
                // lanes of a stream are an aligned group of nuk lanes; after NH halving steps lane holds
                // tokens tb + m (m < 8 >> NH), tb = sum over steps s of bit s of the lane times 4 >> s
                const int lo = lane & (nuk - 1);
                int tb = 0;
#pragma unroll
                for (int s2 = 0; s2 < 3; s2++)
                    if (s2 < nh && (lo >> s2 & 1)) tb += 4 >> s2;
                const bool writer = (lo >> nh) == 0 && kact;
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) {
                    float *v = part[gg];
#pragma unroll
                    for (int s2 = 0; s2 < 3; s2++) {
                        if (s2 < nh) {
                            const int off = 1 << s2;
                            const bool up = lane & off;
#pragma unroll
                            for (int k = 0; k < (4 >> s2); k++) {
                                const int half = 4 >> s2;
                                const float send = up ? v[k] : v[k + half];
                                const float keep = up ? v[k + half] : v[k];
                                v[k] = keep + __shfl_xor_sync(0xffffffffu, send, off);
                            }
                        }
                    }
                    for (int off = 1 << nh; off < nuk; off <<= 1)
#pragma unroll
                        for (int k = 0; k < 8; k++)
                            if (k < (8 >> nh)) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
                    if (writer) {
#pragma unroll
                        for (int k = 0; k < 8; k++) {
                            const int t = t0 + tb + k;
                            if (k < (8 >> nh) && t < se) sc[gg * p.chunk + (t - q0)] = v[k];
                        }
                    }
                }
            } else {
                // any other lane count: through shared memory, one query head at a time
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) {
#pragma unroll
                    for (int k = 0; k < 8; k++) rw[k * 33 + lane] = part[gg][k];
                    __syncwarp();
                    for (int o = lane; o < 8 * tpk; o += 32) {
                        const int k = o & 7, so = o >> 3;
                        const int t = q0 + (warp * tpk + so) * Ls + it + k;
                        const int te = min(q0 + (warp * tpk + so + 1) * Ls, q1);
                        float acc = 0.f;
                        for (int uu = 0; uu < nuk; uu++) acc += rw[k * 33 + so * nuk + uu];
                        if (t < te) sc[gg * p.chunk + (t - q0)] = acc;
                    }
                    __syncwarp();
                }
            }
        }
    }
    __syncthreads();
    // sparse key outliers: one thread per entry (entries of the chunk are contiguous; the token of an
    // entry is found by binary search in the chunk's row pointers), corrections added atomically
    {
        const uint32_t *krow = p.krow + ((size_t)s * p.H + h) * (p.capq + 1) + q0;
        const uint32_t *kent = p.kent + ((size_t)s * p.H + h) * p.ent_cap;
        for (int i = tid; i <= n; i += blockDim.x) rows[i] = __ldg(krow + i);
        __syncthreads();
        const int kzc = p.kz[h];
        const uint32_t E0 = rows[0], E1 = rows[n];
        int top = 1;
        while (2 * top <= n) top *= 2;
        constexpr int EB = 4; // entries per thread in flight
        for (uint32_t eb = E0 + tid; eb < E1; eb += EB * blockDim.x) {
            uint32_t en[EB];
            int ti[EB];
#pragma unroll
            for (int m = 0; m < EB; m++) {
                const uint32_t e = eb + m * blockDim.x;
                en[m] = e < E1 ? __ldg(kent + e) : 0u;
                int lo = 0;
                for (int st2 = top; st2; st2 >>= 1)
                    if (lo + st2 < n && rows[lo + st2] <= e) lo += st2;
                ti[m] = lo;
            }
            float2 el[EB];
#pragma unroll
            for (int m = 0; m < EB; m++) el[m] = __ldg(p.rlo + (int)(en[m] >> 17) * 64 + ((q0 + ti[m]) & 63));
#pragma unroll
            for (int m = 0; m < EB; m++) {
                if (eb + m * blockDim.x >= E1) break;
                const int d = en[m] >> 16, i = d >> 1, b = ((q0 + ti[m]) >> 6) - tb0;
                const float corr = h2f(en[m]) - lutk[((d % CK) * NLK + kzc) * 32 + d / CK];
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) {
                    const float2 a = qh[(gg * p.nhb_max + b) * np + i];
                    const float wr = a.x * el[m].x - a.y * el[m].y, wi = a.x * el[m].y + a.y * el[m].x;
                    atomicAdd(&sc[gg * p.chunk + ti[m]], (d & 1) ? -corr * wi : corr * wr);
                }
            }
        }
    }
    __syncthreads();
    chunk_softmax<GQ>(sc, p.chunk, n, red, stat, stat + GQ);
    __syncthreads();

    // phase 3: P·V, lanes along the units of a token row (coalesced), tokens across lanes/warps
    {
        const int nuv = (D + UV::C - 1) / UV::C, tpw = 32 / nuv;
        const int nw = blockDim.x >> 5;
        const int unit = lane % nuv, tsub = lane / nuv;
        {
            const uint32_t *vrow = p.vrow + ((size_t)s * p.H + h) * (p.capq + 1) + q0;
            for (int i = tid; i <= n; i += blockDim.x) rows[i] = __ldg(vrow + i);
        }
        if (tsub < tpw) {
            float acc[GQ][UV::C], pz[GQ];
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                pz[gg] = 0.f;
#pragma unroll
                for (int j = 0; j < UV::C; j++) acc[gg][j] = 0.f;
            }
            const uint32_t *vc = p.vcodes + (size_t)(s * p.H + h) * p.capq * p.vw + unit * UV::W;
            const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq;
            const char *vb = (const char *)vl;
            constexpr int VT = 8; // tokens per batch; the next batch's loads are in flight during a batch
            const int st = nw * tpw;
            uint32_t w[VT][UV::W];
            float2 zr[VT];
            const int tb0 = q0 + warp * tpw + tsub;
#pragma unroll
            for (int k = 0; k < VT; k++) {
                const int t = tb0 + k * st;
#pragma unroll
                for (int x = 0; x < UV::W; x++) w[k][x] = t < q1 ? __ldcs(vc + (size_t)t * p.vw + x) : 0u;
                zr[k] = t < q1 ? __ldg(vs + t) : make_float2(0.f, 0.f);
            }
#pragma unroll 1
            for (int tb = tb0; tb < q1; tb += VT * st) {
                uint32_t wn[VT][UV::W];
                float2 zn[VT];
#pragma unroll
                for (int k = 0; k < VT; k++) {
                    const int t = tb + (VT + k) * st;
#pragma unroll
                    for (int x = 0; x < UV::W; x++) wn[k][x] = t < q1 ? __ldcs(vc + (size_t)t * p.vw + x) : 0u;
                    zn[k] = t < q1 ? __ldg(vs + t) : make_float2(0.f, 0.f);
                }
                // one token's P·V accumulation (k: its slot in the batch)
                auto accumulate = [&](int k, int t) {
                    float pr[GQ];
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) {
                        const float pp = sc[gg * p.chunk + (t - q0)];
                        pr[gg] = pp * zr[k].y;
                        pz[gg] += pp * zr[k].x;
                    }
                    if (BV == 2) {
#pragma unroll
                        for (int j = 0; j < UV::C; j += 2) {
                            const float2 L2 = *(const float2 *)(vb + ((w[k][0] >> (2 * j)) & 15u) * 8);
#pragma unroll
                            for (int gg = 0; gg < GQ; gg++) {
                                acc[gg][j] += pr[gg] * L2.x;
                                acc[gg][j + 1] += pr[gg] * L2.y;
                            }
                        }
                    } else {
#pragma unroll
                        for (int j = 0; j < UV::C; j++) {
                            const float L = *(const float *)(vb + code_sh<BV, 2>(w[k], j));
#pragma unroll
                            for (int gg = 0; gg < GQ; gg++) acc[gg][j] += pr[gg] * L;
                        }
                    }
                };
                if (tb + (VT - 1) * st < q1) { // a full batch: no per-token test, the tokens' work interleaves
#pragma unroll
                    for (int k = 0; k < VT; k++) accumulate(k, tb + k * st);
                } else {
#pragma unroll
                    for (int k = 0; k < VT; k++) {
                        const int t = tb + k * st;
                        if (t >= q1) break;
                        accumulate(k, t);
                    }
                }
#pragma unroll
                for (int k = 0; k < VT; k++) {
                    zr[k] = zn[k];
#pragma unroll
                    for (int x = 0; x < UV::W; x++) w[k][x] = wn[k][x];
                }
            }
#pragma unroll
            for (int j = 0; j < UV::C; j++) {
                const int d = unit * UV::C + j;
                if (d < D)
#pragma unroll
                    for (int gg = 0; gg < GQ; gg++) atomicAdd(&oacc[gg * D + d], acc[gg][j] + pz[gg]);
            }
        }
        __syncthreads(); // rows of the chunk's value outliers
        const uint32_t *vent = p.vent + ((size_t)s * p.H + h) * p.ent_cap;
        const float2 *vs = (const float2 *)p.vscale + (size_t)s * p.capq + q0;
        const float lz = BV == 2 ? vl[2 * p.vz[h]] : vl[p.vz[h]];
        const uint32_t E0 = rows[0], E1 = rows[n];
        int top = 1;
        while (2 * top <= n) top *= 2;
        constexpr int EB = 4;
        for (uint32_t eb = E0 + tid; eb < E1; eb += EB * blockDim.x) {
            uint32_t en[EB];
            int ti[EB];
#pragma unroll
            for (int m = 0; m < EB; m++) {
                const uint32_t e = eb + m * blockDim.x;
                en[m] = e < E1 ? __ldg(vent + e) : 0u;
                int lo = 0;
                for (int st2 = top; st2; st2 >>= 1)
                    if (lo + st2 < n && rows[lo + st2] <= e) lo += st2;
                ti[m] = lo;
            }
            float2 zr[EB];
#pragma unroll
            for (int m = 0; m < EB; m++) zr[m] = __ldg(vs + ti[m]);
#pragma unroll
            for (int m = 0; m < EB; m++) {
                if (eb + m * blockDim.x >= E1) break;
                const int d = en[m] >> 16;
                const float corr = h2f(en[m]) - (lz * zr[m].y + zr[m].x);
#pragma unroll
                for (int gg = 0; gg < GQ; gg++) atomicAdd(&oacc[gg * D + d], sc[gg * p.chunk + ti[m]] * corr);
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < gn * (D + 2); i += blockDim.x) {
        const int j = i / (D + 2), d = i % (D + 2);
        part0[j * pstride + d] = d == 0 ? stat[j] : d == 1 ? stat[GQ + j] : oacc[j * D + d - 2];
    }
}

typedef void (*DecFn)(DecP);

// query heads per block GQ: GQ x channels per unit <= 64 for keys (the RoPE factors a lane keeps) and
// for values (the accumulators of phase 3)
// v3 (nuq_decode above) serves 3-bit keys or values; 2- and 4-bit codes use v4::nuq_decode (kvcache_cuda_dec.cuh)
template <int BK, int BV, int GQ> DecFn nuq_pick3()
{
    if constexpr ((BK == 3 || BV == 3) && GQ * U<BK>::C <= 64 && GQ * U<BV>::C <= 64) return nuq_decode<BK, BV, GQ>;
    else if constexpr (BK != 3 && BV != 3 && GQ <= 4) return v4::nuq_decode<BK, BV, GQ>;
    else return nullptr;
}
template <int BK, int BV> DecFn nuq_pick2(int gq)
{
    switch (gq) {
    case 1: return nuq_pick3<BK, BV, 1>();
    case 2: return nuq_pick3<BK, BV, 2>();
    case 3: return nuq_pick3<BK, BV, 3>();
    case 4: return nuq_pick3<BK, BV, 4>();
    case 8: return nuq_pick3<BK, BV, 8>();
    default: return nullptr;
    }
}
// the decode kernel for BK-bit keys, bv-bit values (2, 3, 4) and gq query heads per block (1, 2, 3, 4, 8); nullptr where
// none
template <int BK> DecFn nuq_kernel(int bv, int gq)
{
    return bv == 2 ? nuq_pick2<BK, 2>(gq) : bv == 3 ? nuq_pick2<BK, 3>(gq) : nuq_pick2<BK, 4>(gq);
}
extern template DecFn nuq_kernel<2>(int, int);
extern template DecFn nuq_kernel<3>(int, int);
extern template DecFn nuq_kernel<4>(int, int);

#endif
