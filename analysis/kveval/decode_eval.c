/* decode_eval.c — kveval --task decode; see decode_eval.h. */
#include "decode_eval.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "outfile.h"
#include "perplexity.h"
#include "quant.h"
#include "version.h"

void kvq_decode_logit_diff(const float *a, const float *b, size_t n, double *max_abs, double *kl)
{
    double mx = 0, ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0;
    for (size_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs((double)a[i] - b[i]));
        ma = fmax(ma, a[i]);
        mb = fmax(mb, b[i]);
    }
    for (size_t i = 0; i < n; i++) {
        sa += exp((double)a[i] - ma);
        sb += exp((double)b[i] - mb);
    }
    const double la = ma + log(sa), lb = mb + log(sb);
    double k = 0;
    for (size_t i = 0; i < n; i++) {
        const double pa = (double)a[i] - la, pb = (double)b[i] - lb;
        k += exp(pa) * (pa - pb);
    }
    if (max_abs) *max_abs = mx;
    if (kl) *kl = k > 0 ? k : 0; /* rounding can leave -1e-17 */
}

/* KVQ_DECODE_KV_FP16: the window's keys (in the scheme's stage) and values rounded to fp16, then the scheme */
static kvq_status sim_fp16_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    const size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    kvq_quant_fp16(k, k, n, NULL);
    kvq_quant_fp16(v, v, n, NULL);
    return kvq_scheme_transform(user, c, k, v, alt, e);
}

kvq_status kvq_decode_sim_logits(const kvq_model *m, const kvq_eval_scheme *s, const int *prompt, size_t P, const int *gen,
                                 size_t S, unsigned fwd_flags, float *out, kvq_err *err)
{
    const size_t W = P + S - 1, V = (size_t)m->hp.vocab_size;
    int *tok = malloc(W * sizeof *tok), *tg = malloc(W * sizeof *tg);
    float *lg = malloc(W * V * sizeof *lg);
    kvq_forward fw = {0};
    kvq_status st = KVQ_OK;
    if (!tok || !tg || !lg) {
        st = kvq_fail(err, KVQ_ENOMEM, "simulation: out of memory for a window of %zu tokens", W);
        goto done;
    }
    memcpy(tok, prompt, P * sizeof *tok);
    if (S > 1) memcpy(tok + P, gen, (S - 1) * sizeof *tok);
    for (size_t t = 0; t < W; t++) tg[t] = -1; /* no loss: the logits are the output */
    st = kvq_forward_init(&fw, m, (int)W, 0, fwd_flags & KVQ_FWD_ROW_INVARIANT, err);
    if (st) goto done;
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, s, &hk);
    if ((fwd_flags & KVQ_DECODE_KV_FP16) && hk.transform) hk.transform = sim_fp16_transform;
    kvq_fwd_io io = {.tokens = tok, .T = (int)W, .targets = tg, .hooks = kvq_eval_scheme_is_identity(s) ? NULL : &hk,
                     .logits = lg};
    kvq_fwd_result r;
    st = kvq_forward_run(&fw, &io, &r, err);
    kvq_scheme_run_free(&run);
    if (st) {
        kvq_err_prefix(err, "simulation of %s", s->name);
        goto done;
    }
    memcpy(out, lg + (P - 1) * V, S * V * sizeof *out);
done:
    kvq_forward_free(&fw);
    free(tok);
    free(tg);
    free(lg);
    return st;
}

void kvq_decode_result_free(kvq_decode_result *r)
{
    if (r->p)
        for (size_t i = 0; i < r->n_prompts; i++) {
            free(r->p[i].tokens);
            free(r->p[i].sim);
        }
    free(r->p);
    memset(r, 0, sizeof *r);
}

