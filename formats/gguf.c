/* gguf.c — GGUF reader; see gguf.h. */
#include "gguf.h"
#include "sniff.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAX_DIMS 4

/* Sanity caps: reject absurd counts before allocating for them. */
#define GGUF_MAX_KV      (1u << 20)
#define GGUF_MAX_TENSORS (1u << 20)

typedef struct {
    const kvq_gguf *g;
    size_t pos;
} cursor;

static kvq_status need(cursor *c, size_t n, const char *what, kvq_err *err)
{
    if (n > c->g->size || c->pos > c->g->size - n)
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: truncated at offset %zu reading %s: need %zu bytes, file has %zu",
                        c->g->path, c->pos, what, n, c->g->size);
    return KVQ_OK;
}

static kvq_status rd(cursor *c, void *dst, size_t n, const char *what, kvq_err *err)
{
    KVQ_TRY(need(c, n, what, err));
    memcpy(dst, c->g->map + c->pos, n);
    c->pos += n;
    return KVQ_OK;
}

static kvq_status rd_u32(cursor *c, uint32_t *v, const char *what, kvq_err *err) { return rd(c, v, 4, what, err); }
static kvq_status rd_u64(cursor *c, uint64_t *v, const char *what, kvq_err *err) { return rd(c, v, 8, what, err); }

static kvq_status rd_str(cursor *c, kvq_gguf_str *s, const char *what, kvq_err *err)
{
    uint64_t len;
    size_t at = c->pos;
    KVQ_TRY(rd_u64(c, &len, what, err));
    if (len > c->g->size)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: string length %llu exceeds file size %zu",
                        c->g->path, at, what, (unsigned long long)len, c->g->size);
    KVQ_TRY(need(c, (size_t)len, what, err));
    s->str = (const char *)c->g->map + c->pos;
    s->len = len;
    c->pos += (size_t)len;
    return KVQ_OK;
}

static const size_t type_size[KVQ_GGUF_NTYPES] = {
    [KVQ_GGUF_UINT8] = 1, [KVQ_GGUF_INT8] = 1, [KVQ_GGUF_UINT16] = 2, [KVQ_GGUF_INT16] = 2,
    [KVQ_GGUF_UINT32] = 4, [KVQ_GGUF_INT32] = 4, [KVQ_GGUF_FLOAT32] = 4, [KVQ_GGUF_BOOL] = 1,
    [KVQ_GGUF_STRING] = 0, [KVQ_GGUF_ARRAY] = 0, [KVQ_GGUF_UINT64] = 8, [KVQ_GGUF_INT64] = 8,
    [KVQ_GGUF_FLOAT64] = 8,
};

const char *kvq_gguf_type_name(kvq_gguf_type t)
{
    static const char *names[KVQ_GGUF_NTYPES] = {
        "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
        "string", "array", "uint64", "int64", "float64"};
    return (unsigned)t < KVQ_GGUF_NTYPES ? names[t] : "invalid";
}

/* Decode one little-endian scalar of type t at p into kv->v. */
static void scalar_from(kvq_gguf_kv *kv, kvq_gguf_type t, const uint8_t *p)
{
    switch (t) {
    case KVQ_GGUF_UINT8: kv->v.u = p[0]; break;
    case KVQ_GGUF_INT8: kv->v.i = (int8_t)p[0]; break;
    case KVQ_GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); kv->v.u = x; } break;
    case KVQ_GGUF_INT16: { int16_t x; memcpy(&x, p, 2); kv->v.i = x; } break;
    case KVQ_GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); kv->v.u = x; } break;
    case KVQ_GGUF_INT32: { int32_t x; memcpy(&x, p, 4); kv->v.i = x; } break;
    case KVQ_GGUF_FLOAT32: { float x; memcpy(&x, p, 4); kv->v.f = x; } break;
    case KVQ_GGUF_BOOL: kv->v.b = p[0] != 0; break;
    case KVQ_GGUF_UINT64: { uint64_t x; memcpy(&x, p, 8); kv->v.u = x; } break;
    case KVQ_GGUF_INT64: { int64_t x; memcpy(&x, p, 8); kv->v.i = x; } break;
    case KVQ_GGUF_FLOAT64: { double x; memcpy(&x, p, 8); kv->v.f = x; } break;
    default: break;
    }
}

