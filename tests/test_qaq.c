/* test_qaq.c — QAQ (kernels/schemes/qaq.c, arXiv 2403.04643 §4):
 *  - decode equivalence: the batched window (the selection form of kvq_kv_sched: every (KV head, token)
 *    re-decided after every query row, widths that fall and rise) equals an explicit token-by-token decode
 *    loop that keeps its own cache: the exact K/V as appended, per layer, KV head and token a key and a
 *    value width, the attention of each one-token step (the observe hook's statistics), the window max,
 *    the §4.1 width formulas and the midpoint quantizer with per-token outliers written out again here;
 *    the same logits and NLLs bit for bit on both tiny models (stories260K: GQA, head_dim 8; aidreams260K:
 *    head_dim 16), with a sink token and a window of 1 and 3; the loop must see widths fall and rise (an
 *    exception re-quantized from the exact copy) and more than one width, and the run's realised counts
 *    (exact, outliers, code bits of the last query's cache) equal the loop's;
 *  - kvdump --q -> kvcalib --method qaq on aidreams260K: qnorm2 per (layer, KV head) equals the 0.9
 *    quantile (nearest rank) of ||q||^2 over the dump's queries of the group, computed here from the dump;
 *    the artifact binds a spec without -q and kvstat's keys take that layer's table in the width formula;
 *    a dump without queries is refused naming kvdump --q;
 *  - the selection form against the switch-time form (bit for bit) and its refusal of a bad index;
 *  - spec parsing, canonical names, refusals before any work (budgets, widths, the window against the
 *    context), bits from counts by hand, kvstat's resting representation. */
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "attention.h"
#include "calibrate.h"
#include "capture.h"
#include "dump.h"
#include "family.h"
#include "forward.h"
#include "identity.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "scheme.h"

static void make_tokens(int *tok, int n, int V, uint32_t seed)
{
    uint32_t x = seed;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        tok[i] = 1 + (int)((x >> 8) % (uint32_t)(V - 1));
    }
}

static size_t n_bits_differ(const float *a, const float *b, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return c;
}

/* ---------------- the step-by-step reference cache ---------------- */

typedef struct {
    int L, H, hd, kvd, gs, N, step, W, ns, lo, hi;
    double ks, vs, q2, f;
    float *ck, *cv;       /* [L][N][kvd] exact post-RoPE keys / values as appended */
    signed char *wk, *wv; /* [L][H][N]: the width each token holds now, -1 exact */
    float *ring;          /* [L][H][N steps][N tokens]: a[i][j] */
    float *mass;          /* [L][n_heads][N + 1]: the last step's probabilities */
    long rises, falls, widths_seen[9];
} ref_cache;

/* one token row x[kvd] of a side at width w per head (w[h] < 0: exact): outliers beyond the (k+1)-th
 * smallest / largest of the row exact (kvq_token_range), each head's dense [min, max] as fp16, 2^w equal
 * segments, values to their midpoints */
static void ref_quant_row(const ref_cache *r, const float *x, const signed char *w, float *y, uint64_t *n_out)
{
    size_t k = kvq_outliers_per_side((size_t)r->kvd, r->f);
    float tl = -INFINITY, th = INFINITY, scr[256];
    ck_assert_int_le(r->kvd, 256);
    if (k) kvq_token_range(x, (size_t)r->kvd, k, scr, &tl, &th);
    for (int h = 0; h < r->H; h++) {
        const float *xh = x + h * r->hd;
        float *yh = y + h * r->hd;
        if (w[h] < 0) {
            memcpy(yh, xh, (size_t)r->hd * sizeof(float));
            continue;
        }
        float mn = INFINITY, mx = -INFINITY;
        for (int d = 0; d < r->hd; d++)
            if (!(xh[d] < tl || xh[d] > th)) {
                mn = fminf(mn, xh[d]);
                mx = fmaxf(mx, xh[d]);
            }
        if (mn > mx) mn = mx = 0;
        double a = kvq_round_fp16(mn), b = kvq_round_fp16(mx), levels = pow(2.0, w[h]), step = (b - a) / levels;
        for (int d = 0; d < r->hd; d++) {
            if (xh[d] < tl || xh[d] > th) {
                yh[d] = xh[d];
                if (n_out) (*n_out)++;
                continue;
            }
            double s = step > 0 ? floor((xh[d] - a) / step) : 0;
            s = s < 0 ? 0 : s > levels - 1 ? levels - 1 : s;
            yh[d] = (float)(a + (s + 0.5) * step);
        }
    }
}

