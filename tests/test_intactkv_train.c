/* test_intactkv_train.c — IntactKV prefix calibration (calib/intactkv.h,
 * issue 9) on the tiny llama2.c models:
 *  - the loss is 0 for the model's own prefix without quantization and > 0
 *    with a quantizing transform or a perturbed prefix;
 *  - prefix gradients (kvq_intactkv_grad, from the backward pass) agree with
 *    central finite differences of kvq_intactkv_loss: all layers without a
 *    transform, and the last layer's prefix with a quantizer on the window
 *    (where the straight-through estimator is not involved);
 *  - a few Adam steps reduce the loss; clipping bounds the first update;
 *    bad options are refused.
 */
#include <math.h>
#include <stdint.h>

#include "artifact.h"
#include "forward.h"
#include "intactkv.h"
#include "kvq_test.h"
#include "model.h"
#include "quant.h"

static const char *const tiny_models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};

static void make_tokens(int32_t *tok, size_t n, int V, uint32_t seed)
{
    uint32_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        tok[i] = 1 + (int32_t)((s >> 8) % (uint32_t)(V - 1));
    }
}

/* int2 per-token K and V (whole token): a coarse, deterministic quantizer. */
static kvq_status int2_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)user, (void)alt;
    size_t kvd = (size_t)c->n_kv_heads * c->head_dim;
    KVQ_TRY(kvq_quant_int_token(k, k, (size_t)c->T, kvd, (size_t)c->head_dim, 2, 0, NULL, err));
    return kvq_quant_int_token(v, v, (size_t)c->T, kvd, (size_t)c->head_dim, 2, 0, NULL, err);
}

typedef struct {
    kvq_model m;
    kvq_artifact_prefix fp; /* the model's own prefix */
    int32_t win[4 * 48];
    size_t n_win, T, np;
} fixture;

static bool fixture_make(fixture *f, int which, size_t P, size_t n_win, size_t T)
{
    char path[4096];
    if (!kvq_test_shared(path, sizeof path, tiny_models[which])) return false;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &f->m, &e) == KVQ_OK, "%s", e.msg);
    int32_t ids[16];
    make_tokens(ids, P, f->m.hp.vocab_size, 99);
    ids[0] = 1; /* BOS first, as a real prefix */
    ck_assert_msg(kvq_intactkv_compute(&f->m, ids, P, "p", false, &f->fp, &e) == KVQ_OK, "%s", e.msg);
    f->n_win = n_win;
    f->T = T;
    make_tokens(f->win, n_win * T, f->m.hp.vocab_size, 4242);
    f->np = (size_t)f->m.hp.n_layers * P * kvq_kv_dim(&f->m.hp);
    return true;
}

static void fixture_free(fixture *f)
{
    kvq_artifact_prefix_free(&f->fp);
    kvq_model_free(&f->m);
}

/* A copy of the model's prefix with its K/V perturbed (deterministic). */
static void perturbed(const fixture *f, kvq_artifact_prefix *px, float amount)
{
    *px = f->fp;
    px->k = malloc(f->np * sizeof(float));
    px->v = malloc(f->np * sizeof(float));
    uint32_t s = 1;
    for (size_t i = 0; i < f->np; i++) {
        s = s * 1664525u + 1013904223u;
        float r = ((float)(s >> 8) / 16777216.0f - 0.5f) * 2 * amount;
        px->k[i] = f->fp.k[i] + r;
        px->v[i] = f->fp.v[i] - r;
    }
}

