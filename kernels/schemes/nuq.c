/* nuq.c — KVQuant's nuqX (Hooper et al., arXiv 2401.18079 §3; repo notes
 * ../shared/docs/kvquant.md): keys per channel with OFFLINE thresholds
 * [lower_c, upper_c] (§3.1, pre-RoPE by default) and values per token with
 * online thresholds (§3.2), both normalised to [-1, 1] and coded to the
 * nearest of 2^b levels of a datatype fitted per layer (or per KV head) by
 * Fisher-weighted 1-D k-means (§3.3, App.D); dense-and-sparse outliers kept
 * exact outside the thresholds (§3.4); the first n_sink tokens exact (§3.5).
 * Calibration: kernels/quant/tables.h (percentile thresholds, the fit).
 * Differences from the reference: the repo feeds sink tokens to its
 * percentiles (the paper does not; kvq follows the paper), quantizes in fp16
 * (kvq: double from fp32, rounded once), and evaluates a whole sequence with
 * thresholds from it (kvq: offline thresholds, decode-equivalent). */
#include <math.h>
#include <string.h>

#include "family.h"
#include "tables.h"

kvq_status kvq_check_key_thresholds(const kvq_kv_desc *d, const kvq_hparams *hp, const char *what, kvq_err *err);

static int parse_nuq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits;
    const char *p = b;
    int r = kvq_spec_bits(&p, "nuq", spec, &bits, err);
    if (r <= 0) return r;
    double f = 0;
    if (*p == '-') {
        p++;
        if (!kvq_spec_percent(&p, &f))
            return kvq_spec_bad(spec, err, "outlier fraction: expected -<f>% with 0 < f < 50 (e.g. nuq3-1%)");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected nuq<b>[-<f>%] (e.g. nuq4, nuq3-1%)");
    q->k_bits = q->v_bits = (int)bits;
    q->outlier_frac = f;
    return 1;
}

static void fmt_nuq(const kvq_scheme *q, char *b, size_t n)
{
    char pct[32];
    kvq_spec_fmt_pct(pct, sizeof pct, q->outlier_frac);
    snprintf(b, n, "nuq%d%s", q->k_bits, pct);
}

static bool needs_artifact_nuq(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool match_nuq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "nuq") && p->k_bits == q->k_bits && p->v_bits == q->v_bits &&
           fabs(p->outlier_frac - q->outlier_frac) <= 1e-9 &&
           (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_nuq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method nuq with %d bits and %g%% outliers%s", q->k_bits, q->outlier_frac * 100,
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
}

static void from_params_nuq(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->outlier_frac = p->outlier_frac;
    q->n_sink = p->n_sink;
}

static kvq_status check_lut(const kvq_nuq_lut *l, int bits, int layer, char kv, const kvq_hparams *hp, kvq_err *err)
{
    if (!l->levels) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels missing (nuq)", layer, kv);
    if (l->bits != bits)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels: expected %d bits, found %d", layer, kv, bits, l->bits);
    if (l->n_tables != 1 && (l->n_tables != (size_t)hp->n_kv_heads || l->head_dim != (size_t)hp->head_dim))
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c levels: expected 1 or %d tables of head_dim %d, found %zu of %zu",
                        layer, kv, hp->n_kv_heads, hp->head_dim, l->n_tables, l->head_dim);
    size_t nl = (size_t)1 << bits;
    for (size_t t = 0; t < l->n_tables; t++)
        for (size_t j = 0; j < nl; j++) {
            float x = l->levels[t * nl + j];
            if (!isfinite(x) || (j && x < l->levels[t * nl + j - 1]))
                return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: %c table %zu level %zu: expected finite and ascending, found %g",
                                layer, kv, t, j, (double)x);
        }
    return KVQ_OK;
}

static kvq_status check_tables_nuq(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    KVQ_TRY(kvq_check_key_thresholds(d, hp, "nuq", err));
    for (int l = 0; l < hp->n_layers; l++) {
        KVQ_TRY(check_lut(&d->layers[l].k_lut, d->q.k_bits, l, 'k', hp, err));
        KVQ_TRY(check_lut(&d->layers[l].v_lut, d->q.v_bits, l, 'v', hp, err));
    }
    return KVQ_OK;
}

static kvq_status quantize_nuq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                               size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)hd;
    const kvq_scheme *q = &d->q;
    const kvq_kv_layer_tables *t = &d->layers[layer];
    if (side == 'v') return kvq_quant_nuq_values(out, in, T, kvd, &t->v_lut, q->outlier_frac, q->n_sink, c, err);
    return kvq_quant_nuq_keys(out, in, T, kvd, &t->k_lut, t->k_lower, t->k_upper, q->outlier_frac > 0, q->n_sink, c, err);
}

/* KVQuant App.M: b code bits; keys: an fp16 (scale, zero) per channel amortised over ctx, values:
 * per token over kv_dim; a LUT of 2^b fp16 levels per tensor; sparse outliers as 16-bit value +
 * 16-bit index, plus a 32-bit row pointer per token (keys: the realised fraction when a run's
 * counts are given; values: 2k per token, k = kvq_outliers_per_side) */
static kvq_status bits_nuq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double ctx = (double)in->ctx, kvd = (double)in->kv_dim, outl_k = 0, outl_v = 0;
    if (q->outlier_frac > 0) {
        outl_k = kvq_bits_outlier_frac(in->k, q->outlier_frac) * 32.0 + 32.0 / kvd;
        size_t kv = kvq_outliers_per_side(in->kv_dim, q->outlier_frac);
        outl_v = (double)(2 * kv) / kvd * 32.0 + 32.0 / kvd;
    }
    double lut_k = 16.0 * (double)(1u << q->k_bits) / (ctx * kvd), lut_v = 16.0 * (double)(1u << q->v_bits) / (ctx * kvd);
    out->k = kvq_bits_mix16(q->k_bits + 32.0 / ctx + lut_k + outl_k, in->ctx, q->n_sink);
    out->v = kvq_bits_mix16(q->v_bits + 32.0 / kvd + lut_v + outl_v, in->ctx, q->n_sink);
    return KVQ_OK;
}

