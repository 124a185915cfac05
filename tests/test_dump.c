/* test_dump.c — HDF5 dump writer/reader (formats/dump.h): f16 codec against a
 * float64 reference rounding, write→read round trips in f32 and f16, root
 * attributes, .partial/rename semantics, resume (and its refusals), a
 * file-size limit hit mid-write, schema-version and layout errors, and the
 * NaN/Inf/f16-range checks with their reported positions.
 *
 * Synthetic data: gen() below is an exact integer formula (multiples of
 * 2^-12 below 245 in magnitude, exact in float32, rounded in f16);
 * tests/scripts/check_dump_h5py.py --synthetic recomputes it in numpy.
 * Set KVQ_DUMP_FIXTURE=path to keep the f16 round-trip dump (this is how
 * tests/fixtures/dump_small.h5 was made). */
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "dump.h"
#include "kvq_test.h"
#include "half.h"

/* ---- synthetic data ------------------------------------------------------- */

static float gen(int ds, int layer, int64_t s, int64_t t, int h, int c)
{
    int64_t x = (1000003LL * ds + 7919LL * layer + 104729LL * s + 3571LL * t + 131LL * h + 17LL * c + 37LL * t * c +
                 11LL * c * c) % 2000001;
    return (float)((double)(x - 1000000) / 4096.0);
}

static int32_t gen_token(int64_t s, int64_t t, int vocab) { return (int32_t)((s * 31 + t * 7 + 3) % vocab); }

/* Interleaved RoPE in double: pairs (2i, 2i+1) within each head, position t. */
static void rope_ref(const kvq_dump_meta *m, const float *in, float *out, int64_t L, int heads)
{
    int D = m->head_dim;
    for (int64_t t = 0; t < L; t++)
        for (int h = 0; h < heads; h++) {
            const float *x = in + ((size_t)t * heads + h) * D;
            float *y = out + ((size_t)t * heads + h) * D;
            for (int c = 0; c < D; c++) y[c] = x[c];
            for (int i = 0; i < m->rope_dim / 2; i++) {
                double freq = pow(m->rope_theta, -2.0 * i / m->rope_dim), a = (double)t * freq;
                double x0 = x[2 * i], x1 = x[2 * i + 1];
                y[2 * i] = (float)(x0 * cos(a) - x1 * sin(a));
                y[2 * i + 1] = (float)(x0 * sin(a) + x1 * cos(a));
            }
        }
}

/* Fill one sample's per-layer buffers with gen() (k = RoPE(k_pre_rope)). */
typedef struct {
    float *buf[KVQ_DUMP_N_DS];
    kvq_dump_layer_data d;
} layer_bufs;

static void fill_layer(const kvq_dump_meta *m, int layer, int64_t s, layer_bufs *b)
{
    for (int k = 0; k < KVQ_DUMP_N_DS; k++) {
        int rank;
        int64_t dims[3];
        kvq_dump_ds_shape(m, (kvq_dump_ds)k, &rank, dims);
        free(b->buf[k]);
        b->buf[k] = malloc(kvq_dump_ds_sample_elems(m, (kvq_dump_ds)k) * sizeof(float));
        ck_assert_ptr_nonnull(b->buf[k]);
        for (int64_t i = 0; i < dims[0]; i++)
            for (int64_t j = 0; j < dims[1]; j++)
                for (int64_t c = 0; c < dims[2]; c++) {
                    /* per-token: (t=i, h=j, c); attn: (h=i, t=j) */
                    float v = rank == 3 ? gen(k, layer, s, i, (int)j, (int)c) : gen(k, layer, s, j, (int)i, 0);
                    b->buf[k][(i * dims[1] + j) * dims[2] + c] = v;
                }
    }
    rope_ref(m, b->buf[KVQ_DUMP_K_PRE_ROPE], b->buf[KVQ_DUMP_K], m->seq_len, m->n_kv_heads);
    b->d = (kvq_dump_layer_data){b->buf[0], b->buf[1], b->buf[2], b->buf[3], b->buf[4], b->buf[5], b->buf[6], b->buf[7]};
}

static void free_layer(layer_bufs *b)
{
    for (int k = 0; k < KVQ_DUMP_N_DS; k++) free(b->buf[k]);
    memset(b, 0, sizeof *b);
}

static int64_t g_offsets[4] = {0, 1000, 2000, 3000};

static void small_meta(kvq_dump_meta *m, kvq_dump_dtype dtype)
{
    memset(m, 0, sizeof *m);
    snprintf(m->kvq_version, sizeof m->kvq_version, "0.1.0-test");
    snprintf(m->model_path, sizeof m->model_path, "models/tiny.gguf");
    snprintf(m->model_sha256, sizeof m->model_sha256, "%064d", 7);
    snprintf(m->model_arch, sizeof m->model_arch, "llama");
    kvq_hparams hp = {.n_layers = 4, .dim = 32, .hidden_dim = 64, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8,
                      .vocab_size = 100, .ctx_len = 64, .rope_dim = 6, .rope_theta = 10000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1.0f};
    kvq_dump_meta_set_hparams(m, &hp);
    snprintf(m->tokenizer, sizeof m->tokenizer, "test:bytes vocab=100");
    snprintf(m->corpus_path, sizeof m->corpus_path, "../shared/datasets/wikitext-2/wiki.valid.tokens");
    snprintf(m->corpus_sha256, sizeof m->corpus_sha256, "%064d", 9);
    snprintf(m->corpus_format, sizeof m->corpus_format, "wikitext-tokens");
    snprintf(m->bos_policy, sizeof m->bos_policy, "prepend");
    m->n_samples = 3;
    m->seq_len = 12;
    m->seed = 0;
    m->sample_offsets = g_offsets;
    m->dtype = dtype;
    m->has_q = m->has_fisher = m->has_attn_stats = true;
    m->layer_first = 1;
    m->layer_last = 2;
    snprintf(m->command_line, sizeof m->command_line, "kvdump --model models/tiny.gguf --samples 3 --seq-len 12");
    snprintf(m->compute_mode, sizeof m->compute_mode, "exact");
    snprintf(m->compute_device, sizeof m->compute_device, "CPU (test)");
}

static void tmp_path(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/kvq_test_dump_%d_%s.h5", (int)getpid(), tag);
}

