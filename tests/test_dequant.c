/* test_dequant.c — ggml dequantization against the `gguf` PyPI package's own
 * dequantizer (gguf.quants.dequantize), bit for bit:
 *   - synthetic blocks of every supported type (tests/fixtures/dequant_synthetic.bin),
 *   - a few rows of every tensor of the default model (dequant_model_rows.bin),
 *   - the SHA-256 of every whole dequantized tensor of the default model
 *     (dequant_model.sha256).
 * Fixtures: tests/scripts/gguf_dequant_fixture.py. Plus fp16 conversion of all
 * 65536 bit patterns against a float64 formula, Q8_K by hand, and errors. */
#include <math.h>
#include <stdint.h>

#include <openssl/evp.h>

#include "ggml_dequant.h"
#include "gguf.h"
#include "kvq_test.h"
#include "model.h"
#include "half.h"

#define FIX "tests/fixtures/"

static uint8_t *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* bitwise equality of float arrays (NaN payloads and signed zeros included) */
static long first_bit_mismatch(const float *a, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t x, y;
        memcpy(&x, &a[i], 4);
        memcpy(&y, b + 4 * i, 4);
        if (x != y) return (long)i;
    }
    return -1;
}

START_TEST(test_synthetic_every_type)
{
    size_t n;
    uint8_t *buf = slurp(FIX "dequant_synthetic.bin", &n);
    ck_assert_msg(buf != NULL, "fixture " FIX "dequant_synthetic.bin missing");
    ck_assert(n > 12 && memcmp(buf, "KVQDQ1\0\0", 8) == 0);
    uint32_t nrec = rd32(buf + 8);
    size_t pos = 12;
    uint32_t seen = 0; /* bitmask over ggml type ids */
    for (uint32_t r = 0; r < nrec; r++) {
        ck_assert(pos + 12 <= n);
        kvq_ggml_type t = (kvq_ggml_type)rd32(buf + pos);
        uint32_t nel = rd32(buf + pos + 4), nb = rd32(buf + pos + 8);
        pos += 12;
        ck_assert(pos + nb + 4ull * nel <= n);
        float *out = malloc(nel * sizeof(float));
        kvq_err e = {0};
        const char *name = "?";
        kvq_ggml_type_info(t, NULL, NULL, &name);
        ck_assert_msg(kvq_ggml_dequantize(t, buf + pos, nb, out, nel, name, &e) == KVQ_OK, "%s", e.msg);
        long bad = first_bit_mismatch(out, buf + pos + nb, nel);
        float want;
        if (bad >= 0) memcpy(&want, buf + pos + nb + 4 * bad, 4);
        ck_assert_msg(bad < 0, "%s: element %ld: got %a, gguf.quants gives %a", name, bad, bad >= 0 ? out[bad] : 0.0f,
                      bad >= 0 ? want : 0.0f);
        /* a non-trivial fixture: values are not all zero */
        int nonzero = 0;
        for (uint32_t i = 0; i < nel; i++) nonzero += out[i] != 0;
        ck_assert_msg(nonzero > (int)nel / 4, "%s: fixture mostly zeros", name);
        free(out);
        seen |= 1u << (t == KVQ_GGML_BF16 ? 31 : t);
        pos += nb + 4ull * nel;
    }
    ck_assert_uint_eq(pos, n);
    const kvq_ggml_type want[] = {KVQ_GGML_F32, KVQ_GGML_F16, KVQ_GGML_BF16, KVQ_GGML_Q4_0, KVQ_GGML_Q4_1, KVQ_GGML_Q5_0,
                                  KVQ_GGML_Q5_1, KVQ_GGML_Q8_0, KVQ_GGML_Q2_K, KVQ_GGML_Q3_K, KVQ_GGML_Q4_K, KVQ_GGML_Q5_K,
                                  KVQ_GGML_Q6_K};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(seen & (1u << (want[i] == KVQ_GGML_BF16 ? 31 : want[i])), "type %d absent from fixture", want[i]);
    free(buf);
}
END_TEST

