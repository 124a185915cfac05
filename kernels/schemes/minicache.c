/* minicache.c — MiniCache: cross-layer merging of adjacent layers' KV states (Liu et al., "MiniCache: KV
 * Cache Compression in Depth Dimension for Large Language Models", arXiv 2405.14366, NeurIPS 2024). No
 * public implementation could be read here (github.com/AkideLiu/MiniCache holds the project page only);
 * the rules below follow the paper as recalled, its abstract, the project page's method figure and a
 * public summary of its tables (section numbers and t = 0.6 are recalled, not checked against the PDF):
 *   §4.1 cross-layer compression: for a pair of adjacent layers (l, l+1) every token's K (and V) head
 *        vector is split into its magnitude ||x|| and direction x / ||x||; the two layers' directions
 *        are merged by SLERP,
 *            e = sin((1 - t) W) / sin W * x_l / ||x_l|| + sin(t W) / sin W * x_{l+1} / ||x_{l+1}||,
 *            W = arccos(x_l . x_{l+1} / (||x_l|| ||x_{l+1}||)),
 *        (t weights the deeper layer; t = 0.6 as the paper's default) and stored once for the pair with
 *        both layers' magnitudes; each layer restores x^ = e ||x|| (Eq. 2-3);
 *   §4.1 unmergeable-token retention: the angular distance d = W / pi of a pair of states; a token whose
 *        d exceeds d_max - (d_max - d_min) gamma (d over the tokens: the most distinct gamma-slice of the
 *        range) is kept unmerged in both layers, with its index; a larger gamma retains more (the paper's
 *        ablation: "increasing gamma improves performance but reduces compression", gamma = 0.05 retaining
 *        a small share). The exact form of the paper's Eq. could not be read here: the direction of the
 *        rule is taken from that ablation;
 *   §4.1 merging starts from the middle of the model (S = n_layers / 2) and merges (S, S+1), (S+2, S+3),
 *        ...; §5 reports MiniCache combined with 4-bit KV quantization (KIVI-4) of the merged cache.
 *
 * Spec: minicache[<b>][-s<S>|-cal][-t<t>][-g<gamma>][-c<C>]
 *   b      code bits of the per-(token, KV head) asymmetric integer quantizer of every stored vector
 *          (merged directions, retained and unmerged states; fp16 scale and zero point per head vector);
 *          absent: an fp16 cache;
 *   S      first layer of the merged pairs (S, S+1), (S+2, S+3), ... (default n_layers / 2);
 *   -cal   the merged pairs and per-(layer, KV head) retention thresholds from a kvcalib artifact of
 *          method minicache (kvcalib --method minicache chooses the pairs from the dump);
 *   t      SLERP parameter in (0, 1), default 0.6;
 *   gamma  retention threshold in [0, 1], default 0.05 (without -cal: d_min / d_max over the window's
 *          tokens merged so far in that pair, side and KV head; 0 retains nothing, 1 all but the nearest);
 *   C      tokens per step, default 1 (a token-by-token decode; see below).
 * Keys post-RoPE (what the cache holds); no +pre-rope, no rotation.
 *
 * Decode semantics (family.h contract 4, "a window in steps"): the cache entry of token j in layer l of a
 * pair depends on layer l+1's state of j, which exists only once j has passed layer l+1. The window runs
 * in steps of C tokens (kvq_hooks.chunk); within a step the tokens of the step read the pair layers'
 * states exact (the paper's decoding concatenates the new token unmerged) and the unpaired layers'
 * quantized (in place); after the step its tokens are merged (or retained), quantized, and join the
 * cache every later step attends as its prefix. C = 1 is exact token-by-token decoding; C > 1 simulates
 * merging after chunks of C tokens (chunked prefill: the paper merges once after the prefill).
 *
 * Tables (artifact of method minicache, per layer and side k / v; ARTIFACT.md):
 *   dist  [n_kv_heads]  mean angular distance between layer l and l+1 over the dump's tokens (0 for the last layer);
 *   theta [n_kv_heads]  retention threshold d_max - (d_max - d_min) gamma over the dump's tokens of (l, l+1);
 *   merge [1]           1: layer l and l+1 are a merged pair (l is its first layer), else 0; the same on k and v;
 * parameters kvq.minicache.t (0.6), gamma (0.05), pairs (0: the paper's count, (n_layers - n_layers / 2) / 2),
 * from (lowest first layer of a pair, default 0). calib->finish chooses `pairs` disjoint pairs (l, l+1),
 * l >= from, with the smallest mean angular distance (K and V heads averaged), greedily.
 *
 * Counts (kvq_quant_counts, per side): n_elems every element cached; n_exact the elements of merged
 * states (both layers of a pair); n_high the retained ones (both layers); n_sink the sink tokens'.
 * Bits per element: q = b + 32 / head_dim (or 16 for fp16); unpaired and retained states q; a retained
 * (token, KV head) adds a 32-bit index shared by the two layers (16 / head_dim per element); a merged
 * state q / 2 (the direction, once per pair) + 16 / head_dim (its layer's fp16 magnitude); sink tokens
 * 16; from the realised counts (nominal: the spec's pairs of n_layers, nothing retained; with -cal the
 * nominal figure, e.g. kvcalib's bits_per_element, counts no pair: the pairs live in the artifact's
 * tables, which the bits accounting does not see; kveval reports the realised counts).
 *
 * Where kvq differs from the reference (the paper):
 *   - quantization: the paper reports MiniCache on top of KIVI-4 (per-channel keys in groups of tokens,
 *     an fp16 residual); kvq quantizes every stored head vector per token at b bits (a quantizer per
 *     vector that needs no token groups, so merging and quantization stay per token); the direction is
 *     quantized after the merge, magnitudes stored fp16;
 *   - retention: the paper applies its threshold rule to the prompt's tokens at prefill; without -cal
 *     kvq applies it causally (d_min / d_max over the tokens merged so far), with -cal it uses the
 *     threshold kvcalib computed from the dump (the rule over every calibration token);
 *   - decisions are per (token, KV head); the paper's tensors are [batch, head, token, dim] with the
 *     norm over dim (per head) as well, its retention index set per token is not verified against code;
 *   - merged pairs: the paper merges fixed pairs from the middle; kvcalib (-cal) chooses them from the
 *     dump's cross-layer distances (the paper's Fig. 2 observation);
 *   - a window run in one call (C >= window, a forward without the engine) lets no query read a merged
 *     state: the pair layers' states stay exact for the window (its resting cache is merged and counted);
 *   - kvstat's quantization error (quantize) shows the per-vector quantizer only (one layer alone cannot
 *     be merged); the cross-layer picture is kvstat --cross-layer (analysis/kvstat/xlayer.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

#define MC_T(q) ((q)->x[0])     /* SLERP t, (0, 1) */
#define MC_GAMMA(q) ((q)->x[1]) /* retention gamma, [0, 1] */
#define MC_START(q) ((q)->x[2]) /* first layer of the pairs; -1: n_layers / 2; -2: the artifact's pairs (-cal) */
#define MC_CHUNK(q) ((q)->x[3]) /* tokens per step, >= 1 */
#define MC_QUANT 1              /* scheme variant: b-bit per-vector integer; 0: fp16 */

