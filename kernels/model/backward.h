/* backward.h — reverse-mode gradients through the Llama forward (forward.h)
 * with frozen weights: dL/dK (pre- and post-RoPE), dL/dV of every layer and
 * dL/d(prefix K, V), for KVQuant's Fisher information (Hooper et al. 2024,
 * KVQuant §3.2 / App. C: element-wise squared gradients of the LM loss w.r.t.
 * the pre-RoPE keys and the values) and IntactKV's prefix calibration (Liu
 * et al. 2024, IntactKV §3.2: the cached prefix K/V as trainable parameters).
 * No weight gradient is ever computed.
 *
 * Loss. L = [xent] mean next-token cross-entropy over the scored positions of
 * the kvq_fwd_io (io->targets, same rule as the forward)
 *         + [upstream] any loss on the layer outputs whose gradient the caller
 *           supplies through kvq_bwd_spec.upstream.
 * The second term is the generic entry point for IntactKV's training loss
 * ½ Σ_l ||f_l(full precision) − f_l(quantized, trainable prefix)||², f_l =
 * the residual stream leaving layer l: run the full-precision model once with
 * KVQ_FWD_SAVE_LAYER_INPUTS and keep kvq_forward_layer_input(fw, l + 1)
 * (= f_l) for l = 0..n_layers-1; then call kvq_backward_run with the
 * quantizing transform, the prefix, xent = false and an upstream callback that
 * does dx_out[t][c] += x_out[t][c] − f_l_fp[t][c] (and adds ½ Σ (…)² to its
 * own loss); the grads callback then receives dL/d(prefix K, V) per layer.
 *
 * Straight-through transform. When io->hooks->transform is set (quantize →
 * dequantize simulation), the backward treats it as the identity (straight-
 * through estimator, Bengio et al. 2013): the gradient w.r.t. the model's own
 * K/V equals the gradient w.r.t. the transformed K/V attention used, plus the
 * gradient w.r.t. the alternative representation (kvq_kv_alt) when one was
 * supplied. Because RoPE is linear and orthogonal, the result is the same for
 * both key stages: dK_post = gradient w.r.t. the post-RoPE keys attention
 * read; dK_pre = RoPE^-1(dK_post). Prefix entries are never transformed and
 * get their exact gradient (they are post-RoPE keys; dpk is w.r.t. those).
 * Without a transform the gradients are exact.
 *
 * Checkpointing and memory. kvq_backward_run first runs the ordinary forward
 * (the user's hooks, including observe and transform, see every layer once).
 * Two policies (kvq_backward_init_opts; both give bit-identical results,
 * tested):
 *  - keep (default when the store needs <= KVQ_BWD_KEEP_ACTS_MAX bytes): the
 *    forward runs with KVQ_FWD_SAVE_ACTIVATIONS and keeps, per layer, the
 *    post-RoPE q, the K/V attention used (and their alternative
 *    representation and boundaries), the attention output and its per-row
 *    log-sum-exp, the residual after attention and the gate/up projections
 *    (kvq_fwd_layer_acts), plus the n_layers+1 residual streams [T][dim]; the
 *    backward then recomputes nothing and calls the transform hook once.
 *    Store: 4 B * T * n_layers * (2 q_dim + 4 kv_dim + dim + 2 hidden_dim +
 *    n_heads) = 1.37 GB for SmolLM2-135M at T = 2048.
 *  - recompute: the forward keeps only the residual streams
 *    (KVQ_FWD_SAVE_LAYER_INPUTS); for l = n_layers-1 .. 0, layer l is
 *    recomputed from its saved input (RMSNorm, projections, RoPE, the
 *    transform hook again — it must be deterministic —, attention
 *    (kvq_attention) with its per-row log-sum-exp, output projection, MLP up
 *    to SwiGLU) and immediately differentiated; only one layer's activations
 *    exist at a time.
 * Either way, layer l is differentiated for l = n_layers-1 .. 0, and the
 * attention probabilities are recomputed block by block in the backward
 * (attention_backward.h), never stored. With the cross-entropy (and no
 * io->logits requested) the forward skips its LM head (kvq_fwd_io.skip_loss):
 * the loss and io->nll come from the backward's LM-head pass, which computes
 * the gradient blockwise over the vocabulary with an online softmax
 * (kvq_lm_head_xent_bwd): [T][v_chunk] logits at a time. Memory for the
 * default model (SmolLM2-135M, T = 2048, P = 0, keep policy): model 0.54 GB
 * (fp32) + forward workspace with the 31 checkpoints (~0.15 GB) + activation
 * store (1.37 GB) + backward workspace (~0.1 GB of one layer's gradients, 151
 * MiB of attention dq partials, a 2048 x 2048 logit block): measured peak RSS
 * 2098 MiB (bench_backward without its forward-only workspace; 900 MiB with
 * the recompute policy). Per-layer
 * gradients are handed to a callback and not kept; kvq_grad_store collects
 * all layers when the caller wants them.
 *
 * Threads: GEMMs use OpenBLAS's threads; attention (forward recompute and
 * backward) and the LM head's exponentials use OpenMP; elementwise ops run on
 * the calling thread. Results do not depend on the OpenMP thread count.
 *
 * Cost (keep policy): forward without its LM head (plus copies of the
 * activations) + backward GEMMs (dX = dY W, no dW) + one LM-head pass (two
 * GEMMs per vocabulary block) + attention backward; the recompute policy adds
 * a second forward of every layer but the down projection. The attention
 * backward is the largest phase; the ratio to the forward is measured by
 * bench_backward (docs/BENCHMARKS.md).
 */
