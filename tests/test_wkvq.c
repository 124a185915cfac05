/* test_wkvq.c — WKVQuant's KV part (kernels/schemes/wkvq.c), the first family
 * with a layer fit (kvq_calib_src) and family tables:
 *  - kvdump -> kvcalib --method wkvq -> kveval on both tiny models: the
 *    artifact's shift / scale equal the closed form recomputed here from the
 *    dump (min / max per channel without the sink tokens, alpha 1 and 0.5);
 *    decode equivalence of the past-only cache against a token-by-token loop
 *    that appends each token's quantized copy after its own step (reference
 *    quantizer written here: smoothing, kvq_quant_int_token per row,
 *    unsmoothing), with sink tokens and groups; the naive pass that quantizes
 *    the current token too differs;
 *  - the artifact: write / read round trip byte for byte, --inspect lines,
 *    a file without one table or with a misshapen one refused by the reader
 *    naming the tensor, a zero scale refused by the writer;
 *  - kvcalib --param: unknown name, non-number, out-of-range alpha (exit 2 /
 *    exit 1 before any work, the rule named);
 *  - spec parsing, canonical names, refusals, bits by hand, the artifact
 *    required, kvstat's resting representation (kvq_kv_desc_from_artifact). */
#include <math.h>
#include <stdint.h>

#include "artifact.h"
#include "calibrate.h"
#include "dump.h"
#include "family.h"
#include "family_env.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "scheme.h"

static void tmp(char *buf, size_t n, const char *tag) { snprintf(buf, n, "/tmp/kvq_test_wkvq_%d_%s", (int)getpid(), tag); }

typedef struct {
    const kvq_eval_scheme *s;
    int kvd;
} wref;

/* the cache entry of one token, written out again: (x - shift) / scale, uniform per-token groups, * scale + shift */
static void wkvq_ref(void *ctx, int layer, char side, int pos, float *x)
{
    const wref *w = ctx;
    const kvq_scheme *q = &w->s->s.q;
    if ((size_t)pos < q->n_sink) return;
    const kvq_kv_table *t = side == 'k' ? &w->s->art->k[layer] : &w->s->art->v[layer];
    const float *sh = kvq_kv_table_get(t, "shift")->data, *sc = kvq_kv_table_get(t, "scale")->data;
    float y[1024];
    for (int j = 0; j < w->kvd; j++) y[j] = (x[j] - sh[j]) / sc[j];
    kvq_err e = {0};
    ck_assert(kvq_quant_int_token(y, y, 1, (size_t)w->kvd, q->group, side == 'k' ? q->k_bits : q->v_bits, 0, NULL, &e) == KVQ_OK);
    for (int j = 0; j < w->kvd; j++) x[j] = y[j] * sc[j] + sh[j];
}

