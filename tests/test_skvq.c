/* test_skvq.c — the SKVQ family (kernels/schemes/skvq.c):
 *  - decode equivalence: the batched window (the quantized K/V as the alternative read beyond the
 *    sliding window) equals a token-by-token decode loop that keeps its own cache: a token is exact
 *    while it is a sink token or one of the W most recent, then it holds the clipped group
 *    quantization written out again here from the artifact's tables (pre-RoPE keys quantized, then
 *    rotated at their position); the same logits and NLLs bit for bit on both tiny models
 *    (stories260K: GQA, head_dim 8; aidreams260K: head_dim 16), with in-memory tables (random
 *    permutation, unequal groups, clip < 1) and with a kvcalib artifact;
 *  - kvdump -> kvcalib --method skvq -> kveval on aidreams260K: the artifact read back and validated;
 *    the fitted groups are a k-means fixed point of the channels' calibration (min, max) (every
 *    channel nearest to its own group's centroid, computed here from the dump); the clip ratio has
 *    the least reconstruction error on the grid (recomputed here in double); kvstat's view of it;
 *  - spec, canonical name, bits by hand, refusals naming the rule (tables, parameters, context). */
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "artifact.h"
#include "calibrate.h"
#include "capture.h"
#include "dump.h"
#include "family.h"
#include "forward.h"
#include "identity.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "kvsrc.h"
#include "kvstats.h"
#include "ops.h"
#include "scheme.h"

static void make_tokens(int *tok, int n, int V, uint32_t seed)
{
    uint32_t s = seed;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        tok[i] = (int)((s >> 8) % (uint32_t)V);
    }
}

static size_t n_bits_differ(const float *a, const float *b, size_t n)
{
    size_t f = 0;
    for (size_t i = 0; i < n; i++) f += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return f;
}

/* ---------------- the reference quantizer, written out again ---------------- */

/* token row x[kvd] -> y: group g holds the channels perm[gs[g] .. gs[g+1]); its range min / max times the clip
 * ratio a; scale max((hi - lo) / (2^b - 1), 1e-5); code round(clamp((x - lo) / scale, 0, 2^b - 1)) */
static void ref_quant(float *y, const float *x, const kvq_kv_table *t, int bits)
{
    const kvq_fam_tensor *pm = kvq_kv_table_get(t, "perm"), *gs = kvq_kv_table_get(t, "group_start"), *cl = kvq_kv_table_get(t, "clip");
    ck_assert(pm && gs && cl);
    float a = cl->data[0], top = (float)((1 << bits) - 1);
    for (size_t g = 0; g + 1 < gs->shape[0]; g++) {
        int r0 = (int)gs->data[g], r1 = (int)gs->data[g + 1];
        float lo = INFINITY, hi = -INFINITY;
        for (int r = r0; r < r1; r++) {
            float v = x[(int)pm->data[r]];
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
        }
        lo *= a;
        hi *= a;
        float s = fmaxf((hi - lo) / top, 1e-5f);
        for (int r = r0; r < r1; r++) {
            int c = (int)pm->data[r];
            y[c] = rintf(fminf(fmaxf((x[c] - lo) / s, 0.0f), top)) * s + lo;
        }
    }
}

/* ---------------- the step-by-step reference cache ---------------- */

typedef struct {
    int L, kvd, N, step;
    float *ck, *ckpre, *cv; /* [L][N][kvd]: exact post-RoPE keys, pre-RoPE keys, values as appended */
    const kvq_eval_scheme *s; /* W = 0: the appended token is quantized before it attends (transform hook) */
} ref_cache;

