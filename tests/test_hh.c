/* test_hh.c — the heavy-hitter mixed-precision family (kernels/schemes/hh.c),
 * the first attention-aware family through the scheme seam:
 *  - decode equivalence: the batched window (a per-key schedule whose switch
 *    times are decided after every query row, kvq_attention_sched) equals an
 *    explicit token-by-token decode loop that keeps its own cache: per layer
 *    and KV head a class per token (exact / high / low), accumulated
 *    attention from the probabilities that very cache produced (the observe
 *    hook's attention statistics of each one-token step), the budget and the
 *    window rule written out again here; the same logits and NLLs bit for bit
 *    (batch-invariant GEMMs), on both tiny models (stories260K: GQA 2 query
 *    heads per KV head, head_dim 8; aidreams260K: head_dim 16), with sink
 *    tokens, int8 high precision and channel groups; the loop must see
 *    demotions and direct-to-low decisions, so a schedule that ignored
 *    attention (or read it from another cache) would not pass;
 *  - the schedule machinery: one representation equals kvq_attention, two
 *    with switch times taken from KIVI's boundaries equal the boundary form,
 *    bit for bit;
 *  - spec parsing, canonical names, bits (nominal by hand; realised from
 *    counts), kvstat's resting representation, no backward pass. */
#include <math.h>
#include <stdint.h>

#include "attention.h"
#include "backward.h"
#include "family.h"
#include "forward.h"
#include "kv_desc.h"
#include "kvq_test.h"
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

/* ---------------- the step-by-step reference cache ---------------- */

enum { C_EXACT = 0, C_HIGH = 1, C_LOW = 2 };

typedef struct {
    int L, H, hd, kvd, gs, N, step;
    int bits, hi_bits, group, W, ns;
    double f;
    float *ck, *cv;      /* [L][N][kvd] exact post-RoPE keys / values as appended */
    unsigned char *cls;  /* [L][H][N] */
    double *score;       /* [L][H][N] */
    int *heavy, *nh;     /* [L][H][N], [L][H] */
    float *mass;         /* [L][n_heads][N + 1]: the last step's attention probabilities */
    long demotions, direct_low;
} ref_cache;

/* one token's head h: its representation for class c */
static void ref_rep(const ref_cache *r, const float *x, float *y, int c, int h)
{
    kvq_err e = {0};
    const float *xh = x + (size_t)h * r->hd;
    float *yh = y + (size_t)h * r->hd;
    size_t g = r->group ? (size_t)r->group : (size_t)r->hd;
    if (c == C_EXACT) memcpy(yh, xh, (size_t)r->hd * sizeof(float));
    else if (c == C_HIGH && r->hi_bits == 16) kvq_quant_fp16(yh, xh, (size_t)r->hd, NULL);
    else ck_assert(kvq_quant_int_token(yh, xh, 1, (size_t)r->hd, g, c == C_HIGH ? 8 : r->bits, 0, NULL, &e) == KVQ_OK);
}

static kvq_status ref_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *e)
{
    (void)e;
    ref_cache *r = user;
    ck_assert_int_eq(c->T, 1);
    size_t off = ((size_t)c->layer * r->N + r->step) * r->kvd;
    memcpy(r->ck + off, o->k_att, (size_t)r->kvd * sizeof(float));
    memcpy(r->cv + off, o->v_att, (size_t)r->kvd * sizeof(float));
    int n = c->P + 1, nh = c->n_heads;
    ck_assert_ptr_nonnull(o->attn_mass);
    memcpy(r->mass + (size_t)c->layer * nh * (r->N + 1), o->attn_mass, (size_t)nh * n * sizeof(float));
    return KVQ_OK;
}

