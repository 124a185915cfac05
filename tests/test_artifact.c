/* test_artifact.c — calibration artifact: fit → write twice → byte-identical
 * (also across a fresh re-fit), read back equal, every method's layout, bad
 * parameters rejected naming the field (and no file written), newer schema
 * and wrong schema rejected, tensor shape checks, the fingerprint check and
 * its override warning, and the --inspect summary. */
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>

#include "artifact.h"
#include "family.h"
#include "kvq_test.h"
#include "safetensors.h"
#include "tables.h"

/* scratch files live in the git-ignored build/ tree, never in /tmp */
static const char *tmp_path(char *buf, size_t n, const char *name)
{
    mkdir("build", 0755);
    mkdir("build/tmp", 0755);
    mkdir("build/tmp/test_artifact", 0755);
    snprintf(buf, n, "build/tmp/test_artifact/%s", name);
    return buf;
}

static unsigned char *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static uint64_t rng_state;
static double unif(void)
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

enum { L = 2, H = 2, HD = 8, D = H * HD, T = 1024, SL = 256 };

/* Calibrate a small synthetic "model" (2 layers) into an nuq3-1% artifact. */
static void build_nuq(kvq_artifact *a, bool per_head)
{
    memset(a, 0, sizeof *a);
    kvq_artifact_params *p = &a->p;
    p->method = KVQ_FAM("nuq");
    p->k_bits = p->v_bits = 3;
    p->outlier_frac = 0.01;
    p->n_sink = 1;
    p->per_head = per_head;
    p->fisher = true;
    snprintf(p->fit, sizeof p->fit, "auto");
    p->n_layers = L;
    p->n_kv_heads = H;
    p->head_dim = HD;
    snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "sha256:%064d", 7);
    snprintf(p->dump_fingerprint, sizeof p->dump_fingerprint, "dump-sha256:%064d", 9);
    kvq_err e = {0};
    ck_assert(kvq_calib_fill_bits(p, 2048, &e) == KVQ_OK);
    a->k = calloc(L, sizeof *a->k);
    a->v = calloc(L, sizeof *a->v);
    float *k = malloc(T * D * sizeof *k), *v = malloc(T * D * sizeof *v), *f = malloc(T * D * sizeof *f);
    rng_state = 77;
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_sink = 1, .sample_len = SL, .n_kv_heads = H,
                        .head_dim = HD, .per_head = per_head};
    for (int l = 0; l < L; l++) {
        for (size_t i = 0; i < (size_t)T * D; i++) {
            k[i] = (float)((double)(i % D) * 0.3 + gauss() / (0.3 + fabs(gauss())));
            v[i] = (float)gauss();
            double g = gauss();
            f[i] = (float)(g * g);
        }
        ck_assert_msg(kvq_calib_keys(k, f, T, &o, &a->k[l], &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_calib_values(v, f, T, &o, &a->v[l], &e) == KVQ_OK, "%s", e.msg);
    }
    free(k); free(v); free(f);
}

static void assert_same_params(const kvq_artifact_params *x, const kvq_artifact_params *y)
{
    ck_assert(x->method == y->method && x->k_bits == y->k_bits && x->v_bits == y->v_bits);
    ck_assert(x->outlier_frac == y->outlier_frac && x->n_sink == y->n_sink);
    ck_assert(x->post_rope == y->post_rope && x->per_head == y->per_head && x->fisher == y->fisher);
    ck_assert(x->group_size == y->group_size && x->residual_length == y->residual_length);
    ck_assert_str_eq(x->fit, y->fit);
    ck_assert(x->n_layers == y->n_layers && x->n_kv_heads == y->n_kv_heads && x->head_dim == y->head_dim);
    ck_assert(x->bits_k == y->bits_k && x->bits_v == y->bits_v && x->bits_ctx == y->bits_ctx);
    ck_assert_str_eq(x->model_fingerprint, y->model_fingerprint);
    ck_assert_str_eq(x->dump_fingerprint, y->dump_fingerprint);
}

