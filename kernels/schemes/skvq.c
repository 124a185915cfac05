/* skvq.c — SKVQ: sliding-window KV cache quantization with channel reordering and clipped dynamic
 * group quantization (Duanmu et al., "SKVQ: Sliding-window Key and Value Cache Quantization for Large
 * Language Models", arXiv 2405.06219, COLM 2024; reference code github.com/cat538/SKVQ:
 * calibration.py, KV_process.py, KVcache_manager.py). Only the abstract of the paper could be read here:
 * the section numbers below (§3.1 clipped dynamic quantization with channel reorder, §3.2 the sliding
 * window and its filter rules) were not checked against the PDF; every rule was checked against the
 * reference code, which the lines name.
 *   §3.1 channel reordering: the channels of a layer's keys (and values) are clustered offline by
 *        their calibration (min, max) with k-means into kv_dim / G clusters, the channels are permuted
 *        so that every cluster is contiguous and each cluster is one quantization group (groups of
 *        unequal size, G channels on average; reference get_reorder_indices, metric "minmax");
 *   §3.1 clipped dynamic quantization: per token and group, asymmetric min/max quantization with the
 *        range shrunk by a clip ratio a: zero point a min, scale max(a (max - min) / (2^b - 1), 1e-5),
 *        q = round(clamp((x - a min) / scale, 0, 2^b - 1)) (reference KV_process.py quant());
 *        one a per layer and side, calibrated offline;
 *   §3.2 sliding window: the W most recent tokens stay in full precision (W = 128 in the paper);
 *   §3.2 filter rules: the attention-sink tokens, the first n_sink of the sequence (the reference's
 *        "sink5"), stay in full precision.
 *
 * Spec: skvq<b>[-w<W>] (default W = 128), bound to a kvcalib artifact of method skvq with b-bit keys and
 * values; +sink<N> defaults to the artifact's (kvcalib --sink, default 5); keys as the artifact says
 * (kvcalib --keys, default pre-RoPE as the reference's "pre_rope"; +post-rope with a post-RoPE artifact).
 * The sink and the window must be shorter than the evaluation's context (refused before any work).
 *
 * Tables (artifact, per layer and side k / v; ARTIFACT.md):
 *   perm        [kv_dim]         reordered position r holds channel perm[r] (a permutation of 0..kv_dim-1, as floats);
 *   group_start [n_groups + 1]   reordered positions where each group starts, 0 first, kv_dim last, increasing;
 *   clip        [1]              the clip ratio a, (0, 1];
 * parameter kvq.skvq.clip: 0 (default) searches a per layer and side over 1.00, 0.99, ..., 0.50 for the
 * least squared reconstruction error of the dump's tokens (sink tokens excluded); a value in (0, 1]
 * fixes it (the reference README's "unified clipping", 0.91-0.97).
 *
 * Decode semantics (kernels/model/forward.h, contract form 2): the transform keeps the exact K/V and gives
 * the quantized ones (sink tokens exact) as the alternative, read by query i for keys j < i + 1 - W: the
 * token leaving the window is quantized from its exact value, per token, so what query i reads depends
 * on tokens <= i only.
 *
 * Bits per element: the sink and min(W, ctx - n_sink) window tokens at 16; the rest b + 32 n_groups /
 * kv_dim (an fp16 scale and zero point per token and group; n_groups = kv_dim / G as calibrated), plus
 * the permutation (16 bits per channel) and group starts amortised over the context (16 (kv_dim +
 * n_groups + 1) / (kv_dim ctx)).
 *
 * Where kvq differs from the reference code:
 *   - the window: the reference flushes keys from the fp16 window in blocks of W (KIVI's layout,
 *     KVcache_manager.py) and values one token at a time; kvq slides both one token at a time (the
 *     paper's sliding window), and simulates every query of the evaluation window as a decode step
 *     (the reference's prefill attends the exact K/V);
 *   - calibration statistics exclude the sink tokens of every sample (they are never quantized); the
 *     reference takes channel min / max over every token of its calibration set;
 *   - k-means: Lloyd's algorithm with k-means++ seeding (10 restarts, fixed seeds per layer and side,
 *     the least inertia kept; empty clusters dropped), clusters ordered by their centroid, instead of
 *     scikit-learn's KMeans(n_init=10);
 *   - the clip ratio is searched per layer and side for the least K / V reconstruction error (the paper
 *     calibrates a per-layer ratio; the released code hard-codes one ratio); kvq keeps fp32 scales
 *     (the reference's -fp8 option stores them in FP8, not modelled).
 *   - kvstat (the family's quantize) shows the resting cache: the sink and the last W tokens exact. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"

enum { SK_W = 128, SK_SINK = 5, SK_G = 128, SK_RESTARTS = 10, SK_ITERS = 300 };
#define SK_CLIP_LO 0.50

/* ---- spec ------------------------------------------------------------------------------ */

