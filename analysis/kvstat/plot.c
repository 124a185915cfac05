/* plot.c — see plot.h. A small axes/ticks/colour-bar engine over cairo. */
#include "plot.h"

#include <cairo-svg.h>
#include <cairo.h>
#include <fontconfig/fontconfig.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outfile.h"

kvq_plot_style kvq_plot_style_default(void)
{
    kvq_plot_style s = {.model = "", .width = 0, .height = 0, .font_px = 13, .png = true, .svg = true};
    return s;
}

void kvq_plot_cleanup(void)
{
    cairo_debug_reset_static_data();
    FcFini(); /* fontconfig's configuration, which cairo's toy font API loaded */
}

/* ---- drawing context ------------------------------------------------------------- */

typedef struct {
    cairo_t *cr;
    const kvq_plot_style *st;
    double fs; /* font size */
    int w, h;
} fig_t;

typedef struct {
    double lo, hi;
    bool log;
} axis_t;

typedef struct {
    double x, y, w, h; /* plot area in px */
    axis_t ax, ay;
    bool nogrid;       /* heatmaps: no grid lines over the image */
} panel_t;

typedef struct { double r, g, b; } rgb_t;

static const rgb_t PALETTE[] = {{0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173},
                                {0.839, 0.153, 0.157}, {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294},
                                {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498}, {0.737, 0.741, 0.133},
                                {0.090, 0.745, 0.812}};
#define N_PALETTE (int)(sizeof PALETTE / sizeof *PALETTE)

static rgb_t viridis(double t)
{
    static const double a[9][3] = {{68, 1, 84},    {71, 44, 122},  {59, 81, 139},  {44, 113, 142}, {33, 144, 141},
                                   {39, 173, 129}, {92, 200, 99},  {170, 220, 50}, {253, 231, 37}};
    if (!(t > 0)) t = 0;
    if (t > 1) t = 1;
    double u = t * 8;
    int i = (int)u;
    if (i > 7) i = 7;
    double f = u - i;
    rgb_t c = {(a[i][0] + f * (a[i + 1][0] - a[i][0])) / 255, (a[i][1] + f * (a[i + 1][1] - a[i][1])) / 255,
               (a[i][2] + f * (a[i + 1][2] - a[i][2])) / 255};
    return c;
}

static void set_rgb(cairo_t *cr, rgb_t c, double alpha) { cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha); }

static double ax_t(const axis_t *a, double v)
{
    if (a->log) {
        double l0 = log10(a->lo), l1 = log10(a->hi);
        double lv = v > 0 ? log10(v) : l0 - 1;
        return (lv - l0) / (l1 - l0);
    }
    return (v - a->lo) / (a->hi - a->lo);
}

static double px(const panel_t *p, double v) { return p->x + ax_t(&p->ax, v) * p->w; }
static double py(const panel_t *p, double v) { return p->y + p->h - ax_t(&p->ay, v) * p->h; }

/* Text anchored at (x, y): ha 0 left, 0.5 centre, 1 right; va 0 top, 0.5 middle, 1 baseline-ish bottom. */
static void text(fig_t *f, double x, double y, const char *s, double ha, double va, double size, bool bold)
{
    cairo_t *cr = f->cr;
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, size);
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    cairo_font_extents_t fe;
    cairo_font_extents(cr, &fe);
    double hh = fe.ascent + fe.descent;
    cairo_move_to(cr, x - ha * e.x_advance, y - va * hh + fe.ascent);
    cairo_show_text(cr, s);
}

static void text_rot(fig_t *f, double x, double y, const char *s, double size)
{
    cairo_save(f->cr);
    cairo_translate(f->cr, x, y);
    cairo_rotate(f->cr, -M_PI / 2);
    text(f, 0, 0, s, 0.5, 0.5, size, false);
    cairo_restore(f->cr);
}

