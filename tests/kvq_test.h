/* kvq_test.h — shared helpers for the Check suites under tests/.
 * Each tests/test_<name>.c defines `static Suite *suite(void)` and ends with
 * KVQ_TEST_MAIN(suite). Tests run from the repository root.
 * External inputs are optional on a developer's machine: ../shared (override:
 * KVQ_SHARED) and the default model models/SmolLM2-135M-Instruct.Q4_1.gguf
 * (override: KVQ_MODEL). A test whose input is absent prints "SKIP <test>: <why>"
 * and returns — except in CI (the environment variable CI set, e.g. CI=true, as
 * CI services and .ci/run set it), where an absent input is a broken setup and
 * FAILS the test (KVQ_SKIP_IF, kvq_test_skip_missing): a setup that lost ../shared
 * or the model must not turn CI green. Skips that are a choice of the run, not a
 * missing input (sanitizer quick mode, CK_FORK=no), use KVQ_SKIP_OPTIONAL_IF. */
#ifndef KVQ_TEST_H
#define KVQ_TEST_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "family.h"

/* The registry's families as a switchable index (tests that branch on the family). */
enum { KVQ_TEST_FP32, KVQ_TEST_FP16, KVQ_TEST_INT, KVQ_TEST_INT_PC, KVQ_TEST_NUQ, KVQ_TEST_KIVI, KVQ_TEST_FP8, KVQ_TEST_GGML,
       KVQ_TEST_NVFP4, KVQ_TEST_MXFP4, KVQ_TEST_OTHER };
static inline int kvq_test_fam(const kvq_family *f)
{
    static const char *const names[] = {"fp32", "fp16", "int", "int-pc", "nuq", "kivi", "fp8", "llama.cpp", "nvfp4", "mxfp4"};
    for (int i = 0; f && i < KVQ_TEST_OTHER; i++)
        if (!strcmp(f->name, names[i])) return i;
    return KVQ_TEST_OTHER;
}

static inline const char *kvq_test_shared_dir(void)
{
    const char *s = getenv("KVQ_SHARED");
    return s && *s ? s : "../shared";
}

/* Build "<shared>/<rel>" into buf; returns buf if the file exists, else NULL. */
static inline const char *kvq_test_shared(char *buf, size_t n, const char *rel)
{
    snprintf(buf, n, "%s/%s", kvq_test_shared_dir(), rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

static inline const char *kvq_test_model(void)
{
    const char *s = getenv("KVQ_MODEL");
    const char *p = s && *s ? s : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    return access(p, R_OK) == 0 ? p : NULL;
}

/* Path of a kvq binary ("kvdump", ...) in the build under test: $KVQ_BIN_DIR
 * (set by the Makefile: bin, bin-cpu or bin-asan), default "bin". Returns buf
 * if it is executable, else NULL. */
static inline const char *kvq_test_bin(char *buf, size_t n, const char *tool)
{
    const char *d = getenv("KVQ_BIN_DIR");
    snprintf(buf, n, "%s/%s", d && *d ? d : "bin", tool);
    return access(buf, X_OK) == 0 ? buf : NULL;
}

/* Read a whole file: malloc'd, NUL-terminated (so text files are C strings),
 * length in *n (may be NULL); NULL when the file cannot be opened. A short
 * read fails the test. */
static inline void *kvq_test_slurp(const char *path, size_t *n)
{
    if (n) *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc(sz > 0 ? (size_t)sz + 1 : 1);
    ck_assert_ptr_nonnull(p);
    ck_assert_msg(sz <= 0 || fread(p, 1, (size_t)sz, f) == (size_t)sz, "%s: short read", path);
    fclose(f);
    p[sz > 0 ? sz : 0] = 0;
    if (n) *n = sz > 0 ? (size_t)sz : 0;
    return p;
}

/* Run an independent Python reader (a script of tests/scripts: h5py on a dump, safetensors on an
 * artifact or vLLM scales) with its arguments; the test fails with the script's output unless it
 * exits 0. python3 and its packages (numpy, h5py, safetensors) are installed by scripts/setup.sh:
 * a missing one is a failure, not a skip. */
static inline void kvq_test_python(const char *script, const char *args)
{
    char cmd[4096], out[8192];
    snprintf(cmd, sizeof cmd, "%s tests/scripts/%s %s 2>&1", getenv("PYTHON") ? getenv("PYTHON") : "python3", script, args);
    FILE *p = popen(cmd, "r");
    ck_assert_msg(p != NULL, "cannot run %s", cmd);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int rc = pclose(p);
    ck_assert_msg(rc == 0, "%s: exit status %d:\n%s", cmd, rc, out);
    fprintf(stderr, "INFO %s: ok (%zu bytes of output)\n", script, n);
}

/* Quick mode (ASan runs): tests may shrink their workloads. */
static inline int kvq_test_quick(void) { const char *q = getenv("KVQ_TEST_QUICK"); return q && *q == '1'; }

/* Whether this is a CI run: CI set to anything but "", "0", "false" or "no". */
static inline int kvq_test_ci(void)
{
    const char *c = getenv("CI");
    return c && *c && strcmp(c, "0") && strcasecmp(c, "false") && strcasecmp(c, "no");
}

/* A test input is absent: "SKIP test: why" on stderr, or in CI a failure of the test. */
static inline void kvq_test_skip_missing(const char *test, const char *why)
{
    if (kvq_test_ci())
        ck_abort_msg("%s: %s; CI=%s: an absent test input fails in CI (a broken setup must not pass as skipped tests)", test,
                     why, getenv("CI"));
    fprintf(stderr, "SKIP %s: %s\n", test, why);
}

/* Skip the test when cond holds because an input is absent (fails in CI: kvq_test_skip_missing). */
#define KVQ_SKIP_IF(cond, why) do { if (cond) { kvq_test_skip_missing(__func__, (why)); return; } } while (0)
/* Skip for a reason that is not a missing input (never a failure). */
#define KVQ_SKIP_OPTIONAL_IF(cond, why) do { if (cond) { fprintf(stderr, "SKIP %s: %s\n", __func__, (why)); return; } } while (0)

/* relative L2 error ||a-b|| / ||b|| in double */
static inline double kvq_test_rel_l2_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) { double d = (double)a[i] - b[i]; num += d * d; den += (double)b[i] * b[i]; }
    return den > 0 ? __builtin_sqrt(num / den) : __builtin_sqrt(num);
}

#define KVQ_TEST_MAIN(suite_fn) \
    int main(void) { \
        SRunner *sr = srunner_create(suite_fn()); \
        srunner_run_all(sr, CK_NORMAL); \
        int nf = srunner_ntests_failed(sr); \
        srunner_free(sr); \
        return nf ? EXIT_FAILURE : EXIT_SUCCESS; \
    }

#endif
