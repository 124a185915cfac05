// cuda_ops.cu — device kernels of the CUDA forward; see cuda_ops.cuh.
#include "cuda_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "cuda_attn_tile.cuh"
#include "cuda_reduce.cuh"

namespace {

// ---- forward building blocks -------------------------------------------------

__global__ void embed_bf16_k(float *x, const unsigned short *E, const int *tok, int dim)
{
    int t = blockIdx.x;
    const unsigned short *src = E + (size_t)tok[t] * dim;
    float *dst = x + (size_t)t * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = __uint_as_float((unsigned)src[c] << 16);
}

__global__ void to_bf16_k(unsigned short *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
}

__global__ void embed_k(float *x, const float *E, const int *tok, int dim)
{
    int t = blockIdx.x;
    const float *src = E + (size_t)tok[t] * dim;
    float *dst = x + (size_t)t * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = src[c];
}

__global__ void rmsnorm_k(float *out, const float *x, const float *g, int dim, float eps)
{
    __shared__ double sh[kThreads / 32];
    int t = blockIdx.x;
    const float *xr = x + (size_t)t * dim;
    float *o = out + (size_t)t * dim;
    double ss = 0;
    for (int c = threadIdx.x; c < dim; c += kThreads) ss += (double)xr[c] * (double)xr[c];
    ss = block_sum_d(ss, sh);
    float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (int c = threadIdx.x; c < dim; c += kThreads) o[c] = __fmul_rn(__fmul_rn(xr[c], r), g[c]);
}

// kvq_rope_apply (INV = false) and kvq_rope_bwd (INV = true: rotation by the negative angle, i.e. the
// same formula with -sin; negating an operand is exact, so both match their CPU references bit for bit).
template <bool INV>
__global__ void rope_k(float *x, int nh, int hd, int half, const float *cos_t, const float *sin_t)
{
    int t = blockIdx.x;
    const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;
    for (int idx = threadIdx.x; idx < nh * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float *v = x + ((size_t)t * nh + h) * hd;
        const float a = v[2 * i], b = v[2 * i + 1], sn = INV ? -s[i] : s[i];
        v[2 * i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, sn));
        v[2 * i + 1] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, c[i]));
    }
}

__global__ void add_bias_k(float *y, const float *b, int n, size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], b[i % n]);
}

__global__ void swiglu_k(float *out, const float *gate, const float *up, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    }
}

__global__ void lse_init_k(float *row_max, double *row_sum, float *row_tgt, int T)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        row_max[t] = -INFINITY;
        row_sum[t] = 0;
        row_tgt[t] = __int_as_float(0x7fc00000);
    }
}

__global__ void lse_block_k(const float *z, const int *tg, int v0, int nv, float *row_max, double *row_sum, float *row_tgt)
{
    __shared__ double shd[kThreads / 32];
    __shared__ float shf[kThreads / 32];
    int t = blockIdx.x;
    int target = tg[t];
    if (target < 0) return; // uniform over the block
    const float *zr = z + (size_t)t * nv;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < nv; i += kThreads) mx = fmaxf(mx, zr[i]);
    mx = block_extreme<true>(mx, shf);
    float old = row_max[t];
    mx = fmaxf(mx, old);
    double sum = 0;
    for (int i = threadIdx.x; i < nv; i += kThreads) sum += exp((double)zr[i] - (double)mx);
    sum = block_sum_d(sum, shd);
    if (threadIdx.x == 0) {
        row_sum[t] = row_sum[t] * exp((double)old - (double)mx) + sum;
        row_max[t] = mx;
        if (target >= v0 && target < v0 + nv) row_tgt[t] = zr[target - v0];
    }
}

