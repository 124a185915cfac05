/* test_pth.c — vLLM's per-token-head KV caches (kernels/quant/quant_pth.h, the families
 * int8-pth, fp8-pth, int4-pth): hand-computed values (int8's truncation toward zero, int4's
 * round-half-away, zero point and its place in the scale word), fp8 against the E4M3FN
 * definition (quant_fp8.h), the round trip through the families, specs, bits by hand and
 * the refused head sizes. Decode equivalence: tests/test_kveval.c (int4-pth, int8-pth,
 * fp8-pth+sink2 against the step-by-step cache). */
#include <math.h>
#include <stdint.h>

#include "family.h"
#include "hadamard.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "quant_fp8.h"
#include "quant_pth.h"
#include "scheme.h"

START_TEST(test_int8_by_hand)
{
    /* head 0: absmax 127 -> scale exactly 1: codes are the truncated values (round-to-nearest would give
     * 1, -2, 3, -2); head 1: the same x 4 -> scale 4 */
    float x[16] = {127, -64, 0.75f, -1.5f, 3.25f, -2.5f, 0.f, 100.9f};
    const float want0[8] = {127, -64, 0, -1, 3, -2, 0, 100};
    for (int i = 0; i < 8; i++) x[8 + i] = 4 * x[i];
    int8_t q[8];
    ck_assert(kvq_pth_int8_encode(x, 8, q) == 1.0f);
    for (int i = 0; i < 8; i++) ck_assert_int_eq(q[i], (int)want0[i]);
    float y[16];
    kvq_err e = {0};
    kvq_quant_counts c = {0};
    ck_assert(kvq_quant_pth(KVQ_PTH_INT8, y, x, 1, 2, 8, 0, &c, &e) == KVQ_OK);
    for (int i = 0; i < 8; i++) {
        ck_assert_msg(y[i] == want0[i], "head 0 [%d]: %g, want %g", i, (double)y[i], (double)want0[i]);
        ck_assert_msg(y[8 + i] == 4 * want0[i], "head 1 [%d]: %g, want %g", i, (double)y[8 + i], 4 * (double)want0[i]);
    }
    ck_assert_uint_eq(c.n_elems, 16);
    /* an all-zero head: scale clamps to 1e-6, codes 0, output 0 */
    float z[4] = {0, 0, 0, 0};
    ck_assert(kvq_pth_int8_encode(z, 4, q) == 1e-6f);
    ck_assert(kvq_quant_pth(KVQ_PTH_INT8, z, z, 1, 1, 4, 0, NULL, &e) == KVQ_OK);
    for (int i = 0; i < 4; i++) ck_assert(z[i] == 0);
}
END_TEST

START_TEST(test_fp8_definition)
{
    /* absmax 448 -> scale 1: the E4M3FN grid itself. 17 ties to 16 (even mantissa), 0.3 -> 0.3125,
     * 300 -> 288 (step 32 in [256, 448]), -0.001 -> the subnormal 2^-9 grid: 2^-9 = 0.001953125, 0.001
     * is nearer 0.001953125 than 0 */
    float x[6] = {448, 17, 0.3f, 300, -0.001f, -448};
    const float want[6] = {448, 16, 0.3125f, 288, -0.001953125f, -448};
    float y[6];
    kvq_err e = {0};
    ck_assert(kvq_quant_pth(KVQ_PTH_FP8, y, x, 1, 1, 6, 0, NULL, &e) == KVQ_OK);
    for (int i = 0; i < 6; i++) ck_assert_msg(y[i] == want[i], "[%d] %g -> %g, want %g", i, (double)x[i], (double)y[i], (double)want[i]);
    /* random heads against the format definition: decode(encode(x / s)) * s, s = absmax / 448 */
    uint64_t r = 7;
    float a[3 * 64], b[3 * 64];
    for (int i = 0; i < 3 * 64; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        a[i] = (float)((double)(r >> 11) / 9007199254740992.0 - 0.5) * (i % 64 == 3 ? 40.f : 2.f);
    }
    ck_assert(kvq_quant_pth(KVQ_PTH_FP8, b, a, 1, 3, 64, 0, NULL, &e) == KVQ_OK);
    for (int h = 0; h < 3; h++) {
        float m = 0;
        for (int d = 0; d < 64; d++) m = fmaxf(m, fabsf(a[h * 64 + d]));
        float s = m / 448.0f;
        for (int d = 0; d < 64; d++) {
            float want1 = kvq_fp8_decode(KVQ_FP8_E4M3FN, kvq_fp8_encode(KVQ_FP8_E4M3FN, a[h * 64 + d] * (1.0f / s))) * s;
            ck_assert(b[h * 64 + d] == want1);
        }
    }
}
END_TEST

