/* intactkv.h — IntactKV (Liu et al. 2024, "IntactKV: Improving Large Language
 * Model Quantization by Keeping Pivot Tokens Intact", arXiv 2403.01241; notes
 * ../shared/docs/kivi-intactkv-mikv.md §2): the KV cache of a fixed prefix
 * (the BOS token, or a whole system prompt) computed once by the full-
 * precision model, attended by every later token and never quantized — and,
 * optionally, calibrated as trainable parameters against the quantized cache
 * (IntactKV_[P] + Cal, notes §2.4).
 *
 * Shapes (kv_dim = n_kv_heads * head_dim, channel c = h * head_dim + d):
 * prefix K/V are [n_layers][P][kv_dim] row-major float32, positions 0..P-1;
 * keys post-RoPE (what attention reads, kvq_prefix of kernels/model/forward.h) and
 * pre-RoPE (the projection output; for a trained prefix RoPE^-1 of the
 * trained post-RoPE keys). Stored in the calibration artifact
 * (kernels/schemes/artifact.h kvq_artifact_prefix, ARTIFACT.md "IntactKV prefix").
 *
 * Training objective (notes §2.4; IntactKV train_model.py): for a calibration
 * window x of T tokens placed after the prefix (positions P..P+T-1),
 *   L(x) = ½ Σ_l mean_{t,c} (f_l(x; quantized window K/V, trainable prefix)[t][c]
 *                             − f_l(x; full-precision K/V, the model's own prefix)[t][c])²
 * with f_l the residual stream leaving decoder layer l ([T][dim]), the mean
 * over the T×dim entries (the reference's per-layer MSE; this scale is what
 * its clipping threshold 0.3 refers to). The window K/V are quantized by the
 * caller's transform hook (the base scheme, decode-equivalent), differentiated
 * with the straight-through estimator (kernels/model/backward.h); the prefix is
 * never quantized. Trainable: the post-RoPE keys and values of the prefix in
 * every layer (the reference's per-layer K/V parameter). Adam (Kingma & Ba
 * 2015) with bias correction, no weight decay, constant learning rate, global
 * gradient-norm clipping on the step's gradient (torch clip_grad_norm_:
 * scale by clip / (norm + 1e-6) when norm > clip) — as the reference's HF
 * Trainer (paged AdamW 32-bit, weight decay 0, constant schedule).
 */
#ifndef KVQ_INTACTKV_H
#define KVQ_INTACTKV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "artifact.h"
#include "forward.h"
#include "model.h"
#include "status.h"
#include "text.h"
#include "tokenizer.h"

/* Tokenise a prefix. spec "bos": the tokenizer's BOS token alone (KVQ_EINVAL
 * if the vocabulary has none). Otherwise spec is text, encoded with
 * KVQ_TOK_PARSE_SPECIAL when special (chat prompts: "<|im_start|>system\n...")
 * and a BOS prepended when add_bos. Errors (KVQ_EINVAL): empty spec or no
 * tokens; a token outside [0, vocab_size) of the model ("prefix token 3 = 600
 * is outside the model's vocabulary [0, 512)"); the unknown token (the text
 * has characters the vocabulary cannot represent: "unknown prefix token at
 * 2"); P > max_P. *ids malloc'd [*P]. */
kvq_status kvq_intactkv_tokenize(const kvq_tokenizer *tok, const char *spec, bool special, bool add_bos, int vocab_size,
                                 size_t max_P, int32_t **ids, size_t *P, kvq_err *err);

/* Compute the prefix with the unquantized model: one forward over ids at
 * positions 0..P-1 (no hooks but an observer), recording every layer's
 * pre-RoPE keys, post-RoPE keys and values. px is filled (owned; free with
 * kvq_artifact_prefix_free): token_ids, positions 0..P-1, k, k_pre, v, text
 * (copied), special, trained = false. Errors: KVQ_EINVAL for P < 1,
 * P > ctx_len of the model ("prefix of 300 tokens exceeds the model's
 * context length 256"), a token outside the vocabulary; KVQ_ENOMEM. */
kvq_status kvq_intactkv_compute(const kvq_model *m, const int32_t *ids, size_t P, const char *text, bool special,
                                kvq_artifact_prefix *px, kvq_err *err);

/* A kvq_prefix view of px for the forward (pointers borrowed). */
kvq_prefix kvq_intactkv_view(const kvq_artifact_prefix *px);

/* Recompute px->k_pre = RoPE^-1(px->k) at positions 0..P-1 (after training
 * changed the post-RoPE keys). Channels >= rope_dim are copied. KVQ_ENOMEM. */
kvq_status kvq_intactkv_sync_pre_rope(const kvq_hparams *hp, kvq_artifact_prefix *px, kvq_err *err);

