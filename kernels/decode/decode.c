/* decode.c — greedy decoding on the packed KV cache; see decode.h. */
#include "decode.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

kvq_status kvq_decoder_spec_check(const kvq_scheme_spec *sp, const char *name, const kvq_hparams *hp, kvq_err *err)
{
    const kvq_family *f = sp->q.fam;
    if (!f || !f->kvcache_config) {
        char who[160] = "";
        size_t n, len = 0;
        const kvq_family *const *all = kvq_families(&n);
        for (size_t i = 0; i < n; i++)
            if (all[i]->kvcache_config && len < sizeof who)
                len += (size_t)snprintf(who + len, sizeof who - len, "%s%s", len ? " and " : "", all[i]->name);
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: the packed KV cache (kernels/kvcache) has formats for %s only", name,
                        who);
    }
    if (sp->intactkv)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: +intactkv is not in the decode engine (its prefix is not fed to the "
                        "packed cache)", name);
    if (sp->rot.kind != KVQ_ROT_NONE)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: the packed KV cache has no rotation (+hadamard / +rht)", name);
    for (int kv = 0; kv < 2; kv++) { /* the codes' widths the cache and its kernels pack (formats/KVCACHE.md) */
        int b = kv ? sp->q.v_bits : sp->q.k_bits;
        if (b < 2 || b > 4)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: %d-bit %s; the packed KV cache stores 2-, 3- or 4-bit codes", name,
                            b, kv ? "values" : "keys");
    }
    for (int l = 0; l < hp->n_layers; l++)
        if (kvq_layer_window(hp, l) > 0)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: a sliding window of %d keys; the packed KV cache attends every "
                            "position", l, kvq_layer_window(hp, l));
    if (sp->key_stage != KVQ_KEYS_POST_ROPE && hp->rope_dim > 0 && hp->rope_scaling != KVQ_ROPE_SCALING_NONE &&
        hp->rope_scaling != KVQ_ROPE_SCALING_LINEAR)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "RoPE scaling %s: the packed KV cache rotates pre-RoPE keys with none or linear "
                        "scaling only", kvq_rope_scaling_name(hp->rope_scaling));
    return KVQ_OK;
}

kvq_status kvq_decoder_cache_config(const kvq_eval_scheme *s, const kvq_hparams *hp, size_t layer, kvq_kvcache_config *cfg,
                                    kvq_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    const kvq_scheme *q = &s->s.q;
    const kvq_family *f = q->fam;
    KVQ_TRY(kvq_decoder_spec_check(&s->s, s->name, hp, err));
    if (s->prefix)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: +intactkv is not in the decode engine (its prefix is not fed to the "
                        "packed cache)", s->name);
    const bool post = s->s.key_stage == KVQ_KEYS_POST_ROPE;
    if (s->art && s->art->p.method == f) {
        KVQ_TRY(kvq_kvcache_config_from_artifact(cfg, s->art, layer, err));
    } else if (!strcmp(f->name, "kivi")) { /* online: the spec's G, R and bits */
        cfg->format = KVQ_KVCACHE_KIVI;
        cfg->n_kv_heads = (size_t)hp->n_kv_heads;
        cfg->head_dim = (size_t)hp->head_dim;
        cfg->k_bits = q->k_bits;
        cfg->v_bits = q->v_bits;
        cfg->group = q->group;
        cfg->residual = q->residual;
        cfg->post_rope = true;
    } else {
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the packed KV cache needs a kvcalib artifact of method %s (--artifact)",
                        s->name, f->name);
    }
    if (cfg->post_rope != post)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: %s keys; the packed %s format quantizes %s keys", s->name,
                        post ? "post-RoPE" : "pre-RoPE", f->name, cfg->post_rope ? "post-RoPE" : "pre-RoPE");
    if (cfg->format == KVQ_KVCACHE_NUQ && cfg->post_rope)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "scheme %s: a post-RoPE nuq artifact; the decode engine takes nuq with pre-RoPE "
                        "keys only (KVQuant's layout; with post-RoPE keys the decode and its simulation were seen to part by "
                        "logits of 4, not understood yet)", s->name);
    if (cfg->k_bits != q->k_bits || cfg->v_bits != q->v_bits ||
        (cfg->format == KVQ_KVCACHE_NUQ && cfg->outlier_frac != q->outlier_frac) ||
        (cfg->format == KVQ_KVCACHE_KIVI && (cfg->group != q->group || cfg->residual != q->residual)))
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the artifact's parameters (bits %d/%d, outliers %g, G %zu, R %zu) differ "
                        "from the spec's", s->name, cfg->k_bits, cfg->v_bits, cfg->outlier_frac, cfg->group, cfg->residual);
    if (cfg->n_kv_heads != (size_t)hp->n_kv_heads || cfg->head_dim != (size_t)hp->head_dim)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the artifact's %zu KV heads x %zu, the model's %d x %d", s->name,
                        cfg->n_kv_heads, cfg->head_dim, hp->n_kv_heads, hp->head_dim);
    cfg->n_sink = q->n_sink;
    if (cfg->post_rope) return KVQ_OK; /* appended as the model rotated them (dec_attend): no RoPE in the cache */
    cfg->rope.rope_dim = (size_t)hp->rope_dim;
    cfg->rope.rope_theta = hp->rope_theta;
    cfg->rope.scale = hp->rope_scaling == KVQ_ROPE_SCALING_LINEAR ? hp->rope_scale_factor : 1;
    return KVQ_OK;
}

