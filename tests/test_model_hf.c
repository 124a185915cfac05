/* test_model_hf.c — HF safetensors checkpoint loader (formats/model_safetensors.c),
 * the model → tokenizer path helper and tokenizer_config.json.
 *
 * References:
 *  - tests/fixtures/stories260K-hf{,-sharded}/: ../shared/models/llama2c/stories260K.bin
 *    converted by tests/scripts/llama2c_to_hf.py with transformers' own
 *    q/k permutation (HF rotate-half layout). Loading them must give weights
 *    bit-identical to the llama2.c loader's, tensor by tensor.
 *  - a hand-written row table for the un-permutation (full and partial rotary).
 *  - f16/bf16 variants: values equal the f32 fixture rounded to the dtype.
 * Variants for bad-input tests are written to a fresh /tmp directory with
 * kvq_safetensors_write and cJSON. */
#include <cJSON.h>
#include <math.h>
#include <dirent.h>
#include <sys/stat.h>

#include "forward.h"
#include "kvq_test.h"
#include "loaders.h"
#include "model.h"
#include "safetensors.h"
#include "tokenizer.h"
#include "half.h"

#define FIX "tests/fixtures/stories260K-hf"
#define FIX_SHARDED "tests/fixtures/stories260K-hf-sharded"

/* ---- helpers ------------------------------------------------------------- */

static void make_tmpdir(char *buf, size_t n)
{
    snprintf(buf, n, "/tmp/kvq_test_hf_XXXXXX");
    ck_assert(mkdtemp(buf) != NULL);
}

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    ck_assert(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

static void copy_file(const char *src, const char *dst, long limit /* -1: all */)
{
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    ck_assert(in && out);
    char buf[1 << 16];
    size_t got;
    long done = 0;
    while ((got = fread(buf, 1, sizeof buf, in)) > 0) {
        if (limit >= 0 && done + (long)got > limit) got = (size_t)(limit - done);
        fwrite(buf, 1, got, out);
        done += (long)got;
        if (limit >= 0 && done >= limit) break;
    }
    fclose(in);
    fclose(out);
}

static cJSON *read_json_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    ck_assert(f);
    static const size_t cap = 1 << 20;
    char *buf = malloc(cap);
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    ck_assert(j);
    return j;
}

static void write_json(const char *dir, const char *name, const cJSON *j)
{
    char *t = cJSON_Print(j);
    write_text(dir, name, t);
    free(t);
}

/* In-memory checkpoint, mutable, written with kvq_safetensors_write. */
typedef struct {
    kvq_st_entry e[64];
    char *name[64];
    void *data[64];
    size_t n;
    cJSON *cfg;
} ckpt;

static void ckpt_load(ckpt *c)
{
    memset(c, 0, sizeof *c);
    kvq_safetensors st;
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_open(FIX "/model.safetensors", &st, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(st.n_tensors <= 60);
    for (size_t i = 0; i < st.n_tensors; i++) {
        const kvq_st_tensor *t = &st.tensors[i];
        c->name[i] = strdup(t->name);
        c->data[i] = malloc(t->n_bytes + 16);
        memcpy(c->data[i], t->data, t->n_bytes);
        c->e[i] = (kvq_st_entry){.name = c->name[i], .dtype = t->dtype, .n_dims = t->n_dims, .data = c->data[i]};
        memcpy(c->e[i].shape, t->shape, sizeof t->shape);
    }
    c->n = st.n_tensors;
    kvq_safetensors_close(&st);
    c->cfg = read_json_file(FIX "/config.json");
}

static kvq_st_entry *ckpt_find(ckpt *c, const char *name)
{
    for (size_t i = 0; i < c->n; i++)
        if (!strcmp(c->name[i], name)) return &c->e[i];
    ck_abort_msg("fixture has no tensor %s", name);
    return NULL;
}

/* Add a tensor whose data the checkpoint owns (copied). */
static void ckpt_add(ckpt *c, const char *name, kvq_st_dtype dt, uint32_t nd, const uint64_t *shape, const void *data, size_t bytes)
{
    size_t i = c->n++;
    ck_assert(i < 64);
    c->name[i] = strdup(name);
    c->data[i] = malloc(bytes + 16);
    memcpy(c->data[i], data, bytes);
    c->e[i] = (kvq_st_entry){.name = c->name[i], .dtype = dt, .n_dims = nd, .data = c->data[i]};
    memcpy(c->e[i].shape, shape, nd * sizeof *shape);
}

static void ckpt_drop(ckpt *c, const char *name)
{
    kvq_st_entry *e = ckpt_find(c, name);
    size_t i = (size_t)(e - c->e);
    free(c->name[i]);
    free(c->data[i]);
    c->n--;
    c->e[i] = c->e[c->n];
    c->name[i] = c->name[c->n];
    c->data[i] = c->data[c->n];
}

static void ckpt_write(const ckpt *c, const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_write(p, c->e, c->n, NULL, 0, &e) == KVQ_OK, "%s", e.msg);
    write_json(dir, "config.json", c->cfg);
}

static void ckpt_free(ckpt *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free(c->name[i]);
        free(c->data[i]);
    }
    cJSON_Delete(c->cfg);
}

/* Load `dir` expecting failure `code`; every needle must occur in the message. */
static void expect_fail(const char *dir, kvq_status code, const char *n1, const char *n2, const char *n3)
{
    kvq_model m;
    kvq_err e = {0};
    kvq_status s = kvq_model_load(dir, &m, &e);
    ck_assert_msg(s != KVQ_OK, "%s: accepted (expected '%s')", dir, n1 ? n1 : "");
    ck_assert_msg(s == code || code == KVQ_OK, "%s: status %d (%s), expected %d: %s", dir, s, kvq_status_name(s), code, e.msg);
    const char *needles[3] = {n1, n2, n3};
    for (int i = 0; i < 3; i++)
        ck_assert_msg(!needles[i] || strstr(e.msg, needles[i]), "message lacks '%s': %s", needles[i], e.msg);
    ck_assert(m.arena == NULL && m.layers == NULL);
}

