/* scheme.c — scheme specs, artifact binding, transforms, bits; see scheme.h. */
#include "scheme.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "identity.h"
#include "quant_fp8.h"
#include "quant_ggml.h"
#include "progress.h"
#include "safetensors.h"

/* ---- small parsing helpers ------------------------------------------------ */

/* Read an unsigned decimal at *p (no sign); advances *p. false if no digit or
 * the value exceeds max. */
static bool scan_uint(const char **p, unsigned long max, unsigned long *out)
{
    const char *s = *p;
    if (!isdigit((unsigned char)*s)) return false;
    unsigned long v = 0;
    while (isdigit((unsigned char)*s)) {
        v = v * 10 + (unsigned long)(*s - '0');
        if (v > max) return false;
        s++;
    }
    *p = s;
    *out = v;
    return true;
}

/* "<f>%" with f a decimal in (0, 50): *frac = f / 100. */
static bool scan_percent(const char **p, double *frac)
{
    const char *s = *p, *pct = strchr(s, '%');
    if (!pct || pct == s || pct - s > 31) return false;
    char buf[32];
    memcpy(buf, s, (size_t)(pct - s));
    buf[pct - s] = 0;
    for (const char *c = buf; *c; c++)
        if (!isdigit((unsigned char)*c) && *c != '.') return false;
    double f;
    if (!kvq_parse_double(buf, &f) || !(f > 0 && f < 50)) return false;
    *frac = f / 100.0;
    *p = pct + 1;
    return true;
}

static bool starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

static int bad(kvq_scheme_spec *sp, kvq_err *err, const char *what)
{
    kvq_fail(err, KVQ_EINVAL, "scheme '%s': %s", sp->spec, what);
    return -1;
}

static void fmt_pct(char *buf, size_t n, double frac)
{
    if (frac > 0) snprintf(buf, n, "-%g%%", frac * 100.0);
    else buf[0] = 0;
}

/* ---- families: parse ----------------------------------------------------- */

static int parse_fp32(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    (void)err;
    if (strcmp(b, "fp32") != 0) return 0;
    sp->q.kind = KVQ_SCHEME_FP32;
    return 1;
}

static int parse_fp16(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    (void)err;
    if (strcmp(b, "fp16") != 0) return 0;
    sp->q.kind = KVQ_SCHEME_FP16;
    return 1;
}

/* "<prefix><b>" → bits; returns 0 if b does not start with prefix + digit. */
static int scan_bits(const char **p, const char *prefix, kvq_scheme_spec *sp, kvq_err *err, unsigned long *bits)
{
    if (!starts(*p, prefix) || !isdigit((unsigned char)(*p)[strlen(prefix)])) return 0;
    *p += strlen(prefix);
    if (!scan_uint(p, 1000, bits) || *bits < 1 || *bits > KVQ_QUANT_MAX_BITS)
        return bad(sp, err, "bits: expected 1..8");
    return 1;
}

static int parse_int(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    unsigned long bits, g = 0;
    const char *p = b;
    int r = scan_bits(&p, "int", sp, err, &bits);
    if (r <= 0) return r;
    if (starts(p, "-pc")) return 0; /* the int-pc family */
    if (starts(p, "-g")) {
        p += 2;
        if (!scan_uint(&p, 1u << 20, &g) || g == 0) return bad(sp, err, "group size after -g: expected an integer >= 1");
    }
    if (*p) return bad(sp, err, "expected int<b>[-g<G>] (e.g. int4, int4-g64)");
    sp->q.kind = KVQ_SCHEME_INT;
    sp->q.k_bits = sp->q.v_bits = (int)bits;
    sp->q.group = g;
    return 1;
}

static int parse_int_pc(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    unsigned long bits;
    const char *p = b;
    int r = scan_bits(&p, "int", sp, err, &bits);
    if (r <= 0) return r;
    if (!starts(p, "-pc")) return 0;
    p += 3;
    double f = 0;
    if (*p == '-') {
        p++;
        if (!scan_percent(&p, &f)) return bad(sp, err, "outlier fraction: expected -<f>% with 0 < f < 50 (e.g. int4-pc-1%)");
    }
    if (*p) return bad(sp, err, "expected int<b>-pc[-<f>%] (e.g. int4-pc, int3-pc-1%)");
    sp->q.kind = KVQ_SCHEME_INT_PC;
    sp->q.k_bits = sp->q.v_bits = (int)bits;
    sp->q.outlier_frac = f;
    sp->q.group = 0;
    return 1;
}

static int parse_kivi(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    unsigned long bits, g = 32, r = 128;
    const char *p = b;
    int rc = scan_bits(&p, "kivi", sp, err, &bits);
    if (rc <= 0) return rc;
    if (starts(p, "-g")) {
        p += 2;
        if (!scan_uint(&p, 1u << 20, &g) || g == 0) return bad(sp, err, "group size after -g: expected an integer >= 1");
    }
    if (starts(p, "-r")) {
        p += 2;
        if (!scan_uint(&p, 1u << 24, &r)) return bad(sp, err, "residual length after -r: expected an integer >= 0");
    }
    if (*p) return bad(sp, err, "expected kivi<b>[-g<G>][-r<R>] (e.g. kivi2, kivi2-g32-r128)");
    if (r % g) {
        kvq_fail(err, KVQ_EINVAL, "scheme '%s': residual length %lu must be a multiple of the group size %lu (KIVI flushes R/G key groups)",
                 sp->spec, r, g);
        return -1;
    }
    sp->q.kind = KVQ_SCHEME_KIVI;
    sp->q.k_bits = sp->q.v_bits = (int)bits;
    sp->q.group = g;
    sp->q.residual = r;
    return 1;
}

