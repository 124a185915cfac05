/* forward.h — Llama-family transformer forward on CPU, batched over a window
 * of T tokens (prefill), with per-layer hooks for K/V observation and
 * K/V transformation (quantize→dequantize simulation).
 *
 * Per layer l, for the window's tokens t = 0..T-1 at positions pos0 + t
 * (Touvron et al. 2023, Llama; GQA: Ainslie et al. 2023):
 *   xn = RMSNorm(x; attn_norm)
 *   q = xn Wq^T (+ bq)  [T][n_heads][head_dim];  k_pre = xn Wk^T (+ bk), v = xn Wv^T (+ bv)  [T][n_kv_heads][head_dim]
 *   q, k_pre = RMSNorm_head(q; q_norm), RMSNorm_head(k_pre; k_norm)   (Qwen3 only: per head, over head_dim)
 *   q, k_post = RoPE(q), RoPE(k_pre)          (interleaved pairs, kvq_rope_apply)
 *   (K, V) -> transform hook (optional)       (pre- or post-RoPE keys, see kvq_hooks)
 *   a = CausalGQA(q, [prefix K | K], [prefix V | V])   (kvq_attention; a sliding window in the model's
 *                                              sliding layers, kvq_layer_window: keys more than W-1 positions
 *                                              back are masked, as HF's sliding_window_overlay does)
 *   observe hook (optional)
 *   x += a Wo^T (+ bo)
 *   x += SwiGLU(RMSNorm(x; ffn_norm)) Wdown^T,  SwiGLU(h) = silu(h Wgate^T) * (h Wup^T)
 * then logits = RMSNorm(x; out_norm) Wout^T (Wout = tok_embd when tied).
 * Activations are fp32; GEMMs through cblas_sgemm (weights not stored in
 * fp32 are converted block by block first, kvq_linear_mat); attention in fp32.
 * The biases and norms of the optional parts are NULL for Llama, so the
 * Llama path is unchanged. The pre-RoPE key k_pre that hooks, the dump and
 * the Fisher information see is the key after bias and k-norm.
 *
 * Threads: GEMMs use OpenBLAS's threads (OPENBLAS_NUM_THREADS, default = cores);
 * attention and the per-row NLL use OpenMP (OMP_NUM_THREADS, default = cores),
 * with the count fixed at kvq_forward_init, one parallel region per layer;
 * elementwise ops run on the calling thread. On machines shared with other
 * work, OMP_WAIT_POLICY=passive keeps idle OpenMP workers from spinning against
 * OpenBLAS's threads. Results do not depend on the OpenMP thread count (each
 * output row is computed by one thread in a fixed order); kvq's own kernels
 * give the same bits on every vector ISA (kernels/model/simd.h), OpenBLAS's sgemm
 * may round differently on different CPUs.
 *
 * Memory: one workspace per kvq_forward, allocated by kvq_forward_init for at
 * most max_T window tokens and max_P prefix entries; kvq_forward_run allocates
 * nothing. When no logits are requested, the LM head is computed in vocabulary
 * blocks of fw->v_chunk rows of Wout (one GEMM per block over all T tokens,
 * online log-sum-exp in double), so the [T][vocab] logits are never
 * materialised and the LM-head weights are streamed once per window.
 *
 * Checkpointing contract (for the backward pass, issue 4): with
 * KVQ_FWD_SAVE_LAYER_INPUTS, run() stores the residual stream entering every
 * layer and the one leaving the last layer, kvq_forward_layer_input(fw, l)
 * [T][dim] for l = 0..n_layers (l = n_layers: input of the final norm). These
 * n_layers+1 tensors, the tokens, pos0, the prefix and the hooks are all a
 * backward pass needs: layer l is recomputed from its input (projections, RoPE,
 * the transform hook — which must be deterministic —, attention rows on demand,
 * MLP), one layer at a time, in reverse order. Nothing else of the forward is
 * kept alive between layers. With KVQ_FWD_SAVE_ACTIVATIONS the forward also
 * keeps every layer's activations (kvq_forward_layer_acts: post-RoPE q, the
 * K/V attention used with their alternatives, attention output and per-row
 * log-sum-exp, the residual after attention, gate/up), so that the backward
 * recomputes nothing; this costs memory copies in the forward and
 * ~1.37 GB at T = 2048 for SmolLM2-135M (backward.h).
 */