static const double MC_T_DEF = 0.6, MC_GAMMA_DEF = 0.05;

/* ---- spec ----------------------------------------------------------------------------------- */

static bool spec_num(const char **p, double *out)
{
    char *end;
    const char *s = *p;
    if (!(*s >= '0' && *s <= '9') && *s != '.') return false;
    double v = strtod(s, &end);
    if (end == s || !isfinite(v)) return false;
    *p = end;
    *out = v;
    return true;
}

static int parse_mc(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!kvq_spec_starts(b, "minicache")) return 0;
    const char *p = b + strlen("minicache");
    unsigned long bits = 0, v;
    q->variant = 0;
    if (*p >= '0' && *p <= '9') {
        if (!kvq_spec_uint(&p, 1000, &bits) || bits < 1 || bits > KVQ_QUANT_MAX_BITS)
            return kvq_spec_bad(spec, err, "bits: expected 1..8");
        q->variant = MC_QUANT;
    }
    q->k_bits = q->v_bits = bits ? (int)bits : 8; /* fp16 cache: the code bits are not used */
    MC_T(q) = MC_T_DEF;
    MC_GAMMA(q) = MC_GAMMA_DEF;
    MC_START(q) = -1;
    MC_CHUNK(q) = 1;
    while (*p) {
        if (kvq_spec_starts(p, "-cal")) {
            p += 4;
            MC_START(q) = -2;
        } else if (kvq_spec_starts(p, "-s")) {
            p += 2;
            if (!kvq_spec_uint(&p, 1u << 16, &v)) return kvq_spec_bad(spec, err, "first merged layer after -s: expected an integer >= 0");
            MC_START(q) = (double)v;
        } else if (kvq_spec_starts(p, "-t")) {
            p += 2;
            if (!spec_num(&p, &MC_T(q))) return kvq_spec_bad(spec, err, "SLERP parameter after -t: expected a number in (0, 1)");
        } else if (kvq_spec_starts(p, "-g")) {
            p += 2;
            if (!spec_num(&p, &MC_GAMMA(q))) return kvq_spec_bad(spec, err, "retention gamma after -g: expected a number in [0, 1]");
        } else if (kvq_spec_starts(p, "-c")) {
            p += 2;
            if (!kvq_spec_uint(&p, 1u << 20, &v) || v == 0)
                return kvq_spec_bad(spec, err, "tokens per step after -c: expected an integer >= 1");
            MC_CHUNK(q) = (double)v;
        } else
            return kvq_spec_bad(spec, err, "expected minicache[<b>][-s<S>|-cal][-t<t>][-g<gamma>][-c<C>] (e.g. minicache4, "
                                           "minicache4-s15-t0.6-g0.05, minicache4-cal-c64)");
    }
    return 1;
}

static void fmt_mc(const kvq_scheme *q, char *b, size_t n)
{
    char bits[8] = "", s[24] = "-cal";
    if (q->variant == MC_QUANT) snprintf(bits, sizeof bits, "%d", q->k_bits);
    if (MC_START(q) == -1) s[0] = 0;
    else if (MC_START(q) >= 0) snprintf(s, sizeof s, "-s%g", MC_START(q));
    snprintf(b, n, "minicache%s%s-t%g-g%g-c%g", bits, s, MC_T(q), MC_GAMMA(q), MC_CHUNK(q));
}

