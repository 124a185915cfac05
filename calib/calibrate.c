/* calibrate.c — dump → tables → artifact; see calibrate.h. */
#include "calibrate.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "identity.h" /* defines: kvq_identity_model_from_dump, kvq_identity_dump, kvq_identity_rope_desc */
#include "progress.h" /* defines: kvq_now */
#include "vllm_scales.h" /* defines: kvq_vllm_scales_write */
#include "tables.h"   /* defines: kvq_calib_opts */

kvq_calibrate_opts kvq_calibrate_defaults(const kvq_family *m)
{
    kvq_calibrate_opts o;
    memset(&o, 0, sizeof o);
    o.method = m;
    o.fit.method = KVQ_FIT_AUTO;
    if (!m || !m->calib) return o;
    const kvq_family_calib *c = m->calib;
    o.k_bits = o.v_bits = c->bits;
    o.outlier_frac = c->outliers;
    o.n_sink = c->sink;
    o.post_rope = c->post_rope;
    o.fisher = c->fisher;
    o.group_size = c->group;
    o.residual_length = c->residual;
    o.fp8_percentile = c->fp8_percentile;
    for (int j = 0; j < KVQ_ARTIFACT_X; j++) o.x[j] = c->x[j];
    return o;
}

/* "nuq and int-pc": the methods whose calib part has the option at `off` */
static const char *who(size_t off, char *buf, size_t n) { return kvq_family_list_calib_flag(off, buf, n); }

kvq_status kvq_calibrate_validate(const kvq_calibrate_opts *o, kvq_err *err)
{
    if (!o) return kvq_fail(err, KVQ_EINVAL, "calibration options: NULL");
    char ms[160], w[160];
    if (!o->method || !o->method->calib)
        return kvq_fail(err, KVQ_EINVAL, "method: %s; expected one of %s", o->method ? o->method->name : "none",
                        kvq_family_methods(", ", ms, sizeof ms));
    const char *mn = o->method->name;
    const kvq_family_calib *c = o->method->calib;
    const kvq_family_artifact *ly = o->method->artifact;
    if (o->k_bits < 1 || o->k_bits > 8) return kvq_fail(err, KVQ_EINVAL, "bits (keys): expected 1..8, found %d", o->k_bits);
    if (o->v_bits < 1 || o->v_bits > 8) return kvq_fail(err, KVQ_EINVAL, "bits (values): expected 1..8, found %d", o->v_bits);
    if (!(o->outlier_frac >= 0 && o->outlier_frac < 0.5))
        return kvq_fail(err, KVQ_EINVAL, "outlier fraction: expected [0, 0.5), found %g", o->outlier_frac);
    if (o->outlier_frac > 0 && !ly->outliers)
        return kvq_fail(err, KVQ_EINVAL, "outlier fraction: method %s keeps no outliers (%s do), found %g", mn,
                        kvq_family_list_artifact_flag(offsetof(kvq_family_artifact, outliers), w, sizeof w), o->outlier_frac);
    if (o->per_head && !ly->per_head)
        return kvq_fail(err, KVQ_EINVAL, "per-head: datatypes or scales per KV head exist for %s only, method is %s",
                        kvq_family_list_artifact_flag(offsetof(kvq_family_artifact, per_head), w, sizeof w), mn);
    if (c->fp8_opt && (o->k_bits != c->bits || o->v_bits != c->bits))
        return kvq_fail(err, KVQ_EINVAL, "bits: %s stores %d-bit codes, found %d / %d", mn, c->bits, o->k_bits, o->v_bits);
    if (c->fp8_opt && !(o->fp8_percentile > 0 && o->fp8_percentile <= 100))
        return kvq_fail(err, KVQ_EINVAL, "percentile: expected (0, 100] (100 = absmax), found %g", o->fp8_percentile);
    if (!c->fp8_opt && (o->fp8_e5m2 || (o->fp8_percentile != 0 && o->fp8_percentile != 100)))
        return kvq_fail(err, KVQ_EINVAL, "percentile / fp8 format: fp8 scale options (%s), method is %s",
                        who(offsetof(kvq_family_calib, fp8_opt), w, sizeof w), mn);
    if (o->fp8_e5m2 && !c->fp8_format_opt)
        return kvq_fail(err, KVQ_EINVAL, "fp8 format e5m2: E5M2 scales exist for %s only, method is %s",
                        who(offsetof(kvq_family_calib, fp8_format_opt), w, sizeof w), mn);
    if (o->fisher && !c->fisher_opt)
        return kvq_fail(err, KVQ_EINVAL, "fisher: only %s fits datatypes, method is %s",
                        who(offsetof(kvq_family_calib, fisher_opt), w, sizeof w), mn);
    if ((unsigned)o->fit.method > KVQ_FIT_EXACT)
        return kvq_fail(err, KVQ_EINVAL, "fit: unknown value %d", (int)o->fit.method);
    if (c->residual_opt) {
        if (o->group_size == 0) return kvq_fail(err, KVQ_EINVAL, "group size: %s needs G >= 1, found 0", mn);
        if (o->residual_length % o->group_size)
            return kvq_fail(err, KVQ_EINVAL, "residual length: expected a multiple of the group size %zu, found %zu",
                            o->group_size, o->residual_length);
    } else if (o->residual_length) {
        return kvq_fail(err, KVQ_EINVAL, "residual length: only %s has one, method is %s, found %zu",
                        who(offsetof(kvq_family_calib, residual_opt), w, sizeof w), mn, o->residual_length);
    }
    if (!c->group_opt && o->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group size: %s has none (%s), found %zu", mn,
                        c->fp8_opt ? "one scale per tensor or KV head" : "per-channel keys, per-token values", o->group_size);
    if (o->n_threads < 0) return kvq_fail(err, KVQ_EINVAL, "threads: expected >= 0, found %d", o->n_threads);
    for (int j = 0; j < KVQ_ARTIFACT_X; j++) {
        const char *nm = NULL;
        for (int q = 0; ly->params && q <= j && ly->params[q]; q++) nm = q == j ? ly->params[q] : NULL;
        if (!isfinite(o->x[j])) return kvq_fail(err, KVQ_EINVAL, "%s: expected a finite number, found %g", nm ? nm : "parameter", o->x[j]);
    }
    if (o->rotation.kind != KVQ_ROT_NONE && !(c->fit && (c->fit_k || c->fit_v))) {
        char fitted[160] = "";
        size_t nf, len = 0;
        const kvq_family *const *f = kvq_families(&nf);
        for (size_t i = 0; i < nf; i++)
            if (f[i]->calib && f[i]->calib->fit && (f[i]->calib->fit_k || f[i]->calib->fit_v) && len < sizeof fitted)
                len += (size_t)snprintf(fitted + len, sizeof fitted - len, "%s%s", len ? ", " : "", f[i]->name);
        return kvq_fail(err, KVQ_EINVAL,
                        "rotate: only methods with fitted tables (%s) are fitted on rotated K / V; method %s has none "
                        "(use +%s on the scheme without an artifact)",
                        fitted, mn, kvq_rotation_kind_name(o->rotation.kind));
    }
    return KVQ_OK;
}

