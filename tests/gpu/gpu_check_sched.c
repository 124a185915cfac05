/* gpu_check_sched.c — gpu_check --sched: the attention-importance schedule on the device (kernels/cuda/cuda_sched.cuh,
 * the CUDA forward's path for a schedule with a declarative policy, forward.h kvq_sched_imp) against the CPU oracle
 * kvq_attention_sched with the family's host step, on random q / K / V through the real transforms of hh, mikv and
 * zipcache (GQA groups of 1 to 8, MQA, prefixes, sink tokens, windows, normalised importance, probe queries).
 * Per case:
 *   - switch decisions: the final switch times of every (KV head, token) and the realised counts identical; or, where
 *     they differ, the first differing decision step, its head and tokens, and the margin: the tokens' importances
 *     at that step as the CPU accumulated them (an independent sum of the step's probabilities, importance.h), the
 *     spread relative to the largest; a spread <= SCHED_TIE_REL is a near-tie that a last-ulp difference of the
 *     probabilities decides (the CPU's exp and sum order are not the GPU's), anything wider fails;
 *   - outputs of the query rows up to that step (all rows when the decisions agree): max |GPU - CPU| relative to
 *     max |CPU| <= SCHED_OUT_REL; every output finite (the GPU's output, switch times and counts are poisoned
 *     before each run).
 * Then the time of one SmolLM2-135M-shaped layer (T 2048, 9/3 heads, head_dim 64): the device schedule, the
 * CPU schedule (all cores) and the native fp32 attention kernel (kvq_cuda_attention) at the same shape.
 * The harness (sched_cases_run) takes the device runner as a callback: tests/gpu/emu/emu_sched.cc runs the same
 * cases through the CUDA emulator on the host (make test). */
#include "gpu_check.h"
#include "gpu_check_sched.h"
#include "importance.h"
#include "scheme.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* A step wrapper: the family's step, and an independent accumulation of importance.h's scores (for the margin of
 * a differing decision): s_j += sum over the group's heads of the step's probabilities when query i votes. */
typedef struct {
    kvq_kv_sched inner;
    int T, P;
    double probe;
    bool normalise;
    double *score; /* [nkv][T] */
    int *votes;    /* [T + 1] */
    int watch_i, watch_h, n_watch;
    const int *watch_t;
    double *watch_v;
} sc_wrap;

static kvq_status wrap_step(void *user, const kvq_sched_step *s, kvq_kv_sched *sc, kvq_err *err)
{
    sc_wrap *w = user;
    const int i = s->i, n = s->P + i + 1;
    double *score = w->score + (size_t)s->kv_head * w->T;
    if (w->votes[i + 1] > w->votes[i])
        for (int j = 0; j <= i; j++) {
            double a = 0;
            for (int q = 0; q < s->n_q; q++) a += s->probs[(size_t)q * n + s->P + j];
            score[j] += a;
        }
    if (i == w->watch_i && s->kv_head == w->watch_h)
        for (int x = 0; x < w->n_watch; x++) {
            int t = w->watch_t[x], nv = w->votes[i + 1] - w->votes[t];
            w->watch_v[x] = !w->normalise ? score[t] : nv > 0 ? score[t] / nv : 0.0;
        }
    (void)sc;
    return w->inner.step(w->inner.user, s, &w->inner, err);
}

static double sc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t sc_rng(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}
static void sc_fill(float *x, size_t n, float a, uint64_t *s)
{
    for (size_t i = 0; i < n; i++) x[i] = a * (float)((double)(sc_rng(s) >> 11) / 9007199254740992.0 * 2 - 1);
}

typedef struct {
    const char *name, *family;
    int T, P, nh, nkv, hd, sink, window;
    double x[4];
} sc_case;

/* the transform of the case's scheme on fresh copies of k, v: the schedule in run's state */
static void sc_transform(const sc_case *c, kvq_kv_desc *d, kvq_kv_desc_run *run, const float *k, const float *v, float *kc,
                         float *vc, kvq_kv_sched **out)
{
    kvq_err err = {0};
    size_t n = (size_t)c->T * c->nkv * c->hd;
    memcpy(kc, k, n * sizeof(float));
    memcpy(vc, v, n * sizeof(float));
    kvq_layer_ctx ctx = {0, c->T, c->P, c->P, c->nh, c->nkv, c->hd, NULL, 1};
    kvq_kv_alt alt = {0};
    if (kvq_kv_desc_transform(run, &ctx, kc, vc, &alt, &err)) DIE("%s: transform: %s", c->name, err.msg);
    if (!alt.sched || !alt.sched->imp) DIE("%s: the transform gave no schedule with a declarative policy", c->name);
    (void)d;
    *out = alt.sched;
}

