/* fp.c — the unquantized baselines: fp32 (no transform at all) and fp16 (K/V
 * rounded to IEEE binary16, what an fp16 KV cache holds; kernels/quant/quant.h
 * kvq_quant_fp16: round to nearest even, saturating at ±65504). The first
 * n_sink tokens stay exact. Two families in one file because they share the
 * "key stage makes no difference" rule and the 32 / 16 bits accounting. */
#include <string.h>

#include "family.h"

static int parse_fp32(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    (void)q;
    return strcmp(b, "fp32") == 0;
}

static int parse_fp16(const char *b, const char *spec, kvq_scheme *q, kvq_err *err)
{
    (void)spec;
    (void)err;
    (void)q;
    return strcmp(b, "fp16") == 0;
}

static void fmt_fp32(const kvq_scheme *q, char *b, size_t n)
{
    (void)q;
    snprintf(b, n, "fp32");
}

static void fmt_fp16(const kvq_scheme *q, char *b, size_t n)
{
    (void)q;
    snprintf(b, n, "fp16");
}

static kvq_status bits_fp32(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)q;
    (void)in;
    (void)err;
    out->k = out->v = 32;
    return KVQ_OK;
}

static kvq_status bits_fp16(const kvq_scheme *q, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    (void)q;
    (void)in;
    (void)err;
    out->k = out->v = 16;
    return KVQ_OK;
}

static int code_bits_fp32(const kvq_scheme *q, char side)
{
    (void)q;
    (void)side;
    return 32;
}

static int code_bits_fp16(const kvq_scheme *q, char side)
{
    (void)q;
    (void)side;
    return 16;
}

static kvq_status quantize_fp32(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)d;
    (void)layer;
    (void)side;
    (void)hd;
    (void)err;
    if (out != in) memmove(out, in, T * kvd * sizeof(float));
    if (c) c->n_elems += T * kvd;
    return KVQ_OK;
}

/* sink tokens exact (counted as elements and sink), the rest rounded to half */
static kvq_status quantize_fp16(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t T,
                                size_t kvd, size_t hd, kvq_quant_counts *c, kvq_err *err)
{
    (void)layer;
    (void)side;
    (void)hd;
    (void)err;
    size_t ns = d->q.n_sink < T ? d->q.n_sink : T;
    if (out != in) memmove(out, in, ns * kvd * sizeof(float));
    kvq_quant_fp16(out + ns * kvd, in + ns * kvd, (T - ns) * kvd, c);
    if (c) {
        c->n_sink += ns * kvd;
        c->n_elems += ns * kvd;
    }
    return KVQ_OK;
}

const kvq_family kvq_family_fp32 = {
    .name = "fp32",
    .syntax = "fp32",
    .summary = "no quantization (the baseline; no hook at all)",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .stage_free = true,
    .identity = true,
    .parse = parse_fp32,
    .format = fmt_fp32,
    .quantize = quantize_fp32,
    .bits = bits_fp32,
    .code_bits = code_bits_fp32,
};

#ifdef KVQ_CUDA
extern const kvq_family_cuda kvq_fp16_cuda;
#endif

const kvq_family kvq_family_fp16 = {
    .name = "fp16",
    .syntax = "fp16",
    .summary = "K/V rounded to IEEE half (what an fp16 cache holds)",
    .default_stage = KVQ_KEYS_POST_ROPE,
    .stage_free = true,
    .parse = parse_fp16,
    .format = fmt_fp16,
    .quantize = quantize_fp16,
    .bits = bits_fp16,
    .code_bits = code_bits_fp16,
    .cuda = KVQ_FAMILY_CUDA(kvq_fp16_cuda),
};
