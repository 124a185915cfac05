/* model_gguf.c — GGUF model loader for architectures "llama", "qwen2", "qwen3".
 *
 * Metadata, prefixed by the architecture name <a> (llama.cpp
 * src/llama-model.cpp, llama_model::load_hparams; gguf-py constants.py
 * Keys.LLM / Keys.Attention / Keys.Rope):
 *   required  <a>.block_count, <a>.embedding_length, <a>.feed_forward_length,
 *             <a>.attention.head_count, <a>.attention.layer_norm_rms_epsilon,
 *             <a>.context_length
 *   optional  <a>.attention.head_count_kv (default head_count),
 *             <a>.attention.key_length / value_length (head_dim, default
 *               embedding_length / head_count; both must agree: a decoupled head
 *               size as in Qwen3),
 *             <a>.rope.freq_base (10000), <a>.rope.dimension_count (head_dim),
 *             <a>.rope.scaling.type none|linear|yarn (others rejected, naming the
 *               key and the value), <a>.rope.scaling.factor,
 *               <a>.rope.scaling.original_context_length,
 *               <a>.rope.scaling.yarn_beta_fast / yarn_beta_slow (32 / 1),
 *               <a>.rope.scaling.attn_factor (yarn: multiplies the default
 *               magnitude 0.1 ln(factor) + 1, as llama.cpp's ggml_rope_yarn does),
 *               legacy <a>.rope.scale_linear (linear factor),
 *             <a>.attention.sliding_window (every layer; a per-layer
 *               sliding_window_pattern is rejected).
 * Tensors (GGUF ne[0] = input dim, ne[1] = output dim, i.e. numpy/kvq shape
 * [out][in]): token_embd [dim, vocab] (vocab_size = its ne[1]), output_norm
 * [dim], output [dim, vocab] (absent: tied to token_embd), rope_freqs [rope_dim/2]
 * (optional, F32: per-pair frequency divisors, which llama.cpp's converter
 * writes for Llama-3.1 `llama3` scaling: kvq's freq_factors), and per layer N
 * blk.N.{attn_norm [dim], attn_q [dim, q_dim], attn_k/attn_v [dim, kv_dim],
 * attn_output [q_dim, dim], ffn_norm [dim], ffn_gate/ffn_up [dim, hidden],
 * ffn_down [hidden, dim]}.weight, plus blk.N.attn_{q,k,v}.bias (qwen2; any
 * architecture when all three are present), blk.N.attn_output.bias (when
 * present), blk.N.attn_{q,k}_norm.weight [head_dim] (qwen3). Any other tensor
 * is rejected, so nothing the forward pass would need is silently dropped.
 * RoPE pairing: llama files hold q/k rows in interleaved order
 * (convert_hf_to_gguf.py `permute`), kvq's canonical layout; qwen2/qwen3 files
 * keep HF's rotate-half order (llama.cpp runs them with NEOX RoPE), so their
 * q/k rows, biases and norm weights are un-permuted here as in the HF loader.
 * Matrix storage follows the kvq_weights mode: f32 dequantizes every matrix;
 * native keeps the file's blocks (dequantized block by block when used).
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_dequant.h"
#include "gguf.h"
#include "half.h"
#include "loaders.h"

enum { KVQ_GGUF_NAME_MAX = 64 };

/* Required/optional positive int key that fits an int. */
static kvq_status get_dim(const kvq_gguf *g, const char *key, bool required, int *out, kvq_err *err)
{
    int64_t v = *out;
    KVQ_TRY(kvq_gguf_get_int(g, key, required, &v, err));
    if (!kvq_gguf_find(g, key)) return KVQ_OK;
    if (v <= 0 || v > INT_MAX)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected a positive value that fits in 32 bits, found %lld",
                        g->path, key, (long long)v);
    *out = (int)v;
    return KVQ_OK;
}

