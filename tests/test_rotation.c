/* test_rotation.c — the +hadamard / +rht rotation modifier (kernels/quant/hadamard.h,
 * the generic wrapping in kernels/schemes/kv_desc.c):
 *  - the matrix: llama.cpp's construction (ggml_gen_hadamard's doubling loop, written
 *    out again here) equals (-1)^popcount(i&j)/sqrt(n) in float64, is orthonormal and
 *    its own inverse; the fast transform equals the dense product; blocks and signs;
 *  - specs: parse, canonical names, round trip, no stored bits, the refused forms and the
 *    head_dim rule, the GPU choice (host path);
 *  - the seam: kvstat's quantize of a rotated scheme is Q(x·R)·Rᵀ, fp32+hadamard is
 *    within 1e-6 of fp32 on a text window, rotation cuts int4's per-token error on keys
 *    with a large outlier channel;
 *  - artifacts: kvq.rotation written and read back, bound only by the same modifier
 *    (both rotations named when refused), the packed cache refuses a rotated artifact.
 * Decode equivalence of rotated schemes: tests/test_kveval.c (int4+hadamard,
 * int3+rht5+sink2, fp16+rht, q4_0+hadamard, q8_0+rht against the step-by-step cache). */
#include <math.h>
#include <stdint.h>

#include "artifact.h"
#include "hadamard.h"
#include "identity.h"
#include "kv_desc.h"
#include "kvcache.h"
#include "kveval_env.h"
#include "kveval_util.h"
#include "kvq_test.h"
#include "perplexity.h"
#include "quant.h"
#include "quant_ggml.h"
#include "scheme.h"

static uint64_t rs = 12345;
static double urand(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return ((double)(rs >> 11) + 0.5) / 9007199254740992.0;
}
static double grand(void) { return sqrt(-2 * log(urand())) * cos(6.283185307179586 * urand()); }

static double h_ref(size_t n, size_t i, size_t j) { return (__builtin_popcountll(i & j) & 1 ? -1.0 : 1.0) / sqrt((double)n); }

START_TEST(test_hadamard_matrix)
{
    for (size_t n = 1; n <= 256; n *= 2) {
        /* llama.cpp src/llama-kv-cache.cpp ggml_gen_hadamard: data[0] = 1/sqrt(n), then doubling */
        float *g = calloc(n * n, sizeof *g);
        g[0] = (float)(1.0 / sqrtf((float)n));
        for (size_t s = 1; s < n; s *= 2)
            for (size_t i = 0; i < s; i++)
                for (size_t j = 0; j < s; j++) {
                    float val = g[i * n + j];
                    g[(i + s) * n + j] = val;
                    g[i * n + j + s] = val;
                    g[(i + s) * n + j + s] = -val;
                }
        double max_orth = 0, max_inv = 0;
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < n; j++) {
                ck_assert_msg(fabs(g[i * n + j] - h_ref(n, i, j)) <= 1e-7, "n %zu (%zu,%zu): llama.cpp %g, ref %g", n, i, j,
                              (double)g[i * n + j], h_ref(n, i, j));
                double hht = 0, hh = 0;
                for (size_t k = 0; k < n; k++) {
                    hht += h_ref(n, i, k) * h_ref(n, j, k);
                    hh += h_ref(n, i, k) * h_ref(n, k, j);
                }
                max_orth = fmax(max_orth, fabs(hht - (i == j)));
                max_inv = fmax(max_inv, fabs(hh - (i == j)));
            }
        ck_assert_msg(max_orth <= 1e-12 && max_inv <= 1e-12, "n %zu: |H Hᵀ - I| %g, |H H - I| %g", n, max_orth, max_inv);
        /* the fast transform against the dense product (float64), and twice = identity */
        float x[256], y[256];
        for (size_t i = 0; i < n; i++) x[i] = y[i] = (float)grand();
        kvq_fwht(y, n);
        double scale = 0;
        for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(x[i]));
        for (size_t j = 0; j < n; j++) {
            double want = 0;
            for (size_t i = 0; i < n; i++) want += (double)x[i] * h_ref(n, i, j);
            ck_assert_msg(fabs(y[j] - want) <= 1e-6 * scale * sqrt((double)n), "n %zu j %zu: fwht %.9g dense %.9g", n, j,
                          (double)y[j], want);
        }
        kvq_fwht(y, n);
        for (size_t i = 0; i < n; i++) ck_assert_msg(fabs(y[i] - x[i]) <= 1e-6 * scale, "n %zu: H(Hx) != x at %zu", n, i);
        free(g);
    }
}
END_TEST

