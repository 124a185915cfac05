/* dump_write.c — the kvdump HDF5 file's streaming writer (formats/dump.h; schema: formats/DUMP.md): create, write
 * and commit samples (chunks shuffled and deflated in parallel, per-sample CRC-32s), finish, abort, /k_bias. */
#include "dump_internal.h"
#include "half.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

/* ---- writer ------------------------------------------------------------------- */

static const float *layer_ptr(const kvq_dump_layer_data *d, kvq_dump_ds ds)
{
    switch (ds) {
    case KVQ_DUMP_K_PRE_ROPE: return d->k_pre_rope;
    case KVQ_DUMP_K: return d->k;
    case KVQ_DUMP_V: return d->v;
    case KVQ_DUMP_Q: return d->q;
    case KVQ_DUMP_FISHER_K_PRE_ROPE: return d->fisher_k_pre_rope;
    case KVQ_DUMP_FISHER_V: return d->fisher_v;
    case KVQ_DUMP_ATTN_RECEIVED: return d->attn_received;
    case KVQ_DUMP_ATTN_ENTROPY: return d->attn_entropy;
    default: return NULL;
    }
}

/* CRC-32 of x[0..n) stored as f16 or f32 bits, little-endian, from crc. */
static uint32_t span_crc(const float *x, size_t n, bool f16, uint32_t crc)
{
    unsigned char buf[8192];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (f16) {
            const uint16_t u = kvq_f32_to_f16(x[i]);
            buf[k++] = (unsigned char)(u & 0xff);
            buf[k++] = (unsigned char)(u >> 8);
        } else {
            uint32_t u;
            memcpy(&u, &x[i], sizeof u);
            for (int b = 0; b < 4; b++) buf[k++] = (unsigned char)(u >> (8 * b));
        }
        if (k + 4 > sizeof buf) {
            crc = (uint32_t)crc32(crc, buf, (uInt)k);
            k = 0;
        }
    }
    return k ? (uint32_t)crc32(crc, buf, (uInt)k) : crc;
}

/* CRC-32 (zlib) of one sample of a dataset as the file stores it — f16 or f32 bits, little-endian, the sample's
 * elements in row-major order (x's order) — continuing crc. From 2^20 elements on, in up to 256 blocks of >= 2^18
 * elements in parallel (OpenMP), joined in order with crc32_combine (0.25 s per 35M f16 values on one core: on a GPU
 * run the writer thread is the bottleneck). Smaller ones stay on the calling thread (and keep a process that forks
 * afterwards free of OpenMP's thread pool, which a forked child cannot use). */
static uint32_t ds_crc(const kvq_dump_meta *m, kvq_dump_ds ds, const float *x, uint32_t crc)
{
    const size_t n = kvq_dump_ds_sample_elems(m, ds), blk = n / 256 + 1 > ((size_t)1 << 18) ? n / 256 + 1 : (size_t)1 << 18;
    const size_t nb = (n + blk - 1) / blk;
    const bool f16 = ds_is_f16(m, ds);
    const size_t esize = f16 ? 2 : 4;
    uint32_t part[256];
    if (n < ((size_t)1 << 20)) return span_crc(x, n, f16, crc);
#pragma omp parallel for schedule(static)
    for (long b = 0; b < (long)nb; b++) {
        const size_t i0 = (size_t)b * blk, cnt = n - i0 < blk ? n - i0 : blk;
        part[b] = span_crc(x + i0, cnt, f16, (uint32_t)crc32(0L, Z_NULL, 0));
    }
    for (size_t b = 0; b < nb; b++) {
        const size_t cnt = n - b * blk < blk ? n - b * blk : blk;
        crc = (uint32_t)crc32_combine(crc, part[b], (z_off_t)(cnt * esize));
    }
    return crc;
}

static uint32_t tokens_crc(const int32_t *t, int64_t n)
{
    uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)t[i];
        const unsigned char b[4] = {(unsigned char)u, (unsigned char)(u >> 8), (unsigned char)(u >> 16), (unsigned char)(u >> 24)};
        crc = (uint32_t)crc32(crc, b, 4);
    }
    return crc;
}

bool kvqi_file_exists(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

static bool is_dir(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Whether another writer holds the file's lock (HDF5's own, or kvqi_hold_lock's when HDF5's file locking is
 * off); false when it cannot tell. */
/* A new descriptor of fname holding an exclusive flock(), or -1 (errno EWOULDBLOCK: another
 * descriptor holds one). */
static int try_lock(const char *fname)
{
    int fd = open(fname, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); /* (never blocks on a FIFO) */
    if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) == 0) return fd;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}