/* shift / scale of one (layer, side) recomputed from the dump: min / max over the non-sink tokens */
static void check_closed_form(const char *dump, const kvq_artifact *a, double alpha)
{
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(dump, &r, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    size_t kvd = (size_t)m->n_kv_heads * (size_t)m->head_dim, L = (size_t)m->seq_len, ns = a->p.n_sink;
    float *x = malloc(L * kvd * sizeof(float));
    double lo[1024], hi[1024];
    for (int l = 0; l < m->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            kvq_dump_ds ds = w ? KVQ_DUMP_V : a->p.post_rope ? KVQ_DUMP_K : KVQ_DUMP_K_PRE_ROPE;
            for (size_t j = 0; j < kvd; j++) {
                lo[j] = INFINITY;
                hi[j] = -INFINITY;
            }
            for (int64_t smp = 0; smp < m->n_samples; smp++) {
                ck_assert(kvq_dump_read(r, l, ds, smp, x, &e) == KVQ_OK);
                for (size_t t = ns; t < L; t++)
                    for (size_t j = 0; j < kvd; j++) {
                        lo[j] = fmin(lo[j], x[t * kvd + j]);
                        hi[j] = fmax(hi[j], x[t * kvd + j]);
                    }
            }
            const kvq_kv_table *t = w ? &a->v[l] : &a->k[l];
            const float *sh = kvq_kv_table_get(t, "shift")->data, *sc = kvq_kv_table_get(t, "scale")->data;
            double R = 0;
            for (size_t j = 0; j < kvd; j++) R = fmax(R, (hi[j] - lo[j]) / 2);
            for (size_t j = 0; j < kvd; j++) {
                double want_sh = (hi[j] + lo[j]) / 2, want_sc = pow(fmax((hi[j] - lo[j]) / 2, 1e-6 * R), alpha);
                ck_assert_msg(fabs(sh[j] - want_sh) <= 1e-6 * (fabs(want_sh) + 1e-3) && fabs(sc[j] - want_sc) <= 1e-6 * want_sc,
                              "layer %d %c channel %zu: shift %g scale %g, want %g %g", l, w ? 'v' : 'k', j, (double)sh[j],
                              (double)sc[j], want_sh, want_sc);
            }
        }
    free(x);
    kvq_dump_close(r);
}

static void calibrate(const char *dump, const char *out, size_t sink, double alpha, bool post_rope)
{
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("wkvq"));
    o.n_sink = sink;
    o.x[0] = alpha;
    o.post_rope = post_rope;
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
}

