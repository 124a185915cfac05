/* model.h — the one in-memory model every loader produces (GGUF, safetensors,
 * llama2.c). The forward pass never knows the source format.
 *
 * Weights are fp32, dequantized once at load, row-major. A linear layer
 * W of shape [out][in] computes y = W x (x is a row of `in` floats).
 *
 * RoPE pairing is normalised at load: every loader permutes q/k projection rows
 * so that rotary pairs are adjacent channels (2i, 2i+1) within each head
 * ("interleaved", GGML rope mode 0, llama2.c, Meta's reference). HF checkpoints
 * (rotate-half pairs (i, i + rotary_dim/2)) are un-permuted by the safetensors
 * loader. As a consequence, pre-RoPE key channels are always reported in the
 * interleaved order. Source: llama.cpp convert_hf_to_gguf.py `permute`.
 */
#ifndef KVQ_MODEL_H
#define KVQ_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum {
    KVQ_ROPE_SCALING_NONE = 0,
    KVQ_ROPE_SCALING_LINEAR,  /* positions divided by factor */
    KVQ_ROPE_SCALING_LLAMA3   /* Llama-3.1 frequency-dependent scaling */
} kvq_rope_scaling;

typedef enum {
    KVQ_SRC_GGUF = 0,
    KVQ_SRC_SAFETENSORS,
    KVQ_SRC_LLAMA2C
} kvq_model_source;

/* Architecture hyperparameters. */
typedef struct {
    int n_layers;     /* llama.block_count */
    int dim;          /* llama.embedding_length (d_model) */
    int hidden_dim;   /* llama.feed_forward_length (SwiGLU inner size) */
    int n_heads;      /* llama.attention.head_count (query heads) */
    int n_kv_heads;   /* llama.attention.head_count_kv (GQA: n_heads % n_kv_heads == 0) */
    int head_dim;     /* dim / n_heads */
    int vocab_size;   /* rows of the embedding table */
    int ctx_len;      /* llama.context_length (training context) */
    int rope_dim;     /* llama.rope.dimension_count (rotated channels per head, <= head_dim, even) */
    float rope_theta; /* llama.rope.freq_base */
    kvq_rope_scaling rope_scaling;
    float rope_scale_factor;   /* linear/llama3 factor (1 when none) */
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 only */
    int rope_orig_ctx;         /* llama3 only: original context length */
    float norm_eps;   /* llama.attention.layer_norm_rms_epsilon */
    bool tied_embeddings; /* LM head shares tok_embd */
} kvq_hparams;

/* Per-layer weights, fp32 row-major. q_dim = n_heads*head_dim, kv_dim = n_kv_heads*head_dim. */
typedef struct {
    float *attn_norm; /* [dim] */
    float *wq;        /* [q_dim][dim] */
    float *wk;        /* [kv_dim][dim] */
    float *wv;        /* [kv_dim][dim] */
    float *wo;        /* [dim][q_dim] */
    float *ffn_norm;  /* [dim] */
    float *w_gate;    /* [hidden_dim][dim] (w1) */
    float *w_up;      /* [hidden_dim][dim] (w3) */
    float *w_down;    /* [dim][hidden_dim] (w2) */
} kvq_layer_weights;

typedef struct {
    kvq_hparams hp;
    float *tok_embd;          /* [vocab_size][dim] */
    float *out_norm;          /* [dim] */
    float *output;            /* [vocab_size][dim]; == tok_embd when tied */
    kvq_layer_weights *layers;/* [n_layers] */
    kvq_model_source source;
    char path[4096];          /* file the weights came from */
    /* ownership: every float* above points into `arena` (one allocation) */
    float *arena;
    size_t arena_floats;
} kvq_model;

/* Load any supported model file, choosing the loader by content:
 * GGUF magic, a directory / .safetensors / config.json (HF), else llama2.c.
 * On success *out owns its memory; release with kvq_model_free. */
kvq_status kvq_model_load(const char *path, kvq_model *out, kvq_err *err);

/* Validate hyperparameters (positive, divisible, products that fit); names the
 * offending field. Loaders call it; exposed for tests. */
kvq_status kvq_hparams_validate(const kvq_hparams *hp, const char *path, kvq_err *err);

/* Allocate the arena for hp and point every weight into it (zeroed).
 * Used by loaders. */
kvq_status kvq_model_alloc(kvq_model *m, const kvq_hparams *hp, kvq_err *err);

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
