/* gpu_check_attn.c — gpu_check --attn (also run by --synthetic): the bf16 mode's tensor-core attention
 * forward (kernels/cuda/cuda_attn_tc.cu) against the exact fp32 kernel (cuda_ops.cu attn_k) on the same
 * random inputs, through kvq_cuda_attention: head_dim 64 and 128, T not a multiple of the 64-query /
 * 64-key tiles, GQA and MQA, prefixes shorter and longer than a key tile, sliding windows that cut the
 * prefix. Per case the relative L2 of the outputs and the largest |Δlse| (natural log), under the bounds
 * of forward_cuda.h (bf16 mode); then the kernel times alone at a Llama-3-8B layer's shape (32/8 heads,
 * head_dim 128), per call and per 32-layer window, information only. */
#include "gpu_check.h"

/* forward_cuda.h, "Math modes", KVQ_CUDA_BF16: the bounds of the tensor-core attention vs the fp32 one */
#define ATTN_TC_OUT_REL_L2 2e-2
#define ATTN_TC_LSE_ABS 5e-2

typedef struct {
    int T, P, nh, nkv, hd, window;
} attn_case;

static void attn_inputs(const kvq_cuda_attn_shape *s, uint64_t seed, float **q, float **k, float **v, float **pk, float **pv)
{
    uint64_t r = seed;
    size_t nq = (size_t)s->T * s->n_heads * s->head_dim, nk = (size_t)s->T * s->n_kv_heads * s->head_dim,
           np = (size_t)s->P * s->n_kv_heads * s->head_dim;
    *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
    *pk = np ? malloc(np * sizeof(float)) : NULL, *pv = np ? malloc(np * sizeof(float)) : NULL;
    /* scores q.k/sqrt(head_dim) with a standard deviation of about 2: softmax rows neither flat nor one-hot */
    fill(*q, nq, 2.5f, &r);
    fill(*k, nk, 2.5f, &r);
    fill(*v, nk, 1.0f, &r);
    if (np) fill(*pk, np, 2.5f, &r), fill(*pv, np, 1.0f, &r);
}

int run_attn_check(void)
{
    if (!kvq_cuda_compiled()) {
        printf("\n### bf16 tensor-core attention vs fp32: needs a CUDA build: FAIL\n");
        return 0;
    }
    const attn_case cases[] = {
        {300, 5, 8, 2, 64, 0},    /* GQA 4, prefix */
        {257, 0, 4, 1, 128, 0},   /* MQA, no prefix */
        {130, 70, 4, 2, 128, 0},  /* prefix longer than a key tile */
        {300, 7, 8, 2, 128, 100}, /* window 100 after a prefix */
        {200, 3, 4, 4, 64, 40},   /* MHA, window 40 */
        {1000, 9, 8, 2, 128, 333},
    };
    kvq_err err = {0};
    int all_ok = 1;
    printf("\n### bf16 tensor-core attention (--math bf16) vs the fp32 kernel, random inputs\n\n");
    printf("| T | prefix | heads | head_dim | window | out rel L2 | max abs dlse | bound | result |\n|---|---|---|---|---|---|---|---|---|\n");
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const attn_case *ac = &cases[c];
        kvq_cuda_attn_shape s = {ac->T, ac->P, ac->nh, ac->nkv, ac->hd, ac->window, ac->P};
        float *q, *k, *v, *pk, *pv;
        attn_inputs(&s, 4242 + c, &q, &k, &v, &pk, &pv);
        size_t nq = (size_t)s.T * s.n_heads * s.head_dim, nl = (size_t)s.n_heads * s.T;
        float *o32 = malloc(nq * sizeof(float)), *o16 = malloc(nq * sizeof(float));
        float *l32 = malloc(nl * sizeof(float)), *l16 = malloc(nl * sizeof(float));
        TRYE(kvq_cuda_attention(0, &s, KVQ_CUDA_EXACT, q, k, v, pk, pv, o32, l32, 0, NULL, &err));
        TRYE(kvq_cuda_attention(0, &s, KVQ_CUDA_BF16, q, k, v, pk, pv, o16, l16, 0, NULL, &err));
        double rel = rel_l2(o16, o32, nq), dl = 0;
        int finite = 1;
        for (size_t i = 0; i < nl; i++) {
            double d = fabs((double)l16[i] - l32[i]);
            if (!(d == d) || !isfinite(l16[i])) finite = 0;
            if (d > dl) dl = d;
        }
        for (size_t i = 0; i < nq; i++) finite &= isfinite(o16[i]) != 0;
        int ok = finite && rel <= ATTN_TC_OUT_REL_L2 && dl <= ATTN_TC_LSE_ABS;
        printf("| %d | %d | %d/%d | %d | %d | %.2e | %.2e | %.0e / %.0e | %s |\n", s.T, s.P, s.n_heads, s.n_kv_heads, s.head_dim,
               s.window, rel, dl, ATTN_TC_OUT_REL_L2, ATTN_TC_LSE_ABS, ok ? "PASS" : "FAIL");
        all_ok &= ok;
        free(q), free(k), free(v), free(pk), free(pv), free(o32), free(o16), free(l32), free(l16);
    }
    /* kernel times alone at a Llama-3-8B layer (information only): median of 5 calls, CUDA events */
    printf("\nattention kernel alone, Llama-3-8B layer shape (32/8 heads, head_dim 128, causal, no prefix), median of 5:\n\n");
    printf("| T | fp32 ms | bf16 tensor cores ms | speed-up | bf16 ms x 32 layers | bf16 TFLOP/s (causal) |\n|---|---|---|---|---|---|\n");
    const int Ts[] = {512, 1024, 2048};
    for (size_t c = 0; c < sizeof Ts / sizeof *Ts; c++) {
        kvq_cuda_attn_shape s = {Ts[c], 0, 32, 8, 128, 0, 0};
        float *q, *k, *v, *pk, *pv;
        attn_inputs(&s, 99 + c, &q, &k, &v, &pk, &pv);
        float *o = malloc((size_t)s.T * 32 * 128 * sizeof(float));
        double t32 = 0, t16 = 0;
        TRYE(kvq_cuda_attention(0, &s, KVQ_CUDA_EXACT, q, k, v, pk, pv, o, NULL, 5, &t32, &err));
        TRYE(kvq_cuda_attention(0, &s, KVQ_CUDA_BF16, q, k, v, pk, pv, o, NULL, 5, &t16, &err));
        double flop = 4.0 * 128 * 32 * ((double)s.T * (s.T + 1) / 2); /* QK^T and PV over the causal pairs */
        printf("| %d | %.3f | %.3f | %.2fx | %.2f | %.1f |\n", s.T, t32, t16, t32 / t16, 32 * t16, flop / (t16 * 1e-3) / 1e12);
        free(q), free(k), free(v), free(o);
    }
    printf("\nbf16 tensor-core attention vs fp32: %s\n", all_ok ? "PASS" : "FAIL");
    return all_ok;
}
