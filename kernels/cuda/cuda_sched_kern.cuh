// cuda_sched_kern.cuh — the device code of cuda_sched.cuh (the policy and output kernels), in a header of its
// own so that tests/gpu/emu/emu_sched.cc runs the same code on the host through cuda_emu.h (make test's CPU check
// of the kernels' logic). Included by cuda_sched.cu only (and the emulator); see cuda_sched.cuh for the semantics.
#ifndef KVQ_CUDA_SCHED_KERN_CUH
#define KVQ_CUDA_SCHED_KERN_CUH

#include <limits.h>
#include <math.h>

#include "cuda_sched.cuh"

#ifndef KVQ_EMU
#define KVQ_DYN_SMEM(T, name) extern __shared__ __align__(16) T name[]
#define KVQ_STATIC_SMEM(T, name, n, al) __shared__ __align__(al) T name[n]
#endif

namespace kvq_sched {


constexpr int SCH_MAXG = 8;

// importance.c kvq_imp_is_probe, bit for bit (a fixed hash of i against frac)
__device__ __forceinline__ bool sch_is_probe(int i, double frac)
{
    if (frac <= 0) return true;
    uint32_t x = (uint32_t)i * 0x9E3779B9u + 0x7F4A7C15u;
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return (double)x < frac * 4294967296.0;
}

// representation of window key j at step i (flo <= i implies fhi <= i; forward.h kvq_sched_rep)
__device__ __forceinline__ int sch_rep(const int *fhi, const int *flo, int j, int i)
{
    return flo[j] <= i ? 2 : fhi[j] <= i ? 1 : 0;
}

// G scores of one key row kr against qs[G][hd] (already scaled): products and sums in d order, no FMA. The row is
// read 32 floats at a time, all eight loads issued before the arithmetic (one memory latency per 32 channels instead
// of one per 4: the loop is latency-bound, a thread has nothing else to overlap with)
template <int G>
__device__ __forceinline__ void sch_dot(float *acc, const float *qs, const float *__restrict__ kr, int hd)
{
#pragma unroll
    for (int q = 0; q < G; q++) acc[q] = 0.f;
    for (int d0 = 0; d0 < hd; d0 += 32) {
        float4 kb[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (d0 + 4 * u < hd) kb[u] = __ldg(reinterpret_cast<const float4 *>(kr + d0 + 4 * u));
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (d0 + 4 * u < hd) {
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const float *x = qs + q * hd + d0 + 4 * u;
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(x[0], kb[u].x));
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(x[1], kb[u].y));
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(x[2], kb[u].z));
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(x[3], kb[u].w));
                }
            }
    }
}

__device__ __forceinline__ const float *sch_key(const kvq_cu_sched_args &a, const int *fhi, const int *flo, int j, int i,
                                                int h, bool value)
{
    const size_t stride = (size_t)a.n_kv_heads * a.head_dim;
    if (j < a.P) return (value ? a.pv : a.pk) + (size_t)j * stride + (size_t)h * a.head_dim;
    const int w = j - a.P, r = sch_rep(fhi, flo, w, i);
    return (value ? a.v[r] : a.k[r]) + (size_t)w * stride + (size_t)h * a.head_dim;
}

template <class A> __device__ __forceinline__ void sch_load_q(const A &a, float *qs, int G, int h, int i)
{
    const int hd = a.head_dim;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int x = threadIdx.x; x < G * hd; x += blockDim.x)
        qs[x] = __fmul_rn(a.q[((size_t)i * a.n_heads + (size_t)h * G) * hd + x], scale);
}

inline size_t sch_policy_smem(int T, int P, int G, int hd)
{
    return (size_t)T * sizeof(double) + ((size_t)G * (P + T) + (size_t)G * hd) * sizeof(float) + (4 * (size_t)T + 1) * sizeof(int);
}

// importance of token t after query i's votes (importance.c importance())
__device__ __forceinline__ double sch_importance(const double *score, const int *votes, bool normalise, int t, int i)
{
    if (!normalise) return score[t];
    const int n = votes[i + 1] - votes[t];
    return n > 0 ? score[t] / (double)n : 0.0;
}

__device__ __forceinline__ bool sch_less(double v, int t, double mv, int mt) { return v < mv || (v == mv && t < mt); }