/* after step t has attended: accumulate, then the token leaving the window */
static void ref_after_step(ref_cache *r, int t, int n_heads)
{
    for (int l = 0; l < r->L; l++)
        for (int h = 0; h < r->H; h++) {
            double *sc = r->score + ((size_t)l * r->H + h) * r->N;
            unsigned char *cl = r->cls + ((size_t)l * r->H + h) * r->N;
            const float *m = r->mass + (size_t)l * n_heads * (r->N + 1);
            for (int j = 0; j <= t; j++) {
                double a = 0;
                for (int q = 0; q < r->gs; q++) a += m[(size_t)(h * r->gs + q) * (t + 1) + j];
                sc[j] += a;
            }
            int e = t + 1 - r->W;
            if (e < r->ns || e < 0) continue;
            int *hv = r->heavy + ((size_t)l * r->H + h) * r->N, *nh = &r->nh[l * r->H + h];
            int cap = (int)floor(r->f * (double)(t + 2) + 1e-9);
            if (*nh < cap) {
                hv[(*nh)++] = e;
                cl[e] = C_HIGH;
                continue;
            }
            int best = e, slot = -1;
            for (int k = 0; k < *nh; k++)
                if (sc[hv[k]] < sc[best] || (sc[hv[k]] == sc[best] && hv[k] < best)) {
                    best = hv[k];
                    slot = k;
                }
            if (slot < 0) {
                cl[e] = C_LOW;
                r->direct_low++;
            } else {
                cl[best] = C_LOW;
                hv[slot] = e;
                cl[e] = C_HIGH;
                r->demotions++;
            }
        }
}

/* the batched pass (as kveval runs it) against the decode loop */
static void hh_decode_case(const kvq_model *m, const char *spec, bool expect_demotions)
{
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make(spec, NULL, &m->hp, &s, &e) == KVQ_OK, "%s", e.msg);
    const int N = 48, V = m->hp.vocab_size, kvd = kvq_kv_dim(&m->hp), L = m->hp.n_layers, H = m->hp.n_kv_heads;
    int tok[48];
    make_tokens(tok, N, V, 4242);
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
    kvq_quant_counts kc = run.k_counts;

    /* decode loop */
    const kvq_scheme *q = &s.s.q;
    ref_cache r = {.L = L, .H = H, .hd = m->hp.head_dim, .kvd = kvd, .gs = m->hp.n_heads / H, .N = N, .bits = q->k_bits,
                   .hi_bits = (int)q->x[1], .group = (int)q->group, .W = (int)q->residual, .ns = (int)q->n_sink, .f = q->x[0]};
    size_t cn = (size_t)L * N * kvd;
    r.ck = calloc(cn, sizeof(float));
    r.cv = calloc(cn, sizeof(float));
    r.cls = calloc((size_t)L * H * N, 1);
    r.score = calloc((size_t)L * H * N, sizeof(double));
    r.heavy = calloc((size_t)L * H * N, sizeof(int));
    r.nh = calloc((size_t)L * H, sizeof(int));
    r.mass = calloc((size_t)L * m->hp.n_heads * (N + 1), sizeof(float));
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    kvq_hooks hd = {.user = &r, .observe = ref_observe, .attn_stats = true, .key_stage = KVQ_KEYS_POST_ROPE};
    double loss_d = 0;
    uint64_t want_high = 0, want_exact = 0;
    for (int t = 0; t < N; t++) {
        for (int l = 0; l < L; l++)
            for (int j = 0; j < t; j++)
                for (int h = 0; h < H; h++) {
                    size_t src = ((size_t)l * N + j) * kvd, dst = ((size_t)l * t + j) * kvd;
                    int c = r.cls[((size_t)l * H + h) * N + j];
                    ref_rep(&r, r.ck + src, pk + dst, c, h);
                    ref_rep(&r, r.cv + src, pv + dst, c, h);
                }
        kvq_prefix px = {.P = t, .k = pk, .v = pv};
        r.step = t;
        int tg = t + 1 < N ? tok[t + 1] : -1;
        kvq_fwd_io io1 = {.tokens = tok + t, .T = 1, .pos0 = t, .targets = &tg, .prefix = &px, .hooks = &hd,
                          .logits = ld + (size_t)t * V, .nll = nll_d + t};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &res, &e) == KVQ_OK, "%s", e.msg);
        if (t + 1 < N) loss_d += nll_d[t];
        if (t + 1 == N) /* the resting cache the last query read (before its own decisions): exact (window, sink) and high */
            for (int l = 0; l < L; l++)
                for (int h = 0; h < H; h++)
                    for (int j = r.ns; j < N; j++) {
                        int c = j > N - 1 - r.W ? C_EXACT : r.cls[((size_t)l * H + h) * N + j];
                        if (c == C_EXACT) want_exact += (uint64_t)r.hd;
                        if (c == C_HIGH) want_high += (uint64_t)r.hd;
                    }
        ref_after_step(&r, t, m->hp.n_heads);
    }
    loss_d /= N - 1;
    size_t logit_diff = n_bits_differ(lb, ld, (size_t)N * V);
    int first_div = -1;
    for (int t = 0; t + 1 < N && first_div < 0; t++)
        if (memcmp(&nll_b[t], &nll_d[t], sizeof(double))) first_div = t;

    /* teeth: against fp32 the scheme matters */
    kvq_fwd_io io0 = {.tokens = tok, .T = N};
    ck_assert(kvq_forward_run(&fw, &io0, &res, &e) == KVQ_OK);
    double d_fp32 = fabs(res.loss - loss_d) / loss_d;
    fprintf(stderr, "INFO hh decode %-28s %s: batched %.9f decode %.9f, %zu logits differ, first NLL difference at %d; "
                    "%ld demotions, %ld straight to low; vs fp32 %.2e\n",
            s.name, m->path, loss_b, loss_d, logit_diff, first_div, r.demotions, r.direct_low, d_fp32);
    ck_assert_msg(logit_diff == 0 && first_div < 0 && fabs(loss_b - loss_d) <= 1e-12 * loss_d,
                  "%s: batched %.12g vs decode %.12g, %zu logits differ, first NLL difference at %d", s.name, loss_b, loss_d,
                  logit_diff, first_div);
    ck_assert_msg(d_fp32 > 1e-4, "%s barely changes the loss (%.2e)", s.name, d_fp32);
    if (expect_demotions) ck_assert_msg(r.demotions > 0 && r.direct_low > 0, "%s: the policy never had to choose", s.name);
    ck_assert_uint_eq(kc.n_high, want_high);
    ck_assert_uint_eq(kc.n_exact, want_exact);
    ck_assert_uint_eq(kc.n_elems, (uint64_t)L * N * kvd);
    ck_assert_uint_eq(kc.n_sink, (uint64_t)L * r.ns * kvd);
    free(pk);
    free(pv);
    free(r.ck);
    free(r.cv);
    free(r.cls);
    free(r.score);
    free(r.heavy);
    free(r.nh);
    free(r.mass);
    free(lb);
    free(ld);
    kvq_forward_free(&fw);
}

