/* importance.c — the attention-importance mixed-precision schedule (importance.h): the per-key
 * switch times of hh, mikv and zipcache, decided after every query row from the probabilities the
 * simulated cache produced (kvq_kv_sched's step callback). */
#include "importance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    size_t cap_T, H, kvd;
    float *k_hi, *k_lo, *v_hi, *v_lo; /* [cap_T][kvd] */
    int *from;                        /* [2][H][cap_T]: first query reading the high / low representation */
    double *score;                    /* [H][cap_T] accumulated attention */
    int *heavy;                       /* [H][cap_T] important token indices */
    int *n_heavy;                     /* [H] */
    int *votes;                       /* [cap_T + 1]: voting queries among window queries 0..i-1 (prefix sums) */
    uint64_t *cnt;                    /* [H][4]: elements, sink, exact, high of the last query (per head) */
    bool pending;                     /* cnt holds a layer not yet added to the run's counters */
    int T, P, ns, W;
    kvq_imp_policy pol;
    size_t hd;
    kvq_kv_sched sched;
    kvq_sched_imp desc; /* the step's declarative form (a device runs the policy itself) */
} imp_state;

int kvq_imp_capacity(double f, int n) { return (int)floor(f * (double)n + 1e-9); }

bool kvq_imp_is_probe(int i, double frac)
{
    if (frac <= 0) return true;
    uint32_t x = (uint32_t)i * 0x9E3779B9u + 0x7F4A7C15u; /* one murmur3 finaliser round of i */
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return (double)x < frac * 4294967296.0;
}

static void flush_counts(kvq_kv_desc_run *run, imp_state *st)
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

static void free_bufs(imp_state *st)
{
    free(st->k_hi);
    free(st->k_lo);
    free(st->v_hi);
    free(st->v_lo);
    free(st->from);
    free(st->score);
    free(st->heavy);
    free(st->n_heavy);
    free(st->votes);
    free(st->cnt);
}

void kvq_imp_run_free(kvq_kv_desc_run *run)
{
    imp_state *st = run->state;
    if (!st) return;
    flush_counts(run, st);
    free_bufs(st);
    free(st);
    run->state = NULL;
}

/* importance of token t at step i (after query i's votes) */
static inline double importance(const imp_state *st, const double *score, int t, int i)
{
    if (!st->pol.normalise) return score[t];
    int n = st->votes[i + 1] - st->votes[t];
    return n > 0 ? score[t] / (double)n : 0.0;
}

