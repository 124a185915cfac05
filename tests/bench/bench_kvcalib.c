/* bench_kvcalib.c — end-to-end calibration time of nuq3-1% (Fisher-weighted,
 * sink 1, fit auto) on a synthetic dump shaped like the default model's
 * 16 x 2048 dump (SmolLM2-135M: 30 layers, 3 KV heads x head_dim 64, f16
 * k_pre_rope/k/v + f32 Fisher, deflate off), written with the dump writer
 * into /tmp (about 2.6 GB; removed afterwards unless KVQ_BENCH_KEEP=1).
 * Measures kvq_calibrate_file (open, read + check + fit every (layer, K|V)
 * table, write the artifact), excluding the dump. Issue 6 target: <= 60 s
 * on the 2-core machine.
 * Usage: bench_kvcalib [n_samples [seq_len [n_layers [threads [deflate]]]]]
 *        (defaults 16 2048 30 0 0; threads 0 = OpenMP default). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "calibrate.h"
#include "dump.h"
#include "progress.h"

typedef struct { uint64_t s; } rng;
static inline uint64_t nx(rng *r)
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}
/* cheap approximately normal deviate: centred sum of four 16-bit uniforms (Irwin-Hall), unit variance */
static inline float gs(rng *r)
{
    uint64_t u = nx(r);
    double s = (double)(u & 0xffff) + (double)((u >> 16) & 0xffff) + (double)((u >> 32) & 0xffff) + (double)(u >> 48);
    return (float)((s / 65536.0 - 2.0) * 1.7320508075688772);
}