/* the width of a token with dense range `range`: the least b in [lo, hi] whose quantizer's std
 * (2^-b range / (2 sqrt 3)) meets the bound sigma (× S sqrt(T) folded in by the caller for values) */
static int ref_width(const ref_cache *r, double lhs, double unit)
{
    for (int b = r->lo; b < r->hi; b++)
        if (lhs <= ldexp(unit, b)) return b;
    return r->hi;
}

static kvq_status ref_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *e)
{
    (void)e;
    ref_cache *r = user;
    ck_assert_int_eq(c->T, 1);
    size_t off = ((size_t)c->layer * r->N + r->step) * r->kvd;
    memcpy(r->ck + off, o->k_att, (size_t)r->kvd * sizeof(float));
    memcpy(r->cv + off, o->v_att, (size_t)r->kvd * sizeof(float));
    ck_assert_ptr_nonnull(o->attn_mass);
    memcpy(r->mass + (size_t)c->layer * c->n_heads * (r->N + 1), o->attn_mass, (size_t)c->n_heads * (c->P + 1) * sizeof(float));
    return KVQ_OK;
}

/* after step t: the window max of each token's scores, then its widths for step t + 1 */
static void ref_after_step(ref_cache *r, int t, int n_heads)
{
    const double Tn = t + 2.0, c23 = 2 * sqrt(3.0);
    for (int l = 0; l < r->L; l++) {
        const float *m = r->mass + (size_t)l * n_heads * (r->N + 1);
        for (int h = 0; h < r->H; h++) {
            float *ring = r->ring + ((size_t)l * r->H + h) * r->N * r->N;
            for (int j = 0; j <= t; j++) {
                float a = 0;
                for (int q = 0; q < r->gs; q++) a = fmaxf(a, m[(size_t)(h * r->gs + q) * (t + 1) + j]);
                ring[(size_t)t * r->N + j] = a;
            }
            /* sigma_K^2 <= log(T^3 / (T - 1) sigma_S^2 + 1) / (||q||^2 / head_dim) */
            double sk = sqrt(log(Tn * Tn * Tn / (Tn - 1) * r->ks * r->ks + 1) / (r->q2 / r->hd));
            for (int j = r->ns; j <= t; j++) {
                signed char *pk = &r->wk[((size_t)l * r->H + h) * r->N + j], *pv = &r->wv[((size_t)l * r->H + h) * r->N + j];
                signed char nk = (signed char)r->hi, nv = (signed char)r->hi;
                if (t - j + 1 >= r->W) {
                    float s = 0;
                    for (int i = t - r->W + 1; i <= t; i++) s = fmaxf(s, ring[(size_t)i * r->N + j]);
                    /* the dense ranges, recomputed from the exact rows */
                    float rng[2];
                    for (int side = 0; side < 2; side++) {
                        const float *x = (side ? r->cv : r->ck) + ((size_t)l * r->N + j) * r->kvd;
                        size_t k = kvq_outliers_per_side((size_t)r->kvd, r->f);
                        float tl = -INFINITY, th = INFINITY, scr[256];
                        if (k) kvq_token_range(x, (size_t)r->kvd, k, scr, &tl, &th);
                        float mn = INFINITY, mx = -INFINITY;
                        for (int d = h * r->hd; d < (h + 1) * r->hd; d++)
                            if (!(x[d] < tl || x[d] > th)) {
                                mn = fminf(mn, x[d]);
                                mx = fmaxf(mx, x[d]);
                            }
                        if (mn > mx) mn = mx = 0;
                        rng[side] = kvq_round_fp16(mx) - kvq_round_fp16(mn);
                    }
                    nk = (signed char)ref_width(r, (double)rng[0], c23 * sk);
                    nv = (signed char)ref_width(r, (double)rng[1] * (double)s * sqrt(Tn), c23 * r->vs);
                }
                for (int side = 0; side < 2; side++) {
                    signed char *p = side ? pv : pk, n = side ? nv : nk;
                    if (*p >= 0 && n > *p) r->rises++;
                    if (*p >= 0 && n < *p) r->falls++;
                    *p = n;
                    r->widths_seen[(int)n]++;
                }
            }
        }
    }
}

