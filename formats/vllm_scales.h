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
 *
 * Three forms (kvq_kv_scale_form) of the same values, as the calibration
 * tools write them; vLLM's loader (vllm/model_executor/model_loader/
 * weight_utils.py maybe_remap_kv_scale_name) maps each name onto
 * model.layers.<i>.self_attn.attn.{k,v}_scale:
 *   vllm                kvq's original file: self_attn.{k,v}_scale, shape []
 *                       (per tensor) or [n_kv_heads].
 *   compressed-tensors  llm-compressor's checkpoint tensors: the same names
 *                       with the shapes compressed-tensors initialises them
 *                       with (compressed_tensors/quantization/lifecycle/
 *                       initialize.py initialize_qparams / _attn_qparams):
 *                       strategy "tensor" -> [1], strategy "attn_head" ->
 *                       [n_kv_heads, 1, 1] (observed shape (num_kv_heads,
 *                       seq, head_dim) -> (shape[-3], 1, 1)); plus the
 *                       config.json fragment kvq_ct_config_write writes.
 *                       llm-compressor stores them in the module's dtype
 *                       (bf16 for a bf16 checkpoint); kvq writes float32,
 *                       which vLLM's loader copies into its float32
 *                       parameters without rounding.
 *   modelopt            NVIDIA ModelOpt's names self_attn.k_proj.k_scale and
 *                       self_attn.v_proj.v_scale, shape [1], per tensor only
 *                       (modelopt/torch/export/quant_utils.py
 *                       get_kv_cache_scaling_factor; ModelOpt itself raises
 *                       FP8 scales below 1.0 to 1.0 — kvq writes the
 *                       calibrated values unchanged).
 */
#ifndef KVQ_VLLM_SCALES_H
#define KVQ_VLLM_SCALES_H

#include <stddef.h>

#include "safetensors.h"
#include "status.h"

typedef enum {
    KVQ_SCALES_VLLM = 0,               /* self_attn.k_scale, shape [] or [n_kv_heads] */
    KVQ_SCALES_COMPRESSED_TENSORS = 1, /* self_attn.k_scale, shape [1] or [n_kv_heads, 1, 1] */
    KVQ_SCALES_MODELOPT = 2            /* self_attn.k_proj.k_scale / v_proj.v_scale, shape [1]; per tensor only */
} kvq_kv_scale_form;

/* "vllm", "compressed-tensors", "modelopt" */
const char *kvq_kv_scale_form_name(kvq_kv_scale_form f);

typedef struct {
    size_t n_layers;
    size_t n_kv_heads;     /* per_head: scales per layer; ignored otherwise */
    int per_head;          /* 0: shape [] per layer, 1: shape [n_kv_heads] */
    const float *k_scale;  /* [n_layers] or [n_layers][n_kv_heads], row-major */
    const float *v_scale;  /* same shape */
    kvq_kv_scale_form form; /* names and shapes (0: vllm) */
} kvq_vllm_kv_scales;

/* Tensor name for layer i: "model.layers.<i>.self_attn.k_scale" (is_v 0) or
 * "...v_scale" (is_v 1) into buf[n]; returns buf (truncated names cannot
 * occur for n >= 64). */
char *kvq_vllm_scale_name(char *buf, size_t n, size_t layer, int is_v);
/* The same for a form: modelopt gives "model.layers.<i>.self_attn.k_proj.k_scale" /
 * "...self_attn.v_proj.v_scale". */
char *kvq_kv_scale_name(char *buf, size_t n, kvq_kv_scale_form form, size_t layer, int is_v);

/* Write the scales to `path` (atomically: "<path>.partial" then rename;
 * deterministic bytes). meta: extra __metadata__ entries (may be NULL when
 * n_meta is 0; must not contain "format"). Errors: KVQ_EINVAL for
 * n_layers 0, per_head with n_kv_heads 0, or a scale that is not finite and
 * > 0 (naming layer, K/V and head), per-head scales in the modelopt form or
 * an unknown form; KVQ_ENOMEM; KVQ_EIO from the writer. */
kvq_status kvq_vllm_scales_write(const char *path, const kvq_vllm_kv_scales *s, const kvq_st_kv *meta,
                                 size_t n_meta, kvq_err *err);

/* The config.json fragment that makes vLLM create the scale parameters of a
 * compressed-tensors checkpoint (llm-compressor's kv_cache_scheme; vLLM
 * compressed_tensors.py accepts num_bits 8, type float, strategy tensor or
 * attn_head, symmetric):
 *   {"quantization_config": {"quant_method": "compressed-tensors",
 *     "kv_cache_scheme": {"num_bits": 8, "type": "float",
 *       "strategy": "tensor" | "attn_head", "dynamic": false, "symmetric": true}}}
 * Written whole or not at all (formats/outfile.h). Errors: KVQ_EIO. */
kvq_status kvq_ct_config_write(const char *path, int per_head, kvq_err *err);

#endif
