/* ppl_report.c — kveval's markdown table and JSON report; see perplexity.h. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "outfile.h"
#include "version.h"
#include "perplexity.h"

/* a family's parameters into the scheme's JSON object (kvq_param_sink) */
static void json_num(void *ctx, const char *key, double v) { cJSON_AddNumberToObject(ctx, key, v); }
static void json_str(void *ctx, const char *key, const char *v) { cJSON_AddStringToObject(ctx, key, v); }

static const char *stage_name(kvq_key_stage s) { return s == KVQ_KEYS_PRE_ROPE ? "pre-rope" : "post-rope"; }

static uint64_t scored_total(const kvq_ppl_report *r) { return (uint64_t)r->plan->n_windows * r->plan->scored_per_window; }

/* model FLOPs / seconds of the forward calls, in TFLOP/s (NaN when no time was measured) */
static double tflops(const kvq_ppl_result *res) { return res->seconds > 0 ? res->flops / res->seconds / 1e12 : NAN; }

/* the arithmetic of kvq_cuda_sgemm_rate in the run's math mode */
static const char *gemm_words(const kvq_ppl_exec *x)
{
    return x->math == KVQ_CUDA_TF32 ? "TF32" : x->math == KVQ_CUDA_BF16 ? "BF16 (fp32 accumulation)" : "FP32 (pedantic)";
}

/* What string was tokenised, in words: "the file's bytes (its 2891 CRLF kept; --newlines keep) less one
 * final LF, as llama-perplexity -f reads it" / "its 2891 rows (CRLF -> LF; --newlines lf) joined with
 * "\n\n", as the GPTQ/KVQuant harness joins the dataset's rows" */
static void stream_words(const kvq_windows *w, char *buf, size_t n)
{
    char nl[96];
    if (w->eol == KVQ_EOL_KEEP)
        snprintf(nl, sizeof nl, "%zu CRLF kept; --newlines keep", w->crlf_in_file);
    else
        snprintf(nl, sizeof nl, "%zu CRLF turned into LF; --newlines lf", w->crlf_replaced);
    if (w->rows_joined)
        snprintf(buf, n, "its %zu rows (%s) joined with \"\\n\\n\", as the GPTQ/KVQuant harness joins the dataset's rows",
                 w->rows_joined, nl);
    else
        snprintf(buf, n, "the file's bytes (%s)%s, as llama-perplexity -f reads them", nl,
                 w->final_lf_dropped ? " less the final LF" : "");
}

