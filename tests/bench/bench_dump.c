/* bench_dump.c — HDF5 dump write throughput for the default model's shapes
 * (SmolLM2-135M: 30 layers, 3 kv heads x 64, 9 query heads x 64), L = 512,
 * 4 samples, for several storage settings. Reports MB/s of stored bytes
 * (before compression), tokens/s, ms per sample and the compression ratio,
 * so kvdump's HDF5 cost can be compared with the forward pass (the issue
 * wants writing <= 15% of forward time).
 *
 * Data: synthetic activations with a realistic value structure — Gaussian
 * values, per-channel scales spread over ~2 decades with a few 20x outlier
 * channels (keys), squared-gradient magnitudes for Fisher (f32), and smooth
 * attention statistics. Real activations may compress differently.
 *
 *   build/bench/bench_dump [dir]   (default dir: $TMPDIR or /tmp) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dump.h"

enum { N_LAYERS = 30, N_KV = 3, N_HEADS = 9, HEAD_DIM = 64, SEQ = 512, SAMPLES = 4 };

/* xorshift64* + Box-Muller; state passed explicitly */
static double uni(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return ((*s * 2685821657736338717ULL) >> 11) * 0x1p-53;
}
static double gauss(uint64_t *s)
{
    double u = uni(s), v = uni(s);
    return sqrt(-2 * log(u + 1e-300)) * cos(2 * M_PI * v);
}

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    const char *name;
    kvq_dump_dtype dtype;
    int deflate;
    bool q, fisher, attn;
} config;

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char path[1024];
    snprintf(path, sizeof path, "%s/kvq_bench_dump_%d.h5", dir, (int)getpid());

    /* one sample's worth of per-layer data (reused for every layer: chunks compress independently) */
    size_t nkv = (size_t)SEQ * N_KV * HEAD_DIM, nq = (size_t)SEQ * N_HEADS * HEAD_DIM, na = (size_t)N_HEADS * SEQ;
    float *kp = malloc(nkv * 4), *k = malloc(nkv * 4), *v = malloc(nkv * 4), *q = malloc(nq * 4);
    float *fk = malloc(nkv * 4), *fv = malloc(nkv * 4), *ar = malloc(na * 4), *ae = malloc(na * 4);
    uint64_t rs = 0x9e3779b97f4a7c15ULL;
    float scale[N_KV * HEAD_DIM];
    for (int c = 0; c < N_KV * HEAD_DIM; c++) scale[c] = (float)(0.1 * pow(10.0, 2 * uni(&rs)) * (c % 61 == 7 ? 20 : 1));
    for (size_t i = 0; i < nkv; i++) {
        int c = (int)(i % (N_KV * HEAD_DIM));
        kp[i] = (float)(gauss(&rs) * scale[c]);
        k[i] = (float)(gauss(&rs) * scale[c]);
        v[i] = (float)(gauss(&rs) * 0.5);
        fk[i] = (float)(pow(gauss(&rs) * 1e-3 * scale[c], 2));
        fv[i] = (float)(pow(gauss(&rs) * 1e-3, 2));
    }
    for (size_t i = 0; i < nq; i++) q[i] = (float)(gauss(&rs) * 2.0);
    for (size_t i = 0; i < na; i++) {
        size_t t = i % SEQ;
        ar[i] = (float)((t == 0 ? 300.0 : 1.0) * (0.5 + uni(&rs)) * (SEQ - t) / SEQ);
        ae[i] = (float)(log(1.0 + t) * (0.5 + 0.5 * uni(&rs)));
    }
    kvq_dump_layer_data layers[N_LAYERS];
    for (int l = 0; l < N_LAYERS; l++) layers[l] = (kvq_dump_layer_data){kp, k, v, q, fk, fv, ar, ae};
    int32_t tok[SEQ];
    for (int t = 0; t < SEQ; t++) tok[t] = (t * 7919) % 49152;
    int64_t offsets[SAMPLES] = {0, SEQ, 2 * SEQ, 3 * SEQ};

    static kvq_dump_meta m; /* large (paths); static storage, written once before use */
    memset(&m, 0, sizeof m);
    kvq_hparams hp = {.n_layers = N_LAYERS, .dim = 576, .hidden_dim = 1536, .n_heads = N_HEADS, .n_kv_heads = N_KV,
                      .head_dim = HEAD_DIM, .vocab_size = 49152, .ctx_len = 8192, .rope_dim = HEAD_DIM,
                      .rope_theta = 100000.0f, .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1};
    kvq_dump_meta_set_hparams(&m, &hp);
    snprintf(m.kvq_version, sizeof m.kvq_version, "bench");
    snprintf(m.model_arch, sizeof m.model_arch, "llama");
    m.n_samples = SAMPLES;
    m.seq_len = SEQ;
    m.sample_offsets = offsets;
    m.layer_first = 0;
    m.layer_last = N_LAYERS - 1;

    const config cfgs[] = {
        {"f16 k_pre_rope+k+v, no deflate", KVQ_DUMP_F16, 0, false, false, false},
        {"f16 k_pre_rope+k+v, deflate 1", KVQ_DUMP_F16, 1, false, false, false},
        {"f16 k_pre_rope+k+v, deflate 4", KVQ_DUMP_F16, 4, false, false, false},
        {"f16 k_pre_rope+k+v, deflate 6", KVQ_DUMP_F16, 6, false, false, false},
        {"f16 +fisher+attn, no deflate", KVQ_DUMP_F16, 0, false, true, true},
        {"f16 +fisher+attn, deflate 1", KVQ_DUMP_F16, 1, false, true, true},
        {"f16 +fisher+attn, deflate 4", KVQ_DUMP_F16, 4, false, true, true},
        {"f16 +q+fisher+attn, deflate 1", KVQ_DUMP_F16, 1, true, true, true},
        {"f32 k_pre_rope+k+v, deflate 1", KVQ_DUMP_F32, 1, false, false, false},
    };
    printf("bench_dump: %d layers, %d kv heads x %d, %d heads, L = %d, %d samples, file %s\n", N_LAYERS, N_KV, HEAD_DIM,
           N_HEADS, SEQ, SAMPLES, path);
    printf("wall = elapsed time (includes waiting for the CPU on a shared machine); cpu = this process's CPU time\n");
    printf("%-34s %9s %9s %9s %10s %9s %8s\n", "config", "MB/s", "tok/s", "tok/s", "ms/sample", "file MB", "ratio");
    printf("%-34s %9s %9s %9s %10s %9s %8s\n", "", "wall", "wall", "cpu", "cpu", "", "");
    for (size_t i = 0; i < sizeof cfgs / sizeof *cfgs; i++) {
        const config *c = &cfgs[i];
        m.dtype = c->dtype;
        m.has_q = c->q;
        m.has_fisher = c->fisher;
        m.has_attn_stats = c->attn;
        kvq_dump_opts o = kvq_dump_opts_default();
        o.force = true;
        o.deflate_level = c->deflate;
        kvq_err e = {0};
        kvq_dump_writer *w;
        double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        if (kvq_dump_create(path, &m, &o, &w, &e)) {
            fprintf(stderr, "bench_dump: %s\n", e.msg);
            return 1;
        }
        for (int s = 0; s < SAMPLES; s++)
            if (kvq_dump_write_sample(w, s, tok, layers, &e)) {
                fprintf(stderr, "bench_dump: %s\n", e.msg);
                kvq_dump_abort(w, NULL);
                return 1;
            }
        if (kvq_dump_finish(w, &e)) {
            fprintf(stderr, "bench_dump: %s\n", e.msg);
            return 1;
        }
        double dt = clock_s(CLOCK_MONOTONIC) - t0, ct = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
        double esz = c->dtype == KVQ_DUMP_F16 ? 2 : 4;
        double bytes = (double)SAMPLES * N_LAYERS *
                       (3 * nkv * esz + (c->q ? nq * esz : 0) + (c->fisher ? 2 * nkv * 4.0 : 0) + (c->attn ? 2 * na * 4.0 : 0));
        struct stat st;
        stat(path, &st);
        printf("%-34s %9.1f %9.0f %9.0f %10.1f %9.2f %8.3f\n", c->name, bytes / dt / 1e6, SAMPLES * SEQ / dt,
               SAMPLES * SEQ / ct, ct / SAMPLES * 1e3, st.st_size / 1e6, st.st_size / bytes);
        unlink(path);
    }
    free(kp), free(k), free(v), free(q), free(fk), free(fv), free(ar), free(ae);
    return 0;
}
