/* safetensors.c — safetensors reader/writer; see safetensors.h. */
#include "safetensors.h"
#include "half.h"
#include "sniff.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvq safetensors I/O assumes a little-endian host");

static const struct { const char *name; size_t size; } dtypes[KVQ_ST_NDTYPES] = {
    [KVQ_ST_BOOL] = {"BOOL", 1},       [KVQ_ST_U8] = {"U8", 1},     [KVQ_ST_I8] = {"I8", 1},
    [KVQ_ST_F8_E5M2] = {"F8_E5M2", 1}, [KVQ_ST_F8_E4M3] = {"F8_E4M3", 1},
    [KVQ_ST_I16] = {"I16", 2},         [KVQ_ST_U16] = {"U16", 2},   [KVQ_ST_F16] = {"F16", 2},
    [KVQ_ST_BF16] = {"BF16", 2},       [KVQ_ST_I32] = {"I32", 4},   [KVQ_ST_U32] = {"U32", 4},
    [KVQ_ST_F32] = {"F32", 4},         [KVQ_ST_F64] = {"F64", 8},   [KVQ_ST_I64] = {"I64", 8},
    [KVQ_ST_U64] = {"U64", 8},
};

const char *kvq_st_dtype_name(kvq_st_dtype d)
{
    return (unsigned)d < KVQ_ST_NDTYPES ? dtypes[d].name : NULL;
}

size_t kvq_st_dtype_size(kvq_st_dtype d)
{
    return (unsigned)d < KVQ_ST_NDTYPES ? dtypes[d].size : 0;
}

kvq_st_dtype kvq_st_dtype_parse(const char *s)
{
    for (int i = 0; i < KVQ_ST_NDTYPES; i++)
        if (s && strcmp(s, dtypes[i].name) == 0) return (kvq_st_dtype)i;
    return KVQ_ST_NDTYPES;
}

/* ---- half conversions ---------------------------------------------------- */

/* ---- reader --------------------------------------------------------------- */

void kvq_safetensors_close(kvq_safetensors *st)
{
    if (!st) return;
    for (size_t i = 0; i < st->n_tensors; i++) free(st->tensors[i].name);
    for (size_t i = 0; i < st->n_meta; i++) { free(st->meta[i].key); free(st->meta[i].value); }
    free(st->tensors);
    free(st->meta);
    if (st->map) munmap((void *)st->map, st->size);
    st->map = NULL;
    st->tensors = NULL;
    st->meta = NULL;
    st->n_tensors = st->n_meta = 0;
}

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* A JSON number that is a non-negative integer exactly representable (< 2^53). */
static int json_u64(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j)) return 0;
    double v = j->valuedouble;
    if (!(v >= 0) || v > 9007199254740992.0 || v != floor(v)) return 0;
    *out = (uint64_t)v;
    return 1;
}

static int cmp_begin(const void *a, const void *b)
{
    const kvq_st_tensor *x = *(const kvq_st_tensor *const *)a, *y = *(const kvq_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_name(const void *a, const void *b)
{
    const kvq_st_tensor *x = *(const kvq_st_tensor *const *)a, *y = *(const kvq_st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static kvq_status parse_tensor(kvq_safetensors *st, const cJSON *item, kvq_st_tensor *t,
                               uint64_t data_size, kvq_err *err)
{
    const char *p = st->path, *nm = item->string;
    if (!cJSON_IsObject(item))
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': expected an object, found another JSON type", p, nm);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsString(jd))
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'dtype': expected a string, found %s", p, nm,
                        jd ? "another JSON type" : "nothing");
    t->dtype = kvq_st_dtype_parse(jd->valuestring);
    if (t->dtype == KVQ_ST_NDTYPES)
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'dtype': unknown dtype \"%s\"", p, nm,
                        jd->valuestring);
    if (!cJSON_IsArray(js))
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'shape': expected an array, found %s", p, nm,
                        js ? "another JSON type" : "nothing");
    int nd = cJSON_GetArraySize(js);
    if (nd > KVQ_ST_MAX_DIMS)
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'shape': %d dimensions, at most %d supported",
                        p, nm, nd, KVQ_ST_MAX_DIMS);
    t->n_dims = (uint32_t)nd;
    uint64_t n_el = 1;
    int i = 0;
    for (const cJSON *d = js->child; d; d = d->next, i++) {
        uint64_t v;
        if (!json_u64(d, &v))
            return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'shape'[%d]: expected a non-negative integer",
                            p, nm, i);
        t->shape[i] = v;
        size_t prod;
        if (v > SIZE_MAX || kvq_mul_size((size_t)n_el, (size_t)v, &prod))
            return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': field 'shape': element count overflows", p, nm);
        n_el = prod;
    }
    t->n_elements = n_el;
    size_t nb;
    if (kvq_mul_size((size_t)n_el, kvq_st_dtype_size(t->dtype), &nb))
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': byte size overflows", p, nm);
    t->n_bytes = nb;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_u64(jo->child, &t->begin) ||
        !json_u64(jo->child->next, &t->end))
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: header: tensor '%s': field 'data_offsets': expected [begin, end] non-negative integers", p, nm);
    if (t->end < t->begin)
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: tensor '%s': data_offsets [%llu, %llu]: end before begin", p, nm,
                        (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_size)
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: tensor '%s': data_offsets end %llu exceeds the data buffer (%llu bytes; file truncated?)", p,
                        nm, (unsigned long long)t->end, (unsigned long long)data_size);
    if (t->end - t->begin != t->n_bytes)
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: tensor '%s': data_offsets span %llu bytes, but dtype %s x %llu elements needs %llu", p, nm,
                        (unsigned long long)(t->end - t->begin), jd->valuestring, (unsigned long long)n_el,
                        (unsigned long long)t->n_bytes);
    t->data = st->map + st->data_offset + t->begin;
    return KVQ_OK;
}

