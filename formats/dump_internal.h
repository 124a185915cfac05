/* dump_internal.h — what the kvdump HDF5 file's sources share (not a public API): dump.c (dataset table, meta,
 * HDF5 plumbing, root attributes, datasets), dump_write.c (writer), dump_resume.c (--resume and its checksum
 * verification), dump_read.c (reader). Each function is documented where it is defined. */
#ifndef KVQ_DUMP_INTERNAL_H
#define KVQ_DUMP_INTERNAL_H

#include "dump.h"

#include <hdf5.h>

#define CHUNK_MAX_BYTES ((size_t)1 << 20)   /* chunk cap: 1 MiB (and <= one sample x one layer) */

/* Silence HDF5's automatic error printing for the duration of one of our calls. */
typedef struct {
    H5E_auto2_t func;
    void *data;
} h5_quiet;

typedef struct {
    char inner[400]; /* innermost description */
    char os[300];    /* "errno = N, error message = '...'" if any level had one */
} h5_errtext;

/* Shared state of the open file: the handles of every dataset. */
typedef struct {
    kvq_dump_meta meta; /* sample_offsets → offsets */
    int64_t *offsets;
    char path[KVQ_DUMP_PATH_MAX];   /* the name the user gave (final name) */
    char fname[KVQ_DUMP_PATH_MAX + 16]; /* the file actually open (path or path.partial) */
    hid_t file, tokens, f16_mem;
    hid_t crcs; /* /sample_crc32 [N][n_range + 1] (absent in dumps from before it: invalid) */
    hid_t *ds; /* [n_range * KVQ_DUMP_N_DS], invalid where absent */
    int n_range;
    int64_t samples_done;
    bool broken; /* an HDF5 write/flush failed: never close (see kvqi_quiet_begin), leave the file as last flushed */
    uint16_t *scratch;
    size_t scratch_n;
} h5_dump;

/* One chunk of one layer dataset of one sample, filtered by us (deflate > 0):
 * the same bytes HDF5's shuffle + deflate pipeline would store. */
typedef struct {
    kvq_dump_ds ds;
    hsize_t offset[4];    /* chunk origin in the file dataset; [0] = the sample */
    size_t raw_bytes;     /* whole chunk (an edge chunk is padded with the fill value 0) */
    unsigned char *shuf;  /* [raw_bytes] byte-shuffled chunk */
    unsigned char *zbuf;  /* [zcap] deflate output */
    size_t zcap, zlen;
    int zrc;              /* zcompress_huffman's status */
} chunk_job;

struct kvq_dump_writer {
    h5_dump d;
    kvq_dump_opts opts;
    unsigned char *layer_done; /* [n_range] for sample samples_done */
    signed char *zlevel;       /* [n_range * KVQ_DUMP_N_DS] deflate level of a dataset stored with exactly
                                  shuffle + deflate, else -1 (written through H5Dwrite) */
    chunk_job *jobs;           /* [n_jobs] the chunks of one layer (same for every layer); NULL when no dataset is filtered */
    size_t n_jobs;
    unsigned char *arena;      /* the jobs' shuf and zbuf buffers */
    int lock_fd;               /* our own flock on the .partial while HDF5's file locking is off, else -1 */
    uint32_t *crc;             /* [n_range + 1] CRC-32 of the sample in progress: each layer's stored values, its tokens */
};

/* ---- dataset table (dump.c) ---------------------------------------------------- */

extern const char *const kvqi_DS_NAMES[KVQ_DUMP_N_DS];
static inline bool ds_is_attn(kvq_dump_ds ds) { return ds == KVQ_DUMP_ATTN_RECEIVED || ds == KVQ_DUMP_ATTN_ENTROPY; }
static inline bool ds_is_f16(const kvq_dump_meta *m, kvq_dump_ds ds) { return m->dtype == KVQ_DUMP_F16 && ds <= KVQ_DUMP_Q; }
static inline int ds_heads(const kvq_dump_meta *m, kvq_dump_ds ds)
{
    return (ds == KVQ_DUMP_Q || ds_is_attn(ds)) ? m->n_heads : m->n_kv_heads;
}
static inline hid_t *ds_slot(h5_dump *d, int layer, kvq_dump_ds ds)
{
    return &d->ds[(size_t)(layer - d->meta.layer_first) * KVQ_DUMP_N_DS + (size_t)ds];
}
int kvqi_ds_full_dims(const kvq_dump_meta *m, kvq_dump_ds ds, hsize_t dims[4]);
void kvqi_chunk_dims(const kvq_dump_meta *m, kvq_dump_ds ds, const hsize_t full[4], int rank, hsize_t chunk[4]);

/* ---- HDF5 plumbing (dump.c) ----------------------------------------------------- */

extern const char kvqi_IN_USE[];
void kvqi_quiet_begin(h5_quiet *q);
void kvqi_quiet_end(const h5_quiet *q);
void kvqi_h5_capture(h5_errtext *t);
__attribute__((format(printf, 4, 5))) kvq_status kvqi_h5_fail_at(kvq_err *err, kvq_status code, const h5_errtext *t,
                                                            const char *fmt, ...);
__attribute__((format(printf, 3, 4))) kvq_status kvqi_h5_fail(kvq_err *err, kvq_status code, const char *fmt, ...);
hid_t kvqi_make_f16_type(H5T_order_t order);
hid_t kvqi_make_fapl(void);
void kvqi_dump_init(h5_dump *d);
herr_t kvqi_dump_close_file(h5_dump *d);
void kvqi_dump_free(h5_dump *d);
kvq_status kvqi_dump_set_meta(h5_dump *d, const kvq_dump_meta *m, kvq_err *err);

/* ---- root attributes and datasets (dump.c) -------------------------------------- */

kvq_status kvqi_put_attr(hid_t loc, const char *fname, const char *name, hid_t ftype, hid_t mtype, hid_t space,
                    const void *buf, kvq_err *err);
hid_t kvqi_vlen_str_type(void);
kvq_status kvqi_write_root_attrs(h5_dump *d, kvq_err *err);
kvq_status kvqi_read_root_attrs(h5_dump *d, kvq_err *err);
kvq_status kvqi_compare_meta(const char *fname, const kvq_dump_meta *file, const kvq_dump_meta *req, kvq_err *err);
kvq_status kvqi_create_datasets(h5_dump *d, int level, kvq_err *err);
kvq_status kvqi_open_datasets(h5_dump *d, size_t cache_bytes, kvq_err *err);

/* ---- writer (dump_write.c), for dump_resume.c ------------------------------------ */

bool kvqi_file_exists(const char *p);
bool kvqi_locked_by_another(const char *fname);
kvq_status kvqi_writer_alloc(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                        kvq_dump_writer **out, kvq_err *err);
void kvqi_hold_lock(kvq_dump_writer *w);
void kvqi_writer_free(kvq_dump_writer *w);
kvq_status kvqi_writer_filters(kvq_dump_writer *w, kvq_err *err);

#endif