static int parse_nuq(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    unsigned long bits;
    const char *p = b;
    int r = scan_bits(&p, "nuq", sp, err, &bits);
    if (r <= 0) return r;
    double f = 0;
    if (*p == '-') {
        p++;
        if (!scan_percent(&p, &f)) return bad(sp, err, "outlier fraction: expected -<f>% with 0 < f < 50 (e.g. nuq3-1%)");
    }
    if (*p) return bad(sp, err, "expected nuq<b>[-<f>%] (e.g. nuq4, nuq3-1%)");
    sp->q.kind = KVQ_SCHEME_NUQ;
    sp->q.k_bits = sp->q.v_bits = (int)bits;
    sp->q.outlier_frac = f;
    return 1;
}

/* fp8, e5m2 (scale 1.0): variant = kvq_fp8_format */
static int parse_fp8(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    (void)err;
    if (strcmp(b, "fp8") && strcmp(b, "e5m2")) return 0;
    sp->q.kind = KVQ_SCHEME_FP8;
    sp->q.k_bits = sp->q.v_bits = 8;
    sp->variant = b[0] == 'e' ? KVQ_FP8_E5M2 : KVQ_FP8_E4M3FN;
    return 1;
}

/* {fp8,e5m2}-{tensor,head}[-p<P>]: variant = format + 2 * per_head */
static int parse_fp8_scaled(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    const char *p = b;
    int fmt;
    if (starts(p, "fp8-")) { fmt = KVQ_FP8_E4M3FN; p += 4; }
    else if (starts(p, "e5m2-")) { fmt = KVQ_FP8_E5M2; p += 5; }
    else return 0;
    int head;
    if (starts(p, "tensor")) { head = 0; p += 6; }
    else if (starts(p, "head")) { head = 1; p += 4; }
    else return bad(sp, err, "expected fp8, e5m2, {fp8,e5m2}-tensor[-p<P>] or {fp8,e5m2}-head[-p<P>]");
    double pct = 100;
    if (starts(p, "-p")) {
        p += 2;
        char buf[32];
        size_t n = strlen(p);
        if (n == 0 || n >= sizeof buf || strspn(p, "0123456789.") != n) return bad(sp, err, "percentile after -p: expected a number in (0, 100] (e.g. fp8-tensor-p99.9)");
        memcpy(buf, p, n + 1);
        if (!kvq_parse_double(buf, &pct) || !(pct > 0 && pct <= 100))
            return bad(sp, err, "percentile after -p: expected a number in (0, 100] (e.g. fp8-tensor-p99.9)");
        p += n;
    }
    if (*p) return bad(sp, err, "expected {fp8,e5m2}-{tensor,head}[-p<P>] (e.g. fp8-tensor, fp8-head-p99.9)");
    sp->q.kind = KVQ_SCHEME_FP8;
    sp->q.k_bits = sp->q.v_bits = 8;
    sp->variant = fmt + 2 * head;
    sp->percentile = pct;
    return 1;
}

static const struct {
    const char *name;
    kvq_ggml_type t;
    int code_bits;
} ggml_formats[] = {
    {"q8_0", KVQ_GGML_Q8_0, 8}, {"q4_0", KVQ_GGML_Q4_0, 4}, {"q4_1", KVQ_GGML_Q4_1, 4},
    {"q5_0", KVQ_GGML_Q5_0, 5}, {"q5_1", KVQ_GGML_Q5_1, 5}, {"iq4_nl", KVQ_GGML_IQ4_NL, 4},
};
#define N_GGML (sizeof ggml_formats / sizeof *ggml_formats)

static int parse_ggml(const char *b, kvq_scheme_spec *sp, kvq_err *err)
{
    (void)err;
    for (size_t i = 0; i < N_GGML; i++)
        if (!strcmp(b, ggml_formats[i].name)) {
            sp->q.kind = KVQ_SCHEME_GGML;
            sp->q.k_bits = sp->q.v_bits = ggml_formats[i].code_bits;
            sp->variant = (int)ggml_formats[i].t;
            return 1;
        }
    return 0;
}

static const char *ggml_name(int variant)
{
    for (size_t i = 0; i < N_GGML; i++)
        if ((int)ggml_formats[i].t == variant) return ggml_formats[i].name;
    return "?";
}

/* ---- families: artifact needs ---------------------------------------------- */

static bool same_frac(double a, double b) { return fabs(a - b) <= 1e-9; }

static bool stage_ok(const kvq_scheme_spec *sp, const kvq_artifact_params *p)
{
    return !sp->stage_set || p->post_rope == (sp->key_stage == KVQ_KEYS_POST_ROPE);
}

static bool match_nuq(const kvq_scheme_spec *sp, const kvq_artifact_params *p)
{
    return p->method == KVQ_METHOD_NUQ && p->k_bits == sp->q.k_bits && p->v_bits == sp->q.v_bits &&
           same_frac(p->outlier_frac, sp->q.outlier_frac) && stage_ok(sp, p);
}

static bool match_int_pc(const kvq_scheme_spec *sp, const kvq_artifact_params *p)
{
    return (p->method == KVQ_METHOD_INT_PC || p->method == KVQ_METHOD_NUQ) &&
           same_frac(p->outlier_frac, sp->q.outlier_frac) && stage_ok(sp, p);
}

static bool match_fp8(const kvq_scheme_spec *sp, const kvq_artifact_params *p)
{
    return p->method == KVQ_METHOD_FP8 && p->fp8_e5m2 == ((sp->variant & 1) == KVQ_FP8_E5M2) &&
           p->per_head == (sp->variant >= 2) && fabs(p->fp8_percentile - sp->percentile) <= 1e-9 && stage_ok(sp, p);
}

