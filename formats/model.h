/* model.h — the one in-memory model every loader produces (GGUF, safetensors,
 * llama2.c). The forward pass never knows the source format.
 *
 * Weights are row-major. Vectors (norms, biases) are fp32; matrices are
 * kvq_mat: fp32 in exact mode (KVQ_WEIGHTS_F32, dequantized once at load),
 * or bf16 / f16 / the file's own storage (GGUF blocks) to fit large models in
 * memory, converted to fp32 block by block as they are used (kvq_weights). A
 * linear layer W of shape [out][in] computes y = W x (x is a row of `in`
 * floats).
 *
 * RoPE pairing is normalised at load: every loader permutes q/k projection rows
 * so that rotary pairs are adjacent channels (2i, 2i+1) within each head
 * ("interleaved", GGML rope mode 0, llama2.c, Meta's reference). HF checkpoints
 * (rotate-half pairs (i, i + rotary_dim/2)) are un-permuted by the safetensors
 * loader. As a consequence, pre-RoPE key channels are always reported in the
 * interleaved order; the per-head q/k norm weights and the q/k biases follow
 * the same permutation. llama GGUF files are already interleaved; qwen2/qwen3
 * GGUF files keep HF's order (llama.cpp runs them in NEOX mode) and are
 * un-permuted like HF checkpoints. Source: llama.cpp convert_hf_to_gguf.py
 * `permute`.
 */
#ifndef KVQ_MODEL_H
#define KVQ_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* Architecture families (HF model_type / GGUF general.architecture). They
 * share one forward (forward.h); a family differs only in the optional parts
 * below: attention biases, q/k norms, the sliding window, the RoPE pairing of
 * its checkpoints (interleaved in llama GGUF files, rotate-half in HF files
 * and in qwen2/qwen3 GGUF files; normalised at load, see above). */
typedef enum {
    KVQ_ARCH_LLAMA = 0,  /* Llama 1/2/3.x, SmolLM, llama2.c (also Mistral converted by llama.cpp, which writes "llama") */
    KVQ_ARCH_QWEN2,      /* Qwen2 / Qwen2.5: q/k/v biases */
    KVQ_ARCH_QWEN3,      /* Qwen3: per-head RMSNorm of q and k before RoPE, decoupled head_dim */
    KVQ_ARCH_MISTRAL     /* Mistral: sliding-window attention */
} kvq_arch;

/* "llama", "qwen2", "qwen3", "mistral" (the dump's model_arch attribute). */
const char *kvq_arch_name(kvq_arch a);

/* RoPE frequency rules (inverse frequency theta_i = base^(-2i/rope_dim) of
 * pair i, then, by type; sources: HF transformers modeling_rope_utils.py,
 * `_compute_*_parameters`; llama.cpp ggml_rope_ext for freq_factors):
 *   linear        theta_i / factor
 *   llama3        Llama-3.1 piecewise rule (factor, low/high_freq_factor,
 *                 original context)
 *   yarn          YaRN (Peng et al. 2023): interpolation theta_i/factor and
 *                 extrapolation theta_i blended by a linear ramp over pairs
 *                 [low, high] from beta_fast/beta_slow rotations at the
 *                 original context; cos and sin multiplied by attn_factor
 *                 (default 0.1 ln(factor) + 1)
 *   dynamic       dynamic NTK: base * ((factor S / ctx_len) - (factor - 1))^(d/(d-2))
 *                 with S = max(ctx_len, pos0 + T) of the window (the rule HF
 *                 applies to one forward call)
 *   freq_factors  theta_i / f_i for a per-pair table f (GGUF tensor
 *                 rope_freqs.weight, which llama.cpp's converter writes for
 *                 Llama-3.1 `llama3` scaling) */
typedef enum {
    KVQ_ROPE_SCALING_NONE = 0,
    KVQ_ROPE_SCALING_LINEAR,       /* positions divided by factor */
    KVQ_ROPE_SCALING_LLAMA3,       /* Llama-3.1 frequency-dependent scaling */
    KVQ_ROPE_SCALING_YARN,
    KVQ_ROPE_SCALING_DYNAMIC,
    KVQ_ROPE_SCALING_FREQ_FACTORS
} kvq_rope_scaling;

/* "none", "linear", "llama3", "yarn", "dynamic", "freq_factors". */
const char *kvq_rope_scaling_name(kvq_rope_scaling s);

#define KVQ_ROPE_MAX_PAIRS 256 /* rope_dim / 2 <= this (head_dim <= 512) */

