/* test_conventions.c — the conventions every kvq binary shares (issue 40):
 *  - one version (formats/version.h): every binary's --version prints KVQ_VERSION;
 *  - one meaning per option: across all binaries and subcommands (their --help, generated from
 *    the option tables), a short letter names one long option, a long option has one metavar
 *    and one set of choices, and the shared options (kvq_cli_common) have the shared help text;
 *  - llama.cpp's long aliases (--ctx-size, --file) parse as the options they stand for and are
 *    listed in --help;
 *  - every key of the JSON reports (kveval ppl and passkey, kvstat) on a small run is in the key
 *    reference docs/JSON.md with a type that admits the value, and each report names its schema.
 * Runs the built binaries ($KVQ_BIN_DIR) on the tiny llama2.c models of ../shared. */
#include <ctype.h>
#include <cjson/cJSON.h>
#include <sys/wait.h>

#include "cli.h"
#include "kvq_test.h"
#include "version.h"

#define MAX_OPTS 512

typedef struct {
    char tool[48], lng[48], metavar[32], choices[160], help[1024];
    char shrt;
} opt_row;

typedef struct {
    opt_row r[MAX_OPTS];
    int n;
} opt_set;

/* Run a shell command; stdout into a malloc'd string (NULL on failure); exit status in *rc. */
static char *run_capture(const char *cmd, int *rc)
{
    FILE *p = popen(cmd, "r");
    if (!p) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n - 1, p)) > 0;) {
        n += k;
        if (cap - n < 2) buf = realloc(buf, cap *= 2);
    }
    int st = pclose(p);
    if (rc) *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (buf) buf[n] = 0;
    return buf;
}

/* The options of one --help text (kvq_cli_usage's layout: "  -x, --name METAVAR" left column of
 * 30 characters, help from column 33 or on the next line after a longer left column). */
static void parse_help(const char *tool, const char *text, opt_set *s)
{
    const char *opts = strstr(text, "\noptions:\n");
    ck_assert_msg(opts, "%s --help: no 'options:' section", tool);
    char line[4096], next[4096];
    for (const char *p = opts + 10; *p;) {
        size_t len = strcspn(p, "\n");
        snprintf(line, sizeof line, "%.*s", (int)len, p);
        p += len + (p[len] == '\n');
        size_t nlen = strcspn(p, "\n");
        snprintf(next, sizeof next, "%.*s", (int)nlen, p);
        if (strncmp(line, "  -", 3) && strncmp(line, "      --", 8)) continue;
        char left[256];
        const char *help;
        if (strlen(line) > 33 && line[32] == ' ') {
            snprintf(left, sizeof left, "%.30s", line + 2);
            help = line + 33;
        } else { /* a long left column: the help is on the next line, indented by 33 */
            ck_assert_msg(strspn(next, " ") == 33, "%s --help: cannot read the line '%s'", tool, line);
            snprintf(left, sizeof left, "%.200s", line + 2);
            help = next + 33;
            p += nlen + (p[nlen] == '\n');
        }
        char w[3][128] = {{0}};
        int nw = sscanf(left, "%127s %127s %127s", w[0], w[1], w[2]);
        opt_row r = {0};
        snprintf(r.tool, sizeof r.tool, "%.40s", tool);
        int i = 0;
        if (w[0][0] == '-' && w[0][1] != '-') { /* "-x," */
            ck_assert_msg(strlen(w[0]) == 3 && w[0][2] == ',', "%s: bad short option in '%s'", tool, line);
            r.shrt = w[0][1];
            i = 1;
        }
        ck_assert_msg(i < nw && !strncmp(w[i], "--", 2), "%s: no long option in '%s'", tool, line);
        snprintf(r.lng, sizeof r.lng, "%s", w[i] + 2);
        if (i + 1 < nw) snprintf(r.metavar, sizeof r.metavar, "%s", w[i + 1]);
        snprintf(r.help, sizeof r.help, "%.1000s", help);
        size_t hl = strlen(help);
        const char *brace = strrchr(help, '{');
        if (hl && help[hl - 1] == '}' && brace) snprintf(r.choices, sizeof r.choices, "%.*s", (int)(help + hl - 1 - brace - 1), brace + 1);
        if (!strcmp(r.lng, "help")) continue;
        ck_assert_int_lt(s->n, MAX_OPTS);
        s->r[s->n++] = r;
    }
}