static void need_fp8(const kvq_scheme_spec *sp, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method fp8 with %s %s scales (%s)%s",
             (sp->variant & 1) == KVQ_FP8_E5M2 ? "E5M2" : "E4M3FN", sp->variant >= 2 ? "per-KV-head" : "per-tensor",
             sp->percentile < 100 ? "percentile" : "absmax, percentile 100",
             sp->stage_set ? (sp->key_stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
    if (sp->percentile < 100) {
        size_t l = strlen(buf);
        if (l < n) snprintf(buf + l, n - l, " %g", sp->percentile);
    }
}

static void need_nuq(const kvq_scheme_spec *sp, char *buf, size_t n)
{
    snprintf(buf, n, "a kvcalib artifact of method nuq with %d bits and %g%% outliers%s", sp->q.k_bits,
             sp->q.outlier_frac * 100, sp->stage_set ? (sp->key_stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
}

static void need_int_pc(const kvq_scheme_spec *sp, char *buf, size_t n)
{
    snprintf(buf, n, "per-channel key thresholds: a kvcalib artifact of method int-pc or nuq fitted with %g%% outliers%s",
             sp->q.outlier_frac * 100,
             sp->stage_set ? (sp->key_stage == KVQ_KEYS_POST_ROPE ? ", post-RoPE keys" : ", pre-RoPE keys") : "");
}

/* ---- families: checks and names --------------------------------------------- */

static kvq_status check_int(const kvq_eval_scheme *s, const kvq_hparams *hp, kvq_err *err)
{
    size_t kvd = (size_t)kvq_kv_dim(hp);
    if (s->s.q.group && kvd % s->s.q.group)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': group size %zu does not divide the model's kv_dim %zu",
                        s->s.spec, s->s.q.group, kvd);
    return KVQ_OK;
}

static kvq_status check_kivi(const kvq_eval_scheme *s, const kvq_hparams *hp, kvq_err *err)
{
    if ((size_t)hp->head_dim % s->s.q.group)
        return kvq_fail(err, KVQ_EINVAL,
                        "scheme '%s': KIVI group size %zu must divide head_dim %d (value groups never cross heads)",
                        s->s.spec, s->s.q.group, hp->head_dim);
    return KVQ_OK;
}

static kvq_status check_ggml(const kvq_eval_scheme *s, const kvq_hparams *hp, kvq_err *err)
{
    if (hp->head_dim % KVQ_GGML_KV_BLOCK)
        return kvq_fail(err, KVQ_EUNSUPPORTED,
                        "scheme '%s': head_dim %d is not a multiple of the %d-value block; llama.cpp refuses a quantized "
                        "KV cache of such a model, so this scheme does not apply",
                        s->s.spec, hp->head_dim, KVQ_GGML_KV_BLOCK);
    return KVQ_OK;
}

static void fmt_fp8(const kvq_scheme_spec *sp, char *b, size_t n)
{
    snprintf(b, n, "%s", (sp->variant & 1) == KVQ_FP8_E5M2 ? "e5m2" : "fp8");
}
static void fmt_fp8_scaled(const kvq_scheme_spec *sp, char *b, size_t n)
{
    char pct[40] = "";
    if (sp->percentile < 100) snprintf(pct, sizeof pct, "-p%g", sp->percentile);
    snprintf(b, n, "%s-%s%s", (sp->variant & 1) == KVQ_FP8_E5M2 ? "e5m2" : "fp8", sp->variant >= 2 ? "head" : "tensor", pct);
}
static void fmt_ggml(const kvq_scheme_spec *sp, char *b, size_t n) { snprintf(b, n, "%s", ggml_name(sp->variant)); }

static void fmt_fp32(const kvq_scheme_spec *sp, char *b, size_t n) { (void)sp; snprintf(b, n, "fp32"); }
static void fmt_fp16(const kvq_scheme_spec *sp, char *b, size_t n) { (void)sp; snprintf(b, n, "fp16"); }
static void fmt_int(const kvq_scheme_spec *sp, char *b, size_t n)
{
    if (sp->q.group) snprintf(b, n, "int%d-g%zu", sp->q.k_bits, sp->q.group);
    else snprintf(b, n, "int%d", sp->q.k_bits);
}
static void fmt_int_pc(const kvq_scheme_spec *sp, char *b, size_t n)
{
    char pct[32];
    fmt_pct(pct, sizeof pct, sp->q.outlier_frac);
    snprintf(b, n, "int%d-pc%s", sp->q.k_bits, pct);
}
static void fmt_kivi(const kvq_scheme_spec *sp, char *b, size_t n)
{
    snprintf(b, n, "kivi%d-g%zu-r%zu", sp->q.k_bits, sp->q.group, sp->q.residual);
}
static void fmt_nuq(const kvq_scheme_spec *sp, char *b, size_t n)
{
    char pct[32];
    fmt_pct(pct, sizeof pct, sp->q.outlier_frac);
    snprintf(b, n, "nuq%d%s", sp->q.k_bits, pct);
}

/* ---- families: transforms ------------------------------------------------------
 * The built-in families have no apply function: their transform is
 * kvq_kv_desc_transform on the descriptor built at bind (kernels/schemes/kv_desc.h). */

/* fp8: per token, offline scales (1.0, or the artifact's per layer); the
 * first n_sink tokens exact. */
static kvq_status apply_fp8(kvq_scheme_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                            kvq_err *err)
{
    (void)alt;
    const kvq_eval_scheme *s = run->s;
    size_t H = (size_t)c->n_kv_heads, D = (size_t)c->head_dim, kvd = H * D, T = (size_t)c->T;
    size_t ns = s->s.q.n_sink < T ? s->s.q.n_sink : T;
    kvq_fp8_format f = (kvq_fp8_format)(s->s.variant & 1);
    const float one = 1.0f, *ks = &one, *vs = &one;
    size_t nk = 1, nv = 1;
    if (s->art) {
        ks = s->art->k[c->layer].fp8_scale;
        nk = s->art->k[c->layer].n_fp8_scales;
        vs = s->art->v[c->layer].fp8_scale;
        nv = s->art->v[c->layer].n_fp8_scales;
    }
    if (T > ns) {
        KVQ_TRY(kvq_fp8_kv_roundtrip(f, k + ns * kvd, k + ns * kvd, T - ns, H, D, ks, nk, err));
        KVQ_TRY(kvq_fp8_kv_roundtrip(f, v + ns * kvd, v + ns * kvd, T - ns, H, D, vs, nv, err));
    }
    run->k_counts.n_elems += T * kvd;
    run->v_counts.n_elems += T * kvd;
    run->k_counts.n_sink += ns * kvd;
    run->v_counts.n_sink += ns * kvd;
    return KVQ_OK;
}

/* llama.cpp block formats: 32-value blocks of one token's head; first n_sink tokens exact. */
static kvq_status apply_ggml(kvq_scheme_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                             kvq_err *err)
{
    (void)alt;
    size_t H = (size_t)c->n_kv_heads, D = (size_t)c->head_dim, kvd = H * D, T = (size_t)c->T;
    size_t ns = run->s->s.q.n_sink < T ? run->s->s.q.n_sink : T;
    kvq_ggml_type t = (kvq_ggml_type)run->s->s.variant;
    if (T > ns) {
        KVQ_TRY(kvq_ggml_kv_roundtrip(t, k + ns * kvd, k + ns * kvd, T - ns, H, D, err));
        KVQ_TRY(kvq_ggml_kv_roundtrip(t, v + ns * kvd, v + ns * kvd, T - ns, H, D, err));
    }
    run->k_counts.n_elems += T * kvd;
    run->v_counts.n_elems += T * kvd;
    run->k_counts.n_sink += ns * kvd;
    run->v_counts.n_sink += ns * kvd;
    return KVQ_OK;
}


static kvq_status bits_builtin(const kvq_eval_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err)
{
    return kvq_scheme_bits(&s->s.q, ctx, kv_dim, out, err);
}

static double mix_sink(double dense, size_t ctx, size_t ns)
{
    if (ns > ctx) ns = ctx;
    return ((double)(ctx - ns) * dense + (double)ns * 16.0) / (double)ctx;
}

/* fp8: 8-bit codes + float32 scales per layer (1 or n_kv_heads each for K and V; scale 1.0 is
 * still one stored float) amortised over the ctx-token cache (kvq_fp8_bits_per_element). */
static kvq_status bits_fp8(const kvq_eval_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err)
{
    if (ctx == 0 || kv_dim == 0 || s->head_dim == 0 || kv_dim % s->head_dim)
        return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx %zu, kv_dim %zu, head_dim %zu", ctx, kv_dim, s->head_dim);
    size_t H = kv_dim / s->head_dim, n_sc = s->s.variant >= 2 ? H : 1;
    double dense = kvq_fp8_bits_per_element(n_sc, ctx, H, s->head_dim);
    out->k = out->v = mix_sink(dense, ctx, s->s.q.n_sink);
    out->mean = out->k;
    return KVQ_OK;
}

/* llama.cpp blocks: block bytes * 8 / 32 (fp16 scale, and min for _1 formats, per block). */
static kvq_status bits_ggml(const kvq_eval_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err)
{
    if (ctx == 0 || kv_dim == 0) return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx and kv_dim must be > 0");
    double dense = kvq_ggml_kv_bits_per_element((kvq_ggml_type)s->s.variant);
    out->k = out->v = mix_sink(dense, ctx, s->s.q.n_sink);
    out->mean = out->k;
    return KVQ_OK;
}

static int code_bits_builtin(const kvq_eval_scheme *s, char kv)
{
    switch (s->s.q.kind) {
    case KVQ_SCHEME_FP32: return 32;
    case KVQ_SCHEME_FP16: return 16;
    default: return kv == 'k' ? s->s.q.k_bits : s->s.q.v_bits;
    }
}

/* ---- the registry ---------------------------------------------------------------- */

static const kvq_scheme_family families[] = {
    {"fp32", "fp32", parse_fp32, KVQ_KEYS_POST_ROPE, NULL, NULL, NULL, fmt_fp32, NULL, bits_builtin, code_bits_builtin,
     false},
    {"fp16", "fp16", parse_fp16, KVQ_KEYS_POST_ROPE, NULL, NULL, NULL, fmt_fp16, NULL, bits_builtin, code_bits_builtin,
     true},
    {"int", "int<b>[-g<G>]", parse_int, KVQ_KEYS_POST_ROPE, NULL, NULL, check_int, fmt_int, NULL, bits_builtin,
     code_bits_builtin, true},
    {"int-pc", "int<b>-pc[-<f>%]", parse_int_pc, KVQ_KEYS_PRE_ROPE, match_int_pc, need_int_pc, NULL, fmt_int_pc, NULL,
     bits_builtin, code_bits_builtin, true},
    {"kivi", "kivi<b>[-g<G>][-r<R>]", parse_kivi, KVQ_KEYS_POST_ROPE, NULL, NULL, check_kivi, fmt_kivi, NULL,
     bits_builtin, code_bits_builtin, true},
    {"nuq", "nuq<b>[-<f>%]", parse_nuq, KVQ_KEYS_PRE_ROPE, match_nuq, need_nuq, NULL, fmt_nuq, NULL, bits_builtin,
     code_bits_builtin, true},
    {"fp8", "fp8, e5m2", parse_fp8, KVQ_KEYS_POST_ROPE, NULL, NULL, NULL, fmt_fp8, apply_fp8, bits_fp8, code_bits_builtin,
     false},
    {"fp8-scaled", "{fp8,e5m2}-{tensor,head}[-p<P>]", parse_fp8_scaled, KVQ_KEYS_POST_ROPE, match_fp8, need_fp8, NULL,
     fmt_fp8_scaled, apply_fp8, bits_fp8, code_bits_builtin, false},
    {"llama.cpp", "q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl", parse_ggml, KVQ_KEYS_POST_ROPE, NULL, NULL, check_ggml, fmt_ggml,
     apply_ggml, bits_ggml, code_bits_builtin, false},
};
#define N_FAMILIES (sizeof families / sizeof *families)

const kvq_scheme_family *kvq_scheme_families(size_t *n)
{
    *n = N_FAMILIES;
    return families;
}

const char *kvq_scheme_syntax(void)
{
    return "fp32, fp16, int<b>[-g<G>], int<b>-pc[-<f>%], kivi<b>[-g<G>][-r<R>] (default G=32, R=128), nuq<b>[-<f>%], "
           "fp8, e5m2, {fp8,e5m2}-{tensor,head}[-p<P>], q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; "
           "b = 1..8; modifiers +sink<N>, +pre-rope, +post-rope, +intactkv, +artifact<N> "
           "(e.g. int4, kivi2-g32-r128, nuq3-1%+sink1)";
}

/* ---- parse ------------------------------------------------------------------------- */

kvq_status kvq_scheme_parse(const char *spec, kvq_scheme_spec *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    out->artifact_index = 0;
    if (!spec || !*spec) return kvq_fail(err, KVQ_EINVAL, "scheme: empty spec; expected one of %s", kvq_scheme_syntax());
    if (strlen(spec) >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%.40s...': longer than %d characters", spec, KVQ_SPEC_MAX - 1);
    snprintf(out->spec, sizeof out->spec, "%s", spec);
    char buf[KVQ_SPEC_MAX];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL, *base = strtok_r(buf, "+", &save);
    if (!base || spec[0] == '+')
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': missing base name; expected one of %s", spec, kvq_scheme_syntax());
    int found = 0;
    for (size_t i = 0; i < N_FAMILIES && !found; i++) {
        int r = families[i].parse(base, out, err);
        if (r < 0) return KVQ_EINVAL;
        if (r > 0) {
            out->fam = &families[i];
            found = 1;
        }
    }
    if (!found)
        return kvq_fail(err, KVQ_EINVAL, "unknown scheme '%s' (base '%s'); valid: %s", spec, base, kvq_scheme_syntax());
    out->key_stage = out->fam->default_stage;
    for (char *m = strtok_r(NULL, "+", &save); m; m = strtok_r(NULL, "+", &save)) {
        const char *p = m;
        unsigned long n;
        if (starts(m, "sink")) {
            p += 4;
            if (!scan_uint(&p, 1u << 24, &n) || *p)
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': modifier '+%s': expected +sink<N> with N >= 0", spec, m);
            if (out->sink_set) /* (the last one silently won) */
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +sink given twice (+sink%zu, then +%s)", spec, out->q.n_sink, m);
            out->q.n_sink = n;
            out->sink_set = true;
        } else if (!strcmp(m, "pre-rope") || !strcmp(m, "post-rope")) {
            if (out->stage_set)
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': the key stage given twice (+%s after +%s)", spec, m,
                                out->key_stage == KVQ_KEYS_PRE_ROPE ? "pre-rope" : "post-rope");
            out->key_stage = m[1] == 'r' ? KVQ_KEYS_PRE_ROPE : KVQ_KEYS_POST_ROPE;
            out->stage_set = true;
        } else if (!strcmp(m, "intactkv")) {
            if (out->intactkv) return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +intactkv given twice", spec);
            out->intactkv = true;
        } else if (starts(m, "artifact")) {
            p += 8;
            if (!scan_uint(&p, 4096, &n) || *p || n == 0)
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': modifier '+%s': expected +artifact<N> with N >= 1 (the N-th --artifact)",
                                spec, m);
            if (out->artifact_index) return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +artifact given twice", spec);
            out->artifact_index = (int)n;
        } else {
            return kvq_fail(err, KVQ_EINVAL,
                            "scheme '%s': unknown modifier '+%s'; valid: +sink<N>, +pre-rope, +post-rope, +intactkv, +artifact<N>",
                            spec, m);
        }
    }
    if (spec[strlen(spec) - 1] == '+' || strstr(spec, "++"))
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': empty modifier", spec);
    if ((out->q.kind == KVQ_SCHEME_FP32 || out->q.kind == KVQ_SCHEME_FP16) && out->stage_set)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +pre-rope/+post-rope: %s does not depend on the key stage", spec,
                        out->fam->name);
    if (out->q.kind == KVQ_SCHEME_FP32 && out->sink_set)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +sink: fp32 keeps every token exact already", spec);
    return kvq_scheme_validate(&out->q, err) ? kvq_err_prefix(err, "scheme '%s'", spec) : KVQ_OK;
}

