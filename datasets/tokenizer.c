/* tokenizer.c — see tokenizer.h. Loaders (GGUF, llama2.c, HF json), the
 * special-token partition, the two merge engines and decode. */
#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "loaders.h"
#include "model.h"
#include "sniff.h"

enum { PRE_NONE = 0, PRE_GPT2 = 1, PRE_STARCODER = 2 };

/* The GPT-2 pattern (encoder.py), as HF ByteLevel(use_regex=true) uses it. */
static const char RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char RE_DIGIT[] = "\\p{N}";

struct kvq_tokenizer {
    kvq_tok_kind kind;
    int32_t n_vocab;
    char *blob;            /* all token texts, concatenated */
    size_t *off;           /* [n_vocab] offset into blob */
    uint32_t *len;         /* [n_vocab] */
    float *score;          /* [n_vocab] */
    uint8_t *type;         /* [n_vocab] kvq_toktype */
    int32_t *ht;           /* text -> id, open addressing, -1 empty */
    size_t ht_mask;
    /* merges: (left id, right id) -> rank, merged id */
    uint64_t *pk;
    int32_t *prank, *pmerged;
    size_t p_mask;
    int32_t n_merges;
    bool use_ranks;        /* SPM engine driven by merge ranks (HF Metaspace BPE) */
    int32_t bos, eos, unk;
    bool add_bos, add_eos, add_space_prefix;
    int pre;
    pcre2_code *re[2];
    int n_re;
    int32_t byte_tok[256]; /* byte -> token (SPM "<0xNN>", byte-level: bytes_to_unicode char) */
    uint16_t b2cp[256];    /* GPT-2 bytes_to_unicode */
    int16_t cp2b[324];     /* inverse, -1 if none */
    int32_t *special;      /* ids of control/unknown/user-defined tokens, text length descending */
    int32_t n_special;
    int32_t n_dup;
    char desc[192];
};

