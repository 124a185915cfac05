/* kvcalib — turn a kvdump file into quantization tables (nuqX datatypes,
 * per-channel pre-RoPE key thresholds, outlier thresholds; int / int-pc /
 * KIVI settings) in one calibration artifact (kernels/schemes/ARTIFACT.md).
 *
 *   kvcalib DUMP --method M --bits B --out FILE [options]   calibrate (calib/calibrate.h)
 *   kvcalib DUMP --method fp8 --out FILE [--scale tensor|head] [--percentile P]
 *           [--fp8-format e4m3|e5m2] [--export-vllm FILE]     FP8 cache scales
 *   kvcalib export-vllm ARTIFACT --out FILE [--form vllm|compressed-tensors|modelopt] [--config JSON] [--force]
 *                                                             k/v_scale safetensors (+ config.json fragment)
 *   kvcalib --inspect FILE                                   print an artifact
 *   kvcalib intactkv --model M --base A --prefix P --out F  IntactKV prefix (calib/intactkv.h)
 *
 * Exit status: 0 success, 1 the calibration or I/O failed (message on
 * stderr, nothing written), 2 bad command line. */
#include <errno.h>
#include <stddef.h>
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "artifact.h"
#include "calibrate.h"
#include "family.h"
#include "identity.h"
#include "intactkv.h"
#include "model.h"
#include "scheme.h"
#include "text.h"
#include "tokenizer.h"
#include "cli.h"
#include "outfile.h"
#include "cuda_info.h"
#include "device.h"
#include "progress.h"

#define PROG "kvcalib"
#define EXIT_USAGE 2

static const char SUMMARY_HEAD[] =
    "Turn a kvdump HDF5 file into the tables a quantized KV cache needs, written as one\n"
    "calibration artifact (safetensors; kernels/schemes/ARTIFACT.md).\n"
    "\n"
    "  kvcalib DUMP --method M --bits B --out FILE [options]\n"
    "  kvcalib DUMP --method lowrank --group G --out FILE [--keys pre-rope] [--fisher]   low-rank KV heads (no --bits)\n"
    "  kvcalib DUMP --method fp8 --out FILE [--scale tensor|head] [--percentile P] [--export-vllm FILE]\n"
    "  kvcalib DUMP --method nvfp4 --out FILE [--percentile P]   NVFP4 per-tensor scales (amax / (448 * 6))\n"
    "  kvcalib export-vllm ARTIFACT --out FILE [--form F] [--config JSON] [--force]   k/v_scale tensors for a checkpoint\n"
    "  kvcalib --inspect FILE         print an artifact's summary\n"
    "  kvcalib intactkv ...           IntactKV prefix of a base artifact (kvcalib intactkv --help)\n"
    "\n"
    "Methods (--bits is required, except where the format fixes it (fp8, nvfp4) or the tables do not depend on it\n"
    "(lowrank); the other options' defaults where -1 is given; docs/fp8-vllm.md for fp8, docs/KVEVAL.md for nvfp4):\n";

/* The --help summary: the head above, then one line per method of the registry (family.h) with its
 * defaults, so that the list and the defaults cannot drift from the code. */
static const char *summary_text(char *buf, size_t n)
{
    size_t len = (size_t)snprintf(buf, n, "%s", SUMMARY_HEAD), nf;
    const kvq_family *const *f = kvq_families(&nf);
    for (size_t i = 0; i < nf && len < n; i++) {
        const kvq_family_calib *c = f[i]->calib;
        if (!c) continue;
        char extra[160] = "";
        size_t el = 0;
        if (c->group_opt) el += (size_t)snprintf(extra + el, sizeof extra - el, " --group %zu", c->group);
        if (c->residual_opt) el += (size_t)snprintf(extra + el, sizeof extra - el, " --residual %zu", c->residual);
        if (c->fp8_opt) el += (size_t)snprintf(extra + el, sizeof extra - el, " --percentile %g", c->fp8_percentile);
        for (int j = 0; f[i]->artifact && f[i]->artifact->params && j < KVQ_ARTIFACT_X && f[i]->artifact->params[j] &&
                        el < sizeof extra;
             j++)
            el += (size_t)snprintf(extra + el, sizeof extra - el, " --param %s=%g", f[i]->artifact->params[j], c->x[j]);
        if (c->fisher_opt && el < sizeof extra)
            el += (size_t)snprintf(extra + el, sizeof extra - el, " %s", c->fisher ? "Fisher-weighted" : "unweighted");
        char bits[32] = "";
        if (c->fp8_opt) snprintf(bits, sizeof bits, "--bits %d ", c->bits); /* the format's; elsewhere --bits is required */
        len += (size_t)snprintf(buf + len, n - len, "  %-7s %s\n          defaults: %s--outliers %g --sink %zu --keys %s%s\n",
                                f[i]->name, f[i]->summary, bits, c->outliers, c->sink, c->post_rope ? "post-rope" : "pre-rope",
                                extra);
    }
    return buf;
}

typedef struct {
    const char *method, *keys, *fit, *out, *inspect, *scale, *fp8_format, *export_vllm, *rotate;
    long bits, sink, group, residual, bits_ctx, threads, seed;
    double outliers, percentile;
    bool no_fisher, fisher, per_head, force, quiet, version;
    kvq_strlist params;
} cli_args;