static const char *const TOOLS[][2] = {{"kvdump", ""},  {"kvcalib", ""}, {"kvcalib", "intactkv"}, {"kvcalib", "export-vllm"},
                                       {"kveval", ""},  {"kvstat", ""}};
#define N_TOOLS (sizeof TOOLS / sizeof *TOOLS)

static int all_options(opt_set *s)
{
    s->n = 0;
    for (size_t t = 0; t < N_TOOLS; t++) {
        char bin[512], cmd[1024], name[64];
        if (!kvq_test_bin(bin, sizeof bin, TOOLS[t][0])) return 0;
        snprintf(cmd, sizeof cmd, "%s %s --help", bin, TOOLS[t][1]);
        snprintf(name, sizeof name, "%s%s%s", TOOLS[t][0], *TOOLS[t][1] ? " " : "", TOOLS[t][1]);
        int rc;
        char *out = run_capture(cmd, &rc);
        ck_assert_msg(out && rc == 0, "%s: exit %d", cmd, rc);
        parse_help(name, out, s);
        free(out);
    }
    return 1;
}

START_TEST(test_version)
{
    char bin[512], cmd[1024], want[128];
    for (size_t t = 0; t < N_TOOLS; t++) {
        if (*TOOLS[t][1]) continue;
        KVQ_SKIP_IF(!kvq_test_bin(bin, sizeof bin, TOOLS[t][0]), "the binaries are not built");
        snprintf(cmd, sizeof cmd, "%s --version", bin);
        int rc;
        char *out = run_capture(cmd, &rc);
        snprintf(want, sizeof want, "%s (kvq) %s, ", TOOLS[t][0], KVQ_VERSION);
        ck_assert_msg(out && rc == 0 && !strncmp(out, want, strlen(want)), "%s: exit %d, '%s' (expected '%s...')", cmd, rc,
                      out ? out : "", want);
        ck_assert_msg(strstr(out, "CUDA build") || strstr(out, "CPU-only build"), "%s", out);
        free(out);
    }
    /* the helper the binaries call */
    char buf[256] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    kvq_cli_print_version(f, "kvx", "CPU-only");
    fclose(f);
    snprintf(want, sizeof want, "kvx (kvq) %s, CPU-only build\n", KVQ_VERSION);
    ck_assert_str_eq(buf, want);
}
END_TEST

START_TEST(test_one_meaning_per_option)
{
    static opt_set s;
    KVQ_SKIP_IF(!all_options(&s), "the binaries are not built");
    ck_assert_int_gt(s.n, 60); /* the parser read the tables */
    for (int i = 0; i < s.n; i++) { /* a default written into the help text as well as generated from the target */
        const char *d = strstr(s.r[i].help, "[default ");
        ck_assert_msg(!d || !strstr(d + 1, "[default "), "%s --%s: two defaults: %s", s.r[i].tool, s.r[i].lng, s.r[i].help);
    }
    for (int i = 0; i < s.n; i++)
        for (int j = 0; j < i; j++) {
            const opt_row *a = &s.r[i], *b = &s.r[j];
            if (a->shrt && a->shrt == b->shrt)
                ck_assert_msg(!strcmp(a->lng, b->lng), "-%c means --%s in %s and --%s in %s", a->shrt, a->lng, a->tool, b->lng,
                              b->tool);
            if (!strcmp(a->lng, b->lng)) {
                ck_assert_msg(a->shrt == b->shrt, "--%s: short form -%c in %s, -%c in %s", a->lng, a->shrt ? a->shrt : '-',
                              a->tool, b->shrt ? b->shrt : '-', b->tool);
                ck_assert_msg(!strcmp(a->metavar, b->metavar), "--%s: metavar '%s' in %s, '%s' in %s", a->lng, a->metavar,
                              a->tool, b->metavar, b->tool);
                ck_assert_msg(!strcmp(a->choices, b->choices), "--%s: choices {%s} in %s, {%s} in %s", a->lng, a->choices,
                              a->tool, b->choices, b->tool);
            }
        }
    /* the shared options: the shared entry's letter, metavar, choices and help wherever they appear */
    int n_seen[KVQ_COPT_COUNT] = {0};
    for (int c = 0; c < KVQ_COPT_COUNT; c++) {
        kvq_opt o = kvq_cli_common((kvq_common_opt)c, NULL, false);
        ck_assert_ptr_nonnull(o.name);
        for (int i = 0; i < s.n; i++) {
            if (strcmp(s.r[i].lng, o.name)) continue;
            n_seen[c]++;
            ck_assert_msg(s.r[i].shrt == o.short_name, "%s --%s: not the shared short form", s.r[i].tool, o.name);
            ck_assert_str_eq(s.r[i].metavar, o.metavar ? o.metavar : "");
            ck_assert_str_eq(s.r[i].choices, o.choices ? o.choices : "");
            ck_assert_msg(!strncmp(s.r[i].help, o.help, strlen(o.help)), "%s --%s: help '%s', shared '%s'", s.r[i].tool, o.name,
                          s.r[i].help, o.help);
        }
    }
    ck_assert_int_ge(n_seen[KVQ_COPT_MODEL], 3);
    ck_assert_int_ge(n_seen[KVQ_COPT_THREADS], 3);
    ck_assert_int_eq(n_seen[KVQ_COPT_QUIET], (int)N_TOOLS);
    ck_assert_int_eq(kvq_cli_common(KVQ_COPT_MODEL, NULL, false).short_name, 'm');
    ck_assert_int_eq(kvq_cli_common(KVQ_COPT_THREADS, NULL, false).short_name, 'j');
    ck_assert_ptr_null(kvq_cli_common(KVQ_COPT_COUNT, NULL, false).name);
}
END_TEST

