/* kveval — perplexity with the KV cache quantized by each scheme, side by side
 * with the unquantized (fp32) baseline of the same run. Thin main over
 * kernels/schemes/scheme.h and analysis/kveval/perplexity.h. Exit status: 0 success, 1 a
 * failure while running (bad input files, mismatched artifacts, numerics), 2
 * a bad command line (an unknown option or scheme, a scheme that cannot apply, --ctx beyond
 * the model's, a llama2.c model without --tokenizer). */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "artifact.h"
#include "cli.h"
#include "identity.h"
#include "cuda_info.h"
#include "decode_eval.h"
#include "model.h"
#include "passkey.h"
#include "pipeline.h"
#include "perplexity.h"
#include "progress.h"
#include "quant.h"
#include "scheme.h"
#include "text.h"
#include "tokenizer.h"

/* --help: the scheme forms come from the registry (kernels/schemes/family.h) */
static const char *summary_text(char *buf, size_t n)
{
    char syn[KVQ_SCHEME_SYNTAX_MAX];
    snprintf(buf, n,
             "measure perplexity with the KV cache quantized by each scheme, next to the fp32 baseline of the same run\n"
             "(same tokens, same windows). Schemes: %s.\n"
             "nuq, int-pc, fp8-tensor/-head and nvfp4-tensor read a kvcalib --artifact. llama.cpp formats and mxfp4 are\n"
             "skipped with a message for a head_dim that is not a multiple of 32 (nvfp4, fp4_mx_block16: of 16).\n"
             "Runs on a GPU when one is present (--device).\n"
             "Table on stdout, progress on stderr. The table adds DeltaPPL's paired standard error and the KL divergence of\n"
             "each scheme's next-token distribution from fp32's (mean, median, p99, same top token %%). On a GPU the device line\n"
             "gives each scheme's throughput: model FLOPs (2 x matmul parameters x tokens + causal attention) / seconds of\n"
             "its forward calls (model load excluded; LM head included); --gemm-rate adds its ratio to cuBLAS's GEMM rate.\n"
             "--task passkey: a number hidden in filler text at several lengths and depths, retrieved by greedy decoding\n"
             "with each scheme's cache (fp16 first).\n"
             "--task decode (or --decode): real token-by-token greedy decoding on the packed KV cache (nuq and kivi schemes\n"
             "of 2, 3 or 4 bits, one --scheme; CPU or GPU) from --prompts prompts of --prompt-len tokens, compared step by step with kveval's\n"
             "decode-equivalent simulation of the same scheme (CPU) teacher-forced on the decoded tokens; tokens/s and cache\n"
             "bytes.",
             kvq_scheme_syntax(syn, sizeof syn));
    return buf;
}

typedef struct {
    const char *model, *text, *format, *protocol, *newlines, *json, *tokenizer, *bos, *device, *devices, *math, *ctx_s, *weights;
    const char *task, *pk_lengths, *pk_depths, *prompt_file;
    long ctx, max_windows, pk_trials, seed, threads, n_prompts, prompt_len, steps, batch;
    bool decode, kv_fp16, no_sim, noise_floor, dequant_attn;
    bool ctx_max;
    kvq_strlist artifacts, schemes;
    bool quiet, version, allow_mismatch, fast, no_kld, gemm_rate;
} kveval_opts;

static int fail(const char *what, const kvq_err *e, int code)
{
    fprintf(stderr, "kveval: %s%s%s\n", what ? what : "", what ? ": " : "", e->msg);
    return code;
}

static kvq_status load_tokenizer(const kveval_opts *o, const kvq_model *m, kvq_tokenizer **tok, kvq_err *e)
{
    if (o->tokenizer) return kvq_tokenizer_load(o->tokenizer, tok, e);
    if (m->source == KVQ_SRC_GGUF) return kvq_tokenizer_from_gguf(o->model, tok, e);
    if (m->source == KVQ_SRC_SAFETENSORS) {
        char p[4200];
        snprintf(p, sizeof p, "%s/tokenizer.json", o->model);
        return kvq_tokenizer_from_hf_json(p, tok, e);
    }
    return kvq_fail(e, KVQ_EINVAL, "%s: a llama2.c model carries no tokenizer; pass --tokenizer FILE (tokenizer.bin)", o->model);
}

/* load_tokenizer's exit status: a llama2.c model without --tokenizer is a command-line error (2), a tokenizer that
 * fails to load a runtime one (1) */
static int tokenizer_rc(const kveval_opts *o, const kvq_model *m) { return !o->tokenizer && m->source == KVQ_SRC_LLAMA2C ? 2 : 1; }

/* "512,1024,max" → lengths (max = the model's context less the longest prefix); "0,50,100" → depths/100 */
static int parse_list(const char *what, const char *s, bool lengths, size_t max_len, size_t *len, double *dep, size_t *n)
{
    *n = 0;
    const char *p = s;
    while (*p) {
        if (*n == KVQ_PASSKEY_MAX) {
            fprintf(stderr, "kveval: %s: more than %d values\n", what, KVQ_PASSKEY_MAX);
            return 2;
        }
        char *end = NULL;
        if (lengths && !strncmp(p, "max", 3) && (p[3] == ',' || !p[3])) {
            len[(*n)++] = max_len;
            end = (char *)p + 3;
        } else {
            errno = 0;
            double v = strtod(p, &end);
            bool ok = end != p && !errno && (*end == ',' || !*end) &&
                      (lengths ? v >= 2 && v == floor(v) && v <= (double)max_len : v >= 0 && v <= 100);
            if (!ok) {
                fprintf(stderr, "kveval: %s: expected %s, found '%s'\n", what,
                        lengths ? "token counts of 2 or more (or max) within the model's context" : "percentages 0..100", p);
                return 2;
            }
            if (lengths) len[(*n)++] = (size_t)v;
            else dep[(*n)++] = v / 100;
        }
        for (size_t i = 0; i + 1 < *n; i++) /* a repeated value gave two identical columns */
            if (lengths ? len[i] == len[*n - 1] : dep[i] == dep[*n - 1]) {
                fprintf(stderr, "kveval: %s: %.*s given twice%s\n", what, (int)(end - p), p,
                        lengths && len[i] == max_len ? " (max is the model's context less the longest prefix)" : "");
                return 2;
            }
        if (*end == ',' && !end[1]) {
            fprintf(stderr, "kveval: %s: a value expected after the last comma of '%s'\n", what, s);
            return 2;
        }
        p = *end == ',' ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "kveval: %s: empty list\n", what);
        return 2;
    }
    return 0;
}

