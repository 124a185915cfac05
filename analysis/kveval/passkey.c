/* passkey.c — the passkey retrieval task; see passkey.h. */
#include "passkey.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "outfile.h"
#include "text.h"
#include "version.h"

static const char TASK[] = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                           "I will quiz you about the important information there.";
static const char *const FILLER[5] = {"The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                                      "There and back again."};
static const char QUESTION[] = "What is the pass key? The pass key is";

/* The prompt with F filler sentences, `before` of them ahead of the key line; *key_off: the byte where the key
 * line starts. Returns malloc'd text (NULL: out of memory). */
static char *prompt_text(size_t F, size_t before, const char *key, size_t *key_off)
{
    size_t cap = sizeof TASK + sizeof QUESTION + 128 + 32 * F, n = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    n += (size_t)snprintf(s + n, cap - n, "%s\n", TASK);
    for (size_t i = 0; i < before; i++) n += (size_t)snprintf(s + n, cap - n, "%s%s", i ? " " : "", FILLER[i % 5]);
    n += (size_t)snprintf(s + n, cap - n, "\n");
    *key_off = n;
    n += (size_t)snprintf(s + n, cap - n, "The pass key is %s. Remember it. %s is the pass key.\n", key, key);
    for (size_t i = before; i < F; i++) n += (size_t)snprintf(s + n, cap - n, "%s%s", i > before ? " " : "", FILLER[i % 5]);
    snprintf(s + n, cap - n, "\n%s", QUESTION);
    return s;
}

/* Tokens of the prompt with F sentences and of its answer. */
static kvq_status build(const kvq_tokenizer *tok, size_t F, double depth, const char *key, kvq_passkey_case *c, kvq_err *err)
{
    size_t before = (size_t)llround(depth * (double)F), koff;
    if (before > F) before = F;
    char *p = prompt_text(F, before, key, &koff);
    if (!p) return kvq_fail(err, KVQ_ENOMEM, "passkey: out of memory");
    const size_t pl = strlen(p);
    char *full = malloc(pl + strlen(key) + 2);
    if (!full) {
        free(p);
        return kvq_fail(err, KVQ_ENOMEM, "passkey: out of memory");
    }
    snprintf(full, pl + strlen(key) + 2, "%s %s", p, key);
    int32_t *pid = NULL, *fid = NULL, *kid = NULL;
    size_t np = 0, nf = 0, nk = 0;
    kvq_status s = kvq_tokenizer_encode(tok, p, pl, KVQ_TOK_ADD_BOS_DEFAULT, &pid, &np, err);
    if (!s) s = kvq_tokenizer_encode(tok, full, strlen(full), KVQ_TOK_ADD_BOS_DEFAULT, &fid, &nf, err);
    if (!s) s = kvq_tokenizer_encode(tok, p, koff, KVQ_TOK_ADD_BOS_DEFAULT, &kid, &nk, err);
    if (!s) {
        size_t common = 0;
        while (common < np && common < nf && pid[common] == fid[common]) common++;
        if (common == nf || common == 0) s = kvq_fail(err, KVQ_EINVAL, "passkey: the answer \" %s\" adds no token to the prompt", key);
        else if (nf - common > KVQ_PASSKEY_MAX_ANSWER)
            s = kvq_fail(err, KVQ_EUNSUPPORTED, "passkey: the answer \" %s\" takes %zu tokens, more than %d", key, nf - common,
                         KVQ_PASSKEY_MAX_ANSWER);
        free(c->tokens);
        c->tokens = fid;
        fid = NULL;
        c->n = nf;
        c->n_prompt = common;
        c->n_answer = nf - common;
        c->n_filler = F;
        c->key_token = nk;
    }
    free(pid);
    free(fid);
    free(kid);
    free(p);
    free(full);
    return s;
}

kvq_status kvq_passkey_make(const kvq_tokenizer *tok, size_t length, double depth, const char *key, kvq_passkey_case *c,
                            kvq_err *err)
{
    memset(c, 0, sizeof *c);
    c->length = length;
    c->depth = depth;
    snprintf(c->key, sizeof c->key, "%s", key);
    if (!(depth >= 0 && depth <= 1)) return kvq_fail(err, KVQ_EINVAL, "passkey: depth %g, expected 0..1", depth);
    KVQ_TRY(build(tok, 0, depth, key, c, err));
    if (c->n > length) {
        const size_t need = c->n;
        kvq_passkey_case_free(c);
        return kvq_fail(err, KVQ_EINVAL, "passkey: a window of %zu tokens is too short: the prompt and answer without filler take %zu",
                        length, need);
    }
    size_t lo = 0, hi = length; /* every sentence is at least one token: F <= length */
    while (lo < hi) {            /* the largest F whose window fits */
        size_t mid = lo + (hi - lo + 1) / 2;
        kvq_status s = build(tok, mid, depth, key, c, err);
        if (s) {
            kvq_passkey_case_free(c);
            return s;
        }
        if (c->n <= length) lo = mid;
        else hi = mid - 1;
    }
    kvq_status s = build(tok, lo, depth, key, c, err);
    if (s) kvq_passkey_case_free(c);
    return s;
}

void kvq_passkey_case_free(kvq_passkey_case *c)
{
    free(c->tokens);
    c->tokens = NULL;
}

void kvq_passkey_result_free(kvq_passkey_result *r)
{
    for (size_t i = 0; r->cases && i < r->n_cases; i++) kvq_passkey_case_free(&r->cases[i]);
    free(r->cases);
    free(r->out);
    memset(r, 0, sizeof *r);
}

static bool starts_with_digit(const kvq_tokenizer *tok, int32_t id)
{
    char *t = NULL;
    size_t n = 0;
    if (kvq_tokenizer_decode(tok, &id, 1, KVQ_TOK_KEEP_LEADING_SPACE, &t, &n, NULL) != KVQ_OK) return false;
    bool d = n > 0 && t[0] >= '0' && t[0] <= '9';
    free(t);
    return d;
}

/* One scheme on one case: the top tokens of the answer rows and the row after the last digit. */
static kvq_status run_case(kvq_engine *e, const kvq_tokenizer *tok, const kvq_eval_scheme *sc, bool native,
                           const kvq_passkey_case *c, int *targets, int *argmax, kvq_passkey_outcome *out, kvq_err *err)
{
    const size_t n = c->n;
    for (size_t t = 0; t < n; t++) targets[t] = -1;
    for (size_t t = c->n_prompt - 1; t + 1 < n; t++) targets[t] = c->tokens[t + 1];
    targets[n - 1] = c->tokens[n - 1]; /* any valid id: the row is scored for its top token only */
    kvq_scheme_run run;
    kvq_hooks hooks;
    kvq_scheme_hooks(&run, sc, &hooks);
    if (native) hooks.transform = NULL;
    kvq_prefix px = {0};
    if (sc->prefix) px = (kvq_prefix){.P = sc->prefix->P, .k = sc->prefix->k, .v = sc->prefix->v};
    kvq_fwd_head head = {.argmax = argmax};
    kvq_fwd_io io = {.tokens = (const int *)c->tokens, .T = (int)n, .pos0 = px.P, .targets = targets,
                     .prefix = sc->prefix ? &px : NULL, .hooks = hooks.transform ? &hooks : NULL, .head = &head};
    kvq_fwd_result r;
    kvq_status st = kvq_engine_run(e, &io, &r, err);
    if (st) return st;
    memset(out, 0, sizeof *out);
    out->first_wrong = -1;
    for (size_t j = 0; j <= KVQ_PASSKEY_MAX_ANSWER; j++) out->top[j] = j <= c->n_answer ? argmax[c->n_prompt - 1 + j] : -1;
    size_t j = 0;
    for (; j < c->n_answer; j++)
        if (argmax[c->n_prompt - 1 + j] != c->tokens[c->n_prompt + j]) break;
    if (j < c->n_answer) out->first_wrong = (int)j;
    else if (starts_with_digit(tok, argmax[n - 1])) out->first_wrong = (int)c->n_answer;
    out->correct = out->first_wrong < 0;
    /* what it wrote: the greedy tokens up to the first wrong one */
    const size_t upto = out->correct ? c->n_answer : (size_t)out->first_wrong + 1;
    int32_t got[64];
    size_t ng = 0;
    for (size_t k = 0; k < upto && ng < 64; k++) got[ng++] = argmax[c->n_prompt - 1 + k];
    char *txt = NULL;
    size_t tl = 0;
    if (ng && kvq_tokenizer_decode(tok, got, ng, KVQ_TOK_KEEP_LEADING_SPACE, &txt, &tl, NULL) == KVQ_OK)
        snprintf(out->got, sizeof out->got, "%.*s", (int)(tl < sizeof out->got ? tl : sizeof out->got - 1), txt);
    free(txt);
    return KVQ_OK;
}

kvq_status kvq_passkey_run(kvq_ppl_exec *x, const kvq_model *m, const kvq_tokenizer *tok, const kvq_eval_scheme *schemes,
                           size_t n_schemes, const kvq_passkey_opts *o, kvq_progress *prog, kvq_passkey_result *res,
                           kvq_err *err)
{
    memset(res, 0, sizeof *res);
    int max_P = 0, step_P = 0;
    for (size_t s = 0; s < n_schemes; s++)
        if (schemes[s].prefix && schemes[s].prefix->P > max_P) max_P = schemes[s].prefix->P;
    size_t max_len = 0;
    for (size_t i = 0; i < o->n_lengths; i++) {
        if (o->lengths[i] + (size_t)max_P > (size_t)m->hp.ctx_len)
            return kvq_fail(err, KVQ_EINVAL, "passkey: length %zu%s exceeds the model's context length %d", o->lengths[i],
                            max_P ? " after an IntactKV prefix" : "", m->hp.ctx_len);
        if (o->lengths[i] > max_len) max_len = o->lengths[i];
        for (size_t s = 0; s < n_schemes; s++) /* windows in steps attend the earlier steps as a prefix */
            if (kvq_kv_desc_chunk(&schemes[s].desc) > 0 && (int)o->lengths[i] > step_P) step_P = (int)o->lengths[i];
        /* a scheme's rules against the window (a recent window longer than it), before any work */
        for (size_t s = 0; s < n_schemes; s++) {
            const kvq_family *f = schemes[s].desc.q.fam;
            if (f && f->check_ctx && f->check_ctx(&schemes[s].desc.q, schemes[s].name, o->lengths[i], err))
                return kvq_err_prefix(err, "passkey: length %zu", o->lengths[i]);
        }
    }
    res->n_schemes = n_schemes;
    res->n_cases = o->n_lengths * o->n_depths * o->trials;
    res->cases = calloc(res->n_cases ? res->n_cases : 1, sizeof *res->cases);
    res->out = calloc((res->n_cases ? res->n_cases : 1) * n_schemes, sizeof *res->out);
    if (!res->cases || !res->out) {
        kvq_passkey_result_free(res);
        return kvq_fail(err, KVQ_ENOMEM, "passkey: out of memory");
    }
    kvq_pyrandom rng;
    kvq_pyrandom_seed(&rng, o->seed);
    kvq_status st = KVQ_OK;
    size_t ci = 0;
    for (size_t li = 0; !st && li < o->n_lengths; li++)
        for (size_t di = 0; !st && di < o->n_depths; di++)
            for (size_t t = 0; !st && t < o->trials; t++, ci++) {
                char key[16];
                snprintf(key, sizeof key, "%lld", (long long)kvq_pyrandom_randint(&rng, 10000, 99999));
                st = kvq_passkey_make(tok, o->lengths[li], o->depths[di], key, &res->cases[ci], err);
            }
    if (st) {
        kvq_passkey_result_free(res);
        return st;
    }
    kvq_device dev = x ? x->device : KVQ_DEVICE_CPU;
    kvq_engine e;
    st = x && x->n_gpus > 1
             ? kvq_engine_init_pipe(&e, x->gpus, x->n_gpus, x->math, m, (int)max_len, max_P > step_P ? max_P : step_P, o->engine_flags, NULL, 0, err)
             : kvq_engine_init_fallback(&e, dev, x && x->auto_device, x ? x->gpu : 0, x ? x->math : KVQ_CUDA_EXACT, m, (int)max_len,
                                        max_P > step_P ? max_P : step_P, o->engine_flags, x ? x->note : NULL, x ? sizeof x->note : 0, err);
    if (st) {
        kvq_passkey_result_free(res);
        return st;
    }
    dev = e.dev;
    if (x && dev != x->device) {
        x->device = dev;
        x->math = KVQ_CUDA_EXACT;
    }
    if (x) kvq_engine_describe(&e, x->described, sizeof x->described);
    int *targets = malloc(max_len * sizeof *targets), *argmax = malloc(max_len * sizeof *argmax);
    if (!targets || !argmax) st = kvq_fail(err, KVQ_ENOMEM, "passkey: out of memory");
    const double t0 = kvq_now();
    uint64_t done = 0;
    for (size_t c = 0; !st && c < res->n_cases; c++)
        for (size_t s = 0; !st && s < n_schemes; s++) {
            const kvq_kv_desc *d = dev == KVQ_DEVICE_CUDA ? kvq_eval_scheme_gpu_desc(&schemes[s]) : NULL;
            if (dev == KVQ_DEVICE_CUDA) st = kvq_engine_set_kv(&e, d, err);
            if (!st)
                st = run_case(&e, tok, &schemes[s], d != NULL, &res->cases[c], targets, argmax, &res->out[c * n_schemes + s], err);
            if (st) {
                kvq_err_prefix(err, "passkey: scheme %s, length %zu, depth %g", schemes[s].name, res->cases[c].length,
                               res->cases[c].depth);
                break;
            }
            if (prog) kvq_progress_update(prog, ++done);
        }
    if (!st && dev == KVQ_DEVICE_CUDA) st = kvq_engine_set_kv(&e, NULL, err);
    res->seconds = kvq_now() - t0;
    free(targets);
    free(argmax);
    kvq_engine_free(&e);
    if (st) kvq_passkey_result_free(res);
    return st;
}

/* ---- reports --------------------------------------------------------------------- */

/* correct / total of scheme s over the cases of length index li (li < 0: every length with keep[li]) */
static void tally(const kvq_passkey_opts *o, const kvq_passkey_result *r, size_t s, long li, long di, const bool *keep,
                  size_t *ok, size_t *n)
{
    *ok = *n = 0;
    size_t c = 0;
    for (size_t l = 0; l < o->n_lengths; l++)
        for (size_t d = 0; d < o->n_depths; d++)
            for (size_t t = 0; t < o->trials; t++, c++) {
                if (li >= 0 && (size_t)li != l) continue;
                if (li < 0 && keep && !keep[l]) continue;
                if (di >= 0 && (size_t)di != d) continue;
                (*n)++;
                *ok += r->out[c * r->n_schemes + s].correct;
            }
}

/* lengths where the reference (scheme 0) retrieves at least half of the keys */
static void summary_lengths(const kvq_passkey_opts *o, const kvq_passkey_result *r, bool *keep)
{
    for (size_t l = 0; l < o->n_lengths; l++) {
        size_t ok, n;
        tally(o, r, 0, (long)l, -1, NULL, &ok, &n);
        keep[l] = 2 * ok >= n && n > 0;
    }
}

kvq_status kvq_passkey_report_table(FILE *f, const kvq_model *m, const kvq_passkey_opts *o, const kvq_eval_scheme *schemes,
                                    const kvq_passkey_result *r, const kvq_ppl_exec *x, kvq_err *err)
{
    bool keep[KVQ_PASSKEY_MAX];
    summary_lengths(o, r, keep);
    fprintf(f, "- model: `%s` (%d layers, %d KV heads x head_dim %d, context %d)\n", m->path, m->hp.n_layers, m->hp.n_kv_heads,
            m->hp.head_dim, m->hp.ctx_len);
    fprintf(f, "- task: passkey retrieval (Landmark Attention's prompt: a 5-digit key in filler text, asked for at the end), "
               "greedy, decode-equivalent with each scheme's cache; %zu depths (",
            o->n_depths);
    for (size_t d = 0; d < o->n_depths; d++) fprintf(f, "%s%g%%", d ? ", " : "", 100 * o->depths[d]);
    fprintf(f, ") x %zu trial%s per length, keys from seed %llu\n", o->trials, o->trials == 1 ? "" : "s",
            (unsigned long long)o->seed);
    if (x)
        fprintf(f, "- device: %s, %s: %s; %.1f s\n", kvq_device_name(x->device), kvq_ppl_exec_mode(x), x->described, r->seconds);
    fprintf(f, "\n| scheme |");
    for (size_t l = 0; l < o->n_lengths; l++) fprintf(f, " %zu |", o->lengths[l]);
    fprintf(f, " summary |\n|---|");
    for (size_t l = 0; l <= o->n_lengths; l++) fprintf(f, "---:|");
    fputc('\n', f);
    for (size_t s = 0; s < r->n_schemes; s++) {
        fprintf(f, "| %s |", schemes[s].name);
        for (size_t l = 0; l < o->n_lengths; l++) {
            size_t ok, n;
            tally(o, r, s, (long)l, -1, NULL, &ok, &n);
            fprintf(f, " %zu/%zu |", ok, n);
        }
        size_t ok, n;
        tally(o, r, s, -1, -1, keep, &ok, &n);
        if (n) fprintf(f, " %.0f%% (%zu/%zu) |\n", 100.0 * (double)ok / (double)n, ok, n);
        else fprintf(f, " — |\n");
    }
    fprintf(f, "\n| scheme (summary lengths) |");
    for (size_t d = 0; d < o->n_depths; d++) fprintf(f, " depth %g%% |", 100 * o->depths[d]);
    fprintf(f, "\n|---|");
    for (size_t d = 0; d < o->n_depths; d++) fprintf(f, "---:|");
    fputc('\n', f);
    for (size_t s = 0; s < r->n_schemes; s++) {
        fprintf(f, "| %s |", schemes[s].name);
        for (size_t d = 0; d < o->n_depths; d++) {
            size_t ok, n;
            tally(o, r, s, -1, (long)d, keep, &ok, &n);
            if (n) fprintf(f, " %zu/%zu |", ok, n);
            else fprintf(f, " — |");
        }
        fputc('\n', f);
    }
    bool any = false;
    for (size_t l = 0; l < o->n_lengths; l++) any |= !keep[l];
    fprintf(f, "\n- summary: over the lengths where %s retrieves at least half of the keys", r->n_schemes ? schemes[0].name : "-");
    if (any) {
        fprintf(f, "; %s cannot do it at", r->n_schemes ? schemes[0].name : "-");
        for (size_t l = 0, k = 0; l < o->n_lengths; l++)
            if (!keep[l]) fprintf(f, "%s %zu", k++ ? "," : "", o->lengths[l]);
        fprintf(f, " tokens: left out");
    }
    fputc('\n', f);
    if (fflush(f) != 0 || ferror(f)) return kvq_fail(err, KVQ_EIO, "cannot write the table");
    return KVQ_OK;
}

kvq_status kvq_passkey_report_json(const char *path, const kvq_model *m, const kvq_tokenizer *tok, const kvq_passkey_opts *o,
                                   const kvq_eval_scheme *schemes, const kvq_passkey_result *r, const kvq_ppl_exec *x,
                                   kvq_err *err)
{
    bool keep[KVQ_PASSKEY_MAX];
    summary_lengths(o, r, keep);
    cJSON *root = kvq_kveval_json_head("kvq.kveval.passkey", KVQ_JSON_PASSKEY_VERSION, "passkey", m);
    cJSON_AddStringToObject(root, "tokenizer", kvq_tokenizer_describe(tok));
    cJSON *oj = cJSON_AddObjectToObject(root, "options");
    cJSON *lj = cJSON_AddArrayToObject(oj, "lengths"), *dj = cJSON_AddArrayToObject(oj, "depths");
    for (size_t l = 0; l < o->n_lengths; l++) cJSON_AddItemToArray(lj, cJSON_CreateNumber((double)o->lengths[l]));
    for (size_t d = 0; d < o->n_depths; d++) cJSON_AddItemToArray(dj, cJSON_CreateNumber(o->depths[d]));
    cJSON_AddNumberToObject(oj, "trials", (double)o->trials);
    cJSON_AddNumberToObject(oj, "seed", (double)o->seed);
    cJSON_AddStringToObject(oj, "reference", r->n_schemes ? schemes[0].name : "");
    cJSON *sl = cJSON_AddArrayToObject(oj, "summary_lengths");
    for (size_t l = 0; l < o->n_lengths; l++)
        if (keep[l]) cJSON_AddItemToArray(sl, cJSON_CreateNumber((double)o->lengths[l]));
    if (x) {
        cJSON *d = cJSON_AddObjectToObject(root, "device");
        cJSON_AddStringToObject(d, "name", kvq_device_name(x->device));
        cJSON_AddStringToObject(d, "description", x->described);
    }
    cJSON *ss = cJSON_AddArrayToObject(root, "schemes");
    for (size_t s = 0; s < r->n_schemes; s++) {
        cJSON *so = cJSON_CreateObject();
        cJSON_AddStringToObject(so, "name", schemes[s].name);
        size_t ok, n;
        tally(o, r, s, -1, -1, keep, &ok, &n);
        cJSON_AddNumberToObject(so, "summary_correct", (double)ok);
        cJSON_AddNumberToObject(so, "summary_cases", (double)n);
        cJSON *pl = cJSON_AddArrayToObject(so, "by_length");
        for (size_t l = 0; l < o->n_lengths; l++) {
            tally(o, r, s, (long)l, -1, NULL, &ok, &n);
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "length", (double)o->lengths[l]);
            cJSON_AddNumberToObject(e, "correct", (double)ok);
            cJSON_AddNumberToObject(e, "cases", (double)n);
            cJSON_AddItemToArray(pl, e);
        }
        cJSON_AddItemToArray(ss, so);
    }
    cJSON *cs = cJSON_AddArrayToObject(root, "cases");
    for (size_t c = 0; c < r->n_cases; c++) {
        const kvq_passkey_case *k = &r->cases[c];
        cJSON *co = cJSON_CreateObject();
        cJSON_AddNumberToObject(co, "length", (double)k->length);
        cJSON_AddNumberToObject(co, "depth", k->depth);
        cJSON_AddStringToObject(co, "key", k->key);
        cJSON_AddNumberToObject(co, "tokens", (double)k->n);
        cJSON_AddNumberToObject(co, "prompt_tokens", (double)k->n_prompt);
        cJSON_AddNumberToObject(co, "answer_tokens", (double)k->n_answer);
        cJSON_AddNumberToObject(co, "filler_sentences", (double)k->n_filler);
        cJSON_AddNumberToObject(co, "key_line_token", (double)k->key_token);
        cJSON *res = cJSON_AddObjectToObject(co, "results");
        for (size_t s = 0; s < r->n_schemes; s++) {
            const kvq_passkey_outcome *oc = &r->out[c * r->n_schemes + s];
            cJSON *e = cJSON_AddObjectToObject(res, schemes[s].name);
            cJSON_AddBoolToObject(e, "correct", oc->correct);
            cJSON_AddStringToObject(e, "wrote", oc->got);
            if (!oc->correct) cJSON_AddNumberToObject(e, "first_wrong_step", oc->first_wrong);
        }
        cJSON_AddItemToArray(cs, co);
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text) return kvq_fail(err, KVQ_ENOMEM, "%s: cannot build the JSON report", path);
    kvq_status st = kvq_outfile_write_text(path, text, err);
    free(text);
    return st;
}
