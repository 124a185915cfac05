/* hh.c — heavy-hitter mixed precision: attention decides which tokens keep a
 * high precision, the rest are kept at a low precision instead of being
 * evicted. H2O's heavy-hitter oracle (Zhang et al., NeurIPS 2023, "H2O:
 * Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
 * Models", §3-4: accumulated attention scores, greedy eviction of the lowest
 * score, a recent window) with MiKV's "no token left behind" twist (Yang et
 * al., arXiv 2402.18096: the would-be-evicted tokens stay in the cache at
 * INT2-INT4 per-token precision, the important ones at FP16 or INT8; notes
 * ../shared/docs/kivi-intactkv-mikv.md §3). The worked example of
 * docs/architecture.md "Adding a method": one file, one registry line.
 *
 * Spec: hh<b>[-i8][-<f>%][-w<W>][-g<G>]
 *   b   low precision: uniform asymmetric per token, groups of G channels
 *       within a head (kernels/quant/quant.h kvq_quant_int_token; G = 0 or
 *       absent: the whole head), 1..8 bits
 *   -i8 the high precision is int8 (same quantizer); default fp16 (kvq_quant_fp16)
 *   f   heavy-hitter budget, percent of the tokens in the cache, (0, 100], default 20
 *   W   recent window kept exact, >= 1, default 32
 * Keys post-RoPE by default (what a cache holds); +sink<N> keeps the first N
 * tokens exact and out of the competition.
 *
 * Decode semantics: the attention-importance schedule of importance.h (shared
 * with mikv.c and zipcache.c) with budget f and window W, every query voting,
 * importance = accumulated attention (H2O). Three representations (exact,
 * high, low) per key and value, the kvq_kv_sched contract (forward.h).
 *
 * Bits: from the resting cache the last query saw, per element: exact tokens
 * (window and sink) at 16, high at 16 (or 8 + 32/G) plus a 16-bit token index
 * per (token, head), low at b + 32/G (fp16 scale and zero point per group);
 * the share of the tokens outside the sink and the window kept at the high
 * precision is a run's realised one (n_high of its counts) when given, else
 * the budget's (min(floor(f ctx), ctx - n_sink - W) heavy hitters).
 *
 * Differences from the reference code: H2O's released simulation
 * (h2o_hf, "heavy_ratio / recent_ratio" masks) evicts from full-precision
 * attention of the whole prompt at once; kvq runs the streaming (decode)
 * policy on every query of the window, from the attention the mixed-precision
 * cache itself produced. MiKV's outlier-aware query/key channel balancer is
 * not part of this family (a calibrated family of its own). The low and high
 * precision quantize the exact token (the simulation keeps fp32 K/V, not an
 * fp16 copy). kvstat (the family's quantize, no attention at hand) reports
 * the low precision's error for everything but the sink and the last W
 * tokens.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "importance.h"

#define HH_BUDGET(q) ((q)->x[0]) /* heavy-hitter fraction, (0, 1] */
#define HH_HIGH(q) ((q)->x[1])   /* high precision bits: 16 (fp16) or 8 */
enum { HH_W = 32 };
static const double HH_F = 0.20;

/* ---- spec ------------------------------------------------------------------------------ */

