/* test_backward_ops.c — per-op gradient checks (kernels/model/ops_backward.h,
 * kernels/model/attention_backward.h). For every op: the float64 build of the
 * backward against central finite differences of an independent float64
 * forward written here (relative L2 ≤ 1e-6 over the whole gradient), then the
 * fp32 build against the float64 gradient (relative L2 ≤ 1e-3). Loss of an op
 * with output y: L = sum(y * r) for a fixed random r, so dL/dy = r. */
#include <math.h>
#include <stdint.h>

#include "attention.h"
#include "attention_backward.h"
#include "kvq_test.h"
#include "ops_backward.h"

typedef struct {
    uint64_t s;
} rng;
static double urand(rng *r) /* uniform in [-1, 1) */
{
    r->s = r->s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(r->s >> 11) / (double)(1ULL << 52) - 1.0;
}
static double *rvec(rng *r, size_t n, double scale)
{
    double *x = malloc((n ? n : 1) * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = scale * urand(r);
    return x;
}
static float *tof(const double *x, size_t n)
{
    float *y = malloc((n ? n : 1) * sizeof *y);
    for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}
static double rel_l2(const double *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}
static double rel_l2_fd(const float *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* Central finite differences of loss(ctx) over every element of x. */
typedef double (*loss_fn)(void *ctx);
static void fd_grad(double *g, double *x, size_t n, loss_fn f, void *ctx, double eps)
{
    for (size_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + eps;
        double lp = f(ctx);
        x[i] = x0 - eps;
        double lm = f(ctx);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * eps);
    }
}

#define FD_EPS 1e-5
#define TOL64 1e-6
#define TOL32 1e-3

/* ---------------- linear ---------------- */
typedef struct {
    int T, in, out;
    double *x, *w, *r;
} lin_ctx;
static double lin_loss(void *p)
{
    lin_ctx *c = p;
    double L = 0;
    for (int t = 0; t < c->T; t++)
        for (int o = 0; o < c->out; o++) {
            double y = 0;
            for (int i = 0; i < c->in; i++) y += c->x[t * c->in + i] * c->w[o * c->in + i];
            L += y * c->r[t * c->out + o];
        }
    return L;
}
START_TEST(test_linear)
{
    rng r = {1};
    lin_ctx c = {.T = 5, .in = 7, .out = 6};
    c.x = rvec(&r, 35, 1);
    c.w = rvec(&r, 42, 1);
    c.r = rvec(&r, 30, 1);
    double g[35], fd[35], g0[35];
    for (int i = 0; i < 35; i++) g[i] = g0[i] = urand(&r);
    fd_grad(fd, c.x, 35, lin_loss, &c, FD_EPS);
    kvq_linear_bwd_f64(g, c.r, c.w, c.T, c.in, c.out, 0);
    double e64 = rel_l2(g, fd, 35);
    kvq_linear_bwd_f64(g0, c.r, c.w, c.T, c.in, c.out, 1); /* beta = 1 accumulates */
    float *xf = tof(g, 35), *rf = tof(c.r, 30), *wf = tof(c.w, 42);
    kvq_linear_bwd(xf, rf, wf, c.T, c.in, c.out, 0);
    double e32 = rel_l2_fd(xf, g, 35);
    fprintf(stderr, "INFO linear: f64 vs FD %.2e, f32 vs f64 %.2e\n", e64, e32);
    ck_assert(e64 <= TOL64);
    ck_assert(e32 <= TOL32);
    rng r2 = {1};
    for (int i = 0; i < 35 + 42 + 30; i++) urand(&r2);
    for (int i = 0; i < 35; i++) ck_assert(fabs(g0[i] - (urand(&r2) + g[i])) < 1e-12);
    free(c.x), free(c.w), free(c.r), free(xf), free(rf), free(wf);
}
END_TEST

/* ---------------- RMSNorm ---------------- */
typedef struct {
    int T, dim;
    double eps, *x, *gw, *r;
} rms_ctx;
static double rms_loss(void *p)
{
    rms_ctx *c = p;
    double L = 0;
    for (int t = 0; t < c->T; t++) {
        double ss = 0;
        for (int i = 0; i < c->dim; i++) ss += c->x[t * c->dim + i] * c->x[t * c->dim + i];
        double s = 1 / sqrt(ss / c->dim + c->eps);
        for (int i = 0; i < c->dim; i++) L += c->x[t * c->dim + i] * s * c->gw[i] * c->r[t * c->dim + i];
    }
    return L;
}
START_TEST(test_rmsnorm)
{
    rng r = {2};
    rms_ctx c = {.T = 4, .dim = 16, .eps = 1e-5};
    size_t n = 64;
    c.x = rvec(&r, n, 2);
    c.gw = rvec(&r, 16, 1.5);
    c.r = rvec(&r, n, 1);
    double g[64], fd[64];
    fd_grad(fd, c.x, n, rms_loss, &c, FD_EPS);
    kvq_rmsnorm_bwd_f64(g, c.r, c.x, c.gw, c.T, c.dim, c.eps, 0);
    double e64 = rel_l2(g, fd, n);
    float *xf = tof(c.x, n), *gf = tof(c.gw, 16), *rf = tof(c.r, n), *df = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) df[i] = 1.0f;
    kvq_rmsnorm_bwd(df, rf, xf, gf, c.T, c.dim, 1e-5f, 1); /* accumulate onto 1 */
    for (size_t i = 0; i < n; i++) df[i] -= 1.0f;
    double e32 = rel_l2_fd(df, g, n);
    fprintf(stderr, "INFO rmsnorm: f64 vs FD %.2e, f32 (accumulating) vs f64 %.2e\n", e64, e32);
    ck_assert(e64 <= TOL64);
    ck_assert(e32 <= TOL32);
    free(c.x), free(c.gw), free(c.r), free(xf), free(gf), free(rf), free(df);
}
END_TEST

