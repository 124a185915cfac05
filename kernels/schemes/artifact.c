/* artifact.c — calibration artifact read/write/inspect; see artifact.h and ARTIFACT.md. */
#include "artifact.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "family.h"
#include "quant.h"
#include "safetensors.h"

void kvq_kv_table_free(kvq_kv_table *t)
{
    if (!t) return;
    free(t->levels);
    free(t->channel_lower);
    free(t->channel_upper);
    free(t->obj_lloyd);
    free(t->obj_exact);
    free(t->chosen);
    free(t->fp8_scale);
    for (size_t j = 0; j < t->n_ft && j < KVQ_FAM_TENSORS; j++) free(t->ft[j].data);
    memset(t, 0, sizeof *t);
}

size_t kvq_fam_tensor_len(const kvq_fam_tensor *x)
{
    size_t n = 1;
    for (uint32_t d = 0; d < x->n_dims && d < KVQ_FAM_TENSOR_DIMS; d++) n *= (size_t)x->shape[d];
    return n;
}

const kvq_fam_tensor *kvq_kv_table_get(const kvq_kv_table *t, const char *name)
{
    for (size_t j = 0; t && j < t->n_ft && j < KVQ_FAM_TENSORS; j++)
        if (!strcmp(t->ft[j].name, name)) return &t->ft[j];
    return NULL;
}

static bool fam_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= sizeof(((kvq_fam_tensor *)0)->name)) return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
}

kvq_status kvq_kv_table_add(kvq_kv_table *t, const char *name, uint32_t n_dims, const uint64_t *shape, float **data,
                            kvq_err *err)
{
    if (data) *data = NULL;
    if (!name || !fam_name_ok(name))
        return kvq_fail(err, KVQ_EINVAL, "family table name \"%s\": expected 1..31 characters of [A-Za-z0-9_]", name ? name : "");
    if (kvq_kv_table_get(t, name)) return kvq_fail(err, KVQ_EINVAL, "family table %s: already present", name);
    if (t->n_ft >= KVQ_FAM_TENSORS)
        return kvq_fail(err, KVQ_EINVAL, "family table %s: a table holds at most %d family tables", name, KVQ_FAM_TENSORS);
    if (n_dims < 1 || n_dims > KVQ_FAM_TENSOR_DIMS)
        return kvq_fail(err, KVQ_EINVAL, "family table %s: dimensions: expected 1..%d, found %u", name, KVQ_FAM_TENSOR_DIMS, n_dims);
    size_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (shape[d] == 0 || shape[d] > ((uint64_t)1 << 32) || kvq_mul_size(n, (size_t)shape[d], &n) || n > ((size_t)1 << 32))
            return kvq_fail(err, KVQ_EINVAL, "family table %s: extent %u: expected 1..2^32 elements in all, found %llu", name, d,
                            (unsigned long long)shape[d]);
    }
    kvq_fam_tensor *x = &t->ft[t->n_ft];
    memset(x, 0, sizeof *x);
    x->data = calloc(n, sizeof(float));
    if (!x->data) return kvq_fail(err, KVQ_ENOMEM, "family table %s: cannot allocate %zu floats", name, n);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->n_dims = n_dims;
    for (uint32_t d = 0; d < n_dims; d++) x->shape[d] = shape[d];
    t->n_ft++;
    if (data) *data = x->data;
    return KVQ_OK;
}

void kvq_artifact_free(kvq_artifact *a)
{
    if (!a) return;
    for (size_t i = 0; a->k && i < a->p.n_layers; i++) kvq_kv_table_free(&a->k[i]);
    for (size_t i = 0; a->v && i < a->p.n_layers; i++) kvq_kv_table_free(&a->v[i]);
    free(a->k);
    free(a->v);
    a->k = a->v = NULL;
    if (a->prefix) {
        kvq_artifact_prefix_free(a->prefix);
        free(a->prefix);
        a->prefix = NULL;
    }
}

kvq_status kvq_artifact_prefix_alloc(kvq_artifact_prefix *px, size_t P, size_t n_layers, size_t kv_dim, const char *what,
                                     kvq_err *err)
{
    size_t n;
    if (kvq_mul_size(P * kv_dim, n_layers, &n) || n > ((size_t)1 << 34))
        return kvq_fail(err, KVQ_ENOMEM, "%s: IntactKV prefix of %zu entries is too large", what, P);
    px->P = P;
    px->token_ids = malloc(P * sizeof(int32_t));
    px->positions = malloc(P * sizeof(int32_t));
    px->k = malloc(n * sizeof(float));
    px->k_pre = malloc(n * sizeof(float));
    px->v = malloc(n * sizeof(float));
    if (!px->token_ids || !px->positions || !px->k || !px->k_pre || !px->v)
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the IntactKV prefix (%zu entries)", what, P);
    return KVQ_OK;
}

void kvq_artifact_prefix_free(kvq_artifact_prefix *px)
{
    if (!px) return;
    free(px->token_ids);
    free(px->positions);
    free(px->k);
    free(px->k_pre);
    free(px->v);
    free(px->text);
    free(px->loss_curve);
    memset(px, 0, sizeof *px);
}

/* the method's artifact layout (family.h); methods come from the registry, so never NULL for a valid method */
static const kvq_family_artifact *layout(const kvq_family *m) { return m ? m->artifact : NULL; }
static bool has_levels(const kvq_family *m) { return layout(m) && layout(m)->k_levels; }
static bool has_v_levels(const kvq_family *m) { return layout(m) && layout(m)->v_levels; }
static bool has_k_thresholds(const kvq_family *m) { return layout(m) && layout(m)->k_thresholds; }
static bool has_fp8(const kvq_family *m) { return layout(m) && layout(m)->fp8_scales; }
static const char *mname(const kvq_family *m) { return m ? m->name : "?"; }
/* the family's own tables for side kv under p (NULL-terminated; never NULL) */
static const char *const *fam_tensors(const kvq_artifact_params *p, char kv)
{
    static const char *const none[] = {NULL};
    const kvq_family_artifact *ly = layout(p->method);
    const char *const *l = ly && ly->tensors ? ly->tensors(p, kv) : NULL;
    return l ? l : none;
}
static bool has_fam_tensors(const kvq_artifact_params *p, char kv) { return fam_tensors(p, kv)[0] != NULL; }
static size_t n_fam_params(const kvq_family *m)
{
    size_t n = 0;
    while (layout(m) && layout(m)->params && n < KVQ_ARTIFACT_X && layout(m)->params[n]) n++;
    return n;
}

/* every listed family table present, no other; then the family's own checks */
static kvq_status check_fam_tables(const kvq_artifact_params *p, const kvq_kv_table *t, size_t layer, char kv, kvq_err *err)
{
    const char *const *l = fam_tensors(p, kv);
    size_t n = 0;
    for (; l[n]; n++) {
        const kvq_fam_tensor *x = kvq_kv_table_get(t, l[n]);
        if (!x || !x->data) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s: missing (method %s)", layer, kv, l[n], mname(p->method));
        size_t len = kvq_fam_tensor_len(x);
        for (size_t j = 0; j < len; j++)
            if (!isfinite(x->data[j])) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s[%zu]: not finite", layer, kv, l[n], j);
    }
    if (t->n_ft != n)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c: %zu family tables, method %s stores %zu", layer, kv, t->n_ft,
                        mname(p->method), n);
    const kvq_family_artifact *ly = layout(p->method);
    if (n && ly->check_tensors) KVQ_TRY(ly->check_tensors(p, layer, kv, t, err));
    return KVQ_OK;
}

static kvq_status check_fp8_table(const kvq_artifact_params *p, const kvq_kv_table *t, size_t layer, char kv,
                                  kvq_err *err)
{
    size_t want = p->per_head ? p->n_kv_heads : 1;
    if (!t->fp8_scale) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.fp8_scale: missing", layer, kv);
    if (t->n_fp8_scales != want)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.fp8_scale: %zu scales, expected %zu (%s)", layer, kv,
                        t->n_fp8_scales, want, p->per_head ? "per KV head" : "per tensor");
    for (size_t h = 0; h < want; h++)
        if (!isfinite(t->fp8_scale[h]) || !(t->fp8_scale[h] > 0))
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.fp8_scale[%zu]: expected finite and > 0, found %g", layer, kv,
                            h, (double)t->fp8_scale[h]);
    return KVQ_OK;
}

