/* test_model_gguf.c — the GGUF llama loader (formats/model_gguf.c):
 *   - the default model: published hyperparameters, every weight array equal
 *     (SHA-256) to gguf.quants.dequantize in kvq's [out][in] layout, fingerprint;
 *   - tests/fixtures/tiny_llama.gguf (GGUFWriter, mixed types, untied): values,
 *     every truncation, bit flips in header/metadata/tensor infos;
 *   - the default model truncated at many offsets and with header bytes flipped;
 *   - GGUF files built here with one defect each: a missing required key (each),
 *     wrong architecture, RoPE scaling variants, shape mismatches, extra /
 *     missing / duplicate tensors, an undequantizable type, overflowing sizes. */
#include <stdint.h>
#include <sys/stat.h>

#include <openssl/evp.h>

#include "gguf.h"
#include "kvq_test.h"
#include "model.h"

#define FIX "tests/fixtures/"

/* ---------------------------------------------------------------- helpers */

static void sha256_hex(const void *p, size_t n, char hex[65])
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned dn = 0;
    ck_assert(EVP_Digest(p, n, d, &dn, EVP_sha256(), NULL) == 1);
    for (unsigned i = 0; i < dn; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

/* The kvq array holding GGUF tensor `name`, and its element count. */
static const float *model_array(const kvq_model *m, const char *name, size_t *n)
{
    const kvq_hparams *h = &m->hp;
    size_t D = h->dim, H = h->hidden_dim, Q = kvq_q_dim(h), KV = kvq_kv_dim(h), V = h->vocab_size;
    if (!strcmp(name, "token_embd.weight")) return *n = V * D, kvq_mat_f32(&m->tok_embd);
    if (!strcmp(name, "output.weight")) return *n = V * D, kvq_mat_f32(&m->output);
    if (!strcmp(name, "output_norm.weight")) return *n = D, m->out_norm;
    int l, off = 0;
    char what[64];
    if (sscanf(name, "blk.%d.%63[a-z_].weight%n", &l, what, &off) != 2 || name[off] || l < 0 || l >= h->n_layers) return NULL;
    const kvq_layer_weights *w = &m->layers[l];
    if (!strcmp(what, "attn_norm")) return *n = D, w->attn_norm;
    if (!strcmp(what, "attn_q")) return *n = Q * D, kvq_mat_f32(&w->wq);
    if (!strcmp(what, "attn_k")) return *n = KV * D, kvq_mat_f32(&w->wk);
    if (!strcmp(what, "attn_v")) return *n = KV * D, kvq_mat_f32(&w->wv);
    if (!strcmp(what, "attn_output")) return *n = D * Q, kvq_mat_f32(&w->wo);
    if (!strcmp(what, "ffn_norm")) return *n = D, w->ffn_norm;
    if (!strcmp(what, "ffn_gate")) return *n = H * D, kvq_mat_f32(&w->w_gate);
    if (!strcmp(what, "ffn_up")) return *n = H * D, kvq_mat_f32(&w->w_up);
    if (!strcmp(what, "ffn_down")) return *n = D * H, kvq_mat_f32(&w->w_down);
    return NULL;
}

/* Check every array of m against a "<name> <type> <n> <sha256>" file (lines
 * starting with "file " are skipped); returns the number of tensors checked. */
static int check_weights(const kvq_model *m, const char *sha_file)
{
    FILE *f = fopen(sha_file, "r");
    ck_assert_msg(f != NULL, "fixture %s missing", sha_file);
    char line[512], name[128], type[16], want[65], got[65];
    unsigned long long nel;
    int count = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "file ", 5)) continue;
        ck_assert(sscanf(line, "%127s %15s %llu %64s", name, type, &nel, want) == 4);
        size_t n = 0;
        const float *a = model_array(m, name, &n);
        ck_assert_msg(a != NULL, "no kvq array for %s", name);
        ck_assert_uint_eq(n, nel);
        sha256_hex(a, n * sizeof(float), got);
        ck_assert_msg(!strcmp(got, want), "%s (%s): kvq weights differ from gguf.quants.dequantize", name, type);
        count++;
    }
    fclose(f);
    return count;
}

static uint8_t *slurp(const char *path, size_t *n) { return kvq_test_slurp(path, n); }

static void write_bytes(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert(fwrite(p, 1, n, f) == n);
    fclose(f);
}

static void tmp_path(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/kvq_test_model_gguf_%d_%s.gguf", (int)getpid(), tag);
}

/* Load must fail with a message naming the file and some field. */
static kvq_status expect_fail(const char *path, const char *what)
{
    kvq_model m;
    kvq_err e = {0};
    kvq_status s = kvq_model_load(path, &m, &e);
    ck_assert_msg(s != KVQ_OK, "%s: accepted", what);
    ck_assert_msg(strstr(e.msg, path) != NULL, "%s: message lacks the path: %s", what, e.msg);
    ck_assert_msg(strstr(e.msg, "offset") || strstr(e.msg, "tensor") || strstr(e.msg, "metadata") || strstr(e.msg, "header") ||
                      strstr(e.msg, "magic"),
                  "%s: message names no field: %s", what, e.msg);
    ck_assert_ptr_null(m.arena);
    return s;
}