static int parse_skvq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits, w = SK_W;
    const char *p = b;
    int rc = kvq_spec_bits(&p, "skvq", spec, &bits, err);
    if (rc <= 0) return rc;
    if (kvq_spec_starts(p, "-w")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 24, &w)) return kvq_spec_bad(spec, err, "sliding window after -w: expected an integer >= 0");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected skvq<b>[-w<W>] (e.g. skvq2-w128)");
    q->k_bits = q->v_bits = (int)bits;
    q->residual = w;
    return 1;
}

static void fmt_skvq(const kvq_scheme *q, char *b, size_t n)
{
    snprintf(b, n, "skvq%d-w%zu", q->k_bits, q->residual);
}

static kvq_status validate_skvq(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0) return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: skvq has no sparse outliers, found %g", q->outlier_frac);
    if (q->k_bits != q->v_bits) return kvq_fail(err, KVQ_EINVAL, "scheme: skvq: k_bits %d and v_bits %d differ", q->k_bits, q->v_bits);
    return KVQ_OK;
}

static kvq_status check_ctx_skvq(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (q->n_sink + q->residual >= ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: the sink (%zu) and the sliding window (%zu) must be shorter than the context "
                        "(%zu tokens): nothing would ever be quantized", name, q->n_sink, q->residual, ctx);
    return KVQ_OK;
}

static void describe_skvq(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "group_size", (double)q->group);
    o->num(o->ctx, "recent_window", (double)q->residual);
    o->str(o->ctx, "groups", "k-means channel clusters (artifact)");
    o->str(o->ctx, "clip", "per layer and side (artifact)");
}

/* ---- artifact ------------------------------------------------------------------------------ */

static bool needs_artifact_skvq(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool match_skvq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "skvq") && p->k_bits == q->k_bits && p->v_bits == q->v_bits &&
           (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_skvq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "the channel permutation, groups and clip ratios: a kvcalib artifact of method skvq, %d bits%s", q->k_bits,
             !stage_set ? "" : stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys");
}

static void bind_skvq(kvq_scheme *q, const kvq_artifact_params *p) { q->group = p->group_size; }

static void from_params_skvq(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
    q->residual = SK_W;
}

static const char *const tab_names[] = {"perm", "group_start", "clip", NULL};
static const char *const param_names[] = {"clip", NULL};

static const char *const *tensors_skvq(const kvq_artifact_params *p, char side)
{
    (void)p;
    (void)side;
    return tab_names;
}