int sched_cases_run(sched_dev_fn dev, void *user, int quick)
{
    const sc_case all[] = {
        {"hh2-25%-w8 GQA 4", "hh", 300, 0, 8, 2, 64, 0, 8, {0.25, 16}},
        {"hh2-10%-w32 sink 4 prefix 5", "hh", 517, 5, 9, 3, 64, 4, 32, {0.1, 8}},
        {"mikv-h8-l2-30%-w16 MHA", "mikv", 400, 3, 4, 4, 128, 0, 16, {0.3, 8, 0}},
        {"zipcache p50% n4 MQA 8", "zipcache", 600, 0, 8, 1, 64, 2, 8, {0.25, 4, 0.5, 4}},
        {"zipcache all-vote n4 GQA 3", "zipcache", 256, 7, 6, 2, 32, 1, 12, {0.2, 8, 0, 4}},
        {"hh tiny window 1", "hh", 70, 0, 2, 1, 16, 0, 1, {0.5, 16}},
    };
    const sc_case qk[] = {
        {"hh2-25%-w8 GQA 4", "hh", 72, 0, 4, 2, 16, 0, 8, {0.25, 16}},
        {"hh2-20%-w4 sink 2 prefix 3", "hh", 61, 3, 6, 2, 8, 2, 4, {0.2, 8}},
        {"mikv-h8-l2-30%-w6 MHA", "mikv", 50, 2, 2, 2, 32, 0, 6, {0.3, 8, 0}},
        {"zipcache p50% n4 MQA 3", "zipcache", 66, 0, 3, 1, 16, 2, 5, {0.25, 4, 0.5, 4}},
        {"zipcache all-vote n4", "zipcache", 48, 4, 4, 2, 8, 1, 3, {0.3, 8, 0, 4}},
    };
    const sc_case *cases = quick ? qk : all;
    const size_t n_cases = quick ? sizeof qk / sizeof *qk : sizeof all / sizeof *all;
    int all_ok = 1, nt = 1;
#ifdef _OPENMP
    nt = omp_get_max_threads();
#endif
    printf("\n### importance schedule on the device vs kvq_attention_sched (random q/K/V through the family transforms)\n\n");
    printf("| case | T | prefix | heads | head_dim | sink | W | decisions | first difference (step, head, tokens, "
           "importance spread) | rows compared | out max rel | counts | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t ci = quick == 2; ci < n_cases; ci += quick == 2 ? 2 : 1) {
        const sc_case *c = &cases[ci];
        kvq_err err = {0};
        const size_t T = c->T, nq = T * c->nh * c->hd, nk = T * c->nkv * c->hd, np = (size_t)c->P * c->nkv * c->hd;
        uint64_t r = 0x9E3779B97F4A7C15ull + ci;
        float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
        float *kc = malloc(nk * sizeof(float)), *vc = malloc(nk * sizeof(float));
        float *pk = np ? malloc(np * sizeof(float)) : NULL, *pv = np ? malloc(np * sizeof(float)) : NULL;
        float *oc = malloc(nq * sizeof(float)), *og = malloc(nq * sizeof(float));
        int *fc = malloc(2 * c->nkv * T * sizeof(int)), *fg = malloc(2 * c->nkv * T * sizeof(int));
        uint64_t cc[4 * 8], cg[4 * 8];
        double *score = calloc((size_t)c->nkv * T, sizeof(double));
        int *votes = malloc((T + 1) * sizeof(int));
        if (!q || !k || !v || !kc || !vc || (np && (!pk || !pv)) || !oc || !og || !fc || !fg || !score || !votes)
            DIE("out of memory");
        /* scores q.k/sqrt(head_dim) with a spread of a few units: rows neither flat nor one-hot */
        sc_fill(q, nq, 2.5f, &r);
        sc_fill(k, nk, 2.5f, &r);
        sc_fill(v, nk, 1.0f, &r);
        if (np) sc_fill(pk, np, 2.5f, &r), sc_fill(pv, np, 1.0f, &r);
        kvq_kv_desc d = {.q = {.fam = KVQ_FAM(c->family), .k_bits = 2, .v_bits = 2, .n_sink = (size_t)c->sink,
                               .residual = (size_t)c->window},
                         .key_stage = KVQ_KEYS_POST_ROPE};
        memcpy(d.q.x, c->x, sizeof c->x);
        char label[96];
        kvq_kv_desc_name(&d, label, sizeof label);
        kvq_kv_desc_run run = {0};
        if (kvq_kv_desc_run_init(&run, &d, &err)) DIE("%s: %s", c->name, err.msg);
        kvq_attn_args a = {.T = c->T, .P = c->P, .n_heads = c->nh, .n_kv_heads = c->nkv, .head_dim = c->hd, .q = q,
                           .pk = pk, .pv = pv, .out = oc};
        /* CPU: the family's steps (through the wrapper) */
        kvq_kv_sched *sc;
        sc_transform(c, &d, &run, k, v, kc, vc, &sc);
        const kvq_sched_imp *im = sc->imp;
        sc_wrap w = {.inner = *sc, .T = c->T, .P = c->P, .probe = im->probe, .normalise = im->normalise, .score = score,
                     .votes = votes, .watch_i = -1};
        votes[0] = 0;
        for (size_t i = 0; i < T; i++) votes[i + 1] = votes[i] + (kvq_imp_is_probe((int)i, im->probe) ? 1 : 0);
        kvq_kv_sched ws = *sc;
        ws.step = wrap_step;
        ws.user = &w;
        double t0 = sc_now();
        if (kvq_attention_sched(&a, &ws, 0, nt, &err)) DIE("%s: CPU schedule: %s", c->name, err.msg);
        double cpu_s = sc_now() - t0;
        memcpy(fc, sc->k_from, 2 * c->nkv * T * sizeof(int));
        memcpy(cc, im->counts, 4 * (size_t)c->nkv * sizeof(uint64_t));
        /* device: a fresh schedule, its outputs poisoned */
        sc_transform(c, &d, &run, k, v, kc, vc, &sc);
        im = sc->imp;
        for (size_t x = 0; x < nq; x++) og[x] = NAN;
        for (size_t x = 0; x < 2 * c->nkv * T; x++) sc->k_from[x] = -7;
        for (int x = 0; x < 4 * c->nkv; x++) im->counts[x] = 0xdeadbeefull;
        kvq_cuda_attn_shape shp = {c->T, c->P, c->nh, c->nkv, c->hd, 0, 0};
        double ms[2] = {0, 0};
        if (dev(user, &shp, q, pk, pv, sc, og, ms, &err)) DIE("%s: device schedule: %s", c->name, err.msg);
        memcpy(fg, sc->k_from, 2 * c->nkv * T * sizeof(int));
        memcpy(cg, im->counts, 4 * (size_t)c->nkv * sizeof(uint64_t));
        /* first differing decision: the earlier switch time of a differing entry, minus one */
        int first = INT32_MAX, fh = -1, nd = 0, dt[8];
        for (int s = 0; s < 2; s++)
            for (int h = 0; h < c->nkv; h++)
                for (size_t j = 0; j < T; j++) {
                    size_t x = ((size_t)s * c->nkv + h) * T + j;
                    if (fc[x] == fg[x]) continue;
                    int st = (fc[x] < fg[x] ? fc[x] : fg[x]) - 1;
                    if (st < first || (st == first && h < fh)) first = st, fh = h;
                }
        int same = first == INT32_MAX;
        double spread = 0;
        char diff[160] = "none";
        if (!same) {
            for (int s = 0; s < 2; s++)
                for (size_t j = 0; j < T && nd < 8; j++) {
                    size_t x = ((size_t)s * c->nkv + fh) * T + j;
                    int st = (fc[x] < fg[x] ? fc[x] : fg[x]) - 1;
                    if (fc[x] != fg[x] && st == first) {
                        int dup = 0;
                        for (int y = 0; y < nd; y++) dup |= dt[y] == (int)j;
                        if (!dup) dt[nd++] = (int)j;
                    }
                }
            /* the margin: the CPU again, watching step `first` of head fh */
            double wv[8] = {0};
            sc_transform(c, &d, &run, k, v, kc, vc, &sc);
            memset(score, 0, (size_t)c->nkv * T * sizeof(double));
            w.inner = *sc;
            w.watch_i = first, w.watch_h = fh, w.n_watch = nd, w.watch_t = dt, w.watch_v = wv;
            ws = *sc;
            ws.step = wrap_step;
            ws.user = &w;
            /* (its outputs overwrite oc with the same values: the CPU schedule is deterministic) */
            if (kvq_attention_sched(&a, &ws, 0, nt, &err)) DIE("%s: CPU schedule (margin): %s", c->name, err.msg);
            double lo = wv[0], hi = wv[0], big = 0;
            for (int y = 0; y < nd; y++) {
                lo = wv[y] < lo ? wv[y] : lo, hi = wv[y] > hi ? wv[y] : hi;
                big = fabs(wv[y]) > big ? fabs(wv[y]) : big;
            }
            spread = big > 0 ? (hi - lo) / big : 0;
            int o = snprintf(diff, sizeof diff, "step %d, head %d, tokens", first, fh);
            for (int y = 0; y < nd && o < (int)sizeof diff - 24; y++) o += snprintf(diff + o, sizeof diff - o, " %d", dt[y]);
            snprintf(diff + o, sizeof diff - o, ", spread %.2e", spread);
        }
        /* outputs of the rows whose schedules agree: 0..first (row i reads decisions of steps < i) */
        const int rows = same ? c->T : first + 1;
        double dmax = 0, omax = 0;
        int finite = 1;
        for (size_t x = 0; x < nq; x++) finite &= isfinite(og[x]) != 0;
        for (size_t x = 0; x < (size_t)rows * c->nh * c->hd; x++) {
            double e = fabs((double)og[x] - oc[x]);
            dmax = e > dmax ? e : dmax;
            omax = fabs(oc[x]) > omax ? fabs(oc[x]) : omax;
        }
        double rel = omax > 0 ? dmax / omax : dmax;
        int counts_ok = !same || !memcmp(cc, cg, 4 * (size_t)c->nkv * sizeof(uint64_t));
        int ok = finite && rel <= SCHED_OUT_REL && counts_ok && (same || spread <= SCHED_TIE_REL);
        printf("| %s (%s) | %d | %d | %d/%d | %d | %d | %d | %s | %s | %d | %.2e | %s | %s |\n", c->name, label, c->T, c->P, c->nh,
               c->nkv, c->hd, c->sink, c->window, same ? "identical" : "differ", diff, rows, rel,
               same ? (counts_ok ? "identical" : "DIFFER") : "(n/a)", ok ? "PASS" : "FAIL");
        if (!finite) printf("  non-finite device outputs (poisoned with NaN before the run: rows left unwritten?)\n");
        if (getenv("KVQ_SCHED_VERBOSE")) printf("  CPU %.3f ms, device %.3f + %.3f ms\n", cpu_s * 1e3, ms[0], ms[1]);
        all_ok &= ok;
        kvq_kv_desc_run_free(&run);
        free(q), free(k), free(v), free(kc), free(vc), free(pk), free(pv), free(oc), free(og), free(fc), free(fg);
        free(score), free(votes);
    }
    printf("\nimportance schedule, device vs CPU: %s (outputs within %.0e of the largest, decisions identical or a "
           "near-tie within %.0e)\n", all_ok ? "PASS" : "FAIL", SCHED_OUT_REL, SCHED_TIE_REL);
    return all_ok;
}