/* ---------- small helpers ---------- */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) { h ^= (uint8_t)s[i]; h *= 1099511628211ull; }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if invalid. */
static size_t utf8_seq(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t c = s[0];
    if (c < 0x80) { if (cp) *cp = c; return 1; }
    size_t k;
    uint32_t v, min;
    if ((c & 0xE0) == 0xC0) { k = 2; v = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { k = 3; v = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { k = 4; v = c & 0x07; min = 0x10000; }
    else return 0;
    if (k > n) return 0;
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    if (cp) *cp = v;
    return k;
}

static size_t utf8_put(char *o, uint32_t cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

typedef struct { int32_t *v; size_t n, cap; } ivec;
typedef struct { char *v; size_t n, cap; } bvec;

static int ivec_push(ivec *a, int32_t x)
{
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 256;
        int32_t *p = realloc(a->v, nc * sizeof *p);
        if (!p) return 1;
        a->v = p; a->cap = nc;
    }
    a->v[a->n++] = x;
    return 0;
}

static int bvec_put(bvec *a, const char *s, size_t n)
{
    if (n > ((size_t)-1 >> 2) - a->n) return 1;
    if (a->n + n + 1 > a->cap) {
        size_t nc = a->cap ? a->cap : 256;
        while (nc < a->n + n + 1) nc *= 2;
        char *p = realloc(a->v, nc);
        if (!p) return 1;
        a->v = p; a->cap = nc;
    }
    memcpy(a->v + a->n, s, n);
    a->n += n;
    a->v[a->n] = 0;
    return 0;
}

/* ---------- vocabulary construction ---------- */

static kvq_tokenizer *tok_alloc(int32_t n_vocab, size_t blob_cap)
{
    kvq_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->n_vocab = n_vocab;
    t->blob = malloc(blob_cap ? blob_cap : 1);
    t->off = calloc((size_t)n_vocab + 1, sizeof *t->off);
    t->len = calloc((size_t)n_vocab + 1, sizeof *t->len);
    t->score = calloc((size_t)n_vocab + 1, sizeof *t->score);
    t->type = calloc((size_t)n_vocab + 1, 1);
    t->bos = t->eos = t->unk = -1;
    if (!t->blob || !t->off || !t->len || !t->score || !t->type) { kvq_tokenizer_free(t); return NULL; }
    return t;
}

void kvq_tokenizer_free(kvq_tokenizer *t)
{
    if (!t) return;
    free(t->blob); free(t->off); free(t->len); free(t->score); free(t->type); free(t->ht);
    free(t->pk); free(t->prank); free(t->pmerged); free(t->special);
    for (int i = 0; i < t->n_re; i++) pcre2_code_free(t->re[i]);
    free(t);
}

int32_t kvq_tokenizer_find(const kvq_tokenizer *t, const char *s, size_t n)
{
    if (!t->ht) return -1;
    size_t h = (size_t)hash_bytes(s, n) & t->ht_mask;
    for (;;) {
        int32_t id = t->ht[h];
        if (id < 0) return -1;
        if (t->len[id] == n && memcmp(t->blob + t->off[id], s, n) == 0) return id;
        h = (h + 1) & t->ht_mask;
    }
}

static int pair_find(const kvq_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *merged)
{
    if (!t->pk || a < 0 || b < 0) return 0;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t h = (size_t)hash_u64(key) & t->p_mask;
    for (;;) {
        if (t->pmerged[h] < 0) return 0;
        if (t->pk[h] == key) { *rank = t->prank[h]; *merged = t->pmerged[h]; return 1; }
        h = (h + 1) & t->p_mask;
    }
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const kvq_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (t->len[x] != t->len[y]) return t->len[x] > t->len[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* Validate texts, build the text hash, byte tokens, the special list and the
 * pre-tokenizer; `src` names the file for messages. */
static kvq_status tok_finish(kvq_tokenizer *t, const char *src, kvq_err *err)
{
    size_t cap = 16;
    while (cap < (size_t)t->n_vocab * 2) cap <<= 1;
    t->ht = malloc(cap * sizeof *t->ht);
    if (!t->ht) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the token hash", src);
    memset(t->ht, 0xff, cap * sizeof *t->ht);
    t->ht_mask = cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (t->len[id] == 0) continue; /* empty text (or an id hole in HF json): never produced by encode */
        const char *s = t->blob + t->off[id];
        size_t h = (size_t)hash_bytes(s, t->len[id]) & t->ht_mask;
        int dup = 0;
        while (t->ht[h] >= 0) {
            int32_t o = t->ht[h];
            if (t->len[o] == t->len[id] && memcmp(t->blob + t->off[o], s, t->len[id]) == 0) { dup = 1; break; }
            h = (h + 1) & t->ht_mask;
        }
        if (dup) { t->n_dup++; continue; } /* first id wins */
        t->ht[h] = id;
    }
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    if (t->kind == KVQ_TOK_BPE_BYTES) {
        int n = 0;
        for (int b = 0; b < 256; b++) {
            int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            t->b2cp[b] = (uint16_t)(keep ? b : 256 + n++);
        }
        for (int i = 0; i < 324; i++) t->cp2b[i] = -1;
        for (int b = 0; b < 256; b++) {
            t->cp2b[t->b2cp[b]] = (int16_t)b;
            char u[4];
            size_t k = utf8_put(u, t->b2cp[b]);
            t->byte_tok[b] = kvq_tokenizer_find(t, u, k);
        }
    } else {
        for (int b = 0; b < 256; b++) {
            char u[8];
            snprintf(u, sizeof u, "<0x%02X>", b);
            int32_t id = kvq_tokenizer_find(t, u, 6);
            if (id >= 0 && t->type[id] == KVQ_TOKTYPE_NORMAL) t->type[id] = KVQ_TOKTYPE_BYTE;
            t->byte_tok[b] = id;
        }
    }
    t->special = malloc(((size_t)t->n_vocab + 1) * sizeof *t->special);
    if (!t->special) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the special-token list", src);
    for (int32_t id = 0; id < t->n_vocab; id++) {
        int ty = t->type[id];
        if ((ty == KVQ_TOKTYPE_CONTROL || ty == KVQ_TOKTYPE_USER_DEFINED || ty == KVQ_TOKTYPE_UNKNOWN) && t->len[id] > 0)
            t->special[t->n_special++] = id;
    }
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special, t);
    if (t->bos >= t->n_vocab || t->eos >= t->n_vocab || t->unk >= t->n_vocab)
        return kvq_fail(err, KVQ_EFORMAT, "%s: bos %d / eos %d / unk %d: id out of range [0, %d)", src, t->bos, t->eos,
                        t->unk, t->n_vocab);
    if (t->add_bos && t->bos < 0)
        return kvq_fail(err, KVQ_EFORMAT, "%s: add_bos_token is set but the vocabulary has no BOS id", src);
    if (t->pre != PRE_NONE) {
        const char *pats[2];
        int np = 0;
        if (t->pre == PRE_STARCODER) pats[np++] = RE_DIGIT;
        pats[np++] = RE_GPT2;
        for (int i = 0; i < np; i++) {
            int ec;
            PCRE2_SIZE eo;
            t->re[i] = pcre2_compile((PCRE2_SPTR)pats[i], PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
            if (!t->re[i]) {
                PCRE2_UCHAR buf[256];
                pcre2_get_error_message(ec, buf, sizeof buf);
                return kvq_fail(err, KVQ_EUNSUPPORTED, "pcre2_compile of the pre-tokenizer regex failed at %zu: %s",
                                (size_t)eo, (const char *)buf);
            }
            t->n_re = i + 1;
            (void)pcre2_jit_compile(t->re[i], PCRE2_JIT_COMPLETE); /* falls back to the interpreter */
        }
    }
    return KVQ_OK;
}

/* Add merges "A B" (texts); the pair table is sized for n. */
static kvq_status merges_alloc(kvq_tokenizer *t, size_t n, const char *src, kvq_err *err)
{
    size_t cap = 16;
    while (cap < n * 2 + 2) cap <<= 1;
    t->pk = malloc(cap * sizeof *t->pk);
    t->prank = malloc(cap * sizeof *t->prank);
    t->pmerged = malloc(cap * sizeof *t->pmerged);
    if (!t->pk || !t->prank || !t->pmerged) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %zu merges", src, n);
    memset(t->pmerged, 0xff, cap * sizeof *t->pmerged);
    t->p_mask = cap - 1;
    return KVQ_OK;
}

static kvq_status merge_add(kvq_tokenizer *t, const char *a, size_t na, const char *b, size_t nb, int32_t rank,
                            const char *src, const char *field, kvq_err *err)
{
    int32_t ia = kvq_tokenizer_find(t, a, na), ib = kvq_tokenizer_find(t, b, nb);
    char small[512], *cat = na + nb <= sizeof small ? small : malloc(na + nb);
    if (!cat) return kvq_fail(err, KVQ_ENOMEM, "%s: %s[%d]: out of memory", src, field, rank);
    memcpy(cat, a, na);
    memcpy(cat + na, b, nb);
    int32_t im = kvq_tokenizer_find(t, cat, na + nb);
    if (cat != small) free(cat);
    if (ia < 0 || ib < 0 || im < 0)
        return kvq_fail(err, KVQ_EFORMAT, "%s: %s[%d] = \"%.*s %.*s\": %s is not a token of the vocabulary", src, field,
                        rank, (int)(na > 64 ? 64 : na), a, (int)(nb > 64 ? 64 : nb), b,
                        ia < 0 ? "the left part" : ib < 0 ? "the right part" : "the merged text");
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t h = (size_t)hash_u64(key) & t->p_mask;
    while (t->pmerged[h] >= 0) {
        if (t->pk[h] == key) return KVQ_OK; /* repeated merge: the first (lowest) rank stays */
        h = (h + 1) & t->p_mask;
    }
    t->pk[h] = key;
    t->prank[h] = rank;
    t->pmerged[h] = im;
    t->n_merges++;
    return KVQ_OK;
}

/* Split a merge line "A B" at its single separating space. */
static kvq_status merge_add_line(kvq_tokenizer *t, const char *s, size_t n, int32_t rank, const char *src,
                                 const char *field, kvq_err *err)
{
    const char *sp = memchr(s, ' ', n);
    if (!sp || sp == s || sp == s + n - 1 || memchr(sp + 1, ' ', n - (size_t)(sp - s) - 1))
        return kvq_fail(err, KVQ_EFORMAT, "%s: %s[%d] = \"%.*s\": expected \"LEFT RIGHT\" with one space", src, field, rank,
                        (int)(n > 64 ? 64 : n), s);
    return merge_add(t, s, (size_t)(sp - s), sp + 1, n - (size_t)(sp - s) - 1, rank, src, field, err);
}

/* ---------- GGUF ---------- */

static kvq_status from_gguf(const kvq_gguf *g, kvq_tokenizer **out, kvq_err *err)
{
    const char *src = g->path;
    kvq_gguf_str model = {0}, pre = {0};
    KVQ_TRY(kvq_gguf_get_str(g, "tokenizer.ggml.model", true, &model, err));
    KVQ_TRY(kvq_gguf_get_str(g, "tokenizer.ggml.pre", false, &pre, err));
    kvq_tok_kind kind;
    if (kvq_gguf_str_eq(model, "llama")) kind = KVQ_TOK_SPM;
    else if (kvq_gguf_str_eq(model, "gpt2")) kind = KVQ_TOK_BPE_BYTES;
    else
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tokenizer.ggml.model = \"%.*s\": expected \"llama\" or \"gpt2\"", src,
                        (int)(model.len > 64 ? 64 : model.len), model.str);
    int prek = PRE_NONE;
    char prename[64] = "default";
    if (pre.str) snprintf(prename, sizeof prename, "%.*s", (int)(pre.len > 63 ? 63 : pre.len), pre.str);
    if (kind == KVQ_TOK_BPE_BYTES) {
        if (!strcmp(prename, "default") || !strcmp(prename, "gpt-2") || !strcmp(prename, "gpt2")) prek = PRE_GPT2;
        else if (!strcmp(prename, "starcoder") || !strcmp(prename, "smollm")) prek = PRE_STARCODER;
        else
            return kvq_fail(err, KVQ_EUNSUPPORTED,
                            "%s: tokenizer.ggml.pre = \"%s\": kvq implements \"default\", \"gpt-2\", \"starcoder\", \"smollm\"",
                            src, prename);
    }
    const kvq_gguf_kv *toks, *scores = NULL, *types = NULL, *merges = NULL;
    KVQ_TRY(kvq_gguf_get_arr(g, "tokenizer.ggml.tokens", KVQ_GGUF_STRING, &toks, err));
    if (toks->arr_n == 0 || toks->arr_n > (1u << 30))
        return kvq_fail(err, KVQ_EFORMAT, "%s: tokenizer.ggml.tokens: %llu tokens (expected 1..2^30)", src,
                        (unsigned long long)toks->arr_n);
    int32_t n = (int32_t)toks->arr_n;
    if (kvq_gguf_find(g, "tokenizer.ggml.scores")) {
        KVQ_TRY(kvq_gguf_get_arr(g, "tokenizer.ggml.scores", KVQ_GGUF_FLOAT32, &scores, err));
        if (scores->arr_n != toks->arr_n)
            return kvq_fail(err, KVQ_EFORMAT, "%s: tokenizer.ggml.scores: %llu entries, expected %d (one per token)", src,
                            (unsigned long long)scores->arr_n, n);
    }
    if (kvq_gguf_find(g, "tokenizer.ggml.token_type")) {
        KVQ_TRY(kvq_gguf_get_arr(g, "tokenizer.ggml.token_type", KVQ_GGUF_INT32, &types, err));
        if (types->arr_n != toks->arr_n)
            return kvq_fail(err, KVQ_EFORMAT, "%s: tokenizer.ggml.token_type: %llu entries, expected %d", src,
                            (unsigned long long)types->arr_n, n);
    }
    if (kind == KVQ_TOK_BPE_BYTES) {
        if (!kvq_gguf_find(g, "tokenizer.ggml.merges"))
            return kvq_fail(err, KVQ_EFORMAT, "%s: tokenizer.ggml.merges: missing (required for a \"gpt2\" byte-level BPE vocabulary)", src);
        KVQ_TRY(kvq_gguf_get_arr(g, "tokenizer.ggml.merges", KVQ_GGUF_STRING, &merges, err));
    }
    size_t blob = 0;
    for (int32_t i = 0; i < n; i++) blob += toks->arr_str[i].len; /* bounded by the file size */
    kvq_tokenizer *t = tok_alloc(n, blob);
    if (!t) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate a vocabulary of %d tokens", src, n);
    t->kind = kind;
    t->pre = prek;
    size_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        memcpy(t->blob + at, toks->arr_str[i].str, toks->arr_str[i].len);
        t->off[i] = at;
        t->len[i] = (uint32_t)toks->arr_str[i].len;
        at += toks->arr_str[i].len;
        t->score[i] = scores ? (float)kvq_gguf_arr_float(scores, (uint64_t)i) : 0.0f;
        int64_t ty = types ? kvq_gguf_arr_int(types, (uint64_t)i) : KVQ_TOKTYPE_NORMAL;
        if (ty < 0 || ty > KVQ_TOKTYPE_BYTE) {
            kvq_tokenizer_free(t);
            return kvq_fail(err, KVQ_EFORMAT, "%s: tokenizer.ggml.token_type[%d] = %lld (expected 0..6)", src, i, (long long)ty);
        }
        t->type[i] = (uint8_t)(ty == 0 ? KVQ_TOKTYPE_NORMAL : ty);
    }
    int64_t v;
    bool b;
    kvq_status s = KVQ_OK;
    static const char *const id_keys[3] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.unknown_token_id"};
    int32_t *ids[3] = {&t->bos, &t->eos, &t->unk};
    for (int k = 0; k < 3; k++) {
        v = kind == KVQ_TOK_SPM ? (k == 0 ? 1 : k == 1 ? 2 : 0) : -1;
        if ((s = kvq_gguf_get_int(g, id_keys[k], false, &v, err))) goto fail;
        if (v >= n) { /* named with the value the file holds (it was clamped to n before the message) */
            s = kvq_fail(err, KVQ_EFORMAT, "%s: %s %lld: id out of range [0, %lld)", src, id_keys[k], (long long)v, (long long)n);
            goto fail;
        }
        *ids[k] = v < 0 ? -1 : (int32_t)v;
    }
    b = kind == KVQ_TOK_SPM;
    if ((s = kvq_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", false, &b, err))) goto fail;
    t->add_bos = b;
    b = false;
    if ((s = kvq_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", false, &b, err))) goto fail;
    t->add_eos = b;
    b = kind == KVQ_TOK_SPM;
    if ((s = kvq_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", false, &b, err))) goto fail;
    t->add_space_prefix = b;
    if (t->add_bos && t->bos < 0) t->add_bos = false;
    if (t->add_eos && t->eos < 0) t->add_eos = false;
    if ((s = tok_finish(t, src, err))) goto fail;
    if (merges) {
        if ((s = merges_alloc(t, merges->arr_n, src, err))) goto fail;
        for (uint64_t i = 0; i < merges->arr_n; i++)
            if ((s = merge_add_line(t, merges->arr_str[i].str, merges->arr_str[i].len, (int32_t)i, src,
                                    "tokenizer.ggml.merges", err)))
                goto fail;
    }
    snprintf(t->desc, sizeof t->desc, "gguf %s/%s vocab %d", kind == KVQ_TOK_SPM ? "llama" : "gpt2", prename, n);
    if (merges) snprintf(t->desc + strlen(t->desc), sizeof t->desc - strlen(t->desc), " merges %d", t->n_merges);
    if (t->n_dup) snprintf(t->desc + strlen(t->desc), sizeof t->desc - strlen(t->desc), " duplicates %d", t->n_dup);
    *out = t;
    return KVQ_OK;
fail:
    kvq_tokenizer_free(t);
    return s;
}

kvq_status kvq_tokenizer_from_gguf(const char *path, kvq_tokenizer **out, kvq_err *err)
{
    *out = NULL;
    kvq_gguf g;
    KVQ_TRY(kvq_gguf_open(path, &g, err));
    kvq_status s = from_gguf(&g, out, err);
    kvq_gguf_close(&g);
    return s;
}

/* ---------- whole-file read ---------- */

static kvq_status slurp(const char *path, char **data, size_t *n, kvq_err *err)
{
    *data = NULL;
    *n = 0;
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a tokenizer file", &f, err));
    bvec b = {0};
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0)
        if (bvec_put(&b, buf, got)) { fclose(f); free(b.v); return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory reading", path); }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(b.v); return kvq_fail(err, KVQ_EIO, "%s: read error", path); }
    if (!b.v) { b.v = malloc(1); if (!b.v) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path); b.v[0] = 0; }
    *data = b.v;
    *n = b.n;
    return KVQ_OK;
}

/* ---------- llama2.c ---------- */

/* Files that are recognisably something else than a llama2.c tokenizer (whose own header, a bare
 * uint32, has no magic): named instead of a record-length message about their bytes. */
static const char *foreign_file(const char *d, size_t n)
{
    switch (kvq_sniff(d, n, n)) {
    case KVQ_KIND_GGUF: return "a GGUF file (load it as a GGUF tokenizer)";
    case KVQ_KIND_SAFETENSORS: return "a safetensors file (weights?)";
    case KVQ_KIND_LLAMA2C: return "a llama2.c model checkpoint (pass its tokenizer.bin)";
    case KVQ_KIND_HDF5: case KVQ_KIND_ZIP: case KVQ_KIND_GZIP: case KVQ_KIND_HTML: case KVQ_KIND_EMPTY: case KVQ_KIND_ARTIFACT:
        return kvq_kind_desc(kvq_sniff(d, n, n));
    default: return NULL; /* (a llama2.c tokenizer has no magic: binary data, or even text-like bytes) */
    }
}

kvq_status kvq_tokenizer_from_llama2c(const char *path, int32_t vocab_size, kvq_tokenizer **out, kvq_err *err)
{
    *out = NULL;
    char *d;
    size_t n;
    KVQ_TRY(slurp(path, &d, &n, err));
    kvq_status s = KVQ_OK;
    kvq_tokenizer *t = NULL;
    const char *other = foreign_file(d, n);
    if (other) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: %s, not a tokenizer (expected a llama2.c tokenizer.bin, a GGUF file or an HF tokenizer.json)",
                     path, other);
        goto done;
    }
    if (n < 4) { s = kvq_fail(err, KVQ_EFORMAT, "%s: %zu bytes: too short for the uint32 max_token_length header", path, n); goto done; }
    uint32_t maxlen;
    memcpy(&maxlen, d, 4);
    if (maxlen > 65536) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: offset 0: max_token_length %u (expected at most 65536): not a llama2.c tokenizer", path, maxlen);
        goto done;
    }
    /* pass 1: count records and text bytes (with ' ' -> U+2581 growing 1 byte to 3) */
    size_t at = 4, blob = 0;
    int32_t cnt = 0;
    while (at < n && (vocab_size <= 0 || cnt < vocab_size)) {
        if (n - at < 8) { s = kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: token %d: record header truncated (8 bytes needed, %zu left)", path, at, cnt, n - at); goto done; }
        int32_t l;
        memcpy(&l, d + at + 4, 4);
        if (l <= 0 || (size_t)l > n - at - 8 || (maxlen && (uint32_t)l > maxlen)) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: token %d: length %d (expected 1..%u within the %zu bytes left)", path, at + 4, cnt, l, maxlen, n - at - 8);
            goto done;
        }
        blob += 3 * (size_t)l;
        at += 8 + (size_t)l;
        if (++cnt >= (1 << 30)) break;
    }
    if (vocab_size > 0 && cnt < vocab_size) { s = kvq_fail(err, KVQ_EFORMAT, "%s: %d token records, expected vocab_size %d", path, cnt, vocab_size); goto done; }
    if (cnt < 3) { s = kvq_fail(err, KVQ_EFORMAT, "%s: %d token records (expected at least <unk>, BOS, EOS)", path, cnt); goto done; }
    t = tok_alloc(cnt, blob);
    if (!t) { s = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %d tokens", path, cnt); goto done; }
    t->kind = KVQ_TOK_SPM;
    at = 4;
    size_t bo = 0;
    for (int32_t i = 0; i < cnt; i++) {
        float sc;
        int32_t l;
        memcpy(&sc, d + at, 4);
        memcpy(&l, d + at + 4, 4);
        at += 8;
        t->off[i] = bo;
        for (int32_t k = 0; k < l; k++) {
            if (d[at + (size_t)k] == ' ') { memcpy(t->blob + bo, "\xe2\x96\x81", 3); bo += 3; }
            else t->blob[bo++] = d[at + (size_t)k];
        }
        t->len[i] = (uint32_t)(bo - t->off[i]);
        at += (size_t)l;
        t->score[i] = isfinite(sc) ? sc : -INFINITY;
        t->type[i] = KVQ_TOKTYPE_NORMAL;
    }
    /* llama2.c conventions (run.c): 0 = <unk>, 1 = BOS, 2 = EOS, bytes "<0xNN>" */
    t->unk = 0;
    t->bos = 1;
    t->eos = 2;
    t->type[0] = KVQ_TOKTYPE_UNKNOWN;
    t->type[1] = t->type[2] = KVQ_TOKTYPE_CONTROL;
    t->add_bos = true;
    t->add_space_prefix = true;
    if ((s = tok_finish(t, path, err))) goto done;
    snprintf(t->desc, sizeof t->desc, "llama2c spm vocab %d", cnt);
    if (t->n_dup) snprintf(t->desc + strlen(t->desc), sizeof t->desc - strlen(t->desc), " duplicates %d", t->n_dup);
    *out = t;
    t = NULL;
done:
    kvq_tokenizer_free(t);
    free(d);
    return s;
}

/* ---------- HF tokenizer.json ---------- */

static const cJSON *jget(const cJSON *o, const char *k) { return o ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL; }
static bool jtype_is(const cJSON *o, const char *ty)
{
    const cJSON *x = jget(o, "type");
    return cJSON_IsString(x) && !strcmp(x->valuestring, ty);
}

/* Classify the HF pre_tokenizer: returns PRE_* or -1 (unsupported); *bytelevel set if a ByteLevel is present. */
static int hf_pre(const cJSON *p, bool *bytelevel, bool *prefix_space)
{
    if (!p || cJSON_IsNull(p)) return PRE_NONE;
    if (jtype_is(p, "ByteLevel")) {
        *bytelevel = true;
        *prefix_space = cJSON_IsTrue(jget(p, "add_prefix_space"));
        const cJSON *ur = jget(p, "use_regex");
        return ur && cJSON_IsFalse(ur) ? PRE_NONE : PRE_GPT2;
    }
    if (jtype_is(p, "Sequence")) {
        const cJSON *a = jget(p, "pretokenizers");
        int n = cJSON_GetArraySize(a), digits = 0, r = PRE_NONE;
        for (int i = 0; i < n; i++) {
            const cJSON *e = cJSON_GetArrayItem(a, i);
            if (jtype_is(e, "Digits") && cJSON_IsTrue(jget(e, "individual_digits")) && i == 0) digits = 1;
            else if (jtype_is(e, "Split") && i == 0) {
                const cJSON *pat = jget(jget(e, "pattern"), "Regex");
                if (cJSON_IsString(pat) && !strcmp(pat->valuestring, "\\p{N}") && cJSON_IsString(jget(e, "behavior")) &&
                    !strcmp(jget(e, "behavior")->valuestring, "Isolated"))
                    digits = 1;
                else return -1;
            } else if (jtype_is(e, "ByteLevel")) {
                r = hf_pre(e, bytelevel, prefix_space);
                if (r < 0) return -1;
            } else return -1;
        }
        if (!*bytelevel) return -1;
        if (digits) return r == PRE_GPT2 ? PRE_STARCODER : -1;
        return r;
    }
    return -1;
}

/* Llama-2 style normalizer: Sequence[Prepend("▁"), Replace(" " -> "▁")] or a Metaspace pre_tokenizer. */
static int hf_metaspace(const cJSON *root, bool *prefix)
{
    const cJSON *nm = jget(root, "normalizer"), *pt = jget(root, "pre_tokenizer");
    if (jtype_is(pt, "Metaspace")) {
        const cJSON *ps = jget(pt, "prepend_scheme");
        *prefix = !(cJSON_IsString(ps) && !strcmp(ps->valuestring, "never")) && !cJSON_IsFalse(jget(pt, "add_prefix_space"));
        return 1;
    }
    if (!jtype_is(nm, "Sequence")) return 0;
    const cJSON *a = jget(nm, "normalizers");
    int rep = 0;
    *prefix = false;
    for (int i = 0; i < cJSON_GetArraySize(a); i++) {
        const cJSON *e = cJSON_GetArrayItem(a, i);
        if (jtype_is(e, "Prepend")) *prefix = true;
        else if (jtype_is(e, "Replace")) {
            const cJSON *c = jget(e, "content"), *st = jget(jget(e, "pattern"), "String");
            if (cJSON_IsString(c) && cJSON_IsString(st) && !strcmp(st->valuestring, " ") && !strcmp(c->valuestring, "\xe2\x96\x81")) rep = 1;
            else return -1;
        } else return -1;
    }
    return rep ? 1 : 0;
}

static int32_t hf_token_id(const cJSON *root, const cJSON *vocab, const char *text)
{
    const cJSON *added = jget(root, "added_tokens");
    for (int i = 0; i < cJSON_GetArraySize(added); i++) {
        const cJSON *e = cJSON_GetArrayItem(added, i), *c = jget(e, "content"), *id = jget(e, "id");
        if (cJSON_IsString(c) && cJSON_IsNumber(id) && !strcmp(c->valuestring, text)) return (int32_t)id->valuedouble;
    }
    const cJSON *v = jget(vocab, text);
    return cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
}

/* tokenizer_config.json "bos_token"/"eos_token": a string, an AddedToken
 * object {"content": string, ...}, or null/absent (*text = NULL). */
static kvq_status tcfg_token(const cJSON *tcfg, const char *key, const char *tcfg_path, const char **text, kvq_err *err)
{
    const cJSON *v = jget(tcfg, key);
    *text = NULL;
    if (!v || cJSON_IsNull(v)) return KVQ_OK;
    if (cJSON_IsObject(v)) v = jget(v, "content");
    if (!cJSON_IsString(v))
        return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s': expected a string or {\"content\": string}", tcfg_path, key);
    *text = v->valuestring;
    return KVQ_OK;
}

/* Apply tokenizer_config.json (transformers): bos_token / eos_token set the
 * BOS / EOS ids; add_bos_token / add_eos_token, when present, decide whether
 * they are added by default (LlamaTokenizerFast rebuilds its post-processor
 * from them); absent keys leave what tokenizer.json's post_processor says. */
static kvq_status apply_tcfg(kvq_tokenizer *t, const cJSON *root, const cJSON *vocab, const cJSON *tcfg, const char *tcfg_path,
                             kvq_err *err)
{
    const char *keys[2] = {"bos_token", "eos_token"};
    int32_t *ids[2] = {&t->bos, &t->eos};
    for (int i = 0; i < 2; i++) {
        const char *text;
        KVQ_TRY(tcfg_token(tcfg, keys[i], tcfg_path, &text, err));
        if (!text) continue;
        int32_t id = hf_token_id(root, vocab, text);
        if (id < 0)
            return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s': token \"%.64s\" is not in the vocabulary of the neighbouring tokenizer.json",
                            tcfg_path, keys[i], text);
        *ids[i] = id;
    }
    const char *fk[2] = {"add_bos_token", "add_eos_token"};
    bool *flags[2] = {&t->add_bos, &t->add_eos};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = jget(tcfg, fk[i]);
        if (!v || cJSON_IsNull(v)) continue;
        if (!cJSON_IsBool(v)) return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s': expected true or false", tcfg_path, fk[i]);
        *flags[i] = cJSON_IsTrue(v);
        if (*flags[i] && *ids[i] < 0)
            return kvq_fail(err, KVQ_EFORMAT, "%s: key '%s' is true but no %s token is defined (tokenizer.json post_processor or '%s')",
                            tcfg_path, fk[i], i ? "EOS" : "BOS", keys[i]);
    }
    return KVQ_OK;
}

static kvq_status from_hf(const cJSON *root, const char *path, const cJSON *tcfg, const char *tcfg_path, kvq_tokenizer **out,
                          kvq_err *err)
{
    const cJSON *model = jget(root, "model");
    if (!cJSON_IsObject(model)) return kvq_fail(err, KVQ_EFORMAT, "%s: \"model\": missing or not an object", path);
    const cJSON *mt = jget(model, "type");
    if (mt && !(cJSON_IsString(mt) && !strcmp(mt->valuestring, "BPE")))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: model.type = \"%s\": only \"BPE\" is supported", path,
                        cJSON_IsString(mt) ? mt->valuestring : "?");
    const cJSON *vocab = jget(model, "vocab"), *merges = jget(model, "merges"), *added = jget(root, "added_tokens");
    if (!cJSON_IsObject(vocab)) return kvq_fail(err, KVQ_EFORMAT, "%s: model.vocab: missing or not an object", path);
    if (!cJSON_IsArray(merges)) return kvq_fail(err, KVQ_EFORMAT, "%s: model.merges: missing or not an array (a BPE vocabulary needs its merges)", path);
    bool bytelevel = false, bl_prefix = false, ms_prefix = false;
    int pre = hf_pre(jget(root, "pre_tokenizer"), &bytelevel, &bl_prefix);
    int ms = hf_metaspace(root, &ms_prefix);
    if (pre < 0 || ms < 0 || (!bytelevel && ms != 1))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: normalizer/pre_tokenizer combination not supported (kvq handles ByteLevel, "
                        "Digits/Split(\\p{N})+ByteLevel, and the Llama-2 Metaspace normalizer)", path);
    int64_t maxid = -1;
    size_t blob = 0;
    int nv = 0;
    for (const cJSON *e = vocab->child; e; e = e->next, nv++) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 30) || !e->string)
            return kvq_fail(err, KVQ_EFORMAT, "%s: model.vocab[\"%.64s\"]: id must be an integer in [0, 2^30)", path, e->string ? e->string : "?");
        if ((int64_t)e->valuedouble > maxid) maxid = (int64_t)e->valuedouble;
        blob += strlen(e->string);
    }
    for (int i = 0; i < cJSON_GetArraySize(added); i++) {
        const cJSON *e = cJSON_GetArrayItem(added, i), *c = jget(e, "content"), *id = jget(e, "id");
        if (!cJSON_IsString(c) || !cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= (1 << 30))
            return kvq_fail(err, KVQ_EFORMAT, "%s: added_tokens[%d]: expected {\"id\": int, \"content\": string}", path, i);
        if ((int64_t)id->valuedouble > maxid) maxid = (int64_t)id->valuedouble;
        blob += strlen(c->valuestring);
    }
    if (maxid < 0) return kvq_fail(err, KVQ_EFORMAT, "%s: model.vocab is empty", path);
    /* ids index arrays of maxid + 1 entries: a vocabulary with more holes than tokens (id 10^9 among
     * 12 entries asked for 1.6 GB) is refused, so memory stays bounded by the file's size */
    const int64_t n_entries = (int64_t)nv + cJSON_GetArraySize(added);
    if (maxid >= 2 * n_entries + 1024)
        return kvq_fail(err, KVQ_EFORMAT, "%s: model.vocab / added_tokens: id %lld for %lld entries (expected ids below %lld: "
                        "a vocabulary numbered 0..n-1, with few holes)", path, (long long)maxid, (long long)n_entries,
                        (long long)(2 * n_entries + 1024));
    int32_t n = (int32_t)maxid + 1;
    kvq_tokenizer *t = tok_alloc(n, blob);
    if (!t) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate %d tokens", path, n);
    kvq_status s = KVQ_OK;
    t->kind = bytelevel ? KVQ_TOK_BPE_BYTES : KVQ_TOK_SPM;
    t->use_ranks = !bytelevel;
    t->pre = bytelevel ? pre : PRE_NONE;
    t->add_space_prefix = bytelevel ? bl_prefix : ms_prefix;
    for (int32_t i = 0; i < n; i++) t->type[i] = KVQ_TOKTYPE_UNUSED;
    size_t bo = 0;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int32_t id = (int32_t)e->valuedouble;
        size_t l = strlen(e->string);
        if (t->type[id] != KVQ_TOKTYPE_UNUSED) { s = kvq_fail(err, KVQ_EFORMAT, "%s: model.vocab: id %d assigned twice", path, id); goto fail; }
        memcpy(t->blob + bo, e->string, l);
        t->off[id] = bo; t->len[id] = (uint32_t)l; bo += l;
        t->type[id] = KVQ_TOKTYPE_NORMAL;
    }
    for (int i = 0; i < cJSON_GetArraySize(added); i++) {
        const cJSON *e = cJSON_GetArrayItem(added, i);
        int32_t id = (int32_t)jget(e, "id")->valuedouble;
        const char *c = jget(e, "content")->valuestring;
        size_t l = strlen(c);
        memcpy(t->blob + bo, c, l);
        t->off[id] = bo; t->len[id] = (uint32_t)l; bo += l;
        t->type[id] = cJSON_IsTrue(jget(e, "special")) ? KVQ_TOKTYPE_CONTROL : KVQ_TOKTYPE_USER_DEFINED;
    }
    const cJSON *unk = jget(model, "unk_token");
    if (cJSON_IsString(unk)) t->unk = hf_token_id(root, vocab, unk->valuestring);
    if (t->unk >= 0 && t->type[t->unk] == KVQ_TOKTYPE_NORMAL) t->type[t->unk] = KVQ_TOKTYPE_UNKNOWN;
    /* BOS: a TemplateProcessing post_processor whose "single" starts with a SpecialToken */
    const cJSON *pp = jget(root, "post_processor");
    const cJSON *single = jget(pp, "single");
    if (jtype_is(pp, "TemplateProcessing") && cJSON_IsArray(single)) {
        const cJSON *first = cJSON_GetArrayItem(single, 0), *st = jget(jget(first, "SpecialToken"), "id");
        if (cJSON_IsString(st)) { t->bos = hf_token_id(root, vocab, st->valuestring); t->add_bos = t->bos >= 0; }
        const cJSON *last = cJSON_GetArrayItem(single, cJSON_GetArraySize(single) - 1);
        const cJSON *se = jget(jget(last, "SpecialToken"), "id");
        if (cJSON_GetArraySize(single) > 1 && cJSON_IsString(se)) { t->eos = hf_token_id(root, vocab, se->valuestring); t->add_eos = t->eos >= 0; }
    }
    if (tcfg && (s = apply_tcfg(t, root, vocab, tcfg, tcfg_path, err))) goto fail;
    if ((s = tok_finish(t, path, err))) goto fail;
    if ((s = merges_alloc(t, (size_t)cJSON_GetArraySize(merges), path, err))) goto fail;
    int32_t rank = 0;
    for (const cJSON *e = merges->child; e; e = e->next, rank++) {
        if (cJSON_IsString(e)) s = merge_add_line(t, e->valuestring, strlen(e->valuestring), rank, path, "model.merges", err);
        else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) && cJSON_IsString(e->child->next))
            s = merge_add(t, e->child->valuestring, strlen(e->child->valuestring), e->child->next->valuestring,
                          strlen(e->child->next->valuestring), rank, path, "model.merges", err);
        else s = kvq_fail(err, KVQ_EFORMAT, "%s: model.merges[%d]: expected \"A B\" or [\"A\", \"B\"]", path, rank);
        if (s) goto fail;
    }
    snprintf(t->desc, sizeof t->desc, "hf-json %s vocab %d merges %d", bytelevel ? (pre == PRE_STARCODER ? "bytelevel/digits" : "bytelevel") : "metaspace", n, t->n_merges);
    if (t->n_dup) snprintf(t->desc + strlen(t->desc), sizeof t->desc - strlen(t->desc), " duplicates %d", t->n_dup);
    *out = t;
    return KVQ_OK;
