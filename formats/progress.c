/* progress.c — see progress.h. */
#include "progress.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

double kvq_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void kvq_progress_init(kvq_progress *p, const char *label, const char *unit, uint64_t total, bool quiet)
{
    p->label = label;
    p->unit = unit ? unit : "";
    p->total = total;
    p->done = 0;
    p->t0 = p->last = kvq_now();
    p->period = 10.0;
    p->tty = isatty(STDERR_FILENO);
    p->quiet = quiet;
    p->drawn = false;
}

static void fmt_time(char *buf, size_t n, double s)
{
    if (s < 0 || s > 1e7) { snprintf(buf, n, "?"); return; }
    int t = (int)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%dh%02dm", t / 3600, t / 60 % 60);
    else snprintf(buf, n, "%dm%02ds", t / 60, t % 60);
}

/* the rate as units per second, or seconds per unit when below 1/s ("0.0 window-runs/s" told nothing) */
static void fmt_rate(char *buf, size_t n, double rate, const char *unit)
{
    if (rate >= 1) snprintf(buf, n, "%.1f %s/s", rate, unit);
    else if (rate > 0) snprintf(buf, n, "%.1f s each", 1.0 / rate);
    else snprintf(buf, n, "- %s/s", unit);
}

static void draw(kvq_progress *p, double now, bool final)
{
    double el = now - p->t0;
    double rate = el > 0 ? p->done / el : 0;
    char eta[32] = "", elapsed[32];
    fmt_time(elapsed, sizeof elapsed, el);
    char rs[64];
    fmt_rate(rs, sizeof rs, rate, p->unit);
    if (p->total && rate > 0 && !final) fmt_time(eta, sizeof eta, (p->total - (p->done < p->total ? p->done : p->total)) / rate);
    if (p->tty) {
        int width = 30, fill = p->total ? (int)(width * (double)p->done / p->total) : 0;
        if (fill > width) fill = width;
        char bar[64];
        for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
        bar[width] = 0;
        fprintf(stderr, "\r%s [%s] %llu/%llu %s  %s  %s %s\033[K", p->label, bar, (unsigned long long)p->done,
                (unsigned long long)p->total, p->unit, rs, final ? "elapsed" : "ETA", final ? elapsed : eta);
        if (final) fputc('\n', stderr);
    } else {
        fprintf(stderr, "%s: %llu/%llu %s, %s, %s %s\n", p->label, (unsigned long long)p->done, (unsigned long long)p->total,
                p->unit, rs, final ? "elapsed" : "ETA", final ? elapsed : eta);
    }
    p->drawn = true;
}

void kvq_progress_update(kvq_progress *p, uint64_t done)
{
    p->done = done;
    if (p->quiet) return;
    double now = kvq_now();
    if (now - p->last >= (p->tty ? 0.2 : p->period)) {
        p->last = now;
        draw(p, now, false);
    }
}

void kvq_progress_finish(kvq_progress *p)
{
    if (p->quiet) return;
    draw(p, kvq_now(), true);
}