static kvq_status validate_mc(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: minicache has no sparse outliers, found %g", q->outlier_frac);
    if (q->k_bits != q->v_bits)
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache: k_bits %d and v_bits %d differ (one quantizer for merged K and V)",
                        q->k_bits, q->v_bits);
    if (q->variant != 0 && q->variant != MC_QUANT)
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache variant: expected 0 (fp16) or 1 (b-bit), found %d", q->variant);
    if (!(MC_T(q) > 0 && MC_T(q) < 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache SLERP parameter t: expected 0 < t < 1, found %g", MC_T(q));
    if (!(MC_GAMMA(q) >= 0 && MC_GAMMA(q) <= 1))
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache retention gamma: expected 0 <= gamma <= 1, found %g", MC_GAMMA(q));
    if (!(MC_START(q) == -1 || MC_START(q) == -2 || (MC_START(q) >= 0 && MC_START(q) == floor(MC_START(q)))))
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache first merged layer: expected an integer >= 0, found %g", MC_START(q));
    if (!(MC_CHUNK(q) >= 1 && MC_CHUNK(q) == floor(MC_CHUNK(q)) && MC_CHUNK(q) <= 1 << 20))
        return kvq_fail(err, KVQ_EINVAL, "scheme: minicache tokens per step: expected an integer >= 1, found %g", MC_CHUNK(q));
    return KVQ_OK;
}

static int start_layer(const kvq_scheme *q, int n_layers) { return MC_START(q) >= 0 ? (int)MC_START(q) : n_layers / 2; }

static kvq_status check_model_mc(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if (MC_START(q) == -2) return KVQ_OK; /* the artifact's pairs (check_tables) */
    int S = start_layer(q, hp->n_layers);
    if (S + 1 >= hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': the first merged pair (%d, %d) needs layer %d; the model has %d layers "
                        "(first layer after -s: at most %d)", spec, S, S + 1, S + 1, hp->n_layers, hp->n_layers - 2);
    return KVQ_OK;
}

static kvq_status check_ctx_mc(const kvq_scheme *q, const char *name, size_t ctx, kvq_err *err)
{
    if (MC_CHUNK(q) >= (double)ctx)
        return kvq_fail(err, KVQ_EINVAL, "scheme %s: steps of %g tokens must be shorter than the context (%zu tokens): a window "
                        "would be one step, which attends its own exact K/V, and nothing merged would ever be read", name,
                        MC_CHUNK(q), ctx);
    return KVQ_OK;
}

static void describe_mc(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "slerp_t", MC_T(q));
    o->num(o->ctx, "retention_gamma", MC_GAMMA(q));
    o->num(o->ctx, "tokens_per_step", MC_CHUNK(q));
    o->str(o->ctx, "storage", q->variant == MC_QUANT ? "int-per-token-head" : "fp16");
    if (MC_START(q) == -2) o->str(o->ctx, "pairs", "artifact");
    else o->num(o->ctx, "first_merged_layer", MC_START(q)); /* -1: n_layers / 2 */
}

static int code_bits_mc(const kvq_scheme *q, char side)
{
    (void)side;
    return q->variant == MC_QUANT ? q->k_bits : 16;
}

/* ---- the artifact: merged pairs, distances, retention thresholds -------------------------------- */

static bool needs_artifact_mc(const kvq_scheme *q) { return MC_START(q) == -2; }

static bool match_mc(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    (void)q;
    return p->method && !strcmp(p->method->name, "minicache") && p->post_rope && (!stage_set || stage == KVQ_KEYS_POST_ROPE);
}

static void need_mc(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    (void)q;
    (void)stage_set;
    (void)stage;
    snprintf(buf, n, "the merged layer pairs: a kvcalib artifact of method minicache (post-RoPE keys; or -s<S> instead of -cal)");
}

static void bind_params_mc(kvq_scheme *q, const kvq_artifact_params *p)
{
    (void)p; /* t and gamma stay the spec's; the artifact's tables give the pairs and thresholds */
    (void)q;
}

static void from_params_mc(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = q->v_bits = p->k_bits;
    q->variant = MC_QUANT;
    q->n_sink = p->n_sink;
    MC_T(q) = p->x[0];
    MC_GAMMA(q) = p->x[1];
    MC_START(q) = -2;
    MC_CHUNK(q) = 1;
}

static const char *const tab_names[] = {"dist", "theta", "merge", NULL};
static const char *const param_names[] = {"t", "gamma", "pairs", "from", NULL};

static const char *const *tensors_mc(const kvq_artifact_params *p, char side)
{
    (void)p;
    (void)side;
    return tab_names;
}

static kvq_status check_tab(const kvq_kv_table *t, size_t layer, size_t n_layers, char side, size_t H, kvq_err *err)
{
    static const char *const names[] = {"dist", "theta", "merge"};
    for (int i = 0; i < 3; i++) {
        const kvq_fam_tensor *x = kvq_kv_table_get(t, names[i]);
        size_t want = i == 2 ? 1 : H;
        if (!x) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s: missing", layer, side, names[i]);
        if (x->n_dims != 1 || x->shape[0] != want)
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s: expected shape [%zu], found %u dims, first %llu", layer, side,
                            names[i], want, x->n_dims, (unsigned long long)x->shape[0]);
        for (size_t h = 0; h < want; h++) {
            float f = x->data[h];
            bool ok = i == 2 ? (f == 0 || (f == 1 && layer + 1 < n_layers)) : (isfinite(f) && f >= 0 && f <= 1);
            if (!ok)
                return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.%s[%zu]: expected %s, found %g", layer, side, names[i], h,
                                i == 2 ? (layer + 1 < n_layers ? "0 or 1" : "0 (the last layer pairs with none)")
                                       : "an angular distance in [0, 1]",
                                (double)f);
        }
    }
    return KVQ_OK;
}