// the softmax statistics of query row i of KV head h's group (G query heads), all the block's threads: lm[q] holds
// the thread's largest score of head q on entry; s[q·ld + j], j < n, the scores, become exp(score − max); mxs[q] and
// sums[q] (shared) receive the row's max and sum, also kept in row_m / row_s [n_heads][T] at (h·G + q, i); red:
// G·32 floats of shared scratch. The policy kernels of both declarative schedule forms share it (the same ops in
// the same order as the CPU's kvq_attention_sched: see cuda_sched.cuh)
template <int G>
__device__ __forceinline__ void sch_row_softmax(float *s, size_t ld, int n, float (&lm)[G], float *red, float *mxs, float *sums,
                                                float *row_m, float *row_s, int h, int T, int i)
{
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
#pragma unroll
    for (int q = 0; q < G; q++) {
        for (int o = 16; o > 0; o >>= 1) lm[q] = fmaxf(lm[q], __shfl_xor_sync(0xffffffffu, lm[q], o));
        if (lane == 0) red[q * 32 + warp] = lm[q];
    }
    __syncthreads();
    if (tid < G) {
        float m = red[tid * 32];
        for (int w = 1; w < nw; w++) m = fmaxf(m, red[tid * 32 + w]);
        mxs[tid] = m;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < G; q++) lm[q] = 0.f;
    for (int j = tid; j < n; j += nt)
#pragma unroll
        for (int q = 0; q < G; q++) {
            const float e = expf(s[(size_t)q * ld + j] - mxs[q]);
            s[(size_t)q * ld + j] = e;
            lm[q] += e;
        }
#pragma unroll
    for (int q = 0; q < G; q++) {
        for (int o = 16; o > 0; o >>= 1) lm[q] += __shfl_xor_sync(0xffffffffu, lm[q], o);
        if (lane == 0) red[q * 32 + warp] = lm[q];
    }
    __syncthreads();
    if (tid < G) {
        float m = 0;
        for (int w = 0; w < nw; w++) m += red[tid * 32 + w];
        sums[tid] = m;
        row_m[((size_t)h * G + tid) * T + i] = mxs[tid];
        row_s[((size_t)h * G + tid) * T + i] = m;
    }
    __syncthreads();
}

