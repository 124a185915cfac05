/* intactkv_train.c — IntactKV prefix calibration (IntactKV_[P] + Cal): Adam on
 * the prefix K/V against the layer-output loss of intactkv.h, gradients from
 * the backward pass (kernels/model/backward.h: upstream gradient on each layer's
 * output, straight-through quantizer, dL/d(prefix K, V)). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backward.h"
#include "device.h"
#include "intactkv.h"
#include "progress.h"

/* Full-precision targets f_l(x) of the windows: cached for all windows when
 * they fit in the budget, else recomputed into one slot per call. */
typedef struct {
    const kvq_model *m;
    kvq_engine *e;         /* borrowed: runs the targets' forward (no hooks), keeps layer inputs */
    kvq_prefix fp;         /* the model's own prefix */
    const int32_t *win;
    size_t n_win, T, per;  /* per = n_layers * T * dim floats per window */
    float *cache;          /* [n_win][n_layers][T][dim] or NULL */
    unsigned char *have;   /* [n_win] cache filled */
    float *slot;           /* [n_layers][T][dim] when not caching */
    float *xbuf;           /* [T][dim]: one layer output of the trained prefix's forward */
    int *tok, *neg;        /* [T] window tokens as int, all -1 targets */
} targets;

static kvq_status targets_init(targets *tg, kvq_engine *e, const kvq_model *m, const kvq_artifact_prefix *fp, const int32_t *win,
                               size_t n_win, size_t T, size_t cache_mib, kvq_err *err)
{
    memset(tg, 0, sizeof *tg);
    tg->m = m;
    tg->e = e;
    tg->fp = kvq_intactkv_view(fp);
    tg->win = win;
    tg->n_win = n_win;
    tg->T = T;
    tg->per = (size_t)m->hp.n_layers * T * (size_t)m->hp.dim;
    size_t total;
    bool cache = !kvq_mul_size(tg->per * sizeof(float), n_win, &total) && total <= cache_mib * ((size_t)1 << 20);
    if (cache) {
        tg->cache = malloc(total);
        tg->have = calloc(n_win, 1);
    }
    if (!tg->cache) tg->slot = malloc(tg->per * sizeof(float));
    tg->xbuf = malloc(T * (size_t)m->hp.dim * sizeof(float));
    tg->tok = malloc(T * sizeof(int));
    tg->neg = malloc(T * sizeof(int));
    if ((!tg->cache && !tg->slot) || (tg->cache && !tg->have) || !tg->xbuf || !tg->tok || !tg->neg) {
        free(tg->cache);
        free(tg->have);
        free(tg->slot);
        free(tg->xbuf);
        free(tg->tok);
        free(tg->neg);
        return kvq_fail(err, KVQ_ENOMEM, "intactkv: cannot allocate the training targets");
    }
    for (size_t t = 0; t < T; t++) tg->neg[t] = -1;
    return KVQ_OK;
}

static void targets_free(targets *tg)
{
    free(tg->xbuf);
    free(tg->cache);
    free(tg->have);
    free(tg->slot);
    free(tg->tok);
    free(tg->neg);
    memset(tg, 0, sizeof *tg);
}

/* Copy the layer outputs l = 0..n_layers-1 of the engine's last run into dst [n_layers][T][dim]. */
static kvq_status copy_outputs(kvq_engine *e, const kvq_model *m, size_t T, float *dst, kvq_err *err)
{
    size_t n = T * (size_t)m->hp.dim;
    for (int l = 0; l < m->hp.n_layers; l++) KVQ_TRY(kvq_engine_layer_input(e, l + 1, dst + (size_t)l * n, err));
    return KVQ_OK;
}

