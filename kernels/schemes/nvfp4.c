/* nvfp4.c — NVIDIA's NVFP4 KV cache (kernels/quant/quant_fp4.h): E2M1 values
 * in blocks of 16 along head_dim, one E4M3 block scale per block computed
 * when the token is written (dynamic), and one float32 per-tensor scale g per
 * layer for K and one for V (stored in the dequantization direction,
 * amax / (448 * 6); TensorRT-LLM / ModelOpt checkpoints, SGLang's
 * NVFP4KVCacheMethod with FlashInfer's nvfp4_kv_quantize). Two specs:
 *   nvfp4                g = 1.0 for every layer: what the engine runs when the
 *                        checkpoint carries no KV scales (SGLang initialises
 *                        its per-layer scales to ones); no calibration.
 *   nvfp4-tensor[-p<P>]  g from a kvcalib nvfp4 artifact: absmax (or the P-th
 *                        percentile) of |x| over the calibration keys/values of
 *                        that layer divided by 448 * 6 (ModelOpt's rule).
 * The block scales are dynamic in both; a per-tensor scale taken from the
 * evaluated text itself would read future tokens (not decode-equivalent) and
 * is not offered. Keys post-RoPE (what the engines cache); the first n_sink
 * tokens exact. head_dim must be a multiple of 16 (FlashInfer's kernel
 * requires it): other models are refused with KVQ_EUNSUPPORTED.
 * The artifact stores g as layers.<i>.{k,v}.fp8_scale (one float32, the
 * family's fp8_scales storage; kvq.method "nvfp4", kvq.fp8_format e4m3fn =
 * the block scales' format). variant: 0 = unit g, 1 = g from an artifact. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "cli.h"
#include "quant_fp4.h"
#include "quant_fp8.h"

enum { NV_UNIT = 0, NV_SCALED = 1 };

static const char SPEC_HELP[] = "expected nvfp4 or nvfp4-tensor[-p<P>] (e.g. nvfp4-tensor, nvfp4-tensor-p99.9)";

static int parse_nvfp4(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!strcmp(b, "nvfp4")) {
        q->k_bits = q->v_bits = 4;
        q->variant = NV_UNIT;
        return 1;
    }
    if (!kvq_spec_starts(b, "nvfp4-")) return 0;
    const char *p = b + 6;
    if (!kvq_spec_starts(p, "tensor")) return kvq_spec_bad(spec, err, SPEC_HELP);
    p += 6;
    double pct = 100;
    if (kvq_spec_starts(p, "-p")) {
        p += 2;
        char buf[32];
        size_t n = strlen(p);
        if (n == 0 || n >= sizeof buf || strspn(p, "0123456789.") != n)
            return kvq_spec_bad(spec, err, "percentile after -p: expected a number in (0, 100] (e.g. nvfp4-tensor-p99.9)");
        memcpy(buf, p, n + 1);
        if (!kvq_parse_double(buf, &pct) || !(pct > 0 && pct <= 100))
            return kvq_spec_bad(spec, err, "percentile after -p: expected a number in (0, 100] (e.g. nvfp4-tensor-p99.9)");
        p += n;
    }
    if (*p) return kvq_spec_bad(spec, err, SPEC_HELP);
    q->k_bits = q->v_bits = 4;
    q->variant = NV_SCALED;
    q->percentile = pct;
    return 1;
}

static bool scaled(const kvq_scheme *q) { return q->variant == NV_SCALED; }

static void fmt_nvfp4(const kvq_scheme *q, char *b, size_t n)
{
    if (!scaled(q)) {
        snprintf(b, n, "nvfp4");
        return;
    }
    char pct[40] = "";
    if (q->percentile < 100) snprintf(pct, sizeof pct, "-p%g", q->percentile);
    snprintf(b, n, "nvfp4-tensor%s", pct);
}

static kvq_status validate_nvfp4(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0 || q->group || q->residual)
        return kvq_fail(err, KVQ_EINVAL, "scheme: nvfp4 has no outliers, groups or residual (found %g, %zu, %zu)",
                        q->outlier_frac, q->group, q->residual);
    if (q->variant != NV_UNIT && q->variant != NV_SCALED)
        return kvq_fail(err, KVQ_EINVAL, "scheme: nvfp4 variant: unknown value %d", q->variant);
    if (q->k_bits != 4 || q->v_bits != 4)
        return kvq_fail(err, KVQ_EINVAL, "scheme: nvfp4 stores 4-bit codes, found %d / %d", q->k_bits, q->v_bits);
    return KVQ_OK;
}

static kvq_status check_model_nvfp4(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    (void)q;
    if (hp->head_dim % 16)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "scheme '%s': head_dim %d is not a multiple of the 16-value NVFP4 block (FlashInfer's "
                        "nvfp4_kv_quantize requires it), so this scheme does not apply",
                        spec, hp->head_dim);
    return KVQ_OK;
}

static bool needs_artifact_nvfp4(const kvq_scheme *q) { return scaled(q); }

static bool match_nvfp4(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, const kvq_artifact_params *p)
{
    return p->method && !strcmp(p->method->name, "nvfp4") && fabs(p->fp8_percentile - q->percentile) <= 1e-9 &&
           (!stage_set || p->post_rope == (stage == KVQ_KEYS_POST_ROPE));
}

static void need_nvfp4(const kvq_scheme *q, bool stage_set, kvq_key_stage stage, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method nvfp4 (per-tensor scales, %s)%s",
             q->percentile < 100 ? "percentile" : "absmax, percentile 100",
             stage_set ? (stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
    if (q->percentile < 100) {
        size_t l = strlen(buf);
        if (l < n) snprintf(buf + l, n - l, " %g", q->percentile);
    }
}

static void describe_nvfp4(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)q;
    o->num(o->ctx, "block_size", 16);
    o->str(o->ctx, "block_scale_format", "e4m3fn");
    o->str(o->ctx, "tensor_scale", has_artifact ? "calibrated" : "unit");
    if (has_artifact) o->num(o->ctx, "tensor_scale_percentile", q->percentile);
}

static void from_params_nvfp4(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = q->v_bits = 4;
    q->variant = NV_SCALED;
    q->percentile = p->fp8_percentile;
    q->n_sink = p->n_sink;
}

static kvq_status check_tables_nvfp4(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err)
{
    if (!scaled(&d->q)) return KVQ_OK;
    const kvq_artifact *a = d->art;
    if (!a || a->p.n_layers != (size_t)hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "kv descriptor: nvfp4 per-tensor scales need an artifact of %d layers", hp->n_layers);
    for (size_t l = 0; l < a->p.n_layers; l++) {
        const kvq_kv_table *kt = a->k ? &a->k[l] : NULL, *vt = a->v ? &a->v[l] : NULL;
        if (!kt || !vt || !kt->fp8_scale || !vt->fp8_scale || kt->n_fp8_scales != 1 || vt->n_fp8_scales != 1)
            return kvq_fail(err, KVQ_EFORMAT, "layer %zu lacks the nvfp4 per-tensor scale for K or V", l);
    }
    return KVQ_OK;
}

static float tensor_scale(const kvq_kv_desc *d, int layer, char side)
{
    if (!scaled(&d->q)) return 1.0f;
    const kvq_kv_table *t = side == 'k' ? &d->art->k[layer] : &d->art->v[layer];
    return t->fp8_scale[0];
}

/* per token, 16-value blocks with dynamic E4M3 scales under the layer's per-tensor scale; the first
 * n_sink tokens exact */