/* W = 0: the new token enters the cache quantized (keys in the scheme's stage), so it attends its own quantized key */
static kvq_status ref_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *e)
{
    (void)alt;
    (void)e;
    ref_cache *r = user;
    const kvq_scheme *q = &r->s->s.q;
    if (q->residual > 0 || (size_t)r->step < q->n_sink) return KVQ_OK;
    float y[4096];
    ck_assert_int_le(r->kvd, 4096);
    ref_quant(y, k, &r->s->art->k[c->layer], q->k_bits);
    memcpy(k, y, (size_t)r->kvd * sizeof(float));
    ref_quant(y, v, &r->s->art->v[c->layer], q->v_bits);
    memcpy(v, y, (size_t)r->kvd * sizeof(float));
    return KVQ_OK;
}

static kvq_status ref_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *e)
{
    (void)e;
    ref_cache *r = user;
    ck_assert_int_eq(c->T, 1);
    size_t off = ((size_t)c->layer * r->N + r->step) * r->kvd;
    memcpy(r->ck + off, o->k_post, (size_t)r->kvd * sizeof(float)); /* exact, whatever the transform did */
    memcpy(r->ckpre + off, o->k_pre, (size_t)r->kvd * sizeof(float));
    memcpy(r->cv + off, o->v, (size_t)r->kvd * sizeof(float));
    return KVQ_OK;
}

static void skvq_decode_case(const kvq_model *m, const char *spec, const kvq_artifact_set *set)
{
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make(spec, set, &m->hp, &s, &e) == KVQ_OK, "%s: %s", spec, e.msg);
    const int N = 48, V = m->hp.vocab_size, kvd = kvq_kv_dim(&m->hp), L = m->hp.n_layers, hd = m->hp.head_dim;
    int tok[48];
    make_tokens(tok, N, V, 777);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
    float *lb = malloc((size_t)N * V * sizeof(float)), *ld = malloc((size_t)N * V * sizeof(float));
    double nll_b[48], nll_d[48];
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &s, &hk);
    kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hk, .logits = lb, .nll = nll_b};
    kvq_fwd_result res;
    ck_assert_msg(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK, "%s", e.msg);
    double loss_b = res.loss;
    kvq_scheme_run_free(&run);
    kvq_quant_counts kc = run.k_counts, vc = run.v_counts;

    const kvq_scheme *q = &s.s.q;
    const int W = (int)q->residual, ns = (int)q->n_sink;
    const bool pre = s.s.key_stage == KVQ_KEYS_PRE_ROPE;
    size_t cn = (size_t)L * N * kvd;
    ref_cache r = {.L = L, .kvd = kvd, .N = N, .ck = calloc(cn, sizeof(float)), .ckpre = calloc(cn, sizeof(float)),
                   .cv = calloc(cn, sizeof(float)), .s = &s};
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    float *cs = malloc((size_t)m->hp.rope_dim * sizeof(float)), *sn = malloc((size_t)m->hp.rope_dim * sizeof(float));
    kvq_hooks hd0 = {.user = &r, .observe = ref_observe, .transform = ref_transform, .key_stage = s.s.key_stage};
    double loss_d = 0;
    long n_quant_reads = 0;
    for (int t = 0; t < N; t++) {
        for (int l = 0; l < L; l++)
            for (int j = 0; j < t; j++) {
                size_t src = ((size_t)l * N + j) * kvd, dst = ((size_t)l * t + j) * kvd;
                if (j < ns || j > t - W) { /* sink or sliding window: exact */
                    memcpy(pk + dst, r.ck + src, (size_t)kvd * sizeof(float));
                    memcpy(pv + dst, r.cv + src, (size_t)kvd * sizeof(float));
                    continue;
                }
                n_quant_reads++;
                if (pre) { /* the pre-RoPE key quantized, then rotated at position j */
                    ref_quant(pk + dst, r.ckpre + src, &s.art->k[l], q->k_bits);
                    kvq_rope_table(&m->hp, j, 1, cs, sn);
                    kvq_rope_apply(pk + dst, 1, m->hp.n_kv_heads, hd, m->hp.rope_dim, cs, sn, 0);
                } else
                    ref_quant(pk + dst, r.ck + src, &s.art->k[l], q->k_bits);
                ref_quant(pv + dst, r.cv + src, &s.art->v[l], q->v_bits);
            }
        kvq_prefix px = {.P = t, .k = pk, .v = pv};
        r.step = t;
        int tg = t + 1 < N ? tok[t + 1] : -1;
        kvq_fwd_io io1 = {.tokens = tok + t, .T = 1, .pos0 = t, .targets = &tg, .prefix = &px, .hooks = &hd0,
                          .logits = ld + (size_t)t * V, .nll = nll_d + t};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &res, &e) == KVQ_OK, "%s", e.msg);
        if (t + 1 < N) loss_d += nll_d[t];
    }
    loss_d /= N - 1;
    size_t logit_diff = n_bits_differ(lb, ld, (size_t)N * V);
    int first_div = -1;
    for (int t = 0; t + 1 < N && first_div < 0; t++)
        if (memcmp(&nll_b[t], &nll_d[t], sizeof(double))) first_div = t;
    kvq_fwd_io io0 = {.tokens = tok, .T = N};
    ck_assert(kvq_forward_run(&fw, &io0, &res, &e) == KVQ_OK);
    double d_fp32 = fabs(res.loss - loss_d) / loss_d;
    fprintf(stderr, "INFO skvq decode %-24s %s: batched %.9f decode %.9f, %zu logits differ, first NLL difference at %d; %ld quantized "
                    "reads; vs fp32 %.2e\n",
            s.name, m->path, loss_b, loss_d, logit_diff, first_div, n_quant_reads, d_fp32);
    ck_assert_msg(logit_diff == 0 && first_div < 0 && fabs(loss_b - loss_d) <= 1e-12 * loss_d,
                  "%s: batched %.12g vs decode %.12g, %zu logits differ, first NLL difference at %d", s.name, loss_b, loss_d, logit_diff,
                  first_div);
    ck_assert_msg(d_fp32 > 1e-4, "%s barely changes the loss (%.2e)", s.name, d_fp32);
    ck_assert_int_gt(n_quant_reads, 0);
    /* the resting cache of the last query: sink and window exact */
    uint64_t win = (uint64_t)(N - ns < W ? N - ns : W);
    ck_assert_uint_eq(kc.n_elems, (uint64_t)L * N * kvd);
    ck_assert_uint_eq(kc.n_sink, (uint64_t)L * ns * kvd);
    ck_assert_uint_eq(kc.n_exact, (uint64_t)L * win * kvd);
    ck_assert_uint_eq(vc.n_exact, kc.n_exact);
    free(pk);
    free(pv);
    free(cs);
    free(sn);
    free(r.ck);
    free(r.ckpre);
    free(r.cv);
    free(lb);
    free(ld);
    kvq_forward_free(&fw);
}

