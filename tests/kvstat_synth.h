/* kvstat_synth.h — synthetic "dump" for the kvstat tests: planted outlier key
 * channels, known-kurtosis value channels, real RoPE between k_pre_rope and
 * k, and attention with a sink at position 0 plus a pivot token.
 *
 * Shape: 4 layers, 4 query heads, 2 KV heads, head_dim 16 (kv_dim 32),
 * N = 3 samples, L = 64 positions (KVQ_TEST_QUICK does not change it: it is small).
 * Planted, per layer j:
 *   k_pre_rope channel 3+j ~ 8 + 2·N(0,1)   (outlier, ~8x the others)
 *   k_pre_rope channel 21  ~ 5·N(0,1)       (outlier, ~5x)
 *   other key channels     ~ N(0,1)
 *   v channel 5 Laplace(0, 1/√2) (kurtosis 6), channel 7 uniform ±√3 (kurtosis 1.8),
 *   other value channels N(0,1)
 *   k = RoPE(k_pre_rope), interleaved pairs (2i, 2i+1), θ = 10000, angle t·θ^(−2i/16)
 *   attention (every query head): query t > 0 gives 0.6 to position 0 and
 *   the rest uniformly to 1..t; in sample 1 for layers >= 2 query t >= 10
 *   gives 0.4 to position 0, 0.3 to position 10 and 0.3 uniformly to the
 *   others (1..t without 10; all to 10 when there is none). Query 0 gives 1 to 0.
 *   tokens: sample s position t -> 1000·s + t, position 0 -> 1 (BOS)
 */
#ifndef KVSTAT_SYNTH_H
#define KVSTAT_SYNTH_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvstats.h"

#define SY_NL 4
#define SY_H 4
#define SY_HKV 2
#define SY_D 16
#define SY_KV (SY_HKV * SY_D)
#define SY_N 3
#define SY_L 64
#define SY_PIVOT 10

typedef struct {
    float *t[KVQ_KVT_COUNT][SY_NL];
    const float *tp[KVQ_KVT_COUNT][SY_NL]; /* const views for kvq_kvsrc_mem */
    int32_t tokens[SY_N * SY_L];
    kvq_kvsrc_mem mem;
    kvq_kvsrc src;
} synth_t;

static inline uint64_t sy_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double sy_unif(uint64_t *s) { return ((double)(sy_next(s) >> 11) + 0.5) / 9007199254740992.0; }
static inline double sy_gauss(uint64_t *s) { return sqrt(-2 * log(sy_unif(s))) * cos(2 * M_PI * sy_unif(s)); }

static inline int sy_outlier1(int layer) { return 3 + layer; }
#define SY_OUTLIER2 21

