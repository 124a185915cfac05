/* test_forward.c — the batched forward (kernels/model/forward.h) against the
 * float64 numpy reference (tests/scripts/ref_forward.py → tests/fixtures/
 * fwd_*.bin), and the hook contracts: observe (K_post = RoPE(K_pre), attention
 * statistics), transform (identity is bit-exact, zeroing V matters), prefix
 * (= one longer window), boundaries (identical representations = plain pass;
 * a KIVI-like rule = an explicit token-by-token decode loop). */
#include <malloc.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "forward.h"
#include "kvq_test.h"
#include "model.h"

/* ---------- fixtures ---------- */

typedef struct {
    int V, T, pos0, n_full, n_cols;
    int *tokens, *full_pos, *cols;
    float *full_logits, *col_logits;
    double *nll, loss;
} fixture;

static int read_fixture(const char *path, fixture *fx)
{
    memset(fx, 0, sizeof *fx);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char magic[8];
    int32_t h[5];
    ck_assert(fread(magic, 8, 1, f) == 1 && memcmp(magic, "KVQFWD1", 8) == 0);
    ck_assert(fread(h, sizeof h, 1, f) == 1);
    fx->V = h[0], fx->T = h[1], fx->pos0 = h[2], fx->n_full = h[3], fx->n_cols = h[4];
    ck_assert(fx->V > 0 && fx->T > 0 && fx->n_full >= 0 && fx->n_cols >= 0);
    fx->tokens = malloc(fx->T * sizeof(int));
    fx->full_pos = malloc((fx->n_full + 1) * sizeof(int));
    fx->cols = malloc((fx->n_cols + 1) * sizeof(int));
    fx->full_logits = malloc(((size_t)fx->n_full * fx->V + 1) * sizeof(float));
    fx->col_logits = malloc(((size_t)fx->T * fx->n_cols + 1) * sizeof(float));
    fx->nll = malloc(fx->T * sizeof(double));
    ck_assert(fread(fx->tokens, sizeof(int), fx->T, f) == (size_t)fx->T);
    ck_assert(fread(fx->full_pos, sizeof(int), fx->n_full, f) == (size_t)fx->n_full);
    ck_assert(fread(fx->cols, sizeof(int), fx->n_cols, f) == (size_t)fx->n_cols);
    ck_assert(fread(fx->full_logits, sizeof(float), (size_t)fx->n_full * fx->V, f) == (size_t)fx->n_full * fx->V);
    ck_assert(fread(fx->col_logits, sizeof(float), (size_t)fx->T * fx->n_cols, f) == (size_t)fx->T * fx->n_cols);
    ck_assert(fread(fx->nll, sizeof(double), fx->T, f) == (size_t)fx->T);
    ck_assert(fread(&fx->loss, sizeof(double), 1, f) == 1);
    fclose(f);
    return 1;
}

static void free_fixture(fixture *fx)
{
    free(fx->tokens);
    free(fx->full_pos);
    free(fx->cols);
    free(fx->full_logits);
    free(fx->col_logits);
    free(fx->nll);
}

/* Compare the forward on fx's tokens with the fixture; tolerances: loss
 * relative, logits relative L2 over everything stored. */
