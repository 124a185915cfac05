/* test_backward.c — whole-model gradients (kernels/model/backward.h) on the tiny
 * llama2.c models (stories260K: GQA 8/4 heads; aidreams260K) and the default
 * model:
 *  - directional derivatives of the loss along random directions in every
 *    layer's pre-RoPE K and V (perturbation injected by a transform hook that
 *    adds eps*direction, whose derivative is the identity), and in the prefix
 *    K/V, against central finite differences of the fp32 forward (Richardson-
 *    extrapolated), ≤ 1e-3 relative;
 *  - the upstream (layer-output) loss entry point on ½ Σ_l ||x_l − ref_l||²;
 *  - straight-through: with a quantizing transform the gradient w.r.t. the
 *    model's K/V equals the exact gradient w.r.t. the dequantized K/V;
 *  - dL/dV of layers 0 and 29 of SmolLM2-135M (128 tokens) against a JAX
 *    autograd fixture (tests/scripts/ref_grad_jax.py), relative L2 ≤ 1e-3;
 *  - the same directional checks, plus the input embeddings, on the model
 *    families of tests/test_families.c: Qwen2 (biases), Qwen3 (q/k norms,
 *    decoupled head_dim), Mistral (sliding window 8 with a prefix), Llama-3.1
 *    and YaRN RoPE. */
#include <math.h>
#include <stdint.h>

#include "backward.h"
#include "device.h"
#include "kv_desc.h"
#include "forward.h"
#include "kvq_test.h"
#include "model.h"
#include "ops.h"

typedef struct {
    uint64_t s;
} rng;
static double urand(rng *r)
{
    r->s = r->s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(r->s >> 11) / (double)(1ULL << 52) - 1.0;
}

/* in-distribution tokens: those of the forward fixture (tests/fixtures/fwd_<name>.bin) */
static void fixture_tokens(const char *name, int *tok, int n)
{
    char path[256];
    snprintf(path, sizeof path, "tests/fixtures/fwd_%s.bin", name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f, "%s missing", path);
    int32_t h[5];
    ck_assert(fseek(f, 8, SEEK_SET) == 0 && fread(h, sizeof h, 1, f) == 1 && h[1] >= n);
    ck_assert(fread(tok, sizeof(int), n, f) == (size_t)n);
    fclose(f);
}

static int load_tiny(const char *name, kvq_model *m)
{
    char buf[4096], rel[128];
    snprintf(rel, sizeof rel, "models/llama2c/%s.bin", name);
    const char *p = kvq_test_shared(buf, sizeof buf, rel);
    if (!p) return 0;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, m, &e) == KVQ_OK, "%s", e.msg);
    return 1;
}

/* ---- perturbation transform: k += eps*dk[l], v += eps*dv[l] (pre-RoPE keys) ---- */
typedef struct {
    double eps;
    const float *dk, *dv; /* [L][T][kvd] */
    /* quantization (STE test): step > 0 rounds k and v to multiples of step */
    float step;
    float *delta_k, *delta_v; /* record Q(x) - x when non-NULL */
    const float *add_k, *add_v; /* add a fixed offset when non-NULL */
    int alt;                   /* also supply an alternative (= transformed values) with boundaries */
} pert;

static kvq_status pert_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)err;
    pert *p = user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim, off = (size_t)c->layer * n;
    for (size_t i = 0; i < n; i++) {
        float k0 = k[i], v0 = v[i];
        if (p->step > 0) {
            k[i] = p->step * roundf(k[i] / p->step);
            v[i] = p->step * roundf(v[i] / p->step);
            if (p->delta_k) p->delta_k[off + i] = k[i] - k0, p->delta_v[off + i] = v[i] - v0;
        }
        if (p->add_k) k[i] += p->add_k[off + i], v[i] += p->add_v[off + i];
        if (p->dk) k[i] += (float)(p->eps * p->dk[off + i]);
        if (p->dv) v[i] += (float)(p->eps * p->dv[off + i]);
    }
    if (p->alt) {
        /* KIVI-like: older keys from the alternative, the newest from the primary;
         * both representations here equal the transformed values, plus a different
         * offset on the alternative so that the two paths are distinguishable */
        for (size_t i = 0; i < n; i++) alt->k[i] = k[i] + 0.05f * (float)((int)((i * 7) % 5) - 2), alt->v[i] = v[i] - 0.03f * (float)((int)((i * 3) % 5) - 2);
        for (int i = 0; i < c->T; i++) alt->k_bound[i] = (i / 4) * 4, alt->v_bound[i] = i > 2 ? i - 2 : 0;
        alt->use_k = alt->use_v = true;
    }
    return KVQ_OK;
}

static double fwd_loss(kvq_forward *fw, kvq_fwd_io *io)
{
    kvq_fwd_result r;
    kvq_err e = {0};
    ck_assert_msg(kvq_forward_run(fw, io, &r, &e) == KVQ_OK, "%s", e.msg);
    return r.loss;
}

/* Derivative at 0 of f along a direction from central differences
 * g(e) = (f(e) - f(-e)) / 2 at e = h k / N, k = 1..N, fitted by least squares
 * with the odd polynomial c1 e + c3 e^3 + c5 e^5 (normal equations in double);
 * returns c1. Fitting many step sizes averages the fp32 rounding noise of the
 * forward while the e^3, e^5 terms absorb the truncation error. */