/* ---------------- an in-memory artifact: a random permutation, unequal groups, clip < 1 ---------------- */

typedef struct {
    kvq_artifact a;
    kvq_eval_prefix px;
    char path[1][4096];
    kvq_kv_layer_tables *tables;
    kvq_artifact_set set;
} sk_art;

static void sk_tables(kvq_kv_table *t, size_t kvd, uint32_t *st, float clip)
{
    kvq_err e = {0};
    float *pm, *gs, *cl;
    uint64_t sp[1] = {kvd}, sc[1] = {1};
    /* groups of 1, 3, 2, 5, ... channels (cycling) up to kv_dim */
    size_t sizes[64], ng = 0, tot = 0;
    static const size_t cyc[] = {1, 3, 2, 5, 4, 7};
    while (tot < kvd) {
        size_t z = cyc[ng % 6];
        if (tot + z > kvd) z = kvd - tot;
        sizes[ng++] = z;
        tot += z;
    }
    uint64_t sg[1] = {ng + 1};
    ck_assert(kvq_kv_table_add(t, "perm", 1, sp, &pm, &e) == KVQ_OK);
    ck_assert(kvq_kv_table_add(t, "group_start", 1, sg, &gs, &e) == KVQ_OK);
    ck_assert(kvq_kv_table_add(t, "clip", 1, sc, &cl, &e) == KVQ_OK);
    for (size_t c = 0; c < kvd; c++) pm[c] = (float)c;
    for (size_t c = kvd - 1; c > 0; c--) { /* Fisher-Yates */
        *st = *st * 1664525u + 1013904223u;
        size_t j = (*st >> 8) % (c + 1);
        float x = pm[c];
        pm[c] = pm[j];
        pm[j] = x;
    }
    gs[0] = 0;
    for (size_t g = 0; g < ng; g++) gs[g + 1] = gs[g] + (float)sizes[g];
    cl[0] = clip;
}