START_TEST(test_aliases)
{
    const char *text = NULL, *ctx = NULL;
    bool help = false;
    kvq_opt tab[] = {
        kvq_cli_common(KVQ_COPT_TEXT, &text, false),
        {"ctx", 'c', KVQ_OPT_STRING, &ctx, "N", "window", NULL, 0, 0, false},
    };
    kvq_err e = {0};
    char *a1[] = {"prog", "--file", "a.txt", "--ctx-size=512"};
    int given[2];
    ck_assert_int_eq(kvq_cli_parse_given("prog", "", tab, 2, 4, a1, NULL, &help, given, &e), KVQ_OK);
    ck_assert_str_eq(text, "a.txt");
    ck_assert_str_eq(ctx, "512");
    ck_assert_int_eq(given[0], 1);
    ck_assert_int_eq(given[1], 3);
    char *a2[] = {"prog", "--ctx-size", "64", "--text", "b.txt"};
    ck_assert_int_eq(kvq_cli_parse("prog", "", tab, 2, 5, a2, NULL, &help, &e), KVQ_OK);
    ck_assert_str_eq(ctx, "64");
    ck_assert_str_eq(text, "b.txt");
    /* an alias of an option the table lacks is an unknown option; a prefix of an alias is none */
    char *a3[] = {"prog", "--file", "c.txt"};
    ck_assert_int_eq(kvq_cli_parse("prog", "", tab + 1, 1, 3, a3, NULL, &help, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "unknown option '--file'"), "%s", e.msg);
    char *a4[] = {"prog", "--ctx-siz", "1"};
    ck_assert_int_eq(kvq_cli_parse("prog", "", tab, 2, 3, a4, NULL, &help, &e), KVQ_EINVAL);
    ck_assert_str_eq(kvq_cli_alias_of("ctx-size"), "ctx");
    ck_assert_str_eq(kvq_cli_alias_of("file"), "text");
    ck_assert_ptr_null(kvq_cli_alias_of("ctx"));
    /* --help names them */
    char buf[4096] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    kvq_cli_usage(f, "prog", "", tab, 2);
    fclose(f);
    ck_assert_msg(strstr(buf, "(alias --file)") && strstr(buf, "(alias --ctx-size)"), "%s", buf);
    /* in the binaries: kveval --ctx-size and --threads (and --file) run as --ctx and -j */
    static opt_set s;
    KVQ_SKIP_IF(!all_options(&s), "the binaries are not built");
    int n_ctx = 0;
    for (int i = 0; i < s.n; i++)
        if (!strcmp(s.r[i].lng, "ctx")) n_ctx += strstr(s.r[i].help, "(alias --ctx-size)") != NULL;
        else if (!strcmp(s.r[i].lng, "text")) ck_assert_msg(strstr(s.r[i].help, "(alias --file)"), "%s", s.r[i].tool);
    ck_assert_int_eq(n_ctx, 1);
    char bin[512], model[4096], tok[4096], src[4096], cmd[16384];
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/stories260K.bin") ||
                    !kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(src, sizeof src, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared tiny model or wikitext-2 absent");
    kvq_test_bin(bin, sizeof bin, "kveval");
    snprintf(cmd, sizeof cmd, "head -c 4000 %s > /tmp/kvq_conv_%d.tokens && %s -m %s --tokenizer %s --file /tmp/kvq_conv_%d.tokens "
             "--ctx-size 64 --threads 1 --max-windows 2 -s int4 -q --json - 2>&1; rm -f /tmp/kvq_conv_%d.tokens",
             src, (int)getpid(), bin, model, tok, (int)getpid(), (int)getpid());
    int rc;
    char *out = run_capture(cmd, &rc);
    ck_assert_msg(out && rc == 0, "exit %d: %s", rc, out ? out : "");
    cJSON *root = cJSON_Parse(out);
    ck_assert_msg(root, "%s", out);
    ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "protocol"), "ctx")->valueint, 64);
    ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "protocol"), "windows")->valueint, 2);
    cJSON_Delete(root);
    free(out);
}
END_TEST