static void check_against_fixture(const char *model_path, const char *fixture_path, double loss_tol, double logit_tol)
{
    fixture fx;
    ck_assert_msg(read_fixture(fixture_path, &fx), "fixture %s missing (run tests/scripts/ref_forward.py)", fixture_path);
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(model_path, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(m.hp.vocab_size, fx.V);
    kvq_forward fw;
    ck_assert_msg(kvq_forward_init(&fw, &m, fx.T, 0, 0, &e) == KVQ_OK, "%s", e.msg);
    float *logits = malloc((size_t)fx.T * fx.V * sizeof(float));
    double *nll = malloc(fx.T * sizeof(double));
    kvq_fwd_io io = {.tokens = fx.tokens, .T = fx.T, .pos0 = fx.pos0, .logits = logits, .nll = nll};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(r.n_scored, fx.T - 1);
    double rel_loss = fabs(r.loss - fx.loss) / fx.loss;
    /* gather the stored logits */
    size_t ns = (size_t)fx.n_full * fx.V + (size_t)fx.T * fx.n_cols, k = 0;
    float *got = malloc(ns * sizeof(float)), *want = malloc(ns * sizeof(float));
    for (int i = 0; i < fx.n_full; i++)
        for (int c = 0; c < fx.V; c++, k++) {
            got[k] = logits[(size_t)fx.full_pos[i] * fx.V + c];
            want[k] = fx.full_logits[(size_t)i * fx.V + c];
        }
    for (int t = 0; t < fx.T; t++)
        for (int c = 0; c < fx.n_cols; c++, k++) {
            got[k] = logits[(size_t)t * fx.V + fx.cols[c]];
            want[k] = fx.col_logits[(size_t)t * fx.n_cols + c];
        }
    double rel_logits = kvq_test_rel_l2_f(got, want, ns);
    double max_nll = 0;
    for (int t = 0; t < fx.T - 1; t++) max_nll = fmax(max_nll, fabs(nll[t] - fx.nll[t]));
    ck_assert(isnan(nll[fx.T - 1]));
    fprintf(stderr, "INFO %s: loss %.8f vs ref %.8f (rel %.2e), logits rel L2 %.2e over %zu values, max |dNLL| %.2e\n",
            model_path, r.loss, fx.loss, rel_loss, rel_logits, ns, max_nll);
    ck_assert_msg(rel_loss <= loss_tol, "loss rel error %.3e > %.1e", rel_loss, loss_tol);
    ck_assert_msg(rel_logits <= logit_tol, "logits rel L2 %.3e > %.1e", rel_logits, logit_tol);

    /* loss-only run (no logits buffer) gives the same numbers: its LM head covers the scored rows only (T - 1 rows, the
     * logits path T), a GEMM of another M that OpenBLAS may sum in another order (an AMD EPYC, Zen kernels: 3.3e-8 to 7.7e-8
     * relative); a wrong row or block would be off by far more than 1e-6 */
    kvq_fwd_io io2 = {.tokens = fx.tokens, .T = fx.T, .pos0 = fx.pos0};
    kvq_fwd_result r2;
    ck_assert_msg(kvq_forward_run(&fw, &io2, &r2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(fabs(r2.loss - r.loss) <= 1e-6 * r.loss, "loss-only path: %.17g vs %.17g", r2.loss, r.loss);
    ck_assert_int_eq(r2.n_scored, r.n_scored);
    fw.v_chunk = 100; /* several vocabulary blocks with a ragged tail */
    ck_assert_msg(kvq_forward_run(&fw, &io2, &r2, &e) == KVQ_OK, "%s", e.msg);
    /* the LM head's GEMMs have another N here, which OpenBLAS may sum in another order (an AMD EPYC: 5e-8 relative,
     * float rounding); a wrong block or tail would be off by far more than 1e-6 */
    ck_assert_msg(fabs(r2.loss - r.loss) <= 1e-6 * r.loss, "blocked loss-only path: %.17g vs %.17g", r2.loss, r.loss);
    /* skip_loss: no LM head; n_scored still counted, nll left untouched; the
     * logits request wins over skip_loss */
    double *nll2 = malloc(fx.T * sizeof(double));
    for (int t = 0; t < fx.T; t++) nll2[t] = -7;
    kvq_fwd_io io3 = {.tokens = fx.tokens, .T = fx.T, .pos0 = fx.pos0, .nll = nll2, .skip_loss = true};
    ck_assert_msg(kvq_forward_run(&fw, &io3, &r2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(isnan(r2.loss) && r2.n_scored == r.n_scored && nll2[0] == -7 && nll2[fx.T - 1] == -7);
    io3.logits = logits;
    ck_assert_msg(kvq_forward_run(&fw, &io3, &r2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(r2.loss == r.loss && nll2[0] == nll[0]);
    free(nll2);
    free(got);
    free(want);
    free(logits);
    free(nll);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
    free_fixture(&fx);
}

START_TEST(test_ref_stories)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    check_against_fixture(p, "tests/fixtures/fwd_stories260K.bin", 1e-5, 1e-5);
}
END_TEST

START_TEST(test_ref_aidreams)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/aidreams260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    check_against_fixture(p, "tests/fixtures/fwd_aidreams260K.bin", 1e-5, 1e-5);
}
END_TEST

START_TEST(test_ref_default_model)
{
    const char *p = kvq_test_model();
    KVQ_SKIP_IF(!p, "default model absent (run scripts/fetch_model.sh)");
    kvq_model m;
    kvq_err e = {0};
    kvq_status s = kvq_model_load(p, &m, &e);
    KVQ_SKIP_IF(s == KVQ_EUNSUPPORTED, "GGUF model loading not available in this build");
    ck_assert_msg(s == KVQ_OK, "%s", e.msg);
    kvq_model_free(&m);
    check_against_fixture(p, "tests/fixtures/fwd_smollm2.bin", 1e-5, 1e-4);
}
END_TEST

/* ---------- hooks ---------- */

static const char *tiny_path(char *buf, size_t n) { return kvq_test_shared(buf, n, "models/llama2c/stories260K.bin"); }

/* a fixed token sequence in the vocabulary */
static void make_tokens(int *tok, int n, int V)
{
    uint32_t s = 12345;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        tok[i] = (int)((s >> 8) % (uint32_t)V);
    }
}

typedef struct {
    const kvq_hparams *hp;
    int pos0;
    double max_rope_err, max_mass_err, max_ent_err;
    int calls;
} obs_check;

/* Independent checks inside observe: K_post = RoPE(K_pre) with the formula of
 * RoFormer §3.4.2 in double; attention mass/entropy recomputed in double from
 * the observed q and k_post (no prefix here). */
static kvq_status observe_check(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    obs_check *oc = user;
    const kvq_hparams *hp = oc->hp;
    int hd = c->head_dim, nkv = c->n_kv_heads, T = c->T;
    oc->calls++;
    ck_assert_int_eq(c->pos0, oc->pos0);
    ck_assert(o->k_att == o->k_post && o->v_att == o->v && o->k_alt == NULL);
    for (int t = 0; t < T; t++)
        for (int g = 0; g < nkv; g++) {
            const float *a = o->k_pre + ((size_t)t * nkv + g) * hd, *b = o->k_post + ((size_t)t * nkv + g) * hd;
            for (int i = 0; i < hd / 2; i++) {
                double ang = (c->pos0 + t) * pow((double)hp->rope_theta, -2.0 * i / hp->rope_dim);
                double x = a[2 * i] * cos(ang) - a[2 * i + 1] * sin(ang), y = a[2 * i] * sin(ang) + a[2 * i + 1] * cos(ang);
                double scale = fabs(a[2 * i]) + fabs(a[2 * i + 1]) + 1e-6;
                oc->max_rope_err = fmax(oc->max_rope_err, fmax(fabs(x - b[2 * i]), fabs(y - b[2 * i + 1])) / scale);
            }
        }
    ck_assert_ptr_nonnull(o->attn_mass);
    ck_assert_ptr_nonnull(o->attn_entropy);
    double *mass = calloc((size_t)c->n_heads * T, sizeof(double)), *p = malloc(T * sizeof(double));
    for (int h = 0; h < c->n_heads; h++) {
        int g = h / (c->n_heads / nkv);
        for (int i = 0; i < T; i++) {
            double mx = -INFINITY, z = 0, ent = 0;
            for (int j = 0; j <= i; j++) {
                double s = 0;
                for (int d = 0; d < hd; d++)
                    s += (double)o->q[((size_t)i * c->n_heads + h) * hd + d] * o->k_post[((size_t)j * nkv + g) * hd + d];
                p[j] = s / sqrt(hd);
                mx = fmax(mx, p[j]);
            }
            for (int j = 0; j <= i; j++) z += (p[j] = exp(p[j] - mx));
            for (int j = 0; j <= i; j++) {
                p[j] /= z;
                mass[(size_t)h * T + j] += p[j];
                if (p[j] > 0) ent -= p[j] * log(p[j]);
            }
            oc->max_ent_err = fmax(oc->max_ent_err, fabs(ent - o->attn_entropy[(size_t)h * T + i]));
        }
        for (int j = 0; j < T; j++) oc->max_mass_err = fmax(oc->max_mass_err, fabs(mass[(size_t)h * T + j] - o->attn_mass[(size_t)h * T + j]));
    }
    free(mass);
    free(p);
    return KVQ_OK;
}

START_TEST(test_observe)
{
    char buf[4096];
    const char *path = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!path, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    int T = 40, tok[40];
    make_tokens(tok, T, m.hp.vocab_size);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, T, 0, 0, &e) == KVQ_OK);
    obs_check oc = {.hp = &m.hp, .pos0 = 37};
    kvq_hooks hk = {.user = &oc, .observe = observe_check, .attn_stats = true};
    float *l1 = malloc((size_t)T * m.hp.vocab_size * sizeof(float)), *l2 = malloc((size_t)T * m.hp.vocab_size * sizeof(float));
    kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = 37, .hooks = &hk, .logits = l1};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(oc.calls, m.hp.n_layers);
    fprintf(stderr, "INFO observe: max RoPE rel err %.2e, mass err %.2e, entropy err %.2e\n", oc.max_rope_err, oc.max_mass_err, oc.max_ent_err);
    ck_assert(oc.max_rope_err < 1e-5);
    ck_assert(oc.max_mass_err < 1e-4);
    ck_assert(oc.max_ent_err < 1e-4);
    /* observing (with statistics) does not change the logits */
    io.hooks = NULL;
    io.logits = l2;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
    ck_assert(memcmp(l1, l2, (size_t)T * m.hp.vocab_size * sizeof(float)) == 0);
    free(l1);
    free(l2);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}
END_TEST

typedef struct {
    int mode; /* 0 identity, 1 zero V, 2 copy to alt with bounds i/2, 3 bad bounds */
} tr_state;

static kvq_status transform_test(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)err;
    tr_state *st = user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    if (st->mode == 1) memset(v, 0, n * sizeof(float));
    if (st->mode >= 2) {
        memcpy(alt->k, k, n * sizeof(float));
        memcpy(alt->v, v, n * sizeof(float));
        for (int i = 0; i < c->T; i++) {
            int b = ((i + 2) / 4) * 4; /* non-decreasing, sometimes i+1 (own key from the alternative) */
            alt->k_bound[i] = b < i + 1 ? b : i + 1;
            alt->v_bound[i] = i;
        }
        if (st->mode == 3) alt->v_bound[5] = 0;
        alt->use_k = alt->use_v = true;
    }
    return KVQ_OK;
}

