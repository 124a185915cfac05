/* lowrank.c — low-rank KV heads (Yu, Yang, Li, Li, Wu, "Effectively Compress
 * KV Heads for LLM", arXiv 2406.07056, 2024).
 *
 * The paper (its method part, cited as §3 below) observes that the KV caches of a layer are low-rank: the
 * concatenated keys (values) of a group of KV heads, [tokens][g * head_dim],
 * keep most of their energy in a few principal directions. It converts MHA
 * into GQA by replacing each group of g KV heads with fewer heads: an SVD of
 * the calibration KV cache of the group (not of the weights) gives the
 * orthonormal directions U [g*head_dim][r] that minimise the reconstruction
 * error of the cache; the reduced heads cache c = Uᵀ x (r numbers per token
 * and group instead of g*head_dim), the keys' Uᵀ is absorbed into the query
 * side (q·(U c) = (Uᵀ q)·c) and the values' U into the output projection
 * (Σ_j a_j U c_j = U Σ_j a_j c_j). Keys under RoPE: RoPE's position-dependent
 * rotation sits between W_k and the cache, so the key projection cannot simply
 * be folded into W_k / W_q; the abstract announces "specialized strategies
 * for key caches with RoPE". Only the abstract and secondary summaries of the
 * paper were available to us (no full text, no code), so kvq does not claim
 * to reproduce those strategies. What kvq does instead, exactly: by default
 * it fits and applies the projection to the post-RoPE keys (the cache holds
 * Uᵀ RoPE(k), the post-RoPE query is projected by the same U: exact query
 * absorption, an extra r x D product per query head at decode); with
 * --keys pre-rope / +pre-rope it projects the pre-RoPE keys and the reader
 * reconstructs U c and then rotates it (no query absorption). The paper also
 * fine-tunes the compressed model; kvq does not.
 *
 * What kvq does: per layer, side and group of G consecutive KV heads
 * (D = G * head_dim channels), kvcalib --method lowrank stores the
 * eigendecomposition of the calibration second-moment matrix
 * C = Σ_t w_t x_t x_tᵀ / Σ_t w_t (LAPACK dsyevd in float64; the right singular
 * vectors of the cache matrix: an uncentred SVD of the calibration cache),
 * w_t = 1 (plain, the default: the paper works from the low-rank structure of
 * the caches themselves, with no weighting its summaries mention) or, with --fisher, the token's Fisher information summed over
 * the group's channels (an option of kvq's):
 *   layers.<i>.<k|v>.basis   [n_groups][D][D]  row j = principal direction j (unit, descending eigenvalue)
 *   layers.<i>.<k|v>.eigval  [n_groups][D]     eigenvalue j = mean squared coefficient on direction j
 * Keys post-RoPE by default (above); kvcalib --keys pre-rope calibrates
 * pre-RoPE keys (spec +pre-rope). The spec picks the rank at evaluation time
 * from the stored eigenvalues, so one artifact serves every rank:
 *   lowrank-g<G>-r<R>[-q<b>]   rank R per group in every layer (R <= G*head_dim)
 *   lowrank-g<G>-ev<P>[-q<b>]  per layer and group the smallest rank whose calibrated explained
 *                              variance (Σ_{j<r} λ_j / Σ_j λ_j) reaches P% (0 < P <= 100)
 *   lowrank-g<G>-b<B>[-q<b>]   a bits budget: B coefficient bits per element on average over all
 *                              layers (Σ r * cb = B * n_layers * kv_dim per token, cb the coefficient
 *                              bits), at least one direction per group, the rest given to the
 *                              directions of largest explained-variance fraction in any layer
 * Coefficients: fp16 (a cache of reduced heads in fp16) by default; -q<b>: the r coefficients of
 * each (token, group), each divided by its calibrated standard deviation sqrt(λ_j) (whitened: the
 * leading coefficients are orders of magnitude larger than the trailing ones, and one shared range
 * would leave the trailing ones a code or two), quantized to b-bit uniform asymmetric integers with
 * one fp16 (scale, zero) pair per (token, group) (kvq_quant_int_token over the r values), then
 * multiplied back; the sqrt(λ_j) are part of the projection (folded into U_r), not stored per
 * token. The first n_sink tokens (artifact) stay exact.
 *
 * The cache (form 1 of the contract, in place): each non-sink token's group x is replaced by
 * x̂ = U_r Q(U_rᵀ x), U_r the first r rows of the basis. This is exact, not an approximation of
 * the reduced cache: attention reads keys only through q·k and values only through Σ a_j v_j,
 * both linear, so q·(U_r ĉ) = (U_rᵀ q)·ĉ and Σ a_j U_r ĉ_j = U_r Σ a_j ĉ_j: a cache of reduced
 * heads holding ĉ with the query / output absorption computes the same scores and outputs as
 * the full-size cache holding U_r ĉ (up to fp32 rounding order). For post-RoPE keys the query
 * is absorbed after its own rotation; for pre-RoPE keys the reader reconstructs U_r ĉ and
 * rotates it (the forward applies RoPE after the transform), which is what a pre-RoPE cache of
 * reduced heads reads. Per token the projection and the reconstruction are plain loops in a
 * fixed order (no GEMM blocking), so a token's entry does not depend on the window length
 * (decode equivalence, bit for bit).
 *
 * Bits per element (realised counts: kvq_quant_counts.n_coef, the coefficients stored): with
 * f = n_coef / (non-sink elements) the share of kept directions,
 *   f * cb  (cb = 16, or b + 32 / r̄ for the fp16 scale and zero of each (token, group))
 *   + 16 * f * D / ctx  (the fp16 projections U_r, [D][r] per group, amortised over a context of
 *                        ctx tokens; a deployment absorbs them into W_q / W_o, the paper counts none)
 * sink tokens at 16 bits. Nominal (no counts): f = R / D (rank), B / cb (budget), 1 (ev: an upper
 * bound; kveval reports the realised value).
 *
 * Differences from the reference (the paper's abstract and summaries; its full text and code were not
 * available to us, so the section reference above is to the method part as a whole and every point
 * below that is not in the abstract is our reading): no uptraining after the conversion (kvq
 * measures the training-free conversion); any rank r, not only whole heads (the paper turns g heads
 * into g/2 or g/4 heads: r a multiple of head_dim, i.e. -r<k*head_dim>); per-layer ranks by explained
 * variance or a global bits budget (the paper: one compression ratio for all layers); optional
 * quantization of the coefficients and Fisher-weighted calibration (kvq's); calibration on the kvdump
 * windows; the RoPE handling above instead of the paper's own key strategies. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "cli.h" /* kvq_parse_double */
