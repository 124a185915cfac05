/* model.c — model allocation, validation and format dispatch; see model.h. */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ggml_dequant.h"
#include "half.h"
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
    if (hp->rope_dim / 2 > KVQ_ROPE_MAX_PAIRS)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: rope dimension_count %d: at most %d rotated channels per head are supported", path,
                        hp->rope_dim, 2 * KVQ_ROPE_MAX_PAIRS);
    if ((double)hp->n_heads * hp->head_dim > big || hp->sliding_window < 0 || hp->swa_first_layer < 0 || hp->swa_first_layer > hp->n_layers)
        return kvq_fail(err, KVQ_EFORMAT, "%s: implausible attention shape (heads %d x head_dim %d, sliding window %d from layer %d)", path,
                        hp->n_heads, hp->head_dim, hp->sliding_window, hp->swa_first_layer);
    if (hp->rope_scaling != KVQ_ROPE_SCALING_NONE && !(hp->rope_scale_factor > 0 && isfinite(hp->rope_scale_factor)))
        return kvq_fail(err, KVQ_EFORMAT, "%s: rope scaling factor %g: expected a finite positive number", path, hp->rope_scale_factor);
    if (hp->rope_scaling == KVQ_ROPE_SCALING_YARN &&
        (hp->rope_orig_ctx <= 0 || !(hp->rope_attn_factor > 0) || !isfinite(hp->rope_attn_factor) || !(hp->rope_beta_fast > 0) ||
         !(hp->rope_beta_slow > 0) || !isfinite(hp->rope_beta_fast) || !isfinite(hp->rope_beta_slow)))
        return kvq_fail(err, KVQ_EFORMAT, "%s: yarn RoPE: original context %d, attention factor %g, beta_fast %g, beta_slow %g: expected positive finite values",
                        path, hp->rope_orig_ctx, hp->rope_attn_factor, hp->rope_beta_fast, hp->rope_beta_slow);
    if (hp->rope_scaling == KVQ_ROPE_SCALING_FREQ_FACTORS)
        for (int i = 0; i < hp->rope_dim / 2; i++)
            if (!(hp->rope_freq_factors[i] > 0) || !isfinite(hp->rope_freq_factors[i]))
                return kvq_fail(err, KVQ_EFORMAT, "%s: RoPE frequency factor %d is %g: expected a finite positive number", path, i,
                                hp->rope_freq_factors[i]);
    return KVQ_OK;
}

const char *kvq_arch_name(kvq_arch a)
{
    switch (a) {
    case KVQ_ARCH_QWEN2: return "qwen2";
    case KVQ_ARCH_QWEN3: return "qwen3";
    case KVQ_ARCH_MISTRAL: return "mistral";
    default: return "llama";
    }
}

const char *kvq_rope_scaling_name(kvq_rope_scaling s)
{
    switch (s) {
    case KVQ_ROPE_SCALING_LINEAR: return "linear";
    case KVQ_ROPE_SCALING_LLAMA3: return "llama3";
    case KVQ_ROPE_SCALING_YARN: return "yarn";
    case KVQ_ROPE_SCALING_DYNAMIC: return "dynamic";
    case KVQ_ROPE_SCALING_FREQ_FACTORS: return "freq_factors";
    default: return "none";
    }
}

static const char *const WEIGHTS_NAMES[] = {"auto", "f32", "bf16", "f16", "native"};

const char *kvq_weights_name(kvq_weights w)
{
    return (unsigned)w < sizeof WEIGHTS_NAMES / sizeof *WEIGHTS_NAMES ? WEIGHTS_NAMES[w] : "?";
}

kvq_status kvq_weights_parse(const char *s, const char *what, kvq_weights *out, kvq_err *err)
{
    for (size_t i = 0; i < sizeof WEIGHTS_NAMES / sizeof *WEIGHTS_NAMES; i++)
        if (s && !strcmp(s, WEIGHTS_NAMES[i])) {
            *out = (kvq_weights)i;
            return KVQ_OK;
        }
    return kvq_fail(err, KVQ_EINVAL, "%s: expected auto, f32, bf16, f16 or native, found \"%.64s\"", what, s ? s : "");
}