/* Targets of window w: [n_layers][T][dim], valid until the next call. */
static kvq_status targets_get(targets *tg, size_t w, const float **out, kvq_err *err)
{
    if (tg->cache && tg->have[w]) {
        *out = tg->cache + w * tg->per;
        return KVQ_OK;
    }
    const int32_t *x = tg->win + w * tg->T;
    for (size_t t = 0; t < tg->T; t++) tg->tok[t] = x[t];
    kvq_fwd_io io = {.tokens = tg->tok, .T = (int)tg->T, .pos0 = tg->fp.P, .targets = tg->neg, .prefix = tg->fp.P ? &tg->fp : NULL};
    kvq_fwd_result r;
    kvq_status s = kvq_engine_run(tg->e, &io, &r, err);
    float *dst = tg->cache ? tg->cache + w * tg->per : tg->slot;
    if (!s) s = copy_outputs(tg->e, tg->m, tg->T, dst, err);
    if (s) return kvq_err_prefix(err, "intactkv: full-precision targets of window %zu", w);
    if (tg->cache) tg->have[w] = 1;
    *out = dst;
    return KVQ_OK;
}

/* ½ mean((x - t)^2) of one layer, [n] entries. */
static double half_mse(const float *x, const float *t, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - t[i];
        s += d * d;
    }
    return 0.5 * s / (double)n;
}

/* Loss of every window for prefix px under quant (forward only, on tg's engine), mean into *loss. */
static kvq_status loss_all(targets *tg, const kvq_artifact_prefix *px, const kvq_hooks *quant, double *loss, kvq_err *err)
{
    const kvq_model *m = tg->m;
    size_t n = tg->T * (size_t)m->hp.dim;
    kvq_prefix pv = kvq_intactkv_view(px);
    double sum = 0;
    for (size_t w = 0; w < tg->n_win; w++) {
        const float *tgt;
        KVQ_TRY(targets_get(tg, w, &tgt, err));
        const int32_t *x = tg->win + w * tg->T;
        for (size_t t = 0; t < tg->T; t++) tg->tok[t] = x[t];
        kvq_fwd_io io = {.tokens = tg->tok, .T = (int)tg->T, .pos0 = pv.P, .targets = tg->neg, .prefix = pv.P ? &pv : NULL,
                         .hooks = quant};
        kvq_fwd_result r;
        kvq_status s = kvq_engine_run(tg->e, &io, &r, err);
        for (int l = 0; l < m->hp.n_layers && !s; l++) {
            s = kvq_engine_layer_input(tg->e, l + 1, tg->xbuf, err);
            if (!s) sum += half_mse(tg->xbuf, tgt + (size_t)l * n, n);
        }
        if (s) return kvq_err_prefix(err, "intactkv: loss of window %zu", w);
    }
    *loss = sum / (double)tg->n_win;
    if (!isfinite(*loss)) return kvq_fail(err, KVQ_ENUMERIC, "intactkv: loss is not finite (%g)", *loss);
    return KVQ_OK;
}

static kvq_status check_windows(const kvq_model *m, const kvq_artifact_prefix *px, size_t n_win, size_t T, kvq_err *err)
{
    if (n_win == 0) return kvq_fail(err, KVQ_EINVAL, "intactkv: no calibration windows");
    if (T < 1 || px->P + T > (size_t)m->hp.ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: prefix of %zu + window of %zu tokens exceeds the model's context length %d", px->P,
                        T, m->hp.ctx_len);
    return KVQ_OK;
}

kvq_status kvq_intactkv_loss(const kvq_model *m, const kvq_artifact_prefix *fp_prefix, const kvq_artifact_prefix *px,
                             const kvq_hooks *quant, const int32_t *win, size_t n_win, size_t T, double *loss, kvq_err *err)
{
    *loss = NAN;
    KVQ_TRY(check_windows(m, px, n_win, T, err));
    if (fp_prefix->P != px->P)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: target prefix has %zu entries, trained prefix %zu", fp_prefix->P, px->P);
    kvq_engine e;
    KVQ_TRY(kvq_engine_init(&e, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, m, (int)T, (int)px->P, KVQ_FWD_SAVE_LAYER_INPUTS, err));
    targets tg;
    kvq_status s = targets_init(&tg, &e, m, fp_prefix, win, n_win, T, 0, err);
    if (!s) {
        s = loss_all(&tg, px, quant, loss, err);
        targets_free(&tg);
    }
    kvq_engine_free(&e);
    return s;
}