static kvq_status get_pos_float(const kvq_gguf *g, const char *key, bool required, float *out, kvq_err *err)
{
    double v = *out;
    KVQ_TRY(kvq_gguf_get_float(g, key, required, &v, err));
    if (!kvq_gguf_find(g, key)) return KVQ_OK;
    if (!(v > 0) || !isfinite(v) || v > 3.0e38)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected a finite positive number, found %g", g->path, key, v);
    *out = (float)v;
    return KVQ_OK;
}

/* "<arch>.<rest>" */
static const char *K(char *buf, size_t n, const char *arch, const char *rest)
{
    snprintf(buf, n, "%s.%s", arch, rest);
    return buf;
}

static kvq_status read_hparams(const kvq_gguf *g, kvq_hparams *hp, bool *neox, kvq_err *err)
{
    const char *path = g->path;
    kvq_gguf_str as = {0};
    char k[160], a[16];
    KVQ_TRY(kvq_gguf_get_str(g, "general.architecture", true, &as, err));
    memset(hp, 0, sizeof *hp);
    if (kvq_gguf_str_eq(as, "llama")) hp->arch = KVQ_ARCH_LLAMA;
    else if (kvq_gguf_str_eq(as, "qwen2")) hp->arch = KVQ_ARCH_QWEN2;
    else if (kvq_gguf_str_eq(as, "qwen3")) hp->arch = KVQ_ARCH_QWEN3;
    else
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata 'general.architecture': expected \"llama\", \"qwen2\" or \"qwen3\", found \"%.*s\"",
                        path, (int)(as.len < 64 ? as.len : 64), as.str);
    snprintf(a, sizeof a, "%s", kvq_arch_name(hp->arch));
    *neox = hp->arch != KVQ_ARCH_LLAMA;
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "block_count"), true, &hp->n_layers, err));
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "embedding_length"), true, &hp->dim, err));
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "feed_forward_length"), true, &hp->hidden_dim, err));
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "attention.head_count"), true, &hp->n_heads, err));
    hp->n_kv_heads = hp->n_heads;
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "attention.head_count_kv"), false, &hp->n_kv_heads, err));
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "context_length"), true, &hp->ctx_len, err));
    hp->norm_eps = 0;
    KVQ_TRY(get_pos_float(g, K(k, sizeof k, a, "attention.layer_norm_rms_epsilon"), true, &hp->norm_eps, err));
    hp->rope_theta = 10000.0f;
    KVQ_TRY(get_pos_float(g, K(k, sizeof k, a, "rope.freq_base"), false, &hp->rope_theta, err));

    /* head size: key_length (= value_length), else embedding_length / head_count */
    char kk[160], kv[160];
    K(kk, sizeof kk, a, "attention.key_length");
    K(kv, sizeof kv, a, "attention.value_length");
    hp->head_dim = hp->dim % hp->n_heads ? 0 : hp->dim / hp->n_heads;
    int kl = hp->head_dim, vl = -1;
    KVQ_TRY(get_dim(g, kk, false, &kl, err));
    vl = kl;
    KVQ_TRY(get_dim(g, kv, false, &vl, err));
    if (vl != kl)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata '%s' %d differs from '%s' %d (different key and value head sizes are not supported)",
                        path, kv, vl, kk, kl);
    if (kl <= 0)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s.embedding_length' %d is not a multiple of '%s.attention.head_count' %d and '%s' is absent",
                        path, a, hp->dim, a, hp->n_heads, kk);
    hp->head_dim = kl;
    hp->rope_dim = hp->head_dim;
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "rope.dimension_count"), false, &hp->rope_dim, err));

    /* RoPE scaling */
    hp->rope_scaling = KVQ_ROPE_SCALING_NONE;
    hp->rope_scale_factor = 1.0f;
    hp->rope_attn_factor = 1.0f;
    kvq_gguf_str st = {0};
    const char *kt = K(k, sizeof k, a, "rope.scaling.type");
    char ktype[160];
    snprintf(ktype, sizeof ktype, "%s", kt);
    KVQ_TRY(kvq_gguf_get_str(g, ktype, false, &st, err));
    char kf[160], ko[160];
    K(kf, sizeof kf, a, "rope.scaling.factor");
    K(ko, sizeof ko, a, "rope.scaling.original_context_length");
    if (kvq_gguf_find(g, ktype) && !kvq_gguf_str_eq(st, "none")) {
        if (kvq_gguf_str_eq(st, "linear")) {
            hp->rope_scaling = KVQ_ROPE_SCALING_LINEAR;
            KVQ_TRY(get_pos_float(g, kf, true, &hp->rope_scale_factor, err));
        } else if (kvq_gguf_str_eq(st, "yarn")) {
            hp->rope_scaling = KVQ_ROPE_SCALING_YARN;
            KVQ_TRY(get_pos_float(g, kf, true, &hp->rope_scale_factor, err));
            KVQ_TRY(get_dim(g, ko, true, &hp->rope_orig_ctx, err));
            hp->rope_beta_fast = 32.0f;
            hp->rope_beta_slow = 1.0f;
            hp->rope_yarn_truncate = true;
            KVQ_TRY(get_pos_float(g, K(k, sizeof k, a, "rope.scaling.yarn_beta_fast"), false, &hp->rope_beta_fast, err));
            KVQ_TRY(get_pos_float(g, K(k, sizeof k, a, "rope.scaling.yarn_beta_slow"), false, &hp->rope_beta_slow, err));
            float af = 1.0f;
            KVQ_TRY(get_pos_float(g, K(k, sizeof k, a, "rope.scaling.attn_factor"), false, &af, err));
            double f = hp->rope_scale_factor;
            hp->rope_attn_factor = (float)(af * (f <= 1 ? 1.0 : 0.1 * log(f) + 1.0));
            const char *unsup[] = {"rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier"};
            for (int i = 0; i < 3; i++)
                if (kvq_gguf_find(g, K(k, sizeof k, a, unsup[i])))
                    return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata '%s': this YaRN variant is not supported", path, k);
        } else if (kvq_gguf_str_eq(st, "longrope")) {
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata '%s': RoPE scaling \"longrope\" is not supported (supported: none, linear, yarn)",
                            path, ktype);
        } else {
            return kvq_fail(err, KVQ_EFORMAT, "%s: metadata '%s': expected none, linear, yarn or longrope, found \"%.*s\"",
                            path, ktype, (int)(st.len < 64 ? st.len : 64), st.str);
        }
    } else if (kvq_gguf_find(g, K(k, sizeof k, a, "rope.scale_linear"))) {
        KVQ_TRY(get_pos_float(g, k, true, &hp->rope_scale_factor, err));
        if (hp->rope_scale_factor != 1.0f) hp->rope_scaling = KVQ_ROPE_SCALING_LINEAR;
    }
    if (hp->rope_scaling != KVQ_ROPE_SCALING_YARN) KVQ_TRY(get_dim(g, ko, false, &hp->rope_orig_ctx, err));
    const kvq_gguf_tensor *rf = kvq_gguf_find_tensor(g, "rope_freqs.weight");
    if (rf) {
        int half = hp->rope_dim / 2;
        if (hp->rope_scaling != KVQ_ROPE_SCALING_NONE)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor 'rope_freqs.weight' together with '%s' \"%s\" is not supported", path, ktype,
                            kvq_rope_scaling_name(hp->rope_scaling));
        if (rf->type != KVQ_GGML_F32 || rf->n_dims != 1 || rf->ne[0] != (uint64_t)half || half > KVQ_ROPE_MAX_PAIRS || !rf->data)
            return kvq_fail(err, KVQ_EFORMAT, "%s: tensor 'rope_freqs.weight': expected F32 [%d] (rope dimension_count / 2), found type %d, %u dims, ne[0] %llu",
                            path, half, (int)rf->type, rf->n_dims, (unsigned long long)rf->ne[0]);
        memcpy(hp->rope_freq_factors, rf->data, (size_t)half * sizeof(float));
        hp->rope_scaling = KVQ_ROPE_SCALING_FREQ_FACTORS;
        hp->rope_scale_factor = 1.0f;
        hp->rope_orig_ctx = 0;
    }

    /* sliding window (llama.cpp's converter writes none for Mistral, which it stores as "llama") */
    int W = 0;
    KVQ_TRY(get_dim(g, K(k, sizeof k, a, "attention.sliding_window"), false, &W, err));
    if (kvq_gguf_find(g, K(k, sizeof k, a, "attention.sliding_window_pattern")))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata '%s': per-layer sliding-window patterns are not supported", path, k);
    hp->sliding_window = W;

    /* optional parts */
    bool has_q = kvq_gguf_find_tensor(g, "blk.0.attn_q.bias"), has_k = kvq_gguf_find_tensor(g, "blk.0.attn_k.bias"),
         has_v = kvq_gguf_find_tensor(g, "blk.0.attn_v.bias");
    if (hp->arch == KVQ_ARCH_QWEN2 && !(has_q && has_k && has_v))
        return kvq_fail(err, KVQ_EFORMAT, "%s: a qwen2 model needs tensors blk.N.attn_q.bias, attn_k.bias and attn_v.bias; 'blk.0.attn_%c.bias' is missing",
                        path, !has_q ? 'q' : !has_k ? 'k' : 'v');
    hp->attn_qkv_bias = has_q && has_k && has_v;
    hp->attn_out_bias = kvq_gguf_find_tensor(g, "blk.0.attn_output.bias") != NULL;
    hp->qk_norm = hp->arch == KVQ_ARCH_QWEN3;

    /* vocabulary from the embedding table */
    const kvq_gguf_tensor *te = kvq_gguf_find_tensor(g, "token_embd.weight");
    if (!te) return kvq_fail(err, KVQ_EFORMAT, "%s: required tensor 'token_embd.weight' is missing", path);
    if (te->n_dims != 2 || te->ne[1] > INT_MAX)
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor 'token_embd.weight': expected shape [%d, vocab], found %u dims [%llu, %llu, %llu, %llu]",
                        path, hp->dim, te->n_dims, (unsigned long long)te->ne[0], (unsigned long long)te->ne[1],
                        (unsigned long long)te->ne[2], (unsigned long long)te->ne[3]);
    hp->vocab_size = (int)te->ne[1];
    hp->tied_embeddings = kvq_gguf_find_tensor(g, "output.weight") == NULL;
    return kvq_hparams_validate(hp, path, err);
}

