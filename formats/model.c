/* model.c — model allocation, validation and format dispatch; see model.h. */
#include "model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loaders.h"
#include "sniff.h"

kvq_status kvq_hparams_validate(const kvq_hparams *hp, const char *path, kvq_err *err)
{
#define POS(f, name) if (hp->f <= 0) return kvq_fail(err, KVQ_EFORMAT, "%s: %s: expected > 0, found %d", path, name, hp->f)
    POS(n_layers, "n_layers (block_count)");
    POS(dim, "dim (embedding_length)");
    POS(hidden_dim, "hidden_dim (feed_forward_length)");
    POS(n_heads, "n_heads (attention.head_count)");
    POS(n_kv_heads, "n_kv_heads (attention.head_count_kv)");
    POS(head_dim, "head_dim");
    POS(vocab_size, "vocab_size");
    POS(ctx_len, "ctx_len (context_length)");
#undef POS
    const int big = 1 << 20;
    if (hp->dim > big || hp->hidden_dim > big || hp->n_layers > 4096 || hp->n_heads > 4096 || hp->vocab_size > (1 << 24) || hp->head_dim > 4096)
        return kvq_fail(err, KVQ_EFORMAT, "%s: implausible dimensions (dim %d, hidden %d, layers %d, heads %d, vocab %d, head_dim %d)",
                        path, hp->dim, hp->hidden_dim, hp->n_layers, hp->n_heads, hp->vocab_size, hp->head_dim);
    if (hp->n_heads % hp->n_kv_heads)
        return kvq_fail(err, KVQ_EFORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d (GQA)", path, hp->n_heads, hp->n_kv_heads);
    if (hp->rope_dim <= 0 || hp->rope_dim > hp->head_dim || hp->rope_dim % 2)
        return kvq_fail(err, KVQ_EFORMAT, "%s: rope dimension_count: expected an even value in 2..head_dim (%d), found %d", path, hp->head_dim, hp->rope_dim);
    if (!(hp->rope_theta > 0) || !(hp->norm_eps > 0) || !(hp->norm_eps < 1))
        return kvq_fail(err, KVQ_EFORMAT, "%s: rope theta %g / rms eps %g out of range", path, hp->rope_theta, hp->norm_eps);
    return KVQ_OK;
}

/* Sizes, in floats, of every weight; one arena holds them all (llm.c style). */
kvq_status kvq_model_alloc(kvq_model *m, const kvq_hparams *hp, kvq_err *err)
{
    size_t dim = hp->dim, hid = hp->hidden_dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), V = hp->vocab_size, L = hp->n_layers;
    size_t per_layer = dim /*attn_norm*/ + qd * dim + 2 * kvd * dim + dim * qd + dim /*ffn_norm*/ + 3 * hid * dim;
    size_t total = V * dim + dim + (hp->tied_embeddings ? 0 : V * dim);
    size_t tl;
    if (kvq_mul_size(per_layer, L, &tl) || kvq_add_size(total, tl, &total) || total > ((size_t)1 << 40))
        return kvq_fail(err, KVQ_ENOMEM, "model size overflows (%zu layers x %zu floats)", L, per_layer);
    m->hp = *hp;
    m->arena = calloc(total, sizeof(float));
    m->layers = calloc(L, sizeof *m->layers);
    if (!m->arena || !m->layers) {
        free(m->arena);
        free(m->layers);
        m->arena = NULL;
        m->layers = NULL;
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate %.1f MiB for model weights", total * 4.0 / (1 << 20));
    }
    m->arena_floats = total;
    float *p = m->arena;
#define TAKE(n) (p += (n), p - (n))
    m->tok_embd = TAKE(V * dim);
    m->out_norm = TAKE(dim);
    m->output = hp->tied_embeddings ? m->tok_embd : TAKE(V * dim);
    for (size_t l = 0; l < L; l++) {
        kvq_layer_weights *w = &m->layers[l];
        w->attn_norm = TAKE(dim);
        w->wq = TAKE(qd * dim);
        w->wk = TAKE(kvd * dim);
        w->wv = TAKE(kvd * dim);
        w->wo = TAKE(dim * qd);
        w->ffn_norm = TAKE(dim);
        w->w_gate = TAKE(hid * dim);
        w->w_up = TAKE(hid * dim);
        w->w_down = TAKE(dim * hid);
    }
#undef TAKE
    return KVQ_OK;
}

