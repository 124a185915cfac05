/* mikv.c — MiKV: importance-aware mixed-precision KV cache (Yang et al., "No
 * Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed
 * Precision Quantization", arXiv 2402.18096; notes
 * ../shared/docs/kivi-intactkv-mikv.md §3).
 *   §3.1 the pairs an eviction policy (H2O: accumulated attention + a recent
 *        window) would drop are kept at a low precision, per-token asymmetric
 *        round-to-nearest (scale (max - min) / (2^b - 1), zero point min),
 *        INT2-INT4; the important ones at a high precision (FP16, or INT8 /
 *        INT4 with the same quantizer);
 *   §3.2 the outlier-aware query/key channel balancer: per (layer, KV head,
 *        channel) b_c = max|q_c|^a / max|k_c|^(1-a) (a = 1/2: sqrt(max|q| /
 *        max|k|)); the cache stores k_c b_c and the query is divided by b_c,
 *        so q.k is unchanged while the keys' outlier channels are flattened
 *        before low-bit quantization.
 *
 * Spec: mikv[-h<H>][-l<L>][-b<f>%][-w<W>][-g<G>][-nobal]
 *   H  high precision: 16 (fp16, default) or 2..8 bits (> L)
 *   L  low precision, 1..8 bits (default 2)
 *   f  importance budget, percent of the tokens in the cache, (0, 100], default 20
 *   W  recent window kept exact, >= 1, default 32; n_sink + W must be shorter than the context
 *   G  channels per (scale, zero point) group of the per-token quantizers, dividing head_dim
 *      (0 / absent: the whole head)
 *   -nobal  without the balancer (then no artifact is read: hh's policy at H/L)
 * Keys post-RoPE (what the cache holds; the balancer is fitted on post-RoPE q and k).
 * With the balancer the spec needs a kvcalib artifact of method mikv (table layers.<i>.k.balancer
 * [kv_dim], parameter kvq.mikv.alpha).
 *
 * Decode semantics: importance.h's schedule with budget f and window W, every query voting,
 * importance = accumulated attention (H2O). Low / high representations: keys
 * Q(k * b) / b (the balanced key the cache stores, read by the balanced query: the same
 * q.k in exact arithmetic), values Q(v); fp16 high precision stores the exact key.
 *
 * Bits per element: exact (window, sink) 16; low L + 32/G (fp16 scale and zero point per group);
 * high 16 or H + 32/G, plus a 16-bit token index per (token, head) of the important set; keys
 * add the balancer, 16 bits per channel per layer amortised over the context (16 / ctx). The
 * important share is the run's realised one (importance.h kvq_imp_bits).
 *
 * Where kvq differs from the reference (the paper's §3-4; no public code was found to read):
 *   - importance: the paper takes H2O's policy (scores from the prompt's attention at prefill, then
 *     updated per generated token); kvq runs the streaming policy on every query of the window
 *     from the attention the mixed-precision cache itself produced (decode-equivalent);
 *   - the balancer: the paper computes it dynamically from the prompt's queries and keys at prefill
 *     ("dynamic outlier awareness"); kvq calibrates it offline in kvcalib from a dump's queries
 *     (kvdump --q) and keys, since a per-window balancer would read queries of future tokens. The
 *     exponent a is kvcalib --param alpha (default 1/2, the formula as the notes restate it; the
 *     direction follows SmoothQuant's migration and was not verified against the PDF);
 *   - the low and high precision quantize the exact token (a demoted INT8 token is requantized
 *     from its fp32 value, not from its INT8 copy); the balanced key is divided back by b in fp32.
 *   - kvstat (no attention at hand) reports the low precision's error for every token but the
 *     sink and the last W. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "importance.h"

#define MK_BUDGET(q) ((q)->x[0]) /* importance fraction, (0, 1] */
#define MK_HIGH(q) ((q)->x[1])   /* high precision bits: 16 (fp16) or 2..8 */
#define MK_BAL(q) ((q)->x[2])    /* 1: balanced keys (artifact), 0: none */
enum { MK_W = 32 };
static const double MK_F = 0.20;

/* ---- spec ------------------------------------------------------------------------------ */

