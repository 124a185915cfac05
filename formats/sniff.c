/* sniff.c — see sniff.h. */
#include "sniff.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loaders.h"
#include "status.h"

const char *kvq_kind_desc(kvq_file_kind k)
{
    switch (k) {
    case KVQ_KIND_EMPTY: return "an empty file";
    case KVQ_KIND_HDF5: return "an HDF5 file (a kvdump dump?)";
    case KVQ_KIND_GGUF: return "a GGUF file";
    case KVQ_KIND_ARTIFACT: return "a kvcalib artifact (safetensors with kvq metadata)";
    case KVQ_KIND_SAFETENSORS: return "a safetensors file";
    case KVQ_KIND_ZIP: return "a zip archive (a Python wheel or a zipped download? unpack it first)";
    case KVQ_KIND_GZIP: return "a gzip-compressed file (decompress it first)";
    case KVQ_KIND_HTML: return "an HTML page (a failed download saved under this name?)";
    case KVQ_KIND_JSON: return "a JSON file";
    case KVQ_KIND_LLAMA2C: return "a llama2.c model checkpoint";
    case KVQ_KIND_TEXT: return "a text file";
    default: return "binary data of no kind kvq knows";
    }
}

static bool prefix_ci(const unsigned char *p, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    if (n < l) return false;
    for (size_t i = 0; i < l; i++)
        if (tolower(p[i]) != lit[i]) return false;
    return true;
}

kvq_file_kind kvq_sniff(const void *head, size_t n, size_t file_size)
{
    const unsigned char *d = head;
    if (file_size == 0 || n == 0) return KVQ_KIND_EMPTY;
    if (n >= 8 && !memcmp(d, "\x89HDF\r\n\x1a\n", 8)) return KVQ_KIND_HDF5;
    if (n >= 4 && !memcmp(d, "GGUF", 4)) return KVQ_KIND_GGUF;
    if (n >= 9) {
        uint64_t hl;
        memcpy(&hl, d, 8);
        if (hl >= 2 && hl <= file_size - 8 && d[8] == '{') {
            const size_t look = hl + 8 < n ? (size_t)hl + 8 : n;
            return memmem(d, look, "\"kvq.schema", 11) ? KVQ_KIND_ARTIFACT : KVQ_KIND_SAFETENSORS;
        }
    }
    if (n >= 4 && !memcmp(d, "PK\3\4", 4)) return KVQ_KIND_ZIP;
    if (n >= 2 && d[0] == 0x1f && d[1] == 0x8b) return KVQ_KIND_GZIP;
    size_t i = n >= 3 && !memcmp(d, "\xef\xbb\xbf", 3) ? 3 : 0;
    while (i < n && (d[i] == ' ' || d[i] == '\t' || d[i] == '\r' || d[i] == '\n')) i++;
    static const char *const html[] = {"<!doctype html", "<html", "<?xml", "<head", "<body", "<!--"};
    for (size_t k = 0; k < sizeof html / sizeof *html; k++)
        if (prefix_ci(d + i, n - i, html[k])) return KVQ_KIND_HTML;
    if (i < n && (d[i] == '{' || d[i] == '[')) return KVQ_KIND_JSON;
    if (kvq_llama2c_is_checkpoint(d, n, file_size)) return KVQ_KIND_LLAMA2C;
    size_t bad = 0;
    for (size_t j = 0; j < n; j++) {
        if (d[j] == 0) return KVQ_KIND_BINARY;
        if (d[j] < 0x20 && d[j] != '\t' && d[j] != '\n' && d[j] != '\r' && d[j] != '\f') bad++;
    }
    return bad * 100 <= n ? KVQ_KIND_TEXT : KVQ_KIND_BINARY;
}

kvq_file_kind kvq_sniff_path(const char *path)
{
    int fd;
    if (kvq_open_regular(path, "a file", &fd, NULL)) return KVQ_KIND_BINARY;
    struct stat st;
    unsigned char *b = malloc(65536);
    kvq_file_kind k = KVQ_KIND_BINARY;
    if (b && fstat(fd, &st) == 0) {
        ssize_t got = read(fd, b, 65536);
        if (got >= 0) k = kvq_sniff(b, (size_t)got, (size_t)st.st_size);
    }
    free(b);
    close(fd);
    return k;
}