START_TEST(test_hh_decode_equivalence)
{
    char buf[4096];
    const char *specs[] = {"hh2-25%-w8", "hh3-i8-30%-w4-g4+sink2", "hh2-10%-w3+sink1"};
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        const char *p = kvq_test_shared(buf, sizeof buf, models[mi]);
        KVQ_SKIP_IF(!p, "../shared/models/llama2c tiny models absent");
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
        for (size_t i = 0; i < sizeof specs / sizeof *specs; i++) {
            if (mi == 0 && i == 1) continue; /* -g4 needs head_dim 16 */
            hh_decode_case(&m, specs[i], true);
        }
        kvq_model_free(&m);
    }
}
END_TEST

/* ---------------- the schedule machinery against kvq_attention ---------------- */

START_TEST(test_sched_equals_attention)
{
    enum { T = 37, P = 3, NH = 6, NKV = 2, HD = 16 };
    const size_t qn = (size_t)T * NH * HD, kn = (size_t)T * NKV * HD, pn = (size_t)P * NKV * HD;
    float *q = malloc(qn * sizeof(float)), *k = malloc(kn * sizeof(float)), *v = malloc(kn * sizeof(float));
    float *kq = malloc(kn * sizeof(float)), *vq = malloc(kn * sizeof(float)), *pk = malloc(pn * sizeof(float)),
          *pv = malloc(pn * sizeof(float));
    float *o1 = malloc(qn * sizeof(float)), *o2 = malloc(qn * sizeof(float));
    float m1[NH * (P + T)], m2[NH * (P + T)], e1[NH * T], e2[NH * T];
    uint32_t s = 7;
    float *all[] = {q, k, v, kq, vq, pk, pv};
    size_t ns[] = {qn, kn, kn, kn, kn, pn, pn};
    for (int a = 0; a < 7; a++)
        for (size_t i = 0; i < ns[a]; i++) {
            s = s * 1664525u + 1013904223u;
            all[a][i] = (float)((int)(s >> 9) % 2001 - 1000) / 300.0f;
        }
    kvq_err e = {0};
    kvq_attn_ws ws;
    ck_assert(kvq_attn_ws_init(&ws, T, P, NKV, HD, 2, &e) == KVQ_OK);
    /* one representation */
    kvq_attn_args a = {.T = T, .P = P, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD, .q = q, .k = k, .v = v, .pk = pk, .pv = pv,
                       .out = o1, .mass = m1, .entropy = e1};
    ck_assert(kvq_attention(&a, &ws, &e) == KVQ_OK);
    kvq_kv_sched sc = {.n_k = 1, .n_v = 1, .k = {k}, .v = {v}};
    kvq_attn_args b = {.T = T, .P = P, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD, .q = q, .pk = pk, .pv = pv, .out = o2,
                       .mass = m2, .entropy = e2};
    ck_assert_msg(kvq_attention_sched(&b, &sc, 0, 2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(n_bits_differ(o1, o2, qn), 0);
    ck_assert_uint_eq(n_bits_differ(m1, m2, NH * (P + T)), 0);
    ck_assert_uint_eq(n_bits_differ(e1, e2, NH * T), 0);
    /* two representations, switch times from KIVI-style boundaries: key j is read as the alternative by queries i with
     * j < kb[i], i.e. from the first such i on */
    int kb[T], vb[T], from[2][NKV][T];
    for (int i = 0; i < T; i++) {
        kb[i] = i < 5 ? 0 : (i / 4) * 4;
        vb[i] = i > 6 ? i - 6 : 0;
    }
    for (int w = 0; w < 2; w++)
        for (int j = 0; j < T; j++) {
            int f = T;
            for (int i = T - 1; i >= 0; i--)
                if (j < (w ? vb[i] : kb[i])) f = i;
            for (int h = 0; h < NKV; h++) from[w][h][j] = f;
        }
    kvq_attn_args a2 = a;
    a2.kq = kq;
    a2.kb = kb;
    a2.vq = vq;
    a2.vb = vb;
    ck_assert(kvq_attention(&a2, &ws, &e) == KVQ_OK);
    kvq_kv_sched sc2 = {.n_k = 2, .n_v = 2, .k = {k, kq}, .v = {v, vq}, .k_from = &from[0][0][0], .v_from = &from[1][0][0]};
    ck_assert_msg(kvq_attention_sched(&b, &sc2, 0, 1, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(n_bits_differ(o1, o2, qn), 0);
    ck_assert_uint_eq(n_bits_differ(m1, m2, NH * (P + T)), 0);
    /* teeth: the same schedule with one key switched later differs */
    from[0][1][3] = T;
    ck_assert(kvq_attention_sched(&b, &sc2, 0, 1, &e) == KVQ_OK);
    ck_assert_uint_gt(n_bits_differ(o1, o2, qn), 0);
    /* a schedule that goes back to an earlier representation is refused */
    kvq_kv_sched sc3 = {.n_k = 3, .n_v = 1, .k = {k, kq, k}, .v = {v}, .k_from = malloc(2 * NKV * T * sizeof(int))};
    for (int x = 0; x < NKV * T; x++) {
        sc3.k_from[x] = 10;
        sc3.k_from[NKV * T + x] = 5;
    }
    ck_assert_int_eq(kvq_attention_sched(&b, &sc3, 0, 1, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "switches to representation 2"), "%s", e.msg);
    free(sc3.k_from);
    kvq_attn_ws_free(&ws);
    for (int i = 0; i < 7; i++) free(all[i]);
    free(o1);
    free(o2);
}
END_TEST

/* ---------------- spec, bits, kvstat, backward ---------------- */

START_TEST(test_hh_spec_bits)
{
    kvq_hparams hp = {.n_layers = 30, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                      .vocab_size = 49152, .ctx_len = 8192, .rope_dim = 64, .rope_theta = 100000, .norm_eps = 1e-5f};
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("hh2", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "hh2-20%-w32");
    ck_assert_msg(kvq_eval_scheme_make("hh3-i8-12.5%-w64-g32+sink1", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "hh3-i8-12.5%-w64-g32+sink1");
    ck_assert_int_eq(kvq_eval_scheme_code_bits(&s, 'k'), 3);
    /* nominal bits at ctx 2048: 1 sink + 64 window exact (16), floor(0.125 * 2048) = 256 heavy at 8 + 32/32
     * plus a 16-bit index per head (16/64), the rest (1727) at 3 + 32/32 */
    kvq_bits b;
    ck_assert(kvq_eval_scheme_bits(&s, 2048, &hp, &b, &e) == KVQ_OK);
    double want = (65.0 * 16 + 256.0 * (9 + 0.25) + 1727.0 * 4) / 2048;
    ck_assert_double_eq_tol(b.k, want, 1e-12);
    ck_assert_double_eq_tol(b.v, want, 1e-12);
    /* realised: of the 700 elements outside sink and window a run kept 100 high: that share of the 1983 tokens
     * outside the 65 exact ones */
    kvq_quant_counts c = {.n_elems = 1000, .n_sink = 100, .n_exact = 200, .n_high = 100};
    ck_assert(kvq_eval_scheme_bits_run(&s, 2048, &hp, &c, &c, &b, &e) == KVQ_OK);
    double fh = 100.0 / 700 * 1983 / 2048;
    ck_assert_double_eq_tol(b.k, 65.0 / 2048 * 16 + fh * 9.25 + (1 - 65.0 / 2048 - fh) * 4, 1e-12);
    /* bad specs name the part */
    const struct { const char *spec, *needle; } bad[] = {
        {"hh9", "bits: expected 1..8"},
        {"hh2-0%", "heavy-hitter budget"},
        {"hh2-101%", "heavy-hitter budget"},
        {"hh2-w0", "recent window"},
        {"hh2-x", "expected hh<b>"},
        {"hh2-g48", "does not divide head_dim 64"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_ne(kvq_eval_scheme_make(bad[i].spec, NULL, &hp, &s, &e), KVQ_OK);
        ck_assert_msg(strstr(e.msg, bad[i].needle), "%s: %s", bad[i].spec, e.msg);
    }
    /* kvstat's resting representation: sink and the last W tokens exact, the rest at the low precision */
    ck_assert(kvq_eval_scheme_make("hh2-w4+sink1", NULL, &hp, &s, &e) == KVQ_OK);
    enum { T = 12, KVD = 192 };
    static float x[T * KVD], y[T * KVD], lo[T * KVD];
    for (int i = 0; i < T * KVD; i++) x[i] = sinf(0.37f * (float)i) * 3.0f;
    kvq_quant_counts qc = {0};
    ck_assert(kvq_kv_desc_quantize(&s.desc, 0, 'k', y, x, T, KVD, 64, &qc, &e) == KVQ_OK);
    ck_assert(kvq_quant_int_token(lo, x, T, KVD, 64, 2, 0, NULL, &e) == KVQ_OK);
    ck_assert_uint_eq(n_bits_differ(y, x, KVD), 0);
    ck_assert_uint_eq(n_bits_differ(y + KVD, lo + KVD, (T - 5) * KVD), 0);
    ck_assert_uint_eq(n_bits_differ(y + (T - 4) * KVD, x + (T - 4) * KVD, 4 * KVD), 0);
    ck_assert_uint_eq(qc.n_exact, 4 * KVD);
    ck_assert_uint_eq(qc.n_sink, KVD);
}
END_TEST

START_TEST(test_hh_no_backward)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/aidreams260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c/aidreams260K.bin absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert(kvq_model_load(p, &m, &e) == KVQ_OK);
    kvq_eval_scheme s;
    ck_assert(kvq_eval_scheme_make("hh2-w4", NULL, &m.hp, &s, &e) == KVQ_OK);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, 16, 0, KVQ_FWD_SAVE_ACTIVATIONS, &e) == KVQ_OK);
    int tok[16];
    make_tokens(tok, 16, m.hp.vocab_size, 5);
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &s, &hk);
    kvq_fwd_io io = {.tokens = tok, .T = 16, .hooks = &hk};
    kvq_fwd_result r;
    ck_assert_int_eq(kvq_forward_run(&fw, &io, &r, &e), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(e.msg, "no backward pass"), "%s", e.msg);
    kvq_scheme_run_free(&run);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("hh");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_sched_equals_attention);
    tcase_add_test(tc, test_hh_spec_bits);
    tcase_add_test(tc, test_hh_decode_equivalence);
    tcase_add_test(tc, test_hh_no_backward);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