/* ---- training ---------------------------------------------------------------------- */

typedef struct {
    const float *tgt; /* [n_layers][T][dim] */
    size_t n;         /* T * dim */
    double loss;      /* ½ Σ_l mean(...)² of this window */
    float *gk, *gv;   /* [n_layers][P][kv_dim] accumulated gradient */
    size_t per;       /* P * kv_dim */
    float scale;      /* 1 / accum */
} bwd_ctx;

static kvq_status upstream_cb(void *user, const kvq_layer_ctx *ctx, const float *x_out, float *dx_out, kvq_err *err)
{
    (void)err;
    bwd_ctx *c = user;
    const float *t = c->tgt + (size_t)ctx->layer * c->n;
    double s = 0, inv = 1.0 / (double)c->n;
    float finv = (float)inv;
    for (size_t i = 0; i < c->n; i++) {
        float d = x_out[i] - t[i];
        s += (double)d * d;
        dx_out[i] += d * finv;
    }
    c->loss += 0.5 * s * inv;
    return KVQ_OK;
}

static kvq_status grads_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    (void)err;
    bwd_ctx *c = user;
    float *gk = c->gk + (size_t)g->layer * c->per, *gv = c->gv + (size_t)g->layer * c->per;
    for (size_t i = 0; i < c->per; i++) {
        gk[i] += c->scale * g->dpk[i];
        gv[i] += c->scale * g->dpv[i];
    }
    return KVQ_OK;
}

/* Loss and gradient of window w for prefix pv (gradient ADDED, scaled by c->scale, into c->gk / c->gv). */
static kvq_status window_grad(kvq_engine *e, targets *tg, size_t w, const kvq_prefix *pv, const kvq_hooks *quant, int *tok,
                              const int *neg, bwd_ctx *c, kvq_err *err)
{
    KVQ_TRY(targets_get(tg, w, &c->tgt, err));
    const int32_t *x = tg->win + w * tg->T;
    for (size_t t = 0; t < tg->T; t++) tok[t] = x[t];
    c->loss = 0;
    kvq_fwd_io io = {.tokens = tok, .T = (int)tg->T, .pos0 = pv->P, .targets = neg, .prefix = pv, .hooks = quant};
    kvq_bwd_spec spec = {.user = c, .xent = false, .upstream = upstream_cb, .grads = grads_cb};
    kvq_bwd_result r;
    return kvq_engine_backward(e, &io, &spec, &r, err);
}

kvq_status kvq_intactkv_grad(const kvq_model *m, const kvq_artifact_prefix *fp_prefix, const kvq_artifact_prefix *px,
                             const kvq_hooks *quant, const int32_t *win, size_t n_win, size_t T, double *loss, float *gk, float *gv,
                             kvq_err *err)
{
    *loss = NAN;
    KVQ_TRY(check_windows(m, px, n_win, T, err));
    if (fp_prefix->P != px->P)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: target prefix has %zu entries, trained prefix %zu", fp_prefix->P, px->P);
    size_t per = px->P * (size_t)kvq_kv_dim(&m->hp);
    memset(gk, 0, per * (size_t)m->hp.n_layers * sizeof(float));
    memset(gv, 0, per * (size_t)m->hp.n_layers * sizeof(float));
    kvq_engine e;
    KVQ_TRY(kvq_engine_init(&e, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, m, (int)T, (int)px->P, KVQ_ENGINE_BACKWARD, err));
    targets tg;
    int *tok = malloc(T * sizeof *tok);
    kvq_status s = tok ? targets_init(&tg, &e, m, fp_prefix, win, n_win, T, 0, err) : kvq_fail(err, KVQ_ENOMEM, "intactkv: out of memory");
    if (s) {
        free(tok);
        kvq_engine_free(&e);
        return s;
    }
    kvq_prefix pv = kvq_intactkv_view(px);
    double sum = 0;
    for (size_t w = 0; w < n_win && !s; w++) {
        bwd_ctx c = {.n = T * (size_t)m->hp.dim, .gk = gk, .gv = gv, .per = per, .scale = 1.0f / (float)n_win};
        s = window_grad(&e, &tg, w, &pv, quant, tok, tg.neg, &c, err);
        if (s) kvq_err_prefix(err, "intactkv: window %zu", w);
        sum += c.loss;
    }
    if (!s) *loss = sum / (double)n_win;
    free(tok);
    targets_free(&tg);
    kvq_engine_free(&e);
    return s;
}