/* ---- the selection form (forward.h kvq_sched_sel: QAQ's rule) ------------------------------------------------- */

/* The CPU step wrapper of a selection-form schedule: before the family's step after query i of head h, the
 * selections query i read (the trace the device writes), and every step's a[i][j] (the group's largest probability,
 * for the distance of a differing decision to its threshold). */
typedef struct {
    kvq_kv_sched inner;
    int T, P, nkv;
    signed char *hist; /* [2][nkv][T + 1][T]: row T = the selections the last step left */
    float *amax;       /* [nkv][T][T] */
} ss_wrap;

static kvq_status ss_step(void *user, const kvq_sched_step *s, kvq_kv_sched *sc, kvq_err *err)
{
    ss_wrap *w = user;
    const int i = s->i, h = s->kv_head, T = w->T, n = s->P + i + 1;
    for (int side = 0; side < 2; side++)
        memcpy(w->hist + (((size_t)side * w->nkv + h) * (T + 1) + i) * T, (side ? w->inner.v_sel : w->inner.k_sel) + (size_t)h * T,
               (size_t)i + 1);
    float *am = w->amax + ((size_t)h * T + i) * T;
    for (int j = 0; j <= i; j++) {
        float a = 0;
        for (int q = 0; q < s->n_q; q++)
            if (s->probs[(size_t)q * n + s->P + j] > a) a = s->probs[(size_t)q * n + s->P + j];
        am[j] = a;
    }
    (void)sc;
    return w->inner.step(w->inner.user, s, &w->inner, err);
}

