/* test_text.c — corpus readers and the perplexity / calibration protocols.
 * References: the published size and sha256 of wiki.test.raw (../shared/README.md),
 * tests/fixtures/smollm2_wikitext_windows.txt (Python: HF `tokenizers` + `random`,
 * tests/scripts/make_wikitext_windows_fixture.py), CPython's random module values
 * for the MT19937 port, and small hand-written corpora. */
#include <stdint.h>

#include "kvq_test.h"
#include "text.h"
#include "tokenizer.h"

static void fixture_get(const char *key, char *val, size_t n)
{
    FILE *f = fopen("tests/fixtures/smollm2_wikitext_windows.txt", "r");
    ck_assert_ptr_nonnull(f);
    char line[4096];
    val[0] = 0;
    while (fgets(line, sizeof line, f)) {
        size_t kl = strlen(key);
        if (!strncmp(line, key, kl) && line[kl] == ' ') {
            snprintf(val, n, "%s", line + kl + 1);
            val[strcspn(val, "\n")] = 0;
        }
    }
    fclose(f);
    ck_assert_msg(val[0], "fixture key %s missing", key);
}

static long fixture_int(const char *key)
{
    char v[64];
    fixture_get(key, v, sizeof v);
    return atol(v);
}

static void ids_sha(const int32_t *ids, size_t n, char hex[65])
{
    ck_assert(kvq_sha256_hex(ids, n * sizeof *ids, hex, NULL) == KVQ_OK); /* little-endian host */
}

static char *write_tmp(const char *name, const char *data, size_t n, char *path, size_t pn)
{
    snprintf(path, pn, "/tmp/kvq_test_text_%d_%s", (int)getpid(), name);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    if (n) ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    fclose(f);
    return path;
}

START_TEST(test_pyrandom)
{
    /* values printed by CPython: random.seed(0); [randint(0, 304830-2048-1) for 16] etc. */
    kvq_pyrandom r;
    kvq_pyrandom_seed(&r, 0);
    static const int64_t want[16] = {201979, 220500, 21225, 135746, 268055, 254766, 212302, 159023,
                                     249874, 187720, 114526, 264601, 73019, 147764, 73267, 49718};
    for (int i = 0; i < 16; i++) ck_assert_int_eq(kvq_pyrandom_randint(&r, 0, 304830 - 2048 - 1), want[i]);
    kvq_pyrandom_seed(&r, 12345678901ull); /* a seed wider than 32 bits: two key words */
    static const int64_t w2[5] = {968, 610, 335, 888, 393};
    for (int i = 0; i < 5; i++) ck_assert_int_eq(kvq_pyrandom_randint(&r, 0, 999), w2[i]);
    kvq_pyrandom_seed(&r, 0);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(kvq_pyrandom_randint(&r, 0, 0), 0);
    ck_assert_uint_eq(kvq_pyrandom_u32(&r), 1112038970u); /* random.getrandbits(32) after that */
}
END_TEST