/* Checks that need the dump's meta. */
static kvq_status check_against_dump(const kvq_dump_meta *m, int64_t done, const char *name, const kvq_calibrate_opts *o,
                                     bool needs_data, kvq_err *err)
{
    if (done != m->n_samples)
        return kvq_fail(err, KVQ_EINVAL,
                        "%s: the dump is incomplete (samples_done %" PRId64 " of n_samples %" PRId64
                        "); finish it with kvdump --resume",
                        name, done, m->n_samples);
    size_t hd = (size_t)m->head_dim;
    if (o->method->calib->residual_opt && hd % o->group_size)
        return kvq_fail(err, KVQ_EINVAL, "group size: %s needs G dividing head_dim %zu (from %s), found %zu%s", o->method->name, hd,
                        name, o->group_size,
                        o->group_size == o->method->calib->group ? " (the method's default; choose one with --group)" : "");
    /* other group rules are the family's (kvq_family_artifact.check_params: int / int-pc a divisor of kv_dim, cq of
     * head_dim, lowrank of n_kv_heads, ...), checked before any work below; a generic kv_dim rule here used to
     * answer first, with the wrong rule for cq, lowrank and skvq */
    if (o->rotation.kind != KVQ_ROT_NONE && kvq_rotation_check(&o->rotation, hd, err))
        return kvq_err_prefix(err, "rotate (head_dim from %s)", name);
    if (!needs_data) return KVQ_OK;
    if (m->layer_first != 0 || m->layer_last != m->n_layers - 1)
        return kvq_fail(err, KVQ_EINVAL,
                        "%s: layers %d..%d dumped, but method %s needs every layer 0..%d (rerun kvdump without a layer range)",
                        name, m->layer_first, m->layer_last, o->method->name, m->n_layers - 1);
    if ((int64_t)o->n_sink >= m->seq_len)
        return kvq_fail(err, KVQ_EINVAL, "sink: %zu sink tokens leave nothing to calibrate in samples of seq_len %" PRId64 " (%s)",
                        o->n_sink, m->seq_len, name);
    return KVQ_OK;
}

