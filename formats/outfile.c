/* outfile.c — see outfile.h. */
#include "outfile.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

kvq_status kvq_outfile_tmpname(const char *path, char *buf, size_t n, kvq_err *err)
{
    int k = snprintf(buf, n, "%s.tmp%ld", path, (long)getpid());
    if (k < 0 || (size_t)k >= n) return kvq_fail(err, KVQ_EINVAL, "%s: path too long for its temporary name %s.tmp<pid>", path, path);
    return KVQ_OK;
}

kvq_status kvq_outfile_open(kvq_outfile *o, const char *path, kvq_err *err)
{
    memset(o, 0, sizeof *o);
    if (!path || !*path) return kvq_fail(err, KVQ_EINVAL, "output: empty file name");
    o->path = path;
    if (!strcmp(path, "-")) {
        o->f = stdout;
        return KVQ_OK;
    }
    /* not a regular file (/dev/null, /dev/stdout, a FIFO): written in place, never renamed over
     * (a rename would replace the device node with a regular file) */
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        if (S_ISDIR(st.st_mode)) return kvq_fail(err, KVQ_EINVAL, "%s: is a directory (expected a file name)", path);
        o->f = fopen(path, "wb");
        if (!o->f) return kvq_fail(err, KVQ_EIO, "%s: cannot open for writing: %s", path, strerror(errno));
        o->direct = true;
        return KVQ_OK;
    }
    if (kvq_outfile_read_only(path)) return kvq_fail(err, KVQ_EIO, "%s: not replaced: it exists and is read-only", path);
    /* a symbolic link: the file it names is replaced, the link stays */
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
        o->real = realpath(path, NULL);
        if (!o->real) return kvq_fail(err, KVQ_EIO, "%s: cannot resolve the symbolic link: %s", path, strerror(errno));
        o->path = o->real;
    }
    size_t n = strlen(o->path) + 32;
    o->tmp = malloc(n);
    if (!o->tmp) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
    kvq_status s = kvq_outfile_tmpname(o->path, o->tmp, n, err);
    if (s == KVQ_OK) {
        o->f = fopen(o->tmp, "wb");
        if (!o->f) s = kvq_fail(err, KVQ_EIO, "%s: cannot create: %s", o->tmp, strerror(errno));
    }
    if (s != KVQ_OK) {
        free(o->tmp);
        free(o->real);
        o->tmp = o->real = NULL;
    }
    return s;
}

bool kvq_outfile_read_only(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) return false;
    return (st.st_mode & (S_IWUSR | S_IWGRP | S_IWOTH)) == 0 || access(path, W_OK) != 0;
}

kvq_status kvq_outfile_rename(const char *tmp, const char *path, kvq_err *err)
{
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) { /* never replace a device node, FIFO or directory */
        remove(tmp);
        return kvq_fail(err, KVQ_EIO, "%s: not replaced: it exists and is not a regular file", path);
    }
    if (kvq_outfile_read_only(path)) { /* a rename needs only the directory's permission */
        remove(tmp);
        return kvq_fail(err, KVQ_EIO, "%s: not replaced: it exists and is read-only", path);
    }
    if (rename(tmp, path) == 0) return KVQ_OK;
    int e = errno;
    remove(tmp);
    return kvq_fail(err, KVQ_EIO, "%s: cannot rename %s over it: %s", path, tmp, strerror(e));
}

kvq_status kvq_outfile_commit(kvq_outfile *o, kvq_err *err)
{
    if (!o->f) return kvq_fail(err, KVQ_EINVAL, "output: not open");
    kvq_status s = KVQ_OK;
    if (!o->tmp) { /* stdout, or a device / FIFO written in place */
        int bad = fflush(o->f) != 0 || ferror(o->f), e = errno;
        if (o->direct && fclose(o->f) != 0 && !bad) { bad = 1; e = errno; }
        if (bad) s = kvq_fail(err, KVQ_EIO, "%s: write failed: %s", o->direct ? o->path : "stdout", strerror(e ? e : EIO));
        o->f = NULL;
        o->direct = false;
        return s;
    }
    int bad = ferror(o->f), e = errno;
    if (fclose(o->f) != 0 && !bad) { bad = 1; e = errno; }
    o->f = NULL;
    if (bad) {
        remove(o->tmp);
        s = kvq_fail(err, KVQ_EIO, "%s: write failed: %s", o->tmp, strerror(e ? e : EIO));
    } else {
        s = kvq_outfile_rename(o->tmp, o->path, err);
    }
    free(o->tmp);
    free(o->real);
    o->tmp = o->real = NULL;
    return s;
}

void kvq_outfile_abort(kvq_outfile *o)
{
    if (!o->f) return;
    if (o->tmp) {
        fclose(o->f);
        remove(o->tmp);
        free(o->tmp);
        o->tmp = NULL;
    } else if (o->direct) {
        fclose(o->f);
    }
    free(o->real);
    o->real = NULL;
    o->f = NULL;
    o->direct = false;
}

kvq_status kvq_outfile_write_text(const char *path, const char *text, kvq_err *err)
{
    kvq_outfile o;
    KVQ_TRY(kvq_outfile_open(&o, path, err));
    fputs(text, o.f);
    fputc('\n', o.f);
    return kvq_outfile_commit(&o, err);
}
