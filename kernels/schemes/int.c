/* int.c — uniform asymmetric intX per token, keys and values: per group of
 * `group` channels of one token (0 = the whole token, all KV heads), float
 * minimum as zero point, round half to even (kernels/quant/quant.h
 * kvq_quant_int_token). KVQuant's intX baseline (Hooper et al., arXiv
 * 2401.18079, App.P: post-RoPE per-token keys, one fp16 sink token in its
 * Table 18 baselines). Differences from the reference: KVQuant's simquant
 * computes the same min/max rule in fp16; kvq in double from fp32 inputs,
 * rounded once (quant.h "Numerics"). */
#include <string.h>

#include "family.h"

static int parse_int(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    unsigned long bits, g = 0;
    const char *p = b;
    int r = kvq_spec_bits(&p, "int", spec, &bits, err);
    if (r <= 0) return r;
    if (kvq_spec_starts(p, "-pc")) return 0; /* the int-pc family */
    if (kvq_spec_starts(p, "-g")) {
        p += 2;
        if (!kvq_spec_uint(&p, 1u << 20, &g) || g == 0)
            return kvq_spec_bad(spec, err, "group size after -g: expected an integer >= 1");
    }
    if (*p) return kvq_spec_bad(spec, err, "expected int<b>[-g<G>] (e.g. int4, int4-g64)");
    q->k_bits = q->v_bits = (int)bits;
    q->group = g;
    return 1;
}

static void fmt_int(const kvq_scheme *q, char *b, size_t n)
{
    if (q->group) snprintf(b, n, "int%d-g%zu", q->k_bits, q->group);
    else snprintf(b, n, "int%d", q->k_bits);
}

static kvq_status validate_int(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: int per-token has no sparse outliers, found %g", q->outlier_frac);
    return KVQ_OK;
}

static kvq_status check_model_int(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    if (q->group && kvd % q->group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide the model's kv_dim %zu", spec, q->group, kvd);
    return KVQ_OK;
}

static kvq_status quantize_int(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                               size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)hd;
    return kvq_quant_int_token(out, in, T, kvd, d->q.group, side == 'k' ? d->q.k_bits : d->q.v_bits, d->q.n_sink, c, err);
}

/* b code bits + an fp16 scale and zero point per group of g channels (whole token: kv_dim) */
static kvq_status bits_int(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double g = (double)(q->group ? q->group : in->kv_dim);
    out->k = kvq_bits_mix16(q->k_bits + 32.0 / g, in->ctx, q->n_sink);
    out->v = kvq_bits_mix16(q->v_bits + 32.0 / g, in->ctx, q->n_sink);
    return KVQ_OK;
}

static void describe_int(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "group_size", (double)q->group);
}

static void from_params_int(const kvq_artifact_params *p, kvq_scheme *q)
{
    q->k_bits = p->k_bits;
    q->v_bits = p->v_bits;
    q->group = p->group_size;
    q->n_sink = p->n_sink;
}

/* int and int-pc: a per-token group size must divide kv_dim */
kvq_status kvq_int_check_group(const kvq_artifact_params *p, kvq_err *err);
kvq_status kvq_int_check_group(const kvq_artifact_params *p, kvq_err *err)
{
    size_t kv_dim = p->n_kv_heads * p->head_dim;
    if (p->group_size && kv_dim % p->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group_size: expected 0 or a divisor of kv_dim %zu, found %zu", kv_dim, p->group_size);
    return KVQ_OK;
}

void kvq_int_inspect_group(FILE *f, const kvq_artifact_params *p);
void kvq_int_inspect_group(FILE *f, const kvq_artifact_params *p)
{
    fprintf(f, "group size    %zu%s\n", p->group_size, p->group_size ? " channels" : " (whole token)");
}

static const kvq_family_artifact art_int = {
    .post_rope_only = true,
    .k_axis = "per-token",
    .v_axis = "per-token",
    .k_scaling = "uniform-online-per-token-minmax",
    .v_scaling = "uniform-online-per-token-minmax",
    .check_params = kvq_int_check_group,
    .inspect = kvq_int_inspect_group,
};

/* KVQuant's baselines: post-RoPE per-token keys, one fp16 sink token (App.P, Table 18) */
static const kvq_family_calib calib_int = {
    .bits = 4,
    .sink = 1,
    .post_rope = true,
    .group_opt = true,
};

#ifdef KVQ_CUDA
extern const kvq_family_cuda kvq_int_cuda;
#endif

const kvq_family kvq_family_int = {
    .name = "int",
    .syntax = "int<b>[-g<G>]",
    .summary = "uniform asymmetric per-token K and V, G channels per (scale, zero) group (default the whole token: "
               "KVQuant's intX baseline, App.P); post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_int,
    .format = fmt_int,
    .validate = validate_int,
    .check_model = check_model_int,
    .from_params = from_params_int,
    .artifact = &art_int,
    .calib = &calib_int,
    .quantize = quantize_int,
    .describe = describe_int,
    .bits = bits_int,
    .cuda = KVQ_FAMILY_CUDA(kvq_int_cuda),
};