/* Compare every weight tensor of a and b bit for bit. */
static void assert_same_weights(const kvq_model *a, const kvq_model *b)
{
    const kvq_hparams *h = &a->hp;
    ck_assert_int_eq(h->n_layers, b->hp.n_layers);
    size_t D = h->dim, H = h->hidden_dim, Q = kvq_q_dim(h), KV = kvq_kv_dim(h), V = h->vocab_size;
#define SAME(pa, pb, n, what, l) ck_assert_msg(memcmp((pa), (pb), (n) * sizeof(float)) == 0, "tensor %s (layer %d) differs", what, l)
    SAME(kvq_mat_f32(&a->tok_embd), kvq_mat_f32(&b->tok_embd), V * D, "tok_embd", -1);
    SAME(kvq_mat_f32(&a->output), kvq_mat_f32(&b->output), V * D, "output", -1);
    SAME(a->out_norm, b->out_norm, D, "out_norm", -1);
    for (int l = 0; l < h->n_layers; l++) {
        const kvq_layer_weights *x = &a->layers[l], *y = &b->layers[l];
        SAME(x->attn_norm, y->attn_norm, D, "attn_norm", l);
        SAME(kvq_mat_f32(&x->wq), kvq_mat_f32(&y->wq), Q * D, "wq", l);
        SAME(kvq_mat_f32(&x->wk), kvq_mat_f32(&y->wk), KV * D, "wk", l);
        SAME(kvq_mat_f32(&x->wv), kvq_mat_f32(&y->wv), KV * D, "wv", l);
        SAME(kvq_mat_f32(&x->wo), kvq_mat_f32(&y->wo), D * Q, "wo", l);
        SAME(x->ffn_norm, y->ffn_norm, D, "ffn_norm", l);
        SAME(kvq_mat_f32(&x->w_gate), kvq_mat_f32(&y->w_gate), H * D, "w_gate", l);
        SAME(kvq_mat_f32(&x->w_up), kvq_mat_f32(&y->w_up), H * D, "w_up", l);
        SAME(kvq_mat_f32(&x->w_down), kvq_mat_f32(&y->w_down), D * H, "w_down", l);
    }
#undef SAME
}

static void assert_same_hparams(const kvq_hparams *a, const kvq_hparams *b)
{
    ck_assert_int_eq(a->n_layers, b->n_layers);
    ck_assert_int_eq(a->dim, b->dim);
    ck_assert_int_eq(a->hidden_dim, b->hidden_dim);
    ck_assert_int_eq(a->n_heads, b->n_heads);
    ck_assert_int_eq(a->n_kv_heads, b->n_kv_heads);
    ck_assert_int_eq(a->head_dim, b->head_dim);
    ck_assert_int_eq(a->vocab_size, b->vocab_size);
    ck_assert_int_eq(a->ctx_len, b->ctx_len);
    ck_assert_int_eq(a->rope_dim, b->rope_dim);
    ck_assert(a->rope_theta == b->rope_theta);
    ck_assert_int_eq(a->rope_scaling, b->rope_scaling);
    ck_assert(a->rope_scale_factor == b->rope_scale_factor);
    ck_assert(a->norm_eps == b->norm_eps);
    ck_assert_int_eq(a->tied_embeddings, b->tied_embeddings);
}

/* ---- equality with the llama2.c original ---------------------------------- */

START_TEST(test_hf_equals_llama2c)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    kvq_model ref, m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &ref, &e) == KVQ_OK, "%s", e.msg);
    /* the directory, its config.json and the weights file all name the same checkpoint */
    const char *paths[] = {FIX, FIX "/", FIX "/config.json", FIX "/model.safetensors"};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++) {
        ck_assert_msg(kvq_model_load(paths[i], &m, &e) == KVQ_OK, "%s: %s", paths[i], e.msg);
        ck_assert_int_eq(m.source, KVQ_SRC_SAFETENSORS);
        ck_assert_str_eq(m.path, paths[i]);
        assert_same_hparams(&m.hp, &ref.hp);
        ck_assert_int_eq(m.hp.n_kv_heads, 4); /* GQA */
        ck_assert_int_eq(m.hp.head_dim, 8);
        ck_assert(m.hp.tied_embeddings && kvq_mat_f32(&m.output) == kvq_mat_f32(&m.tok_embd));
        assert_same_weights(&m, &ref);
        kvq_model_free(&m);
    }
    kvq_model_free(&ref);
}
END_TEST

/* Both sources through the forward pass: identical logits, bit for bit. */
START_TEST(test_hf_logits_equal_llama2c)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    kvq_model ref, m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &ref, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_model_load(FIX_SHARDED, &m, &e) == KVQ_OK, "%s", e.msg);
    enum { T = 48 };
    int tokens[T];
    uint32_t x = 12345;
    tokens[0] = 1; /* BOS */
    for (int t = 1; t < T; t++) {
        x = x * 1664525u + 1013904223u;
        tokens[t] = 3 + (int)((x >> 8) % 509u);
    }
    const kvq_model *models[2] = {&ref, &m};
    float *logits[2];
    double loss[2];
    for (int i = 0; i < 2; i++) {
        kvq_forward fw;
        ck_assert_msg(kvq_forward_init(&fw, models[i], T, 0, 0, &e) == KVQ_OK, "%s", e.msg);
        logits[i] = malloc((size_t)T * 512 * sizeof(float));
        kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = 0, .logits = logits[i]};
        kvq_fwd_result r;
        ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
        loss[i] = r.loss;
        kvq_forward_free(&fw);
    }
    ck_assert(isfinite(loss[0]) && loss[0] > 0.5 && loss[0] < 20);
    ck_assert_msg(loss[0] == loss[1], "loss %.17g vs %.17g", loss[0], loss[1]);
    ck_assert_msg(memcmp(logits[0], logits[1], (size_t)T * 512 * sizeof(float)) == 0, "logits differ");
    free(logits[0]);
    free(logits[1]);
    kvq_model_free(&m);
    kvq_model_free(&ref);
}
END_TEST