void kvq_decoder_free(kvq_decoder *d)
{
    if (d->cache && d->m)
        for (int l = 0; l < d->m->hp.n_layers; l++) kvq_kvcache_free(d->cache[l]);
    if (d->gcache && d->m)
        for (int l = 0; l < d->m->hp.n_layers; l++) kvq_kvcache_cuda_free(d->gcache[l]);
    free(d->cache);
    free(d->gcache);
    if (d->gpu) kvq_forward_cuda_free(d->gpu);
    else kvq_forward_free(&d->fw);
    free(d->pos);
    free(d->targets);
    free(d->logits);
    free(d->kbuf);
    free(d->vbuf);
    kvq_cuda_free(d->kbuf_dev);
    kvq_cuda_free(d->vbuf_dev);
    free(d->dk);
    free(d->dv);
    kvq_attn_ws_free(&d->aws);
    memset(d, 0, sizeof *d);
}

kvq_status kvq_decoder_init(kvq_decoder *d, const kvq_model *m, const kvq_eval_scheme *s, size_t n_seqs, size_t max_tokens,
                            unsigned fwd_flags, kvq_err *err)
{
    return kvq_decoder_init_on(d, KVQ_DEVICE_CPU, 0, m, s, n_seqs, max_tokens, fwd_flags, err);
}

