/* kv_desc.h — a built-in KV-cache quantize→dequantize transform described as
 * plain data, so that the CPU forward (through a kvq_hooks.transform
 * callback) and the CUDA forward (natively, kernels/cuda/forward_cuda.h) run the
 * SAME transform from one description.
 *
 * A descriptor is a kvq_scheme (kernels/quant/quant.h: kind, bits, group size,
 * residual length, outlier fraction, n_sink), the key stage the scheme
 * quantizes (pre- or post-RoPE keys), and, for the schemes with offline
 * tables, per-layer tables. Per layer and window, on the window's rows
 * k, v [T][kv_dim] (kv_dim = n_kv_heads * head_dim, row-major fp32):
 *
 *   FP32    no transform (the hook does nothing)
 *   FP16    k, v <- kvq_quant_fp16 on tokens >= n_sink (sink tokens exact)
 *   INT     k <- kvq_quant_int_token(group, k_bits, n_sink), v likewise with v_bits
 *   INT_PC  k <- kvq_quant_int_channel(layer's lower/upper, k_bits, outliers = outlier_frac > 0, n_sink),
 *           v <- kvq_quant_int_token(group 0 = whole token, v_bits, n_sink)
 *   NUQ     k <- kvq_quant_nuq_keys(layer's k_lut, lower/upper, outliers = outlier_frac > 0, n_sink),
 *           v <- kvq_quant_nuq_values(layer's v_lut, outlier_frac, n_sink)
 *   KIVI    k, v stay exact; alt.k <- kvq_kivi_keys(group, k_bits, n_sink),
 *           alt.v <- kvq_kivi_values(head_dim, group, v_bits, n_sink), bounds
 *           kvq_kivi_key_boundary / kvq_kivi_value_boundary (decode equivalence)
 *
 * This is the one implementation of these schemes: kveval's built-in
 * families (analysis/kveval/scheme.h) build a descriptor from a bound scheme (kind
 * and parameters from its kvq_scheme, tables from its artifact's per-layer
 * kvq_kv_table) and run kvq_kv_desc_transform on the CPU; the CUDA forward
 * runs the same descriptor natively, bit-exact with it. Sources: see quant.h
 * (KVQuant arXiv 2401.18079 §3, App.G/P; KIVI arXiv 2402.02750 §3).
 */
#ifndef KVQ_KV_DESC_H
#define KVQ_KV_DESC_H

#include <stdbool.h>

#include "forward.h"
#include "quant.h"
#include "status.h"

/* Tables of one layer (pointers borrowed; must outlive every use). */
typedef struct {
    const float *k_lower, *k_upper; /* [kv_dim] per-channel key thresholds (INT_PC, NUQ), else NULL */
    kvq_nuq_lut k_lut, v_lut;       /* NUQ levels (bits == scheme's k_bits / v_bits), else zeroed */
} kvq_kv_layer_tables;

typedef struct {
    kvq_scheme q;                        /* kind and parameters */
    kvq_key_stage key_stage;             /* which keys are quantized */
    const kvq_kv_layer_tables *layers;   /* [n_layers] for INT_PC and NUQ, else NULL */
    int n_layers;                        /* entries of layers (0 when NULL) */
} kvq_kv_desc;

/* Check the descriptor against the model shape: kvq_scheme_validate, tables
 * present for INT_PC/NUQ with finite lower <= upper and ascending levels of
 * the right bit width (per-layer or per-KV-head tables), group sizes that
 * divide kv_dim (INT) or head_dim (KIVI). Errors (KVQ_EINVAL) name the layer
 * and field. */
kvq_status kvq_kv_desc_validate(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err);

/* True when the descriptor leaves K/V unchanged (FP32). */
bool kvq_kv_desc_is_identity(const kvq_kv_desc *d);

/* Canonical short label for reports, e.g. "int4-g64", "kivi2-g32-r128",
 * "nuq4-1%+sink1", "int4-pc-1%". */
void kvq_kv_desc_name(const kvq_kv_desc *d, char *buf, size_t n);

/* KIVI boundaries of a window of T tokens, kb/vb [T]: kb[i] =
 * kvq_kivi_key_boundary(i, ...), vb[i] = kvq_kivi_value_boundary(i, ...)
 * (both <= i + 1, as attention.h requires). Shared by the CPU hook and the
 * CUDA forward. */
void kvq_kv_desc_kivi_bounds(const kvq_scheme *q, size_t T, int *kb, int *vb);

/* Per-run state of the CPU hook: the descriptor and quantizer counters
 * accumulated (+=) over layers and windows. */
typedef struct {
    const kvq_kv_desc *d;
    kvq_quant_counts k_counts, v_counts;
} kvq_kv_desc_run;

/* The CPU transform callback (kvq_hooks.transform signature; user is a
 * kvq_kv_desc_run). */
kvq_status kvq_kv_desc_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                                 kvq_err *err);

/* hooks = {transform = kvq_kv_desc_transform, user = run, key_stage = d->key_stage};
 * an FP32 descriptor gives no transform at all. */
void kvq_kv_desc_hooks(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_hooks *hooks);

#endif
