/* bench_kvcache_cuda.c — decode-attention latency of the packed NUQ and KIVI caches vs fp16 caches
 * (own split-K kernel, cuBLAS batched GEMM), and achieved DRAM bandwidth on the bytes
 * each pass reads vs a device-to-device copy measured in the same run.
 * Run by scripts/gpu_kvcache_bench.sh; prints a table (stdout) and writes CSV to argv[1].
 *
 * Method (../.library/device/METHOD.md): CUDA events around each launch sequence, L2
 * flushed (256 MB memset) before every timed run so small caches are not served from
 * L2, warm-up first, median of R runs. Data: pseudo-random codes / fp16 values (never
 * zeros), 1 sparse outlier per (token, KV head) row for K and for V (0.8% of elements
 * at head_dim 128, 1.6% at 64), 1 fp16 sink token.
 *
 * Size-matched copy (NUQ rows and KIVI gD rows): a device-to-device copy moving the same number of bytes
 * as the pass reads (bytes / 2 read + bytes / 2 written), timed the same way, as a share of
 * the 4 GiB copy bandwidth: what the launch, the L2 flush's aftermath and the DRAM ramp leave
 * of the bandwidth at that size, i.e. the %copy no pass of that size reaches past. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "kvcache_cuda.h"

#define CU(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "CUDA error %s: %s\n", #x, cudaGetErrorString(e_)); exit(2); } } while (0)
#define OK(x) do { kvq_err err_; kvq_status s_ = (x); if (s_ != KVQ_OK) { fprintf(stderr, "error %s: %s\n", #x, err_.msg); exit(2); } } while (0)
#define ERR (&err_)

enum { R = 15, WARM = 3 };

static int cmpf(const void *a, const void *b) { float x = *(const float *)a, y = *(const float *)b; return (x > y) - (x < y); }

typedef struct {
    void *flush;
    size_t flush_bytes;
    cudaEvent_t e0, e1;
} timer;

typedef int (*runfn)(void *ctx);

/* median microseconds of fn over R runs, L2 flushed before each */
static double time_us(timer *tm, runfn fn, void *ctx)
{
    float ms[R];
    for (int i = 0; i < WARM; i++) if (fn(ctx)) return -1;
    CU(cudaDeviceSynchronize());
    for (int i = 0; i < R; i++) {
        CU(cudaMemsetAsync(tm->flush, i & 0xff, tm->flush_bytes, 0));
        CU(cudaEventRecord(tm->e0, 0));
        if (fn(ctx)) return -1;
        CU(cudaEventRecord(tm->e1, 0));
        CU(cudaEventSynchronize(tm->e1));
        CU(cudaEventElapsedTime(&ms[i], tm->e0, tm->e1));
    }
    qsort(ms, R, sizeof ms[0], cmpf);
    return ms[R / 2] * 1000.0;
}

