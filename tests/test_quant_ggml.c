/* test_quant_ggml.c — llama.cpp KV block quantizers (kernels/quant_ggml):
 *   - block bytes bit-exact against gguf.quants.quantize (Q8_0, Q4_0, Q4_1,
 *     Q5_0, Q5_1) and a float32 transcription of ggml's
 *     quantize_row_iq4_nl_ref (IQ4_NL) on 21 adversarial + 40 random blocks
 *     (tests/fixtures/ggml_kv_quant.bin, tests/scripts/ggml_kv_fixture.py);
 *     the dequantized values bit-exact against gguf.quants.dequantize
 *     (incl. the new IQ4_NL decoder in formats/ggml_dequant.c);
 *   - RMSE on llama.cpp test-quantize-fns data (0.1 + 2 cos i, 4096 values)
 *     under its ceiling 0.002 (sqrt(sum d^2)/n), and per-bit-width
 *     ceilings on the true RMSE of Gaussian data from the step size;
 *   - the KV round trip = per-row quantize + dequantize, in place, and the
 *     head_dim % 32 refusal; bits per element; fp32 -> fp16 rounding of the scales. */
#include <math.h>
#include <stdint.h>

#include "ggml_dequant.h"
#include "gguf.h"
#include "kvq_test.h"
#include "quant_ggml.h"
#include "safetensors.h"
#include "half.h"

#define FIX "tests/fixtures/"

static uint8_t *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static const kvq_ggml_type TYPES[] = {KVQ_GGML_Q8_0, KVQ_GGML_Q4_0, KVQ_GGML_Q4_1,
                                      KVQ_GGML_Q5_0, KVQ_GGML_Q5_1, KVQ_GGML_IQ4_NL};
#define NTYPES (sizeof TYPES / sizeof TYPES[0])

/* Block 1 of the fixture is 32 x -0.0. ggml's quantize_row_q{4,5}_0_ref
 * starts from max = +0.0f and never updates it (fabsf(-0.0) is not > 0), so
 * d = +0.0/-8 = -0.0 (fp16 0x8000); gguf.quants takes the element itself
 * (-0.0) and gets d = +0.0. kvq follows ggml; both dequantize to zeros. */
static int known_gguf_difference(kvq_ggml_type t, uint32_t block, uint32_t byte)
{
    return block == 1 && byte < 2 && (t == KVQ_GGML_Q4_0 || t == KVQ_GGML_Q5_0);
}

START_TEST(test_fixture_bit_exact)
{
    size_t n;
    uint8_t *buf = slurp(FIX "ggml_kv_quant.bin", &n);
    ck_assert_msg(buf != NULL, "fixture " FIX "ggml_kv_quant.bin missing (tests/scripts/ggml_kv_fixture.py)");
    ck_assert(n > 12 && memcmp(buf, "KVQGQK01", 8) == 0);
    const uint32_t nb = rd32(buf + 8);
    const size_t nel = (size_t)nb * 32;
    const float *x = (const float *)(buf + 12); /* 4-aligned: offset 12 */
    size_t pos = 12 + 4 * nel;
    const uint32_t ntypes = rd32(buf + pos);
    pos += 4;
    ck_assert_uint_eq(ntypes, NTYPES);
    uint8_t *q = malloc(nb * 64);
    float *y = malloc(nel * sizeof(float));
    for (uint32_t k = 0; k < ntypes; k++) {
        const kvq_ggml_type t = (kvq_ggml_type)rd32(buf + pos);
        const uint32_t bb = rd32(buf + pos + 4);
        pos += 8;
        ck_assert_int_eq(t, TYPES[k]);
        const uint8_t *want = buf + pos, *want_y = buf + pos + (size_t)nb * bb;
        pos += (size_t)nb * bb + 4 * nel;
        ck_assert(pos <= n);
        const char *name;
        ck_assert(kvq_ggml_type_info(t, NULL, NULL, &name));
        kvq_err e = {0};
        ck_assert_msg(kvq_ggml_quantize(t, x, nel, q, (size_t)nb * 64, &e) == KVQ_OK, "%s", e.msg);
        for (uint32_t b = 0; b < nb; b++)
            for (uint32_t i = 0; i < bb; i++) {
                const uint8_t got = q[b * bb + i], exp = want[b * bb + i];
                if (got == exp) continue;
                if (known_gguf_difference(t, b, i)) {
                    ck_assert_msg(i != 1 || got == 0x80, "%s block %u: d must be -0.0 (0x8000) as in ggml", name, b);
                    continue;
                }
                ck_assert_msg(0, "%s block %u byte %u: got 0x%02x, reference 0x%02x", name, b, i, got, exp);
            }
        ck_assert_msg(kvq_ggml_dequantize(t, q, (size_t)nb * bb, y, nel, name, &e) == KVQ_OK, "%s", e.msg);
        for (size_t i = 0; i < nel; i++) {
            float w;
            memcpy(&w, want_y + 4 * i, 4);
            ck_assert_msg(y[i] == w, "%s element %zu (block %zu): dequantized %a, gguf.quants.dequantize %a", name, i,
                          i / 32, y[i], w);
        }
        /* the round trip entry point gives the same values (fixture blocks as [nb][1][32]) */
        ck_assert_msg(kvq_ggml_kv_roundtrip(t, x, y, nb, 1, 32, &e) == KVQ_OK, "%s", e.msg);
        for (size_t i = 0; i < nel; i++) {
            float w;
            memcpy(&w, want_y + 4 * i, 4);
            ck_assert_msg(y[i] == w, "%s round trip element %zu: %a vs %a", name, i, y[i], w);
        }
    }
    ck_assert_uint_eq(pos, n);
    free(q);
    free(y);
    free(buf);
}
END_TEST