#ifndef KVQ_FORWARD_H
#define KVQ_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "attention.h"
#include "model.h"
#include "status.h"

/* Which keys the transform hook receives and returns. */
typedef enum {
    KVQ_KEYS_PRE_ROPE = 0, /* keys before RoPE; RoPE is applied to the transformed keys (KVQuant default) */
    KVQ_KEYS_POST_ROPE = 1 /* keys after RoPE (KIVI, "+post-rope") */
} kvq_key_stage;

/* What a hook knows about the current layer call. Token t of the window has
 * absolute position pos0 + t; with a prefix, normally pos0 == P. */
typedef struct {
    int layer;   /* 0 .. n_layers-1 */
    int T;       /* window tokens */
    int pos0;    /* position of window token 0 */
    int P;       /* prefix entries attended before the window (0 = none) */
    int n_heads, n_kv_heads, head_dim;
    const int *tokens; /* [T] window token ids */
    int n_layers;      /* the model's layers (0 = unknown: contexts built by hand); families with a per-layer
                          policy read it (turboquant's boundary layers) */
} kvq_layer_ctx;

/* Observed tensors of one layer; all row-major fp32, valid only during the call. */
typedef struct {
    const float *q;      /* [T][n_heads][head_dim], post-RoPE */
    const float *k_pre;  /* [T][n_kv_heads][head_dim], before RoPE, as the model computed it (not transformed) */
    const float *k_post; /* [T][n_kv_heads][head_dim], RoPE(k_pre) (not transformed) */
    const float *v;      /* [T][n_kv_heads][head_dim], not transformed */
    const float *k_att;  /* [T][n_kv_heads][head_dim]: the post-RoPE keys attention used (== k_post without a transform) */
    const float *v_att;  /* [T][n_kv_heads][head_dim]: the values attention used (== v without a transform) */
    /* The transform's alternative representation (post-RoPE keys) and its
     * boundaries, when it supplied one (kvq_kv_alt), else NULL: */
    const float *k_alt, *v_alt; /* [T][n_kv_heads][head_dim] */
    const int *k_bound, *v_bound; /* [T] */
    const struct kvq_kv_sched *sched; /* the transform's per-key schedule (post-RoPE keys), else NULL */
    /* Only when kvq_hooks.attn_stats is set, else NULL: */
    const float *attn_mass;    /* [n_heads][P+T]: sum over the window's queries of the attention probability each key
                                  (prefix keys first, then window keys) receives */
    const float *attn_entropy; /* [n_heads][T]: entropy of each query's attention distribution, nats */
} kvq_layer_obs;

/* A per-key schedule of representations (the general form of decode
 * equivalence, kernels/schemes/family.h "cache-simulation contract" 3): key j
 * of KV head h is read by query i as representation
 *     r = #{ r' in 1..n-1 : from[(r'-1)][h][j] <= i }
 * (0 before its first switch), so every (KV head, token) changes
 * representation at query steps of its own, never back (from[] non-decreasing
 * in r'). Values likewise with v_from. Representation buffers are
 * [T][n_kv_heads][head_dim] in the hook's key stage; pre-RoPE keys get RoPE
 * applied by the forward (in place, once per distinct buffer). The arrays
 * belong to the transform (its run state) and must stay valid until the
 * layer's attention returns.
 * step (optional): called after query row i of KV head h has been attended
 * (all query heads of its GQA group), with the attention probabilities the
 * simulated cache produced; it may change from[][h][j] for j <= i to values
 * > i (decisions take effect at later queries only). Calls for different KV
 * heads may run concurrently: a step must touch only head h's state.
 * Selection form (k_sel / v_sel instead of k_from / v_from, per side): the
 * representation key j of head h holds now, sel[h][j] in 0..n-1 (the
 * transform sets the initial values, read when key j joins at step j); a step
 * after query row i may set sel[h][j] for any j <= i to any representation,
 * also back to an earlier one (QAQ's re-quantization from the full-precision
 * copy), read from query i + 1 on. The attention refuses a value out of range. */
#define KVQ_KV_MAX_REPS 12

