/* dump_read.c — the kvdump HDF5 file's reader (formats/dump.h; schema: formats/DUMP.md): open, rows of a sample,
 * tokens, /k_bias. */
#include "dump_internal.h"
#include "half.h"
#include "sniff.h"

#include <errno.h>
#include <hdf5.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define READ_CACHE_BYTES ((size_t)4 << 20)  /* reader chunk cache per dataset: holds >= 1 chunk */

struct kvq_dump_reader {
    h5_dump d;
};

kvq_status kvq_dump_open(const char *path, kvq_dump_reader **out, kvq_err *err)
{
    *out = NULL;
    if (!path) return kvq_fail(err, KVQ_EINVAL, "dump: NULL path");
    if (strlen(path) >= KVQ_DUMP_PATH_MAX) return kvq_fail(err, KVQ_EINVAL, "dump: path longer than %d bytes", KVQ_DUMP_PATH_MAX - 1);
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = KVQ_OK;
    kvq_dump_reader *r = calloc(1, sizeof *r);
    if (!r) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    kvqi_dump_init(&r->d);
    snprintf(r->d.path, sizeof r->d.path, "%s", path);
    snprintf(r->d.fname, sizeof r->d.fname, "%s", path);
    if (access(path, R_OK) != 0) {
        s = kvq_fail(err, KVQ_EIO, "%s: cannot open: %s", path, strerror(errno));
        goto done;
    }
    /* HDF5 opens by name: a FIFO would block it forever, a directory fail with a library message */
    if ((s = kvq_check_regular(path, "a kvdump dump (HDF5)", err))) goto done;
    if (H5Fis_hdf5(path) <= 0) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: it is %s, not a kvdump dump (an HDF5 file: no HDF5 signature)", path,
                     kvq_kind_desc(kvq_sniff_path(path)));
        goto done;
    }
    hid_t fapl = kvqi_make_fapl();
    if (fapl >= 0) {
        r->d.file = H5Fopen(path, H5F_ACC_RDONLY, fapl);
        if (r->d.file < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot open", path);
        H5Pclose(fapl);
    } else {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up file access", path);
    }
    if (s) goto done;
    if ((s = kvqi_read_root_attrs(&r->d, err))) goto done;
    /* kvqi_dump_set_meta deep-copies the offsets: hand it the file's copy, then drop ours */
    int64_t *tmp = r->d.offsets;
    kvq_dump_meta m = r->d.meta;
    r->d.offsets = NULL;
    s = kvqi_dump_set_meta(&r->d, &m, err);
    free(tmp);
    if (!s) s = kvqi_open_datasets(&r->d, READ_CACHE_BYTES, err);
done:
    if (s && r) {
        kvqi_dump_close_file(&r->d);
        kvqi_dump_free(&r->d);
        free(r);
        r = NULL;
    }
    *out = r;
    kvqi_quiet_end(&q);
    return s;
}

kvq_status kvq_dump_read_k_bias(kvq_dump_reader *r, float *out, bool *present, kvq_err *err)
{
    const kvq_dump_meta *m = &r->d.meta;
    *present = false;
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = KVQ_OK;
    if (H5Lexists(r->d.file, "k_bias", H5P_DEFAULT) <= 0) goto done;
    hid_t ds = H5Dopen2(r->d.file, "k_bias", H5P_DEFAULT), sp = ds >= 0 ? H5Dget_space(ds) : -1, ty = ds >= 0 ? H5Dget_type(ds) : -1;
    hsize_t dims[2] = {0, 0};
    const hsize_t want0 = (hsize_t)(m->layer_last - m->layer_first + 1), want1 = (hsize_t)m->n_kv_heads * (hsize_t)m->head_dim;
    if (ds < 0 || sp < 0 || ty < 0) s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot open /k_bias", r->d.fname);
    else if (H5Sget_simple_extent_ndims(sp) != 2 || H5Sget_simple_extent_dims(sp, dims, NULL) != 2 || dims[0] != want0 ||
             dims[1] != want1 || H5Tget_class(ty) != H5T_FLOAT)
        s = kvq_fail(err, KVQ_EFORMAT, "%s: /k_bias: expected float [%llu][%llu] (layers x kv_dim), found %d dims [%llu][%llu]", r->d.fname,
                     (unsigned long long)want0, (unsigned long long)want1, sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1,
                     (unsigned long long)dims[0], (unsigned long long)dims[1]);
    else if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: reading /k_bias failed", r->d.fname);
    else
        *present = true;
    if (ty >= 0) H5Tclose(ty);
    if (sp >= 0) H5Sclose(sp);
    if (ds >= 0) H5Dclose(ds);
done:
    kvqi_quiet_end(&q);
    return s;
}

const kvq_dump_meta *kvq_dump_reader_meta(const kvq_dump_reader *r) { return &r->d.meta; }
int64_t kvq_dump_reader_samples_done(const kvq_dump_reader *r) { return r->d.samples_done; }

bool kvq_dump_has(const kvq_dump_reader *r, int layer, kvq_dump_ds ds)
{
    const kvq_dump_meta *m = &r->d.meta;
    if (layer < m->layer_first || layer > m->layer_last || (unsigned)ds >= KVQ_DUMP_N_DS) return false;
    return r->d.ds[(size_t)(layer - m->layer_first) * KVQ_DUMP_N_DS + (size_t)ds] >= 0;
}

