/* loaders.h — per-format model loaders behind kvq_model_load (model.h).
 * Each fills a kvq_model with weights (matrices stored as the kvq_weights
 * mode says) in kvq's canonical layout
 * (row-major [out][in], interleaved RoPE pairs) or returns an error naming
 * the file and the field. */
#ifndef KVQ_LOADERS_H
#define KVQ_LOADERS_H

#include "model.h"

/* GGUF v2/v3, architectures "llama", "qwen2", "qwen3" (formats/model_gguf.c). */
kvq_status kvq_model_load_gguf(const char *path, kvq_weights weights, kvq_model *out, kvq_err *err);
/* llama2.c checkpoint: 7 int32 header (dim, hidden_dim, n_layers, n_heads,
 * n_kv_heads, vocab_size, seq_len; vocab_size < 0 = untied classifier), fp32
 * weights in run.c order (formats/llama2c.c). Source: karpathy/llama2.c run.c. */
kvq_status kvq_model_load_llama2c(const char *path, kvq_model *out, kvq_err *err);
/* Whether a file whose first head_len bytes are `head` and whose size is
 * file_size is a llama2.c checkpoint: a valid 7-int32 header whose implied
 * size (as kvq_model_load_llama2c computes it) equals file_size. Used to
 * name a checkpoint given where its tokenizer belongs. */
bool kvq_llama2c_is_checkpoint(const void *head, size_t head_len, size_t file_size);
/* HF (transformers) Llama / Qwen2 / Qwen3 / Mistral checkpoint: config.json plus model.safetensors or
 * model.safetensors.index.json shards; F32/F16/BF16; q/k rows un-permuted
 * from rotate-half to interleaved RoPE pairs (formats/model_safetensors.c,
 * whose header documents keys, tensor names and the permutation). `path` is
 * the directory, its config.json, a .safetensors file or an index .json. */
kvq_status kvq_model_load_safetensors(const char *path, kvq_weights weights, kvq_model *out, kvq_err *err);

/* Resolve an HF checkpoint path as kvq_model_load_safetensors does: dir gets
 * the checkpoint directory (where config.json and tokenizer.json live; "."
 * for a bare file name), weights the weights file (a directory or config.json
 * selects model.safetensors, else model.safetensors.index.json — the order of
 * transformers' from_pretrained; any other file is used as given). KVQ_EIO
 * when path does not exist or the directory holds neither weights file;
 * KVQ_EINVAL when a path does not fit its buffer. */
kvq_status kvq_hf_checkpoint_paths(const char *path, char *dir, size_t dir_size, char *weights, size_t weights_size,
                                   kvq_err *err);

#endif