static void assert_same_table(const kvq_kv_table *x, const kvq_kv_table *y)
{
    ck_assert_int_eq(x->bits, y->bits);
    ck_assert_uint_eq(x->n_tables, y->n_tables);
    ck_assert_uint_eq(x->kv_dim, y->kv_dim);
    size_t nl = (size_t)1 << x->bits;
    ck_assert((x->levels == NULL) == (y->levels == NULL));
    if (x->levels) {
        ck_assert(memcmp(x->levels, y->levels, x->n_tables * nl * sizeof(float)) == 0);
        ck_assert(memcmp(x->obj_lloyd, y->obj_lloyd, x->n_tables * sizeof(double)) == 0);
        ck_assert(memcmp(x->obj_exact, y->obj_exact, x->n_tables * sizeof(double)) == 0);
        ck_assert(memcmp(x->chosen, y->chosen, x->n_tables) == 0);
    }
    ck_assert((x->channel_lower == NULL) == (y->channel_lower == NULL));
    if (x->channel_lower) {
        ck_assert(memcmp(x->channel_lower, y->channel_lower, x->kv_dim * sizeof(float)) == 0);
        ck_assert(memcmp(x->channel_upper, y->channel_upper, x->kv_dim * sizeof(float)) == 0);
    }
    ck_assert(x->n_elems == y->n_elems && x->n_outliers == y->n_outliers && x->n_points == y->n_points);
}

START_TEST(test_determinism_and_round_trip)
{
    for (int per_head = 0; per_head < 2; per_head++) {
        kvq_artifact a, b, r;
        build_nuq(&a, per_head);
        build_nuq(&b, per_head); /* a fresh, independent fit of the same inputs */
        char p1[512], p2[512], p3[512];
        kvq_err e = {0};
        ck_assert_msg(kvq_artifact_write(tmp_path(p1, sizeof p1, "a1.safetensors"), &a, &e) == KVQ_OK, "%s", e.msg);
        ck_assert(kvq_artifact_write(tmp_path(p2, sizeof p2, "a2.safetensors"), &a, &e) == KVQ_OK);
        ck_assert(kvq_artifact_write(tmp_path(p3, sizeof p3, "b.safetensors"), &b, &e) == KVQ_OK);
        size_t n1, n2, n3;
        unsigned char *x1 = slurp(p1, &n1), *x2 = slurp(p2, &n2), *x3 = slurp(p3, &n3);
        ck_assert(n1 == n2 && memcmp(x1, x2, n1) == 0);
        ck_assert_msg(n1 == n3 && memcmp(x1, x3, n1) == 0, "re-fit of the same inputs is not byte-identical");
        free(x1); free(x2); free(x3);
        ck_assert_msg(kvq_artifact_read(p1, &r, &e) == KVQ_OK, "%s", e.msg);
        kvq_test_python("check_artifact.py", p1); /* an independent reader: Python safetensors against ARTIFACT.md */
        assert_same_params(&r.p, &a.p);
        for (int l = 0; l < L; l++) {
            assert_same_table(&r.k[l], &a.k[l]);
            /* the loader rounds nuq's value levels to fp16 (the format's LUT, formats/KVCACHE.md "Precision") */
            for (size_t j = 0; j < a.v[l].n_tables * ((size_t)1 << a.v[l].bits); j++) a.v[l].levels[j] = kvq_round_fp16(a.v[l].levels[j]);
            assert_same_table(&r.v[l], &a.v[l]);
        }
        ck_assert_uint_eq(r.k[0].n_tables, per_head ? H : 1);
        /* the file is plain safetensors with the documented names */
        kvq_safetensors st;
        ck_assert(kvq_safetensors_open(p1, &st, &e) == KVQ_OK);
        const kvq_st_tensor *t = kvq_safetensors_find(&st, "layers.1.k.levels");
        ck_assert_ptr_nonnull(t);
        ck_assert(t->dtype == KVQ_ST_F32 && t->n_dims == (per_head ? 2u : 1u));
        ck_assert_ptr_nonnull(kvq_safetensors_find(&st, "layers.0.k.channel_upper"));
        ck_assert_ptr_nonnull(kvq_safetensors_find(&st, "layers.1.v.fit_objective"));
        ck_assert_ptr_null(kvq_safetensors_find(&st, "layers.0.v.channel_upper"));
        ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.method"), "nuq");
        ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.key_position"), "pre-rope");
        ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.outlier_fraction"), "0.01");
        kvq_safetensors_close(&st);
        kvq_artifact_free(&a);
        kvq_artifact_free(&b);
        kvq_artifact_free(&r);
    }
}
END_TEST