/* The relative distance of side w's decision for key j of head h at step s to the nearest width threshold of
 * kvq_sched_sel's rule, from the CPU's probabilities; -1 where the decision does not depend on attention (a sink, a
 * young token, a side without attn: a difference there is a bug, not a tie). */
static double ss_margin(const kvq_sched_sel *p, const float *amax, int T, int nkv, int w, int h, int s, int j)
{
    const int N = p->window < T ? p->window : T;
    if (j < p->n_sink || s - j + 1 < N || !p->attn[w]) return -1;
    float a = 0;
    for (int i = s - N + 1; i <= s; i++)
        if (amax[((size_t)h * T + i) * T + j] > a) a = amax[((size_t)h * T + i) * T + j];
    const double lhs = (double)p->range[((size_t)w * T + j) * nkv + h] * (double)a * p->root[s], u = p->unit[((size_t)w * nkv + h) * T + s];
    double m = INFINITY;
    for (int b = p->lo; b < p->lo + p->n_lv - 1; b++) {
        double t = ldexp(u, b), d = fabs(lhs - t) / t;
        m = d < m ? d : m;
    }
    return m;
}

typedef struct {
    const char *name, *spec;
    int T, P, nh, nkv, hd;
} ss_case;

/* the transform of the case's scheme on fresh copies of k, v */
static kvq_kv_sched *ss_transform(const ss_case *c, kvq_kv_desc_run *run, const float *k, const float *v, float *kc, float *vc)
{
    kvq_err err = {0};
    size_t n = (size_t)c->T * c->nkv * c->hd;
    memcpy(kc, k, n * sizeof(float));
    memcpy(vc, v, n * sizeof(float));
    kvq_layer_ctx ctx = {0, c->T, c->P, c->P, c->nh, c->nkv, c->hd, NULL, 1};
    kvq_kv_alt alt = {0};
    if (kvq_kv_desc_transform(run, &ctx, kc, vc, &alt, &err)) DIE("%s: transform: %s", c->name, err.msg);
    if (!alt.sched || !alt.sched->sel || !alt.sched->k_sel) DIE("%s: the transform gave no selection schedule with a declarative step", c->name);
    return alt.sched;
}

