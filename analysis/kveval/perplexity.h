/* perplexity.h — perplexity of a model over token windows with the KV cache
 * quantized by several schemes, evaluated side by side on the same windows.
 *
 * Protocols (the windows come from datasets/text.h kvq_ppl_windows):
 *  - kvquant (KVQuant/GPTQ harness, docs/kvquant.md §9.1): non-overlapping
 *    windows of ctx tokens, BOS only at the start of the stream; in each
 *    window every position after the first is scored: position t predicts
 *    token t+1 for t = 0..ctx-2 → ctx-1 scored tokens per window.
 *  - llamacpp (llama.cpp tools/perplexity): the window's first token is BOS
 *    (overwritten by kvq_ppl_windows), only the second half is scored:
 *    first = ctx/2, positions t = first..ctx-2 predict t+1 → ctx-1-first
 *    scored tokens per window.
 * PPL = exp(sum of scored NLL / number of scored tokens) (natural log); with
 * the same count in every window this is also exp(mean of window means), the
 * KVQuant formula.
 *
 * With a +intactkv prefix of P entries the window is unchanged, runs at
 * positions P..P+ctx-1 after the prefix, and the prefix is never scored.
 *
 * Every window is run once per scheme (fp32 without hooks); numbers are
 * deterministic for a fixed thread count (forward.h).
 *
 * Devices (kernels/model/device.h): on the CPU windows run window-major (window w
 * for every scheme, then w+1) with each scheme's transform as a hook; on a
 * GPU scheme-major (every window of scheme 0, then scheme 1: one descriptor
 * upload per scheme), a scheme with a descriptor (kvq_eval_scheme_kv_desc)
 * transformed natively on the GPU, any other as a host transform. The
 * per-window numbers do not depend on the order.
 */
#ifndef KVQ_PERPLEXITY_H
#define KVQ_PERPLEXITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "model.h"
#include "progress.h"
#include "scheme.h"
#include "status.h"
#include "text.h"

typedef struct {
    kvq_ppl_protocol protocol;
    size_t ctx;                /* window length */
    size_t n_windows;          /* windows evaluated: min(available, max_windows) */
    size_t first_scored;       /* window index of the first scored prediction: 0 (kvquant), ctx/2 (llamacpp) */
    size_t scored_per_window;  /* ctx - 1 - first_scored */
} kvq_ppl_plan;

/* Plan for windows `win` (ctx, n_windows from it); max_windows 0 = all.
 * Errors: KVQ_EINVAL when the text holds no complete window ("text of N
 * tokens is shorter than one window of ctx tokens"), ctx < 2, or a protocol
 * that would score no token per window (llamacpp at ctx 2). */
kvq_status kvq_ppl_plan_make(const kvq_windows *win, kvq_ppl_protocol protocol, size_t max_windows,
                             kvq_ppl_plan *out, kvq_err *err);

/* Targets of one window: targets[t] = tokens[t+1] for first_scored <= t <
 * ctx-1, else -1 (the forward's convention). targets: [ctx]. */
void kvq_ppl_targets(const kvq_ppl_plan *plan, const int32_t *tokens, int *targets);

const char *kvq_ppl_protocol_name(kvq_ppl_protocol p);

/* Where a run executes, and what it compares. Zeroed = the CPU, no KL divergence. */
typedef struct {
    kvq_device device;   /* KVQ_DEVICE_CPU or KVQ_DEVICE_CUDA (kvq_device_parse) */
    /* KL divergence and top-1 agreement of every scheme's next-token distribution against
     * scheme kld_baseline's (the fp32 baseline), per scored token, streamed (kvq_fwd_head: the
     * baseline's expected output embedding, never [T][vocab] logits). The run goes window-major
     * on both devices (the baseline's window first), so only one window's head outputs are kept. */
    bool kld;
    size_t kld_baseline;
    int gpu;             /* GPU index (cuda:N) */
    int n_gpus;          /* > 1: the pipeline over gpus[0..n_gpus) (--devices; kvq_engine_init_pipe), forward only */
    int gpus[64];
    kvq_cuda_math math;  /* CUDA: KVQ_CUDA_EXACT (fp32, TF32 off), KVQ_CUDA_TF32 or KVQ_CUDA_BF16 (fast modes) */
    bool auto_device;    /* device came from "auto": a GPU that cannot run the model falls back to the CPU */
    char described[256]; /* output of kvq_ppl_run_on: kvq_engine_describe of the engine that ran */
    char note[320];      /* output: why an "auto" GPU run fell back to the CPU ("" otherwise); device is then CPU */
    /* The throughput's baseline (kveval --gemm-rate): on the GPU, cuBLAS's GEMM rate in the run's math mode
     * (kvq_cuda_sgemm_rate: 8192^3, median of 7; FP32 pedantic, TF32, or bf16 inputs with fp32 accumulation)
     * measured after the model is on the device and before the first window. Ignored on the CPU. */
    bool gemm_rate;
    double gemm_flops;   /* output: that rate in FLOP/s; 0 = not measured (not asked, or the run was on the CPU) */
} kvq_ppl_exec;

