/* llama2c.c — llama2.c checkpoint loader (legacy "version 0" export).
 * Layout (karpathy/llama2.c run.c, memory_map_weights): header of 7 int32
 * {dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len}; a
 * negative vocab_size means the classifier is stored separately (untied).
 * Then fp32 arrays, each stacked over layers where per-layer:
 *   token_embedding [vocab][dim], rms_att [L][dim], wq [L][q_dim][dim],
 *   wk [L][kv_dim][dim], wv [L][kv_dim][dim], wo [L][dim][q_dim],
 *   rms_ffn [L][dim], w1 [L][hidden][dim], w2 [L][dim][hidden],
 *   w3 [L][hidden][dim], rms_final [dim], freq_cis_real/imag
 *   [seq_len][head_dim/2] each (skipped), wcls [vocab][dim] if untied.
 * RoPE: interleaved pairs, theta 10000, rotary dim = head_dim; RMSNorm eps 1e-5
 * (run.c constants). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "loaders.h"

/* Hyperparameters of a llama2.c header and the file size they imply (bytes). */
static kvq_status llama2c_header(const int32_t h[7], const char *path, kvq_hparams *out, size_t *expect, kvq_err *err)
{
    kvq_hparams hp = {0};
    hp.dim = h[0];
    hp.hidden_dim = h[1];
    hp.n_layers = h[2];
    hp.n_heads = h[3];
    hp.n_kv_heads = h[4];
    hp.tied_embeddings = h[5] > 0;
    hp.vocab_size = h[5] == INT32_MIN ? 0 : (h[5] < 0 ? -h[5] : h[5]);
    hp.ctx_len = h[6];
    hp.head_dim = hp.n_heads > 0 && hp.dim % hp.n_heads == 0 ? hp.dim / hp.n_heads : 0;
    hp.rope_dim = hp.head_dim;
    hp.rope_theta = 10000.0f;
    hp.rope_scaling = KVQ_ROPE_SCALING_NONE;
    hp.rope_scale_factor = 1.0f;
    hp.rope_attn_factor = 1.0f;
    hp.norm_eps = 1e-5f;
    if (hp.n_heads > 0 && hp.dim % hp.n_heads)
        return kvq_fail(err, KVQ_EFORMAT, "%s: header: dim %d is not a multiple of n_heads %d", path, hp.dim, hp.n_heads);
    if (kvq_hparams_validate(&hp, path, err)) return kvq_err_prefix(err, "not a GGUF file, read as llama2.c checkpoint");
    size_t dim = hp.dim, hid = hp.hidden_dim, L = hp.n_layers, V = hp.vocab_size, qd = kvq_q_dim(&hp), kvd = kvq_kv_dim(&hp);
    size_t freq = (size_t)hp.ctx_len * hp.head_dim / 2;
    size_t n = V * dim + L * (dim + qd * dim + 2 * kvd * dim + dim * qd + dim + 3 * hid * dim) + dim + 2 * freq + (hp.tied_embeddings ? 0 : V * dim);
    *expect = 7 * sizeof(int32_t) + n * sizeof(float);
    *out = hp;
    return KVQ_OK;
}

bool kvq_llama2c_is_checkpoint(const void *head, size_t head_len, size_t file_size)
{
    if (head_len < 7 * sizeof(int32_t)) return false;
    int32_t h[7];
    memcpy(h, head, sizeof h);
    kvq_hparams hp;
    size_t expect;
    kvq_err e;
    return llama2c_header(h, "", &hp, &expect, &e) == KVQ_OK && expect == file_size;
}

kvq_status kvq_model_load_llama2c(const char *path, kvq_model *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a llama2.c checkpoint", &f, err));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int e = errno;
        fclose(f);
        return kvq_fail(err, KVQ_EIO, "%s: cannot stat: %s", path, strerror(e));
    }
    size_t fsize = (size_t)st.st_size;
    int32_t h[7];
    if (fsize < sizeof h || fread(h, sizeof h, 1, f) != 1) {
        fclose(f);
        return kvq_fail(err, KVQ_EFORMAT, "%s: llama2.c header: expected 28 bytes (7 int32), file has %zu", path, fsize);
    }
    kvq_hparams hp;
    size_t expect;
    kvq_status s = llama2c_header(h, path, &hp, &expect, err);
    if (s) {
        fclose(f);
        return s;
    }
    if (expect != fsize) {
        fclose(f);
        return kvq_fail(err, KVQ_EFORMAT, "%s: llama2.c checkpoint size: header (dim %d, hidden %d, layers %d, heads %d, kv heads %d, vocab %d, seq_len %d) implies %zu bytes, file has %zu",
                        path, h[0], h[1], h[2], h[3], h[4], h[5], h[6], expect, fsize);
    }
    if ((s = kvq_model_alloc(out, &hp, err))) {
        fclose(f);
        return s;
    }
    out->source = KVQ_SRC_LLAMA2C;
    const size_t dim = hp.dim, hid = hp.hidden_dim, L = hp.n_layers, V = hp.vocab_size, qd = kvq_q_dim(&hp), kvd = kvq_kv_dim(&hp);
    const size_t freq = (size_t)hp.ctx_len * hp.head_dim / 2;
    /* read helper: the array of n floats at the current offset */
#define RD(dst, cnt, what) do { \
        if (fread((dst), sizeof(float), (cnt), f) != (cnt)) { \
            s = kvq_fail(err, KVQ_EIO, "%s: reading %s at offset %ld failed", path, (what), ftell(f)); goto done; } } while (0)
    RD(kvq_mat_f32(&out->tok_embd), V * dim, "token_embedding_table");
    for (size_t l = 0; l < L; l++) RD(out->layers[l].attn_norm, dim, "rms_att_weight");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].wq), qd * dim, "wq");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].wk), kvd * dim, "wk");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].wv), kvd * dim, "wv");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].wo), dim * qd, "wo");
    for (size_t l = 0; l < L; l++) RD(out->layers[l].ffn_norm, dim, "rms_ffn_weight");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].w_gate), hid * dim, "w1");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].w_down), dim * hid, "w2");
    for (size_t l = 0; l < L; l++) RD(kvq_mat_f32(&out->layers[l].w_up), hid * dim, "w3");
    RD(out->out_norm, dim, "rms_final_weight");
    if (fseek(f, (long)(2 * freq * sizeof(float)), SEEK_CUR) != 0) {
        s = kvq_fail(err, KVQ_EIO, "%s: seeking past freq_cis failed", path);
        goto done;
    }
    if (!hp.tied_embeddings) RD(kvq_mat_f32(&out->output), V * dim, "wcls");
#undef RD
done:
    fclose(f);
    if (s) kvq_model_free(out);
    return s;
}