kvq_status kvq_decoder_init_on(kvq_decoder *d, kvq_device dev, int gpu, const kvq_model *m, const kvq_eval_scheme *s,
                               size_t n_seqs, size_t max_tokens, unsigned fwd_flags, kvq_err *err)
{
    memset(d, 0, sizeof *d);
    const bool cuda = dev == KVQ_DEVICE_CUDA;
    if (cuda && (fwd_flags & KVQ_DECODE_DEQUANT_ATTN))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "decoder: the dequantized-cache attention (a diagnostic) runs on the CPU only");
    const kvq_hparams *hp = &m->hp;
    if (n_seqs == 0 || n_seqs > (1u << 16))
        return kvq_fail(err, KVQ_EINVAL, "decoder: %zu sequences, expected 1..65536", n_seqs);
    if (max_tokens == 0 || max_tokens > (size_t)hp->ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "decoder: %zu positions per sequence, expected 1..%d (the model's context length)",
                        max_tokens, hp->ctx_len);
    kvq_kvcache_config cfg;
    KVQ_TRY(kvq_decoder_cache_config(s, hp, 0, &cfg, err)); /* refusals before any allocation */
    d->m = m;
    d->dev = cuda ? KVQ_DEVICE_CUDA : KVQ_DEVICE_CPU;
    d->n_seqs = n_seqs;
    d->max_tokens = max_tokens;
    if (cuda) d->gcache = calloc((size_t)hp->n_layers, sizeof *d->gcache);
    else d->cache = calloc((size_t)hp->n_layers, sizeof *d->cache);
    d->pos = malloc(n_seqs * sizeof *d->pos);
    d->targets = malloc(n_seqs * sizeof *d->targets);
    d->logits = malloc(n_seqs * (size_t)hp->vocab_size * sizeof *d->logits);
    d->kv_fp16 = (fwd_flags & KVQ_DECODE_KV_FP16) != 0;
    if (d->kv_fp16 && !cuda) {
        d->kbuf = malloc(n_seqs * (size_t)kvq_kv_dim(hp) * sizeof *d->kbuf);
        d->vbuf = malloc(n_seqs * (size_t)kvq_kv_dim(hp) * sizeof *d->vbuf);
    }
    d->dequant_attn = (fwd_flags & KVQ_DECODE_DEQUANT_ATTN) != 0;
    if (d->dequant_attn) {
        d->dk = malloc(max_tokens * (size_t)kvq_kv_dim(hp) * sizeof *d->dk);
        d->dv = malloc(max_tokens * (size_t)kvq_kv_dim(hp) * sizeof *d->dv);
    }
    if ((!d->cache && !d->gcache) || !d->pos || !d->targets || !d->logits || (d->kv_fp16 && !cuda && (!d->kbuf || !d->vbuf)) ||
        (d->dequant_attn && (!d->dk || !d->dv))) {
        kvq_decoder_free(d);
        return kvq_fail(err, KVQ_ENOMEM, "decoder: out of memory for %zu sequences", n_seqs);
    }
    for (size_t b = 0; b < n_seqs; b++) d->targets[b] = -1;
    kvq_status st = cuda ? kvq_forward_cuda_init(&d->gpu, m, (int)n_seqs, 0, 0, KVQ_CUDA_EXACT, gpu, err)
                         : kvq_forward_init(&d->fw, m, (int)n_seqs, 0, fwd_flags & KVQ_FWD_ROW_INVARIANT, err);
    if (!st && cuda && d->kv_fp16) {
        const size_t bytes = n_seqs * (size_t)kvq_kv_dim(hp) * sizeof(float);
        st = kvq_cuda_alloc((void **)&d->kbuf_dev, bytes, err);
        if (!st) st = kvq_cuda_alloc((void **)&d->vbuf_dev, bytes, err);
    }
    if (!st && d->dequant_attn)
        st = kvq_attn_ws_init(&d->aws, 1, (int)max_tokens, hp->n_kv_heads, hp->head_dim, omp_get_max_threads(), err);
    for (int l = 0; !st && l < hp->n_layers; l++) {
        st = kvq_decoder_cache_config(s, hp, (size_t)l, &cfg, err);
        if (st) break;
        cfg.n_seqs = n_seqs;
        cfg.max_tokens = max_tokens;
        st = cuda ? kvq_kvcache_cuda_create(&d->gcache[l], &cfg, err) : kvq_kvcache_create(&d->cache[l], &cfg, err);
        if (st) kvq_err_prefix(err, "layer %d", l);
    }
    d->post_rope = cfg.post_rope;
    if (st) kvq_decoder_free(d);
    return st;
}

size_t kvq_decoder_len(const kvq_decoder *d) { return d->len; }

