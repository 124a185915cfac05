/* family_env.h — shared fixtures of the calibrated-family tests (test_wkvq,
 * test_cq): a real kvdump of a tiny model (kvq_capture_run over
 * wiki.valid.tokens, optionally with Fisher information), and the
 * step-by-step decode oracle: a cache appended one token at a time, each
 * token's K/V replaced by a per-token reference quantizer written in the
 * test, attended as a prefix by the next steps; compared bit for bit with the
 * batched pass kveval runs (logits, per-position NLL, the cache entries
 * attention read). Families in place (form 1) quantize the new token before
 * its own step; past-only families (form 2, WKVQuant) let it attend itself
 * exactly and store the quantized copy for later steps. */
#ifndef KVQ_FAMILY_ENV_H
#define KVQ_FAMILY_ENV_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capture.h"
#include "forward.h"
#include "identity.h"
#include "kvq_test.h"
#include "model.h"
#include "safetensors.h"
#include "scheme.h"
#include <sys/wait.h>

/* A dump of `samples` x `seq_len` tokens of wiki.valid.tokens through the tiny model (aidreams-tok512
 * tokenizer: both tiny models have its 512-token vocabulary). 0 when ../shared lacks a file. */
static int fenv_dump(const char *model_rel, int samples, int seq_len, bool fisher, const char *out, char *model_path, size_t n)
{
    char tokf[4096], text[4096];
    if (!kvq_test_shared(model_path, n, model_rel) ||
        !kvq_test_shared(tokf, sizeof tokf, "models/llama2c/aidreams-tok512.bin") ||
        !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"))
        return 0;
    kvq_capture_opts co = kvq_capture_opts_default();
    co.model_path = model_path;
    co.tokenizer_path = tokf;
    co.text_path = text;
    co.format = KVQ_TEXT_WIKITEXT_TOKENS;
    co.samples = samples;
    co.seq_len = seq_len;
    co.fisher = fisher;
    co.dtype = KVQ_DUMP_F32;
    co.quiet = true;
    co.force = true;
    co.out_path = out;
    co.command_line = "family_env";
    kvq_capture_report rep;
    kvq_err e = {0};
    ck_assert_msg(kvq_capture_run(&co, &rep, &e) == KVQ_OK, "%s", e.msg);
    return 1;
}

static void fenv_tokens(int *tok, int n, int V, uint32_t seed)
{
    uint32_t s = seed;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        tok[i] = (int)((s >> 8) % (uint32_t)V);
    }
}

static size_t fenv_bits_differ(const float *a, const float *b, size_t n)
{
    size_t f = 0;
    for (size_t i = 0; i < n; i++) f += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return f;
}

/* Per-token reference quantizer: one token's row x[kv_dim] (keys in the scheme's stage) of `layer`, side
 * 'k' / 'v', at window position pos, replaced in place by what the cache stores. */
typedef void (*fenv_quant_fn)(void *ctx, int layer, char side, int pos, float *x);

typedef struct {
    fenv_quant_fn q;
    void *qctx;
    bool past_only;
    int kvd, N, step;
    float *ck, *cv; /* [L][N][kvd]: the entries the cache holds (post-RoPE keys) */
} fenv_dec;

static kvq_status fenv_dec_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    (void)alt;
    (void)e;
    fenv_dec *d = user;
    ck_assert_int_eq(c->T, 1);
    ck_assert_int_eq(c->pos0, d->step);
    size_t off = ((size_t)c->layer * d->N + d->step) * d->kvd;
    if (d->past_only) { /* the token attends itself exactly; the cache receives its quantized copy */
        memcpy(d->ck + off, k, (size_t)d->kvd * sizeof(float));
        memcpy(d->cv + off, v, (size_t)d->kvd * sizeof(float));
        d->q(d->qctx, c->layer, 'k', d->step, d->ck + off);
        d->q(d->qctx, c->layer, 'v', d->step, d->cv + off);
        return KVQ_OK;
    }
    d->q(d->qctx, c->layer, 'k', d->step, k);
    d->q(d->qctx, c->layer, 'v', d->step, v);
    return KVQ_OK;
}

static kvq_status fenv_dec_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *e)
{
    (void)e;
    fenv_dec *d = user;
    if (d->past_only) return KVQ_OK;
    size_t off = ((size_t)c->layer * d->N + d->step) * d->kvd;
    memcpy(d->ck + off, o->k_att, (size_t)d->kvd * sizeof(float));
    memcpy(d->cv + off, o->v_att, (size_t)d->kvd * sizeof(float));
    return KVQ_OK;
}

