// forward_cuda_impl.cuh — internals shared by forward_cuda.cu and
// backward_cuda.cu: the workspace struct, error macros (every CUDA / cuBLAS
// call checked; the message names the call, file and line), device
// allocation with an out-of-memory message that says what to shrink, and the
// cuBLAS linear layer. Not a public header.
#ifndef KVQ_FORWARD_CUDA_IMPL_CUH
#define KVQ_FORWARD_CUDA_IMPL_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <time.h>

#include <vector>

#include "cuda_ops.cuh"

extern "C" {
#include "forward_cuda.h"
}

struct dev_layer {
    float *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w_gate, *w_up, *w_down;
    float *bq, *bk, *bv, *bo;   // attention biases (fp32), NULL when the model has none
    float *q_norm, *k_norm;     // per-head q/k RMSNorm weights [head_dim] (Qwen3), NULL otherwise
};

static inline kvq_status cu_fail(kvq_err *err, cudaError_t e, const char *call, const char *file, int line)
{
    (void)cudaGetLastError();
    return kvq_fail(err, e == cudaErrorMemoryAllocation ? KVQ_ENOMEM : KVQ_EIO, "CUDA: %s failed (%s:%d): %s",
                    call, file, line, cudaGetErrorString(e));
}

static inline kvq_status cb_fail(kvq_err *err, cublasStatus_t s, const char *call, const char *file, int line)
{
    return kvq_fail(err, s == CUBLAS_STATUS_ALLOC_FAILED ? KVQ_ENOMEM : KVQ_EIO, "CUDA: %s failed (%s:%d): %s",
                    call, file, line, cublasGetStatusString(s));
}

