/* test_quant_fp4.c — FP4 KV block formats (kernels/quant/quant_fp4):
 *   - the 16 E2M1 codes decode to ml_dtypes' float4_e2m1fn values
 *     (tests/fixtures/fp4_ml_dtypes.bin, tests/scripts/fp4_fixture.py) and to
 *     the OCP MX v1.0 formula; the 256 E8M0 codes to float8_e8m0fnu's;
 *   - E2M1 round-to-nearest-even agrees with ml_dtypes on every code value,
 *     every midpoint (ties) and their float32 neighbours, both signs;
 *     saturation; SGLang's ties-up encoder on its bounds table;
 *   - 200 blocks per format (NVFP4 with g = 0.37, OCP MXFP4, SGLang
 *     fp4_mx_block16) bit for bit against the numpy/ml_dtypes transcription
 *     of each engine's rule: element codes, scale byte, dequantized values;
 *   - the scale rules by hand (published definitions), the KV round trip's
 *     layout and errors, bits accounting. */
#include <math.h>
#include <stdint.h>

#include "kvq_test.h"
#include "quant_fp4.h"

#define FIX "tests/fixtures/"

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static float rdf(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static uint8_t *fixture(size_t *n)
{
    uint8_t *buf = kvq_test_slurp(FIX "fp4_ml_dtypes.bin", n);
    ck_assert_msg(buf != NULL, "fixture " FIX "fp4_ml_dtypes.bin missing (tests/scripts/fp4_fixture.py)");
    ck_assert(*n > 8 + 16 * 4 + 256 * 4 && memcmp(buf, "KVQFP4R1", 8) == 0);
    return buf;
}

/* OCP MX v1.0 E2M1: bias 1, e = 0 subnormal m * 0.5, else 2^(e-1) (1 + m/2) */
static double ocp_e2m1(uint8_t c)
{
    int e = (c >> 1) & 3, m = c & 1;
    double v = e == 0 ? 0.5 * m : ldexp(1.0 + 0.5 * m, e - 1);
    return (c & 8) ? -v : v;
}

START_TEST(test_decode_all_codes)
{
    size_t n;
    uint8_t *buf = fixture(&n);
    static const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6}; /* OCP MX v1.0 Table "FP4 E2M1" */
    for (int c = 0; c < 16; c++) {
        float want = rdf(buf + 8 + 4 * c), got = kvq_e2m1_decode((uint8_t)c);
        ck_assert_msg(bits_of(want) == bits_of(got), "e2m1 code %d: ml_dtypes %g, kvq %g", c, (double)want, (double)got);
        ck_assert(got == (float)ocp_e2m1((uint8_t)c));
        ck_assert(fabsf(got) == table[c & 7]);
        ck_assert_int_eq(!!signbit(got), c >= 8);
        if (c != 8) ck_assert_int_eq(kvq_e2m1_encode(got), c); /* encode(decode(c)) == c */
    }
    ck_assert_int_eq(kvq_e2m1_encode(-0.0f), 8);
    const uint8_t *e8 = buf + 8 + 64;
    for (int c = 0; c < 256; c++) {
        float want = rdf(e8 + 4 * c), got = kvq_e8m0_decode((uint8_t)c);
        if (c == 255) {
            ck_assert(isnan(want) && isnan(got));
            continue;
        }
        ck_assert_msg(want == got, "e8m0 code %d: ml_dtypes %g, kvq %g", c, (double)want, (double)got);
        ck_assert(got == (float)ldexp(1.0, c - 127));
    }
    free(buf);
}
END_TEST