/* hand-checked blocks, independent of any fixture */
START_TEST(test_hand_blocks)
{
    float x[32];
    uint8_t b[34];
    kvq_err e = {0};
    /* Q8_0: amax 127 -> d = 1 exactly; k + 0.5 rounds away from zero */
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16) + 0.5f;
    x[0] = 127.0f;
    ck_assert(kvq_ggml_quantize(KVQ_GGML_Q8_0, x, 32, b, sizeof b, &e) == KVQ_OK);
    ck_assert_uint_eq(b[0] | b[1] << 8, 0x3C00); /* fp16 1.0 */
    ck_assert_int_eq((int8_t)b[2], 127);
    ck_assert_int_eq((int8_t)b[2 + 1], -15);  /* -14.5 -> -15 */
    ck_assert_int_eq((int8_t)b[2 + 16], 1);   /* 0.5 -> 1 */
    ck_assert_int_eq((int8_t)b[2 + 31], 16);  /* 15.5 -> 16 */
    /* Q4_0: max = -8 -> d = 1, q = trunc(x + 8.5) in 0..15 */
    for (int j = 0; j < 32; j++) x[j] = (float)(j % 16) - 8.0f;
    ck_assert(kvq_ggml_quantize(KVQ_GGML_Q4_0, x, 32, b, sizeof b, &e) == KVQ_OK);
    ck_assert_uint_eq(b[0] | b[1] << 8, 0x3C00);
    for (int j = 0; j < 16; j++) ck_assert_uint_eq(b[2 + j], (uint8_t)(j | j << 4));
    /* Q4_1: 0..31 -> min 0, d = 31/15; dequantized values within d/2 */
    for (int j = 0; j < 32; j++) x[j] = (float)j;
    float y[32];
    ck_assert(kvq_ggml_kv_roundtrip(KVQ_GGML_Q4_1, x, y, 1, 1, 32, &e) == KVQ_OK);
    for (int j = 0; j < 32; j++) ck_assert_msg(fabsf(y[j] - x[j]) <= 31.0f / 15 / 2 + 1e-2f, "%d: %g", j, y[j]);
    /* IQ4_NL: x = codebook * 0.5 -> every index exact, d = 0.5 exactly (least squares) */
    static const int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    for (int j = 0; j < 32; j++) x[j] = 0.5f * kv[j % 16];
    ck_assert(kvq_ggml_kv_roundtrip(KVQ_GGML_IQ4_NL, x, y, 1, 1, 32, &e) == KVQ_OK);
    for (int j = 0; j < 32; j++) ck_assert_msg(y[j] == x[j], "%d: %g vs %g", j, y[j], x[j]);
}
END_TEST

/* llama.cpp tests/test-quantize-fns.cpp: generate_data(0, 4096) =
 * 0.1 + 2 cos(i), error sqrt(sum diff^2)/n < MAX_QUANTIZATION_TOTAL_ERROR
 * (0.002) for these types. Also a per-bit-width ceiling on the true RMSE of
 * N(0,1) data: uniform rounding with step d gives RMSE ~ d/sqrt(12); with
 * d ~ amax/127 (8 bit), amax/8 (4 bit), amax/16 (5 bit) and amax of 32
 * Gaussians ~ 2.5, so the ceilings are ~1.5x those values. */