typedef struct {
    char name[KVQ_GGUF_NAME_MAX];
    uint64_t ne0, ne1;  /* expected GGUF shape; ne1 = 0 for a 1-D tensor */
    float *dst;         /* a vector (fp32), or NULL for a matrix */
    kvq_mat *mat;       /* a matrix, or NULL */
    int role, layer;    /* matrices: kvq_mat_role and layer (-1: embedding / LM head) */
    int perm_heads;     /* > 0: un-permute rows (rotate-half -> interleaved) over this many heads */
    const kvq_gguf_tensor *t;
} job;

static void add_job(job *jobs, size_t *n, const char *name, uint64_t ne0, uint64_t ne1, float *dst, kvq_mat *mat, int role, int layer,
                    int perm_heads)
{
    job *j = &jobs[(*n)++];
    snprintf(j->name, sizeof j->name, "%s", name);
    j->ne0 = ne0;
    j->ne1 = ne1;
    j->dst = dst;
    j->mat = mat;
    j->role = role;
    j->layer = layer;
    j->perm_heads = perm_heads;
    j->t = NULL;
}

static kvq_status check_job(const kvq_gguf *g, job *j, kvq_err *err)
{
    const kvq_gguf_tensor *t = kvq_gguf_find_tensor(g, j->name);
    if (!t) return kvq_fail(err, KVQ_EFORMAT, "%s: required tensor '%s' is missing", g->path, j->name);
    uint32_t want_dims = j->ne1 ? 2 : 1;
    if (t->n_dims != want_dims || t->ne[0] != j->ne0 || (j->ne1 && t->ne[1] != j->ne1)) {
        char want[64], found[128];
        if (j->ne1) snprintf(want, sizeof want, "[%llu, %llu]", (unsigned long long)j->ne0, (unsigned long long)j->ne1);
        else snprintf(want, sizeof want, "[%llu]", (unsigned long long)j->ne0);
        int k = snprintf(found, sizeof found, "[");
        for (uint32_t d = 0; d < t->n_dims && d < 4; d++)
            k += snprintf(found + k, sizeof found - (size_t)k, "%s%llu", d ? ", " : "", (unsigned long long)t->ne[d]);
        snprintf(found + k, sizeof found - (size_t)k, "]");
        return kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s': expected GGUF shape %s (ne[0] = input dim), found %s",
                        g->path, j->name, want, found);
    }
    if (!kvq_ggml_can_dequantize(t->type)) {
        const char *tn = "unknown";
        kvq_ggml_type_info(t->type, NULL, NULL, &tn);
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor '%s': type %s (%d) cannot be dequantized", g->path, j->name, tn, (int)t->type);
    }
    j->t = t;
    return KVQ_OK;
}

