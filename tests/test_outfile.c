/* test_outfile.c — report outputs written whole or not at all (formats/outfile.h): the previous
 * file survives every failure (a write error, a failed rename, an abort), no temporary file is
 * left behind, and success replaces the file in one rename. */
#include "outfile.h"
#include "cli.h"
#include "kvq_test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

static void tmpdir(char *d, size_t n)
{
    snprintf(d, n, "/tmp/kvq_test_outfile_%ld_XXXXXX", (long)getpid());
    ck_assert_ptr_nonnull(mkdtemp(d));
}

static void put(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* the entries of dir other than . and .. */
static int n_entries(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static void expect_text(const char *path, const char *want)
{
    char *got = kvq_test_slurp(path, NULL);
    ck_assert_msg(got && !strcmp(got, want), "%s: '%s', expected '%s'", path, got ? got : "(unreadable)", want);
    free(got);
}

START_TEST(test_replace_and_abort)
{
    char d[128], p[256];
    tmpdir(d, sizeof d);
    snprintf(p, sizeof p, "%s/r.json", d);
    put(p, "old\n");
    kvq_err e = {0};
    ck_assert_msg(kvq_outfile_write_text(p, "{\"a\": 1}", &e) == KVQ_OK, "%s", e.msg);
    expect_text(p, "{\"a\": 1}\n");
    ck_assert_int_eq(n_entries(d), 1);
    /* abort mid-write: the file as it was, the temporary file gone */
    kvq_outfile o;
    ck_assert(kvq_outfile_open(&o, p, &e) == KVQ_OK);
    fputs("half a rep", o.f);
    ck_assert_int_eq(n_entries(d), 2); /* the temporary file beside it while open */
    kvq_outfile_abort(&o);
    expect_text(p, "{\"a\": 1}\n");
    ck_assert_int_eq(n_entries(d), 1);
    /* a new file */
    char q[256];
    snprintf(q, sizeof q, "%s/new.md", d);
    ck_assert(kvq_outfile_open(&o, q, &e) == KVQ_OK);
    fprintf(o.f, "# t\n");
    ck_assert(kvq_outfile_commit(&o, &e) == KVQ_OK);
    expect_text(q, "# t\n");
    ck_assert_int_eq(n_entries(d), 2);
    unlink(q);
    unlink(p);
    rmdir(d);
}
END_TEST

START_TEST(test_failures_keep_the_old_file)
{
    char d[128], p[400], sub[256];
    tmpdir(d, sizeof d);
    kvq_err e = {0};
    /* a directory: refused at open; one that appears meanwhile makes the rename fail: an error
     * naming it, the directory's content intact, no temporary file left */
    snprintf(sub, sizeof sub, "%s/dir", d);
    ck_assert_int_eq(mkdir(sub, 0777), 0);
    ck_assert(kvq_outfile_write_text(sub, "x", &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, sub) && strstr(e.msg, "is a directory"), "%s", e.msg);
    rmdir(sub);
    kvq_outfile o;
    ck_assert(kvq_outfile_open(&o, sub, &e) == KVQ_OK);
    fputs("x", o.f);
    ck_assert_int_eq(mkdir(sub, 0777), 0);
    snprintf(p, sizeof p, "%s/keep", sub);
    put(p, "keep");
    ck_assert(kvq_outfile_commit(&o, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, sub) && strstr(e.msg, "not replaced: it exists and is not a regular file"), "%s", e.msg);
    expect_text(p, "keep");
    ck_assert_int_eq(n_entries(d), 1);
    /* the temporary file cannot be created (no such directory) */
    char miss[256];
    snprintf(miss, sizeof miss, "%s/nodir/r.json", d);
    ck_assert(kvq_outfile_write_text(miss, "x", &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "nodir/r.json.tmp") && strstr(e.msg, "cannot create"), "%s", e.msg);
    ck_assert(kvq_outfile_write_text("", "x", &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "empty file name"), "%s", e.msg);
    /* a write error (the file-size limit, as a full disk would): the old file intact, an error
     * naming the temporary file, which is removed (the old writers truncated the report first) */
    char r[256];
    snprintf(r, sizeof r, "%s/r.json", d);
    put(r, "old\n");
    struct rlimit old;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {4096, old.rlim_max};
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    size_t big = 1 << 20;
    char *text = malloc(big + 1);
    memset(text, 'x', big);
    text[big] = 0;
    kvq_status s = kvq_outfile_write_text(r, text, &e);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);
    free(text);
    ck_assert_int_eq(s, KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "r.json.tmp") && strstr(e.msg, "write failed"), "%s", e.msg);
    expect_text(r, "old\n");
    ck_assert_int_eq(n_entries(d), 2); /* dir and r.json */
    unlink(r);
    unlink(p);
    rmdir(sub);
    rmdir(d);
}
END_TEST

