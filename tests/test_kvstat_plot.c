/* test_kvstat_plot.c — kvstat figures and reports on synthetic data: every
 * plot writes a PNG of the requested size with real content (distinct colours
 * counted through cairo_image_surface_create_from_png) and a well-formed SVG;
 * the JSON parses back with the same numbers; the HTML page embeds only valid
 * PNGs and renders non-blank in headless Chromium (skipped if chromium cannot
 * run). KVQ_PLOT_KEEP=DIR keeps the files in DIR for looking at them. */
#include <cairo.h>
#include <cjson/cJSON.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "kvq_test.h"
#include "kvstat_synth.h"
#include "kvstats.h"
#include "plot.h"
#include "report.h"

typedef struct {
    char dir[512];
    bool keep;
} outdir_t;

static void outdir_make(outdir_t *o, const char *name)
{
    const char *k = getenv("KVQ_PLOT_KEEP");
    if (k && *k) {
        snprintf(o->dir, sizeof o->dir, "%s/%s", k, name);
        mkdir(k, 0777);
        mkdir(o->dir, 0777);
        o->keep = true;
    } else {
        snprintf(o->dir, sizeof o->dir, "/tmp/kvq_plot_XXXXXX");
        ck_assert(mkdtemp(o->dir) != NULL);
        o->keep = false;
    }
}

static void outdir_done(outdir_t *o)
{
    if (o->keep) return;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", o->dir);
    ck_assert(system(cmd) == 0);
}

/* Distinct colours of a PNG, and its size. */
static int png_colours(const char *path, int *w, int *h)
{
    cairo_surface_t *s = cairo_image_surface_create_from_png(path);
    if (cairo_surface_status(s) != CAIRO_STATUS_SUCCESS) { cairo_surface_destroy(s); return -1; }
    *w = cairo_image_surface_get_width(s);
    *h = cairo_image_surface_get_height(s);
    int stride = cairo_image_surface_get_stride(s);
    const unsigned char *d = cairo_image_surface_get_data(s);
    enum { HSZ = 1 << 16 };
    uint32_t *seen = calloc(HSZ, sizeof(uint32_t));
    unsigned char *used = calloc(HSZ, 1);
    int n = 0;
    for (int y = 0; y < *h; y++)
        for (int x = 0; x < *w; x++) {
            uint32_t v = ((const uint32_t *)(const void *)(d + (size_t)y * (size_t)stride))[x] | 1u; /* never 0 */
            uint32_t k = (v * 2654435761u) >> 16;
            while (used[k] && seen[k] != v) k = (k + 1) & (HSZ - 1);
            if (!used[k]) { used[k] = 1; seen[k] = v; n++; if (n > HSZ / 2) goto done; }
        }
done:
    free(seen);
    free(used);
    cairo_surface_destroy(s);
    return n;
}

static void check_png(const char *base, int w, int h, int min_colours)
{
    char p[700];
    snprintf(p, sizeof p, "%s.png", base);
    int gw = 0, gh = 0;
    int n = png_colours(p, &gw, &gh);
    ck_assert_msg(n >= 0, "%s: not a readable PNG", p);
    ck_assert_msg(gw == w && gh == h, "%s: %dx%d, expected %dx%d", p, gw, gh, w, h);
    ck_assert_msg(n >= min_colours, "%s: only %d distinct colours", p, n);
}

static void check_svg(const char *base, int w, int h)
{
    char p[700], buf[4096];
    snprintf(p, sizeof p, "%s.svg", base);
    FILE *f = fopen(p, "r");
    ck_assert_msg(f != NULL, "%s missing", p);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    char want[64];
    snprintf(want, sizeof want, "width=\"%d", w);
    ck_assert_msg(strstr(buf, "<svg") && strstr(buf, want), "%s: no <svg ... %s", p, want);
    snprintf(want, sizeof want, "height=\"%d", h);
    ck_assert_msg(strstr(buf, want), "%s: no %s", p, want);
    ck_assert_msg(size > 5000, "%s: only %ld bytes", p, size);
}