typedef double (*along_fn)(void *ctx, double eps);
#define FD_N 12
static double fd_dir(along_fn f, void *ctx, double h)
{
    double A[3][4] = {{0}};
    for (int k = 1; k <= FD_N; k++) {
        double e = h * k / FD_N, g = (f(ctx, e) - f(ctx, -e)) / 2, u = e / h;
        double b[3] = {u, u * u * u, u * u * u * u * u};
        for (int i = 0; i < 3; i++) {
            for (int j = 0; j < 3; j++) A[i][j] += b[i] * b[j];
            A[i][3] += b[i] * g;
        }
    }
    for (int i = 0; i < 3; i++) /* Gauss-Jordan, SPD: no pivoting needed */
        for (int r = 0; r < 3; r++) {
            if (r == i) continue;
            double fct = A[r][i] / A[i][i];
            for (int j = 0; j < 4; j++) A[r][j] -= fct * A[i][j];
        }
    return A[0][3] / A[0][0] / h;
}

typedef struct {
    kvq_forward *fw;
    kvq_fwd_io *io;
    pert *p;
    kvq_prefix *px;
    float *pk0, *pv0, *pk, *pv; /* prefix: base and working copy */
    const float *dpk, *dpv;
    size_t np;
    /* upstream loss: refs [L][T][dim] */
    const float *ref;
    int L, T, dim;
    /* embedding perturbation */
    float *emb, *emb0, *demb;
    size_t ne;
} along_ctx;

static double along_kv(void *vc, double eps)
{
    along_ctx *c = vc;
    c->p->eps = eps;
    return fwd_loss(c->fw, c->io);
}

static double along_prefix(void *vc, double eps)
{
    along_ctx *c = vc;
    for (size_t i = 0; i < c->np; i++) c->pk[i] = c->pk0[i] + (float)(eps * c->dpk[i]), c->pv[i] = c->pv0[i] + (float)(eps * c->dpv[i]);
    return fwd_loss(c->fw, c->io);
}