bool kvqi_locked_by_another(const char *fname)
{
    int fd = try_lock(fname);
    if (fd >= 0) close(fd);
    return fd < 0 && errno == EWOULDBLOCK;
}

/* --force on an existing <path>.partial: remove it, but only if no process has it open for
 * writing. HDF5 (1.10+, file locking on) holds an exclusive flock() on a file it writes
 * until it closes it, so a running kvdump's partial refuses our non-blocking lock; truncating
 * it instead (H5F_ACC_TRUNC) would corrupt that run's dump, which would still finish with
 * status 0. Absent: nothing to do. */
static kvq_status remove_stale_partial(const char *fname, kvq_err *err)
{
    int fd = open(fname, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT) return KVQ_OK;
        if (errno == ELOOP && unlink(fname) == 0) return KVQ_OK; /* a symlink: remove the link itself */
        return kvq_fail(err, KVQ_EIO, "%s: cannot open it to replace it: %s", fname, strerror(errno));
    }
    kvq_status s = KVQ_OK;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK)
            s = kvq_fail(err, KVQ_EIO, "%s: not replaced: %s", fname, kvqi_IN_USE);
        else
            s = kvq_fail(err, KVQ_EIO, "%s: cannot lock it to replace it: %s", fname, strerror(errno));
    } else if (unlink(fname) != 0 && errno != ENOENT) {
        s = kvq_fail(err, KVQ_EIO, "%s: cannot remove it to replace it: %s", fname, strerror(errno));
    }
    close(fd); /* (releases the lock) */
    return s;
}

/* Lay out the chunks of one layer's datasets and their buffers (deflate > 0).
 * Chunk geometry is kvqi_chunk_dims(), as in kvqi_create_datasets(). */
static kvq_status jobs_alloc(kvq_dump_writer *w, kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    size_t n = 0, bytes = 0;
    for (int pass = 0; pass < 2; pass++) {
        size_t j = 0, at = 0;
        for (int k = 0; k < KVQ_DUMP_N_DS; k++) {
            kvq_dump_ds ds = (kvq_dump_ds)k;
            if (!kvq_dump_ds_enabled(m, ds)) continue;
            hsize_t full[4], chunk[4];
            int rank = kvqi_ds_full_dims(m, ds, full);
            kvqi_chunk_dims(m, ds, full, rank, chunk);
            int ax = ds_is_attn(ds) ? 2 : 1; /* the split axis */
            size_t elems = 1, esize = ds_is_f16(m, ds) ? 2 : 4;
            for (int i = 1; i < rank; i++) elems *= (size_t)chunk[i]; /* <= 1 MiB / esize (kvqi_chunk_dims) */
            size_t raw = elems * esize, zcap = (size_t)compressBound((uLong)raw);
            for (hsize_t c0 = 0; c0 < full[ax]; c0 += chunk[ax], j++) {
                if (pass == 1) {
                    chunk_job *jb = &w->jobs[j];
                    memset(jb, 0, sizeof *jb);
                    jb->ds = ds;
                    jb->offset[ax] = c0;
                    jb->raw_bytes = raw;
                    jb->zcap = zcap;
                    jb->shuf = w->arena + at;
                    jb->zbuf = w->arena + at + raw;
                    at += raw + zcap;
                } else if (kvq_add_size(bytes, raw + zcap, &bytes)) {
                    return kvq_fail(err, KVQ_ENOMEM, "%s: chunk buffers of one layer overflow size_t", w->d.fname);
                }
            }
        }
        if (pass == 0) {
            n = j;
            if (!(w->jobs = calloc(n ? n : 1, sizeof *w->jobs)) || !(w->arena = malloc(bytes ? bytes : 1)))
                return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %zu bytes of chunk buffers for deflate", w->d.fname, bytes);
        }
    }
    w->n_jobs = n;
    return KVQ_OK;
}

