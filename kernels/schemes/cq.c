/* cq.c — CQ, coupled quantization (Zhang, Yi, Xu, Shrivastava, "KV Cache is 1
 * Bit Per Channel: Efficient Large Language Model Inference with Coupled
 * Quantization", arXiv 2405.03917, NeurIPS 2024).
 *
 * §3.1: the channels of a key or value vector are not independent, so coding
 * several jointly costs fewer bits than coding each alone (joint entropy <
 * sum of marginal entropies). §3.2: the channels of each token are split into
 * contiguous, non-overlapping groups of c channels; each group is stored as
 * one b-bit index into a learned codebook of 2^b centroids in c dimensions,
 * one codebook per channel group, per layer, for keys and for values — b/c
 * bits per channel ("CQ-<c>c<b>b"; §4 runs 2c8b = 4 bits, 4c8b = 2 bits,
 * 8c8b = 1 bit per channel). Centroids are learned offline on calibration
 * activations by k-means; "Fisher-guided centroid learning" weights each
 * calibration vector by its squared gradient norm, the sum of the Fisher
 * information (squared gradients) of its c channels (§3.2, the weighted
 * objective), which kvq takes from the dump's fisher_k_pre_rope / fisher_v.
 *
 * Spec: cq-c<c>b<b> (e.g. cq-c8b8, cq-c4b8, cq-c2b8); c divides head_dim
 * (groups never cross KV heads), b = 1..8. Tables: an artifact of method cq
 * (kvcalib --method cq --group <c> --bits <b>) holding, per layer,
 *   layers.<i>.k.codebook, layers.<i>.v.codebook   float32 [kv_dim / c][2^b][c]
 * group g covers channels g*c .. g*c+c-1 (channel = h*head_dim + d); keys pre-RoPE
 * by default (--keys post-rope for the ablation). Parameters (kvcalib --param):
 *   iters   Lloyd iterations after k-means++ seeding (default 20)
 *   points  calibration vectors per group at most (default 8192): an evenly
 *           strided subset of the non-sink calibration tokens, so that the
 *           default model's 16 x 2048 dump calibrates in under a minute on
 *           two cores; at least 2^b (one per codeword), else refused.
 * The cache (form 1 of the contract, in place): every non-sink token's group
 * is replaced by its nearest centroid (kernels/quant/vq.h: squared Euclidean
 * distance, ties to the lowest index); the first n_sink tokens stay exact.
 *
 * Bits per element: b/c code bits, plus the codebooks, 2^b * c fp16 numbers per
 * group = 16 * 2^b / ctx bits per element amortised over a context of ctx
 * tokens (one layer's codebooks over one sequence: 2 bits at ctx 2048 for
 * b = 8 — the paper counts only the codes, its codebooks being shared by a
 * whole batch of long sequences), sink tokens at 16 bits.
 *
 * Differences from the reference (the paper; its code was not available to
 * us): kvq learns centroids with weighted Lloyd from one k-means++ start on an
 * evenly strided subset of at most `points` tokens per group (the paper
 * trains its centroids on all calibration tokens, on the GPU); the
 * calibration set is the kvdump windows (the paper: 16 windows of 2048 tokens
 * of WikiText-2 / C4); codes are chosen by unweighted nearest centroid (as
 * the paper) in fp32 (the paper in fp16); keys are pre-RoPE by default
 * (rotary pairs lie inside a group for even c, and RoPE's rotation spreads a
 * post-RoPE pair's distribution over a circle, which the codebook must then
 * cover: measured on the default model in docs/RESULTS.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "vq.h"

enum { CQ_X_ITERS = 0, CQ_X_POINTS = 1 };
#define CQ_MAX_C 64

static int parse_cq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!kvq_spec_starts(b, "cq")) return 0;
    const char *p = b + 2;
    unsigned long c, bits;
    if (!kvq_spec_starts(p, "-c")) return kvq_spec_bad(spec, err, "expected cq-c<c>b<b> (e.g. cq-c8b8: 8 channels per 8-bit code)");
    p += 2;
    if (!kvq_spec_uint(&p, CQ_MAX_C, &c) || c == 0)
        return kvq_spec_bad(spec, err, "channels per group after -c: expected 1..64");
    if (*p != 'b') return kvq_spec_bad(spec, err, "expected cq-c<c>b<b> (e.g. cq-c8b8)");
    p++;
    if (!kvq_spec_uint(&p, 8, &bits) || bits == 0) return kvq_spec_bad(spec, err, "bits per code after b: expected 1..8");
    if (*p) return kvq_spec_bad(spec, err, "expected cq-c<c>b<b> (e.g. cq-c8b8, cq-c4b8, cq-c2b8)");
    q->k_bits = q->v_bits = (int)bits;
    q->group = c;
    return 1;
}

static void fmt_cq(const kvq_scheme *q, char *b, size_t n) { snprintf(b, n, "cq-c%zub%d", q->group, q->k_bits); }

static kvq_status validate_cq(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: cq has no sparse outliers, found %g", q->outlier_frac);
    if (q->group < 1 || q->group > CQ_MAX_C)
        return kvq_fail(err, KVQ_EINVAL, "scheme: cq channels per group: expected 1..%d, found %zu", CQ_MAX_C, q->group);
    if (q->k_bits != q->v_bits)
        return kvq_fail(err, KVQ_EINVAL, "scheme: cq code bits: keys and values share b, found %d / %d", q->k_bits, q->v_bits);
    return KVQ_OK;
}

static kvq_status check_model_cq(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if ((size_t)hp->head_dim % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': %zu channels per group do not divide head_dim %d (CQ groups never cross KV heads)",
                        spec, q->group, hp->head_dim);
    return KVQ_OK;
}

static bool needs_artifact_cq(const kvq_scheme *q)
{
    (void)q;
    return true;
}

static bool match_cq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "cq") && p->group_size == q->group && p->k_bits == q->k_bits &&
           p->v_bits == q->v_bits && (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_cq(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method cq with %zu channels per group (--group %zu) and %d-bit codes (--bits %d)%s",
             q->group, q->group, q->k_bits, q->k_bits,
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
}

static void bind_params_cq(kvq_scheme *q, const kvq_artifact_params *p)
{
    for (int j = 0; j < KVQ_SCHEME_X; j++) q->x[j] = p->x[j];
}

static void from_params_cq(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
    bind_params_cq(q, p);
}

/* the codebook of (layer, side) from the bound artifact, shape-checked against the scheme */
static kvq_status codebook(const kvq_kv_desc *d, int layer, char side, size_t kvd, const float **cb, kvq_err *err)
{
    const kvq_artifact *a = d->art;
    if (!a || layer < 0 || (size_t)layer >= a->p.n_layers || !(side == 'k' ? a->k : a->v))
        return kvq_fail(err, KVQ_EINVAL, "cq: layer %d: no artifact tables bound (a kvcalib artifact of method cq)", layer);
    const kvq_fam_tensor *t = kvq_kv_table_get(side == 'k' ? &a->k[layer] : &a->v[layer], "codebook");
    size_t c = d->q.group, K = (size_t)1 << (side == 'k' ? d->q.k_bits : d->q.v_bits);
    if (!t || t->n_dims != 3 || t->shape[0] != kvd / c || t->shape[1] != K || t->shape[2] != c)
        return kvq_fail(err, KVQ_EINVAL, "cq: layers.%d.%c.codebook: expected [%zu][%zu][%zu] (kv_dim / c, 2^b, c), found %s", layer,
                        side, kvd / c, K, c, t ? "another shape" : "none");
    *cb = t->data;
    return KVQ_OK;
}