fail:
    kvq_tokenizer_free(t);
    return s;
}

/* Parse a whole JSON file; *root NULL and KVQ_OK when `optional` and the file does not exist. */
static kvq_status json_file(const char *path, bool optional, cJSON **root, kvq_err *err)
{
    *root = NULL;
    if (optional && access(path, F_OK) != 0 && errno == ENOENT) return KVQ_OK;
    char *d;
    size_t n;
    KVQ_TRY(slurp(path, &d, &n, err));
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(d, n, &end, 0);
    if (!*root) {
        size_t at = end ? (size_t)(end - d) : 0;
        free(d);
        return kvq_fail(err, KVQ_EFORMAT, "%s: offset %zu: invalid JSON", path, at);
    }
    free(d);
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return kvq_fail(err, KVQ_EFORMAT, "%s: expected a JSON object at the top level", path);
    }
    return KVQ_OK;
}

kvq_status kvq_tokenizer_from_hf_json(const char *path, kvq_tokenizer **out, kvq_err *err)
{
    *out = NULL;
    cJSON *root, *tcfg = NULL;
    KVQ_TRY(json_file(path, false, &root, err));
    /* a file named tokenizer.json reads its neighbour tokenizer_config.json */
    char tcfg_path[4096] = "";
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    kvq_status s = KVQ_OK;
    if (!strcmp(base, "tokenizer.json")) {
        int dl = (int)(base - path);
        int k = snprintf(tcfg_path, sizeof tcfg_path, "%.*stokenizer_config.json", dl, path);
        if (k < 0 || (size_t)k >= sizeof tcfg_path) s = kvq_fail(err, KVQ_EINVAL, "%s: path too long", path);
        else s = json_file(tcfg_path, true, &tcfg, err);
    }
    if (!s) s = from_hf(root, path, tcfg, tcfg_path, out, err);
    cJSON_Delete(tcfg);
    cJSON_Delete(root);
    return s;
}

