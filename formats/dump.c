/* dump.c — kvdump HDF5 writer/reader (schema: formats/DUMP.md). */
#include "dump.h"
#include "sha256.h"
#include "half.h"
#include "sniff.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define CHUNK_MAX_BYTES ((size_t)1 << 20)   /* chunk cap: 1 MiB (and <= one sample x one layer) */
#define READ_CACHE_BYTES ((size_t)4 << 20)  /* reader chunk cache per dataset: holds >= 1 chunk */

/* ---- f16 codec ------------------------------------------------------------ */

/* ---- dataset table -------------------------------------------------------- */

static const char *const DS_NAMES[KVQ_DUMP_N_DS] = {
    "k_pre_rope", "k", "v", "q", "fisher_k_pre_rope", "fisher_v", "attn_received", "attn_entropy",
};

const char *kvq_dump_ds_name(kvq_dump_ds ds)
{
    return (unsigned)ds < KVQ_DUMP_N_DS ? DS_NAMES[ds] : "?";
}

kvq_status kvq_dump_ds_from_name(const char *name, kvq_dump_ds *out, kvq_err *err)
{
    for (int i = 0; i < KVQ_DUMP_N_DS; i++)
        if (name && strcmp(name, DS_NAMES[i]) == 0) {
            *out = (kvq_dump_ds)i;
            return KVQ_OK;
        }
    return kvq_fail(err, KVQ_EINVAL, "unknown dump dataset '%s' (expected k_pre_rope, k, v, q, fisher_k_pre_rope, "
                                     "fisher_v, attn_received or attn_entropy)", name ? name : "(null)");
}

bool kvq_dump_ds_enabled(const kvq_dump_meta *m, kvq_dump_ds ds)
{
    switch (ds) {
    case KVQ_DUMP_K_PRE_ROPE: case KVQ_DUMP_K: case KVQ_DUMP_V: return true;
    case KVQ_DUMP_Q: return m->has_q;
    case KVQ_DUMP_FISHER_K_PRE_ROPE: case KVQ_DUMP_FISHER_V: return m->has_fisher;
    case KVQ_DUMP_ATTN_RECEIVED: case KVQ_DUMP_ATTN_ENTROPY: return m->has_attn_stats;
    default: return false;
    }
}

static bool ds_is_attn(kvq_dump_ds ds) { return ds == KVQ_DUMP_ATTN_RECEIVED || ds == KVQ_DUMP_ATTN_ENTROPY; }
static bool ds_is_f16(const kvq_dump_meta *m, kvq_dump_ds ds) { return m->dtype == KVQ_DUMP_F16 && ds <= KVQ_DUMP_Q; }
static int ds_heads(const kvq_dump_meta *m, kvq_dump_ds ds)
{
    return (ds == KVQ_DUMP_Q || ds_is_attn(ds)) ? m->n_heads : m->n_kv_heads;
}

void kvq_dump_ds_shape(const kvq_dump_meta *m, kvq_dump_ds ds, int *rank, int64_t dims[3])
{
    if (ds_is_attn(ds)) {
        *rank = 2;
        dims[0] = m->n_heads;
        dims[1] = m->seq_len;
        dims[2] = 1;
    } else {
        *rank = 3;
        dims[0] = m->seq_len;
        dims[1] = ds_heads(m, ds);
        dims[2] = m->head_dim;
    }
}

size_t kvq_dump_ds_sample_elems(const kvq_dump_meta *m, kvq_dump_ds ds)
{
    int rank;
    int64_t d[3];
    kvq_dump_ds_shape(m, ds, &rank, d);
    return (size_t)d[0] * (size_t)d[1] * (size_t)d[2]; /* validated not to overflow */
}

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

/* ---- root attribute table ------------------------------------------------- */

typedef enum { AK_INT, AK_I64, AK_F64, AK_STR, AK_BOOL, AK_DTYPE } attr_kind;
typedef struct {
    const char *name;
    attr_kind kind;
    size_t off, size;
    bool compare; /* checked on resume */
} attr_desc;

#define ATTR(f, k, c) { #f, k, offsetof(kvq_dump_meta, f), sizeof(((kvq_dump_meta *)0)->f), c }
static const attr_desc ATTRS[] = {
    ATTR(kvq_version, AK_STR, true),
    ATTR(model_path, AK_STR, false), /* (a path may be spelt another way: the sha256 decides) */
    ATTR(model_sha256, AK_STR, true),
    ATTR(model_arch, AK_STR, true),
    ATTR(n_layers, AK_INT, true),
    ATTR(dim, AK_INT, true),
    ATTR(hidden_dim, AK_INT, true),
    ATTR(n_heads, AK_INT, true),
    ATTR(n_kv_heads, AK_INT, true),
    ATTR(head_dim, AK_INT, true),
    ATTR(vocab_size, AK_INT, true),
    ATTR(ctx_len, AK_INT, true),
    ATTR(rope_theta, AK_F64, true),
    ATTR(rope_dim, AK_INT, true),
    ATTR(rope_pairing, AK_STR, true),
    ATTR(rope_scaling, AK_STR, true),
    ATTR(rope_scale_factor, AK_F64, true),
    ATTR(rope_low_freq_factor, AK_F64, true),
    ATTR(rope_high_freq_factor, AK_F64, true),
    ATTR(rope_orig_ctx, AK_INT, true),
    ATTR(rope_params, AK_STR, true),
    ATTR(attention, AK_STR, true),
    ATTR(tokenizer, AK_STR, true),
    ATTR(corpus_path, AK_STR, false), /* (likewise) */
    ATTR(corpus_sha256, AK_STR, true),
    ATTR(corpus_format, AK_STR, true),
    ATTR(bos_policy, AK_STR, true),
    ATTR(n_samples, AK_I64, true),
    ATTR(seq_len, AK_I64, true),
    ATTR(seed, AK_I64, true),
    ATTR(dtype, AK_DTYPE, true),
    ATTR(has_q, AK_BOOL, true),
    ATTR(has_fisher, AK_BOOL, true),
    ATTR(has_attn_stats, AK_BOOL, true),
    ATTR(layer_first, AK_INT, true),
    ATTR(layer_last, AK_INT, true),
    ATTR(compute_mode, AK_STR, true),
    ATTR(compute_device, AK_STR, false),
    ATTR(command_line, AK_STR, false),
};
/* attributes added after the first release: absent in older files (read as the default) */
static const char *optional_attr_default(const char *name)
{
    return !strcmp(name, "compute_mode") ? "exact"
           : !strcmp(name, "compute_device") || !strcmp(name, "rope_params") || !strcmp(name, "attention") ? ""
                                                                                                            : NULL;
}
#define N_ATTRS (sizeof ATTRS / sizeof *ATTRS)
/* plus: schema_version (int64), sample_offsets (int64 [N]), samples_done (int64) */

static int64_t attr_get_int(const kvq_dump_meta *m, const attr_desc *a)
{
    const char *p = (const char *)m + a->off;
    switch (a->kind) {
    case AK_INT: { int v; memcpy(&v, p, sizeof v); return v; }
    case AK_I64: { int64_t v; memcpy(&v, p, sizeof v); return v; }
    case AK_BOOL: { bool v; memcpy(&v, p, sizeof v); return v; }
    default: return 0;
    }
}

static void attr_set_int(kvq_dump_meta *m, const attr_desc *a, int64_t v)
{
    char *p = (char *)m + a->off;
    switch (a->kind) {
    case AK_INT: { int x = (int)v; memcpy(p, &x, sizeof x); break; }
    case AK_I64: memcpy(p, &v, sizeof v); break;
    case AK_BOOL: { bool x = v != 0; memcpy(p, &x, sizeof x); break; }
    default: break;
    }
}

static const char *dtype_name(kvq_dump_dtype t) { return t == KVQ_DUMP_F16 ? "f16" : "f32"; }

/* ---- meta helpers ----------------------------------------------------------- */

