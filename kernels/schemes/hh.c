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
 * Decode semantics, per layer and KV head h (GQA: the query heads of h's
 * group vote together), for the query at step i (window token i):
 *   - tokens j in (i - W, i] (the recent window) and sink tokens are exact;
 *   - after query i has attended, every window key j <= i gains
 *     s_j += sum over the group's query heads of their attention probability
 *     p_ij (the probability as the simulated cache produced it, rounded to
 *     float; the sum over heads in double, added in head order);
 *   - then token e = i + 1 - W leaves the window (if e >= n_sink): with fewer
 *     than C(i + 2) = floor(f * (i + 2)) heavy hitters it joins them (high
 *     precision from step i + 1 on); otherwise the token with the lowest s
 *     among the heavy hitters and e (ties: the lowest index) goes to the low
 *     precision from step i + 1 on, for good (no token is ever promoted back:
 *     a real cache no longer has its high-precision copy), and e takes its
 *     place unless it was e itself.
 * This is the kvq_kv_sched contract (forward.h): three representations
 * (exact, high, low) per key and value, switch times per (KV head, token)
 * decided by the step callback after every query row.
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
    const kvq_scheme *q = &d->q;
    size_t ns = q->n_sink < T ? q->n_sink : T, w = T - ns < q->residual ? T - ns : q->residual, lo = T - w;
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    if (lo > ns) KVQ_TRY(low_rep(q, out + ns * kvd, in + ns * kvd, lo - ns, kvd, hd, q->k_bits, err));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
        c->n_exact += w * kvd;
    }
    return KVQ_OK;
}

/* ---- the streaming policy ---------------------------------------------------------------- */

typedef struct {
    size_t cap_T, H, kvd;
    float *k_hi, *k_lo, *v_hi, *v_lo; /* [cap_T][kvd] */
    int *from;                        /* [2][H][cap_T]: first query reading the high / low representation */
    double *score;                    /* [H][cap_T] accumulated attention */
    int *heavy;                       /* [H][cap_T] heavy-hitter token indices */
    int *n_heavy;                     /* [H] */
    uint64_t *cnt;                    /* [H][4]: elements, sink, exact, high of the last query (per head) */
    bool pending;                     /* cnt holds a layer not yet added to the run's counters */
    int T, P, ns, W;
    double f;
    size_t hd;
    kvq_kv_sched sched;
} hh_state;

static void flush_counts(kvq_kv_desc_run *run, hh_state *st)
{
    if (!st->pending) return;
    for (size_t h = 0; h < st->H; h++)
        for (int w = 0; w < 2; w++) {
            kvq_quant_counts *c = w ? &run->v_counts : &run->k_counts;
            const uint64_t *x = st->cnt + 4 * h;
            c->n_elems += x[0];
            c->n_sink += x[1];
            c->n_exact += x[2];
            c->n_high += x[3];
        }
    st->pending = false;
}

static void free_state(hh_state *st)
{
    if (!st) return;
    free(st->k_hi);
    free(st->k_lo);
    free(st->v_hi);
    free(st->v_lo);
    free(st->from);
    free(st->score);
    free(st->heavy);
    free(st->n_heavy);
    free(st->cnt);
    free(st);
}

static void run_free_hh(kvq_kv_desc_run *run)
{
    hh_state *st = run->state;
    if (!st) return;
    flush_counts(run, st);
    free_state(st);
    run->state = NULL;
}

/* floor(f n), with a margin for f n that should be an integer (0.29 * 100) */
static int capacity(double f, int n) { return (int)floor(f * (double)n + 1e-9); }

static kvq_status step_hh(void *user, const kvq_sched_step *s, kvq_kv_sched *sc, kvq_err *err)
{
    (void)sc;
    (void)err;
    hh_state *st = user;
    const int h = s->kv_head, i = s->i, T = st->T, n = s->P + i + 1;
    double *score = st->score + (size_t)h * T;
    int *f_hi = st->from + (size_t)h * T, *f_lo = st->from + ((size_t)st->H + h) * T;
    if (i == T - 1) { /* the resting cache as the last query reads it */
        uint64_t *c = st->cnt + 4 * h, hd = st->hd;
        c[0] = (uint64_t)T * hd;
        c[1] = (uint64_t)(st->ns < T ? st->ns : T) * hd;
        c[2] = c[3] = 0;
        for (int j = st->ns; j < T; j++) {
            if (f_hi[j] > i && f_lo[j] > i) c[2] += hd;
            else if (f_lo[j] > i) c[3] += hd;
        }
    }
    for (int j = 0; j <= i; j++) {
        double a = 0;
        for (int q = 0; q < s->n_q; q++) a += s->probs[(size_t)q * n + s->P + j];
        score[j] += a;
    }
    const int e = i + 1 - st->W;
    if (e < st->ns || e < 0) return KVQ_OK;
    int *heavy = st->heavy + (size_t)h * T, *nh = &st->n_heavy[h];
    if (*nh < capacity(st->f, i + 2)) {
        heavy[(*nh)++] = e;
        f_hi[e] = i + 1;
        return KVQ_OK;
    }
    int m = -1, mk = e; /* slot of the minimum, its token */
    for (int k = 0; k < *nh; k++) {
        int t = heavy[k];
        if (score[t] < score[mk] || (score[t] == score[mk] && t < mk)) {
            m = k;
            mk = t;
        }
    }
    if (m < 0) { /* e itself: straight to the low precision */
        f_hi[e] = f_lo[e] = i + 1;
        return KVQ_OK;
    }
    f_lo[mk] = i + 1;
    heavy[m] = e;
    f_hi[e] = i + 1;
    return KVQ_OK;
}

