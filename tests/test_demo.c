/* test_demo.c — `make demo` shrunk: scripts/demo.sh end to end on the tiny
 * aidreams260K model (kvdump --fisher --attn-stats → kvcalib nuq → kveval →
 * kvstat --html → results table), checking the files it leaves and that the
 * printed table agrees with kveval's JSON. */
#include <glob.h>
#include <cjson/cJSON.h>
#include <stdbool.h>
#include <string.h>
#include <sys/wait.h>

#include "kvq_test.h"

static char *slurp(const char *path) { return kvq_test_slurp(path, NULL); }

START_TEST(test_demo_tiny)
{
    char model[4096], tok[4096], data[4096], bin[512];
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/aidreams260K.bin") ||
                    !kvq_test_shared(tok, sizeof tok, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(data, sizeof data, "datasets/wikitext-2-raw/wiki.test.raw"),
                "../shared tiny model or WikiText-2 absent");
    KVQ_SKIP_IF(!kvq_test_bin(bin, sizeof bin, "kveval"), "the kvq binaries are not built");
    char out[128], cmd[16384];
    snprintf(out, sizeof out, "/tmp/kvq_test_demo_%d", (int)getpid());
    const char *dir = getenv("KVQ_BIN_DIR");
    snprintf(cmd, sizeof cmd,
             "KVQ_BIN_DIR=%s KVQ_DEMO_MODEL=%s KVQ_DEMO_TOKENIZER=%s KVQ_DEMO_CALIB_N=2 KVQ_DEMO_CALIB_L=64 "
             "KVQ_DEMO_CTX=64 KVQ_DEMO_WINDOWS=2 KVQ_DEMO_OUT=%s "
             "KVQ_DEMO_SCHEMES='fp16 int4+sink1 kivi2-g8-r16 nuq4-1%% nuq2-1%%' "
             "bash scripts/demo.sh > %s.stdout 2> %s.stderr",
             dir && *dir ? dir : "bin", model, tok, out, out, out);
    int st = system(cmd);
    char p[512];
    snprintf(p, sizeof p, "%s.stderr", out);
    char *err = slurp(p);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "demo failed: %s", err ? err : "");
    free(err);
    const char *files[] = {"dump.h5", "nuq4-1pct.safetensors", "nuq3-1pct.safetensors", "nuq2-1pct.safetensors",
                           "kveval.json", "kveval.md", "report/index.html", "kvstat.md", "results.md", "timings.md"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/%s", out, files[i]);
        ck_assert_msg(access(p, R_OK) == 0, "demo left no %s", files[i]);
    }
    /* the printed table = results.md, whose rows agree with the JSON */
    snprintf(p, sizeof p, "%s.stdout", out);
    char *stdout_txt = slurp(p);
    snprintf(p, sizeof p, "%s/results.md", out);
    char *table = slurp(p);
    snprintf(p, sizeof p, "%s/kveval.json", out);
    char *js = slurp(p);
    ck_assert(stdout_txt && table && js);
    ck_assert_msg(strstr(stdout_txt, "| scheme | eff. bits/elem |"), "no table printed: %s", stdout_txt);
    ck_assert(strstr(stdout_txt, "report/index.html"));
    cJSON *root = cJSON_Parse(js);
    ck_assert_ptr_nonnull(root);
    cJSON *ss = cJSON_GetObjectItem(root, "schemes");
    /* fp32 baseline + 5, + nuq2-1%+intactkv (demo.sh adds it now that kvcalib intactkv exists) */
    ck_assert_int_eq(cJSON_GetArraySize(ss), 7);
    for (int i = 0; i < cJSON_GetArraySize(ss); i++) {
        cJSON *o = cJSON_GetArrayItem(ss, i);
        char row[256];
        snprintf(row, sizeof row, "| %s | %.2f |", cJSON_GetObjectItem(o, "name")->valuestring,
                 cJSON_GetObjectItem(o, "bits_per_element")->valuedouble);
        const char *line = strstr(table, row);
        ck_assert_msg(line, "row '%s' missing from results.md", row);
        char ppl[64];
        snprintf(ppl, sizeof ppl, "| %.4f |", cJSON_GetObjectItem(o, "ppl")->valuedouble);
        const char *eol = strchr(line, '\n');
        ck_assert(eol && strstr(line, ppl) && strstr(line, ppl) < eol);
        ck_assert(strstr(stdout_txt, row));
    }
    /* a nuq scheme really used its artifact and changed the result */
    cJSON *nuq = cJSON_GetArrayItem(ss, 5);
    ck_assert_ptr_nonnull(cJSON_GetObjectItem(nuq, "artifact"));
    ck_assert(cJSON_GetObjectItem(nuq, "ppl")->valuedouble != cJSON_GetObjectItem(cJSON_GetArrayItem(ss, 0), "ppl")->valuedouble);
    /* the IntactKV row used the BOS prefix from the artifact the demo wrote */
    cJSON *ikv = cJSON_GetArrayItem(ss, 6);
    ck_assert_str_eq(cJSON_GetObjectItem(ikv, "name")->valuestring, "nuq2-1%+sink1+intactkv");
    ck_assert_int_eq((int)cJSON_GetObjectItem(ikv, "intactkv_prefix_entries")->valuedouble, 1);
    ck_assert(cJSON_IsFalse(cJSON_GetObjectItem(ikv, "intactkv_trained")));
    ck_assert(strstr(cJSON_GetObjectItem(ikv, "intactkv_artifact")->valuestring, "nuq2-1pct-intactkv.safetensors"));
    cJSON_Delete(root);
    free(stdout_txt);
    free(table);
    free(js);
    snprintf(cmd, sizeof cmd, "rm -rf %s %s.stdout %s.stderr", out, out, out);
    ck_assert(system(cmd) == 0);
}
END_TEST

