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
    return ok;
}