static double text_width(fig_t *f, const char *s, double size)
{
    cairo_select_font_face(f->cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(f->cr, size);
    cairo_text_extents_t e;
    cairo_text_extents(f->cr, s, &e);
    return e.x_advance;
}

static void fmt_num(char *b, size_t n, double v)
{
    if (v == 0) { snprintf(b, n, "0"); return; }
    double a = fabs(v);
    if (a >= 1e5 || a < 1e-3) {
        int e = (int)floor(log10(a));
        double m = v / pow(10, e);
        if (fabs(m - round(m)) < 1e-9) snprintf(b, n, "%.0fe%d", m, e);
        else snprintf(b, n, "%.2ge%d", m, e);
    } else {
        snprintf(b, n, "%.6g", v);
    }
}

/* Tick values of an axis (at most max ticks). */
static int ticks(const axis_t *a, double *out, int max, int target)
{
    int n = 0;
    if (a->log) {
        int e0 = (int)ceil(log10(a->lo) - 1e-9), e1 = (int)floor(log10(a->hi) + 1e-9);
        int dec = e1 - e0 + 1, every = dec > target ? (dec + target - 1) / target : 1;
        for (int e = e0; e <= e1 && n < max; e += every) out[n++] = pow(10, e);
        if (dec <= 2) { /* add 2x and 5x */
            for (int e = e0 - 1; e <= e1 && n < max; e++)
                for (int m = 2; m <= 5; m += 3) {
                    double v = m * pow(10, e);
                    if (v >= a->lo && v <= a->hi && n < max) out[n++] = v;
                }
        }
        return n;
    }
    double lo = fmin(a->lo, a->hi), hi = fmax(a->lo, a->hi); /* reversed axes (heatmap rows) too */
    double range = hi - lo;
    if (!(range > 0)) { out[0] = lo; return 1; }
    double raw = range / target, mag = pow(10, floor(log10(raw))), r = raw / mag;
    double step = (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
    double k0 = ceil(lo / step - 1e-9);
    for (double k = k0; n < max; k++) {
        double v = k * step;
        if (v > hi + step * 1e-9) break;
        out[n++] = fabs(v) < step * 1e-9 ? 0 : v;
    }
    return n;
}

/* Axes frame: grid, ticks, tick labels, axis labels. xticks_int: x ticks only at integers. */
static void frame(fig_t *f, const panel_t *p, const char *xlabel, const char *ylabel, bool xticks_int)
{
    cairo_t *cr = f->cr;
    double t[64];
    char b[64];
    double ts = f->fs - 1;
    cairo_set_line_width(cr, 1);
    /* grid + y ticks */
    int ny = ticks(&p->ay, t, 64, (int)(p->h / 45) + 1);
    double maxw = 0;
    for (int i = 0; i < ny; i++) {
        double y = round(py(p, t[i])) + 0.5;
        if (!p->nogrid) {
            cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
            cairo_move_to(cr, p->x, y);
            cairo_line_to(cr, p->x + p->w, y);
            cairo_stroke(cr);
        }
        cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
        cairo_move_to(cr, p->x - 5, y);
        cairo_line_to(cr, p->x, y);
        cairo_stroke(cr);
        fmt_num(b, sizeof b, t[i]);
        text(f, p->x - 8, y, b, 1, 0.5, ts, false);
        double w = text_width(f, b, ts);
        if (w > maxw) maxw = w;
    }
    int nx = ticks(&p->ax, t, 64, (int)(p->w / 90) + 1);
    for (int i = 0; i < nx; i++) {
        if (xticks_int && fabs(t[i] - round(t[i])) > 1e-9) continue;
        double x = round(px(p, t[i])) + 0.5;
        cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
        cairo_move_to(cr, x, p->y + p->h);
        cairo_line_to(cr, x, p->y + p->h + 5);
        cairo_stroke(cr);
        fmt_num(b, sizeof b, t[i]);
        text(f, x, p->y + p->h + 7, b, 0.5, 0, ts, false);
    }
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    cairo_rectangle(cr, round(p->x) + 0.5, round(p->y) + 0.5, round(p->w), round(p->h));
    cairo_stroke(cr);
    if (xlabel) text(f, p->x + p->w / 2, p->y + p->h + 10 + ts * 1.3, xlabel, 0.5, 0, f->fs, false);
    if (ylabel) text_rot(f, p->x - 14 - maxw - f->fs * 0.7, p->y + p->h / 2, ylabel, f->fs);
}

static void title(fig_t *f, const char *s)
{
    cairo_set_source_rgb(f->cr, 0, 0, 0);
    text(f, f->w / 2.0, 10, s, 0.5, 0, f->fs + 2, true);
}

static void subtitle(fig_t *f, const panel_t *p, const char *s)
{
    cairo_set_source_rgb(f->cr, 0, 0, 0);
    text(f, p->x, p->y - 6, s, 0, 1, f->fs, true);
}

/* Legend row: coloured squares + labels, right-aligned ending at x_right, at y. */
static void legend(fig_t *f, double x_right, double y, int n, const rgb_t *cols, const char *const *labels, bool line)
{
    double x = x_right;
    double wsum = 0;
    for (int i = 0; i < n; i++) wsum += 22 + text_width(f, labels[i], f->fs - 1) + 14;
    x -= wsum;
    for (int i = 0; i < n; i++) {
        set_rgb(f->cr, cols[i], 1);
        if (line) {
            cairo_set_line_width(f->cr, 3);
            cairo_move_to(f->cr, x, y);
            cairo_line_to(f->cr, x + 16, y);
            cairo_stroke(f->cr);
        } else {
            cairo_rectangle(f->cr, x, y - 6, 16, 12);
            cairo_fill(f->cr);
        }
        cairo_set_source_rgb(f->cr, 0.1, 0.1, 0.1);
        text(f, x + 22, y, labels[i], 0, 0.5, f->fs - 1, false);
        x += 22 + text_width(f, labels[i], f->fs - 1) + 14;
    }
}

/* Vertical colour bar in rect (x, y, w, h) for axis a, with its label. */
static void colorbar(fig_t *f, double x, double y, double w, double h, const axis_t *a, const char *label)
{
    cairo_t *cr = f->cr;
    int n = (int)h;
    if (n < 2) n = 2;
    for (int i = 0; i < n; i++) {
        set_rgb(cr, viridis(1 - (double)i / (n - 1)), 1);
        cairo_rectangle(cr, x, y + i * h / n, w, h / n + 0.6);
        cairo_fill(cr);
    }
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    cairo_set_line_width(cr, 1);
    cairo_rectangle(cr, round(x) + 0.5, round(y) + 0.5, round(w), round(h));
    cairo_stroke(cr);
    panel_t p = {x, y, w, h, {0, 1, false}, *a, false};
    double t[64];
    char b[64];
    int nt = ticks(a, t, 64, (int)(h / 50) + 1);
    double maxw = 0;
    for (int i = 0; i < nt; i++) {
        double yy = round(py(&p, t[i])) + 0.5;
        cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
        cairo_move_to(cr, x + w, yy);
        cairo_line_to(cr, x + w + 4, yy);
        cairo_stroke(cr);
        fmt_num(b, sizeof b, t[i]);
        text(f, x + w + 6, yy, b, 0, 0.5, f->fs - 1, false);
        double tw = text_width(f, b, f->fs - 1);
        if (tw > maxw) maxw = tw;
    }
    if (label) {
        cairo_save(cr);
        cairo_translate(cr, x + w + 12 + maxw + f->fs * 0.6, y + h / 2);
        cairo_rotate(cr, M_PI / 2);
        text(f, 0, 0, label, 0.5, 0.5, f->fs, false);
        cairo_restore(cr);
    }
}

/* Paint a [rows][cols] value grid (already mapped to [0, 1], NaN = grey) into panel p. */
static kvq_status paint_grid(fig_t *f, const panel_t *p, const float *t01, int rows, int cols, kvq_err *err)
{
    cairo_surface_t *img = cairo_image_surface_create(CAIRO_FORMAT_RGB24, cols, rows);
    if (cairo_surface_status(img) != CAIRO_STATUS_SUCCESS) {
        cairo_surface_destroy(img);
        return kvq_fail(err, KVQ_ENOMEM, "plot: cannot create a %dx%d image", cols, rows);
    }
    cairo_surface_flush(img);
    unsigned char *d = cairo_image_surface_get_data(img);
    int stride = cairo_image_surface_get_stride(img);
    for (int r = 0; r < rows; r++) {
        uint32_t *row = (uint32_t *)(void *)(d + (size_t)r * (size_t)stride);
        for (int c = 0; c < cols; c++) {
            float v = t01[(size_t)r * (size_t)cols + (size_t)c];
            rgb_t col = isnan(v) ? (rgb_t){0.8, 0.8, 0.8} : viridis(v);
            row[c] = ((uint32_t)(col.r * 255 + 0.5) << 16) | ((uint32_t)(col.g * 255 + 0.5) << 8) |
                     (uint32_t)(col.b * 255 + 0.5);
        }
    }
    cairo_surface_mark_dirty(img);
    cairo_t *cr = f->cr;
    cairo_save(cr);
    cairo_rectangle(cr, p->x, p->y, p->w, p->h);
    cairo_clip(cr);
    cairo_translate(cr, p->x, p->y);
    cairo_scale(cr, p->w / cols, p->h / rows);
    cairo_set_source_surface(cr, img, 0, 0);
    cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
    cairo_paint(cr);
    cairo_restore(cr);
    cairo_surface_destroy(img);
    return KVQ_OK;
}

/* ---- render to files --------------------------------------------------------------- */

typedef kvq_status (*draw_fn)(fig_t *f, const void *arg, kvq_err *err);

static kvq_status draw_on(cairo_surface_t *surf, const kvq_plot_style *st, int w, int h, draw_fn fn, const void *arg,
                          kvq_err *err)
{
    cairo_t *cr = cairo_create(surf);
    fig_t f = {cr, st, st->font_px > 0 ? st->font_px : 13, w, h};
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    kvq_status s = fn(&f, arg, err);
    cairo_status_t cs = cairo_status(cr);
    cairo_destroy(cr);
    if (s == KVQ_OK && cs != CAIRO_STATUS_SUCCESS)
        s = kvq_fail(err, KVQ_EIO, "plot: cairo: %s", cairo_status_to_string(cs));
    return s;
}

static kvq_status render(const char *path, const kvq_plot_style *st, int dw, int dh, draw_fn fn, const void *arg,
                         kvq_err *err)
{
    int w = st->width > 0 ? st->width : dw, h = st->height > 0 ? st->height : dh;
    char file[4200], tmp[4300];
    if (strlen(path) > 4096) return kvq_fail(err, KVQ_EINVAL, "plot: path too long");
    if (st->png) {
        snprintf(file, sizeof file, "%s.png", path);
        KVQ_TRY(kvq_outfile_tmpname(file, tmp, sizeof tmp, err));
        cairo_surface_t *s = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, w, h);
        kvq_status r = draw_on(s, st, w, h, fn, arg, err);
        if (r == KVQ_OK) {
            errno = 0;
            cairo_status_t cs = cairo_surface_write_to_png(s, tmp);
            if (cs != CAIRO_STATUS_SUCCESS) {
                const int e = errno; /* cairo's message does not say why the stream failed (e.g. EFBIG, ENOSPC) */
                remove(tmp);
                r = kvq_fail(err, KVQ_EIO, "%s: cannot write PNG: %s%s%s%s", tmp, cairo_status_to_string(cs), e ? " (" : "",
                             e ? strerror(e) : "", e ? ")" : "");
            }
        }
        cairo_surface_destroy(s);
        KVQ_TRY(r);
        KVQ_TRY(kvq_outfile_rename(tmp, file, err));
    }
    if (st->svg) {
        snprintf(file, sizeof file, "%s.svg", path);
        KVQ_TRY(kvq_outfile_tmpname(file, tmp, sizeof tmp, err));
        cairo_surface_t *s = cairo_svg_surface_create(tmp, w, h);
        if (cairo_surface_status(s) != CAIRO_STATUS_SUCCESS) {
            kvq_status r = kvq_fail(err, KVQ_EIO, "%s: cannot create SVG: %s", tmp,
                                    cairo_status_to_string(cairo_surface_status(s)));
            cairo_surface_destroy(s);
            remove(tmp);
            return r;
        }
        kvq_status r = draw_on(s, st, w, h, fn, arg, err);
        errno = 0;
        cairo_surface_finish(s);
        cairo_status_t cs = cairo_surface_status(s);
        const int e = errno;
        cairo_surface_destroy(s);
        if (r == KVQ_OK && cs != CAIRO_STATUS_SUCCESS)
            r = kvq_fail(err, KVQ_EIO, "%s: cannot write SVG: %s%s%s%s", tmp, cairo_status_to_string(cs), e ? " (" : "",
                         e ? strerror(e) : "", e ? ")" : "");
        if (r != KVQ_OK) {
            remove(tmp);
            return r;
        }
        KVQ_TRY(kvq_outfile_rename(tmp, file, err));
    }
    return KVQ_OK;
}

static void model_prefix(char *b, size_t n, const kvq_plot_style *st)
{
    if (st->model && *st->model) snprintf(b, n, "%s — ", st->model);
    else b[0] = 0;
}

/* ---- channel profile ------------------------------------------------------------------ */

typedef struct {
    const kvq_kvstats *s;
    const kvq_layer_stats *ls;
} prof_arg;

static kvq_status draw_profile(fig_t *f, const void *varg, kvq_err *err)
{
    (void)err;
    const prof_arg *a = varg;
    const kvq_kvstats *s = a->s;
    const kvq_layer_stats *ls = a->ls;
    cairo_t *cr = f->cr;
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%slayer %d: per-channel magnitude |x| (%lld samples × %lld tokens)", mp, ls->layer,
             (long long)s->n_samples, (long long)s->seq_len);
    title(f, b);
    static const rgb_t cols[3] = {{0.70, 0.82, 0.93}, {0.30, 0.55, 0.80}, {0.03, 0.19, 0.42}};
    const char *labels[3] = {"absmax", "p99", "mean |x|"};
    legend(f, f->w - 30, 44, 3, cols, labels, false);
    double top = 80, bottom = 60, gap = 70;
    double ph = (f->h - top - bottom - 2 * gap) / 3;
    int kv = s->kv_dim;
    for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
        const kvq_tensor_stats *ts = &ls->t[t];
        double ymax = 0;
        for (int c = 0; c < kv; c++) if (ts->chan[c].absmax > ymax) ymax = ts->chan[c].absmax;
        if (!(ymax > 0)) ymax = 1;
        panel_t p = {85, top + t * (ph + gap), f->w - 85 - 30, ph, {-0.5, kv - 0.5, false}, {0, ymax * 1.08, false}, false};
        snprintf(b, sizeof b, "%s (%s)   ·   %d outlier channel%s (%s ≥ %g× layer median)", kvq_kvt_title((kvq_kvt)t),
                 kvq_kvt_name((kvq_kvt)t), ts->n_outliers, ts->n_outliers == 1 ? "" : "s",
                 kvq_outlier_stat_name(s->opts.outlier_stat), s->opts.outlier_mult);
        subtitle(f, &p, b);
        frame(f, &p, t == 2 ? "channel (KV head × head_dim + dim)" : NULL, "|x| (activation units)", true);
        double bw = p.w / kv;
        for (int layer = 0; layer < 3; layer++) {
            set_rgb(cr, cols[layer], 1);
            for (int c = 0; c < kv; c++) {
                const kvq_chan_stats *cs = &ts->chan[c];
                double v = layer == 0 ? cs->absmax : layer == 1 ? cs->p99 : cs->mean_abs;
                double x0 = px(&p, c - 0.5), y0 = py(&p, v);
                cairo_rectangle(cr, x0 + (bw > 3 ? 0.5 : 0), y0, bw > 3 ? bw - 1 : bw, p.y + p.h - y0);
            }
            cairo_fill(cr);
        }
        /* head boundaries */
        cairo_set_source_rgba(cr, 0.3, 0.3, 0.3, 0.8);
        cairo_set_line_width(cr, 1);
        double dash[] = {4, 3};
        cairo_set_dash(cr, dash, 2, 0);
        for (int h = 1; h < s->n_kv_heads; h++) {
            double x = round(px(&p, h * s->head_dim - 0.5)) + 0.5;
            cairo_move_to(cr, x, p.y);
            cairo_line_to(cr, x, p.y + p.h);
        }
        cairo_stroke(cr);
        for (int h = 0; h < s->n_kv_heads && s->n_kv_heads <= 32; h++) {
            snprintf(b, sizeof b, "head %d", h);
            cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
            text(f, px(&p, h * s->head_dim - 0.5) + 4, p.y + 4, b, 0, 0, f->fs - 2, false);
        }
        /* outlier threshold */
        double thr = s->opts.outlier_mult * ts->median_stat;
        if (thr > 0 && thr < p.ay.hi) {
            cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
            cairo_set_line_width(cr, 1.5);
            cairo_move_to(cr, p.x, py(&p, thr));
            cairo_line_to(cr, p.x + p.w, py(&p, thr));
            cairo_stroke(cr);
            snprintf(b, sizeof b, "threshold %.3g", thr);
            double tw = text_width(f, b, f->fs - 2);
            cairo_set_source_rgba(cr, 1, 1, 1, 0.85);
            cairo_rectangle(cr, p.x + p.w - 8 - tw, py(&p, thr) - 4 - f->fs, tw + 6, f->fs + 1);
            cairo_fill(cr);
            cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
            text(f, p.x + p.w - 5, py(&p, thr) - 3, b, 1, 1, f->fs - 2, false);
        }
        cairo_set_dash(cr, NULL, 0, 0);
        /* top outliers labelled */
        cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
        for (int i = 0; i < ts->n_outliers && i < 5; i++) {
            int c = ts->outlier_chan[i];
            double v = ts->chan[c].absmax;
            snprintf(b, sizeof b, "%d", c);
            text(f, px(&p, c), py(&p, v) - 2, b, 0.5, 1, f->fs - 2, true);
        }
    }
    return KVQ_OK;
}