static kvq_status check_tables_one(const kvq_kv_table *t, size_t kvd, const char *where, kvq_err *err)
{
    const kvq_fam_tensor *pm = kvq_kv_table_get(t, "perm"), *gs = kvq_kv_table_get(t, "group_start"),
                         *cl = kvq_kv_table_get(t, "clip");
    if (!pm || !gs || !cl) return kvq_fail(err, KVQ_EINVAL, "%s: missing table %s", where, !pm ? "perm" : !gs ? "group_start" : "clip");
    if (pm->n_dims != 1 || pm->shape[0] != kvd)
        return kvq_fail(err, KVQ_EINVAL, "%s.perm: expected shape [%zu] (kv_dim), found %u dims, first %llu", where, kvd, pm->n_dims,
                        (unsigned long long)pm->shape[0]);
    unsigned char *seen = calloc(kvd, 1);
    if (!seen) return kvq_fail(err, KVQ_ENOMEM, "%s.perm: out of memory", where);
    for (size_t r = 0; r < kvd; r++) {
        float x = pm->data[r];
        if (!(x >= 0 && x < (float)kvd && x == floorf(x)) || seen[(size_t)x]) {
            free(seen);
            return kvq_fail(err, KVQ_EINVAL, "%s.perm[%zu]: expected a channel index 0..%zu not used before (a permutation), found %g",
                            where, r, kvd - 1, (double)x);
        }
        seen[(size_t)x] = 1;
    }
    free(seen);
    if (gs->n_dims != 1 || gs->shape[0] < 2 || gs->shape[0] > kvd + 1)
        return kvq_fail(err, KVQ_EINVAL, "%s.group_start: expected shape [n_groups + 1] with 1 <= n_groups <= %zu, found %u dims, first %llu",
                        where, kvd, gs->n_dims, (unsigned long long)gs->shape[0]);
    size_t ng = (size_t)gs->shape[0] - 1;
    if (gs->data[0] != 0 || gs->data[ng] != (float)kvd)
        return kvq_fail(err, KVQ_EINVAL, "%s.group_start: expected 0 first and %zu (kv_dim) last, found %g and %g", where, kvd,
                        (double)gs->data[0], (double)gs->data[ng]);
    for (size_t g = 1; g <= ng; g++)
        if (!(gs->data[g] > gs->data[g - 1] && gs->data[g] == floorf(gs->data[g])))
            return kvq_fail(err, KVQ_EINVAL, "%s.group_start[%zu]: expected an integer above %g (groups are not empty), found %g", where,
                            g, (double)gs->data[g - 1], (double)gs->data[g]);
    if (cl->n_dims != 1 || cl->shape[0] != 1 || !(cl->data[0] > 0 && cl->data[0] <= 1))
        return kvq_fail(err, KVQ_EINVAL, "%s.clip: expected one ratio in (0, 1], found %g", where, (double)cl->data[0]);
    return KVQ_OK;
}

static kvq_status check_tensors_skvq(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    char where[64];
    snprintf(where, sizeof where, "layers.%zu.%c", layer, side);
    return check_tables_one(t, p->n_kv_heads * p->head_dim, where, err);
}

static kvq_status check_params_skvq(const kvq_artifact_params *p, kvq_err *err)
{
    if (!(p->x[0] == 0 || (p->x[0] > 0 && p->x[0] <= 1)))
        return kvq_fail(err, KVQ_EINVAL, "kvq.skvq.clip: expected 0 (search per layer) or a ratio in (0, 1], found %g", p->x[0]);
    size_t kvd = p->n_kv_heads * p->head_dim;
    if (p->group_size == 0 || (kvd && kvd % p->group_size))
        return kvq_fail(err, KVQ_EINVAL, "group_size: skvq clusters kv_dim %zu channels into kv_dim / G groups: expected G dividing it, found %zu",
                        kvd, p->group_size);
    if (p->k_bits != p->v_bits) return kvq_fail(err, KVQ_EINVAL, "bits: skvq: k_bits %d and v_bits %d differ", p->k_bits, p->v_bits);
    return KVQ_OK;
}

static void inspect_skvq(FILE *f, const kvq_artifact_params *p)
{
    if (p->x[0] > 0) fprintf(f, "skvq          k-means channel groups (kv_dim / %zu clusters), clip ratio %g (fixed)\n", p->group_size, p->x[0]);
    else fprintf(f, "skvq          k-means channel groups (kv_dim / %zu clusters), clip ratio searched per layer and side\n", p->group_size);
}

static kvq_status check_tables_skvq(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!d->art || !d->art->k || !d->art->v || d->art->p.n_layers != (size_t)hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: skvq needs the tables of %d layers (an artifact of method skvq)", hp->n_layers);
    for (int l = 0; l < hp->n_layers; l++)
        for (int w = 0; w < 2; w++) {
            char where[64];
            snprintf(where, sizeof where, "layers.%d.%c", l, w ? 'v' : 'k');
            KVQ_TRY(check_tables_one(w ? &d->art->v[l] : &d->art->k[l], (size_t)kvq_kv_dim(hp), where, err));
        }
    return KVQ_OK;
}

/* ---- the quantizer ------------------------------------------------------------------------- */

