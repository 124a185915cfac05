/* test_families.c — the model families beyond Llama-2 (model.h kvq_arch,
 * kvq_rope_scaling) against Hugging Face transformers.
 *
 * Reference: tests/fixtures/hf-<name>/ (tests/scripts/hf_family_fixtures.py):
 * a tiny random-weight checkpoint per family written with transformers'
 * save_pretrained, and ref.bin with transformers' float32 logits and loss
 * (eager attention) for a fixed 32-token sequence; hf-<name>.gguf holds the
 * same weights in llama.cpp's GGUF layout. For every family:
 *  - kvq's logits (HF checkpoint) within 1e-4 relative L2 of transformers',
 *    and the mean next-token loss within 1e-5 relative;
 *  - the GGUF file gives bit-identical logits (Llama-3.1's rope_freqs
 *    factors are float32 divisors, HF's llama3 rule is computed in double:
 *    there within 1e-6);
 *  - the matrices kept as stored (--weights native) give the same logits
 *    (bit-identical: bf16 and f32 storage are converted exactly);
 * plus the parts only some families have: the Llama-3.1 rope_freqs factors
 * against the llama3 rule, the sliding window's decode loop (one token at a
 * time with the earlier K/V as prefix equals the batched window: the KV cache
 * semantics beyond the window), the dump's model_arch / rope attributes and
 * the artifact fingerprint's RoPE naming, and bad configs naming key and value.
 * The backward of each family is checked against finite differences in
 * tests/test_backward.c. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "artifact.h"
#include "dump.h"
#include "forward.h"
#include "identity.h"
#include "kvq_test.h"
#include "loaders.h"
#include "model.h"
#include "ops.h"

#define FIXDIR "tests/fixtures/hf-"

typedef struct {
    int V, T;
    int tokens[64];
    float *logits; /* [T][V] */
    double loss;
} ref_t;

static void ref_read(const char *name, ref_t *r)
{
    char p[256];
    snprintf(p, sizeof p, FIXDIR "%s/ref.bin", name);
    size_t n;
    unsigned char *b = kvq_test_slurp(p, &n);
    ck_assert_msg(b, "%s missing (tests/scripts/hf_family_fixtures.py writes it)", p);
    ck_assert(n >= 16 && memcmp(b, "KVQREF1\0", 8) == 0);
    memcpy(&r->V, b + 8, 4);
    memcpy(&r->T, b + 12, 4);
    ck_assert(r->T > 0 && r->T <= 64 && r->V > 0);
    size_t need = 16 + 4 * (size_t)r->T + 4 * (size_t)r->T * r->V + 8;
    ck_assert_msg(n == need, "%s: %zu bytes, expected %zu", p, n, need);
    memcpy(r->tokens, b + 16, 4 * (size_t)r->T);
    r->logits = malloc(4 * (size_t)r->T * r->V);
    memcpy(r->logits, b + 16 + 4 * r->T, 4 * (size_t)r->T * r->V);
    memcpy(&r->loss, b + need - 8, 8);
    free(b);
}

static void load(const char *path, kvq_weights w, kvq_model *m)
{
    kvq_err e = {0};
    kvq_load_opts o = {.weights = w};
    ck_assert_msg(kvq_model_load_opts(path, &o, m, &e) == KVQ_OK, "%s: %s", path, e.msg);
}

/* logits [T][V] and loss of the whole sequence in one window */
static double run_logits(const kvq_model *m, const ref_t *r, float *logits)
{
    kvq_forward fw;
    kvq_err e = {0};
    ck_assert_msg(kvq_forward_init(&fw, m, r->T, 0, 0, &e) == KVQ_OK, "%s", e.msg);
    kvq_fwd_io io = {.tokens = r->tokens, .T = r->T, .pos0 = 0, .logits = logits};
    kvq_fwd_result res;
    ck_assert_msg(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK, "%s", e.msg);
    kvq_forward_free(&fw);
    return res.loss;
}

static int has_gguf(const char *name)
{
    char p[256];
    snprintf(p, sizeof p, FIXDIR "%s.gguf", name);
    return access(p, R_OK) == 0;
}

