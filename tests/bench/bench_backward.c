/* bench_backward.c — forward+backward time of one window of the default
 * model (kernels/model/backward.h: cross-entropy gradients w.r.t. every layer's
 * K_pre / V, consumed by a Fisher-style callback that squares and sums them,
 * as kvdump --fisher does) as a ratio to the forward-only time (a plain
 * kvq_forward workspace: no checkpoints, no activation store) in the same
 * run, the backward's phases, and peak RSS (getrusage). Target ratio ≤ 3×.
 *
 * Usage: bench_backward [MODEL] [T]
 *   MODEL default: $KVQ_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf (else
 *   a smoke run on ../shared/models/llama2c/stories260K.bin); T default 2048
 *   (clamped to the model's context). Runs: forward, forward+backward,
 *   forward (best forward reported). Wall and CPU (user+sys) times are both
 *   given: on a machine shared with other work, CPU time is the steadier one. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "backward.h"
#include "model.h"

static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static double peak_rss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0; /* Linux: KiB */
}

typedef struct {
    double sum_k, sum_v;
} fisher_acc;

static kvq_status fisher_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    (void)err;
    fisher_acc *f = user;
    size_t n = (size_t)g->T * g->n_kv_heads * g->head_dim;
    for (size_t i = 0; i < n; i++) {
        f->sum_k += (double)g->dk_pre[i] * g->dk_pre[i];
        f->sum_v += (double)g->dv[i] * g->dv[i];
    }
    return KVQ_OK;
}

int main(int argc, char **argv)
{
    const char *env = getenv("KVQ_MODEL");
    const char *path = argc > 1 ? argv[1] : (env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    int T = argc > 2 ? atoi(argv[2]) : 2048;
    kvq_model m;
    kvq_err e = {0};
    char buf[4096];
    if (kvq_model_load(path, &m, &e) != KVQ_OK) {
        printf("bench_backward: default model not loadable (%s); smoke run on stories260K instead\n", e.msg);
        const char *sh = getenv("KVQ_SHARED");
        snprintf(buf, sizeof buf, "%s/models/llama2c/stories260K.bin", sh && *sh ? sh : "../shared");
        path = buf;
        if (kvq_model_load(path, &m, &e) != KVQ_OK) {
            printf("bench_backward: SKIP: %s\n", e.msg);
            return 0;
        }
    }
    const kvq_hparams *hp = &m.hp;
    if (T > hp->ctx_len) T = hp->ctx_len;
    if (T < 2) T = 2;
    printf("model %s: %d layers, dim %d, heads %d/%d, vocab %d; window T = %d; threads: OpenMP %d, OpenBLAS %d\n", path, hp->n_layers,
           hp->dim, hp->n_heads, hp->n_kv_heads, hp->vocab_size, T, omp_get_max_threads(), openblas_get_num_threads());
    double rss_model = peak_rss_mib();
    kvq_backward bw;
    if (kvq_backward_init(&bw, &m, T, 0, &e) != KVQ_OK) {
        fprintf(stderr, "bench_backward: %s\n", e.msg);
        return 1;
    }
    /* forward-only baseline: a plain workspace (no checkpoints, no activation store) */
    kvq_forward fw;
    if (kvq_forward_init(&fw, &m, T, 0, 0, &e) != KVQ_OK) {
        fprintf(stderr, "bench_backward: %s\n", e.msg);
        return 1;
    }
    int *tok = malloc(T * sizeof(int));
    unsigned s = 7;
    for (int i = 0; i < T; i++) tok[i] = (int)((s = s * 1103515245u + 12345u) >> 9) % hp->vocab_size;
    kvq_fwd_io io = {.tokens = tok, .T = T};
    kvq_fwd_result fr;
    kvq_bwd_result br;
    fisher_acc fa = {0};
    kvq_bwd_spec spec = {.user = &fa, .xent = true, .grads = fisher_cb};
    double wf[2] = {0}, cf[2] = {0}, wb = 0, cb = 0;
    for (int rep = 0; rep < 3; rep++) {
        double w0 = omp_get_wtime(), c0 = cpu_now();
        kvq_status st = rep == 1 ? kvq_backward_run(&bw, &io, &spec, &br, &e) : kvq_forward_run(&fw, &io, &fr, &e);
        double w = omp_get_wtime() - w0, c = cpu_now() - c0;
        if (st != KVQ_OK) {
            fprintf(stderr, "bench_backward: %s\n", e.msg);
            return 1;
        }
        if (rep == 1) wb = w, cb = c;
        else wf[rep / 2] = w, cf[rep / 2] = c;
    }
    double wfw = fmin(wf[0], wf[1]), cfw = fmin(cf[0], cf[1]);
    printf("forward only:       wall %.2f s (%.2f, %.2f)  cpu %.2f s\n", wfw, wf[0], wf[1], cfw);
    printf("forward + backward: wall %.2f s  cpu %.2f s  -> ratio %.2fx wall, %.2fx cpu (target <= 3x)\n", wb, cb, wb / wfw, cb / cfw);
    printf("  activations: %s\n", bw.keep_acts ? "kept by the forward (KVQ_FWD_SAVE_ACTIVATIONS)" : "recomputed per layer");
    printf("  phases (wall): forward %.2f, LM head + xent backward %.2f, layer recompute %.2f, attention backward %.2f, other backward %.2f s\n",
           bw.t_forward, bw.t_head, bw.t_recompute, bw.t_attn_bwd, bw.t_other_bwd);
    printf("loss %.4f over %d positions (synthetic tokens); sum of squared dL/dK_pre %.4e, dL/dV %.4e\n", br.loss, br.n_scored, fa.sum_k,
           fa.sum_v);
    printf("peak RSS %.0f MiB (after model load %.0f MiB); limit 4096 MiB\n", peak_rss_mib(), rss_model);
    free(tok);
    kvq_backward_free(&bw);
    kvq_forward_free(&fw);
    kvq_model_free(&m);
    return 0;
}
