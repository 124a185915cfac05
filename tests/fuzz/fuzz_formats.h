/* fuzz_formats.h — one fuzz step over kvq's file readers, shared by the
 * libFuzzer harness (tests/fuzz/fuzz_formats.c, scripts/fuzz_formats.sh) and
 * the Check replay of saved inputs (tests/test_fuzz_formats.c,
 * tests/fixtures/fuzz-formats/).
 *
 * Input: byte 0 picks the reader (data[0] % KVQ_FZ_SLOTS; slots past KVQ_FZ_N
 * are spare and do nothing, so a reader added in one keeps every saved input's
 * meaning); byte 1 is a per-reader option; readers of two files (HF
 * checkpoint: config.json + weights; HF tokenizer: tokenizer.json +
 * tokenizer_config.json) take bytes 2..3 as the little-endian length of the
 * first file, the rest as the second. The files are written into `dir` (a
 * private directory) under the names the readers expect and loaded from there.
 *
 * Checks: the reader returns KVQ_OK, or an error whose message is non-empty
 * and names the file it read (the status.h convention); a loaded model has
 * valid hyperparameters; a loaded tokenizer encodes and decodes a short text
 * (or fails with a message); a read artifact validates and kvcalib --inspect's
 * printer accepts it. Crashes, leaks and undefined behaviour are left to the
 * sanitizers.
 * Returns NULL when fine, else a description (static text). */
#ifndef KVQ_FUZZ_FORMATS_H
#define KVQ_FUZZ_FORMATS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "artifact.h"
#include "gguf.h"
#include "loaders.h"
#include "model.h"
#include "safetensors.h"
#include "text.h"
#include "tokenizer.h"

enum {
    KVQ_FZ_GGUF = 0,       /* kvq_gguf_open + every getter on every key */
    KVQ_FZ_MODEL_GGUF,     /* kvq_model_load_gguf */
    KVQ_FZ_TOK_GGUF,       /* kvq_tokenizer_from_gguf */
    KVQ_FZ_LLAMA2C,        /* kvq_model_load_llama2c */
    KVQ_FZ_TOK_LLAMA2C,    /* kvq_tokenizer_from_llama2c (vocab from byte 1) and kvq_tokenizer_load */
    KVQ_FZ_SAFETENSORS,    /* kvq_safetensors_open + read_f32 of every tensor */
    KVQ_FZ_HF_CKPT,        /* config.json + model.safetensors → kvq_model_load_safetensors */
    KVQ_FZ_TOK_HF,         /* tokenizer.json + tokenizer_config.json → kvq_tokenizer_from_hf_json */
    KVQ_FZ_TEXT,           /* kvq_text_read, format and EOL mode from byte 1 */
    KVQ_FZ_ARTIFACT,       /* kvq_artifact_read (validated), then kvq_artifact_inspect */
    KVQ_FZ_N,
    KVQ_FZ_SLOTS = 16
};

static inline int kvq_fz_write(const char *path, const uint8_t *d, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = (n == 0 || fwrite(d, 1, n, f) == n);
    ok &= fclose(f) == 0;
    return ok ? 0 : -1;
}

/* The error convention: a message that names the file (for readers of two
 * files, either one: name2 non-NULL). */
static inline const char *kvq_fz_check_err2(kvq_status s, const kvq_err *e, const char *name, const char *name2)
{
    if (s == KVQ_OK) return NULL;
    if (e->msg[0] == 0) return "error without a message";
    if (!strstr(e->msg, name) && !(name2 && strstr(e->msg, name2))) return "error message does not name the file";
    return NULL;
}

static inline const char *kvq_fz_check_err(kvq_status s, const kvq_err *e, const char *name)
{
    return kvq_fz_check_err2(s, e, name, NULL);
}

/* A loaded tokenizer encodes and decodes a short text, or fails with a message
 * (a vocabulary without the text's characters and without <unk> is refused at
 * encode time, naming the byte). */
static inline const char *kvq_fz_check_tok(kvq_tokenizer *tok)
{
    static const char text[] = "Hello world 123";
    int32_t *ids = NULL;
    size_t n = 0;
    kvq_err e = {0};
    const char *bad = NULL;
    if (kvq_tokenizer_encode(tok, text, sizeof text - 1, KVQ_TOK_ADD_BOS_DEFAULT, &ids, &n, &e) != KVQ_OK)
        return e.msg[0] ? NULL : "encode error without a message";
    for (size_t i = 0; i < n && !bad; i++)
        if (ids[i] < 0 || ids[i] >= kvq_tokenizer_n_vocab(tok)) bad = "a loaded tokenizer gave an id out of range";
    char *back = NULL;
    size_t bl = 0;
    if (!bad && kvq_tokenizer_decode(tok, ids, n, 0, &back, &bl, &e) != KVQ_OK && !e.msg[0])
        bad = "decode error without a message";
    free(back);
    free(ids);
    return bad;
}