static kvq_status quantize_nvfp4(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                 size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    size_t ns = d->q.n_sink < T ? d->q.n_sink : T;
    if (out != in) memmove(out, in, ns * kvd * sizeof(float));
    uint64_t clipped = 0;
    if (T > ns)
        KVQ_TRY(kvq_fp4_kv_roundtrip(KVQ_FP4_NVFP4, in + ns * kvd, out + ns * kvd, T - ns, kvd / hd, hd,
                                     tensor_scale(d, layer, side), &clipped, err));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
        c->n_clipped += clipped;
    }
    return KVQ_OK;
}

/* 4-bit codes + one E4M3 byte per 16 values + one float32 per-tensor scale per layer (also when it is
 * 1.0: the engine keeps it) amortised over the ctx-token cache; sink tokens at 16 */
static kvq_status bits_nvfp4(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double dense = kvq_fp4_bits_per_element(KVQ_FP4_NVFP4, in->ctx * in->kv_dim);
    out->k = out->v = kvq_bits_mix16(dense, in->ctx, q->n_sink);
    return KVQ_OK;
}

static int code_bits_nvfp4(const kvq_scheme *q, char side)
{
    (void)q;
    (void)side;
    return 4;
}

static kvq_status check_params_nvfp4(const kvq_artifact_params *p, kvq_err *err)
{
    if (p->k_bits != 4 || p->v_bits != 4)
        return kvq_fail(err, KVQ_EINVAL, "k_bits, v_bits: nvfp4 stores 4-bit codes, found %d / %d", p->k_bits, p->v_bits);
    if (p->group_size || p->residual_length)
        return kvq_fail(err, KVQ_EINVAL, "group_size, residual_length: nvfp4 has neither, found %zu / %zu", p->group_size,
                        p->residual_length);
    if (p->per_head)
        return kvq_fail(err, KVQ_EINVAL, "granularity: nvfp4 has one per-tensor scale per layer, found per-head");
    if (p->fp8_e5m2)
        return kvq_fail(err, KVQ_EINVAL, "fp8_format: nvfp4's block scales are E4M3FN, found e5m2");
    if (!(p->fp8_percentile > 0 && p->fp8_percentile <= 100))
        return kvq_fail(err, KVQ_EINVAL, "fp8_percentile: expected (0, 100], found %g", p->fp8_percentile);
    return KVQ_OK;
}