/* pairs never overlap, K and V merge the same pairs */
static kvq_status check_pairs(const kvq_kv_table *k, const kvq_kv_table *v, size_t L, kvq_err *err)
{
    for (size_t l = 0; l < L; l++) {
        float mk = kvq_kv_table_get(&k[l], "merge")->data[0], mv = kvq_kv_table_get(&v[l], "merge")->data[0];
        if (mk != mv) return kvq_fail(err, KVQ_EINVAL, "layers.%zu.k.merge (%g) and layers.%zu.v.merge (%g) differ", l, (double)mk, l, (double)mv);
        if (mk == 1 && l > 0 && kvq_kv_table_get(&k[l - 1], "merge")->data[0] == 1)
            return kvq_fail(err, KVQ_EINVAL, "layers.%zu.k.merge: pairs (%zu, %zu) and (%zu, %zu) overlap", l, l - 1, l, l, l + 1);
    }
    return KVQ_OK;
}

static kvq_status check_tensors_mc(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    return check_tab(t, layer, p->n_layers, side, p->n_kv_heads, err);
}

static kvq_status check_params_mc(const kvq_artifact_params *p, kvq_err *err)
{
    if (!(p->x[0] > 0 && p->x[0] < 1)) return kvq_fail(err, KVQ_EINVAL, "kvq.minicache.t: expected 0 < t < 1, found %g", p->x[0]);
    if (!(p->x[1] >= 0 && p->x[1] <= 1))
        return kvq_fail(err, KVQ_EINVAL, "kvq.minicache.gamma: expected 0 <= gamma <= 1, found %g", p->x[1]);
    if (!(p->x[2] >= 0 && p->x[2] == floor(p->x[2])))
        return kvq_fail(err, KVQ_EINVAL, "kvq.minicache.pairs: expected an integer >= 0 (0: (n_layers - n_layers / 2) / 2), found %g",
                        p->x[2]);
    if (!(p->x[3] >= 0 && p->x[3] == floor(p->x[3])))
        return kvq_fail(err, KVQ_EINVAL, "kvq.minicache.from: expected a layer index >= 0, found %g", p->x[3]);
    size_t L = p->n_layers, from = (size_t)p->x[3];
    if (L) {
        size_t room = from + 1 < L ? (L - from) / 2 : 0, want = p->x[2] > 0 ? (size_t)p->x[2] : (L - L / 2) / 2;
        if (want == 0 || want > room)
            return kvq_fail(err, KVQ_EINVAL, "kvq.minicache.pairs: %zu disjoint pairs (l, l+1) with l >= from = %zu do not fit %zu "
                            "layers (at most %zu)", want, from, L, room);
    }
    if (!p->post_rope) return kvq_fail(err, KVQ_EINVAL, "kvq.key_position: minicache merges post-RoPE keys, found pre-RoPE");
    return KVQ_OK;
}

static void inspect_mc(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "minicache     SLERP t %g, retention gamma %g, %g pairs (0: from the middle's count) from layer %g\n", p->x[0],
            p->x[1], p->x[2], p->x[3]);
}

