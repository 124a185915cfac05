/* bench_decode_step.c — the decode step of a Llama-2-7B-shaped model (random bf16 weights) on the packed
 * KV cache (kernels/kvcache/kvcache_cuda.h: nuq2/3/4 with 1% dense-and-sparse outliers, kivi2) against an
 * fp16 cache, batch B sequences of N cached positions each (issue 46). Run by scripts/gpu_decode_step.sh;
 * `bench_decode_step --help` lists the options.
 *
 * The step (one token per sequence, all B sequences at the same position N): token embedding (bf16 table);
 * per layer RMSNorm, Q/K/V projections (one cuBLAS strided-batched bf16 GEMM, fp32 accumulation and output:
 * cublasGemmStridedBatchedEx; the activation rounded to bf16 first), RoPE on q (and on k for the fp16 cache;
 * NUQ appends pre-RoPE keys and rotates after dequantization; KIVI, configured with post-RoPE keys and the
 * model's RoPE, rotates the pre-RoPE keys it is given before quantizing them), the new token of every sequence appended to the
 * layer's cache (kvq_kvcache_cuda_append_step, one call for all B sequences; the fp16 cache: one kernel writing the fp16 row), decode attention (kvq_kvcache_cuda_attend; the fp16 cache: kvq_fp16_attend,
 * the tuned split-K kernel), O projection, residual, RMSNorm, SwiGLU MLP (gate and up as one batched GEMM),
 * residual; final RMSNorm and the LM head (32000 logits per sequence). Activations fp32; RMSNorm, SwiGLU,
 * bf16 rounding and the embedding gather are the CUDA forward's kernels (kernels/cuda/cuda_ops.cuh).
 * Weights: uniform in ±sqrt(3 / fan_in) (unit-variance outputs), generated on the device; norm gains 1.
 *
 * The cache before the step: every layer filled to N positions by kvq_kvcache_cuda_fill_random (NUQ: 1 fp16
 * sink row, random codes and value scales, 1 sparse entry per (token, KV head) row for K and for V; KIVI:
 * codes, scales and the residual ring) or kvq_cuda_fill_half (fp16). Synthetic, as issue 46 allows; the
 * appended tokens are the model's real K/V. NUQ tables: 2^b levels evenly spaced in [-1, 1], key thresholds
 * ±2.576 per channel (the 1% two-sided tail of the unit-variance keys).
 *
 * Timing (CUDA events on the default stream): WARM steps, then the median of R steps (each appends one token,
 * so the timed steps run at N + WARM .. N + WARM + R − 1 positions); tokens/s = B / step time. Then R more
 * steps with events between the phases, medians of: GEMMs (all weight reads: QKV, O, gate/up, down, LM head),
 * cache append (RoPE of k, the fp16 row write or kvq_kvcache_cuda_append_step: asynchronous, row pointers advanced
 * on the device; it synchronises only when its bound on the outlier store's use could exceed the capacity, rarely:
 * kvcache_cuda.h), attention, the rest (embedding, norms, bf16 rounding, RoPE of q,
 * SwiGLU, residual adds). No L2 flush: a step reads > 13 GB.
 * Bytes: weights read (every GEMM weight, the embedding rows) + what attention reads from the caches
 * (kvq_kvcache_cuda_bytes_read; fp16: K and V of every position); the size-matched bound is those bytes at
 * the device-to-device copy bandwidth measured in the same run (2 GiB buffers, read + write), and
 * %bound = bound / step time. Device memory: cudaMemGetInfo's used bytes with the row's caches allocated.
 *
 * Rows: fp16, nuq4, nuq3, nuq2 (1% outliers, 1 sink), kivi2 (G = 128 = head_dim, R = 128) at N = 4K, 32K,
 * 128K and the longest N (a multiple of 4096) whose caches fit the free memory (tests/gpu/decode_plan.h, 2 GiB
 * margin), B = 1 and 32; a row that does not fit is printed as skipped with the bytes it needs and the bytes
 * free. --moonshot: nuq2 at B = 1, N = 1M and the longest N. Ratios to fp16 are to the fp16 row of the same
 * (B, N) in this run ("-" when it did not fit).
 *
 * Correctness, before timing (any failure exits 1; any CUDA / cuBLAS error exits 2 naming the call):
 *  1. the GEMM path (bf16 rounding of x, cublasGemmEx and the strided-batched form) against a float64 host
 *     product of the same bf16 values, small shapes: relative L2 <= 1e-5;
 *  2. one layer's step at small N (B = 2, N = 200) for every format: the pre-step cache downloaded
 *     (kvq_kvcache_cuda_download) into a CPU cache (kernels/kvcache/kvcache.h), the layer's own K/V appended
 *     there (kvq_kvcache_append), its q rotated by kvq_rope_rotate and
 *     kvq_kvcache_attend (float64) against the device's attention output: relative L2 <= 2e-5 (the GPU
 *     cache's stated tolerance, kvcache_cuda.h); the device RoPE of q against kvq_rope_rotate: relative
 *     L2 <= 1e-6; fp16: the appended row against fp16(kvq_rope_rotate(k)) (at most 1 fp16 ulp apart) and
 *     kvq_fp16_attend against a float64 attention over the downloaded fp16 rows: relative L2 <= 1e-4;
 *  3. every timed row: the logits of its last step are finite. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_decode_step_kern.h"
#include "decode_plan.h"
#include "half.h"
#include "kvcache.h"
#include "kvcache_cuda.h"

#define CU(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "CUDA error in %s (%s:%d): %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); exit(2); } } while (0)
#define KD(x) do { int e_ = (x); if (e_) { fprintf(stderr, "CUDA error in %s (%s:%d): %s\n", #x, __FILE__, __LINE__, cudaGetErrorString((cudaError_t)e_)); exit(2); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "cuBLAS error in %s (%s:%d): %s\n", #x, __FILE__, __LINE__, cublasGetStatusString(s_)); exit(2); } } while (0)
#define OK(x) do { kvq_err err_; kvq_status s_ = (x); if (s_ != KVQ_OK) { fprintf(stderr, "error in %s (%s:%d): %s\n", #x, __FILE__, __LINE__, err_.msg); exit(2); } } while (0)
#define ERR (&err_)

enum { F_FP16 = 0, F_NUQ4, F_NUQ3, F_NUQ2, F_KIVI2, N_FMT };
static const char *const fmt_name[N_FMT] = {"fp16", "nuq4-1%", "nuq3-1%", "nuq2-1%", "kivi2"};
static const double ROPE_THETA = 10000.0, KEY_THR = 2.576;
enum { CAT_GEMM = 0, CAT_APPEND, CAT_ATTN, CAT_REST, N_CAT, MAX_MARKS = 1024 };

/* ---- the model ---------------------------------------------------------------------------------------------- */
typedef struct {
    kvq_dp_model m;
    cublasHandle_t h;
    uint16_t **wl;   /* per layer: Wq|Wk|Wv [3][d][d], Wo [d][d], W_gate|W_up [2][ffn][d], W_down [d][ffn] (bf16) */
    uint16_t *emb, *head;
    float *ones;     /* RMSNorm gains (1) */
    size_t Bmax;
    float *x, *xn, *qkv, *qr, *kr, *att, *o, *gu, *hm, *logits;
    uint16_t *xb;
    int *tok, *flag;
} model;