START_TEST(test_wikitext_raw_read)
{
    char b[4096];
    const char *p = kvq_test_shared(b, sizeof b, "datasets/wikitext-2-raw/wiki.test.raw");
    KVQ_SKIP_IF(!p, "../shared/datasets absent");
    kvq_text t;
    kvq_err e = {0};
    ck_assert_msg(kvq_text_read(p, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(t.bytes_read, 1290547);
    ck_assert_str_eq(t.file_sha256, "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c");
    ck_assert_uint_eq(t.crlf_replaced, 2891);
    ck_assert_uint_eq(t.len, 1290547 - 2891);
    ck_assert_uint_eq(t.n_rows, 2891); /* the README's row count */
    ck_assert(!memcmp(t.rows_base + t.row_off[0], " = Robert Boulter = \n", t.row_len[0]));
    ck_assert_uint_eq(t.row_len[0], 21);
    ck_assert(memchr(t.data, '\r', t.len) == NULL);
    kvq_text_free(&t);
    ck_assert(kvq_text_read(p, KVQ_TEXT_RAW, KVQ_EOL_KEEP, &t, &e) == KVQ_OK);
    ck_assert_uint_eq(t.crlf_replaced, 0);
    ck_assert_uint_eq(t.len, 1290547);
    kvq_text_free(&t);
}
END_TEST

START_TEST(test_smollm2_protocols)
{
    char b[4096];
    const char *p = kvq_test_shared(b, sizeof b, "datasets/wikitext-2-raw/wiki.test.raw");
    KVQ_SKIP_IF(!p, "../shared/datasets absent");
    const char *m = kvq_test_model();
    KVQ_SKIP_IF(!m, "default model absent");
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_gguf(m, &tok, &e) == KVQ_OK, "%s", e.msg);
    kvq_text t;
    ck_assert_msg(kvq_text_read(p, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK, "%s", e.msg);
    char v[1024], hex[65];
    kvq_windows w;

    ck_assert_msg(kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, 2048, KVQ_BOS_MODEL, &w, &e) == KVQ_OK, "%s", e.msg);
    fixture_get("kvquant_text_sha256", v, sizeof v);
    ck_assert_str_eq(w.text_sha256, v);
    ck_assert_int_eq(w.bos, 0); /* SmolLM2: add_bos_token = false */
    ck_assert_uint_eq(w.n_tokens, (size_t)fixture_int("kvquant_tokens"));
    ck_assert_uint_eq(w.n_windows, (size_t)fixture_int("kvquant_windows"));
    ck_assert_uint_eq(w.dropped_tail, w.n_tokens - w.n_windows * 2048);
    ids_sha(w.tokens, w.n_windows * 2048, hex);
    fixture_get("kvquant_windows_sha256", v, sizeof v);
    ck_assert_str_eq(hex, v);
    ck_assert_uint_eq(w.offsets[3], 3 * 2048);
    FILE *devnull = fopen("/dev/null", "w");
    kvq_windows_report(&w, devnull);
    kvq_windows_free(&w);

    ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_LLAMACPP, 2048, KVQ_BOS_ALWAYS, &w, &e) == KVQ_OK);
    ck_assert_uint_eq(w.n_tokens, (size_t)fixture_int("llamacpp_bos_tokens"));
    ck_assert_uint_eq(w.n_windows, (size_t)fixture_int("llamacpp_bos_windows"));
    for (size_t i = 0; i < w.n_windows; i++) ck_assert_int_eq(w.tokens[i * 2048], 1);
    ids_sha(w.tokens, w.n_windows * 2048, hex);
    fixture_get("llamacpp_bos_windows_sha256", v, sizeof v);
    ck_assert_str_eq(hex, v);
    kvq_windows_free(&w);

    ck_assert(kvq_calib_windows(&t, tok, 16, 2048, 0, KVQ_BOS_MODEL, &w, &e) == KVQ_OK);
    fixture_get("calib_offsets", v, sizeof v);
    char *q = v;
    for (size_t i = 0; i < 16; i++) ck_assert_uint_eq(w.offsets[i], strtoul(q, &q, 10));
    ids_sha(w.tokens, 16 * 2048, hex);
    fixture_get("calib_windows_sha256", v, sizeof v);
    ck_assert_str_eq(hex, v);
    kvq_windows_report(&w, devnull);
    fclose(devnull);
    kvq_windows_free(&w);

    /* a window longer than the corpus: clear error */
    ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, 1000000, KVQ_BOS_MODEL, &w, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "fewer than one window"));
    kvq_text_free(&t);
    kvq_tokenizer_free(tok);
}
END_TEST