static int parse_mikv(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (strncmp(b, "mikv", 4) || (b[4] && b[4] != '-')) return 0;
    const char *p = b + 4;
    unsigned long hi = 16, lo = 2, w = MK_W, g = 0;
    double f = MK_F;
    bool bal = true;
    if (kvq_spec_starts(p, "-h")) {
        p += 2;
        if (!kvq_spec_uint(&p, 16, &hi) || !(hi == 16 || (hi >= 2 && hi <= 8)))
            return kvq_spec_bad(spec, err, "high precision after -h: expected 16 (fp16) or 2..8 bits");
    }
    if (kvq_spec_starts(p, "-l")) {
        p += 2;
        if (!kvq_spec_uint(&p, 8, &lo) || lo < 1) return kvq_spec_bad(spec, err, "low precision after -l: expected 1..8 bits");
    }
    if (kvq_spec_starts(p, "-b")) {
        p += 2;
        const char *pct = strchr(p, '%');
        char buf[32];
        if (!pct || pct == p || pct - p > 30) return kvq_spec_bad(spec, err, "importance budget: expected -b<f>% with 0 < f <= 100 (e.g. mikv-b20%)");
        memcpy(buf, p, (size_t)(pct - p));
        buf[pct - p] = 0;
        char *end;
        f = strtod(buf, &end) / 100.0;
        if (*end || strspn(buf, "0123456789.") != strlen(buf) || !(f > 0 && f <= 1))
            return kvq_spec_bad(spec, err, "importance budget: expected -b<f>% with 0 < f <= 100 (e.g. mikv-b20%)");
        p = pct + 1;
    }
    if (kvq_spec_starts(p, "-w")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &w) || w == 0) return kvq_spec_bad(spec, err, "recent window after -w: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-g")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &g) || g == 0) return kvq_spec_bad(spec, err, "group size after -g: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-nobal")) {
        p += 6;
        bal = false;
    }
    if (*p) return kvq_spec_bad(spec, err, "expected mikv[-h<H>][-l<L>][-b<f>%][-w<W>][-g<G>][-nobal] (e.g. mikv-h8-l2-b20%-w32)");
    q->k_bits = q->v_bits = (int)lo;
    q->residual = w;
    q->group = g;
    MK_BUDGET(q) = f;
    MK_HIGH(q) = (double)hi;
    MK_BAL(q) = bal ? 1 : 0;
    return 1;
}

static void fmt_mikv(const kvq_scheme *q, char *b, size_t n)
{
    char g[32] = "";
    if (q->group) snprintf(g, sizeof g, "-g%zu", q->group);
    snprintf(b, n, "mikv-h%g-l%d-b%g%%-w%zu%s%s", MK_HIGH(q), q->k_bits, MK_BUDGET(q) * 100, q->residual, g,
             MK_BAL(q) ? "" : "-nobal");
}

