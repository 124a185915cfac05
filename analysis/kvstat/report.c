/* report.c — see report.h. */
#include "report.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "outfile.h"
#include "version.h"

/* ---- tables ------------------------------------------------------------------------- */

#define CELL_MAX 256

typedef struct {
    char title[160];
    char note[400];
    int ncols, nrows, cap;
    char (*cells)[CELL_MAX]; /* [(nrows + 1) * ncols], row 0 = header */
} table_t;

static bool table_init(table_t *t, const char *title, const char *note, int ncols, const char *const *header)
{
    memset(t, 0, sizeof *t);
    snprintf(t->title, sizeof t->title, "%s", title);
    snprintf(t->note, sizeof t->note, "%s", note ? note : "");
    t->ncols = ncols;
    t->cap = 16;
    t->cells = calloc((size_t)(t->cap + 1) * (size_t)ncols, sizeof *t->cells);
    if (!t->cells) return false;
    for (int c = 0; c < ncols; c++) snprintf(t->cells[c], CELL_MAX, "%s", header[c]);
    return true;
}

static void table_free(table_t *t) { free(t->cells); t->cells = NULL; }

/* Append a row; returns the row's cells or NULL on OOM. */
static char (*table_row(table_t *t))[CELL_MAX]
{
    if (t->nrows == t->cap) {
        int nc = t->cap * 2;
        void *p = realloc(t->cells, (size_t)(nc + 1) * (size_t)t->ncols * sizeof *t->cells);
        if (!p) return NULL;
        t->cells = p;
        t->cap = nc;
    }
    t->nrows++;
    char (*row)[CELL_MAX] = t->cells + (size_t)t->nrows * (size_t)t->ncols;
    memset(row, 0, (size_t)t->ncols * sizeof *row);
    return row;
}

static void cellf(char *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void cellf(char *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c, CELL_MAX, fmt, ap);
    va_end(ap);
}

static void num(char *c, double v)
{
    if (!isfinite(v)) cellf(c, "–");
    else cellf(c, "%.4g", v);
}

static void md_table(FILE *f, const table_t *t)
{
    fprintf(f, "\n### %s\n\n", t->title);
    if (t->note[0]) fprintf(f, "%s\n\n", t->note);
    for (int r = 0; r <= t->nrows; r++) {
        fputc('|', f);
        for (int c = 0; c < t->ncols; c++) {
            fputc(' ', f);
            for (const char *p = t->cells[(size_t)r * (size_t)t->ncols + (size_t)c]; *p; p++) {
                if (*p == '|') fputc('\\', f);
                fputc(*p, f);
            }
            fputs(" |", f);
        }
        fputc('\n', f);
        if (r == 0) {
            fputc('|', f);
            for (int c = 0; c < t->ncols; c++) fputs(c == 0 ? " --- |" : " ---: |", f);
            fputc('\n', f);
        }
    }
}