static kvq_status read_kv(cursor *c, kvq_gguf_kv *kv, uint64_t idx, kvq_err *err)
{
    char what[96];
    snprintf(what, sizeof what, "metadata key #%llu", (unsigned long long)idx);
    KVQ_TRY(rd_str(c, &kv->key, what, err));
    char kname[160];
    snprintf(kname, sizeof kname, "metadata '%.*s'", (int)(kv->key.len < 120 ? kv->key.len : 120), kv->key.str);
    uint32_t t;
    size_t at = c->pos;
    KVQ_TRY(rd_u32(c, &t, kname, err));
    if (t >= KVQ_GGUF_NTYPES)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: value type %u is not a GGUF type (expected 0..12)",
                        c->g->path, at, kname, t);
    kv->type = (kvq_gguf_type)t;
    if (t == KVQ_GGUF_STRING) return rd_str(c, &kv->s, kname, err);
    if (t != KVQ_GGUF_ARRAY) {
        KVQ_TRY(need(c, type_size[t], kname, err));
        scalar_from(kv, kv->type, c->g->map + c->pos);
        c->pos += type_size[t];
        return KVQ_OK;
    }
    uint32_t et;
    at = c->pos;
    KVQ_TRY(rd_u32(c, &et, kname, err));
    if (et >= KVQ_GGUF_NTYPES || et == KVQ_GGUF_ARRAY)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: array element type %u invalid (expected a scalar or string type)",
                        c->g->path, at, kname, et);
    kv->arr_type = (kvq_gguf_type)et;
    at = c->pos;
    KVQ_TRY(rd_u64(c, &kv->arr_n, kname, err));
    if (et != KVQ_GGUF_STRING) {
        size_t nb;
        if (kv->arr_n > c->g->size || kvq_mul_size((size_t)kv->arr_n, type_size[et], &nb))
            return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: array of %llu %s exceeds file size %zu",
                            c->g->path, at, kname, (unsigned long long)kv->arr_n, kvq_gguf_type_name(kv->arr_type), c->g->size);
        KVQ_TRY(need(c, nb, kname, err));
        kv->arr_data = c->g->map + c->pos;
        c->pos += nb;
        return KVQ_OK;
    }
    /* each string needs at least 8 bytes: bound the count before allocating */
    if (kv->arr_n > (c->g->size - c->pos) / 8)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: array of %llu strings cannot fit in the %zu bytes left",
                        c->g->path, at, kname, (unsigned long long)kv->arr_n, c->g->size - c->pos);
    kv->arr_str = calloc(kv->arr_n ? (size_t)kv->arr_n : 1, sizeof *kv->arr_str);
    if (!kv->arr_str) return kvq_fail(err, KVQ_ENOMEM, "%s: %s: cannot allocate index of %llu strings", c->g->path, kname, (unsigned long long)kv->arr_n);
    for (uint64_t i = 0; i < kv->arr_n; i++) KVQ_TRY(rd_str(c, &kv->arr_str[i], kname, err));
    return KVQ_OK;
}

bool kvq_ggml_type_info(kvq_ggml_type t, uint32_t *block_elems, uint32_t *block_bytes, const char **name)
{
    uint32_t be, bb;
    const char *n;
    switch (t) {
    case KVQ_GGML_F32: be = 1; bb = 4; n = "F32"; break;
    case KVQ_GGML_F16: be = 1; bb = 2; n = "F16"; break;
    case KVQ_GGML_BF16: be = 1; bb = 2; n = "BF16"; break;
    case KVQ_GGML_Q4_0: be = 32; bb = 18; n = "Q4_0"; break;
    case KVQ_GGML_Q4_1: be = 32; bb = 20; n = "Q4_1"; break;
    case KVQ_GGML_Q5_0: be = 32; bb = 22; n = "Q5_0"; break;
    case KVQ_GGML_Q5_1: be = 32; bb = 24; n = "Q5_1"; break;
    case KVQ_GGML_Q8_0: be = 32; bb = 34; n = "Q8_0"; break;
    case KVQ_GGML_Q8_1: be = 32; bb = 36; n = "Q8_1"; break;
    case KVQ_GGML_Q2_K: be = 256; bb = 84; n = "Q2_K"; break;
    case KVQ_GGML_Q3_K: be = 256; bb = 110; n = "Q3_K"; break;
    case KVQ_GGML_Q4_K: be = 256; bb = 144; n = "Q4_K"; break;
    case KVQ_GGML_Q5_K: be = 256; bb = 176; n = "Q5_K"; break;
    case KVQ_GGML_Q6_K: be = 256; bb = 210; n = "Q6_K"; break;
    case KVQ_GGML_Q8_K: be = 256; bb = 292; n = "Q8_K"; break;
    case KVQ_GGML_IQ4_NL: be = 32; bb = 18; n = "IQ4_NL"; break;
    default: return false;
    }
    if (block_elems) *block_elems = be;
    if (block_bytes) *block_bytes = bb;
    if (name) *name = n;
    return true;
}