/* ---- artifact set ------------------------------------------------------------------- */

static kvq_status read_prefix(const char *path, const kvq_model *m, kvq_eval_prefix *px, kvq_err *err)
{
    memset(px, 0, sizeof *px);
    kvq_safetensors st;
    KVQ_TRY(kvq_safetensors_open(path, &st, err));
    kvq_status s = KVQ_OK;
    const kvq_st_tensor *ids = kvq_safetensors_find(&st, "intactkv.token_ids");
    if (!ids) goto done;
    size_t kvd = (size_t)kvq_kv_dim(&m->hp), L = (size_t)m->hp.n_layers;
    if (ids->dtype != KVQ_ST_I32 || ids->n_dims != 1 || ids->shape[0] < 1 || ids->shape[0] > 65536) {
        s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor intactkv.token_ids: expected I32 [P] with 1 <= P <= 65536, found %s with %u dims",
                     path, kvq_st_dtype_name(ids->dtype), ids->n_dims);
        goto done;
    }
    size_t P = (size_t)ids->shape[0];
    px->token_ids = malloc(P * sizeof *px->token_ids);
    px->k = malloc(L * P * kvd * sizeof(float));
    px->v = malloc(L * P * kvd * sizeof(float));
    if (!px->token_ids || !px->k || !px->v) {
        s = kvq_fail(err, KVQ_ENOMEM, "%s: cannot allocate the IntactKV prefix (%zu entries)", path, P);
        goto done;
    }
    memcpy(px->token_ids, ids->data, P * sizeof(int32_t));
    for (size_t i = 0; i < P; i++)
        if (px->token_ids[i] < 0 || px->token_ids[i] >= m->hp.vocab_size) {
            s = kvq_fail(err, KVQ_EFORMAT, "%s: intactkv.token_ids[%zu] = %d outside the model's vocabulary [0, %d)", path, i,
                         px->token_ids[i], m->hp.vocab_size);
            goto done;
        }
    for (size_t l = 0; l < L && s == KVQ_OK; l++)
        for (int w = 0; w < 2 && s == KVQ_OK; w++) {
            char name[64];
            snprintf(name, sizeof name, "layers.%zu.intactkv.%c", l, w ? 'v' : 'k');
            const kvq_st_tensor *t = kvq_safetensors_find(&st, name);
            if (!t || t->n_dims != 2 || t->shape[0] != P || t->shape[1] != kvd) {
                s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor %s: expected [%zu, %zu] (P, kv_dim), found %s", path, name, P, kvd,
                             t ? "another shape" : "none");
                break;
            }
            float *dst = (w ? px->v : px->k) + l * P * kvd;
            s = kvq_safetensors_read_f32(&st, t, dst, P * kvd, err);
            for (size_t i = 0; s == KVQ_OK && i < P * kvd; i++)
                if (!isfinite(dst[i])) s = kvq_fail(err, KVQ_EFORMAT, "%s: tensor %s[%zu]: not finite", path, name, i);
        }
    if (s == KVQ_OK) px->P = (int)P;