START_TEST(test_hf_sharded_equals_single)
{
    kvq_model a, b;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(FIX, &a, &e) == KVQ_OK, "%s", e.msg);
    const char *paths[] = {FIX_SHARDED, FIX_SHARDED "/model.safetensors.index.json"};
    for (size_t i = 0; i < 2; i++) {
        ck_assert_msg(kvq_model_load(paths[i], &b, &e) == KVQ_OK, "%s: %s", paths[i], e.msg);
        assert_same_hparams(&a.hp, &b.hp);
        assert_same_weights(&a, &b);
        kvq_model_free(&b);
    }
    /* the loader really un-permutes: raw HF q rows differ from the loaded ones */
    kvq_safetensors st;
    ck_assert(kvq_safetensors_open(FIX "/model.safetensors", &st, &e) == KVQ_OK);
    const kvq_st_tensor *t = kvq_safetensors_find(&st, "model.layers.0.self_attn.q_proj.weight");
    ck_assert(t && t->n_elements == (uint64_t)kvq_q_dim(&a.hp) * a.hp.dim);
    ck_assert(memcmp(t->data, kvq_mat_f32(&a.layers[0].wq), t->n_bytes) != 0);
    kvq_safetensors_close(&st);
    kvq_model_free(&a);
}
END_TEST

/* ---- the permutation against a hand-written table ------------------------- */

/* q_proj/k_proj rows hold their HF row index (every column); after loading,
 * kvq row r of head h must hold HF row table[r] of that head. */