static int option_table(cli_args *a, kvq_opt *t, const char *methods)
{
    const kvq_opt tab[] = {
        {"method", 0, KVQ_OPT_CHOICE, &a->method, "M", "quantization scheme (the methods below)", methods, 0, 0, false},
        {"bits", 'b', KVQ_OPT_INT, &a->bits, "B", "code bits of keys and values, 1..8 (required to calibrate)", NULL, 1, 8,
         false},
        {"outliers", 0, KVQ_OPT_FLOAT, &a->outliers, "F",
         "dense-and-sparse outlier fraction in [0, 0.5), both tails (-1: method default)", NULL, 0, 0, false},
        {"sink", 0, KVQ_OPT_INT, &a->sink, "N",
         "attention-sink tokens per sample excluded from calibration, kept exact (-1: method default)", NULL, -1, 1e9,
         false},
        {"keys", 0, KVQ_OPT_CHOICE, &a->keys, "POS",
         "keys before or after RoPE (default: the method's, listed below: pre-rope for nuq and cq)", "pre-rope|post-rope", 0, 0, false},
        {"no-fisher", 0, KVQ_OPT_FLAG, &a->no_fisher, NULL, "nuq, cq: plain (unweighted) k-means instead of Fisher weights",
         NULL, 0, 0, false},
        {"fisher", 0, KVQ_OPT_FLAG, &a->fisher, NULL,
         "lowrank: weight each calibration token by its Fisher information (default: plain second moment, an SVD of the cache)", NULL, 0, 0,
         false},
        {"per-head", 0, KVQ_OPT_FLAG, &a->per_head, NULL, "nuq: one datatype per KV head instead of per layer", NULL, 0,
         0, false},
        {"fit", 0, KVQ_OPT_CHOICE, &a->fit, "HOW",
         "nuq datatype fit: Lloyd's weighted k-means, the exact 1-D optimum, or the better of both", "auto|lloyd|exact", 0,
         0, false},
        {"rotate", 0, KVQ_OPT_STRING, &a->rotate, "ROT",
         "fit on K / V rotated as a scheme's +hadamard / +rht[<seed>] modifier does: hadamard, rht or rht<seed> "
         "(methods with fitted tables; recorded as kvq.rotation, bound only by a spec with that modifier)",
         NULL, 0, 0, false},
        {"group", 0, KVQ_OPT_INT, &a->group, "G", "int/int-pc: channels per token group; kivi: group size; skvq: kv_dim / G channel clusters (-1: default)",
         NULL, -1, 1e9, false},
        {"residual", 0, KVQ_OPT_INT, &a->residual, "R", "kivi: full-precision recent tokens (-1: default)", NULL, -1, 1e9,
         false},
        {"scale", 0, KVQ_OPT_CHOICE, &a->scale, "GRAN", "fp8: one scale per layer tensor or per KV head (default tensor; nvfp4: tensor only)",
         "tensor|head", 0, 0, false},
        {"percentile", 0, KVQ_OPT_FLOAT, &a->percentile, "P",
         "fp8, nvfp4: map this percentile of |x| to the format's max (default 100 = absmax)", NULL, 0, 0, false},
        {"fp8-format", 0, KVQ_OPT_CHOICE, &a->fp8_format, "FMT", "fp8: scales for E4M3FN (vLLM \"fp8\", default) or E5M2",
         "e4m3|e5m2", 0, 0, false},
        {"export-vllm", 0, KVQ_OPT_STRING, &a->export_vllm, "FILE",
         "fp8: also write model.layers.<i>.self_attn.k_scale/v_scale (safetensors) for vLLM", NULL, 0, 0, false},
        {"param", 0, KVQ_OPT_LIST, &a->params, "NAME=VALUE",
         "a method's own parameter (repeatable; the methods' parameters and defaults are listed below)", NULL, 0, 0, false},
        {"bits-ctx", 0, KVQ_OPT_INT, &a->bits_ctx, "N", "context length of the bits accounting (0: the dump's seq_len)",
         NULL, 0, 1e9, false},
        {"seed", 0, KVQ_OPT_INT, &a->seed, "S", "nuq: k-means++ seed", NULL, 0, 9e15, false},
        kvq_cli_common(KVQ_COPT_THREADS, &a->threads, false),
        {"out", 'o', KVQ_OPT_STRING, &a->out, "FILE", "artifact to write (required to calibrate)", NULL, 0, 0, false},
        {"force", 'f', KVQ_OPT_FLAG, &a->force, NULL, "replace an existing --out file", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_QUIET, &a->quiet, false),
        {"inspect", 0, KVQ_OPT_STRING, &a->inspect, "FILE", "print a readable summary of an artifact and exit", NULL, 0,
         0, false},
        kvq_cli_common(KVQ_COPT_VERSION, &a->version, false),
    };
    memcpy(t, tab, sizeof tab);
    return (int)(sizeof tab / sizeof *tab);
}

/* ---- progress ------------------------------------------------------------------ */

typedef struct {
    double t0;
    bool quiet;
    bool outliers; /* the fit keeps sparse outliers (--outliers > 0): only then is their share printed */
} progress_ctx;

static const char *chosen_name(uint8_t c)
{
    return c == KVQ_FIT_CHOSEN_LLOYD ? "lloyd" : c == KVQ_FIT_CHOSEN_EXACT ? "exact" : "none";
}

static void on_table(void *vctx, int done, int total, int layer, char kv, const kvq_kv_table *t, double seconds)
{
    progress_ctx *c = vctx;
    if (c->quiet) return;
    fprintf(stderr, "%s: [%d/%d] layer %d %c: %.2f s", PROG, done, total, layer, kv == 'k' ? 'K' : 'V', seconds);
    if (t->n_elems && (c->outliers || t->n_outliers))
        fprintf(stderr, ", outliers %.3f%%", 100.0 * (double)t->n_outliers / (double)t->n_elems);
    for (size_t h = 0; h < t->n_tables; h++) {
        if (t->n_tables > 1) fprintf(stderr, "\n    head %zu:", h);
        fprintf(stderr, ", objective lloyd %.6g exact %.6g -> %s", t->obj_lloyd[h], t->obj_exact[h],
                chosen_name(t->chosen[h]));
    }
    fprintf(stderr, " (%.1f s elapsed)\n", kvq_now() - c->t0);
}

static void print_summary(FILE *f, const char *out, const kvq_artifact *a, double seconds, int threads)
{
    const kvq_artifact_params *p = &a->p;
    fprintf(f, "%s: wrote %s: %s K%d/V%d", PROG, out, p->method->name, p->k_bits, p->v_bits);
    if (p->outlier_frac > 0) fprintf(f, ", outliers %.4g%%", 100 * p->outlier_frac);
    fprintf(f, ", sink %zu, %s keys; %.4f / %.4f bits per K / V element at ctx %zu\n", p->n_sink,
            p->post_rope ? "post-RoPE" : "pre-RoPE", p->bits_k, p->bits_v, p->bits_ctx);
    double tl = 0, te = 0, tc = 0;
    size_t n = 0, exact = 0;
    uint64_t out_n = 0, out_e = 0;
    for (size_t i = 0; i < p->n_layers; i++)
        for (int w = 0; w < 2; w++) {
            const kvq_kv_table *t = w ? (a->v ? &a->v[i] : NULL) : (a->k ? &a->k[i] : NULL);
            if (!t) continue;
            if (w == 0) { out_n += t->n_outliers; out_e += t->n_elems; }
            for (size_t h = 0; h < t->n_tables; h++) {
                if (t->obj_lloyd[h] > 0) tl += t->obj_lloyd[h];
                if (t->obj_exact[h] > 0) te += t->obj_exact[h];
                tc += t->obj_exact[h] >= 0 && (t->obj_lloyd[h] < 0 || t->obj_exact[h] <= t->obj_lloyd[h]) ? t->obj_exact[h]
                                                                                                          : t->obj_lloyd[h];
                exact += t->chosen[h] == KVQ_FIT_CHOSEN_EXACT;
                n++;
            }
        }
    if (out_e) fprintf(f, "%s: key outliers realised %.4f%% of calibration elements\n", PROG, 100.0 * (double)out_n / (double)out_e);
    if (n) {
        fprintf(f, "%s: datatype objectives summed over %zu tables: lloyd %.6g, exact %.6g", PROG, n, tl, te);
        if (tl > 0 && te > 0) fprintf(f, " (exact/lloyd %.5f)", te / tl);
        fprintf(f, "; exact chosen for %zu\n", exact);
    }
    fprintf(f, "%s: calibration time %.2f s (%d thread%s)\n", PROG, seconds, threads, threads == 1 ? "" : "s");
}

/* The dense-and-sparse key thresholds are per-channel percentiles over the calibration
 * tokens: with too few of them each channel's extremes fall outside its thresholds
 * whatever the fraction (4 tokens at --outliers 0.01 made 50% of the keys outliers). */