/* the checks every family gets (see the header); returns nothing, asserts */
static void family_case(const char *name, kvq_arch arch, kvq_rope_scaling rs)
{
    ref_t r;
    ref_read(name, &r);
    char hf[256], gg[256];
    snprintf(hf, sizeof hf, FIXDIR "%s", name);
    snprintf(gg, sizeof gg, FIXDIR "%s.gguf", name);
    kvq_model m;
    load(hf, KVQ_WEIGHTS_F32, &m);
    ck_assert_int_eq(m.hp.arch, arch);
    ck_assert_int_eq(m.hp.rope_scaling, rs);
    ck_assert_int_eq(m.hp.vocab_size, r.V);
    size_t n = (size_t)r.T * r.V;
    float *lg = malloc(n * sizeof *lg), *lg2 = malloc(n * sizeof *lg2);
    double loss = run_logits(&m, &r, lg);
    double err = kvq_test_rel_l2_f(lg, r.logits, n), lerr = fabs(loss - r.loss) / r.loss;
    fprintf(stderr, "INFO %s (HF checkpoint): logits rel L2 %.2e vs transformers float32, loss %.8f vs %.8f (rel %.1e)\n", name, err,
            loss, r.loss, lerr);
    ck_assert_msg(err <= 1e-4, "%s: logits rel L2 %.3e > 1e-4", name, err);
    ck_assert_msg(lerr <= 1e-5, "%s: loss %.8f vs transformers %.8f", name, loss, r.loss);

    /* the matrices as stored (bf16 for qwen2, f32 for the others): the same bits */
    kvq_model mn;
    load(hf, KVQ_WEIGHTS_NATIVE, &mn);
    run_logits(&mn, &r, lg2);
    ck_assert_msg(memcmp(lg, lg2, n * sizeof *lg) == 0, "%s: native weights (%s) change the logits (rel %.2e)", name, mn.weights_desc,
                  kvq_test_rel_l2_f(lg2, lg, n));
    kvq_model_free(&mn);

    if (has_gguf(name)) {
        kvq_model mg;
        load(gg, KVQ_WEIGHTS_F32, &mg);
        ck_assert_int_eq(mg.hp.head_dim, m.hp.head_dim);
        ck_assert_int_eq(mg.hp.sliding_window, m.hp.sliding_window);
        run_logits(&mg, &r, lg2);
        double eg = kvq_test_rel_l2_f(lg2, lg, n);
        fprintf(stderr, "INFO %s (GGUF, %s): logits rel L2 %.2e vs the HF checkpoint%s\n", name, kvq_arch_name(mg.hp.arch), eg,
                memcmp(lg, lg2, n * sizeof *lg) ? "" : " (identical)");
        if (rs == KVQ_ROPE_SCALING_LLAMA3) {
            ck_assert_int_eq(mg.hp.rope_scaling, KVQ_ROPE_SCALING_FREQ_FACTORS);
            ck_assert_msg(eg <= 1e-6, "%s: GGUF rope_freqs logits rel L2 %.3e", name, eg);
        } else {
            ck_assert_int_eq(mg.hp.rope_scaling, rs);
            ck_assert_msg(memcmp(lg, lg2, n * sizeof *lg) == 0, "%s: GGUF logits differ from the HF checkpoint's (rel %.2e)", name, eg);
        }
        /* GGUF, blocks kept as stored */
        kvq_model_free(&mg);
        load(gg, KVQ_WEIGHTS_NATIVE, &mg);
        float *lg3 = malloc(n * sizeof *lg3);
        run_logits(&mg, &r, lg3);
        ck_assert_msg(memcmp(lg2, lg3, n * sizeof *lg) == 0, "%s: GGUF native weights change the logits", name);
        free(lg3);
        kvq_model_free(&mg);
    }
    free(lg);
    free(lg2);
    free(r.logits);
    kvq_model_free(&m);
}

START_TEST(test_llama31) { family_case("llama31", KVQ_ARCH_LLAMA, KVQ_ROPE_SCALING_LLAMA3); }
END_TEST
START_TEST(test_llama_yarn) { family_case("llama-yarn", KVQ_ARCH_LLAMA, KVQ_ROPE_SCALING_YARN); }
END_TEST
START_TEST(test_llama_dynamic) { family_case("llama-dynamic", KVQ_ARCH_LLAMA, KVQ_ROPE_SCALING_DYNAMIC); }
END_TEST
START_TEST(test_llama_linear) { family_case("llama-linear", KVQ_ARCH_LLAMA, KVQ_ROPE_SCALING_LINEAR); }
END_TEST
START_TEST(test_qwen2) { family_case("qwen2", KVQ_ARCH_QWEN2, KVQ_ROPE_SCALING_NONE); }
END_TEST
START_TEST(test_qwen3) { family_case("qwen3", KVQ_ARCH_QWEN3, KVQ_ROPE_SCALING_NONE); }
END_TEST
START_TEST(test_mistral) { family_case("mistral", KVQ_ARCH_MISTRAL, KVQ_ROPE_SCALING_NONE); }
END_TEST