static kvq_status check_tables_mc(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (d->key_stage != KVQ_KEYS_POST_ROPE)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: minicache merges the cached (post-RoPE) keys; +pre-rope is refused");
    if (d->rot.kind != KVQ_ROT_NONE)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: minicache merges the cache states themselves; a rotation is refused");
    if (MC_START(&d->q) != -2) return KVQ_OK;
    size_t L = (size_t)hp->n_layers;
    if (!d->art || !d->art->k || !d->art->v || d->art->p.n_layers != L || d->art->p.n_kv_heads != (size_t)hp->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: minicache -cal needs the pairs of %zu layers, %d KV heads (an artifact of "
                        "method minicache)", L, hp->n_kv_heads);
    for (size_t l = 0; l < L; l++) {
        KVQ_TRY(check_tab(&d->art->k[l], l, L, 'k', (size_t)hp->n_kv_heads, err));
        KVQ_TRY(check_tab(&d->art->v[l], l, L, 'v', (size_t)hp->n_kv_heads, err));
    }
    return check_pairs(d->art->k, d->art->v, L, err);
}

/* ---- merging ---------------------------------------------------------------------------------- */

/* angular distance d = arccos(cos) / pi of two head vectors, with their norms; 1 (never merged) when a norm is 0 */
static double ang_dist(const float *a, const float *b, size_t hd, double *na, double *nb)
{
    double s = 0, sa = 0, sb = 0;
    for (size_t i = 0; i < hd; i++) {
        s += (double)a[i] * b[i];
        sa += (double)a[i] * a[i];
        sb += (double)b[i] * b[i];
    }
    *na = sqrt(sa);
    *nb = sqrt(sb);
    if (!(*na > 0 && *nb > 0)) return 1.0;
    double c = s / (*na * *nb);
    c = c > 1 ? 1 : c < -1 ? -1 : c;
    return acos(c) / M_PI;
}

/* the stored representation of one head vector in place: b-bit per-vector integer or fp16 */
static kvq_status store_vec(const kvq_scheme *q, float *x, size_t hd, kvq_err *err)
{
    if (q->variant == MC_QUANT) return kvq_quant_int_token(x, x, 1, hd, hd, q->k_bits, 0, NULL, err);
    for (size_t i = 0; i < hd; i++) x[i] = kvq_round_fp16(x[i]);
    return KVQ_OK;
}

/* SLERP of the unit directions of a and b at t (Eq. 3), into e[hd]; W = pi d */
static void slerp_dir(const float *a, const float *b, double na, double nb, double d, double t, size_t hd, float *e)
{
    double W = d * M_PI, s = sin(W), wa, wb;
    if (s < 1e-6) { /* (anti)parallel limit: linear interpolation of the directions */
        wa = 1 - t;
        wb = t;
    } else {
        wa = sin((1 - t) * W) / s;
        wb = sin(t * W) / s;
    }
    for (size_t i = 0; i < hd; i++) e[i] = (float)(wa * a[i] / na + wb * b[i] / nb);
}

/* ---- run state ------------------------------------------------------------------------------------ */

typedef struct {
    int L, H, hd, kvd, cap;   /* layers, KV heads, head_dim, kv_dim, tokens the stores hold */
    int done;                 /* tokens stored in every layer */
    signed char *role;        /* [L]: 0 unpaired, 1 first of a pair, 2 second */
    float **k, **v;           /* [L][cap][kvd]: the cache every later step reads (post-RoPE keys) */
    float **pk, **pv;         /* [L] pending exact states of the current step, first layers of pairs: [cap][kvd] */
    double *dmin, *dmax;      /* [L][2][H]: running distance range per first layer, side, head (no artifact) */
    float *pre_k, *pre_v;     /* [L][P][kvd]: the packed prefix */
    size_t pre_cap;
} mc_state;

static void mc_free(mc_state *s)
{
    if (!s) return;
    for (int l = 0; l < s->L; l++) {
        if (s->k) free(s->k[l]);
        if (s->v) free(s->v[l]);
        if (s->pk) free(s->pk[l]);
        if (s->pv) free(s->pv[l]);
    }
    free(s->k);
    free(s->v);
    free(s->pk);
    free(s->pv);
    free(s->role);
    free(s->dmin);
    free(s->dmax);
    free(s->pre_k);
    free(s->pre_v);
    free(s);
}

static void run_free_mc(kvq_kv_desc_run *run)
{
    mc_free(run->state);
    run->state = NULL;
}

static kvq_status mc_new(const kvq_kv_desc *d, const kvq_layer_ctx *c, mc_state **out, kvq_err *err)
{
    if (c->n_layers <= 0) return kvq_fail(err, KVQ_EINVAL, "minicache: the layer context does not give the model's depth");
    mc_state *s = calloc(1, sizeof *s);
    if (!s) return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot allocate its run state");
    s->L = c->n_layers;
    s->H = c->n_kv_heads;
    s->hd = c->head_dim;
    s->kvd = s->H * s->hd;
    s->role = calloc((size_t)s->L, 1);
    s->k = calloc((size_t)s->L, sizeof *s->k);
    s->v = calloc((size_t)s->L, sizeof *s->v);
    s->pk = calloc((size_t)s->L, sizeof *s->pk);
    s->pv = calloc((size_t)s->L, sizeof *s->pv);
    s->dmin = malloc((size_t)s->L * 2 * s->H * sizeof(double));
    s->dmax = malloc((size_t)s->L * 2 * s->H * sizeof(double));
    if (!s->role || !s->k || !s->v || !s->pk || !s->pv || !s->dmin || !s->dmax) {
        mc_free(s);
        return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot allocate its run state");
    }
    if (MC_START(&d->q) == -2) {
        if (!d->art || !d->art->k || d->art->p.n_layers != (size_t)s->L) {
            mc_free(s);
            return kvq_fail(err, KVQ_EINVAL, "minicache -cal: no artifact with the pairs of %d layers bound", s->L);
        }
        for (int l = 0; l + 1 < s->L; l++)
            if (kvq_kv_table_get(&d->art->k[l], "merge")->data[0] == 1 && s->role[l] == 0) {
                s->role[l] = 1;
                s->role[l + 1] = 2;
            }
    } else
        for (int l = start_layer(&d->q, s->L); l + 1 < s->L; l += 2) {
            s->role[l] = 1;
            s->role[l + 1] = 2;
        }
    *out = s;
    return KVQ_OK;
}

static kvq_status mc_reserve(mc_state *s, int need, kvq_err *err)
{
    if (need <= s->cap) return KVQ_OK;
    int cap = s->cap ? s->cap : 64;
    while (cap < need) cap *= 2;
    size_t n = (size_t)cap * s->kvd;
    for (int l = 0; l < s->L; l++) {
        float *a = realloc(s->k[l], n * sizeof(float)), *b = a ? realloc(s->v[l], n * sizeof(float)) : NULL;
        if (a) s->k[l] = a;
        if (b) s->v[l] = b;
        if (!a || !b) return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot hold %d tokens of cache", cap);
        if (s->role[l] == 1) {
            a = realloc(s->pk[l], n * sizeof(float));
            if (a) s->pk[l] = a;
            b = a ? realloc(s->pv[l], n * sizeof(float)) : NULL;
            if (b) s->pv[l] = b;
            if (!a || !b) return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot hold %d pending tokens", cap);
        }
    }
    s->cap = cap;
    return KVQ_OK;
}

/* Merge the step's tokens [p0, p0 + T) of the pair (l, l+1), side 'k'/'v': a = layer l's exact states
 * [T][kvd], b = layer l+1's; writes both layers' cache entries. */
static kvq_status merge_side(const kvq_kv_desc *d, mc_state *s, int l, int side, int p0, int T, const float *a, const float *b,
                             float *out_a, float *out_b, kvq_quant_counts *cnt, kvq_err *err)
{
    const kvq_scheme *q = &d->q;
    const size_t hd = (size_t)s->hd, kvd = (size_t)s->kvd;
    const bool cal = MC_START(q) == -2;
    const float *theta = cal ? kvq_kv_table_get(side ? &d->art->v[l] : &d->art->k[l], "theta")->data : NULL;
    double *dmn = s->dmin + ((size_t)l * 2 + side) * s->H, *dmx = s->dmax + ((size_t)l * 2 + side) * s->H;
    const size_t nd = (size_t)T * s->H;
    double *dist = malloc(3 * nd * sizeof(double)), *norm_a = dist + nd, *norm_b = dist + 2 * nd;
    if (!dist) return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot hold %d x %d distances", T, s->H);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < s->H; h++) {
            size_t o = (size_t)t * kvd + (size_t)h * hd, i = (size_t)t * s->H + h;
            double dd = ang_dist(a + o, b + o, hd, &norm_a[i], &norm_b[i]);
            dist[i] = dd;
            if (!cal && (size_t)(p0 + t) >= q->n_sink && dd < 1.0) { /* the causal range: tokens merged so far */
                if (dd < dmn[h]) dmn[h] = dd;
                if (dd > dmx[h]) dmx[h] = dd;
            }
        }
    kvq_status st = KVQ_OK;
    for (int t = 0; t < T && !st; t++)
        for (int h = 0; h < s->H && !st; h++) {
            size_t o = (size_t)t * kvd + (size_t)h * hd;
            float *xa = out_a + o, *xb = out_b + o;
            memcpy(xa, a + o, hd * sizeof(float));
            memcpy(xb, b + o, hd * sizeof(float));
            cnt->n_elems += 2 * hd;
            if ((size_t)(p0 + t) < q->n_sink) { /* attention sink: exact in both layers */
                cnt->n_sink += 2 * hd;
                continue;
            }
            double dd = dist[(size_t)t * s->H + h];
            double th = cal ? (double)theta[h] : dmx[h] - (dmx[h] - dmn[h]) * MC_GAMMA(q);
            if (dd >= 1.0 || dd > th) { /* unmergeable: both layers keep their own states */
                cnt->n_high += 2 * hd;
                st = store_vec(q, xa, hd, err);
                if (!st) st = store_vec(q, xb, hd, err);
                continue;
            }
            double na = norm_a[(size_t)t * s->H + h], nb = norm_b[(size_t)t * s->H + h];
            float e[512];
            slerp_dir(a + o, b + o, na, nb, dd, MC_T(q), hd, e);
            st = store_vec(q, e, hd, err);
            float ma = kvq_round_fp16((float)na), mb = kvq_round_fp16((float)nb);
            for (size_t i = 0; i < hd; i++) {
                xa[i] = e[i] * ma;
                xb[i] = e[i] * mb;
            }
            cnt->n_exact += 2 * hd;
        }
    free(dist);
    return st;
}

