#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

kvq_status kvq_fail(kvq_err *err, kvq_status code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

kvq_status kvq_err_prefix(kvq_err *err, const char *fmt, ...)
{
    /* only called on failure: never KVQ_OK, so `return kvq_err_prefix(err, ...)` cannot turn an
     * error into success where err is NULL or the callee left no code */
    if (!err) return KVQ_EINVAL;
    char pre[KVQ_ERR_MSG_MAX], old[KVQ_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t np = strnlen(pre, sizeof pre - 1), no = strnlen(old, sizeof old - 1), cap = sizeof err->msg - 1;
    size_t k = 0;
    for (size_t i = 0; i < np && k < cap; i++) err->msg[k++] = pre[i];
    for (const char *sep = ": "; *sep && k < cap; sep++) err->msg[k++] = *sep;
    for (size_t i = 0; i < no && k < cap; i++) err->msg[k++] = old[i];
    err->msg[k] = 0;
    if (err->code == KVQ_OK) err->code = KVQ_EINVAL;
    return err->code;
}

const char *kvq_status_name(kvq_status s)
{
    switch (s) {
    case KVQ_OK: return "ok";
    case KVQ_EIO: return "I/O error";
    case KVQ_EFORMAT: return "format error";
    case KVQ_ENOMEM: return "out of memory";
    case KVQ_EINVAL: return "invalid argument";
    case KVQ_EUNSUPPORTED: return "unsupported";
    case KVQ_ENUMERIC: return "numerical error";
    case KVQ_EMISMATCH: return "mismatch";
    }
    return "unknown error";
}

int kvq_mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > (size_t)-1 / a) return 1;
    *out = a * b;
    return 0;
}

int kvq_add_size(size_t a, size_t b, size_t *out)
{
    if (b > (size_t)-1 - a) return 1;
    *out = a + b;
    return 0;
}

static kvq_status require_regular_fd(int fd, const char *path, const char *what, kvq_err *err)
{
    struct stat st;
    if (fstat(fd, &st) != 0) return kvq_fail(err, KVQ_EIO, "%s: cannot stat: %s", path, strerror(errno));
    if (S_ISREG(st.st_mode)) return KVQ_OK;
    if (S_ISDIR(st.st_mode)) return kvq_fail(err, KVQ_EIO, "%s: is a directory (expected %s)", path, what);
    const char *kind = S_ISCHR(st.st_mode) ? "a character device" : S_ISBLK(st.st_mode) ? "a block device" : S_ISFIFO(st.st_mode) ? "a pipe" : S_ISSOCK(st.st_mode) ? "a socket" : "not a file";
    return kvq_fail(err, KVQ_EIO, "%s: not a regular file (%s; expected %s)", path, kind, what);
}

kvq_status kvq_require_regular(FILE *f, const char *path, const char *what, kvq_err *err)
{
    return require_regular_fd(fileno(f), path, what, err);
}

kvq_status kvq_open_regular(const char *path, const char *what, int *fd, kvq_err *err)
{
    *fd = -1;
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f < 0) return kvq_fail(err, KVQ_EIO, "%s: cannot open: %s", path, strerror(errno));
    kvq_status s = require_regular_fd(f, path, what, err);
    if (s) {
        close(f);
        return s;
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(f);
        return kvq_fail(err, KVQ_EIO, "%s: cannot set up reading: %s", path, strerror(e));
    }
    *fd = f;
    return KVQ_OK;
}

kvq_status kvq_fopen_regular(const char *path, const char *what, FILE **out, kvq_err *err)
{
    *out = NULL;
    int fd;
    KVQ_TRY(kvq_open_regular(path, what, &fd, err));
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        return kvq_fail(err, KVQ_EIO, "%s: cannot open: %s", path, strerror(e));
    }
    *out = f;
    return KVQ_OK;
}

kvq_status kvq_check_regular(const char *path, const char *what, kvq_err *err)
{
    int fd;
    KVQ_TRY(kvq_open_regular(path, what, &fd, err));
    close(fd);
    return KVQ_OK;
}
