/* loaders.h — per-format model loaders behind kvq_model_load (model.h).
 * Each fills a kvq_model with fp32 weights in kvq's canonical layout
 * (row-major [out][in], interleaved RoPE pairs) or returns an error naming
 * the file and the field. */
#ifndef KVQ_LOADERS_H
#define KVQ_LOADERS_H

#include "model.h"

/* GGUF v2/v3, architecture "llama" (formats/model_gguf.c). */
kvq_status kvq_model_load_gguf(const char *path, kvq_model *out, kvq_err *err);
/* llama2.c checkpoint: 7 int32 header (dim, hidden_dim, n_layers, n_heads,
 * n_kv_heads, vocab_size, seq_len; vocab_size < 0 = untied classifier), fp32
 * weights in run.c order (formats/llama2c.c). Source: karpathy/llama2.c run.c. */
kvq_status kvq_model_load_llama2c(const char *path, kvq_model *out, kvq_err *err);
/* HF safetensors checkpoint: a directory with config.json and model.safetensors
 * or model.safetensors.index.json shards (formats/model_safetensors.c). */
kvq_status kvq_model_load_safetensors(const char *path, kvq_model *out, kvq_err *err);

#endif