kvq_status kvq_plot_channel_profile(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, int layer,
                                    kvq_err *err)
{
    const kvq_layer_stats *ls = kvq_kvstats_layer(s, layer);
    if (!ls) return kvq_fail(err, KVQ_EINVAL, "layer %d is not in the dump (layers %d..%d)", layer, s->layer_first, s->layer_last);
    prof_arg a = {s, ls};
    return render(path, st, 1000, 900, draw_profile, &a, err);
}

/* ---- heatmap ------------------------------------------------------------------------------ */

typedef struct {
    int layer, head, n;
    int64_t sample, L;
    int D;
    const float *const *data;
    const char *const *titles;
} heat_arg;

static kvq_status draw_heat(fig_t *f, const void *varg, kvq_err *err)
{
    const heat_arg *a = varg;
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%slayer %d, KV head %d, sample %lld: |x| per token and channel", mp, a->layer, a->head,
             (long long)a->sample);
    title(f, b);
    double left = 70, right = 20, cbw = 16, cbspace = 78, gap = 50;
    double pw = (f->w - left - right - a->n * (cbw + cbspace) - (a->n - 1) * gap) / a->n;
    double top = 70, ph = f->h - top - 70;
    int rows = a->L > (int64_t)ph ? (int)ph : (int)a->L;
    float *g = malloc((size_t)rows * (size_t)a->D * sizeof(float));
    if (!g) return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory");
    for (int i = 0; i < a->n; i++) {
        const float *d = a->data[i];
        double mx = 0;
        for (int64_t k = 0; k < a->L * a->D; k++) if (fabs(d[k]) > mx) mx = fabs(d[k]);
        if (!(mx > 0)) mx = 1;
        for (int r = 0; r < rows; r++) {
            int64_t t0 = (int64_t)r * a->L / rows, t1 = (int64_t)(r + 1) * a->L / rows;
            if (t1 <= t0) t1 = t0 + 1;
            for (int c = 0; c < a->D; c++) {
                double m = 0;
                for (int64_t t = t0; t < t1; t++) if (fabs(d[t * a->D + c]) > m) m = fabs(d[t * a->D + c]);
                g[(size_t)r * (size_t)a->D + (size_t)c] = (float)(m / mx);
            }
        }
        double x = left + i * (pw + cbw + cbspace + gap);
        panel_t p = {x, top, pw, ph, {-0.5, a->D - 0.5, false}, {a->L - 0.5, -0.5, false}, true};
        subtitle(f, &p, a->titles[i]);
        kvq_status st = paint_grid(f, &p, g, rows, a->D, err);
        if (st != KVQ_OK) { free(g); return st; }
        frame(f, &p, "channel within head", i == 0 ? "token position" : NULL, true);
        axis_t ca = {0, mx, false};
        colorbar(f, x + pw + 10, top, cbw, ph, &ca, "|x| (activation units)");
    }
    free(g);
    return KVQ_OK;
}