START_TEST(test_other_methods)
{
    kvq_err e = {0};
    char p[512];
    tmp_path(p, sizeof p, "m.safetensors");
    /* KIVI: no tables, parameters only */
    kvq_artifact a = {0}, r;
    a.p = (kvq_artifact_params){.method = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group_size = 4,
                                .residual_length = 8, .n_layers = 3, .n_kv_heads = H, .head_dim = HD, .post_rope = true};
    ck_assert(kvq_calib_fill_bits(&a.p, 64, &e) == KVQ_OK);
    ck_assert_double_eq_tol(a.p.bits_k, (56.0 * (2 + 32.0 / 4) + 8 * 16) / 64, 1e-12);
    ck_assert_msg(kvq_artifact_write(p, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_artifact_read(p, &r, &e) == KVQ_OK, "%s", e.msg);
    assert_same_params(&r.p, &a.p);
    ck_assert(!r.k && !r.v);
    kvq_test_python("check_artifact.py", p);
    kvq_artifact_free(&r);
    /* int per-token */
    a.p = (kvq_artifact_params){.method = KVQ_FAM("int"), .k_bits = 4, .v_bits = 4, .n_layers = 3, .n_kv_heads = H,
                                .head_dim = HD};
    ck_assert(kvq_artifact_write(p, &a, &e) == KVQ_OK);
    ck_assert(kvq_artifact_read(p, &r, &e) == KVQ_OK && r.p.method == KVQ_FAM("int"));
    kvq_artifact_free(&r);
    /* int with per-channel keys: thresholds only */
    a.p = (kvq_artifact_params){.method = KVQ_FAM("int-pc"), .k_bits = 3, .v_bits = 3, .outlier_frac = 0.01,
                                .n_layers = 1, .n_kv_heads = H, .head_dim = HD};
    a.k = calloc(1, sizeof *a.k);
    float k[64 * D];
    rng_state = 5;
    for (size_t i = 0; i < 64 * D; i++) k[i] = (float)gauss();
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.01, .n_kv_heads = H, .head_dim = HD};
    ck_assert(kvq_calib_int_pc_keys(k, 64, &o, &a.k[0], &e) == KVQ_OK);
    ck_assert_msg(kvq_artifact_write(p, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_artifact_read(p, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_nonnull(r.k);
    ck_assert_ptr_null(r.v);
    assert_same_table(&r.k[0], &a.k[0]);
    kvq_test_python("check_artifact.py", p);
    kvq_artifact_free(&r);
    kvq_artifact_free(&a);
}
END_TEST

START_TEST(test_bad_params)
{
    kvq_artifact a;
    build_nuq(&a, false);
    char p[512];
    tmp_path(p, sizeof p, "bad.safetensors");
    kvq_err e = {0};
    kvq_artifact_params keep = a.p;
#define EXPECT_BAD(stmt, field)                                                                      \
    do {                                                                                             \
        a.p = keep;                                                                                  \
        stmt;                                                                                        \
        unlink(p);                                                                                   \
        ck_assert_int_eq(kvq_artifact_write(p, &a, &e), KVQ_EINVAL);                                 \
        ck_assert_msg(strstr(e.msg, field) != NULL, "message '%s' lacks '%s'", e.msg, field);        \
        ck_assert_int_ne(access(p, F_OK), 0);                                                        \
    } while (0)
    EXPECT_BAD(a.p.k_bits = 9, "k_bits: expected 1..8, found 9");
    EXPECT_BAD(a.p.k_bits = 0, "k_bits");
    EXPECT_BAD(a.p.v_bits = 9, "v_bits");
    EXPECT_BAD(a.p.outlier_frac = 0.5, "outlier_fraction: expected [0, 0.5), found 0.5");
    EXPECT_BAD(a.p.outlier_frac = -0.01, "outlier_fraction");
    EXPECT_BAD(a.p.outlier_frac = NAN, "outlier_fraction");
    EXPECT_BAD(a.p.n_layers = 0, "n_layers");
    EXPECT_BAD(snprintf(a.p.fit, sizeof a.p.fit, "kmeans"), "fit");
    EXPECT_BAD(a.p.k_bits = 4, "layers.0.k: table bits 3, expected k_bits 4");
    EXPECT_BAD(a.k[1].levels[3] = 2.0f, "layers.1.k.levels[0][3]");
    a.k[1].levels[3] = a.k[1].levels[4];
    EXPECT_BAD(a.k[0].channel_lower[5] = NAN, "layers.0.k.channel_lower[5]: not finite");
    a.k[0].channel_lower[5] = -1;
    EXPECT_BAD(a.p.per_head = true, "layers.0.k: 1 datatypes, expected 2 (per-head)");
    /* degenerate tables (issue 41: an artifact whose nuq levels were all equal was accepted): every kind of table —
     * key and value datatypes, per-layer and per-head, per-channel thresholds — refused naming the tensor */
    {
        const size_t nl = 8;
        float kl[8], vl[8], clo[D], cup[D];
        memcpy(kl, a.k[1].levels, sizeof kl);
        memcpy(vl, a.v[0].levels, sizeof vl);
        memcpy(clo, a.k[0].channel_lower, sizeof clo);
        memcpy(cup, a.k[0].channel_upper, sizeof cup);
        for (size_t j = 0; j < nl; j++) a.k[1].levels[j] = 0.25f; /* all equal */
        EXPECT_BAD((void)0, "layers.1.k.levels[0]: degenerate datatype: its 8 levels span 0 (from 0.25 to 0.25)");
        memcpy(a.k[1].levels, kl, sizeof kl);
        for (size_t j = 0; j < nl; j++) a.v[0].levels[j] = -0.5f + 1e-4f * (float)j; /* nearly equal */
        EXPECT_BAD((void)0, "layers.0.v.levels[0]: degenerate datatype");
        memcpy(a.v[0].levels, vl, sizeof vl);
        for (size_t c = 0; c < D; c++) a.k[0].channel_upper[c] = a.k[0].channel_lower[c];
        EXPECT_BAD((void)0, "layers.0.k.channel_lower/upper: degenerate thresholds: lower == upper in all 16 channels");
        /* one constant channel is fine (it is reproduced exactly) */
        memcpy(a.k[0].channel_upper, cup, sizeof cup);
        a.k[0].channel_upper[3] = a.k[0].channel_lower[3];
        a.p = keep;
        unlink(p);
        ck_assert_msg(kvq_artifact_write(p, &a, &e) == KVQ_OK, "%s", e.msg);
        memcpy(a.k[0].channel_lower, clo, sizeof clo);
        memcpy(a.k[0].channel_upper, cup, sizeof cup);
        /* per-head datatypes: the second head's */
        kvq_artifact ph;
        build_nuq(&ph, true);
        for (size_t j = 0; j < nl; j++) ph.k[0].levels[nl + j] = 0.0f;
        ck_assert_int_eq(kvq_artifact_validate(&ph, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, "layers.0.k.levels[1]: degenerate datatype"), "%s", e.msg);
        kvq_artifact_free(&ph);
        /* a file holding one is refused on reading too (a hand-edited or foreign artifact) */
        char q[512];
        tmp_path(q, sizeof q, "degenerate.safetensors");
        unlink(q);
        ck_assert(kvq_artifact_write(q, &a, &e) == KVQ_OK);
        size_t n = 0;
        unsigned char *bytes = slurp(q, &n);
        kvq_safetensors st;
        ck_assert(kvq_safetensors_open(q, &st, &e) == KVQ_OK);
        const kvq_st_tensor *lt = NULL;
        for (size_t i = 0; i < st.n_tensors; i++)
            if (!strcmp(st.tensors[i].name, "layers.0.v.levels")) lt = &st.tensors[i];
        ck_assert_ptr_nonnull(lt);
        const size_t off = (size_t)(lt->data - st.map);
        kvq_safetensors_close(&st);
        for (size_t j = 0; j < nl; j++) memcpy(bytes + off + 4 * j, &(float){0.5f}, 4);
        FILE *f = fopen(q, "wb");
        ck_assert(f && fwrite(bytes, 1, n, f) == n);
        fclose(f);
        free(bytes);
        kvq_artifact r;
        ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, "layers.0.v.levels[0]: degenerate datatype"), "%s", e.msg);
        unlink(q);
    }
    /* fp8 scales of zero, negative or not finite: the same rule for the other table kind */
    {
        kvq_artifact f8 = {0};
        f8.p = (kvq_artifact_params){.method = KVQ_FAM("fp8"), .k_bits = 8, .v_bits = 8, .n_layers = 1, .n_kv_heads = H,
                                     .head_dim = HD, .post_rope = true, .fp8_percentile = 100};
        f8.k = calloc(1, sizeof *f8.k);
        f8.v = calloc(1, sizeof *f8.v);
        float ks[1] = {2.0f}, vs[1] = {1.0f};
        f8.k[0].fp8_scale = ks;
        f8.k[0].n_fp8_scales = 1;
        f8.v[0].fp8_scale = vs;
        f8.v[0].n_fp8_scales = 1;
        ck_assert_msg(kvq_artifact_validate(&f8, &e) == KVQ_OK, "%s", e.msg);
        const float bad[3] = {0.0f, -1.0f, NAN};
        for (int i = 0; i < 3; i++) {
            vs[0] = bad[i];
            ck_assert_int_eq(kvq_artifact_validate(&f8, &e), KVQ_EINVAL);
            ck_assert_msg(strstr(e.msg, "layers.0.v.fp8_scale[0]: expected finite and > 0"), "%s", e.msg);
        }
        free(f8.k);
        free(f8.v);
    }
    kvq_artifact kv = {0};
    kv.p = (kvq_artifact_params){.method = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group_size = 4,
                                 .residual_length = 6, .n_layers = 1, .n_kv_heads = H, .head_dim = HD};
    ck_assert_int_eq(kvq_artifact_write(p, &kv, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "residual_length"));
    kv.p.residual_length = 8;
    kv.p.outlier_frac = 0.01;
    ck_assert_int_eq(kvq_artifact_write(p, &kv, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "outlier_fraction"));
    a.p = keep;
    kvq_artifact_free(&a);
}
END_TEST

/* Rewrite an artifact's file with one metadata value replaced (or removed, value NULL) or one tensor renamed. */
static void rewrite(const char *src, const char *dst, const char *key, const char *value, const char *drop_tensor)
{
    kvq_safetensors st;
    kvq_err e = {0};
    ck_assert(kvq_safetensors_open(src, &st, &e) == KVQ_OK);
    kvq_st_entry *te = calloc(st.n_tensors + 1, sizeof *te);
    kvq_st_kv *m = calloc(st.n_meta + 1, sizeof *m);
    size_t nt = 0, nm = 0;
    for (size_t i = 0; i < st.n_tensors; i++) {
        const kvq_st_tensor *t = &st.tensors[i];
        if (drop_tensor && strcmp(t->name, drop_tensor) == 0) continue;
        te[nt] = (kvq_st_entry){t->name, t->dtype, t->n_dims, {0}, t->data};
        memcpy(te[nt].shape, t->shape, sizeof t->shape);
        nt++;
    }
    for (size_t i = 0; i < st.n_meta; i++) {
        if (key && strcmp(st.meta[i].key, key) == 0) {
            if (!value) continue;
            m[nm++] = (kvq_st_kv){st.meta[i].key, value};
        } else {
            m[nm++] = (kvq_st_kv){st.meta[i].key, st.meta[i].value};
        }
    }
    ck_assert(kvq_safetensors_write(dst, te, nt, m, nm, &e) == KVQ_OK);
    kvq_safetensors_close(&st);
    free(te);
    free(m);
}

START_TEST(test_read_rejects)
{
    kvq_artifact a, r;
    build_nuq(&a, false);
    char p[512], q[512];
    tmp_path(p, sizeof p, "good.safetensors");
    tmp_path(q, sizeof q, "edited.safetensors");
    kvq_err e = {0};
    ck_assert(kvq_artifact_write(p, &a, &e) == KVQ_OK);
    rewrite(p, q, "kvq.schema_version", "2", NULL);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(e.msg, "newer than this build supports"));
    rewrite(p, q, "kvq.schema", "something-else", NULL);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "kvq.schema"));
    rewrite(p, q, "kvq.k_bits", NULL, NULL);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "metadata 'kvq.k_bits' missing"));
    rewrite(p, q, "kvq.k_bits", "3x", NULL);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "kvq.k_bits"));
    rewrite(p, q, "kvq.k_bits", "12", NULL);
    ck_assert(kvq_artifact_read(q, &r, &e) != KVQ_OK);
    ck_assert_ptr_nonnull(strstr(e.msg, "k_bits: expected 1..8, found 12"));
    rewrite(p, q, "kvq.outlier_fraction", "0.7", NULL);
    ck_assert(kvq_artifact_read(q, &r, &e) != KVQ_OK);
    ck_assert_ptr_nonnull(strstr(e.msg, "outlier_fraction"));
    rewrite(p, q, "kvq.method", "nuq9", NULL);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "unknown method \"nuq9\""));
    rewrite(p, q, NULL, NULL, "layers.1.v.levels");
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "tensor 'layers.1.v.levels' missing"));
    rewrite(p, q, "kvq.k_bits", "2", NULL); /* levels tensor has 8 entries, 2 bits needs 4 */
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    /* both shapes exactly (a 1-D want printed as "[40]", a trailing 0 after the size) */
    ck_assert_msg(strstr(e.msg, "tensor 'layers.0.k.levels': expected F32 [4], found F32 [8]"), "%s", e.msg);
    ck_assert_int_eq(kvq_artifact_read("/nonexistent.safetensors", &r, &e), KVQ_EIO);
    /* calibration counts that cannot be (more outliers than elements: --inspect printed "outliers
     * 100.000% (9223372036854775808/...)") */
    a.k[1].n_outliers = a.k[1].n_elems + 1;
    ck_assert_msg(kvq_artifact_write(q, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_artifact_read(q, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, q) && strstr(e.msg, "layers.1.k.calib_counts: outliers") && strstr(e.msg, "expected <= elements"), "%s",
                  e.msg);
    kvq_artifact_free(&a);
}
END_TEST

