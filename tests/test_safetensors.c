/* test_safetensors.c — safetensors reader/writer: a fixture written by the
 * reference Python package (tests/scripts/make_safetensors_fixture.py) read
 * back value by value and reproduced byte for byte by our writer; round trips
 * of every dtype with alignment and order-independence; every truncation of a
 * valid file and one handcrafted file per corruption mode rejected with a
 * message naming the field. */
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>

#include "kvq_test.h"
#include "safetensors.h"

#define FIXTURE "tests/fixtures/st_fixture.safetensors"

/* scratch files live in the git-ignored build/ tree, never in /tmp */
static const char *tmp_path(char *buf, size_t n, const char *name)
{
    mkdir("build", 0755);
    mkdir("build/tmp", 0755);
    mkdir("build/tmp/test_safetensors", 0755);
    snprintf(buf, n, "build/tmp/test_safetensors/%s", name);
    return buf;
}

static unsigned char *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static void spit(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

/* the fixture's tensors, as our writer's input */
static const float fa[6] = {-1, -0.5f, 0, 0.5f, 1, 1.5f};
static const uint16_t fb[4] = {0x2e66, 0xc100, 0x7bff, 0x0001}; /* numpy half of 0.1, -2.5, 65504, 6e-8 */
static const uint16_t fc[3] = {0x3f80, 0xc049, 0x0001};
static const int32_t fd[4] = {1, -2, 3, 2147483647};
static const int64_t fe[3] = {-1, 0, (int64_t)1 << 40};
static const uint8_t ff[5] = {0, 1, 2, 254, 255};
static const double fg[2] = {1.5, -1e300};
static const float fh = 42.0f;

static void fixture_entries(kvq_st_entry *e, kvq_st_kv *m)
{
    e[0] = (kvq_st_entry){"g.f64", KVQ_ST_F64, 1, {2}, fg};
    e[1] = (kvq_st_entry){"a.f32", KVQ_ST_F32, 2, {2, 3}, fa};
    e[2] = (kvq_st_entry){"c.bf16", KVQ_ST_BF16, 1, {3}, fc};
    e[3] = (kvq_st_entry){"h.scalar", KVQ_ST_F32, 0, {0}, &fh};
    e[4] = (kvq_st_entry){"b.f16", KVQ_ST_F16, 1, {4}, fb};
    e[5] = (kvq_st_entry){"d.i32", KVQ_ST_I32, 2, {2, 2}, fd};
    e[6] = (kvq_st_entry){"f.u8", KVQ_ST_U8, 1, {5}, ff};
    e[7] = (kvq_st_entry){"e.i64", KVQ_ST_I64, 1, {3}, fe};
    m[0] = (kvq_st_kv){"note", "quote \" and unicode \xc3\xa9"};
    m[1] = (kvq_st_kv){"format", "kvq-fixture"};
}

START_TEST(test_python_fixture)
{
    kvq_safetensors st;
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_open(FIXTURE, &st, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(st.n_tensors, 8);
    ck_assert_str_eq(kvq_safetensors_meta(&st, "format"), "kvq-fixture");
    ck_assert_str_eq(kvq_safetensors_meta(&st, "note"), "quote \" and unicode \xc3\xa9");
    ck_assert_ptr_null(kvq_safetensors_meta(&st, "nope"));
    const kvq_st_tensor *t = kvq_safetensors_find(&st, "a.f32");
    ck_assert_ptr_nonnull(t);
    ck_assert(t->dtype == KVQ_ST_F32 && t->n_dims == 2 && t->shape[0] == 2 && t->shape[1] == 3);
    float buf[8];
    ck_assert(kvq_safetensors_read_f32(&st, t, buf, 6, &e) == KVQ_OK);
    for (int i = 0; i < 6; i++) ck_assert_float_eq(buf[i], fa[i]);
    t = kvq_safetensors_find(&st, "b.f16");
    ck_assert(kvq_safetensors_read_f32(&st, t, buf, 4, &e) == KVQ_OK);
    ck_assert_float_eq(buf[0], 0.0999755859375f);
    ck_assert_float_eq(buf[1], -2.5f);
    ck_assert_float_eq(buf[2], 65504.0f);
    ck_assert_float_eq(buf[3], 5.9604644775390625e-08f);
    t = kvq_safetensors_find(&st, "c.bf16");
    ck_assert(t->dtype == KVQ_ST_BF16);
    ck_assert(kvq_safetensors_read_f32(&st, t, buf, 3, &e) == KVQ_OK);
    ck_assert_float_eq(buf[0], 1.0f);
    ck_assert_float_eq(buf[1], -3.140625f);
    ck_assert(buf[2] > 0 && buf[2] < 1e-38f);
    t = kvq_safetensors_find(&st, "d.i32");
    int32_t i32[4];
    memcpy(i32, t->data, 16);
    ck_assert(memcmp(i32, fd, 16) == 0);
    t = kvq_safetensors_find(&st, "e.i64");
    ck_assert(t->dtype == KVQ_ST_I64 && memcmp(t->data, fe, 24) == 0);
    t = kvq_safetensors_find(&st, "f.u8");
    ck_assert(t->dtype == KVQ_ST_U8 && memcmp(t->data, ff, 5) == 0);
    t = kvq_safetensors_find(&st, "g.f64");
    ck_assert(kvq_safetensors_read_f32(&st, t, buf, 2, &e) == KVQ_OK);
    ck_assert_float_eq(buf[0], 1.5f);
    ck_assert(isinf(buf[1]) && buf[1] < 0); /* -1e300 does not fit float32 */
    t = kvq_safetensors_find(&st, "h.scalar");
    ck_assert(t->n_dims == 0 && t->n_elements == 1);
    ck_assert(kvq_safetensors_read_f32(&st, t, buf, 1, &e) == KVQ_OK);
    ck_assert_float_eq(buf[0], 42.0f);
    /* wrong dtype / count for conversion name the tensor */
    ck_assert(kvq_safetensors_read_f32(&st, kvq_safetensors_find(&st, "d.i32"), buf, 4, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "d.i32"));
    ck_assert(kvq_safetensors_read_f32(&st, kvq_safetensors_find(&st, "a.f32"), buf, 5, &e) == KVQ_EINVAL);
    kvq_safetensors_close(&st);
}
END_TEST

START_TEST(test_writer_matches_reference_bytes)
{
    kvq_st_entry ent[8];
    kvq_st_kv meta[2];
    fixture_entries(ent, meta);
    char p[512];
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_write(tmp_path(p, sizeof p, "mine.safetensors"), ent, 8, meta, 2, &e) == KVQ_OK, "%s",
                  e.msg);
    size_t na, nb;
    unsigned char *a = slurp(p, &na), *b = slurp(FIXTURE, &nb);
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert_uint_eq(na, nb);
    ck_assert_msg(memcmp(a, b, na) == 0, "C writer output differs from the Python reference fixture");
    free(a);
    free(b);
    char partial[600];
    snprintf(partial, sizeof partial, "%s.partial", p);
    ck_assert_int_ne(access(partial, F_OK), 0);
}
END_TEST

START_TEST(test_round_trip_and_order)
{
    kvq_st_entry ent[8], rev[8];
    kvq_st_kv meta[2], mrev[2];
    fixture_entries(ent, meta);
    for (int i = 0; i < 8; i++) rev[i] = ent[7 - i];
    mrev[0] = meta[1];
    mrev[1] = meta[0];
    char p1[512], p2[512];
    kvq_err e = {0};
    ck_assert(kvq_safetensors_write(tmp_path(p1, sizeof p1, "o1.safetensors"), ent, 8, meta, 2, &e) == KVQ_OK);
    ck_assert(kvq_safetensors_write(tmp_path(p2, sizeof p2, "o2.safetensors"), rev, 8, mrev, 2, &e) == KVQ_OK);
    size_t n1, n2;
    unsigned char *a = slurp(p1, &n1), *b = slurp(p2, &n2);
    ck_assert(n1 == n2 && memcmp(a, b, n1) == 0);
    free(a);
    free(b);
    kvq_safetensors st;
    ck_assert(kvq_safetensors_open(p1, &st, &e) == KVQ_OK);
    ck_assert_uint_eq(st.data_offset % 8, 0);
    for (int i = 0; i < 8; i++) {
        const kvq_st_tensor *t = kvq_safetensors_find(&st, ent[i].name);
        ck_assert_ptr_nonnull(t);
        ck_assert(t->dtype == ent[i].dtype && t->n_dims == ent[i].n_dims);
        ck_assert_uint_eq(t->begin % kvq_st_dtype_size(t->dtype), 0); /* aligned to its element size */
        ck_assert(memcmp(t->data, ent[i].data, t->n_bytes) == 0);
    }
    kvq_safetensors_close(&st);
    /* empty file: no tensors, no metadata; and a zero-element tensor */
    kvq_st_entry z = {"empty", KVQ_ST_F32, 2, {0, 5}, NULL};
    ck_assert(kvq_safetensors_write(p1, &z, 1, NULL, 0, &e) == KVQ_OK);
    ck_assert(kvq_safetensors_open(p1, &st, &e) == KVQ_OK);
    ck_assert_uint_eq(st.n_tensors, 1);
    ck_assert_uint_eq(st.tensors[0].n_elements, 0);
    kvq_safetensors_close(&st);
    ck_assert(kvq_safetensors_write(p1, NULL, 0, NULL, 0, &e) == KVQ_OK);
    ck_assert(kvq_safetensors_open(p1, &st, &e) == KVQ_OK);
    ck_assert_uint_eq(st.n_tensors + st.n_meta, 0);
    kvq_safetensors_close(&st);
}
END_TEST

START_TEST(test_writer_errors)
{
    char p[512];
    tmp_path(p, sizeof p, "keep.safetensors");
    spit(p, "previous", 8);
    float x = 1;
    kvq_st_entry dup[2] = {{"w", KVQ_ST_F32, 1, {1}, &x}, {"w", KVQ_ST_F16, 1, {1}, &x}};
    kvq_err e = {0};
    ck_assert(kvq_safetensors_write(p, dup, 2, NULL, 0, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "duplicate tensor name 'w'"));
    kvq_st_entry bad = {"__metadata__", KVQ_ST_F32, 1, {1}, &x};
    ck_assert(kvq_safetensors_write(p, &bad, 1, NULL, 0, &e) == KVQ_EINVAL);
    kvq_st_kv m[2] = {{"k", "1"}, {"k", "2"}};
    ck_assert(kvq_safetensors_write(p, NULL, 0, m, 2, &e) == KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "duplicate metadata key 'k'"));
    size_t n;
    unsigned char *b = slurp(p, &n);
    ck_assert(n == 8 && memcmp(b, "previous", 8) == 0); /* untouched on failure */
    free(b);
    ck_assert(kvq_safetensors_write("/nonexistent-dir/x.safetensors", NULL, 0, NULL, 0, &e) == KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "/nonexistent-dir/x.safetensors.partial"));
}
END_TEST

