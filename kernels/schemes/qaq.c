/* qaq.c — QAQ: quality adaptive quantization of the KV cache (Dong, Cheng, Qin, Wang, "QAQ: Quality
 * Adaptive Quantization for LLM KV Cache", arXiv 2403.04643; reference code
 * github.com/ClubieDong/QAQ-KVCacheQuantization, src/quantizer.py).
 *   §3.1 / §4.1 keys and values get bit widths of their own, per token (here per (layer, KV head,
 *        token)), from an error budget:
 *        values  sigma_V(t) <= sigma_X / (sqrt(T) |S_t|)                          (S_t: the token's attention)
 *        keys    sigma_K(t)^2 <= log(T^3 / (T - 1) sigma_S^2 + 1) / sum_d Q_d^2    (T: tokens in the cache)
 *        bits    B(t) = ceil(log2((max_t - min_t) / (2 sqrt(3) sigma(t))))       clamped to [L, H]
 *        with sum_d Q_d^2 the upper-10% quantile of the squared query norm, precomputed (§4.1);
 *   §4.1 the quantizer: the token's [min, max] split into 2^B equal segments, each value rounded to its
 *        segment's midpoint;
 *   §3.3 / §4.2 outliers: the values beyond the alpha quantiles at both ends of each token (here each
 *        token's row of a layer, kv_dim values: beyond the (k+1)-th smallest / largest, k =
 *        kvq_outliers_per_side(kv_dim, alpha), the rule of KVQuant's per-token values) are kept exact in a
 *        sparse matrix; each head's min / max are those of the rest;
 *   §3.2 / §4.2 the attention window and its exceptions: the attention a token will receive is
 *        predicted as the maximum of its last N attention scores; bits are recomputed for every token
 *        at every generation step, a token whose new width is lower is quantized further, one whose
 *        width rises (an exception: attention that shifted after quantization) is re-quantized from
 *        the full-precision copy kept in CPU memory.
 *
 * Spec: qaq-k<Ks>-v<Vs>[-o<f>%][-w<N>][-l<L>][-h<H>][-q<Q2>]
 *   Ks  sigma_S max, the key budget (std of the attention probabilities), > 0
 *   Vs  sigma_X max, the value budget (std of the attention output, value units), > 0
 *   f   outliers, percent of each token's row of a layer, [0, 50) (default 1, the paper's setting)
 *   N   attention window, >= 1 (default 5, the paper's setting); n_sink + N must be shorter than the context
 *   L, H  the bit-width range, 0 <= L <= H <= 8 (default 1 and 8)
 *   Q2  a fixed squared query norm ||q||^2 for every layer and head (the reference's q_norm
 *       hyperparameter); without -q the spec needs a kvcalib artifact of method qaq (table
 *       layers.<i>.k.qnorm2 [n_kv_heads]: the quantile of ||q||^2 over the dump's queries of each KV head's
 *       GQA group, parameter kvq.qaq.quantile, default 0.9).
 * The paper neglects attention's 1/sqrt(head_dim); kvq keeps it: sum_d Q_d^2 = ||q||^2 / head_dim.
 * Keys post-RoPE by default (what the cache holds; +pre-rope accepted).
 *
 * Decode semantics (contract form 3, the selection form of kvq_kv_sched, forward.h): per layer and KV
 * head h, with a[i][j] = the largest probability of the group's query heads for window key j at window
 * query i, as the simulated cache produced it:
 *   - query i reads its own key and value exact (the new token's KV is fresh), sink tokens stay exact;
 *   - after query i: every window token j <= i with fewer than N scores (i - j + 1 < N) is held at H bits
 *     (the reference's "not enough history attentions": n_bits_max); the others get
 *     S_j = max(a[i-N+1..i][j]), T = P + i + 2 (the keys the next query reads) and the widths above, for
 *     both sides, read from query i + 1 on; a width may fall or rise at any step (the rise is the
 *     paper's exception path); every width is quantized from the exact token.
 * The widths compare in double: B = the smallest b in [L, H] with r <= 2^b 2 sqrt(3) sigma (r = max - min
 * of the dense values after fp16 rounding), else H; values: r S_j sqrt(T) <= 2^b 2 sqrt(3) sigma_X.
 *
 * Bits per element (from a run's realised counts, kvq_quant_counts): sink and exact tokens 16; a
 * quantized (token, head) its width per element (n_code_bits), plus 32 / head_dim for its fp16 min and
 * max, 4 / head_dim for its width, and 32 per outlier (16-bit value, 16-bit index; at most 2k per row,
 * fixed by f: no row pointer); keys with an artifact add the table (32 bits per layer and KV head,
 * amortised: 32 / (ctx head_dim)). Nominal (no counts): every non-sink token at H bits with 2k outliers
 * per row.
 *
 * Where kvq differs from the reference code (and the paper):
 *   - importance: the reference computes the widths once, at prefill, from the full-precision attention
 *     of the prompt's last N queries (max over them, and over layers / heads at its coarser levels) and
 *     quantizes the prompt's cache once; kvq simulates every query of the evaluation window as a decode
 *     step that reads the attention the quantized cache itself produced at earlier steps, and
 *     re-decides every width after every step (the paper's §4.2 integration);
 *   - the key formula: the reference code uses max_error = sqrt(err / D) / T / (q_norm x_t), x_t =
 *     max_k |S_t delta_tk - S_t S_k| (attention-dependent); kvq uses the paper's §4.1 formula, which
 *     depends on T and the query norm only; the value formula follows the paper (sqrt(T), sigma) where
 *     the reference writes T and a half-width;
 *   - the reference's quantizer rounds mean-centred values to integers clamped to [-2^(B-1), 2^(B-1)-1]
 *     with step (max - min) / 2^B; kvq uses the paper's midpoint quantizer over [min, max] (fp16 min and
 *     max);
 *   - outliers: the reference picks them per quantization unit (at its "head" level each head vector,
 *     ceil(alpha/2 head_dim) per side, 3% of a 64-channel head at alpha = 1%); kvq per token row of a
 *     layer (alpha of kv_dim), ties at the thresholds dense;
 *   - a width that falls is quantized from the exact token, not from the higher-width copy (the paper
 *     quantizes the quantized copy further);
 *   - GQA: a KV head's tokens take the largest attention of its group's query heads and the group's
 *     pooled query-norm quantile;
 *   - defaults: the reference's grid search tries L in 0..2, H in 2..4, N in {1, 5} and q_norm 300 (the
 *     paper reports N = 5, 1% outliers); kvq defaults to L = 1, H = 8 (the formula alone decides);
 *   - kvstat (no attention at hand) shows keys at their formula widths for the whole window (T = the
 *     window) and values at uniform attention S = 1 / T; the last N - 1 tokens at H bits; an artifact's
 *     own scheme (kvstat --artifact) takes Ks = 0.001, Vs = 0.1.
 * The step is also described declaratively (forward.h kvq_sched_sel: the ranges, the key units per (head, row), the
 * value unit and sqrt(T) per row, computed here once per layer and read by the step too), so the CUDA forward runs
 * it on the device (kernels/cuda/cuda_sched.cuh) with the same selections and counts.
 * Cost of the simulation: every width is a representation of its own, (H - L + 1) x 2 x T x kv_dim floats
 * per layer (8 widths of a 2048-token SmolLM2 window: 25 MB); the step is O(N T) per query row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"

#define QA_KS(q) ((q)->x[0]) /* sigma_S max */
#define QA_VS(q) ((q)->x[1]) /* sigma_X max */
#define QA_Q2(q) ((q)->x[2]) /* fixed ||q||^2, 0: the artifact's table */
#define QA_LO(q) ((q)->x[3]) /* L */
enum { QA_N = 5, QA_L = 1, QA_H = 8, QA_WBITS = 4 };
static const double QA_F = 0.01, QA_KS_DEF = 0.001, QA_VS_DEF = 0.1;