static void html_esc(FILE *f, const char *s)
{
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

static void html_table(FILE *f, const table_t *t)
{
    fputs("<h2>", f);
    html_esc(f, t->title);
    fputs("</h2>\n", f);
    if (t->note[0]) { fputs("<p class=note>", f); html_esc(f, t->note); fputs("</p>\n", f); }
    fputs("<table>\n<thead><tr>", f);
    for (int c = 0; c < t->ncols; c++) { fputs("<th>", f); html_esc(f, t->cells[c]); fputs("</th>", f); }
    fputs("</tr></thead>\n<tbody>\n", f);
    for (int r = 1; r <= t->nrows; r++) {
        fputs("<tr>", f);
        for (int c = 0; c < t->ncols; c++) {
            const char *cell = t->cells[(size_t)r * (size_t)t->ncols + (size_t)c];
            bool numeric = c > 0 && (strchr("0123456789-.", cell[0]) || !strncmp(cell, "–", strlen("–")));
            fputs(numeric ? "<td class=n>" : "<td>", f);
            html_esc(f, cell);
            fputs("</td>", f);
        }
        fputs("</tr>\n", f);
    }
    fputs("</tbody></table>\n", f);
}

/* ---- the tables ----------------------------------------------------------------------- */

#define MAX_TABLES 16

typedef struct {
    table_t t[MAX_TABLES];
    int n;
} tables_t;

static void tables_free(tables_t *ts)
{
    for (int i = 0; i < ts->n; i++) table_free(&ts->t[i]);
    ts->n = 0;
}

static void top_list(char *c, const kvq_tensor_stats *ts, int top_n)
{
    size_t off = 0;
    c[0] = 0;
    for (int i = 0; i < ts->n_outliers && i < top_n && off < CELL_MAX - 24; i++)
        off += (size_t)snprintf(c + off, CELL_MAX - off, "%s%d (%.1f×)", i ? ", " : "", ts->outlier_chan[i],
                                ts->outlier_ratio[i]);
    if (ts->n_outliers == 0) snprintf(c, CELL_MAX, "–");
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double median_f(const float *x, size_t n, float *tmp)
{
    memcpy(tmp, x, n * sizeof *tmp);
    qsort(tmp, n, sizeof *tmp, cmp_float);
    size_t k = n / 2;
    return n % 2 ? tmp[k] : 0.5 * ((double)tmp[k - 1] + tmp[k]);
}

void kvq_kbias_layer(const kvq_report *r, int j, kvq_kbias_stats *st)
{
    const kvq_kvstats *s = r->s;
    const int kvd = s->kv_dim;
    const float *b = r->k_bias + (size_t)j * kvd;
    const kvq_chan_stats *ch = s->layers[j].t[KVQ_KVT_K_PRE_ROPE].chan;
    memset(st, 0, sizeof *st);
    double ss = 0, ek = 0;
    int cand[4096], nc = 0;
    double rat[4096];
    for (int c = 0; c < kvd; c++) {
        double a = fabs((double)b[c]);
        ss += a * a;
        ek += ch[c].std * ch[c].std + ch[c].mean * ch[c].mean; /* mean_t k_c^2 */
        if (a > st->max_abs) st->max_abs = a, st->max_chan = c;
        double r2 = ch[c].mean_abs > 0 ? a / ch[c].mean_abs : (a > 0 ? INFINITY : 0);
        if (r2 >= 0.5) {
            st->n_dom++;
            if (nc < 4096) cand[nc] = c, rat[nc++] = r2;
        }
    }
    st->norm = sqrt(ss);
    st->rel = ek > 0 ? st->norm / sqrt(ek) : NAN;
    for (int k = 0; k < 8 && k < nc; k++) { /* top by ratio (selection; nc is small) */
        int best = k;
        for (int i = k + 1; i < nc; i++)
            if (rat[i] > rat[best]) best = i;
        int tc = cand[k];
        double tr = rat[k];
        cand[k] = cand[best], rat[k] = rat[best];
        cand[best] = tc, rat[best] = tr;
        st->dom_chan[k] = cand[k];
        st->dom_ratio[k] = rat[k];
    }
}

static kvq_status build_tables(const kvq_report *r, tables_t *T, kvq_err *err)
{
    const kvq_kvstats *s = r->s;
    int top_n = r->top_n > 0 ? r->top_n : 5;
    memset(T, 0, sizeof *T);
    char note[400];
    bool ok = true;
#define NEW_TABLE(title, note_, ...)                                                                                   \
    do {                                                                                                               \
        const char *h_[] = {__VA_ARGS__};                                                                              \
        ok = ok && table_init(&T->t[T->n], title, note_, (int)(sizeof h_ / sizeof *h_), h_);                          \
        if (ok) T->n++;                                                                                                \
    } while (0)
#define ROW(tb) ((tb)->cells ? table_row(tb) : NULL)

    /* 1 summary */
    NEW_TABLE("Summary", NULL, "item", "value");
    if (ok) {
        table_t *t = &T->t[T->n - 1];
        const char *items[][2] = {{"model", s->model}, {"dump", r->dump_path ? r->dump_path : "–"},
                                  {"artifact", r->artifact_path ? r->artifact_path : "–"}};
        for (size_t i = 0; i < 3 && ok; i++) {
            char (*row)[CELL_MAX] = ROW(t);
            if (!(ok = row)) break;
            cellf(row[0], "%s", items[i][0]);
            cellf(row[1], "%s", items[i][1]);
        }
        char (*row)[CELL_MAX];
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "samples × tokens"); cellf(row[1], "%lld × %lld", (long long)s->n_samples, (long long)s->seq_len); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "layers"); cellf(row[1], "%d..%d of %d", s->layer_first, s->layer_last, s->n_layers); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "heads (query / KV) × head_dim"); cellf(row[1], "%d / %d × %d (kv_dim %d)", s->n_heads, s->n_kv_heads, s->head_dim, s->kv_dim); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "outlier channel"); cellf(row[1], "%s |x| ≥ %g × layer median", kvq_outlier_stat_name(s->opts.outlier_stat), s->opts.outlier_mult); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "attention sink"); cellf(row[1], s->has_attn ? "share ≥ %g, seen by ≥ %lld queries" : "no attn_received in the dump (kvdump --attn-stats)", s->opts.sink_share, (long long)s->opts.sink_min_queries); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "percentiles"); cellf(row[1], "nearest rank, log-bucket sketch, relative error ≤ %g", s->sketch.alpha); }
        if (ok && (ok = (row = ROW(t)))) { cellf(row[0], "detail layer (figures)"); cellf(row[1], "%d", r->detail_layer); }
    }

    /* 2 outlier channels */
    snprintf(note, sizeof note, "Channels whose %s |x| is ≥ %g × the layer median; top %d listed as channel (ratio). "
             "Channel c = KV head × %d + dim.", kvq_outlier_stat_name(s->opts.outlier_stat), s->opts.outlier_mult, top_n, s->head_dim);
    NEW_TABLE("Outlier channels per layer", note, "layer", "pre-RoPE K #", "top pre-RoPE K channels", "post-RoPE K #",
              "top post-RoPE K channels", "V #", "top V channels");
    if (ok) {
        table_t *t = &T->t[T->n - 1];
        for (int j = 0; j < s->n_stat_layers && ok; j++) {
            const kvq_layer_stats *ls = &s->layers[j];
            char (*row)[CELL_MAX] = ROW(t);
            if (!(ok = row)) break;
            cellf(row[0], "%d", ls->layer);
            for (int k = 0; k < 3; k++) {
                cellf(row[1 + 2 * k], "%d", ls->t[k].n_outliers);
                top_list(row[2 + 2 * k], &ls->t[k], top_n);
            }
        }
    }

    /* 3 magnitudes */
    NEW_TABLE("Magnitudes per layer", "absmax and p99.9 of |x| over the layer; kurtosis: largest channel kurtosis (Pearson, 3 = Gaussian) and its channel.",
              "layer", "K pre absmax", "K pre p99.9", "K pre max kurtosis (ch)", "K post absmax", "K post p99.9", "V absmax", "V p99.9",
              "V max kurtosis (ch)");
    if (ok) {
        table_t *t = &T->t[T->n - 1];
        for (int j = 0; j < s->n_stat_layers && ok; j++) {
            const kvq_layer_stats *ls = &s->layers[j];
            char (*row)[CELL_MAX] = ROW(t);
            if (!(ok = row)) break;
            cellf(row[0], "%d", ls->layer);
            for (int k = 0, col = 1; k < 3; k++) {
                const kvq_tensor_stats *ts = &ls->t[k];
                num(row[col++], ts->all.absmax);
                num(row[col++], ts->all.p999);
                if (k != 1) {
                    int bc = 0;
                    for (int c = 1; c < s->kv_dim; c++) if (ts->chan[c].kurtosis > ts->chan[bc].kurtosis) bc = c;
                    cellf(row[col++], "%.3g (%d)", ts->chan[bc].kurtosis, bc);
                }
            }
        }
    }

    /* 3b key biases (Qwen2) */
    if (r->k_bias) {
        snprintf(note, sizeof note, "The model's key bias b (pre-RoPE, added to every token's key): ||b||, its share of the pre-RoPE "
                 "keys' RMS, the largest |b_c|, and the channels it dominates (|b_c| ≥ 0.5 × mean |k_c|), top %d as channel (|b_c| / "
                 "mean |k_c|). Per-channel asymmetric pre-RoPE quantizers (int-pc, nuq) absorb such offsets in the zero point.",
                 top_n);
        NEW_TABLE("Key biases per layer", note, "layer", "||b_k||", "||b_k|| / RMS(K pre)", "max |b_c| (ch)", "dominated #",
                  "dominated channels");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < s->n_stat_layers && ok; j++) {
                kvq_kbias_stats kb;
                kvq_kbias_layer(r, j, &kb);
                char (*row)[CELL_MAX] = ROW(t);
                if (!(ok = row)) break;
                cellf(row[0], "%d", s->layers[j].layer);
                num(row[1], kb.norm);
                num(row[2], kb.rel);
                cellf(row[3], "%.4g (%d)", kb.max_abs, kb.max_chan);
                cellf(row[4], "%d", kb.n_dom);
                size_t off = 0;
                row[5][0] = 0;
                for (int i = 0; i < kb.n_dom && i < top_n && i < 8 && off < CELL_MAX - 24; i++)
                    off += (size_t)snprintf(row[5] + off, CELL_MAX - off, "%s%d (%.1f)", i ? ", " : "", kb.dom_chan[i], kb.dom_ratio[i]);
            }
        }
    }

    /* 4 RoPE spread */
    NEW_TABLE("Pre- vs post-RoPE keys",
              "Channel magnitude m_c = mean |x| of channel c. var ratio = var_c(m_c) before RoPE / after (> 1: RoPE spreads outlier "
              "channels over their rotary pair); max/median of m_c; CV = mean over channels of std|x| / mean|x| across tokens "
              "(a pre-RoPE channel keeps its magnitude from token to token, RoPE makes it oscillate).",
              "layer", "var ratio pre/post", "max/median pre", "max/median post", "CV pre", "CV post");
    if (ok) {
        table_t *t = &T->t[T->n - 1];
        for (int j = 0; j < s->n_stat_layers && ok; j++) {
            const kvq_layer_stats *ls = &s->layers[j];
            char (*row)[CELL_MAX] = ROW(t);
            if (!(ok = row)) break;
            cellf(row[0], "%d", ls->layer);
            num(row[1], ls->spread_var_ratio);
            num(row[2], ls->maxmed_pre);
            num(row[3], ls->maxmed_post);
            num(row[4], ls->cv_pre);
            num(row[5], ls->cv_post);
        }
    }

    /* 5 token norms */
    NEW_TABLE("Token norms", "L2 norm of each token's vector over all KV heads, mean over samples at position 0 vs the median over positions; the position with the largest mean norm.",
              "layer", "K pre pos 0", "K pre median", "K pre max pos", "V pos 0", "V median", "V max pos");
    if (ok) {
        table_t *t = &T->t[T->n - 1];
        size_t L = (size_t)s->seq_len, N = (size_t)s->n_samples;
        float *pm = malloc(L * sizeof(float)), *tmp = malloc(L * sizeof(float));
        if (!pm || !tmp) ok = false;
        for (int j = 0; j < s->n_stat_layers && ok; j++) {
            const kvq_layer_stats *ls = &s->layers[j];
            char (*row)[CELL_MAX] = ROW(t);
            if (!(ok = row)) break;
            cellf(row[0], "%d", ls->layer);
            for (int k = 0, col = 1; k < 3; k += 2) {
                size_t best = 0;
                for (size_t p = 0; p < L; p++) {
                    double a = 0;
                    for (size_t n = 0; n < N; n++) a += ls->t[k].tok_norm[n * L + p];
                    pm[p] = (float)(a / (double)N);
                    if (pm[p] > pm[best]) best = p;
                }
                num(row[col++], pm[0]);
                num(row[col++], median_f(pm, L, tmp));
                cellf(row[col++], "%zu", best);
            }
        }
        free(pm);
        free(tmp);
    }

    /* 6 attention */
    if (s->has_attn) {
        snprintf(note, sizeof note, "share = attention a position receives / number of queries that see it (mean over query heads). "
                 "Sinks: share ≥ %g and seen by ≥ %lld queries; listed as sample:position [token id] share.",
                 s->opts.sink_share, (long long)s->opts.sink_min_queries);
        NEW_TABLE("Attention sinks per layer", note, "layer", "top position", "% of attention", "# sinks", "strongest sinks");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < s->n_stat_layers && ok; j++) {
                const kvq_layer_stats *ls = &s->layers[j];
                char (*row)[CELL_MAX] = ROW(t);
                if (!(ok = row)) break;
                cellf(row[0], "%d", ls->layer);
                cellf(row[1], "%lld", (long long)ls->top_pos);
                cellf(row[2], "%.1f", 100 * ls->top_frac);
                cellf(row[3], "%d%s", ls->n_sinks, ls->n_sinks >= s->opts.max_sinks ? "+" : "");
                size_t off = 0;
                row[4][0] = 0;
                for (int i = 0; i < ls->n_sinks && i < top_n && off < CELL_MAX - 40; i++)
                    off += (size_t)snprintf(row[4] + off, CELL_MAX - off, "%s%lld:%lld [%d] %.2f", i ? ", " : "",
                                            (long long)ls->sinks[i].sample, (long long)ls->sinks[i].pos,
                                            (int)ls->sinks[i].token, ls->sinks[i].share);
                if (!ls->n_sinks) cellf(row[4], "–");
            }
        }
        NEW_TABLE("Pivot tokens", "Positions that are sinks in the most layers (at most 20 listed).", "sample", "position",
                  "token id", "layers", "max share");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int i = 0; i < s->n_pivots && i < 20 && ok; i++) {
                const kvq_pivot *p = &s->pivots[i];
                char (*row)[CELL_MAX] = ROW(t);
                if (!(ok = row)) break;
                cellf(row[0], "%lld", (long long)p->sample);
                cellf(row[1], "%lld", (long long)p->pos);
                cellf(row[2], "%d", (int)p->token);
                cellf(row[3], "%d", p->n_layers);
                cellf(row[4], "%.3f", p->max_share);
            }
        }
    }

    /* 7 quantization error */
    if (r->q) {
        const kvq_qerr *q = r->q;
        NEW_TABLE("Quantization error per layer",
                  "MSE in squared activation units; rel = MSE / mean x²; Fisher = mean F·(x − x̂)² (KVQuant §3.2 objective; – without "
                  "Fisher or for post-RoPE keys); outl = realised sparse-outlier fraction (calib = fraction on the calibration data).",
                  "layer", "scheme", "K MSE", "K rel", "K Fisher", "K outl", "K calib", "V MSE", "V rel", "V Fisher", "V outl", "V calib");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < q->n_stat_layers && ok; j++)
                for (int si = 0; si < q->n_schemes && ok; si++) {
                    size_t x = (size_t)si * (size_t)q->n_stat_layers + (size_t)j;
                    char (*row)[CELL_MAX] = ROW(t);
                    if (!(ok = row)) break;
                    cellf(row[0], "%d", q->layer_first + j);
                    cellf(row[1], "%s", q->names[si]);
                    num(row[2], q->mse_k[x]);
                    num(row[3], q->sig_k[j] > 0 ? q->mse_k[x] / q->sig_k[j] : NAN);
                    num(row[4], q->fw_k[x]);
                    num(row[5], q->outl_k[x]);
                    num(row[6], q->calib_k[x]);
                    num(row[7], q->mse_v[x]);
                    num(row[8], q->sig_v[j] > 0 ? q->mse_v[x] / q->sig_v[j] : NAN);
                    num(row[9], q->fw_v[x]);
                    num(row[10], q->outl_v[x]);
                    num(row[11], q->calib_v[x]);
                }
        }
    }
    /* 8 coupled-quantization codebooks */
    if (r->cq && ok) {
        const kvq_cqstats *c = r->cq;
        snprintf(note, sizeof note, "The cq artifact's codebooks (%d channels per %d-bit code) over the dump: used = codewords "
                 "chosen at least once (mean over the %d groups, of %d); entropy = of the index distribution, bits (mean over the "
                 "groups; %d = uniform use); MSE per element, mean over the groups and the worst group (its first channel).",
                 c->c, c->bits, c->n_groups, 1 << c->bits, c->bits);
        NEW_TABLE("Coupled-quantization codebooks", note, "layer", "K used", "K entropy", "K MSE", "K worst MSE", "V used", "V entropy",
                  "V MSE", "V worst MSE");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < c->n_stat_layers && ok; j++) {
                char (*row)[CELL_MAX] = ROW(t);
                if (!(ok = row)) break;
                cellf(row[0], "%d", c->layer_first + j);
                for (int w = 0; w < 2; w++) {
                    kvq_cq_summary sm;
                    kvq_cqstats_summary(c, j, w ? 'v' : 'k', &sm);
                    cellf(row[1 + 4 * w], "%.1f", sm.used);
                    cellf(row[2 + 4 * w], "%.2f", sm.entropy_bits);
                    num(row[3 + 4 * w], sm.mse_mean);
                    char wm[CELL_MAX];
                    num(wm, sm.mse_worst);
                    cellf(row[4 + 4 * w], "%s (ch %d)", wm, sm.worst_group * c->c);
                }
            }
        }
    }
    /* 9 cross-layer similarity (MiniCache) */
    if (r->xl && ok) {
        const kvq_xlayer *x = r->xl;
        if (x->artifact)
            snprintf(note, sizeof note, "Adjacent layers' post-RoPE keys and values per (token, KV head), %llu vectors per pair: "
                     "mean cosine similarity, mean angular distance arccos(cos) / pi, and the share the minicache artifact's "
                     "thresholds retain unmerged (MiniCache §4.1); merged = the artifact merges the pair.",
                     (unsigned long long)x->n_vectors);
        else
            snprintf(note, sizeof note, "Adjacent layers' post-RoPE keys and values per (token, KV head), %llu vectors per pair: "
                     "mean cosine similarity, mean angular distance arccos(cos) / pi, and the share MiniCache's retention rule "
                     "(§4.1: distance > d_max - (d_max - d_min) gamma per KV head over the dump, gamma = %g) keeps unmerged.",
                     (unsigned long long)x->n_vectors, x->gamma);
        NEW_TABLE("Cross-layer similarity (MiniCache)", note, "layers", "K cos", "K distance", "K retained", "V cos",
                  "V distance", "V retained", "merged");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < x->n_pairs && ok; j++) {
                char (*row)[CELL_MAX] = ROW(t);
                if (!(ok = row)) break;
                cellf(row[0], "%d-%d", x->layer_first + j, x->layer_first + j + 1);
                cellf(row[1], "%.4f", x->cos_k[j]);
                cellf(row[2], "%.4f", x->dist_k[j]);
                cellf(row[3], "%.2f%%", 100 * x->ret_k[j]);
                cellf(row[4], "%.4f", x->cos_v[j]);
                cellf(row[5], "%.4f", x->dist_v[j]);
                cellf(row[6], "%.2f%%", 100 * x->ret_v[j]);
                cellf(row[7], "%s", x->merged[j] < 0 ? "-" : x->merged[j] ? "yes" : "no");
            }
        }
    }
    /* 10 low-rank KV heads */
    if (r->lr && ok) {
        const kvq_lrstats *c = r->lr;
        snprintf(note, sizeof note, "The lowrank artifact's subspaces (groups of %d KV heads, D = %d channels) per layer and group: "
                 "r@%g%% = the rank its own target keeps (from the calibrated eigenvalues) and the explained variance that rank "
                 "realises on this dump (%llu vectors per group); r@90%% / r@99%% = the ranks this dump needs for 90%% / 99%%.",
                 c->G, c->D, c->ev_target * 100, (unsigned long long)c->n_vectors);
        NEW_TABLE("Low-rank KV heads: explained variance", note, "layer", "group", "K r@target", "K EV (dump)", "K r@90% / r@99%",
                  "V r@target", "V EV (dump)", "V r@90% / r@99%");
        if (ok) {
            table_t *t = &T->t[T->n - 1];
            for (int j = 0; j < c->n_stat_layers && ok; j++)
                for (int g = 0; g < c->n_groups && ok; g++) {
                    char (*row)[CELL_MAX] = ROW(t);
                    if (!(ok = row)) break;
                    cellf(row[0], "%d", c->layer_first + j);
                    cellf(row[1], "%d", g);
                    for (int w = 0; w < 2; w++) {
                        size_t off = ((size_t)j * c->n_groups + g) * c->D;
                        const double *cal = (w ? c->cal_v : c->cal_k) + off, *dm = (w ? c->dump_v : c->dump_k) + off;
                        int rt = kvq_lrstats_rank_at(cal, c->D, c->ev_target);
                        cellf(row[2 + 3 * w], "%d", rt);
                        cellf(row[3 + 3 * w], "%.4f", dm[rt - 1]);
                        cellf(row[4 + 3 * w], "%d / %d", kvq_lrstats_rank_at(dm, c->D, 0.90), kvq_lrstats_rank_at(dm, c->D, 0.99));
                    }
                }
        }
    }