typedef struct {
    kvq_scheme_run run;
    bool alt; /* capture the alternative (past-only) instead of the primary */
    int kvd, N;
    float *k, *v;
} fenv_cap;

static kvq_status fenv_cap_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    return kvq_scheme_transform(&((fenv_cap *)user)->run, c, k, v, alt, e);
}

static kvq_status fenv_cap_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *e)
{
    (void)e;
    fenv_cap *b = user;
    size_t off = (size_t)c->layer * b->N * b->kvd, n = (size_t)c->T * b->kvd;
    const float *k = b->alt ? o->k_alt : o->k_att, *v = b->alt ? o->v_alt : o->v_att;
    ck_assert_ptr_nonnull(k);
    ck_assert_ptr_nonnull(v);
    memcpy(b->k + off, k, n * sizeof(float));
    memcpy(b->v + off, v, n * sizeof(float));
    if (b->alt) /* past-only: query i reads keys j < i from the alternative, its own from the primary */
        for (int i = 0; i < c->T; i++) {
            ck_assert_int_eq(o->k_bound[i], i);
            ck_assert_int_eq(o->v_bound[i], i);
        }
    return KVQ_OK;
}

/* naive batched pass for past-only families: every window token quantized for every query, itself included */
static kvq_status fenv_all_quantized(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    KVQ_TRY(kvq_scheme_transform(user, c, k, v, alt, e));
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    memcpy(k, alt->k, n * sizeof(float));
    memcpy(v, alt->v, n * sizeof(float));
    alt->use_k = alt->use_v = false;
    return KVQ_OK;
}

/* The batched pass of scheme s (as kveval runs it) against the decode loop with the reference quantizer q:
 * the same cache bits, logits and NLLs (batch-invariant GEMMs), the scheme changes the loss against fp32,
 * and a past-only scheme differs from quantizing every token for every query. Returns the counts of the
 * batched run. */
static kvq_quant_counts fenv_decode_case(const kvq_model *m, const kvq_eval_scheme *s, fenv_quant_fn q, void *qctx, bool past_only)
{
    kvq_err e = {0};
    enum { N = 48 };
    const int V = m->hp.vocab_size, kvd = kvq_kv_dim(&m->hp), L = m->hp.n_layers;
    int tok[N];
    fenv_tokens(tok, N, V, 4242);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
    float *lb = malloc((size_t)N * V * sizeof(float)), *ld = malloc((size_t)N * V * sizeof(float));
    double nll_b[N], nll_d[N];
    size_t cn = (size_t)L * N * kvd;

    fenv_cap bc = {.alt = past_only, .kvd = kvd, .N = N, .k = calloc(cn, sizeof(float)), .v = calloc(cn, sizeof(float))};
    kvq_hooks hk;
    kvq_scheme_hooks(&bc.run, s, &hk);
    kvq_hooks hbc = hk;
    hbc.user = &bc;
    hbc.transform = fenv_cap_transform;
    hbc.observe = fenv_cap_observe;
    kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hbc, .logits = lb, .nll = nll_b};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    double loss_b = r.loss;
    kvq_scheme_run_free(&bc.run);
    kvq_quant_counts counts = bc.run.k_counts;

    fenv_dec d = {.q = q, .qctx = qctx, .past_only = past_only, .kvd = kvd, .N = N, .ck = calloc(cn, sizeof(float)),
                  .cv = calloc(cn, sizeof(float))};
    if (past_only) ck_assert_msg(s->s.key_stage == KVQ_KEYS_POST_ROPE, "the past-only oracle stores post-RoPE keys");
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    kvq_hooks hd = {.user = &d, .transform = fenv_dec_transform, .observe = fenv_dec_observe, .key_stage = s->s.key_stage};
    double loss_d = 0;
    for (int t = 0; t < N; t++) {
        for (int l = 0; l < L; l++) {
            memcpy(pk + (size_t)l * t * kvd, d.ck + (size_t)l * N * kvd, (size_t)t * kvd * sizeof(float));
            memcpy(pv + (size_t)l * t * kvd, d.cv + (size_t)l * N * kvd, (size_t)t * kvd * sizeof(float));
        }
        kvq_prefix px = {.P = t, .k = pk, .v = pv};
        d.step = t;
        int tg = t + 1 < N ? tok[t + 1] : -1;
        kvq_fwd_io io1 = {.tokens = tok + t, .T = 1, .pos0 = t, .targets = &tg, .prefix = &px, .hooks = &hd,
                          .logits = ld + (size_t)t * V, .nll = nll_d + t};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &r, &e) == KVQ_OK, "%s", e.msg);
        if (t + 1 < N) loss_d += nll_d[t];
    }
    loss_d /= N - 1;
    size_t cache_diff = fenv_bits_differ(bc.k, d.ck, cn) + fenv_bits_differ(bc.v, d.cv, cn);
    size_t logit_diff = fenv_bits_differ(lb, ld, (size_t)N * V);
    int first_div = -1;
    for (int t = 0; t + 1 < N && first_div < 0; t++)
        if (memcmp(&nll_b[t], &nll_d[t], sizeof(double))) first_div = t;

    kvq_fwd_io io0 = {.tokens = tok, .T = N};
    ck_assert(kvq_forward_run(&fw, &io0, &r, &e) == KVQ_OK);
    double d_fp32 = fabs(r.loss - loss_d) / loss_d, d_naive = -1;
    if (past_only) {
        kvq_scheme_run rn;
        kvq_hooks hn;
        kvq_scheme_hooks(&rn, s, &hn);
        hn.user = &rn;
        hn.transform = fenv_all_quantized;
        kvq_fwd_io ion = {.tokens = tok, .T = N, .hooks = &hn};
        ck_assert(kvq_forward_run(&fw, &ion, &r, &e) == KVQ_OK);
        kvq_scheme_run_free(&rn);
        d_naive = fabs(r.loss - loss_d) / loss_d;
    }
    char naive[64] = "";
    if (past_only) snprintf(naive, sizeof naive, ", vs every token quantized %.2e", d_naive);
    fprintf(stderr, "INFO decode %-22s %s: batched %.9f decode %.9f, %zu logits and %zu/%zu cache elements differ, first NLL "
                    "difference at %d; vs fp32 %.2e%s\n",
            s->name, m->path, loss_b, loss_d, logit_diff, cache_diff, 2 * cn, first_div, d_fp32, naive);
    ck_assert_msg(cache_diff == 0, "%s: %zu cache elements differ between the decode loop and the batched pass", s->name, cache_diff);
    ck_assert_msg(logit_diff == 0 && first_div < 0 && fabs(loss_b - loss_d) <= 1e-12 * loss_d,
                  "%s: batched %.12g vs decode %.12g, %zu logits differ, first NLL difference at %d", s->name, loss_b, loss_d,
                  logit_diff, first_div);
    ck_assert_msg(d_fp32 > 1e-4, "%s barely changes the loss (%.2e): the test would not notice a missing transform", s->name, d_fp32);
    if (past_only) ck_assert_msg(d_naive > 1e-5, "%s: quantizing the current token too gives the same loss (%.2e)", s->name, d_naive);
    free(pk);
    free(pv);
    free(d.ck);
    free(d.cv);
    free(bc.k);
    free(bc.v);
    free(lb);
    free(ld);
    kvq_forward_free(&fw);
    return counts;
}

