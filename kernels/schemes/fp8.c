/* fp8.c — vLLM's FP8 KV cache (kernels/quant/quant_fp8.h: E4M3FN or E5M2,
 * round to nearest even, saturating): stored = fp8(x / scale), read back as
 * fp8 * scale, with scale 1.0 (fp8, e5m2: the engine default without
 * calibrated scales) or per-layer-tensor / per-KV-head k/v scales from a
 * kvcalib artifact (fp8-tensor, fp8-head, e5m2-...: absmax or a percentile of
 * |x| over the calibration keys/values divided by the format's max,
 * llm-compressor's amax / 448). Keys post-RoPE (what vLLM caches). The first
 * n_sink tokens exact. docs/fp8-vllm.md.
 * variant = format (KVQ_FP8_E4M3FN / KVQ_FP8_E5M2) + 2 (per-KV-head scales)
 * + 4 (scales from an artifact). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "cli.h"
#include "quant_fp8.h"

enum { FP8_HEAD = 2, FP8_SCALED = 4 };

static int parse_fp8(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!strcmp(b, "fp8") || !strcmp(b, "e5m2")) {
        q->k_bits = q->v_bits = 8;
        q->variant = b[0] == 'e' ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN;
        return 1;
    }
    const char *p = b;
    int fmt;
    if (kvq_spec_starts(p, "fp8-")) { fmt = KVQ_FP8_E4M3FN; p += 4; }
    else if (kvq_spec_starts(p, "e5m2-")) { fmt = KVQ_FP8_E5M2; p += 5; }
    else return 0;
    int head;
    if (kvq_spec_starts(p, "tensor")) { head = 0; p += 6; }
    else if (kvq_spec_starts(p, "head")) { head = 1; p += 4; }
    else return kvq_spec_bad(spec, err, "expected fp8, e5m2, {fp8,e5m2}-tensor[-p<P>] or {fp8,e5m2}-head[-p<P>]");
    double pct = 100;
    if (kvq_spec_starts(p, "-p")) {
        p += 2;
        char buf[32];
        size_t n = strlen(p);
        if (n == 0 || n >= sizeof buf || strspn(p, "0123456789.") != n)
            return kvq_spec_bad(spec, err, "percentile after -p: expected a number in (0, 100] (e.g. fp8-tensor-p99.9)");
        memcpy(buf, p, n + 1);
        if (!kvq_parse_double(buf, &pct) || !(pct > 0 && pct <= 100))
            return kvq_spec_bad(spec, err, "percentile after -p: expected a number in (0, 100] (e.g. fp8-tensor-p99.9)");
        p += n;
    }
    if (*p) return kvq_spec_bad(spec, err, "expected {fp8,e5m2}-{tensor,head}[-p<P>] (e.g. fp8-tensor, fp8-head-p99.9)");
    q->k_bits = q->v_bits = 8;
    q->variant = fmt + FP8_HEAD * head + FP8_SCALED;
    q->percentile = pct;
    return 1;
}

static bool e5m2(const kvq_scheme *q) { return (q->variant & 1) == KVQ_FP8_E5M2; }
static bool per_head(const kvq_scheme *q) { return (q->variant & FP8_HEAD) != 0; }
static bool scaled(const kvq_scheme *q) { return (q->variant & FP8_SCALED) != 0; }

static void fmt_fp8(const kvq_scheme *q, char *b, size_t n)
{
    if (!scaled(q)) {
        snprintf(b, n, "%s", e5m2(q) ? "e5m2" : "fp8");
        return;
    }
    char pct[40] = "";
    if (q->percentile < 100) snprintf(pct, sizeof pct, "-p%g", q->percentile);
    snprintf(b, n, "%s-%s%s", e5m2(q) ? "e5m2" : "fp8", per_head(q) ? "head" : "tensor", pct);
}

static kvq_status validate_fp8(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0 || q->group || q->residual)
        return kvq_fail(err, KVQ_EINVAL, "scheme: fp8 has no outliers, groups or residual (found %g, %zu, %zu)", q->outlier_frac,
                        q->group, q->residual);
    if (q->variant < 0 || q->variant > 7) return kvq_fail(err, KVQ_EINVAL, "scheme: fp8 variant: unknown value %d", q->variant);
    return KVQ_OK;
}

static bool needs_artifact_fp8(const kvq_scheme *q) { return scaled(q); }

static bool match_fp8(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "fp8") && p->fp8_e5m2 == e5m2(q) && p->per_head == per_head(q) &&
           fabs(p->fp8_percentile - q->percentile) <= 1e-9 && (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_fp8(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method fp8 with %s %s scales (%s)%s", e5m2(q) ? "E5M2" : "E4M3FN",
             per_head(q) ? "per-KV-head" : "per-tensor", q->percentile < 100 ? "percentile" : "absmax, percentile 100",
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
    if (q->percentile < 100) {
        size_t l = strlen(buf);
        if (l < n) snprintf(buf + l, n - l, " %g", q->percentile);
    }
}

static void describe_fp8(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    o->str(o->ctx, "fp8_format", e5m2(q) ? "e5m2" : "e4m3fn");
    o->str(o->ctx, "fp8_scales", !has_artifact ? "unit" : per_head(q) ? "per-kv-head" : "per-tensor");
    if (has_artifact) o->num(o->ctx, "fp8_percentile", q->percentile);
}

static void from_params_fp8(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = q->v_bits = 8;
    q->variant = (p->fp8_e5m2 ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN) + (p->per_head ? FP8_HEAD : 0) + FP8_SCALED;
    q->percentile = p->fp8_percentile;
    q->n_sink = p->n_sink;
}

static kvq_status check_tables_fp8(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!scaled(&d->q)) return KVQ_OK;
    const kvq_artifact *a = d->art;
    size_t want = per_head(&d->q) ? (size_t)hp->n_kv_heads : 1;
    if (!a || a->p.n_layers != (size_t)hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: fp8 scales need an artifact of %d layers", hp->n_layers);
    for (size_t l = 0; l < a->p.n_layers; l++) {
        const kvq_kv_table *kt = a->k ? &a->k[l] : NULL, *vt = a->v ? &a->v[l] : NULL;
        if (!kt || !vt || !kt->fp8_scale || !vt->fp8_scale || kt->n_fp8_scales != want || vt->n_fp8_scales != want)
            return kvq_fail(err, KVQ_EFORMAT, "layer %zu lacks %zu fp8 scale(s) for K and V", l, want);
    }
    return KVQ_OK;
}

/* per token, offline scales (1.0, or the artifact's per layer); the first n_sink tokens exact */
static kvq_status quantize_fp8(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                               size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    size_t H = kvd / hd, ns = d->q.n_sink < T ? d->q.n_sink : T;
    const float one = 1.0f, *sc = &one;
    size_t n_sc = 1;
    if (scaled(&d->q)) {
        const kvq_kv_table *t = side == 'k' ? &d->art->k[layer] : &d->art->v[layer];
        sc = t->fp8_scale;
        n_sc = t->n_fp8_scales;
    }
    if (out != in) memmove(out, in, ns * kvd * sizeof(float));
    const kvq_fp8_format f = (kvq_fp8_format)(d->q.variant & 1);
    if (c && T > ns) c->n_clipped += kvq_fp8_count_saturated(f, in + ns * kvd, T - ns, H, hd, sc, n_sc);
    if (T > ns) KVQ_TRY(kvq_fp8_kv_roundtrip(f, in + ns * kvd, out + ns * kvd, T - ns, H, hd, sc, n_sc, err));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
    }
    return KVQ_OK;
}