static void check_perm(double partial, const int *table)
{
    ckpt c;
    ckpt_load(&c);
    if (partial > 0) cJSON_AddNumberToObject(c.cfg, "partial_rotary_factor", partial);
    const int D = 64, HD = 8;
    for (int l = 0; l < 5; l++) {
        const char *which[2] = {"q_proj", "k_proj"};
        for (int w = 0; w < 2; w++) {
            char nm[96];
            snprintf(nm, sizeof nm, "model.layers.%d.self_attn.%s.weight", l, which[w]);
            kvq_st_entry *e = ckpt_find(&c, nm);
            float *d = (float *)e->data;
            for (uint64_t r = 0; r < e->shape[0]; r++)
                for (int k = 0; k < D; k++) d[r * D + k] = (float)r;
        }
    }
    char dir[64];
    make_tmpdir(dir, sizeof dir);
    ckpt_write(&c, dir);
    kvq_model m;
    kvq_err err = {0};
    ck_assert_msg(kvq_model_load(dir, &m, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(m.hp.rope_dim, partial > 0 ? (int)(HD * partial) : HD);
    for (int l = 0; l < 5; l++)
        for (int w = 0; w < 2; w++) {
            const float *x = w ? kvq_mat_f32(&m.layers[l].wk) : kvq_mat_f32(&m.layers[l].wq);
            int heads = w ? m.hp.n_kv_heads : m.hp.n_heads;
            for (int h = 0; h < heads; h++)
                for (int r = 0; r < HD; r++)
                    for (int k = 0; k < D; k += 21)
                        ck_assert_msg(x[(size_t)(h * HD + r) * D + k] == (float)(h * HD + table[r]),
                                      "layer %d %s head %d row %d: holds HF row %g, expected %d", l, w ? "wk" : "wq", h, r,
                                      x[(size_t)(h * HD + r) * D + k], h * HD + table[r]);
        }
    kvq_model_free(&m);
    rm_tree(dir);
    ckpt_free(&c);
}

START_TEST(test_hf_permutation_table)
{
    /* full rotary, head_dim 8: kvq pair (2i, 2i+1) <- HF rows (i, i+4) */
    static const int full[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    check_perm(0, full);
    /* partial_rotary_factor 0.5: rotary dim 4, pairs (2i, 2i+1) <- (i, i+2); rows 4..7 pass through */
    static const int half[8] = {0, 2, 1, 3, 4, 5, 6, 7};
    check_perm(0.5, half);
}
END_TEST

/* ---- dtypes --------------------------------------------------------------- */

START_TEST(test_hf_f16_bf16)
{
    kvq_model ref;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(FIX, &ref, &e) == KVQ_OK, "%s", e.msg);
    for (int pass = 0; pass < 2; pass++) {
        kvq_st_dtype dt = pass ? KVQ_ST_BF16 : KVQ_ST_F16;
        ckpt c;
        ckpt_load(&c);
        for (size_t i = 0; i < c.n; i++) {
            kvq_st_entry *en = &c.e[i];
            size_t n = en->n_dims == 2 ? en->shape[0] * en->shape[1] : en->shape[0];
            const float *f = c.data[i];
            uint16_t *h = malloc(n * 2);
            for (size_t k = 0; k < n; k++) h[k] = pass ? kvq_f32_to_bf16(f[k]) : kvq_f32_to_f16(f[k]);
            memcpy(c.data[i], h, n * 2);
            free(h);
            en->dtype = dt;
        }
        char dir[64];
        make_tmpdir(dir, sizeof dir);
        ckpt_write(&c, dir);
        kvq_model m;
        ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
        /* the permutation moves whole rows, so rounding commutes with it */
        ck_assert_uint_eq(m.arena_floats, ref.arena_floats);
        size_t changed = 0;
        for (size_t k = 0; k < ref.arena_floats; k++) {
            float r = ref.arena[k];
            float want = pass ? kvq_bf16_to_f32(kvq_f32_to_bf16(r)) : kvq_f16_to_f32(kvq_f32_to_f16(r));
            ck_assert_msg(memcmp(&m.arena[k], &want, 4) == 0, "%s: float %zu = %a, expected %a", kvq_st_dtype_name(dt), k,
                          m.arena[k], want);
            changed += want != r;
        }
        ck_assert(changed > ref.arena_floats / 2); /* the rounding really happened */
        kvq_model_free(&m);
        rm_tree(dir);
        ckpt_free(&c);
    }
    kvq_model_free(&ref);
}
END_TEST

/* ---- config.json ---------------------------------------------------------- */

START_TEST(test_hf_config_rope_and_tie)
{
    ckpt c;
    ckpt_load(&c);
    char dir[64];
    make_tmpdir(dir, sizeof dir);
    kvq_model m;
    kvq_err e = {0};
    /* llama3 scaling, theta, eps */
    cJSON *rs = cJSON_CreateObject();
    cJSON_AddStringToObject(rs, "rope_type", "llama3");
    cJSON_AddNumberToObject(rs, "factor", 8.0);
    cJSON_AddNumberToObject(rs, "low_freq_factor", 1.0);
    cJSON_AddNumberToObject(rs, "high_freq_factor", 4.0);
    cJSON_AddNumberToObject(rs, "original_max_position_embeddings", 256);
    cJSON_ReplaceItemInObject(c.cfg, "rope_scaling", rs);
    cJSON_ReplaceItemInObject(c.cfg, "rope_theta", cJSON_CreateNumber(500000.0));
    ckpt_write(&c, dir);
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(m.hp.rope_scaling, KVQ_ROPE_SCALING_LLAMA3);
    ck_assert(m.hp.rope_scale_factor == 8.0f && m.hp.rope_low_freq_factor == 1.0f && m.hp.rope_high_freq_factor == 4.0f);
    ck_assert_int_eq(m.hp.rope_orig_ctx, 256);
    ck_assert(m.hp.rope_theta == 500000.0f);
    kvq_model_free(&m);
    /* linear, old spelling "type" */
    rs = cJSON_CreateObject();
    cJSON_AddStringToObject(rs, "type", "linear");
    cJSON_AddNumberToObject(rs, "factor", 2.5);
    cJSON_ReplaceItemInObject(c.cfg, "rope_scaling", rs);
    cJSON_DeleteItemFromObject(c.cfg, "rope_theta"); /* default 10000 */
    cJSON_DeleteItemFromObject(c.cfg, "num_key_value_heads"); /* default = heads: k_proj shape no longer fits */
    ckpt_write(&c, dir);
    expect_fail(dir, KVQ_EFORMAT, "model.layers.0.self_attn.k_proj.weight", "expected shape [64, 64]", "found [32, 64]");
    cJSON_AddNumberToObject(c.cfg, "num_key_value_heads", 4);
    ckpt_write(&c, dir);
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(m.hp.rope_scaling, KVQ_ROPE_SCALING_LINEAR);
    ck_assert(m.hp.rope_scale_factor == 2.5f && m.hp.rope_theta == 10000.0f);
    kvq_model_free(&m);
    /* untied: lm_head.weight required; with it, the head is its own tensor */
    cJSON_ReplaceItemInObject(c.cfg, "rope_scaling", cJSON_CreateNull());
    cJSON_ReplaceItemInObject(c.cfg, "tie_word_embeddings", cJSON_CreateFalse());
    ckpt_write(&c, dir);
    expect_fail(dir, KVQ_EFORMAT, "lm_head.weight", "tie_word_embeddings", "model.safetensors");
    cJSON_DeleteItemFromObject(c.cfg, "tie_word_embeddings"); /* LlamaConfig default: false */
    ckpt_write(&c, dir);
    expect_fail(dir, KVQ_EFORMAT, "lm_head.weight", NULL, NULL);
    kvq_st_entry *emb = ckpt_find(&c, "model.embed_tokens.weight");
    size_t ne = emb->shape[0] * emb->shape[1];
    float *head = malloc(ne * sizeof *head);
    for (size_t k = 0; k < ne; k++) head[k] = 0.25f * (float)(k % 17) - 1.0f;
    ckpt_add(&c, "lm_head.weight", KVQ_ST_F32, 2, emb->shape, head, ne * sizeof *head);
    ckpt_write(&c, dir);
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(!m.hp.tied_embeddings && kvq_mat_f32(&m.output) != kvq_mat_f32(&m.tok_embd));
    ck_assert(memcmp(kvq_mat_f32(&m.output), head, ne * sizeof *head) == 0);
    kvq_model_free(&m);
    /* tied + a stray lm_head.weight: transformers' tie_weights() keeps the embedding */
    cJSON_AddTrueToObject(c.cfg, "tie_word_embeddings");
    ckpt_write(&c, dir);
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(m.hp.tied_embeddings && kvq_mat_f32(&m.output) == kvq_mat_f32(&m.tok_embd) && memcmp(kvq_mat_f32(&m.output), head, ne * sizeof *head) != 0);
    kvq_model_free(&m);
    free(head);
    /* a saved rotary_emb.inv_freq buffer is ignored */
    float inv[4] = {1, 0.1f, 0.01f, 0.001f};
    ckpt_add(&c, "model.layers.0.self_attn.rotary_emb.inv_freq", KVQ_ST_F32, 1, (const uint64_t[]){4}, inv, sizeof inv);
    ckpt_write(&c, dir);
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    kvq_model_free(&m);
    rm_tree(dir);
    ckpt_free(&c);
}
END_TEST

START_TEST(test_hf_config_errors)
{
    ckpt c;
    ckpt_load(&c);
    char dir[64], cfgp[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    ckpt_write(&c, dir);
    /* each required key, removed, is named */
    const char *req[] = {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "vocab_size", "max_position_embeddings", "rms_norm_eps"};
    for (size_t i = 0; i < sizeof req / sizeof *req; i++) {
        cJSON *cfg = cJSON_Duplicate(c.cfg, 1);
        cJSON_DeleteItemFromObject(cfg, req[i]);
        write_json(dir, "config.json", cfg);
        char want[96];
        snprintf(want, sizeof want, "required key '%s' is missing", req[i]);
        expect_fail(dir, KVQ_EFORMAT, cfgp, want, NULL);
        cJSON_Delete(cfg);
    }
    /* wrong values, each named with the key */
    struct { const char *key; const char *json; kvq_status code; const char *needle; } bad[] = {
        {"hidden_size", "\"64\"", KVQ_EFORMAT, "'hidden_size': expected a positive integer"},
        {"hidden_size", "64.5", KVQ_EFORMAT, "found 64.5"},
        {"num_attention_heads", "0", KVQ_EFORMAT, "'num_attention_heads'"},
        {"num_attention_heads", "7", KVQ_EFORMAT, "not a multiple of 'num_attention_heads' 7"},
        {"num_key_value_heads", "3", KVQ_EFORMAT, "n_kv_heads 3"},
        {"rms_norm_eps", "-1", KVQ_EFORMAT, "'rms_norm_eps'"},
        {"vocab_size", "1e300", KVQ_EFORMAT, "'vocab_size'"},
        {"model_type", "\"gpt2\"", KVQ_EUNSUPPORTED, "'model_type': expected \"llama\", \"qwen2\", \"qwen3\" or \"mistral\", found \"gpt2\""},
        {"model_type", "\"mistral\"", KVQ_EUNSUPPORTED, "'architectures': expected it to list \"MistralForCausalLM\""},
        {"architectures", "[\"LlamaForSequenceClassification\"]", KVQ_EUNSUPPORTED, "LlamaForCausalLM"},
        {"hidden_act", "\"gelu\"", KVQ_EUNSUPPORTED, "'hidden_act'"},
        {"attention_bias", "true", KVQ_EFORMAT, "required tensor 'model.layers.0.self_attn.q_proj.bias' is missing"},
        {"mlp_bias", "true", KVQ_EUNSUPPORTED, "'mlp_bias': expected false"},
        {"head_dim", "16", KVQ_EFORMAT, "model.layers.0.self_attn.q_proj.weight': expected shape [128, 64]"},
        {"tie_word_embeddings", "1", KVQ_EFORMAT, "'tie_word_embeddings': expected true or false"},
        {"partial_rotary_factor", "0.1", KVQ_EFORMAT, "'partial_rotary_factor'"},
        {"rope_scaling", "{\"rope_type\": \"longrope\", \"factor\": 4}", KVQ_EUNSUPPORTED, "'rope_scaling.rope_type': RoPE scaling \"longrope\""},
        {"rope_scaling", "{\"type\": \"su\", \"factor\": 4}", KVQ_EUNSUPPORTED, "'rope_scaling.type': RoPE scaling \"su\""},
        {"rope_parameters", "{\"rope_type\": \"longrope\"}", KVQ_EUNSUPPORTED, "'rope_parameters.rope_type': RoPE scaling \"longrope\""},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": -1}", KVQ_EFORMAT, "'rope_scaling.beta_fast': expected a finite positive"},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"truncate\": 1}", KVQ_EFORMAT, "'rope_scaling.truncate': expected true or false"},
        {"rope_scaling", "{\"type\": \"dynamic\"}", KVQ_EFORMAT, "required key 'rope_scaling.factor' is missing"},
        {"layer_types", "[\"full_attention\", \"sliding_attention\", \"full_attention\", \"full_attention\", \"full_attention\"]",
         KVQ_EUNSUPPORTED, "'layer_types': a llama model with layers other than \"full_attention\""},
        {"rope_scaling", "{\"rope_type\": \"linear\"}", KVQ_EFORMAT, "required key 'rope_scaling.factor' is missing"},
        {"rope_scaling", "{\"factor\": 2}", KVQ_EFORMAT, "'rope_scaling.rope_type' (or 'rope_scaling.type') is missing"},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"high_freq_factor\": 4}", KVQ_EFORMAT,
         "'rope_scaling.low_freq_factor' is missing"},
        {"rope_scaling", "[1]", KVQ_EFORMAT, "'rope_scaling': expected null or an object"},
        {"intermediate_size", "100", KVQ_EFORMAT, "mlp.gate_proj.weight': expected shape [100, 64]"},
        {"vocab_size", "500", KVQ_EFORMAT, "model.embed_tokens.weight': expected shape [500, 64]"},
        {"num_hidden_layers", "6", KVQ_EFORMAT, "required tensor 'model.layers.5.input_layernorm.weight' is missing"},
        {"num_hidden_layers", "4", KVQ_EUNSUPPORTED, "'model.layers.4."},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cJSON *cfg = cJSON_Duplicate(c.cfg, 1);
        cJSON *v = cJSON_Parse(bad[i].json);
        ck_assert(v);
        if (cJSON_GetObjectItemCaseSensitive(cfg, bad[i].key)) cJSON_ReplaceItemInObjectCaseSensitive(cfg, bad[i].key, v);
        else cJSON_AddItemToObject(cfg, bad[i].key, v);
        write_json(dir, "config.json", cfg);
        const char *where = strstr(bad[i].needle, ".weight") || strstr(bad[i].needle, "model.layers") ? "model.safetensors" : cfgp;
        expect_fail(dir, bad[i].code, where, bad[i].needle, NULL);
        cJSON_Delete(cfg);
    }
    /* malformed JSON, empty file, not an object */
    const char *junk[] = {"{\"hidden_size\": 64,", "", "[1, 2]", "{\"hidden_size\": 64} trailing"};
    for (size_t i = 0; i < sizeof junk / sizeof *junk; i++) {
        write_text(dir, "config.json", junk[i]);
        expect_fail(dir, KVQ_EFORMAT, cfgp, i == 2 ? "expected a JSON object" : "invalid JSON", NULL);
    }
    /* missing config.json */
    unlink(cfgp);
    expect_fail(dir, KVQ_EIO, cfgp, "cannot open", NULL);
    rm_tree(dir);
    ckpt_free(&c);
}
END_TEST