/* ---------------- RoPE ---------------- */
typedef struct {
    int T, nh, hd, rd;
    double *x, *ang, *r;
} rope_ctx;
static double rope_loss(void *p)
{
    rope_ctx *c = p;
    double L = 0;
    for (int t = 0; t < c->T; t++)
        for (int h = 0; h < c->nh; h++) {
            const double *v = c->x + (t * c->nh + h) * c->hd;
            const double *rr = c->r + (t * c->nh + h) * c->hd;
            for (int i = 0; i < c->hd; i++) {
                double y = v[i];
                if (i < c->rd) {
                    double a = c->ang[t * (c->rd / 2) + i / 2];
                    y = i % 2 == 0 ? v[i] * cos(a) - v[i + 1] * sin(a) : v[i - 1] * sin(a) + v[i] * cos(a);
                }
                L += y * rr[i];
            }
        }
    return L;
}
START_TEST(test_rope)
{
    rng r = {3};
    rope_ctx c = {.T = 3, .nh = 2, .hd = 8, .rd = 6}; /* partial rotary: channels 6, 7 pass through */
    size_t n = 48, nh = 3 * 3;
    c.x = rvec(&r, n, 1);
    c.r = rvec(&r, n, 1);
    c.ang = malloc(nh * sizeof(double));
    double cs[9], sn[9];
    float csf[9], snf[9];
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 3; i++) {
            c.ang[t * 3 + i] = (5 + t) * pow(10000.0, -2.0 * i / 6);
            cs[t * 3 + i] = cos(c.ang[t * 3 + i]);
            sn[t * 3 + i] = sin(c.ang[t * 3 + i]);
            csf[t * 3 + i] = (float)cs[t * 3 + i];
            snf[t * 3 + i] = (float)sn[t * 3 + i];
        }
    double g[48], fd[48];
    fd_grad(fd, c.x, n, rope_loss, &c, FD_EPS);
    memcpy(g, c.r, sizeof g);
    kvq_rope_bwd_f64(g, c.T, c.nh, c.hd, c.rd, cs, sn);
    double e64 = rel_l2(g, fd, n);
    float *gf = tof(c.r, n);
    kvq_rope_bwd(gf, c.T, c.nh, c.hd, c.rd, csf, snf);
    double e32 = rel_l2_fd(gf, g, n);
    fprintf(stderr, "INFO rope: f64 vs FD %.2e, f32 vs f64 %.2e\n", e64, e32);
    ck_assert(e64 <= TOL64);
    ck_assert(e32 <= TOL32);
    free(c.x), free(c.r), free(c.ang), free(gf);
}
END_TEST