typedef enum {
    KVQ_SRC_GGUF = 0,
    KVQ_SRC_SAFETENSORS,
    KVQ_SRC_LLAMA2C
} kvq_model_source;

/* Architecture hyperparameters. */
typedef struct {
    kvq_arch arch;
    int n_layers;     /* llama.block_count */
    int dim;          /* llama.embedding_length (d_model) */
    int hidden_dim;   /* llama.feed_forward_length (SwiGLU inner size) */
    int n_heads;      /* llama.attention.head_count (query heads) */
    int n_kv_heads;   /* llama.attention.head_count_kv (GQA: n_heads % n_kv_heads == 0) */
    int head_dim;     /* dim / n_heads, or HF head_dim / GGUF attention.key_length when decoupled */
    int vocab_size;   /* rows of the embedding table */
    int ctx_len;      /* llama.context_length (training context) */
    int rope_dim;     /* llama.rope.dimension_count (rotated channels per head, <= head_dim, even) */
    float rope_theta; /* llama.rope.freq_base */
    kvq_rope_scaling rope_scaling;
    float rope_scale_factor;   /* linear/llama3/yarn/dynamic factor (1 when none) */
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 only */
    int rope_orig_ctx;         /* llama3/yarn: original context length */
    float rope_attn_factor;    /* yarn: multiplier of cos and sin (1 otherwise) */
    float rope_beta_fast, rope_beta_slow; /* yarn: ramp bounds in rotations (32, 1) */
    bool rope_yarn_truncate;   /* yarn: ramp bounds floored/ceiled (HF `truncate`, default true) */
    float rope_freq_factors[KVQ_ROPE_MAX_PAIRS]; /* freq_factors: divisor of pair i's frequency */
    float norm_eps;   /* llama.attention.layer_norm_rms_epsilon */
    bool tied_embeddings; /* LM head shares tok_embd */
    bool attn_qkv_bias;   /* q, k, v projections carry biases (Qwen2; HF attention_bias) */
    bool attn_out_bias;   /* the output projection carries a bias (HF attention_bias in Llama/Qwen3) */
    bool qk_norm;         /* per-head RMSNorm of q and k (weights [head_dim]) before RoPE (Qwen3) */
    int sliding_window;   /* > 0: query at position p attends keys at positions > p - sliding_window
                             (HF sliding_window_overlay), in layers >= swa_first_layer; 0 = full causal */
    int swa_first_layer;  /* first sliding-window layer (Mistral 0; Qwen2 max_window_layers) */
} kvq_hparams;

/* Keys per query in layer l: sliding_window, or 0 (full causal attention). */
static inline int kvq_layer_window(const kvq_hparams *hp, int l)
{
    return hp->sliding_window > 0 && l >= hp->swa_first_layer ? hp->sliding_window : 0;
}

/* A weight matrix [rows][cols] in the form it is stored: rows back to back,
 * row_bytes each, elements of `type` (a kvq_ggml_type of gguf.h: F32, F16,
 * BF16 or a GGML block type, rows being whole blocks). Read rows with
 * kvq_mat_rows (fp32, exact widening / the ggml dequantization rules). */
typedef struct {
    void *data;
    uint32_t type;    /* kvq_ggml_type */
    int rows, cols;
    size_t row_bytes;
} kvq_mat;

#define KVQ_MAT_F32 0u /* KVQ_GGML_F32 */

/* The rows as fp32 when the matrix is stored in fp32, else NULL. */
static inline float *kvq_mat_f32(const kvq_mat *w) { return w->type == KVQ_MAT_F32 ? (float *)w->data : NULL; }

/* Rows r0 .. r0+n-1 of w (a view; n >= 0, r0 + n <= rows). */
static inline kvq_mat kvq_mat_slice(const kvq_mat *w, int r0, int n)
{
    kvq_mat s = *w;
    s.data = (char *)w->data + (size_t)r0 * w->row_bytes;
    s.rows = n;
    return s;
}

/* dst[n][cols] = fp32 values of rows r0 .. r0+n-1 (a copy for F32; exact
 * widening for F16/BF16; the ggml_dequant.h rules for block types). Never
 * fails on a matrix a loader produced. Serial; callers parallelise. */
void kvq_mat_rows(const kvq_mat *w, int r0, int n, float *dst);

/* Per-layer weights. Vectors are fp32; matrices are kvq_mat (fp32 in exact
 * mode). q_dim = n_heads*head_dim, kv_dim = n_kv_heads*head_dim. Optional
 * parts are NULL when the architecture lacks them. */