/* outliers and elements of n_layers tables, summed */
static void sum_counts(const kvq_kv_table *t, size_t n_layers, uint64_t *n, uint64_t *e)
{
    *n = *e = 0;
    for (size_t i = 0; i < n_layers; i++) {
        *n += t[i].n_outliers;
        *e += t[i].n_elems;
    }
}

static void warn_outlier_share(const kvq_artifact *a)
{
    const kvq_artifact_params *p = &a->p;
    if (!p->method->artifact->k_thresholds || !(p->outlier_frac > 0) || !a->k) return;
    uint64_t n, e;
    sum_counts(a->k, p->n_layers, &n, &e);
    const size_t kv_dim = p->n_kv_heads * p->head_dim;
    if (e && kv_dim && (double)n > 2.0 * p->outlier_frac * (double)e)
        fprintf(stderr,
                "%s: warning: key outliers realised %.4g%% of calibration elements against --outliers %.4g%%: %" PRIu64
                " calibration tokens per channel are too few for that fraction (each channel's extremes fall outside its "
                "percentile thresholds); calibrate on more tokens (kvdump -n, -L)\n",
                PROG, 100.0 * (double)n / (double)e, 100.0 * p->outlier_frac, e / p->n_layers / kv_dim);
    /* values: outliers per token, at least one per side of each token's kv_dim values (16-dim heads: 2/64) */
    if (!a->v || !kv_dim) return;
    sum_counts(a->v, p->n_layers, &n, &e);
    if (e && (double)n > 2.0 * p->outlier_frac * (double)e)
        fprintf(stderr,
                "%s: warning: value outliers realised %.4g%% of calibration elements against --outliers %.4g%%: each token "
                "keeps at least one outlier per side of its %zu values (kv_dim), %.4g%% at the least\n",
                PROG, 100.0 * (double)n / (double)e, 100.0 * p->outlier_frac, kv_dim, 200.0 / (double)kv_dim);
}

/* ---- subcommands ---------------------------------------------------------------- */

/* ---- kvcalib intactkv (issue 9) ---------------------------------------------------- */

static const char IKV_SUMMARY[] =
    "Compute an IntactKV prefix (the K/V cache of the first tokens, from the unquantized model;\n"
    "Liu et al. 2024) and write a new artifact = the base artifact's tables + the prefix\n"
    "(kernels/schemes/ARTIFACT.md, \"IntactKV prefix\"). kveval uses it with the +intactkv modifier.\n"
    "\n"
    "  kvcalib intactkv --model M --base ARTIFACT --prefix bos|TEXT [--special] --out FILE\n"
    "  kvcalib intactkv ... --train --text FILE [--samples N --seq-len L --steps S|--epochs E ...]\n"
    "\n"
    "--prefix bos = the tokenizer's BOS token alone; any other value is text (with --special,\n"
    "control tokens such as <|im_start|> are recognised). --train calibrates the prefix K/V\n"
    "(IntactKV_[P]+Cal): Adam on 1/2 sum over layers of the mean squared difference between the\n"
    "layer outputs with the full-precision cache and with the base scheme's quantized cache\n"
    "(straight-through estimator), on calibration windows sampled as KVQuant does.\n"
    "--text (the calibration text, e.g. wikitext-2 wiki.train.tokens), --format and --device\n"
    "apply to --train only (the exactness mode on a GPU).\n"
    "Training defaults: the IntactKV reference (intactkv_train.py, train.sh) uses 128 ShareGPT samples\n"
    "of <= 1024 tokens, 16 per step, 160 steps (20 epochs), lr 2e-4 (constant), clip 0.3, AdamW\n"
    "without weight decay. Kept here: lr 2e-4, clip 0.3, Adam (0.9, 0.999, 1e-8). Scaled down for a\n"
    "2-core CPU (one window of 256 tokens costs ~3 forwards of the default model): 16 windows x 256\n"
    "tokens, 4 per step, 4 epochs = 16 steps. With 10x fewer steps each parameter moves at most\n"
    "steps x lr; --lr 2e-4*160/steps keeps the reference's budget (e.g. --lr 2e-3 for 16 steps).";

typedef struct {
    const char *model, *tokenizer, *base, *prefix, *out, *text, *format, *scheme, *loss_csv, *device;
    bool special, add_bos, force, quiet, allow_mismatch, train;
    long samples, seq_len, steps, epochs, accum, seed, cache_mib;
    double lr, clip, beta1, beta2, eps;
} ikv_args;

static int ikv_fail(const kvq_err *e, int code)
{
    fprintf(stderr, "%s intactkv: %s\n", PROG, e->msg);
    return code;
}

typedef struct {
    bool quiet;
    FILE *csv;
} step_ctx;

static void on_step(void *vctx, size_t step, size_t steps, double loss, double gnorm, double seconds)
{
    step_ctx *c = vctx;
    if (c->csv) fprintf(c->csv, "%zu,%.9g,%.9g,%.3f\n", step, loss, gnorm, seconds);
    if (c->quiet) return;
    double rate = seconds > 0 ? (double)step / seconds : 0, eta = rate > 0 ? (double)(steps - step) / rate : 0;
    fprintf(stderr, "%s intactkv: step %zu/%zu loss %.6g |grad| %.4g  %.3f steps/s, %.1f s elapsed, ETA %.1f s\n", PROG, step,
            steps, loss, gnorm, rate, seconds, eta);
}

/* The kveval spec string of the base artifact's scheme (what --train quantizes
 * the window with when --scheme is not given): the family's canonical name. */
static void base_spec(const kvq_artifact_params *p, char *buf, size_t n) { kvq_artifact_scheme_spec(p, buf, n); }

