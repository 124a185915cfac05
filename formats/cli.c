/* cli.c — see cli.h. */
#include "cli.h"
#include "outfile.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>

#include "version.h"

bool kvq_parse_long(const char *s, long *out)
{
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}

bool kvq_parse_double(const char *s, double *out)
{
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

/* the shared options (cli.h); targets are filled in by kvq_cli_common */
static const kvq_opt COMMON[KVQ_COPT_COUNT] = {
    [KVQ_COPT_MODEL] = {"model", 'm', KVQ_OPT_STRING, NULL, "PATH", "model: GGUF file, HF directory or llama2.c .bin", NULL, 0, 0,
                        false},
    [KVQ_COPT_TEXT] = {"text", 't', KVQ_OPT_STRING, NULL, "FILE",
                       "text the model reads: raw, WikiText-2 .tokens (e.g. wikitext-2/wiki.valid.tokens) or JSONL", NULL, 0, 0,
                       false},
    [KVQ_COPT_FORMAT] = {"format", 0, KVQ_OPT_CHOICE, NULL, "FMT", "format of --text (default: from the file name)",
                         "raw|wikitext-tokens|jsonl", 0, 0, false},
    [KVQ_COPT_TOKENIZER] = {"tokenizer", 0, KVQ_OPT_STRING, NULL, "FILE",
                            "tokenizer (needed for llama2.c models; default: the model's own)", NULL, 0, 0, false},
    [KVQ_COPT_DEVICE] = {"device", 0, KVQ_OPT_STRING, NULL, "DEV",
                         "where the model runs: cpu, cuda, cuda:N (GPU N) or auto (default: cuda when a GPU is present, else cpu)",
                         NULL, 0, 0, false},
    [KVQ_COPT_DEVICES] = {"devices", 0, KVQ_OPT_STRING, NULL, "LIST",
                          "GPUs of this host for a model larger than one GPU: all, or cuda:N,M,... in pipeline order (layers split "
                          "by memory, docs/MULTIGPU.md; needs a build with NCCL); one GPU is --device cuda:N",
                          NULL, 0, 0, false},
    [KVQ_COPT_MATH] = {"math", 0, KVQ_OPT_CHOICE, NULL, "M",
                       "GPU arithmetic: exact (fp32 weights, TF32 off), tf32, or bf16 (bf16 weights and GEMM inputs, fp32 "
                       "accumulation, attention on bf16 tensor cores, ~1e-2 relative); fast modes are labelled in the "
                       "output [default exact]",
                       "exact|tf32|bf16", 0, 0, false},
    [KVQ_COPT_WEIGHTS] = {"weights", 0, KVQ_OPT_CHOICE, NULL, "W",
                          "how the weight matrices are held: f32 (exact), bf16, f16, native (as stored in the file: GGUF blocks, "
                          "bf16/f16 safetensors; lossless) or auto (f32 up to 6 GiB of fp32 matrices, else native with fp32 files "
                          "as bf16); arithmetic is fp32 [default auto]",
                          "auto|f32|bf16|f16|native", 0, 0, false},
    [KVQ_COPT_THREADS] = {"threads", 'j', KVQ_OPT_INT, NULL, "N", "CPU worker threads (0: OpenMP default)", NULL, 0, 4096, false},
    [KVQ_COPT_QUIET] = {"quiet", 'q', KVQ_OPT_FLAG, NULL, NULL, "no progress, notes or summary lines (errors and the requested outputs only)", NULL,
                        0, 0, false},
    [KVQ_COPT_VERSION] = {"version", 0, KVQ_OPT_FLAG, NULL, NULL, "print the kvq version and build (CPU/CUDA)", NULL, 0, 0, false},
};

kvq_opt kvq_cli_common(kvq_common_opt which, void *target, bool required)
{
    kvq_opt o = {0};
    if ((unsigned)which >= KVQ_COPT_COUNT) return o;
    o = COMMON[which];
    o.target = target;
    o.required = required;
    return o;
}

static const struct {
    const char *alias, *name;
} ALIASES[] = {{"ctx-size", "ctx"}, {"file", "text"}};

const char *kvq_cli_alias_of(const char *name)
{
    for (size_t i = 0; i < sizeof ALIASES / sizeof *ALIASES; i++)
        if (!strcmp(ALIASES[i].alias, name)) return ALIASES[i].name;
    return NULL;
}

void kvq_cli_print_version(FILE *f, const char *prog, const char *build)
{
    fprintf(f, "%s (kvq) %s, %s build\n", prog, KVQ_VERSION, build);
}

static bool choice_ok(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *p = choices; p && *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return true;
        p = bar ? bar + 1 : NULL;
    }
    return false;
}

