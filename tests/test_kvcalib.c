/* test_kvcalib.c — kvcalib end to end (calib/calibrate.h, formats/identity.h,
 * cmd/kvcalib.c) on small synthetic dumps written with the dump writer.
 *
 * Data: 2 layers x 2 KV heads x head_dim 8 (kv_dim 16), 3 samples x 64
 * tokens, f32 (exact in the dump). Keys have per-channel offsets and scales,
 * a planted outlier channel (x20, heavy tails), and a huge attention-sink
 * token (30000) at position 0 of every sample; values have rare large entries;
 * Fisher weights vary over four orders of magnitude. k = RoPE(k_pre_rope).
 *
 * References are computed here independently from the arrays that were
 * written: numpy-linear percentiles by full sort in double, the per-token
 * value range by sort, the normalised points in the library's order fed to
 * a direct kvq_kmeans1d call, and the fingerprints as SHA-256 of the
 * canonical text spelled out in identity.h. */
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "artifact.h"
#include "calibrate.h"
#include "capture.h"
#include "dump.h"
#include "identity.h"
#include "kmeans.h"
#include "quant.h"
#include "quant_fp8.h"
#include "safetensors.h"
#include "kvq_test.h"

enum { NL = 2, HKV = 2, HD = 8, KVD = HKV * HD, NS = 3, SL = 64, ROPE_DIM = 6, NTOK = NS * SL };
enum { D_KPRE = 0, D_K, D_V, D_FK, D_FV, D_N };
#define PLANTED_CHANNEL 11 /* head 1, channel 3 */

/* ---- synthetic data ------------------------------------------------------- */