kvq_status kvq_ppl_report_table(FILE *f, const kvq_ppl_report *r, kvq_err *err)
{
    const kvq_windows *w = r->win;
    const kvq_ppl_plan *pl = r->plan;
    fprintf(f, "- model: `%s` (%s, %d layers, %d KV heads x head_dim %d; weights %s)\n", r->m->path, kvq_arch_name(r->m->hp.arch),
            r->m->hp.n_layers, r->m->hp.n_kv_heads, r->m->hp.head_dim, r->m->weights_desc);
    fprintf(f, "- text: `%s` (%s, %llu bytes, sha256 %s)\n", w->path, r->text_format, (unsigned long long)w->bytes_read,
            w->file_sha256);
    {
        char sw[400];
        stream_words(w, sw, sizeof sw);
        fprintf(f, "- tokenised: %s: %llu bytes, sha256 %s, %zu tokens (%s)\n", sw, (unsigned long long)w->text_bytes,
                w->text_sha256, w->n_tokens, w->tokenizer);
    }
    fprintf(f, "- protocol: %s (newlines %s), ctx %zu%s, %zu of %zu windows, %llu scored tokens (%zu per window, from position %zu), "
               "BOS %s (policy %s)\n",
            kvq_ppl_protocol_name(pl->protocol), kvq_eol_name(w->eol), pl->ctx,
            r->ctx_max ? " (--ctx max: the model's trained context)" : "", pl->n_windows, w->n_windows,
            (unsigned long long)scored_total(r), pl->scored_per_window, pl->first_scored,
            !w->bos ? "off" : pl->protocol == KVQ_PPL_LLAMACPP ? "overwrites each window's first token" : "at stream start",
            r->bos_policy);
    if (r->exec) {
        fprintf(f, "- device: %s, %s%s: %s", kvq_device_name(r->exec->device), kvq_ppl_exec_mode(r->exec),
                r->exec->device != KVQ_DEVICE_CUDA ? ""
                : r->exec->math == KVQ_CUDA_TF32 ? " — GEMMs on TF32 tensor cores, ~1e-3 relative, not the exactness mode"
                : r->exec->math == KVQ_CUDA_BF16 ? " — bf16 weights and GEMM inputs, ~1e-2 relative, not the exactness mode"
                                                 : "",
                r->exec->described);
        if (r->exec->device == KVQ_DEVICE_CUDA) { /* the GPU's throughput, and its ratio to the GEMM rate of the same run */
            const double g = r->exec->gemm_flops;
            fprintf(f, "; throughput (model FLOPs / seconds of the forward calls):");
            for (size_t i = 0; i < r->n_schemes; i++) {
                const double tf = tflops(&r->results[i]);
                fprintf(f, "%s %s %.1f TFLOP/s", i ? "," : "", r->schemes[i].name, tf);
                if (g > 0) fprintf(f, " (%.2f)", tf * 1e12 / g);
            }
            if (g > 0)
                fprintf(f, "; (x) = fraction of cuBLAS's %s GEMM rate measured in this run, %.1f TFLOP/s (8192^3, median of 7)",
                        gemm_words(r->exec), g / 1e12);
        }
        fputc('\n', f);
    }
    bool kld = false;
    for (size_t i = 0; i < r->n_schemes; i++) kld |= r->results[i].has_kld;
    fprintf(f, "\n| scheme | K bits | V bits | eff. bits/elem | KV cache MiB @%zu | PPL | ΔPPL ± SE |%s\n", pl->ctx,
            kld ? " mean KLD | median KLD | p99 KLD | same top % |" : "");
    fprintf(f, "|---|---:|---:|---:|---:|---:|---:|%s\n", kld ? "---:|---:|---:|---:|" : "");
    const kvq_ppl_result *base = &r->results[r->baseline];
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        const kvq_ppl_result *res = &r->results[i];
        /* a size the accounting cannot give is left empty: the computed numbers are never lost for it */
        char bits[32] = "", mib[32] = "";
        kvq_bits b;
        kvq_err be = {0};
        if (kvq_eval_scheme_bits_run(s, pl->ctx, &r->m->hp, &res->k_counts, &res->v_counts, &b, &be) == KVQ_OK) {
            snprintf(bits, sizeof bits, "%.2f", b.mean);
            snprintf(mib, sizeof mib, "%.2f", kvq_eval_scheme_cache_mib(s, &b, pl->ctx, &r->m->hp));
        }
        char delta[64];
        if (i == r->baseline) {
            snprintf(delta, sizeof delta, "baseline");
        } else {
            kvq_ppl_paired pd;
            kvq_ppl_paired_delta(res, base, pl->n_windows, &pd);
            if (isnan(pd.d_ppl_se)) snprintf(delta, sizeof delta, "%+.4f", pd.d_ppl);
            else snprintf(delta, sizeof delta, "%+.4f ± %.4f", pd.d_ppl, pd.d_ppl_se);
        }
        fprintf(f, "| %s | %d | %d | %s | %s | %.4f | %s |", s->name, kvq_eval_scheme_code_bits(s, 'k'),
                kvq_eval_scheme_code_bits(s, 'v'), bits, mib, res->ppl, delta);
        if (kld && res->has_kld)
            fprintf(f, " %.4g | %.4g | %.4g | %.2f |", res->kld.mean, res->kld.median, res->kld.p99, 100.0 * res->kld.same_top_frac);
        else if (kld)
            fprintf(f, " — | — | — | — |");
        fputc('\n', f);
    }
    bool notes = false;
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        const kvq_ppl_result *res = &r->results[i];
        const bool sched = res->sched_device || res->sched_host;
        if (!s->art && !s->prefix && !sched) continue;
        if (!notes) fputc('\n', f);
        notes = true;
        fprintf(f, "- %s:", s->name);
        if (sched)
            fprintf(f, " per-key schedule of %llu layer call%s on the GPU, %llu on the host%s%s",
                    (unsigned long long)res->sched_device, res->sched_device == 1 ? "" : "s", (unsigned long long)res->sched_host,
                    res->sched_host ? " (KVQ_SCHED_HOST=1, or a shape or schedule the device path does not take: docs/architecture.md)" : "",
                    s->art || s->prefix ? ";" : "");
        if (s->art)
            fprintf(f, " tables from `%s` (method %s, %s keys, calibrated with sink %zu%s)", s->art_path, s->art->p.method->name,
                    s->art->p.post_rope ? "post-RoPE" : "pre-RoPE", s->art->p.n_sink,
                    s->s.q.n_sink != s->art->p.n_sink ? "; this row's sink: its +sink" : "");
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
    if (kvq_ppl_report_warnings(NULL, r, "")) {
        if (!notes) fputc('\n', f);
        notes = true;
        kvq_ppl_report_warnings(f, r, "- warning: ");
    }
    for (size_t i = 0; i < r->n_skipped; i++) {
        if (!notes) fputc('\n', f);
        notes = true;
        fprintf(f, "- skipped: %s\n", r->skipped[i]);
    }
    if (!notes) fputc('\n', f);
    fprintf(f, "- ΔPPL ± SE: the standard error from the %zu windows' paired differences%s",
            pl->n_windows, pl->n_windows < 2 ? " (needs 2 windows or more: not given)" : "");
    if (kld)
        fprintf(f, "; KLD: KL(P_fp32 || Q_scheme) of the next-token distribution per scored token, nats (llama-perplexity "
                   "--kl-divergence's statistics); same top %%: the scheme's most likely next token is the baseline's");
    fputc('\n', f);
    if (fflush(f) != 0 || ferror(f)) return kvq_fail(err, KVQ_EIO, "cannot write the table: %s", strerror(errno));
    return KVQ_OK;
}