template <int G>
__global__ void __launch_bounds__(1024) sched_policy_k(kvq_cu_sched_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int h = blockIdx.x, T = a.T, P = a.P, hd = a.head_dim, ld = P + T;
    double *score = reinterpret_cast<double *>(smem);
    float *s = reinterpret_cast<float *>(score + T);
    float *qs = s + (size_t)G * ld;
    int *fhi = reinterpret_cast<int *>(qs + G * hd), *flo = fhi + T, *heavy = flo + T, *votes = heavy + T;
    KVQ_STATIC_SMEM(float, red, G * 32, 4);
    KVQ_STATIC_SMEM(float, mxs, G, 4);
    KVQ_STATIC_SMEM(float, sums, G, 4);
    KVQ_STATIC_SMEM(double, rv, 32, 8);
    KVQ_STATIC_SMEM(int, rt, 32, 4);
    KVQ_STATIC_SMEM(int, rslot, 32, 4);
    KVQ_STATIC_SMEM(int, n_heavy_s, 1, 4);
    KVQ_STATIC_SMEM(unsigned long long, cnt_s, 2, 8); // exact, high
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    for (int j = tid; j < T; j += nt) {
        score[j] = 0;
        fhi[j] = flo[j] = T;
    }
    if (tid == 0) {
        votes[0] = 0;
        for (int i = 0; i < T; i++) votes[i + 1] = votes[i] + (sch_is_probe(i, a.probe) ? 1 : 0);
        n_heavy_s[0] = 0;
        cnt_s[0] = cnt_s[1] = 0;
    }
    for (int i = 0; i < T; i++) {
        const int n = P + i + 1;
        sch_load_q(a, qs, G, h, i);
        __syncthreads();
        const int nhv = n_heavy_s[0]; // thread 0 changes it only after the syncs below
        // scores in the representation each key holds at step i, and the row maxima
        float lm[G], acc[G];
#pragma unroll
        for (int q = 0; q < G; q++) lm[q] = -INFINITY;
        for (int j = tid; j < n; j += nt) {
            if (a.S) { // precomputed (sched_score_k): the same bits
                const int r = j < P ? 0 : sch_rep(fhi, flo, j - P, i);
#pragma unroll
                for (int q = 0; q < G; q++) acc[q] = a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * ld + j];
            } else
                sch_dot<G>(acc, qs, sch_key(a, fhi, flo, j, i, h, false), hd);
#pragma unroll
            for (int q = 0; q < G; q++) {
                s[(size_t)q * ld + j] = acc[q];
                lm[q] = fmaxf(lm[q], acc[q]);
            }
        }
        sch_row_softmax<G>(s, ld, n, lm, red, mxs, sums, a.row_m, a.row_s, h, T, i);
        // query i's votes: s_j += sum over the group's heads of (float)(e * (1.0 / sum)), in double, head order
        if (votes[i + 1] > votes[i]) {
            double dinv[G];
#pragma unroll
            for (int q = 0; q < G; q++) dinv[q] = 1.0 / (double)sums[q];
            for (int j = tid; j <= i; j += nt) {
                double x = 0;
#pragma unroll
                for (int q = 0; q < G; q++) x += (double)(float)((double)s[(size_t)q * ld + P + j] * dinv[q]);
                score[j] += x;
            }
            __syncthreads();
        }
        // token e leaves the window
        const int e = i + 1 - a.window;
        if (e >= a.n_sink && e >= 0) {
            const int cap = (int)floor(a.budget * (double)(i + 2) + 1e-9);
            if (nhv < cap) {
                if (tid == 0) {
                    heavy[nhv] = e;
                    n_heavy_s[0] = nhv + 1;
                    fhi[e] = i + 1;
                }
            } else {
                double mv = INFINITY;
                int mt = INT_MAX, ms = -2;
                if (tid == 0) mv = sch_importance(score, votes, a.normalise, e, i), mt = e, ms = -1;
                for (int k = tid; k < nhv; k += nt) {
                    const int t = heavy[k];
                    const double v = sch_importance(score, votes, a.normalise, t, i);
                    if (sch_less(v, t, mv, mt)) mv = v, mt = t, ms = k;
                }
                for (int o = 16; o > 0; o >>= 1) {
                    const double v2 = __shfl_xor_sync(0xffffffffu, mv, o);
                    const int t2 = __shfl_xor_sync(0xffffffffu, mt, o), s2 = __shfl_xor_sync(0xffffffffu, ms, o);
                    if (sch_less(v2, t2, mv, mt)) mv = v2, mt = t2, ms = s2;
                }
                if (lane == 0) rv[warp] = mv, rt[warp] = mt, rslot[warp] = ms;
                __syncthreads();
                if (tid == 0) {
                    for (int w = 1; w < nw; w++)
                        if (sch_less(rv[w], rt[w], mv, mt)) mv = rv[w], mt = rt[w], ms = rslot[w];
                    if (ms < 0) fhi[e] = flo[e] = i + 1; // e itself: straight to the low precision
                    else {
                        flo[mt] = i + 1;
                        heavy[ms] = e;
                        fhi[e] = i + 1;
                    }
                }
            }
        }
        __syncthreads();
    }
    // the resting cache as the last query read it (the last step's decisions only set switch times T)
    for (int j = a.n_sink + tid; j < T; j += nt) {
        if (fhi[j] > T - 1 && flo[j] > T - 1) atomicAdd(&cnt_s[0], 1ull);
        else if (flo[j] > T - 1) atomicAdd(&cnt_s[1], 1ull);
    }
    for (int j = tid; j < T; j += nt) {
        a.from[(size_t)h * T + j] = fhi[j];
        a.from[((size_t)a.n_kv_heads + h) * T + j] = flo[j];
    }
    __syncthreads();
    if (tid == 0) {
        unsigned long long *c = a.counts + 4 * (size_t)h, d = (unsigned long long)hd;
        c[0] = (unsigned long long)T * d;
        c[1] = (unsigned long long)(a.n_sink < T ? a.n_sink : T) * d;
        c[2] = cnt_s[0] * d;
        c[3] = cnt_s[1] * d;
    }
}

template <int G>
__global__ void __launch_bounds__(128) sched_out_k(kvq_cu_sched_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int i = blockIdx.x, h = blockIdx.y, T = a.T, P = a.P, hd = a.head_dim, n = P + i + 1;
    float *qs = reinterpret_cast<float *>(smem), *p = qs + G * hd;
    unsigned char *rep = reinterpret_cast<unsigned char *>(p + (size_t)G * n);
    const int *fhi = a.from + (size_t)h * T, *flo = a.from + ((size_t)a.n_kv_heads + h) * T;
    sch_load_q(a, qs, G, h, i);
    for (int j = threadIdx.x; j <= i; j += blockDim.x) rep[j] = (unsigned char)sch_rep(fhi, flo, j, i);
    __syncthreads();
    float m[G], acc[G];
#pragma unroll
    for (int q = 0; q < G; q++) m[q] = a.row_m[((size_t)h * G + q) * T + i];
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        if (a.S) {
            const int r = j < P ? 0 : rep[j - P];
#pragma unroll
            for (int q = 0; q < G; q++) acc[q] = a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * (P + T) + j];
        } else
            sch_dot<G>(acc, qs, sch_key(a, fhi, flo, j, i, h, false), hd);