kvq_status kvq_tokenizer_for_model(const char *model_path, const char *tokenizer, kvq_tokenizer **out, kvq_err *err)
{
    *out = NULL;
    char p[4096];
    KVQ_TRY(kvq_model_tokenizer_path(model_path, tokenizer, p, sizeof p, err));
    return kvq_tokenizer_load(p, out, err);
}

kvq_status kvq_tokenizer_load(const char *path, kvq_tokenizer **out, kvq_err *err)
{
    *out = NULL;
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a tokenizer file", &f, err));
    unsigned char h[64];
    size_t got = fread(h, 1, sizeof h, f);
    fclose(f);
    if (got >= 4 && !memcmp(h, "GGUF", 4)) return kvq_tokenizer_from_gguf(path, out, err);
    size_t i = 0;
    while (i < got && (h[i] == ' ' || h[i] == '\n' || h[i] == '\r' || h[i] == '\t')) i++;
    if (i < got && h[i] == '{') return kvq_tokenizer_from_hf_json(path, out, err);
    return kvq_tokenizer_from_llama2c(path, 0, out, err);
}

/* ---------- encode ---------- */

typedef struct { int32_t prev, next; uint32_t start, n; int32_t id; } sym_t;
typedef struct { float key; int32_t l, r, lid, rid, merged; uint32_t size; } bigram_t;