static kvq_status read_tensor_info(cursor *c, kvq_gguf_tensor *t, uint64_t idx, kvq_err *err)
{
    char what[64];
    snprintf(what, sizeof what, "tensor info #%llu", (unsigned long long)idx);
    KVQ_TRY(rd_str(c, &t->name, what, err));
    char tn[192];
    snprintf(tn, sizeof tn, "tensor '%.*s'", (int)(t->name.len < 150 ? t->name.len : 150), t->name.str);
    size_t at = c->pos;
    KVQ_TRY(rd_u32(c, &t->n_dims, tn, err));
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: n_dims %u (expected 1..%d)", c->g->path, at, tn, t->n_dims, GGUF_MAX_DIMS);
    uint64_t nel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        at = c->pos;
        KVQ_TRY(rd_u64(c, &t->ne[d], tn, err));
        size_t tmp;
        if (t->ne[d] == 0 || t->ne[d] > INT64_MAX || kvq_mul_size((size_t)nel, (size_t)t->ne[d], &tmp) || tmp > INT64_MAX)
            return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: dimension %u = %llu is zero or makes the element count overflow",
                            c->g->path, at, tn, d, (unsigned long long)t->ne[d]);
        nel = tmp;
    }
    t->n_elements = nel;
    uint32_t ty;
    at = c->pos;
    KVQ_TRY(rd_u32(c, &ty, tn, err));
    t->type = (kvq_ggml_type)ty;
    uint32_t be, bb;
    const char *name;
    if (ty > 255)
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: %s: ggml type %u is not a ggml type id", c->g->path, at, tn, ty);
    if (!kvq_ggml_type_info(t->type, &be, &bb, &name)) {
        /* A type kvq cannot size (e.g. IQ quants): the metadata (tokenizer)
         * stays readable; the tensor has n_bytes 0 and data NULL, and
         * dequantizing it reports the type as unsupported. */
        t->n_bytes = 0;
        t->size_known = false;
        return rd_u64(c, &t->offset, tn, err);
    }
    t->size_known = true;
    if (t->ne[0] % be)
        return kvq_fail(err, KVQ_EFORMAT, "%s: %s: row length %llu is not a multiple of the %s block size %u",
                        c->g->path, tn, (unsigned long long)t->ne[0], name, be);
    size_t nb;
    if (kvq_mul_size((size_t)(nel / be), bb, &nb))
        return kvq_fail(err, KVQ_EFORMAT, "%s: %s: byte size overflows", c->g->path, tn);
    t->n_bytes = nb;
    return rd_u64(c, &t->offset, tn, err);
}