static kvq_status step_imp(void *user, const kvq_sched_step *s, kvq_kv_sched *sc, kvq_err *err)
{
    (void)sc;
    (void)err;
    imp_state *st = user;
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
    if (st->votes[i + 1] > st->votes[i]) /* query i votes */
        for (int j = 0; j <= i; j++) {
            double a = 0;
            for (int q = 0; q < s->n_q; q++) a += s->probs[(size_t)q * n + s->P + j];
            score[j] += a;
        }
    const int e = i + 1 - st->W;
    if (e < st->ns || e < 0) return KVQ_OK;
    int *heavy = st->heavy + (size_t)h * T, *nh = &st->n_heavy[h];
    if (*nh < kvq_imp_capacity(st->pol.budget, i + 2)) {
        heavy[(*nh)++] = e;
        f_hi[e] = i + 1;
        return KVQ_OK;
    }
    int m = -1, mk = e; /* slot of the minimum, its token */
    double mv = importance(st, score, e, i);
    for (int k = 0; k < *nh; k++) {
        int t = heavy[k];
        double v = importance(st, score, t, i);
        if (v < mv || (v == mv && t < mk)) {
            m = k;
            mk = t;
            mv = v;
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

static kvq_status grow(imp_state *st, size_t T, size_t H, size_t kvd, kvq_err *err)
{
    if (st->cap_T >= T && st->H == H && st->kvd == kvd) return KVQ_OK;
    size_t n = T * kvd;
    imp_state b = {0};
    b.k_hi = malloc(n * sizeof(float));
    b.k_lo = malloc(n * sizeof(float));
    b.v_hi = malloc(n * sizeof(float));
    b.v_lo = malloc(n * sizeof(float));
    b.from = malloc(2 * H * T * sizeof(int));
    b.heavy = malloc(H * T * sizeof(int));
    b.n_heavy = malloc(H * sizeof(int));
    b.votes = malloc((T + 1) * sizeof(int));
    b.score = malloc(H * T * sizeof(double));
    b.cnt = calloc(4 * H, sizeof(uint64_t));
    if (!b.k_hi || !b.k_lo || !b.v_hi || !b.v_lo || !b.from || !b.heavy || !b.n_heavy || !b.votes || !b.score || !b.cnt) {
        free_bufs(&b);
        return kvq_fail(err, KVQ_ENOMEM, "importance schedule: cannot allocate the cache simulation for %zu tokens x %zu channels",
                        T, kvd);
    }
    free_bufs(st);
    st->k_hi = b.k_hi;
    st->k_lo = b.k_lo;
    st->v_hi = b.v_hi;
    st->v_lo = b.v_lo;
    st->from = b.from;
    st->heavy = b.heavy;
    st->n_heavy = b.n_heavy;
    st->votes = b.votes;
    st->score = b.score;
    st->cnt = b.cnt;
    st->cap_T = T;
    st->H = H;
    st->kvd = kvd;
    return KVQ_OK;
}

kvq_status kvq_imp_transform(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                             const kvq_imp_policy *pol, kvq_imp_reps_fn reps, kvq_err *err)
{
    const kvq_scheme *q = &run->d->q;
    size_t T = (size_t)c->T, H = (size_t)c->n_kv_heads, hd = (size_t)c->head_dim, kvd = H * hd;
    imp_state *st = run->state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st) return kvq_fail(err, KVQ_ENOMEM, "importance schedule: out of memory");
        run->state = st;
    }
    flush_counts(run, st); /* the previous layer's resting cache */
    KVQ_TRY(grow(st, T, H, kvd, err));
    KVQ_TRY(reps(run->d, c, k, v, st->k_hi, st->k_lo, st->v_hi, st->v_lo, err));
    st->T = (int)T;
    st->P = c->P;
    st->ns = (int)(q->n_sink < T ? q->n_sink : T);
    st->W = (int)(pol->window < T ? pol->window : T);
    st->pol = *pol;
    st->hd = hd;
    st->votes[0] = 0;
    for (size_t i = 0; i < T; i++) st->votes[i + 1] = st->votes[i] + (kvq_imp_is_probe((int)i, pol->probe) ? 1 : 0);
    for (size_t x = 0; x < 2 * H * T; x++) st->from[x] = (int)T; /* T: never, within this window */
    memset(st->score, 0, H * T * sizeof(double));
    memset(st->n_heavy, 0, H * sizeof(int));
    memset(st->cnt, 0, 4 * H * sizeof(uint64_t));
    st->pending = true;
    st->desc = (kvq_sched_imp){.budget = pol->budget, .window = st->W, .n_sink = st->ns, .normalise = pol->normalise,
                               .probe = pol->probe, .counts = st->cnt};
    st->sched = (kvq_kv_sched){.n_k = 3, .n_v = 3, .k = {k, st->k_hi, st->k_lo}, .v = {v, st->v_hi, st->v_lo},
                               .k_from = st->from, .v_from = st->from, .step = step_imp, .user = st, .imp = &st->desc};
    alt->sched = &st->sched;
    return KVQ_OK;
}

kvq_status kvq_imp_bits(const kvq_scheme *q, const kvq_imp_policy *pol, const kvq_imp_cost *k, const kvq_imp_cost *v,
                        const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (in->ctx == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx: expected > 0, found 0");
    size_t ctx = in->ctx, ns = q->n_sink < ctx ? q->n_sink : ctx, win = ctx - ns < pol->window ? ctx - ns : pol->window;
    size_t rest = ctx - ns - win, heavy = (size_t)kvq_imp_capacity(pol->budget, (int)ctx);
    if (heavy > rest) heavy = rest;
    for (int w = 0; w < 2; w++) {
        const kvq_quant_counts *c = w ? in->v : in->k;
        const kvq_imp_cost *x = w ? v : k;
        double fe = (double)(ns + win) / (double)ctx, fh = (double)heavy / (double)ctx;
        if (c && c->n_elems > c->n_sink + c->n_exact)
            fh = (double)c->n_high / (double)(c->n_elems - c->n_sink - c->n_exact) * (double)rest / (double)ctx;
        double b = fe * 16.0 + fh * x->hi + (1.0 - fe - fh) * x->lo + x->fixed;
        if (w) out->v = b;
        else out->k = b;
    }
    return KVQ_OK;
}

void kvq_imp_resting(const kvq_scheme *q, size_t T, size_t kvd, size_t *lo_first, size_t *lo_n, kvq_quant_counts *c)
{
    size_t ns = q->n_sink < T ? q->n_sink : T, w = T - ns < q->residual ? T - ns : q->residual, lo = T - w;
    *lo_first = ns;
    *lo_n = lo > ns ? lo - ns : 0;
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
        c->n_exact += w * kvd;
    }
}
