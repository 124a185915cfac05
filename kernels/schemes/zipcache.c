/* zipcache.c — ZipCache: salient tokens by normalised attention at a high bit width, the rest at a
 * low one, with channel-separable token-wise quantization (He et al., "ZipCache: Accurate and
 * Efficient KV Cache Quantization with Salient Token Identification", arXiv 2405.14256, NeurIPS 2024;
 * reference code github.com/ThisisBillhe/ZipCache, zipcache/models/modeling_llama.py and
 * CompressUtils/compress_function.py). Only the abstract of the paper could be read here: the section
 * numbers below follow its method section's order (channel-separable quantization, normalised attention,
 * probe approximation) and were not checked against the PDF; every rule was checked against the
 * reference code, which the lines name.
 *   §4.1 channel-separable token-wise quantization: every channel c is divided by
 *        n_c = sqrt(max_t |x_tc|), then each token is quantized asymmetrically (min/max) per token,
 *        and multiplied back by n_c: one normaliser per channel plus a scale and zero point per
 *        token instead of one pair per group (reference: true_channel_separate_mixedprec_tokenwise_
 *        compress, sqrt(max(abs)) over the tokens compressed together). The reference's demo
 *        configuration applies it to the values and quantizes the keys channel-wise (mode
 *        "mixed_channelwiseQ": per-channel min/max over the tokens compressed together); kvq does
 *        the same by default, -kt quantizes the keys channel-separably too;
 *   §4.2 normalised attention: the saliency of token j is its accumulated attention divided by the
 *        number of queries that could attend to it (the causal mask gives early tokens more
 *        queries; reference: token_attn_sum / flip(arange(1, L + 1)));
 *   §4.3 the probe approximation: only a subset of the queries (the probes) computes attention
 *        scores for the saliency (reference: the last 5% of the prompt's queries plus 5% drawn at
 *        random); kvq: -p<P>% makes a fixed pseudo-random share P of the window's queries the
 *        probes (importance.h kvq_imp_is_probe), the normaliser counting probes only;
 *   mixed precision: the salient share f of the tokens at H bits, the rest at L bits (reference
 *        demo: H = 4, L = 2, 40% "unimportant", i.e. f = 60%).
 *
 * Spec: zipcache[-h<H>][-l<L>][-b<f>%][-w<W>][-n<N>][-g<G>][-p<P>%][-kt]
 *   H  high bit width: 16 (fp16) or 2..8 (> L), default 4
 *   L  low bit width, 1..8, default 2
 *   f  salient share of the tokens in the cache, percent, (0, 100], default 60
 *   W  recent window kept exact, >= 1, default 100 (the reference's streaming gap: new tokens stay
 *      in full precision until 100 of them are compressed together)
 *   N  tokens per normalisation block (channel normalisers, channel-wise key ranges), 1..W, default
 *      W: block b holds window tokens [bN, bN + N); N <= W keeps it decode-equivalent (a token is
 *      quantized only after it leaves the window, when its whole block has been seen)
 *   G  channels per scale / zero point of the token-wise quantizer, dividing head_dim; 0 / absent:
 *      the whole head (one pair per (token, KV head))
 *   P  probe share of the queries, percent, (0, 100); absent: every query votes
 *   -kt  keys channel-separable token-wise as well (default: per-channel over the block)
 * Keys post-RoPE (what the cache holds). No calibration: every statistic is taken online.
 *
 * Decode semantics: importance.h's schedule with budget f, window W, normalised importance and the
 * probe votes. Low / high representations of a token j in block b at B bits:
 *   values (and -kt keys): n_c = sqrtf(max over block b of |x_tc|) (1 where that is 0), then
 *     kvq_quant_int_token(x / n, groups G, B bits) * n;
 *   keys: kvq_quant_int_channel with lower / upper = the block's per-channel min / max, B bits;
 *   H = 16: fp16 (kvq_quant_fp16), no normaliser.
 *
 * Bits per element (realised salient share, importance.h kvq_imp_bits): exact (window, sink) 16;
 *   token-wise side: L + 32/G (low) or H + 32/G (high; 16 for fp16), plus 16/N for the fp16
 *     channel normaliser of every block;
 *   channel-wise keys: L or H (16 for fp16), plus 32/N: one fp16 min and max per channel per block,
 *     from which both bit widths derive their scale (the salient and the other tokens of a block share
 *     the range);
 *   keys also carry the saliency metadata per (token, KV head) outside the window: a 1-bit flag
 *     and the 16-bit accumulated score the streaming policy compares, (1 + 16) / head_dim.
 *
 * Where kvq differs from the reference code (decode-equivalent simulation):
 *   - saliency: the reference decides it at prefill from full-precision attention of the probe
 *     queries over the whole prompt (and, while generating, again every 100 tokens over the new
 *     tokens from full-precision attention, without normalisation); kvq runs the streaming policy
 *     after every query of the window from the attention the mixed-precision cache itself produced,
 *     with the normalisation throughout, and a token is judged when it leaves the recent window;
 *   - probes: the reference takes the last 5% of the prompt plus 5% at random; kvq a fixed hashed
 *     share of all queries (in a stream every query is "recent" when it is made);
 *   - statistics: the reference computes the channel normalisers and the key ranges over every
 *     token compressed in one call (the whole prompt, then the whole sequence again every 100
 *     tokens, re-quantizing already quantized tokens), and over the salient and the other tokens
 *     separately for the key ranges; kvq over fixed blocks of N window tokens (all classes
 *     together), fixed once the block has left the window, each token quantized once from its
 *     exact value (a demoted token is requantized from fp32, not from its H-bit copy);
 *   - the token-wise scale: the reference's per-token min/max runs over all heads' channels of a
 *     gathered row (rows of different heads' salient tokens side by side); kvq per (token, KV head)
 *     or per group of G channels, since saliency is per KV head;
 *   - kvstat (no attention at hand) reports the low precision's error for every token but the sink
 *     and the last W. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "importance.h"

#define ZC_BUDGET(q) ((q)->x[0]) /* salient share, (0, 1] */
#define ZC_HIGH(q) ((q)->x[1])   /* high bits: 16 (fp16) or 2..8 */
#define ZC_PROBE(q) ((q)->x[2])  /* probe share, 0 = every query */
#define ZC_BLOCK(q) ((q)->x[3])  /* N, tokens per normalisation block */
#define ZC_KT(q) ((q)->variant)  /* 1: keys channel-separable token-wise */
enum { ZC_W = 100 };
static const double ZC_F = 0.60;