kvq_status kvq_plot_heatmap(const char *path, const kvq_plot_style *st, int layer, int head, int64_t sample,
                            int n_panels, const float *const *data, const char *const *titles, int64_t L, int head_dim,
                            kvq_err *err)
{
    if (n_panels < 1 || n_panels > 3 || L < 1 || head_dim < 1)
        return kvq_fail(err, KVQ_EINVAL, "heatmap: expected 1..3 panels of [L>=1][head_dim>=1], found %d of [%lld][%d]",
                        n_panels, (long long)L, head_dim);
    heat_arg a = {layer, head, n_panels, sample, L, head_dim, data, titles};
    return render(path, st, 1200, 700, draw_heat, &a, err);
}

/* ---- outlier map --------------------------------------------------------------------------- */

static kvq_status draw_omap(fig_t *f, const void *varg, kvq_err *err)
{
    const kvq_kvstats *s = varg;
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%soutlier channels, all layers: channel %s |x| / layer median", mp,
             kvq_outlier_stat_name(s->opts.outlier_stat));
    title(f, b);
    int nl = s->n_stat_layers, kv = s->kv_dim;
    double rmax = s->opts.outlier_mult * 2;
    for (int j = 0; j < nl; j++)
        for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
            const kvq_tensor_stats *ts = &s->layers[j].t[t];
            double med = ts->median_stat > 0 ? ts->median_stat : 1e-300;
            for (int c = 0; c < kv; c++) {
                double r = kvq_chan_stat_value(&ts->chan[c], s->opts.outlier_stat) / med;
                if (r > rmax && isfinite(r)) rmax = r;
            }
        }
    axis_t ca = {0.25, rmax, true};
    float *g = malloc((size_t)nl * (size_t)kv * sizeof(float));
    if (!g) return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory");
    double top = 70, bottom = 60, gap = 60, left = 70, right = 130;
    double ph = (f->h - top - bottom - 2 * gap) / 3;
    for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
        for (int j = 0; j < nl; j++) {
            const kvq_tensor_stats *ts = &s->layers[j].t[t];
            double med = ts->median_stat > 0 ? ts->median_stat : 1e-300;
            for (int c = 0; c < kv; c++) {
                double r = kvq_chan_stat_value(&ts->chan[c], s->opts.outlier_stat) / med;
                g[(size_t)(nl - 1 - j) * (size_t)kv + (size_t)c] = (float)ax_t(&ca, r < ca.lo ? ca.lo : r);
            }
        }
        panel_t p = {left, top + t * (ph + gap), f->w - left - right, ph, {-0.5, kv - 0.5, false},
                     {s->layer_first - 0.5, s->layer_last + 0.5, false}, true};
        snprintf(b, sizeof b, "%s (%s)", kvq_kvt_title((kvq_kvt)t), kvq_kvt_name((kvq_kvt)t));
        subtitle(f, &p, b);
        kvq_status st = paint_grid(f, &p, g, nl, kv, err);
        if (st != KVQ_OK) { free(g); return st; }
        frame(f, &p, t == 2 ? "channel (KV head × head_dim + dim)" : NULL, "layer", true);
    }
    free(g);
    double cy = top, ch = f->h - top - bottom;
    colorbar(f, f->w - right + 20, cy, 16, ch, &ca, "channel magnitude / layer median");
    panel_t cp = {f->w - right + 20, cy, 16, ch, {0, 1, false}, ca, false};
    double ty = py(&cp, s->opts.outlier_mult);
    cairo_set_source_rgb(f->cr, 0.84, 0.15, 0.16);
    cairo_set_line_width(f->cr, 2);
    cairo_move_to(f->cr, cp.x - 4, ty);
    cairo_line_to(f->cr, cp.x + 20, ty);
    cairo_stroke(f->cr);
    return KVQ_OK;
}