static kvq_status set_value(const kvq_opt *o, const char *v, kvq_err *err)
{
    switch (o->type) {
    case KVQ_OPT_FLAG: *(bool *)o->target = true; return KVQ_OK;
    case KVQ_OPT_INT: {
        long x;
        if (!kvq_parse_long(v, &x))
            return kvq_fail(err, KVQ_EINVAL, "--%s: expected an integer, found '%s'", o->name, v);
        if (o->min < o->max && (x < o->min || x > o->max))
            return kvq_fail(err, KVQ_EINVAL, "--%s: expected %.0f..%.0f, found %ld", o->name, o->min, o->max, x);
        *(long *)o->target = x;
        return KVQ_OK;
    }
    case KVQ_OPT_FLOAT: {
        double x;
        if (!kvq_parse_double(v, &x))
            return kvq_fail(err, KVQ_EINVAL, "--%s: expected a finite number, found '%s'", o->name, v);
        if (o->min < o->max && (x < o->min || x > o->max))
            return kvq_fail(err, KVQ_EINVAL, "--%s: expected %.10g..%.10g, found %.10g", o->name, o->min, o->max, x);
        *(double *)o->target = x;
        return KVQ_OK;
    }
    case KVQ_OPT_STRING:
        if (!*v) return kvq_fail(err, KVQ_EINVAL, "--%s: expected a non-empty value", o->name);
        *(const char **)o->target = v;
        return KVQ_OK;
    case KVQ_OPT_CHOICE:
        if (!choice_ok(o->choices, v))
            return kvq_fail(err, KVQ_EINVAL, "--%s: expected one of %s, found '%s'", o->name, o->choices, v);
        *(const char **)o->target = v;
        return KVQ_OK;
    case KVQ_OPT_LIST: {
        kvq_strlist *l = o->target;
        if (l->n >= KVQ_STRLIST_MAX)
            return kvq_fail(err, KVQ_EINVAL, "--%s: at most %d values", o->name, KVQ_STRLIST_MAX);
        l->v[l->n++] = v;
        return KVQ_OK;
    }
    }
    return kvq_fail(err, KVQ_EINVAL, "--%s: bad option table", o->name);
}

kvq_status kvq_cli_parse(const char *prog, const char *summary, const kvq_opt *opts, int n_opts,
                         int argc, char **argv, kvq_strlist *pos, bool *help, kvq_err *err)
{
    return kvq_cli_parse_given(prog, summary, opts, n_opts, argc, argv, pos, help, NULL, err);
}