typedef struct {
    float *attn_norm; /* [dim] */
    kvq_mat wq;       /* [q_dim][dim] */
    kvq_mat wk;       /* [kv_dim][dim] */
    kvq_mat wv;       /* [kv_dim][dim] */
    kvq_mat wo;       /* [dim][q_dim] */
    float *bq, *bk, *bv; /* [q_dim], [kv_dim], [kv_dim] when attn_qkv_bias (bk: the pre-RoPE key bias) */
    float *bo;        /* [dim] when attn_out_bias */
    float *q_norm, *k_norm; /* [head_dim] when qk_norm (in kvq's interleaved channel order) */
    float *ffn_norm;  /* [dim] */
    kvq_mat w_gate;   /* [hidden_dim][dim] (w1) */
    kvq_mat w_up;     /* [hidden_dim][dim] (w3) */
    kvq_mat w_down;   /* [dim][hidden_dim] (w2) */
} kvq_layer_weights;

/* How the weight matrices are held in memory (vectors are always fp32).
 * Arithmetic is fp32 in every mode: a matrix not stored in fp32 is
 * converted block by block as it is used (kernels/model/ops.h kvq_linear_mat). */
typedef enum {
    KVQ_WEIGHTS_AUTO = 0,  /* f32 when the fp32 matrices fit in KVQ_WEIGHTS_AUTO_F32_MAX bytes; else each matrix as
                              stored in the file (lossless), except fp32 ones, which become bf16 */
    KVQ_WEIGHTS_F32,       /* exact mode: every matrix dequantized to fp32 at load (4 bytes per parameter) */
    KVQ_WEIGHTS_BF16,      /* every matrix rounded to bf16 (round to nearest even; lossy unless stored bf16) */
    KVQ_WEIGHTS_F16,       /* every matrix rounded to IEEE f16 (lossy unless stored f16) */
    KVQ_WEIGHTS_NATIVE     /* every matrix as stored (GGUF blocks, F16/BF16/F32 safetensors): lossless */
} kvq_weights;

#define KVQ_WEIGHTS_AUTO_F32_MAX (6.0 * 1024 * 1024 * 1024)

/* "auto", "f32", "bf16", "f16", "native". */
const char *kvq_weights_name(kvq_weights w);
/* Parse those names (KVQ_EINVAL naming `what`, e.g. "--weights", and the value). */
kvq_status kvq_weights_parse(const char *s, const char *what, kvq_weights *out, kvq_err *err);

typedef struct {
    kvq_weights weights;
} kvq_load_opts;

typedef struct {
    kvq_hparams hp;
    kvq_mat tok_embd;         /* [vocab_size][dim] */
    float *out_norm;          /* [dim] */
    kvq_mat output;           /* [vocab_size][dim]; the same matrix as tok_embd when tied */
    kvq_layer_weights *layers;/* [n_layers] */
    kvq_model_source source;
    char path[4096];          /* file the weights came from */
    kvq_weights weights;      /* the storage actually used (never AUTO) */
    char weights_desc[96];    /* e.g. "f32 (exact)", "bf16", "native: q4_1 x 211, q6_k x 1" */
    /* ownership: every fp32 vector (and every fp32 matrix) points into `arena`,
     * every other matrix into `warena` (one allocation each) */
    float *arena;
    size_t arena_floats;
    void *warena;
    size_t warena_bytes;
} kvq_model;

/* Load any supported model file, choosing the loader by content:
 * GGUF magic, a directory / .safetensors / config.json (HF), else llama2.c.
 * On success *out owns its memory; release with kvq_model_free.
 * kvq_model_load uses KVQ_WEIGHTS_AUTO. llama2.c checkpoints are held in fp32 only: KVQ_WEIGHTS_BF16 / F16 for
 * one fail with KVQ_EUNSUPPORTED naming the option (native and f32 are its fp32). */
kvq_status kvq_model_load(const char *path, kvq_model *out, kvq_err *err);
kvq_status kvq_model_load_opts(const char *path, const kvq_load_opts *opts, kvq_model *out, kvq_err *err);

/* Validate hyperparameters (positive, divisible, products that fit); names the
 * offending field. Loaders call it; exposed for tests. */
kvq_status kvq_hparams_validate(const kvq_hparams *hp, const char *path, kvq_err *err);

/* Allocate the arena for hp and point every weight into it (zeroed), every
 * matrix in fp32. Used by loaders and tests. */
kvq_status kvq_model_alloc(kvq_model *m, const kvq_hparams *hp, kvq_err *err);

/* The matrices of a model, for typed allocation: role and layer (-1 for
 * tok_embd and output). */