/* --task passkey: fp16 first (the reference), then the listed schemes (fp32 only when listed) */
static int run_passkey(const kveval_opts *o, const kvq_model *m, const kvq_artifact_set *arts, const kvq_scheme_spec *specs,
                       size_t n_spec, kvq_ppl_exec *exec)
{
    kvq_err e = {0};
    int rc = 1;
    kvq_tokenizer *tok = NULL;
    kvq_eval_scheme *sch = calloc(n_spec + 1, sizeof *sch);
    kvq_passkey_result res = {0};
    size_t n = 0;
    if (!sch) return 1;
    if (kvq_eval_scheme_make("fp16", arts, &m->hp, &sch[n++], &e)) { fail(NULL, &e, 1); goto done; }
    for (size_t i = 0; i < n_spec; i++) {
        kvq_eval_scheme b;
        kvq_status bs = kvq_eval_scheme_bind(&specs[i], arts, &m->hp, &b, &e);
        if (bs == KVQ_EUNSUPPORTED) {
            fprintf(stderr, "kveval: skipping: %s\n", e.msg);
            continue;
        }
        if (bs) { fail(NULL, &e, 1); goto done; }
        if (!strcmp(b.name, "fp16")) continue; /* already first */
        sch[n++] = b;
    }
    int max_p = 0;
    for (size_t i = 0; i < n; i++)
        if (sch[i].prefix && sch[i].prefix->P > max_p) max_p = sch[i].prefix->P;
    const size_t max_len = (size_t)(m->hp.ctx_len - max_p);
    kvq_passkey_opts po = {.trials = (size_t)o->pk_trials, .seed = (uint64_t)o->seed};
    char deflen[128];
    snprintf(deflen, sizeof deflen, "512,1024,2048,4096,max");
    if (!o->pk_lengths) { /* the defaults that fit the model, and its context */
        size_t k = 0;
        for (size_t l = 512; l < max_len && l <= 4096; l *= 2) k += (size_t)snprintf(deflen + k, sizeof deflen - k, "%zu,", l);
        snprintf(deflen + k, sizeof deflen - k, "max");
        if (max_len < 4096 && !o->quiet)
            fprintf(stderr, "kveval: passkey: default lengths %s (those of 512,1024,2048,4096 below the context of %zu, then max)\n",
                    deflen, max_len);
    }
    if ((rc = parse_list("--passkey-lengths", o->pk_lengths ? o->pk_lengths : deflen, true, max_len, po.lengths, NULL, &po.n_lengths)) ||
        (rc = parse_list("--passkey-depths", o->pk_depths ? o->pk_depths : "0,25,50,75,100", false, 0, NULL, po.depths, &po.n_depths)))
        goto done;
    rc = 1;
    if (load_tokenizer(o, m, &tok, &e)) { rc = fail("tokenizer", &e, tokenizer_rc(o, m)); goto done; }
    if (kvq_tokenizer_check_vocab(tok, m->hp.vocab_size, o->tokenizer ? o->tokenizer : o->model, &e)) { fail(NULL, &e, 1); goto done; }
    kvq_progress prog;
    kvq_progress_init(&prog, "kveval", "case-runs", (uint64_t)po.n_lengths * po.n_depths * po.trials * n, o->quiet);
    if (!o->quiet)
        fprintf(stderr, "kveval: passkey: %zu lengths x %zu depths x %zu trials x %zu schemes on %s\n", po.n_lengths, po.n_depths,
                po.trials, n, kvq_device_name(exec->device));
    if (kvq_passkey_run(exec, m, tok, sch, n, &po, &prog, &res, &e)) {
        if (!o->quiet && prog.drawn && prog.tty) fputc('\n', stderr);
        fail(NULL, &e, 1);
        goto done;
    }
    kvq_progress_finish(&prog);
    {
        kvq_err je = {0};
        const kvq_status js = o->json ? kvq_passkey_report_json(o->json, m, tok, &po, sch, &res, exec, &je) : KVQ_OK;
        const bool json_stdout = o->json && !strcmp(o->json, "-");
        FILE *tf = json_stdout ? stderr : stdout;
        const kvq_status ts = (!json_stdout || !o->quiet) ? kvq_passkey_report_table(tf, m, &po, sch, &res, exec, &e) : KVQ_OK;
        if (js) fail("--json", &je, 1);
        if (ts) fail(NULL, &e, 1);
        rc = js || ts ? 1 : 0;
    }
done:
    kvq_passkey_result_free(&res);
    if (tok) kvq_tokenizer_free(tok);
    free(sch);
    return rc;
}

/* --prompt-file: one prompt per non-empty line; P = prompt_len or the shortest; *out [n][P] */
static int read_prompt_file(const char *path, const kvq_tokenizer *tok, unsigned flags, long prompt_len, int **out, size_t *n,
                            size_t *P)
{
    kvq_err e = {0};
    kvq_text txt = {0};
    if (kvq_text_read(path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &txt, &e)) return fail(NULL, &e, 1);
    int32_t **ids = NULL;
    size_t *len = NULL, cap = 0, shortest = SIZE_MAX;
    int rc = 1;
    *n = 0;
    size_t lineno = 0;
    for (char *line = txt.data, *end; line < txt.data + txt.len; line = end + 1) {
        end = memchr(line, '\n', (size_t)(txt.data + txt.len - line));
        if (!end) end = txt.data + txt.len;
        lineno++;
        if (end == line) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int32_t **ni = realloc(ids, cap * sizeof *ids);
            size_t *nl = ni ? realloc(len, cap * sizeof *len) : NULL;
            if (ni) ids = ni;
            if (!ni || !nl) goto done;
            len = nl;
        }
        if (kvq_tokenizer_encode(tok, line, (size_t)(end - line), flags, &ids[*n], &len[*n], &e)) {
            fail(path, &e, 1);
            goto done;
        }
        if (prompt_len > 0 && len[*n] < (size_t)prompt_len) {
            fprintf(stderr, "kveval: %s: line %zu (prompt %zu, counted from 0 as in the report) has %zu tokens, --prompt-len asks "
                            "for %ld\n", path, lineno, *n, len[*n], prompt_len);
            (*n)++;
            rc = 2;
            goto done;
        }
        if (len[*n] < shortest) shortest = len[*n];
        (*n)++;
    }
    if (*n == 0) {
        fprintf(stderr, "kveval: %s: no prompt (every line is empty)\n", path);
        goto done;
    }
    *P = prompt_len > 0 ? (size_t)prompt_len : shortest;
    *out = malloc(*n * *P * sizeof **out);
    if (!*out) goto done;
    for (size_t i = 0; i < *n; i++)
        for (size_t t = 0; t < *P; t++) (*out)[i * *P + t] = ids[i][t];
    rc = 0;
