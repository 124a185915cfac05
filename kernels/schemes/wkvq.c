/* wkvq.c — the KV-cache part of WKVQuant (Yue, Yuan, Duanmu, Zhou, Wu, Nie,
 * "WKVQuant: Quantizing Weight and Key/Value Cache for Large Language Models
 * Gains More", arXiv 2402.12065).
 *
 * §3.1 Past-Only Quantization (POQ): at every decode step the current token
 * attends to its own key and value in full precision; only the past, the
 * cache, is quantized (the token is quantized when it is appended, after its
 * own step). kvq gives the quantized K/V as the alternative with per-query
 * boundaries k_bound[i] = v_bound[i] = i (form 2 of the contract): query i
 * reads keys j < i quantized and its own exact.
 * §3.2 Two-dimensional quantization: static channel smoothing, then dynamic
 * token-wise quantization. Per channel c of a layer's keys (values),
 *   y = (x - shift_c) / scale_c,
 * then each token's y is quantized uniformly, asymmetric min/max per group of
 * G channels (kernels/quant/quant.h kvq_quant_int_token, round half to even,
 * G = 0: the whole token), and read back as x = y_hat * scale_c + shift_c.
 *
 * Out of scope: WKVQuant's weight quantization (W4, OmniQuant-style) and its
 * §3.3 Cross-block Reconstruction Regularization, the training that learns
 * shift and scale (and the weights' clipping) block by block. kvq uses a
 * closed form in their place, computed by kvcalib from the dump's
 * calibration tokens (sink tokens excluded), per layer and channel:
 *   shift_c = (max_c + min_c) / 2,   scale_c = max(r_c, 1e-6 * R)^alpha,
 *   r_c = (max_c - min_c) / 2, R = max over channels of r_c,
 * i.e. each channel centred and brought to the same range [-1, 1] at
 * alpha = 1 (the per-channel shift/scale of OS+, the initialisation of the
 * smoothing parameters that training starts from), so per-token quantization
 * no longer loses the small channels to the outlier channels.
 *
 * Spec: wkvq<b>[-g<G>] (b = 1..8; G channels per per-token group dividing
 * kv_dim, default 0 = the whole token), e.g. wkvq4, wkvq2-g64. Tables: an
 * artifact of method wkvq (kvcalib --method wkvq), per layer
 *   layers.<i>.k.shift, layers.<i>.k.scale, layers.<i>.v.shift, layers.<i>.v.scale
 *   float32 [kv_dim] (scale > 0); keys post-RoPE by default (the cache the
 *   paper quantizes; --keys pre-rope fits and applies them before RoPE).
 * Parameter (kvcalib --param): alpha in [0, 1], the smoothing strength
 * (default 1; 0 = no smoothing beyond the shift).
 * The tables do not depend on b or G: any wkvq spec binds to any wkvq artifact
 * of its key stage.
 * Bits per element: b + 32 / G (fp16 scale and zero point per group and
 * token) + 32 / ctx (the fp16 shift and scale of each channel amortised over
 * ctx tokens); sink tokens at 16.
 * Differences from the reference: shift and scale are the closed form above,
 * not trained (§3.3); kvq quantizes in double from fp32 (the paper's fake
 * quantization in fp16); the group size is a kvq parameter (the paper uses
 * per-token quantization); the paper's prefill quantizes the past of every
 * prompt token the same way, which the boundaries reproduce. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dump.h"
#include "family.h"

enum { WKVQ_X_ALPHA = 0 };

static int parse_wkvq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits, g = 0;
    const char *p = b;
    int rc = kvq_spec_bits(&p, "wkvq", spec, &bits, err);
    if (rc <= 0) return rc;
    if (kvq_spec_starts(p, "-g")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &g) || g == 0)
            return kvq_spec_bad(spec, err, "group size after -g: expected an integer >= 1");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected wkvq<b>[-g<G>] (e.g. wkvq4, wkvq2-g64)");
    q->k_bits = q->v_bits = (int)bits;
    q->group = g;
    return 1;
}

static void fmt_wkvq(const kvq_scheme *q, char *b, size_t n)
{
    if (q->group) snprintf(b, n, "wkvq%d-g%zu", q->k_bits, q->group);
    else snprintf(b, n, "wkvq%d", q->k_bits);
}

static kvq_status validate_wkvq(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: wkvq has no sparse outliers, found %g", q->outlier_frac);
    return KVQ_OK;
}

static kvq_status check_model_wkvq(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    if (q->group && kvd % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide the model's kv_dim %zu", spec, q->group, kvd);
    return KVQ_OK;
}

static bool needs_artifact_wkvq(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool match_wkvq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    (void)q;
    return p->method && !strcmp(p->method->name, "wkvq") && (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_wkvq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    (void)q;
    snprintf(buf, n, "a kvcalib artifact of method wkvq (channel shift and scale; any bits)%s",
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
}

static void bind_params_wkvq(kvq_scheme *q, const kvq_artifact_params *p)
{
    for (int j = 0; j < KVQ_SCHEME_X; j++) q->x[j] = p->x[j];
}

static void from_params_wkvq(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
    bind_params_wkvq(q, p);
}

static kvq_status tables(const kvq_kv_desc *d, int layer, char side, size_t kvd, const float **shift, const float **scale,
                         kvq_err *err)
{
    const kvq_artifact *a = d->art;
    if (!a || layer < 0 || (size_t)layer >= a->p.n_layers || !(side == 'k' ? a->k : a->v))
        return kvq_fail(err, KVQ_EINVAL, "wkvq: layer %d: no artifact tables bound (a kvcalib artifact of method wkvq)", layer);
    const kvq_kv_table *t = side == 'k' ? &a->k[layer] : &a->v[layer];
    const kvq_fam_tensor *sh = kvq_kv_table_get(t, "shift"), *sc = kvq_kv_table_get(t, "scale");
    if (!sh || !sc || sh->n_dims != 1 || sc->n_dims != 1 || sh->shape[0] != kvd || sc->shape[0] != kvd)
        return kvq_fail(err, KVQ_EINVAL, "wkvq: layers.%d.%c.shift / scale: expected [%zu] (kv_dim) each, found %s", layer, side, kvd,
                        sh && sc ? "another shape" : "none");
    *shift = sh->data;
    *scale = sc->data;
    return KVQ_OK;
}

static kvq_status check_tables_wkvq(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    const float *a, *b;
    for (int l = 0; l < hp->n_layers; l++) {
        KVQ_TRY(tables(d, l, 'k', kvd, &a, &b, err));
        KVQ_TRY(tables(d, l, 'v', kvd, &a, &b, err));
    }
    return KVQ_OK;
}

static kvq_status quantize_wkvq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                                size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)hd;
    const float *shift, *scale;
    KVQ_TRY(tables(d, layer, side, kvd, &shift, &scale, err));
    size_t ns = d->q.n_sink < T ? d->q.n_sink : T;
    if (out != in) memcpy(out, in, T * kvd * sizeof *out);
    for (size_t t = ns; t < T; t++)
        for (size_t j = 0; j < kvd; j++) out[t * kvd + j] = (out[t * kvd + j] - shift[j]) / scale[j];
    KVQ_TRY(kvq_quant_int_token(out, out, T, kvd, d->q.group, side == 'k' ? d->q.k_bits : d->q.v_bits, ns, c, err));
    for (size_t t = ns; t < T; t++)
        for (size_t j = 0; j < kvd; j++) out[t * kvd + j] = out[t * kvd + j] * scale[j] + shift[j];
    return KVQ_OK;
}

/* past-only: query i reads keys and values j < i from the quantized cache, its own exact */
static void bounds_wkvq(const kvq_scheme *q, size_t T, int *kb, int *vb)
{
    (void)q;
    for (size_t i = 0; i < T; i++) kb[i] = vb[i] = (int)i;
}