/* ---- docs/JSON.md ---------------------------------------------------------------------------- */

#define MAX_KEYS 1024
typedef struct {
    char schema[48], path[160], type[64];
} doc_key;

static doc_key g_doc[MAX_KEYS];
static int g_ndoc;

/* The key tables of docs/JSON.md: under a heading "## `kvq.NAME`", rows "| `path` | type | ...". */
static void read_doc(void)
{
    size_t n;
    char *d = kvq_test_slurp("docs/JSON.md", &n);
    ck_assert_msg(d, "docs/JSON.md missing");
    g_ndoc = 0;
    char schema[48] = "";
    for (char *line = strtok(d, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "## `", 4)) {
            snprintf(schema, sizeof schema, "%.*s", (int)strcspn(line + 4, "`"), line + 4);
            continue;
        }
        if (strncmp(line, "| `", 3) || !*schema) continue;
        doc_key *k = &g_doc[g_ndoc];
        snprintf(k->schema, sizeof k->schema, "%s", schema);
        snprintf(k->path, sizeof k->path, "%.*s", (int)strcspn(line + 3, "`"), line + 3);
        const char *c = strchr(line + 3 + strlen(k->path) + 1, '|');
        ck_assert_msg(c, "docs/JSON.md: no type column in '%s'", line);
        c += strspn(c + 1, " ") + 1;
        snprintf(k->type, sizeof k->type, "%.*s", (int)strcspn(c, "|"), c);
        ck_assert_int_lt(++g_ndoc, MAX_KEYS);
    }
    free(d);
    ck_assert_int_gt(g_ndoc, 100);
}

static const doc_key *doc_find(const char *schema, const char *path)
{
    for (int i = 0; i < g_ndoc; i++)
        if (!strcmp(g_doc[i].schema, schema) && !strcmp(g_doc[i].path, path)) return &g_doc[i];
    return NULL;
}

/* A documented path that starts with prefix + "." + a placeholder "<name>": the placeholder. */
static bool doc_placeholder(const char *schema, const char *prefix, char *out, size_t n)
{
    size_t pl = strlen(prefix);
    for (int i = 0; i < g_ndoc; i++) {
        const char *p = g_doc[i].path;
        if (strcmp(g_doc[i].schema, schema) || strncmp(p, prefix, pl) || p[pl] != '.' || p[pl + 1] != '<') continue;
        snprintf(out, n, "%.*s", (int)strcspn(p + pl + 1, "."), p + pl + 1);
        return true;
    }
    return false;
}

static bool doc_has_prefix(const char *schema, const char *path)
{
    size_t pl = strlen(path);
    for (int i = 0; i < g_ndoc; i++)
        if (!strcmp(g_doc[i].schema, schema) && !strncmp(g_doc[i].path, path, pl) &&
            (g_doc[i].path[pl] == 0 || g_doc[i].path[pl] == '.' || g_doc[i].path[pl] == '['))
            return true;
    return false;
}

static int g_nchecked;