/* H_4 (s ⊙ x), unnormalised, with kvq's int4-pth signs */
static void rht4(const float *x, float *y)
{
    float t[4];
    for (int d = 0; d < 4; d++) t[d] = x[d] * (float)kvq_rht_sign(KVQ_PTH_RHT_SEED, (size_t)d);
    for (int j = 0; j < 4; j++) {
        y[j] = 0;
        for (int i = 0; i < 4; i++) y[j] += t[i] * (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.f : 1.f);
    }
}

START_TEST(test_int4_by_hand)
{
    /* rotated vector y = [0, 15, 7.5, 2.5]: min 0, max 15 -> scale 1, zp 0; codes round half away from zero:
     * 7.5 -> 8, 2.5 -> 3 (round-to-nearest-even would give 8, 2) */
    uint8_t q[4];
    const float y0[4] = {0, 15, 7.5f, 2.5f};
    float w = kvq_pth_int4_encode(y0, 4, q);
    ck_assert(w == 1.0f);
    ck_assert(q[0] == 0 && q[1] == 15 && q[2] == 8 && q[3] == 3);
    /* min -3, max 12: scale 1, zp 3 stored in the scale word's low mantissa bits */
    const float y1[4] = {-3, 12, 0.5f, -1.5f};
    w = kvq_pth_int4_encode(y1, 4, q);
    uint32_t bits;
    memcpy(&bits, &w, 4);
    ck_assert_uint_eq(bits & 15u, 3);
    ck_assert_uint_eq(bits & ~15u, 0x3F800000u); /* 1.0f */
    ck_assert(q[0] == 0 && q[1] == 15 && q[2] == 4 && q[3] == 2); /* 0.5 + 3 = 3.5 -> 4; -1.5 + 3 = 1.5 -> 2 */
    /* the whole round trip on one head: x = s ⊙ H y0 / 4, so that the rotation gives back y0 exactly */
    float x[4], yy[4], out[4];
    for (int j = 0; j < 4; j++) {
        x[j] = 0;
        for (int i = 0; i < 4; i++) x[j] += y0[i] * (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.f : 1.f);
        x[j] = x[j] * (float)kvq_rht_sign(KVQ_PTH_RHT_SEED, (size_t)j) / 4;
    }
    rht4(x, yy);
    for (int i = 0; i < 4; i++) ck_assert(yy[i] == y0[i]);
    kvq_err e = {0};
    ck_assert(kvq_quant_pth(KVQ_PTH_INT4, out, x, 1, 1, 4, 0, NULL, &e) == KVQ_OK);
    const float yq[4] = {0, 15, 8, 3}; /* read back: (q - zp) * scale, then s ⊙ H ŷ / 4 */
    for (int j = 0; j < 4; j++) {
        float want = 0;
        for (int i = 0; i < 4; i++) want += yq[i] * (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.f : 1.f);
        want = want * (float)kvq_rht_sign(KVQ_PTH_RHT_SEED, (size_t)j) / 4;
        ck_assert_msg(fabsf(out[j] - want) <= 1e-6f, "[%d] %g, want %g", j, (double)out[j], (double)want);
    }
    /* head_dim not a power of two: refused, naming the rule */
    float big[12] = {0};
    ck_assert_int_eq(kvq_quant_pth(KVQ_PTH_INT4, big, big, 1, 1, 12, 0, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "head_dim 12") && strstr(e.msg, "power of two"), "%s", e.msg);
}
END_TEST