kvq_status kvq_gguf_open(const char *path, kvq_gguf *g, kvq_err *err)
{
    memset(g, 0, sizeof *g);
    snprintf(g->path, sizeof g->path, "%s", path);
    int fd;
    KVQ_TRY(kvq_open_regular(path, "a GGUF file", &fd, err));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvq_fail(err, KVQ_EIO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (st.st_size < 24) {
        close(fd);
        return kvq_fail(err, KVQ_EFORMAT, "%s: file is %lld bytes, too short for a GGUF header (24 bytes)", path, (long long)st.st_size);
    }
    g->size = (size_t)st.st_size;
    void *m = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return kvq_fail(err, KVQ_EIO, "%s: mmap failed: %s", path, strerror(errno));
    g->map = m;

    kvq_status s = KVQ_OK;
    cursor c = {g, 0};
    char magic[4];
    if ((s = rd(&c, magic, 4, "magic", err))) goto fail;
    if (memcmp(magic, "GGUF", 4) != 0) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 0: magic: expected \"GGUF\", found %02x %02x %02x %02x: it is %s, not a GGUF file",
                     path, (uint8_t)magic[0], (uint8_t)magic[1], (uint8_t)magic[2], (uint8_t)magic[3],
                     kvq_kind_desc(kvq_sniff(g->map, g->size < 65536 ? g->size : 65536, g->size)));
        goto fail;
    }
    if ((s = rd_u32(&c, &g->version, "version", err))) goto fail;
    if (g->version != 2 && g->version != 3) {
        s = kvq_fail(err, KVQ_EUNSUPPORTED, "%s: offset 4: version: expected 2 or 3, found %u", path, g->version);
        goto fail;
    }
    if ((s = rd_u64(&c, &g->n_tensors, "tensor_count", err))) goto fail;
    if ((s = rd_u64(&c, &g->n_kv, "metadata_kv_count", err))) goto fail;
    if (g->n_tensors > GGUF_MAX_TENSORS || g->n_tensors > g->size / 24) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 8: tensor_count %llu is implausible for a %zu-byte file",
                     path, (unsigned long long)g->n_tensors, g->size);
        goto fail;
    }
    if (g->n_kv > GGUF_MAX_KV || g->n_kv > g->size / 13) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 16: metadata_kv_count %llu is implausible for a %zu-byte file",
                     path, (unsigned long long)g->n_kv, g->size);
        goto fail;
    }
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %llu metadata entries / %llu tensor infos", path,
                     (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors);
        goto fail;
    }
    for (uint64_t i = 0; i < g->n_kv; i++)
        if ((s = read_kv(&c, &g->kv[i], i, err))) goto fail;
    g->alignment = 32;
    const kvq_gguf_kv *al = kvq_gguf_find(g, "general.alignment");
    if (al) {
        if (al->type != KVQ_GGUF_UINT32 || al->v.u == 0 || (al->v.u & (al->v.u - 1))) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'general.alignment': expected a uint32 power of two, found %s %llu",
                         path, kvq_gguf_type_name(al->type), (unsigned long long)al->v.u);
            goto fail;
        }
        g->alignment = al->v.u;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((s = read_tensor_info(&c, &g->tensors[i], i, err))) goto fail;
    uint64_t data = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    g->data_offset = data;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvq_gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%.*s': offset %llu is not a multiple of the alignment %llu",
                         path, (int)t->name.len, t->name.str, (unsigned long long)t->offset, (unsigned long long)g->alignment);
            goto fail;
        }
        if (data > g->size || t->offset > g->size - data || t->n_bytes > g->size - data - t->offset) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%.*s': data at offset %llu + %llu bytes exceeds file size %zu",
                         path, (int)t->name.len, t->name.str, (unsigned long long)(data + t->offset),
                         (unsigned long long)t->n_bytes, g->size);
            goto fail;
        }
        t->data = t->size_known ? g->map + data + t->offset : NULL;
    }
    return KVQ_OK;
fail:
    kvq_gguf_close(g);
    return s;
}

void kvq_gguf_close(kvq_gguf *g)
{
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) free(g->kv[i].arr_str);
    free(g->kv);
    free(g->tensors);
    if (g->map) munmap((void *)g->map, g->size);
    g->kv = NULL;
    g->tensors = NULL;
    g->map = NULL;
}

bool kvq_gguf_str_eq(kvq_gguf_str s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && memcmp(s.str, c, n) == 0;
}