static void inspect_nvfp4(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "nvfp4         E2M1 in 16-value blocks, E4M3 block scales, per-tensor scale = %s / (448 * 6)\n",
            p->fp8_percentile < 100 ? "percentile of |x|" : "absmax");
    if (p->fp8_percentile < 100) fprintf(f, "percentile    %.6g\n", p->fp8_percentile);
}

/* drop each sample's first n_sink rows (in place), take the per-tensor scale, count saturation */
static kvq_status fit_nvfp4(const kvq_artifact_params *p, char side, const kvq_fit_input *in, kvq_kv_table *out,
                            kvq_err *err)
{
    (void)side;
    size_t H = in->n_kv_heads, D = in->head_dim, kvd = H * D;
    float *x = (float *)in->x; /* the driver's buffer, ours to compact */
    size_t rows = kvq_fit_drop_sink(in, p->n_sink);
    double stat;
    KVQ_TRY(kvq_fp8_calib_stat(x, rows, H, D, p->fp8_percentile, &stat, err));
    memset(out, 0, sizeof *out);
    out->bits = 4;
    out->kv_dim = kvd;
    out->n_fp8_scales = 1;
    out->fp8_scale = malloc(sizeof *out->fp8_scale);
    if (!out->fp8_scale) return kvq_fail(err, KVQ_ENOMEM, "out of memory");
    out->fp8_scale[0] = kvq_nvfp4_global_scale(stat);
    /* saturated on the calibration data (|x| scaled at or beyond 7, or a block scale above 448); the
     * round trip runs in place: the statistic is taken */
    uint64_t clipped = 0;
    kvq_status s = kvq_fp4_kv_roundtrip(KVQ_FP4_NVFP4, x, x, rows, H, D, out->fp8_scale[0], &clipped, err);
    if (s) {
        kvq_kv_table_free(out);
        return s;
    }
    out->n_elems = out->n_points = (uint64_t)rows * kvd;
    out->n_outliers = clipped;
    return KVQ_OK;
}

static const kvq_family_artifact art_nvfp4 = {
    .fp8_scales = true,
    .k_axis = "per-token-block16",
    .v_axis = "per-token-block16",
    .k_scaling = "nvfp4-e4m3-block-and-tensor-scale",
    .v_scaling = "nvfp4-e4m3-block-and-tensor-scale",
    .check_params = check_params_nvfp4,
    .inspect = inspect_nvfp4,
};

/* 4-bit E2M1, per-tensor absmax scales (percentile 100), no sink, post-RoPE keys (ModelOpt's amax / (448 * 6)) */
static const kvq_family_calib calib_nvfp4 = {
    .bits = 4,
    .post_rope = true,
    .fp8_percentile = 100,
    .fp8_opt = true,
    .fit_k = true,
    .fit_v = true,
    .fit = fit_nvfp4,
};

const kvq_family kvq_family_nvfp4 = {
    .name = "nvfp4",
    .syntax = "nvfp4, nvfp4-tensor[-p<P>]",
    .summary = "NVIDIA NVFP4 cache: E2M1 in 16-value blocks with dynamic E4M3 block scales under a float32 per-tensor "
               "scale, 1.0 or from a kvcalib nvfp4 artifact (amax or percentile P / (448*6)); post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_nvfp4,
    .format = fmt_nvfp4,
    .validate = validate_nvfp4,
    .check_model = check_model_nvfp4,
    .needs_artifact = needs_artifact_nvfp4,
    .match = match_nvfp4,
    .describe_need = need_nvfp4,
    .from_params = from_params_nvfp4,
    .check_tables = check_tables_nvfp4,
    .artifact = &art_nvfp4,
    .calib = &calib_nvfp4,
    .quantize = quantize_nvfp4,
    .describe = describe_nvfp4,
    .bits = bits_nvfp4,
    .code_bits = code_bits_nvfp4,
};
