/* kveval — perplexity with the KV cache quantized by each scheme, side by side
 * with the unquantized (fp32) baseline of the same run. Thin main over
 * analysis/kveval/scheme.h and analysis/kveval/perplexity.h. Exit status: 0 success, 1 a
 * failure while running (bad input files, mismatched artifacts, numerics), 2
 * a bad command line (unknown option or scheme). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact.h"
#include "cli.h"
#include "identity.h"
#include "cuda_info.h"
#include "model.h"
#include "perplexity.h"
#include "progress.h"
#include "quant.h"
#include "scheme.h"
#include "text.h"
#include "tokenizer.h"

#define SUMMARY                                                                                                          \
    "measure perplexity with the KV cache quantized by each scheme, next to the fp32 baseline of the same run\n"        \
    "(same tokens, same windows). Schemes: fp32, fp16, int<b>[-g<G>], int<b>-pc[-<f>%], kivi<b>[-g<G>][-r<R>]\n"        \
    "(G=32, R=128 by default), nuq<b>[-<f>%], fp8, e5m2, {fp8,e5m2}-{tensor,head}[-p<P>] (vLLM FP8 cache),\n"     \
    "q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl (llama.cpp); modifiers +sink<N>, +pre-rope, +post-rope, +intactkv,\n"       \
    "+artifact<N>. nuq, int-pc and fp8-tensor/-head read a kvcalib --artifact. llama.cpp formats are skipped\n"       \
    "with a message for a head_dim that is not a multiple of 32. Runs on a GPU when one is present (--device).\n"      \
    "Table on stdout, progress on stderr."

typedef struct {
    const char *model, *text, *format, *protocol, *json, *tokenizer, *bos, *device, *math, *weights;
    long ctx, max_windows;
    kvq_strlist artifacts, schemes;
    bool quiet, version, allow_mismatch, fast;
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

int main(int argc, char **argv)
{
    kveval_opts o = {.protocol = "kvquant", .bos = "model", .ctx = 0, .max_windows = 0};
    kvq_opt tab[] = {
        {"model", 'm', KVQ_OPT_STRING, &o.model, "PATH", "model (GGUF, HF directory or llama2.c .bin)", NULL, 0, 0, true},
        {"text", 't', KVQ_OPT_STRING, &o.text, "FILE", "evaluation text", NULL, 0, 0, true},
        {"format", 0, KVQ_OPT_CHOICE, &o.format, "FMT", "text format (default: from the file name)", "raw|wikitext-tokens|jsonl",
         0, 0, false},
        {"protocol", 0, KVQ_OPT_CHOICE, &o.protocol, "P",
         "kvquant: windows of ctx, all but the first position scored; llamacpp: BOS first, second half scored",
         "kvquant|llamacpp", 0, 0, false},
        {"ctx", 'c', KVQ_OPT_INT, &o.ctx, "N", "window length in tokens (0 = min(2048, model context - the longest IntactKV prefix))",
         NULL, 0, 1 << 24, false},
        {"max-windows", 'w', KVQ_OPT_INT, &o.max_windows, "W", "evaluate at most the first W windows (0 = all)", NULL, 0,
         1 << 30, false},
        {"artifact", 'a', KVQ_OPT_LIST, &o.artifacts, "FILE", "kvcalib artifact (repeatable; +artifact<N> picks the N-th)",
         NULL, 0, 0, false},
        {"scheme", 's', KVQ_OPT_LIST, &o.schemes, "SPEC", "KV-cache scheme (repeatable); fp32 baseline always included", NULL,
         0, 0, true},
        {"json", 'j', KVQ_OPT_STRING, &o.json, "FILE",
         "also write the results and protocol details as JSON ('-' = stdout; the table then goes to stderr)", NULL, 0, 0, false},
        {"tokenizer", 0, KVQ_OPT_STRING, &o.tokenizer, "FILE", "tokenizer (default: the model's own)", NULL, 0, 0, false},
        {"bos", 0, KVQ_OPT_CHOICE, &o.bos, "POLICY", "BOS: as the model's tokenizer says, always or never", "model|always|never",
         0, 0, false},
        {"allow-model-mismatch", 0, KVQ_OPT_FLAG, &o.allow_mismatch, NULL,
         "load artifacts whose model fingerprint differs (warning instead of error)", NULL, 0, 0, false},
        {"device", 0, KVQ_OPT_STRING, &o.device, "DEV",
         "where the model runs: cpu, cuda, cuda:N (GPU N) or auto (default: cuda when a GPU is present, else cpu)", NULL, 0, 0,
         false},
        {"fast", 0, KVQ_OPT_FLAG, &o.fast, NULL,
         "GPU fast mode: TF32 tensor cores for the GEMMs (~1e-3 relative; labelled in the output); = --math tf32", NULL,
         0, 0, false},
        {"math", 0, KVQ_OPT_CHOICE, &o.math, "M",
         "GPU arithmetic: exact (fp32 weights, TF32 off), tf32, or bf16 (bf16 weights and GEMM inputs, fp32 accumulation, "
         "~1e-2 relative); fast modes are labelled in the output [default exact]",
         "exact|tf32|bf16", 0, 0, false},
        {"weights", 0, KVQ_OPT_CHOICE, &o.weights, "W",
         "how the weight matrices are held: f32 (exact), bf16, f16, native (as stored in the file: GGUF blocks, "
         "bf16/f16 safetensors; lossless) or auto (f32 up to 6 GiB of fp32 matrices, else native with fp32 files as bf16); "
         "arithmetic is fp32 [default auto]", "auto|f32|bf16|f16|native", 0, 0, false},
        {"quiet", 'q', KVQ_OPT_FLAG, &o.quiet, NULL, "no progress on stderr", NULL, 0, 0, false},
        {"version", 0, KVQ_OPT_FLAG, &o.version, NULL, "print the kvq version and build (CPU/CUDA)", NULL, 0, 0, false},
    };
    int n_tab = (int)(sizeof tab / sizeof *tab);
    kvq_err e = {0};
    bool help = false;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--version")) {
            printf("kveval (kvq) 0.1.0, %s build\n", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
            return 0;
        }
    if (kvq_cli_parse("kveval", SUMMARY, tab, n_tab, argc, argv, NULL, &help, &e)) return fail(NULL, &e, 2);
    if (help) return 0;
    { /* the JSON output must be writable and replace no input (it used to overwrite --text or --tokenizer) */
        kvq_cli_file outs[1] = {{"--json", o.json}}, ins[2 + KVQ_STRLIST_MAX] = {{"--model", o.model}, {"--text", o.text}, {"--tokenizer", o.tokenizer}};
        int n_in = 3;
        for (int i = 0; i < o.artifacts.n && n_in < 2 + KVQ_STRLIST_MAX; i++) ins[n_in++] = (kvq_cli_file){"--artifact", o.artifacts.v[i]};
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

    /* device: a bad name fails before loading; cuda without a GPU fails here too */
    kvq_ppl_exec exec = {0};
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
        ctx = o.ctx ? (size_t)o.ctx : room < 2048 ? room : 2048;
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
        else if (q->kind == KVQ_SCHEME_KIVI && kvq_kivi_key_boundary(last, q->group, q->residual, ns) <= ns &&
                 kvq_kivi_value_boundary(last, q->residual, ns) <= ns)
            snprintf(why, sizeof why, "residual length %zu%s keeps every key and value of the window of %zu in fp16", q->residual,
                     ns ? " after its sink tokens" : "", ctx);
        if (*why) {
            fprintf(stderr, "kveval: scheme %s quantizes nothing at ctx %zu: %s; use a longer --ctx or a smaller sink/residual\n",
                    sch[i].name, ctx, why);
            rc = 2;
            goto out;
        }
    }

    if (load_tokenizer(&o, &m, &tok, &e)) { fail("tokenizer", &e, 1); goto out; }
    if (kvq_tokenizer_check_vocab(tok, m.hp.vocab_size, o.tokenizer ? o.tokenizer : o.model, &e)) { fail(NULL, &e, 1); goto out; }
    kvq_text_format fmt = !o.format ? kvq_text_format_from_path(o.text)
                          : !strcmp(o.format, "jsonl") ? KVQ_TEXT_JSONL
                          : !strcmp(o.format, "wikitext-tokens") ? KVQ_TEXT_WIKITEXT_TOKENS
                                                                 : KVQ_TEXT_RAW;
    if (kvq_text_read(o.text, fmt, KVQ_EOL_TO_LF, &txt, &e)) { fail("text", &e, 1); goto out; }
    kvq_ppl_protocol proto = !strcmp(o.protocol, "llamacpp") ? KVQ_PPL_LLAMACPP : KVQ_PPL_KVQUANT;
    kvq_bos_policy bos = !strcmp(o.bos, "always") ? KVQ_BOS_ALWAYS : !strcmp(o.bos, "never") ? KVQ_BOS_NEVER : KVQ_BOS_MODEL;
    if (kvq_ppl_windows(&txt, tok, proto, ctx, bos, &win, &e)) { fail("text", &e, 1); goto out; }
    kvq_ppl_plan plan;
    if (kvq_ppl_plan_make(&win, proto, (size_t)o.max_windows, &plan, &e)) { fail(o.text, &e, 1); goto out; }

    res = calloc(n_sch, sizeof *res);
    if (!res) goto out;
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

    kvq_ppl_report rep = {.m = &m, .model_fingerprint = have_fp ? fp : NULL, .win = &win,
                          .text_format = kvq_text_format_name(fmt), .bos_policy = o.bos, .plan = &plan, .arts = &arts,
                          .schemes = sch, .results = res, .n_schemes = n_sch, .baseline = baseline,
                          .skipped = (const char *const *)skip, .n_skipped = n_skip, .exec = &exec};
    if (o.json && kvq_ppl_report_json(o.json, &rep, &e)) { fail("--json", &e, 1); goto out; }
    { /* with --json - stdout carries the JSON alone: the table goes to stderr (not with --quiet) */
        const bool json_stdout = o.json && !strcmp(o.json, "-");
        FILE *tf = json_stdout ? stderr : stdout;
        if ((!json_stdout || !o.quiet) && kvq_ppl_report_table(tf, &rep, &e)) { fail(NULL, &e, 1); goto out; }
        fflush(tf);
    }
    rc = 0;
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