START_TEST(test_every_truncation_rejected)
{
    size_t n;
    unsigned char *b = slurp(FIXTURE, &n);
    ck_assert_ptr_nonnull(b);
    char p[512];
    tmp_path(p, sizeof p, "trunc.safetensors");
    kvq_err e = {0};
    for (size_t len = 0; len < n; len++) {
        spit(p, b, len);
        kvq_safetensors st;
        kvq_status s = kvq_safetensors_open(p, &st, &e);
        ck_assert_msg(s == KVQ_EFORMAT, "truncated to %zu of %zu bytes: status %d", len, n, (int)s);
        ck_assert_msg(strstr(e.msg, p) != NULL, "message does not name the file: %s", e.msg);
    }
    free(b);
}
END_TEST

/* write [u64 len][header][data] */
static kvq_status open_crafted(const char *header, size_t data_len, kvq_err *e)
{
    char p[512];
    tmp_path(p, sizeof p, "crafted.safetensors");
    size_t hl = strlen(header);
    unsigned char *b = calloc(8 + hl + data_len + 1, 1);
    uint64_t h64 = hl;
    memcpy(b, &h64, 8);
    memcpy(b + 8, header, hl);
    spit(p, b, 8 + hl + data_len);
    free(b);
    kvq_safetensors st;
    kvq_status s = kvq_safetensors_open(p, &st, e);
    if (s == KVQ_OK) kvq_safetensors_close(&st);
    return s;
}

