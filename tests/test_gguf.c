/* test_gguf.c — GGUF reader: the real default model, the conformance vocab
 * files, and corrupted variants (truncated, bad magic, flipped bytes). */
#include <stdint.h>

#include "gguf.h"
#include "kvq_test.h"

START_TEST(test_open_default_model)
{
    const char *p = kvq_test_model();
    KVQ_SKIP_IF(!p, "default model absent (run scripts/fetch_model.sh)");
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert_msg(kvq_gguf_open(p, &g, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(g.version, 3);
    ck_assert_uint_eq(g.n_tensors, 272);
    int64_t v = 0;
    ck_assert(kvq_gguf_get_int(&g, "llama.block_count", true, &v, &e) == KVQ_OK);
    ck_assert_int_eq(v, 30);
    ck_assert(kvq_gguf_get_int(&g, "llama.attention.head_count_kv", true, &v, &e) == KVQ_OK);
    ck_assert_int_eq(v, 3);
    double f = 0;
    ck_assert(kvq_gguf_get_float(&g, "llama.rope.freq_base", true, &f, &e) == KVQ_OK);
    ck_assert_double_eq_tol(f, 100000.0, 1e-3);
    const kvq_gguf_kv *toks;
    ck_assert(kvq_gguf_get_arr(&g, "tokenizer.ggml.tokens", KVQ_GGUF_STRING, &toks, &e) == KVQ_OK);
    ck_assert_uint_eq(toks->arr_n, 49152);
    ck_assert(kvq_gguf_str_eq(toks->arr_str[1], "<|im_start|>"));
    const kvq_gguf_tensor *t = kvq_gguf_find_tensor(&g, "blk.0.attn_k.weight");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->type, KVQ_GGML_Q4_1);
    ck_assert_uint_eq(t->ne[0], 576);
    ck_assert_uint_eq(t->ne[1], 192);
    ck_assert_uint_eq(t->n_bytes, 576 * 192 / 32 * 20);
    /* a missing key is an error naming it */
    ck_assert(kvq_gguf_get_int(&g, "llama.no_such_key", true, &v, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "llama.no_such_key"));
    /* a type mismatch names expected and found */
    ck_assert(kvq_gguf_get_bool(&g, "llama.block_count", true, &(bool){0}, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "expected bool"));
    kvq_gguf_close(&g);
}
END_TEST

/* Write the first n bytes of src (optionally with one byte XORed) to a temp file. */
static void write_variant(const char *src, size_t n, long flip_at, uint8_t flip, char *out, size_t outn)
{
    FILE *in = fopen(src, "rb");
    ck_assert_ptr_nonnull(in);
    snprintf(out, outn, "/tmp/kvq_test_gguf_%d.gguf", (int)getpid());
    FILE *o = fopen(out, "wb");
    ck_assert_ptr_nonnull(o);
    uint8_t buf[1 << 16];
    size_t done = 0;
    while (done < n) {
        size_t want = n - done < sizeof buf ? n - done : sizeof buf;
        size_t got = fread(buf, 1, want, in);
        if (got == 0) break;
        if (flip_at >= 0 && (size_t)flip_at >= done && (size_t)flip_at < done + got) buf[flip_at - done] ^= flip;
        fwrite(buf, 1, got, o);
        done += got;
    }
    fclose(in);
    fclose(o);
}

START_TEST(test_truncations_and_flips)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "tokenizer-conformance/ggml-vocab-gpt-2.gguf");
    KVQ_SKIP_IF(!p, "../shared/tokenizer-conformance absent");
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert_msg(kvq_gguf_open(p, &g, &e) == KVQ_OK, "%s", e.msg);
    size_t size = g.size;
    kvq_gguf_close(&g);
    char tmp[256];
    /* truncations: every one must fail cleanly with the path in the message */
    size_t cuts[] = {0, 1, 3, 4, 7, 8, 15, 16, 23, 24, 25, 40, 100, 1000, 10000, size / 2, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        if (cuts[i] >= size) continue;
        write_variant(p, cuts[i], -1, 0, tmp, sizeof tmp);
        memset(&e, 0, sizeof e);
        kvq_status s = kvq_gguf_open(tmp, &g, &e);
        ck_assert_msg(s != KVQ_OK, "truncation at %zu accepted", cuts[i]);
        ck_assert_msg(strstr(e.msg, tmp) != NULL, "message lacks path: %s", e.msg);
    }
    /* bad magic */
    write_variant(p, size, 0, 0x20, tmp, sizeof tmp);
    ck_assert(kvq_gguf_open(tmp, &g, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "magic"));
    /* flipped bytes in the header and the first metadata: must never crash;
     * either rejected with a message or (when the flip hits a value) accepted */
    for (long at = 4; at < 600; at++) {
        for (int bit = 0; bit < 8; bit += 3) {
            write_variant(p, size, at, (uint8_t)(1u << bit), tmp, sizeof tmp);
            memset(&e, 0, sizeof e);
            if (kvq_gguf_open(tmp, &g, &e) == KVQ_OK) kvq_gguf_close(&g);
            else ck_assert_msg(e.msg[0] != 0, "flip at %ld bit %d: empty error", at, bit);
        }
    }
    /* a huge count in the header is rejected before allocation */
    write_variant(p, size, 15, 0x40, tmp, sizeof tmp); /* tensor_count high byte */
    ck_assert(kvq_gguf_open(tmp, &g, &e) == KVQ_EFORMAT);
    unlink(tmp);
}
END_TEST

START_TEST(test_missing_file)
{
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert(kvq_gguf_open("/nonexistent/x.gguf", &g, &e) == KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "/nonexistent/x.gguf"));
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("gguf");
    TCase *tc = tcase_create("reader");
    tcase_add_test(tc, test_open_default_model);
    tcase_add_test(tc, test_truncations_and_flips);
    tcase_add_test(tc, test_missing_file);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