START_TEST(test_encode_rne_ties_saturation)
{
    size_t n;
    uint8_t *buf = fixture(&n);
    size_t pos = 8 + 64 + 1024, n_enc = rd32(buf + pos);
    pos += 4;
    ck_assert_uint_ge(n_enc, 80);
    for (size_t i = 0; i < n_enc; i++, pos += 5) {
        float x = rdf(buf + pos);
        uint8_t want = buf[pos + 4], got = kvq_e2m1_encode(x);
        /* ml_dtypes keeps the sign of a value rounding to zero too */
        ck_assert_msg(got == want, "e2m1(%a = %.9g): ml_dtypes code %u, kvq %u", (double)x, (double)x, want, got);
    }
    /* ties to the even code (the published RNE values, OCP MX / cvt.rn): */
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    static const uint8_t rne[7] = {0, 2, 2, 4, 4, 6, 6}; /* 0, 1, 1, 2, 2, 4, 4 */
    static const uint8_t up[7] = {1, 2, 3, 4, 5, 6, 7};  /* SGLang: 0.5, 1, 1.5, 2, 3, 4, 6 */
    for (int i = 0; i < 7; i++) {
        ck_assert_int_eq(kvq_e2m1_encode(mid[i]), rne[i]);
        ck_assert_int_eq(kvq_e2m1_encode(-mid[i]), 8 | rne[i]);
        ck_assert_int_eq(kvq_e2m1_encode_ties_up(mid[i]), up[i]);
        ck_assert_int_eq(kvq_e2m1_encode_ties_up(-mid[i]), 8 | up[i]);
        /* just below a midpoint both round down to the lower magnitude i */
        float below = nextafterf(mid[i], 0.0f);
        ck_assert_int_eq(kvq_e2m1_encode(below), i);
        ck_assert_int_eq(kvq_e2m1_encode_ties_up(below), i);
        ck_assert_int_eq(kvq_e2m1_encode(nextafterf(mid[i], 7.0f)), i + 1);
    }
    /* saturation at 6 (satfinite): beyond the largest value, infinity; NaN has no code (6 with its sign) */
    const float sat[] = {6.0f, 6.5f, 7.0f, 8.0f, 1e30f, INFINITY};
    for (size_t i = 0; i < sizeof sat / sizeof *sat; i++) {
        ck_assert_int_eq(kvq_e2m1_encode(sat[i]), 7);
        ck_assert_int_eq(kvq_e2m1_encode(-sat[i]), 15);
        ck_assert_int_eq(kvq_e2m1_encode_ties_up(sat[i]), 7);
    }
    ck_assert_int_eq(kvq_e2m1_encode(1e-30f), 0);
    ck_assert_int_eq(kvq_e2m1_encode(-1e-30f), 8);
    ck_assert_int_eq(kvq_e2m1_encode_ties_up(-1e-30f), 8); /* SGLang: sign bit from x < 0 */
    ck_assert_int_eq(kvq_e2m1_encode_ties_up(-0.0f), 0);
    free(buf);
}
END_TEST

START_TEST(test_blocks_match_reference)
{
    size_t n;
    uint8_t *buf = fixture(&n);
    size_t pos = 8 + 64 + 1024;
    pos += 4 + 5 * (size_t)rd32(buf + pos);
    ck_assert_uint_eq(rd32(buf + pos), 3);
    pos += 4;
    for (int k = 0; k < 3; k++) {
        kvq_fp4_format f = (kvq_fp4_format)rd32(buf + pos);
        size_t B = rd32(buf + pos + 4), nb = rd32(buf + pos + 8);
        float g = rdf(buf + pos + 12);
        pos += 16;
        ck_assert_uint_eq(B, kvq_fp4_block(f));
        size_t n_sat = 0, n_zero_sc = 0;
        for (size_t b = 0; b < nb; b++) {
            float x[32], y[32], yw[32];
            uint8_t codes[32], sc;
            memcpy(x, buf + pos, B * 4);
            const uint8_t *cw = buf + pos + B * 4, scw = buf[pos + B * 5];
            memcpy(yw, buf + pos + B * 5 + 1, B * 4);
            pos += B * 9 + 1;
            n_sat += kvq_fp4_block_roundtrip(f, x, g, codes, &sc, y);
            ck_assert_msg(sc == scw, "%s block %zu: scale byte %u, reference %u", kvq_fp4_name(f), b, sc, scw);
            n_zero_sc += sc == 0;
            for (size_t j = 0; j < B; j++)
                ck_assert_msg(codes[j] == cw[j] && bits_of(y[j]) == bits_of(yw[j]),
                              "%s block %zu elem %zu: x %.9g code %u / %u, y %.9g / %.9g", kvq_fp4_name(f), b, j,
                              (double)x[j], codes[j], cw[j], (double)y[j], (double)yw[j]);
            /* in place gives the same */
            kvq_fp4_block_roundtrip(f, x, g, NULL, NULL, x);
            ck_assert(memcmp(x, y, B * 4) == 0);
        }
        /* the fixture exercises saturation (outliers, E4M3 block scales at 448) where the format has it */
        if (f != KVQ_FP4_MX16_SGL) ck_assert_uint_gt(n_sat, 0);
        else ck_assert_uint_eq(n_sat, 0);
        if (f == KVQ_FP4_NVFP4) ck_assert_uint_gt(n_zero_sc, 0); /* underflowing block scales read back 0 */
    }
    ck_assert_uint_eq(pos, n);
    free(buf);
}
END_TEST