static kvq_status validate_mikv(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0) return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: mikv has no sparse outliers, found %g", q->outlier_frac);
    if (q->k_bits != q->v_bits) return kvq_fail(err, KVQ_EINVAL, "scheme: mikv: k_bits %d and v_bits %d differ", q->k_bits, q->v_bits);
    if (!(MK_BUDGET(q) > 0 && MK_BUDGET(q) <= 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: mikv importance budget: expected (0, 1] (at most 100%% of the tokens), found %g",
                        MK_BUDGET(q));
    double h = MK_HIGH(q);
    if (!(h == 16 || (h >= 2 && h <= 8 && h == floor(h))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: mikv high precision: expected 16 (fp16) or 2..8 bits, found %g", h);
    if (h <= q->k_bits)
        return kvq_fail(err, KVQ_EINVAL, "scheme: mikv: high precision %g bits must exceed the low precision %d bits", h, q->k_bits);
    if (q->residual == 0) return kvq_fail(err, KVQ_EINVAL, "scheme: mikv recent window: expected >= 1, found 0");
    if (MK_BAL(q) != 0 && MK_BAL(q) != 1) return kvq_fail(err, KVQ_EINVAL, "scheme: mikv balancer: expected 0 or 1, found %g", MK_BAL(q));
    return KVQ_OK;
}

static kvq_status check_model_mikv(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if (q->group && (size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide head_dim %d (groups never cross heads)", spec,
                        q->group, hp->head_dim);
    return KVQ_OK;
}

static kvq_status check_ctx_mikv(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (q->n_sink + q->residual >= ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the sink (%zu) and the recent window (%zu) must be shorter than the context "
                        "(%zu tokens): nothing would ever be quantized", name, q->n_sink, q->residual, ctx);
    return KVQ_OK;
}

static void describe_mikv(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "importance_budget", MK_BUDGET(q));
    o->num(o->ctx, "high_bits", MK_HIGH(q));
    o->num(o->ctx, "low_bits", q->k_bits);
    o->num(o->ctx, "recent_window", (double)q->residual);
    o->num(o->ctx, "group_size", (double)q->group);
    o->str(o->ctx, "balancer", MK_BAL(q) ? "artifact" : "none");
}

/* ---- the artifact: the balancer ------------------------------------------------------------ */

static bool needs_artifact_mikv(const kvq_scheme *q) { return MK_BAL(q) != 0; }

static bool match_mikv(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    (void)q;
    return p->method && !strcmp(p->method->name, "mikv") && p->post_rope && (!stage_set || stage == KVQ_KEYS_POST_ROPE);
}

static void need_mikv(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    (void)q;
    (void)stage_set;
    (void)stage;
    snprintf(buf, n, "the query/key channel balancer: a kvcalib artifact of method mikv (post-RoPE keys; or -nobal)");
}

static void from_params_mikv(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = q->v_bits = p->k_bits;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
    q->residual = MK_W;
    MK_BUDGET(q) = MK_F;
    MK_HIGH(q) = 16;
    MK_BAL(q) = 1;
}

static const char *const bal_names[] = {"balancer", NULL};
static const char *const no_names[] = {NULL};
static const char *const param_names[] = {"alpha", NULL};

static const char *const *tensors_mikv(const kvq_artifact_params *p, char side)
{
    (void)p;
    return side == 'k' ? bal_names : no_names;
}

static kvq_status check_balancer(const kvq_fam_tensor *t, size_t kvd, const char *where, kvq_err *err)
{
    if (!t) return kvq_fail(err, KVQ_EINVAL, "%s.balancer: missing", where);
    if (t->n_dims != 1 || t->shape[0] != kvd)
        return kvq_fail(err, KVQ_EINVAL, "%s.balancer: expected shape [%zu] (kv_dim), found %u dims, first %llu", where, kvd,
                        t->n_dims, (unsigned long long)t->shape[0]);
    for (size_t c = 0; c < kvd; c++)
        if (!(isfinite(t->data[c]) && t->data[c] > 0))
            return kvq_fail(err, KVQ_EINVAL, "%s.balancer[%zu]: expected a finite value > 0, found %g", where, c, (double)t->data[c]);
    return KVQ_OK;
}

static kvq_status check_tensors_mikv(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    char where[64];
    snprintf(where, sizeof where, "layers.%zu.%c", layer, side);
    return check_balancer(kvq_kv_table_get(t, "balancer"), p->n_kv_heads * p->head_dim, where, err);
}

static kvq_status check_params_mikv(const kvq_artifact_params *p, kvq_err *err)
{
    if (!(p->x[0] > 0 && p->x[0] < 1)) return kvq_fail(err, KVQ_EINVAL, "kvq.mikv.alpha: expected 0 < alpha < 1, found %g", p->x[0]);
    if (!p->post_rope) return kvq_fail(err, KVQ_EINVAL, "kvq.key_position: mikv balances post-RoPE keys, found pre-RoPE");
    if (p->group_size && p->head_dim % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group_size: expected a divisor of head_dim %zu, found %zu", p->head_dim, p->group_size);
    return KVQ_OK;
}

static void inspect_mikv(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "mikv          balancer b = max|q|^%g / max|k|^%g per (layer, KV head, channel), post-RoPE\n", p->x[0], 1 - p->x[0]);
}

static kvq_status check_tables_mikv(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!MK_BAL(&d->q)) return KVQ_OK;
    if (!d->art || !d->art->k || d->art->p.n_layers != (size_t)hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: mikv needs the balancer of %d layers (an artifact of method mikv)", hp->n_layers);
    for (int l = 0; l < hp->n_layers; l++) {
        char where[64];
        snprintf(where, sizeof where, "layers.%d.k", l);
        KVQ_TRY(check_balancer(kvq_kv_table_get(&d->art->k[l], "balancer"), (size_t)kvq_kv_dim(hp), where, err));
    }
    return KVQ_OK;
}

/* kvcalib: b_c = max|q_c|^a / max|k_c|^(1-a) over every token of the dump, the query max over the
 * GQA group's query heads; a channel where either max is 0 (or not finite) keeps b = 1 */
static kvq_status fit_layer_mikv(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k,
                                 kvq_kv_table *v, kvq_err *err)
{
    (void)v;
    if (!src->has_q)
        return kvq_fail(err, KVQ_EINVAL, "mikv's balancer reads the dump's queries: the dump has none (rerun kvdump with --q)");
    size_t H = src->n_kv_heads, hd = src->head_dim, kvd = H * hd, nh = src->n_heads, gs = nh / H;
    size_t rows = src->n_samples * src->seq_len;
    float *qb = malloc(kvq_calib_src_len(src, 3) * sizeof(float)), *kb = malloc(kvq_calib_src_len(src, 1) * sizeof(float));
    double *mq = calloc(kvd, sizeof(double)), *mk = calloc(kvd, sizeof(double));
    kvq_status s = KVQ_OK;
    if (!qb || !kb || !mq || !mk) s = kvq_fail(err, KVQ_ENOMEM, "mikv: cannot hold layer %d's queries and keys", layer);
    if (!s) s = src->read(src, layer, 3, qb, err);
    if (!s) s = src->read(src, layer, 1, kb, err);
    if (!s) {
        for (size_t t = 0; t < rows; t++)
            for (size_t c = 0; c < kvd; c++) {
                double a = fabs((double)kb[t * kvd + c]);
                if (a > mk[c]) mk[c] = a;
                size_t h = c / hd, d = c % hd;
                for (size_t g = 0; g < gs; g++) {
                    double b = fabs((double)qb[(t * nh + h * gs + g) * hd + d]);
                    if (b > mq[c]) mq[c] = b;
                }
            }
        float *out;
        uint64_t shape[1] = {kvd};
        s = kvq_kv_table_add(k, "balancer", 1, shape, &out, err);
        if (!s) {
            const double a = p->x[0];
            for (size_t c = 0; c < kvd; c++) {
                double b = mq[c] > 0 && mk[c] > 0 ? pow(mq[c], a) / pow(mk[c], 1 - a) : 1.0;
                out[c] = isfinite(b) && b > 0 && (float)b > 0 && isfinite((float)b) ? (float)b : 1.0f;
            }
            k->bits = p->k_bits;
        }
    }
    free(qb);
    free(kb);
    free(mq);
    free(mk);
    return s;
}

static const kvq_family_artifact art_mikv = {
    .post_rope_only = true,
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "mixed-precision-per-token-balanced-channels",
    .v_scaling = "mixed-precision-per-token",
    .check_params = check_params_mikv,
    .inspect = inspect_mikv,
    .tensors = tensors_mikv,
    .check_tensors = check_tensors_mikv,
    .params = param_names,
};

/* low precision 2 bits, post-RoPE keys, the whole head per group, alpha 1/2 */
static const kvq_family_calib calib_mikv = {
    .bits = 2,
    .post_rope = true,
    .group_opt = true,
    .fit_k = true,
    .fit_layer = fit_layer_mikv,
    .x = {0.5},
};

/* ---- representations ------------------------------------------------------------------------ */

static const float *balancer(const kvq_kv_desc *d, int layer)
{
    if (!MK_BAL(&d->q) || !d->art || !d->art->k) return NULL;
    const kvq_fam_tensor *t = kvq_kv_table_get(&d->art->k[layer], "balancer");
    return t ? t->data : NULL;
}

/* rows [0, T) at `bits` per token (groups of G within each head); keys balanced by b when given */
static kvq_status int_rep(const kvq_scheme *q, const float *b, float *out, const float *in, size_t T, size_t kvd, size_t hd,
                          int bits, kvq_err *err)
{
    size_t g = q->group ? q->group : hd;
    if (!b) return kvq_quant_int_token(out, in, T, kvd, g, bits, 0, NULL, err);
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < kvd; c++) out[t * kvd + c] = in[t * kvd + c] * b[c];
    KVQ_TRY(kvq_quant_int_token(out, out, T, kvd, g, bits, 0, NULL, err));
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < kvd; c++) out[t * kvd + c] /= b[c];
    return KVQ_OK;
}

