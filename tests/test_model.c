/* test_model.c — model loaders: llama2.c checkpoints (shared tiny models),
 * hyperparameter validation, and bad input. */
#include "kvq_test.h"
#include "model.h"

START_TEST(test_llama2c_stories)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
    /* published shape (../shared/README.md) */
    ck_assert_int_eq(m.hp.dim, 64);
    ck_assert_int_eq(m.hp.hidden_dim, 172);
    ck_assert_int_eq(m.hp.n_layers, 5);
    ck_assert_int_eq(m.hp.n_heads, 8);
    ck_assert_int_eq(m.hp.n_kv_heads, 4);
    ck_assert_int_eq(m.hp.head_dim, 8);
    ck_assert_int_eq(m.hp.vocab_size, 512);
    ck_assert_int_eq(m.hp.ctx_len, 512);
    ck_assert(m.hp.tied_embeddings);
    ck_assert_ptr_eq(kvq_mat_f32(&m.output), kvq_mat_f32(&m.tok_embd));
    ck_assert_int_eq(m.source, KVQ_SRC_LLAMA2C);
    /* RMSNorm gains are learned values near 1, not zeros/garbage */
    double s = 0;
    for (int i = 0; i < m.hp.dim; i++) s += m.layers[0].attn_norm[i];
    ck_assert(s / m.hp.dim > 0.05 && s / m.hp.dim < 20);
    kvq_model_free(&m);
    /* rounding weight modes are refused, not ignored (the run said "f32 (exact)" after --weights bf16); native and f32
     * load the fp32 checkpoint */
    const kvq_weights lossy[] = {KVQ_WEIGHTS_BF16, KVQ_WEIGHTS_F16};
    for (int i = 0; i < 2; i++) {
        kvq_load_opts o = {.weights = lossy[i]};
        ck_assert_int_eq(kvq_model_load_opts(p, &o, &m, &e), KVQ_EUNSUPPORTED);
        ck_assert_msg(strstr(e.msg, i ? "--weights f16" : "--weights bf16") && strstr(e.msg, "llama2.c"), "%s", e.msg);
    }
    kvq_load_opts on = {.weights = KVQ_WEIGHTS_NATIVE};
    ck_assert_msg(kvq_model_load_opts(p, &on, &m, &e) == KVQ_OK, "%s", e.msg);
    kvq_model_free(&m);
}
END_TEST

START_TEST(test_llama2c_truncated)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/aidreams260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    FILE *in = fopen(p, "rb");
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    unsigned char *data = malloc(size);
    ck_assert(fread(data, 1, size, in) == (size_t)size);
    fclose(in);
    char tmp[128];
    snprintf(tmp, sizeof tmp, "/tmp/kvq_test_l2c_%d.bin", (int)getpid());
    long cuts[] = {0, 1, 27, 28, 100, size / 3, size - 4, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        FILE *o = fopen(tmp, "wb");
        fwrite(data, 1, cuts[i], o);
        fclose(o);
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(tmp, &m, &e) != KVQ_OK, "cut %ld accepted", cuts[i]);
        ck_assert_msg(strstr(e.msg, tmp) != NULL, "no path in: %s", e.msg);
    }
    /* absurd header values: dims whose product overflows */
    int32_t bad[][7] = {{1 << 30, 1 << 30, 1 << 20, 1, 1, 1 << 24, 1},
                        {64, 172, 5, 8, 3, 512, 512},      /* 8 % 3 != 0 */
                        {64, 172, 5, 0, 4, 512, 512},      /* zero heads */
                        {64, 172, -5, 8, 4, 512, 512},
                        {64, 172, 5, 8, 4, INT32_MIN, 512}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        FILE *o = fopen(tmp, "wb");
        fwrite(bad[i], sizeof bad[i], 1, o);
        fwrite(data + 28, 1, size - 28, o);
        fclose(o);
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(tmp, &m, &e) != KVQ_OK, "bad header %zu accepted", i);
        ck_assert(e.msg[0]);
    }
    unlink(tmp);
    free(data);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("load");
    tcase_add_test(tc, test_llama2c_stories);
    tcase_add_test(tc, test_llama2c_truncated);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