static void sk_art_make(sk_art *x, const kvq_hparams *hp, int bits, size_t ns, bool post_rope)
{
    memset(x, 0, sizeof *x);
    size_t L = (size_t)hp->n_layers, kvd = (size_t)kvq_kv_dim(hp);
    x->a.p.method = KVQ_FAM("skvq");
    x->a.p.k_bits = x->a.p.v_bits = bits;
    x->a.p.post_rope = post_rope;
    x->a.p.n_sink = ns;
    x->a.p.group_size = 4;
    x->a.p.n_layers = L;
    x->a.p.n_kv_heads = (size_t)hp->n_kv_heads;
    x->a.p.head_dim = (size_t)hp->head_dim;
    x->a.k = calloc(L, sizeof *x->a.k);
    x->a.v = calloc(L, sizeof *x->a.v);
    uint32_t st = 5;
    for (size_t l = 0; l < L; l++) {
        sk_tables(&x->a.k[l], kvd, &st, 0.93f);
        sk_tables(&x->a.v[l], kvd, &st, 0.97f);
    }
    snprintf(x->path[0], sizeof x->path[0], "skvq-test.safetensors");
    x->tables = calloc(L, sizeof *x->tables);
    x->set = (kvq_artifact_set){.n = 1, .a = &x->a, .prefix = &x->px, .path = x->path, .tables = &x->tables};
}

static void sk_art_free(sk_art *x)
{
    for (size_t l = 0; l < x->a.p.n_layers; l++) {
        kvq_kv_table_free(&x->a.k[l]);
        kvq_kv_table_free(&x->a.v[l]);
    }
    free(x->a.k);
    free(x->a.v);
    free(x->tables);
}

START_TEST(test_skvq_decode_equivalence)
{
    char buf[4096];
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        const char *p = kvq_test_shared(buf, sizeof buf, models[mi]);
        KVQ_SKIP_IF(!p, "../shared/models/llama2c tiny models absent");
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
        sk_art pre, post;
        sk_art_make(&pre, &m.hp, 2, 2, false);
        sk_art_make(&post, &m.hp, 3, 0, true);
        skvq_decode_case(&m, "skvq2-w8", &pre.set);      /* pre-RoPE keys, 2 sink tokens from the artifact */
        skvq_decode_case(&m, "skvq2-w3+sink1", &pre.set); /* the sink overridden */
        skvq_decode_case(&m, "skvq3-w5", &post.set);      /* post-RoPE keys, no sink */
        skvq_decode_case(&m, "skvq3-w0", &post.set);      /* no window: a token attends its own quantized key */
        skvq_decode_case(&m, "skvq2-w0+sink3", &pre.set); /* the same with pre-RoPE keys and sink tokens */
        sk_art_free(&pre);
        sk_art_free(&post);
        kvq_model_free(&m);
    }
}
END_TEST

/* ---------------- kvdump -> kvcalib -> kveval / kvstat on a real tiny model ---------------- */