int ssel_cases_run(sched_dev_fn dev, void *user, int quick)
{
    /* budgets that spread the widths over the whole range on this data (uniform keys of +-2.5, values of +-1): keys
     * from the cache length alone, values from the attention, widths that fall and rise */
    const ss_case all[] = {
        {"qaq GQA 3, window 5", "qaq-k0.01-v0.002-q60", 600, 0, 9, 3, 64},
        {"qaq sink 4, prefix 7, w3, l2-h6", "qaq-k0.02-v0.004-o2%-w3-l2-h6-q30+sink4", 517, 7, 8, 2, 64},
        {"qaq MHA, w1, l0", "qaq-k0.005-v0.001-w1-l0-q100", 300, 3, 4, 4, 128},
        {"qaq MQA 8, no outliers", "qaq-k0.01-v0.003-o0%-w8-q60+sink1", 400, 0, 8, 1, 32},
    };
    const ss_case qk[] = {
        {"qaq GQA 3, window 5", "qaq-k0.01-v0.002-q60", 64, 0, 6, 2, 16},
        {"qaq sink 2, prefix 3, w3, l2-h6", "qaq-k0.02-v0.004-o2%-w3-l2-h6-q30+sink2", 57, 3, 4, 2, 32},
        {"qaq MHA, w1, l0", "qaq-k0.005-v0.001-w1-l0-q100", 40, 2, 2, 2, 16},
        {"qaq MQA 3, no outliers", "qaq-k0.01-v0.003-o0%-w8-q60+sink1", 50, 0, 3, 1, 8},
    };
    const ss_case *cases = quick ? qk : all;
    const size_t n_cases = quick ? sizeof qk / sizeof *qk : sizeof all / sizeof *all;
    int all_ok = 1, nt = 1;
#ifdef _OPENMP
    nt = omp_get_max_threads();
#endif
    printf("\n### selection schedule (QAQ) on the device vs kvq_attention_sched (random q/K/V through the qaq transform)\n\n");
    printf("| case | T | prefix | heads | head_dim | widths used (keys / values) | rises | decisions | differing (largest distance "
           "to a threshold) | rows compared | out max rel | counts | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t ci = quick == 2; ci < n_cases; ci += quick == 2 ? 2 : 1) {
        const ss_case *c = &cases[ci];
        kvq_err err = {0};
        const size_t T = c->T, nkv = c->nkv, nq = T * c->nh * c->hd, nk = T * nkv * c->hd, np = (size_t)c->P * nkv * c->hd;
        uint64_t r = 0xC2B2AE3D27D4EB4Full + ci;
        float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
        float *kc = malloc(nk * sizeof(float)), *vc = malloc(nk * sizeof(float));
        float *pk = np ? malloc(np * sizeof(float)) : NULL, *pv = np ? malloc(np * sizeof(float)) : NULL;
        float *oc = malloc(nq * sizeof(float)), *og = malloc(nq * sizeof(float)), *amax = malloc(nkv * T * T * sizeof(float));
        signed char *hc = malloc(2 * nkv * (T + 1) * T), *hg = malloc(2 * nkv * (T + 1) * T), *tr = malloc(2 * nkv * T * T);
        uint64_t cc[10 * 8], cg[10 * 8];
        if (!q || !k || !v || !kc || !vc || (np && (!pk || !pv)) || !oc || !og || !amax || !hc || !hg || !tr) DIE("out of memory");
        sc_fill(q, nq, 2.5f, &r);
        sc_fill(k, nk, 2.5f, &r);
        sc_fill(v, nk, 1.0f, &r);
        if (np) sc_fill(pk, np, 2.5f, &r), sc_fill(pv, np, 1.0f, &r);
        kvq_scheme_spec sp;
        if (kvq_scheme_parse(c->spec, &sp, &err)) DIE("%s: %s", c->name, err.msg);
        kvq_kv_desc d = {.q = sp.q, .key_stage = KVQ_KEYS_POST_ROPE};
        char label[96];
        kvq_kv_desc_name(&d, label, sizeof label);
        kvq_kv_desc_run run = {0};
        if (kvq_kv_desc_run_init(&run, &d, &err)) DIE("%s: %s", c->name, err.msg);
        kvq_attn_args a = {.T = c->T, .P = c->P, .n_heads = c->nh, .n_kv_heads = c->nkv, .head_dim = c->hd, .q = q,
                           .pk = pk, .pv = pv, .out = oc};
        /* CPU: the family's steps through the wrapper */
        kvq_kv_sched *sc = ss_transform(c, &run, k, v, kc, vc);
        memset(hc, 0, 2 * nkv * (T + 1) * T);
        ss_wrap w = {.inner = *sc, .T = c->T, .P = c->P, .nkv = c->nkv, .hist = hc, .amax = amax};
        kvq_kv_sched ws = *sc;
        ws.step = ss_step;
        ws.user = &w;
        if (kvq_attention_sched(&a, &ws, 0, nt, &err)) DIE("%s: CPU schedule: %s", c->name, err.msg);
        for (int s2 = 0; s2 < 2; s2++)
            for (size_t h = 0; h < nkv; h++)
                memcpy(hc + ((s2 * nkv + h) * (T + 1) + T) * T, (s2 ? sc->v_sel : sc->k_sel) + h * T, T);
        memcpy(cc, sc->sel->counts, 10 * nkv * sizeof(uint64_t));
        /* widths used and rises (a value's representation above the one it held a step before), over the CPU's trace */
        int used[2][KVQ_KV_MAX_REPS] = {{0}}, nused[2] = {0, 0};
        long rises = 0;
        for (int s2 = 0; s2 < 2; s2++)
            for (size_t h = 0; h < nkv; h++)
                for (size_t i = 0; i <= T; i++)
                    for (size_t j = 0; j < (i < T ? i + 1 : T); j++) {
                        const signed char x = hc[((s2 * nkv + h) * (T + 1) + i) * T + j];
                        if (x >= 0 && x < KVQ_KV_MAX_REPS && !used[s2][(int)x]) used[s2][(int)x] = 1, nused[s2]++;
                        if (i > 0 && j < i && x > hc[((s2 * nkv + h) * (T + 1) + i - 1) * T + j]) rises++;
                    }
        /* device: a fresh schedule, everything it writes poisoned */
        sc = ss_transform(c, &run, k, v, kc, vc);
        kvq_sched_sel *pol = (kvq_sched_sel *)sc->sel; /* the trace is a check's request: the run state's descriptor */
        pol->trace = tr;
        memset(tr, 99, 2 * nkv * T * T);
        memset(sc->k_sel, 99, nkv * T);
        memset(sc->v_sel, 99, nkv * T);
        for (size_t x = 0; x < nq; x++) og[x] = NAN;
        for (size_t x = 0; x < 10 * nkv; x++) pol->counts[x] = 0xdeadbeefull;
        kvq_cuda_attn_shape shp = {c->T, c->P, c->nh, c->nkv, c->hd, 0, 0};
        double ms[2] = {0, 0};
        if (dev(user, &shp, q, pk, pv, sc, og, ms, &err)) DIE("%s: device schedule: %s", c->name, err.msg);
        pol->trace = NULL;
        memcpy(cg, pol->counts, 10 * nkv * sizeof(uint64_t));
        for (int s2 = 0; s2 < 2; s2++)
            for (size_t h = 0; h < nkv; h++) {
                for (size_t i = 0; i < T; i++)
                    memcpy(hg + ((s2 * nkv + h) * (T + 1) + i) * T, tr + ((s2 * nkv + h) * T + i) * T, i + 1);
                memcpy(hg + ((s2 * nkv + h) * (T + 1) + T) * T, (s2 ? sc->v_sel : sc->k_sel) + h * T, T);
            }
        /* every differing decision: a near-tie on the value side, or a failure; worst: the largest distance */
        long ndiff = 0, nbad = 0;
        double worst = -1;
        unsigned char *row_ok = malloc(T);
        if (!row_ok) DIE("out of memory");
        memset(row_ok, 1, T);
        for (int s2 = 0; s2 < 2; s2++)
            for (size_t h = 0; h < nkv; h++)
                for (size_t i = 0; i <= T; i++)
                    for (size_t j = 0; j < (i < T ? i + 1 : T); j++) {
                        const size_t x = ((s2 * nkv + h) * (T + 1) + i) * T + j;
                        if (hc[x] == hg[x]) continue;
                        ndiff++;
                        if (i < T) row_ok[i] = 0;
                        /* the decision of step i - 1 (row T: of step T - 1); row 0 and j == i are never decided */
                        const double m = i > 0 && j < i ? ss_margin(pol, amax, c->T, c->nkv, s2, (int)h, (int)i - 1, (int)j) : -1;
                        if (m > worst) worst = m;
                        if (m < 0 || m > SCHED_TIE_REL) {
                            if (nbad++ < 3)
                                printf("  %s: %s of KV head %zu, key %zu at row %zu: CPU %d, device %d (distance %.2e; -1: a "
                                       "decision that reads no attention)\n", c->name, s2 ? "value" : "key", h, j, i, hc[x], hg[x], m);
                        }
                    }
        /* outputs of the rows that read the same selections */
        double dmax = 0, omax = 0;
        int finite = 1;
        size_t rows = 0;
        for (size_t x = 0; x < nq; x++) finite &= isfinite(og[x]) != 0;
        for (size_t i = 0; i < T; i++) {
            if (!row_ok[i]) continue;
            rows++;
            for (size_t x = i * c->nh * c->hd; x < (i + 1) * c->nh * c->hd; x++) {
                double e = fabs((double)og[x] - oc[x]);
                dmax = e > dmax ? e : dmax;
                omax = fabs(oc[x]) > omax ? fabs(oc[x]) : omax;
            }
        }
        const double rel = omax > 0 ? dmax / omax : dmax;
        const int counts_same = !memcmp(cc, cg, 10 * nkv * sizeof(uint64_t)), counts_ok = counts_same || !row_ok[T - 1];
        /* the case must exercise the rule: more than one width a side and values that rise */
        const int varied = nused[0] > 2 && nused[1] > 2 && rises > 0;
        const int ok = finite && nbad == 0 && rel <= SCHED_OUT_REL && counts_ok && varied;
        char diff[64] = "none";
        if (ndiff) snprintf(diff, sizeof diff, "%ld (%.2e)", ndiff, worst);
        printf("| %s (%s) | %d | %d | %d/%d | %d | %d / %d | %ld | %s | %s | %zu | %.2e | %s | %s |\n", c->name, label, c->T, c->P,
               c->nh, c->nkv, c->hd, nused[0], nused[1], rises, ndiff ? (nbad ? "DIFFER" : "near-ties") : "identical", diff, rows,
               rel, counts_same ? "identical" : counts_ok ? "(n/a)" : "DIFFER", ok ? "PASS" : "FAIL");
        if (!finite) printf("  non-finite device outputs (poisoned with NaN before the run: rows left unwritten?)\n");
        if (!varied) printf("  the case does not exercise the rule (widths used %d / %d, rises %ld)\n", nused[0], nused[1], rises);
        if (getenv("KVQ_SCHED_VERBOSE")) printf("  device %.3f + %.3f ms\n", ms[0], ms[1]);
        all_ok &= ok;
        kvq_kv_desc_run_free(&run);
        free(row_ok);
        free(q), free(k), free(v), free(kc), free(vc), free(pk), free(pv), free(oc), free(og), free(amax), free(hc), free(hg), free(tr);
    }
    printf("\nselection schedule, device vs CPU: %s (the selections every query read and the last step left identical, or a "
           "value width within %.0e of its threshold; outputs of the rows reading the same selections within %.0e; counts)\n",
           all_ok ? "PASS" : "FAIL", SCHED_TIE_REL, SCHED_OUT_REL);
    return all_ok;
}

