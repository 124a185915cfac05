// cuda_bwd_ops.cu — device kernels of the CUDA backward pass and of the
// attention statistics; see cuda_ops.cuh. Semantics are those of
// ops_backward.h and attention_backward.h (the CPU reference); each kernel
// says where the GPU differs (summation order only).
#include "cuda_ops.cuh"

#include <math.h>

#include "cuda_attn_tile.cuh"
#include "cuda_reduce.cuh"

namespace {

// ---- elementwise / row kernels ---------------------------------------------------

// kvq_rmsnorm_bwd: one block per row; both row sums in double.
__global__ void rmsnorm_bwd_k(float *dx, const float *dy, const float *x, const float *g, int dim, float eps, int accumulate)
{
    __shared__ double sh[kThreads / 32];
    const size_t t = blockIdx.x;
    const float *xr = x + t * dim, *dyr = dy + t * dim;
    float *o = dx + t * dim;
    double ss = 0, dot = 0;
    for (int c = threadIdx.x; c < dim; c += kThreads) {
        ss += (double)xr[c] * xr[c];
        dot += (double)dyr[c] * g[c] * xr[c];
    }
    ss = block_sum_d(ss, sh);
    dot = block_sum_d(dot, sh);
    const double r = 1.0 / sqrt(ss / dim + (double)eps);
    const float a = (float)r, b = (float)(r * r * r * dot / dim);
    for (int c = threadIdx.x; c < dim; c += kThreads) {
        float v = __fsub_rn(__fmul_rn(__fmul_rn(a, g[c]), dyr[c]), __fmul_rn(b, xr[c]));
        o[c] = accumulate ? __fadd_rn(o[c], v) : v;
    }
}

// kvq_swiglu_bwd (dgate may alias gate, dup may alias up).
__global__ void swiglu_bwd_k(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = gate[i], u = up[i], d = dout[i];
        const float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
        dup[i] = __fmul_rn(__fmul_rn(d, g), sg);
        dgate[i] = __fmul_rn(__fmul_rn(__fmul_rn(d, u), sg), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg))));
    }
}

__global__ void lse_final_k(double *lse, const float *row_max, const double *row_sum, const int *tg, int T)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) lse[t] = tg[t] >= 0 ? (double)row_max[t] + log(row_sum[t]) : 0.0;
}

// z[T][nv] (logits of vocabulary rows v0..v0+nv-1) -> dL/dz = scale (softmax - onehot); 0 on unscored rows.
__global__ void xent_grad_k(float *z, const int *tg, int v0, int nv, const double *lse, float scale)
{
    const size_t t = blockIdx.x;
    float *zr = z + t * nv;
    const int target = tg[t];
    if (target < 0) {
        for (int i = threadIdx.x; i < nv; i += kThreads) zr[i] = 0.0f;
        return;
    }
    const double l = lse[t];
    for (int i = threadIdx.x; i < nv; i += kThreads) {
        float p = (float)exp((double)zr[i] - l);
        if (v0 + i == target) p = __fsub_rn(p, 1.0f);
        zr[i] = __fmul_rn(scale, p);
    }
}

__global__ void nonfinite_k(const float *x, size_t n, int *flag)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (!isfinite(x[i])) {
            atomicOr(flag, 1);
            return;
        }
}