#undef NEW_TABLE
#undef ROW
    if (!ok) { tables_free(T); return kvq_fail(err, KVQ_ENOMEM, "report: out of memory"); }
    return KVQ_OK;
}

kvq_status kvq_report_markdown(FILE *f, const kvq_report *r, kvq_err *err)
{
    tables_t T;
    KVQ_TRY(build_tables(r, &T, err));
    fprintf(f, "# kvstat: %s\n", r->s->model);
    for (int i = 0; i < T.n; i++) md_table(f, &T.t[i]);
    tables_free(&T);
    if (ferror(f)) return kvq_fail(err, KVQ_EIO, "report: writing markdown failed: %s", strerror(errno));
    return KVQ_OK;
}

/* ---- JSON ---------------------------------------------------------------------------------- */

static cJSON *jnum(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

static void jadd(cJSON *o, const char *k, double v) { cJSON_AddItemToObject(o, k, jnum(v)); }

static cJSON *jstats(const kvq_chan_stats *c)
{
    cJSON *o = cJSON_CreateObject();
    jadd(o, "n", (double)c->n);
    jadd(o, "absmax", c->absmax);
    jadd(o, "min", c->min);
    jadd(o, "max", c->max);
    jadd(o, "mean", c->mean);
    jadd(o, "std", c->std);
    jadd(o, "mean_abs", c->mean_abs);
    jadd(o, "std_abs", c->std_abs);
    jadd(o, "kurtosis", c->kurtosis);
    jadd(o, "p99", c->p99);
    jadd(o, "p999", c->p999);
    return o;
}

static cJSON *jchan_array(const kvq_chan_stats *c, int n, size_t off)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, jnum(*(const double *)((const char *)&c[i] + off)));
    return a;
}