#define CU(call)                                                          \
    do {                                                                  \
        cudaError_t cu_e_ = (call);                                       \
        if (cu_e_ != cudaSuccess) return cu_fail(err, cu_e_, #call, __FILE__, __LINE__); \
    } while (0)
#define CB(call)                                                                 \
    do {                                                                         \
        cublasStatus_t cb_s_ = (call);                                           \
        if (cb_s_ != CUBLAS_STATUS_SUCCESS) return cb_fail(err, cb_s_, #call, __FILE__, __LINE__); \
    } while (0)

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct kvq_forward_cuda {
    const kvq_model *m;
    int dev, max_T, max_P;
    int l0, l1;             // the layers this workspace holds: l0 .. l1-1 (0 .. n_layers: the whole model)
    unsigned flags;
    kvq_cuda_math math;
    cudaStream_t st;
    cublasHandle_t blas;
    char name[1024];
    size_t weight_bytes;
    // device weights (one arena)
    void *wbuf;
    float *tok_embd, *out_norm, *output;
    std::vector<dev_layer> L;
    // device activations (one arena)
    void *abuf;
    float *x, *xn, *q, *k_pre, *k_post, *v, *k_att, *v_att, *k_alt, *v_alt, *att, *gate, *up, *blk;
    float *row_max, *row_tgt, *rcos, *rsin, *pk, *pv;
    double *row_sum;
    int *tok, *tg, *kb, *vb;
    unsigned long long *cnt; // [2]: k, v outliers of the current run
    int v_chunk;
    float *logits; // [max_T][vocab], lazily
    float *d_ex;   // [max_T][dim] the LM head's running expectation (kvq_fwd_head.expect), lazily
    int *d_arg;    // [max_T] top tokens (kvq_fwd_head.argmax), lazily
    // pinned host staging (one allocation)
    void *hbuf;
    float *h_row_max, *h_row_tgt, *h_cos, *h_sin;
    double *h_row_sum;
    int *h_tok, *h_tg, *h_kb, *h_vb;
    float *h_q, *h_kpre, *h_kpost, *h_v, *h_katt, *h_vatt, *h_kalt, *h_valt;
    unsigned long long *h_cnt;
    // native transform
    bool has_desc;
    kvq_kv_desc desc;
    void *kv_state;                        // the family's uploaded tables (kvq_family_cuda.upload), or NULL
    std::vector<float> h_att;              // host attention output for a per-key schedule ([max_T][q_dim])
    // a schedule with a declarative policy (forward.h kvq_sched_imp) on the device (cuda_sched.cuh), lazily:
    // 3 key + 3 value representations [max_T][kv_dim], from [2][n_kv_heads][max_T], row max / sum
    // [n_heads][max_T], counts [n_kv_heads][4]
    bool sched_host; // KVQ_SCHED_HOST=1: every schedule on the host (same-run comparisons)
    bool sched_pre;  // every representation's scores ahead of the policy (cuda_sched.cuh S): KVQ_SCHED_PRESCORE unset
                     // (when they fit a quarter of the free memory) or 1 (always); 0 never
    bool sched_pre_forced; // KVQ_SCHED_PRESCORE=1
    float *sd_S;     // [3][n_heads][max_T][max_P + max_T] for sched_pre, lazily (NULL: not allocated or too large)
    void *sched_buf;
    float *sd_k[3], *sd_v[3], *sd_m, *sd_s;
    int *sd_from;
    unsigned long long *sd_cnt;
    std::vector<unsigned long long> h_sched_cnt;
    // the selection form's declarative step (forward.h kvq_sched_sel, cuda_sched.cuh kvq_cu_ssel_args), lazily: its
    // representations, rows, ring, selection history and policy arrays in one buffer (ssel_plan), regrown when a
    // layer needs more; the prescores of its key representations (sched_pre) in another
    void *ss_buf;
    size_t ss_cap;
    float *ss_S;
    size_t ss_S_cap;
    kvq_cuda_stats stats;
    // KVQ_CUDA_BF16: GEMM weights (and tok_embd / output) hold bf16 bits behind their float* type;
    // xb = bf16 copy of a GEMM's activation input ([max_T][max(dim, q_dim, hidden_dim, v_chunk)])
    bool bf16;
    bool attn_tc; // the bf16 tensor-core attention forward (bf16 mode, unless KVQ_ATTN_TC=0)
    unsigned short *xb;
    size_t xb_elems;
    // KVQ_FWD_SAVE_LAYER_INPUTS / KVQ_FWD_SAVE_ACTIVATIONS store (device, one arena), for the backward
    void *sbuf;
    float *xs;                                   // [n_layers+1][max_T][dim] residual stream entering layer l
    float *s_q, *s_k, *s_v, *s_kq, *s_vq, *s_att; // [n_layers][max_T][q_dim | kv_dim]
    float *s_lse;                                // [n_layers][n_heads][max_T]
    float *s_xmid, *s_gate, *s_up;               // [n_layers][max_T][dim | hidden_dim]
    int *s_kb, *s_vb;                            // [n_layers][max_T]
    std::vector<unsigned char> s_alt;            // [n_layers]: bit 0 alternative keys, bit 1 alternative values
    int T_last;                                  // T of the last successful run (0: none)
    int P_last;
    // attention statistics (observe with attn_stats)
    float *lse, *mass, *entropy;                 // [n_heads][max_T], [n_heads][max_P+max_T], [n_heads][max_T]
    float *h_mass, *h_ent;                       // pinned copies
    // backward workspace (backward_cuda.cu; allocated on the first backward)
    void *bbuf, *hbbuf;
    float *b_dx, *b_dxn, *b_xn, *b_dh, *b_dup, *b_datt, *b_dq, *b_dk, *b_dv, *b_dkpre, *b_dpk, *b_dpv, *b_D;
    float *b_qraw, *b_kraw, *b_dqraw, *b_dkraw; // q/k before their per-head norm and the gradients there (qk_norm only)
    double *b_lse;
    int *b_flag;
    float *hb_dkpre, *hb_dk, *hb_dv, *hb_dpk, *hb_dpv, *hb_x, *hb_dx;
    int *hb_flag;
    cudaEvent_t b_ev;   // "this layer's gradients are on the host" (created with the backward workspace)
    double t_bwd_forward, t_bwd_head, t_bwd_layers; // wall seconds of the last backward, by phase
    kvq_fwd_result bs_fr;   // the stage forward awaiting its backward (kvq_forward_cuda_backward_stage_*)
    bool bs_skip, bs_ready;
};

static inline kvq_status dev_alloc(kvq_forward_cuda *g, void **p, size_t bytes, const char *what, kvq_err *err)
{
    cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return KVQ_OK;
    (void)cudaGetLastError();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    (void)cudaGetLastError();
    *p = NULL;
    if (e == cudaErrorMemoryAllocation)
        return kvq_fail(err, KVQ_ENOMEM,
                        "CUDA forward: cannot allocate %.1f MiB on GPU %d for %s (max_T %d, max_P %d): %.1f MiB free of %.1f MiB; "
                        "shrink the window (--ctx / --seq-len), evaluate fewer tokens at once, or use --device cpu",
                        bytes / 1048576.0, g->dev, what, g->max_T, g->max_P, fr / 1048576.0, tot / 1048576.0);
    return kvq_fail(err, KVQ_EIO, "CUDA forward: cudaMalloc of %.1f MiB for %s failed: %s", bytes / 1048576.0, what,
                    cudaGetErrorString(e));
}

// Carve float/int buffers out of one arena; sizes in elements of 4 bytes (8 for doubles).
struct carve {
    size_t off = 0;
    char *base = NULL;
    template <class T> void take(T **p, size_t n)
    {
        *p = base ? reinterpret_cast<T *>(base + off) : NULL;
        off = align_up(off + n * sizeof(T), 256);
    }
    // n elements of elem bytes each behind a T* (bf16 weights behind float*)
    template <class T> void take_as(T **p, size_t n, size_t elem)
    {
        *p = base ? reinterpret_cast<T *>(base + off) : NULL;
        off = align_up(off + n * elem, 256);
    }
};

// Weight pointer + n elements (bf16 weights are 2 bytes each).
static inline const float *woff(const kvq_forward_cuda *g, const float *w, size_t n)
{
    return g->bf16 ? reinterpret_cast<const float *>(reinterpret_cast<const unsigned short *>(w) + n) : w + n;
}

// C (column-major m x n, ldc) = alpha op(W) B + beta C for a weight W (fp32, or bf16 in
// KVQ_CUDA_BF16 mode, where B is first rounded to bf16 into g->xb).
static inline kvq_status gemm_w(kvq_forward_cuda *g, cublasOperation_t opw, int m, int n, int k, const float *w, int ldw,
                                const float *b, int ldb, float beta, float *c, int ldc, kvq_err *err)
{
    const float alpha = 1.0f;
    if (!g->bf16) {
        CB(cublasSgemm(g->blas, opw, CUBLAS_OP_N, m, n, k, &alpha, w, ldw, b, ldb, &beta, c, ldc));
        return KVQ_OK;
    }
    const size_t nb = (size_t)ldb * n;
    if (nb > g->xb_elems)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: bf16 staging of %zu elements exceeds its %zu (internal sizing)", nb, g->xb_elems);
    CU(kvq_cu_to_bf16(g->xb, b, nb, g->st));
    CB(cublasGemmEx(g->blas, opw, CUBLAS_OP_N, m, n, k, &alpha, w, CUDA_R_16BF, ldw, g->xb, CUDA_R_16BF, ldb, &beta, c, CUDA_R_32F,
                    ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return KVQ_OK;
}

static inline kvq_status linear(kvq_forward_cuda *g, float *y, const float *x, const float *w, int T, int in, int out, float beta,
                  kvq_err *err)
{
    // row-major y[T][out] = x[T][in] W^T  <=>  column-major y^T (out x T) = op(W)(out x in) x^T (in x T)
    return gemm_w(g, CUBLAS_OP_T, out, T, in, w, in, x, in, beta, y, out, err);
}


// ops.h kvq_qkv_finish on the device: biases, then the per-head q/k RMSNorm (Qwen3; with norm = false the
// projections stop before it: the backward's pre-norm q/k).
static inline kvq_status qkv_finish(kvq_forward_cuda *g, const dev_layer &w, int T, float *q, float *k, float *v, bool norm,
                                    kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp);
    if (w.bq) {
        CU(kvq_cu_add_bias(q, w.bq, T, qd, g->st));
        CU(kvq_cu_add_bias(k, w.bk, T, kvd, g->st));
        if (v) CU(kvq_cu_add_bias(v, w.bv, T, kvd, g->st));
    }
    if (norm && w.q_norm) {
        CU(kvq_cu_rmsnorm(q, q, w.q_norm, T * hp->n_heads, hp->head_dim, hp->norm_eps, g->st));
        CU(kvq_cu_rmsnorm(k, k, w.k_norm, T * hp->n_kv_heads, hp->head_dim, hp->norm_eps, g->st));
    }
    return KVQ_OK;
}

static inline kvq_status d2h(kvq_forward_cuda *g, float *h, const float *d, size_t n, kvq_err *err)
{
    CU(cudaMemcpyAsync(h, d, n * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    return KVQ_OK;
}
static inline kvq_status h2d(kvq_forward_cuda *g, float *d, const float *h, size_t n, kvq_err *err)
{
    CU(cudaMemcpyAsync(d, h, n * sizeof(float), cudaMemcpyHostToDevice, g->st));
    return KVQ_OK;
}


#endif
