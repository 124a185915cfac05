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
 * NULL if none are accepted). Errors name the option, what was expected and
 * what was found, and return KVQ_EINVAL. */
kvq_status kvq_cli_parse(const char *prog, const char *summary, const kvq_opt *opts, int n_opts,
                         int argc, char **argv, kvq_strlist *pos, bool *help, kvq_err *err);

/* kvq_cli_parse, also telling which options the command line gave: given_at
 * [n_opts] (may be NULL) receives, per option, the argv index of the word
 * that named it last ("--name", "--name=value" or "-c"), or 0 if absent. */
kvq_status kvq_cli_parse_given(const char *prog, const char *summary, const kvq_opt *opts, int n_opts, int argc, char **argv,
                               kvq_strlist *pos, bool *help, int *given_at, kvq_err *err);

/* Print the generated usage text. */
void kvq_cli_usage(FILE *f, const char *prog, const char *summary, const kvq_opt *opts, int n_opts);

/* Parse a whole string as a number (no trailing garbage); false on failure. */
bool kvq_parse_long(const char *s, long *out);
bool kvq_parse_double(const char *s, double *out);

#endif