#include "family.h"

/* LAPACK (OpenBLAS bundles it): symmetric eigendecomposition, divide and conquer. The trailing
 * lengths are the Fortran hidden string lengths of jobz and uplo. */
extern void dsyevd_(const char *jobz, const char *uplo, const int *n, double *a, const int *lda, double *w, double *work,
                    const int *lwork, int *iwork, const int *liwork, int *info, size_t jobz_len, size_t uplo_len);

enum { LR_RANK = 0, LR_EV = 1, LR_BUDGET = 2 };
enum { LR_X_VALUE = 0, LR_X_QBITS = 1 };
#define LR_MAX_G 64

static const char *const LR_TABLES[] = {"basis", "eigval", NULL};

/* ---- spec ---- */

/* a decimal number up to the next '-' or the end */
static bool spec_num(const char **p, double *v)
{
    const char *s = *p, *e = s;
    while (*e && *e != '-') e++;
    if (e == s || e - s > 31) return false;
    char buf[32];
    memcpy(buf, s, (size_t)(e - s));
    buf[e - s] = 0;
    for (const char *c = buf; *c; c++)
        if (!(*c >= '0' && *c <= '9') && *c != '.') return false;
    if (!kvq_parse_double(buf, v)) return false;
    *p = e;
    return true;
}

static int parse_lr(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!kvq_spec_starts(b, "lowrank")) return 0;
    const char *p = b + 7;
    static const char *form = "expected lowrank-g<G>-r<R>|-ev<P>|-b<B>[-q<b>] (e.g. lowrank-g3-r96, lowrank-g1-ev95-q8)";
    unsigned long G, R, qb = 0;
    if (!kvq_spec_starts(p, "-g")) return kvq_spec_bad(spec, err, form);
    p += 2;
    if (!kvq_spec_uint(&p, LR_MAX_G, &G) || G == 0) return kvq_spec_bad(spec, err, "KV heads per group after -g: expected 1..64");
    double val;
    int mode;
    if (kvq_spec_starts(p, "-ev")) {
        p += 3;
        if (!spec_num(&p, &val) || !(val > 0 && val <= 100))
            return kvq_spec_bad(spec, err, "explained variance after -ev: expected a percentage in (0, 100]");
        mode = LR_EV;
        val /= 100.0;
    } else if (kvq_spec_starts(p, "-r")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &R) || R == 0) return kvq_spec_bad(spec, err, "rank after -r: expected an integer >= 1");
        mode = LR_RANK;
        val = (double)R;
    } else if (kvq_spec_starts(p, "-b")) {
        p += 2;
        if (!spec_num(&p, &val) || !(val > 0 && val <= 16))
            return kvq_spec_bad(spec, err, "bits budget after -b: expected coefficient bits per element in (0, 16]");
        mode = LR_BUDGET;
    } else
        return kvq_spec_bad(spec, err, form);
    if (kvq_spec_starts(p, "-q")) {
        p += 2;
        if (!kvq_spec_uint(&p, 100, &qb) || qb < 1 || qb > 8)
            return kvq_spec_bad(spec, err, "coefficient bits after -q: expected 1..8");
    }
    if (*p) return kvq_spec_bad(spec, err, form);
    q->group = G;
    q->variant = mode;
    q->x[LR_X_VALUE] = val;
    q->x[LR_X_QBITS] = (double)qb;
    q->k_bits = q->v_bits = qb ? (int)qb : 8; /* generic range; fp16 coefficients when x[QBITS] == 0 */
    return 1;
}

static void fmt_lr(const kvq_scheme *q, char *b, size_t n)
{
    char m[48], qs[16] = "";
    if (q->variant == LR_RANK) snprintf(m, sizeof m, "r%.0f", q->x[LR_X_VALUE]);
    else if (q->variant == LR_EV) snprintf(m, sizeof m, "ev%g", q->x[LR_X_VALUE] * 100.0);
    else snprintf(m, sizeof m, "b%g", q->x[LR_X_VALUE]);
    if (q->x[LR_X_QBITS] > 0) snprintf(qs, sizeof qs, "-q%.0f", q->x[LR_X_QBITS]);
    snprintf(b, n, "lowrank-g%zu-%s%s", q->group, m, qs);
}

/* bits of one stored coefficient: 16 (fp16) or the -q bits */
static double coef_bits(const kvq_scheme *q) { return q->x[LR_X_QBITS] > 0 ? q->x[LR_X_QBITS] : 16.0; }

static kvq_status validate_lr(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: lowrank has no sparse outliers, found %g", q->outlier_frac);
    if (q->group < 1 || q->group > LR_MAX_G)
        return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank KV heads per group: expected 1..%d, found %zu", LR_MAX_G, q->group);
    double v = q->x[LR_X_VALUE], qb = q->x[LR_X_QBITS];
    if (!(qb == 0 || (qb >= 1 && qb <= 8 && qb == floor(qb))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank coefficient bits: expected 0 (fp16) or 1..8, found %g", qb);
    switch (q->variant) {
    case LR_RANK:
        if (!(v >= 1 && v == floor(v))) return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank rank: expected an integer >= 1, found %g", v);
        break;
    case LR_EV:
        if (!(v > 0 && v <= 1)) return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank explained variance: expected (0, 1], found %g", v);
        break;
    case LR_BUDGET:
        if (!(v > 0 && v <= coef_bits(q)))
            return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank bits budget: expected (0, %g] (the coefficient bits: full rank), found %g",
                            coef_bits(q), v);
        break;
    default: return kvq_fail(err, KVQ_EINVAL, "scheme: lowrank mode: expected 0..2, found %d", q->variant);
    }
    return KVQ_OK;
}

static kvq_status check_model_lr(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if ((size_t)hp->n_kv_heads % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group: %zu KV heads per group do not divide n_kv_heads %d", spec, q->group,
                        hp->n_kv_heads);
    size_t D = q->group * (size_t)hp->head_dim;
    if (q->variant == LR_RANK && q->x[LR_X_VALUE] > (double)D)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': rank: %.0f exceeds the group's G * head_dim = %zu * %d = %zu channels", spec,
                        q->x[LR_X_VALUE], q->group, hp->head_dim, D);
    return KVQ_OK;
}

static bool needs_artifact_lr(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool match_lr(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "lowrank") && p->group_size == q->group &&
           (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_lr(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method lowrank with %zu KV heads per group (--group %zu)%s", q->group, q->group,
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys (--keys pre-rope)") : "");
}

static void from_params_lr(const kvq_artifact_params *p, kvq_scheme *q)
{
    /* the artifact's own scheme (kvstat): the explained-variance target stored with it, fp16 coefficients */
    q->group = p->group_size;
    q->variant = LR_EV;
    q->x[LR_X_VALUE] = p->x[0] / 100.0;
    q->x[LR_X_QBITS] = 0;
    q->k_bits = q->v_bits = 8;
    q->n_sink = p->n_sink;
}

/* ---- tables ---- */

typedef struct {
    const float *basis, *eigval; /* [ng][D][D], [ng][D] */
} lr_tab;

static kvq_status tables(const kvq_artifact *a, int layer, char side, size_t kvd, size_t G, size_t hd, lr_tab *t, kvq_err *err)
{
    if (!a || layer < 0 || (size_t)layer >= a->p.n_layers || !(side == 'k' ? a->k : a->v))
        return kvq_fail(err, KVQ_EINVAL, "lowrank: layer %d: no artifact tables bound (a kvcalib artifact of method lowrank)", layer);
    const kvq_kv_table *kt = side == 'k' ? &a->k[layer] : &a->v[layer];
    const kvq_fam_tensor *b = kvq_kv_table_get(kt, "basis"), *e = kvq_kv_table_get(kt, "eigval");
    size_t D = G * hd, ng = D ? kvd / D : 0;
    if (!b || b->n_dims != 3 || b->shape[0] != ng || b->shape[1] != D || b->shape[2] != D)
        return kvq_fail(err, KVQ_EINVAL, "lowrank: layers.%d.%c.basis: expected [%zu][%zu][%zu] (n_groups, G*head_dim, G*head_dim), found %s",
                        layer, side, ng, D, D, b ? "another shape" : "none");
    if (!e || e->n_dims != 2 || e->shape[0] != ng || e->shape[1] != D)
        return kvq_fail(err, KVQ_EINVAL, "lowrank: layers.%d.%c.eigval: expected [%zu][%zu] (n_groups, G*head_dim), found %s", layer, side,
                        ng, D, e ? "another shape" : "none");
    t->basis = b->data;
    t->eigval = e->data;
    return KVQ_OK;
}

static kvq_status check_tables_lr(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    lr_tab t;
    for (int l = 0; l < hp->n_layers; l++) {
        KVQ_TRY(tables(d->art, l, 'k', kvd, d->q.group, (size_t)hp->head_dim, &t, err));
        KVQ_TRY(tables(d->art, l, 'v', kvd, d->q.group, (size_t)hp->head_dim, &t, err));
    }
    return KVQ_OK;
}

/* The smallest r with Σ_{j<r} λ_j >= ev * Σ_j λ_j (λ descending, >= 0), at least 1. */
size_t kvq_lowrank_ev_rank(const float *eig, size_t D, double ev);
size_t kvq_lowrank_ev_rank(const float *eig, size_t D, double ev)
{
    double tot = 0, cum = 0;
    for (size_t j = 0; j < D; j++) tot += eig[j] > 0 ? eig[j] : 0;
    if (!(tot > 0) || ev >= 1) return D;
    for (size_t j = 0; j < D; j++) {
        cum += eig[j] > 0 ? eig[j] : 0;
        if (cum >= ev * tot * (1 - 1e-12)) return j + 1;
    }
    return D;
}

typedef struct {
    double v;
    unsigned l, g, j;
} lr_cand;

static int cand_cmp(const void *a, const void *b)
{
    const lr_cand *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    if (x->l != y->l) return x->l < y->l ? -1 : 1;
    if (x->g != y->g) return x->g < y->g ? -1 : 1;
    return x->j < y->j ? -1 : x->j > y->j;
}

/* Ranks of (layer, side) per group, ranks[ng]. */
static kvq_status layer_ranks(const kvq_kv_desc *d, int layer, char side, size_t kvd, size_t hd, size_t *ranks, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    size_t D = q->group * hd, ng = kvd / D;
    lr_tab t;
    KVQ_TRY(tables(d->art, layer, side, kvd, q->group, hd, &t, err));
    if (q->variant == LR_RANK) {
        for (size_t g = 0; g < ng; g++) ranks[g] = (size_t)q->x[LR_X_VALUE] < D ? (size_t)q->x[LR_X_VALUE] : D;
        return KVQ_OK;
    }
    if (q->variant == LR_EV) {
        for (size_t g = 0; g < ng; g++) ranks[g] = kvq_lowrank_ev_rank(t.eigval + g * D, D, q->x[LR_X_VALUE]);
        return KVQ_OK;
    }
    /* budget: every layer's eigenvalues, normalised by their group's total */
    size_t L = d->art->p.n_layers, nc = L * ng * (D - 1), total = L * ng * D;
    double want = q->x[LR_X_VALUE] / coef_bits(q) * (double)total;
    size_t keep = (size_t)floor(want + 1e-9);
    if (keep < L * ng) keep = L * ng;
    if (keep > total) keep = total;
    lr_cand *c = malloc((nc ? nc : 1) * sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ENOMEM, "lowrank: cannot allocate %zu budget candidates", nc);
    size_t n = 0;
    for (size_t l = 0; l < L; l++) {
        lr_tab tl;
        kvq_status s = tables(d->art, (int)l, side, kvd, q->group, hd, &tl, err);
        if (s) {
            free(c);
            return s;
        }
        for (size_t g = 0; g < ng; g++) {
            const float *e = tl.eigval + g * D;
            double tot = 0;
            for (size_t j = 0; j < D; j++) tot += e[j] > 0 ? e[j] : 0;
            for (size_t j = 1; j < D; j++)
                c[n++] = (lr_cand){.v = tot > 0 && e[j] > 0 ? e[j] / tot : 0, .l = (unsigned)l, .g = (unsigned)g, .j = (unsigned)j};
        }
    }
    qsort(c, n, sizeof *c, cand_cmp);
    for (size_t g = 0; g < ng; g++) ranks[g] = 1;
    for (size_t i = 0; i < keep - L * ng && i < n; i++)
        if (c[i].l == (unsigned)layer) ranks[c[i].g]++;
    free(c);
    return KVQ_OK;
}

/* The scale of coefficient j before integer quantization: its calibrated standard deviation sqrt(λ_j)
 * (1 where λ_j is 0). */
static float coef_sigma(float eig)
{
    float s = sqrtf(eig);
    return s > 0 && isfinite(s) ? s : 1.0f;
}

/* One token's group x[D] -> U_r Q(U_rᵀ x), fixed-order loops (B: r rows of D, the leading directions;
 * eig: their eigenvalues, the integer coefficients' whitening). */
static kvq_status project_token(float *out, const float *x, const float *B, const float *eig, size_t D, size_t r, int qbits,
                                float *coef, kvq_quant_counts *cc, kvq_err *err)
{
    for (size_t j = 0; j < r; j++) {
        const float *bj = B + j * D;
        float s = 0;
        for (size_t i = 0; i < D; i++) s += bj[i] * x[i];
        coef[j] = s;
    }
    if (qbits) { /* whitened: every coefficient in units of its own calibrated spread, then one (scale, zero) */
        for (size_t j = 0; j < r; j++) coef[j] /= coef_sigma(eig[j]);
        KVQ_TRY(kvq_quant_int_token(coef, coef, 1, r, 0, qbits, 0, NULL, err));
        for (size_t j = 0; j < r; j++) coef[j] *= coef_sigma(eig[j]);
    } else
        kvq_quant_fp16(coef, coef, r, cc);
    float acc[LR_MAX_G * 256];
    float *a = D <= sizeof acc / sizeof *acc ? acc : out; /* out may alias x: accumulate aside when it fits */
    for (size_t i = 0; i < D; i++) a[i] = 0;
    for (size_t j = 0; j < r; j++) {
        const float *bj = B + j * D;
        const float cj = coef[j];
        for (size_t i = 0; i < D; i++) a[i] += cj * bj[i];
    }
    if (a != out) memcpy(out, a, D * sizeof *out);
    return KVQ_OK;
}

/* Every non-sink token's groups of D = G*head_dim channels replaced by their rank-ranks[g] projections. */
kvq_status kvq_lowrank_apply(float *out, const float *in, size_t T, size_t kvd, size_t D, const float *basis, const float *eigval,
                             const size_t *ranks, int qbits, size_t n_sink, kvq_quant_counts *cnt, kvq_err *err);
kvq_status kvq_lowrank_apply(float *out, const float *in, size_t T, size_t kvd, size_t D, const float *basis, const float *eigval,
                             const size_t *ranks, int qbits, size_t n_sink, kvq_quant_counts *cnt, kvq_err *err)
{
    if (D == 0 || kvd % D || D > LR_MAX_G * 256)
        return kvq_fail(err, KVQ_EINVAL, "lowrank: group of %zu channels, kv_dim %zu (expected a divisor of kv_dim, at most %d)", D, kvd,
                        LR_MAX_G * 256);
    size_t ng = kvd / D, ns = n_sink < T ? n_sink : T, rsum = 0;
    for (size_t g = 0; g < ng; g++) {
        if (ranks[g] < 1 || ranks[g] > D) return kvq_fail(err, KVQ_EINVAL, "lowrank: group %zu: rank %zu outside 1..%zu", g, ranks[g], D);
        rsum += ranks[g];
    }
    if (out != in) memcpy(out, in, ns * kvd * sizeof *out);
    long long n = (long long)(T - ns);
    int failed = 0;
    uint64_t clipped = 0;
    kvq_err e1 = {0};
#pragma omp parallel if (n * (long long)(rsum * D) > (1ll << 20))
    {
        float *coef = malloc(D * sizeof *coef);
        kvq_quant_counts lc = {0};
        kvq_err le = {0};
#pragma omp for schedule(static)
        for (long long i = 0; i < n; i++) {
            size_t t = ns + (size_t)i;
            for (size_t g = 0; g < ng && coef; g++)
                if (project_token(out + t * kvd + g * D, in + t * kvd + g * D, basis + g * D * D, eigval + g * D, D, ranks[g], qbits,
                                  coef, &lc, &le)) {
#pragma omp atomic write
                    failed = 1;
                }
        }
#pragma omp critical(kvq_lowrank_apply)
        {
            if (!coef) failed = 2;
            if (failed == 1 && le.msg[0] && !e1.msg[0]) e1 = le;
            clipped += lc.n_clipped;
        }
        free(coef);
    }
    if (failed == 2) return kvq_fail(err, KVQ_ENOMEM, "lowrank: cannot allocate %zu coefficients", D);
    if (failed) {
        if (err) *err = e1;
        return KVQ_EINVAL;
    }
    if (cnt) {
        cnt->n_elems += (uint64_t)T * kvd;
        cnt->n_sink += (uint64_t)ns * kvd;
        cnt->n_coef += (uint64_t)(T - ns) * rsum;
        cnt->n_clipped += clipped;
    }
    return KVQ_OK;
}

static kvq_status quantize_lr(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                              size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    size_t D = d->q.group * hd, ng = D ? kvd / D : 0;
    if (!D || kvd % D)
        return kvq_fail(err, KVQ_EINVAL, "lowrank: %zu KV heads per group of head_dim %zu do not divide kv_dim %zu", d->q.group, hd, kvd);
    lr_tab t;
    KVQ_TRY(tables(d->art, layer, side, kvd, d->q.group, hd, &t, err));
    size_t *r = malloc(ng * sizeof *r);
    if (!r) return kvq_fail(err, KVQ_ENOMEM, "lowrank: cannot allocate %zu ranks", ng);
    kvq_status s = layer_ranks(d, layer, side, kvd, hd, r, err);
    if (!s) s = kvq_lowrank_apply(out, in, T, kvd, D, t.basis, t.eigval, r, (int)d->q.x[LR_X_QBITS], d->q.n_sink, c, err);
    free(r);
    return s;
}

/* ---- bits ---- */

static double side_bits(const kvq_scheme *q, const kvq_bits_in *in, const kvq_quant_counts *c)
{
    size_t hd = in->head_dim ? in->head_dim : in->kv_dim; /* unknown head_dim: the nominal share needs D only for ranks */
    double D = (double)(q->group * hd), f;
    uint64_t dense = c ? c->n_elems - c->n_sink : 0;
    if (c && dense && c->n_coef) f = (double)c->n_coef / (double)dense;
    else if (q->variant == LR_RANK) f = q->x[LR_X_VALUE] / D;
    else if (q->variant == LR_BUDGET) f = q->x[LR_X_VALUE] / coef_bits(q);
    else f = 1;
    if (f > 1) f = 1;
    double cb = q->x[LR_X_QBITS] > 0 ? q->x[LR_X_QBITS] + 32.0 / (f * D) : 16.0;
    double dense_bits = f * cb + 16.0 * f * D / (double)in->ctx;
    return kvq_bits_mix16(dense_bits, in->ctx, q->n_sink);
}

static kvq_status bits_lr(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    out->k = side_bits(q, in, in->k);
    out->v = side_bits(q, in, in->v);
    return KVQ_OK;
}

static int code_bits_lr(const kvq_scheme *q, char side)
{
    (void)side;
    return (int)coef_bits(q);
}

static void describe_lr(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "kv_heads_per_group", (double)q->group);
    o->str(o->ctx, "rank_rule", q->variant == LR_RANK ? "rank" : q->variant == LR_EV ? "explained-variance" : "bits-budget");
    o->num(o->ctx, q->variant == LR_RANK ? "rank" : q->variant == LR_EV ? "explained_variance" : "bits_budget", q->x[LR_X_VALUE]);
    o->num(o->ctx, "coefficient_bits", coef_bits(q));
}

/* ---- artifact and calibration ---- */

static const char *const *tensors_lr(const kvq_artifact_params *p, char side)
{
    (void)p;
    (void)side;
    return LR_TABLES;
}

static kvq_status check_tensors_lr(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    size_t D = p->group_size * p->head_dim, ng = D ? p->n_kv_heads * p->head_dim / D : 0;
    const kvq_fam_tensor *b = kvq_kv_table_get(t, "basis"), *e = kvq_kv_table_get(t, "eigval");
    if (b->n_dims != 3 || b->shape[0] != ng || b->shape[1] != D || b->shape[2] != D)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.basis: expected shape [%zu, %zu, %zu] (n_groups, G*head_dim, G*head_dim), found %u "
                        "dimensions [%llu, %llu, %llu]", layer, side, ng, D, D, b->n_dims, (unsigned long long)b->shape[0],
                        (unsigned long long)(b->n_dims > 1 ? b->shape[1] : 0), (unsigned long long)(b->n_dims > 2 ? b->shape[2] : 0));
    if (e->n_dims != 2 || e->shape[0] != ng || e->shape[1] != D)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.eigval: expected shape [%zu, %zu] (n_groups, G*head_dim), found %u dimensions "
                        "[%llu, %llu]", layer, side, ng, D, e->n_dims, (unsigned long long)e->shape[0],
                        (unsigned long long)(e->n_dims > 1 ? e->shape[1] : 0));
    for (size_t g = 0; g < ng; g++)
        for (size_t j = 0; j < D; j++) {
            float v = e->data[g * D + j];
            if (!isfinite(v) || v < 0 || (j && v > e->data[g * D + j - 1]))
                return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.eigval[%zu][%zu]: expected finite, >= 0 and descending, found %g", layer,
                                side, g, j, v);
            double nn = 0;
            for (size_t i = 0; i < D; i++) {
                float x = b->data[(g * D + j) * D + i];
                if (!isfinite(x)) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.basis[%zu][%zu][%zu]: expected finite, found %g", layer, side, g, j, i, x);
                nn += (double)x * x;
            }
            if (fabs(nn - 1) > 1e-3)
                return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.basis[%zu][%zu]: expected a unit vector, found squared norm %g", layer, side, g,
                                j, nn);
        }
    return KVQ_OK;
}

static kvq_status check_params_lr(const kvq_artifact_params *p, kvq_err *err)
{
    if (p->group_size < 1 || p->group_size > LR_MAX_G || (p->n_kv_heads && p->n_kv_heads % p->group_size))
        return kvq_fail(err, KVQ_EINVAL, "group_size: lowrank's KV heads per group must divide n_kv_heads %zu, found %zu", p->n_kv_heads,
                        p->group_size);
    if (p->group_size * p->head_dim > LR_MAX_G * 256)
        return kvq_fail(err, KVQ_EINVAL, "group_size: lowrank's group of %zu x %zu channels exceeds %d", p->group_size, p->head_dim,
                        LR_MAX_G * 256);
    double ev = p->x[0];
    if (!(ev > 0 && ev <= 100))
        return kvq_fail(err, KVQ_EINVAL, "ev: expected a percentage in (0, 100] (the artifact's own scheme lowrank-g<G>-ev<P>), found %g", ev);
    return KVQ_OK;
}

static void inspect_lr(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "lowrank       %zu KV heads per group (%zu channels), eigendecomposition of the %s second moment of the %s keys and "
               "the values; own scheme lowrank-g%zu-ev%g\n",
            p->group_size, p->group_size * p->head_dim, p->fisher ? "Fisher-weighted" : "plain", p->post_rope ? "post-RoPE" : "pre-RoPE",
            p->group_size, p->x[0]);
}

