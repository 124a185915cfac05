/* sniff.h — what a file is, from its first bytes, for error messages that say
 * what was given and what was expected ("m.gguf: it is an HTML page (a failed
 * download saved under this name?), not a GGUF file"), instead of a message
 * about a field of the format that was expected (a 7e17-byte safetensors
 * header length for an HDF5 dump, a llama2.c header for a web page).
 *
 * Recognised, in this order: an empty file; HDF5 (signature \x89HDF\r\n\x1a\n:
 * a kvdump dump); GGUF ("GGUF"); safetensors (a little-endian u64 header length
 * that fits, then '{'; with kvq metadata "kvq.schema" in the header: a kvcalib
 * artifact); zip ("PK\3\4": a Python wheel, a zipped download); gzip (1f 8b);
 * an HTML or XML page ("<!doctype html", "<html", "<?xml", "<head", "<body"
 * after whitespace or a UTF-8 BOM, case-insensitive); JSON ('{' or '[');
 * a llama2.c checkpoint (kvq_llama2c_is_checkpoint: header sizes consistent
 * with the file size); UTF-8 text (no NUL, at most 1% other control bytes or
 * invalid UTF-8 in the first bytes); else "binary data of no kind kvq knows". */
#ifndef KVQ_SNIFF_H
#define KVQ_SNIFF_H

#include <stddef.h>

typedef enum {
    KVQ_KIND_EMPTY = 0,
    KVQ_KIND_HDF5,
    KVQ_KIND_GGUF,
    KVQ_KIND_ARTIFACT,     /* safetensors with kvq metadata */
    KVQ_KIND_SAFETENSORS,
    KVQ_KIND_ZIP,
    KVQ_KIND_GZIP,
    KVQ_KIND_HTML,
    KVQ_KIND_JSON,
    KVQ_KIND_LLAMA2C,
    KVQ_KIND_TEXT,
    KVQ_KIND_BINARY
} kvq_file_kind;

/* The kind of a file whose first n bytes are head (n <= file_size). */
kvq_file_kind kvq_sniff(const void *head, size_t n, size_t file_size);
/* The kind of the file at path (reads at most its first 64 KiB; a file that cannot be read,
 * or is not a regular file, is KVQ_KIND_BINARY). */
kvq_file_kind kvq_sniff_path(const char *path);
/* "an HDF5 file (a kvdump dump?)", "an HTML page (a failed download saved under this name?)", ... */
const char *kvq_kind_desc(kvq_file_kind k);

#endif
