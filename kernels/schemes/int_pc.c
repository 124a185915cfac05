/* int_pc.c — uniform intX with per-channel keys from OFFLINE thresholds and
 * per-token values: KVQuant's "per-channel keys" ablation step (Hooper et
 * al., arXiv 2401.18079, §3.1 + App.G). Keys: channel c quantized on the
 * calibrated [lower_c, upper_c] (kvcalib --method int-pc, or the thresholds of
 * an nuq artifact); with an outlier fraction f > 0 keys outside them are kept
 * exact (dense-and-sparse, §3.4), otherwise they clamp. Values: per token in
 * groups of the artifact's --group channels (0 = whole token). Keys pre-RoPE
 * by default (the next ablation step; kvcalib's default stays post-RoPE).
 * Differences from the reference: KVQuant's per-channel simulation takes the
 * thresholds from the evaluated sequence itself (non-causal); kvq uses the
 * offline calibration so that no token sees later tokens. */
#include <math.h>
#include <string.h>

#include "family.h"
#include "tables.h"

kvq_status kvq_int_check_group(const kvq_artifact_params *p, kvq_err *err);
void kvq_int_inspect_group(FILE *f, const kvq_artifact_params *p);

static int parse_int_pc(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits;
    const char *p = b;
    int r = kvq_spec_bits(&p, "int", spec, &bits, err);
    if (r <= 0) return r;
    if (!kvq_spec_starts(p, "-pc")) return 0;
    p += 3;
    double f = 0;
    if (*p == '-') {
        p++;
        if (!kvq_spec_percent(&p, &f))
            return kvq_spec_bad(spec, err, "outlier fraction: expected -<f>% with 0 < f < 50 (e.g. int4-pc-1%)");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected int<b>-pc[-<f>%] (e.g. int4-pc, int3-pc-1%)");
    q->k_bits = q->v_bits = (int)bits;
    q->outlier_frac = f;
    q->group = 0;
    return 1;
}

static void fmt_int_pc(const kvq_scheme *q, char *b, size_t n)
{
    char pct[32];
    kvq_spec_fmt_pct(pct, sizeof pct, q->outlier_frac);
    snprintf(b, n, "int%d-pc%s", q->k_bits, pct);
}

static bool needs_artifact_int_pc(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool stage_ok(bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return !stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE);
}

static const char *stage_text(bool stage_set, kvq_key_stage stage)
{
    return stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "";
}

/* per-channel key thresholds: an int-pc artifact or an nuq one fitted with the same outlier fraction */
static bool match_int_pc(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && (!strcmp(p->method->name, "int-pc") || !strcmp(p->method->name, "nuq")) &&
           fabs(p->outlier_frac - q->outlier_frac) <= 1e-9 && stage_ok(stage_set, stage, p);
}

static void need_int_pc(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "per-channel key thresholds: a kvcalib artifact of method int-pc or nuq fitted with %g%% outliers%s",
             q->outlier_frac * 100, stage_text(stage_set, stage));
}

/* the values' per-token group size is the artifact's (kvcalib --group); an nuq artifact lending its key
 * thresholds has none */
static void bind_int_pc(kvq_scheme *q, const kvq_artifact_params *p)
{
    q->group = !strcmp(p->method->name, "int-pc") ? p->group_size : 0;
}

static void from_params_int_pc(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->outlier_frac = p->outlier_frac;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
}

/* thresholds of every layer: finite, lower <= upper */
kvq_status kvq_check_key_thresholds(const kvq_kv_desc *d, const kvq_hparams *hp, const char *what, kvq_err *err);
kvq_status kvq_check_key_thresholds(const kvq_kv_desc *d, const kvq_hparams *hp, const char *what, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    if (!d->layers || d->n_layers != hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: %s needs tables for %d layers, found %d", what, hp->n_layers,
                        d->layers ? d->n_layers : 0);
    for (int l = 0; l < hp->n_layers; l++) {
        const kvq_kv_layer_tables *t = &d->layers[l];
        if (!t->k_lower || !t->k_upper) return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: key channel thresholds missing", l);
        for (size_t c = 0; c < kvd; c++)
            if (!isfinite(t->k_lower[c]) || !isfinite(t->k_upper[c]) || t->k_lower[c] > t->k_upper[c])
                return kvq_fail(err, KVQ_EINVAL, "kv descriptor: layer %d: channel %zu: expected finite lower <= upper, found [%g, %g]",
                                l, c, (double)t->k_lower[c], (double)t->k_upper[c]);
    }
    return KVQ_OK;
}

