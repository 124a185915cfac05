/* test_fuzz_formats.c — replay every saved input of the file-reader fuzzer
 * (tests/fixtures/fuzz-formats/, written by scripts/fuzz_formats.sh) through
 * its step (tests/fuzz/fuzz_formats.h): each once tripped a check or a
 * sanitizer, and each must now load or fail with a message naming the file.
 * Besides the inputs that tripped it, a few per reader from its merged corpus
 * (corpus-<reader>-*: error paths of every reader) are kept, so the replay
 * covers each reader; run under `make asan` it also catches memory errors on
 * them. Inputs that failed only by allocating too much (oom-*) pass here
 * either way (no allocation limit); the explicit test beside the fix covers
 * them (test_tokenizer.c: test_bad_vocab). */
#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>

#include "kvq_test.h"
#include "fuzz/fuzz_formats.h"

static void rm_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char p[PATH_MAX];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

START_TEST(test_fuzz_formats_regressions)
{
    char dir[] = "/tmp/kvq-test-fuzz-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    DIR *d = opendir("tests/fixtures/fuzz-formats");
    ck_assert_ptr_nonnull(d);
    int cnt = 0, per_reader[KVQ_FZ_N] = {0};
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char p[PATH_MAX];
        snprintf(p, sizeof p, "tests/fixtures/fuzz-formats/%s", de->d_name);
        size_t n;
        char *data = kvq_test_slurp(p, &n);
        ck_assert_ptr_nonnull(data);
        const char *bad = kvq_fuzz_formats_one(dir, (const uint8_t *)data, n);
        ck_assert_msg(bad == NULL, "%s: %s", p, bad);
        if (n && (uint8_t)data[0] % KVQ_FZ_SLOTS < KVQ_FZ_N) per_reader[(uint8_t)data[0] % KVQ_FZ_SLOTS]++;
        free(data);
        cnt++;
    }
    closedir(d);
    rm_dir(dir);
    /* every reader has saved inputs: the replay covers them all */
    for (int r = 0; r < KVQ_FZ_N; r++) ck_assert_msg(per_reader[r] >= 1, "no saved input for reader %d", r);
    ck_assert_int_ge(cnt, KVQ_FZ_N);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("fuzz_formats");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fuzz_formats_regressions);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