/* 8-bit codes + float32 scales per layer (1 or n_kv_heads each for K and V; scale 1.0 is still one
 * stored float) amortised over the ctx-token cache (kvq_fp8_bits_per_element); sink tokens at 16 */
static kvq_status bits_fp8(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (in->head_dim == 0 || in->kv_dim % in->head_dim)
        return kvq_fail(err, KVQ_EINVAL, "scheme bits: fp8: ctx %zu, kv_dim %zu, head_dim %zu (the scale count needs head_dim)",
                        in->ctx, in->kv_dim, in->head_dim);
    size_t H = in->kv_dim / in->head_dim, n_sc = per_head(q) ? H : 1;
    double dense = kvq_fp8_bits_per_element(n_sc, in->ctx, H, in->head_dim);
    out->k = out->v = kvq_bits_mix16(dense, in->ctx, q->n_sink);
    return KVQ_OK;
}

static kvq_status check_params_fp8(const kvq_artifact_params *p, kvq_err *err)
{
    if (p->k_bits != 8 || p->v_bits != 8)
        return kvq_fail(err, KVQ_EINVAL, "k_bits, v_bits: fp8 stores 8-bit codes, found %d / %d", p->k_bits, p->v_bits);
    if (p->group_size || p->residual_length)
        return kvq_fail(err, KVQ_EINVAL, "group_size, residual_length: fp8 has neither, found %zu / %zu", p->group_size,
                        p->residual_length);
    if (!(p->fp8_percentile > 0 && p->fp8_percentile <= 100))
        return kvq_fail(err, KVQ_EINVAL, "fp8_percentile: expected (0, 100], found %g", p->fp8_percentile);
    return KVQ_OK;
}