kvq_status kvqi_writer_alloc(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                        kvq_dump_writer **out, kvq_err *err)
{
    *out = NULL;
    if (!path || !*path) return kvq_fail(err, KVQ_EINVAL, "dump: empty output path");
    if (strlen(path) >= KVQ_DUMP_PATH_MAX) return kvq_fail(err, KVQ_EINVAL, "dump: output path longer than %d bytes", KVQ_DUMP_PATH_MAX - 1);
    KVQ_TRY(kvq_dump_meta_validate(meta, err));
    kvq_dump_opts o = opts ? *opts : kvq_dump_opts_default();
    if (o.deflate_level < 0 || o.deflate_level > 9)
        return kvq_fail(err, KVQ_EINVAL, "dump: deflate level %d, expected 0 (off) .. 9", o.deflate_level);
    kvq_dump_writer *w = calloc(1, sizeof *w);
    if (!w) return kvq_fail(err, KVQ_ENOMEM, "dump: out of memory");
    kvqi_dump_init(&w->d);
    w->opts = o;
    w->lock_fd = -1;
    snprintf(w->d.path, sizeof w->d.path, "%s", path);
    snprintf(w->d.fname, sizeof w->d.fname, "%s.partial", path);
    kvq_status s = kvqi_dump_set_meta(&w->d, meta, err);
    if (!s && !(w->layer_done = calloc((size_t)w->d.n_range, 1))) s = kvq_fail(err, KVQ_ENOMEM, "dump: out of memory");
    if (!s && !(w->crc = calloc((size_t)w->d.n_range + 1, sizeof *w->crc))) s = kvq_fail(err, KVQ_ENOMEM, "dump: out of memory");
    if (s) {
        kvqi_dump_close_file(&w->d);
        kvqi_dump_free(&w->d);
        free(w->crc);
        free(w->layer_done);
        free(w->zlevel);
        free(w->jobs);
        free(w->arena);
        free(w);
        return s;
    }
    *out = w;
    return KVQ_OK;
}

/* After HDF5 opened the .partial for writing: make sure some lock marks it as being written, so
 * that another kvdump's --force or --resume refuses it (kvqi_locked_by_another). HDF5 (1.10+) holds an
 * exclusive flock() on its own descriptor unless its file locking is off (HDF5_USE_FILE_LOCKING=FALSE,
 * common on cluster file systems); then our lock on a second descriptor fails, and we close it. With
 * HDF5's locking off ours succeeds and is held until the writer is freed. Best effort: a file system
 * without flock() gets neither. */
void kvqi_hold_lock(kvq_dump_writer *w) { w->lock_fd = try_lock(w->d.fname); }

void kvqi_writer_free(kvq_dump_writer *w)
{
    kvqi_dump_close_file(&w->d);
    if (w->lock_fd >= 0) close(w->lock_fd); /* (after HDF5's close: releases our lock) */
    kvqi_dump_free(&w->d);
    free(w->layer_done);
    free(w->crc);
    free(w->zlevel);
    free(w->jobs);
    free(w->arena);
    free(w);
}

/* After the datasets are created or opened: which ones carry exactly HDF5's
 * shuffle + deflate pipeline (their chunks are filtered by us, at the level the
 * file records, whatever opts say: a resumed file keeps its own filters). */
kvq_status kvqi_writer_filters(kvq_dump_writer *w, kvq_err *err)
{
    size_t n = (size_t)w->d.n_range * KVQ_DUMP_N_DS;
    bool any = false;
    if (!(w->zlevel = malloc(n))) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", w->d.fname);
    for (size_t i = 0; i < n; i++) {
        w->zlevel[i] = -1;
        hid_t id = w->d.ds[i];
        if (id < 0) continue;
        hid_t dcpl = H5Dget_create_plist(id);
        if (dcpl < 0) return kvqi_h5_fail(err, KVQ_EIO, "%s: cannot read a dataset's creation properties", w->d.fname);
        unsigned flags, cd0[4] = {0}, cd1[4] = {0};
        size_t n0 = 4, n1 = 4;
        hid_t t = H5Dget_type(id);
        size_t esize = t >= 0 ? H5Tget_size(t) : 0;
        if (t >= 0) H5Tclose(t);
        if (H5Pget_nfilters(dcpl) == 2 && H5Pget_filter2(dcpl, 0, &flags, &n0, cd0, 0, NULL, NULL) == H5Z_FILTER_SHUFFLE &&
            H5Pget_filter2(dcpl, 1, &flags, &n1, cd1, 0, NULL, NULL) == H5Z_FILTER_DEFLATE && n1 >= 1 && cd1[0] <= 9 &&
            (n0 == 0 || cd0[0] == esize) && (esize == 2 || esize == 4)) {
            w->zlevel[i] = (signed char)cd1[0];
            any = true;
        }
        H5Pclose(dcpl);
    }
    return any ? jobs_alloc(w, err) : KVQ_OK;
}