/* ---------------- SwiGLU ---------------- */
typedef struct {
    size_t n;
    double *gu, *r; /* gate then up */
} swi_ctx;
static double swi_loss(void *p)
{
    swi_ctx *c = p;
    double L = 0;
    for (size_t i = 0; i < c->n; i++) {
        double g = c->gu[i];
        L += g / (1 + exp(-g)) * c->gu[c->n + i] * c->r[i];
    }
    return L;
}
START_TEST(test_swiglu)
{
    rng r = {4};
    swi_ctx c = {.n = 40};
    c.gu = rvec(&r, 80, 4);
    c.r = rvec(&r, 40, 1);
    double g[80], fd[80];
    fd_grad(fd, c.gu, 80, swi_loss, &c, FD_EPS);
    kvq_swiglu_bwd_f64(g, g + 40, c.r, c.gu, c.gu + 40, 40);
    double e64 = rel_l2(g, fd, 80);
    float *gf = tof(c.gu, 80), *rf = tof(c.r, 40);
    kvq_swiglu_bwd(gf, gf + 40, rf, gf, gf + 40, 40); /* in place */
    double e32 = rel_l2_fd(gf, g, 80);
    fprintf(stderr, "INFO swiglu: f64 vs FD %.2e, f32 (in place) vs f64 %.2e\n", e64, e32);
    ck_assert(e64 <= TOL64);
    ck_assert(e32 <= TOL32);
    free(c.gu), free(c.r), free(gf), free(rf);
}
END_TEST

/* ---------------- LM head + cross-entropy ---------------- */
typedef struct {
    int T, dim, V;
    const int *tg;
    double *xn, *w, scale;
} xent_ctx;
static double xent_loss(void *p)
{
    xent_ctx *c = p;
    double L = 0;
    double *z = malloc(c->V * sizeof(double));
    for (int t = 0; t < c->T; t++) {
        if (c->tg[t] < 0) continue;
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < c->V; v++) {
            z[v] = 0;
            for (int i = 0; i < c->dim; i++) z[v] += c->xn[t * c->dim + i] * c->w[v * c->dim + i];
            mx = fmax(mx, z[v]);
        }
        for (int v = 0; v < c->V; v++) s += exp(z[v] - mx);
        L += mx + log(s) - z[c->tg[t]];
    }
    free(z);
    return L * c->scale;
}
START_TEST(test_lm_head_xent)
{
    rng r = {5};
    enum { T = 6, DIM = 8, V = 53 };
    int tg[T] = {3, -1, 52, 0, 17, 17};
    xent_ctx c = {.T = T, .dim = DIM, .V = V, .tg = tg, .scale = 1.0 / 5};
    c.xn = rvec(&r, T * DIM, 2);
    c.w = rvec(&r, V * DIM, 1);
    double g[T * DIM], fd[T * DIM], nll[T], z[T * 7], rmax[T], rsum[T], rt[T];
    fd_grad(fd, c.xn, T * DIM, xent_loss, &c, FD_EPS);
    double sum = kvq_lm_head_xent_bwd_f64(g, nll, c.xn, c.w, tg, T, DIM, V, c.scale, 7, z, rmax, rsum, rt);
    double e64 = rel_l2(g, fd, T * DIM);
    ck_assert(fabs(sum * c.scale - xent_loss(&c)) < 1e-12);
    ck_assert(isnan(nll[1]));
    for (int i = 0; i < DIM; i++) ck_assert(g[DIM + i] == 0);
    float *xf = tof(c.xn, T * DIM), *wf = tof(c.w, V * DIM), gf[T * DIM], zf[T * 16], mf[T], tf[T];
    kvq_mat wm = {.data = wf, .type = KVQ_MAT_F32, .rows = V, .cols = DIM, .row_bytes = DIM * sizeof(float)};
    double sf = kvq_lm_head_xent_bwd(gf, NULL, xf, &wm, NULL, tg, T, DIM, V, c.scale, 16, zf, mf, rsum, tf);
    double e32 = rel_l2_fd(gf, g, T * DIM);
    /* one block (v_chunk = V) gives the same */
    double g1[T * DIM], z1[T * V];
    kvq_lm_head_xent_bwd_f64(g1, NULL, c.xn, c.w, tg, T, DIM, V, c.scale, V, z1, rmax, rsum, rt);
    fprintf(stderr, "INFO lm_head_xent: f64 vs FD %.2e, f32 vs f64 %.2e, 1 block vs 8 blocks %.2e\n", e64, e32, rel_l2(g1, g, T * DIM));
    ck_assert(e64 <= TOL64);
    ck_assert(e32 <= TOL32);
    ck_assert(fabs(sf - sum) / sum < 1e-5);
    ck_assert(rel_l2(g1, g, T * DIM) < 1e-12);
    free(c.xn), free(c.w), free(xf), free(wf);
}
END_TEST