typedef struct {
    int layer;
    int i;             /* window query row just attended */
    int kv_head;       /* h */
    int T, P;          /* window tokens, prefix entries */
    int n_q;           /* query heads of the group (h * n_q .. h * n_q + n_q - 1) */
    const float *probs;/* [n_q][P + i + 1]: probabilities (prefix keys first), each (float)(exp / sum) in double */
} kvq_sched_step;

/* The declarative form of a schedule's step (optional): the attention-importance
 * policy of kernels/schemes/importance.h, described so that a device can run
 * it without the host callback (the CUDA forward, kernels/cuda/cuda_sched.cu).
 * With it the schedule has n_k = n_v = 3 (0 exact, 1 high, 2 low), k_from ==
 * v_from ([2][n_kv_heads][T]: first query reading the high / low representation,
 * every entry T on entry) and `step` implements exactly this policy; a device
 * run leaves in k_from the switch times the steps would have left and writes
 * the realised counts the steps write. Values are already clipped to the
 * window (window, n_sink <= T). */
typedef struct {
    double budget;  /* f: capacity floor(f (i + 2)) + 1e-9 margin, kvq_imp_capacity */
    int window;     /* W >= 1 */
    int n_sink;     /* exact sink tokens */
    bool normalise; /* importance = accumulated attention / voting queries that could attend */
    double probe;   /* 0: every query votes, else kvq_imp_is_probe(i, probe) */
    uint64_t *counts; /* [n_kv_heads][4] out: elements, sink, exact, high of the resting cache the last query read */
} kvq_sched_imp;

/* The declarative form of a selection-form step (optional; forward.h's selection form, k_sel / v_sel): a
 * per-(side, KV head, token) choice among representations 0 (exact) and 1..n_lv (one quantizer at widths
 * lo .. lo + n_lv - 1 bits: representation r holds width lo + r - 1), decided after every query row i from
 * the attention the simulated cache produced (QAQ's rule, kernels/schemes/qaq.c; the CUDA forward runs it on
 * the device, kernels/cuda/cuda_sched.cuh). Per KV head h, after query row i:
 *   a[i][j] = the largest probability of the group's query heads for window key j (the step's probs);
 *   tokens j < n_sink and j > i are left as they are (the transform sets every sel to 0: sinks exact, a new
 *   token read exact by its own query);
 *   a token with fewer than `window` rows (i - j + 1 < window) holds representation `young`;
 *   any other j <= i: S_j = max of a[i'][j] over i' in (i - window, i], and for each side w
 *       x = (double)range[w][j][h]                                 (attn[w] false)
 *       x = (double)range[w][j][h] * (double)S_j * root[i]          (attn[w] true, left to right)
 *       sel = 1 + (the smallest b in [lo, lo + n_lv - 1) with x <= ldexp(unit[w][h][i], b), else lo + n_lv - 1) - lo.
 * The decisions are read from query i + 1 on; a representation may fall or rise at any step. The
 * comparisons are in double on the values given (the host computes the units and roots: both devices read
 * the same bits). With it the schedule has k_sel and v_sel, n_k == n_v == n_lv + 1, and `step` implements
 * exactly this rule; a device run leaves in k_sel / v_sel the selections the last step left, and writes
 * the realised counts the steps write. */
typedef struct {
    int n_sink;            /* tokens j < n_sink are never touched */
    int window;            /* N >= 1 (clipped to T) */
    int young;             /* representation of a token with fewer than N rows, 0..n_lv */
    int n_lv, lo;          /* representations 1..n_lv at widths lo .. lo + n_lv - 1 bits */
    bool attn[2];          /* keys (0) / values (1): x scales with S_j root[i] */
    const float *range;    /* [2][T][n_kv_heads]: x's base per side, token, head (QAQ: the dense range max - min) */
    const double *unit;    /* [2][n_kv_heads][T]: u per side, head, query row */
    const double *root;    /* [T]: the factor of S_j at query row i (QAQ: sqrt(P + i + 2)) */
    const unsigned short *nout; /* [2][T][n_kv_heads]: exact outliers of a quantized vector (counts only) */
    /* out: per side and head, of the resting cache the last query read (the selections before the last
     * step): elements, sink, exact (sel 0, not sink), outliers (nout of the quantized), code bits
     * ((lo + sel - 1) head_dim of the quantized) */
    uint64_t *counts;      /* [2][n_kv_heads][5] */
    signed char *trace;    /* NULL, or out [2][n_kv_heads][T][T]: the representation query i read for key j <= i
                              (checks; a device run fills it, a host step does not) */
} kvq_sched_sel;