START_TEST(test_transform)
{
    char buf[4096];
    const char *path = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!path, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    int T = 33, V = m.hp.vocab_size, tok[33];
    make_tokens(tok, T, V);
    size_t nl = (size_t)T * V;
    float *base = malloc(nl * sizeof(float)), *got = malloc(nl * sizeof(float));
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, T, 0, 0, &e) == KVQ_OK);
    kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = 3, .logits = base};
    kvq_fwd_result r;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
    tr_state st = {0};
    kvq_hooks hk = {.user = &st, .transform = transform_test};
    io.hooks = &hk;
    io.logits = got;
    for (int stage = 0; stage < 2; stage++) {
        hk.key_stage = stage ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE;
        st.mode = 0; /* identity: bit-identical */
        ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(memcmp(base, got, nl * sizeof(float)) == 0, "identity transform (stage %d) changed the logits", stage);
        st.mode = 2; /* alternative == primary, any boundary: bit-identical */
        ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(memcmp(base, got, nl * sizeof(float)) == 0, "identical alternative (stage %d) changed the logits", stage);
        st.mode = 1; /* zero V: changes the logits */
        ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
        double d = kvq_test_rel_l2_f(got, base, nl);
        ck_assert_msg(d > 1e-2, "zeroing V changed logits by only %.2e", d);
        st.mode = 3; /* malformed boundary: clear error */
        ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, "value boundary[5]") && strstr(e.msg, "layer 0"), "%s", e.msg);
    }
    free(base);
    free(got);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}
