/* test_vllm_scales.c — FP8 k_scale / v_scale export for vLLM
 * (formats/vllm_scales): per-tensor (shape []) and per-KV-head
 * ([n_kv_heads]) files are read back with kvq's safetensors reader (names,
 * dtype F32, shapes, values bit-exact, metadata) and errors are checked.
 * The files are left in build/tmp/test_vllm_scales/ so that
 * tests/scripts/check_vllm_scales.py can confirm the Python `safetensors`
 * package reads them the same way (run by hand; values there follow the
 * same formula as scale_value below). */
#include <math.h>
#include <sys/stat.h>

#include "kvq_test.h"
#include "safetensors.h"
#include "vllm_scales.h"

enum { L = 3, H = 5 };

static const char *tmp_path(char *buf, size_t n, const char *name)
{
    mkdir("build", 0755);
    mkdir("build/tmp", 0755);
    mkdir("build/tmp/test_vllm_scales", 0755);
    snprintf(buf, n, "build/tmp/test_vllm_scales/%s", name);
    return buf;
}

/* k: (layer+1)/448 + head/1000, v: the same * 3 (also in check_vllm_scales.py) */
static float scale_value(int layer, int head, int is_v)
{
    float k = (float)(layer + 1) / 448.0f + (float)head / 1000.0f;
    return is_v ? k * 3.0f : k;
}