enum { MAX_JOBS_PER_LAYER = 15 };

/* The tensors of the model with their expected GGUF shapes; dst/mat pointers
 * into m when m != NULL (else NULL: shape checking before allocation). */
static size_t build_jobs(const kvq_hparams *hp, bool neox, kvq_model *m, job *jobs)
{
    size_t n = 0;
    const uint64_t D = hp->dim, H = hp->hidden_dim, Q = kvq_q_dim(hp), KV = kvq_kv_dim(hp), V = hp->vocab_size, HD = hp->head_dim;
    /* largest first: the embedding table dominates the load time */
    add_job(jobs, &n, "token_embd.weight", D, V, NULL, m ? &m->tok_embd : NULL, KVQ_MAT_TOK_EMBD, -1, 0);
    if (!hp->tied_embeddings) add_job(jobs, &n, "output.weight", D, V, NULL, m ? &m->output : NULL, KVQ_MAT_OUTPUT, -1, 0);
    add_job(jobs, &n, "output_norm.weight", D, 0, m ? m->out_norm : NULL, NULL, -1, -1, 0);
    const int pq = neox ? hp->n_heads : 0, pk = neox ? hp->n_kv_heads : 0;
    for (int l = 0; l < hp->n_layers; l++) {
        kvq_layer_weights *w = m ? &m->layers[l] : NULL;
        char nm[KVQ_GGUF_NAME_MAX];
#define VEC(suffix, ne0, field, ph) do { \
            snprintf(nm, sizeof nm, "blk.%d." suffix, l); \
            add_job(jobs, &n, nm, ne0, 0, w ? w->field : NULL, NULL, -1, -1, ph); } while (0)
#define MAT(suffix, ne0, ne1, field, role, ph) do { \
            snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l); \
            add_job(jobs, &n, nm, ne0, ne1, NULL, w ? &w->field : NULL, role, l, ph); } while (0)
        VEC("attn_norm.weight", D, attn_norm, 0);
        MAT("attn_q", D, Q, wq, KVQ_MAT_WQ, pq);
        MAT("attn_k", D, KV, wk, KVQ_MAT_WK, pk);
        MAT("attn_v", D, KV, wv, KVQ_MAT_WV, 0);
        MAT("attn_output", Q, D, wo, KVQ_MAT_WO, 0);
        if (hp->attn_qkv_bias) {
            VEC("attn_q.bias", Q, bq, pq);
            VEC("attn_k.bias", KV, bk, pk);
            VEC("attn_v.bias", KV, bv, 0);
        }
        if (hp->attn_out_bias) VEC("attn_output.bias", D, bo, 0);
        if (hp->qk_norm) {
            VEC("attn_q_norm.weight", HD, q_norm, neox ? 1 : 0);
            VEC("attn_k_norm.weight", HD, k_norm, neox ? 1 : 0);
        }
        VEC("ffn_norm.weight", D, ffn_norm, 0);
        MAT("ffn_gate", D, H, w_gate, KVQ_MAT_GATE, 0);
        MAT("ffn_up", D, H, w_up, KVQ_MAT_UP, 0);
        MAT("ffn_down", H, D, w_down, KVQ_MAT_DOWN, 0);
