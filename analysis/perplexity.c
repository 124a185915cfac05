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

kvq_status kvq_ppl_run(const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
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
    kvq_forward fw;
    kvq_status st = kvq_forward_init(&fw, m, (int)plan->ctx, max_P, 0, err);
    int *targets = st ? NULL : malloc(plan->ctx * sizeof *targets);
    double *nll = st ? NULL : malloc(plan->ctx * sizeof *nll);
    if (!st && (!targets || !nll)) st = kvq_fail(err, KVQ_ENOMEM, "perplexity: out of memory");
    uint64_t done = 0;
    for (size_t w = 0; st == KVQ_OK && w < plan->n_windows; w++) {
        const int32_t *tok = win->tokens + w * plan->ctx;
        kvq_ppl_targets(plan, tok, targets);
        for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++) {
            const kvq_eval_scheme *sc = &schemes[s];
            kvq_scheme_run run;
            kvq_hooks hooks;
            kvq_scheme_hooks(&run, sc, &hooks);
            run.k_counts = results[s].k_counts;
            run.v_counts = results[s].v_counts;
            kvq_prefix px = {0};
            if (sc->prefix) px = (kvq_prefix){.P = sc->prefix->P, .k = sc->prefix->k, .v = sc->prefix->v};
            kvq_fwd_io io = {.tokens = (const int *)tok, .T = (int)plan->ctx, .pos0 = px.P, .targets = targets,
                             .prefix = sc->prefix ? &px : NULL, .hooks = hooks.transform ? &hooks : NULL, .nll = nll};
            kvq_fwd_result r;
            double t0 = kvq_now();
            st = kvq_forward_run(&fw, &io, &r, err);
            results[s].seconds += kvq_now() - t0;
            if (st) {
                kvq_err_prefix(err, "scheme %s, window %zu (stream offset %zu)", sc->name, w, win->offsets[w]);
                break;
            }
            if (r.n_scored != (int)plan->scored_per_window) {
                st = kvq_fail(err, KVQ_EINVAL, "perplexity: scheme %s, window %zu: %d positions scored, expected %zu", sc->name,
                              w, r.n_scored, plan->scored_per_window);
                break;
            }
            double sum = 0;
            for (size_t t = plan->first_scored; t + 1 < plan->ctx; t++) sum += nll[t];
            results[s].nll_sum += sum;
            results[s].n_scored += (uint64_t)r.n_scored;
            results[s].window_nll[w] = sum / r.n_scored;
            results[s].k_counts = run.k_counts;
            results[s].v_counts = run.v_counts;
            results[s].transform_seconds += run.seconds;
            if (prog) kvq_progress_update(prog, ++done);
        }
    }
    for (size_t s = 0; st == KVQ_OK && s < n_schemes; s++)
        results[s].ppl = results[s].n_scored ? exp(results[s].nll_sum / (double)results[s].n_scored) : NAN;
    free(targets);
    free(nll);
    kvq_forward_free(&fw);
    if (st) kvq_ppl_results_free(results, n_schemes);
    return st;
}