/* What each family's loader must have read (not just "it runs"). */
START_TEST(test_family_hparams)
{
    kvq_model m;
    load(FIXDIR "qwen2", KVQ_WEIGHTS_AUTO, &m);
    ck_assert(m.hp.attn_qkv_bias && !m.hp.attn_out_bias && !m.hp.qk_norm && m.hp.sliding_window == 0);
    ck_assert_ptr_nonnull(m.layers[0].bk);
    ck_assert_ptr_null(m.layers[0].bo);
    /* the large key bias of layer 0 (channel 3 of kv head 0 in HF's rotate-half order: rope_dim 8, half 4 -> pair 3 ->
     * interleaved channel 2*3 = 6) survives the un-permutation at its interleaved place */
    ck_assert_msg(m.layers[0].bk[6] > 10, "bk[6] = %g", m.layers[0].bk[6]);
    ck_assert_int_eq(m.weights, KVQ_WEIGHTS_F32); /* auto: a small model is exact */
    kvq_model_free(&m);
    load(FIXDIR "qwen2", KVQ_WEIGHTS_NATIVE, &m);
    ck_assert_int_eq(m.weights, KVQ_WEIGHTS_NATIVE);
    ck_assert_uint_eq(m.layers[1].wq.type, 30u); /* BF16 as stored */
    ck_assert_msg(strstr(m.weights_desc, "native: BF16 x 16"), "%s", m.weights_desc); /* 7 matrices x 2 layers, the embedding and the LM head */
    kvq_model_free(&m);

    load(FIXDIR "qwen3", KVQ_WEIGHTS_AUTO, &m);
    ck_assert(m.hp.qk_norm && !m.hp.attn_qkv_bias && m.hp.tied_embeddings);
    ck_assert_int_eq(m.hp.head_dim, 16);
    ck_assert_int_eq(kvq_q_dim(&m.hp), 64); /* 4 heads x 16 != hidden 32 */
    ck_assert_int_eq(m.layers[0].wo.cols, 64);
    kvq_model_free(&m);

    load(FIXDIR "mistral", KVQ_WEIGHTS_AUTO, &m);
    ck_assert_int_eq(m.hp.sliding_window, 8);
    ck_assert_int_eq(kvq_layer_window(&m.hp, 0), 8);
    ck_assert_int_eq(kvq_layer_window(&m.hp, 1), 8);
    kvq_model_free(&m);

    load(FIXDIR "llama-yarn", KVQ_WEIGHTS_AUTO, &m);
    ck_assert_int_eq(m.hp.rope_orig_ctx, 16);
    ck_assert(m.hp.rope_scale_factor == 4.0f && m.hp.rope_beta_fast == 32.0f && m.hp.rope_beta_slow == 1.0f && m.hp.rope_yarn_truncate);
    ck_assert(fabs(m.hp.rope_attn_factor - (0.1 * log(4.0) + 1.0)) < 1e-6); /* transformers' yarn_get_mscale(4) */
    kvq_model_free(&m);
}
END_TEST

/* Llama-3.1: the GGUF factors are llama.cpp's reading of the same llama3
 * rule; kvq's frequencies from either source agree to float32 rounding,
 * and bands: high-frequency pairs unscaled, low-frequency ones divided by 8. */