double kvq_hparams_f32_bytes(const kvq_hparams *hp)
{
    double dim = hp->dim, hid = hp->hidden_dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), V = hp->vocab_size;
    double per_layer = qd * dim * 2 + kvd * dim * 2 + 3 * hid * dim;
    return 4.0 * (per_layer * hp->n_layers + V * dim * (hp->tied_embeddings ? 1 : 2));
}

uint32_t kvq_weights_type(kvq_weights w, const kvq_hparams *hp, uint32_t stored)
{
    switch (w) {
    case KVQ_WEIGHTS_F32: return KVQ_GGML_F32;
    case KVQ_WEIGHTS_BF16: return KVQ_GGML_BF16;
    case KVQ_WEIGHTS_F16: return KVQ_GGML_F16;
    case KVQ_WEIGHTS_NATIVE: return stored;
    default:
        if (kvq_hparams_f32_bytes(hp) <= KVQ_WEIGHTS_AUTO_F32_MAX) return KVQ_GGML_F32;
        return stored == KVQ_GGML_F32 ? KVQ_GGML_BF16 : stored;
    }
}

void kvq_mat_rows(const kvq_mat *w, int r0, int n, float *dst)
{
    if (n <= 0) return;
    const char *src = (const char *)w->data + (size_t)r0 * w->row_bytes;
    size_t ne = (size_t)n * w->cols;
    switch (w->type) {
    case KVQ_GGML_F32: memcpy(dst, src, ne * sizeof(float)); return;
    case KVQ_GGML_BF16: {
        const uint16_t *h = (const uint16_t *)src;
        for (size_t i = 0; i < ne; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &u, sizeof u);
        }
        return;
    }
    case KVQ_GGML_F16: {
        const uint16_t *h = (const uint16_t *)src;
        for (size_t i = 0; i < ne; i++) dst[i] = kvq_f16_to_f32(h[i]);
        return;
    }
    default:
        /* validated at allocation: whole blocks of a type kvq dequantizes */
        (void)kvq_ggml_dequantize((kvq_ggml_type)w->type, src, (size_t)n * w->row_bytes, dst, ne, "weights", NULL);
    }
}

/* Matrices of hp in allocation order: role, layer, rows, cols. */
typedef struct {
    kvq_mat_role role;
    int layer;
    size_t rows, cols;
} mat_spec;

static size_t mat_specs(const kvq_hparams *hp, mat_spec *out)
{
    size_t n = 0, dim = hp->dim, hid = hp->hidden_dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), V = hp->vocab_size;
#define ADD(r, l, R, C) do { if (out) out[n] = (mat_spec){r, l, R, C}; n++; } while (0)
    ADD(KVQ_MAT_TOK_EMBD, -1, V, dim);
    if (!hp->tied_embeddings) ADD(KVQ_MAT_OUTPUT, -1, V, dim);
    for (int l = 0; l < hp->n_layers; l++) {
        ADD(KVQ_MAT_WQ, l, qd, dim);
        ADD(KVQ_MAT_WK, l, kvd, dim);
        ADD(KVQ_MAT_WV, l, kvd, dim);
        ADD(KVQ_MAT_WO, l, dim, qd);
        ADD(KVQ_MAT_GATE, l, hid, dim);
        ADD(KVQ_MAT_UP, l, hid, dim);
        ADD(KVQ_MAT_DOWN, l, dim, hid);
    }
#undef ADD
    return n;
}

static kvq_mat *mat_of(kvq_model *m, kvq_mat_role r, int l)
{
    kvq_layer_weights *w = l >= 0 ? &m->layers[l] : NULL;
    switch (r) {
    case KVQ_MAT_TOK_EMBD: return &m->tok_embd;
    case KVQ_MAT_OUTPUT: return &m->output;
    case KVQ_MAT_WQ: return &w->wq;
    case KVQ_MAT_WK: return &w->wk;
    case KVQ_MAT_WV: return &w->wv;
    case KVQ_MAT_WO: return &w->wo;
    case KVQ_MAT_GATE: return &w->w_gate;
    case KVQ_MAT_UP: return &w->w_up;
    default: return &w->w_down;
    }
}