static inline const char *kvq_fz_gguf(const char *path)
{
    kvq_gguf g;
    kvq_err e = {0};
    kvq_status s = kvq_gguf_open(path, &g, &e);
    const char *bad = kvq_fz_check_err(s, &e, "in.gguf");
    if (s != KVQ_OK) return bad;
    for (uint64_t i = 0; i < g.n_kv; i++) {
        const kvq_gguf_kv *kv = &g.kv[i];
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)(kv->key.len < 255 ? kv->key.len : 255), kv->key.str);
        int64_t iv;
        double fv;
        bool bv;
        kvq_gguf_str sv;
        const kvq_gguf_kv *av;
        kvq_err e2 = {0};
        (void)kvq_gguf_get_int(&g, key, true, &iv, &e2);
        (void)kvq_gguf_get_float(&g, key, true, &fv, &e2);
        (void)kvq_gguf_get_bool(&g, key, true, &bv, &e2);
        (void)kvq_gguf_get_str(&g, key, true, &sv, &e2);
        if (kvq_gguf_get_arr(&g, key, kv->arr_type, &av, &e2) == KVQ_OK && av->arr_type != KVQ_GGUF_STRING)
            for (uint64_t j = 0; j < av->arr_n && j < 64; j++) {
                (void)kvq_gguf_arr_float(av, j);
                (void)kvq_gguf_arr_int(av, j);
            }
    }
    volatile uint64_t sum = 0; /* each tensor's first and last byte are read: ASan checks the offsets */
    for (uint64_t t = 0; t < g.n_tensors; t++) {
        const kvq_gguf_tensor *ti = &g.tensors[t];
        if (ti->size_known && ti->n_bytes) sum += ti->data[0] + ti->data[ti->n_bytes - 1];
    }
    kvq_gguf_close(&g);
    return NULL;
}

/* the GGUF loader in its default (auto) weights mode, and in native mode (blocks kept) every other time */
static inline kvq_status kvq_fz_load_gguf(const char *path, kvq_model *m, kvq_err *e)
{
    kvq_status s = kvq_model_load_gguf(path, KVQ_WEIGHTS_AUTO, m, e);
    if (s == KVQ_OK) {
        kvq_model m2;
        kvq_err e2 = {0};
        if (kvq_model_load_gguf(path, KVQ_WEIGHTS_NATIVE, &m2, &e2) == KVQ_OK) kvq_model_free(&m2);
    }
    return s;
}

static inline const char *kvq_fz_model(kvq_status (*load)(const char *, kvq_model *, kvq_err *), const char *path,
                                       const char *name)
{
    kvq_model m;
    kvq_err e = {0};
    kvq_status s = load(path, &m, &e);
    const char *bad = kvq_fz_check_err(s, &e, name);
    if (s != KVQ_OK) return bad;
    if (kvq_hparams_validate(&m.hp, path, &e) != KVQ_OK) bad = "a loaded model has invalid hyperparameters";
    kvq_model_free(&m);
    return bad;
}

static inline const char *kvq_fz_safetensors(const char *path)
{
    kvq_safetensors st;
    kvq_err e = {0};
    kvq_status s = kvq_safetensors_open(path, &st, &e);
    const char *bad = kvq_fz_check_err(s, &e, "in.safetensors");
    if (s != KVQ_OK) return bad;
    for (size_t t = 0; t < st.n_tensors && !bad; t++) {
        const kvq_st_tensor *ti = &st.tensors[t];
        if (ti->n_elements > ((size_t)1 << 24)) continue;
        float *out = malloc((ti->n_elements ? ti->n_elements : 1) * sizeof *out);
        if (!out) return "out of memory in the harness";
        kvq_err e2 = {0};
        kvq_status s2 = kvq_safetensors_read_f32(&st, ti, out, ti->n_elements, &e2);
        if (s2 != KVQ_OK && e2.msg[0] == 0) bad = "read_f32 error without a message";
        free(out);
    }
    kvq_safetensors_close(&st);
    return bad;
}

static inline const char *kvq_fz_tok(kvq_status s, kvq_tokenizer *tok, const kvq_err *e, const char *name)
{
    const char *bad = kvq_fz_check_err(s, e, name);
    if (s != KVQ_OK) return bad;
    bad = kvq_fz_check_tok(tok);
    kvq_tokenizer_free(tok);
    return bad;
}

