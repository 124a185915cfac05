/* bench_kvdump.c — kvdump throughput (tokens/s) with and without --fisher,
 * as ratios to the bare forward over the same windows in the same run, and
 * the share of HDF5 writing in the capture time (issue 5 target: HDF5
 * writing <= 15% of the forward time).
 *
 * Usage: bench_kvdump [MODEL] [TEXT] [N] [L]
 *   defaults: models/SmolLM2-135M-Instruct.Q4_1.gguf,
 *   ../shared/datasets/wikitext-2/wiki.valid.tokens, N = 2, L = 512.
 * Writes /tmp/kvq_bench_kvdump_*.h5 (removed afterwards). Reports CPU time too
 * (getrusage), which is steadier than wall time on a shared machine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "capture.h"
#include "forward.h"
#include "model.h"
#include "progress.h"
#include "text.h"
#include "tokenizer.h"

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

int main(int argc, char **argv)
{
    const char *model = argc > 1 ? argv[1] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *text = argc > 2 ? argv[2] : "../shared/datasets/wikitext-2/wiki.valid.tokens";
    int N = argc > 3 ? atoi(argv[3]) : 2, L = argc > 4 ? atoi(argv[4]) : 512;
    if (access(model, R_OK) || access(text, R_OK) || N < 1 || L < 2) {
        fprintf(stderr, "bench_kvdump: need a model (%s) and a text (%s); skipping\n", model, text);
        return 0;
    }
    kvq_err e = {0};
    /* bare forward over the same windows */
    kvq_model m;
    kvq_tokenizer *tok;
    kvq_text txt;
    kvq_windows w;
    if (kvq_model_load(model, &m, &e) || kvq_tokenizer_for_model(model, NULL, &tok, &e) ||
        kvq_text_read(text, kvq_text_format_from_path(text), KVQ_EOL_TO_LF, &txt, &e) ||
        kvq_calib_windows(&txt, tok, (size_t)N, (size_t)L, 0, KVQ_BOS_MODEL, &w, &e)) {
        fprintf(stderr, "bench_kvdump: %s\n", e.msg);
        return 1;
    }
    kvq_forward fw;
    if (kvq_forward_init(&fw, &m, L, 0, 0, &e)) { fprintf(stderr, "bench_kvdump: %s\n", e.msg); return 1; }
    int *ids = malloc(sizeof(int) * (size_t)L);
    double w0 = kvq_now(), c0 = cpu_s();
    for (int s = 0; s < N; s++) {
        for (int t = 0; t < L; t++) ids[t] = w.tokens[(size_t)s * L + t];
        kvq_fwd_io io = {.tokens = ids, .T = L};
        kvq_fwd_result r;
        if (kvq_forward_run(&fw, &io, &r, &e)) { fprintf(stderr, "bench_kvdump: %s\n", e.msg); return 1; }
    }
    double fwd_wall = kvq_now() - w0, fwd_cpu = cpu_s() - c0;
    kvq_forward_free(&fw);
    free(ids);
    kvq_windows_free(&w);
    kvq_text_free(&txt);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);

    printf("kvdump benchmark: %s, %d samples x %d tokens\n", model, N, L);
    printf("| run | wall s | CPU s | tokens/s | wall / bare forward | HDF5 s | HDF5 / forward |\n|---|---:|---:|---:|---:|---:|---:|\n");
    printf("| bare forward | %.2f | %.2f | %.1f | 1.00 | – | – |\n", fwd_wall, fwd_cpu, N * L / fwd_wall);
    const struct { const char *name; bool fisher; int deflate; } runs[] = {
        {"kvdump (f16, deflate 1)", false, 1}, {"kvdump (f16, no deflate)", false, 0}, {"kvdump --fisher (deflate 1)", true, 1}};
    for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
        char out[128];
        snprintf(out, sizeof out, "/tmp/kvq_bench_kvdump_%d.h5", (int)getpid());
        kvq_capture_opts o = kvq_capture_opts_default();
        o.model_path = model;
        o.text_path = text;
        o.format = kvq_text_format_from_path(text);
        o.samples = N;
        o.seq_len = L;
        o.fisher = runs[i].fisher;
        o.attn_stats = true;
        o.deflate = runs[i].deflate;
        o.force = true;
        o.quiet = true;
        o.out_path = out;
        kvq_capture_report rep;
        double c1 = cpu_s();
        if (kvq_capture_run(&o, &rep, &e)) { fprintf(stderr, "bench_kvdump: %s\n", e.msg); return 1; }
        double cpu = cpu_s() - c1;
        printf("| %s | %.2f | %.2f | %.1f | %.2f | %.2f | %.0f%% |\n", runs[i].name, rep.seconds_total, cpu,
               N * L / rep.seconds_total, rep.seconds_total / fwd_wall, rep.seconds_write,
               100 * rep.seconds_write / rep.seconds_forward);
        unlink(out);
    }
    return 0;
}