/* One token row x[kvd] -> y: per group of reordered channels, clipped asymmetric min/max (reference quant()) */
static void quant_row(float *y, const float *x, size_t kvd, const float *perm, const float *gs, size_t ng, float clip, int bits)
{
    const float mx = (float)((1 << bits) - 1);
    (void)kvd;
    for (size_t g = 0; g < ng; g++) {
        size_t r0 = (size_t)gs[g], r1 = (size_t)gs[g + 1];
        float lo = x[(size_t)perm[r0]], hi = lo;
        for (size_t r = r0 + 1; r < r1; r++) {
            float v = x[(size_t)perm[r]];
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        lo *= clip;
        hi *= clip;
        float s = (hi - lo) / mx;
        if (!(s >= 1e-5f)) s = 1e-5f;
        for (size_t r = r0; r < r1; r++) {
            size_t c = (size_t)perm[r];
            float u = (x[c] - lo) / s;
            u = u < 0 ? 0 : u > mx ? mx : u;
            y[c] = rintf(u) * s + lo;
        }
    }
}

typedef struct {
    const float *perm, *gs;
    size_t ng;
    float clip;
} sk_tabs;

static kvq_status tabs(const kvq_kv_desc *d, int layer, char side, sk_tabs *t, kvq_err *err)
{
    if (!d->art || !(side == 'k' ? d->art->k : d->art->v))
        return kvq_fail(err, KVQ_EINVAL, "skvq: layer %d %c: no artifact tables bound", layer, side);
    const kvq_kv_table *tb = side == 'k' ? &d->art->k[layer] : &d->art->v[layer];
    const kvq_fam_tensor *pm = kvq_kv_table_get(tb, "perm"), *gs = kvq_kv_table_get(tb, "group_start"), *cl = kvq_kv_table_get(tb, "clip");
    if (!pm || !gs || !cl) return kvq_fail(err, KVQ_EINVAL, "skvq: layers.%d.%c: tables missing", layer, side);
    *t = (sk_tabs){.perm = pm->data, .gs = gs->data, .ng = (size_t)gs->shape[0] - 1, .clip = cl->data[0]};
    return KVQ_OK;
}

/* rows [n_sink, T) quantized, the sink copied exactly */
static kvq_status quant_side(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd, size_t ns,
                             kvq_err *err)
{
    sk_tabs t = {0};
    KVQ_TRY(tabs(d, layer, side, &t, err));
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    int bits = side == 'k' ? d->q.k_bits : d->q.v_bits;
    for (size_t i = ns; i < T; i++) quant_row(out + i * kvd, in + i * kvd, kvd, t.perm, t.gs, t.ng, t.clip, bits);
    return KVQ_OK;
}

/* kvstat: the resting cache, the sink and the last W tokens exact */
static kvq_status quantize_skvq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd, size_t hd,
                                kvq_quant_counts *c, kvq_err *err)
{
    (void)hd;
    const kvq_scheme *q = &d->q;
    size_t ns = q->n_sink < T ? q->n_sink : T, w = T - ns < q->residual ? T - ns : q->residual;
    KVQ_TRY(quant_side(d, layer, side, out, in, T - w, kvd, ns, err));
    if (out != in && w) memmove(out + (T - w) * kvd, in + (T - w) * kvd, w * kvd * sizeof(float));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
        c->n_exact += w * kvd;
    }
    return KVQ_OK;
}

static void bounds_skvq(const kvq_scheme *q, size_t T, int *kb, int *vb)
{
    for (size_t i = 0; i < T; i++) {
        long b = (long)i + 1 - (long)q->residual;
        kb[i] = vb[i] = b > 0 ? (int)b : 0;
    }
}

static kvq_status transform_skvq(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    const kvq_kv_desc *d = run->d;
    size_t T = (size_t)c->T, kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim, ns = d->q.n_sink < T ? d->q.n_sink : T;
    KVQ_TRY(quant_side(d, c->layer, 'k', alt->k, k, T, kvd, ns, err));
    KVQ_TRY(quant_side(d, c->layer, 'v', alt->v, v, T, kvd, ns, err));
    bounds_skvq(&d->q, T, alt->k_bound, alt->v_bound);
    alt->use_k = alt->use_v = true;
    /* the resting cache the window's last query read */
    size_t w = T - ns < d->q.residual ? T - ns : d->q.residual;
    for (int s = 0; s < 2; s++) {
        kvq_quant_counts *q = s ? &run->v_counts : &run->k_counts;
        q->n_elems += T * kvd;
        q->n_sink += ns * kvd;
        q->n_exact += w * kvd;
    }
    return KVQ_OK;
}