/* ---- validation -------------------------------------------------------------- */

static kvq_status check_table(const kvq_artifact_params *p, const kvq_kv_table *t, size_t layer, char kv,
                              bool want_levels, bool want_thr, kvq_err *err)
{
    size_t kv_dim = p->n_kv_heads * p->head_dim;
    int bits = kv == 'k' ? p->k_bits : p->v_bits;
    size_t want_tables = want_levels ? (p->per_head ? p->n_kv_heads : 1) : 0;
    if (t->bits != bits)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c: table bits %d, expected %c_bits %d", layer, kv, t->bits, kv, bits);
    if (t->n_tables != want_tables)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c: %zu datatypes, expected %zu (%s)", layer, kv, t->n_tables,
                        want_tables, p->per_head ? "per-head" : "per-layer");
    if (t->kv_dim != kv_dim)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c: kv_dim %zu, expected n_kv_heads*head_dim = %zu", layer, kv,
                        t->kv_dim, kv_dim);
    if (want_levels) {
        if (!t->levels || !t->obj_lloyd || !t->obj_exact || !t->chosen)
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.levels: missing", layer, kv);
        size_t nl = (size_t)1 << bits;
        for (size_t h = 0; h < t->n_tables; h++) {
            for (size_t j = 0; j < nl; j++) {
                float v = t->levels[h * nl + j];
                if (!isfinite(v) || v < -1.0f || v > 1.0f || (j && v < t->levels[h * nl + j - 1]))
                    return kvq_fail(err, KVQ_EINVAL,
                                    "layers.%zu.%c.levels[%zu][%zu]: expected finite, ascending, in [-1, 1], found %g",
                                    layer, kv, h, j, (double)v);
            }
            /* a datatype whose levels all (nearly) coincide maps every normalised value to one number: nothing
             * a calibration on real K/V gives (it spans the data's [-1, 1]); refused rather than evaluated */
            const float lo = t->levels[h * nl], hi = t->levels[h * nl + nl - 1];
            if (hi - lo < KVQ_ARTIFACT_MIN_LEVEL_SPAN)
                return kvq_fail(err, KVQ_EINVAL,
                                "layers.%zu.%c.levels[%zu]: degenerate datatype: its %zu levels span %g (from %g to %g), expected "
                                "at least %g of the normalised range [-1, 1] (a one-value table quantizes everything to it)",
                                layer, kv, h, nl, (double)(hi - lo), (double)lo, (double)hi, KVQ_ARTIFACT_MIN_LEVEL_SPAN);
        }
    }
    if (want_thr) {
        if (!t->channel_lower || !t->channel_upper)
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.channel_lower/upper: missing", layer, kv);
        for (size_t c = 0; c < kv_dim; c++) {
            float lo = t->channel_lower[c], hi = t->channel_upper[c];
            if (!isfinite(lo)) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.channel_lower[%zu]: not finite", layer, kv, c);
            if (!isfinite(hi)) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.channel_upper[%zu]: not finite", layer, kv, c);
            if (lo > hi)
                return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c: channel %zu: lower %g > upper %g", layer, kv, c,
                                (double)lo, (double)hi);
        }
        /* one channel may be constant (lower == upper: it is reproduced exactly), every channel cannot */
        size_t flat = 0;
        for (size_t c = 0; c < kv_dim; c++) flat += t->channel_lower[c] == t->channel_upper[c];
        if (flat == kv_dim)
            return kvq_fail(err, KVQ_EINVAL,
                            "layers.%zu.%c.channel_lower/upper: degenerate thresholds: lower == upper in all %zu channels (a "
                            "zero range everywhere: every key would be its channel's one value or an outlier)",
                            layer, kv, kv_dim);
    }
    return KVQ_OK;
}