static cJSON *num_array(const double *v, size_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

/* JSON has no NaN: a value that is not finite is null */
static void add_num_or_null(cJSON *o, const char *k, double v)
{
    if (isfinite(v)) cJSON_AddNumberToObject(o, k, v);
    else cJSON_AddNullToObject(o, k);
}

static cJSON *counts_json(const kvq_quant_counts *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "elements", (double)c->n_elems);
    cJSON_AddNumberToObject(o, "outliers", (double)c->n_outliers);
    cJSON_AddNumberToObject(o, "sink", (double)c->n_sink);
    cJSON_AddNumberToObject(o, "exact_other", (double)c->n_exact);
    cJSON_AddNumberToObject(o, "high_precision", (double)c->n_high);
    cJSON_AddNumberToObject(o, "code_bits", (double)c->n_code_bits);
    cJSON_AddNumberToObject(o, "clipped", (double)c->n_clipped);
    cJSON_AddNumberToObject(o, "stored_coefficients", (double)c->n_coef);
    cJSON_AddNumberToObject(o, "outlier_fraction", c->n_elems ? (double)c->n_outliers / (double)c->n_elems : 0.0);
    return o;
}

size_t kvq_ppl_report_warnings(FILE *f, const kvq_ppl_report *r, const char *prefix)
{
    size_t n = 0;
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        const kvq_ppl_result *res = &r->results[i];
        const kvq_quant_counts *kc = &res->k_counts, *vc = &res->v_counts;
        if (kc->n_clipped || vc->n_clipped) {
            const uint64_t tot = kc->n_elems + vc->n_elems;
            if (f)
                fprintf(f, "%s%s: %llu key and %llu value elements (%.3g%% of the cache) lay beyond the format's range and were "
                           "saturated to its largest value (a real %s cache would hold %s there)\n",
                        prefix, s->name, (unsigned long long)kc->n_clipped, (unsigned long long)vc->n_clipped,
                        tot ? 100.0 * (double)(kc->n_clipped + vc->n_clipped) / (double)tot : 0.0,
                        s->s.q.fam->name, !strcmp(s->s.q.fam->name, "fp16") ? "Inf" : "the saturated value too");
            n++;
        }
        const double nominal = s->s.q.outlier_frac;
        /* keys only: their thresholds are calibrated offline, so the realised share measures the match of
         * tables and data; values' outliers (and the keys' of families that choose them per token, qaq) are a
         * fixed count per row, 2 k_side / kv_dim, above the nominal where kv_dim is small */
        const double got = kvq_bits_outlier_frac(kc, nominal); /* the nominal itself when nothing was counted */
        if (nominal > 0 && !s->s.q.fam->key_outliers_online && got > KVQ_OUTLIER_WARN_RATIO * nominal) {
            if (f)
                fprintf(f, "%s%s: %.3g%% of the keys went to the sparse outliers, %.1fx the nominal %.3g%% (tables calibrated on "
                           "other data or another model?); the bits column counts the realised fraction\n",
                        prefix, s->name, 100.0 * got, got / nominal, 100.0 * nominal);
            n++;
        }
    }
    return n;
}

