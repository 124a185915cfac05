/* test_tools_bad_input.c — the bad-input defects issue 41 found by probing the four binaries, each
 * tested across every binary and every input or output it applies to:
 *  - a FIFO given as any input file (model, tokenizer, text, artifact, dump) blocked forever in
 *    open(): now refused at once, naming the file and what it is (every case runs under a timeout);
 *  - under a file-size limit (ulimit -f) kvcalib, kvcalib intactkv / export-vllm, kveval --json and
 *    kvstat died of SIGXFSZ and left *.tmp* files: now exit 1 with "File too large", no temporary
 *    file left, no previous output destroyed, and kveval still prints its table (a result is never
 *    lost after the compute);
 *  - kveval --json with fp8 / e5m2 / fp8-tensor on a model whose head_dim does not divide 4096 (80,
 *    96, 100) failed after the whole run writing neither table nor JSON: the Llama-2-7B-shaped size
 *    that cannot apply is now null, everything else written.
 * Inputs: ../shared's tiny llama2.c models and WikiText, the built binaries ($KVQ_BIN_DIR). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "kveval_util.h"
#include "dump.h"
#include "identity.h"
#include "kvq_test.h"
#include "sniff.h"
#include "tokenizer.h"

/* (kveval_util.h's helpers are static; this suite uses the fp8 one) */
void *kvq_test_keep_util(void);
void *kvq_test_keep_util(void) { return (void *)kvq_util_make_nuq_artifact; }

typedef struct {
    char kvdump[64], kvcalib[64], kveval[64], kvstat[64];
    char model[4096], tok[4096], text[4096];
    char dir[256], dump[512], art[512], fp8[512], fifo[512];
} env_t;

static int sh(const char *cmd)
{
    int st = system(cmd);
    ck_assert_msg(st != -1 && WIFEXITED(st), "%s: did not exit", cmd);
    return WEXITSTATUS(st);
}

static int env_init(env_t *e)
{
    if (!kvq_test_bin(e->kvdump, sizeof e->kvdump, "kvdump") || !kvq_test_bin(e->kvcalib, sizeof e->kvcalib, "kvcalib") ||
        !kvq_test_bin(e->kveval, sizeof e->kveval, "kveval") || !kvq_test_bin(e->kvstat, sizeof e->kvstat, "kvstat"))
        return 0;
    if (!kvq_test_shared(e->model, sizeof e->model, "models/llama2c/aidreams260K.bin") ||
        !kvq_test_shared(e->tok, sizeof e->tok, "models/llama2c/aidreams-tok512.bin") ||
        !kvq_test_shared(e->text, sizeof e->text, "datasets/wikitext-2/wiki.valid.tokens"))
        return 0;
    snprintf(e->dir, sizeof e->dir, "/tmp/kvq_test_bad_input_%ld", (long)getpid());
    snprintf(e->dump, sizeof e->dump, "%s/d.h5", e->dir);
    snprintf(e->art, sizeof e->art, "%s/nuq3.safetensors", e->dir);
    snprintf(e->fp8, sizeof e->fp8, "%s/fp8.safetensors", e->dir);
    snprintf(e->fifo, sizeof e->fifo, "%s/fifo", e->dir);
    char cmd[16384];
    snprintf(cmd, sizeof cmd,
             "rm -rf %s && mkdir -p %s && mkfifo %s && %s -m %s --tokenizer %s -t %s -n 3 -L 48 --fisher -o %s -q && "
             "%s %s --method nuq --bits 3 --out %s -q && %s %s --method fp8 --out %s -q",
             e->dir, e->dir, e->fifo, e->kvdump, e->model, e->tok, e->text, e->dump, e->kvcalib, e->dump, e->art, e->kvcalib,
             e->dump, e->fp8);
    ck_assert_msg(sh(cmd) == 0, "setup failed: %s", cmd);
    return 1;
}