// first index of the largest value over the block (ties: the smaller index); result in every thread
__device__ __forceinline__ void block_argmax(float &v, int &i, float *shv, int *shi)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        const int j = __shfl_xor_sync(0xffffffffu, i, o);
        if (u > v || (u == v && j >= 0 && (i < 0 || j < i))) {
            v = u;
            i = j;
        }
    }
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) {
        shv[w] = v;
        shi[w] = i;
    }
    __syncthreads();
    v = shv[0];
    i = shi[0];
    for (int k = 1; k < kThreads / 32; k++)
        if (shv[k] > v || (shv[k] == v && shi[k] >= 0 && (i < 0 || shi[k] < i))) {
            v = shv[k];
            i = shi[k];
        }
}

__global__ void lse_block_head_k(float *z, const int *tg, int v0, int nv, float *row_max, double *row_sum, float *row_tgt,
                                 int *row_arg, float *ex, int dim)
{
    __shared__ double shd[kThreads / 32];
    __shared__ float shf[kThreads / 32];
    __shared__ int shi[kThreads / 32];
    int t = blockIdx.x;
    int target = tg[t];
    float *zr = z + (size_t)t * nv;
    if (target < 0) { // uniform over the block
        if (ex)
            for (int i = threadIdx.x; i < nv; i += kThreads) zr[i] = 0.0f;
        return;
    }
    const bool has_tgt = target >= v0 && target < v0 + nv;
    const float tval = has_tgt && threadIdx.x == 0 ? zr[target - v0] : 0.0f; // read before z is overwritten
    float bmax = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < nv; i += kThreads)
        if (zr[i] > bmax) {
            bmax = zr[i];
            bi = i;
        }
    block_argmax(bmax, bi, shf, shi);
    const float old = row_max[t];
    const float mx = bmax > old ? bmax : old;
    double sum = 0;
    if (ex) {
        const float f = (float)exp((double)old - (double)mx);
        float *er = ex + (size_t)t * dim;
        for (int d = threadIdx.x; d < dim; d += kThreads) er[d] *= f;
        for (int i = threadIdx.x; i < nv; i += kThreads) {
            const double q = exp((double)zr[i] - (double)mx);
            sum += q;
            zr[i] = (float)q;
        }
    } else {
        for (int i = threadIdx.x; i < nv; i += kThreads) sum += exp((double)zr[i] - (double)mx);
    }
    sum = block_sum_d(sum, shd);
    if (threadIdx.x == 0) {
        if (row_arg && bi >= 0 && (bmax > old || row_arg[t] < 0)) row_arg[t] = v0 + bi;
        row_sum[t] = row_sum[t] * exp((double)old - (double)mx) + sum;
        row_max[t] = mx;
        if (has_tgt) row_tgt[t] = tval;
    }
}