/* all 65536 binary16 patterns against the IEEE definition evaluated in double */
START_TEST(test_fp16_all_patterns)
{
    for (uint32_t h = 0; h < 65536; h++) {
        int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
        float got = kvq_f16_to_f32((uint16_t)h);
        if (exp == 31) {
            if (mant == 0) {
                ck_assert(isinf(got) && (signbit(got) != 0) == sign);
            } else {
                ck_assert_msg(isnan(got) && (signbit(got) != 0) == sign, "h=%04x", h);
                uint32_t bits;
                memcpy(&bits, &got, 4);
                ck_assert_uint_eq(bits & 0x003FFFFFu, ((uint32_t)mant << 13) & 0x003FFFFFu); /* payload kept */
                ck_assert(bits & 0x00400000u);                                               /* quiet */
            }
            continue;
        }
        double want = exp == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, exp - 25);
        if (sign) want = -want;
        ck_assert_msg((double)got == want && (signbit(got) != 0) == sign, "h=%04x: got %a want %a", h, got, want);
    }
    /* bf16: the upper half of a binary32 */
    ck_assert(kvq_bf16_to_f32(0x3F80) == 1.0f);
    ck_assert(kvq_bf16_to_f32(0xC0A0) == -5.0f);
    ck_assert(kvq_bf16_to_f32(0x0001) == ldexpf(1.0f, -133)); /* binary32 subnormal */
    ck_assert(isinf(kvq_bf16_to_f32(0xFF80)) && kvq_bf16_to_f32(0xFF80) < 0);
    ck_assert(isnan(kvq_bf16_to_f32(0x7FC1)));
}
END_TEST

START_TEST(test_q8_k_by_hand)
{
    uint8_t blk[292] = {0};
    float d = 0.375f;
    memcpy(blk, &d, 4);
    for (int i = 0; i < 256; i++) blk[4 + i] = (uint8_t)(int8_t)(i - 128);
    memset(blk + 260, 0x5A, 32); /* bsums: ignored by dequantization */
    float y[256];
    kvq_err e = {0};
    ck_assert_msg(kvq_ggml_dequantize(KVQ_GGML_Q8_K, blk, sizeof blk, y, 256, "q8k", &e) == KVQ_OK, "%s", e.msg);
    for (int i = 0; i < 256; i++) ck_assert(y[i] == 0.375f * (float)(i - 128));
}
END_TEST

START_TEST(test_errors)
{
    uint8_t blk[64] = {0};
    float y[64];
    kvq_err e = {0};
    ck_assert_int_eq(kvq_ggml_dequantize(KVQ_GGML_Q8_1, blk, sizeof blk, y, 32, "blk.7.attn_q.weight", &e), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(e.msg, "blk.7.attn_q.weight") && strstr(e.msg, "Q8_1"), "%s", e.msg);
    ck_assert_int_eq(kvq_ggml_dequantize((kvq_ggml_type)99, blk, sizeof blk, y, 32, "t99", &e), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(e.msg, "t99") && strstr(e.msg, "99"), "%s", e.msg);
    ck_assert_int_eq(kvq_ggml_dequantize(KVQ_GGML_Q4_0, blk, sizeof blk, y, 33, "odd", &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "odd") && strstr(e.msg, "Q4_0"), "%s", e.msg);
    ck_assert_int_eq(kvq_ggml_dequantize(KVQ_GGML_Q8_0, blk, 33, y, 32, "short", &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "short") && strstr(e.msg, "34"), "%s", e.msg);
    size_t nb = 0;
    ck_assert_int_eq(kvq_ggml_nbytes(KVQ_GGML_Q6_K, 512, &nb, "x", &e), KVQ_OK);
    ck_assert_uint_eq(nb, 420);
    ck_assert_int_eq(kvq_ggml_nbytes(KVQ_GGML_Q8_K, (size_t)-1 / 256 * 256, &nb, "x", &e), KVQ_EFORMAT);
}
END_TEST

/* Open the default model and check it is the file the fixtures were made from. */
static int open_model(kvq_gguf *g, char *sha_line, size_t n)
{
    const char *p = kvq_test_model();
    if (!p) return 0;
    FILE *f = fopen(FIX "dequant_model.sha256", "r");
    ck_assert_ptr_nonnull(f);
    ck_assert(fgets(sha_line, (int)n, f) != NULL);
    fclose(f);
    char hex[65];
    kvq_err e = {0};
    ck_assert_msg(kvq_sha256_path(p, hex, &e) == KVQ_OK, "%s", e.msg);
    if (strncmp(sha_line, "file ", 5) != 0 || strncmp(sha_line + 5, hex, 64) != 0) {
        fprintf(stderr, "note: %s (sha256 %s) is not the model the fixtures were made from\n", p, hex);
        return 0;
    }
    ck_assert_msg(kvq_gguf_open(p, g, &e) == KVQ_OK, "%s", e.msg);
    return 1;
}