static kvq_status check_tables_cq(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    const float *cb;
    for (int l = 0; l < hp->n_layers; l++) {
        KVQ_TRY(codebook(d, l, 'k', kvd, &cb, err));
        KVQ_TRY(codebook(d, l, 'v', kvd, &cb, err));
    }
    return KVQ_OK;
}

/* Every non-sink token's c-channel groups replaced by their nearest centroids. */
kvq_status kvq_cq_quantize(float *out, const float *in, size_t T, size_t kvd, size_t c, size_t K, const float *cb, size_t n_sink,
                           kvq_quant_counts *cnt, kvq_err *err);
kvq_status kvq_cq_quantize(float *out, const float *in, size_t T, size_t kvd, size_t c, size_t K, const float *cb, size_t n_sink,
                           kvq_quant_counts *cnt, kvq_err *err)
{
    if (c == 0 || kvd % c || K == 0 || K > KVQ_VQ_MAX_K)
        return kvq_fail(err, KVQ_EINVAL, "cq: %zu channels per group, %zu codewords, kv_dim %zu", c, K, kvd);
    size_t G = kvd / c, ns = n_sink < T ? n_sink : T;
    float *cbt = malloc(G * K * c * sizeof *cbt);
    if (!cbt) return kvq_fail(err, KVQ_ENOMEM, "cq: cannot allocate %zu floats", G * K * c);
    for (size_t g = 0; g < G; g++) kvq_vq_transpose(cbt + g * K * c, cb + g * K * c, K, c);
    if (out != in) memcpy(out, in, ns * kvd * sizeof *out);
    long long n = (long long)(T - ns);
#pragma omp parallel for schedule(static) if (n * (long long)(K * kvd) > (1ll << 22))
    for (long long i = 0; i < n; i++) {
        float dist[KVQ_VQ_MAX_K];
        size_t t = ns + (size_t)i;
        for (size_t g = 0; g < G; g++) {
            const float *x = in + t * kvd + g * c, *cg = cb + g * K * c;
            size_t k = kvq_vq_nearest_t(x, cbt + g * K * c, K, c, dist);
            memcpy(out + t * kvd + g * c, cg + k * c, c * sizeof *out);
        }
    }
    free(cbt);
    if (cnt) {
        cnt->n_elems += (uint64_t)T * kvd;
        cnt->n_sink += (uint64_t)ns * kvd;
    }
    return KVQ_OK;
}