static void inspect_fp8(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "fp8           %s, %s scales, %s\n", p->fp8_e5m2 ? "E5M2" : "E4M3FN", p->per_head ? "per-KV-head" : "per-tensor",
            p->fp8_percentile < 100 ? "percentile of |x|" : "absmax");
    if (p->fp8_percentile < 100) fprintf(f, "percentile    %.6g\n", p->fp8_percentile);
}

/* drop each sample's first n_sink rows (in place), take the scales, count saturation */
static kvq_status fit_fp8(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out, kvq_err *err)
{
    (void)side;
    size_t H = in->n_kv_heads, D = in->head_dim, kvd = H * D;
    float *x = (float *)in->x; /* the driver's buffer, ours to compact */
    size_t rows = kvq_fit_drop_sink(in, p->n_sink);
    kvq_fp8_format f = p->fp8_e5m2 ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN;
    size_t n_sc = p->per_head ? H : 1;
    memset(out, 0, sizeof *out);
    out->bits = 8;
    out->kv_dim = kvd;
    out->n_fp8_scales = n_sc;
    out->fp8_scale = malloc(n_sc * sizeof *out->fp8_scale);
    if (!out->fp8_scale) return kvq_fail(err, KVQ_ENOMEM, "out of memory");
    kvq_status s = p->per_head ? kvq_fp8_calib_heads(f, x, rows, H, D, p->fp8_percentile, out->fp8_scale, err)
                               : kvq_fp8_calib_tensor(f, x, rows, H, D, p->fp8_percentile, out->fp8_scale, err);
    if (s) {
        kvq_kv_table_free(out);
        return s;
    }
    /* clipped by saturation: |x / s| at or beyond the rounding midpoint above the largest finite
     * value (448 + 32/2 for E4M3FN, 57344 + 8192/2 for E5M2); below it round-to-nearest gives the
     * max anyway (absmax scales can land a hair above 448 in float32) */
    out->n_elems = out->n_points = (uint64_t)rows * kvd;
    out->n_outliers = kvq_fp8_count_saturated(f, x, rows, H, D, out->fp8_scale, n_sc);
    return KVQ_OK;
}

static const kvq_family_artifact art_fp8 = {
    .fp8_scales = true,
    .vllm_export = true,
    .per_head = true,
    .k_axis = "per-element",
    .v_axis = "per-element",
    .k_scaling = "fp8-offline-scale",
    .v_scaling = "fp8-offline-scale",
    .check_params = check_params_fp8,
    .inspect = inspect_fp8,
};

/* 8 bit E4M3FN, per-tensor absmax scales (percentile 100), no sink, post-RoPE keys (vLLM's cache
 * with llm-compressor's amax / 448) */
static const kvq_family_calib calib_fp8 = {
    .bits = 8,
    .post_rope = true,
    .fp8_percentile = 100,
    .pre_rope_ok = true,
    .fp8_opt = true,
    .fp8_format_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit = fit_fp8,
};

static int code_bits_fp8(const kvq_scheme *q, char side)
{
    (void)q;
    (void)side;
    return 8;
}

const kvq_family kvq_family_fp8 = {
    .name = "fp8",
    .syntax = "fp8, e5m2, {fp8,e5m2}-{tensor,head}[-p<P>]",
    .summary = "vLLM's FP8 cache, E4M3FN / E5M2, scale 1.0, or per-tensor / per-KV-head k/v scales from a kvcalib fp8 "
               "artifact (percentile P, default 100 = absmax); post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_fp8,
    .format = fmt_fp8,
    .validate = validate_fp8,
    .needs_artifact = needs_artifact_fp8,
    .match = match_fp8,
    .describe_need = need_fp8,
    .from_params = from_params_fp8,
    .check_tables = check_tables_fp8,
    .artifact = &art_fp8,
    .calib = &calib_fp8,
    .quantize = quantize_fp8,
    .describe = describe_fp8,
    .bits = bits_fp8,
    .code_bits = code_bits_fp8,
};