static kvq_status check_tables_int_pc(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    if (d->q.group && kvd % d->q.group)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: int-pc value group size %zu does not divide kv_dim %zu", d->q.group, kvd);
    return kvq_check_key_thresholds(d, hp, "int per-channel", err);
}

static kvq_status quantize_int_pc(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                  size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)hd;
    const kvq_scheme *q = &d->q;
    if (side == 'v') return kvq_quant_int_token(out, in, T, kvd, q->group, q->v_bits, q->n_sink, c, err);
    const kvq_kv_layer_tables *t = &d->layers[layer];
    return kvq_quant_int_channel(out, in, T, kvd, t->k_lower, t->k_upper, q->k_bits, q->outlier_frac > 0, q->n_sink, c, err);
}

/* keys: b + fp16 (scale, zero) per channel amortised over ctx + sparse outliers (f*32 + a 32-bit row
 * pointer per token); values: b + 32/g */
static kvq_status bits_int_pc(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double g = (double)(q->group ? q->group : in->kv_dim), f = kvq_bits_outlier_frac(in->k, q->outlier_frac);
    double outl_k = q->outlier_frac > 0 ? f * 32.0 + 32.0 / (double)in->kv_dim : 0;
    out->k = kvq_bits_mix16(q->k_bits + 32.0 / (double)in->ctx + outl_k, in->ctx, q->n_sink);
    out->v = kvq_bits_mix16(q->v_bits + 32.0 / g, in->ctx, q->n_sink);
    return KVQ_OK;
}

static kvq_status fit_int_pc(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out,
                             kvq_err *err)
{
    (void)side;
    kvq_calib_opts co = {.bits = p->k_bits, .outlier_frac = p->outlier_frac, .n_sink = p->n_sink, .sample_len = in->sample_len,
                         .n_kv_heads = in->n_kv_heads, .head_dim = in->head_dim, .fit = in->fit};
    return kvq_calib_int_pc_keys(in->x, in->n_tokens, &co, out, err);
}

static const kvq_family_artifact art_int_pc = {
    .k_thresholds = true,
    .outliers = true,
    .k_axis = "per-channel",
    .v_axis = "per-token",
    .k_scaling = "uniform-offline-per-channel-thresholds",
    .v_scaling = "uniform-online-per-token-minmax",
    .check_params = kvq_int_check_group,
    .inspect = kvq_int_inspect_group,
};

/* the "per-channel keys" ablation step: post-RoPE keys, --keys pre-rope for the next step */
static const kvq_family_calib calib_int_pc = {
    .bits = 4,
    .sink = 1,
    .post_rope = true,
    .pre_rope_ok = true,
    .group_opt = true,
    .fit_k = true,
    .fit = fit_int_pc,
};

#ifdef KVQ_CUDA
extern const kvq_family_cuda kvq_int_pc_cuda;
#endif

const kvq_family kvq_family_int_pc = {
    .name = "int-pc",
    .syntax = "int<b>-pc[-<f>%]",
    .summary = "uniform, per-channel keys with offline thresholds (KVQuant App.G; f > 0 keeps keys outside them exact), "
               "per-token values; keys at the artifact's stage (kvcalib: post-RoPE by default, the ablation's per-channel step; "
               "--keys pre-rope for KVQuant's)",
    .default_stage = KVQ_KEYS_PRE_ROPE,
    .parse = parse_int_pc,
    .format = fmt_int_pc,
    .needs_artifact = needs_artifact_int_pc,
    .match = match_int_pc,
    .describe_need = need_int_pc,
    .bind_params = bind_int_pc,
    .from_params = from_params_int_pc,
    .check_tables = check_tables_int_pc,
    .artifact = &art_int_pc,
    .calib = &calib_int_pc,
    .quantize = quantize_int_pc,
    .bits = bits_int_pc,
    .cuda = KVQ_FAMILY_CUDA(kvq_int_pc_cuda),
};