static kvq_status transform_wkvq(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    const kvq_kv_desc *d = run->d;
    size_t kvd = (size_t)c->n_kv_heads * c->head_dim, T = (size_t)c->T;
    KVQ_TRY(quantize_wkvq(d, c->layer, 'k', alt->k, k, T, kvd, (size_t)c->head_dim, &run->k_counts, err));
    KVQ_TRY(quantize_wkvq(d, c->layer, 'v', alt->v, v, T, kvd, (size_t)c->head_dim, &run->v_counts, err));
    bounds_wkvq(&d->q, T, alt->k_bound, alt->v_bound);
    alt->use_k = alt->use_v = true;
    return KVQ_OK;
}

static kvq_status bits_wkvq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double g = (double)(q->group ? q->group : in->kv_dim), tab = 32.0 / (double)in->ctx;
    out->k = kvq_bits_mix16(q->k_bits + 32.0 / g + tab, in->ctx, q->n_sink);
    out->v = kvq_bits_mix16(q->v_bits + 32.0 / g + tab, in->ctx, q->n_sink);
    return KVQ_OK;
}

static void describe_wkvq(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    o->num(o->ctx, "group_size", (double)q->group);
    o->str(o->ctx, "past_only", "true");
    if (has_artifact) o->num(o->ctx, "smoothing_alpha", q->x[WKVQ_X_ALPHA]);
}

