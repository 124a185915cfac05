/* attention.h — causal grouped-query attention over one window, with an
 * optional full-precision prefix and an optional second ("quantized") K/V
 * representation selected per (query, key) by a boundary.
 *
 * Keys are indexed in one sequence of P + T entries: the P prefix entries
 * (IntactKV; every query attends them, always in full precision) followed by
 * the T window entries. Window query i (0-based) attends prefix keys 0..P-1
 * and window keys j <= i (causal). Query head h reads kv head
 * h / (n_heads / n_kv_heads) (GQA, Ainslie et al. 2023).
 *
 * Boundary (decode equivalence for position-dependent schemes, e.g. KIVI's
 * residual window and incomplete key groups): when kq/kb are given, query i
 * scores window key j with kq[j] if j < kb[i] and with k[j] if
 * kb[i] <= j <= i; likewise vq/vb for values. kb, vb must be non-decreasing
 * with 0 <= b[i] <= i+1 (kvq_attn_check_bounds). Each score uses exactly one of
 * the two representations, so the cost equals a plain pass.
 *
 * Sliding window: with a->window > 0, query i only attends keys less than
 * `window` positions back (kvq_attn_key_lo); masked keys get probability 0
 * and contribute nothing to the output, the statistics or the gradients.
 *
 * Numerics: scores q.k / sqrt(head_dim) in fp32, softmax with max subtraction,
 * probabilities and the P.V accumulation in fp32. No [T][T] matrix is ever
 * stored: each (head, query) row lives in a per-thread scratch of P + T floats,
 * so a backward pass can recompute rows on demand.
 */
#ifndef KVQ_ATTENTION_H
#define KVQ_ATTENTION_H

#include "status.h"

typedef struct {
    int T;          /* window queries and window keys */
    int P;          /* prefix keys (0 = none) */
    int n_heads, n_kv_heads, head_dim;
    const float *q; /* [T][n_heads][head_dim], post-RoPE */
    const float *k; /* [T][n_kv_heads][head_dim], post-RoPE, the full-precision window keys */
    const float *v; /* [T][n_kv_heads][head_dim] */
    const float *pk, *pv; /* [P][n_kv_heads][head_dim] prefix K (post-RoPE) and V, or NULL when P == 0 */
    const float *kq; const int *kb; /* alternative keys [T][n_kv_heads][head_dim] + boundary [T], or both NULL */
    const float *vq; const int *vb; /* alternative values + boundary [T], or both NULL */
    float *out;     /* [T][n_heads][head_dim] output (attention-weighted values) */
    float *mass;    /* optional [n_heads][P+T]: sum over queries of the probability each key receives */
    float *entropy; /* optional [n_heads][T]: entropy of query i's attention distribution, nats */
    float *lse;     /* optional [n_heads][T]: log sum_j exp(score_j) of query i's row (scores as above, i.e.
                       scaled), for the backward pass (attention_backward.h); added by the backward helper */
    int window;     /* > 0: sliding window (kvq_attn_key_lo); 0 = full causal attention */
    int pos0;       /* position of window query/key 0 (prefix entry j is at position j); used with window */
} kvq_attn_args;

/* Sliding window (Mistral; HF sliding_window_overlay: key position > query
 * position - window). Window query i sits at position pos0 + i, window key j
 * at pos0 + j, prefix key j at position j. Query i attends prefix keys
 * [*plo, P) and window keys [*wlo, i]; everything before is masked (its
 * probability is exactly 0). window <= 0: *plo = *wlo = 0. */
static inline void kvq_attn_key_lo(int window, int pos0, int P, int i, int *plo, int *wlo)
{
    if (window <= 0) {
        *plo = *wlo = 0;
        return;
    }
    long p = (long)pos0 + i - window + 1, w = (long)i - window + 1;
    *plo = p < 0 ? 0 : p > P ? P : (int)p;
    *wlo = w < 0 ? 0 : (int)w;
}

/* Scratch for kvq_attention, sized once for max_T window keys, max_P prefix
 * keys and n_threads OpenMP threads. */
typedef struct {
    int max_T, max_P, n_kv_heads, head_dim, n_threads;
    size_t kt_gs, kq_gs; /* floats per kv head in kt / kqt */
    float *kt;     /* [n_kv_heads][ceil((max_P+max_T)/16)][head_dim][16]: keys (prefix then window) in tiles of 16 keys */
    float *kqt;    /* [n_kv_heads][ceil(max_T/16)][head_dim][16]: alternative keys, same tiling */
    float *scores; /* [n_threads][4][max_P+max_T]: rows of up to 4 heads of one GQA group */
    double *acc;   /* [n_threads][4][max_P+max_T]: mass accumulators (stats mode) */
} kvq_attn_ws;

kvq_status kvq_attn_ws_init(kvq_attn_ws *ws, int max_T, int max_P, int n_kv_heads, int head_dim, int n_threads, kvq_err *err);
void kvq_attn_ws_free(kvq_attn_ws *ws);

/* Check a boundary array: non-decreasing, 0 <= b[i] <= i+1. `what` names it in the error. */
kvq_status kvq_attn_check_bounds(const int *b, int T, const char *what, kvq_err *err);

/* Run attention (see the header comment). Fails with KVQ_EINVAL when the sizes
 * exceed the workspace or a boundary is malformed. Deterministic: every output
 * and statistic is computed by one thread in a fixed order, whatever the
 * thread count. */
kvq_status kvq_attention(const kvq_attn_args *a, kvq_attn_ws *ws, kvq_err *err);

/* Attention over a per-key schedule of representations (forward.h,
 * kvq_kv_sched): query i reads window key j of KV head h (and its value) as
 * the representation the schedule gives for step i; prefix entries are
 * always the full-precision a->pk / a->pv. Query rows are attended in order
 * within a KV head (sched->step, when set, runs after each row and may change
 * later switch times), KV heads in parallel. a->k / a->v and the boundary
 * fields must be NULL; a->lse is not supported (no backward). Numerics are
 * kvq_attention's exactly: for the same keys a row gets the same scores,
 * probabilities, outputs and statistics bit for bit (scores over the tiled
 * key layout in d order, the same softmax, P.V in key order, prefix first),
 * so a schedule is decode-equivalent with the plain attention of a
 * token-by-token cache. Allocates its scratch (per call; O((P+T) head_dim)
 * floats per KV head). `layer` is passed to the step. Errors: KVQ_EINVAL
 * (sizes, a malformed schedule), KVQ_ENOMEM, any status a step returns. */
struct kvq_kv_sched;
kvq_status kvq_attention_sched(const kvq_attn_args *a, struct kvq_kv_sched *sched, int layer, int n_threads,
                               kvq_err *err);

#endif