/* ------------------------------------------------------- the default model */

START_TEST(test_default_model)
{
    const char *p = kvq_test_model();
    KVQ_SKIP_IF(!p, "default model absent (run scripts/fetch_model.sh)");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
    /* published SmolLM2-135M config (HF config.json: num_hidden_layers 30,
     * hidden_size 576, intermediate_size 1536, 9 heads / 3 KV heads,
     * vocab 49152, rope_theta 100000, rms_norm_eps 1e-5, tied, 8192 positions) */
    const kvq_hparams *h = &m.hp;
    ck_assert_int_eq(h->n_layers, 30);
    ck_assert_int_eq(h->dim, 576);
    ck_assert_int_eq(h->hidden_dim, 1536);
    ck_assert_int_eq(h->n_heads, 9);
    ck_assert_int_eq(h->n_kv_heads, 3);
    ck_assert_int_eq(h->head_dim, 64);
    ck_assert_int_eq(h->rope_dim, 64);
    ck_assert_int_eq(h->vocab_size, 49152);
    ck_assert_int_eq(h->ctx_len, 8192);
    ck_assert(h->rope_theta == 100000.0f);
    ck_assert(h->norm_eps == 1e-5f);
    ck_assert_int_eq(h->rope_scaling, KVQ_ROPE_SCALING_NONE);
    ck_assert(h->rope_scale_factor == 1.0f);
    ck_assert(h->tied_embeddings);
    ck_assert_ptr_eq(kvq_mat_f32(&m.output), kvq_mat_f32(&m.tok_embd));
    ck_assert_int_eq(m.source, KVQ_SRC_GGUF);
    ck_assert_str_eq(m.path, p);
    /* every array, in kvq's [out][in] layout, equals gguf.quants.dequantize of
     * its tensor (the fixture's model file is checked by test_dequant) */
    int n = check_weights(&m, FIX "dequant_model.sha256");
    ck_assert_int_eq(n, 272);
    /* fingerprint: weights digest = the file's recorded sha256; sensitive to hparams */
    char fp[65], wh[65], fp2[65];
    ck_assert_msg(kvq_model_fingerprint(&m, fp, wh, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(strlen(fp), 64);
    FILE *f = fopen("scripts/models.sha256", "r");
    if (f) {
        char rec[65] = {0};
        ck_assert(fscanf(f, "%64s", rec) == 1);
        fclose(f);
        ck_assert_str_eq(wh, rec);
    }
    ck_assert(kvq_model_fingerprint(&m, fp2, NULL, &e) == KVQ_OK);
    ck_assert_str_eq(fp, fp2);
    m.hp.rope_theta = 10000.0f;
    ck_assert(kvq_model_fingerprint(&m, fp2, NULL, &e) == KVQ_OK);
    ck_assert_str_ne(fp, fp2);
    kvq_model_free(&m);
}
END_TEST

START_TEST(test_default_truncated_and_flipped)
{
    const char *p = kvq_test_model();
    KVQ_SKIP_IF(!p, "default model absent (run scripts/fetch_model.sh)");
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert_msg(kvq_gguf_open(p, &g, &e) == KVQ_OK, "%s", e.msg);
    size_t size = g.size, data = g.data_offset;
    size_t tinfo = (size_t)((const uint8_t *)g.tensors[0].name.str - g.map) - 8; /* first tensor info */
    size_t tok = (size_t)((const uint8_t *)kvq_gguf_find(&g, "tokenizer.ggml.tokens")->arr_str[1000].str - g.map);
    kvq_gguf_close(&g);
    size_t cuts[] = {0, 3, 4, 8, 16, 23, 24, 40, 100, 1000, tok, tok + 5, tinfo - 1, tinfo, tinfo + 9, tinfo + 5000,
                     data - 1, data, data + 4096, size / 2, size - 1};
    size_t ncut = sizeof cuts / sizeof *cuts;
    char tmp[256];
    tmp_path(tmp, sizeof tmp, "trunc");
    /* write the prefix up to each cut only (the big ones once each) */
    FILE *in = fopen(p, "rb");
    ck_assert_ptr_nonnull(in);
    uint8_t *buf = malloc(1 << 20);
    for (size_t i = 0; i < ncut; i++) {
        if (kvq_test_quick() && cuts[i] > data + 4096) continue;
        FILE *o = fopen(tmp, "wb");
        fseek(in, 0, SEEK_SET);
        for (size_t done = 0; done < cuts[i];) {
            size_t want = cuts[i] - done < (1 << 20) ? cuts[i] - done : (1 << 20);
            size_t got = fread(buf, 1, want, in);
            ck_assert(got == want);
            ck_assert(fwrite(buf, 1, got, o) == got);
            done += got;
        }
        fclose(o);
        char what[64];
        snprintf(what, sizeof what, "cut at %zu", cuts[i]);
        expect_fail(tmp, what);
    }
    /* header bytes flipped: one full copy, then flip/restore in place */
    if (!kvq_test_quick()) {
        FILE *o = fopen(tmp, "wb");
        fseek(in, 0, SEEK_SET);
        size_t got;
        while ((got = fread(buf, 1, 1 << 20, in)) > 0) ck_assert(fwrite(buf, 1, got, o) == got);
        fclose(o);
        int accepted = 0, rejected = 0;
        for (long at = 0; at < 32; at++) {
            for (int bit = 0; bit < 8; bit += 6) {
                FILE *rw = fopen(tmp, "r+b");
                uint8_t b;
                fseek(rw, at, SEEK_SET);
                ck_assert(fread(&b, 1, 1, rw) == 1);
                uint8_t fb = (uint8_t)(b ^ (1u << bit));
                fseek(rw, at, SEEK_SET);
                fwrite(&fb, 1, 1, rw);
                fclose(rw);
                kvq_model m;
                memset(&e, 0, sizeof e);
                if (kvq_model_load(tmp, &m, &e) == KVQ_OK) {
                    /* e.g. version 3 -> 2: same layout, still a valid file */
                    kvq_model_free(&m);
                    accepted++;
                } else {
                    ck_assert_msg(strstr(e.msg, tmp) != NULL, "flip at %ld: no path in: %s", at, e.msg);
                    rejected++;
                }
                rw = fopen(tmp, "r+b");
                fseek(rw, at, SEEK_SET);
                fwrite(&b, 1, 1, rw);
                fclose(rw);
            }
        }
        ck_assert_int_ge(rejected, 60);
        fprintf(stderr, "test_default_truncated_and_flipped: %d header flips rejected, %d accepted\n", rejected, accepted);
    }
    fclose(in);
    free(buf);
    unlink(tmp);
}
END_TEST

/* ------------------------------------------------- the tiny GGUFWriter model */

START_TEST(test_tiny_values)
{
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(FIX "tiny_llama.gguf", &m, &e) == KVQ_OK, "%s", e.msg);
    const kvq_hparams *h = &m.hp;
    ck_assert_int_eq(h->n_layers, 2);
    ck_assert_int_eq(h->dim, 32);
    ck_assert_int_eq(h->hidden_dim, 64);
    ck_assert_int_eq(h->n_heads, 4);
    ck_assert_int_eq(h->n_kv_heads, 2);
    ck_assert_int_eq(h->head_dim, 8);
    ck_assert_int_eq(h->vocab_size, 48);
    ck_assert_int_eq(h->ctx_len, 256);
    ck_assert(h->rope_theta == 500000.0f);
    ck_assert(h->norm_eps == 1e-6f);
    ck_assert(!h->tied_embeddings);
    ck_assert_ptr_ne(kvq_mat_f32(&m.output), kvq_mat_f32(&m.tok_embd));
    /* every array (non-square [out][in] shapes, 8 tensor types) as gguf.quants gives it */
    ck_assert_int_eq(check_weights(&m, FIX "tiny_llama.sha256"), 21);
    /* weights digest = hashlib.sha256 of the file (first fixture line) */
    char fp[65], wh[65], line[128];
    ck_assert_msg(kvq_model_fingerprint(&m, fp, wh, &e) == KVQ_OK, "%s", e.msg);
    FILE *f = fopen(FIX "tiny_llama.sha256", "r");
    ck_assert(f && fgets(line, sizeof line, f));
    fclose(f);
    ck_assert_msg(!strncmp(line, "file ", 5) && !strncmp(line + 5, wh, 64), "%s vs %s", line, wh);
    kvq_model_free(&m);
}
END_TEST

START_TEST(test_tiny_truncations)
{
    size_t n;
    uint8_t *buf = slurp(FIX "tiny_llama.gguf", &n);
    ck_assert_ptr_nonnull(buf);
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert(kvq_gguf_open(FIX "tiny_llama.gguf", &g, &e) == KVQ_OK);
    size_t data = g.data_offset;
    kvq_gguf_close(&g);
    char tmp[256];
    tmp_path(tmp, sizeof tmp, "tiny_trunc");
    size_t step = kvq_test_quick() ? 7 : 1, tested = 0;
    for (size_t cut = 4; cut < n; cut += cut < data + 64 ? step : 61) {
        write_bytes(tmp, buf, cut);
        char what[64];
        snprintf(what, sizeof what, "tiny cut at %zu of %zu", cut, n);
        expect_fail(tmp, what);
        tested++;
    }
    write_bytes(tmp, buf, n - 1);
    expect_fail(tmp, "tiny cut at size - 1");
    /* cuts 0..3 are not GGUF-magic files: still a clean error naming the file */
    for (size_t cut = 0; cut < 4; cut++) {
        write_bytes(tmp, buf, cut);
        kvq_model m;
        ck_assert(kvq_model_load(tmp, &m, &e) != KVQ_OK);
        ck_assert_msg(strstr(e.msg, tmp) != NULL, "%s", e.msg);
    }
    fprintf(stderr, "test_tiny_truncations: %zu truncated files rejected\n", tested + 1);
    unlink(tmp);
    free(buf);
}
END_TEST

START_TEST(test_tiny_flips)
{
    size_t n;
    uint8_t *buf = slurp(FIX "tiny_llama.gguf", &n);
    ck_assert_ptr_nonnull(buf);
    kvq_gguf g;
    kvq_err e = {0};
    ck_assert(kvq_gguf_open(FIX "tiny_llama.gguf", &g, &e) == KVQ_OK);
    size_t data = g.data_offset;
    kvq_gguf_close(&g);
    char tmp[256];
    tmp_path(tmp, sizeof tmp, "tiny_flip");
    int accepted = 0, rejected = 0;
    size_t step = kvq_test_quick() ? 5 : 1;
    for (size_t at = 0; at < data; at += step) {
        for (int bit = 0; bit < 8; bit += 3) {
            buf[at] ^= (uint8_t)(1u << bit);
            write_bytes(tmp, buf, n);
            buf[at] ^= (uint8_t)(1u << bit);
            kvq_model m;
            memset(&e, 0, sizeof e);
            if (kvq_model_load(tmp, &m, &e) == KVQ_OK) {
                /* the flip hit a value (name text, a float): still a valid model */
                ck_assert(kvq_hparams_validate(&m.hp, tmp, &e) == KVQ_OK);
                kvq_model_free(&m);
                accepted++;
            } else {
                ck_assert_msg(strstr(e.msg, tmp) != NULL, "flip at %zu bit %d: %s", at, bit, e.msg);
                rejected++;
            }
        }
    }
    ck_assert_int_gt(rejected, accepted); /* most header/metadata/tensor-info flips are fatal */
    fprintf(stderr, "test_tiny_flips: %d flips rejected with a message, %d harmless\n", rejected, accepted);
    unlink(tmp);
    free(buf);
}
END_TEST

/* A directory (HF checkpoint) digest: *.json and *.safetensors files in name
 * order as "<name>\\0<u64 LE size><bytes>"; other files ignored. Expected value
 * from Python hashlib over the same byte string. */
START_TEST(test_sha256_directory)
{
    char dir[128], p[256];
    snprintf(dir, sizeof dir, "/tmp/kvq_test_sha_dir_%d", (int)getpid());
    ck_assert(mkdir(dir, 0700) == 0);
    const char *names[] = {"b.safetensors", "a.json", "c.txt"};
    const char *data[] = {"\x00\x01\x02" "abc", "{\"x\": 1}", "ignored"};
    size_t lens[] = {6, 8, 7};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        write_bytes(p, (const uint8_t *)data[i], lens[i]);
    }
    char hex[65];
    kvq_err e = {0};
    ck_assert_msg(kvq_sha256_path(dir, hex, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(hex, "86a6c86d69f7f1537b5646b13176374be9150ed4b11c1ebf8e9542d028e8fce3");
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
    ck_assert_int_eq(kvq_sha256_path("/nonexistent/model.gguf", hex, &e), KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "/nonexistent/model.gguf"));
}
END_TEST

/* ------------------------------------------- GGUF files built with defects */

typedef struct {
    char key[64];
    kvq_gguf_type type; /* UINT32, UINT64, FLOAT32, STRING */
    uint64_t u;
    float f;
    char s[32];
} bkv;

typedef struct {
    char name[64];
    uint32_t n_dims;
    uint64_t ne[4];
    kvq_ggml_type type;
} bten;

typedef struct {
    bkv kv[32];
    int n_kv;
    bten t[64];
    int n_t;
} spec;

static bkv *kv_slot(spec *s, const char *key)
{
    for (int i = 0; i < s->n_kv; i++)
        if (!strcmp(s->kv[i].key, key)) return &s->kv[i];
    ck_assert(s->n_kv < 32);
    bkv *k = &s->kv[s->n_kv++];
    memset(k, 0, sizeof *k);
    snprintf(k->key, sizeof k->key, "%s", key);
    return k;
}
static void set_u32(spec *s, const char *key, uint32_t v) { bkv *k = kv_slot(s, key); k->type = KVQ_GGUF_UINT32; k->u = v; }
static void set_u64(spec *s, const char *key, uint64_t v) { bkv *k = kv_slot(s, key); k->type = KVQ_GGUF_UINT64; k->u = v; }
static void set_f32(spec *s, const char *key, float v) { bkv *k = kv_slot(s, key); k->type = KVQ_GGUF_FLOAT32; k->f = v; }
static void set_str(spec *s, const char *key, const char *v) { bkv *k = kv_slot(s, key); k->type = KVQ_GGUF_STRING; snprintf(k->s, sizeof k->s, "%s", v); }
static void del_kv(spec *s, const char *key)
{
    for (int i = 0; i < s->n_kv; i++)
        if (!strcmp(s->kv[i].key, key)) {
            s->kv[i] = s->kv[--s->n_kv];
            return;
        }
    ck_abort_msg("no key %s", key);
}

static bten *tensor(spec *s, const char *name)
{
    for (int i = 0; i < s->n_t; i++)
        if (!strcmp(s->t[i].name, name)) return &s->t[i];
    ck_abort_msg("no tensor %s", name);
    return NULL;
}
static void add_tensor(spec *s, const char *name, uint64_t ne0, uint64_t ne1, kvq_ggml_type type)
{
    ck_assert(s->n_t < 64);
    bten *t = &s->t[s->n_t++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = ne1 ? 2 : 1;
    t->ne[0] = ne0;
    t->ne[1] = ne1 ? ne1 : 1;
    t->ne[2] = t->ne[3] = 1;
    t->type = type;
}
static void del_tensor(spec *s, const char *name)
{
    bten *t = tensor(s, name);
    *t = s->t[--s->n_t];
}

/* 2 layers, dim 16, hidden 32, 2 heads / 1 KV head (head_dim 8), vocab 24, F32, tied. */
static void spec_base(spec *s)
{
    memset(s, 0, sizeof *s);
    set_str(s, "general.architecture", "llama");
    set_u32(s, "llama.block_count", 2);
    set_u32(s, "llama.embedding_length", 16);
    set_u32(s, "llama.feed_forward_length", 32);
    set_u32(s, "llama.attention.head_count", 2);
    set_u32(s, "llama.attention.head_count_kv", 1);
    set_f32(s, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    set_u32(s, "llama.context_length", 64);
    set_f32(s, "llama.rope.freq_base", 20000.0f);
    set_u32(s, "llama.rope.dimension_count", 8);
    add_tensor(s, "token_embd.weight", 16, 24, KVQ_GGML_F32);
    add_tensor(s, "output_norm.weight", 16, 0, KVQ_GGML_F32);
    for (int l = 0; l < 2; l++) {
        char nm[64];
#define T(suffix, a, b) snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l), add_tensor(s, nm, a, b, KVQ_GGML_F32)
        T("attn_norm", 16, 0);
        T("attn_q", 16, 16);
        T("attn_k", 16, 8);
        T("attn_v", 16, 8);
        T("attn_output", 16, 0 + 16);
        T("ffn_norm", 16, 0);
        T("ffn_gate", 16, 32);
        T("ffn_up", 16, 32);
        T("ffn_down", 32, 16);
#undef T
    }
}

static void put(FILE *f, const void *p, size_t n) { ck_assert(fwrite(p, 1, n, f) == n); }
static void put_u32(FILE *f, uint32_t v) { put(f, &v, 4); }
static void put_u64(FILE *f, uint64_t v) { put(f, &v, 8); }
static void put_str(FILE *f, const char *s) { put_u64(f, strlen(s)); put(f, s, strlen(s)); }

/* Write s as GGUF v3 (alignment 32); tensor data is a deterministic ramp
 * (zeros for quantized types). A tensor whose size overflows gets no data. */
static void spec_write(const spec *s, const char *path)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    put(f, "GGUF", 4);
    put_u32(f, 3);
    put_u64(f, (uint64_t)s->n_t);
    put_u64(f, (uint64_t)s->n_kv);
    for (int i = 0; i < s->n_kv; i++) {
        const bkv *k = &s->kv[i];
        put_str(f, k->key);
        put_u32(f, k->type);
        if (k->type == KVQ_GGUF_UINT32) put_u32(f, (uint32_t)k->u);
        else if (k->type == KVQ_GGUF_UINT64) put_u64(f, k->u);
        else if (k->type == KVQ_GGUF_FLOAT32) put(f, &k->f, 4);
        else put_str(f, k->s);
    }
    uint64_t off = 0, nbytes[64];
    for (int i = 0; i < s->n_t; i++) {
        const bten *t = &s->t[i];
        uint32_t be = 1, bb = 0; /* a type kvq cannot size gets no data */
        if (!kvq_ggml_type_info(t->type, &be, &bb, NULL)) be = 1;
        uint64_t nel = 1;
        bool ovf = false;
        for (uint32_t d = 0; d < t->n_dims; d++) ovf |= __builtin_mul_overflow(nel, t->ne[d], &nel);
        nbytes[i] = ovf ? 0 : nel / be * bb;
        put_str(f, t->name);
        put_u32(f, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(f, t->ne[d]);
        put_u32(f, t->type);
        put_u64(f, off);
        off += (nbytes[i] + 31) / 32 * 32;
    }
    long pos = ftell(f);
    static const uint8_t zero[32] = {0};
    put(f, zero, (size_t)((32 - pos % 32) % 32));
    for (int i = 0; i < s->n_t; i++) {
        uint64_t nb = nbytes[i];
        for (uint64_t b = 0; b < nb; b += 4) {
            float v = s->t[i].type == KVQ_GGML_F32 ? (float)(b / 4 % 17) * 0.125f - 1.0f : 0.0f;
            put(f, &v, nb - b < 4 ? (size_t)(nb - b) : 4);
        }
        put(f, zero, (size_t)((32 - nb % 32) % 32));
    }
    fclose(f);
}

/* Build, load, and return the status; msg receives the error. */
static kvq_status try_load(const spec *s, kvq_model *m, char *msg, size_t n, char *path, size_t pn)
{
    tmp_path(path, pn, "built");
    spec_write(s, path);
    kvq_err e = {0};
    kvq_status st = kvq_model_load(path, m, &e);
    snprintf(msg, n, "%s", e.msg);
    if (st) ck_assert_ptr_null(m->arena);
    return st;
}

/* Expect failure with `code` and every one of up to three substrings (and the path). */
static void expect_err(const spec *s, kvq_status code, const char *a, const char *b, const char *c)
{
    kvq_model m;
    char msg[KVQ_ERR_MSG_MAX], path[256];
    kvq_status st = try_load(s, &m, msg, sizeof msg, path, sizeof path);
    if (st == KVQ_OK) kvq_model_free(&m);
    ck_assert_msg(st == code, "expected status %d, got %d: %s", code, st, msg);
    ck_assert_msg(strstr(msg, path), "no path in: %s", msg);
    ck_assert_msg(!a || strstr(msg, a), "'%s' not in: %s", a, msg);
    ck_assert_msg(!b || strstr(msg, b), "'%s' not in: %s", b, msg);
    ck_assert_msg(!c || strstr(msg, c), "'%s' not in: %s", c, msg);
    unlink(path);
}

START_TEST(test_built_valid_and_defaults)
{
    spec s;
    spec_base(&s);
    kvq_model m;
    char msg[KVQ_ERR_MSG_MAX], path[256];
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert_int_eq(m.hp.n_kv_heads, 1);
    ck_assert_int_eq(m.hp.vocab_size, 24);
    ck_assert(m.hp.rope_theta == 20000.0f);
    ck_assert(m.hp.tied_embeddings);
    /* F32 data is the ramp written by spec_write: [out][in] = file order */
    for (int i = 0; i < 16 * 16; i++) ck_assert(kvq_mat_f32(&m.layers[1].wq)[i] == (float)(i % 17) * 0.125f - 1.0f);
    for (int i = 0; i < 16 * 32; i++) ck_assert(kvq_mat_f32(&m.layers[0].w_down)[i] == (float)(i % 17) * 0.125f - 1.0f);
    kvq_model_free(&m);
    unlink(path);

    /* optional keys absent: head_count_kv = head_count, theta 10000, rope dim = head_dim */
    del_kv(&s, "llama.attention.head_count_kv");
    del_kv(&s, "llama.rope.freq_base");
    del_kv(&s, "llama.rope.dimension_count");
    for (int l = 0; l < 2; l++) {
        char nm[64];
        snprintf(nm, sizeof nm, "blk.%d.attn_k.weight", l);
        tensor(&s, nm)->ne[1] = 16;
        snprintf(nm, sizeof nm, "blk.%d.attn_v.weight", l);
        tensor(&s, nm)->ne[1] = 16;
    }
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert_int_eq(m.hp.n_kv_heads, 2);
    ck_assert(m.hp.rope_theta == 10000.0f);
    ck_assert_int_eq(m.hp.rope_dim, 8);
    kvq_model_free(&m);
    unlink(path);

    /* untied: output.weight present */
    spec_base(&s);
    add_tensor(&s, "output.weight", 16, 24, KVQ_GGML_F32);
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert(!m.hp.tied_embeddings);
    ck_assert_ptr_ne(kvq_mat_f32(&m.output), kvq_mat_f32(&m.tok_embd));
    kvq_model_free(&m);
    unlink(path);
}
END_TEST

START_TEST(test_built_missing_keys)
{
    const char *req[] = {"general.architecture", "llama.block_count", "llama.embedding_length",
                         "llama.feed_forward_length", "llama.attention.head_count",
                         "llama.attention.layer_norm_rms_epsilon", "llama.context_length"};
    for (size_t i = 0; i < sizeof req / sizeof *req; i++) {
        spec s;
        spec_base(&s);
        del_kv(&s, req[i]);
        expect_err(&s, KVQ_EFORMAT, req[i], "missing", NULL);
    }
    spec s;
    spec_base(&s);
    set_str(&s, "llama.block_count", "two");
    expect_err(&s, KVQ_EFORMAT, "llama.block_count", "expected an integer", "string");
    spec_base(&s);
    set_f32(&s, "llama.attention.layer_norm_rms_epsilon", -1.0f);
    expect_err(&s, KVQ_EFORMAT, "layer_norm_rms_epsilon", NULL, NULL);
}
END_TEST

START_TEST(test_built_arch_and_rope)
{
    spec s;
    spec_base(&s);
    set_str(&s, "general.architecture", "gpt2");
    expect_err(&s, KVQ_EUNSUPPORTED, "general.architecture", "\"gpt2\"", "llama");

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "yarn");
    set_f32(&s, "llama.rope.scaling.factor", 4.0f);
    expect_err(&s, KVQ_EFORMAT, "llama.rope.scaling.original_context_length", "missing", NULL);

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "yarn");
    set_f32(&s, "llama.rope.scaling.factor", 4.0f);
    set_u32(&s, "llama.rope.scaling.original_context_length", 64);
    set_f32(&s, "llama.rope.scaling.yarn_log_multiplier", 0.1f);
    expect_err(&s, KVQ_EUNSUPPORTED, "llama.rope.scaling.yarn_log_multiplier", "not supported", NULL);

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "longrope");
    expect_err(&s, KVQ_EUNSUPPORTED, "llama.rope.scaling.type", "\"longrope\"", NULL);

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "bogus");
    expect_err(&s, KVQ_EFORMAT, "llama.rope.scaling.type", "bogus", NULL);

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "linear");
    expect_err(&s, KVQ_EFORMAT, "llama.rope.scaling.factor", "missing", NULL);

    /* Llama-3.1 frequency factors: the built tensor's first value is -1, not a frequency divisor */
    spec_base(&s);
    add_tensor(&s, "rope_freqs.weight", 4, 0, KVQ_GGML_F32);
    expect_err(&s, KVQ_EFORMAT, "RoPE frequency factor 0", "-1", NULL);

    spec_base(&s);
    add_tensor(&s, "rope_freqs.weight", 3, 0, KVQ_GGML_F32);
    expect_err(&s, KVQ_EFORMAT, "rope_freqs.weight", "expected F32 [4]", NULL);

    spec_base(&s);
    add_tensor(&s, "rope_freqs.weight", 4, 0, KVQ_GGML_F32);
    set_str(&s, "llama.rope.scaling.type", "linear");
    set_f32(&s, "llama.rope.scaling.factor", 4.0f);
    expect_err(&s, KVQ_EUNSUPPORTED, "rope_freqs.weight", "linear", NULL);

    /* decoupled head size: key_length must match value_length, and the tensors the head size */
    spec_base(&s);
    set_u32(&s, "llama.attention.key_length", 16);
    set_u32(&s, "llama.attention.value_length", 8);
    expect_err(&s, KVQ_EUNSUPPORTED, "llama.attention.value_length", "differs", NULL);

    spec_base(&s);
    set_u32(&s, "llama.attention.key_length", 16);
    expect_err(&s, KVQ_EFORMAT, "blk.0.attn_q.weight", "expected GGUF shape", NULL);

    spec_base(&s);
    set_str(&s, "general.architecture", "qwen2");
    expect_err(&s, KVQ_EFORMAT, "qwen2.block_count", "missing", NULL);

    spec_base(&s);
    set_u32(&s, "llama.attention.sliding_window_pattern", 2);
    expect_err(&s, KVQ_EUNSUPPORTED, "llama.attention.sliding_window_pattern", NULL, NULL);

    spec_base(&s);
    set_u32(&s, "llama.rope.dimension_count", 9);
    expect_err(&s, KVQ_EFORMAT, "rope dimension_count", NULL, NULL);

    kvq_model m;
    char msg[KVQ_ERR_MSG_MAX], path[256];
    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "linear");
    set_f32(&s, "llama.rope.scaling.factor", 4.0f);
    set_u32(&s, "llama.rope.scaling.original_context_length", 1024);
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert_int_eq(m.hp.rope_scaling, KVQ_ROPE_SCALING_LINEAR);
    ck_assert(m.hp.rope_scale_factor == 4.0f);
    ck_assert_int_eq(m.hp.rope_orig_ctx, 1024);
    kvq_model_free(&m);

    spec_base(&s);
    set_str(&s, "llama.rope.scaling.type", "none");
    set_f32(&s, "llama.rope.scaling.factor", 4.0f);
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert_int_eq(m.hp.rope_scaling, KVQ_ROPE_SCALING_NONE);
    ck_assert(m.hp.rope_scale_factor == 1.0f);
    kvq_model_free(&m);

    spec_base(&s);
    set_f32(&s, "llama.rope.scale_linear", 2.0f); /* legacy key */
    ck_assert_msg(try_load(&s, &m, msg, sizeof msg, path, sizeof path) == KVQ_OK, "%s", msg);
    ck_assert_int_eq(m.hp.rope_scaling, KVQ_ROPE_SCALING_LINEAR);
    ck_assert(m.hp.rope_scale_factor == 2.0f);
    kvq_model_free(&m);
    unlink(path);
}
END_TEST