kvq_status kvq_dump_create(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                           kvq_dump_writer **out, kvq_err *err)
{
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_dump_writer *w = NULL;
    kvq_status s = kvqi_writer_alloc(path, meta, opts, &w, err);
    if (s) goto done;
    if (!w->opts.force && kvqi_file_exists(path)) {
        s = kvq_fail(err, KVQ_EIO, "%s: already exists (use --force to replace it)", path);
    } else if (is_dir(w->d.fname)) { /* (it read "an unfinished dump is there (use --resume ...)") */
        s = kvq_fail(err, KVQ_EIO, "%s: is a directory, not an unfinished dump; move it away first", w->d.fname);
    } else if (!w->opts.force && kvqi_file_exists(w->d.fname)) {
        if (kvqi_locked_by_another(w->d.fname)) s = kvq_fail(err, KVQ_EIO, "%s: an unfinished dump is there, %s", w->d.fname, kvqi_IN_USE);
        else s = kvq_fail(err, KVQ_EIO, "%s: an unfinished dump is there (use --resume to continue it or --force to start over)", w->d.fname);
    } else if (w->opts.force && (s = remove_stale_partial(w->d.fname, err)) != KVQ_OK) {
        /* (the error is set; nothing was touched) */
    } else {
        hid_t fapl = kvqi_make_fapl();
        if (fapl < 0) {
            s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up file access", w->d.fname);
        } else {
            /* no object timestamps (root group included): same inputs, same bytes */
            hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
            if (fcpl < 0 || H5Pset_obj_track_times(fcpl, 0) < 0) {
                s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up file creation", w->d.fname);
            } else {
                w->d.file = H5Fcreate(w->d.fname, H5F_ACC_EXCL, fcpl, fapl); /* (a stale partial was removed above) */
                if (w->d.file < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot create", w->d.fname);
                else kvqi_hold_lock(w);
            }
            if (fcpl >= 0) H5Pclose(fcpl);
            H5Pclose(fapl);
        }
        if (!s) s = kvqi_write_root_attrs(&w->d, err);
        if (!s) s = kvqi_create_datasets(&w->d, w->opts.deflate_level, err);
        if (!s) s = kvqi_writer_filters(w, err);
        if (!s && H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: flush failed", w->d.fname);
        if (s && w->d.file >= 0) { /* nothing worth keeping: remove the half-made file (unclosed, see kvqi_quiet_begin) */
            w->d.broken = true;
            kvqi_dump_close_file(&w->d);
            unlink(w->d.fname);
        }
    }
    if (s) {
        kvqi_writer_free(w);
        w = NULL;
    }
done:
    *out = w;
    kvqi_quiet_end(&q);
    return s;
}

int64_t kvq_dump_writer_samples_done(const kvq_dump_writer *w) { return w->d.samples_done; }
const kvq_dump_meta *kvq_dump_writer_meta(const kvq_dump_writer *w) { return &w->d.meta; }

static kvq_status check_turn(kvq_dump_writer *w, int64_t sample, kvq_err *err)
{
    if (w->opts.stop && *w->opts.stop)
        return kvq_fail(err, KVQ_EIO, "%s: interrupted by a signal after %" PRId64 " complete samples (resume with --resume)",
                        w->d.fname, w->d.samples_done);
    if (w->d.file < 0) return kvq_fail(err, KVQ_EINVAL, "%s: writer is not open", w->d.fname);
    if (w->d.broken)
        return kvq_fail(err, KVQ_EIO, "%s: unusable after an earlier write error (%" PRId64 " samples committed)",
                        w->d.fname, w->d.samples_done);
    if (sample != w->d.samples_done)
        return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 " written out of order: expected sample %" PRId64 " of %" PRId64,
                        w->d.fname, sample, w->d.samples_done, w->d.meta.n_samples);
    if (sample >= w->d.meta.n_samples)
        return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 " is beyond n_samples = %" PRId64, w->d.fname, sample,
                        w->d.meta.n_samples);
    return KVQ_OK;
}

/* Write rows [t0, t0+n) (here: the whole sample) of one sample of a dataset. */
static kvq_status write_ds(kvq_dump_writer *w, int layer, kvq_dump_ds ds, int64_t sample, const float *x, kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    hid_t id = *ds_slot(&w->d, layer, ds);
    hsize_t full[4], start[4] = {0}, count[4];
    int rank = kvqi_ds_full_dims(m, ds, full);
    memcpy(count, full, sizeof count);
    start[0] = (hsize_t)sample;
    count[0] = 1;
    hid_t fs = H5Dget_space(id), ms = H5Screate_simple(rank, count, NULL);
    size_t n = kvq_dump_ds_sample_elems(m, ds);
    herr_t rc = -1;
    h5_errtext et = {{0}, {0}};
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0) {
        if (ds_is_f16(m, ds)) {
            for (size_t i = 0; i < n; i++) w->d.scratch[i] = kvq_f32_to_f16(x[i]);
            rc = H5Dwrite(id, w->d.f16_mem, ms, fs, H5P_DEFAULT, w->d.scratch);
        } else {
            rc = H5Dwrite(id, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, x);
        }
    }
    if (rc < 0) kvqi_h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0) {
        w->d.broken = true;
        return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: writing /layers/%d/%s sample %" PRId64 " failed", w->d.fname, layer,
                          kvqi_DS_NAMES[ds], sample);
    }
    return KVQ_OK;
}