static kvq_status quantize_cq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                              size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)hd;
    const float *cb;
    KVQ_TRY(codebook(d, layer, side, kvd, &cb, err));
    size_t K = (size_t)1 << (side == 'k' ? d->q.k_bits : d->q.v_bits);
    return kvq_cq_quantize(out, in, T, kvd, d->q.group, K, cb, d->q.n_sink, c, err);
}

/* b/c code bits + 2^b * c fp16 centroid numbers per c channels of a layer, amortised over ctx tokens;
 * sink tokens at 16 bits */
static kvq_status bits_cq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double ctx = (double)in->ctx, c = (double)q->group;
    out->k = kvq_bits_mix16(q->k_bits / c + 16.0 * (double)(1u << q->k_bits) / ctx, in->ctx, q->n_sink);
    out->v = kvq_bits_mix16(q->v_bits / c + 16.0 * (double)(1u << q->v_bits) / ctx, in->ctx, q->n_sink);
    return KVQ_OK;
}

/* kveval's code-bits column is an integer: b / c rounded (1 for cq-c8b8); the JSON has the exact value */
static int code_bits_cq(const kvq_scheme *q, char side)
{
    int b = side == 'k' ? q->k_bits : q->v_bits;
    long r = lround((double)b / (double)q->group);
    return r < 1 ? 1 : (int)r;
}

static void describe_cq(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    o->num(o->ctx, "channels_per_group", (double)q->group);
    o->num(o->ctx, "code_bits_per_channel", (double)q->k_bits / (double)q->group);
    if (has_artifact) {
        o->num(o->ctx, "calib_iters", q->x[CQ_X_ITERS]);
        o->num(o->ctx, "calib_points", q->x[CQ_X_POINTS]);
    }
}