#undef VEC
#undef MAT
    }
    return n;
}

/* rotate-half rows -> interleaved, per head (model_safetensors.c's rule), rows of rb bytes */
static void unpermute_rows(void *w, int n_heads, int head_dim, int rope_dim, size_t rb, char *tmp)
{
    const int half = rope_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        char *base = (char *)w + (size_t)h * head_dim * rb;
        memcpy(tmp, base, (size_t)rope_dim * rb);
        for (int i = 0; i < half; i++)
            for (int jj = 0; jj < 2; jj++) memcpy(base + (size_t)(2 * i + jj) * rb, tmp + (size_t)(jj * half + i) * rb, rb);
    }
}

typedef struct {
    const kvq_hparams *hp;
    kvq_weights mode;
    uint32_t *stored; /* [(n_layers + 1) * 9] */
} type_ctx;

static uint32_t mat_type(void *user, kvq_mat_role role, int layer)
{
    const type_ctx *c = user;
    return kvq_weights_type(c->mode, c->hp, c->stored[(size_t)(layer + 1) * 9 + role]);
}

/* Tensor -> matrix storage: bytes as they are when the types agree; else
 * dequantized to fp32 (and rounded to bf16 / f16 when that is the target),
 * one row at a time. */
static kvq_status read_mat(const kvq_gguf *g, const job *j, float *row, kvq_err *err)
{
    const kvq_gguf_tensor *t = j->t;
    kvq_mat *m = j->mat;
    if ((uint32_t)t->type == m->type) {
        memcpy(m->data, t->data, t->n_bytes);
        return KVQ_OK;
    }
    if (m->type == KVQ_GGML_F32) return kvq_gguf_tensor_dequantize(g, t, (float *)m->data, err);
    size_t src_rb = t->n_bytes / (size_t)m->rows;
    for (int r = 0; r < m->rows; r++) {
        KVQ_TRY(kvq_ggml_dequantize(t->type, t->data + (size_t)r * src_rb, src_rb, row, (size_t)m->cols, j->name, err));
        uint16_t *d = (uint16_t *)((char *)m->data + (size_t)r * m->row_bytes);
        for (int c = 0; c < m->cols; c++) d[c] = m->type == KVQ_GGML_F16 ? kvq_f32_to_f16(row[c]) : kvq_f32_to_bf16(row[c]);
    }
    return KVQ_OK;
}