kvq_status kvq_plot_outlier_map(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, kvq_err *err)
{
    return render(path, st, 1000, 900, draw_omap, s, err);
}

/* ---- attention ------------------------------------------------------------------------------ */

typedef struct {
    const kvq_kvstats *s;
    const kvq_layer_stats *ls;
    bool log_y;
} attn_arg;

static kvq_status draw_attn(fig_t *f, const void *varg, kvq_err *err)
{
    const attn_arg *a = varg;
    const kvq_kvstats *s = a->s;
    const kvq_layer_stats *ls = a->ls;
    cairo_t *cr = f->cr;
    size_t L = (size_t)s->seq_len, H = (size_t)s->n_heads;
    double *mean = calloc(L, sizeof(double));
    if (!mean) return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory");
    double ymax = 0, ymin = INFINITY;
    for (size_t h = 0; h < H; h++)
        for (size_t j = 0; j < L; j++) {
            double v = ls->attn_recv[h * L + j];
            mean[j] += v / (double)H;
            if (v > ymax) ymax = v;
            if (v > 0 && v < ymin) ymin = v;
        }
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%slayer %d: attention received by position (mean over %lld samples)", mp, ls->layer,
             (long long)s->n_samples);
    title(f, b);
    if (!(ymax > 0)) ymax = 1;
    if (!(ymin < ymax)) ymin = ymax / 10;
    axis_t ay = a->log_y ? (axis_t){pow(10, floor(log10(ymin))), pow(10, ceil(log10(ymax))), true}
                         : (axis_t){0, ymax * 1.05, false};
    panel_t p = {90, 70, f->w - 90 - 30, f->h - 70 - 65, {0, L > 1 ? (double)(L - 1) : 1, false}, ay, false};
    frame(f, &p, "key position (token index in the sample)",
          a->log_y ? "attention received (log)" : "attention received (Σ over queries)", true);
    cairo_save(cr);
    cairo_rectangle(cr, p.x, p.y, p.w, p.h);
    cairo_clip(cr);
    cairo_set_line_width(cr, 1);
    for (size_t h = 0; h < H; h++) {
        set_rgb(cr, PALETTE[h % N_PALETTE], 0.55);
        for (size_t j = 0; j < L; j++) {
            double x = px(&p, (double)j), y = py(&p, ls->attn_recv[h * L + j]);
            if (j == 0) cairo_move_to(cr, x, y);
            else cairo_line_to(cr, x, y);
        }
        cairo_stroke(cr);
    }
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_set_line_width(cr, 2.2);
    for (size_t j = 0; j < L; j++) {
        double x = px(&p, (double)j), y = py(&p, mean[j]);
        if (j == 0) cairo_move_to(cr, x, y);
        else cairo_line_to(cr, x, y);
    }
    cairo_stroke(cr);
    cairo_restore(cr);
    /* annotate the top position */
    if (ls->top_pos >= 0) {
        snprintf(b, sizeof b, "top: position %lld (%.1f%% of all attention)", (long long)ls->top_pos, 100 * ls->top_frac);
        cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
        text(f, p.x + p.w - 6, p.y + 6, b, 1, 0, f->fs, true);
    }
    rgb_t lc[2] = {{0, 0, 0}, PALETTE[0]};
    snprintf(b, sizeof b, "each of %zu query heads", H);
    const char *ll[2] = {"mean over heads", b};
    legend(f, f->w - 30, 46, 2, lc, ll, true);
    free(mean);
    return KVQ_OK;
}