kvq_status kvq_decode_eval(const kvq_model *m, const kvq_eval_scheme *s, const int *prompts, size_t n_prompts, size_t P,
                           const kvq_decode_opts *o, kvq_progress *prog, kvq_decode_result *r, kvq_err *err)
{
    memset(r, 0, sizeof *r);
    const size_t S = o->steps, V = (size_t)m->hp.vocab_size;
    const size_t B = o->batch < 1 ? 1 : o->batch < n_prompts ? o->batch : n_prompts;
    if (n_prompts == 0 || P == 0 || S == 0)
        return kvq_fail(err, KVQ_EINVAL, "decode: %zu prompts of %zu tokens, %zu steps; expected >= 1 each", n_prompts, P, S);
    if (P + S - 1 > (size_t)m->hp.ctx_len)
        return kvq_fail(err, KVQ_EINVAL, "decode: a prompt of %zu tokens and %zu steps need %zu positions, beyond the model's "
                        "context length of %d", P, S, P + S - 1, m->hp.ctx_len);
    r->n_prompts = n_prompts;
    r->prompt_len = P;
    r->steps = S;
    r->batch = B;
    r->dev = o->dev;
    r->noise_floor = o->noise_floor && !o->no_sim;
    r->kv_fp16 = (o->fwd_flags & KVQ_DECODE_KV_FP16) != 0;
    r->dequant_attn = (o->fwd_flags & KVQ_DECODE_DEQUANT_ATTN) != 0;
    r->p = calloc(n_prompts, sizeof *r->p);
    /* the decoder's logits are kept for the comparison only: B x S x vocab floats */
    float *dl = o->no_sim ? NULL : malloc(B * S * V * sizeof *dl), *sl = o->no_sim ? NULL : malloc(S * V * sizeof *sl);
    float *fl = o->no_sim || !o->noise_floor ? NULL : malloc(S * V * sizeof *fl);
    int *gen = malloc(B * S * sizeof *gen);
    kvq_status st = KVQ_OK;
    if (!r->p || !gen || (!o->no_sim && (!dl || !sl)) || (!o->no_sim && o->noise_floor && !fl)) {
        st = kvq_fail(err, KVQ_ENOMEM, "decode: out of memory for %zu x %zu logits of %zu", B, S, V);
        goto done;
    }
    for (size_t b0 = 0; b0 < n_prompts && !st; b0 += B) {
        const size_t nb = n_prompts - b0 < B ? n_prompts - b0 : B;
        kvq_decoder d;
        st = kvq_decoder_init_on(&d, o->dev, o->gpu, m, s, nb, P + S - 1, o->fwd_flags, err);
        if (st) break;
        double pf = 0, dc = 0;
        st = kvq_decoder_generate(&d, prompts + b0 * P, P, S, gen, dl, &pf, &dc, prog, err);
        if (!st && b0 == 0) {
            kvq_decoder_bytes(&d, &r->bytes_packed, &r->bytes_fp16);
            r->batch0_seqs = nb;
        }
        kvq_decoder_free(&d);
        if (st) {
            kvq_err_prefix(err, "prompts %zu..%zu", b0, b0 + nb - 1);
            break;
        }
        r->prefill_s += pf;
        r->decode_s += dc;
        r->n_batches++;
        for (size_t i = 0; i < nb && !st; i++) {
            kvq_decode_prompt *pr = &r->p[b0 + i];
            pr->batch_index = r->n_batches - 1;
            pr->first_diff = -1;
            pr->diff_abs = pr->diff_kl = pr->margin = NAN;
            pr->tokens = malloc(S * sizeof *pr->tokens);
            if (!pr->tokens) {
                st = kvq_fail(err, KVQ_ENOMEM, "decode: out of memory");
                break;
            }
            memcpy(pr->tokens, gen + i * S, S * sizeof *pr->tokens);
            if (o->no_sim) continue;
            pr->sim = malloc(S * sizeof *pr->sim);
            if (!pr->sim) {
                st = kvq_fail(err, KVQ_ENOMEM, "decode: out of memory");
                break;
            }
            const double t0 = kvq_now();
            st = kvq_decode_sim_logits(m, s, prompts + (b0 + i) * P, P, pr->tokens, S, o->fwd_flags, sl, err);
            r->sim_s += kvq_now() - t0;
            if (!st && fl) /* the noise floor: the same simulation with the other GEMM order */
                st = kvq_decode_sim_logits(m, s, prompts + (b0 + i) * P, P, pr->tokens, S, o->fwd_flags ^ KVQ_FWD_ROW_INVARIANT, fl,
                                           err);
            if (st) {
                kvq_err_prefix(err, "prompt %zu", b0 + i);
                break;
            }
            pr->floor_first = -1;
            for (size_t t = 0; fl && t < S; t++) {
                double ab, kl;
                kvq_decode_logit_diff(sl + t * V, fl + t * V, V, &ab, &kl);
                pr->floor_abs = fmax(pr->floor_abs, ab);
                pr->floor_kl = fmax(pr->floor_kl, kl);
                if (kvq_decoder_argmax(sl + t * V, V) != kvq_decoder_argmax(fl + t * V, V)) {
                    if (pr->floor_first < 0) pr->floor_first = (int)t;
                    pr->floor_flips++;
                }
            }
            for (size_t t = 0; t < S; t++) {
                const float *zs = sl + t * V, *zd = dl + (i * S + t) * V;
                double ab, kl;
                kvq_decode_logit_diff(zs, zd, V, &ab, &kl);
                pr->worst_abs = fmax(pr->worst_abs, ab);
                pr->worst_kl = fmax(pr->worst_kl, kl);
                pr->sim[t] = kvq_decoder_argmax(zs, V);
                if (pr->first_diff < 0 && pr->sim[t] != pr->tokens[t]) {
                    pr->first_diff = (int)t;
                    pr->diff_abs = ab;
                    pr->diff_kl = kl;
                    pr->margin = (double)zs[pr->sim[t]] - zs[pr->tokens[t]];
                    pr->rank = 1;
                    for (size_t v = 0; v < V; v++) pr->rank += zs[v] > zs[pr->tokens[t]];
                    pr->within_floor = fl && pr->margin <= pr->floor_abs;
                }
            }
        }
    }
done:
    free(dl);
    free(sl);
    free(fl);
    free(gen);
    if (st) kvq_decode_result_free(r);
    return st;
}