typedef struct {
    const kvq_tokenizer *t;
    ivec out;
    sym_t *sym; size_t sym_cap;
    bigram_t *heap; size_t hn, hcap;
    bvec buf;
    pcre2_match_data *md;
    kvq_err *err;
} enc_ctx;

static int heap_less(const bigram_t *a, const bigram_t *b) { return a->key < b->key || (a->key == b->key && a->l < b->l); }

static int heap_push(enc_ctx *c, bigram_t b)
{
    if (c->hn == c->hcap) {
        size_t nc = c->hcap ? c->hcap * 2 : 64;
        bigram_t *p = realloc(c->heap, nc * sizeof *p);
        if (!p) return 1;
        c->heap = p; c->hcap = nc;
    }
    size_t i = c->hn++;
    while (i > 0) {
        size_t par = (i - 1) / 2;
        if (!heap_less(&b, &c->heap[par])) break;
        c->heap[i] = c->heap[par];
        i = par;
    }
    c->heap[i] = b;
    return 0;
}

static bigram_t heap_pop(enc_ctx *c)
{
    bigram_t top = c->heap[0], last = c->heap[--c->hn];
    size_t i = 0;
    for (;;) {
        size_t k = 2 * i + 1;
        if (k >= c->hn) break;
        if (k + 1 < c->hn && heap_less(&c->heap[k + 1], &c->heap[k])) k++;
        if (!heap_less(&c->heap[k], &last)) break;
        c->heap[i] = c->heap[k];
        i = k;
    }
    if (c->hn) c->heap[i] = last;
    return top;
}