static kvq_status parse_header(kvq_safetensors *st, kvq_err *err)
{
    const char *p = st->path;
    const char *hdr = (const char *)st->map + 8;
    size_t hlen = (size_t)st->header_len;
    if (hlen == 0 || hdr[0] != '{')
        return kvq_fail(err, KVQ_EFORMAT, "%s: header at offset 8: expected a JSON object starting with '{'", p);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, hlen, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        size_t at = end ? (size_t)(end - hdr) : 0;
        cJSON_Delete(root);
        return kvq_fail(err, KVQ_EFORMAT, "%s: header (%zu bytes at offset 8): invalid JSON near header byte %zu", p, hlen,
                        at);
    }
    for (const char *q = end; q < hdr + hlen; q++) {
        if (*q != ' ' && *q != '\n' && *q != '\r' && *q != '\t') {
            cJSON_Delete(root);
            return kvq_fail(err, KVQ_EFORMAT, "%s: header: unexpected byte 0x%02x after the JSON object at header byte %zu",
                            p, (unsigned char)*q, (size_t)(q - hdr));
        }
    }
    uint64_t data_size = st->size - st->data_offset;
    size_t n_items = (size_t)cJSON_GetArraySize(root);
    kvq_status s = KVQ_OK;
    st->tensors = calloc(n_items ? n_items : 1, sizeof *st->tensors);
    if (!st->tensors) { cJSON_Delete(root); return kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", p); }
    for (const cJSON *it = root->child; it && s == KVQ_OK; it = it->next) {
        if (!it->string) { s = kvq_fail(err, KVQ_EFORMAT, "%s: header: member without a name", p); break; }
        if (strcmp(it->string, "__metadata__") == 0) {
            if (st->meta) { s = kvq_fail(err, KVQ_EFORMAT, "%s: header: duplicate '__metadata__'", p); break; }
            if (!cJSON_IsObject(it)) {
                s = kvq_fail(err, KVQ_EFORMAT, "%s: header: '__metadata__': expected an object of strings", p);
                break;
            }
            size_t nm = (size_t)cJSON_GetArraySize(it);
            st->meta = calloc(nm ? nm : 1, sizeof *st->meta);
            if (!st->meta) { s = kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", p); break; }
            for (const cJSON *m = it->child; m; m = m->next) {
                if (!cJSON_IsString(m)) {
                    s = kvq_fail(err, KVQ_EFORMAT, "%s: header: '__metadata__'.'%s': expected a string value", p,
                                 m->string ? m->string : "?");
                    break;
                }
                for (size_t j = 0; j < st->n_meta; j++)
                    if (strcmp(st->meta[j].key, m->string) == 0) {
                        s = kvq_fail(err, KVQ_EFORMAT, "%s: header: '__metadata__': duplicate key '%s'", p, m->string);
                        break;
                    }
                if (s != KVQ_OK) break;
                kvq_st_meta *mm = &st->meta[st->n_meta];
                mm->key = dupstr(m->string);
                mm->value = dupstr(m->valuestring);
                st->n_meta++;
                if (!mm->key || !mm->value) { s = kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", p); break; }
            }
            continue;
        }
        kvq_st_tensor *t = &st->tensors[st->n_tensors];
        if (!(t->name = dupstr(it->string))) { s = kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", p); break; }
        st->n_tensors++;
        s = parse_tensor(st, it, t, data_size, err);
    }
    cJSON_Delete(root);
    if (s != KVQ_OK) return s;

    /* names unique; tensors tile the data buffer */
    kvq_st_tensor **ix = malloc((st->n_tensors ? st->n_tensors : 1) * sizeof *ix);
    if (!ix) return kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", p);
    for (size_t i = 0; i < st->n_tensors; i++) ix[i] = &st->tensors[i];
    qsort(ix, st->n_tensors, sizeof *ix, cmp_name);
    for (size_t i = 1; i < st->n_tensors; i++)
        if (strcmp(ix[i - 1]->name, ix[i]->name) == 0) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: header: duplicate tensor name '%s'", p, ix[i]->name);
            break;
        }
    if (s == KVQ_OK) {
        qsort(ix, st->n_tensors, sizeof *ix, cmp_begin);
        uint64_t at = 0;
        for (size_t i = 0; i < st->n_tensors && s == KVQ_OK; i++) {
            if (ix[i]->begin != at)
                s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': data_offsets begin %llu, expected %llu (%s)", p,
                             ix[i]->name, (unsigned long long)ix[i]->begin, (unsigned long long)at,
                             ix[i]->begin < at ? "overlaps the previous tensor" : "leaves a gap");
            at = ix[i]->end;
        }
        if (s == KVQ_OK && at != data_size)
            s = kvq_fail(err, KVQ_EFORMAT,
                         "%s: data buffer is %llu bytes but the tensors cover %llu (trailing bytes or truncated header)",
                         p, (unsigned long long)data_size, (unsigned long long)at);
    }
    free(ix);
    return s;
}

kvq_status kvq_safetensors_open(const char *path, kvq_safetensors *st, kvq_err *err)
{
    memset(st, 0, sizeof *st);
    snprintf(st->path, sizeof st->path, "%s", path);
    int fd;
    KVQ_TRY(kvq_open_regular(path, "a safetensors file", &fd, err));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return kvq_fail(err, KVQ_EIO, "%s: stat failed: %s", path, strerror(e));
    }
    if (sb.st_size < 8) {
        close(fd);
        return kvq_fail(err, KVQ_EFORMAT, "%s: file is %lld bytes, shorter than the 8-byte header length field", path,
                        (long long)sb.st_size);
    }
    st->size = (size_t)sb.st_size;
    void *m = mmap(NULL, st->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return kvq_fail(err, KVQ_EIO, "%s: mmap failed: %s", path, strerror(errno));
    st->map = m;
    uint64_t hl;
    memcpy(&hl, st->map, 8);
    st->header_len = hl;
    kvq_status s = KVQ_OK;
    const kvq_file_kind kind = kvq_sniff(st->map, st->size < 65536 ? st->size : 65536, st->size);
    if ((hl > KVQ_ST_MAX_HEADER || hl > st->size - 8 || (st->size > 8 && st->map[8] != '{')) && kind != KVQ_KIND_SAFETENSORS &&
        kind != KVQ_KIND_ARTIFACT && kind != KVQ_KIND_BINARY) /* (an HDF5 dump read as a 7e17-byte header length) */
        s = kvq_fail(err, KVQ_EFORMAT, "%s: it is %s, not a safetensors file (an 8-byte header length, then a JSON header)",
                     path, kvq_kind_desc(kind));
    else if (hl > KVQ_ST_MAX_HEADER)
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 0: header length %llu exceeds the %u-byte limit (corrupt file?)", path,
                     (unsigned long long)hl, KVQ_ST_MAX_HEADER);
    else if (hl > st->size - 8)
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 0: header length %llu exceeds the %zu bytes after it (truncated?)",
                     path, (unsigned long long)hl, st->size - 8);
    if (s == KVQ_OK) {
        st->data_offset = 8 + (size_t)hl;
        s = parse_header(st, err);
    }
    if (s != KVQ_OK) kvq_safetensors_close(st);
    return s;
}