START_TEST(test_rmse_ceilings)
{
    enum { N = 4096 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) x[i] = (float)(0.1 + 2.0f * cosf((float)i));
    static const double ceil_gauss[NTYPES] = {0.0100, 0.120, 0.120, 0.060, 0.060, 0.110};
    kvq_err e = {0};
    for (size_t k = 0; k < NTYPES; k++) {
        ck_assert_msg(kvq_ggml_kv_roundtrip(TYPES[k], x, y, N / 128, 4, 32, &e) == KVQ_OK, "%s", e.msg);
        double s = 0;
        for (int i = 0; i < N; i++) s += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        const double err = sqrt(s) / N;
        const char *name;
        kvq_ggml_type_info(TYPES[k], NULL, NULL, &name);
        fprintf(stderr, "  %-6s test-quantize-fns error %.6f (ceiling 0.002)", name, err);
        ck_assert_msg(err < 0.002, "%s: %g", name, err);
        /* Gaussian data, deterministic LCG + Box-Muller */
        uint64_t st = 12345;
        for (int i = 0; i < N; i += 2) {
            double u[2];
            for (int r = 0; r < 2; r++) {
                st = st * 6364136223846793005ull + 1442695040888963407ull;
                u[r] = ((st >> 11) + 0.5) / 9007199254740992.0;
            }
            x[i] = (float)(sqrt(-2 * log(u[0])) * cos(2 * M_PI * u[1]));
            x[i + 1] = (float)(sqrt(-2 * log(u[0])) * sin(2 * M_PI * u[1]));
        }
        ck_assert(kvq_ggml_kv_roundtrip(TYPES[k], x, y, N / 64, 1, 64, &e) == KVQ_OK);
        s = 0;
        for (int i = 0; i < N; i++) s += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        const double rmse = sqrt(s / N);
        fprintf(stderr, ", N(0,1) RMSE %.5f (ceiling %.4f)\n", rmse, ceil_gauss[k]);
        ck_assert_msg(rmse < ceil_gauss[k], "%s: Gaussian RMSE %g", name, rmse);
        ck_assert_msg(rmse > ceil_gauss[k] / 10, "%s: Gaussian RMSE %g implausibly small", name, rmse);
        for (int i = 0; i < N; i++) x[i] = (float)(0.1 + 2.0f * cosf((float)i));
    }
    free(x);
    free(y);
}
END_TEST

START_TEST(test_roundtrip_layout_and_inplace)
{
    /* [T=3][H=2][D=64]: the round trip equals per-row quantize + dequantize, also in place */
    enum { T = 3, H = 2, D = 64, NE = T * H * D };
    float x[NE], y[NE], z[NE], w[NE];
    for (int i = 0; i < NE; i++) x[i] = sinf(0.37f * i) * (1.0f + (float)(i % 7)) + (i == 77 ? 40.0f : 0.0f);
    kvq_err e = {0};
    for (size_t k = 0; k < NTYPES; k++) {
        uint8_t q[NE / 32 * 34];
        ck_assert(kvq_ggml_quantize(TYPES[k], x, NE, q, sizeof q, &e) == KVQ_OK);
        size_t nbytes;
        ck_assert(kvq_ggml_nbytes(TYPES[k], NE, &nbytes, "t", &e) == KVQ_OK);
        ck_assert(kvq_ggml_dequantize(TYPES[k], q, nbytes, w, NE, "t", &e) == KVQ_OK);
        ck_assert(kvq_ggml_kv_roundtrip(TYPES[k], x, y, T, H, D, &e) == KVQ_OK);
        memcpy(z, x, sizeof z);
        ck_assert(kvq_ggml_kv_roundtrip(TYPES[k], z, z, T, H, D, &e) == KVQ_OK);
        ck_assert(memcmp(y, w, sizeof y) == 0);
        ck_assert(memcmp(z, w, sizeof z) == 0);
    }
}
END_TEST