/* Eigendecomposition of the symmetric C[D][D] (float64, overwritten): eigenvalues descending into w, the
 * eigenvectors as the rows of C, each signed so that its largest-magnitude entry is positive. */
kvq_status kvq_lowrank_eig(double *C, size_t D, double *w, kvq_err *err);
kvq_status kvq_lowrank_eig(double *C, size_t D, double *w, kvq_err *err)
{
    int n = (int)D, lwork = -1, liwork = -1, info = 0, iq;
    double wq;
    dsyevd_("V", "U", &n, C, &n, w, &wq, &lwork, &iq, &liwork, &info, 1, 1);
    if (info) return kvq_fail(err, KVQ_EINVAL, "lowrank: dsyevd workspace query failed (info %d)", info);
    lwork = (int)wq;
    liwork = iq;
    double *work = malloc((size_t)lwork * sizeof *work);
    int *iwork = malloc((size_t)liwork * sizeof *iwork);
    if (!work || !iwork) {
        free(work);
        free(iwork);
        return kvq_fail(err, KVQ_ENOMEM, "lowrank: cannot allocate the eigensolver's workspace (%d doubles)", lwork);
    }
    dsyevd_("V", "U", &n, C, &n, w, work, &lwork, iwork, &liwork, &info, 1, 1);
    free(work);
    free(iwork);
    if (info) return kvq_fail(err, KVQ_EINVAL, "lowrank: dsyevd failed to converge (info %d) on a %zu x %zu second-moment matrix", info, D, D);
    /* column-major: eigenvector j (ascending) is C[j*D .. j*D+D-1]; reverse to descending */
    for (size_t a = 0, b = D - 1; a < b; a++, b--) {
        double t = w[a];
        w[a] = w[b];
        w[b] = t;
        for (size_t i = 0; i < D; i++) {
            t = C[a * D + i];
            C[a * D + i] = C[b * D + i];
            C[b * D + i] = t;
        }
    }
    for (size_t j = 0; j < D; j++) {
        double *v = C + j * D;
        size_t im = 0;
        for (size_t i = 1; i < D; i++)
            if (fabs(v[i]) > fabs(v[im])) im = i;
        if (v[im] < 0)
            for (size_t i = 0; i < D; i++) v[i] = -v[i];
    }
    return KVQ_OK;
}