/* length of the valid UTF-8 sequence at s[0..n) (RFC 3629: no overlongs, surrogates or code points past U+10FFFF),
 * 0 if none */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    const unsigned char c = s[0];
    size_t k;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) k = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        k = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        k = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 0;
    if (n < k || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return k;
}

char *kvq_text_utf8(const char *t, size_t tl, size_t max_bytes, bool for_table)
{
    char *out = malloc((tl < max_bytes ? tl : max_bytes) * 3 + 8);
    if (!out) return NULL;
    const unsigned char *u = (const unsigned char *)t;
    size_t i = 0, j = 0;
    while (i < tl) {
        size_t k = utf8_len(u + i, tl - i);
        const size_t w = k ? k : 3;
        if (j + w > max_bytes) {
            memcpy(out + j, "\xE2\x80\xA6", 3); /* … */
            j += 3;
            break;
        }
        if (!k) { /* U+FFFD */
            memcpy(out + j, "\xEF\xBF\xBD", 3);
            j += 3;
            i++;
        } else if (k == 1) {
            const char c = t[i++];
            out[j++] = (unsigned char)c < 32 || c == 127 ? ' ' : for_table && c == '|' ? '/' : c;
        } else {
            memcpy(out + j, t + i, k);
            j += k;
            i += k;
        }
    }
    out[j] = 0;
    return out;
}

/* the first n tokens of a generation as text (kvq_text_utf8; NULL without a tokenizer or on failure) */
static char *gen_text(const kvq_tokenizer *tok, const int *ids, size_t n, size_t max_bytes, bool for_table)
{
    if (!tok) return NULL;
    char *t = NULL;
    size_t tl = 0;
    kvq_err e = {0};
    if (kvq_tokenizer_decode(tok, ids, n, 0, &t, &tl, &e)) return NULL;
    char *out = kvq_text_utf8(t, tl, max_bytes, for_table);
    free(t);
    return out;
}

static double tok_per_s(double tokens, double s) { return s > 0 ? tokens / s : NAN; }