static kvq_status read_rows_impl(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, int64_t t0, int64_t n,
                                 float *out, kvq_err *err)
{
    h5_dump *d = &r->d;
    const kvq_dump_meta *m = &d->meta;
    if (!kvq_dump_has(r, layer, ds))
        return kvq_fail(err, KVQ_EINVAL, "%s: /layers/%d/%s is not in this dump (layers %d-%d, q %s, fisher %s, attn stats %s)",
                        d->fname, layer, kvq_dump_ds_name(ds), m->layer_first, m->layer_last, m->has_q ? "yes" : "no",
                        m->has_fisher ? "yes" : "no", m->has_attn_stats ? "yes" : "no");
    if (sample < 0 || sample >= d->samples_done)
        return kvq_fail(err, KVQ_EINVAL, "%s: /layers/%d/%s: sample %" PRId64 " requested, %" PRId64 " samples are complete",
                        d->fname, layer, kvqi_DS_NAMES[ds], sample, d->samples_done);
    if (t0 < 0 || n < 1 || t0 > m->seq_len || n > m->seq_len - t0)
        return kvq_fail(err, KVQ_EINVAL, "%s: /layers/%d/%s: positions [%" PRId64 ", %" PRId64 ") requested, seq_len is %" PRId64,
                        d->fname, layer, kvqi_DS_NAMES[ds], t0, t0 + n, m->seq_len);
    if (!out) return kvq_fail(err, KVQ_EINVAL, "%s: NULL output buffer", d->fname);
    hid_t id = *ds_slot(d, layer, ds);
    hsize_t full[4], start[4] = {0}, count[4];
    int rank = kvqi_ds_full_dims(m, ds, full);
    memcpy(count, full, sizeof count);
    start[0] = (hsize_t)sample;
    count[0] = 1;
    int tdim = ds_is_attn(ds) ? 2 : 1;
    start[tdim] = (hsize_t)t0;
    count[tdim] = (hsize_t)n;
    size_t elems = 1;
    for (int i = 0; i < rank; i++) elems *= (size_t)count[i];
    hid_t fs = H5Dget_space(id), ms = H5Screate_simple(rank, count, NULL);
    herr_t rc = -1;
    bool f16 = ds_is_f16(m, ds);
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = f16 ? H5Dread(id, d->f16_mem, ms, fs, H5P_DEFAULT, d->scratch)
                 : H5Dread(id, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, out);
    h5_errtext et = {{0}, {0}};
    if (rc < 0) kvqi_h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0)
        return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: reading /layers/%d/%s sample %" PRId64 " positions [%" PRId64 ", %" PRId64 ") failed",
                       d->fname, layer, kvqi_DS_NAMES[ds], sample, t0, t0 + n);
    if (f16)
        for (size_t i = 0; i < elems; i++) out[i] = kvq_f16_to_f32(d->scratch[i]);
    return KVQ_OK;
}

kvq_status kvq_dump_read_rows(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, int64_t t0, int64_t n,
                              float *out, kvq_err *err)
{
    if (!r) return kvq_fail(err, KVQ_EINVAL, "dump: NULL reader");
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvq_status s = read_rows_impl(r, layer, ds, sample, t0, n, out, err);
    kvqi_quiet_end(&q);
    return s;
}

kvq_status kvq_dump_read(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, float *out, kvq_err *err)
{
    if (!r) return kvq_fail(err, KVQ_EINVAL, "dump: NULL reader");
    return kvq_dump_read_rows(r, layer, ds, sample, 0, r->d.meta.seq_len, out, err);
}

kvq_status kvq_dump_read_tokens(kvq_dump_reader *r, int64_t s0, int64_t n, int32_t *out, kvq_err *err)
{
    if (!r) return kvq_fail(err, KVQ_EINVAL, "dump: NULL reader");
    h5_dump *d = &r->d;
    if (s0 < 0 || n < 1 || s0 > d->samples_done || n > d->samples_done - s0)
        return kvq_fail(err, KVQ_EINVAL, "%s: /tokens: samples [%" PRId64 ", %" PRId64 ") requested, %" PRId64 " are complete",
                        d->fname, s0, s0 + n, d->samples_done);
    if (!out) return kvq_fail(err, KVQ_EINVAL, "%s: NULL output buffer", d->fname);
    h5_quiet q;
    kvqi_quiet_begin(&q);
    hsize_t start[2] = {(hsize_t)s0, 0}, count[2] = {(hsize_t)n, (hsize_t)d->meta.seq_len};
    hid_t fs = H5Dget_space(d->tokens), ms = H5Screate_simple(2, count, NULL);
    herr_t rc = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = H5Dread(d->tokens, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, out);
    h5_errtext et = {{0}, {0}};
    if (rc < 0) kvqi_h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    kvq_status s = rc < 0 ? kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: reading /tokens samples [%" PRId64 ", %" PRId64 ") failed", d->fname, s0, s0 + n)
                          : KVQ_OK;
    kvqi_quiet_end(&q);
    return s;
}

void kvq_dump_close(kvq_dump_reader *r)
{
    if (!r) return;
    h5_quiet q;
    kvqi_quiet_begin(&q);
    kvqi_dump_close_file(&r->d);
    kvqi_dump_free(&r->d);
    free(r);
    kvqi_quiet_end(&q);
}