/* A table set none of whose datatypes had a point to fit (every head fell back to uniform
 * levels) is a calibration-set problem, not a property of the layer: too many sink tokens for
 * the sample length, outliers taking every element, or zero Fisher information on every
 * remaining position (a sample's last position gets no gradient of the LM loss). An error
 * instead of an artifact of placeholder datatypes. */
static kvq_status check_fitted(const kvq_kv_table *t, size_t n_tokens, const kvq_calib_opts *co, bool fisher, kvq_err *err)
{
    for (size_t h = 0; h < t->n_tables; h++)
        if (t->chosen[h] != KVQ_FIT_CHOSEN_NONE) return KVQ_OK;
    size_t per = co->sample_len ? co->sample_len : n_tokens, ns = co->n_sink < per ? co->n_sink : per;
    size_t used = n_tokens / per * (per - ns);
    return kvq_fail(err, KVQ_EINVAL,
                    "no calibration points to fit the nuq%d datatype%s: the %zu tokens left after excluding %zu sink tokens "
                    "per sample of %zu are all outliers, constant%s; use fewer --sink tokens, more or longer samples%s",
                    co->bits, t->n_tables > 1 ? "s" : "", used, ns, per,
                    fisher ? " or carry zero Fisher information (a sample's last position gets no gradient)" : "",
                    fisher ? ", or --no-fisher" : "");
}

static kvq_status fit_nuq(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out, kvq_err *err)
{
    kvq_calib_opts co = {.bits = side == 'k' ? p->k_bits : p->v_bits, .outlier_frac = p->outlier_frac, .n_sink = p->n_sink,
                         .sample_len = in->sample_len, .n_kv_heads = in->n_kv_heads, .head_dim = in->head_dim,
                         .per_head = p->per_head, .fit = in->fit};
    kvq_status s = side == 'k' ? kvq_calib_keys(in->x, in->fisher, in->n_tokens, &co, out, err)
                               : kvq_calib_values(in->x, in->fisher, in->n_tokens, &co, out, err);
    if (!s) s = check_fitted(out, in->n_tokens, &co, in->fisher != NULL, err);
    if (s) kvq_kv_table_free(out);
    return s;
}

static void inspect_nuq(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "datatypes     %s, fit %s, %s\n", p->per_head ? "per-head" : "per-layer", p->fit,
            p->fisher ? "Fisher-weighted" : "unweighted");
}

static kvq_status kvcache_nuq(kvq_kvcache_config *cfg, const kvq_artifact *a, size_t layer, kvq_err *err)
{
    if (!a->k || !a->v || !a->k[layer].levels || !a->v[layer].levels || !a->k[layer].channel_lower || !a->k[layer].channel_upper)
        return kvq_fail(err, KVQ_EFORMAT, "artifact: layers.%zu: nuq tables missing", layer);
    cfg->format = KVQ_KVCACHE_NUQ;
    cfg->outlier_frac = a->p.outlier_frac;
    cfg->k_tables = a->k[layer].n_tables;
    cfg->v_tables = a->v[layer].n_tables;
    cfg->k_levels = a->k[layer].levels;
    cfg->v_levels = a->v[layer].levels;
    cfg->k_lower = a->k[layer].channel_lower;
    cfg->k_upper = a->k[layer].channel_upper;
    return KVQ_OK;
}

static const kvq_family_artifact art_nuq = {
    .k_levels = true,
    .v_levels = true,
    .v_levels_fp16 = true,
    .k_thresholds = true,
    .outliers = true,
    .per_head = true,
    .k_axis = "per-channel",
    .v_axis = "per-token",
    .k_scaling = "nuq-offline-per-channel-thresholds",
    .v_scaling = "nuq-online-per-token-thresholds",
    .inspect = inspect_nuq,
};

/* 4 bit, 1% outliers, 1 sink token, pre-RoPE keys, Fisher-weighted per-layer datatypes, fit auto */
static const kvq_family_calib calib_nuq = {
    .bits = 4,
    .outliers = 0.01,
    .sink = 1,
    .post_rope = false,
    .fisher = true,
    .pre_rope_ok = true,
    .fisher_opt = true,
    .fit_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit = fit_nuq,
};

#ifdef KVQ_CUDA
extern const kvq_family_cuda kvq_nuq_cuda;
#endif

const kvq_family kvq_family_nuq = {
    .name = "nuq",
    .syntax = "nuq<b>[-<f>%]",
    .summary = "KVQuant nuqX (arXiv 2401.18079 §3): per-channel pre-RoPE keys with offline thresholds, per-token values, "
               "Fisher-weighted datatypes, f% dense-and-sparse outliers; tables from a kvcalib artifact",
    .default_stage = KVQ_KEYS_PRE_ROPE,
    .parse = parse_nuq,
    .format = fmt_nuq,
    .needs_artifact = needs_artifact_nuq,
    .match = match_nuq,
    .describe_need = need_nuq,
    .from_params = from_params_nuq,
    .check_tables = check_tables_nuq,
    .artifact = &art_nuq,
    .calib = &calib_nuq,
    .quantize = quantize_nuq,
    .bits = bits_nuq,
    .cuda = KVQ_FAMILY_CUDA(kvq_nuq_cuda),
    .kvcache_config = kvcache_nuq,
};