/* channel (min, max) of one side over the dump's rows, every sample's first ns tokens left out */
static void chan_minmax(kvq_dump_reader *dr, const kvq_dump_meta *dm, int layer, int ds, size_t ns, double *mn, double *mx, float **rows,
                        size_t *n_rows)
{
    kvq_err e = {0};
    size_t kvd = (size_t)dm->n_kv_heads * dm->head_dim, L = (size_t)dm->seq_len, n = (size_t)dm->n_samples * L;
    float *x = malloc(n * kvd * sizeof(float)), *y = malloc(n * kvd * sizeof(float));
    for (int64_t smp = 0; smp < dm->n_samples; smp++)
        ck_assert_msg(kvq_dump_read(dr, layer, (kvq_dump_ds)ds, smp, x + (size_t)smp * L * kvd, &e) == KVQ_OK, "%s", e.msg);
    size_t o = 0;
    for (size_t i = 0; i < n; i++)
        if (i % L >= ns) memcpy(y + (o++) * kvd, x + i * kvd, kvd * sizeof(float));
    for (size_t c = 0; c < kvd; c++) {
        mn[c] = INFINITY;
        mx[c] = -INFINITY;
        for (size_t i = 0; i < o; i++) {
            mn[c] = fmin(mn[c], y[i * kvd + c]);
            mx[c] = fmax(mx[c], y[i * kvd + c]);
        }
    }
    free(x);
    *rows = y;
    *n_rows = o;
}