void kvq_dump_meta_set_hparams(kvq_dump_meta *m, const kvq_hparams *hp)
{
    snprintf(m->model_arch, sizeof m->model_arch, "%s", kvq_arch_name(hp->arch));
    m->n_layers = hp->n_layers;
    m->dim = hp->dim;
    m->hidden_dim = hp->hidden_dim;
    m->n_heads = hp->n_heads;
    m->n_kv_heads = hp->n_kv_heads;
    m->head_dim = hp->head_dim;
    m->vocab_size = hp->vocab_size;
    m->ctx_len = hp->ctx_len;
    m->rope_theta = hp->rope_theta;
    m->rope_dim = hp->rope_dim;
    snprintf(m->rope_pairing, sizeof m->rope_pairing, "interleaved");
    snprintf(m->rope_scaling, sizeof m->rope_scaling, "%s", kvq_rope_scaling_name(hp->rope_scaling));
    bool scaled = hp->rope_scaling == KVQ_ROPE_SCALING_LINEAR || hp->rope_scaling == KVQ_ROPE_SCALING_LLAMA3 ||
                  hp->rope_scaling == KVQ_ROPE_SCALING_YARN || hp->rope_scaling == KVQ_ROPE_SCALING_DYNAMIC;
    m->rope_scale_factor = scaled ? hp->rope_scale_factor : 1.0;
    bool l3 = hp->rope_scaling == KVQ_ROPE_SCALING_LLAMA3, yarn = hp->rope_scaling == KVQ_ROPE_SCALING_YARN;
    m->rope_low_freq_factor = l3 ? hp->rope_low_freq_factor : 0.0;
    m->rope_high_freq_factor = l3 ? hp->rope_high_freq_factor : 0.0;
    m->rope_orig_ctx = l3 || yarn ? hp->rope_orig_ctx : 0;
    m->rope_params[0] = 0;
    if (yarn) {
        snprintf(m->rope_params, sizeof m->rope_params, "beta_fast=%.9g beta_slow=%.9g attn_factor=%.9g truncate=%d",
                 (double)hp->rope_beta_fast, (double)hp->rope_beta_slow, (double)hp->rope_attn_factor, (int)hp->rope_yarn_truncate);
    } else if (hp->rope_scaling == KVQ_ROPE_SCALING_FREQ_FACTORS) {
        int n = hp->rope_dim / 2;
        unsigned char le[4 * KVQ_ROPE_MAX_PAIRS];
        float lo = hp->rope_freq_factors[0], hi = lo;
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &hp->rope_freq_factors[i], 4);
            for (int b = 0; b < 4; b++) le[4 * i + b] = (unsigned char)(u >> (8 * b));
            lo = hp->rope_freq_factors[i] < lo ? hp->rope_freq_factors[i] : lo;
            hi = hp->rope_freq_factors[i] > hi ? hp->rope_freq_factors[i] : hi;
        }
        char hex[65] = "";
        if (kvq_sha256_hex(le, (size_t)4 * n, hex, NULL) != KVQ_OK) snprintf(hex, sizeof hex, "?");
        snprintf(m->rope_params, sizeof m->rope_params, "n=%d min=%.9g max=%.9g sha256=%s", n, (double)lo, (double)hi, hex);
    }
    m->attention[0] = 0;
    if (hp->sliding_window > 0 && hp->swa_first_layer < hp->n_layers)
        snprintf(m->attention, sizeof m->attention, "sliding_window=%d first_layer=%d", hp->sliding_window, hp->swa_first_layer);
}

kvq_status kvq_dump_meta_validate(const kvq_dump_meta *m, kvq_err *err)
{
    if (!m) return kvq_fail(err, KVQ_EINVAL, "dump meta: NULL");
    for (size_t i = 0; i < N_ATTRS; i++) {
        const attr_desc *a = &ATTRS[i];
        if (a->kind == AK_STR && !memchr((const char *)m + a->off, 0, a->size))
            return kvq_fail(err, KVQ_EINVAL, "dump meta: %s is not NUL-terminated within %zu bytes", a->name, a->size);
    }
    const struct { const char *name; int v; } pos[] = {
        {"n_layers", m->n_layers}, {"dim", m->dim}, {"hidden_dim", m->hidden_dim}, {"n_heads", m->n_heads},
        {"n_kv_heads", m->n_kv_heads}, {"head_dim", m->head_dim}, {"vocab_size", m->vocab_size},
        {"ctx_len", m->ctx_len}, {"rope_dim", m->rope_dim},
    };
    for (size_t i = 0; i < sizeof pos / sizeof *pos; i++)
        if (pos[i].v < 1) return kvq_fail(err, KVQ_EINVAL, "dump meta: %s = %d, expected >= 1", pos[i].name, pos[i].v);
    if (m->n_heads % m->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "dump meta: n_heads = %d is not a multiple of n_kv_heads = %d", m->n_heads,
                        m->n_kv_heads);
    if (m->rope_dim > m->head_dim || m->rope_dim % 2)
        return kvq_fail(err, KVQ_EINVAL, "dump meta: rope_dim = %d, expected an even number <= head_dim = %d",
                        m->rope_dim, m->head_dim);
    if (!(m->rope_theta > 0) || !isfinite(m->rope_theta))
        return kvq_fail(err, KVQ_EINVAL, "dump meta: rope_theta = %g, expected a finite positive number", m->rope_theta);
    if (m->n_samples < 1) return kvq_fail(err, KVQ_EINVAL, "dump meta: n_samples = %" PRId64 ", expected >= 1", m->n_samples);
    if (m->seq_len < 1 || m->seq_len > m->ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "dump meta: seq_len = %" PRId64 ", expected 1 .. ctx_len = %d", m->seq_len,
                        m->ctx_len);
    if (m->layer_first < 0 || m->layer_last < m->layer_first || m->layer_last >= m->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "dump meta: layer range %d-%d, expected 0 <= first <= last <= %d",
                        m->layer_first, m->layer_last, m->n_layers - 1);
    if (m->dtype != KVQ_DUMP_F16 && m->dtype != KVQ_DUMP_F32)
        return kvq_fail(err, KVQ_EINVAL, "dump meta: dtype = %d, expected f16 or f32", (int)m->dtype);
    if (!m->sample_offsets) return kvq_fail(err, KVQ_EINVAL, "dump meta: sample_offsets is NULL (need n_samples values)");
    /* sizes: N * L * heads * head_dim * 4 bytes must fit */
    size_t t, heads = (size_t)(m->n_heads > m->n_kv_heads ? m->n_heads : m->n_kv_heads);
    if (kvq_mul_size((size_t)m->n_samples, (size_t)m->seq_len, &t) || kvq_mul_size(t, heads, &t) ||
        kvq_mul_size(t, (size_t)m->head_dim, &t) || kvq_mul_size(t, 4, &t) ||
        (size_t)m->n_samples > (size_t)1 << 40)
        return kvq_fail(err, KVQ_ENOMEM, "dump meta: n_samples x seq_len x heads x head_dim overflows");
    return KVQ_OK;
}

bool kvq_dump_find_bad(const float *x, size_t n_rows, size_t row_len, float max_abs, size_t *row, size_t *col)
{
    size_t n = n_rows * row_len;
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        if (!isfinite(v) || (max_abs > 0 && fabsf(v) > max_abs)) {
            *row = row_len ? i / row_len : 0;
            *col = row_len ? i % row_len : 0;
            return true;
        }
    }
    return false;
}

kvq_status kvq_dump_check_values(const kvq_dump_meta *m, kvq_dump_ds ds, const float *x, int layer, int64_t sample,
                                 float max_abs, kvq_err *err)
{
    int rank;
    int64_t d[3];
    kvq_dump_ds_shape(m, ds, &rank, d);
    size_t row, col;
    if (!kvq_dump_find_bad(x, (size_t)d[0], (size_t)(d[1] * d[2]), max_abs, &row, &col)) return KVQ_OK;
    float v = x[row * (size_t)(d[1] * d[2]) + col];
    char where[160];
    if (rank == 3) /* [L][heads][head_dim]: row = position */
        snprintf(where, sizeof where, "position %zu, head %zu, channel %zu", row, col / (size_t)d[2], col % (size_t)d[2]);
    else /* [n_heads][L]: row = head */
        snprintf(where, sizeof where, "position %zu, head %zu", col, row);
    if (!isfinite(v))
        return kvq_fail(err, KVQ_ENUMERIC, "%s: layer %d, sample %" PRId64 ", %s: value %g is not finite",
                        kvq_dump_ds_name(ds), layer, sample, where, (double)v);
    return kvq_fail(err, KVQ_ENUMERIC,
                    "%s: layer %d, sample %" PRId64 ", %s: value %g exceeds the f16 range +-%g (use --dtype f32)",
                    kvq_dump_ds_name(ds), layer, sample, where, (double)v, (double)max_abs);
}

kvq_dump_opts kvq_dump_opts_default(void)
{
    return (kvq_dump_opts){.force = false, .deflate_level = KVQ_DUMP_DEFLATE_DEFAULT, .stop = NULL};
}

/* ---- HDF5 plumbing ---------------------------------------------------------- */

/* Silence HDF5's automatic error printing for the duration of one of our calls. */
typedef struct {
    H5E_auto2_t func;
    void *data;
} h5_quiet;
static void quiet_begin(h5_quiet *q)
{
    /* HDF5 1.10.8 frees a file's struct when its close fails (flush after disk
     * full / file-size limit) but keeps the ID; the library's atexit cleanup
     * then touches it and crashes (HDFFV-11052, fixed in 1.14.1). We never
     * leave a healthy file open, so we give up that cleanup. Effective only
     * when this is the process's first HDF5 call; later calls just return
     * FAIL, which is harmless. */
    H5dont_atexit();
    if (H5Eget_auto2(H5E_DEFAULT, &q->func, &q->data) < 0) {
        q->func = NULL;
        q->data = NULL;
    }
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}
static void quiet_end(const h5_quiet *q) { H5Eset_auto2(H5E_DEFAULT, q->func, q->data); }

