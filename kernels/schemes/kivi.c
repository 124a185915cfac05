/* kivi.c — KIVI (Liu et al., arXiv 2402.02750 §3.2-3.3; notes
 * ../shared/docs/kivi-intactkv-mikv.md §1): keys per channel in groups of G
 * consecutive tokens, values per token in groups of G channels, both uniform
 * asymmetric (float minimum as zero point), with an R-token full-precision
 * residual; post-RoPE keys (what KIVI caches). Defaults G = 32, R = 128 (the
 * paper's runs, notes §1.3).
 * Decode equivalence: keys are flushed from the fp16 buffer in chunks of R
 * (G when R = 0) after the step that fills it has attended, values leave a
 * sliding window of R (kernels/quant/quant.h kvq_kivi_key_boundary /
 * kvq_kivi_value_boundary): the transform keeps the exact K/V and gives the
 * quantized ones as the alternative with those per-query boundaries.
 * Differences from the reference: KIVI computes min/scale in fp16 and rounds
 * Q.K to fp16 before scaling (notes trap 13); kvq keeps fp32/double. KIVI's
 * prefill attends exact K/V (notes trap 4); kvq simulates every query as a
 * decode step would see the cache (the decode-equivalent protocol). */
#include <string.h>

#include "family.h"

enum { KIVI_G = 32, KIVI_R = 128 };

static int parse_kivi(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits, g = KIVI_G, r = KIVI_R;
    const char *p = b;
    int rc = kvq_spec_bits(&p, "kivi", spec, &bits, err);
    if (rc <= 0) return rc;
    if (kvq_spec_starts(p, "-g")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &g) || g == 0)
            return kvq_spec_bad(spec, err, "group size after -g: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-r")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &r)) return kvq_spec_bad(spec, err, "residual length after -r: expected an integer >= 0");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected kivi<b>[-g<G>][-r<R>] (e.g. kivi2, kivi2-g32-r128)");
    if (r % g) {
        kvq_fail(err, KVQ_EINVAL, "scheme '%s': residual length %lu must be a multiple of the group size %lu (KIVI flushes R/G key groups)",
                 spec, r, g);
        return -1;
    }
    q->k_bits = q->v_bits = (int)bits;
    q->group = g;
    q->residual = r;
    return 1;
}

static void fmt_kivi(const kvq_scheme *q, char *b, size_t n)
{
    snprintf(b, n, "kivi%d-g%zu-r%zu", q->k_bits, q->group, q->residual);
}

static kvq_status validate_kivi(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: kivi has no sparse outliers, found %g", q->outlier_frac);
    if (q->group == 0) return kvq_fail(err, KVQ_EINVAL, "scheme: kivi group size: expected > 0, found 0");
    if (q->residual % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme: kivi residual length %zu: expected a multiple of group size %zu", q->residual,
                        q->group);
    return KVQ_OK;
}