/* One side of one layer: per group the eigendecomposition of the (weighted) second moment of the non-sink tokens. */
static kvq_status fit_lr(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out, kvq_err *err)
{
    (void)side;
    size_t hd = in->head_dim, kvd = in->n_kv_heads * hd, D = p->group_size * hd, ng = kvd / D;
    size_t per = in->sample_len ? in->sample_len : in->n_tokens, ns = p->n_sink < per ? p->n_sink : per;
    size_t avail = in->n_tokens / per * (per - ns);
    if (avail == 0)
        return kvq_fail(err, KVQ_EINVAL, "lowrank: no calibration tokens left after excluding %zu sink tokens per sample of %zu", ns, per);
    enum { BLK = 512 };
    double *C = malloc(D * D * sizeof *C), *w = malloc(D * sizeof *w), *X = malloc(BLK * D * sizeof *X);
    float *basis, *eig;
    if (!C || !w || !X) {
        free(C);
        free(w);
        free(X);
        return kvq_fail(err, KVQ_ENOMEM, "lowrank: cannot allocate a %zu x %zu second-moment matrix", D, D);
    }
    uint64_t sb[3] = {ng, D, D}, se[2] = {ng, D};
    kvq_status s = kvq_kv_table_add(out, "basis", 3, sb, &basis, err);
    if (!s) s = kvq_kv_table_add(out, "eigval", 2, se, &eig, err);
    for (size_t g = 0; !s && g < ng; g++) {
        memset(C, 0, D * D * sizeof *C);
        double wsum = 0;
        size_t nb = 0;
        for (size_t a = 0; a <= avail; a++) {
            if (a < avail) {
                size_t t = a / (per - ns) * per + ns + a % (per - ns);
                const float *x = in->x + t * kvd + g * D;
                double wt = 1;
                if (in->fisher) {
                    wt = 0;
                    for (size_t i = 0; i < D; i++) wt += in->fisher[t * kvd + g * D + i];
                }
                wsum += wt;
                double sw = sqrt(wt);
                for (size_t i = 0; i < D; i++) X[nb * D + i] = sw * (double)x[i];
                nb++;
            }
            if (nb == BLK || (a == avail && nb)) { /* C += Xᵀ X (upper triangle, column-major = lower of row-major) */
                cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, (int)D, (int)nb, 1.0, X, (int)D, 1.0, C, (int)D);
                nb = 0;
            }
        }
        if (!(wsum > 0)) {
            s = kvq_fail(err, KVQ_EINVAL, "lowrank: group %zu: the calibration weights sum to %g (Fisher information all zero: --no-fisher "
                         "calibrates unweighted)", g, wsum);
            break;
        }
        for (size_t i = 0; i < D * D; i++) C[i] /= wsum;
        s = kvq_lowrank_eig(C, D, w, err);
        if (s) {
            kvq_err_prefix(err, "lowrank: group %zu (KV heads %zu..%zu)", g, g * p->group_size, g * p->group_size + p->group_size - 1);
            break;
        }
        for (size_t j = 0; j < D; j++) {
            eig[g * D + j] = (float)(w[j] > 0 ? w[j] : 0);
            for (size_t i = 0; i < D; i++) basis[(g * D + j) * D + i] = (float)C[j * D + i];
        }
        for (size_t j = 1; j < D; j++) /* float rounding must not break the descending order */
            if (eig[g * D + j] > eig[g * D + j - 1]) eig[g * D + j] = eig[g * D + j - 1];
    }
    free(C);
    free(w);
    free(X);
    if (s) {
        kvq_kv_table_free(out);
        return s;
    }
    out->bits = p->k_bits;
    out->kv_dim = kvd;
    out->n_elems = (uint64_t)avail * kvd;
    out->n_points = (uint64_t)avail * ng;
    return KVQ_OK;
}

