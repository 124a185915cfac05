/* progress.h — progress reporting on stderr for long work.
 * On a TTY: a one-line bar redrawn at most 5 times a second with done/total,
 * rate (units/s) and ETA. Otherwise: one plain line every `period` seconds
 * (default 10). quiet = true silences everything. State lives in the caller's
 * struct; nothing global. */
#ifndef KVQ_PROGRESS_H
#define KVQ_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    const char *label;  /* e.g. "kvdump" */
    const char *unit;   /* e.g. "tok" */
    uint64_t total;     /* 0 = unknown */
    uint64_t done;
    double t0, last;    /* seconds (monotonic) */
    double period;      /* seconds between plain lines when not a TTY */
    bool tty, quiet, drawn;
} kvq_progress;

/* Monotonic clock in seconds. */
double kvq_now(void);

void kvq_progress_init(kvq_progress *p, const char *label, const char *unit, uint64_t total, bool quiet);
/* Set the absolute amount done and redraw if due. */
void kvq_progress_update(kvq_progress *p, uint64_t done);
/* Final line (rate and elapsed time), newline on a TTY. */
void kvq_progress_finish(kvq_progress *p);

#endif