START_TEST(test_model_rows)
{
    kvq_gguf g;
    char line[256];
    KVQ_SKIP_IF(!open_model(&g, line, sizeof line), "default model absent or not the fixture's model");
    size_t n;
    uint8_t *buf = slurp(FIX "dequant_model_rows.bin", &n);
    ck_assert_ptr_nonnull(buf);
    ck_assert(memcmp(buf, "KVQROWS1", 8) == 0);
    uint32_t nt = rd32(buf + 8);
    ck_assert_uint_eq(nt, g.n_tensors);
    size_t pos = 12, rows_checked = 0;
    float *row = malloc(65536 * sizeof(float));
    for (uint32_t i = 0; i < nt; i++) {
        uint32_t nl = rd32(buf + pos);
        char name[128];
        ck_assert(nl < sizeof name);
        memcpy(name, buf + pos + 4, nl);
        name[nl] = 0;
        pos += 4 + nl;
        const kvq_gguf_tensor *t = kvq_gguf_find_tensor(&g, name);
        ck_assert_msg(t != NULL, "tensor %s not in model", name);
        uint32_t nr = rd32(buf + pos);
        pos += 4;
        size_t ne0 = t->ne[0], row_bytes;
        kvq_err e = {0};
        ck_assert(ne0 <= 65536 && ne0 >= 64);
        ck_assert(kvq_ggml_nbytes(t->type, ne0, &row_bytes, name, &e) == KVQ_OK);
        for (uint32_t r = 0; r < nr; r++) {
            uint64_t ri = rd64(buf + pos);
            pos += 8;
            ck_assert(ri < t->n_elements / ne0);
            ck_assert_msg(kvq_ggml_dequantize(t->type, t->data + ri * row_bytes, row_bytes, row, ne0, name, &e) == KVQ_OK, "%s", e.msg);
            long b1 = first_bit_mismatch(row, buf + pos, 32);
            long b2 = first_bit_mismatch(row + ne0 - 32, buf + pos + 128, 32);
            ck_assert_msg(b1 < 0 && b2 < 0, "%s row %llu: mismatch at head %ld / tail %ld", name, (unsigned long long)ri, b1, b2);
            pos += 64 * 4;
            rows_checked++;
        }
    }
    ck_assert_uint_eq(pos, n);
    ck_assert_uint_ge(rows_checked, 272 * 2);
    free(row);
    free(buf);
    kvq_gguf_close(&g);
}
END_TEST

static void sha256_hex(const void *p, size_t n, char hex[65])
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned dn = 0;
    ck_assert(EVP_Digest(p, n, d, &dn, EVP_sha256(), NULL) == 1);
    for (unsigned i = 0; i < dn; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

/* Every tensor of the default model, whole: SHA-256 of our fp32 equals that of
 * gguf.quants.dequantize. Quick mode (ASan) checks a subset. */
START_TEST(test_model_full_file)
{
    kvq_gguf g;
    char line[256];
    KVQ_SKIP_IF(!open_model(&g, line, sizeof line), "default model absent or not the fixture's model");
    FILE *f = fopen(FIX "dequant_model.sha256", "r");
    ck_assert(fgets(line, sizeof line, f) != NULL); /* file line */
    float *buf = NULL;
    size_t cap = 0, checked = 0, elems = 0;
    char name[128], type[16], want[65], got[65];
    unsigned long long nel;
    int idx = 0;
    while (fscanf(f, "%127s %15s %llu %64s", name, type, &nel, want) == 4) {
        idx++;
        if (kvq_test_quick() && idx > 12) continue;
        const kvq_gguf_tensor *t = kvq_gguf_find_tensor(&g, name);
        ck_assert_msg(t != NULL, "%s missing", name);
        ck_assert_uint_eq(t->n_elements, nel);
        const char *tn = "?";
        kvq_ggml_type_info(t->type, NULL, NULL, &tn);
        ck_assert_str_eq(tn, type);
        if (nel > cap) {
            free(buf);
            buf = malloc(nel * sizeof(float));
            ck_assert_ptr_nonnull(buf);
            cap = nel;
        }
        kvq_err e = {0};
        ck_assert_msg(kvq_gguf_tensor_dequantize(&g, t, buf, &e) == KVQ_OK, "%s", e.msg);
        sha256_hex(buf, nel * sizeof(float), got);
        ck_assert_msg(strcmp(got, want) == 0, "%s (%s): sha256 of dequantized fp32 %s, gguf.quants gives %s", name, type, got, want);
        checked++;
        elems += nel;
    }
    fclose(f);
    ck_assert_uint_eq(idx, g.n_tensors);
    if (!kvq_test_quick()) {
        ck_assert_uint_eq(checked, 272);
        ck_assert_uint_gt(elems, 134000000); /* 134,515,008 parameters */
    }
    fprintf(stderr, "test_model_full_file: %zu tensors, %zu values identical to gguf.quants.dequantize\n", checked, elems);
    free(buf);
    kvq_gguf_close(&g);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("dequant");
    TCase *tc = tcase_create("dequant");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_synthetic_every_type);
    tcase_add_test(tc, test_fp16_all_patterns);
    tcase_add_test(tc, test_q8_k_by_hand);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_model_rows);
    tcase_add_test(tc, test_model_full_file);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