// ---- attention -----------------------------------------------------------------
// Block: 128 threads = BQ queries x TPQ threads per query for one query head;
// thread `part` of a query owns channels e*TPQ + part (e < DPT), so the
// threads of a query read consecutive shared-memory words (no bank conflicts).
// Keys (prefix then window) stream through shared memory in tiles of BK;
// scores are taken CH at a time, then the running max / sum / accumulator
// are rescaled once per chunk (online softmax, Milakov & Gimelshein 2018).
template <int HD, int TPQ, int BK, bool ALT>
__global__ void __launch_bounds__(128) attn_k(kvq_cu_attn a, float scale)
{
    constexpr int DPT = HD / TPQ, BQ = 128 / TPQ, CH = 8;
    __shared__ __align__(16) float Ks[BK * HD];
    __shared__ __align__(16) float Vs[BK * HD];
    __shared__ __align__(16) float Kq[ALT ? BK * HD : 4];
    __shared__ __align__(16) float Vq[ALT ? BK * HD : 4];
    const int h = blockIdx.y, kvh = h / (a.n_heads / a.n_kv_heads);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ; // heaviest (latest) query tiles first
    const int tid = threadIdx.x, qi = tid / TPQ, part = tid % TPQ;
    const int i = q0 + qi;
    const bool valid = i < a.T;
    float qr[DPT], acc[DPT];
    const float *qp = a.q + ((size_t)(valid ? i : 0) * a.n_heads + h) * HD;
#pragma unroll
    for (int e = 0; e < DPT; e++) {
        qr[e] = valid ? __fmul_rn(qp[e * TPQ + part], scale) : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    int kb = 0, vb = 0;
    if (ALT && valid) {
        kb = a.kb ? a.kb[i] : 0;
        vb = a.vb ? a.vb[i] : 0;
    }
    const int q_last = min(a.T, q0 + BQ) - 1;
    const int n_keys = a.P + q_last + 1, my_last = a.P + i;
    // sliding window: keys before the block's first query's window are masked for the whole block
    const int k_first = win_first_key(a, q0) / BK * BK;
    for (int k0 = k_first; k0 < n_keys; k0 += BK) {
        load_kv_tile<HD, BK, ALT, true>(a, kvh, k0, n_keys, tid, Ks, Vs, Kq, Vq);
        __syncthreads();
        const int kend = min(BK, n_keys - k0);
        for (int c0 = 0; c0 < kend; c0 += CH) {
            float s[CH];
            float mc = -INFINITY;
#pragma unroll
            for (int c = 0; c < CH; c++) {
                const int r = c0 + c, jj = k0 + r;
                const float *kr = Ks + r * HD;
                if (ALT && jj >= a.P && jj - a.P < kb) kr = Kq + r * HD;
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < DPT; e++) d = fmaf(qr[e], kr[e * TPQ + part], d);
                d = group_sum<TPQ>(d);
                const bool vis = valid && r < kend && jj <= my_last && win_vis(a, i, jj);
                s[c] = vis ? d : -INFINITY;
                mc = fmaxf(mc, s[c]);
            }
            if (mc == -INFINITY) continue; // nothing visible in this chunk (no shuffles below)
            const float mn = fmaxf(m, mc);
            const float corr = expf(m - mn); // exp(-inf) = 0 on the first chunk
            l *= corr;
#pragma unroll
            for (int e = 0; e < DPT; e++) acc[e] *= corr;
#pragma unroll
            for (int c = 0; c < CH; c++) {
                if (s[c] == -INFINITY) continue;
                const int r = c0 + c, jj = k0 + r;
                const float p = expf(s[c] - mn);
                l += p;
                const float *vr = Vs + r * HD;
                if (ALT && jj >= a.P && jj - a.P < vb) vr = Vq + r * HD;
#pragma unroll
                for (int e = 0; e < DPT; e++) acc[e] = fmaf(p, vr[e * TPQ + part], acc[e]);
            }
            m = mn;
        }
        __syncthreads();
    }
    if (valid) {
        float *o = a.out + ((size_t)i * a.n_heads + h) * HD;
        const float inv = 1.0f / l;
#pragma unroll
        for (int e = 0; e < DPT; e++) o[e * TPQ + part] = acc[e] * inv;
        if (a.lse && part == 0) a.lse[(size_t)h * a.T + i] = m + logf(l);
    }
}

template <int HD, int TPQ, int BK>
cudaError_t attn_launch(const kvq_cu_attn *a, cudaStream_t st)
{
    constexpr int BQ = 128 / TPQ;
    dim3 grid((unsigned)((a->T + BQ - 1) / BQ), (unsigned)a->n_heads);
    float scale = 1.0f / sqrtf((float)a->head_dim);
    if (a->kq || a->vq) attn_k<HD, TPQ, BK, true><<<grid, 128, 0, st>>>(*a, scale);
    else attn_k<HD, TPQ, BK, false><<<grid, 128, 0, st>>>(*a, scale);
    return cudaGetLastError();
}

// ---- quantizers ------------------------------------------------------------------

__device__ inline float uq(float x, double mn, double s, double qmax)
{
    if (s == 0) return (float)mn;
    double q = rint(__ddiv_rn(__dsub_rn((double)x, mn), s));
    if (q < 0) q = 0;
    if (q > qmax) q = qmax;
    return (float)__dadd_rn(__dmul_rn(q, s), mn);
}