typedef struct kvq_kv_sched {
    int n_k, n_v;                  /* representations of keys / values, 1..KVQ_KV_MAX_REPS */
    float *k[KVQ_KV_MAX_REPS];     /* [T][n_kv_heads][head_dim] each */
    float *v[KVQ_KV_MAX_REPS];
    int *k_from, *v_from;          /* [n - 1][n_kv_heads][T] (NULL when n == 1 or with sel); may be the same array */
    signed char *k_sel, *v_sel;    /* [n_kv_heads][T]: the selection form (above), else NULL */
    kvq_status (*step)(void *user, const kvq_sched_step *st, struct kvq_kv_sched *sched, kvq_err *err);
    void *user;
    const kvq_sched_imp *imp;      /* the step's declarative form, or NULL (host steps only) */
    const kvq_sched_sel *sel;      /* the selection form's declarative step, or NULL */
} kvq_kv_sched;

/* The representation index query i reads for key j of head h (n reps, from as above). */
static inline int kvq_sched_rep(const int *from, int n, int n_kv_heads, int T, int h, int j, int i)
{
    int r = 0;
    for (int s = 1; s < n; s++)
        if (from[((size_t)(s - 1) * n_kv_heads + h) * T + j] <= i) r = s;
    return r;
}

/* Decode-equivalence support: a second (quantized) representation of the
 * window's K and/or V, and per-query boundaries. Query i uses the alternative
 * for window keys j < k_bound[i] (values: j < v_bound[i]) and the primary
 * (full-precision) K/V for k_bound[i] <= j <= i. Bounds must be non-decreasing
 * with 0 <= b[i] <= i+1. The buffers are owned by the forward workspace: the
 * transform fills them and sets use_k / use_v. Alternative keys are in the same
 * stage (pre-/post-RoPE) as the hook's keys; pre-RoPE ones get RoPE applied.
 * Or, for the general form, the transform points sched at its own schedule
 * (then k, v and use_k / use_v are ignored; no backward pass). */
typedef struct {
    float *k;     /* [T][n_kv_heads][head_dim] */
    int *k_bound; /* [T] */
    bool use_k;
    float *v;     /* [T][n_kv_heads][head_dim] */
    int *v_bound; /* [T] */
    bool use_v;
    kvq_kv_sched *sched; /* a per-key schedule (NULL: in place or the boundaries above) */
} kvq_kv_alt;

struct kvq_prefix;

/* Per-layer hooks. Any callback may be NULL. No global state: everything the
 * hook needs travels in `user`. A callback returning non-OK aborts the run with
 * its status and err message (prefixed with the layer). */
typedef struct {
    void *user;
    /* Called after attention, before the output projection. */
    kvq_status (*observe)(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err);
    bool attn_stats; /* compute attn_mass/attn_entropy for observe (costs a little parallelism) */
    /* Called before attention with copies of the layer's keys (stage per
     * key_stage) and values, [T][n_kv_heads][head_dim], to be replaced in place
     * by their quantize→dequantize reconstruction; `alt` optionally receives a
     * second representation with boundaries (see kvq_kv_alt). Prefix entries
     * are never passed to the transform. */
    kvq_status (*transform)(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt, kvq_err *err);
    kvq_key_stage key_stage;
    /* A window in steps (kvq_engine_run; kvq_forward_run itself ignores both): for a transform whose cache
     * entry of token j depends on states computed after j's own layer call (cross-layer merging: layer l
     * stores a state shared with layer l+1), the window runs as calls of at most `chunk` tokens (pos0 +
     * the tokens already run); before every call but the first, `cache` gives the cache the transform
     * built for the P tokens already run (per layer, P post-RoPE keys and values, kvq_prefix), attended
     * as that call's prefix. chunk == 1 is a token-by-token decode; 0 = the whole window in one call. */
    int chunk;
    kvq_status (*cache)(void *user, int P, struct kvq_prefix *out, kvq_err *err);
    /* Attention from an external KV cache (kernels/decode/decode.h: the packed runtime cache), instead of the
     * forward's own causal attention, transform and observe. Called once per layer with the window's post-RoPE
     * queries q [T][n_heads][head_dim] and the layer's new keys and values [T][n_kv_heads][head_dim] (k_pre
     * before RoPE, k_post = RoPE(k_pre) at the row's position, v), after the projections, biases and q/k norms
     * of the model; it writes the attention output out [T][n_heads][head_dim]. The rows of the window are then
     * independent (no causal attention among them): row t may be another sequence, at position io->pos[t].
     * Not with transform, observe, a prefix or a workspace that keeps activations (KVQ_EINVAL). On the CUDA
     * forward (forward_cuda.h) the five pointers are device memory: the forward's stream is synchronised
     * before the call, and the callback's device work must be complete when it returns. */
    kvq_status (*attend)(void *user, const kvq_layer_ctx *ctx, const float *q, const float *k_pre, const float *k_post,
                         const float *v, float *out, kvq_err *err);
} kvq_hooks;

