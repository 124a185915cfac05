/* dump.c — the kvdump HDF5 file (schema: formats/DUMP.md): the dataset table, meta, HDF5 plumbing, root attributes
 * and datasets. The writer is in dump_write.c, --resume in dump_resume.c, the reader in dump_read.c
 * (what they share: dump_internal.h). */
#include "dump_internal.h"
#include "sha256.h"

#include <errno.h>
#include <hdf5.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- f16 codec ------------------------------------------------------------ */

/* ---- dataset table -------------------------------------------------------- */

const char *const kvqi_DS_NAMES[KVQ_DUMP_N_DS] = {
    "k_pre_rope", "k", "v", "q", "fisher_k_pre_rope", "fisher_v", "attn_received", "attn_entropy",
};

const char *kvq_dump_ds_name(kvq_dump_ds ds)
{
    return (unsigned)ds < KVQ_DUMP_N_DS ? kvqi_DS_NAMES[ds] : "?";
}

kvq_status kvq_dump_ds_from_name(const char *name, kvq_dump_ds *out, kvq_err *err)
{
    for (int i = 0; i < KVQ_DUMP_N_DS; i++)
        if (name && strcmp(name, kvqi_DS_NAMES[i]) == 0) {
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

void kvqi_quiet_begin(h5_quiet *q)
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
void kvqi_quiet_end(const h5_quiet *q) { H5Eset_auto2(H5E_DEFAULT, q->func, q->data); }

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
void kvqi_h5_capture(h5_errtext *t)
{
    t->inner[0] = t->os[0] = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk_cb, t);
}

/* HDF5's own lock (1.10+, file locking on): another process has the file open for writing,
 * reported as "errno = 11, error message = 'Resource temporarily unavailable'" */
const char kvqi_IN_USE[] = "in use by another process (it holds the file's lock: a running kvdump?); let that run finish or stop it first";

static kvq_status h5_vfail(kvq_err *err, kvq_status code, const h5_errtext *t, const char *fmt, va_list ap)
{
    char msg[KVQ_ERR_MSG_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    int en = 0;
    if (t->os[0] && sscanf(t->os, "errno = %d", &en) == 1 && en == EWOULDBLOCK) return kvq_fail(err, code, "%s: %s", msg, kvqi_IN_USE);
    if (t->os[0]) return kvq_fail(err, code, "%s (%s)", msg, t->os);
    if (t->inner[0]) return kvq_fail(err, code, "%s (HDF5: %s)", msg, t->inner);
    return kvq_fail(err, code, "%s", msg);
}

/* kvq_fail with a captured HDF5 error line appended. */
__attribute__((format(printf, 4, 5))) kvq_status kvqi_h5_fail_at(kvq_err *err, kvq_status code, const h5_errtext *t,
                                                            const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvq_status s = h5_vfail(err, code, t, fmt, ap);
    va_end(ap);
    return s;
}

/* kvq_fail with the current HDF5 error stack's most useful line appended. */
__attribute__((format(printf, 3, 4))) kvq_status kvqi_h5_fail(kvq_err *err, kvq_status code, const char *fmt, ...)
{
    h5_errtext t;
    kvqi_h5_capture(&t);
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
hid_t kvqi_make_f16_type(H5T_order_t order)
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
int kvqi_ds_full_dims(const kvq_dump_meta *m, kvq_dump_ds ds, hsize_t dims[4])
{
    int rank;
    int64_t d[3];
    kvq_dump_ds_shape(m, ds, &rank, d);
    dims[0] = (hsize_t)m->n_samples;
    for (int i = 0; i < rank; i++) dims[1 + i] = (hsize_t)d[i];
    return rank + 1;
}

void kvqi_dump_init(h5_dump *d)
{
    memset(d, 0, sizeof *d);
    d->file = d->tokens = d->f16_mem = d->crcs = H5I_INVALID_HID;
}

/* Close everything; returns H5Fclose's result (< 0: the final flush failed). */
herr_t kvqi_dump_close_file(h5_dump *d)
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

void kvqi_dump_free(h5_dump *d)
{
    free(d->ds);
    free(d->offsets);
    free(d->scratch);
    d->ds = NULL;
    d->offsets = NULL;
    d->scratch = NULL;
}

/* Copy meta into d (deep-copying sample_offsets) and size the handle table. */
kvq_status kvqi_dump_set_meta(h5_dump *d, const kvq_dump_meta *m, kvq_err *err)
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
    if ((d->f16_mem = kvqi_make_f16_type(H5Tget_order(H5T_NATIVE_FLOAT))) < 0)
        return kvqi_h5_fail(err, KVQ_EIO, "%s: cannot build the f16 datatype", d->path);
    return KVQ_OK;
}

/* ---- attributes: write ------------------------------------------------------ */

kvq_status kvqi_put_attr(hid_t loc, const char *fname, const char *name, hid_t ftype, hid_t mtype, hid_t space,
                    const void *buf, kvq_err *err)
{
    if (H5Aexists(loc, name) > 0 && H5Adelete(loc, name) < 0)
        return kvqi_h5_fail(err, KVQ_EIO, "%s: cannot replace attribute '%s'", fname, name);
    hid_t a = H5Acreate2(loc, name, ftype, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0) return kvqi_h5_fail(err, KVQ_EIO, "%s: cannot create attribute '%s'", fname, name);
    h5_errtext et = {{0}, {0}};
    herr_t rc = H5Awrite(a, mtype, buf);
    if (rc < 0) kvqi_h5_capture(&et);
    H5Aclose(a);
    if (rc < 0) return kvqi_h5_fail_at(err, KVQ_EIO, &et, "%s: cannot write attribute '%s'", fname, name);
    return KVQ_OK;
}

hid_t kvqi_vlen_str_type(void)
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
    if (sp < 0) return kvqi_h5_fail(err, KVQ_EIO, "%s: H5Screate failed", fname);
    kvq_status s = kvqi_put_attr(loc, fname, name, H5T_STD_I64LE, H5T_NATIVE_INT64, sp, &v, err);
    H5Sclose(sp);
    return s;
}

kvq_status kvqi_write_root_attrs(h5_dump *d, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    hid_t sp = H5Screate(H5S_SCALAR), st = kvqi_vlen_str_type();
    kvq_status s = KVQ_OK;
    if (sp < 0 || st < 0) {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot build attribute types", d->fname);
        goto out;
    }
    if ((s = put_i64(d->file, d->fname, "schema_version", KVQ_DUMP_SCHEMA_VERSION, err))) goto out;
    for (size_t i = 0; i < N_ATTRS && !s; i++) {
        const attr_desc *a = &ATTRS[i];
        if (a->kind == AK_STR || a->kind == AK_DTYPE) {
            const char *p = a->kind == AK_STR ? (const char *)m + a->off : dtype_name(m->dtype);
            s = kvqi_put_attr(d->file, d->fname, a->name, st, st, sp, &p, err);
        } else if (a->kind == AK_F64) {
            double v;
            memcpy(&v, (const char *)m + a->off, sizeof v);
            s = kvqi_put_attr(d->file, d->fname, a->name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, sp, &v, err);
        } else {
            s = put_i64(d->file, d->fname, a->name, attr_get_int(m, a), err);
        }
    }
    if (s) goto out;
    hsize_t n = (hsize_t)m->n_samples;
    hid_t sp1 = H5Screate_simple(1, &n, NULL);
    if (sp1 < 0) {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: H5Screate_simple failed", d->fname);
        goto out;
    }
    s = kvqi_put_attr(d->file, d->fname, "sample_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, sp1, m->sample_offsets, err);
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
    if (ex < 0) return kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot query root attribute '%s'", fname, name);
    if (ex == 0) return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute '%s' is missing", fname, name);
    if ((*a = H5Aopen(loc, name, H5P_DEFAULT)) < 0)
        return kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot open root attribute '%s'", fname, name);
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
    if (rc < 0) return kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
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
        hid_t mt = kvqi_vlen_str_type();
        char *p = NULL;
        if (mt < 0 || H5Aread(a, mt, &p) < 0) {
            s = kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
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
            if (mt < 0 || H5Aread(a, mt, buf) < 0) s = kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute '%s'", fname, name);
            if (mt >= 0) H5Tclose(mt);
            buf[n] = 0;
        }
    }
    H5Tclose(t);
    H5Aclose(a);
    return s;
}

/* Read the root attributes of an open file into d->meta (+ d->offsets, d->samples_done). */
kvq_status kvqi_read_root_attrs(h5_dump *d, kvq_err *err)
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
    if (rc < 0) return kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot read root attribute 'sample_offsets'", d->fname);
    m->sample_offsets = d->offsets;
    KVQ_TRY(get_i64(f, d->fname, "samples_done", &v, err));
    if (v < 0 || v > m->n_samples)
        return kvq_fail(err, KVQ_EFORMAT, "%s: root attribute 'samples_done' = %" PRId64 ", expected 0 .. %" PRId64,
                        d->fname, v, m->n_samples);
    d->samples_done = v;
    return KVQ_OK;
}

