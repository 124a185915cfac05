/* text.c — see text.h. */
#include "text.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

const char *kvq_text_format_name(kvq_text_format f)
{
    return f == KVQ_TEXT_JSONL ? "jsonl" : f == KVQ_TEXT_WIKITEXT_TOKENS ? "wikitext-tokens" : "raw";
}

const char *kvq_eol_name(kvq_eol_mode m) { return m == KVQ_EOL_KEEP ? "keep" : "lf"; }

kvq_eol_mode kvq_ppl_default_eol(kvq_ppl_protocol p) { return p == KVQ_PPL_LLAMACPP ? KVQ_EOL_KEEP : KVQ_EOL_TO_LF; }

size_t kvq_text_bad_bytes(const char *d, size_t n, size_t *first)
{
    const unsigned char *u = (const unsigned char *)d;
    size_t bad = 0, i = 0;
    *first = n;
    while (i < n) {
        unsigned c = u[i];
        size_t len = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        bool ok = len > 0 && c != 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) ok = (u[i + k] & 0xC0) == 0x80;
        if (ok && len == 3) { /* no overlong forms, no UTF-16 surrogates */
            unsigned c1 = u[i + 1];
            ok = !(c == 0xE0 && c1 < 0xA0) && !(c == 0xED && c1 >= 0xA0);
        } else if (ok && len == 4) { /* no overlong forms, nothing above U+10FFFF */
            unsigned c1 = u[i + 1];
            ok = !(c == 0xF0 && c1 < 0x90) && !(c == 0xF4 && c1 >= 0x90);
        }
        if (ok) { i += len; continue; }
        if (*first == n) *first = i;
        bad++;
        i++; /* resynchronise on the next byte */
    }
    return bad;
}

kvq_text_format kvq_text_format_from_path(const char *p)
{
    size_t n = strlen(p);
    if ((n >= 6 && !strcmp(p + n - 6, ".jsonl")) || (n >= 5 && !strcmp(p + n - 5, ".json"))) return KVQ_TEXT_JSONL;
    if (n >= 7 && !strcmp(p + n - 7, ".tokens")) return KVQ_TEXT_WIKITEXT_TOKENS;
    return KVQ_TEXT_RAW;
}

void kvq_text_free(kvq_text *t)
{
    if (!t) return;
    if (t->rows_base != t->data) free(t->rows_base);
    free(t->data);
    free(t->row_off);
    free(t->row_len);
    memset(t, 0, sizeof *t);
}

static kvq_status add_row(kvq_text *t, size_t *cap, size_t off, size_t len, kvq_err *err)
{
    if (t->n_rows == *cap) {
        size_t nc = *cap ? *cap * 2 : 1024;
        size_t *a = realloc(t->row_off, nc * sizeof *a);
        if (!a) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory for rows", t->path);
        t->row_off = a;
        size_t *b = realloc(t->row_len, nc * sizeof *b);
        if (!b) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory for rows", t->path);
        t->row_len = b;
        *cap = nc;
    }
    t->row_off[t->n_rows] = off;
    t->row_len[t->n_rows] = len;
    t->n_rows++;
    return KVQ_OK;
}

