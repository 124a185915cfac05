/* cli.h — declarative command-line options shared by the kvq binaries.
 *
 * Each binary declares a table of kvq_opt; kvq_cli_parse fills the targets,
 * validates every value as a whole string (no "12abc"), checks ranges and
 * choices, and kvq_cli_usage prints --help generated from the same table, with
 * the current value of each target as its default — so help and parser
 * cannot drift (cf. code-style-anchors.md, "habits to avoid" 2).
 * Options are long (--name VALUE or --name=VALUE) with an optional one-letter
 * short form; "--" ends options; other words are positional arguments.
 */
#ifndef KVQ_CLI_H
#define KVQ_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "status.h"

typedef enum {
    KVQ_OPT_FLAG,   /* target: bool*; no value */
    KVQ_OPT_INT,    /* target: long*; range [min, max] when min < max */
    KVQ_OPT_FLOAT,  /* target: double*; range [min, max] when min < max */
    KVQ_OPT_STRING, /* target: const char** (points into argv) */
    KVQ_OPT_LIST,   /* target: kvq_strlist*; repeatable */
    KVQ_OPT_CHOICE  /* target: const char**; value must be one of `choices` ("a|b|c") */
} kvq_opt_type;

#define KVQ_STRLIST_MAX 64
typedef struct {
    const char *v[KVQ_STRLIST_MAX];
    int n;
} kvq_strlist;

typedef struct {
    const char *name;     /* long name, without "--" */
    char short_name;      /* 0 for none */
    kvq_opt_type type;
    void *target;
    const char *metavar;  /* e.g. "N", "FILE" */
    const char *help;     /* one line */
    const char *choices;  /* KVQ_OPT_CHOICE only */
    double min, max;      /* numeric range (inclusive) when min < max */
    bool required;
} kvq_opt;

/* Parse argv[1..]. "-h/--help" prints usage to stdout and sets *help = true
 * (the caller then exits 0). Positional words are stored in `pos` (may be
 * NULL if none are accepted). A flag option named "version", when given,
 * waives the required options (as --help does). Errors name the option, what
 * was expected and what was found, and return KVQ_EINVAL. */
kvq_status kvq_cli_parse(const char *prog, const char *summary, const kvq_opt *opts, int n_opts,
                         int argc, char **argv, kvq_strlist *pos, bool *help, kvq_err *err);

/* kvq_cli_parse, also telling which options the command line gave: given_at
 * [n_opts] (may be NULL) receives, per option, the argv index of the word
 * that named it last ("--name", "--name=value" or "-c"), or 0 if absent. */
kvq_status kvq_cli_parse_given(const char *prog, const char *summary, const kvq_opt *opts, int n_opts, int argc, char **argv,
                               kvq_strlist *pos, bool *help, int *given_at, kvq_err *err);

/* Whether the command line gave option `name` (given_at from kvq_cli_parse_given). */
bool kvq_cli_given(const kvq_opt *opts, int n_opts, const int *given_at, const char *name);

/* Print the generated usage text. */
void kvq_cli_usage(FILE *f, const char *prog, const char *summary, const kvq_opt *opts, int n_opts);

/* A file named on the command line: the option that named it ("--json", or "DUMP" for a
 * positional word) and its path (NULL: not given). */
typedef struct {
    const char *opt;
    const char *path;
} kvq_cli_file;

/* Check, before any work, that the outputs can be written and replace no input:
 * each output (path NULL or "-" = stdout: skipped) must not be an existing
 * directory, its directory must exist, and it must not be the same file as any
 * input (same device and inode; for a path that does not exist yet, the same
 * canonical path) nor as another output. Errors (KVQ_EINVAL), e.g.
 * "--json tok.bin: the same file as --tokenizer tok.bin (the output would replace
 * the input)", "--json nodir/x.json: directory 'nodir' does not exist",
 * "--out d: is a directory (expected a file name)". */
kvq_status kvq_cli_check_outputs(const kvq_cli_file *outs, int n_outs, const kvq_cli_file *ins, int n_ins, kvq_err *err);

/* For outputs written under a temporary name and renamed into place (dumps, artifacts): one
 * that exists must be a regular file (a rename over /dev/null replaced the device node with a
 * regular file). NULL paths are skipped. Errors (KVQ_EINVAL): "--out /dev/null: not a regular
 * file (a character device); the output is written under a temporary name and renamed into place". */
kvq_status kvq_cli_check_renamed_outputs(const kvq_cli_file *outs, int n_outs, kvq_err *err);

/* An output directory (NULL: skipped): an existing directory, or a name to create inside an
 * existing one; checked before any work. `what` says what goes there. Errors (KVQ_EINVAL): "--html
 * f: exists and is not a directory (expected a directory for the WHAT)", and the parent errors of
 * kvq_cli_check_outputs ("directory 'x' does not exist", "'x' is not a directory"). */
kvq_status kvq_cli_check_out_dir(const char *opt, const char *dir, const char *what, kvq_err *err);

/* ---- options shared by the tools -------------------------------------------------------------
 * Declared once (formats/cli.c) so that every tool that takes one gives it the same long name,
 * short letter, metavar, help text and choices (tests/test_conventions.c checks every binary's
 * --help). A tool puts kvq_cli_common(KVQ_COPT_MODEL, &model, true) in its option table; only
 * the target and whether the option is required differ between tools. Targets: const char **
 * for MODEL, TEXT, FORMAT, TOKENIZER, DEVICE, DEVICES, MATH, WEIGHTS; long * for THREADS; bool * for
 * QUIET and VERSION. Short letters: -m model, -t text, -j threads, -q quiet; no tool gives these
 * letters another meaning. */
typedef enum {
    KVQ_COPT_MODEL,     /* -m, --model PATH */
    KVQ_COPT_TEXT,      /* -t, --text FILE (alias --file) */
    KVQ_COPT_FORMAT,    /* --format FMT {raw|wikitext-tokens|jsonl} */
    KVQ_COPT_TOKENIZER, /* --tokenizer FILE */
    KVQ_COPT_DEVICE,    /* --device DEV */
    KVQ_COPT_DEVICES,   /* --devices LIST (several GPUs: pipeline by layers) */
    KVQ_COPT_MATH,      /* --math M {exact|tf32|bf16} */
    KVQ_COPT_WEIGHTS,   /* --weights W {auto|f32|bf16|f16|native} */
    KVQ_COPT_THREADS,   /* -j, --threads N, 0..4096 */
    KVQ_COPT_QUIET,     /* -q, --quiet */
    KVQ_COPT_VERSION,   /* --version */
    KVQ_COPT_COUNT
} kvq_common_opt;

/* The shared entry `which` with its target set (a copy; NULL target if `which` is out of range). */
kvq_opt kvq_cli_common(kvq_common_opt which, void *target, bool required);

/* Long aliases (the names llama.cpp users type): --ctx-size = --ctx, --file = --text. The parser
 * accepts an alias wherever the table has its option, and --help lists it on that option's line
 * ("(alias --ctx-size)"). Returns the option an alias stands for, or NULL if `name` (without
 * "--") is no alias. */
const char *kvq_cli_alias_of(const char *name);

/* The kvq version line of --version: "PROG (kvq) VERSION, BUILD build\n" (build: "CUDA" or
 * "CPU-only"). */
void kvq_cli_print_version(FILE *f, const char *prog, const char *build);

/* Parse a whole string as a number (no trailing garbage); false on failure. */
bool kvq_parse_long(const char *s, long *out);
bool kvq_parse_double(const char *s, double *out);

#endif