/* user: int *, 1 = the scores ahead of the policy (KVQ_SCHED_PRESCORE=1, read by kvq_cuda_attention_sched) */
static kvq_status cuda_runner(void *user, const kvq_cuda_attn_shape *s, const float *q, const float *pk, const float *pv,
                              kvq_kv_sched *sc, float *out, double *ms, kvq_err *err)
{
    setenv("KVQ_SCHED_PRESCORE", *(const int *)user ? "1" : "0", 1);
    return kvq_cuda_attention_sched(0, s, q, pk, pv, sc, out, ms, err);
}

int run_sched_check(void)
{
    if (!kvq_cuda_compiled()) {
        printf("\n### importance schedule on the device: needs a CUDA build: FAIL\n");
        return 0;
    }
    const int in_loop = 0, ahead = 1;
    int ok = sched_cases_run(cuda_runner, (void *)&in_loop, 0);
    printf("\n(again with the scores of every representation computed ahead of the policy, KVQ_SCHED_PRESCORE=1)\n");
    ok &= sched_cases_run(cuda_runner, (void *)&ahead, 0);
    ok &= ssel_cases_run(cuda_runner, (void *)&in_loop, 0);
    printf("\n(again with the scores of every key representation computed ahead of the policy, KVQ_SCHED_PRESCORE=1)\n");
    ok &= ssel_cases_run(cuda_runner, (void *)&ahead, 0);
    /* one SmolLM2-135M layer at ctx 2048: device schedule vs CPU schedule vs the native attention (information) */
    printf("\none SmolLM2-135M-shaped layer (T 2048, 9/3 heads, head_dim 64, no prefix):\n\n");
    printf("| scheme | scores | device schedule ms (policy + output kernel) | CPU schedule ms (%d threads) | native fp32 attention ms | "
           "device / native | CPU / device |\n|---|---|---|---|---|---|---|\n",
#ifdef _OPENMP
           omp_get_max_threads()
#else
           1
#endif
    );
    const sc_case lay[] = {
        {"hh2-20%-w32 sink 4", "hh", 2048, 0, 9, 3, 64, 4, 32, {0.2, 16}},
        {"zipcache p10% n32 sink 4", "zipcache", 2048, 0, 9, 3, 64, 4, 32, {0.2, 4, 0.1, 32}},
    };
    for (size_t ci = 0; ci < sizeof lay / sizeof *lay; ci++) {
        const sc_case *c = &lay[ci];
        kvq_err err = {0};
        const size_t T = c->T, nq = T * c->nh * c->hd, nk = T * c->nkv * c->hd;
        uint64_t r = 77 + ci;
        float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
        float *kc = malloc(nk * sizeof(float)), *vc = malloc(nk * sizeof(float)), *o = malloc(nq * sizeof(float));
        if (!q || !k || !v || !kc || !vc || !o) DIE("out of memory");
        sc_fill(q, nq, 2.5f, &r), sc_fill(k, nk, 2.5f, &r), sc_fill(v, nk, 1.0f, &r);
        kvq_kv_desc d = {.q = {.fam = KVQ_FAM(c->family), .k_bits = 2, .v_bits = 2, .n_sink = (size_t)c->sink,
                               .residual = (size_t)c->window},
                         .key_stage = KVQ_KEYS_POST_ROPE};
        memcpy(d.q.x, c->x, sizeof c->x);
        kvq_kv_desc_run run = {0};
        if (kvq_kv_desc_run_init(&run, &d, &err)) DIE("%s: %s", c->name, err.msg);
        kvq_kv_sched *sc;
        double dms[2] = {1e30, 1e30}, dpol[2] = {0, 0}, dout[2] = {0, 0}, tms = 0, cpu_ms = 0;
        for (int pre = 0; pre < 2; pre++)
            for (int rep = 0; rep < 3; rep++) {
                sc_transform(c, &d, &run, k, v, kc, vc, &sc);
                double x[2] = {0, 0};
                kvq_cuda_attn_shape shp = {c->T, 0, c->nh, c->nkv, c->hd, 0, 0};
                if (cuda_runner((void *)(pre ? &ahead : &in_loop), &shp, q, NULL, NULL, sc, o, x, &err))
                    DIE("%s: %s", c->name, err.msg);
                if (x[0] + x[1] < dms[pre]) dms[pre] = x[0] + x[1], dpol[pre] = x[0], dout[pre] = x[1];
            }
        unsetenv("KVQ_SCHED_PRESCORE");
        sc_transform(c, &d, &run, k, v, kc, vc, &sc);
        kvq_attn_args a = {.T = c->T, .n_heads = c->nh, .n_kv_heads = c->nkv, .head_dim = c->hd, .q = q, .out = o};
        int nt = 1;
#ifdef _OPENMP
        nt = omp_get_max_threads();
#endif
        double t0 = sc_now();
        if (kvq_attention_sched(&a, sc, 0, nt, &err)) DIE("%s: %s", c->name, err.msg);
        cpu_ms = (sc_now() - t0) * 1e3;
        kvq_cuda_attn_shape shp = {c->T, 0, c->nh, c->nkv, c->hd, 0, 0};
        if (kvq_cuda_attention(0, &shp, KVQ_CUDA_EXACT, q, kc, vc, NULL, NULL, o, NULL, 5, &tms, &err))
            DIE("native attention: %s", err.msg);
        for (int pre = 0; pre < 2; pre++)
            printf("| %s | %s | %.3f (%.3f + %.3f) | %.1f | %.3f | %.1fx | %.1fx |\n", c->name, pre ? "ahead" : "in the policy",
                   dms[pre], dpol[pre], dout[pre], cpu_ms, tms, dms[pre] / tms, cpu_ms / dms[pre]);
        kvq_kv_desc_run_free(&run);
        free(q), free(k), free(v), free(kc), free(vc), free(o);
    }
    /* QAQ's selection schedule at the same shape (9 key and 9 value representations; a fixed query norm instead of
     * the artifact's table) */
    {
        const ss_case c = {"qaq-k0.0003-v0.03 (-q60)", "qaq-k0.0003-v0.03-q60", 2048, 0, 9, 3, 64};
        kvq_err err = {0};
        const size_t T = c.T, nq = T * c.nh * c.hd, nk = T * c.nkv * c.hd;
        uint64_t r = 99;
        float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
        float *kc = malloc(nk * sizeof(float)), *vc = malloc(nk * sizeof(float)), *o = malloc(nq * sizeof(float));
        if (!q || !k || !v || !kc || !vc || !o) DIE("out of memory");
        sc_fill(q, nq, 2.5f, &r), sc_fill(k, nk, 2.5f, &r), sc_fill(v, nk, 1.0f, &r);
        kvq_scheme_spec sp;
        if (kvq_scheme_parse(c.spec, &sp, &err)) DIE("%s: %s", c.name, err.msg);
        kvq_kv_desc d = {.q = sp.q, .key_stage = KVQ_KEYS_POST_ROPE};
        kvq_kv_desc_run run = {0};
        if (kvq_kv_desc_run_init(&run, &d, &err)) DIE("%s: %s", c.name, err.msg);
        double dms[2] = {1e30, 1e30}, dpol[2] = {0, 0}, dout[2] = {0, 0}, tms = 0, cpu_ms = 0;
        kvq_cuda_attn_shape shp = {c.T, 0, c.nh, c.nkv, c.hd, 0, 0};
        for (int pre = 0; pre < 2; pre++)
            for (int rep = 0; rep < 3; rep++) {
                kvq_kv_sched *sc = ss_transform(&c, &run, k, v, kc, vc);
                double x[2] = {0, 0};
                if (cuda_runner((void *)(pre ? &ahead : &in_loop), &shp, q, NULL, NULL, sc, o, x, &err)) DIE("%s: %s", c.name, err.msg);
                if (x[0] + x[1] < dms[pre]) dms[pre] = x[0] + x[1], dpol[pre] = x[0], dout[pre] = x[1];
            }
        unsetenv("KVQ_SCHED_PRESCORE");
        kvq_kv_sched *sc = ss_transform(&c, &run, k, v, kc, vc);
        kvq_attn_args a = {.T = c.T, .n_heads = c.nh, .n_kv_heads = c.nkv, .head_dim = c.hd, .q = q, .out = o};
        int nt = 1;
#ifdef _OPENMP
        nt = omp_get_max_threads();
#endif
        double t0 = sc_now();
        if (kvq_attention_sched(&a, sc, 0, nt, &err)) DIE("%s: %s", c.name, err.msg);
        cpu_ms = (sc_now() - t0) * 1e3;
        if (kvq_cuda_attention(0, &shp, KVQ_CUDA_EXACT, q, kc, vc, NULL, NULL, o, NULL, 5, &tms, &err))
            DIE("native attention: %s", err.msg);
        for (int pre = 0; pre < 2; pre++)
            printf("| %s | %s | %.3f (%.3f + %.3f) | %.1f | %.3f | %.1fx | %.1fx |\n", c.name, pre ? "ahead" : "in the policy",
                   dms[pre], dpol[pre], dout[pre], cpu_ms, tms, dms[pre] / tms, cpu_ms / dms[pre]);
        kvq_kv_desc_run_free(&run);
        free(q), free(k), free(v), free(kc), free(vc), free(o);
    }
    return ok;
}