// ---- attention: query side (dq and D, or the entropy) ------------------------------
// Block: 128 threads = BQ queries x TPQ threads of one query head, as the forward
// kernel (cuda_ops.cu attn_k) with the same per-thread channel split and the same
// summation order for the scores, so s and the forward's lse agree. Keys (prefix,
// then window) stream through shared memory in tiles of BK. Both reductions of a
// key are done by all lanes (full-warp shuffles) and masked afterwards.
// ENT = false: D_i = do_i . o_i and dq_i = scale * sum_c p_c (dp_c - D_i) k_c
//              (FlashAttention-2, Algorithm 2), dp_c = do_i . v_c, p_c = exp(s_c - lse_i).
// ENT = true:  entropy_i = -sum_c p_c (s_c - lse_i).
template <int HD, int TPQ, int BK, bool ALT, bool ENT>
__global__ void __launch_bounds__(128) attn_qside_k(kvq_cu_attn a, kvq_cu_attn_grad b, float scale)
{
    constexpr int DPT = HD / TPQ, BQ = 128 / TPQ;
    __shared__ __align__(16) float Ks[BK * HD];
    __shared__ __align__(16) float Vs[ENT ? 4 : BK * HD];
    __shared__ __align__(16) float Kq[ALT ? BK * HD : 4];
    __shared__ __align__(16) float Vq[ALT && !ENT ? BK * HD : 4];
    const int h = blockIdx.y, kvh = h / (a.n_heads / a.n_kv_heads);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int tid = threadIdx.x, qi = tid / TPQ, part = tid % TPQ;
    const int i = q0 + qi;
    const bool valid = i < a.T;
    const size_t row = ((size_t)(valid ? i : 0) * a.n_heads + h) * HD;
    float qr[DPT], dor[DPT], dq[DPT];
    float D = 0.0f;
#pragma unroll
    for (int e = 0; e < DPT; e++) {
        qr[e] = valid ? __fmul_rn(a.q[row + e * TPQ + part], scale) : 0.0f;
        dq[e] = 0.0f;
        dor[e] = 0.0f;
        if (!ENT && valid) {
            dor[e] = b.dout[row + e * TPQ + part];
            D = fmaf(dor[e], a.out[row + e * TPQ + part], D);
        }
    }
    if (!ENT) D = group_sum<TPQ>(D);
    const float lse = valid ? a.lse[(size_t)h * a.T + i] : 0.0f;
    int kb = 0, vb = 0;
    if (ALT && valid) {
        kb = a.kb ? a.kb[i] : 0;
        vb = a.vb ? a.vb[i] : 0;
    }
    const int q_last = min(a.T, q0 + BQ) - 1;
    const int n_keys = a.P + q_last + 1, my_last = a.P + i;
    float hsum = 0.0f;
    const int k_first = win_first_key(a, q0) / BK * BK; // sliding window: keys masked for the whole block
    for (int k0 = k_first; k0 < n_keys; k0 += BK) {
        load_kv_tile<HD, BK, ALT, !ENT>(a, kvh, k0, n_keys, tid, Ks, Vs, Kq, Vq);
        __syncthreads();
        const int kend = min(BK, n_keys - k0);
        for (int r = 0; r < kend; r++) {
            const int jj = k0 + r;
            const float *kr = Ks + r * HD;
            if (ALT && jj >= a.P && jj - a.P < kb) kr = Kq + r * HD;
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < DPT; e++) d = fmaf(qr[e], kr[e * TPQ + part], d);
            d = group_sum<TPQ>(d);
            const bool vis = valid && jj <= my_last && win_vis(a, i, jj);
            const float t = d - lse;
            const float p = vis ? expf(t) : 0.0f;
            if (ENT) {
                if (p > 0.0f) hsum -= p * t;
            } else {
                const float *vr = Vs + r * HD;
                if (ALT && jj >= a.P && jj - a.P < vb) vr = Vq + r * HD;
                float dp = 0.0f;
#pragma unroll
                for (int e = 0; e < DPT; e++) dp = fmaf(dor[e], vr[e * TPQ + part], dp);
                dp = group_sum<TPQ>(dp);
                const float ds = p * (dp - D);
#pragma unroll
                for (int e = 0; e < DPT; e++) dq[e] = fmaf(ds, kr[e * TPQ + part], dq[e]);
            }
        }
        __syncthreads();
    }
    if (!valid) return;
    if constexpr (ENT) {
        if (part == 0) b.entropy[(size_t)h * a.T + i] = hsum;
    } else {
#pragma unroll
        for (int e = 0; e < DPT; e++) b.dq[row + e * TPQ + part] = dq[e] * scale;
        if (part == 0) b.D[(size_t)h * a.T + i] = D;
    }
}