static cJSON *jdarray(const double *v, size_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(a, jnum(v[i]));
    return a;
}

static cJSON *build_json(const kvq_report *r)
{
    const kvq_kvstats *s = r->s;
    cJSON *root = cJSON_CreateObject();
    cJSON *schema = cJSON_AddObjectToObject(root, "schema"); /* docs/JSON.md */
    cJSON_AddStringToObject(schema, "name", "kvq.kvstat");
    cJSON_AddNumberToObject(schema, "version", KVQ_JSON_KVSTAT_VERSION);
    cJSON_AddStringToObject(root, "tool", "kvstat");
    cJSON_AddStringToObject(root, "version", KVQ_VERSION);
    cJSON_AddStringToObject(root, "model", s->model);
    if (r->dump_path) cJSON_AddStringToObject(root, "dump", r->dump_path);
    if (r->artifact_path) cJSON_AddStringToObject(root, "artifact", r->artifact_path);
    cJSON *shape = cJSON_AddObjectToObject(root, "shape");
    jadd(shape, "n_layers", s->n_layers);
    jadd(shape, "layer_first", s->layer_first);
    jadd(shape, "layer_last", s->layer_last);
    jadd(shape, "n_heads", s->n_heads);
    jadd(shape, "n_kv_heads", s->n_kv_heads);
    jadd(shape, "head_dim", s->head_dim);
    jadd(shape, "n_samples", (double)s->n_samples);
    jadd(shape, "seq_len", (double)s->seq_len);
    cJSON *o = cJSON_AddObjectToObject(root, "options");
    jadd(o, "outlier_mult", s->opts.outlier_mult);
    cJSON_AddStringToObject(o, "outlier_stat", kvq_outlier_stat_name(s->opts.outlier_stat));
    jadd(o, "sink_share", s->opts.sink_share);
    jadd(o, "sink_min_queries", (double)s->opts.sink_min_queries);
    jadd(o, "sketch_alpha", s->sketch.alpha);
    if (r->k_bias) {
        cJSON *kb = cJSON_AddArrayToObject(root, "k_bias");
        for (int j = 0; j < s->n_stat_layers; j++) {
            kvq_kbias_stats st;
            kvq_kbias_layer(r, j, &st);
            cJSON *o2 = cJSON_CreateObject();
            cJSON_AddItemToArray(kb, o2);
            jadd(o2, "layer", s->layers[j].layer);
            jadd(o2, "norm", st.norm);
            jadd(o2, "rel_rms", st.rel);
            jadd(o2, "max_abs", st.max_abs);
            jadd(o2, "max_channel", st.max_chan);
            jadd(o2, "n_dominated", st.n_dom);
            cJSON *dc = cJSON_AddArrayToObject(o2, "dominated");
            for (int i = 0; i < st.n_dom && i < 8; i++) {
                cJSON *e = cJSON_CreateObject();
                jadd(e, "channel", st.dom_chan[i]);
                jadd(e, "ratio", st.dom_ratio[i]);
                cJSON_AddItemToArray(dc, e);
            }
            float *bv = malloc((size_t)s->kv_dim * sizeof *bv);
            double *bd = malloc((size_t)s->kv_dim * sizeof *bd);
            if (bv && bd) {
                for (int c = 0; c < s->kv_dim; c++) bd[c] = r->k_bias[(size_t)j * s->kv_dim + c];
                cJSON_AddItemToObject(o2, "bias", jdarray(bd, (size_t)s->kv_dim));
            }
            free(bv);
            free(bd);
        }
    }
    cJSON *layers = cJSON_AddArrayToObject(root, "layers");
    size_t L = (size_t)s->seq_len, N = (size_t)s->n_samples, H = (size_t)s->n_heads;
    double *pm = malloc(L * sizeof(double));
    for (int j = 0; j < s->n_stat_layers && pm; j++) {
        const kvq_layer_stats *ls = &s->layers[j];
        cJSON *lj = cJSON_CreateObject();
        cJSON_AddItemToArray(layers, lj);
        jadd(lj, "layer", ls->layer);
        for (int k = 0; k < KVQ_KVT_N_STAT; k++) {
            const kvq_tensor_stats *ts = &ls->t[k];
            cJSON *tj = cJSON_AddObjectToObject(lj, kvq_kvt_name((kvq_kvt)k));
            cJSON_AddItemToObject(tj, "all", jstats(&ts->all));
            cJSON *heads = cJSON_AddArrayToObject(tj, "heads");
            for (int h = 0; h < s->n_kv_heads; h++) cJSON_AddItemToArray(heads, jstats(&ts->head[h]));
            cJSON *ch = cJSON_AddObjectToObject(tj, "channels");
            struct { const char *k; size_t off; } f[] = {
                {"absmax", offsetof(kvq_chan_stats, absmax)}, {"mean_abs", offsetof(kvq_chan_stats, mean_abs)},
                {"std_abs", offsetof(kvq_chan_stats, std_abs)}, {"p99", offsetof(kvq_chan_stats, p99)},
                {"p999", offsetof(kvq_chan_stats, p999)}, {"kurtosis", offsetof(kvq_chan_stats, kurtosis)},
                {"min", offsetof(kvq_chan_stats, min)}, {"max", offsetof(kvq_chan_stats, max)}};
            for (size_t i = 0; i < sizeof f / sizeof *f; i++)
                cJSON_AddItemToObject(ch, f[i].k, jchan_array(ts->chan, s->kv_dim, f[i].off));
            jadd(tj, "median_stat", ts->median_stat);
            cJSON *ol = cJSON_AddArrayToObject(tj, "outliers");
            for (int i = 0; i < ts->n_outliers; i++) {
                cJSON *x = cJSON_CreateObject();
                jadd(x, "channel", ts->outlier_chan[i]);
                jadd(x, "head", ts->outlier_chan[i] / s->head_dim);
                jadd(x, "dim", ts->outlier_chan[i] % s->head_dim);
                jadd(x, "ratio", ts->outlier_ratio[i]);
                cJSON_AddItemToArray(ol, x);
            }
            for (size_t p = 0; p < L; p++) {
                double a = 0;
                for (size_t n = 0; n < N; n++) a += ts->tok_norm[n * L + p];
                pm[p] = a / (double)N;
            }
            cJSON_AddItemToObject(tj, "token_norm_by_position", jdarray(pm, L));
        }
        cJSON *sp = cJSON_AddObjectToObject(lj, "rope_spread");
        jadd(sp, "var_ratio", ls->spread_var_ratio);
        jadd(sp, "maxmed_pre", ls->maxmed_pre);
        jadd(sp, "maxmed_post", ls->maxmed_post);
        jadd(sp, "cv_pre", ls->cv_pre);
        jadd(sp, "cv_post", ls->cv_post);
        if (s->has_attn) {
            cJSON *at = cJSON_AddObjectToObject(lj, "attention");
            jadd(at, "top_pos", (double)ls->top_pos);
            jadd(at, "top_frac", ls->top_frac);
            for (size_t p = 0; p < L; p++) {
                double a = 0;
                for (size_t h = 0; h < H; h++) a += ls->attn_recv[h * L + p];
                pm[p] = a / (double)H;
            }
            cJSON_AddItemToObject(at, "received_by_position", jdarray(pm, L));
            cJSON *sk = cJSON_AddArrayToObject(at, "sinks");
            for (int i = 0; i < ls->n_sinks; i++) {
                cJSON *x = cJSON_CreateObject();
                jadd(x, "sample", (double)ls->sinks[i].sample);
                jadd(x, "pos", (double)ls->sinks[i].pos);
                jadd(x, "token", ls->sinks[i].token);
                jadd(x, "share", ls->sinks[i].share);
                jadd(x, "received", ls->sinks[i].received);
                cJSON_AddItemToArray(sk, x);
            }
        }
    }
    free(pm);
    if (s->has_attn) {
        cJSON *pv = cJSON_AddArrayToObject(root, "pivots");
        for (int i = 0; i < s->n_pivots; i++) {
            cJSON *x = cJSON_CreateObject();
            jadd(x, "sample", (double)s->pivots[i].sample);
            jadd(x, "pos", (double)s->pivots[i].pos);
            jadd(x, "token", s->pivots[i].token);
            jadd(x, "n_layers", s->pivots[i].n_layers);
            jadd(x, "max_share", s->pivots[i].max_share);
            cJSON_AddItemToArray(pv, x);
        }
    }
    if (r->q) {
        const kvq_qerr *q = r->q;
        cJSON *qj = cJSON_AddObjectToObject(root, "quant_error");
        jadd(qj, "layer_first", q->layer_first);
        cJSON_AddItemToObject(qj, "mean_sq_k", jdarray(q->sig_k, (size_t)q->n_stat_layers));
        cJSON_AddItemToObject(qj, "mean_sq_v", jdarray(q->sig_v, (size_t)q->n_stat_layers));
        cJSON *sc = cJSON_AddArrayToObject(qj, "schemes");
        for (int si = 0; si < q->n_schemes; si++) {
            size_t off = (size_t)si * (size_t)q->n_stat_layers, n = (size_t)q->n_stat_layers;
            cJSON *x = cJSON_CreateObject();
            cJSON_AddStringToObject(x, "name", q->names[si]);
            cJSON_AddItemToObject(x, "mse_k", jdarray(q->mse_k + off, n));
            cJSON_AddItemToObject(x, "mse_v", jdarray(q->mse_v + off, n));
            cJSON_AddItemToObject(x, "fisher_k", jdarray(q->fw_k + off, n));
            cJSON_AddItemToObject(x, "fisher_v", jdarray(q->fw_v + off, n));
            cJSON_AddItemToObject(x, "outlier_frac_k", jdarray(q->outl_k + off, n));
            cJSON_AddItemToObject(x, "outlier_frac_v", jdarray(q->outl_v + off, n));
            cJSON_AddItemToObject(x, "calib_outlier_frac_k", jdarray(q->calib_k + off, n));
            cJSON_AddItemToObject(x, "calib_outlier_frac_v", jdarray(q->calib_v + off, n));
            cJSON_AddItemToArray(sc, x);
        }
    }
    if (r->xl) {
        const kvq_xlayer *x = r->xl;
        cJSON *xj = cJSON_AddObjectToObject(root, "cross_layer");
        jadd(xj, "layer_first", x->layer_first);
        jadd(xj, "n_pairs", x->n_pairs);
        jadd(xj, "vectors_per_pair", (double)x->n_vectors);
        if (x->artifact) cJSON_AddStringToObject(xj, "thresholds", "artifact");
        else jadd(xj, "retention_gamma", x->gamma);
        cJSON_AddItemToObject(xj, "cos_k", jdarray(x->cos_k, (size_t)x->n_pairs));
        cJSON_AddItemToObject(xj, "cos_v", jdarray(x->cos_v, (size_t)x->n_pairs));
        cJSON_AddItemToObject(xj, "angular_distance_k", jdarray(x->dist_k, (size_t)x->n_pairs));
        cJSON_AddItemToObject(xj, "angular_distance_v", jdarray(x->dist_v, (size_t)x->n_pairs));
        cJSON_AddItemToObject(xj, "retained_k", jdarray(x->ret_k, (size_t)x->n_pairs));
        cJSON_AddItemToObject(xj, "retained_v", jdarray(x->ret_v, (size_t)x->n_pairs));
        if (x->artifact) {
            cJSON *m = cJSON_AddArrayToObject(xj, "merged");
            for (int j = 0; j < x->n_pairs; j++) cJSON_AddItemToArray(m, cJSON_CreateBool(x->merged[j] == 1));
        }
    }
    if (r->lr) {
        const kvq_lrstats *c = r->lr;
        cJSON *lj = cJSON_AddObjectToObject(root, "lowrank_ev");
        jadd(lj, "layer_first", c->layer_first);
        jadd(lj, "kv_heads_per_group", c->G);
        jadd(lj, "channels_per_group", c->D);
        jadd(lj, "n_groups", c->n_groups);
        jadd(lj, "ev_target", c->ev_target);
        jadd(lj, "vectors_per_group", (double)c->n_vectors);
        size_t n = (size_t)c->n_stat_layers * (size_t)c->n_groups * (size_t)c->D;
        for (int w = 0; w < 2; w++) { /* [n_stat_layers][n_groups][D] row-major: EV of the leading r = index + 1 directions */
            cJSON *side = cJSON_AddObjectToObject(lj, w ? "v" : "k");
            cJSON_AddItemToObject(side, "calibrated", jdarray(w ? c->cal_v : c->cal_k, n));
            cJSON_AddItemToObject(side, "realised", jdarray(w ? c->dump_v : c->dump_k, n));
        }
    }
    if (r->cq) {
        const kvq_cqstats *c = r->cq;
        cJSON *cj = cJSON_AddObjectToObject(root, "cq_codebooks");
        jadd(cj, "layer_first", c->layer_first);
        jadd(cj, "channels_per_group", c->c);
        jadd(cj, "bits", c->bits);
        jadd(cj, "n_groups", c->n_groups);
        jadd(cj, "vectors_per_group", (double)c->n_vectors);
        size_t nl = (size_t)c->n_stat_layers, G = (size_t)c->n_groups, n = (size_t)c->n_vectors;
        for (int w = 0; w < 2; w++) {
            cJSON *side = cJSON_AddObjectToObject(cj, w ? "v" : "k");
            double *used = malloc(nl * sizeof(double)), *ent = malloc(nl * sizeof(double)), *mse = malloc(nl * G * sizeof(double));
            if (!used || !ent || !mse) {
                free(used);
                free(ent);
                free(mse);
                break;
            }
            for (size_t j = 0; j < nl; j++) {
                kvq_cq_summary sm;
                kvq_cqstats_summary(c, (int)j, w ? 'v' : 'k', &sm);
                used[j] = sm.used;
                ent[j] = sm.entropy_bits;
                for (size_t g = 0; g < G; g++)
                    mse[j * G + g] = n ? (w ? c->sse_v : c->sse_k)[j * G + g] / ((double)n * c->c) : NAN;
            }
            cJSON_AddItemToObject(side, "used_mean", jdarray(used, nl));
            cJSON_AddItemToObject(side, "entropy_bits_mean", jdarray(ent, nl));
            cJSON_AddItemToObject(side, "mse_per_group", jdarray(mse, nl * G)); /* [n_stat_layers][n_groups], row-major */
            free(used);
            free(ent);
            free(mse);
        }
    }
    return root;
}

