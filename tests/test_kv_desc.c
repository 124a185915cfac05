/* test_kv_desc.c — the plain-data KV transform descriptor (kernels/schemes/kv_desc.h)
 * that the CUDA forward executes natively, its CPU reference hook, the KIVI
 * boundary clamp, the CPU/GPU engine (kernels/model/device.h) on the CPU, device
 * selection, and the CUDA entry points' behaviour on machines without a GPU
 * (CI). The GPU itself is checked by tests/gpu/gpu_check.c
 * (scripts/gpu_check_bench.sh), which compares every native GPU transform bit
 * for bit with kvq_kv_desc_transform — the function tested here against the
 * quant.h primitives. */
#include <math.h>
#include <stdint.h>

#include "cuda_info.h"
#include "device.h"
#include "forward_cuda.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "quant.h"

enum { NL = 2, DIM = 64, NH = 4, NKV = 2, HD = 16, KVD = NKV * HD, HID = 96, VOC = 97, T = 40 };

static uint64_t rng(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float urand(uint64_t *s) { return (float)((double)(rng(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

static void fill(float *x, size_t n, float a, uint64_t *s)
{
    for (size_t i = 0; i < n; i++) x[i] = a * urand(s);
}

static void make_model(kvq_model *m)
{
    kvq_hparams hp = {.n_layers = NL, .dim = DIM, .hidden_dim = HID, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD,
                      .vocab_size = VOC, .ctx_len = 256, .rope_dim = HD, .rope_theta = 10000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1, .norm_eps = 1e-5f};
    kvq_err e = {0};
    ck_assert_msg(kvq_model_alloc(m, &hp, &e) == KVQ_OK, "%s", e.msg);
    uint64_t s = 5;
    fill(kvq_mat_f32(&m->tok_embd), (size_t)VOC * DIM, 1, &s);
    fill(kvq_mat_f32(&m->output), (size_t)VOC * DIM, 0.3f, &s);
    for (int i = 0; i < DIM; i++) m->out_norm[i] = 1;
    for (int l = 0; l < NL; l++) {
        kvq_layer_weights *w = &m->layers[l];
        for (int i = 0; i < DIM; i++) w->attn_norm[i] = w->ffn_norm[i] = 1;
        fill(kvq_mat_f32(&w->wq), (size_t)NH * HD * DIM, 0.4f, &s);
        fill(kvq_mat_f32(&w->wk), (size_t)KVD * DIM, 0.4f, &s);
        fill(kvq_mat_f32(&w->wv), (size_t)KVD * DIM, 0.2f, &s);
        fill(kvq_mat_f32(&w->wo), (size_t)DIM * NH * HD, 0.2f, &s);
        fill(kvq_mat_f32(&w->w_gate), (size_t)HID * DIM, 0.2f, &s);
        fill(kvq_mat_f32(&w->w_up), (size_t)HID * DIM, 0.2f, &s);
        fill(kvq_mat_f32(&w->w_down), (size_t)DIM * HID, 0.1f, &s);
    }
}

/* tables shared by the tests */
static float g_lo[NL][KVD], g_up[NL][KVD], g_lv3[8], g_lv4[16];
static kvq_kv_layer_tables g_lt[NL];

static void make_tables(int bits)
{
    for (int l = 0; l < NL; l++) {
        for (int c = 0; c < KVD; c++) {
            g_lo[l][c] = -1.0f - 0.01f * c;
            g_up[l][c] = 1.2f + 0.02f * c;
        }
        const float *lv = bits == 3 ? g_lv3 : g_lv4;
        g_lt[l] = (kvq_kv_layer_tables){.k_lower = g_lo[l], .k_upper = g_up[l],
                                        .k_lut = {.bits = bits, .n_tables = 1, .head_dim = HD, .levels = lv},
                                        .v_lut = {.bits = bits, .n_tables = 1, .head_dim = HD, .levels = lv}};
    }
    for (int i = 0; i < 8; i++) g_lv3[i] = (float)(-1.0 + 2.0 * i / 7);
    for (int i = 0; i < 16; i++) {
        double u = -1.0 + 2.0 * i / 15;
        g_lv4[i] = (float)(u < 0 ? -pow(-u, 1.5) : pow(u, 1.5));
    }
}

static kvq_layer_ctx ctx_for(int layer, const int *tokens)
{
    return (kvq_layer_ctx){.layer = layer, .T = T, .pos0 = 0, .P = 0, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD,
                           .tokens = tokens};
}

static int bits_equal(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* Each kind's hook equals the quant.h calls kv_desc.h documents. */
START_TEST(hook_matches_primitives)
{
    make_tables(4);
    uint64_t s = 11;
    float k0[T * KVD], v0[T * KVD], k[T * KVD], v[T * KVD], ke[T * KVD], ve[T * KVD], ka[T * KVD], va[T * KVD];
    int kb[T], vb[T], tokens[T] = {0};
    fill(k0, T * KVD, 2, &s);
    fill(v0, T * KVD, 1, &s);
    k0[7 * KVD + 3] = 9.0f; /* a key outlier beyond the thresholds */
    kvq_err e = {0};
    kvq_kv_layer_tables lt4[NL];
    memcpy(lt4, g_lt, sizeof lt4);
    struct { kvq_scheme q; } cases[] = {
        {{.fam = KVQ_FAM("fp16"), .n_sink = 2}},
        {{.fam = KVQ_FAM("int"), .k_bits = 4, .v_bits = 3, .group = 0, .n_sink = 1}},
        {{.fam = KVQ_FAM("int"), .k_bits = 2, .v_bits = 2, .group = HD}},
        {{.fam = KVQ_FAM("int-pc"), .k_bits = 4, .v_bits = 4, .outlier_frac = 0.01, .n_sink = 1}},
        {{.fam = KVQ_FAM("nuq"), .k_bits = 4, .v_bits = 4, .outlier_frac = 0.1, .n_sink = 3}},
        {{.fam = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 4, .group = 8, .residual = 16, .n_sink = 2}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvq_kv_desc d = {.q = cases[i].q, .key_stage = KVQ_KEYS_PRE_ROPE, .layers = lt4, .n_layers = NL};
        kvq_hparams hp = {.n_layers = NL, .n_kv_heads = NKV, .head_dim = HD, .n_heads = NH};
        ck_assert_msg(kvq_kv_desc_validate(&d, &hp, &e) == KVQ_OK, "case %zu: %s", i, e.msg);
        memcpy(k, k0, sizeof k);
        memcpy(v, v0, sizeof v);
        memcpy(ke, k0, sizeof k);
        memcpy(ve, v0, sizeof v);
        kvq_kv_desc_run run = {.d = &d};
        kvq_kv_alt alt = {ka, kb, false, va, vb, false, NULL};
        kvq_layer_ctx c = ctx_for(1, tokens);
        ck_assert_msg(kvq_kv_desc_transform(&run, &c, k, v, &alt, &e) == KVQ_OK, "case %zu: %s", i, e.msg);
        const kvq_scheme *q = &d.q;
        size_t ns = q->n_sink;
        switch (kvq_test_fam(q->fam)) {
        case KVQ_TEST_FP16:
            kvq_quant_fp16(ke + ns * KVD, ke + ns * KVD, (T - ns) * KVD, NULL);
            kvq_quant_fp16(ve + ns * KVD, ve + ns * KVD, (T - ns) * KVD, NULL);
            ck_assert(bits_equal(k, ke, T * KVD) && bits_equal(v, ve, T * KVD));
            ck_assert(bits_equal(k, k0, ns * KVD)); /* sink rows exact */
            ck_assert(!bits_equal(k + ns * KVD, k0 + ns * KVD, (T - ns) * KVD));
            break;
        case KVQ_TEST_INT:
            kvq_quant_int_token(ke, ke, T, KVD, q->group, q->k_bits, ns, NULL, &e);
            kvq_quant_int_token(ve, ve, T, KVD, q->group, q->v_bits, ns, NULL, &e);
            ck_assert(bits_equal(k, ke, T * KVD) && bits_equal(v, ve, T * KVD));
            break;
        case KVQ_TEST_INT_PC:
            kvq_quant_int_channel(ke, ke, T, KVD, g_lo[1], g_up[1], q->k_bits, true, ns, NULL, &e);
            kvq_quant_int_token(ve, ve, T, KVD, 0, q->v_bits, ns, NULL, &e);
            ck_assert(bits_equal(k, ke, T * KVD) && bits_equal(v, ve, T * KVD));
            ck_assert(k[7 * KVD + 3] == 9.0f);
            {
                uint64_t want = 0;
                for (size_t t = ns; t < T; t++)
                    for (int c = 0; c < KVD; c++) want += k0[t * KVD + c] > g_up[1][c] || k0[t * KVD + c] < g_lo[1][c];
                ck_assert(want >= 1);
                ck_assert_uint_eq(run.k_counts.n_outliers, want);
            }
            break;
        case KVQ_TEST_NUQ:
            kvq_quant_nuq_keys(ke, ke, T, KVD, &lt4[1].k_lut, g_lo[1], g_up[1], true, ns, NULL, &e);
            kvq_quant_nuq_values(ve, ve, T, KVD, &lt4[1].v_lut, q->outlier_frac, ns, NULL, &e);
            ck_assert(bits_equal(k, ke, T * KVD) && bits_equal(v, ve, T * KVD));
            /* 2 outliers per side of 32 values at 10%: kvq_outliers_per_side(32, 0.1) */
            ck_assert_uint_eq(run.v_counts.n_outliers, (T - ns) * 2 * kvq_outliers_per_side(KVD, 0.1));
            break;
        case KVQ_TEST_KIVI: {
            ck_assert(alt.use_k && alt.use_v);
            ck_assert(bits_equal(k, k0, T * KVD) && bits_equal(v, v0, T * KVD)); /* primary stays exact */
            float kq[T * KVD], vq[T * KVD];
            kvq_kivi_keys(kq, k0, T, KVD, q->group, q->k_bits, ns, NULL, &e);
            kvq_kivi_values(vq, v0, T, KVD, HD, q->group, q->v_bits, ns, NULL, &e);
            ck_assert(bits_equal(ka, kq, T * KVD) && bits_equal(va, vq, T * KVD));
            ck_assert_msg(kvq_attn_check_bounds(kb, T, "k_bound", &e) == KVQ_OK, "%s", e.msg);
            ck_assert_msg(kvq_attn_check_bounds(vb, T, "v_bound", &e) == KVQ_OK, "%s", e.msg);
            /* clamp below the sink, the published rule above it */
            ck_assert_int_eq(kb[0], 1);
            ck_assert_int_eq(kb[1], 2);
            ck_assert_int_eq(vb[0], 1);
            for (int t = 2; t < T; t++) {
                ck_assert_int_eq(kb[t], (int)kvq_kivi_key_boundary(t, 8, 16, 2));
                ck_assert_int_eq(vb[t], (int)kvq_kivi_value_boundary(t, 16, 2));
            }
            ck_assert_int_eq(kb[17], 2);  /* 2 + 16 * floor(15 / 16) */
            ck_assert_int_eq(kb[18], 18); /* first flush after 16 tokens */
            ck_assert_int_eq(vb[30], 14); /* 30 - 16 */
            break;
        }
        default: ck_abort();
        }
    }
}
END_TEST

START_TEST(validate_errors)
{
    make_tables(4);
    kvq_hparams hp = {.n_layers = NL, .n_kv_heads = NKV, .head_dim = HD, .n_heads = NH};
    kvq_err e = {0};
    kvq_kv_desc d = {.q = {.fam = KVQ_FAM("nuq"), .k_bits = 3, .v_bits = 3}, .layers = g_lt, .n_layers = NL};
    ck_assert_int_eq(kvq_kv_desc_validate(&d, &hp, &e), KVQ_EINVAL); /* 4-bit tables for a 3-bit scheme */
    ck_assert_msg(strstr(e.msg, "expected 3 bits, found 4"), "%s", e.msg);
    d.q.k_bits = d.q.v_bits = 4;
    d.n_layers = 1;
    ck_assert_int_eq(kvq_kv_desc_validate(&d, &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "tables for 2 layers, found 1"), "%s", e.msg);
    d.n_layers = NL;
    ck_assert_int_eq(kvq_kv_desc_validate(&d, &hp, &e), KVQ_OK);
    float bad[KVD];
    memcpy(bad, g_up[1], sizeof bad);
    bad[5] = -5; /* upper < lower */
    kvq_kv_layer_tables lt[NL];
    memcpy(lt, g_lt, sizeof lt);
    lt[1].k_upper = bad;
    d.layers = lt;
    ck_assert_int_eq(kvq_kv_desc_validate(&d, &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer 1: channel 5"), "%s", e.msg);
    kvq_kv_desc k = {.q = {.fam = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group = 12, .residual = 24}};
    ck_assert_int_eq(kvq_kv_desc_validate(&k, &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "does not divide head_dim 16"), "%s", e.msg);
    char name[64];
    kvq_kv_desc n = {.q = {.fam = KVQ_FAM("nuq"), .k_bits = 3, .v_bits = 3, .outlier_frac = 0.01, .n_sink = 1}};
    kvq_kv_desc_name(&n, name, sizeof name);
    ck_assert_str_eq(name, "nuq3-1%+sink1");
    kvq_kv_desc_name(&k, name, sizeof name);
    ck_assert_str_eq(name, "kivi2-g12-r24");
}
END_TEST

static kvq_status count_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    int *calls = user;
    if (obs->k_att && obs->v_att && ctx->T == T) (*calls)++;
    return KVQ_OK;
}

/* The CPU engine with a descriptor == kvq_forward_run with the descriptor's hook;
 * the caller's observe hook still runs. */
START_TEST(engine_cpu_matches_hooks)
{
    kvq_model m;
    make_model(&m);
    make_tables(3);
    kvq_err e = {0};
    int tokens[T];
    uint64_t s = 3;
    for (int t = 0; t < T; t++) tokens[t] = (int)(rng(&s) % VOC);
    kvq_kv_desc d = {.q = {.fam = KVQ_FAM("nuq"), .k_bits = 3, .v_bits = 3, .outlier_frac = 0.05, .n_sink = 1},
                     .key_stage = KVQ_KEYS_PRE_ROPE, .layers = g_lt, .n_layers = NL};
    kvq_forward fw;
    ck_assert_msg(kvq_forward_init(&fw, &m, T, 0, 0, &e) == KVQ_OK, "%s", e.msg);
    kvq_kv_desc_run run;
    kvq_hooks h;
    kvq_kv_desc_hooks(&run, &d, &h);
    double nll_a[T], nll_b[T], nll_c[T];
    kvq_fwd_io io = {.tokens = tokens, .T = T, .hooks = &h, .nll = nll_a};
    kvq_fwd_result ra, rb, rc;
    ck_assert_msg(kvq_forward_run(&fw, &io, &ra, &e) == KVQ_OK, "%s", e.msg);
    io.hooks = NULL;
    io.nll = nll_c;
    ck_assert_msg(kvq_forward_run(&fw, &io, &rc, &e) == KVQ_OK, "%s", e.msg);
    kvq_forward_free(&fw);

    kvq_engine en;
    ck_assert_msg(kvq_engine_init(&en, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, 0, 0, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_engine_set_kv(&en, &d, &e) == KVQ_OK, "%s", e.msg);
    int calls = 0;
    kvq_hooks obs = {.user = &calls, .observe = count_observe};
    io.hooks = &obs;
    io.nll = nll_b;
    ck_assert_msg(kvq_engine_run(&en, &io, &rb, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(calls, NL);
    ck_assert_int_eq(ra.n_scored, T - 1);
    ck_assert(memcmp(nll_a, nll_b, sizeof nll_a) == 0); /* same code path, same bits */
    ck_assert(ra.loss == rb.loss);
    ck_assert_msg(fabs(ra.loss - rc.loss) > 1e-6, "the 3-bit transform changed nothing: %g vs %g", ra.loss, rc.loss);
    /* a descriptor plus a transform hook is refused */
    kvq_hooks both = h;
    io.hooks = &both;
    ck_assert_int_eq(kvq_engine_run(&en, &io, &rb, &e), KVQ_EINVAL);
    /* FP32 descriptor = no transform */
    kvq_kv_desc f = {.q = {.fam = KVQ_FAM("fp32")}};
    ck_assert(kvq_engine_set_kv(&en, &f, &e) == KVQ_OK);
    io.hooks = NULL;
    io.nll = nll_b;
    ck_assert(kvq_engine_run(&en, &io, &rb, &e) == KVQ_OK);
    ck_assert(rb.loss == rc.loss);
    char buf[256];
    ck_assert(strstr(kvq_engine_describe(&en, buf, sizeof buf), "CPU"));
    kvq_engine_free(&en);
    kvq_model_free(&m);
}
END_TEST

START_TEST(device_selection)
{
    kvq_err e = {0};
    kvq_device d;
    int idx = -1;
    ck_assert(kvq_device_parse("cpu", &d, &idx, &e) == KVQ_OK && d == KVQ_DEVICE_CPU && idx == 0);
    ck_assert_int_eq(kvq_device_parse("gpu", &d, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "expected cpu, cuda, cuda:N or auto"), "%s", e.msg);
    ck_assert_int_eq(kvq_device_parse("cuda:x", &d, NULL, &e), KVQ_EINVAL);
    char why[256];
    int n = kvq_cuda_device_count(why, sizeof why);
    ck_assert(kvq_device_parse("auto", &d, NULL, &e) == KVQ_OK);
    ck_assert_int_eq(d, n > 0 ? KVQ_DEVICE_CUDA : KVQ_DEVICE_CPU);
    if (n == 0) {
        /* CI: no GPU (CPU-only build, or CUDA build without a device): clear errors, no crash */
        ck_assert_int_eq(kvq_device_parse("cuda", &d, NULL, &e), KVQ_EUNSUPPORTED);
        ck_assert_msg(strstr(e.msg, "--device cpu"), "%s", e.msg);
        kvq_model m;
        make_model(&m);
        kvq_forward_cuda *g = (kvq_forward_cuda *)&m; /* must be reset to NULL */
        ck_assert_int_eq(kvq_forward_cuda_init(&g, &m, T, 0, 0, KVQ_CUDA_EXACT, 0, &e), KVQ_EUNSUPPORTED);
        ck_assert(g == NULL);
        ck_assert_msg(strstr(e.msg, "--device cpu"), "%s", e.msg);
        kvq_forward_cuda_free(NULL);
        kvq_engine en;
        ck_assert_int_eq(kvq_engine_init(&en, KVQ_DEVICE_CUDA, KVQ_CUDA_EXACT, &m, T, 0, 0, &e), KVQ_EUNSUPPORTED);
        double r = 1;
        ck_assert_int_ne(kvq_cuda_sgemm_rate(0, 64, 1, KVQ_CUDA_EXACT, &r, &e), KVQ_OK);
        kvq_model_free(&m);
    } else {
        fprintf(stderr, "INFO device_selection: %d GPU(s); the GPU path is checked by scripts/gpu_check_bench.sh\n", n);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kv_desc");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, hook_matches_primitives);
    tcase_add_test(tc, validate_errors);
    tcase_add_test(tc, engine_cpu_matches_hooks);
    tcase_add_test(tc, device_selection);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