kvq_status kvq_model_load_gguf(const char *path, kvq_weights weights, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    kvq_gguf g;
    KVQ_TRY(kvq_gguf_open(path, &g, err));
    kvq_hparams hp;
    bool neox = false;
    job *jobs = NULL;
    uint32_t *stored = NULL;
    char *tmp = NULL;
    size_t n = 0;
    kvq_status s = read_hparams(&g, &hp, &neox, err);
    if (s) goto done;
    jobs = calloc(3 + MAX_JOBS_PER_LAYER * (size_t)hp.n_layers, sizeof *jobs);
    stored = calloc(((size_t)hp.n_layers + 1) * 9, sizeof *stored);
    if (!jobs || !stored) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the tensor list", path);
        goto done;
    }
    /* 1. every expected tensor present with its shape and a known type (before allocating) */
    n = build_jobs(&hp, neox, NULL, jobs);
    for (size_t i = 0; i < n; i++) {
        if ((s = check_job(&g, &jobs[i], err))) goto done;
        if (jobs[i].role >= 0) stored[(size_t)(jobs[i].layer + 1) * 9 + jobs[i].role] = (uint32_t)jobs[i].t->type;
    }
    /* 2. every tensor in the file claimed exactly once (rope_freqs.weight was read with the hyperparameters) */
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const kvq_gguf_tensor *t = &g.tensors[i];
        bool used = kvq_gguf_str_eq(t->name, "rope_freqs.weight") && hp.rope_scaling == KVQ_ROPE_SCALING_FREQ_FACTORS &&
                    t == kvq_gguf_find_tensor(&g, "rope_freqs.weight");
        for (size_t k = 0; k < n && !used; k++) used = jobs[k].t == t;
        if (used) continue;
        for (size_t k = 0; k < n; k++)
            if (kvq_gguf_str_eq(t->name, jobs[k].name)) {
                s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' appears more than once", path, jobs[k].name);
                goto done;
            }
        s = kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor '%.*s' is not part of a %d-layer %s model that kvq can run (expected %zu tensors, file has %llu)",
                     path, (int)(t->name.len < 96 ? t->name.len : 96), t->name.str, hp.n_layers, kvq_arch_name(hp.arch), n,
                     (unsigned long long)g.n_tensors);
        goto done;
    }
    /* 3. allocate and convert; nothing below can fail on file content */
    type_ctx tc = {&hp, weights, stored};
    if ((s = kvq_model_alloc_typed(out, &hp, mat_type, &tc, weights == KVQ_WEIGHTS_AUTO ? KVQ_WEIGHTS_NATIVE : weights, err))) {
        kvq_err_prefix(err, "%s", path);
        goto done;
    }
    out->source = KVQ_SRC_GGUF;
    snprintf(out->path, sizeof out->path, "%s", path);
    n = build_jobs(&hp, neox, out, jobs);
    size_t max_cols = 1;
    for (size_t i = 0; i < n; i++) {
        if ((s = check_job(&g, &jobs[i], err))) goto done;
        if (jobs[i].mat && (size_t)jobs[i].mat->cols > max_cols) max_cols = (size_t)jobs[i].mat->cols;
    }
    /* one parallel region over tensors (largest first, dynamic), not one per
     * tensor: hundreds of small fork/join barriers are slow on busy machines.
     * kvq_gguf_tensor_dequantize's own row loop runs serially when nested. */
    int failed = 0;