/* Small corpora with hand-derived expectations (GPT-2 conformance vocab). */
START_TEST(test_small_corpora_and_bad_input)
{
    char b[4096], path[512];
    const char *g = kvq_test_shared(b, sizeof b, "tokenizer-conformance/ggml-vocab-gpt-2.gguf");
    KVQ_SKIP_IF(!g, "../shared/tokenizer-conformance absent");
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert(kvq_tokenizer_from_gguf(g, &tok, &e) == KVQ_OK);
    kvq_text t;
    kvq_windows w;
    /* JSONL: rows are the text fields; kvquant joins them with "\n\n" */
    const char jl[] = "{\"text\": \"Hello world\", \"id\": 1}\n\n{\"text\": \"Hello\\nworld\"}\r\n";
    write_tmp("c4.jsonl", jl, sizeof jl - 1, path, sizeof path);
    ck_assert_int_eq(kvq_text_format_from_path(path), KVQ_TEXT_JSONL);
    ck_assert_msg(kvq_text_read(path, KVQ_TEXT_JSONL, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(t.n_rows, 2);
    ck_assert_msg(kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, 2, KVQ_BOS_NEVER, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(w.text_bytes, strlen("Hello world\n\nHello\nworld"));
    /* "Hello world\n\nHello\nworld" → Hello, Ġworld, Ċ, Ċ, Hello, Ċ, world: 7 tokens
     * (\s+(?!\S) leaves the "\n" before "Hello" to a piece of its own) */
    ck_assert_uint_eq(w.n_tokens, 7);
    ck_assert_uint_eq(w.n_windows, 3);
    ck_assert_int_eq(w.tokens[0], 15496); /* "Hello" (gpt-2 .out: 15496 995 = "Hello world") */
    ck_assert_int_eq(w.tokens[1], 995);
    kvq_windows_free(&w);
    /* llamacpp with BOS: 8 tokens, ctx 3 → 2 windows, first of each = BOS 50256, tail 2 */
    ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_LLAMACPP, 3, KVQ_BOS_ALWAYS, &w, &e) == KVQ_OK);
    ck_assert_uint_eq(w.n_tokens, 8);
    ck_assert_uint_eq(w.n_windows, 2);
    ck_assert_uint_eq(w.dropped_tail, 2);
    ck_assert_int_eq(w.tokens[0], 50256);
    ck_assert_int_eq(w.tokens[3], 50256);
    kvq_windows_free(&w);
    /* calibration needs more than len tokens */
    ck_assert(kvq_calib_windows(&t, tok, 4, 7, 0, KVQ_BOS_NEVER, &w, &e) == KVQ_EFORMAT);
    ck_assert(kvq_calib_windows(&t, tok, 4, 6, 0, KVQ_BOS_NEVER, &w, &e) == KVQ_OK);
    for (int i = 0; i < 4; i++) ck_assert_uint_eq(w.offsets[i], 0); /* randint(0, 0) */
    kvq_windows_free(&w);
    kvq_text_free(&t);
    unlink(path);

    /* malformed JSONL names the line */
    const char bad[] = "{\"text\": \"ok\"}\n{\"txt\": 1}\n";
    write_tmp("bad.jsonl", bad, sizeof bad - 1, path, sizeof path);
    ck_assert(kvq_text_read(path, KVQ_TEXT_JSONL, KVQ_EOL_TO_LF, &t, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "line 2"));
    unlink(path);
    /* one JSON value per line: trailing characters are an error (accepted before), whitespace is not */
    const char trail[] = "{\"text\": \"ok\"}  \r\n{\"text\": \"abc\"} trailing\n";
    write_tmp("trail.jsonl", trail, sizeof trail - 1, path, sizeof path);
    ck_assert(kvq_text_read(path, KVQ_TEXT_JSONL, KVQ_EOL_TO_LF, &t, &e) == KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "line 2, column 17: trailing characters after the JSON value"), "%s", e.msg);
    unlink(path);
    /* empty file */
    write_tmp("empty.txt", "", 0, path, sizeof path);
    ck_assert(kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "empty file"));
    unlink(path);
    /* missing file */
    ck_assert(kvq_text_read("/nonexistent/kvq.txt", KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_EIO);
    /* not a regular file: refused at once with its kind (/dev/zero used to be read until memory ran out,
     * a directory failed as "read error after 0 bytes") */
    ck_assert(kvq_text_read("/dev/zero", KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/dev/zero: not a regular file (a character device; expected a text file)"), "%s", e.msg);
    ck_assert(kvq_text_read("/tmp", KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/tmp: is a directory (expected a text file)"), "%s", e.msg);
    {
        int pfd[2];
        ck_assert_int_eq(pipe(pfd), 0);
        char fifo[64];
        snprintf(fifo, sizeof fifo, "/dev/fd/%d", pfd[0]);
        ck_assert(kvq_text_read(fifo, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_EIO); /* would block forever */
        ck_assert_msg(strstr(e.msg, "not a regular file (a pipe;"), "%s", e.msg);
        close(pfd[0]);
        close(pfd[1]);
    }
    /* NUL bytes, lone CR and invalid UTF-8 are kept and tokenised; shorter than a window → error */
    const char odd[] = "a\0b\r\xff\xfe\r\nc";
    write_tmp("odd.txt", odd, sizeof odd - 1, path, sizeof path);
    ck_assert(kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK);
    ck_assert_uint_eq(t.crlf_replaced, 1);
    ck_assert_uint_eq(t.len, sizeof odd - 2);
    ck_assert_uint_eq(t.n_rows, 2);
    ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, 4096, KVQ_BOS_NEVER, &w, &e) == KVQ_EFORMAT);
    ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_LLAMACPP, 2, KVQ_BOS_NEVER, &w, &e) == KVQ_OK);
    kvq_windows_free(&w);
    kvq_text_free(&t);
    unlink(path);
    kvq_tokenizer_free(tok);
}
END_TEST

START_TEST(test_wikitext_tokens_file)
{
    char b[4096];
    const char *p = kvq_test_shared(b, sizeof b, "datasets/wikitext-2/wiki.valid.tokens");
    KVQ_SKIP_IF(!p, "../shared/datasets absent");
    ck_assert_int_eq(kvq_text_format_from_path(p), KVQ_TEXT_WIKITEXT_TOKENS);
    kvq_text t;
    kvq_err e = {0};
    ck_assert(kvq_text_read(p, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK);
    ck_assert_uint_eq(t.bytes_read, 1121681);
    ck_assert_uint_eq(t.crlf_replaced, 0); /* LF file */
    ck_assert(!memcmp(t.rows_base + t.row_off[1], " = Homarus gammarus = \n", t.row_len[1]));
    size_t total = 0;
    for (size_t r = 0; r < t.n_rows; r++) total += t.row_len[r];
    ck_assert_uint_eq(total, t.len); /* rows cover the text exactly */
    kvq_text_free(&t);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("text");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_pyrandom);
    tcase_add_test(tc, test_wikitext_raw_read);
    tcase_add_test(tc, test_smollm2_protocols);
    tcase_add_test(tc, test_small_corpora_and_bad_input);
    tcase_add_test(tc, test_wikitext_tokens_file);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