static double dotf(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* A random direction (uniform entries in [-1, 1]) along which the derivative
 * g.d is not accidentally tiny: over random d, g.d has standard deviation
 * sigma = |g| / sqrt(3); draws with |g.d| < sigma / 4 (about 20% of them) are
 * redrawn, since there the fp32 forward's rounding noise (~1e-7 of the loss)
 * swamps a finite difference. Up to two gradients (g2 may be NULL) share one
 * direction test: the sum g.d + g2.d2 is used. */
static void rand_dirs(rng *r, float *d, const float *g, float *d2, const float *g2, size_t n)
{
    double sigma = sqrt((dotf(g, g, n) + (g2 ? dotf(g2, g2, n) : 0)) / 3);
    for (int tries = 0; tries < 20; tries++) {
        for (size_t i = 0; i < n; i++) d[i] = (float)urand(r);
        if (d2)
            for (size_t i = 0; i < n; i++) d2[i] = (float)urand(r);
        double D = dotf(g, d, n) + (g2 ? dotf(g2, d2, n) : 0);
        if (fabs(D) >= sigma / 4) return;
    }
}

/* capture the post-RoPE K and V of every layer (observe) — a real prefix */
typedef struct {
    float *k, *v;
} cap;
static kvq_status capture_kv(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    cap *cp = user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    memcpy(cp->k + c->layer * n, o->k_post, n * sizeof(float));
    memcpy(cp->v + c->layer * n, o->v, n * sizeof(float));
    return KVQ_OK;
}

static void make_prefix(const kvq_model *m, const int *tok, int P, float *pk, float *pv)
{
    kvq_forward fw;
    kvq_err e = {0};
    ck_assert(kvq_forward_init(&fw, m, P, 0, 0, &e) == KVQ_OK);
    cap cp = {pk, pv};
    kvq_hooks hk = {.user = &cp, .observe = capture_kv};
    kvq_fwd_io io = {.tokens = tok, .T = P, .pos0 = 0, .hooks = &hk};
    fwd_loss(&fw, &io);
    kvq_forward_free(&fw);
}

static double along_embd(void *vc, double eps)
{
    along_ctx *c = vc;
    for (size_t i = 0; i < c->ne; i++) c->emb[i] = c->emb0[i] + (float)(eps * c->demb[i]);
    return fwd_loss(c->fw, c->io);
}

/* dL/dK_pre, dL/dV, dL/d(prefix K, V) and dL/d(input embeddings) along random
 * directions vs finite differences, for the window tok[P .. P+T) after a
 * prefix of the first P tokens (m: fp32 weights; its embedding table is
 * perturbed and restored). */
static void directional_model(const char *name, kvq_model *m, const int *tok, int T, int P)
{
    const int L = m->hp.n_layers, kvd = kvq_kv_dim(&m->hp), dim = m->hp.dim;
    size_t n = (size_t)L * T * kvd, np = (size_t)L * P * kvd;
    float *pk0 = malloc(np * sizeof(float)), *pv0 = malloc(np * sizeof(float)), *pk = malloc(np * sizeof(float)), *pv = malloc(np * sizeof(float));
    make_prefix(m, tok, P, pk0, pv0);
    memcpy(pk, pk0, np * sizeof(float));
    memcpy(pv, pv0, np * sizeof(float));
    kvq_prefix px = {.P = P, .k = pk, .v = pv};

    kvq_grad_store st = {.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4), .dpv = malloc(np * 4)};
    float *d_embd = malloc((size_t)T * dim * 4);
    kvq_backward bw;
    kvq_err e = {0};
    ck_assert_msg(kvq_backward_init(&bw, m, T, P, &e) == KVQ_OK, "%s", e.msg);
    kvq_fwd_io io = {.tokens = tok + P, .T = T, .pos0 = P, .prefix = &px};
    kvq_bwd_result br;
    kvq_bwd_spec spec = {.user = &st, .xent = true, .grads = kvq_grad_store_cb, .d_embd = d_embd};
    ck_assert_msg(kvq_backward_run(&bw, &io, &spec, &br, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(br.n_scored, T - 1);

    rng r = {0x5eed};
    float *dk = malloc(n * 4), *dv = malloc(n * 4), *dpk = malloc(np * 4), *dpv = malloc(np * 4);
    rand_dirs(&r, dk, st.dk_pre, NULL, NULL, n);
    rand_dirs(&r, dv, st.dv, NULL, NULL, n);
    rand_dirs(&r, dpk, st.dpk, dpv, st.dpv, np);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, m, T, P, 0, &e) == KVQ_OK);
    /* the backward's loss (its own LM-head pass) agrees with the forward's */
    double fl = fwd_loss(&fw, &io);
    ck_assert_msg(fabs(br.loss - fl) < 1e-5 * fl && br.xent_loss == br.loss, "backward LM head loss %.8f vs forward %.8f", br.loss, fl);
    pert p = {.dk = dk, .dv = dv};
    kvq_hooks hk = {.user = &p, .transform = pert_transform, .key_stage = KVQ_KEYS_PRE_ROPE};
    kvq_fwd_io fio = io;
    fio.hooks = &hk;
    along_ctx c = {.fw = &fw, .io = &fio, .p = &p};
    /* K_pre and V separately, then the prefix */
    double an_k = dotf(st.dk_pre, dk, n), an_v = dotf(st.dv, dv, n), an_p = dotf(st.dpk, dpk, np) + dotf(st.dpv, dpv, np);
    p.dv = NULL;
    double fd_k = fd_dir(along_kv, &c, 0.02);
    p.dv = dv;
    p.dk = NULL;
    double fd_v = fd_dir(along_kv, &c, 0.02);
    fio.hooks = NULL;
    c.pk0 = pk0, c.pv0 = pv0, c.pk = pk, c.pv = pv, c.dpk = dpk, c.dpv = dpv, c.np = np;
    double fd_p = fd_dir(along_prefix, &c, 0.02);
    memcpy(pk, pk0, np * sizeof(float));
    memcpy(pv, pv0, np * sizeof(float));
    /* the input embeddings: every op of every layer (biases, q/k norms, the window, RoPE) lies on this path.
     * A tied LM head gets its own copy meanwhile: d_embd is the gradient through the input side only. */
    float *emb = kvq_mat_f32(&m->tok_embd);
    ck_assert_ptr_nonnull(emb);
    size_t ne = (size_t)m->hp.vocab_size * dim;
    kvq_mat head = m->output;
    float *head_copy = NULL;
    if (m->output.data == m->tok_embd.data) {
        head_copy = malloc(ne * 4);
        memcpy(head_copy, emb, ne * 4);
        m->output.data = head_copy;
    }
    float *emb0 = malloc(ne * 4), *demb = calloc(ne, 4);
    memcpy(emb0, emb, ne * 4);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < dim; i++) demb[(size_t)tok[P + t] * dim + i] = (float)urand(&r);
    double an_e = 0;
    for (int t = 0; t < T; t++) an_e += dotf(d_embd + (size_t)t * dim, demb + (size_t)tok[P + t] * dim, dim);
    c.emb = emb, c.emb0 = emb0, c.demb = demb, c.ne = ne;
    double fd_e = fd_dir(along_embd, &c, 0.004);
    memcpy(emb, emb0, ne * 4);
    m->output = head;
    free(head_copy);
    /* dk_post = RoPE(dk_pre): the post-RoPE direction RoPE(d) gives the same derivative (up to YaRN's attention factor) */
    double an_post = dotf(st.dk_post, st.dk_post, n), an_pre = dotf(st.dk_pre, st.dk_pre, n), msc = kvq_rope_attn_scale(&m->hp);
    double rot = m->hp.rope_dim == m->hp.head_dim ? sqrt(an_post / an_pre) * msc - 1 : 0; /* dk_pre = m R^T dk_post */
    double ek = fabs(an_k - fd_k) / fabs(fd_k), ev = fabs(an_v - fd_v) / fabs(fd_v), ep = fabs(an_p - fd_p) / fabs(fd_p),
           ee = fabs(an_e - fd_e) / fabs(fd_e);
    fprintf(stderr, "INFO %s directional: K_pre %.6e vs FD %.6e (rel %.1e); V %.6e vs %.6e (%.1e); prefix K,V %.6e vs %.6e (%.1e); "
            "embeddings %.6e vs %.6e (%.1e); m |dK_post|/|dK_pre| - 1 = %.1e\n",
            name, an_k, fd_k, ek, an_v, fd_v, ev, an_p, fd_p, ep, an_e, fd_e, ee, rot);
    ck_assert(ek <= 1e-3 && ev <= 1e-3 && ep <= 1e-3 && ee <= 1e-3);
    ck_assert(fabs(rot) < 1e-5);

    kvq_forward_free(&fw);
    kvq_backward_free(&bw);
    free(st.dk_pre), free(st.dk_post), free(st.dv), free(st.dpk), free(st.dpv), free(d_embd);
    free(pk0), free(pv0), free(pk), free(pv), free(dk), free(dv), free(dpk), free(dpv), free(emb0), free(demb);
}

static void directional_case(const char *name)
{
    kvq_model m;
    if (!load_tiny(name, &m)) {
        kvq_test_skip_missing(name, "directional: ../shared/models/llama2c absent");
        return;
    }
    int tok[27];
    fixture_tokens(name, tok, 27);
    directional_model(name, &m, tok, 24, 3);
    kvq_model_free(&m);
}

/* The families of tests/test_families.c (tests/fixtures/hf-<name>: Qwen2's
 * biases, Qwen3's q/k norms and decoupled head_dim, Mistral's sliding window
 * of 8 over a 3-token prefix and 24 window tokens, the scaled RoPEs): the same
 * finite-difference checks through every new op's backward. */