static inline const char *kvq_fuzz_formats_one(const char *dir, const uint8_t *data, size_t size)
{
    if (size < 2 || data[0] % KVQ_FZ_SLOTS >= KVQ_FZ_N) return NULL;
    int which = data[0] % KVQ_FZ_SLOTS;
    uint8_t opt = data[1];
    const uint8_t *a = data + 2, *b = NULL;
    size_t na = size - 2, nb = 0;
    if (which == KVQ_FZ_HF_CKPT || which == KVQ_FZ_TOK_HF) {
        if (size < 4) return NULL;
        size_t la = (size_t)data[2] | (size_t)data[3] << 8;
        a = data + 4;
        na = size - 4;
        if (la < na) { b = a + la; nb = na - la; na = la; }
    }
    char p1[4200], p2[4200];
    const char *bad = NULL;
    kvq_err e = {0};
    kvq_tokenizer *tok = NULL;
    switch (which) {
    case KVQ_FZ_GGUF:
    case KVQ_FZ_MODEL_GGUF:
    case KVQ_FZ_TOK_GGUF:
        snprintf(p1, sizeof p1, "%s/in.gguf", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        if (which == KVQ_FZ_GGUF) bad = kvq_fz_gguf(p1);
        else if (which == KVQ_FZ_MODEL_GGUF) bad = kvq_fz_model(kvq_fz_load_gguf, p1, "in.gguf");
        else bad = kvq_fz_tok(kvq_tokenizer_from_gguf(p1, &tok, &e), tok, &e, "in.gguf");
        break;
    case KVQ_FZ_LLAMA2C:
        snprintf(p1, sizeof p1, "%s/in.bin", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        bad = kvq_fz_model(kvq_model_load_llama2c, p1, "in.bin");
        break;
    case KVQ_FZ_TOK_LLAMA2C:
        snprintf(p1, sizeof p1, "%s/tok.bin", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        if (opt & 1) bad = kvq_fz_tok(kvq_tokenizer_load(p1, &tok, &e), tok, &e, "tok.bin");
        else bad = kvq_fz_tok(kvq_tokenizer_from_llama2c(p1, (int32_t)(opt >> 1) + 3, &tok, &e), tok, &e, "tok.bin");
        break;
    case KVQ_FZ_SAFETENSORS:
        snprintf(p1, sizeof p1, "%s/in.safetensors", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        bad = kvq_fz_safetensors(p1);
        break;
    case KVQ_FZ_HF_CKPT:
        snprintf(p1, sizeof p1, "%s/config.json", dir);
        snprintf(p2, sizeof p2, "%s/model.safetensors", dir);
        if (kvq_fz_write(p1, a, na) || kvq_fz_write(p2, b, nb)) return "harness: cannot write";
        {
            kvq_model m;
            kvq_status s = kvq_model_load_safetensors(dir, KVQ_WEIGHTS_AUTO, &m, &e);
            bad = kvq_fz_check_err2(s, &e, "config.json", "model.safetensors"); /* either may be at fault */
            if (s == KVQ_OK) {
                if (kvq_hparams_validate(&m.hp, dir, &e) != KVQ_OK) bad = "a loaded model has invalid hyperparameters";
                kvq_model_free(&m);
            }
        }
        unlink(p2);
        break;
    case KVQ_FZ_TOK_HF:
        snprintf(p1, sizeof p1, "%s/tokenizer.json", dir);
        snprintf(p2, sizeof p2, "%s/tokenizer_config.json", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        if (b && kvq_fz_write(p2, b, nb)) return "harness: cannot write";
        {
            kvq_status s = kvq_tokenizer_from_hf_json(p1, &tok, &e);
            bad = kvq_fz_check_err2(s, &e, "tokenizer.json", "tokenizer_config.json");
            if (s == KVQ_OK) {
                bad = kvq_fz_check_tok(tok);
                kvq_tokenizer_free(tok);
            }
        }
        if (b) unlink(p2);
        break;
    case KVQ_FZ_ARTIFACT:
        snprintf(p1, sizeof p1, "%s/in.kvq", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        {
            kvq_artifact art;
            kvq_status s = kvq_artifact_read(p1, &art, &e);
            bad = kvq_fz_check_err(s, &e, "in.kvq");
            if (s == KVQ_OK) {
                if (kvq_artifact_validate(&art, &e) != KVQ_OK) bad = "a read artifact does not validate";
                kvq_artifact_free(&art);
                FILE *sink = tmpfile(); /* the printout itself is not checked */
                kvq_err e2 = {0};
                kvq_status s2 = sink ? kvq_artifact_inspect(sink, p1, &e2) : KVQ_OK;
                if (sink) fclose(sink);
                if (!bad && s2 != KVQ_OK) bad = "inspect failed on an artifact that reads";
            }
        }
        break;
    case KVQ_FZ_TEXT:
        snprintf(p1, sizeof p1, "%s/in.txt", dir);
        if (kvq_fz_write(p1, a, na)) return "harness: cannot write";
        {
            kvq_text t;
            kvq_status s = kvq_text_read(p1, (kvq_text_format)(opt % 3), (opt & 4) ? KVQ_EOL_KEEP : KVQ_EOL_TO_LF, &t, &e);
            bad = kvq_fz_check_err(s, &e, "in.txt");
            if (s == KVQ_OK) {
                volatile unsigned sum = 0; /* every row's bytes are read: ASan checks the offsets */
                for (size_t r = 0; r < t.n_rows; r++)
                    for (size_t k = 0; k < t.row_len[r]; k++) sum += (unsigned char)t.rows_base[t.row_off[r] + k];
                kvq_text_free(&t);
            }
        }
        break;
    }
    return bad;
}

#endif