static kvq_status transform_mc(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)alt;
    const kvq_kv_desc *d = run->d;
    if (c->head_dim > 512) return kvq_fail(err, KVQ_EUNSUPPORTED, "minicache: head_dim %d above 512", c->head_dim);
    mc_state *s = run->state;
    if (s && (s->L != c->n_layers || s->H != c->n_kv_heads || s->hd != c->head_dim)) {
        mc_free(s);
        run->state = s = NULL;
    }
    if (!s) {
        KVQ_TRY(mc_new(d, c, &s, err));
        run->state = s;
    }
    if (c->layer == 0 && c->pos0 == 0) { /* a new window */
        s->done = 0;
        for (size_t i = 0; i < (size_t)s->L * 2 * s->H; i++) {
            s->dmin[i] = 2;
            s->dmax[i] = -1;
        }
    }
    if (c->pos0 != s->done)
        return kvq_fail(err, KVQ_EINVAL, "minicache: layer %d: a step at position %d, expected %d (windows run in order, "
                        "their steps after the cache, kvq_hooks.chunk)", c->layer, c->pos0, s->done);
    const int T = c->T, l = c->layer;
    const size_t kvd = (size_t)s->kvd, hd = (size_t)s->hd, n = (size_t)T * kvd;
    KVQ_TRY(mc_reserve(s, s->done + T, err));
    float *ck = s->k[l] + (size_t)s->done * kvd, *cv = s->v[l] + (size_t)s->done * kvd;
    if (s->role[l] == 0) { /* unpaired: the stored states, read in place by the step too */
        for (int t = 0; t < T; t++)
            for (int h = 0; h < s->H; h++) {
                size_t o = (size_t)t * kvd + (size_t)h * hd;
                run->k_counts.n_elems += hd;
                run->v_counts.n_elems += hd;
                if ((size_t)(c->pos0 + t) < d->q.n_sink) {
                    run->k_counts.n_sink += hd;
                    run->v_counts.n_sink += hd;
                    continue;
                }
                KVQ_TRY(store_vec(&d->q, k + o, hd, err));
                KVQ_TRY(store_vec(&d->q, v + o, hd, err));
            }
        memcpy(ck, k, n * sizeof(float));
        memcpy(cv, v, n * sizeof(float));
    } else if (s->role[l] == 1) { /* first of a pair: exact within the step, kept until l+1's states exist */
        memcpy(s->pk[l], k, n * sizeof(float));
        memcpy(s->pv[l], v, n * sizeof(float));
    } else { /* second: merge the step's tokens of (l-1, l) into both layers' cache */
        float *ak = s->k[l - 1] + (size_t)s->done * kvd, *av = s->v[l - 1] + (size_t)s->done * kvd;
        KVQ_TRY(merge_side(d, s, l - 1, 0, c->pos0, T, s->pk[l - 1], k, ak, ck, &run->k_counts, err));
        KVQ_TRY(merge_side(d, s, l - 1, 1, c->pos0, T, s->pv[l - 1], v, av, cv, &run->v_counts, err));
    }
    if (l == s->L - 1) s->done += T;
    return KVQ_OK;
}