/* A cached full-precision prefix (IntactKV): per layer, P entries of post-RoPE
 * keys (at positions 0..P-1) and values. Attended by every window query in
 * every layer, never transformed. */
typedef struct kvq_prefix {
    int P;
    const float *k; /* [n_layers][P][n_kv_heads][head_dim], post-RoPE */
    const float *v; /* [n_layers][P][n_kv_heads][head_dim] */
} kvq_prefix;

enum {
    KVQ_FWD_SAVE_LAYER_INPUTS = 1u << 0, /* keep [n_layers+1][T][dim] residual checkpoints (see header comment) */
    /* also keep every layer's activations (kvq_fwd_layer_acts) so that a
     * backward pass need not recompute them: ~(2 q_dim + 4 kv_dim + dim +
     * 2 hidden_dim + n_heads) * 4 B per token and layer (1.37 GB for
     * SmolLM2-135M at T = 2048). Implies KVQ_FWD_SAVE_LAYER_INPUTS. */
    KVQ_FWD_SAVE_ACTIVATIONS = 1u << 1,
    /* Batch invariance: every linear layer (and the LM head) as one M = 1
     * GEMM per token row, so that a token's activations are the same bits
     * however many tokens share the call (a window of 48 or a decode step of
     * 1). OpenBLAS's sgemm may round a row differently at M = 48 than at
     * M = 1 (kernel choice, remainder paths); attention, norms and the NLL are
     * per row already. For exact decode-equivalence checks (tests/test_kveval.c);
     * slower (every weight is read once per row). */
    KVQ_FWD_ROW_INVARIANT = 1u << 2
};

/* Optional LM-head outputs for comparing the next-token distributions of two
 * runs over the same tokens without keeping [T][vocab] logits (kveval's KL
 * divergence and top-1 agreement). Rows are the scored positions (target >= 0);
 * other rows get NaN / -1 / nothing. Any pointer may be NULL.
 *   KL(P || Q) of row t, P from run a (with expect), Q from run b:
 *     sum_v P_v (log P_v - log Q_v) = (h_a - h_b) . e_a - lse_a + lse_b
 *   since log P_v = z_v - lse, z = Wout h and e_a = sum_v P_v Wout[v].
 * Computed in the LM head's vocabulary blocks: the running maximum rescales the
 * accumulated expectation as it grows (online softmax), so nothing of size
 * [T][vocab] is stored. */
typedef struct {
    float *hidden;  /* out [T][dim]: the final RMSNorm's output (the LM head's input), every row */
    double *lse;    /* out [T]: log sum_v exp(logit_v), nats, in double; NaN on rows not scored */
    int *argmax;    /* out [T]: the first index of the largest logit (llama.cpp's "top token"); -1 on rows not scored */
    float *expect;  /* out [T][dim]: e = sum_v softmax(logits)_v Wout[v] on scored rows (others untouched);
                       costs one more GEMM of the LM head's size over the scored rows */
} kvq_fwd_head;