/* One (layer, K|V) work item. */
typedef struct {
    int layer;
    char kv;          /* 'k' or 'v' */
    kvq_dump_ds ds;   /* tensor */
    kvq_dump_ds fds;  /* Fisher tensor, or KVQ_DUMP_N_DS for none */
} work_item;

typedef struct {
    kvq_dump_reader *r;
    const kvq_dump_meta *m;
    const char *name;
    const kvq_calibrate_opts *o;
    size_t n_tokens, per_sample; /* N*L; L*kv_dim */
} work_ctx;

/* Read one whole tensor [N*L][kv_dim] (HDF5 calls serialised). */
static kvq_status read_tensor(const work_ctx *c, int layer, kvq_dump_ds ds, float *buf, kvq_err *err)
{
    kvq_status s = KVQ_OK;
#pragma omp critical(kvq_calibrate_hdf5)
    {
        for (int64_t smp = 0; smp < c->m->n_samples && s == KVQ_OK; smp++)
            s = kvq_dump_read(c->r, layer, ds, smp, buf + (size_t)smp * c->per_sample, err);
    }
    if (s) return s;
    for (int64_t smp = 0; smp < c->m->n_samples; smp++) {
        const float *x = buf + (size_t)smp * c->per_sample;
        if (kvq_dump_check_values(c->m, ds, x, layer, smp, 0.0f, err)) return kvq_err_prefix(err, "%s", c->name);
        if (ds == KVQ_DUMP_FISHER_K_PRE_ROPE || ds == KVQ_DUMP_FISHER_V)
            for (size_t i = 0; i < c->per_sample; i++)
                if (x[i] < 0) {
                    size_t kvd = (size_t)c->m->n_kv_heads * (size_t)c->m->head_dim, hd = (size_t)c->m->head_dim;
                    return kvq_fail(err, KVQ_ENUMERIC,
                                    "%s: %s: layer %d, sample %" PRId64 ", position %zu, head %zu, channel %zu: value %g "
                                    "is negative (squared gradients are >= 0)",
                                    c->name, kvq_dump_ds_name(ds), layer, smp, i / kvd, (i % kvd) / hd, i % hd, (double)x[i]);
                }
    }
    return KVQ_OK;
}

/* ---- kvq_calib_src over the dump (family.h): any dataset of any layer, all samples ---- */

static size_t src_per_sample(const kvq_dump_meta *m, int ds)
{
    size_t L = (size_t)m->seq_len, hd = (size_t)m->head_dim;
    switch (ds) {
    case KVQ_DUMP_K_PRE_ROPE: case KVQ_DUMP_K: case KVQ_DUMP_V: case KVQ_DUMP_FISHER_K_PRE_ROPE: case KVQ_DUMP_FISHER_V:
        return L * (size_t)m->n_kv_heads * hd;
    case KVQ_DUMP_Q: return L * (size_t)m->n_heads * hd;
    case KVQ_DUMP_ATTN_RECEIVED: case KVQ_DUMP_ATTN_ENTROPY: return (size_t)m->n_heads * L;
    default: return 0;
    }
}

