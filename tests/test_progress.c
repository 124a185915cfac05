/* test_progress.c — the progress line on stderr (formats/progress.h): done/total, the rate and the ETA as a
 * reader can use them. A kveval run on the CPU printed "0.0 window-runs/s" for its whole run (one window-run
 * every 25-50 s): below one unit per second the line gives the seconds per unit instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvq_test.h"
#include "progress.h"

/* the plain (non-TTY) line of a progress at `done` of `total` after `elapsed` seconds */
static void line_of(uint64_t done, uint64_t total, double elapsed, bool final, char *out, size_t n)
{
    fflush(stderr);
    int saved = dup(2);
    FILE *tmp = tmpfile();
    ck_assert(saved >= 0 && tmp);
    ck_assert(dup2(fileno(tmp), 2) >= 0);
    kvq_progress p;
    kvq_progress_init(&p, "kveval", "window-runs", total, false);
    p.tty = false;
    p.t0 = kvq_now() - elapsed;
    p.last = -1e9; /* due now */
    if (final) {
        p.done = done;
        kvq_progress_finish(&p);
    } else
        kvq_progress_update(&p, done);
    fflush(stderr);
    ck_assert(dup2(saved, 2) >= 0);
    close(saved);
    rewind(tmp);
    size_t k = fread(out, 1, n - 1, tmp);
    out[k] = 0;
    fclose(tmp);
}

START_TEST(test_rate_and_eta)
{
    char l[512];
    line_of(6, 8, 180, false, l, sizeof l); /* 30 s per window-run */
    ck_assert_msg(strstr(l, "kveval: 6/8 window-runs, 30.0 s each, ETA 1m00s") && !strstr(l, "0.0 window-runs/s"), "%s", l);
    line_of(600, 800, 100, false, l, sizeof l); /* 6 per second */
    ck_assert_msg(strstr(l, "kveval: 600/800 window-runs, 6.0 window-runs/s, ETA 0m33s"), "%s", l);
    line_of(8, 8, 240, true, l, sizeof l);
    ck_assert_msg(strstr(l, "kveval: 8/8 window-runs, 30.0 s each, elapsed 4m00s"), "%s", l);
    line_of(0, 8, 5, false, l, sizeof l); /* nothing done yet: no rate, no ETA */
    ck_assert_msg(strstr(l, "kveval: 0/8 window-runs, - window-runs/s, ETA"), "%s", l);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("progress");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_rate_and_eta);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
