/* test_quant_fp8.c — FP8 E4M3FN / E5M2 (kernels/quant_fp8):
 *   - all 256 codes decode to ml_dtypes' float8_e4m3fn / float8_e5m2 values
 *     (tests/fixtures/fp8_ml_dtypes.bin, tests/scripts/fp8_fixture.py), and
 *     to the OFP8 formula in float64;
 *   - encode(decode(c)) == c for every non-NaN code;
 *   - encoding agrees with ml_dtypes on ~2000 in-range inputs per format
 *     (every midpoint between adjacent codes and its float32 neighbours,
 *     random magnitudes), and with a brute-force nearest-even search here;
 *   - saturation, inf, NaN, signed zero, no NaN from any finite float32
 *     (sampled over all exponents);
 *   - scaled KV round trips (per tensor, per head, in place), calibration
 *     (absmax/448, per head, percentile vs. a sorted float64 reference),
 *     bits accounting, errors. */
#include <math.h>
#include <stdint.h>

#include "kvq_test.h"
#include "quant_fp8.h"

#define FIX "tests/fixtures/"

static uint8_t *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static float rdf(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

static const kvq_fp8_format FMTS[2] = {KVQ_FP8_E4M3FN, KVQ_FP8_E5M2};

/* OFP8 value of a code in float64, from the definition */
static double ofp8_value(kvq_fp8_format f, uint8_t c, int *is_nan, int *is_inf)
{
    const int mb = f == KVQ_FP8_E5M2 ? 2 : 3, eb = 7 - mb, bias = f == KVQ_FP8_E5M2 ? 15 : 7;
    const int e = (c >> mb) & ((1 << eb) - 1), m = c & ((1 << mb) - 1);
    const double s = (c & 0x80) ? -1 : 1;
    *is_nan = *is_inf = 0;
    if (f == KVQ_FP8_E4M3FN && e == 15 && m == 7) { *is_nan = 1; return NAN; }
    if (f == KVQ_FP8_E5M2 && e == 31) {
        if (m) { *is_nan = 1; return NAN; }
        *is_inf = 1;
        return s * INFINITY;
    }
    if (e == 0) return s * ldexp(m, 1 - bias - mb);
    return s * ldexp(1.0 + m / (double)(1 << mb), e - bias);
}

START_TEST(test_decode_all_codes)
{
    size_t n;
    uint8_t *buf = slurp(FIX "fp8_ml_dtypes.bin", &n);
    ck_assert_msg(buf != NULL, "fixture " FIX "fp8_ml_dtypes.bin missing (tests/scripts/fp8_fixture.py)");
    ck_assert(n > 12 && memcmp(buf, "KVQFP8R1", 8) == 0);
    ck_assert_uint_eq(rd32(buf + 8), 2);
    size_t pos = 12;
    for (int k = 0; k < 2; k++) {
        const kvq_fp8_format f = (kvq_fp8_format)rd32(buf + pos);
        ck_assert_int_eq(f, FMTS[k]);
        pos += 4;
        int n_nan = 0, n_inf = 0;
        for (int c = 0; c < 256; c++) {
            const float want = rdf(buf + pos + 4 * c), got = kvq_fp8_decode(f, (uint8_t)c);
            int is_nan, is_inf;
            const double def = ofp8_value(f, (uint8_t)c, &is_nan, &is_inf);
            n_nan += is_nan;
            n_inf += is_inf;
            if (isnan(want)) {
                ck_assert_msg(isnan(got) && is_nan, "%s code 0x%02x: NaN expected, got %a", kvq_fp8_name(f), c, got);
                continue;
            }
            uint32_t gb, wb;
            memcpy(&gb, &got, 4);
            memcpy(&wb, &want, 4);
            ck_assert_msg(gb == wb, "%s code 0x%02x: got %a, ml_dtypes %a", kvq_fp8_name(f), c, got, want);
            ck_assert_msg((double)got == def && !signbit(got) == !(c & 0x80), "%s code 0x%02x vs definition %a",
                          kvq_fp8_name(f), c, def);
            /* encode(decode(c)) == c for every non-NaN code (inf saturates in E5M2) */
            const uint8_t back = kvq_fp8_encode(f, got);
            if (is_inf) ck_assert_uint_eq(back, (c & 0x80) | 0x7B);
            else ck_assert_msg(back == c, "%s code 0x%02x re-encodes to 0x%02x", kvq_fp8_name(f), c, back);
        }
        ck_assert_int_eq(n_nan, f == KVQ_FP8_E4M3FN ? 2 : 6);
        ck_assert_int_eq(n_inf, f == KVQ_FP8_E4M3FN ? 0 : 2);
        ck_assert(kvq_fp8_decode(f, f == KVQ_FP8_E4M3FN ? 0x7E : 0x7B) == kvq_fp8_max(f));
        pos += 4 * 256;
        const uint32_t ni = rd32(buf + pos);
        pos += 4;
        ck_assert_uint_gt(ni, 1500);
        const uint8_t *codes = buf + pos + 4 * (size_t)ni;
        for (uint32_t i = 0; i < ni; i++) {
            const float x = rdf(buf + pos + 4 * i);
            const uint8_t got = kvq_fp8_encode(f, x);
            ck_assert_msg(got == codes[i], "%s encode(%a): got 0x%02x, ml_dtypes 0x%02x", kvq_fp8_name(f), x, got,
                          codes[i]);
        }
        pos += 5 * (size_t)ni;
    }
    ck_assert_uint_eq(pos, n);
    free(buf);
}
END_TEST

/* brute force: nearest finite code, ties to the even code (lowest mantissa
 * bit 0), saturating, computed from the decode table in float64 */
static uint8_t encode_reference(kvq_fp8_format f, float x)
{
    const double ax = fabs((double)x);
    const uint8_t maxc = f == KVQ_FP8_E4M3FN ? 0x7E : 0x7B;
    uint8_t best = 0;
    double bd = INFINITY;
    for (uint8_t c = 0; c <= maxc; c++) {
        const double v = kvq_fp8_decode(f, c), dd = fabs(v - ax);
        if (dd < bd || (dd == bd && !(c & 1))) { bd = dd; best = c; }
    }
    return (uint8_t)(best | (signbit(x) ? 0x80 : 0));
}

START_TEST(test_ties_and_neighbours)
{
    for (int k = 0; k < 2; k++) {
        const kvq_fp8_format f = FMTS[k];
        const uint8_t maxc = f == KVQ_FP8_E4M3FN ? 0x7E : 0x7B;
        for (uint8_t c = 0; c < maxc; c++) {
            const float a = kvq_fp8_decode(f, c), b = kvq_fp8_decode(f, (uint8_t)(c + 1));
            const float mid = (float)(((double)a + b) / 2);
            ck_assert((double)mid == ((double)a + b) / 2);
            const uint8_t even = (c & 1) ? (uint8_t)(c + 1) : c;
            for (int sgn = 0; sgn < 2; sgn++) {
                const float sm = sgn ? -mid : mid;
                const uint8_t sb = sgn ? 0x80 : 0;
                ck_assert_msg(kvq_fp8_encode(f, sm) == (even | sb), "%s tie between 0x%02x and 0x%02x",
                              kvq_fp8_name(f), c, c + 1);
                ck_assert_uint_eq(kvq_fp8_encode(f, nextafterf(sm, 0.0f)), c | sb);
                ck_assert_uint_eq(kvq_fp8_encode(f, nextafterf(sm, sgn ? -INFINITY : INFINITY)), (c + 1) | sb);
            }
        }
        /* a deterministic sweep over float32 bit patterns against brute force */
        for (uint32_t u = 0x30000000u; u < 0x48000000u; u += 0x2F1Bu) {
            float x;
            memcpy(&x, &u, 4);
            if (fabsf(x) > 2 * kvq_fp8_max(f)) continue;
            ck_assert_msg(kvq_fp8_encode(f, x) == encode_reference(f, x), "%s encode(%a)", kvq_fp8_name(f), x);
            ck_assert_msg(kvq_fp8_encode(f, -x) == encode_reference(f, -x), "%s encode(%a)", kvq_fp8_name(f), -x);
        }
    }
}
END_TEST

START_TEST(test_saturation_nan_zero)
{
    /* E4M3FN: 448 max; 464 is the tie between 448 and (non-existent) 480 -> 448; beyond saturates */
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, 448.0f), 0x7E);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, 464.0f), 0x7E);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, 480.0f), 0x7E);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, 1e30f), 0x7E);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, -3.4e38f), 0xFE);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, INFINITY), 0x7E);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, -INFINITY), 0xFE);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, NAN), 0x7F);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, -NAN), 0xFF);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, 57344.0f), 0x7B);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, 61440.0f), 0x7B); /* tie to 65536 (= inf code): saturate */
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, 1e6f), 0x7B);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, -INFINITY), 0xFB);
    ck_assert(isnan(kvq_fp8_decode(KVQ_FP8_E5M2, kvq_fp8_encode(KVQ_FP8_E5M2, NAN))));
    ck_assert(isinf(kvq_fp8_decode(KVQ_FP8_E5M2, 0x7C)));
    /* signed zeros and underflow keep the sign */
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, 0.0f), 0x00);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, -0.0f), 0x80);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, -0.0f), 0x80);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, -1e-30f), 0x80);
    ck_assert(signbit(kvq_fp8_decode(KVQ_FP8_E4M3FN, 0x80)) && kvq_fp8_decode(KVQ_FP8_E4M3FN, 0x80) == 0);
    /* subnormals: smallest 2^-9 (E4M3FN), 2^-16 (E5M2); half of it ties to 0, just above -> 1 */
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, ldexpf(1, -9)), 0x01);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, ldexpf(1, -10)), 0x00);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, nextafterf(ldexpf(1, -10), 1)), 0x01);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E4M3FN, ldexpf(3, -10)), 0x02); /* 1.5 ulp tie -> even 2 */
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, ldexpf(1, -16)), 0x01);
    ck_assert_uint_eq(kvq_fp8_encode(KVQ_FP8_E5M2, ldexpf(1, -17)), 0x00);
    ck_assert(kvq_fp8_decode(KVQ_FP8_E4M3FN, 0x01) == ldexpf(1, -9));
    ck_assert(kvq_fp8_decode(KVQ_FP8_E4M3FN, 0x08) == ldexpf(1, -6)); /* smallest normal */
    ck_assert(kvq_fp8_decode(KVQ_FP8_E5M2, 0x04) == ldexpf(1, -14));
    /* no finite float32 gives NaN or inf: sample every exponent, both signs */
    for (int k = 0; k < 2; k++)
        for (uint32_t u = 0; u < 0x7F800000u; u += 0x7FFF1u) {
            float x;
            memcpy(&x, &u, 4);
            for (int s = 0; s < 2; s++) {
                const float v = kvq_fp8_decode(FMTS[k], kvq_fp8_encode(FMTS[k], s ? -x : x));
                ck_assert_msg(isfinite(v), "%s: %a -> %a", kvq_fp8_name(FMTS[k]), s ? -x : x, v);
            }
        }
}
END_TEST

