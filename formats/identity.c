/* identity.c — artifact fingerprints of models and dumps; see identity.h. */
#include "identity.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "sha256.h"

static bool is_sha256_hex(const char *s)
{
    for (int i = 0; i < 64; i++)
        if (!isxdigit((unsigned char)s[i])) return false;
    return s[64] == 0;
}

/* Incremental SHA-256 with a printf front end. */
typedef struct {
    EVP_MD_CTX *ctx;
    bool ok;
} hasher;

static bool h_init(hasher *h)
{
    h->ctx = EVP_MD_CTX_new();
    h->ok = h->ctx && EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) == 1;
    return h->ok;
}

static void h_bytes(hasher *h, const void *p, size_t n)
{
    if (h->ok && n && EVP_DigestUpdate(h->ctx, p, n) != 1) h->ok = false;
}

static void h_printf(hasher *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void h_printf(hasher *h, const char *fmt, ...)
{
    char buf[KVQ_DUMP_CMDLINE_MAX + 64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof buf) { h->ok = false; return; }
    h_bytes(h, buf, (size_t)n);
}

static bool h_final(hasher *h, char hex[65])
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned dn = 0;
    if (h->ok && EVP_DigestFinal_ex(h->ctx, d, &dn) != 1) h->ok = false;
    EVP_MD_CTX_free(h->ctx);
    h->ctx = NULL;
    if (h->ok) kvq_hex(d, dn, hex);
    return h->ok;
}

kvq_status kvq_identity_model_from_dump(const kvq_dump_meta *m, char hex[65], kvq_err *err)
{
    if (!is_sha256_hex(m->model_sha256))
        return kvq_fail(err, KVQ_EINVAL, "model_sha256: expected 64 hex digits, found \"%.80s\"", m->model_sha256);
    hasher h;
    if (!h_init(&h)) {
        EVP_MD_CTX_free(h.ctx);
        return kvq_fail(err, KVQ_ENOMEM, "model fingerprint: cannot initialise SHA-256");
    }
    h_printf(&h, "kvq-artifact-model-v1\nweights_sha256=%s\nmodel_arch=%s\n", m->model_sha256, m->model_arch);
    h_printf(&h, "n_layers=%d\ndim=%d\nhidden_dim=%d\nn_heads=%d\nn_kv_heads=%d\nhead_dim=%d\nvocab_size=%d\nctx_len=%d\n",
             m->n_layers, m->dim, m->hidden_dim, m->n_heads, m->n_kv_heads, m->head_dim, m->vocab_size, m->ctx_len);
    h_printf(&h, "rope_theta=%a\nrope_dim=%d\nrope_pairing=%s\nrope_scaling=%s\n", m->rope_theta, m->rope_dim,
             m->rope_pairing, m->rope_scaling);
    h_printf(&h, "rope_scale_factor=%a\nrope_low_freq_factor=%a\nrope_high_freq_factor=%a\nrope_orig_ctx=%d\n",
             m->rope_scale_factor, m->rope_low_freq_factor, m->rope_high_freq_factor, m->rope_orig_ctx);
    /* added with YaRN / freq_factors RoPE and sliding windows: present only when set, so the fingerprints
     * of models without them (and of artifacts calibrated before) are unchanged */
    if (m->rope_params[0]) h_printf(&h, "rope_params=%s\n", m->rope_params);
    if (m->attention[0]) h_printf(&h, "attention=%s\n", m->attention);
    if (!h_final(&h, hex)) return kvq_fail(err, KVQ_EIO, "model fingerprint: SHA-256 failed");
    return KVQ_OK;
}

kvq_status kvq_identity_model_hp(const char *weights_sha256, const kvq_hparams *hp, char hex[65], kvq_err *err)
{
    kvq_dump_meta *m = calloc(1, sizeof *m); /* ~17 KB of strings: keep it off the stack */
    if (!m) return kvq_fail(err, KVQ_ENOMEM, "model fingerprint: out of memory");
    snprintf(m->model_sha256, sizeof m->model_sha256, "%s", weights_sha256 ? weights_sha256 : "");
    kvq_dump_meta_set_hparams(m, hp); /* model_arch too */
    kvq_status s = kvq_identity_model_from_dump(m, hex, err);
    free(m);
    return s;
}

kvq_status kvq_identity_model(const kvq_model *model, char hex[65], kvq_err *err)
{
    if (!model->path[0]) return kvq_fail(err, KVQ_EINVAL, "model fingerprint: the model has no source path");
    char wh[65];
    KVQ_TRY(kvq_sha256_path(model->path, wh, err));
    return kvq_identity_model_hp(wh, &model->hp, hex, err);
}

