/* perplexity.c — windows × schemes through the forward; see perplexity.h. */
#include "perplexity.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"

_Static_assert(sizeof(int) == sizeof(int32_t), "window tokens (int32_t) are passed to the forward as int");

const char *kvq_ppl_protocol_name(kvq_ppl_protocol p)
{
    return p == KVQ_PPL_LLAMACPP ? "llamacpp" : "kvquant";
}

kvq_status kvq_ppl_plan_make(const kvq_windows *win, kvq_ppl_protocol protocol, size_t max_windows,
                             kvq_ppl_plan *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    if (win->ctx < 2)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: ctx = %zu, expected >= 2 (one prediction per window at least)", win->ctx);
    if (win->n_windows == 0)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: text of %zu tokens is shorter than one window of ctx = %zu tokens",
                        win->n_tokens, win->ctx);
    out->protocol = protocol;
    out->ctx = win->ctx;
    out->n_windows = max_windows && max_windows < win->n_windows ? max_windows : win->n_windows;
    out->first_scored = protocol == KVQ_PPL_LLAMACPP ? win->ctx / 2 : 0;
    out->scored_per_window = win->ctx - 1 - out->first_scored;
    if (out->scored_per_window == 0) { /* (llamacpp at ctx 2) the perplexity would be 0/0 */
        kvq_ppl_protocol p = protocol;
        memset(out, 0, sizeof *out);
        return kvq_fail(err, KVQ_EINVAL, "perplexity: ctx = %zu scores no token under the %s protocol (it scores positions ctx/2 .. ctx - 2); expected ctx >= 3",
                        win->ctx, p == KVQ_PPL_LLAMACPP ? "llamacpp" : "kvquant");
    }
    return KVQ_OK;
}

void kvq_ppl_targets(const kvq_ppl_plan *plan, const int32_t *tokens, int *targets)
{
    for (size_t t = 0; t < plan->ctx; t++)
        targets[t] = t >= plan->first_scored && t + 1 < plan->ctx ? tokens[t + 1] : -1;
}