END_TEST

/* ---------- prefix ---------- */

typedef struct {
    int P, kvd, only_window; /* capture rows [0, P) of each layer */
    float *k, *v;            /* [n_layers][P][kvd] */
} capture;

static kvq_status observe_capture(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    capture *cp = user;
    size_t n = (size_t)cp->P * cp->kvd;
    memcpy(cp->k + c->layer * n, o->k_post, n * sizeof(float));
    memcpy(cp->v + c->layer * n, o->v, n * sizeof(float));
    return KVQ_OK;
}

static void prefix_case(const char *path)
{
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    int P = 11, T = 21, V = m.hp.vocab_size, kvd = kvq_kv_dim(&m.hp), tok[32];
    make_tokens(tok, P + T, V);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, P + T, P, 0, &e) == KVQ_OK);
    /* one window of P+T tokens */
    float *full = malloc((size_t)(P + T) * V * sizeof(float)), *got = malloc((size_t)T * V * sizeof(float));
    double nll_full[32], nll_got[32];
    kvq_fwd_io io = {.tokens = tok, .T = P + T, .logits = full, .nll = nll_full};
    kvq_fwd_result r;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
    /* the model's own prefix K/V, from the first P tokens */
    capture cp = {.P = P, .kvd = kvd};
    cp.k = malloc((size_t)m.hp.n_layers * P * kvd * sizeof(float));
    cp.v = malloc((size_t)m.hp.n_layers * P * kvd * sizeof(float));
    kvq_hooks hk = {.user = &cp, .observe = observe_capture};
    kvq_fwd_io io1 = {.tokens = tok, .T = P, .hooks = &hk};
    ck_assert(kvq_forward_run(&fw, &io1, &r, &e) == KVQ_OK);
    /* the remaining T tokens at positions P.., attending the prefix; a
     * transform must not see the prefix, so add an identity one too */
    kvq_prefix px = {.P = P, .k = cp.k, .v = cp.v};
    tr_state st = {0};
    kvq_hooks hk2 = {.user = &st, .transform = transform_test};
    int tg[32];
    for (int t = 0; t < T; t++) tg[t] = t + 1 < T ? tok[P + t + 1] : -1;
    kvq_fwd_io io2 = {.tokens = tok + P, .T = T, .pos0 = P, .targets = tg, .prefix = &px, .hooks = &hk2, .logits = got, .nll = nll_got};
    ck_assert_msg(kvq_forward_run(&fw, &io2, &r, &e) == KVQ_OK, "%s", e.msg);
    double d = kvq_test_rel_l2_f(got, full + (size_t)P * V, (size_t)T * V);
    double dn = 0;
    for (int t = 0; t < T - 1; t++) dn = fmax(dn, fabs(nll_got[t] - nll_full[P + t]));
    fprintf(stderr, "INFO prefix %s: logits rel L2 %.2e, max |dNLL| %.2e\n", path, d, dn);
    ck_assert_msg(d < 1e-5, "prefix logits differ: rel L2 %.3e", d);
    ck_assert(dn < 1e-4);
    /* prefix larger than the workspace */
    px.P = P + 1;
    ck_assert(kvq_forward_run(&fw, &io2, &r, &e) == KVQ_EINVAL);
    free(cp.k);
    free(cp.v);
    free(full);
    free(got);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}

START_TEST(test_prefix)
{
    char buf[4096];
    const char *path = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!path, "../shared/models/llama2c absent");
    prefix_case(path);
}
END_TEST

/* ---------- boundaries vs an explicit token-by-token decode loop ---------- */

/* A position-dependent scheme in the style of KIVI: keys are "quantized"
 * (pre-RoPE, rounded to a 1/16 grid; values too) once a chunk of 4 is complete (flushed
 * after use: query i sees kq for j < kb(i) = ((i+1)/4)*4, so i = 3 already
 * sees its own key quantized), values in a sliding full-precision window of
 * the last 5 tokens (vb(i) = max(0, i+1-5)). */
static float quant(float x) { return roundf(x * 16.0f) / 16.0f; }
static int kb_rule(int i) { return ((i + 1) / 4) * 4; }
static int vb_rule(int i) { return i + 1 - 5 > 0 ? i + 1 - 5 : 0; }

typedef struct {
    int step; /* decode: absolute index of the single window token; batched: -1 */
    int kvd, nl;
    /* decode cache, [n_layers][max][kvd]: full and quantized representations */
    float *kf, *kq, *vf, *vq;
    int max;
} kivi_state;