START_TEST(test_scaled_roundtrip)
{
    enum { T = 5, H = 3, D = 16, NE = T * H * D };
    float x[NE], y[NE], z[NE];
    uint8_t c[NE];
    for (int i = 0; i < NE; i++) x[i] = (float)(sin(0.7 * i) * pow(10.0, (i % 9) - 4) * ((i / D) % H + 1));
    kvq_err e = {0};
    const float one = 1.0f;
    /* scale 1.0 == plain encode/decode (the engine default "fp8") */
    ck_assert(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, T, H, D, &one, 1, &e) == KVQ_OK);
    for (int i = 0; i < NE; i++) ck_assert(y[i] == kvq_fp8_decode(KVQ_FP8_E4M3FN, kvq_fp8_encode(KVQ_FP8_E4M3FN, x[i])));
    /* per head: scale[h] applies to head h only; codes agree with the round trip */
    const float sc[H] = {0.01f, 3.0f, 0.25f};
    ck_assert(kvq_fp8_kv_roundtrip(KVQ_FP8_E5M2, x, y, T, H, D, sc, H, &e) == KVQ_OK);
    ck_assert(kvq_fp8_kv_quantize(KVQ_FP8_E5M2, x, c, T, H, D, sc, H, &e) == KVQ_OK);
    for (int i = 0; i < NE; i++) {
        const int h = (i / D) % H;
        ck_assert_uint_eq(c[i], kvq_fp8_encode(KVQ_FP8_E5M2, x[i] / sc[h]));
        ck_assert(y[i] == kvq_fp8_decode(KVQ_FP8_E5M2, c[i]) * sc[h]);
    }
    /* in place */
    memcpy(z, x, sizeof z);
    ck_assert(kvq_fp8_kv_roundtrip(KVQ_FP8_E5M2, z, z, T, H, D, sc, H, &e) == KVQ_OK);
    ck_assert(memcmp(z, y, sizeof z) == 0);
    /* calibrated per-tensor scale: relative error bounded by 2^-4 (3 mantissa bits, RNE) for normals */
    float s;
    ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, T, H, D, 100.0, &s, &e) == KVQ_OK);
    ck_assert(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, T, H, D, &s, 1, &e) == KVQ_OK);
    for (int i = 0; i < NE; i++)
        if (fabsf(x[i]) >= s * ldexpf(1, -6))
            ck_assert_msg(fabsf(y[i] - x[i]) <= fabsf(x[i]) * 0.0625f * 1.0001f, "%d: %g -> %g", i, x[i], y[i]);
        else
            ck_assert(fabsf(y[i] - x[i]) <= s * ldexpf(1, -10) * 1.0001f);
    /* the absmax element maps to the largest code */
    float amax = 0;
    for (int i = 0; i < NE; i++) amax = fmaxf(amax, fabsf(x[i]));
    ck_assert(s == amax / 448.0f);
    int hit = 0;
    ck_assert(kvq_fp8_kv_quantize(KVQ_FP8_E4M3FN, x, c, T, H, D, &s, 1, &e) == KVQ_OK);
    for (int i = 0; i < NE; i++) hit += (c[i] & 0x7F) == 0x7E;
    ck_assert_int_ge(hit, 1);
    /* NaN input passes through as NaN; no error */
    x[3] = NAN;
    ck_assert(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, T, H, D, &one, 1, &e) == KVQ_OK);
    ck_assert(isnan(y[3]));
}
END_TEST

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* numpy percentile (method "linear") in float64 from a full sort */
static double ref_percentile(const double *sorted, size_t n, double p)
{
    const double r = p / 100 * (double)(n - 1);
    const size_t k = (size_t)floor(r);
    if (k + 1 >= n) return sorted[n - 1];
    return sorted[k] + (sorted[k + 1] - sorted[k]) * (r - (double)k);
}

