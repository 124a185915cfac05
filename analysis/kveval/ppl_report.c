/* ppl_report.c — kveval's markdown table and JSON report; see perplexity.h. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "outfile.h"
#include "perplexity.h"

static const char *stage_name(kvq_key_stage s) { return s == KVQ_KEYS_PRE_ROPE ? "pre-rope" : "post-rope"; }

static uint64_t scored_total(const kvq_ppl_report *r) { return (uint64_t)r->plan->n_windows * r->plan->scored_per_window; }

kvq_status kvq_ppl_report_table(FILE *f, const kvq_ppl_report *r, kvq_err *err)
{
    const kvq_windows *w = r->win;
    const kvq_ppl_plan *pl = r->plan;
    fprintf(f, "- model: `%s` (%s, %d layers, %d KV heads x head_dim %d; weights %s)\n", r->m->path, kvq_arch_name(r->m->hp.arch),
            r->m->hp.n_layers, r->m->hp.n_kv_heads, r->m->hp.head_dim, r->m->weights_desc);
    fprintf(f, "- text: `%s` (%s, %llu bytes, sha256 %s)\n", w->path, r->text_format, (unsigned long long)w->bytes_read,
            w->file_sha256);
    fprintf(f, "- protocol: %s, ctx %zu, %zu of %zu windows, %llu scored tokens (%zu per window, from position %zu), "
               "BOS %s (policy %s)\n",
            kvq_ppl_protocol_name(pl->protocol), pl->ctx, pl->n_windows, w->n_windows,
            (unsigned long long)scored_total(r), pl->scored_per_window, pl->first_scored,
            !w->bos ? "off" : pl->protocol == KVQ_PPL_LLAMACPP ? "overwrites each window's first token" : "at stream start",
            r->bos_policy);
    if (r->exec)
        fprintf(f, "- device: %s, %s%s: %s\n", kvq_device_name(r->exec->device), kvq_ppl_exec_mode(r->exec),
                r->exec->device != KVQ_DEVICE_CUDA ? ""
                : r->exec->math == KVQ_CUDA_TF32 ? " — GEMMs on TF32 tensor cores, ~1e-3 relative, not the exactness mode"
                : r->exec->math == KVQ_CUDA_BF16 ? " — bf16 weights and GEMM inputs, ~1e-2 relative, not the exactness mode"
                                                 : "",
                r->exec->described);
    fprintf(f, "\n| scheme | K bits | V bits | eff. bits/elem | KV cache MiB @%zu | PPL | ΔPPL |\n", pl->ctx);
    fprintf(f, "|---|---:|---:|---:|---:|---:|---:|\n");
    double base = r->results[r->baseline].ppl;
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        kvq_bits b;
        KVQ_TRY(kvq_eval_scheme_bits(s, pl->ctx, &r->m->hp, &b, err));
        double mib = kvq_eval_scheme_cache_mib(s, &b, pl->ctx, &r->m->hp);
        double ppl = r->results[i].ppl;
        char delta[32];
        if (i == r->baseline) snprintf(delta, sizeof delta, "baseline");
        else snprintf(delta, sizeof delta, "%+.4f", ppl - base);
        fprintf(f, "| %s | %d | %d | %.2f | %.2f | %.4f | %s |\n", s->name, kvq_eval_scheme_code_bits(s, 'k'),
                kvq_eval_scheme_code_bits(s, 'v'), b.mean, mib, ppl, delta);
    }
    bool notes = false;
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        if (!s->art && !s->prefix) continue;
        if (!notes) fputc('\n', f);
        notes = true;
        fprintf(f, "- %s:", s->name);
        if (s->art)
            fprintf(f, " tables from `%s` (method %s, %s keys, sink %zu)", s->art_path, kvq_method_name(s->art->p.method),
                    s->art->p.post_rope ? "post-RoPE" : "pre-RoPE", s->art->p.n_sink);
        if (s->prefix) {
            fprintf(f, "%s IntactKV prefix of %d entr%s from `%s`", s->art ? ";" : "", s->prefix->P, s->prefix->P == 1 ? "y" : "ies",
                    r->arts->path[s->prefix_index]);
            const kvq_artifact_prefix *px = r->arts->a[s->prefix_index].prefix;
            if (px && px->trained)
                fprintf(f, " (\"%.60s\", trained against %s: %zu steps x %zu windows of %zu tokens, lr %g, loss %.4g -> %.4g)",
                        px->text, px->train.scheme, px->train.steps, px->train.accum, px->train.seq_len, px->train.lr,
                        px->train.loss_before, px->train.loss_after);
            else if (px)
                fprintf(f, " (\"%.60s\", untrained)", px->text);
        }
        fputc('\n', f);
    }
    for (size_t i = 0; i < r->n_skipped; i++) {
        if (!notes) fputc('\n', f);
        notes = true;
        fprintf(f, "- skipped: %s\n", r->skipped[i]);
    }
    return KVQ_OK;
}

static cJSON *num_array(const double *v, size_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

static cJSON *counts_json(const kvq_quant_counts *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "elements", (double)c->n_elems);
    cJSON_AddNumberToObject(o, "outliers", (double)c->n_outliers);
    cJSON_AddNumberToObject(o, "sink", (double)c->n_sink);
    cJSON_AddNumberToObject(o, "exact_other", (double)c->n_exact);
    cJSON_AddNumberToObject(o, "outlier_fraction", c->n_elems ? (double)c->n_outliers / (double)c->n_elems : 0.0);
    return o;
}

static cJSON *build(const kvq_ppl_report *r, kvq_err *err, kvq_status *st)
{
    const kvq_windows *w = r->win;
    const kvq_ppl_plan *pl = r->plan;
    const kvq_hparams *hp = &r->m->hp;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "tool", "kveval");
    cJSON_AddStringToObject(root, "version", "0.1.0");
    cJSON *m = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(m, "path", r->m->path);
    if (r->model_fingerprint) cJSON_AddStringToObject(m, "fingerprint", r->model_fingerprint);
    cJSON_AddStringToObject(m, "arch", kvq_arch_name(hp->arch));
    cJSON_AddStringToObject(m, "weights", r->m->weights_desc);
    cJSON_AddNumberToObject(m, "n_layers", hp->n_layers);
    cJSON_AddNumberToObject(m, "n_kv_heads", hp->n_kv_heads);
    cJSON_AddNumberToObject(m, "head_dim", hp->head_dim);
    cJSON_AddNumberToObject(m, "kv_dim", kvq_kv_dim(hp));
    cJSON_AddNumberToObject(m, "ctx_len", hp->ctx_len);
    cJSON *t = cJSON_AddObjectToObject(root, "text");
    cJSON_AddStringToObject(t, "path", w->path);
    cJSON_AddStringToObject(t, "format", r->text_format);
    cJSON_AddNumberToObject(t, "bytes", (double)w->bytes_read);
    cJSON_AddStringToObject(t, "sha256", w->file_sha256);
    cJSON_AddNumberToObject(t, "tokenised_bytes", (double)w->text_bytes);
    cJSON_AddStringToObject(t, "tokenised_sha256", w->text_sha256);
    cJSON_AddNumberToObject(t, "crlf_replaced", (double)w->crlf_replaced);
    cJSON_AddStringToObject(t, "tokenizer", w->tokenizer);
    cJSON *p = cJSON_AddObjectToObject(root, "protocol");
    cJSON_AddStringToObject(p, "name", kvq_ppl_protocol_name(pl->protocol));
    cJSON_AddNumberToObject(p, "ctx", (double)pl->ctx);
    cJSON_AddStringToObject(p, "bos_policy", r->bos_policy);
    cJSON_AddBoolToObject(p, "bos", w->bos != 0);
    cJSON_AddStringToObject(p, "bos_placement", !w->bos ? "none"
                                                : pl->protocol == KVQ_PPL_LLAMACPP ? "overwrites the first token of every window"
                                                                                   : "start of the token stream only");
    cJSON_AddNumberToObject(p, "stream_tokens", (double)w->n_tokens);
    cJSON_AddNumberToObject(p, "windows_available", (double)w->n_windows);
    cJSON_AddNumberToObject(p, "windows", (double)pl->n_windows);
    cJSON_AddNumberToObject(p, "dropped_tail_tokens", (double)w->dropped_tail);
    cJSON_AddNumberToObject(p, "first_scored_position", (double)pl->first_scored);
    cJSON_AddNumberToObject(p, "scored_per_window", (double)pl->scored_per_window);
    cJSON_AddNumberToObject(p, "scored_tokens", (double)scored_total(r));
    cJSON *offs = cJSON_AddArrayToObject(p, "window_offsets");
    for (size_t i = 0; i < pl->n_windows; i++) cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)w->offsets[i]));
    cJSON_AddStringToObject(p, "ppl", "exp(sum of scored NLL / scored tokens), natural log");
    if (r->exec) {
        cJSON *d = cJSON_AddObjectToObject(root, "device");
        cJSON_AddStringToObject(d, "name", kvq_device_name(r->exec->device));
        if (r->exec->device == KVQ_DEVICE_CUDA) cJSON_AddNumberToObject(d, "gpu", r->exec->gpu);
        cJSON_AddStringToObject(d, "mode", r->exec->device != KVQ_DEVICE_CUDA ? "exact"
                                           : r->exec->math == KVQ_CUDA_TF32  ? "tf32"
                                           : r->exec->math == KVQ_CUDA_BF16  ? "bf16"
                                                                             : "exact");
        cJSON_AddStringToObject(d, "description", r->exec->described);
    }
    cJSON *arts = cJSON_AddArrayToObject(root, "artifacts");
    for (size_t i = 0; r->arts && i < r->arts->n; i++) {
        const kvq_artifact_params *ap = &r->arts->a[i].p;
        cJSON *a = cJSON_CreateObject();
        cJSON_AddStringToObject(a, "path", r->arts->path[i]);
        cJSON_AddStringToObject(a, "method", kvq_method_name(ap->method));
        cJSON_AddNumberToObject(a, "k_bits", ap->k_bits);
        cJSON_AddNumberToObject(a, "v_bits", ap->v_bits);
        cJSON_AddNumberToObject(a, "outlier_fraction", ap->outlier_frac);
        cJSON_AddNumberToObject(a, "n_sink", (double)ap->n_sink);
        cJSON_AddStringToObject(a, "key_position", ap->post_rope ? "post-rope" : "pre-rope");
        cJSON_AddStringToObject(a, "model_fingerprint", ap->model_fingerprint);
        cJSON_AddStringToObject(a, "dump_fingerprint", ap->dump_fingerprint);
        cJSON_AddNumberToObject(a, "intactkv_prefix_entries", r->arts->prefix[i].P);
        cJSON_AddItemToArray(arts, a);
    }
    cJSON *sk = cJSON_AddArrayToObject(root, "skipped");
    for (size_t i = 0; sk && i < r->n_skipped; i++) cJSON_AddItemToArray(sk, cJSON_CreateString(r->skipped[i]));
    cJSON *ss = cJSON_AddArrayToObject(root, "schemes");
    double base = r->results[r->baseline].ppl;
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        const kvq_ppl_result *res = &r->results[i];
        kvq_bits b;
        if ((*st = kvq_eval_scheme_bits(s, pl->ctx, hp, &b, err)) != KVQ_OK) break;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", s->name);
        cJSON_AddStringToObject(o, "spec", s->s.spec);
        cJSON_AddStringToObject(o, "family", s->s.fam->name);
        cJSON_AddBoolToObject(o, "baseline", i == r->baseline);
        cJSON_AddNumberToObject(o, "k_code_bits", kvq_eval_scheme_code_bits(s, 'k'));
        cJSON_AddNumberToObject(o, "v_code_bits", kvq_eval_scheme_code_bits(s, 'v'));
        cJSON_AddNumberToObject(o, "k_bits_per_element", b.k);
        cJSON_AddNumberToObject(o, "v_bits_per_element", b.v);
        cJSON_AddNumberToObject(o, "bits_per_element", b.mean);
        cJSON_AddNumberToObject(o, "kv_cache_mib", kvq_eval_scheme_cache_mib(s, &b, pl->ctx, hp));
        /* the same accounting at longer contexts, for this model and for a
         * Llama-2-7B-shaped cache (32 layers, 32 KV heads x 128) */
        {
            static const size_t ctxs[] = {2048, 32768, 131072};
            kvq_hparams l7 = *hp;
            l7.n_layers = 32;
            l7.n_kv_heads = 32;
            l7.head_dim = 128;
            const struct { const char *name; const kvq_hparams *h; } shapes[] = {{"model", hp}, {"llama2_7b", &l7}};
            cJSON *at = cJSON_AddObjectToObject(o, "kv_cache_mib_at");
            for (size_t k = 0; k < 2 && *st == KVQ_OK; k++) {
                cJSON *sh = cJSON_AddObjectToObject(at, shapes[k].name);
                for (size_t c = 0; c < 3; c++) {
                    kvq_bits bc;
                    if ((*st = kvq_eval_scheme_bits(s, ctxs[c], shapes[k].h, &bc, err)) != KVQ_OK) break;
                    char key[32];
                    snprintf(key, sizeof key, "%zu", ctxs[c]);
                    cJSON_AddNumberToObject(sh, key, kvq_eval_scheme_cache_mib(s, &bc, ctxs[c], shapes[k].h));
                }
            }
            if (*st != KVQ_OK) {
                cJSON_Delete(o);
                break;
            }
        }
        cJSON_AddStringToObject(o, "key_stage", stage_name(s->s.key_stage));
        cJSON_AddNumberToObject(o, "n_sink", (double)s->s.q.n_sink);
        if (s->s.q.kind == KVQ_SCHEME_INT) cJSON_AddNumberToObject(o, "group_size", (double)s->s.q.group);
        if (s->s.q.kind == KVQ_SCHEME_KIVI) {
            cJSON_AddNumberToObject(o, "group_size", (double)s->s.q.group);
            cJSON_AddNumberToObject(o, "residual_length", (double)s->s.q.residual);
        }
        if (s->s.q.outlier_frac > 0) cJSON_AddNumberToObject(o, "outlier_fraction", s->s.q.outlier_frac);
        if (s->s.q.kind == KVQ_SCHEME_FP8) {
            cJSON_AddStringToObject(o, "fp8_format", (s->s.variant & 1) ? "e5m2" : "e4m3fn");
            cJSON_AddStringToObject(o, "fp8_scales", !s->art ? "unit" : s->s.variant >= 2 ? "per-kv-head" : "per-tensor");
            if (s->art) cJSON_AddNumberToObject(o, "fp8_percentile", s->s.percentile);
        }
        if (s->s.q.kind == KVQ_SCHEME_GGML) cJSON_AddNumberToObject(o, "block_size", 32);
        if (s->art_path) cJSON_AddStringToObject(o, "artifact", s->art_path);
        if (s->prefix) {
            cJSON_AddStringToObject(o, "intactkv_artifact", r->arts->path[s->prefix_index]);
            cJSON_AddNumberToObject(o, "intactkv_prefix_entries", s->prefix->P);
            const kvq_artifact_prefix *px = r->arts->a[s->prefix_index].prefix;
            if (px) {
                cJSON_AddStringToObject(o, "intactkv_prefix", px->text);
                cJSON_AddBoolToObject(o, "intactkv_trained", px->trained);
                if (px->trained) {
                    cJSON_AddStringToObject(o, "intactkv_train_scheme", px->train.scheme);
                    cJSON_AddNumberToObject(o, "intactkv_train_steps", (double)px->train.steps);
                    cJSON_AddNumberToObject(o, "intactkv_train_loss_before", px->train.loss_before);
                    cJSON_AddNumberToObject(o, "intactkv_train_loss_after", px->train.loss_after);
                }
            }
        }
        cJSON_AddNumberToObject(o, "ppl", res->ppl);
        if (i == r->baseline) cJSON_AddNullToObject(o, "delta_ppl");
        else cJSON_AddNumberToObject(o, "delta_ppl", res->ppl - base);
        cJSON_AddNumberToObject(o, "nll_sum", res->nll_sum);
        cJSON_AddNumberToObject(o, "scored_tokens", (double)res->n_scored);
        cJSON_AddNumberToObject(o, "seconds", res->seconds);
        cJSON_AddStringToObject(o, "transform", kvq_ppl_xform_name(res->xform));
        if (res->xform == KVQ_PPL_XF_GPU) cJSON_AddNullToObject(o, "transform_seconds"); /* inside the GPU forward */
        else cJSON_AddNumberToObject(o, "transform_seconds", res->transform_seconds);
        cJSON_AddItemToObject(o, "k_counts", counts_json(&res->k_counts));
        cJSON_AddItemToObject(o, "v_counts", counts_json(&res->v_counts));
        cJSON_AddItemToObject(o, "window_mean_nll", num_array(res->window_nll, pl->n_windows));
        cJSON_AddItemToArray(ss, o);
    }
    return root;
}

kvq_status kvq_ppl_report_json(const char *path, const kvq_ppl_report *r, kvq_err *err)
{
    kvq_status st = KVQ_OK;
    cJSON *root = build(r, err, &st);
    char *text = st == KVQ_OK && root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (st) {
        free(text);
        return st;
    }
    if (!text) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot build the JSON report", path);
    st = kvq_outfile_write_text(path, text, err);
    free(text);
    return st;
}