__device__ inline size_t nuq_nearest(const float *lv, size_t n, float x)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (lv[mid] <= x) lo = mid + 1;
        else hi = mid;
    }
    size_t best;
    if (lo == 0) best = 0;
    else if (lo == n) best = n - 1;
    else best = fabsf(__fsub_rn(lv[lo], x)) < fabsf(__fsub_rn(x, lv[lo - 1])) ? lo : lo - 1;
    float bd = fabsf(__fsub_rn(x, lv[best]));
    while (best > 0 && fabsf(__fsub_rn(x, lv[best - 1])) <= bd) {
        best--;
        bd = fabsf(__fsub_rn(x, lv[best]));
    }
    return best;
}

__device__ inline float nuq_one(float x, double zp, double r, const float *lv, size_t nl)
{
    if (r == 0) return (float)zp;
    double xn = __ddiv_rn(__dsub_rn((double)x, zp), r);
    if (!(xn >= (double)lv[0])) xn = lv[0];
    if (xn > (double)lv[nl - 1]) xn = lv[nl - 1];
    size_t i = nuq_nearest(lv, nl, (float)xn);
    return (float)__dadd_rn(__dmul_rn((double)lv[i], r), zp);
}

// saturated values (|x| >= 65520, quant.h KVQ_FP16_OVERFLOW) counted in *clipped when given
__global__ void q_fp16_k(float *x, size_t n0, size_t n1, unsigned long long *clipped)
{
    unsigned long long c = 0;
    for (size_t i = n0 + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n1; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        c += fabsf(v) >= 65520.0f;
        x[i] = v > 65504.0f ? 65504.0f : v < -65504.0f ? -65504.0f : __half2float(__float2half_rn(v));
    }
    if (clipped && c) atomicAdd(clipped, c);
}

// One warp per (token, group).
__global__ void q_int_token_k(float *out, const float *in, size_t T, size_t kvd, size_t group, double qmax, size_t ns)
{
    size_t gpt = kvd / group;
    size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (w >= T * gpt) return; // whole warp
    size_t t = w / gpt, g0 = (w % gpt) * group;
    const float *x = in + t * kvd + g0;
    float *y = out + t * kvd + g0;
    if (t < ns) {
        for (size_t c = lane; c < group; c += 32) y[c] = x[c];
        return;
    }
    float mn = INFINITY, mx = -INFINITY;
    for (size_t c = lane; c < group; c += 32) {
        mn = fminf(mn, x[c]);
        mx = fmaxf(mx, x[c]);
    }
    mn = warp_extreme<false>(mn);
    mx = warp_extreme<true>(mx);
    double s = __ddiv_rn(__dsub_rn((double)mx, (double)mn), qmax);
    for (size_t c = lane; c < group; c += 32) y[c] = uq(x[c], mn, s, qmax);
}

__global__ void q_int_channel_k(float *x, size_t T, size_t kvd, const float *lo, const float *up, double qmax,
                                int outliers, size_t ns, unsigned long long *cnt)
{
    unsigned long long n_out = 0;
    for (size_t i = ns * kvd + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < T * kvd;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t c = i % kvd;
        float v = x[i];
        if (outliers && (v > up[c] || v < lo[c])) {
            n_out++;
            continue;
        }
        double s = __ddiv_rn(__dsub_rn((double)up[c], (double)lo[c]), qmax);
        x[i] = uq(v, lo[c], s, qmax);
    }
    if (n_out) atomicAdd(cnt, n_out);
}

__global__ void q_nuq_keys_k(float *x, size_t T, size_t kvd, const float *levels, size_t nl, size_t n_tables,
                             size_t head_dim, const float *lo, const float *up, int outliers, size_t ns,
                             unsigned long long *cnt)
{
    unsigned long long n_out = 0;
    for (size_t i = ns * kvd + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < T * kvd;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t c = i % kvd;
        float v = x[i];
        if (outliers && (v > up[c] || v < lo[c])) {
            n_out++;
            continue;
        }
        double zp = __dmul_rn(__dadd_rn((double)up[c], (double)lo[c]), 0.5);
        double r = __dmul_rn(__dsub_rn((double)up[c], (double)lo[c]), 0.5);
        const float *lv = n_tables > 1 ? levels + (c / head_dim) * nl : levels;
        x[i] = nuq_one(v, zp, r, lv, nl);
    }
    if (n_out) atomicAdd(cnt, n_out);
}