/* --train: windows from --text, the base scheme's transform, Adam (calib/intactkv.h). */
static kvq_status train_prefix(const ikv_args *a, const kvq_model *m, const kvq_tokenizer *tok, kvq_artifact *art,
                               const char *model_fp, step_ctx *sc, kvq_err *e)
{
    char spec[KVQ_SPEC_MAX];
    if (a->scheme) snprintf(spec, sizeof spec, "%s", a->scheme);
    else base_spec(&art->p, spec, sizeof spec);
    kvq_artifact_set set;
    const char *paths[1] = {a->base};
    KVQ_TRY(kvq_artifact_set_load(&set, paths, 1, m, model_fp, a->allow_mismatch, NULL, e));
    kvq_text txt = {0};
    kvq_windows win = {0};
    double *curve = NULL;
    FILE *csv = NULL;
    kvq_outfile csv_out = {0};
    kvq_eval_scheme sch;
    kvq_scheme_spec sp;
    kvq_status s = kvq_scheme_parse(spec, &sp, e);
    if (!s && sp.intactkv) s = kvq_fail(e, KVQ_EINVAL, "--scheme %s: +intactkv is what is being trained; give the base scheme only", spec);
    if (!s) s = kvq_eval_scheme_bind(&sp, &set, &m->hp, &sch, e);
    if (s) {
        kvq_err_prefix(e, "--train: scheme of the window");
        goto done;
    }
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &sch, &hk);
    kvq_text_format fmt = a->format ? (!strcmp(a->format, "raw") ? KVQ_TEXT_RAW : !strcmp(a->format, "jsonl") ? KVQ_TEXT_JSONL
                                                                                                           : KVQ_TEXT_WIKITEXT_TOKENS)
                                    : kvq_text_format_from_path(a->text);
    if ((s = kvq_text_read(a->text, fmt, KVQ_EOL_TO_LF, &txt, e))) goto done;
    if (txt.bad_bytes && !a->quiet)
        fprintf(stderr, "%s intactkv: warning: %s: %zu byte%s NUL or invalid UTF-8 (the first at offset %llu); tokenised as byte tokens\n",
                PROG, a->text, txt.bad_bytes, txt.bad_bytes == 1 ? " is" : "s are", (unsigned long long)txt.first_bad);
    if ((s = kvq_calib_windows(&txt, tok, (size_t)a->samples, (size_t)a->seq_len, (uint64_t)a->seed, KVQ_BOS_MODEL, &win, e)))
        goto done;
    kvq_intactkv_train_opts o = kvq_intactkv_train_defaults();
    o.accum = (size_t)a->accum;
    o.steps = a->steps > 0 ? (size_t)a->steps : ((size_t)a->epochs * (size_t)a->samples + o.accum - 1) / o.accum;
    o.lr = a->lr;
    o.beta1 = a->beta1;
    o.beta2 = a->beta2;
    o.eps = a->eps;
    o.clip = a->clip;
    o.seed = (uint64_t)a->seed;
    o.target_cache_mib = (size_t)a->cache_mib;
    o.on_step = on_step;
    o.on_step_ctx = sc;
    char dev_desc[256] = "";
    o.device = a->device ? a->device : "auto";
    o.device_desc = dev_desc;
    o.device_desc_len = sizeof dev_desc;
    curve = malloc(o.steps * sizeof *curve);
    if (!curve) {
        s = kvq_fail(e, KVQ_ENOMEM, "out of memory");
        goto done;
    }
    if (a->loss_csv) { /* under a temporary name until training ends (it was truncated in place) */
        if ((s = kvq_outfile_open(&csv_out, a->loss_csv, e))) {
            kvq_err_prefix(e, "--loss-csv");
            goto done;
        }
        csv = csv_out.f;
        fprintf(csv, "step,loss,grad_norm,seconds\n");
        sc->csv = csv;
    }
    if (!a->quiet)
        fprintf(stderr,
                "%s intactkv: training %zu x %zu prefix K/V parameters against %s: %zu windows x %zu tokens, %zu steps x %zu "
                "windows (%.3g epochs), lr %g, clip %g\n",
                PROG, (size_t)2 * m->hp.n_layers, art->prefix->P * (size_t)kvq_kv_dim(&m->hp), sch.name, win.n_windows, win.ctx,
                o.steps, o.accum, (double)(o.steps * o.accum) / (double)win.n_windows, o.lr, o.clip);
    double t0 = kvq_now(), lb, la;
    s = kvq_intactkv_train(m, art->prefix, &hk, win.tokens, win.n_windows, win.ctx, &o, curve, &lb, &la, e);
    if (s) goto done;
    if (!a->quiet) fprintf(stderr, "%s intactkv: trained on %s\n", PROG, dev_desc);
    kvq_artifact_prefix *px = art->prefix;
    px->trained = true;
    px->loss_curve = curve;
    px->n_loss = o.steps;
    curve = NULL;
    kvq_prefix_training *tr = &px->train;
    snprintf(tr->scheme, sizeof tr->scheme, "%s", sch.name);
    tr->steps = o.steps;
    tr->accum = o.accum;
    tr->samples = win.n_windows;
    tr->seq_len = win.ctx;
    tr->lr = o.lr;
    tr->beta1 = o.beta1;
    tr->beta2 = o.beta2;
    tr->eps = o.eps;
    tr->clip = o.clip;
    tr->seed = o.seed;
    tr->loss_before = lb;
    tr->loss_after = la;
    tr->seconds = kvq_now() - t0;
    snprintf(tr->text_sha256, sizeof tr->text_sha256, "%s", txt.file_sha256);
    if (!a->quiet)
        fprintf(stderr, "%s intactkv: training loss over all %zu windows %.6g -> %.6g (%+.1f%%), %.1f s (%.2f s per step)\n", PROG,
                win.n_windows, lb, la, lb > 0 ? 100 * (la - lb) / lb : 0, tr->seconds, tr->seconds / (double)o.steps);
done:
    if (csv && !s && (s = kvq_outfile_commit(&csv_out, e))) kvq_err_prefix(e, "--loss-csv");
    else if (csv && s) kvq_outfile_abort(&csv_out);
    sc->csv = NULL;
    free(curve);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_artifact_set_free(&set);
    return s;
}