/* ---------------- attention ---------------- */
typedef struct {
    int T, P, nh, nkv, hd;
    double *q, *k, *v, *pk, *pv, *kq, *vq, *r; /* kq/vq NULL: no alternative */
    const int *kb, *vb;
    int window, pos0; /* sliding window (0: none): key position > query position - window */
} att_ctx;
/* independent float64 attention forward: explicit scores, softmax, weighted sum */
static double att_loss(void *p)
{
    att_ctx *c = p;
    const int hd = c->hd, nkv = c->nkv, rep = c->nh / nkv, P = c->P;
    double L = 0, *s = malloc((P + c->T) * sizeof(double));
    for (int i = 0; i < c->T; i++)
        for (int h = 0; h < c->nh; h++) {
            int g = h / rep, n = P + i + 1;
            const double *qi = c->q + (i * c->nh + h) * hd;
            double mx = -INFINITY, z = 0;
            for (int j = 0; j < n; j++) {
                const double *kr;
                if (j < P) kr = c->pk + (j * nkv + g) * hd;
                else if (c->kq && j - P < c->kb[i]) kr = c->kq + ((j - P) * nkv + g) * hd;
                else kr = c->k + ((j - P) * nkv + g) * hd;
                double d = 0;
                for (int e = 0; e < hd; e++) d += qi[e] * kr[e];
                s[j] = d / sqrt(hd);
                mx = fmax(mx, s[j]);
            }
            for (int j = 0; j < n; j++) { /* sliding window, by position: prefix key j at j, window key at pos0 + j - P */
                long kp = j < P ? j : (long)c->pos0 + (j - P), qp = (long)c->pos0 + i;
                if (c->window > 0 && qp - kp >= c->window) s[j] = -INFINITY;
            }
            mx = -INFINITY;
            for (int j = 0; j < n; j++) mx = fmax(mx, s[j]);
            for (int j = 0; j < n; j++) z += (s[j] = exp(s[j] - mx));
            for (int e = 0; e < hd; e++) {
                double o = 0;
                for (int j = 0; j < n; j++) {
                    const double *vr;
                    if (j < P) vr = c->pv + (j * nkv + g) * hd;
                    else if (c->vq && j - P < c->vb[i]) vr = c->vq + ((j - P) * nkv + g) * hd;
                    else vr = c->v + ((j - P) * nkv + g) * hd;
                    o += s[j] / z * vr[e];
                }
                L += o * c->r[(i * c->nh + h) * hd + e];
            }
        }
    free(s);
    return L;
}