START_TEST(test_llama31_freq_factors)
{
    kvq_model a, b;
    load(FIXDIR "llama31", KVQ_WEIGHTS_AUTO, &a);
    load(FIXDIR "llama31.gguf", KVQ_WEIGHTS_AUTO, &b);
    int half = a.hp.rope_dim / 2;
    double fa[KVQ_ROPE_MAX_PAIRS], fb[KVQ_ROPE_MAX_PAIRS], f0[KVQ_ROPE_MAX_PAIRS];
    kvq_rope_freqs(&a.hp, fa);
    kvq_rope_freqs(&b.hp, fb);
    kvq_hparams plain = a.hp;
    plain.rope_scaling = KVQ_ROPE_SCALING_NONE;
    kvq_rope_freqs(&plain, f0);
    for (int i = 0; i < half; i++) {
        ck_assert_msg(fabs(fa[i] - fb[i]) <= 1e-6 * fa[i], "pair %d: llama3 %.9g vs rope_freqs %.9g", i, fa[i], fb[i]);
        double wl = 2 * M_PI / f0[i];
        if (wl < 16.0 / 4) ck_assert(fa[i] == f0[i]);                         /* high frequency: kept */
        else if (wl > 16.0 / 1) ck_assert(fabs(fa[i] * 8 - f0[i]) < 1e-12 * f0[i]); /* low frequency: / factor */
    }
    kvq_model_free(&a);
    kvq_model_free(&b);
}
END_TEST

/* Sliding window and the KV cache: decoding one token at a time, with every
 * earlier token's K/V given as the (full-precision) prefix, reproduces the
 * batched window's logits, though the cache holds all 31 earlier entries:
 * entries more than W-1 positions back are masked by position, which is the
 * rolling buffer of W entries of Mistral's reference (they are never read).
 * Without the window (W = 0) the decode differs: the mask matters. */
typedef struct {
    float *k, *v; /* [L][maxP][kvd] */
    int maxP, kvd, pos;
} kvcap;
static kvq_status cap_obs(void *u, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    kvcap *k = u;
    size_t off = ((size_t)c->layer * k->maxP + k->pos) * k->kvd;
    memcpy(k->k + off, o->k_post, (size_t)c->T * k->kvd * sizeof(float));
    memcpy(k->v + off, o->v, (size_t)c->T * k->kvd * sizeof(float));
    return KVQ_OK;
}

static double decode_vs_batch(kvq_model *m, const ref_t *r, const float *batched)
{
    const int T = r->T, V = r->V, L = m->hp.n_layers, kvd = kvq_kv_dim(&m->hp);
    kvcap c = {.maxP = T, .kvd = kvd};
    c.k = calloc((size_t)L * T * kvd, sizeof(float));
    c.v = calloc((size_t)L * T * kvd, sizeof(float));
    float *pk = malloc((size_t)L * T * kvd * sizeof(float)), *pv = malloc((size_t)L * T * kvd * sizeof(float));
    float *lg = malloc((size_t)T * V * sizeof(float));
    kvq_forward fw;
    kvq_err e = {0};
    ck_assert(kvq_forward_init(&fw, m, 1, T, 0, &e) == KVQ_OK);
    kvq_hooks hk = {.user = &c, .observe = cap_obs};
    for (int t = 0; t < T; t++) {
        /* prefix: entries 0..t-1 of every layer, packed [L][t][kvd] */
        for (int l = 0; l < L; l++) {
            memcpy(pk + (size_t)l * t * kvd, c.k + (size_t)l * T * kvd, (size_t)t * kvd * sizeof(float));
            memcpy(pv + (size_t)l * t * kvd, c.v + (size_t)l * T * kvd, (size_t)t * kvd * sizeof(float));
        }
        kvq_prefix px = {.P = t, .k = pk, .v = pv};
        int tg = -1;
        c.pos = t;
        kvq_fwd_io io = {.tokens = &r->tokens[t], .T = 1, .pos0 = t, .targets = &tg, .prefix = t ? &px : NULL, .hooks = &hk,
                         .logits = lg + (size_t)t * V};
        kvq_fwd_result res;
        ck_assert_msg(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK, "%s", e.msg);
    }
    double d = kvq_test_rel_l2_f(lg, batched, (size_t)T * V);
    kvq_forward_free(&fw);
    free(c.k), free(c.v), free(pk), free(pv), free(lg);
    return d;
}