static void family_directional(const char *name)
{
    char dir[200], ref[256];
    snprintf(dir, sizeof dir, "tests/fixtures/hf-%.64s", name);
    snprintf(ref, sizeof ref, "%s/ref.bin", dir);
    size_t nb;
    unsigned char *b = kvq_test_slurp(ref, &nb);
    ck_assert_msg(b && nb > 16 + 4 * 27, "%s missing", ref);
    int tok[27];
    memcpy(tok, b + 16, sizeof tok);
    free(b);
    kvq_model m;
    kvq_err e = {0};
    kvq_load_opts o = {.weights = KVQ_WEIGHTS_F32};
    ck_assert_msg(kvq_model_load_opts(dir, &o, &m, &e) == KVQ_OK, "%s", e.msg);
    directional_model(name, &m, tok, 24, 3);
    kvq_model_free(&m);
}

START_TEST(test_directional_qwen2) { family_directional("qwen2"); }
END_TEST
START_TEST(test_directional_qwen3) { family_directional("qwen3"); }
END_TEST
START_TEST(test_directional_mistral) { family_directional("mistral"); }
END_TEST
START_TEST(test_directional_llama31) { family_directional("llama31"); }
END_TEST
START_TEST(test_directional_yarn) { family_directional("llama-yarn"); }
END_TEST

START_TEST(test_directional_stories) { directional_case("stories260K"); }
END_TEST
START_TEST(test_directional_aidreams) { directional_case("aidreams260K"); }
END_TEST

/* Straight-through: a quantizing transform (round to a grid of 0.05, both key
 * stages) gives gradients equal to the exact gradient w.r.t. the dequantized
 * K/V, obtained by a transform that adds the fixed offset Q(x) - x (derivative:
 * identity), itself checked against finite differences. With a KIVI-like
 * alternative representation and boundaries, the gradient w.r.t. K is the sum
 * over both representations (FD of a perturbation that moves both). */
START_TEST(test_straight_through)
{
    kvq_model m;
    KVQ_SKIP_IF(!load_tiny("stories260K", &m), "../shared/models/llama2c absent");
    const int T = 24, P = 2, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp);
    int tok[26];
    fixture_tokens("stories260K", tok, T + P);
    size_t n = (size_t)L * T * kvd, np = (size_t)L * P * kvd;
    float *pk = malloc(np * 4), *pv = malloc(np * 4);
    make_prefix(&m, tok, P, pk, pv);
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    kvq_backward bw;
    kvq_err e = {0};
    ck_assert(kvq_backward_init(&bw, &m, T, P, &e) == KVQ_OK);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, T, P, 0, &e) == KVQ_OK);
    kvq_grad_store g0 = {.dk_pre = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4)};
    kvq_grad_store gs = {.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4)};
    kvq_grad_store gx = {.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4)};
    float *delta_k = malloc(n * 4), *delta_v = malloc(n * 4), *dir = malloc(n * 4);
    kvq_bwd_result br;
    kvq_fwd_io io = {.tokens = tok + P, .T = T, .pos0 = P, .prefix = &px};
    ck_assert(kvq_backward_xent(&bw, &io, &g0, &br, &e) == KVQ_OK);
    rng r = {77};
    for (int stage = 0; stage < 2; stage++) {
        pert q = {.step = 0.05f, .delta_k = delta_k, .delta_v = delta_v};
        kvq_hooks hk = {.user = &q, .transform = pert_transform, .key_stage = stage ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE};
        io.hooks = &hk;
        ck_assert_msg(kvq_backward_xent(&bw, &io, &gs, &br, &e) == KVQ_OK, "%s", e.msg);
        double loss_q = br.loss;
        pert x = {.add_k = delta_k, .add_v = delta_v};
        hk.user = &x;
        ck_assert(kvq_backward_xent(&bw, &io, &gx, &br, &e) == KVQ_OK);
        double dl = fabs(br.loss - loss_q);
        double ek = kvq_test_rel_l2_f(gs.dk_pre, gx.dk_pre, n), ekp = kvq_test_rel_l2_f(gs.dk_post, gx.dk_post, n);
        double ev = kvq_test_rel_l2_f(gs.dv, gx.dv, n), ep = kvq_test_rel_l2_f(gs.dpk, gx.dpk, np);
        double moved = kvq_test_rel_l2_f(gs.dk_pre, g0.dk_pre, n), movedv = kvq_test_rel_l2_f(gs.dv, g0.dv, n);
        /* the offset transform's gradient is the true one: FD along a random direction */
        rand_dirs(&r, dir, gx.dk_post, NULL, NULL, n);
        x.dk = dir;
        kvq_fwd_io fio = io;
        along_ctx c = {.fw = &fw, .io = &fio, .p = &x};
        double fd = fd_dir(along_kv, &c, 0.02), an = dotf(stage ? gx.dk_post : gx.dk_pre, dir, n);
        fprintf(stderr, "INFO STE %s-RoPE: loss Q %.6f vs offset %.6f; STE vs exact-at-dequantized rel L2: dK_pre %.1e dK_post %.1e dV %.1e dPK %.1e; "
                        "exact directional %.6e vs FD %.6e (%.1e); quantization moved dK by %.2f, dV by %.2f\n",
                stage ? "post" : "pre", loss_q, br.loss, ek, ekp, ev, ep, an, fd, fabs(an - fd) / fabs(fd), moved, movedv);
        ck_assert(dl < 1e-5 && ek < 1e-4 && ekp < 1e-4 && ev < 1e-4 && ep < 1e-4);
        ck_assert(fabs(an - fd) <= 1e-3 * fabs(fd));
        ck_assert(moved > 1e-3 && movedv > 1e-3); /* the test is not vacuous */
    }
    /* alternative representation with boundaries: both paths' gradients are summed */
    pert a = {.alt = 1};
    kvq_hooks hk = {.user = &a, .transform = pert_transform, .key_stage = KVQ_KEYS_PRE_ROPE};
    io.hooks = &hk;
    ck_assert_msg(kvq_backward_xent(&bw, &io, &gs, &br, &e) == KVQ_OK, "%s", e.msg);
    float *dir_v = malloc(n * 4);
    rand_dirs(&r, dir, gs.dk_pre, dir_v, gs.dv, n);
    a.dk = dir;
    a.dv = dir_v;
    kvq_fwd_io fio = io;
    along_ctx c = {.fw = &fw, .io = &fio, .p = &a};
    double fd = fd_dir(along_kv, &c, 0.02), an = dotf(gs.dk_pre, dir, n) + dotf(gs.dv, dir_v, n);
    fprintf(stderr, "INFO STE with alternative K/V + boundaries: directional %.6e vs FD %.6e (%.1e)\n", an, fd, fabs(an - fd) / fabs(fd));
    ck_assert(fabs(an - fd) <= 1e-3 * fabs(fd));
    free(dir_v);
    kvq_forward_free(&fw);
    kvq_backward_free(&bw);
    free(g0.dk_pre), free(g0.dv), free(g0.dpk), free(gs.dk_pre), free(gs.dk_post), free(gs.dv), free(gs.dpk);
    free(gx.dk_pre), free(gx.dk_post), free(gx.dv), free(gx.dpk), free(delta_k), free(delta_v), free(dir), free(pk), free(pv);
    kvq_model_free(&m);
}
END_TEST

