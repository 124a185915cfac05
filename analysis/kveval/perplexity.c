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
        results[i].window_nll = NULL;
    }
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

/* One window of one scheme through the engine; accumulates into res.
 * native: the scheme's descriptor is set on the (GPU) engine, no hook. */
static kvq_status run_window(kvq_engine *e, const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan, size_t w,
                             const kvq_eval_scheme *sc, bool native, kvq_ppl_result *res, int *targets, double *nll,
                             kvq_err *err)
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
    kvq_fwd_io io = {.tokens = (const int *)tok, .T = (int)plan->ctx, .pos0 = px.P, .targets = targets,
                     .prefix = sc->prefix ? &px : NULL, .hooks = hooks.transform ? &hooks : NULL, .nll = nll};
    kvq_fwd_result r;
    double t0 = kvq_now();
    kvq_status st = kvq_engine_run(e, &io, &r, err);
    res->seconds += kvq_now() - t0;
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

kvq_status kvq_ppl_run(const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
                       const kvq_eval_scheme *schemes, size_t n_schemes, kvq_progress *prog,
                       kvq_ppl_result *results, kvq_err *err)
{
    return kvq_ppl_run_on(NULL, m, win, plan, schemes, n_schemes, prog, results, err);
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
    int max_P = 0;
    for (size_t s = 0; s < n_schemes; s++) {
        int P = schemes[s].prefix ? schemes[s].prefix->P : 0;
        if ((size_t)P + plan->ctx > (size_t)m->hp.ctx_len)
            return kvq_fail(err, KVQ_EINVAL, "perplexity: scheme %s: prefix of %d + ctx %zu exceeds the model's context length %d",
                            schemes[s].name, P, plan->ctx, m->hp.ctx_len);
        if (P > max_P) max_P = P;
    }
    for (size_t s = 0; s < n_schemes; s++) {
        results[s].window_nll = calloc(plan->n_windows ? plan->n_windows : 1, sizeof(double));
        if (!results[s].window_nll) {
            kvq_ppl_results_free(results, n_schemes);
            return kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
        }
    }
    kvq_device dev = x ? x->device : KVQ_DEVICE_CPU;
    kvq_engine e;
    kvq_status st = kvq_engine_init_fallback(&e, dev, x && x->auto_device, x ? x->gpu : 0, x ? x->math : KVQ_CUDA_EXACT, m,
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
    int *targets = malloc(plan->ctx * sizeof *targets);
    double *nll = malloc(plan->ctx * sizeof *nll);
    if (!targets || !nll) st = kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
    uint64_t done = 0;
    if (dev == KVQ_DEVICE_CPU) {
        for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w++)
            for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++) {
                st = run_window(&e, m, win, plan, w, &schemes[s], false, &results[s], targets, nll, err);
                if (!st && prog) kvq_progress_update(prog, ++done);
            }
    } else {
        for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++) {
            /* natively on the GPU when the family has a CUDA part, else the hook on the host */
            const kvq_kv_desc *d = kvq_eval_scheme_kv_desc(&schemes[s]);
            if (d && !d->q.fam->cuda) d = NULL;
            st = kvq_engine_set_kv(&e, d, err);
            if (st) {
                kvq_err_prefix(err, "scheme %s", schemes[s].name);
                break;
            }
            kvq_cuda_stats s0, s1;
            kvq_forward_cuda_stats(e.gpu, &s0);
            for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w++) {
                st = run_window(&e, m, win, plan, w, &schemes[s], d != NULL, &results[s], targets, nll, err);
                if (!st && prog) kvq_progress_update(prog, ++done);
            }
            kvq_forward_cuda_stats(e.gpu, &s1);
            if (d) {
                results[s].xform = KVQ_PPL_XF_GPU;
                results[s].k_counts.n_outliers += s1.k_outliers - s0.k_outliers;
                results[s].v_counts.n_outliers += s1.v_outliers - s0.v_outliers;
            }
        }
        if (!st) st = kvq_engine_set_kv(&e, NULL, err);
    }
    for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++)
        results[s].ppl = results[s].n_scored ? exp(results[s].nll_sum / (double)results[s].n_scored) : NAN;
    free(targets);
    free(nll);
    kvq_engine_free(&e);
    if (st) kvq_ppl_results_free(results, n_schemes);
    return st;
}
