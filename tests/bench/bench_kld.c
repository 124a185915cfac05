/* bench_kld.c — what kveval's KL divergence costs (issue 41: at most 10% of a
 * pass). The KLD needs, per scored row, the LM head's input h, its log-sum-exp
 * and top token (kvq_fwd_head: nothing extra to compute) and, for the fp32
 * baseline only, the expected output embedding e = sum_v p_v Wout[v] (one more
 * GEMM of the LM head's size over the scored rows); each scheme then adds a
 * dot product of dim per row (KL = (h_base - h) . e - lse_base + lse).
 *
 * Measured on the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf, or
 * KVQ_MODEL), windows of ctx tokens of wiki.test.raw (kvquant protocol: every
 * row but the last scored), three forwards per window interleaved in each round
 * so that load on the shared machine hits them alike:
 *   plain     the forward as kveval ran it without the KLD (loss only)
 *   scheme    + hidden, lse and argmax (what every quantized scheme's pass adds)
 *   baseline  + the expectation (what the fp32 baseline's pass adds)
 * plus the per-row dot products of a scheme (timed alone). Best round per kind,
 * in process CPU time (all threads): on a machine shared with other jobs wall
 * time varies by tens of percent between identical passes, CPU time by a few;
 * run with OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 to keep idle-spinning
 * threads out of it.
 * The cost of a kveval run of N quantized schemes is baseline - plain once per
 * window plus N x (scheme - plain + dots), against (N + 1) plain passes.
 * Usage: bench_kld [ctx [windows [rounds]]] (default 1024 2 3) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "forward.h"
#include "progress.h"
#include "text.h"
#include "tokenizer.h"

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int die(const char *what, const kvq_err *e)
{
    fprintf(stderr, "bench_kld: %s: %s\n", what, e->msg);
    return 1;
}

int main(int argc, char **argv)
{
    const char *mp = getenv("KVQ_MODEL");
    if (!mp || !*mp) mp = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *sh = getenv("KVQ_SHARED");
    char text[4096];
    snprintf(text, sizeof text, "%s/datasets/wikitext-2-raw/wiki.test.raw", sh && *sh ? sh : "../shared");
    FILE *probe = fopen(mp, "rb");
    if (!probe) {
        printf("bench_kld: SKIP (model %s absent)\n", mp);
        return 0;
    }
    fclose(probe);
    size_t ctx = argc > 1 ? (size_t)atol(argv[1]) : 1024, nw = argc > 2 ? (size_t)atol(argv[2]) : 2;
    int rounds = argc > 3 ? atoi(argv[3]) : 3;
    if (ctx < 2 || nw < 1 || rounds < 1) {
        fprintf(stderr, "usage: bench_kld [ctx [windows [rounds]]]\n");
        return 2;
    }
    kvq_err e = {0};
    kvq_model m;
    if (kvq_model_load(mp, &m, &e)) return die("model", &e);
    kvq_tokenizer *tok;
    if (kvq_tokenizer_from_gguf(mp, &tok, &e)) return die("tokenizer", &e);
    kvq_text t;
    if (kvq_text_read(text, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &t, &e)) return die("text", &e);
    kvq_windows w;
    if (kvq_ppl_windows(&t, tok, KVQ_PPL_KVQUANT, ctx, KVQ_BOS_MODEL, &w, &e)) return die("windows", &e);
    if (nw > w.n_windows) nw = w.n_windows;
    kvq_forward fw;
    if (kvq_forward_init(&fw, &m, (int)ctx, 0, 0, &e)) return die("forward", &e);
    const size_t dim = (size_t)m.hp.dim;
    float *hb = malloc(ctx * dim * sizeof(float)), *eb = malloc(ctx * dim * sizeof(float)), *hs = malloc(ctx * dim * sizeof(float));
    double *lb = malloc(ctx * sizeof(double)), *ls = malloc(ctx * sizeof(double)), *kl = malloc(ctx * sizeof(double));
    int *ab = malloc(ctx * sizeof(int)), *as = malloc(ctx * sizeof(int));
    if (!hb || !eb || !hs || !lb || !ls || !kl || !ab || !as) {
        fprintf(stderr, "bench_kld: out of memory\n");
        return 1;
    }
    enum { PLAIN, SCHEME, BASE, DOTS, NK };
    double best[NK];
    for (int k = 0; k < NK; k++) best[k] = 1e300;
    double sink = 0;
    for (int r = 0; r < rounds; r++) {
        double tot[NK] = {0};
        for (size_t wi = 0; wi < nw; wi++) {
            const int *tk = (const int *)(w.tokens + wi * ctx);
            kvq_fwd_head hb_h = {.hidden = hb, .lse = lb, .argmax = ab, .expect = eb};
            kvq_fwd_head hs_h = {.hidden = hs, .lse = ls, .argmax = as};
            kvq_fwd_head *heads[3] = {NULL, &hs_h, &hb_h};
            for (int k = 0; k < 3; k++) {
                kvq_fwd_io io = {.tokens = tk, .T = (int)ctx, .head = heads[k]};
                kvq_fwd_result res;
                double t0 = cpu_now();
                if (kvq_forward_run(&fw, &io, &res, &e)) return die("forward", &e);
                tot[k] += cpu_now() - t0;
            }
            double t0 = cpu_now();
            for (size_t i = 0; i + 1 < ctx; i++) {
                double c = 0, d = 0;
                for (size_t j = 0; j < dim; j++) {
                    c += (double)hb[i * dim + j] * eb[i * dim + j];
                    d += (double)hs[i * dim + j] * eb[i * dim + j];
                }
                kl[i] = c - d - lb[i] + ls[i];
            }
            tot[DOTS] += cpu_now() - t0;
            sink += kl[ctx / 2];
        }
        for (int k = 0; k < NK; k++) best[k] = tot[k] < best[k] ? tot[k] : best[k];
        fprintf(stderr, "round %d/%d (CPU s): plain %.2f, scheme %.2f, baseline %.2f, dots %.4f\n", r + 1, rounds, tot[PLAIN],
                tot[SCHEME], tot[BASE], tot[DOTS]);
    }
    const double p = best[PLAIN];
    printf("KL divergence cost, %s, ctx %zu, %zu windows of wiki.test.raw (kvquant: %zu scored rows each), best of %d rounds, "
           "process CPU time\n\n",
           mp, ctx, nw, ctx - 1, rounds);
    printf("| pass | CPU s / window | vs plain pass |\n|---|---:|---:|\n");
    printf("| plain (no KLD) | %.3f | 1.000 |\n", p / nw);
    printf("| quantized scheme + h, lse, top token + KL dots | %.3f | %.3f |\n", (best[SCHEME] + best[DOTS]) / nw,
           (best[SCHEME] + best[DOTS]) / p);
    printf("| fp32 baseline + expectation GEMM | %.3f | %.3f |\n", best[BASE] / nw, best[BASE] / p);
    const double per_scheme = (best[SCHEME] + best[DOTS] - p) / p, base_extra = (best[BASE] - p) / p;
    printf("\nextra per pass: %.1f%% for each quantized scheme, %.1f%% for the baseline once per window;\n", 100 * per_scheme,
           100 * base_extra);
    for (int n = 1; n <= 8; n *= 2)
        printf("a run of fp32 + %d scheme%s (%d passes per window): +%.1f%% of its time\n", n, n > 1 ? "s" : "", n + 1,
               100 * (base_extra + n * per_scheme) / (n + 1));
    (void)sink;
    free(hb);
    free(eb);
    free(hs);
    free(lb);
    free(ls);
    free(kl);
    free(ab);
    free(as);
    kvq_forward_free(&fw);
    kvq_windows_free(&w);
    kvq_text_free(&t);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return 0;
}