static kvq_status kivi_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)err;
    kivi_state *st = user;
    size_t n = (size_t)c->T * st->kvd;
    for (size_t i = 0; i < n; i++) {
        alt->k[i] = quant(k[i]);
        alt->v[i] = quant(v[i]);
    }
    for (int i = 0; i < c->T; i++) {
        int abs_i = st->step < 0 ? i : st->step; /* the query's index in the sequence */
        int off = st->step < 0 ? 0 : st->step;   /* window key 0's index in the sequence */
        int kb = kb_rule(abs_i) - off, vb = vb_rule(abs_i) - off;
        alt->k_bound[i] = kb < 0 ? 0 : kb;
        alt->v_bound[i] = vb < 0 ? 0 : vb;
    }
    alt->use_k = alt->use_v = true;
    return KVQ_OK;
}

/* decode: store this step's token in the cache (both representations) */
static kvq_status kivi_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    kivi_state *st = user;
    ck_assert_int_eq(c->T, 1);
    ck_assert_ptr_nonnull(o->k_alt);
    size_t off = ((size_t)c->layer * st->max + st->step) * st->kvd;
    memcpy(st->kf + off, o->k_post, st->kvd * sizeof(float));
    memcpy(st->kq + off, o->k_alt, st->kvd * sizeof(float));
    memcpy(st->vf + off, o->v, st->kvd * sizeof(float));
    memcpy(st->vq + off, o->v_alt, st->kvd * sizeof(float));
    return KVQ_OK;
}

static void decode_case(const char *path)
{
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    const int N = 23, V = m.hp.vocab_size, kvd = kvq_kv_dim(&m.hp), L = m.hp.n_layers;
    int tok[23];
    make_tokens(tok, N, V);
    kivi_state st = {.step = -1, .kvd = kvd, .nl = L, .max = N};
    size_t cn = (size_t)L * N * kvd;
    st.kf = malloc(cn * sizeof(float));
    st.kq = malloc(cn * sizeof(float));
    st.vf = malloc(cn * sizeof(float));
    st.vq = malloc(cn * sizeof(float));
    float *batched = malloc((size_t)N * V * sizeof(float)), *dec = malloc((size_t)N * V * sizeof(float));
    double nll_b[23], nll_d[23];
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, N, N, 0, &e) == KVQ_OK);
    kvq_hooks hk = {.user = &st, .transform = kivi_transform, .key_stage = KVQ_KEYS_PRE_ROPE};
    kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hk, .logits = batched, .nll = nll_b};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    double loss_b = r.loss;

    /* decode loop: step i runs one token at position i; its prefix is the
     * cache of tokens 0..i-1, each represented as query i sees it */
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    kvq_hooks hd = {.user = &st, .transform = kivi_transform, .observe = kivi_observe, .key_stage = KVQ_KEYS_PRE_ROPE};
    double loss_d = 0;
    for (int i = 0; i < N; i++) {
        for (int l = 0; l < L; l++)
            for (int j = 0; j < i; j++) {
                size_t src = ((size_t)l * N + j) * kvd, dst = ((size_t)l * i + j) * kvd;
                memcpy(pk + dst, (j < kb_rule(i) ? st.kq : st.kf) + src, kvd * sizeof(float));
                memcpy(pv + dst, (j < vb_rule(i) ? st.vq : st.vf) + src, kvd * sizeof(float));
            }
        kvq_prefix px = {.P = i, .k = pk, .v = pv};
        st.step = i;
        int tg = i + 1 < N ? tok[i + 1] : -1;
        kvq_fwd_io io1 = {.tokens = tok + i, .T = 1, .pos0 = i, .targets = &tg, .prefix = &px, .hooks = &hd,
                          .logits = dec + (size_t)i * V, .nll = nll_d + i};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &r, &e) == KVQ_OK, "%s", e.msg);
        if (i + 1 < N) loss_d += nll_d[i];
    }
    loss_d /= N - 1;
    double d = kvq_test_rel_l2_f(batched, dec, (size_t)N * V), dl = fabs(loss_b - loss_d) / loss_d;
    /* the scheme matters: the plain pass differs */
    kvq_fwd_io io0 = {.tokens = tok, .T = N, .logits = dec};
    ck_assert(kvq_forward_run(&fw, &io0, &r, &e) == KVQ_OK);
    double d0 = kvq_test_rel_l2_f(batched, dec, (size_t)N * V);
    ck_assert_msg(d0 > 1e-3, "the test scheme barely changes the logits (%.2e)", d0);
    fprintf(stderr, "INFO decode %s: batched loss %.8f, decode loss %.8f (rel %.2e), logits rel L2 %.2e\n", path, loss_b, loss_d, dl, d);
    ck_assert_msg(d < 1e-5, "batched boundary pass differs from decode: rel L2 %.3e", d);
    ck_assert(dl < 1e-5);
    free(pk);
    free(pv);
    free(st.kf);
    free(st.kq);
    free(st.vf);
    free(st.vq);
    free(batched);
    free(dec);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}

START_TEST(test_boundary_decode)
{
    char buf[4096];
    const char *p = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    decode_case(p);
    p = kvq_test_shared(buf, sizeof buf, "models/llama2c/aidreams260K.bin");
    decode_case(p);
}
END_TEST

/* ---------- streamed LM-head outputs (kvq_fwd_head: kveval's KL divergence) ---------- */