kvq_status kvq_cli_parse_given(const char *prog, const char *summary, const kvq_opt *opts, int n_opts, int argc, char **argv,
                               kvq_strlist *pos, bool *help, int *given_at, kvq_err *err)
{
    *help = false;
    bool seen[256] = {0};
    if (given_at)
        for (int k = 0; k < n_opts; k++) given_at[k] = 0;
    if (n_opts > 256) return kvq_fail(err, KVQ_EINVAL, "%s: too many options in table", prog);
    bool only_pos = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (only_pos || a[0] != '-' || a[1] == 0) {
            if (!pos) return kvq_fail(err, KVQ_EINVAL, "unexpected argument '%s' (see --help)", a);
            if (pos->n >= KVQ_STRLIST_MAX) return kvq_fail(err, KVQ_EINVAL, "too many arguments");
            pos->v[pos->n++] = a;
            continue;
        }
        if (!strcmp(a, "--")) { only_pos = true; continue; }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            kvq_cli_usage(stdout, prog, summary, opts, n_opts);
            *help = true;
            return KVQ_OK;
        }
        const kvq_opt *o = NULL;
        const char *val = NULL;
        int idx = -1;
        if (a[1] == '-') {
            const char *name = a + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            for (int k = 0; k < n_opts; k++)
                if (strlen(opts[k].name) == len && !strncmp(opts[k].name, name, len)) { o = &opts[k]; idx = k; }
            for (size_t j = 0; !o && j < sizeof ALIASES / sizeof *ALIASES; j++) /* --ctx-size = --ctx, ... */
                if (strlen(ALIASES[j].alias) == len && !strncmp(ALIASES[j].alias, name, len))
                    for (int k = 0; k < n_opts; k++)
                        if (!strcmp(opts[k].name, ALIASES[j].name)) { o = &opts[k]; idx = k; }
            if (eq) val = eq + 1;
        } else if (a[2] == 0) {
            for (int k = 0; k < n_opts; k++)
                if (opts[k].short_name && opts[k].short_name == a[1]) { o = &opts[k]; idx = k; }
        }
        if (!o) return kvq_fail(err, KVQ_EINVAL, "unknown option '%s' (see %s --help)", a, prog);
        if (o->type == KVQ_OPT_FLAG) {
            if (val) return kvq_fail(err, KVQ_EINVAL, "--%s takes no value, found '=%s'", o->name, val);
        } else if (!val) {
            if (i + 1 >= argc) return kvq_fail(err, KVQ_EINVAL, "--%s: expected a value %s, found the end of the command line", o->name, o->metavar ? o->metavar : "");
            val = argv[++i];
        }
        if (given_at) given_at[idx] = val == argv[i] ? i - 1 : i; /* the word that named the option */
        KVQ_TRY(set_value(o, val, err));
        seen[idx] = true;
    }
    /* --version, like --help, needs none of the required options (kvdump --version asked for --model) */
    for (int k = 0; k < n_opts; k++)
        if (seen[k] && opts[k].type == KVQ_OPT_FLAG && !strcmp(opts[k].name, "version") && *(bool *)opts[k].target) return KVQ_OK;
    for (int k = 0; k < n_opts; k++)
        if (opts[k].required && !seen[k])
            return kvq_fail(err, KVQ_EINVAL, "missing required option --%s %s (see %s --help)", opts[k].name,
                            opts[k].metavar ? opts[k].metavar : "", prog);
    return KVQ_OK;
}

void kvq_cli_usage(FILE *f, const char *prog, const char *summary, const kvq_opt *opts, int n_opts)
{
    fprintf(f, "usage: %s [options]\n\n%s\n\noptions:\n", prog, summary);
    for (int k = 0; k < n_opts; k++) {
        const kvq_opt *o = &opts[k];
        char left[96];
        const char *mv = o->metavar ? o->metavar : (o->type == KVQ_OPT_FLAG ? "" : "VALUE");
        if (o->short_name) snprintf(left, sizeof left, "-%c, --%s%s%s", o->short_name, o->name, *mv ? " " : "", mv);
        else snprintf(left, sizeof left, "    --%s%s%s", o->name, *mv ? " " : "", mv);
        /* help from column 33, on the next line after a long left column (tests/test_conventions.c reads it) */
        if (strlen(left) > 30) fprintf(f, "  %s\n%33s%s", left, "", o->help ? o->help : "");
        else fprintf(f, "  %-30s %s", left, o->help ? o->help : "");
        for (size_t j = 0; j < sizeof ALIASES / sizeof *ALIASES; j++)
            if (!strcmp(ALIASES[j].name, o->name)) fprintf(f, " (alias --%s)", ALIASES[j].alias);
        if (o->required) fprintf(f, " (required)");
        else switch (o->type) {
        case KVQ_OPT_INT: fprintf(f, " [default %ld]", *(long *)o->target); break;
        case KVQ_OPT_FLOAT: fprintf(f, " [default %g]", *(double *)o->target); break;
        case KVQ_OPT_STRING: case KVQ_OPT_CHOICE:
            if (*(const char **)o->target) fprintf(f, " [default %s]", *(const char **)o->target);
            break;
        default: break;
        }
        if (o->type == KVQ_OPT_CHOICE) fprintf(f, " {%s}", o->choices);
        fputc('\n', f);
    }
    fprintf(f, "  %-30s %s\n", "-h, --help", "show this help and exit");
}

/* the canonical form of a path that may not exist yet: realpath of the whole, else of its
 * directory + "/" + its last component, else the path as written */
static void canon_path(const char *p, char *out, size_t cap)
{
    char buf[PATH_MAX];
    if (realpath(p, buf)) { snprintf(out, cap, "%s", buf); return; }
    const char *slash = strrchr(p, '/');
    char dir[PATH_MAX];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == p) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - p), p);
    if (realpath(dir, buf)) snprintf(out, cap, "%s/%s", buf, slash ? slash + 1 : p);
    else snprintf(out, cap, "%s", p);
}

