/* test_engine.c — the CPU/GPU engine's device choice (kernels/model/device.h):
 * kvq_device_parse, the math-mode names, and kvq_engine_init_fallback, which
 * turns an "auto" GPU that cannot run the model (no GPU here, a CPU-only build,
 * or a head_dim the CUDA attention lacks) into a CPU engine with a note, while
 * an explicit --device cuda keeps failing. Runs with or without a GPU: where a
 * GPU can run the model, the engine must be on it and the note empty. */
#include "device.h"
#include "kvq_test.h"
#include "model.h"

/* A random-weight model (weights only need to exist; nothing is run here). */
static void tiny_model(kvq_model *m, int head_dim)
{
    kvq_hparams hp = {.n_layers = 1, .dim = 2 * head_dim, .hidden_dim = 32, .n_heads = 2, .n_kv_heads = 1, .head_dim = head_dim,
                      .vocab_size = 40, .ctx_len = 64, .rope_dim = head_dim, .rope_theta = 10000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1, .norm_eps = 1e-5f};
    kvq_err e = {0};
    ck_assert_msg(kvq_model_alloc(m, &hp, &e) == KVQ_OK, "%s", e.msg);
}

START_TEST(test_math_names)
{
    kvq_cuda_math mm;
    kvq_err e = {0};
    ck_assert(kvq_cuda_math_parse("bf16", "--math", &mm, &e) == KVQ_OK && mm == KVQ_CUDA_BF16);
    ck_assert(kvq_cuda_math_parse("tf32", "--math", &mm, &e) == KVQ_OK && mm == KVQ_CUDA_TF32);
    ck_assert(kvq_cuda_math_parse("exact", "--math", &mm, &e) == KVQ_OK && mm == KVQ_CUDA_EXACT);
    ck_assert_int_eq(kvq_cuda_math_parse("fp8", "--math", &mm, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "--math") && strstr(e.msg, "fp8"), "%s", e.msg);
    ck_assert_str_eq(kvq_cuda_math_name(KVQ_CUDA_BF16), "fast (BF16)");
    ck_assert_str_eq(kvq_cuda_math_name(KVQ_CUDA_EXACT), "exact (fp32)");
}
END_TEST

START_TEST(test_fallback)
{
    /* head_dim 8 is supported by the CUDA attention, 24 is not */
    const int hds[] = {8, 24};
    for (int i = 0; i < 2; i++) {
        kvq_model m;
        tiny_model(&m, hds[i]);
        kvq_err e = {0};
        char note[320] = "x";
        kvq_engine eng;
        /* auto: always an engine; on the CPU exactly when the GPU could not take it, with the reason */
        ck_assert_msg(kvq_engine_init_fallback(&eng, KVQ_DEVICE_CUDA, true, 0, KVQ_CUDA_EXACT, &m, 16, 0, 0, note, sizeof note, &e) ==
                          KVQ_OK,
                      "%s", e.msg);
        if (eng.dev == KVQ_DEVICE_CPU) {
            ck_assert_msg(strstr(note, "no GPU run: ") && strstr(note, "running on the CPU"), "%s", note);
            fprintf(stderr, "INFO head_dim %d, auto: %s\n", hds[i], note);
        } else {
            ck_assert_msg(note[0] == 0 && hds[i] != 24, "head_dim %d on the GPU, note '%s'", hds[i], note);
        }
        int on_gpu = eng.dev == KVQ_DEVICE_CUDA;
        kvq_engine_free(&eng);
        /* explicit cuda: the same situation fails with KVQ_EUNSUPPORTED and a message */
        kvq_status s = kvq_engine_init_fallback(&eng, KVQ_DEVICE_CUDA, false, 0, KVQ_CUDA_EXACT, &m, 16, 0, 0, note, sizeof note, &e);
        if (on_gpu) {
            ck_assert(s == KVQ_OK);
            kvq_engine_free(&eng);
        } else {
            ck_assert_int_eq(s, KVQ_EUNSUPPORTED);
            ck_assert(e.msg[0] != 0 && note[0] == 0);
        }
        /* the CPU is never a fallback case */
        ck_assert(kvq_engine_init_fallback(&eng, KVQ_DEVICE_CPU, true, 0, KVQ_CUDA_EXACT, &m, 16, 0, 0, note, sizeof note, &e) == KVQ_OK);
        ck_assert(eng.dev == KVQ_DEVICE_CPU && note[0] == 0);
        kvq_engine_free(&eng);
        kvq_model_free(&m);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("device");
    tcase_add_test(tc, test_math_names);
    tcase_add_test(tc, test_fallback);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