static void attention_case_w(int T, int P, int with_alt, uint64_t seed, int window)
{
    rng r = {seed};
    const int nh = 4, nkv = 2, hd = 8;
    size_t nq = (size_t)T * nh * hd, nk = (size_t)T * nkv * hd, np = (size_t)P * nkv * hd;
    int kb[200], vb[200];
    for (int i = 0; i < T; i++) {
        kb[i] = i < 3 ? 0 : (i / 3) * 3 - 1; /* non-decreasing, < i+1 */
        vb[i] = i + 1 - (i % 4);             /* sometimes the own value from the alternative */
        if (vb[i] < (i ? vb[i - 1] : 0)) vb[i] = i ? vb[i - 1] : 0;
    }
    att_ctx c = {.T = T, .P = P, .nh = nh, .nkv = nkv, .hd = hd, .window = window, .pos0 = P};
    c.q = rvec(&r, nq, 1.5);
    c.k = rvec(&r, nk, 1.5);
    c.v = rvec(&r, nk, 1);
    c.pk = rvec(&r, np, 1.5);
    c.pv = rvec(&r, np, 1);
    c.r = rvec(&r, nq, 1);
    if (with_alt) {
        c.kq = rvec(&r, nk, 1.5);
        c.vq = rvec(&r, nk, 1);
        c.kb = kb;
        c.vb = vb;
    }
    /* finite differences of every input */
    double *fq = malloc(nq * 8), *fk = malloc(nk * 8), *fv = malloc(nk * 8), *fpk = malloc((np + 1) * 8), *fpv = malloc((np + 1) * 8),
           *fkq = calloc(nk, 8), *fvq = calloc(nk, 8);
    fd_grad(fq, c.q, nq, att_loss, &c, FD_EPS);
    fd_grad(fk, c.k, nk, att_loss, &c, FD_EPS);
    fd_grad(fv, c.v, nk, att_loss, &c, FD_EPS);
    fd_grad(fpk, c.pk, np, att_loss, &c, FD_EPS);
    fd_grad(fpv, c.pv, np, att_loss, &c, FD_EPS);
    if (with_alt) {
        fd_grad(fkq, c.kq, nk, att_loss, &c, FD_EPS);
        fd_grad(fvq, c.vq, nk, att_loss, &c, FD_EPS);
    }
    kvq_err e = {0};
    /* float64 build, separate alternative gradients */
    kvq_attn_grad_ws ws;
    ck_assert_msg(kvq_attn_grad_ws_init(&ws, T + 3, P + 1, nh, nkv, hd, 3, sizeof(double), &e) == KVQ_OK, "%s", e.msg);
    double *out = malloc(nq * 8), *lse = malloc((size_t)nh * T * 8), *dq = malloc(nq * 8), *dk = malloc(nk * 8), *dv = malloc(nk * 8),
           *dpk = malloc((np + 1) * 8), *dpv = malloc((np + 1) * 8), *dkq = malloc(nk * 8), *dvq = malloc(nk * 8);
    kvq_attn_grad_args_f64 a = {.T = T, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .q = c.q, .k = c.k, .v = c.v,
                                .pk = P ? c.pk : NULL, .pv = P ? c.pv : NULL, .kq = c.kq, .kb = with_alt ? kb : NULL, .vq = c.vq,
                                .vb = with_alt ? vb : NULL, .out = out, .lse = lse, .dout = c.r, .dq = dq, .dk = dk, .dv = dv,
                                .dpk = dpk, .dpv = dpv, .dkq = with_alt ? dkq : NULL, .dvq = with_alt ? dvq : NULL,
                                .window = window, .pos0 = P};
    ck_assert_msg(kvq_attn_fwd_lse_f64(&a, &ws, &e) == KVQ_OK, "%s", e.msg);
    /* forward output vs the independent forward: sum(out * r) */
    double Lk = 0;
    for (size_t i = 0; i < nq; i++) Lk += out[i] * c.r[i];
    ck_assert_msg(fabs(Lk - att_loss(&c)) < 1e-12 * (1 + fabs(Lk)), "forward %.15g vs reference %.15g", Lk, att_loss(&c));
    ck_assert_msg(kvq_attn_bwd_f64(&a, &ws, &e) == KVQ_OK, "%s", e.msg);
    double eq = rel_l2(dq, fq, nq), ek = rel_l2(dk, fk, nk), ev = rel_l2(dv, fv, nk);
    double epk = P ? rel_l2(dpk, fpk, np) : 0, epv = P ? rel_l2(dpv, fpv, np) : 0;
    double ekq = with_alt ? rel_l2(dkq, fkq, nk) : 0, evq = with_alt ? rel_l2(dvq, fvq, nk) : 0;
    fprintf(stderr, "INFO attention T=%d P=%d alt=%d window=%d f64 vs FD: dq %.1e dk %.1e dv %.1e dpk %.1e dpv %.1e dkq %.1e dvq %.1e\n", T, P,
            with_alt, window, eq, ek, ev, epk, epv, ekq, evq);
    ck_assert(eq <= TOL64 && ek <= TOL64 && ev <= TOL64 && epk <= TOL64 && epv <= TOL64 && ekq <= TOL64 && evq <= TOL64);
    kvq_attn_grad_ws_free(&ws);

    /* fp32 build; alternatives' gradients folded into dk/dv (straight-through) */
    ck_assert(kvq_attn_grad_ws_init(&ws, T, P, nh, nkv, hd, 2, sizeof(float), &e) == KVQ_OK);
    float *qf = tof(c.q, nq), *kf = tof(c.k, nk), *vf = tof(c.v, nk), *pkf = tof(c.pk, np), *pvf = tof(c.pv, np), *rf = tof(c.r, nq),
          *kqf = with_alt ? tof(c.kq, nk) : NULL, *vqf = with_alt ? tof(c.vq, nk) : NULL;
    float *of = malloc(nq * 4), *lf = malloc((size_t)nh * T * 4), *dqf = malloc(nq * 4), *dkf = malloc(nk * 4), *dvf = malloc(nk * 4),
          *dpkf = malloc((np + 1) * 4), *dpvf = malloc((np + 1) * 4);
    kvq_attn_grad_args af = {.T = T, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .q = qf, .k = kf, .v = vf,
                             .pk = P ? pkf : NULL, .pv = P ? pvf : NULL, .kq = kqf, .kb = with_alt ? kb : NULL, .vq = vqf,
                             .vb = with_alt ? vb : NULL, .out = of, .lse = lf, .dout = rf, .dq = dqf, .dk = dkf, .dv = dvf,
                             .dpk = dpkf, .dpv = dpvf, .window = window, .pos0 = P};
    ck_assert(kvq_attn_fwd_lse(&af, &ws, &e) == KVQ_OK);
    /* the forward kernel (attention.h) gives the same output and lse (the backward pass uses it) */
    {
        kvq_attn_ws fws;
        float *o2 = malloc(nq * 4), *l2 = malloc((size_t)nh * T * 4);
        ck_assert(kvq_attn_ws_init(&fws, T, P, nkv, hd, 2, &e) == KVQ_OK);
        kvq_attn_args fa = {.T = T, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .q = qf, .k = kf, .v = vf, .pk = af.pk,
                            .pv = af.pv, .kq = kqf, .kb = af.kb, .vq = vqf, .vb = af.vb, .out = o2, .lse = l2,
                            .window = window, .pos0 = P};
        ck_assert(kvq_attention(&fa, &fws, &e) == KVQ_OK);
        double max_dl = 0;
        for (int i = 0; i < nh * T; i++) max_dl = fmax(max_dl, fabs((double)l2[i] - lf[i]));
        double eo = kvq_test_rel_l2_f(o2, of, nq);
        fprintf(stderr, "INFO attention T=%d: kvq_attention vs kvq_attn_fwd_lse: out rel L2 %.1e, max |d lse| %.1e\n", T, eo, max_dl);
        ck_assert(eo < 1e-5 && max_dl < 1e-5);
        kvq_attn_ws_free(&fws);
        free(o2), free(l2);
    }
    ck_assert(kvq_attn_bwd(&af, &ws, &e) == KVQ_OK);
    if (with_alt)
        for (size_t i = 0; i < nk; i++) dk[i] += dkq[i], dv[i] += dvq[i];
    double f_q = rel_l2_fd(dqf, dq, nq), f_k = rel_l2_fd(dkf, dk, nk), f_v = rel_l2_fd(dvf, dv, nk);
    double f_pk = P ? rel_l2_fd(dpkf, dpk, np) : 0, f_pv = P ? rel_l2_fd(dpvf, dpv, np) : 0;
    fprintf(stderr, "INFO attention T=%d P=%d alt=%d f32 vs f64: dq %.1e dk(+dkq) %.1e dv(+dvq) %.1e dpk %.1e dpv %.1e\n", T, P, with_alt,
            f_q, f_k, f_v, f_pk, f_pv);
    ck_assert(f_q <= TOL32 && f_k <= TOL32 && f_v <= TOL32 && f_pk <= TOL32 && f_pv <= TOL32);
    /* the kv heads in passes of one (what a large model's workspace does: KVQ_ATTN_BWD_DQP_MAX) give the same bits */
    {
        float *dq1 = malloc(nq * 4), *dk1 = malloc(nk * 4), *dv1 = malloc(nk * 4);
        kvq_attn_grad_args a1 = af;
        a1.dq = dq1, a1.dk = dk1, a1.dv = dv1, a1.dpk = NULL, a1.dpv = NULL;
        int keep = ws.g_chunk;
        ck_assert_int_eq(keep, nkv);
        ws.g_chunk = 1;
        ck_assert(kvq_attn_bwd(&a1, &ws, &e) == KVQ_OK);
        ws.g_chunk = keep;
        ck_assert(memcmp(dq1, dqf, nq * 4) == 0 && memcmp(dk1, dkf, nk * 4) == 0 && memcmp(dv1, dvf, nk * 4) == 0);
        free(dq1), free(dk1), free(dv1);
    }
    /* a malformed boundary is refused */
    if (with_alt) {
        int bad[200];
        memcpy(bad, kb, T * sizeof(int));
        bad[T - 1] = 0;
        af.kb = bad;
        ck_assert(kvq_attn_bwd(&af, &ws, &e) == KVQ_EINVAL);
    }
    kvq_attn_grad_ws_free(&ws);
    free(c.q), free(c.k), free(c.v), free(c.pk), free(c.pv), free(c.r), free(c.kq), free(c.vq);
    free(fq), free(fk), free(fv), free(fpk), free(fpv), free(fkq), free(fvq);
    free(out), free(lse), free(dq), free(dk), free(dv), free(dpk), free(dpv), free(dkq), free(dvq);
    free(qf), free(kf), free(vf), free(pkf), free(pvf), free(rf), free(kqf), free(vqf);
    free(of), free(lf), free(dqf), free(dkf), free(dvf), free(dpkf), free(dpvf);
}

static void attention_case(int T, int P, int with_alt, uint64_t seed) { attention_case_w(T, P, with_alt, seed, 0); }

START_TEST(test_attention_plain) { attention_case(11, 0, 0, 6); }
END_TEST
START_TEST(test_attention_prefix_alt) { attention_case(13, 3, 1, 7); }
END_TEST
/* more keys than one backward block (KVQ_ATTN_BWD_BK = 64): 70 keys, prefix and window sharing block 0 */
START_TEST(test_attention_blocks) { attention_case(40, 30, 1, 8); }
END_TEST
/* Mistral's sliding window (12 positions) over a 30-entry prefix and 40 window keys in two backward
 * blocks: prefix keys leave the window for later queries, window keys too */
START_TEST(test_attention_window) { attention_case_w(40, 30, 1, 9, 12); }
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("backward_ops");
    TCase *tc = tcase_create("ops");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_linear);
    tcase_add_test(tc, test_rmsnorm);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_swiglu);
    tcase_add_test(tc, test_lm_head_xent);
    tcase_add_test(tc, test_attention_plain);
    tcase_add_test(tc, test_attention_prefix_alt);
    tcase_add_test(tc, test_attention_blocks);
    tcase_add_test(tc, test_attention_window);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