void kvq_ppl_results_free(kvq_ppl_result *results, size_t n)
{
    for (size_t i = 0; results && i < n; i++) {
        free(results[i].window_nll);
        free(results[i].window_kld);
        free(results[i].token_kld);
        results[i].window_nll = results[i].window_kld = results[i].token_kld = NULL;
    }
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* llama-perplexity's percentile of sorted values: linear interpolation at fraction * (n - 1) */
static double percentile(const double *v, uint64_t n, double fraction)
{
    if (fraction <= 0) return v[0];
    if (fraction >= 1) return v[n - 1];
    const double p = fraction * (double)(n - 1);
    const uint64_t ip = (uint64_t)p;
    const double f = p - (double)ip;
    return (1 - f) * v[ip] + f * v[ip + 1 < n ? ip + 1 : n - 1];
}

void kvq_kld_stats_compute(double *x, uint64_t n, uint64_t same_top, kvq_kld_stats *st)
{
    memset(st, 0, sizeof *st);
    st->n = n;
    st->same_top = same_top;
    if (n == 0) {
        st->mean = st->mean_se = st->median = st->p90 = st->p95 = st->p99 = st->p999 = st->min = st->max = NAN;
        st->same_top_frac = st->same_top_se = NAN;
        return;
    }
    double sum = 0, sum2 = 0;
    for (uint64_t i = 0; i < n; i++) {
        sum += x[i];
        sum2 += x[i] * x[i];
    }
    st->mean = sum / (double)n;
    const double var = sum2 / (double)n - st->mean * st->mean;
    st->mean_se = n > 1 && var > 0 ? sqrt(var / (double)(n - 1)) : n > 1 ? 0 : NAN;
    qsort(x, n, sizeof *x, cmp_double);
    st->median = n % 2 == 0 ? 0.5 * (x[n / 2] + x[n / 2 - 1]) : x[n / 2];
    st->p90 = percentile(x, n, 0.90);
    st->p95 = percentile(x, n, 0.95);
    st->p99 = percentile(x, n, 0.99);
    st->p999 = percentile(x, n, 0.999);
    st->min = x[0];
    st->max = x[n - 1];
    st->same_top_frac = (double)same_top / (double)n;
    st->same_top_se = n > 1 ? sqrt(st->same_top_frac * (1 - st->same_top_frac) / (double)(n - 1)) : NAN;
}

void kvq_ppl_paired_delta(const kvq_ppl_result *s, const kvq_ppl_result *base, size_t W, kvq_ppl_paired *out)
{
    out->d_ppl = s->ppl - base->ppl;
    out->d_nll = s->n_scored && base->n_scored ? s->nll_sum / (double)s->n_scored - base->nll_sum / (double)base->n_scored : NAN;
    out->d_nll_se = out->d_ppl_se = NAN;
    if (W < 2 || !s->window_nll || !base->window_nll) return;
    double ma = 0, mb = 0;
    for (size_t w = 0; w < W; w++) {
        ma += s->window_nll[w];
        mb += base->window_nll[w];
    }
    ma /= (double)W;
    mb /= (double)W;
    double va = 0, vb = 0, cab = 0, vd = 0;
    for (size_t w = 0; w < W; w++) {
        const double a = s->window_nll[w] - ma, b = base->window_nll[w] - mb;
        va += a * a;
        vb += b * b;
        cab += a * b;
        vd += (a - b) * (a - b);
    }
    va /= (double)(W - 1);
    vb /= (double)(W - 1);
    cab /= (double)(W - 1);
    vd /= (double)(W - 1);
    out->d_nll_se = sqrt(vd / (double)W);
    const double pa = s->ppl, pb = base->ppl, v = pa * pa * va + pb * pb * vb - 2 * pa * pb * cab;
    out->d_ppl_se = sqrt((v > 0 ? v : 0) / (double)W);
}

const char *kvq_ppl_exec_mode(const kvq_ppl_exec *x)
{
    return x && x->device == KVQ_DEVICE_CUDA ? kvq_cuda_math_name(x->math) : "exact (fp32)";
}

const char *kvq_ppl_xform_name(kvq_ppl_xform x)
{
    switch (x) {
    case KVQ_PPL_XF_CPU: return "cpu";
    case KVQ_PPL_XF_GPU: return "gpu-native";
    case KVQ_PPL_XF_HOST: return "host";
    default: return "none";
    }
}

/* One window's LM-head outputs for the KL divergence: the baseline's (kept until the next window)
 * and the current scheme's. */
typedef struct {
    bool on, is_base;
    float *hb, *eb, *hs; /* [ctx][dim]: baseline hidden and expectation, scheme hidden */
    double *cb, *lb, *ls; /* [ctx]: baseline h.e and lse, scheme lse */
    int *ab, *as;         /* [ctx]: top tokens */
} kld_ws;

static kvq_status kld_ws_init(kld_ws *k, size_t ctx, size_t dim, kvq_err *err)
{
    memset(k, 0, sizeof *k);
    k->on = true;
    k->hb = malloc(ctx * dim * sizeof(float));
    k->eb = malloc(ctx * dim * sizeof(float));
    k->hs = malloc(ctx * dim * sizeof(float));
    k->cb = malloc(ctx * sizeof(double));
    k->lb = malloc(ctx * sizeof(double));
    k->ls = malloc(ctx * sizeof(double));
    k->ab = malloc(ctx * sizeof(int));
    k->as = malloc(ctx * sizeof(int));
    if (!k->hb || !k->eb || !k->hs || !k->cb || !k->lb || !k->ls || !k->ab || !k->as)
        return kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory for the KL divergence of windows of %zu tokens", ctx);
    return KVQ_OK;
}

static void kld_ws_free(kld_ws *k)
{
    free(k->hb);
    free(k->eb);
    free(k->hs);
    free(k->cb);
    free(k->lb);
    free(k->ls);
    free(k->ab);
    free(k->as);
    memset(k, 0, sizeof *k);
}

/* ---- where a non-finite value arises (a NaN/Inf NLL is rerun with this observer) ---- */

typedef struct {
    kvq_hooks inner;   /* the scheme's hooks (transform and its user) */
    int layer;         /* first layer with a non-finite value, -1 = none */
    char what[256];
} nan_probe;

static kvq_status probe_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    nan_probe *p = user;
    return p->inner.transform(p->inner.user, ctx, k, v, alt, err);
}