/* perturb K and V of every layer a little (a stand-in for a quantizer): x += 0.05 * |x| * pattern */
static kvq_status perturb_kv(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)err;
    (void)alt;
    const double amp = *(const double *)user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    for (size_t i = 0; i < n; i++) {
        double f = amp * (((i * 2654435761u + (size_t)c->layer * 97u) % 17) / 8.0 - 1.0);
        k[i] += (float)(f * fabs(k[i]));
        v[i] += (float)(f * fabs(v[i]));
    }
    return KVQ_OK;
}

/* The blocked LM head's lse, argmax and expectation (several vocabulary blocks) equal those computed
 * from the full logits, and KL(P_a || P_b) = (h_a - h_b) . e_a - lse_a + lse_b equals the direct sum
 * over the vocabulary (float64 from both runs' full logits) on every scored row; the NLL is the same
 * bits with and without the head outputs; rows not scored are left alone. */
START_TEST(test_head_kld_streamed)
{
    char buf[4096];
    const char *path = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!path, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    const int T = 40, V = m.hp.vocab_size, dim = m.hp.dim;
    int tok[40], tg[40];
    make_tokens(tok, T, V);
    for (int t = 0; t < T; t++) tg[t] = t >= 5 && t + 1 < T && t != 20 ? tok[t + 1] : -1; /* a gap inside the span */
    float *lg[2], *hid[2], *ex[2];
    double *lse[2], *nll[3];
    int *am[2];
    for (int r = 0; r < 2; r++) {
        lg[r] = malloc((size_t)T * V * sizeof(float));
        hid[r] = malloc((size_t)T * dim * sizeof(float));
        ex[r] = malloc((size_t)T * dim * sizeof(float));
        lse[r] = malloc(T * sizeof(double));
        am[r] = malloc(T * sizeof(int));
    }
    for (int r = 0; r < 3; r++) nll[r] = malloc(T * sizeof(double));
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, T, 0, 0, &e) == KVQ_OK);
    fw.v_chunk = 100; /* 6 vocabulary blocks, the last partial */
    double amp[2] = {0, 0.05};
    for (int r = 0; r < 2; r++) {
        kvq_hooks hk = {.user = &amp[r], .transform = perturb_kv, .key_stage = KVQ_KEYS_POST_ROPE};
        kvq_fwd_io io = {.tokens = tok, .T = T, .targets = tg, .hooks = r ? &hk : NULL, .logits = lg[r]};
        kvq_fwd_result res;
        ck_assert(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK);
        for (int t = 0; t < T; t++) ex[r][t * dim] = 12345.0f; /* sentinel: rows not scored stay untouched */
        kvq_fwd_head h = {.hidden = hid[r], .lse = lse[r], .argmax = am[r], .expect = ex[r]};
        io.logits = NULL;
        io.head = &h;
        io.nll = nll[r];
        ck_assert(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK);
        io.head = NULL;
        io.nll = nll[2];
        ck_assert(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK);
        for (int t = 0; t < T; t++) /* the head outputs do not change the loss */
            ck_assert(tg[t] < 0 ? isnan(nll[r][t]) && isnan(nll[2][t]) : nll[r][t] == nll[2][t]);
        /* against the full logits */
        kvq_fwd_head hf = {.lse = malloc(T * sizeof(double)), .argmax = malloc(T * sizeof(int)),
                           .expect = malloc((size_t)T * dim * sizeof(float))};
        ck_assert(kvq_fwd_head_from_logits(&m, lg[r], NULL, tg, T, &hf, &e) == KVQ_OK);
        for (int t = 0; t < T; t++) {
            if (tg[t] < 0) {
                ck_assert(isnan(lse[r][t]) && am[r][t] == -1 && ex[r][t * dim] == 12345.0f);
                continue;
            }
            ck_assert_int_eq(am[r][t], hf.argmax[t]);
            ck_assert_msg(fabs(lse[r][t] - hf.lse[t]) < 1e-5, "row %d: lse %.9f vs %.9f", t, lse[r][t], hf.lse[t]);
            double rel = kvq_test_rel_l2_f(ex[r] + (size_t)t * dim, hf.expect + (size_t)t * dim, dim);
            ck_assert_msg(rel < 1e-5, "row %d: expectation differs by %.3e", t, rel);
        }
        free(hf.lse);
        free(hf.argmax);
        free(hf.expect);
    }
    /* hidden: the LM head's input reproduces the logits */
    for (int t = 0; t < T; t++)
        for (int v = 0; v < V; v += 37) {
            double z = 0;
            for (int c = 0; c < dim; c++) z += (double)hid[1][t * dim + c] * kvq_mat_f32(&m.output)[(size_t)v * dim + c];
            ck_assert_msg(fabs(z - lg[1][(size_t)t * V + v]) < 1e-4, "row %d col %d: %.6f vs %.6f", t, v, z, lg[1][(size_t)t * V + v]);
        }
    /* KL(P_0 || P_1): streamed formula vs the direct sum in float64; top-1 agreement likewise */
    double worst = 0, mean = 0;
    int n = 0, same = 0, same_direct = 0;
    for (int t = 0; t < T; t++) {
        if (tg[t] < 0) continue;
        const float *za = lg[0] + (size_t)t * V, *zb = lg[1] + (size_t)t * V;
        double ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0;
        int aa = 0, ab = 0;
        for (int v = 0; v < V; v++) {
            if (za[v] > ma) { ma = za[v]; aa = v; }
            if (zb[v] > mb) { mb = zb[v]; ab = v; }
        }
        for (int v = 0; v < V; v++) {
            sa += exp(za[v] - ma);
            sb += exp(zb[v] - mb);
        }
        const double la = ma + log(sa), lb = mb + log(sb);
        double kl = 0;
        for (int v = 0; v < V; v++) {
            const double lpa = za[v] - la, lpb = zb[v] - lb;
            kl += exp(lpa) * (lpa - lpb);
        }
        double dot = 0;
        for (int c = 0; c < dim; c++) dot += ((double)hid[0][t * dim + c] - hid[1][t * dim + c]) * ex[0][t * dim + c];
        const double ks = dot - lse[0][t] + lse[1][t];
        worst = fmax(worst, fabs(ks - kl) / (1e-6 + kl));
        mean += kl;
        n++;
        same += am[0][t] == am[1][t];
        same_direct += aa == ab;
    }
    mean /= n;
    fprintf(stderr, "INFO head: mean KLD %.6f over %d rows, worst relative deviation of the streamed formula %.2e, same top %d\n",
            mean, n, worst, same);
    ck_assert_msg(mean > 1e-4, "the perturbation changed nothing (mean KLD %.3e): the test cannot fail", mean);
    ck_assert_msg(worst < 1e-3, "streamed KL divergence deviates by %.3e (relative)", worst);
    ck_assert_int_eq(same, same_direct);
    kvq_forward_free(&fw);
    for (int r = 0; r < 2; r++) {
        free(lg[r]);
        free(hid[r]);
        free(ex[r]);
        free(lse[r]);
        free(am[r]);
    }
    for (int r = 0; r < 3; r++) free(nll[r]);
    kvq_model_free(&m);
}
END_TEST