void kvq_model_free(kvq_model *m)
{
    free(m->arena);
    free(m->layers);
    m->arena = NULL;
    m->layers = NULL;
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Format of a model path, as kvq_model_load chooses its loader. */
static kvq_status detect_source(const char *path, kvq_model_source *src, kvq_err *err)
{
    struct stat st;
    if (stat(path, &st) != 0) return kvq_fail(err, KVQ_EIO, "%s: cannot open model: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode) || ends_with(path, ".json")) {
        *src = KVQ_SRC_SAFETENSORS;
        return KVQ_OK;
    }
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a model: GGUF, llama2.c .bin or an HF directory", &f, err)); /* (a FIFO blocked open()) */
    unsigned char head[4096];
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    /* what the file is, when it is not a model kvq loads from a file: named instead of a message about a
     * field of the format its name suggested (a web page named .gguf read as a llama2.c header) */
    const kvq_file_kind kind = kvq_sniff(head, got, (size_t)st.st_size);
    if (kind == KVQ_KIND_GGUF) {
        *src = KVQ_SRC_GGUF;
        return KVQ_OK;
    }
    if (kind == KVQ_KIND_SAFETENSORS || kind == KVQ_KIND_ARTIFACT) {
        if (kind == KVQ_KIND_ARTIFACT)
            return kvq_fail(err, KVQ_EFORMAT, "%s: it is %s, not a model (give it to --artifact)", path, kvq_kind_desc(kind));
        /* the weights of an HF checkpoint: loaded with the config.json beside them; a bare one is named */
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", path);
        char *sl = strrchr(dir, '/');
        if (sl) *sl = 0;
        else snprintf(dir, sizeof dir, ".");
        char cfg[4200];
        snprintf(cfg, sizeof cfg, "%s/config.json", dir);
        if (access(cfg, F_OK) == 0) {
            *src = KVQ_SRC_SAFETENSORS;
            return KVQ_OK;
        }
        return kvq_fail(err, KVQ_EFORMAT,
                        "%s: it is a safetensors file of weights alone: an HF model is its directory, with the config.json "
                        "(and tokenizer.json) beside the weights, and %s has no config.json (expected a GGUF file, a llama2.c "
                        "checkpoint or an HF model directory)",
                        path, dir);
    }
    if (kind != KVQ_KIND_LLAMA2C && kind != KVQ_KIND_BINARY)
        return kvq_fail(err, KVQ_EFORMAT, "%s: it is %s%s, not a model (expected a GGUF file, a llama2.c checkpoint or an HF model "
                                          "directory)",
                        path, kvq_kind_desc(kind), ends_with(path, ".gguf") ? ", named .gguf but without the GGUF magic" : "");
    *src = KVQ_SRC_LLAMA2C;
    return KVQ_OK;
}

kvq_status kvq_model_load(const char *path, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    kvq_model_source src;
    KVQ_TRY(detect_source(path, &src, err));
    kvq_status s;
    if (src == KVQ_SRC_SAFETENSORS) s = kvq_model_load_safetensors(path, out, err);
    else if (src == KVQ_SRC_GGUF) s = kvq_model_load_gguf(path, out, err);
    else s = kvq_model_load_llama2c(path, out, err);
    if (s == KVQ_OK) snprintf(out->path, sizeof out->path, "%s", path);
    return s;
}

kvq_status kvq_model_tokenizer_path(const char *model_path, const char *tokenizer, char *out, size_t out_size, kvq_err *err)
{
    if (tokenizer && *tokenizer) {
        if (access(tokenizer, R_OK) != 0) return kvq_fail(err, KVQ_EIO, "--tokenizer %s: cannot open: %s", tokenizer, strerror(errno));
        if ((size_t)snprintf(out, out_size, "%s", tokenizer) >= out_size)
            return kvq_fail(err, KVQ_EINVAL, "--tokenizer %s: path too long (limit %zu bytes)", tokenizer, out_size - 1);
        return KVQ_OK;
    }
    kvq_model_source src;
    KVQ_TRY(detect_source(model_path, &src, err));
    if (src == KVQ_SRC_GGUF) {
        if ((size_t)snprintf(out, out_size, "%s", model_path) >= out_size)
            return kvq_fail(err, KVQ_EINVAL, "%s: path too long (limit %zu bytes)", model_path, out_size - 1);
        return KVQ_OK;
    }
    if (src == KVQ_SRC_LLAMA2C)
        return kvq_fail(err, KVQ_EINVAL, "%s: a llama2.c checkpoint carries no tokenizer; pass --tokenizer FILE "
                        "(llama2.c tokenizer.bin, HF tokenizer.json or a GGUF file)", model_path);
    char dir[4096], weights[4096];
    KVQ_TRY(kvq_hf_checkpoint_paths(model_path, dir, sizeof dir, weights, sizeof weights, err));
    int k = snprintf(out, out_size, "%s/tokenizer.json", dir);
    if (k < 0 || (size_t)k >= out_size) return kvq_fail(err, KVQ_EINVAL, "%s/tokenizer.json: path too long (limit %zu bytes)", dir, out_size - 1);
    if (access(out, R_OK) != 0)
        return kvq_fail(err, KVQ_EINVAL, "%s: HF checkpoint has no readable tokenizer.json (%s); pass --tokenizer FILE", model_path, strerror(errno));
    return KVQ_OK;
}