// One block (kThreads) per token >= ns; row in dynamic shared memory.
__global__ void q_nuq_values_k(float *x, size_t kvd, const float *levels, size_t nl, size_t n_tables, size_t head_dim,
                               size_t k, size_t ns, unsigned long long *cnt)
{
    extern __shared__ float row[];
    __shared__ float sh[kThreads / 32];
    __shared__ float s_lo, s_hi;
    size_t t = ns + blockIdx.x;
    float *xr = x + t * kvd;
    for (size_t c = threadIdx.x; c < kvd; c += kThreads) row[c] = xr[c];
    __syncthreads();
    float lo, hi;
    if (k == 0) {
        float mn = INFINITY, mx = -INFINITY;
        for (size_t c = threadIdx.x; c < kvd; c += kThreads) {
            mn = fminf(mn, row[c]);
            mx = fmaxf(mx, row[c]);
        }
        lo = block_extreme<false>(mn, sh);
        hi = block_extreme<true>(mx, sh);
    } else {
        // order statistics by rank: value of rank r is row[i] with less(i) <= r < less(i) + eq(i)
        size_t r_lo = k, r_hi = kvd - 1 - k;
        for (size_t i = threadIdx.x; i < kvd; i += kThreads) {
            float v = row[i];
            size_t less = 0, eq = 0;
            for (size_t j = 0; j < kvd; j++) {
                less += row[j] < v;
                eq += row[j] == v;
            }
            if (less <= r_lo && r_lo < less + eq) s_lo = v;
            if (less <= r_hi && r_hi < less + eq) s_hi = v;
        }
        __syncthreads();
        lo = s_lo;
        hi = s_hi;
    }
    double zp = __dmul_rn(__dadd_rn((double)hi, (double)lo), 0.5), r = __dmul_rn(__dsub_rn((double)hi, (double)lo), 0.5);
    unsigned long long n_out = 0;
    for (size_t c = threadIdx.x; c < kvd; c += kThreads) {
        float v = row[c];
        if (k && (v < lo || v > hi)) {
            n_out++;
            continue;
        }
        const float *lv = n_tables > 1 ? levels + (c / head_dim) * nl : levels;
        xr[c] = nuq_one(v, zp, r, lv, nl);
    }
    if (n_out) atomicAdd(cnt, n_out);
}

// One thread per (group, channel) of the complete groups after ns.
__global__ void q_kivi_keys_k(float *out, const float *in, size_t kvd, size_t group, size_t n_groups, double qmax,
                              size_t ns)
{
    size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= n_groups * kvd) return;
    size_t g = idx / kvd, c = idx % kvd;
    const float *x0 = in + (ns + g * group) * kvd + c;
    float *y0 = out + (ns + g * group) * kvd + c;
    float mn = x0[0], mx = x0[0];
    for (size_t t = 1; t < group; t++) {
        float v = x0[t * kvd];
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    double s = __ddiv_rn(__dsub_rn((double)mx, (double)mn), qmax);
    for (size_t t = 0; t < group; t++) y0[t * kvd] = uq(x0[t * kvd], mn, s, qmax);
}

__global__ void fill_random_k(float *x, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 16;
        h *= 0x7feb352du;
        h ^= h >> 15;
        h *= 0x846ca68bu;
        h ^= h >> 16;
        x[i] = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
}

} // namespace

cudaError_t kvq_cu_embed_bf16(float *x, const unsigned short *E, const int *tok, int T, int dim, cudaStream_t st)
{
    embed_bf16_k<<<T, 128, 0, st>>>(x, E, tok, dim);
    return cudaGetLastError();
}

