/* bench_weights.c — the CPU forward with the weight matrices held as fp32
 * (exact mode), as stored in the file (GGUF blocks, bf16 safetensors) or as
 * bf16 (model.h kvq_weights): load time, resident memory, prefill tokens/s and
 * the achieved FLOP/s as a fraction of this machine's sgemm rate at the
 * model's GEMM shapes, measured in the same run (interleaved with the forward
 * rounds, best of the rounds for both: fair on a machine shared with other
 * work). The PPL side of the comparison is kveval's (docs/BENCHMARKS.md).
 *
 * Usage: bench_weights [MODEL] [T] [MODES]
 *   MODEL default $KVQ_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf
 *   T     prefill window (default 512, clamped to the context)
 *   MODES comma-separated kvq_weights names (default "f32,native,bf16"); the
 *         first listed is the baseline of the ratio column.
 * The sgemm rate uses random fp32 matrices of the model's layer shapes (one
 * layer) and of 8192 LM-head rows (scaled to the vocabulary), so it needs no
 * fp32 copy of a large model. */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "model.h"
#include "ops.h"

static double now(void) { return omp_get_wtime(); }

/* resident set size and its peak, MiB (Linux /proc/self/status) */
static void rss(double *cur, double *peak)
{
    *cur = *peak = -1;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        long kb;
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) *cur = kb / 1024.0;
        if (sscanf(line, "VmHWM: %ld kB", &kb) == 1) *peak = kb / 1024.0;
    }
    fclose(f);
}

static float *rand_mat(size_t n, unsigned seed)
{
    float *w = malloc(n * sizeof *w);
    if (!w) return NULL;
    for (size_t i = 0; i < n; i++) w[i] = (float)((seed = seed * 1103515245u + 12345u) >> 9) / 8388608.0f - 1.0f;
    return w;
}

static double time_gemm(float *y, const float *x, const float *w, int T, int in, int out)
{
    double t0 = now();
    kvq_linear(y, x, w, T, in, out, 0);
    return now() - t0;
}

int main(int argc, char **argv)
{
    const char *env = getenv("KVQ_MODEL");
    const char *path = argc > 1 ? argv[1] : (env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    int T = argc > 2 ? atoi(argv[2]) : 512;
    char modes[256];
    snprintf(modes, sizeof modes, "%s", argc > 3 ? argv[3] : "f32,native,bf16");
    printf("bench_weights: %s, T = %d, threads: OpenMP %d, OpenBLAS %d\n\n", path, T, omp_get_max_threads(), openblas_get_num_threads());
    printf("| weights | storage | load s | RSS after load MiB | prefill best s | tokens/s | ratio to %s | GFLOP/s | of sgemm rate |\n",
           strtok(strdup(modes), ","));
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    double base_tps = 0;
    for (char *mode = strtok(modes, ","); mode; mode = strtok(NULL, ",")) {
        kvq_load_opts lo;
        kvq_err e = {0};
        if (kvq_weights_parse(mode, "mode", &lo.weights, &e)) {
            fprintf(stderr, "bench_weights: %s\n", e.msg);
            return 2;
        }
        kvq_model m;
        double t0 = now();
        if (kvq_model_load_opts(path, &lo, &m, &e) != KVQ_OK) {
            printf("| %s | (not loaded: %s) | | | | | | | |\n", mode, e.msg);
            continue;
        }
        double t_load = now() - t0, r_now, r_peak;
        rss(&r_now, &r_peak);
        const kvq_hparams *hp = &m.hp;
        int Tw = T > hp->ctx_len ? hp->ctx_len : T;
        kvq_forward fw;
        if (kvq_forward_init(&fw, &m, Tw, 0, 0, &e) != KVQ_OK) {
            fprintf(stderr, "bench_weights: %s\n", e.msg);
            return 1;
        }
        int *tok = malloc((size_t)Tw * sizeof *tok);
        unsigned s = 7;
        for (int i = 0; i < Tw; i++) tok[i] = (int)((s = s * 1103515245u + 12345u) >> 9) % hp->vocab_size;
        kvq_fwd_io io = {.tokens = tok, .T = Tw};
        kvq_fwd_result r;
        if (kvq_forward_run(&fw, &io, &r, &e) != KVQ_OK) {
            fprintf(stderr, "bench_weights: %s\n", e.msg);
            return 1;
        }
        /* sgemm rate at the model's shapes (fp32 random matrices), interleaved with the forward rounds */
        const int dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim, V = hp->vocab_size;
        const int VH = V < 8192 ? V : 8192, mw = hid > qd ? (hid > dim ? hid : dim) : (qd > dim ? qd : dim);
        float *wq = rand_mat((size_t)qd * dim, 1), *wk = rand_mat((size_t)kvd * dim, 2), *wo = rand_mat((size_t)dim * qd, 3),
              *wg = rand_mat((size_t)hid * dim, 4), *wd = rand_mat((size_t)dim * hid, 5), *wh = rand_mat((size_t)VH * dim, 6);
        float *x = rand_mat((size_t)Tw * mw, 7), *y = malloc((size_t)Tw * (VH > mw ? VH : mw) * sizeof(float));
        if (!wq || !wk || !wo || !wg || !wd || !wh || !x || !y) {
            fprintf(stderr, "bench_weights: out of memory for the sgemm matrices\n");
            return 1;
        }
        const double fl = kvq_forward_flops(hp, Tw, 0);
        const int reps = fl < 5e9 ? 5 : fl < 2e11 ? 3 : 1;
        double best = 1e30, tl = 1e30, th = 1e30;
        for (int i = 0; i < reps; i++) {
            double a = now();
            kvq_forward_run(&fw, &io, &r, &e);
            double dt = now() - a;
            best = dt < best ? dt : best;
            double l = time_gemm(y, x, wq, Tw, dim, qd) + 2 * time_gemm(y, x, wk, Tw, dim, kvd) + time_gemm(y, x, wo, Tw, qd, dim) +
                       2 * time_gemm(y, x, wg, Tw, dim, hid) + time_gemm(y, x, wd, Tw, hid, dim);
            double h = time_gemm(y, x, wh, Tw, dim, VH) * V / VH;
            tl = l < tl ? l : tl;
            th = h < th ? h : th;
        }
        const double gf = 2.0 * Tw * ((double)dim * qd * 2 + (double)dim * kvd * 2 + 3.0 * dim * hid) * hp->n_layers +
                          2.0 * Tw * (double)dim * V;
        const double sgemm = gf / (tl * hp->n_layers + th), rate = fl / best, tps = Tw / best;
        if (base_tps == 0) base_tps = tps;
        printf("| %s | %s | %.1f | %.0f | %.3f | %.1f | %.3f | %.1f | %.0f%% |\n", mode, m.weights_desc, t_load, r_now, best, tps,
               tps / base_tps, rate / 1e9, 100 * rate / sgemm);
        fflush(stdout);
        free(wq), free(wk), free(wo), free(wg), free(wd), free(wh), free(x), free(y), free(tok);
        kvq_forward_free(&fw);
        kvq_model_free(&m);
    }
    double r_now, r_peak;
    rss(&r_now, &r_peak);
    printf("\npeak RSS of the process (all modes): %.0f MiB\n", r_peak);
    return 0;
}
