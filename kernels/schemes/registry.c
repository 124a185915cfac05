/* registry.c — the list of KV-cache method families and the helpers every
 * family file shares; see family.h. Adding a family: its file, one extern and
 * one line in `families` below, its tests. */
#include "family.h"

#include <ctype.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "cli.h" /* kvq_parse_double */

extern const kvq_family kvq_family_fp32, kvq_family_fp16, kvq_family_int, kvq_family_int_pc, kvq_family_kivi,
    kvq_family_nuq, kvq_family_fp8, kvq_family_nvfp4, kvq_family_mxfp4, kvq_family_ggml, kvq_family_hh,
    kvq_family_int8_pth, kvq_family_int4_pth, kvq_family_fp8_pth, kvq_family_turboquant;
extern const kvq_family kvq_family_wkvq, kvq_family_cq, kvq_family_lowrank;
extern const kvq_family kvq_family_mikv, kvq_family_zipcache, kvq_family_skvq;
extern const kvq_family kvq_family_minicache;
extern const kvq_family kvq_family_qaq;

/* Listing order (kveval --help, kvcalib --method, error messages): the baselines, then KVQuant's
 * nuqX (the method the suite is built around), the uniform and KIVI families, the production
 * formats, the attention-aware ones. Parse tries them in this order; a family whose names
 * share a prefix with another's answers 0 for those (int answers 0 for int<b>-pc). */
static const kvq_family *const families[] = {
    &kvq_family_fp32, &kvq_family_fp16, &kvq_family_nuq,  &kvq_family_int, &kvq_family_int_pc,
    &kvq_family_kivi, &kvq_family_fp8,  &kvq_family_nvfp4, &kvq_family_mxfp4, &kvq_family_ggml, &kvq_family_int8_pth,
    &kvq_family_int4_pth, &kvq_family_fp8_pth, &kvq_family_turboquant, &kvq_family_hh,
    &kvq_family_wkvq, &kvq_family_cq, &kvq_family_lowrank,
    &kvq_family_mikv, &kvq_family_zipcache, &kvq_family_skvq,
    &kvq_family_minicache,
    &kvq_family_qaq,
};
#define N_FAMILIES (sizeof families / sizeof *families)

const kvq_family *const *kvq_families(size_t *n)
{
    *n = N_FAMILIES;
    return families;
}

const kvq_family *kvq_family_find(const char *name)
{
    for (size_t i = 0; name && i < N_FAMILIES; i++)
        if (!strcmp(families[i]->name, name)) return families[i];
    return NULL;
}

const kvq_family *kvq_family_method(const char *name)
{
    const kvq_family *f = kvq_family_find(name);
    return f && f->artifact ? f : NULL;
}

static void join(char *buf, size_t n, size_t *len, const char *sep, const char *item)
{
    if (*len >= n) return;
    int w = snprintf(buf + *len, n - *len, "%s%s", *len ? sep : "", item);
    if (w > 0) *len += (size_t)w;
}

const char *kvq_family_methods(const char *sep, char *buf, size_t n)
{
    size_t len = 0;
    if (n) buf[0] = 0;
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (families[i]->calib) join(buf, n, &len, sep, families[i]->name);
    return buf;
}

/* "a", "a and b", "a, b and c" */
static const char *list_flag(size_t off, bool calib, char *buf, size_t n)
{
    const char *names[N_FAMILIES];
    size_t k = 0, len = 0;
    for (size_t i = 0; i < N_FAMILIES; i++) {
        const void *part = calib ? (const void *)families[i]->calib : (const void *)families[i]->artifact;
        if (part && *(const bool *)((const char *)part + off)) names[k++] = families[i]->name;
    }
    if (n) buf[0] = 0;
    for (size_t i = 0; i < k; i++) join(buf, n, &len, i + 1 == k && k > 1 ? " and " : ", ", names[i]);
    return buf;
}

const char *kvq_family_list_artifact_flag(size_t flag_offset, char *buf, size_t n)
{
    return list_flag(flag_offset, false, buf, n);
}

const char *kvq_family_list_calib_flag(size_t flag_offset, char *buf, size_t n)
{
    return list_flag(flag_offset, true, buf, n);
}

/* ---- schemes ---------------------------------------------------------------------------- */

static kvq_status check_bits(int bits, const char *field, kvq_err *err)
{
    if (bits < 1 || bits > KVQ_QUANT_MAX_BITS)
        return kvq_fail(err, KVQ_EINVAL, "%s: expected 1..%d, found %d", field, KVQ_QUANT_MAX_BITS, bits);
    return KVQ_OK;
}

