/* test_quant.c — quantize→dequantize primitives against float64 / brute-force
 * references written independently here: uniform int error bounds and grid
 * membership, nuq nearest-level exactness (brute-force argmin), outliers and
 * sink tokens exact, zero-range guards, KIVI group semantics on hand-computed
 * examples and its decode boundaries against an explicit cache simulation,
 * bits accounting against the papers' numbers. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kvq_test.h"
#include "family.h"
#include "quant.h"
#include "safetensors.h"
#include "half.h"

static uint64_t rng_state;
static double unif(void)
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

static void fill_keys(float *x, size_t n_tokens, size_t kv_dim)
{
    for (size_t t = 0; t < n_tokens; t++)
        for (size_t c = 0; c < kv_dim; c++)
            x[t * kv_dim + c] = (float)((double)(c % 5) + (1 + (double)(c % 3)) * gauss() / (0.4 + fabs(gauss())));
}

/* ---- fp16 ---------------------------------------------------------------------- */

START_TEST(test_fp16_round)
{
    /* exhaustive: every finite half survives f16 -> f32 -> f16 */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        float f = kvq_f16_to_f32((uint16_t)h);
        ck_assert_msg(kvq_f32_to_f16(f) == h, "half 0x%04x -> %g -> 0x%04x", h, (double)f, kvq_f32_to_f16(f));
    }
    ck_assert_float_eq(kvq_round_fp16(1.0f), 1.0f);
    ck_assert_float_eq(kvq_round_fp16(0.1f), 0.0999755859375f);
    ck_assert_float_eq(kvq_round_fp16(2049.0f), 2048.0f);  /* tie → even */
    ck_assert_float_eq(kvq_round_fp16(2051.0f), 2052.0f);  /* tie → even */
    ck_assert_float_eq(kvq_round_fp16(65504.0f), 65504.0f);
    ck_assert_float_eq(kvq_round_fp16(1e6f), 65504.0f);    /* saturates, no Inf */
    ck_assert_float_eq(kvq_round_fp16(-1e6f), -65504.0f);
    ck_assert_float_eq(kvq_round_fp16(2.9e-8f), 0.0f);     /* below 2^-25 */
    ck_assert_float_eq(kvq_round_fp16(4e-8f), 5.9604644775390625e-08f); /* nearest subnormal 2^-24 */
    ck_assert_float_eq(kvq_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(kvq_f16_to_f32(0xc000), -2.0f);
    ck_assert(isinf(kvq_f16_to_f32(0x7c00)));
    ck_assert_uint_eq(kvq_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(kvq_f32_to_bf16(1.00390625f), 0x3f80); /* 1 + 2^-8: tie → even */
    ck_assert_uint_eq(kvq_f32_to_bf16(1.01171875f), 0x3f82); /* 1 + 3*2^-8: tie → even (up) */
    ck_assert_float_eq(kvq_bf16_to_f32(0x4049), 3.140625f);
    float in[3] = {0.1f, -3.3f, 7.0f}, out[3];
    kvq_quant_counts c = {0};
    kvq_quant_fp16(out, in, 3, &c);
    ck_assert_float_eq(out[1], -3.30078125f);
    ck_assert_uint_eq(c.n_elems, 3);
}
END_TEST

/* ---- uniform ------------------------------------------------------------------ */

/* float64 check of one group: every output is on the grid mn + q s, q in 0..2^b-1,
 * within s/2 of the input, and endpoints exact-ish */
static void check_uniform_group(const float *x, const float *y, size_t n, size_t stride, int bits)
{
    double mn = x[0], mx = x[0];
    for (size_t i = 1; i < n; i++) { mn = fmin(mn, x[i * stride]); mx = fmax(mx, x[i * stride]); }
    double s = (mx - mn) / ((1 << bits) - 1);
    for (size_t i = 0; i < n; i++) {
        double xi = x[i * stride], yi = y[i * stride];
        ck_assert(isfinite(yi));
        if (s == 0) { ck_assert_msg(yi == xi, "constant group must round-trip: %g vs %g", yi, xi); continue; }
        double q = (yi - mn) / s;
        ck_assert_msg(fabs(q - rint(q)) < 1e-4 && rint(q) >= 0 && rint(q) <= (1 << bits) - 1, "off-grid q=%g", q);
        ck_assert_msg(fabs(yi - xi) <= s / 2 * (1 + 1e-6) + 1e-6 * fabs(xi), "|%g - %g| > s/2 = %g", yi, xi, s / 2);
    }
}

START_TEST(test_int_token)
{
    rng_state = 11;
    const size_t T = 40, D = 96;
    float *x = malloc(T * D * sizeof *x), *y = malloc(T * D * sizeof *y);
    fill_keys(x, T, D);
    for (size_t c = 0; c < D; c++) x[5 * D + c] = 2.5f;  /* constant token */
    for (size_t c = 0; c < D; c++) x[0 * D + c] = 1e4f;  /* sink token */
    kvq_err e = {0};
    size_t groups[3] = {0, 32, 8};
    for (int bits = 1; bits <= 8; bits++)
        for (int g = 0; g < 3; g++) {
            kvq_quant_counts cnt = {0};
            ck_assert_msg(kvq_quant_int_token(y, x, T, D, groups[g], bits, 1, &cnt, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_uint_eq(cnt.n_elems, T * D);
            ck_assert_uint_eq(cnt.n_sink, D);
            for (size_t c = 0; c < D; c++) ck_assert_float_eq(y[c], x[c]);
            size_t G = groups[g] ? groups[g] : D;
            for (size_t t = 1; t < T; t++)
                for (size_t c0 = 0; c0 < D; c0 += G) check_uniform_group(x + t * D + c0, y + t * D + c0, G, 1, bits);
        }
    /* in place equals out of place */
    float *z = malloc(T * D * sizeof *z);
    memcpy(z, x, T * D * sizeof *z);
    ck_assert(kvq_quant_int_token(y, x, T, D, 32, 3, 0, NULL, &e) == KVQ_OK);
    ck_assert(kvq_quant_int_token(z, z, T, D, 32, 3, 0, NULL, &e) == KVQ_OK);
    ck_assert(memcmp(y, z, T * D * sizeof *z) == 0);
    /* bad arguments name the field */
    ck_assert(kvq_quant_int_token(y, x, T, D, 7, 3, 0, NULL, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "group size"));
    ck_assert(kvq_quant_int_token(y, x, T, D, 0, 9, 0, NULL, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "bits"));
    free(x); free(y); free(z);
}
END_TEST

START_TEST(test_int_round_half_even)
{
    /* range [0, 3] at 2 bits: s = 1; 0.5 → 0, 1.5 → 2, 2.5 → 2 (half to even) */
    float x[4] = {0, 0.5f, 2.5f, 3}, y[4];
    ck_assert(kvq_quant_int_token(y, x, 1, 4, 0, 2, 0, NULL, NULL) == KVQ_OK);
    ck_assert_float_eq(y[0], 0); ck_assert_float_eq(y[1], 0); ck_assert_float_eq(y[2], 2); ck_assert_float_eq(y[3], 3);
    float x2[4] = {0, 1.5f, 1.4f, 3}, y2[4];
    ck_assert(kvq_quant_int_token(y2, x2, 1, 4, 0, 2, 0, NULL, NULL) == KVQ_OK);
    ck_assert_float_eq(y2[1], 2); ck_assert_float_eq(y2[2], 1);
}
END_TEST

START_TEST(test_int_channel_static)
{
    rng_state = 12;
    const size_t T = 64, D = 16;
    float *x = malloc(T * D * sizeof *x), *y = malloc(T * D * sizeof *y), lo[16], hi[16];
    fill_keys(x, T, D);
    for (size_t c = 0; c < D; c++) { lo[c] = (float)(c % 5) - 1.5f; hi[c] = (float)(c % 5) + 2.0f; }
    lo[3] = hi[3] = 7.25f; /* zero-range channel */
    for (size_t t = 0; t < T; t++) x[t * D + 3] = 7.25f;
    x[10 * D + 3] = 9.0f; /* an outlier on the zero-range channel */
    kvq_err e = {0};
    for (int with_out = 0; with_out < 2; with_out++) {
        kvq_quant_counts cnt = {0};
        ck_assert_msg(kvq_quant_int_channel(y, x, T, D, lo, hi, 3, with_out, 2, &cnt, &e) == KVQ_OK, "%s", e.msg);
        uint64_t n_out = 0;
        for (size_t t = 0; t < T; t++)
            for (size_t c = 0; c < D; c++) {
                double xi = x[t * D + c], yi = y[t * D + c];
                ck_assert(isfinite(yi));
                if (t < 2) { ck_assert(yi == xi); continue; }
                bool out = xi > hi[c] || xi < lo[c];
                if (out && with_out) { ck_assert(yi == xi); n_out++; continue; }
                double s = ((double)hi[c] - lo[c]) / 7;
                double xc = fmin(fmax(xi, lo[c]), hi[c]); /* clamped without outliers */
                if (s == 0) { ck_assert(yi == lo[c]); continue; }
                ck_assert(fabs(yi - xc) <= s / 2 * (1 + 1e-6));
            }
        ck_assert_uint_eq(cnt.n_outliers, n_out);
        ck_assert(with_out ? n_out > 0 : n_out == 0);
    }
    lo[0] = 5; hi[0] = 4;
    ck_assert(kvq_quant_int_channel(y, x, T, D, lo, hi, 3, true, 0, NULL, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "channel 0"));
    free(x); free(y);
}
END_TEST

/* ---- nuq ------------------------------------------------------------------------ */

static size_t brute_nearest(const float *lv, size_t n, float x)
{
    size_t b = 0;
    for (size_t j = 1; j < n; j++)
        if (fabsf(x - lv[j]) < fabsf(x - lv[b])) b = j;
    return b;
}

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

START_TEST(test_nuq_nearest_bruteforce)
{
    rng_state = 13;
    float lv[256];
    for (int bits = 1; bits <= 8; bits++) {
        size_t n = (size_t)1 << bits;
        for (int rep = 0; rep < 20; rep++) {
            for (size_t j = 0; j < n; j++) lv[j] = (float)(2 * unif() - 1);
            if (n > 2 && rep % 3 == 0) lv[1] = lv[0]; /* duplicate levels */
            qsort(lv, n, sizeof *lv, cmp_f);
            for (int i = 0; i < 500; i++) {
                float x;
                if (i % 4 == 0 && n > 1) { size_t j = (size_t)(unif() * (double)(n - 1)); x = (lv[j] + lv[j + 1]) / 2; } /* midpoints */
                else if (i % 4 == 1) x = lv[(size_t)(unif() * (double)n)]; /* on a level */
                else x = (float)(2.4 * unif() - 1.2);
                size_t a = kvq_nuq_nearest(lv, n, x), b = brute_nearest(lv, n, x);
                ck_assert_msg(a == b, "bits %d x=%.9g: got %zu (%.9g) brute %zu (%.9g)", bits, (double)x, a,
                              (double)lv[a], b, (double)lv[b]);
            }
        }
    }
}
END_TEST

/* float64 reference of one nuq element: same normalisation, brute-force nearest */
static float ref_nuq(float x, double lo, double hi, const float *lv, size_t n)
{
    double zp = (hi + lo) / 2, r = (hi - lo) / 2;
    if (r == 0) return (float)zp;
    double xn = (x - zp) / r;
    xn = fmin(fmax(xn, lv[0]), lv[n - 1]);
    size_t j = brute_nearest(lv, n, (float)xn);
    return (float)(lv[j] * r + zp);
}

START_TEST(test_nuq_keys)
{
    rng_state = 14;
    const size_t T = 50, H = 2, HD = 8, D = H * HD;
    float *x = malloc(T * D * sizeof *x), *y = malloc(T * D * sizeof *y), lo[16], hi[16];
    fill_keys(x, T, D);
    for (size_t c = 0; c < D; c++) { lo[c] = (float)(c % 5) - 1.0f; hi[c] = (float)(c % 5) + 1.5f; }
    lo[5] = hi[5] = 0.0f; /* zero range: reproduces 0 exactly */
    for (size_t t = 0; t < T; t++) x[t * D + 5] = 0.0f;
    float levels[2][8] = {{-1, -0.6f, -0.3f, -0.1f, 0.05f, 0.2f, 0.5f, 1}, {-0.9f, -0.5f, -0.5f, 0, 0.1f, 0.3f, 0.7f, 0.95f}};
    kvq_err e = {0};
    for (int per_head = 0; per_head < 2; per_head++)
        for (int with_out = 0; with_out < 2; with_out++) {
            kvq_nuq_lut lut = {3, per_head ? H : 1, HD, &levels[0][0]};
            kvq_quant_counts cnt = {0};
            ck_assert_msg(kvq_quant_nuq_keys(y, x, T, D, &lut, lo, hi, with_out, 3, &cnt, &e) == KVQ_OK, "%s", e.msg);
            uint64_t n_out = 0;
            for (size_t t = 0; t < T; t++)
                for (size_t c = 0; c < D; c++) {
                    float xi = x[t * D + c], yi = y[t * D + c];
                    ck_assert(isfinite(yi));
                    if (t < 3) { ck_assert(yi == xi); continue; }
                    if (with_out && (xi > hi[c] || xi < lo[c])) { ck_assert(yi == xi); n_out++; continue; }
                    const float *lv = per_head ? levels[c / HD] : levels[0];
                    float ref = ref_nuq(xi, lo[c], hi[c], lv, 8);
                    ck_assert_msg(yi == ref, "t %zu c %zu: %.9g vs ref %.9g", t, c, (double)yi, (double)ref);
                }
            ck_assert_uint_eq(cnt.n_outliers, n_out);
            ck_assert_uint_eq(cnt.n_sink, 3 * D);
            ck_assert(with_out ? n_out > 0 : n_out == 0);
        }
    /* unsorted levels are rejected */
    float bad[8] = {0, -1, 0, 0, 0, 0, 0, 0};
    kvq_nuq_lut blut = {3, 1, 0, bad};
    ck_assert(kvq_quant_nuq_keys(y, x, T, D, &blut, lo, hi, true, 0, NULL, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "ascending"));
    free(x); free(y);
}
END_TEST

START_TEST(test_outliers_per_side)
{
    ck_assert_uint_eq(kvq_outliers_per_side(4096, 0.01), 21); /* KVQuant deployment: 21 per side */
    ck_assert_uint_eq(kvq_outliers_per_side(192, 0.01), 1);
    ck_assert_uint_eq(kvq_outliers_per_side(4096, 0.001), 3);  /* 0.9995*4095 = 4092.95 → 4096-4093 */
    ck_assert_uint_eq(kvq_outliers_per_side(101, 0.02), 2);    /* 0.99*100 = 99 exactly → 101-99 */
    ck_assert_uint_eq(kvq_outliers_per_side(4096, 0), 0);
    ck_assert_uint_eq(kvq_outliers_per_side(3, 0.49), 1);
}
END_TEST

START_TEST(test_nuq_values)
{
    rng_state = 15;
    const size_t T = 30, D = 64;
    float *x = malloc(T * D * sizeof *x), *y = malloc(T * D * sizeof *y), s[64];
    for (size_t i = 0; i < T * D; i++) x[i] = (float)(gauss() + (unif() < 0.03 ? 20 * gauss() : 0));
    for (size_t c = 0; c < D; c++) x[7 * D + c] = -4.5f;  /* constant token */
    for (size_t c = 0; c < D; c++) x[0 * D + c] = 3e30f; /* huge sink */
    float lv[4] = {-1, -0.25f, 0.3f, 1};
    kvq_nuq_lut lut = {2, 1, 0, lv};
    kvq_err e = {0};
    double fracs[3] = {0, 0.01, 0.1};
    for (int fi = 0; fi < 3; fi++) {
        kvq_quant_counts cnt = {0};
        ck_assert_msg(kvq_quant_nuq_values(y, x, T, D, &lut, fracs[fi], 1, &cnt, &e) == KVQ_OK, "%s", e.msg);
        size_t k = kvq_outliers_per_side(D, fracs[fi]);
        uint64_t n_out = 0;
        for (size_t t = 0; t < T; t++) {
            const float *xr = x + t * D, *yr = y + t * D;
            if (t == 0) { ck_assert(memcmp(xr, yr, D * sizeof *xr) == 0); continue; }
            memcpy(s, xr, sizeof s);
            qsort(s, D, sizeof *s, cmp_f);
            float lo = s[k], hi = s[D - 1 - k];
            for (size_t c = 0; c < D; c++) {
                if (k && (xr[c] < lo || xr[c] > hi)) { ck_assert(yr[c] == xr[c]); n_out++; continue; }
                ck_assert_msg(yr[c] == ref_nuq(xr[c], lo, hi, lv, 4), "t %zu c %zu", t, c);
            }
        }
        ck_assert_uint_eq(cnt.n_outliers, n_out);
        ck_assert_uint_eq(n_out, (uint64_t)2 * k * (T - 2)); /* distinct values: exactly k per side (constant token: none) */
        for (size_t c = 0; c < D; c++) ck_assert_float_eq(y[7 * D + c], -4.5f);
    }
    free(x); free(y);
}
END_TEST

/* ---- KIVI --------------------------------------------------------------------- */

START_TEST(test_kivi_hand)
{
    /* keys: 9 tokens x 2 channels, G = 4, 2 bits: groups [0,4), [4,8); token 8 exact */
    float k[9][2] = {{0, 5}, {0.5f, 5}, {2.5f, 5}, {3, 5},       /* ch0 range [0,3] s=1 → 0,0,2,3 ; ch1 constant */
                     {1, -1}, {1.2f, 0}, {1.7f, 0.5f}, {2, 2},   /* ch0 [1,2] s=1/3 ; ch1 [-1,2] s=1 */
                     {9, 9}};
    float y[9][2];
    kvq_quant_counts cnt = {0};
    kvq_err e = {0};
    ck_assert_msg(kvq_kivi_keys(&y[0][0], &k[0][0], 9, 2, 4, 2, 0, &cnt, &e) == KVQ_OK, "%s", e.msg);
    float want0[9] = {0, 0, 2, 3, 1, 1 + 1.0f / 3, 1 + 2.0f / 3, 2, 9};
    float want1[9] = {5, 5, 5, 5, -1, 0, 0 /* 1.5 → 2 → 1? */, 2, 9};
    want1[6] = 1.0f; /* 0.5 - (-1) = 1.5 → rint(1.5) = 2 → -1 + 2 = 1 */
    for (int t = 0; t < 9; t++) {
        ck_assert_msg(fabsf(y[t][0] - want0[t]) < 1e-6f, "k t%d ch0 %g want %g", t, (double)y[t][0], (double)want0[t]);
        ck_assert_msg(fabsf(y[t][1] - want1[t]) < 1e-6f, "k t%d ch1 %g want %g", t, (double)y[t][1], (double)want1[t]);
    }
    ck_assert_uint_eq(cnt.n_exact, 2);
    /* with a 1-token sink, groups start at token 1: [1,5), [5,9); token 0 exact */
    memset(&cnt, 0, sizeof cnt);
    ck_assert(kvq_kivi_keys(&y[0][0], &k[0][0], 9, 2, 4, 2, 1, &cnt, &e) == KVQ_OK);
    ck_assert_float_eq(y[0][0], 0);
    ck_assert_uint_eq(cnt.n_sink, 2);
    ck_assert_uint_eq(cnt.n_exact, 0);
    /* group [1,5) ch0 = {0.5, 2.5, 3, 1}: mn 0.5, s = 2.5/3; 2.5 → q = 2.4 → 2 → 0.5 + 5/3 */
    ck_assert(fabsf(y[2][0] - (0.5f + 5.0f / 3)) < 1e-6f);
    /* values: 2 tokens x 8 channels, head_dim 8, G = 4, 2 bits */
    float v[2][8] = {{0, 0.5f, 2.5f, 3, 7, 7, 7, 7}, {1, 2, 3, 4, -1, 0.5f, 0.4f, 2}};
    float vy[2][8];
    ck_assert(kvq_kivi_values(&vy[0][0], &v[0][0], 2, 8, 8, 4, 2, 0, NULL, &e) == KVQ_OK);
    float wv[2][8] = {{0, 0, 2, 3, 7, 7, 7, 7}, {1, 2, 3, 4, -1, 1, 0, 2}};
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 8; c++)
            ck_assert_msg(fabsf(vy[t][c] - wv[t][c]) < 1e-6f, "v t%d c%d %g want %g", t, c, (double)vy[t][c],
                          (double)wv[t][c]);
    ck_assert(kvq_kivi_values(&vy[0][0], &v[0][0], 2, 8, 8, 3, 2, 0, NULL, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "group size 3"));
}
END_TEST

/* Step-by-step KIVI cache (notes §1.4-1.5): keys flushed in chunks of R after
 * use, values evicted one at a time from an R+1 window after use. Returns the
 * number of quantized keys / values each query t sees. */
START_TEST(test_kivi_boundaries_vs_cache)
{
    size_t cases[][3] = {{4, 8, 0}, {4, 8, 1}, {4, 0, 0}, {2, 2, 3}, {32, 128, 0}, {4, 4, 2}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        size_t G = cases[ci][0], R = cases[ci][1], P = cases[ci][2];
        size_t flush = R ? R : G;
        size_t kq = P, kbuf = 0, vq = P, vbuf = 0; /* quantized prefix ends; fp16 buffer sizes */
        for (size_t t = 0; t < 600; t++) {
            if (t < P) { /* sink tokens live in their own fp16 store: every key so far exact; a valid bound (<= t+1) */
                ck_assert_uint_eq(kvq_kivi_key_boundary(t, G, R, P), t + 1);
                ck_assert_uint_eq(kvq_kivi_value_boundary(t, R, P), t + 1);
                continue;
            }
            ck_assert_uint_le(kvq_kivi_key_boundary(t, G, R, P), t + 1);
            ck_assert_uint_le(kvq_kivi_value_boundary(t, R, P), t + 1);
            kbuf++; vbuf++;                          /* append token t */
            ck_assert_msg(kvq_kivi_key_boundary(t, G, R, P) == kq, "G%zu R%zu P%zu t%zu keys: %zu vs cache %zu", G, R,
                          P, t, kvq_kivi_key_boundary(t, G, R, P), kq);
            ck_assert_msg(kvq_kivi_value_boundary(t, R, P) == vq, "G%zu R%zu P%zu t%zu values: %zu vs cache %zu", G, R,
                          P, t, kvq_kivi_value_boundary(t, R, P), vq);
            ck_assert(kq + kbuf == t + 1 && vq + vbuf == t + 1);
            if (kbuf == flush) { kq += flush; kbuf = 0; } /* flush after attending */
            if (vbuf == R + 1) { vq++; vbuf--; }          /* evict oldest after attending */
        }
    }
}
END_TEST

/* ---- guards ------------------------------------------------------------------- */

START_TEST(test_zero_range_and_huge)
{
    const size_t T = 8, D = 8;
    float x[64], y[64];
    kvq_err e = {0};
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < T * D; i++) x[i] = pass ? (i % 2 ? 3e38f : -3e38f) : 1.25f;
        ck_assert(kvq_quant_int_token(y, x, T, D, 0, 2, 0, NULL, &e) == KVQ_OK);
        for (size_t i = 0; i < T * D; i++) { ck_assert(isfinite(y[i])); if (!pass) ck_assert(y[i] == x[i]); }
        ck_assert(kvq_kivi_keys(y, x, T, D, 4, 2, 0, NULL, &e) == KVQ_OK);
        for (size_t i = 0; i < T * D; i++) { ck_assert(isfinite(y[i])); if (!pass) ck_assert(y[i] == x[i]); }
        if (pass) for (size_t i = 0; i < T * D; i++) ck_assert(y[i] == x[i]); /* extremes are grid endpoints */
        float lv[2] = {-1, 1};
        kvq_nuq_lut lut = {1, 1, 0, lv};
        ck_assert(kvq_quant_nuq_values(y, x, T, D, &lut, 0, 0, NULL, &e) == KVQ_OK);
        for (size_t i = 0; i < T * D; i++) { ck_assert(isfinite(y[i])); if (!pass) ck_assert(y[i] == x[i]); }
        float lo[8], hi[8];
        for (size_t c = 0; c < D; c++) { lo[c] = pass ? -3e38f : 1.25f; hi[c] = pass ? 3e38f : 1.25f; }
        ck_assert(kvq_quant_nuq_keys(y, x, T, D, &lut, lo, hi, false, 0, NULL, &e) == KVQ_OK);
        for (size_t i = 0; i < T * D; i++) { ck_assert(isfinite(y[i])); if (!pass) ck_assert(y[i] == x[i]); }
        ck_assert(kvq_quant_int_channel(y, x, T, D, lo, hi, 1, false, 0, NULL, &e) == KVQ_OK);
        for (size_t i = 0; i < T * D; i++) { ck_assert(isfinite(y[i])); if (!pass) ck_assert(y[i] == x[i]); }
    }
}
END_TEST