static kvq_status check_model_kivi(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if ((size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': KIVI group size %zu does not divide head_dim %d (value groups never cross heads)",
                        spec, q->group, hp->head_dim);
    return KVQ_OK;
}

static kvq_status quantize_kivi(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    const kvq_scheme *q = &d->q;
    if (side == 'k') return kvq_kivi_keys(out, in, T, kvd, q->group, q->k_bits, q->n_sink, c, err);
    return kvq_kivi_values(out, in, T, kvd, hd, q->group, q->v_bits, q->n_sink, c, err);
}

static void bounds_kivi(const kvq_scheme *q, size_t T, int *kb, int *vb)
{
    for (size_t i = 0; i < T; i++) {
        kb[i] = (int)kvq_kivi_key_boundary(i, q->group, q->residual, q->n_sink);
        vb[i] = (int)kvq_kivi_value_boundary(i, q->residual, q->n_sink);
    }
}

/* exact K/V for the recent tokens, the quantized ones as the alternative with the decode boundaries */
static kvq_status transform_kivi(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                                 kvq_err *err)
{
    const kvq_kv_desc *d = run->d;
    size_t kvd = (size_t)c->n_kv_heads * c->head_dim, T = (size_t)c->T;
    KVQ_TRY(quantize_kivi(d, c->layer, 'k', alt->k, k, T, kvd, (size_t)c->head_dim, &run->k_counts, err));
    KVQ_TRY(quantize_kivi(d, c->layer, 'v', alt->v, v, T, kvd, (size_t)c->head_dim, &run->v_counts, err));
    bounds_kivi(&d->q, T, alt->k_bound, alt->v_bound);
    alt->use_k = alt->use_v = true;
    return KVQ_OK;
}

/* b + 32/G per quantized element (notes trap 16: "2-bit" KIVI is ~3 bits); the residual
 * counted as min(R, ctx - n_sink) fp16 tokens for K and V (the resting cache between steps);
 * with R = 0 the keys of the last partial group, (ctx - n_sink) mod G, stay fp16 */
static kvq_status bits_kivi(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    size_t ctx = in->ctx, ns = q->n_sink, rest = ctx > ns ? ctx - ns : 0;
    size_t n16 = ns + (q->residual < rest ? q->residual : rest);
    size_t n16k = q->residual == 0 && q->group ? ns + rest % q->group : n16;
    out->k = kvq_bits_mix16(q->k_bits + 32.0 / (double)q->group, ctx, n16k);
    out->v = kvq_bits_mix16(q->v_bits + 32.0 / (double)q->group, ctx, n16);
    return KVQ_OK;
}

static void describe_kivi(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "group_size", (double)q->group);
    o->num(o->ctx, "residual_length", (double)q->residual);
}

static void from_params_kivi(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->group = p->group_size;
    q->residual = p->residual_length;
    q->n_sink = p->n_sink;
}

static kvq_status check_params_kivi(const kvq_artifact_params *p, kvq_err *err)
{
    if (p->group_size == 0 || p->head_dim % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group_size: expected a divisor of head_dim %zu, found %zu", p->head_dim, p->group_size);
    if (p->residual_length % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "residual_length: expected a multiple of group_size %zu, found %zu", p->group_size,
                        p->residual_length);
    return KVQ_OK;
}

static void inspect_kivi(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "kivi          group size %zu, residual length %zu\n", p->group_size, p->residual_length);
}

static kvq_status kvcache_kivi(kvq_kvcache_config *cfg, const kvq_artifact *a, size_t layer, kvq_err *err)
{
    (void)layer;
    (void)err;
    cfg->format = KVQ_KVCACHE_KIVI;
    cfg->group = a->p.group_size;
    cfg->residual = a->p.residual_length;
    return KVQ_OK;
}

static const kvq_family_artifact art_kivi = {
    .post_rope_only = true,
    .k_axis = "per-channel",
    .v_axis = "per-token",
    .k_scaling = "uniform-online-per-channel-token-groups",
    .v_scaling = "uniform-online-per-token-channel-groups",
    .check_params = check_params_kivi,
    .inspect = inspect_kivi,
};

/* KIVI-2 of the notes: 2 bits, G = 32, R = 128, no sink, post-RoPE keys (what KIVI's cache holds) */
static const kvq_family_calib calib_kivi = {
    .bits = 2,
    .group = KIVI_G,
    .residual = KIVI_R,
    .post_rope = true,
    .group_opt = true,
    .residual_opt = true,
};

#ifdef KVQ_CUDA
extern const kvq_family_cuda kvq_kivi_cuda;
#endif

const kvq_family kvq_family_kivi = {
    .name = "kivi",
    .syntax = "kivi<b>[-g<G>][-r<R>] (default G=32, R=128)",
    .summary = "KIVI (arXiv 2402.02750): keys per channel in G-token groups, values per token in G-channel groups, "
               "an R-token full-precision residual; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_kivi,
    .format = fmt_kivi,
    .validate = validate_kivi,
    .check_model = check_model_kivi,
    .from_params = from_params_kivi,
    .artifact = &art_kivi,
    .calib = &calib_kivi,
    .quantize = quantize_kivi,
    .transform = transform_kivi,
    .alt_bounds = bounds_kivi,
    .describe = describe_kivi,
    .bits = bits_kivi,
    .cuda = KVQ_FAMILY_CUDA(kvq_kivi_cuda),
    .kvcache_config = kvcache_kivi,
};