/* Under `set -o pipefail`, `producer | grep -q PATTERN` fails at random: grep exits
 * at the first match, the producer gets SIGPIPE on its next write and the pipeline
 * returns 141 (this made demo.sh skip its IntactKV step once kvcalib's help grew).
 * No script of the repository may pipe into grep -q; they use grep ... >/dev/null. */
START_TEST(test_scripts_no_pipe_into_grep_q)
{
    /* every script of the repository (a list named twelve and missed the ones added after it) */
    glob_t g;
    ck_assert_int_eq(glob("scripts/*.sh", 0, NULL, &g), 0);
    ck_assert_int_eq(glob(".ci/run", GLOB_APPEND, NULL, &g), 0);
    ck_assert_int_eq(glob("tests/scripts/*.sh", GLOB_APPEND | GLOB_NOCHECK, NULL, &g), 0);
    const char *const *scripts = (const char *const *)g.gl_pathv;
    const size_t n_scripts = g.gl_pathc;
    int checked = 0;
    for (size_t i = 0; i < n_scripts; i++) {
        char *txt = kvq_test_slurp(scripts[i], NULL);
        if (!txt) continue;
        checked++;
        int line = 1;
        for (char *p = txt; *p; p++) {
            if (*p == '\n') line++;
            if (*p != '|' || p[1] == '|' || (p > txt && p[-1] == '|')) continue;
            const char *q = p + 1;
            while (*q == ' ' || *q == '\t') q++;
            if (strncmp(q, "grep ", 5) != 0) continue;
            /* the grep command's words up to the end of the command (newline, ';', '|', '&') */
            size_t len = strcspn(q, "\n;|&");
            bool quiet = false;
            for (size_t k = 4; k + 2 < len; k++)
                if (q[k] == ' ' && q[k + 1] == '-' && q[k + 2] != '-' && memchr(q + k + 1, 'q', strcspn(q + k + 1, " ")))
                    quiet = true;
            ck_assert_msg(!quiet, "%s:%d pipes into grep -q (SIGPIPE under pipefail); use grep ... >/dev/null", scripts[i], line);
        }
        free(txt);
    }
    ck_assert_int_ge(checked, 20);
    globfree(&g);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("demo");
    TCase *tc = tcase_create("tiny");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_demo_tiny);
    tcase_add_test(tc, test_scripts_no_pipe_into_grep_q);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
