/* test_text.c — corpus readers and the perplexity / calibration protocols.
 * References: the published size and sha256 of wiki.test.raw (../shared/README.md),
 * tests/fixtures/smollm2_wikitext_windows.txt (Python: HF `tokenizers` + `random`,
 * tests/scripts/make_wikitext_windows_fixture.py), CPython's random module values
 * for the MT19937 port, and small hand-written corpora. */
#include <stdint.h>

#include "kvq_test.h"
#include "text.h"
#include "tokenizer.h"

static void fixture_get_from(const char *file, const char *key, char *val, size_t n)
{
    FILE *f = fopen(file, "r");
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

static void fixture_get(const char *key, char *val, size_t n)
{
    fixture_get_from("tests/fixtures/smollm2_wikitext_windows.txt", key, val, n);
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
    kvq_windows_free(&w);
    kvq_text_free(&t);

    /* llamacpp as llama-perplexity -f reads the file (issue 41: kveval replaced the 2,891 CRLF, a 2.4% PPL
     * difference): the bytes, CRLF kept, the final LF popped; ctx 512, no BOS for SmolLM2 */
    ck_assert_msg(kvq_text_read(p, KVQ_TEXT_RAW, kvq_ppl_default_eol(KVQ_PPL_LLAMACPP), &t, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(t.crlf_in_file, 2891);
    ck_assert_msg(kvq_ppl_windows(&t, tok, KVQ_PPL_LLAMACPP, 512, KVQ_BOS_MODEL, &w, &e) == KVQ_OK, "%s", e.msg);
    fixture_get("llamacpp_keep_text_sha256", v, sizeof v);
    ck_assert_str_eq(w.text_sha256, v);
    ck_assert_uint_eq(w.text_bytes, 1290546);
    ck_assert_int_eq(w.final_lf_dropped, 1);
    ck_assert_int_eq(w.bos, 0);
    ck_assert_uint_eq(w.n_tokens, (size_t)fixture_int("llamacpp_keep_tokens"));
    ck_assert_uint_eq(w.n_windows, (size_t)fixture_int("llamacpp_keep512_windows"));
    ids_sha(w.tokens, w.n_windows * 512, hex);
    fixture_get("llamacpp_keep512_windows_sha256", v, sizeof v);
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
    /* a few NUL / invalid UTF-8 bytes in a long text are kept (byte tokens) and counted, with the first offset;
     * a lone CR stays; shorter than a window → error */
    {
        size_t n = 4000;
        char *odd = malloc(n);
        ck_assert_ptr_nonnull(odd);
        for (size_t i = 0; i < n; i++) odd[i] = "the quick brown fox jumps\r\n"[i % 27];
        odd[100] = 0;
        odd[2001] = (char)0xff;
        odd[3000] = '\r';
        write_tmp("odd.txt", odd, n, path, sizeof path);
        free(odd);
        ck_assert_msg(kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_uint_eq(t.bad_bytes, 2);
        ck_assert_uint_eq(t.first_bad, 100);
        ck_assert_uint_eq(t.crlf_in_file, t.crlf_replaced);
        ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, 100000, KVQ_BOS_NEVER, &w, &e) == KVQ_EFORMAT);
        ck_assert(kvq_ppl_windows(&t, tok, KVQ_PPL_LLAMACPP, 2, KVQ_BOS_NEVER, &w, &e) == KVQ_OK);
        kvq_windows_free(&w);
        kvq_text_free(&t);
        unlink(path);
    }
    kvq_tokenizer_free(tok);
}
END_TEST

/* Files that are not text are refused, whatever kind of bytes make them so (issue 41: binary garbage,
 * NUL bytes or invalid UTF-8 as --text ran with exit 0): the message counts the bad bytes and names the
 * first offset; the UTF-8 rules are checked sequence by sequence. */
START_TEST(test_not_text_refused)
{
    size_t first;
    struct { const char *s; size_t n, bad, first; } seq[] = {
        {"plain ascii", 11, 0, 11},
        {"caf\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80", 14, 0, 14}, /* 2-, 3- and 4-byte forms */
        {"a\0b", 3, 1, 1},                                         /* NUL */
        {"\xc0\xaf", 2, 2, 0},                                      /* overlong '/' */
        {"\xe0\x80\xaf", 3, 3, 0},                                  /* overlong, 3 bytes */
        {"\xed\xa0\x80", 3, 3, 0},                                  /* UTF-16 surrogate U+D800 */
        {"\xf4\x90\x80\x80", 4, 4, 0},                              /* above U+10FFFF */
        {"x\x80y", 3, 1, 1},                                        /* stray continuation byte */
        {"ab\xe2\x80", 4, 2, 2},                                     /* truncated at the end */
        {"\xe2\x80z", 3, 2, 0},                                      /* truncated in the middle */
        {"\xfe\xff", 2, 2, 0},                                      /* never in UTF-8 */
    };
    for (size_t i = 0; i < sizeof seq / sizeof *seq; i++) {
        size_t bad = kvq_text_bad_bytes(seq[i].s, seq[i].n, &first);
        ck_assert_msg(bad == seq[i].bad && first == seq[i].first, "case %zu: %zu bad from %zu, expected %zu from %zu", i, bad,
                      first, seq[i].bad, seq[i].first);
    }
    /* whole files: random bytes, a NUL-padded file, UTF-16LE text, a gzip header + noise, a text whose bad bytes are
     * just over the limit */
    char path[512];
    kvq_text t;
    kvq_err e = {0};
    size_t n = 4096;
    unsigned char *d = malloc(n);
    ck_assert_ptr_nonnull(d);
    for (int kind = 0; kind < 5; kind++) {
        uint32_t x = 2463534242u;
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13; x ^= x >> 17; x ^= x << 5;
            d[i] = kind == 0 ? (unsigned char)x
                   : kind == 1 ? (i < 200 ? (unsigned char)"some text "[i % 10] : 0)
                   : kind == 2 ? (i % 2 ? 0 : (unsigned char)"UTF-16 text "[(i / 2) % 12])
                   : kind == 3 ? (i < 2 ? (unsigned char)"\x1f\x8b"[i] : (unsigned char)(x | 0x80))
                               : (unsigned char)"plain line of text\n"[i % 19];
        }
        if (kind == 4) /* 5 bad bytes in 4096: 1.2 per mille */
            for (int k = 0; k < 5; k++) d[700 + 97 * k] = 0xff;
        write_tmp("bin.txt", (const char *)d, n, path, sizeof path);
        ck_assert_int_eq(kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e), KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "not a text file") && strstr(e.msg, "NUL bytes or invalid UTF-8") &&
                          strstr(e.msg, "expected UTF-8 text"),
                      "kind %d: %s", kind, e.msg);
        ck_assert_ptr_null(t.data);
        /* JSONL and WikiText files go through the same check */
        ck_assert_int_eq(kvq_text_read(path, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_KEEP, &t, &e), KVQ_EFORMAT);
        unlink(path);
    }
    ck_assert_msg(strstr(e.msg, "5 of its 4096 bytes") && strstr(e.msg, "0xff at offset 700"), "%s", e.msg);
    /* 4 bad bytes in 4096 (below 1 per mille): accepted, counted */
    d[700 + 97 * 4] = 'x';
    write_tmp("few.txt", (const char *)d, n, path, sizeof path);
    ck_assert_msg(kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(t.bad_bytes, 4);
    ck_assert_uint_eq(t.first_bad, 700);
    kvq_text_free(&t);
    unlink(path);
    free(d);
}
END_TEST

/* Every protocol x newline policy on a CRLF text with the tiny llama2.c tokenizer, against
 * tests/scripts/protocol_streams_reference.py (the tools' rules re-implemented in Python over the
 * file's bytes, with a literal port of run.c encode()): the exact string tokenised (bytes, sha256),
 * the stream's token count and the windows' ids (sha256), at ctx 64. */
START_TEST(test_protocol_streams_crlf)
{
    char b[4096];
    const char *tp = kvq_test_shared(b, sizeof b, "models/llama2c/aidreams-tok512.bin");
    KVQ_SKIP_IF(!tp, "../shared/models/llama2c absent");
    static const char fx[] = "tests/fixtures/protocol_streams.txt", sample[] = "tests/fixtures/crlf_sample.txt";
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_llama2c(tp, 512, &tok, &e) == KVQ_OK, "%s", e.msg);
    char v[256], key[128], hex[65];
    fixture_get_from(fx, "ctx", v, sizeof v);
    const size_t ctx = (size_t)atol(v);
    static const kvq_ppl_protocol protos[2] = {KVQ_PPL_LLAMACPP, KVQ_PPL_KVQUANT};
    static const kvq_eol_mode eols[2] = {KVQ_EOL_KEEP, KVQ_EOL_TO_LF};
    ck_assert_int_eq(kvq_ppl_default_eol(KVQ_PPL_LLAMACPP), KVQ_EOL_KEEP);
    ck_assert_int_eq(kvq_ppl_default_eol(KVQ_PPL_KVQUANT), KVQ_EOL_TO_LF);
    for (int pi = 0; pi < 2; pi++)
        for (int ei = 0; ei < 2; ei++) {
            kvq_text t;
            kvq_windows w;
            ck_assert_msg(kvq_text_read(sample, KVQ_TEXT_RAW, eols[ei], &t, &e) == KVQ_OK, "%s", e.msg);
            fixture_get_from(fx, "file_sha256", v, sizeof v);
            ck_assert_str_eq(t.file_sha256, v);
            fixture_get_from(fx, "file_crlf", v, sizeof v);
            ck_assert_uint_eq(t.crlf_in_file, (size_t)atol(v));
            ck_assert_uint_eq(t.crlf_replaced, eols[ei] == KVQ_EOL_TO_LF ? (size_t)atol(v) : 0);
            ck_assert_msg(kvq_ppl_windows(&t, tok, protos[pi], ctx, KVQ_BOS_MODEL, &w, &e) == KVQ_OK, "%s", e.msg);
            const char *pn = protos[pi] == KVQ_PPL_LLAMACPP ? "llamacpp" : "kvquant", *en = kvq_eol_name(eols[ei]);
            ck_assert_int_eq(w.eol, eols[ei]);
            ck_assert_int_eq(w.bos, 1); /* llama2.c: BOS always */
            ck_assert_int_eq(w.final_lf_dropped, protos[pi] == KVQ_PPL_LLAMACPP);
            snprintf(key, sizeof key, "%s_%s_text_bytes", pn, en);
            fixture_get_from(fx, key, v, sizeof v);
            ck_assert_msg(w.text_bytes == (uint64_t)atoll(v), "%s: %llu bytes tokenised, reference %s", key,
                          (unsigned long long)w.text_bytes, v);
            snprintf(key, sizeof key, "%s_%s_text_sha256", pn, en);
            fixture_get_from(fx, key, v, sizeof v);
            ck_assert_msg(!strcmp(w.text_sha256, v), "%s: %s, reference %s", key, w.text_sha256, v);
            snprintf(key, sizeof key, "%s_%s_tokens", pn, en);
            fixture_get_from(fx, key, v, sizeof v);
            ck_assert_msg(w.n_tokens == (size_t)atol(v), "%s: %zu, reference %s", key, w.n_tokens, v);
            snprintf(key, sizeof key, "%s_%s_windows", pn, en);
            fixture_get_from(fx, key, v, sizeof v);
            ck_assert_uint_eq(w.n_windows, (size_t)atol(v));
            ids_sha(w.tokens, w.n_windows * ctx, hex);
            snprintf(key, sizeof key, "%s_%s_windows_sha256", pn, en);
            fixture_get_from(fx, key, v, sizeof v);
            ck_assert_msg(!strcmp(hex, v), "%s: %s, reference %s", key, hex, v);
            if (protos[pi] == KVQ_PPL_LLAMACPP)
                for (size_t i = 0; i < w.n_windows; i++) ck_assert_int_eq(w.tokens[i * ctx], 1);
            /* the same stream whole, before windowing (BOS at its start only) */
            {
                int32_t *ids;
                size_t n;
                char *joined = NULL;
                const char *s0 = t.data;
                size_t sl = t.len;
                if (protos[pi] == KVQ_PPL_KVQUANT) { /* "\n\n".join(rows) */
                    joined = malloc(t.len + 2 * t.n_rows + 1);
                    ck_assert_ptr_nonnull(joined);
                    sl = 0;
                    for (size_t r = 0; r < t.n_rows; r++) {
                        if (r) { joined[sl++] = '\n'; joined[sl++] = '\n'; }
                        memcpy(joined + sl, t.rows_base + t.row_off[r], t.row_len[r]);
                        sl += t.row_len[r];
                    }
                    s0 = joined;
                } else if (sl && s0[sl - 1] == '\n') {
                    sl--;
                }
                ck_assert(kvq_tokenizer_encode(tok, s0, sl, KVQ_TOK_ADD_BOS, &ids, &n, &e) == KVQ_OK);
                ids_sha(ids, n, hex);
                snprintf(key, sizeof key, "%s_%s_stream_sha256", pn, en);
                fixture_get_from(fx, key, v, sizeof v);
                ck_assert_msg(!strcmp(hex, v), "%s: %s, reference %s", key, hex, v);
                free(ids);
                free(joined);
            }
            const size_t nt = w.n_tokens;
            kvq_windows_free(&w);
            /* llama-perplexity refuses fewer than 2 x ctx tokens; so does the llamacpp protocol (one window
             * of n/2 + 1 tokens would fit; kvquant takes it) */
            ck_assert_int_eq(kvq_ppl_windows(&t, tok, protos[pi], nt / 2 + 1, KVQ_BOS_MODEL, &w, &e),
                             protos[pi] == KVQ_PPL_LLAMACPP ? KVQ_EFORMAT : KVQ_OK);
            if (protos[pi] == KVQ_PPL_LLAMACPP)
                ck_assert_msg(strstr(e.msg, "needs at least 2 x ctx") && strstr(e.msg, "llama-perplexity"), "%s", e.msg);
            else
                kvq_windows_free(&w);
            kvq_text_free(&t);
        }
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
    tcase_add_test(tc, test_protocol_streams_crlf);
    tcase_add_test(tc, test_not_text_refused);
    tcase_add_test(tc, test_wikitext_tokens_file);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
