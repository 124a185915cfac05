/* test_tokenizer.c — tokenizers against independent references:
 *  - llama.cpp conformance files (../shared/tokenizer-conformance: llama-spm,
 *    gpt-2, starcoder; every case must match),
 *  - the default model's vocabulary (SmolLM2, pre "smollm") against ids from
 *    the HF `tokenizers` package (tests/fixtures/smollm2_tok.txt, made by
 *    tests/scripts/make_smollm2_tok_fixture.py),
 *  - HF tokenizer.json files (tests/fixtures/hf_mini_tokenizer.json: byte-level
 *    with digits; hf_metaspace_tokenizer.json: Llama-2 style) against the same
 *    package's ids,
 *  - the llama2.c aidreams tokenizer (ids checked by hand against run.c's rules),
 *  - decode round trips, special tokens, bad input, fuzz regressions. */
#include <dirent.h>
#include <stdint.h>

#include "kvq_test.h"
#include "tokenizer.h"
#include "fuzz/fuzz_common.h"

/* Parse whitespace-separated ints of one line into ids; returns count. */
static size_t parse_ids(const char *line, size_t len, int32_t *ids, size_t cap)
{
    size_t k = 0, i = 0;
    while (i < len) {
        while (i < len && (line[i] == ' ' || line[i] == '\t')) i++;
        if (i >= len) break;
        char *end;
        long v = strtol(line + i, &end, 10);
        ck_assert_msg(end != line + i, "bad id list");
        ck_assert_uint_lt(k, cap);
        ids[k++] = (int32_t)v;
        i = (size_t)(end - line);
    }
    return k;
}