done:
    kvq_safetensors_close(&st);
    if (s) {
        free(px->token_ids);
        free(px->k);
        free(px->v);
        memset(px, 0, sizeof *px);
    }
    return s;
}

/* Descriptor views of an artifact's per-layer tables (kv_desc.h). */
static kvq_status layer_tables(const kvq_artifact *a, kvq_kv_layer_tables **out, kvq_err *err)
{
    size_t L = a->p.n_layers;
    kvq_kv_layer_tables *t = calloc(L ? L : 1, sizeof *t);
    if (!t) return kvq_fail(err, KVQ_ENOMEM, "cannot allocate table views for %zu layers", L);
    for (size_t l = 0; l < L; l++) {
        if (a->k) {
            const kvq_kv_table *kt = &a->k[l];
            t[l].k_lower = kt->channel_lower;
            t[l].k_upper = kt->channel_upper;
            if (kt->levels)
                t[l].k_lut = (kvq_nuq_lut){.bits = kt->bits, .n_tables = kt->n_tables, .head_dim = a->p.head_dim, .levels = kt->levels};
        }
        if (a->v && a->v[l].levels)
            t[l].v_lut = (kvq_nuq_lut){.bits = a->v[l].bits, .n_tables = a->v[l].n_tables, .head_dim = a->p.head_dim,
                                       .levels = a->v[l].levels};
    }
    *out = t;
    return KVQ_OK;
}