/* Rewrite the safetensors file src as dst with tensor `drop` left out, or (reshape) stored with its last
 * dimension one element shorter; everything else (metadata, other tensors) byte for byte. */
static void fenv_rewrite(const char *src, const char *dst, const char *name, bool reshape)
{
    kvq_safetensors st;
    kvq_err e = {0};
    ck_assert_msg(kvq_safetensors_open(src, &st, &e) == KVQ_OK, "%s", e.msg);
    kvq_st_entry *te = calloc(st.n_tensors, sizeof *te);
    kvq_st_kv *kv = calloc(st.n_meta ? st.n_meta : 1, sizeof *kv);
    size_t n = 0, hit = 0;
    for (size_t i = 0; i < st.n_tensors; i++) {
        const kvq_st_tensor *t = &st.tensors[i];
        bool is = !strcmp(t->name, name);
        hit += is;
        if (is && !reshape) continue;
        te[n] = (kvq_st_entry){.name = t->name, .dtype = t->dtype, .n_dims = t->n_dims, .data = t->data};
        for (uint32_t d = 0; d < t->n_dims; d++) te[n].shape[d] = t->shape[d];
        if (is) te[n].shape[t->n_dims - 1]--;
        n++;
    }
    ck_assert_msg(hit == 1, "%s has no tensor %s", src, name);
    for (size_t i = 0; i < st.n_meta; i++) kv[i] = (kvq_st_kv){st.meta[i].key, st.meta[i].value};
    ck_assert_msg(kvq_safetensors_write(dst, te, n, kv, st.n_meta, &e) == KVQ_OK, "%s", e.msg);
    free(te);
    free(kv);
    kvq_safetensors_close(&st);
}

/* Run a command, capture stdout+stderr into out; returns the exit status. */
static int fenv_run(const char *cmd, char *out, size_t n)
{
    char full[8192];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    ck_assert(p);
    size_t len = fread(out, 1, n - 1, p);
    out[len] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif
