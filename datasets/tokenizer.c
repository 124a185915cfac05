/* tokenizer.c — see tokenizer.h. Vocabulary construction (the text hash, merges, the special-token partition,
 * the pre-tokenizer), the two merge engines (encode), decode and the accessors. The loaders (GGUF, llama2.c,
 * HF tokenizer.json) are in tokenizer_load.c; what the two share is in tokenizer_internal.h. */
#include "tokenizer_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The GPT-2 pattern (encoder.py), as HF ByteLevel(use_regex=true) uses it. */
static const char RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char RE_DIGIT[] = "\\p{N}";

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

int kvqi_bvec_put(bvec *a, const char *s, size_t n)
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

kvq_tokenizer *kvqi_tok_alloc(int32_t n_vocab, size_t blob_cap)
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
kvq_status kvqi_tok_finish(kvq_tokenizer *t, const char *src, kvq_err *err)
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
kvq_status kvqi_merges_alloc(kvq_tokenizer *t, size_t n, const char *src, kvq_err *err)
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

kvq_status kvqi_merge_add(kvq_tokenizer *t, const char *a, size_t na, const char *b, size_t nb, int32_t rank,
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
kvq_status kvqi_merge_add_line(kvq_tokenizer *t, const char *s, size_t n, int32_t rank, const char *src,
                          const char *field, kvq_err *err)
{
    const char *sp = memchr(s, ' ', n);
    if (!sp || sp == s || sp == s + n - 1 || memchr(sp + 1, ' ', n - (size_t)(sp - s) - 1))
        return kvq_fail(err, KVQ_EFORMAT, "%s: %s[%d] = \"%.*s\": expected \"LEFT RIGHT\" with one space", src, field, rank,
                        (int)(n > 64 ? 64 : n), s);
    return kvqi_merge_add(t, s, (size_t)(sp - s), sp + 1, n - (size_t)(sp - s) - 1, rank, src, field, err);
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
    if (prefix) e |= kvqi_bvec_put(&c->buf, "\xe2\x96\x81", 3);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            e |= kvqi_bvec_put(&c->buf, s + run, i - run);
            e |= kvqi_bvec_put(&c->buf, "\xe2\x96\x81", 3);
            run = i + 1;
        }
    }
    e |= kvqi_bvec_put(&c->buf, s + run, n - run);
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
            if (kvqi_bvec_put(&c.buf, " ", 1) || kvqi_bvec_put(&c.buf, p, l)) { s = kvq_fail(err, KVQ_ENOMEM, "tokenizer: out of memory"); goto done; }
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
    int e = kvqi_bvec_put(&o, "", 0);
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
            if (flags & KVQ_TOK_DECODE_SPECIAL) e |= kvqi_bvec_put(&o, s, l);
            continue; /* does not consume the leading-space strip */
        }
        if (ty == KVQ_TOKTYPE_USER_DEFINED) e |= kvqi_bvec_put(&o, s, l);
        else if (ty == KVQ_TOKTYPE_BYTE && l == 6 && hexval(s[3]) >= 0 && hexval(s[4]) >= 0) {
            char b = (char)(hexval(s[3]) * 16 + hexval(s[4]));
            e |= kvqi_bvec_put(&o, &b, 1);
        } else if (t->kind == KVQ_TOK_BPE_BYTES) {
            for (size_t k = 0; k < l && !e;) {
                uint32_t cp;
                size_t q = utf8_seq((const uint8_t *)s + k, l - k, &cp);
                if (q == 0) { e |= kvqi_bvec_put(&o, s + k, 1); k++; continue; }
                if (cp < 324 && t->cp2b[cp] >= 0) { char b = (char)t->cp2b[cp]; e |= kvqi_bvec_put(&o, &b, 1); }
                else e |= kvqi_bvec_put(&o, s + k, q);
                k += q;
            }
        } else {
            size_t run = 0;
            for (size_t k = 0; k + 3 <= l; k++)
                if (!memcmp(s + k, "\xe2\x96\x81", 3)) { e |= kvqi_bvec_put(&o, s + run, k - run); e |= kvqi_bvec_put(&o, " ", 1); run = k + 3; k += 2; }
            e |= kvqi_bvec_put(&o, s + run, l - run);
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