cudaError_t kvq_cu_to_bf16(unsigned short *dst, const float *src, size_t n, cudaStream_t st)
{
    if (!n) return cudaSuccess;
    to_bf16_k<<<grid_for(n, kThreads * 4), kThreads, 0, st>>>(dst, src, n);
    return cudaGetLastError();
}

cudaError_t kvq_cu_embed(float *x, const float *E, const int *tok, int T, int dim, cudaStream_t st)
{
    embed_k<<<T, 128, 0, st>>>(x, E, tok, dim);
    return cudaGetLastError();
}

cudaError_t kvq_cu_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps, cudaStream_t st)
{
    rmsnorm_k<<<T, kThreads, 0, st>>>(out, x, g, dim, eps);
    return cudaGetLastError();
}

cudaError_t kvq_cu_rope(float *x, int T, int nh, int hd, int rope_dim, const float *cos_t, const float *sin_t,
                        cudaStream_t st)
{
    if (rope_dim < 2) return cudaSuccess;
    rope_k<false><<<T, 128, 0, st>>>(x, nh, hd, rope_dim / 2, cos_t, sin_t);
    return cudaGetLastError();
}

cudaError_t kvq_cu_rope_inv(float *x, int T, int nh, int hd, int rope_dim, const float *cos_t, const float *sin_t,
                            cudaStream_t st)
{
    if (rope_dim < 2) return cudaSuccess;
    rope_k<true><<<T, 128, 0, st>>>(x, nh, hd, rope_dim / 2, cos_t, sin_t);
    return cudaGetLastError();
}

cudaError_t kvq_cu_add_bias(float *y, const float *b, int T, int n, cudaStream_t st)
{
    const size_t total = (size_t)T * n;
    if (total) add_bias_k<<<grid_for(total, kThreads * 4), kThreads, 0, st>>>(y, b, n, total);
    return cudaGetLastError();
}

cudaError_t kvq_cu_swiglu(float *out, const float *gate, const float *up, size_t n, cudaStream_t st)
{
    swiglu_k<<<grid_for(n, kThreads * 4), kThreads, 0, st>>>(out, gate, up, n);
    return cudaGetLastError();
}

cudaError_t kvq_cu_lse_init(float *row_max, double *row_sum, float *row_tgt, int T, cudaStream_t st)
{
    lse_init_k<<<(T + 255) / 256, 256, 0, st>>>(row_max, row_sum, row_tgt, T);
    return cudaGetLastError();
}

cudaError_t kvq_cu_lse_block(const float *z, const int *tg, int v0, int nv, int T, float *row_max, double *row_sum,
                             float *row_tgt, cudaStream_t st)
{
    lse_block_k<<<T, kThreads, 0, st>>>(z, tg, v0, nv, row_max, row_sum, row_tgt);
    return cudaGetLastError();
}

cudaError_t kvq_cu_lse_block_head(float *z, const int *tg, int v0, int nv, int T, float *row_max, double *row_sum,
                                  float *row_tgt, int *row_arg, float *ex, int dim, cudaStream_t st)
{
    lse_block_head_k<<<T, kThreads, 0, st>>>(z, tg, v0, nv, row_max, row_sum, row_tgt, row_arg, ex, dim);
    return cudaGetLastError();
}

int kvq_cu_attn_supported(int hd) { return hd == 8 || hd == 16 || hd == 32 || hd == 64 || hd == 128 ? 0 : -1; }

cudaError_t kvq_cu_attention(const kvq_cu_attn *a, cudaStream_t st)
{
    if (a->bf16_tc && kvq_cu_attn_tc_supported(a)) return kvq_cu_attention_tc(a, st);
    switch (a->head_dim) {
    case 8: return attn_launch<8, 1, 32>(a, st);
    case 16: return attn_launch<16, 1, 32>(a, st);
    case 32: return attn_launch<32, 2, 32>(a, st);
    case 64: return attn_launch<64, 4, 32>(a, st);
    case 128: return attn_launch<128, 8, 16>(a, st);
    default: return cudaErrorInvalidValue;
    }
}