START_TEST(test_errors)
{
    float x[96] = {0};
    float y[96];
    uint8_t q[128];
    kvq_err e = {0};
    ck_assert_int_eq(kvq_ggml_kv_roundtrip(KVQ_GGML_Q4_0, x, y, 1, 1, 48, &e), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(e.msg, "head_dim 48") && strstr(e.msg, "llama.cpp refuses"), "%s", e.msg);
    ck_assert_int_eq(kvq_ggml_kv_roundtrip(KVQ_GGML_Q4_K, x, y, 1, 1, 32, &e), KVQ_EUNSUPPORTED);
    ck_assert_int_eq(kvq_ggml_kv_roundtrip(KVQ_GGML_Q8_0, x, y, 0, 1, 32, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_ggml_kv_roundtrip(KVQ_GGML_Q8_0, x, y, SIZE_MAX / 2, 4, 32, &e), KVQ_ENOMEM);
    ck_assert_int_eq(kvq_ggml_quantize(KVQ_GGML_Q8_0, x, 33, q, sizeof q, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_ggml_quantize(KVQ_GGML_Q8_0, x, 96, q, 100, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "102 bytes"), "%s", e.msg);
    x[40] = NAN;
    ck_assert_int_eq(kvq_ggml_quantize(KVQ_GGML_Q4_1, x, 64, q, sizeof q, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "element 40") && strstr(e.msg, "NaN"), "%s", e.msg);
    x[40] = INFINITY;
    ck_assert_int_eq(kvq_ggml_kv_roundtrip(KVQ_GGML_IQ4_NL, x, y, 1, 2, 32, &e), KVQ_ENUMERIC);
    ck_assert(!kvq_ggml_can_quantize(KVQ_GGML_F16) && kvq_ggml_can_quantize(KVQ_GGML_IQ4_NL));
}
END_TEST

START_TEST(test_bits_per_element)
{
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q8_0) == 8.5);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q4_0) == 4.5);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q4_1) == 5.0);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q5_0) == 5.5);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q5_1) == 6.0);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_IQ4_NL) == 4.5);
    ck_assert(kvq_ggml_kv_bits_per_element(KVQ_GGML_Q4_K) == 0.0);
}
END_TEST

/* fp32 -> fp16 (kvq_f32_to_f16, formats/safetensors.c, which the block
 * scales go through): every binary16 value maps back to itself, midpoints between
 * adjacent values round to the even one, values just off the midpoint round
 * to the nearer one; overflow -> inf; NaN stays NaN. */
START_TEST(test_fp32_to_fp16)
{
    for (uint32_t h = 0; h < 0x10000; h++) {
        const float f = kvq_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            ck_assert(isnan(kvq_f16_to_f32(kvq_f32_to_f16(f))));
            continue;
        }
        ck_assert_msg(kvq_f32_to_f16(f) == h, "0x%04x", h);
        if ((h & 0x7FFF) >= 0x7C00 || (h & 0x7FFF) == 0x7BFF) continue;
        const float g = kvq_f16_to_f32((uint16_t)(h + 1)); /* next magnitude, same sign */
        const float mid = (float)(((double)f + g) / 2);      /* exact in float32 */
        ck_assert((double)mid == ((double)f + g) / 2);
        const uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        ck_assert_msg(kvq_f32_to_f16(mid) == even, "mid 0x%04x", h);
        ck_assert_msg(kvq_f32_to_f16(nextafterf(mid, 0.0f)) == h, "below mid 0x%04x", h);
        ck_assert_msg(kvq_f32_to_f16(nextafterf(mid, copysignf(INFINITY, mid))) == h + 1, "above mid 0x%04x", h);
    }
    ck_assert_uint_eq(kvq_f32_to_f16(65520.0f), 0x7C00);  /* midpoint 65504..65536 -> inf (even) */
    ck_assert_uint_eq(kvq_f32_to_f16(65519.996f), 0x7BFF);
    ck_assert_uint_eq(kvq_f32_to_f16(-1e30f), 0xFC00);
    ck_assert_uint_eq(kvq_f32_to_f16(ldexpf(1.0f, -25)), 0x0000); /* half the smallest subnormal: tie to 0 */
    ck_assert_uint_eq(kvq_f32_to_f16(nextafterf(ldexpf(1.0f, -25), 1.0f)), 0x0001);
    ck_assert_uint_eq(kvq_f32_to_f16(-0.0f), 0x8000);
    ck_assert_uint_eq(kvq_f32_to_f16(1e-40f), 0x0000);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("quant_ggml");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_fixture_bit_exact);
    tcase_add_test(tc, test_hand_blocks);
    tcase_add_test(tc, test_rmse_ceilings);
    tcase_add_test(tc, test_roundtrip_layout_and_inplace);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_bits_per_element);
    tcase_add_test(tc, test_fp32_to_fp16);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