/* ---- bits ------------------------------------------------------------------------------------ */

static kvq_status bits_skvq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (in->ctx == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx: expected > 0, found 0");
    size_t kvd = in->kv_dim, G = q->group ? q->group : SK_G, ctx = in->ctx, ns = q->n_sink < ctx ? q->n_sink : ctx;
    size_t w = ctx - ns < q->residual ? ctx - ns : q->residual;
    double ng = (double)kvd / (double)G;
    double tables = 16.0 * ((double)kvd + ng + 1) / ((double)kvd * (double)ctx);
    out->k = kvq_bits_mix16(q->k_bits + 32.0 * ng / (double)kvd, ctx, ns + w) + tables;
    out->v = kvq_bits_mix16(q->v_bits + 32.0 * ng / (double)kvd, ctx, ns + w) + tables;
    return KVQ_OK;
}

/* ---- calibration ------------------------------------------------------------------------------ */

static uint32_t lcg(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* k-means of n 2-D points (double) into k clusters: Lloyd's algorithm, k-means++ seeding, `restarts` runs from
 * seeds derived from `seed`, the least inertia kept. lab[n] receives cluster indices 0..k-1. */
static kvq_status kmeans2(const double *x, size_t n, size_t k, uint32_t seed, int *lab, kvq_err *err)
{
    double *c = malloc(2 * k * sizeof(double)), *d2 = malloc(n * sizeof(double)), *sum = malloc(3 * k * sizeof(double));
    int *l = malloc(n * sizeof(int));
    if (!c || !d2 || !sum || !l) {
        free(c);
        free(d2);
        free(sum);
        free(l);
        return kvq_fail(err, KVQ_ENOMEM, "skvq k-means: out of memory");
    }
    double best = INFINITY;
    for (int run = 0; run < SK_RESTARTS; run++) {
        uint32_t s = seed * 2654435761u + (uint32_t)run * 40503u + 1u;
        /* k-means++ */
        size_t f = lcg(&s) % n;
        c[0] = x[2 * f];
        c[1] = x[2 * f + 1];
        for (size_t i = 0; i < n; i++) d2[i] = INFINITY;
        for (size_t j = 1; j < k; j++) {
            double tot = 0;
            for (size_t i = 0; i < n; i++) {
                double a = x[2 * i] - c[2 * (j - 1)], b = x[2 * i + 1] - c[2 * (j - 1) + 1], e = a * a + b * b;
                if (e < d2[i]) d2[i] = e;
                tot += d2[i];
            }
            size_t pick = lcg(&s) % n;
            if (tot > 0) {
                double u = (double)lcg(&s) / 16777216.0 * tot, acc = 0;
                for (pick = 0; pick + 1 < n; pick++) {
                    acc += d2[pick];
                    if (acc > u) break;
                }
            }
            c[2 * j] = x[2 * pick];
            c[2 * j + 1] = x[2 * pick + 1];
        }
        /* Lloyd */
        double inertia = INFINITY;
        for (int it = 0; it < SK_ITERS; it++) {
            bool moved = false;
            inertia = 0;
            for (size_t i = 0; i < n; i++) {
                int bj = 0;
                double be = INFINITY;
                for (size_t j = 0; j < k; j++) {
                    double a = x[2 * i] - c[2 * j], b = x[2 * i + 1] - c[2 * j + 1], e = a * a + b * b;
                    if (e < be) {
                        be = e;
                        bj = (int)j;
                    }
                }
                if (it == 0 || l[i] != bj) moved = true;
                l[i] = bj;
                inertia += be;
            }
            if (!moved) break;
            memset(sum, 0, 3 * k * sizeof(double));
            for (size_t i = 0; i < n; i++) {
                sum[3 * l[i]] += x[2 * i];
                sum[3 * l[i] + 1] += x[2 * i + 1];
                sum[3 * l[i] + 2] += 1;
            }
            for (size_t j = 0; j < k; j++)
                if (sum[3 * j + 2] > 0) {
                    c[2 * j] = sum[3 * j] / sum[3 * j + 2];
                    c[2 * j + 1] = sum[3 * j + 1] / sum[3 * j + 2];
                }
        }
        if (inertia < best) {
            best = inertia;
            /* clusters renumbered by centroid (min, then max), so the order does not depend on the seeding */
            int *ord = (int *)sum; /* k ints fit in 3k doubles */
            for (size_t j = 0; j < k; j++) ord[j] = (int)j;
            for (size_t a = 1; a < k; a++)
                for (size_t b = a; b > 0; b--) {
                    int p = ord[b - 1], q = ord[b];
                    if (c[2 * p] > c[2 * q] || (c[2 * p] == c[2 * q] && c[2 * p + 1] > c[2 * q + 1])) {
                        ord[b - 1] = q;
                        ord[b] = p;
                    } else
                        break;
                }
            int rank[4096];
            for (size_t j = 0; j < k && j < 4096; j++) rank[ord[j]] = (int)j;
            for (size_t i = 0; i < n; i++) lab[i] = rank[l[i]];
        }
    }
    free(c);
    free(d2);
    free(sum);
    free(l);
    return KVQ_OK;
}

/* squared reconstruction error of rows x[n][kvd] at clip a */
static double clip_sse(const float *x, size_t n, size_t kvd, const float *perm, const float *gs, size_t ng, float a, int bits, float *y)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        quant_row(y, x + i * kvd, kvd, perm, gs, ng, a, bits);
        for (size_t c = 0; c < kvd; c++) {
            double d = (double)y[c] - (double)x[i * kvd + c];
            e += d * d;
        }
    }
    return e;
}