START_TEST(test_calibration)
{
    enum { T = 200, H = 4, D = 32, NE = T * H * D };
    float *x = malloc(NE * sizeof(float));
    double *a = malloc(NE * sizeof(double));
    uint64_t st = 99;
    for (int i = 0; i < NE; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const double u = ((st >> 11) + 0.5) / 9007199254740992.0 - 0.5;
        const int h = (i / D) % H;
        x[i] = (float)(u * (h + 1) * (h == 2 ? 10 : 1));
    }
    x[123 * H * D + 1 * D + 7] = -77.0f; /* one outlier in head 1 */
    kvq_err e = {0};
    float s, sh[H];
    ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, T, H, D, 100.0, &s, &e) == KVQ_OK);
    ck_assert(s == 77.0f / 448.0f);
    ck_assert(kvq_fp8_calib_heads(KVQ_FP8_E4M3FN, x, T, H, D, 100.0, sh, &e) == KVQ_OK);
    for (int h = 0; h < H; h++) {
        float m = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < D; j++) m = fmaxf(m, fabsf(x[(t * H + h) * D + j]));
        ck_assert(sh[h] == m / 448.0f);
    }
    ck_assert(sh[1] == 77.0f / 448.0f);
    ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E5M2, x, T, H, D, 100.0, &s, &e) == KVQ_OK);
    ck_assert(s == 77.0f / 57344.0f);
    /* percentiles against a sorted float64 reference */
    const double ps[] = {99.99, 99.9, 50.0, 1.0, 0.001};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        for (int i = 0; i < NE; i++) a[i] = fabs((double)x[i]);
        qsort(a, NE, sizeof(double), cmp_double);
        ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, T, H, D, ps[k], &s, &e) == KVQ_OK);
        const double want = ref_percentile(a, NE, ps[k]) / 448.0;
        ck_assert_msg(fabs(s - want) <= 1e-6 * want, "p%g: %.9g vs %.9g", ps[k], (double)s, want);
        ck_assert(kvq_fp8_calib_heads(KVQ_FP8_E4M3FN, x, T, H, D, ps[k], sh, &e) == KVQ_OK);
        for (int h = 0; h < H; h++) {
            size_t m = 0;
            for (int t = 0; t < T; t++)
                for (int j = 0; j < D; j++) a[m++] = fabs((double)x[(t * H + h) * D + j]);
            qsort(a, m, sizeof(double), cmp_double);
            const double wh = ref_percentile(a, m, ps[k]) / 448.0;
            ck_assert_msg(fabs(sh[h] - wh) <= 1e-6 * wh, "p%g head %d: %.9g vs %.9g", ps[k], h, (double)sh[h], wh);
        }
    }
    /* the 99.9th percentile ignores the single outlier among head 1's 6400
     * values (rank 0.999*6399 = 6392.6 < 6399); the 99.99th does not */
    ck_assert(kvq_fp8_calib_heads(KVQ_FP8_E4M3FN, x, T, H, D, 99.9, sh, &e) == KVQ_OK);
    ck_assert(sh[1] < 2.0f / 448.0f);
    /* all zeros -> engine default 1.0; NaN rejected; bad percentile */
    float zeros[64] = {0};
    ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, zeros, 2, 1, 32, 100.0, &s, &e) == KVQ_OK);
    ck_assert(s == 1.0f);
    ck_assert(kvq_fp8_calib_heads(KVQ_FP8_E4M3FN, zeros, 2, 2, 16, 50.0, sh, &e) == KVQ_OK);
    ck_assert(sh[0] == 1.0f && sh[1] == 1.0f);
    zeros[40] = NAN;
    ck_assert_int_eq(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, zeros, 2, 1, 32, 100.0, &s, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "token 1") && strstr(e.msg, "dim 8"), "%s", e.msg);
    ck_assert_int_eq(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, T, H, D, 0.0, &s, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, T, H, D, 100.5, &s, &e), KVQ_EINVAL);
    free(x);
    free(a);
}
END_TEST