kvq_status kvq_report_json(const char *path, const kvq_report *r, kvq_err *err)
{
    cJSON *root = build_json(r);
    char *txt = root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!txt) return kvq_fail(err, KVQ_ENOMEM, "report: out of memory building JSON");
    kvq_status st = kvq_outfile_write_text(path, txt, err);
    free(txt);
    return st;
}

/* ---- HTML ----------------------------------------------------------------------------------- */

char *kvq_base64(const unsigned char *d, size_t n)
{
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    if (n > (SIZE_MAX - 1) / 4 * 3 - 3) return NULL;
    size_t m = (n + 2) / 3 * 4;
    char *o = malloc(m + 1), *p = o;
    if (!o) return NULL;
    size_t i = 0;
    for (; i + 2 < n; i += 3) {
        uint32_t v = (uint32_t)d[i] << 16 | (uint32_t)d[i + 1] << 8 | d[i + 2];
        *p++ = A[v >> 18]; *p++ = A[(v >> 12) & 63]; *p++ = A[(v >> 6) & 63]; *p++ = A[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)d[i] << 16 | (i + 1 < n ? (uint32_t)d[i + 1] << 8 : 0);
        *p++ = A[v >> 18];
        *p++ = A[(v >> 12) & 63];
        *p++ = i + 1 < n ? A[(v >> 6) & 63] : '=';
        *p++ = '=';
    }
    *p = 0;
    return o;
}

