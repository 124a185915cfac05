/* bench_forward.c — prefill throughput of the CPU forward (kernels/model/forward.h)
 * and, in the same run, the sgemm rate of this machine at the model's GEMM
 * shapes; prints achieved forward FLOP/s as a fraction of the sgemm rate.
 *
 * Usage: bench_forward [MODEL] [T]
 *   MODEL default: $KVQ_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf; when
 *   it cannot be loaded, a smoke run on ../shared/models/llama2c/stories260K.bin.
 *   T default 512 (clamped to the model's context).
 * Model FLOPs (kvq_forward_flops) = 2 * matmul params (incl. LM head) * T
 *   + causal attention 4 * n_heads * head_dim * T(T+1)/2 per layer.
 * Threads: OPENBLAS_NUM_THREADS / OMP_NUM_THREADS (default = cores). */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "model.h"
#include "ops.h"

static double now(void) { return omp_get_wtime(); }

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* best-of-reps time of one GEMM y[T][out] = x[T][in] W^T */
static double time_gemm(float *y, const float *x, const float *w, int T, int in, int out, int reps)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        kvq_linear(y, x, w, T, in, out, 0);
        double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    const char *env = getenv("KVQ_MODEL");
    const char *path = argc > 1 ? argv[1] : (env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    int T = argc > 2 ? atoi(argv[2]) : 512;
    kvq_model m;
    kvq_err e = {0};
    double t_load = now();
    if (kvq_model_load(path, &m, &e) != KVQ_OK) {
        printf("bench_forward: default model not loadable (%s); smoke run on stories260K instead\n", e.msg);
        const char *sh = getenv("KVQ_SHARED");
        static char buf[4096];
        snprintf(buf, sizeof buf, "%s/models/llama2c/stories260K.bin", sh && *sh ? sh : "../shared");
        path = buf;
        if (kvq_model_load(path, &m, &e) != KVQ_OK) {
            printf("bench_forward: SKIP: %s\n", e.msg);
            return 0;
        }
    }
    t_load = now() - t_load;
    const kvq_hparams *hp = &m.hp;
    if (T > hp->ctx_len) T = hp->ctx_len;
    if (T < 1) T = 1;
    printf("model %s: %d layers, dim %d, hidden %d, heads %d/%d, head_dim %d, vocab %d (load %.2f s)\n", path, hp->n_layers, hp->dim,
           hp->hidden_dim, hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->vocab_size, t_load);
    const char *wp = getenv("OMP_WAIT_POLICY");
    printf("threads: OpenMP %d (OMP_WAIT_POLICY=%s), OpenBLAS %d; window T = %d\n", omp_get_max_threads(), wp ? wp : "unset",
           openblas_get_num_threads(), T);

    kvq_forward fw;
    if (kvq_forward_init(&fw, &m, T, 0, 0, &e) != KVQ_OK) {
        fprintf(stderr, "bench_forward: %s\n", e.msg);
        return 1;
    }
    int *tok = malloc(T * sizeof(int));
    unsigned s = 7;
    for (int i = 0; i < T; i++) tok[i] = (int)((s = s * 1103515245u + 12345u) >> 9) % hp->vocab_size;
    double flops = kvq_forward_flops(hp, T, 0);
    double tiny = flops < 1e9;
    int reps = tiny ? 20 : 5;
    double times[20];
    kvq_fwd_io io = {.tokens = tok, .T = T};
    kvq_fwd_result r;
    if (kvq_forward_run(&fw, &io, &r, &e) != KVQ_OK) { /* warm-up */
        fprintf(stderr, "bench_forward: %s\n", e.msg);
        return 1;
    }
    /* sgemm at the model's shapes: one layer's 7 GEMMs (x n_layers) + the LM
     * head, timed in the same rounds as the forward (interleaved, best of the
     * rounds for both: fair on a machine shared with other work) */
    int dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim, V = hp->vocab_size;
    int maxw = hid > qd ? hid : qd;
    maxw = maxw > dim ? maxw : dim;
    float *x = calloc((size_t)T * maxw, sizeof(float)), *y = malloc((size_t)T * (V > maxw ? V : maxw) * sizeof(float));
    for (size_t i = 0; i < (size_t)T * maxw; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    const kvq_layer_weights *w = &m.layers[0];
    double tl = 1e30, th = 1e30;
    for (int i = 0; i < reps; i++) {
        double t0 = now();
        kvq_forward_run(&fw, &io, &r, &e);
        times[i] = now() - t0;
        double l = time_gemm(y, x, kvq_mat_f32(&w->wq), T, dim, qd, 1) + time_gemm(y, x, kvq_mat_f32(&w->wk), T, dim, kvd, 1) +
                   time_gemm(y, x, kvq_mat_f32(&w->wv), T, dim, kvd, 1) + time_gemm(y, x, kvq_mat_f32(&w->wo), T, qd, dim, 1) +
                   time_gemm(y, x, kvq_mat_f32(&w->w_gate), T, dim, hid, 1) + time_gemm(y, x, kvq_mat_f32(&w->w_up), T, dim, hid, 1) +
                   time_gemm(y, x, kvq_mat_f32(&w->w_down), T, hid, dim, 1);
        double h = time_gemm(y, x, kvq_mat_f32(&m.output), T, dim, V, 1);
        tl = l < tl ? l : tl;
        th = h < th ? h : th;
    }
    qsort(times, reps, sizeof *times, cmp_d);
    double t_best = times[0], t_med = times[reps / 2];
    double fl_layer = 2.0 * T * ((double)dim * qd * 2 + (double)dim * kvd * 2 + 3.0 * dim * hid);
    double fl_head = 2.0 * T * (double)dim * V;
    double gemm_flops = fl_layer * hp->n_layers + fl_head;
    double gemm_time = tl * hp->n_layers + th;
    double sgemm_rate = gemm_flops / gemm_time;

    double fwd_rate = flops / t_best;
    printf("forward prefill: T=%d  best %.3f s  median %.3f s  (%d runs, interleaved with the sgemm timing)  -> %.0f tokens/s (best), %.0f tokens/s (median)\n", T, t_best,
           t_med, reps, T / t_best, T / t_med);
    printf("model FLOPs per window: %.2f GFLOP (attention %.1f%%)\n", flops / 1e9, 100.0 * (flops - gemm_flops) / flops);
    printf("sgemm at model shapes: %.1f GFLOP/s (layer GEMMs %.1f GFLOP/s, LM head %.1f GFLOP/s)\n", sgemm_rate / 1e9,
           fl_layer / tl / 1e9, fl_head / th / 1e9);
    printf("forward: %.1f GFLOP/s = %.0f%% of the sgemm rate (target >= 60%%); GEMM-only lower bound on time %.3f s\n", fwd_rate / 1e9,
           100.0 * fwd_rate / sgemm_rate, gemm_time);
    printf("loss on the synthetic window: %.4f over %d positions\n", r.loss, r.n_scored);
    free(x);
    free(y);
    free(tok);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
    return 0;
}