const kvq_gguf_kv *kvq_gguf_find(const kvq_gguf *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (kvq_gguf_str_eq(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

const kvq_gguf_tensor *kvq_gguf_find_tensor(const kvq_gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (kvq_gguf_str_eq(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}

static kvq_status lookup(const kvq_gguf *g, const char *key, bool required, const kvq_gguf_kv **kv, kvq_err *err)
{
    *kv = kvq_gguf_find(g, key);
    if (!*kv && required)
        return kvq_fail(err, KVQ_EFORMAT, "%s: required metadata key '%s' is missing", g->path, key);
    return KVQ_OK;
}

static kvq_status wrong_type(const kvq_gguf *g, const char *key, const char *expected, kvq_gguf_type found, kvq_err *err)
{
    return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected %s, found %s", g->path, key, expected, kvq_gguf_type_name(found));
}

static bool is_signed(kvq_gguf_type t) { return t == KVQ_GGUF_INT8 || t == KVQ_GGUF_INT16 || t == KVQ_GGUF_INT32 || t == KVQ_GGUF_INT64; }
static bool is_unsigned(kvq_gguf_type t) { return t == KVQ_GGUF_UINT8 || t == KVQ_GGUF_UINT16 || t == KVQ_GGUF_UINT32 || t == KVQ_GGUF_UINT64; }

kvq_status kvq_gguf_get_int(const kvq_gguf *g, const char *key, bool required, int64_t *out, kvq_err *err)
{
    const kvq_gguf_kv *kv;
    KVQ_TRY(lookup(g, key, required, &kv, err));
    if (!kv) return KVQ_OK;
    if (is_signed(kv->type)) { *out = kv->v.i; return KVQ_OK; }
    if (is_unsigned(kv->type)) {
        if (kv->v.u > INT64_MAX) return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': value %llu out of range", g->path, key, (unsigned long long)kv->v.u);
        *out = (int64_t)kv->v.u;
        return KVQ_OK;
    }
    return wrong_type(g, key, "an integer", kv->type, err);
}

kvq_status kvq_gguf_get_float(const kvq_gguf *g, const char *key, bool required, double *out, kvq_err *err)
{
    const kvq_gguf_kv *kv;
    KVQ_TRY(lookup(g, key, required, &kv, err));
    if (!kv) return KVQ_OK;
    if (kv->type == KVQ_GGUF_FLOAT32 || kv->type == KVQ_GGUF_FLOAT64) *out = kv->v.f;
    else if (is_signed(kv->type)) *out = (double)kv->v.i;
    else if (is_unsigned(kv->type)) *out = (double)kv->v.u;
    else return wrong_type(g, key, "a number", kv->type, err);
    return KVQ_OK;
}

kvq_status kvq_gguf_get_bool(const kvq_gguf *g, const char *key, bool required, bool *out, kvq_err *err)
{
    const kvq_gguf_kv *kv;
    KVQ_TRY(lookup(g, key, required, &kv, err));
    if (!kv) return KVQ_OK;
    if (kv->type != KVQ_GGUF_BOOL) return wrong_type(g, key, "bool", kv->type, err);
    *out = kv->v.b;
    return KVQ_OK;
}

kvq_status kvq_gguf_get_str(const kvq_gguf *g, const char *key, bool required, kvq_gguf_str *out, kvq_err *err)
{
    const kvq_gguf_kv *kv;
    KVQ_TRY(lookup(g, key, required, &kv, err));
    if (!kv) return KVQ_OK;
    if (kv->type != KVQ_GGUF_STRING) return wrong_type(g, key, "string", kv->type, err);
    *out = kv->s;
    return KVQ_OK;
}

kvq_status kvq_gguf_get_arr(const kvq_gguf *g, const char *key, kvq_gguf_type elem_type, const kvq_gguf_kv **out, kvq_err *err)
{
    const kvq_gguf_kv *kv;
    KVQ_TRY(lookup(g, key, true, &kv, err));
    if (kv->type != KVQ_GGUF_ARRAY) return wrong_type(g, key, "array", kv->type, err);
    if (kv->arr_type != elem_type)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected array of %s, found array of %s", g->path, key,
                        kvq_gguf_type_name(elem_type), kvq_gguf_type_name(kv->arr_type));
    *out = kv;
    return KVQ_OK;
}

double kvq_gguf_arr_float(const kvq_gguf_kv *kv, uint64_t i)
{
    kvq_gguf_kv tmp = {0};
    scalar_from(&tmp, kv->arr_type, kv->arr_data + i * type_size[kv->arr_type]);
    if (kv->arr_type == KVQ_GGUF_FLOAT32 || kv->arr_type == KVQ_GGUF_FLOAT64) return tmp.v.f;
    if (is_signed(kv->arr_type)) return (double)tmp.v.i;
    if (kv->arr_type == KVQ_GGUF_BOOL) return tmp.v.b;
    return (double)tmp.v.u;
}

int64_t kvq_gguf_arr_int(const kvq_gguf_kv *kv, uint64_t i)
{
    kvq_gguf_kv tmp = {0};
    scalar_from(&tmp, kv->arr_type, kv->arr_data + i * type_size[kv->arr_type]);
    if (is_signed(kv->arr_type)) return tmp.v.i;
    if (kv->arr_type == KVQ_GGUF_FLOAT32 || kv->arr_type == KVQ_GGUF_FLOAT64) return (int64_t)tmp.v.f;
    if (kv->arr_type == KVQ_GGUF_BOOL) return tmp.v.b;
    return (int64_t)tmp.v.u;
}

void kvq_gguf_release(const kvq_gguf *g, const kvq_gguf_tensor *t)
{
    /* whole pages inside the tensor's bytes only: neighbours keep theirs */
    if (!t->data || !t->n_bytes) return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), lo = ((uintptr_t)t->data + pg - 1) / pg * pg,
                    hi = ((uintptr_t)t->data + t->n_bytes) / pg * pg;
    (void)g;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