typedef struct {
    char inner[400]; /* innermost description */
    char os[300];    /* "errno = N, error message = '...'" if any level had one */
} h5_errtext;

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *ud)
{
    (void)n;
    h5_errtext *t = ud;
    if (!e->desc || !*e->desc) return 0;
    snprintf(t->inner, sizeof t->inner, "%s", e->desc);
    const char *p = strstr(e->desc, "errno = ");
    if (p && !t->os[0]) {
        const char *q = strstr(p, "', ");
        int len = q ? (int)(q - p + 1) : (int)strlen(p);
        snprintf(t->os, sizeof t->os, "%.*s", len, p);
    }
    return 0;
}

/* Copy the current HDF5 error stack's useful lines. Call it right after the
 * failing HDF5 call: any later API call (even a close) clears the stack. */
static void h5_capture(h5_errtext *t)
{
    t->inner[0] = t->os[0] = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk_cb, t);
}

/* HDF5's own lock (1.10+, file locking on): another process has the file open for writing,
 * reported as "errno = 11, error message = 'Resource temporarily unavailable'" */
static const char IN_USE[] = "in use by another process (it holds the file's lock: a running kvdump?); let that run finish or stop it first";

static kvq_status h5_vfail(kvq_err *err, kvq_status code, const h5_errtext *t, const char *fmt, va_list ap)
{
    char msg[KVQ_ERR_MSG_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    int en = 0;
    if (t->os[0] && sscanf(t->os, "errno = %d", &en) == 1 && en == EWOULDBLOCK) return kvq_fail(err, code, "%s: %s", msg, IN_USE);
    if (t->os[0]) return kvq_fail(err, code, "%s (%s)", msg, t->os);
    if (t->inner[0]) return kvq_fail(err, code, "%s (HDF5: %s)", msg, t->inner);
    return kvq_fail(err, code, "%s", msg);
}

/* kvq_fail with a captured HDF5 error line appended. */
__attribute__((format(printf, 4, 5))) static kvq_status h5_fail_at(kvq_err *err, kvq_status code, const h5_errtext *t,
                                                                   const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvq_status s = h5_vfail(err, code, t, fmt, ap);
    va_end(ap);
    return s;
}

/* kvq_fail with the current HDF5 error stack's most useful line appended. */
__attribute__((format(printf, 3, 4))) static kvq_status h5_fail(kvq_err *err, kvq_status code, const char *fmt, ...)
{
    h5_errtext t;
    h5_capture(&t);
    va_list ap;
    va_start(ap, fmt);
    kvq_status s = h5_vfail(err, code, &t, fmt, ap);
    va_end(ap);
    return s;
}

static void close_id(hid_t *id)
{
    if (*id >= 0) H5Idec_ref(*id);
    *id = H5I_INVALID_HID;
}

/* IEEE binary16 as h5py builds it (h5py/h5t.pyx IEEE_F16LE). */
static hid_t make_f16_type(H5T_order_t order)
{
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    if (t < 0) return t;
    if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0 ||
        H5Tset_precision(t, 16) < 0 || H5Tset_order(t, order) < 0) {
        H5Tclose(t);
        return H5I_INVALID_HID;
    }
    return t;
}

static bool type_is_f16(hid_t t)
{
    size_t spos, epos, esize, mpos, msize;
    return H5Tget_class(t) == H5T_FLOAT && H5Tget_size(t) == 2 &&
           H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize) >= 0 && spos == 15 && epos == 10 && esize == 5 &&
           mpos == 0 && msize == 10 && H5Tget_ebias(t) == 15;
}

/* Full file dims of a layer dataset: [N][L][heads][head_dim] or [N][n_heads][L]. */
static int ds_full_dims(const kvq_dump_meta *m, kvq_dump_ds ds, hsize_t dims[4])
{
    int rank;
    int64_t d[3];
    kvq_dump_ds_shape(m, ds, &rank, d);
    dims[0] = (hsize_t)m->n_samples;
    for (int i = 0; i < rank; i++) dims[1 + i] = (hsize_t)d[i];
    return rank + 1;
}

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
    bool broken; /* an HDF5 write/flush failed: never close (see quiet_begin), leave the file as last flushed */
    uint16_t *scratch;
    size_t scratch_n;
} h5_dump;

static void dump_init(h5_dump *d)
{
    memset(d, 0, sizeof *d);
    d->file = d->tokens = d->f16_mem = d->crcs = H5I_INVALID_HID;
}

static hid_t *ds_slot(h5_dump *d, int layer, kvq_dump_ds ds)
{
    return &d->ds[(size_t)(layer - d->meta.layer_first) * KVQ_DUMP_N_DS + (size_t)ds];
}

/* Close everything; returns H5Fclose's result (< 0: the final flush failed). */
static herr_t dump_close_file(h5_dump *d)
{
    herr_t rc = 0;
    if (d->broken) { /* leak the handles on purpose: closing would flush (and fail) again */
        if (d->ds)
            for (size_t i = 0; i < (size_t)d->n_range * KVQ_DUMP_N_DS; i++) d->ds[i] = H5I_INVALID_HID;
        d->tokens = d->f16_mem = d->file = d->crcs = H5I_INVALID_HID;
        return 0;
    }
    if (d->ds)
        for (size_t i = 0; i < (size_t)d->n_range * KVQ_DUMP_N_DS; i++) close_id(&d->ds[i]);
    close_id(&d->tokens);
    close_id(&d->crcs);
    close_id(&d->f16_mem);
    if (d->file >= 0) {
        rc = H5Fclose(d->file);
        d->file = H5I_INVALID_HID;
    }
    return rc;
}

static void dump_free(h5_dump *d)
{
    free(d->ds);
    free(d->offsets);
    free(d->scratch);
    d->ds = NULL;
    d->offsets = NULL;
    d->scratch = NULL;
}

/* Copy meta into d (deep-copying sample_offsets) and size the handle table. */
static kvq_status dump_set_meta(h5_dump *d, const kvq_dump_meta *m, kvq_err *err)
{
    d->meta = *m;
    size_t nb;
    if (kvq_mul_size((size_t)m->n_samples, sizeof(int64_t), &nb) || !(d->offsets = malloc(nb)))
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %" PRId64 " sample offsets", d->path, m->n_samples);
    memcpy(d->offsets, m->sample_offsets, nb);
    d->meta.sample_offsets = d->offsets;
    d->n_range = m->layer_last - m->layer_first + 1;
    if (!(d->ds = malloc((size_t)d->n_range * KVQ_DUMP_N_DS * sizeof(hid_t))))
        return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", d->path);
    for (size_t i = 0; i < (size_t)d->n_range * KVQ_DUMP_N_DS; i++) d->ds[i] = H5I_INVALID_HID;
    size_t mx = 0;
    for (int s = 0; s < KVQ_DUMP_N_DS; s++) {
        size_t e = kvq_dump_ds_sample_elems(m, (kvq_dump_ds)s);
        if (e > mx) mx = e;
    }
    if (!(d->scratch = malloc(mx * sizeof(uint16_t))))
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate a %zu-element conversion buffer", d->path, mx);
    d->scratch_n = mx;
    if ((d->f16_mem = make_f16_type(H5Tget_order(H5T_NATIVE_FLOAT))) < 0)
        return h5_fail(err, KVQ_EIO, "%s: cannot build the f16 datatype", d->path);
    return KVQ_OK;
}

/* ---- attributes: write ------------------------------------------------------ */

static kvq_status put_attr(hid_t loc, const char *fname, const char *name, hid_t ftype, hid_t mtype, hid_t space,
                           const void *buf, kvq_err *err)
{
    if (H5Aexists(loc, name) > 0 && H5Adelete(loc, name) < 0)
        return h5_fail(err, KVQ_EIO, "%s: cannot replace attribute '%s'", fname, name);
    hid_t a = H5Acreate2(loc, name, ftype, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0) return h5_fail(err, KVQ_EIO, "%s: cannot create attribute '%s'", fname, name);
    h5_errtext et = {{0}, {0}};
    herr_t rc = H5Awrite(a, mtype, buf);
    if (rc < 0) h5_capture(&et);
    H5Aclose(a);
    if (rc < 0) return h5_fail_at(err, KVQ_EIO, &et, "%s: cannot write attribute '%s'", fname, name);
    return KVQ_OK;
}

static hid_t vlen_str_type(void)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    if (t >= 0 && (H5Tset_size(t, H5T_VARIABLE) < 0 || H5Tset_cset(t, H5T_CSET_UTF8) < 0)) {
        H5Tclose(t);
        return H5I_INVALID_HID;
    }
    return t;
}

