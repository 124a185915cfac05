/* kvstat — report and plot channel/token outliers and quantization error from a kvdump file.
 *
 * kvstat DUMP [--artifact FILE] [--layer N] [--head H] [--sample S] [--outlier-mult X]
 *        [--json FILE] [--html DIR] [--plots DIR] [--quiet] ...
 * Markdown tables go to stdout (or --markdown FILE; with --json - the JSON alone does); progress to stderr.
 * Every output file is written under a temporary name and renamed when complete.
 * Exit status: 0 success, 1 failure (message on stderr), 2 bad command line. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "cuda_info.h"
#include "kvsrc.h"
#include "kvstats.h"
#include "outfile.h"
#include "plot.h"
#include "report.h"
#include "scheme.h"

#define PLOT_NAMES "profile|heatmap|outliers|attention|hist|qerr|xlayer|lowrank"
#define MAX_IMAGES 16

typedef struct {
    const char *artifact, *json, *html, *plots, *markdown, *outlier_stat, *format, *attn_scale;
    long layer, head, sample, top, chunk;
    double outlier_mult, sink_share, gamma;
    kvq_strlist plot;
    kvq_strlist scheme; /* --scheme: table-free schemes whose quantization error is reported (repeatable) */
    bool quiet, version, cross_layer;
} args_t;

typedef struct {
    char paths[MAX_IMAGES][4200];
    char caps[MAX_IMAGES][256];
    const char *pp[MAX_IMAGES], *cp[MAX_IMAGES];
    int n;
} images_t;

static bool want(const args_t *a, const char *name)
{
    if (a->plot.n == 0) return true;
    for (int i = 0; i < a->plot.n; i++)
        if (!strcmp(a->plot.v[i], name)) return true;
    return false;
}

static bool explicitly(const args_t *a, const char *name) { return a->plot.n > 0 && want(a, name); }

static void add_image(images_t *im, const char *base, const char *cap)
{
    if (im->n >= MAX_IMAGES) return;
    snprintf(im->paths[im->n], sizeof im->paths[im->n], "%s.png", base);
    snprintf(im->caps[im->n], sizeof im->caps[im->n], "%s", cap);
    im->pp[im->n] = im->paths[im->n];
    im->cp[im->n] = im->caps[im->n];
    im->n++;
}

/* *created: whether this call made the directory (a failed run removes it again when it is still empty) */
static kvq_status mkdir_p(const char *dir, bool *created, kvq_err *err)
{
    *created = mkdir(dir, 0777) == 0;
    if (!*created && errno != EEXIST)
        return kvq_fail(err, KVQ_EIO, "%s: cannot create directory: %s", dir, strerror(errno));
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return kvq_fail(err, KVQ_EIO, "%s: not a directory", dir);
    return KVQ_OK;
}

/* Histograms of normalised keys/values of the detail layer with the artifact's nuq levels. */
static kvq_status plot_hists(const args_t *a, const kvq_kvsrc *src, const kvq_artifact *art, int layer,
                             const char *dir, const kvq_plot_style *st, images_t *im, kvq_err *err)
{
    if (!art->p.method->artifact->k_levels || !art->p.method->artifact->v_levels || !art->k || !art->v) {
        if (explicitly(a, "hist"))
            return kvq_fail(err, KVQ_EINVAL, "--plot hist needs an artifact with nuq datatypes (this one is %s)",
                            art->p.method->name);
        return KVQ_OK;
    }
    enum { NB = 240 };
    for (int w = 0; w < 2; w++) {
        const kvq_kv_table *t = w ? &art->v[layer] : &art->k[layer];
        uint64_t cnt[NB] = {0}, under = 0, over = 0;
        kvq_kvt tens = w ? KVQ_KVT_V : art->p.post_rope ? KVQ_KVT_K : KVQ_KVT_K_PRE_ROPE;
        KVQ_TRY(kvq_normhist_layer(src, layer, tens, w ? NULL : t->channel_lower, w ? NULL : t->channel_upper,
                                   art->p.outlier_frac, -1.2, 1.2, NB, cnt, &under, &over, err));
        char base[4200], title[300], lab[64];
        snprintf(base, sizeof base, "%s/hist_%s_layer%d", dir, w ? "v" : "k", layer);
        snprintf(title, sizeof title, "layer %d %s: normalised values and nuq%d levels (%s)", layer,
                 w ? "values (per-token range)" : "keys (per-channel thresholds)", t->bits,
                 t->n_tables > 1 ? "KV head 0's datatype" : "per-layer datatype");
        snprintf(lab, sizeof lab, "nuq%d levels (%d)", t->bits, 1 << t->bits);
        KVQ_TRY(kvq_plot_histogram(base, st, title, "normalised value (x − zp) / r", cnt, NB, -1.2, 1.2, under, over,
                                   t->levels, 1 << t->bits, lab, true, err));
        add_image(im, base, title);
    }
    return KVQ_OK;
}