/* Every key under `v` (at `path`) is documented with a type that admits its value. */
static void check_keys(const char *schema, const char *path, const cJSON *v, bool element)
{
    if (*path && !element) { /* (an array element: its array's row describes it) */
        const doc_key *k = doc_find(schema, path);
        ck_assert_msg(k, "%s: key '%s' is not in docs/JSON.md", schema, path);
        const char *t = cJSON_IsNull(v) ? "null" : cJSON_IsBool(v) ? "boolean" : cJSON_IsNumber(v) ? "number"
                      : cJSON_IsString(v) ? "string" : cJSON_IsArray(v) ? "array" : "object";
        bool ok = strstr(k->type, t) != NULL;
        if (cJSON_IsNumber(v) && strstr(k->type, "integer")) ok = v->valuedouble == (double)(long long)v->valuedouble;
        ck_assert_msg(ok, "%s: '%s' is %s, docs/JSON.md says '%s'", schema, path, t, k->type);
        g_nchecked++;
    }
    char sub[256];
    if (cJSON_IsArray(v)) {
        snprintf(sub, sizeof sub, "%s[]", path);
        for (const cJSON *c = v->child; c; c = c->next)
            if (cJSON_IsObject(c) || cJSON_IsArray(c)) check_keys(schema, sub, c, true);
    } else if (cJSON_IsObject(v)) {
        for (const cJSON *c = v->child; c; c = c->next) {
            snprintf(sub, sizeof sub, "%s%s%s", path, *path ? "." : "", c->string);
            char ph[64];
            if (!doc_has_prefix(schema, sub) && doc_placeholder(schema, path, ph, sizeof ph))
                snprintf(sub, sizeof sub, "%s%s%s", path, *path ? "." : "", ph);
            check_keys(schema, sub, c, false);
        }
    }
}

static void check_report(const char *file, const char *schema)
{
    size_t n;
    char *txt = kvq_test_slurp(file, &n);
    ck_assert_msg(txt, "%s not written", file);
    cJSON *root = cJSON_Parse(txt);
    ck_assert_msg(root, "%s: not JSON", file);
    const cJSON *s = cJSON_GetObjectItem(root, "schema");
    ck_assert_msg(cJSON_IsObject(s) && cJSON_IsString(cJSON_GetObjectItem(s, "name")), "%s: no schema", file);
    ck_assert_str_eq(cJSON_GetObjectItem(s, "name")->valuestring, schema);
    ck_assert_int_eq(cJSON_GetObjectItem(s, "version")->valueint,
                     !strcmp(schema, "kvq.kveval") ? KVQ_JSON_KVEVAL_VERSION
                     : !strcmp(schema, "kvq.kvstat") ? KVQ_JSON_KVSTAT_VERSION
                     : !strcmp(schema, "kvq.kveval.decode") ? KVQ_JSON_DECODE_VERSION : KVQ_JSON_PASSKEY_VERSION);
    ck_assert_str_eq(cJSON_GetObjectItem(root, "version")->valuestring, KVQ_VERSION);
    int before = g_nchecked;
    check_keys(schema, "", root, false);
    fprintf(stderr, "INFO %s: %d keys documented\n", schema, g_nchecked - before);
    cJSON_Delete(root);
    free(txt);
}