static kvq_status src_read(const kvq_calib_src *src, int layer, int ds, float *buf, kvq_err *err)
{
    const work_ctx *c = src->ctx;
    const kvq_dump_meta *m = c->m;
    if (ds < 0 || ds >= KVQ_DUMP_N_DS) return kvq_fail(err, KVQ_EINVAL, "%s: dataset %d: unknown", c->name, ds);
    if (layer < 0 || layer >= m->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "%s: layer %d: expected 0..%d", c->name, layer, m->n_layers - 1);
    if (!kvq_dump_has(c->r, layer, (kvq_dump_ds)ds)) {
        const char *opt = ds == KVQ_DUMP_Q ? "--q" : ds >= KVQ_DUMP_ATTN_RECEIVED ? "--attn-stats"
                        : ds >= KVQ_DUMP_FISHER_K_PRE_ROPE ? "--fisher" : "its defaults";
        return kvq_fail(err, KVQ_EINVAL, "%s: layer %d: dataset %s is missing; method %s reads it (rerun kvdump with %s)", c->name,
                        layer, kvq_dump_ds_name((kvq_dump_ds)ds), c->o->method->name, opt);
    }
    size_t per = src_per_sample(m, ds);
    kvq_status s = KVQ_OK;
#pragma omp critical(kvq_calibrate_hdf5)
    {
        for (int64_t smp = 0; smp < m->n_samples && s == KVQ_OK; smp++)
            s = kvq_dump_read(c->r, layer, (kvq_dump_ds)ds, smp, buf + (size_t)smp * per, err);
    }
    if (s) return s;
    for (int64_t smp = 0; smp < m->n_samples; smp++) {
        const float *x = buf + (size_t)smp * per;
        if (kvq_dump_check_values(m, (kvq_dump_ds)ds, x, layer, smp, 0.0f, err)) return kvq_err_prefix(err, "%s", c->name);
        if (ds == KVQ_DUMP_FISHER_K_PRE_ROPE || ds == KVQ_DUMP_FISHER_V)
            for (size_t i = 0; i < per; i++)
                if (x[i] < 0)
                    return kvq_fail(err, KVQ_ENUMERIC, "%s: %s: layer %d, sample %" PRId64 ", element %zu: value %g is negative "
                                    "(squared gradients are >= 0)", c->name, kvq_dump_ds_name((kvq_dump_ds)ds), layer, smp, i,
                                    (double)x[i]);
    }
    return KVQ_OK;
}

static kvq_calib_src make_src(const work_ctx *c)
{
    const kvq_dump_meta *m = c->m;
    return (kvq_calib_src){.ctx = (void *)c, .n_samples = (size_t)m->n_samples, .seq_len = (size_t)m->seq_len,
                           .n_layers = (size_t)m->n_layers, .n_heads = (size_t)m->n_heads, .n_kv_heads = (size_t)m->n_kv_heads,
                           .head_dim = (size_t)m->head_dim, .rope_dim = (size_t)m->rope_dim, .has_q = m->has_q,
                           .has_fisher = m->has_fisher, .has_attn_stats = m->has_attn_stats, .read = src_read};
}

/* Fisher weights of rotated channels: the mean over each Hadamard block (calibrate.h). */
static void fisher_block_mean(float *f, size_t n_rows, size_t kv_dim, size_t block)
{
    for (size_t i = 0; i < n_rows * kv_dim; i += block) {
        double sum = 0;
        for (size_t j = 0; j < block; j++) sum += f[i + j];
        float mean = (float)(sum / (double)block);
        for (size_t j = 0; j < block; j++) f[i + j] = mean;
    }
}

/* Pre-RoPE Fisher → weights for post-RoPE keys: pair mean over rotary pairs (calibrate.h). */
static void fisher_pair_mean(float *f, size_t n_rows, size_t n_heads, size_t hd, size_t rope_dim)
{
    for (size_t t = 0; t < n_rows; t++)
        for (size_t h = 0; h < n_heads; h++) {
            float *x = f + (t * n_heads + h) * hd;
            for (size_t j = 0; j + 1 < rope_dim; j += 2) {
                float mean = (float)(((double)x[j] + (double)x[j + 1]) * 0.5);
                x[j] = x[j + 1] = mean;
            }
        }
}