/* The chunk's values in file order, byte-shuffled as HDF5's shuffle filter does
 * (H5Zshuffle.c: byte b of element i goes to out[b*n + i]), little-endian file
 * types; past the dataset's end (edge chunk) the fill value 0. */
static void shuffle_chunk(const kvq_dump_meta *m, const chunk_job *jb, const float *x)
{
    kvq_dump_ds ds = jb->ds;
    bool f16 = ds_is_f16(m, ds);
    size_t esize = f16 ? 2 : 4, ne = jb->raw_bytes / esize;
    unsigned char *o = jb->shuf;
    /* source of chunk element i: per-token [rows][heads][D] -> x[e0 + i];
     * attention [H][cols] -> x[h*L + c0 + c] */
    size_t L = (size_t)m->seq_len, row = ds_is_attn(ds) ? 0 : (size_t)ds_heads(m, ds) * (size_t)m->head_dim;
    size_t total = ds_is_attn(ds) ? 0 : L * row, e0 = ds_is_attn(ds) ? 0 : (size_t)jb->offset[1] * row;
    size_t c0 = ds_is_attn(ds) ? (size_t)jb->offset[2] : 0, cols = ds_is_attn(ds) ? ne / (size_t)m->n_heads : 0;
    for (size_t i = 0; i < ne; i++) {
        float v = 0.0f;
        bool have;
        if (ds_is_attn(ds)) {
            size_t h = i / cols, c = c0 + i % cols;
            have = c < L;
            if (have) v = x[h * L + c];
        } else {
            have = e0 + i < total;
            if (have) v = x[e0 + i];
        }
        if (f16) {
            uint16_t u = have ? kvq_f32_to_f16(v) : 0;
            o[i] = (unsigned char)(u & 0xff);
            o[ne + i] = (unsigned char)(u >> 8);
        } else {
            uint32_t u = 0;
            if (have) memcpy(&u, &v, sizeof u);
            for (size_t b = 0; b < 4; b++) o[b * ne + i] = (unsigned char)(u >> (8 * b));
        }
    }
}

/* zlib stream of src at `level` with the Huffman-only strategy: the shuffled
 * bytes of activations have little for LZ77 to match (measured: it saves ~1%
 * of the size at 3-4x the time), so entropy coding alone keeps nearly all of
 * deflate's gain. The output is an ordinary zlib (RFC 1950/1951) stream, which
 * HDF5's deflate filter (and h5py) decompress like any other. */
static int zcompress_huffman(Bytef *dst, uLongf *dst_len, const Bytef *src, uLong n, int level)
{
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    int rc = deflateInit2(&zs, level, Z_DEFLATED, 15, 8, Z_HUFFMAN_ONLY);
    if (rc != Z_OK) return rc;
    zs.next_in = (Bytef *)src;
    zs.avail_in = (uInt)n;
    zs.next_out = dst;
    zs.avail_out = (uInt)*dst_len;
    rc = deflate(&zs, Z_FINISH);
    *dst_len = zs.total_out;
    deflateEnd(&zs);
    return rc == Z_STREAM_END ? Z_OK : (rc == Z_OK ? Z_BUF_ERROR : rc);
}

/* deflate > 0: shuffle + deflate every chunk of the layer in parallel (OpenMP,
 * zcompress_huffman at the dataset's level), then hand the filtered chunks to
 * HDF5 one by one on this thread (H5Dwrite_chunk, filter mask 0 = both filters
 * applied). Readers see the standard shuffle + deflate datasets. */
