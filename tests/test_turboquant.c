/* test_turboquant.c — vLLM's TurboQuant presets (kernels/quant/quant_tq.h, kernels/schemes/turboquant.c):
 *  - the Lloyd–Max centroids of N(0, 1/d) against Max's published Gaussian quantizer (J. Max, "Quantizing for
 *    minimum distortion", IRE Trans. IT-6, 1960, Table I: 8 and 16 levels, unit variance);
 *  - keys against an independent float64 reference of the store/read path (dense Sylvester Hadamard,
 *    nearest-centroid bucketing, fp16 norm, norm correction) and the defining property of "nc":
 *    ||k̂|| = fp16(||k||); FP8 keys against the E4M3FN definition (no scale, saturating);
 *  - values by hand (round half up, fp16 scale and zero);
 *  - specs, bits by hand, boundary layers through the hook, the refused forms.
 * Decode equivalence: tests/test_kveval.c (turboquant-4bit-nc-b1, turboquant-k3v4-nc). */
#include <math.h>
#include <stdint.h>

#include "family.h"
#include "half.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "quant_fp8.h"
#include "quant_tq.h"
#include "scheme.h"

START_TEST(test_centroids_max1960)
{
    static const double max3[4] = {0.2451, 0.7560, 1.3440, 2.1520};
    static const double max4[8] = {0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326};
    const size_t dims[] = {64, 128, 16};
    for (size_t k = 0; k < 3; k++) {
        size_t d = dims[k];
        double s = sqrt((double)d);
        float c[16];
        kvq_tq_centroids(d, 3, c);
        for (int i = 0; i < 4; i++) {
            ck_assert_msg(fabs(c[4 + i] * s - max3[i]) < 2e-3, "d %zu 3-bit level %d: %.5f, Max %.4f", d, i, c[4 + i] * s, max3[i]);
            ck_assert_msg(fabs(c[3 - i] + c[4 + i]) < 1e-6, "d %zu: 3-bit levels not symmetric", d);
        }
        kvq_tq_centroids(d, 4, c);
        for (int i = 0; i < 8; i++)
            ck_assert_msg(fabs(c[8 + i] * s - max4[i]) < 2e-3, "d %zu 4-bit level %d: %.5f, Max %.4f", d, i, c[8 + i] * s, max4[i]);
        for (int i = 0; i + 1 < 16; i++) ck_assert(c[i] < c[i + 1]);
    }
}
END_TEST