#ifndef KVQ_BACKWARD_H
#define KVQ_BACKWARD_H

#include <stdbool.h>

#include "attention_backward.h"
#include "forward.h"
#include "model.h"
#include "status.h"

/* Largest per-window activation store (bytes) for which kvq_backward_init
 * asks the forward to keep every layer's activations instead of recomputing
 * them (1.37 GB for SmolLM2-135M at T = 2048). */
#define KVQ_BWD_KEEP_ACTS_MAX (2.5 * 1024.0 * 1024.0 * 1024.0)

/* Gradients of one layer, valid only during the grads callback. All fp32,
 * row-major. */
typedef struct {
    int layer, T, P, n_kv_heads, head_dim;
    const float *dk_pre;  /* [T][n_kv_heads][head_dim] dL/dK before RoPE (the model's k_pre) */
    const float *dk_post; /* [T][n_kv_heads][head_dim] dL/dK after RoPE (= RoPE(dk_pre)) */
    const float *dv;      /* [T][n_kv_heads][head_dim] dL/dV */
    const float *dpk;     /* [P][n_kv_heads][head_dim] dL/d(prefix K, post-RoPE); NULL when P == 0 */
    const float *dpv;     /* [P][n_kv_heads][head_dim] dL/d(prefix V); NULL when P == 0 */
} kvq_layer_grads;

/* What to differentiate and where the gradients go. */
typedef struct {
    void *user;
    bool xent; /* include the mean next-token cross-entropy in L */
    /* Optional: called for l = n_layers-1 down to 0, before layer l is
     * differentiated, with x_out = the residual stream leaving layer l [T][dim]
     * and dx_out [T][dim] = dL/dx_out accumulated so far (from the cross-
     * entropy and later layers); the callback ADDS the gradient of its own loss
     * term w.r.t. x_out. */
    kvq_status (*upstream)(void *user, const kvq_layer_ctx *ctx, const float *x_out, float *dx_out, kvq_err *err);
    /* Optional: receives each layer's gradients, in the order n_layers-1 .. 0. */
    kvq_status (*grads)(void *user, const kvq_layer_grads *g, kvq_err *err);
    float *d_embd; /* optional out [T][dim]: dL/d(input embeddings) */
} kvq_bwd_spec;

typedef struct {
    double loss;      /* mean NLL over scored positions (NaN when none): with xent, from the backward's LM-head pass
                         (the forward skips its own unless io->logits is requested); else the forward's */
    int n_scored;
    double xent_loss; /* the cross-entropy computed by the backward's LM head (xent only, else NaN) */
} kvq_bwd_result;

/* Workspace: a forward (with checkpoints) and one layer of recomputed
 * activations and gradients. Read-only for callers except fw, whose
 * checkpoints (kvq_forward_layer_input) are valid after a run. */
typedef struct {
    kvq_forward fw;
    const kvq_model *m;
    int max_T, max_P, n_threads, v_chunk;
    bool keep_acts;       /* the forward keeps every layer's activations (KVQ_FWD_SAVE_ACTIVATIONS) */
    float *x_mid, *xn, *dx, *dxn;               /* [max_T][dim] */
    float *q, *att, *datt, *dq;                 /* [max_T][q_dim] */
    float *k_pre, *k_att, *v_att, *k_alt, *v_alt, *dk, *dv, *dk_pre; /* [max_T][kv_dim] */
    float *gate, *up, *dh;                      /* [max_T][hidden_dim] (gate, up: the forward workspace's, see init) */
    float *dpk, *dpv;                           /* [max_P][kv_dim] */
    float *lse;                                 /* [n_heads][max_T] */
    float *rope_cos, *rope_sin;                 /* [max_T][rope_dim/2] */
    float *zbuf;                                /* [max_T][v_chunk] */
    float *rmax, *rtgt;                         /* [max_T] */
    double *rsum, *nll;                         /* [max_T] */
    int *k_bound, *v_bound, *targets;           /* [max_T] */
    float *q_raw, *dq_raw;                      /* [max_T][q_dim] pre-norm q and its gradient (qk_norm only, else NULL) */
    float *k_raw, *dk_raw;                      /* [max_T][kv_dim] pre-norm k and its gradient (qk_norm only) */
    float *wscratch;                            /* the forward's block of converted weight rows (non-fp32 matrices) */
    size_t wscratch_floats;
    float *head_buf;                            /* [v_chunk][dim] converted LM-head rows (non-fp32 head only) */
    kvq_attn_grad_ws attn;     /* attention backward */
    kvq_attn_ws fattn;         /* recomputed attention forward (kvq_attention with lse) */
    /* the stage run by kvq_backward_stage_forward, awaiting its backward */
    kvq_fwd_result st_fr;
    bool st_skip;
    int st_l0, st_l1;
    /* wall seconds of the last run, by phase (profiling; not part of results) */
    double t_forward, t_head, t_recompute, t_attn_bwd, t_other_bwd;
    float *arena;
    int *iarena;
    double *darena;
} kvq_backward;

