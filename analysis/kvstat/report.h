/* report.h — kvstat's outputs besides plots: markdown tables, JSON (cJSON)
 * and one self-contained HTML page.
 *
 * The same tables feed the markdown and the HTML page:
 *   summary; per-layer outlier channels (count and top channels with their
 *   ratio to the layer median) for pre-RoPE keys, post-RoPE keys and values;
 *   per-layer magnitudes (absmax, p99.9, largest channel kurtosis); pre- vs
 *   post-RoPE spread; token norms (position 0 vs the median position);
 *   attention (top position, its share, the sinks with token ids) and pivot
 *   tokens; with an artifact, quantization error per layer and scheme.
 * JSON holds every number (per-channel arrays included); NaN is written as
 * null. HTML embeds each PNG as a base64 data: URI, so the page is one file
 * that opens offline.
 */
#ifndef KVQ_REPORT_H
#define KVQ_REPORT_H

#include <stdio.h>

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
} kvq_report;

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