static kvq_status run_item(const work_ctx *c, const work_item *w, kvq_kv_table *out, kvq_err *err)
{
    const kvq_calibrate_opts *o = c->o;
    const kvq_dump_meta *m = c->m;
    size_t n = c->n_tokens * ((size_t)m->n_kv_heads * (size_t)m->head_dim); /* overflow checked by the caller */
    float *x = malloc(n * sizeof *x);
    float *f = w->fds != KVQ_DUMP_N_DS ? malloc(n * sizeof *f) : NULL;
    if (!x || (w->fds != KVQ_DUMP_N_DS && !f)) {
        free(x);
        free(f);
        return kvq_fail(err, KVQ_ENOMEM, "%s: layer %d: cannot allocate %zu floats for %s", c->name, w->layer, n,
                        kvq_dump_ds_name(w->ds));
    }
    kvq_status s = read_tensor(c, w->layer, w->ds, x, err);
    if (!s && f) s = read_tensor(c, w->layer, w->fds, f, err);
    if (!s && f && w->kv == 'k' && o->post_rope)
        fisher_pair_mean(f, c->n_tokens, (size_t)m->n_kv_heads, (size_t)m->head_dim, (size_t)m->rope_dim);
    if (!s && o->rotation.kind != KVQ_ROT_NONE) {
        size_t kvd = (size_t)m->n_kv_heads * (size_t)m->head_dim;
        s = kvq_rotation_apply(&o->rotation, x, c->n_tokens, kvd, (size_t)m->head_dim, w->kv, false, err);
        if (f) fisher_block_mean(f, c->n_tokens, kvd, kvq_hadamard_block((size_t)m->head_dim, w->kv));
    }
    if (!s) {
        kvq_artifact_params p = {.method = o->method, .k_bits = o->k_bits, .v_bits = o->v_bits, .outlier_frac = o->outlier_frac,
                                 .n_sink = o->n_sink, .post_rope = o->post_rope, .per_head = o->per_head,
                                 .group_size = o->group_size, .residual_length = o->residual_length,
                                 .fisher = o->fisher, .fp8_e5m2 = o->fp8_e5m2, .fp8_percentile = o->fp8_percentile,
                                 .rotation = o->rotation, .n_layers = (size_t)m->n_layers, .n_kv_heads = (size_t)m->n_kv_heads,
                                 .head_dim = (size_t)m->head_dim};
        for (int j = 0; j < KVQ_ARTIFACT_X; j++) p.x[j] = o->x[j]; /* the family's parameters (artifact->params) */
        kvq_fit_input in = {.x = x, .fisher = f, .n_tokens = c->n_tokens, .sample_len = (size_t)m->seq_len,
                            .n_kv_heads = (size_t)m->n_kv_heads, .head_dim = (size_t)m->head_dim, .fit = o->fit};
        s = o->method->calib->fit(&p, w->kv, &in, out, err);
        if (s) kvq_err_prefix(err, "%s: layer %d (%s%s%s)", c->name, w->layer, kvq_dump_ds_name(w->ds), f ? " weighted by " : "",
                              f ? kvq_dump_ds_name(w->fds) : "");
    }
    free(x);
    free(f);
    return s;
}

/* Families with a layer fit (family.h fit_layer): one work item per layer, both sides, then `finish`. */
static kvq_status calibrate_layers(work_ctx *c, kvq_artifact *a, bool fit_k, bool fit_v, kvq_artifact *out, kvq_err *err)
{
    const kvq_calibrate_opts *o = c->o;
    const kvq_family_calib *fc = o->method->calib;
    const kvq_dump_meta *m = c->m;
    int n_items = m->n_layers;
    kvq_status *st = calloc((size_t)n_items, sizeof *st);
    kvq_err *errs = calloc((size_t)n_items, sizeof *errs);
    a->k = fit_k ? calloc(a->p.n_layers, sizeof *a->k) : NULL;
    a->v = fit_v ? calloc(a->p.n_layers, sizeof *a->v) : NULL;
    if (!st || !errs || (fit_k && !a->k) || (fit_v && !a->v)) {
        free(st);
        free(errs);
        kvq_artifact_free(a);
        return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", c->name);
    }
    kvq_calib_src src = make_src(c);
    int nt = o->n_threads > 0 ? o->n_threads : omp_get_max_threads();
    if (nt > n_items) nt = n_items;
    if (nt < 1) nt = 1;
    int failed = 0, n_done = 0, total = n_items * ((fit_k ? 1 : 0) + (fit_v ? 1 : 0));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int l = 0; l < n_items; l++) {
        int stop;
#pragma omp atomic read
        stop = failed;
        if (stop) continue;
        double t0 = kvq_now();
        kvq_kv_table *tk = fit_k ? &a->k[l] : NULL, *tv = fit_v ? &a->v[l] : NULL;
        st[l] = fc->fit_layer(&a->p, l, &src, tk, tv, &errs[l]);
        if (st[l]) {
            kvq_err_prefix(&errs[l], "%s: layer %d", c->name, l);
#pragma omp atomic write
            failed = 1;
        } else if (o->on_table) {
            double dt = kvq_now() - t0;
#pragma omp critical(kvq_calibrate_progress)
            {
                if (tk) o->on_table(o->on_table_ctx, ++n_done, total, l, 'k', tk, dt);
                if (tv) o->on_table(o->on_table_ctx, ++n_done, total, l, 'v', tv, dt);
            }
        }
    }
    kvq_status s = KVQ_OK;
    for (int it = 0; it < n_items && !s; it++)
        if (st[it]) {
            s = st[it];
            if (err) *err = errs[it];
        }
    free(st);
    free(errs);
    if (!s && fc->finish) {
        s = fc->finish(&a->p, &src, a, err);
        if (s) kvq_err_prefix(err, "%s", c->name);
    }
    if (!s) s = kvq_artifact_validate(a, err);
    if (s) {
        kvq_artifact_free(a);
        return s;
    }
    *out = *a;
    return KVQ_OK;
}