static kvq_status put_i64(hid_t loc, const char *fname, const char *name, int64_t v, kvq_err *err)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    if (sp < 0) return h5_fail(err, KVQ_EIO, "%s: H5Screate failed", fname);
    kvq_status s = put_attr(loc, fname, name, H5T_STD_I64LE, H5T_NATIVE_INT64, sp, &v, err);
    H5Sclose(sp);
    return s;
}

static kvq_status write_root_attrs(h5_dump *d, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    hid_t sp = H5Screate(H5S_SCALAR), st = vlen_str_type();
    kvq_status s = KVQ_OK;
    if (sp < 0 || st < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: cannot build attribute types", d->fname);
        goto out;
    }
    if ((s = put_i64(d->file, d->fname, "schema_version", KVQ_DUMP_SCHEMA_VERSION, err))) goto out;
    for (size_t i = 0; i < N_ATTRS && !s; i++) {
        const attr_desc *a = &ATTRS[i];
        if (a->kind == AK_STR || a->kind == AK_DTYPE) {
            const char *p = a->kind == AK_STR ? (const char *)m + a->off : dtype_name(m->dtype);
            s = put_attr(d->file, d->fname, a->name, st, st, sp, &p, err);
        } else if (a->kind == AK_F64) {
            double v;
            memcpy(&v, (const char *)m + a->off, sizeof v);
            s = put_attr(d->file, d->fname, a->name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, sp, &v, err);
        } else {
            s = put_i64(d->file, d->fname, a->name, attr_get_int(m, a), err);
        }
    }
    if (s) goto out;
    hsize_t n = (hsize_t)m->n_samples;
    hid_t sp1 = H5Screate_simple(1, &n, NULL);
    if (sp1 < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: H5Screate_simple failed", d->fname);
        goto out;
    }
    s = put_attr(d->file, d->fname, "sample_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, sp1, m->sample_offsets, err);
    H5Sclose(sp1);
    if (!s) s = put_i64(d->file, d->fname, "samples_done", 0, err);
out:
    if (sp >= 0) H5Sclose(sp);
    if (st >= 0) H5Tclose(st);
    return s;
}

/* ---- attributes: read ------------------------------------------------------- */

static kvq_status open_attr(hid_t loc, const char *fname, const char *name, H5T_class_t want, hid_t *a, hid_t *t,
                            hssize_t *npoints, kvq_err *err)
{
    static const char *const cls[] = {"integer", "float", "time", "string", "bitfield", "opaque",
                                      "compound", "reference", "enum", "vlen", "array"};
    htri_t ex = H5Aexists(loc, name);
    if (ex < 0) return h5_fail(err, KVQ_EFORMAT, "%s: cannot query root attribute '%s'", fname, name);
    if (ex == 0) return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s' is missing", fname, name);
    if ((*a = H5Aopen(loc, name, H5P_DEFAULT)) < 0)
        return h5_fail(err, KVQ_EFORMAT, "%s: cannot open root attribute '%s'", fname, name);
    *t = H5Aget_type(*a);
    hid_t sp = H5Aget_space(*a);
    *npoints = sp >= 0 ? H5Sget_simple_extent_npoints(sp) : -1;
    if (sp >= 0) H5Sclose(sp);
    H5T_class_t c = *t >= 0 ? H5Tget_class(*t) : H5T_NO_CLASS;
    if (c != want) {
        const char *found = (c >= 0 && (size_t)c < sizeof cls / sizeof *cls) ? cls[c] : "unknown";
        if (*t >= 0) H5Tclose(*t);
        H5Aclose(*a);
        return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s': expected type %s, found %s", fname, name,
                        cls[want], found);
    }
    return KVQ_OK;
}

/* One numeric root attribute of HDF5 class cls, read as mem_type into *v. */
static kvq_status get_num(hid_t loc, const char *fname, const char *name, H5T_class_t cls, hid_t mem_type, void *v, kvq_err *err)
{
    hid_t a, t;
    hssize_t np;
    KVQ_TRY(open_attr(loc, fname, name, cls, &a, &t, &np, err));
    herr_t rc = np == 1 ? H5Aread(a, mem_type, v) : -1;
    H5Tclose(t);
    H5Aclose(a);
    if (np != 1) return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s': expected 1 value, found %lld", fname, name, (long long)np);
    if (rc < 0) return h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
    return KVQ_OK;
}

static kvq_status get_i64(hid_t loc, const char *fname, const char *name, int64_t *v, kvq_err *err)
{
    return get_num(loc, fname, name, H5T_INTEGER, H5T_NATIVE_INT64, v, err);
}

static kvq_status get_f64(hid_t loc, const char *fname, const char *name, double *v, kvq_err *err)
{
    return get_num(loc, fname, name, H5T_FLOAT, H5T_NATIVE_DOUBLE, v, err);
}

/* String attribute (variable- or fixed-length) into buf[cap]. */
static kvq_status get_str(hid_t loc, const char *fname, const char *name, char *buf, size_t cap, kvq_err *err)
{
    hid_t a, t;
    hssize_t np;
    KVQ_TRY(open_attr(loc, fname, name, H5T_STRING, &a, &t, &np, err));
    kvq_status s = KVQ_OK;
    if (np != 1) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s': expected 1 string, found %lld", fname, name, (long long)np);
    } else if (H5Tis_variable_str(t) > 0) {
        hid_t mt = vlen_str_type();
        char *p = NULL;
        if (mt < 0 || H5Aread(a, mt, &p) < 0) {
            s = h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
        } else {
            size_t n = p ? strlen(p) : 0;
            if (n >= cap)
                s = kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s': %zu bytes, at most %zu expected", fname, name, n, cap - 1);
            else
                memcpy(buf, p ? p : "", n + 1);
            H5free_memory(p);
        }
        if (mt >= 0) H5Tclose(mt);
    } else {
        size_t n = H5Tget_size(t);
        if (n >= cap) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s': %zu bytes, at most %zu expected", fname, name, n, cap - 1);
        } else {
            hid_t mt = H5Tcopy(t);
            memset(buf, 0, cap);
            if (mt < 0 || H5Aread(a, mt, buf) < 0) s = h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
            if (mt >= 0) H5Tclose(mt);
            buf[n] = 0;
        }
    }
    H5Tclose(t);
    H5Aclose(a);
    return s;
}

/* Read the root attributes of an open file into d->meta (+ d->offsets, d->samples_done). */
static kvq_status read_root_attrs(h5_dump *d, kvq_err *err)
{
    int64_t v;
    hid_t f = d->file;
    htri_t ex = H5Aexists(f, "schema_version");
    if (ex <= 0)
        return kvq_fail(err, KVQ_EFORMAT, "%s: not a kvq dump (no root attribute 'schema_version')", d->fname);
    KVQ_TRY(get_i64(f, d->fname, "schema_version", &v, err));
    if (v != KVQ_DUMP_SCHEMA_VERSION)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: dump schema_version %" PRId64 ", this kvq reads version %d only (see formats/DUMP.md)",
                        d->fname, v, KVQ_DUMP_SCHEMA_VERSION);
    kvq_dump_meta *m = &d->meta;
    memset(m, 0, sizeof *m);
    m->schema_version = (int)v;
    for (size_t i = 0; i < N_ATTRS; i++) {
        const attr_desc *a = &ATTRS[i];
        char *p = (char *)m + a->off;
        if (a->kind == AK_STR) {
            const char *def = optional_attr_default(a->name);
            if (def && H5Aexists(f, a->name) <= 0) {
                snprintf(p, a->size, "%s", def);
                continue;
            }
            KVQ_TRY(get_str(f, d->fname, a->name, p, a->size, err));
        } else if (a->kind == AK_DTYPE) {
            char s[16];
            KVQ_TRY(get_str(f, d->fname, a->name, s, sizeof s, err));
            if (strcmp(s, "f16") && strcmp(s, "f32"))
                return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute 'dtype': expected \"f16\" or \"f32\", found \"%s\"", d->fname, s);
            m->dtype = strcmp(s, "f16") == 0 ? KVQ_DUMP_F16 : KVQ_DUMP_F32;
        } else if (a->kind == AK_F64) {
            double x;
            KVQ_TRY(get_f64(f, d->fname, a->name, &x, err));
            memcpy(p, &x, sizeof x);
        } else {
            KVQ_TRY(get_i64(f, d->fname, a->name, &v, err));
            if (a->kind == AK_INT && (v < INT32_MIN || v > INT32_MAX))
                return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s' = %" PRId64 " is out of range", d->fname, a->name, v);
            attr_set_int(m, a, v);
        }
    }
    /* sample_offsets: set to a placeholder so validation passes, then read */
    int64_t dummy = 0;
    m->sample_offsets = &dummy;
    kvq_status s = kvq_dump_meta_validate(m, err);
    m->sample_offsets = NULL;
    if (s) return kvq_err_prefix(err, "%s", d->fname);
    hid_t a, t;
    hssize_t np;
    KVQ_TRY(open_attr(f, d->fname, "sample_offsets", H5T_INTEGER, &a, &t, &np, err));
    H5Tclose(t);
    if (np != m->n_samples) {
        H5Aclose(a);
        return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute 'sample_offsets': expected %" PRId64 " values (n_samples), found %lld",
                        d->fname, m->n_samples, (long long)np);
    }
    free(d->offsets);
    if (!(d->offsets = malloc((size_t)m->n_samples * sizeof(int64_t)))) {
        H5Aclose(a);
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %" PRId64 " sample offsets", d->fname, m->n_samples);
    }
    herr_t rc = H5Aread(a, H5T_NATIVE_INT64, d->offsets);
    H5Aclose(a);
    if (rc < 0) return h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute 'sample_offsets'", d->fname);
    m->sample_offsets = d->offsets;
    KVQ_TRY(get_i64(f, d->fname, "samples_done", &v, err));
    if (v < 0 || v > m->n_samples)
        return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute 'samples_done' = %" PRId64 ", expected 0 .. %" PRId64,
                        d->fname, v, m->n_samples);
    d->samples_done = v;
    return KVQ_OK;
}