START_TEST(test_loss_zero_and_positive)
{
    fixture f;
    KVQ_SKIP_IF(!fixture_make(&f, _i, 2, 2, 24), "tiny llama2.c model absent");
    kvq_err e = {0};
    double l0, lq;
    ck_assert_msg(kvq_intactkv_loss(&f.m, &f.fp, &f.fp, NULL, f.win, f.n_win, f.T, &l0, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(l0 == 0.0, "own prefix, no quantization: loss %.3e", l0);
    kvq_hooks q = {.transform = int2_transform, .key_stage = KVQ_KEYS_POST_ROPE};
    ck_assert_msg(kvq_intactkv_loss(&f.m, &f.fp, &f.fp, &q, f.win, f.n_win, f.T, &lq, &e) == KVQ_OK, "%s", e.msg);
    fprintf(stderr, "INFO %s: loss with int2 window K/V %.6g\n", tiny_models[_i], lq);
    ck_assert(lq > 1e-4 && isfinite(lq));
    /* the gradient of the exact-zero loss is zero */
    float *gk = malloc(f.np * 4), *gv = malloc(f.np * 4);
    double lg;
    ck_assert_msg(kvq_intactkv_grad(&f.m, &f.fp, &f.fp, NULL, f.win, f.n_win, f.T, &lg, gk, gv, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(lg == 0.0);
    for (size_t i = 0; i < f.np; i++) ck_assert(gk[i] == 0 && gv[i] == 0);
    /* bad: prefix + window beyond the context */
    ck_assert_int_eq(kvq_intactkv_loss(&f.m, &f.fp, &f.fp, NULL, f.win, 1, (size_t)f.m.hp.ctx_len, &lg, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "context length"), "%s", e.msg);
    free(gk);
    free(gv);
    fixture_free(&f);
}
END_TEST

/* <g, d> vs (L(p + h d) - L(p - h d)) / 2h over the parameters selected by [lo, hi) of each of K and V. */
static void fd_check(fixture *f, kvq_artifact_prefix *px, const kvq_hooks *q, size_t lo, size_t hi, const char *what)
{
    kvq_err e = {0};
    float *gk = malloc(f->np * 4), *gv = malloc(f->np * 4), *dk = calloc(f->np, 4), *dv = calloc(f->np, 4);
    float *k0 = malloc(f->np * 4), *v0 = malloc(f->np * 4);
    memcpy(k0, px->k, f->np * 4);
    memcpy(v0, px->v, f->np * 4);
    double L;
    ck_assert_msg(kvq_intactkv_grad(&f->m, &f->fp, px, q, f->win, f->n_win, f->T, &L, gk, gv, &e) == KVQ_OK, "%s", e.msg);
    double Ll;
    ck_assert(kvq_intactkv_loss(&f->m, &f->fp, px, q, f->win, f->n_win, f->T, &Ll, &e) == KVQ_OK);
    ck_assert_msg(fabs(L - Ll) <= 1e-9 + 1e-6 * Ll, "backward loss %.9g vs forward loss %.9g", L, Ll);
    /* direction: the gradient itself on the selection, unit norm (so <g, d> = |g| is
     * well above the float32 noise of the loss differences) */
    double nrm = 0, gd = 0;
    for (size_t i = lo; i < hi; i++) nrm += (double)gk[i] * gk[i] + (double)gv[i] * gv[i];
    nrm = sqrt(nrm);
    ck_assert_msg(nrm > 0, "%s: zero gradient", what);
    for (size_t i = lo; i < hi; i++) {
        dk[i] = (float)(gk[i] / nrm);
        dv[i] = (float)(gv[i] / nrm);
        gd += (double)gk[i] * dk[i] + (double)gv[i] * dv[i];
    }
    double best = INFINITY, fd_best = 0, hs[3] = {3e-2, 1e-2, 3e-3};
    for (int j = 0; j < 3; j++) {
        double h = hs[j], Lp, Lm;
        for (size_t i = 0; i < f->np; i++) {
            px->k[i] = (float)(k0[i] + h * dk[i]);
            px->v[i] = (float)(v0[i] + h * dv[i]);
        }
        ck_assert(kvq_intactkv_loss(&f->m, &f->fp, px, q, f->win, f->n_win, f->T, &Lp, &e) == KVQ_OK);
        for (size_t i = 0; i < f->np; i++) {
            px->k[i] = (float)(k0[i] - h * dk[i]);
            px->v[i] = (float)(v0[i] - h * dv[i]);
        }
        ck_assert(kvq_intactkv_loss(&f->m, &f->fp, px, q, f->win, f->n_win, f->T, &Lm, &e) == KVQ_OK);
        double fd = (Lp - Lm) / (2 * h), rel = fabs(fd - gd) / fmax(fabs(gd), 1e-12);
        if (rel < best) best = rel, fd_best = fd;
    }
    memcpy(px->k, k0, f->np * 4);
    memcpy(px->v, v0, f->np * 4);
    fprintf(stderr, "INFO %s: loss %.6g, directional derivative backward %.6e, finite difference %.6e (rel err %.2e)\n", what, L,
            gd, fd_best, best);
    ck_assert_msg(fabs(gd) > 1e-8, "%s: zero directional derivative", what);
    ck_assert_msg(best < 1e-3, "%s: backward %.6e vs finite difference %.6e (rel %.3e)", what, gd, fd_best, best);
    free(gk);
    free(gv);
    free(dk);
    free(dv);
    free(k0);
    free(v0);
}

START_TEST(test_grad_fd)
{
    fixture f;
    KVQ_SKIP_IF(!fixture_make(&f, _i, 3, 2, 20), "tiny llama2.c model absent");
    kvq_artifact_prefix px;
    perturbed(&f, &px, 0.5f);
    char what[128];
    snprintf(what, sizeof what, "%s, all layers, no quantizer", tiny_models[_i]);
    fd_check(&f, &px, NULL, 0, f.np, what);
    /* with int2 on the window K/V: the last layer's prefix gradient is exact
     * (nothing after it goes through the straight-through estimator) */
    kvq_hooks q = {.transform = int2_transform, .key_stage = KVQ_KEYS_POST_ROPE};
    size_t per = f.np / (size_t)f.m.hp.n_layers;
    snprintf(what, sizeof what, "%s, last layer, int2 window", tiny_models[_i]);
    fd_check(&f, &px, &q, f.np - per, f.np, what);
    free(px.k);
    free(px.v);
    fixture_free(&f);
}
END_TEST

typedef struct {
    size_t calls;
    double first_norm;
} step_log;

static void on_step(void *ctx, size_t step, size_t steps, double loss, double gnorm, double seconds)
{
    (void)steps, (void)loss, (void)seconds;
    step_log *l = ctx;
    l->calls++;
    if (step == 1) l->first_norm = gnorm;
}

START_TEST(test_train_reduces_loss)
{
    fixture f;
    KVQ_SKIP_IF(!fixture_make(&f, _i, 2, 4, 32), "tiny llama2.c model absent");
    kvq_err e = {0};
    kvq_hooks q = {.transform = int2_transform, .key_stage = KVQ_KEYS_POST_ROPE};
    kvq_artifact_prefix px = f.fp;
    px.k = malloc(f.np * 4);
    px.v = malloc(f.np * 4);
    px.k_pre = malloc(f.np * 4);
    memcpy(px.k, f.fp.k, f.np * 4);
    memcpy(px.v, f.fp.v, f.np * 4);
    memcpy(px.k_pre, f.fp.k_pre, f.np * 4);
    kvq_intactkv_train_opts o = kvq_intactkv_train_defaults();
    o.steps = 12;
    o.accum = 2;
    o.lr = 2e-2;
    o.clip = 0.3;
    step_log lg = {0};
    o.on_step = on_step;
    o.on_step_ctx = &lg;
    double curve[12], before, after;
    ck_assert_msg(kvq_intactkv_train(&f.m, &px, &q, f.win, f.n_win, f.T, &o, curve, &before, &after, &e) == KVQ_OK, "%s", e.msg);
    fprintf(stderr, "INFO %s: training loss %.6g -> %.6g; steps %.6g %.6g ... %.6g; first |grad| %.3g\n", tiny_models[_i], before,
            after, curve[0], curve[1], curve[11], lg.first_norm);
    ck_assert_uint_eq(lg.calls, 12);
    double ref;
    ck_assert(kvq_intactkv_loss(&f.m, &f.fp, &f.fp, &q, f.win, f.n_win, f.T, &ref, &e) == KVQ_OK);
    ck_assert_msg(fabs(before - ref) <= 1e-12 * ref, "loss before %.9g, forward %.9g", before, ref);
    ck_assert_msg(after < 0.97 * before, "training did not reduce the loss: %.6g -> %.6g", before, after);
    double tail = (curve[9] + curve[10] + curve[11]) / 3, head = (curve[0] + curve[1] + curve[2]) / 3;
    ck_assert_msg(tail < head, "loss curve did not fall: first steps %.6g, last steps %.6g", head, tail);
    /* the trained pre-RoPE keys follow the trained post-RoPE keys */
    float *kp = malloc(f.np * 4);
    memcpy(kp, px.k_pre, f.np * 4);
    ck_assert(kvq_intactkv_sync_pre_rope(&f.m.hp, &px, &e) == KVQ_OK);
    ck_assert(memcmp(kp, px.k_pre, f.np * 4) == 0);
    ck_assert(memcmp(px.k, f.fp.k, f.np * 4) != 0);
    /* Adam's first step moves every parameter by at most lr (|m̂/sqrt(v̂)| <= 1) */
    kvq_artifact_prefix p1 = f.fp;
    p1.k = malloc(f.np * 4);
    p1.v = malloc(f.np * 4);
    p1.k_pre = malloc(f.np * 4);
    memcpy(p1.k, f.fp.k, f.np * 4);
    memcpy(p1.v, f.fp.v, f.np * 4);
    o.steps = 1;
    o.on_step = NULL;
    ck_assert(kvq_intactkv_train(&f.m, &p1, &q, f.win, f.n_win, f.T, &o, curve, NULL, NULL, &e) == KVQ_OK);
    double mx = 0;
    for (size_t i = 0; i < f.np; i++)
        mx = fmax(mx, fmax(fabs((double)p1.k[i] - f.fp.k[i]), fabs((double)p1.v[i] - f.fp.v[i])));
    ck_assert_msg(mx <= o.lr * 1.0001 && mx > 0.5 * o.lr, "first Adam step moved a parameter by %.4g (lr %.4g)", mx, o.lr);
    /* bad options */
    o.steps = 0;
    ck_assert_int_eq(kvq_intactkv_train(&f.m, &p1, &q, f.win, f.n_win, f.T, &o, curve, NULL, NULL, &e), KVQ_EINVAL);
    o.steps = 1;
    o.lr = -1;
    ck_assert_int_eq(kvq_intactkv_train(&f.m, &p1, &q, f.win, f.n_win, f.T, &o, curve, NULL, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "lr"), "%s", e.msg);
    o.lr = 1e-3;
    ck_assert_int_eq(kvq_intactkv_train(&f.m, &p1, &q, f.win, 0, f.T, &o, curve, NULL, NULL, &e), KVQ_EINVAL);
    free(kp);
    free(p1.k);
    free(p1.v);
    free(p1.k_pre);
    free(px.k);
    free(px.v);
    free(px.k_pre);
    fixture_free(&f);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("intactkv_train");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, test_loss_zero_and_positive, 0, 2);
    tcase_add_loop_test(tc, test_grad_fd, 0, 2);
    tcase_add_loop_test(tc, test_train_reduces_loss, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
