/* gpu_check_pipeline.c — gpu_check --pipeline (issue 47, docs/MULTIGPU.md): the CUDA pipeline stages against the
 * whole-model CUDA forward and backward.
 *  1. one GPU: two stage workspaces (kvq_forward_cuda_init_stage, layers 0..1 and 2..3 of a synthetic model with
 *     biases and q/k norms) on GPU 0, the residual stream and dL/dx handed over with a device-to-device copy:
 *     logits, loss, NLL, dL/dK pre/post-RoPE, dL/dV and dL/d(embeddings) must be the whole-model run's bits
 *     (same kernels in the same order), fp32 and with a native KV scheme (KIVI-2 boundaries);
 *  2. with two GPUs and NCCL: kvq_pipe_cuda over cuda:0,1 (layers split 2 + 2): the forward of 3 windows as
 *     micro-batches and the backward of one, against the whole model on cuda:0 (bit for bit expected on two GPUs
 *     of one model; printed as relative L2 either way, pass <= 1e-6).
 */
#include <cuda_runtime.h>

#include "gpu_check.h"
#include "pipeline_nccl.h"

typedef struct {
    float *dkpre, *dkpost, *dv;
    size_t per_layer;
} pstore;

static kvq_status pstore_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    (void)err;
    pstore *p = user;
    memcpy(p->dkpre + (size_t)g->layer * p->per_layer, g->dk_pre, p->per_layer * 4);
    memcpy(p->dkpost + (size_t)g->layer * p->per_layer, g->dk_post, p->per_layer * 4);
    memcpy(p->dv + (size_t)g->layer * p->per_layer, g->dv, p->per_layer * 4);
    return KVQ_OK;
}

static int same(const char *what, const void *a, const void *b, size_t bytes, int bits, double rl2, double tol)
{
    int eq = !memcmp(a, b, bytes);
    int ok = bits ? eq : rl2 <= tol;
    printf("  %-44s %s (relative L2 %.2e)%s\n", what, eq ? "bit-identical" : "differs", rl2, ok ? "" : "  FAIL");
    return ok;
}