#pragma unroll
        for (int q = 0; q < G; q++) p[(size_t)q * n + j] = expf(acc[q] - m[q]);
    }
    __syncthreads();
    const size_t stride = (size_t)a.n_kv_heads * hd;
    for (int x = threadIdx.x; x < G * hd; x += blockDim.x) {
        const int q = x / hd, d = x % hd;
        const float *pq = p + (size_t)q * n;
        float o = 0.f;
        for (int j = 0; j < P; j++) o = __fadd_rn(o, __fmul_rn(pq[j], a.pv[(size_t)j * stride + (size_t)h * hd + d]));
        // values in key order, eight rows' loads issued before their products and sums (latency, as sch_dot)
        int j = 0;
        for (; j + 8 <= i + 1; j += 8) {
            float vb[8];
#pragma unroll
            for (int u = 0; u < 8; u++) vb[u] = __ldg(a.v[rep[j + u]] + (size_t)(j + u) * stride + (size_t)h * hd + d);
#pragma unroll
            for (int u = 0; u < 8; u++) o = __fadd_rn(o, __fmul_rn(pq[P + j + u], vb[u]));
        }
        for (; j <= i; j++) o = __fadd_rn(o, __fmul_rn(pq[P + j], a.v[rep[j]][(size_t)j * stride + (size_t)h * hd + d]));
        const float inv = __fdiv_rn(1.0f, a.row_s[((size_t)h * G + q) * T + i]);
        a.out[((size_t)i * a.n_heads + (size_t)h * G + q) * hd + d] = __fmul_rn(o, inv);
    }
}

// The scores of every representation ahead of the policy (a.S given): block (query row i, KV head h, representation
// r), keys 0..P+i, the group's heads; the same sch_dot as the kernels above, so the same bits. Prefix keys are
// written for r = 0 only (they have one representation).
template <int G>
__global__ void __launch_bounds__(128) sched_score_k(kvq_cu_sched_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int i = blockIdx.x, h = blockIdx.y, r = blockIdx.z, T = a.T, P = a.P, hd = a.head_dim, ld = P + T;
    float *qs = reinterpret_cast<float *>(smem);
    sch_load_q(a, qs, G, h, i);
    __syncthreads();
    const size_t stride = (size_t)a.n_kv_heads * hd;
    float acc[G];
    for (int j = (r ? P : 0) + threadIdx.x; j < P + i + 1; j += blockDim.x) {
        const float *kr = j < P ? a.pk + (size_t)j * stride + (size_t)h * hd : a.k[r] + (size_t)(j - P) * stride + (size_t)h * hd;
        sch_dot<G>(acc, qs, kr, hd);
#pragma unroll
        for (int q = 0; q < G; q++) a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * ld + j] = acc[q];
    }
}

// ---- the selection form (kvq_cu_ssel_args, forward.h kvq_sched_sel) ----------------------------------------------

inline size_t ssel_policy_smem(int T, int P, int G, int hd)
{
    return ((size_t)G * (P + T) + (size_t)G * hd) * sizeof(float) + 2 * (size_t)T;
}
inline size_t ssel_out_smem(int T, int P, int G, int hd)
{
    return ((size_t)G * hd + (size_t)G * (P + T)) * sizeof(float) + 2 * (size_t)T;
}

// kvq_sched_sel's width rule: 1 + (the smallest b in [lo, lo + n_lv - 1) with x <= ldexp(u, b), else the last) - lo
__device__ __forceinline__ int ssel_width(double x, double u, int lo, int n_lv)
{
    int b = lo;
    while (b < lo + n_lv - 1 && x > ldexp(u, b)) b++;
    return b - lo + 1;
}