START_TEST(test_json_keys_documented)
{
    read_doc();
    char kvdump[512], kvcalib[512], kveval[512], kvstat[512], model[4096], tok[4096], src[4096];
    KVQ_SKIP_IF(!kvq_test_bin(kvdump, sizeof kvdump, "kvdump") || !kvq_test_bin(kvcalib, sizeof kvcalib, "kvcalib") ||
                    !kvq_test_bin(kveval, sizeof kveval, "kveval") || !kvq_test_bin(kvstat, sizeof kvstat, "kvstat"),
                "the binaries are not built");
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/stories260K.bin") ||
                    !kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(src, sizeof src, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared tiny model or wikitext-2 absent");
    char dir[128];
    static char cmd[1 << 17];
    snprintf(dir, sizeof dir, "/tmp/kvq_test_conventions_%ld", (long)getpid());
    /* a dump with attention statistics and Fisher information, a nuq artifact and an fp8 one, the
     * kvstat report with quantization error, kveval over schemes whose families describe parameters
     * (int groups, KIVI, fp8, llama.cpp blocks, heavy hitters, IntactKV, zipcache, skvq, mikv, qaq, turboquant), the passkey report,
     * the decode report */
    snprintf(cmd, sizeof cmd,
             "set -e; rm -rf %1$s; mkdir -p %1$s; head -c 12000 %2$s > %1$s/t.tokens; "
             "%3$s -m %4$s --tokenizer %5$s -t %1$s/t.tokens -n 2 -L 48 --fisher --attn-stats -o %1$s/d.h5 -q; "
             "%6$s %1$s/d.h5 --method nuq --bits 3 --outliers 0.01 -o %1$s/nuq.safetensors -q; "
             "%6$s %1$s/d.h5 --method fp8 -o %1$s/fp8.safetensors -q; "
             "%6$s %1$s/d.h5 --method skvq --bits 2 --group 8 -o %1$s/skvq.safetensors -q; "
             "%6$s intactkv -m %4$s --tokenizer %5$s --base %1$s/nuq.safetensors --prefix bos -o %1$s/ikv.safetensors -q; "
             "%7$s %1$s/d.h5 --artifact %1$s/nuq.safetensors --json %1$s/kvstat.json -q > /dev/null; "
             "%8$s -m %4$s --tokenizer %5$s -t %1$s/t.tokens --ctx 48 -w 2 -q --json %1$s/kveval.json "
             "-a %1$s/nuq.safetensors -a %1$s/fp8.safetensors -a %1$s/ikv.safetensors -a %1$s/skvq.safetensors "
             "-s fp16 -s int4-g16 -s kivi2-g8-r16 -s nuq3-1%%+artifact1 -s fp8-tensor+artifact2 -s e5m2 -s q8_0 "
             "-s nuq3-1%%+artifact3+intactkv -s hh2 -s zipcache-h4-l2-w8-n4-p50%% -s skvq2-w8 -s mikv-nobal "
             "-s qaq-k0.003-v0.02-w3-q60 -s turboquant-k3v4-nc-b1 > /dev/null; "
             "%8$s --task passkey -m %4$s --tokenizer %5$s --passkey-lengths 200 --passkey-depths 0,100 -s int4 -q "
             "--json %1$s/passkey.json > /dev/null; "
             "%8$s --task decode -m %4$s --tokenizer %5$s -t %1$s/t.tokens -a %1$s/nuq.safetensors -s nuq3-1%% --prompts 2 "
             "--prompt-len 8 --steps 6 --noise-floor --device cpu -q --json %1$s/decode.json > /dev/null",
             dir, src, kvdump, model, tok, kvcalib, kvstat, kveval);
    int rc;
    char *out = run_capture(cmd, &rc);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, out ? out : "");
    free(out);
    char p[256];
    snprintf(p, sizeof p, "%s/kveval.json", dir);
    check_report(p, "kvq.kveval");
    snprintf(p, sizeof p, "%s/passkey.json", dir);
    check_report(p, "kvq.kveval.passkey");
    snprintf(p, sizeof p, "%s/decode.json", dir);
    check_report(p, "kvq.kveval.decode");
    snprintf(p, sizeof p, "%s/kvstat.json", dir);
    check_report(p, "kvq.kvstat");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert(system(cmd) == 0);
}
END_TEST

/* Every compile rule of the Makefile writes a dependency file, nvcc's too: a CUDA object that did not
 * depend on the C headers it includes kept the layout of kvq_family / kvq_kv_desc from before a header
 * change, and the GPU binaries crashed at run time (no CI machine runs them). */
START_TEST(test_build_dependencies)
{
    size_t n;
    char *mk = kvq_test_slurp("Makefile", &n);
    ck_assert_msg(mk, "cannot read the Makefile");
    ck_assert_msg(strstr(mk, "-MMD -MP"), "CFLAGS lack -MMD -MP");
    int rules = 0;
    for (char *line = strtok(mk, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != '\t') continue; /* recipe lines only */
        bool cc = strstr(line, "$(CC) $(CFLAGS) -c") != NULL, nv = strstr(line, "$(NVCC) $(NVCCFLAGS)") && strstr(line, " -c ");
        if (!cc && !nv) continue;
        rules++;
        if (nv) ck_assert_msg(strstr(line, "-MMD") && strstr(line, "-MP") && strstr(line, "-MF"),
                              "an nvcc compile rule without a dependency file (-MMD -MP -MF): %s", line);
    }
    ck_assert_int_ge(rules, 3);
    free(mk);
}
END_TEST

/* Host code in .cu files that uses OpenMP is compiled with it: nvcc's host compiler got no -fopenmp, so
 * `#ifdef _OPENMP` blocks in forward_cuda.cu vanished and the GPU path's host schedule attention ran on one
 * thread whatever OMP_NUM_THREADS said (and an unguarded `#pragma omp` would be ignored silently). */