static kvq_status read_text(const char *path, kvq_text_format fmt, kvq_eol_mode eol, kvq_text *t, kvq_err *err)
{
    snprintf(t->path, sizeof t->path, "%s", path);
    t->format = fmt;
    /* a directory, device, FIFO or socket would fail late ("read error"), never end (/dev/zero) or block in
     * open() (a FIFO): checked before reading */
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a text file", &f, err));
    size_t cap = 1 << 16, n = 0;
    char *d = malloc(cap);
    if (!d) { fclose(f); return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); }
    for (;;) {
        if (cap - n < 1 + (1 << 15)) {
            char *p = realloc(d, cap * 2);
            if (!p) { free(d); fclose(f); return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory after %zu bytes", path, n); }
            d = p;
            cap *= 2;
        }
        size_t got = fread(d + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    t->data = d;
    if (bad) return kvq_fail(err, KVQ_EIO, "%s: read error after %zu bytes", path, n);
    t->bytes_read = n;
    t->eol = eol;
    KVQ_TRY(kvq_sha256_hex(d, n, t->file_sha256, err));
    if (n == 0) return kvq_fail(err, KVQ_EFORMAT, "%s: empty file (0 bytes; expected text)", path);
    {
        size_t first;
        t->bad_bytes = kvq_text_bad_bytes(d, n, &first);
        t->first_bad = first;
        if (t->bad_bytes > 0 && t->bad_bytes * 1000 > (size_t)KVQ_TEXT_BAD_PER_MILLE * n) {
            size_t nul = 0;
            for (size_t i = 0; i < n; i++) nul += d[i] == 0;
            return kvq_fail(err, KVQ_EFORMAT,
                            "%s: not a text file: %zu of its %zu bytes are NUL bytes or invalid UTF-8 (%zu NUL; the first bad "
                            "byte 0x%02x at offset %zu); expected UTF-8 text (at most %d per mille bad bytes are tolerated)",
                            path, t->bad_bytes, n, nul, (unsigned char)d[first], first, KVQ_TEXT_BAD_PER_MILLE);
        }
    }
    for (size_t r = 0; r + 1 < n; r++) t->crlf_in_file += d[r] == '\r' && d[r + 1] == '\n';
    if (eol == KVQ_EOL_TO_LF) {
        size_t w = 0;
        for (size_t r = 0; r < n; r++) {
            if (d[r] == '\r' && r + 1 < n && d[r + 1] == '\n') { t->crlf_replaced++; continue; }
            d[w++] = d[r];
        }
        n = w;
    }
    d[n] = 0;
    t->len = n;
    size_t rcap = 0;
    if (fmt != KVQ_TEXT_JSONL) {
        t->rows_base = d;
        size_t a = 0;
        for (size_t i = 0; i < n; i++)
            if (d[i] == '\n') { KVQ_TRY(add_row(t, &rcap, a, i + 1 - a, err)); a = i + 1; }
        if (a < n) KVQ_TRY(add_row(t, &rcap, a, n - a, err));
        return KVQ_OK;
    }
    /* JSONL: rows are the "text" strings, copied into rows_base */
    char *rb = malloc(n + 1);
    if (!rb) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
    t->rows_base = rb;
    size_t used = 0, a = 0, line = 0;
    while (a < n) {
        const char *nl = memchr(d + a, '\n', n - a);
        size_t e = nl ? (size_t)(nl - d) : n;
        line++;
        size_t k = a;
        while (k < e && (d[k] == ' ' || d[k] == '\t' || d[k] == '\r')) k++;
        if (k < e) {
            if (memchr(d + a, 0, e - a))
                return kvq_fail(err, KVQ_EFORMAT, "%s: line %zu: NUL byte inside a JSON line", path, line);
            const char *end = NULL;
            cJSON *o = cJSON_ParseWithLengthOpts(d + a, e - a, &end, 0);
            if (o) { /* one JSON value per line: only whitespace after it ({"text":"a"} junk was accepted) */
                const char *q = end, *stop = d + e;
                while (q < stop && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
                if (q < stop) {
                    cJSON_Delete(o);
                    return kvq_fail(err, KVQ_EFORMAT, "%s: line %zu, column %zu: trailing characters after the JSON value", path,
                                    line, (size_t)(q - (d + a)) + 1);
                }
            }
            const cJSON *tx = o ? cJSON_GetObjectItemCaseSensitive(o, "text") : NULL;
            if (!cJSON_IsString(tx)) {
                cJSON_Delete(o);
                return kvq_fail(err, KVQ_EFORMAT, "%s: line %zu: expected a JSON object with a string field \"text\", found %s",
                                path, line, o ? "no such string field" : "invalid JSON");
            }
            size_t l = strlen(tx->valuestring);
            if (l > n - used) { cJSON_Delete(o); return kvq_fail(err, KVQ_EFORMAT, "%s: line %zu: text longer than the line", path, line); }
            memcpy(rb + used, tx->valuestring, l);
            cJSON_Delete(o);
            kvq_status s = add_row(t, &rcap, used, l, err);
            if (s) return s;
            used += l;
        }
        a = e + 1;
    }
    rb[used] = 0;
    if (t->n_rows == 0) return kvq_fail(err, KVQ_EFORMAT, "%s: no JSON lines with a \"text\" field", path);
    return KVQ_OK;
}

kvq_status kvq_text_read(const char *path, kvq_text_format fmt, kvq_eol_mode eol, kvq_text *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    kvq_status s = read_text(path, fmt, eol, out, err);
    if (s) kvq_text_free(out);
    return s;
}

/* ---------- Python random ---------- */

static void mt_init(kvq_pyrandom *r, uint32_t s)
{
    r->mt[0] = s;
    for (int i = 1; i < 624; i++) r->mt[i] = 1812433253u * (r->mt[i - 1] ^ (r->mt[i - 1] >> 30)) + (uint32_t)i;
    r->mti = 624;
}

void kvq_pyrandom_seed(kvq_pyrandom *r, uint64_t seed)
{
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    int klen = key[1] ? 2 : 1;
    mt_init(r, 19650218u);
    int i = 1, j = 0;
    for (int k = 624 > klen ? 624 : klen; k; k--) {
        r->mt[i] = (r->mt[i] ^ ((r->mt[i - 1] ^ (r->mt[i - 1] >> 30)) * 1664525u)) + key[j] + (uint32_t)j;
        i++; j++;
        if (i >= 624) { r->mt[0] = r->mt[623]; i = 1; }
        if (j >= klen) j = 0;
    }
    for (int k = 623; k; k--) {
        r->mt[i] = (r->mt[i] ^ ((r->mt[i - 1] ^ (r->mt[i - 1] >> 30)) * 1566083941u)) - (uint32_t)i;
        i++;
        if (i >= 624) { r->mt[0] = r->mt[623]; i = 1; }
    }
    r->mt[0] = 0x80000000u;
    r->mti = 624;
}

uint32_t kvq_pyrandom_u32(kvq_pyrandom *r)
{
    if (r->mti >= 624) {
        for (int k = 0; k < 624; k++) {
            uint32_t y = (r->mt[k] & 0x80000000u) | (r->mt[(k + 1) % 624] & 0x7fffffffu);
            r->mt[k] = r->mt[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        r->mti = 0;
    }
    uint32_t y = r->mt[r->mti++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

int64_t kvq_pyrandom_randint(kvq_pyrandom *r, int64_t a, int64_t b)
{
    uint64_t m = (uint64_t)(b - a) + 1; /* 1 .. 2^32 */
    int k = 0;
    while (k < 64 && (m >> k)) k++;    /* bit_length(m) */
    if (k > 32) return a;              /* out of the documented range; callers check */
    uint64_t x;
    do x = kvq_pyrandom_u32(r) >> (32 - k); while (x >= m);
    return a + (int64_t)x;
}

/* ---------- windows ---------- */

void kvq_windows_free(kvq_windows *w)
{
    if (!w) return;
    free(w->offsets);
    free(w->tokens);
    memset(w, 0, sizeof *w);
}

/* The string a protocol tokenises: rows joined by "\n\n" (join 1: kvquant, calibration,
 * and llamacpp on JSONL) or the text as read (llamacpp on RAW/TOKENS). */
static kvq_status build_stream_text(const kvq_text *txt, int join, char **s, size_t *n, kvq_err *err)
{
    if (join != 1) { *s = txt->data; *n = txt->len; return KVQ_OK; }
    size_t total = 0;
    for (size_t r = 0; r < txt->n_rows; r++) total += txt->row_len[r] + (r ? 2 : 0);
    char *b = malloc(total + 1);
    if (!b) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory joining %zu rows", txt->path, txt->n_rows);
    size_t k = 0;
    for (size_t r = 0; r < txt->n_rows; r++) {
        if (r) { b[k++] = '\n'; b[k++] = '\n'; }
        memcpy(b + k, txt->rows_base + txt->row_off[r], txt->row_len[r]);
        k += txt->row_len[r];
    }
    b[k] = 0;
    *s = b;
    *n = k;
    return KVQ_OK;
}

static kvq_status tokenise_stream(const kvq_text *txt, const kvq_tokenizer *tok, int join, kvq_bos_policy bos,
                                  kvq_windows *w, int32_t **ids, size_t *n, kvq_err *err)
{
    char *s = NULL;
    size_t sl = 0;
    KVQ_TRY(build_stream_text(txt, join, &s, &sl, err));
    w->crlf_in_file = txt->crlf_in_file;
    w->eol = txt->eol;
    w->rows_joined = join == 1 ? txt->n_rows : 0;
    if (join == 2 && sl > 0 && s[sl - 1] == '\n') { /* llama.cpp -f FILE pops one trailing "\n" */
        sl--;
        w->final_lf_dropped = 1;
    }
    snprintf(w->tokenizer, sizeof w->tokenizer, "%s", kvq_tokenizer_describe(tok));
    snprintf(w->path, sizeof w->path, "%s", txt->path);
    w->bytes_read = txt->bytes_read;
    memcpy(w->file_sha256, txt->file_sha256, sizeof w->file_sha256);
    w->crlf_replaced = txt->crlf_replaced;
    w->text_bytes = sl;
    kvq_status st = kvq_sha256_hex(s, sl, w->text_sha256, err);
    w->bos = bos == KVQ_BOS_ALWAYS || (bos == KVQ_BOS_MODEL && kvq_tokenizer_add_bos_default(tok));
    if (w->bos && kvq_tokenizer_bos(tok) < 0)
        st = kvq_fail(err, KVQ_EINVAL, "%s: BOS requested but the tokenizer (%s) has none", txt->path, w->tokenizer);
    if (!st) st = kvq_tokenizer_encode(tok, s, sl, w->bos ? KVQ_TOK_ADD_BOS : 0, ids, n, err);
    if (s != txt->data) free(s);
    if (!st) w->n_tokens = *n;
    return st;
}

static kvq_status alloc_windows(kvq_windows *w, const char *path, kvq_err *err)
{
    size_t nt;
    if (kvq_mul_size(w->n_windows, w->ctx, &nt)) return kvq_fail(err, KVQ_ENOMEM, "%s: %zu windows x %zu tokens overflows", path, w->n_windows, w->ctx);
    w->offsets = malloc((w->n_windows ? w->n_windows : 1) * sizeof *w->offsets);
    w->tokens = malloc((nt ? nt : 1) * sizeof *w->tokens);
    if (!w->offsets || !w->tokens) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %zu windows of %zu tokens", path, w->n_windows, w->ctx);
    return KVQ_OK;
}

kvq_status kvq_ppl_windows(const kvq_text *txt, const kvq_tokenizer *tok, kvq_ppl_protocol proto, size_t ctx,
                           kvq_bos_policy bos, kvq_windows *w, kvq_err *err)
{
    memset(w, 0, sizeof *w);
    if (ctx < 2) return kvq_fail(err, KVQ_EINVAL, "perplexity: ctx = %zu (expected >= 2)", ctx);
    snprintf(w->protocol, sizeof w->protocol, "%s", proto == KVQ_PPL_LLAMACPP ? "llamacpp" : "kvquant");
    w->ctx = ctx;
    /* join: 1 = rows joined with "\n\n"; 0 = the text as read; 2 = as read, one trailing "\n" dropped (llama.cpp -f) */
    int join = proto == KVQ_PPL_KVQUANT || txt->format == KVQ_TEXT_JSONL ? 1 : 2;
    int32_t *ids = NULL;
    size_t n = 0;
    kvq_status s = tokenise_stream(txt, tok, join, bos, w, &ids, &n, err);
    if (!s && n < ctx)
        s = kvq_fail(err, KVQ_EFORMAT, "%s: %zu tokens with %s, fewer than one window of ctx = %zu", txt->path, n, w->tokenizer, ctx);
    else if (!s && proto == KVQ_PPL_LLAMACPP && n / 2 < ctx)
        s = kvq_fail(err, KVQ_EFORMAT,
                     "%s: %zu tokens with %s; the llamacpp protocol needs at least 2 x ctx = %zu tokens, as llama-perplexity "
                     "refuses fewer (use a smaller --ctx or the kvquant protocol)",
                     txt->path, n, w->tokenizer, 2 * ctx);
    if (!s) {
        w->n_windows = n / ctx;
        w->dropped_tail = n - w->n_windows * ctx;
        s = alloc_windows(w, txt->path, err);
    }
    if (!s) {
        memcpy(w->tokens, ids, w->n_windows * ctx * sizeof *ids);
        for (size_t i = 0; i < w->n_windows; i++) {
            w->offsets[i] = i * ctx;
            if (proto == KVQ_PPL_LLAMACPP && w->bos) w->tokens[i * ctx] = kvq_tokenizer_bos(tok);
        }
    }
    free(ids);
    if (s) kvq_windows_free(w);
    return s;
}

kvq_status kvq_calib_windows(const kvq_text *txt, const kvq_tokenizer *tok, size_t n_windows, size_t len, uint64_t seed,
                             kvq_bos_policy bos, kvq_windows *w, kvq_err *err)
{
    memset(w, 0, sizeof *w);
    if (len < 1 || n_windows < 1) return kvq_fail(err, KVQ_EINVAL, "calibration: %zu windows of %zu tokens (expected >= 1 each)", n_windows, len);
    snprintf(w->protocol, sizeof w->protocol, "calib-kvquant");
    w->ctx = len;
    w->seed = seed;
    w->n_windows = n_windows;
    int32_t *ids = NULL;
    size_t n = 0;
    kvq_status s = tokenise_stream(txt, tok, 1, bos, w, &ids, &n, err);
    if (!s && (n <= len || n - len - 1 > UINT32_MAX))
        s = kvq_fail(err, KVQ_EFORMAT, "%s: %zu tokens: calibration windows of %zu tokens need at least %zu (and fewer than 2^32 + len)",
                     txt->path, n, len, len + 1);
    if (!s) s = alloc_windows(w, txt->path, err);
    if (!s) {
        kvq_pyrandom r;
        kvq_pyrandom_seed(&r, seed);
        for (size_t i = 0; i < n_windows; i++) {
            size_t off = (size_t)kvq_pyrandom_randint(&r, 0, (int64_t)(n - len - 1));
            w->offsets[i] = off;
            memcpy(w->tokens + i * len, ids + off, len * sizeof *ids);
        }
    }
    free(ids);
    if (s) kvq_windows_free(w);
    return s;
}

void kvq_windows_report(const kvq_windows *w, FILE *f)
{
    fprintf(f, "protocol: %s\ntokenizer: %s\npath: %s\nbytes_read: %llu\nfile_sha256: %s\n", w->protocol, w->tokenizer,
            w->path, (unsigned long long)w->bytes_read, w->file_sha256);
    fprintf(f, "text_bytes: %llu\ntext_sha256: %s\nnewlines: %s\ncrlf_in_file: %zu\ncrlf_replaced: %zu\nfinal_lf_dropped: %d\n",
            (unsigned long long)w->text_bytes, w->text_sha256, kvq_eol_name(w->eol), w->crlf_in_file, w->crlf_replaced,
            w->final_lf_dropped);
    fprintf(f, "bos: %d\ntokens: %zu\nctx: %zu\nwindows: %zu\n", w->bos, w->n_tokens, w->ctx, w->n_windows);
    if (!strcmp(w->protocol, "calib-kvquant")) fprintf(f, "seed: %llu\n", (unsigned long long)w->seed);
    else fprintf(f, "dropped_tail: %zu\n", w->dropped_tail);
    for (size_t i = 0; i < w->n_windows; i++)
        fprintf(f, "window %zu offset %zu first %d last %d\n", i, w->offsets[i], w->tokens[i * w->ctx],
                w->tokens[i * w->ctx + w->ctx - 1]);
}