static void check_file(const char *path, int per_head)
{
    kvq_safetensors st;
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_open(path, &st, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(st.n_tensors, 2 * L);
    ck_assert_str_eq(kvq_safetensors_meta(&st, "format"), "pt");
    ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq_granularity"), per_head ? "attn_head" : "tensor");
    for (int l = 0; l < L; l++)
        for (int v = 0; v < 2; v++) {
            char name[64];
            kvq_vllm_scale_name(name, sizeof name, (size_t)l, v);
            const kvq_st_tensor *t = kvq_safetensors_find(&st, name);
            ck_assert_msg(t != NULL, "%s missing", name);
            ck_assert_int_eq(t->dtype, KVQ_ST_F32);
            ck_assert_uint_eq(t->n_dims, per_head ? 1 : 0);
            if (per_head) ck_assert_uint_eq(t->shape[0], H);
            ck_assert_uint_eq(t->n_elements, per_head ? H : 1);
            float got[H];
            ck_assert(kvq_safetensors_read_f32(&st, t, got, t->n_elements, &e) == KVQ_OK);
            for (uint64_t h = 0; h < t->n_elements; h++)
                ck_assert_msg(got[h] == scale_value(l, (int)h, v), "%s[%llu]", name, (unsigned long long)h);
        }
    ck_assert(kvq_safetensors_find(&st, "model.layers.3.self_attn.k_scale") == NULL);
    kvq_safetensors_close(&st);
}

START_TEST(test_write_read_back)
{
    float kt[L], vt[L], kh[L * H], vh[L * H];
    for (int l = 0; l < L; l++) {
        kt[l] = scale_value(l, 0, 0);
        vt[l] = scale_value(l, 0, 1);
        for (int h = 0; h < H; h++) {
            kh[l * H + h] = scale_value(l, h, 0);
            vh[l * H + h] = scale_value(l, h, 1);
        }
    }
    char p[256];
    kvq_err e = {0};
    const kvq_st_kv mt[] = {{"kvq_granularity", "tensor"}, {"kvq_calibration", "absmax/448"}};
    const kvq_vllm_kv_scales st = {L, H, 0, kt, vt, KVQ_SCALES_VLLM};
    ck_assert_msg(kvq_vllm_scales_write(tmp_path(p, sizeof p, "tensor.safetensors"), &st, mt, 2, &e) == KVQ_OK, "%s",
                  e.msg);
    check_file(p, 0);
    const kvq_st_kv mh[] = {{"kvq_granularity", "attn_head"}};
    const kvq_vllm_kv_scales sh = {L, H, 1, kh, vh, KVQ_SCALES_VLLM};
    ck_assert_msg(kvq_vllm_scales_write(tmp_path(p, sizeof p, "head.safetensors"), &sh, mh, 1, &e) == KVQ_OK, "%s",
                  e.msg);
    check_file(p, 1);
    /* the reader vLLM and transformers use: Python safetensors on both files */
    kvq_test_python("check_vllm_scales.py", "build/tmp/test_vllm_scales");
    char name[64];
    ck_assert_str_eq(kvq_vllm_scale_name(name, sizeof name, 17, 1), "model.layers.17.self_attn.v_scale");
    ck_assert_str_eq(kvq_kv_scale_name(name, sizeof name, KVQ_SCALES_MODELOPT, 3, 0), "model.layers.3.self_attn.k_proj.k_scale");
    ck_assert_str_eq(kvq_kv_scale_name(name, sizeof name, KVQ_SCALES_MODELOPT, 3, 1), "model.layers.3.self_attn.v_proj.v_scale");
    /* the other forms' shapes through kvq's reader: compressed-tensors [1] / [H, 1, 1], modelopt [1] */
    const struct { kvq_kv_scale_form f; int head; int nd; uint64_t s0; } forms[] = {
        {KVQ_SCALES_COMPRESSED_TENSORS, 0, 1, 1}, {KVQ_SCALES_COMPRESSED_TENSORS, 1, 3, H}, {KVQ_SCALES_MODELOPT, 0, 1, 1}};
    for (size_t i = 0; i < 3; i++) {
        kvq_vllm_kv_scales sf = forms[i].head ? sh : st;
        sf.form = forms[i].f;
        ck_assert_msg(kvq_vllm_scales_write(tmp_path(p, sizeof p, "form.safetensors"), &sf, NULL, 0, &e) == KVQ_OK, "%s", e.msg);
        kvq_safetensors sr;
        ck_assert(kvq_safetensors_open(p, &sr, &e) == KVQ_OK);
        for (int l = 0; l < L; l++)
            for (int v = 0; v < 2; v++) {
                const kvq_st_tensor *t = kvq_safetensors_find(&sr, kvq_kv_scale_name(name, sizeof name, forms[i].f, (size_t)l, v));
                ck_assert_msg(t != NULL, "%s missing", name);
                ck_assert_uint_eq(t->n_dims, (unsigned)forms[i].nd);
                ck_assert_uint_eq(t->shape[0], forms[i].s0);
                if (forms[i].nd == 3) ck_assert(t->shape[1] == 1 && t->shape[2] == 1);
                float got[H];
                size_t n = forms[i].head ? H : 1;
                ck_assert(kvq_safetensors_read_f32(&sr, t, got, n, &e) == KVQ_OK);
                for (size_t h = 0; h < n; h++) ck_assert(got[h] == scale_value(l, (int)h, v));
            }
        kvq_safetensors_close(&sr);
        remove(p);
    }
}
END_TEST

START_TEST(test_errors)
{
    float k[L * H], v[L * H];
    for (int i = 0; i < L * H; i++) k[i] = v[i] = 0.01f;
    char p[256];
    kvq_err e = {0};
    tmp_path(p, sizeof p, "bad.safetensors");
    v[2 * H + 4] = 0.0f;
    kvq_vllm_kv_scales s = {L, H, 1, k, v, KVQ_SCALES_VLLM};
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, NULL, 0, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer 2 v_scale[4] = 0"), "%s", e.msg);
    v[2 * H + 4] = 0.01f;
    k[1] = NAN;
    s.per_head = 0;
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, NULL, 0, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer 1 k_scale = nan"), "%s", e.msg);
    k[1] = 0.01f;
    s.n_layers = 0;
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, NULL, 0, &e), KVQ_EINVAL);
    s.n_layers = L;
    s.per_head = 1;
    s.n_kv_heads = 0;
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, NULL, 0, &e), KVQ_EINVAL);
    s.n_kv_heads = H;
    s.form = KVQ_SCALES_MODELOPT; /* ModelOpt has no per-head k_scale */
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, NULL, 0, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "modelopt form"), "%s", e.msg);
    s.form = KVQ_SCALES_VLLM;
    const kvq_st_kv bad[] = {{"format", "np"}};
    ck_assert_int_eq(kvq_vllm_scales_write(p, &s, bad, 1, &e), KVQ_EINVAL);
    struct stat sb;
    ck_assert(stat(p, &sb) != 0); /* nothing written on error */
    ck_assert_int_eq(kvq_vllm_scales_write("build/tmp/no/such/dir/x.safetensors", &s, NULL, 0, &e), KVQ_EIO);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("vllm_scales");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_write_read_back);
    tcase_add_test(tc, test_errors);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