/* one side's tables from its calibration rows x[n][kvd] (sink tokens already left out) */
static kvq_status fit_side(const kvq_artifact_params *p, int layer, char side, const float *x, size_t n, size_t kvd, kvq_kv_table *t,
                           kvq_err *err)
{
    size_t G = p->group_size, k = kvd / G;
    if (k > 4096) return kvq_fail(err, KVQ_EINVAL, "skvq: %zu groups (kv_dim %zu / G %zu): at most 4096", k, kvd, G);
    double *pt = malloc(2 * kvd * sizeof(double));
    int *lab = malloc(kvd * sizeof(int));
    float *y = malloc(kvd * sizeof(float));
    kvq_status s = KVQ_OK;
    if (!pt || !lab || !y) s = kvq_fail(err, KVQ_ENOMEM, "skvq: layer %d: out of memory", layer);
    if (!s) {
        for (size_t c = 0; c < kvd; c++) pt[2 * c] = pt[2 * c + 1] = x[c];
        for (size_t i = 1; i < n; i++)
            for (size_t c = 0; c < kvd; c++) {
                double v = x[i * kvd + c];
                pt[2 * c] = v < pt[2 * c] ? v : pt[2 * c];
                pt[2 * c + 1] = v > pt[2 * c + 1] ? v : pt[2 * c + 1];
            }
        s = k > 1 ? kmeans2(pt, kvd, k, (uint32_t)layer * 2u + (side == 'v'), lab, err) : KVQ_OK;
        if (k <= 1)
            for (size_t c = 0; c < kvd; c++) lab[c] = 0;
    }
    float *perm = NULL, *gs = NULL, *cl = NULL;
    size_t ng = 0;
    if (!s) {
        size_t *cnt = calloc(k, sizeof(size_t));
        if (!cnt) s = kvq_fail(err, KVQ_ENOMEM, "skvq: out of memory");
        for (size_t c = 0; !s && c < kvd; c++) cnt[lab[c]]++;
        for (size_t j = 0; !s && j < k; j++) ng += cnt[j] > 0;
        uint64_t sh_p[1] = {kvd}, sh_g[1] = {ng + 1}, sh_c[1] = {1};
        if (!s) s = kvq_kv_table_add(t, "perm", 1, sh_p, &perm, err);
        if (!s) s = kvq_kv_table_add(t, "group_start", 1, sh_g, &gs, err);
        if (!s) s = kvq_kv_table_add(t, "clip", 1, sh_c, &cl, err);
        if (!s) { /* channels in cluster order, ascending channel index within a cluster (a stable argsort) */
            size_t r = 0, g = 0;
            for (size_t j = 0; j < k; j++) {
                if (!cnt[j]) continue;
                gs[g++] = (float)r;
                for (size_t c = 0; c < kvd; c++)
                    if (lab[c] == (int)j) perm[r++] = (float)c;
            }
            gs[ng] = (float)kvd;
        }
        free(cnt);
    }
    if (!s) {
        int bits = side == 'k' ? p->k_bits : p->v_bits;
        float a = (float)p->x[0];
        if (a == 0) { /* search: 1.00 down to 0.50, the least error (ties: the larger ratio) */
            double be = INFINITY;
            for (int i = 100; i >= (int)lround(SK_CLIP_LO * 100); i--) {
                float r = (float)i / 100.0f;
                double e = clip_sse(x, n, kvd, perm, gs, ng, r, bits, y);
                if (e < be) {
                    be = e;
                    a = r;
                }
            }
        }
        cl[0] = a;
        t->bits = bits;
        t->n_elems = (uint64_t)n * kvd;
    }
    free(pt);
    free(lab);
    free(y);
    return s;
}