START_TEST(test_specs_bits)
{
    kvq_hparams hp = {.n_layers = 2, .dim = 384, .hidden_dim = 64, .n_heads = 6, .n_kv_heads = 2, .head_dim = 64,
                      .vocab_size = 512, .ctx_len = 256, .rope_dim = 64, .rope_theta = 10000, .norm_eps = 1e-5f};
    kvq_err e = {0};
    kvq_eval_scheme s;
    const struct { const char *spec; double bits; int code; } c[] = {
        {"int8-pth", 8 + 32.0 / 64, 8}, {"fp8-pth", 8 + 32.0 / 64, 8}, {"int4-pth", 4 + 32.0 / 64, 4},
        {"int4-pth+sink4", ((512 - 4) * (4 + 32.0 / 64) + 4 * 16.0) / 512, 4}, {"int4-pth+hadamard", 4 + 32.0 / 64, 4},
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        ck_assert_msg(kvq_eval_scheme_make(c[i].spec, NULL, &hp, &s, &e) == KVQ_OK, "%s: %s", c[i].spec, e.msg);
        ck_assert_str_eq(s.name, c[i].spec);
        kvq_bits b;
        ck_assert(kvq_eval_scheme_bits(&s, 512, &hp, &b, &e) == KVQ_OK);
        ck_assert_msg(fabs(b.k - c[i].bits) < 1e-12 && fabs(b.v - c[i].bits) < 1e-12, "%s: %g, want %g", c[i].spec, b.k, c[i].bits);
        ck_assert_int_eq(kvq_eval_scheme_code_bits(&s, 'k'), c[i].code);
        ck_assert_ptr_null(kvq_eval_scheme_gpu_desc(&s)); /* no native CUDA part: the host hook */
        /* kvstat's representation: the family's quantize */
        float x[2 * 128], y[2 * 128];
        for (int k = 0; k < 256; k++) x[k] = sinf((float)k * 0.37f) * (k % 64 == 9 ? 8.f : 1.f);
        ck_assert(kvq_kv_desc_quantize(&s.desc, 0, 'k', y, x, 2, 128, 64, NULL, &e) == KVQ_OK);
        double err = 0;
        for (int k = 0; k < 256; k++) err = fmax(err, fabs(y[k] - x[k]));
        if (strstr(c[i].spec, "+sink")) ck_assert_msg(err == 0, "%s: the sink tokens moved by %g", c[i].spec, err);
        else ck_assert_msg(err > 0 && err < (c[i].code == 4 ? 1.5 : 0.2), "%s: max error %g", c[i].spec, err);
    }
    /* int8-pth is not parsed as int with a bad suffix any more; malformed names keep their family's message */
    ck_assert_int_eq(kvq_eval_scheme_make("int8-pthx", NULL, &hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "int<b>[-g<G>]"), "%s", e.msg);
    /* int4-pth needs a power-of-two head_dim (vLLM's whole-head RHT) */
    kvq_hparams odd = hp;
    odd.head_dim = 48;
    odd.dim = 288;
    ck_assert_int_eq(kvq_eval_scheme_make("int4-pth", NULL, &odd, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "int4-pth") && strstr(e.msg, "head_dim 48") && strstr(e.msg, "power of two"), "%s", e.msg);
    ck_assert(kvq_eval_scheme_make("int8-pth", NULL, &odd, &s, &e) == KVQ_OK);
    /* outliers and bit counts are the format's */
    kvq_scheme q = {.fam = KVQ_FAM("int8-pth"), .k_bits = 4, .v_bits = 8};
    ck_assert_int_eq(kvq_scheme_validate(&q, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "8-bit codes"), "%s", e.msg);
    char syn[KVQ_SCHEME_SYNTAX_MAX];
    ck_assert(strstr(kvq_scheme_syntax(syn, sizeof syn), "int8-pth, int4-pth, fp8-pth"));
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("pth");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_int8_by_hand);
    tcase_add_test(tc, test_fp8_definition);
    tcase_add_test(tc, test_int4_by_hand);
    tcase_add_test(tc, test_specs_bits);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