static void env_done(env_t *e)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", e->dir);
    ck_assert(sh(cmd) == 0);
}

/* Run cmd (a shell command line) with stderr into dir/err.txt (returned, NUL-terminated). */
static int run_err(const env_t *e, const char *cmd, char *err, size_t en)
{
    char full[20000], p[600];
    snprintf(full, sizeof full, "%s 2> %s/err.txt", cmd, e->dir);
    int rc = sh(full);
    snprintf(p, sizeof p, "%s/err.txt", e->dir);
    FILE *f = fopen(p, "rb");
    size_t n = f ? fread(err, 1, en - 1, f) : 0;
    if (f) fclose(f);
    err[n] = 0;
    return rc;
}

/* A FIFO as any input file: refused at once (a plain open() of a FIFO waits for a writer forever). */
START_TEST(test_fifo_inputs_refused)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "the kvq binaries or ../shared tiny models/wikitext absent (run make all)");
    char tt[600];
    snprintf(tt, sizeof tt, "%s", "tests/fixtures/crlf_sample.txt");
    struct { const char *what, *fmt; } cases[] = {
        {"kveval --model", "%s/kveval -m FIFO --tokenizer TOK -t TXT --ctx 32 --scheme int4 -q"},
        {"kveval --tokenizer", "%s/kveval -m MODEL --tokenizer FIFO -t TXT --ctx 32 --scheme int4 -q"},
        {"kveval --text", "%s/kveval -m MODEL --tokenizer TOK -t FIFO --ctx 32 --scheme int4 -q"},
        {"kveval --artifact", "%s/kveval -m MODEL --tokenizer TOK -t TXT --ctx 32 --scheme nuq3 --artifact FIFO -q"},
        {"kvdump --model", "%s/kvdump -m FIFO --tokenizer TOK -t TXT -n 1 -L 16 -o OUT -q"},
        {"kvdump --tokenizer", "%s/kvdump -m MODEL --tokenizer FIFO -t TXT -n 1 -L 16 -o OUT -q"},
        {"kvdump --text", "%s/kvdump -m MODEL --tokenizer TOK -t FIFO -n 1 -L 16 -o OUT -q"},
        {"kvcalib DUMP", "%s/kvcalib FIFO --method nuq --bits 3 --out OUT -q"},
        {"kvcalib --inspect", "%s/kvcalib --inspect FIFO"},
        {"kvcalib export-vllm", "%s/kvcalib export-vllm FIFO --out OUT"},
        {"kvcalib intactkv --model", "%s/kvcalib intactkv -m FIFO --tokenizer TOK --base ART --prefix bos --out OUT -q"},
        {"kvcalib intactkv --base", "%s/kvcalib intactkv -m MODEL --tokenizer TOK --base FIFO --prefix bos --out OUT -q"},
        {"kvcalib intactkv --tokenizer", "%s/kvcalib intactkv -m MODEL --tokenizer FIFO --base ART --prefix bos --out OUT -q"},
        {"kvcalib intactkv --text", "%s/kvcalib intactkv -m MODEL --tokenizer TOK --base ART --prefix bos --out OUT --train --text FIFO "
                                    "--samples 1 --seq-len 16 --steps 1 -q"},
        {"kvstat DUMP", "%s/kvstat FIFO -q"},
        {"kvstat --artifact", "%s/kvstat DUMP --artifact FIFO -q"},
    };
    const char *bin = getenv("KVQ_BIN_DIR");
    char bdir[256];
    snprintf(bdir, sizeof bdir, "%s", bin && *bin ? bin : "bin");
    static char err[65536];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        /* substitute the placeholders */
        char line[8192], out[600];
        snprintf(out, sizeof out, "%s/out_%zu", e.dir, i);
        snprintf(line, sizeof line, cases[i].fmt, bdir);
        struct { const char *k, *v; } sub[] = {{"FIFO", e.fifo}, {"MODEL", e.model}, {"TOK", e.tok}, {"TXT", tt},
                                               {"OUT", out},     {"ART", e.art},     {"DUMP", e.dump}};
        char cmd[16384] = "timeout 20 ";
        size_t cl = strlen(cmd);
        for (const char *p = line; *p;) {
            size_t j = 0;
            for (; j < sizeof sub / sizeof *sub; j++)
                if (!strncmp(p, sub[j].k, strlen(sub[j].k))) break;
            const char *piece = j < sizeof sub / sizeof *sub ? sub[j].v : p;
            const size_t pl = j < sizeof sub / sizeof *sub ? strlen(sub[j].v) : 1;
            ck_assert(cl + pl < sizeof cmd);
            memcpy(cmd + cl, piece, pl);
            cl += pl;
            cmd[cl] = 0;
            p += j < sizeof sub / sizeof *sub ? strlen(sub[j].k) : 1;
        }
        int rc = run_err(&e, cmd, err, sizeof err);
        fprintf(stderr, "INFO %-28s exit %d: %s", cases[i].what, rc, err);
        ck_assert_msg(rc != 124, "%s: still blocked after 20 s on the FIFO", cases[i].what);
        ck_assert_msg(rc == 1 || rc == 2, "%s: exit %d: %s", cases[i].what, rc, err);
        ck_assert_msg(strstr(err, e.fifo) && strstr(err, "not a regular file (a pipe"), "%s: %s", cases[i].what, err);
        ck_assert_msg(access(out, F_OK) != 0, "%s: an output was written", cases[i].what);
    }
    env_done(&e);
}
END_TEST