static int cmd_intactkv(int argc, char **argv)
{
    kvq_intactkv_train_opts d = kvq_intactkv_train_defaults();
    ikv_args a = {.samples = 16, .seq_len = 256, .steps = 0, .epochs = 4, .accum = 4, .seed = (long)d.seed,
                  .cache_mib = (long)d.target_cache_mib, .lr = d.lr, .clip = d.clip, .beta1 = d.beta1, .beta2 = d.beta2,
                  .eps = d.eps};
    kvq_opt tab[] = {
        kvq_cli_common(KVQ_COPT_MODEL, &a.model, true),
        kvq_cli_common(KVQ_COPT_TOKENIZER, &a.tokenizer, false),
        {"base", 0, KVQ_OPT_STRING, &a.base, "FILE", "base artifact (any scheme) whose tables the output keeps", NULL, 0, 0, true},
        {"prefix", 0, KVQ_OPT_STRING, &a.prefix, "P", "'bos' (the BOS token alone) or the prefix text", NULL, 0, 0, true},
        {"special", 0, KVQ_OPT_FLAG, &a.special, NULL, "recognise special tokens (e.g. <|im_start|>) in the prefix text", NULL, 0,
         0, false},
        {"add-bos", 0, KVQ_OPT_FLAG, &a.add_bos, NULL, "prepend the BOS token to the prefix text", NULL, 0, 0, false},
        {"out", 'o', KVQ_OPT_STRING, &a.out, "FILE", "artifact to write", NULL, 0, 0, true},
        {"force", 'f', KVQ_OPT_FLAG, &a.force, NULL, "replace an existing --out file", NULL, 0, 0, false},
        {"allow-model-mismatch", 0, KVQ_OPT_FLAG, &a.allow_mismatch, NULL,
         "accept a base artifact whose model fingerprint differs (warning instead of error)", NULL, 0, 0, false},
        {"train", 0, KVQ_OPT_FLAG, &a.train, NULL, "calibrate the prefix K/V against the base scheme (needs --text)", NULL, 0, 0,
         false},
        kvq_cli_common(KVQ_COPT_TEXT, &a.text, false),
        kvq_cli_common(KVQ_COPT_FORMAT, &a.format, false),
        {"scheme", 's', KVQ_OPT_STRING, &a.scheme, "SPEC",
         "--train: kveval scheme quantizing the window (default: the base artifact's own)", NULL, 0, 0, false},
        {"samples", 'n', KVQ_OPT_INT, &a.samples, "N", "--train: calibration windows (reference: 128)", NULL, 1, 1e6, false},
        {"seq-len", 'L', KVQ_OPT_INT, &a.seq_len, "L", "--train: tokens per window (reference: <= 1024)", NULL, 2, 1 << 20, false},
        {"epochs", 'E', KVQ_OPT_INT, &a.epochs, "E", "--train: passes over the windows (reference: 20); steps = E*N/accum",
         NULL, 1, 1e6, false},
        {"steps", 0, KVQ_OPT_INT, &a.steps, "S", "--train: optimizer steps (overrides --epochs when > 0; reference: 160)", NULL, 0,
         1e9, false},
        {"accum", 0, KVQ_OPT_INT, &a.accum, "A", "--train: windows per optimizer step (reference: 16)", NULL, 1, 1e6, false},
        {"lr", 0, KVQ_OPT_FLOAT, &a.lr, "LR", "--train: Adam learning rate (reference: 2e-4)", NULL, 0, 0, false},
        {"clip", 0, KVQ_OPT_FLOAT, &a.clip, "C", "--train: global gradient-norm clipping, 0 = off (reference: 0.3)", NULL, 0, 0,
         false},
        {"beta1", 0, KVQ_OPT_FLOAT, &a.beta1, "B", "--train: Adam beta1, in [0, 1)", NULL, 0, 0, false},
        {"beta2", 0, KVQ_OPT_FLOAT, &a.beta2, "B", "--train: Adam beta2, in [0, 1)", NULL, 0, 0, false},
        {"eps", 0, KVQ_OPT_FLOAT, &a.eps, "E", "--train: Adam epsilon", NULL, 0, 0, false},
        {"seed", 0, KVQ_OPT_INT, &a.seed, "S", "--train: window sampling and shuffling seed (reference data seed: 42)", NULL, 0,
         2147483647.0, false},
        {"cache-mib", 0, KVQ_OPT_INT, &a.cache_mib, "MiB",
         "--train: keep the full-precision targets of all windows in memory up to this size (else recompute)", NULL, 0, 1 << 20,
         false},
        {"loss-csv", 0, KVQ_OPT_STRING, &a.loss_csv, "FILE", "--train: also write step,loss,grad_norm,seconds per step", NULL, 0,
         0, false},
        kvq_cli_common(KVQ_COPT_DEVICE, &a.device, false),
        kvq_cli_common(KVQ_COPT_QUIET, &a.quiet, false),
    };
    int n_tab = (int)(sizeof tab / sizeof *tab);
    kvq_err e = {0};
    bool help = false;
    int given_at[sizeof tab / sizeof *tab];
    if (kvq_cli_parse_given(PROG " intactkv", IKV_SUMMARY, tab, n_tab, argc, argv, NULL, &help, given_at, &e))
        return ikv_fail(&e, EXIT_USAGE);
    if (help) return 0;
    if (a.train && !a.text) {
        fprintf(stderr, "%s intactkv: --train needs --text FILE (calibration text)\n", PROG);
        return EXIT_USAGE;
    }
    if (!a.train) /* every "--train:" option (and the shared --text, --format, --device, which only --train uses) given
                   * without --train is a usage error, not silently ignored */
        for (int k = 0; k < n_tab; k++)
            if (given_at[k] && (!strncmp(tab[k].help, "--train:", 8) || !strcmp(tab[k].name, "text") ||
                                !strcmp(tab[k].name, "format") || !strcmp(tab[k].name, "device"))) {
                const char *w = argv[given_at[k]];
                fprintf(stderr, "%s intactkv: %.*s applies to --train only (the --train: options of --help)\n", PROG,
                        (int)strcspn(w, "="), w);
                return EXIT_USAGE;
            }
    if (a.device) {
        kvq_device dv;
        if (kvq_device_parse(a.device, &dv, NULL, &e)) return ikv_fail(&e, e.code == KVQ_EINVAL ? EXIT_USAGE : 1);
    }
    { /* each named with its value (one message listed every rule) */
        const struct { const char *opt, *want; double v; bool ok; } chk[] = {
            {"--lr", "> 0", a.lr, a.lr > 0},          {"--eps", "> 0", a.eps, a.eps > 0},
            {"--clip", ">= 0", a.clip, a.clip >= 0},  {"--beta1", "in [0, 1)", a.beta1, a.beta1 >= 0 && a.beta1 < 1},
            {"--beta2", "in [0, 1)", a.beta2, a.beta2 >= 0 && a.beta2 < 1},
        };
        for (size_t k = 0; k < sizeof chk / sizeof *chk; k++)
            if (!chk[k].ok) {
                fprintf(stderr, "%s intactkv: %s: expected %s, found %g\n", PROG, chk[k].opt, chk[k].want, chk[k].v);
                return EXIT_USAGE;
            }
    }
    if (a.add_bos && !strcmp(a.prefix, "bos")) { /* the prefix is the BOS token already: the flag did nothing */
        fprintf(stderr, "%s intactkv: --add-bos: --prefix bos is the BOS token alone already\n", PROG);
        return EXIT_USAGE;
    }
    {
        const kvq_cli_file outs[2] = {{"--out", a.out}, {"--loss-csv", a.loss_csv}},
                           ins[4] = {{"--model", a.model}, {"--tokenizer", a.tokenizer}, {"--base", a.base}, {"--text", a.text}};
        if (kvq_cli_check_outputs(outs, 2, ins, 4, &e) || kvq_cli_check_renamed_outputs(outs, 1, &e)) return ikv_fail(&e, EXIT_USAGE);
    }
    if (!a.force && access(a.out, F_OK) == 0) {
        fprintf(stderr, "%s intactkv: %s: already exists; not overwritten (use --force to replace it)\n", PROG, a.out);
        return 1;
    }
    double t0 = kvq_now();
    int rc = 1;
    kvq_model m = {0};
    kvq_tokenizer *tok = NULL;
    kvq_artifact art = {0};
    int32_t *ids = NULL;
    size_t P = 0;
    char fp[65];
    if (kvq_model_load(a.model, &m, &e)) goto out;
    if (kvq_tokenizer_for_model(a.model, a.tokenizer, &tok, &e)) goto out;
    if (kvq_tokenizer_check_vocab(tok, m.hp.vocab_size, a.tokenizer ? a.tokenizer : a.model, &e)) goto out;
    if (kvq_artifact_read(a.base, &art, &e)) {
        kvq_err_prefix(&e, "--base %s", a.base);
        goto out;
    }
    if (kvq_identity_model(&m, fp, &e)) goto out;
    if (kvq_intactkv_check_base(&art, a.base, &m, fp, a.allow_mismatch, stderr, &e)) goto out;
    size_t max_P = (size_t)m.hp.ctx_len - (a.train ? (size_t)a.seq_len : 1);
    if (a.train && (size_t)a.seq_len >= (size_t)m.hp.ctx_len) {
        kvq_fail(&e, KVQ_EINVAL, "--seq-len %ld leaves no room for a prefix in the model's context of %d", a.seq_len, m.hp.ctx_len);
        goto out;
    }
    if (kvq_intactkv_tokenize(tok, a.prefix, a.special, a.add_bos, m.hp.vocab_size, max_P, &ids, &P, &e)) goto out;
    if (a.special && !a.quiet) { /* --special that matched nothing is named, not silently ignored */
        int32_t *plain = NULL;
        size_t Pp = 0;
        kvq_err e2 = {0};
        if (kvq_intactkv_tokenize(tok, a.prefix, false, a.add_bos, m.hp.vocab_size, max_P, &plain, &Pp, &e2) == KVQ_OK &&
            Pp == P && !memcmp(plain, ids, P * sizeof *ids))
            fprintf(stderr, "%s intactkv: warning: --special changed nothing: the prefix text holds none of the tokenizer's "
                            "special tokens\n", PROG);
        free(plain);
    }
    if (art.prefix) {
        if (!a.quiet)
            fprintf(stderr, "%s intactkv: --base %s already holds a prefix of %zu token%s; replacing it\n", PROG, a.base, art.prefix->P,
                    art.prefix->P == 1 ? "" : "s");
        kvq_artifact_prefix_free(art.prefix);
        free(art.prefix);
        art.prefix = NULL;
    }
    art.prefix = calloc(1, sizeof *art.prefix);
    if (!art.prefix) {
        kvq_fail(&e, KVQ_ENOMEM, "out of memory");
        goto out;
    }
    if (kvq_intactkv_compute(&m, ids, P, a.prefix, a.special, art.prefix, &e)) goto out;
    if (!a.quiet) {
        fprintf(stderr, "%s intactkv: prefix \"%.80s\" = %zu token%s:", PROG, a.prefix, P, P == 1 ? "" : "s");
        for (size_t i = 0; i < P && i < 32; i++) {
            size_t len;
            const char *t = kvq_tokenizer_token_text(tok, ids[i], &len);
            fprintf(stderr, " %d '", ids[i]);
            for (size_t j = 0; t && j < len && j < 24; j++) {
                unsigned char ch = (unsigned char)t[j];
                if (ch == '\n') fputs("\\n", stderr);
                else if (ch < 0x20 || ch == 0x7f) fprintf(stderr, "\\x%02x", ch);
                else fputc(ch, stderr);
            }
            fputc('\'', stderr);
        }
        fprintf(stderr, "%s\n", P > 32 ? " ..." : "");
    }
    if (a.train) {
        step_ctx sc = {.quiet = a.quiet};
        if (train_prefix(&a, &m, tok, &art, fp, &sc, &e)) goto out;
    }
    if (kvq_intactkv_write(a.out, a.force, &art, &e)) goto out;
    if (!a.quiet) {
        printf("%s intactkv: wrote %s: %s base (%s) + %s prefix of %zu token%s", PROG, a.out, art.p.method->name, a.base,
               art.prefix->trained ? "trained" : "untrained", P, P == 1 ? "" : "s");
        if (art.prefix->trained)
            printf("; training loss %.6g -> %.6g in %.1f s", art.prefix->train.loss_before, art.prefix->train.loss_after,
                   art.prefix->train.seconds);
        printf(" (total %.1f s)\n", kvq_now() - t0);
    }
    rc = 0;
out:
    if (rc) ikv_fail(&e, 1);
    free(ids);
    kvq_artifact_free(&art);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return rc;
}