/* A scheme whose sink or window covers the dump's samples of seq_len tokens quantizes nothing in the resting view:
 * refused with the family's rule (its check_ctx, as kveval refuses it against --ctx), where it printed an error of 0 */
static kvq_status quantizes_nothing(const kvq_qscheme_state *st, int64_t seq_len, kvq_err *err)
{
    const kvq_scheme *q = &st->desc.q;
    char name[128];
    kvq_kv_desc_name(&st->desc, name, sizeof name);
    if (q->n_sink >= (size_t)seq_len)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: its %zu attention-sink tokens cover the dump's samples of %lld tokens: "
                        "nothing would be quantized", name, q->n_sink, (long long)seq_len);
    if (q->fam && q->fam->check_ctx && q->fam->check_ctx(q, name, (size_t)seq_len, err))
        return kvq_err_prefix(err, "the dump's samples of %lld tokens", (long long)seq_len);
    return KVQ_OK;
}

static int run(const args_t *a, const char *dump_path)
{
    kvq_err err = {0};
    kvq_kvsrc src;
    kvq_status st = kvq_kvsrc_dump_open(dump_path, &src, &err);
    if (st != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); return 1; }
    kvq_artifact art;
    bool have_art = false;
    kvq_kvstats *s = NULL;
    kvq_qerr q;
    bool have_q = false;
    enum { MAX_SCHEMES = 3 + 8 }; /* the artifact's, two baselines, up to 8 --scheme */
    kvq_qscheme_state qs[MAX_SCHEMES];
    kvq_qscheme sch[MAX_SCHEMES];
    int n_qs = 0;
    kvq_cqstats cqs;
    bool have_cq = false;
    kvq_xlayer xl;
    bool have_xl = false;
    kvq_lrstats lrs;
    bool have_lr = false;
    float *k_bias = NULL;
    int rc = 1;
    bool made_dir = false;
    /* validate the detail selection before the long pass */
    const size_t pl = strlen(dump_path);
    if (!a->quiet && pl > 8 && !strcmp(dump_path + pl - 8, ".partial"))
        fprintf(stderr, "kvstat: note: %s is an unfinished dump: statistics over its %lld complete samples\n", dump_path,
                (long long)src.n_samples);
    int layer = a->layer >= 0 ? (int)a->layer : (src.layer_first + src.layer_last) / 2;
    if (layer < src.layer_first || layer > src.layer_last) {
        fprintf(stderr, "kvstat: --layer %d: the dump has layers %d..%d\n", layer, src.layer_first, src.layer_last);
        goto out;
    }
    if (a->head >= src.n_kv_heads) {
        fprintf(stderr, "kvstat: --head %ld: the model has %d KV heads (0..%d)\n", a->head, src.n_kv_heads, src.n_kv_heads - 1);
        goto out;
    }
    if (a->sample >= src.n_samples) {
        fprintf(stderr, "kvstat: --sample %ld: the dump has %lld samples (0..%lld)\n", a->sample, (long long)src.n_samples,
                (long long)src.n_samples - 1);
        goto out;
    }
    if (explicitly(a, "attention") && !src.has_attn) {
        fprintf(stderr, "kvstat: --plot attention: %s has no attn_received; re-run kvdump with --attn-stats\n", dump_path);
        goto out;
    }
    if ((explicitly(a, "qerr") && !a->artifact && a->scheme.n == 0) || (explicitly(a, "hist") && !a->artifact)) {
        fprintf(stderr, "kvstat: --plot qerr/hist need --artifact FILE (a kvcalib artifact; qerr also takes --scheme SPEC)\n");
        goto out;
    }
    if (a->scheme.n > MAX_SCHEMES - 3) {
        fprintf(stderr, "kvstat: --scheme: at most %d schemes, found %d\n", MAX_SCHEMES - 3, a->scheme.n);
        goto out;
    }
    if (a->artifact) {
        if (kvq_artifact_read(a->artifact, &art, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
        have_art = true;
        if (kvq_artifact_check_source(&art, &src, &err) != KVQ_OK) {
            fprintf(stderr, "kvstat: %s: %s\n", a->artifact, err.msg);
            goto out;
        }
    }
    if (explicitly(a, "lowrank") && !(have_art && art.p.method == kvq_family_find("lowrank"))) { /* it wrote nothing, exit 0 */
        fprintf(stderr, "kvstat: --plot lowrank needs --artifact FILE of method lowrank (kvcalib --method lowrank)%s%s\n",
                have_art ? "; this one is " : "", have_art ? art.p.method->name : "");
        goto out;
    }
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.outlier_mult = a->outlier_mult;
    o.outlier_stat = !strcmp(a->outlier_stat, "absmax") ? KVQ_OUTLIER_ABSMAX
                     : !strcmp(a->outlier_stat, "p99") ? KVQ_OUTLIER_P99 : KVQ_OUTLIER_MEAN_ABS;
    o.sink_share = a->sink_share;
    o.chunk_tokens = a->chunk;
    o.quiet = a->quiet;
    if (kvq_kvstats_compute(&src, &o, &s, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s: %s\n", dump_path, err.msg); goto out; }
    if (have_art) {
        if (kvq_qscheme_from_artifact(&art, &qs[0], &sch[0], &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s: %s\n", a->artifact, err.msg); goto out; }
        n_qs = 1;
        if (quantizes_nothing(&qs[0], src.seq_len, &err)) { fprintf(stderr, "kvstat: %s: %s\n", a->artifact, err.msg); goto out; }
        /* baselines at the artifact's code bits per element (its family's code_bits: cq-c4b8 codes 2 bits per
         * channel): uniform per-token intX, KIVI with its default group size */
        const kvq_family *fi = kvq_family_find("int"), *fk = kvq_family_find("kivi");
        kvq_scheme own = {.fam = art.p.method, .k_bits = art.p.k_bits, .v_bits = art.p.v_bits};
        if (own.fam->from_params) own.fam->from_params(&art.p, &own);
        int bk = own.fam->code_bits ? own.fam->code_bits(&own, 'k') : art.p.k_bits,
            bv = own.fam->code_bits ? own.fam->code_bits(&own, 'v') : art.p.v_bits;
        kvq_scheme base = {.fam = fi, .k_bits = bk, .v_bits = bv, .n_sink = art.p.n_sink};
        if (art.p.method != fi && kvq_qscheme_plain(&base, (size_t)src.head_dim, &qs[n_qs], &sch[n_qs], &err) == KVQ_OK) n_qs++;
        kvq_scheme kivi = {.fam = fk, .k_bits = bk, .v_bits = bv, .n_sink = art.p.n_sink,
                           .group = fk->calib->group, .residual = fk->calib->residual};
        if (art.p.method != fk && src.head_dim % (int)fk->calib->group == 0) {
            if (kvq_qscheme_plain(&kivi, (size_t)src.head_dim, &qs[n_qs], &sch[n_qs], &err) == KVQ_OK) n_qs++;
        } else if (art.p.method != fk && !a->quiet) { /* the row vanished without a word */
            fprintf(stderr, "kvstat: note: no KIVI baseline: its group of %zu does not divide head_dim %d\n", fk->calib->group,
                    src.head_dim);
        }
    }
    /* --scheme: families without tables (zipcache, hh, int, kivi, ...), the resting cache as the family's quantize
     * gives it (keys at the spec's stage, through its rotation), checked against the dump's head_dim before the pass */
    for (int i = 0; i < a->scheme.n; i++) {
        kvq_scheme_spec ss;
        kvq_hparams hp = {.n_layers = src.layer_last + 1, .n_heads = src.n_heads, .n_kv_heads = src.n_kv_heads,
                          .head_dim = src.head_dim};
        if (kvq_scheme_parse(a->scheme.v[i], &ss, &err) != KVQ_OK ||
            (ss.q.fam->check_model && ss.q.fam->check_model(&ss.q, a->scheme.v[i], &hp, &err) != KVQ_OK) ||
            kvq_qscheme_spec(&ss, (size_t)src.head_dim, &qs[n_qs], &sch[n_qs], &err) != KVQ_OK) {
            fprintf(stderr, "kvstat: --scheme %s: %s\n", a->scheme.v[i], err.msg);
            goto out;
        }
        n_qs++;
        if (quantizes_nothing(&qs[n_qs - 1], src.seq_len, &err)) { fprintf(stderr, "kvstat: --scheme %s: %s\n", a->scheme.v[i], err.msg); goto out; }
    }
    if (n_qs > 0) {
        if (kvq_qerr_compute(&src, sch, n_qs, a->quiet, &q, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
        have_q = true;
        if (art.p.method == kvq_family_find("cq")) { /* the codebooks' usage and per-group error */
            if (kvq_cqstats_compute(&src, &art, a->quiet, &cqs, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
            have_cq = true;
        }
        if (art.p.method == kvq_family_find("lowrank")) { /* explained variance of the subspaces per layer and group */
            if (kvq_lrstats_compute(&src, &art, a->quiet, &lrs, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
            have_lr = true;
        }
    }
    /* adjacent layers' similarity (MiniCache): --cross-layer, --plot xlayer or a minicache artifact */
    const bool mc_art = have_art && art.p.method == kvq_family_find("minicache");
    if (a->cross_layer || explicitly(a, "xlayer") || mc_art) {
        if (src.layer_last <= src.layer_first) {
            if (a->cross_layer || explicitly(a, "xlayer")) {
                fprintf(stderr, "kvstat: --cross-layer: %s holds one layer; adjacent pairs need two (kvdump --layers A-B)\n", dump_path);
                goto out;
            }
        } else {
            if (kvq_xlayer_compute(&src, mc_art ? &art : NULL, a->gamma, 0, a->quiet, &xl, &err) != KVQ_OK) {
                fprintf(stderr, "kvstat: %s\n", err.msg);
                goto out;
            }
            have_xl = true;
        }
    }
    /* plots */
    images_t im = {.n = 0};
    const char *pdir = a->plots ? a->plots : a->html;
    if (pdir) {
        if (mkdir_p(pdir, &made_dir, &err) != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
        kvq_plot_style ps = kvq_plot_style_default();
        ps.model = s->model;
        ps.png = strcmp(a->format, "svg") != 0 || a->html;
        ps.svg = strcmp(a->format, "png") != 0;
        char base[4200], cap[256];
        bool logy = !strcmp(a->attn_scale, "log");
        if (want(a, "profile")) {
            snprintf(base, sizeof base, "%s/channel_profile_layer%d", pdir, layer);
            st = kvq_plot_channel_profile(base, &ps, s, layer, &err);
            snprintf(cap, sizeof cap, "Per-channel magnitude, layer %d (pre-RoPE keys, post-RoPE keys, values)", layer);
            if (st == KVQ_OK) add_image(&im, base, cap);
        }
        if (st == KVQ_OK && want(a, "heatmap")) {
            size_t n = (size_t)src.seq_len * (size_t)src.head_dim;
            float *hm[3] = {malloc(n * sizeof(float)), malloc(n * sizeof(float)), malloc(n * sizeof(float))};
            if (!hm[0] || !hm[1] || !hm[2]) st = kvq_fail(&err, KVQ_ENOMEM, "heatmap: out of memory");
            for (int t = 0; t < 3 && st == KVQ_OK; t++)
                st = kvq_kvsrc_read_head(&src, layer, (kvq_kvt)t, a->sample, (int)a->head, hm[t], &err);
            const char *titles[3] = {"pre-RoPE keys (k_pre_rope)", "post-RoPE keys (k)", "values (v)"};
            snprintf(base, sizeof base, "%s/heatmap_layer%d_head%ld_sample%ld", pdir, layer, a->head, a->sample);
            if (st == KVQ_OK)
                st = kvq_plot_heatmap(base, &ps, layer, (int)a->head, a->sample, 3, (const float *const *)hm, titles,
                                      src.seq_len, src.head_dim, &err);
            snprintf(cap, sizeof cap, "|x| per token and channel, layer %d, KV head %ld, sample %ld", layer, a->head, a->sample);
            if (st == KVQ_OK) add_image(&im, base, cap);
            for (int t = 0; t < 3; t++) free(hm[t]);
        }
        if (st == KVQ_OK && want(a, "outliers")) {
            snprintf(base, sizeof base, "%s/outlier_map", pdir);
            st = kvq_plot_outlier_map(base, &ps, s, &err);
            if (st == KVQ_OK) add_image(&im, base, "Outlier channels of every layer (channel magnitude / layer median)");
        }
        if (st == KVQ_OK && want(a, "attention") && s->has_attn) {
            snprintf(base, sizeof base, "%s/attention_layer%d", pdir, layer);
            st = kvq_plot_attention(base, &ps, s, layer, logy, &err);
            snprintf(cap, sizeof cap, "Attention received by position, layer %d", layer);
            if (st == KVQ_OK) add_image(&im, base, cap);
            snprintf(base, sizeof base, "%s/attention_layers", pdir);
            if (st == KVQ_OK) st = kvq_plot_attention_layers(base, &ps, s, &err);
            if (st == KVQ_OK) add_image(&im, base, "Attention sink strength per layer");
        } else if (st == KVQ_OK && want(a, "attention") && !a->quiet) {
            fprintf(stderr, "kvstat: note: no attention plots: the dump has no attn_received (kvdump --attn-stats)\n");
        }
        if (st == KVQ_OK && have_art && want(a, "hist")) st = plot_hists(a, &src, &art, layer, pdir, &ps, &im, &err);
        if (st == KVQ_OK && have_q && want(a, "qerr")) {
            snprintf(base, sizeof base, "%s/quant_error", pdir);
            st = kvq_plot_qerr(base, &ps, &q, true, &err);
            if (st == KVQ_OK) add_image(&im, base, "Relative quantization error per layer and scheme");
        }
        if (st == KVQ_OK && have_xl && want(a, "xlayer")) {
            snprintf(base, sizeof base, "%s/cross_layer", pdir);
            st = kvq_plot_xlayer(base, &ps, &xl, &err);
            if (st == KVQ_OK) add_image(&im, base, "Adjacent layers' K/V similarity and MiniCache's retained fraction");
        }
        if (st == KVQ_OK && have_lr && want(a, "lowrank")) {
            snprintf(base, sizeof base, "%s/lowrank_ev", pdir);
            st = kvq_plot_lowrank(base, &ps, &lrs, &err);
            if (st == KVQ_OK) add_image(&im, base, "Low-rank KV heads: explained variance on the dump by rank, per layer");
        }
        if (st != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
    }
    /* the model's key biases, when the dump holds them (Qwen2: kvdump writes /k_bias) */
    k_bias = malloc((size_t)s->n_stat_layers * s->kv_dim * sizeof *k_bias);
    bool have_kb = false;
    if (!k_bias) { st = kvq_fail(&err, KVQ_ENOMEM, "out of memory"); fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
    {
        kvq_dump_reader *dr = NULL;
        st = kvq_dump_open(dump_path, &dr, &err);
        if (st == KVQ_OK) st = kvq_dump_read_k_bias(dr, k_bias, &have_kb, &err);
        kvq_dump_close(dr);
        if (st != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
    }
    kvq_report r = {.s = s, .q = have_q ? &q : NULL, .dump_path = dump_path, .artifact_path = a->artifact,
                    .detail_layer = layer, .top_n = (int)a->top, .n_images = im.n, .image_paths = im.pp,
                    .image_captions = im.cp, .k_bias = have_kb ? k_bias : NULL, .cq = have_cq ? &cqs : NULL,
                    .xl = have_xl ? &xl : NULL,
                    .lr = have_lr ? &lrs : NULL};
    if (a->markdown) { /* NULL when the JSON takes stdout */
        kvq_outfile mf;
        st = kvq_outfile_open(&mf, a->markdown, &err);
        if (st == KVQ_OK) {
            st = kvq_report_markdown(mf.f, &r, &err);
            if (st == KVQ_OK) st = kvq_outfile_commit(&mf, &err);
            else kvq_outfile_abort(&mf);
        }
    }
    if (st == KVQ_OK && a->json) st = kvq_report_json(a->json, &r, &err);
    if (st == KVQ_OK && a->html) st = kvq_report_html(a->html, &r, &err);
    if (st != KVQ_OK) { fprintf(stderr, "kvstat: %s\n", err.msg); goto out; }
    if (a->html && !a->quiet) fprintf(stderr, "kvstat: wrote %s/index.html\n", a->html);
    rc = 0;
out:
    free(k_bias);
    if (rc && made_dir) rmdir(a->plots ? a->plots : a->html); /* (only when empty: a failure on the first figure) */
    if (have_q) kvq_qerr_free(&q);
    if (have_cq) kvq_cqstats_free(&cqs);
    if (have_xl) kvq_xlayer_free(&xl);
    if (have_lr) kvq_lrstats_free(&lrs);
    for (int i = 0; i < n_qs; i++) kvq_qscheme_state_free(&qs[i]);
    kvq_kvstats_free(s);
    if (have_art) kvq_artifact_free(&art);
    kvq_kvsrc_dump_close(&src);
    return rc;
}

int main(int argc, char **argv)
{
    signal(SIGXFSZ, SIG_IGN); /* past a file-size limit writes fail with EFBIG (reported, cleaned up) instead of killing us */
    args_t a = {.layer = -1, .head = 0, .sample = 0, .top = 5, .chunk = 256, .outlier_mult = 4, .sink_share = 0.2,
                .gamma = 0.05, .outlier_stat = "mean", .format = "both", .attn_scale = "log", .markdown = "-"};
    kvq_opt opts[] = {
        {"artifact", 'a', KVQ_OPT_STRING, &a.artifact, "FILE", "kvcalib artifact: adds quantization error, outlier fractions, nuq histograms", NULL, 0, 0, false},
        {"layer", 'l', KVQ_OPT_INT, &a.layer, "N", "layer of the detailed figures (-1 = the middle dumped layer)", NULL, -1, 1e6, false},
        {"head", 0, KVQ_OPT_INT, &a.head, "H", "KV head of the heatmap", NULL, 0, 1e6, false},
        {"sample", 0, KVQ_OPT_INT, &a.sample, "S", "sample of the heatmap", NULL, 0, 1e12, false},
        {"outlier-mult", 0, KVQ_OPT_FLOAT, &a.outlier_mult, "X", "outlier channel: statistic >= X times the layer median", NULL, 1, 1e6, false},
        {"outlier-stat", 0, KVQ_OPT_CHOICE, &a.outlier_stat, "S", "channel statistic for outliers", "mean|absmax|p99", 0, 0, false},
        {"sink-share", 0, KVQ_OPT_FLOAT, &a.sink_share, "X", "sink: mean attention probability from the queries that see the position >= X", NULL, 1e-6, 1, false},
        {"top", 0, KVQ_OPT_INT, &a.top, "N", "outlier channels / sinks listed per layer in the tables", NULL, 1, 1000, false},
        {"json", 0, KVQ_OPT_STRING, &a.json, "FILE", "write every number as JSON ('-' = stdout, instead of the markdown)", NULL, 0, 0, false},
        {"html", 0, KVQ_OPT_STRING, &a.html, "DIR", "write DIR/index.html, one self-contained page (plots embedded)", NULL, 0, 0, false},
        {"plots", 'p', KVQ_OPT_STRING, &a.plots, "DIR", "write the figures into DIR (default with --html: the html DIR)", NULL, 0, 0, false},
        {"scheme", 's', KVQ_OPT_LIST, &a.scheme, "SPEC", "also report the quantization error of this table-free kveval scheme "
         "(repeatable, post-RoPE keys; e.g. zipcache-h4-l2-b60%, int4)", NULL, 0, 0, false},
        {"plot", 0, KVQ_OPT_LIST, &a.plot, "NAME", "only these figures (repeatable): " PLOT_NAMES, NULL, 0, 0, false},
        {"plot-format", 0, KVQ_OPT_CHOICE, &a.format, "F", "figure files (--html also writes the PNGs it embeds)", "png|svg|both", 0, 0,
         false},
        {"attn-scale", 0, KVQ_OPT_CHOICE, &a.attn_scale, "S", "y axis of the attention-by-position plot", "log|linear", 0, 0, false},
        {"markdown", 0, KVQ_OPT_STRING, &a.markdown, "FILE", "markdown tables ('-' = stdout)", NULL, 0, 0, false},
        {"cross-layer", 0, KVQ_OPT_FLAG, &a.cross_layer, NULL, "adjacent layers' K/V cosine similarity and MiniCache's retained fraction (on by default with a minicache --artifact)", NULL, 0, 0, false},
        {"gamma", 0, KVQ_OPT_FLOAT, &a.gamma, "G", "--cross-layer without a minicache artifact: retention threshold d_max - (d_max - d_min) G of MiniCache", NULL, 0, 1, false},
        {"chunk", 0, KVQ_OPT_INT, &a.chunk, "N", "positions read per slab (memory vs HDF5 calls)", NULL, 1, 1 << 20, false},
        kvq_cli_common(KVQ_COPT_QUIET, &a.quiet, false),
        kvq_cli_common(KVQ_COPT_VERSION, &a.version, false),
    };
    int n_opts = (int)(sizeof opts / sizeof *opts);
    const char *summary = "kvstat DUMP: channel and token outlier statistics, attention sinks, pre- vs post-RoPE spread\n"
                          "and (with --artifact) quantization error of a kvdump file; markdown tables on stdout,\n"
                          "JSON, PNG/SVG figures and a self-contained HTML page on request.";
    kvq_strlist pos = {.n = 0};
    bool help = false;
    kvq_err err = {0};
    int given[sizeof opts / sizeof *opts] = {0};
    if (kvq_cli_parse_given("kvstat", summary, opts, n_opts, argc, argv, &pos, &help, given, &err) != KVQ_OK) {
        fprintf(stderr, "kvstat: %s\n", err.msg); /* the parser names kvstat --help */
        return 2;
    }
    if (help) return 0;
    if (a.version) {
        kvq_cli_print_version(stdout, "kvstat", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
        return 0;
    }
    for (int i = 0; i < a.plot.n; i++) {
        static const char *const names[] = {"profile", "heatmap", "outliers", "attention", "hist", "qerr", "xlayer", "lowrank"};
        bool ok = false;
        for (size_t k = 0; k < sizeof names / sizeof *names; k++) ok = ok || !strcmp(a.plot.v[i], names[k]);
        if (!ok) {
            const char *v = a.plot.v[i];
            fprintf(stderr, "kvstat: --plot: expected one of %s, found '%s'\n", PLOT_NAMES, v);
            return 2;
        }
    }
    if (pos.n != 1) {
        fprintf(stderr, "kvstat: expected one dump file, found %d arguments (see --help)\n", pos.n);
        return 2;
    }
    if (!a.plots && !a.html) { /* figure options without a place for figures did nothing (exit 0) */
        static const char *const fig[] = {"plot", "plot-format", "attn-scale"};
        for (size_t i = 0; i < sizeof fig / sizeof *fig; i++)
            if (kvq_cli_given(opts, n_opts, given, fig[i])) {
                fprintf(stderr, "kvstat: --%s: selects figures, which only --plots DIR or --html DIR write\n", fig[i]);
                return 2;
            }
    }
    for (int i = 0; i < a.scheme.n; i++) { /* a spec's syntax is the command line's: exit 2 before the dump is read */
        kvq_scheme_spec ss;
        if (kvq_scheme_parse(a.scheme.v[i], &ss, &err) != KVQ_OK) {
            fprintf(stderr, "kvstat: --scheme %s: %s\n", a.scheme.v[i], err.msg);
            return 2;
        }
    }
    if (a.json && !strcmp(a.json, "-")) { /* stdout carries the JSON alone */
        const bool md_given = kvq_cli_given(opts, n_opts, given, "markdown");
        if (md_given && !strcmp(a.markdown, "-")) {
            fprintf(stderr, "kvstat: --json - and --markdown -: both on stdout; write one of them to a FILE\n");
            return 2;
        }
        if (!md_given) a.markdown = NULL;
    }
    { /* outputs writable, replacing no input (-j/-m used to overwrite the dump or the artifact) */
        const kvq_cli_file outs[2] = {{"--json", a.json}, {"--markdown", a.markdown}}, ins[2] = {{"DUMP", pos.v[0]}, {"--artifact", a.artifact}};
        /* (an --html / --plots file failed late, with cairo's "error while writing to output stream") */
        if (kvq_cli_check_outputs(outs, 2, ins, 2, &err) || kvq_cli_check_out_dir("--html", a.html, "page and its figures", &err) ||
            kvq_cli_check_out_dir("--plots", a.plots, "figures", &err)) {
            fprintf(stderr, "kvstat: %s\n", err.msg);
            return 2;
        }
    }
    int rc = run(&a, pos.v[0]);
    kvq_plot_cleanup();
    return rc;
}