int run_pipeline_check(void)
{
    printf("\n## pipeline stages (issue 47)\n\n");
    kvq_model m;
    synth_model_ex(&m, 4, 256, 4, 2, 64, 512, 1000, 1, 1, 0, 0, 4747);
    const kvq_hparams *hp = &m.hp;
    const int T = 100, L = hp->n_layers, dim = hp->dim, V = hp->vocab_size, kvd = kvq_kv_dim(hp);
    int32_t tok[3][100];
    uint64_t seed = 47;
    for (int w = 0; w < 3; w++)
        for (int t = 0; t < T; t++) tok[w][t] = (int32_t)(rng_next(&seed) % (uint64_t)V);
    const size_t nl = (size_t)T * V, nx = (size_t)T * dim, ng = (size_t)L * T * kvd;
    float *lg0 = malloc(nl * 4), *lg1 = malloc(nl * 4), *de0 = malloc(nx * 4), *de1 = malloc(nx * 4);
    pstore g0 = {malloc(ng * 4), malloc(ng * 4), malloc(ng * 4), (size_t)T * kvd}, g1 = {malloc(ng * 4), malloc(ng * 4), malloc(ng * 4), (size_t)T * kvd};
    double nll0[100], nll1[100];
    kvq_err err = {0};
    int ok = 1;
    kvq_forward_cuda *whole, *s0, *s1;
    TRYE(kvq_forward_cuda_init(&whole, &m, T, 0, KVQ_FWD_SAVE_ACTIVATIONS, KVQ_CUDA_EXACT, 0, &err));
    TRYE(kvq_forward_cuda_init_stage(&s0, &m, 0, 2, T, 0, KVQ_FWD_SAVE_ACTIVATIONS, KVQ_CUDA_EXACT, 0, &err));
    TRYE(kvq_forward_cuda_init_stage(&s1, &m, 2, L, T, 0, KVQ_FWD_SAVE_ACTIVATIONS, KVQ_CUDA_EXACT, 0, &err));
    scheme_list sl = {0};
    add_scheme(&sl, "kivi", 2, 16, 32, 0, 0, KVQ_KEYS_POST_ROPE, NULL, NULL); /* KIVI-2, group 16, residual 32: boundaries */
    for (int sc = 0; sc < 2; sc++) {
        const kvq_kv_desc *d = sc ? &sl.d[0] : NULL;
        TRYE(kvq_forward_cuda_set_kv(whole, d, &err));
        TRYE(kvq_forward_cuda_set_kv(s0, d, &err));
        TRYE(kvq_forward_cuda_set_kv(s1, d, &err));
        printf("one GPU, stages 0..1 | 2..3, %s:\n", sc ? sl.name[0] : "fp32");
        kvq_fwd_io io = {.tokens = tok[0], .T = T, .logits = lg0, .nll = nll0};
        kvq_fwd_result r0, r1;
        TRYE(kvq_forward_cuda_run(whole, &io, &r0, &err));
        io.logits = lg1, io.nll = nll1;
        TRYE(kvq_forward_cuda_stage(s0, &io, NULL, &r1, &err));
        if (cudaMemcpy(kvq_forward_cuda_stage_x(s1), kvq_forward_cuda_stage_x(s0), nx * 4, cudaMemcpyDeviceToDevice) != cudaSuccess)
            DIE("cudaMemcpy of the stream");
        TRYE(kvq_forward_cuda_stage(s1, &io, kvq_forward_cuda_stage_x(s1), &r1, &err));
        ok &= same("forward logits", lg0, lg1, nl * 4, 1, rel_l2(lg1, lg0, nl), 0);
        ok &= same("forward NLL", nll0, nll1, sizeof nll0, 1, fabs(r1.loss - r0.loss) / fabs(r0.loss), 0);
        kvq_bwd_spec sp0 = {.user = &g0, .xent = true, .grads = pstore_cb, .d_embd = de0}, sp1 = sp0;
        sp1.user = &g1, sp1.d_embd = de1;
        kvq_fwd_io bio = {.tokens = tok[0], .T = T};
        kvq_bwd_result b0, b1, bs;
        TRYE(kvq_forward_cuda_backward(whole, &bio, &sp0, &b0, &err));
        TRYE(kvq_forward_cuda_backward_stage_forward(s0, &bio, &sp1, NULL, &bs, &err));
        if (cudaMemcpy(kvq_forward_cuda_stage_x(s1), kvq_forward_cuda_stage_x(s0), nx * 4, cudaMemcpyDeviceToDevice) != cudaSuccess)
            DIE("cudaMemcpy of the stream");
        TRYE(kvq_forward_cuda_backward_stage_forward(s1, &bio, &sp1, kvq_forward_cuda_stage_x(s1), &b1, &err));
        TRYE(kvq_forward_cuda_backward_stage_backward(s1, &bio, &sp1, NULL, &b1, &err));
        if (cudaMemcpy(kvq_forward_cuda_stage_dx(s0), kvq_forward_cuda_stage_dx(s1), nx * 4, cudaMemcpyDeviceToDevice) != cudaSuccess)
            DIE("cudaMemcpy of dL/dx");
        TRYE(kvq_forward_cuda_backward_stage_backward(s0, &bio, &sp1, kvq_forward_cuda_stage_dx(s0), &bs, &err));
        ok &= same("backward loss", &b0.loss, &b1.loss, sizeof b0.loss, 1, fabs(b1.loss - b0.loss) / fabs(b0.loss), 0);
        ok &= same("dL/dK pre-RoPE", g0.dkpre, g1.dkpre, ng * 4, 1, rel_l2(g1.dkpre, g0.dkpre, ng), 0);
        ok &= same("dL/dK post-RoPE", g0.dkpost, g1.dkpost, ng * 4, 1, rel_l2(g1.dkpost, g0.dkpost, ng), 0);
        ok &= same("dL/dV", g0.dv, g1.dv, ng * 4, 1, rel_l2(g1.dv, g0.dv, ng), 0);
        ok &= same("dL/d(embeddings)", de0, de1, nx * 4, 1, rel_l2(de1, de0, nx), 0);
    }
    kvq_forward_cuda_free(s0);
    kvq_forward_cuda_free(s1);

    char why[512] = "";
    int n_gpu = kvq_cuda_device_count(why, sizeof why);
    if (n_gpu < 2 || !kvq_pipe_nccl_compiled(why, sizeof why)) {
        printf("\nNCCL pipeline over two GPUs: not run (%s)\n", n_gpu < 2 ? "fewer than two GPUs" : why);
    } else {
        TRYE(kvq_forward_cuda_set_kv(whole, NULL, &err));
        int gpus[2] = {0, 1}, first[3] = {0, 2, 4};
        char plan[1024];
        kvq_pipe_cuda *p;
        TRYE(kvq_pipe_cuda_init(&p, &m, gpus, 2, first, T, 0, KVQ_FWD_SAVE_ACTIVATIONS, KVQ_CUDA_EXACT, plan, sizeof plan, &err));
        printf("\nNCCL pipeline over cuda:0,1:\n%s\n", plan);
        float *lgs = malloc(3 * nl * 4);
        kvq_fwd_io ios[3];
        kvq_fwd_result rs[3];
        for (int w = 0; w < 3; w++) ios[w] = (kvq_fwd_io){.tokens = tok[w], .T = T, .logits = lgs + (size_t)w * nl};
        TRYE(kvq_pipe_cuda_run(p, ios, rs, 3, &err));
        for (int w = 0; w < 3; w++) {
            kvq_fwd_io io = {.tokens = tok[w], .T = T, .logits = lg0};
            kvq_fwd_result r0;
            TRYE(kvq_forward_cuda_run(whole, &io, &r0, &err));
            char what[64];
            snprintf(what, sizeof what, "window %d of 3 (micro-batches): logits", w);
            ok &= same(what, lg0, lgs + (size_t)w * nl, nl * 4, 0, rel_l2(lgs + (size_t)w * nl, lg0, nl), 1e-6);
        }
        kvq_bwd_spec sp0 = {.user = &g0, .xent = true, .grads = pstore_cb, .d_embd = de0}, sp1 = sp0;
        sp1.user = &g1, sp1.d_embd = de1;
        kvq_fwd_io bio = {.tokens = tok[1], .T = T};
        kvq_bwd_result b0, b1;
        TRYE(kvq_forward_cuda_backward(whole, &bio, &sp0, &b0, &err));
        TRYE(kvq_pipe_cuda_backward(p, &bio, &sp1, &b1, &err));
        ok &= same("backward loss", &b0.loss, &b1.loss, sizeof b0.loss, 0, fabs(b1.loss - b0.loss) / fabs(b0.loss), 1e-6);
        ok &= same("dL/dK pre-RoPE", g0.dkpre, g1.dkpre, ng * 4, 0, rel_l2(g1.dkpre, g0.dkpre, ng), 1e-6);
        ok &= same("dL/dV", g0.dv, g1.dv, ng * 4, 0, rel_l2(g1.dv, g0.dv, ng), 1e-6);
        ok &= same("dL/d(embeddings)", de0, de1, nx * 4, 0, rel_l2(de1, de0, nx), 1e-6);
        kvq_pipe_cuda_free(p);
        free(lgs);
    }
    kvq_forward_cuda_free(whole);
    free(lg0), free(lg1), free(de0), free(de1);
    free(g0.dkpre), free(g0.dkpost), free(g0.dv), free(g1.dkpre), free(g1.dkpost), free(g1.dv);
    kvq_model_free(&m);
    printf("\npipeline check: %s\n", ok ? "pass" : "FAIL");
    return ok;
}