kvq_status kvq_scheme_validate(const kvq_scheme *s, kvq_err *err)
{
    if (!s) return kvq_fail(err, KVQ_EINVAL, "scheme: NULL");
    if (!s->fam) return kvq_fail(err, KVQ_EINVAL, "scheme: family: none");
    if (s->fam->identity || s->fam->stage_free) return s->fam->validate ? s->fam->validate(s, err) : KVQ_OK;
    KVQ_TRY(check_bits(s->k_bits, "scheme: k_bits", err));
    KVQ_TRY(check_bits(s->v_bits, "scheme: v_bits", err));
    if (!(s->outlier_frac >= 0 && s->outlier_frac < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "scheme: outlier fraction: expected [0, 0.5), found %g", s->outlier_frac);
    return s->fam->validate ? s->fam->validate(s, err) : KVQ_OK;
}

kvq_status kvq_scheme_bits_ex(const kvq_scheme *s, const kvq_bits_in *in, kvq_bits *out, kvq_err *err)
{
    KVQ_TRY(kvq_scheme_validate(s, err));
    if (in->ctx == 0 || in->kv_dim == 0)
        return kvq_fail(err, KVQ_EINVAL, "scheme bits: ctx and kv_dim must be > 0, found %zu and %zu", in->ctx, in->kv_dim);
    KVQ_TRY(s->fam->bits(s, in, out, err));
    out->mean = (out->k + out->v) / 2;
    return KVQ_OK;
}

kvq_status kvq_scheme_bits(const kvq_scheme *s, size_t ctx, size_t kv_dim, kvq_bits *out, kvq_err *err)
{
    kvq_bits_in in = {.ctx = ctx, .kv_dim = kv_dim};
    return kvq_scheme_bits_ex(s, &in, out, err);
}

double kvq_bits_outlier_frac(const kvq_quant_counts *c, double nominal)
{
    if (!c || nominal <= 0) return nominal;
    uint64_t dense = c->n_elems - c->n_sink - c->n_exact;
    return dense ? (double)c->n_outliers / (double)dense : nominal;
}

double kvq_bits_mix16(double dense, size_t ctx, size_t n16)
{
    if (n16 > ctx) n16 = ctx;
    return ((double)(ctx - n16) * dense + (double)n16 * 16.0) / (double)ctx;
}

kvq_status kvq_family_transform_in_place(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v,
                                         kvq_err *err)
{
    const kvq_kv_desc *d = run->d;
    size_t kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim, T = (size_t)c->T, hd = (size_t)c->head_dim;
    KVQ_TRY(d->q.fam->quantize(d, c->layer, 'k', k, k, T, kvd, hd, &run->k_counts, err));
    return d->q.fam->quantize(d, c->layer, 'v', v, v, T, kvd, hd, &run->v_counts, err);
}

/* ---- spec helpers ------------------------------------------------------------------------ */

bool kvq_spec_uint(const char **p, unsigned long max, unsigned long *out)
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

bool kvq_spec_percent(const char **p, double *frac)
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

bool kvq_spec_starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

int kvq_spec_bad(const char *spec, kvq_err *err, const char *what)
{
    kvq_fail(err, KVQ_EINVAL, "scheme '%s': %s", spec, what);
    return -1;
}

int kvq_spec_bits(const char **p, const char *prefix, const char *spec, unsigned long *bits, kvq_err *err)
{
    if (!kvq_spec_starts(*p, prefix) || !isdigit((unsigned char)(*p)[strlen(prefix)])) return 0;
    *p += strlen(prefix);
    if (!kvq_spec_uint(p, 1000, bits) || *bits < 1 || *bits > KVQ_QUANT_MAX_BITS)
        return kvq_spec_bad(spec, err, "bits: expected 1..8");
    return 1;
}

void kvq_spec_fmt_pct(char *buf, size_t n, double frac)
{
    if (frac > 0) snprintf(buf, n, "-%g%%", frac * 100.0);
    else if (n) buf[0] = 0;
}

size_t kvq_calib_src_len(const kvq_calib_src *src, int ds)
{
    size_t rows = src->n_samples * src->seq_len, hd = src->head_dim;
    switch (ds) {
    case 0: case 1: case 2: case 4: case 5: return rows * src->n_kv_heads * hd; /* keys, values, Fisher */
    case 3: return rows * src->n_heads * hd;                                     /* queries */
    case 6: case 7: return src->n_samples * src->n_heads * src->seq_len;         /* attention statistics */
    default: return 0;
    }
}

size_t kvq_fit_drop_sink(const kvq_fit_input *in, size_t n_sink)
{
    size_t kvd = in->n_kv_heads * in->head_dim, L = in->sample_len ? in->sample_len : in->n_tokens;
    size_t ns = n_sink < L ? n_sink : L, rows = 0;
    float *x = (float *)in->x;
    for (size_t t = 0; t < in->n_tokens; t++)
        if (t % L >= ns) {
            if (rows != t) memmove(x + rows * kvd, x + t * kvd, kvd * sizeof *x);
            rows++;
        }
    return rows;
}