START_TEST(test_fingerprint_and_inspect)
{
    kvq_artifact a;
    build_nuq(&a, true);
    kvq_err e = {0};
    ck_assert(kvq_artifact_check_model(&a.p, a.p.model_fingerprint, false, NULL, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_artifact_check_model(&a.p, "sha256:other", false, NULL, &e), KVQ_EMISMATCH);
    ck_assert_ptr_nonnull(strstr(e.msg, "sha256:other"));
    ck_assert_ptr_nonnull(strstr(e.msg, a.p.model_fingerprint));
    char *buf = NULL;
    size_t len = 0;
    FILE *w = open_memstream(&buf, &len);
    ck_assert(kvq_artifact_check_model(&a.p, "sha256:other", true, w, &e) == KVQ_OK);
    fclose(w);
    ck_assert_ptr_nonnull(strstr(buf, "warning:"));
    ck_assert_ptr_nonnull(strstr(buf, "sha256:other"));
    free(buf);
    kvq_artifact_params none = a.p;
    none.model_fingerprint[0] = 0;
    ck_assert_int_eq(kvq_artifact_check_model(&none, "sha256:x", false, NULL, &e), KVQ_EMISMATCH);
    ck_assert_ptr_nonnull(strstr(e.msg, "none recorded"));

    char p[512];
    tmp_path(p, sizeof p, "inspect.safetensors");
    ck_assert(kvq_artifact_write(p, &a, &e) == KVQ_OK);
    w = open_memstream(&buf, &len);
    ck_assert_msg(kvq_artifact_inspect(w, p, &e) == KVQ_OK, "%s", e.msg);
    fclose(w);
    char bits_line[128];
    snprintf(bits_line, sizeof bits_line, "bits/element  K %.4f, V %.4f (ctx 2048", a.p.bits_k, a.p.bits_v);
    const char *want[] = {"method        nuq  K 3 bit, V 3 bit, outliers 1%", "pre-RoPE", "per-head",
                          "Fisher-weighted", a.p.model_fingerprint, a.p.dump_fingerprint, "layer  1 V",
                          "head 1 levels [", "objective lloyd", "chosen ", bits_line};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(strstr(buf, want[i]) != NULL, "inspect output lacks '%s':\n%s", want[i], buf);
    free(buf);
    kvq_artifact_free(&a);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("artifact");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_determinism_and_round_trip);
    tcase_add_test(tc, test_other_methods);
    tcase_add_test(tc, test_bad_params);
    tcase_add_test(tc, test_read_rejects);
    tcase_add_test(tc, test_fingerprint_and_inspect);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