/* ---- artifact and calibration ---- */

static const char *const WKVQ_TABLES[] = {"shift", "scale", NULL};
static const char *const *tensors_wkvq(const kvq_artifact_params *p, char side)
{
    (void)p;
    (void)side;
    return WKVQ_TABLES;
}

static kvq_status check_tensors_wkvq(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    size_t kvd = p->n_kv_heads * p->head_dim;
    for (int w = 0; w < 2; w++) {
        const char *nm = WKVQ_TABLES[w];
        const kvq_fam_tensor *x = kvq_kv_table_get(t, nm);
        if (x->n_dims != 1 || x->shape[0] != kvd)
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s: expected shape [%zu] (kv_dim), found %u dimensions, first %llu", layer,
                            side, nm, kvd, x->n_dims, (unsigned long long)x->shape[0]);
        if (w == 1)
            for (size_t j = 0; j < kvd; j++)
                if (!(x->data[j] > 0))
                    return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.scale[%zu]: expected > 0, found %g", layer, side, j, (double)x->data[j]);
    }
    return KVQ_OK;
}

static kvq_status check_params_wkvq(const kvq_artifact_params *p, kvq_err *err)
{
    double a = p->x[WKVQ_X_ALPHA];
    if (!(a >= 0 && a <= 1)) return kvq_fail(err, KVQ_EINVAL, "alpha: expected the smoothing strength in [0, 1], found %g", a);
    size_t kvd = p->n_kv_heads * p->head_dim;
    if (p->group_size && kvd && kvd % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group_size: expected 0 or a divisor of kv_dim %zu, found %zu", kvd, p->group_size);
    return KVQ_OK;
}

static void inspect_wkvq(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "wkvq          past-only; channel shift and scale (closed form, alpha %g); per-token groups of %zu%s\n",
            p->x[WKVQ_X_ALPHA], p->group_size, p->group_size ? " channels" : " (whole token)");
}