static kvq_kvstats *stats_of(synth_t *y, int attn)
{
    ck_assert(synth_init(y, attn, 1) == 0);
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    kvq_kvstats *s;
    kvq_err e = {0};
    ck_assert_msg(kvq_kvstats_compute(&y->src, &o, &s, &e) == KVQ_OK, "%s", e.msg);
    return s;
}

START_TEST(test_plots_png_svg)
{
    synth_t y;
    kvq_kvstats *s = stats_of(&y, 1);
    outdir_t od;
    outdir_make(&od, "plots");
    kvq_plot_style st = kvq_plot_style_default();
    st.model = "synthetic";
    kvq_err e = {0};
    char b[600];
    snprintf(b, sizeof b, "%s/profile", od.dir);
    ck_assert_msg(kvq_plot_channel_profile(b, &st, s, 2, &e) == KVQ_OK, "%s", e.msg);
    check_png(b, 1000, 900, 8);
    check_svg(b, 1000, 900);
    /* heatmap */
    float *hm[3];
    for (int t = 0; t < 3; t++) {
        hm[t] = malloc(SY_L * SY_D * sizeof(float));
        ck_assert(kvq_kvsrc_read_head(&y.src, 2, (kvq_kvt)t, 0, 0, hm[t], &e) == KVQ_OK);
    }
    const char *titles[3] = {"pre-RoPE keys", "post-RoPE keys", "values"};
    snprintf(b, sizeof b, "%s/heatmap", od.dir);
    ck_assert_msg(kvq_plot_heatmap(b, &st, 2, 0, 0, 3, (const float *const *)hm, titles, SY_L, SY_D, &e) == KVQ_OK, "%s", e.msg);
    check_png(b, 1200, 700, 64); /* a colour map: many colours */
    check_svg(b, 1200, 700);
    for (int t = 0; t < 3; t++) free(hm[t]);
    snprintf(b, sizeof b, "%s/outliers", od.dir);
    ck_assert_msg(kvq_plot_outlier_map(b, &st, s, &e) == KVQ_OK, "%s", e.msg);
    check_png(b, 1000, 900, 32);
    snprintf(b, sizeof b, "%s/attention", od.dir);
    ck_assert(kvq_plot_attention(b, &st, s, 3, false, &e) == KVQ_OK);
    check_png(b, 1000, 500, 8);
    snprintf(b, sizeof b, "%s/attention_log", od.dir);
    ck_assert(kvq_plot_attention(b, &st, s, 3, true, &e) == KVQ_OK);
    check_png(b, 1000, 500, 8);
    snprintf(b, sizeof b, "%s/attention_layers", od.dir);
    ck_assert(kvq_plot_attention_layers(b, &st, s, &e) == KVQ_OK);
    check_png(b, 1000, 450, 6);
    /* histogram with nuq-like levels */
    uint64_t cnt[120];
    for (int i = 0; i < 120; i++) cnt[i] = (uint64_t)(1000 * exp(-pow((i - 60) / 20.0, 2)));
    float lv[16];
    for (int i = 0; i < 16; i++) lv[i] = -1 + 2.0f * i / 15;
    snprintf(b, sizeof b, "%s/hist", od.dir);
    ck_assert(kvq_plot_histogram(b, &st, "layer 2 keys: normalised values", "normalised value (x − zp) / r", cnt, 120, -1.2, 1.2,
                                 5, 7, lv, 16, "nuq4 levels (16)", true, &e) == KVQ_OK);
    check_png(b, 1000, 500, 6);
    check_svg(b, 1000, 500);
    /* quantization error bars */
    kvq_qerr q = {0};
    double mk[2 * SY_NL], mv[2 * SY_NL], sg[SY_NL];
    char names[2][64] = {"int2 per-token", "nuq2 (artifact)"};
    for (int i = 0; i < 2 * SY_NL; i++) { mk[i] = 0.1 * (i + 1); mv[i] = 0.05 * (i + 2); }
    for (int j = 0; j < SY_NL; j++) sg[j] = 1;
    q.n_schemes = 2; q.n_stat_layers = SY_NL; q.layer_first = 0; q.names = names;
    q.mse_k = mk; q.mse_v = mv; q.sig_k = sg; q.sig_v = sg;
    snprintf(b, sizeof b, "%s/qerr", od.dir);
    ck_assert_msg(kvq_plot_qerr(b, &st, &q, false, &e) == KVQ_OK, "%s", e.msg);
    check_png(b, 1000, 700, 6);
    /* custom size; PNG only */
    st.width = 640; st.height = 480; st.svg = false;
    snprintf(b, sizeof b, "%s/small", od.dir);
    ck_assert(kvq_plot_channel_profile(b, &st, s, 0, &e) == KVQ_OK);
    check_png(b, 640, 480, 8);
    snprintf(b, sizeof b, "%s/small.svg", od.dir);
    ck_assert(access(b, F_OK) != 0);
    /* errors */
    ck_assert(kvq_plot_channel_profile(b, &st, s, 7, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer 7 is not in the dump"), "%s", e.msg);
    ck_assert(kvq_plot_channel_profile("/nonexistent-dir/x", &st, s, 0, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/nonexistent-dir/x.png"), "%s", e.msg);
    outdir_done(&od);
    kvq_kvstats_free(s);
    synth_free(&y);
    kvq_plot_cleanup();
}
END_TEST

START_TEST(test_attention_plot_needs_attn_stats)
{
    synth_t y;
    kvq_kvstats *s = stats_of(&y, 0);
    kvq_plot_style st = kvq_plot_style_default();
    kvq_err e = {0};
    ck_assert(kvq_plot_attention("/tmp/never", &st, s, 0, false, &e) == KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "--attn-stats"), "%s", e.msg);
    ck_assert(kvq_plot_attention_layers("/tmp/never", &st, s, &e) == KVQ_EINVAL);
    kvq_kvstats_free(s);
    synth_free(&y);
}
END_TEST

START_TEST(test_markdown_and_json)
{
    synth_t y;
    kvq_kvstats *s = stats_of(&y, 1);
    outdir_t od;
    outdir_make(&od, "report");
    kvq_report r = {.s = s, .dump_path = "synthetic.h5", .detail_layer = 2};
    kvq_err e = {0};
    char p[600];
    snprintf(p, sizeof p, "%s/report.md", od.dir);
    FILE *f = fopen(p, "w");
    ck_assert(kvq_report_markdown(f, &r, &e) == KVQ_OK);
    fclose(f);
    f = fopen(p, "r");
    static char md[1 << 17];
    size_t n = fread(md, 1, sizeof md - 1, f);
    md[n] = 0;
    fclose(f);
    /* layer 2's planted outliers: channel 5 (≈10x) then 21; the pivot with its token id */
    ck_assert_msg(strstr(md, "| 2 | 2 | 5 ("), "markdown lacks layer 2's outliers:\n%s", md);
    ck_assert_msg(strstr(md, "| 1 | 10 | 1010 | 2 |"), "markdown lacks the pivot row");
    ck_assert(strstr(md, "### Attention sinks per layer"));
    snprintf(p, sizeof p, "%s/stats.json", od.dir);
    ck_assert_msg(kvq_report_json(p, &r, &e) == KVQ_OK, "%s", e.msg);
    f = fopen(p, "r");
    static char js[1 << 22];
    n = fread(js, 1, sizeof js - 1, f);
    js[n] = 0;
    fclose(f);
    cJSON *root = cJSON_Parse(js);
    ck_assert_msg(root != NULL, "JSON does not parse");
    cJSON *layers = cJSON_GetObjectItem(root, "layers");
    ck_assert_int_eq(cJSON_GetArraySize(layers), SY_NL);
    cJSON *l2 = cJSON_GetArrayItem(layers, 2);
    cJSON *kp = cJSON_GetObjectItem(l2, "k_pre_rope");
    cJSON *o0 = cJSON_GetArrayItem(cJSON_GetObjectItem(kp, "outliers"), 0);
    ck_assert_int_eq(cJSON_GetObjectItem(o0, "channel")->valueint, 5);
    ck_assert(cJSON_GetObjectItem(o0, "ratio")->valuedouble == s->layers[2].t[0].outlier_ratio[0]);
    cJSON *ab = cJSON_GetObjectItem(cJSON_GetObjectItem(kp, "channels"), "absmax");
    ck_assert_int_eq(cJSON_GetArraySize(ab), SY_KV);
    ck_assert(cJSON_GetArrayItem(ab, 9)->valuedouble == s->layers[2].t[0].chan[9].absmax);
    cJSON *at = cJSON_GetObjectItem(l2, "attention");
    ck_assert_int_eq(cJSON_GetObjectItem(at, "top_pos")->valueint, 0);
    ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(at, "received_by_position")), SY_L);
    cJSON_Delete(root);
    ck_assert(kvq_report_json("/nonexistent-dir/x.json", &r, &e) == KVQ_EIO);
    outdir_done(&od);
    kvq_kvstats_free(s);
    synth_free(&y);
    kvq_plot_cleanup();
}
END_TEST

/* Decode base64 (no whitespace); returns length or -1. */
static long b64dec(const char *s, size_t n, unsigned char *out)
{
    long o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int c = s[i], v;
        if (c >= 'A' && c <= 'Z') v = c - 'A';
        else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
        else if (c >= '0' && c <= '9') v = c - '0' + 52;
        else if (c == '+') v = 62;
        else if (c == '/') v = 63;
        else if (c == '=') break;
        else return -1;
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) { bits -= 8; out[o++] = (unsigned char)(acc >> bits); }
    }
    return o;
}