/* First attribute where `file` and `req` differ (resume check). */
kvq_status kvqi_compare_meta(const char *fname, const kvq_dump_meta *file, const kvq_dump_meta *req, kvq_err *err)
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

void kvqi_chunk_dims(const kvq_dump_meta *m, kvq_dump_ds ds, const hsize_t full[4], int rank, hsize_t chunk[4])
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
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: %s: cannot set up chunking/filters", d->fname, full_name);
    } else if ((*out = H5Dcreate2(loc, name, ftype, sp, H5P_DEFAULT, dcpl, dapl)) < 0) {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot create dataset %s", d->fname, full_name);
    }
    if (sp >= 0) H5Sclose(sp);
    if (dcpl >= 0) H5Pclose(dcpl);
    return s;
}

kvq_status kvqi_create_datasets(h5_dump *d, int level, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    kvq_status s = KVQ_OK;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS), gcpl = H5Pcreate(H5P_GROUP_CREATE), f16 = kvqi_make_f16_type(H5T_ORDER_LE);
    hid_t layers = H5I_INVALID_HID;
    /* no chunk cache: each whole-chunk write goes through the filters to disk at once */
    if (dapl < 0 || gcpl < 0 || f16 < 0 || H5Pset_chunk_cache(dapl, 0, 0, 1.0) < 0 || H5Pset_obj_track_times(gcpl, 0) < 0) {
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up property lists", d->fname);
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
        s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot create group /layers", d->fname);
        goto out;
    }
    for (int l = m->layer_first; l <= m->layer_last && !s; l++) {
        char gname[32], full[96];
        snprintf(gname, sizeof gname, "%d", l);
        hid_t g = H5Gcreate2(layers, gname, H5P_DEFAULT, gcpl, H5P_DEFAULT);
        if (g < 0) {
            s = kvqi_h5_fail(err, KVQ_EIO, "%s: cannot create group /layers/%d", d->fname, l);
            break;
        }
        for (int k = 0; k < KVQ_DUMP_N_DS && !s; k++) {
            kvq_dump_ds ds = (kvq_dump_ds)k;
            if (!kvq_dump_ds_enabled(m, ds)) continue;
            hsize_t full_dims[4], chunk[4];
            int rank = kvqi_ds_full_dims(m, ds, full_dims);
            kvqi_chunk_dims(m, ds, full_dims, rank, chunk);
            snprintf(full, sizeof full, "/layers/%d/%s", l, kvqi_DS_NAMES[k]);
            s = create_dataset(d, g, kvqi_DS_NAMES[k], full, ds_is_f16(m, ds) ? f16 : H5T_IEEE_F32LE, rank, full_dims, chunk,
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
    if (ds < 0) return kvqi_h5_fail(err, KVQ_EFORMAT, "%s: cannot open dataset %s", d->fname, full);
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

kvq_status kvqi_open_datasets(h5_dump *d, size_t cache_bytes, kvq_err *err)
{
    const kvq_dump_meta *m = &d->meta;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl < 0 || H5Pset_chunk_cache(dapl, cache_bytes ? 521 : 0, cache_bytes, 0.75) < 0) {
        if (dapl >= 0) H5Pclose(dapl);
        return kvqi_h5_fail(err, KVQ_EIO, "%s: cannot set up dataset access", d->fname);
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
            snprintf(full, sizeof full, "/layers/%d/%s", l, kvqi_DS_NAMES[k]);
            hsize_t dims[4];
            int rank = kvqi_ds_full_dims(m, ds, dims);
            bool f16 = ds_is_f16(m, ds);
            s = open_checked(d, full, H5T_FLOAT, f16 ? 2 : 4, f16, rank, dims, dapl, ds_slot(d, l, ds), err);
        }
    H5Pclose(dapl);
    return s;
}

hid_t kvqi_make_fapl(void)
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