// ---- attention: key side (dK, dV, prefix gradients, or the attention mass) ---------
// Block: 128 threads = BKK keys x TPQ threads of one kv head; keys c0..c0+BKK-1 of
// the sequence [prefix | window] stay in registers (both representations when the
// alternative is in use); the queries that see them (all for prefix keys, i >= j for
// window key j) stream through shared memory in tiles of BQT, for every query head of
// the GQA group. The score uses the representation query i reads (kb[i] / vb[i]);
// the gradient goes to dK / dV whichever it was (straight-through: the alternative's
// gradient is added to the primary's, attention_backward.h with dkq = dvq = NULL).
// MASS = false: dv_c = sum_i p dO_i, dk_c = sum_i ds q_i scale.
// MASS = true:  mass[h][c] = sum_i p (double accumulator, one per key and head).
template <int HD, int TPQ, int BQT, bool ALT, bool MASS>
__global__ void __launch_bounds__(128) attn_kside_k(kvq_cu_attn a, kvq_cu_attn_grad b, float scale)
{
    constexpr int DPT = HD / TPQ, BKK = 128 / TPQ;
    __shared__ __align__(16) float Qs[BQT * HD];
    __shared__ __align__(16) float Os[MASS ? 4 : BQT * HD];
    __shared__ float Ls[BQT], Ds[BQT];
    __shared__ int Kb[BQT], Vb[BQT];
    const int g = blockIdx.y, gs = a.n_heads / a.n_kv_heads;
    const int c0 = blockIdx.x * BKK; // earliest keys (most queries) first
    const int tid = threadIdx.x, ki = tid / TPQ, part = tid % TPQ;
    const int c = c0 + ki, n_keys = a.P + a.T;
    const bool validk = c < n_keys, pre = c < a.P;
    const int j = c - a.P; // window index (valid when !pre)
    float kr[DPT], vr[DPT], kqr[DPT], vqr[DPT], dk[DPT], dv[DPT];
    {
        const float *ks = NULL, *vs = NULL, *kqs = NULL, *vqs = NULL;
        if (validk) {
            if (pre) {
                size_t off = ((size_t)c * a.n_kv_heads + g) * HD;
                ks = a.pk + off;
                vs = a.pv + off;
            } else {
                size_t off = ((size_t)j * a.n_kv_heads + g) * HD;
                ks = a.k + off;
                vs = a.v + off;
                if (ALT) {
                    kqs = a.kq ? a.kq + off : ks;
                    vqs = a.vq ? a.vq + off : vs;
                }
            }
        }
#pragma unroll
        for (int e = 0; e < DPT; e++) {
            const int ch = e * TPQ + part;
            kr[e] = ks ? ks[ch] : 0.0f;
            vr[e] = vs && !MASS ? vs[ch] : 0.0f;
            kqr[e] = kqs ? kqs[ch] : kr[e];
            vqr[e] = vqs && !MASS ? vqs[ch] : vr[e];
            dk[e] = dv[e] = 0.0f;
        }
    }
    // first query that sees any key of the block: 0 when a prefix key is in it; with a sliding window, the
    // queries from i_end on see none of them (the block's last key leaves their window)
    const int i_first = c0 < a.P ? 0 : c0 - a.P;
    int i_end = a.T;
    if (a.window > 0) {
        const int c_last = min(c0 + BKK, n_keys) - 1;
        const long kp = c_last < a.P ? (long)c_last : (long)a.pos0 + (c_last - a.P), e = kp - a.pos0 + a.window;
        i_end = e < 0 ? 0 : e < a.T ? (int)e : a.T;
    }
    for (int hh = 0; hh < gs; hh++) {
        const int h = g * gs + hh;
        double mass = 0.0;
        for (int i0 = i_first; i0 < i_end; i0 += BQT) {
            const int nq = min(BQT, i_end - i0);
            __syncthreads();
            for (int idx = tid; idx < nq * HD; idx += 128) {
                const int r = idx / HD, ch = idx % HD;
                const size_t src = ((size_t)(i0 + r) * a.n_heads + h) * HD + ch;
                Qs[r * HD + ch] = __fmul_rn(a.q[src], scale);
                if (!MASS) Os[r * HD + ch] = b.dout[src];
            }
            for (int r = tid; r < nq; r += 128) {
                Ls[r] = a.lse[(size_t)h * a.T + i0 + r];
                if (!MASS) Ds[r] = b.D[(size_t)h * a.T + i0 + r];
                Kb[r] = ALT && a.kb ? a.kb[i0 + r] : 0;
                Vb[r] = ALT && a.vb ? a.vb[i0 + r] : 0;
            }
            __syncthreads();
            for (int r = 0; r < nq; r++) {
                const int i = i0 + r;
                const bool useq = ALT && !pre && j < Kb[r];
                const float *qs = Qs + r * HD;
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < DPT; e++) d = fmaf(qs[e * TPQ + part], useq ? kqr[e] : kr[e], d);
                d = group_sum<TPQ>(d);
                const bool vis = validk && (pre || j <= i) && win_vis(a, i, c);
                const float p = vis ? expf(d - Ls[r]) : 0.0f;
                if (MASS) {
                    mass += p;
                } else {
                    const bool usevq = ALT && !pre && j < Vb[r];
                    const float *os = Os + r * HD;
                    float dp = 0.0f;
#pragma unroll
                    for (int e = 0; e < DPT; e++) dp = fmaf(os[e * TPQ + part], usevq ? vqr[e] : vr[e], dp);
                    dp = group_sum<TPQ>(dp);
                    const float ds = p * (dp - Ds[r]);
#pragma unroll
                    for (int e = 0; e < DPT; e++) {
                        dv[e] = fmaf(p, os[e * TPQ + part], dv[e]);
                        dk[e] = fmaf(ds, qs[e * TPQ + part], dk[e]);
                    }
                }
            }
        }
        if (MASS && validk && part == 0) b.mass[(size_t)h * n_keys + c] = (float)mass;
    }
    if (MASS || !validk) return;
    float *dks, *dvs;
    if (pre) {
        if (!b.dpk) return;
        size_t off = ((size_t)c * a.n_kv_heads + g) * HD;
        dks = b.dpk + off;
        dvs = b.dpv + off;
    } else {
        size_t off = ((size_t)j * a.n_kv_heads + g) * HD;
        dks = b.dk + off;
        dvs = b.dv + off;
    }
