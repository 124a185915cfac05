/* scheme.c — scheme specs, artifact binding, the transform hook, bits; see
 * scheme.h. Everything family-specific comes from the registry (family.h). */
#include "scheme.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "identity.h"
#include "progress.h"
#include "safetensors.h"

/* ---- the valid forms --------------------------------------------------------------- */

static const char MODIFIERS[] = "+sink<N>, +pre-rope, +post-rope, +intactkv, +artifact<N>, +hadamard, +rht[<seed>]";

const char *kvq_scheme_syntax(char *buf, size_t cap)
{
    size_t n, len = 0;
    const kvq_family *const *f = kvq_families(&n);
    if (!cap) return buf;
    buf[0] = 0;
    for (size_t i = 0; i < n && len < cap; i++) {
        int w = snprintf(buf + len, cap - len, "%s%s", i ? ", " : "", f[i]->syntax);
        if (w > 0) len += (size_t)w;
    }
    if (len < cap)
        snprintf(buf + len, cap - len, "; b = 1..8; modifiers %s (e.g. int4, kivi2-g32-r128, nuq3-1%%+sink1, q4_0+hadamard)",
                 MODIFIERS);
    return buf;
}

/* ---- parse ------------------------------------------------------------------------- */

kvq_status kvq_scheme_parse(const char *spec, kvq_scheme_spec *out, kvq_err *err)
{
    char syn[KVQ_SCHEME_SYNTAX_MAX];
    memset(out, 0, sizeof *out);
    out->artifact_index = 0;
    if (!spec || !*spec) return kvq_fail(err, KVQ_EINVAL, "scheme: empty spec; expected one of %s", kvq_scheme_syntax(syn, sizeof syn));
    if (strlen(spec) >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%.40s...': longer than %d characters", spec, KVQ_SPEC_MAX - 1);
    snprintf(out->spec, sizeof out->spec, "%s", spec);
    char buf[KVQ_SPEC_MAX];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL, *base = strtok_r(buf, "+", &save);
    if (!base || spec[0] == '+')
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': missing base name; expected one of %s", spec, kvq_scheme_syntax(syn, sizeof syn));
    size_t nf;
    const kvq_family *const *fams = kvq_families(&nf);
    /* every family is asked; the first that parses the base wins. A family that finds a malformed name of
     * its own (-1) loses to a later one that takes it (int's "int8-…" against int8-pth); with no taker the
     * first malformed-name error is the answer. */
    kvq_err first = {0};
    bool malformed = false;
    for (size_t i = 0; i < nf && !out->q.fam; i++) {
        kvq_scheme q = {0};
        kvq_err e1 = {0};
        int r = fams[i]->parse(base, out->spec, &q, &e1);
        if (r < 0 && !malformed) {
            first = e1;
            malformed = true;
        }
        if (r > 0) {
            out->q = q;
            out->q.fam = fams[i];
        }
    }
    if (!out->q.fam && malformed) {
        if (err) *err = first;
        return KVQ_EINVAL;
    }
    if (!out->q.fam)
        return kvq_fail(err, KVQ_EINVAL, "unknown scheme '%s' (base '%s'); valid: %s", spec, base, kvq_scheme_syntax(syn, sizeof syn));
    const kvq_family *fam = out->q.fam;
    out->key_stage = fam->default_stage;
    for (char *m = strtok_r(NULL, "+", &save); m; m = strtok_r(NULL, "+", &save)) {
        const char *p = m;
        unsigned long n;
        if (kvq_spec_starts(m, "sink")) {
            p += 4;
            if (!kvq_spec_uint(&p, 1u << 24, &n) || *p)
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
        } else if (!strcmp(m, "hadamard") || kvq_spec_starts(m, "rht")) {
            kvq_rotation r = {.kind = m[0] == 'h' ? KVQ_ROT_HADAMARD : KVQ_ROT_RHT};
            if (r.kind == KVQ_ROT_RHT && m[3]) { /* a decimal 64-bit seed */
                char *end;
                errno = 0;
                unsigned long long seed = strtoull(m + 3, &end, 10);
                if (!isdigit((unsigned char)m[3]) || *end || errno)
                    return kvq_fail(err, KVQ_EINVAL,
                                    "scheme '%s': modifier '+%s': expected +rht or +rht<seed> with a decimal seed < 2^64", spec, m);
                r.seed = (uint64_t)seed;
            }
            if (out->rot.kind != KVQ_ROT_NONE) {
                char prev[48];
                kvq_rotation_spec(&out->rot, prev, sizeof prev);
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': a rotation given twice (+%s after %s)", spec, m, prev);
            }
            out->rot = r;
        } else if (!strcmp(m, "intactkv")) {
            if (out->intactkv) return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +intactkv given twice", spec);
            out->intactkv = true;
        } else if (kvq_spec_starts(m, "artifact")) {
            p += 8;
            if (!kvq_spec_uint(&p, 4096, &n) || *p || n == 0)
                return kvq_fail(err, KVQ_EINVAL, "scheme '%s': modifier '+%s': expected +artifact<N> with N >= 1 (the N-th --artifact)",
                                spec, m);
            if (out->artifact_index) return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +artifact given twice", spec);
            out->artifact_index = (int)n;
        } else {
            return kvq_fail(err, KVQ_EINVAL, "scheme '%s': unknown modifier '+%s'; valid: %s", spec, m, MODIFIERS);
        }
    }
    if (spec[strlen(spec) - 1] == '+' || strstr(spec, "++"))
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': empty modifier", spec);
    if (fam->stage_free && out->stage_set)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +pre-rope/+post-rope: %s does not depend on the key stage", spec, fam->name);
    if (fam->identity && out->sink_set)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +sink: %s keeps every token exact already", spec, fam->name);
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
        s = kvq_kv_layer_tables_view(&set->a[i], &set->tables[i], err);
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

/* can the artifact serve the spec: the family's rule and the same rotation (kvcalib --rotate) */
static bool art_match(const kvq_scheme_spec *spec, const kvq_artifact_params *p)
{
    return spec->q.fam->match(&spec->q, spec->stage_set, spec->key_stage, p) && kvq_rotation_equal(&spec->rot, &p->rotation);
}

kvq_status kvq_eval_scheme_bind(const kvq_scheme_spec *spec, const kvq_artifact_set *set, const kvq_hparams *hp,
                                kvq_eval_scheme *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    out->s = *spec;
    out->art_index = out->prefix_index = -1;
    out->head_dim = (size_t)hp->head_dim;
    const kvq_family *f = spec->q.fam;
    size_t n_art = set ? set->n : 0;
    int want = spec->artifact_index - 1; /* -1 = auto */
    if (want >= (int)n_art)
        return kvq_fail(err, KVQ_EINVAL, "scheme '%s': +artifact%d: only %zu --artifact file(s) given", spec->spec,
                        spec->artifact_index, n_art);
    if (f->needs_artifact && f->needs_artifact(&spec->q)) {
        char need[320];
        f->describe_need(&spec->q, spec->stage_set, spec->key_stage, need, sizeof need);
        bool any_rot = spec->rot.kind != KVQ_ROT_NONE;
        for (size_t i = 0; i < n_art; i++) any_rot |= set->a[i].p.rotation.kind != KVQ_ROT_NONE;
        if (any_rot) { /* the rotation the tables must have been fitted on (kvcalib --rotate) */
            char rd[64];
            kvq_rotation_describe(&spec->rot, rd, sizeof rd);
            size_t l = strlen(need);
            if (l < sizeof need) snprintf(need + l, sizeof need - l, ", fitted on %s K / V", rd);
        }
        if (n_art == 0)
            return kvq_fail(err, KVQ_EINVAL, "scheme '%s' needs %s; none given (--artifact FILE, written by kvcalib)",
                            spec->spec, need);
        int pick = -1;
        if (want >= 0) {
            if (!art_match(spec, &set->a[want].p)) {
                char rd[64];
                kvq_rotation_describe(&set->a[want].p.rotation, rd, sizeof rd);
                return kvq_fail(err, KVQ_EMISMATCH,
                                "scheme '%s' needs %s; --artifact %s is method %s, %d/%d bits, %g%% outliers, %s keys, fitted on "
                                "%s K / V",
                                spec->spec, need, set->path[want], set->a[want].p.method->name, set->a[want].p.k_bits,
                                set->a[want].p.v_bits, set->a[want].p.outlier_frac * 100,
                                set->a[want].p.post_rope ? "post-RoPE" : "pre-RoPE", rd);
            }
            pick = want;
        } else {
            /* first match; with +intactkv prefer a matching artifact that holds a prefix */
            for (size_t i = 0; i < n_art && pick < 0; i++)
                if (art_match(spec, &set->a[i].p) && (!spec->intactkv || set->prefix[i].P > 0)) pick = (int)i;
            for (size_t i = 0; i < n_art && pick < 0; i++)
                if (art_match(spec, &set->a[i].p)) pick = (int)i;
        }
        if (pick < 0) {
            /* a spec no artifact could serve (sizes against the model) names its rule, not the missing artifact */
            if (f->check_model) KVQ_TRY(f->check_model(&spec->q, spec->spec, hp, err));
            char seen[768] = "";
            for (size_t i = 0; i < n_art; i++) {
                const kvq_artifact_params *p = &set->a[i].p;
                char rd[80] = "";
                if (any_rot) {
                    rd[0] = ',';
                    rd[1] = ' ';
                    kvq_rotation_describe(&p->rotation, rd + 2, sizeof rd - 2);
                }
                size_t l = strlen(seen);
                if (l < sizeof seen)
                    snprintf(seen + l, sizeof seen - l, "%s%s (%s, %d/%d bits, %g%% outliers, %s%s)", i ? "; " : "", set->path[i],
                             p->method->name, p->k_bits, p->v_bits, p->outlier_frac * 100,
                             p->post_rope ? "post-RoPE" : "pre-RoPE", rd);
            }
            return kvq_fail(err, KVQ_EINVAL, "scheme '%s' needs %s; none of the %zu given matches: %s", spec->spec, need,
                            n_art, seen);
        }
        out->art = &set->a[pick];
        out->art_index = pick;
        out->art_path = set->path[pick];
        if (!spec->stage_set) out->s.key_stage = out->art->p.post_rope ? KVQ_KEYS_POST_ROPE : KVQ_KEYS_PRE_ROPE;
        if (!spec->sink_set) out->s.q.n_sink = out->art->p.n_sink;
        if (f->bind_params) f->bind_params(&out->s.q, &out->art->p);
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
                            "layers.<i>.intactkv.k/v; written by kvcalib intactkv); %s",
                            spec->spec, pick >= 0 ? "the selected --artifact has none" : n_art ? "no --artifact has one" : "no --artifact given");
        out->prefix = &set->prefix[pick];
        out->prefix_index = pick;
        /* refused here, before any work (the engine refused it inside the first window, losing every row) */
        const int C = f->chunk ? f->chunk(&out->s.q) : 0;
        if (C > 0)
            return kvq_fail(err, KVQ_EINVAL,
                            "scheme '%s': +intactkv: %s runs the window in steps of %d token%s, each attending the cache it built; "
                            "that cannot follow an IntactKV prefix", spec->spec, f->name, C, C == 1 ? "" : "s");
    }
    if (f->check_model) KVQ_TRY(f->check_model(&out->s.q, spec->spec, hp, err));
    out->desc = (kvq_kv_desc){.q = out->s.q, .key_stage = out->s.key_stage, .rot = spec->rot};
    if (out->art) {
        out->desc.layers = set->tables[out->art_index];
        out->desc.n_layers = (int)out->art->p.n_layers;
        out->desc.art = out->art;
    }
    if (!kvq_kv_desc_is_identity(&out->desc) && kvq_kv_desc_validate(&out->desc, hp, err))
        return kvq_err_prefix(err, "scheme '%s'%s%s", spec->spec, out->art ? ": --artifact " : "", out->art ? out->art_path : "");
    /* canonical name */
    f->format(&out->s.q, out->name, sizeof out->name);
    /* +sink<N> whenever a sink is held, and +sink0 where it overrides an artifact's sink: the name, given back as a spec
     * with the same artifacts, is the same scheme ("nuq3-1%+sink0" was named "nuq3-1%", which means the artifact's sink) */
    if (out->s.q.n_sink || (out->art && out->art->p.n_sink))
        append(out->name, sizeof out->name, "+sink", (long)out->s.q.n_sink);
    if (!f->stage_free && out->s.key_stage != f->default_stage)
        append(out->name, sizeof out->name, out->s.key_stage == KVQ_KEYS_PRE_ROPE ? "+pre-rope" : "+post-rope", -1);
    if (spec->rot.kind != KVQ_ROT_NONE) {
        char r[48];
        kvq_rotation_spec(&spec->rot, r, sizeof r);
        append(out->name, sizeof out->name, r, -1);
    }
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

bool kvq_eval_scheme_is_identity(const kvq_eval_scheme *s)
{
    return (!s->s.q.fam || kvq_kv_desc_is_identity(&s->desc)) && !s->prefix;
}

const kvq_kv_desc *kvq_eval_scheme_kv_desc(const kvq_eval_scheme *s)
{
    return s->s.q.fam && !kvq_kv_desc_is_identity(&s->desc) ? &s->desc : NULL;
}

const kvq_kv_desc *kvq_eval_scheme_gpu_desc(const kvq_eval_scheme *s)
{
    const kvq_kv_desc *d = kvq_eval_scheme_kv_desc(s);
    return kvq_kv_desc_cuda(d) ? d : NULL;
}

int kvq_eval_scheme_code_bits(const kvq_eval_scheme *s, char kv)
{
    const kvq_scheme *q = &s->s.q;
    if (q->fam->code_bits) return q->fam->code_bits(q, kv);
    return kv == 'k' ? q->k_bits : q->v_bits;
}

kvq_status kvq_eval_scheme_bits_run(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, const kvq_quant_counts *k,
                                    const kvq_quant_counts *v, kvq_bits *out, kvq_err *err)
{
    kvq_bits_in in = {.ctx = ctx, .kv_dim = (size_t)kvq_kv_dim(hp), .head_dim = (size_t)hp->head_dim,
                      .n_layers = (size_t)hp->n_layers, .k = k, .v = v};
    KVQ_TRY(kvq_scheme_bits_ex(&s->s.q, &in, out, err));
    if (s->prefix && s->prefix->P > 0) {
        double P = s->prefix->P, full = s->s.q.fam->identity ? 32.0 : 16.0;
        out->k = (out->k * (double)ctx + full * P) / ((double)ctx + P);
        out->v = (out->v * (double)ctx + full * P) / ((double)ctx + P);
        out->mean = (out->k + out->v) / 2;
    }
    return KVQ_OK;
}

kvq_status kvq_eval_scheme_bits(const kvq_eval_scheme *s, size_t ctx, const kvq_hparams *hp, kvq_bits *out,
                                kvq_err *err)
{
    return kvq_eval_scheme_bits_run(s, ctx, hp, NULL, NULL, out, err);
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
    if (kvq_kv_desc_is_identity(&run->s->desc)) return KVQ_OK;
    double t0 = kvq_now();
    kvq_kv_desc_run dr = {.d = &run->s->desc, .k_counts = run->k_counts, .v_counts = run->v_counts, .state = run->state};
    kvq_status s = kvq_kv_desc_transform(&dr, ctx, k, v, alt, err);
    run->k_counts = dr.k_counts;
    run->v_counts = dr.v_counts;
    run->state = dr.state;
    run->seconds += kvq_now() - t0;
    return s ? kvq_err_prefix(err, "scheme %s", run->s->name) : KVQ_OK;
}

static kvq_status scheme_cache(void *user, int P, kvq_prefix *out, kvq_err *err)
{
    kvq_scheme_run *run = user;
    kvq_kv_desc_run dr = {.d = &run->s->desc, .k_counts = run->k_counts, .v_counts = run->v_counts, .state = run->state};
    kvq_status s = kvq_kv_desc_cache(&dr, P, out, err);
    run->k_counts = dr.k_counts;
    run->v_counts = dr.v_counts;
    run->state = dr.state;
    return s ? kvq_err_prefix(err, "scheme %s", run->s->name) : KVQ_OK;
}

void kvq_scheme_hooks(kvq_scheme_run *run, const kvq_eval_scheme *s, kvq_hooks *hooks)
{
    memset(run, 0, sizeof *run);
    run->s = s;
    memset(hooks, 0, sizeof *hooks);
    hooks->user = run;
    hooks->transform = !kvq_kv_desc_is_identity(&s->desc) ? kvq_scheme_transform : NULL;
    hooks->key_stage = s->s.key_stage;
    hooks->chunk = kvq_kv_desc_chunk(&s->desc);
    if (hooks->chunk) hooks->cache = scheme_cache;
}

void kvq_scheme_run_free(kvq_scheme_run *run)
{
    if (!run || !run->state) return;
    kvq_kv_desc_run dr = {.d = &run->s->desc, .k_counts = run->k_counts, .v_counts = run->v_counts, .state = run->state};
    kvq_kv_desc_run_free(&dr); /* a family may add what it still held back (hh: the last layer's resting cache) */
    run->k_counts = dr.k_counts;
    run->v_counts = dr.v_counts;
    run->state = NULL;
}