static kvq_status need_attn(const kvq_kvstats *s, kvq_err *err)
{
    if (!s->has_attn)
        return kvq_fail(err, KVQ_EINVAL,
                        "the dump has no attn_received (attention plots need it): re-run kvdump with --attn-stats");
    return KVQ_OK;
}

kvq_status kvq_plot_attention(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, int layer, bool log_y,
                              kvq_err *err)
{
    KVQ_TRY(need_attn(s, err));
    const kvq_layer_stats *ls = kvq_kvstats_layer(s, layer);
    if (!ls) return kvq_fail(err, KVQ_EINVAL, "layer %d is not in the dump (layers %d..%d)", layer, s->layer_first, s->layer_last);
    attn_arg a = {s, ls, log_y};
    return render(path, st, 1000, 500, draw_attn, &a, err);
}

/* ---- grouped bars (attention per layer, quantization error) ------------------------------------ */

typedef struct {
    int n_groups, n_series;
    const double *v;          /* [n_series][n_groups] */
    const char *const *names; /* [n_series] */
    int first_label;          /* x label of group 0 (layer index) */
    bool log_y;
} bars_t;

static void draw_bars(fig_t *f, const panel_t *p0, const bars_t *b, const char *xlabel, const char *ylabel)
{
    cairo_t *cr = f->cr;
    double vmax = 0, vmin = INFINITY;
    for (int i = 0; i < b->n_series * b->n_groups; i++) {
        double v = b->v[i];
        if (!isfinite(v)) continue;
        if (v > vmax) vmax = v;
        if (v > 0 && v < vmin) vmin = v;
    }
    if (!(vmax > 0)) vmax = 1;
    if (!(vmin < vmax)) vmin = vmax / 10;
    panel_t p = *p0;
    p.ax = (axis_t){b->first_label - 0.5, b->first_label + b->n_groups - 0.5, false};
    p.ay = b->log_y ? (axis_t){pow(10, floor(log10(vmin) - 0.5)), pow(10, ceil(log10(vmax))), true}
                    : (axis_t){0, vmax * 1.08, false};
    frame(f, &p, xlabel, ylabel, true);
    double gw = p.w / b->n_groups, bw = gw * 0.8 / b->n_series;
    for (int si = 0; si < b->n_series; si++) {
        set_rgb(cr, PALETTE[si % N_PALETTE], 1);
        for (int g = 0; g < b->n_groups; g++) {
            double v = b->v[si * b->n_groups + g];
            if (!isfinite(v) || (b->log_y && !(v > 0))) continue;
            double x = p.x + g * gw + gw * 0.1 + si * bw, y = py(&p, v), y0 = p.y + p.h;
            if (y < p.y) y = p.y;
            cairo_rectangle(cr, x, y, bw > 2 ? bw - 0.5 : bw, y0 - y);
        }
        cairo_fill(cr);
    }
}

static kvq_status draw_attn_layers(fig_t *f, const void *varg, kvq_err *err)
{
    (void)err;
    const kvq_kvstats *s = varg;
    int nl = s->n_stat_layers;
    size_t L = (size_t)s->seq_len, H = (size_t)s->n_heads;
    double *v = calloc(2 * (size_t)nl, sizeof(double));
    if (!v) return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory");
    for (int j = 0; j < nl; j++) {
        const kvq_layer_stats *ls = &s->layers[j];
        double tot = 0, p0 = 0;
        for (size_t h = 0; h < H; h++)
            for (size_t k = 0; k < L; k++) { tot += ls->attn_recv[h * L + k]; if (k == 0) p0 += ls->attn_recv[h * L]; }
        v[j] = tot > 0 ? p0 / tot : 0;
        v[nl + j] = ls->top_frac;
    }
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%sattention sink strength per layer (mean over %lld samples × %d heads)", mp,
             (long long)s->n_samples, s->n_heads);
    title(f, b);
    const char *names[2] = {"position 0", "layer's top position"};
    bars_t bars = {nl, 2, v, names, s->layer_first, false};
    panel_t p = {90, 70, f->w - 90 - 30, f->h - 70 - 65, {0, 1, false}, {0, 1, false}, false};
    draw_bars(f, &p, &bars, "layer", "fraction of all attention mass");
    rgb_t lc[2] = {PALETTE[0], PALETTE[1]};
    legend(f, f->w - 30, 46, 2, lc, names, false);
    free(v);
    return KVQ_OK;
}

