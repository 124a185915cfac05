/* tokenizer_load.c — the tokenizer loaders (tokenizer.h): GGUF, llama2.c tokenizer.bin, HF tokenizer.json (+
 * tokenizer_config.json), and the dispatch by file contents. They fill a kvq_tokenizer through tokenizer.c's
 * vocabulary construction (tokenizer_internal.h). */
#include "tokenizer_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "loaders.h"
#include "model.h"
#include "sniff.h"

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
    kvq_tokenizer *t = kvqi_tok_alloc(n, blob);
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
    if ((s = kvqi_tok_finish(t, src, err))) goto fail;
    if (merges) {
        if ((s = kvqi_merges_alloc(t, merges->arr_n, src, err))) goto fail;
        for (uint64_t i = 0; i < merges->arr_n; i++)
            if ((s = kvqi_merge_add_line(t, merges->arr_str[i].str, merges->arr_str[i].len, (int32_t)i, src,
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
        if (kvqi_bvec_put(&b, buf, got)) { fclose(f); free(b.v); return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory reading", path); }
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
    t = kvqi_tok_alloc(cnt, blob);
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
    if ((s = kvqi_tok_finish(t, path, err))) goto done;
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
    kvq_tokenizer *t = kvqi_tok_alloc(n, blob);
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
    if ((s = kvqi_tok_finish(t, path, err))) goto fail;
    if ((s = kvqi_merges_alloc(t, (size_t)cJSON_GetArraySize(merges), path, err))) goto fail;
    int32_t rank = 0;
    for (const cJSON *e = merges->child; e; e = e->next, rank++) {
        if (cJSON_IsString(e)) s = kvqi_merge_add_line(t, e->valuestring, strlen(e->valuestring), rank, path, "model.merges", err);
        else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) && cJSON_IsString(e->child->next))
            s = kvqi_merge_add(t, e->child->valuestring, strlen(e->child->valuestring), e->child->next->valuestring,
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