#pragma omp parallel reduction(|| : failed)
    {
        float *row = malloc(max_cols * sizeof *row);
        if (!row) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n; i++) {
            if (!row) continue;
            kvq_err e2 = {0};
            const job *j = &jobs[i];
            kvq_status r = j->mat ? read_mat(&g, j, row, &e2) : kvq_gguf_tensor_dequantize(&g, j->t, j->dst, &e2);
            if (r != KVQ_OK) failed = 1;
            kvq_gguf_release(&g, j->t); /* the file's pages leave this process's memory */
        }
        free(row);
    }
    if (failed) { /* unreachable after check_job (or out of memory); report the first failure serially */
        float *row = malloc(max_cols * sizeof *row);
        if (!row) s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        for (size_t i = 0; i < n && !s; i++) s = jobs[i].mat ? read_mat(&g, &jobs[i], row, err) : kvq_gguf_tensor_dequantize(&g, jobs[i].t, jobs[i].dst, err);
        free(row);
        if (s) goto done;
    }
    size_t max_rb = sizeof(float);
    for (size_t i = 0; i < n; i++)
        if (jobs[i].mat && jobs[i].mat->row_bytes > max_rb) max_rb = jobs[i].mat->row_bytes;
    tmp = malloc((size_t)hp.head_dim * max_rb);
    if (!tmp) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const job *j = &jobs[i];
        if (j->perm_heads <= 0) continue;
        if (j->mat) unpermute_rows(j->mat->data, j->perm_heads, hp.head_dim, hp.rope_dim, j->mat->row_bytes, tmp);
        else unpermute_rows(j->dst, j->perm_heads, hp.head_dim, hp.rope_dim, sizeof(float), tmp);
    }
done:
    free(tmp);
    free(jobs);
    free(stored);
    kvq_gguf_close(&g);
    if (s) kvq_model_free(out);
    return s;
}