static kvq_status cache_mc(kvq_kv_desc_run *run, int P, kvq_prefix *out, kvq_err *err)
{
    mc_state *s = run->state;
    if (!s || P != s->done || P <= 0)
        return kvq_fail(err, KVQ_EINVAL, "minicache: a cache of %d tokens asked, %d stored", P, s ? s->done : 0);
    size_t per = (size_t)P * s->kvd, need = (size_t)s->L * per;
    if (need > s->pre_cap) {
        size_t cap = need + need / 2;
        float *a = realloc(s->pre_k, cap * sizeof(float));
        if (a) s->pre_k = a;
        float *b = a ? realloc(s->pre_v, cap * sizeof(float)) : NULL;
        if (b) s->pre_v = b;
        if (!a || !b) return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot pack a prefix of %d tokens", P);
        s->pre_cap = cap;
    }
    for (int l = 0; l < s->L; l++) {
        memcpy(s->pre_k + (size_t)l * per, s->k[l], per * sizeof(float));
        memcpy(s->pre_v + (size_t)l * per, s->v[l], per * sizeof(float));
    }
    *out = (kvq_prefix){.P = P, .k = s->pre_k, .v = s->pre_v};
    return KVQ_OK;
}

static int chunk_mc(const kvq_scheme *q) { return (int)MC_CHUNK(q); }

/* kvstat's resting view of one layer alone: the per-vector quantizer (merging needs the neighbour layer) */
static kvq_status quantize_mc(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                              size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    for (size_t t = 0; t < T; t++)
        for (size_t h = 0; h < kvd / hd; h++) {
            if (c) c->n_elems += hd;
            if (t < d->q.n_sink) {
                if (c) c->n_sink += hd;
                continue;
            }
            KVQ_TRY(store_vec(&d->q, out + t * kvd + h * hd, hd, err));
        }
    return KVQ_OK;
}

/* ---- bits ----------------------------------------------------------------------------------------- */

static double side_bits(const kvq_scheme *q, const kvq_bits_in *in, const kvq_quant_counts *c)
{
    double hd = (double)(in->head_dim ? in->head_dim : in->kv_dim);
    double qb = q->variant == MC_QUANT ? q->k_bits + 32.0 / hd : 16.0;
    double merged = qb / 2 + 16.0 / hd, retained = qb + 16.0 / hd;
    if (c && c->n_elems) {
        double N = (double)c->n_elems, M = (double)c->n_exact, R = (double)c->n_high, S = (double)c->n_sink;
        double U = N - M - R - S;
        return (U * qb + M * merged + R * retained + S * 16.0) / N;
    }
    double frac = 0; /* nominal: the spec's pairs of n_layers, nothing retained */
    if (in->n_layers && MC_START(q) != -2) {
        int L = (int)in->n_layers, S = start_layer(q, L), pairs = S + 1 < L ? (L - S) / 2 : 0;
        frac = 2.0 * pairs / L;
    }
    double dense = (1 - frac) * qb + frac * merged;
    return kvq_bits_mix16(dense, in->ctx, q->n_sink);
}

static kvq_status bits_mc(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    out->k = side_bits(q, in, in->k);
    out->v = side_bits(q, in, in->v);
    return KVQ_OK;
}

/* ---- kvcalib -------------------------------------------------------------------------------------- */

/* layer l against l+1 over every token of the dump but each sample's sink: per KV head the mean angular
 * distance and the threshold d_max - (d_max - d_min) gamma; merge = 0 (finish chooses) */
