/* status.h — error reporting for every fallible kvq function.
 *
 * Convention: a fallible function returns kvq_status (KVQ_OK == 0 on success)
 * and takes a `kvq_err *err` as its last argument. On failure it fills
 * err->msg with one line that names the file, the offset or field, what was
 * expected and what was found, e.g.
 *   "model.gguf: tensor 'blk.3.attn_q.weight': data offset 123456 + 8192 bytes
 *    exceeds file size 100000"
 * err may be NULL (the message is then discarded). No global state is used:
 * the error lives in the caller's struct.
 */
#ifndef KVQ_STATUS_H
#define KVQ_STATUS_H

#include <stddef.h>
#include <stdio.h>

typedef enum {
    KVQ_OK = 0,
    KVQ_EIO,          /* open/read/write/rename failed (errno text included) */
    KVQ_EFORMAT,      /* file content does not follow its format */
    KVQ_ENOMEM,       /* allocation failed or a size would overflow */
    KVQ_EINVAL,       /* bad argument or option value */
    KVQ_EUNSUPPORTED, /* valid input that kvq does not handle (yet) */
    KVQ_ENUMERIC,     /* NaN/Inf or other numerical failure */
    KVQ_EMISMATCH     /* inputs that do not belong together (fingerprints) */
} kvq_status;

#define KVQ_ERR_MSG_MAX 1024

typedef struct {
    kvq_status code;
    char msg[KVQ_ERR_MSG_MAX];
} kvq_err;

/* Fill err (if non-NULL) with code and a printf-formatted message; returns code. */
kvq_status kvq_fail(kvq_err *err, kvq_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefix err->msg with "prefix: " (used to add context while unwinding); returns err->code.
 * For failures only: never returns KVQ_OK — KVQ_EINVAL when err is NULL or holds no code — so
 * `return kvq_err_prefix(err, ...)` cannot turn a failure into success. */
kvq_status kvq_err_prefix(kvq_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Short name of a status code ("I/O error", "format error", ...). */
const char *kvq_status_name(kvq_status s);

/* Overflow-checked size arithmetic: return 0 and set *out on success, 1 on overflow. */
int kvq_mul_size(size_t a, size_t b, size_t *out);
int kvq_add_size(size_t a, size_t b, size_t *out);

/* Check that the open stream f (opened from path) is a regular file, so that a directory,
 * device (/dev/zero), FIFO or socket is refused at once instead of failing late or reading
 * forever. `what` names the expected input ("a text file"). Errors: KVQ_EIO, e.g.
 * "d: is a directory (expected a text file)", "/dev/zero: not a regular file (a character
 * device; expected a text file)", or the fstat error. f is not closed. */
kvq_status kvq_require_regular(FILE *f, const char *path, const char *what, kvq_err *err);

/* Open path for reading only if it is a regular file. The open itself never blocks: it is made
 * with O_NONBLOCK and checked with fstat before anything is read (a plain open() of a FIFO waits
 * forever for a writer), then the descriptor is switched back to blocking. Errors: KVQ_EIO
 * "PATH: cannot open: ERRNO", or kvq_require_regular's messages ("PATH: not a regular file (a
 * FIFO; expected WHAT)", "PATH: is a directory (expected WHAT)"). */
kvq_status kvq_open_regular(const char *path, const char *what, int *fd, kvq_err *err);
/* The same as a stdio stream ("rb"). */
kvq_status kvq_fopen_regular(const char *path, const char *what, FILE **f, kvq_err *err);
/* The same check without keeping the file open (for libraries that open by name: HDF5). */
kvq_status kvq_check_regular(const char *path, const char *what, kvq_err *err);

/* Propagate a non-OK status. */
#define KVQ_TRY(expr) do { kvq_status kvq_try_s_ = (expr); if (kvq_try_s_ != KVQ_OK) return kvq_try_s_; } while (0)

#endif
