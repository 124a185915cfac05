/* turboquant.c — vLLM's TurboQuant KV-cache presets (--kv-cache-dtype turboquant_k8v4,
 * turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc), kernels/quant/quant_tq.h
 * for the formats and their source:
 *   preset      keys                                            values   norm correction
 *   k8v4        FP8 E4M3FN, no scale, no rotation               4-bit    —
 *   4bit-nc     Hadamard + 4-bit Lloyd–Max of N(0, 1/d) + fp16 norm  4-bit    yes
 *   k3v4-nc     Hadamard + 3-bit Lloyd–Max + fp16 norm          4-bit    yes
 *   3bit-nc     Hadamard + 3-bit Lloyd–Max + fp16 norm          3-bit    yes
 * "nc" (norm correction): the centroid vector is rescaled to unit length before the
 * fp16 norm multiplies it, so ||k̂|| = fp16(||k||). Values: uniform asymmetric per
 * (token, KV head), fp16 scale and zero, no rotation.
 * Spec: turboquant-<preset>[-b<N>]: vLLM keeps the first and last N = 2 attention layers of
 * a dense model uncompressed ("boundary protection", TurboQuantConfig.get_boundary_skip_layers,
 * applied by default for every turboquant_* dtype: min(N, n_layers/2) each side); -b0 turns
 * it off. Those layers are exact here (vLLM keeps them in the model dtype) and counted at 16
 * bits. The boundary layers need the model's depth: the hook has it (kvq_layer_ctx.n_layers);
 * kvstat's at-rest view (quantize) shows the compressed format for every layer.
 * Keys post-RoPE (what vLLM caches); head_dim a power of two (vLLM's Hadamard matrix);
 * no artifact, no native CUDA transform (the GPU runs it as the host hook).
 * Bits: keys b + 16/d (MSE) or 8 (FP8), values vb + 32/d (config.py key_packed_size,
 * value_packed_size); boundary layers and sink tokens at 16. */
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "hadamard.h"
#include "quant_tq.h"

/* x[0]: boundary layers each side */
#define TQ_BOUNDARY(q) ((int)(q)->x[0])

static const struct {
    const char *name;
    int k_bits, v_bits;
    bool nc;
} presets[] = {{"k8v4", 8, 4, false}, {"4bit-nc", 4, 4, true}, {"k3v4-nc", 3, 4, true}, {"3bit-nc", 3, 3, true}};
#define N_PRESETS (sizeof presets / sizeof *presets)

static int preset_of(const kvq_scheme *q)
{
    for (size_t i = 0; i < N_PRESETS; i++)
        if (presets[i].k_bits == q->k_bits && presets[i].v_bits == q->v_bits) return (int)i;
    return -1;
}

static int parse_tq(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    if (!kvq_spec_starts(b, "turboquant-")) return 0;
    const char *p = b + strlen("turboquant-");
    for (size_t i = 0; i < N_PRESETS; i++) {
        size_t n = strlen(presets[i].name);
        if (strncmp(p, presets[i].name, n) || (p[n] && p[n] != '-')) continue;
        p += n;
        unsigned long nb = 2;
        if (kvq_spec_starts(p, "-b")) {
            p += 2;
            if (!kvq_spec_uint(&p, 1024, &nb))
                return kvq_spec_bad(spec, err, "boundary layers after -b: expected an integer >= 0 (vLLM's default 2)");
        }
        if (*p) return kvq_spec_bad(spec, err, "expected turboquant-{k8v4,4bit-nc,k3v4-nc,3bit-nc}[-b<N>]");
        q->k_bits = presets[i].k_bits;
        q->v_bits = presets[i].v_bits;
        q->x[0] = (double)nb;
        return 1;
    }
    return kvq_spec_bad(spec, err, "unknown TurboQuant preset; expected turboquant-{k8v4,4bit-nc,k3v4-nc,3bit-nc}[-b<N>] "
                                   "(vLLM's turboquant_k8v4, _4bit_nc, _k3v4_nc, _3bit_nc)");
}

static void fmt_tq(const kvq_scheme *q, char *b, size_t n)
{
    int i = preset_of(q);
    if (TQ_BOUNDARY(q) == 2) snprintf(b, n, "turboquant-%s", i >= 0 ? presets[i].name : "?");
    else snprintf(b, n, "turboquant-%s-b%d", i >= 0 ? presets[i].name : "?", TQ_BOUNDARY(q));
}