kvq_status kvq_identity_dump(kvq_dump_reader *r, char hex[65], kvq_err *err)
{
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    int64_t done = kvq_dump_reader_samples_done(r);
    size_t n_tok = 0;
    int32_t *tok = NULL;
    if (done > 0) {
        if (kvq_mul_size((size_t)done, (size_t)m->seq_len, &n_tok))
            return kvq_fail(err, KVQ_ENOMEM, "dump fingerprint: token count overflows");
        tok = malloc(n_tok * sizeof *tok);
        if (!tok) return kvq_fail(err, KVQ_ENOMEM, "dump fingerprint: cannot allocate %zu tokens", n_tok);
        kvq_status s = kvq_dump_read_tokens(r, 0, done, tok, err);
        if (s) { free(tok); return s; }
    }
    hasher h;
    if (!h_init(&h)) {
        EVP_MD_CTX_free(h.ctx);
        free(tok);
        return kvq_fail(err, KVQ_ENOMEM, "dump fingerprint: cannot initialise SHA-256");
    }
    h_printf(&h, "kvq-dump-v1\nschema_version=%d\nkvq_version=%s\nmodel_sha256=%s\nmodel_arch=%s\n", m->schema_version,
             m->kvq_version, m->model_sha256, m->model_arch);
    h_printf(&h, "n_layers=%d\ndim=%d\nhidden_dim=%d\nn_heads=%d\nn_kv_heads=%d\nhead_dim=%d\nvocab_size=%d\nctx_len=%d\n",
             m->n_layers, m->dim, m->hidden_dim, m->n_heads, m->n_kv_heads, m->head_dim, m->vocab_size, m->ctx_len);
    h_printf(&h, "rope_theta=%a\nrope_dim=%d\nrope_pairing=%s\nrope_scaling=%s\n", m->rope_theta, m->rope_dim,
             m->rope_pairing, m->rope_scaling);
    h_printf(&h, "rope_scale_factor=%a\nrope_low_freq_factor=%a\nrope_high_freq_factor=%a\nrope_orig_ctx=%d\n",
             m->rope_scale_factor, m->rope_low_freq_factor, m->rope_high_freq_factor, m->rope_orig_ctx);
    if (m->rope_params[0]) h_printf(&h, "rope_params=%s\n", m->rope_params);
    if (m->attention[0]) h_printf(&h, "attention=%s\n", m->attention);
    h_printf(&h, "tokenizer=%s\ncorpus_sha256=%s\ncorpus_format=%s\nbos_policy=%s\n", m->tokenizer, m->corpus_sha256,
             m->corpus_format, m->bos_policy);
    h_printf(&h, "n_samples=%" PRId64 "\nseq_len=%" PRId64 "\nseed=%" PRId64 "\n", m->n_samples, m->seq_len, m->seed);
    h_printf(&h, "dtype=%s\nhas_q=%d\nhas_fisher=%d\nhas_attn_stats=%d\nlayer_first=%d\nlayer_last=%d\n",
             m->dtype == KVQ_DUMP_F16 ? "f16" : "f32", (int)m->has_q, (int)m->has_fisher, (int)m->has_attn_stats,
             m->layer_first, m->layer_last);
    h_printf(&h, "samples_done=%" PRId64 "\nsample_offsets=", done);
    for (int64_t s = 0; s < m->n_samples; s++) h_printf(&h, "%s%" PRId64, s ? "," : "", m->sample_offsets[s]);
    h_printf(&h, "\n");
    unsigned char *b = (unsigned char *)tok; /* int32 little-endian whatever the host order, in place */
    for (size_t i = 0; i < n_tok; i++) {
        uint32_t u = (uint32_t)tok[i];
        b[4 * i] = (unsigned char)u;
        b[4 * i + 1] = (unsigned char)(u >> 8);
        b[4 * i + 2] = (unsigned char)(u >> 16);
        b[4 * i + 3] = (unsigned char)(u >> 24);
    }
    h_bytes(&h, b, 4 * n_tok);
    free(tok);
    if (!h_final(&h, hex)) return kvq_fail(err, KVQ_EIO, "dump fingerprint: SHA-256 failed");
    return KVQ_OK;
}

void kvq_identity_rope_desc(const kvq_dump_meta *m, char *buf, size_t n)
{
    int k = snprintf(buf, n, "%s (theta %.9g, rope_dim %d", m->rope_scaling, m->rope_theta, m->rope_dim);
    if (k < 0 || (size_t)k >= n) return;
    if (strcmp(m->rope_scaling, "none") && strcmp(m->rope_scaling, "freq_factors"))
        k += snprintf(buf + k, n - (size_t)k, ", factor %.9g", m->rope_scale_factor);
    if (k >= 0 && (size_t)k < n && !strcmp(m->rope_scaling, "llama3"))
        k += snprintf(buf + k, n - (size_t)k, ", low_freq_factor %.9g, high_freq_factor %.9g", m->rope_low_freq_factor,
                      m->rope_high_freq_factor);
    if (k >= 0 && (size_t)k < n && m->rope_orig_ctx)
        k += snprintf(buf + k, n - (size_t)k, ", original ctx %d", m->rope_orig_ctx);
    if (k >= 0 && (size_t)k < n && !strcmp(m->rope_scaling, "dynamic"))
        k += snprintf(buf + k, n - (size_t)k, ", ctx_len %d", m->ctx_len);
    if (k >= 0 && (size_t)k < n && m->rope_params[0]) k += snprintf(buf + k, n - (size_t)k, ", %s", m->rope_params);
    if (k >= 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, ")");
}

kvq_status kvq_identity_rope_desc_hp(const kvq_hparams *hp, char *buf, size_t n, kvq_err *err)
{
    kvq_dump_meta *m = calloc(1, sizeof *m);
    if (!m) return kvq_fail(err, KVQ_ENOMEM, "RoPE description: out of memory");
    kvq_dump_meta_set_hparams(m, hp);
    kvq_identity_rope_desc(m, buf, n);
    free(m);
    return KVQ_OK;
}