START_TEST(test_cuda_host_openmp)
{
    char *mk = kvq_test_slurp("Makefile", NULL);
    ck_assert_msg(mk, "cannot read the Makefile");
    char *nv = strstr(mk, "NVCCFLAGS ?=");
    ck_assert_msg(nv, "the Makefile has no NVCCFLAGS ?= line");
    char *eol = strchr(nv, '\n');
    if (eol) *eol = 0;
    bool has = strstr(nv, "-fopenmp") != NULL;
    FILE *ls = popen("grep -rlE '_OPENMP|#pragma omp|omp_get' --include='*.cu' --include='*.cuh' kernels tests 2>/dev/null", "r");
    ck_assert(ls != NULL);
    char path[512];
    int users = 0;
    while (fgets(path, sizeof path, ls)) {
        users++;
        ck_assert_msg(has, "%.*s uses OpenMP but NVCCFLAGS (%s) does not pass -fopenmp to the host compiler",
                      (int)strcspn(path, "\n"), path, nv);
    }
    pclose(ls);
    ck_assert_msg(users > 0, "no .cu file uses OpenMP: the check would pass vacuously (forward_cuda.cu's host schedule does)");
    free(mk);
}
END_TEST

/* GitHub's heading anchor: lower case, ASCII letters/digits/'-'/'_' kept, spaces to '-', the rest (punctuation,
 * backticks, non-ASCII symbols such as '×') dropped; the n-th repeat of a slug gets "-n" */
static void md_slug(const char *h, char *out, size_t n)
{
    size_t k = 0;
    for (const unsigned char *c = (const unsigned char *)h; *c && k + 1 < n; c++) {
        if (isalnum(*c) || *c == '-' || *c == '_') out[k++] = (char)tolower(*c);
        else if (*c == ' ') out[k++] = '-';
    }
    out[k] = 0;
}

typedef struct {
    char **slug;
    size_t n, cap;
} slug_set;

static void md_headings(const char *text, slug_set *set)
{
    bool fence = false;
    for (const char *l = text; l && *l;) {
        const char *e = strchr(l, '\n');
        size_t len = e ? (size_t)(e - l) : strlen(l);
        if (len >= 3 && !strncmp(l, "```", 3)) fence = !fence;
        else if (!fence && l[0] == '#') {
            const char *h = l;
            while (*h == '#') h++;
            while (*h == ' ') h++;
            char head[512], sl[512];
            snprintf(head, sizeof head, "%.*s", (int)(len - (size_t)(h - l)), h);
            md_slug(head, sl, sizeof sl);
            int dup = 0;
            for (size_t i = 0; i < set->n; i++) {
                const char *x = set->slug[i];
                size_t sn = strlen(sl);
                if (!strncmp(x, sl, sn) && (x[sn] == 0 || (x[sn] == '-' && isdigit((unsigned char)x[sn + 1])))) dup++;
            }
            if (set->n == set->cap) {
                set->cap = set->cap ? 2 * set->cap : 64;
                set->slug = realloc(set->slug, set->cap * sizeof *set->slug);
            }
            char full[530];
            if (dup) snprintf(full, sizeof full, "%s-%d", sl, dup);
            else snprintf(full, sizeof full, "%s", sl);
            set->slug[set->n++] = strdup(full);
        }
        l = e ? e + 1 : NULL;
    }
}

static bool slug_in(const slug_set *set, const char *a)
{
    for (size_t i = 0; i < set->n; i++)
        if (!strcmp(set->slug[i], a)) return true;
    return false;
}

static void slug_free(slug_set *set)
{
    for (size_t i = 0; i < set->n; i++) free(set->slug[i]);
    free(set->slug);
}

/* Every relative link in the repository's markdown resolves: the file exists and, with #anchor into a
 * markdown file, a heading of that file has that anchor. (BENCHMARKS.md's index kept linking four sections
 * an edit had deleted; ARTIFACT.md linked a KVCACHE.md next to itself that lives in formats/.) */
