/* model_gguf.c — GGUF model loader for architecture "llama".
 *
 * Metadata (llama.cpp src/llama-model.cpp, llama_model::load_hparams; gguf-py
 * constants.py Keys.LLM / Keys.Attention / Keys.Rope):
 *   required  llama.block_count, llama.embedding_length, llama.feed_forward_length,
 *             llama.attention.head_count, llama.attention.layer_norm_rms_epsilon,
 *             llama.context_length
 *   optional  llama.attention.head_count_kv (default head_count),
 *             llama.rope.freq_base (10000), llama.rope.dimension_count (head_dim),
 *             llama.attention.key_length / value_length (must equal head_dim),
 *             llama.rope.scaling.type none|linear (yarn rejected),
 *             llama.rope.scaling.factor, llama.rope.scaling.original_context_length,
 *             legacy llama.rope.scale_linear (linear factor).
 * Tensors (GGUF ne[0] = input dim, ne[1] = output dim, i.e. numpy/kvq shape
 * [out][in]): token_embd [dim, vocab] (vocab_size = its ne[1]), output_norm
 * [dim], output [dim, vocab] (absent: tied to token_embd), and per layer N
 * blk.N.{attn_norm [dim], attn_q [dim, q_dim], attn_k/attn_v [dim, kv_dim],
 * attn_output [q_dim, dim], ffn_norm [dim], ffn_gate/ffn_up [dim, hidden],
 * ffn_down [hidden, dim]}.weight. Any other tensor is rejected (biases,
 * rope_freqs.weight of Llama-3.1 frequency scaling, ...), so nothing the
 * forward pass would need is silently dropped.
 * q/k rows are already in interleaved-RoPE order (convert_hf_to_gguf.py
 * `permute`), kvq's canonical layout: no re-permutation here.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_dequant.h"
#include "gguf.h"
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

static kvq_status read_hparams(const kvq_gguf *g, kvq_hparams *hp, kvq_err *err)
{
    const char *path = g->path;
    kvq_gguf_str arch = {0};
    KVQ_TRY(kvq_gguf_get_str(g, "general.architecture", true, &arch, err));
    if (!kvq_gguf_str_eq(arch, "llama"))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata 'general.architecture': expected \"llama\", found \"%.*s\"",
                        path, (int)(arch.len < 64 ? arch.len : 64), arch.str);
    memset(hp, 0, sizeof *hp);
    KVQ_TRY(get_dim(g, "llama.block_count", true, &hp->n_layers, err));
    KVQ_TRY(get_dim(g, "llama.embedding_length", true, &hp->dim, err));
    KVQ_TRY(get_dim(g, "llama.feed_forward_length", true, &hp->hidden_dim, err));
    KVQ_TRY(get_dim(g, "llama.attention.head_count", true, &hp->n_heads, err));
    hp->n_kv_heads = hp->n_heads;
    KVQ_TRY(get_dim(g, "llama.attention.head_count_kv", false, &hp->n_kv_heads, err));
    KVQ_TRY(get_dim(g, "llama.context_length", true, &hp->ctx_len, err));
    hp->norm_eps = 0;
    KVQ_TRY(get_pos_float(g, "llama.attention.layer_norm_rms_epsilon", true, &hp->norm_eps, err));
    hp->rope_theta = 10000.0f;
    KVQ_TRY(get_pos_float(g, "llama.rope.freq_base", false, &hp->rope_theta, err));

    if (hp->dim % hp->n_heads)
        return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'llama.embedding_length' %d is not a multiple of 'llama.attention.head_count' %d",
                        path, hp->dim, hp->n_heads);
    hp->head_dim = hp->dim / hp->n_heads;
    const char *hd_keys[] = {"llama.attention.key_length", "llama.attention.value_length"};
    for (int i = 0; i < 2; i++) {
        int hd = hp->head_dim;
        KVQ_TRY(get_dim(g, hd_keys[i], false, &hd, err));
        if (hd != hp->head_dim)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata '%s': expected embedding_length/head_count = %d, found %d (decoupled head size not supported)",
                            path, hd_keys[i], hp->head_dim, hd);
    }
    hp->rope_dim = hp->head_dim;
    KVQ_TRY(get_dim(g, "llama.rope.dimension_count", false, &hp->rope_dim, err));

    /* RoPE scaling */
    hp->rope_scaling = KVQ_ROPE_SCALING_NONE;
    hp->rope_scale_factor = 1.0f;
    kvq_gguf_str st = {0};
    KVQ_TRY(kvq_gguf_get_str(g, "llama.rope.scaling.type", false, &st, err));
    if (kvq_gguf_find(g, "llama.rope.scaling.type")) {
        if (kvq_gguf_str_eq(st, "linear")) {
            hp->rope_scaling = KVQ_ROPE_SCALING_LINEAR;
            KVQ_TRY(get_pos_float(g, "llama.rope.scaling.factor", true, &hp->rope_scale_factor, err));
        } else if (kvq_gguf_str_eq(st, "yarn")) {
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: metadata 'llama.rope.scaling.type': \"yarn\" RoPE scaling is not supported (supported: none, linear)", path);
        } else if (!kvq_gguf_str_eq(st, "none")) {
            return kvq_fail(err, KVQ_EFORMAT, "%s: metadata 'llama.rope.scaling.type': expected none, linear or yarn, found \"%.*s\"",
                            path, (int)(st.len < 64 ? st.len : 64), st.str);
        }
    } else if (kvq_gguf_find(g, "llama.rope.scale_linear")) {
        KVQ_TRY(get_pos_float(g, "llama.rope.scale_linear", true, &hp->rope_scale_factor, err));
        if (hp->rope_scale_factor != 1.0f) hp->rope_scaling = KVQ_ROPE_SCALING_LINEAR;
    }
    KVQ_TRY(get_dim(g, "llama.rope.scaling.original_context_length", false, &hp->rope_orig_ctx, err));
    if (kvq_gguf_find_tensor(g, "rope_freqs.weight"))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor 'rope_freqs.weight': Llama-3.1-style RoPE frequency factors are not supported", path);

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
    float *dst;
    const kvq_gguf_tensor *t;
} job;