template <int G>
__global__ void __launch_bounds__(1024) ssel_policy_k(kvq_cu_ssel_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int h = blockIdx.x, T = a.T, P = a.P, hd = a.head_dim, ld = P + T, nkv = a.n_kv_heads;
    const int N = a.window < T ? a.window : T;
    float *s = reinterpret_cast<float *>(smem);
    float *qs = s + (size_t)G * ld;
    signed char *selk = reinterpret_cast<signed char *>(qs + G * hd), *selv = selk + T;
    KVQ_STATIC_SMEM(float, red, G * 32, 4);
    KVQ_STATIC_SMEM(float, mxs, G, 4);
    KVQ_STATIC_SMEM(float, sums, G, 4);
    KVQ_STATIC_SMEM(unsigned long long, cnt_s, 6, 8); // per side: exact, outliers, code bits
    const int tid = threadIdx.x, nt = blockDim.x;
    const size_t stride = (size_t)nkv * hd;
    float *ring = a.ring + (size_t)h * N * T;
    for (int j = tid; j < T; j += nt) selk[j] = selv[j] = 0;
    if (tid < 6) cnt_s[tid] = 0;
    for (int i = 0; i < T; i++) {
        const int n = P + i + 1;
        sch_load_q(a, qs, G, h, i);
        __syncthreads();
        // the selections query i reads
        signed char *hk = a.hist + ((size_t)h * T + i) * T, *hv = a.hist + (((size_t)nkv + h) * T + i) * T;
        for (int j = tid; j <= i; j += nt) hk[j] = selk[j], hv[j] = selv[j];
        if (i == T - 1) // the resting cache as the last query reads it
            for (int j = a.n_sink + tid; j < T; j += nt)
                for (int w = 0; w < 2; w++) {
                    const int r = w ? selv[j] : selk[j];
                    if (r == 0) atomicAdd(&cnt_s[3 * w], 1ull);
                    else {
                        atomicAdd(&cnt_s[3 * w + 1], (unsigned long long)a.nout[((size_t)w * T + j) * nkv + h]);
                        atomicAdd(&cnt_s[3 * w + 2], (unsigned long long)(a.lo + r - 1));
                    }
                }
        float lm[G], acc[G];
#pragma unroll
        for (int q = 0; q < G; q++) lm[q] = -INFINITY;
        for (int j = tid; j < n; j += nt) {
            const int r = j < P ? 0 : selk[j - P];
            if (a.S) {
#pragma unroll
                for (int q = 0; q < G; q++) acc[q] = a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * ld + j];
            } else
                sch_dot<G>(acc, qs, j < P ? a.pk + (size_t)j * stride + (size_t)h * hd : a.k[r] + (size_t)(j - P) * stride + (size_t)h * hd,
                           hd);
#pragma unroll
            for (int q = 0; q < G; q++) {
                s[(size_t)q * ld + j] = acc[q];
                lm[q] = fmaxf(lm[q], acc[q]);
            }
        }
        sch_row_softmax<G>(s, ld, n, lm, red, mxs, sums, a.row_m, a.row_s, h, T, i);
        // a[i][j]: the group's largest probability (each (float)(e * (1.0 / sum)), as the step's probs)
        {
            double dinv[G];
#pragma unroll
            for (int q = 0; q < G; q++) dinv[q] = 1.0 / (double)sums[q];
            float *row = ring + (size_t)(i % N) * T;
            for (int j = tid; j <= i; j += nt) {
                float x = 0.f;
#pragma unroll
                for (int q = 0; q < G; q++) {
                    const float p = (float)((double)s[(size_t)q * ld + P + j] * dinv[q]);
                    if (p > x) x = p;
                }
                row[j] = x;
            }
        }
        __syncthreads();
        // the decisions, read from query i + 1 on
        for (int j = a.n_sink + tid; j <= i; j += nt) {
            if (i - j + 1 < N) {
                selk[j] = selv[j] = (signed char)a.young;
                continue;
            }
            float x = 0.f;
            for (int r = 0; r < N; r++) {
                const float y = ring[(size_t)r * T + j];
                if (y > x) x = y;
            }
            for (int w = 0; w < 2; w++) {
                const double rg = (double)a.range[((size_t)w * T + j) * nkv + h];
                const double lhs = a.attn[w] ? rg * (double)x * a.root[i] : rg;
                const int r = ssel_width(lhs, a.unit[((size_t)w * nkv + h) * T + i], a.lo, a.n_lv);
                if (w) selv[j] = (signed char)r;
                else selk[j] = (signed char)r;
            }
        }
        __syncthreads();
    }
    for (int j = tid; j < T; j += nt) {
        a.sel[(size_t)h * T + j] = selk[j];
        a.sel[((size_t)nkv + h) * T + j] = selv[j];
    }
    if (tid == 0) {
        const unsigned long long d = (unsigned long long)hd, ns = (unsigned long long)(a.n_sink < T ? a.n_sink : T);
        for (int w = 0; w < 2; w++) {
            unsigned long long *c = a.counts + ((size_t)w * nkv + h) * 5;
            c[0] = (unsigned long long)T * d;
            c[1] = ns * d;
            c[2] = cnt_s[3 * w] * d;
            c[3] = cnt_s[3 * w + 1];
            c[4] = cnt_s[3 * w + 2] * d;
        }
    }
}