kvq_status kvq_decode_report_table(FILE *f, const kvq_model *m, const kvq_tokenizer *tok, const kvq_eval_scheme *s,
                                   const kvq_decode_result *r, kvq_err *err)
{
    (void)err;
    const bool sim = r->n_prompts && r->p[0].sim;
    fprintf(f, "# kveval decode: %s on the packed KV cache, greedy\n\n", s->name);
    fprintf(f, "model: %s\n", m->path);
    fprintf(f, "device: %s (the packed cache through the forward's attend hook); simulation on the CPU\n",
            r->dev == KVQ_DEVICE_CUDA ? "CUDA (kvq_kvcache_cuda)" : "CPU (kvq_kvcache)");
    fprintf(f, "prompts: %zu x %zu tokens, %zu steps, batch %zu\n", r->n_prompts, r->prompt_len, r->steps, r->batch);
    if (sim)
        fprintf(f, "reference: the decode-equivalent simulation of %s (kveval's transform), teacher-forced on the decoded "
                   "tokens\n", s->name);
    fprintf(f, "\n| prompt | tokens equal | first diff step | max abs diff there | KL there | margin | worst max abs diff | "
               "worst KL | text |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    size_t n_eq = 0;
    for (size_t i = 0; i < r->n_prompts; i++) {
        const kvq_decode_prompt *p = &r->p[i];
        char *tx = gen_text(tok, p->tokens, r->steps < 24 ? r->steps : 24, 90, true);
        const char *txt = tx ? tx : "";
        if (!sim)
            fprintf(f, "| %zu | - | - | - | - | - | - | - | %s |\n", i, txt);
        else if (p->first_diff < 0)
            fprintf(f, "| %zu | yes (%zu) | - | - | - | - | %.3g | %.3g | %s |\n", i, r->steps, p->worst_abs, p->worst_kl, txt);
        else
            fprintf(f, "| %zu | no%s | %d | %.3g | %.3g | %.3g (rank %d) | %.3g | %.3g | %s |\n", i,
                    p->within_floor ? " (within the noise floor)" : "", p->first_diff, p->diff_abs, p->diff_kl, p->margin, p->rank,
                    p->worst_abs, p->worst_kl, txt);
        n_eq += sim && p->first_diff < 0;
        free(tx);
    }
    const double dec_tok = (double)r->n_prompts * (double)(r->steps - 1), pre_tok = (double)r->n_prompts * r->prompt_len;
    fprintf(f, "\n");
    if (sim) fprintf(f, "tokens equal: %zu of %zu prompts\n", n_eq, r->n_prompts);
    if (sim && r->noise_floor) {
        fprintf(f, "noise floor (the simulation against itself with the other GEMM order):");
        for (size_t i = 0; i < r->n_prompts; i++) {
            fprintf(f, "%s prompt %zu: worst max abs diff %.3g, worst KL %.3g, argmax differs at %d step%s", i ? ";" : "", i,
                    r->p[i].floor_abs, r->p[i].floor_kl, r->p[i].floor_flips, r->p[i].floor_flips == 1 ? "" : "s");
            if (r->p[i].floor_first >= 0) fprintf(f, " (first %d)", r->p[i].floor_first);
        }
        fprintf(f, "\n");
    }
    fprintf(f, "decode: %.2f tokens/s (%zu sequence%s x %zu step%s in %.2f s); prefill %.2f tokens/s (token by token)\n",
            tok_per_s(dec_tok, r->decode_s), r->n_prompts, r->n_prompts == 1 ? "" : "s", r->steps - 1, r->steps == 2 ? "" : "s",
            r->decode_s, tok_per_s(pre_tok, r->prefill_s));
    fprintf(f, "KV cache at %zu positions x %zu sequence%s: %zu bytes packed, %zu bytes fp16 (%.3fx)\n",
            r->prompt_len + r->steps - 1, r->batch0_seqs, r->batch0_seqs == 1 ? "" : "s", r->bytes_packed, r->bytes_fp16,
            r->bytes_fp16 ? (double)r->bytes_packed / (double)r->bytes_fp16 : NAN);
    return KVQ_OK;
}

kvq_status kvq_decode_report_json(const char *path, const kvq_model *m, const kvq_tokenizer *tok, const kvq_eval_scheme *s,
                                  const kvq_decode_result *r, const int *prompts, kvq_err *err)
{
    cJSON *root = kvq_kveval_json_head("kvq.kveval.decode", KVQ_JSON_DECODE_VERSION, "decode", m);
    if (tok) cJSON_AddStringToObject(root, "tokenizer", kvq_tokenizer_describe(tok));
    cJSON_AddStringToObject(root, "scheme", s->name);
    if (s->art_path) cJSON_AddStringToObject(root, "artifact", s->art_path);
    cJSON_AddStringToObject(root, "device", r->dev == KVQ_DEVICE_CUDA ? "cuda" : "cpu");
    cJSON *oj = cJSON_AddObjectToObject(root, "options");
    cJSON_AddNumberToObject(oj, "prompts", (double)r->n_prompts);
    cJSON_AddNumberToObject(oj, "prompt_len", (double)r->prompt_len);
    cJSON_AddNumberToObject(oj, "steps", (double)r->steps);
    cJSON_AddNumberToObject(oj, "batch", (double)r->batch);
    const bool sim = r->n_prompts && r->p[0].sim;
    cJSON_AddBoolToObject(oj, "simulation", sim);
    cJSON_AddBoolToObject(oj, "noise_floor", sim && r->noise_floor);
    cJSON_AddBoolToObject(oj, "kv_fp16", r->kv_fp16);
    cJSON_AddBoolToObject(oj, "dequant_attn", r->dequant_attn);
    cJSON *th = cJSON_AddObjectToObject(root, "throughput");
    cJSON_AddNumberToObject(th, "decode_tokens_per_s", tok_per_s((double)r->n_prompts * (double)(r->steps - 1), r->decode_s));
    cJSON_AddNumberToObject(th, "decode_seconds", r->decode_s);
    cJSON_AddNumberToObject(th, "prefill_tokens_per_s", tok_per_s((double)r->n_prompts * r->prompt_len, r->prefill_s));
    cJSON_AddNumberToObject(th, "prefill_seconds", r->prefill_s);
    cJSON_AddNumberToObject(th, "simulation_seconds", r->sim_s);
    cJSON *cb = cJSON_AddObjectToObject(root, "kv_cache");
    cJSON_AddNumberToObject(cb, "positions", (double)(r->prompt_len + r->steps - 1));
    cJSON_AddNumberToObject(cb, "sequences", (double)r->batch0_seqs);
    cJSON_AddNumberToObject(cb, "bytes_packed", (double)r->bytes_packed);
    cJSON_AddNumberToObject(cb, "bytes_fp16", (double)r->bytes_fp16);
    size_t n_eq = 0;
    cJSON *pa = cJSON_AddArrayToObject(root, "prompts");
    for (size_t i = 0; i < r->n_prompts; i++) {
        const kvq_decode_prompt *p = &r->p[i];
        cJSON *po = cJSON_CreateObject();
        cJSON_AddItemToObject(po, "prompt_tokens", cJSON_CreateIntArray(prompts + i * r->prompt_len, (int)r->prompt_len));
        cJSON_AddItemToObject(po, "tokens", cJSON_CreateIntArray(p->tokens, (int)r->steps));
        char *txt = gen_text(tok, p->tokens, r->steps, (size_t)1 << 20, false);
        if (txt) cJSON_AddStringToObject(po, "text", txt);
        free(txt);
        if (sim) {
            n_eq += p->first_diff < 0;
            cJSON_AddBoolToObject(po, "tokens_equal", p->first_diff < 0);
            cJSON_AddItemToObject(po, "simulation_tokens", cJSON_CreateIntArray(p->sim, (int)r->steps));
            if (p->first_diff >= 0) {
                cJSON *fd = cJSON_AddObjectToObject(po, "first_diff");
                cJSON_AddNumberToObject(fd, "step", p->first_diff);
                cJSON_AddNumberToObject(fd, "max_abs_diff", p->diff_abs);
                cJSON_AddNumberToObject(fd, "kl", p->diff_kl);
                cJSON_AddNumberToObject(fd, "margin", p->margin);
                cJSON_AddNumberToObject(fd, "rank", p->rank);
                if (r->noise_floor) cJSON_AddBoolToObject(fd, "within_noise_floor", p->within_floor);
            }
            cJSON_AddNumberToObject(po, "worst_max_abs_diff", p->worst_abs);
            cJSON_AddNumberToObject(po, "worst_kl", p->worst_kl);
            if (r->noise_floor) {
                cJSON *nf = cJSON_AddObjectToObject(po, "noise_floor");
                cJSON_AddNumberToObject(nf, "worst_max_abs_diff", p->floor_abs);
                cJSON_AddNumberToObject(nf, "worst_kl", p->floor_kl);
                cJSON_AddNumberToObject(nf, "argmax_differs_steps", p->floor_flips);
                cJSON_AddNumberToObject(nf, "first_step", p->floor_first);
            }
        }
        cJSON_AddNumberToObject(po, "batch", (double)p->batch_index);
        cJSON_AddItemToArray(pa, po);
    }
    if (sim) cJSON_AddNumberToObject(root, "prompts_tokens_equal", (double)n_eq);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot build the JSON report", path);
    kvq_status st = kvq_outfile_write_text(path, text, err);
    free(text);
    return st;
}