done:
    for (size_t i = 0; i < *n; i++) free(ids[i]);
    free(ids);
    free(len);
    kvq_text_free(&txt);
    return rc;
}

/* --task decode: one scheme, prompts from --text or --prompt-file, the packed cache on the CPU or the GPU */
static int run_decode(const kveval_opts *o)
{
    kvq_err e = {0};
    if (o->schemes.n != 1) {
        fprintf(stderr, "kveval: --task decode takes exactly one --scheme (found %d)\n", o->schemes.n);
        return 2;
    }
    if (o->text && o->prompt_file) {
        fprintf(stderr, "kveval: --text and --prompt-file both give the decode's prompts; give one of them\n");
        return 2;
    }
    if (!o->text && !o->prompt_file) {
        fprintf(stderr, "kveval: --task decode needs the prompts from --text FILE or --prompt-file FILE\n");
        return 2;
    }
    const char *unused = o->pk_lengths || o->pk_depths || o->pk_trials != 1 ? "--passkey-*" : o->ctx_s ? "--ctx"
                         : o->max_windows ? "--max-windows" : o->no_kld ? "--no-kld" : o->gemm_rate ? "--gemm-rate"
                         : o->devices ? "--devices" : (o->prompt_file && o->n_prompts != 3) ? "--prompts (with --prompt-file)"
                         : strcmp(o->protocol, "kvquant") ? "--protocol (the prompts are cut as the kvquant protocol does)"
                         : o->newlines ? "--newlines" : o->seed ? "--seed"
                         : o->fast || o->math ? "--fast / --math (the decode's forward runs in its exact mode)"
                                              : NULL;
    if (unused) {
        fprintf(stderr, "kveval: %s does not apply to --task decode\n", unused);
        return 2;
    }
    { /* the JSON output must be writable and replace no input */
        kvq_cli_file outs[1] = {{"--json", o->json}},
                     ins[3 + KVQ_STRLIST_MAX] = {{"--model", o->model}, {"--text", o->text}, {"--tokenizer", o->tokenizer},
                                                 {"--prompt-file", o->prompt_file}};
        int n_in = 4;
        for (int i = 0; i < o->artifacts.n && n_in < 3 + KVQ_STRLIST_MAX; i++) ins[n_in++] = (kvq_cli_file){"--artifact", o->artifacts.v[i]};
        if (kvq_cli_check_outputs(outs, 1, ins, n_in, &e)) return fail(NULL, &e, 2);
    }
    kvq_scheme_spec spec;
    if (kvq_scheme_parse(o->schemes.v[0], &spec, &e)) return fail(NULL, &e, 2);
    kvq_device dev;
    int gpu = 0;
    if (kvq_device_parse(o->device ? o->device : "auto", &dev, &gpu, &e)) return fail(NULL, &e, e.code == KVQ_EINVAL ? 2 : 1);
    if (dev == KVQ_DEVICE_CUDA && o->dequant_attn) {
        if (o->device) {
            fprintf(stderr, "kveval: --dequant-attn (a diagnostic) runs on the CPU only; use --device cpu\n");
            return 2;
        }
        dev = KVQ_DEVICE_CPU; /* auto */
    }
    if (o->no_sim && o->noise_floor) {
        fprintf(stderr, "kveval: --noise-floor compares simulations; it contradicts --no-sim\n");
        return 2;
    }
    const size_t steps = (size_t)o->steps;
    int rc = 1;
    kvq_model m = {0};
    kvq_tokenizer *tok = NULL;
    kvq_artifact_set arts = {0};
    kvq_text txt = {0};
    kvq_windows win = {0};
    kvq_decode_result res = {0};
    int *prompts = NULL;
    size_t n_prompts = 0, P = 0;
    char fp[65];
    {
        kvq_load_opts lo = {.weights = KVQ_WEIGHTS_AUTO};
        if (o->weights && kvq_weights_parse(o->weights, "--weights", &lo.weights, &e)) { rc = fail(NULL, &e, 2); goto out; }
        if (kvq_model_load_opts(o->model, &lo, &m, &e)) { fail("model", &e, 1); goto out; }
        if (!o->quiet) fprintf(stderr, "kveval: weights: %s\n", m.weights_desc);
    }
    /* the rules the spec alone decides, before any artifact is read (a +rht scheme is refused for the cache's lack of
     * rotation, not for a missing rotated artifact) */
    if (kvq_decoder_spec_check(&spec, o->schemes.v[0], &m.hp, &e)) { rc = fail(NULL, &e, 2); goto out; }
    if (o->artifacts.n > 0) {
        if (kvq_identity_model(&m, fp, &e)) { fail("model fingerprint", &e, 1); goto out; }
        if (kvq_artifact_set_load(&arts, o->artifacts.v, (size_t)o->artifacts.n, &m, fp, o->allow_mismatch, stderr, &e)) {
            fail(NULL, &e, 1);
            goto out;
        }
    }
    kvq_eval_scheme sch;
    if (kvq_eval_scheme_bind(&spec, &arts, &m.hp, &sch, &e)) { fail(NULL, &e, 1); goto out; }
    kvq_kvcache_config cfg0;
    /* the cache refuses before any text is read */
    if (kvq_decoder_cache_config(&sch, &m.hp, 0, &cfg0, &e)) { rc = fail(NULL, &e, e.code == KVQ_EUNSUPPORTED ? 2 : 1); goto out; }
    if (load_tokenizer(o, &m, &tok, &e)) { rc = fail("tokenizer", &e, tokenizer_rc(o, &m)); goto out; }
    if (kvq_tokenizer_check_vocab(tok, m.hp.vocab_size, o->tokenizer ? o->tokenizer : o->model, &e)) { fail(NULL, &e, 1); goto out; }
    kvq_bos_policy bos = !strcmp(o->bos, "always") ? KVQ_BOS_ALWAYS : !strcmp(o->bos, "never") ? KVQ_BOS_NEVER : KVQ_BOS_MODEL;
    if (o->prompt_file) {
        unsigned fl = bos == KVQ_BOS_ALWAYS ? KVQ_TOK_ADD_BOS : bos == KVQ_BOS_MODEL ? KVQ_TOK_ADD_BOS_DEFAULT : 0;
        const int pr = read_prompt_file(o->prompt_file, tok, fl, o->prompt_len, &prompts, &n_prompts, &P);
        if (pr) {
            rc = pr;
            goto out;
        }
    } else {
        P = o->prompt_len ? (size_t)o->prompt_len : 64;
        n_prompts = (size_t)o->n_prompts;
        if (P < 2) {
            fprintf(stderr, "kveval: --prompt-len %zu: prompts cut from --text need at least 2 tokens (one prompt token: "
                            "--prompt-file)\n", P);
            rc = 2;
            goto out;
        }
        kvq_text_format fmt = !o->format ? kvq_text_format_from_path(o->text)
                              : !strcmp(o->format, "jsonl") ? KVQ_TEXT_JSONL
                              : !strcmp(o->format, "wikitext-tokens") ? KVQ_TEXT_WIKITEXT_TOKENS
                                                                       : KVQ_TEXT_RAW;
        if (kvq_text_read(o->text, fmt, KVQ_EOL_TO_LF, &txt, &e)) { fail("text", &e, 1); goto out; }
        if (P + steps - 1 > (size_t)m.hp.ctx_len) {
            fprintf(stderr, "kveval: --prompt-len %zu and --steps %zu need %zu positions, beyond the context length of %s (%d)\n", P,
                    steps, P + steps - 1, o->model, m.hp.ctx_len);
            rc = 2;
            goto out;
        }
        if (kvq_ppl_windows(&txt, tok, KVQ_PPL_KVQUANT, P, bos, &win, &e)) { fail("text", &e, 1); goto out; }
        if (win.n_windows < n_prompts) {
            fprintf(stderr, "kveval: %s holds %zu prompts of %zu tokens, --prompts asks for %zu\n", o->text, win.n_windows, P, n_prompts);
            goto out;
        }
        prompts = malloc(n_prompts * P * sizeof *prompts);
        if (!prompts) goto out;
        for (size_t i = 0; i < n_prompts * P; i++) prompts[i] = win.tokens[i];
    }
    if (P + steps - 1 > (size_t)m.hp.ctx_len) {
        fprintf(stderr, "kveval: prompts of %zu tokens and --steps %zu need %zu positions, beyond the context length of %s (%d)\n",
                P, steps, P + steps - 1, o->model, m.hp.ctx_len);
        rc = 2;
        goto out;
    }
    if (sch.s.q.n_sink >= P + steps - 1) {
        fprintf(stderr, "kveval: scheme %s: %zu attention-sink tokens for %zu positions (the prompt and the steps); expected "
                        "fewer sink tokens than positions\n", sch.name, sch.s.q.n_sink, P + steps - 1);
        rc = 2;
        goto out;
    }
    if (cfg0.format == KVQ_KVCACHE_KIVI && cfg0.residual >= P + steps - 1)
        fprintf(stderr, "kveval: warning: %s: its fp16 residual of %zu tokens holds all %zu positions: the cache quantizes "
                        "nothing (KIVI quantizes a token once it leaves the residual window)\n", sch.name, cfg0.residual, P + steps - 1);
    if ((size_t)o->batch > n_prompts) { /* was cut to the prompts' count without a word */
        fprintf(stderr, "kveval: --batch %ld: only %zu prompts to decode together (--prompts, or the --prompt-file's lines)\n",
                o->batch, n_prompts);
        rc = 2;
        goto out;
    }
    kvq_decode_opts dopt = {.steps = steps, .batch = (size_t)o->batch, .no_sim = o->no_sim,
                            .noise_floor = o->noise_floor, .dev = dev, .gpu = gpu,
                            .fwd_flags = (o->kv_fp16 ? KVQ_DECODE_KV_FP16 : 0u) | (o->dequant_attn ? KVQ_DECODE_DEQUANT_ATTN : 0u)};
    const size_t nb = (n_prompts + dopt.batch - 1) / dopt.batch;
    kvq_progress prog;
    kvq_progress_init(&prog, "kveval", "steps", (uint64_t)nb * (P + steps - 1), o->quiet);
    if (!o->quiet)
        fprintf(stderr, "kveval: decode: %s, %zu prompts x %zu tokens, %zu steps, batch %zu, on %s\n", sch.name, n_prompts, P,
                steps, dopt.batch, dev == KVQ_DEVICE_CUDA ? "the GPU" : "the CPU");
    if (kvq_decode_eval(&m, &sch, prompts, n_prompts, P, &dopt, &prog, &res, &e)) {
        if (!o->quiet && prog.drawn && prog.tty) fputc('\n', stderr);
        rc = fail(NULL, &e, e.code == KVQ_EUNSUPPORTED ? 2 : 1);
        goto out;
    }
    kvq_progress_finish(&prog);
    {
        kvq_err je = {0};
        const kvq_status js = o->json ? kvq_decode_report_json(o->json, &m, tok, &sch, &res, prompts, &je) : KVQ_OK;
        const bool json_stdout = o->json && !strcmp(o->json, "-");
        FILE *tf = json_stdout ? stderr : stdout;
        const kvq_status ts = (!json_stdout || !o->quiet) ? kvq_decode_report_table(tf, &m, tok, &sch, &res, &e) : KVQ_OK;
        if (js) fail("--json", &je, 1);
        if (ts) fail(NULL, &e, 1);
        rc = js || ts ? 1 : 0;
    }
out:
    kvq_decode_result_free(&res);
    free(prompts);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_artifact_set_free(&arts);
    if (tok) kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return rc;
}