START_TEST(test_sliding_window_cache)
{
    ref_t r;
    ref_read("mistral", &r);
    kvq_model m;
    load(FIXDIR "mistral", KVQ_WEIGHTS_AUTO, &m);
    size_t n = (size_t)r.T * r.V;
    float *lg = malloc(n * sizeof *lg), *lg0 = malloc(n * sizeof *lg0);
    run_logits(&m, &r, lg);
    double d = decode_vs_batch(&m, &r, lg);
    /* the same model without its window: batched logits move away from transformers' */
    m.hp.sliding_window = 0;
    run_logits(&m, &r, lg0);
    double moved = kvq_test_rel_l2_f(lg0, r.logits, n), d0 = decode_vs_batch(&m, &r, lg0);
    fprintf(stderr, "INFO sliding window 8: decode with a 31-entry cache vs batched window: rel L2 %.2e; without the window: "
            "logits %.2e from transformers' (decode vs batched %.2e)\n", d, moved, d0);
    ck_assert_msg(d <= 1e-5, "decode vs batched %.3e", d);
    ck_assert_msg(moved > 1e-2, "the window changes nothing (%.3e): the test cannot fail", moved);
    ck_assert(d0 <= 1e-5);
    free(lg), free(lg0), free(r.logits);
    kvq_model_free(&m);
}
END_TEST

/* The dump records the architecture and every RoPE parameter; the artifact
 * fingerprint changes with them, and a mismatch names both RoPE configurations. */
START_TEST(test_rope_identity)
{
    kvq_model a, b, c;
    load(FIXDIR "llama-yarn", KVQ_WEIGHTS_AUTO, &a);
    load(FIXDIR "llama31", KVQ_WEIGHTS_AUTO, &b);
    load(FIXDIR "llama31.gguf", KVQ_WEIGHTS_AUTO, &c);
    kvq_dump_meta *m = calloc(1, sizeof *m);
    kvq_dump_meta_set_hparams(m, &a.hp);
    ck_assert_str_eq(m->model_arch, "llama");
    ck_assert_str_eq(m->rope_scaling, "yarn");
    ck_assert_int_eq(m->rope_orig_ctx, 16);
    ck_assert_msg(strstr(m->rope_params, "beta_fast=32 beta_slow=1 attn_factor=1.13862944 truncate=1"), "%s", m->rope_params);
    kvq_dump_meta_set_hparams(m, &c.hp);
    ck_assert_str_eq(m->rope_scaling, "freq_factors");
    /* head_dim 8: no pair of wavelength below 16/4, the first is smoothed: factor 1.736 */
    ck_assert_msg(strstr(m->rope_params, "n=4 min=1.73594117 max=8 sha256="), "%s", m->rope_params);
    kvq_model q;
    load(FIXDIR "mistral", KVQ_WEIGHTS_AUTO, &q);
    kvq_dump_meta_set_hparams(m, &q.hp);
    ck_assert_str_eq(m->model_arch, "mistral");
    ck_assert_str_eq(m->attention, "sliding_window=8 first_layer=0");
    kvq_model_free(&q);

    /* fingerprints: any RoPE parameter changes them; a model without the new parameters keeps the v1 text */
    const char *w = "0000000000000000000000000000000000000000000000000000000000000000";
    char f1[65], f2[65], d1[512], d2[512];
    kvq_err e = {0};
    kvq_hparams h = a.hp;
    ck_assert(kvq_identity_model_hp(w, &h, f1, &e) == KVQ_OK);
    h.rope_beta_fast = 16;
    ck_assert(kvq_identity_model_hp(w, &h, f2, &e) == KVQ_OK);
    ck_assert_str_ne(f1, f2);
    h = b.hp;
    ck_assert(kvq_identity_model_hp(w, &h, f1, &e) == KVQ_OK);
    h.rope_high_freq_factor = 5;
    ck_assert(kvq_identity_model_hp(w, &h, f2, &e) == KVQ_OK);
    ck_assert_str_ne(f1, f2);

    /* an artifact calibrated under llama3 RoPE, loaded for the YaRN model: refused, naming both */
    kvq_artifact_params p = {0};
    ck_assert(kvq_identity_model_hp(w, &b.hp, p.model_fingerprint, &e) == KVQ_OK);
    ck_assert(kvq_identity_rope_desc_hp(&b.hp, p.model_rope, sizeof p.model_rope, &e) == KVQ_OK);
    ck_assert(kvq_identity_model_hp(w, &a.hp, f1, &e) == KVQ_OK);
    ck_assert(kvq_identity_rope_desc_hp(&a.hp, d1, sizeof d1, &e) == KVQ_OK);
    kvq_status s = kvq_artifact_check_model_rope(&p, f1, d1, false, NULL, &e);
    ck_assert_int_eq(s, KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, "calibrated under RoPE scaling llama3 (theta 500000, rope_dim 8, factor 8, low_freq_factor 1, high_freq_factor 4, "
                                "original ctx 16)") &&
                      strstr(e.msg, "the model uses RoPE scaling yarn (theta 10000, rope_dim 8, factor 4, original ctx 16, beta_fast=32"),
                  "%s", e.msg);
    /* the same model: accepted */
    ck_assert(kvq_identity_model_hp(w, &b.hp, f2, &e) == KVQ_OK);
    ck_assert(kvq_identity_rope_desc_hp(&b.hp, d2, sizeof d2, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_artifact_check_model_rope(&p, f2, d2, false, NULL, &e), KVQ_OK);
    free(m);
    kvq_model_free(&a);
    kvq_model_free(&b);
    kvq_model_free(&c);
}
END_TEST