static int try_bigram(enc_ctx *c, const char *text, int32_t l, int32_t r)
{
    if (l < 0 || r < 0) return 0;
    const kvq_tokenizer *t = c->t;
    const sym_t *a = &c->sym[l], *b = &c->sym[r];
    bigram_t g = {0, l, r, a->id, b->id, -1, a->n + b->n};
    if (t->kind == KVQ_TOK_BPE_BYTES || t->use_ranks) {
        int32_t rank;
        if (!pair_find(t, a->id, b->id, &rank, &g.merged)) return 0;
        g.key = (float)rank;
    } else {
        g.merged = kvq_tokenizer_find(t, text + a->start, (size_t)a->n + b->n);
        if (g.merged < 0) return 0;
        g.key = -t->score[g.merged];
    }
    return heap_push(c, g);
}

/* Merge the symbols of one word (text[0..n) with symbols already set up) and emit ids. */
static kvq_status merge_word(enc_ctx *c, const char *text, int32_t ns)
{
    const kvq_tokenizer *t = c->t;
    c->hn = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (try_bigram(c, text, i, i + 1)) return kvq_fail(c->err, KVQ_ENOMEM, "tokenizer: out of memory");
    while (c->hn) {
        bigram_t g = heap_pop(c);
        sym_t *a = &c->sym[g.l], *b = &c->sym[g.r];
        if (a->n == 0 || b->n == 0 || a->next != g.r || a->id != g.lid || b->id != g.rid || a->n + b->n != g.size) continue;
        a->n += b->n;
        a->id = g.merged;
        a->next = b->next;
        if (b->next >= 0) c->sym[b->next].prev = g.l;
        b->n = 0;
        if (try_bigram(c, text, a->prev, g.l) || try_bigram(c, text, g.l, a->next))
            return kvq_fail(c->err, KVQ_ENOMEM, "tokenizer: out of memory");
    }
    for (int32_t i = 0; i >= 0 && ns > 0; i = c->sym[i].next) {
        const sym_t *s = &c->sym[i];
        int r = 0;
        if (s->id >= 0) r = ivec_push(&c->out, s->id);
        else {
            /* byte fallback: every byte of the symbol as its byte token; else <unk> once */
            int all = 1;
            for (uint32_t k = 0; k < s->n; k++) all &= t->byte_tok[(uint8_t)text[s->start + k]] >= 0;
            if (all) for (uint32_t k = 0; k < s->n && !r; k++) r = ivec_push(&c->out, t->byte_tok[(uint8_t)text[s->start + k]]);
            else if (t->unk >= 0) r = ivec_push(&c->out, t->unk);
            else return kvq_fail(c->err, KVQ_EUNSUPPORTED, "tokenizer: byte 0x%02X has no token and the vocabulary has no <unk>",
                                 (uint8_t)text[s->start]);
        }
        if (r) return kvq_fail(c->err, KVQ_ENOMEM, "tokenizer: out of memory");
    }
    return KVQ_OK;
}