static bool find_bad(const float *x, size_t rows, size_t width, size_t *r, size_t *c)
{
    for (size_t i = 0; x && i < rows * width; i++)
        if (!isfinite(x[i])) {
            *r = i / width;
            *c = i % width;
            return true;
        }
    return false;
}

static kvq_status probe_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    nan_probe *p = user;
    if (p->layer >= 0) return KVQ_OK;
    const size_t kvw = (size_t)ctx->n_kv_heads * ctx->head_dim, qw = (size_t)ctx->n_heads * ctx->head_dim;
    /* in the order they arise: the model's projections, then what the scheme made of them */
    const struct { const float *x; size_t w; const char *name; } chk[] = {
        {obs->q, qw, "the query (model)"},
        {obs->k_pre, kvw, "the pre-RoPE key (model)"},
        {obs->v, kvw, "the value (model)"},
        {obs->k_att, kvw, "the key after the scheme's transform"},
        {obs->v_att, kvw, "the value after the scheme's transform"},
        {obs->k_alt, kvw, "the key's quantized representation (scheme)"},
        {obs->v_alt, kvw, "the value's quantized representation (scheme)"},
    };
    for (size_t i = 0; i < sizeof chk / sizeof *chk; i++) {
        size_t r, c;
        if (find_bad(chk[i].x, (size_t)ctx->T, chk[i].w, &r, &c)) {
            p->layer = ctx->layer;
            snprintf(p->what, sizeof p->what, "layer %d: position %zu, head %zu, channel %zu: %s is %g", ctx->layer,
                     (size_t)ctx->pos0 + r, c / (size_t)ctx->head_dim, c % (size_t)ctx->head_dim, chk[i].name,
                     (double)chk[i].x[r * chk[i].w + c]);
            return KVQ_OK;
        }
    }
    return KVQ_OK;
}

/* Rerun a window whose NLL was not finite, observing every layer, and name where the first non-finite
 * value arose (the message kvdump gives): "layer L: position P, head H, channel C: the value after the
 * scheme's transform is nan"; or that every layer's Q/K/V stayed finite. */