kvq_status kvq_calibrate_dump(kvq_dump_reader *r, const char *dump_name, const kvq_calibrate_opts *o, kvq_artifact *out,
                              kvq_err *err)
{
    memset(out, 0, sizeof *out);
    KVQ_TRY(kvq_calibrate_validate(o, err));
    if (!r) return kvq_fail(err, KVQ_EINVAL, "dump: NULL reader");
    const char *name = dump_name ? dump_name : "dump";
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    const kvq_family_calib *fc = o->method->calib;
    bool fit_k = fc->fit_k && (fc->fit || fc->fit_layer), fit_v = fc->fit_v && (fc->fit || fc->fit_layer),
         needs_data = fit_k || fit_v;
    KVQ_TRY(check_against_dump(m, kvq_dump_reader_samples_done(r), name, o, needs_data, err));

    kvq_artifact a;
    memset(&a, 0, sizeof a);
    kvq_artifact_params *p = &a.p;
    p->method = o->method;
    p->k_bits = o->k_bits;
    p->v_bits = o->v_bits;
    p->outlier_frac = o->outlier_frac;
    p->n_sink = o->n_sink;
    p->post_rope = o->post_rope;
    p->per_head = o->per_head;
    p->group_size = o->group_size;
    p->residual_length = o->residual_length;
    p->fisher = fc->fisher_opt && o->fisher;
    p->fp8_e5m2 = fc->fp8_opt && o->fp8_e5m2;
    p->fp8_percentile = fc->fp8_opt ? o->fp8_percentile : 0;
    p->rotation = o->rotation;
    snprintf(p->fit, sizeof p->fit, "%s", fc->fit_opt ? kvq_fit_method_name(o->fit.method) : "");
    p->n_layers = (size_t)m->n_layers;
    p->n_kv_heads = (size_t)m->n_kv_heads;
    p->head_dim = (size_t)m->head_dim;
    for (int j = 0; j < KVQ_ARTIFACT_X; j++) p->x[j] = o->x[j];
    if (o->method->artifact->check_params) KVQ_TRY(o->method->artifact->check_params(p, err)); /* before any work */
    KVQ_TRY(kvq_calib_fill_bits(p, o->bits_ctx ? o->bits_ctx : (size_t)m->seq_len, err));
    char hex[65];
    if (kvq_identity_model_from_dump(m, hex, err)) return kvq_err_prefix(err, "%s", name);
    snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "%s", hex);
    kvq_identity_rope_desc(m, p->model_rope, sizeof p->model_rope);
    KVQ_TRY(kvq_identity_dump(r, hex, err));
    snprintf(p->dump_fingerprint, sizeof p->dump_fingerprint, "%s", hex);

    if (!needs_data) { /* int, kivi: the metadata is the whole scheme */
        KVQ_TRY(kvq_artifact_validate(&a, err));
        *out = a;
        return KVQ_OK;
    }

    /* work items: (layer, K) and / or (layer, V), as the family fits them */
    kvq_dump_ds kds = o->post_rope ? KVQ_DUMP_K : KVQ_DUMP_K_PRE_ROPE;
    bool fisher = p->fisher;
    for (int l = 0; fisher && l < m->n_layers; l++)
        for (int j = 0; j < 2; j++) {
            kvq_dump_ds fd = j ? KVQ_DUMP_FISHER_V : KVQ_DUMP_FISHER_K_PRE_ROPE;
            if (!kvq_dump_has(r, l, fd))
                return kvq_fail(err, KVQ_EINVAL,
                                "%s: layer %d: dataset %s is missing (the dump was written without Fisher information, "
                                "has_fisher = %d): rerun kvdump with --fisher, or calibrate with --no-fisher",
                                name, l, kvq_dump_ds_name(fd), (int)m->has_fisher);
        }
    work_ctx c = {.r = r, .m = m, .name = name, .o = o};
    size_t kv_dim = (size_t)m->n_kv_heads * (size_t)m->head_dim, tot;
    if (kvq_mul_size((size_t)m->n_samples, (size_t)m->seq_len, &c.n_tokens) ||
        kvq_mul_size((size_t)m->seq_len, kv_dim, &c.per_sample) || kvq_mul_size(c.n_tokens, kv_dim, &tot) ||
        kvq_mul_size(tot, sizeof(float), &tot))
        return kvq_fail(err, KVQ_ENOMEM, "%s: n_samples x seq_len x kv_dim overflows", name);
    if (fc->fit_layer) return calibrate_layers(&c, &a, fit_k, fit_v, out, err);
    int per_layer = (fit_k ? 1 : 0) + (fit_v ? 1 : 0), n_items = m->n_layers * per_layer;
    work_item *items = calloc((size_t)n_items, sizeof *items);
    kvq_status *st = calloc((size_t)n_items, sizeof *st);
    kvq_err *errs = calloc((size_t)n_items, sizeof *errs);
    a.k = fit_k ? calloc(p->n_layers, sizeof *a.k) : NULL;
    a.v = fit_v ? calloc(p->n_layers, sizeof *a.v) : NULL;
    if (!items || !st || !errs || (fit_k && !a.k) || (fit_v && !a.v)) {
        free(items);
        free(st);
        free(errs);
        kvq_artifact_free(&a);
        return kvq_fail(err, KVQ_ENOMEM, "%s: out of memory", name);
    }
    for (int l = 0; l < m->n_layers; l++)
        for (int j = 0; j < per_layer; j++) {
            work_item *w = &items[l * per_layer + j];
            bool v = !fit_k || j == 1;
            w->layer = l;
            w->kv = v ? 'v' : 'k';
            w->ds = v ? KVQ_DUMP_V : kds;
            w->fds = !fisher ? KVQ_DUMP_N_DS : v ? KVQ_DUMP_FISHER_V : KVQ_DUMP_FISHER_K_PRE_ROPE;
        }
    int nt = o->n_threads > 0 ? o->n_threads : omp_get_max_threads();
    if (nt > n_items) nt = n_items;
    if (nt < 1) nt = 1;
    int failed = 0, n_done = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int it = 0; it < n_items; it++) {
        int stop;
#pragma omp atomic read
        stop = failed;
        if (stop) continue;
        const work_item *w = &items[it];
        kvq_kv_table *t = w->kv == 'k' ? &a.k[w->layer] : &a.v[w->layer];
        double t0 = kvq_now();
        st[it] = run_item(&c, w, t, &errs[it]);
        if (st[it]) {
#pragma omp atomic write
            failed = 1;
        } else if (o->on_table) {
            double dt = kvq_now() - t0;
#pragma omp critical(kvq_calibrate_progress)
            o->on_table(o->on_table_ctx, ++n_done, n_items, w->layer, w->kv, t, dt);
        }
    }
    kvq_status s = KVQ_OK;
    /* Items are dispatched in index order and a started item always finishes,
     * so the lowest failing index is the same whatever the schedule. */
    for (int it = 0; it < n_items && !s; it++)
        if (st[it]) {
            s = st[it];
            if (err) *err = errs[it];
        }
    free(items);
    free(st);
    free(errs);
    if (!s) s = kvq_artifact_validate(&a, err);
    if (s) {
        kvq_artifact_free(&a);
        return s;
    }
    *out = a;
    return KVQ_OK;
}