START_TEST(test_blocks_and_signs)
{
    /* llama.cpp where head_dim % 64 == 0: K = the largest power of two dividing head_dim, V = 64 */
    const struct { size_t hd, k, v; } b[] = {{64, 64, 64}, {128, 128, 64}, {192, 64, 64}, {256, 256, 64}, {96, 32, 32},
                                             {16, 16, 16}, {8, 8, 8}, {30, 2, 2}, {7, 0, 0}, {0, 0, 0}};
    for (size_t i = 0; i < sizeof b / sizeof *b; i++) {
        ck_assert_uint_eq(kvq_hadamard_block(b[i].hd, 'k'), b[i].k);
        ck_assert_uint_eq(kvq_hadamard_block(b[i].hd, 'v'), b[i].v);
    }
    /* head_dim 128, 2 heads, 3 tokens: keys one 128-block, values two 64-blocks; rht: (x ⊙ s) · H */
    enum { T = 3, H = 2, HD = 128, KVD = H * HD };
    float *x = malloc(T * KVD * sizeof *x), *y = malloc(T * KVD * sizeof *y);
    for (size_t i = 0; i < T * KVD; i++) x[i] = (float)grand();
    kvq_err e = {0};
    for (int kind = 1; kind <= 2; kind++)
        for (int side = 0; side < 2; side++) {
            kvq_rotation r = {(kvq_rot_kind)kind, 99};
            char sd = side ? 'v' : 'k';
            size_t nb = side ? 64 : 128;
            memcpy(y, x, T * KVD * sizeof *y);
            ck_assert(kvq_rotation_apply(&r, y, T, KVD, HD, sd, false, &e) == KVQ_OK);
            for (size_t v = 0; v < T * H; v++)
                for (size_t c = 0; c < HD; c++) {
                    size_t b0 = c / nb * nb;
                    double want = 0;
                    for (size_t i = b0; i < b0 + nb; i++)
                        want += (double)x[v * HD + i] * (kind == 2 ? kvq_rht_sign(99, i) : 1) * h_ref(nb, i - b0, c - b0);
                    ck_assert_msg(fabs(y[v * HD + c] - want) <= 1e-5, "kind %d side %c vector %zu channel %zu: %.9g vs %.9g",
                                  kind, sd, v, c, (double)y[v * HD + c], want);
                }
            ck_assert(kvq_rotation_apply(&r, y, T, KVD, HD, sd, true, &e) == KVQ_OK);
            for (size_t i = 0; i < T * KVD; i++) ck_assert(fabs(y[i] - x[i]) <= 1e-6 * (1 + fabs(x[i])));
        }
    /* signs: deterministic per seed, about balanced, different seeds differ */
    int plus = 0, differ = 0;
    for (size_t d = 0; d < 1024; d++) {
        ck_assert_int_eq(kvq_rht_sign(5, d), kvq_rht_sign(5, d));
        plus += kvq_rht_sign(5, d) > 0;
        differ += kvq_rht_sign(5, d) != kvq_rht_sign(6, d);
    }
    ck_assert_msg(plus > 400 && plus < 624 && differ > 400, "signs: %d of 1024 positive, %d differ between seeds", plus, differ);
    /* bad input */
    kvq_rotation had = {KVQ_ROT_HADAMARD, 0};
    ck_assert_int_eq(kvq_rotation_apply(&had, y, T, KVD, 7, 'k', false, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_rotation_apply(&had, y, 1, 14, 7, 'k', false, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "+hadamard") && strstr(e.msg, "head_dim 7"), "%s", e.msg);
    ck_assert_int_eq(kvq_rotation_apply(&had, y, T, KVD, HD, 'x', false, &e), KVQ_EINVAL);
    free(x);
    free(y);
}
END_TEST

static kvq_hparams hp_of(int head_dim)
{
    kvq_hparams hp = {.n_layers = 2, .dim = 2 * head_dim * 3, .hidden_dim = 64, .n_heads = 6, .n_kv_heads = 2,
                      .head_dim = head_dim, .vocab_size = 512, .ctx_len = 256, .rope_dim = head_dim, .rope_theta = 10000,
                      .norm_eps = 1e-5f};
    return hp;
}

START_TEST(test_specs)
{
    kvq_hparams hp = hp_of(64);
    kvq_err e = {0};
    kvq_eval_scheme s, s2, p;
    const struct { const char *spec, *name; } c[] = {
        {"q4_0+hadamard", "q4_0+hadamard"}, {"int4+rht", "int4+rht"},       {"int4+rht0", "int4+rht"},
        {"int4+rht7+sink2", "int4+sink2+rht7"}, {"fp32+hadamard", "fp32+hadamard"}, {"kivi2+hadamard", "kivi2-g32-r128+hadamard"},
        {"e5m2+rht3", "e5m2+rht3"}, {"hh2+hadamard", NULL},
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        ck_assert_msg(kvq_eval_scheme_make(c[i].spec, NULL, &hp, &s, &e) == KVQ_OK, "%s: %s", c[i].spec, e.msg);
        if (c[i].name) ck_assert_str_eq(s.name, c[i].name);
        ck_assert_msg(kvq_eval_scheme_make(s.name, NULL, &hp, &s2, &e) == KVQ_OK, "%s: %s", s.name, e.msg);
        ck_assert_str_eq(s2.name, s.name);
        ck_assert(kvq_rotation_equal(&s2.desc.rot, &s.desc.rot));
        ck_assert(s.desc.rot.kind != KVQ_ROT_NONE);
        ck_assert(!kvq_eval_scheme_is_identity(&s));
        /* a rotated scheme runs on the host path on the GPU */
        ck_assert_ptr_null(kvq_kv_desc_cuda(&s.desc));
        ck_assert_ptr_null(kvq_eval_scheme_gpu_desc(&s));
        char label[160];
        kvq_kv_desc_name(&s.desc, label, sizeof label);
        ck_assert_msg(strstr(label, s.desc.rot.kind == KVQ_ROT_RHT ? "+rht" : "+hadamard"), "%s", label);
        /* no stored bits: the same as the unrotated scheme */
        char base[KVQ_SPEC_MAX];
        snprintf(base, sizeof base, "%s", c[i].spec);
        *strchr(base, '+') = 0;
        if (strstr(c[i].spec, "+sink2")) strcat(base, "+sink2");
        ck_assert_msg(kvq_eval_scheme_make(base, NULL, &hp, &p, &e) == KVQ_OK, "%s: %s", base, e.msg);
        kvq_bits a, b;
        ck_assert(kvq_eval_scheme_bits(&s, 512, &hp, &a, &e) == KVQ_OK);
        ck_assert(kvq_eval_scheme_bits(&p, 512, &hp, &b, &e) == KVQ_OK);
        ck_assert_msg(a.k == b.k && a.v == b.v, "%s: bits %g/%g vs %g/%g", s.name, a.k, a.v, b.k, b.v);
    }
    /* the unrotated native path is unchanged (the CUDA build has int's native transform) */
    ck_assert(kvq_eval_scheme_make("int4", NULL, &hp, &s, &e) == KVQ_OK);
    ck_assert_ptr_eq(kvq_kv_desc_cuda(&s.desc), s.desc.q.fam->cuda);
    ck_assert(kvq_eval_scheme_make("fp32", NULL, &hp, &s, &e) == KVQ_OK);
    ck_assert(kvq_eval_scheme_is_identity(&s));
    /* refused forms, each naming its rule */
    const struct { const char *spec, *want; } bad[] = {
        {"int4+hadamard+rht", "rotation given twice"}, {"int4+rht+rht2", "rotation given twice"},
        {"int4+rhtx", "+rht<seed>"},                   {"int4+rht-1", "+rht<seed>"},
        {"int4+hadamard2", "unknown modifier"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_eq(kvq_eval_scheme_make(bad[i].spec, NULL, &hp, &s, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, bad[i].want), "%s: %s", bad[i].spec, e.msg);
    }
    /* head_dim without a factor 2: no Walsh-Hadamard block */
    kvq_hparams odd = hp_of(7);
    ck_assert_int_eq(kvq_eval_scheme_make("int4+hadamard", NULL, &odd, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "int4+hadamard") && strstr(e.msg, "head_dim 7") && strstr(e.msg, "power-of-two block"), "%s", e.msg);
    ck_assert_int_eq(kvq_eval_scheme_make("fp32+rht", NULL, &odd, &s, &e), KVQ_EINVAL);
    ck_assert(kvq_eval_scheme_make("int4", NULL, &odd, &s, &e) == KVQ_OK);
    /* --help lists the modifiers */
    char syn[KVQ_SCHEME_SYNTAX_MAX];
    ck_assert(strstr(kvq_scheme_syntax(syn, sizeof syn), "+hadamard, +rht[<seed>]"));
}
END_TEST

/* kvstat's representation (kvq_kv_desc_quantize): exactly rotate, the family's quantize, un-rotate */
START_TEST(test_quantize_is_rotated)
{
    kvq_hparams hp = hp_of(64);
    enum { T = 16, KVD = 128 };
    float x[T * KVD], y[T * KVD], want[T * KVD];
    for (size_t i = 0; i < T * KVD; i++) x[i] = (float)grand();
    kvq_err e = {0};
    kvq_eval_scheme s;
    const char *specs[] = {"int4+hadamard", "q4_0+rht9", "fp32+hadamard"};
    for (size_t k = 0; k < 3; k++) {
        ck_assert(kvq_eval_scheme_make(specs[k], NULL, &hp, &s, &e) == KVQ_OK);
        for (int side = 0; side < 2; side++) {
            char sd = side ? 'v' : 'k';
            kvq_quant_counts c = {0};
            ck_assert_msg(kvq_kv_desc_quantize(&s.desc, 0, sd, y, x, T, KVD, 64, &c, &e) == KVQ_OK, "%s", e.msg);
            memcpy(want, x, sizeof want);
            ck_assert(kvq_rotation_apply(&s.desc.rot, want, T, KVD, 64, sd, false, &e) == KVQ_OK);
            if (k == 0) ck_assert(kvq_quant_int_token(want, want, T, KVD, 0, 4, 0, NULL, &e) == KVQ_OK);
            if (k == 1) ck_assert(kvq_ggml_kv_roundtrip(KVQ_GGML_Q4_0, want, want, T, 2, 64, &e) == KVQ_OK);
            ck_assert(kvq_rotation_apply(&s.desc.rot, want, T, KVD, 64, sd, true, &e) == KVQ_OK);
            ck_assert_msg(memcmp(want, y, sizeof y) == 0, "%s side %c: not Q(x·R)·Rᵀ", specs[k], sd);
            double err = 0;
            for (size_t i = 0; i < T * KVD; i++) err = fmax(err, fabs(y[i] - x[i]));
            if (k == 2) ck_assert_msg(err <= 1e-6, "fp32+hadamard moved a value by %g", err);
            else ck_assert_msg(err > 1e-3, "%s: nothing quantized", specs[k]);
        }
    }
}
END_TEST

/* keys with one large outlier channel per head: the rotation spreads it over the block and int4's per-token
 * step shrinks; the mean squared error must drop by at least 4x (measured ~25x) */
START_TEST(test_rotation_reduces_outlier_error)
{
    kvq_hparams hp = hp_of(64);
    enum { T = 128, KVD = 128 };
    float *x = malloc(T * KVD * sizeof *x), *y = malloc(T * KVD * sizeof *y);
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < KVD; c++) x[t * KVD + c] = (float)(grand() * (c % 64 == 5 ? 30.0 : 1.0));
    kvq_err e = {0};
    double mse[3];
    const char *specs[] = {"int4", "int4+hadamard", "int4+rht1"};
    for (int k = 0; k < 3; k++) {
        kvq_eval_scheme s;
        ck_assert(kvq_eval_scheme_make(specs[k], NULL, &hp, &s, &e) == KVQ_OK);
        ck_assert(kvq_kv_desc_quantize(&s.desc, 0, 'k', y, x, T, KVD, 64, NULL, &e) == KVQ_OK);
        double acc = 0;
        for (size_t i = 0; i < T * KVD; i++) acc += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        mse[k] = acc / (T * KVD);
    }
    fprintf(stderr, "INFO int4 MSE on keys with a 30x outlier channel: plain %.4g, +hadamard %.4g, +rht1 %.4g\n", mse[0], mse[1],
            mse[2]);
    ck_assert_msg(mse[1] < 0.25 * mse[0] && mse[2] < 0.25 * mse[0], "rotation did not cut the error: %g, %g vs %g", mse[1],
                  mse[2], mse[0]);
    free(x);
    free(y);
}
END_TEST

/* fp32+hadamard: a transform that rotates and un-rotates; the perplexity within 1e-6 of fp32 */
START_TEST(test_fp32_rotated_identity)
{
    text_env env;
    KVQ_SKIP_IF(!env_open(&env), "tiny model, tokenizer or wikitext absent");
    kvq_err e = {0};
    kvq_windows w;
    ck_assert(kvq_ppl_windows(&env.txt, env.tok, KVQ_PPL_KVQUANT, 96, KVQ_BOS_MODEL, &w, &e) == KVQ_OK);
    kvq_ppl_plan plan;
    ck_assert(kvq_ppl_plan_make(&w, KVQ_PPL_KVQUANT, 4, &plan, &e) == KVQ_OK);
    kvq_eval_scheme s[3];
    ck_assert(kvq_eval_scheme_make("fp32", NULL, &env.m.hp, &s[0], &e) == KVQ_OK);
    ck_assert(kvq_eval_scheme_make("fp32+hadamard", NULL, &env.m.hp, &s[1], &e) == KVQ_OK);
    ck_assert(kvq_eval_scheme_make("fp32+rht3", NULL, &env.m.hp, &s[2], &e) == KVQ_OK);
    ck_assert(!kvq_eval_scheme_is_identity(&s[1]) && !kvq_eval_scheme_is_identity(&s[2]));
    kvq_ppl_result res[3];
    ck_assert_msg(kvq_ppl_run(&env.m, &w, &plan, s, 3, NULL, res, &e) == KVQ_OK, "%s", e.msg);
    for (int i = 1; i < 3; i++) {
        double rel = fabs(res[i].ppl - res[0].ppl) / res[0].ppl;
        fprintf(stderr, "INFO %s ppl %.10f vs fp32 %.10f (rel %.2e)\n", s[i].name, res[i].ppl, res[0].ppl, rel);
        ck_assert_msg(rel <= 1e-6, "%s: ppl %.12g vs fp32 %.12g", s[i].name, res[i].ppl, res[0].ppl);
    }
    kvq_ppl_results_free(res, 3);
    kvq_windows_free(&w);
    env_close(&env);
}
END_TEST

/* kvq.rotation in the artifact; binding needs the same rotation, and the refusal names both */
START_TEST(test_rotated_artifact_bind)
{
    char buf[4096];
    const char *mp = kvq_test_shared(buf, sizeof buf, "models/llama2c/aidreams260K.bin");
    KVQ_SKIP_IF(!mp, "../shared/models/llama2c/aidreams260K.bin absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(mp, &m, &e) == KVQ_OK, "%s", e.msg);
    char fp[65], plain[256], rot[256];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    snprintf(plain, sizeof plain, "/tmp/kvq_test_rotation_%ld_plain.safetensors", (long)getpid());
    snprintf(rot, sizeof rot, "/tmp/kvq_test_rotation_%ld_rht.safetensors", (long)getpid());
    int tok[2 * 48];
    for (int i = 0; i < 2 * 48; i++) tok[i] = (int)(urand() * m.hp.vocab_size);
    ck_assert_msg(kvq_util_make_nuq_artifact(&m, tok, 2, 48, 3, 0.0, 1, false, fp, plain, &e) == KVQ_OK, "%s", e.msg);
    /* the same tables relabelled as fitted on rht-rotated K / V (kvcalib's rotated fit: tests/test_kvcalib.c) */
    kvq_artifact a;
    ck_assert_msg(kvq_artifact_read(plain, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(a.p.rotation.kind, KVQ_ROT_NONE);
    a.p.rotation = (kvq_rotation){KVQ_ROT_RHT, 18446744073709551557ULL};
    ck_assert_msg(kvq_artifact_write(rot, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_free(&a);
    ck_assert_msg(kvq_artifact_read(rot, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(a.p.rotation.kind, KVQ_ROT_RHT);
    ck_assert(a.p.rotation.seed == 18446744073709551557ULL);
    kvq_kvcache_config cfg;
    ck_assert_int_eq(kvq_kvcache_config_from_artifact(&cfg, &a, 0, &e), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(e.msg, "rht-rotated") && strstr(e.msg, "packed cache"), "%s", e.msg);
    kvq_kv_desc d;
    kvq_kv_layer_tables *tv;
    ck_assert(kvq_kv_desc_from_artifact(&a, &d, &tv, &e) == KVQ_OK);
    ck_assert(kvq_rotation_equal(&d.rot, &a.p.rotation));
    free(tv);
    kvq_artifact_free(&a);

    const char *both[2] = {plain, rot};
    kvq_artifact_set set;
    ck_assert_msg(kvq_artifact_set_load(&set, both, 2, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("nuq3", &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(s.art_index, 0);
    ck_assert_msg(kvq_eval_scheme_make("nuq3+rht18446744073709551557", &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(s.art_index, 1);
    ck_assert_str_eq(s.name, "nuq3+sink1+rht18446744073709551557");
    /* explicit +artifact of the other rotation */
    ck_assert_int_eq(kvq_eval_scheme_make("nuq3+artifact2", &set, &m.hp, &s, &e), KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, "fitted on unrotated K / V") && strstr(e.msg, "rht-rotated"), "%s", e.msg);
    kvq_artifact_set_free(&set);
    /* only the rotated one: an unrotated spec is refused, naming both */
    ck_assert(kvq_artifact_set_load(&set, both + 1, 1, &m, fp, false, NULL, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_eval_scheme_make("nuq3", &set, &m.hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "fitted on unrotated K / V") && strstr(e.msg, "rht-rotated (seed 18446744073709551557)"), "%s",
                  e.msg);
    ck_assert_int_eq(kvq_eval_scheme_make("nuq3+rht", &set, &m.hp, &s, &e), KVQ_EINVAL); /* another seed */
    ck_assert_msg(strstr(e.msg, "rht-rotated (seed 0)") && strstr(e.msg, "seed 18446744073709551557"), "%s", e.msg);
    kvq_artifact_set_free(&set);
    /* only the plain one: a rotated spec is refused, naming both */
    ck_assert(kvq_artifact_set_load(&set, both, 1, &m, fp, false, NULL, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_eval_scheme_make("nuq3+hadamard", &set, &m.hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "fitted on hadamard-rotated K / V") && strstr(e.msg, "unrotated)"), "%s", e.msg);
    kvq_artifact_set_free(&set);
    remove(plain);
    remove(rot);
    kvq_model_free(&m);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("rotation");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_hadamard_matrix);
    tcase_add_test(tc, test_blocks_and_signs);
    tcase_add_test(tc, test_specs);
    tcase_add_test(tc, test_quantize_is_rotated);
    tcase_add_test(tc, test_rotation_reduces_outlier_error);
    tcase_add_test(tc, test_fp32_rotated_identity);
    tcase_add_test(tc, test_rotated_artifact_bind);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