static kvq_status validate_params(const kvq_artifact_params *p, kvq_err *err)
{
    if (!layout(p->method)) return kvq_fail(err, KVQ_EINVAL, "method: %s", p->method ? "has no artifact layout" : "none");
    const kvq_family_artifact *ly = layout(p->method);
    if (p->k_bits < 1 || p->k_bits > 8) return kvq_fail(err, KVQ_EINVAL, "k_bits: expected 1..8, found %d", p->k_bits);
    if (p->v_bits < 1 || p->v_bits > 8) return kvq_fail(err, KVQ_EINVAL, "v_bits: expected 1..8, found %d", p->v_bits);
    if (!(p->outlier_frac >= 0 && p->outlier_frac < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "outlier_fraction: expected [0, 0.5), found %g", p->outlier_frac);
    if (p->outlier_frac > 0 && !ly->outliers)
        return kvq_fail(err, KVQ_EINVAL, "outlier_fraction: method %s keeps no outliers, found %g", mname(p->method),
                        p->outlier_frac);
    if (p->n_layers == 0 || p->n_layers > 4096)
        return kvq_fail(err, KVQ_EINVAL, "n_layers: expected 1..4096, found %zu", p->n_layers);
    if (p->n_kv_heads == 0 || p->head_dim == 0 || p->n_kv_heads > 65536 || p->head_dim > 65536)
        return kvq_fail(err, KVQ_EINVAL, "n_kv_heads, head_dim: expected 1..65536, found %zu, %zu", p->n_kv_heads,
                        p->head_dim);
    if (ly->check_params) KVQ_TRY(ly->check_params(p, err));
    if (p->rotation.kind != KVQ_ROT_NONE && kvq_rotation_check(&p->rotation, p->head_dim, err))
        return kvq_err_prefix(err, "rotation");
    if (p->per_head && !ly->per_head) {
        char who[128];
        return kvq_fail(err, KVQ_EINVAL, "granularity: per-head datatypes or scales apply to %s only, method is %s",
                        kvq_family_list_artifact_flag(offsetof(kvq_family_artifact, per_head), who, sizeof who),
                        mname(p->method));
    }
    if (strnlen(p->fit, sizeof p->fit) == sizeof p->fit) return kvq_fail(err, KVQ_EINVAL, "fit: not terminated");
    if ((has_levels(p->method) || has_v_levels(p->method)) && strcmp(p->fit, "auto") && strcmp(p->fit, "lloyd") &&
        strcmp(p->fit, "exact"))
        return kvq_fail(err, KVQ_EINVAL, "fit: expected auto, lloyd or exact, found \"%s\"", p->fit);
    if (strnlen(p->model_fingerprint, KVQ_FINGERPRINT_MAX) == KVQ_FINGERPRINT_MAX)
        return kvq_fail(err, KVQ_EINVAL, "model_fingerprint: longer than %d bytes", KVQ_FINGERPRINT_MAX - 1);
    if (strnlen(p->dump_fingerprint, KVQ_FINGERPRINT_MAX) == KVQ_FINGERPRINT_MAX)
        return kvq_fail(err, KVQ_EINVAL, "dump_fingerprint: longer than %d bytes", KVQ_FINGERPRINT_MAX - 1);
    if (!isfinite(p->bits_k) || !isfinite(p->bits_v) || p->bits_k < 0 || p->bits_v < 0)
        return kvq_fail(err, KVQ_EINVAL, "bits_per_element: expected finite and >= 0, found %g / %g", p->bits_k,
                        p->bits_v);
    return KVQ_OK;
}

#define KVQ_PREFIX_MAX 65536

static kvq_status check_prefix(const kvq_artifact_params *p, const kvq_artifact_prefix *px, kvq_err *err)
{
    if (px->P < 1 || px->P > KVQ_PREFIX_MAX)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: prefix length: expected 1..%d, found %zu", KVQ_PREFIX_MAX, px->P);
    if (!px->token_ids || !px->positions || !px->k || !px->k_pre || !px->v || !px->text)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: token ids, positions, k, k_pre_rope, v and text are all required");
    for (size_t i = 0; i < px->P; i++) {
        if (px->token_ids[i] < 0)
            return kvq_fail(err, KVQ_EINVAL, "intactkv.token_ids[%zu]: expected >= 0, found %d", i, px->token_ids[i]);
        if (px->positions[i] != (int32_t)i)
            return kvq_fail(err, KVQ_EINVAL, "intactkv.positions[%zu]: expected %zu (the prefix starts the sequence), found %d",
                            i, i, px->positions[i]);
    }
    size_t kv_dim = p->n_kv_heads * p->head_dim, n = p->n_layers * px->P * kv_dim;
    const float *arr[3] = {px->k, px->k_pre, px->v};
    const char *nm[3] = {"k", "k_pre_rope", "v"};
    for (int w = 0; w < 3; w++)
        for (size_t j = 0; j < n; j++)
            if (!isfinite(arr[w][j]))
                return kvq_fail(err, KVQ_EINVAL, "intactkv: layers.%zu.intactkv.%s[%zu][%zu]: not finite", j / (px->P * kv_dim),
                                nm[w], (j / kv_dim) % px->P, j % kv_dim);
    if (px->trained) {
        if (!px->loss_curve || px->n_loss < 1)
            return kvq_fail(err, KVQ_EINVAL, "intactkv: a trained prefix needs a loss curve of >= 1 steps, found %zu", px->n_loss);
        for (size_t i = 0; i < px->n_loss; i++)
            if (!isfinite(px->loss_curve[i]))
                return kvq_fail(err, KVQ_EINVAL, "intactkv.loss_curve[%zu]: not finite", i);
        if (strnlen(px->train.scheme, sizeof px->train.scheme) == sizeof px->train.scheme)
            return kvq_fail(err, KVQ_EINVAL, "intactkv: training scheme: not terminated");
    }
    return KVQ_OK;
}

kvq_status kvq_artifact_validate(const kvq_artifact *a, kvq_err *err)
{
    const kvq_artifact_params *p = &a->p;
    KVQ_TRY(validate_params(p, err));
    bool lv = has_levels(p->method), vlv = has_v_levels(p->method), thr = has_k_thresholds(p->method);
    if ((lv || thr) && !a->k) return kvq_fail(err, KVQ_EINVAL, "method %s: key tables missing", mname(p->method));
    if (vlv && !a->v) return kvq_fail(err, KVQ_EINVAL, "method %s: value tables missing", mname(p->method));
    if (has_fp8(p->method)) {
        if (!a->k || !a->v) return kvq_fail(err, KVQ_EINVAL, "method fp8: key/value scales missing");
        for (size_t i = 0; i < p->n_layers; i++) {
            KVQ_TRY(check_fp8_table(p, &a->k[i], i, 'k', err));
            KVQ_TRY(check_fp8_table(p, &a->v[i], i, 'v', err));
        }
    }
    for (size_t i = 0; i < p->n_layers; i++) {
        if (a->k && (lv || thr)) KVQ_TRY(check_table(p, &a->k[i], i, 'k', lv, thr, err));
        if (a->v && vlv) KVQ_TRY(check_table(p, &a->v[i], i, 'v', true, false, err));
    }
    bool fk = has_fam_tensors(p, 'k'), fv = has_fam_tensors(p, 'v');
    if ((fk && !a->k) || (fv && !a->v))
        return kvq_fail(err, KVQ_EINVAL, "method %s: %s tables missing", mname(p->method), fk && !a->k ? "key" : "value");
    for (size_t i = 0; i < p->n_layers; i++) {
        if (a->k) KVQ_TRY(check_fam_tables(p, &a->k[i], i, 'k', err));
        if (a->v) KVQ_TRY(check_fam_tables(p, &a->v[i], i, 'v', err));
    }
    if (a->prefix) KVQ_TRY(check_prefix(p, a->prefix, err));
    return KVQ_OK;
}

kvq_status kvq_calib_fill_bits(kvq_artifact_params *p, size_t ctx, kvq_err *err)
{
    if (!p->method || !p->method->from_params) return kvq_fail(err, KVQ_EINVAL, "method: %s", p->method ? p->method->name : "none");
    if (ctx == 0) return kvq_fail(err, KVQ_EINVAL, "bits ctx: expected > 0, found 0");
    kvq_scheme q = {.fam = p->method};
    p->method->from_params(p, &q);
    kvq_bits_in in = {.ctx = ctx, .kv_dim = p->n_kv_heads * p->head_dim, .head_dim = p->head_dim};
    kvq_bits b;
    KVQ_TRY(kvq_scheme_bits_ex(&q, &in, &b, err));
    p->bits_k = b.k;
    p->bits_v = b.v;
    p->bits_ctx = ctx;
    return KVQ_OK;
}

const char *kvq_artifact_scheme_spec(const kvq_artifact_params *p, char *buf, size_t n)
{
    if (!n) return buf;
    buf[0] = 0;
    if (!p->method || !p->method->from_params) return buf;
    kvq_scheme q = {.fam = p->method};
    p->method->from_params(p, &q);
    p->method->format(&q, buf, n);
    return buf;
}

/* ---- write ------------------------------------------------------------------------ */

#define META_MAX 72

typedef struct {
    kvq_st_kv kv[META_MAX];
    char val[META_MAX][64];
    size_t n;
} meta_list;

static void meta_add(meta_list *m, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void meta_add(meta_list *m, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->val[m->n], sizeof m->val[m->n], fmt, ap);
    va_end(ap);
    m->kv[m->n].key = key;
    m->kv[m->n].value = m->val[m->n];
    m->n++;
}

typedef struct {
    char name[96];
} tname;

kvq_status kvq_artifact_write(const char *path, const kvq_artifact *a, kvq_err *err)
{
    KVQ_TRY(kvq_artifact_validate(a, err));
    const kvq_artifact_params *p = &a->p;
    meta_list m = {0};
    meta_add(&m, "kvq.schema", "%s", KVQ_ARTIFACT_SCHEMA);
    meta_add(&m, "kvq.schema_version", "%d", KVQ_ARTIFACT_VERSION);
    meta_add(&m, "kvq.method", "%s", mname(p->method));
    meta_add(&m, "kvq.k_bits", "%d", p->k_bits);
    meta_add(&m, "kvq.v_bits", "%d", p->v_bits);
    meta_add(&m, "kvq.outlier_fraction", "%.17g", p->outlier_frac);
    meta_add(&m, "kvq.n_sink", "%zu", p->n_sink);
    meta_add(&m, "kvq.key_position", "%s", p->post_rope ? "post-rope" : "pre-rope");
    meta_add(&m, "kvq.granularity", "%s", p->per_head ? "per-head" : "per-layer");
    meta_add(&m, "kvq.group_size", "%zu", p->group_size);
    meta_add(&m, "kvq.residual_length", "%zu", p->residual_length);
    meta_add(&m, "kvq.k_axis", "%s", layout(p->method)->k_axis);
    meta_add(&m, "kvq.v_axis", "%s", layout(p->method)->v_axis);
    meta_add(&m, "kvq.k_scaling", "%s", layout(p->method)->k_scaling);
    meta_add(&m, "kvq.v_scaling", "%s", layout(p->method)->v_scaling);
    meta_add(&m, "kvq.fisher", "%s", p->fisher ? "true" : "false");
    meta_add(&m, "kvq.fit", "%s", p->fit);
    meta_add(&m, "kvq.n_layers", "%zu", p->n_layers);
    meta_add(&m, "kvq.n_kv_heads", "%zu", p->n_kv_heads);
    meta_add(&m, "kvq.head_dim", "%zu", p->head_dim);
    meta_add(&m, "kvq.bits_per_element.k", "%.17g", p->bits_k);
    meta_add(&m, "kvq.bits_per_element.v", "%.17g", p->bits_v);
    meta_add(&m, "kvq.bits_ctx", "%zu", p->bits_ctx);
    meta_add(&m, "kvq.creator", "%s", "kvq kvcalib");
    char pkeys[KVQ_ARTIFACT_X][96];
    for (size_t j = 0; j < n_fam_params(p->method); j++) {
        snprintf(pkeys[j], sizeof pkeys[j], "kvq.%s.%s", mname(p->method), layout(p->method)->params[j]);
        meta_add(&m, pkeys[j], "%.17g", p->x[j]);
    }
    if (has_fp8(p->method)) {
        meta_add(&m, "kvq.fp8_format", "%s", p->fp8_e5m2 ? "e5m2" : "e4m3fn");
        meta_add(&m, "kvq.fp8_percentile", "%.17g", p->fp8_percentile);
    }
    /* fingerprints may exceed the 64-byte scratch values */
    m.kv[m.n].key = "kvq.model_fingerprint";
    m.kv[m.n++].value = p->model_fingerprint;
    m.kv[m.n].key = "kvq.dump_fingerprint";
    m.kv[m.n++].value = p->dump_fingerprint;
    if (p->model_rope[0]) {
        m.kv[m.n].key = "kvq.model_rope";
        m.kv[m.n++].value = p->model_rope;
    }
    if (p->rotation.kind != KVQ_ROT_NONE) { /* absent = none (artifacts before rotation stay byte-identical) */
        meta_add(&m, "kvq.rotation", "%s", kvq_rotation_kind_name(p->rotation.kind));
        if (p->rotation.kind == KVQ_ROT_RHT) meta_add(&m, "kvq.rotation_seed", "%llu", (unsigned long long)p->rotation.seed);
    }

    const kvq_artifact_prefix *px = a->prefix;
    if (px) {
        meta_add(&m, "kvq.intactkv.P", "%zu", px->P);
        m.kv[m.n].key = "kvq.intactkv.prefix";
        m.kv[m.n++].value = px->text;
        meta_add(&m, "kvq.intactkv.special", "%s", px->special ? "true" : "false");
        meta_add(&m, "kvq.intactkv.trained", "%s", px->trained ? "true" : "false");
        if (px->trained) {
            const kvq_prefix_training *tr = &px->train;
            m.kv[m.n].key = "kvq.intactkv.train.scheme";
            m.kv[m.n++].value = tr->scheme;
            meta_add(&m, "kvq.intactkv.train.steps", "%zu", tr->steps);
            meta_add(&m, "kvq.intactkv.train.accum", "%zu", tr->accum);
            meta_add(&m, "kvq.intactkv.train.samples", "%zu", tr->samples);
            meta_add(&m, "kvq.intactkv.train.seq_len", "%zu", tr->seq_len);
            meta_add(&m, "kvq.intactkv.train.lr", "%.17g", tr->lr);
            meta_add(&m, "kvq.intactkv.train.beta1", "%.17g", tr->beta1);
            meta_add(&m, "kvq.intactkv.train.beta2", "%.17g", tr->beta2);
            meta_add(&m, "kvq.intactkv.train.eps", "%.17g", tr->eps);
            meta_add(&m, "kvq.intactkv.train.clip", "%.17g", tr->clip);
            meta_add(&m, "kvq.intactkv.train.seed", "%llu", (unsigned long long)tr->seed);
            meta_add(&m, "kvq.intactkv.train.loss_before", "%.17g", tr->loss_before);
            meta_add(&m, "kvq.intactkv.train.loss_after", "%.17g", tr->loss_after);
            meta_add(&m, "kvq.intactkv.train.seconds", "%.17g", tr->seconds);
            meta_add(&m, "kvq.intactkv.train.text_sha256", "%s", tr->text_sha256);
        }
    }

    bool lv = has_levels(p->method), vlv = has_v_levels(p->method), thr = has_k_thresholds(p->method), f8 = has_fp8(p->method);
    size_t per_layer = 0;
    if (a->k && (lv || thr)) per_layer += (lv ? 3 : 0) + (thr ? 2 : 0) + 1;
    if (a->v && vlv) per_layer += 4;
    if (f8) per_layer = 4;
    bool fk = a->k && has_fam_tensors(p, 'k'), fv = a->v && has_fam_tensors(p, 'v');
    per_layer += (fk ? KVQ_FAM_TENSORS + 1 : 0) + (fv ? KVQ_FAM_TENSORS + 1 : 0);
    if (px) per_layer += 3;
    size_t n_t = per_layer * p->n_layers + 3, nt = 0;
    kvq_st_entry *te = calloc(n_t ? n_t : 1, sizeof *te);
    tname *names = calloc(n_t ? n_t : 1, sizeof *names);
    double **objs = calloc(2 * p->n_layers + 1, sizeof *objs);
    uint64_t *counts = calloc(6 * p->n_layers + 1, sizeof *counts);
    kvq_status s = KVQ_OK;
    if (!te || !names || !objs || !counts) { s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); goto done; }
    size_t kv_dim = p->n_kv_heads * p->head_dim;
    for (size_t i = 0; i < p->n_layers; i++) {
        for (int which = 0; which < 2; which++) {
            const kvq_kv_table *t = which == 0 ? (a->k ? &a->k[i] : NULL) : (a->v ? &a->v[i] : NULL);
            char kv = which == 0 ? 'k' : 'v';
            bool want_lv = which == 0 ? lv : vlv, want_thr = which == 0 && thr, want_ft = which == 0 ? fk : fv;
            if (!t || (!want_lv && !want_thr && !f8 && !want_ft)) continue;
            size_t nl = (size_t)1 << t->bits;
#define ADD(suffix, dt, nd, s0, s1, ptr)                                                        \
    do {                                                                                       \
        snprintf(names[nt].name, sizeof names[nt].name, "layers.%zu.%c." suffix, i, kv);       \
        te[nt] = (kvq_st_entry){names[nt].name, dt, nd, {s0, s1}, ptr};                        \
        nt++;                                                                                  \
    } while (0)
            if (want_lv) {
                if (p->per_head) ADD("levels", KVQ_ST_F32, 2, t->n_tables, nl, t->levels);
                else ADD("levels", KVQ_ST_F32, 1, nl, 0, t->levels);
                double *o = malloc(2 * t->n_tables * sizeof *o);
                if (!o) { s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); goto done; }
                objs[2 * i + which] = o;
                for (size_t h = 0; h < t->n_tables; h++) { o[2 * h] = t->obj_lloyd[h]; o[2 * h + 1] = t->obj_exact[h]; }
                ADD("fit_objective", KVQ_ST_F64, 2, t->n_tables, 2, o);
                ADD("fit_chosen", KVQ_ST_U8, 1, t->n_tables, 0, t->chosen);
            }
            if (f8) ADD("fp8_scale", KVQ_ST_F32, 1, t->n_fp8_scales, 0, t->fp8_scale);
            if (want_thr) {
                ADD("channel_lower", KVQ_ST_F32, 1, kv_dim, 0, t->channel_lower);
                ADD("channel_upper", KVQ_ST_F32, 1, kv_dim, 0, t->channel_upper);
            }
            for (size_t j = 0; want_ft && j < t->n_ft; j++) {
                const kvq_fam_tensor *x = &t->ft[j];
                snprintf(names[nt].name, sizeof names[nt].name, "layers.%zu.%c.%s", i, kv, x->name);
                te[nt] = (kvq_st_entry){names[nt].name, KVQ_ST_F32, x->n_dims, {0}, x->data};
                for (uint32_t d = 0; d < x->n_dims; d++) te[nt].shape[d] = x->shape[d];
                nt++;
            }
            uint64_t *c = counts + 6 * i + 3 * which;
            c[0] = t->n_elems;
            c[1] = t->n_outliers;
            c[2] = t->n_points;
            ADD("calib_counts", KVQ_ST_U64, 1, 3, 0, c);
#undef ADD
        }
    }
    if (px) {
        size_t per = px->P * kv_dim;
        for (size_t i = 0; i < p->n_layers; i++) {
            const float *src[3] = {px->k, px->k_pre, px->v};
            const char *nm[3] = {"k", "k_pre_rope", "v"};
            for (int w = 0; w < 3; w++) {
                snprintf(names[nt].name, sizeof names[nt].name, "layers.%zu.intactkv.%s", i, nm[w]);
                te[nt] = (kvq_st_entry){names[nt].name, KVQ_ST_F32, 2, {px->P, kv_dim}, src[w] + i * per};
                nt++;
            }
        }
        te[nt++] = (kvq_st_entry){"intactkv.token_ids", KVQ_ST_I32, 1, {px->P}, px->token_ids};
        te[nt++] = (kvq_st_entry){"intactkv.positions", KVQ_ST_I32, 1, {px->P}, px->positions};
        if (px->trained) te[nt++] = (kvq_st_entry){"intactkv.loss_curve", KVQ_ST_F64, 1, {px->n_loss}, px->loss_curve};
    }
    s = kvq_safetensors_write(path, te, nt, m.kv, m.n, err);