/* One call's inputs and outputs. */
typedef struct {
    const int *tokens;  /* [T] token ids in [0, vocab) */
    int T;              /* 1 .. max_T */
    int pos0;           /* position of tokens[0] (>= 0) */
    /* Per-row positions [T] (only with hooks->attend, whose rows are independent sequences): row t at
     * pos[t] (>= 0) instead of pos0 + t. NULL = pos0 + t. */
    const int *pos;
    /* Targets: targets[t] is the token position t must predict, < 0 = not
     * scored. NULL: targets[t] = tokens[t+1] for t < T-1, last not scored. */
    const int *targets;
    const kvq_prefix *prefix; /* NULL = none */
    const kvq_hooks *hooks;   /* NULL = none */
    float *logits;      /* out, optional: [T][vocab_size] */
    double *nll;        /* out, optional: [T] per-position NLL in nats (NaN where not scored) */
    kvq_fwd_head *head; /* out, optional: LM-head outputs (see kvq_fwd_head); NULL = none */
    /* Skip the LM head (ignored when logits are requested): res->loss = NaN,
     * io->nll not written, res->n_scored still counted. For a caller that
     * computes the loss itself (kvq_backward_run recomputes it in its own
     * LM-head pass). */
    bool skip_loss;
} kvq_fwd_io;

typedef struct {
    double loss;   /* mean NLL over scored positions (nats; NaN when none) */
    int n_scored;
} kvq_fwd_result;

/* The forward workspace (opaque in spirit: read-only for callers). */
typedef struct {
    const kvq_model *m;
    int max_T, max_P, n_threads;
    unsigned flags;
    int T_last;           /* T of the last successful run (for layer_input) */
    /* activations, one window */
    float *x;             /* [max_T][dim] residual stream */
    float *xn;            /* [max_T][dim] normed */
    float *q;             /* [max_T][q_dim] */
    float *k_pre, *k_post, *v;  /* [max_T][kv_dim] */
    float *k_att, *v_att;       /* [max_T][kv_dim] transform outputs */
    float *k_alt, *v_alt;       /* [max_T][kv_dim] alternative representations */
    int *k_bound, *v_bound;     /* [max_T] */
    float *att;           /* [max_T][q_dim] attention output */
    float *gate, *up;     /* [max_T][hidden_dim] */
    int v_chunk;          /* vocabulary block of the loss-only LM head; a caller may lower it (1..v_chunk_max) */
    int v_chunk_max;      /* set by init: min(vocab, clamp(2^22 / max_T, 256, 8192)) */
    float *logit_blk;     /* [max_T][v_chunk_max] */
    float *row_max, *row_tgt;   /* [max_T] online log-sum-exp state: running max, target logit */
    double *row_sum;      /* [max_T] running sum of exp(logit - max) */
    float *rope_cos, *rope_sin; /* [max_T][rope_dim/2] */
    float *mass, *entropy;      /* [n_heads][max_P+max_T], [n_heads][max_T] */
    float *saved;         /* [n_layers+1][max_T][dim] when KVQ_FWD_SAVE_LAYER_INPUTS */
    int *def_targets;     /* [max_T] */
    float *acts;          /* [n_layers][act_stride] when KVQ_FWD_SAVE_ACTIVATIONS (see kvq_forward_layer_acts) */
    size_t act_stride;    /* floats per layer */
    int *act_bounds;      /* [n_layers][2][max_T] boundaries of the alternative K / V */
    unsigned char *act_alt; /* [n_layers]: bit 0 alternative keys used, bit 1 alternative values used */
    float *wscratch;      /* [wscratch_floats] fp32 rows of a non-fp32 weight matrix (kvq_linear_mat), NULL for fp32 models */
    size_t wscratch_floats;
    kvq_attn_ws attn;
    float *arena;         /* owns every float buffer above */
    int *iarena;
} kvq_forward;

/* Allocate the workspace for windows of up to max_T tokens after up to max_P
 * prefix entries. flags: KVQ_FWD_*. The model must outlive the workspace.
 * Errors: KVQ_EINVAL (sizes), KVQ_ENOMEM. */
kvq_status kvq_forward_init(kvq_forward *fw, const kvq_model *m, int max_T, int max_P, unsigned flags, kvq_err *err);
void kvq_forward_free(kvq_forward *fw);

/* Run one window. Errors: KVQ_EINVAL (T, pos0, token id, target id, prefix
 * size out of range; malformed boundaries from a transform), any status a hook
 * returns, KVQ_ENUMERIC when a scored position's NLL is not finite (the message
 * names the position). io->nll and io->logits are filled even then. */