typedef enum {
    KVQ_MAT_TOK_EMBD = 0, KVQ_MAT_OUTPUT, KVQ_MAT_WQ, KVQ_MAT_WK, KVQ_MAT_WV, KVQ_MAT_WO,
    KVQ_MAT_GATE, KVQ_MAT_UP, KVQ_MAT_DOWN
} kvq_mat_role;
/* Storage type of one matrix (a kvq_ggml_type), chosen by the loader. */
typedef uint32_t (*kvq_mat_type_fn)(void *user, kvq_mat_role role, int layer);

/* As kvq_model_alloc with matrix storage types from type_of (NULL: all
 * fp32); weights records the mode for m->weights. Block types need cols to be
 * a multiple of their block size (KVQ_EFORMAT naming the matrix otherwise). */
kvq_status kvq_model_alloc_typed(kvq_model *m, const kvq_hparams *hp, kvq_mat_type_fn type_of, void *user,
                                 kvq_weights weights, kvq_err *err);

/* Storage type (kvq_ggml_type) of a matrix stored in the file as `stored`
 * under mode w for a model of hyperparameters hp: F32 -> F32; BF16 / F16 ->
 * that type; NATIVE -> stored; AUTO -> F32 when kvq_hparams_f32_bytes(hp) <=
 * KVQ_WEIGHTS_AUTO_F32_MAX, else stored, except stored F32 -> BF16. */
uint32_t kvq_weights_type(kvq_weights w, const kvq_hparams *hp, uint32_t stored);

/* Bytes of the fp32 matrices of hp (what exact mode holds). */
double kvq_hparams_f32_bytes(const kvq_hparams *hp);

void kvq_model_free(kvq_model *m);

/* The tokenizer file for a model, for the binaries' `--tokenizer FILE` option
 * (every binary that takes a model must offer it, because llama2.c
 * checkpoints and some HF directories carry no tokenizer).
 *   tokenizer non-NULL and non-empty (the option was given): that path,
 *     which must be readable (KVQ_EIO otherwise);
 *   else by the format kvq_model_load would choose:
 *     GGUF             → model_path itself (tokenizer.ggml.* metadata);
 *     HF checkpoint    → "<checkpoint dir>/tokenizer.json" (its neighbour
 *                        tokenizer_config.json is read by the tokenizer
 *                        loader); KVQ_EINVAL naming the model when absent;
 *     llama2.c         → KVQ_EINVAL "... carries no tokenizer; pass --tokenizer FILE".
 * out receives a NUL-terminated path (KVQ_EINVAL if it does not fit).
 * Load it with kvq_tokenizer_load, or use kvq_tokenizer_for_model (datasets/tokenizer.h). */
kvq_status kvq_model_tokenizer_path(const char *model_path, const char *tokenizer, char *out, size_t out_size, kvq_err *err);

/* Weights-file digest: SHA-256 of the bytes of `path` (OpenSSL EVP) as 64
 * lowercase hex digits + NUL. A directory (HF checkpoint) is hashed as the
 * concatenation, in byte-wise name order, of "<name>\0<8-byte LE size><bytes>"
 * for every regular *.json and *.safetensors file in it. KVQ_EIO naming the
 * file on read errors. */
kvq_status kvq_sha256_path(const char *path, char hex[65], kvq_err *err);

/* Model fingerprint for dump/artifact metadata: SHA-256 (hex, 64 digits + NUL)
 * of the canonical text
 *   "kvq-model-fingerprint-v1\nweights_sha256=<kvq_sha256_path(m->path)>\n"
 *   "n_layers=%d\ndim=%d\nhidden_dim=%d\nn_heads=%d\nn_kv_heads=%d\n"
 *   "head_dim=%d\nvocab_size=%d\nctx_len=%d\nrope_dim=%d\nrope_theta=%a\n"
 *   "rope_scaling=%d\nrope_scale_factor=%a\nrope_low_freq_factor=%a\n"
 *   "rope_high_freq_factor=%a\nrope_orig_ctx=%d\nnorm_eps=%a\ntied=%d\n"
 * (floats as C99 hex-float of the stored float value). Two models with the
 * same fingerprint have byte-identical weight files and identical
 * hyperparameters, RoPE included. If weights_hex is non-NULL it receives the
 * weights-file digest. Cost: one pass over the weights file (~0.3 s/100 MB). */
kvq_status kvq_model_fingerprint(const kvq_model *m, char hex[65], char weights_hex[65], kvq_err *err);

static inline int kvq_q_dim(const kvq_hparams *hp) { return hp->n_heads * hp->head_dim; }
static inline int kvq_kv_dim(const kvq_hparams *hp) { return hp->n_kv_heads * hp->head_dim; }

#endif
