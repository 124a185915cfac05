/* report.h — kvstat's outputs besides plots: markdown tables, JSON (cJSON)
 * and one self-contained HTML page.
 *
 * The same tables feed the markdown and the HTML page:
 *   summary; per-layer outlier channels (count and top channels with their
 *   ratio to the layer median) for pre-RoPE keys, post-RoPE keys and values;
 *   per-layer magnitudes (absmax, p99.9, largest channel kurtosis); pre- vs
 *   post-RoPE spread; token norms (position 0 vs the median position);
 *   attention (top position, its share, the sinks with token ids) and pivot
 *   tokens; with an artifact, quantization error per layer and scheme; with
 *   key biases in the dump (Qwen2), their norm per layer and the channels they
 *   dominate (kvq_kbias_layer); with a cq artifact, its codebooks' usage and
 *   per-group error (cqstats.h); adjacent layers' K/V similarity and the
 *   MiniCache retained fraction (xlayer.h);
 *   with a lowrank artifact, the explained
 *   variance of its subspaces per layer and KV-head group (lrstats.h).
 * JSON holds every number (per-channel arrays included); NaN is written as
 * null. HTML embeds each PNG as a base64 data: URI, so the page is one file
 * that opens offline.
 */
#ifndef KVQ_REPORT_H
#define KVQ_REPORT_H

#include <stdio.h>

#include "cqstats.h"
#include "xlayer.h"
#include "lrstats.h"
#include "kvstats.h"
#include "status.h"

typedef struct {
    const kvq_kvstats *s;
    const kvq_qerr *q;               /* NULL without an artifact */
    const char *dump_path;           /* shown in the summary (may be NULL) */
    const char *artifact_path;       /* idem */
    int detail_layer;                /* layer of the detailed figures (shown in the summary) */
    int top_n;                       /* outlier channels / sinks listed per layer (default 5 when <= 0) */
    int n_images;                    /* PNG figures for the HTML page */
    const char *const *image_paths;  /* [n_images] */
    const char *const *image_captions; /* [n_images] */
    const float *k_bias;             /* [n_stat_layers][kv_dim] the model's key biases (dump /k_bias, Qwen2), or NULL */
    const kvq_cqstats *cq;           /* codebook usage and per-group error of a cq artifact, or NULL (cqstats.h) */
    const kvq_xlayer *xl;            /* adjacent layers' similarity and retained fraction (xlayer.h), or NULL */
    const kvq_lrstats *lr;           /* explained variance of a lowrank artifact's subspaces, or NULL (lrstats.h) */
} kvq_report;

/* The key bias of one layer against its pre-RoPE keys (kvq_report.k_bias):
 * the bias dominates channel c when |b_c| >= 0.5 mean_t |k_c| (the constant
 * offset is at least half the channel's typical magnitude: a symmetric
 * quantizer must spend its range on it, an asymmetric per-channel one absorbs
 * it in the zero point). */
typedef struct {
    double norm;          /* ||b||_2 over the layer's kv_dim channels */
    double rel;           /* ||b||_2 / sqrt(sum_c mean_t k_c^2): share of the keys' RMS */
    int max_chan;         /* argmax_c |b_c| */
    double max_abs;       /* max_c |b_c| */
    int n_dom;            /* channels the bias dominates */
    int dom_chan[8];      /* the first (largest |b_c| / mean|k_c|) of them */
    double dom_ratio[8];  /* |b_c| / mean_t |k_c| */
} kvq_kbias_stats;

/* Fill st for layer j (0-based in the stat range) from r->k_bias and the pre-RoPE key statistics. */
void kvq_kbias_layer(const kvq_report *r, int j, kvq_kbias_stats *st);

/* Markdown tables to f. */
kvq_status kvq_report_markdown(FILE *f, const kvq_report *r, kvq_err *err);

/* JSON document to path ("-" = stdout). KVQ_EIO naming the file on failure. */
kvq_status kvq_report_json(const char *path, const kvq_report *r, kvq_err *err);

/* Write <dir>/index.html (dir is created if missing): title, the tables and
 * every image embedded as data:image/png;base64. KVQ_EIO if an image cannot
 * be read (naming it) or the page cannot be written. */
kvq_status kvq_report_html(const char *dir, const kvq_report *r, kvq_err *err);

/* Base64 (RFC 4648, no line breaks) of n bytes into a malloc'd NUL-terminated string; NULL on OOM. */
char *kvq_base64(const unsigned char *data, size_t n);

#endif