/* ---- spec ------------------------------------------------------------------------------ */

/* a positive decimal at *p (digits and one '.'), advancing *p */
static bool spec_num(const char **p, double *out)
{
    const char *s = *p;
    size_t n = strspn(s, "0123456789.");
    if (n == 0 || n > 30) return false;
    char buf[32];
    memcpy(buf, s, n);
    buf[n] = 0;
    char *end;
    double v = strtod(buf, &end);
    if (*end || !isfinite(v)) return false;
    *out = v;
    *p = s + n;
    return true;
}

static int parse_qaq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (strncmp(b, "qaq", 3) || (b[3] && b[3] != '-')) return 0;
    const char *p = b + 3;
    const char *form = "expected qaq-k<Ks>-v<Vs>[-o<f>%][-w<N>][-l<L>][-h<H>][-q<Q2>] (e.g. qaq-k0.001-v0.1-o1%-w5)";
    double ks, vs, f = QA_F, q2 = 0;
    unsigned long w = QA_N, lo = QA_L, hi = QA_H;
    if (!kvq_spec_starts(p, "-k")) return kvq_spec_bad(spec, err, form);
    p += 2;
    if (!spec_num(&p, &ks) || !(ks > 0)) return kvq_spec_bad(spec, err, "key budget after -k: expected a number > 0 (sigma_S max)");
    if (!kvq_spec_starts(p, "-v")) return kvq_spec_bad(spec, err, form);
    p += 2;
    if (!spec_num(&p, &vs) || !(vs > 0)) return kvq_spec_bad(spec, err, "value budget after -v: expected a number > 0 (sigma_X max)");
    if (kvq_spec_starts(p, "-o")) {
        p += 2;
        if (!spec_num(&p, &f) || *p != '%' || !(f >= 0 && f < 50))
            return kvq_spec_bad(spec, err, "outliers after -o: expected <f>% with 0 <= f < 50 (e.g. -o1%)");
        p++;
        f /= 100;
    }
    if (kvq_spec_starts(p, "-w")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &w) || w == 0) return kvq_spec_bad(spec, err, "attention window after -w: expected an integer >= 1");
    }
    if (kvq_spec_starts(p, "-l")) {
        p += 2;
        if (!kvq_spec_uint(&p, 8, &lo)) return kvq_spec_bad(spec, err, "lowest width after -l: expected 0..8 bits");
    }
    if (kvq_spec_starts(p, "-h")) {
        p += 2;
        if (!kvq_spec_uint(&p, 8, &hi) || hi < 1) return kvq_spec_bad(spec, err, "highest width after -h: expected 1..8 bits");
    }
    if (kvq_spec_starts(p, "-q")) {
        p += 2;
        if (!spec_num(&p, &q2) || !(q2 > 0)) return kvq_spec_bad(spec, err, "query norm after -q: expected ||q||^2 > 0");
    }
    if (*p) return kvq_spec_bad(spec, err, form);
    q->k_bits = q->v_bits = (int)hi;
    q->outlier_frac = f;
    q->residual = w;
    QA_KS(q) = ks;
    QA_VS(q) = vs;
    QA_Q2(q) = q2;
    QA_LO(q) = (double)lo;
    return 1;
}