static const char *role_name(kvq_mat_role r)
{
    static const char *const n[] = {"tok_embd", "output", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
    return (unsigned)r < 9 ? n[r] : "?";
}

kvq_status kvq_model_alloc(kvq_model *m, const kvq_hparams *hp, kvq_err *err)
{
    return kvq_model_alloc_typed(m, hp, NULL, NULL, KVQ_WEIGHTS_F32, err);
}

/* One arena for the fp32 vectors and fp32 matrices (llm.c style), one byte
 * arena for the other matrices. */
kvq_status kvq_model_alloc_typed(kvq_model *m, const kvq_hparams *hp, kvq_mat_type_fn type_of, void *user,
                                 kvq_weights weights, kvq_err *err)
{
    size_t dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), L = hp->n_layers, hd = hp->head_dim;
    size_t vec_per_layer = 2 * dim + (hp->attn_qkv_bias ? qd + 2 * kvd : 0) + (hp->attn_out_bias ? dim : 0) +
                           (hp->qk_norm ? 2 * hd : 0);
    size_t n_mat = mat_specs(hp, NULL);
    mat_spec *ms = malloc(n_mat * sizeof *ms);
    uint32_t *ty = malloc(n_mat * sizeof *ty);
    size_t *nbytes = malloc(n_mat * sizeof *nbytes);
    if (!ms || !ty || !nbytes) {
        free(ms), free(ty), free(nbytes);
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate the weight list");
    }
    mat_specs(hp, ms);
    size_t total = dim, tl, wbytes = 0; /* out_norm */
    kvq_status s = KVQ_OK;
    if (kvq_mul_size(vec_per_layer, L, &tl) || kvq_add_size(total, tl, &total)) s = kvq_fail(err, KVQ_ENOMEM, "model size overflows");
    for (size_t i = 0; i < n_mat && !s; i++) {
        ty[i] = type_of ? type_of(user, ms[i].role, ms[i].layer) : KVQ_GGML_F32;
        size_t rb = 0, nb;
        if (ty[i] != KVQ_GGML_F32 && !kvq_ggml_can_dequantize((kvq_ggml_type)ty[i]))
            s = kvq_fail(err, KVQ_EUNSUPPORTED, "%s (layer %d): storage type %u cannot be dequantized", role_name(ms[i].role), ms[i].layer, ty[i]);
        else if (kvq_ggml_nbytes((kvq_ggml_type)ty[i], ms[i].cols, &rb, role_name(ms[i].role), err))
            s = kvq_err_prefix(err, "layer %d", ms[i].layer);
        else if (kvq_mul_size(rb, ms[i].rows, &nb)) s = kvq_fail(err, KVQ_ENOMEM, "model size overflows");
        else if (ty[i] == KVQ_GGML_F32) {
            if (kvq_add_size(total, nb / sizeof(float), &total)) s = kvq_fail(err, KVQ_ENOMEM, "model size overflows");
        } else if (kvq_add_size(wbytes, (nb + 63) / 64 * 64, &wbytes)) s = kvq_fail(err, KVQ_ENOMEM, "model size overflows");
        nbytes[i] = nb;
    }
    if (!s && (total > ((size_t)1 << 40) || wbytes > ((size_t)1 << 42)))
        s = kvq_fail(err, KVQ_ENOMEM, "model size overflows (%zu layers)", L);
    if (s) {
        free(ms), free(ty), free(nbytes);
        return s;
    }
    memset(m, 0, offsetof(kvq_model, source));
    m->hp = *hp;
    m->arena = calloc(total, sizeof(float));
    m->warena = wbytes ? calloc(1, wbytes) : NULL;
    m->layers = calloc(L, sizeof *m->layers);
    if (!m->arena || !m->layers || (wbytes && !m->warena)) {
        free(m->arena);
        free(m->warena);
        free(m->layers);
        m->arena = NULL;
        m->warena = NULL;
        m->layers = NULL;
        free(ms), free(ty), free(nbytes);
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate %.1f MiB for model weights (%s weights)",
                        (total * 4.0 + (double)wbytes) / (1 << 20), kvq_weights_name(weights));
    }
    m->arena_floats = total;
    m->warena_bytes = wbytes;
    m->weights = weights;
    float *p = m->arena;
    char *wp = m->warena;