/* First attribute where `file` and `req` differ (resume check). */
static kvq_status compare_meta(const char *fname, const kvq_dump_meta *file, const kvq_dump_meta *req, kvq_err *err)
{
    for (size_t i = 0; i < N_ATTRS; i++) {
        const attr_desc *a = &ATTRS[i];
        if (!a->compare) continue;
        const char *pf = (const char *)file + a->off, *pr = (const char *)req + a->off;
        const char *what = "%s: cannot resume: root attribute '%s' differs: file has %s, request has %s";
        char vf[96], vr[96];
        switch (a->kind) {
        case AK_STR:
            if (strcmp(pf, pr))
                return kvq_fail(err, KVQ_EMISMATCH, "%s: cannot resume: root attribute '%s' differs: file has \"%.300s\", request has \"%.300s\"",
                                fname, a->name, pf, pr);
            break;
        case AK_DTYPE:
            if (file->dtype != req->dtype)
                return kvq_fail(err, KVQ_EMISMATCH, what, fname, a->name, dtype_name(file->dtype), dtype_name(req->dtype));
            break;
        case AK_F64: {
            double x, y;
            memcpy(&x, pf, sizeof x);
            memcpy(&y, pr, sizeof y);
            if (memcmp(&x, &y, sizeof x) && x != y) {
                snprintf(vf, sizeof vf, "%.17g", x);
                snprintf(vr, sizeof vr, "%.17g", y);
                return kvq_fail(err, KVQ_EMISMATCH, what, fname, a->name, vf, vr);
            }
            break;
        }
        default: {
            int64_t x = attr_get_int(file, a), y = attr_get_int(req, a);
            if (x != y) {
                snprintf(vf, sizeof vf, "%" PRId64, x);
                snprintf(vr, sizeof vr, "%" PRId64, y);
                return kvq_fail(err, KVQ_EMISMATCH, what, fname, a->name, vf, vr);
            }
        }
        }
    }
    for (int64_t i = 0; i < file->n_samples; i++)
        if (file->sample_offsets[i] != req->sample_offsets[i])
            return kvq_fail(err, KVQ_EMISMATCH,
                            "%s: cannot resume: root attribute 'sample_offsets' differs at sample %" PRId64
                            ": file has %" PRId64 ", request has %" PRId64,
                            fname, i, file->sample_offsets[i], req->sample_offsets[i]);
    return KVQ_OK;
}

/* ---- datasets ---------------------------------------------------------------- */

static void chunk_dims(const kvq_dump_meta *m, kvq_dump_ds ds, const hsize_t full[4], int rank, hsize_t chunk[4])
{
    size_t esize = ds_is_f16(m, ds) ? 2 : 4;
    for (int i = 0; i < rank; i++) chunk[i] = full[i];
    chunk[0] = 1;
    if (ds_is_attn(ds)) { /* [1][n_heads][cols] */
        size_t cols = CHUNK_MAX_BYTES / ((size_t)m->n_heads * esize);
        chunk[2] = cols < 1 ? 1 : (cols < full[2] ? cols : full[2]);
    } else { /* [1][rows][heads][head_dim] */
        size_t rows = CHUNK_MAX_BYTES / ((size_t)full[2] * full[3] * esize);
        chunk[1] = rows < 1 ? 1 : (rows < full[1] ? rows : full[1]);
    }
}

static kvq_status create_dataset(h5_dump *d, hid_t loc, const char *name, const char *full_name, hid_t ftype, int rank,
                                 const hsize_t *dims, const hsize_t *chunk, int level, hid_t dapl, hid_t *out, kvq_err *err)
{
    hid_t sp = H5Screate_simple(rank, dims, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    kvq_status s = KVQ_OK;
    if (sp < 0 || dcpl < 0 || H5Pset_chunk(dcpl, rank, chunk) < 0 || H5Pset_obj_track_times(dcpl, 0) < 0 ||
        (level > 0 && (H5Pset_shuffle(dcpl) < 0 || H5Pset_deflate(dcpl, (unsigned)level) < 0))) {
        s = h5_fail(err, KVQ_EIO, "%s: %s: cannot set up chunking/filters", d->fname, full_name);
    } else if ((*out = H5Dcreate2(loc, name, ftype, sp, H5P_DEFAULT, dcpl, dapl)) < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: cannot create dataset %s", d->fname, full_name);
    }
    if (sp >= 0) H5Sclose(sp);
    if (dcpl >= 0) H5Pclose(dcpl);
    return s;
}

static kvq_status create_datasets(h5_dump *d, int level, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    kvq_status s = KVQ_OK;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS), gcpl = H5Pcreate(H5P_GROUP_CREATE), f16 = make_f16_type(H5T_ORDER_LE);
    hid_t layers = H5I_INVALID_HID;
    /* no chunk cache: each whole-chunk write goes through the filters to disk at once */
    if (dapl < 0 || gcpl < 0 || f16 < 0 || H5Pset_chunk_cache(dapl, 0, 0, 1.0) < 0 || H5Pset_obj_track_times(gcpl, 0) < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: cannot set up property lists", d->fname);
        goto out;
    }
    hsize_t tdims[2] = {(hsize_t)m->n_samples, (hsize_t)m->seq_len}, tchunk[2] = {1, (hsize_t)m->seq_len};
    if ((s = create_dataset(d, d->file, "tokens", "/tokens", H5T_STD_I32LE, 2, tdims, tchunk, level, dapl, &d->tokens, err)))
        goto out;
    /* per sample: a CRC-32 of each layer's stored values and of its tokens (checked by --resume) */
    hsize_t cdims[2] = {(hsize_t)m->n_samples, (hsize_t)d->n_range + 1}, cchunk[2] = {1, (hsize_t)d->n_range + 1};
    if ((s = create_dataset(d, d->file, "sample_crc32", "/sample_crc32", H5T_STD_U32LE, 2, cdims, cchunk, 0, dapl, &d->crcs, err)))
        goto out;
    if ((layers = H5Gcreate2(d->file, "layers", H5P_DEFAULT, gcpl, H5P_DEFAULT)) < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: cannot create group /layers", d->fname);
        goto out;
    }
    for (int l = m->layer_first; l <= m->layer_last && !s; l++) {
        char gname[32], full[96];
        snprintf(gname, sizeof gname, "%d", l);
        hid_t g = H5Gcreate2(layers, gname, H5P_DEFAULT, gcpl, H5P_DEFAULT);
        if (g < 0) {
            s = h5_fail(err, KVQ_EIO, "%s: cannot create group /layers/%d", d->fname, l);
            break;
        }
        for (int k = 0; k < KVQ_DUMP_N_DS && !s; k++) {
            kvq_dump_ds ds = (kvq_dump_ds)k;
            if (!kvq_dump_ds_enabled(m, ds)) continue;
            hsize_t full_dims[4], chunk[4];
            int rank = ds_full_dims(m, ds, full_dims);
            chunk_dims(m, ds, full_dims, rank, chunk);
            snprintf(full, sizeof full, "/layers/%d/%s", l, DS_NAMES[k]);
            s = create_dataset(d, g, DS_NAMES[k], full, ds_is_f16(m, ds) ? f16 : H5T_IEEE_F32LE, rank, full_dims, chunk,
                               level, dapl, ds_slot(d, l, ds), err);
        }
        H5Gclose(g);
    }
out:
    if (layers >= 0) H5Gclose(layers);
    if (dapl >= 0) H5Pclose(dapl);
    if (gcpl >= 0) H5Pclose(gcpl);
    if (f16 >= 0) H5Tclose(f16);
    return s;
}