typedef struct { uint64_t s; } rng;
static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double unif(rng *r) { return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static double gauss(rng *r) { return sqrt(-2 * log(unif(r))) * cos(6.283185307179586 * unif(r)); }

typedef struct {
    float *x[NL][D_N]; /* [NTOK][KVD] each */
    int32_t tok[NS][SL];
} synth;

static void synth_make(synth *d, uint64_t seed)
{
    rng r = {seed};
    for (int l = 0; l < NL; l++) {
        for (int j = 0; j < D_N; j++) d->x[l][j] = malloc(NTOK * KVD * sizeof(float));
        double off[KVD], sc[KVD];
        for (int c = 0; c < KVD; c++) {
            off[c] = gauss(&r);
            sc[c] = exp(0.5 * gauss(&r)) * (c == PLANTED_CHANNEL ? 20 : 1);
        }
        for (int t = 0; t < NTOK; t++) {
            int pos = t % SL;
            for (int c = 0; c < KVD; c++) {
                size_t i = (size_t)t * KVD + c;
                double g = gauss(&r);
                if (c == PLANTED_CHANNEL && unif(&r) < 0.05) g *= 10;
                d->x[l][D_KPRE][i] = pos == 0 ? (float)(30000 + c) : (float)(off[c] + sc[c] * g);
                double v = 0.5 * gauss(&r) + (unif(&r) < 0.03 ? 6 * gauss(&r) : 0);
                d->x[l][D_V][i] = pos == 0 ? (float)(800 - c) : (float)v;
                double gk = gauss(&r) * exp(2 * gauss(&r)) * 1e-3, gv = gauss(&r) * exp(2 * gauss(&r)) * 1e-3;
                d->x[l][D_FK][i] = (float)(gk * gk);
                d->x[l][D_FV][i] = (float)(gv * gv);
            }
            /* k = interleaved RoPE(k_pre_rope) at position pos, theta 10000 */
            for (int h = 0; h < HKV; h++) {
                const float *x = d->x[l][D_KPRE] + (size_t)t * KVD + h * HD;
                float *y = d->x[l][D_K] + (size_t)t * KVD + h * HD;
                for (int c = 0; c < HD; c++) y[c] = x[c];
                for (int i = 0; i < ROPE_DIM / 2; i++) {
                    double a = pos * pow(10000.0, -2.0 * i / ROPE_DIM), x0 = x[2 * i], x1 = x[2 * i + 1];
                    y[2 * i] = (float)(x0 * cos(a) - x1 * sin(a));
                    y[2 * i + 1] = (float)(x0 * sin(a) + x1 * cos(a));
                }
            }
        }
    }
    for (int s = 0; s < NS; s++)
        for (int t = 0; t < SL; t++) d->tok[s][t] = (int32_t)((s * 31 + t * 7 + 3) % 100);
}

static void synth_free(synth *d)
{
    for (int l = 0; l < NL; l++)
        for (int j = 0; j < D_N; j++) free(d->x[l][j]);
}

static const int64_t OFFSETS[NS] = {0, 1000, 2000};

static void test_meta(kvq_dump_meta *m, kvq_hparams *hp_out)
{
    memset(m, 0, sizeof *m);
    snprintf(m->kvq_version, sizeof m->kvq_version, "0.1.0-test");
    snprintf(m->model_path, sizeof m->model_path, "models/tiny.gguf");
    snprintf(m->model_sha256, sizeof m->model_sha256, "%064d", 7);
    snprintf(m->model_arch, sizeof m->model_arch, "llama");
    kvq_hparams hp = {.n_layers = NL, .dim = 32, .hidden_dim = 64, .n_heads = 4, .n_kv_heads = HKV, .head_dim = HD,
                      .vocab_size = 100, .ctx_len = 256, .rope_dim = ROPE_DIM, .rope_theta = 10000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1.0f};
    if (hp_out) *hp_out = hp;
    kvq_dump_meta_set_hparams(m, &hp);
    snprintf(m->tokenizer, sizeof m->tokenizer, "test:bytes vocab=100");
    snprintf(m->corpus_path, sizeof m->corpus_path, "corpus.txt");
    snprintf(m->corpus_sha256, sizeof m->corpus_sha256, "%064d", 9);
    snprintf(m->corpus_format, sizeof m->corpus_format, "raw");
    snprintf(m->bos_policy, sizeof m->bos_policy, "none");
    m->n_samples = NS;
    m->seq_len = SL;
    m->seed = 0;
    m->sample_offsets = OFFSETS;
    m->dtype = KVQ_DUMP_F32;
    m->has_fisher = true;
    m->layer_first = 0;
    m->layer_last = NL - 1;
    snprintf(m->command_line, sizeof m->command_line, "test_kvcalib");
}

typedef struct {
    bool no_fisher;
    int layer_first, layer_last;
    int64_t seed;
    int samples; /* commit this many samples; < NS leaves a .partial (abort) */
} dump_spec;

static void write_dump(const char *path, const synth *d, const dump_spec *sp)
{
    kvq_dump_meta m;
    test_meta(&m, NULL);
    m.has_fisher = !sp->no_fisher;
    m.layer_first = sp->layer_first;
    m.layer_last = sp->layer_last ? sp->layer_last : NL - 1;
    m.seed = sp->seed;
    char p[512];
    unlink(path);
    snprintf(p, sizeof p, "%s.partial", path);
    unlink(p);
    kvq_dump_opts o = kvq_dump_opts_default();
    o.deflate_level = 0;
    kvq_dump_writer *w;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    int n = sp->samples ? sp->samples : NS;
    for (int s = 0; s < n; s++) {
        kvq_dump_layer_data ld[NL];
        for (int l = m.layer_first; l <= m.layer_last; l++) {
            size_t off = (size_t)s * SL * KVD;
            ld[l - m.layer_first] = (kvq_dump_layer_data){.k_pre_rope = d->x[l][D_KPRE] + off,
                                                          .k = d->x[l][D_K] + off,
                                                          .v = d->x[l][D_V] + off,
                                                          .fisher_k_pre_rope = d->x[l][D_FK] + off,
                                                          .fisher_v = d->x[l][D_FV] + off};
        }
        ck_assert_msg(kvq_dump_write_sample(w, s, d->tok[s], ld, &e) == KVQ_OK, "%s", e.msg);
    }
    if (n == NS) ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    else ck_assert_msg(kvq_dump_abort(w, &e) == KVQ_OK, "%s", e.msg);
}

static void tmp(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/kvq_test_kvcalib_%d_%s", (int)getpid(), tag);
}

/* ---- independent references --------------------------------------------------- */

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* numpy percentile(method="linear") of sorted s[0..n) at fraction q, as numpy's _lerp, rounded to float. */
static float ref_percentile(const double *s, size_t n, double q)
{
    double pos = q * (double)(n - 1);
    size_t i = (size_t)floor(pos);
    if (i + 1 >= n) return (float)s[n - 1];
    double g = pos - (double)i, a = s[i], b = s[i + 1];
    return (float)(g >= 0.5 ? b - (b - a) * (1 - g) : a + (b - a) * g);
}

static bool is_sink(int t, int n_sink) { return t % SL < n_sink; }

/* thresholds of channel c over non-sink tokens */
static void ref_thresholds(const float *x, int c, int n_sink, double f, float *lo, float *hi, size_t *n_used)
{
    double *s = malloc(NTOK * sizeof *s);
    size_t n = 0;
    for (int t = 0; t < NTOK; t++)
        if (!is_sink(t, n_sink)) s[n++] = x[(size_t)t * KVD + c];
    qsort(s, n, sizeof *s, cmp_d);
    double tq = 1.0 - f / 2;
    *lo = ref_percentile(s, n, 1.0 - tq);
    *hi = ref_percentile(s, n, tq);
    *n_used = n;
    free(s);
}

static float norm1(float x, double lo, double hi)
{
    double zp = (hi + lo) * 0.5, r = (hi - lo) * 0.5, xn = ((double)x - zp) / r;
    return (float)(xn > 1 ? 1 : xn < -1 ? -1 : xn);
}

/* Key levels by a direct kvq_kmeans1d call on the normalised inliers (token-major order). */
static void ref_key_levels(const float *x, const float *w, const float *lo, const float *hi, int n_sink, int bits,
                           float *levels)
{
    float *px = malloc(NTOK * KVD * sizeof *px), *pw = malloc(NTOK * KVD * sizeof *pw);
    size_t n = 0;
    for (int t = 0; t < NTOK; t++) {
        if (is_sink(t, n_sink)) continue;
        for (int c = 0; c < KVD; c++) {
            float v = x[(size_t)t * KVD + c];
            if (v < lo[c] || v > hi[c] || lo[c] == hi[c]) continue;
            px[n] = norm1(v, lo[c], hi[c]);
            pw[n++] = w ? w[(size_t)t * KVD + c] : 1.0f;
        }
    }
    kvq_kmeans_opts ko = {.method = KVQ_FIT_AUTO};
    kvq_err e = {0};
    ck_assert_msg(kvq_kmeans1d(px, w ? pw : NULL, n, 1 << bits, &ko, levels, NULL, &e) == KVQ_OK, "%s", e.msg);
    for (int j = 0; j < 1 << bits; j++) levels[j] = levels[j] > 1 ? 1 : levels[j] < -1 ? -1 : levels[j];
    free(px);
    free(pw);
}

/* Value levels: per-token range by sorting (k per side), then kmeans. */
static void ref_value_levels(const float *x, const float *w, int n_sink, double f, int bits, float *levels)
{
    float *px = malloc(NTOK * KVD * sizeof *px), *pw = malloc(NTOK * KVD * sizeof *pw);
    size_t n = 0, k = kvq_outliers_per_side(KVD, f);
    for (int t = 0; t < NTOK; t++) {
        if (is_sink(t, n_sink)) continue;
        double s[KVD];
        for (int c = 0; c < KVD; c++) s[c] = x[(size_t)t * KVD + c];
        qsort(s, KVD, sizeof *s, cmp_d);
        double lo = s[k], hi = s[KVD - 1 - k];
        if (hi == lo) continue;
        for (int c = 0; c < KVD; c++) {
            float v = x[(size_t)t * KVD + c];
            if (v < lo || v > hi) continue;
            px[n] = norm1(v, lo, hi);
            pw[n++] = w ? w[(size_t)t * KVD + c] : 1.0f;
        }
    }
    kvq_kmeans_opts ko = {.method = KVQ_FIT_AUTO};
    kvq_err e = {0};
    ck_assert_msg(kvq_kmeans1d(px, w ? pw : NULL, n, 1 << bits, &ko, levels, NULL, &e) == KVQ_OK, "%s", e.msg);
    for (int j = 0; j < 1 << bits; j++) levels[j] = levels[j] > 1 ? 1 : levels[j] < -1 ? -1 : levels[j];
    free(px);
    free(pw);
}

static void sha256_hex(const char *text, char hex[65])
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned dn = 0;
    ck_assert(EVP_Digest(text, strlen(text), d, &dn, EVP_sha256(), NULL) == 1);
    for (unsigned i = 0; i < dn; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

static bool same_bytes(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool same = fa && fb;
    while (same) {
        int x = fgetc(fa), y = fgetc(fb);
        if (x != y) same = false;
        if (x == EOF || y == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

/* ---- tests ----------------------------------------------------------------------- */

/* nuq3 at 10% and 1% outliers: thresholds, realised outlier fraction, levels, counts. */
static void check_nuq(double f, int bits)
{
    synth d;
    synth_make(&d, 42);
    char dump[256], out[256];
    tmp(dump, sizeof dump, "nuq.h5");
    tmp(out, sizeof out, "nuq.safetensors");
    write_dump(dump, &d, &(dump_spec){0});
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    o.k_bits = o.v_bits = bits;
    o.outlier_frac = f;
    kvq_err e = {0};
    unlink(out);
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact a;
    ck_assert_msg(kvq_artifact_read(out, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_eq(a.p.method, KVQ_FAM("nuq"));
    ck_assert_int_eq(a.p.k_bits, bits);
    ck_assert_uint_eq(a.p.n_sink, 1);
    ck_assert(a.p.fisher && !a.p.post_rope && !a.p.per_head);
    ck_assert_uint_eq(a.p.n_layers, NL);
    ck_assert_uint_eq(a.p.bits_ctx, SL);
    int nl = 1 << bits;
    for (int l = 0; l < NL; l++) {
        const kvq_kv_table *k = &a.k[l], *v = &a.v[l];
        uint64_t out_total = 0;
        for (int c = 0; c < KVD; c++) {
            float lo, hi;
            size_t n;
            ref_thresholds(d.x[l][D_KPRE], c, 1, f, &lo, &hi, &n);
            ck_assert_msg(k->channel_lower[c] == lo && k->channel_upper[c] == hi,
                          "layer %d channel %d: thresholds [%a, %a], expected [%a, %a]", l, c,
                          (double)k->channel_lower[c], (double)k->channel_upper[c], (double)lo, (double)hi);
            ck_assert_msg(hi < 30000, "layer %d channel %d: the sink token leaked into the thresholds (%g)", l, c, (double)hi);
            /* realised per-channel outliers: numpy-linear leaves (n-1) - floor(t (n-1)) values above
             * (distinct data), the same number below */
            size_t above = 0, below = 0;
            for (int t = 0; t < NTOK; t++) {
                if (is_sink(t, 1)) continue;
                float x = d.x[l][D_KPRE][(size_t)t * KVD + c];
                above += x > hi;
                below += x < lo;
            }
            double pos = (1 - f / 2) * (double)(n - 1);
            size_t want = (size_t)(n - 1) - (size_t)floor(pos);
            if (pos == floor(pos)) want = (size_t)(n - 1) - (size_t)pos; /* hits a sample: it stays inside */
            ck_assert_msg(above == want && below == want, "layer %d channel %d: %zu above, %zu below, expected %zu each", l,
                          c, above, below, want);
            ck_assert_msg(fabs((double)(above + below) / (double)n - f) <= 2.0 / (double)n,
                          "layer %d channel %d: realised fraction %g, requested %g", l, c, (double)(above + below) / (double)n, f);
            out_total += above + below;
        }
        ck_assert_uint_eq(k->n_outliers, out_total);
        ck_assert_uint_eq(k->n_elems, (uint64_t)(NTOK - NS) * KVD);
        float want_lv[256], plain_lv[256];
        ref_key_levels(d.x[l][D_KPRE], d.x[l][D_FK], k->channel_lower, k->channel_upper, 1, bits, want_lv);
        for (int j = 0; j < nl; j++)
            ck_assert_msg(k->levels[j] == want_lv[j], "layer %d K level %d: %a, expected %a", l, j, (double)k->levels[j],
                          (double)want_lv[j]);
        /* the Fisher weights matter: the unweighted fit differs */
        ref_key_levels(d.x[l][D_KPRE], NULL, k->channel_lower, k->channel_upper, 1, bits, plain_lv);
        ck_assert_msg(memcmp(plain_lv, want_lv, (size_t)nl * sizeof *want_lv) != 0, "layer %d: Fisher weights had no effect", l);
        ref_value_levels(d.x[l][D_V], d.x[l][D_FV], 1, f, bits, want_lv);
        /* nuq's value LUT is fp16: the artifact loader rounds the fitted levels */
        for (int j = 0; j < nl; j++)
            ck_assert_msg(v->levels[j] == kvq_round_fp16(want_lv[j]), "layer %d V level %d: %a, expected fp16(%a)", l, j,
                          (double)v->levels[j], (double)want_lv[j]);
        for (const kvq_kv_table *t = k; t; t = t == k ? v : NULL) {
            ck_assert(t->obj_lloyd[0] > 0 && t->obj_exact[0] > 0);
            ck_assert_msg(t->obj_exact[0] <= t->obj_lloyd[0] * (1 + 1e-12), "exact %g > lloyd %g", t->obj_exact[0],
                          t->obj_lloyd[0]);
        }
    }
    kvq_artifact_free(&a);
    synth_free(&d);
    unlink(dump);
    unlink(out);
}

START_TEST(test_nuq_tables) { check_nuq(0.1, 3); check_nuq(0.01, 2); check_nuq(0, 4); }
END_TEST

START_TEST(test_post_rope_and_per_head)
{
    synth d;
    synth_make(&d, 7);
    char dump[256];
    tmp(dump, sizeof dump, "post.h5");
    write_dump(dump, &d, &(dump_spec){0});
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(dump, &r, &e) == KVQ_OK, "%s", e.msg);
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    o.k_bits = o.v_bits = 3;
    o.post_rope = true;
    kvq_artifact a;
    ck_assert_msg(kvq_calibrate_dump(r, dump, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(a.p.post_rope);
    /* thresholds from /layers/i/k; Fisher = pre-RoPE Fisher averaged over rotary pairs */
    float *w = malloc(NTOK * KVD * sizeof *w);
    for (int l = 0; l < NL; l++) {
        for (int c = 0; c < KVD; c++) {
            float lo, hi;
            size_t n;
            ref_thresholds(d.x[l][D_K], c, 1, 0.01, &lo, &hi, &n);
            ck_assert(a.k[l].channel_lower[c] == lo && a.k[l].channel_upper[c] == hi);
        }
        for (int t = 0; t < NTOK; t++)
            for (int c = 0; c < KVD; c++) {
                int dd = c % HD, c0 = c - dd % 2;
                const float *f = d.x[l][D_FK] + (size_t)t * KVD;
                w[(size_t)t * KVD + c] = dd < ROPE_DIM ? (float)(((double)f[c0] + (double)f[c0 + 1]) * 0.5) : f[c];
            }
        float want[8];
        ref_key_levels(d.x[l][D_K], w, a.k[l].channel_lower, a.k[l].channel_upper, 1, 3, want);
        ck_assert(memcmp(want, a.k[l].levels, sizeof want) == 0);
    }
    kvq_artifact_free(&a);
    /* per-head: one datatype per KV head; head h fitted on its own channels */
    o.post_rope = false;
    o.per_head = true;
    ck_assert_msg(kvq_calibrate_dump(r, dump, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(a.k[1].n_tables, HKV);
    ck_assert_uint_eq(a.v[1].n_tables, HKV);
    for (int h = 0; h < HKV; h++) {
        /* reference: mask the other head's channels by giving them zero range */
        float lo[KVD], hi[KVD], want[8];
        for (int c = 0; c < KVD; c++) {
            bool mine = c / HD == h;
            lo[c] = mine ? a.k[1].channel_lower[c] : 0;
            hi[c] = mine ? a.k[1].channel_upper[c] : 0;
        }
        ref_key_levels(d.x[1][D_KPRE], d.x[1][D_FK], lo, hi, 1, 3, want);
        ck_assert_msg(memcmp(want, a.k[1].levels + 8 * h, sizeof want) == 0, "head %d levels differ", h);
    }
    kvq_artifact_free(&a);
    kvq_dump_close(r);
    free(w);
    synth_free(&d);
    unlink(dump);
}
END_TEST

START_TEST(test_baselines)
{
    synth d;
    synth_make(&d, 3);
    char dump[256], out[256];
    tmp(dump, sizeof dump, "base.h5");
    tmp(out, sizeof out, "base.safetensors");
    write_dump(dump, &d, &(dump_spec){.no_fisher = true});
    kvq_err e = {0};
    kvq_artifact a;
    /* int-pc: thresholds only, no Fisher needed */
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("int-pc"));
    o.k_bits = o.v_bits = 3;
    o.outlier_frac = 0.02;
    unlink(out);
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_artifact_read(out, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_eq(a.p.method, KVQ_FAM("int-pc"));
    ck_assert(a.p.post_rope);
    ck_assert_uint_eq(a.p.n_sink, 1);
    ck_assert_ptr_nonnull(a.k);
    ck_assert_uint_eq(a.k[0].n_tables, 0);
    for (int c = 0; c < KVD; c++) {
        float lo, hi;
        size_t n;
        ref_thresholds(d.x[1][D_K], c, 1, 0.02, &lo, &hi, &n); /* int-pc defaults: post-RoPE keys, sink 1 */
        ck_assert(a.k[1].channel_lower[c] == lo && a.k[1].channel_upper[c] == hi);
    }
    kvq_artifact_free(&a);
    /* int and kivi: metadata only; bits accounting filled */
    const struct { const kvq_family *m; int bits; double bk; } cases[] = {
        {KVQ_FAM("int"), 4, ((SL - 1) * (4 + 32.0 / KVD) + 16) / SL}, /* whole-token group b + 32/kv_dim; 1 sink token at 16 */
        {KVQ_FAM("kivi"), 2, -1},
    };
    for (size_t i = 0; i < 2; i++) {
        o = kvq_calibrate_defaults(cases[i].m);
        o.k_bits = o.v_bits = cases[i].bits;
        if (cases[i].m == KVQ_FAM("kivi")) { o.group_size = 4; o.residual_length = 8; }
        ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, &a, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_ptr_null(a.k);
        ck_assert_ptr_null(a.v);
        if (cases[i].bk > 0) ck_assert_double_eq_tol(a.p.bits_k, cases[i].bk, 1e-12);
        kvq_artifact_free(&a);
        ck_assert_msg(kvq_artifact_read(out, &a, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_ptr_eq(a.p.method, cases[i].m);
        if (cases[i].m == KVQ_FAM("kivi")) {
            ck_assert_uint_eq(a.p.group_size, 4);
            ck_assert_uint_eq(a.p.residual_length, 8);
            ck_assert_int_eq(a.p.k_bits, 2);
        }
        kvq_artifact_free(&a);
    }
    /* kivi: G must divide head_dim (dump-dependent check) */
    o = kvq_calibrate_defaults(KVQ_FAM("kivi"));
    o.group_size = 16;
    o.residual_length = 32;
    ck_assert_int_eq(kvq_calibrate_file(dump, out, true, &o, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "group size") && strstr(e.msg, "head_dim 8"), "%s", e.msg);
    synth_free(&d);
    unlink(dump);
    unlink(out);
}
END_TEST

START_TEST(test_deterministic)
{
    synth d;
    synth_make(&d, 11);
    char dump[256], o1[256], o2[256], o3[256];
    tmp(dump, sizeof dump, "det.h5");
    tmp(o1, sizeof o1, "det1.st");
    tmp(o2, sizeof o2, "det2.st");
    tmp(o3, sizeof o3, "det3.st");
    write_dump(dump, &d, &(dump_spec){0});
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    o.k_bits = o.v_bits = 3;
    kvq_err e = {0};
    unlink(o1);
    unlink(o2);
    unlink(o3);
    o.n_threads = 2;
    ck_assert_msg(kvq_calibrate_file(dump, o1, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_calibrate_file(dump, o2, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    o.n_threads = 1;
    ck_assert_msg(kvq_calibrate_file(dump, o3, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(same_bytes(o1, o2), "two runs differ");
    ck_assert_msg(same_bytes(o1, o3), "1 and 2 threads differ");
    char t1[300];
    snprintf(t1, sizeof t1, "%s.tmp", o1);
    ck_assert(!exists(t1));
    /* refuses to overwrite without force; force replaces */
    ck_assert_int_eq(kvq_calibrate_file(dump, o1, false, &o, NULL, &e), KVQ_EIO);
    ck_assert_msg(strstr(e.msg, o1) && strstr(e.msg, "already exists") && strstr(e.msg, "--force"), "%s", e.msg);
    ck_assert_msg(kvq_calibrate_file(dump, o1, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(same_bytes(o1, o2));
    synth_free(&d);
    unlink(dump);
    unlink(o1);
    unlink(o2);
    unlink(o3);
}
END_TEST

START_TEST(test_fingerprints)
{
    synth d;
    synth_make(&d, 5);
    char dump[256], dump2[256], dump3[256], out[256];
    tmp(dump, sizeof dump, "fp1.h5");
    tmp(dump2, sizeof dump2, "fp2.h5");
    tmp(dump3, sizeof dump3, "fp3.h5");
    tmp(out, sizeof out, "fp.st");
    write_dump(dump, &d, &(dump_spec){0});
    write_dump(dump2, &d, &(dump_spec){0});
    write_dump(dump3, &d, &(dump_spec){.seed = 1});
    /* model fingerprint: SHA-256 of the canonical text of identity.h, spelled out here */
    char want[65], got[65], got2[65];
    char text[2048];
    snprintf(text, sizeof text,
             "kvq-artifact-model-v1\nweights_sha256=%064d\nmodel_arch=llama\n"
             "n_layers=2\ndim=32\nhidden_dim=64\nn_heads=4\nn_kv_heads=2\nhead_dim=8\nvocab_size=100\nctx_len=256\n"
             "rope_theta=0x1.388p+13\nrope_dim=6\nrope_pairing=interleaved\nrope_scaling=none\n"
             "rope_scale_factor=0x1p+0\nrope_low_freq_factor=0x0p+0\nrope_high_freq_factor=0x0p+0\nrope_orig_ctx=0\n",
             7);
    sha256_hex(text, want);
    kvq_dump_meta m;
    kvq_hparams hp;
    test_meta(&m, &hp);
    kvq_err e = {0};
    ck_assert_msg(kvq_identity_model_from_dump(&m, got, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(got, want);
    char wsha[65];
    snprintf(wsha, sizeof wsha, "%064d", 7);
    ck_assert_msg(kvq_identity_model_hp(wsha, &hp, got2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(got2, want); /* kveval's side (from the model) agrees */
    hp.rope_theta = 500000.0f;
    ck_assert(kvq_identity_model_hp(wsha, &hp, got2, &e) == KVQ_OK && strcmp(got2, want) != 0);
    ck_assert_int_eq(kvq_identity_model_hp("abc", &hp, got2, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "model_sha256"), "%s", e.msg);
    /* the artifact records it; check_model accepts the model's and rejects another */
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("int"));
    kvq_artifact a;
    ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(a.p.model_fingerprint, want);
    ck_assert_int_eq(kvq_artifact_check_model(&a.p, want, false, NULL, &e), KVQ_OK);
    ck_assert_int_eq(kvq_artifact_check_model(&a.p, got2, false, NULL, &e), KVQ_EMISMATCH);
    /* dump fingerprint: independent of the path, sensitive to the sampling */
    kvq_artifact a2, a3;
    ck_assert_msg(kvq_calibrate_file(dump2, out, true, &o, &a2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_calibrate_file(dump3, out, true, &o, &a3, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(strlen(a.p.dump_fingerprint), 64);
    ck_assert_str_eq(a.p.dump_fingerprint, a2.p.dump_fingerprint);
    ck_assert_str_ne(a.p.dump_fingerprint, a3.p.dump_fingerprint);
    kvq_artifact_free(&a);
    kvq_artifact_free(&a2);
    kvq_artifact_free(&a3);
    synth_free(&d);
    unlink(dump);
    unlink(dump2);
    unlink(dump3);
    unlink(out);
}
END_TEST

/* kvdump → kvcalib → kveval on a real (tiny) model: the artifact's model
 * fingerprint, computed from the dump's attributes, equals the one kveval
 * computes from the loaded model file. */
START_TEST(test_model_chain)
{
    char model[4096], tokf[4096], text[4096];
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/aidreams260K.bin") ||
                    !kvq_test_shared(tokf, sizeof tokf, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared tiny model or WikiText-2 absent");
    char dump[256], out[256];
    tmp(dump, sizeof dump, "chain.h5");
    tmp(out, sizeof out, "chain.st");
    unlink(dump);
    unlink(out);
    kvq_capture_opts co = kvq_capture_opts_default();
    co.model_path = model;
    co.tokenizer_path = tokf;
    co.text_path = text;
    co.format = KVQ_TEXT_WIKITEXT_TOKENS;
    co.samples = 2;
    co.seq_len = 64;
    co.quiet = true;
    co.out_path = dump;
    co.command_line = "test_kvcalib";
    kvq_capture_report rep;
    kvq_err e = {0};
    { /* interrupted before the first sample: no file, and the message does not offer --resume (the
       * empty .partial is removed, so --resume then found nothing) */
        volatile sig_atomic_t stop = 1;
        kvq_capture_opts c2 = co;
        c2.stop = &stop;
        ck_assert_int_eq(kvq_capture_run(&c2, &rep, &e), KVQ_EIO);
        ck_assert_msg(strstr(e.msg, "before the first of 2 samples") && !strstr(e.msg, "--resume"), "%s", e.msg);
        char partial[300];
        snprintf(partial, sizeof partial, "%s.partial", dump);
        ck_assert(!exists(partial) && !exists(dump));
    }
    ck_assert_msg(kvq_capture_run(&co, &rep, &e) == KVQ_OK, "%s", e.msg);
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    o.k_bits = o.v_bits = 3;
    o.fisher = false;
    kvq_artifact a;
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_model m;
    ck_assert_msg(kvq_model_load(model, &m, &e) == KVQ_OK, "%s", e.msg);
    char fp[65];
    ck_assert_msg(kvq_identity_model(&m, fp, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(a.p.model_fingerprint, fp);
    ck_assert_int_eq(kvq_artifact_check_model(&a.p, fp, false, NULL, &e), KVQ_OK);
    ck_assert_uint_eq(a.p.n_layers, (size_t)m.hp.n_layers);
    ck_assert_uint_eq(a.p.head_dim, (size_t)m.hp.head_dim);
    kvq_model_free(&m);
    kvq_artifact_free(&a);
    unlink(dump);
    unlink(out);
}
END_TEST

/* ---- fp8 scales (issue 13) ------------------------------------------------------- */

static void expect_fail(const char *dump, const kvq_calibrate_opts *o, kvq_status code, const char *const *needles);

/* Rows of x ([NTOK][KVD]) without each sample's first n_sink tokens. */
static float *drop_sink(const float *x, int n_sink, size_t *rows)
{
    float *y = malloc(NTOK * KVD * sizeof(float));
    size_t r = 0;
    for (int t = 0; t < NTOK; t++)
        if (!is_sink(t, n_sink)) memcpy(y + KVD * r++, x + (size_t)t * KVD, KVD * sizeof(float));
    *rows = r;
    return y;
}

/* kvcalib fp8 scales == kvq_fp8_calib_* on the arrays written to the dump
 * (post-RoPE k, v), per tensor and per head, absmax / percentile, E4M3 / E5M2,
 * with and without sink; saturation counts by direct count; artifact round
 * trip; vLLM export read back with kvq's safetensors reader. */
START_TEST(test_fp8_scales)
{
    synth d;
    synth_make(&d, 23);
    char dump[256], out[256], vl[256];
    tmp(dump, sizeof dump, "fp8.h5");
    tmp(out, sizeof out, "fp8.safetensors");
    tmp(vl, sizeof vl, "fp8_vllm.safetensors");
    write_dump(dump, &d, &(dump_spec){.no_fisher = true});
    kvq_err e = {0};
    const struct {
        bool head, e5m2;
        double pct;
        int sink;
    } cases[] = {{false, false, 100, 0}, {true, false, 100, 0}, {true, false, 90, 0}, {false, true, 100, 0},
                 {true, false, 100, 1}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
        ck_assert(o.post_rope && o.n_sink == 0 && o.k_bits == 8 && o.fp8_percentile == 100);
        o.per_head = cases[ci].head;
        o.fp8_e5m2 = cases[ci].e5m2;
        o.fp8_percentile = cases[ci].pct;
        o.n_sink = (size_t)cases[ci].sink;
        kvq_artifact a;
        ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_artifact_read(out, &a, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_ptr_eq(a.p.method, KVQ_FAM("fp8"));
        kvq_test_python("check_artifact.py", out);
        ck_assert(a.p.per_head == cases[ci].head && a.p.fp8_e5m2 == cases[ci].e5m2 && a.p.post_rope);
        ck_assert_double_eq(a.p.fp8_percentile, cases[ci].pct);
        size_t nsc = cases[ci].head ? HKV : 1;
        /* bits: 8 + 32 n_scales / (ctx kv_dim) at ctx = seq_len, sink tokens at 16 */
        double dense = 8 + 32.0 * nsc / (SL * KVD);
        ck_assert_double_eq_tol(a.p.bits_k, ((SL - cases[ci].sink) * dense + cases[ci].sink * 16.0) / SL, 1e-12);
        kvq_fp8_format f = cases[ci].e5m2 ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN;
        uint64_t tot_sat = 0;
        for (int l = 0; l < NL; l++)
            for (int w = 0; w < 2; w++) {
                size_t rows;
                float *x = drop_sink(d.x[l][w ? D_V : D_K], cases[ci].sink, &rows);
                float ref[HKV];
                if (cases[ci].head) ck_assert(kvq_fp8_calib_heads(f, x, rows, HKV, HD, cases[ci].pct, ref, &e) == KVQ_OK);
                else ck_assert(kvq_fp8_calib_tensor(f, x, rows, HKV, HD, cases[ci].pct, ref, &e) == KVQ_OK);
                const kvq_kv_table *t = w ? &a.v[l] : &a.k[l];
                ck_assert_uint_eq(t->n_fp8_scales, nsc);
                uint64_t sat = 0;
                for (size_t i = 0; i < rows * KVD; i++)
                    sat += fabsf(x[i] / ref[cases[ci].head ? (i % KVD) / HD : 0]) >= (cases[ci].e5m2 ? 61440.0f : 464.0f);
                for (size_t h = 0; h < nsc; h++)
                    ck_assert_msg(t->fp8_scale[h] == ref[h], "case %zu layer %d %c head %zu: %.9g vs %.9g", ci, l, w ? 'v' : 'k',
                                  h, (double)t->fp8_scale[h], (double)ref[h]);
                ck_assert_uint_eq(t->n_elems, rows * KVD);
                ck_assert_uint_eq(t->n_outliers, sat);
                if (cases[ci].pct == 100) ck_assert_uint_eq(sat, 0);
                tot_sat += sat;
                /* the absmax rule by hand: the (sink-free) maximum |x| over the tensor / head / 448 */
                if (cases[ci].pct == 100 && !cases[ci].e5m2)
                    for (size_t h = 0; h < nsc; h++) {
                        float mx = 0;
                        for (size_t i = 0; i < rows * KVD; i++)
                            if ((!cases[ci].head || (i % KVD) / HD == h) && fabsf(x[i]) > mx) mx = fabsf(x[i]);
                        ck_assert_float_eq_tol(t->fp8_scale[h], mx / 448.0f, mx * 1e-6f);
                    }
                free(x);
            }
        if (cases[ci].pct < 100) ck_assert_uint_gt(tot_sat, 0); /* a percentile scale clips the tails */
        /* the sink changes the scales: token 0 holds the planted sink values (30000 + c keys, 800 - c values) */
        if (cases[ci].sink) ck_assert(a.v[0].fp8_scale[0] < 100.0f / 448);
        else if (!cases[ci].e5m2 && cases[ci].pct == 100) ck_assert(a.v[0].fp8_scale[0] >= 790.0f / 448);
        /* export for vLLM; read back */
        if (!cases[ci].e5m2 && !cases[ci].sink) {
            unlink(vl);
            ck_assert_msg(kvq_calibrate_export_vllm(&a, vl, false, &e) == KVQ_OK, "%s", e.msg);
            kvq_safetensors st;
            ck_assert_msg(kvq_safetensors_open(vl, &st, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_str_eq(kvq_safetensors_meta(&st, "format"), "pt");
            ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.fp8_format"), "e4m3fn");
            ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.granularity"), cases[ci].head ? "per-head" : "per-tensor");
            ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.model_fingerprint"), a.p.model_fingerprint);
            for (int l = 0; l < NL; l++)
                for (int w = 0; w < 2; w++) {
                    char name[96];
                    snprintf(name, sizeof name, "model.layers.%d.self_attn.%c_scale", l, w ? 'v' : 'k');
                    const kvq_st_tensor *t = kvq_safetensors_find(&st, name);
                    ck_assert_msg(t, "%s missing", name);
                    ck_assert_int_eq(t->dtype, KVQ_ST_F32);
                    ck_assert_uint_eq(t->n_dims, cases[ci].head ? 1 : 0);
                    if (cases[ci].head) ck_assert_uint_eq(t->shape[0], HKV);
                    float got[HKV];
                    ck_assert(kvq_safetensors_read_f32(&st, t, got, nsc, &e) == KVQ_OK);
                    const kvq_kv_table *tb = w ? &a.v[l] : &a.k[l];
                    ck_assert(memcmp(got, tb->fp8_scale, nsc * sizeof(float)) == 0);
                }
            ck_assert(kvq_safetensors_find(&st, "model.layers.2.self_attn.k_scale") == NULL);
            kvq_safetensors_close(&st);
            /* no overwrite without force */
            ck_assert_int_eq(kvq_calibrate_export_vllm(&a, vl, false, &e), KVQ_EIO);
            ck_assert_msg(strstr(e.msg, "already exists"), "%s", e.msg);
            /* the three forms (vllm, llm-compressor's compressed-tensors + config.json fragment, ModelOpt's names),
             * each read back by the Python safetensors package and compared with the artifact bit for bit */
            for (int fm = 0; fm < 3; fm++) {
                char xp[256], cj[256], args[1024];
                tmp(xp, sizeof xp, fm == 0 ? "x_vllm.st" : fm == 1 ? "x_ct.st" : "x_mo.st");
                tmp(cj, sizeof cj, "x_ct.json");
                unlink(cj);
                const char *cfg = fm == KVQ_SCALES_COMPRESSED_TENSORS ? cj : NULL;
                kvq_status xs = kvq_calibrate_export_scales(&a, (kvq_kv_scale_form)fm, xp, cfg, true, &e);
                if (fm == KVQ_SCALES_MODELOPT && cases[ci].head) { /* ModelOpt has one scale per layer */
                    ck_assert_int_eq(xs, KVQ_EUNSUPPORTED);
                    ck_assert_msg(strstr(e.msg, "modelopt form") && strstr(e.msg, "per-KV-head"), "%s", e.msg);
                    continue;
                }
                ck_assert_msg(xs == KVQ_OK, "%s", e.msg);
                snprintf(args, sizeof args, "%s %s %s %s", out, xp, kvq_kv_scale_form_name((kvq_kv_scale_form)fm),
                         cfg ? cfg : "");
                kvq_test_python("check_kv_exports.py", args);
                if (cfg) { /* an existing fragment is kept without force, nothing written */
                    unlink(xp);
                    ck_assert_int_eq(kvq_calibrate_export_scales(&a, KVQ_SCALES_COMPRESSED_TENSORS, xp, cj, false, &e), KVQ_EIO);
                    ck_assert_msg(strstr(e.msg, cj) && strstr(e.msg, "already exists") && !exists(xp), "%s", e.msg);
                    ck_assert_int_eq(kvq_calibrate_export_scales(&a, KVQ_SCALES_VLLM, xp, cj, true, &e), KVQ_EINVAL);
                    ck_assert_msg(strstr(e.msg, "compressed-tensors form"), "%s", e.msg);
                    unlink(cj);
                }
                unlink(xp);
            }
        }
        if (ci == 1) { /* validation names the tensor, head and value; the writer refuses */
            float keep = a.v[1].fp8_scale[1];
            a.v[1].fp8_scale[1] = -0.5f;
            ck_assert_int_eq(kvq_artifact_validate(&a, &e), KVQ_EINVAL);
            ck_assert_msg(strstr(e.msg, "layers.1.v.fp8_scale[1]") && strstr(e.msg, "found -0.5"), "%s", e.msg);
            ck_assert_int_eq(kvq_calibrate_export_vllm(&a, vl, true, &e), KVQ_EINVAL);
            a.v[1].fp8_scale[1] = keep;
            a.p.k_bits = 4;
            ck_assert_int_eq(kvq_artifact_validate(&a, &e), KVQ_EINVAL);
            ck_assert_msg(strstr(e.msg, "fp8 stores 8-bit codes"), "%s", e.msg);
            a.p.k_bits = 8;
        }
        if (cases[ci].e5m2) {
            ck_assert_int_eq(kvq_calibrate_export_vllm(&a, vl, true, &e), KVQ_EUNSUPPORTED);
            ck_assert_msg(strstr(e.msg, "E5M2"), "%s", e.msg);
        }
        kvq_artifact_free(&a);
    }
    /* export of a non-fp8 artifact, pre-RoPE fp8 scales */
    kvq_artifact a;
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("int"));
    ck_assert(kvq_calibrate_file(dump, out, true, &o, &a, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_calibrate_export_vllm(&a, vl, true, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "method int") && strstr(e.msg, "fp8"), "%s", e.msg);
    kvq_artifact_free(&a);
    o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
    o.post_rope = false;
    ck_assert(kvq_calibrate_file(dump, out, true, &o, &a, &e) == KVQ_OK);
    size_t rows;
    float *x = drop_sink(d.x[1][D_KPRE], 0, &rows), ref;
    ck_assert(kvq_fp8_calib_tensor(KVQ_FP8_E4M3FN, x, rows, HKV, HD, 100, &ref, &e) == KVQ_OK);
    ck_assert(a.k[1].fp8_scale[0] == ref);
    free(x);
    ck_assert_int_eq(kvq_calibrate_export_vllm(&a, vl, true, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "pre-RoPE"), "%s", e.msg);
    kvq_artifact_free(&a);
    /* option errors */
    o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
    o.k_bits = o.v_bits = 4;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"bits", "fp8 stores 8-bit codes", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
    o.fp8_percentile = 0;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"percentile", "(0, 100]", "found 0", NULL});
    o.fp8_percentile = 100.5;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"percentile", "found 100.5", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
    o.outlier_frac = 0.01;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"outlier fraction", "method fp8", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("int"));
    o.fp8_percentile = 99;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"percentile", "method is int", NULL});
    /* nvfp4 (calibrated by the family's fit, tests/test_kveval.c): its rules, and head_dim 8 refused naming the block */
    o = kvq_calibrate_defaults(KVQ_FAM("nvfp4"));
    ck_assert(o.post_rope && o.n_sink == 0 && o.k_bits == 4 && o.fp8_percentile == 100);
    expect_fail(dump, &o, KVQ_EUNSUPPORTED, (const char *const[]){"head_dim 8", "16-value block", NULL});
    o.k_bits = o.v_bits = 8;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"bits", "nvfp4 stores 4-bit codes", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("nvfp4"));
    o.fp8_e5m2 = true;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"e5m2", "fp8 only", "method is nvfp4", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("nvfp4"));
    o.per_head = true;
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"per-head", "method is nvfp4", NULL});
    o = kvq_calibrate_defaults(KVQ_FAM("fp8"));
    write_dump(dump, &d, &(dump_spec){.no_fisher = true, .layer_first = 1, .layer_last = 1});
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"layers 1..1", "method fp8", NULL});
    synth_free(&d);
    unlink(dump);
    unlink(out);
    unlink(vl);
}
END_TEST

/* Every failure: error code, message, and the existing output left untouched. */
static void expect_fail(const char *dump, const kvq_calibrate_opts *o, kvq_status code, const char *const *needles)
{
    char out[256];
    tmp(out, sizeof out, "keep.st");
    FILE *f = fopen(out, "w");
    fputs("keep", f);
    fclose(f);
    kvq_err e = {0};
    kvq_status s = kvq_calibrate_file(dump, out, true, o, NULL, &e);
    ck_assert_msg(s == code, "status %d (%s), expected %d", (int)s, e.msg, (int)code);
    for (const char *const *n = needles; *n; n++) ck_assert_msg(strstr(e.msg, *n), "message '%s' lacks '%s'", e.msg, *n);
    char buf[16] = {0};
    f = fopen(out, "r");
    ck_assert_ptr_nonnull(fgets(buf, sizeof buf, f));
    fclose(f);
    ck_assert_str_eq(buf, "keep");
    char t[300];
    snprintf(t, sizeof t, "%s.tmp", out);
    ck_assert(!exists(t));
    unlink(out);
}

static void poke(const char *path, const char *ds, hsize_t s, hsize_t t, hsize_t h, hsize_t c, float v)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t d = H5Dopen2(f, ds, H5P_DEFAULT);
    ck_assert_int_ge(d, 0);
    hid_t fs = H5Dget_space(d);
    hsize_t start[4] = {s, t, h, c}, count[4] = {1, 1, 1, 1};
    ck_assert_int_ge(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL), 0);
    hid_t ms = H5Screate_simple(4, count, NULL);
    ck_assert_int_ge(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, &v), 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

START_TEST(test_errors)
{
    synth d;
    synth_make(&d, 13);
    char dump[256];
    tmp(dump, sizeof dump, "err.h5");
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    o.k_bits = o.v_bits = 3;
    /* options */
    kvq_calibrate_opts b = o;
    write_dump(dump, &d, &(dump_spec){0});
    b.k_bits = b.v_bits = 9;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"bits", "expected 1..8, found 9", NULL});
    b.k_bits = b.v_bits = 0;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"bits", "found 0", NULL});
    b = o;
    b.outlier_frac = 0.5;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"outlier fraction", "[0, 0.5)", "found 0.5", NULL});
    b.outlier_frac = -0.01;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"outlier fraction", "found -0.01", NULL});
    b = o;
    b.method = KVQ_FAM("fp16"); /* a family kvcalib cannot calibrate */
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"method", "fp16", NULL});
    b = kvq_calibrate_defaults(KVQ_FAM("int"));
    b.outlier_frac = 0.01;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"outlier fraction", "method int", NULL});
    b = o;
    b.n_sink = SL;
    expect_fail(dump, &b, KVQ_EINVAL, (const char *const[]){"sink", "seq_len 64", NULL});
    /* every token left after the sink tokens carries zero Fisher information (as a real dump's last
     * position of each sample does: it gets no gradient of the LM loss): an error naming the layer
     * and the counts, not an artifact of uniform placeholder datatypes with exit 0 (kvcalib --sink 63
     * on samples of 64 used to write one) */
    {
        synth z = d;
        float *fz[NL][2];
        for (int l = 0; l < NL; l++)
            for (int j = 0; j < 2; j++) {
                fz[l][j] = malloc(NTOK * KVD * sizeof(float));
                memcpy(fz[l][j], d.x[l][D_FK + j], NTOK * KVD * sizeof(float));
                for (int s = 0; s < NS; s++) memset(fz[l][j] + ((size_t)s * SL + SL - 1) * KVD, 0, KVD * sizeof(float));
                z.x[l][D_FK + j] = fz[l][j];
            }
        write_dump(dump, &z, &(dump_spec){0});
        b = o;
        b.n_sink = SL - 1;
        expect_fail(dump, &b, KVQ_EINVAL,
                    (const char *const[]){"layer 0 (k_pre_rope weighted by fisher_k_pre_rope)", "no calibration points to fit the nuq3 datatype",
                                          "the 3 tokens left after excluding 63 sink tokens per sample of 64", "zero Fisher information",
                                          "--no-fisher", NULL});
        b.fisher = false; /* unweighted, the same tokens fit */
        char out[256];
        tmp(out, sizeof out, "zf.st");
        kvq_err e = {0};
        ck_assert_msg(kvq_calibrate_file(dump, out, true, &b, NULL, &e) == KVQ_OK, "%s", e.msg);
        unlink(out);
        b = o;
        b.n_sink = SL - 2; /* two tokens per sample, one with Fisher information: fits */
        ck_assert_msg(kvq_calibrate_file(dump, out, true, &b, NULL, &e) == KVQ_OK, "%s", e.msg);
        unlink(out);
        for (int l = 0; l < NL; l++)
            for (int j = 0; j < 2; j++) free(fz[l][j]);
        write_dump(dump, &d, &(dump_spec){0});
    }
    /* NaN in k_pre_rope, Inf in v, negative Fisher */
    poke(dump, "/layers/1/k_pre_rope", 1, 5, 1, 3, NAN);
    expect_fail(dump, &o, KVQ_ENUMERIC,
                (const char *const[]){dump, "k_pre_rope", "layer 1", "sample 1", "position 5", "head 1", "channel 3",
                                      "not finite", NULL});
    write_dump(dump, &d, &(dump_spec){0});
    poke(dump, "/layers/0/v", 2, 9, 0, 7, INFINITY);
    expect_fail(dump, &o, KVQ_ENUMERIC, (const char *const[]){"v: layer 0", "sample 2", "position 9", "not finite", NULL});
    write_dump(dump, &d, &(dump_spec){0});
    poke(dump, "/layers/1/fisher_v", 0, 3, 1, 2, -1.0f);
    expect_fail(dump, &o, KVQ_ENUMERIC,
                (const char *const[]){"fisher_v", "layer 1", "sample 0", "position 3", "head 1", "channel 2", "negative", NULL});
    /* schema version of another kvq */
    write_dump(dump, &d, &(dump_spec){0});
    hid_t f = H5Fopen(dump, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t at = H5Aopen(f, "schema_version", H5P_DEFAULT);
    int64_t v2 = 2;
    ck_assert_int_ge(H5Awrite(at, H5T_NATIVE_INT64, &v2), 0);
    H5Aclose(at);
    H5Fclose(f);
    expect_fail(dump, &o, KVQ_EUNSUPPORTED, (const char *const[]){dump, "schema_version 2", "version 1", NULL});
    /* no Fisher in the dump */
    write_dump(dump, &d, &(dump_spec){.no_fisher = true});
    expect_fail(dump, &o, KVQ_EINVAL,
                (const char *const[]){dump, "layer 0", "fisher_k_pre_rope", "missing", "kvdump with --fisher", "--no-fisher", NULL});
    b = o;
    b.fisher = false;
    char out[256];
    tmp(out, sizeof out, "nofisher.st");
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, out, true, &b, NULL, &e) == KVQ_OK, "%s", e.msg);
    unlink(out);
    /* a layer range, an unfinished dump */
    write_dump(dump, &d, &(dump_spec){.layer_first = 1, .layer_last = 1});
    expect_fail(dump, &o, KVQ_EINVAL, (const char *const[]){"layers 1..1", "every layer 0..1", NULL});
    write_dump(dump, &d, &(dump_spec){.samples = 1});
    char partial[300];
    snprintf(partial, sizeof partial, "%s.partial", dump);
    expect_fail(partial, &o, KVQ_EINVAL, (const char *const[]){"incomplete", "samples_done 1 of n_samples 3", NULL});
    unlink(partial);
    /* not a dump */
    expect_fail("/nonexistent/kvq.h5", &o, KVQ_EIO, (const char *const[]){"/nonexistent/kvq.h5", NULL});
    synth_free(&d);
    unlink(dump);
}
END_TEST

/* ---- the command ------------------------------------------------------------------ */

static const char *kvcalib_bin(char *buf, size_t n) { return kvq_test_bin(buf, n, "kvcalib"); }

/* Run a shell command, capture stdout+stderr; returns the exit status. */
static int run_cmd(const char *cmd, char *out, size_t n)
{
    char full[2048];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    ck_assert_ptr_nonnull(p);
    size_t got = fread(out, 1, n - 1, p);
    out[got] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(test_cli)
{
    char bin[512];
    KVQ_SKIP_IF(!kvcalib_bin(bin, sizeof bin), "bin/kvcalib not built (run make)");
    synth d;
    synth_make(&d, 17);
    char dump[256], nof[256], out[256], cmd[2048];
    static char buf[1 << 16];
    tmp(dump, sizeof dump, "cli.h5");
    tmp(nof, sizeof nof, "cli_nofisher.h5");
    tmp(out, sizeof out, "cli.st");
    write_dump(dump, &d, &(dump_spec){0});
    write_dump(nof, &d, &(dump_spec){.no_fisher = true});
    unlink(out);
    struct {
        const char *args;
        int rc;
        const char *needles[4];
    } cases[] = {
        {"%s %s --method nuq --bits 3 --outliers 0.02 --out %s -j 2", 0,
         {"wrote", "objective lloyd", "exact", "calibration time"}},
        {"%s %s --method nuq --bits 3 --out %s", 1, {"already exists", "--force"}},
        {"%s %s --method nuq --bits 3 --out %s --quiet --force", 0, {NULL}},
        {"%s %s --method nuq --bits 9 --out %s", 2, {"--bits: expected 1..8, found 9"}},
        {"%s %s --method nuq --bits 3 --outliers 0.5 --out %s", 2, {"outlier fraction: expected [0, 0.5), found 0.5"}},
        {"%s %s --method foo --bits 3 --out %s", 2, {"--method: expected one of nuq|int|int-pc|kivi|fp8|", "found 'foo'"}},
        {"%s %s --bits 3 --out %s", 2, {"missing required option --method"}},
        {"%s %s --method int --bits 3 --outliers 0.01 --out %s", 2, {"outlier fraction", "method int"}},
        {"%s %s --method nuq --bits 0 --out %s", 2, {"--bits: expected 1..8, found 0"}}, /* was "missing required option" */
        /* the nuq fit's options with another method were silently ignored */
        {"%s %s --method int --bits 4 --no-fisher --out %s --force", 2, {"--no-fisher: applies to --method nuq", "method is int"}},
        {"%s %s --method fp8 --fit exact --out %s --force", 2, {"--fit: applies to --method nuq only", "method is fp8"}},
        {"%s %s --method kivi --bits 2 --group 8 --seed 3 --out %s --force", 2, {"--seed: applies to --method nuq only", "method is kivi"}},
        {"%s %s --method int-pc --bits 4 --keys pre-rope --out %s --force --quiet", 0, {NULL}},  /* (pre-RoPE keys are int-pc's own) */
        /* 3 samples x (64 - 56) tokens: percentile thresholds at 1% make 1 per side of 24 outliers (8.3%) */
        {"%s %s --method nuq --bits 3 --sink 56 --out %s --force", 0,
         {"warning: key outliers realised 8.333% of calibration elements against --outliers 1%",
          "24 calibration tokens per channel are too few"}},
        {"%s %s --method nuq --bits 3 --sink 56 --out %s --force --quiet", 0, {NULL}}, /* --quiet: errors only */
        /* int and kivi artifacts are read as post-RoPE: a pre-RoPE label was accepted and then ignored */
        {"%s %s --method kivi --bits 2 --group 8 --keys pre-rope --out %s --force", 2, {"--keys pre-rope: method kivi quantizes post-RoPE keys"}},
        {"%s %s --method int --bits 4 --keys pre-rope --out %s --force", 2, {"--keys pre-rope: method int quantizes post-RoPE keys"}},
        /* nvfp4: 4-bit codes, per-tensor E4M3-block scales only, no vLLM FP8 export; head_dim 8 has no 16-value block */
        {"%s %s --method nvfp4 --bits 8 --out %s --force", 2, {"--bits: nvfp4 stores 4-bit codes, found 8"}},
        {"%s %s --method nvfp4 --fp8-format e5m2 --out %s --force", 2, {"--fp8-format: applies to --method fp8 only", "method is nvfp4"}},
        {"%s %s --method nvfp4 --export-vllm /tmp/kvq_never.st --out %s --force", 2, {"--export-vllm: applies to --method fp8 only"}},
        {"%s %s --method nvfp4 --scale head --out %s --force", 2, {"per KV head exist for nuq and fp8 only, method is nvfp4"}},
        {"%s %s --method nvfp4 --out %s --force", 1, {"head_dim 8 is not a multiple of the 16-value block"}},
        {"%s %s --method int --bits 4 --percentile 99 --out %s --force", 2, {"apply to --method fp8 and nvfp4 only"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(cmd, sizeof cmd, cases[i].args, bin, dump, out);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == cases[i].rc, "'%s': exit %d, expected %d; output:\n%s", cmd, rc, cases[i].rc, buf);
        for (int j = 0; j < 4 && cases[i].needles[j]; j++)
            ck_assert_msg(strstr(buf, cases[i].needles[j]), "'%s': output lacks '%s':\n%s", cmd, cases[i].needles[j], buf);
        if (i == 2 || (strstr(cmd, "--sink 56 --out") && strstr(cmd, "--quiet"))) ck_assert_msg(buf[0] == 0, "--quiet printed:\n%s", buf);
        if (i == 0) { /* keys: 189 tokens per channel are enough for 2%; values: 1 per side of kv_dim 16 is 12.5% */
            ck_assert_msg(!strstr(buf, "warning: key outliers"), "189 tokens per channel at 2%%: no key warning expected:\n%s", buf);
            ck_assert_msg(strstr(buf, "warning: value outliers realised 12.5% of calibration elements against --outliers 2%: each "
                                      "token keeps at least one outlier per side of its 16 values (kv_dim), 12.5% at the least"),
                          "%s", buf);
        }
    }
    /* an output that is the dump, or both outputs one file, is refused before any work, the dump
     * intact (-o DUMP -f used to replace the dump with the artifact; --export-vllm = --out left the
     * vLLM file where the artifact should be, exit 0) */
    {
        size_t n0 = 0, n1 = 0;
        char *before = kvq_test_slurp(dump, &n0);
        snprintf(cmd, sizeof cmd, "%s %s --method nuq --bits 3 --out %s --force", bin, dump, dump);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 2 && strstr(buf, "the same file as DUMP"), "'%s': exit %d: %s", cmd, rc, buf);
        snprintf(cmd, sizeof cmd, "%s %s --method fp8 --out %s --export-vllm %s --force", bin, dump, out, out);
        rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 2 && strstr(buf, "(two outputs)"), "'%s': exit %d: %s", cmd, rc, buf);
        char fp8out[256];
        tmp(fp8out, sizeof fp8out, "cli_fp8.st");
        snprintf(cmd, sizeof cmd, "%s %s --method fp8 --out %s --force", bin, dump, fp8out);
        rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 0 && strstr(buf, ": fp8, "), "'%s': exit %d: %s", cmd, rc, buf); /* the label was "fp88" */
        unlink(fp8out);
        char *after = kvq_test_slurp(dump, &n1);
        ck_assert(before && after && n0 == n1 && memcmp(before, after, n0) == 0);
        free(before);
        free(after);
    }
    /* an output that is not a regular file is refused before any work: the artifact is renamed into
     * place, which replaced a device node (-o /dev/null --force as root) with a regular file */
    {
        char fifo[300];
        snprintf(fifo, sizeof fifo, "%s.fifo", out);
        unlink(fifo);
        ck_assert_int_eq(mkfifo(fifo, 0600), 0);
        snprintf(cmd, sizeof cmd, "%s %s --method nuq --bits 3 --out %s --force", bin, dump, fifo);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 2 && strstr(buf, "not a regular file (a FIFO)"), "'%s': exit %d: %s", cmd, rc, buf);
        struct stat fst;
        ck_assert(lstat(fifo, &fst) == 0 && S_ISFIFO(fst.st_mode));
        unlink(fifo);
    }
    /* missing Fisher: exit 1 with the hint; --no-fisher works; nothing written on failure */
    char out2[256];
    tmp(out2, sizeof out2, "cli2.st");
    unlink(out2);
    snprintf(cmd, sizeof cmd, "%s %s --method nuq --bits 2 --out %s", bin, nof, out2);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
    ck_assert_msg(strstr(buf, "fisher_k_pre_rope") && strstr(buf, "--no-fisher"), "%s", buf);
    ck_assert(!exists(out2));
    snprintf(cmd, sizeof cmd, "%s %s --method nuq --bits 2 --no-fisher --fit lloyd --out %s", bin, nof, out2);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    /* --inspect */
    snprintf(cmd, sizeof cmd, "%s --inspect %s", bin, out);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "method        nuq  K 3 bit, V 3 bit, outliers 1%") && strstr(buf, "Fisher-weighted") &&
                      strstr(buf, "layer  1 V"),
                  "%s", buf);
    snprintf(cmd, sizeof cmd, "%s --inspect %s", bin, dump); /* not an artifact */
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
    ck_assert_msg(strstr(buf, dump), "%s", buf);
    /* fp8: --bits optional, --scale head, --percentile, --export-vllm; the subcommand */
    char vl[256], vl2[256];
    tmp(vl, sizeof vl, "cli_vllm.st");
    tmp(vl2, sizeof vl2, "cli_vllm2.st");
    unlink(vl);
    unlink(vl2);
    snprintf(cmd, sizeof cmd, "%s %s --method fp8 --scale head --percentile 99.9 --out %s --force --export-vllm %s", bin, nof, out,
             vl);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "fp8 K8/V8") && strstr(buf, "layer  1 fp8 scale K") && strstr(buf, "saturated") &&
                      strstr(buf, vl),
                  "%s", buf);
    ck_assert(exists(vl));
    snprintf(cmd, sizeof cmd, "%s --inspect %s", bin, out);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "E4M3FN, per-KV-head scales") && strstr(buf, "percentile    99.9"), "%s", buf);
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s", bin, out, vl2);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "[n_kv_heads] per KV head"), "%s", buf);
    ck_assert(same_bytes(vl, vl2));
    struct {
        const char *fmt;
        int rc;
        const char *needle;
    } fcases[] = {
        {"%s %s --method fp8 --bits 4 --out %s --force", 2, "fp8 stores 8-bit codes"},
        {"%s %s --method fp8 --percentile 0 --out %s --force", 2, "percentile: expected (0, 100]"},
        {"%s %s --method int --bits 4 --scale head --out %s --force", 2, "apply to --method fp8 and nvfp4 only"},
        {"%s %s --method fp8 --scale chan --out %s --force", 2, "--scale: expected one of tensor|head"},
        {"%s %s --method fp8 --fp8-format e5m2 --export-vllm /tmp/x.st --out %s --force", 2, "fp8_e5m2"},
    };
    for (size_t i = 0; i < sizeof fcases / sizeof *fcases; i++) {
        snprintf(cmd, sizeof cmd, fcases[i].fmt, bin, nof, out);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == fcases[i].rc && strstr(buf, fcases[i].needle), "'%s': exit %d:\n%s", cmd, rc, buf);
    }
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s", bin, out, vl2); /* exists */
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
    ck_assert_msg(strstr(buf, "already exists"), "%s", buf);
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s --force", bin, out2, vl2); /* a nuq artifact */
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
    ck_assert_msg(strstr(buf, "method nuq") && strstr(buf, out2), "%s", buf);
    snprintf(cmd, sizeof cmd, "%s export-vllm %s", bin, out);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 2);
    ck_assert_msg(strstr(buf, "--out"), "%s", buf);
    /* the forms: compressed-tensors needs its config fragment, the fragment belongs to that form only */
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s --force --form compressed-tensors", bin, out, vl2);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 2);
    ck_assert_msg(strstr(buf, "missing --config JSON"), "%s", buf);
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s --force --form modelopt --config %s.json", bin, out, vl2, vl2);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 2);
    ck_assert_msg(strstr(buf, "--config: the config.json fragment belongs to --form compressed-tensors"), "%s", buf);
    snprintf(cmd, sizeof cmd, "%s export-vllm %s --out %s --force --form compressed-tensors --config %s.json", bin, out, vl2,
             vl2);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, "compressed-tensors form") && strstr(buf, "config fragment"),
                  "%s", buf);
    snprintf(cmd, sizeof cmd, "%s.json", vl2);
    ck_assert(exists(cmd));
    unlink(cmd);
    unlink(vl);
    unlink(vl2);
    snprintf(cmd, sizeof cmd, "%s intactkv", bin);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 2);
    ck_assert_msg(strstr(buf, "missing required option --model"), "%s", buf); /* tests/test_intactkv.c covers the rest */
    synth_free(&d);
    unlink(dump);
    unlink(nof);
    unlink(out);
    unlink(out2);
}
END_TEST

