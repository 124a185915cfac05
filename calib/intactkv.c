/* intactkv.c — IntactKV prefix: tokenise, compute with the unquantized model,
 * check the base artifact, write; see intactkv.h. Training: intactkv_train.c. */
#include "intactkv.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "identity.h"
#include "ops.h"

kvq_status kvq_intactkv_tokenize(const kvq_tokenizer *tok, const char *spec, bool special, bool add_bos, int vocab_size,
                                 size_t max_P, int32_t **ids, size_t *P, kvq_err *err)
{
    *ids = NULL;
    *P = 0;
    if (!spec || !*spec) return kvq_fail(err, KVQ_EINVAL, "--prefix: empty; expected 'bos' or the prefix text");
    int32_t *v = NULL;
    size_t n = 0;
    if (strcmp(spec, "bos") == 0) {
        int32_t bos = kvq_tokenizer_bos(tok);
        if (bos < 0) return kvq_fail(err, KVQ_EINVAL, "--prefix bos: the tokenizer (%s) has no BOS token", kvq_tokenizer_describe(tok));
        v = malloc(sizeof *v);
        if (!v) return kvq_fail(err, KVQ_ENOMEM, "--prefix: out of memory");
        v[0] = bos;
        n = 1;
    } else {
        unsigned flags = (special ? KVQ_TOK_PARSE_SPECIAL : 0u) | (add_bos ? KVQ_TOK_ADD_BOS : 0u);
        KVQ_TRY(kvq_tokenizer_encode(tok, spec, strlen(spec), flags, &v, &n, err));
        if (n == 0) {
            free(v);
            return kvq_fail(err, KVQ_EINVAL, "--prefix \"%.100s\": tokenises to no tokens", spec);
        }
    }
    kvq_status s = KVQ_OK;
    for (size_t i = 0; i < n && !s; i++) {
        if (v[i] < 0 || v[i] >= vocab_size)
            s = kvq_fail(err, KVQ_EINVAL, "--prefix: token %zu = %d is outside the model's vocabulary [0, %d)", i, v[i], vocab_size);
        else if (kvq_tokenizer_token_type(tok, v[i]) == KVQ_TOKTYPE_UNKNOWN)
            s = kvq_fail(err, KVQ_EINVAL,
                         "--prefix \"%.100s\": unknown prefix token at %zu (id %d): the vocabulary cannot represent the text there",
                         spec, i, v[i]);
    }
    if (!s && n > max_P)
        s = kvq_fail(err, KVQ_EINVAL, "--prefix: %zu tokens, more than the %zu the model's context allows", n, max_P);
    if (s) {
        free(v);
        return s;
    }
    *ids = v;
    *P = n;
    return KVQ_OK;
}

typedef struct {
    size_t P, kvd;
    kvq_artifact_prefix *px;
} capture_ctx;

static kvq_status capture_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    capture_ctx *cc = user;
    size_t n = cc->P * cc->kvd, off = (size_t)c->layer * n;
    memcpy(cc->px->k + off, o->k_post, n * sizeof(float));
    memcpy(cc->px->k_pre + off, o->k_pre, n * sizeof(float));
    memcpy(cc->px->v + off, o->v, n * sizeof(float));
    return KVQ_OK;
}

kvq_status kvq_intactkv_compute(const kvq_model *m, const int32_t *ids, size_t P, const char *text, bool special,
                                kvq_artifact_prefix *px, kvq_err *err)
{
    memset(px, 0, sizeof *px);
    const kvq_hparams *hp = &m->hp;
    if (P < 1) return kvq_fail(err, KVQ_EINVAL, "intactkv: empty prefix");
    if (P > (size_t)hp->ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "intactkv: prefix of %zu tokens exceeds the model's context length %d", P, hp->ctx_len);
    for (size_t i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= hp->vocab_size)
            return kvq_fail(err, KVQ_EINVAL, "intactkv: prefix token %zu = %d is outside the model's vocabulary [0, %d)", i, ids[i],
                            hp->vocab_size);
    size_t kvd = (size_t)kvq_kv_dim(hp);
    int *tok = NULL;
    kvq_status s = kvq_artifact_prefix_alloc(px, P, (size_t)hp->n_layers, kvd, "intactkv", err);
    if (s) goto done;
    px->text = strdup(text ? text : "");
    tok = malloc(P * sizeof *tok);
    if (!px->text || !tok) {
        s = kvq_fail(err, KVQ_ENOMEM, "intactkv: cannot allocate the prefix (%zu tokens)", P);
        goto done;
    }
    for (size_t i = 0; i < P; i++) {
        px->token_ids[i] = ids[i];
        px->positions[i] = (int32_t)i;
        tok[i] = ids[i];
    }
    px->special = special;
    kvq_forward fw;
    s = kvq_forward_init(&fw, m, (int)P, 0, 0, err);
    if (s) goto done;
    capture_ctx cc = {.P = P, .kvd = kvd, .px = px};
    kvq_hooks hk = {.user = &cc, .observe = capture_observe};
    kvq_fwd_io io = {.tokens = tok, .T = (int)P, .pos0 = 0, .hooks = &hk};
    kvq_fwd_result r;
    s = kvq_forward_run(&fw, &io, &r, err);
    kvq_forward_free(&fw);
    if (s) kvq_err_prefix(err, "intactkv: prefix forward");
done:
    free(tok);
    if (s) kvq_artifact_prefix_free(px);
    return s;
}