START_TEST(test_wkvq_chain_decode)
{
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        char mp[4096], dump[256], a0[256], a1[256], ah[256];
        tmp(dump, sizeof dump, "dump.h5");
        KVQ_SKIP_IF(!fenv_dump(models[mi], 4, 64, false, dump, mp, sizeof mp), "../shared tiny model or WikiText-2 absent");
        tmp(a0, sizeof a0, "a0.st");
        tmp(a1, sizeof a1, "a1.st");
        tmp(ah, sizeof ah, "ah.st");
        calibrate(dump, a0, 0, 1.0, true);
        calibrate(dump, a1, 2, 1.0, true);
        calibrate(dump, ah, 0, 0.5, false);
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(mp, &m, &e) == KVQ_OK, "%s", e.msg);
        char fp[65];
        ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
        const char *paths[] = {a0, a1, ah};
        kvq_artifact_set set;
        ck_assert_msg(kvq_artifact_set_load(&set, paths, 3, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
        check_closed_form(dump, &set.a[0], 1.0);
        check_closed_form(dump, &set.a[1], 1.0);
        check_closed_form(dump, &set.a[2], 0.5);
        ck_assert_double_eq(set.a[2].p.x[0], 0.5);
        int kvd = kvq_kv_dim(&m.hp);
        char g[32];
        snprintf(g, sizeof g, "wkvq3-g%d", m.hp.head_dim / 2);
        const char *specs[] = {"wkvq4", "wkvq2+artifact2", g};
        for (int i = 0; i < 3; i++) {
            kvq_eval_scheme s;
            ck_assert_msg(kvq_eval_scheme_make(specs[i], &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_int_eq(s.s.key_stage, KVQ_KEYS_POST_ROPE);
            wref w = {&s, kvd};
            kvq_quant_counts c = fenv_decode_case(&m, &s, wkvq_ref, &w, true);
            ck_assert_uint_eq(c.n_sink, (uint64_t)m.hp.n_layers * s.s.q.n_sink * kvd);
            if (i == 1) ck_assert_str_eq(s.name, "wkvq2+sink2+artifact2");
        }
        /* the pre-RoPE artifact binds with +pre-rope only, and the alternative is still read with the past-only bounds */
        kvq_eval_scheme s;
        ck_assert_msg(kvq_eval_scheme_make("wkvq4+pre-rope", &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(s.art_index, 2);
        ck_assert_str_eq(s.name, "wkvq4+pre-rope");
        kvq_artifact_set_free(&set);
        kvq_model_free(&m);
        unlink(dump);
        unlink(a0);
        unlink(a1);
        unlink(ah);
    }
}
END_TEST

START_TEST(test_wkvq_artifact_and_cli)
{
    char mp[4096], dump[256], a[256], b[256], bad[256], cmd[8192], out[8192], bin[4096];
    tmp(dump, sizeof dump, "dump2.h5");
    KVQ_SKIP_IF(!fenv_dump("models/llama2c/aidreams260K.bin", 2, 32, false, dump, mp, sizeof mp), "../shared tiny model absent");
    tmp(a, sizeof a, "rt_a.st");
    tmp(b, sizeof b, "rt_b.st");
    tmp(bad, sizeof bad, "bad.st");
    calibrate(dump, a, 1, 0.75, true);
    kvq_artifact art;
    kvq_err e = {0};
    ck_assert_msg(kvq_artifact_read(a, &art, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_eq(art.p.method, KVQ_FAM("wkvq"));
    ck_assert_double_eq(art.p.x[0], 0.75);
    ck_assert_uint_eq(art.k[0].n_ft, 2);
    ck_assert_uint_eq(art.v[3].n_ft, 2);
    check_closed_form(dump, &art, 0.75);
    /* round trip: the same bytes */
    ck_assert_msg(kvq_artifact_write(b, &art, &e) == KVQ_OK, "%s", e.msg);
    char c1[16384];
    snprintf(cmd, sizeof cmd, "cmp %s %s", a, b);
    ck_assert_msg(fenv_run(cmd, c1, sizeof c1) == 0, "round trip differs: %s", c1);
    /* the writer refuses a zero scale, a missing table, an extra one */
    float keep = art.v[2].ft[1].data[5];
    art.v[2].ft[1].data[5] = 0;
    ck_assert_int_eq(kvq_artifact_write(bad, &art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.2.v.scale[5]: expected > 0"), "%s", e.msg);
    art.v[2].ft[1].data[5] = keep;
    art.k[1].n_ft = 1;
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.1.k.scale: missing"), "%s", e.msg);
    art.k[1].n_ft = 2;
    float *extra;
    uint64_t sh1[1] = {4};
    ck_assert(kvq_kv_table_add(&art.k[0], "junk", 1, sh1, &extra, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.0.k: 3 family tables, method wkvq stores 2"), "%s", e.msg);
    kvq_artifact_free(&art);
    /* the reader refuses a file without one table, or with a misshapen one, naming the tensor */
    fenv_rewrite(a, bad, "layers.3.v.shift", false);
    ck_assert_int_eq(kvq_artifact_read(bad, &art, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "layers.3.v.shift") && strstr(e.msg, "missing"), "%s", e.msg);
    fenv_rewrite(a, bad, "layers.0.k.scale", true);
    ck_assert_int_ne(kvq_artifact_read(bad, &art, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "layers.0.k.scale: expected shape ["), "%s", e.msg);
    /* --inspect */
    const char *kvcalib = kvq_test_bin(bin, sizeof bin, "kvcalib");
    ck_assert_msg(kvcalib, "%s: kvcalib not built (KVQ_BIN_DIR)", bin);
    snprintf(cmd, sizeof cmd, "%s --inspect %s", kvcalib, a);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "method        wkvq") && strstr(out, "alpha         0.75 (kvq.wkvq.alpha)") &&
                      strstr(out, "past-only; channel shift and scale (closed form, alpha 0.75)") && strstr(out, "shift [") &&
                      strstr(out, "scale [") && strstr(out, "sink tokens   1"),
                  "%s", out);
    /* a family without sparse outliers prints no outlier share per table (it printed "outliers 0.000%") */
    ck_assert_msg(!strstr(out, "outliers 0.000%") && strstr(out, "layer  0 K: points"), "%s", out);
    /* kvcalib --param: the rules named, nothing written */
    struct { const char *args; int code; const char *want; } cases[] = {
        {"--param beta=1", 2, "NAME one of method wkvq's parameters (alpha)"},
        {"--param alpha=x", 2, "value of alpha: expected a finite number, found \"x\""},
        {"--param alpha", 2, "expected NAME=VALUE"},
        {"--param alpha=1.5", 1, "alpha: expected the smoothing strength in [0, 1], found 1.5"},
        {"--param alpha=-0.1", 1, "alpha: expected the smoothing strength in [0, 1], found -0.1"},
        {"--group 5", 1, "group_size: expected 0 or a divisor of kv_dim 64, found 5"},
    };
    unlink(b);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(cmd, sizeof cmd, "%s %s --method wkvq --bits 4 %s --out %s", kvcalib, dump, cases[i].args, b);
        int rc = fenv_run(cmd, out, sizeof out);
        ck_assert_msg(rc == cases[i].code && strstr(out, cases[i].want), "%s: exit %d: %s", cases[i].args, rc, out);
        ck_assert_int_ne(access(b, F_OK), 0);
    }
    snprintf(cmd, sizeof cmd, "%s %s --method nuq --bits 4 --param alpha=1 --out %s", kvcalib, dump, b);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "method nuq's parameters (it has none)"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s --help", kvcalib);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "wkvq") && strstr(out, "--param alpha=1"), "%s", out);
    unlink(a);
    unlink(b);
    unlink(bad);
    unlink(dump);
}
END_TEST

static kvq_hparams smol_hp(void)
{
    return (kvq_hparams){.n_layers = 30, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                         .vocab_size = 49152, .ctx_len = 8192, .rope_dim = 64, .rope_theta = 100000.0f};
}

START_TEST(test_wkvq_spec_bits)
{
    kvq_scheme_spec sp;
    kvq_err e = {0};
    kvq_hparams hp = smol_hp();
    ck_assert(kvq_scheme_parse("wkvq2-g64", &sp, &e) == KVQ_OK);
    ck_assert_ptr_eq(sp.q.fam, KVQ_FAM("wkvq"));
    ck_assert_int_eq(sp.q.k_bits, 2);
    ck_assert_uint_eq(sp.q.group, 64);
    ck_assert_int_eq(sp.key_stage, KVQ_KEYS_POST_ROPE);
    kvq_bits b;
    /* 2 code bits + an fp16 scale and zero per 64 channels + fp16 shift and scale per channel over 512 tokens */
    ck_assert(kvq_scheme_bits(&sp.q, 512, 192, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 2 + 32.0 / 64 + 32.0 / 512, 1e-12);
    ck_assert_double_eq_tol(b.v, 2 + 32.0 / 64 + 32.0 / 512, 1e-12);
    ck_assert(kvq_scheme_parse("wkvq4+sink1", &sp, &e) == KVQ_OK);
    ck_assert(kvq_scheme_bits(&sp.q, 2048, 192, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, ((4 + 32.0 / 192 + 32.0 / 2048) * 2047 + 16) / 2048, 1e-12);
    const char *bad[][2] = {{"wkvq9", "bits: expected 1..8"}, {"wkvq4-g0", "group size after -g"}, {"wkvq4-x", "expected wkvq<b>[-g<G>]"},
                            {"wkvq", "unknown scheme"}};
    for (size_t i = 0; i < 4; i++) {
        ck_assert_int_eq(kvq_scheme_parse(bad[i][0], &sp, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, bad[i][1]), "%s: %s", bad[i][0], e.msg);
    }
    kvq_eval_scheme s;
    ck_assert_int_eq(kvq_eval_scheme_make("wkvq4", NULL, &hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "needs a kvcalib artifact of method wkvq"), "%s", e.msg);
    ck_assert(kvq_scheme_parse("wkvq4-g50", &sp, &e) == KVQ_OK);
    ck_assert_int_eq(KVQ_FAM("wkvq")->check_model(&sp.q, "wkvq4-g50", &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "group size 50 does not divide the model's kv_dim 192"), "%s", e.msg);
}
END_TEST

/* kvstat's quantization error: the artifact's own scheme at rest (every token, itself included) */
START_TEST(test_wkvq_kvstat_representation)
{
    enum { T = 9, H = 2, D = 4, KVD = H * D, L = 1 };
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    a.p.method = KVQ_FAM("wkvq");
    a.p.k_bits = a.p.v_bits = 2;
    a.p.n_sink = 1;
    a.p.group_size = 4;
    a.p.post_rope = true;
    a.p.n_layers = L;
    a.p.n_kv_heads = H;
    a.p.head_dim = D;
    a.p.x[0] = 1;
    a.k = calloc(L, sizeof *a.k);
    a.v = calloc(L, sizeof *a.v);
    kvq_err e = {0};
    uint64_t sh[1] = {KVD};
    float *x[4];
    ck_assert(kvq_kv_table_add(&a.k[0], "shift", 1, sh, &x[0], &e) == KVQ_OK);
    ck_assert(kvq_kv_table_add(&a.k[0], "scale", 1, sh, &x[1], &e) == KVQ_OK);
    ck_assert(kvq_kv_table_add(&a.v[0], "shift", 1, sh, &x[2], &e) == KVQ_OK);
    ck_assert(kvq_kv_table_add(&a.v[0], "scale", 1, sh, &x[3], &e) == KVQ_OK);
    for (int j = 0; j < KVD; j++) {
        x[0][j] = x[2][j] = 0.5f * (float)j - 1;
        x[1][j] = x[3][j] = j == 3 ? 40.0f : 1.0f + 0.25f * (float)j;
    }
    ck_assert_msg(kvq_artifact_validate(&a, &e) == KVQ_OK, "%s", e.msg);
    kvq_kv_desc d;
    kvq_kv_layer_tables *tabs;
    ck_assert_msg(kvq_kv_desc_from_artifact(&a, &d, &tabs, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(d.q.fam->name, "wkvq");
    float in[T * KVD], out[T * KVD], want[T * KVD];
    for (int i = 0; i < T * KVD; i++) in[i] = (float)sin(0.7 * i) * (i % KVD == 3 ? 30.0f : 2.0f);
    kvq_quant_counts c = {0};
    ck_assert(kvq_kv_desc_quantize(&d, 0, 'k', out, in, T, KVD, D, &c, &e) == KVQ_OK);
    kvq_eval_scheme es = {.desc = d, .art = &a};
    es.s.q = d.q;
    wref w = {&es, KVD};
    memcpy(want, in, sizeof want);
    for (int t = 0; t < T; t++) wkvq_ref(&w, 0, 'k', t, want + t * KVD);
    ck_assert_uint_eq(fenv_bits_differ(out, want, T * KVD), 0);
    ck_assert_uint_eq(c.n_sink, KVD);
    ck_assert_uint_eq(c.n_elems, T * KVD);
    /* teeth: without the smoothing (plain int2 per 4 channels) the small channels are worse */
    float plain[T * KVD];
    ck_assert(kvq_quant_int_token(plain, in, T, KVD, 4, 2, 1, NULL, &e) == KVQ_OK);
    double es1 = 0, es0 = 0;
    for (int t = 1; t < T; t++)
        for (int j = 0; j < 3; j++) {
            es1 += pow(out[t * KVD + j] - in[t * KVD + j], 2);
            es0 += pow(plain[t * KVD + j] - in[t * KVD + j], 2);
        }
    ck_assert_msg(es1 < es0, "smoothing did not help the small channels: %g vs %g", es1, es0);
    free(tabs);
    kvq_artifact_free(&a);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("wkvq");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_wkvq_spec_bits);
    tcase_add_test(tc, test_wkvq_kvstat_representation);
    tcase_add_test(tc, test_wkvq_artifact_and_cli);
    tcase_add_test(tc, test_wkvq_chain_decode);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
