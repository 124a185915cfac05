/* test_seam.c — one implementation per scheme (kernels/schemes/family.h):
 * one K/V block goes through every consumer of a family and they must agree
 * bit for bit:
 *   kvcalib  the family's calib part fits the tables of an artifact from the
 *            block (what kvcalib runs per layer), its realised outlier count
 *            and bits accounting (kvq_calib_fill_bits);
 *   kveval   the bound scheme's transform hook (kvq_scheme_transform, an
 *            artifact set holding that artifact) on the block as one layer;
 *   kvstat   the artifact's own scheme (kvq_qscheme_from_artifact), keys and
 *            values quantized as kvstat measures their error;
 *   runtime  the packed cache (kvq_kvcache_config_from_artifact, append,
 *            dequantize), where the family has one (nuq, kivi);
 * for nuq (pre-RoPE keys, dense-and-sparse outliers, a sink token), kivi
 * (R = 0, so the resting cache is every complete group) and fp8 per-head
 * scales. The inputs are fp16-representable (the runtime cache holds exact
 * rows in fp16). Also: every family of the registry parses its own canonical
 * name back to itself, and every --help list comes from the registry. */
#include <math.h>
#include <stdint.h>

#include "artifact.h"
#include "family.h"
#include "kv_desc.h"
#include "kvcache.h"
#include "kvq_test.h"
#include "kvsrc.h"
#include "scheme.h"

enum { T = 64, H = 2, D = 32, KVD = H * D };

static void make_block(float *k, float *v)
{
    uint32_t s = 12345;
    for (int i = 0; i < T * KVD; i++) {
        s = s * 1664525u + 1013904223u;
        float a = (float)((int)(s >> 8) % 20001 - 10000) / 4000.0f;
        s = s * 1664525u + 1013904223u;
        float b = (float)((int)(s >> 8) % 20001 - 10000) / 5000.0f;
        int c = i % KVD;
        k[i] = kvq_round_fp16(a * (1.0f + (float)(c % 7)) + (c == 5 ? 9.0f : 0.0f)); /* an outlier channel */
        v[i] = kvq_round_fp16(b * (i % 97 == 0 ? 12.0f : 1.0f));
    }
}

static size_t n_differ(const float *a, const float *b, size_t n)
{
    size_t f = 0;
    for (size_t i = 0; i < n; i++) f += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return f;
}

static kvq_hparams block_hp(void)
{
    kvq_hparams hp = {.n_layers = 1, .dim = 2 * KVD, .hidden_dim = 64, .n_heads = 2 * H, .n_kv_heads = H, .head_dim = D,
                      .vocab_size = 16, .ctx_len = 4096, .rope_dim = D, .rope_theta = 10000, .norm_eps = 1e-5f};
    return hp;
}