int main(int argc, char **argv)
{
    int64_t N = argc > 1 ? atoll(argv[1]) : 16, L = argc > 2 ? atoll(argv[2]) : 2048;
    int n_layers = argc > 3 ? atoi(argv[3]) : 30, threads = argc > 4 ? atoi(argv[4]) : 0;
    int deflate = argc > 5 ? atoi(argv[5]) : 0;
    const int H = 3, D = 64, KVD = H * D;
    char dump[256], out[256];
    snprintf(dump, sizeof dump, "/tmp/kvq_bench_kvcalib_%d.h5", (int)getpid());
    snprintf(out, sizeof out, "/tmp/kvq_bench_kvcalib_%d.safetensors", (int)getpid());

    kvq_dump_meta *m = calloc(1, sizeof *m);
    int64_t *offs = malloc((size_t)N * sizeof *offs);
    int32_t *tok = malloc((size_t)L * sizeof *tok);
    size_t per = (size_t)L * KVD;
    float *kp = malloc(per * sizeof *kp), *k = malloc(per * sizeof *k), *v = malloc(per * sizeof *v);
    float *fk = malloc(per * sizeof *fk), *fv = malloc(per * sizeof *fv);
    if (!m || !offs || !tok || !kp || !k || !v || !fk || !fv) return 1;
    for (int64_t s = 0; s < N; s++) offs[s] = s * L;
    for (int64_t t = 0; t < L; t++) tok[t] = (int32_t)(t % 49152);
    snprintf(m->kvq_version, sizeof m->kvq_version, "bench");
    snprintf(m->model_path, sizeof m->model_path, "synthetic");
    snprintf(m->model_sha256, sizeof m->model_sha256, "%064d", 0);
    snprintf(m->model_arch, sizeof m->model_arch, "llama");
    kvq_hparams hp = {.n_layers = n_layers, .dim = 576, .hidden_dim = 1536, .n_heads = 9, .n_kv_heads = H,
                      .head_dim = D, .vocab_size = 49152, .ctx_len = 8192, .rope_dim = D, .rope_theta = 100000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1.0f};
    kvq_dump_meta_set_hparams(m, &hp);
    snprintf(m->tokenizer, sizeof m->tokenizer, "synthetic");
    snprintf(m->corpus_path, sizeof m->corpus_path, "synthetic");
    snprintf(m->corpus_sha256, sizeof m->corpus_sha256, "%064d", 0);
    snprintf(m->corpus_format, sizeof m->corpus_format, "raw");
    snprintf(m->bos_policy, sizeof m->bos_policy, "none");
    m->n_samples = N;
    m->seq_len = L;
    m->sample_offsets = offs;
    m->dtype = KVQ_DUMP_F16;
    m->has_fisher = true;
    m->layer_first = 0;
    m->layer_last = n_layers - 1;

    kvq_err e = {0};
    kvq_dump_opts o = kvq_dump_opts_default();
    o.deflate_level = deflate;
    o.force = true;
    kvq_dump_writer *w;
    unlink(dump);
    double t0 = kvq_now();
    if (kvq_dump_create(dump, m, &o, &w, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    rng r = {0x9e3779b97f4a7c15ull};
    float scale[64 * 3], off[64 * 3];
    for (int64_t s = 0; s < N; s++) {
        for (int l = 0; l < n_layers; l++) {
            rng cr = {0x1234567ull + (uint64_t)l * 7919u};
            for (int c = 0; c < KVD; c++) {
                scale[c] = expf(gs(&cr));
                off[c] = gs(&cr) * 2;
            }
            for (int64_t t = 0; t < L; t++)
                for (int c = 0; c < KVD; c++) {
                    size_t i = (size_t)t * KVD + c;
                    uint64_t u = nx(&r);
                    float g = gs(&r), tail = (u & 0xff) < 26 ? 6.0f : 1.0f; /* ~10% heavy-tailed keys */
                    kp[i] = t == 0 ? 400.0f : off[c] + scale[c] * g * tail;
                    k[i] = kp[i];
                    v[i] = t == 0 ? 300.0f : 0.5f * gs(&r) * (((u >> 8) & 0xff) < 3 ? 10.0f : 1.0f);
                    float a = gs(&r) * 1e-3f, b = gs(&r) * 1e-3f;
                    fk[i] = a * a * (1 + (float)((u >> 16) & 0xf));
                    fv[i] = b * b * (1 + (float)((u >> 20) & 0xf));
                }
            kvq_dump_layer_data ld = {.k_pre_rope = kp, .k = k, .v = v, .fisher_k_pre_rope = fk, .fisher_v = fv};
            if (kvq_dump_write_layer(w, s, l, &ld, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
        }
        if (kvq_dump_commit_sample(w, s, tok, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    }
    if (kvq_dump_finish(w, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    double t_dump = kvq_now() - t0;
    printf("synthetic dump: %d layers x %d KV heads x %d, N=%lld, L=%lld, f16 + Fisher, deflate %d: written in %.1f s\n",
           n_layers, H, D, (long long)N, (long long)L, deflate, t_dump);

    kvq_calibrate_opts co = kvq_calibrate_defaults(KVQ_FAM("nuq"));
    co.k_bits = co.v_bits = 3;
    co.outlier_frac = 0.01;
    co.n_threads = threads;
    int nt = threads > 0 ? threads : omp_get_max_threads();
    kvq_artifact a;
    double c0 = kvq_now(), cpu0 = (double)clock() / CLOCKS_PER_SEC;
    if (kvq_calibrate_file(dump, out, true, &co, &a, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
    double dt = kvq_now() - c0, cpu = (double)clock() / CLOCKS_PER_SEC - cpu0;
    double tl = 0, te = 0;
    for (int l = 0; l < n_layers; l++) {
        tl += a.k[l].obj_lloyd[0] + a.v[l].obj_lloyd[0];
        te += a.k[l].obj_exact[0] + a.v[l].obj_exact[0];
    }
    printf("kvcalib nuq3-1%% (Fisher, sink 1, fit auto), %d threads: %.2f s wall, %.2f s CPU; objectives lloyd %.6g exact %.6g\n",
           nt, dt, cpu, tl, te);
    if (n_layers != 30) printf("  -> 30 layers (linear in layers): %.1f s wall\n", dt * 30 / n_layers);
    if (N * L != 32768) printf("  -> 16 x 2048 tokens (linear in tokens): %.1f s wall\n", dt * 32768.0 / (double)(N * L));
    kvq_artifact_free(&a);
    const char *keep = getenv("KVQ_BENCH_KEEP");
    if (!(keep && *keep == '1')) {
        unlink(dump);
        unlink(out);
    } else {
        printf("kept %s and %s\n", dump, out);
    }
    free(m);
    free(offs);
    free(tok);
    free(kp);
    free(k);
    free(v);
    free(fk);
    free(fv);
    return 0;
}