cJSON *kvq_kveval_json_head(const char *schema, int version, const char *task, const kvq_model *m)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *sj = cJSON_AddObjectToObject(root, "schema");
    cJSON_AddStringToObject(sj, "name", schema);
    cJSON_AddNumberToObject(sj, "version", version);
    cJSON_AddStringToObject(root, "tool", "kveval");
    cJSON_AddStringToObject(root, "version", KVQ_VERSION);
    cJSON_AddStringToObject(root, "task", task);
    cJSON *mj = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(mj, "path", m->path);
    cJSON_AddNumberToObject(mj, "ctx_len", m->hp.ctx_len);
    return root;
}

static cJSON *build(const kvq_ppl_report *r)
{
    const kvq_windows *w = r->win;
    const kvq_ppl_plan *pl = r->plan;
    const kvq_hparams *hp = &r->m->hp;
    cJSON *root = cJSON_CreateObject();
    cJSON *schema = cJSON_AddObjectToObject(root, "schema"); /* docs/JSON.md */
    cJSON_AddStringToObject(schema, "name", "kvq.kveval");
    cJSON_AddNumberToObject(schema, "version", KVQ_JSON_KVEVAL_VERSION);
    cJSON_AddStringToObject(root, "tool", "kveval");
    cJSON_AddStringToObject(root, "version", KVQ_VERSION);
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
    cJSON_AddStringToObject(t, "newlines", kvq_eol_name(w->eol));
    cJSON_AddNumberToObject(t, "crlf_in_file", (double)w->crlf_in_file);
    cJSON_AddNumberToObject(t, "crlf_replaced", (double)w->crlf_replaced);
    cJSON_AddBoolToObject(t, "final_lf_dropped", w->final_lf_dropped != 0);
    cJSON_AddNumberToObject(t, "rows_joined", (double)w->rows_joined);
    {
        char sw[400];
        stream_words(w, sw, sizeof sw);
        cJSON_AddStringToObject(t, "tokenised_text", sw);
    }
    cJSON_AddStringToObject(t, "tokenizer", w->tokenizer);
    cJSON *p = cJSON_AddObjectToObject(root, "protocol");
    cJSON_AddStringToObject(p, "name", kvq_ppl_protocol_name(pl->protocol));
    cJSON_AddStringToObject(p, "newlines", kvq_eol_name(w->eol));
    cJSON_AddNumberToObject(p, "ctx", (double)pl->ctx);
    cJSON_AddBoolToObject(p, "ctx_max", r->ctx_max);
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
        if (r->exec->gemm_flops > 0) {
            cJSON_AddNumberToObject(d, "gemm_tflops_per_s", r->exec->gemm_flops / 1e12);
            cJSON_AddStringToObject(d, "gemm", gemm_words(r->exec));
        }
    }
    cJSON *arts = cJSON_AddArrayToObject(root, "artifacts");
    for (size_t i = 0; r->arts && i < r->arts->n; i++) {
        const kvq_artifact_params *ap = &r->arts->a[i].p;
        cJSON *a = cJSON_CreateObject();
        cJSON_AddStringToObject(a, "path", r->arts->path[i]);
        cJSON_AddStringToObject(a, "method", ap->method->name);
        cJSON_AddNumberToObject(a, "k_bits", ap->k_bits);
        cJSON_AddNumberToObject(a, "v_bits", ap->v_bits);
        cJSON_AddNumberToObject(a, "outlier_fraction", ap->outlier_frac);
        cJSON_AddNumberToObject(a, "n_sink", (double)ap->n_sink);
        cJSON_AddStringToObject(a, "key_position", ap->post_rope ? "post-rope" : "pre-rope");
        cJSON_AddStringToObject(a, "rotation", kvq_rotation_kind_name(ap->rotation.kind));
        if (ap->rotation.kind == KVQ_ROT_RHT) cJSON_AddNumberToObject(a, "rotation_seed", (double)ap->rotation.seed);
        cJSON_AddStringToObject(a, "model_fingerprint", ap->model_fingerprint);
        cJSON_AddStringToObject(a, "dump_fingerprint", ap->dump_fingerprint);
        cJSON_AddNumberToObject(a, "intactkv_prefix_entries", r->arts->prefix[i].P);
        cJSON_AddItemToArray(arts, a);
    }
    cJSON *sk = cJSON_AddArrayToObject(root, "skipped");
    for (size_t i = 0; sk && i < r->n_skipped; i++) cJSON_AddItemToArray(sk, cJSON_CreateString(r->skipped[i]));
    cJSON *ss = cJSON_AddArrayToObject(root, "schemes");
    const kvq_ppl_result *base = &r->results[r->baseline];
    for (size_t i = 0; i < r->n_schemes; i++) {
        const kvq_eval_scheme *s = &r->schemes[i];
        const kvq_ppl_result *res = &r->results[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", s->name);
        cJSON_AddStringToObject(o, "spec", s->s.spec);
        cJSON_AddStringToObject(o, "family", s->s.q.fam->name);
        cJSON_AddBoolToObject(o, "baseline", i == r->baseline);
        cJSON_AddNumberToObject(o, "k_code_bits", kvq_eval_scheme_code_bits(s, 'k'));
        cJSON_AddNumberToObject(o, "v_code_bits", kvq_eval_scheme_code_bits(s, 'v'));
        /* sizes: a size the accounting cannot give for a shape (e.g. a per-head fp8 scale count of a
         * Llama-2-7B-shaped cache for a model whose head_dim differs) is null with the reason; the
         * report is written whatever it is (the numbers of the run are never lost for a size) */
        kvq_bits b;
        kvq_err be = {0};
        if (kvq_eval_scheme_bits_run(s, pl->ctx, hp, &res->k_counts, &res->v_counts, &b, &be) == KVQ_OK) {
            cJSON_AddNumberToObject(o, "k_bits_per_element", b.k);
            cJSON_AddNumberToObject(o, "v_bits_per_element", b.v);
            cJSON_AddNumberToObject(o, "bits_per_element", b.mean);
            cJSON_AddNumberToObject(o, "kv_cache_mib", kvq_eval_scheme_cache_mib(s, &b, pl->ctx, hp));
        } else {
            cJSON_AddNullToObject(o, "k_bits_per_element");
            cJSON_AddNullToObject(o, "v_bits_per_element");
            cJSON_AddNullToObject(o, "bits_per_element");
            cJSON_AddNullToObject(o, "kv_cache_mib");
            cJSON_AddStringToObject(o, "bits_error", be.msg);
        }
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
            for (size_t k = 0; k < 2; k++) {
                cJSON *sh = cJSON_AddObjectToObject(at, shapes[k].name);
                for (size_t c = 0; c < 3; c++) {
                    kvq_bits bc;
                    char key[32];
                    snprintf(key, sizeof key, "%zu", ctxs[c]);
                    if (kvq_eval_scheme_bits_run(s, ctxs[c], shapes[k].h, &res->k_counts, &res->v_counts, &bc, &be) == KVQ_OK)
                        cJSON_AddNumberToObject(sh, key, kvq_eval_scheme_cache_mib(s, &bc, ctxs[c], shapes[k].h));
                    else
                        cJSON_AddNullToObject(sh, key);
                }
            }
        }
        cJSON_AddStringToObject(o, "key_stage", stage_name(s->s.key_stage));
        cJSON_AddStringToObject(o, "rotation", kvq_rotation_kind_name(s->desc.rot.kind));
        if (s->desc.rot.kind == KVQ_ROT_RHT) cJSON_AddNumberToObject(o, "rotation_seed", (double)s->desc.rot.seed);
        cJSON_AddNumberToObject(o, "n_sink", (double)s->s.q.n_sink);
        if (s->s.q.outlier_frac > 0) cJSON_AddNumberToObject(o, "outlier_fraction", s->s.q.outlier_frac);
        if (s->s.q.fam->describe) {
            kvq_param_sink ps = {.ctx = o, .num = json_num, .str = json_str};
            s->s.q.fam->describe(&s->s.q, s->art != NULL, &ps);
        }
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
        if (i == r->baseline) {
            cJSON_AddNullToObject(o, "delta_ppl");
            cJSON_AddNullToObject(o, "delta_ppl_se");
            cJSON_AddNullToObject(o, "delta_mean_nll");
            cJSON_AddNullToObject(o, "delta_mean_nll_se");
        } else {
            kvq_ppl_paired pd;
            kvq_ppl_paired_delta(res, base, pl->n_windows, &pd);
            cJSON_AddNumberToObject(o, "delta_ppl", pd.d_ppl);
            add_num_or_null(o, "delta_ppl_se", pd.d_ppl_se);
            cJSON_AddNumberToObject(o, "delta_mean_nll", pd.d_nll);
            add_num_or_null(o, "delta_mean_nll_se", pd.d_nll_se);
        }
        if (res->has_kld) {
            const kvq_kld_stats *k = &res->kld;
            cJSON *kj = cJSON_AddObjectToObject(o, "kld");
            cJSON_AddNumberToObject(kj, "tokens", (double)k->n);
            add_num_or_null(kj, "mean", k->mean);
            add_num_or_null(kj, "mean_se", k->mean_se);
            add_num_or_null(kj, "median", k->median);
            add_num_or_null(kj, "p90", k->p90);
            add_num_or_null(kj, "p95", k->p95);
            add_num_or_null(kj, "p99", k->p99);
            add_num_or_null(kj, "p99_9", k->p999);
            add_num_or_null(kj, "min", k->min);
            add_num_or_null(kj, "max", k->max);
            cJSON_AddNumberToObject(kj, "same_top_tokens", (double)k->same_top);
            add_num_or_null(kj, "same_top_fraction", k->same_top_frac);
            add_num_or_null(kj, "same_top_se", k->same_top_se);
            cJSON_AddItemToObject(kj, "window_mean", num_array(res->window_kld, pl->n_windows));
        } else {
            cJSON_AddNullToObject(o, "kld");
        }
        cJSON_AddNumberToObject(o, "nll_sum", res->nll_sum);
        cJSON_AddNumberToObject(o, "scored_tokens", (double)res->n_scored);
        cJSON_AddNumberToObject(o, "seconds", res->seconds);
        cJSON_AddNumberToObject(o, "flops", res->flops);
        add_num_or_null(o, "tflops_per_s", tflops(res));
        if (r->exec && r->exec->gemm_flops > 0) add_num_or_null(o, "of_gemm_rate", tflops(res) * 1e12 / r->exec->gemm_flops);
        cJSON_AddStringToObject(o, "transform", kvq_ppl_xform_name(res->xform));
        if (res->xform == KVQ_PPL_XF_GPU) cJSON_AddNullToObject(o, "transform_seconds"); /* inside the GPU forward */
        else cJSON_AddNumberToObject(o, "transform_seconds", res->transform_seconds);
        if (res->sched_device || res->sched_host) {
            cJSON *sj = cJSON_AddObjectToObject(o, "schedule_layers");
            cJSON_AddNumberToObject(sj, "device", (double)res->sched_device);
            cJSON_AddNumberToObject(sj, "host", (double)res->sched_host);
        } else {
            cJSON_AddNullToObject(o, "schedule_layers");
        }
        cJSON_AddItemToObject(o, "k_counts", counts_json(&res->k_counts));
        cJSON_AddItemToObject(o, "v_counts", counts_json(&res->v_counts));
        cJSON_AddItemToObject(o, "window_mean_nll", num_array(res->window_nll, pl->n_windows));
        cJSON_AddItemToArray(ss, o);
    }
    return root;
}

kvq_status kvq_ppl_report_json(const char *path, const kvq_ppl_report *r, kvq_err *err)
{
    cJSON *root = build(r);
    char *text = root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot build the JSON report", path);
    kvq_status st = kvq_outfile_write_text(path, text, err);
    free(text);
    return st;
}