/* the batched pass (as kveval runs it) against the decode loop */
static void qaq_decode_case(const kvq_model *m, const char *spec)
{
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make(spec, NULL, &m->hp, &s, &e) == KVQ_OK, "%s", e.msg);
    const int N = 40, V = m->hp.vocab_size, kvd = kvq_kv_dim(&m->hp), L = m->hp.n_layers, H = m->hp.n_kv_heads, nh = m->hp.n_heads;
    int tok[40];
    make_tokens(tok, N, V, 4242);
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, m, N, N, KVQ_FWD_ROW_INVARIANT, &e) == KVQ_OK);
    float *lb = malloc((size_t)N * V * sizeof(float)), *ld = malloc((size_t)N * V * sizeof(float));
    double nll_b[40], nll_d[40];
    kvq_scheme_run run;
    kvq_hooks hk;
    kvq_scheme_hooks(&run, &s, &hk);
    kvq_fwd_io io = {.tokens = tok, .T = N, .hooks = &hk, .logits = lb, .nll = nll_b};
    kvq_fwd_result res;
    ck_assert_msg(kvq_forward_run(&fw, &io, &res, &e) == KVQ_OK, "%s", e.msg);
    double loss_b = res.loss;
    kvq_scheme_run_free(&run);
    kvq_quant_counts kc = run.k_counts, vc = run.v_counts;

    const kvq_scheme *q = &s.s.q; /* qaq.c: x = {sigma_S, sigma_X, ||q||^2, L}, k_bits = H, residual = N */
    ref_cache r = {.L = L, .H = H, .hd = m->hp.head_dim, .kvd = kvd, .gs = nh / H, .N = N, .W = (int)q->residual,
                   .ns = (int)q->n_sink, .lo = (int)q->x[3], .hi = q->k_bits, .ks = q->x[0], .vs = q->x[1], .q2 = q->x[2],
                   .f = q->outlier_frac};
    size_t cn = (size_t)L * N * kvd;
    r.ck = calloc(cn, sizeof(float));
    r.cv = calloc(cn, sizeof(float));
    r.wk = malloc((size_t)L * H * N);
    r.wv = malloc((size_t)L * H * N);
    memset(r.wk, -1, (size_t)L * H * N);
    memset(r.wv, -1, (size_t)L * H * N);
    r.ring = calloc((size_t)L * H * N * N, sizeof(float));
    r.mass = calloc((size_t)L * nh * (N + 1), sizeof(float));
    float *pk = malloc(cn * sizeof(float)), *pv = malloc(cn * sizeof(float));
    kvq_hooks hd = {.user = &r, .observe = ref_observe, .attn_stats = true, .key_stage = KVQ_KEYS_POST_ROPE};
    double loss_d = 0;
    uint64_t want[2][3] = {{0}}; /* exact, outliers, code bits */
    for (int t = 0; t < N; t++) {
        for (int l = 0; l < L; l++)
            for (int j = 0; j < t; j++) {
                size_t src = ((size_t)l * N + j) * kvd, dst = ((size_t)l * t + j) * kvd;
                signed char w[2][64];
                ck_assert_int_le(H, 64);
                for (int h = 0; h < H; h++) {
                    w[0][h] = r.wk[((size_t)l * H + h) * N + j];
                    w[1][h] = r.wv[((size_t)l * H + h) * N + j];
                }
                ref_quant_row(&r, r.ck + src, w[0], pk + dst, NULL);
                ref_quant_row(&r, r.cv + src, w[1], pv + dst, NULL);
            }
        kvq_prefix px = {.P = t, .k = pk, .v = pv};
        r.step = t;
        int tg = t + 1 < N ? tok[t + 1] : -1;
        kvq_fwd_io io1 = {.tokens = tok + t, .T = 1, .pos0 = t, .targets = &tg, .prefix = &px, .hooks = &hd,
                          .logits = ld + (size_t)t * V, .nll = nll_d + t};
        ck_assert_msg(kvq_forward_run(&fw, &io1, &res, &e) == KVQ_OK, "%s", e.msg);
        if (t + 1 < N) loss_d += nll_d[t];
        if (t + 1 == N) /* the resting cache the last query read: exact tokens, outliers and code bits of the rest */
            for (int l = 0; l < L; l++)
                for (int j = r.ns; j < N; j++)
                    for (int side = 0; side < 2; side++) {
                        const signed char *wa = side ? r.wv : r.wk;
                        signed char w[64];
                        for (int h = 0; h < H; h++) {
                            w[h] = wa[((size_t)l * H + h) * N + j];
                            if (w[h] < 0) want[side][0] += (uint64_t)r.hd;
                            else want[side][2] += (uint64_t)w[h] * r.hd;
                        }
                        float y[256];
                        ref_quant_row(&r, (side ? r.cv : r.ck) + ((size_t)l * N + j) * kvd, w, y, &want[side][1]);
                    }
        ref_after_step(&r, t, nh);
    }
    loss_d /= N - 1;
    size_t logit_diff = n_bits_differ(lb, ld, (size_t)N * V);
    int first_div = -1;
    for (int t = 0; t + 1 < N && first_div < 0; t++)
        if (memcmp(&nll_b[t], &nll_d[t], sizeof(double))) first_div = t;
    kvq_fwd_io io0 = {.tokens = tok, .T = N};
    ck_assert(kvq_forward_run(&fw, &io0, &res, &e) == KVQ_OK);
    double d_fp32 = fabs(res.loss - loss_d) / loss_d;
    int n_widths = 0;
    for (int b = 0; b <= 8; b++) n_widths += r.widths_seen[b] > 0;
    fprintf(stderr, "INFO qaq decode %-40s %s: batched %.9f decode %.9f, %zu logits differ, first NLL difference at %d; "
                    "%ld rises, %ld falls, %d widths; vs fp32 %.2e\n",
            s.name, m->path, loss_b, loss_d, logit_diff, first_div, r.rises, r.falls, n_widths, d_fp32);
    ck_assert_msg(logit_diff == 0 && first_div < 0 && loss_b == loss_d, "%s: batched %.12g vs decode %.12g, %zu logits differ, first NLL "
                  "difference at %d", s.name, loss_b, loss_d, logit_diff, first_div);
    ck_assert_msg(d_fp32 > 1e-4, "%s barely changes the loss (%.2e)", s.name, d_fp32);
    ck_assert_msg(r.rises > 0 && r.falls > 0 && n_widths > 1, "%s: the policy never re-decided (%ld rises, %ld falls, %d widths)", s.name,
                  r.rises, r.falls, n_widths);
    const kvq_quant_counts *got[2] = {&kc, &vc};
    for (int side = 0; side < 2; side++) {
        ck_assert_uint_eq(got[side]->n_elems, (uint64_t)L * N * kvd);
        ck_assert_uint_eq(got[side]->n_sink, (uint64_t)L * r.ns * kvd);
        ck_assert_uint_eq(got[side]->n_exact, want[side][0]);
        ck_assert_uint_eq(got[side]->n_outliers, want[side][1]);
        ck_assert_uint_eq(got[side]->n_code_bits, want[side][2]);
    }
    free(pk);
    free(pv);
    free(r.ck);
    free(r.cv);
    free(r.wk);
    free(r.wv);
    free(r.ring);
    free(r.mass);
    free(lb);
    free(ld);
    kvq_forward_free(&fw);
}

