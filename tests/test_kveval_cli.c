/* test_kveval_cli.c — bin/kveval end to end on the tiny model: a successful
 * run (markdown table on stdout, JSON with the same numbers and the protocol
 * details) and every bad-input case of issue 7 (exit status + message, no
 * JSON left behind). Runs the built binary ($KVQ_BIN_DIR/kveval: bin, bin-cpu or bin-asan
 * ); skips when it or the tiny models are absent. */
#include <cjson/cJSON.h>
#include <math.h>
#include <sys/wait.h>

#include "kveval_util.h"
#include "kvq_test.h"
#include "identity.h"

typedef struct {
    char bin[64], model[4096], tok[4096], text[4096], other[4096];
    char dir[256];
} env_t;

static int env_init(env_t *e)
{
    if (!kvq_test_bin(e->bin, sizeof e->bin, "kveval")) return 0;
    if (!kvq_test_shared(e->model, sizeof e->model, "models/llama2c/stories260K.bin")) return 0;
    if (!kvq_test_shared(e->other, sizeof e->other, "models/llama2c/aidreams260K.bin")) return 0;
    if (!kvq_test_shared(e->tok, sizeof e->tok, "models/llama2c/aidreams-tok512.bin")) return 0;
    char src[4096];
    if (!kvq_test_shared(src, sizeof src, "datasets/wikitext-2/wiki.valid.tokens")) return 0;
    snprintf(e->dir, sizeof e->dir, "/tmp/kvq_test_kveval_cli_%ld", (long)getpid());
    char cmd[8500];
    snprintf(cmd, sizeof cmd, "mkdir -p %s && head -c 20000 %s > %s/text.tokens", e->dir, src, e->dir);
    ck_assert(system(cmd) == 0);
    snprintf(e->text, sizeof e->text, "%s/text.tokens", e->dir);
    return 1;
}

static void env_done(env_t *e)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", e->dir);
    ck_assert(system(cmd) == 0);
}

/* Run "bin args" with stdout/stderr captured into out/err (NUL-terminated, truncated). */
static int run(env_t *e, const char *args, char *out, size_t on, char *err, size_t en)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "%s %s > %s/out.txt 2> %s/err.txt", e->bin, args, e->dir, e->dir);
    int st = system(cmd);
    ck_assert(st != -1 && WIFEXITED(st));
    char p[512];
    const char *names[2] = {"out.txt", "err.txt"};
    char *bufs[2] = {out, err};
    size_t lens[2] = {on, en};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", e->dir, names[i]);
        FILE *f = fopen(p, "rb");
        size_t n = f ? fread(bufs[i], 1, lens[i] - 1, f) : 0;
        if (f) fclose(f);
        bufs[i][n] = 0;
    }
    return WEXITSTATUS(st);
}

static char *slurp(const char *path) { return kvq_test_slurp(path, NULL); }