static kvq_status hi_rep(const kvq_scheme *q, const float *b, float *out, const float *in, size_t T, size_t kvd, size_t hd, kvq_err *err)
{
    if (MK_HIGH(q) == 16) {
        kvq_quant_fp16(out, in, T * kvd, NULL);
        return KVQ_OK;
    }
    return int_rep(q, b, out, in, T, kvd, hd, (int)MK_HIGH(q), err);
}

static kvq_status reps_mikv(const kvq_kv_desc *d, const kvq_layer_ctx *c, const float *k, const float *v, float *k_hi, float *k_lo,
                            float *v_hi, float *v_lo, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    const float *b = balancer(d, c->layer);
    size_t T = (size_t)c->T, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd;
    KVQ_TRY(int_rep(q, b, k_lo, k, T, kvd, hd, q->k_bits, err));
    KVQ_TRY(int_rep(q, NULL, v_lo, v, T, kvd, hd, q->v_bits, err));
    KVQ_TRY(hi_rep(q, b, k_hi, k, T, kvd, hd, err));
    return hi_rep(q, NULL, v_hi, v, T, kvd, hd, err);
}

static kvq_imp_policy policy_mikv(const kvq_scheme *q) { return (kvq_imp_policy){.budget = MK_BUDGET(q), .window = q->residual}; }