/* Fill everything; with_attn / with_fisher choose the optional tensors. Returns 0 on success. */
static inline int synth_init(synth_t *y, int with_attn, int with_fisher)
{
    memset(y, 0, sizeof *y);
    uint64_t rng = 12345;
    size_t per = (size_t)SY_N * SY_L * SY_KV;
    for (int j = 0; j < SY_NL; j++) {
        for (int t = 0; t < KVQ_KVT_COUNT; t++) {
            if (t == KVQ_KVT_ATTN_RECEIVED && !with_attn) continue;
            if ((t == KVQ_KVT_FISHER_K_PRE_ROPE || t == KVQ_KVT_FISHER_V) && !with_fisher) continue;
            size_t n = t == KVQ_KVT_ATTN_RECEIVED ? (size_t)SY_N * SY_H * SY_L : per;
            y->t[t][j] = calloc(n, sizeof(float));
            if (!y->t[t][j]) return -1;
            y->tp[t][j] = y->t[t][j];
        }
        float *kp = y->t[KVQ_KVT_K_PRE_ROPE][j], *k = y->t[KVQ_KVT_K][j], *v = y->t[KVQ_KVT_V][j];
        for (int s = 0; s < SY_N; s++)
            for (int p = 0; p < SY_L; p++) {
                float *rk = kp + ((size_t)s * SY_L + p) * SY_KV, *rr = k + ((size_t)s * SY_L + p) * SY_KV;
                float *rv = v + ((size_t)s * SY_L + p) * SY_KV;
                for (int c = 0; c < SY_KV; c++) {
                    double g = sy_gauss(&rng);
                    rk[c] = (float)(c == sy_outlier1(j) ? 8 + 2 * g : c == SY_OUTLIER2 ? 5 * g : g);
                    double u = sy_unif(&rng);
                    if (c == 5) rv[c] = (float)(u < 0.5 ? log(2 * u) / sqrt(2.0) : -log(2 * (1 - u)) / sqrt(2.0));
                    else if (c == 7) rv[c] = (float)((2 * u - 1) * sqrt(3.0));
                    else rv[c] = (float)sy_gauss(&rng);
                }
                for (int h = 0; h < SY_HKV; h++)
                    for (int i = 0; i < SY_D / 2; i++) {
                        double a = p * pow(10000.0, -2.0 * i / SY_D);
                        int c0 = h * SY_D + 2 * i;
                        double x0 = rk[c0], x1 = rk[c0 + 1];
                        rr[c0] = (float)(x0 * cos(a) - x1 * sin(a));
                        rr[c0 + 1] = (float)(x0 * sin(a) + x1 * cos(a));
                    }
            }
        if (with_fisher)
            for (size_t i = 0; i < per; i++) {
                y->t[KVQ_KVT_FISHER_K_PRE_ROPE][j][i] = 2.0f;
                y->t[KVQ_KVT_FISHER_V][j][i] = 0.5f;
            }
        if (with_attn) {
            float *a = y->t[KVQ_KVT_ATTN_RECEIVED][j];
            for (int s = 0; s < SY_N; s++)
                for (int h = 0; h < SY_H; h++) {
                    double recv[SY_L] = {0};
                    for (int q = 0; q < SY_L; q++) {
                        if (q == 0) { recv[0] += 1; continue; }
                        bool piv = s == 1 && j >= 2 && q >= SY_PIVOT;
                        if (!piv) {
                            recv[0] += 0.6;
                            for (int kk = 1; kk <= q; kk++) recv[kk] += 0.4 / q;
                        } else {
                            recv[0] += 0.4;
                            int others = q - 1; /* 1..q without the pivot */
                            if (others == 0) recv[SY_PIVOT] += 0.6;
                            else {
                                recv[SY_PIVOT] += 0.3;
                                for (int kk = 1; kk <= q; kk++) if (kk != SY_PIVOT) recv[kk] += 0.3 / others;
                            }
                        }
                    }
                    for (int p = 0; p < SY_L; p++) a[((size_t)s * SY_H + h) * SY_L + p] = (float)recv[p];
                }
        }
    }
    for (int s = 0; s < SY_N; s++)
        for (int p = 0; p < SY_L; p++) y->tokens[s * SY_L + p] = p == 0 ? 1 : 1000 * s + p;
    for (int t = 0; t < KVQ_KVT_COUNT; t++) y->mem.t[t] = y->tp[t][0] ? y->tp[t] : NULL;
    y->mem.tokens = y->tokens;
    kvq_kvsrc *src = &y->src;
    src->n_layers = SY_NL;
    src->layer_first = 0;
    src->layer_last = SY_NL - 1;
    src->n_heads = SY_H;
    src->n_kv_heads = SY_HKV;
    src->head_dim = SY_D;
    src->n_samples = SY_N;
    src->seq_len = SY_L;
    strcpy(src->model, "synthetic");
    return kvq_kvsrc_mem_init(src, &y->mem, NULL) == KVQ_OK ? 0 : -1;
}

static inline void synth_free(synth_t *y)
{
    for (int t = 0; t < KVQ_KVT_COUNT; t++)
        for (int j = 0; j < SY_NL; j++) free(y->t[t][j]);
}

#endif