static void fmt_qaq(const kvq_scheme *q, char *b, size_t n)
{
    char qn[40] = "";
    if (QA_Q2(q) > 0) snprintf(qn, sizeof qn, "-q%g", QA_Q2(q));
    snprintf(b, n, "qaq-k%g-v%g-o%g%%-w%zu-l%g-h%d%s", QA_KS(q), QA_VS(q), q->outlier_frac * 100, q->residual, QA_LO(q), q->k_bits, qn);
}

static kvq_status validate_qaq(const kvq_scheme *q, kvq_err *err)
{
    if (q->k_bits != q->v_bits) return kvq_fail(err, KVQ_EINVAL, "scheme: qaq: k_bits %d and v_bits %d differ", q->k_bits, q->v_bits);
    if (!(QA_KS(q) > 0 && isfinite(QA_KS(q))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: qaq key budget sigma_S: expected a finite value > 0, found %g", QA_KS(q));
    if (!(QA_VS(q) > 0 && isfinite(QA_VS(q))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: qaq value budget sigma_X: expected a finite value > 0, found %g", QA_VS(q));
    if (!(QA_Q2(q) >= 0 && isfinite(QA_Q2(q))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: qaq query norm: expected ||q||^2 > 0 (or 0: the artifact's), found %g", QA_Q2(q));
    double lo = QA_LO(q);
    if (!(lo >= 0 && lo <= q->k_bits && lo == floor(lo)))
        return kvq_fail(err, KVQ_EINVAL, "scheme: qaq widths: expected 0 <= L <= H = %d integer bits, found L = %g", q->k_bits, lo);
    if (q->residual == 0) return kvq_fail(err, KVQ_EINVAL, "scheme: qaq attention window: expected >= 1, found 0");
    if (q->k_bits - (int)lo + 2 > KVQ_KV_MAX_REPS)
        return kvq_fail(err, KVQ_EINVAL, "scheme: qaq: %d widths and the exact copy exceed %d representations", q->k_bits - (int)lo + 1,
                        KVQ_KV_MAX_REPS);
    return KVQ_OK;
}

/* outliers per side of one token's row of kv_dim values (quant.h kvq_outliers_per_side) */
static size_t qa_k(double f, size_t kvd) { return kvq_outliers_per_side(kvd, f); }

static kvq_status check_ctx_qaq(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (q->n_sink + q->residual >= ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the sink (%zu) and the attention window (%zu) must be shorter than the context "
                        "(%zu tokens): no token would ever get a width of its own", name, q->n_sink, q->residual, ctx);
    return KVQ_OK;
}

static void describe_qaq(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    o->num(o->ctx, "key_budget_sigma_s", QA_KS(q));
    o->num(o->ctx, "value_budget_sigma_x", QA_VS(q));
    o->num(o->ctx, "attention_window", (double)q->residual);
    o->num(o->ctx, "min_bits", QA_LO(q));
    o->num(o->ctx, "max_bits", q->k_bits);
    if (QA_Q2(q) > 0) o->num(o->ctx, "query_norm2", QA_Q2(q));
    else o->str(o->ctx, "query_norm2", has_artifact ? "artifact" : "missing");
}

/* ---- the artifact: the query-norm quantile ------------------------------------------------ */

static bool needs_artifact_qaq(const kvq_scheme *q) { return !(QA_Q2(q) > 0); }

static bool match_qaq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    (void)q;
    (void)stage_set;
    (void)stage;
    return p->method && !strcmp(p->method->name, "qaq");
}

static void need_qaq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    (void)q;
    (void)stage_set;
    (void)stage;
    snprintf(buf, n, "the query-norm quantile per layer and KV head: a kvcalib artifact of method qaq (or -q<Q2>)");
}

static void from_params_qaq(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = q->v_bits = p->k_bits;
    q->n_sink = p->n_sink;
    q->outlier_frac = p->outlier_frac;
    q->residual = QA_N;
    QA_KS(q) = QA_KS_DEF;
    QA_VS(q) = QA_VS_DEF;
    QA_Q2(q) = 0;
    QA_LO(q) = QA_L < p->k_bits ? QA_L : p->k_bits;
}

static const char *const qn_names[] = {"qnorm2", NULL};
static const char *const no_names[] = {NULL};
static const char *const param_names[] = {"quantile", NULL};

static const char *const *tensors_qaq(const kvq_artifact_params *p, char side)
{
    (void)p;
    return side == 'k' ? qn_names : no_names;
}

static kvq_status check_qnorm(const kvq_fam_tensor *t, size_t H, const char *where, kvq_err *err)
{
    if (!t) return kvq_fail(err, KVQ_EINVAL, "%s.qnorm2: missing", where);
    if (t->n_dims != 1 || t->shape[0] != H)
        return kvq_fail(err, KVQ_EINVAL, "%s.qnorm2: expected shape [%zu] (n_kv_heads), found %u dims, first %llu", where, H, t->n_dims,
                        (unsigned long long)t->shape[0]);
    for (size_t h = 0; h < H; h++)
        if (!(isfinite(t->data[h]) && t->data[h] > 0))
            return kvq_fail(err, KVQ_EINVAL, "%s.qnorm2[%zu]: expected a finite value > 0, found %g", where, h, (double)t->data[h]);
    return KVQ_OK;
}

static kvq_status check_tensors_qaq(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    char where[64];
    snprintf(where, sizeof where, "layers.%zu.%c", layer, side);
    return check_qnorm(kvq_kv_table_get(t, "qnorm2"), p->n_kv_heads, where, err);
}

static kvq_status check_params_qaq(const kvq_artifact_params *p, kvq_err *err)
{
    if (!(p->x[0] > 0 && p->x[0] <= 1)) return kvq_fail(err, KVQ_EINVAL, "kvq.qaq.quantile: expected 0 < quantile <= 1, found %g", p->x[0]);
    return KVQ_OK;
}

static void inspect_qaq(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "qaq           qnorm2 = the %g quantile of ||q||^2 per (layer, KV head) over the dump's queries of its group\n",
            p->x[0]);
}

static kvq_status check_tables_qaq(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (QA_Q2(&d->q) > 0) return KVQ_OK;
    if (!d->art || !d->art->k || d->art->p.n_layers != (size_t)hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: qaq needs the query-norm table of %d layers (an artifact of method qaq, or -q)",
                        hp->n_layers);
    for (int l = 0; l < hp->n_layers; l++) {
        char where[64];
        snprintf(where, sizeof where, "layers.%d.k", l);
        KVQ_TRY(check_qnorm(kvq_kv_table_get(&d->art->k[l], "qnorm2"), (size_t)hp->n_kv_heads, where, err));
    }
    return KVQ_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* kvcalib: per KV head, the quantile (kvq.qaq.quantile, nearest rank) of ||q||^2 over every token and
 * every query head of its group (RoPE keeps the norm: either stage) */
static kvq_status fit_layer_qaq(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k,
                                kvq_kv_table *v, kvq_err *err)
{
    (void)v;
    if (!src->has_q)
        return kvq_fail(err, KVQ_EINVAL, "qaq's query-norm quantile reads the dump's queries: the dump has none (rerun kvdump with --q)");
    size_t H = src->n_kv_heads, hd = src->head_dim, nh = src->n_heads, gs = nh / H, rows = src->n_samples * src->seq_len;
    float *qb = malloc(kvq_calib_src_len(src, 3) * sizeof(float));
    double *n2 = malloc(rows * gs * sizeof(double));
    kvq_status s = KVQ_OK;
    if (!qb || !n2) s = kvq_fail(err, KVQ_ENOMEM, "qaq: cannot hold layer %d's queries", layer);
    if (!s) s = src->read(src, layer, 3, qb, err);
    float *out = NULL;
    uint64_t shape[1] = {H};
    if (!s) s = kvq_kv_table_add(k, "qnorm2", 1, shape, &out, err);
    for (size_t h = 0; !s && h < H; h++) {
        for (size_t t = 0; t < rows; t++)
            for (size_t g = 0; g < gs; g++) {
                const float *x = qb + (t * nh + h * gs + g) * hd;
                double a = 0;
                for (size_t d = 0; d < hd; d++) a += (double)x[d] * x[d];
                n2[t * gs + g] = a;
            }
        size_t n = rows * gs;
        qsort(n2, n, sizeof *n2, cmp_double);
        size_t r = (size_t)ceil(p->x[0] * (double)n - 1e-9);
        double val = n2[(r ? r : 1) - 1];
        if (!(val > 0 && isfinite((float)val))) {
            s = kvq_fail(err, KVQ_EINVAL, "qaq: layer %d KV head %zu: the %g quantile of ||q||^2 is %g, expected a finite value > 0",
                         layer, h, p->x[0], val);
            break;
        }
        out[h] = (float)val;
    }
    if (!s) k->bits = p->k_bits;
    free(qb);
    free(n2);
    return s;
}

static const kvq_family_artifact art_qaq = {
    .outliers = true,
    .post_rope_only = true,
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "attention-adaptive-width-per-token-head",
    .v_scaling = "attention-adaptive-width-per-token-head",
    .check_params = check_params_qaq,
    .inspect = inspect_qaq,
    .tensors = tensors_qaq,
    .check_tensors = check_tensors_qaq,
    .params = param_names,
};

/* H = 8 bits, 1% outliers, post-RoPE keys (the norm needs no stage), the 0.9 quantile (§4.1) */
static const kvq_family_calib calib_qaq = {
    .bits = 8,
    .outliers = 0.01,
    .post_rope = true,
    .fit_k = true,
    .fit_layer = fit_layer_qaq,
    .x = {0.9},
};

/* ---- the quantizer ------------------------------------------------------------------------ */

/* One token's row x[kvd] of a layer: its outliers (kvq_token_range, the rule of KVQuant's per-token
 * values: k per side over the whole row, values beyond the (k+1)-th smallest / largest exact, ties dense)
 * marked in mask[kvd]; per head h the dense range [lo[h], hi[h]] of the rest as fp16 and its outlier
 * count nout[h]. scratch: [kvd] floats. */
static void qa_prep(const float *x, size_t kvd, size_t hd, size_t k, float *scratch, unsigned char *mask, float *lo, float *hi,
                    unsigned short *nout)
{
    float tl = -INFINITY, th = INFINITY;
    if (k) kvq_token_range(x, kvd, k, scratch, &tl, &th);
    for (size_t h = 0; h < kvd / hd; h++) {
        float mn = INFINITY, mx = -INFINITY;
        unsigned short no = 0;
        for (size_t d = h * hd; d < (h + 1) * hd; d++) {
            mask[d] = x[d] < tl || x[d] > th;
            if (mask[d]) {
                no++;
                continue;
            }
            if (x[d] < mn) mn = x[d];
            if (x[d] > mx) mx = x[d];
        }
        if (mn > mx) mn = mx = 0; /* every value of the head an outlier */
        lo[h] = kvq_round_fp16(mn);
        hi[h] = kvq_round_fp16(mx);
        nout[h] = no;
    }
}

/* the §4.1 midpoint quantizer of one vector at b bits (outliers exact) */
static void qa_quant(float *y, const float *x, size_t hd, const unsigned char *mask, float lo, float hi, int b)
{
    const double n = ldexp(1.0, b), w = ((double)hi - (double)lo) / n;
    for (size_t d = 0; d < hd; d++) {
        if (mask[d]) {
            y[d] = x[d];
            continue;
        }
        double s = w > 0 ? floor(((double)x[d] - (double)lo) / w) : 0;
        if (s < 0) s = 0;
        if (s > n - 1) s = n - 1;
        y[d] = (float)((double)lo + (s + 0.5) * w);
    }
}

/* the smallest b in [L, H] with lhs <= 2^b u, else H */
static int qa_width(double lhs, double u, int L, int H)
{
    int b = L;
    while (b < H && lhs > ldexp(u, b)) b++;
    return b;
}

/* the key's sigma bound for a cache of Tn tokens (§4.1) and squared query norm q2 (||q||^2 / head_dim) */
static double qa_sigma_k(double Tn, double ks, double q2hd)
{
    return sqrt(log(Tn * Tn * Tn / (Tn - 1) * ks * ks + 1) / q2hd);
}

static double qa_q2(const kvq_kv_desc *d, int layer, int h)
{
    if (QA_Q2(&d->q) > 0) return QA_Q2(&d->q);
    const kvq_fam_tensor *t = d->art && d->art->k ? kvq_kv_table_get(&d->art->k[layer], "qnorm2") : NULL;
    return t ? (double)t->data[h] : 1.0;
}

/* ---- the schedule ------------------------------------------------------------------------- */

typedef struct {
    size_t cap_T, H, kvd, n_rep;
    float *rep;          /* [2][n_rep][cap_T][kvd]: keys, values at widths L..H */
    float *rng;          /* [2][T][H]: dense range hi - lo (this layer's T) */
    unsigned short *nout;/* [2][T][H]: outliers of the vector */
    double *unit;        /* [2][H][T]: the width rule's unit 2 sqrt(3) sigma per side, head, query row */
    double *root;        /* [T]: sqrt(P + i + 2) */
    unsigned char *mask; /* [cap_T][kvd] scratch */
    float *lo, *hi;      /* [cap_T][H] scratch */
    float *scratch;      /* [cap_T][kvd]: a token's own (the tokens are prepared in parallel) */
    signed char *sel;    /* [2][H][cap_T] */
    float *ring;         /* [H][N][cap_T] */
    uint64_t *cnt;       /* [2][H][5]: elements, sink, exact, outliers, code bits of the last query */
    bool pending;
    int T, P, ns, N, L, Hb, hd;
    double ks, vs, q2hd[64];
    kvq_kv_sched sched;
    kvq_sched_sel desc; /* the step's declarative form (a device runs the rule itself) */
} qa_state;

static void flush_counts(kvq_kv_desc_run *run, qa_state *st)
{
    if (!st->pending) return;
    for (int w = 0; w < 2; w++) {
        kvq_quant_counts *c = w ? &run->v_counts : &run->k_counts;
        for (size_t h = 0; h < st->H; h++) {
            const uint64_t *x = st->cnt + (w * st->H + h) * 5;
            c->n_elems += x[0];
            c->n_sink += x[1];
            c->n_exact += x[2];
            c->n_outliers += x[3];
            c->n_code_bits += x[4];
        }
    }
    st->pending = false;
}

static void free_bufs(qa_state *st)
{
    free(st->rep);
    free(st->rng);
    free(st->nout);
    free(st->unit);
    free(st->root);
    free(st->mask);
    free(st->lo);
    free(st->hi);
    free(st->scratch);
    free(st->sel);
    free(st->ring);
    free(st->cnt);
}

static void run_free_qaq(kvq_kv_desc_run *run)
{
    qa_state *st = run->state;
    if (!st) return;
    flush_counts(run, st);
    free_bufs(st);
    free(st);
    run->state = NULL;
}

static kvq_status step_qaq(void *user, const kvq_sched_step *s, kvq_kv_sched *sc, kvq_err *err)
{
    (void)sc;
    (void)err;
    qa_state *st = user;
    const int h = s->kv_head, i = s->i, T = st->T, n = s->P + i + 1, N = st->N, L = st->L, Hb = st->Hb;
    signed char *sk = st->sel + (size_t)h * T, *sv = st->sel + ((size_t)st->H + h) * T;
    const size_t H = st->H;
    if (i == T - 1) /* the resting cache as the last query reads it */
        for (int w = 0; w < 2; w++) {
            uint64_t *c = st->cnt + (w * H + h) * 5, hd = (uint64_t)st->hd;
            const signed char *sl = w ? sv : sk;
            memset(c, 0, 5 * sizeof *c);
            c[0] = (uint64_t)T * hd;
            c[1] = (uint64_t)st->ns * hd;
            for (int j = st->ns; j < T; j++) {
                if (sl[j] == 0) c[2] += hd;
                else {
                    c[3] += st->nout[((size_t)w * T + j) * H + h];
                    c[4] += (uint64_t)(L + sl[j] - 1) * hd;
                }
            }
        }
    float *ring = st->ring + (size_t)h * N * T, *row = ring + (size_t)(i % N) * T;
    for (int j = 0; j <= i; j++) {
        float a = 0;
        for (int q = 0; q < s->n_q; q++) {
            float p = s->probs[(size_t)q * n + s->P + j];
            if (p > a) a = p;
        }
        row[j] = a;
    }
    /* the units and roots the transform computed (kvq_sched_sel: a device reads the same bits) */
    const double uk = st->unit[(size_t)h * T + i], uv = st->unit[(H + h) * T + i], sq = st->root[i];
    const float *rk = st->rng + (size_t)h, *rv = st->rng + (size_t)T * H + (size_t)h;
    for (int j = st->ns; j <= i; j++) {
        if (i - j + 1 < N) {
            sk[j] = sv[j] = (signed char)(Hb - L + 1);
            continue;
        }
        float a = 0;
        for (int r = 0; r < N; r++)
            if (ring[(size_t)r * T + j] > a) a = ring[(size_t)r * T + j];
        sk[j] = (signed char)(qa_width((double)rk[(size_t)j * H], uk, L, Hb) - L + 1);
        sv[j] = (signed char)(qa_width((double)rv[(size_t)j * H] * (double)a * sq, uv, L, Hb) - L + 1);
    }
    return KVQ_OK;
}

static kvq_status grow(qa_state *st, size_t T, size_t H, size_t kvd, size_t n_rep, int N, kvq_err *err)
{
    if (st->cap_T >= T && st->H == H && st->kvd == kvd && st->n_rep == n_rep && st->N >= N) return KVQ_OK;
    qa_state b = {0};
    b.rep = malloc(2 * n_rep * T * kvd * sizeof(float));
    b.rng = malloc(2 * T * H * sizeof(float));
    b.nout = malloc(2 * T * H * sizeof(unsigned short));
    b.unit = malloc(2 * H * T * sizeof(double));
    b.root = malloc(T * sizeof(double));
    b.mask = malloc(T * kvd);
    b.lo = malloc(T * H * sizeof(float));
    b.hi = malloc(T * H * sizeof(float));
    b.scratch = malloc(T * kvd * sizeof(float));
    b.sel = malloc(2 * H * T);
    b.ring = malloc(H * (size_t)N * T * sizeof(float));
    b.cnt = calloc(2 * H * 5, sizeof(uint64_t));
    if (!b.rep || !b.rng || !b.nout || !b.unit || !b.root || !b.mask || !b.lo || !b.hi || !b.scratch || !b.sel || !b.ring || !b.cnt) {
        free_bufs(&b);
        return kvq_fail(err, KVQ_ENOMEM, "qaq: cannot allocate %zu widths of a %zu-token x %zu-channel window", n_rep, T, kvd);
    }
    free_bufs(st);
    st->rep = b.rep;
    st->rng = b.rng;
    st->nout = b.nout;
    st->unit = b.unit;
    st->root = b.root;
    st->mask = b.mask;
    st->lo = b.lo;
    st->hi = b.hi;
    st->scratch = b.scratch;
    st->sel = b.sel;
    st->ring = b.ring;
    st->cnt = b.cnt;
    st->cap_T = T;
    st->H = H;
    st->kvd = kvd;
    st->n_rep = n_rep;
    st->N = N;
    return KVQ_OK;
}

static kvq_status transform_qaq(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    const kvq_kv_desc *d = run->d;
    const kvq_scheme *q = &d->q;
    const size_t T = (size_t)c->T, H = (size_t)c->n_kv_heads, hd = (size_t)c->head_dim, kvd = H * hd;
    const int L = (int)QA_LO(q), Hb = q->k_bits, N = (int)(q->residual < T ? q->residual : T);
    const size_t n_rep = (size_t)(Hb - L + 1), ko = qa_k(q->outlier_frac, kvd);
    if (H > 64) return kvq_fail(err, KVQ_EINVAL, "qaq: %zu KV heads, at most 64", H);
    qa_state *st = run->state;
    if (!st) {
        st = calloc(1, sizeof *st);
        if (!st) return kvq_fail(err, KVQ_ENOMEM, "qaq: out of memory");
        run->state = st;
    }
    flush_counts(run, st); /* the previous layer's resting cache */
    KVQ_TRY(grow(st, T, H, kvd, n_rep, (int)q->residual < (int)T ? (int)q->residual : (int)T, err));
    const size_t cap = st->cap_T;
    for (int w = 0; w < 2; w++) {
        const float *x = w ? v : k;
        /* every token on its own (its rows of every buffer): the same bits on any thread count */
#pragma omp parallel for schedule(static) if (T * kvd * n_rep > (1u << 18))
        for (size_t t = 0; t < T; t++) {
            qa_prep(x + t * kvd, kvd, hd, ko, st->scratch + t * kvd, st->mask + t * kvd, st->lo + t * H, st->hi + t * H,
                    st->nout + ((size_t)w * T + t) * H);
            for (size_t h = 0; h < H; h++) {
                const size_t o = t * kvd + h * hd, th = t * H + h;
                st->rng[(size_t)w * T * H + th] = st->hi[th] - st->lo[th];
                for (size_t r = 0; r < n_rep; r++)
                    qa_quant(st->rep + ((w * n_rep + r) * cap) * kvd + o, x + o, hd, st->mask + o, st->lo[th], st->hi[th], L + (int)r);
            }
        }
    }
    st->T = (int)T;
    st->P = c->P;
    st->ns = (int)(q->n_sink < T ? q->n_sink : T);
    st->N = N;
    st->L = L;
    st->Hb = Hb;
    st->hd = (int)hd;
    st->ks = QA_KS(q);
    st->vs = QA_VS(q);
    for (size_t h = 0; h < H; h++) st->q2hd[h] = qa_q2(d, c->layer, (int)h) / (double)hd;
    const double c23 = 2 * sqrt(3.0);
    for (size_t i = 0; i < T; i++) {
        const double Tn = (double)c->P + (double)i + 2;
        st->root[i] = sqrt(Tn);
        for (size_t h = 0; h < H; h++) {
            st->unit[h * T + i] = c23 * qa_sigma_k(Tn, st->ks, st->q2hd[h]);
            st->unit[(H + h) * T + i] = c23 * st->vs;
        }
    }
    memset(st->sel, 0, 2 * H * T);
    memset(st->ring, 0, H * (size_t)N * T * sizeof(float));
    memset(st->cnt, 0, 2 * H * 5 * sizeof(uint64_t));
    st->pending = true;
    kvq_kv_sched *sc = &st->sched;
    memset(sc, 0, sizeof *sc);
    sc->n_k = sc->n_v = (int)n_rep + 1;
    sc->k[0] = k;
    sc->v[0] = v;
    for (size_t r = 0; r < n_rep; r++) {
        sc->k[r + 1] = st->rep + (r * cap) * kvd;
        sc->v[r + 1] = st->rep + ((n_rep + r) * cap) * kvd;
    }
    sc->k_sel = st->sel;
    sc->v_sel = st->sel + H * T;
    sc->step = step_qaq;
    sc->user = st;
    st->desc = (kvq_sched_sel){.n_sink = st->ns, .window = N, .young = (int)n_rep, .n_lv = (int)n_rep, .lo = L,
                               .attn = {false, true}, .range = st->rng, .unit = st->unit, .root = st->root, .nout = st->nout,
                               .counts = st->cnt};
    sc->sel = &st->desc;
    alt->sched = sc;
    return KVQ_OK;
}

/* kvstat: keys at their formula widths for a cache of the whole window, values at uniform attention;
 * the sink exact, the last N - 1 tokens at H bits */
static kvq_status quantize_qaq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                               size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    if (hd == 0 || kvd % hd) return kvq_fail(err, KVQ_EINVAL, "qaq: head_dim %zu does not divide kv_dim %zu", hd, kvd);
    const size_t H = kvd / hd, ns = q->n_sink < T ? q->n_sink : T, N = q->residual, ko = qa_k(q->outlier_frac, kvd);
    const int L = (int)QA_LO(q), Hb = q->k_bits;
    unsigned char *mask = malloc(kvd);
    float *y = malloc(kvd * sizeof(float)), *scr = malloc(kvd * sizeof(float)), *lo = malloc(H * sizeof(float)),
          *hi = malloc(H * sizeof(float));
    unsigned short *no = malloc(H * sizeof *no);
    kvq_status s = KVQ_OK;
    if (!mask || !y || !scr || !lo || !hi || !no) s = kvq_fail(err, KVQ_ENOMEM, "qaq: out of memory");
    const double Tn = T > 1 ? (double)T : 2.0, c23 = 2 * sqrt(3.0);
    if (!s && c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
    }
    for (size_t t = 0; !s && t < T; t++) {
        const float *x = in + t * kvd;
        if (t < ns) {
            if (out != in) memcpy(out + t * kvd, x, kvd * sizeof(float));
            continue;
        }
        qa_prep(x, kvd, hd, ko, scr, mask, lo, hi, no);
        for (size_t h = 0; h < H; h++) {
            int b = Hb;
            if (t + N <= T) {
                double r = (double)hi[h] - (double)lo[h];
                b = side == 'k' ? qa_width(r, c23 * qa_sigma_k(Tn, QA_KS(q), qa_q2(d, layer, (int)h) / (double)hd), L, Hb)
                                : qa_width(r * (1.0 / (double)T) * sqrt(Tn), c23 * QA_VS(q), L, Hb);
            }
            qa_quant(y + h * hd, x + h * hd, hd, mask + h * hd, lo[h], hi[h], b);
            if (c) {
                c->n_outliers += no[h];
                c->n_code_bits += (uint64_t)b * hd;
            }
        }
        memcpy(out + t * kvd, y, kvd * sizeof(float));
    }
    free(mask);
    free(y);
    free(scr);
    free(lo);
    free(hi);
    free(no);
    return s;
}

/* ---- bits ------------------------------------------------------------------------------------ */

static kvq_status bits_qaq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    size_t hd = in->head_dim;
    if (hd == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: qaq: the per-head metadata needs head_dim (kvq_scheme_bits_ex)");
    if (in->ctx == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx: expected > 0, found 0");
    const double meta = (32.0 + QA_WBITS) / (double)hd, ko = (double)qa_k(q->outlier_frac, in->kv_dim);
    for (int w = 0; w < 2; w++) {
        const kvq_quant_counts *c = w ? in->v : in->k;
        double b;
        if (c && c->n_elems > 0) {
            double e = (double)c->n_elems, x16 = (double)(c->n_sink + c->n_exact), nq = e - x16;
            b = (16.0 * x16 + (double)c->n_code_bits + 32.0 * (double)c->n_outliers + meta * nq) / e;
        } else {
            size_t ns = q->n_sink < in->ctx ? q->n_sink : in->ctx;
            double dense = q->k_bits + meta + 64.0 * ko / (double)in->kv_dim;
            b = kvq_bits_mix16(dense, in->ctx, ns);
        }
        if (!w && !(QA_Q2(q) > 0)) b += 32.0 / ((double)in->ctx * (double)hd);
        if (w) out->v = b;
        else out->k = b;
    }
    return KVQ_OK;
}

const kvq_family kvq_family_qaq = {
    .name = "qaq",
    .syntax = "qaq-k<Ks>-v<Vs>[-o<f>%][-w<N>][-l<L>][-h<H>][-q<Q2>] (default f=1, N=5, L=1, H=8; without -q a kvcalib artifact)",
    .key_outliers_online = true,
    .summary = "QAQ (arXiv 2403.04643 §4): per (token, head) key and value widths in [L, H] from error budgets sigma_S (keys, "
               "from the cache length and the calibrated query norm) and sigma_X (values, from the max of each token's last N "
               "attention scores), re-decided after every decode step (down or back up), f% outliers per vector exact; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_qaq,
    .format = fmt_qaq,
    .validate = validate_qaq,
    .check_ctx = check_ctx_qaq,
    .needs_artifact = needs_artifact_qaq,
    .match = match_qaq,
    .describe_need = need_qaq,
    .from_params = from_params_qaq,
    .check_tables = check_tables_qaq,
    .artifact = &art_qaq,
    .calib = &calib_qaq,
    .quantize = quantize_qaq,
    .transform = transform_qaq,
    .run_free = run_free_qaq,
    .no_backward = true,
    .describe = describe_qaq,
    .bits = bits_qaq,
};