/* Keeping the forward's activations (KVQ_FWD_SAVE_ACTIVATIONS) and
 * recomputing them layer by layer give bit-identical gradients and losses,
 * with a prefix, with a transform that has alternative K/V + boundaries, and
 * for both key stages. */
START_TEST(test_keep_vs_recompute)
{
    kvq_model m;
    KVQ_SKIP_IF(!load_tiny("stories260K", &m), "../shared/models/llama2c absent");
    const int T = 24, P = 2, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp);
    int tok[26];
    fixture_tokens("stories260K", tok, T + P);
    size_t n = (size_t)L * T * kvd, np = (size_t)L * P * kvd;
    float *pk = malloc(np * 4), *pv = malloc(np * 4);
    make_prefix(&m, tok, P, pk, pv);
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    kvq_backward bk, br;
    kvq_err e = {0};
    ck_assert(kvq_backward_init_opts(&bk, &m, T, P, 1, &e) == KVQ_OK && bk.keep_acts);
    ck_assert(kvq_backward_init_opts(&br, &m, T, P, 0, &e) == KVQ_OK && !br.keep_acts);
    kvq_grad_store g[2];
    for (int i = 0; i < 2; i++)
        g[i] = (kvq_grad_store){.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4),
                                .dpv = malloc(np * 4)};
    for (int c = 0; c < 4; c++) {
        pert a = {.alt = c >= 2, .step = c == 1 ? 0.05f : 0};
        float *dk = malloc(n * 4), *dv = malloc(n * 4);
        if (c == 1) a.delta_k = dk, a.delta_v = dv;
        kvq_hooks hk = {.user = &a, .transform = pert_transform, .key_stage = c == 3 ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE};
        kvq_fwd_io io = {.tokens = tok + P, .T = T, .pos0 = P, .prefix = &px, .hooks = c ? &hk : NULL};
        kvq_bwd_result r[2];
        ck_assert_msg(kvq_backward_xent(&bk, &io, &g[0], &r[0], &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_backward_xent(&br, &io, &g[1], &r[1], &e) == KVQ_OK, "%s", e.msg);
        ck_assert(r[0].loss == r[1].loss && r[0].xent_loss == r[1].xent_loss);
        ck_assert(!memcmp(g[0].dk_pre, g[1].dk_pre, n * 4) && !memcmp(g[0].dk_post, g[1].dk_post, n * 4));
        ck_assert(!memcmp(g[0].dv, g[1].dv, n * 4));
        ck_assert(!memcmp(g[0].dpk, g[1].dpk, np * 4) && !memcmp(g[0].dpv, g[1].dpv, np * 4));
        double norm = 0;
        for (size_t i = 0; i < n; i++) norm += (double)g[0].dv[i] * g[0].dv[i];
        ck_assert(norm > 0); /* not vacuous */
        free(dk), free(dv);
    }
    for (int i = 0; i < 2; i++) free(g[i].dk_pre), free(g[i].dk_post), free(g[i].dv), free(g[i].dpk), free(g[i].dpv);
    kvq_backward_free(&bk);
    kvq_backward_free(&br);
    free(pk), free(pv);
    kvq_model_free(&m);
}
END_TEST

/* The engine (device.h) on the CPU: kvq_engine_backward with a built-in scheme
 * set by kvq_engine_set_kv gives bit-identical results to kvq_backward_run with
 * the descriptor's transform as a hook (the GPU engine is checked against this
 * CPU path by tests/gpu/gpu_check.c --backward), and kvq_engine_layer_input
 * returns the forward's residual checkpoints. */