#pragma unroll
    for (int e = 0; e < DPT; e++) {
        dks[e * TPQ + part] = dk[e];
        dvs[e * TPQ + part] = dv[e];
    }
}

template <int HD, int TPQ, int BK>
cudaError_t attn_bwd_launch(const kvq_cu_attn *a, const kvq_cu_attn_grad *b, bool stats, cudaStream_t st)
{
    constexpr int BQ = 128 / TPQ, BQT = 32;
    const float scale = 1.0f / sqrtf((float)a->head_dim);
    const bool alt = a->kq || a->vq;
    dim3 gq((unsigned)((a->T + BQ - 1) / BQ), (unsigned)a->n_heads);
    dim3 gk((unsigned)((a->P + a->T + BQ - 1) / BQ), (unsigned)a->n_kv_heads);
    if (stats) {
        if (b->entropy) {
            if (alt) attn_qside_k<HD, TPQ, BK, true, true><<<gq, 128, 0, st>>>(*a, *b, scale);
            else attn_qside_k<HD, TPQ, BK, false, true><<<gq, 128, 0, st>>>(*a, *b, scale);
        }
        if (b->mass) {
            if (alt) attn_kside_k<HD, TPQ, BQT, true, true><<<gk, 128, 0, st>>>(*a, *b, scale);
            else attn_kside_k<HD, TPQ, BQT, false, true><<<gk, 128, 0, st>>>(*a, *b, scale);
        }
        return cudaGetLastError();
    }
    if (alt) attn_qside_k<HD, TPQ, BK, true, false><<<gq, 128, 0, st>>>(*a, *b, scale);
    else attn_qside_k<HD, TPQ, BK, false, false><<<gq, 128, 0, st>>>(*a, *b, scale);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    if (alt) attn_kside_k<HD, TPQ, BQT, true, false><<<gk, 128, 0, st>>>(*a, *b, scale);
    else attn_kside_k<HD, TPQ, BQT, false, false><<<gk, 128, 0, st>>>(*a, *b, scale);
    return cudaGetLastError();
}

