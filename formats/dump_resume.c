/* dump_resume.c — kvq_dump_resume (formats/dump.h): reopen a <path>.partial, check its root attributes against the
 * request, and read every committed sample back against its CRC-32s before writing on. */
#include "dump_internal.h"

#include <hdf5.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* Read every committed sample back and check it against its CRC-32s (/sample_crc32): a .partial damaged after it
 * was written (a disk error, an editor, a copy cut short) is refused instead of continued. A chunk that cannot
 * be read (a deflate stream whose own checksum fails) is refused as well; dumps from before the checksums are
 * only read through. */
static kvq_status verify_samples(h5_dump *d, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    size_t mx = 0;
    for (int k = 0; k < KVQ_DUMP_N_DS; k++) {
        size_t e = kvq_dump_ds_sample_elems(m, (kvq_dump_ds)k);
        mx = e > mx ? e : mx;
    }
    if ((size_t)m->seq_len > mx) mx = (size_t)m->seq_len;
    unsigned char *buf = malloc(mx * 4);
    uint32_t *want = malloc(((size_t)d->n_range + 1) * sizeof *want);
    kvq_status s = KVQ_OK;
    if (!buf || !want) s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory for verifying the written samples", d->fname);
    static const char again[] = "the unfinished dump was damaged after it was written and cannot be resumed; start it again with --force";
    for (int64_t smp = 0; !s && smp < d->samples_done; smp++) {
        if (d->crcs >= 0) {
            hsize_t cs[2] = {(hsize_t)smp, 0}, cc[2] = {1, (hsize_t)d->n_range + 1};
            hid_t fs = H5Dget_space(d->crcs), ms = H5Screate_simple(2, cc, NULL);
            herr_t rc = fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, cs, NULL, cc, NULL) >= 0
                            ? H5Dread(d->crcs, H5T_NATIVE_UINT32, ms, fs, H5P_DEFAULT, want)
                            : -1;
            if (fs >= 0) H5Sclose(fs);
            if (ms >= 0) H5Sclose(ms);
            if (rc < 0) s = kvqi_h5_fail(err, KVQ_EFORMAT, "%s: sample %" PRId64 ": its checksums cannot be read: %s", d->fname, smp, again);
        }
        for (int j = 0; !s && j <= d->n_range; j++) {
            uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
            const char *what = "tokens";
            for (int k = 0; !s && k < (j < d->n_range ? KVQ_DUMP_N_DS : 1); k++) {
                kvq_dump_ds ds = (kvq_dump_ds)k;
                hid_t id = d->tokens, mt = H5T_STD_I32LE;
                size_t n = (size_t)m->seq_len, esize = 4;
                hsize_t full[4] = {(hsize_t)m->n_samples, (hsize_t)m->seq_len}, start[4] = {(hsize_t)smp}, count[4];
                int rank = 2;
                if (j < d->n_range) {
                    if (!kvq_dump_ds_enabled(m, ds)) continue;
                    id = *ds_slot(d, m->layer_first + j, ds);
                    rank = kvqi_ds_full_dims(m, ds, full);
                    n = kvq_dump_ds_sample_elems(m, ds);
                    esize = ds_is_f16(m, ds) ? 2 : 4;
                    mt = esize == 2 ? kvqi_make_f16_type(H5T_ORDER_LE) : H5Tcopy(H5T_IEEE_F32LE);
                    what = kvqi_DS_NAMES[k];
                }
                memcpy(count, full, sizeof count);
                count[0] = 1;
                hid_t fs = H5Dget_space(id), ms = H5Screate_simple(rank, count, NULL);
                herr_t rc = mt >= 0 && fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0
                                ? H5Dread(id, mt, ms, fs, H5P_DEFAULT, buf)
                                : -1;
                if (fs >= 0) H5Sclose(fs);
                if (ms >= 0) H5Sclose(ms);
                if (j < d->n_range && mt >= 0) H5Tclose(mt);
                if (rc < 0) {
                    char where[96] = "";
                    if (j < d->n_range) snprintf(where, sizeof where, "layer %d ", m->layer_first + j);
                    s = kvqi_h5_fail(err, KVQ_EFORMAT, "%s: sample %" PRId64 ", %s%s: cannot be read back: %s", d->fname, smp, where, what,
                                again);
                    break;
                }
                crc = (uint32_t)crc32(crc, buf, (uInt)(n * esize));
            }
            if (!s && d->crcs >= 0 && crc != want[j]) {
                if (j < d->n_range)
                    s = kvq_fail(err, KVQ_EFORMAT,
                                 "%s: sample %" PRId64 ", layer %d: the stored K/V do not match their CRC-32 (%08x, recorded %08x): %s",
                                 d->fname, smp, m->layer_first + j, crc, want[j], again);
                else
                    s = kvq_fail(err, KVQ_EFORMAT, "%s: sample %" PRId64 ": the stored tokens do not match their CRC-32 (%08x, recorded %08x): %s",
                                 d->fname, smp, crc, want[j], again);
            }
        }
    }
    free(buf);
    free(want);
    return s;
}