static int parse_hh(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits, w = HH_W, g = 0;
    const char *p = b;
    int r = kvq_spec_bits(&p, "hh", spec, &bits, err);
    if (r <= 0) return r;
    double f = HH_F, hi = 16;
    if (kvq_spec_starts(p, "-i8")) {
        hi = 8;
        p += 3;
    }
    if (*p == '-' && p[1] >= '0' && p[1] <= '9') {
        const char *pct = strchr(p + 1, '%');
        char buf[32];
        if (!pct || pct - p - 1 > 30) return kvq_spec_bad(spec, err, "heavy-hitter budget: expected -<f>% with 0 < f <= 100 (e.g. hh2-20%)");
        memcpy(buf, p + 1, (size_t)(pct - p - 1));
        buf[pct - p - 1] = 0;
        char *end;
        f = strtod(buf, &end) / 100.0;
        if (*end || !(f > 0 && f <= 1) || strspn(buf, "0123456789.") != strlen(buf))
            return kvq_spec_bad(spec, err, "heavy-hitter budget: expected -<f>% with 0 < f <= 100 (e.g. hh2-20%)");
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
    if (*p) return kvq_spec_bad(spec, err, "expected hh<b>[-i8][-<f>%][-w<W>][-g<G>] (e.g. hh2, hh2-20%-w32, hh3-i8-10%)");
    q->k_bits = q->v_bits = (int)bits;
    q->residual = w;
    q->group = g;
    HH_BUDGET(q) = f;
    HH_HIGH(q) = hi;
    return 1;
}

static void fmt_hh(const kvq_scheme *q, char *b, size_t n)
{
    char g[32] = "";
    if (q->group) snprintf(g, sizeof g, "-g%zu", q->group);
    snprintf(b, n, "hh%d%s-%g%%-w%zu%s", q->k_bits, HH_HIGH(q) == 8 ? "-i8" : "", HH_BUDGET(q) * 100, q->residual, g);
}

static kvq_status validate_hh(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0) return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: hh has no sparse outliers, found %g", q->outlier_frac);
    if (q->k_bits != q->v_bits) return kvq_fail(err, KVQ_EINVAL, "scheme: hh: k_bits %d and v_bits %d differ", q->k_bits, q->v_bits);
    if (!(HH_BUDGET(q) > 0 && HH_BUDGET(q) <= 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: hh budget: expected (0, 1], found %g", HH_BUDGET(q));
    if (HH_HIGH(q) != 16 && HH_HIGH(q) != 8)
        return kvq_fail(err, KVQ_EINVAL, "scheme: hh high precision: expected 16 (fp16) or 8, found %g", HH_HIGH(q));
    if (q->residual == 0) return kvq_fail(err, KVQ_EINVAL, "scheme: hh recent window: expected >= 1, found 0");
    return KVQ_OK;
}

static kvq_status check_ctx_hh(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (q->n_sink + q->residual >= ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the sink (%zu) and the recent window (%zu) must be shorter than the context "
                        "(%zu tokens): nothing would ever be quantized", name, q->n_sink, q->residual, ctx);
    return KVQ_OK;
}

static kvq_status check_model_hh(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if (q->group && (size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide head_dim %d (groups never cross heads)", spec,
                        q->group, hp->head_dim);
    return KVQ_OK;
}

static void describe_hh(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "heavy_budget", HH_BUDGET(q));
    o->num(o->ctx, "high_bits", HH_HIGH(q));
    o->num(o->ctx, "recent_window", (double)q->residual);
    o->num(o->ctx, "group_size", (double)q->group);
}

/* ---- representations ------------------------------------------------------------------- */

/* rows [0, T) of x quantized per token at `bits` (groups of G within each head) */
static kvq_status low_rep(const kvq_scheme *q, float *out, const float *in, size_t T, size_t kvd, size_t hd, int bits, kvq_err *err)
{
    return kvq_quant_int_token(out, in, T, kvd, q->group ? q->group : hd, bits, 0, NULL, err);
}

static kvq_status high_rep(const kvq_scheme *q, float *out, const float *in, size_t T, size_t kvd, size_t hd, kvq_err *err)
{
    if (HH_HIGH(q) == 8) return low_rep(q, out, in, T, kvd, hd, 8, err);
    kvq_quant_fp16(out, in, T * kvd, NULL);
    return KVQ_OK;
}

/* the resting representation without attention at hand (kvstat): sink and the last W tokens exact,
 * the rest at the low precision */
static kvq_status quantize_hh(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                              size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    size_t lo0, n_lo;
    kvq_imp_resting(&d->q, T, kvd, &lo0, &n_lo, c);
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    return n_lo ? low_rep(&d->q, out + lo0 * kvd, in + lo0 * kvd, n_lo, kvd, hd, d->q.k_bits, err) : KVQ_OK;
}

/* ---- the streaming policy (importance.h, shared with mikv and zipcache) ------------------- */

static kvq_imp_policy policy_hh(const kvq_scheme *q)
{
    return (kvq_imp_policy){.budget = HH_BUDGET(q), .window = q->residual};
}

static kvq_status reps_hh(const kvq_kv_desc *d, const kvq_layer_ctx *c, const float *k, const float *v, float *k_hi, float *k_lo,
                          float *v_hi, float *v_lo, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    size_t T = (size_t)c->T, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd;
    KVQ_TRY(low_rep(q, k_lo, k, T, kvd, hd, q->k_bits, err));
    KVQ_TRY(low_rep(q, v_lo, v, T, kvd, hd, q->v_bits, err));
    KVQ_TRY(high_rep(q, k_hi, k, T, kvd, hd, err));
    return high_rep(q, v_hi, v, T, kvd, hd, err);
}

static kvq_status transform_hh(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_imp_policy pol = policy_hh(&run->d->q);
    return kvq_imp_transform(run, c, k, v, alt, &pol, reps_hh, err);
}

/* ---- bits ---------------------------------------------------------------------------------- */

static kvq_status bits_hh(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    size_t hd = in->head_dim, g = q->group ? q->group : hd;
    if (g == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: hh: the per-head group needs head_dim (kvq_scheme_bits_ex)");
    kvq_imp_cost x = {.lo = q->k_bits + 32.0 / (double)g,
                      .hi = (HH_HIGH(q) == 8 ? 8 + 32.0 / (double)g : 16.0) + 16.0 / (double)hd};
    kvq_imp_policy pol = policy_hh(q);
    return kvq_imp_bits(q, &pol, &x, &x, in, out, err);
}

const kvq_family kvq_family_hh = {
    .name = "hh",
    .syntax = "hh<b>[-i8][-<f>%][-w<W>][-g<G>] (default f=20, W=32)",
    .summary = "heavy-hitter mixed precision (H2O's accumulated attention, MiKV's low-precision instead of eviction): the "
               "f% tokens with the most attention at fp16 (or int8), a W-token recent window exact, the rest at b-bit per "
               "token; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_hh,
    .format = fmt_hh,
    .validate = validate_hh,
    .check_model = check_model_hh,
    .check_ctx = check_ctx_hh,
    .quantize = quantize_hh,
    .transform = transform_hh,
    .run_free = kvq_imp_run_free,
    .no_backward = true,
    .describe = describe_hh,
    .bits = bits_hh,
};