template <int G>
__global__ void __launch_bounds__(128) ssel_out_k(kvq_cu_ssel_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int i = blockIdx.x, h = blockIdx.y, T = a.T, P = a.P, hd = a.head_dim, n = P + i + 1, nkv = a.n_kv_heads;
    float *qs = reinterpret_cast<float *>(smem), *p = qs + G * hd;
    signed char *rk = reinterpret_cast<signed char *>(p + (size_t)G * n), *rv = rk + T;
    const signed char *hk = a.hist + ((size_t)h * T + i) * T, *hv = a.hist + (((size_t)nkv + h) * T + i) * T;
    sch_load_q(a, qs, G, h, i);
    for (int j = threadIdx.x; j <= i; j += blockDim.x) rk[j] = hk[j], rv[j] = hv[j];
    __syncthreads();
    const size_t stride = (size_t)nkv * hd;
    float m[G], acc[G];
#pragma unroll
    for (int q = 0; q < G; q++) m[q] = a.row_m[((size_t)h * G + q) * T + i];
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int r = j < P ? 0 : rk[j - P];
        if (a.S) {
#pragma unroll
            for (int q = 0; q < G; q++) acc[q] = a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * (P + T) + j];
        } else
            sch_dot<G>(acc, qs, j < P ? a.pk + (size_t)j * stride + (size_t)h * hd : a.k[r] + (size_t)(j - P) * stride + (size_t)h * hd,
                       hd);
#pragma unroll
        for (int q = 0; q < G; q++) p[(size_t)q * n + j] = expf(acc[q] - m[q]);
    }
    __syncthreads();
    for (int x = threadIdx.x; x < G * hd; x += blockDim.x) {
        const int q = x / hd, d = x % hd;
        const float *pq = p + (size_t)q * n;
        float o = 0.f;
        for (int j = 0; j < P; j++) o = __fadd_rn(o, __fmul_rn(pq[j], a.pv[(size_t)j * stride + (size_t)h * hd + d]));
        int j = 0;
        for (; j + 8 <= i + 1; j += 8) {
            float vb[8];
#pragma unroll
            for (int u = 0; u < 8; u++) vb[u] = __ldg(a.v[rv[j + u]] + (size_t)(j + u) * stride + (size_t)h * hd + d);
#pragma unroll
            for (int u = 0; u < 8; u++) o = __fadd_rn(o, __fmul_rn(pq[P + j + u], vb[u]));
        }
        for (; j <= i; j++) o = __fadd_rn(o, __fmul_rn(pq[P + j], a.v[rv[j]][(size_t)j * stride + (size_t)h * hd + d]));
        const float inv = __fdiv_rn(1.0f, a.row_s[((size_t)h * G + q) * T + i]);
        a.out[((size_t)i * a.n_heads + (size_t)h * G + q) * hd + d] = __fmul_rn(o, inv);
    }
}

// every key representation's scores ahead of the policy (a.S given): block (query row i, KV head h, representation r)
template <int G>
__global__ void __launch_bounds__(128) ssel_score_k(kvq_cu_ssel_args a)
{
    KVQ_DYN_SMEM(unsigned char, smem);
    const int i = blockIdx.x, h = blockIdx.y, r = blockIdx.z, T = a.T, P = a.P, hd = a.head_dim, ld = P + T;
    float *qs = reinterpret_cast<float *>(smem);
    sch_load_q(a, qs, G, h, i);
    __syncthreads();
    const size_t stride = (size_t)a.n_kv_heads * hd;
    float acc[G];
    for (int j = (r ? P : 0) + threadIdx.x; j < P + i + 1; j += blockDim.x) {
        const float *kr = j < P ? a.pk + (size_t)j * stride + (size_t)h * hd : a.k[r] + (size_t)(j - P) * stride + (size_t)h * hd;
        sch_dot<G>(acc, qs, kr, hd);
#pragma unroll
        for (int q = 0; q < G; q++) a.S[(((size_t)r * a.n_heads + (size_t)h * G + q) * T + i) * ld + j] = acc[q];
    }
}

} // namespace kvq_sched

#endif
