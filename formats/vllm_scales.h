/* vllm_scales.h — export calibrated FP8 KV-cache scales for vLLM as a
 * safetensors file that can be merged into a Hugging Face checkpoint.
 *
 * Tensors written (float32, one pair per decoder layer i = 0..n_layers-1):
 *   model.layers.<i>.self_attn.k_scale   shape []           (per tensor)
 *   model.layers.<i>.self_attn.v_scale   or [n_kv_heads]   (per KV head)
 * Names follow the HF Llama module path (model.layers.<i>.self_attn), which
 * is where llm-compressor / compressed-tensors checkpoints keep k_scale /
 * v_scale and what vLLM's loader remaps onto its attention layers
 * (self_attn.attn.k_scale). Convention (vLLM quant_utils): stored FP8 =
 * Quantize(x / scale), read back as FP8 * scale; a calibrated scale is
 * typically absmax / 448 for E4M3FN (kernels/quant/quant_fp8.h calibration).
 * Per-head scales are [n_kv_heads] (vLLM docs: k/v_scale = [num_kv_heads],
 * Flash Attention backend only). How to use the file: docs/fp8-vllm.md.
 *
 * Metadata: "format": "pt" (what HF transformers expects in checkpoint
 * shards) plus the caller's key/value pairs (e.g. the calibration rule).
 */
#ifndef KVQ_VLLM_SCALES_H
#define KVQ_VLLM_SCALES_H

#include <stddef.h>

#include "safetensors.h"
#include "status.h"

typedef struct {
    size_t n_layers;
    size_t n_kv_heads;     /* per_head: scales per layer; ignored otherwise */
    int per_head;          /* 0: shape [] per layer, 1: shape [n_kv_heads] */
    const float *k_scale;  /* [n_layers] or [n_layers][n_kv_heads], row-major */
    const float *v_scale;  /* same shape */
} kvq_vllm_kv_scales;

/* Tensor name for layer i: "model.layers.<i>.self_attn.k_scale" (is_v 0) or
 * "...v_scale" (is_v 1) into buf[n]; returns buf (truncated names cannot
 * occur for n >= 64). */
char *kvq_vllm_scale_name(char *buf, size_t n, size_t layer, int is_v);

/* Write the scales to `path` (atomically: "<path>.partial" then rename;
 * deterministic bytes). meta: extra __metadata__ entries (may be NULL when
 * n_meta is 0; must not contain "format"). Errors: KVQ_EINVAL for
 * n_layers 0, per_head with n_kv_heads 0, or a scale that is not finite and
 * > 0 (naming layer, K/V and head); KVQ_ENOMEM; KVQ_EIO from the writer. */
kvq_status kvq_vllm_scales_write(const char *path, const kvq_vllm_kv_scales *s, const kvq_st_kv *meta,
                                 size_t n_meta, kvq_err *err);

#endif