/* "exact (fp32)", "fast (TF32)" or "fast (BF16)": the math mode of x (the CPU is always exact). */
const char *kvq_ppl_exec_mode(const kvq_ppl_exec *x);

/* Where a scheme's K/V transform ran. */
typedef enum {
    KVQ_PPL_XF_NONE = 0,   /* no transform (fp32) */
    KVQ_PPL_XF_CPU,        /* CPU hook (counters and transform_seconds measured) */
    KVQ_PPL_XF_GPU,        /* natively on the GPU (counters: n_elems, n_sink and n_outliers only;
                            * transform_seconds not measured, 0) */
    KVQ_PPL_XF_HOST        /* GPU forward, transform on the host between layers (measured) */
} kvq_ppl_xform;

const char *kvq_ppl_xform_name(kvq_ppl_xform x); /* "none", "cpu", "gpu-native", "host" */

/* KL divergence statistics of one scheme against the baseline, over its scored tokens, as
 * llama-perplexity --kl-divergence reports them (tools/perplexity): KL(P_base || Q_scheme) =
 * sum_v P_v (ln P_v - ln Q_v) in nats per token; mean_se = sqrt((mean(x^2) - mean(x)^2) / (n - 1));
 * median = the middle value (the mean of the two middle ones for even n); the percentiles
 * interpolate linearly at fraction * (n - 1) of the sorted values; "same top" = the scheme's
 * largest logit is the baseline's (first index on ties), se = sqrt(f (1 - f) / (n - 1)). */
typedef struct {
    uint64_t n;                    /* tokens compared */
    double mean, mean_se;
    double median, p90, p95, p99, p999, min, max;
    uint64_t same_top;
    double same_top_frac, same_top_se;
} kvq_kld_stats;

/* Fill st from the n per-token values x (sorted in place) and the same-top count. */
void kvq_kld_stats_compute(double *x, uint64_t n, uint64_t same_top, kvq_kld_stats *st);

/* Result of one scheme. */
typedef struct {
    double nll_sum;            /* nats, over all scored tokens */
    uint64_t n_scored;
    double ppl;                /* exp(nll_sum / n_scored) */
    double seconds;            /* wall time of this scheme's forward calls (kvq_engine_run: embedding to the LM head's
                                * loss, and the head's KL divergence work when on; not the model load, the
                                * tokeniser, nor the host's per-token KLD dot products) */
    double flops;              /* model FLOPs of those calls: windows x kvq_forward_flops(hp, ctx, prefix P) (the LM
                                * head counted for every position; the KL divergence's expectation GEMM in the
                                * baseline's pass is not counted); throughput = flops / seconds */
    double transform_seconds;  /* of which inside the scheme's K/V transform (quantize→dequantize) */
    kvq_quant_counts k_counts, v_counts; /* quantizer counters summed over layers and windows */
    double *window_nll;        /* [n_windows] mean NLL of each window (owned; kvq_ppl_results_free) */
    kvq_ppl_xform xform;       /* where the transform ran */
    uint64_t sched_device, sched_host; /* on the GPU: layer calls whose per-key schedule (a scheme of contract form 3,
                                * kernels/model/forward.h kvq_kv_sched) ran on the device / on the host (kvq_cuda_stats
                                * device_scheds / host_scheds); 0 on the CPU and for schemes without a schedule */
    /* with kvq_ppl_exec.kld, for every scheme but the baseline: */
    bool has_kld;
    kvq_kld_stats kld;
    double *window_kld;        /* [n_windows] mean KL divergence of each window (owned) */
    double *token_kld;         /* [n_windows][scored_per_window] per scored token, sorted after the run (owned) */
} kvq_ppl_result;

/* Paired difference of a scheme against the baseline over the same windows: the change in
 * mean NLL (nats) and in perplexity, each with its standard error from the per-window
 * differences (W windows of equal scored counts; a_w, b_w the windows' mean NLLs):
 *   d_nll = mean_w (a_w - b_w),  se = sd_w(a_w - b_w) / sqrt(W)
 *   d_ppl = PPL_a - PPL_b,  se by the delta method on (mean a, mean b):
 *     sqrt((PPL_a^2 var(a) + PPL_b^2 var(b) - 2 PPL_a PPL_b cov(a, b)) / W)
 * (sample variances, W - 1). The se are NaN for W < 2. */
typedef struct {
    double d_nll, d_nll_se, d_ppl, d_ppl_se;
} kvq_ppl_paired;
void kvq_ppl_paired_delta(const kvq_ppl_result *s, const kvq_ppl_result *base, size_t n_windows, kvq_ppl_paired *out);