static bool same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    const bool ea = stat(a, &sa) == 0, eb = stat(b, &sb) == 0;
    if (ea && eb) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    if (ea != eb) return false;
    char ca[PATH_MAX + 256], cb[PATH_MAX + 256];
    canon_path(a, ca, sizeof ca);
    canon_path(b, cb, sizeof cb);
    return strcmp(ca, cb) == 0;
}

/* The directory that holds p (if p names one) exists and is a directory; trailing slashes of p name p itself
 * ("site/" is in the current directory) */
static kvq_status check_parent(const char *opt, const char *p, kvq_err *err)
{
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') n--;
    const char *slash = NULL;
    for (size_t i = 0; i < n; i++)
        if (p[i] == '/') slash = p + i;
    if (!slash || slash == p) return KVQ_OK;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - p), p);
    struct stat st;
    if (stat(dir, &st) != 0) return kvq_fail(err, KVQ_EINVAL, "%s %s: directory '%s' does not exist", opt, p, dir);
    if (!S_ISDIR(st.st_mode)) return kvq_fail(err, KVQ_EINVAL, "%s %s: '%s' is not a directory", opt, p, dir);
    return KVQ_OK;
}

kvq_status kvq_cli_check_out_dir(const char *opt, const char *dir, const char *what, kvq_err *err)
{
    if (!dir) return KVQ_OK;
    if (!*dir) return kvq_fail(err, KVQ_EINVAL, "%s: empty directory name", opt);
    struct stat st;
    if (stat(dir, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            return kvq_fail(err, KVQ_EINVAL, "%s %s: exists and is not a directory (expected a directory for the %s)", opt, dir, what);
        return KVQ_OK;
    }
    return check_parent(opt, dir, err);
}

bool kvq_cli_given(const kvq_opt *opts, int n_opts, const int *given_at, const char *name)
{
    for (int i = 0; i < n_opts; i++)
        if (given_at[i] && !strcmp(opts[i].name, name)) return true;
    return false;
}

kvq_status kvq_cli_check_renamed_outputs(const kvq_cli_file *outs, int n_outs, kvq_err *err)
{
    for (int i = 0; i < n_outs; i++) {
        struct stat st;
        const char *p = outs[i].path;
        if (!p || stat(p, &st) != 0 || S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) continue; /* (directories: check_outputs) */
        return kvq_fail(err, KVQ_EINVAL, "%s %s: not a regular file (%s); the output is written under a temporary name and renamed into place",
                        outs[i].opt, p,
                        S_ISCHR(st.st_mode) ? "a character device" : S_ISBLK(st.st_mode) ? "a block device"
                        : S_ISFIFO(st.st_mode) ? "a FIFO" : "a socket or other special file");
    }
    return KVQ_OK;
}

kvq_status kvq_cli_check_outputs(const kvq_cli_file *outs, int n_outs, const kvq_cli_file *ins, int n_ins, kvq_err *err)
{
    for (int i = 0; i < n_outs; i++) {
        const char *p = outs[i].path;
        if (!p || !strcmp(p, "-")) continue;
        if (!*p) return kvq_fail(err, KVQ_EINVAL, "%s: empty file name", outs[i].opt);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISDIR(st.st_mode))
            return kvq_fail(err, KVQ_EINVAL, "%s %s: is a directory (expected a file name)", outs[i].opt, p);
        KVQ_TRY(check_parent(outs[i].opt, p, err));
        if (kvq_outfile_read_only(p))
            return kvq_fail(err, KVQ_EINVAL, "%s %s: exists and is read-only; not replaced (make it writable or choose another "
                            "name)", outs[i].opt, p);
        bool special = stat(p, &st) == 0 && !S_ISREG(st.st_mode); /* /dev/null, a FIFO: written in place, may repeat */
        for (int j = 0; j < n_ins; j++)
            if (ins[j].path && same_file(p, ins[j].path))
                return kvq_fail(err, KVQ_EINVAL, "%s %s: the same file as %s %s (the output would replace the input)", outs[i].opt, p,
                                ins[j].opt, ins[j].path);
        for (int j = 0; j < i && !special; j++)
            if (outs[j].path && strcmp(outs[j].path, "-") && same_file(p, outs[j].path))
                return kvq_fail(err, KVQ_EINVAL, "%s %s: the same file as %s %s (two outputs)", outs[i].opt, p, outs[j].opt, outs[j].path);
    }
    return KVQ_OK;
}