START_TEST(test_cli_success)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "bin/kveval or ../shared tiny models/wikitext absent (run make all)");
    static char out[65536], err[65536];
    char args[16384];
    snprintf(args, sizeof args,
             "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 3 --scheme fp16 --scheme int4 --scheme kivi2-g4-r8 "
             "--json %s/r.json --quiet",
             e.model, e.tok, e.text, e.dir);
    int rc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    fprintf(stderr, "INFO kveval stdout:\n%s", out);
    ck_assert_msg(strstr(out, "| scheme | K bits | V bits | eff. bits/elem | KV cache MiB @64 | PPL | ΔPPL ± SE | mean KLD | median KLD | "
                              "p99 KLD | same top % |"),
                  "%s", out);
    ck_assert_msg(strstr(out, "| baseline | — | — | — | — |") && strstr(out, "standard error from the 3 windows' paired differences") &&
                      strstr(out, "KL(P_fp32 || Q_scheme)"),
                  "%s", out);
    ck_assert(strstr(out, "| fp32 | 32 | 32 | 32.00 |") && strstr(out, "baseline"));
    ck_assert(strstr(out, "| int4 | 4 | 4 | 5.00 |")); /* 4 + 32/32 (kv_dim 32) */
    ck_assert(strstr(out, "| kivi2-g4-r8 | 2 | 2 |"));
    ck_assert(strstr(out, "189 scored tokens"));
    ck_assert_msg(err[0] == 0, "--quiet printed: %s", err);
    char jp[512];
    snprintf(jp, sizeof jp, "%s/r.json", e.dir);
    char *js = slurp(jp);
    ck_assert(js);
    cJSON *root = cJSON_Parse(js);
    ck_assert(root);
    cJSON *proto = cJSON_GetObjectItem(root, "protocol");
    ck_assert_str_eq(cJSON_GetObjectItem(proto, "name")->valuestring, "kvquant");
    ck_assert_int_eq(cJSON_GetObjectItem(proto, "ctx")->valueint, 64);
    ck_assert_int_eq(cJSON_GetObjectItem(proto, "windows")->valueint, 3);
    ck_assert_int_eq(cJSON_GetObjectItem(proto, "scored_tokens")->valueint, 3 * 63);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(proto, "window_offsets")), 3);
    ck_assert(cJSON_IsTrue(cJSON_GetObjectItem(proto, "bos")));
    cJSON *text = cJSON_GetObjectItem(root, "text");
    ck_assert_int_eq(cJSON_GetObjectItem(text, "bytes")->valueint, 20000);
    ck_assert_int_eq((int)strlen(cJSON_GetObjectItem(text, "sha256")->valuestring), 64);
    cJSON *ss = cJSON_GetObjectItem(root, "schemes");
    ck_assert_int_eq(cJSON_GetArraySize(ss), 4);
    /* the table's PPL column is the JSON's ppl rounded */
    for (int i = 0; i < 4; i++) {
        cJSON *o = cJSON_GetArrayItem(ss, i);
        char row[256];
        snprintf(row, sizeof row, "| %s |", cJSON_GetObjectItem(o, "name")->valuestring);
        const char *line = strstr(out, row);
        ck_assert_msg(line, "row %s missing", row);
        char ppl[64];
        snprintf(ppl, sizeof ppl, "| %.4f |", cJSON_GetObjectItem(o, "ppl")->valuedouble);
        const char *eol = strchr(line, '\n');
        ck_assert(eol);
        char l[512];
        snprintf(l, sizeof l, "%.*s", (int)(eol - line), line);
        ck_assert_msg(strstr(l, ppl), "row '%s' lacks %s", l, ppl);
        ck_assert_int_eq(cJSON_GetObjectItem(o, "scored_tokens")->valueint, 189);
        /* ΔPPL ± SE, the KLD columns: the JSON's numbers as the table prints them */
        cJSON *k = cJSON_GetObjectItem(o, "kld");
        if (i == 0) {
            ck_assert(cJSON_IsNull(k) && cJSON_IsNull(cJSON_GetObjectItem(o, "delta_ppl_se")));
            continue;
        }
        char cell[160];
        snprintf(cell, sizeof cell, "| %+.4f ± %.4f | %.4g | %.4g | %.4g | %.2f |", cJSON_GetObjectItem(o, "delta_ppl")->valuedouble,
                 cJSON_GetObjectItem(o, "delta_ppl_se")->valuedouble, cJSON_GetObjectItem(k, "mean")->valuedouble,
                 cJSON_GetObjectItem(k, "median")->valuedouble, cJSON_GetObjectItem(k, "p99")->valuedouble,
                 100 * cJSON_GetObjectItem(k, "same_top_fraction")->valuedouble);
        ck_assert_msg(strstr(l, cell), "row '%s' lacks '%s'", l, cell);
        ck_assert_int_eq(cJSON_GetObjectItem(k, "tokens")->valueint, 189);
        ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(k, "window_mean")), 3);
        ck_assert(cJSON_GetObjectItem(k, "mean")->valuedouble > 0 && cJSON_GetObjectItem(k, "p99")->valuedouble >=
                                                                         cJSON_GetObjectItem(k, "median")->valuedouble);
        ck_assert(cJSON_GetObjectItem(o, "delta_mean_nll_se")->valuedouble > 0);
    }
    ck_assert(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 0), "baseline")));
    /* KV cache size at other contexts: an fp16 cache of a Llama-2-7B-shaped model
     * (32 layers x 32 KV heads x 128) holds 2 x 32 x 4096 x 2 B = 512 KiB per token:
     * exactly 1 GiB at 2K and 64 GiB at 128K; for this model at ctx 64 it equals kv_cache_mib */
    for (int i = 0; i < 4; i++) {
        cJSON *o = cJSON_GetArrayItem(ss, i);
        cJSON *at = cJSON_GetObjectItem(o, "kv_cache_mib_at");
        ck_assert_ptr_nonnull(at);
        double m2k = cJSON_GetObjectItem(cJSON_GetObjectItem(at, "model"), "2048")->valuedouble;
        const char *name = cJSON_GetObjectItem(o, "name")->valuestring;
        if (strncmp(name, "kivi", 4) != 0) /* no ctx-dependent terms (KIVI's residual window has) */
            ck_assert_double_eq_tol(m2k, cJSON_GetObjectItem(o, "kv_cache_mib")->valuedouble * 2048.0 / 64.0, 1e-9 * m2k);
        else
            ck_assert(m2k < cJSON_GetObjectItem(o, "kv_cache_mib")->valuedouble * 2048.0 / 64.0);
        if (!strcmp(cJSON_GetObjectItem(o, "name")->valuestring, "fp16")) {
            cJSON *l7 = cJSON_GetObjectItem(at, "llama2_7b");
            ck_assert_double_eq_tol(cJSON_GetObjectItem(l7, "2048")->valuedouble, 1024.0, 1e-9);
            ck_assert_double_eq_tol(cJSON_GetObjectItem(l7, "131072")->valuedouble, 65536.0, 1e-9);
        }
    }
    cJSON_Delete(root);
    free(js);

    /* the same run again: identical JSON numbers (timings aside) → identical table */
    static char out2[65536];
    snprintf(args, sizeof args,
             "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 3 --scheme fp16 --scheme int4 --scheme kivi2-g4-r8 -q",
             e.model, e.tok, e.text);
    ck_assert(run(&e, args, out2, sizeof out2, err, sizeof err) == 0);
    ck_assert_str_eq(out, out2);
    /* --json - : stdout is the JSON alone (it used to write a file named "-"), the table on stderr,
     * nothing at all on stderr with --quiet */
    for (int quiet = 1; quiet >= 0; quiet--) {
        snprintf(args, sizeof args,
                 "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 3 --scheme fp16 --scheme int4 --scheme kivi2-g4-r8 "
                 "--json -%s",
                 e.model, e.tok, e.text, quiet ? " -q" : "");
        ck_assert(run(&e, args, out2, sizeof out2, err, sizeof err) == 0);
        cJSON *r2 = cJSON_Parse(out2);
        ck_assert_msg(r2, "stdout is not JSON: %.300s", out2);
        ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(r2, "schemes")), 4);
        cJSON_Delete(r2);
        if (quiet) ck_assert_msg(err[0] == 0, "--quiet printed: %s", err);
        else ck_assert_msg(strstr(err, out), "stderr lacks the table:\n%s", err); /* the same table as on stdout above */
        char dash[600];
        snprintf(dash, sizeof dash, "%s/-", e.dir);
        ck_assert_msg(access(dash, F_OK) != 0 && access("-", F_OK) != 0, "a file named '-' was written");
    }

    /* llamacpp: second half scored */
    snprintf(args, sizeof args, "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 2 --protocol llamacpp --scheme fp16 -q",
             e.model, e.tok, e.text);
    ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
    ck_assert_msg(strstr(out, "62 scored tokens (31 per window, from position 32)"), "%s", out);
    ck_assert(strstr(out, "overwrites each window's first token"));

    /* newlines: each protocol's tool's default, recorded in the header and the JSON; --newlines changes the stream
     * (a CRLF text: tests/fixtures/crlf_sample.txt, 21 CRLF) */
    {
        char ppl[2][2][32];
        for (int pi = 0; pi < 2; pi++)
            for (int ni = 0; ni < 3; ni++) {
                const char *proto = pi ? "kvquant" : "llamacpp", *nl = ni == 0 ? "" : ni == 1 ? "--newlines keep" : "--newlines lf";
                snprintf(args, sizeof args,
                         "--model %s --tokenizer %s --text tests/fixtures/crlf_sample.txt --ctx 64 --max-windows 2 --protocol %s %s "
                         "--scheme int4 --json %s/nl.json -q",
                         e.model, e.tok, proto, nl, e.dir);
                rc = run(&e, args, out, sizeof out, err, sizeof err);
                ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
                const bool keep = ni == 1 || (ni == 0 && pi == 0);
                char want[128];
                snprintf(want, sizeof want, "- protocol: %s (newlines %s), ctx 64", proto, keep ? "keep" : "lf");
                ck_assert_msg(strstr(out, want), "%s: %s", want, out);
                ck_assert_msg(strstr(out, keep ? "21 CRLF kept; --newlines keep" : "21 CRLF turned into LF; --newlines lf"), "%s", out);
                ck_assert_msg(pi == 1 ? (strstr(out, "rows (") && strstr(out, "joined with \"\\n\\n\""))
                                      : strstr(out, "less the final LF, as llama-perplexity -f reads them") != NULL,
                              "%s", out);
                snprintf(jp, sizeof jp, "%s/nl.json", e.dir);
                js = slurp(jp);
                root = cJSON_Parse(js);
                ck_assert(root);
                ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "text"), "newlines")->valuestring, keep ? "keep" : "lf");
                ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "protocol"), "newlines")->valuestring,
                                 keep ? "keep" : "lf");
                ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "text"), "crlf_in_file")->valueint, 21);
                if (ni) snprintf(ppl[pi][ni - 1], sizeof ppl[pi][ni - 1], "%.6f",
                                 cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "schemes"), 0), "ppl")->valuedouble);
                cJSON_Delete(root);
                free(js);
            }
        for (int pi = 0; pi < 2; pi++) /* the line ends are scored: keep and lf differ */
            ck_assert_msg(strcmp(ppl[pi][0], ppl[pi][1]), "%s protocol: keep and lf scored the same (%s)", pi ? "kvquant" : "llamacpp",
                          ppl[pi][0]);
    }
    snprintf(args, sizeof args, "--model %s --tokenizer %s --text %s --ctx 64 --scheme int4 --newlines crlf", e.model, e.tok, e.text);
    ck_assert_int_eq(run(&e, args, out, sizeof out, err, sizeof err), 2);
    ck_assert_msg(strstr(err, "--newlines") && strstr(err, "keep|lf"), "%s", err);

    /* production formats on stories260K (head_dim 8): fp8 and e5m2 run (8 + 32/(64 x 32) bits); the llama.cpp block
     * formats do not apply (head_dim % 32 != 0) and are skipped with a message, the rest still runs */
    snprintf(args, sizeof args,
             "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 2 --scheme fp8 --scheme q4_0 --scheme e5m2 "
             "--scheme iq4_nl --json %s/p.json",
             e.model, e.tok, e.text, e.dir);
    rc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    fprintf(stderr, "INFO kveval production stdout:\n%s", out);
    ck_assert_msg(strstr(err, "skipping: scheme 'q4_0': head_dim 8 is not a multiple of the 32-value block") &&
                      strstr(err, "llama.cpp refuses") && strstr(err, "skipping: scheme 'iq4_nl'"),
                  "%s", err);
    ck_assert_msg(strstr(out, "| fp8 | 8 | 8 | 8.02 |") && strstr(out, "| e5m2 | 8 | 8 | 8.02 |") && !strstr(out, "| q4_0 |") &&
                      strstr(out, "- skipped: scheme 'q4_0'") && strstr(out, "- skipped: scheme 'iq4_nl'"),
                  "%s", out);
    snprintf(jp, sizeof jp, "%s/p.json", e.dir);
    js = slurp(jp);
    root = cJSON_Parse(js);
    ck_assert(root);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(root, "schemes")), 3);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(root, "skipped")), 2);
    cJSON_Delete(root);
    free(js);

    snprintf(args, sizeof args, "--help");
    ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
    ck_assert(strstr(out, "--scheme") && strstr(out, "--max-windows"));
    env_done(&e);
}
END_TEST

