/* mxfp4.c — FP4 (E2M1) KV caches with power-of-two block scales
 * (kernels/quant/quant_fp4.h), computed when the token is written:
 *   mxfp4           OCP Microscaling MXFP4 (MX v1.0): blocks of 32 along
 *                   head_dim, E8M0 scale 2^(floor(log2 amax) - 2), round to
 *                   nearest even, saturating at +-6;
 *   fp4_mx_block16  SGLang's --kv-cache-dtype fp4_mx_block16 (formerly
 *                   fp4_e2m1): blocks of 16, exponent scale
 *                   2^ceil(log2(amax / 6)), magnitudes rounded with ties up.
 * Keys post-RoPE; the first n_sink tokens exact. head_dim must be a multiple
 * of the block (KVQ_EUNSUPPORTED otherwise). No calibration, no artifact.
 * variant: the kvq_fp4_format. */
#include <string.h>

#include "family.h"
#include "quant_fp4.h"

static int parse_mxfp4(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    if (!strcmp(b, "mxfp4")) q->variant = KVQ_FP4_MXFP4;
    else if (!strcmp(b, "fp4_mx_block16")) q->variant = KVQ_FP4_MX16_SGL;
    else return 0;
    q->k_bits = q->v_bits = 4;
    return 1;
}

static void fmt_mxfp4(const kvq_scheme *q, char *b, size_t n) { snprintf(b, n, "%s", kvq_fp4_name((kvq_fp4_format)q->variant)); }

static kvq_status validate_mxfp4(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0 || q->group || q->residual)
        return kvq_fail(err, KVQ_EINVAL, "scheme: mxfp4 has no outliers, groups or residual (found %g, %zu, %zu)",
                        q->outlier_frac, q->group, q->residual);
    if (q->variant != KVQ_FP4_MXFP4 && q->variant != KVQ_FP4_MX16_SGL)
        return kvq_fail(err, KVQ_EINVAL, "scheme: mxfp4 variant: unknown value %d", q->variant);
    if (q->k_bits != 4 || q->v_bits != 4)
        return kvq_fail(err, KVQ_EINVAL, "scheme: %s stores 4-bit codes, found %d / %d",
                        kvq_fp4_name((kvq_fp4_format)q->variant), q->k_bits, q->v_bits);
    return KVQ_OK;
}

static kvq_status check_model_mxfp4(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    const kvq_fp4_format f = (kvq_fp4_format)q->variant;
    const size_t B = kvq_fp4_block(f);
    if ((size_t)hp->head_dim % B)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "scheme '%s': head_dim %d is not a multiple of the %zu-value %s block (a block never straddles "
                        "two heads), so this scheme does not apply",
                        spec, hp->head_dim, B, f == KVQ_FP4_MXFP4 ? "MXFP4" : "fp4_mx_block16");
    return KVQ_OK;
}

static kvq_status quantize_mxfp4(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                 size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    size_t ns = d->q.n_sink < T ? d->q.n_sink : T;
    if (out != in) memmove(out, in, ns * kvd * sizeof(float));
    uint64_t clipped = 0;
    if (T > ns)
        KVQ_TRY(kvq_fp4_kv_roundtrip((kvq_fp4_format)d->q.variant, in + ns * kvd, out + ns * kvd, T - ns, kvd / hd, hd,
                                     1.0f, &clipped, err));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
        c->n_clipped += clipped;
    }
    return KVQ_OK;
}

/* 4-bit codes + one 8-bit scale per block (4.25 for 32, 4.5 for 16); sink tokens at 16 */
static kvq_status bits_mxfp4(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double dense = kvq_fp4_bits_per_element((kvq_fp4_format)q->variant, 0);
    out->k = out->v = kvq_bits_mix16(dense, in->ctx, q->n_sink);
    return KVQ_OK;
}

static void describe_mxfp4(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    const kvq_fp4_format f = (kvq_fp4_format)q->variant;
    o->num(o->ctx, "block_size", (double)kvq_fp4_block(f));
    o->str(o->ctx, "block_scale_format", f == KVQ_FP4_MXFP4 ? "e8m0 floor(log2 amax)-2" : "exponent ceil(log2(amax/6))");
    o->str(o->ctx, "element_rounding", f == KVQ_FP4_MXFP4 ? "nearest-even, saturating" : "nearest, ties up");
}

const kvq_family kvq_family_mxfp4 = {
    .name = "mxfp4",
    .syntax = "mxfp4, fp4_mx_block16",
    .summary = "FP4 E2M1 with power-of-two block scales: OCP MXFP4 (32-value blocks, E8M0) or SGLang's fp4_mx_block16 "
               "(16-value blocks); post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_mxfp4,
    .format = fmt_mxfp4,
    .validate = validate_mxfp4,
    .check_model = check_model_mxfp4,
    .quantize = quantize_mxfp4,
    .describe = describe_mxfp4,
    .bits = bits_mxfp4,
};