/* Allocate for windows of up to max_T tokens after up to max_P prefix
 * entries (the model must outlive the workspace). Errors: KVQ_EINVAL,
 * KVQ_ENOMEM. */
kvq_status kvq_backward_init(kvq_backward *bw, const kvq_model *m, int max_T, int max_P, kvq_err *err);
void kvq_backward_free(kvq_backward *bw);

/* As kvq_backward_init with the checkpointing policy chosen by the caller:
 * keep_acts = 1: the forward keeps every layer's activations
 * (KVQ_FWD_SAVE_ACTIVATIONS) and the backward recomputes nothing; 0: only
 * the residual checkpoints are kept and each layer is recomputed; -1:
 * automatic (kvq_backward_init): keep when the store needs at most
 * KVQ_BWD_KEEP_ACTS_MAX bytes. Both policies give bit-identical results. */
kvq_status kvq_backward_init_opts(kvq_backward *bw, const kvq_model *m, int max_T, int max_P, int keep_acts, kvq_err *err);

/* Forward (io, with its hooks and prefix; io->logits / io->nll filled as by
 * kvq_forward_run) then backward of the loss described by spec. Errors: those
 * of kvq_forward_run; KVQ_EINVAL when spec has neither xent nor upstream, or
 * xent with no scored position; any status a callback returns (the message
 * names the layer); KVQ_ENUMERIC when a gradient is not finite. */
kvq_status kvq_backward_run(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res, kvq_err *err);

/* kvq_backward_run in pipeline stages (pipeline.h): for a stage of layers
 * l0 .. l1-1, kvq_backward_stage_forward runs its forward (kvq_forward_stage
 * from x_in, the stream entering l0; NULL when l0 == 0) keeping what the
 * backward needs; then kvq_backward_stage_backward differentiates layers
 * l1-1 .. l0: from the LM head's cross-entropy when l1 == n_layers, else from
 * dx_in [T][dim] = dL/d(stream leaving layer l1-1), the next stage's
 * kvq_backward_stage_dx. Afterwards kvq_backward_stage_dx is dL/d(stream
 * entering l0). res: the loss fields as kvq_backward_run's (final on the last
 * stage). kvq_backward_run is the one stage 0 .. n_layers: the same code.
 * Errors: those of kvq_backward_run; KVQ_EINVAL for a backward whose forward
 * was not the same stage's last call, or a missing x_in / dx_in. */
kvq_status kvq_backward_stage_forward(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l0, int l1,
                                      const float *x_in, kvq_bwd_result *res, kvq_err *err);
kvq_status kvq_backward_stage_backward(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l0, int l1,
                                       const float *dx_in, kvq_bwd_result *res, kvq_err *err);
static inline const float *kvq_backward_stage_dx(const kvq_backward *bw) { return bw->dx; }

/* A ready-made grads callback that copies each layer into caller-owned
 * arrays (any may be NULL): [n_layers][T][n_kv_heads][head_dim] for dk_pre,
 * dk_post, dv, and [n_layers][P][n_kv_heads][head_dim] for dpk, dpv. Pass
 * the store as kvq_bwd_spec.user with .grads = kvq_grad_store_cb (for small
 * models and tests; the default model at T = 2048 needs 30*2048*192*4 B =
 * 47 MB per array). */
typedef struct {
    float *dk_pre, *dk_post, *dv, *dpk, *dpv;
} kvq_grad_store;
kvq_status kvq_grad_store_cb(void *user, const kvq_layer_grads *g, kvq_err *err);

/* Convenience: gradients of the mean next-token cross-entropy into a store. */
kvq_status kvq_backward_xent(kvq_backward *bw, const kvq_fwd_io *io, kvq_grad_store *store, kvq_bwd_result *res, kvq_err *err);

#endif