/* ---- artifact and calibration ---- */

static const char *const CQ_TABLES[] = {"codebook", NULL};
static const char *const *tensors_cq(const kvq_artifact_params *p, char side)
{
    (void)p;
    (void)side;
    return CQ_TABLES;
}

static kvq_status check_tensors_cq(const kvq_artifact_params *p, size_t layer, char side, const kvq_kv_table *t, kvq_err *err)
{
    const kvq_fam_tensor *x = kvq_kv_table_get(t, "codebook");
    size_t kvd = p->n_kv_heads * p->head_dim, c = p->group_size, K = (size_t)1 << (side == 'k' ? p->k_bits : p->v_bits);
    if (x->n_dims != 3 || x->shape[0] != kvd / c || x->shape[1] != K || x->shape[2] != c)
        return kvq_fail(err, KVQ_EINVAL, "layers.%zu.%c.codebook: expected shape [%zu, %zu, %zu] (kv_dim / group_size, 2^bits, group_size), "
                        "found %u dimensions [%llu, %llu, %llu]", layer, side, kvd / c, K, c, x->n_dims, (unsigned long long)x->shape[0],
                        (unsigned long long)(x->n_dims > 1 ? x->shape[1] : 0), (unsigned long long)(x->n_dims > 2 ? x->shape[2] : 0));
    return KVQ_OK;
}

static kvq_status check_params_cq(const kvq_artifact_params *p, kvq_err *err)
{
    if (p->group_size < 1 || p->group_size > CQ_MAX_C || p->head_dim % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group_size: cq's channels per group must divide head_dim %zu (groups never cross KV heads), "
                        "found %zu", p->head_dim, p->group_size);
    if (p->k_bits != p->v_bits)
        return kvq_fail(err, KVQ_EINVAL, "bits: cq codes keys and values with the same b, found %d / %d", p->k_bits, p->v_bits);
    double it = p->x[CQ_X_ITERS], pts = p->x[CQ_X_POINTS];
    if (!(it >= 1 && it <= 1000 && it == floor(it)))
        return kvq_fail(err, KVQ_EINVAL, "iters: expected an integer 1..1000 (Lloyd iterations), found %g", it);
    if (!(pts >= 1 && pts <= 1e8 && pts == floor(pts)))
        return kvq_fail(err, KVQ_EINVAL, "points: expected an integer 1..1e8 (calibration vectors per group), found %g", pts);
    if (p->k_bits >= 1 && p->k_bits < 31 && pts < (double)(1u << p->k_bits)) /* a codebook of copies of the few points */
        return kvq_fail(err, KVQ_EINVAL, "points: %g calibration vectors per group cannot fit %u codewords (%d-bit codes): expected "
                        "at least %u", pts, 1u << p->k_bits, p->k_bits, 1u << p->k_bits);
    return KVQ_OK;
}

static void inspect_cq(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "cq            %zu channels per %d-bit code (%.4g code bits per channel), Lloyd iterations %g, at most %g "
               "calibration vectors per group, %s\n",
            p->group_size, p->k_bits, (double)p->k_bits / (double)p->group_size, p->x[CQ_X_ITERS], p->x[CQ_X_POINTS],
            p->fisher ? "Fisher-weighted" : "unweighted");
}