void kvq_artifact_set_free(kvq_artifact_set *set)
{
    for (size_t i = 0; i < set->n; i++) {
        if (set->a) kvq_artifact_free(&set->a[i]);
        if (set->prefix) {
            free(set->prefix[i].token_ids);
            free(set->prefix[i].k);
            free(set->prefix[i].v);
        }
    }
    for (size_t i = 0; set->tables && i < set->n; i++) free(set->tables[i]);
    free(set->tables);
    free(set->a);
    free(set->prefix);
    free(set->path);
    memset(set, 0, sizeof *set);
}

kvq_status kvq_artifact_set_load(kvq_artifact_set *set, const char *const *paths, size_t n, const kvq_model *m,
                                 const char *model_fingerprint, bool allow_mismatch, FILE *warn, kvq_err *err)
{
    memset(set, 0, sizeof *set);
    if (n == 0) return KVQ_OK;
    set->a = calloc(n, sizeof *set->a);
    set->prefix = calloc(n, sizeof *set->prefix);
    set->path = calloc(n, sizeof *set->path);
    set->tables = calloc(n, sizeof *set->tables);
    if (!set->a || !set->prefix || !set->path || !set->tables) {
        kvq_artifact_set_free(set);
        return kvq_fail(err, KVQ_ENOMEM, "artifacts: out of memory");
    }
    kvq_status s = KVQ_OK;
    for (size_t i = 0; i < n && s == KVQ_OK; i++) {
        snprintf(set->path[i], sizeof set->path[i], "%s", paths[i]);
        s = kvq_artifact_read(paths[i], &set->a[i], err);
        if (s) {
            kvq_err_prefix(err, "--artifact %s", paths[i]);
            break;
        }
        set->n = i + 1;
        const kvq_artifact_params *p = &set->a[i].p;
        char rope[512] = "";
        kvq_identity_rope_desc_hp(&m->hp, rope, sizeof rope, NULL);
        s = kvq_artifact_check_model_rope(p, model_fingerprint, rope[0] ? rope : NULL, allow_mismatch, warn, err);
        if (s) {
            kvq_err_prefix(err, "--artifact %s: calibrated for another model", paths[i]);
            break;
        }
        if (p->n_layers != (size_t)m->hp.n_layers || p->n_kv_heads != (size_t)m->hp.n_kv_heads ||
            p->head_dim != (size_t)m->hp.head_dim) {
            s = kvq_fail(err, KVQ_EMISMATCH,
                         "--artifact %s: shape %zu layers x %zu KV heads x head_dim %zu, model has %d x %d x %d", paths[i],
                         p->n_layers, p->n_kv_heads, p->head_dim, m->hp.n_layers, m->hp.n_kv_heads, m->hp.head_dim);
            break;
        }
        s = read_prefix(paths[i], m, &set->prefix[i], err);
        if (s) {
            kvq_err_prefix(err, "--artifact %s", paths[i]);
            break;
        }
        s = layer_tables(&set->a[i], &set->tables[i], err);
        if (s) kvq_err_prefix(err, "--artifact %s", paths[i]);
    }
    if (s) kvq_artifact_set_free(set);
    return s;
}