/* ---- tensors and files ---------------------------------------------------- */

START_TEST(test_hf_tensor_errors)
{
    char dir[64];
    make_tmpdir(dir, sizeof dir);
    char stp[128];
    snprintf(stp, sizeof stp, "%s/model.safetensors", dir);
    const char *kp = "model.layers.2.self_attn.k_proj.weight";
    /* wrong shape: transposed k_proj */
    {
        ckpt c;
        ckpt_load(&c);
        kvq_st_entry *k = ckpt_find(&c, kp);
        uint64_t t = k->shape[0];
        k->shape[0] = k->shape[1];
        k->shape[1] = t;
        ckpt_write(&c, dir);
        expect_fail(dir, KVQ_EFORMAT, stp, "'model.layers.2.self_attn.k_proj.weight': expected shape [32, 64]", "found [64, 32]");
        /* 1-D where 2-D expected */
        k->n_dims = 1;
        k->shape[0] = 32 * 64;
        ckpt_write(&c, dir);
        expect_fail(dir, KVQ_EFORMAT, kp, "found [2048]", NULL);
        ckpt_free(&c);
    }
    /* bad dtypes */
    kvq_st_dtype bad_dt[] = {KVQ_ST_I32, KVQ_ST_F64, KVQ_ST_F8_E4M3};
    for (size_t i = 0; i < sizeof bad_dt / sizeof *bad_dt; i++) {
        ckpt c;
        ckpt_load(&c);
        ckpt_find(&c, kp)->dtype = bad_dt[i]; /* data buffer is large enough for every dtype <= 4 bytes */
        if (bad_dt[i] == KVQ_ST_F64) ckpt_find(&c, kp)->shape[0] /= 2;
        ckpt_write(&c, dir);
        char want[96];
        snprintf(want, sizeof want, "dtype %s, expected F32, F16 or BF16", kvq_st_dtype_name(bad_dt[i]));
        expect_fail(dir, KVQ_EUNSUPPORTED, stp, kp, want);
        ckpt_free(&c);
    }
    /* missing and unknown tensors */
    {
        ckpt c;
        ckpt_load(&c);
        ckpt_drop(&c, "model.norm.weight");
        ckpt_write(&c, dir);
        expect_fail(dir, KVQ_EFORMAT, stp, "required tensor 'model.norm.weight' is missing", NULL);
        float b[32] = {0};
        ckpt_add(&c, "model.norm.weight", KVQ_ST_F32, 1, (const uint64_t[]){64}, (float[64]){0}, 64 * sizeof(float));
        ckpt_add(&c, "model.layers.1.self_attn.k_proj.bias", KVQ_ST_F32, 1, (const uint64_t[]){32}, b, sizeof b);
        ckpt_write(&c, dir);
        expect_fail(dir, KVQ_EUNSUPPORTED, stp, "'model.layers.1.self_attn.k_proj.bias' is not part of a 5-layer llama model", NULL);
        ckpt_free(&c);
    }
    /* truncated / zero-length / header-corrupted weights: the reader's errors name the file */
    {
        struct stat sb;
        ck_assert(stat(FIX "/model.safetensors", &sb) == 0);
        long cuts[] = {0, 4, 8, 9, 200, (long)sb.st_size / 2, (long)sb.st_size - 1};
        for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
            copy_file(FIX "/model.safetensors", stp, cuts[i]);
            expect_fail(dir, KVQ_EFORMAT, stp, NULL, NULL);
        }
        /* flip bytes of the length field and the JSON header */
        long flips[] = {0, 3, 7, 8, 20, 60};
        FILE *f = fopen(FIX "/model.safetensors", "rb");
        unsigned char *data = malloc((size_t)sb.st_size);
        ck_assert(fread(data, 1, (size_t)sb.st_size, f) == (size_t)sb.st_size);
        fclose(f);
        for (size_t i = 0; i < sizeof flips / sizeof *flips; i++) {
            data[flips[i]] ^= 0x5a;
            f = fopen(stp, "wb");
            fwrite(data, 1, (size_t)sb.st_size, f);
            fclose(f);
            data[flips[i]] ^= 0x5a;
            expect_fail(dir, KVQ_OK /* any code */, stp, NULL, NULL);
        }
        free(data);
        unlink(stp);
        expect_fail(dir, KVQ_EIO, dir, "neither model.safetensors nor model.safetensors.index.json", NULL);
    }
    rm_tree(dir);
}
END_TEST