START_TEST(test_built_tensors)
{
    spec s;
    spec_base(&s);
    tensor(&s, "blk.1.attn_k.weight")->ne[1] = 16;
    expect_err(&s, KVQ_EFORMAT, "'blk.1.attn_k.weight'", "expected GGUF shape [16, 8]", "found [16, 16]");

    spec_base(&s);
    tensor(&s, "blk.0.ffn_down.weight")->ne[0] = 16; /* transposed */
    tensor(&s, "blk.0.ffn_down.weight")->ne[1] = 32;
    expect_err(&s, KVQ_EFORMAT, "'blk.0.ffn_down.weight'", "[32, 16]", "[16, 32]");

    spec_base(&s);
    bten *t = tensor(&s, "blk.0.ffn_up.weight");
    t->n_dims = 3;
    t->ne[1] = 16;
    t->ne[2] = 2;
    expect_err(&s, KVQ_EFORMAT, "'blk.0.ffn_up.weight'", "[16, 16, 2]", NULL);

    spec_base(&s);
    tensor(&s, "token_embd.weight")->ne[0] = 8;
    expect_err(&s, KVQ_EFORMAT, "'token_embd.weight'", "[16, 24]", "[8, 24]");

    spec_base(&s);
    del_tensor(&s, "blk.1.ffn_up.weight");
    expect_err(&s, KVQ_EFORMAT, "'blk.1.ffn_up.weight'", "missing", NULL);

    spec_base(&s);
    del_tensor(&s, "token_embd.weight");
    expect_err(&s, KVQ_EFORMAT, "'token_embd.weight'", "missing", NULL);

    spec_base(&s);
    add_tensor(&s, "blk.0.attn_q.bias", 16, 0, KVQ_GGML_F32);
    expect_err(&s, KVQ_EUNSUPPORTED, "'blk.0.attn_q.bias'", NULL, NULL);

    spec_base(&s);
    add_tensor(&s, "blk.2.attn_norm.weight", 16, 0, KVQ_GGML_F32); /* a 3rd layer the metadata does not declare */
    expect_err(&s, KVQ_EUNSUPPORTED, "'blk.2.attn_norm.weight'", NULL, NULL);

    spec_base(&s);
    add_tensor(&s, "blk.0.attn_norm.weight", 16, 0, KVQ_GGML_F32);
    expect_err(&s, KVQ_EFORMAT, "'blk.0.attn_norm.weight'", "more than once", NULL);

    spec_base(&s);
    tensor(&s, "blk.0.ffn_down.weight")->type = KVQ_GGML_Q8_1; /* ne[0] = 32: one block per row */
    expect_err(&s, KVQ_EUNSUPPORTED, "'blk.0.ffn_down.weight'", "Q8_1", NULL);

    /* a type the reader cannot even size (16 = IQ2_XXS): the file opens (its
     * metadata stays readable), the model load names the tensor */
    spec_base(&s);
    tensor(&s, "blk.0.ffn_down.weight")->type = (kvq_ggml_type)16;
    expect_err(&s, KVQ_EUNSUPPORTED, "'blk.0.ffn_down.weight'", NULL, NULL);

    /* quantized and half types go through the dequantizer */
    spec_base(&s);
    tensor(&s, "blk.0.attn_q.weight")->type = KVQ_GGML_Q4_0; /* ne[0] 16 is not a block of 32 */
    expect_err(&s, KVQ_EFORMAT, "'blk.0.attn_q.weight'", "block", NULL);
}
END_TEST

