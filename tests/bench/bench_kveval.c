/* bench_kveval.c — kveval throughput per scheme as a ratio to the fp32
 * baseline measured in the same run (issue 7 target: quantization
 * simulation costs <= 15% extra, i.e. ratio <= 1.15).
 *
 * Default: the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf, or
 * KVQ_MODEL) on the first W windows (default 2) of ctx tokens (default 512)
 * of ../shared/datasets/wikitext-2-raw/wiki.test.raw, kvquant protocol;
 * schemes fp32, fp16, int4, int2, int4-pc-1%, kivi4, kivi2, nuq3-1%, hh2 (a per-key schedule) — the
 * nuq tables calibrated in-process on 2 windows of wiki.valid.tokens (same
 * fitting code as kvcalib, tests/kveval_util.h). Every round runs all
 * schemes window by window (interleaved, so load on the shared machine hits
 * them alike); the best round per scheme is reported.
 * Usage: bench_kveval [ctx [windows [rounds [-a ARTIFACT]... [SPEC]...]]]: extra kvcalib artifacts (mikv,
 * skvq, ...) and extra scheme specs run after the default list, in the same interleaved rounds.
 *
 * Calibration mode (a stand-in for kvdump | kvcalib until those commands
 * land): bench_kveval --calibrate OUTDIR [samples [len]] captures pre-RoPE K
 * and V of the default model on `samples` windows of `len` tokens of
 * wiki.valid.tokens (KVQuant's sampler, seed 0; default 4 x 2048) and writes
 * OUTDIR/nuq{4,3,2}.safetensors and OUTDIR/nuq{4,3,2}-1pct.safetensors
 * (sink 1, per-layer datatypes, no Fisher weights). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kveval_util.h"
#include "perplexity.h"
#include "identity.h"
#include "progress.h"
#include "scheme.h"
#include "text.h"
#include "tokenizer.h"

static int die(const char *what, const kvq_err *e)
{
    fprintf(stderr, "bench_kveval: %s: %s\n", what, e->msg);
    return 1;
}

static const char *shared_dir(void)
{
    const char *s = getenv("KVQ_SHARED");
    return s && *s ? s : "../shared";
}

/* Calibration windows of the valid split, tokenised with the model's tokenizer. */
static kvq_status calib_tokens(const kvq_tokenizer *tok, size_t n, size_t len, kvq_windows *w, kvq_err *e)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/datasets/wikitext-2/wiki.valid.tokens", shared_dir());
    kvq_text t;
    KVQ_TRY(kvq_text_read(p, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_TO_LF, &t, e));
    kvq_status s = kvq_calib_windows(&t, tok, n, len, 0, KVQ_BOS_MODEL, w, e);
    kvq_text_free(&t);
    return s;
}

static int calibrate(const kvq_model *m, const kvq_tokenizer *tok, const char *dir, size_t ns, size_t len)
{
    kvq_err e = {0};
    char fp[65];
    if (kvq_identity_model(m, fp, &e)) return die("fingerprint", &e);
    kvq_windows w;
    if (calib_tokens(tok, ns, len, &w, &e)) return die("calibration text", &e);
    double t0 = kvq_now();
    kvq_util_capture cap;
    if (kvq_util_capture_kv(m, (const int *)w.tokens, ns, len, false, &cap, &e)) return die("capture", &e);
    fprintf(stderr, "captured %zu x %zu tokens in %.1f s\n", ns, len, kvq_now() - t0);
    int rc = 0;
    for (int bits = 4; bits >= 2 && !rc; bits--)
        for (int o = 0; o < 2 && !rc; o++) {
            char path[4200];
            snprintf(path, sizeof path, "%s/nuq%d%s.safetensors", dir, bits, o ? "-1pct" : "");
            double t1 = kvq_now();
            if (kvq_util_fit_nuq(m, &cap, len, bits, o ? 0.01 : 0.0, 1, len, fp, path, &e)) rc = die(path, &e);
            else fprintf(stderr, "wrote %s (%.1f s)\n", path, kvq_now() - t1);
        }
    free(cap.k);
    free(cap.v);
    kvq_windows_free(&w);
    return rc;
}

