/* fp8_pth.c — vLLM's fp8_per_token_head KV cache (kv_cache_dtype "fp8_per_token_head"): FP8 E4M3FN per (token, KV head),
 * scale = absmax / 448 (float32), round to nearest even (kernels/quant/quant_fp8.h).
 * Calibration-free: the scale of each (token, KV head) is computed when the token is
 * written (kernels/quant/quant_pth.h has the formulas, the vLLM source and where kvq
 * differs). Post-RoPE keys, as vLLM caches them; no artifact, no native CUDA transform
 * (the GPU runs it as the host hook). Bits: 8 + 32 / head_dim (an fp32 scale per token and head). */
#include <string.h>

#include "family.h"
#include "quant_pth.h"

static int parse_fp8_pth(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    if (strcmp(b, "fp8-pth")) return 0;
    q->k_bits = q->v_bits = 8;
    return 1;
}

static void fmt_fp8_pth(const kvq_scheme *q, char *b, size_t n)
{
    (void)q;
    snprintf(b, n, "fp8-pth");
}

static kvq_status validate_fp8_pth(const kvq_scheme *q, kvq_err *err)
{
    if (q->k_bits != 8 || q->v_bits != 8)
        return kvq_fail(err, KVQ_EINVAL, "scheme: fp8-pth stores 8-bit codes, found %d / %d", q->k_bits, q->v_bits);
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: fp8-pth has no sparse outliers, found %g", q->outlier_frac);
    return KVQ_OK;
}

static kvq_status quantize_fp8_pth(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                               size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    return kvq_quant_pth(KVQ_PTH_FP8, out, in, T, kvd / hd, hd, d->q.n_sink, c, err);
}

/* 8 code bits + one float32 scale per (token, KV head); sink tokens at 16 */
static kvq_status bits_fp8_pth(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (!in->head_dim) return kvq_fail(err, KVQ_EINVAL, "fp8-pth bits: head_dim unknown (the scale is per KV head)");
    double b = 8.0 + 32.0 / (double)in->head_dim;
    out->k = out->v = kvq_bits_mix16(b, in->ctx, q->n_sink);
    return KVQ_OK;
}

const kvq_family kvq_family_fp8_pth = {
    .name = "fp8-pth",
    .syntax = "fp8-pth",
    .summary = "vLLM's fp8_per_token_head: E4M3FN with an fp32 absmax/448 scale per (token, KV head) at write time; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_fp8_pth,
    .format = fmt_fp8_pth,
    .validate = validate_fp8_pth,
    .quantize = quantize_fp8_pth,
    .bits = bits_fp8_pth,
};