/* kvq_hooks.attend: the step's rows are the sequences; append their K/V to the layer's cache, attend from it */
static kvq_status dec_attend(void *user, const kvq_layer_ctx *c, const float *q, const float *k_pre, const float *k_post,
                             const float *v, float *out, kvq_err *err)
{
    kvq_decoder *d = user;
    const size_t kvd = (size_t)c->n_kv_heads * c->head_dim;
    if ((size_t)c->T != d->n_seqs)
        return kvq_fail(err, KVQ_EINVAL, "decoder: %d rows for %zu sequences", c->T, d->n_seqs);
    kvq_kvcache *kc = d->cache[c->layer];
    /* pre-RoPE keys for a format that quantizes them (NUQ: the cache rotates after dequantization); post-RoPE keys
     * as the model's RoPE rotated them for one that quantizes those (KIVI; its cache then has no RoPE of its own) */
    const bool post = d->post_rope;
    const float *k = post ? k_post : k_pre;
    if (d->kv_fp16) { /* KVQ_DECODE_KV_FP16: values, and pre-RoPE keys (post-RoPE ones the cache rounds itself) */
        const size_t n = d->n_seqs * kvd;
        if (!post) {
            kvq_quant_fp16(d->kbuf, k, n, NULL);
            k = d->kbuf;
        }
        kvq_quant_fp16(d->vbuf, v, n, NULL);
        v = d->vbuf;
    }
    for (size_t b = 0; b < d->n_seqs; b++)
        if (kvq_kvcache_append(kc, b, k + b * kvd, v + b * kvd, 1, err)) return kvq_err_prefix(err, "sequence %zu", b);
    if (!d->dequant_attn) return kvq_kvcache_attend(kc, q, (size_t)c->n_heads, 0, out, err);
    /* KVQ_DECODE_DEQUANT_ATTN: the forward's attention over the cache's contents, the new token as the window */
    const size_t qd = (size_t)c->n_heads * c->head_dim, len = kvq_kvcache_len(kc, 0);
    for (size_t b = 0; b < d->n_seqs; b++) {
        KVQ_TRY(kvq_kvcache_dequant(kc, b, d->dk, d->dv, err));
        kvq_attn_args a = {.T = 1, .P = (int)len - 1, .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                           .q = q + b * qd, .k = d->dk + (len - 1) * kvd, .v = d->dv + (len - 1) * kvd, .out = out + b * qd,
                           .pos0 = (int)len - 1};
        if (len > 1) {
            a.pk = d->dk;
            a.pv = d->dv;
        }
        KVQ_TRY(kvq_attention(&a, &d->aws, err));
    }
    return KVQ_OK;
}

/* the same on the GPU: device pointers, the forward's stream idle (forward.h kvq_hooks.attend) */
static kvq_status dec_attend_cuda(void *user, const kvq_layer_ctx *c, const float *q, const float *k_pre, const float *k_post,
                                  const float *v, float *out, kvq_err *err)
{
    kvq_decoder *d = user;
    const size_t kvd = (size_t)c->n_kv_heads * c->head_dim;
    if ((size_t)c->T != d->n_seqs)
        return kvq_fail(err, KVQ_EINVAL, "decoder: %d rows for %zu sequences", c->T, d->n_seqs);
    kvq_kvcache_cuda *kc = d->gcache[c->layer];
    const float *k = d->post_rope ? k_post : k_pre;
    if (d->kv_fp16) { /* as dec_attend: values, and pre-RoPE keys, rounded on the device */
        const size_t n = d->n_seqs * kvd;
        if (!d->post_rope) {
            KVQ_TRY(kvq_cuda_round_fp16(d->kbuf_dev, k, n, err));
            k = d->kbuf_dev;
        }
        KVQ_TRY(kvq_cuda_round_fp16(d->vbuf_dev, v, n, err));
        v = d->vbuf_dev;
    }
    /* every sequence's token in one batched append (no host synchronisation in the steady state), then the attention,
     * which synchronises: the hook's device work is complete when it returns (forward.h) */
    KVQ_TRY(kvq_kvcache_cuda_append_step(kc, k, v, err));
    return kvq_kvcache_cuda_attend(kc, q, (size_t)c->n_heads, 0, out, 0, 1, err);
}