done:
    if (objs)
        for (size_t i = 0; i < 2 * p->n_layers; i++) free(objs[i]);
    free(objs);
    free(counts);
    free(names);
    free(te);
    return s;
}

/* ---- read ------------------------------------------------------------------------- */

static kvq_status meta_str(const kvq_safetensors *st, const char *key, const char **out, kvq_err *err)
{
    *out = kvq_safetensors_meta(st, key);
    if (!*out) return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s' missing", st->path, key);
    return KVQ_OK;
}

static kvq_status meta_size(const kvq_safetensors *st, const char *key, size_t *out, kvq_err *err)
{
    const char *v;
    KVQ_TRY(meta_str(st, key, &v, err));
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (!*v || *end || errno || v[0] == '-' || x > SIZE_MAX)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected a non-negative integer, found \"%s\"", st->path,
                        key, v);
    *out = (size_t)x;
    return KVQ_OK;
}

static kvq_status meta_int(const kvq_safetensors *st, const char *key, int *out, kvq_err *err)
{
    size_t v;
    KVQ_TRY(meta_size(st, key, &v, err));
    if (v > 1000000) return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': value %zu out of range", st->path, key, v);
    *out = (int)v;
    return KVQ_OK;
}

static kvq_status meta_double(const kvq_safetensors *st, const char *key, double *out, kvq_err *err)
{
    const char *v;
    KVQ_TRY(meta_str(st, key, &v, err));
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x))
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected a finite number, found \"%s\"", st->path, key, v);
    *out = x;
    return KVQ_OK;
}