/* Check that a base artifact belongs to the model: fingerprint (model_fp,
 * kvq_identity_model) unless allow_mismatch (then a warning on warn), and
 * the shape (n_layers, n_kv_heads, head_dim). KVQ_EMISMATCH naming both. */
kvq_status kvq_intactkv_check_base(const kvq_artifact *base, const char *base_path, const kvq_model *m, const char *model_fp,
                                   bool allow_mismatch, FILE *warn, kvq_err *err);

/* Write art to out_path atomically: "<out_path>.tmp" then a no-replace
 * rename (or, with force, rename over). Refuses (KVQ_EIO) when out_path
 * exists and !force; on error out_path is untouched, no temporary is left. */
kvq_status kvq_intactkv_write(const char *out_path, bool force, const kvq_artifact *art, kvq_err *err);

/* ---- training (--train) ------------------------------------------------- */

/* Called after every optimizer step (1-based step of steps) with the step's
 * mean loss over its samples (before the update), the gradient norm before
 * clipping, and the seconds since the first step started. */
typedef void (*kvq_intactkv_step_fn)(void *ctx, size_t step, size_t steps, double loss, double grad_norm, double seconds);

typedef struct {
    size_t steps;            /* optimizer steps (>= 1) */
    size_t accum;            /* windows per step (gradient accumulation; >= 1) */
    double lr, beta1, beta2, eps, clip; /* Adam; clip <= 0: no clipping */
    uint64_t seed;           /* epoch shuffling (Python-compatible MT19937) */
    size_t target_cache_mib; /* cache the full-precision targets of all windows when they fit (0: recompute each time) */
    kvq_intactkv_step_fn on_step;
    void *on_step_ctx;
    /* Where the forward/backward passes run (kernels/model/device.h): "cpu", "cuda",
     * "cuda:N" or "auto"; NULL = "cpu". On a GPU: exactness mode (fp32, TF32
     * off); a quant hook's transform runs on the host (forward_cuda.h). */
    const char *device;
    char *device_desc;       /* optional out: the engine's description */
    size_t device_desc_len;
} kvq_intactkv_train_opts;

/* Defaults: the IntactKV reference (notes §2.4, intactkv_train.py +
 * train.sh): lr 2e-4, β1 0.9, β2 0.999, eps 1e-8, clip 0.3, accum 16,
 * steps 160 (= 20 epochs of 128 windows); seed 42 (the reference's data
 * seed); target cache 1024 MiB. kvcalib scales steps/windows down for a CPU. */
kvq_intactkv_train_opts kvq_intactkv_train_defaults(void);

/* Mean loss L(x) over the windows (forward only), for the prefix px with the
 * window K/V transformed by quant (NULL: no quantization; then L = 0 exactly
 * for the model's own prefix). win: [n_win][T] tokens. fp_prefix: the
 * target's prefix (the model's own, untrained). */
kvq_status kvq_intactkv_loss(const kvq_model *m, const kvq_artifact_prefix *fp_prefix, const kvq_artifact_prefix *px,
                             const kvq_hooks *quant, const int32_t *win, size_t n_win, size_t T, double *loss,
                             kvq_err *err);

/* The mean loss over the windows and its gradient with respect to the
 * prefix's post-RoPE keys and values, gk / gv [n_layers][P][kv_dim]
 * (caller-owned, overwritten), from the backward pass (straight-through
 * through quant's window K/V; the prefix itself is never quantized, so its
 * gradient is exact when quant is NULL). Same errors as kvq_intactkv_loss. */
kvq_status kvq_intactkv_grad(const kvq_model *m, const kvq_artifact_prefix *fp_prefix, const kvq_artifact_prefix *px,
                             const kvq_hooks *quant, const int32_t *win, size_t n_win, size_t T, double *loss, float *gk, float *gv,
                             kvq_err *err);

/* Train px in place (post-RoPE keys and values of every layer; k_pre is
 * synced at the end) on the windows win [n_win][T] (positions P..P+T-1).
 * Windows are visited epoch by epoch, each epoch a fresh permutation (seed).
 * loss_curve receives steps entries (caller-owned, [steps]); loss_before /
 * loss_after (optional) the mean loss over all windows before and after.
 * Errors: KVQ_EINVAL (options, P + T > ctx_len, n_win == 0), the forward's /
 * backward's errors naming the step and window, KVQ_ENUMERIC for a non-finite
 * loss or gradient. Cost per window ≈ one forward (targets, unless cached) +
 * forward + backward with recomputation (≈ 3 forwards). */
kvq_status kvq_intactkv_train(const kvq_model *m, kvq_artifact_prefix *px, const kvq_hooks *quant, const int32_t *win,
                              size_t n_win, size_t T, const kvq_intactkv_train_opts *o, double *loss_curve,
                              double *loss_before, double *loss_after, kvq_err *err);

#endif