static void check_ids(const kvq_tokenizer *tok, const char *what, int idx, const char *s, size_t sl, unsigned flags,
                      const int32_t *want, size_t nwant)
{
    kvq_err e = {0};
    int32_t *ids;
    size_t n;
    ck_assert_msg(kvq_tokenizer_encode(tok, s, sl, flags, &ids, &n, &e) == KVQ_OK, "%s", e.msg);
    int ok = n == nwant && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
    if (!ok) {
        fprintf(stderr, "%s case %d \"%.*s\": got", what, idx, (int)sl, s);
        for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n   want");
        for (size_t i = 0; i < nwant; i++) fprintf(stderr, " %d", want[i]);
        fprintf(stderr, "\n");
    }
    ck_assert_msg(ok, "%s case %d mismatch", what, idx);
    /* decode round trip (these inputs are valid UTF-8 without special tokens) */
    char *txt;
    size_t tl;
    ck_assert_msg(kvq_tokenizer_decode(tok, ids, n, 0, &txt, &tl, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(tl == sl && memcmp(txt, s, sl) == 0, "%s case %d: decode gives \"%s\"", what, idx, txt);
    free(txt);
    free(ids);
}

static void run_conformance(const char *name, const char *expect_desc)
{
    char b1[4096], b2[4096], b3[4096], rel[256];
    snprintf(rel, sizeof rel, "tokenizer-conformance/ggml-vocab-%s.gguf", name);
    const char *g = kvq_test_shared(b1, sizeof b1, rel);
    if (!g) { kvq_test_skip_missing(name, "conformance: ../shared/tokenizer-conformance absent"); return; }
    snprintf(rel, sizeof rel, "tokenizer-conformance/ggml-vocab-%s.gguf.inp", name);
    const char *inp = kvq_test_shared(b2, sizeof b2, rel);
    snprintf(rel, sizeof rel, "tokenizer-conformance/ggml-vocab-%s.gguf.out", name);
    const char *outp = kvq_test_shared(b3, sizeof b3, rel);
    ck_assert(inp && outp);
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_gguf(g, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), expect_desc);
    size_t ni, no;
    char *in = kvq_test_slurp(inp, &ni), *out = kvq_test_slurp(outp, &no);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    const char *p = in, *q = out;
    int cases = 0;
    int32_t want[4096];
    for (;;) {
        const char *end = strstr(p, sep);
        if (!end) break;
        const char *nl = strchr(q, '\n');
        ck_assert_ptr_nonnull(nl);
        size_t nw = parse_ids(q, (size_t)(nl - q), want, 4096);
        check_ids(tok, name, cases, p, (size_t)(end - p), 0, want, nw);
        cases++;
        p = end + strlen(sep);
        q = nl + 1;
    }
    ck_assert_int_eq(cases, 46);
    ck_assert_uint_eq((size_t)(p - in), ni); /* consumed the whole file */
    free(in);
    free(out);
    kvq_tokenizer_free(tok);
}

START_TEST(test_conformance_llama_spm) { run_conformance("llama-spm", "gguf llama/default vocab 32000"); }
END_TEST
START_TEST(test_conformance_gpt2) { run_conformance("gpt-2", "gguf gpt2/gpt-2 vocab 50257 merges 50000"); }
END_TEST
START_TEST(test_conformance_starcoder) { run_conformance("starcoder", "gguf gpt2/starcoder vocab 49152 merges 48872"); }
END_TEST


/* Fixture lines: MODE \t hex(input) \t ids ; MODE P = parse special tokens. */
static int run_fixture(const kvq_tokenizer *tok, const char *fixture)
{
    size_t n;
    char *d = kvq_test_slurp(fixture, &n);
    ck_assert_msg(d != NULL, "fixture %s missing", fixture);
    int cases = 0;
    char *save = NULL;
    for (char *line = strtok_r(d, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *t1 = strchr(line, '\t');
        ck_assert_ptr_nonnull(t1);
        char *t2 = strchr(t1 + 1, '\t');
        ck_assert_ptr_nonnull(t2);
        size_t hl = (size_t)(t2 - t1 - 1);
        char *txt = malloc(hl / 2 + 1);
        for (size_t i = 0; i < hl / 2; i++) {
            unsigned v;
            ck_assert_int_eq(sscanf(t1 + 1 + 2 * i, "%2x", &v), 1);
            txt[i] = (char)v;
        }
        int32_t want[1024];
        size_t nw = parse_ids(t2 + 1, strlen(t2 + 1), want, 1024);
        unsigned flags = line[0] == 'P' ? KVQ_TOK_PARSE_SPECIAL : 0;
        kvq_err e = {0};
        int32_t *ids;
        size_t ni;
        ck_assert_msg(kvq_tokenizer_encode(tok, txt, hl / 2, flags, &ids, &ni, &e) == KVQ_OK, "%s", e.msg);
        int ok = ni == nw && (ni == 0 || !memcmp(ids, want, ni * sizeof *ids));
        if (!ok) {
            fprintf(stderr, "%s case %d (%c) \"%.*s\": got", fixture, cases, line[0], (int)(hl / 2), txt);
            for (size_t i = 0; i < ni; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n   want %s\n", t2 + 1);
        }
        ck_assert_msg(ok, "%s case %d mismatch", fixture, cases);
        char *back;
        size_t bl;
        ck_assert(kvq_tokenizer_decode(tok, ids, ni, KVQ_TOK_DECODE_SPECIAL, &back, &bl, &e) == KVQ_OK);
        ck_assert_msg(bl == hl / 2 && !memcmp(back, txt, bl), "%s case %d: round trip gives \"%s\"", fixture, cases, back);
        free(back);
        free(ids);
        free(txt);
        cases++;
    }
    free(d);
    return cases;
}

START_TEST(test_smollm2_fixture)
{
    const char *m = kvq_test_model();
    KVQ_SKIP_IF(!m, "default model absent (run scripts/fetch_model.sh)");
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_gguf(m, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), "gguf gpt2/smollm vocab 49152 merges 48900");
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), 2);
    ck_assert(!kvq_tokenizer_add_bos_default(tok));
    ck_assert_int_eq(run_fixture(tok, "tests/fixtures/smollm2_tok.txt"), 24);
    /* the special-token switch: "<|im_start|>" is one token only when asked */
    int32_t *ids;
    size_t n;
    ck_assert(kvq_tokenizer_encode(tok, "<|im_start|>", 12, KVQ_TOK_PARSE_SPECIAL, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(ids[0], 1);
    free(ids);
    ck_assert(kvq_tokenizer_encode(tok, "<|im_start|>", 12, 0, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_gt(n, 1);
    free(ids);
    /* BOS flags: explicit vs metadata default (SmolLM2: add_bos_token = false) */
    ck_assert(kvq_tokenizer_encode(tok, "Hi", 2, KVQ_TOK_ADD_BOS_DEFAULT, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert_int_ne(ids[0], 1);
    free(ids);
    ck_assert(kvq_tokenizer_encode(tok, "Hi", 2, KVQ_TOK_ADD_BOS | KVQ_TOK_ADD_EOS, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_eq(n, 3);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[2], 2);
    /* decode drops control tokens unless asked */
    char *txt;
    size_t tl;
    ck_assert(kvq_tokenizer_decode(tok, ids, n, 0, &txt, &tl, &e) == KVQ_OK);
    ck_assert_str_eq(txt, "Hi");
    free(txt);
    ck_assert(kvq_tokenizer_decode(tok, ids, n, KVQ_TOK_DECODE_SPECIAL, &txt, &tl, &e) == KVQ_OK);
    ck_assert_str_eq(txt, "<|im_start|>Hi<|im_end|>");
    free(txt);
    free(ids);
    kvq_tokenizer_free(tok);
}
END_TEST

START_TEST(test_hf_json_mini)
{
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_hf_json("tests/fixtures/hf_mini_tokenizer.json", &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), "hf-json bytelevel/digits vocab 3000 merges 2748");
    ck_assert_int_eq(run_fixture(tok, "tests/fixtures/hf_mini_tok.txt"), 24);
    kvq_tokenizer_free(tok);
    /* kvq_tokenizer_load picks the loader by content */
    ck_assert_msg(kvq_tokenizer_load("tests/fixtures/hf_mini_tokenizer.json", &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_n_vocab(tok), 3000);
    kvq_tokenizer_free(tok);
    /* Llama-2 style: Prepend/Replace normalizer, byte_fallback, <s> template */
    ck_assert_msg(kvq_tokenizer_from_hf_json("tests/fixtures/hf_metaspace_tokenizer.json", &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), "hf-json metaspace vocab 271 merges 8");
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert(kvq_tokenizer_add_bos_default(tok));
    ck_assert_int_eq(run_fixture(tok, "tests/fixtures/hf_metaspace_tok.txt"), 7);
    int32_t *ids;
    size_t n;
    ck_assert(kvq_tokenizer_encode(tok, "ab", 2, KVQ_TOK_ADD_BOS_DEFAULT, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_eq(n, 2); /* tokenizers: encode("ab").ids == [1, 265] */
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[1], 265);
    free(ids);
    kvq_tokenizer_free(tok);
}
END_TEST

/* llama2.c aidreams tokenizer: "Once upon a time" with BOS. The expected ids
 * follow run.c encode(): BOS, then the dummy-prefix " Once upon a time" merged
 * by best score (this small vocabulary has no "▁Once", so it stays in pieces). */
/* A GGUF vocabulary whose BOS id is out of range: the error names the key and the value the file
 * holds (it printed the vocabulary size, the value clamped before the message) */
START_TEST(test_gguf_special_id_range)
{
    char b[4096];
    const char *p = kvq_test_shared(b, sizeof b, "tokenizer-conformance/ggml-vocab-llama-spm.gguf");
    KVQ_SKIP_IF(!p, "../shared/tokenizer-conformance absent");
    size_t n = 0;
    unsigned char *d = kvq_test_slurp(p, &n);
    ck_assert_ptr_nonnull(d);
    static const char key[] = "tokenizer.ggml.bos_token_id";
    unsigned char *at = memmem(d, n, key, sizeof key - 1);
    ck_assert_ptr_nonnull(at);
    uint32_t type, bad = 99999999u;
    memcpy(&type, at + sizeof key - 1, 4);
    ck_assert_uint_eq(type, 4); /* GGUF_TYPE_UINT32, then the value */
    memcpy(at + sizeof key - 1 + 4, &bad, 4);
    char tp[128];
    snprintf(tp, sizeof tp, "/tmp/kvq_test_tok_bos_%ld.gguf", (long)getpid());
    FILE *f = fopen(tp, "wb");
    ck_assert(f && fwrite(d, 1, n, f) == n);
    fclose(f);
    free(d);
    kvq_tokenizer *tok = NULL;
    kvq_err e = {0};
    ck_assert_int_eq(kvq_tokenizer_from_gguf(tp, &tok, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, tp) && strstr(e.msg, "tokenizer.ggml.bos_token_id 99999999: id out of range [0, 32000)"), "%s", e.msg);
    ck_assert_ptr_null(tok);
    unlink(tp);
}
END_TEST

START_TEST(test_llama2c_aidreams)
{
    char b[4096];
    const char *p = kvq_test_shared(b, sizeof b, "models/llama2c/aidreams-tok512.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_from_llama2c(p, 512, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), "llama2c spm vocab 512");
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), 2);
    /* vocabulary against the model's embedding rows: a llama2.c tokenizer has exactly one record per
     * row (a truncated file or another model's used to run with its ids, exit 0); fewer rows than
     * tokens are a mismatch for any tokenizer */
    ck_assert_int_eq(kvq_tokenizer_check_vocab(tok, 512, p, &e), KVQ_OK);
    ck_assert_int_eq(kvq_tokenizer_check_vocab(tok, 513, p, &e), KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, p) && strstr(e.msg, "llama2.c tokenizer has 512 token records, the model's vocab_size is 513"), "%s",
                  e.msg);
    ck_assert_int_eq(kvq_tokenizer_check_vocab(tok, 511, p, &e), KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, p) && strstr(e.msg, "tokenizer has 512 tokens, the model's vocabulary only 511: wrong --tokenizer?"), "%s", e.msg);
    /* any other tokenizer covers at least 90% of the rows (models pad a few): a GGUF vocabulary */
    {
        char g[4096];
        kvq_tokenizer *gt = NULL;
        if (kvq_test_shared(g, sizeof g, "tokenizer-conformance/ggml-vocab-llama-spm.gguf") &&
            kvq_tokenizer_from_gguf(g, &gt, &e) == KVQ_OK) {
            const int32_t nv = kvq_tokenizer_n_vocab(gt);
            ck_assert_int_eq(kvq_tokenizer_check_vocab(gt, nv, g, &e), KVQ_OK);
            ck_assert_int_eq(kvq_tokenizer_check_vocab(gt, nv + 64, g, &e), KVQ_OK);          /* padded rows */
            ck_assert_int_eq(kvq_tokenizer_check_vocab(gt, (int32_t)(nv / 0.9), g, &e), KVQ_OK); /* 90% */
            ck_assert_int_eq(kvq_tokenizer_check_vocab(gt, (int32_t)(nv / 0.9) + 2, g, &e), KVQ_EMISMATCH);
            ck_assert_msg(strstr(e.msg, g) && strstr(e.msg, "another model's --tokenizer?"), "%s", e.msg);
            kvq_tokenizer_free(gt);
        } else {
            kvq_test_skip_missing(__func__, "the 90% rule: ../shared/tokenizer-conformance/ggml-vocab-llama-spm.gguf absent");
        }
    }
    int32_t *ids;
    size_t n;
    const char *s = "Once upon a time";
    ck_assert(kvq_tokenizer_encode(tok, s, strlen(s), KVQ_TOK_ADD_BOS_DEFAULT, &ids, &n, &e) == KVQ_OK);
    fprintf(stderr, "aidreams \"Once upon a time\":");
    for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
    /* reference: a literal Python port of llama2.c run.c encode() over the same file */
    static const int32_t want[] = {1, 429, 491, 433, 295, 429, 444, 445, 265, 262, 263, 342, 430};
    ck_assert_uint_eq(n, sizeof want / sizeof *want);
    ck_assert(!memcmp(ids, want, sizeof want));
    /* concatenated token texts give "▁Once▁upon▁a▁time" */
    char cat[256] = "";
    for (size_t i = 1; i < n; i++) {
        size_t l;
        const char *tt = kvq_tokenizer_token_text(tok, ids[i], &l);
        strncat(cat, tt, l);
    }
    ck_assert_str_eq(cat, "\xe2\x96\x81Once\xe2\x96\x81upon\xe2\x96\x81" "a\xe2\x96\x81time");
    char *txt;
    size_t tl;
    ck_assert(kvq_tokenizer_decode(tok, ids, n, 0, &txt, &tl, &e) == KVQ_OK);
    ck_assert_str_eq(txt, s);
    free(txt);
    free(ids);
    /* a character outside the vocabulary goes to byte tokens <0xNN> = id 3 + byte (run.c) */
    ck_assert(kvq_tokenizer_encode(tok, "\xc3\xa9", 2, 0, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_ge(n, 2);
    ck_assert_int_eq(ids[n - 2], 3 + 0xc3);
    ck_assert_int_eq(ids[n - 1], 3 + 0xa9);
    ck_assert(kvq_tokenizer_decode(tok, ids, n, 0, &txt, &tl, &e) == KVQ_OK);
    ck_assert_str_eq(txt, "\xc3\xa9");
    free(txt);
    free(ids);
    kvq_tokenizer_free(tok);
    /* kvq_tokenizer_load infers the vocab size */
    ck_assert_msg(kvq_tokenizer_load(p, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_n_vocab(tok), 512);
    kvq_tokenizer_free(tok);
}
END_TEST

/* path: the caller's buffer, "" at first; the file it named before (if any) is removed first, so that one
 * unlink(path) at the end leaves nothing behind */
static const char *tmpfile_with(const char *name, const void *data, size_t n, char *path, size_t pn)
{
    if (path[0]) unlink(path);
    snprintf(path, pn, "/tmp/kvq_test_tok_%d_%s", (int)getpid(), name);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    if (n) ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    fclose(f);
    return path;
}

/* Invalid UTF-8, NUL bytes, empty text: never an error, lossless where documented. */
START_TEST(test_bad_text)
{
    static const char *names[3] = {"gpt-2", "starcoder", "llama-spm"};
    static const char odd[] = "\xff\x00 a\xc3(\xe2\x82 \xf0\x9f\x98\x01\xed\xa0\x80z\x00\x00 \xc0\xaf";
    for (int v = 0; v < 3; v++) {
        char b[4096], rel[256];
        snprintf(rel, sizeof rel, "tokenizer-conformance/ggml-vocab-%s.gguf", names[v]);
        const char *g = kvq_test_shared(b, sizeof b, rel);
        KVQ_SKIP_IF(!g, "../shared/tokenizer-conformance absent");
        kvq_tokenizer *tok;
        kvq_err e = {0};
        ck_assert(kvq_tokenizer_from_gguf(g, &tok, &e) == KVQ_OK);
        int32_t *ids;
        size_t n;
        /* empty text: no tokens; with BOS only BOS */
        ck_assert(kvq_tokenizer_encode(tok, "", 0, 0, &ids, &n, &e) == KVQ_OK);
        ck_assert_uint_eq(n, 0);
        free(ids);
        ck_assert(kvq_tokenizer_encode(tok, NULL, 0, KVQ_TOK_ADD_BOS, &ids, &n, &e) == KVQ_OK);
        ck_assert_uint_eq(n, 1);
        ck_assert_int_eq(ids[0], kvq_tokenizer_bos(tok));
        free(ids);
        ck_assert(kvq_tokenizer_encode(tok, odd, sizeof odd - 1, 0, &ids, &n, &e) == KVQ_OK);
        char *txt;
        size_t tl;
        ck_assert(kvq_tokenizer_decode(tok, ids, n, 0, &txt, &tl, &e) == KVQ_OK);
        if (v != 1) ck_assert(tl == sizeof odd - 1 && !memcmp(txt, odd, tl)); /* lossless */
        else {
            /* StarCoder has no token for 0xFF (never valid UTF-8): <unk> (= id 0) stands for it */
            ck_assert_int_eq(kvq_tokenizer_byte_token(tok, 0xff), -1);
            ck_assert_int_eq(ids[0], 0);
        }
        if (v == 2) { /* SPM: the "▁" prefix alone (nothing merges with an invalid byte), then <0xFF> */
            ck_assert_int_eq(ids[0], 29871);
            ck_assert_int_eq(ids[1], 3 + 0xff);
            ck_assert_int_eq(ids[2], 3 + 0x00);
        }
        free(txt);
        /* an id out of range is a clear decode error */
        int32_t badid[2] = {5, kvq_tokenizer_n_vocab(tok)};
        ck_assert(kvq_tokenizer_decode(tok, badid, 2, 0, &txt, &tl, &e) == KVQ_EINVAL);
        ck_assert_ptr_nonnull(strstr(e.msg, "ids[1]"));
        free(ids);
        kvq_tokenizer_free(tok);
    }
}
END_TEST

/* Vocabulary defects: clear errors or the documented first-id-wins rule. */
START_TEST(test_bad_vocab)
{
    char path[512] = "";
    kvq_tokenizer *tok;
    kvq_err e = {0};
    const char *nomerges = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    tmpfile_with("nomerges.json", nomerges, strlen(nomerges), path, sizeof path);
    ck_assert(kvq_tokenizer_from_hf_json(path, &tok, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "model.merges"));
    const char *badmerge = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\", \"a c\"]},"
                           " \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    tmpfile_with("badmerge.json", badmerge, strlen(badmerge), path, sizeof path);
    ck_assert(kvq_tokenizer_from_hf_json(path, &tok, &e) == KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "model.merges[1]") && strstr(e.msg, "right part"), "%s", e.msg);
    /* ids far beyond the entries (fuzzer: id 2e8 among a few entries allocated 1.6 GB): refused, in
     * model.vocab and in added_tokens; a few holes stay allowed */
    const char *sparse[2] = {
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 200000000}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"},"
        " \"added_tokens\": [{\"id\": 1030, \"content\": \"<x>\"}]}"};
    for (int i = 0; i < 2; i++) {
        tmpfile_with("sparse.json", sparse[i], strlen(sparse[i]), path, sizeof path);
        ck_assert(kvq_tokenizer_from_hf_json(path, &tok, &e) == KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, i ? "id 1030 for 3 entries" : "id 200000000 for 2 entries") &&
                          strstr(e.msg, i ? "below 1030" : "below 1028"),
                      "%s", e.msg);
    }
    const char *holes = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"},"
                        " \"added_tokens\": [{\"id\": 1026, \"content\": \"<x>\"}]}";
    tmpfile_with("holes.json", holes, strlen(holes), path, sizeof path);
    ck_assert_msg(kvq_tokenizer_from_hf_json(path, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_n_vocab(tok), 1027);
    kvq_tokenizer_free(tok);
    /* files of other kinds given as a tokenizer are named (they got a record-length message about their
     * bytes: "token 0: length 526338 (expected 1..1178880137 ...)" for a dump) */
    struct {
        const char *file, *needle;
    } foreign[] = {
        {"tests/fixtures/dump_small.h5", "an HDF5 file (a kvdump dump?), not a tokenizer"},
        {"tests/fixtures/st_fixture.safetensors", "a safetensors file (weights?), not a tokenizer"},
    };
    for (size_t i = 0; i < sizeof foreign / sizeof *foreign; i++) {
        ck_assert(kvq_tokenizer_load(foreign[i].file, &tok, &e) == KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, foreign[i].file) && strstr(e.msg, foreign[i].needle), "%s", e.msg);
        ck_assert(kvq_tokenizer_from_llama2c(foreign[i].file, 0, &tok, &e) == KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, foreign[i].needle), "%s", e.msg);
    }
    ck_assert(kvq_tokenizer_from_llama2c("tests/fixtures/tiny_llama.gguf", 0, &tok, &e) == KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "a GGUF file"), "%s", e.msg);
    const unsigned char hugemax[16] = {0x70, 0x11, 0x01, 0, 0, 0, 0, 0, 1, 0, 0, 0, 'a', 'b', 'c', 'd'}; /* 70000 */
    tmpfile_with("hugemax.bin", (const char *)hugemax, sizeof hugemax, path, sizeof path);
    ck_assert(kvq_tokenizer_from_llama2c(path, 0, &tok, &e) == KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "max_token_length 70000 (expected at most 65536)"), "%s", e.msg);
    char ck[4096];
    if (kvq_test_shared(ck, sizeof ck, "models/llama2c/aidreams260K.bin")) {
        ck_assert(kvq_tokenizer_load(ck, &tok, &e) == KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, "a llama2.c model checkpoint (pass its tokenizer.bin), not a tokenizer"), "%s", e.msg);
    }
    const char *unigram = "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}";
    tmpfile_with("unigram.json", unigram, strlen(unigram), path, sizeof path);
    ck_assert(kvq_tokenizer_from_hf_json(path, &tok, &e) == KVQ_EUNSUPPORTED);
    /* not a regular file: refused at once (every loader: kvq_tokenizer_load sniffs the first bytes first) */
    ck_assert(kvq_tokenizer_load("/dev/zero", &tok, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/dev/zero: not a regular file (a character device; expected a tokenizer file)"), "%s", e.msg);
    ck_assert(kvq_tokenizer_from_hf_json("/dev/zero", &tok, &e) == KVQ_EIO);
    ck_assert(kvq_tokenizer_from_llama2c("/dev/zero", 0, &tok, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "not a regular file"), "%s", e.msg);
    ck_assert(kvq_tokenizer_load("/tmp", &tok, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/tmp: is a directory"), "%s", e.msg);
    tmpfile_with("broken.json", "{\"model\": {", 11, path, sizeof path);
    ck_assert(kvq_tokenizer_load(path, &tok, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "invalid JSON"));
    /* llama2.c file with a duplicate token text: first id wins, counted in describe() */
    unsigned char bin[256];
    size_t k = 0;
    uint32_t maxlen = 8;
    memcpy(bin, &maxlen, 4);
    k = 4;
    const char *texts[] = {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "b", "a", " a"};
    float scores[] = {0, 0, 0, -1, -2, -3, -4, -5};
    for (int i = 0; i < 8; i++) {
        int32_t l = (int32_t)strlen(texts[i]);
        memcpy(bin + k, &scores[i], 4);
        memcpy(bin + k + 4, &l, 4);
        memcpy(bin + k + 8, texts[i], (size_t)l);
        k += 8 + (size_t)l;
    }
    tmpfile_with("dup.bin", bin, k, path, sizeof path);
    ck_assert_msg(kvq_tokenizer_from_llama2c(path, 8, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_tokenizer_describe(tok), "llama2c spm vocab 8 duplicates 1");
    int32_t *ids;
    size_t n;
    ck_assert(kvq_tokenizer_encode(tok, "ab", 2, 0, &ids, &n, &e) == KVQ_OK);
    /* "▁ab": ▁a (id 7) then b; the duplicate "a" (id 6) is never produced */
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(ids[0], 7);
    ck_assert_int_eq(ids[1], 5);
    free(ids);
    /* no byte tokens: an unknown character becomes <unk> (id 0) */
    ck_assert(kvq_tokenizer_encode(tok, "c", 1, 0, &ids, &n, &e) == KVQ_OK);
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(ids[1], 0);
    free(ids);
    kvq_tokenizer_free(tok);
    /* asking for more tokens than the file has; truncated records */
    ck_assert(kvq_tokenizer_from_llama2c(path, 9, &tok, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "expected vocab_size 9"));
    tmpfile_with("trunc.bin", bin, k - 3, path, sizeof path);
    ck_assert(kvq_tokenizer_from_llama2c(path, 8, &tok, &e) == KVQ_EFORMAT);
    ck_assert_ptr_nonnull(strstr(e.msg, "token 7"));
    tmpfile_with("empty.bin", bin, 0, path, sizeof path);
    ck_assert(kvq_tokenizer_load(path, &tok, &e) == KVQ_EFORMAT);
    unlink(path);
}
END_TEST

/* Replay every saved fuzz input (tests/fixtures/fuzz/) through the fuzz step. */
START_TEST(test_fuzz_regressions)
{
    static const char *names[3] = {"gpt-2", "starcoder", "llama-spm"};
    kvq_tokenizer *toks[3];
    for (int v = 0; v < 3; v++) {
        char b[4096], rel[256];
        snprintf(rel, sizeof rel, "tokenizer-conformance/ggml-vocab-%s.gguf", names[v]);
        const char *g = kvq_test_shared(b, sizeof b, rel);
        KVQ_SKIP_IF(!g, "../shared/tokenizer-conformance absent");
        kvq_err e = {0};
        ck_assert(kvq_tokenizer_from_gguf(g, &toks[v], &e) == KVQ_OK);
    }
    DIR *d = opendir("tests/fixtures/fuzz");
    ck_assert_ptr_nonnull(d);
    int cnt = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char p[1024];
        snprintf(p, sizeof p, "tests/fixtures/fuzz/%s", de->d_name);
        size_t n;
        char *data = kvq_test_slurp(p, &n);
        ck_assert_ptr_nonnull(data);
        const char *bad = kvq_fuzz_one(toks, 3, (const uint8_t *)data, n);
        ck_assert_msg(bad == NULL, "%s: %s", p, bad);
        free(data);
        cnt++;
    }
    closedir(d);
    ck_assert_int_ge(cnt, 1);
    for (int v = 0; v < 3; v++) kvq_tokenizer_free(toks[v]);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("tokenizer");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_conformance_llama_spm);
    tcase_add_test(tc, test_conformance_gpt2);
    tcase_add_test(tc, test_conformance_starcoder);
    tcase_add_test(tc, test_smollm2_fixture);
    tcase_add_test(tc, test_hf_json_mini);
    tcase_add_test(tc, test_llama2c_aidreams);
    tcase_add_test(tc, test_gguf_special_id_range);
    tcase_add_test(tc, test_bad_text);
    tcase_add_test(tc, test_bad_vocab);
    tcase_add_test(tc, test_fuzz_regressions);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