static kvq_status meta_choice(const kvq_safetensors *st, const char *key, const char *yes, const char *no, bool *out,
                              kvq_err *err)
{
    const char *v;
    KVQ_TRY(meta_str(st, key, &v, err));
    if (strcmp(v, yes) == 0) *out = true;
    else if (strcmp(v, no) == 0) *out = false;
    else return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected \"%s\" or \"%s\", found \"%s\"", st->path, key, yes, no, v);
    return KVQ_OK;
}

static kvq_status meta_copy(const kvq_safetensors *st, const char *key, char *dst, size_t cap, kvq_err *err)
{
    const char *v;
    KVQ_TRY(meta_str(st, key, &v, err));
    if (strlen(v) >= cap)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': longer than %zu bytes", st->path, key, cap - 1);
    memcpy(dst, v, strlen(v) + 1);
    return KVQ_OK;
}

/* "[s0]" or "[s0, s1]" (want: nd and s0, s1), or a found tensor's whole shape */
static const char *shape_text(char *buf, size_t cap, uint32_t nd, const uint64_t *dims)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (uint32_t d = 0; d < nd && k < cap; d++) k += (size_t)snprintf(buf + k, cap - k, d ? ", %llu" : "%llu", (unsigned long long)dims[d]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
    return buf;
}

/* dtype/shape mismatch of tensor `name` (the 1-D case printed "[80]" for [8]: a 0 after the size) */
static kvq_status shape_fail(const kvq_safetensors *st, const char *name, kvq_st_dtype dt, uint32_t nd, uint64_t s0, uint64_t s1,
                             const kvq_st_tensor *t, const char *why, kvq_err *err)
{
    char want[64], found[160];
    const uint64_t wd[2] = {s0, s1};
    shape_text(want, sizeof want, nd, wd);
    shape_text(found, sizeof found, t->n_dims <= KVQ_ST_MAX_DIMS ? t->n_dims : KVQ_ST_MAX_DIMS, t->shape);
    return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': expected %s %s%s, found %s %s", st->path, name, kvq_st_dtype_name(dt), want, why,
                    kvq_st_dtype_name(t->dtype), found);
}

/* Find tensor `layers.<i>.<kv>.<suffix>` with dtype and shape; copy its bytes into a new buffer. */
static kvq_status get_tensor(const kvq_safetensors *st, size_t layer, char kv, const char *suffix, kvq_st_dtype dt,
                             uint32_t nd, uint64_t s0, uint64_t s1, void **out, kvq_err *err)
{
    char name[96];
    snprintf(name, sizeof name, "layers.%zu.%c.%s", layer, kv, suffix);
    const kvq_st_tensor *t = kvq_safetensors_find(st, name);
    if (!t) return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' missing", st->path, name);
    if (t->dtype != dt || t->n_dims != nd || t->shape[0] != s0 || (nd == 2 && t->shape[1] != s1))
        return shape_fail(st, name, dt, nd, s0, s1, t, "", err);
    *out = malloc(t->n_bytes ? t->n_bytes : 1);
    if (!*out) return kvq_fail(err, KVQ_ENOMEM, "%s: tensor '%s': out of memory", st->path, name);
    memcpy(*out, t->data, t->n_bytes);
    return KVQ_OK;
}

static kvq_status read_table(const kvq_safetensors *st, const kvq_artifact_params *p, size_t i, char kv, bool lv,
                             bool thr, kvq_kv_table *t, kvq_err *err)
{
    size_t kv_dim = p->n_kv_heads * p->head_dim;
    t->bits = kv == 'k' ? p->k_bits : p->v_bits;
    t->kv_dim = kv_dim;
    t->n_tables = lv ? (p->per_head ? p->n_kv_heads : 1) : 0;
    if (has_fp8(p->method)) {
        t->n_fp8_scales = p->per_head ? p->n_kv_heads : 1;
        KVQ_TRY(get_tensor(st, i, kv, "fp8_scale", KVQ_ST_F32, 1, t->n_fp8_scales, 0, (void **)&t->fp8_scale, err));
    }
    size_t nl = (size_t)1 << t->bits;
    if (lv) {
        void *obj;
        if (p->per_head) KVQ_TRY(get_tensor(st, i, kv, "levels", KVQ_ST_F32, 2, t->n_tables, nl, (void **)&t->levels, err));
        else KVQ_TRY(get_tensor(st, i, kv, "levels", KVQ_ST_F32, 1, nl, 0, (void **)&t->levels, err));
        /* an fp16 value LUT (nuq: KVQuant App. M, as its bits accounting counts): the simulation, the packed caches
         * and the GPU kernel's tensor-core operands (exact only for fp16 numbers) all use the levels rounded so */
        if (kv == 'v' && layout(p->method)->v_levels_fp16)
            for (size_t j = 0; j < t->n_tables * nl; j++) t->levels[j] = kvq_round_fp16(t->levels[j]);
        KVQ_TRY(get_tensor(st, i, kv, "fit_objective", KVQ_ST_F64, 2, t->n_tables, 2, &obj, err));
        t->obj_lloyd = malloc(t->n_tables * sizeof(double));
        t->obj_exact = malloc(t->n_tables * sizeof(double));
        if (!t->obj_lloyd || !t->obj_exact) { free(obj); return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", st->path); }
        for (size_t h = 0; h < t->n_tables; h++) {
            t->obj_lloyd[h] = ((double *)obj)[2 * h];
            t->obj_exact[h] = ((double *)obj)[2 * h + 1];
        }
        free(obj);
        KVQ_TRY(get_tensor(st, i, kv, "fit_chosen", KVQ_ST_U8, 1, t->n_tables, 0, (void **)&t->chosen, err));
    }
    if (thr) {
        KVQ_TRY(get_tensor(st, i, kv, "channel_lower", KVQ_ST_F32, 1, kv_dim, 0, (void **)&t->channel_lower, err));
        KVQ_TRY(get_tensor(st, i, kv, "channel_upper", KVQ_ST_F32, 1, kv_dim, 0, (void **)&t->channel_upper, err));
    }
    for (const char *const *l = fam_tensors(p, kv); *l; l++) {
        char name[96];
        snprintf(name, sizeof name, "layers.%zu.%c.%s", i, kv, *l);
        const kvq_st_tensor *x = kvq_safetensors_find(st, name);
        if (!x) return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' missing (method %s stores it)", st->path, name, mname(p->method));
        if (x->dtype != KVQ_ST_F32 || x->n_dims < 1 || x->n_dims > KVQ_FAM_TENSOR_DIMS)
            return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': expected F32 with 1..%d dimensions, found %s with %u", st->path, name,
                            KVQ_FAM_TENSOR_DIMS, kvq_st_dtype_name(x->dtype), x->n_dims);
        float *d;
        kvq_status s = kvq_kv_table_add(t, *l, x->n_dims, x->shape, &d, err);
        if (s) return kvq_err_prefix(err, "%s: tensor '%s'", st->path, name);
        memcpy(d, x->data, x->n_bytes);
    }
    uint64_t *c;
    KVQ_TRY(get_tensor(st, i, kv, "calib_counts", KVQ_ST_U64, 1, 3, 0, (void **)&c, err));
    t->n_elems = c[0];
    t->n_outliers = c[1];
    t->n_points = c[2];
    free(c);
    if (t->n_outliers > t->n_elems || t->n_points > t->n_elems) /* (--inspect printed "outliers 100.000% (2^63/...)") */
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: layers.%zu.%c.calib_counts: outliers %llu and points %llu expected <= elements %llu", st->path, i, kv,
                        (unsigned long long)t->n_outliers, (unsigned long long)t->n_points, (unsigned long long)t->n_elems);
    return KVQ_OK;
}