/* ---- bad configs: the key and the value named, nothing ignored ----------- */

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    ck_assert(f);
    fputs(text, f);
    fclose(f);
}

/* copy of a fixture with config.json edited: key set to json (or removed when json is NULL) */
static void with_config(const char *fixture, const char *key, const char *json, char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/kvq_test_families_XXXXXX");
    ck_assert(mkdtemp(dir));
    char src[512], dst[512];
    snprintf(src, sizeof src, FIXDIR "%s/model.safetensors", fixture);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    char *abs = realpath(src, NULL);
    ck_assert_msg(abs, "%s: %s", src, strerror(errno));
    ck_assert_msg(symlink(abs, dst) == 0, "symlink %s -> %s: %s", dst, abs, strerror(errno));
    free(abs);
    snprintf(src, sizeof src, FIXDIR "%s/config.json", fixture);
    char *cfg = kvq_test_slurp(src, NULL);
    ck_assert(cfg);
    char *out = malloc(strlen(cfg) + 4096);
    /* a top-level key added first (JSON objects: the last duplicate would win in most readers; kvq's cJSON takes the
     * first), or the existing one replaced by text surgery on `"key": value` */
    char pat[128];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    char *at = strstr(cfg, pat);
    if (at) {
        char *v = at + strlen(pat), *end = v;
        int depth = 0;
        while (*end == ' ') end++;
        for (; *end; end++) {
            if (*end == '{' || *end == '[') depth++;
            else if (*end == '}' || *end == ']') {
                if (depth == 0) break;
                depth--;
            } else if (*end == ',' && depth == 0) break;
        }
        if (json) sprintf(out, "%.*s %s%s", (int)(v - cfg), cfg, json, end);
        else sprintf(out, "%.*s null%s", (int)(v - cfg), cfg, end);
    } else {
        sprintf(out, "{\"%s\": %s,%s", key, json ? json : "null", cfg + 1);
    }
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    write_file(dst, out);
    free(out);
    free(cfg);
}