// Same thread split per head_dim as the forward kernel (kvq_cu_attention), so the
// scores here equal the forward's bit for bit.
cudaError_t attn_bwd_dispatch(const kvq_cu_attn *a, const kvq_cu_attn_grad *b, bool stats, cudaStream_t st)
{
    switch (a->head_dim) {
    case 8: return attn_bwd_launch<8, 1, 32>(a, b, stats, st);
    case 16: return attn_bwd_launch<16, 1, 32>(a, b, stats, st);
    case 32: return attn_bwd_launch<32, 2, 32>(a, b, stats, st);
    case 64: return attn_bwd_launch<64, 4, 32>(a, b, stats, st);
    case 128: return attn_bwd_launch<128, 8, 16>(a, b, stats, st);
    default: return cudaErrorInvalidValue;
    }
}

} // namespace

cudaError_t kvq_cu_rmsnorm_bwd(float *dx, const float *dy, const float *x, const float *g, int T, int dim, float eps,
                               int accumulate, cudaStream_t st)
{
    rmsnorm_bwd_k<<<T, kThreads, 0, st>>>(dx, dy, x, g, dim, eps, accumulate);
    return cudaGetLastError();
}

cudaError_t kvq_cu_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n,
                              cudaStream_t st)
{
    swiglu_bwd_k<<<grid_for(n, kThreads * 4), kThreads, 0, st>>>(dgate, dup, dout, gate, up, n);
    return cudaGetLastError();
}

cudaError_t kvq_cu_lse_final(double *lse, const float *row_max, const double *row_sum, const int *tg, int T, cudaStream_t st)
{
    lse_final_k<<<(T + 255) / 256, 256, 0, st>>>(lse, row_max, row_sum, tg, T);
    return cudaGetLastError();
}

cudaError_t kvq_cu_xent_grad(float *z, const int *tg, int v0, int nv, int T, const double *lse, float scale, cudaStream_t st)
{
    xent_grad_k<<<T, kThreads, 0, st>>>(z, tg, v0, nv, lse, scale);
    return cudaGetLastError();
}

cudaError_t kvq_cu_nonfinite(const float *x, size_t n, int *flag, cudaStream_t st)
{
    nonfinite_k<<<grid_for(n, kThreads * 8), kThreads, 0, st>>>(x, n, flag);
    return cudaGetLastError();
}

cudaError_t kvq_cu_attn_bwd(const kvq_cu_attn *a, const kvq_cu_attn_grad *b, cudaStream_t st)
{
    return attn_bwd_dispatch(a, b, false, st);
}

cudaError_t kvq_cu_attn_stats(const kvq_cu_attn *a, const float *lse, float *mass, float *entropy, cudaStream_t st)
{
    kvq_cu_attn f = *a;
    f.lse = const_cast<float *>(lse);
    kvq_cu_attn_grad b = {};
    b.mass = mass;
    b.entropy = entropy;
    return attn_bwd_dispatch(&f, &b, true, st);
}