/* ---- bits accounting ---------------------------------------------------------------- */

START_TEST(test_scheme_bits)
{
    kvq_bits b;
    kvq_err e = {0};
    /* LLaMA-7B-like: kv_dim 4096, ctx 2048 (KVQuant Table 1 "avg bits" column) */
    kvq_scheme nuq3 = {.fam = KVQ_FAM("nuq"), .k_bits = 3, .v_bits = 3, .outlier_frac = 0.01};
    ck_assert(kvq_scheme_bits(&nuq3, 2048, 4096, &b, &e) == KVQ_OK);
    double kref = 3 + 32.0 / 2048 + 16.0 * 8 / (2048.0 * 4096) + 0.32 + 32.0 / 4096;
    double vref = 3 + 32.0 / 4096 + 16.0 * 8 / (2048.0 * 4096) + 42.0 / 4096 * 32 + 32.0 / 4096;
    ck_assert_double_eq_tol(b.k, kref, 1e-12);
    ck_assert_double_eq_tol(b.v, vref, 1e-12);
    ck_assert(b.mean > 3.32 && b.mean < 3.35); /* paper: nuq3-1% 3.32-3.35 */
    kvq_scheme int4 = {.fam = KVQ_FAM("int"), .k_bits = 4, .v_bits = 4};
    ck_assert(kvq_scheme_bits(&int4, 2048, 4096, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 4 + 32.0 / 4096, 1e-12); /* paper: 4.00-4.02 */
    kvq_scheme kivi2 = {.fam = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group = 32, .residual = 128};
    ck_assert(kvq_scheme_bits(&kivi2, 4096, 4096, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, (3968.0 * 3 + 128 * 16) / 4096, 1e-12); /* 3 bits dense + fp16 residual */
    /* no residual: keys still go in whole groups, the last partial group stays fp16 (a window shorter
     * than G kept every key exact but was counted as 4 bits); values are quantized at once */
    kvq_scheme kivi_r0 = {.fam = KVQ_FAM("kivi"), .k_bits = 2, .v_bits = 2, .group = 16, .residual = 0};
    ck_assert(kvq_scheme_bits(&kivi_r0, 8, 64, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 16, 1e-12);
    ck_assert_double_eq_tol(b.v, 2 + 32.0 / 16, 1e-12);
    ck_assert(kvq_scheme_bits(&kivi_r0, 70, 64, &b, &e) == KVQ_OK); /* 4 groups + 6 fp16 keys */
    ck_assert_double_eq_tol(b.k, (64.0 * 4 + 6 * 16) / 70, 1e-12);
    kivi_r0.n_sink = 2;
    ck_assert(kvq_scheme_bits(&kivi_r0, 70, 64, &b, &e) == KVQ_OK); /* 2 sink + 4 groups + 4 fp16 keys */
    ck_assert_double_eq_tol(b.k, (64.0 * 4 + 6 * 16) / 70, 1e-12);
    ck_assert_double_eq_tol(b.v, (68.0 * 4 + 2 * 16) / 70, 1e-12);
    kvq_scheme sink = {.fam = KVQ_FAM("int"), .k_bits = 2, .v_bits = 2, .n_sink = 1, .group = 64};
    ck_assert(kvq_scheme_bits(&sink, 2048, 192, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.v, (2047.0 * 2.5 + 16) / 2048, 1e-12);
    kvq_scheme fp16 = {.fam = KVQ_FAM("fp16")};
    ck_assert(kvq_scheme_bits(&fp16, 10, 10, &b, &e) == KVQ_OK && b.k == 16 && b.v == 16);
    /* validation names the field */
    kvq_scheme bad = nuq3;
    bad.k_bits = 9;
    ck_assert(kvq_scheme_bits(&bad, 2048, 4096, &b, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "k_bits"));
    bad = nuq3;
    bad.outlier_frac = 0.5;
    ck_assert(kvq_scheme_validate(&bad, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "outlier fraction"));
    bad = kivi2;
    bad.residual = 100;
    ck_assert(kvq_scheme_validate(&bad, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "residual"));
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_fp16_round);
    tcase_add_test(tc, test_int_token);
    tcase_add_test(tc, test_int_round_half_even);
    tcase_add_test(tc, test_int_channel_static);
    tcase_add_test(tc, test_nuq_nearest_bruteforce);
    tcase_add_test(tc, test_nuq_keys);
    tcase_add_test(tc, test_outliers_per_side);
    tcase_add_test(tc, test_nuq_values);
    tcase_add_test(tc, test_kivi_hand);
    tcase_add_test(tc, test_kivi_boundaries_vs_cache);
    tcase_add_test(tc, test_zero_range_and_huge);
    tcase_add_test(tc, test_scheme_bits);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