/* A read-only report is never replaced: a rename needs only the directory's permission, so kveval --json and
 * kvstat replaced a 0444 file (even one owned by another user) before the rule was checked. Refused before any
 * work (kvq_cli_check_outputs), at open, and at the rename (a file made read-only while the report was written);
 * the file's bytes intact, no temporary file left. The mode test holds for root too (no write bit). */
START_TEST(test_read_only_kept)
{
    char d[128], r[256];
    tmpdir(d, sizeof d);
    snprintf(r, sizeof r, "%s/ro.json", d);
    put(r, "keep\n");
    ck_assert_int_eq(chmod(r, 0444), 0);
    ck_assert(kvq_outfile_read_only(r));
    kvq_err e = {0};
    ck_assert(kvq_outfile_write_text(r, "new", &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, r) && strstr(e.msg, "read-only"), "%s", e.msg);
    expect_text(r, "keep\n");
    const kvq_cli_file outs[] = {{"--json", r}};
    ck_assert(kvq_cli_check_outputs(outs, 1, NULL, 0, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "--json") && strstr(e.msg, "read-only"), "%s", e.msg);
    /* writable again: replaced; made read-only during the write: kept, the temporary file removed */
    ck_assert_int_eq(chmod(r, 0644), 0);
    ck_assert(!kvq_outfile_read_only(r));
    ck_assert(kvq_cli_check_outputs(outs, 1, NULL, 0, &e) == KVQ_OK);
    kvq_outfile o;
    ck_assert(kvq_outfile_open(&o, r, &e) == KVQ_OK);
    fputs("new\n", o.f);
    ck_assert_int_eq(chmod(r, 0400), 0);
    ck_assert(kvq_outfile_commit(&o, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "read-only"), "%s", e.msg);
    expect_text(r, "keep\n");
    ck_assert_int_eq(n_entries(d), 1);
    ck_assert_int_eq(chmod(r, 0644), 0);
    ck_assert(kvq_outfile_write_text(r, "new", &e) == KVQ_OK);
    expect_text(r, "new\n");
    /* a missing file, a directory and /dev/null are not read-only files */
    ck_assert(!kvq_outfile_read_only("/nonexistent/kvq"));
    ck_assert(!kvq_outfile_read_only(d));
    ck_assert(!kvq_outfile_read_only("/dev/null"));
    /* the same device twice (kvstat --json /dev/null --markdown /dev/null): both written in place, no "two outputs" */
    const kvq_cli_file two[] = {{"--json", "/dev/null"}, {"--markdown", "/dev/null"}};
    ck_assert_msg(kvq_cli_check_outputs(two, 2, NULL, 0, &e) == KVQ_OK, "%s", e.msg);
    unlink(r);
    rmdir(d);
}
END_TEST

/* Special files are written in place, never renamed over (a rename replaced /dev/null with a
 * regular file when kvstat --markdown /dev/null ran as root); a symbolic link's target is replaced and the
 * link kept (a rename would have replaced the link itself) */
START_TEST(test_fifo_and_symlink)
{
    char d[128], fifo[256], link[256], target[256];
    tmpdir(d, sizeof d);
    snprintf(fifo, sizeof fifo, "%s/fifo", d);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    int rfd = open(fifo, O_RDWR | O_NONBLOCK); /* a reader, so that the writer's open does not block */
    ck_assert_int_ge(rfd, 0);
    kvq_err e = {0};
    ck_assert_msg(kvq_outfile_write_text(fifo, "{\"x\": 2}", &e) == KVQ_OK, "%s", e.msg);
    char got[64] = {0};
    ck_assert_int_eq(read(rfd, got, sizeof got - 1), 9);
    ck_assert_str_eq(got, "{\"x\": 2}\n");
    close(rfd);
    struct stat st;
    ck_assert(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode));
    ck_assert_int_eq(n_entries(d), 1); /* no temporary file beside it */
    snprintf(target, sizeof target, "%s/real.json", d);
    snprintf(link, sizeof link, "%s/link.json", d);
    put(target, "old\n");
    ck_assert_int_eq(symlink("real.json", link), 0);
    ck_assert_msg(kvq_outfile_write_text(link, "new", &e) == KVQ_OK, "%s", e.msg);
    ck_assert(lstat(link, &st) == 0 && S_ISLNK(st.st_mode));
    expect_text(target, "new\n");
    ck_assert_int_eq(n_entries(d), 3);
    unlink(link);
    unlink(target);
    unlink(fifo);
    rmdir(d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("outfile");
    TCase *tc = tcase_create("outfile");
    tcase_add_test(tc, test_replace_and_abort);
    tcase_add_test(tc, test_failures_keep_the_old_file);
    tcase_add_test(tc, test_fifo_and_symlink);
    tcase_add_test(tc, test_read_only_kept);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