static int ensure_sym(enc_ctx *c, size_t n)
{
    if (n <= c->sym_cap) return 0;
    size_t nc = c->sym_cap ? c->sym_cap : 64;
    while (nc < n) nc *= 2;
    sym_t *p = realloc(c->sym, nc * sizeof *p);
    if (!p) return 1;
    c->sym = p; c->sym_cap = nc;
    return 0;
}

/* Byte-level word: one symbol per byte. */
static kvq_status bpe_word(enc_ctx *c, const char *s, size_t n)
{
    if (n == 0) return KVQ_OK;
    if (n > INT32_MAX / 2 || ensure_sym(c, n)) return kvq_fail(c->err, KVQ_ENOMEM, "tokenizer: out of memory (word of %zu bytes)", n);
    for (size_t i = 0; i < n; i++)
        c->sym[i] = (sym_t){(int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1, (uint32_t)i, 1, c->t->byte_tok[(uint8_t)s[i]]};
    return merge_word(c, s, (int32_t)n);
}

static kvq_status pretok(enc_ctx *c, int level, const char *s, size_t n)
{
    const kvq_tokenizer *t = c->t;
    if (level >= t->n_re) return bpe_word(c, s, n);
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(t->re[level], (PCRE2_SPTR)s, n, pos, 0, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR buf[256];
            pcre2_get_error_message(rc, buf, sizeof buf);
            return kvq_fail(c->err, KVQ_EUNSUPPORTED, "tokenizer: pre-tokenizer regex failed at byte %zu: %s", pos, (const char *)buf);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms || ms < pos) break; /* empty match: cannot happen with these patterns; rest is one piece */
        if (ms > pos) KVQ_TRY(pretok(c, level + 1, s + pos, ms - pos));
        KVQ_TRY(pretok(c, level + 1, s + ms, me - ms));
        pos = me;
    }
    if (pos < n) KVQ_TRY(pretok(c, level + 1, s + pos, n - pos));
    return KVQ_OK;
}

/* SentencePiece path: escape spaces, optional prefix, characters as symbols. */
static kvq_status spm_fragment(enc_ctx *c, const char *s, size_t n, bool prefix)
{
    c->buf.n = 0;
    int e = 0;
    if (prefix) e |= bvec_put(&c->buf, "\xe2\x96\x81", 3);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            e |= bvec_put(&c->buf, s + run, i - run);
            e |= bvec_put(&c->buf, "\xe2\x96\x81", 3);
            run = i + 1;
        }
    }
    e |= bvec_put(&c->buf, s + run, n - run);
    if (e || c->buf.n > INT32_MAX / 2 || ensure_sym(c, c->buf.n))
        return kvq_fail(c->err, KVQ_ENOMEM, "tokenizer: out of memory (fragment of %zu bytes)", n);
    const char *b = c->buf.v;
    size_t bn = c->buf.n;
    int32_t ns = 0;
    for (size_t i = 0; i < bn;) {
        size_t k = utf8_seq((const uint8_t *)b + i, bn - i, NULL);
        if (k == 0) k = 1; /* invalid byte: a character of its own (byte fallback) */
        c->sym[ns] = (sym_t){ns - 1, -1, (uint32_t)i, (uint32_t)k, kvq_tokenizer_find(c->t, b + i, k)};
        if (ns > 0) c->sym[ns - 1].next = ns;
        ns++;
        i += k;
    }
    return merge_word(c, b, ns);
}

typedef struct { size_t start, len; int32_t tok; } frag_t;

kvq_status kvq_tokenizer_encode(const kvq_tokenizer *t, const char *text, size_t len, unsigned flags, int32_t **ids,
                                size_t *n, kvq_err *err)
{
    *ids = NULL;
    *n = 0;
    if (!text && len) return kvq_fail(err, KVQ_EINVAL, "kvq_tokenizer_encode: text is NULL with length %zu", len);
    bool add_bos = (flags & KVQ_TOK_ADD_BOS) || ((flags & KVQ_TOK_ADD_BOS_DEFAULT) && t->add_bos);
    bool add_eos = (flags & KVQ_TOK_ADD_EOS) || ((flags & KVQ_TOK_ADD_EOS_DEFAULT) && t->add_eos);
    if (add_bos && t->bos < 0) return kvq_fail(err, KVQ_EINVAL, "kvq_tokenizer_encode: BOS requested but %s has no BOS token", t->desc);
    if (add_eos && t->eos < 0) return kvq_fail(err, KVQ_EINVAL, "kvq_tokenizer_encode: EOS requested but %s has no EOS token", t->desc);
    enc_ctx c = {.t = t, .err = err};
    kvq_status s = KVQ_OK;
    frag_t *fr = NULL, *nf = NULL;
    size_t nfr = 0;
    if (t->n_re) {
        c.md = pcre2_match_data_create(4, NULL);
        if (!c.md) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
    }
    if (add_bos && ivec_push(&c.out, t->bos)) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
    /* special-token partition (llama.cpp tokenizer_st_partition): longest special first */
    if (len) {
        fr = malloc(sizeof *fr);
        if (!fr) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
        fr[0] = (frag_t){0, len, -1};
        nfr = 1;
    }
    for (int32_t si = 0; si < t->n_special && nfr; si++) {
        int32_t id = t->special[si];
        if (t->type[id] != KVQ_TOKTYPE_USER_DEFINED && !(flags & KVQ_TOK_PARSE_SPECIAL)) continue;
        const char *st = t->blob + t->off[id];
        size_t sl = t->len[id];
        size_t cnt = 0;
        for (size_t f = 0; f < nfr; f++) {
            if (fr[f].tok >= 0) continue;
            const char *p = text + fr[f].start, *e = p + fr[f].len;
            while ((p = memmem(p, (size_t)(e - p), st, sl))) { cnt++; p += sl; }
        }
        if (!cnt) continue;
        size_t cap = nfr + 2 * cnt;
        nf = malloc(cap * sizeof *nf);
        if (!nf) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
        size_t k = 0;
        for (size_t f = 0; f < nfr; f++) {
            if (fr[f].tok >= 0) { nf[k++] = fr[f]; continue; }
            size_t a = fr[f].start, e = fr[f].start + fr[f].len;
            const char *p;
            while (a < e && (p = memmem(text + a, e - a, st, sl))) {
                size_t at = (size_t)(p - text);
                if (at > a) nf[k++] = (frag_t){a, at - a, -1};
                nf[k++] = (frag_t){at, sl, id};
                a = at + sl;
            }
            if (a < e) nf[k++] = (frag_t){a, e - a, -1};
        }
        free(fr);
        fr = nf;
        nf = NULL;
        nfr = k;
    }
    bool prev_special = true;
    for (size_t f = 0; f < nfr; f++) {
        if (fr[f].tok >= 0) {
            if (ivec_push(&c.out, fr[f].tok)) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
            prev_special = true;
            continue;
        }
        const char *p = text + fr[f].start;
        size_t l = fr[f].len;
        if (t->kind == KVQ_TOK_SPM) s = spm_fragment(&c, p, l, t->add_space_prefix && prev_special);
        else if (t->add_space_prefix && prev_special && p[0] != ' ') {
            /* HF ByteLevel(add_prefix_space): a space before the fragment */
            c.buf.n = 0;
            if (bvec_put(&c.buf, " ", 1) || bvec_put(&c.buf, p, l)) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
            bvec copy = c.buf;
            c.buf = (bvec){0};
            s = pretok(&c, 0, copy.v, copy.n);
            free(copy.v);
        } else s = pretok(&c, 0, p, l);
        if (s) goto done;
        prev_special = false;
    }
    if (add_eos && ivec_push(&c.out, t->eos)) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
    if (!c.out.v) { c.out.v = malloc(sizeof(int32_t)); if (!c.out.v) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; } }
    *ids = c.out.v;
    *n = c.out.n;
    c.out.v = NULL;