typedef struct {
    const char *what, *args, *needle;
    int rc;
} bad_case;

START_TEST(test_cli_errors)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "bin/kveval or ../shared tiny models/wikitext absent (run make all)");
    /* artifacts: one for aidreams (another model), one for stories, one with a too-new schema */
    kvq_err ke = {0};
    char a_other[512], a_ok[512], a_new[512], small[512];
    snprintf(a_other, sizeof a_other, "%s/other.safetensors", e.dir);
    snprintf(a_ok, sizeof a_ok, "%s/ok.safetensors", e.dir);
    snprintf(a_new, sizeof a_new, "%s/new.safetensors", e.dir);
    snprintf(small, sizeof small, "%s/small.txt", e.dir);
    const char *mp[2] = {e.other, e.model};
    const char *ap[2] = {a_other, a_ok};
    for (int i = 0; i < 2; i++) {
        kvq_model m;
        ck_assert(kvq_model_load(mp[i], &m, &ke) == KVQ_OK);
        char fp[65];
        ck_assert(kvq_identity_model(&m, fp, &ke) == KVQ_OK);
        int tok[2 * 32];
        for (int t = 0; t < 64; t++) tok[t] = (t * 37 + 11) % m.hp.vocab_size;
        ck_assert_msg(kvq_util_make_nuq_artifact(&m, tok, 2, 32, 3, 0.01, 0, false, fp, ap[i], &ke) == KVQ_OK, "%s", ke.msg);
        kvq_model_free(&m);
    }
    char *bytes = slurp(a_ok);
    FILE *f = fopen(a_ok, "rb");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    char *hit = memmem(bytes, (size_t)n, "\"kvq.schema_version\":\"1\"", 24);
    ck_assert_msg(hit, "schema_version not found in the artifact header");
    hit[22] = '9';
    f = fopen(a_new, "wb");
    ck_assert(fwrite(bytes, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    free(bytes);
    f = fopen(small, "wb");
    fputs(" = Tiny = \n\n hello world \n", f);
    fclose(f);

    char base[16384];
    snprintf(base, sizeof base, "--model %s --tokenizer %s --ctx 64 --max-windows 1 -q", e.model, e.tok);
    char tx[4200];
    snprintf(tx, sizeof tx, "--text %s", e.text);
    char sm[600];
    snprintf(sm, sizeof sm, "--text %s", small);
    char ao[600], ak[600], an[600];
    snprintf(ao, sizeof ao, "--artifact %s", a_other);
    snprintf(ak, sizeof ak, "--artifact %s", a_ok);
    snprintf(an, sizeof an, "--artifact %s", a_new);
    struct {
        const char *what, *a1, *a2, *needle;
        int rc;
    } cases[] = {
        {"unknown scheme", tx, "--scheme int4 --scheme q3_0", "unknown scheme 'q3_0'", 2},
        {"fp8 scales need an artifact", tx, "--scheme fp8-head", "method fp8 with E4M3FN per-KV-head scales", 1},
        {"unknown scheme lists valid", tx, "--scheme zz", "kivi<b>[-g<G>][-r<R>]", 2},
        {"no scheme", tx, "", "missing required option --scheme", 2},
        {"needs artifact", tx, "--scheme nuq3-1%", "needs a kvcalib artifact of method nuq with 3 bits and 1% outliers; none given", 1},
        {"no match", tx, "--scheme nuq2-1%", "none of the 1 given matches", 1},
        {"another model", tx, "--scheme nuq3-1%", "calibrated for another model", 1},
        {"schema too new", tx, "--scheme int4", "newer than this build supports", 1},
        {"ctx above model", tx, "--scheme int4 --ctx 4096", "exceeds the context length", 2},
        {"text too short", sm, "--scheme int4", "fewer than one window", 1},
        {"intactkv without prefix", tx, "--scheme nuq3-1%+intactkv", "IntactKV prefix", 1},
        {"missing text", "--text /nonexistent/x.txt", "--scheme int4", "--text /nonexistent/x.txt: cannot open", 1}, /* before the model load */
        {"bad option value", tx, "--scheme int4 --ctx 12x", "--ctx: expected an integer", 2},
        /* schemes that quantize nothing in the window reported "+0.0000" as if lossless (exit 0) */
        {"sink covers the window", tx, "--scheme int4 --scheme int3+sink64",
         "scheme int3+sink64 quantizes nothing at ctx 64: its 64 attention-sink tokens cover the window of 64", 2},
        {"kivi residual covers it", tx, "--scheme kivi2-g4", "residual length 128 keeps every key and value of the window of 64 in fp16", 2},
        {"ctx 1", tx, "--scheme int4 --ctx 1", "--ctx 1: expected >= 2", 2},
        /* a family's own context rule (check_ctx): before the run, exit 2 (it was 1, from inside the run) */
        {"hh window covers it", tx, "--scheme int4 --scheme hh4-w64",
         "scheme hh4-20%-w64: the sink (0) and the recent window (64) must be shorter than the context (64 tokens)", 2},
    };
    const char *extra[] = {"", "", "", "", "", ak, ao, an, "", "", ak, "", "", "", "", "", ""};
    static char out[65536], err[65536];
    char args[40000], jp[512];
    snprintf(jp, sizeof jp, "%s/fail.json", e.dir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(args, sizeof args, "%s %s %s %s --json %s", base, cases[i].a1, cases[i].a2, extra[i], jp);
        int rc = run(&e, args, out, sizeof out, err, sizeof err);
        fprintf(stderr, "INFO %-26s exit %d: %s", cases[i].what, rc, err);
        ck_assert_msg(rc == cases[i].rc, "%s: exit %d, expected %d (%s)", cases[i].what, rc, cases[i].rc, err);
        ck_assert_msg(strstr(err, cases[i].needle), "%s: stderr lacks '%s': %s", cases[i].what, cases[i].needle, err);
        ck_assert_msg(access(jp, F_OK) != 0, "%s: a JSON report was left behind", cases[i].what);
        ck_assert_msg(out[0] == 0, "%s: printed a table: %s", cases[i].what, out);
    }
    /* a llama2.c model without --tokenizer is a command-line error: exit 2, as the other ones (it was 1) */
    snprintf(args, sizeof args, "--model %s --ctx 64 --max-windows 1 -q %s --scheme int4", e.model, tx);
    int trc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(trc == 2 && strstr(err, "a llama2.c model carries no tokenizer; pass --tokenizer"), "exit %d: %s", trc, err);
    /* an --artifact that no scheme reads is said (it was passed over without a word) */
    snprintf(args, sizeof args, "--model %s --tokenizer %s --ctx 64 --max-windows 1 %s --scheme int4 --artifact %s", e.model, e.tok, tx,
             a_ok);
    trc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(trc == 0 && strstr(err, "no --scheme reads it") && strstr(err, a_ok), "exit %d: %s", trc, err);
    /* no temporary JSON either */
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls %s | grep -q tmp", e.dir);
    ck_assert(system(cmd) != 0);
    /* an output that would replace an input, or cannot be written, is refused before any work:
     * --json TOKENIZER used to overwrite the tokenizer with JSON (exit 0), --json nodir/x.json failed
     * after the whole run; llamacpp at ctx 2 scored nothing and printed PPL nan (exit 0) */
    {
        char tokc[600], missing[600];
        snprintf(tokc, sizeof tokc, "%s/tokc.bin", e.dir);
        snprintf(missing, sizeof missing, "%s/nodir/x.json", e.dir);
        char *orig = slurp(e.tok);
        FILE *tf = fopen(e.tok, "rb");
        fseek(tf, 0, SEEK_END);
        const long tn = ftell(tf);
        fclose(tf);
        tf = fopen(tokc, "wb");
        ck_assert(fwrite(orig, 1, (size_t)tn, tf) == (size_t)tn);
        fclose(tf);
        struct { const char *what, *fmt, *needle; int rc; } oc[] = {
            {"json = tokenizer", "--model %s --tokenizer %s %s --scheme int4 --ctx 64 --max-windows 1 -q --json %s", "the same file as --tokenizer", 2},
            {"json = text", "--model %s --tokenizer %s %s --scheme int4 --ctx 64 --max-windows 1 -q --json %s", "the same file as --text", 2},
            {"json dir missing", "--model %s --tokenizer %s %s --scheme int4 --ctx 64 --max-windows 1 -q --json %s", "does not exist", 2},
            {"llamacpp ctx 2", "--model %s --tokenizer %s %s --scheme int4 --ctx 2 --max-windows 1 -q --protocol llamacpp --json %s",
             "scores no token under the llamacpp protocol", 1},
        };
        const char *jsons[] = {tokc, small, missing, jp}, *texts[] = {tx, sm, tx, tx}; /* (a copy as the text: never ../shared) */
        for (size_t i = 0; i < sizeof oc / sizeof *oc; i++) {
            snprintf(args, sizeof args, oc[i].fmt, e.model, tokc, texts[i], jsons[i]);
            const int orc = run(&e, args, out, sizeof out, err, sizeof err);
            ck_assert_msg(orc == oc[i].rc && strstr(err, oc[i].needle), "%s: exit %d (expected %d): %s", oc[i].what, orc, oc[i].rc, err);
            ck_assert_msg(out[0] == 0, "%s: printed a table: %s", oc[i].what, out);
        }
        char *now = slurp(tokc);
        ck_assert_msg(memcmp(now, orig, (size_t)tn) == 0, "the tokenizer was modified");
        char *sn = slurp(small);
        ck_assert_msg(sn && !strcmp(sn, " = Tiny = \n\n hello world \n"), "the text was modified");
        free(sn);
        ck_assert(access(jp, F_OK) != 0);
        free(now);
        free(orig);
        unlink(tokc);
    }
    /* the matching artifact works, and the artifact is named in the notes */
    snprintf(args, sizeof args, "%s %s %s --scheme nuq3-1%% --scheme int3-pc-1%%", base, tx, ak);
    int rc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_msg(strstr(out, "| nuq3-1% | 3 | 3 |") && strstr(out, "| int3-pc-1% | 3 | 3 |") && strstr(out, a_ok), "%s", out);
    env_done(&e);
}
END_TEST

/* --device: cpu runs and is labelled (table and JSON), bad names are usage
 * errors, cuda without a GPU fails naming --device cpu, auto falls back to
 * the CPU with a one-line note in a CUDA build; KIVI with 2 sink tokens runs. */
START_TEST(test_cli_device)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "bin/kveval or ../shared tiny models/wikitext absent (run make all)");
    static char out[65536], err[65536];
    char args[16384], base[12800];
    snprintf(base, sizeof base, "--model %s --tokenizer %s --text %s --ctx 64 --max-windows 2", e.model, e.tok, e.text);
    snprintf(args, sizeof args, "%s --device cpu --scheme kivi2-g4-r8+sink2 --scheme int4 --json %s/d.json -q", base, e.dir);
    int rc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, "- device: cpu, exact (fp32): CPU"), "%s", out);
    ck_assert_msg(strstr(out, "| kivi2-g4-r8+sink2 | 2 | 2 |"), "%s", out);
    char jp[512];
    snprintf(jp, sizeof jp, "%s/d.json", e.dir);
    char *js = slurp(jp);
    ck_assert(js);
    cJSON *root = cJSON_Parse(js);
    ck_assert(root);
    cJSON *dev = cJSON_GetObjectItem(root, "device");
    ck_assert(dev);
    ck_assert_str_eq(cJSON_GetObjectItem(dev, "name")->valuestring, "cpu");
    ck_assert_str_eq(cJSON_GetObjectItem(dev, "mode")->valuestring, "exact");
    cJSON *ss = cJSON_GetObjectItem(root, "schemes");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 0), "transform")->valuestring, "none");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 1), "transform")->valuestring, "cpu");
    /* throughput: the same model FLOPs for every scheme (no prefix), over each one's seconds; no GEMM rate on the CPU */
    for (int i = 0; i < 3; i++) {
        cJSON *s0 = cJSON_GetArrayItem(ss, 0), *si = cJSON_GetArrayItem(ss, i);
        const double fl = cJSON_GetObjectItem(si, "flops")->valuedouble, sec = cJSON_GetObjectItem(si, "seconds")->valuedouble;
        ck_assert(fl > 0 && fl == cJSON_GetObjectItem(s0, "flops")->valuedouble && sec > 0);
        ck_assert_double_eq_tol(cJSON_GetObjectItem(si, "tflops_per_s")->valuedouble, fl / sec / 1e12, 1e-9 * fl / sec / 1e12);
        ck_assert_ptr_null(cJSON_GetObjectItem(si, "of_gemm_rate"));
    }
    ck_assert_ptr_null(cJSON_GetObjectItem(dev, "gemm_tflops_per_s"));
    ck_assert_msg(!strstr(out, "throughput"), "the CPU's device line: %s", out);
    cJSON_Delete(root);
    free(js);

    snprintf(args, sizeof args, "%s --device gpu --scheme int4 -q", base);
    ck_assert_int_eq(run(&e, args, out, sizeof out, err, sizeof err), 2);
    ck_assert_msg(strstr(err, "expected cpu, cuda, cuda:N or auto") && out[0] == 0, "%s", err);

    /* --math: a bad value and a contradiction with --fast are usage errors */
    snprintf(args, sizeof args, "%s --scheme int4 --math fp8", base);
    ck_assert_int_eq(run(&e, args, out, sizeof out, err, sizeof err), 2);
    ck_assert_msg(strstr(err, "--math") && strstr(err, "fp8") && out[0] == 0, "%s", err);
    snprintf(args, sizeof args, "%s --scheme int4 --fast --math bf16", base);
    ck_assert_int_eq(run(&e, args, out, sizeof out, err, sizeof err), 2);
    ck_assert_msg(strstr(err, "contradicts --math bf16") && out[0] == 0, "%s", err);

    /* the binary's build: CUDA or CPU-only */
    ck_assert(run(&e, "--version", out, sizeof out, err, sizeof err) == 0);
    bool cuda_build = strstr(out, "CUDA build") != NULL;
    snprintf(args, sizeof args, "%s --device cuda --scheme int4 -q", base);
    rc = run(&e, args, out, sizeof out, err, sizeof err);
    if (rc != 0) { /* no usable GPU (CI): a clear error, no table */
        fprintf(stderr, "INFO --device cuda: exit %d: %s", rc, err);
        ck_assert_int_eq(rc, 1);
        ck_assert_msg(strstr(err, "--device cpu") && out[0] == 0, "%s", err);
        /* auto: the CPU, with one note line in a CUDA build (none with -q) */
        snprintf(args, sizeof args, "%s --scheme int4 --fast", base);
        ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
        ck_assert_msg(strstr(out, "- device: cpu, exact (fp32)"), "%s", out);
        ck_assert_msg(!cuda_build || strstr(err, "--device auto: no usable GPU"), "%s", err);
        ck_assert_msg(strstr(err, "--fast / --math apply to the GPU only"), "%s", err);
        snprintf(args, sizeof args, "%s --scheme int4 --gemm-rate", base);
        ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
        ck_assert_msg(strstr(err, "--gemm-rate applies to the GPU only") && !strstr(out, "GEMM rate"), "%s", err);
        snprintf(args, sizeof args, "%s --scheme int4 --math bf16 -q", base);
        ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
        ck_assert_msg(strstr(out, "- device: cpu, exact (fp32)"), "%s", out);
        snprintf(args, sizeof args, "%s --scheme int4 -q", base);
        ck_assert(run(&e, args, out, sizeof out, err, sizeof err) == 0);
        ck_assert_msg(err[0] == 0, "-q printed: %s", err);
    } else {
        ck_assert_msg(strstr(out, "- device: cuda, exact (fp32)"), "%s", out);
    }
    env_done(&e);
}
END_TEST