static kvq_status write_layer_chunks(kvq_dump_writer *w, int layer, int64_t sample, const kvq_dump_layer_data *d,
                                     kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    const signed char *zlevel = w->zlevel + (size_t)(layer - m->layer_first) * KVQ_DUMP_N_DS;
    chunk_job *jobs = w->jobs;
    long n = (long)w->n_jobs;
#pragma omp parallel for schedule(dynamic, 1)
    for (long j = 0; j < n; j++) {
        chunk_job *jb = &jobs[j];
        int level = zlevel[jb->ds];
        jb->zrc = Z_OK;
        if (level < 0) continue; /* written by write_ds */
        shuffle_chunk(m, jb, layer_ptr(d, jb->ds));
        uLongf zl = (uLongf)jb->zcap;
        jb->zrc = zcompress_huffman(jb->zbuf, &zl, jb->shuf, (uLong)jb->raw_bytes, level);
        jb->zlen = (size_t)zl;
    }
    for (long j = 0; j < n; j++)
        if (jobs[j].zrc != Z_OK)
            return kvq_fail(err, jobs[j].zrc == Z_MEM_ERROR ? KVQ_ENOMEM : KVQ_EIO,
                            "%s: compressing /layers/%d/%s sample %" PRId64 " failed: zlib error %d", w->d.fname, layer,
                            kvqi_DS_NAMES[jobs[j].ds], sample, jobs[j].zrc);
    for (long j = 0; j < n; j++) {
        chunk_job *jb = &jobs[j];
        if (zlevel[jb->ds] < 0) continue;
        jb->offset[0] = (hsize_t)sample;
        if (H5Dwrite_chunk(*ds_slot(&w->d, layer, jb->ds), H5P_DEFAULT, 0, jb->offset, jb->zlen, jb->zbuf) < 0) {
            w->d.broken = true;
            return kvqi_h5_fail(err, KVQ_EIO, "%s: writing /layers/%d/%s sample %" PRId64 " failed", w->d.fname, layer,
                           kvqi_DS_NAMES[jb->ds], sample);
        }
    }
    return KVQ_OK;
}

static kvq_status write_layer_impl(kvq_dump_writer *w, int64_t sample, int layer, const kvq_dump_layer_data *d,
                                   kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    KVQ_TRY(check_turn(w, sample, err));
    if (layer < m->layer_first || layer > m->layer_last)
        return kvq_fail(err, KVQ_EINVAL, "%s: layer %d is outside the dumped range %d-%d", w->d.fname, layer,
                        m->layer_first, m->layer_last);
    if (!d) return kvq_fail(err, KVQ_EINVAL, "%s: layer %d: no data", w->d.fname, layer);
    /* check every value before writing anything */
    for (int k = 0; k < KVQ_DUMP_N_DS; k++) {
        kvq_dump_ds ds = (kvq_dump_ds)k;
        if (!kvq_dump_ds_enabled(m, ds)) continue;
        const float *x = layer_ptr(d, ds);
        if (!x)
            return kvq_fail(err, KVQ_EINVAL, "%s: layer %d: no data for %s, which the dump records", w->d.fname, layer, kvqi_DS_NAMES[k]);
        kvq_status s = kvq_dump_check_values(m, ds, x, layer, sample, ds_is_f16(m, ds) ? KVQ_DUMP_F16_MAX : 0.0f, err);
        if (s) return kvq_err_prefix(err, "%s", w->d.fname);
    }
    /* filtered datasets: chunks compressed here in parallel; the others (deflate 0) through H5Dwrite */
    if (w->jobs) KVQ_TRY(write_layer_chunks(w, layer, sample, d, err));
    const signed char *zlevel = w->zlevel + (size_t)(layer - m->layer_first) * KVQ_DUMP_N_DS;
    for (int k = 0; k < KVQ_DUMP_N_DS; k++)
        if (kvq_dump_ds_enabled(m, (kvq_dump_ds)k) && zlevel[k] < 0)
            KVQ_TRY(write_ds(w, layer, (kvq_dump_ds)k, sample, layer_ptr(d, (kvq_dump_ds)k), err));
    uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
    for (int k = 0; k < KVQ_DUMP_N_DS; k++)
        if (kvq_dump_ds_enabled(m, (kvq_dump_ds)k)) crc = ds_crc(m, (kvq_dump_ds)k, layer_ptr(d, (kvq_dump_ds)k), crc);
    w->crc[layer - m->layer_first] = crc;
    w->layer_done[layer - m->layer_first] = 1;
    return KVQ_OK;
}

kvq_status kvq_dump_write_layer(kvq_dump_writer *w, int64_t sample, int layer, const kvq_dump_layer_data *d,
                                kvq_err *err)
{
    if (!w) return kvq_fail(err, KVQ_EINVAL, "dump: NULL writer");
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = write_layer_impl(w, sample, layer, d, err);
    kvqi_quiet_end(&q);
    return s;
}