#define TAKE(n) (p += (n), p - (n))
    m->out_norm = TAKE(dim);
    for (size_t l = 0; l < L; l++) {
        kvq_layer_weights *w = &m->layers[l];
        w->attn_norm = TAKE(dim);
        w->ffn_norm = TAKE(dim);
        if (hp->attn_qkv_bias) {
            w->bq = TAKE(qd);
            w->bk = TAKE(kvd);
            w->bv = TAKE(kvd);
        }
        if (hp->attn_out_bias) w->bo = TAKE(dim);
        if (hp->qk_norm) {
            w->q_norm = TAKE(hd);
            w->k_norm = TAKE(hd);
        }
    }
    size_t count[64] = {0};
    for (size_t i = 0; i < n_mat; i++) {
        kvq_mat *mt = mat_of(m, ms[i].role, ms[i].layer);
        mt->type = ty[i];
        mt->rows = (int)ms[i].rows;
        mt->cols = (int)ms[i].cols;
        mt->row_bytes = nbytes[i] / (ms[i].rows ? ms[i].rows : 1);
        if (ty[i] == KVQ_GGML_F32) {
            mt->data = TAKE(nbytes[i] / sizeof(float));
        } else {
            mt->data = wp;
            wp += (nbytes[i] + 63) / 64 * 64;
        }
        count[ty[i] < 64 ? ty[i] : 63]++;
    }
#undef TAKE
    if (hp->tied_embeddings) m->output = m->tok_embd;
    /* description: the mode and the storage types used */
    bool all_f32 = true;
    for (size_t i = 0; i < n_mat; i++) all_f32 &= ty[i] == KVQ_GGML_F32;
    if (all_f32) m->weights = weights = KVQ_WEIGHTS_F32;
    size_t k = (size_t)snprintf(m->weights_desc, sizeof m->weights_desc, "%s", all_f32 ? "f32 (exact)" : kvq_weights_name(weights));
    const char *sep = ": ";
    for (uint32_t t = 0; t < 64 && !all_f32 && k < sizeof m->weights_desc; t++) {
        if (!count[t]) continue;
        const char *tn = "?";
        kvq_ggml_type_info((kvq_ggml_type)t, NULL, NULL, &tn);
        k += (size_t)snprintf(m->weights_desc + k, sizeof m->weights_desc - k, "%s%s x %zu", sep, tn, count[t]);
        sep = ", ";
    }
    free(ms), free(ty), free(nbytes);
    return KVQ_OK;
}

void kvq_model_free(kvq_model *m)
{
    free(m->arena);
    free(m->warena);
    free(m->layers);
    m->arena = NULL;
    m->warena = NULL;
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
    kvq_load_opts o = {.weights = KVQ_WEIGHTS_AUTO};
    return kvq_model_load_opts(path, &o, out, err);
}

kvq_status kvq_model_load_opts(const char *path, const kvq_load_opts *opts, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    kvq_weights wm = opts ? opts->weights : KVQ_WEIGHTS_AUTO;
    kvq_model_source src;
    KVQ_TRY(detect_source(path, &src, err));
    kvq_status s;
    if (src == KVQ_SRC_SAFETENSORS) s = kvq_model_load_safetensors(path, wm, out, err);
    else if (src == KVQ_SRC_GGUF) s = kvq_model_load_gguf(path, wm, out, err);
    else if (wm == KVQ_WEIGHTS_BF16 || wm == KVQ_WEIGHTS_F16) /* was ignored: the run said "f32 (exact)" */
        return kvq_fail(err, KVQ_EUNSUPPORTED, "--weights %s: %s is a llama2.c checkpoint, loaded in fp32 only (exact mode; "
                        "--weights auto, f32 or native)", wm == KVQ_WEIGHTS_BF16 ? "bf16" : "f16", path);
    else s = kvq_model_load_llama2c(path, out, err); /* fp32 checkpoints of small models: always exact */
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
