/* attention_backward.h — causal grouped-query attention with a prefix and
 * optional boundary-selected alternative K/V (the semantics of attention.h),
 * recomputed with its per-row log-sum-exp, and its reverse-mode gradient with
 * respect to q, the window K/V, the alternative K/V and the prefix K/V.
 *
 * Forward (per query head h, window query i, kv head g = h / (n_heads /
 * n_kv_heads), keys c = 0..P+i in one sequence [prefix | window]):
 *   s_c = (q_i . k_c) / sqrt(head_dim),  p = softmax(s),  o_i = sum_c p_c v_c,
 *   lse_i = log sum_c exp(s_c); window key j is read from the alternative
 *   (kq/vq) when j < kb[i] (vb[i]), else from k/v (attention.h).
 * Backward (Dao 2023, FlashAttention-2, Algorithm 2; D_i = do_i . o_i):
 *   dp_c = do_i . v_c,  ds_c = p_c (dp_c - D_i),
 *   dq_i = sum_c ds_c k_c / sqrt(hd),  dk_c += ds_c q_i / sqrt(hd),  dv_c += p_c do_i
 * summed over the query heads of a GQA group and over queries.
 *
 * Memory and schedule: probabilities are never stored. kvq_attn_fwd_lse
 * computes o and lse row by row (one (query, head) row of P+T scores per
 * thread); the model-level backward uses kvq_attention (attention.h) with its
 * optional lse output instead, which is faster and agrees to ~1e-7 (tested).
 * kvq_attn_bwd walks blocks of KVQ_ATTN_BWD_BK keys of one kv head (one OpenMP
 * task each, earliest blocks first). For every query that sees the block it
 * recomputes the scores and dp of all the GQA group's heads (accumulated in
 * registers over the block's keys), p = exp(s - lse), and updates the block's
 * dK and dV, kept transposed [head_dim][BK], once per query for all heads of
 * the group. The dq contribution of each key block goes to a partial buffer
 * [ceil((P+T)/BK)][T][n_heads][head_dim], summed afterwards in block order
 * (for models whose partials would exceed KVQ_ATTN_BWD_DQP_MAX, a pass per
 * group of kv heads, reusing the buffer).
 * Results are therefore independent of the thread count. Workspace for the
 * default model (T = 2048, 9 heads of 64, P = 0): 151 MiB of dq partials + 1.5
 * MiB of transposed keys + ~0.2 MiB scratch per thread.
 *
 * Both builds exist: fp32 (kvq_attn_*) and float64 (kvq_attn_*_f64), from one
 * source (attention_backward.inc); the workspace serves either (it is sized
 * for the element size given at init).
 */
#ifndef KVQ_ATTENTION_BACKWARD_H
#define KVQ_ATTENTION_BACKWARD_H

#include <stddef.h>

#include "status.h"

#define KVQ_ATTN_BWD_BK 64 /* keys per backward block */
/* Largest dq-partials buffer (bytes): beyond it the backward runs the kv heads
 * in passes of g_chunk heads (the same results: each head's sums are formed
 * in the same order). 256 MiB: all heads at once for SmolLM2 at T = 2048
 * (151 MiB), one kv head per pass for a Llama-3-8B shape (134 MiB each, 1.07
 * GiB for all 8). */
#define KVQ_ATTN_BWD_DQP_MAX ((size_t)256 << 20)

/* Inputs, outputs and gradients of one attention call (fp32). Layouts:
 * q, out, dout, dq [T][n_heads][head_dim]; k, v, kq, vq, dk, dv, dkq, dvq
 * [T][n_kv_heads][head_dim]; pk, pv, dpk, dpv [P][n_kv_heads][head_dim];
 * lse [n_heads][T]; kb, vb [T]. All row-major. */
typedef struct {
    int T, P, n_heads, n_kv_heads, head_dim;
    const float *q, *k, *v;
    const float *pk, *pv;            /* NULL when P == 0 */
    const float *kq; const int *kb;  /* alternative keys + boundary, or both NULL */
    const float *vq; const int *vb;  /* alternative values + boundary, or both NULL */
    float *out, *lse;                /* written by kvq_attn_fwd_lse, read by kvq_attn_bwd */
    const float *dout;               /* bwd input: dL/dout */
    float *dq, *dk, *dv;             /* bwd outputs (overwritten) */
    float *dpk, *dpv;                /* bwd outputs when P > 0 (overwritten), may be NULL */
    float *dkq, *dvq;                /* bwd outputs for the alternatives; NULL: their gradient is ADDED to
                                        dk / dv (straight-through: the alternative is a function of k/v) */
    int window, pos0;                /* sliding window (attention.h kvq_attn_key_lo); window 0 = none */
} kvq_attn_grad_args;

/* Same, float64. */
typedef struct {
    int T, P, n_heads, n_kv_heads, head_dim;
    const double *q, *k, *v;
    const double *pk, *pv;
    const double *kq; const int *kb;
    const double *vq; const int *vb;
    double *out, *lse;
    const double *dout;
    double *dq, *dk, *dv;
    double *dpk, *dpv;
    double *dkq, *dvq;
    int window, pos0;
} kvq_attn_grad_args_f64;

typedef struct {
    int max_T, max_P, n_heads, n_kv_heads, head_dim, n_threads;
    size_t elem;        /* sizeof(float) or sizeof(double) */
    void *kt;           /* [n_kv_heads][head_dim][max_P+max_T] keys transposed (prefix then window) */
    void *kqt;          /* [n_kv_heads][head_dim][max_T] alternative keys transposed */
    void *D;            /* [n_heads][max_T] do . o */
    void *dqp;          /* [ceil((max_P+max_T)/BK)][max_T][g_chunk * n_heads/n_kv_heads][head_dim] dq partials of one pass */
    int g_chunk;        /* kv heads per pass: all of them unless their partials would exceed KVQ_ATTN_BWD_DQP_MAX bytes */
    void *scratch;      /* [n_threads][per-thread] rows and key-block buffers */
    size_t scratch_per_thread; /* elements */
} kvq_attn_grad_ws;

/* Allocate for up to max_T queries/window keys and max_P prefix keys, for
 * OpenMP n_threads; elem = sizeof(float) or sizeof(double). Errors:
 * KVQ_EINVAL, KVQ_ENOMEM. */
kvq_status kvq_attn_grad_ws_init(kvq_attn_grad_ws *ws, int max_T, int max_P, int n_heads, int n_kv_heads, int head_dim,
                                 int n_threads, size_t elem, kvq_err *err);
void kvq_attn_grad_ws_free(kvq_attn_grad_ws *ws);

/* Forward with lse: fills a->out and a->lse. Errors: KVQ_EINVAL (sizes
 * beyond the workspace, wrong element size, malformed boundaries). */
kvq_status kvq_attn_fwd_lse(const kvq_attn_grad_args *a, kvq_attn_grad_ws *ws, kvq_err *err);
kvq_status kvq_attn_fwd_lse_f64(const kvq_attn_grad_args_f64 *a, kvq_attn_grad_ws *ws, kvq_err *err);

/* Backward: needs a->out and a->lse from kvq_attn_fwd_lse on the same inputs
 * and a->dout; fills dq, dk, dv (and dkq, dvq, dpk, dpv when given). */
kvq_status kvq_attn_bwd(const kvq_attn_grad_args *a, kvq_attn_grad_ws *ws, kvq_err *err);
kvq_status kvq_attn_bwd_f64(const kvq_attn_grad_args_f64 *a, kvq_attn_grad_ws *ws, kvq_err *err);

#endif