static const kvq_family_artifact art_lr = {
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "low-rank-projection-per-kv-head-group",
    .v_scaling = "low-rank-projection-per-kv-head-group",
    .check_params = check_params_lr,
    .inspect = inspect_lr,
    .tensors = tensors_lr,
    .check_tensors = check_tensors_lr,
    .params = (const char *const[]){"ev", NULL},
};

/* plain (unweighted) SVD of the cache as the paper's summaries describe, post-RoPE keys (kvq's choice, header), no sink; groups of one KV head by
 * default (every model's n_kv_heads is a multiple of 1) */
static const kvq_family_calib calib_lr = {
    .bits = 8,
    .bits_free = true,
    .group = 1,
    .post_rope = true,
    .fisher = false,
    .pre_rope_ok = true,
    .fisher_opt = true,
    .group_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit = fit_lr,
    .x = {90},
};

const kvq_family kvq_family_lowrank = {
    .name = "lowrank",
    .syntax = "lowrank-g<G>-r<R>|-ev<P>|-b<B>[-q<b>] (G KV heads per group, rank R, P% explained variance or B bits budget)",
    .summary = "low-rank KV heads (arXiv 2406.07056 §3): each group of G KV heads projected onto the leading principal directions of "
               "its calibration cache (fp16 or b-bit coefficients), the reduced heads read through query / output absorption; "
               "post-RoPE keys; tables from a kvcalib artifact",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_lr,
    .format = fmt_lr,
    .validate = validate_lr,
    .check_model = check_model_lr,
    .needs_artifact = needs_artifact_lr,
    .match = match_lr,
    .describe_need = need_lr,
    .from_params = from_params_lr,
    .check_tables = check_tables_lr,
    .artifact = &art_lr,
    .calib = &calib_lr,
    .quantize = quantize_lr,
    .describe = describe_lr,
    .bits = bits_lr,
    .code_bits = code_bits_lr,
};