done:
    free(c.out.v); free(c.sym); free(c.heap); free(c.buf.v); free(fr); free(nf);
    if (c.md) pcre2_match_data_free(c.md);
    return s;
}

/* ---------- decode ---------- */

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
}

kvq_status kvq_tokenizer_decode(const kvq_tokenizer *t, const int32_t *ids, size_t n, unsigned flags, char **text,
                                size_t *len, kvq_err *err)
{
    *text = NULL;
    *len = 0;
    bvec o = {0};
    int e = bvec_put(&o, "", 0);
    bool strip = t->add_space_prefix && !(flags & KVQ_TOK_KEEP_LEADING_SPACE);
    for (size_t i = 0; i < n && !e; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) {
            free(o.v);
            return kvq_fail(err, KVQ_EINVAL, "kvq_tokenizer_decode: ids[%zu] = %d is outside [0, %d)", i, id, t->n_vocab);
        }
        const char *s = t->blob + t->off[id];
        size_t l = t->len[id];
        int ty = t->type[id];
        size_t before = o.n;
        if (ty == KVQ_TOKTYPE_CONTROL || ty == KVQ_TOKTYPE_UNKNOWN || ty == KVQ_TOKTYPE_UNUSED) {
            if (flags & KVQ_TOK_DECODE_SPECIAL) e |= bvec_put(&o, s, l);
            continue; /* does not consume the leading-space strip */
        }
        if (ty == KVQ_TOKTYPE_USER_DEFINED) e |= bvec_put(&o, s, l);
        else if (ty == KVQ_TOKTYPE_BYTE && l == 6 && hexval(s[3]) >= 0 && hexval(s[4]) >= 0) {
            char b = (char)(hexval(s[3]) * 16 + hexval(s[4]));
            e |= bvec_put(&o, &b, 1);
        } else if (t->kind == KVQ_TOK_BPE_BYTES) {
            for (size_t k = 0; k < l && !e;) {
                uint32_t cp;
                size_t q = utf8_seq((const uint8_t *)s + k, l - k, &cp);
                if (q == 0) { e |= bvec_put(&o, s + k, 1); k++; continue; }
                if (cp < 324 && t->cp2b[cp] >= 0) { char b = (char)t->cp2b[cp]; e |= bvec_put(&o, &b, 1); }
                else e |= bvec_put(&o, s + k, q);
                k += q;
            }
        } else {
            size_t run = 0;
            for (size_t k = 0; k + 3 <= l; k++)
                if (!memcmp(s + k, "\xe2\x96\x81", 3)) { e |= bvec_put(&o, s + run, k - run); e |= bvec_put(&o, " ", 1); run = k + 3; k += 2; }
            e |= bvec_put(&o, s + run, l - run);
        }
        if (strip) {
            if (o.n > before && o.v[before] == ' ') { memmove(o.v + before, o.v + before + 1, o.n - before); o.n--; }
            strip = false;
        }
    }
    if (e) { free(o.v); return kvq_fail(err, KVQ_ENOMEM, "kvq_tokenizer_decode: out of memory"); }
    *text = o.v;
    *len = o.n;
    return KVQ_OK;
}

/* ---------- accessors ---------- */

int32_t kvq_tokenizer_byte_token(const kvq_tokenizer *t, uint8_t b) { return t->byte_tok[b]; }
int32_t kvq_tokenizer_n_vocab(const kvq_tokenizer *t) { return t->n_vocab; }
kvq_status kvq_tokenizer_check_vocab(const kvq_tokenizer *t, int32_t model_vocab, const char *what, kvq_err *err)
{
    if (t->n_vocab > model_vocab)
        return kvq_fail(err, KVQ_EMISMATCH, "%s: tokenizer has %d tokens, the model's vocabulary only %d: wrong --tokenizer?", what,
                        t->n_vocab, model_vocab);
    if (!strncmp(t->desc, "llama2c ", 8) && t->n_vocab != model_vocab) /* run.c reads exactly vocab_size records */
        return kvq_fail(err, KVQ_EMISMATCH,
                        "%s: llama2.c tokenizer has %d token records, the model's vocab_size is %d (a llama2.c tokenizer has exactly "
                        "one per id): truncated, or another model's --tokenizer?",
                        what, t->n_vocab, model_vocab);
    if ((int64_t)t->n_vocab * 10 < (int64_t)model_vocab * 9)
        return kvq_fail(err, KVQ_EMISMATCH,
                        "%s: tokenizer has %d tokens, the model's vocabulary %d (a model pads its vocabulary by a few rows at most): "
                        "another model's --tokenizer?",
                        what, t->n_vocab, model_vocab);
    return KVQ_OK;
}
int32_t kvq_tokenizer_bos(const kvq_tokenizer *t) { return t->bos; }
int32_t kvq_tokenizer_eos(const kvq_tokenizer *t) { return t->eos; }
bool kvq_tokenizer_add_bos_default(const kvq_tokenizer *t) { return t->add_bos; }
kvq_tok_kind kvq_tokenizer_kind(const kvq_tokenizer *t) { return t->kind; }
const char *kvq_tokenizer_describe(const kvq_tokenizer *t) { return t->desc; }

kvq_toktype kvq_tokenizer_token_type(const kvq_tokenizer *t, int32_t id)
{
    return id < 0 || id >= t->n_vocab ? KVQ_TOKTYPE_UNDEFINED : (kvq_toktype)t->type[id];
}

const char *kvq_tokenizer_token_text(const kvq_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab) { if (len) *len = 0; return NULL; }
    if (len) *len = t->len[id];
    return t->blob + t->off[id];
}