/* One side of one layer: a codebook per group of c channels from at most `points` non-sink tokens. */
static kvq_status fit_cq(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out, kvq_err *err)
{
    size_t kvd = in->n_kv_heads * in->head_dim, c = p->group_size, G = kvd / c;
    int bits = side == 'k' ? p->k_bits : p->v_bits;
    size_t K = (size_t)1 << bits, per = in->sample_len ? in->sample_len : in->n_tokens;
    size_t ns = p->n_sink < per ? p->n_sink : per, avail = in->n_tokens / per * (per - ns);
    if (avail == 0)
        return kvq_fail(err, KVQ_EINVAL, "cq: no calibration tokens left after excluding %zu sink tokens per sample of %zu", ns, per);
    size_t M = (size_t)p->x[CQ_X_POINTS];
    if (M > avail) M = avail;
    float *x = malloc(M * c * sizeof *x), *w = in->fisher ? malloc(M * sizeof *w) : NULL, *cb;
    if (!x || (in->fisher && !w)) {
        free(x);
        free(w);
        return kvq_fail(err, KVQ_ENOMEM, "cq: cannot allocate %zu calibration vectors", M);
    }
    uint64_t sh[3] = {G, K, c};
    kvq_status s = kvq_kv_table_add(out, "codebook", 3, sh, &cb, err);
    kvq_vq_opts vo = {.max_iter = (int)p->x[CQ_X_ITERS]};
    for (size_t g = 0; !s && g < G; g++) {
        for (size_t i = 0; i < M; i++) {
            size_t a = (size_t)((double)i * (double)avail / (double)M), t = a / (per - ns) * per + ns + a % (per - ns);
            memcpy(x + i * c, in->x + t * kvd + g * c, c * sizeof *x);
            if (w) {
                double f = 0;
                for (size_t d = 0; d < c; d++) f += in->fisher[t * kvd + g * c + d];
                w[i] = (float)f;
            }
        }
        vo.seed = 0x51ed270b27ull + 1000003ull * g + (side == 'v');
        s = kvq_vq_kmeans(x, w, M, c, K, &vo, cb + g * K * c, NULL, err);
        if (s) kvq_err_prefix(err, "cq: channel group %zu (channels %zu..%zu)%s", g, g * c, g * c + c - 1,
                              w && s == KVQ_EINVAL ? " (Fisher weights: --no-fisher calibrates unweighted)" : "");
    }
    free(x);
    free(w);
    if (s) {
        kvq_kv_table_free(out);
        return s;
    }
    out->bits = bits;
    out->kv_dim = kvd;
    out->n_elems = (uint64_t)avail * kvd;
    out->n_points = (uint64_t)M * G;
    return KVQ_OK;
}

static const kvq_family_artifact art_cq = {
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "vector-codebook-per-channel-group",
    .v_scaling = "vector-codebook-per-channel-group",
    .check_params = check_params_cq,
    .inspect = inspect_cq,
    .tensors = tensors_cq,
    .check_tensors = check_tensors_cq,
    .params = (const char *const[]){"iters", "points", NULL},
};

/* the paper's headline configuration: 8 channels per 8-bit code (1 bit per channel), Fisher-guided
 * centroids, pre-RoPE keys, no sink */
static const kvq_family_calib calib_cq = {
    .bits = 8,
    .group = 8,
    .fisher = true,
    .pre_rope_ok = true,
    .fisher_opt = true,
    .group_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit = fit_cq,
    .x = {20, 8192},
};

const kvq_family kvq_family_cq = {
    .name = "cq",
    .syntax = "cq-c<c>b<b> (c channels per b-bit code)",
    .summary = "CQ coupled quantization (arXiv 2405.03917 §3): c contiguous channels coded jointly by a b-bit index into a learned "
               "per-group codebook (Fisher-guided k-means); pre-RoPE keys; tables from a kvcalib artifact",
    .default_stage = KVQ_KEYS_PRE_ROPE,
    .parse = parse_cq,
    .format = fmt_cq,
    .validate = validate_cq,
    .check_model = check_model_cq,
    .needs_artifact = needs_artifact_cq,
    .match = match_cq,
    .describe_need = need_cq,
    .bind_params = bind_params_cq,
    .from_params = from_params_cq,
    .check_tables = check_tables_cq,
    .artifact = &art_cq,
    .calib = &calib_cq,
    .quantize = quantize_cq,
    .describe = describe_cq,
    .bits = bits_cq,
    .code_bits = code_bits_cq,
};