static kvq_status transform_mikv(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_imp_policy pol = policy_mikv(&run->d->q);
    return kvq_imp_transform(run, c, k, v, alt, &pol, reps_mikv, err);
}

/* kvstat: the sink and the last W tokens exact, the rest at the low precision (balanced keys) */
static kvq_status quantize_mikv(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                                size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    size_t lo0, n_lo;
    kvq_imp_resting(&d->q, T, kvd, &lo0, &n_lo, c);
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    if (!n_lo) return KVQ_OK;
    return int_rep(&d->q, side == 'k' ? balancer(d, layer) : NULL, out + lo0 * kvd, in + lo0 * kvd, n_lo, kvd, hd, d->q.k_bits, err);
}

/* ---- bits ------------------------------------------------------------------------------------ */

static kvq_status bits_mikv(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    size_t hd = in->head_dim, g = q->group ? q->group : hd;
    if (g == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: mikv: the per-head group needs head_dim (kvq_scheme_bits_ex)");
    if (in->ctx == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx: expected > 0, found 0");
    double h = MK_HIGH(q);
    kvq_imp_cost v = {.lo = q->v_bits + 32.0 / (double)g, .hi = (h == 16 ? 16.0 : h + 32.0 / (double)g) + 16.0 / (double)hd};
    kvq_imp_cost k = v;
    k.lo = q->k_bits + 32.0 / (double)g;
    if (MK_BAL(q)) k.fixed = 16.0 / (double)in->ctx;
    kvq_imp_policy pol = policy_mikv(q);
    return kvq_imp_bits(q, &pol, &k, &v, in, out, err);
}

const kvq_family kvq_family_mikv = {
    .name = "mikv",
    .syntax = "mikv[-h<H>][-l<L>][-b<f>%][-w<W>][-g<G>][-nobal] (default H=16, L=2, f=20, W=32)",
    .summary = "MiKV (arXiv 2402.18096 §3): the f% tokens with the most accumulated attention at H bits (16: fp16), a W-token "
               "window exact, the rest at L-bit per token instead of evicted; keys balanced per channel by a kvcalib "
               "query/key balancer; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_mikv,
    .format = fmt_mikv,
    .validate = validate_mikv,
    .check_model = check_model_mikv,
    .check_ctx = check_ctx_mikv,
    .needs_artifact = needs_artifact_mikv,
    .match = match_mikv,
    .describe_need = need_mikv,
    .from_params = from_params_mikv,
    .check_tables = check_tables_mikv,
    .artifact = &art_mikv,
    .calib = &calib_mikv,
    .quantize = quantize_mikv,
    .transform = transform_mikv,
    .run_free = kvq_imp_run_free,
    .no_backward = true,
    .describe = describe_mikv,
    .bits = bits_mikv,
};