kvq_status kvq_decoder_step(kvq_decoder *d, const int *tokens, kvq_err *err)
{
    const size_t len = kvq_decoder_len(d);
    if (len >= d->max_tokens)
        return kvq_fail(err, KVQ_EINVAL, "decoder: the sequences hold %zu positions, the capacity (max_tokens)", len);
    for (size_t b = 0; b < d->n_seqs; b++) d->pos[b] = (int)len;
    kvq_hooks hk = {.user = d, .attend = d->gpu ? dec_attend_cuda : dec_attend};
    kvq_fwd_io io = {.tokens = tokens, .T = (int)d->n_seqs, .pos0 = (int)len, .pos = d->pos, .targets = d->targets,
                     .hooks = &hk, .logits = d->logits};
    kvq_fwd_result r;
    const double t0 = kvq_now();
    KVQ_TRY(d->gpu ? kvq_forward_cuda_run(d->gpu, &io, &r, err) : kvq_forward_run(&d->fw, &io, &r, err));
    d->seconds += kvq_now() - t0;
    d->steps++;
    d->len++;
    return KVQ_OK;
}

int kvq_decoder_argmax(const float *x, size_t n)
{
    int best = -1;
    for (size_t i = 0; i < n; i++)
        if (!isnan(x[i]) && (best < 0 || x[i] > x[best])) best = (int)i;
    return best;
}

kvq_status kvq_decoder_generate(kvq_decoder *d, const int *prompts, size_t P, size_t steps, int *out, float *logits,
                                double *prefill_s, double *decode_s, kvq_progress *prog, kvq_err *err)
{
    const size_t B = d->n_seqs, V = (size_t)d->m->hp.vocab_size;
    if (P == 0 || steps == 0)
        return kvq_fail(err, KVQ_EINVAL, "decoder: prompt of %zu tokens and %zu steps, expected >= 1 each", P, steps);
    if (P + steps - 1 > d->max_tokens)
        return kvq_fail(err, KVQ_EINVAL, "decoder: a prompt of %zu tokens and %zu steps need %zu positions, the caches hold %zu",
                        P, steps, P + steps - 1, d->max_tokens);
    if (kvq_decoder_len(d) != 0) return kvq_fail(err, KVQ_EINVAL, "decoder: generate needs empty caches");
    int *tok = malloc(B * sizeof *tok);
    if (!tok) return kvq_fail(err, KVQ_ENOMEM, "decoder: out of memory");
    kvq_status st = KVQ_OK;
    const uint64_t base = prog ? prog->done : 0; /* steps counted on from where the progress stands */
    double t0 = kvq_now(), t1 = t0;
    for (size_t t = 0; t < P + steps - 1 && !st; t++) {
        for (size_t b = 0; b < B; b++) tok[b] = t < P ? prompts[b * P + t] : out[b * steps + (t - P)];
        st = kvq_decoder_step(d, tok, err);
        if (st) {
            kvq_err_prefix(err, "%s step %zu", t < P ? "prefill" : "decode", t < P ? t : t - P + 1);
            break;
        }
        if (t + 1 >= P) { /* the logits of generated token s = t + 1 - P */
            const size_t s = t + 1 - P;
            for (size_t b = 0; b < B; b++) {
                const float *z = d->logits + b * V;
                out[b * steps + s] = kvq_decoder_argmax(z, V);
                if (logits) memcpy(logits + (b * steps + s) * V, z, V * sizeof(float));
            }
        }
        if (t + 1 == P) t1 = kvq_now();
        if (prog) kvq_progress_update(prog, base + t + 1);
    }
    if (prefill_s) *prefill_s = t1 - t0;
    if (decode_s) *decode_s = kvq_now() - t1;
    free(tok);
    return st;
}

void kvq_decoder_bytes(const kvq_decoder *d, size_t *packed, size_t *fp16)
{
    const kvq_hparams *hp = &d->m->hp;
    size_t p = 0, n = 0;
    for (int l = 0; l < hp->n_layers; l++) {
        if (d->gcache) {
            p += kvq_kvcache_cuda_bytes_read(d->gcache[l]);
            n += d->len * d->n_seqs;
            continue;
        }
        kvq_kvcache_stats s;
        kvq_kvcache_stats_get(d->cache[l], &s);
        p += s.bytes_k + s.bytes_v;
        n += s.n_tokens;
    }
    if (packed) *packed = p;
    if (fp16) *fp16 = n * (size_t)kvq_kv_dim(hp) * 2 * 2;
}