static void rm_dump(const char *path)
{
    char p[512];
    unlink(path);
    snprintf(p, sizeof p, "%s.partial", path);
    unlink(p);
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

/* Write samples [from, to) into an open writer. */
static void write_samples(kvq_dump_writer *w, const kvq_dump_meta *m, int64_t from, int64_t to)
{
    int nr = m->layer_last - m->layer_first + 1;
    layer_bufs b[8];
    memset(b, 0, sizeof b);
    kvq_dump_layer_data d[8];
    int32_t *tok = malloc((size_t)m->seq_len * sizeof *tok);
    ck_assert_ptr_nonnull(tok);
    kvq_err e = {0};
    for (int64_t s = from; s < to; s++) {
        for (int j = 0; j < nr; j++) {
            fill_layer(m, m->layer_first + j, s, &b[j]);
            d[j] = b[j].d;
        }
        for (int64_t t = 0; t < m->seq_len; t++) tok[t] = gen_token(s, t, m->vocab_size);
        ck_assert_msg(kvq_dump_write_sample(w, s, tok, d, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(kvq_dump_writer_samples_done(w), s + 1);
    }
    for (int j = 0; j < nr; j++) free_layer(&b[j]);
    free(tok);
}

/* ---- float64 reference rounding to binary16 -------------------------------- */

static double ref_f16(double x)
{
    if (isnan(x) || x == 0 || isinf(x)) return x;
    double a = fabs(x);
    int e;
    frexp(a, &e);
    int E = e - 1 < -14 ? -14 : e - 1; /* subnormals share the 2^-14 binade's ulp */
    double ulp = ldexp(1.0, E - 10);
    double r = rint(a / ulp) * ulp; /* exact scaling; rint = round half to even */
    if (r > 65504.0) r = INFINITY;
    return copysign(r, x);
}

static void check_codec_one(float x)
{
    float got = kvq_f16_to_f32(kvq_f32_to_f16(x));
    double want = ref_f16((double)x);
    if (isnan(want)) {
        ck_assert_msg(isnan(got), "f16(%a) = %a, expected NaN", (double)x, (double)got);
        return;
    }
    ck_assert_msg(got == (float)want && (signbit(got) != 0) == (signbit(want) != 0), "f16(%a) = %a, expected %a", (double)x,
                  (double)got, want);
}

START_TEST(test_f16_codec)
{
    /* decode every binary16 pattern against the formula */
    for (uint32_t h = 0; h < 65536; h++) {
        int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
        double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
        float got = kvq_f16_to_f32((uint16_t)h);
        if (isnan(v)) ck_assert(isnan(got));
        else ck_assert_msg(got == (float)(s ? -v : v) && (signbit(got) != 0) == (s != 0), "decode %04x", h);
    }
    /* every f16 value, the exact midpoint to its successor (ties), and 1 float ulp either side */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        double lo = (double)kvq_f16_to_f32((uint16_t)h);
        double hi = h + 1 < 0x7c00 ? (double)kvq_f16_to_f32((uint16_t)(h + 1)) : 65536.0;
        float mid = (float)((lo + hi) / 2); /* exact in float32 */
        float pts[5] = {(float)lo, mid, nextafterf(mid, 0), nextafterf(mid, INFINITY), (float)hi};
        for (int i = 0; i < 5; i++) {
            check_codec_one(pts[i]);
            check_codec_one(-pts[i]);
        }
    }
    /* a strided sweep over all float32 bit patterns (incl. NaN, Inf, subnormals) */
    int step = kvq_test_quick() ? 0x10001 : 0x1001;
    for (uint64_t u = 0; u <= 0xffffffffu; u += (uint64_t)step) {
        uint32_t b = (uint32_t)u;
        float x;
        memcpy(&x, &b, sizeof x);
        check_codec_one(x);
    }
    /* named cases: ties to even, overflow boundary, NaN stays NaN */
    ck_assert_uint_eq(kvq_f32_to_f16(65504.0f), 0x7bff);
    ck_assert_uint_eq(kvq_f32_to_f16(65519.99f), 0x7bff);
    ck_assert_uint_eq(kvq_f32_to_f16(65520.0f), 0x7c00);
    ck_assert_uint_eq(kvq_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);          /* tie → even (down) */
    ck_assert_uint_eq(kvq_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);      /* tie → even (up) */
    ck_assert_uint_eq(kvq_f32_to_f16(0x1p-25f), 0x0000);                 /* tie → even zero */
    ck_assert_uint_eq(kvq_f32_to_f16(0x1.8p-24f), 0x0002);               /* 1.5 subnormal steps → 2 */
    ck_assert_uint_eq(kvq_f32_to_f16(-0.0f), 0x8000);
    ck_assert((kvq_f32_to_f16(NAN) & 0x7fff) > 0x7c00);
}
END_TEST

static void make_small_dump(const char *path);

/* ---- round trips ------------------------------------------------------------ */

static void check_contents(const char *path, kvq_dump_dtype dtype)
{
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(path, &r, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    ck_assert_int_eq(kvq_dump_reader_samples_done(r), m->n_samples);
    ck_assert_int_eq(m->dtype, dtype);
    size_t maxe = 0;
    for (int k = 0; k < KVQ_DUMP_N_DS; k++)
        if (kvq_dump_ds_sample_elems(m, (kvq_dump_ds)k) > maxe) maxe = kvq_dump_ds_sample_elems(m, (kvq_dump_ds)k);
    float *got = malloc(maxe * sizeof(float)), *rows = malloc(maxe * sizeof(float));
    layer_bufs b;
    memset(&b, 0, sizeof b);
    size_t n_rounded = 0;
    for (int64_t s = 0; s < m->n_samples; s++)
        for (int l = m->layer_first; l <= m->layer_last; l++) {
            fill_layer(m, l, s, &b);
            for (int k = 0; k < KVQ_DUMP_N_DS; k++) {
                kvq_dump_ds ds = (kvq_dump_ds)k;
                ck_assert(kvq_dump_has(r, l, ds));
                ck_assert_msg(kvq_dump_read(r, l, ds, s, got, &e) == KVQ_OK, "%s", e.msg);
                size_t n = kvq_dump_ds_sample_elems(m, ds);
                bool f16 = dtype == KVQ_DUMP_F16 && ds <= KVQ_DUMP_Q;
                for (size_t i = 0; i < n; i++) {
                    float want = f16 ? (float)ref_f16(b.buf[k][i]) : b.buf[k][i];
                    n_rounded += want != b.buf[k][i];
                    ck_assert_msg(got[i] == want, "%s layer %d sample %lld elem %zu: got %a want %a", kvq_dump_ds_name(ds),
                                  l, (long long)s, i, (double)got[i], (double)want);
                }
                /* a slab of token rows [3, 3+5) equals the same part of the whole sample */
                int rank;
                int64_t dims[3];
                kvq_dump_ds_shape(m, ds, &rank, dims);
                ck_assert_msg(kvq_dump_read_rows(r, l, ds, s, 3, 5, rows, &e) == KVQ_OK, "%s", e.msg);
                if (rank == 3) {
                    size_t row = (size_t)(dims[1] * dims[2]);
                    ck_assert(memcmp(rows, got + 3 * row, 5 * row * sizeof(float)) == 0);
                } else {
                    for (int h = 0; h < m->n_heads; h++)
                        for (int t = 0; t < 5; t++) ck_assert(rows[h * 5 + t] == got[h * m->seq_len + 3 + t]);
                }
            }
        }
    if (dtype == KVQ_DUMP_F16) ck_assert_uint_gt(n_rounded, 100); /* the data did exercise rounding */
    /* tokens */
    int32_t tok[3 * 12];
    ck_assert_msg(kvq_dump_read_tokens(r, 0, 3, tok, &e) == KVQ_OK, "%s", e.msg);
    for (int s = 0; s < 3; s++)
        for (int t = 0; t < 12; t++) ck_assert_int_eq(tok[s * 12 + t], gen_token(s, t, m->vocab_size));
    /* outside the dump: clear errors */
    ck_assert(!kvq_dump_has(r, 0, KVQ_DUMP_K));
    ck_assert_int_eq(kvq_dump_read(r, 0, KVQ_DUMP_K, 0, got, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "/layers/0/k is not in this dump"));
    ck_assert_int_eq(kvq_dump_read(r, 1, KVQ_DUMP_K, 3, got, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "sample 3 requested"));
    ck_assert_int_eq(kvq_dump_read_rows(r, 1, KVQ_DUMP_V, 0, 10, 3, got, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "positions [10, 13)"));
    free_layer(&b);
    free(got);
    free(rows);
    kvq_dump_close(r);
}

static void roundtrip(kvq_dump_dtype dtype, const char *keep)
{
    char path[256];
    tmp_path(path, sizeof path, dtype == KVQ_DUMP_F16 ? "rt16" : "rt32");
    if (keep) snprintf(path, sizeof path, "%s", keep);
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, dtype);
    kvq_dump_writer *w;
    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    write_samples(w, &m, 0, 3);
    ck_assert(!exists(path)); /* nothing under the final name before finish */
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(exists(path));
    char partial[300];
    snprintf(partial, sizeof partial, "%s.partial", path);
    ck_assert(!exists(partial));
    check_contents(path, dtype);
    /* an independent reader: h5py on the same file, every value recomputed in numpy */
    char args[400];
    snprintf(args, sizeof args, "'%s' --synthetic", path);
    kvq_test_python("check_dump_h5py.py", args);
    if (!keep) rm_dump(path);
}

START_TEST(test_roundtrip_f32) { roundtrip(KVQ_DUMP_F32, NULL); }
END_TEST

START_TEST(test_roundtrip_f16)
{
    const char *keep = getenv("KVQ_DUMP_FIXTURE");
    roundtrip(KVQ_DUMP_F16, keep && *keep ? keep : NULL);
}
END_TEST

/* Same inputs → byte-identical files (no object timestamps anywhere), even a second apart. */
START_TEST(test_deterministic)
{
    char a[256], b[256];
    tmp_path(a, sizeof a, "detA");
    tmp_path(b, sizeof b, "detB");
    make_small_dump(a);
    sleep(1);
    make_small_dump(b);
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    ck_assert(fa && fb);
    long n = 0;
    int ca, cb;
    do {
        ca = fgetc(fa);
        cb = fgetc(fb);
        ck_assert_msg(ca == cb, "dumps differ at byte %ld", n);
        n++;
    } while (ca != EOF);
    ck_assert_int_gt(n, 10000);
    fclose(fa);
    fclose(fb);
    rm_dump(a);
    rm_dump(b);
}
END_TEST

START_TEST(test_attributes_roundtrip)
{
    char path[256];
    tmp_path(path, sizeof path, "attrs");
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F32);
    /* llama3 RoPE scaling fields, non-round doubles, a long path, a large offsets array (dense attribute storage) */
    m.rope_theta = 500000.123456789;
    snprintf(m.rope_scaling, sizeof m.rope_scaling, "llama3");
    m.rope_scale_factor = 8.0;
    m.rope_low_freq_factor = 1.0;
    m.rope_high_freq_factor = 4.0;
    m.rope_orig_ctx = 8192;
    memset(m.model_path, 'x', 3000);
    m.model_path[3000] = 0;
    snprintf(m.tokenizer, sizeof m.tokenizer, "gguf:gpt2 vocab=49152 merges=48900 \xc3\xa9");
    m.seed = -42;
    m.has_q = false;
    m.has_attn_stats = false;
    m.n_samples = 20000;
    m.seq_len = 2;
    m.layer_first = m.layer_last = 3;
    int64_t *off = malloc(20000 * sizeof *off);
    for (int i = 0; i < 20000; i++) off[i] = (int64_t)i * 3 + 5000000000LL;
    m.sample_offsets = off;
    kvq_dump_writer *w;
    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
    char partial[300];
    snprintf(partial, sizeof partial, "%s.partial", path);
    kvq_dump_reader *r;
    ck_assert_msg(kvq_dump_open(partial, &r, &e) == KVQ_OK, "%s", e.msg); /* a .partial is readable */
    const kvq_dump_meta *g = kvq_dump_reader_meta(r);
    ck_assert_int_eq(g->schema_version, KVQ_DUMP_SCHEMA_VERSION);
    ck_assert_int_eq(kvq_dump_reader_samples_done(r), 0);
    ck_assert_str_eq(g->kvq_version, m.kvq_version);
    ck_assert_str_eq(g->model_path, m.model_path);
    ck_assert_str_eq(g->model_sha256, m.model_sha256);
    ck_assert_str_eq(g->model_arch, "llama");
    ck_assert_str_eq(g->tokenizer, m.tokenizer);
    ck_assert_str_eq(g->corpus_path, m.corpus_path);
    ck_assert_str_eq(g->corpus_sha256, m.corpus_sha256);
    ck_assert_str_eq(g->corpus_format, "wikitext-tokens");
    ck_assert_str_eq(g->bos_policy, "prepend");
    ck_assert_str_eq(g->rope_pairing, "interleaved");
    ck_assert_str_eq(g->rope_scaling, "llama3");
    ck_assert_str_eq(g->command_line, m.command_line);
    ck_assert(g->rope_theta == m.rope_theta && g->rope_scale_factor == 8.0 && g->rope_high_freq_factor == 4.0 &&
              g->rope_low_freq_factor == 1.0);
    ck_assert_int_eq(g->rope_orig_ctx, 8192);
    ck_assert_int_eq(g->rope_dim, 6);
    int gi[] = {g->n_layers, g->dim, g->hidden_dim, g->n_heads, g->n_kv_heads, g->head_dim, g->vocab_size, g->ctx_len};
    int mi[] = {4, 32, 64, 4, 2, 8, 100, 64};
    for (int i = 0; i < 8; i++) ck_assert_int_eq(gi[i], mi[i]);
    ck_assert_int_eq(g->n_samples, 20000);
    ck_assert_int_eq(g->seq_len, 2);
    ck_assert_int_eq(g->seed, -42);
    ck_assert(!g->has_q && g->has_fisher && !g->has_attn_stats);
    ck_assert_int_eq(g->layer_first, 3);
    ck_assert_int_eq(g->layer_last, 3);
    ck_assert_int_eq(g->dtype, KVQ_DUMP_F32);
    for (int i = 0; i < 20000; i++) ck_assert_int_eq(g->sample_offsets[i], off[i]);
    ck_assert(kvq_dump_has(r, 3, KVQ_DUMP_FISHER_V) && !kvq_dump_has(r, 3, KVQ_DUMP_Q) &&
              !kvq_dump_has(r, 3, KVQ_DUMP_ATTN_ENTROPY));
    kvq_dump_close(r);
    free(off);
    rm_dump(path);
}
END_TEST

/* ---- partial / rename / force ------------------------------------------------ */

static void write_file(const char *p, const char *s)
{
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(s, f);
    fclose(f);
}

static bool file_is(const char *p, const char *s)
{
    char buf[256] = {0};
    FILE *f = fopen(p, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    return n == strlen(s) && memcmp(buf, s, n) == 0;
}

START_TEST(test_partial_and_force)
{
    char path[256], partial[300];
    tmp_path(path, sizeof path, "force");
    snprintf(partial, sizeof partial, "%s.partial", path);
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_dump_writer *w;
    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    /* an existing final file is refused without force, and untouched */
    write_file(path, "precious");
    ck_assert_int_eq(kvq_dump_create(path, &m, &o, &w, &e), KVQ_EIO);
    ck_assert_ptr_null(w);
    ck_assert_ptr_nonnull(strstr(e.msg, "already exists"));
    ck_assert(file_is(path, "precious"));
    ck_assert(!exists(partial));
    /* with force: the old file stays until finish */
    o.force = true;
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(exists(partial));
    write_samples(w, &m, 0, 3);
    ck_assert(file_is(path, "precious"));
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(!file_is(path, "precious"));
    ck_assert(!exists(partial));
    check_contents(path, KVQ_DUMP_F16);
    /* an unfinished .partial is refused without force ("use --resume") */
    rm_dump(path);
    o.force = false;
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
    ck_assert(exists(partial) && !exists(path));
    ck_assert_int_eq(kvq_dump_create(path, &m, &o, &w, &e), KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "--resume"));
    /* a directory in the .partial's place is named as such, with or without force, and left alone
     * (it read "an unfinished dump is there (use --resume ...)") */
    {
        char moved[400];
        snprintf(moved, sizeof moved, "%s.moved", partial);
        ck_assert_int_eq(rename(partial, moved), 0);
        ck_assert_int_eq(mkdir(partial, 0755), 0);
        for (int f = 0; f < 2; f++) {
            o.force = f;
            ck_assert_int_eq(kvq_dump_create(path, &m, &o, &w, &e), KVQ_EIO);
            ck_assert_msg(strstr(e.msg, partial) && strstr(e.msg, "is a directory, not an unfinished dump"), "%s", e.msg);
        }
        o.force = false;
        ck_assert_int_eq(rmdir(partial), 0);
        ck_assert_int_eq(rename(moved, partial), 0);
    }
    /* with force, a .partial that another process holds locked (as HDF5 does while a kvdump
     * writes it) is refused and left as it was: H5F_ACC_TRUNC used to truncate it before the
     * lock refused, corrupting the other run's dump, which still finished with status 0 */
    {
        struct stat st0, st1;
        ck_assert_int_eq(stat(partial, &st0), 0);
        int pfd[2];
        ck_assert_int_eq(pipe(pfd), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) { /* the other process: lock, tell the parent, wait to be killed */
            int fd = open(partial, O_RDONLY);
            char c = (fd >= 0 && flock(fd, LOCK_EX) == 0) ? 'y' : 'n';
            if (write(pfd[1], &c, 1) != 1) _exit(1);
            pause();
            _exit(0);
        }
        char c = 0;
        ck_assert_int_eq(read(pfd[0], &c, 1), 1);
        ck_assert_int_eq(c, 'y');
        /* without force: the same, and no "--resume" hint for a file another run is writing;
         * resuming it or reading it names the cause, not HDF5's "errno = 11, error message =
         * 'Resource temporarily unavailable'" (when HDF5's file locking is on, its default) */
        kvq_err e2 = {0}, e3 = {0}, e4 = {0};
        kvq_status st2 = kvq_dump_create(path, &m, &o, &w, &e2);
        kvq_dump_writer *w3 = NULL;
        kvq_status st3 = kvq_dump_resume(path, &m, &o, &w3, &e3);
        kvq_dump_reader *r4 = NULL;
        kvq_status st4 = kvq_dump_open(partial, &r4, &e4);
        const char *lk = getenv("HDF5_USE_FILE_LOCKING");
        const bool h5lock = !lk || (strcmp(lk, "FALSE") && strcmp(lk, "0"));
        if (w3) kvq_dump_abort(w3, NULL);
        if (r4) kvq_dump_close(r4);
        o.force = true;
        kvq_status st = kvq_dump_create(path, &m, &o, &w, &e);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        close(pfd[0]);
        close(pfd[1]);
        ck_assert_int_eq(st, KVQ_EIO);
        ck_assert_ptr_null(w);
        ck_assert_msg(strstr(e.msg, partial) && strstr(e.msg, "in use by another process"), "%s", e.msg);
        ck_assert_int_eq(st2, KVQ_EIO);
        ck_assert_msg(strstr(e2.msg, "an unfinished dump is there, in use by another process") && !strstr(e2.msg, "--resume"), "%s",
                      e2.msg);
        if (h5lock) {
            ck_assert_int_eq(st3, KVQ_EIO);
            ck_assert_msg(strstr(e3.msg, partial) && strstr(e3.msg, "in use by another process") && !strstr(e3.msg, "errno"), "%s",
                          e3.msg);
            ck_assert_int_eq(st4, KVQ_EIO);
            ck_assert_msg(strstr(e4.msg, partial) && strstr(e4.msg, "in use by another process") && !strstr(e4.msg, "errno"), "%s",
                          e4.msg);
        } else {
            fprintf(stderr, "NOTE test_dump: HDF5_USE_FILE_LOCKING=%s: the resume/open lock checks skipped\n", lk);
        }
        ck_assert_int_eq(stat(partial, &st1), 0);
        ck_assert(st0.st_ino == st1.st_ino && st0.st_size == st1.st_size && st0.st_mtime == st1.st_mtime);
        /* once the lock is gone, force replaces it */
        ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
        o.force = false;
    }
    /* finish of an incomplete dump fails, keeps the .partial, makes no final file */
    o.force = true;
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    write_samples(w, &m, 0, 1);
    ck_assert_int_eq(kvq_dump_finish(w, &e), KVQ_EINVAL);
    ck_assert_ptr_nonnull(strstr(e.msg, "1 of 3 samples"));
    ck_assert(exists(partial) && !exists(path));
    /* a final file that appears meanwhile is not replaced without force */
    o.force = false;
    ck_assert_msg(kvq_dump_resume(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    write_samples(w, &m, 1, 3);
    write_file(path, "raced");
    ck_assert_int_eq(kvq_dump_finish(w, &e), KVQ_EIO);
    ck_assert(file_is(path, "raced"));
    ck_assert(exists(partial));
    /* an unwritable directory: a clear error quoting the OS */
    ck_assert_int_eq(kvq_dump_create("/nonexistent_dir_kvq/x.h5", &m, &o, &w, &e), KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "/nonexistent_dir_kvq/x.h5.partial") && strstr(e.msg, "No such file"), "%s", e.msg);
    rm_dump(path);
}
END_TEST

/* With HDF5's file locking off (HDF5_USE_FILE_LOCKING=FALSE, common on cluster file systems) HDF5
 * takes no lock of its own: a writer's .partial must still be refused by --force and --resume (force
 * used to remove the running dump's file, whose finish would then have renamed the new run's). The
 * variable is set before this test's first HDF5 call (Check runs each test in a fresh process; HDF5
 * reads it once); the lock must be there (/proc/locks) or the check proves nothing. */
START_TEST(test_lock_without_hdf5_locking)
{
    KVQ_SKIP_OPTIONAL_IF(getenv("CK_FORK") && !strcmp(getenv("CK_FORK"), "no"), "needs a fresh process per test (CK_FORK=no)");
    setenv("HDF5_USE_FILE_LOCKING", "FALSE", 1);
    char path[256], partial[300];
    tmp_path(path, sizeof path, "nolock");
    snprintf(partial, sizeof partial, "%s.partial", path);
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_err e = {0}, e5 = {0}, e6 = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    kvq_dump_writer *wa = NULL, *wb = NULL;
    ck_assert_msg(kvq_dump_create(path, &m, &o, &wa, &e) == KVQ_OK, "%s", e.msg);
    struct stat sa, sb;
    ck_assert_int_eq(stat(partial, &sa), 0);
    /* exactly one flock on the file: ours (HDF5's locking is off) */
    FILE *pl = fopen("/proc/locks", "r");
    int n_locks = 0;
    if (pl) {
        char line[256], key[64];
        snprintf(key, sizeof key, ":%lu ", (unsigned long)sa.st_ino);
        while (fgets(line, sizeof line, pl)) n_locks += strstr(line, "FLOCK") && strstr(line, key);
        fclose(pl);
        ck_assert_int_eq(n_locks, 1);
    }
    o.force = true;
    kvq_status s5 = kvq_dump_create(path, &m, &o, &wb, &e5);
    if (wb) kvq_dump_abort(wb, NULL);
    wb = NULL;
    o.force = false;
    kvq_status s6 = kvq_dump_resume(path, &m, &o, &wb, &e6);
    if (wb) kvq_dump_abort(wb, NULL);
    ck_assert_int_eq(stat(partial, &sb), 0);
    ck_assert_int_eq(kvq_dump_abort(wa, &e), KVQ_OK);
    ck_assert_int_eq(s5, KVQ_EIO);
    ck_assert_msg(strstr(e5.msg, partial) && strstr(e5.msg, "in use by another process"), "%s", e5.msg);
    ck_assert_int_eq(s6, KVQ_EIO);
    ck_assert_msg(strstr(e6.msg, partial) && strstr(e6.msg, "in use by another process"), "%s", e6.msg);
    ck_assert(sa.st_ino == sb.st_ino);
    /* once the writer is gone, both work again */
    ck_assert_msg(kvq_dump_resume(path, &m, &o, &wb, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_abort(wb, &e), KVQ_OK);
    o.force = true;
    ck_assert_msg(kvq_dump_create(path, &m, &o, &wb, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_abort(wb, &e), KVQ_OK);
    rm_dump(path);
}
END_TEST

START_TEST(test_order_and_interrupt)
{
    char path[256];
    tmp_path(path, sizeof path, "order");
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F32);
    volatile sig_atomic_t stop = 0;
    kvq_dump_opts o = kvq_dump_opts_default();
    o.stop = &stop;
    kvq_dump_writer *w;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    layer_bufs b;
    memset(&b, 0, sizeof b);
    fill_layer(&m, 1, 1, &b);
    ck_assert_int_eq(kvq_dump_write_layer(w, 1, 1, &b.d, &e), KVQ_EINVAL); /* sample 1 before 0 */
    ck_assert_ptr_nonnull(strstr(e.msg, "expected sample 0"));
    fill_layer(&m, 1, 0, &b);
    ck_assert_int_eq(kvq_dump_write_layer(w, 0, 3, &b.d, &e), KVQ_EINVAL); /* layer outside 1-2 */
    ck_assert_ptr_nonnull(strstr(e.msg, "layer 3 is outside"));
    ck_assert_msg(kvq_dump_write_layer(w, 0, 1, &b.d, &e) == KVQ_OK, "%s", e.msg);
    int32_t tok[12];
    for (int t = 0; t < 12; t++) tok[t] = gen_token(0, t, 100);
    ck_assert_int_eq(kvq_dump_commit_sample(w, 0, tok, &e), KVQ_EINVAL); /* layer 2 missing */
    ck_assert_ptr_nonnull(strstr(e.msg, "layer 2 was not written"));
    b.d.q = NULL;
    ck_assert_int_eq(kvq_dump_write_layer(w, 0, 2, &b.d, &e), KVQ_EINVAL); /* q enabled but absent */
    ck_assert_ptr_nonnull(strstr(e.msg, "no data for q"));
    fill_layer(&m, 2, 0, &b);
    ck_assert_msg(kvq_dump_write_layer(w, 0, 2, &b.d, &e) == KVQ_OK, "%s", e.msg);
    tok[4] = 100;
    ck_assert_int_eq(kvq_dump_commit_sample(w, 0, tok, &e), KVQ_EINVAL); /* token outside the vocabulary */
    ck_assert_ptr_nonnull(strstr(e.msg, "position 4: token id 100"));
    tok[4] = gen_token(0, 4, 100);
    ck_assert_msg(kvq_dump_commit_sample(w, 0, tok, &e) == KVQ_OK, "%s", e.msg);
    /* a signal flag stops further writes; abort keeps sample 0 */
    stop = 1;
    fill_layer(&m, 1, 1, &b);
    ck_assert_int_eq(kvq_dump_write_layer(w, 1, 1, &b.d, &e), KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "interrupted"));
    ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
    free_layer(&b);
    char partial[300];
    snprintf(partial, sizeof partial, "%s.partial", path);
    kvq_dump_reader *r;
    ck_assert_msg(kvq_dump_open(partial, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_reader_samples_done(r), 1);
    float v[12 * 2 * 8];
    ck_assert_msg(kvq_dump_read(r, 2, KVQ_DUMP_V, 0, v, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(v[5] == gen(KVQ_DUMP_V, 2, 0, 0, 0, 5));
    kvq_dump_close(r);
    rm_dump(path);
}
END_TEST

/* ---- resume -------------------------------------------------------------------- */

START_TEST(test_resume)
{
    char path[256];
    tmp_path(path, sizeof path, "resume");
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_dump_writer *w;
    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    write_samples(w, &m, 0, 2);
    ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
    ck_assert(!exists(path));
    /* mismatching requests are refused, naming the attribute */
    const char *cases[] = {"rope_theta", "tokenizer", "dtype", "n_kv_heads", "has_fisher", "sample_offsets", "kvq_version",
                           "compute_mode"};
    int64_t off2[4] = {0, 1000, 2001, 3000};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvq_dump_meta x = m;
        switch (i) {
        case 0: x.rope_theta = 10000.5; break;
        case 1: snprintf(x.tokenizer, sizeof x.tokenizer, "other"); break;
        case 2: x.dtype = KVQ_DUMP_F32; break;
        case 3: x.n_kv_heads = 4; break;
        case 4: x.has_fisher = false; break;
        case 5: x.sample_offsets = off2; break;
        case 6: snprintf(x.kvq_version, sizeof x.kvq_version, "0.2"); break;
        case 7: snprintf(x.compute_mode, sizeof x.compute_mode, "bf16"); break; /* a dump never mixes math modes */
        }
        ck_assert_int_eq(kvq_dump_resume(path, &x, &o, &w, &e), KVQ_EMISMATCH);
        ck_assert_ptr_null(w);
        char want[64];
        snprintf(want, sizeof want, "'%s' differs", cases[i]);
        ck_assert_msg(strstr(e.msg, want), "case %s: %s", cases[i], e.msg);
    }
    ck_assert_ptr_nonnull(strstr(e.msg, "file has \"exact\", request has \"bf16\""));
    /* the same model and text under other spellings of their paths (./x, another working directory):
     * the sha256s decide (resume was refused on the path strings); the file keeps its first paths */
    {
        kvq_dump_meta x = m;
        snprintf(x.model_path, sizeof x.model_path, "./elsewhere/../%.200s", m.model_path);
        snprintf(x.corpus_path, sizeof x.corpus_path, "/abs/%.200s", m.corpus_path);
        ck_assert_msg(kvq_dump_resume(path, &x, &o, &w, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
        snprintf(x.model_sha256, sizeof x.model_sha256, "%064d", 5); /* another model: refused */
        ck_assert_int_eq(kvq_dump_resume(path, &x, &o, &w, &e), KVQ_EMISMATCH);
        ck_assert_msg(strstr(e.msg, "'model_sha256' differs"), "%s", e.msg);
    }
    /* the matching request (a different command line and device are fine) continues at sample 2 */
    snprintf(m.command_line, sizeof m.command_line, "kvdump --resume ...");
    snprintf(m.compute_device, sizeof m.compute_device, "GPU (test)");
    ck_assert_msg(kvq_dump_resume(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_writer_samples_done(w), 2);
    write_samples(w, &m, 2, 3);
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    check_contents(path, KVQ_DUMP_F16);
    kvq_dump_reader *r;
    ck_assert_msg(kvq_dump_open(path, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(kvq_dump_reader_meta(r)->command_line, "kvdump --resume ...");
    ck_assert_str_eq(kvq_dump_reader_meta(r)->compute_device, "GPU (test)");
    ck_assert_str_eq(kvq_dump_reader_meta(r)->compute_mode, "exact");
    kvq_dump_close(r);
    /* a file written before compute_mode / compute_device existed reads as exact, device "" */
    {
        char p2[600];
        snprintf(p2, sizeof p2, "cp %s %s.old", path, path);
        ck_assert(system(p2) == 0);
        snprintf(p2, sizeof p2, "%s.old", path);
        hid_t f = H5Fopen(p2, H5F_ACC_RDWR, H5P_DEFAULT);
        ck_assert(f >= 0 && H5Adelete(f, "compute_mode") >= 0 && H5Adelete(f, "compute_device") >= 0);
        H5Fclose(f);
        ck_assert_msg(kvq_dump_open(p2, &r, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_str_eq(kvq_dump_reader_meta(r)->compute_mode, "exact");
        ck_assert_str_eq(kvq_dump_reader_meta(r)->compute_device, "");
        kvq_dump_close(r);
        unlink(p2);
    }
    /* nothing to resume */
    ck_assert_int_eq(kvq_dump_resume(path, &m, &o, &w, &e), KVQ_EIO); /* final exists */
    rm_dump(path);
    ck_assert_int_eq(kvq_dump_resume(path, &m, &o, &w, &e), KVQ_EIO);
    ck_assert_ptr_nonnull(strstr(e.msg, "no unfinished dump"));
}
END_TEST

/* --resume trusted the data already in the .partial: a file damaged after it was written resumed to exit 0. Every
 * committed sample is now read back against its CRC-32s: a flipped byte in a layer's values (stored as they are
 * with --deflate 0, or inside a deflate stream), in the tokens, in f16 and in f32 dumps, is refused naming the
 * sample, the layer and what to do; the intact file resumes; a file from before the checksums is read through. */
static void fsize_meta(kvq_dump_meta *m);

static void flip_chunk_byte(const char *file, const char *dset, hsize_t s, hsize_t frac_num, hsize_t frac_den)
{
    hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert(f >= 0);
    hid_t d = H5Dopen2(f, dset, H5P_DEFAULT);
    ck_assert(d >= 0);
    hsize_t off[4] = {s, 0, 0, 0};
    unsigned mask = 0;
    haddr_t addr = 0;
    hsize_t size = 0;
    ck_assert(H5Dget_chunk_info_by_coord(d, off, &mask, &addr, &size) >= 0 && size > 0);
    H5Dclose(d);
    H5Fclose(f);
    int fd = open(file, O_RDWR);
    ck_assert(fd >= 0);
    unsigned char b;
    const off_t at = (off_t)(addr + size * frac_num / frac_den);
    ck_assert(pread(fd, &b, 1, at) == 1);
    b ^= 0x5a;
    ck_assert(pwrite(fd, &b, 1, at) == 1);
    close(fd);
}

START_TEST(test_resume_verifies_samples)
{
    char path[256], part[300], keep[320], cmd[1000];
    tmp_path(path, sizeof path, "verify");
    snprintf(part, sizeof part, "%s.partial", path);
    snprintf(keep, sizeof keep, "%s.keep", path);
    for (int v = 0; v < 4; v++) { /* f16 deflate 1, f16 deflate 0, f32 deflate 0, f16 deflate 0 in 2^20-element samples */
        rm_dump(path);
        kvq_dump_meta m;
        if (v == 2) fsize_meta(&m);
        else small_meta(&m, KVQ_DUMP_F16);
        if (v == 3) { /* 4096 x 2 x 128 per K/V sample: the writer's checksums run in parallel blocks */
            m.seq_len = 4096;
            m.ctx_len = 4096;
            m.head_dim = 128;
            m.rope_dim = 128;
        }
        kvq_dump_opts o = kvq_dump_opts_default();
        o.deflate_level = v == 0 ? 1 : 0;
        kvq_dump_writer *w;
        kvq_err e = {0};
        ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
        write_samples(w, &m, 0, 2);
        ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
        snprintf(cmd, sizeof cmd, "cp %s %s", part, keep);
        ck_assert(system(cmd) == 0);
        struct { const char *dset; hsize_t s; const char *want; } damage[] = {
            {"/layers/2/v", 1, "sample 1, layer 2"},
            {"/layers/1/k_pre_rope", 0, "sample 0, layer 1"},
            {"/tokens", 1, "sample 1"},
        };
        for (size_t i = 0; i < sizeof damage / sizeof *damage; i++) {
            snprintf(cmd, sizeof cmd, "cp %s %s", keep, part);
            ck_assert(system(cmd) == 0);
            flip_chunk_byte(part, damage[i].dset, damage[i].s, 1, 2);
            ck_assert_int_eq(kvq_dump_resume(path, &m, &o, &w, &e), KVQ_EFORMAT);
            ck_assert_ptr_null(w);
            fprintf(stderr, "INFO resume of a damaged dump (%d, %s): %s\n", v, damage[i].dset, e.msg);
            ck_assert_msg(strstr(e.msg, part) && strstr(e.msg, damage[i].want) && strstr(e.msg, "damaged") && strstr(e.msg, "--force"),
                          "%s", e.msg);
            ck_assert_msg(o.deflate_level || strstr(e.msg, "CRC-32"), "%s", e.msg); /* stored as is: the checksum finds it */
        }
        /* the intact file resumes and finishes */
        snprintf(cmd, sizeof cmd, "cp %s %s", keep, part);
        ck_assert(system(cmd) == 0);
        ck_assert_msg(kvq_dump_resume(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(kvq_dump_writer_samples_done(w), 2);
        write_samples(w, &m, 2, 3);
        ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
        /* a .partial from before the checksums: read through (resumes) */
        snprintf(cmd, sizeof cmd, "cp %s %s", keep, part);
        ck_assert(system(cmd) == 0);
        rm_dump(path);
        snprintf(cmd, sizeof cmd, "cp %s %s", keep, part);
        ck_assert(system(cmd) == 0);
        hid_t f = H5Fopen(part, H5F_ACC_RDWR, H5P_DEFAULT);
        ck_assert(f >= 0 && H5Ldelete(f, "/sample_crc32", H5P_DEFAULT) >= 0);
        H5Fclose(f);
        ck_assert_msg(kvq_dump_resume(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_int_eq(kvq_dump_abort(w, &e), KVQ_OK);
    }
    rm_dump(path);
    unlink(keep);
}
END_TEST

/* ---- file-size limit mid-write -------------------------------------------------- */

/* The file-size test's dump: 2 layers x 8 datasets x ~32-64 KiB per sample, no compression. */
static void fsize_meta(kvq_dump_meta *m)
{
    small_meta(m, KVQ_DUMP_F32);
    m->seq_len = 64;
    m->head_dim = 64;
    m->rope_dim = 64;
}

/* Child: commit sample 0, then limit the file size to its current size + 16 KiB
 * (SIGXFSZ ignored, so write() fails with EFBIG) and write on; report through fd. */
static int fsize_child(const char *path, int fd)
{
    kvq_dump_meta m;
    fsize_meta(&m);
    kvq_dump_opts o = kvq_dump_opts_default();
    o.force = true;
    o.deflate_level = 0;
    kvq_dump_writer *w;
    kvq_err e = {0};
    if (kvq_dump_create(path, &m, &o, &w, &e) != KVQ_OK) {
        dprintf(fd, "create: %s", e.msg);
        return 2;
    }
    layer_bufs b[2];
    memset(b, 0, sizeof b);
    kvq_dump_layer_data d[2];
    int32_t tok[64] = {0};
    kvq_status s = KVQ_OK;
    for (int64_t i = 0; i < m.n_samples && !s; i++) {
        if (i == 1) {
            char partial[300];
            struct stat st;
            snprintf(partial, sizeof partial, "%s.partial", path);
            if (stat(partial, &st) != 0) return 3;
            struct rlimit rl = {(rlim_t)st.st_size + (16 << 10), (rlim_t)st.st_size + (16 << 10)};
            signal(SIGXFSZ, SIG_IGN);
            if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 3;
        }
        for (int j = 0; j < 2; j++) {
            fill_layer(&m, 1 + j, i, &b[j]);
            d[j] = b[j].d;
        }
        for (int t = 0; t < 64; t++) tok[t] = gen_token(i, t, m.vocab_size);
        s = kvq_dump_write_sample(w, i, tok, d, &e);
    }
    for (int j = 0; j < 2; j++) free_layer(&b[j]);
    if (!s) {
        kvq_dump_finish(w, &e);
        return 1;
    }
    dprintf(fd, "%d|%s", (int)s, e.msg);
    /* the writer refuses further work, finish fails, and nothing reaches the final name */
    s = kvq_dump_commit_sample(w, 1, tok, &e);
    dprintf(fd, "|then:%d|%s", (int)s, e.msg);
    s = kvq_dump_finish(w, &e);
    dprintf(fd, "|finish:%d|%s", (int)s, e.msg);
    return 0;
}

static void run_fsize(const char *path, char *msg, size_t n)
{
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        _exit(fsize_child(path, p[1]));
    }
    close(p[1]);
    size_t got = 0;
    ssize_t k;
    while (got + 1 < n && (k = read(p[0], msg + got, n - 1 - got)) > 0) got += (size_t)k;
    msg[got] = 0;
    close(p[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d: %s", st, msg);
}

START_TEST(test_file_size_limit)
{
    char path[256], partial[300], msg[4000];
    tmp_path(path, sizeof path, "fsize");
    snprintf(partial, sizeof partial, "%s.partial", path);
    rm_dump(path);
    run_fsize(path, msg, sizeof msg);
    /* KVQ_EIO naming the file, the dataset and the OS reason */
    ck_assert_msg(strncmp(msg, "1|", 2) == 0 && strstr(msg, ".partial: writing /layers/") &&
                  strstr(msg, "sample 1 failed") && strstr(msg, "File too large"), "%s", msg);
    ck_assert_msg(strstr(msg, "|then:1|") && strstr(msg, "unusable after an earlier write error"), "%s", msg);
    ck_assert_msg(strstr(msg, "|finish:1|") && strstr(msg, "keeps the 1 committed samples"), "%s", msg);
    ck_assert(!exists(path));
    /* the .partial still holds sample 0 and resumes to a complete, correct dump */
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(partial, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_reader_samples_done(r), 1);
    kvq_dump_close(r);
    kvq_dump_meta m;
    fsize_meta(&m);
    kvq_dump_writer *w;
    ck_assert_msg(kvq_dump_resume(path, &m, NULL, &w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_writer_samples_done(w), 1);
    write_samples(w, &m, 1, 3);
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_dump_open(path, &r, &e) == KVQ_OK, "%s", e.msg);
    float *got = malloc(64 * 4 * 64 * sizeof(float));
    layer_bufs b;
    memset(&b, 0, sizeof b);
    for (int64_t s = 0; s < 3; s++) {
        fill_layer(&m, 2, s, &b);
        ck_assert_msg(kvq_dump_read(r, 2, KVQ_DUMP_Q, s, got, &e) == KVQ_OK, "%s", e.msg);
        ck_assert(memcmp(got, b.buf[KVQ_DUMP_Q], 64 * 4 * 64 * sizeof(float)) == 0);
    }
    free_layer(&b);
    free(got);
    kvq_dump_close(r);
    /* a pre-existing final file (forced replacement) survives the failure */
    rm_dump(path);
    write_file(path, "precious");
    run_fsize(path, msg, sizeof msg);
    ck_assert_msg(strstr(msg, "File too large"), "%s", msg);
    ck_assert(file_is(path, "precious"));
    rm_dump(path);
}
END_TEST

/* ---- bad files -------------------------------------------------------------------- */

static void make_small_dump(const char *path)
{
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_dump_writer *w;
    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    write_samples(w, &m, 0, 3);
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
}

START_TEST(test_bad_files)
{
    char path[256];
    tmp_path(path, sizeof path, "bad");
    kvq_dump_reader *r;
    kvq_err e = {0};
    /* schema version from the future */
    make_small_dump(path);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t a = H5Aopen(f, "schema_version", H5P_DEFAULT);
    int64_t v2 = 2;
    ck_assert_int_ge(H5Awrite(a, H5T_NATIVE_INT64, &v2), 0);
    H5Aclose(a);
    H5Fclose(f);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EUNSUPPORTED);
    ck_assert_ptr_null(r);
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "schema_version 2") && strstr(e.msg, "version 1"), "%s", e.msg);
    /* a dataset of the wrong type, then one of the wrong shape */
    make_small_dump(path);
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(H5Ldelete(f, "/layers/2/v", H5P_DEFAULT), 0);
    ck_assert_int_ge(H5Ldelete(f, "/layers/2/fisher_v", H5P_DEFAULT), 0);
    hsize_t dims[4] = {3, 12, 2, 8};
    hid_t sp = H5Screate_simple(4, dims, NULL);
    hid_t d = H5Dcreate2(f, "/layers/2/v", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert_int_ge(d, 0);
    H5Dclose(d);
    H5Sclose(sp);
    dims[3] = 4;
    sp = H5Screate_simple(4, dims, NULL);
    d = H5Dcreate2(f, "/layers/2/fisher_v", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert_int_ge(d, 0);
    H5Dclose(d);
    H5Sclose(sp);
    H5Fclose(f);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "/layers/2/v: expected IEEE binary16 (f16), found class 1 of 4 bytes"), "%s", e.msg);
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(H5Ldelete(f, "/layers/2/v", H5P_DEFAULT), 0);
    H5Fclose(f);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "/layers/2/v is missing"), "%s", e.msg);
    /* put back a correct v: now the fisher_v shape is the first problem */
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(H5Lcreate_hard(f, "/layers/2/k", f, "/layers/2/v", H5P_DEFAULT, H5P_DEFAULT), 0);
    H5Fclose(f);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "/layers/2/fisher_v: expected shape [3][12][2][8], found [3][12][2][4]"), "%s", e.msg);
    /* an HDF5 file that is not a dump */
    rm_dump(path);
    f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(f);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "not a kvq dump"), "%s", e.msg);
    /* not HDF5 at all; missing */
    write_file(path, "hello");
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "it is a text file, not a kvdump dump"), "%s", e.msg);
    rm_dump(path);
    ck_assert_int_eq(kvq_dump_open(path, &r, &e), KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "No such file"), "%s", e.msg);
    /* HDF5 printed nothing on any of these failures, and its printing setting is restored afterwards */
    char errf[300];
    snprintf(errf, sizeof errf, "%s.stderr", path);
    fflush(stderr);
    int saved = dup(2), fd = open(errf, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    ck_assert(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    make_small_dump(path);
    f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    a = H5Aopen(f, "schema_version", H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v2);
    H5Aclose(a);
    H5Fclose(f);
    kvq_status s1 = kvq_dump_open(path, &r, &e);                                      /* schema error */
    kvq_status s2 = kvq_dump_open("/nonexistent_dir_kvq/x.h5", &r, &e);               /* missing */
    kvq_dump_writer *w0;
    kvq_dump_meta m0;
    small_meta(&m0, KVQ_DUMP_F32);
    kvq_status s3 = kvq_dump_create("/nonexistent_dir_kvq/x.h5", &m0, NULL, &w0, &e); /* HDF5 create fails */
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    ck_assert(s1 == KVQ_EUNSUPPORTED && s2 == KVQ_EIO && s3 == KVQ_EIO);
    struct stat st;
    ck_assert_int_eq(stat(errf, &st), 0);
    ck_assert_msg(st.st_size == 0, "HDF5 wrote %lld bytes to stderr", (long long)st.st_size);
    unlink(errf);
    H5E_auto2_t func = NULL;
    void *data = NULL;
    H5Eget_auto2(H5E_DEFAULT, &func, &data);
    ck_assert_ptr_nonnull((void *)func); /* HDF5's default printer is back */
    rm_dump(path);
    /* bad meta at create names the field */
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_dump_writer *w;
    m.layer_last = 4;
    ck_assert_int_eq(kvq_dump_create(path, &m, NULL, &w, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layer range 1-4"), "%s", e.msg);
    small_meta(&m, KVQ_DUMP_F16);
    m.seq_len = 65;
    ck_assert_int_eq(kvq_dump_create(path, &m, NULL, &w, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "seq_len = 65"), "%s", e.msg);
    ck_assert(!exists(path));
}
END_TEST

/* ---- non-finite and f16-range checks ------------------------------------------------ */

START_TEST(test_nonfinite)
{
    size_t row, col;
    float x[6] = {1, 2, 3, 4, NAN, 6};
    ck_assert(kvq_dump_find_bad(x, 2, 3, 0, &row, &col));
    ck_assert(row == 1 && col == 1);
    x[4] = 5;
    ck_assert(!kvq_dump_find_bad(x, 2, 3, 0, &row, &col));
    x[2] = 70000;
    ck_assert(!kvq_dump_find_bad(x, 2, 3, 0, &row, &col));
    ck_assert(kvq_dump_find_bad(x, 2, 3, KVQ_DUMP_F16_MAX, &row, &col) && row == 0 && col == 2);
    x[2] = -INFINITY;
    ck_assert(kvq_dump_find_bad(x, 2, 3, 0, &row, &col) && row == 0 && col == 2);

    char path[256];
    tmp_path(path, sizeof path, "nan");
    rm_dump(path);
    kvq_dump_meta m;
    small_meta(&m, KVQ_DUMP_F16);
    kvq_dump_writer *w;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_create(path, &m, NULL, &w, &e) == KVQ_OK, "%s", e.msg);
    layer_bufs b;
    memset(&b, 0, sizeof b);
    fill_layer(&m, 1, 0, &b);
    /* k[t=5][h=1][c=3] = NaN */
    b.buf[KVQ_DUMP_K][(5 * 2 + 1) * 8 + 3] = NAN;
    ck_assert_int_eq(kvq_dump_write_layer(w, 0, 1, &b.d, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "k: layer 1, sample 0, position 5, head 1, channel 3: value nan is not finite"), "%s", e.msg);
    fill_layer(&m, 1, 0, &b);
    /* v beyond the f16 range */
    b.buf[KVQ_DUMP_V][(7 * 2 + 0) * 8 + 2] = -70000.0f;
    ck_assert_int_eq(kvq_dump_write_layer(w, 0, 1, &b.d, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "v: layer 1, sample 0, position 7, head 0, channel 2: value -70000 exceeds the f16 range"), "%s", e.msg);
    fill_layer(&m, 1, 0, &b);
    /* attention entropy [n_heads][L]: head 3, position 9; Fisher (f32) may exceed 65504 */
    b.buf[KVQ_DUMP_ATTN_ENTROPY][3 * 12 + 9] = INFINITY;
    b.buf[KVQ_DUMP_FISHER_V][0] = 1e6f;
    ck_assert_int_eq(kvq_dump_write_layer(w, 0, 1, &b.d, &e), KVQ_ENUMERIC);
    ck_assert_msg(strstr(e.msg, "attn_entropy: layer 1, sample 0, position 9, head 3: value inf"), "%s", e.msg);
    b.buf[KVQ_DUMP_ATTN_ENTROPY][3 * 12 + 9] = 0.5f;
    ck_assert_msg(kvq_dump_write_layer(w, 0, 1, &b.d, &e) == KVQ_OK, "%s", e.msg);
    free_layer(&b);
    kvq_dump_abort(w, NULL);
    rm_dump(path);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("dump");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_f16_codec);
    tcase_add_test(tc, test_roundtrip_f32);
    tcase_add_test(tc, test_roundtrip_f16);
    tcase_add_test(tc, test_deterministic);
    tcase_add_test(tc, test_attributes_roundtrip);
    tcase_add_test(tc, test_partial_and_force);
    tcase_add_test(tc, test_lock_without_hdf5_locking);
    tcase_add_test(tc, test_order_and_interrupt);
    tcase_add_test(tc, test_resume);
    tcase_add_test(tc, test_resume_verifies_samples);
    tcase_add_test(tc, test_file_size_limit);
    tcase_add_test(tc, test_bad_files);
    tcase_add_test(tc, test_nonfinite);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