const kvq_st_tensor *kvq_safetensors_find(const kvq_safetensors *st, const char *name)
{
    for (size_t i = 0; i < st->n_tensors; i++)
        if (strcmp(st->tensors[i].name, name) == 0) return &st->tensors[i];
    return NULL;
}

const char *kvq_safetensors_meta(const kvq_safetensors *st, const char *key)
{
    for (size_t i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta[i].key, key) == 0) return st->meta[i].value;
    return NULL;
}

kvq_status kvq_safetensors_read_f32(const kvq_safetensors *st, const kvq_st_tensor *t, float *out, size_t n_out,
                                    kvq_err *err)
{
    if (n_out != t->n_elements)
        return kvq_fail(err, KVQ_EINVAL, "%s: tensor '%s': has %llu elements, caller expects %zu", st->path, t->name,
                        (unsigned long long)t->n_elements, n_out);
    const uint8_t *d = t->data;
    switch (t->dtype) {
    case KVQ_ST_F32: memcpy(out, d, n_out * 4); break;
    case KVQ_ST_F64:
        for (size_t i = 0; i < n_out; i++) { double v; memcpy(&v, d + 8 * i, 8); out[i] = (float)v; }
        break;
    case KVQ_ST_F16:
        for (size_t i = 0; i < n_out; i++) { uint16_t h; memcpy(&h, d + 2 * i, 2); out[i] = kvq_f16_to_f32(h); }
        break;
    case KVQ_ST_BF16:
        for (size_t i = 0; i < n_out; i++) { uint16_t h; memcpy(&h, d + 2 * i, 2); out[i] = kvq_bf16_to_f32(h); }
        break;
    default:
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': dtype %s, expected F64/F32/F16/BF16", st->path, t->name,
                        kvq_st_dtype_name(t->dtype));
    }
    return KVQ_OK;
}