static kvq_status read_params(const kvq_safetensors *st, kvq_artifact_params *p, kvq_err *err)
{
    const char *v;
    KVQ_TRY(meta_str(st, "kvq.schema", &v, err));
    if (strcmp(v, KVQ_ARTIFACT_SCHEMA) != 0)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.schema': expected \"%s\", found \"%s\" (not a kvq artifact)",
                        st->path, KVQ_ARTIFACT_SCHEMA, v);
    size_t ver;
    KVQ_TRY(meta_size(st, "kvq.schema_version", &ver, err));
    if (ver > KVQ_ARTIFACT_VERSION)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "%s: metadata 'kvq.schema_version': %zu is newer than this build supports (%d); update kvq",
                        st->path, ver, KVQ_ARTIFACT_VERSION);
    if (ver < 1) return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.schema_version': invalid %zu", st->path, ver);
    KVQ_TRY(meta_str(st, "kvq.method", &v, err));
    p->method = kvq_family_method(v);
    if (!p->method) {
        char known[160];
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.method': unknown method \"%s\" (known: %s)", st->path, v,
                        kvq_family_methods(", ", known, sizeof known));
    }
    KVQ_TRY(meta_int(st, "kvq.k_bits", &p->k_bits, err));
    KVQ_TRY(meta_int(st, "kvq.v_bits", &p->v_bits, err));
    KVQ_TRY(meta_double(st, "kvq.outlier_fraction", &p->outlier_frac, err));
    KVQ_TRY(meta_size(st, "kvq.n_sink", &p->n_sink, err));
    KVQ_TRY(meta_choice(st, "kvq.key_position", "post-rope", "pre-rope", &p->post_rope, err));
    KVQ_TRY(meta_choice(st, "kvq.granularity", "per-head", "per-layer", &p->per_head, err));
    KVQ_TRY(meta_size(st, "kvq.group_size", &p->group_size, err));
    KVQ_TRY(meta_size(st, "kvq.residual_length", &p->residual_length, err));
    KVQ_TRY(meta_choice(st, "kvq.fisher", "true", "false", &p->fisher, err));
    KVQ_TRY(meta_copy(st, "kvq.fit", p->fit, sizeof p->fit, err));
    KVQ_TRY(meta_size(st, "kvq.n_layers", &p->n_layers, err));
    KVQ_TRY(meta_size(st, "kvq.n_kv_heads", &p->n_kv_heads, err));
    KVQ_TRY(meta_size(st, "kvq.head_dim", &p->head_dim, err));
    KVQ_TRY(meta_double(st, "kvq.bits_per_element.k", &p->bits_k, err));
    KVQ_TRY(meta_double(st, "kvq.bits_per_element.v", &p->bits_v, err));
    KVQ_TRY(meta_size(st, "kvq.bits_ctx", &p->bits_ctx, err));
    KVQ_TRY(meta_copy(st, "kvq.model_fingerprint", p->model_fingerprint, sizeof p->model_fingerprint, err));
    KVQ_TRY(meta_copy(st, "kvq.dump_fingerprint", p->dump_fingerprint, sizeof p->dump_fingerprint, err));
    p->model_rope[0] = 0; /* optional: absent in artifacts written before it was recorded */
    if (kvq_safetensors_meta(st, "kvq.model_rope")) KVQ_TRY(meta_copy(st, "kvq.model_rope", p->model_rope, sizeof p->model_rope, err));
    for (size_t j = 0; j < n_fam_params(p->method); j++) {
        char key[96];
        snprintf(key, sizeof key, "kvq.%s.%s", mname(p->method), layout(p->method)->params[j]);
        KVQ_TRY(meta_double(st, key, &p->x[j], err));
    }
    p->rotation = (kvq_rotation){0}; /* optional: absent = fitted on unrotated K / V */
    if (kvq_safetensors_meta(st, "kvq.rotation")) {
        KVQ_TRY(meta_str(st, "kvq.rotation", &v, err));
        if (!kvq_rotation_kind_parse(v, &p->rotation.kind))
            return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.rotation': expected \"none\", \"hadamard\" or \"rht\", found \"%s\"",
                            st->path, v);
        if (p->rotation.kind == KVQ_ROT_RHT) {
            KVQ_TRY(meta_str(st, "kvq.rotation_seed", &v, err));
            char *end;
            errno = 0;
            unsigned long long seed = strtoull(v, &end, 10);
            if (!*v || *end || errno || *v == '-')
                return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.rotation_seed': expected an unsigned 64-bit integer, found \"%s\"",
                                st->path, v);
            p->rotation.seed = (uint64_t)seed;
        }
    }
    if (has_fp8(p->method)) {
        bool e4;
        KVQ_TRY(meta_choice(st, "kvq.fp8_format", "e4m3fn", "e5m2", &e4, err));
        p->fp8_e5m2 = !e4;
        KVQ_TRY(meta_double(st, "kvq.fp8_percentile", &p->fp8_percentile, err));
    }
    kvq_status s = validate_params(p, err);
    if (s != KVQ_OK) return kvq_err_prefix(err, "%s", st->path);
    return KVQ_OK;
}

/* Copy a named tensor of exact dtype and shape [s0] or [s0, s1] into dst. */
static kvq_status read_named(const kvq_safetensors *st, const char *name, kvq_st_dtype dt, uint32_t nd, uint64_t s0,
                             uint64_t s1, void *dst, kvq_err *err)
{
    const kvq_st_tensor *t = kvq_safetensors_find(st, name);
    if (!t) return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' missing (an IntactKV prefix needs it)", st->path, name);
    if (t->dtype != dt || t->n_dims != nd || t->shape[0] != s0 || (nd == 2 && t->shape[1] != s1))
        return shape_fail(st, name, dt, nd, s0, s1, t, " (an IntactKV prefix)", err);
    memcpy(dst, t->data, t->n_bytes);
    return KVQ_OK;
}