static void add_job(job *jobs, size_t *n, const char *name, uint64_t ne0, uint64_t ne1, float *dst)
{
    job *j = &jobs[(*n)++];
    snprintf(j->name, sizeof j->name, "%s", name);
    j->ne0 = ne0;
    j->ne1 = ne1;
    j->dst = dst;
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

/* The tensors of a llama model with their expected GGUF shapes; dst pointers
 * into m when m != NULL (else NULL: shape checking before allocation). */
static size_t build_jobs(const kvq_hparams *hp, kvq_model *m, job *jobs)
{
    size_t n = 0;
    const uint64_t D = hp->dim, H = hp->hidden_dim, Q = kvq_q_dim(hp), KV = kvq_kv_dim(hp), V = hp->vocab_size;
    /* largest first: the embedding table dominates the load time */
    add_job(jobs, &n, "token_embd.weight", D, V, m ? m->tok_embd : NULL);
    if (!hp->tied_embeddings) add_job(jobs, &n, "output.weight", D, V, m ? m->output : NULL);
    add_job(jobs, &n, "output_norm.weight", D, 0, m ? m->out_norm : NULL);
    for (int l = 0; l < hp->n_layers; l++) {
        kvq_layer_weights *w = m ? &m->layers[l] : NULL;
        char nm[KVQ_GGUF_NAME_MAX];
#define LAYER(suffix, ne0, ne1, field) do { \
            snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", l); \
            add_job(jobs, &n, nm, ne0, ne1, w ? w->field : NULL); } while (0)
        LAYER("attn_norm", D, 0, attn_norm);
        LAYER("attn_q", D, Q, wq);
        LAYER("attn_k", D, KV, wk);
        LAYER("attn_v", D, KV, wv);
        LAYER("attn_output", Q, D, wo);
        LAYER("ffn_norm", D, 0, ffn_norm);
        LAYER("ffn_gate", D, H, w_gate);
        LAYER("ffn_up", D, H, w_up);
        LAYER("ffn_down", H, D, w_down);
#undef LAYER
    }
    return n;
}

kvq_status kvq_model_load_gguf(const char *path, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    kvq_gguf g;
    KVQ_TRY(kvq_gguf_open(path, &g, err));
    kvq_hparams hp;
    job *jobs = NULL;
    size_t n = 0;
    kvq_status s = read_hparams(&g, &hp, err);
    if (s) goto done;
    jobs = calloc(3 + 9 * (size_t)hp.n_layers, sizeof *jobs);
    if (!jobs) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the tensor list", path);
        goto done;
    }
    /* 1. every expected tensor present with its shape and a known type (before allocating) */
    n = build_jobs(&hp, NULL, jobs);
    for (size_t i = 0; i < n; i++)
        if ((s = check_job(&g, &jobs[i], err))) goto done;
    /* 2. every tensor in the file claimed exactly once */
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const kvq_gguf_tensor *t = &g.tensors[i];
        bool used = false;
        for (size_t k = 0; k < n && !used; k++) used = jobs[k].t == t;
        if (used) continue;
        for (size_t k = 0; k < n; k++)
            if (kvq_gguf_str_eq(t->name, jobs[k].name)) {
                s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor '%s' appears more than once", path, jobs[k].name);
                goto done;
            }
        s = kvq_fail(err, KVQ_EUNSUPPORTED, "%s: tensor '%.*s' is not part of a %d-layer llama model that kvq can run (expected %zu tensors, file has %llu)",
                     path, (int)(t->name.len < 96 ? t->name.len : 96), t->name.str, hp.n_layers, n, (unsigned long long)g.n_tensors);
        goto done;
    }
    /* 3. allocate and dequantize; nothing below can fail on file content */
    if ((s = kvq_model_alloc(out, &hp, err))) {
        kvq_err_prefix(err, "%s", path);
        goto done;
    }
    out->source = KVQ_SRC_GGUF;
    snprintf(out->path, sizeof out->path, "%s", path);
    n = build_jobs(&hp, out, jobs);
    for (size_t i = 0; i < n; i++)
        if ((s = check_job(&g, &jobs[i], err))) goto done;
    /* one parallel region over tensors (largest first, dynamic), not one per
     * tensor: hundreds of small fork/join barriers are slow on busy machines.
     * kvq_gguf_tensor_dequantize's own row loop runs serially when nested. */
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
    for (size_t i = 0; i < n; i++) {
        kvq_err e2 = {0};
        if (kvq_gguf_tensor_dequantize(&g, jobs[i].t, jobs[i].dst, &e2) != KVQ_OK) failed = 1;
    }
    if (failed) /* unreachable after check_job; report the first failure serially */
        for (size_t i = 0; i < n && !s; i++) s = kvq_gguf_tensor_dequantize(&g, jobs[i].t, jobs[i].dst, err);
done:
    free(jobs);
    kvq_gguf_close(&g);
    if (s) kvq_model_free(out);
    return s;
}