static void rm_dir(const char *dir)
{
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

START_TEST(test_bad_configs)
{
    struct {
        const char *fixture, *key, *json;
        kvq_status code;
        const char *needle;
    } bad[] = {
        {"llama31", "rope_scaling", "{\"rope_type\": \"longrope\", \"factor\": 4}", KVQ_EUNSUPPORTED,
         "'rope_scaling.rope_type': RoPE scaling \"longrope\" is not supported"},
        {"llama-yarn", "rope_parameters", "{\"rope_type\": \"llama4\", \"rope_theta\": 10000}", KVQ_EUNSUPPORTED,
         "'rope_parameters.rope_type': RoPE scaling \"llama4\""},
        {"llama-yarn", "rope_parameters", "{\"full_attention\": {\"rope_type\": \"default\"}}", KVQ_EUNSUPPORTED,
         "'rope_parameters': per-layer-type RoPE parameters"},
        {"llama-yarn", "rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 0}", KVQ_EFORMAT,
         "'rope_parameters.factor': expected a finite positive number, found 0"},
        {"llama31", "model_type", "\"phi3\"", KVQ_EUNSUPPORTED, "'model_type': expected \"llama\", \"qwen2\", \"qwen3\" or \"mistral\", found \"phi3\""},
        {"qwen2", "architectures", "[\"LlamaForCausalLM\"]", KVQ_EUNSUPPORTED, "'architectures': expected it to list \"Qwen2ForCausalLM\""},
        {"qwen2", "layer_types", "[\"full_attention\", \"sliding_attention\"]", KVQ_EFORMAT,
         "'layer_types' has sliding-window layers but 'sliding_window' is not in use"},
        {"qwen2", "layer_types", "[\"sliding_attention\", \"full_attention\"]", KVQ_EUNSUPPORTED,
         "'layer_types[1]': a full-attention layer after sliding-window layer 0"},
        {"qwen2", "layer_types", "[\"chunked_attention\", \"full_attention\"]", KVQ_EUNSUPPORTED, "'layer_types[0]'"},
        {"mistral", "layer_types", "[\"sliding_attention\", \"sliding_attention\"]", KVQ_EUNSUPPORTED,
         "per-layer attention types are not supported for model_type \"mistral\""},
        {"mistral", "sliding_window", "-3", KVQ_EFORMAT, "'sliding_window': expected a positive integer"},
        {"qwen3", "head_dim", "12", KVQ_EFORMAT, "'model.layers.0.self_attn.q_proj.weight': expected shape [48, 32]"},
        {"qwen3", "mlp_bias", "true", KVQ_EUNSUPPORTED, "'mlp_bias': expected false"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char dir[64];
        with_config(bad[i].fixture, bad[i].key, bad[i].json, dir, sizeof dir);
        kvq_model m;
        kvq_err e = {0};
        kvq_status s = kvq_model_load(dir, &m, &e);
        if (s == KVQ_OK) kvq_model_free(&m);
        ck_assert_msg(s == bad[i].code && strstr(e.msg, bad[i].needle) && strstr(e.msg, dir),
                      "%s %s=%s: status %d, message: %s", bad[i].fixture, bad[i].key, bad[i].json, s, e.msg);
        rm_dir(dir);
    }
    /* mistral with sliding_window null: full attention (transformers: create_causal_mask) */
    char dir[64];
    with_config("mistral", "sliding_window", NULL, dir, sizeof dir);
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(m.hp.sliding_window, 0);
    kvq_model_free(&m);
    rm_dir(dir);
}
END_TEST

/* Qwen2 end to end: kvdump (with --fisher: the backward through the biases)
 * records the key biases as /k_bias, equal to the model's; kvstat reports
 * their norm per layer and the channels they dominate: the +12 offset that
 * tests/scripts/hf_family_fixtures.py puts on HF channel 3 of layer 0 is
 * kvq channel 6 (rotate-half -> interleaved) and the largest. */
static int sh(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

START_TEST(test_qwen2_dump_kvstat_k_bias)
{
    char tok[4096], text[4096], kvdump[4096], kvstat[4096];
    KVQ_SKIP_IF(!kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared absent");
    ck_assert_msg(kvq_test_bin(kvdump, sizeof kvdump, "kvdump") && kvq_test_bin(kvstat, sizeof kvstat, "kvstat"), "kvdump/kvstat not built");
    char out[256], md[256], cmd[16384];
    snprintf(out, sizeof out, "/tmp/kvq_test_families_%d.h5", (int)getpid());
    snprintf(md, sizeof md, "/tmp/kvq_test_families_%d.md", (int)getpid());
    unlink(out);
    snprintf(cmd, sizeof cmd, "%s -m " FIXDIR "qwen2 --tokenizer %s -t %s -n 2 -L 32 --fisher --device cpu -q -o %s", kvdump, tok, text, out);
    ck_assert_int_eq(sh(cmd), 0);
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(out, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_dump_reader_meta(r)->model_arch, "qwen2");
    kvq_model m;
    load(FIXDIR "qwen2", KVQ_WEIGHTS_AUTO, &m);
    const int kvd = kvq_kv_dim(&m.hp);
    float kb[2 * 64];
    bool present = false;
    ck_assert(kvq_dump_read_k_bias(r, kb, &present, &e) == KVQ_OK && present);
    for (int l = 0; l < 2; l++) ck_assert(memcmp(kb + l * kvd, m.layers[l].bk, kvd * sizeof(float)) == 0);
    kvq_dump_close(r);
    snprintf(cmd, sizeof cmd, "%s %s -q --markdown %s", kvstat, out, md);
    ck_assert_int_eq(sh(cmd), 0);
    char *rep = kvq_test_slurp(md, NULL);
    ck_assert_ptr_nonnull(rep);
    char *tab = strstr(rep, "Key biases per layer");
    ck_assert_msg(tab, "no key-bias table in:\n%s", rep);
    char want[64];
    snprintf(want, sizeof want, "| %.4g (6) |", (double)fabsf(m.layers[0].bk[6]));
    ck_assert_msg(strstr(tab, want), "'%s' not in the key-bias table:\n%.1500s", want, tab);
    free(rep);
    unlink(out);
    unlink(md);
    kvq_model_free(&m);
}
END_TEST

/* The RoPE configuration end to end: an artifact calibrated on the Qwen2
 * checkpoint records it (kvq.model_rope); kveval refuses the artifact for the
 * same weights under YaRN scaling, naming both configurations, and accepts it
 * for the checkpoint it was calibrated on. */
START_TEST(test_artifact_rope_mismatch_cli)
{
    char tok[4096], text[4096], kvdump[4096], kvcalib[4096], kveval[4096];
    KVQ_SKIP_IF(!kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared absent");
    ck_assert_msg(kvq_test_bin(kvdump, sizeof kvdump, "kvdump") && kvq_test_bin(kvcalib, sizeof kvcalib, "kvcalib") &&
                      kvq_test_bin(kveval, sizeof kveval, "kveval"),
                  "kvdump/kvcalib/kveval not built");
    char dump[256], art[256], errf[256], yarn[64], cmd[20000];
    snprintf(dump, sizeof dump, "/tmp/kvq_test_families_rope_%d.h5", (int)getpid());
    snprintf(art, sizeof art, "/tmp/kvq_test_families_rope_%d.safetensors", (int)getpid());
    snprintf(errf, sizeof errf, "/tmp/kvq_test_families_rope_%d.err", (int)getpid());
    unlink(dump);
    snprintf(cmd, sizeof cmd, "%s -m " FIXDIR "qwen2 --tokenizer %s -t %s -n 2 -L 64 --device cpu -q -o %s", kvdump, tok, text, dump);
    ck_assert_int_eq(sh(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s %s --method int-pc --bits 3 -q -f -o %s", kvcalib, dump, art);
    ck_assert_int_eq(sh(cmd), 0);
    kvq_artifact a;
    kvq_err e = {0};
    ck_assert_msg(kvq_artifact_read(art, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(!strcmp(a.p.model_rope, "none (theta 1000000, rope_dim 8)"), "kvq.model_rope = \"%s\"", a.p.model_rope);
    kvq_artifact_free(&a);
    /* the same weights, YaRN scaling added to the config */
    with_config("qwen2", "rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 32, "
                "\"rope_theta\": 1000000}", yarn, sizeof yarn);
    snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s --ctx 64 -w 1 --device cpu -q --artifact %s -s int3-pc >/dev/null 2>%s", kveval, yarn,
             tok, text, art, errf);
    ck_assert_int_eq(sh(cmd), 1);
    char *msg = kvq_test_slurp(errf, NULL);
    ck_assert_ptr_nonnull(msg);
    ck_assert_msg(strstr(msg, "calibrated under RoPE scaling none (theta 1000000, rope_dim 8), but the model uses RoPE scaling yarn (theta 1000000, "
                              "rope_dim 8, factor 4, original ctx 32, beta_fast=32 beta_slow=1 attn_factor=1.13862944 truncate=1)"),
                  "%s", msg);
    free(msg);
    rm_dir(yarn);
    snprintf(cmd, sizeof cmd, "%s -m " FIXDIR "qwen2 --tokenizer %s -t %s --ctx 64 -w 1 --device cpu -q --artifact %s -s int3-pc >/dev/null 2>%s",
             kveval, tok, text, art, errf);
    ck_assert_int_eq(sh(cmd), 0);
    unlink(dump);
    unlink(art);
    unlink(errf);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("families");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_llama31);
    tcase_add_test(tc, test_llama_yarn);
    tcase_add_test(tc, test_llama_dynamic);
    tcase_add_test(tc, test_llama_linear);
    tcase_add_test(tc, test_qwen2);
    tcase_add_test(tc, test_qwen3);
    tcase_add_test(tc, test_mistral);
    tcase_add_test(tc, test_family_hparams);
    tcase_add_test(tc, test_llama31_freq_factors);
    tcase_add_test(tc, test_sliding_window_cache);
    tcase_add_test(tc, test_rope_identity);
    tcase_add_test(tc, test_bad_configs);
    tcase_add_test(tc, test_qwen2_dump_kvstat_k_bias);
    tcase_add_test(tc, test_artifact_rope_mismatch_cli);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
