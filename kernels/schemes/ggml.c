/* ggml.c — llama.cpp's KV-cache block formats (-ctk / -ctv: q8_0, q4_0, q4_1,
 * q5_0, q5_1, iq4_nl; kernels/quant/quant_ggml.h): 32-value blocks along
 * head_dim with an fp16 scale (and min for the _1 formats), post-RoPE keys.
 * llama.cpp refuses a quantized KV cache whose head_dim is not a multiple of
 * the block: binding fails with KVQ_EUNSUPPORTED (kveval skips the scheme
 * with a message). The first n_sink tokens exact (llama.cpp has no sink; +sink
 * is kvq's modifier). Differences from llama.cpp: since 2025 llama.cpp also
 * rotates Q/K/V with a Hadamard transform when the cache is quantized; this
 * family quantizes without rotation (as llama.cpp did before). */
#include <string.h>

#include "family.h"
#include "quant_ggml.h"

static const struct {
    const char *name;
    kvq_ggml_type t;
    int code_bits;
} formats[] = {
    {"q8_0", KVQ_GGML_Q8_0, 8}, {"q4_0", KVQ_GGML_Q4_0, 4}, {"q4_1", KVQ_GGML_Q4_1, 4},
    {"q5_0", KVQ_GGML_Q5_0, 5}, {"q5_1", KVQ_GGML_Q5_1, 5}, {"iq4_nl", KVQ_GGML_IQ4_NL, 4},
};
#define N_FORMATS (sizeof formats / sizeof *formats)

static int parse_ggml(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    for (size_t i = 0; i < N_FORMATS; i++)
        if (!strcmp(b, formats[i].name)) {
            q->k_bits = q->v_bits = formats[i].code_bits;
            q->variant = (int)formats[i].t;
            return 1;
        }
    return 0;
}

static void fmt_ggml(const kvq_scheme *q, char *b, size_t n)
{
    const char *name = "?";
    for (size_t i = 0; i < N_FORMATS; i++)
        if ((int)formats[i].t == q->variant) name = formats[i].name;
    snprintf(b, n, "%s", name);
}

static kvq_status validate_ggml(const kvq_scheme *q, kvq_err *err)
{
    if (q->outlier_frac > 0 || q->group || q->residual)
        return kvq_fail(err, KVQ_EINVAL, "scheme: a llama.cpp block format has no outliers, groups or residual (found %g, %zu, %zu)",
                        q->outlier_frac, q->group, q->residual);
    if (kvq_ggml_kv_bits_per_element((kvq_ggml_type)q->variant) <= 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme: llama.cpp block format: unknown type %d", q->variant);
    return KVQ_OK;
}

static kvq_status check_model_ggml(const kvq_scheme *q, const char *spec, const kvq_hparams *hp, kvq_err *err)
{
    (void)q;
    if (hp->head_dim % KVQ_GGML_KV_BLOCK)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "scheme '%s': head_dim %d is not a multiple of the %d-value block; llama.cpp refuses a quantized "
                        "KV cache of such a model, so this scheme does not apply",
                        spec, hp->head_dim, KVQ_GGML_KV_BLOCK);
    return KVQ_OK;
}

/* 32-value blocks of one token's head; the first n_sink tokens exact */
static kvq_status quantize_ggml(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T, size_t kvd,
                                size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    size_t ns = d->q.n_sink < T ? d->q.n_sink : T;
    if (out != in) memmove(out, in, ns * kvd * sizeof(float));
    if (T > ns)
        KVQ_TRY(kvq_ggml_kv_roundtrip((kvq_ggml_type)d->q.variant, in + ns * kvd, out + ns * kvd, T - ns, kvd / hd, hd, err));
    if (c) {
        c->n_elems += T * kvd;
        c->n_sink += ns * kvd;
    }
    return KVQ_OK;
}

/* block bytes * 8 / 32 (fp16 scale, and min for _1 formats, per block); sink tokens at 16 */
static kvq_status bits_ggml(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)err;
    double dense = kvq_ggml_kv_bits_per_element((kvq_ggml_type)q->variant);
    out->k = out->v = kvq_bits_mix16(dense, in->ctx, q->n_sink);
    return KVQ_OK;
}

static void describe_ggml(const kvq_scheme *q, bool has_artifact, kvq_param_sink *o)
{
    (void)q;
    (void)has_artifact;
    o->num(o->ctx, "block_size", KVQ_GGML_KV_BLOCK);
}

const kvq_family kvq_family_ggml = {
    .name = "llama.cpp",
    .syntax = "q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl",
    .summary = "llama.cpp's KV block formats (-ctk/-ctv), 32-value blocks along head_dim, post-RoPE keys",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .parse = parse_ggml,
    .format = fmt_ggml,
    .validate = validate_ggml,
    .check_model = check_model_ggml,
    .quantize = quantize_ggml,
    .describe = describe_ggml,
    .bits = bits_ggml,
};