/* Evaluate every scheme on the plan's windows (window-major: window w for
 * scheme 0..n-1, then w+1). results: [n_schemes], filled (zeroed first).
 * prog (optional) counts window-scheme runs. Errors: those of the forward,
 * prefixed with the scheme, window and its offset in the stream; a NaN/Inf
 * NLL → KVQ_ENUMERIC naming scheme, window and position. On error the
 * results are freed. */
kvq_status kvq_ppl_run(const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
                       const kvq_eval_scheme *schemes, size_t n_schemes, kvq_progress *prog,
                       kvq_ppl_result *results, kvq_err *err);
/* kvq_ppl_run on the device x says (NULL = CPU); fills x->described.
 * Errors also those of kvq_engine_init_at (KVQ_EUNSUPPORTED: no GPU or a
 * CPU-only build; KVQ_ENOMEM naming the device buffer) and of
 * kvq_forward_cuda_set_kv. */
kvq_status kvq_ppl_run_on(kvq_ppl_exec *x, const kvq_model *m, const kvq_windows *win, const kvq_ppl_plan *plan,
                          const kvq_eval_scheme *schemes, size_t n_schemes, kvq_progress *prog,
                          kvq_ppl_result *results, kvq_err *err);
void kvq_ppl_results_free(kvq_ppl_result *results, size_t n);

/* ---- reports (ppl_report.c) ------------------------------------------------- */

/* Everything a report prints; all pointers borrowed. */
typedef struct {
    const kvq_model *m;
    const char *model_fingerprint; /* may be NULL */
    const kvq_windows *win;
    const char *text_format;       /* "raw", ... */
    const char *bos_policy;        /* "model", "always", "never" */
    const kvq_ppl_plan *plan;
    const kvq_artifact_set *arts;  /* may be NULL */
    const kvq_eval_scheme *schemes;
    const kvq_ppl_result *results;
    size_t n_schemes;
    size_t baseline;               /* index of the fp32 baseline in schemes */
    const kvq_ppl_exec *exec;      /* the device that ran (NULL: not reported) */
    bool ctx_max;                  /* ctx is the model's trained context (kveval --ctx max) */
    const char *const *skipped;    /* [n_skipped] "why" lines of schemes that do not apply to the model
                                      (KVQ_EUNSUPPORTED at binding, e.g. q4_0 with head_dim 48); may be NULL */
    size_t n_skipped;
} kvq_ppl_report;

/* Markdown: a few "key: value" lines (model, text bytes + sha256, the string
 * tokenised, protocol and newline policy, ctx, windows, scored tokens, BOS,
 * device and math mode), then the table
 *   scheme | K bits | V bits | eff. bits/elem | KV cache MiB @ctx | PPL | ΔPPL ± SE
 *   [| mean KLD | median KLD | p99 KLD | same top % |  when the run had the KLD]
 * (K/V bits = code bits; effective bits = mean of K and V per
 * kvq_eval_scheme_bits, left empty where the accounting fails; ΔPPL against
 * the baseline row with kvq_ppl_paired_delta's standard error), then one line
 * per scheme that read an artifact or a prefix, one "skipped" line per entry
 * of r->skipped and a line saying what ± and KLD are. Errors: KVQ_EIO when
 * f cannot be written. */
kvq_status kvq_ppl_report_table(FILE *f, const kvq_ppl_report *r, kvq_err *err);

/* Findings a reader of the numbers must see, one line each to f (when not
 * NULL) after prefix; returns their count. (1) Values saturated by the
 * storage format (quant.h n_clipped: fp16 |x| >= 65520, which a real fp16
 * cache stores as Inf; fp8 saturation), with their share of the cache. (2) A
 * realised sparse-outlier fraction of the keys above KVQ_OUTLIER_WARN_RATIO x
 * the scheme's nominal one (key thresholds from other data or another model;
 * values' outliers are chosen per token, a fixed count). The table prints them as "- warning: " notes; kveval
 * also on stderr. */
#define KVQ_OUTLIER_WARN_RATIO 2.0
size_t kvq_ppl_report_warnings(FILE *f, const kvq_ppl_report *r, const char *prefix);

/* The same numbers plus every protocol detail (window offsets, per-window
 * NLL, quantizer counters, timings, paired differences and their se, the KLD
 * statistics and per-window means; null for what does not apply or is not
 * finite) as JSON (cJSON), written to "<path>.tmp<pid>" and renamed over
 * path: path is either the complete report or untouched. A size the bits
 * accounting cannot give for a shape is null (with bits_error), never a
 * failure. Errors: KVQ_EIO naming the path, KVQ_ENOMEM. */
kvq_status kvq_ppl_report_json(const char *path, const kvq_ppl_report *r, kvq_err *err);

/* The head of kveval's per-task JSON reports (docs/JSON.md; passkey.c, decode_eval.c): schema {name,
 * version}, tool "kveval", version, task, model {path, ctx_len}. Returns the root (the caller deletes it). */
struct cJSON;
struct cJSON *kvq_kveval_json_head(const char *schema, int version, const char *task, const kvq_model *m);

#endif