static size_t off_wo(const kvq_dp_model *m) { return 3 * m->dim * m->dim; }
static size_t off_wgu(const kvq_dp_model *m) { return 4 * m->dim * m->dim; }
static size_t off_wd(const kvq_dp_model *m) { return 4 * m->dim * m->dim + 2 * m->ffn * m->dim; }
static size_t layer_params(const kvq_dp_model *m) { return 4 * m->dim * m->dim + 3 * m->ffn * m->dim; }

static void model_init(model *M, size_t Bmax)
{
    memset(M, 0, sizeof *M);
    M->m = kvq_dp_llama2_7b();
    const kvq_dp_model *m = &M->m;
    const size_t d = m->dim, f = m->ffn, V = m->vocab;
    M->Bmax = Bmax;
    CB(cublasCreate(&M->h));
    CB(cublasSetStream(M->h, 0));
    M->wl = calloc(m->n_layers, sizeof *M->wl);
    if (!M->wl) { fprintf(stderr, "out of host memory\n"); exit(2); }
    for (size_t l = 0; l < m->n_layers; l++) {
        CU(cudaMalloc((void **)&M->wl[l], layer_params(m) * 2));
        uint16_t *w = M->wl[l];
        const float sd = sqrtf(3.0f / (float)d), sf = sqrtf(3.0f / (float)f);
        KD(kvq_ds_fill_bf16(w, off_wd(m), sd, 1000 + l));             /* Wq, Wk, Wv, Wo, gate, up: fan-in d */
        KD(kvq_ds_fill_bf16(w + off_wd(m), d * f, sf, 2000 + l));     /* W_down: fan-in ffn */
    }
    CU(cudaMalloc((void **)&M->emb, V * d * 2));
    CU(cudaMalloc((void **)&M->head, V * d * 2));
    KD(kvq_ds_fill_bf16(M->emb, V * d, 1.0f, 7));
    KD(kvq_ds_fill_bf16(M->head, V * d, sqrtf(3.0f / (float)d), 8));
    CU(cudaMalloc((void **)&M->ones, d * 4));
    KD(kvq_ds_fill_f32(M->ones, d, 1.0f));
    const size_t B = Bmax;
    CU(cudaMalloc((void **)&M->x, B * d * 4));
    CU(cudaMalloc((void **)&M->xn, B * d * 4));
    CU(cudaMalloc((void **)&M->qkv, 3 * B * d * 4));
    CU(cudaMalloc((void **)&M->qr, B * d * 4));
    CU(cudaMalloc((void **)&M->kr, B * d * 4));
    CU(cudaMalloc((void **)&M->att, B * d * 4));
    CU(cudaMalloc((void **)&M->o, B * d * 4));
    CU(cudaMalloc((void **)&M->gu, 2 * B * f * 4));
    CU(cudaMalloc((void **)&M->hm, B * f * 4));
    CU(cudaMalloc((void **)&M->logits, B * V * 4));
    CU(cudaMalloc((void **)&M->xb, B * f * 2));
    CU(cudaMalloc((void **)&M->tok, B * sizeof(int)));
    CU(cudaMalloc((void **)&M->flag, sizeof(int)));
    CU(cudaDeviceSynchronize());
}

static void model_free(model *M)
{
    for (size_t l = 0; l < M->m.n_layers; l++) cudaFree(M->wl[l]);
    free(M->wl);
    void *p[] = {M->emb, M->head, M->ones, M->x, M->xn, M->qkv, M->qr, M->kr, M->att, M->o, M->gu, M->hm, M->logits, M->xb, M->tok, M->flag};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
    cublasDestroy(M->h);
}

/* y[batch][B][out] = x[B][in] · W[batch][out][in]^T: the row-major [out][in] weights seen column-major as
 * W^T, x rounded to bf16 into xb (done by the caller), fp32 accumulation and output */