static kvq_status validate_tq(const kvq_scheme *q, kvq_err *err)
{
    if (preset_of(q) < 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: turboquant: K/V bits %d/%d are no vLLM preset (8/4, 4/4, 3/4, 3/3)", q->k_bits,
                        q->v_bits);
    if (q->outlier_frac > 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: turboquant has no sparse outliers, found %g", q->outlier_frac);
    if (!(q->x[0] >= 0 && q->x[0] <= 1024 && q->x[0] == (int)q->x[0]))
        return kvq_fail(err, KVQ_EINVAL, "scheme: turboquant boundary layers: expected an integer 0..1024, found %g", q->x[0]);
    return KVQ_OK;
}

static int boundary_of(const kvq_scheme *q, int L);

static kvq_status check_model_tq(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    if (hp->n_layers > 0 && 2 * boundary_of(q, hp->n_layers) >= hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': %d boundary layers at each end cover all %d layers of the model: nothing "
                        "would be quantized (-b<n> with 2n < %d)", spec, TQ_BOUNDARY(q), hp->n_layers, hp->n_layers);
    int hd = hp->head_dim;
    if (hd < 2 || hd > KVQ_HADAMARD_MAX || (hd & (hd - 1)))
        return kvq_fail(err, KVQ_EINVAL,
                        "scheme '%s': head_dim %d: TurboQuant rotates the whole head with vLLM's Sylvester Hadamard "
                        "matrix, which needs a power of two", spec, hd);
    return KVQ_OK;
}

static kvq_status quantize_tq(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                              size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    const kvq_scheme *q = &d->q;
    if (hd < 2 || hd > KVQ_HADAMARD_MAX || (hd & (hd - 1)))
        return kvq_fail(err, KVQ_EINVAL, "turboquant: head_dim %zu: expected a power of two <= %d", hd, KVQ_HADAMARD_MAX);
    int bits = side == 'k' ? q->k_bits : q->v_bits;
    float cent[1 << KVQ_TQ_MAX_BITS];
    bool mse = side == 'k' && bits <= KVQ_TQ_MAX_BITS;
    if (mse) kvq_tq_centroids(hd, bits, cent);
    bool nc = preset_of(q) >= 0 && presets[preset_of(q)].nc;
    for (size_t t = 0; t < T; t++) {
        if (t < q->n_sink) {
            if (out != in) memcpy(out + t * kvd, in + t * kvd, kvd * sizeof *out);
            if (c) c->n_sink += kvd;
            continue;
        }
        for (size_t h = 0; h < kvd / hd; h++) {
            const float *x = in + t * kvd + h * hd;
            float *o = out + t * kvd + h * hd;
            if (side == 'k') kvq_tq_key(x, o, hd, bits, cent, nc);
            else kvq_tq_value(x, o, hd, bits);
        }
    }
    if (c) c->n_elems += T * kvd;
    return KVQ_OK;
}

/* boundary layers each side of a model of L layers (TurboQuantConfig.get_boundary_skip_layers) */
static int boundary_of(const kvq_scheme *q, int L)
{
    int n = TQ_BOUNDARY(q);
    return L <= 0 ? 0 : n < L / 2 ? n : L / 2;
}

static kvq_status transform_tq(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                               kvq_err *err)
{
    (void)alt;
    int nb = boundary_of(&run->d->q, c->n_layers);
    if (nb > 0 && (c->layer < nb || c->layer >= c->n_layers - nb)) { /* vLLM keeps it uncompressed */
        uint64_t n = (uint64_t)c->T * (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim;
        run->k_counts.n_elems += n, run->k_counts.n_exact += n;
        run->v_counts.n_elems += n, run->v_counts.n_exact += n;
        return KVQ_OK;
    }
    return kvq_family_transform_in_place(run, c, k, v, err);
}

static kvq_status bits_tq(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    if (!in->head_dim) return kvq_fail(err, KVQ_EINVAL, "turboquant bits: head_dim unknown (norms and scales are per KV head)");
    double d = (double)in->head_dim;
    double bk = q->k_bits == 8 ? 8.0 : q->k_bits + 16.0 / d, bv = q->v_bits + 32.0 / d;
    bk = kvq_bits_mix16(bk, in->ctx, q->n_sink);
    bv = kvq_bits_mix16(bv, in->ctx, q->n_sink);
    if (in->n_layers) { /* boundary layers at 16 bits */
        double L = (double)in->n_layers, nb = 2.0 * boundary_of(q, (int)in->n_layers);
        bk = ((L - nb) * bk + nb * 16.0) / L;
        bv = ((L - nb) * bv + nb * 16.0) / L;
    }
    out->k = bk;
    out->v = bv;
    return KVQ_OK;
}

static void describe_tq(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)has_artifact;
    o->num(o->ctx, "boundary_layers", q->x[0]);
    o->num(o->ctx, "norm_correction", preset_of(q) >= 0 && presets[preset_of(q)].nc);
}

const kvq_family kvq_family_turboquant = {
    .name = "turboquant",
    .syntax = "turboquant-{k8v4,4bit-nc,k3v4-nc,3bit-nc}[-b<N>]",
    .summary = "vLLM's TurboQuant presets: Hadamard rotation + Lloyd-Max keys with an fp16 norm (norm-corrected) or FP8 "
               "keys, uniform 3/4-bit values; N = 2 boundary layers each side uncompressed; post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_tq,
    .format = fmt_tq,
    .validate = validate_tq,
    .check_model = check_model_tq,
    .quantize = quantize_tq,
    .transform = transform_tq,
    .describe = describe_tq,
    .bits = bits_tq,
};