static void name_nonfinite(kvq_engine *e, const kvq_fwd_io *io0, kvq_err *err)
{
    nan_probe p = {.layer = -1};
    kvq_hooks hk = {0};
    if (io0->hooks) p.inner = *io0->hooks;
    hk.user = &p;
    hk.observe = probe_observe;
    hk.transform = p.inner.transform ? probe_transform : NULL;
    hk.key_stage = p.inner.key_stage;
    kvq_fwd_io io = *io0;
    io.hooks = &hk;
    io.head = NULL;
    kvq_fwd_result r;
    kvq_err e2 = {0};
    (void)kvq_engine_run(e, &io, &r, &e2);
    char msg[KVQ_ERR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", err->msg);
    if (p.layer >= 0)
        kvq_fail(err, KVQ_ENUMERIC, "%s (not finite); %s", p.what, msg);
    else
        kvq_fail(err, KVQ_ENUMERIC, "every layer's query, keys and values are finite: the non-finite value arose after the "
                                    "attention of the last layer (MLP or LM head); %s", msg);
}

/* One window of one scheme through the engine; accumulates into res.
 * native: the scheme's descriptor is set on the (GPU) engine, no hook.
 * kw (may be NULL): KL divergence against the baseline (kw->is_base: this is the baseline's run). */
static kvq_status run_window(kvq_engine *e, const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan, size_t w,
                             const kvq_eval_scheme *sc, bool native, kvq_ppl_result *res, int *targets, double *nll,
                             kld_ws *kw, kvq_err *err)
{
    const int32_t *tok = win->tokens + w * plan->ctx;
    kvq_ppl_targets(plan, tok, targets);
    kvq_scheme_run run;
    kvq_hooks hooks;
    kvq_scheme_hooks(&run, sc, &hooks);
    if (native) hooks.transform = NULL;
    run.k_counts = res->k_counts;
    run.v_counts = res->v_counts;
    kvq_prefix px = {0};
    if (sc->prefix) px = (kvq_prefix){.P = sc->prefix->P, .k = sc->prefix->k, .v = sc->prefix->v};
    kvq_fwd_head head = {0};
    if (kw && kw->on) {
        if (kw->is_base) head = (kvq_fwd_head){.hidden = kw->hb, .lse = kw->lb, .argmax = kw->ab, .expect = kw->eb};
        else head = (kvq_fwd_head){.hidden = kw->hs, .lse = kw->ls, .argmax = kw->as};
    }
    kvq_fwd_io io = {.tokens = (const int *)tok, .T = (int)plan->ctx, .pos0 = px.P, .targets = targets,
                     .prefix = sc->prefix ? &px : NULL, .hooks = hooks.transform ? &hooks : NULL, .nll = nll,
                     .head = kw && kw->on ? &head : NULL};
    kvq_fwd_result r;
    double t0 = kvq_now();
    kvq_status st = kvq_engine_run(e, &io, &r, err);
    res->seconds += kvq_now() - t0;
    if (st == KVQ_ENUMERIC) name_nonfinite(e, &io, err);
    kvq_scheme_run_free(&run);
    if (st) return kvq_err_prefix(err, "scheme %s, window %zu (stream offset %zu)", sc->name, w, win->offsets[w]);
    if (r.n_scored != (int)plan->scored_per_window)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: scheme %s, window %zu: %d positions scored, expected %zu", sc->name, w,
                        r.n_scored, plan->scored_per_window);
    double sum = 0;
    for (size_t t = plan->first_scored; t + 1 < plan->ctx; t++) sum += nll[t];
    res->nll_sum += sum;
    res->n_scored += (uint64_t)r.n_scored;
    res->window_nll[w] = sum / r.n_scored;
    if (kw && kw->on) {
        const size_t dim = (size_t)m->hp.dim, f = plan->first_scored;
        if (kw->is_base) {
            for (size_t t = f; t + 1 < plan->ctx; t++) {
                double c = 0;
                for (size_t d = 0; d < dim; d++) c += (double)kw->hb[t * dim + d] * kw->eb[t * dim + d];
                kw->cb[t] = c;
            }
        } else {
            /* KL(P_base || Q) = (h_base - h) . e_base - lse_base + lse (kvq_fwd_head) */
            double wsum = 0;
            double *out = res->token_kld + w * plan->scored_per_window;
            for (size_t t = f; t + 1 < plan->ctx; t++) {
                double c = 0;
                for (size_t d = 0; d < dim; d++) c += (double)kw->hs[t * dim + d] * kw->eb[t * dim + d];
                const double kl = kw->cb[t] - c - kw->lb[t] + kw->ls[t];
                out[t - f] = kl;
                wsum += kl;
                res->kld.same_top += kw->as[t] == kw->ab[t];
            }
            res->window_kld[w] = wsum / (double)plan->scored_per_window;
        }
    }
    if (native) { /* the GPU counts outliers only (added per scheme by the caller); elements and sink tokens here */
        uint64_t L = (uint64_t)m->hp.n_layers, kvd = (uint64_t)kvq_kv_dim(&m->hp), T = plan->ctx;
        uint64_t ns = sc->s.q.n_sink < T ? sc->s.q.n_sink : T;
        run.k_counts.n_elems += L * T * kvd;
        run.v_counts.n_elems += L * T * kvd;
        run.k_counts.n_sink += L * ns * kvd;
        run.v_counts.n_sink += L * ns * kvd;
    } else if (hooks.transform) {
        res->xform = e->dev == KVQ_DEVICE_CUDA ? KVQ_PPL_XF_HOST : KVQ_PPL_XF_CPU;
    }
    res->k_counts = run.k_counts;
    res->v_counts = run.v_counts;
    res->transform_seconds += run.seconds;
    return KVQ_OK;
}

/* A pipeline over several GPUs (kvq_engine_init_pipe) with a native scheme (no host hooks): windows w0 .. w0+nb-1
 * as micro-batches of one kvq_engine_run_batch, so that the stages overlap; the accounting of run_window per
 * window. targets, nll: [nb][ctx]. */