/* ---- spec ------------------------------------------------------------------------------ */

/* "<f>%" with lo < f <= hi (hi_incl) or < hi: *frac = f / 100 */
static bool pct(const char **p, double lo, double hi, bool hi_incl, double *frac)
{
    const char *s = *p, *e = strchr(s, '%');
    char buf[32];
    if (!e || e == s || e - s > 30) return false;
    memcpy(buf, s, (size_t)(e - s));
    buf[e - s] = 0;
    if (strspn(buf, "0123456789.") != strlen(buf)) return false;
    char *end;
    double f = strtod(buf, &end);
    if (*end || !(f > lo && (hi_incl ? f <= hi : f < hi))) return false;
    *frac = f / 100.0;
    *p = e + 1;
    return true;
}

static int parse_zc(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (strncmp(b, "zipcache", 8) || (b[8] && b[8] != '-')) return 0;
    const char *p = b + 8;
    unsigned long hi = 4, lo = 2, w = ZC_W, n = 0, g = 0;
    double f = ZC_F, probe = 0;
    bool kt = false;
    if (kvq_spec_starts(p, "-h")) {
        p += 2;
        if (!kvq_spec_uint(&p, 16, &hi) || !(hi == 16 || (hi >= 2 && hi <= 8)))
            return kvq_spec_bad(spec, err, "high bit width after -h: expected 16 (fp16) or 2..8 bits");
    }
    if (kvq_spec_starts(p, "-l")) {
        p += 2;
        if (!kvq_spec_uint(&p, 8, &lo) || lo < 1) return kvq_spec_bad(spec, err, "low bit width after -l: expected 1..8 bits");
    }
    if (kvq_spec_starts(p, "-b")) {
        p += 2;
        if (!pct(&p, 0, 100, true, &f))
            return kvq_spec_bad(spec, err, "salient share: expected -b<f>% with 0 < f <= 100 (e.g. zipcache-b60%)");
    }
    if (kvq_spec_starts(p, "-w")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &w) || w == 0) return kvq_spec_bad(spec, err, "recent window after -w: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-n")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &n) || n == 0) return kvq_spec_bad(spec, err, "normalisation block after -n: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-g")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &g) || g == 0) return kvq_spec_bad(spec, err, "group size after -g: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-p")) {
        p += 2;
        if (!pct(&p, 0, 100, false, &probe))
            return kvq_spec_bad(spec, err, "probe share: expected -p<P>% with 0 < P < 100 (e.g. zipcache-p10%)");
    }
    if (!strcmp(p, "-kt")) {
        p += 3;
        kt = true;
    }
    if (*p)
        return kvq_spec_bad(spec, err, "expected zipcache[-h<H>][-l<L>][-b<f>%][-w<W>][-n<N>][-g<G>][-p<P>%][-kt] "
                                       "(e.g. zipcache-h4-l2-b60%-w100)");
    q->k_bits = q->v_bits = (int)lo;
    q->residual = w;
    q->group = g;
    q->variant = kt ? 1 : 0;
    ZC_BUDGET(q) = f;
    ZC_HIGH(q) = (double)hi;
    ZC_PROBE(q) = probe;
    ZC_BLOCK(q) = (double)(n ? n : w);
    return 1;
}