static kvq_status read_prefix(const kvq_safetensors *st, const kvq_artifact_params *p, kvq_artifact_prefix *px,
                              kvq_err *err)
{
    const kvq_st_tensor *ids = kvq_safetensors_find(st, "intactkv.token_ids");
    if (ids->dtype != KVQ_ST_I32 || ids->n_dims != 1 || ids->shape[0] < 1 || ids->shape[0] > KVQ_PREFIX_MAX)
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor 'intactkv.token_ids': expected I32 [P] with 1 <= P <= %d, found %s with %u dims",
                        st->path, KVQ_PREFIX_MAX, kvq_st_dtype_name(ids->dtype), ids->n_dims);
    size_t P = (size_t)ids->shape[0], kv_dim = p->n_kv_heads * p->head_dim, per = P * kv_dim, n;
    if (kvq_mul_size(per, p->n_layers, &n) || n > ((size_t)1 << 34))
        return kvq_fail(err, KVQ_EFORMAT, "%s: IntactKV prefix of %zu entries is too large", st->path, P);
    KVQ_TRY(kvq_artifact_prefix_alloc(px, P, p->n_layers, kv_dim, st->path, err));
    KVQ_TRY(read_named(st, "intactkv.token_ids", KVQ_ST_I32, 1, P, 0, px->token_ids, err));
    KVQ_TRY(read_named(st, "intactkv.positions", KVQ_ST_I32, 1, P, 0, px->positions, err));
    for (size_t i = 0; i < p->n_layers; i++) {
        float *dst[3] = {px->k, px->k_pre, px->v};
        const char *nm[3] = {"k", "k_pre_rope", "v"};
        for (int w = 0; w < 3; w++) {
            char name[96];
            snprintf(name, sizeof name, "layers.%zu.intactkv.%s", i, nm[w]);
            KVQ_TRY(read_named(st, name, KVQ_ST_F32, 2, P, kv_dim, dst[w] + i * per, err));
        }
    }
    size_t mp;
    KVQ_TRY(meta_size(st, "kvq.intactkv.P", &mp, err));
    if (mp != P)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'kvq.intactkv.P' = %zu, but intactkv.token_ids has %zu entries", st->path,
                        mp, P);
    const char *text;
    KVQ_TRY(meta_str(st, "kvq.intactkv.prefix", &text, err));
    px->text = strdup(text);
    if (!px->text) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", st->path);
    KVQ_TRY(meta_choice(st, "kvq.intactkv.special", "true", "false", &px->special, err));
    KVQ_TRY(meta_choice(st, "kvq.intactkv.trained", "true", "false", &px->trained, err));
    if (!px->trained) return KVQ_OK;
    kvq_prefix_training *tr = &px->train;
    KVQ_TRY(meta_copy(st, "kvq.intactkv.train.scheme", tr->scheme, sizeof tr->scheme, err));
    KVQ_TRY(meta_size(st, "kvq.intactkv.train.steps", &tr->steps, err));
    KVQ_TRY(meta_size(st, "kvq.intactkv.train.accum", &tr->accum, err));
    KVQ_TRY(meta_size(st, "kvq.intactkv.train.samples", &tr->samples, err));
    KVQ_TRY(meta_size(st, "kvq.intactkv.train.seq_len", &tr->seq_len, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.lr", &tr->lr, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.beta1", &tr->beta1, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.beta2", &tr->beta2, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.eps", &tr->eps, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.clip", &tr->clip, err));
    size_t seed;
    KVQ_TRY(meta_size(st, "kvq.intactkv.train.seed", &seed, err));
    tr->seed = seed;
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.loss_before", &tr->loss_before, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.loss_after", &tr->loss_after, err));
    KVQ_TRY(meta_double(st, "kvq.intactkv.train.seconds", &tr->seconds, err));
    KVQ_TRY(meta_copy(st, "kvq.intactkv.train.text_sha256", tr->text_sha256, sizeof tr->text_sha256, err));
    const kvq_st_tensor *lc = kvq_safetensors_find(st, "intactkv.loss_curve");
    if (!lc || lc->dtype != KVQ_ST_F64 || lc->n_dims != 1 || lc->shape[0] < 1 || lc->shape[0] > ((uint64_t)1 << 28))
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor 'intactkv.loss_curve': expected F64 [n_steps] for a trained prefix, found %s",
                        st->path, lc ? "another dtype or shape" : "none");
    px->n_loss = (size_t)lc->shape[0];
    px->loss_curve = malloc(px->n_loss * sizeof(double));
    if (!px->loss_curve) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", st->path);
    memcpy(px->loss_curve, lc->data, px->n_loss * sizeof(double));
    return KVQ_OK;
}

kvq_status kvq_artifact_read(const char *path, kvq_artifact *a, kvq_err *err)
{
    memset(a, 0, sizeof *a);
    kvq_safetensors st;
    KVQ_TRY(kvq_safetensors_open(path, &st, err));
    kvq_status s = read_params(&st, &a->p, err);
    bool lv = s == KVQ_OK && has_levels(a->p.method), vlv = s == KVQ_OK && has_v_levels(a->p.method),
         thr = s == KVQ_OK && has_k_thresholds(a->p.method), f8 = s == KVQ_OK && has_fp8(a->p.method);
    bool fk = s == KVQ_OK && has_fam_tensors(&a->p, 'k'), fv = s == KVQ_OK && has_fam_tensors(&a->p, 'v');
    if (s == KVQ_OK && (lv || vlv || thr || f8 || fk || fv)) {
        bool kt = lv || thr || f8 || fk, vt = vlv || f8 || fv;
        if (kt) a->k = calloc(a->p.n_layers, sizeof *a->k);
        if (vt) a->v = calloc(a->p.n_layers, sizeof *a->v);
        if ((kt && !a->k) || (vt && !a->v)) s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        for (size_t i = 0; s == KVQ_OK && i < a->p.n_layers; i++) {
            if (kt) s = read_table(&st, &a->p, i, 'k', lv, thr, &a->k[i], err);
            if (s == KVQ_OK && vt) s = read_table(&st, &a->p, i, 'v', vlv, false, &a->v[i], err);
        }
    }
    if (s == KVQ_OK && kvq_safetensors_find(&st, "intactkv.token_ids")) {
        a->prefix = calloc(1, sizeof *a->prefix);
        if (!a->prefix) s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        else s = read_prefix(&st, &a->p, a->prefix, err);
    }
    if (s == KVQ_OK) {
        s = kvq_artifact_validate(a, err);
        if (s != KVQ_OK) kvq_err_prefix(err, "%s", path);
    }
    kvq_safetensors_close(&st);
    if (s != KVQ_OK) {
        kvq_artifact_params keep = a->p;
        kvq_artifact_free(a);
        a->p = keep;
    }
    return s;
}

/* ---- fingerprint and inspect --------------------------------------------------- */

kvq_status kvq_artifact_check_model_rope(const kvq_artifact_params *p, const char *model_fingerprint, const char *model_rope,
                                         bool allow_mismatch, FILE *warn, kvq_err *err)
{
    const char *have = p->model_fingerprint, *want = model_fingerprint ? model_fingerprint : "";
    if (*have && strcmp(have, want) == 0) return KVQ_OK;
    char msg[KVQ_ERR_MSG_MAX];
    if (model_rope && p->model_rope[0] && strcmp(model_rope, p->model_rope))
        snprintf(msg, sizeof msg, "calibrated under RoPE scaling %.400s, but the model uses RoPE scaling %.400s (artifact model fingerprint \"%.70s\", the model's \"%.70s\")",
                 p->model_rope, model_rope, *have ? have : "(none recorded)", *want ? want : "(none)");
    else
        snprintf(msg, sizeof msg, "artifact model fingerprint \"%.200s\" does not match the model's \"%.200s\"",
                 *have ? have : "(none recorded)", *want ? want : "(none)");
    if (!allow_mismatch) return kvq_fail(err, KVQ_EMISMATCH, "%s (--allow-model-mismatch loads it anyway)", msg);
    if (warn) fprintf(warn, "warning: %s; loading anyway as requested\n", msg);
    return KVQ_OK;
}

kvq_status kvq_artifact_check_model(const kvq_artifact_params *p, const char *model_fingerprint, bool allow_mismatch,
                                    FILE *warn, kvq_err *err)
{
    return kvq_artifact_check_model_rope(p, model_fingerprint, NULL, allow_mismatch, warn, err);
}

static void print_levels(FILE *f, const float *lv, size_t nl)
{
    fputc('[', f);
    for (size_t j = 0; j < nl; j++) {
        if (j == 8 && nl > 10) { fprintf(f, " ... %+.4f", (double)lv[nl - 1]); break; }
        fprintf(f, "%s%+.4f", j ? " " : "", (double)lv[j]);
    }
    fputc(']', f);
}