static kvq_status commit_impl(kvq_dump_writer *w, int64_t sample, const int32_t *tokens, kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    KVQ_TRY(check_turn(w, sample, err));
    for (int j = 0; j < w->d.n_range; j++)
        if (!w->layer_done[j])
            return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 ": layer %d was not written before commit", w->d.fname,
                            sample, m->layer_first + j);
    if (!tokens) return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 ": no tokens", w->d.fname, sample);
    for (int64_t t = 0; t < m->seq_len; t++)
        if (tokens[t] < 0 || tokens[t] >= m->vocab_size)
            return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 ", position %" PRId64 ": token id %d outside the vocabulary [0, %d)",
                            w->d.fname, sample, t, tokens[t], m->vocab_size);
    hsize_t start[2] = {(hsize_t)sample, 0}, count[2] = {1, (hsize_t)m->seq_len};
    hid_t fs = H5Dget_space(w->d.tokens), ms = H5Screate_simple(2, count, NULL);
    herr_t rc = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = H5Dwrite(w->d.tokens, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, tokens);
    h5_errtext et = {{0}, {0}};
    if (rc < 0) kvqi_h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0) w->d.broken = true;
    if (rc < 0) return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: writing /tokens sample %" PRId64 " failed", w->d.fname, sample);
    if (w->d.crcs >= 0) { /* the sample's checksums, before the counter that declares it complete */
        w->crc[w->d.n_range] = tokens_crc(tokens, m->seq_len);
        hsize_t cs[2] = {(hsize_t)sample, 0}, cc[2] = {1, (hsize_t)w->d.n_range + 1};
        hid_t cfs = H5Dget_space(w->d.crcs), cms = H5Screate_simple(2, cc, NULL);
        rc = -1;
        if (cfs >= 0 && cms >= 0 && H5Sselect_hyperslab(cfs, H5S_SELECT_SET, cs, NULL, cc, NULL) >= 0)
            rc = H5Dwrite(w->d.crcs, H5T_NATIVE_UINT32, cms, cfs, H5P_DEFAULT, w->crc);
        if (rc < 0) kvqi_h5_capture(&et);
        if (cfs >= 0) H5Sclose(cfs);
        if (cms >= 0) H5Sclose(cms);
        if (rc < 0) {
            w->d.broken = true;
            return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: writing /sample_crc32 sample %" PRId64 " failed", w->d.fname, sample);
        }
    }
    /* data first, then the counter that declares it complete */
    if (H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        w->d.broken = true;
        return kvqi_h5_fail(err, KVQ_EIO, "%s: flushing sample %" PRId64 " failed", w->d.fname, sample);
    }
    hid_t a = H5Aopen(w->d.file, "samples_done", H5P_DEFAULT);
    int64_t done = sample + 1;
    rc = a >= 0 ? H5Awrite(a, H5T_NATIVE_INT64, &done) : -1;
    if (rc < 0) kvqi_h5_capture(&et);
    if (a >= 0) H5Aclose(a);
    if (rc >= 0 && H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        rc = -1;
        kvqi_h5_capture(&et);
    }
    if (rc < 0) w->d.broken = true;
    if (rc < 0)
        return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: recording sample %" PRId64 " as complete failed", w->d.fname, sample);
    w->d.samples_done = done;
    memset(w->layer_done, 0, (size_t)w->d.n_range);
    return KVQ_OK;
}

kvq_status kvq_dump_commit_sample(kvq_dump_writer *w, int64_t sample, const int32_t *tokens, kvq_err *err)
{
    if (!w) return kvq_fail(err, KVQ_EINVAL, "dump: NULL writer");
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = commit_impl(w, sample, tokens, err);
    kvqi_quiet_end(&q);
    return s;
}

kvq_status kvq_dump_write_sample(kvq_dump_writer *w, int64_t sample, const int32_t *tokens,
                                 const kvq_dump_layer_data *layers, kvq_err *err)
{
    if (!w) return kvq_fail(err, KVQ_EINVAL, "dump: NULL writer");
    if (!layers) return kvq_fail(err, KVQ_EINVAL, "%s: sample %" PRId64 ": no layer data", w->d.fname, sample);
    for (int j = 0; j < w->d.n_range; j++)
        KVQ_TRY(kvq_dump_write_layer(w, sample, w->d.meta.layer_first + j, &layers[j], err));
    return kvq_dump_commit_sample(w, sample, tokens, err);
}

static kvq_status fsync_path(const char *p, int flags, kvq_err *err)
{
    int fd = open(p, flags);
    if (fd < 0) return kvq_fail(err, KVQ_EIO, "%s: cannot open to sync: %s", p, strerror(errno));
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL && e != EROFS) /* directories on some filesystems refuse fsync */
        return kvq_fail(err, KVQ_EIO, "%s: fsync failed: %s", p, strerror(e));
    return KVQ_OK;
}