static kvq_status read_file(const char *path, unsigned char **out, size_t *n, kvq_err *err)
{
    FILE *f;
    KVQ_TRY(kvq_fopen_regular(path, "an image written by kvstat", &f, err));
    size_t cap = 1 << 16, len = 0;
    unsigned char *b = malloc(cap);
    while (b) {
        if (len == cap) {
            unsigned char *nb = realloc(b, cap * 2);
            if (!nb) { free(b); b = NULL; break; }
            b = nb;
            cap *= 2;
        }
        size_t k = fread(b + len, 1, cap - len, f);
        len += k;
        if (k == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (!b) return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory reading image", path);
    if (bad) { free(b); return kvq_fail(err, KVQ_EIO, "%s: read error", path); }
    if (len < 8 || memcmp(b, "\x89PNG\r\n\x1a\n", 8)) {
        free(b);
        return kvq_fail(err, KVQ_EFORMAT, "%s: not a PNG file", path);
    }
    *out = b;
    *n = len;
    return KVQ_OK;
}

kvq_status kvq_report_html(const char *dir, const kvq_report *r, kvq_err *err)
{
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return kvq_fail(err, KVQ_EIO, "%s: cannot create directory: %s", dir, strerror(errno));
    tables_t T;
    KVQ_TRY(build_tables(r, &T, err));
    char path[4200];
    snprintf(path, sizeof path, "%s/index.html", dir);
    kvq_outfile of;
    kvq_status os = kvq_outfile_open(&of, path, err);
    if (os != KVQ_OK) {
        tables_free(&T);
        return os;
    }
    FILE *f = of.f;
    const kvq_kvstats *s = r->s;
    fputs("<!doctype html>\n<html lang=en><head><meta charset=utf-8>\n<title>kvstat: ", f);
    html_esc(f, s->model);
    fputs("</title>\n<style>\n"
          "body{font-family:'DejaVu Sans',Helvetica,Arial,sans-serif;font-size:14px;margin:24px;color:#222;max-width:1300px}\n"
          "h1{font-size:22px}h2{font-size:17px;margin-top:28px}\n"
          "table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ccc;padding:3px 8px}"
          "th{background:#f0f0f0}td.n{text-align:right;font-variant-numeric:tabular-nums}\n"
          "p.note{color:#555;max-width:1000px}figure{margin:16px 0}img{max-width:100%;border:1px solid #ddd}"
          "figcaption{color:#444;margin-top:4px}\n"
          "</style></head><body>\n<h1>kvstat: ", f);
    html_esc(f, s->model);
    fprintf(f, "</h1>\n<p>%lld samples × %lld tokens, layers %d..%d.</p>\n", (long long)s->n_samples,
            (long long)s->seq_len, s->layer_first, s->layer_last);
    kvq_status st = KVQ_OK;
    if (T.n > 0) html_table(f, &T.t[0]);
    if (r->n_images > 0) fputs("<h2>Figures</h2>\n", f);
    for (int i = 0; i < r->n_images && st == KVQ_OK; i++) {
        unsigned char *img = NULL;
        size_t n = 0;
        st = read_file(r->image_paths[i], &img, &n, err);
        if (st != KVQ_OK) break;
        char *b64 = kvq_base64(img, n);
        free(img);
        if (!b64) { st = kvq_fail(err, KVQ_ENOMEM, "report: out of memory encoding %s", r->image_paths[i]); break; }
        const char *cap = r->image_captions && r->image_captions[i] ? r->image_captions[i] : "";
        fputs("<figure><img alt=\"", f);
        html_esc(f, cap);
        fprintf(f, "\" src=\"data:image/png;base64,%s\"><figcaption>", b64);
        html_esc(f, cap);
        fputs("</figcaption></figure>\n", f);
        free(b64);
    }
    for (int i = 1; i < T.n; i++) html_table(f, &T.t[i]);
    fputs("</body></html>\n", f);
    tables_free(&T);
    if (st != KVQ_OK) {
        kvq_outfile_abort(&of);
        return st;
    }
    return kvq_outfile_commit(&of, err);
}