START_TEST(test_corrupt_headers)
{
    struct { const char *header; size_t data; const char *expect; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, NULL}, /* valid control */
        {"not json", 0, "expected a JSON object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "invalid JSON"},
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype \"F33\""},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "field 'dtype'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "field 'shape'[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8, "field 'shape'[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,80]}}", 8, "exceeds the data buffer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "end before begin"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "field 'data_offsets'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "leaves a gap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "trailing bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "duplicate tensor name 'a'"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "'__metadata__'.'k'"},
        {"{\"__metadata__\":[]}", 0, "'__metadata__'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} x", 8, "unexpected byte"},
        {"{\"a\":7}", 0, "tensor 'a': expected an object"},
    };
    kvq_err e = {0};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvq_status s = open_crafted(cases[i].header, cases[i].data, &e);
        if (!cases[i].expect) { ck_assert_msg(s == KVQ_OK, "control case: %s", e.msg); continue; }
        ck_assert_msg(s == KVQ_EFORMAT, "case %zu accepted: %s", i, cases[i].header);
        ck_assert_msg(strstr(e.msg, cases[i].expect) != NULL, "case %zu: message '%s' lacks '%s'", i, e.msg,
                      cases[i].expect);
    }
    /* header length field larger than the file / than the limit */
    char p[512];
    tmp_path(p, sizeof p, "hl.safetensors");
    unsigned char b[16] = {0};
    uint64_t hl = 1000;
    memcpy(b, &hl, 8);
    memcpy(b + 8, "{}      ", 8);
    spit(p, b, 16);
    kvq_safetensors st;
    ck_assert(kvq_safetensors_open(p, &st, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "header length 1000"));
    hl = (uint64_t)1 << 62;
    memcpy(b, &hl, 8);
    spit(p, b, 16);
    ck_assert(kvq_safetensors_open(p, &st, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "limit"));
    ck_assert(kvq_safetensors_open("/nonexistent.safetensors", &st, &e) == KVQ_EIO);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_python_fixture);
    tcase_add_test(tc, test_writer_matches_reference_bytes);
    tcase_add_test(tc, test_round_trip_and_order);
    tcase_add_test(tc, test_writer_errors);
    tcase_add_test(tc, test_every_truncation_rejected);
    tcase_add_test(tc, test_corrupt_headers);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