static void gemm(cublasHandle_t h, const uint16_t *W, const uint16_t *xb, float *y, int in, int out, int B, int batch)
{
    const float one = 1, zero = 0;
    if (batch == 1)
        CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, B, in, &one, W, CUDA_R_16BF, in, xb, CUDA_R_16BF, in, &zero, y, CUDA_R_32F,
                        out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, B, in, &one, W, CUDA_R_16BF, in, (long long)out * in, xb, CUDA_R_16BF,
                                      in, 0, &zero, y, CUDA_R_32F, out, (long long)out * B, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* ---- caches -------------------------------------------------------------------------------------------------- */
typedef struct {
    int fmt;
    size_t B, cap, len;               /* len: positions every sequence holds */
    kvq_kvcache_cuda **pc;            /* packed: one per layer */
    kvq_kvcache_config cfg;
    float *lev, *lo, *hi;
    kvq_fp16_cache *fc;               /* fp16: one per layer */
    float *part;                      /* fp16 attention partials */
} caches;

static kvq_dp_cache plan_of(int fmt, size_t N, size_t extra)
{
    kvq_dp_cache c;
    memset(&c, 0, sizeof c);
    if (fmt == F_FP16) c.format = KVQ_DP_FP16;
    else if (fmt == F_KIVI2) { c.format = KVQ_DP_KIVI; c.bits = 2; c.group = 128; c.residual = 128; }
    else { c.format = KVQ_DP_NUQ; c.bits = fmt == F_NUQ4 ? 4 : fmt == F_NUQ3 ? 3 : 2; c.n_sink = 1; c.ent_cap = kvq_dp_ent_cap(N, 1, extra); }
    return c;
}

static void caches_config(caches *C, const kvq_dp_model *m, int fmt, size_t B, size_t N, size_t extra)
{
    memset(C, 0, sizeof *C);
    C->fmt = fmt;
    C->B = B;
    C->cap = N + extra;
    if (fmt == F_FP16) return;
    const size_t H = m->n_kv_heads, D = m->head_dim;
    kvq_kvcache_config *g = &C->cfg;
    g->n_seqs = B; g->n_kv_heads = H; g->head_dim = D; g->max_tokens = C->cap;
    g->rope.rope_dim = D; g->rope.rope_theta = ROPE_THETA;
    if (fmt == F_KIVI2) {
        g->format = KVQ_KVCACHE_KIVI; g->k_bits = g->v_bits = 2; g->group = 128; g->residual = 128; g->post_rope = true;
        return;
    }
    const int bits = fmt == F_NUQ4 ? 4 : fmt == F_NUQ3 ? 3 : 2;
    const size_t nl = (size_t)1 << bits;
    C->lev = malloc(nl * sizeof(float));
    C->lo = malloc(H * D * sizeof(float));
    C->hi = malloc(H * D * sizeof(float));
    if (!C->lev || !C->lo || !C->hi) { fprintf(stderr, "out of host memory\n"); exit(2); }
    for (size_t j = 0; j < nl; j++) C->lev[j] = -1.0f + 2.0f * (float)j / (float)(nl - 1);
    for (size_t c = 0; c < H * D; c++) { C->lo[c] = (float)-KEY_THR; C->hi[c] = (float)KEY_THR; }
    g->format = KVQ_KVCACHE_NUQ; g->k_bits = g->v_bits = bits; g->n_sink = 1; g->outlier_frac = 0.01;
    g->k_tables = g->v_tables = 1; g->k_levels = g->v_levels = C->lev; g->k_lower = C->lo; g->k_upper = C->hi;
    g->outlier_cap = kvq_dp_ent_cap(N, 1, extra);
}

static void caches_free(caches *C, size_t L)
{
    for (size_t l = 0; C->fc && l < L; l++) {
        cudaFree((void *)C->fc[l].k16_dev);
        cudaFree((void *)C->fc[l].v16_dev);
    }
    for (size_t l = 0; C->pc && l < L; l++) kvq_kvcache_cuda_free(C->pc[l]);
    if (C->part) cudaFree(C->part);
    free(C->fc);
    free(C->pc);
    free(C->lev);
    free(C->lo);
    free(C->hi);
    memset(C, 0, sizeof *C);
}

/* a device allocation that may fail for memory (the row is then skipped): 0, or 1 with the reason in why */
static int try_alloc(void **p, size_t bytes, const char *what, char *why, size_t nwhy)
{
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return 0;
    *p = NULL;
    if (e != cudaErrorMemoryAllocation) CU(e);
    (void)cudaGetLastError();
    snprintf(why, nwhy, "%s: cudaMalloc of %zu bytes: %s", what, bytes, cudaGetErrorString(e));
    return 1;
}

/* allocate and fill every layer's cache to N positions (seed per layer). 0, or 1 when the device memory ran out
 * (why says where; everything allocated is freed again); any other failure is fatal */
static int caches_create(caches *C, const kvq_dp_model *m, int fmt, size_t B, size_t N, size_t extra, char *why, size_t nwhy)
{
    caches_config(C, m, fmt, B, N, extra);
    const size_t L = m->n_layers, H = m->n_kv_heads, D = m->head_dim;
    C->len = N;
    if (fmt == F_FP16) {
        C->fc = calloc(L, sizeof *C->fc);
        if (!C->fc) { fprintf(stderr, "out of host memory\n"); exit(2); }
        for (size_t l = 0; l < L; l++) {
            uint16_t *k = NULL, *v = NULL;
            const size_t n = B * H * C->cap * D;
            if (try_alloc((void **)&k, n * 2, "fp16 keys", why, nwhy) || try_alloc((void **)&v, n * 2, "fp16 values", why, nwhy)) {
                if (k) cudaFree(k);
                caches_free(C, L);
                return 1;
            }
            C->fc[l] = (kvq_fp16_cache){B, H, D, C->cap, N, k, v};
            OK(kvq_cuda_fill_half(k, n, 11 + 2 * l, ERR));
            OK(kvq_cuda_fill_half(v, n, 12 + 2 * l, ERR));
        }
        kvq_fp16_cache f = C->fc[0];
        size_t part = 0; /* the split count follows the length: the most any length of the row asks for */
        for (f.len = N; f.len <= C->cap; f.len++) {
            const size_t s = kvq_fp16_attend_scratch(&f, m->n_heads, 0);
            if (s > part) part = s;
        }
        if (try_alloc((void **)&C->part, part * 4, "fp16 attention partials", why, nwhy)) { caches_free(C, L); return 1; }
        CU(cudaDeviceSynchronize());
        return 0;
    }
    C->pc = calloc(L, sizeof *C->pc);
    if (!C->pc) { fprintf(stderr, "out of host memory\n"); exit(2); }
    for (size_t l = 0; l < L; l++) {
        kvq_err e;
        kvq_status st = kvq_kvcache_cuda_create(&C->pc[l], &C->cfg, &e);
        if (st == KVQ_OK) st = kvq_kvcache_cuda_fill_random(C->pc[l], N, 1, 99 + 7 * l, &e);
        if (st == KVQ_ENOMEM) {
            snprintf(why, nwhy, "layer %zu: %.400s", l, e.msg);
            caches_free(C, L);
            return 1;
        }
        if (st != KVQ_OK) { fprintf(stderr, "error in the cache of layer %zu: %s\n", l, e.msg); exit(2); }
    }
    return 0;
}

/* bytes attention reads from all layers' caches in their current state */
static double caches_bytes_read(const caches *C, const kvq_dp_model *m)
{
    if (C->fmt == F_FP16) return (double)m->n_layers * 2.0 * C->B * m->n_kv_heads * C->len * m->head_dim * 2;
    double b = 0;
    for (size_t l = 0; l < m->n_layers; l++) b += (double)kvq_kvcache_cuda_bytes_read(C->pc[l]);
    return b;
}

/* ---- the step ------------------------------------------------------------------------------------------------ */
typedef struct {
    cudaEvent_t ev[MAX_MARKS];
    int cat[MAX_MARKS], n;
} marks;

static void mark(marks *mk, int cat)
{
    if (!mk) return;
    if (mk->n >= MAX_MARKS) { fprintf(stderr, "bench_decode_step: too many phase marks\n"); exit(2); }
    CU(cudaEventRecord(mk->ev[mk->n], 0));
    mk->cat[mk->n++] = cat;
}

/* what the correctness check keeps of one layer: host copies of pre-RoPE q, k, v, the device's rotated q, the
 * attention output ([B][d] each) */
typedef struct {
    size_t layer;
    float *q, *k, *v, *qr, *att;
} capture;

static void dl(float *dst, const float *src, size_t n) { CU(cudaMemcpy(dst, src, n * 4, cudaMemcpyDeviceToHost)); }

/* one decode step of all B sequences at position C->len; appends one position to every cache */
static void step(model *M, caches *C, marks *mk, capture *cap, unsigned tok_seed)
{
    const kvq_dp_model *m = &M->m;
    const int B = (int)C->B, d = (int)m->dim, f = (int)m->ffn, H = (int)m->n_kv_heads, D = (int)m->head_dim, nh = (int)m->n_heads;
    const size_t kvd = (size_t)H * D, pos = C->len;
    {
        int tok[64];
        for (int b = 0; b < B; b++) tok[b] = (int)((tok_seed * 2654435761u + 40503u * (unsigned)b) % (unsigned)m->vocab);
        CU(cudaMemcpyAsync(M->tok, tok, B * sizeof(int), cudaMemcpyHostToDevice, 0));
    }
    mark(mk, CAT_REST);
    KD(kvq_ds_embed_bf16(M->x, M->emb, M->tok, B, d));
    float *q = M->qkv, *k = M->qkv + (size_t)B * d, *v = M->qkv + 2 * (size_t)B * d;
    for (size_t l = 0; l < m->n_layers; l++) {
        const uint16_t *w = M->wl[l];
        KD(kvq_ds_rmsnorm(M->xn, M->x, M->ones, B, d, 1e-5f));
        KD(kvq_ds_to_bf16(M->xb, M->xn, (size_t)B * d));
        mark(mk, CAT_GEMM);
        gemm(M->h, w, M->xb, M->qkv, d, d, B, 3);
        mark(mk, CAT_REST);
        KD(kvq_ds_rope(M->qr, q, B, nh, D, (long)pos, ROPE_THETA));
        mark(mk, CAT_APPEND);
        if (C->fmt == F_FP16) {
            KD(kvq_ds_rope(M->kr, k, B, H, D, (long)pos, ROPE_THETA));
            KD(kvq_ds_f16_put((uint16_t *)C->fc[l].k16_dev, (uint16_t *)C->fc[l].v16_dev, M->kr, v, B, H, D, C->cap, pos));
            C->fc[l].len = pos + 1;
            mark(mk, CAT_ATTN);
            OK(kvq_fp16_attend(&C->fc[l], M->qr, (size_t)nh, 0, M->att, C->part, 0, 0, ERR));
        } else {
            /* pre-RoPE keys: NUQ quantizes them so and rotates after dequantization; KIVI (post_rope with the model's
             * RoPE in its configuration) rotates them on the way in, before quantizing (kvcache_cuda.h) */
            OK(kvq_kvcache_cuda_append_step(C->pc[l], k, v, ERR));
            mark(mk, CAT_ATTN);
            OK(kvq_kvcache_cuda_attend(C->pc[l], M->qr, (size_t)nh, 0, M->att, 0, 0, ERR));
        }
        if (cap && cap->layer == l) {
            CU(cudaDeviceSynchronize());
            dl(cap->q, q, (size_t)B * d);
            dl(cap->k, k, (size_t)B * kvd);
            dl(cap->v, v, (size_t)B * kvd);
            dl(cap->qr, M->qr, (size_t)B * d);
            dl(cap->att, M->att, (size_t)B * d);
        }
        mark(mk, CAT_REST);
        KD(kvq_ds_to_bf16(M->xb, M->att, (size_t)B * d));
        mark(mk, CAT_GEMM);
        gemm(M->h, w + off_wo(m), M->xb, M->o, d, d, B, 1);
        mark(mk, CAT_REST);
        KD(kvq_ds_add(M->x, M->o, (size_t)B * d));
        KD(kvq_ds_rmsnorm(M->xn, M->x, M->ones, B, d, 1e-5f));
        KD(kvq_ds_to_bf16(M->xb, M->xn, (size_t)B * d));
        mark(mk, CAT_GEMM);
        gemm(M->h, w + off_wgu(m), M->xb, M->gu, d, f, B, 2);
        mark(mk, CAT_REST);
        KD(kvq_ds_swiglu(M->hm, M->gu, M->gu + (size_t)B * f, (size_t)B * f));
        KD(kvq_ds_to_bf16(M->xb, M->hm, (size_t)B * f));
        mark(mk, CAT_GEMM);
        gemm(M->h, w + off_wd(m), M->xb, M->o, f, d, B, 1);
        mark(mk, CAT_REST);
        KD(kvq_ds_add(M->x, M->o, (size_t)B * d));
    }
    KD(kvq_ds_rmsnorm(M->xn, M->x, M->ones, B, d, 1e-5f));
    KD(kvq_ds_to_bf16(M->xb, M->xn, (size_t)B * d));
    mark(mk, CAT_GEMM);
    gemm(M->h, M->head, M->xb, M->logits, d, (int)m->vocab, B, 1);
    mark(mk, N_CAT);
    C->len = pos + 1;
}

/* ---- correctness checks -------------------------------------------------------------------------------------- */
static double rel_l2(const float *a, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int report(const char *what, double got, double tol)
{
    const int ok = got <= tol && !isnan(got);
    printf("  %-62s %.2e (tolerance %.0e) %s\n", what, got, tol, ok ? "ok" : "FAIL");
    return ok ? 0 : 1;
}

static int check_gemm(cublasHandle_t h)
{
    const int in = 264, out = 300, B = 3, batch = 2;
    const size_t nw = (size_t)batch * out * in;
    uint16_t *W, *xb;
    float *x, *y;
    CU(cudaMalloc((void **)&W, nw * 2));
    CU(cudaMalloc((void **)&xb, (size_t)B * in * 2));
    CU(cudaMalloc((void **)&x, (size_t)B * in * 4));
    CU(cudaMalloc((void **)&y, (size_t)batch * B * out * 4));
    KD(kvq_ds_fill_bf16(W, nw, 0.1f, 5));
    float *hx = malloc((size_t)B * in * 4), *hy = malloc((size_t)batch * B * out * 4);
    uint16_t *hw = malloc(nw * 2), *hxb = malloc((size_t)B * in * 2);
    double *ref = malloc((size_t)batch * B * out * 8);
    if (!hx || !hy || !hw || !hxb || !ref) { fprintf(stderr, "out of host memory\n"); exit(2); }
    for (int i = 0; i < B * in; i++) hx[i] = (float)(sin(0.37 * i) * 3.0 + 0.01 * i);
    CU(cudaMemcpy(x, hx, (size_t)B * in * 4, cudaMemcpyHostToDevice));
    KD(kvq_ds_to_bf16(xb, x, (size_t)B * in));
    CU(cudaMemcpy(hw, W, nw * 2, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hxb, xb, (size_t)B * in * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    size_t nbf = 0;
    for (int i = 0; i < B * in; i++) nbf += hxb[i] != kvq_f32_to_bf16(hx[i]);
    printf("  bf16 rounding of the activations: %zu of %d differ from kvq_f32_to_bf16 %s\n", nbf, B * in, nbf ? "FAIL" : "ok");
    bad += nbf != 0;
    for (int g = 0; g < batch; g++)
        for (int b = 0; b < B; b++)
            for (int o = 0; o < out; o++) {
                double s = 0;
                for (int i = 0; i < in; i++) s += (double)kvq_bf16_to_f32(hw[((size_t)g * out + o) * in + i]) * kvq_bf16_to_f32(hxb[b * in + i]);
                ref[((size_t)g * B + b) * out + o] = s;
            }
    gemm(h, W, xb, y, in, out, B, 1);
    CU(cudaMemcpy(hy, y, (size_t)B * out * 4, cudaMemcpyDeviceToHost));
    bad += report("GEMM (cublasGemmEx bf16, 300x264, B=3) vs float64: rel L2", rel_l2(hy, ref, (size_t)B * out), 1e-5);
    gemm(h, W, xb, y, in, out, B, batch);
    CU(cudaMemcpy(hy, y, (size_t)batch * B * out * 4, cudaMemcpyDeviceToHost));
    bad += report("GEMM (strided-batched x2, 300x264, B=3) vs float64: rel L2", rel_l2(hy, ref, (size_t)batch * B * out), 1e-5);
    cudaFree(W); cudaFree(xb); cudaFree(x); cudaFree(y);
    free(hx); free(hy); free(hw); free(hxb); free(ref);
    return bad;
}

/* float64 attention of q [nh][D] over n rows of fp16 K, V ([n][D] of one KV head, stride D) */
static void attend_ref(const float *q, const uint16_t *K, const uint16_t *V, size_t n, size_t D, double *out)
{
    double *s = malloc(n * sizeof *s), mx = -INFINITY, sum = 0;
    if (!s) { fprintf(stderr, "out of host memory\n"); exit(2); }
    for (size_t t = 0; t < n; t++) {
        double a = 0;
        for (size_t c = 0; c < D; c++) a += (double)q[c] * kvq_f16_to_f32(K[t * D + c]);
        s[t] = a / sqrt((double)D);
        if (s[t] > mx) mx = s[t];
    }
    for (size_t t = 0; t < n; t++) sum += (s[t] = exp(s[t] - mx));
    for (size_t c = 0; c < D; c++) out[c] = 0;
    for (size_t t = 0; t < n; t++)
        for (size_t c = 0; c < D; c++) out[c] += s[t] / sum * kvq_f16_to_f32(V[t * D + c]);
    free(s);
}

static int check_layer(model *M, int fmt)
{
    const kvq_dp_model *m = &M->m;
    const size_t B = 2, N = 200, L = m->n_layers, d = m->dim, H = m->n_kv_heads, D = m->head_dim, kvd = H * D, nh = m->n_heads;
    caches C;
    char why[1024];
    if (caches_create(&C, m, fmt, B, N, 8, why, sizeof why)) { fprintf(stderr, "check: %s: %s\n", fmt_name[fmt], why); exit(2); }
    if (fmt != F_FP16) {
        /* the checked layer's cache from real appends of N random rows per sequence: kvq_kvcache_cuda_fill_random writes
         * random codes where its sparse entries sit (not the zero code an append leaves there), a state no append
         * produces and on which the GPU (dense + correction) and the CPU (entry replaces the dense value) part */
        const size_t l = L / 2, n = N * kvd;
        float *hk = malloc(n * 4), *hv = malloc(n * 4), *dk = NULL, *dv = NULL;
        if (!hk || !hv) { fprintf(stderr, "out of host memory\n"); exit(2); }
        uint64_t x = 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            hk[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 4.0 - 2.0) * (1.0f + (float)(i % D % 4));
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            hv[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        }
        CU(cudaMalloc((void **)&dk, n * 4));
        CU(cudaMalloc((void **)&dv, n * 4));
        CU(cudaMemcpy(dk, hk, n * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(dv, hv, n * 4, cudaMemcpyHostToDevice));
        kvq_kvcache_cuda_free(C.pc[l]);
        C.pc[l] = NULL;
        OK(kvq_kvcache_cuda_create(&C.pc[l], &C.cfg, ERR));
        for (size_t b = 0; b < B; b++) OK(kvq_kvcache_cuda_append(C.pc[l], b, dk, dv, N, ERR));
        cudaFree(dk); cudaFree(dv); free(hk); free(hv);
    }
    step(M, &C, NULL, NULL, 1); /* one real token first, so the checked step's cache holds appended rows too */
    capture cp = {L / 2, malloc(B * d * 4), malloc(B * kvd * 4), malloc(B * kvd * 4), malloc(B * d * 4), malloc(B * d * 4)};
    double *ref = malloc(B * d * 8);
    float *qh = malloc(B * d * 4), *kh = malloc(B * kvd * 4);
    if (!cp.q || !cp.k || !cp.v || !cp.qr || !cp.att || !ref || !qh || !kh) { fprintf(stderr, "out of host memory\n"); exit(2); }
    kvq_kvcache *cpu = NULL;
    uint16_t *k16 = NULL, *v16 = NULL;
    const size_t pos = C.len, per = B * H * C.cap * D;
    if (fmt == F_FP16) {
        k16 = malloc(per * 2);
        v16 = malloc(per * 2);
        if (!k16 || !v16) { fprintf(stderr, "out of host memory\n"); exit(2); }
    } else {
        OK(kvq_kvcache_create(&cpu, &C.cfg, ERR));
        OK(kvq_kvcache_cuda_download(C.pc[cp.layer], cpu, ERR));
    }
    step(M, &C, NULL, &cp, 2);
    CU(cudaDeviceSynchronize());
    /* q: kvq_rope_rotate of the captured pre-RoPE q at position pos */
    kvq_rope rope = {D, ROPE_THETA, 0};
    memcpy(qh, cp.q, B * d * 4);
    memcpy(kh, cp.k, B * kvd * 4);
    for (size_t b = 0; b < B; b++) {
        OK(kvq_rope_rotate(qh + b * d, 1, nh, D, &rope, pos, ERR));
        OK(kvq_rope_rotate(kh + b * kvd, 1, H, D, &rope, pos, ERR));
    }
    int bad = 0;
    char what[160];
    {
        double *r = malloc(B * d * 8);
        if (!r) { fprintf(stderr, "out of host memory\n"); exit(2); }
        for (size_t i = 0; i < B * d; i++) r[i] = qh[i];
        snprintf(what, sizeof what, "%s: device RoPE of q vs kvq_rope_rotate: rel L2", fmt_name[fmt]);
        bad += report(what, rel_l2(cp.qr, r, B * d), 1e-6);
        free(r);
    }
    double tol;
    if (fmt == F_FP16) {
        CU(cudaMemcpy(k16, C.fc[cp.layer].k16_dev, per * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(v16, C.fc[cp.layer].v16_dev, per * 2, cudaMemcpyDeviceToHost));
        int ulp = 0;
        for (size_t b = 0; b < B; b++)
            for (size_t h = 0; h < H; h++)
                for (size_t c = 0; c < D; c++) {
                    const size_t o = ((b * H + h) * C.cap + pos) * D + c;
                    const int dk = abs((int)k16[o] - (int)kvq_f32_to_f16(kh[b * kvd + h * D + c]));
                    const int dv = abs((int)v16[o] - (int)kvq_f32_to_f16(cp.v[b * kvd + h * D + c]));
                    if (dk > ulp) ulp = dk;
                    if (dv > ulp) ulp = dv;
                }
        snprintf(what, sizeof what, "%s: appended row vs fp16(kvq_rope_rotate(k)), fp16 ulps", fmt_name[fmt]);
        bad += report(what, ulp, 1);
        for (size_t b = 0; b < B; b++)
            for (size_t j = 0; j < nh; j++) {
                const size_t h = j / (nh / H), o = (b * H + h) * C.cap * D;
                attend_ref(qh + b * d + j * D, k16 + o, v16 + o, pos + 1, D, ref + b * d + j * D);
            }
        tol = 1e-4;
    } else {
        for (size_t b = 0; b < B; b++) OK(kvq_kvcache_append(cpu, b, cp.k + b * kvd, cp.v + b * kvd, 1, ERR));
        float *o32 = malloc(B * d * 4);
        if (!o32) { fprintf(stderr, "out of host memory\n"); exit(2); }
        OK(kvq_kvcache_attend(cpu, qh, nh, 0, o32, ERR));
        for (size_t i = 0; i < B * d; i++) ref[i] = o32[i];
        free(o32);
        tol = 2e-5;
    }
    snprintf(what, sizeof what, "%s: layer %zu attention, B=%zu N=%zu, vs CPU float64: rel L2", fmt_name[fmt], cp.layer, B, pos + 1);
    bad += report(what, rel_l2(cp.att, ref, B * d), tol);
    int flag = 0;
    CU(cudaMemset(M->flag, 0, sizeof(int)));
    KD(kvq_ds_nonfinite(M->logits, B * m->vocab, M->flag));
    CU(cudaMemcpy(&flag, M->flag, sizeof(int), cudaMemcpyDeviceToHost));
    if (flag) { printf("  %s: non-finite logits FAIL\n", fmt_name[fmt]); bad++; }
    if (cpu) kvq_kvcache_free(cpu);
    free(k16); free(v16); free(cp.q); free(cp.k); free(cp.v); free(cp.qr); free(cp.att); free(ref); free(qh); free(kh);
    caches_free(&C, L);
    return bad;
}

/* ---- timing -------------------------------------------------------------------------------------------------- */
static int cmpf(const void *a, const void *b) { float x = *(const float *)a, y = *(const float *)b; return (x > y) - (x < y); }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

typedef struct {
    double step_ms, cat_ms[N_CAT], bytes_w, bytes_kv, used_bytes;
    int finite;
} result;

static void time_row(model *M, caches *C, int warm, int reps, marks *mk, result *r)
{
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float *ms = malloc(reps * sizeof(float)), *cm = malloc((size_t)reps * N_CAT * sizeof(float));
    if (!ms || !cm) { fprintf(stderr, "out of host memory\n"); exit(2); }
    unsigned seed = 100;
    for (int i = 0; i < warm; i++) step(M, C, NULL, NULL, seed++);
    CU(cudaDeviceSynchronize());
    r->bytes_kv = 0;
    for (int i = 0; i < reps; i++) {
        r->bytes_kv += caches_bytes_read(C, &M->m) / reps; /* before the step's append: the pass reads one row more */
        CU(cudaEventRecord(e0, 0));
        step(M, C, NULL, NULL, seed++);
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        CU(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, reps, sizeof ms[0], cmpf);
    r->step_ms = ms[reps / 2];
    for (int i = 0; i < reps; i++) {
        mk->n = 0;
        step(M, C, mk, NULL, seed++);
        CU(cudaEventSynchronize(mk->ev[mk->n - 1]));
        float acc[N_CAT] = {0};
        for (int j = 0; j + 1 < mk->n; j++) {
            float t;
            CU(cudaEventElapsedTime(&t, mk->ev[j], mk->ev[j + 1]));
            acc[mk->cat[j]] += t;
        }
        for (int c = 0; c < N_CAT; c++) cm[c * reps + i] = acc[c];
    }
    for (int c = 0; c < N_CAT; c++) {
        qsort(cm + c * reps, reps, sizeof(float), cmpf);
        r->cat_ms[c] = cm[c * reps + reps / 2];
    }
    size_t fr, tot;
    CU(cudaMemGetInfo(&fr, &tot));
    r->used_bytes = (double)(tot - fr);
    int flag = 0;
    CU(cudaMemset(M->flag, 0, sizeof(int)));
    KD(kvq_ds_nonfinite(M->logits, C->B * M->m.vocab, M->flag));
    CU(cudaMemcpy(&flag, M->flag, sizeof(int), cudaMemcpyDeviceToHost));
    r->finite = !flag;
    free(ms);
    free(cm);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
}

/* device-to-device copy bandwidth, bytes read + written, median of 9 copies of n bytes */
static double copy_bw(size_t n)
{
    void *a, *b;
    CU(cudaMalloc(&a, n));
    CU(cudaMalloc(&b, n));
    OK(kvq_cuda_fill_half(a, n / 2, 7, ERR));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float ms[9];
    for (int i = -2; i < 9; i++) {
        CU(cudaEventRecord(e0, 0));
        CU(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, 0));
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        if (i >= 0) CU(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, 9, sizeof ms[0], cmpf);
    cudaFree(a);
    cudaFree(b);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 2.0 * n / (ms[4] * 1e-3);
}

/* ---- the command line ---------------------------------------------------------------------------------------- */
static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_decode_step [options]\n"
            "  The decode step of a Llama-2-7B-shaped model (32 layers, d_model 4096, 32 heads x 128, FFN 11008, vocab 32000,\n"
            "  random bf16 weights, cuBLAS bf16 GEMMs with fp32 accumulation, fp32 activations) on an fp16 KV cache and on\n"
            "  the packed cache (nuq4/3/2 with 1%% outliers, kivi2), caches filled synthetically to N positions.\n"
            "  Checks first (GEMM vs float64, one layer's attention vs the CPU cache), then tokens/s per row.\n"
            "  --csv PATH        write the rows as CSV (written to PATH.tmp, renamed when complete)\n"
            "  --md PATH         write the table as markdown (same)\n"
            "  --quick           B = 1 at N = 4K and 32K; fp16 and nuq3-1%% only; 2 warm-up, 5 timed steps\n"
            "  --moonshot        nuq2-1%% at B = 1, N = 1M (1048576) and the longest N that fits (issue 46's moonshot)\n"
            "  --formats LIST    comma-separated of fp16,nuq4,nuq3,nuq2,kivi2 (default all)\n"
            "  --batch LIST      batch sizes (default 1,32; at most 64)\n"
            "  --ctx LIST        context lengths N (default 4096,32768,131072 plus the longest that fits per format)\n"
            "  --no-longest      no longest-N rows\n"
            "  --reps R          timed steps per row (default 9; the breakdown takes R more), --warm W (default 3)\n"
            "  --budget S        start no row after S seconds (default 480); rows left out are listed\n"
            "  --margin GIB      device memory kept free beyond the caches (default 2)\n"
            "  --check-only      run the correctness checks and stop\n"
            "  --no-check        skip the correctness checks\n"
            "  -h, --help        this text\n"
            "Exit status: 0 done, 1 a check failed or a row's logits were not finite, 2 usage or CUDA/cuBLAS error.\n");
}

static int parse_list(const char *s, size_t *out, int max)
{
    int n = 0;
    for (const char *p = s; *p && n < max;) {
        char *end;
        const double v = strtod(p, &end);
        if (end == p || v <= 0) return -1;
        out[n++] = (size_t)v;
        if (*end == ',') p = end + 1;
        else if (*end == 0) p = end;
        else return -1;
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *csv_path = NULL, *md_path = NULL;
    int quick = 0, moonshot = 0, check_only = 0, no_check = 0, longest = 1, reps = 9, warm = 3;
    int use_fmt[N_FMT] = {1, 1, 1, 1, 1}, fmt_set = 0;
    size_t Bs[8] = {1, 32}, Ns[16] = {4096, 32768, 131072};
    int nB = 2, nN = 3;
    double budget = 480, margin_gib = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int more = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--quick")) quick = 1;
        else if (!strcmp(a, "--moonshot")) moonshot = 1;
        else if (!strcmp(a, "--check-only")) check_only = 1;
        else if (!strcmp(a, "--no-check")) no_check = 1;
        else if (!strcmp(a, "--no-longest")) longest = 0;
        else if (!strcmp(a, "--csv") && more) csv_path = argv[++i];
        else if (!strcmp(a, "--md") && more) md_path = argv[++i];
        else if (!strcmp(a, "--reps") && more) { reps = atoi(argv[++i]); if (reps < 1 || reps > 99) { fprintf(stderr, "bench_decode_step: --reps: expected 1..99, found %s\n", argv[i]); return 2; } }
        else if (!strcmp(a, "--warm") && more) { warm = atoi(argv[++i]); if (warm < 0 || warm > 99) { fprintf(stderr, "bench_decode_step: --warm: expected 0..99, found %s\n", argv[i]); return 2; } }
        else if (!strcmp(a, "--budget") && more) budget = atof(argv[++i]);
        else if (!strcmp(a, "--margin") && more) margin_gib = atof(argv[++i]);
        else if (!strcmp(a, "--batch") && more) {
            nB = parse_list(argv[++i], Bs, 8);
            for (int j = 0; j < nB; j++) if (Bs[j] > 64) nB = -1;
            if (nB <= 0) { fprintf(stderr, "bench_decode_step: --batch: expected a comma-separated list of 1..64, found %s\n", argv[i]); return 2; }
        } else if (!strcmp(a, "--ctx") && more) {
            nN = parse_list(argv[++i], Ns, 15);
            if (nN <= 0) { fprintf(stderr, "bench_decode_step: --ctx: expected a comma-separated list of positive numbers, found %s\n", argv[i]); return 2; }
        } else if (!strcmp(a, "--formats") && more) {
            fmt_set = 1;
            memset(use_fmt, 0, sizeof use_fmt);
            char buf[256];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                int k = -1;
                for (int j = 0; j < N_FMT; j++)
                    if (!strncmp(t, fmt_name[j], strlen(t)) && strlen(t) >= 4) k = j;
                if (k < 0) { fprintf(stderr, "bench_decode_step: --formats: unknown format '%s' (expected fp16, nuq4, nuq3, nuq2, kivi2)\n", t); return 2; }
                use_fmt[k] = 1;
            }
        } else {
            fprintf(stderr, "bench_decode_step: unknown option or missing value: %s (see --help)\n", a);
            return 2;
        }
    }
    if (quick) {
        nB = 1; Bs[0] = 1;
        nN = 2; Ns[0] = 4096; Ns[1] = 32768;
        longest = 0;
        if (!fmt_set) for (int j = 0; j < N_FMT; j++) use_fmt[j] = j == F_FP16 || j == F_NUQ3;
        reps = reps < 5 ? reps : 5;
        warm = 2;
    }
    if (moonshot) {
        nB = 1; Bs[0] = 1;
        nN = 1; Ns[0] = 1048576;
        if (!fmt_set) for (int j = 0; j < N_FMT; j++) use_fmt[j] = j == F_NUQ2;
    }
    const double t_start = now_s();
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
    const double bw = copy_bw((size_t)2 << 30);
    printf("copy bandwidth: %.0f GB/s (2 GiB device-to-device, read + write, median of 9)\n", bw / 1e9);
    size_t Bmax = 1;
    for (int j = 0; j < nB; j++) if (Bs[j] > Bmax) Bmax = Bs[j];
    if (!no_check && Bmax < 2) Bmax = 2;
    model M;
    model_init(&M, Bmax);
    const kvq_dp_model *m = &M.m;
    size_t fr, tot;
    CU(cudaMemGetInfo(&fr, &tot));
    printf("model: Llama-2-7B shape, %.2f G parameters, bf16 weights %.2f GB on the device; %.1f GB free\n",
           kvq_dp_weight_params(m) / 1e9, kvq_dp_weight_bytes(m) / 1e9, fr / 1e9);
    int bad = 0;
    if (!no_check) {
        printf("== checks\n");
        bad += check_gemm(M.h);
        for (int fmt = 0; fmt < N_FMT; fmt++) bad += check_layer(&M, fmt);
        printf("checks: %s\n", bad ? "FAILED" : "all passed");
        fflush(stdout);
        if (bad || check_only) { model_free(&M); return bad ? 1 : 0; }
    }
    marks mk;
    for (int i = 0; i < MAX_MARKS; i++) CU(cudaEventCreate(&mk.ev[i]));
    const size_t extra = (size_t)warm + 2 * (size_t)reps + 1;
    const uint64_t margin = (uint64_t)(margin_gib * 1073741824.0);
    CU(cudaMemGetInfo(&fr, &tot));
    FILE *csv = NULL, *md = NULL;
    char csv_tmp[4096], md_tmp[4096];
    if (csv_path) {
        snprintf(csv_tmp, sizeof csv_tmp, "%s.tmp", csv_path);
        if (!(csv = fopen(csv_tmp, "w"))) { fprintf(stderr, "bench_decode_step: cannot write %s\n", csv_tmp); return 2; }
        fprintf(csv, "device,copy_GBps,format,B,N,longest,step_ms,tokens_per_s,x_fp16,gemm_ms,append_ms,attn_ms,rest_ms,weight_bytes,kv_bytes,"
                     "bound_ms,pct_bound,kv_alloc_bytes,device_used_bytes,logits_finite\n");
    }
    if (md_path) {
        snprintf(md_tmp, sizeof md_tmp, "%s.tmp", md_path);
        if (!(md = fopen(md_tmp, "w"))) { fprintf(stderr, "bench_decode_step: cannot write %s\n", md_tmp); return 2; }
        fprintf(md, "Device: %s; copy bandwidth %.0f GB/s (same run).\n\n", prop.name, bw / 1e9);
        fprintf(md, "| cache | B | N | step ms | tokens/s | x fp16 | GEMM ms | append ms | attention ms | rest ms | weights GB | KV read GB | bound ms | %% of bound | KV alloc GB | device used GB |\n");
        fprintf(md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    printf("== decode step (median of %d steps after %d warm-up; breakdown: median of %d more)\n", reps, warm, reps);
    printf("%-8s %3s %8s | %9s %9s %6s | %8s %8s %8s %8s | %7s %7s %8s %6s | %7s %7s\n", "cache", "B", "N", "step ms", "tok/s", "x fp16",
           "GEMM ms", "append", "attn", "rest", "W GB", "KV GB", "bound ms", "%bound", "KV alloc", "used GB");
    char skipped[8192] = "";
    double f16_tps[8][16]; /* fp16 tokens/s per (B, N) index; the longest rows have N of their own */
    memset(f16_tps, 0, sizeof f16_tps);
    /* pass 0: the listed N for every B; pass 1: the longest N per format (last: the largest caches) */
    for (int pass = 0; pass < 2; pass++)
        for (int bi = 0; bi < nB; bi++) {
            const size_t B = Bs[bi];
            size_t longN[N_FMT] = {0};
            if (pass == 1 && (longest || moonshot))
                for (int fmt = 0; fmt < N_FMT; fmt++)
                    if (use_fmt[fmt]) longN[fmt] = kvq_dp_longest(m, plan_of(fmt, 0, extra), B, extra, 1, fr, margin, 4096, (size_t)1 << 26);
            for (int ri = 0; ri < (pass ? N_FMT : nN); ri++)
                for (int fmt = 0; fmt < N_FMT; fmt++) {
                    if (!use_fmt[fmt]) continue;
                    size_t N;
                    if (!pass) N = Ns[ri];
                    else if (ri == fmt && longN[fmt]) {
                        N = longN[fmt];
                        int dup = 0;
                        for (int j = 0; j < nN; j++) dup |= Ns[j] == N;
                        if (dup) continue;
                    } else continue;
                    char tag[64];
                    snprintf(tag, sizeof tag, "%s B=%zu N=%zu%s", fmt_name[fmt], B, N, pass ? " (longest)" : "");
                    const kvq_dp_cache pl = plan_of(fmt, N, extra);
                    const uint64_t need = kvq_dp_caches_bytes(m, &pl, B, N + extra);
                    if (!kvq_dp_fits(m, &pl, B, N + extra, fr, margin)) {
                        printf("%-8s %3zu %8zu | skipped for memory: the caches need %.1f GB + %.1f GB margin, %.1f GB free after the weights\n",
                               fmt_name[fmt], B, N, need / 1e9, margin / 1e9, fr / 1e9);
                        snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), "  %s: memory (needs %.1f GB + %.1f GB margin, %.1f GB free)\n",
                                 tag, need / 1e9, margin / 1e9, fr / 1e9);
                        continue;
                    }
                    if (now_s() - t_start > budget) {
                        printf("%-8s %3zu %8zu | skipped: the %.0f s budget is spent\n", fmt_name[fmt], B, N, budget);
                        snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), "  %s: budget\n", tag);
                        continue;
                    }
                    caches C;
                    char why[1024];
                    if (caches_create(&C, m, fmt, B, N, extra, why, sizeof why)) {
                        printf("%-8s %3zu %8zu | skipped: out of device memory (%s)\n", fmt_name[fmt], B, N, why);
                        snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), "  %s: out of device memory at allocation (%s)\n", tag, why);
                        continue;
                    }
                    result r;
                    memset(&r, 0, sizeof r);
                    time_row(&M, &C, warm, reps, &mk, &r);
                    caches_free(&C, m->n_layers);
                    r.bytes_w = (double)kvq_dp_weight_bytes_read(m, B);
                    const double tps = B / (r.step_ms * 1e-3), bound_ms = (r.bytes_w + r.bytes_kv) / bw * 1e3;
                    if (fmt == F_FP16 && !pass) f16_tps[bi][ri] = tps;
                    const double x16 = !pass && f16_tps[bi][ri] > 0 ? tps / f16_tps[bi][ri] : 0;
                    char xs[16];
                    if (x16 > 0) snprintf(xs, sizeof xs, "%.2f", x16);
                    else snprintf(xs, sizeof xs, "-");
                    printf("%-8s %3zu %8zu | %9.3f %9.1f %6s | %8.3f %8.3f %8.3f %8.3f | %7.2f %7.2f %8.3f %5.0f%% | %7.1f %7.1f%s%s\n", fmt_name[fmt],
                           B, N, r.step_ms, tps, xs, r.cat_ms[CAT_GEMM], r.cat_ms[CAT_APPEND], r.cat_ms[CAT_ATTN], r.cat_ms[CAT_REST],
                           r.bytes_w / 1e9, r.bytes_kv / 1e9, bound_ms, 100 * bound_ms / r.step_ms, need / 1e9, r.used_bytes / 1e9,
                           pass ? "  (longest)" : "", r.finite ? "" : "  NON-FINITE LOGITS");
                    fflush(stdout);
                    bad += !r.finite;
                    if (csv)
                        fprintf(csv, "\"%s\",%.1f,%s,%zu,%zu,%d,%.4f,%.2f,%.3f,%.4f,%.4f,%.4f,%.4f,%.0f,%.0f,%.4f,%.1f,%.0f,%.0f,%d\n", prop.name,
                                bw / 1e9, fmt_name[fmt], B, N, pass, r.step_ms, tps, x16, r.cat_ms[CAT_GEMM], r.cat_ms[CAT_APPEND],
                                r.cat_ms[CAT_ATTN], r.cat_ms[CAT_REST], r.bytes_w, r.bytes_kv, bound_ms, 100 * bound_ms / r.step_ms, (double)need,
                                r.used_bytes, r.finite);
                    if (csv) fflush(csv);
                    if (md)
                        fprintf(md, "| %s | %zu | %zu%s | %.2f | %.1f | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f%% | %.1f | %.1f |\n",
                                fmt_name[fmt], B, N, pass ? " (longest)" : "", r.step_ms, tps, xs, r.cat_ms[CAT_GEMM], r.cat_ms[CAT_APPEND],
                                r.cat_ms[CAT_ATTN], r.cat_ms[CAT_REST], r.bytes_w / 1e9, r.bytes_kv / 1e9, bound_ms, 100 * bound_ms / r.step_ms,
                                need / 1e9, r.used_bytes / 1e9);
                }
        }
    if (*skipped) printf("rows skipped:\n%s", skipped);
    if (md && *skipped) fprintf(md, "\nRows skipped:\n\n%s", skipped);
    for (int i = 0; i < MAX_MARKS; i++) cudaEventDestroy(mk.ev[i]);
    model_free(&M);
    if (csv) { fclose(csv); if (rename(csv_tmp, csv_path)) { fprintf(stderr, "bench_decode_step: cannot rename %s\n", csv_tmp); return 2; } }
    if (md) { fclose(md); if (rename(md_tmp, md_path)) { fprintf(stderr, "bench_decode_step: cannot rename %s\n", md_tmp); return 2; } }
    printf("total %.0f s\n", now_s() - t_start);
    return bad ? 1 : 0;
}