kvq_status kvq_calibrate_file(const char *dump_path, const char *out_path, bool force, const kvq_calibrate_opts *o,
                              kvq_artifact *result, kvq_err *err)
{
    if (result) memset(result, 0, sizeof *result);
    if (!dump_path || !out_path) return kvq_fail(err, KVQ_EINVAL, "calibrate: NULL path");
    KVQ_TRY(kvq_calibrate_validate(o, err));
    if (!force && access(out_path, F_OK) == 0) /* checked before the long calibration, and again at the move */
        return kvq_fail(err, KVQ_EIO, "%s: already exists; not overwritten (use --force to replace it)", out_path);
    kvq_dump_reader *r = NULL;
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    kvq_status s = kvq_dump_open(dump_path, &r, err);
    if (!s) s = kvq_calibrate_dump(r, dump_path, o, &a, err);
    kvq_dump_close(r);
    if (!s) s = kvq_artifact_write_new(out_path, &a, force, err);
    if (s || !result) kvq_artifact_free(&a);
    else *result = a;
    return s;
}

kvq_status kvq_calibrate_export_vllm(const kvq_artifact *a, const char *out_path, bool force, kvq_err *err)
{
    return kvq_calibrate_export_scales(a, KVQ_SCALES_VLLM, out_path, NULL, force, err);
}