static kvq_status fit_layer_skvq(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k, kvq_kv_table *v,
                                 kvq_err *err)
{
    size_t kvd = src->n_kv_heads * src->head_dim, L = src->seq_len, ns = p->n_sink < L ? p->n_sink : L;
    size_t rows = src->n_samples * L, keep = src->n_samples * (L - ns);
    if (!keep) return kvq_fail(err, KVQ_EINVAL, "skvq: layer %d: the sink (%zu) leaves no calibration tokens in samples of %zu", layer, ns, L);
    float *buf = malloc(rows * kvd * sizeof(float));
    if (!buf) return kvq_fail(err, KVQ_ENOMEM, "skvq: cannot hold layer %d's %zu tokens", layer, rows);
    kvq_status s = KVQ_OK;
    for (int w = 0; w < 2 && !s; w++) {
        s = src->read(src, layer, w ? 2 : p->post_rope ? 1 : 0, buf, err);
        if (s) break;
        size_t o = 0; /* drop every sample's sink tokens in place */
        for (size_t i = 0; i < rows; i++)
            if (i % L >= ns) memmove(buf + (o++) * kvd, buf + i * kvd, kvd * sizeof(float));
        s = fit_side(p, layer, w ? 'v' : 'k', buf, keep, kvd, w ? v : k, err);
    }
    free(buf);
    return s;
}

static const kvq_family_artifact art_skvq = {
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "clipped-dynamic-per-token-reordered-channel-groups",
    .v_scaling = "clipped-dynamic-per-token-reordered-channel-groups",
    .check_params = check_params_skvq,
    .inspect = inspect_skvq,
    .tensors = tensors_skvq,
    .check_tensors = check_tensors_skvq,
    .params = param_names,
};

/* the reference's k2-v2-g128-w128-reorder-pre_rope-clip-sink5 */
static const kvq_family_calib calib_skvq = {
    .bits = 2,
    .sink = SK_SINK,
    .group = SK_G,
    .pre_rope_ok = true,
    .group_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit_layer = fit_layer_skvq,
    .x = {0},
};

const kvq_family kvq_family_skvq = {
    .name = "skvq",
    .syntax = "skvq<b>[-w<W>] (default W=128; needs a kvcalib skvq artifact)",
    .summary = "SKVQ (arXiv 2405.06219 §3): channels reordered by offline k-means so similar channels share a group, "
               "clipped dynamic per-token group quantization with per-layer clip ratios, a W-token full-precision "
               "sliding window and full-precision sink tokens; pre-RoPE keys by default",
    .default_stage = KVQ_KEYS_PRE_ROPE,
    .parse = parse_skvq,
    .format = fmt_skvq,
    .validate = validate_skvq,
    .check_ctx = check_ctx_skvq,
    .needs_artifact = needs_artifact_skvq,
    .match = match_skvq,
    .describe_need = need_skvq,
    .bind_params = bind_skvq,
    .from_params = from_params_skvq,
    .check_tables = check_tables_skvq,
    .artifact = &art_skvq,
    .calib = &calib_skvq,
    .quantize = quantize_skvq,
    .transform = transform_skvq,
    .alt_bounds = bounds_skvq,
    .describe = describe_skvq,
    .bits = bits_skvq,
};