START_TEST(test_hf_shard_errors)
{
    char dir[64], idx[128], s1[128], s2[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    snprintf(s1, sizeof s1, "%s/model-00001-of-00002.safetensors", dir);
    snprintf(s2, sizeof s2, "%s/model-00002-of-00002.safetensors", dir);
    const char *files[] = {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors"};
    char src[256], dst[256];
    for (int i = 0; i < 4; i++) {
        snprintf(src, sizeof src, FIX_SHARDED "/%s", files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        copy_file(src, dst, -1);
    }
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(dir, &m, &e) == KVQ_OK, "%s", e.msg);
    kvq_model_free(&m);
    /* missing shard: the index entry and the shard are named */
    unlink(s2);
    expect_fail(dir, KVQ_EIO, idx, "weight_map[\"model.layers.3.", s2);
    /* truncated shard */
    snprintf(src, sizeof src, FIX_SHARDED "/%s", files[3]);
    copy_file(src, s2, 5000);
    expect_fail(dir, KVQ_EFORMAT, idx, s2, NULL);
    copy_file(src, s2, -1);
    /* index edits */
    cJSON *good = read_json_file(FIX_SHARDED "/model.safetensors.index.json");
    cJSON *wm;
    cJSON *j = cJSON_Duplicate(good, 1);
    wm = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
    cJSON_DeleteItemFromObject(wm, "model.norm.weight");
    write_json(dir, "model.safetensors.index.json", j);
    expect_fail(dir, KVQ_EFORMAT, idx, "weight_map has no entry for required tensor 'model.norm.weight'", NULL);
    cJSON_Delete(j);
    j = cJSON_Duplicate(good, 1);
    wm = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
    cJSON_ReplaceItemInObjectCaseSensitive(wm, "model.norm.weight", cJSON_CreateString("model-00001-of-00002.safetensors"));
    write_json(dir, "model.safetensors.index.json", j);
    expect_fail(dir, KVQ_EFORMAT, s1, "required tensor 'model.norm.weight' is missing", idx);
    cJSON_Delete(j);
    j = cJSON_Duplicate(good, 1);
    wm = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
    cJSON_ReplaceItemInObjectCaseSensitive(wm, "model.norm.weight", cJSON_CreateString("../model.safetensors"));
    write_json(dir, "model.safetensors.index.json", j);
    expect_fail(dir, KVQ_EFORMAT, idx, "weight_map[\"model.norm.weight\"]: expected a shard file name", NULL);
    cJSON_Delete(j);
    j = cJSON_Duplicate(good, 1);
    cJSON_DeleteItemFromObject(j, "weight_map");
    write_json(dir, "model.safetensors.index.json", j);
    expect_fail(dir, KVQ_EFORMAT, idx, "required key 'weight_map' is missing", NULL);
    cJSON_Delete(j);
    write_text(dir, "model.safetensors.index.json", "{\"weight_map\": {\"a\": ");
    expect_fail(dir, KVQ_EFORMAT, idx, "invalid JSON", NULL);
    /* the same tensor in both shards */
    {
        ckpt c;
        ckpt_load(&c);
        cJSON *w2 = cJSON_CreateObject(), *ix = cJSON_CreateObject();
        cJSON_AddItemToObject(ix, "weight_map", w2);
        for (size_t i = 0; i < c.n; i++) cJSON_AddStringToObject(w2, c.name[i], "a.safetensors");
        kvq_st_entry *norm = ckpt_find(&c, "model.norm.weight");
        ck_assert(kvq_safetensors_write(s1, norm, 1, NULL, 0, &e) == KVQ_OK);
        char pa[128];
        snprintf(pa, sizeof pa, "%s/a.safetensors", dir);
        ck_assert(kvq_safetensors_write(pa, c.e, c.n, NULL, 0, &e) == KVQ_OK);
        cJSON_AddStringToObject(w2, "extra.weight", "model-00001-of-00002.safetensors");
        write_json(dir, "model.safetensors.index.json", ix);
        expect_fail(dir, KVQ_EFORMAT, "'model.norm.weight' also appears in", s1, pa);
        cJSON_Delete(ix);
        ckpt_free(&c);
    }
    cJSON_Delete(good);
    rm_tree(dir);
}
END_TEST

/* ---- tokenizer path and tokenizer_config.json ------------------------------ */

START_TEST(test_tokenizer_path)
{
    char out[4096];
    kvq_err e = {0};
    /* GGUF: the model itself */
    ck_assert_msg(kvq_model_tokenizer_path("tests/fixtures/tiny_llama.gguf", NULL, out, sizeof out, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(out, "tests/fixtures/tiny_llama.gguf");
    /* explicit --tokenizer wins, and must exist */
    ck_assert(kvq_model_tokenizer_path(FIX, "tests/fixtures/hf_mini_tokenizer.json", out, sizeof out, &e) == KVQ_OK);
    ck_assert_str_eq(out, "tests/fixtures/hf_mini_tokenizer.json");
    ck_assert_int_eq(kvq_model_tokenizer_path(FIX, "tests/fixtures/nope.json", out, sizeof out, &e), KVQ_EIO);
    ck_assert(strstr(e.msg, "--tokenizer tests/fixtures/nope.json"));
    /* HF directory without tokenizer.json */
    ck_assert_int_eq(kvq_model_tokenizer_path(FIX, NULL, out, sizeof out, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "tokenizer.json") && strstr(e.msg, "--tokenizer FILE"), "%s", e.msg);
    ck_assert_int_eq(kvq_model_tokenizer_path("tests/fixtures/nope", NULL, out, sizeof out, &e), KVQ_EIO);
    /* llama2.c: none */
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    if (p) {
        ck_assert_int_eq(kvq_model_tokenizer_path(p, "", out, sizeof out, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, p) && strstr(e.msg, "pass --tokenizer FILE"), "%s", e.msg);
        kvq_tokenizer *tok;
        ck_assert_int_eq(kvq_tokenizer_for_model(p, NULL, &tok, &e), KVQ_EINVAL);
        ck_assert_ptr_null(tok);
    }
    /* HF directory with tokenizer.json: found from the dir, config.json or the weights */
    char dir[64], want[128], src[256];
    make_tmpdir(dir, sizeof dir);
    snprintf(src, sizeof src, "%s/config.json", dir);
    copy_file(FIX "/config.json", src, -1);
    snprintf(src, sizeof src, "%s/model.safetensors", dir);
    copy_file(FIX "/model.safetensors", src, -1);
    snprintf(src, sizeof src, "%s/tokenizer.json", dir);
    copy_file("tests/fixtures/hf_metaspace_tokenizer.json", src, -1);
    snprintf(want, sizeof want, "%s/tokenizer.json", dir);
    const char *forms[3] = {dir, NULL, NULL};
    char f1[128], f2[128];
    snprintf(f1, sizeof f1, "%s/config.json", dir);
    snprintf(f2, sizeof f2, "%s/model.safetensors", dir);
    forms[1] = f1;
    forms[2] = f2;
    for (int i = 0; i < 3; i++) {
        ck_assert_msg(kvq_model_tokenizer_path(forms[i], NULL, out, sizeof out, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_str_eq(out, want);
    }
    kvq_tokenizer *tok;
    ck_assert_msg(kvq_tokenizer_for_model(dir, NULL, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_n_vocab(tok), 271); /* hf_metaspace_tokenizer.json */
    kvq_tokenizer_free(tok);
    char small[8];
    ck_assert_int_eq(kvq_model_tokenizer_path(dir, NULL, small, sizeof small, &e), KVQ_EINVAL);
    rm_tree(dir);
}
END_TEST

static void encode(const kvq_tokenizer *tok, const char *text, unsigned flags, int32_t **ids, size_t *n)
{
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_encode(tok, text, strlen(text), flags, ids, n, &e) == KVQ_OK, "%s", e.msg);
}

START_TEST(test_tokenizer_config_json)
{
    char dir[64], tj[128], tc[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir);
    snprintf(tc, sizeof tc, "%s/tokenizer_config.json", dir);
    copy_file("tests/fixtures/hf_metaspace_tokenizer.json", tj, -1);
    kvq_tokenizer *tok;
    kvq_err e = {0};
    int32_t *ids, *ids0;
    size_t n, n0;
    /* without tokenizer_config.json: the post_processor's <s> prefix, no EOS */
    ck_assert_msg(kvq_tokenizer_from_hf_json(tj, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), -1);
    ck_assert(kvq_tokenizer_add_bos_default(tok));
    encode(tok, "hello world", KVQ_TOK_ADD_BOS_DEFAULT | KVQ_TOK_ADD_EOS_DEFAULT, &ids0, &n0);
    ck_assert(n0 >= 2 && ids0[0] == 1 && ids0[n0 - 1] != 2);
    kvq_tokenizer_free(tok);
    /* with it: EOS known and appended, BOS not prepended */
    write_text(dir, "tokenizer_config.json",
               "{\"add_bos_token\": false, \"add_eos_token\": true, \"bos_token\": {\"__type\": \"AddedToken\", "
               "\"content\": \"<s>\", \"special\": true}, \"eos_token\": \"</s>\", \"unk_token\": \"<unk>\", "
               "\"model_max_length\": 1000000000000000019884624838656}");
    ck_assert_msg(kvq_tokenizer_from_hf_json(tj, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), 2);
    ck_assert(!kvq_tokenizer_add_bos_default(tok));
    encode(tok, "hello world", KVQ_TOK_ADD_BOS_DEFAULT | KVQ_TOK_ADD_EOS_DEFAULT, &ids, &n);
    ck_assert_uint_eq(n, n0); /* drop <s>, add </s> */
    ck_assert(memcmp(ids, ids0 + 1, (n0 - 1) * sizeof *ids) == 0);
    ck_assert_int_eq(ids[n - 1], 2);
    free(ids);
    kvq_tokenizer_free(tok);
    /* the same through kvq_tokenizer_load (content dispatch) */
    ck_assert_msg(kvq_tokenizer_load(tj, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), 2);
    kvq_tokenizer_free(tok);
    /* only a file named tokenizer.json looks for its neighbour */
    char other[128];
    snprintf(other, sizeof other, "%s/other.json", dir);
    copy_file(tj, other, -1);
    ck_assert_msg(kvq_tokenizer_from_hf_json(other, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_eos(tok), -1);
    kvq_tokenizer_free(tok);
    /* null keeps the tokenizer.json value */
    write_text(dir, "tokenizer_config.json", "{\"bos_token\": null, \"eos_token\": null}");
    ck_assert_msg(kvq_tokenizer_from_hf_json(tj, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_tokenizer_bos(tok), 1);
    ck_assert(kvq_tokenizer_add_bos_default(tok));
    kvq_tokenizer_free(tok);
    /* errors name tokenizer_config.json and the key */
    struct { const char *json; const char *needle; } bad[] = {
        {"{\"eos_token\": \"<nope>\"}", "'eos_token': token \"<nope>\" is not in the vocabulary"},
        {"{\"bos_token\": 5}", "'bos_token': expected a string"},
        {"{\"add_bos_token\": \"yes\"}", "'add_bos_token': expected true or false"},
        {"{\"add_eos_token\": true}", "'add_eos_token' is true but no EOS token"},
        {"{\"bos_token\": \"<s>\",", "invalid JSON"},
        {"[]", "expected a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_text(dir, "tokenizer_config.json", bad[i].json);
        ck_assert_int_eq(kvq_tokenizer_from_hf_json(tj, &tok, &e), KVQ_EFORMAT);
        ck_assert_ptr_null(tok);
        ck_assert_msg(strstr(e.msg, tc) && strstr(e.msg, bad[i].needle), "case %zu: %s", i, e.msg);
    }
    free(ids0);
    rm_tree(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("model_hf");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_hf_equals_llama2c);
    tcase_add_test(tc, test_hf_logits_equal_llama2c);
    tcase_add_test(tc, test_hf_sharded_equals_single);
    tcase_add_test(tc, test_hf_permutation_table);
    tcase_add_test(tc, test_hf_f16_bf16);
    tcase_add_test(tc, test_hf_config_rope_and_tie);
    tcase_add_test(tc, test_hf_config_errors);
    tcase_add_test(tc, test_hf_tensor_errors);
    tcase_add_test(tc, test_hf_shard_errors);
    tcase_add_test(tc, test_tokenizer_path);
    tcase_add_test(tc, test_tokenizer_config_json);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