/* kvcalib's step: the family's fit on (layer 0, side) of the block */
static void fit_artifact(kvq_artifact *a, const char *method, int bits, double outliers, size_t sink, bool per_head,
                         const float *k, const float *v)
{
    memset(a, 0, sizeof *a);
    const kvq_family *f = kvq_family_method(method);
    ck_assert_ptr_nonnull(f);
    kvq_artifact_params *p = &a->p;
    p->method = f;
    p->k_bits = p->v_bits = bits;
    p->outlier_frac = outliers;
    p->n_sink = sink;
    p->post_rope = f->calib->post_rope;
    p->per_head = per_head;
    p->fp8_percentile = f->calib->fp8_percentile;
    p->group_size = f->calib->group_opt ? f->calib->group : 0;
    if (!strcmp(method, "kivi")) p->group_size = 8;
    snprintf(p->fit, sizeof p->fit, "%s", f->calib->fit_opt ? "auto" : "");
    p->n_layers = 1;
    p->n_kv_heads = H;
    p->head_dim = D;
    kvq_err e = {0};
    float kx[T * KVD], vx[T * KVD];
    memcpy(kx, k, sizeof kx);
    memcpy(vx, v, sizeof vx);
    kvq_rope rope = {.rope_dim = D, .rope_theta = 10000, .scale = 1};
    if (p->post_rope) ck_assert(kvq_rope_rotate(kx, T, H, D, &rope, 0, &e) == KVQ_OK); /* kvcalib reads /layers/i/k */
    kvq_fit_input in = {.n_tokens = T, .sample_len = T, .n_kv_heads = H, .head_dim = D, .fit = {.method = KVQ_FIT_AUTO}};
    if (f->calib->fit_k) {
        a->k = calloc(1, sizeof *a->k);
        in.x = kx;
        ck_assert_msg(f->calib->fit(p, 'k', &in, &a->k[0], &e) == KVQ_OK, "%s", e.msg);
    }
    if (f->calib->fit_v) {
        a->v = calloc(1, sizeof *a->v);
        in.x = vx;
        ck_assert_msg(f->calib->fit(p, 'v', &in, &a->v[0], &e) == KVQ_OK, "%s", e.msg);
    }
    ck_assert_msg(kvq_calib_fill_bits(p, T, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_artifact_validate(a, &e) == KVQ_OK, "%s", e.msg);
}

/* every consumer on the block; out_k/out_v: what kveval's transform attends (post-RoPE keys), for the runtime check */
static void consumers(const char *spec, const kvq_artifact *a, const float *k, const float *v, bool runtime)
{
    kvq_err e = {0};
    kvq_hparams hp = block_hp();
    kvq_rope rope = {.rope_dim = D, .rope_theta = 10000, .scale = 1};
    /* kveval: a bound scheme over an artifact set holding a */
    kvq_kv_layer_tables *views;
    ck_assert(kvq_kv_layer_tables_view(a, &views, &e) == KVQ_OK);
    kvq_eval_prefix px = {0};
    char path[1][4096] = {"block.safetensors"};
    kvq_artifact_set set = {.n = 1, .a = (kvq_artifact *)a, .prefix = &px, .path = path, .tables = &views};
    kvq_eval_scheme es;
    ck_assert_msg(kvq_eval_scheme_make(spec, &set, &hp, &es, &e) == KVQ_OK, "%s: %s", spec, e.msg);
    const bool pre = es.s.key_stage == KVQ_KEYS_PRE_ROPE;
    /* keys as the family's stage sees them */
    static float ks[T * KVD], kt[T * KVD], vt[T * KVD], ka[T * KVD], va[T * KVD];
    memcpy(ks, k, sizeof ks);
    if (!pre) ck_assert(kvq_rope_rotate(ks, T, H, D, &rope, 0, &e) == KVQ_OK);
    if (!pre && runtime) kvq_quant_fp16(ks, ks, T * KVD, NULL); /* the runtime cache holds post-RoPE keys in fp16 until flushed */
    memcpy(kt, ks, sizeof kt);
    memcpy(vt, v, sizeof vt);
    int kb[T], vb[T];
    kvq_kv_alt alt = {ka, kb, false, va, vb, false, NULL};
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &es, &hk);
    kvq_layer_ctx c = {.layer = 0, .T = T, .n_heads = hp.n_heads, .n_kv_heads = H, .head_dim = D};
    ck_assert_msg(kvq_scheme_transform(&run, &c, kt, vt, &alt, &e) == KVQ_OK, "%s", e.msg);
    kvq_scheme_run_free(&run);
    const float *rk = alt.use_k ? ka : kt, *rv = alt.use_v ? va : vt; /* the resting (quantized) representation */
    /* kvstat: the artifact's own scheme */
    kvq_qscheme_state st;
    kvq_qscheme qs;
    ck_assert_msg(kvq_qscheme_from_artifact(a, &st, &qs, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(qs.keys_post_rope == !pre);
    { /* kvstat's label: a family name ending in a digit is followed by its spec, not the bits ("nvfp44/4") */
        const char *fn = a->p.method->name;
        char spec[64];
        kvq_artifact_scheme_spec(&a->p, spec, sizeof spec);
        if (fn[strlen(fn) - 1] >= '0' && fn[strlen(fn) - 1] <= '9')
            ck_assert_msg(!strncmp(st.name, spec, strlen(spec)), "label '%s', expected it to start with '%s'", st.name, spec);
    }
    static float sk[T * KVD], sv[T * KVD];
    uint64_t no = 0, ne = 0, vo = 0, vn = 0;
    ck_assert(qs.quantize(qs.ctx, 0, false, ks, T, KVD, sk, &no, &ne, &e) == KVQ_OK);
    ck_assert(qs.quantize(qs.ctx, 0, true, v, T, KVD, sv, &vo, &vn, &e) == KVQ_OK);
    ck_assert_msg(n_differ(sk, rk, T * KVD) == 0, "%s: kvstat keys differ from kveval's", spec);
    ck_assert_msg(n_differ(sv, rv, T * KVD) == 0, "%s: kvstat values differ from kveval's", spec);
    ck_assert_uint_eq(no, run.k_counts.n_outliers);
    ck_assert_uint_eq(vo, run.v_counts.n_outliers);
    /* kvcalib: the calibration's realised key outliers on the same block are the quantizer's, its bits kveval's */
    if (a->k && a->k[0].channel_lower) ck_assert_uint_eq(a->k[0].n_outliers, run.k_counts.n_outliers);
    kvq_bits b;
    ck_assert(kvq_eval_scheme_bits(&es, T, &hp, &b, &e) == KVQ_OK);
    ck_assert_msg(b.k == a->p.bits_k && b.v == a->p.bits_v, "%s: kveval bits %.17g/%.17g, the artifact's %.17g/%.17g", spec,
                  b.k, b.v, a->p.bits_k, a->p.bits_v);
    /* teeth: the scheme changes the block */
    ck_assert_uint_gt(n_differ(rk, ks, T * KVD), T * KVD / 4);
    if (runtime) {
        kvq_kvcache_config cfg = {0};
        ck_assert_msg(kvq_kvcache_config_from_artifact(&cfg, a, 0, &e) == KVQ_OK, "%s", e.msg);
        cfg.n_seqs = 1;
        cfg.max_tokens = T;
        cfg.rope = rope;
        kvq_kvcache *kc;
        ck_assert_msg(kvq_kvcache_create(&kc, &cfg, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_kvcache_append(kc, 0, k, v, T, &e) == KVQ_OK, "%s", e.msg);
        static float dk[T * KVD], dv[T * KVD], want[T * KVD];
        ck_assert(kvq_kvcache_dequant(kc, 0, dk, dv, &e) == KVQ_OK);
        memcpy(want, rk, sizeof want);
        if (pre) ck_assert(kvq_rope_rotate(want, T, H, D, &rope, 0, &e) == KVQ_OK);
        if (!strcmp(es.s.q.fam->name, "kivi")) {
            /* the cache after T appends holds what query T-1 reads: rows before the family's boundaries quantized, the
             * rest in fp16 (KIVI's key group that the last step completed is flushed after that step) */
            int b2k[T], b2v[T];
            ck_assert(kvq_kv_desc_alt_bounds(&es.desc, T, b2k, b2v));
            static float wv[T * KVD];
            for (int j = 0; j < T; j++)
                for (int ch = 0; ch < KVD; ch++) {
                    want[j * KVD + ch] = j < b2k[T - 1] ? rk[j * KVD + ch] : kvq_round_fp16(ks[j * KVD + ch]);
                    wv[j * KVD + ch] = j < b2v[T - 1] ? rv[j * KVD + ch] : kvq_round_fp16(v[j * KVD + ch]);
                }
            ck_assert_int_lt(b2k[T - 1], T); /* teeth: the composition matters */
            /* the packed KIVI format stores each group's scale as float (formats/KVCACHE.md), the simulation keeps it in
             * double: the same codes, reconstructions apart by at most the scale's rounding times the code (< 2^-21 of
             * the group's range at 2 bits) */
            double worst = 0;
            for (int i = 0; i < T * KVD; i++) {
                double dkx = fabs((double)dk[i] - want[i]), dvx = fabs((double)dv[i] - wv[i]);
                worst = fmax(worst, fmax(dkx, dvx));
            }
            ck_assert_msg(worst < 1e-5, "%s: the runtime cache differs from kveval's by %g", spec, worst);
        } else {
            ck_assert_msg(n_differ(dk, want, T * KVD) == 0, "%s: the runtime cache's keys differ from kveval's (%zu)", spec,
                          n_differ(dk, want, T * KVD));
            ck_assert_msg(n_differ(dv, rv, T * KVD) == 0, "%s: the runtime cache's values differ from kveval's (%zu)", spec,
                          n_differ(dv, rv, T * KVD));
        }
        kvq_kvcache_free(kc);
    }
    kvq_qscheme_state_free(&st);
    free(views);
}

START_TEST(test_one_implementation)
{
    static float k[T * KVD], v[T * KVD];
    make_block(k, v);
    kvq_artifact a;
    fit_artifact(&a, "nuq", 3, 0.02, 1, false, k, v);
    consumers("nuq3-2%", &a, k, v, true);
    kvq_artifact_free(&a);
    fit_artifact(&a, "nuq", 4, 0.0, 0, true, k, v);
    consumers("nuq4", &a, k, v, true);
    kvq_artifact_free(&a);
    fit_artifact(&a, "int-pc", 4, 0.02, 1, false, k, v);
    consumers("int4-pc-2%+post-rope", &a, k, v, false);
    kvq_artifact_free(&a);
    fit_artifact(&a, "kivi", 2, 0, 0, false, k, v);
    a.p.residual_length = 0;
    kvq_err e = {0};
    ck_assert(kvq_calib_fill_bits(&a.p, T, &e) == KVQ_OK);
    consumers("kivi2-g8-r0", &a, k, v, true);
    kvq_artifact_free(&a);
    fit_artifact(&a, "fp8", 8, 0, 0, true, k, v);
    consumers("fp8-head", &a, k, v, false);
    kvq_artifact_free(&a);
    fit_artifact(&a, "nvfp4", 4, 0, 0, false, k, v);
    consumers("nvfp4-tensor", &a, k, v, false);
    kvq_artifact_free(&a);
}
END_TEST

START_TEST(test_registry_round_trip)
{
    kvq_hparams hp = block_hp();
    hp.head_dim = 64;
    hp.n_kv_heads = 2;
    hp.rope_dim = 64;
    size_t n;
    const kvq_family *const *f = kvq_families(&n);
    ck_assert_uint_ge(n, 11);
    /* one spec per family that needs no artifact, plus its canonical name parsed back */
    const char *specs[] = {"fp32", "fp16+sink2", "int3-g32", "kivi2", "fp8", "e5m2+sink1", "q4_0", "hh2-i8-15%-w16",
                           "nvfp4", "mxfp4+sink1", "fp4_mx_block16",
                           "zipcache-h8-l3-b25%-w16-n8-g32-p10%-kt+sink1", "mikv-h4-l2-nobal"};
    for (size_t i = 0; i < sizeof specs / sizeof *specs; i++) {
        kvq_err e = {0};
        kvq_eval_scheme s, s2;
        ck_assert_msg(kvq_eval_scheme_make(specs[i], NULL, &hp, &s, &e) == KVQ_OK, "%s: %s", specs[i], e.msg);
        ck_assert_msg(kvq_eval_scheme_make(s.name, NULL, &hp, &s2, &e) == KVQ_OK, "%s: %s", s.name, e.msg);
        ck_assert_str_eq(s2.name, s.name);
        ck_assert_ptr_eq(s2.s.q.fam, s.s.q.fam);
        ck_assert(memcmp(&s2.s.q, &s.s.q, sizeof s.s.q) == 0);
        /* what a GPU engine is handed: the descriptor only for a family with a native CUDA part (the KL
         * divergence's GPU path once handed fp8's to the engine, which refused it); the rest run on the host */
        const kvq_kv_desc *d = kvq_eval_scheme_kv_desc(&s), *g = kvq_eval_scheme_gpu_desc(&s);
        ck_assert_ptr_eq(g, s.s.q.fam->cuda ? d : NULL);
        if (i == 0) ck_assert_ptr_null(d);
        if (i >= 4) ck_assert_msg(d && !g, "%s: a descriptor, run on the host", specs[i]);
    }
    /* the syntax line and kvcalib's methods list every family of the registry */
    char syn[KVQ_SCHEME_SYNTAX_MAX], methods[256];
    kvq_scheme_syntax(syn, sizeof syn);
    kvq_family_methods("|", methods, sizeof methods);
    for (size_t i = 0; i < n; i++) {
        ck_assert_msg(strstr(syn, f[i]->syntax), "%s missing from '%s'", f[i]->name, syn);
        if (f[i]->calib) ck_assert_msg(strstr(methods, f[i]->name), "%s missing from '%s'", f[i]->name, methods);
        /* a family's required parts */
        ck_assert(f[i]->parse && f[i]->format && f[i]->quantize && f[i]->bits);
        if (f[i]->calib) ck_assert(f[i]->artifact && f[i]->from_params);
    }
    /* kvcalib --help describes every method (its summary buffer once filled up and dropped minicache and qaq) */
    char bin[4096], cmd[4400];
    const char *kvcalib = kvq_test_bin(bin, sizeof bin, "kvcalib");
    ck_assert_msg(kvcalib, "%s: kvcalib not built (KVQ_BIN_DIR)", bin);
    snprintf(cmd, sizeof cmd, "%s --help 2>&1", kvcalib);
    FILE *hf = popen(cmd, "r");
    ck_assert(hf != NULL);
    static char help[65536];
    size_t hn = fread(help, 1, sizeof help - 1, hf);
    help[hn] = 0;
    pclose(hf);
    for (size_t i = 0; i < n; i++) {
        if (!f[i]->calib) continue;
        char line[64];
        snprintf(line, sizeof line, "\n  %-7s %.16s", f[i]->name, f[i]->summary);
        ck_assert_msg(strstr(help, line), "kvcalib --help lacks the line of method %s ('%s')", f[i]->name, line + 1);
    }
    /* the original methods first, in listing order (families added later follow: wkvq, cq, ...) */
    ck_assert_msg(!strncmp(methods, "nuq|int|int-pc|kivi|fp8|", 24), "%s", methods);
    ck_assert_msg(strstr(methods, "|wkvq") && strstr(methods, "|cq") && strstr(methods, "|nvfp4") && strstr(methods, "|mikv") &&
                  strstr(methods, "|skvq") && strstr(methods, "|minicache"), "%s", methods);
}
END_TEST

/* The family-table container of the seam (artifact.h): names, shapes, limits, lookup. */
START_TEST(test_family_tables)
{
    kvq_kv_table t = {0};
    kvq_err e;
    float *d = NULL;
    const uint64_t sh[3] = {2, 3, 4};
    ck_assert_int_eq(kvq_kv_table_add(&t, "codebook", 3, sh, &d, &e), KVQ_OK);
    ck_assert_ptr_nonnull(d);
    for (int i = 0; i < 24; i++) ck_assert(d[i] == 0.0f); /* zero-filled */
    d[23] = 7.0f;
    const kvq_fam_tensor *x = kvq_kv_table_get(&t, "codebook");
    ck_assert_ptr_nonnull(x);
    ck_assert_uint_eq(kvq_fam_tensor_len(x), 24);
    ck_assert(x->data[23] == 7.0f && x->n_dims == 3 && x->shape[2] == 4);
    ck_assert_ptr_null(kvq_kv_table_get(&t, "codebooks"));
    /* refusals name the rule */
    ck_assert_int_eq(kvq_kv_table_add(&t, "codebook", 1, sh, &d, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "already present"));
    ck_assert_int_eq(kvq_kv_table_add(&t, "bad-name", 1, sh, &d, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "[A-Za-z0-9_]"));
    ck_assert_int_eq(kvq_kv_table_add(&t, "four", 4, sh, &d, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "dimensions"));
    const uint64_t zero[1] = {0};
    ck_assert_int_eq(kvq_kv_table_add(&t, "empty", 1, zero, &d, &e), KVQ_EINVAL);
    ck_assert_ptr_null(d);
    for (int i = 1; i < KVQ_FAM_TENSORS; i++) {
        char nm[16];
        snprintf(nm, sizeof nm, "t%d", i);
        ck_assert_int_eq(kvq_kv_table_add(&t, nm, 1, sh, &d, &e), KVQ_OK);
    }
    ck_assert_int_eq(kvq_kv_table_add(&t, "one_more", 1, sh, &d, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "at most"));
    ck_assert_uint_eq(t.n_ft, KVQ_FAM_TENSORS);
    kvq_kv_table_free(&t);
    ck_assert_uint_eq(t.n_ft, 0);
    /* what a layer fit may read, per dataset */
    kvq_calib_src src = {.n_samples = 3, .seq_len = 5, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8};
    ck_assert_uint_eq(kvq_calib_src_len(&src, 0), 3 * 5 * 2 * 8);  /* k_pre_rope */
    ck_assert_uint_eq(kvq_calib_src_len(&src, 3), 3 * 5 * 4 * 8);  /* q */
    ck_assert_uint_eq(kvq_calib_src_len(&src, 5), 3 * 5 * 2 * 8);  /* fisher_v */
    ck_assert_uint_eq(kvq_calib_src_len(&src, 6), 3 * 4 * 5);      /* attn_received */
    ck_assert_uint_eq(kvq_calib_src_len(&src, 8), 0);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("seam");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_one_implementation);
    tcase_add_test(tc, test_registry_round_trip);
    tcase_add_test(tc, test_family_tables);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