int main(int argc, char **argv)
{
    const char *mp = getenv("KVQ_MODEL");
    if (!mp || !*mp) mp = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    char text[4096];
    snprintf(text, sizeof text, "%s/datasets/wikitext-2-raw/wiki.test.raw", shared_dir());
    FILE *probe = fopen(mp, "rb");
    if (!probe) {
        printf("bench_kveval: SKIP (model %s absent)\n", mp);
        return 0;
    }
    fclose(probe);
    kvq_err e = {0};
    kvq_model m;
    if (kvq_model_load(mp, &m, &e)) return die("model", &e);
    kvq_tokenizer *tok;
    if (kvq_tokenizer_from_gguf(mp, &tok, &e)) return die("tokenizer", &e);
    if (argc > 2 && !strcmp(argv[1], "--calibrate")) {
        size_t ns = argc > 3 ? (size_t)atol(argv[3]) : 4, len = argc > 4 ? (size_t)atol(argv[4]) : 2048;
        int rc = calibrate(&m, tok, argv[2], ns, len);
        kvq_tokenizer_free(tok);
        kvq_model_free(&m);
        return rc;
    }
    size_t ctx = argc > 1 ? (size_t)atol(argv[1]) : 512, nw = argc > 2 ? (size_t)atol(argv[2]) : 2;
    int rounds = argc > 3 ? atoi(argv[3]) : 2;
    enum { MAX_EXTRA = 16 };
    const char *extra_art[MAX_EXTRA], *extra_spec[MAX_EXTRA];
    int n_ea = 0, n_es = 0;
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "-a") && i + 1 < argc && n_ea < MAX_EXTRA) extra_art[n_ea++] = argv[++i];
        else if (argv[i][0] != '-' && n_es < MAX_EXTRA) extra_spec[n_es++] = argv[i];
        else ctx = 0; /* usage */
    }
    if (ctx < 2 || nw < 1 || rounds < 1) {
        fprintf(stderr, "usage: bench_kveval [ctx [windows [rounds [-a ARTIFACT]... [SPEC]...]]] | --calibrate OUTDIR [samples [len]]\n");
        return 2;
    }

    /* nuq tables for the bench: 2 calibration windows of ctx tokens */
    char art[256], fp[65];
    snprintf(art, sizeof art, "/tmp/bench_kveval_%ld.safetensors", (long)getpid());
    if (kvq_identity_model(&m, fp, &e)) return die("fingerprint", &e);
    kvq_windows cw;
    if (calib_tokens(tok, 2, ctx, &cw, &e)) return die("calibration text", &e);
    if (kvq_util_make_nuq_artifact(&m, (const int *)cw.tokens, 2, ctx, 3, 0.01, 0, false, fp, art, &e))
        return die("calibration", &e);
    kvq_windows_free(&cw);
    kvq_artifact_set set;
    const char *ap[1 + MAX_EXTRA] = {art};
    for (int i = 0; i < n_ea; i++) ap[1 + i] = extra_art[i];
    if (kvq_artifact_set_load(&set, ap, 1 + (size_t)n_ea, &m, fp, false, NULL, &e)) return die(art, &e);
    remove(art);

    kvq_text t;
    if (kvq_text_read(text, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e)) return die("text", &e);
    kvq_windows w;
    if (kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, ctx, KVQ_BOS_MODEL, &w, &e)) return die("windows", &e);
    kvq_ppl_plan plan;
    if (kvq_ppl_plan_make(&w, KVQ_PPL_KVQUANT, nw, &plan, &e)) return die("plan", &e);

    const char *specs[9 + MAX_EXTRA] = {"fp32", "fp16", "int4", "int2", "int4-pc-1%", "kivi4", "kivi2", "nuq3-1%", "hh2"};
    enum { NS_MAX = 9 + MAX_EXTRA };
    const int NS = 9 + n_es;
    for (int i = 0; i < n_es; i++) specs[9 + i] = extra_spec[i];
    kvq_eval_scheme s[NS_MAX];
    for (int i = 0; i < NS; i++)
        if (kvq_eval_scheme_make(specs[i], &set, &m.hp, &s[i], &e)) return die(specs[i], &e);
    double best[NS_MAX], ppl[NS_MAX], share[NS_MAX];
    for (int i = 0; i < NS; i++) best[i] = 1e300;
    for (int r = 0; r < rounds; r++) {
        kvq_ppl_result res[NS_MAX];
        if (kvq_ppl_run(&m, &w, &plan, s, NS, NULL, res, &e)) return die("run", &e);
        for (int i = 0; i < NS; i++) {
            if (res[i].seconds < best[i]) {
                best[i] = res[i].seconds;
                share[i] = res[i].transform_seconds / res[i].seconds;
            }
            ppl[i] = res[i].ppl;
        }
        kvq_ppl_results_free(res, NS);
        fprintf(stderr, "round %d/%d done\n", r + 1, rounds);
    }
    printf("kveval throughput, %s, ctx %zu, %zu windows (kvquant protocol, wiki.test.raw), best of %d rounds\n\n", mp, ctx,
           plan.n_windows, rounds);
    printf("| scheme | s / window | tokens/s | time vs fp32 | in K/V transform | PPL |\n|---|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < NS; i++)
        printf("| %s | %.2f | %.0f | %.3f | %.1f%% | %.4f |\n", s[i].name, best[i] / plan.n_windows,
               (double)plan.n_windows * ctx / best[i], best[i] / best[0], 100 * share[i], ppl[i]);
    kvq_windows_free(&w);
    kvq_text_free(&t);
    kvq_artifact_set_free(&set);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return 0;
}
