/* fingerprint.c — SHA-256 of weights files and model fingerprints; see model.h. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <openssl/evp.h>

#include "model.h"
#include "sha256.h"

static kvq_status hash_file(EVP_MD_CTX *ctx, const char *path, kvq_err *err)
{
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "a model file to hash", &f, err));
    unsigned char *buf = malloc(1 << 20);
    if (!buf) {
        fclose(f);
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the hash buffer", path);
    }
    kvq_status s = KVQ_OK;
    size_t got;
    while ((got = fread(buf, 1, 1 << 20, f)) > 0)
        if (EVP_DigestUpdate(ctx, buf, got) != 1) {
            s = kvq_fail(err, KVQ_EIO, "%s: SHA-256 update failed", path);
            break;
        }
    if (!s && ferror(f)) s = kvq_fail(err, KVQ_EIO, "%s: read error while hashing: %s", path, strerror(errno));
    free(buf);
    fclose(f);
    return s;
}

static int keep_entry(const struct dirent *d)
{
    size_t n = strlen(d->d_name);
    return (n > 5 && strcmp(d->d_name + n - 5, ".json") == 0) || (n > 12 && strcmp(d->d_name + n - 12, ".safetensors") == 0);
}

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

static kvq_status hash_dir(EVP_MD_CTX *ctx, const char *dir, kvq_err *err)
{
    struct dirent **list = NULL;
    int n = scandir(dir, &list, keep_entry, by_name);
    if (n < 0) return kvq_fail(err, KVQ_EIO, "%s: cannot list directory: %s", dir, strerror(errno));
    kvq_status s = KVQ_OK;
    for (int i = 0; i < n; i++) {
        char p[8192];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, list[i]->d_name);
        if (!s && stat(p, &st) == 0 && S_ISREG(st.st_mode)) {
            unsigned char sz[8];
            for (int k = 0; k < 8; k++) sz[k] = (unsigned char)((uint64_t)st.st_size >> (8 * k));
            if (EVP_DigestUpdate(ctx, list[i]->d_name, strlen(list[i]->d_name) + 1) != 1 || EVP_DigestUpdate(ctx, sz, 8) != 1)
                s = kvq_fail(err, KVQ_EIO, "%s: SHA-256 update failed", p);
            else
                s = hash_file(ctx, p, err);
        }
        free(list[i]);
    }
    free(list);
    return s;
}

kvq_status kvq_sha256_path(const char *path, char hex[65], kvq_err *err)
{
    struct stat st;
    if (stat(path, &st) != 0) return kvq_fail(err, KVQ_EIO, "%s: cannot stat for hashing: %s", path, strerror(errno));
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return kvq_fail(err, KVQ_ENOMEM, "%s: cannot initialise SHA-256", path);
    }
    kvq_status s = S_ISDIR(st.st_mode) ? hash_dir(ctx, path, err) : hash_file(ctx, path, err);
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned dn = 0;
    if (!s && EVP_DigestFinal_ex(ctx, d, &dn) != 1) s = kvq_fail(err, KVQ_EIO, "%s: SHA-256 final failed", path);
    EVP_MD_CTX_free(ctx);
    if (!s) kvq_hex(d, dn, hex);
    return s;
}

kvq_status kvq_model_fingerprint(const kvq_model *m, char hex[65], char weights_hex[65], kvq_err *err)
{
    if (!m->path[0]) return kvq_fail(err, KVQ_EINVAL, "model fingerprint: the model has no source path");
    char wh[65];
    KVQ_TRY(kvq_sha256_path(m->path, wh, err));
    const kvq_hparams *h = &m->hp;
    char text[2048];
    int n = snprintf(text, sizeof text,
                     "kvq-model-fingerprint-v1\nweights_sha256=%s\n"
                     "n_layers=%d\ndim=%d\nhidden_dim=%d\nn_heads=%d\nn_kv_heads=%d\n"
                     "head_dim=%d\nvocab_size=%d\nctx_len=%d\nrope_dim=%d\nrope_theta=%a\n"
                     "rope_scaling=%d\nrope_scale_factor=%a\nrope_low_freq_factor=%a\n"
                     "rope_high_freq_factor=%a\nrope_orig_ctx=%d\nnorm_eps=%a\ntied=%d\n",
                     wh, h->n_layers, h->dim, h->hidden_dim, h->n_heads, h->n_kv_heads, h->head_dim, h->vocab_size,
                     h->ctx_len, h->rope_dim, (double)h->rope_theta, (int)h->rope_scaling, (double)h->rope_scale_factor,
                     (double)h->rope_low_freq_factor, (double)h->rope_high_freq_factor, h->rope_orig_ctx,
                     (double)h->norm_eps, (int)h->tied_embeddings);
    if (n < 0 || (size_t)n >= sizeof text)
        return kvq_fail(err, KVQ_EIO, "%s: model fingerprint: canonical text too long", m->path);
    if (kvq_sha256_hex(text, (size_t)n, hex, err)) return kvq_err_prefix(err, "%s: model fingerprint", m->path);
    if (weights_hex) memcpy(weights_hex, wh, 65);
    return KVQ_OK;
}