START_TEST(test_built_overflow)
{
    spec s;
    spec_base(&s);
    set_u64(&s, "llama.embedding_length", 1ull << 40);
    expect_err(&s, KVQ_EFORMAT, "llama.embedding_length", "32 bits", NULL);

    spec_base(&s);
    set_u32(&s, "llama.block_count", 1u << 30);
    expect_err(&s, KVQ_EFORMAT, "implausible", NULL, NULL);

    spec_base(&s);
    set_u32(&s, "llama.embedding_length", 1u << 20);
    set_u32(&s, "llama.feed_forward_length", 1u << 20);
    set_u32(&s, "llama.attention.head_count", 256);
    set_u32(&s, "llama.attention.head_count_kv", 256);
    set_u32(&s, "llama.rope.dimension_count", 128);
    tensor(&s, "token_embd.weight")->ne[0] = 1u << 20;
    tensor(&s, "token_embd.weight")->ne[1] = 1;
    /* 4 TiB of weights claimed: rejected by the shape check before any allocation */
    expect_err(&s, KVQ_EFORMAT, "tensor", "expected GGUF shape", NULL);

    spec_base(&s);
    bten *t = tensor(&s, "blk.0.ffn_gate.weight");
    t->n_dims = 3;
    t->ne[0] = 1ull << 32;
    t->ne[1] = 1ull << 32;
    t->ne[2] = 1ull << 10;
    expect_err(&s, KVQ_EFORMAT, "'blk.0.ffn_gate.weight'", "overflow", NULL);

    spec_base(&s);
    set_u32(&s, "llama.attention.head_count", 3);
    expect_err(&s, KVQ_EFORMAT, "llama.attention.head_count", "multiple", NULL);

    spec_base(&s);
    set_u32(&s, "llama.attention.head_count_kv", 3);
    expect_err(&s, KVQ_EFORMAT, "n_kv_heads", NULL, NULL);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("model_gguf");
    TCase *tc = tcase_create("model_gguf");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_default_model);
    tcase_add_test(tc, test_default_truncated_and_flipped);
    tcase_add_test(tc, test_tiny_values);
    tcase_add_test(tc, test_tiny_truncations);
    tcase_add_test(tc, test_tiny_flips);
    tcase_add_test(tc, test_sha256_directory);
    tcase_add_test(tc, test_built_valid_and_defaults);
    tcase_add_test(tc, test_built_missing_keys);
    tcase_add_test(tc, test_built_arch_and_rope);
    tcase_add_test(tc, test_built_tensors);
    tcase_add_test(tc, test_built_overflow);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