START_TEST(test_engine_backward_matches)
{
    kvq_model m;
    KVQ_SKIP_IF(!load_tiny("stories260K", &m), "../shared/models/llama2c absent");
    const int T = 40, P = 2, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp), dim = m.hp.dim;
    int tok[42];
    fixture_tokens("stories260K", tok, T + P);
    size_t n = (size_t)L * T * kvd, np = (size_t)L * P * kvd;
    float *pk = malloc(np * 4), *pv = malloc(np * 4);
    make_prefix(&m, tok, P, pk, pv);
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    kvq_err e = {0};
    /* KIVI-2: alternative keys/values with boundaries (the decode-equivalent path) */
    kvq_kv_desc d = {.q = {.fam = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group = 8, .residual = 16},
                     .key_stage = KVQ_KEYS_POST_ROPE};
    kvq_engine eng;
    ck_assert_msg(kvq_engine_init(&eng, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, P, KVQ_ENGINE_BACKWARD, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_engine_set_kv(&eng, &d, &e) == KVQ_OK, "%s", e.msg);
    kvq_backward bw;
    ck_assert(kvq_backward_init(&bw, &m, T, P, &e) == KVQ_OK);
    kvq_grad_store g[2];
    for (int i = 0; i < 2; i++)
        g[i] = (kvq_grad_store){.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4),
                                .dpv = malloc(np * 4)};
    kvq_fwd_io io = {.tokens = tok + P, .T = T, .pos0 = P, .prefix = &px};
    kvq_bwd_spec s0 = {.user = &g[0], .xent = true, .grads = kvq_grad_store_cb};
    kvq_bwd_result r[2];
    ck_assert_msg(kvq_engine_backward(&eng, &io, &s0, &r[0], &e) == KVQ_OK, "%s", e.msg);
    kvq_kv_desc_run run = {.d = &d};
    kvq_hooks hk = {.user = &run, .transform = kvq_kv_desc_transform, .key_stage = d.key_stage};
    kvq_fwd_io io2 = io;
    io2.hooks = &hk;
    ck_assert_msg(kvq_backward_xent(&bw, &io2, &g[1], &r[1], &e) == KVQ_OK, "%s", e.msg);
    ck_assert(r[0].loss == r[1].loss && isfinite(r[0].loss));
    ck_assert(!memcmp(g[0].dk_pre, g[1].dk_pre, n * 4) && !memcmp(g[0].dv, g[1].dv, n * 4));
    ck_assert(!memcmp(g[0].dpk, g[1].dpk, np * 4) && !memcmp(g[0].dpv, g[1].dpv, np * 4));
    /* and the transform was applied: the unquantized gradients differ */
    kvq_grad_store g2 = {.dv = malloc(n * 4)};
    ck_assert(kvq_backward_xent(&bw, &io, &g2, &r[1], &e) == KVQ_OK);
    ck_assert(memcmp(g[0].dv, g2.dv, n * 4) != 0 && r[1].loss != r[0].loss);
    /* layer inputs of the engine's last run = the forward's checkpoints (run the engine again to compare) */
    ck_assert(kvq_engine_backward(&eng, &io, &s0, &r[0], &e) == KVQ_OK);
    float *x = malloc((size_t)T * dim * 4);
    for (int l = 0; l <= L; l++) {
        ck_assert_msg(kvq_engine_layer_input(&eng, l, x, &e) == KVQ_OK, "%s", e.msg);
        ck_assert(!memcmp(x, kvq_forward_layer_input(&eng.bw.fw, l), (size_t)T * dim * 4));
    }
    ck_assert_int_eq(kvq_engine_layer_input(&eng, L + 1, x, &e), KVQ_EINVAL);
    /* an engine without KVQ_ENGINE_BACKWARD refuses, naming the flag */
    kvq_engine plain;
    ck_assert(kvq_engine_init(&plain, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, P, 0, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_engine_backward(&plain, &io, &s0, &r[0], &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "KVQ_ENGINE_BACKWARD"), "%s", e.msg);
    kvq_engine_free(&plain);
    free(x);
    free(g2.dv);
    for (int i = 0; i < 2; i++) free(g[i].dk_pre), free(g[i].dk_post), free(g[i].dv), free(g[i].dpk), free(g[i].dpv);
    kvq_backward_free(&bw);
    kvq_engine_free(&eng);
    free(pk), free(pv);
    kvq_model_free(&m);
}
END_TEST

/* ---- upstream (layer-output) loss: ½ Σ_l ||x_l − ref_l||² (IntactKV) ---- */
typedef struct {
    const float *ref; /* [L][T][dim]: reference output of layer l */
    int T, dim;
    double loss;
    kvq_grad_store *store;
} up_state;

static kvq_status up_cb(void *user, const kvq_layer_ctx *c, const float *x_out, float *dx, kvq_err *err)
{
    (void)err;
    up_state *u = user;
    const float *ref = u->ref + (size_t)c->layer * u->T * u->dim;
    for (size_t i = 0; i < (size_t)u->T * u->dim; i++) {
        double d = (double)x_out[i] - ref[i];
        dx[i] += (float)d;
        u->loss += 0.5 * d * d;
    }
    return KVQ_OK;
}
static kvq_status up_grads(void *user, const kvq_layer_grads *g, kvq_err *err) { return kvq_grad_store_cb(((up_state *)user)->store, g, err); }

static double up_loss(kvq_forward *fw, kvq_fwd_io *io, const float *ref, int L, int T, int dim)
{
    fwd_loss(fw, io);
    double s = 0;
    for (int l = 0; l < L; l++) {
        const float *x = kvq_forward_layer_input(fw, l + 1), *rr = ref + (size_t)l * T * dim;
        for (size_t i = 0; i < (size_t)T * dim; i++) s += 0.5 * ((double)x[i] - rr[i]) * ((double)x[i] - rr[i]);
    }
    return s;
}
static double along_up_prefix(void *vc, double eps)
{
    along_ctx *c = vc;
    for (size_t i = 0; i < c->np; i++) c->pk[i] = c->pk0[i] + (float)(eps * c->dpk[i]), c->pv[i] = c->pv0[i] + (float)(eps * c->dpv[i]);
    return up_loss(c->fw, c->io, c->ref, c->L, c->T, c->dim);
}
static double along_up_kv(void *vc, double eps)
{
    along_ctx *c = vc;
    c->p->eps = eps;
    return up_loss(c->fw, c->io, c->ref, c->L, c->T, c->dim);
}