kvq_status kvq_forward_run(kvq_forward *fw, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err);

/* io->pos's rules, the CPU and the CUDA forward alike: per-row positions need an attend hook (attend: the run
 * has io->hooks->attend; the rows are independent sequences), each of the T rows' in [0, INT32_MAX). KVQ_EINVAL
 * naming the rule or the row otherwise. */
kvq_status kvq_fwd_check_pos(const kvq_fwd_io *io, int T, bool attend, kvq_err *err);

/* One pipeline stage of kvq_forward_run (pipeline.h): layers l0 .. l1-1 of
 * the window io. l0 == 0: from the token embeddings (x_in ignored); else from
 * x_in [T][dim], the residual stream entering layer l0 (the previous stage's
 * kvq_forward_stage_output; may be fw->x itself). l1 == n_layers: the final
 * norm and LM head follow as in kvq_forward_run (res, io->nll, io->logits,
 * io->head); else they are skipped (res->loss NaN, res->n_scored counted) and
 * the stream leaving layer l1-1 is kvq_forward_stage_output. Hooks see layers
 * l0 .. l1-1. Checkpoints (KVQ_FWD_SAVE_*) are written for layers l0 .. l1
 * only. kvq_forward_run(fw, io, ...) is kvq_forward_stage(fw, io, 0,
 * n_layers, NULL, ...): one code path, so that staging changes no bit.
 * Errors: those of kvq_forward_run; KVQ_EINVAL for a layer range outside
 * 0 <= l0 < l1 <= n_layers or l0 > 0 without x_in. */
kvq_status kvq_forward_stage(kvq_forward *fw, const kvq_fwd_io *io, int l0, int l1, const float *x_in, kvq_fwd_result *res,
                             kvq_err *err);
/* The residual stream leaving the last stage run, [T][dim] (valid until the next run). */
static inline const float *kvq_forward_stage_output(const kvq_forward *fw) { return fw->x; }

/* kvq_fwd_head from full logits [T][vocab] (the io->logits path of both
 * devices): lse, argmax and expect of the scored rows (targets[t] >= 0;
 * targets NULL: every row but the last), hidden copied from xn [T][dim] when
 * both are given. Errors: KVQ_ENOMEM. */
kvq_status kvq_fwd_head_from_logits(const kvq_model *m, const float *logits, const float *xn, const int *targets, int T,
                                    kvq_fwd_head *head, kvq_err *err);

/* Residual stream entering layer l (l = n_layers: entering the final norm),
 * [T][dim] for the last run's T; NULL unless KVQ_FWD_SAVE_LAYER_INPUTS. */
const float *kvq_forward_layer_input(const kvq_forward *fw, int l);

/* One layer's activations as the last run computed them (all fp32,
 * row-major, T = the last run's T): valid until the next run. */
typedef struct {
    const float *q;        /* [T][n_heads][head_dim], post-RoPE */
    const float *k, *v;    /* [T][n_kv_heads][head_dim]: the post-RoPE keys and the values attention used (transformed) */
    const float *kq, *vq;  /* alternative keys (post-RoPE) / values, or NULL when the transform gave none */
    const int *kb, *vb;    /* [T] their boundaries, or NULL */
    const float *att;      /* [T][n_heads][head_dim] attention output */
    const float *lse;      /* [n_heads][T] per-row log-sum-exp of the scaled scores (attention.h) */
    const float *x_mid;    /* [T][dim] residual stream after the attention block */
    const float *gate, *up; /* [T][hidden_dim] xn Wgate^T and xn Wup^T (before SwiGLU) */
} kvq_fwd_layer_acts;

/* Fill *out with layer l's activations of the last run; returns false (and
 * leaves *out untouched) unless the workspace has KVQ_FWD_SAVE_ACTIVATIONS
 * and a run succeeded. */
bool kvq_forward_layer_acts(const kvq_forward *fw, int l, kvq_fwd_layer_acts *out);

/* FLOPs of one window (multiply-add = 2): 2 * (matmul parameters incl. the LM
 * head) * T + causal attention 4 * n_heads * head_dim * sum_i (P + i + 1). */
double kvq_forward_flops(const kvq_hparams *hp, int T, int P);

#endif