static kvq_status run_windows_pipe(kvq_engine *e, const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan, size_t w0,
                                   size_t nb, const kvq_eval_scheme *sc, kvq_ppl_result *res, int *targets, double *nll,
                                   kvq_fwd_io *io, kvq_fwd_result *r, kvq_err *err)
{
    kvq_prefix px = {0};
    if (sc->prefix) px = (kvq_prefix){.P = sc->prefix->P, .k = sc->prefix->k, .v = sc->prefix->v};
    const size_t T = plan->ctx;
    for (size_t i = 0; i < nb; i++) {
        const int32_t *tok = win->tokens + (w0 + i) * T;
        kvq_ppl_targets(plan, tok, targets + i * T);
        io[i] = (kvq_fwd_io){.tokens = (const int *)tok, .T = (int)T, .pos0 = px.P, .targets = targets + i * T,
                             .prefix = sc->prefix ? &px : NULL, .nll = nll + i * T};
    }
    double t0 = kvq_now();
    kvq_status st = kvq_engine_run_batch(e, io, r, (int)nb, err);
    res->seconds += kvq_now() - t0;
    if (st) return kvq_err_prefix(err, "scheme %s, windows %zu..%zu", sc->name, w0, w0 + nb - 1);
    const uint64_t L = (uint64_t)m->hp.n_layers, kvd = (uint64_t)kvq_kv_dim(&m->hp), ns = sc->s.q.n_sink < T ? sc->s.q.n_sink : T;
    for (size_t i = 0; i < nb; i++) {
        const size_t w = w0 + i;
        if (r[i].n_scored != (int)plan->scored_per_window)
            return kvq_fail(err, KVQ_EINVAL, "perplexity: scheme %s, window %zu: %d positions scored, expected %zu", sc->name, w,
                            r[i].n_scored, plan->scored_per_window);
        double sum = 0;
        for (size_t t = plan->first_scored; t + 1 < T; t++) sum += nll[i * T + t];
        res->nll_sum += sum;
        res->n_scored += (uint64_t)r[i].n_scored;
        res->window_nll[w] = sum / r[i].n_scored;
        /* the GPU counts outliers only (added per scheme by the caller); elements and sink tokens here (run_window) */
        res->k_counts.n_elems += L * T * kvd;
        res->v_counts.n_elems += L * T * kvd;
        res->k_counts.n_sink += L * ns * kvd;
        res->v_counts.n_sink += L * ns * kvd;
    }
    return KVQ_OK;
}

kvq_status kvq_ppl_run(const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
                       const kvq_eval_scheme *schemes, size_t n_schemes, kvq_progress *prog,
                       kvq_ppl_result *results, kvq_err *err)
{
    return kvq_ppl_run_on(NULL, m, win, plan, schemes, n_schemes, prog, results, err);
}

/* the GPU's per-key schedules between two stats snapshots (any scheme on the GPU), into a scheme's result */
static void gpu_sched_add(kvq_ppl_result *r, const kvq_cuda_stats *s0, const kvq_cuda_stats *s1)
{
    r->sched_device += s1->device_scheds - s0->device_scheds;
    r->sched_host += s1->host_scheds - s0->host_scheds;
}

/* what the GPU's native transforms counted between two stats snapshots, into a scheme's result */
static void gpu_counts_add(kvq_ppl_result *r, const kvq_cuda_stats *s0, const kvq_cuda_stats *s1)
{
    r->xform = KVQ_PPL_XF_GPU;
    r->k_counts.n_outliers += s1->k_outliers - s0->k_outliers;
    r->v_counts.n_outliers += s1->v_outliers - s0->v_outliers;
    r->k_counts.n_clipped += s1->k_clipped - s0->k_clipped;
    r->v_counts.n_clipped += s1->v_clipped - s0->v_clipped;
}