static uint64_t rs = 99;
static double grand(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    double u1 = ((double)(rs >> 11) + 0.5) / 9007199254740992.0;
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    double u2 = ((double)(rs >> 11) + 0.5) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static double h_ref(size_t n, size_t i, size_t j) { return (__builtin_popcountll(i & j) & 1 ? -1.0 : 1.0) / sqrt((double)n); }

/* float64 reference of one MSE key: rotate, nearest centroid, (nc) unit length, fp16 norm, rotate back */
static void key_ref(const float *k, double *out, size_t d, const float *cent, int n, int nc)
{
    double norm = 0, y[128], c2 = 0;
    for (size_t j = 0; j < d; j++) norm += (double)k[j] * k[j];
    norm = sqrt(norm);
    for (size_t j = 0; j < d; j++) {
        y[j] = 0;
        for (size_t i = 0; i < d; i++) y[j] += k[i] / norm * h_ref(d, i, j);
        int best = 0;
        for (int l = 1; l < n; l++)
            if (fabs(y[j] - cent[l]) < fabs(y[j] - cent[best])) best = l;
        y[j] = cent[best];
        c2 += y[j] * y[j];
    }
    double n16 = kvq_f16_to_f32(kvq_f32_to_f16((float)norm)), s = nc ? n16 / sqrt(c2) : n16;
    for (size_t j = 0; j < d; j++) {
        out[j] = 0;
        for (size_t i = 0; i < d; i++) out[j] += y[i] * s * h_ref(d, i, j);
    }
}

START_TEST(test_keys)
{
    enum { D = 64 };
    float k[D], kh[D], cent[16];
    double want[D];
    for (int bits = 3; bits <= 4; bits++) {
        kvq_tq_centroids(D, bits, cent);
        for (int trial = 0; trial < 20; trial++) {
            double amp = trial % 2 ? 0.05 : 7.0;
            for (int j = 0; j < D; j++) k[j] = (float)(grand() * amp * (j == 11 ? 6 : 1));
            for (int nc = 0; nc < 2; nc++) {
                kvq_tq_key(k, kh, D, bits, cent, nc);
                key_ref(k, want, D, cent, 1 << bits, nc);
                double norm = 0, nh = 0, err = 0, scale = 0;
                for (int j = 0; j < D; j++) {
                    norm += (double)k[j] * k[j];
                    nh += (double)kh[j] * kh[j];
                    err = fmax(err, fabs(kh[j] - want[j]));
                    scale = fmax(scale, fabs(want[j]));
                }
                ck_assert_msg(err <= 1e-5 * scale, "bits %d nc %d trial %d: max diff %g (scale %g)", bits, nc, trial, err, scale);
                double n16 = kvq_f16_to_f32(kvq_f32_to_f16((float)sqrt(norm)));
                if (nc) ck_assert_msg(fabs(sqrt(nh) - n16) <= 1e-5 * n16, "nc: ||k̂|| %.9g vs fp16 norm %.9g", sqrt(nh), n16);
                else ck_assert_msg(fabs(sqrt(nh) - n16) > 1e-4 * n16, "without nc the norm is not restored exactly");
            }
        }
    }
    /* FP8 keys (k8v4): E4M3FN of the key itself, no scale; 500 saturates to 448 */
    for (int j = 0; j < D; j++) k[j] = (float)(grand() * 3);
    k[5] = 500;
    k[6] = -0.3f;
    kvq_tq_key(k, kh, D, 8, NULL, false);
    for (int j = 0; j < D; j++) ck_assert(kh[j] == kvq_fp8_decode(KVQ_FP8_E4M3FN, kvq_fp8_encode(KVQ_FP8_E4M3FN, k[j])));
    ck_assert(kh[5] == 448 && kh[6] == -0.3125f);
}
END_TEST

START_TEST(test_values_by_hand)
{
    /* 4-bit: min 0, max 3.75 -> scale 0.25; 0.625 -> 2.5 + 0.5 = 3 (half up), 0.375 -> 2, 0.125 -> 1 (RNE: 0) */
    float v[8] = {0, 0.75f, 3.75f, 0.625f, 0.375f, 0.125f, 1.0f, 3.7f}, vh[8];
    const float want4[8] = {0, 0.75f, 3.75f, 0.75f, 0.5f, 0.25f, 1.0f, 3.75f};
    kvq_tq_value(v, vh, 8, 4);
    for (int i = 0; i < 8; i++) ck_assert_msg(vh[i] == want4[i], "4-bit [%d] %g -> %g, want %g", i, (double)v[i], (double)vh[i], (double)want4[i]);
    /* 3-bit: min -1, max 2.5 -> scale 0.5; fp16 scale and zero exact */
    float w[6] = {-1, 2.5f, -0.75f, 0.24f, 1.26f, 0}, wh[6];
    const float want3[6] = {-1, 2.5f, -0.5f, 0, 1.5f, 0};
    kvq_tq_value(w, wh, 6, 3);
    for (int i = 0; i < 6; i++) ck_assert_msg(wh[i] == want3[i], "3-bit [%d] %g -> %g, want %g", i, (double)w[i], (double)wh[i], (double)want3[i]);
    /* a constant vector: scale 1e-8 (then fp16 0), code 0, read back fp16(min) */
    float cst[4] = {1.1f, 1.1f, 1.1f, 1.1f}, ch[4];
    kvq_tq_value(cst, ch, 4, 4);
    for (int i = 0; i < 4; i++) ck_assert(ch[i] == kvq_f16_to_f32(kvq_f32_to_f16(1.1f)));
}
END_TEST

static kvq_hparams hp_of(int hd, int L)
{
    kvq_hparams hp = {.n_layers = L, .dim = 2 * hd * 3, .hidden_dim = 64, .n_heads = 6, .n_kv_heads = 2, .head_dim = hd,
                      .vocab_size = 512, .ctx_len = 256, .rope_dim = hd, .rope_theta = 10000, .norm_eps = 1e-5f};
    return hp;
}

START_TEST(test_specs_bits_boundary)
{
    kvq_hparams hp = hp_of(64, 30);
    kvq_err e = {0};
    kvq_eval_scheme s;
    /* keys b + 16/64 (fp16 norm) or 8, values vb + 32/64; 4 of 30 layers at 16 */
    const struct { const char *spec, *name; double k, v; } c[] = {
        {"turboquant-k8v4", "turboquant-k8v4", 8, 4.5},
        {"turboquant-4bit-nc", "turboquant-4bit-nc", 4.25, 4.5},
        {"turboquant-k3v4-nc", "turboquant-k3v4-nc", 3.25, 4.5},
        {"turboquant-3bit-nc-b0", "turboquant-3bit-nc-b0", 3.25, 3.5},
        {"turboquant-3bit-nc-b2", "turboquant-3bit-nc", 3.25, 3.5},
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        ck_assert_msg(kvq_eval_scheme_make(c[i].spec, NULL, &hp, &s, &e) == KVQ_OK, "%s: %s", c[i].spec, e.msg);
        ck_assert_str_eq(s.name, c[i].name);
        kvq_bits b;
        ck_assert(kvq_eval_scheme_bits(&s, 512, &hp, &b, &e) == KVQ_OK);
        double nb = strstr(c[i].spec, "-b0") ? 0 : 4;
        double wk = ((30 - nb) * c[i].k + nb * 16) / 30, wv = ((30 - nb) * c[i].v + nb * 16) / 30;
        ck_assert_msg(fabs(b.k - wk) < 1e-12 && fabs(b.v - wv) < 1e-12, "%s: bits %g/%g, want %g/%g", c[i].spec, b.k, b.v, wk, wv);
        ck_assert_ptr_null(kvq_eval_scheme_gpu_desc(&s));
    }
    /* refused forms, each naming its rule */
    const struct { const char *spec, *want; } bad[] = {
        {"turboquant-5bit", "unknown TurboQuant preset"}, {"turboquant-k8v4-bx", "boundary layers after -b"},
        {"turboquant-k8v4x", "unknown TurboQuant preset"}, {"turboquant-4bit-nc-b2-b3", "expected turboquant-"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_eq(kvq_eval_scheme_make(bad[i].spec, NULL, &hp, &s, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, bad[i].want), "%s: %s", bad[i].spec, e.msg);
    }
    kvq_hparams odd = hp_of(48, 30);
    ck_assert_int_eq(kvq_eval_scheme_make("turboquant-k8v4", NULL, &odd, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "head_dim 48") && strstr(e.msg, "power of two"), "%s", e.msg);
    /* boundary layers covering the whole model (aidreams260K's 4 layers at N = 2): nothing would be quantized, so
     * refused (the row claimed 8/4 bits at KLD 0); 5 layers keep the middle one; -b1 leaves two of 4 */
    kvq_hparams four = hp_of(64, 4), five = hp_of(64, 5);
    ck_assert_int_eq(kvq_eval_scheme_make("turboquant-k8v4", NULL, &four, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "cover all 4 layers") && strstr(e.msg, "nothing"), "%s", e.msg);
    ck_assert_int_eq(kvq_eval_scheme_make("turboquant-3bit-nc-b7", NULL, &four, &s, &e), KVQ_EINVAL);
    ck_assert_msg(kvq_eval_scheme_make("turboquant-k8v4-b1", NULL, &four, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_eval_scheme_make("turboquant-k8v4", NULL, &five, &s, &e) == KVQ_OK, "%s", e.msg);

    /* boundary layers through the hook: 8 layers, N = 2: layers 0, 1, 6, 7 untouched; 3 layers: min(2, 1) = 1 */
    enum { T = 4, KVD = 128 };
    float k0[T * KVD], v0[T * KVD], k[T * KVD], v[T * KVD];
    for (int i = 0; i < T * KVD; i++) k0[i] = (float)grand(), v0[i] = (float)grand();
    const struct { const char *spec; int L; const char *exact; } bc[] = {
        {"turboquant-4bit-nc", 8, "11000011"}, {"turboquant-4bit-nc-b0", 8, "00000000"}, {"turboquant-k8v4", 3, "101"},
        {"turboquant-3bit-nc-b3", 8, "11100111"},
    };
    for (size_t i = 0; i < sizeof bc / sizeof *bc; i++) {
        kvq_hparams h = hp_of(64, bc[i].L);
        ck_assert(kvq_eval_scheme_make(bc[i].spec, NULL, &h, &s, &e) == KVQ_OK);
        kvq_kv_desc_run run;
        ck_assert(kvq_kv_desc_run_init(&run, &s.desc, &e) == KVQ_OK);
        for (int l = 0; l < bc[i].L; l++) {
            memcpy(k, k0, sizeof k);
            memcpy(v, v0, sizeof v);
            kvq_layer_ctx ctx = {.layer = l, .T = T, .n_heads = 6, .n_kv_heads = 2, .head_dim = 64, .n_layers = bc[i].L};
            kvq_kv_alt alt = {0};
            ck_assert(kvq_kv_desc_transform(&run, &ctx, k, v, &alt, &e) == KVQ_OK);
            bool same = !memcmp(k, k0, sizeof k) && !memcmp(v, v0, sizeof v);
            ck_assert_msg(same == (bc[i].exact[l] == '1'), "%s, %d layers: layer %d %s", bc[i].spec, bc[i].L, l,
                          same ? "left exact" : "quantized");
        }
        kvq_kv_desc_run_free(&run);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("turboquant");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_centroids_max1960);
    tcase_add_test(tc, test_keys);
    tcase_add_test(tc, test_values_by_hand);
    tcase_add_test(tc, test_specs_bits_boundary);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