START_TEST(test_doc_links)
{
    FILE *ls = popen("git ls-files '*.md' 2>/dev/null", "r");
    ck_assert(ls != NULL);
    char path[512];
    int files = 0, links = 0, anchors = 0, bad = 0;
    static char report[16384];
    report[0] = 0;
    while (fgets(path, sizeof path, ls)) {
        path[strcspn(path, "\n")] = 0;
        char *text = kvq_test_slurp(path, NULL);
        ck_assert_msg(text, "cannot read %s", path);
        files++;
        char dir[512];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) slash[1] = 0;
        else dir[0] = 0;
        bool fence = false;
        for (char *l = text; l && *l;) {
            char *e = strchr(l, '\n');
            if (e) *e = 0;
            if (!strncmp(l, "```", 3)) fence = !fence;
            for (char *p = l; !fence && (p = strstr(p, "](")) != NULL; p += 2) {
                char *q = p + 2, *end = strchr(q, ')');
                if (!end) break;
                char tgt[512];
                snprintf(tgt, sizeof tgt, "%.*s", (int)(end - q), q);
                if (strstr(tgt, "://") || !strncmp(tgt, "mailto:", 7) || strchr(tgt, ' ') || !tgt[0]) continue;
                char *hash = strchr(tgt, '#');
                char anchor[512] = "";
                if (hash) {
                    snprintf(anchor, sizeof anchor, "%s", hash + 1);
                    *hash = 0;
                }
                char file[1100];
                if (tgt[0]) snprintf(file, sizeof file, "%s%s", dir, tgt);
                else snprintf(file, sizeof file, "%s", path);
                links++;
                size_t rl = strlen(report);
                if (access(file, F_OK) != 0) {
                    bad++;
                    snprintf(report + rl, sizeof report - rl, "\n  %s: link '%s%s%s' names %s, which does not exist", path, tgt,
                             anchor[0] ? "#" : "", anchor, file);
                    continue;
                }
                size_t fl = strlen(file);
                if (anchor[0] && fl > 3 && !strcmp(file + fl - 3, ".md")) {
                    char *t2 = kvq_test_slurp(file, NULL);
                    ck_assert(t2 != NULL);
                    slug_set set = {0};
                    md_headings(t2, &set);
                    anchors++;
                    if (!slug_in(&set, anchor)) {
                        bad++;
                        snprintf(report + rl, sizeof report - rl, "\n  %s: link to %s#%s: no heading there has that anchor", path,
                                 file, anchor);
                    }
                    slug_free(&set);
                    free(t2);
                }
            }
            l = e ? e + 1 : NULL;
        }
        free(text);
    }
    pclose(ls);
    ck_assert_msg(bad == 0, "%d broken markdown link(s):%s", bad, report);
    /* not vacuous: the repository's docs link to files and to sections */
    ck_assert_msg(files >= 10 && links >= 20 && anchors >= 10, "%d markdown files, %d links, %d anchors checked", files, links,
                  anchors);
}
END_TEST

/* A make recipe that runs a script reading KVQ_BIN_DIR passes the build's binaries ($(BIN)): `make CUDA=0
 * demo` ran scripts/demo.sh on bin/ (absent in a CPU build: "bin/kvdump is not built"; stale otherwise). */
START_TEST(test_make_scripts_bin_dir)
{
    char *mk = kvq_test_slurp("Makefile", NULL);
    ck_assert_msg(mk, "cannot read the Makefile");
    int checked = 0;
    for (char *l = mk; l && *l;) {
        char *e = strchr(l, '\n');
        if (e) *e = 0;
        const char *sc = l[0] == '\t' ? strstr(l, "scripts/") : NULL;
        if (sc) {
            char script[256];
            size_t n = strcspn(sc, " \t;|&)");
            snprintf(script, sizeof script, "%.*s", (int)n, sc);
            char *body = strstr(script, ".sh") ? kvq_test_slurp(script, NULL) : NULL;
            if (body && strstr(body, "KVQ_BIN_DIR")) {
                checked++;
                ck_assert_msg(strstr(l, "KVQ_BIN_DIR="), "Makefile: '%s' runs %s, which reads KVQ_BIN_DIR, without setting it", l + 1,
                              script);
            }
            free(body);
        }
        l = e ? e + 1 : NULL;
    }
    ck_assert_msg(checked >= 1, "no recipe runs a script that reads KVQ_BIN_DIR (demo does): the check is vacuous (%d)", checked);
    free(mk);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("conventions");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_version);
    tcase_add_test(tc, test_one_meaning_per_option);
    tcase_add_test(tc, test_aliases);
    tcase_add_test(tc, test_json_keys_documented);
    tcase_add_test(tc, test_build_dependencies);
    tcase_add_test(tc, test_cuda_host_openmp);
    tcase_add_test(tc, test_doc_links);
    tcase_add_test(tc, test_make_scripts_bin_dir);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