/* kvcalib export-vllm ARTIFACT --out FILE [--force] */
static int cmd_export_vllm(int argc, char **argv)
{
    const char *out = NULL;
    bool force = false, quiet = false;
    const char *form = "vllm", *config = NULL;
    kvq_opt tab[] = {
        {"out", 'o', KVQ_OPT_STRING, &out, "FILE", "safetensors file to write", NULL, 0, 0, true},
        {"form", 0, KVQ_OPT_CHOICE, &form, "F",
         "tensor names and shapes: vllm (self_attn.k_scale, [] or [n_kv_heads]), compressed-tensors (llm-compressor: "
         "[1] or [n_kv_heads,1,1]), modelopt (self_attn.k_proj.k_scale / v_proj.v_scale, [1]; per tensor only)",
         "vllm|compressed-tensors|modelopt", 0, 0, false},
        {"config", 0, KVQ_OPT_STRING, &config, "JSON",
         "compressed-tensors: also write the config.json fragment (quantization_config.kv_cache_scheme) here", NULL, 0, 0,
         false},
        {"force", 'f', KVQ_OPT_FLAG, &force, NULL, "replace an existing --out file", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_QUIET, &quiet, false),
    };
    kvq_strlist pos = {0};
    bool help = false;
    kvq_err e = {0};
    if (kvq_cli_parse(PROG " export-vllm",
                      "Write an fp8 artifact's scales as model.layers.<i>.self_attn.k_scale / v_scale (float32) in a\n"
                      "safetensors file to merge into a Hugging Face checkpoint for vLLM, in the names and shapes of\n"
                      "kvq's vLLM file, llm-compressor (compressed-tensors, with the config.json fragment) or ModelOpt\n"
                      "(docs/fp8-vllm.md).\n\n"
                      "  kvcalib export-vllm ARTIFACT --out FILE [--form vllm|compressed-tensors|modelopt] [--config JSON] [--force]",
                      tab, (int)(sizeof tab / sizeof *tab), argc, argv, &pos, &help, &e)) {
        fprintf(stderr, "%s export-vllm: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    if (help) return 0;
    if (pos.n != 1) {
        fprintf(stderr, "%s export-vllm: expected one ARTIFACT file, found %d arguments\n", PROG, pos.n);
        return EXIT_USAGE;
    }
    kvq_kv_scale_form f = !strcmp(form, "compressed-tensors") ? KVQ_SCALES_COMPRESSED_TENSORS
                          : !strcmp(form, "modelopt")         ? KVQ_SCALES_MODELOPT
                                                              : KVQ_SCALES_VLLM;
    if (config && f != KVQ_SCALES_COMPRESSED_TENSORS) {
        fprintf(stderr, "%s export-vllm: --config: the config.json fragment belongs to --form compressed-tensors, form is %s\n",
                PROG, form);
        return EXIT_USAGE;
    }
    if (!config && f == KVQ_SCALES_COMPRESSED_TENSORS) {
        fprintf(stderr, "%s export-vllm: --form compressed-tensors: missing --config JSON (the quantization_config "
                        "fragment vLLM needs to create the scale parameters)\n", PROG);
        return EXIT_USAGE;
    }
    {
        const kvq_cli_file outs[2] = {{"--out", out}, {"--config", config}}, ins[1] = {{"ARTIFACT", pos.v[0]}};
        if (kvq_cli_check_outputs(outs, 2, ins, 1, &e) || kvq_cli_check_renamed_outputs(outs, 2, &e)) {
            fprintf(stderr, "%s export-vllm: %s\n", PROG, e.msg);
            return EXIT_USAGE;
        }
    }
    kvq_artifact a;
    if (kvq_artifact_read(pos.v[0], &a, &e)) {
        fprintf(stderr, "%s export-vllm: %s\n", PROG, e.msg);
        return 1;
    }
    kvq_status s = kvq_calibrate_export_scales(&a, f, out, config, force, &e);
    if (s) fprintf(stderr, "%s export-vllm: %s: %s\n", PROG, pos.v[0], e.msg);
    else if (!quiet) {
        static const char *const shapes[3][2] = {{"one scalar (shape []) per layer", "[n_kv_heads] per KV head"},
                                                 {"[1] per layer (strategy tensor)", "[n_kv_heads, 1, 1] (strategy attn_head)"},
                                                 {"[1] per layer", "-"}};
        printf("%s: wrote %s (%s form): %zu layers, k_scale/v_scale %s%s%s\n", PROG, out, form, a.p.n_layers,
               shapes[f][a.p.per_head ? 1 : 0], config ? "; config fragment " : "", config ? config : "");
    }
    kvq_artifact_free(&a);
    return s ? 1 : 0;
}

static int cmd_calibrate(int argc, char **argv)
{
    cli_args a = {.keys = NULL, .fit = "auto", .bits = 0, .sink = -1, .group = -1, .residual = -1,
                  .outliers = -1, .percentile = -1};
    kvq_opt tab[32];
    char methods[160], summary[16384]; /* every method's lines: 13 families filled 4096 bytes and the last were cut */
    int n = option_table(&a, tab, kvq_family_methods("|", methods, sizeof methods));
    kvq_strlist pos = {0};
    bool help = false;
    kvq_err e = {0};
    int given[32] = {0};
    if (kvq_cli_parse_given(PROG, summary_text(summary, sizeof summary), tab, n, argc, argv, &pos, &help, given, &e)) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    if (help) return 0;
    if (a.version) {
        kvq_cli_print_version(stdout, "kvcalib", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
        return 0;
    }
    if (a.inspect) {
        if (pos.n || a.method || a.out) {
            fprintf(stderr, "%s: --inspect FILE takes no dump, --method or --out\n", PROG);
            return EXIT_USAGE;
        }
        if (kvq_artifact_inspect(stdout, a.inspect, &e)) {
            fprintf(stderr, "%s: %s\n", PROG, e.msg);
            return 1;
        }
        return 0;
    }
    if (pos.n != 1) {
        fprintf(stderr, "%s: expected one DUMP file, found %d arguments (see %s --help)\n", PROG, pos.n, PROG);
        return EXIT_USAGE;
    }
    if (!a.method) { fprintf(stderr, "%s: missing required option --method M (see --help)\n", PROG); return EXIT_USAGE; }
    const kvq_family *m = kvq_family_method(a.method);
    if (!m || !m->calib) { /* the option table already restricts it; kept for safety */
        fprintf(stderr, "%s: --method: unknown method '%s'\n", PROG, a.method);
        return EXIT_USAGE;
    }
    bool fp8 = m->calib->fp8_opt; /* calibrated scales (fp8, nvfp4): the code bits are the format's */
    if (fp8 && !a.bits) a.bits = m->calib->bits;
    if (fp8 && a.bits != m->calib->bits) {
        fprintf(stderr, "%s: --bits: %s stores %d-bit codes, found %ld (omit --bits)\n", PROG, a.method, m->calib->bits, a.bits);
        return EXIT_USAGE;
    }
    if (!fp8 && (a.scale || a.percentile != -1 || a.fp8_format || a.export_vllm)) {
        char who[128];
        fprintf(stderr, "%s: --scale, --percentile, --fp8-format and --export-vllm apply to --method %s only\n", PROG,
                kvq_family_list_calib_flag(offsetof(kvq_family_calib, fp8_opt), who, sizeof who));
        return EXIT_USAGE;
    }
    if ((a.fp8_format && !m->calib->fp8_format_opt) || (a.export_vllm && !m->artifact->vllm_export)) {
        fprintf(stderr, "%s: --%s: applies to --method fp8 only (vLLM's FP8 k/v scales), method is %s\n", PROG,
                a.fp8_format && !m->calib->fp8_format_opt ? "fp8-format" : "export-vllm", a.method);
        return EXIT_USAGE;
    }
    if (m->calib->bits_free && a.bits) {
        fprintf(stderr, "%s: --bits: %s's tables do not depend on code bits (its kveval spec picks them), found --bits %ld (omit it)\n",
                PROG, a.method, a.bits);
        return EXIT_USAGE;
    }
    if (m->calib->bits_free) a.bits = m->calib->bits;
    if (!a.bits) { fprintf(stderr, "%s: missing required option --bits B (see --help)\n", PROG); return EXIT_USAGE; }
    if (!a.out) { fprintf(stderr, "%s: missing required option --out FILE (see --help)\n", PROG); return EXIT_USAGE; }
    { /* outputs writable, replacing no input, not each other (-o DUMP -f used to replace the dump) */
        const kvq_cli_file outs[2] = {{"--out", a.out}, {"--export-vllm", a.export_vllm}}, ins[1] = {{"DUMP", pos.v[0]}};
        if (kvq_cli_check_outputs(outs, 2, ins, 1, &e) || kvq_cli_check_renamed_outputs(outs, 2, &e)) {
            fprintf(stderr, "%s: %s\n", PROG, e.msg);
            return EXIT_USAGE;
        }
    }
    { /* the fits' options would be silently ignored: --no-fisher where the method weights by Fisher (fisher_opt),
       * --fit / --seed for the datatype fit (fit_opt) */
        static const char *const fit_opts[] = {"no-fisher", "fisher", "fit", "seed"};
        if (a.fisher && a.no_fisher) { fprintf(stderr, "%s: --fisher and --no-fisher contradict each other\n", PROG); return EXIT_USAGE; }
        if (a.fisher && m->calib->fisher) {
            fprintf(stderr, "%s: --fisher: %s is Fisher-weighted already (omit it; --no-fisher calibrates unweighted)\n", PROG, a.method);
            return EXIT_USAGE;
        }
        for (size_t i = 0; i < sizeof fit_opts / sizeof *fit_opts; i++) {
            size_t flag = i > 1 ? offsetof(kvq_family_calib, fit_opt) : offsetof(kvq_family_calib, fisher_opt);
            if (!*(const bool *)((const char *)m->calib + flag) && kvq_cli_given(tab, n, given, fit_opts[i])) {
                char who[128];
                fprintf(stderr, "%s: --%s: applies to --method %s only (%s), method is %s\n", PROG, fit_opts[i],
                        kvq_family_list_calib_flag(flag, who, sizeof who), i > 1 ? "the datatype fit" : "Fisher-weighted fits",
                        a.method);
                return EXIT_USAGE;
            }
        }
    }
    kvq_calibrate_opts o = kvq_calibrate_defaults(m);
    o.k_bits = o.v_bits = (int)a.bits;
    if (a.outliers != -1) o.outlier_frac = a.outliers;
    if (a.sink >= 0) o.n_sink = (size_t)a.sink;
    if (a.group >= 0) o.group_size = (size_t)a.group;
    if (a.residual >= 0) o.residual_length = (size_t)a.residual;
    if (a.keys) o.post_rope = !strcmp(a.keys, "post-rope");
    for (int i = 0; i < (int)a.params.n; i++) { /* --param NAME=VALUE: the family's artifact->params */
        const char *arg = a.params.v[i], *eq = strchr(arg, '=');
        const char *const *names = m->artifact ? m->artifact->params : NULL;
        int j = 0;
        while (names && j < KVQ_ARTIFACT_X && names[j] && (!eq || strlen(names[j]) != (size_t)(eq - arg) ||
                                                          strncmp(names[j], arg, (size_t)(eq - arg))))
            j++;
        char *end = NULL;
        double v = eq ? strtod(eq + 1, &end) : 0;
        if (!eq || !names || j >= KVQ_ARTIFACT_X || !names[j]) {
            char known[160] = "";
            for (int q = 0; names && q < KVQ_ARTIFACT_X && names[q]; q++)
                snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", q ? ", " : "", names[q]);
            fprintf(stderr, "%s: --param %s: expected NAME=VALUE with NAME one of method %s's parameters (%s)\n", PROG, arg,
                    a.method, known[0] ? known : "it has none");
            return EXIT_USAGE;
        }
        if (!eq[1] || *end || !isfinite(v)) {
            fprintf(stderr, "%s: --param %s: value of %s: expected a finite number, found \"%s\"\n", PROG, arg, names[j], eq + 1);
            return EXIT_USAGE;
        }
        o.x[j] = v;
    }
    if (!o.post_rope && !m->calib->pre_rope_ok) {
        /* kvstat and the IntactKV trainer read int/kivi artifacts as post-RoPE (kvq's int and KIVI
         * quantize the cached post-RoPE keys): the label would be wrong (it was accepted) */
        char who[128];
        fprintf(stderr, "%s: --keys pre-rope: method %s quantizes post-RoPE keys; pre-RoPE keys are for %s\n", PROG, a.method,
                kvq_family_list_calib_flag(offsetof(kvq_family_calib, pre_rope_ok), who, sizeof who));
        return EXIT_USAGE;
    }
    o.fisher = m->calib->fisher_opt && (m->calib->fisher || a.fisher) && !a.no_fisher;
    o.per_head = a.per_head;
    if (fp8) {
        if (a.per_head) {
            fprintf(stderr, "%s: --per-head is for nuq datatypes; %s takes --scale\n", PROG, a.method);
            return EXIT_USAGE;
        }
        o.per_head = a.scale && !strcmp(a.scale, "head");
        if (a.percentile != -1) o.fp8_percentile = a.percentile;
        o.fp8_e5m2 = a.fp8_format && !strcmp(a.fp8_format, "e5m2");
        if (a.export_vllm && o.fp8_e5m2) {
            fprintf(stderr, "%s: --export-vllm: vLLM's fp8_e5m2 cache takes no checkpoint scales; export E4M3 scales\n", PROG);
            return EXIT_USAGE;
        }
        if (a.export_vllm && !a.force && access(a.export_vllm, F_OK) == 0) {
            fprintf(stderr, "%s: --export-vllm %s: already exists; not overwritten (use --force to replace it)\n", PROG,
                    a.export_vllm);
            return 1;
        }
    }
    if (a.rotate) {
        const char *r = a.rotate;
        char *end = NULL;
        bool bad = false;
        if (!strcmp(r, "hadamard")) o.rotation.kind = KVQ_ROT_HADAMARD;
        else if (!strncmp(r, "rht", 3)) {
            o.rotation.kind = KVQ_ROT_RHT;
            if (r[3]) {
                errno = 0;
                o.rotation.seed = strtoull(r + 3, &end, 10);
                bad = *end || errno || r[3] < '0' || r[3] > '9';
            }
        } else bad = strcmp(r, "none") != 0;
        if (bad) {
            fprintf(stderr, "%s: --rotate: expected none, hadamard, rht or rht<seed> (decimal), found '%s'\n", PROG, r);
            return EXIT_USAGE;
        }
    }
    o.fit.method = !strcmp(a.fit, "lloyd") ? KVQ_FIT_LLOYD : !strcmp(a.fit, "exact") ? KVQ_FIT_EXACT : KVQ_FIT_AUTO;
    o.fit.seed = (uint64_t)a.seed;
    o.bits_ctx = (size_t)a.bits_ctx;
    o.n_threads = (int)a.threads;
    if (kvq_calibrate_validate(&o, &e)) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    progress_ctx pc = {.t0 = kvq_now(), .quiet = a.quiet, .outliers = o.outlier_frac > 0};
    o.on_table = on_table;
    o.on_table_ctx = &pc;
    int threads = o.n_threads > 0 ? o.n_threads : omp_get_max_threads();
    if (!a.quiet) {
        char label[48]; /* nuq3, int4, kivi2; fp8 alone (it printed "fp88") */
        if (fp8) snprintf(label, sizeof label, "%s", a.method);
        else snprintf(label, sizeof label, "%s%d", a.method, o.k_bits);
        fprintf(stderr, "%s: %s -> %s: %s, %d thread%s\n", PROG, pos.v[0], a.out, label, threads, threads == 1 ? "" : "s");
    }
    kvq_artifact art;
    kvq_status s = kvq_calibrate_file(pos.v[0], a.out, a.force, &o, &art, &e);
    if (s) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return 1;
    }
    double dt = kvq_now() - pc.t0;
    if (!a.quiet) print_summary(stdout, a.out, &art, dt, threads);
    if (!a.quiet) warn_outlier_share(&art); /* (--quiet: errors only) */
    if (fp8 && !a.quiet) {
        for (size_t i = 0; i < art.p.n_layers; i++) {
            printf("%s: layer %2zu %s scale K", PROG, i, a.method);
            for (size_t h = 0; h < art.k[i].n_fp8_scales; h++) printf(" %.6g", (double)art.k[i].fp8_scale[h]);
            printf(" V");
            for (size_t h = 0; h < art.v[i].n_fp8_scales; h++) printf(" %.6g", (double)art.v[i].fp8_scale[h]);
            printf(" (saturated %.4f%% / %.4f%%)\n",
                   art.k[i].n_elems ? 100.0 * (double)art.k[i].n_outliers / (double)art.k[i].n_elems : 0.0,
                   art.v[i].n_elems ? 100.0 * (double)art.v[i].n_outliers / (double)art.v[i].n_elems : 0.0);
        }
    }
    if (a.export_vllm) {
        s = kvq_calibrate_export_vllm(&art, a.export_vllm, a.force, &e);
        if (s) {
            fprintf(stderr, "%s: --export-vllm: %s (the artifact %s was written)\n", PROG, e.msg, a.out);
            kvq_artifact_free(&art);
            return 1;
        }
        if (!a.quiet) printf("%s: wrote %s (vLLM k_scale / v_scale)\n", PROG, a.export_vllm);
    }
    kvq_artifact_free(&art);
    return 0;
}

int main(int argc, char **argv)
{
    /* past a file-size limit (ulimit -f) writes fail with EFBIG, reported and cleaned up, instead of SIGXFSZ
     * killing us with a temporary file left behind */
    signal(SIGXFSZ, SIG_IGN);
    if (argc > 1 && !strcmp(argv[1], "intactkv")) return cmd_intactkv(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "export-vllm")) return cmd_export_vllm(argc - 1, argv + 1);
    return cmd_calibrate(argc, argv);
}
