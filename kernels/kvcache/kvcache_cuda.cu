// kvcache_cuda.cu — the packed KV cache on the GPU; see kvcache_cuda.h and formats/KVCACHE.md.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cublas_v2.h> // declarations only: cuBLAS is loaded with dlopen at run time

extern "C" {
#include "kvcache_cuda.h"
#include "quant.h"
}
#include "kvcache_cuda_dec.cuh"
#include "kvcache_cuda_kivi.cuh"
#include "kvcache_cuda_nuq.cuh"

#define CK(x)                                                                                               \
    do {                                                                                                    \
        cudaError_t e_ = (x);                                                                               \
        if (e_ != cudaSuccess)                                                                              \
            return kvq_fail(err, e_ == cudaErrorMemoryAllocation ? KVQ_ENOMEM : KVQ_EIO, "CUDA: %s (%s:%d): %s", \
                            #x, __FILE__, __LINE__, cudaGetErrorString(e_));                              \
    } while (0)
#define CKL() CK(cudaGetLastError())

static const int NT = 128;           // threads per decode block
static const size_t SMEM_MAX = 160 * 1024;

// the NUQ decode kernel for bk-bit keys, bv-bit values, gq query heads per block and version ver (4, 5: nuq_kernel,
// kvcache_cuda_nuq.cuh); nullptr where none
static DecFn pick(int bk, int bv, int gq, int ver)
{
    return bk == 2 ? nuq_kernel<2>(bv, gq, ver) : bk == 3 ? nuq_kernel<3>(bv, gq, ver) : nuq_kernel<4>(bv, gq, ver);
}

// query heads per block: the candidate (1, 2, 3, 4; v4's registers hold 8 scores per query head) that wastes the
// fewest masked query slots, ties to the larger
static int choose_gq(int g)
{
    const int gmax = 4;
    const int cand[5] = {8, 4, 3, 2, 1};
    int best = 1;
    long bw = -1;
    for (int i = 0; i < 5; i++) {
        if (cand[i] > gmax) continue;
        long w = (long)((g + cand[i] - 1) / cand[i]) * cand[i] - g;
        if (bw < 0 || w < bw) { bw = w; best = cand[i]; }
    }
    return best;
}

// ---- the device cache -----------------------------------------------------------------
struct kvq_kvcache_cuda {
    kvq_kvcache_config cfg;
    size_t C, n_exact, capq, kw, vw, ent_cap, kps, np, dpad, nhi;
    size_t *len, *kused, *vused; // host mirrors (kused / vused: entries per (sequence, head) at the last synchronisation)
    size_t *since;              // NUQ: rows kvq_kvcache_cuda_append_step quantized into each sequence after it (host)
    bool stale;                 // some since[s] > 0: kused / vused are bounds, not counts
    uint32_t *dused;            // NUQ: [2][B][H] gather_used's output (device)
    int *dlen;
    uint16_t *k16, *v16;
    uint32_t *kcodes, *vcodes, *krow, *vrow, *kent, *vent;
    float *vscale, *klut, *vlevels, *klevels, *klo, *khi;
    uint8_t *kz, *vz;
    float2 *rlo, *rhi;
    double *inv_freq;
    float *part;
    size_t part_cap;
    int *cnt;
    float *range;
    size_t cnt_cap;
    int n_sm;
    // KIVI
    float *kscale;              // [B][ngk][C][2] (min, scale) per key group and channel
    uint16_t *kring, *vring;    // [B][ring][C] fp16 residual
    uint16_t *stg;              // append staging: new keys then values [2][stg_cap][C] fp16
    size_t ring, ngk, stg_cap;
    size_t *kq, *vq;            // host: quantized key / value positions per sequence
    bool *prefix_set;           // host: IntactKV prefix set, per sequence
    int *dkq, *dvq, *dqf;       // device copies, and kivi_fast's range per sequence: dlen[B], then these, one allocation
    int *tick;                  // [B][n_heads] kivi_generic's finished splits per query head (zero between decodes)
    size_t tick_cap;
    cudaStream_t side;          // KIVI: kivi_generic's stream (non-blocking, highest priority) beside kivi_fast
    cudaEvent_t ev_fork, ev_join; // KIVI: side waits for ev_fork (legacy stream), the legacy stream for ev_join (side)
};

template <class T> static kvq_status dalloc(T **p, size_t n, const char *what, kvq_err *err)
{
    size_t b;
    if (kvq_mul_size(n ? n : 1, sizeof(T), &b)) return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: %s: size overflows", what);
    cudaError_t e = cudaMalloc((void **)p, b);
    if (e != cudaSuccess) {
        *p = nullptr;
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: %s: cannot allocate %zu bytes: %s", what, b, cudaGetErrorString(e));
    }
    CK(cudaMemset(*p, 0, b));
    return KVQ_OK;
}

extern "C" void kvq_kvcache_cuda_free(kvq_kvcache_cuda *c)
{
    if (!c) return;
    void *d[] = {c->dlen, c->k16, c->v16, c->kcodes, c->vcodes, c->krow, c->vrow, c->kent, c->vent, c->vscale, c->klut,
                 c->vlevels, c->klevels, c->klo, c->khi, c->kz, c->vz, c->rlo, c->rhi, c->inv_freq, c->part, c->cnt, c->range,
                 c->kscale, c->kring, c->vring, c->stg, c->tick, c->dused};
    for (void *x : d)
        if (x) cudaFree(x);
    if (c->ev_fork) cudaEventDestroy(c->ev_fork);
    if (c->ev_join) cudaEventDestroy(c->ev_join);
    if (c->side) cudaStreamDestroy(c->side);
    free(c->kq);
    free(c->vq);
    free(c->prefix_set);
    free(c->len);
    free(c->kused);
    free(c->vused);
    free(c->since);
    free(c);
}

static __global__ void append_count(const float *k, const float *v, const float *klo, const float *khi, int H, int D, int kps,
                             int outl, int P2, float *range, int *cnt);
static __global__ void kivi_key_flush(uint32_t *kcodes, float2 *kscale, const uint16_t *ring, const uint16_t *stg, int H, int D, int G,
                               int bits, int capq, int kw, int ring_n, int n_exact, int q0, int p0);
static kvq_status set_step_smem(kvq_err *err); // append_step's shared memory (after kvcache_cuda_app.cuh)
static kvq_status set_smem_limits(kvq_err *err)
{
    const int bits[3] = {2, 3, 4}, gqs[5] = {1, 2, 3, 4, 8};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int g = 0; g < 5; g++)
                for (int ver = 4; ver <= 5; ver++) {
                    DecFn f = pick(bits[a], bits[b], gqs[g], ver);
                    if (f) CK(cudaFuncSetAttribute((const void *)f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
                }
    CK(cudaFuncSetAttribute((const void *)append_count, cudaFuncAttributeMaxDynamicSharedMemorySize, 16384 * 4));
    CK(cudaFuncSetAttribute((const void *)kivi_key_flush, cudaFuncAttributeMaxDynamicSharedMemorySize, 256 * 256));
    CK(cudaFuncSetAttribute((const void *)exact_decode, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
    CK(cudaFuncSetAttribute((const void *)kv::kivi_generic, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
    CK(cudaFuncSetAttribute((const void *)kv::kivi_tail, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++)
            for (int g = 1; g <= 4; g++)
                for (int lg = 0; lg < 4; lg++)
                    for (int nw = 0; nw < 3; nw++)
                        CK(cudaFuncSetAttribute((const void *)kv::fast_pick(2 + 2 * a, 2 + 2 * b, g, lg, nw),
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_create(kvq_kvcache_cuda **out, const kvq_kvcache_config *cfg, kvq_err *err)
{
    if (!out) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda create: NULL output");
    *out = nullptr;
    KVQ_TRY(kvq_kvcache_config_validate(cfg, err));
    const size_t B = cfg->n_seqs, H = cfg->n_kv_heads, D = cfg->head_dim, C = H * D;
    if (H > 512) return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda: n_kv_heads %zu: up to 512", H);
    if (C > 16384) return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda: kv_dim %zu: the append kernel handles up to 16384", C);
    if (cfg->max_tokens > (size_t)1 << 30) return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda: max_tokens %zu: up to 2^30", cfg->max_tokens);
    {
        // the exact-region kernel keeps a query and the region's scores in shared memory
        const size_t ne = cfg->n_sink > cfg->prefix_len ? cfg->n_sink : cfg->prefix_len, lim = SMEM_MAX / 4 - D - 1;
        if (ne > lim)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda: n_sink / prefix_len %zu: the GPU's exact region holds up to %zu positions at head_dim %zu",
                            ne, lim, D);
    }
    kvq_kvcache_cuda *c = (kvq_kvcache_cuda *)calloc(1, sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: cannot allocate");
    kvq_status st = KVQ_OK;
    c->cfg = *cfg;
    c->C = C;
    c->n_exact = cfg->n_sink > cfg->prefix_len ? cfg->n_sink : cfg->prefix_len;
    c->capq = (cfg->max_tokens - c->n_exact + 31) / 32 * 32;
    c->kw = kvq_kvcache_head_words(cfg->k_bits, D);
    c->vw = kvq_kvcache_head_words(cfg->v_bits, D);
    c->kps = kvq_outliers_per_side(C, cfg->outlier_frac);
    c->dpad = (D + 1) / 2 * 2;
    c->np = c->dpad / 2;
    c->nhi = cfg->max_tokens / 64 + 4; // v4 also reads rows 0..3 (e^{i 8m θ}, m < 32)
    const bool nuq = cfg->format == KVQ_KVCACHE_NUQ;
    if (!nuq) { // KIVI: as kvcache.c
        const size_t F = cfg->residual ? cfg->residual : cfg->group;
        c->ring = (F > cfg->residual ? F : cfg->residual) + 2;
        c->ngk = c->capq / cfg->group + 1;
    }
    size_t nlk = (size_t)1 << cfg->k_bits, nlv = (size_t)1 << cfg->v_bits;
    size_t ne = c->n_exact ? c->n_exact : 1;
    c->len = (size_t *)calloc(B, sizeof(size_t));
    c->kused = (size_t *)calloc(B * H, sizeof(size_t));
    c->vused = (size_t *)calloc(B * H, sizeof(size_t));
    c->since = (size_t *)calloc(B, sizeof(size_t));
    c->kq = (size_t *)calloc(B, sizeof(size_t));
    c->vq = (size_t *)calloc(B, sizeof(size_t));
    c->prefix_set = (bool *)calloc(B, sizeof(bool));
    float *hl = nullptr, *hv = nullptr, *hk = nullptr;
    float2 *hlo = nullptr, *hhi = nullptr;
    uint8_t *hz = nullptr;
    if (!c->len || !c->kused || !c->vused || !c->since || !c->kq || !c->vq || !c->prefix_set) { st = kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: cannot allocate"); goto fail; }
    {
        int dev = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess) { st = kvq_fail(err, KVQ_EIO, "kvcache cuda: no usable device: %s", cudaGetErrorString(e)); goto fail; }
    }
    {
        size_t per_tok = 2 * (size_t)ceil(cfg->outlier_frac * (double)D) + 2, cap = cfg->outlier_cap;
        if (!cap && kvq_mul_size(per_tok, cfg->max_tokens, &cap)) cap = (size_t)1 << 30;
        if ((cfg->outlier_frac == 0 && !cfg->outlier_cap) || !nuq) cap = 1;
        if (cfg->outlier_max && cap > cfg->outlier_max) cap = cfg->outlier_max;
        if (cap > 0xffffffffu) cap = 0xffffffffu;
        c->ent_cap = cap ? cap : 1;
    }
#define DA(ptr, n, what) do { if ((st = dalloc(&(ptr), (n), (what), err)) != KVQ_OK) goto fail; } while (0)
    DA(c->dlen, 4 * B, "lengths");
    c->dkq = c->dlen + B;
    c->dvq = c->dlen + 2 * B;
    c->dqf = c->dlen + 3 * B;
    DA(c->k16, B * H * ne * D, "fp16 keys");
    DA(c->v16, B * H * ne * D, "fp16 values");
    DA(c->kcodes, B * H * c->kw * c->capq, "key codes");
    DA(c->vcodes, B * H * c->capq * c->vw, "value codes");
    if (nuq) {
        DA(c->krow, B * H * (c->capq + 1), "key outlier rows");
        DA(c->vrow, B * H * (c->capq + 1), "value outlier rows");
        DA(c->kent, B * H * c->ent_cap, "key outliers");
        DA(c->vent, B * H * c->ent_cap, "value outliers");
        DA(c->vscale, B * c->capq * 2, "value scales");
        DA(c->klut, C * nlk, "key LUT");
        DA(c->vlevels, H * nlv, "value levels");
        DA(c->klevels, H * nlk, "key levels");
        DA(c->klo, C, "thresholds");
        DA(c->khi, C, "thresholds");
        DA(c->kz, H, "zero codes");
        DA(c->vz, H, "zero codes");
        DA(c->dused, 2 * B * H, "outlier counts");
    } else {
        DA(c->vscale, B * c->capq * (C / cfg->group) * 2, "value scales");
        DA(c->kscale, B * c->ngk * C * 2, "key scales");
        DA(c->kring, B * c->ring * C, "key residual");
        DA(c->vring, B * c->ring * C, "value residual");
    }
    DA(c->rlo, c->np * 64, "rope table");
    DA(c->rhi, c->nhi * c->np, "rope table");
    DA(c->inv_freq, c->np, "rope");
#undef DA
    // tables (host, double), as kvcache.c
    hl = (float *)malloc(C * nlk * sizeof(float));
    hv = (float *)malloc(H * nlv * sizeof(float));
    hk = (float *)malloc(H * nlk * sizeof(float));
    hz = (uint8_t *)malloc(2 * H);
    hlo = (float2 *)malloc(c->np * 64 * sizeof(float2));
    hhi = (float2 *)malloc(c->nhi * c->np * sizeof(float2));
    if (!hl || !hv || !hk || !hz || !hlo || !hhi) { st = kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: cannot allocate tables"); goto fail; }
    for (size_t h = 0; nuq && h < H; h++) {
        const float *kl = cfg->k_levels + (cfg->k_tables > 1 ? h : 0) * nlk, *vl = cfg->v_levels + (cfg->v_tables > 1 ? h : 0) * nlv;
        memcpy(hk + h * nlk, kl, nlk * sizeof(float));
        memcpy(hv + h * nlv, vl, nlv * sizeof(float));
        hz[h] = (uint8_t)kvq_nuq_nearest(kl, nlk, 0.0f);
        hz[H + h] = (uint8_t)kvq_nuq_nearest(vl, nlv, 0.0f);
        for (size_t d = 0; d < D; d++) {
            size_t ch = h * D + d;
            double zp = ((double)cfg->k_upper[ch] + (double)cfg->k_lower[ch]) * 0.5, r = ((double)cfg->k_upper[ch] - (double)cfg->k_lower[ch]) * 0.5;
            for (size_t j = 0; j < nlk; j++) hl[ch * nlk + j] = r == 0 ? (float)zp : (float)((double)kl[j] * r + zp);
        }
    }
    {
        double *fr = (double *)malloc(c->np * sizeof(double));
        if (!fr) { st = kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: cannot allocate"); goto fail; }
        size_t nr = cfg->rope.rope_dim / 2;
        for (size_t i = 0; i < c->np; i++) {
            double f = 0;
            if (i < nr) {
                f = pow(cfg->rope.rope_theta, -2.0 * (double)i / (double)cfg->rope.rope_dim);
                if (cfg->rope.scale > 0) f /= cfg->rope.scale;
            }
            fr[i] = f;
            for (int l = 0; l < 64; l++) hlo[i * 64 + l] = i < nr ? make_float2((float)cos(l * f), (float)sin(l * f)) : make_float2(1, 0);
            for (size_t b = 0; b < c->nhi; b++)
                hhi[b * c->np + i] = i < nr ? make_float2((float)cos((double)(64 * b) * f), (float)sin((double)(64 * b) * f)) : make_float2(1, 0);
        }
        cudaError_t e = cudaMemcpy(c->inv_freq, fr, c->np * sizeof(double), cudaMemcpyHostToDevice);
        free(fr);
        if (e != cudaSuccess) { st = kvq_fail(err, KVQ_EIO, "CUDA: copy: %s", cudaGetErrorString(e)); goto fail; }
    }
    {
        cudaError_t e = cudaSuccess;
#define UP(dst, src, bytes) if (e == cudaSuccess) e = cudaMemcpy((dst), (src), (bytes), cudaMemcpyHostToDevice)
        if (nuq) UP(c->klut, hl, C * nlk * sizeof(float));
        if (nuq) {
            UP(c->vlevels, hv, H * nlv * sizeof(float));
            UP(c->klevels, hk, H * nlk * sizeof(float));
            UP(c->kz, hz, H);
            UP(c->vz, hz + H, H);
            UP(c->klo, cfg->k_lower, C * sizeof(float));
            UP(c->khi, cfg->k_upper, C * sizeof(float));
        }
        UP(c->rlo, hlo, c->np * 64 * sizeof(float2));
        UP(c->rhi, hhi, c->nhi * c->np * sizeof(float2));
#undef UP
        if (e != cudaSuccess) { st = kvq_fail(err, KVQ_EIO, "CUDA: table upload: %s", cudaGetErrorString(e)); goto fail; }
    }
    if ((st = set_smem_limits(err)) != KVQ_OK || (st = set_step_smem(err)) != KVQ_OK) goto fail;
    if (!nuq) {
        int lo = 0, hi = 0;
        cudaError_t e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
        if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, hi);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->ev_join, cudaEventDisableTiming);
        if (e != cudaSuccess) { st = kvq_fail(err, KVQ_EIO, "kvcache cuda: decode streams: %s", cudaGetErrorString(e)); goto fail; }
    }
    free(hl); free(hv); free(hk); free(hz); free(hlo); free(hhi);
    *out = c;
    return KVQ_OK;
fail:
    free(hl); free(hv); free(hk); free(hz); free(hlo); free(hhi);
    kvq_kvcache_cuda_free(c);
    return st;
}

#include "kvcache_cuda_app.cuh" // the NUQ append kernels (and f2h_sat, rope_elem), shared with the host emulator

// ---- KIVI append (formats/KVCACHE.md "KIVI"; the rules of kvcache.c's kivi_flush_keys / kivi_flush_value) ----
// the new tokens in the quantization domain: fp16 keys (rotated first when post_rope: double, as kvq_rope_rotate)
// and values; [n][C] each
static __global__ void kivi_stage(uint16_t *sk, uint16_t *sv, const float *k, const float *v, const double *inv_freq, int rope_pairs,
                           int post_rope, int H, int D, int pos0, int n)
{
    const int C = H * D;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * C; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / C), ch = (int)(i % C), h = ch / D, d = ch % D;
        sk[i] = f2h_sat(post_rope ? rope_elem(k + (size_t)t * C + h * D, d, pos0 + t, inv_freq, rope_pairs) : k[i]);
        sv[i] = f2h_sat(v[i]);
    }
}

// fp16 of channel ch at quantized index q: from the staged new tokens (position >= p0) or the ring
__device__ __forceinline__ float kivi_src(const uint16_t *ring, const uint16_t *stg, int ring_n, int C, int n_exact, int p0, int q, int ch)
{
    const int pos = n_exact + q;
    return h2f(pos >= p0 ? stg[(size_t)(pos - p0) * C + ch] : ring[(size_t)(pos % ring_n) * C + ch]);
}

// KIVI's code of x for a group (min mn, scale den in double): rint((x − mn) / den) clamped to [0, qmax]; 0 when den
// is 0 (kvcache.c kivi_flush_keys / kivi_flush_value)
__device__ __forceinline__ unsigned char kivi_code(double x, float mn, double den, double qmax)
{
    double qq = den == 0 ? 0 : rint((x - mn) / den);
    if (qq < 0) qq = 0;
    if (qq > qmax) qq = qmax;
    return (unsigned char)qq;
}

// pack codes[0..D) (bytes) of one (token, head) into unit words: word j of unit u -> dst[(u·W + j)·stride]
static __device__ void kivi_pack(uint32_t *dst, size_t stride, const unsigned char *codes, int D, int bits, int u)
{
    const int cpu = bits == 2 ? 16 : bits == 3 ? 32 : 8, W = bits == 3 ? 3 : 1;
    uint32_t w[3] = {0u, 0u, 0u};
    for (int j = 0; j < cpu; j++) {
        const int d = u * cpu + j;
        const uint32_t code = d < D ? codes[d] : 0u;
        const int bit = bits * j, o = bit & 31;
        w[bit >> 5] |= code << o;
        if (o + bits > 32) w[(bit >> 5) + 1] |= code >> (32 - o);
    }
    for (int j = 0; j < W; j++) dst[(size_t)(u * W + j) * stride] = w[j];
}

// key groups [q0 + G·blockIdx.x, +G) of one sequence, head blockIdx.y: per channel min / max over the G tokens,
// scale in double, codes rint((x − min) / scale) clamped; dynamic shared memory G·D bytes
static __global__ void kivi_key_flush(uint32_t *kcodes, float2 *kscale, const uint16_t *ring, const uint16_t *stg, int H, int D, int G,
                               int bits, int capq, int kw, int ring_n, int n_exact, int q0, int p0)
{
    extern __shared__ unsigned char cod[];
    const int h = blockIdx.y, C = H * D, qg = q0 + (int)blockIdx.x * G;
    const double qmax = (double)((1 << bits) - 1);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const int ch = h * D + d;
        float mn = INFINITY, mx = -INFINITY;
        for (int t = 0; t < G; t++) {
            const float x = kivi_src(ring, stg, ring_n, C, n_exact, p0, qg + t, ch);
            if (x < mn) mn = x;
            if (x > mx) mx = x;
        }
        const double den = ((double)mx - (double)mn) / qmax;
        kscale[(size_t)(qg / G) * C + ch] = make_float2(mn, (float)den);
        for (int t = 0; t < G; t++) cod[t * D + d] = kivi_code(kivi_src(ring, stg, ring_n, C, n_exact, p0, qg + t, ch), mn, den, qmax);
    }
    __syncthreads();
    const int cpu = bits == 2 ? 16 : bits == 3 ? 32 : 8, nu = (D + cpu - 1) / cpu;
    for (int i = threadIdx.x; i < G * nu; i += blockDim.x) {
        const int t = i / nu, u = i % nu;
        const int q = qg + t; // KIVI key tiles [capq/16][kw][16] (formats/KVCACHE.md)
        kivi_pack(kcodes + (size_t)h * kw * capq + (size_t)(q >> 4) * kw * 16 + (q & 15), 16, cod + t * D, D, bits, u);
    }
}

// value positions q0 + blockIdx.x of one sequence: per token and G-channel group min / max, scale in double, stored
// [H][capq][D/G] (vscale: the sequence's block); a thread per group (codes of its G channels), then the packing;
// dynamic shared memory C bytes
static __global__ void kivi_value_flush(uint32_t *vcodes, float2 *vscale, const uint16_t *ring, const uint16_t *stg, int H, int D, int G,
                                 int bits, int capq, int vw, int ring_n, int n_exact, int q0, int p0)
{
    extern __shared__ unsigned char cod[];
    const int C = H * D, q = q0 + (int)blockIdx.x, ng = C / G;
    const double qmax = (double)((1 << bits) - 1);
    for (int gi = threadIdx.x; gi < ng; gi += blockDim.x) {
        const int c0 = gi * G;
        float mn = kivi_src(ring, stg, ring_n, C, n_exact, p0, q, c0), mx = mn;
        for (int j = 1; j < G; j++) {
            const float y = kivi_src(ring, stg, ring_n, C, n_exact, p0, q, c0 + j);
            if (y < mn) mn = y;
            if (y > mx) mx = y;
        }
        const double sc = ((double)mx - (double)mn) / qmax;
        const int nh = D / G; // groups per head: group gi is group gi % nh of head gi / nh
        vscale[((size_t)(gi / nh) * capq + q) * nh + gi % nh] = make_float2(mn, (float)sc);
        for (int j = 0; j < G; j++) cod[c0 + j] = kivi_code(kivi_src(ring, stg, ring_n, C, n_exact, p0, q, c0 + j), mn, sc, qmax);
    }
    __syncthreads();
    const int cpu = bits == 2 ? 16 : bits == 3 ? 32 : 8, nu = (D + cpu - 1) / cpu;
    for (int i = threadIdx.x; i < H * nu; i += blockDim.x) {
        const int h = i / nu, u = i % nu;
        kivi_pack(vcodes + ((size_t)h * capq + q) * vw, 1, cod + h * D, D, bits, u);
    }
}

// the last positions [pw, p1) of the append into the ring (after the flushes that read the ring)
static __global__ void kivi_ring_write(uint16_t *kring, uint16_t *vring, const uint16_t *sk, const uint16_t *sv, int C, int ring_n, int p0, int pw,
                                int p1)
{
    const size_t n = (size_t)(p1 - pw) * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int pos = pw + (int)(i / C), ch = (int)(i % C);
        kring[(size_t)(pos % ring_n) * C + ch] = sk[(size_t)(pos - p0) * C + ch];
        vring[(size_t)(pos % ring_n) * C + ch] = sv[(size_t)(pos - p0) * C + ch];
    }
}

// KIVI: positions [p0, p0 + m) (all past the exact region) of sequence seq
static kvq_status kivi_append(kvq_kvcache_cuda *c, size_t seq, const float *k, const float *v, size_t p0, size_t m, bool sync, kvq_err *err)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C, G = g->group, p1 = p0 + m;
    if (m > c->stg_cap) {
        if (c->stg) cudaFree(c->stg);
        c->stg = nullptr;
        c->stg_cap = 0;
        KVQ_TRY(dalloc(&c->stg, 2 * m * C, "append staging", err));
        c->stg_cap = m;
    }
    uint16_t *sk = c->stg, *sv = c->stg + m * C;
    const unsigned nb = (unsigned)((m * C + 255) / 256 < 4096 ? (m * C + 255) / 256 : 4096);
    kivi_stage<<<nb, 256>>>(sk, sv, k, v, c->inv_freq, (int)(g->rope.rope_dim / 2), g->post_rope ? 1 : 0, (int)H, (int)D, (int)p0, (int)m);
    CKL();
    const size_t kb = kvq_kivi_key_boundary(p1 - 1, G, g->residual, c->n_exact) - c->n_exact;
    const size_t vb = kvq_kivi_value_boundary(p1 - 1, g->residual, c->n_exact) - c->n_exact;
    size_t kq = c->kq[seq], vq = c->vq[seq];
    if (kq + G <= kb) {
        const size_t ng = (kb - kq) / G;
        kivi_key_flush<<<dim3((unsigned)ng, (unsigned)H), D < 128 ? 64 : 128, G * D>>>(
            c->kcodes + seq * H * c->kw * c->capq, (float2 *)c->kscale + seq * c->ngk * C, c->kring + seq * c->ring * C, sk, (int)H,
            (int)D, (int)G, g->k_bits, (int)c->capq, (int)c->kw, (int)c->ring, (int)c->n_exact, (int)kq, (int)p0);
        CKL();
        kq += ng * G;
    }
    if (vq < vb) {
        kivi_value_flush<<<(unsigned)(vb - vq), 64, C>>>(c->vcodes + seq * H * c->capq * c->vw, (float2 *)c->vscale + seq * c->capq * (C / G),
                                                          c->vring + seq * c->ring * C, sv, (int)H, (int)D, (int)G, g->v_bits, (int)c->capq,
                                                          (int)c->vw, (int)c->ring, (int)c->n_exact, (int)vq, (int)p0);
        CKL();
        vq = vb;
    }
    const size_t pw = p1 - p0 > c->ring ? p1 - c->ring : p0;
    kivi_ring_write<<<nb, 256>>>(c->kring + seq * c->ring * C, c->vring + seq * c->ring * C, sk, sv, (int)C, (int)c->ring, (int)p0,
                                 (int)pw, (int)p1);
    CKL();
    if (sync) CK(cudaDeviceSynchronize());
    c->kq[seq] = kq;
    c->vq[seq] = vq;
    return KVQ_OK;
}

// the entries a (sequence, head) store may hold: outlier_max, or what a row pointer can address
static size_t ent_limit(const kvq_kvcache_cuda *c) { return c->cfg.outlier_max ? c->cfg.outlier_max : 0xffffffffu; }
static kvq_status resize_entries(kvq_kvcache_cuda *c, size_t cap, kvq_err *err);
static kvq_status grow_entries(kvq_kvcache_cuda *c, size_t need, size_t seq, size_t pos, kvq_err *err)
{
    size_t lim = ent_limit(c), cap = c->ent_cap;
    if (need > lim)
        return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda: sequence %zu position %zu: sparse outlier store needs %zu entries, limit outlier_max %zu",
                        seq, pos, need, lim);
    while (cap < need) cap = cap > lim / 2 ? lim : cap * 2;
    return resize_entries(c, cap, err);
}
// both stores reallocated with cap entries per (sequence, head) (cap >= ent_cap), the entries copied
static kvq_status resize_entries(kvq_kvcache_cuda *c, size_t cap, kvq_err *err)
{
    const size_t B = c->cfg.n_seqs * c->cfg.n_kv_heads; /* one store per (sequence, head) */
    uint32_t *ke = nullptr, *ve = nullptr;
    KVQ_TRY(dalloc(&ke, B * cap, "key outliers", err));
    kvq_status st = dalloc(&ve, B * cap, "value outliers", err);
    if (st != KVQ_OK) { cudaFree(ke); return st; }
    cudaError_t e = cudaMemcpy2D(ke, cap * 4, c->kent, c->ent_cap * 4, c->ent_cap * 4, B, cudaMemcpyDeviceToDevice);
    if (e == cudaSuccess) e = cudaMemcpy2D(ve, cap * 4, c->vent, c->ent_cap * 4, c->ent_cap * 4, B, cudaMemcpyDeviceToDevice);
    if (e != cudaSuccess) { cudaFree(ke); cudaFree(ve); return kvq_fail(err, KVQ_EIO, "CUDA: outlier store copy: %s", cudaGetErrorString(e)); }
    cudaFree(c->kent);
    cudaFree(c->vent);
    c->kent = ke;
    c->vent = ve;
    c->ent_cap = cap;
    return KVQ_OK;
}

typedef void (*AppFn)(const float *, const float *, const float *, const float *, const float *, const float *, const uint8_t *,
                      const uint8_t *, const float *, int, int, int, int, int, int, int, int, uint32_t *, uint32_t *,
                      const uint32_t *, const uint32_t *, uint32_t *, uint32_t *, float *, size_t);
template <int BK> static AppFn app1(int bv) { return bv == 2 ? append_write<BK, 2> : bv == 3 ? append_write<BK, 3> : append_write<BK, 4>; }
static AppFn app_pick(int bk, int bv) { return bk == 2 ? app1<2>(bv) : bk == 3 ? app1<3>(bv) : app1<4>(bv); }

// IntactKV prefix rows [n][C] (post-RoPE keys, values) into the exact region of one sequence, fp16 (saturating)
static __global__ void put_prefix_kernel(uint16_t *k16, uint16_t *v16, const float *k, const float *v, int H, int D, int n_exact, int n)
{
    const int C = H * D;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * C; i += (size_t)gridDim.x * blockDim.x) {
        const int p = (int)(i / C), ch = (int)(i % C), h = ch / D, d = ch % D;
        const size_t o = ((size_t)h * n_exact + p) * D + d;
        k16[o] = f2h_sat(k[i]);
        v16[o] = f2h_sat(v[i]);
    }
}

static __global__ void put_lengths(int *dlen, int B, int seq, int len, int kq, int vq, int qf)
{
    if (threadIdx.x == 0) { dlen[seq] = len; dlen[B + seq] = kq; dlen[2 * B + seq] = vq; dlen[3 * B + seq] = qf; }
}
// the device copies of sequence seq's length, quantized key / value positions and kivi_fast's range: column seq
// of the [4][B] array at dlen, by a kernel (its arguments travel with the launch: no copy from pageable memory, which
// would synchronise the host)
static kvq_status upload_lengths(kvq_kvcache_cuda *c, size_t seq, kvq_err *err)
{
    const size_t qf = (c->kq[seq] < c->vq[seq] ? c->kq[seq] : c->vq[seq]) / 16 * 16;
    put_lengths<<<1, 32>>>(c->dlen, (int)c->cfg.n_seqs, (int)seq, (int)c->len[seq], (int)c->kq[seq], (int)c->vq[seq], (int)qf);
    CKL();
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_set_prefix(kvq_kvcache_cuda *c, size_t seq, const float *k, const float *v, kvq_err *err)
{
    if (!c || !k || !v) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda set_prefix: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    if (seq >= g->n_seqs) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda set_prefix: sequence %zu: expected < %zu", seq, g->n_seqs);
    if (!g->prefix_len) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda set_prefix: prefix_len is 0 in the configuration");
    if (c->len[seq])
        return kvq_fail(err, KVQ_EINVAL, "kvcache cuda set_prefix: sequence %zu holds %zu positions; the prefix goes first", seq, c->len[seq]);
    const size_t H = g->n_kv_heads, D = g->head_dim, P = g->prefix_len;
    put_prefix_kernel<<<(unsigned)((P * c->C + 255) / 256 < 4096 ? (P * c->C + 255) / 256 : 4096), 256>>>(
        c->k16 + seq * H * c->n_exact * D, c->v16 + seq * H * c->n_exact * D, k, v, (int)H, (int)D, (int)c->n_exact, (int)P);
    CKL();
    c->len[seq] = P;
    c->kq[seq] = c->vq[seq] = 0;
    c->prefix_set[seq] = true;
    KVQ_TRY(upload_lengths(c, seq, err));
    CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

// append_count's outputs for m tokens: counts [m][2][H] and ranges (m·2·H of each allocated)
static kvq_status ensure_scratch(kvq_kvcache_cuda *c, size_t m, kvq_err *err)
{
    const size_t H = c->cfg.n_kv_heads;
    if (m * 2 * H <= c->cnt_cap) return KVQ_OK;
    if (c->cnt) cudaFree(c->cnt);
    if (c->range) cudaFree(c->range);
    c->cnt = nullptr; c->range = nullptr; c->cnt_cap = 0;
    KVQ_TRY(dalloc(&c->cnt, m * 2 * H, "append scratch", err));
    KVQ_TRY(dalloc(&c->range, m * 2 * H, "append scratch", err));
    c->cnt_cap = m * 2 * H;
    return KVQ_OK;
}

// the exact entry counts of every (sequence, head) from the device's row pointers: ku, vu [B][H] (host)
static cudaError_t read_used(const kvq_kvcache_cuda *c, size_t *ku, size_t *vu)
{
    const size_t B = c->cfg.n_seqs, H = c->cfg.n_kv_heads, n = B * H;
    uint32_t *h = (uint32_t *)malloc(2 * n * sizeof(uint32_t));
    if (!h) return cudaErrorMemoryAllocation;
    gather_used<<<(unsigned)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024), 256>>>(c->krow, c->vrow, c->dlen, (int)B, (int)H, (int)c->capq,
                                                                                    (int)c->n_exact, c->dused);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpy(h, c->dused, 2 * n * sizeof(uint32_t), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
        for (size_t i = 0; i < n; i++) { ku[i] = h[i]; vu[i] = h[n + i]; }
    free(h);
    return e;
}
// kused / vused exact again after batched steps (one synchronisation)
static kvq_status refresh_used(kvq_kvcache_cuda *c, kvq_err *err)
{
    if (!c->stale) return KVQ_OK;
    CK(read_used(c, c->kused, c->vused));
    memset(c->since, 0, c->cfg.n_seqs * sizeof(size_t));
    c->stale = false;
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_append(kvq_kvcache_cuda *c, size_t seq, const float *k, const float *v, size_t n, kvq_err *err)
{
    if (!c || (n && (!k || !v))) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda append: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    if (seq >= g->n_seqs) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda append: sequence %zu: expected < %zu", seq, g->n_seqs);
    if (g->prefix_len && !c->prefix_set[seq])
        return kvq_fail(err, KVQ_EINVAL, "kvcache cuda append: sequence %zu: the IntactKV prefix (%zu positions) must be set first", seq,
                        g->prefix_len);
    const size_t len = c->len[seq], H = g->n_kv_heads, D = g->head_dim, C = c->C;
    if (n > g->max_tokens - len)
        return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append: sequence %zu: %zu positions + %zu new exceed max_tokens %zu", seq, len, n, g->max_tokens);
    if (g->format == KVQ_KVCACHE_NUQ) KVQ_TRY(refresh_used(c, err)); // the rows below continue from the exact counts
    size_t t = 0, pos = len;
    if (pos < c->n_exact && n) {
        size_t m = c->n_exact - pos < n ? c->n_exact - pos : n;
        put_exact_kernel<<<(unsigned)((m * C + 255) / 256), 256>>>(c->k16 + seq * H * c->n_exact * D, c->v16 + seq * H * c->n_exact * D, k, v,
                                                                   c->inv_freq, (int)(g->rope.rope_dim / 2), (int)H, (int)D, (int)c->n_exact, (int)pos, (int)m);
        CKL();
        t += m;
        pos += m;
    }
    kvq_status st = KVQ_OK;
    const size_t m = n - t;
    if (m && g->format == KVQ_KVCACHE_KIVI) {
        st = kivi_append(c, seq, k + t * C, v + t * C, pos, m, true, err);
        if (st == KVQ_OK) pos += m;
    } else if (m) {
        const float *kq = k + t * C, *vq = v + t * C;
        const size_t q0 = pos - c->n_exact;
        KVQ_TRY(ensure_scratch(c, m, err));
        int P2 = 1;
        while ((size_t)P2 < C) P2 <<= 1;
        const int outl = g->outlier_frac > 0;
        append_count<<<(unsigned)m, 256, P2 * sizeof(float)>>>(kq, vq, c->klo, c->khi, (int)H, (int)D, (int)c->kps, outl, P2, c->range, c->cnt);
        CKL();
        int *hc = (int *)malloc(m * 2 * H * sizeof(int));
        uint32_t *rk = (uint32_t *)malloc(m * H * sizeof(uint32_t)), *rv = (uint32_t *)malloc(m * H * sizeof(uint32_t));
        if (!hc || !rk || !rv) { free(hc); free(rk); free(rv); return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append: cannot allocate"); }
        cudaError_t e = cudaMemcpy(hc, c->cnt, m * 2 * H * sizeof(int), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) { free(hc); free(rk); free(rv); return kvq_fail(err, KVQ_EIO, "CUDA: counts: %s", cudaGetErrorString(e)); }
        const size_t R = c->capq + 1;
        size_t *ku = c->kused + seq * H, *vu = c->vused + seq * H, mm = 0;
        size_t *nku = (size_t *)malloc(2 * H * sizeof(size_t));
        if (!nku) { free(hc); free(rk); free(rv); return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append: cannot allocate"); }
        size_t *nvu = nku + H;
        memcpy(nku, ku, H * sizeof(size_t));
        memcpy(nvu, vu, H * sizeof(size_t));
        for (; mm < m; mm++) {
            size_t need = 0;
            for (size_t h = 0; h < H; h++) {
                size_t a = nku[h] + hc[mm * 2 * H + h], b = nvu[h] + hc[mm * 2 * H + H + h];
                if (a > need) need = a;
                if (b > need) need = b;
            }
            if (need > c->ent_cap && (st = grow_entries(c, need, seq, pos + mm, err)) != KVQ_OK) break;
            for (size_t h = 0; h < H; h++) {
                nku[h] += hc[mm * 2 * H + h];
                nvu[h] += hc[mm * 2 * H + H + h];
                rk[h * m + mm] = (uint32_t)nku[h];
                rv[h * m + mm] = (uint32_t)nvu[h];
            }
        }
        if (mm) {
            const size_t rb = seq * H * R + q0 + 1;
            e = cudaMemcpy2D(c->krow + rb, R * 4, rk, m * 4, mm * 4, H, cudaMemcpyHostToDevice);
            if (e == cudaSuccess) e = cudaMemcpy2D(c->vrow + rb, R * 4, rv, m * 4, mm * 4, H, cudaMemcpyHostToDevice);
            if (e != cudaSuccess) { free(hc); free(rk); free(rv); free(nku); return kvq_fail(err, KVQ_EIO, "CUDA: rows: %s", cudaGetErrorString(e)); }
            AppFn f = app_pick(g->k_bits, g->v_bits);
            f<<<(unsigned)mm, 128>>>(kq, vq, c->klo, c->khi, c->klevels, c->vlevels, c->kz, c->vz, c->range, (int)H, (int)D,
                                     (int)c->kps, outl, (int)q0, (int)c->capq, (int)c->kw, (int)c->vw,
                                     c->kcodes + seq * H * c->kw * c->capq, c->vcodes + seq * H * c->capq * c->vw,
                                     c->krow + seq * H * R, c->vrow + seq * H * R,
                                     c->kent + seq * H * c->ent_cap, c->vent + seq * H * c->ent_cap, c->vscale + seq * c->capq * 2,
                                     c->ent_cap);
            e = cudaGetLastError();
            if (e == cudaSuccess) e = cudaDeviceSynchronize();
            if (e != cudaSuccess) { free(hc); free(rk); free(rv); free(nku); return kvq_fail(err, KVQ_EIO, "CUDA: append kernel: %s", cudaGetErrorString(e)); }
            memcpy(ku, nku, H * sizeof(size_t));
            memcpy(vu, nvu, H * sizeof(size_t));
        }
        free(nku);
        free(hc); free(rk); free(rv);
        pos += mm;
    }
    c->len[seq] = pos;
    if (g->format == KVQ_KVCACHE_NUQ) c->kq[seq] = c->vq[seq] = pos > c->n_exact ? pos - c->n_exact : 0;
    KVQ_TRY(upload_lengths(c, seq, err));
    CK(cudaDeviceSynchronize());
    return st;
}

// ---- the batched step ------------------------------------------------------------------------------
typedef void (*StepFn)(StepArgs);
template <int BK> static StepFn step1(int bv) { return bv == 2 ? append_step<BK, 2> : bv == 3 ? append_step<BK, 3> : append_step<BK, 4>; }
static StepFn step_pick(int bk, int bv) { return bk == 2 ? step1<2>(bv) : bk == 3 ? step1<3>(bv) : step1<4>(bv); }
static kvq_status set_step_smem(kvq_err *err)
{
    for (int a = 2; a <= 4; a++)
        for (int b = 2; b <= 4; b++)
            CK(cudaFuncSetAttribute((const void *)step_pick(a, b), cudaFuncAttributeMaxDynamicSharedMemorySize, 16384 * 4));
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_append_step(kvq_kvcache_cuda *c, const float *k, const float *v, kvq_err *err)
{
    if (!c || !k || !v) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda append step: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    const size_t B = g->n_seqs, H = g->n_kv_heads, D = g->head_dim, C = c->C;
    for (size_t s = 0; s < B; s++) { // every rule before any work: a refused step appends nothing
        if (g->prefix_len && !c->prefix_set[s])
            return kvq_fail(err, KVQ_EINVAL, "kvcache cuda append step: sequence %zu: the IntactKV prefix (%zu positions) must be set first", s,
                            g->prefix_len);
        if (c->len[s] >= g->max_tokens)
            return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append step: sequence %zu: %zu positions + 1 new exceed max_tokens %zu", s, c->len[s],
                            g->max_tokens);
    }
    if (g->format == KVQ_KVCACHE_KIVI) { // the per-sequence append without its synchronisation (kvcache_cuda.h)
        for (size_t s = 0; s < B; s++) {
            const size_t pos = c->len[s];
            if (pos < c->n_exact) {
                put_exact_kernel<<<(unsigned)((C + 255) / 256), 256>>>(c->k16 + s * H * c->n_exact * D, c->v16 + s * H * c->n_exact * D, k + s * C,
                                                                      v + s * C, c->inv_freq, (int)(g->rope.rope_dim / 2), (int)H, (int)D,
                                                                      (int)c->n_exact, (int)pos, 1);
                CKL();
            } else {
                KVQ_TRY(kivi_append(c, s, k + s * C, v + s * C, pos, 1, false, err));
            }
            c->len[s] = pos + 1;
            KVQ_TRY(upload_lengths(c, s, err));
        }
        return KVQ_OK;
    }
    int P2 = 1;
    while ((size_t)P2 < C) P2 <<= 1;
    const int outl = g->outlier_frac > 0;
    if (outl && step_bound_exceeds(c->kused, c->vused, c->since, c->len, B, H, D, c->n_exact, c->ent_cap)) {
        c->stale = true; // read the exact counts (one synchronisation)
        KVQ_TRY(refresh_used(c, err));
        const size_t lim = ent_limit(c);
        const size_t t = step_capacity(c->kused, c->vused, c->len, B, H, D, c->n_exact, g->max_tokens, c->ent_cap, lim);
        if (t == 0) { // near outlier_max: this step's exact counts decide
            KVQ_TRY(ensure_scratch(c, B, err));
            append_count<<<(unsigned)B, 256, P2 * sizeof(float)>>>(k, v, c->klo, c->khi, (int)H, (int)D, (int)c->kps, outl, P2, c->range, c->cnt);
            CKL();
            int *hc = (int *)malloc(B * 2 * H * sizeof(int));
            if (!hc) return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append step: cannot allocate");
            cudaError_t e = cudaMemcpy(hc, c->cnt, B * 2 * H * sizeof(int), cudaMemcpyDeviceToHost);
            if (e != cudaSuccess) { free(hc); return kvq_fail(err, KVQ_EIO, "CUDA: counts: %s", cudaGetErrorString(e)); }
            size_t need = 0;
            for (size_t s = 0; s < B; s++) {
                if (c->len[s] < c->n_exact) continue;
                for (size_t h = 0; h < H; h++) {
                    const size_t a = c->kused[s * H + h] + (size_t)hc[s * 2 * H + h], b = c->vused[s * H + h] + (size_t)hc[s * 2 * H + H + h],
                                 m = a > b ? a : b;
                    if (m > lim) {
                        free(hc);
                        return kvq_fail(err, KVQ_ENOMEM, "kvcache cuda append step: sequence %zu position %zu: sparse outlier store needs %zu "
                                        "entries, limit outlier_max %zu; nothing of the step appended", s, c->len[s], m, lim);
                    }
                    if (m > need) need = m;
                }
            }
            free(hc);
            if (need > c->ent_cap) KVQ_TRY(grow_entries(c, need, 0, 0, err));
        } else if (t > c->ent_cap) {
            KVQ_TRY(resize_entries(c, t, err));
        }
    }
    StepArgs p;
    p.k = k; p.v = v; p.klo = c->klo; p.khi = c->khi; p.klev = c->klevels; p.vlev = c->vlevels; p.kz = c->kz; p.vz = c->vz;
    p.inv_freq = c->inv_freq; p.rope_pairs = (int)(g->rope.rope_dim / 2); p.B = (int)B; p.H = (int)H; p.D = (int)D; p.kps = (int)c->kps;
    p.outl = outl; p.P2 = P2; p.n_exact = (int)c->n_exact; p.capq = (int)c->capq; p.kw = (int)c->kw; p.vw = (int)c->vw;
    p.k16 = c->k16; p.v16 = c->v16; p.kcodes = c->kcodes; p.vcodes = c->vcodes; p.krow = c->krow; p.vrow = c->vrow;
    p.kent = c->kent; p.vent = c->vent; p.vscale = c->vscale; p.ent_cap = c->ent_cap; p.len = c->dlen;
    step_pick(g->k_bits, g->v_bits)<<<(unsigned)B, 128, P2 * sizeof(float)>>>(p);
    CKL();
    for (size_t s = 0; s < B; s++) { // the host mirrors: every sequence one position longer
        if (outl && c->len[s] >= c->n_exact) { c->since[s]++; c->stale = true; }
        c->len[s]++;
        c->kq[s] = c->vq[s] = c->len[s] > c->n_exact ? c->len[s] - c->n_exact : 0;
    }
    return KVQ_OK;
}

// ---- attention -----------------------------------------------------------------------------------
// a device buffer *p of *cap elements grown to at least need, zero-filled when (re)allocated
template <class T> static kvq_status ensure_dev(T **p, size_t *cap, size_t need, const char *what, kvq_err *err)
{
    if (need <= *cap) return KVQ_OK;
    if (*p) cudaFree(*p);
    *p = nullptr;
    *cap = 0;
    KVQ_TRY(dalloc(p, need, what, err));
    *cap = need;
    return KVQ_OK;
}
static kvq_status ensure_part(kvq_kvcache_cuda *c, size_t need, kvq_err *err) { return ensure_dev(&c->part, &c->part_cap, need, "attention partials", err); }
// kivi_generic's tick counters for n query-head rows (zero between decodes)
static kvq_status ensure_tick(kvq_kvcache_cuda *c, size_t n, kvq_err *err) { return ensure_dev(&c->tick, &c->tick_cap, n, "decode tick counters", err); }

// the exact region's decode (fp16 rows) into the last of nslots partial slots, when there is one
static void exact_launch(kvq_kvcache_cuda *c, const float *q, size_t n_heads, float scale, size_t nslots)
{
    const size_t H = c->cfg.n_kv_heads, D = c->cfg.head_dim, B = c->cfg.n_seqs;
    if (!c->n_exact) return;
    DecP p;
    memset(&p, 0, sizeof p);
    p.k16 = c->k16; p.v16 = c->v16; p.q = q; p.part = c->part; p.len = c->dlen;
    p.H = (int)H; p.D = (int)D; p.n_heads = (int)n_heads; p.g = (int)(n_heads / H); p.n_exact = (int)c->n_exact; p.nslots = (int)nslots;
    p.scale = scale > 0 ? scale : 1.0f / sqrtf((float)D);
    exact_decode<<<dim3((unsigned)n_heads, (unsigned)B), NT, (D + c->n_exact + 1) * sizeof(float)>>>(p);
}

// the exact region's decode (fp16 rows) into the last partial slot, then the combine (without an exact region the
// combine leaves that slot out instead: one launch less)
static kvq_status exact_and_combine(kvq_kvcache_cuda *c, const float *q, size_t n_heads, float scale, float *out, size_t nslots, kvq_err *err)
{
    const size_t D = c->cfg.head_dim, B = c->cfg.n_seqs;
    exact_launch(c, q, n_heads, scale, nslots);
    CKL();
    combine<<<dim3((unsigned)n_heads, (unsigned)B), D < 128 ? 64 : 128>>>(c->part, out, (int)n_heads, (int)D, (int)nslots,
                                                                          combine_slots(nslots, c->n_exact));
    CKL();
    return KVQ_OK;
}

// KIVI decode: kivi_fast on [0, qf) of each sequence when it applies (post-RoPE keys, 2/4-bit, G = 16..128, a power
// of two), the exact region, kivi_tail on the rest (beside kivi_fast on the side stream, then combine_par or, with
// fewer than 4 rows per SM, combine_par_wide after the join), or kivi_generic on everything (then its last block per
// query head combines)
static kvq_status kivi_attend(kvq_kvcache_cuda *c, const float *q, size_t n_heads, float scale, float *out, size_t max_splits, int sync,
                              kvq_err *err)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, B = g->n_seqs, G = g->group;
    const int gg = (int)(n_heads / H), lg = G == 16 ? 0 : G == 32 ? 1 : G == 64 ? 2 : G == 128 ? 3 : -1;
    const bool fast = g->post_rope && (g->k_bits == 2 || g->k_bits == 4) && (g->v_bits == 2 || g->v_bits == 4) && lg >= 0;
    size_t maxqf = 0, maxrest = 0;
    for (size_t s = 0; s < B; s++) {
        const size_t nq = c->len[s] > c->n_exact ? c->len[s] - c->n_exact : 0;
        const size_t qf = fast ? (c->kq[s] < c->vq[s] ? c->kq[s] : c->vq[s]) / 16 * 16 : 0;
        if (qf > maxqf) maxqf = qf;
        if (nq - qf > maxrest) maxrest = nq - qf;
    }
    int gq = 1, qgroups = gg;
    if (fast && maxqf) {
        gq = choose_gq(gg);
        qgroups = (gg + gq - 1) / gq;
    }
    const kv::KiviSchedule ks = kv::kivi_schedule(maxqf, maxrest, B * H * qgroups, B * n_heads, (size_t)c->n_sm, max_splits, gq, (int)D,
                                                  (int)G, g->k_bits, g->v_bits, SMEM_MAX);
    const kv::FastPlan &fp = ks.fast;
    const size_t fsplits = fp.splits, gchunk = ks.gchunk, gsplits = ks.gsplits;
    if (fsplits > 65535 || (fsplits && B > 65535))
        return kvq_fail(err, KVQ_EINVAL, "kvcache cuda attend: %zu sequences in %zu splits of %zu positions exceed a launch (65535 each)", B, fsplits,
                        ks.fchunk);
    const size_t nslots = fsplits + gsplits + 1;
    KVQ_TRY(ensure_part(c, B * n_heads * nslots * (D + 2), err));
    const bool side = fsplits != 0; // kivi_tail beside kivi_fast; the tick counters only without it
    if (!side) KVQ_TRY(ensure_tick(c, B * n_heads, err));
    KivP p;
    memset(&p, 0, sizeof p);
    p.kcodes = c->kcodes; p.vcodes = c->vcodes; p.kscale = (const float2 *)c->kscale; p.vscale = (const float2 *)c->vscale;
    p.kring = c->kring; p.vring = c->vring; p.rlo = c->rlo; p.rhi = c->rhi; p.q = q; p.part = c->part;
    p.len = c->dlen; p.kq = c->dkq; p.vq = c->dvq; p.qf = c->dqf;
    p.H = (int)H; p.D = (int)D; p.G = (int)G; p.kb = g->k_bits; p.vb = g->v_bits; p.np = (int)c->np; p.n_heads = (int)n_heads; p.g = gg;
    p.qgroups = qgroups; p.kw = (int)c->kw; p.vw = (int)c->vw; p.capq = (int)c->capq; p.ngk = (int)c->ngk; p.n_exact = (int)c->n_exact;
    p.ring = (int)c->ring; p.nslots = (int)nslots; p.post_rope = g->post_rope ? 1 : 0;
    p.scale = scale > 0 ? scale : 1.0f / sqrtf((float)D);
    p.gchunk = (int)gchunk;
    p.use_qf = fsplits ? 1 : 0;
    if (side) { // the tail on the side stream, from here on
        CK(cudaEventRecord(c->ev_fork, 0));
        CK(cudaStreamWaitEvent(c->side, c->ev_fork, 0));
    }
    if (fsplits) { // grid (query-head groups, sequences, splits): see kivi_fast
        p.chunk = (int)fp.chunk; p.nlong = (int)fp.nlong; p.chunk2 = (int)fp.chunk2;
        p.vpref = ks.vpref;
        kv::fast_pick(g->k_bits, g->v_bits, gq, lg, kv::fast_nw((int)D))<<<dim3((unsigned)(H * qgroups), (unsigned)B, (unsigned)fsplits), kv::fast_threads((int)G),
                                                       (size_t)kv::fast_smem(gq, (int)D, (int)G, g->k_bits, g->v_bits, (int)fp.chunk).total * 4>>>(p);
        CKL();
    }
    exact_launch(c, q, n_heads, scale, nslots);
    CKL();
    p.slot0 = (int)fsplits;
    p.out = out;
    p.tick = side ? nullptr : c->tick;
    p.nuse = combine_slots(nslots, c->n_exact);
    if (side)
        kv::kivi_tail<<<dim3((unsigned)gsplits, (unsigned)n_heads, (unsigned)B), kv::NTG, kv::generic_smem((int)D, (int)gchunk) * sizeof(float), c->side>>>(p);
    else
        kv::kivi_generic<<<dim3((unsigned)gsplits, (unsigned)n_heads, (unsigned)B), kv::NTG, kv::generic_smem((int)D, (int)gchunk) * sizeof(float)>>>(p);
    CKL();
    if (side) { // join, then the combine
        CK(cudaEventRecord(c->ev_join, c->side));
        CK(cudaStreamWaitEvent(0, c->ev_join, 0));
        const dim3 cg((unsigned)n_heads, (unsigned)B);
        switch (kv::combine_pick(B * n_heads, (size_t)c->n_sm, p.nuse, (int)D)) {
        case kv::COMBINE_ROW512: kv::combine_row<512, 16><<<cg, 512, kv::combine1_smem(512, (int)D) * sizeof(float)>>>(p); break;
        case kv::COMBINE_ROW128: kv::combine_row<128, 24><<<cg, 128, kv::combine1_smem(128, (int)D) * sizeof(float)>>>(p); break;
        case kv::COMBINE_WIDE: kv::combine_par_wide<<<cg, kv::CW_NT, kv::combine_wide_smem((int)D) * sizeof(float)>>>(p); break;
        case kv::COMBINE_PAR: kv::combine_par<<<cg, 128, COMBINE_SMEM * sizeof(float)>>>(p); break;
        }
        CKL();
    }
    if (sync) CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_attend(kvq_kvcache_cuda *c, const float *q, size_t n_heads, float scale, float *out,
                                              size_t max_splits, int sync, kvq_err *err)
{
    if (!c || !q || !out) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda attend: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, B = g->n_seqs;
    if (n_heads == 0 || n_heads % H)
        return kvq_fail(err, KVQ_EINVAL, "kvcache cuda attend: n_heads %zu: expected a multiple of n_kv_heads %zu", n_heads, H);
    if (g->format == KVQ_KVCACHE_KIVI) return kivi_attend(c, q, n_heads, scale, out, max_splits, sync, err);
    const int gg = (int)(n_heads / H), gq = choose_gq(gg), qgroups = (gg + gq - 1) / gq;
    size_t maxlen = 0;
    for (size_t s = 0; s < B; s++) if (c->len[s] > maxlen) maxlen = c->len[s];
    const size_t nq = maxlen > c->n_exact ? maxlen - c->n_exact : 0;
    // key pairs (padded to whole units: 3-bit units are 3 words of 32 channels)
    const int npk = (int)(c->kw / kvq_kvcache_unit_words(g->k_bits) * (kvq_kvcache_unit_channels(g->k_bits) / 2));
    size_t splits, chunk;
    v4::plan(nq, B * H * qgroups, (size_t)c->n_sm, max_splits, gq, npk, SMEM_MAX, &chunk, &splits);
    const int nhb_max = (int)(chunk / 64 + 2);
    const size_t nslots = splits + 1;
    KVQ_TRY(ensure_part(c, B * n_heads * nslots * (D + 2), err));
    DecP p;
    p.kcodes = c->kcodes; p.vcodes = c->vcodes; p.krow = c->krow; p.vrow = c->vrow; p.kent = c->kent; p.vent = c->vent;
    p.vscale = c->vscale; p.klut = c->klut; p.vlevels = c->vlevels; p.kz = c->kz; p.vz = c->vz;
    p.rlo = c->rlo; p.rhi = c->rhi; p.k16 = c->k16; p.v16 = c->v16; p.q = q; p.part = c->part; p.len = c->dlen;
    p.H = (int)H; p.D = (int)D; p.dpad = (int)c->dpad; p.np = (int)c->np; p.n_heads = (int)n_heads; p.g = gg; p.qgroups = qgroups;
    p.kw = (int)c->kw; p.vw = (int)c->vw; p.capq = (int)c->capq; p.n_exact = (int)c->n_exact; p.n_splits = (int)splits;
    p.chunk = (int)chunk; p.nhb_max = nhb_max; p.ent_cap = (int)c->ent_cap; p.nslots = (int)nslots;
    p.scale = scale > 0 ? scale : 1.0f / sqrtf((float)D);
    {
        // benchmark time breakdown only (kvcache_cuda_dec.cuh, KVQ_SKIP): phases to skip, the outputs then wrong
        const char *pe = getenv("KVQ_DEC_PROF");
        p.prof = pe ? atoi(pe) & 31 : 0;
    }
    // the kernel version: v5 (default) or v4 (KVQ_NUQ_KERNEL=v4, kept to time one against the other; the same results)
    int ver = 5;
    {
        const char *kv = getenv("KVQ_NUQ_KERNEL");
        if (kv && *kv) {
            if (!strcmp(kv, "v4")) ver = 4;
            else if (strcmp(kv, "v5")) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda attend: KVQ_NUQ_KERNEL: expected v4 or v5, found '%s'", kv);
        }
    }
    DecFn f = pick(g->k_bits, g->v_bits, gq, ver);
    if (!f) return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda attend: no kernel for %d/%d bits, %d query heads per block", g->k_bits, g->v_bits, gq);
    size_t sm = v4::smem_bytes(gq, npk, (int)chunk);
    if (sm > SMEM_MAX) return kvq_fail(err, KVQ_EUNSUPPORTED, "kvcache cuda attend: %zu bytes of shared memory needed", sm);
    f<<<dim3((unsigned)splits, (unsigned)(H * qgroups), (unsigned)B), v4::NT4, sm>>>(p);
    CKL();
    KVQ_TRY(exact_and_combine(c, q, n_heads, scale, out, nslots, err));
    if (sync) CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

extern "C" kvq_status kvq_kvcache_cuda_download(const kvq_kvcache_cuda *c, kvq_kvcache *dst, kvq_err *err)
{
    if (!c || !dst) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda download: NULL argument");
    kvq_kvcache_view v;
    kvq_kvcache_view_get(dst, &v);
    const kvq_kvcache_config *g = &c->cfg, *h = kvq_kvcache_config_of(dst);
    if (h->format != g->format || h->n_seqs != g->n_seqs || h->n_kv_heads != g->n_kv_heads || h->head_dim != g->head_dim ||
        h->max_tokens != g->max_tokens || h->k_bits != g->k_bits || h->v_bits != g->v_bits || h->n_sink != g->n_sink ||
        h->prefix_len != g->prefix_len || v.capq != c->capq || h->post_rope != g->post_rope ||
        (g->format == KVQ_KVCACHE_KIVI && (h->group != g->group || h->residual != g->residual || v.ring != c->ring)))
        return kvq_fail(err, KVQ_EMISMATCH, "kvcache cuda download: the CPU cache has another configuration");
    if (g->format == KVQ_KVCACHE_NUQ && v.ent_cap < c->ent_cap) return kvq_fail(err, KVQ_EMISMATCH, "kvcache cuda download: CPU outlier capacity %zu < GPU %zu", v.ent_cap, c->ent_cap);
    const size_t B = g->n_seqs, H = g->n_kv_heads, D = g->head_dim, ne = c->n_exact ? c->n_exact : 1;
    // the view's pointers are const for users; the cache owns them and this is its mirror
    CK(cudaMemcpy((void *)v.k16, c->k16, B * H * ne * D * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy((void *)v.v16, c->v16, B * H * ne * D * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy((void *)v.kcodes, c->kcodes, B * H * c->kw * c->capq * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy((void *)v.vcodes, c->vcodes, B * H * c->capq * c->vw * 4, cudaMemcpyDeviceToHost));
    if (g->format == KVQ_KVCACHE_KIVI) {
        const size_t C = c->C, G = g->group;
        CK(cudaMemcpy((void *)v.vscale, c->vscale, B * c->capq * (C / G) * 2 * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy((void *)v.kscale, c->kscale, B * c->ngk * C * 2 * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy((void *)v.kring, c->kring, B * c->ring * C * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy((void *)v.vring, c->vring, B * c->ring * C * 2, cudaMemcpyDeviceToHost));
        for (size_t s = 0; s < B; s++) {
            ((size_t *)v.len)[s] = c->len[s];
            ((size_t *)v.kq)[s] = c->kq[s];
            ((size_t *)v.vq)[s] = c->vq[s];
            ((bool *)v.prefix_set)[s] = c->prefix_set[s];
        }
        return KVQ_OK;
    }
    CK(cudaMemcpy((void *)v.vscale, c->vscale, B * c->capq * 2 * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy((void *)v.krow, c->krow, B * H * (c->capq + 1) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy((void *)v.vrow, c->vrow, B * H * (c->capq + 1) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy2D((void *)v.kent, v.ent_cap * 4, c->kent, c->ent_cap * 4, c->ent_cap * 4, B * H, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy2D((void *)v.vent, v.ent_cap * 4, c->vent, c->ent_cap * 4, c->ent_cap * 4, B * H, cudaMemcpyDeviceToHost));
    for (size_t s = 0; s < B; s++) {
        size_t *len = (size_t *)v.len, *kq = (size_t *)v.kq, *vq = (size_t *)v.vq;
        len[s] = c->len[s];
        kq[s] = vq[s] = c->len[s] > c->n_exact ? c->len[s] - c->n_exact : 0;
        ((bool *)v.prefix_set)[s] = c->prefix_set[s];
    }
    return KVQ_OK;
}

// ---- benchmark support ------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
__device__ __forceinline__ float unif11(uint64_t x) { return (float)(mix64(x) >> 40) * (2.0f / 16777216.0f) - 1.0f; }

static __global__ void fill_u32(uint32_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)mix64(seed ^ (i * 0x2545f4914f6cdd1dull));
}
static __global__ void fill_h(uint16_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __half_as_ushort(__float2half_rn(unif11(seed ^ (i * 0x2545f4914f6cdd1dull))));
}
static __global__ void fill_scale(float *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float u = unif11(seed ^ (i * 0x2545f4914f6cdd1dull));
        p[2 * i] = 0.1f * u;
        p[2 * i + 1] = 1.0f + 0.5f * u;
    }
}
// rows [nsh][R] (R = capq + 1) and entries [nsh][ent_cap]: per_row entries per token of the first nq tokens
static __global__ void fill_rows(uint32_t *row, uint32_t *ent, size_t nsh, size_t R, size_t nq, size_t ent_cap, int per_row, int D, uint64_t seed)
{
    const size_t n = nsh * (nq + 1);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t sh = i / (nq + 1), q = i % (nq + 1);
        row[sh * R + q] = (uint32_t)(q * per_row);
        if (q < nq)
            for (int j = 0; j < per_row; j++) {
                uint64_t r = mix64(seed ^ ((i * per_row + j) * 0x2545f4914f6cdd1dull));
                ent[sh * ent_cap + q * per_row + j] = (uint32_t)((r >> 20) % (uint64_t)D) << 16 |
                                                      __half_as_ushort(__float2half_rn(4.0f * unif11(r)));
            }
    }
}

extern "C" kvq_status kvq_cuda_fill_half(uint16_t *dev, size_t n, uint64_t seed, kvq_err *err)
{
    fill_h<<<1024, 256>>>(dev, n, seed);
    CKL();
    return KVQ_OK;
}

static __global__ void round_fp16_kernel(float *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __half2float(__ushort_as_half(f2h_sat(src[i])));
}

extern "C" kvq_status kvq_cuda_round_fp16(float *dst, const float *src, size_t n, kvq_err *err)
{
    if (!n) return KVQ_OK;
    const size_t nb = (n + 255) / 256;
    round_fp16_kernel<<<(unsigned)(nb < 4096 ? nb : 4096), 256>>>(dst, src, n);
    CKL();
    CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_alloc(void **out, size_t bytes, kvq_err *err)
{
    *out = nullptr;
    const cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *out = nullptr;
        return kvq_fail(err, KVQ_ENOMEM, "CUDA: cannot allocate %zu bytes of device memory: %s", bytes, cudaGetErrorString(e));
    }
    return KVQ_OK;
}

extern "C" void kvq_cuda_free(void *dev)
{
    if (dev) cudaFree(dev);
}

extern "C" kvq_status kvq_kvcache_cuda_fill_random(kvq_kvcache_cuda *c, size_t len, size_t per_row, uint64_t seed, kvq_err *err)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t B = g->n_seqs, H = g->n_kv_heads, D = g->head_dim;
    if (len > g->max_tokens) return kvq_fail(err, KVQ_EINVAL, "kvcache cuda fill: len %zu > max_tokens %zu", len, g->max_tokens);
    const size_t nq = len > c->n_exact ? len - c->n_exact : 0, ne = c->n_exact ? c->n_exact : 1;
    if (g->format == KVQ_KVCACHE_KIVI) {
        const size_t C = c->C, G = g->group;
        fill_u32<<<2048, 256>>>(c->kcodes, B * H * c->kw * c->capq, seed + 1);
        fill_u32<<<2048, 256>>>(c->vcodes, B * H * c->capq * c->vw, seed + 2);
        fill_scale<<<1024, 256>>>(c->vscale, B * c->capq * (C / G), seed + 3);
        fill_scale<<<1024, 256>>>(c->kscale, B * c->ngk * C, seed + 8);
        fill_h<<<256, 256>>>(c->k16, B * H * ne * D, seed + 4);
        fill_h<<<256, 256>>>(c->v16, B * H * ne * D, seed + 5);
        fill_h<<<256, 256>>>(c->kring, B * c->ring * C, seed + 6);
        fill_h<<<256, 256>>>(c->vring, B * c->ring * C, seed + 7);
        CKL();
        for (size_t s = 0; s < B; s++) {
            c->len[s] = len;
            c->prefix_set[s] = g->prefix_len > 0; // the exact rows (prefix included) are random too
            c->kq[s] = len > c->n_exact ? kvq_kivi_key_boundary(len - 1, G, g->residual, c->n_exact) - c->n_exact : 0;
            c->vq[s] = len > c->n_exact ? kvq_kivi_value_boundary(len - 1, g->residual, c->n_exact) - c->n_exact : 0;
            KVQ_TRY(upload_lengths(c, s, err));
        }
        CK(cudaDeviceSynchronize());
        return KVQ_OK;
    }
    if (nq * per_row > c->ent_cap) KVQ_TRY(grow_entries(c, nq * per_row, 0, len, err));
    fill_u32<<<2048, 256>>>(c->kcodes, B * H * c->kw * c->capq, seed + 1);
    fill_u32<<<2048, 256>>>(c->vcodes, B * H * c->capq * c->vw, seed + 2);
    fill_scale<<<1024, 256>>>(c->vscale, B * c->capq, seed + 3);
    fill_h<<<256, 256>>>(c->k16, B * H * ne * D, seed + 4);
    fill_h<<<256, 256>>>(c->v16, B * H * ne * D, seed + 5);
    CKL();
    fill_rows<<<2048, 256>>>(c->krow, c->kent, B * H, c->capq + 1, nq, c->ent_cap, (int)per_row, (int)D, seed + 6);
    fill_rows<<<2048, 256>>>(c->vrow, c->vent, B * H, c->capq + 1, nq, c->ent_cap, (int)per_row, (int)D, seed + 7);
    CKL();
    for (size_t s = 0; s < B; s++) {
        c->len[s] = len;
        for (size_t h = 0; h < H; h++) c->kused[s * H + h] = c->vused[s * H + h] = nq * per_row;
        c->since[s] = 0;
        c->kq[s] = c->vq[s] = nq;
        c->prefix_set[s] = g->prefix_len > 0;
        KVQ_TRY(upload_lengths(c, s, err));
    }
    c->stale = false;
    CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

extern "C" size_t kvq_kvcache_cuda_bytes_read(const kvq_kvcache_cuda *c)
{
    const size_t H = c->cfg.n_kv_heads, C = c->C;
    size_t b = 0;
    if (c->cfg.format == KVQ_KVCACHE_KIVI) {
        const size_t G = c->cfg.group;
        for (size_t s = 0; s < c->cfg.n_seqs; s++) {
            const size_t len = c->len[s], ne = len < c->n_exact ? len : c->n_exact, nq = len - ne, kq = c->kq[s], vq = c->vq[s];
            b += 2 * ne * C * 2;                                          // fp16 exact rows
            b += kq * H * c->kw * 4 + (kq / G) * C * 8;                   // key codes, (min, scale) per group and channel
            b += vq * H * c->vw * 4 + vq * (C / G) * 8;                   // value codes, (min, scale) per token and group
            b += (nq - kq) * C * 2 + (nq - vq) * C * 2;                   // fp16 residual
        }
        return b;
    }
    // after batched steps the host holds bounds: the exact counts from the device (one synchronisation; should that
    // fail, the counts of the last synchronisation, a lower bound)
    const size_t *ku = c->kused, *vu = c->vused;
    size_t *ex = c->stale ? (size_t *)malloc(2 * c->cfg.n_seqs * H * sizeof(size_t)) : nullptr;
    if (ex && read_used(c, ex, ex + c->cfg.n_seqs * H) == cudaSuccess) {
        ku = ex;
        vu = ex + c->cfg.n_seqs * H;
    }
    for (size_t s = 0; s < c->cfg.n_seqs; s++) {
        size_t len = c->len[s], ne = len < c->n_exact ? len : c->n_exact, nq = len - ne;
        b += 2 * ne * C * 2;                         // fp16 rows
        b += nq * H * (c->kw + c->vw) * 4 + nq * 8;  // codes, value (zp, r)
        b += 2 * (nq + 1) * H * 4;                   // sparse row pointers (K, V), per head
        for (size_t h = 0; h < H; h++) b += (ku[s * H + h] + vu[s * H + h]) * 4; // sparse entries
    }
    free(ex);
    return b;
}

// ---- fp16 baseline: split-K flash decoding with 16-byte loads ---------------------------------------
struct F16P {
    const uint16_t *k, *v;
    const float *q;
    float *part;
    int H, D, n_heads, g, qgroups, cap, len, n_splits, chunk;
    float scale;
};

template <int GQ>
__global__ void __launch_bounds__(128) fp16_decode(F16P p)
{
    extern __shared__ float4 sm4[];
    float *sm = (float *)sm4;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int s = blockIdx.z, h = blockIdx.y / p.qgroups, qg = blockIdx.y % p.qgroups;
    const int gq0 = qg * GQ, gn = min(GQ, p.g - gq0), D = p.D;
    const int q0 = blockIdx.x * p.chunk, q1 = min(q0 + p.chunk, p.len), n = q1 - q0;
    float *part0 = p.part + ((size_t)(s * p.n_heads + h * p.g + gq0) * p.n_splits + blockIdx.x) * (D + 2);
    const size_t pstride = (size_t)p.n_splits * (D + 2);
    float *sc = sm, *oacc = sc + GQ * p.chunk, *red = oacc + GQ * D, *stat = red + GQ * 8;
    const int L = D / 8, tpw = 32 / L, unit = lane % L, tsub = lane / L;
    for (int i = tid; i < GQ * D; i += blockDim.x) oacc[i] = 0.f;
    float qr[GQ][8];
#pragma unroll
    for (int gg = 0; gg < GQ; gg++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            qr[gg][j] = gg < gn ? p.q[((size_t)s * p.n_heads + h * p.g + gq0 + gg) * D + unit * 8 + j] * p.scale : 0.f;
    const uint4 *kb = (const uint4 *)(p.k + (size_t)(s * p.H + h) * p.cap * D);
    const uint4 *vb = (const uint4 *)(p.v + (size_t)(s * p.H + h) * p.cap * D);
    // the loop is uniform across the warp (shuffles below); tail lanes load nothing
#pragma unroll 4
    for (int tb = q0 + warp * tpw; tb < q1; tb += nw * tpw) {
        const int t = tb + tsub;
        const bool ok = t < q1;
        uint4 kk = make_uint4(0, 0, 0, 0);
        if (ok) kk = __ldg(kb + (size_t)t * L + unit);
        const __half2 *k2 = (const __half2 *)&kk;
        float a[GQ];
#pragma unroll
        for (int gg = 0; gg < GQ; gg++) a[gg] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __half22float2(k2[j]);
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) a[gg] += qr[gg][2 * j] * f.x + qr[gg][2 * j + 1] * f.y;
        }
#pragma unroll
        for (int gg = 0; gg < GQ; gg++) {
            for (int o = L >> 1; o; o >>= 1) a[gg] += __shfl_xor_sync(0xffffffffu, a[gg], o, L);
            if (ok && unit == 0) sc[gg * p.chunk + t - q0] = a[gg];
        }
    }
    __syncthreads();
    chunk_softmax<GQ>(sc, p.chunk, n, red, stat, stat + GQ);
    __syncthreads();
    if (tsub < tpw) {
        float acc[GQ][8];
#pragma unroll
        for (int gg = 0; gg < GQ; gg++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[gg][j] = 0.f;
#pragma unroll 4
        for (int t = q0 + warp * tpw + tsub; t < q1; t += nw * tpw) {
            const uint4 vv = __ldg(vb + (size_t)t * L + unit);
            const __half2 *v2 = (const __half2 *)&vv;
#pragma unroll
            for (int gg = 0; gg < GQ; gg++) {
                const float pp = sc[gg * p.chunk + t - q0];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = __half22float2(v2[j]);
                    acc[gg][2 * j] += pp * f.x;
                    acc[gg][2 * j + 1] += pp * f.y;
                }
            }
        }
#pragma unroll
        for (int gg = 0; gg < GQ; gg++)
#pragma unroll
            for (int j = 0; j < 8; j++) atomicAdd(&oacc[gg * D + unit * 8 + j], acc[gg][j]);
    }
    __syncthreads();
    for (int i = tid; i < gn * (D + 2); i += blockDim.x) {
        const int j = i / (D + 2), d = i % (D + 2);
        part0[j * pstride + d] = d == 0 ? stat[j] : d == 1 ? stat[GQ + j] : oacc[j * D + d - 2];
    }
}

typedef void (*F16Fn)(F16P);
static F16Fn f16_pick(int gq)
{
    switch (gq) {
    case 1: return fp16_decode<1>;
    case 2: return fp16_decode<2>;
    case 3: return fp16_decode<3>;
    case 4: return fp16_decode<4>;
    case 8: return fp16_decode<8>;
    default: return nullptr;
    }
}

static void f16_plan(const kvq_fp16_cache *f, size_t n_heads, size_t max_splits, int n_sm, int *gq, int *qgroups, size_t *splits, size_t *chunk)
{
    const int g = (int)(n_heads / f->n_kv_heads);
    *gq = g <= 4 ? g : 8;
    if (g > 8) *gq = 8;
    *qgroups = (g + *gq - 1) / *gq;
    size_t target = 4 * (size_t)n_sm, per = f->n_seqs * f->n_kv_heads * *qgroups, sp = (target + per - 1) / per;
    if (max_splits && sp > max_splits) sp = max_splits;
    if (sp < 1) sp = 1;
    size_t ch = f->len ? (f->len + sp - 1) / sp : NT;
    ch = (ch + NT - 1) / NT * NT;
    // chunks of at most 1024 positions: the scores' shared memory then allows more blocks per SM, so more loads in flight,
    // and more splits at B = 1 (on the H200 longer chunks were slower, most at SmolLM2-like heads; 512 slower except at
    // Llama-like heads B = 1 32K; 8 loads in flight per lane instead of 4 changed nothing)
    size_t maxch = 16384 / *gq / NT * NT;
    if (maxch > 1024) maxch = 1024;
    if (ch > maxch) ch = maxch;
    *chunk = ch;
    *splits = f->len ? (f->len + ch - 1) / ch : 1;
}

static int dev_sms(void)
{
    int dev = 0, n = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
}

extern "C" size_t kvq_fp16_attend_scratch(const kvq_fp16_cache *f, size_t n_heads, size_t max_splits)
{
    int gq, qg;
    size_t sp, ch;
    f16_plan(f, n_heads, max_splits, dev_sms(), &gq, &qg, &sp, &ch);
    return f->n_seqs * n_heads * sp * (f->head_dim + 2);
}

extern "C" kvq_status kvq_fp16_attend(const kvq_fp16_cache *f, const float *q, size_t n_heads, float scale, float *out,
                                      float *part, size_t max_splits, int sync, kvq_err *err)
{
    if (!f || !q || !out || !part) return kvq_fail(err, KVQ_EINVAL, "fp16 attend: NULL argument");
    const size_t L = f->head_dim / 8;
    if (f->head_dim % 8 || f->head_dim > 256 || (L & (L - 1)) || n_heads % f->n_kv_heads)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "fp16 attend: head_dim %zu (8 x a power of two, up to 256) / n_heads %zu", f->head_dim, n_heads);
    int gq, qg;
    size_t sp, ch;
    f16_plan(f, n_heads, max_splits, dev_sms(), &gq, &qg, &sp, &ch);
    F16P p;
    p.k = f->k16_dev; p.v = f->v16_dev; p.q = q; p.part = part;
    p.H = (int)f->n_kv_heads; p.D = (int)f->head_dim; p.n_heads = (int)n_heads; p.g = (int)(n_heads / f->n_kv_heads);
    p.qgroups = qg; p.cap = (int)f->cap; p.len = (int)f->len; p.n_splits = (int)sp; p.chunk = (int)ch;
    p.scale = scale > 0 ? scale : 1.0f / sqrtf((float)f->head_dim);
    F16Fn fn = f16_pick(gq);
    size_t sm = ((size_t)gq * ch + (size_t)gq * f->head_dim + gq * 8 + 2 * gq) * 4;
    CK(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX));
    fn<<<dim3((unsigned)sp, (unsigned)(f->n_kv_heads * qg), (unsigned)f->n_seqs), NT, sm>>>(p);
    CKL();
    // a separate combine: merging in the fp16 kernel's last block per row (as kivi_generic does) was slower on the H200
    // (at SmolLM2-like heads B = 1 the last block merges 176 splits of 3 query heads in turn)
    combine<<<dim3((unsigned)n_heads, (unsigned)f->n_seqs), f->head_dim < 128 ? 64 : 128>>>(part, out, (int)n_heads, (int)f->head_dim, (int)sp, (int)sp);
    CKL();
    if (sync) CK(cudaDeviceSynchronize());
    return KVQ_OK;
}

// ---- cuBLAS baseline (dlopen) -----------------------------------------------------------------------
struct kvq_cublas {
    void *lib;
    cublasHandle_t h;
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *, const void *,
                           cudaDataType, int, long long, const void *, cudaDataType, int, long long, const void *, void *,
                           cudaDataType, int, long long, int, cublasComputeType_t, cublasGemmAlgo_t);
};

extern "C" kvq_status kvq_cublas_create(kvq_cublas **out, kvq_err *err)
{
    *out = nullptr;
    void *lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return kvq_fail(err, KVQ_EUNSUPPORTED, "cuBLAS: cannot load libcublas.so.13: %s", dlerror());
    kvq_cublas *b = (kvq_cublas *)calloc(1, sizeof *b);
    if (!b) { dlclose(lib); return kvq_fail(err, KVQ_ENOMEM, "cuBLAS: cannot allocate"); }
    b->lib = lib;
    b->create = (decltype(b->create))dlsym(lib, "cublasCreate_v2");
    b->destroy = (decltype(b->destroy))dlsym(lib, "cublasDestroy_v2");
    b->gemm = (decltype(b->gemm))dlsym(lib, "cublasGemmStridedBatchedEx");
    if (!b->create || !b->destroy || !b->gemm) { dlclose(lib); free(b); return kvq_fail(err, KVQ_EUNSUPPORTED, "cuBLAS: missing symbols"); }
    if (b->create(&b->h) != CUBLAS_STATUS_SUCCESS) { dlclose(lib); free(b); return kvq_fail(err, KVQ_EIO, "cuBLAS: cublasCreate failed"); }
    *out = b;
    return KVQ_OK;
}

extern "C" void kvq_cublas_free(kvq_cublas *b)
{
    if (!b) return;
    b->destroy(b->h);
    dlclose(b->lib);
    free(b);
}

extern "C" size_t kvq_cublas_attend_scratch(const kvq_fp16_cache *f, size_t n_heads)
{
    // q16 [B][n_heads][D] half, S [B*H][g][len] float, P [B*H][g][len] half
    return f->n_seqs * n_heads * f->head_dim * 2 + f->n_seqs * n_heads * f->len * 6 + 256;
}

static __global__ void q_to_half(const float *q, __half *o, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) o[i] = __float2half_rn(q[i]);
}

// softmax over each row of S (len floats) into fp16 P: one block per row
static __global__ void softmax_rows(const float *S, __half *P, int len)
{
    __shared__ float red[32];
    const float *s = S + (size_t)blockIdx.x * len;
    __half *p = P + (size_t)blockIdx.x * len;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float m = -INFINITY;
    for (int i = tid; i < len; i += blockDim.x) m = fmaxf(m, s[i]);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < nw; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float l = 0;
    for (int i = tid; i < len; i += blockDim.x) l += expf(s[i] - m);
    for (int o = 16; o; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    l = 0;
    for (int w = 0; w < nw; w++) l += red[w];
    const float il = 1.0f / l;
    for (int i = tid; i < len; i += blockDim.x) p[i] = __float2half_rn(expf(s[i] - m) * il);
}

extern "C" kvq_status kvq_cublas_attend(kvq_cublas *b, const kvq_fp16_cache *f, const float *q, size_t n_heads, float scale,
                                        float *out, void *scratch, int sync, kvq_err *err)
{
    if (!b || !f || !q || !out || !scratch) return kvq_fail(err, KVQ_EINVAL, "cuBLAS attend: NULL argument");
    const size_t B = f->n_seqs, H = f->n_kv_heads, D = f->head_dim, N = f->len, g = n_heads / H;
    if (!N || n_heads % H) return kvq_fail(err, KVQ_EINVAL, "cuBLAS attend: empty cache or n_heads %zu not a multiple of %zu", n_heads, H);
    __half *q16 = (__half *)scratch;
    float *S = (float *)((char *)scratch + ((B * n_heads * D * 2 + 255) / 256) * 256);
    __half *P = (__half *)(S + B * n_heads * N);
    q_to_half<<<256, 256>>>(q, q16, B * n_heads * D);
    CKL();
    const float alpha = scale > 0 ? scale : 1.0f / sqrtf((float)D), one = 1.0f, zero = 0.0f;
    cublasStatus_t st = b->gemm(b->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)g, (int)D, &alpha, f->k16_dev, CUDA_R_16F, (int)D,
                                (long long)(f->cap * D), q16, CUDA_R_16F, (int)D, (long long)(g * D), &zero, S, CUDA_R_32F, (int)N,
                                (long long)(N * g), (int)(B * H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return kvq_fail(err, KVQ_EIO, "cuBLAS: scores GEMM failed (%d)", (int)st);
    softmax_rows<<<(unsigned)(B * n_heads), 256>>>(S, P, (int)N);
    CKL();
    st = b->gemm(b->h, CUBLAS_OP_N, CUBLAS_OP_N, (int)D, (int)g, (int)N, &one, f->v16_dev, CUDA_R_16F, (int)D, (long long)(f->cap * D), P,
                 CUDA_R_16F, (int)N, (long long)(N * g), &zero, out, CUDA_R_32F, (int)D, (long long)(g * D), (int)(B * H),
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return kvq_fail(err, KVQ_EIO, "cuBLAS: output GEMM failed (%d)", (int)st);
    if (sync) CK(cudaDeviceSynchronize());
    return KVQ_OK;
}