/* Open one dataset and check its type and shape. */
static kvq_status open_checked(h5_dump *d, const char *full, H5T_class_t cls, size_t esize, bool f16, int rank,
                               const hsize_t *dims, hid_t dapl, hid_t *out, kvq_err *err)
{
    htri_t ex = H5Lexists(d->file, full, H5P_DEFAULT);
    if (ex <= 0) return kvq_fail(err, KVQ_EFORMAT, "%s: dataset %s is missing (the root attributes say it is present)", d->fname, full);
    hid_t ds = H5Dopen2(d->file, full, dapl);
    if (ds < 0) return h5_fail(err, KVQ_EFORMAT, "%s: cannot open dataset %s", d->fname, full);
    hid_t t = H5Dget_type(ds), sp = H5Dget_space(ds);
    hsize_t got[8] = {0};
    int r = sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1;
    if (r > 0 && r <= 8) H5Sget_simple_extent_dims(sp, got, NULL);
    bool type_ok = t >= 0 && H5Tget_class(t) == cls && H5Tget_size(t) == esize && (!f16 || type_is_f16(t));
    kvq_status s = KVQ_OK;
    if (!type_ok) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: dataset %s: expected %s, found class %d of %zu bytes", d->fname, full,
                     cls == H5T_INTEGER ? "int32" : f16 ? "IEEE binary16 (f16)" : "float32", t >= 0 ? (int)H5Tget_class(t) : -1,
                     t >= 0 ? H5Tget_size(t) : 0);
    } else if (r != rank || memcmp(got, dims, (size_t)rank * sizeof *dims)) {
        char e[128] = "", f[128] = "";
        for (int i = 0; i < rank; i++) snprintf(e + strlen(e), sizeof e - strlen(e), "[%llu]", (unsigned long long)dims[i]);
        for (int i = 0; i < r && i < 8; i++) snprintf(f + strlen(f), sizeof f - strlen(f), "[%llu]", (unsigned long long)got[i]);
        s = kvq_fail(err, KVQ_EFORMAT, "%s: dataset %s: expected shape %s, found %s", d->fname, full, e, r > 0 ? f : "(scalar/none)");
    }
    if (t >= 0) H5Tclose(t);
    if (sp >= 0) H5Sclose(sp);
    if (s) H5Dclose(ds);
    else *out = ds;
    return s;
}

static kvq_status open_datasets(h5_dump *d, size_t cache_bytes, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl < 0 || H5Pset_chunk_cache(dapl, cache_bytes ? 521 : 0, cache_bytes, 0.75) < 0) {
        if (dapl >= 0) H5Pclose(dapl);
        return h5_fail(err, KVQ_EIO, "%s: cannot set up dataset access", d->fname);
    }
    hsize_t tdims[2] = {(hsize_t)m->n_samples, (hsize_t)m->seq_len};
    kvq_status s = open_checked(d, "/tokens", H5T_INTEGER, 4, false, 2, tdims, dapl, &d->tokens, err);
    if (!s && H5Lexists(d->file, "/sample_crc32", H5P_DEFAULT) > 0) { /* (dumps from before it have none) */
        hsize_t cdims[2] = {(hsize_t)m->n_samples, (hsize_t)d->n_range + 1};
        s = open_checked(d, "/sample_crc32", H5T_INTEGER, 4, false, 2, cdims, dapl, &d->crcs, err);
    }
    for (int l = m->layer_first; l <= m->layer_last && !s; l++)
        for (int k = 0; k < KVQ_DUMP_N_DS && !s; k++) {
            kvq_dump_ds ds = (kvq_dump_ds)k;
            if (!kvq_dump_ds_enabled(m, ds)) continue;
            char full[96];
            snprintf(full, sizeof full, "/layers/%d/%s", l, DS_NAMES[k]);
            hsize_t dims[4];
            int rank = ds_full_dims(m, ds, dims);
            bool f16 = ds_is_f16(m, ds);
            s = open_checked(d, full, H5T_FLOAT, f16 ? 2 : 4, f16, rank, dims, dapl, ds_slot(d, l, ds), err);
        }
    H5Pclose(dapl);
    return s;
}

static hid_t make_fapl(void)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0) return fapl;
    /* v1.8+ object headers (large attributes go to dense storage), v1.10 chunk indexes;
     * STRONG close: H5Fclose closes every object still open in the file */
    if (H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST) < 0 ||
        H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) < 0) {
        H5Pclose(fapl);
        return H5I_INVALID_HID;
    }
    return fapl;
}

/* ---- writer ------------------------------------------------------------------- */

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

static bool file_exists(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

static bool is_dir(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Whether another writer holds the file's lock (HDF5's own, or hold_lock's when HDF5's file locking is
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

static bool locked_by_another(const char *fname)
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
            s = kvq_fail(err, KVQ_EIO, "%s: not replaced: %s", fname, IN_USE);
        else
            s = kvq_fail(err, KVQ_EIO, "%s: cannot lock it to replace it: %s", fname, strerror(errno));
    } else if (unlink(fname) != 0 && errno != ENOENT) {
        s = kvq_fail(err, KVQ_EIO, "%s: cannot remove it to replace it: %s", fname, strerror(errno));
    }
    close(fd); /* (releases the lock) */
    return s;
}

/* Lay out the chunks of one layer's datasets and their buffers (deflate > 0).
 * Chunk geometry is chunk_dims(), as in create_datasets(). */
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
            int rank = ds_full_dims(m, ds, full);
            chunk_dims(m, ds, full, rank, chunk);
            int ax = ds_is_attn(ds) ? 2 : 1; /* the split axis */
            size_t elems = 1, esize = ds_is_f16(m, ds) ? 2 : 4;
            for (int i = 1; i < rank; i++) elems *= (size_t)chunk[i]; /* <= 1 MiB / esize (chunk_dims) */
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