static double along_up_embd(void *vc, double eps)
{
    along_ctx *c = vc;
    for (size_t i = 0; i < c->ne; i++) c->emb[i] = c->emb0[i] + (float)(eps * c->demb[i]);
    return up_loss(c->fw, c->io, c->ref, c->L, c->T, c->dim);
}

START_TEST(test_upstream)
{
    kvq_model m;
    KVQ_SKIP_IF(!load_tiny("aidreams260K", &m), "../shared/models/llama2c absent");
    const int T = 20, P = 3, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp), dim = m.hp.dim;
    int tok[23], tok2[3];
    fixture_tokens("aidreams260K", tok, T + P);
    size_t n = (size_t)L * T * kvd, np = (size_t)L * P * kvd;
    float *pk0 = malloc(np * 4), *pv0 = malloc(np * 4), *pk = malloc(np * 4), *pv = malloc(np * 4), *ref = malloc((size_t)L * T * dim * 4);
    /* reference: the window after the true prefix; trained prefix: K/V of other tokens */
    make_prefix(&m, tok, P, pk, pv);
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    kvq_forward fw;
    kvq_err e = {0};
    ck_assert(kvq_forward_init(&fw, &m, T, P, KVQ_FWD_SAVE_LAYER_INPUTS, &e) == KVQ_OK);
    kvq_fwd_io io = {.tokens = tok + P, .T = T, .pos0 = P, .prefix = &px};
    fwd_loss(&fw, &io);
    for (int l = 0; l < L; l++) memcpy(ref + (size_t)l * T * dim, kvq_forward_layer_input(&fw, l + 1), (size_t)T * dim * 4);
    for (int i = 0; i < P; i++) tok2[i] = (tok[i] + 17 * (i + 1)) % m.hp.vocab_size;
    make_prefix(&m, tok2, P, pk0, pv0);
    memcpy(pk, pk0, np * 4);
    memcpy(pv, pv0, np * 4);

    kvq_grad_store st = {.dk_pre = malloc(n * 4), .dv = malloc(n * 4), .dpk = malloc(np * 4), .dpv = malloc(np * 4)};
    up_state u = {.ref = ref, .T = T, .dim = dim, .store = &st};
    float *d_embd = malloc((size_t)T * dim * 4);
    kvq_bwd_spec spec = {.user = &u, .upstream = up_cb, .grads = up_grads, .d_embd = d_embd};
    kvq_backward bw;
    ck_assert(kvq_backward_init(&bw, &m, T, P, &e) == KVQ_OK);
    kvq_bwd_result br;
    ck_assert_msg(kvq_backward_run(&bw, &io, &spec, &br, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(isnan(br.xent_loss));
    double L0 = up_loss(&fw, &io, ref, L, T, dim);
    ck_assert_msg(fabs(u.loss - L0) <= 1e-9 * L0 && L0 > 0, "upstream loss %.9g vs %.9g", u.loss, L0);

    rng r = {4242};
    float *dpk = malloc(np * 4), *dpv = malloc(np * 4), *dk = malloc(n * 4), *dv = malloc(n * 4);
    rand_dirs(&r, dpk, st.dpk, dpv, st.dpv, np);
    rand_dirs(&r, dk, st.dk_pre, dv, st.dv, n);
    along_ctx c = {.fw = &fw, .io = &io, .pk0 = pk0, .pv0 = pv0, .pk = pk, .pv = pv, .dpk = dpk, .dpv = dpv, .np = np,
                   .ref = ref, .L = L, .T = T, .dim = dim};
    double fd_p = fd_dir(along_up_prefix, &c, 0.02), an_p = dotf(st.dpk, dpk, np) + dotf(st.dpv, dpv, np);
    memcpy(pk, pk0, np * 4);
    memcpy(pv, pv0, np * 4);
    pert p = {.dk = dk, .dv = dv};
    kvq_hooks hk = {.user = &p, .transform = pert_transform};
    kvq_fwd_io fio = io;
    fio.hooks = &hk;
    c.io = &fio;
    c.p = &p;
    double fd_kv = fd_dir(along_up_kv, &c, 0.02), an_kv = dotf(st.dk_pre, dk, n) + dotf(st.dv, dv, n);
    fprintf(stderr, "INFO upstream ½Σ||x_l - ref_l||² = %.6f: prefix directional %.6e vs FD %.6e (%.1e); K_pre,V %.6e vs %.6e (%.1e)\n", L0, an_p,
            fd_p, fabs(an_p - fd_p) / fabs(fd_p), an_kv, fd_kv, fabs(an_kv - fd_kv) / fabs(fd_kv));
    ck_assert(fabs(an_p - fd_p) <= 1e-3 * fabs(fd_p));
    ck_assert(fabs(an_kv - fd_kv) <= 1e-3 * fabs(fd_kv));

    /* dL/d(input embeddings): perturb the embedding rows of the window's tokens
     * (the upstream loss does not involve the LM head, so tied weights do not matter) */
    io.hooks = NULL;
    c.io = &io;
    memcpy(pk, pk0, np * 4);
    memcpy(pv, pv0, np * 4);
    size_t ne = (size_t)m.hp.vocab_size * dim;
    float *emb0 = malloc(ne * 4), *demb = calloc(ne, 4);
    memcpy(emb0, kvq_mat_f32(&m.tok_embd), ne * 4);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < dim; i++) demb[(size_t)tok[P + t] * dim + i] = (float)urand(&r);
    double an_e = 0;
    for (int t = 0; t < T; t++) an_e += dotf(d_embd + (size_t)t * dim, demb + (size_t)tok[P + t] * dim, dim);
    c.emb = kvq_mat_f32(&m.tok_embd), c.emb0 = emb0, c.demb = demb, c.ne = ne;
    double fd_e = fd_dir(along_up_embd, &c, 0.02);
    memcpy(kvq_mat_f32(&m.tok_embd), emb0, ne * 4);
    fprintf(stderr, "INFO upstream dL/d(embeddings) directional %.6e vs FD %.6e (%.1e)\n", an_e, fd_e, fabs(an_e - fd_e) / fabs(fd_e));
    ck_assert(fabs(an_e - fd_e) <= 1e-3 * fabs(fd_e));
    free(emb0), free(demb), free(d_embd);

    /* bad specs */
    kvq_bwd_spec none = {0};
    ck_assert(kvq_backward_run(&bw, &io, &none, &br, &e) == KVQ_EINVAL);
    int tg[20];
    for (int i = 0; i < T; i++) tg[i] = -1;
    kvq_fwd_io io2 = io;
    io2.targets = tg;
    kvq_bwd_spec xs = {.xent = true};
    ck_assert(kvq_backward_run(&bw, &io2, &xs, &br, &e) == KVQ_EINVAL);
    fprintf(stderr, "INFO expected error: %s\n", e.msg);

    kvq_backward_free(&bw);
    kvq_forward_free(&fw);
    free(st.dk_pre), free(st.dv), free(st.dpk), free(st.dpv), free(dpk), free(dpv), free(dk), free(dv);
    free(pk0), free(pv0), free(pk), free(pv), free(ref);
    kvq_model_free(&m);
}
END_TEST