/* ---- binding ----------------------------------------------------------------------- */

static void append(char *buf, size_t n, const char *str, long num)
{
    size_t l = strlen(buf);
    if (l >= n) return;
    if (num >= 0) snprintf(buf + l, n - l, "%s%ld", str, num);
    else snprintf(buf + l, n - l, "%s", str);
}

kvq_status kvq_eval_scheme_bind(const kvq_scheme_spec *spec, const kvq_artifact_set *set, const kvq_hparams *hp,
                                kvq_eval_scheme *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    out->s = *spec;
    out->art_index = out->prefix_index = -1;
    out->head_dim = (size_t)hp->head_dim;
    const kvq_scheme_family *f = spec->fam;
    size_t n_art = set ? set->n : 0;
    int want = spec->artifact_index - 1; /* -1 = auto */
    if (want >= (int)n_art)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +artifact%d: only %zu --artifact file(s) given", spec->spec,
                        spec->artifact_index, n_art);
    if (f->match) {
        char need[256];
        f->describe_need(spec, need, sizeof need);
        if (n_art == 0)
            return kvq_fail(err, KVQ_EINVAL, "scheme '%s' needs %s; none given (--artifact FILE, written by kvcalib)",
                            spec->spec, need);
        int pick = -1;
        if (want >= 0) {
            if (!f->match(spec, &set->a[want].p))
                return kvq_fail(err, KVQ_EMISMATCH, "scheme '%s' needs %s; --artifact %s is method %s, %d/%d bits, %g%% outliers, %s keys",
                                spec->spec, need, set->path[want], kvq_method_name(set->a[want].p.method), set->a[want].p.k_bits,
                                set->a[want].p.v_bits, set->a[want].p.outlier_frac * 100,
                                set->a[want].p.post_rope ? "post-RoPE" : "pre-RoPE");
            pick = want;
        } else {
            /* first match; with +intactkv prefer a matching artifact that holds a prefix */
            for (size_t i = 0; i < n_art && pick < 0; i++)
                if (f->match(spec, &set->a[i].p) && (!spec->intactkv || set->prefix[i].P > 0)) pick = (int)i;
            for (size_t i = 0; i < n_art && pick < 0; i++)
                if (f->match(spec, &set->a[i].p)) pick = (int)i;
        }
        if (pick < 0) {
            char seen[512] = "";
            for (size_t i = 0; i < n_art; i++) {
                const kvq_artifact_params *p = &set->a[i].p;
                size_t l = strlen(seen);
                if (l < sizeof seen)
                    snprintf(seen + l, sizeof seen - l, "%s%s (%s, %d/%d bits, %g%% outliers, %s)", i ? "; " : "", set->path[i],
                             kvq_method_name(p->method), p->k_bits, p->v_bits, p->outlier_frac * 100,
                             p->post_rope ? "post-RoPE" : "pre-RoPE");
            }
            return kvq_fail(err, KVQ_EINVAL, "scheme '%s' needs %s; none of the %zu given matches: %s", spec->spec, need,
                            n_art, seen);
        }
        out->art = &set->a[pick];
        out->art_index = pick;
        out->art_path = set->path[pick];
        if (!spec->stage_set) out->s.key_stage = out->art->p.post_rope ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE;
        if (!spec->sink_set) out->s.q.n_sink = out->art->p.n_sink;
        /* int-pc: the values' per-token group size is the artifact's (kvcalib --group; kvstat and the
         * bits accounting used it, the quantizer here did not); a nuq artifact lending its key
         * thresholds has none */
        if (spec->q.kind == KVQ_SCHEME_INT_PC) out->s.q.group = out->art->p.method == KVQ_METHOD_INT_PC ? out->art->p.group_size : 0;
        /* tables present for this use */
        for (size_t l = 0; l < out->art->p.n_layers; l++) {
            const kvq_kv_table *kt = out->art->k ? &out->art->k[l] : NULL;
            if (spec->q.kind == KVQ_SCHEME_FP8) {
                size_t want = spec->variant >= 2 ? (size_t)hp->n_kv_heads : 1;
                const kvq_kv_table *vt = out->art->v ? &out->art->v[l] : NULL;
                if (!kt || !vt || !kt->fp8_scale || !vt->fp8_scale || kt->n_fp8_scales != want || vt->n_fp8_scales != want)
                    return kvq_fail(err, KVQ_EFORMAT, "scheme '%s': --artifact %s: layer %zu lacks %zu fp8 scale(s) for K and V",
                                    spec->spec, out->art_path, l, want);
                continue;
            }
            if (!kt || !kt->channel_lower || !kt->channel_upper ||
                (spec->q.kind == KVQ_SCHEME_NUQ && (!kt->levels || !out->art->v || !out->art->v[l].levels)))
                return kvq_fail(err, KVQ_EFORMAT, "scheme '%s': --artifact %s: layer %zu lacks the tables the scheme needs",
                                spec->spec, out->art_path, l);
        }
    } else if (want >= 0 && !spec->intactkv) {
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +artifact%d: %s reads no artifact tables (only +intactkv would use it)",
                        spec->spec, spec->artifact_index, f->name);
    }
    if (spec->intactkv) {
        int pick = -1;
        if (want >= 0) pick = want;
        else if (out->art_index >= 0 && set->prefix[out->art_index].P > 0) pick = out->art_index;
        else
            for (size_t i = 0; i < n_art && pick < 0; i++)
                if (set->prefix[i].P > 0) pick = (int)i;
        if (pick < 0 || set->prefix[pick].P == 0)
            return kvq_fail(err, KVQ_EINVAL,
                            "scheme '%s': +intactkv needs an artifact holding an IntactKV prefix (tensors intactkv.token_ids, "
                            "layers.<i>.intactkv.k/v; kvcalib intactkv, issue 9); %s",
                            spec->spec, pick >= 0 ? "the selected --artifact has none" : n_art ? "no --artifact has one" : "no --artifact given");
        out->prefix = &set->prefix[pick];
        out->prefix_index = pick;
    }
    if (f->check) KVQ_TRY(f->check(out, hp, err));
    if (f->native) {
        out->desc = (kvq_kv_desc){.q = out->s.q, .key_stage = out->s.key_stage};
        if (out->art) {
            out->desc.layers = set->tables[out->art_index];
            out->desc.n_layers = (int)out->art->p.n_layers;
        }
        if (kvq_kv_desc_validate(&out->desc, hp, err))
            return kvq_err_prefix(err, "scheme '%s'%s%s", spec->spec, out->art ? ": --artifact " : "",
                                  out->art ? out->art_path : "");
    }
    /* canonical name */
    f->format(&out->s, out->name, sizeof out->name);
    if (out->s.q.n_sink) append(out->name, sizeof out->name, "+sink", (long)out->s.q.n_sink);
    if (out->s.q.kind != KVQ_SCHEME_FP32 && out->s.q.kind != KVQ_SCHEME_FP16 && out->s.key_stage != f->default_stage)
        append(out->name, sizeof out->name, out->s.key_stage == KVQ_KEYS_PRE_ROPE ? "+pre-rope" : "+post-rope", -1);
    if (spec->intactkv) append(out->name, sizeof out->name, "+intactkv", -1);
    if (spec->artifact_index) append(out->name, sizeof out->name, "+artifact", spec->artifact_index);
    return KVQ_OK;
}