START_TEST(test_skvq_kvcalib_chain)
{
    char model[4096], tokf[4096], text[4096];
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/aidreams260K.bin") ||
                    !kvq_test_shared(tokf, sizeof tokf, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared tiny model or WikiText-2 absent");
    char dump[256], out[256];
    snprintf(dump, sizeof dump, "/tmp/kvq_test_skvq_%d.h5", (int)getpid());
    snprintf(out, sizeof out, "/tmp/kvq_test_skvq_%d.safetensors", (int)getpid());
    unlink(dump);
    unlink(out);
    kvq_capture_opts co = kvq_capture_opts_default();
    co.model_path = model;
    co.tokenizer_path = tokf;
    co.text_path = text;
    co.format = KVQ_TEXT_WIKITEXT_TOKENS;
    co.samples = 3;
    co.seq_len = 64;
    co.quiet = true;
    co.out_path = dump;
    co.command_line = "test_skvq";
    kvq_capture_report rep;
    kvq_err e = {0};
    ck_assert_msg(kvq_capture_run(&co, &rep, &e) == KVQ_OK, "%s", e.msg);
    kvq_model m;
    ck_assert_msg(kvq_model_load(model, &m, &e) == KVQ_OK, "%s", e.msg);
    const size_t kvd = (size_t)kvq_kv_dim(&m.hp), G = 8;

    /* kvcalib's defaults are the reference's: 2 bits, G = 128, sink 5, pre-RoPE keys, clip searched */
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("skvq"));
    ck_assert_int_eq(o.k_bits, 2);
    ck_assert_uint_eq(o.n_sink, 5);
    ck_assert_uint_eq(o.group_size, 128);
    ck_assert(!o.post_rope);
    ck_assert(o.x[0] == 0);
    /* G = 128 does not divide aidreams' kv_dim: refused before any work, the rule named */
    if (kvd % 128) {
        ck_assert_int_ne(kvq_calibrate_file(dump, out, false, &o, NULL, &e), KVQ_OK);
        ck_assert_msg(strstr(e.msg, "skvq clusters kv_dim") && strstr(e.msg, "expected G dividing it"), "%s", e.msg);
        ck_assert(access(out, F_OK) != 0);
    }
    o.group_size = G;
    o.x[0] = 1.5; /* a clip ratio above 1 */
    ck_assert_int_ne(kvq_calibrate_file(dump, out, false, &o, NULL, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "kvq.skvq.clip"), "%s", e.msg);
    o.x[0] = 0;
    kvq_artifact a;
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_free(&a);
    /* read back from the file, validated */
    kvq_artifact ar;
    ck_assert_msg(kvq_artifact_read(out, &ar, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(ar.p.method->name, "skvq");
    ck_assert_uint_eq(ar.p.group_size, G);

    kvq_dump_reader *dr = NULL;
    ck_assert_msg(kvq_dump_open(dump, &dr, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta dm = *kvq_dump_reader_meta(dr);
    double *mn = malloc(kvd * sizeof(double)), *mx = malloc(kvd * sizeof(double));
    float *y = malloc(kvd * sizeof(float));
    int clip_below_one = 0;
    for (int l = 0; l < m.hp.n_layers; l++)
        for (int w = 0; w < 2; w++) {
            const kvq_kv_table *t = w ? &ar.v[l] : &ar.k[l];
            float *rows;
            size_t n_rows;
            chan_minmax(dr, &dm, l, w ? KVQ_DUMP_V : KVQ_DUMP_K_PRE_ROPE, 5, mn, mx, &rows, &n_rows);
            const kvq_fam_tensor *pm = kvq_kv_table_get(t, "perm"), *gs = kvq_kv_table_get(t, "group_start"),
                                 *cl = kvq_kv_table_get(t, "clip");
            ck_assert(pm && gs && cl);
            size_t ng = (size_t)gs->shape[0] - 1;
            ck_assert_uint_le(ng, kvd / G);
            ck_assert_uint_ge(ng, 2);
            /* a k-means fixed point: every channel is nearest to the centroid of its own group */
            double cen[64][2];
            ck_assert_uint_le(ng, 64);
            for (size_t g = 0; g < ng; g++) {
                cen[g][0] = cen[g][1] = 0;
                for (int r = (int)gs->data[g]; r < (int)gs->data[g + 1]; r++) {
                    cen[g][0] += mn[(int)pm->data[r]];
                    cen[g][1] += mx[(int)pm->data[r]];
                }
                double z = gs->data[g + 1] - gs->data[g];
                cen[g][0] /= z;
                cen[g][1] /= z;
            }
            for (size_t g = 0; g < ng; g++)
                for (int r = (int)gs->data[g]; r < (int)gs->data[g + 1]; r++) {
                    int c = (int)pm->data[r];
                    double own = pow(mn[c] - cen[g][0], 2) + pow(mx[c] - cen[g][1], 2);
                    for (size_t h = 0; h < ng; h++)
                        ck_assert_msg(own <= pow(mn[c] - cen[h][0], 2) + pow(mx[c] - cen[h][1], 2) + 1e-9 * (1 + own),
                                      "layer %d %c: channel %d is nearer to group %zu than to its own %zu", l, w ? 'v' : 'k', c, h, g);
                }
            /* the clip ratio: the least squared error over 1.00 .. 0.50 (written out here in double) */
            double best = INFINITY, at = 0;
            for (int i = 100; i >= 50; i--) {
                kvq_kv_table tt = *t; /* the same tables with clip i/100 */
                float cv = (float)i / 100.0f;
                kvq_fam_tensor clt = *cl;
                clt.data = &cv;
                for (size_t k = 0; k < tt.n_ft; k++)
                    if (!strcmp(tt.ft[k].name, "clip")) tt.ft[k] = clt;
                double sse = 0;
                for (size_t i2 = 0; i2 < n_rows; i2++) {
                    ref_quant(y, rows + i2 * kvd, &tt, 2);
                    for (size_t c = 0; c < kvd; c++) sse += pow((double)y[c] - rows[i2 * kvd + c], 2);
                }
                if (sse < best) {
                    best = sse;
                    at = cv;
                }
            }
            ck_assert_msg(cl->data[0] == (float)at, "layer %d %c: clip %g, the least error is at %g", l, w ? 'v' : 'k', (double)cl->data[0], at);
            clip_below_one += cl->data[0] < 1;
            free(rows);
        }
    ck_assert_msg(clip_below_one > 0, "no layer clipped: the search never chose below 1");
    kvq_dump_close(dr);
    free(mn);
    free(mx);
    free(y);

    /* kveval binds it (keys pre-RoPE, sink 5 from the artifact) and stays decode-equivalent */
    kvq_artifact_set set;
    char fp[65];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    const char *paths[1] = {out};
    ck_assert_msg(kvq_artifact_set_load(&set, paths, 1, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("skvq2-w16", &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "skvq2-w16+sink5");
    ck_assert_int_eq(s.s.key_stage, KVQ_KEYS_PRE_ROPE);
    skvq_decode_case(&m, "skvq2-w16", &set);
    /* a 3-bit spec does not match the 2-bit artifact */
    ck_assert_int_ne(kvq_eval_scheme_make("skvq3", &set, &m.hp, &s, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "method skvq, 3 bits"), "%s", e.msg);

    /* kvstat: the artifact's own scheme over the dump (sink and the last 128 tokens exact: samples of 64 tokens leave
     * nothing quantized at the default window, so the error is 0; the tables still bind) */
    kvq_kvsrc src;
    ck_assert_msg(kvq_kvsrc_dump_open(dump, &src, &e) == KVQ_OK, "%s", e.msg);
    kvq_qscheme_state qs;
    kvq_qscheme qsch;
    ck_assert_msg(kvq_qscheme_from_artifact(&ar, &qs, &qsch, &e) == KVQ_OK, "%s", e.msg);
    kvq_qerr qe;
    ck_assert_msg(kvq_qerr_compute(&src, &qsch, 1, true, &qe, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(strstr(qe.names[0], "skvq"), "%s", qe.names[0]);
    for (int j = 0; j < qe.n_stat_layers; j++) ck_assert(qe.mse_k[j] == 0 && qe.mse_v[j] == 0);
    kvq_qerr_free(&qe);
    kvq_qscheme_state_free(&qs);
    kvq_kvsrc_dump_close(&src);

    kvq_artifact_set_free(&set);
    kvq_artifact_free(&ar);
    kvq_model_free(&m);
    unlink(dump);
    unlink(out);
}
END_TEST

/* ---------------- spec, bits, tables, refusals ---------------- */

START_TEST(test_skvq_spec_bits)
{
    kvq_hparams hp = {.n_layers = 30, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                      .vocab_size = 49152, .ctx_len = 8192, .rope_dim = 64, .rope_theta = 100000, .norm_eps = 1e-5f};
    kvq_err e = {0};
    kvq_eval_scheme s;
    /* the tables are needed */
    ck_assert_int_ne(kvq_eval_scheme_make("skvq2", NULL, &hp, &s, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "method skvq"), "%s", e.msg);
    sk_art x;
    sk_art_make(&x, &hp, 2, 5, false);
    x.a.p.group_size = 32;
    ck_assert_msg(kvq_eval_scheme_make("skvq2", &x.set, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "skvq2-w128+sink5");
    /* bits at ctx 2048: 5 sink + 128 window at 16, the rest at 2 + 32 / 32 (fp16 scale and zero point per token and
     * group, kv_dim / G = 6 groups), plus the permutation and group starts: 16 (192 + 6 + 1) / (192 ctx) */
    kvq_bits b;
    ck_assert(kvq_eval_scheme_bits(&s, 2048, &hp, &b, &e) == KVQ_OK);
    double want = (133.0 * 16 + 1915.0 * 3) / 2048 + 16.0 * 199 / (192.0 * 2048);
    ck_assert_double_eq_tol(b.k, want, 1e-12);
    ck_assert_double_eq_tol(b.v, want, 1e-12);
    /* kvstat's resting keys: the sink and the last W exact, the rest quantized by the tables */
    ck_assert(kvq_eval_scheme_make("skvq2-w4+sink1", &x.set, &hp, &s, &e) == KVQ_OK);
    enum { T = 12, KVD = 192 };
    static float in[T * KVD], yq[T * KVD], r[KVD];
    for (int i = 0; i < T * KVD; i++) in[i] = sinf(0.37f * (float)i) * 3.0f * (1 + (float)(i % KVD % 5));
    kvq_quant_counts qc = {0};
    ck_assert(kvq_kv_desc_quantize(&s.desc, 7, 'v', yq, in, T, KVD, 64, &qc, &e) == KVQ_OK);
    ck_assert_uint_eq(n_bits_differ(yq, in, KVD), 0);
    for (int t = 1; t < T - 4; t++) {
        ref_quant(r, in + t * KVD, &x.a.v[7], 2);
        ck_assert_uint_eq(n_bits_differ(yq + t * KVD, r, KVD), 0);
    }
    ck_assert_uint_eq(n_bits_differ(yq + (T - 4) * KVD, in + (T - 4) * KVD, 4 * KVD), 0);
    ck_assert_uint_eq(qc.n_exact, 4 * KVD);
    ck_assert_uint_eq(qc.n_sink, KVD);
    /* teeth: the permutation matters (the identity order with the same group sizes quantizes differently) */
    {
        kvq_kv_table id = {0};
        uint32_t st0 = 1;
        sk_tables(&id, KVD, &st0, 0.97f);
        float *pm = (float *)kvq_kv_table_get(&id, "perm")->data;
        for (int c = 0; c < KVD; c++) pm[c] = (float)c;
        ref_quant(r, in + 3 * KVD, &id, 2);
        ck_assert_uint_gt(n_bits_differ(yq + 3 * KVD, r, KVD), 0);
        kvq_kv_table_free(&id);
    }
    /* the sink and the window must be shorter than the context, before any work */
    ck_assert(kvq_eval_scheme_make("skvq2-w507", &x.set, &hp, &s, &e) == KVQ_OK);
    ck_assert_int_ne(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 512, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "shorter than the context"), "%s", e.msg);
    ck_assert_int_eq(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 513, &e), KVQ_OK);
    /* bad specs */
    const struct { const char *spec, *needle; } bad[] = {
        {"skvq9", "bits: expected 1..8"},
        {"skvq2-w", "sliding window after -w"},
        {"skvq2-g32", "expected skvq<b>"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_ne(kvq_eval_scheme_make(bad[i].spec, &x.set, &hp, &s, &e), KVQ_OK);
        ck_assert_msg(strstr(e.msg, bad[i].needle), "%s: %s", bad[i].spec, e.msg);
    }
    /* bad tables, each named (the artifact validation a reader runs) */
    const kvq_family_artifact *fa = KVQ_FAM("skvq")->artifact;
    ck_assert(fa->check_tensors(&x.a.p, 0, 'k', &x.a.k[0], &e) == KVQ_OK);
    float *pm = (float *)kvq_kv_table_get(&x.a.k[0], "perm")->data, *gs = (float *)kvq_kv_table_get(&x.a.k[0], "group_start")->data,
          *cl = (float *)kvq_kv_table_get(&x.a.k[0], "clip")->data;
    float keep = pm[5];
    pm[5] = pm[6];
    ck_assert_int_ne(fa->check_tensors(&x.a.p, 0, 'k', &x.a.k[0], &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "layers.0.k.perm[6]") && strstr(e.msg, "permutation"), "%s", e.msg);
    pm[5] = keep;
    keep = gs[2];
    gs[2] = gs[1];
    ck_assert_int_ne(fa->check_tensors(&x.a.p, 0, 'k', &x.a.k[0], &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "layers.0.k.group_start[2]"), "%s", e.msg);
    gs[2] = keep;
    *cl = 1.5f;
    ck_assert_int_ne(fa->check_tensors(&x.a.p, 0, 'k', &x.a.k[0], &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "layers.0.k.clip"), "%s", e.msg);
    *cl = 0.93f;
    /* parameters */
    kvq_artifact_params p = x.a.p;
    p.x[0] = -0.1;
    ck_assert_int_ne(fa->check_params(&p, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "kvq.skvq.clip"), "%s", e.msg);
    p.x[0] = 0.95;
    p.group_size = 50;
    ck_assert_int_ne(fa->check_params(&p, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "G dividing"), "%s", e.msg);
    sk_art_free(&x);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("skvq");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_skvq_spec_bits);
    tcase_add_test(tc, test_skvq_decode_equivalence);
    tcase_add_test(tc, test_skvq_kvcalib_chain);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
