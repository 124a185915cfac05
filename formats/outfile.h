/* outfile.h — report outputs written whole or not at all.
 *
 * kvq's text and image reports (kveval --json, kvstat --json / --markdown /
 * --html and its figures) are written under a temporary name in the target's
 * directory, `<path>.tmp<pid>`, and renamed over <path> only when complete, so
 * an interrupted or failed write never leaves a truncated report and never
 * destroys the previous one. "-" names stdout (written directly, flushed); an
 * existing path that is not a regular file (/dev/null, /dev/stdout, a FIFO) is
 * written in place too (renaming over it would replace the device node with a
 * regular file); a symbolic link's target is replaced and the link kept. An existing
 * read-only file (no write permission bit, or not writable by this user) is never replaced:
 * a rename needs only the directory's permission, so the rule is checked here.
 *
 *   kvq_outfile o;
 *   KVQ_TRY(kvq_outfile_open(&o, path, err));   // o.f is the stream to write
 *   ... fprintf(o.f, ...) ...
 *   return kvq_outfile_commit(&o, err);          // or kvq_outfile_abort(&o)
 */
#ifndef KVQ_OUTFILE_H
#define KVQ_OUTFILE_H

#include <stdbool.h>
#include <stdio.h>

#include "status.h"

typedef struct {
    FILE *f;          /* the stream to write (stdout for "-") */
    const char *path; /* the final name (not copied: must outlive the outfile), or real */
    char *tmp;        /* the temporary name, NULL for stdout and direct writes */
    char *real;       /* a symbolic link's target (realpath), replaced instead of the link */
    bool direct;      /* a device or FIFO (/dev/null, /dev/stdout): written in place, not renamed */
} kvq_outfile;

/* "<path>.tmp<pid>" into buf[n] (the temporary name kvq_outfile uses, also for files
 * written by other libraries, e.g. cairo's PNG writer). Errors: KVQ_EINVAL when it does
 * not fit in n bytes. */
kvq_status kvq_outfile_tmpname(const char *path, char *buf, size_t n, kvq_err *err);

/* Open the temporary file of `path` for writing ("-": stdout). Errors: KVQ_EINVAL for an
 * empty path, KVQ_EIO naming the temporary file and errno's text, or "PATH: not replaced: it
 * exists and is read-only". On error o->f is NULL. */
kvq_status kvq_outfile_open(kvq_outfile *o, const char *path, kvq_err *err);

/* Close the stream and rename the temporary file over path (stdout: flush). Any write
 * error seen on the stream, a failed close or rename fails with KVQ_EIO (naming the file
 * and errno's text) and removes the temporary file; path is then untouched. Frees o's
 * resources in every case. */
kvq_status kvq_outfile_commit(kvq_outfile *o, kvq_err *err);

/* Close the stream and remove the temporary file (path untouched). NULL stream: no-op. */
void kvq_outfile_abort(kvq_outfile *o);

/* Write `text` and a newline to path ("-": stdout) through an outfile. Errors as
 * kvq_outfile_open / kvq_outfile_commit. */
kvq_status kvq_outfile_write_text(const char *path, const char *text, kvq_err *err);

/* Whether path is an existing regular file that is read-only: no write permission bit set
 * (also for root), or access(W_OK) refused. Such a file is never replaced (kvq_outfile_open,
 * kvq_outfile_rename, kvq_cli_check_outputs). */
bool kvq_outfile_read_only(const char *path);

/* Rename a finished temporary file `tmp` over `path`; on failure remove tmp. Errors:
 * KVQ_EIO "PATH: cannot rename TMP over it: ERRNO", "PATH: not replaced: it exists and is
 * not a regular file" (a device node, FIFO or directory is never renamed over), or "PATH: not
 * replaced: it exists and is read-only". */
kvq_status kvq_outfile_rename(const char *tmp, const char *path, kvq_err *err);

#endif