/* ---------- long windows: memory linear in the window (kveval --ctx max) ---------- */

static size_t heap_in_use(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd; /* small blocks in the arenas + mmap'd large ones */
}

/* The forward's workspace for a window of T tokens grows linearly with T — attention keeps one row of P + T
 * scores per thread, never a [T][T] matrix (attention.h) — so the default model's trained context (8192)
 * needs ~0.2 GiB on the CPU; and a window that long runs, its NLL finite and equal to the same tokens' first
 * part where the windows overlap (causality). */
START_TEST(test_long_window_memory)
{
    kvq_model m = {0};
    kvq_err e = {0};
    /* the default model's shape (SmolLM2-135M: 30 layers, dim 576, 9/3 heads, hidden 1536, vocab 49152); no weights needed */
    m.hp = (kvq_hparams){.n_layers = 30, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                         .vocab_size = 49152, .ctx_len = 8192, .rope_dim = 64, .rope_theta = 100000, .norm_eps = 1e-5f};
    /* matrices described as fp32 (kvq_mat type 0) without data: the workspace needs no weight scratch */
    kvq_layer_weights *lw = calloc((size_t)m.hp.n_layers, sizeof *lw);
    ck_assert_ptr_nonnull(lw);
    m.layers = lw;
    size_t bytes[3];
    const int Ts[3] = {2048, 4096, 8192};
    for (int i = 0; i < 3; i++) {
        kvq_forward fw;
        size_t b0 = heap_in_use();
        ck_assert_msg(kvq_forward_init(&fw, &m, Ts[i], 0, 0, &e) == KVQ_OK, "%s", e.msg);
        bytes[i] = heap_in_use() - b0;
        kvq_forward_free(&fw);
    }
    fprintf(stderr, "INFO forward workspace: T 2048 %.1f MiB, 4096 %.1f MiB, 8192 %.1f MiB\n", bytes[0] / 1048576.0,
            bytes[1] / 1048576.0, bytes[2] / 1048576.0);
    /* linear: doubling T at most doubles it (plus a little); a [T][T] buffer would quadruple it */
    ck_assert_msg(bytes[1] <= 2.05 * bytes[0] && bytes[2] <= 2.05 * bytes[1], "workspace grows faster than the window: %zu %zu %zu",
                  bytes[0], bytes[1], bytes[2]);
    ck_assert_msg(bytes[2] < ((size_t)512 << 20), "workspace at 8192 tokens: %zu bytes", bytes[2]);
    free(lw);
    /* a long window on a small synthetic model: runs; its first rows equal a shorter window's */
    kvq_hparams hp = {.n_layers = 2, .dim = 32, .hidden_dim = 64, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8, .vocab_size = 64,
                      .ctx_len = 8192, .rope_dim = 8, .rope_theta = 10000, .norm_eps = 1e-5f, .tied_embeddings = false};
    kvq_model sm;
    ck_assert(kvq_model_alloc(&sm, &hp, &e) == KVQ_OK);
    uint32_t x = 99;
    float *all[] = {kvq_mat_f32(&sm.tok_embd), kvq_mat_f32(&sm.output)};
    size_t nall[] = {(size_t)64 * 32, (size_t)64 * 32};
    for (int a = 0; a < 2; a++)
        for (size_t i = 0; i < nall[a]; i++) all[a][i] = ((x = x * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    for (int i = 0; i < 32; i++) sm.out_norm[i] = 1;
    for (int l = 0; l < 2; l++) {
        kvq_layer_weights *w = &sm.layers[l];
        float *ws[] = {kvq_mat_f32(&w->wq), kvq_mat_f32(&w->wk),     kvq_mat_f32(&w->wv),  kvq_mat_f32(&w->wo),
                        kvq_mat_f32(&w->w_gate), kvq_mat_f32(&w->w_up), kvq_mat_f32(&w->w_down)};
        size_t ns[] = {32 * 32, 16 * 32, 16 * 32, 32 * 32, 64 * 32, 64 * 32, 32 * 64};
        for (int k = 0; k < 7; k++)
            for (size_t i = 0; i < ns[k]; i++) ws[k][i] = (((x = x * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f) * 0.3f;
        for (int i = 0; i < 32; i++) w->attn_norm[i] = w->ffn_norm[i] = 1;
    }
    const int T = 8192;
    int *tok = malloc(T * sizeof(int));
    make_tokens(tok, T, 64);
    double *nl = malloc(T * sizeof(double)), *ns = malloc(T * sizeof(double));
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &sm, T, 0, 0, &e) == KVQ_OK);
    kvq_fwd_io io = {.tokens = tok, .T = T, .nll = nl};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(isfinite(r.loss) && r.n_scored == T - 1);
    io.T = 300;
    io.nll = ns;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
    for (int t = 0; t + 1 < 300; t++) ck_assert_msg(fabs(nl[t] - ns[t]) <= 1e-6 * fabs(ns[t]) + 1e-9, "row %d: %.9g vs %.9g", t, nl[t], ns[t]);
    kvq_forward_free(&fw);
    free(tok);
    free(nl);
    free(ns);
    kvq_model_free(&sm);
}
END_TEST

/* ---------- checkpoints, threads, errors ---------- */

START_TEST(test_save_inputs_threads_errors)
{
    char buf[4096];
    const char *path = tiny_path(buf, sizeof buf);
    KVQ_SKIP_IF(!path, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    const int T = 30, V = m.hp.vocab_size, dim = m.hp.dim, L = m.hp.n_layers;
    int tok[30];
    make_tokens(tok, T, V);
    float *l1 = malloc((size_t)T * V * sizeof(float)), *l2 = malloc((size_t)T * V * sizeof(float));
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, T, 0, KVQ_FWD_SAVE_LAYER_INPUTS, &e) == KVQ_OK);
    kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = 2, .logits = l1};
    kvq_fwd_result r;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
    /* layer 0 input = embedding rows; final checkpoint reproduces the logits */
    const float *x0 = kvq_forward_layer_input(&fw, 0), *xl = kvq_forward_layer_input(&fw, L);
    ck_assert_ptr_nonnull(x0);
    ck_assert_ptr_nonnull(xl);
    ck_assert_ptr_null(kvq_forward_layer_input(&fw, L + 1));
    for (int t = 0; t < T; t++) ck_assert(memcmp(x0 + (size_t)t * dim, kvq_mat_f32(&m.tok_embd) + (size_t)tok[t] * dim, dim * sizeof(float)) == 0);
    double num = 0, den = 0;
    for (int t = 0; t < T; t++) {
        double ss = 0;
        for (int c = 0; c < dim; c++) ss += (double)xl[t * dim + c] * xl[t * dim + c];
        double rs = 1 / sqrt(ss / dim + m.hp.norm_eps);
        for (int v = 0; v < V; v++) {
            double z = 0;
            for (int c = 0; c < dim; c++) z += xl[t * dim + c] * rs * m.out_norm[c] * kvq_mat_f32(&m.output)[(size_t)v * dim + c];
            num += (z - l1[(size_t)t * V + v]) * (z - l1[(size_t)t * V + v]);
            den += z * z;
        }
    }
    ck_assert_msg(sqrt(num / den) < 1e-5, "final checkpoint does not reproduce logits: %.3e", sqrt(num / den));
    /* the OpenMP thread count does not change a bit */
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    kvq_forward fw1;
    ck_assert(kvq_forward_init(&fw1, &m, T, 0, 0, &e) == KVQ_OK);
    omp_set_num_threads(nt);
    io.logits = l2;
    ck_assert(kvq_forward_run(&fw1, &io, &r, &e) == KVQ_OK);
    ck_assert(memcmp(l1, l2, (size_t)T * V * sizeof(float)) == 0);
    kvq_forward_free(&fw1);
    /* errors */
    io.T = T + 1;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "expected 1..30"));
    io.T = T;
    tok[7] = V;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "window index 7"));
    tok[7] = 0;
    io.pos0 = -1;
    ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_EINVAL);
    ck_assert(kvq_forward_init(&fw1, &m, 0, 0, 0, &e) == KVQ_EINVAL);
    free(l1);
    free(l2);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("forward");
    TCase *tc = tcase_create("forward");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_ref_stories);
    tcase_add_test(tc, test_ref_aidreams);
    tcase_add_test(tc, test_ref_default_model);
    tcase_add_test(tc, test_observe);
    tcase_add_test(tc, test_transform);
    tcase_add_test(tc, test_prefix);
    tcase_add_test(tc, test_boundary_decode);
    tcase_add_test(tc, test_save_inputs_threads_errors);
    tcase_add_test(tc, test_head_kld_streamed);
    tcase_add_test(tc, test_long_window_memory);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