/* shift = (max + min) / 2, scale = max(r, 1e-6 R)^alpha per channel over the non-sink tokens of x [rows][kvd] */
static kvq_status smooth_tables(const kvq_artifact_params *p, const float *x, size_t rows, size_t seq, size_t kvd, kvq_kv_table *t,
                                kvq_err *err)
{
    float *shift, *scale;
    uint64_t sh[1] = {kvd};
    KVQ_TRY(kvq_kv_table_add(t, "shift", 1, sh, &shift, err));
    KVQ_TRY(kvq_kv_table_add(t, "scale", 1, sh, &scale, err));
    size_t ns = p->n_sink < seq ? p->n_sink : seq, used = 0;
    double *lo = malloc(kvd * sizeof *lo), *hi = malloc(kvd * sizeof *hi);
    if (!lo || !hi) {
        free(lo);
        free(hi);
        return kvq_fail(err, KVQ_ENOMEM, "wkvq: out of memory");
    }
    for (size_t j = 0; j < kvd; j++) {
        lo[j] = INFINITY;
        hi[j] = -INFINITY;
    }
    for (size_t r = 0; r < rows; r++) {
        if (r % seq < ns) continue;
        used++;
        for (size_t j = 0; j < kvd; j++) {
            double v = x[r * kvd + j];
            if (v < lo[j]) lo[j] = v;
            if (v > hi[j]) hi[j] = v;
        }
    }
    kvq_status s = KVQ_OK;
    if (!used) s = kvq_fail(err, KVQ_EINVAL, "wkvq: no calibration tokens left after excluding %zu sink tokens per sample of %zu", ns, seq);
    double R = 0;
    for (size_t j = 0; !s && j < kvd; j++) R = fmax(R, (hi[j] - lo[j]) / 2);
    for (size_t j = 0; !s && j < kvd; j++) {
        double r = fmax((hi[j] - lo[j]) / 2, 1e-6 * R);
        shift[j] = (float)((hi[j] + lo[j]) / 2);
        scale[j] = (float)(r > 0 ? pow(r, p->x[WKVQ_X_ALPHA]) : 1.0);
        if (!(scale[j] > 0) || !isfinite(scale[j])) scale[j] = 1.0f;
    }
    free(lo);
    free(hi);
    t->kv_dim = kvd;
    t->n_elems = (uint64_t)used * kvd;
    t->n_points = (uint64_t)used * kvd;
    return s;
}

/* One layer: keys (in the artifact's stage) and values read through the dump source. */
static kvq_status fit_layer_wkvq(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k, kvq_kv_table *v,
                                 kvq_err *err)
{
    size_t rows = src->n_samples * src->seq_len, kvd = src->n_kv_heads * src->head_dim;
    float *x = malloc(rows * kvd * sizeof *x);
    if (!x) return kvq_fail(err, KVQ_ENOMEM, "wkvq: cannot allocate %zu floats", rows * kvd);
    kvq_status s = KVQ_OK;
    for (int w = 0; !s && w < 2; w++) {
        kvq_kv_table *t = w ? v : k;
        if (!t) continue;
        int ds = w ? KVQ_DUMP_V : p->post_rope ? KVQ_DUMP_K : KVQ_DUMP_K_PRE_ROPE;
        s = src->read(src, layer, ds, x, err);
        if (!s) {
            t->bits = w ? p->v_bits : p->k_bits;
            s = smooth_tables(p, x, rows, src->seq_len, kvd, t, err);
        }
    }
    free(x);
    return s;
}

static const kvq_family_artifact art_wkvq = {
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "uniform-online-per-token-after-offline-channel-smoothing",
    .v_scaling = "uniform-online-per-token-after-offline-channel-smoothing",
    .check_params = check_params_wkvq,
    .inspect = inspect_wkvq,
    .tensors = tensors_wkvq,
    .check_tensors = check_tensors_wkvq,
    .params = (const char *const[]){"alpha", NULL},
};

/* W4KV4 of the paper: 4-bit per-token KV after smoothing, post-RoPE keys (the cache), no sink */
static const kvq_family_calib calib_wkvq = {
    .bits = 4,
    .post_rope = true,
    .pre_rope_ok = true,
    .group_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit_layer = fit_layer_wkvq,
    .x = {1.0},
};

const kvq_family kvq_family_wkvq = {
    .name = "wkvq",
    .syntax = "wkvq<b>[-g<G>]",
    .summary = "WKVQuant's KV part (arXiv 2402.12065 §3.1-3.2): past-only quantization, offline per-channel shift/scale smoothing "
               "then per-token groups of G channels (0 = whole token); post-RoPE keys; tables from a kvcalib artifact",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_wkvq,
    .format = fmt_wkvq,
    .validate = validate_wkvq,
    .check_model = check_model_wkvq,
    .needs_artifact = needs_artifact_wkvq,
    .match = match_wkvq,
    .describe_need = need_wkvq,
    .bind_params = bind_params_wkvq,
    .from_params = from_params_wkvq,
    .check_tables = check_tables_wkvq,
    .artifact = &art_wkvq,
    .calib = &calib_wkvq,
    .quantize = quantize_wkvq,
    .transform = transform_wkvq,
    .alt_bounds = bounds_wkvq,
    .describe = describe_wkvq,
    .bits = bits_wkvq,
};