/* Python random.shuffle (Fisher–Yates from the end with randbelow(i + 1)). */
static void shuffle(kvq_pyrandom *r, size_t *perm, size_t n)
{
    for (size_t i = 0; i < n; i++) perm[i] = i;
    for (size_t i = n; i-- > 1;) {
        size_t j = (size_t)kvq_pyrandom_randint(r, 0, (int64_t)i);
        size_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

kvq_status kvq_intactkv_train(const kvq_model *m, kvq_artifact_prefix *px, const kvq_hooks *quant, const int32_t *win,
                              size_t n_win, size_t T, const kvq_intactkv_train_opts *o, double *loss_curve,
                              double *loss_before, double *loss_after, kvq_err *err)
{
    if (loss_before) *loss_before = NAN;
    if (loss_after) *loss_after = NAN;
    KVQ_TRY(check_windows(m, px, n_win, T, err));
    if (o->steps < 1 || o->accum < 1) return kvq_fail(err, KVQ_EINVAL, "intactkv: steps %zu / accum %zu: expected >= 1", o->steps, o->accum);
    if (!(o->lr > 0) || !(o->eps > 0) || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) || !(o->clip >= 0))
        return kvq_fail(err, KVQ_EINVAL, "intactkv: Adam lr %g, betas (%g, %g), eps %g, clip %g: expected lr, eps > 0, betas in [0, 1), clip >= 0",
                        o->lr, o->beta1, o->beta2, o->eps, o->clip);
    if (px->P < 1) return kvq_fail(err, KVQ_EINVAL, "intactkv: no prefix to train");
    const kvq_hparams *hp = &m->hp;
    size_t per = px->P * (size_t)kvq_kv_dim(hp), np = per * (size_t)hp->n_layers;

    /* the model's own prefix = the targets' prefix (a copy: px changes) */
    kvq_artifact_prefix fp = *px;
    fp.k = malloc(np * sizeof(float));
    fp.v = malloc(np * sizeof(float));
    float *gk = calloc(np, sizeof(float)), *gv = calloc(np, sizeof(float));
    double *mk = calloc(np, sizeof(double)), *mv = calloc(np, sizeof(double)), *vk = calloc(np, sizeof(double)),
           *vv = calloc(np, sizeof(double));
    size_t *perm = malloc(n_win * sizeof *perm);
    int *tok = malloc(T * sizeof *tok), *neg = malloc(T * sizeof *neg);
    kvq_status s = KVQ_OK;
    bool tg_ok = false, e_ok = false;
    targets tg;
    kvq_engine eng;
    kvq_device dev = KVQ_DEVICE_CPU;
    int gpu = 0;
    if (!fp.k || !fp.v || !gk || !gv || !mk || !mv || !vk || !vv || !perm || !tok || !neg) {
        s = kvq_fail(err, KVQ_ENOMEM, "intactkv: cannot allocate the optimizer state (%zu parameters)", 2 * np);
        goto done;
    }
    memcpy(fp.k, px->k, np * sizeof(float));
    memcpy(fp.v, px->v, np * sizeof(float));
    for (size_t t = 0; t < T; t++) neg[t] = -1;
    /* one engine (CPU or GPU) runs the targets, the losses and the backward passes */
    if ((s = kvq_device_parse(o->device ? o->device : "cpu", &dev, &gpu, err))) goto done;
    char note[320];
    if ((s = kvq_engine_init_fallback(&eng, dev, o->device && !strcmp(o->device, "auto"), gpu, KVQ_CUDA_EXACT, m, (int)T, (int)px->P,
                                      KVQ_ENGINE_BACKWARD, note, sizeof note, err)))
        goto done;
    e_ok = true;
    if (o->device_desc) {
        char d[256];
        kvq_engine_describe(&eng, d, sizeof d);
        snprintf(o->device_desc, o->device_desc_len, "%s%s%s%s", d, note[0] ? " (--device auto: " : "", note, note[0] ? ")" : "");
    }
    if ((s = targets_init(&tg, &eng, m, &fp, win, n_win, T, o->target_cache_mib, err))) goto done;
    tg_ok = true;

    double lb;
    if ((s = loss_all(&tg, px, quant, &lb, err))) goto done;
    if (loss_before) *loss_before = lb;

    kvq_pyrandom rng;
    kvq_pyrandom_seed(&rng, o->seed);
    double ts = kvq_now(); /* the steps' clock (the rate and ETA exclude the loss evaluations) */
    size_t k = 0; /* windows visited */
    double b1t = 1, b2t = 1;
    for (size_t step = 1; step <= o->steps; step++) {
        memset(gk, 0, np * sizeof(float));
        memset(gv, 0, np * sizeof(float));
        double step_loss = 0;
        kvq_prefix pv = kvq_intactkv_view(px);
        for (size_t a = 0; a < o->accum; a++, k++) {
            if (k % n_win == 0) shuffle(&rng, perm, n_win);
            size_t w = perm[k % n_win];
            bwd_ctx c = {.n = T * (size_t)hp->dim, .gk = gk, .gv = gv, .per = per, .scale = 1.0f / (float)o->accum};
            if ((s = window_grad(&eng, &tg, w, &pv, quant, tok, neg, &c, err))) {
                kvq_err_prefix(err, "intactkv: step %zu, window %zu", step, w);
                goto done;
            }
            step_loss += c.loss / (double)o->accum;
        }
        double nrm = 0;
        for (size_t i = 0; i < np; i++) nrm += (double)gk[i] * gk[i] + (double)gv[i] * gv[i];
        nrm = sqrt(nrm);
        if (!isfinite(step_loss) || !isfinite(nrm)) {
            s = kvq_fail(err, KVQ_ENUMERIC, "intactkv: step %zu: loss %g, gradient norm %g (not finite)", step, step_loss, nrm);
            goto done;
        }
        double coef = o->clip > 0 && nrm > o->clip ? o->clip / (nrm + 1e-6) : 1.0;
        b1t *= o->beta1;
        b2t *= o->beta2;
        double bc1 = 1 - b1t, bc2 = 1 - b2t;
        for (int which = 0; which < 2; which++) {
            float *p = which ? px->v : px->k, *g = which ? gv : gk;
            double *m1 = which ? mv : mk, *m2 = which ? vv : vk;
            for (size_t i = 0; i < np; i++) {
                double gi = coef * g[i];
                m1[i] = o->beta1 * m1[i] + (1 - o->beta1) * gi;
                m2[i] = o->beta2 * m2[i] + (1 - o->beta2) * gi * gi;
                p[i] = (float)(p[i] - o->lr * (m1[i] / bc1) / (sqrt(m2[i] / bc2) + o->eps));
            }
        }
        if (loss_curve) loss_curve[step - 1] = step_loss;
        if (o->on_step) o->on_step(o->on_step_ctx, step, o->steps, step_loss, nrm, kvq_now() - ts);
    }
    double la;
    if ((s = loss_all(&tg, px, quant, &la, err))) goto done;
    if (loss_after) *loss_after = la;
    s = kvq_intactkv_sync_pre_rope(hp, px, err);
done:
    if (tg_ok) targets_free(&tg);
    if (e_ok) kvq_engine_free(&eng);
    free(fp.k);
    free(fp.v);
    free(gk);
    free(gv);
    free(mk);
    free(mv);
    free(vk);
    free(vv);
    free(perm);
    free(tok);
    free(neg);
    return s;
}