static void print_table(FILE *f, size_t i, char kv, const kvq_kv_table *t, bool outliers)
{
    fprintf(f, "  layer %2zu %c:", i, kv);
    if (t->n_elems && (outliers || t->n_outliers))
        fprintf(f, " outliers %.3f%% (%llu/%llu), points %llu", 100.0 * (double)t->n_outliers / (double)t->n_elems,
                (unsigned long long)t->n_outliers, (unsigned long long)t->n_elems, (unsigned long long)t->n_points);
    else if (t->n_elems)
        fprintf(f, " points %llu", (unsigned long long)t->n_points);
    if (t->fp8_scale) {
        fprintf(f, ", fp8 scale%s", t->n_fp8_scales > 1 ? "s" : "");
        for (size_t h = 0; h < t->n_fp8_scales; h++) fprintf(f, " %.6g", (double)t->fp8_scale[h]);
    }
    if (t->channel_lower) {
        float lo = t->channel_lower[0], hi = t->channel_upper[0];
        for (size_t c = 1; c < t->kv_dim; c++) {
            if (t->channel_lower[c] < lo) lo = t->channel_lower[c];
            if (t->channel_upper[c] > hi) hi = t->channel_upper[c];
        }
        fprintf(f, ", thresholds in [%.4g, %.4g]", (double)lo, (double)hi);
    }
    for (size_t j = 0; j < t->n_ft; j++) {
        const kvq_fam_tensor *x = &t->ft[j];
        size_t n = kvq_fam_tensor_len(x);
        float lo = x->data[0], hi = x->data[0];
        for (size_t e = 1; e < n; e++) {
            if (x->data[e] < lo) lo = x->data[e];
            if (x->data[e] > hi) hi = x->data[e];
        }
        fprintf(f, "%s%s [", j || t->n_elems || t->fp8_scale || t->channel_lower ? ", " : " ", x->name);
        for (uint32_t d = 0; d < x->n_dims; d++) fprintf(f, "%s%llu", d ? "x" : "", (unsigned long long)x->shape[d]);
        fprintf(f, "] in [%.4g, %.4g]", (double)lo, (double)hi);
    }
    fputc('\n', f);
    size_t nl = (size_t)1 << t->bits;
    for (size_t h = 0; h < t->n_tables; h++) {
        fprintf(f, "    %s", t->n_tables > 1 ? "" : "");
        if (t->n_tables > 1) fprintf(f, "head %zu ", h);
        fprintf(f, "levels ");
        print_levels(f, t->levels + h * nl, nl);
        const char *ch = t->chosen[h] == KVQ_FIT_CHOSEN_LLOYD ? "lloyd" : t->chosen[h] == KVQ_FIT_CHOSEN_EXACT ? "exact" : "-";
        fprintf(f, "\n      objective lloyd %.6g, exact %.6g", t->obj_lloyd[h], t->obj_exact[h]);
        if (t->obj_lloyd[h] > 0 && t->obj_exact[h] >= 0)
            fprintf(f, " (exact/lloyd %.4f)", t->obj_exact[h] / t->obj_lloyd[h]);
        fprintf(f, ", chosen %s\n", ch);
    }
}

kvq_status kvq_artifact_inspect(FILE *f, const char *path, kvq_err *err)
{
    kvq_artifact a;
    KVQ_TRY(kvq_artifact_read(path, &a, err));
    const kvq_artifact_params *p = &a.p;
    fprintf(f, "%s: %s v%d\n", path, KVQ_ARTIFACT_SCHEMA, KVQ_ARTIFACT_VERSION);
    const kvq_family_artifact *ly = layout(p->method);
    fprintf(f, "method        %s  K %d bit, V %d bit", mname(p->method), p->k_bits, p->v_bits);
    if (p->outlier_frac > 0) fprintf(f, ", outliers %.4g%%", 100 * p->outlier_frac);
    fprintf(f, "\n");
    fprintf(f, "keys          %s, %s, %s\n", p->post_rope ? "post-RoPE" : "pre-RoPE", ly->k_axis, ly->k_scaling);
    fprintf(f, "values        %s, %s\n", ly->v_axis, ly->v_scaling);
    fprintf(f, "sink tokens   %zu (full precision)\n", p->n_sink);
    for (size_t j = 0; j < n_fam_params(p->method); j++)
        fprintf(f, "%-13s %.6g (kvq.%s.%s)\n", ly->params[j], p->x[j], mname(p->method), ly->params[j]);
    if (p->rotation.kind != KVQ_ROT_NONE) {
        char rd[64], sp[48];
        kvq_rotation_describe(&p->rotation, rd, sizeof rd);
        kvq_rotation_spec(&p->rotation, sp, sizeof sp);
        fprintf(f, "rotation      fitted on %s K / V (schemes bind it with %s)\n", rd, sp);
    }
    if (ly->inspect) ly->inspect(f, p);
    fprintf(f, "model         %zu layers x %zu KV heads x head_dim %zu\n", p->n_layers, p->n_kv_heads, p->head_dim);
    fprintf(f, "bits/element  K %.4f, V %.4f (ctx %zu; scales, zero points, outliers, sink and residual included)\n",
            p->bits_k, p->bits_v, p->bits_ctx);
    fprintf(f, "model fp      %s\n", *p->model_fingerprint ? p->model_fingerprint : "(none)");
    fprintf(f, "dump fp       %s\n", *p->dump_fingerprint ? p->dump_fingerprint : "(none)");
    if (p->model_rope[0]) fprintf(f, "model RoPE    scaling %s\n", p->model_rope);
    if (a.prefix) {
        const kvq_artifact_prefix *px = a.prefix;
        fprintf(f, "intactkv      prefix of %zu token%s at positions 0..%zu: \"%.200s\"%s, %s\n", px->P, px->P == 1 ? "" : "s",
                px->P - 1, px->text, px->special ? " (special tokens parsed)" : "", px->trained ? "trained" : "untrained");
        fprintf(f, "              token ids");
        for (size_t i = 0; i < px->P && i < 16; i++) fprintf(f, " %d", px->token_ids[i]);
        fprintf(f, "%s\n", px->P > 16 ? " ..." : "");
        if (px->trained) {
            const kvq_prefix_training *tr = &px->train;
            fprintf(f, "              trained against %s: %zu steps x %zu samples of %zu windows x %zu tokens, lr %g, clip %g, "
                       "Adam (%g, %g, %g), seed %llu\n",
                    tr->scheme, tr->steps, tr->accum, tr->samples, tr->seq_len, tr->lr, tr->clip, tr->beta1, tr->beta2, tr->eps,
                    (unsigned long long)tr->seed);
            fprintf(f, "              loss %.6g -> %.6g (all windows), steps %.6g -> %.6g, %.1f s\n", tr->loss_before,
                    tr->loss_after, px->loss_curve[0], px->loss_curve[px->n_loss - 1], tr->seconds);
        }
    }
    if (a.k || a.v) {
        double tl = 0, te = 0;
        size_t wins = 0, n = 0;
        for (size_t i = 0; i < p->n_layers; i++)
            for (int w = 0; w < 2; w++) {
                const kvq_kv_table *t = w ? (a.v ? &a.v[i] : NULL) : (a.k ? &a.k[i] : NULL);
                if (!t) continue;
                for (size_t h = 0; h < t->n_tables; h++) {
                    if (t->obj_lloyd[h] >= 0) tl += t->obj_lloyd[h];
                    if (t->obj_exact[h] >= 0) te += t->obj_exact[h];
                    wins += t->chosen[h] == KVQ_FIT_CHOSEN_EXACT;
                    n++;
                }
            }
        if (n) fprintf(f, "fit totals    lloyd %.6g, exact %.6g; exact chosen for %zu of %zu tables\n", tl, te, wins, n);
        fprintf(f, "tables:\n");
        for (size_t i = 0; i < p->n_layers; i++) {
            if (a.k) print_table(f, i, 'K', &a.k[i], p->outlier_frac > 0);
            if (a.v) print_table(f, i, 'V', &a.v[i], p->outlier_frac > 0);
        }
    }
    kvq_artifact_free(&a);
    return KVQ_OK;
}

kvq_status kvq_artifact_write_new(const char *path, const kvq_artifact *a, bool force, kvq_err *err)
{
    if (!path || !*path) return kvq_fail(err, KVQ_EINVAL, "artifact: no output path");
    if (!force && access(path, F_OK) == 0)
        return kvq_fail(err, KVQ_EIO, "%s: already exists; not overwritten (use --force to replace it)", path);
    size_t pl = strlen(path);
    char *tmp = malloc(pl + sizeof ".tmp");
    if (!tmp) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".tmp", sizeof ".tmp");
    kvq_status s = kvq_artifact_write(tmp, a, err);
    if (!s) {
        if (force) {
            if (rename(tmp, path) != 0) s = kvq_fail(err, KVQ_EIO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        } else if (renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) != 0) {
            int e = errno;
            if (e == EINVAL || e == ENOSYS) { /* file system without RENAME_NOREPLACE: link is no-replace too */
                if (link(tmp, path) != 0) e = errno;
                else e = 0;
            }
            if (e == EEXIST)
                s = kvq_fail(err, KVQ_EIO, "%s: appeared meanwhile; not overwritten (use --force to replace it)", path);
            else if (e)
                s = kvq_fail(err, KVQ_EIO, "%s: cannot move %s into place: %s", path, tmp, strerror(e));
        }
        unlink(tmp); /* after link (or a failed move); after a rename it is already gone */
    }
    free(tmp);
    return s;
}
