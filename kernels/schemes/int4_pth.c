/* int4_pth.c — vLLM's int4_per_token_head KV cache (kv_cache_dtype "int4_per_token_head"): a randomised Hadamard rotation of the
 * whole head, then asymmetric 4-bit min/max per (token, KV head), the zero point hidden in the
 * fp32 scale's low mantissa bits.
 * Calibration-free: the scale of each (token, KV head) is computed when the token is
 * written (kernels/quant/quant_pth.h has the formulas, the vLLM source and where kvq
 * differs). Post-RoPE keys, as vLLM caches them; no artifact, no native CUDA transform
 * (the GPU runs it as the host hook). Bits: 4 + 32 / head_dim (the fp32 scale word holds the zero point). */
#include <string.h>

#include "family.h"
#include "hadamard.h"
#include "quant_pth.h"

static int parse_int4_pth(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    if (strcmp(b, "int4-pth")) return 0;
    q->k_bits = q->v_bits = 4;
    return 1;
}

static void fmt_int4_pth(const kvq_scheme *q, char *b, size_t n)
{
    (void)q;
    snprintf(b, n, "int4-pth");
}

static kvq_status validate_int4_pth(const kvq_scheme *q, kvq_err *err)
{
    if (q->k_bits != 4 || q->v_bits != 4)
        return kvq_fail(err, KVQ_EINVAL, "scheme: int4-pth stores 4-bit codes, found %d / %d", q->k_bits, q->v_bits);
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: int4-pth has no sparse outliers, found %g", q->outlier_frac);
    return KVQ_OK;
}

static kvq_status check_model_int4_pth(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    (void)q;
    int hd = hp->head_dim;
    if (hd < 2 || hd > KVQ_HADAMARD_MAX || (hd & (hd - 1)))
        return kvq_fail(err, KVQ_EINVAL,
                        "scheme '%s': head_dim %d: vLLM's int4_per_token_head rotates the whole head with a Walsh-Hadamard "
                        "transform and needs a power of two (vLLM refuses other head sizes)", spec, hd);
    return KVQ_OK;
}

static kvq_status quantize_int4_pth(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                               size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    return kvq_quant_pth(KVQ_PTH_INT4, out, in, T, kvd / hd, hd, d->q.n_sink, c, err);
}

/* 4 code bits + one float32 scale per (token, KV head) (the zero point inside it); sink tokens at 16 */
static kvq_status bits_int4_pth(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (!in->head_dim) return kvq_fail(err, KVQ_EINVAL, "int4-pth bits: head_dim unknown (the scale is per KV head)");
    double b = 4.0 + 32.0 / (double)in->head_dim;
    out->k = out->v = kvq_bits_mix16(b, in->ctx, q->n_sink);
    return KVQ_OK;
}

const kvq_family kvq_family_int4_pth = {
    .name = "int4-pth",
    .syntax = "int4-pth",
    .summary = "vLLM's int4_per_token_head: randomised Hadamard over the head, asymmetric 4-bit per (token, KV head), fp32 scale holding the zero point; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_int4_pth,
    .format = fmt_int4_pth,
    .validate = validate_int4_pth,
    .check_model = check_model_int4_pth,
    .quantize = quantize_int4_pth,
    .bits = bits_int4_pth,
};