static kvq_status grow(hh_state *st, size_t T, size_t H, size_t kvd, kvq_err *err)
{
    if (st->cap_T >= T && st->H == H && st->kvd == kvd) return KVQ_OK;
    size_t n = T * kvd;
    float *b[4];
    for (int i = 0; i < 4; i++) b[i] = malloc(n * sizeof(float));
    int *from = malloc(2 * H * T * sizeof(int)), *heavy = malloc(H * T * sizeof(int)), *nh = malloc(H * sizeof(int));
    double *score = malloc(H * T * sizeof(double));
    uint64_t *cnt = calloc(4 * H, sizeof(uint64_t));
    if (!b[0] || !b[1] || !b[2] || !b[3] || !from || !heavy || !nh || !score || !cnt) {
        for (int i = 0; i < 4; i++) free(b[i]);
        free(from);
        free(heavy);
        free(nh);
        free(score);
        free(cnt);
        return kvq_fail(err, KVQ_ENOMEM, "hh: cannot allocate the cache simulation for %zu tokens x %zu channels", T, kvd);
    }
    free(st->k_hi);
    free(st->k_lo);
    free(st->v_hi);
    free(st->v_lo);
    free(st->from);
    free(st->heavy);
    free(st->n_heavy);
    free(st->score);
    free(st->cnt);
    st->k_hi = b[0];
    st->k_lo = b[1];
    st->v_hi = b[2];
    st->v_lo = b[3];
    st->from = from;
    st->heavy = heavy;
    st->n_heavy = nh;
    st->score = score;
    st->cnt = cnt;
    st->cap_T = T;
    st->H = H;
    st->kvd = kvd;
    return KVQ_OK;
}

static kvq_status transform_hh(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    const kvq_scheme *q = &run->d->q;
    size_t T = (size_t)c->T, H = (size_t)c->n_kv_heads, hd = (size_t)c->head_dim, kvd = H * hd;
    hh_state *st = run->state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st) return kvq_fail(err, KVQ_ENOMEM, "hh: out of memory");
        run->state = st;
    }
    flush_counts(run, st); /* the previous layer's resting cache */
    KVQ_TRY(grow(st, T, H, kvd, err));
    KVQ_TRY(low_rep(q, st->k_lo, k, T, kvd, hd, q->k_bits, err));
    KVQ_TRY(low_rep(q, st->v_lo, v, T, kvd, hd, q->v_bits, err));
    KVQ_TRY(high_rep(q, st->k_hi, k, T, kvd, hd, err));
    KVQ_TRY(high_rep(q, st->v_hi, v, T, kvd, hd, err));
    st->T = (int)T;
    st->P = c->P;
    st->ns = (int)(q->n_sink < T ? q->n_sink : T);
    st->W = (int)(q->residual < T ? q->residual : T);
    st->f = HH_BUDGET(q);
    st->hd = hd;
    for (size_t x = 0; x < 2 * H * T; x++) st->from[x] = (int)T; /* T: never, within this window */
    memset(st->score, 0, H * T * sizeof(double));
    memset(st->n_heavy, 0, H * sizeof(int));
    memset(st->cnt, 0, 4 * H * sizeof(uint64_t));
    st->pending = true;
    st->sched = (kvq_kv_sched){.n_k = 3, .n_v = 3, .k = {k, st->k_hi, st->k_lo}, .v = {v, st->v_hi, st->v_lo},
                               .k_from = st->from, .v_from = st->from, .step = step_hh, .user = st};
    alt->sched = &st->sched;
    return KVQ_OK;
}

/* ---- bits ---------------------------------------------------------------------------------- */

static kvq_status bits_hh(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    size_t hd = in->head_dim, g = q->group ? q->group : hd;
    if (g == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: hh: the per-head group needs head_dim (kvq_scheme_bits_ex)");
    double lo = q->k_bits + 32.0 / (double)g, hi = (HH_HIGH(q) == 8 ? 8 + 32.0 / (double)g : 16.0) + 16.0 / (double)hd;
    size_t ctx = in->ctx, ns = q->n_sink < ctx ? q->n_sink : ctx, win = ctx - ns < q->residual ? ctx - ns : q->residual;
    size_t rest = ctx - ns - win, heavy = (size_t)capacity(HH_BUDGET(q), (int)ctx);
    if (heavy > rest) heavy = rest;
    for (int w = 0; w < 2; w++) {
        const kvq_quant_counts *c = w ? in->v : in->k;
        /* the sink and the window are exact at any ctx; of the other tokens, the share a run kept at the high
         * precision (realised), else the budget's */
        double fe = (double)(ns + win) / (double)ctx, fh = (double)heavy / (double)ctx;
        if (c && c->n_elems > c->n_sink + c->n_exact)
            fh = (double)c->n_high / (double)(c->n_elems - c->n_sink - c->n_exact) * (double)rest / (double)ctx;
        double b = fe * 16.0 + fh * hi + (1.0 - fe - fh) * lo;
        if (w) out->v = b;
        else out->k = b;
    }
    return KVQ_OK;
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
    .quantize = quantize_hh,
    .transform = transform_hh,
    .run_free = run_free_hh,
    .no_backward = true,
    .describe = describe_hh,
    .bits = bits_hh,
};