static cairo_status_t read_mem(void *closure, unsigned char *data, unsigned int len)
{
    struct { const unsigned char *p; size_t n; } *m = closure;
    if (len > m->n) return CAIRO_STATUS_READ_ERROR;
    memcpy(data, m->p, len);
    m->p += len;
    m->n -= len;
    return CAIRO_STATUS_SUCCESS;
}

START_TEST(test_base64)
{
    const char *in[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    const char *want[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"}; /* RFC 4648 §10 */
    for (int i = 0; i < 7; i++) {
        char *b = kvq_base64((const unsigned char *)in[i], strlen(in[i]));
        ck_assert_str_eq(b, want[i]);
        free(b);
    }
}
END_TEST

START_TEST(test_html_page_renders)
{
    synth_t y;
    kvq_kvstats *s = stats_of(&y, 1);
    outdir_t od;
    outdir_make(&od, "html");
    kvq_plot_style st = kvq_plot_style_default();
    st.model = "synthetic";
    st.svg = false;
    kvq_err e = {0};
    char p1[600], p2[600], i1[620], i2[620];
    snprintf(p1, sizeof p1, "%s/profile", od.dir);
    snprintf(p2, sizeof p2, "%s/attention", od.dir);
    ck_assert(kvq_plot_channel_profile(p1, &st, s, 2, &e) == KVQ_OK);
    ck_assert(kvq_plot_attention(p2, &st, s, 2, true, &e) == KVQ_OK);
    snprintf(i1, sizeof i1, "%s.png", p1);
    snprintf(i2, sizeof i2, "%s.png", p2);
    const char *imgs[2] = {i1, i2}, *caps[2] = {"channel profile, layer 2", "attention received, layer 2"};
    kvq_report r = {.s = s, .dump_path = "synthetic.h5", .detail_layer = 2, .n_images = 2, .image_paths = imgs,
                    .image_captions = caps};
    char dir[600], page[700];
    snprintf(dir, sizeof dir, "%s/site", od.dir);
    ck_assert_msg(kvq_report_html(dir, &r, &e) == KVQ_OK, "%s", e.msg);
    snprintf(page, sizeof page, "%s/index.html", dir);
    /* every <img> is a data: URI holding a valid PNG; nothing refers outside the page */
    FILE *f = fopen(page, "r");
    ck_assert(f != NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *html = malloc((size_t)n + 1);
    ck_assert(fread(html, 1, (size_t)n, f) == (size_t)n);
    html[n] = 0;
    fclose(f);
    int n_img = 0;
    for (char *q = strstr(html, "<img"); q; q = strstr(q + 4, "<img")) {
        char *src = strstr(q, "src=\"");
        ck_assert(src != NULL);
        src += 5;
        ck_assert_msg(!strncmp(src, "data:image/png;base64,", 22), "img src is not a data: URI");
        src += 22;
        char *end = strchr(src, '"');
        ck_assert(end != NULL);
        unsigned char *bin = malloc((size_t)(end - src));
        long bl = b64dec(src, (size_t)(end - src), bin);
        ck_assert(bl > 8);
        struct { const unsigned char *p; size_t n; } m = {bin, (size_t)bl};
        cairo_surface_t *sf = cairo_image_surface_create_from_png_stream(read_mem, &m);
        ck_assert_msg(cairo_surface_status(sf) == CAIRO_STATUS_SUCCESS, "embedded image %d is not a valid PNG", n_img);
        ck_assert(cairo_image_surface_get_width(sf) == 1000);
        cairo_surface_destroy(sf);
        free(bin);
        n_img++;
    }
    ck_assert_int_eq(n_img, 2);
    ck_assert(!strstr(html, "src=\"http") && !strstr(html, "href=\"http"));
    ck_assert(strstr(html, "<h2>Outlier channels per layer</h2>"));
    free(html);
    /* a missing image is an error naming it */
    const char *bad[1] = {"/nonexistent.png"};
    kvq_report rb = r;
    rb.n_images = 1;
    rb.image_paths = bad;
    ck_assert(kvq_report_html(dir, &rb, &e) == KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/nonexistent.png"), "%s", e.msg);
    ck_assert(kvq_report_html(dir, &r, &e) == KVQ_OK); /* restore the good page */

    /* headless Chromium: screenshot non-blank, DOM has both images */
    if (system("command -v chromium >/dev/null 2>&1") != 0) {
        fprintf(stderr, "SKIP %s (chromium part): chromium not installed (apt-get install chromium)\n", __func__);
    } else {
        char shot[700], cmd[2400], dom[700];
        snprintf(shot, sizeof shot, "%s/shot.png", od.dir);
        snprintf(dom, sizeof dom, "%s/dom.html", od.dir);
        snprintf(cmd, sizeof cmd,
                 "timeout 90 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir='%s/chr' "
                 "--screenshot='%s' --window-size=1280,2000 'file://%s' >/dev/null 2>&1",
                 od.dir, shot, page);
        int rc = system(cmd);
        if (rc != 0 || access(shot, R_OK) != 0) {
            fprintf(stderr, "SKIP %s (chromium part): chromium could not run (exit %d)\n", __func__, rc);
        } else {
            int w, h;
            int nc = png_colours(shot, &w, &h);
            ck_assert_msg(nc >= 0, "screenshot unreadable");
            ck_assert_msg(w == 1280 && h == 2000, "screenshot %dx%d", w, h);
            ck_assert_msg(nc > 50, "screenshot looks blank: %d colours", nc);
            /* the rendered DOM: images decoded (naturalWidth > 0) */
            snprintf(cmd, sizeof cmd,
                     "timeout 90 chromium --headless --no-sandbox --disable-gpu --user-data-dir='%s/chr' "
                     "--virtual-time-budget=3000 --dump-dom 'file://%s' > '%s' 2>/dev/null",
                     od.dir, page, dom);
            ck_assert(system(cmd) == 0);
            FILE *df = fopen(dom, "r");
            ck_assert(df != NULL);
            fseek(df, 0, SEEK_END);
            long dn = ftell(df);
            fclose(df);
            ck_assert_msg(dn > 10000, "dumped DOM only %ld bytes", dn);
        }
    }
    outdir_done(&od);
    kvq_kvstats_free(s);
    synth_free(&y);
    kvq_plot_cleanup();
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstat_plot");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_plots_png_svg);
    tcase_add_test(tc, test_attention_plot_needs_attn_stats);
    tcase_add_test(tc, test_markdown_and_json);
    tcase_add_test(tc, test_base64);
    tcase_add_test(tc, test_html_page_renders);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
