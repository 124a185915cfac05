/* gguf.h — GGUF v2/v3 reader (header, metadata of every value type including
 * arrays, tensor infos, general.alignment) over a read-only mmap of the file.
 *
 * Spec: ggml docs/gguf.md (little-endian; v1 used 32-bit counts and is
 * rejected; v2 and v3 use 64-bit counts). Every count, length and offset is
 * checked against the file size before use, so a truncated or corrupt file
 * yields KVQ_EFORMAT with a message naming the file, the byte offset and the
 * field, never a crash.
 *
 * Lifetime: all pointers handed out (keys, strings, array data, tensor data)
 * point into the mapping and stay valid until kvq_gguf_close.
 */
#ifndef KVQ_GGUF_H
#define KVQ_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* Metadata value types (gguf.md `gguf_metadata_value_type`). */
typedef enum {
    KVQ_GGUF_UINT8 = 0, KVQ_GGUF_INT8 = 1, KVQ_GGUF_UINT16 = 2, KVQ_GGUF_INT16 = 3,
    KVQ_GGUF_UINT32 = 4, KVQ_GGUF_INT32 = 5, KVQ_GGUF_FLOAT32 = 6, KVQ_GGUF_BOOL = 7,
    KVQ_GGUF_STRING = 8, KVQ_GGUF_ARRAY = 9, KVQ_GGUF_UINT64 = 10, KVQ_GGUF_INT64 = 11,
    KVQ_GGUF_FLOAT64 = 12,
    KVQ_GGUF_NTYPES
} kvq_gguf_type;

/* ggml tensor types (ggml.h `enum ggml_type`); those kvq can dequantize are
 * listed in kvq_ggml_type_info(). */
typedef enum {
    KVQ_GGML_F32 = 0, KVQ_GGML_F16 = 1, KVQ_GGML_Q4_0 = 2, KVQ_GGML_Q4_1 = 3,
    KVQ_GGML_Q5_0 = 6, KVQ_GGML_Q5_1 = 7, KVQ_GGML_Q8_0 = 8, KVQ_GGML_Q8_1 = 9,
    KVQ_GGML_Q2_K = 10, KVQ_GGML_Q3_K = 11, KVQ_GGML_Q4_K = 12, KVQ_GGML_Q5_K = 13,
    KVQ_GGML_Q6_K = 14, KVQ_GGML_Q8_K = 15, KVQ_GGML_IQ4_NL = 20, KVQ_GGML_BF16 = 30
} kvq_ggml_type;

typedef struct {
    const char *str;  /* NOT NUL-terminated */
    uint64_t len;
} kvq_gguf_str;

typedef struct {
    kvq_gguf_str key;
    kvq_gguf_type type;
    /* scalar value (type != STRING/ARRAY), widened; raw bits for floats */
    union { uint64_t u; int64_t i; double f; bool b; } v;
    kvq_gguf_str s;               /* type == STRING */
    kvq_gguf_type arr_type;       /* type == ARRAY: element type (not ARRAY) */
    uint64_t arr_n;               /* type == ARRAY: element count */
    const uint8_t *arr_data;      /* type == ARRAY, numeric: packed little-endian elements (unaligned) */
    kvq_gguf_str *arr_str;        /* type == ARRAY of STRING: [arr_n] (owned index) */
} kvq_gguf_kv;

typedef struct {
    kvq_gguf_str name;
    uint32_t n_dims;          /* 1..4 */
    uint64_t ne[4];           /* ne[0] is the fastest-varying (row length); unused dims = 1 */
    kvq_ggml_type type;
    uint64_t offset;          /* relative to the data section */
    uint64_t n_elements;
    uint64_t n_bytes;         /* 0 when !size_known */
    bool size_known;          /* false for ggml types kvq cannot size (IQ quants, ...) */
    const uint8_t *data;      /* into the mapping; NULL when !size_known */
} kvq_gguf_tensor;

typedef struct {
    char path[4096];
    const uint8_t *map;
    size_t size;
    uint32_t version;
    uint64_t n_kv, n_tensors;
    kvq_gguf_kv *kv;          /* [n_kv] */
    kvq_gguf_tensor *tensors; /* [n_tensors] */
    uint64_t alignment;       /* general.alignment or 32 */
    uint64_t data_offset;     /* start of the tensor data section */
} kvq_gguf;

/* Open and validate `path`. On failure nothing stays allocated or mapped. */
kvq_status kvq_gguf_open(const char *path, kvq_gguf *g, kvq_err *err);
void kvq_gguf_close(kvq_gguf *g);

/* Metadata lookup; NULL when absent. */
const kvq_gguf_kv *kvq_gguf_find(const kvq_gguf *g, const char *key);
/* Typed getters: KVQ_EFORMAT naming key, expected and found type when the key
 * is missing (if required) or of the wrong type. Integers of any width are
 * accepted when the value fits. With required=false a missing key leaves *out
 * unchanged and returns KVQ_OK. */
kvq_status kvq_gguf_get_int(const kvq_gguf *g, const char *key, bool required, int64_t *out, kvq_err *err);
kvq_status kvq_gguf_get_float(const kvq_gguf *g, const char *key, bool required, double *out, kvq_err *err);
kvq_status kvq_gguf_get_bool(const kvq_gguf *g, const char *key, bool required, bool *out, kvq_err *err);
kvq_status kvq_gguf_get_str(const kvq_gguf *g, const char *key, bool required, kvq_gguf_str *out, kvq_err *err);
/* Array getter: checks the element type. */
kvq_status kvq_gguf_get_arr(const kvq_gguf *g, const char *key, kvq_gguf_type elem_type,
                            const kvq_gguf_kv **out, kvq_err *err);
/* Read element i of a numeric array as double / int64 (bounds-checked by caller via arr_n). */
double kvq_gguf_arr_float(const kvq_gguf_kv *kv, uint64_t i);
int64_t kvq_gguf_arr_int(const kvq_gguf_kv *kv, uint64_t i);

/* Compare a kvq_gguf_str with a C string. */
bool kvq_gguf_str_eq(kvq_gguf_str s, const char *c);

const kvq_gguf_tensor *kvq_gguf_find_tensor(const kvq_gguf *g, const char *name);

/* Block geometry of a ggml type: elements per block and bytes per block.
 * Returns false for types kvq does not know. `name` gets e.g. "Q4_1". */
bool kvq_ggml_type_info(kvq_ggml_type t, uint32_t *block_elems, uint32_t *block_bytes, const char **name);

const char *kvq_gguf_type_name(kvq_gguf_type t);


/* Drop the whole memory pages of t's data from this process's resident set
 * (madvise MADV_DONTNEED on the read-only private mapping: the bytes stay in
 * the page cache and read back unchanged if touched again). Loaders call it
 * once a tensor is copied, so that loading a model of N bytes does not hold N
 * bytes of mapped file in the resident set beside the N bytes loaded. */
void kvq_gguf_release(const kvq_gguf *g, const kvq_gguf_tensor *t);

#endif