/* ---- writer ---------------------------------------------------------------- */

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1) {
            if (nc > SIZE_MAX / 2) { b->oom = 1; return; }
            nc *= 2;
        }
        char *np = realloc(b->p, nc);
        if (!np) { b->oom = 1; return; }
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_str(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        char tmp[8];
        if (*c == '"') sb_put(b, "\\\"", 2);
        else if (*c == '\\') sb_put(b, "\\\\", 2);
        else if (*c == '\n') sb_put(b, "\\n", 2);
        else if (*c == '\t') sb_put(b, "\\t", 2);
        else if (*c < 0x20) { snprintf(tmp, sizeof tmp, "\\u%04x", *c); sb_put(b, tmp, 6); }
        else sb_put(b, (const char *)c, 1);
    }
    sb_put(b, "\"", 1);
}

static int cmp_entry(const void *a, const void *b)
{
    /* the reference writer's order: dtype descending in its enum order (which
     * kvq_st_dtype mirrors, so wider types come first), then name */
    const kvq_st_entry *x = *(const kvq_st_entry *const *)a, *y = *(const kvq_st_entry *const *)b;
    if (x->dtype != y->dtype) return x->dtype > y->dtype ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_kv(const void *a, const void *b)
{
    const kvq_st_kv *x = *(const kvq_st_kv *const *)a, *y = *(const kvq_st_kv *const *)b;
    return strcmp(x->key, y->key);
}

kvq_status kvq_safetensors_write(const char *path, const kvq_st_entry *tensors, size_t n_tensors,
                                 const kvq_st_kv *meta, size_t n_meta, kvq_err *err)
{
    kvq_status s = KVQ_OK;
    const kvq_st_entry **te = calloc(n_tensors ? n_tensors : 1, sizeof *te);
    const kvq_st_kv **mk = calloc(n_meta ? n_meta : 1, sizeof *mk);
    uint64_t *nbytes = calloc(n_tensors ? n_tensors : 1, sizeof *nbytes);
    sbuf h = {0};
    char *tmp = NULL;
    FILE *f = NULL;
    if (!te || !mk || !nbytes) { s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); goto done; }
    for (size_t i = 0; i < n_tensors; i++) {
        const kvq_st_entry *e = &tensors[i];
        if (!e->name || !*e->name || strcmp(e->name, "__metadata__") == 0) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: tensor %zu: invalid name '%s'", path, i, e->name ? e->name : "(null)");
            goto done;
        }
        if (!kvq_st_dtype_size(e->dtype)) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: tensor '%s': invalid dtype %d", path, e->name, (int)e->dtype);
            goto done;
        }
        if (e->n_dims > KVQ_ST_MAX_DIMS) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: tensor '%s': %u dimensions, at most %d", path, e->name, e->n_dims,
                         KVQ_ST_MAX_DIMS);
            goto done;
        }
        size_t n = kvq_st_dtype_size(e->dtype);
        for (uint32_t d = 0; d < e->n_dims; d++)
            if (e->shape[d] > SIZE_MAX || kvq_mul_size(n, (size_t)e->shape[d], &n)) {
                s = kvq_fail(err, KVQ_EINVAL, "%s: tensor '%s': byte size overflows", path, e->name);
                goto done;
            }
        if (n && !e->data) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: tensor '%s': NULL data for %zu bytes", path, e->name, n);
            goto done;
        }
        te[i] = e;
    }
    for (size_t i = 0; i < n_meta; i++) {
        if (!meta[i].key || !meta[i].value) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: metadata entry %zu: NULL key or value", path, i);
            goto done;
        }
        mk[i] = &meta[i];
    }
    qsort(te, n_tensors, sizeof *te, cmp_entry);
    qsort(mk, n_meta, sizeof *mk, cmp_kv);
    for (size_t i = 1; i < n_tensors; i++)
        if (strcmp(te[i - 1]->name, te[i]->name) == 0 && te[i - 1]->dtype == te[i]->dtype) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: duplicate tensor name '%s'", path, te[i]->name);
            goto done;
        }
    for (size_t i = 0; i < n_tensors; i++) /* same name with different dtypes sorts apart */
        for (size_t j = i + 1; j < n_tensors; j++)
            if (strcmp(te[i]->name, te[j]->name) == 0) {
                s = kvq_fail(err, KVQ_EINVAL, "%s: duplicate tensor name '%s'", path, te[i]->name);
                goto done;
            }
    for (size_t i = 1; i < n_meta; i++)
        if (strcmp(mk[i - 1]->key, mk[i]->key) == 0) {
            s = kvq_fail(err, KVQ_EINVAL, "%s: duplicate metadata key '%s'", path, mk[i]->key);
            goto done;
        }

    sb_str(&h, "{");
    if (n_meta) {
        sb_str(&h, "\"__metadata__\":{");
        for (size_t i = 0; i < n_meta; i++) {
            if (i) sb_str(&h, ",");
            sb_json_str(&h, mk[i]->key);
            sb_str(&h, ":");
            sb_json_str(&h, mk[i]->value);
        }
        sb_str(&h, "}");
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n_tensors; i++) {
        const kvq_st_entry *e = te[i];
        char num[64];
        uint64_t nb = kvq_st_dtype_size(e->dtype);
        for (uint32_t d = 0; d < e->n_dims; d++) nb *= e->shape[d];
        nbytes[i] = nb;
        if (n_meta || i) sb_str(&h, ",");
        sb_json_str(&h, e->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, kvq_st_dtype_name(e->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (uint32_t d = 0; d < e->n_dims; d++) {
            snprintf(num, sizeof num, "%s%llu", d ? "," : "", (unsigned long long)e->shape[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + nb));
        sb_str(&h, num);
        off += nb;
    }
    sb_str(&h, "}");
    while ((8 + h.n) % 8) sb_str(&h, " ");
    if (h.oom) { s = kvq_fail(err, KVQ_ENOMEM, "%s: header: out of memory", path); goto done; }

    size_t pl = strlen(path);
    tmp = malloc(pl + sizeof ".partial");
    if (!tmp) { s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); goto done; }
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".partial", sizeof ".partial");
    f = fopen(tmp, "wb");
    if (!f) { s = kvq_fail(err, KVQ_EIO, "%s: cannot create: %s", tmp, strerror(errno)); goto done; }
    uint64_t hl = h.n;
    int ok = fwrite(&hl, 8, 1, f) == 1 && fwrite(h.p, 1, h.n, f) == h.n;
    for (size_t i = 0; ok && i < n_tensors; i++)
        if (nbytes[i]) ok = fwrite(te[i]->data, 1, (size_t)nbytes[i], f) == nbytes[i];
    int e1 = errno;
    if (fclose(f) != 0 && ok) { ok = 0; e1 = errno; }
    f = NULL;
    if (!ok) {
        s = kvq_fail(err, KVQ_EIO, "%s: write failed: %s", tmp, strerror(e1));
        unlink(tmp);
        goto done;
    }
    if (rename(tmp, path) != 0) {
        s = kvq_fail(err, KVQ_EIO, "%s: rename to %s failed: %s", tmp, path, strerror(errno));
        unlink(tmp);
        goto done;
    }
done:
    if (f) fclose(f);
    free(tmp);
    free(h.p);
    free(te);
    free(mk);
    free(nbytes);
    return s;
}

void kvq_safetensors_release(const kvq_safetensors *st, const kvq_st_tensor *t)
{
    /* whole pages inside the tensor's bytes only: neighbours keep theirs */
    if (!t->data || !t->n_bytes) return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), lo = ((uintptr_t)t->data + pg - 1) / pg * pg,
                    hi = ((uintptr_t)t->data + t->n_bytes) / pg * pg;
    (void)st;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
