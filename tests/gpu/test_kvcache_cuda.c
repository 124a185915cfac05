/* test_kvcache_cuda.c — CUDA packed KV cache vs the CPU reference (kernels/kvcache/kvcache.h).
 * Built only when CUDA=1 and run only by scripts/gpu_kvcache_bench.sh (CI has no GPU).
 * Plain C with its own checks (no Check framework: the device image lacks it).
 *
 * For each configuration: the same fp16-representable random K/V are appended in
 * chunks to a CPU cache and to the GPU cache; the GPU state, downloaded, must equal
 * the CPU state bit for bit (codes, value scales, sparse rows and entries; fp16 rows
 * within 1 ulp: RoPE's cos/sin in double may differ by an ulp between libm and CUDA);
 * decode attention on the GPU (output poisoned with NaN before every run, fresh random
 * queries for every check, several split-K settings) must match the CPU's float64
 * attention within 2e-5 relative L2 (every NUQ code width: P·V on the tensor cores with fp16 levels and p·r
 * in two fp16 parts; formats/KVCACHE.md). The fp16 baselines (own kernel, cuBLAS) are
 * checked against float64 attention over the same fp16 cache. KIVI caches (tensor-core and generic decode
 * kernels, both fp32-accurate) the same way at 2e-5, with the rings and scales in the state comparison.
 * Exit status 0 = all pass. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "kvcache_cuda.h"
#include "quant.h"
#include "safetensors.h"
#include "half.h"

static int n_fail, n_pass;
#define CHECK(cond, ...) do { if (cond) n_pass++; else { n_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)
#define CU(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA error %s: %s\n", #x, cudaGetErrorString(e_)); exit(2); } } while (0)
#define OK(x) do { kvq_err err_; kvq_status s_ = (x); if (s_ != KVQ_OK) { printf("error %s: %s\n", #x, err_.msg); exit(2); } } while (0)
/* OK() needs an err in scope: the macro declares its own; functions take &err_ via ERR */
#define ERR (&err_)

#define KVCACHE_SYNTH_SEED 0x1234567887654321ull
#include "../kvcache_synth.h"

static double rel_l2(const float *a, const float *b, size_t n, int *nonfinite)
{
    double num = 0, den = 0;
    *nonfinite = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) (*nonfinite)++;
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void *dmalloc(size_t b) { void *p; CU(cudaMalloc(&p, b ? b : 1)); return p; }
static void poison(void *p, size_t b) { CU(cudaMemset(p, 0xff, b)); } /* 0xffffffff = NaN */

typedef struct {
    size_t B, H, D, g;
    int kb, vb;
    size_t tables, n_sink, NT;
    double f;
    size_t prefix; /* IntactKV prefix positions (0 = none) */
} tcfg;

/* IntactKV prefix (cfg prefix_len > 0): rows 0..P-1 of K, V (fp16-representable) as the post-RoPE prefix of every
 * sequence, on the CPU and the GPU; appending before it must fail on the GPU as on the CPU. Returns P. */
static size_t set_prefixes(kvq_kvcache *cpu, kvq_kvcache_cuda *gpu, const float *K, const float *V, const float *dK, const float *dV,
                           size_t B, size_t NT, size_t C, size_t P, const char *name)
{
    if (!P) return 0;
    kvq_err e1, e2;
    kvq_status s1 = kvq_kvcache_cuda_append(gpu, 0, dK, dV, 1, &e1), s2 = kvq_kvcache_append(cpu, 0, K, V, 1, &e2);
    CHECK(s1 == KVQ_EINVAL && s2 == KVQ_EINVAL && strstr(e1.msg, "prefix"), "%s: append before the prefix: GPU %d '%s', CPU %d", name, (int)s1,
          e1.msg, (int)s2);
    for (size_t s = 0; s < B; s++) {
        OK(kvq_kvcache_set_prefix(cpu, s, K + s * NT * C, V + s * NT * C, ERR));
        OK(kvq_kvcache_cuda_set_prefix(gpu, s, dK + s * NT * C, dV + s * NT * C, ERR));
    }
    s1 = kvq_kvcache_cuda_set_prefix(gpu, 0, dK, dV, &e1);
    CHECK(s1 == KVQ_EINVAL && strstr(e1.msg, "goes first"), "%s: a second set_prefix: GPU %d '%s'", name, (int)s1, e1.msg);
    return P;
}

/* A CPU and a GPU cache of configuration g, and the synthetic K / V rows [B][NT][C] (fp16-representable) they are
 * fed, on the host (K, V) and the device (dK, dV) */