/* SmolLM2-135M, 128 tokens: dL/dV and dL/dK_pre of layers 0 and 29 against
 * JAX float64 autograd (tests/scripts/ref_grad_jax.py → tests/fixtures/grad_smollm2.bin) */
START_TEST(test_default_model_vs_jax)
{
    const char *path = kvq_test_model();
    KVQ_SKIP_IF(!path, "default model absent (run scripts/fetch_model.sh)");
    KVQ_SKIP_OPTIONAL_IF(kvq_test_quick(), "KVQ_TEST_QUICK: the default model's backward is slow under sanitizers");
    FILE *f = fopen("tests/fixtures/grad_smollm2.bin", "rb");
    ck_assert_msg(f, "tests/fixtures/grad_smollm2.bin missing (run tests/scripts/ref_grad_jax.py)");
    char magic[8];
    int32_t h[4];
    ck_assert(fread(magic, 8, 1, f) == 1 && memcmp(magic, "KVQGRD1", 8) == 0);
    ck_assert(fread(h, sizeof h, 1, f) == 1);
    const int T = h[0], L = h[1], kvd = h[2], ns = h[3];
    ck_assert(T > 1 && T <= 4096 && ns > 0 && ns <= 8 && kvd > 0);
    int layers[8], *tok = malloc(T * sizeof(int));
    double ref_loss;
    ck_assert(fread(layers, sizeof(int), ns, f) == (size_t)ns);
    ck_assert(fread(tok, sizeof(int), T, f) == (size_t)T);
    ck_assert(fread(&ref_loss, sizeof ref_loss, 1, f) == 1);
    size_t n1 = (size_t)T * kvd;
    float *ref = malloc(2 * ns * n1 * sizeof(float));
    ck_assert(fread(ref, sizeof(float), 2 * ns * n1, f) == 2 * ns * n1);
    fclose(f);

    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(m.hp.n_layers, L);
    ck_assert_int_eq(kvq_kv_dim(&m.hp), kvd);
    kvq_grad_store st = {.dk_pre = malloc(L * n1 * 4), .dv = malloc(L * n1 * 4)};
    kvq_backward bw;
    ck_assert_msg(kvq_backward_init(&bw, &m, T, 0, &e) == KVQ_OK, "%s", e.msg);
    kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = 0};
    kvq_bwd_result br;
    ck_assert_msg(kvq_backward_xent(&bw, &io, &st, &br, &e) == KVQ_OK, "%s", e.msg);
    double el = fabs(br.loss - ref_loss) / ref_loss;
    fprintf(stderr, "INFO SmolLM2 T=%d: loss %.8f vs JAX %.8f (rel %.1e)\n", T, br.loss, ref_loss, el);
    ck_assert(el < 1e-4);
    for (int i = 0; i < ns; i++) {
        ck_assert(layers[i] >= 0 && layers[i] < L);
        double ev = kvq_test_rel_l2_f(st.dv + layers[i] * n1, ref + (2 * i) * n1, n1);
        double ek = kvq_test_rel_l2_f(st.dk_pre + layers[i] * n1, ref + (2 * i + 1) * n1, n1);
        fprintf(stderr, "INFO SmolLM2 layer %d vs JAX float64 autograd: dL/dV rel L2 %.2e, dL/dK_pre rel L2 %.2e\n", layers[i], ev, ek);
        ck_assert(ev <= 1e-3 && ek <= 1e-3);
    }
    kvq_backward_free(&bw);
    kvq_model_free(&m);
    free(st.dk_pre), free(st.dv), free(ref), free(tok);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("backward");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_directional_stories);
    tcase_add_test(tc, test_engine_backward_matches);
    tcase_add_test(tc, test_directional_aidreams);
    tcase_add_test(tc, test_directional_qwen2);
    tcase_add_test(tc, test_directional_qwen3);
    tcase_add_test(tc, test_directional_mistral);
    tcase_add_test(tc, test_directional_llama31);
    tcase_add_test(tc, test_directional_yarn);
    tcase_add_test(tc, test_straight_through);
    tcase_add_test(tc, test_keep_vs_recompute);
    tcase_add_test(tc, test_upstream);
    tcase_add_test(tc, test_default_model_vs_jax);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