START_TEST(test_scale_rules_by_hand)
{
    float x[32] = {0}, y[32];
    uint8_t c[32], sc;
    /* NVFP4, g = 1: vmax 0.7 -> sf = 0.11666..., E4M3 RNE 0.1171875 (0x1F: 2^-4 * 1.875);
     * 0.7 / 0.1171875 = 5.973 -> 6 -> 0.703125 */
    x[0] = 0.7f;
    x[1] = -0.1f; /* 0.1 / 0.1171875 = 0.853 -> 1 -> -0.1171875 */
    ck_assert_uint_eq(kvq_fp4_block_roundtrip(KVQ_FP4_NVFP4, x, 1.0f, c, &sc, y), 0);
    ck_assert_int_eq(sc, 0x1F);
    ck_assert(y[0] == 0.703125f && c[0] == 7);
    ck_assert(y[1] == -0.1171875f && c[1] == 10);
    /* the per-tensor scale: vmax 2688 g maps to E4M3's 448 and E2M1's 6 exactly; above it the block scale saturates */
    x[0] = 2688.0f * 0.5f;
    x[1] = 0;
    ck_assert_uint_eq(kvq_fp4_block_roundtrip(KVQ_FP4_NVFP4, x, 0.5f, c, &sc, y), 0);
    ck_assert_int_eq(sc, 0x7E);
    ck_assert(y[0] == 1344.0f);
    x[0] = 2688.0f * 0.5f * 1.25f; /* sf 560 -> 448: 7.5 before rounding: saturates */
    ck_assert_uint_eq(kvq_fp4_block_roundtrip(KVQ_FP4_NVFP4, x, 0.5f, c, &sc, y), 1);
    ck_assert(y[0] == 1344.0f);
    ck_assert(kvq_nvfp4_global_scale(2688.0) == 1.0f && kvq_nvfp4_global_scale(0) == 1.0f);
    ck_assert(kvq_nvfp4_global_scale(26.88) == 0.01f);
    /* MXFP4: X = 2^(floor(log2 amax) - 2) */
    memset(x, 0, sizeof x);
    x[5] = 6.0f;
    kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y);
    ck_assert_int_eq(sc, 127); /* X = 1 */
    ck_assert(y[5] == 6.0f);
    x[5] = 7.9f; /* still X = 1: 7.9 clips to 6 (the OCP rule's known clipping of [6, 8)) */
    ck_assert_uint_eq(kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y), 1);
    ck_assert(sc == 127 && y[5] == 6.0f);
    x[5] = -8.0f; /* X = 2 */
    kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y);
    ck_assert(sc == 128 && y[5] == -8.0f && c[5] == 14);
    x[5] = 0.1f; /* floor(log2 0.1) = -4: X = 2^-6; 0.1 * 64 = 6.4 -> 6 -> 0.09375 */
    x[6] = 0.01f; /* 0.64 -> 0.5 -> 2^-7 */
    kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y);
    ck_assert(sc == 121 && y[5] == 0.09375f && y[6] == 0.0078125f);
    memset(x, 0, sizeof x); /* all zero: X = 2^-127 (code 0) */
    kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y);
    ck_assert_int_eq(sc, 0);
    x[0] = 3e38f; /* floor(log2) = 127: X = 2^125 (code 252; float32 never reaches the clamp at 2^127); 7.05 X clips */
    ck_assert_uint_eq(kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y), 1);
    ck_assert(sc == 252 && y[0] == ldexpf(6.0f, 125));
    x[0] = 1e-45f; /* the smallest subnormal, 2^-149: X = 2^-151 clamps to 2^-127, the value rounds to 0 */
    kvq_fp4_block_roundtrip(KVQ_FP4_MXFP4, x, 1, c, &sc, y);
    ck_assert(sc == 0 && y[0] == 0.0f);
    /* SGLang fp4_mx_block16: 2^ceil(log2(amax / 6)) */
    memset(x, 0, sizeof x);
    x[0] = 6.0f;
    kvq_fp4_block_roundtrip(KVQ_FP4_MX16_SGL, x, 1, c, &sc, y);
    ck_assert(sc == 127 && y[0] == 6.0f);
    x[0] = 6.5f; /* 2^1: 3.25 -> 3 -> 6 */
    x[1] = 2.5f; /* 1.25: a tie, up to 1.5 -> 3 */
    kvq_fp4_block_roundtrip(KVQ_FP4_MX16_SGL, x, 1, c, &sc, y);
    ck_assert(sc == 128 && y[0] == 6.0f && y[1] == 3.0f);
    memset(x, 0, sizeof x); /* clamp(0, 1e-10): 2^ceil(log2 1e-10) = 2^-33 */
    kvq_fp4_block_roundtrip(KVQ_FP4_MX16_SGL, x, 1, c, &sc, y);
    ck_assert_int_eq(sc, 127 - 33);
}
END_TEST