START_TEST(test_errors_and_bits)
{
    float x[32] = {0}, y[32];
    kvq_err e = {0};
    const float bad[2] = {1.0f, 0.0f}, neg = -1.0f, inf = INFINITY, ok[3] = {1, 1, 1};
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, 1, 2, 16, bad, 2, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "scale[1]"), "%s", e.msg);
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, 1, 2, 16, &neg, 1, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, 1, 2, 16, &inf, 1, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, 1, 2, 16, ok, 3, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "3 scales"), "%s", e.msg);
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, 0, 2, 16, ok, 1, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_fp8_kv_roundtrip(KVQ_FP8_E4M3FN, x, y, SIZE_MAX / 4, 8, 16, ok, 1, &e), KVQ_ENOMEM);
    /* bits: 8 + 32 * n_scales / elements */
    ck_assert(kvq_fp8_bits_per_element(1, 1000, 3, 64) == 8.0 + 32.0 / 192000.0);
    ck_assert(kvq_fp8_bits_per_element(3, 1000, 3, 64) == 8.0 + 96.0 / 192000.0);
    ck_assert(kvq_fp8_bits_per_element(1, 0, 3, 64) == 8.0);
    ck_assert(kvq_fp8_max(KVQ_FP8_E4M3FN) == 448.0f && kvq_fp8_max(KVQ_FP8_E5M2) == 57344.0f);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("quant_fp8");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_decode_all_codes);
    tcase_add_test(tc, test_ties_and_neighbours);
    tcase_add_test(tc, test_saturation_nan_zero);
    tcase_add_test(tc, test_scaled_roundtrip);
    tcase_add_test(tc, test_calibration);
    tcase_add_test(tc, test_errors_and_bits);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