static void fmt_zc(const kvq_scheme *q, char *b, size_t n)
{
    char g[32] = "", pr[40] = "";
    if (q->group) snprintf(g, sizeof g, "-g%zu", q->group);
    if (ZC_PROBE(q) > 0) snprintf(pr, sizeof pr, "-p%g%%", ZC_PROBE(q) * 100);
    snprintf(b, n, "zipcache-h%g-l%d-b%g%%-w%zu-n%g%s%s%s", ZC_HIGH(q), q->k_bits, ZC_BUDGET(q) * 100, q->residual, ZC_BLOCK(q), g,
             pr, ZC_KT(q) ? "-kt" : "");
}

static kvq_status validate_zc(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0) return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: zipcache has no sparse outliers, found %g", q->outlier_frac);
    if (q->k_bits != q->v_bits) return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache: k_bits %d and v_bits %d differ", q->k_bits, q->v_bits);
    if (!(ZC_BUDGET(q) > 0 && ZC_BUDGET(q) <= 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache salient share: expected (0, 1] (at most 100%% of the tokens), found %g",
                        ZC_BUDGET(q));
    double h = ZC_HIGH(q);
    if (!(h == 16 || (h >= 2 && h <= 8 && h == floor(h))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache high bit width: expected 16 (fp16) or 2..8 bits, found %g", h);
    if (h <= q->k_bits)
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache: the high bit width %g must exceed the low bit width %d", h, q->k_bits);
    if (q->residual == 0) return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache recent window: expected >= 1, found 0");
    double n = ZC_BLOCK(q);
    if (!(n >= 1 && n == floor(n) && n <= (double)q->residual))
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache normalisation block %g: expected 1..W (W = %zu, the recent window): a token "
                        "leaves the window only after its whole block was seen (decode equivalence)", n, q->residual);
    if (!(ZC_PROBE(q) >= 0 && ZC_PROBE(q) < 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache probe share: expected [0, 1) (0: every query), found %g", ZC_PROBE(q));
    if (q->variant != 0 && q->variant != 1)
        return kvq_fail(err, KVQ_EINVAL, "scheme: zipcache key mode: expected 0 (channel-wise) or 1 (-kt), found %d", q->variant);
    return KVQ_OK;
}

static kvq_status check_model_zc(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if (q->group && (size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide head_dim %d (groups never cross heads)", spec,
                        q->group, hp->head_dim);
    return KVQ_OK;
}

static kvq_status check_ctx_zc(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (q->n_sink + q->residual >= ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the sink (%zu) and the recent window (%zu) must be shorter than the context "
                        "(%zu tokens): nothing would ever be quantized", name, q->n_sink, q->residual, ctx);
    return KVQ_OK;
}

static void describe_zc(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "salient_share", ZC_BUDGET(q));
    o->num(o->ctx, "high_bits", ZC_HIGH(q));
    o->num(o->ctx, "low_bits", q->k_bits);
    o->num(o->ctx, "recent_window", (double)q->residual);
    o->num(o->ctx, "block_tokens", ZC_BLOCK(q));
    o->num(o->ctx, "group_size", (double)q->group);
    o->num(o->ctx, "probe_share", ZC_PROBE(q));
    o->str(o->ctx, "keys", ZC_KT(q) ? "channel-separable-tokenwise" : "channelwise-per-block");
    o->str(o->ctx, "values", "channel-separable-tokenwise");
    o->str(o->ctx, "saliency", "normalised-attention");
}

/* ---- representations ------------------------------------------------------------------------ */

/* rows [0, T) of one side at `bits` (16: fp16), blocks of N rows from row 0; token-wise (channel
 * normaliser per block, groups of g) or channel-wise (the block's per-channel min / max). `buf` holds
 * 2 * kvd floats. */
static kvq_status zc_rep(float *out, const float *in, size_t T, size_t kvd, size_t g, size_t N, int bits, bool tokenwise,
                         float *buf, kvq_err *err)
{
    if (bits == 16) {
        kvq_quant_fp16(out, in, T * kvd, NULL);
        return KVQ_OK;
    }
    float *a = buf, *b = buf + kvd;
    for (size_t r0 = 0; r0 < T; r0 += N) {
        size_t n = T - r0 < N ? T - r0 : N;
        const float *x = in + r0 * kvd;
        float *y = out + r0 * kvd;
        if (tokenwise) {
            for (size_t c = 0; c < kvd; c++) a[c] = 0;
            for (size_t t = 0; t < n; t++)
                for (size_t c = 0; c < kvd; c++) a[c] = fmaxf(a[c], fabsf(x[t * kvd + c]));
            for (size_t c = 0; c < kvd; c++) {
                float s = sqrtf(a[c]);
                a[c] = s > 0 && isfinite(s) ? s : 1.0f;
            }
            for (size_t t = 0; t < n; t++)
                for (size_t c = 0; c < kvd; c++) y[t * kvd + c] = x[t * kvd + c] / a[c];
            KVQ_TRY(kvq_quant_int_token(y, y, n, kvd, g, bits, 0, NULL, err));
            for (size_t t = 0; t < n; t++)
                for (size_t c = 0; c < kvd; c++) y[t * kvd + c] *= a[c];
        } else {
            for (size_t c = 0; c < kvd; c++) a[c] = b[c] = x[c];
            for (size_t t = 1; t < n; t++)
                for (size_t c = 0; c < kvd; c++) {
                    a[c] = fminf(a[c], x[t * kvd + c]);
                    b[c] = fmaxf(b[c], x[t * kvd + c]);
                }
            KVQ_TRY(kvq_quant_int_channel(y, x, n, kvd, a, b, bits, false, 0, NULL, err));
        }
    }
    return KVQ_OK;
}

static kvq_status reps_zc(const kvq_kv_desc *d, const kvq_layer_ctx *c, const float *k, const float *v, float *k_hi, float *k_lo,
                          float *v_hi, float *v_lo, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    size_t T = (size_t)c->T, hd = (size_t)c->head_dim, kvd = (size_t)c->n_kv_heads * hd, g = q->group ? q->group : hd;
    size_t N = (size_t)ZC_BLOCK(q);
    float *buf = malloc(2 * kvd * sizeof(float));
    if (!buf) return kvq_fail(err, KVQ_ENOMEM, "zipcache: out of memory");
    bool kt = ZC_KT(q) != 0;
    int H = (int)ZC_HIGH(q);
    kvq_status s = zc_rep(k_lo, k, T, kvd, g, N, q->k_bits, kt, buf, err);
    if (!s) s = zc_rep(k_hi, k, T, kvd, g, N, H, kt, buf, err);
    if (!s) s = zc_rep(v_lo, v, T, kvd, g, N, q->v_bits, true, buf, err);
    if (!s) s = zc_rep(v_hi, v, T, kvd, g, N, H, true, buf, err);
    free(buf);
    return s;
}

static kvq_imp_policy policy_zc(const kvq_scheme *q)
{
    return (kvq_imp_policy){.budget = ZC_BUDGET(q), .window = q->residual, .normalise = true, .probe = ZC_PROBE(q)};
}

static kvq_status transform_zc(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_imp_policy pol = policy_zc(&run->d->q);
    return kvq_imp_transform(run, c, k, v, alt, &pol, reps_zc, err);
}

/* kvstat: the sink and the last W tokens exact, the rest at the low bit width (blocks from row 0) */
static kvq_status quantize_zc(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                              size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    const kvq_scheme *q = &d->q;
    size_t lo0, n_lo;
    kvq_imp_resting(q, T, kvd, &lo0, &n_lo, c);
    if (!n_lo) {
        if (out != in) memmove(out, in, T * kvd * sizeof(float));
        return KVQ_OK;
    }
    float *lo = malloc(T * kvd * sizeof(float)), *buf = malloc(2 * kvd * sizeof(float));
    kvq_status s = KVQ_OK;
    if (!lo || !buf) s = kvq_fail(err, KVQ_ENOMEM, "zipcache: cannot hold %zu tokens x %zu channels", T, kvd);
    if (!s)
        s = zc_rep(lo, in, T, kvd, q->group ? q->group : hd, (size_t)ZC_BLOCK(q), side == 'k' ? q->k_bits : q->v_bits,
                   side == 'v' || ZC_KT(q), buf, err);
    if (!s) {
        if (out != in) memmove(out, in, T * kvd * sizeof(float));
        memcpy(out + lo0 * kvd, lo + lo0 * kvd, n_lo * kvd * sizeof(float));
    }
    free(lo);
    free(buf);
    return s;
}

/* ---- bits ------------------------------------------------------------------------------------ */

static kvq_status bits_zc(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    size_t hd = in->head_dim, g = q->group ? q->group : hd;
    if (g == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: zipcache: the per-head group needs head_dim (kvq_scheme_bits_ex)");
    if (in->ctx == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx: expected > 0, found 0");
    double h = ZC_HIGH(q), N = ZC_BLOCK(q), G = (double)g;
    kvq_imp_cost v = {.lo = q->v_bits + 32.0 / G, .hi = h == 16 ? 16.0 : h + 32.0 / G, .fixed = 16.0 / N};
    kvq_imp_cost k = v;
    if (!ZC_KT(q)) k = (kvq_imp_cost){.lo = q->k_bits, .hi = h, .fixed = 32.0 / N};
    double meta = 17.0 / (double)hd; /* saliency flag + accumulated score per (token, KV head) */
    k.lo += meta;
    k.hi += meta;
    kvq_imp_policy pol = policy_zc(q);
    return kvq_imp_bits(q, &pol, &k, &v, in, out, err);
}

const kvq_family kvq_family_zipcache = {
    .name = "zipcache",
    .syntax = "zipcache[-h<H>][-l<L>][-b<f>%][-w<W>][-n<N>][-g<G>][-p<P>%][-kt] (default H=4, L=2, f=60, W=N=100)",
    .summary = "ZipCache (arXiv 2405.14256 §4): the f% tokens of highest normalised attention (optionally from P% probe "
               "queries) at H bits, the rest at L bits, a W-token window exact; values channel-separable token-wise "
               "(sqrt(max|x|) channel normalisers per N-token block, per-token scales), keys per-channel per block "
               "(-kt: channel-separable too); post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_zc,
    .format = fmt_zc,
    .validate = validate_zc,
    .check_model = check_model_zc,
    .check_ctx = check_ctx_zc,
    .quantize = quantize_zc,
    .transform = transform_zc,
    .run_free = kvq_imp_run_free,
    .no_backward = true,
    .describe = describe_zc,
    .bits = bits_zc,
};