/* No file of dir's listing matches ".tmp" (the temporary names of kvq's writers). */
static void assert_no_tmp(const env_t *e, const char *what)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls -a %s | grep -q '\\.tmp'", e->dir);
    ck_assert_msg(sh(cmd) != 0, "%s: a temporary file was left in %s", what, e->dir);
}

/* Past a file-size limit every writer fails cleanly: exit 1, "File too large", no temporary file,
 * the previous output intact; kveval's table still reaches stdout when its JSON cannot be written. */
START_TEST(test_file_size_limit)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "the kvq binaries or ../shared tiny models/wikitext absent (run make all)");
    const char *bin = getenv("KVQ_BIN_DIR");
    char b[256];
    snprintf(b, sizeof b, "%s", bin && *bin ? bin : "bin");
    char out[600], prev[600];
    snprintf(out, sizeof out, "%s/o", e.dir);
    snprintf(prev, sizeof prev, "%s/previous", e.dir);
    struct { const char *what, *fmt; bool force; } cases[] = {
        {"kvcalib --out", "%s/kvcalib %s --method nuq --bits 3 --out %s -q", true},
        {"kvcalib --method fp8 --export-vllm", "%s/kvcalib %s --method fp8 --out %s.art --export-vllm %s -q", true},
        {"kvcalib export-vllm", "%s/kvcalib export-vllm %s --out %s", true},
        {"kvcalib intactkv", "%s/kvcalib intactkv -m %s --tokenizer %s --base %s --prefix bos --out %s -q", true},
        {"kvcalib intactkv --train", "%s/kvcalib intactkv -m %s --tokenizer %s --base %s --prefix bos --out %s -q --train --text %s "
                                     "--samples 2 --seq-len 16 --steps 1", true},
        {"kveval --json", "%s/kveval -m %s --tokenizer %s -t tests/fixtures/crlf_sample.txt --ctx 64 --scheme int4 --json %s -q", false},
        {"kvstat --json", "%s/kvstat %s --json %s -q", false},
        {"kvstat --markdown", "%s/kvstat %s --markdown %s -q", false},
        {"kvstat --html", "%s/kvstat %s --html %s -q", false},
        {"kvdump --out", "%s/kvdump -m %s --tokenizer %s -t %s -n 2 -L 48 -o %s -q", false},
    };
    static char err[65536];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char c[20000], cmd[24000];
        switch (i) {
        case 0: snprintf(c, sizeof c, cases[i].fmt, b, e.dump, out); break;
        case 1: snprintf(c, sizeof c, cases[i].fmt, b, e.dump, out, out); break;
        case 2: snprintf(c, sizeof c, cases[i].fmt, b, e.fp8, out); break;
        case 3: snprintf(c, sizeof c, cases[i].fmt, b, e.model, e.tok, e.art, out); break;
        case 4: snprintf(c, sizeof c, cases[i].fmt, b, e.model, e.tok, e.art, out, e.text); break;
        case 5: snprintf(c, sizeof c, cases[i].fmt, b, e.model, e.tok, out); break;
        case 9: snprintf(c, sizeof c, cases[i].fmt, b, e.model, e.tok, e.text, out); break;
        default: snprintf(c, sizeof c, cases[i].fmt, b, e.dump, out); break;
        }
        /* a previous output of the same name must survive (except for --html, a directory) */
        if (i != 8) {
            char w[4000];
            snprintf(w, sizeof w, "rm -rf %s %s.partial && printf 'previous output\\n' > %s && cp %s %s", out, out, out, out, prev);
            ck_assert(sh(w) == 0);
            if (cases[i].force || i == 9) strncat(c, i == 9 ? " --force" : " --force", sizeof c - strlen(c) - 1);
        } else {
            char w[700];
            snprintf(w, sizeof w, "rm -rf %s", out);
            ck_assert(sh(w) == 0);
        }
        /* the limit (1 KiB) on the tool alone: its stdout goes through a pipe to a file of the parent */
        snprintf(cmd, sizeof cmd, "bash -c '(ulimit -f 1; exec %s) | cat > %s/stdout.txt; exit ${PIPESTATUS[0]}'", c, e.dir);
        int rc = run_err(&e, cmd, err, sizeof err);
        fprintf(stderr, "INFO %-34s exit %d: %s", cases[i].what, rc, err);
        ck_assert_msg(rc == 1, "%s: exit %d (SIGXFSZ is %d + 128): %s", cases[i].what, rc, SIGXFSZ, err);
        ck_assert_msg(strstr(err, "File too large"), "%s: %s", cases[i].what, err);
        assert_no_tmp(&e, cases[i].what);
        if (i == 8) {
            ck_assert_msg(access(out, F_OK) != 0, "%s: the empty output directory it made was left", cases[i].what);
        } else {
            char w[1400];
            snprintf(w, sizeof w, "cmp -s %s %s", out, prev);
            ck_assert_msg(sh(w) == 0, "%s: the previous %s was replaced or damaged", cases[i].what, out);
        }
        if (i == 5) { /* kveval: the table reached stdout although the JSON could not be written */
            char p[600];
            snprintf(p, sizeof p, "%s/stdout.txt", e.dir);
            char *so = kvq_test_slurp(p, NULL);
            ck_assert_msg(so && strstr(so, "| int4 | 4 | 4 |"), "kveval: no table on stdout: %s", so ? so : "");
            free(so);
        }
    }
    env_done(&e);
}
END_TEST