START_TEST(test_qaq_decode_equivalence)
{
    char buf[4096];
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    const char *specs[2][2] = {{"qaq-k0.01-v0.02-o2%-w3-l1-h6-q40", "qaq-k0.003-v0.01-w1-l0-h5-q40+sink1"},
                               {"qaq-k0.01-v0.02-o2%-w3-l1-h6-q60", "qaq-k0.003-v0.01-w1-l0-h5-q60+sink1"}};
    for (int mi = 0; mi < 2; mi++) {
        const char *p = kvq_test_shared(buf, sizeof buf, models[mi]);
        KVQ_SKIP_IF(!p, "../shared/models/llama2c tiny models absent");
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
        for (int i = 0; i < 2; i++) qaq_decode_case(&m, specs[mi][i]);
        kvq_model_free(&m);
    }
}
END_TEST

/* the selection form: every key at representation 1 from the start equals the switch-time form with
 * every switch at step 0; an index out of range is refused */
START_TEST(test_qaq_selection_form)
{
    enum { T = 9, P = 2, NH = 4, NKV = 2, HD = 8 };
    const size_t qn = (size_t)T * NH * HD, kn = (size_t)T * NKV * HD, pn = (size_t)P * NKV * HD;
    float *q = malloc(qn * sizeof(float)), *k = malloc(kn * sizeof(float)), *v = malloc(kn * sizeof(float)),
          *kq = malloc(kn * sizeof(float)), *vq = malloc(kn * sizeof(float)), *pk = malloc(pn * sizeof(float)),
          *pv = malloc(pn * sizeof(float)), *o1 = malloc(qn * sizeof(float)), *o2 = malloc(qn * sizeof(float));
    for (size_t i = 0; i < qn; i++) q[i] = sinf(0.7f * (float)i);
    for (size_t i = 0; i < kn; i++) {
        k[i] = cosf(0.3f * (float)i);
        v[i] = sinf(0.11f * (float)i + 1);
        kq[i] = roundf(k[i] * 4) / 4;
        vq[i] = roundf(v[i] * 4) / 4;
    }
    for (size_t i = 0; i < pn; i++) {
        pk[i] = cosf(0.9f * (float)i);
        pv[i] = sinf(0.5f * (float)i);
    }
    kvq_err e = {0};
    kvq_attn_args a = {.T = T, .P = P, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD, .q = q, .pk = pk, .pv = pv, .out = o1};
    int from[NKV * T];
    for (int x = 0; x < NKV * T; x++) from[x] = 0;
    from[T + 4] = 6; /* KV head 1, token 4: from step 6 */
    kvq_kv_sched s1 = {.n_k = 2, .n_v = 2, .k = {k, kq}, .v = {v, vq}, .k_from = from, .v_from = from};
    ck_assert_msg(kvq_attention_sched(&a, &s1, 0, 1, &e) == KVQ_OK, "%s", e.msg);
    signed char sel[NKV * T];
    memset(sel, 1, sizeof sel);
    sel[T + 4] = 0;
    kvq_kv_sched s2 = {.n_k = 3, .n_v = 2, .k = {k, kq, k}, .v = {v, vq}, .k_sel = sel, .v_sel = sel};
    a.out = o2;
    ck_assert_msg(kvq_attention_sched(&a, &s2, 0, 1, &e) == KVQ_OK, "%s", e.msg);
    /* KV head 0 (query heads 0, 1) reads the same everywhere; KV head 1 (query heads 2, 3) until step 6, where
     * s1 switches token 4 to the quantized copy and s2 keeps it exact */
    for (int i = 0; i < T; i++)
        ck_assert_uint_eq(n_bits_differ(o1 + (size_t)i * NH * HD, o2 + (size_t)i * NH * HD, 2 * HD), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_uint_eq(n_bits_differ(o1 + ((size_t)i * NH + 2) * HD, o2 + ((size_t)i * NH + 2) * HD, 2 * HD), 0);
    size_t diff2 = n_bits_differ(o1 + ((size_t)6 * NH + 2) * HD, o2 + ((size_t)6 * NH + 2) * HD, 2 * HD);
    ck_assert_uint_gt(diff2, 0); /* step 6: s1 switched, s2 did not */
    sel[3] = 3;
    ck_assert_int_eq(kvq_attention_sched(&a, &s2, 0, 1, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "selects representation 3"), "%s", e.msg);
    free(q);
    free(k);
    free(v);
    free(kq);
    free(vq);
    free(pk);
    free(pv);
    free(o1);
    free(o2);
}
END_TEST

/* ---------------- spec, refusals, bits, kvstat ---------------- */

START_TEST(test_qaq_spec_bits)
{
    kvq_hparams hp = {.n_layers = 30, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                      .vocab_size = 49152, .ctx_len = 8192, .rope_dim = 64, .rope_theta = 100000, .norm_eps = 1e-5f};
    kvq_err e = {0};
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("qaq-k0.001-v0.1-q300", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "qaq-k0.001-v0.1-o1%-w5-l1-h8-q300");
    ck_assert(!s.desc.q.fam->needs_artifact(&s.desc.q));
    ck_assert_msg(kvq_eval_scheme_make("qaq-k0.5-v2-o0%-w1-l0-h4-q12.5+sink1", NULL, &hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(s.name, "qaq-k0.5-v2-o0%-w1-l0-h4-q12.5+sink1");
    /* without -q it needs the artifact */
    ck_assert_int_ne(kvq_eval_scheme_make("qaq-k0.001-v0.1", NULL, &hp, &s, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "method qaq"), "%s", e.msg);
    /* realised bits: 100 sink + 200 exact elements of 1000 at 16; the 700 others cost their code bits (2100),
     * 4 outliers at 32 and 36 / 64 per element of metadata */
    ck_assert(kvq_eval_scheme_make("qaq-k0.001-v0.1-q300", NULL, &hp, &s, &e) == KVQ_OK);
    kvq_quant_counts c = {.n_elems = 1000, .n_sink = 100, .n_exact = 200, .n_outliers = 4, .n_code_bits = 2100};
    kvq_bits b;
    ck_assert(kvq_eval_scheme_bits_run(&s, 2048, &hp, &c, &c, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, (300.0 * 16 + 2100 + 4 * 32 + 700 * 36.0 / 64) / 1000, 1e-12);
    ck_assert_double_eq_tol(b.v, b.k, 1e-12);
    /* nominal: every token at H = 8 bits + 36/64 + 2 outliers per 192-value row at 32 */
    ck_assert(kvq_eval_scheme_bits(&s, 2048, &hp, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 8 + 36.0 / 64 + 64.0 / 192, 1e-12);
    /* refusals name the rule */
    const struct { const char *spec, *needle; } bad[] = {
        {"qaq-k0-v0.1-q1", "key budget"},
        {"qaq-k0.1-v0-q1", "value budget"},
        {"qaq-k0.1-q1", "expected qaq-k<Ks>-v<Vs>"},
        {"qaq-k0.1-v0.1-o50%-q1", "outliers after -o"},
        {"qaq-k0.1-v0.1-w0-q1", "attention window"},
        {"qaq-k0.1-v0.1-l5-h4-q1", "L = 5"},
        {"qaq-k0.1-v0.1-h9-q1", "highest width"},
        {"qaq-k0.1-v0.1-q0", "query norm"},
        {"qaq-k0.1-v0.1-q1-x", "expected qaq-k<Ks>-v<Vs>"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_ne(kvq_eval_scheme_make(bad[i].spec, NULL, &hp, &s, &e), KVQ_OK);
        ck_assert_msg(strstr(e.msg, bad[i].needle), "%s: %s", bad[i].spec, e.msg);
    }
    /* the window against the context (kveval's check before any work) */
    ck_assert(kvq_eval_scheme_make("qaq-k0.1-v0.1-w16-q1+sink1", NULL, &hp, &s, &e) == KVQ_OK);
    ck_assert_int_eq(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 17, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "attention window (16)"), "%s", e.msg);
    ck_assert_int_eq(s.desc.q.fam->check_ctx(&s.desc.q, s.name, 18, &e), KVQ_OK);

    /* kvstat's resting representation: the sink exact, the last N - 1 tokens at H bits, the others keys at
     * the formula's width for the window (here a huge budget: L bits) */
    ck_assert(kvq_eval_scheme_make("qaq-k100-v100-o0%-w4-l2-h6-q1+sink1", NULL, &hp, &s, &e) == KVQ_OK);
    enum { T = 12, KVD = 192 };
    static float x[T * KVD], y[T * KVD];
    for (int i = 0; i < T * KVD; i++) x[i] = sinf(0.37f * (float)i) * 3.0f;
    kvq_quant_counts qc = {0};
    ck_assert(kvq_kv_desc_quantize(&s.desc, 0, 'k', y, x, T, KVD, 64, &qc, &e) == KVQ_OK);
    ck_assert_uint_eq(n_bits_differ(y, x, KVD), 0);
    ck_assert_uint_eq(qc.n_sink, KVD);
    ck_assert_uint_eq(qc.n_code_bits, (uint64_t)(8 * 2 + 3 * 6) * KVD);
    /* a 2-bit token: four midpoints of its head's fp16 range */
    float mn = INFINITY, mx = -INFINITY;
    for (int d = 0; d < 64; d++) {
        mn = fminf(mn, x[KVD + d]);
        mx = fmaxf(mx, x[KVD + d]);
    }
    double a = kvq_round_fp16(mn), w = (kvq_round_fp16(mx) - a) / 4;
    for (int d = 0; d < 64; d++) {
        double s0 = floor((x[KVD + d] - a) / w);
        s0 = s0 < 0 ? 0 : s0 > 3 ? 3 : s0;
        ck_assert_float_eq(y[KVD + d], (float)(a + (s0 + 0.5) * w));
    }
}
END_TEST


/* ---------------- kvcalib: the query-norm quantile ---------------- */

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

START_TEST(test_qaq_kvcalib_chain)
{
    char model[4096], tokf[4096], text[4096];
    KVQ_SKIP_IF(!kvq_test_shared(model, sizeof model, "models/llama2c/aidreams260K.bin") ||
                    !kvq_test_shared(tokf, sizeof tokf, "models/llama2c/aidreams-tok512.bin") ||
                    !kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"),
                "../shared tiny model or WikiText-2 absent");
    char dump[256], dump_noq[256], out[256];
    snprintf(dump, sizeof dump, "/tmp/kvq_test_qaq_%d.h5", (int)getpid());
    snprintf(dump_noq, sizeof dump_noq, "/tmp/kvq_test_qaq_noq_%d.h5", (int)getpid());
    snprintf(out, sizeof out, "/tmp/kvq_test_qaq_%d.safetensors", (int)getpid());
    unlink(dump);
    unlink(dump_noq);
    unlink(out);
    kvq_capture_opts co = kvq_capture_opts_default();
    co.model_path = model;
    co.tokenizer_path = tokf;
    co.text_path = text;
    co.format = KVQ_TEXT_WIKITEXT_TOKENS;
    co.samples = 3;
    co.seq_len = 48;
    co.quiet = true;
    co.out_path = dump_noq;
    co.command_line = "test_qaq";
    kvq_capture_report rep;
    kvq_err e = {0};
    ck_assert_msg(kvq_capture_run(&co, &rep, &e) == KVQ_OK, "%s", e.msg);
    co.q = true;
    co.out_path = dump;
    ck_assert_msg(kvq_capture_run(&co, &rep, &e) == KVQ_OK, "%s", e.msg);
    kvq_model m;
    ck_assert_msg(kvq_model_load(model, &m, &e) == KVQ_OK, "%s", e.msg);

    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("qaq"));
    ck_assert_int_eq(o.k_bits, 8);
    ck_assert(o.x[0] == 0.9);
    ck_assert_int_ne(kvq_calibrate_file(dump_noq, out, false, &o, NULL, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "--q"), "%s", e.msg);
    ck_assert(access(out, F_OK) != 0);
    o.x[0] = 0; /* a quantile of 0 is refused before any work */
    ck_assert_int_ne(kvq_calibrate_file(dump, out, false, &o, NULL, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "kvq.qaq.quantile"), "%s", e.msg);
    o.x[0] = 0.9;
    ck_assert_msg(kvq_calibrate_file(dump, out, false, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact ar;
    ck_assert_msg(kvq_artifact_read(out, &ar, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_str_eq(ar.p.method->name, "qaq");

    kvq_dump_reader *dr = NULL;
    ck_assert_msg(kvq_dump_open(dump, &dr, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta dm = *kvq_dump_reader_meta(dr);
    const int NH = m.hp.n_heads, H = m.hp.n_kv_heads, HD = m.hp.head_dim, gs = NH / H;
    const size_t SL = (size_t)dm.seq_len, rows = (size_t)dm.n_samples * SL;
    float *q = malloc(rows * NH * HD * sizeof(float));
    double *n2 = malloc(rows * gs * sizeof(double));
    for (int l = 0; l < m.hp.n_layers; l++) {
        for (int64_t smp = 0; smp < dm.n_samples; smp++)
            ck_assert_msg(kvq_dump_read(dr, l, KVQ_DUMP_Q, smp, q + (size_t)smp * SL * NH * HD, &e) == KVQ_OK, "%s", e.msg);
        const kvq_fam_tensor *t = kvq_kv_table_get(&ar.k[l], "qnorm2");
        ck_assert_ptr_nonnull(t);
        ck_assert_uint_eq(t->shape[0], (uint64_t)H);
        for (int h = 0; h < H; h++) {
            size_t n = 0;
            for (size_t r = 0; r < rows; r++)
                for (int g = 0; g < gs; g++) {
                    double a = 0;
                    for (int d = 0; d < HD; d++) a += pow(q[(r * NH + h * gs + g) * HD + d], 2);
                    n2[n++] = a;
                }
            qsort(n2, n, sizeof *n2, cmp_d);
            double want = n2[(size_t)ceil(0.9 * (double)n) - 1];
            ck_assert_msg(fabs(t->data[h] - want) <= 1e-5 * want, "layer %d head %d: qnorm2 %g, quantile %g", l, h, (double)t->data[h], want);
        }
    }
    kvq_dump_close(dr);
    free(q);
    free(n2);

    /* the artifact binds a spec without -q; kvstat's keys of layer 1 take its table in the width formula */
    kvq_artifact_set set;
    char fp[65];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    const char *paths[1] = {out};
    ck_assert_msg(kvq_artifact_set_load(&set, paths, 1, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_eval_scheme s;
    ck_assert_msg(kvq_eval_scheme_make("qaq-k0.002-v0.1-o0%-w2-l1-h8", &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_nonnull(s.desc.art);
    enum { T = 20 };
    const size_t kvd = (size_t)kvq_kv_dim(&m.hp);
    float *x = malloc(T * kvd * sizeof(float)), *y = malloc(T * kvd * sizeof(float));
    for (size_t i = 0; i < T * kvd; i++) x[i] = sinf(0.37f * (float)i) * 2.0f + 0.5f * cosf(0.05f * (float)i);
    kvq_quant_counts qc = {0};
    ck_assert(kvq_kv_desc_quantize(&s.desc, 1, 'k', y, x, T, kvd, (size_t)HD, &qc, &e) == KVQ_OK);
    uint64_t want_bits = 8ull * HD * H; /* the last token (N - 1 = 1) at H */
    const kvq_fam_tensor *t1 = kvq_kv_table_get(&ar.k[1], "qnorm2");
    for (int j = 0; j < T - 1; j++)
        for (int h = 0; h < H; h++) {
            float mn = INFINITY, mx = -INFINITY;
            for (int d = 0; d < HD; d++) {
                mn = fminf(mn, x[j * kvd + h * HD + d]);
                mx = fmaxf(mx, x[j * kvd + h * HD + d]);
            }
            double r = kvq_round_fp16(mx) - kvq_round_fp16(mn), Tn = T;
            double sk = sqrt(log(Tn * Tn * Tn / (Tn - 1) * 0.002 * 0.002 + 1) / (t1->data[h] / HD));
            int b = 1;
            while (b < 8 && r > ldexp(2 * sqrt(3.0) * sk, b)) b++;
            want_bits += (uint64_t)b * HD;
        }
    ck_assert_uint_eq(qc.n_code_bits, want_bits);
    /* teeth: the table's norms put the widths strictly inside [L, H] */
    fprintf(stderr, "INFO qaq kvstat keys of layer 1: %.3f code bits per element\n", (double)want_bits / (double)(T * kvd));
    ck_assert(want_bits > (uint64_t)(T - 1) * kvd + 8ull * kvd && want_bits < 8ull * T * kvd);
    free(x);
    free(y);
    kvq_artifact_set_free(&set);
    kvq_artifact_free(&ar);
    kvq_model_free(&m);
    unlink(dump);
    unlink(dump_noq);
    unlink(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("qaq");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_qaq_selection_form);
    tcase_add_test(tc, test_qaq_spec_bits);
    tcase_add_test(tc, test_qaq_decode_equivalence);
    tcase_add_test(tc, test_qaq_kvcalib_chain);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