typedef struct { kvq_kvcache_cuda *c; float *q, *out; size_t nh; } nuq_ctx;
static int run_nuq(void *p) { nuq_ctx *c = p; kvq_err e; if (kvq_kvcache_cuda_attend(c->c, c->q, c->nh, 0, c->out, 0, 0, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; } return 0; }
typedef struct { kvq_fp16_cache f; float *q, *out, *part; size_t nh; kvq_cublas *cb; void *scr; } f16_ctx;
static int run_f16(void *p) { f16_ctx *c = p; kvq_err e; if (kvq_fp16_attend(&c->f, c->q, c->nh, 0, c->out, c->part, 0, 0, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; } return 0; }
static int run_cublas(void *p) { f16_ctx *c = p; kvq_err e; if (kvq_cublas_attend(c->cb, &c->f, c->q, c->nh, 0, c->out, c->scr, 0, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; } return 0; }
typedef struct { void *a, *b; size_t n; } cp_ctx;
static int run_copy(void *p)
{
    cp_ctx *c = p;
    cudaError_t e = cudaMemcpyAsync(c->b, c->a, c->n, cudaMemcpyDeviceToDevice, 0);
    return e != cudaSuccess;
}

/* the size-matched copy (see the header): % of the 4 GiB copy bandwidth, its time in *us;
 * 0 (not measured) when bytes / 2 exceeds the 4 GiB buffers */
static double matched_copy_pct(timer *tm, cp_ctx *big, double bytes, double bw_copy, double *us)
{
    cp_ctx c = *big;
    *us = 0;
    if (bytes / 2 > (double)big->n) return 0;
    c.n = (size_t)(bytes / 2) & ~(size_t)15;
    *us = time_us(tm, run_copy, &c);
    return 100.0 * (2.0 * c.n / (*us * 1e-6) / 1e9) / bw_copy;
}

/* whether n is one of the comma-separated numbers of list */
static int in_list(const char *list, size_t n)
{
    for (const char *p = list; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p) return 0;
        if (v > 0 && (size_t)v == n) return 1;
        p = *end == ',' ? end + 1 : end;
    }
    return 0;
}

int main(int argc, char **argv)
{
    FILE *csv = argc > 1 ? fopen(argv[1], "w") : NULL;
    const double mem_limit = argc > 2 ? atof(argv[2]) : 100e9; /* bytes of caches allowed at once */
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    timer tm;
    tm.flush_bytes = 256u << 20;
    CU(cudaMalloc(&tm.flush, tm.flush_bytes));
    CU(cudaEventCreate(&tm.e0));
    CU(cudaEventCreate(&tm.e1));
    /* copy bandwidth: 4 GiB device-to-device, bytes read + written */
    cp_ctx cp = {0, 0, (size_t)4 << 30};
    CU(cudaMalloc(&cp.a, cp.n));
    CU(cudaMalloc(&cp.b, cp.n));
    OK(kvq_cuda_fill_half(cp.a, cp.n / 2, 7, ERR));
    double tcopy = time_us(&tm, run_copy, &cp);
    double bw_copy = 2.0 * cp.n / (tcopy * 1e-6) / 1e9;
    printf("copy bandwidth: %.0f GB/s (4 GiB D2D, read + write, median of %d)\n", bw_copy, R);
    if (csv) fprintf(csv, "copy_GBps,%.1f\nmodel,B,N,kernel,us,bytes,GBps,frac_copy,speedup_vs_fp16\n", bw_copy);
    kvq_cublas *cb = NULL;
    kvq_err cerr;
    if (kvq_cublas_create(&cb, &cerr) != KVQ_OK) printf("cuBLAS baseline skipped: %s\n", cerr.msg);

    struct { const char *name; size_t H, g, D; } models[2] = {{"llama2-7b", 32, 1, 128}, {"smollm2-135m", 3, 3, 64}};
    const size_t Bs[3] = {1, 8, 32}, Ns[5] = {4096, 16384, 32768, 65536, 131072};
    const int quick = getenv("KVQ_BENCH_QUICK") != NULL; /* only B = 1, 32 at N = 32K */
    /* subsets (profiling): KVQ_BENCH_MODEL=name prefix, KVQ_BENCH_B=b, KVQ_BENCH_N=n, KVQ_BENCH_BITS=bits (only
     * that NUQ variant), KVQ_BENCH_NO_FP16=1 (skip the fp16 and cuBLAS baselines; x fp16 columns then read 0) */
    const char *only_model = getenv("KVQ_BENCH_MODEL");
    const long only_b = getenv("KVQ_BENCH_B") ? atol(getenv("KVQ_BENCH_B")) : 0;
    const char *only_n = getenv("KVQ_BENCH_N"); /* one N or a comma-separated list */
    const int only_bits = getenv("KVQ_BENCH_BITS") ? atoi(getenv("KVQ_BENCH_BITS")) : 0;
    const int no_f16 = getenv("KVQ_BENCH_NO_FP16") != NULL;
    /* KVQ_BENCH_FORMAT=nuq or kivi: only that format's rows (default: both; KIVI rows follow the NUQ row of the same shape) */
    const char *fmt = getenv("KVQ_BENCH_FORMAT");
    const int nuq_only = fmt && !strcmp(fmt, "nuq"), kivi_only = fmt && !strcmp(fmt, "kivi");
    const int bits[4] = {4, 3, 2, 4};
    const size_t per_row[4] = {1, 1, 1, 0}; /* the last: nuq4 without sparse outliers (diagnostic) */
    printf("\n%-13s %3s %7s | %9s %9s | %9s %6s %5s | %9s %6s %5s | %9s %6s %5s | %5s | %9s %5s\n", "model", "B", "N", "fp16 us", "cuBLAS us",
           "nuq4 us", "x fp16", "%bw", "nuq3 us", "x fp16", "%bw", "nuq2 us", "x fp16", "%bw", "fp16%", "nuq4-dense", "%bw");
    printf("%-13s %3s %7s | %9s %9s | %9s %6s %5s | %9s %6s %5s | %9s %6s %5s | %9s %6s %5s\n", "(KIVI rows)", "B", "N", "fp16 us", "cuBLAS us",
           "k2g32 us", "x fp16", "%bw", "k4g32 us", "x fp16", "%bw", "k2gD us", "x fp16", "%bw", "k4gD us", "x fp16", "%bw");
    for (int mi = 0; mi < 2; mi++)
        for (int bi = 0; bi < 3; bi++)
            for (int ni = 0; ni < 5; ni++) {
                const size_t H = models[mi].H, g = models[mi].g, D = models[mi].D, B = Bs[bi], N = Ns[ni], nh = H * g;
                if (quick && (B == 8 || N != 32768)) continue;
                if ((only_model && strncmp(models[mi].name, only_model, strlen(only_model))) || (only_b && (size_t)only_b != B) ||
                    (only_n && !in_list(only_n, N)))
                    continue;
                const double f16_bytes = 2.0 * B * H * N * D * 2;
                if (f16_bytes > mem_limit) continue;
                f16_ctx fc;
                memset(&fc, 0, sizeof fc);
                fc.nh = nh;
                fc.cb = cb;
                uint16_t *k16, *v16;
                CU(cudaMalloc((void **)&k16, B * H * N * D * 2));
                CU(cudaMalloc((void **)&v16, B * H * N * D * 2));
                OK(kvq_cuda_fill_half(k16, B * H * N * D, 11 + N, ERR));
                OK(kvq_cuda_fill_half(v16, B * H * N * D, 13 + N, ERR));
                fc.f = (kvq_fp16_cache){B, H, D, N, N, k16, v16};
                CU(cudaMalloc((void **)&fc.q, B * nh * D * 4));
                CU(cudaMalloc((void **)&fc.out, B * nh * D * 4));
                {
                    float *hq = malloc(B * nh * D * 4);
                    for (size_t i = 0; i < B * nh * D; i++) hq[i] = (float)sin((double)i * 0.7);
                    CU(cudaMemcpy(fc.q, hq, B * nh * D * 4, cudaMemcpyHostToDevice));
                    free(hq);
                }
                CU(cudaMalloc((void **)&fc.part, kvq_fp16_attend_scratch(&fc.f, nh, 0) * 4));
                double t16 = no_f16 ? 0 : time_us(&tm, run_f16, &fc), tcb = -1;
                if (cb && !no_f16) {
                    CU(cudaMalloc(&fc.scr, kvq_cublas_attend_scratch(&fc.f, nh)));
                    tcb = time_us(&tm, run_cublas, &fc);
                    CU(cudaFree(fc.scr));
                }
                CU(cudaFree(k16));
                CU(cudaFree(v16));
                CU(cudaFree(fc.part));
                double bw16 = f16_bytes / (t16 * 1e-6) / 1e9;
                if (csv) {
                    fprintf(csv, "%s,%zu,%zu,fp16,%.2f,%.0f,%.1f,%.3f,1\n", models[mi].name, B, N, t16, f16_bytes, bw16, bw16 / bw_copy);
                    if (cb && !no_f16) fprintf(csv, "%s,%zu,%zu,cublas,%.2f,%.0f,%.1f,%.3f,%.3f\n", models[mi].name, B, N, tcb, f16_bytes,
                                    f16_bytes / (tcb * 1e-6) / 1e9, f16_bytes / (tcb * 1e-6) / 1e9 / bw_copy, t16 / tcb);
                }
                double tq[4], bwq[4], nq_mus[4] = {0}, nq_mpct[4] = {0};
                for (int k = 0; k < 4 && !kivi_only; k++) {
                    tq[k] = bwq[k] = 0;
                    if (only_bits && (bits[k] != only_bits || per_row[k] == 0)) continue;
                    float lev[16];
                    size_t nl = (size_t)1 << bits[k];
                    for (size_t j = 0; j < nl; j++) lev[j] = -1.0f + 2.0f * (float)j / (float)(nl - 1);
                    float *lo = malloc(H * D * 4), *hi = malloc(H * D * 4);
                    for (size_t c = 0; c < H * D; c++) { lo[c] = -1; hi[c] = 1; }
                    kvq_kvcache_config cfg;
                    memset(&cfg, 0, sizeof cfg);
                    cfg.format = KVQ_KVCACHE_NUQ; cfg.n_seqs = B; cfg.n_kv_heads = H; cfg.head_dim = D; cfg.max_tokens = N;
                    cfg.k_bits = cfg.v_bits = bits[k]; cfg.n_sink = 1; cfg.outlier_frac = 0.01;
                    cfg.rope.rope_dim = D; cfg.rope.rope_theta = 10000;
                    cfg.k_tables = cfg.v_tables = 1; cfg.k_levels = lev; cfg.v_levels = lev; cfg.k_lower = lo; cfg.k_upper = hi;
                    cfg.outlier_cap = N;
                    nuq_ctx nc = {NULL, fc.q, fc.out, nh};
                    OK(kvq_kvcache_cuda_create(&nc.c, &cfg, ERR));
                    OK(kvq_kvcache_cuda_fill_random(nc.c, N, per_row[k], 99 + k, ERR));
                    tq[k] = time_us(&tm, run_nuq, &nc);
                    double by = (double)kvq_kvcache_cuda_bytes_read(nc.c);
                    bwq[k] = by / (tq[k] * 1e-6) / 1e9;
                    if (csv) fprintf(csv, "%s,%zu,%zu,nuq%d%s,%.2f,%.0f,%.1f,%.3f,%.3f\n", models[mi].name, B, N, bits[k], per_row[k] ? "" : "-dense", tq[k], by, bwq[k],
                                     bwq[k] / bw_copy, t16 / tq[k]);
                    if (per_row[k]) { /* the issue-46 target: the pass's rate against a copy of its bytes, same run */
                        nq_mpct[k] = matched_copy_pct(&tm, &cp, by, bw_copy, &nq_mus[k]);
                        if (csv && nq_mus[k] > 0) fprintf(csv, "%s,%zu,%zu,copy-matched-nuq%d,%.2f,%.0f,%.1f,%.3f,0\n", models[mi].name, B, N, bits[k],
                                                    nq_mus[k], by, by / (nq_mus[k] * 1e-6) / 1e9, nq_mpct[k] / 100);
                    }
                    kvq_kvcache_cuda_free(nc.c);
                    free(lo);
                    free(hi);
                }
                if (!kivi_only)
                    printf("%-13s %3zu %7zu | %9.1f %9.1f | %9.1f %6.2f %5.0f | %9.1f %6.2f %5.0f | %9.1f %6.2f %5.0f | %5.0f | %9.1f %5.0f\n", models[mi].name, B, N,
                           t16, tcb, tq[0], t16 / tq[0], 100 * bwq[0] / bw_copy, tq[1], t16 / tq[1], 100 * bwq[1] / bw_copy, tq[2], t16 / tq[2],
                           100 * bwq[2] / bw_copy, 100 * bw16 / bw_copy, tq[3], 100 * bwq[3] / bw_copy);
                if (!kivi_only) {
                    printf("%-13s %3zu %7zu | nuq / size-matched copy:", models[mi].name, B, N);
                    for (int k = 0; k < 3; k++)
                        if (nq_mus[k] > 0) printf(" nuq%d %.2f (copy %.1f us, %.0f%% of copy)", bits[k], nq_mus[k] / tq[k], nq_mus[k], nq_mpct[k]);
                    printf("\n");
                }
                /* KIVI (post-RoPE keys as in KIVI; residual 128, no sink): 2 and 4 bits at group 32 (KIVI's default) and
                 * 128 (head_dim 64: 64) */
                double tk[4], bwk[4], mpct[4] = {0}, mus[4] = {0};
                for (int k = 0; k < 4 && !nuq_only; k++) {
                    const int kb = (k & 1) ? 4 : 2;
                    const size_t G = k < 2 ? 32 : D < 128 ? D : 128;
                    tk[k] = bwk[k] = 0;
                    if (only_bits && kb != only_bits) continue;
                    kvq_kvcache_config cfg;
                    memset(&cfg, 0, sizeof cfg);
                    cfg.format = KVQ_KVCACHE_KIVI; cfg.n_seqs = B; cfg.n_kv_heads = H; cfg.head_dim = D; cfg.max_tokens = N;
                    cfg.k_bits = cfg.v_bits = kb; cfg.group = G; cfg.residual = 128; cfg.post_rope = true;
                    cfg.rope.rope_dim = D; cfg.rope.rope_theta = 10000;
                    nuq_ctx nc = {NULL, fc.q, fc.out, nh};
                    OK(kvq_kvcache_cuda_create(&nc.c, &cfg, ERR));
                    OK(kvq_kvcache_cuda_fill_random(nc.c, N, 0, 199 + k, ERR));
                    tk[k] = time_us(&tm, run_nuq, &nc);
                    double by = (double)kvq_kvcache_cuda_bytes_read(nc.c);
                    bwk[k] = by / (tk[k] * 1e-6) / 1e9;
                    if (csv) fprintf(csv, "%s,%zu,%zu,kivi%d-g%zu,%.2f,%.0f,%.1f,%.3f,%.3f\n", models[mi].name, B, N, kb, G, tk[k], by, bwk[k],
                                     bwk[k] / bw_copy, t16 / tk[k]);
                    if (k >= 2) {
                        mpct[k] = matched_copy_pct(&tm, &cp, by, bw_copy, &mus[k]);
                        if (csv && mus[k] > 0) fprintf(csv, "%s,%zu,%zu,copy-matched-kivi%d-g%zu,%.2f,%.0f,%.1f,%.3f,0\n", models[mi].name, B, N, kb, G,
                                         mus[k], by, by / (mus[k] * 1e-6) / 1e9, mpct[k] / 100);
                    }
                    kvq_kvcache_cuda_free(nc.c);
                }
                if (!nuq_only)
                    printf("%-13s %3zu %7zu | %9.1f %9.1f | %9.1f %6.2f %5.0f | %9.1f %6.2f %5.0f | %9.1f %6.2f %5.0f | %9.1f %6.2f %5.0f\n",
                           models[mi].name, B, N, t16, tcb, tk[0], t16 / tk[0], 100 * bwk[0] / bw_copy, tk[1], t16 / tk[1], 100 * bwk[1] / bw_copy,
                           tk[2], t16 / tk[2], 100 * bwk[2] / bw_copy, tk[3], t16 / tk[3], 100 * bwk[3] / bw_copy);
                if (!nuq_only && (mus[2] > 0 || mus[3] > 0)) {
                    printf("%-13s %3zu %7zu | size-matched copy:", models[mi].name, B, N);
                    for (int k = 2; k < 4; k++)
                        if (mus[k] > 0) printf(" k%dgD bytes %.1f us (%.0f%% of copy)", k == 2 ? 2 : 4, mus[k], mpct[k]);
                        else printf(" k%dgD bytes over 8 GiB (not measured)", k == 2 ? 2 : 4);
                    printf("\n");
                }
                CU(cudaFree(fc.q));
                CU(cudaFree(fc.out));
                fflush(stdout);
                if (csv) fflush(csv);
            }
    CU(cudaFree(cp.a));
    CU(cudaFree(cp.b));
    if (cb) kvq_cublas_free(cb);
    if (csv) fclose(csv);
    return 0;
}