/* A llama2.c checkpoint with random weights (small, so the distributions stay near uniform) and the
 * given head_dim, one head. */
static void write_model(const char *path, int hd)
{
    const int dim = hd, hid = 64, L = 2, V = 512, seq = 256;
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t h[7] = {dim, hid, L, 1, 1, V, seq};
    ck_assert(fwrite(h, sizeof h, 1, f) == 1);
    size_t n = (size_t)V * dim + (size_t)L * (dim + 4 * (size_t)dim * dim + dim + 3 * (size_t)hid * dim) + dim + (size_t)seq * hd;
    uint32_t x = 12345;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        float v = ((float)(x >> 8) / 16777216.0f - 0.5f) * 0.2f;
        ck_assert(fwrite(&v, sizeof v, 1, f) == 1);
    }
    fclose(f);
}

/* kveval --json with the FP8 schemes on models whose head_dim does not divide the Llama-2-7B shape's
 * 4096 channels (it used to fail after the whole run: the shape's scale count was taken with the model's
 * head_dim): exit 0, the table and the JSON written, and the Llama-2-7B-shaped sizes computed with that
 * shape's own head_dim (128): 32 layers x K,V x 4096 channels x 2048 tokens x 1 byte = 512 MiB plus one
 * float32 scale per layer for K and V. A size the accounting cannot give would be null (ppl_report.c). */