static kvq_status writer_alloc(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
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
    dump_init(&w->d);
    w->opts = o;
    w->lock_fd = -1;
    snprintf(w->d.path, sizeof w->d.path, "%s", path);
    snprintf(w->d.fname, sizeof w->d.fname, "%s.partial", path);
    kvq_status s = dump_set_meta(&w->d, meta, err);
    if (!s && !(w->layer_done = calloc((size_t)w->d.n_range, 1))) s = kvq_fail(err, KVQ_ENOMEM, "dump: out of memory");
    if (!s && !(w->crc = calloc((size_t)w->d.n_range + 1, sizeof *w->crc))) s = kvq_fail(err, KVQ_ENOMEM, "dump: out of memory");
    if (s) {
        dump_close_file(&w->d);
        dump_free(&w->d);
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
 * that another kvdump's --force or --resume refuses it (locked_by_another). HDF5 (1.10+) holds an
 * exclusive flock() on its own descriptor unless its file locking is off (HDF5_USE_FILE_LOCKING=FALSE,
 * common on cluster file systems); then our lock on a second descriptor fails, and we close it. With
 * HDF5's locking off ours succeeds and is held until the writer is freed. Best effort: a file system
 * without flock() gets neither. */
static void hold_lock(kvq_dump_writer *w) { w->lock_fd = try_lock(w->d.fname); }

static void writer_free(kvq_dump_writer *w)
{
    dump_close_file(&w->d);
    if (w->lock_fd >= 0) close(w->lock_fd); /* (after HDF5's close: releases our lock) */
    dump_free(&w->d);
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
static kvq_status writer_filters(kvq_dump_writer *w, kvq_err *err)
{
    size_t n = (size_t)w->d.n_range * KVQ_DUMP_N_DS;
    bool any = false;
    if (!(w->zlevel = malloc(n))) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", w->d.fname);
    for (size_t i = 0; i < n; i++) {
        w->zlevel[i] = -1;
        hid_t id = w->d.ds[i];
        if (id < 0) continue;
        hid_t dcpl = H5Dget_create_plist(id);
        if (dcpl < 0) return h5_fail(err, KVQ_EIO, "%s: cannot read a dataset's creation properties", w->d.fname);
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
    quiet_begin(&q);
    kvq_dump_writer *w = NULL;
    kvq_status s = writer_alloc(path, meta, opts, &w, err);
    if (s) goto done;
    if (!w->opts.force && file_exists(path)) {
        s = kvq_fail(err, KVQ_EIO, "%s: already exists (use --force to replace it)", path);
    } else if (is_dir(w->d.fname)) { /* (it read "an unfinished dump is there (use --resume ...)") */
        s = kvq_fail(err, KVQ_EIO, "%s: is a directory, not an unfinished dump; move it away first", w->d.fname);
    } else if (!w->opts.force && file_exists(w->d.fname)) {
        if (locked_by_another(w->d.fname)) s = kvq_fail(err, KVQ_EIO, "%s: an unfinished dump is there, %s", w->d.fname, IN_USE);
        else s = kvq_fail(err, KVQ_EIO, "%s: an unfinished dump is there (use --resume to continue it or --force to start over)", w->d.fname);
    } else if (w->opts.force && (s = remove_stale_partial(w->d.fname, err)) != KVQ_OK) {
        /* (the error is set; nothing was touched) */
    } else {
        hid_t fapl = make_fapl();
        if (fapl < 0) {
            s = h5_fail(err, KVQ_EIO, "%s: cannot set up file access", w->d.fname);
        } else {
            /* no object timestamps (root group included): same inputs, same bytes */
            hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
            if (fcpl < 0 || H5Pset_obj_track_times(fcpl, 0) < 0) {
                s = h5_fail(err, KVQ_EIO, "%s: cannot set up file creation", w->d.fname);
            } else {
                w->d.file = H5Fcreate(w->d.fname, H5F_ACC_EXCL, fcpl, fapl); /* (a stale partial was removed above) */
                if (w->d.file < 0) s = h5_fail(err, KVQ_EIO, "%s: cannot create", w->d.fname);
                else hold_lock(w);
            }
            if (fcpl >= 0) H5Pclose(fcpl);
            H5Pclose(fapl);
        }
        if (!s) s = write_root_attrs(&w->d, err);
        if (!s) s = create_datasets(&w->d, w->opts.deflate_level, err);
        if (!s) s = writer_filters(w, err);
        if (!s && H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) s = h5_fail(err, KVQ_EIO, "%s: flush failed", w->d.fname);
        if (s && w->d.file >= 0) { /* nothing worth keeping: remove the half-made file (unclosed, see quiet_begin) */
            w->d.broken = true;
            dump_close_file(&w->d);
            unlink(w->d.fname);
        }
    }
    if (s) {
        writer_free(w);
        w = NULL;
    }
done:
    *out = w;
    quiet_end(&q);
    return s;
}

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
            if (rc < 0) s = h5_fail(err, KVQ_EFORMAT, "%s: sample %" PRId64 ": its checksums cannot be read: %s", d->fname, smp, again);
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
                    rank = ds_full_dims(m, ds, full);
                    n = kvq_dump_ds_sample_elems(m, ds);
                    esize = ds_is_f16(m, ds) ? 2 : 4;
                    mt = esize == 2 ? make_f16_type(H5T_ORDER_LE) : H5Tcopy(H5T_IEEE_F32LE);
                    what = DS_NAMES[k];
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
                    s = h5_fail(err, KVQ_EFORMAT, "%s: sample %" PRId64 ", %s%s: cannot be read back: %s", d->fname, smp, where, what,
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
    quiet_begin(&q);
    kvq_dump_writer *w = NULL;
    h5_dump f; /* what the file holds */
    dump_init(&f);
    kvq_status s = writer_alloc(path, meta, opts, &w, err);
    if (s) goto done;
    snprintf(f.fname, sizeof f.fname, "%s", w->d.fname);
    if (!w->opts.force && file_exists(path)) {
        s = kvq_fail(err, KVQ_EIO, "%s: already exists (use --force to replace it)", path);
        goto done;
    }
    if (!file_exists(w->d.fname)) {
        s = kvq_fail(err, KVQ_EIO, "%s: no unfinished dump to resume", w->d.fname);
        goto done;
    }
    if ((s = kvq_check_regular(w->d.fname, "an unfinished kvdump dump (HDF5)", err))) goto done;
    if (locked_by_another(w->d.fname)) { /* (before our own open, whose lock would answer the probe) */
        s = kvq_fail(err, KVQ_EIO, "%s: cannot open for resuming: %s", w->d.fname, IN_USE);
        goto done;
    }
    hid_t fapl = make_fapl();
    if (fapl >= 0) {
        w->d.file = H5Fopen(w->d.fname, H5F_ACC_RDWR, fapl);
        if (w->d.file < 0) s = h5_fail(err, KVQ_EIO, "%s: cannot open for resuming", w->d.fname);
        else hold_lock(w);
        H5Pclose(fapl);
    } else {
        s = h5_fail(err, KVQ_EIO, "%s: cannot set up file access", w->d.fname);
    }
    if (s) goto done;
    f.file = w->d.file;
    if ((s = read_root_attrs(&f, err))) goto done;
    if ((s = compare_meta(w->d.fname, &f.meta, meta, err))) goto done;
    w->d.samples_done = f.samples_done;
    /* command_line and compute_device: record the resuming invocation */
    hid_t st = vlen_str_type(), sp = H5Screate(H5S_SCALAR);
    const char *cl = meta->command_line, *cd = meta->compute_device;
    if (st < 0 || sp < 0) s = h5_fail(err, KVQ_EIO, "%s: cannot build attribute types", w->d.fname);
    else s = put_attr(w->d.file, w->d.fname, "command_line", st, st, sp, &cl, err);
    if (!s) s = put_attr(w->d.file, w->d.fname, "compute_device", st, st, sp, &cd, err);
    if (st >= 0) H5Tclose(st);
    if (sp >= 0) H5Sclose(sp);
    if (s) goto done;
    s = open_datasets(&w->d, 0, err);
    if (!s) s = verify_samples(&w->d, err);
    if (!s) s = writer_filters(w, err);
done:
    f.file = H5I_INVALID_HID; /* owned by w */
    dump_free(&f);
    if (s && w) {
        writer_free(w);
        w = NULL;
    }
    *out = w;
    quiet_end(&q);
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
    int rank = ds_full_dims(m, ds, full);
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
    if (rc < 0) h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0) {
        w->d.broken = true;
        return h5_fail_at(err, KVQ_EIO, &et, "%s: writing /layers/%d/%s sample %" PRId64 " failed", w->d.fname, layer,
                          DS_NAMES[ds], sample);
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
                            DS_NAMES[jobs[j].ds], sample, jobs[j].zrc);
    for (long j = 0; j < n; j++) {
        chunk_job *jb = &jobs[j];
        if (zlevel[jb->ds] < 0) continue;
        jb->offset[0] = (hsize_t)sample;
        if (H5Dwrite_chunk(*ds_slot(&w->d, layer, jb->ds), H5P_DEFAULT, 0, jb->offset, jb->zlen, jb->zbuf) < 0) {
            w->d.broken = true;
            return h5_fail(err, KVQ_EIO, "%s: writing /layers/%d/%s sample %" PRId64 " failed", w->d.fname, layer,
                           DS_NAMES[jb->ds], sample);
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
            return kvq_fail(err, KVQ_EINVAL, "%s: layer %d: no data for %s, which the dump records", w->d.fname, layer, DS_NAMES[k]);
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
    quiet_begin(&q);
    kvq_status s = write_layer_impl(w, sample, layer, d, err);
    quiet_end(&q);
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
    if (rc < 0) h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0) w->d.broken = true;
    if (rc < 0) return h5_fail_at(err, KVQ_EIO, &et, "%s: writing /tokens sample %" PRId64 " failed", w->d.fname, sample);
    if (w->d.crcs >= 0) { /* the sample's checksums, before the counter that declares it complete */
        w->crc[w->d.n_range] = tokens_crc(tokens, m->seq_len);
        hsize_t cs[2] = {(hsize_t)sample, 0}, cc[2] = {1, (hsize_t)w->d.n_range + 1};
        hid_t cfs = H5Dget_space(w->d.crcs), cms = H5Screate_simple(2, cc, NULL);
        rc = -1;
        if (cfs >= 0 && cms >= 0 && H5Sselect_hyperslab(cfs, H5S_SELECT_SET, cs, NULL, cc, NULL) >= 0)
            rc = H5Dwrite(w->d.crcs, H5T_NATIVE_UINT32, cms, cfs, H5P_DEFAULT, w->crc);
        if (rc < 0) h5_capture(&et);
        if (cfs >= 0) H5Sclose(cfs);
        if (cms >= 0) H5Sclose(cms);
        if (rc < 0) {
            w->d.broken = true;
            return h5_fail_at(err, KVQ_EIO, &et, "%s: writing /sample_crc32 sample %" PRId64 " failed", w->d.fname, sample);
        }
    }
    /* data first, then the counter that declares it complete */
    if (H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        w->d.broken = true;
        return h5_fail(err, KVQ_EIO, "%s: flushing sample %" PRId64 " failed", w->d.fname, sample);
    }
    hid_t a = H5Aopen(w->d.file, "samples_done", H5P_DEFAULT);
    int64_t done = sample + 1;
    rc = a >= 0 ? H5Awrite(a, H5T_NATIVE_INT64, &done) : -1;
    if (rc < 0) h5_capture(&et);
    if (a >= 0) H5Aclose(a);
    if (rc >= 0 && H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        rc = -1;
        h5_capture(&et);
    }
    if (rc < 0) w->d.broken = true;
    if (rc < 0)
        return h5_fail_at(err, KVQ_EIO, &et, "%s: recording sample %" PRId64 " as complete failed", w->d.fname, sample);
    w->d.samples_done = done;
    memset(w->layer_done, 0, (size_t)w->d.n_range);
    return KVQ_OK;
}

kvq_status kvq_dump_commit_sample(kvq_dump_writer *w, int64_t sample, const int32_t *tokens, kvq_err *err)
{
    if (!w) return kvq_fail(err, KVQ_EINVAL, "dump: NULL writer");
    h5_quiet q;
    quiet_begin(&q);
    kvq_status s = commit_impl(w, sample, tokens, err);
    quiet_end(&q);
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
        dump_close_file(d);
        return KVQ_EINVAL;
    }
    if (dump_close_file(d) < 0) return h5_fail(err, KVQ_EIO, "%s: closing failed", d->fname);
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
    quiet_begin(&q);
    kvq_status s = finish_impl(w, err);
    writer_free(w);
    quiet_end(&q);
    return s;
}

kvq_status kvq_dump_abort(kvq_dump_writer *w, kvq_err *err)
{
    if (!w) return KVQ_OK;
    h5_quiet q;
    quiet_begin(&q);
    kvq_status s = KVQ_OK;
    if (dump_close_file(&w->d) < 0)
        s = h5_fail(err, KVQ_EIO, "%s: closing after an interruption failed (the last sample may be lost; %" PRId64 " were committed)",
                    w->d.fname, w->d.samples_done);
    writer_free(w);
    quiet_end(&q);
    return s;
}

/* ---- reader --------------------------------------------------------------------- */

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
    quiet_begin(&q);
    kvq_status s = KVQ_OK;
    hid_t sp = -1, ds = -1;
    htri_t ex = H5Lexists(w->d.file, "k_bias", H5P_DEFAULT);
    if (ex > 0) ds = H5Dopen2(w->d.file, "k_bias", H5P_DEFAULT); /* resume: the same model, so the same values */
    else if ((sp = H5Screate_simple(2, dims, NULL)) >= 0)
        ds = H5Dcreate2(w->d.file, "k_bias", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (ds < 0 || H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, bias) < 0 || H5Fflush(w->d.file, H5F_SCOPE_LOCAL) < 0) {
        s = h5_fail(err, KVQ_EIO, "%s: writing /k_bias failed", w->d.fname);
        w->d.broken = true;
    }
    if (ds >= 0 && !w->d.broken) H5Dclose(ds);
    if (sp >= 0) H5Sclose(sp);
    quiet_end(&q);
    return s;
}

struct kvq_dump_reader {
    h5_dump d;
};

kvq_status kvq_dump_open(const char *path, kvq_dump_reader **out, kvq_err *err)
{
    *out = NULL;
    if (!path) return kvq_fail(err, KVQ_EINVAL, "dump: NULL path");
    if (strlen(path) >= KVQ_DUMP_PATH_MAX) return kvq_fail(err, KVQ_EINVAL, "dump: path longer than %d bytes", KVQ_DUMP_PATH_MAX - 1);
    h5_quiet q;
    quiet_begin(&q);
    kvq_status s = KVQ_OK;
    kvq_dump_reader *r = calloc(1, sizeof *r);
    if (!r) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    dump_init(&r->d);
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
    hid_t fapl = make_fapl();
    if (fapl >= 0) {
        r->d.file = H5Fopen(path, H5F_ACC_RDONLY, fapl);
        if (r->d.file < 0) s = h5_fail(err, KVQ_EIO, "%s: cannot open", path);
        H5Pclose(fapl);
    } else {
        s = h5_fail(err, KVQ_EIO, "%s: cannot set up file access", path);
    }
    if (s) goto done;
    if ((s = read_root_attrs(&r->d, err))) goto done;
    /* dump_set_meta deep-copies the offsets: hand it the file's copy, then drop ours */
    int64_t *tmp = r->d.offsets;
    kvq_dump_meta m = r->d.meta;
    r->d.offsets = NULL;
    s = dump_set_meta(&r->d, &m, err);
    free(tmp);
    if (!s) s = open_datasets(&r->d, READ_CACHE_BYTES, err);
done:
    if (s && r) {
        dump_close_file(&r->d);
        dump_free(&r->d);
        free(r);
        r = NULL;
    }
    *out = r;
    quiet_end(&q);
    return s;
}

kvq_status kvq_dump_read_k_bias(kvq_dump_reader *r, float *out, bool *present, kvq_err *err)
{
    const kvq_dump_meta *m = &r->d.meta;
    *present = false;
    h5_quiet q;
    quiet_begin(&q);
    kvq_status s = KVQ_OK;
    if (H5Lexists(r->d.file, "k_bias", H5P_DEFAULT) <= 0) goto done;
    hid_t ds = H5Dopen2(r->d.file, "k_bias", H5P_DEFAULT), sp = ds >= 0 ? H5Dget_space(ds) : -1, ty = ds >= 0 ? H5Dget_type(ds) : -1;
    hsize_t dims[2] = {0, 0};
    const hsize_t want0 = (hsize_t)(m->layer_last - m->layer_first + 1), want1 = (hsize_t)m->n_kv_heads * (hsize_t)m->head_dim;
    if (ds < 0 || sp < 0 || ty < 0) s = h5_fail(err, KVQ_EIO, "%s: cannot open /k_bias", r->d.fname);
    else if (H5Sget_simple_extent_ndims(sp) != 2 || H5Sget_simple_extent_dims(sp, dims, NULL) != 2 || dims[0] != want0 ||
             dims[1] != want1 || H5Tget_class(ty) != H5T_FLOAT)
        s = kvq_fail(err, KVQ_EFORMAT, "%s: /k_bias: expected float [%llu][%llu] (layers x kv_dim), found %d dims [%llu][%llu]", r->d.fname,
                     (unsigned long long)want0, (unsigned long long)want1, sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1,
                     (unsigned long long)dims[0], (unsigned long long)dims[1]);
    else if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
        s = h5_fail(err, KVQ_EIO, "%s: reading /k_bias failed", r->d.fname);
    else
        *present = true;
    if (ty >= 0) H5Tclose(ty);
    if (sp >= 0) H5Sclose(sp);
    if (ds >= 0) H5Dclose(ds);
done:
    quiet_end(&q);
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
                        d->fname, layer, DS_NAMES[ds], sample, d->samples_done);
    if (t0 < 0 || n < 1 || t0 > m->seq_len || n > m->seq_len - t0)
        return kvq_fail(err, KVQ_EINVAL, "%s: /layers/%d/%s: positions [%" PRId64 ", %" PRId64 ") requested, seq_len is %" PRId64,
                        d->fname, layer, DS_NAMES[ds], t0, t0 + n, m->seq_len);
    if (!out) return kvq_fail(err, KVQ_EINVAL, "%s: NULL output buffer", d->fname);
    hid_t id = *ds_slot(d, layer, ds);
    hsize_t full[4], start[4] = {0}, count[4];
    int rank = ds_full_dims(m, ds, full);
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
    if (rc < 0) h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    if (rc < 0)
        return h5_fail_at(err, KVQ_EIO, &et, "%s: reading /layers/%d/%s sample %" PRId64 " positions [%" PRId64 ", %" PRId64 ") failed",
                       d->fname, layer, DS_NAMES[ds], sample, t0, t0 + n);
    if (f16)
        for (size_t i = 0; i < elems; i++) out[i] = kvq_f16_to_f32(d->scratch[i]);
    return KVQ_OK;
}

kvq_status kvq_dump_read_rows(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, int64_t t0, int64_t n,
                              float *out, kvq_err *err)
{
    if (!r) return kvq_fail(err, KVQ_EINVAL, "dump: NULL reader");
    h5_quiet q;
    quiet_begin(&q);
    kvq_status s = read_rows_impl(r, layer, ds, sample, t0, n, out, err);
    quiet_end(&q);
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
    quiet_begin(&q);
    hsize_t start[2] = {(hsize_t)s0, 0}, count[2] = {(hsize_t)n, (hsize_t)d->meta.seq_len};
    hid_t fs = H5Dget_space(d->tokens), ms = H5Screate_simple(2, count, NULL);
    herr_t rc = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        rc = H5Dread(d->tokens, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, out);
    h5_errtext et = {{0}, {0}};
    if (rc < 0) h5_capture(&et);
    if (fs >= 0) H5Sclose(fs);
    if (ms >= 0) H5Sclose(ms);
    kvq_status s = rc < 0 ? h5_fail_at(err, KVQ_EIO, &et, "%s: reading /tokens samples [%" PRId64 ", %" PRId64 ") failed", d->fname, s0, s0 + n)
                          : KVQ_OK;
    quiet_end(&q);
    return s;
}

void kvq_dump_close(kvq_dump_reader *r)
{
    if (!r) return;
    h5_quiet q;
    quiet_begin(&q);
    dump_close_file(&r->d);
    dump_free(&r->d);
    free(r);
    quiet_end(&q);
}