kvq_status kvq_calibrate_export_scales(const kvq_artifact *a, kvq_kv_scale_form form, const char *out_path,
                                       const char *config_path, bool force, kvq_err *err)
{
    if (!a || !out_path) return kvq_fail(err, KVQ_EINVAL, "export-vllm: NULL argument");
    const kvq_artifact_params *p = &a->p;
    if (!p->method || !p->method->artifact || !p->method->artifact->vllm_export)
        return kvq_fail(err, KVQ_EINVAL, "export-vllm: the artifact is method %s; only fp8 artifacts hold k/v scales "
                        "(kvcalib DUMP --method fp8 ...)", p->method ? p->method->name : "?");
    if (!p->post_rope)
        return kvq_fail(err, KVQ_EINVAL, "export-vllm: the scales were fitted on pre-RoPE keys; vLLM caches post-RoPE "
                        "keys (recalibrate with --keys post-rope, the fp8 default)");
    if (p->fp8_e5m2)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "export-vllm: the artifact holds E5M2 scales; vLLM's fp8_e5m2 cache is "
                        "used without checkpoint scales (calibrate E4M3FN scales for kv_cache_dtype=\"fp8\")");
    if (form == KVQ_SCALES_MODELOPT && p->per_head)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "export-vllm: the modelopt form has one k_scale / v_scale per layer "
                        "(self_attn.k_proj.k_scale, shape [1]); the artifact holds per-KV-head scales (use the vllm or "
                        "compressed-tensors form, strategy attn_head)");
    if (config_path && form != KVQ_SCALES_COMPRESSED_TENSORS)
        return kvq_fail(err, KVQ_EINVAL, "export-vllm: a config.json fragment belongs to the compressed-tensors form, "
                        "form is %s", kvq_kv_scale_form_name(form));
    KVQ_TRY(kvq_artifact_validate(a, err));
    if (!force && access(out_path, F_OK) == 0)
        return kvq_fail(err, KVQ_EIO, "%s: already exists; not overwritten (use --force to replace it)", out_path);
    if (config_path && !force && access(config_path, F_OK) == 0)
        return kvq_fail(err, KVQ_EIO, "%s: already exists; not overwritten (use --force to replace it)", config_path);
    size_t L = p->n_layers, n = p->per_head ? p->n_kv_heads : 1, tot;
    if (kvq_mul_size(L, n, &tot)) return kvq_fail(err, KVQ_ENOMEM, "export-vllm: size overflow");
    float *ks = malloc(tot * sizeof *ks), *vs = malloc(tot * sizeof *vs);
    if (!ks || !vs) {
        free(ks);
        free(vs);
        return kvq_fail(err, KVQ_ENOMEM, "export-vllm: out of memory");
    }
    for (size_t i = 0; i < L; i++) {
        memcpy(ks + i * n, a->k[i].fp8_scale, n * sizeof *ks);
        memcpy(vs + i * n, a->v[i].fp8_scale, n * sizeof *vs);
    }
    kvq_vllm_kv_scales sc = {.n_layers = L, .n_kv_heads = p->n_kv_heads, .per_head = p->per_head, .k_scale = ks,
                             .v_scale = vs, .form = form};
    char pct[40], sink[32];
    snprintf(pct, sizeof pct, "%.17g", p->fp8_percentile);
    snprintf(sink, sizeof sink, "%zu", p->n_sink);
    const kvq_st_kv meta[] = {
        {"kvq.creator", "kvq kvcalib export-vllm"},
        {"kvq.form", kvq_kv_scale_form_name(form)},
        {"kvq.fp8_format", "e4m3fn"},
        {"kvq.fp8_percentile", pct},
        {"kvq.granularity", p->per_head ? "per-head" : "per-tensor"},
        {"kvq.key_position", "post-rope"},
        {"kvq.n_sink", sink},
        {"kvq.model_fingerprint", p->model_fingerprint},
        {"kvq.dump_fingerprint", p->dump_fingerprint},
    };
    kvq_status s = kvq_vllm_scales_write(out_path, &sc, meta, sizeof meta / sizeof *meta, err);
    free(ks);
    free(vs);
    if (!s && config_path) s = kvq_ct_config_write(config_path, p->per_head, err);
    return s;
}