static kvq_status finish_impl(kvq_dump_writer *w, kvq_err *err)
{
    h5_dump *d = &w->d;
    if (d->file < 0) return kvq_fail(err, KVQ_EINVAL, "%s: writer is not open", d->fname);
    if (d->broken)
        return kvq_fail(err, KVQ_EIO, "%s: not finished after an earlier write error; %s keeps the %" PRId64
                                      " committed samples (free space, then --resume)", d->path, d->fname, d->samples_done);
    if (d->samples_done != d->meta.n_samples) {
        kvq_fail(err, KVQ_EINVAL, "%s: dump incomplete: %" PRId64 " of %" PRId64 " samples written; kept as %s (use --resume)",
                 d->path, d->samples_done, d->meta.n_samples, d->fname);
        kvqi_dump_close_file(d);
        return KVQ_EINVAL;
    }
    if (kvqi_dump_close_file(d) < 0) return kvqi_h5_fail(err, KVQ_EIO, "%s: closing failed", d->fname);
    KVQ_TRY(fsync_path(d->fname, O_RDONLY, err));
    int rc;
    if (w->opts.force) {
        rc = rename(d->fname, d->path);
    } else {
        rc = renameat2(AT_FDCWD, d->fname, AT_FDCWD, d->path, RENAME_NOREPLACE);
        if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) { /* filesystem without RENAME_NOREPLACE */
            rc = link(d->fname, d->path);
            if (rc == 0) unlink(d->fname);
        }
    }
    if (rc != 0) {
        int e = errno;
        return kvq_fail(err, KVQ_EIO, "%s: cannot rename %s to it: %s%s", d->path, d->fname, strerror(e),
                        e == EEXIST ? " (created meanwhile; use --force to replace it)" : "");
    }
    /* make the rename durable */
    char dir[KVQ_DUMP_PATH_MAX];
    snprintf(dir, sizeof dir, "%s", d->path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    return fsync_path(dir, O_RDONLY | O_DIRECTORY, err);
}

kvq_status kvq_dump_finish(kvq_dump_writer *w, kvq_err *err)
{
    if (!w) return kvq_fail(err, KVQ_EINVAL, "dump: NULL writer");
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = finish_impl(w, err);
    kvqi_writer_free(w);
    kvqi_quiet_end(&q);
    return s;
}

kvq_status kvq_dump_abort(kvq_dump_writer *w, kvq_err *err)
{
    if (!w) return KVQ_OK;
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = KVQ_OK;
    if (kvqi_dump_close_file(&w->d) < 0)
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: closing after an interruption failed (the last sample may be lost; %" PRId64 " were committed)",
                    w->d.fname, w->d.samples_done);
    kvqi_writer_free(w);
    kvqi_quiet_end(&q);
    return s;
}

/* ---- model constants: the key biases ---------------------------------------- */

kvq_status kvq_dump_write_k_bias(kvq_dump_writer *w, const float *bias, kvq_err *err)
{
    const kvq_dump_meta *m = &w->d.meta;
    if (!bias) return kvq_fail(err, KVQ_EINVAL, "%s: /k_bias: NULL data", w->d.fname);
    if (w->d.broken) return kvq_fail(err, KVQ_EIO, "%s: an earlier write failed; the writer accepts no more data", w->d.fname);
    const hsize_t dims[2] = {(hsize_t)(m->layer_last - m->layer_first + 1), (hsize_t)m->n_kv_heads * (hsize_t)m->head_dim};
    for (hsize_t i = 0; i < dims[0] * dims[1]; i++)
        if (!isfinite(bias[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "%s: /k_bias: layer %d channel %llu is %g", w->d.fname, m->layer_first + (int)(i / dims[1]),
                            (unsigned long long)(i % dims[1]), (double)bias[i]);
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = KVQ_OK;
    hid_t sp = -1, ds = -1;
    htri_t ex = H5Lexists(w->d.file, "k_bias", H5P_DEFAULT);
    if (ex > 0) ds = H5Dopen2(w->d.file, "k_bias", H5P_DEFAULT); /* resume: the same model, so the same values */
    else if ((sp = H5Screate_simple(2, dims, NULL)) >= 0)
        ds = H5Dcreate2(w->d.file, "k_bias", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (ds < 0 || H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, bias) < 0 || H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: writing /k_bias failed", w->d.fname);
        w->d.broken = true;
    }
    if (ds >= 0 && !w->d.broken) H5Dclose(ds);
    if (sp >= 0) H5Sclose(sp);
    kvqi_quiet_end(&q);
    return s;
}