kvq_status kvq_eval_scheme_make(const char *spec, const kvq_artifact_set *set, const kvq_hparams *hp,
                                kvq_eval_scheme *out, kvq_err *err)
{
    kvq_scheme_spec sp;
    KVQ_TRY(kvq_scheme_parse(spec, &sp, err));
    return kvq_eval_scheme_bind(&sp, set, hp, out, err);
}

static bool uses_desc(const kvq_eval_scheme *s) { return !s->s.fam->apply && s->s.fam->native; }

bool kvq_eval_scheme_is_identity(const kvq_eval_scheme *s)
{
    return !s->s.fam->apply && !s->s.fam->native && !s->prefix;
}

const kvq_kv_desc *kvq_eval_scheme_kv_desc(const kvq_eval_scheme *s)
{
    return uses_desc(s) && !kvq_kv_desc_is_identity(&s->desc) ? &s->desc : NULL;
}

int kvq_eval_scheme_code_bits(const kvq_eval_scheme *s, char kv)
{
    return s->s.fam->code_bits(s, kv);
}

kvq_status kvq_eval_scheme_bits(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, kvq_bits *out,
                                kvq_err *err)
{
    KVQ_TRY(s->s.fam->bits(s, ctx, (size_t)kvq_kv_dim(hp), out, err));
    if (s->prefix && s->prefix->P > 0) {
        double P = s->prefix->P, full = s->s.q.kind == KVQ_SCHEME_FP32 ? 32.0 : 16.0;
        out->k = (out->k * (double)ctx + full * P) / ((double)ctx + P);
        out->v = (out->v * (double)ctx + full * P) / ((double)ctx + P);
        out->mean = (out->k + out->v) / 2;
    }
    return KVQ_OK;
}

double kvq_eval_scheme_cache_mib(const kvq_eval_scheme *s, const kvq_bits *bits, size_t ctx, const kvq_hparams *hp)
{
    double tokens = (double)ctx + (s->prefix ? s->prefix->P : 0);
    return (double)hp->n_layers * tokens * (double)kvq_kv_dim(hp) * (bits->k + bits->v) / 8.0 / (1024.0 * 1024.0);
}

/* ---- hooks ----------------------------------------------------------------------------- */

kvq_status kvq_scheme_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                                kvq_err *err)
{
    kvq_scheme_run *run = user;
    const kvq_scheme_family *f = run->s->s.fam;
    if (!f->apply && !f->native) return KVQ_OK;
    double t0 = kvq_now();
    kvq_status s;
    if (f->apply) {
        s = f->apply(run, ctx, k, v, alt, err);
    } else {
        kvq_kv_desc_run dr = {.d = &run->s->desc, .k_counts = run->k_counts, .v_counts = run->v_counts};
        s = kvq_kv_desc_transform(&dr, ctx, k, v, alt, err);
        run->k_counts = dr.k_counts;
        run->v_counts = dr.v_counts;
    }
    run->seconds += kvq_now() - t0;
    return s ? kvq_err_prefix(err, "scheme %s", run->s->name) : KVQ_OK;
}

void kvq_scheme_hooks(kvq_scheme_run *run, const kvq_eval_scheme *s, kvq_hooks *hooks)
{
    memset(run, 0, sizeof *run);
    run->s = s;
    memset(hooks, 0, sizeof *hooks);
    hooks->user = run;
    hooks->transform = s->s.fam->apply || s->s.fam->native ? kvq_scheme_transform : NULL;
    hooks->key_stage = s->s.key_stage;
}