START_TEST(test_kv_roundtrip_layout_errors_bits)
{
    kvq_err e = {0};
    enum { T = 3, H = 2, D = 32 };
    float x[T * H * D], y[T * H * D], r[32];
    uint64_t clipped = 99;
    for (int i = 0; i < T * H * D; i++) x[i] = sinf(0.37f * (float)i) * (float)(1 + i % 7);
    x[40] = 300.0f; /* token 0, head 1: saturates nothing in NVFP4 (g = 1) but sets its block's scale */
    for (int f = 0; f < KVQ_FP4_N_FORMATS; f++) {
        const size_t B = kvq_fp4_block((kvq_fp4_format)f);
        ck_assert_int_eq(kvq_fp4_kv_roundtrip((kvq_fp4_format)f, x, y, T, H, D, 1.0f, &clipped, &e), KVQ_OK);
        for (size_t b = 0; b < T * H * D / B; b++) { /* blocks along head_dim, one token and head each */
            kvq_fp4_block_roundtrip((kvq_fp4_format)f, x + b * B, 1.0f, NULL, NULL, r);
            ck_assert(memcmp(r, y + b * B, B * 4) == 0);
        }
        /* head_dim not a multiple of the block: refused, naming the rule */
        ck_assert_int_eq(kvq_fp4_kv_roundtrip((kvq_fp4_format)f, x, y, 1, 1, B + 8, 1.0f, NULL, &e), KVQ_EUNSUPPORTED);
        ck_assert_msg(strstr(e.msg, "not a multiple of the") && strstr(e.msg, kvq_fp4_name((kvq_fp4_format)f)), "%s", e.msg);
    }
    float bad[32] = {0};
    bad[17] = NAN;
    ck_assert_int_eq(kvq_fp4_kv_roundtrip(KVQ_FP4_NVFP4, bad, bad, 1, 2, 16, 1.0f, NULL, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "head 1") && strstr(e.msg, "NaN"), "%s", e.msg);
    ck_assert_int_eq(kvq_fp4_kv_roundtrip(KVQ_FP4_NVFP4, x, y, 1, 1, 16, 0.0f, NULL, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_fp4_kv_roundtrip(KVQ_FP4_MXFP4, x, y, 0, 1, 32, 1.0f, NULL, &e), KVQ_EINVAL);
    /* bits: 4 + 8 / block (+ NVFP4's float32 per-tensor scale over the layer's K or V elements) */
    ck_assert(kvq_fp4_bits_per_element(KVQ_FP4_MXFP4, 1000) == 4.25);
    ck_assert(kvq_fp4_bits_per_element(KVQ_FP4_MX16_SGL, 1000) == 4.5);
    ck_assert(kvq_fp4_bits_per_element(KVQ_FP4_NVFP4, 2048 * 192) == 4.5 + 32.0 / (2048.0 * 192.0));
    ck_assert(kvq_fp4_bits_per_element(KVQ_FP4_NVFP4, 0) == 4.5);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("quant_fp4");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_decode_all_codes);
    tcase_add_test(tc, test_encode_rne_ties_saturation);
    tcase_add_test(tc, test_blocks_match_reference);
    tcase_add_test(tc, test_scale_rules_by_hand);
    tcase_add_test(tc, test_kv_roundtrip_layout_errors_bits);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