kvq_status kvq_dump_resume(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                           kvq_dump_writer **out, kvq_err *err)
{
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_dump_writer *w = NULL;
    h5_dump f; /* what the file holds */
    kvqi_dump_init(&f);
    kvq_status s = kvqi_writer_alloc(path, meta, opts, &w, err);
    if (s) goto done;
    snprintf(f.fname, sizeof f.fname, "%s", w->d.fname);
    if (!w->opts.force && kvqi_file_exists(path)) {
        s = kvq_fail(err, KVQ_EIO, "%s: already exists (use --force to replace it)", path);
        goto done;
    }
    if (!kvqi_file_exists(w->d.fname)) {
        s = kvq_fail(err, KVQ_EIO, "%s: no unfinished dump to resume", w->d.fname);
        goto done;
    }
    if ((s = kvq_check_regular(w->d.fname, "an unfinished kvdump dump (HDF5)", err))) goto done;
    if (kvqi_locked_by_another(w->d.fname)) { /* (before our own open, whose lock would answer the probe) */
        s = kvq_fail(err, KVQ_EIO, "%s: cannot open for resuming: %s", w->d.fname, kvqi_IN_USE);
        goto done;
    }
    hid_t fapl = kvqi_make_fapl();
    if (fapl >= 0) {
        w->d.file = H5Fopen(w->d.fname, H5F_ACC_RDWR, fapl);
        if (w->d.file < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot open for resuming", w->d.fname);
        else kvqi_hold_lock(w);
        H5Pclose(fapl);
    } else {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up file access", w->d.fname);
    }
    if (s) goto done;
    f.file = w->d.file;
    if ((s = kvqi_read_root_attrs(&f, err))) goto done;
    if ((s = kvqi_compare_meta(w->d.fname, &f.meta, meta, err))) goto done;
    w->d.samples_done = f.samples_done;
    /* command_line and compute_device: record the resuming invocation */
    hid_t st = kvqi_vlen_str_type(), sp = H5Screate(H5S_SCALAR);
    const char *cl = meta->command_line, *cd = meta->compute_device;
    if (st < 0 || sp < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot build attribute types", w->d.fname);
    else s = kvqi_put_attr(w->d.file, w->d.fname, "command_line", st, st, sp, &cl, err);
    if (!s) s = kvqi_put_attr(w->d.file, w->d.fname, "compute_device", st, st, sp, &cd, err);
    if (st >= 0) H5Tclose(st);
    if (sp >= 0) H5Sclose(sp);
    if (s) goto done;
    s = kvqi_open_datasets(&w->d, 0, err);
    if (!s) s = verify_samples(&w->d, err);
    if (!s) s = kvqi_writer_filters(w, err);
done:
    f.file = H5I_INVALID_HID; /* owned by w */
    kvqi_dump_free(&f);
    if (s && w) {
        kvqi_writer_free(w);
        w = NULL;
    }
    *out = w;
    kvqi_quiet_end(&q);
    return s;
}