kvq_prefix kvq_intactkv_view(const kvq_artifact_prefix *px)
{
    return (kvq_prefix){.P = px ? (int)px->P : 0, .k = px ? px->k : NULL, .v = px ? px->v : NULL};
}

kvq_status kvq_intactkv_sync_pre_rope(const kvq_hparams *hp, kvq_artifact_prefix *px, kvq_err *err)
{
    size_t P = px->P, kvd = (size_t)kvq_kv_dim(hp), half = (size_t)hp->rope_dim / 2;
    float *cs = malloc((P * half + 1) * sizeof(float)), *sn = malloc((P * half + 1) * sizeof(float));
    if (!cs || !sn) {
        free(cs);
        free(sn);
        return kvq_fail(err, KVQ_ENOMEM, "intactkv: cannot allocate the RoPE table for %zu positions", P);
    }
    kvq_rope_table(hp, 0, (int)P, cs, sn);
    memcpy(px->k_pre, px->k, (size_t)hp->n_layers * P * kvd * sizeof(float));
    for (int l = 0; l < hp->n_layers; l++)
        kvq_rope_apply(px->k_pre + (size_t)l * P * kvd, (int)P, hp->n_kv_heads, hp->head_dim, hp->rope_dim, cs, sn, 1);
    /* YaRN tables carry the attention factor m: the transpose above is m R^T, the inverse is R^T / m
     * (the rotated channels only; channels >= rope_dim were not scaled) */
    const float m = kvq_rope_attn_scale(hp);
    if (m != 1.0f) {
        const float inv2 = 1.0f / (m * m);
        for (size_t r = 0; r < (size_t)hp->n_layers * P * hp->n_kv_heads; r++)
            for (int c = 0; c < hp->rope_dim; c++) px->k_pre[r * hp->head_dim + c] *= inv2;
    }
    free(cs);
    free(sn);
    return KVQ_OK;
}

kvq_status kvq_intactkv_check_base(const kvq_artifact *base, const char *base_path, const kvq_model *m, const char *model_fp,
                                   bool allow_mismatch, FILE *warn, kvq_err *err)
{
    char rope[512] = "";
    kvq_identity_rope_desc_hp(&m->hp, rope, sizeof rope, NULL);
    if (kvq_artifact_check_model_rope(&base->p, model_fp, rope[0] ? rope : NULL, allow_mismatch, warn, err))
        return kvq_err_prefix(err, "--base %s: calibrated for another model", base_path);
    const kvq_artifact_params *p = &base->p;
    if (p->n_layers != (size_t)m->hp.n_layers || p->n_kv_heads != (size_t)m->hp.n_kv_heads || p->head_dim != (size_t)m->hp.head_dim)
        return kvq_fail(err, KVQ_EMISMATCH, "--base %s: shape %zu layers x %zu KV heads x head_dim %zu, model has %d x %d x %d",
                        base_path, p->n_layers, p->n_kv_heads, p->head_dim, m->hp.n_layers, m->hp.n_kv_heads, m->hp.head_dim);
    return KVQ_OK;
}

kvq_status kvq_intactkv_write(const char *out_path, bool force, const kvq_artifact *art, kvq_err *err)
{
    if (!out_path || !*out_path) return kvq_fail(err, KVQ_EINVAL, "intactkv: no output path");
    return kvq_artifact_write_new(out_path, art, force, err);
}

kvq_intactkv_train_opts kvq_intactkv_train_defaults(void)
{
    return (kvq_intactkv_train_opts){.steps = 160, .accum = 16, .lr = 2e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .clip = 0.3,
                                     .seed = 42, .target_cache_mib = 1024};
}
