/* plot.h — kvstat's figures, drawn with cairo as PNG and/or SVG.
 *
 * Every function writes <path>.png and/or <path>.svg (path given without an
 * extension; the style chooses the formats) and returns KVQ_EIO naming the
 * file and cairo's reason if a surface cannot be written. Figures are sized
 * for reading at 100% zoom (about 1000 px wide, 13 px text, 12 px tick
 * labels); every axis carries a label with its unit and tick labels, and the
 * title names the model, the layer and the tensor.
 *
 * Colour maps: viridis (perceptually uniform; dark = small). Heatmaps with
 * more rows than pixels aggregate rows by their maximum, so a single large
 * token (an attention sink) stays visible.
 */
#ifndef KVQ_PLOT_H
#define KVQ_PLOT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvstats.h"
#include "xlayer.h"
#include "lrstats.h"
#include "status.h"

typedef struct {
    const char *model;   /* model name shown in titles ("" = none) */
    int width, height;   /* px; 0 = the figure's default */
    double font_px;      /* body text size (default 13; ticks use font_px - 1) */
    bool png, svg;       /* which files to write (default both) */
} kvq_plot_style;

kvq_plot_style kvq_plot_style_default(void);

/* Release cairo's and fontconfig's process-wide caches (cairo_debug_reset_static_data, FcFini),
 * so leak checkers see a clean exit. Call once at the end of a program that
 * plotted, when no cairo object is alive any more. */
void kvq_plot_cleanup(void);

/* Per-channel magnitude profile of one layer: three stacked panels (pre-RoPE
 * keys, post-RoPE keys, values), channel c = h*head_dim + d on x, |x| on y
 * (absmax, p99 and mean |x| per channel as overlaid bars), KV-head boundaries,
 * the outlier threshold (opts.outlier_mult x layer median of the outlier
 * statistic) and the top outlier channels labelled. Default 1000x900. */
kvq_status kvq_plot_channel_profile(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, int layer,
                                    kvq_err *err);

/* Token x channel |x| heatmaps of one layer, KV head and sample: n_panels
 * (1..3) side by side, panel i showing data[i] [L][head_dim] (row = position,
 * top = position 0) titled titles[i], each with its colour bar (linear,
 * 0 .. max |x| of that panel). Default 1200x700. */
kvq_status kvq_plot_heatmap(const char *path, const kvq_plot_style *st, int layer, int head, int64_t sample,
                            int n_panels, const float *const *data, const char *const *titles, int64_t L, int head_dim,
                            kvq_err *err);

/* Layer x channel outlier map of the whole dump: three stacked panels
 * (k_pre_rope, k, v), colour = channel statistic / layer median (log scale,
 * shared colour bar with the outlier threshold marked). Default 1000x900. */
kvq_status kvq_plot_outlier_map(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, kvq_err *err);

/* Attention received by position in one layer (mean over samples): one thin
 * line per query head and their mean (thick); log_y for a log y axis.
 * KVQ_EINVAL if the stats have no attention (say: kvdump --attn-stats).
 * Default 1000x500. */
kvq_status kvq_plot_attention(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, int layer, bool log_y,
                              kvq_err *err);

/* Attention sink strength per layer: fraction of all attention mass received
 * by position 0 and by the layer's top position (bars). Default 1000x450. */
kvq_status kvq_plot_attention_layers(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, kvq_err *err);

/* Histogram (counts [n_bins] over [lo, hi]) with vertical lines at levels
 * [n_levels] (e.g. the nuq levels; NULL/0 for none). title and xlabel are
 * printed as given; under/over (values outside the range) are noted in the
 * legend. Default 1000x500. */
kvq_status kvq_plot_histogram(const char *path, const kvq_plot_style *st, const char *title, const char *xlabel,
                              const uint64_t *counts, int n_bins, double lo, double hi, uint64_t under, uint64_t over,
                              const float *levels, int n_levels, const char *levels_label, bool log_y, kvq_err *err);

/* Per-layer quantization error, grouped bars per scheme, keys and values in
 * two panels, log y. relative: MSE / mean x² (dimensionless) instead of MSE
 * (squared activation units). Default 1000x700. */
kvq_status kvq_plot_qerr(const char *path, const kvq_plot_style *st, const kvq_qerr *q, bool relative, kvq_err *err);

/* Adjacent layers' similarity (xlayer.h): mean angular distance of post-RoPE keys and values per pair
 * (bars at the pair's first layer), and the MiniCache retained fraction. Default 1000x700. */
kvq_status kvq_plot_xlayer(const char *path, const kvq_plot_style *st, const kvq_xlayer *x, kvq_err *err);
/* Low-rank KV heads (lrstats.h): the explained variance realised on the dump against the rank r = 1..D, keys
 * and values in two panels, one line per layer (mean over its KV-head groups; colour viridis from the first
 * layer, dark, to the last, yellow), the artifact's own target dashed. Default 1000x700. */
kvq_status kvq_plot_lowrank(const char *path, const kvq_plot_style *st, const kvq_lrstats *s, kvq_err *err);

#endif
