/* safetensors.h — generic safetensors reader (mmap) and writer.
 *
 * Format (huggingface/safetensors, docs "Format"; all little-endian):
 *   [8 bytes]  u64 N = header length in bytes
 *   [N bytes]  UTF-8 JSON object: optional "__metadata__": {string: string},
 *              and per tensor  "name": {"dtype": "F32", "shape": [d0, d1, ...],
 *                                       "data_offsets": [begin, end]}
 *              (may be padded at the end with spaces, 0x20)
 *   [rest]     data buffer; offsets are relative to its start (byte 8 + N).
 * Tensors are C-contiguous (row-major, last dimension fastest). Like the
 * reference implementation, the reader requires the tensors to tile the data
 * buffer exactly: sorted by begin they are contiguous, start at 0, end at the
 * end of the file, and end - begin == prod(shape) * sizeof(dtype); every
 * offset and shape is checked against the file size before use. A corrupt or
 * truncated file gives KVQ_EFORMAT with a message naming the file, the
 * tensor or field, what was expected and what was found.
 *
 * Lifetime: tensor data pointers point into the read-only mapping and stay
 * valid until kvq_safetensors_close; names and metadata are owned copies.
 * Data pointers are only as aligned as the file makes them (the writer below
 * aligns the buffer to 8 bytes); use memcpy or kvq_safetensors_read_f32.
 * Host byte order must be little-endian (checked at compile time).
 */
#ifndef KVQ_SAFETENSORS_H
#define KVQ_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define KVQ_ST_MAX_DIMS 8
/* The reference implementation's header size limit (100 MB). */
#define KVQ_ST_MAX_HEADER (100u * 1000u * 1000u)

typedef enum {
    KVQ_ST_BOOL = 0, KVQ_ST_U8, KVQ_ST_I8, KVQ_ST_F8_E5M2, KVQ_ST_F8_E4M3,
    KVQ_ST_I16, KVQ_ST_U16, KVQ_ST_F16, KVQ_ST_BF16,
    KVQ_ST_I32, KVQ_ST_U32, KVQ_ST_F32,
    KVQ_ST_F64, KVQ_ST_I64, KVQ_ST_U64,
    KVQ_ST_NDTYPES
} kvq_st_dtype;

/* "F32", "BF16", ... (the header spelling); NULL for an invalid value. */
const char *kvq_st_dtype_name(kvq_st_dtype d);
/* Bytes per element; 0 for an invalid value. */
size_t kvq_st_dtype_size(kvq_st_dtype d);
/* Parse a header dtype string; returns KVQ_ST_NDTYPES if unknown. */
kvq_st_dtype kvq_st_dtype_parse(const char *s);

typedef struct {
    char *name;
    kvq_st_dtype dtype;
    uint32_t n_dims;                  /* 0 = scalar */
    uint64_t shape[KVQ_ST_MAX_DIMS];  /* row-major, shape[n_dims-1] fastest */
    uint64_t n_elements;
    uint64_t n_bytes;
    uint64_t begin, end;              /* data_offsets, relative to the data buffer */
    const uint8_t *data;              /* into the mapping (possibly unaligned) */
} kvq_st_tensor;

typedef struct {
    char *key;
    char *value;
} kvq_st_meta;

typedef struct {
    char path[4096];
    const uint8_t *map;
    size_t size;
    uint64_t header_len;
    size_t data_offset;     /* 8 + header_len */
    size_t n_tensors;
    kvq_st_tensor *tensors; /* [n_tensors], in header order */
    size_t n_meta;
    kvq_st_meta *meta;      /* [n_meta], in header order */
} kvq_safetensors;

/* Open and validate `path`. On failure nothing stays allocated or mapped. */
kvq_status kvq_safetensors_open(const char *path, kvq_safetensors *st, kvq_err *err);
void kvq_safetensors_close(kvq_safetensors *st);

/* Tensor by exact name, or NULL. */
const kvq_st_tensor *kvq_safetensors_find(const kvq_safetensors *st, const char *name);
/* __metadata__ value by key, or NULL. */
const char *kvq_safetensors_meta(const kvq_safetensors *st, const char *key);

/* Convert a floating tensor (F64, F32, F16, BF16) to float32; n_out must
 * equal t->n_elements (else KVQ_EINVAL naming the tensor). Other dtypes:
 * KVQ_EFORMAT naming the tensor and its dtype. */
kvq_status kvq_safetensors_read_f32(const kvq_safetensors *st, const kvq_st_tensor *t,
                                    float *out, size_t n_out, kvq_err *err);

/* ---- writer ------------------------------------------------------------- */
typedef struct {
    const char *name;
    kvq_st_dtype dtype;
    uint32_t n_dims;
    uint64_t shape[KVQ_ST_MAX_DIMS];
    const void *data;       /* prod(shape) * sizeof(dtype) bytes, little-endian */
} kvq_st_entry;

typedef struct {
    const char *key, *value;
} kvq_st_kv;

/* Write a safetensors file deterministically: same inputs → same bytes,
 * whatever the order of `tensors` and `meta`.
 *  - JSON: compact, "__metadata__" first (omitted if n_meta == 0) with keys
 *    sorted bytewise; then tensors in data order.
 *  - Data order: dtype descending in the reference implementation's Dtype
 *    enum order (which kvq_st_dtype mirrors: 8-byte types, then 4, 2, 1),
 *    then name bytewise — the reference writer's rule, so every tensor is
 *    aligned to its element size and, for the same tensors and metadata, the
 *    file is byte-identical to the Python package's (tested against a
 *    fixture); the data buffer starts 8-byte aligned (header padded with
 *    spaces).
 *  - Written to "<path>.partial", then renamed over path; on error the
 *    partial file is removed and path is untouched.
 * Names must be non-empty, unique and not "__metadata__"; metadata keys
 * unique; shapes must not overflow. */
kvq_status kvq_safetensors_write(const char *path, const kvq_st_entry *tensors, size_t n_tensors,
                                 const kvq_st_kv *meta, size_t n_meta, kvq_err *err);


/* Drop the whole memory pages of t's data from this process's resident set
 * (madvise MADV_DONTNEED on the read-only private mapping: the bytes stay in
 * the page cache and read back unchanged if touched again). Loaders call it
 * once a tensor is copied, so that loading a model of N bytes does not hold N
 * bytes of mapped file in the resident set beside the N bytes loaded. */
void kvq_safetensors_release(const kvq_safetensors *st, const kvq_st_tensor *t);

#endif