static void setup(const kvq_kvcache_config *g, size_t NT, size_t C, kvq_kvcache **cpu, kvq_kvcache_cuda **gpu, float **K, float **V,
                  float **dK, float **dV)
{
    const size_t n = g->n_seqs * NT * C;
    OK(kvq_kvcache_create(cpu, g, ERR));
    OK(kvq_kvcache_cuda_create(gpu, g, ERR));
    *K = malloc(n * 4);
    *V = malloc(n * 4);
    fill(*K, g->n_seqs * NT, C, 1);
    fill(*V, g->n_seqs * NT, C, 0);
    *dK = dmalloc(n * 4);
    *dV = dmalloc(n * 4);
    CU(cudaMemcpy(*dK, *K, n * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(*dV, *V, n * 4, cudaMemcpyHostToDevice));
}

/* GPU vs CPU attention for max_splits 0, 1 and 3 (or 0 only when one_split), each with fresh random queries and the
 * output poisoned, within relative L2 tol and finite; returns the worst relative L2 */
static double check_attend(kvq_kvcache *cpu, kvq_kvcache_cuda *gpu, size_t B, size_t nh, size_t D, double tol, const char *name, size_t len,
                           int one_split, bool v4cmp)
{
    const size_t nq = B * nh * D, splits[3] = {0, 1, 3};
    float *q = malloc(nq * 4), *o = malloc(nq * 4), *ro = malloc(nq * 4), *dq = dmalloc(nq * 4), *dout = dmalloc(nq * 4);
    double worst = 0;
    for (int k = 0; k < (one_split ? 1 : 3); k++) {
        for (size_t i = 0; i < nq; i++) q[i] = (float)gauss();
        CU(cudaMemcpy(dq, q, nq * 4, cudaMemcpyHostToDevice));
        poison(dout, nq * 4);
        OK(kvq_kvcache_cuda_attend(gpu, dq, nh, 0, dout, splits[k], 1, ERR));
        CU(cudaMemcpy(o, dout, nq * 4, cudaMemcpyDeviceToHost));
        OK(kvq_kvcache_attend(cpu, q, nh, 0, ro, ERR));
        int nf;
        double e = rel_l2(o, ro, nq, &nf);
        if (e > worst) worst = e;
        CHECK(nf == 0 && e <= tol, "%s: len %zu splits %zu: GPU vs CPU attention rel L2 %.3g (tolerance %g), %d non-finite", name, len,
              splits[k], e, tol, nf);
        if (v4cmp) {
            const char *prev = getenv("KVQ_NUQ_KERNEL");
            char keep[16] = "";
            if (prev) snprintf(keep, sizeof keep, "%s", prev);
            setenv("KVQ_NUQ_KERNEL", "v4", 1);
            poison(dout, nq * 4);
            kvq_err e4;
            const kvq_status st = kvq_kvcache_cuda_attend(gpu, dq, nh, 0, dout, splits[k], 1, &e4);
            if (prev) setenv("KVQ_NUQ_KERNEL", keep, 1);
            else unsetenv("KVQ_NUQ_KERNEL");
            if (st != KVQ_OK) { printf("error KVQ_NUQ_KERNEL=v4 attend: %s\n", e4.msg); exit(2); }
            CU(cudaMemcpy(ro, dout, nq * 4, cudaMemcpyDeviceToHost));
            int nf4;
            const double e4r = rel_l2(o, ro, nq, &nf4);
            CHECK(nf4 == 0 && e4r <= 1e-5, "%s: len %zu splits %zu: the v4 kernel's output vs v5's: rel L2 %.3g (tolerance 1e-5), %d non-finite",
                  name, len, splits[k], e4r, nf4);
        }
    }
    free(q); free(o); free(ro);
    CU(cudaFree(dq)); CU(cudaFree(dout));
    return worst;
}

/* Chunked appends of rows [len, NT) of K / V (dK / dV: the same on the device) to both caches; after each
 * step, GPU vs CPU attention for max_splits 0, 1 and 3, each with fresh random queries and the output poisoned,
 * within relative L2 tol and finite. v4cmp (NUQ with 3-bit values, where the kernel versions differ): the v4 kernel's
 * output (KVQ_NUQ_KERNEL=v4) within 1e-5 of v5's (the same arithmetic; the sparse corrections' atomics add in any
 * order, so the last bits may differ; the host emulator checks bit equality without outliers). Returns the worst
 * relative L2. */
static double append_and_check(kvq_kvcache *cpu, kvq_kvcache_cuda *gpu, const float *K, const float *V, const float *dK, const float *dV,
                               size_t B, size_t NT, size_t C, size_t nh, size_t D, size_t len, double tol, const char *name, size_t skew,
                               bool v4cmp)
{
    const size_t steps[] = {1, 3, 57, 1, 200, 7, 1000, 13};
    size_t *sl = malloc(B * sizeof *sl); /* per-sequence lengths: sequence s runs s·skew positions ahead (capped at NT) */
    for (size_t s = 0; s < B; s++) sl[s] = len;
    double worst = 0;
    for (size_t si = 0; len < NT; si++) {
        size_t n = steps[si % 8];
        if (n > NT - len) n = NT - len;
        for (size_t s = 0; s < B; s++) {
            size_t to = len + n + s * skew < NT ? len + n + s * skew : NT, m = to - sl[s];
            OK(kvq_kvcache_append(cpu, s, K + (s * NT + sl[s]) * C, V + (s * NT + sl[s]) * C, m, ERR));
            OK(kvq_kvcache_cuda_append(gpu, s, dK + (s * NT + sl[s]) * C, dV + (s * NT + sl[s]) * C, m, ERR));
            sl[s] = to;
        }
        len += n;
        const double e = check_attend(cpu, gpu, B, nh, D, tol, name, len, 0, v4cmp);
        if (e > worst) worst = e;
    }
    free(sl);
    return worst;
}

/* the arrays both formats share, for sequence s: key code words of the first x.kq[s] positions (NUQ token-minor
 * [B][H][kw][capq], KIVI in tiles [B][H][capq/16][kw][16]), value code words of the first x.vq[s], exact-region fp16
 * rows (keys within 1 ulp: cos/sin in double may differ by an ulp between libm and CUDA). Mismatches are added to
 * *bad and *badh. */
static void compare_codes_rows(const kvq_kvcache_view *x, const kvq_kvcache_view *y, size_t s, size_t H, size_t D, bool kivi, size_t *bad,
                               size_t *badh)
{
    const size_t kw = x->k_head_words;
    for (size_t h = 0; h < H; h++) {
        for (size_t w = 0; w < kw; w++)
            for (size_t q = 0; q < x->kq[s]; q++) {
                size_t blk = (s * H + h) * kw * x->capq, i = kivi ? blk + ((q >> 4) * kw + w) * 16 + (q & 15) : blk + w * x->capq + q;
                *bad += x->kcodes[i] != y->kcodes[i];
            }
        for (size_t q = 0; q < x->vq[s]; q++)
            for (size_t w = 0; w < x->v_head_words; w++) {
                size_t i = ((s * H + h) * x->capq + q) * x->v_head_words + w;
                *bad += x->vcodes[i] != y->vcodes[i];
            }
        for (size_t p = 0; p < x->n_exact && p < x->len[s]; p++)
            for (size_t d = 0; d < D; d++) {
                size_t i = ((s * H + h) * x->n_exact + p) * D + d;
                int dk = (int)x->k16[i] - (int)y->k16[i], dv = (int)x->v16[i] - (int)y->v16[i];
                *badh += (dk > 1 || dk < -1) + (dv != 0);
            }
    }
}

static void compare_state(const kvq_kvcache *a, const kvq_kvcache *b, const tcfg *t, const char *name)
{
    kvq_kvcache_view x, y;
    kvq_kvcache_view_get(a, &x);
    kvq_kvcache_view_get(b, &y);
    size_t H = t->H, bad = 0, badh = 0;
    for (size_t s = 0; s < t->B; s++) {
        CHECK(x.len[s] == y.len[s], "%s: seq %zu length cpu %zu gpu %zu", name, s, x.len[s], y.len[s]);
        CHECK(x.prefix_set[s] == y.prefix_set[s], "%s: seq %zu IntactKV prefix set: cpu %d gpu %d", name, s, x.prefix_set[s], y.prefix_set[s]);
        size_t nq = x.kq[s];
        compare_codes_rows(&x, &y, s, H, t->D, false, &bad, &badh);
        for (size_t q = 0; q < nq; q++) bad += memcmp(x.vscale + (s * x.capq + q) * 2, y.vscale + (s * y.capq + q) * 2, 8) != 0;
        size_t R = x.capq + 1;
        for (size_t h = 0; h < H; h++) {
            const uint32_t *xr = x.krow + (s * H + h) * R, *yr = y.krow + (s * H + h) * R;
            const uint32_t *xv = x.vrow + (s * H + h) * R, *yv = y.vrow + (s * H + h) * R;
            bad += memcmp(xr, yr, (nq + 1) * 4) != 0;
            bad += memcmp(xv, yv, (nq + 1) * 4) != 0;
            bad += memcmp(x.kent + (s * H + h) * x.ent_cap, y.kent + (s * H + h) * y.ent_cap, xr[nq] * 4) != 0;
            bad += memcmp(x.vent + (s * H + h) * x.ent_cap, y.vent + (s * H + h) * y.ent_cap, xv[nq] * 4) != 0;
        }
    }
    CHECK(bad == 0, "%s: %zu mismatching code words / scales / sparse arrays between CPU and GPU append", name, bad);
    CHECK(badh == 0, "%s: %zu fp16 rows differ by more than 1 ulp", name, badh);
}

/* the NUQ configuration of t on synthetic tables: random sorted levels, per-channel thresholds (c % 3 - 1) ± 1.8 (1 + c % 4)
 * (the arrays allocated into *klev, *vlev, *lo, *hi); outlier_cap 16 (small: both stores must grow) */
static void nuq_config(const tcfg *t, kvq_kvcache_config *g, float **klev, float **vlev, float **lo, float **hi)
{
    const size_t C = t->H * t->D, nlk = (size_t)1 << t->kb, nlv = (size_t)1 << t->vb;
    *klev = malloc(t->tables * nlk * 4);
    *vlev = malloc(t->tables * nlv * 4);
    *lo = malloc(C * 4);
    *hi = malloc(C * 4);
    for (size_t i = 0; i < t->tables; i++) { sorted_levels(*klev + i * nlk, nlk); sorted_levels(*vlev + i * nlv, nlv); }
    for (size_t c = 0; c < C; c++) {
        double off = (double)(c % 3) - 1, sc = 1 + (double)(c % 4);
        (*lo)[c] = (float)(off - 1.8 * sc);
        (*hi)[c] = (float)(off + 1.8 * sc);
    }
    memset(g, 0, sizeof *g);
    g->format = KVQ_KVCACHE_NUQ; g->n_seqs = t->B; g->n_kv_heads = t->H; g->head_dim = t->D; g->max_tokens = t->NT;
    g->k_bits = t->kb; g->v_bits = t->vb; g->n_sink = t->n_sink; g->outlier_frac = t->f;
    g->rope.rope_dim = t->D / 2 * 2; g->rope.rope_theta = 10000;
    g->k_tables = g->v_tables = t->tables; g->k_levels = *klev; g->v_levels = *vlev; g->k_lower = *lo; g->k_upper = *hi;
    g->outlier_cap = 16;
    g->prefix_len = t->prefix;
}

static void run(const tcfg *t, const char *name)
{
    const size_t C = t->H * t->D, NT = t->NT, nh = t->H * t->g;
    float *klev, *vlev, *lo, *hi;
    kvq_kvcache_config g;
    nuq_config(t, &g, &klev, &vlev, &lo, &hi);
    kvq_kvcache *cpu, *mirror;
    kvq_kvcache_cuda *gpu;
    float *K, *V, *dK, *dV;
    setup(&g, NT, C, &cpu, &gpu, &K, &V, &dK, &dV);
    float *q = malloc(t->B * nh * t->D * 4), *o = malloc(t->B * nh * t->D * 4), *ro = malloc(t->B * nh * t->D * 4);
    float *dq = dmalloc(t->B * nh * t->D * 4), *dout = dmalloc(t->B * nh * t->D * 4);
    /* P·V runs on the tensor cores at every code width (fp16 levels, p·r as two fp16 parts, fp32 sums;
     * formats/KVCACHE.md "Decode attention (GPU)"): 2e-5 (the host emulator sees up to 1.6e-6) */
    size_t len = set_prefixes(cpu, gpu, K, V, dK, dV, t->B, NT, C, t->prefix, name);
    append_and_check(cpu, gpu, K, V, dK, dV, t->B, NT, C, nh, t->D, len, 2e-5, name, 0, t->vb == 3);
    len = NT;
    /* state equality */
    kvq_kvcache_stats st;
    kvq_kvcache_stats_get(cpu, &st);
    g.outlier_cap = st.outlier_capacity * 8 + 1024;
    OK(kvq_kvcache_create(&mirror, &g, ERR));
    OK(kvq_kvcache_cuda_download(gpu, mirror, ERR));
    compare_state(cpu, mirror, t, name);
    if (t->f > 0) CHECK(st.k_outliers > 16 && st.v_outliers > 16, "%s: expected outliers to exercise growth, found %zu/%zu", name, st.k_outliers, st.v_outliers);
    printf("  %-28s B=%zu H=%zu D=%zu g=%zu k%d/v%d len %zu: outliers K %zu V %zu\n", name, t->B, t->H, t->D, t->g, t->kb, t->vb, len,
           st.k_outliers, st.v_outliers);

    /* fp16 baselines over the CPU cache's reconstruction (post-RoPE keys, fp16) */
    size_t cap = NT;
    uint16_t *hk = malloc(t->B * t->H * cap * t->D * 2), *hv = malloc(t->B * t->H * cap * t->D * 2);
    float *kd = malloc(NT * C * 4), *vd = malloc(NT * C * 4), *kf = malloc(t->B * NT * C * 4), *vf = malloc(t->B * NT * C * 4);
    for (size_t s = 0; s < t->B; s++) {
        OK(kvq_kvcache_dequant(cpu, s, kd, vd, ERR));
        for (size_t p = 0; p < NT; p++)
            for (size_t c = 0; c < C; c++) {
                size_t h = c / t->D, d = c % t->D, i = ((s * t->H + h) * cap + p) * t->D + d;
                hk[i] = kvq_f32_to_f16(kvq_round_fp16(kd[p * C + c]));
                hv[i] = kvq_f32_to_f16(kvq_round_fp16(vd[p * C + c]));
                kf[(s * NT + p) * C + c] = kvq_f16_to_f32(hk[i]);
                vf[(s * NT + p) * C + c] = kvq_f16_to_f32(hv[i]);
            }
    }
    uint16_t *dk16 = dmalloc(t->B * t->H * cap * t->D * 2), *dv16 = dmalloc(t->B * t->H * cap * t->D * 2);
    CU(cudaMemcpy(dk16, hk, t->B * t->H * cap * t->D * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dv16, hv, t->B * t->H * cap * t->D * 2, cudaMemcpyHostToDevice));
    kvq_fp16_cache fc = {t->B, t->H, t->D, cap, NT, dk16, dv16};
    /* float64 reference over the fp16 data */
    for (size_t i = 0; i < t->B * nh * t->D; i++) q[i] = (float)gauss();
    CU(cudaMemcpy(dq, q, t->B * nh * t->D * 4, cudaMemcpyHostToDevice));
    double *pr = malloc(NT * sizeof *pr);
    for (size_t s = 0; s < t->B; s++)
        for (size_t j = 0; j < nh; j++) {
            size_t h = j / t->g;
            double m = -INFINITY, l = 0;
            for (size_t p = 0; p < NT; p++) {
                double a = 0;
                for (size_t d = 0; d < t->D; d++) a += (double)q[(s * nh + j) * t->D + d] * kf[(s * NT + p) * C + h * t->D + d];
                pr[p] = a / sqrt((double)t->D);
                if (pr[p] > m) m = pr[p];
            }
            for (size_t p = 0; p < NT; p++) { pr[p] = exp(pr[p] - m); l += pr[p]; }
            for (size_t d = 0; d < t->D; d++) {
                double a = 0;
                for (size_t p = 0; p < NT; p++) a += pr[p] * vf[(s * NT + p) * C + h * t->D + d];
                ro[(s * nh + j) * t->D + d] = (float)(a / l);
            }
        }
    size_t L = t->D / 8;
    if (t->D % 8 == 0 && !(L & (L - 1))) {
        float *part = dmalloc(kvq_fp16_attend_scratch(&fc, nh, 0) * 4);
        poison(dout, t->B * nh * t->D * 4);
        OK(kvq_fp16_attend(&fc, dq, nh, 0, dout, part, 0, 1, ERR));
        CU(cudaMemcpy(o, dout, t->B * nh * t->D * 4, cudaMemcpyDeviceToHost));
        int nf;
        double e = rel_l2(o, ro, t->B * nh * t->D, &nf);
        CHECK(nf == 0 && e <= 2e-5, "%s: fp16 kernel vs float64 rel L2 %.3g, %d non-finite", name, e, nf);
        CU(cudaFree(part));
        kvq_cublas *cb = NULL;
        kvq_err e2;
        if (kvq_cublas_create(&cb, &e2) == KVQ_OK) {
            void *scr = dmalloc(kvq_cublas_attend_scratch(&fc, nh));
            poison(dout, t->B * nh * t->D * 4);
            OK(kvq_cublas_attend(cb, &fc, dq, nh, 0, dout, scr, 1, ERR));
            CU(cudaMemcpy(o, dout, t->B * nh * t->D * 4, cudaMemcpyDeviceToHost));
            e = rel_l2(o, ro, t->B * nh * t->D, &nf);
            CHECK(nf == 0 && e <= 5e-3, "%s: cuBLAS path vs float64 rel L2 %.3g (fp16 operands), %d non-finite", name, e, nf);
            CU(cudaFree(scr));
            kvq_cublas_free(cb);
        } else {
            printf("  SKIP cuBLAS check: %s\n", e2.msg);
        }
    }
    free(pr); free(hk); free(hv); free(kd); free(vd); free(kf); free(vf);
    CU(cudaFree(dk16)); CU(cudaFree(dv16));
    CU(cudaFree(dK)); CU(cudaFree(dV)); CU(cudaFree(dq)); CU(cudaFree(dout));
    free(K); free(V); free(q); free(o); free(ro); free(klev); free(vlev); free(lo); free(hi);
    kvq_kvcache_free(cpu);
    kvq_kvcache_free(mirror);
    kvq_kvcache_cuda_free(gpu);
}

/* KIVI: the same CPU-vs-GPU protocol (chunked appends of the same K/V, state equal bit for bit, attention
 * within 2e-5 at every step; outputs poisoned, fresh queries, several split settings) */
typedef struct {
    size_t B, H, D, g;
    int kb, vb;
    size_t G, R;
    int post;
    size_t n_sink, NT;
    size_t prefix; /* IntactKV prefix positions (0 = none) */
    size_t skew;   /* sequence s is s·skew positions longer than sequence 0 (capped at NT) */
} kcfg;

static void compare_state_kivi(const kvq_kvcache *a, const kvq_kvcache *b, const kcfg *t, const char *name)
{
    kvq_kvcache_view x, y;
    kvq_kvcache_view_get(a, &x);
    kvq_kvcache_view_get(b, &y);
    const size_t H = t->H, D = t->D, C = H * D, G = t->G;
    size_t bad = 0, badh = 0;
    for (size_t s = 0; s < t->B; s++) {
        CHECK(x.len[s] == y.len[s] && x.kq[s] == y.kq[s] && x.vq[s] == y.vq[s], "%s: seq %zu length/kq/vq cpu %zu/%zu/%zu gpu %zu/%zu/%zu",
              name, s, x.len[s], x.kq[s], x.vq[s], y.len[s], y.kq[s], y.vq[s]);
        CHECK(x.prefix_set[s] == y.prefix_set[s], "%s: seq %zu IntactKV prefix set: cpu %d gpu %d", name, s, x.prefix_set[s], y.prefix_set[s]);
        compare_codes_rows(&x, &y, s, H, D, true, &bad, &badh);
        const size_t ngk = x.capq / G + 1;
        bad += memcmp(x.kscale + s * ngk * C * 2, y.kscale + s * ngk * C * 2, (x.kq[s] / G) * C * 8) != 0;
        for (size_t h = 0; h < H; h++) /* [B][H][capq][D/G][2]: the quantized positions of each head */
            bad += memcmp(x.vscale + (s * H + h) * x.capq * (D / G) * 2, y.vscale + (s * H + h) * y.capq * (D / G) * 2,
                          x.vq[s] * (D / G) * 8) != 0;
        /* the ring slots of the positions not yet quantized (keys or values) */
        size_t q0 = x.kq[s] < x.vq[s] ? x.kq[s] : x.vq[s];
        for (size_t p = x.n_exact + q0; p < x.len[s]; p++) {
            size_t o = (s * x.ring + p % x.ring) * C;
            bad += memcmp(x.kring + o, y.kring + o, C * 2) != 0;
            bad += memcmp(x.vring + o, y.vring + o, C * 2) != 0;
        }
    }
    CHECK(bad == 0, "%s: %zu mismatching code words / scales / residual rows between CPU and GPU append", name, bad);
    CHECK(badh == 0, "%s: %zu fp16 rows differ by more than 1 ulp", name, badh);
}

static void run_kivi(const kcfg *t, const char *name)
{
    const size_t C = t->H * t->D, NT = t->NT, nh = t->H * t->g;
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_KIVI; g.n_seqs = t->B; g.n_kv_heads = t->H; g.head_dim = t->D; g.max_tokens = NT;
    g.k_bits = t->kb; g.v_bits = t->vb; g.n_sink = t->n_sink; g.group = t->G; g.residual = t->R; g.post_rope = t->post;
    g.rope.rope_dim = t->D / 2 * 2; g.rope.rope_theta = 10000; g.prefix_len = t->prefix;
    kvq_kvcache *cpu, *mirror;
    kvq_kvcache_cuda *gpu;
    float *K, *V, *dK, *dV;
    setup(&g, NT, C, &cpu, &gpu, &K, &V, &dK, &dV);
    const size_t len = NT;
    const double worst = append_and_check(cpu, gpu, K, V, dK, dV, t->B, NT, C, nh, t->D,
                                          set_prefixes(cpu, gpu, K, V, dK, dV, t->B, NT, C, t->prefix, name), 2e-5, name, t->skew, false);
    OK(kvq_kvcache_create(&mirror, &g, ERR));
    OK(kvq_kvcache_cuda_download(gpu, mirror, ERR));
    compare_state_kivi(cpu, mirror, t, name);
    printf("  %-28s B=%zu H=%zu D=%zu g=%zu k%d/v%d G=%zu R=%zu %s len %zu: worst rel L2 %.3g\n", name, t->B, t->H, t->D, t->g, t->kb, t->vb,
           t->G, t->R, t->post ? "post-RoPE" : "pre-RoPE", len, worst);
    CU(cudaFree(dK)); CU(cudaFree(dV));
    free(K); free(V);
    kvq_kvcache_free(cpu);
    kvq_kvcache_free(mirror);
    kvq_kvcache_cuda_free(gpu);
}

/* kvq_kvcache_cuda_append_step (one token of every sequence at once) against kvq_kvcache_append of each sequence's
 * token on the CPU. Sequences prefilled to unequal lengths pre[s] by single appends (after the IntactKV prefix when the
 * configuration has one: a step before it is refused), one of them still inside the exact region when pre[s] < n_sink;
 * then `steps` steps, until the longest sequence is full (max_tokens), each step's tokens gathered into [B][kv_dim]
 * device rows. After every step GPU vs CPU attention (fresh queries, output poisoned; all three split settings every
 * 4th step). Halfway, a single append (kvq_kvcache_cuda_append) of the shortest sequence's next token between the
 * steps: it must go on from the exact outlier counts. At the end: one more step refused (a full sequence, KVQ_ENOMEM
 * naming max_tokens) with nothing appended, the state bit for bit (compare_state / compare_state_kivi: lengths, codes,
 * scales, sparse rows and entries, rings), and the bytes an attention pass reads (kvq_kvcache_cuda_bytes_read, from
 * the device's counts after steps) equal to the CPU cache's (kvq_kvcache_stats bytes_k + bytes_v). */
static void run_steps(const kvq_kvcache_config *g0, const size_t *pre, size_t steps, const tcfg *t, const kcfg *kt, double tol, const char *name)
{
    kvq_kvcache_config g = *g0;
    const size_t B = g.n_seqs, H = g.n_kv_heads, D = g.head_dim, C = H * D, nh = H * (t ? t->g : kt->g), P = g.prefix_len;
    size_t NT = 0, smin = 0;
    for (size_t s = 0; s < B; s++) {
        NT = pre[s] > NT ? pre[s] : NT;
        if (pre[s] < pre[smin]) smin = s;
    }
    NT += P + steps;
    g.max_tokens = NT;
    kvq_kvcache *cpu, *mirror;
    kvq_kvcache_cuda *gpu;
    float *K, *V, *dK, *dV;
    setup(&g, NT, C, &cpu, &gpu, &K, &V, &dK, &dV);
    size_t *len = malloc(B * sizeof *len);
    float *sk = dmalloc(B * C * 4), *sv = dmalloc(B * C * 4);
    if (P) {
        kvq_err e1;
        kvq_status s1 = kvq_kvcache_cuda_append_step(gpu, dK, dV, &e1);
        CHECK(s1 == KVQ_EINVAL && strstr(e1.msg, "prefix"), "%s: a step before the prefix: status %d '%s'", name, (int)s1, s1 ? e1.msg : "");
        set_prefixes(cpu, gpu, K, V, dK, dV, B, NT, C, P, name);
    }
    for (size_t s = 0; s < B; s++) {
        len[s] = P + pre[s];
        if (!pre[s]) continue;
        OK(kvq_kvcache_append(cpu, s, K + (s * NT + P) * C, V + (s * NT + P) * C, pre[s], ERR));
        OK(kvq_kvcache_cuda_append(gpu, s, dK + (s * NT + P) * C, dV + (s * NT + P) * C, pre[s], ERR));
    }
    double worst = 0;
    for (size_t st = 0; st < steps; st++) {
        for (size_t s = 0; s < B; s++) {
            const size_t r = s * NT + len[s];
            CU(cudaMemcpy(sk + s * C, dK + r * C, C * 4, cudaMemcpyDeviceToDevice));
            CU(cudaMemcpy(sv + s * C, dV + r * C, C * 4, cudaMemcpyDeviceToDevice));
            OK(kvq_kvcache_append(cpu, s, K + r * C, V + r * C, 1, ERR));
            len[s]++;
        }
        OK(kvq_kvcache_cuda_append_step(gpu, sk, sv, ERR));
        if (st == steps / 2) {
            const size_t r = smin * NT + len[smin];
            OK(kvq_kvcache_append(cpu, smin, K + r * C, V + r * C, 1, ERR));
            OK(kvq_kvcache_cuda_append(gpu, smin, dK + r * C, dV + r * C, 1, ERR));
            len[smin]++;
        }
        const double e = check_attend(cpu, gpu, B, nh, D, tol, name, len[0], st % 4 != 0, false);
        if (e > worst) worst = e;
    }
    kvq_kvcache_stats cs;
    kvq_kvcache_stats_get(cpu, &cs);
    const size_t gb = kvq_kvcache_cuda_bytes_read(gpu);
    CHECK(gb == cs.bytes_k + cs.bytes_v, "%s: after the steps the GPU cache reads %zu bytes per pass, the CPU cache %zu", name, gb,
          cs.bytes_k + cs.bytes_v);
    kvq_err e1;
    kvq_status s1 = kvq_kvcache_cuda_append_step(gpu, sk, sv, &e1);
    CHECK(s1 == KVQ_ENOMEM && strstr(e1.msg, "max_tokens"), "%s: a step with a full sequence: status %d '%s'", name, (int)s1, s1 ? e1.msg : "");
    g.outlier_cap = 2 * D * NT + 1024; /* above whatever the GPU store grew to (its rule clips at D per remaining position) */
    OK(kvq_kvcache_create(&mirror, &g, ERR));
    OK(kvq_kvcache_cuda_download(gpu, mirror, ERR));
    if (t) compare_state(cpu, mirror, t, name);
    else compare_state_kivi(cpu, mirror, kt, name);
    printf("  %-28s B=%zu H=%zu D=%zu %s %zu steps at unequal lengths (prefill", name, B, H, D, t ? "NUQ" : "KIVI", steps);
    for (size_t s = 0; s < B; s++) printf(" %zu", pre[s]);
    printf("): worst rel L2 %.3g, outliers K %zu V %zu\n", worst, cs.k_outliers, cs.v_outliers);
    CU(cudaFree(dK)); CU(cudaFree(dV)); CU(cudaFree(sk)); CU(cudaFree(sv));
    free(K); free(V); free(len);
    kvq_kvcache_free(cpu);
    kvq_kvcache_free(mirror);
    kvq_kvcache_cuda_free(gpu);
}

/* the outlier store's hard limit (outlier_max 100, 30% outliers: the store fills in a few steps) under batched steps:
 * while the worst case fits the steps go on unsynchronised, then each step counts its entries exactly; the first step
 * that does not fit fails with KVQ_ENOMEM naming outlier_max and appends nothing (the GPU state equals the CPU cache
 * that took every step before it), and appending that step's tokens to the CPU cache fails too. */
static void run_step_limit(void)
{
    const tcfg t = {2, 2, 16, 1, 4, 4, 1, 1, 64, 0.3, 0};
    float *klev, *vlev, *lo, *hi;
    kvq_kvcache_config g;
    nuq_config(&t, &g, &klev, &vlev, &lo, &hi);
    for (size_t c = 0; c < 32; c++) { lo[c] = -0.5f; hi[c] = 0.5f; }
    g.outlier_cap = 4;
    g.outlier_max = 100;
    const size_t B = t.B, C = t.H * t.D, NT = t.NT;
    kvq_kvcache *cpu, *mirror;
    kvq_kvcache_cuda *gpu;
    float *K, *V, *dK, *dV;
    setup(&g, NT, C, &cpu, &gpu, &K, &V, &dK, &dV);
    float *sk = dmalloc(B * C * 4), *sv = dmalloc(B * C * 4);
    size_t st = 0;
    kvq_err e1;
    kvq_status s1 = KVQ_OK;
    for (; st < NT; st++) {
        for (size_t s = 0; s < B; s++) {
            CU(cudaMemcpy(sk + s * C, dK + (s * NT + st) * C, C * 4, cudaMemcpyDeviceToDevice));
            CU(cudaMemcpy(sv + s * C, dV + (s * NT + st) * C, C * 4, cudaMemcpyDeviceToDevice));
        }
        if ((s1 = kvq_kvcache_cuda_append_step(gpu, sk, sv, &e1)) != KVQ_OK) break;
        for (size_t s = 0; s < B; s++) OK(kvq_kvcache_append(cpu, s, K + (s * NT + st) * C, V + (s * NT + st) * C, 1, ERR));
    }
    CHECK(st > 1 && s1 == KVQ_ENOMEM && strstr(e1.msg, "outlier_max 100") && strstr(e1.msg, "nothing of the step"),
          "step outlier limit: after %zu steps status %d '%s'", st, (int)s1, s1 ? e1.msg : "");
    g.outlier_cap = 1000;
    OK(kvq_kvcache_create(&mirror, &g, ERR));
    OK(kvq_kvcache_cuda_download(gpu, mirror, ERR));
    compare_state(cpu, mirror, &t, "step outlier limit");
    kvq_status s2 = KVQ_OK;
    kvq_err e2;
    for (size_t s = 0; s < B && s2 == KVQ_OK && st < NT; s++) s2 = kvq_kvcache_append(cpu, s, K + (s * NT + st) * C, V + (s * NT + st) * C, 1, &e2);
    CHECK(s2 == KVQ_ENOMEM, "step outlier limit: the CPU cache takes the refused step's tokens (status %d)", (int)s2);
    printf("  step outlier limit           %zu steps, then refused: %s\n", st, s1 ? e1.msg : "(none)");
    CU(cudaFree(dK)); CU(cudaFree(dV)); CU(cudaFree(sk)); CU(cudaFree(sv));
    free(K); free(V); free(klev); free(vlev); free(lo); free(hi);
    kvq_kvcache_free(cpu);
    kvq_kvcache_free(mirror);
    kvq_kvcache_cuda_free(gpu);
}

static void run_limit(void)
{
    /* hard outlier limit on the GPU: fails cleanly, tokens before stay */
    size_t H = 2, D = 16, C = 32, NT = 64;
    float klev[16], vlev[16], lo[32], hi[32];
    sorted_levels(klev, 16);
    sorted_levels(vlev, 16);
    for (size_t i = 0; i < C; i++) { lo[i] = -0.5f; hi[i] = 0.5f; }
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_NUQ; g.n_seqs = 1; g.n_kv_heads = H; g.head_dim = D; g.max_tokens = NT;
    g.k_bits = g.v_bits = 4; g.n_sink = 1; g.outlier_frac = 0.3; g.rope.rope_dim = D; g.rope.rope_theta = 10000;
    g.k_tables = g.v_tables = 1; g.k_levels = klev; g.v_levels = vlev; g.k_lower = lo; g.k_upper = hi;
    g.outlier_cap = 4; g.outlier_max = 100;
    kvq_kvcache_cuda *gpu;
    kvq_kvcache *cpu;

    OK(kvq_kvcache_cuda_create(&gpu, &g, ERR));
    OK(kvq_kvcache_create(&cpu, &g, ERR));
    float *K = malloc(NT * C * 4), *V = malloc(NT * C * 4);
    fill(K, NT, C, 1);
    fill(V, NT, C, 0);
    float *dK = dmalloc(NT * C * 4), *dV = dmalloc(NT * C * 4);
    CU(cudaMemcpy(dK, K, NT * C * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dV, V, NT * C * 4, cudaMemcpyHostToDevice));
    kvq_err e1, e2;
    kvq_status s1 = kvq_kvcache_cuda_append(gpu, 0, dK, dV, NT, &e1), s2 = kvq_kvcache_append(cpu, 0, K, V, NT, &e2);
    CHECK(s1 == KVQ_ENOMEM && strstr(e1.msg, "outlier_max 100"), "GPU outlier limit: status %d, message '%s'", (int)s1, e1.msg);
    CHECK(s2 == KVQ_ENOMEM, "CPU outlier limit: status %d", (int)s2);
    CHECK(kvq_kvcache_len(cpu, 0) > 1, "CPU kept %zu tokens", kvq_kvcache_len(cpu, 0));
    kvq_kvcache *mirror;
    g.outlier_cap = 1000;
    OK(kvq_kvcache_create(&mirror, &g, ERR));
    OK(kvq_kvcache_cuda_download(gpu, mirror, ERR));
    CHECK(kvq_kvcache_len(mirror, 0) == kvq_kvcache_len(cpu, 0), "GPU kept %zu tokens, CPU %zu", kvq_kvcache_len(mirror, 0), kvq_kvcache_len(cpu, 0));
    tcfg t = {1, H, D, 1, 4, 4, 1, 1, NT, 0.3, 0};
    compare_state(cpu, mirror, &t, "outlier limit");
    kvq_kvcache_free(mirror);
    kvq_kvcache_free(cpu);
    kvq_kvcache_cuda_free(gpu);
    CU(cudaFree(dK)); CU(cudaFree(dV));
    free(K); free(V);
}

/* The decode's split schedule must not change its result. At Llama heads, B = 8, 9K positions kivi_fast runs more than
 * two waves of blocks on an H200, so the plan cuts the range's last chunk into two shorter splits (kv::fast_plan),
 * takes the residual tail in one split per row (kv::tail_plan) and prefetches the value codes (4-bit; kivi_fast's
 * vpref); with max_splits 3 all three are off (uniform chunks, generic_plan's tail, one wave), the schedule the CPU
 * comparisons above check. SmolLM2-like heads (3 KV heads × 64, 3 query heads each), B = 32, 20K positions: more than two
 * waves with the value prefetch at both widths. A cache of random codes (no CPU reference at this size), outputs
 * poisoned before each run. */
static void run_kivi_schedules(int bits, size_t B, size_t H, size_t gq, size_t D, size_t N)
{
    const size_t nh = H * gq, nq = B * nh * D;
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_KIVI; g.n_seqs = B; g.n_kv_heads = H; g.head_dim = D; g.max_tokens = N;
    g.k_bits = g.v_bits = bits; g.group = D < 128 ? D : 128; g.residual = 128; g.post_rope = true;
    g.rope.rope_dim = D; g.rope.rope_theta = 10000;
    kvq_kvcache_cuda *c;
    OK(kvq_kvcache_cuda_create(&c, &g, ERR));
    OK(kvq_kvcache_cuda_fill_random(c, N, 0, 77 + bits, ERR));
    float *q = malloc(nq * sizeof *q), *o0 = malloc(nq * sizeof *o0), *o3 = malloc(nq * sizeof *o3);
    for (size_t i = 0; i < nq; i++) q[i] = (float)gauss();
    float *dq = dmalloc(nq * sizeof *dq), *dout = dmalloc(nq * sizeof *dout);
    CU(cudaMemcpy(dq, q, nq * sizeof *q, cudaMemcpyHostToDevice));
    poison(dout, nq * sizeof *dout);
    OK(kvq_kvcache_cuda_attend(c, dq, nh, 0, dout, 0, 1, ERR));
    CU(cudaMemcpy(o0, dout, nq * sizeof *o0, cudaMemcpyDeviceToHost));
    poison(dout, nq * sizeof *dout);
    OK(kvq_kvcache_cuda_attend(c, dq, nh, 0, dout, 3, 1, ERR));
    CU(cudaMemcpy(o3, dout, nq * sizeof *o3, cudaMemcpyDeviceToHost));
    int nf0, nf3;
    const double e = rel_l2(o0, o3, nq, &nf0);
    rel_l2(o3, o0, nq, &nf3);
    CHECK(nf0 == 0 && nf3 == 0 && e <= 1e-5, "kivi%d schedules (B=%zu H=%zu g=%zu D=%zu len %zu): rel L2 %.3g between the plan's split schedule and "
          "3 uniform splits (limit 1e-5), %d / %d non-finite", bits, B, H, gq, D, N, e, nf0, nf3);
    printf("  kivi%d schedules              B=%zu H=%zu g=%zu D=%zu len %zu: rel L2 %.3g between plan and 3 splits\n", bits, B, H, gq, D, N, e);
    CU(cudaFree(dq)); CU(cudaFree(dout));
    free(q); free(o0); free(o3);
    kvq_kvcache_cuda_free(c);
}

/* configurations the GPU cache must refuse with a clear error instead of corrupting memory or failing later */
static void run_refusals(void)
{
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_KIVI; g.n_seqs = 1; g.n_kv_heads = 2; g.head_dim = 64; g.max_tokens = 300;
    g.k_bits = g.v_bits = 2; g.group = 32; g.residual = 64; g.post_rope = true; g.rope.rope_dim = 64; g.rope.rope_theta = 10000;
    kvq_kvcache_cuda *gpu;
    OK(kvq_kvcache_cuda_create(&gpu, &g, ERR));
    /* download into a CPU cache of another group / residual: the scale and ring arrays have other sizes */
    const size_t other[2][2] = {{64, 64}, {32, 0}};
    for (int i = 0; i < 2; i++) {
        kvq_kvcache_config h = g;
        h.group = other[i][0];
        h.residual = other[i][1];
        kvq_kvcache *cpu;
        OK(kvq_kvcache_create(&cpu, &h, ERR));
        kvq_err e;
        kvq_status st = kvq_kvcache_cuda_download(gpu, cpu, &e);
        CHECK(st == KVQ_EMISMATCH, "download into a cache with group %zu residual %zu: status %d (%s)", h.group, h.residual, (int)st,
              st ? e.msg : "ok");
        kvq_kvcache_free(cpu);
    }
    kvq_kvcache_cuda_free(gpu);
    /* an exact region larger than the exact-region kernel's shared memory holds */
    g.max_tokens = 60000;
    g.prefix_len = 50000;
    kvq_err e;
    kvq_status st = kvq_kvcache_cuda_create(&gpu, &g, &e);
    CHECK(st == KVQ_EUNSUPPORTED && strstr(e.msg, "prefix_len"), "create with prefix_len 50000: status %d (%s)", (int)st, st ? e.msg : "ok");
    if (st == KVQ_OK) kvq_kvcache_cuda_free(gpu);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) { printf("SKIP: no CUDA device\n"); return 77; }
    const tcfg cfgs[] = {
        /* B  H  D   g  kb vb tab sink NT    f    prefix */
        {2, 2, 128, 1, 4, 4, 1, 1, 1500, 0.01, 0},  /* Llama-like head */
        {2, 3, 64, 3, 2, 2, 3, 1, 1300, 0.01, 0},   /* SmolLM2 heads (GQA 3), per-head tables */
        {1, 1, 256, 5, 3, 4, 1, 2, 700, 0.05, 0},   /* head_dim 256, GQA 5, 3-bit keys */
        {1, 2, 40, 2, 4, 3, 1, 0, 500, 0.1, 0},     /* head_dim 40, 3-bit values, no sink */
        {1, 2, 9, 12, 2, 4, 1, 1, 300, 0.0, 0},     /* odd head_dim, GQA 12, no outliers */
        {1, 1, 64, 1, 4, 2, 1, 1, 5000, 0.01, 0},   /* longer context: many chunks, RoPE tables */
        {2, 2, 64, 2, 4, 2, 1, 1, 900, 0.01, 4},    /* IntactKV prefix of 4 (and a sink: n_exact 4) */
        {2, 2, 128, 1, 3, 3, 1, 1, 1500, 0.01, 0},  /* Llama-like head, nuq3 (the 3-bit key units and value slots) */
        {2, 3, 64, 3, 3, 2, 3, 1, 1300, 0.01, 0},   /* SmolLM2 heads, 3-bit keys, 2-bit values */
        {3, 4, 8, 2, 3, 3, 4, 1, 300, 0.01, 0},     /* stories260K's heads (head_dim 8, GQA 2; gpu_check --decode) */
        {3, 4, 8, 2, 2, 4, 1, 2, 300, 0.01, 0},     /* the same, 2-bit keys, 4-bit values, 2 sink tokens */
        {2, 4, 16, 1, 4, 2, 4, 1, 300, 0.01, 0},    /* aidreams260K's heads (head_dim 16, MHA) */
    };
    const char *names[] = {"llama-like 4/4", "smollm-like 2/2 gqa3", "d256 3/4 gqa5", "d40 4/3", "d9 2/4 gqa12", "long 4/2", "prefix 4 nuq 4/2", "llama-like 3/3",
                           "smollm-like 3/2 gqa3", "stories-like d8 3/3 gqa2", "stories-like d8 2/4 sink2", "aidreams-like d16 4/2"};
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) run(&cfgs[i], names[i]);
    run_limit();
    run_refusals();
    {
        /* the batched step: NUQ at SmolLM2's heads (2 sink tokens: sequence 0 starts in the exact region, sequence 1 at
         * its edge), a Llama-like head at nuq3, the tiny models' heads, an IntactKV prefix, no outliers */
        const tcfg st[] = {
            /* B  H  D   g  kb vb tab sink NT f     prefix */
            {3, 3, 64, 3, 3, 2, 3, 2, 0, 0.01, 0},
            {2, 2, 128, 1, 3, 3, 1, 1, 0, 0.01, 0},
            {4, 4, 8, 2, 2, 4, 1, 1, 0, 0.05, 0},
            {2, 2, 64, 2, 4, 2, 1, 1, 0, 0.01, 4},
            {2, 2, 40, 2, 4, 3, 1, 0, 0, 0.0, 0},
        };
        const size_t p0[] = {0, 2, 37}, p1[] = {300, 5}, p2[] = {1, 0, 9, 30}, p3[] = {0, 20}, p4[] = {3, 0};
        const size_t *pre[] = {p0, p1, p2, p3, p4}, nsteps[] = {70, 40, 60, 40, 30};
        const char *sn[] = {"step smollm-like 3/2 sink2", "step llama-like 3/3", "step stories-like d8 2/4", "step prefix 4 nuq 4/2",
                            "step d40 4/3 no outliers"};
        for (size_t i = 0; i < sizeof st / sizeof st[0]; i++) {
            float *klev, *vlev, *lo, *hi;
            kvq_kvcache_config g;
            nuq_config(&st[i], &g, &klev, &vlev, &lo, &hi);
            run_steps(&g, pre[i], nsteps[i], &st[i], NULL, 2e-5, sn[i]);
            free(klev); free(vlev); free(lo); free(hi);
        }
        run_step_limit();
        /* KIVI: the per-sequence append without synchronisation, its flushes (G 32, R 64) at each sequence's own
         * boundaries */
        const kcfg kt = {3, 2, 64, 2, 2, 4, 32, 64, 1, 1, 0, 0, 0};
        kvq_kvcache_config g;
        memset(&g, 0, sizeof g);
        g.format = KVQ_KVCACHE_KIVI; g.n_seqs = kt.B; g.n_kv_heads = kt.H; g.head_dim = kt.D; g.k_bits = kt.kb; g.v_bits = kt.vb;
        g.n_sink = kt.n_sink; g.group = kt.G; g.residual = kt.R; g.post_rope = kt.post; g.rope.rope_dim = kt.D; g.rope.rope_theta = 10000;
        const size_t pk[] = {0, 31, 100};
        run_steps(&g, pk, 110, NULL, &kt, 2e-5, "step kivi 2/4 g32 r64");
    }
    const kcfg kc[] = {
        /* B  H  D   g  kb vb  G    R  post sink NT  prefix skew */
        {2, 2, 128, 1, 2, 2, 32, 128, 1, 0, 1500, 0, 0},   /* KIVI's defaults (2-bit, G 32, R 128), Llama-like head */
        {2, 3, 64, 3, 4, 4, 32, 128, 1, 1, 1300, 0, 0},    /* SmolLM2 heads (GQA 3), 4-bit, a sink token */
        {1, 1, 128, 5, 2, 4, 128, 128, 1, 0, 1100, 0, 0},  /* G 128, GQA 5 */
        {1, 2, 48, 2, 4, 2, 16, 32, 1, 2, 900, 0, 0},      /* G 16, head_dim 48 (a partial 64-dim word group) */
        {1, 1, 256, 4, 4, 4, 64, 0, 1, 0, 700, 0, 0},      /* head_dim 256, R 0 */
        {1, 2, 40, 2, 3, 2, 8, 16, 0, 1, 700, 0, 0},       /* pre-RoPE keys, 3-bit, G 8: the generic kernel only */
        {1, 1, 64, 1, 4, 4, 32, 128, 1, 0, 5000, 0, 0},    /* longer context: several chunks */
        {2, 2, 64, 2, 2, 2, 32, 64, 1, 2, 900, 5, 0},      /* IntactKV prefix of 5 (and 2 sink tokens: n_exact 5) */
        {3, 2, 64, 2, 2, 4, 32, 64, 1, 1, 1200, 0, 45},    /* sequences 45 positions apart: per-sequence ranges */
        {1, 2, 18, 2, 2, 4, 6, 18, 0, 1, 600, 0, 0},       /* generic only, head_dim 2 mod 4: two dims per P·V thread */
        {2, 1, 9, 3, 4, 3, 3, 9, 1, 0, 600, 0, 0},         /* generic only, odd head_dim: a half-empty last pair */
        {2, 2, 128, 1, 2, 2, 128, 128, 1, 0, 1100, 0, 0},  /* the benchmark's k2gD: 2/2 at G 128, Llama-like head */
        {1, 2, 128, 1, 4, 4, 128, 128, 1, 0, 1100, 0, 0},  /* the benchmark's k4gD: 4/4 at G 128 */
        {3, 1, 128, 2, 2, 2, 128, 128, 1, 1, 1100, 0, 45}, /* k2gD's integer path with 2 query heads per block, a sink */
        {1, 1, 128, 4, 2, 2, 128, 128, 1, 0, 1100, 0, 0},  /* 2/2 at G 128 with 4 query heads per block: the fp16 path */
        {3, 1, 128, 2, 4, 4, 128, 128, 1, 1, 1100, 0, 45}, /* k4gD's integer path with 2 query heads per block, a sink */
        {1, 1, 128, 4, 4, 4, 128, 128, 1, 0, 1100, 0, 0},  /* 4/4 at G 128 with 4 query heads per block: the fp16 path */
        {9, 32, 64, 2, 2, 2, 32, 64, 1, 0, 400, 0, 0},     /* 576 (query head, sequence) rows: combine_par, not the wide one */
        {2, 3, 64, 3, 2, 2, 64, 64, 1, 1, 1300, 0, 45},    /* SmolLM2's k2gD: the integer path at head_dim 64, 3 query heads */
        {2, 3, 64, 3, 4, 4, 64, 64, 1, 1, 1300, 0, 0},     /* SmolLM2's k4gD */
        {1, 2, 64, 4, 2, 2, 64, 64, 1, 0, 1100, 0, 0},     /* head_dim 64, 4 query heads per block (two full n-tiles) */
        {1, 2, 64, 2, 4, 4, 64, 64, 1, 0, 1100, 0, 0},     /* head_dim 64, 2 query heads per block (one n-tile) */
    };
    const char *kn[] = {"kivi2 g32 r128 llama-like", "kivi4 smollm-like gqa3", "kivi 2/4 g128 gqa5", "kivi 4/2 g16 d48",
                        "kivi4 d256 g64 r0", "kivi 3/2 pre-RoPE g8", "kivi4 long", "kivi2 prefix 5", "kivi 2/4 uneven lengths",
                        "kivi 2/4 pre-RoPE d18 g6", "kivi 4/3 d9 g3", "kivi2 g128 llama-like", "kivi4 g128 llama-like",
                        "kivi2 g128 gqa2 uneven sink", "kivi2 g128 gqa4 fp16 path",
                        "kivi4 g128 gqa2 uneven sink", "kivi4 g128 gqa4 fp16 path", "kivi2 576 rows",
                        "kivi2 g64 smollm-like gqa3", "kivi4 g64 smollm-like gqa3", "kivi2 g64 gqa4", "kivi4 g64 gqa2"};
    for (size_t i = 0; i < sizeof kc / sizeof kc[0]; i++) run_kivi(&kc[i], kn[i]);
    run_kivi_schedules(2, 8, 32, 1, 128, 9000);
    run_kivi_schedules(4, 8, 32, 1, 128, 9000);
    run_kivi_schedules(2, 32, 3, 3, 64, 20000);
    run_kivi_schedules(4, 32, 3, 3, 64, 20000);
    printf("test_kvcache_cuda: %d checks passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