int main(int argc, char **argv)
{
    signal(SIGXFSZ, SIG_IGN); /* past a file-size limit writes fail with EFBIG (reported, cleaned up) instead of killing us */
    kveval_opts o = {.protocol = "kvquant", .bos = "model", .ctx = 0, .max_windows = 0, .task = NULL, .pk_trials = 1,
                     .n_prompts = 3, .steps = 256, .batch = 1};
    kvq_opt tab[] = {
        kvq_cli_common(KVQ_COPT_MODEL, &o.model, true),
        kvq_cli_common(KVQ_COPT_TEXT, &o.text, false),
        {"task", 0, KVQ_OPT_CHOICE, &o.task, "T",
         "ppl: perplexity, KL divergence and top-1 agreement over --text; passkey: retrieval of a number hidden in "
         "filler text at several lengths and depths (greedy, decode-equivalent; fp16 first); decode: real greedy decoding "
         "on the packed KV cache against the simulation (see below); default ppl",
         "ppl|passkey|decode", 0, 0, false},
        {"passkey-lengths", 0, KVQ_OPT_STRING, &o.pk_lengths, "L,...",
         "passkey window lengths in tokens, or max (the model's context), each once [default 512,1024,2048,4096,max: those below the context]", NULL, 0, 0, false},
        {"passkey-depths", 0, KVQ_OPT_STRING, &o.pk_depths, "D,...",
         "passkey depths in percent of the filler before the key [default 0,25,50,75,100]", NULL, 0, 0, false},
        {"passkey-trials", 0, KVQ_OPT_INT, &o.pk_trials, "N", "passkey keys per length and depth", NULL, 1, 1000, false},
        {"seed", 0, KVQ_OPT_INT, &o.seed, "S", "passkey keys: random.seed(S)", NULL, 0, 1L << 31, false},
        {"decode", 0, KVQ_OPT_FLAG, &o.decode, NULL, "= --task decode", NULL, 0, 0, false},
        {"prompt-file", 0, KVQ_OPT_STRING, &o.prompt_file, "FILE",
         "decode: one prompt per non-empty line, each cut to its first --prompt-len tokens (default: the shortest "
         "prompt's length); instead of --text", NULL, 0, 0, false},
        {"prompts", 0, KVQ_OPT_INT, &o.n_prompts, "N", "decode: prompts cut from --text, consecutive windows", NULL, 1, 4096,
         false},
        {"prompt-len", 0, KVQ_OPT_INT, &o.prompt_len, "P",
         "decode: prompt tokens (BOS included); 0: 64 with --text, the shortest prompt's length with --prompt-file", NULL, 0,
         1 << 24, false},
        {"steps", 0, KVQ_OPT_INT, &o.steps, "S", "decode: generated tokens per prompt", NULL, 1, 1 << 24, false},
        {"batch", 0, KVQ_OPT_INT, &o.batch, "B", "decode: prompts decoded together in one cache (its `seq`)", NULL, 1, 65536,
         false},
        {"kv-fp16", 0, KVQ_OPT_FLAG, &o.kv_fp16, NULL,
         "decode: round the model's keys and values to fp16 in the decode and the simulation alike, as an fp16 model's "
         "cache holds them (the packed cache keeps sink rows, outliers and KIVI's residual in fp16)", NULL, 0, 0, false},
        {"no-sim", 0, KVQ_OPT_FLAG, &o.no_sim, NULL, "decode: skip the simulation (tokens/s and bytes only)", NULL, 0, 0, false},
        {"dequant-attn", 0, KVQ_OPT_FLAG, &o.dequant_attn, NULL,
         "decode, a diagnostic (CPU): attend with the forward's fp32 attention over the cache's dequantized contents instead "
         "of the cache's decode attention (in double): the cache's bits without its attention arithmetic", NULL, 0, 0, false},
        {"noise-floor", 0, KVQ_OPT_FLAG, &o.noise_floor, NULL,
         "decode: also run the simulation with the other GEMM order and report how far it moves from itself (float "
         "rounding alone flips quantization codes, which cascade over the layers)", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_FORMAT, &o.format, false),
        {"protocol", 0, KVQ_OPT_CHOICE, &o.protocol, "P",
         "kvquant: windows of ctx, all but the first position scored; llamacpp: BOS first, second half scored",
         "kvquant|llamacpp", 0, 0, false},
        {"newlines", 0, KVQ_OPT_CHOICE, &o.newlines, "NL",
         "line ends of the text: keep the file's bytes (CRLF stays CRLF) or turn every CRLF into LF; default: as the "
         "protocol's tool reads them (llamacpp keep, kvquant lf)",
         "keep|lf", 0, 0, false},
        {"ctx", 'c', KVQ_OPT_STRING, &o.ctx_s, "N|max",
         "window length in tokens; max = the model's trained context (less the longest IntactKV prefix); "
         "0 or absent = min(2048, that)",
         NULL, 0, 0, false},
        {"max-windows", 'w', KVQ_OPT_INT, &o.max_windows, "W", "evaluate at most the first W windows (0 = all)", NULL, 0,
         1 << 30, false},
        {"artifact", 'a', KVQ_OPT_LIST, &o.artifacts, "FILE", "kvcalib artifact (repeatable; +artifact<N> picks the N-th)",
         NULL, 0, 0, false},
        {"scheme", 's', KVQ_OPT_LIST, &o.schemes, "SPEC", "KV-cache scheme (repeatable); fp32 baseline always included", NULL,
         0, 0, true},
        {"json", 0, KVQ_OPT_STRING, &o.json, "FILE",
         "also write the results and protocol details as JSON ('-' = stdout; the table then goes to stderr)", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_TOKENIZER, &o.tokenizer, false),
        {"bos", 0, KVQ_OPT_CHOICE, &o.bos, "POLICY", "BOS: as the model's tokenizer says, always or never", "model|always|never",
         0, 0, false},
        {"allow-model-mismatch", 0, KVQ_OPT_FLAG, &o.allow_mismatch, NULL,
         "load artifacts whose model fingerprint differs (warning instead of error)", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_DEVICE, &o.device, false),
        kvq_cli_common(KVQ_COPT_DEVICES, &o.devices, false),
        {"fast", 0, KVQ_OPT_FLAG, &o.fast, NULL,
         "GPU fast mode: TF32 tensor cores for the GEMMs (~1e-3 relative; labelled in the output); = --math tf32", NULL,
         0, 0, false},
        kvq_cli_common(KVQ_COPT_MATH, &o.math, false),
        {"no-kld", 0, KVQ_OPT_FLAG, &o.no_kld, NULL,
         "skip the KL divergence and top-1 agreement against the fp32 baseline (they cost one more LM-head GEMM per "
         "window in the baseline's run)",
         NULL, 0, 0, false},
        {"gemm-rate", 0, KVQ_OPT_FLAG, &o.gemm_rate, NULL,
         "GPU: measure cuBLAS's GEMM rate in the --math mode (8192^3, median of 7; bf16: bf16 inputs, fp32 accumulation) "
         "before the windows and give each scheme's throughput as a fraction of it (device line, JSON)",
         NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_WEIGHTS, &o.weights, false),
        kvq_cli_common(KVQ_COPT_THREADS, &o.threads, false),
        kvq_cli_common(KVQ_COPT_QUIET, &o.quiet, false),
        kvq_cli_common(KVQ_COPT_VERSION, &o.version, false),
    };
    int n_tab = (int)(sizeof tab / sizeof *tab);
    kvq_err e = {0};
    bool help = false;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--version")) {
            kvq_cli_print_version(stdout, "kveval", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
            return 0;
        }
    char summary[4096];
    if (kvq_cli_parse("kveval", summary_text(summary, sizeof summary), tab, n_tab, argc, argv, NULL, &help, &e))
        return fail(NULL, &e, 2);
    if (help) return 0;
    if (o.threads > 0) omp_set_num_threads((int)o.threads);
    if (o.decode) {
        if (o.task && strcmp(o.task, "decode")) {
            fprintf(stderr, "kveval: --decode contradicts --task %s\n", o.task);
            return 2;
        }
        o.task = "decode";
    }
    if (!o.task) o.task = "ppl";
    const bool decode = !strcmp(o.task, "decode");
    if (decode) return run_decode(&o);
    if (o.prompt_file || o.n_prompts != 3 || o.prompt_len || o.steps != 256 || o.batch != 1 || o.kv_fp16 || o.no_sim ||
        o.noise_floor || o.dequant_attn) {
        fprintf(stderr, "kveval: --prompt-file, --prompts, --prompt-len, --steps, --batch, --kv-fp16, --no-sim, --noise-floor "
                        "and --dequant-attn apply to --task decode only\n");
        return 2;
    }
    const bool passkey = !strcmp(o.task, "passkey");
    if (!passkey && !o.text) {
        fprintf(stderr, "kveval: missing required option --text (the perplexity task's text)\n");
        return 2;
    }
    if (!passkey && (o.pk_lengths || o.pk_depths || o.pk_trials != 1)) {
        fprintf(stderr, "kveval: --passkey-* options apply to --task passkey only\n");
        return 2;
    }
    if (passkey) { /* the perplexity task's options would be ignored silently */
        const char *unused = o.text ? "--text" : o.format ? "--format" : o.newlines ? "--newlines" : o.ctx_s ? "--ctx"
                             : o.max_windows ? "--max-windows" : o.no_kld ? "--no-kld" : o.gemm_rate ? "--gemm-rate"
                             : strcmp(o.protocol, "kvquant") ? "--protocol"
                                                             : NULL;
        if (unused) {
            fprintf(stderr, "kveval: %s applies to --task ppl, not to --task passkey (its lengths: --passkey-lengths)\n", unused);
            return 2;
        }
    }
    if (o.ctx_s) { /* an integer, or max (the model's trained context) */
        char *end = NULL;
        errno = 0;
        o.ctx_max = !strcmp(o.ctx_s, "max");
        o.ctx = o.ctx_max ? 0 : strtol(o.ctx_s, &end, 10);
        if (!o.ctx_max && (!*o.ctx_s || *end || errno || o.ctx < 0 || o.ctx > (1L << 24))) {
            fprintf(stderr, "kveval: --ctx: expected an integer in 0..%ld or max, found '%s'\n", 1L << 24, o.ctx_s);
            return 2;
        }
    }
    /* the files read: the model first (its loader reports it), then the text, tokenizer and artifacts */
    kvq_cli_file ins[3 + KVQ_STRLIST_MAX] = {{"--model", o.model}, {"--text", o.text}, {"--tokenizer", o.tokenizer}};
    int n_in = 3;
    for (int i = 0; i < o.artifacts.n && n_in < 3 + KVQ_STRLIST_MAX; i++) ins[n_in++] = (kvq_cli_file){"--artifact", o.artifacts.v[i]};
    { /* the JSON output must be writable and replace no input (it used to overwrite --text or --tokenizer) */
        kvq_cli_file outs[1] = {{"--json", o.json}};
        if (kvq_cli_check_outputs(outs, 1, ins, n_in, &e)) return fail(NULL, &e, 2);
    }

    /* schemes first: a typo fails before anything heavy is loaded */
    size_t n_spec = (size_t)o.schemes.n;
    kvq_scheme_spec *specs = calloc(n_spec, sizeof *specs);
    if (!specs) return 1;
    for (size_t i = 0; i < n_spec; i++)
        if (kvq_scheme_parse(o.schemes.v[i], &specs[i], &e)) {
            free(specs);
            return fail(NULL, &e, 2);
        }

    /* --devices: several GPUs are the pipeline by layers; one is today's single-GPU path (--device cuda:N) */
    char one_gpu[32];
    int dev_ids[KVQ_PIPE_MAX_DEV], n_dev = 0;
    if (o.devices) {
        if (kvq_devices_resolve(o.devices, o.device, dev_ids, KVQ_PIPE_MAX_DEV, &n_dev, one_gpu, sizeof one_gpu, &e)) {
            free(specs);
            return fail(NULL, &e, e.code == KVQ_EINVAL ? 2 : 1);
        }
        o.device = n_dev == 1 ? one_gpu : "cuda";
    }
    /* device: a bad name fails before loading; cuda without a GPU fails here too */
    kvq_ppl_exec exec = {0};
    if (n_dev > 1) { /* the pipeline over several GPUs (forward only) */
        exec.n_gpus = n_dev;
        memcpy(exec.gpus, dev_ids, (size_t)n_dev * sizeof *dev_ids);
    }
    if (kvq_device_parse(o.device ? o.device : "auto", &exec.device, &exec.gpu, &e)) {
        free(specs);
        return fail(NULL, &e, e.code == KVQ_EINVAL ? 2 : 1);
    }
    exec.auto_device = !o.device || !strcmp(o.device, "auto");
    if (exec.auto_device) {
        char why[256] = "";
        if (exec.device == KVQ_DEVICE_CPU && kvq_cuda_compiled() && !o.quiet && kvq_cuda_device_count(why, sizeof why) == 0)
            fprintf(stderr, "kveval: --device auto: no usable GPU (%s); running on the CPU\n", why);
    }
    if (o.fast && o.math && strcmp(o.math, "tf32")) {
        fprintf(stderr, "kveval: --fast means --math tf32; it contradicts --math %s\n", o.math);
        free(specs);
        return 2;
    }
    if (o.fast || (o.math && strcmp(o.math, "exact"))) {
        kvq_cuda_math mm = KVQ_CUDA_TF32;
        if (o.math && kvq_cuda_math_parse(o.math, "--math", &mm, &e)) {
            free(specs);
            return fail(NULL, &e, 2);
        }
        if (exec.device == KVQ_DEVICE_CUDA) exec.math = mm;
        else if (!o.quiet) fprintf(stderr, "kveval: --fast / --math apply to the GPU only; the CPU runs exact fp32\n");
    }
    exec.gemm_rate = o.gemm_rate;
    if (o.gemm_rate && exec.device != KVQ_DEVICE_CUDA && !o.quiet)
        fprintf(stderr, "kveval: --gemm-rate applies to the GPU only; nothing measured\n");
    { /* after the command line's own checks (exit 2), before the model is loaded: the inputs readable (a missing
       * --text was reported after the load); stat and access, never open: a FIFO would block (the loaders refuse
       * what is not a regular file) */
        for (int i = 1; i < n_in; i++) {
            struct stat sb;
            if (ins[i].path && (stat(ins[i].path, &sb) != 0 || (S_ISREG(sb.st_mode) && access(ins[i].path, R_OK) != 0))) {
                fprintf(stderr, "kveval: %s %s: cannot open: %s\n", ins[i].opt, ins[i].path, strerror(errno));
                free(specs);
                return 1;
            }
        }
    }

    int rc = 1;
    kvq_model m = {0};
    kvq_tokenizer *tok = NULL;
    kvq_artifact_set arts = {0};
    kvq_text txt = {0};
    kvq_windows win = {0};
    kvq_eval_scheme *sch = NULL;
    kvq_ppl_result *res = NULL;
    size_t n_sch = 0, baseline = 0, n_skip = 0;
    char **skip = calloc(n_spec ? n_spec : 1, sizeof *skip);
    if (!skip) { free(specs); return 1; }
    char fp[65] = "";
    bool have_fp = false;

    {
        kvq_load_opts lo = {.weights = KVQ_WEIGHTS_AUTO};
        if (o.weights && kvq_weights_parse(o.weights, "--weights", &lo.weights, &e)) { rc = fail(NULL, &e, 2); goto out; }
        if (kvq_model_load_opts(o.model, &lo, &m, &e)) { fail("model", &e, 1); goto out; }
        if (!o.quiet) fprintf(stderr, "kveval: weights: %s\n", m.weights_desc);
    }
    if (o.ctx > m.hp.ctx_len) {
        fprintf(stderr, "kveval: --ctx %ld exceeds the context length of %s (%d tokens)\n", o.ctx, o.model, m.hp.ctx_len);
        rc = 2;
        goto out;
    }
    if (o.ctx == 1) {
        fprintf(stderr, "kveval: --ctx 1: expected >= 2\n");
        rc = 2;
        goto out;
    }
    if (o.artifacts.n > 0) {
        if (kvq_identity_model(&m, fp, &e)) { fail("model fingerprint", &e, 1); goto out; }
        have_fp = true;
        if (kvq_artifact_set_load(&arts, o.artifacts.v, (size_t)o.artifacts.n, &m, fp, o.allow_mismatch, stderr, &e)) {
            fail(NULL, &e, 1);
            goto out;
        }
    }
    if (passkey) {
        rc = run_passkey(&o, &m, &arts, specs, n_spec, &exec);
        goto out;
    }

    /* bind; the fp32 baseline comes first unless the user listed it */
    sch = calloc(n_spec + 1, sizeof *sch);
    if (!sch) goto out;
    for (size_t i = 0; i < n_spec; i++) {
        kvq_status bs = kvq_eval_scheme_bind(&specs[i], &arts, &m.hp, &sch[n_sch], &e);
        if (bs == KVQ_EUNSUPPORTED) { /* does not apply to this model (llama.cpp block size): skip, keep the others */
            fprintf(stderr, "kveval: skipping: %s\n", e.msg);
            skip[n_skip] = strdup(e.msg);
            if (!skip[n_skip]) goto out;
            n_skip++;
            continue;
        }
        if (bs) { fail(NULL, &e, 1); goto out; }
        n_sch++;
    }
    {
        int b = -1;
        for (size_t i = 0; i < n_sch && b < 0; i++)
            if (kvq_eval_scheme_is_identity(&sch[i])) b = (int)i;
        if (b < 0) {
            memmove(sch + 1, sch, n_sch * sizeof *sch);
            if (kvq_eval_scheme_make("fp32", &arts, &m.hp, &sch[0], &e)) { fail(NULL, &e, 1); goto out; }
            n_sch++;
            b = 0;
        }
        baseline = (size_t)b;
    }
    for (size_t i = 0; i < arts.n && !o.quiet; i++) { /* an artifact no scheme reads was passed over without a word */
        bool used = false;
        for (size_t j = 0; j < n_sch && !used; j++) used = sch[j].art_index == (int)i || sch[j].prefix_index == (int)i;
        if (!used) fprintf(stderr, "kveval: note: --artifact %s: no --scheme reads it\n", arts.path[i]);
    }
    /* the window length: an IntactKV prefix of P tokens sits before every window, so P + ctx must fit
     * the model's context; the default leaves room for the longest prefix (it was min(2048, context),
     * which failed on a 128-token model with any prefix) */
    size_t ctx;
    {
        int max_p = 0;
        const char *pname = NULL;
        for (size_t i = 0; i < n_sch; i++)
            if (sch[i].prefix && sch[i].prefix->P > max_p) { max_p = sch[i].prefix->P; pname = sch[i].name; }
        const size_t room = max_p < m.hp.ctx_len ? (size_t)(m.hp.ctx_len - max_p) : 0;
        if (o.ctx && (size_t)o.ctx > room) {
            fprintf(stderr, "kveval: --ctx %ld: scheme %s puts an IntactKV prefix of %d tokens before each window, and %d + %ld exceeds "
                            "the context length of %s (%d tokens); use --ctx <= %zu\n",
                    o.ctx, pname, max_p, max_p, o.ctx, o.model, m.hp.ctx_len, room);
            goto out;
        }
        ctx = o.ctx_max ? room : o.ctx ? (size_t)o.ctx : room < 2048 ? room : 2048;
        if (ctx < 2) {
            fprintf(stderr, "kveval: scheme %s: its IntactKV prefix of %d tokens leaves %zu of the context length of %s (%d tokens) "
                            "for a window (expected >= 2)\n",
                    pname, max_p, room, o.model, m.hp.ctx_len);
            goto out;
        }
    }
    /* a scheme that would quantize nothing in a window of ctx tokens (sink tokens covering it, or
     * KIVI's fp16 residual holding every key and value) reported "+0.0000" as if it were lossless */
    for (size_t i = 0; i < n_sch; i++) {
        const kvq_scheme *q = &sch[i].s.q;
        if (kvq_eval_scheme_is_identity(&sch[i])) continue;
        const size_t ns = q->n_sink, last = ctx - 1;
        char why[160] = "";
        if (ns >= ctx)
            snprintf(why, sizeof why, "its %zu attention-sink tokens cover the window of %zu", ns, ctx);
        else if (sch[i].desc.q.fam->alt_bounds) { /* a window the family's alternative never reaches (KIVI's residual) */
            int *kb = malloc(2 * ctx * sizeof *kb);
            if (!kb) {
                fprintf(stderr, "kveval: out of memory\n");
                goto out;
            }
            kvq_kv_desc_alt_bounds(&sch[i].desc, ctx, kb, kb + ctx);
            if (kb[last] <= (int)ns && kb[ctx + last] <= (int)ns)
                snprintf(why, sizeof why, "residual length %zu%s keeps every key and value of the window of %zu in fp16", q->residual,
                         ns ? " after its sink tokens" : "", ctx);
            free(kb);
        }
        if (*why) {
            fprintf(stderr, "kveval: scheme %s quantizes nothing at ctx %zu: %s; use a longer --ctx or a smaller sink/residual\n",
                    sch[i].name, ctx, why);
            rc = 2;
            goto out;
        }
        /* the family's own rule (check_ctx: a window covering the context); kvq_ppl_run applies it too */
        const kvq_family *f = sch[i].desc.q.fam;
        if (f->check_ctx && f->check_ctx(&sch[i].desc.q, sch[i].name, ctx, &e)) {
            rc = fail(NULL, &e, 2);
            goto out;
        }
    }

    if (load_tokenizer(&o, &m, &tok, &e)) { rc = fail("tokenizer", &e, tokenizer_rc(&o, &m)); goto out; }
    if (kvq_tokenizer_check_vocab(tok, m.hp.vocab_size, o.tokenizer ? o.tokenizer : o.model, &e)) { fail(NULL, &e, 1); goto out; }
    kvq_text_format fmt = !o.format ? kvq_text_format_from_path(o.text)
                          : !strcmp(o.format, "jsonl") ? KVQ_TEXT_JSONL
                          : !strcmp(o.format, "wikitext-tokens") ? KVQ_TEXT_WIKITEXT_TOKENS
                                                                 : KVQ_TEXT_RAW;
    kvq_ppl_protocol proto = !strcmp(o.protocol, "llamacpp") ? KVQ_PPL_LLAMACPP : KVQ_PPL_KVQUANT;
    const kvq_eol_mode eol = !o.newlines ? kvq_ppl_default_eol(proto) : !strcmp(o.newlines, "keep") ? KVQ_EOL_KEEP : KVQ_EOL_TO_LF;
    if (kvq_text_read(o.text, fmt, eol, &txt, &e)) { fail("text", &e, 1); goto out; }
    if (txt.bad_bytes && !o.quiet)
        fprintf(stderr, "kveval: warning: %s: %zu byte%s NUL or invalid UTF-8 (the first at offset %llu); tokenised as byte tokens\n",
                o.text, txt.bad_bytes, txt.bad_bytes == 1 ? " is" : "s are", (unsigned long long)txt.first_bad);
    kvq_bos_policy bos = !strcmp(o.bos, "always") ? KVQ_BOS_ALWAYS : !strcmp(o.bos, "never") ? KVQ_BOS_NEVER : KVQ_BOS_MODEL;
    if (kvq_ppl_windows(&txt, tok, proto, ctx, bos, &win, &e)) { fail("text", &e, 1); goto out; }
    kvq_ppl_plan plan;
    if (kvq_ppl_plan_make(&win, proto, (size_t)o.max_windows, &plan, &e)) { fail(o.text, &e, 1); goto out; }

    res = calloc(n_sch, sizeof *res);
    if (!res) goto out;
    exec.kld = !o.no_kld && n_sch > 1;
    exec.kld_baseline = baseline;
    kvq_progress prog;
    kvq_progress_init(&prog, "kveval", "window-runs", (uint64_t)plan.n_windows * n_sch, o.quiet);
    if (!o.quiet)
        fprintf(stderr, "kveval: %zu windows x %zu schemes at ctx %zu (%s protocol, %zu scored tokens per window) on %s, %s\n",
                plan.n_windows, n_sch, ctx, kvq_ppl_protocol_name(proto), plan.scored_per_window, kvq_device_name(exec.device),
                kvq_ppl_exec_mode(&exec));
    if (kvq_ppl_run_on(&exec, &m, &win, &plan, sch, n_sch, &prog, res, &e)) {
        if (!o.quiet && prog.drawn && prog.tty) fputc('\n', stderr);
        fail(NULL, &e, 1);
        goto out;
    }
    kvq_progress_finish(&prog);
    if (exec.note[0] && !o.quiet) fprintf(stderr, "kveval: --device auto: %s\n", exec.note);

    kvq_ppl_report rep = {.m = &m, .model_fingerprint = have_fp ? fp : NULL, .win = &win, .ctx_max = o.ctx_max,
                          .text_format = kvq_text_format_name(fmt), .bos_policy = o.bos, .plan = &plan, .arts = &arts,
                          .schemes = sch, .results = res, .n_schemes = n_sch, .baseline = baseline,
                          .skipped = (const char *const *)skip, .n_skipped = n_skip, .exec = &exec};
    /* the results exist now: each report is written whatever happens to the other (a JSON that cannot be
     * written still leaves the table, and the other way round), and any failure is exit 1 */
    {
        kvq_err je = {0};
        const kvq_status js = o.json ? kvq_ppl_report_json(o.json, &rep, &je) : KVQ_OK;
        /* with --json - stdout carries the JSON alone: the table goes to stderr (not with --quiet) */
        const bool json_stdout = o.json && !strcmp(o.json, "-");
        FILE *tf = json_stdout ? stderr : stdout;
        const kvq_status ts = (!json_stdout || !o.quiet) ? kvq_ppl_report_table(tf, &rep, &e) : KVQ_OK;
        /* saturated values and outlier fractions far above the nominal: on stderr too (also under --quiet) */
        if (tf != stderr || o.quiet) kvq_ppl_report_warnings(stderr, &rep, "kveval: warning: ");
        if (js) fail("--json", &je, 1);
        if (ts) fail(NULL, &e, 1);
        rc = js || ts ? 1 : 0;
    }
out:
    if (res) kvq_ppl_results_free(res, n_sch);
    free(res);
    free(sch);
    free(specs);
    for (size_t i = 0; i < n_skip; i++) free(skip[i]);
    free(skip);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_artifact_set_free(&arts);
    if (tok) kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return rc;
}