/* --task passkey end to end: fp16 first, the table of lengths and depths, the note on lengths the reference cannot
 * do, the JSON's cases; bad lists are usage errors; the perplexity task still needs --text. */
START_TEST(test_cli_passkey)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "bin/kveval or ../shared tiny models/wikitext absent (run make all)");
    static char out[65536], err[65536];
    char args[16384];
    snprintf(args, sizeof args,
             "--task passkey --model %s --tokenizer %s --passkey-lengths 200,max --passkey-depths 0,100 --scheme int4 --scheme fp16 "
             "--json %s/pk.json -q",
             e.model, e.tok, e.dir);
    int rc = run(&e, args, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    fprintf(stderr, "INFO kveval passkey stdout:\n%s", out);
    ck_assert_msg(strstr(out, "| scheme | 200 | 512 | summary |") && strstr(out, "| scheme (summary lengths) | depth 0% | depth 100% |"), "%s", out);
    const char *f16 = strstr(out, "| fp16 |"), *i4 = strstr(out, "| int4 |");
    ck_assert_msg(f16 && i4 && f16 < i4 && !strstr(f16 + 1, "| fp16 | 0/2 | 0/2 | — |\n| fp16"), "fp16 first, once: %s", out);
    ck_assert_msg(strstr(out, "Landmark Attention") && strstr(out, "keys from seed 0"), "%s", out);
    char jp[512];
    snprintf(jp, sizeof jp, "%s/pk.json", e.dir);
    char *js = slurp(jp);
    cJSON *root = cJSON_Parse(js);
    ck_assert(root);
    ck_assert_str_eq(cJSON_GetObjectItem(root, "task")->valuestring, "passkey");
    cJSON *cases = cJSON_GetObjectItem(root, "cases");
    ck_assert_int_eq(cJSON_GetArraySize(cases), 4);
    cJSON *c0 = cJSON_GetArrayItem(cases, 0);
    ck_assert_str_eq(cJSON_GetObjectItem(c0, "key")->valuestring, "60494");
    ck_assert(cJSON_GetObjectItem(c0, "tokens")->valueint <= 200);
    ck_assert(cJSON_GetObjectItem(cJSON_GetObjectItem(c0, "results"), "fp16") && cJSON_GetObjectItem(cJSON_GetObjectItem(c0, "results"), "int4"));
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "options"), "reference")->valuestring, "fp16");
    /* the tiny model cannot do it in fp16 at either length: both named and left out of the summary */
    int nsum = cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "options"), "summary_lengths"));
    if (nsum == 0) ck_assert_msg(strstr(out, "fp16 cannot do it at 200, 512 tokens: left out"), "%s", out);
    cJSON_Delete(root);
    free(js);
    struct { const char *a, *needle; int rc; } bad[] = {
        {"--task passkey --passkey-lengths 600", "--passkey-lengths: expected token counts", 2},
        {"--task passkey --passkey-depths 0,150", "--passkey-depths: expected percentages 0..100, found '150'", 2},
        {"--task passkey --passkey-lengths 100", "too short", 1},
        /* a repeated value gave two identical columns; a trailing comma was dropped without a word */
        {"--task passkey --passkey-lengths 256,256", "--passkey-lengths: 256 given twice", 2},
        {"--task passkey --passkey-depths 0,50,50", "--passkey-depths: 50 given twice", 2},
        {"--task passkey --passkey-lengths 256,", "a value expected after the last comma of '256,'", 2},
        /* a family's rule against the window length (check_ctx), before any work */
        {"--task passkey --passkey-lengths 200,300 --scheme zipcache-w250",
         "passkey: length 200: scheme zipcache-h4-l2-b60%-w250-n250: the sink (0) and the recent window (250) must be shorter than the context (200 tokens)",
         1},
        {"--passkey-trials 2 --text x.txt", "apply to --task passkey only", 2},
        {"", "missing required option --text", 2},
        {"--task passkey --text x.txt", "--text applies to --task ppl, not to --task passkey", 2},
        {"--task passkey --ctx 64", "--ctx applies to --task ppl", 2},
        {"--task passkey --gemm-rate", "--gemm-rate applies to --task ppl", 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(args, sizeof args, "--model %s --tokenizer %s --scheme int4 -q %s", e.model, e.tok, bad[i].a);
        rc = run(&e, args, out, sizeof out, err, sizeof err);
        ck_assert_msg(rc == bad[i].rc && strstr(err, bad[i].needle), "%s: exit %d: %s", bad[i].a, rc, err);
        ck_assert_msg(out[0] == 0, "%s: printed %s", bad[i].a, out);
    }
    env_done(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kveval_cli");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_cli_success);
    tcase_add_test(tc, test_cli_errors);
    tcase_add_test(tc, test_cli_device);
    tcase_add_test(tc, test_cli_passkey);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