START_TEST(test_kveval_sizes_that_do_not_apply)
{
    char kve[64], tok[4096];
    KVQ_SKIP_IF(!kvq_test_bin(kve, sizeof kve, "kveval") || !kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin"),
                "bin/kveval or ../shared tiny tokenizer absent (run make all)");
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/kvq_test_sizes_%ld", (long)getpid());
    char cmd[20000];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    ck_assert(sh(cmd) == 0);
    static const int hds[] = {80, 96, 100};
    for (size_t k = 0; k < 3; k++) {
        char mp[512], ap[512], jp[512], op[512];
        snprintf(mp, sizeof mp, "%s/hd%d.bin", dir, hds[k]);
        snprintf(ap, sizeof ap, "%s/fp8_%d.safetensors", dir, hds[k]);
        snprintf(jp, sizeof jp, "%s/r.json", dir);
        snprintf(op, sizeof op, "%s/out.txt", dir);
        write_model(mp, hds[k]);
        { /* an fp8 per-tensor scale artifact for it */
            kvq_model m;
            kvq_err e = {0};
            ck_assert_msg(kvq_model_load(mp, &m, &e) == KVQ_OK, "%s", e.msg);
            char fp[65];
            ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
            int tk[64];
            for (int t = 0; t < 64; t++) tk[t] = (t * 37 + 11) % 512;
            ck_assert_msg(kvq_util_make_fp8_artifact(&m, tk, 2, 32, false, 100, false, fp, ap, &e) == KVQ_OK, "%s", e.msg);
            kvq_model_free(&m);
        }
        snprintf(cmd, sizeof cmd,
                 "%s -m %s --tokenizer %s -t tests/fixtures/crlf_sample.txt --ctx 64 --max-windows 2 --artifact %s --scheme fp8 "
                 "--scheme e5m2 --scheme fp8-tensor --scheme int4 --json %s -q > %s",
                 kve, mp, tok, ap, jp, op);
        ck_assert_msg(sh(cmd) == 0, "head_dim %d: %s", hds[k], cmd);
        char *out = kvq_test_slurp(op, NULL), *js = kvq_test_slurp(jp, NULL);
        ck_assert_msg(out && strstr(out, "| fp8 |") && strstr(out, "| e5m2 |") && strstr(out, "| fp8-tensor |"), "%s", out);
        cJSON *root = cJSON_Parse(js);
        ck_assert(root);
        cJSON *ss = cJSON_GetObjectItem(root, "schemes");
        ck_assert_int_eq(cJSON_GetArraySize(ss), 5);
        for (int i = 0; i < 5; i++) {
            cJSON *o = cJSON_GetArrayItem(ss, i), *at = cJSON_GetObjectItem(o, "kv_cache_mib_at");
            const char *name = cJSON_GetObjectItem(o, "name")->valuestring;
            ck_assert_msg(cJSON_IsNumber(cJSON_GetObjectItem(o, "bits_per_element")), "%s: bits", name);
            ck_assert_msg(cJSON_IsNumber(cJSON_GetObjectItem(cJSON_GetObjectItem(at, "model"), "2048")), "%s", name);
            ck_assert(isfinite(cJSON_GetObjectItem(o, "ppl")->valuedouble));
            cJSON *l7 = cJSON_GetObjectItem(cJSON_GetObjectItem(at, "llama2_7b"), "2048");
            ck_assert_msg(cJSON_IsNumber(l7), "%s", name);
            if (!strncmp(name, "fp8", 3) || !strncmp(name, "e5m2", 4))
                ck_assert_msg(fabs(l7->valuedouble - (512.0 + 32 * 2 * 4 / 1048576.0)) < 1e-9, "%s: %.9f MiB", name, l7->valuedouble);
        }
        cJSON_Delete(root);
        free(out);
        free(js);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert(sh(cmd) == 0);
}
END_TEST

/* A file of the wrong kind is named for what it is, with what was expected (issue 41: kvcalib --inspect on a
 * dump reported a 7e17-byte safetensors header length, a web page named .gguf was "a bad llama2.c header", a bare
 * .safetensors as --model wanted a config.json): every reader — model, artifact, dump, tokenizer — against every
 * kind of file it does not take, under a name that suggests its own format. */
START_TEST(test_wrong_kind_named)
{
    env_t e;
    KVQ_SKIP_IF(!env_init(&e), "the kvq binaries or ../shared tiny models/wikitext absent (run make all)");
    char p[12][700];
    const kvq_file_kind kinds[] = {KVQ_KIND_HTML, KVQ_KIND_ZIP, KVQ_KIND_GZIP, KVQ_KIND_TEXT, KVQ_KIND_JSON, KVQ_KIND_EMPTY,
                                   KVQ_KIND_HDF5, KVQ_KIND_ARTIFACT, KVQ_KIND_GGUF, KVQ_KIND_LLAMA2C};
    enum { NK = sizeof kinds / sizeof *kinds };
    const char *src[NK] = {NULL, NULL, NULL, NULL, NULL, NULL, e.dump, e.art, "tests/fixtures/tiny_llama.gguf", e.model};
    for (int k = 0; k < NK; k++) {
        snprintf(p[k], sizeof p[k], "%s/kind%d.bin", e.dir, k);
        if (src[k]) {
            char cmd[9000];
            snprintf(cmd, sizeof cmd, "cp %s %s", src[k], p[k]);
            ck_assert(sh(cmd) == 0);
            continue;
        }
        FILE *f = fopen(p[k], "wb");
        ck_assert_ptr_nonnull(f);
        static const char html[] = "\n  <!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>Not Found</body></html>\n";
        static const char zip[] = "PK\3\4\24\0\0\0\10\0 some compressed bytes follow here ...................";
        static const char gz[] = "\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03 deflate stream .........................";
        static const char txt[] = "Once upon a time there was a file that held only words.\nAnd lines.\n";
        static const char js[] = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64}\n";
        const char *what[] = {html, zip, gz, txt, js, ""};
        const size_t len[] = {sizeof html - 1, sizeof zip - 1, sizeof gz - 1, sizeof txt - 1, sizeof js - 1, 0};
        if (len[k]) ck_assert(fwrite(what[k], 1, len[k], f) == len[k]);
        fclose(f);
    }
    for (int k = 0; k < NK; k++) ck_assert_msg(kvq_sniff_path(p[k]) == kinds[k], "kind %d sniffed as %d", k, kvq_sniff_path(p[k]));
    /* which readers refuse which kinds (the others are their own formats, or not told apart by content) */
    struct { const char *reader, *expected; bool refuses[NK]; } rd[] = {
        /*                                     html  zip   gz    text  json  empty hdf5  art   gguf  l2c */
        {"model", "not a model", {true, true, true, true, true, true, true, true, false, false}},
        {"artifact", "not a safetensors file", {true, true, true, true, true, false, true, false, true, true}},
        {"dump", "not a kvdump dump", {true, true, true, true, true, true, false, true, true, true}},
        {"tokenizer", "not a tokenizer", {true, true, true, false, false, true, true, true, false, true}},
    };
    for (size_t r = 0; r < sizeof rd / sizeof *rd; r++)
        for (int k = 0; k < NK; k++) {
            if (!rd[r].refuses[k]) continue;
            /* under the reader's own extension */
            static const char *ext[] = {".gguf", ".safetensors", ".h5", ".bin"};
            char named[800], cmd[10000];
            snprintf(named, sizeof named, "%s/as_%zu_%d%s", e.dir, r, k, ext[r]);
            snprintf(cmd, sizeof cmd, "cp %s %s", p[k], named);
            ck_assert(sh(cmd) == 0);
            kvq_err er = {0};
            kvq_status st;
            if (r == 0) {
                kvq_model m;
                st = kvq_model_load(named, &m, &er);
            } else if (r == 1) {
                kvq_artifact a;
                st = kvq_artifact_read(named, &a, &er);
            } else if (r == 2) {
                kvq_dump_reader *dr;
                st = kvq_dump_open(named, &dr, &er);
            } else {
                kvq_tokenizer *t;
                st = kvq_tokenizer_load(named, &t, &er);
            }
            fprintf(stderr, "INFO %s <- %s: %s\n", rd[r].reader, kvq_kind_desc(kinds[k]), er.msg);
            ck_assert_msg(st != KVQ_OK, "%s took %s", rd[r].reader, kvq_kind_desc(kinds[k]));
            ck_assert_msg(strstr(er.msg, named) && strstr(er.msg, kvq_kind_desc(kinds[k])) && strstr(er.msg, rd[r].expected),
                          "%s <- %s: '%s' lacks the kind or '%s'", rd[r].reader, kvq_kind_desc(kinds[k]), er.msg, rd[r].expected);
            unlink(named);
        }
    /* the weights of an HF checkpoint without their config.json: named as such */
    {
        char w[800], cmd[1700];
        snprintf(w, sizeof w, "%s/model.safetensors", e.dir);
        snprintf(cmd, sizeof cmd, "cp tests/fixtures/stories260K-hf/model.safetensors %s", w);
        ck_assert(sh(cmd) == 0);
        kvq_model m;
        kvq_err er = {0};
        ck_assert_int_eq(kvq_model_load(w, &m, &er), KVQ_EFORMAT);
        ck_assert_msg(strstr(er.msg, "a safetensors file of weights alone") && strstr(er.msg, "has no config.json"), "%s", er.msg);
        ck_assert_msg(kvq_model_load("tests/fixtures/stories260K-hf/model.safetensors", &m, &er) == KVQ_OK, "%s", er.msg);
        kvq_model_free(&m);
    }
    /* through the binaries: kvcalib --inspect on a dump, kveval --model on a web page named .gguf */
    {
        char cmd[12000];
        static char err[65536];
        const char *bin = getenv("KVQ_BIN_DIR");
        snprintf(cmd, sizeof cmd, "%s/kvcalib --inspect %s", bin && *bin ? bin : "bin", e.dump);
        ck_assert_int_eq(run_err(&e, cmd, err, sizeof err), 1);
        ck_assert_msg(strstr(err, "it is an HDF5 file (a kvdump dump?), not a safetensors file"), "%s", err);
        snprintf(cmd, sizeof cmd, "cp %s %s/page.gguf && %s/kveval -m %s/page.gguf -t %s --scheme int4 -q", p[0], e.dir,
                 bin && *bin ? bin : "bin", e.dir, e.text);
        ck_assert_int_eq(run_err(&e, cmd, err, sizeof err), 1);
        ck_assert_msg(strstr(err, "it is an HTML page (a failed download saved under this name?), named .gguf but without the GGUF "
                                  "magic, not a model"),
                      "%s", err);
    }
    env_done(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("tools_bad_input");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_fifo_inputs_refused);
    tcase_add_test(tc, test_file_size_limit);
    tcase_add_test(tc, test_kveval_sizes_that_do_not_apply);
    tcase_add_test(tc, test_wrong_kind_named);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