cudaError_t kvq_cu_q_fp16(float *x, size_t T, size_t n, size_t ns, unsigned long long *clipped, cudaStream_t st)
{
    if (ns >= T) return cudaSuccess;
    size_t cnt = (T - ns) * n;
    q_fp16_k<<<grid_for(cnt, kThreads * 4), kThreads, 0, st>>>(x, ns * n, T * n, clipped);
    return cudaGetLastError();
}

cudaError_t kvq_cu_q_int_token(float *out, const float *in, size_t T, size_t kvd, size_t group, int bits, size_t ns,
                               cudaStream_t st)
{
    if (group == 0) group = kvd;
    size_t warps = T * (kvd / group);
    if (!warps) return cudaSuccess;
    q_int_token_k<<<grid_for(warps, 4), 128, 0, st>>>(out, in, T, kvd, group, (double)((1u << bits) - 1), ns);
    return cudaGetLastError();
}

cudaError_t kvq_cu_q_int_channel(float *x, size_t T, size_t kvd, const float *lo, const float *up, int bits,
                                 int outliers, size_t ns, unsigned long long *cnt, cudaStream_t st)
{
    if (ns >= T) return cudaSuccess;
    q_int_channel_k<<<grid_for((T - ns) * kvd, kThreads * 4), kThreads, 0, st>>>(x, T, kvd, lo, up,
                                                                                   (double)((1u << bits) - 1),
                                                                                   outliers, ns, cnt);
    return cudaGetLastError();
}

cudaError_t kvq_cu_q_nuq_keys(float *x, size_t T, size_t kvd, const float *levels, int bits, size_t n_tables,
                              size_t head_dim, const float *lo, const float *up, int outliers, size_t ns,
                              unsigned long long *cnt, cudaStream_t st)
{
    if (ns >= T) return cudaSuccess;
    q_nuq_keys_k<<<grid_for((T - ns) * kvd, kThreads * 4), kThreads, 0, st>>>(x, T, kvd, levels, (size_t)1 << bits,
                                                                                n_tables, head_dim, lo, up, outliers,
                                                                                ns, cnt);
    return cudaGetLastError();
}

cudaError_t kvq_cu_q_nuq_values(float *x, size_t T, size_t kvd, const float *levels, int bits, size_t n_tables,
                                size_t head_dim, size_t k, size_t ns, unsigned long long *cnt, cudaStream_t st)
{
    if (ns >= T) return cudaSuccess;
    size_t smem = kvd * sizeof(float);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;
    q_nuq_values_k<<<(unsigned)(T - ns), kThreads, smem, st>>>(x, kvd, levels, (size_t)1 << bits, n_tables, head_dim,
                                                                k, ns, cnt);
    return cudaGetLastError();
}

cudaError_t kvq_cu_q_kivi_keys(float *out, const float *in, size_t T, size_t kvd, size_t group, int bits, size_t ns,
                               cudaStream_t st)
{
    size_t nsc = ns < T ? ns : T;
    size_t n_groups = (T - nsc) / group, qend = nsc + n_groups * group;
    cudaError_t e;
    if (nsc && (e = cudaMemcpyAsync(out, in, nsc * kvd * sizeof(float), cudaMemcpyDeviceToDevice, st))) return e;
    if (qend < T &&
        (e = cudaMemcpyAsync(out + qend * kvd, in + qend * kvd, (T - qend) * kvd * sizeof(float), cudaMemcpyDeviceToDevice, st)))
        return e;
    if (n_groups) {
        q_kivi_keys_k<<<grid_for(n_groups * kvd, 128), 128, 0, st>>>(out, in, kvd, group, n_groups,
                                                                     (double)((1u << bits) - 1), nsc);
    }
    return cudaGetLastError();
}

cudaError_t kvq_cu_fill_random(float *x, size_t n, unsigned seed, cudaStream_t st)
{
    fill_random_k<<<grid_for(n, kThreads * 8), kThreads, 0, st>>>(x, n, seed);
    return cudaGetLastError();
}