kvq_status kvq_plot_attention_layers(const char *path, const kvq_plot_style *st, const kvq_kvstats *s, kvq_err *err)
{
    KVQ_TRY(need_attn(s, err));
    return render(path, st, 1000, 450, draw_attn_layers, s, err);
}

typedef struct {
    const kvq_qerr *q;
    bool rel;
} qerr_arg;

static kvq_status draw_qerr(fig_t *f, const void *varg, kvq_err *err)
{
    const qerr_arg *a = varg;
    const kvq_qerr *q = a->q;
    int nl = q->n_stat_layers, ns = q->n_schemes;
    double *v = malloc((size_t)ns * (size_t)nl * sizeof(double));
    const char **names = malloc((size_t)ns * sizeof *names);
    rgb_t *cols = malloc((size_t)ns * sizeof *cols);
    if (!v || !names || !cols) { free(v); free(names); free(cols); return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory"); }
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%squantization error per layer%s", mp, a->rel ? " (relative: MSE / mean x²)" : " (MSE)");
    title(f, b);
    for (int si = 0; si < ns; si++) { names[si] = q->names[si]; cols[si] = PALETTE[si % N_PALETTE]; }
    double top = 80, bottom = 60, gap = 70, ph = (f->h - top - bottom - gap) / 2;
    for (int w = 0; w < 2; w++) {
        const double *m = w ? q->mse_v : q->mse_k, *sig = w ? q->sig_v : q->sig_k;
        for (int si = 0; si < ns; si++)
            for (int j = 0; j < nl; j++) {
                double e = m[(size_t)si * (size_t)nl + (size_t)j];
                v[(size_t)si * (size_t)nl + (size_t)j] = a->rel ? (sig[j] > 0 ? e / sig[j] : NAN) : e;
            }
        bars_t bars = {nl, ns, v, names, q->layer_first, true};
        panel_t p = {95, top + w * (ph + gap), f->w - 95 - 30, ph, {0, 1, false}, {0, 1, false}, false};
        subtitle(f, &p, w ? "values (v)" : "keys (each scheme's key tensor: pre- or post-RoPE)");
        draw_bars(f, &p, &bars, w ? "layer" : NULL, a->rel ? "MSE / mean x² (log)" : "MSE (squared units, log)");
    }
    legend(f, f->w - 30, 46, ns, cols, names, false);
    free(v); free(names); free(cols);
    return KVQ_OK;
}

kvq_status kvq_plot_qerr(const char *path, const kvq_plot_style *st, const kvq_qerr *q, bool relative, kvq_err *err)
{
    if (!q || q->n_schemes < 1 || q->n_stat_layers < 1) return kvq_fail(err, KVQ_EINVAL, "quantization error plot: no data");
    qerr_arg a = {q, relative};
    return render(path, st, 1000, 700, draw_qerr, &a, err);
}

/* ---- cross-layer similarity ---------------------------------------------------------------- */

static kvq_status draw_xlayer(fig_t *f, const void *varg, kvq_err *err)
{
    const kvq_xlayer *x = varg;
    int n = x->n_pairs;
    double *v = malloc(2 * (size_t)n * sizeof(double));
    if (!v) return kvq_fail(err, KVQ_ENOMEM, "plot: out of memory");
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%sadjacent layers (l, l+1): similarity and MiniCache retention", mp);
    title(f, b);
    static const char *const names[2] = {"keys (post-RoPE)", "values"};
    const rgb_t cols[2] = {PALETTE[0], PALETTE[1]};
    double top = 80, bottom = 60, gap = 70, ph = (f->h - top - bottom - gap) / 2;
    for (int w = 0; w < 2; w++) {
        memcpy(v, w ? x->ret_k : x->dist_k, (size_t)n * sizeof(double));
        memcpy(v + n, w ? x->ret_v : x->dist_v, (size_t)n * sizeof(double));
        bars_t bars = {n, 2, v, names, x->layer_first, false};
        panel_t p = {95, top + w * (ph + gap), f->w - 95 - 30, ph, {0, 1, false}, {0, 1, false}, false};
        char sub[160];
        if (w && x->artifact) snprintf(sub, sizeof sub, "retained unmerged (the minicache artifact's thresholds)");
        else if (w) snprintf(sub, sizeof sub, "retained unmerged (distance > d_max - (d_max - d_min) %g per KV head)", x->gamma);
        else snprintf(sub, sizeof sub, "mean angular distance arccos(cos) / pi per (token, KV head): 0 = same direction, 0.5 = orthogonal");
        subtitle(f, &p, sub);
        draw_bars(f, &p, &bars, w ? "first layer l of the pair" : NULL, w ? "fraction" : "angular distance");
    }
    legend(f, f->w - 30, 46, 2, cols, names, false);
    free(v);
    return KVQ_OK;
}

kvq_status kvq_plot_xlayer(const char *path, const kvq_plot_style *st, const kvq_xlayer *x, kvq_err *err)
{
    if (!x || x->n_pairs < 1) return kvq_fail(err, KVQ_EINVAL, "cross-layer plot: no data");
    return render(path, st, 1000, 700, draw_xlayer, x, err);
}

/* ---- histogram ----------------------------------------------------------------------------- */

typedef struct {
    const char *title, *xlabel, *levels_label;
    const uint64_t *counts;
    int n_bins, n_levels;
    double lo, hi;
    uint64_t under, over;
    const float *levels;
    bool log_y;
} hist_arg;

static kvq_status draw_hist(fig_t *f, const void *varg, kvq_err *err)
{
    (void)err;
    const hist_arg *a = varg;
    cairo_t *cr = f->cr;
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%s%s", mp, a->title);
    title(f, b);
    double cmax = 0, cmin = INFINITY;
    for (int i = 0; i < a->n_bins; i++) {
        double c = (double)a->counts[i];
        if (c > cmax) cmax = c;
        if (c > 0 && c < cmin) cmin = c;
    }
    if (!(cmax > 0)) cmax = 1;
    if (!(cmin < cmax)) cmin = cmax / 10;
    axis_t ay = a->log_y ? (axis_t){pow(10, floor(log10(cmin))), pow(10, ceil(log10(cmax))), true}
                         : (axis_t){0, cmax * 1.08, false};
    panel_t p = {95, 70, f->w - 95 - 30, f->h - 70 - 65, {a->lo, a->hi, false}, ay, false};
    frame(f, &p, a->xlabel, a->log_y ? "count (log)" : "count", false);
    double bw = (a->hi - a->lo) / a->n_bins;
    cairo_set_source_rgb(cr, 0.30, 0.55, 0.80);
    for (int i = 0; i < a->n_bins; i++) {
        double c = (double)a->counts[i];
        if (!(c > 0)) continue;
        double x0 = px(&p, a->lo + i * bw), x1 = px(&p, a->lo + (i + 1) * bw), y = py(&p, c);
        cairo_rectangle(cr, x0, y, x1 - x0, p.y + p.h - y);
    }
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
    cairo_set_line_width(cr, 1.3);
    for (int i = 0; i < a->n_levels; i++) {
        if (a->levels[i] < a->lo || a->levels[i] > a->hi) continue;
        double x = px(&p, a->levels[i]);
        cairo_move_to(cr, x, p.y);
        cairo_line_to(cr, x, p.y + p.h);
    }
    cairo_stroke(cr);
    char ob[200];
    snprintf(ob, sizeof ob, "outside [%g, %g]: %llu below, %llu above", a->lo, a->hi, (unsigned long long)a->under,
             (unsigned long long)a->over);
    rgb_t lc[3] = {{0.30, 0.55, 0.80}, {0.84, 0.15, 0.16}, {1, 1, 1}};
    const char *ll[3] = {"count per bin", a->levels_label ? a->levels_label : "levels", ob};
    legend(f, f->w - 30, 46, a->n_levels > 0 ? 3 : 2, lc, a->n_levels > 0 ? ll : (const char *[]){ll[0], ob}, false);
    return KVQ_OK;
}

kvq_status kvq_plot_histogram(const char *path, const kvq_plot_style *st, const char *title_s, const char *xlabel,
                              const uint64_t *counts, int n_bins, double lo, double hi, uint64_t under, uint64_t over,
                              const float *levels, int n_levels, const char *levels_label, bool log_y, kvq_err *err)
{
    if (n_bins < 1 || !(hi > lo)) return kvq_fail(err, KVQ_EINVAL, "histogram: bad range [%g, %g] or %d bins", lo, hi, n_bins);
    hist_arg a = {title_s, xlabel, levels_label, counts, n_bins, levels ? n_levels : 0, lo, hi, under, over, levels, log_y};
    return render(path, st, 1000, 500, draw_hist, &a, err);
}

/* ---- low-rank KV heads: explained variance by rank ------------------------------------------ */

static kvq_status draw_lowrank(fig_t *f, const void *varg, kvq_err *err)
{
    (void)err;
    const kvq_lrstats *s = varg;
    cairo_t *cr = f->cr;
    int nl = s->n_stat_layers, G = s->n_groups, D = s->D;
    char b[512], mp[300];
    model_prefix(mp, sizeof mp, f->st);
    snprintf(b, sizeof b, "%slow-rank KV heads: explained variance on the dump by rank (groups of %d KV heads, %d channels)", mp, s->G,
             D);
    title(f, b);
    double top = 80, bottom = 60, gap = 70, ph = (f->h - top - bottom - gap) / 2;
    for (int w = 0; w < 2; w++) {
        const double *ev = w ? s->dump_v : s->dump_k;
        double lo = 1;
        for (int j = 0; j < nl * G * D; j++)
            if (ev[j] < lo) lo = ev[j];
        lo = floor(fmax(0, lo) * 10) / 10;
        panel_t p = {95, top + w * (ph + gap), f->w - 95 - 30, ph, {1, D > 1 ? D : 2, false}, {lo, 1.0, false}, false};
        subtitle(f, &p, w ? "values (v)" : "keys (the artifact's stage)");
        frame(f, &p, w ? "rank r (directions kept per group)" : NULL, "explained variance", true);
        cairo_save(cr);
        cairo_rectangle(cr, p.x, p.y, p.w, p.h);
        cairo_clip(cr);
        /* the artifact's own target */
        cairo_set_source_rgb(cr, 0.84, 0.15, 0.16);
        cairo_set_line_width(cr, 1.2);
        double dash[2] = {6, 4};
        cairo_set_dash(cr, dash, 2, 0);
        cairo_move_to(cr, p.x, py(&p, s->ev_target));
        cairo_line_to(cr, p.x + p.w, py(&p, s->ev_target));
        cairo_stroke(cr);
        cairo_set_dash(cr, NULL, 0, 0);
        cairo_set_line_width(cr, 1.6);
        for (int j = 0; j < nl; j++) { /* one line per layer: mean over the groups */
            set_rgb(cr, viridis(nl > 1 ? (double)j / (nl - 1) : 0), 0.9);
            for (int r = 0; r < D; r++) {
                double m = 0;
                for (int g = 0; g < G; g++) m += ev[((size_t)j * G + g) * D + r] / G;
                double x = px(&p, r + 1), y = py(&p, m);
                if (r == 0) cairo_move_to(cr, x, y);
                else cairo_line_to(cr, x, y);
            }
            cairo_stroke(cr);
        }
        cairo_restore(cr);
    }
    rgb_t lc[3] = {viridis(0), viridis(1), {0.84, 0.15, 0.16}};
    char l0[64], l1[64], l2[64];
    snprintf(l0, sizeof l0, "layer %d", s->layer_first);
    snprintf(l1, sizeof l1, "layer %d", s->layer_first + nl - 1);
    snprintf(l2, sizeof l2, "artifact target %g%%", s->ev_target * 100);
    const char *ll[3] = {l0, l1, l2};
    legend(f, f->w - 30, 46, 3, lc, ll, true);
    return KVQ_OK;
}

kvq_status kvq_plot_lowrank(const char *path, const kvq_plot_style *st, const kvq_lrstats *s, kvq_err *err)
{
    if (!s || s->n_stat_layers < 1 || s->D < 1) return kvq_fail(err, KVQ_EINVAL, "low-rank plot: no data");
    return render(path, st, 1000, 700, draw_lowrank, s, err);
}