static kvq_status fit_layer_mc(const kvq_artifact_params *p, int layer, const kvq_calib_src *src, kvq_kv_table *k,
                               kvq_kv_table *v, kvq_err *err)
{
    const size_t H = src->n_kv_heads, hd = src->head_dim, kvd = H * hd, rows = src->n_samples * src->seq_len;
    const size_t ns = p->n_sink < src->seq_len ? p->n_sink : src->seq_len;
    kvq_kv_table *tab[2] = {k, v};
    float *dist[2], *theta[2], *merge[2];
    uint64_t sh_h[1] = {H}, sh_1[1] = {1};
    for (int side = 0; side < 2; side++) {
        KVQ_TRY(kvq_kv_table_add(tab[side], "dist", 1, sh_h, &dist[side], err));
        KVQ_TRY(kvq_kv_table_add(tab[side], "theta", 1, sh_h, &theta[side], err));
        KVQ_TRY(kvq_kv_table_add(tab[side], "merge", 1, sh_1, &merge[side], err));
        tab[side]->bits = side ? p->v_bits : p->k_bits;
        merge[side][0] = 0;
    }
    if ((size_t)layer + 1 >= src->n_layers) return KVQ_OK; /* the last layer pairs with none: zeros */
    size_t n = kvq_calib_src_len(src, 1);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    double *sum = calloc(H, sizeof(double)), *mn = malloc(H * sizeof(double)), *mx = malloc(H * sizeof(double));
    kvq_status s = KVQ_OK;
    if (!a || !b || !sum || !mn || !mx) s = kvq_fail(err, KVQ_ENOMEM, "minicache: cannot hold layers %d and %d of the dump", layer, layer + 1);
    for (int side = 0; side < 2 && !s; side++) {
        const int ds = side ? 2 : 1; /* post-RoPE keys, values */
        s = src->read(src, layer, ds, a, err);
        if (!s) s = src->read(src, layer + 1, ds, b, err);
        if (s) break;
        size_t cnt = 0;
        for (size_t h = 0; h < H; h++) {
            sum[h] = 0;
            mn[h] = 1;
            mx[h] = 0;
        }
        for (size_t r = 0; r < rows; r++) {
            if (r % src->seq_len < ns) continue;
            cnt++;
            for (size_t h = 0; h < H; h++) {
                double na, nb, dd = ang_dist(a + r * kvd + h * hd, b + r * kvd + h * hd, hd, &na, &nb);
                sum[h] += dd;
                if (dd < mn[h]) mn[h] = dd;
                if (dd > mx[h]) mx[h] = dd;
            }
        }
        if (cnt == 0) {
            s = kvq_fail(err, KVQ_EINVAL, "minicache: the dump's samples of %zu tokens hold no token after the %zu sink tokens",
                         src->seq_len, ns);
            break;
        }
        for (size_t h = 0; h < H; h++) {
            dist[side][h] = (float)(sum[h] / (double)cnt);
            theta[side][h] = (float)(mx[h] - (mx[h] - mn[h]) * p->x[1]);
        }
    }
    free(a);
    free(b);
    free(sum);
    free(mn);
    free(mx);
    return s;
}

/* the pairs: `pairs` disjoint (l, l+1), l >= from, smallest mean distance (K and V heads averaged) first */
static kvq_status finish_mc(const kvq_artifact_params *p, const kvq_calib_src *src, kvq_artifact *a, kvq_err *err)
{
    (void)src;
    const size_t L = p->n_layers, H = p->n_kv_heads, from = (size_t)p->x[3];
    size_t want = p->x[2] > 0 ? (size_t)p->x[2] : (L - L / 2) / 2;
    double *score = malloc(L * sizeof(double));
    bool *used = calloc(L, sizeof(bool));
    if (!score || !used) {
        free(score);
        free(used);
        return kvq_fail(err, KVQ_ENOMEM, "minicache: cannot rank %zu layer pairs", L);
    }
    for (size_t l = 0; l + 1 < L; l++) {
        double s = 0;
        const float *dk = kvq_kv_table_get(&a->k[l], "dist")->data, *dv = kvq_kv_table_get(&a->v[l], "dist")->data;
        for (size_t h = 0; h < H; h++) s += (double)dk[h] + (double)dv[h];
        score[l] = s / (double)(2 * H);
    }
    size_t got = 0;
    while (got < want) {
        size_t best = L;
        for (size_t l = from; l + 1 < L; l++)
            if (!used[l] && !used[l + 1] && (best == L || score[l] < score[best])) best = l;
        if (best == L) break;
        used[best] = used[best + 1] = true;
        kvq_fam_tensor *mk = (kvq_fam_tensor *)kvq_kv_table_get(&a->k[best], "merge");
        kvq_fam_tensor *mv = (kvq_fam_tensor *)kvq_kv_table_get(&a->v[best], "merge");
        mk->data[0] = mv->data[0] = 1;
        got++;
    }
    free(score);
    free(used);
    if (got < want)
        return kvq_fail(err, KVQ_EINVAL, "minicache: only %zu disjoint layer pairs from layer %zu fit %zu layers, %zu asked", got,
                        from, L, want);
    return KVQ_OK;
}

static const kvq_family_artifact art_mc = {
    .post_rope_only = true,
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "cross-layer-merged-per-token-head",
    .v_scaling = "cross-layer-merged-per-token-head",
    .check_params = check_params_mc,
    .inspect = inspect_mc,
    .tensors = tensors_mc,
    .check_tensors = check_tensors_mc,
    .params = param_names,
};

static const kvq_family_calib calib_mc = {
    .bits = 4,
    .post_rope = true,
    .fit_k = true,
    .fit_v = true,
    .fit_layer = fit_layer_mc,
    .finish = finish_mc,
    .x = {0.6, 0.05, 0, 0},
};

const kvq_family kvq_family_minicache = {
    .name = "minicache",
    .syntax = "minicache[<b>][-s<S>|-cal][-t<t>][-g<g>][-c<C>] (default S=layers/2, t=0.6, g=0.05, C=1)",
    .summary = "MiniCache (arXiv 2405.14366 §4): adjacent layers' K/V directions merged by SLERP from layer S on, per-layer "
               "magnitudes, unmergeable tokens retained; b-bit per-vector integer or fp16 storage; windows in steps of C tokens",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_mc,
    .format = fmt_mc,
    .validate = validate_mc,
    .check_model = check_model_mc,
    .check_ctx = check_ctx_mc,
    .needs_artifact = needs_artifact_mc,
    .match = match_mc,
    .describe_need = need_mc,
    .bind_params = bind_params_mc,
    .from_params = from_params_mc,
    .check_tables = check_tables_mc,
    .artifact = &art_mc,
    .calib = &calib_mc,
    .quantize = quantize_mc,
    .transform = transform_mc,
    .chunk = chunk_mc,
    .cache = cache_mc,
    .run_free = run_free_mc,
    .no_backward = true,
    .describe = describe_mc,
    .bits = bits_mc,
    .code_bits = code_bits_mc,
};