kvq_status kvq_ppl_run_on(kvq_ppl_exec *x, const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
                          const kvq_eval_scheme *schemes, size_t n_schemes, kvq_progress *prog,
                          kvq_ppl_result *results, kvq_err *err)
{
    memset(results, 0, n_schemes * sizeof *results);
    if (plan->ctx != win->ctx || plan->n_windows > win->n_windows)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: plan (ctx %zu, %zu windows) does not fit the windows (ctx %zu, %zu)",
                        plan->ctx, plan->n_windows, win->ctx, win->n_windows);
    if (plan->ctx > (size_t)m->hp.ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: ctx %zu exceeds the model's context length %d", plan->ctx, m->hp.ctx_len);
    const bool kld = x && x->kld;
    const size_t base = kld ? x->kld_baseline : 0;
    if (kld && base >= n_schemes)
        return kvq_fail(err, KVQ_EINVAL, "perplexity: KL divergence baseline %zu of %zu schemes", base, n_schemes);
    int max_P = 0;
    for (size_t s = 0; s < n_schemes; s++) {
        int P = schemes[s].prefix ? schemes[s].prefix->P : 0;
        if ((size_t)P + plan->ctx > (size_t)m->hp.ctx_len)
            return kvq_fail(err, KVQ_EINVAL, "perplexity: scheme %s: prefix of %d + ctx %zu exceeds the model's context length %d",
                            schemes[s].name, P, plan->ctx, m->hp.ctx_len);
        if (P > max_P) max_P = P;
        /* a scheme that runs windows in steps attends the earlier steps' cache as a prefix (kvq_hooks.chunk) */
        int chunk = kvq_kv_desc_chunk(&schemes[s].desc);
        if (chunk > 0 && (size_t)chunk < plan->ctx && (int)plan->ctx > max_P) max_P = (int)plan->ctx;
        const kvq_family *f = schemes[s].desc.q.fam;
        if (f && f->check_ctx) KVQ_TRY(f->check_ctx(&schemes[s].desc.q, schemes[s].name, plan->ctx, err));
    }
    const size_t nw = plan->n_windows ? plan->n_windows : 1, nt = nw * plan->scored_per_window;
    for (size_t s = 0; s < n_schemes; s++) {
        kvq_ppl_result *r = &results[s];
        r->window_nll = calloc(nw, sizeof(double));
        r->has_kld = kld && s != base;
        if (r->has_kld) {
            r->window_kld = calloc(nw, sizeof(double));
            r->token_kld = malloc((nt ? nt : 1) * sizeof(double));
        }
        if (!r->window_nll || (r->has_kld && (!r->window_kld || !r->token_kld))) {
            kvq_ppl_results_free(results, n_schemes);
            return kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
        }
    }
    kvq_device dev = x ? x->device : KVQ_DEVICE_CPU;
    kvq_engine e;
    kvq_status st = x && x->n_gpus > 1
                        ? kvq_engine_init_pipe(&e, x->gpus, x->n_gpus, x->math, m, (int)plan->ctx, max_P, 0, NULL, 0, err)
                        : kvq_engine_init_fallback(&e, dev, x && x->auto_device, x ? x->gpu : 0, x ? x->math : KVQ_CUDA_EXACT, m,
                                                   (int)plan->ctx, max_P, 0, x ? x->note : NULL, x ? sizeof x->note : 0, err);
    if (st) {
        kvq_ppl_results_free(results, n_schemes);
        return st;
    }
    dev = e.dev;
    if (x && dev != x->device) {
        x->device = dev;
        x->math = KVQ_CUDA_EXACT;
    }
    if (x) kvq_engine_describe(&e, x->described, sizeof x->described);
    if (x) x->gemm_flops = 0;
    if (x && x->gemm_rate && dev == KVQ_DEVICE_CUDA) { /* the throughput's baseline, same process, before the windows */
        st = kvq_cuda_sgemm_rate(x->gpu, 8192, 7, x->math, &x->gemm_flops, err);
        if (st) {
            kvq_err_prefix(err, "--gemm-rate");
            kvq_engine_free(&e);
            kvq_ppl_results_free(results, n_schemes);
            return st;
        }
    }
    int *targets = malloc(plan->ctx * sizeof *targets);
    double *nll = malloc(plan->ctx * sizeof *nll);
    if (!targets || !nll) st = kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
    kld_ws kw = {0};
    if (!st && kld) st = kld_ws_init(&kw, plan->ctx, (size_t)m->hp.dim, err);
    uint64_t done = 0;
    if (dev == KVQ_DEVICE_CPU || kld) {
        /* window-major: window w for every scheme (the KL baseline first), then w + 1; on the GPU one
         * descriptor upload per scheme and window */
        for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w++)
            for (size_t k = 0; st == KVQ_OK && k < n_schemes; k++) {
                const size_t s = k == 0 ? base : k <= base ? k - 1 : k;
                kw.is_base = s == base;
                const kvq_kv_desc *d = dev == KVQ_DEVICE_CUDA ? kvq_eval_scheme_gpu_desc(&schemes[s]) : NULL;
                kvq_cuda_stats s0 = {0}, s1 = {0};
                if (dev == KVQ_DEVICE_CUDA) {
                    st = kvq_engine_set_kv(&e, d, err);
                    if (st) {
                        kvq_err_prefix(err, "scheme %s", schemes[s].name);
                        break;
                    }
                    kvq_engine_cuda_stats(&e, &s0);
                }
                st = run_window(&e, m, win, plan, w, &schemes[s], d != NULL, &results[s], targets, nll, kld ? &kw : NULL, err);
                if (!st && dev == KVQ_DEVICE_CUDA) {
                    kvq_engine_cuda_stats(&e, &s1);
                    gpu_sched_add(&results[s], &s0, &s1);
                    if (d) gpu_counts_add(&results[s], &s0, &s1);
                }
                if (!st && prog) kvq_progress_update(prog, ++done);
            }
        if (!st && dev == KVQ_DEVICE_CUDA) st = kvq_engine_set_kv(&e, NULL, err);
    } else {
        for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++) {
            /* natively on the GPU when the family has a CUDA part, else the hook on the host */
            const kvq_kv_desc *d = kvq_eval_scheme_gpu_desc(&schemes[s]);
            st = kvq_engine_set_kv(&e, d, err);
            if (st) {
                kvq_err_prefix(err, "scheme %s", schemes[s].name);
                break;
            }
            kvq_cuda_stats s0, s1;
            kvq_engine_cuda_stats(&e, &s0);
            if (e.pipe && d) { /* several GPUs, a native scheme: batches of windows so that the pipeline's stages overlap */
                enum { PIPE_BATCH = 16 };
                int *tb = malloc((size_t)PIPE_BATCH * plan->ctx * sizeof *tb);
                double *nb_ = malloc((size_t)PIPE_BATCH * plan->ctx * sizeof *nb_);
                kvq_fwd_io ios[PIPE_BATCH];
                kvq_fwd_result rs[PIPE_BATCH];
                if (!tb || !nb_) st = kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
                for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w += PIPE_BATCH) {
                    const size_t nb = plan->n_windows - w < PIPE_BATCH ? plan->n_windows - w : PIPE_BATCH;
                    st = run_windows_pipe(&e, m, win, plan, w, nb, &schemes[s], &results[s], tb, nb_, ios, rs, err);
                    if (!st && prog) kvq_progress_update(prog, done += nb);
                }
                free(tb);
                free(nb_);
            } else {
                for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w++) {
                    st = run_window(&e, m, win, plan, w, &schemes[s], d != NULL, &results[s], targets, nll, NULL, err);
                    if (!st && prog) kvq_progress_update(prog, ++done);
                }
            }
            kvq_engine_cuda_stats(&e, &s1);
            gpu_sched_add(&results[s], &s0, &s1);
            if (d) {
                gpu_counts_add(&results[s], &s0, &s1);
            }
        }
        if (!st) st = kvq_engine_set_kv(&e, NULL, err);
    }
    for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++) {
        kvq_ppl_result *r = &results[s];
        r->ppl = r->n_scored ? exp(r->nll_sum / (double)r->n_scored) : NAN;
        r->flops = (double)plan->n_windows * kvq_forward_flops(&m->hp, (int)plan->ctx, schemes[s].prefix ? schemes[s].prefix->P : 0);
        if (r->has_kld) kvq_kld_stats_compute(r->token_kld, (uint64_t)plan->n_windows * plan->scored_per_window, r->kld.same_top, &r->kld);
    }
    kld_ws_free(&kw);
    free(targets);
    free(nll);
    kvq_engine_free(&e);
    if (st) kvq_ppl_results_free(results, n_schemes);
    return st;
}