/* kvcalib --rotate: int-pc thresholds fitted on keys rotated as +hadamard rotates them (kvq_rotation_apply, checked
 * against the dense matrix in tests/test_rotation.c), recorded in the artifact; methods without fitted tables refuse */
START_TEST(test_rotate)
{
    synth d;
    synth_make(&d, 3);
    char dump[256], out[256];
    tmp(dump, sizeof dump, "rot.h5");
    tmp(out, sizeof out, "rot.safetensors");
    write_dump(dump, &d, &(dump_spec){.no_fisher = true});
    kvq_err e = {0};
    kvq_artifact a;
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("int-pc"));
    o.k_bits = o.v_bits = 3;
    o.outlier_frac = 0.02;
    o.rotation = (kvq_rotation){KVQ_ROT_RHT, 77};
    unlink(out);
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_artifact_read(out, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(a.p.rotation.kind, KVQ_ROT_RHT);
    ck_assert(a.p.rotation.seed == 77);
    float *xr = malloc(NTOK * KVD * sizeof *xr);
    memcpy(xr, d.x[1][D_K], NTOK * KVD * sizeof *xr);
    ck_assert(kvq_rotation_apply(&o.rotation, xr, NTOK, KVD, HD, 'k', false, &e) == KVQ_OK);
    int moved = 0;
    for (int c = 0; c < KVD; c++) {
        float lo, hi, lo0, hi0;
        size_t n;
        ref_thresholds(xr, c, 1, 0.02, &lo, &hi, &n);
        ref_thresholds(d.x[1][D_K], c, 1, 0.02, &lo0, &hi0, &n);
        ck_assert(a.k[1].channel_lower[c] == lo && a.k[1].channel_upper[c] == hi);
        moved += lo != lo0 || hi != hi0;
    }
    ck_assert_int_gt(moved, KVD / 2); /* teeth: the rotated fit is not the plain one */
    free(xr);
    kvq_artifact_free(&a);
    /* int: the artifact is metadata only, nothing to fit on rotated data */
    o = kvq_calibrate_defaults(KVQ_FAM("int"));
    o.k_bits = o.v_bits = 4;
    o.rotation.kind = KVQ_ROT_HADAMARD;
    ck_assert_int_eq(kvq_calibrate_validate(&o, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "rotate") && strstr(e.msg, "int-pc") && strstr(e.msg, "method int"), "%s", e.msg);
    unlink(out);
    unlink(dump);
    synth_free(&d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvcalib");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_nuq_tables);
    tcase_add_test(tc, test_post_rope_and_per_head);
    tcase_add_test(tc, test_baselines);
    tcase_add_test(tc, test_rotate);
    tcase_add_test(tc, test_deterministic);
    tcase_add_test(tc, test_fingerprints);
    tcase_add_test(tc, test_model_chain);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_fp8_scales);
    tcase_add_test(tc, test_cli);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
