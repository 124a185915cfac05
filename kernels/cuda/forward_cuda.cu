// forward_cuda.cu — the Llama forward on one CUDA GPU; see forward_cuda.h.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>
#ifdef _OPENMP
#include <omp.h> /* host-side loops of the CUDA forward (the Makefile passes -fopenmp to nvcc's host compiler) */
#endif

extern "C" {
#include "attention.h"
#include "half.h"
#include "forward_cuda.h"
#include "gguf.h"
#include "ops.h"
}
#include "cuda_ops.cuh"
#include "cuda_sched.cuh"
#include "forward_cuda_impl.cuh"

#define LAUNCH(expr) CU(expr)

extern "C" void kvq_forward_cuda_free(kvq_forward_cuda *g)
{
    if (!g) return;
    if (g->blas) cublasDestroy(g->blas);
    cudaFree(g->wbuf);
    cudaFree(g->abuf);
    cudaFree(g->logits);
    if (g->has_desc && g->kv_state && g->desc.q.fam->cuda->release) g->desc.q.fam->cuda->release(g->kv_state);
    cudaFree(g->d_ex);
    cudaFree(g->d_arg);
    cudaFreeHost(g->hbuf);
    cudaFree(g->sbuf);
    cudaFree(g->sched_buf);
    cudaFree(g->sd_S);
    cudaFree(g->ss_buf);
    cudaFree(g->ss_S);
    cudaFree(g->bbuf);
    cudaFreeHost(g->hbbuf);
    if (g->b_ev) cudaEventDestroy(g->b_ev);
    if (g->st) cudaStreamDestroy(g->st);
    (void)cudaGetLastError();
    delete g;
}

extern "C" kvq_status kvq_forward_cuda_init(kvq_forward_cuda **out, const kvq_model *m, int max_T, int max_P,
                                            unsigned flags, kvq_cuda_math math, int device, kvq_err *err)
{
    return kvq_forward_cuda_init_stage(out, m, 0, m->hp.n_layers, max_T, max_P, flags, math, device, err);
}

extern "C" kvq_status kvq_forward_cuda_init_stage(kvq_forward_cuda **out, const kvq_model *m, int l0, int l1, int max_T,
                                                  int max_P, unsigned flags, kvq_cuda_math math, int device, kvq_err *err)
{
    *out = NULL;
    const kvq_hparams *hp = &m->hp;
    if (l0 < 0 || l1 <= l0 || l1 > hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: stage of layers %d..%d, expected 0 <= first < last <= %d", l0, l1 - 1,
                        hp->n_layers - 1);

    if (max_T <= 0 || max_P < 0 || max_T > (1 << 24) || max_P > (1 << 24))
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: max_T %d / max_P %d out of range (1..2^24 / 0..2^24)", max_T, max_P);
    if (flags & KVQ_FWD_SAVE_ACTIVATIONS) flags |= KVQ_FWD_SAVE_LAYER_INPUTS;
    if (kvq_cu_attn_supported(hp->head_dim))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "CUDA forward: head_dim %d: the attention kernel supports 8, 16, 32, 64, 128; use --device cpu",
                        hp->head_dim);
    if (hp->n_heads % hp->n_kv_heads)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: n_heads %d not a multiple of n_kv_heads %d", hp->n_heads, hp->n_kv_heads);
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_EUNSUPPORTED, "CUDA forward: no usable CUDA device (%s); use --device cpu",
                        ce != cudaSuccess ? cudaGetErrorString(ce) : "none found");
    }
    if (device < 0 || device >= n)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: GPU index %d, but %d GPU(s) found", device, n);

    kvq_forward_cuda *g = new kvq_forward_cuda();
    g->m = m;
    g->dev = device;
    g->l0 = l0;
    g->l1 = l1;
    g->max_T = max_T;
    g->max_P = max_P;
    g->flags = flags;
    g->math = math;
    kvq_status s = KVQ_OK;
    auto fail = [&](kvq_status st) {
        kvq_forward_cuda_free(g);
        return st;
    };
#define TRY(expr)                                 \
    do {                                          \
        if ((s = (expr)) != KVQ_OK) return fail(s); \
    } while (0)
#define CUI(call)                                                                  \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess) return fail(cu_fail(err, e_, #call, __FILE__, __LINE__));     \
    } while (0)
#define CBI(call)                                                                  \
    do {                                                                           \
        cublasStatus_t s_ = (call);                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) return fail(cb_fail(err, s_, #call, __FILE__, __LINE__)); \
    } while (0)

    CUI(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUI(cudaGetDeviceProperties(&prop, device));
    CUI(cudaStreamCreateWithFlags(&g->st, cudaStreamNonBlocking));
    CBI(cublasCreate(&g->blas));
    CBI(cublasSetStream(g->blas, g->st));
    CBI(cublasSetMathMode(g->blas, math == KVQ_CUDA_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                   : math == KVQ_CUDA_BF16 ? CUBLAS_DEFAULT_MATH
                                                           : CUBLAS_PEDANTIC_MATH));
    g->bf16 = math == KVQ_CUDA_BF16;
    {
        // KVQ_ATTN_TC=0: the bf16 mode keeps the fp32 attention kernel (same-run comparisons, forward_cuda.h)
        const char *tc = getenv("KVQ_ATTN_TC");
        g->attn_tc = g->bf16 && !(tc && !strcmp(tc, "0"));
        const char *sh = getenv("KVQ_SCHED_HOST");
        g->sched_host = sh && !strcmp(sh, "1");
        const char *sp = getenv("KVQ_SCHED_PRESCORE");
        // KVQ_SCHED_PRESCORE: 1 always, 0 never, unset: when the scores take at most a quarter of the free memory
        g->sched_pre = !(sp && !strcmp(sp, "0"));
        g->sched_pre_forced = sp && !strcmp(sp, "1");
    }
    snprintf(g->name, sizeof g->name, "%.200s (sm_%d%d, %.1f GiB), %s weights, cuBLAS %s%s", prop.name, prop.major, prop.minor,
             prop.totalGlobalMem / 1073741824.0, g->bf16 ? "bf16" : "fp32",
             math == KVQ_CUDA_TF32   ? "TF32 tensor cores (fast mode, ~1e-3)"
             : math == KVQ_CUDA_BF16 ? "BF16 GEMMs with fp32 accumulation (fast mode, ~1e-2)"
                                     : "FP32 pedantic (TF32 off, exactness mode)",
             !g->bf16                                     ? ""
             : !g->attn_tc                                ? ", attention fp32 (KVQ_ATTN_TC=0)"
             : hp->head_dim == 64 || hp->head_dim == 128 ? ", attention bf16 tensor cores"
                                                          : ", attention fp32 (bf16 tensor cores need head_dim 64 or 128)");

    // ---- weights ----
    const size_t dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim, V = hp->vocab_size;
    const size_t NL = hp->n_layers;
    const bool tied = m->output.data == m->tok_embd.data;
    carve w;
    g->L.resize(NL);
    const size_t we = g->bf16 ? 2 : 4; // bytes per GEMM-weight element
    // a stage holds its layers, the embedding table when it starts at layer 0, the final norm and the LM head when it
    // ends at the last (tied: the embedding table again, unless the stage holds both ends)
    const bool has_embd = l0 == 0, has_head = (size_t)l1 == NL, head_own = has_head && (!tied || !has_embd);
    for (int pass = 0; pass < 2; pass++) {
        w.off = 0;
        if (has_embd) w.take_as(&g->tok_embd, V * dim, we);
        if (has_head) w.take(&g->out_norm, dim);
        if (head_own) w.take_as(&g->output, V * dim, we);
        for (size_t l = (size_t)l0; l < (size_t)l1; l++) {
            dev_layer &d = g->L[l];
            w.take(&d.attn_norm, dim);
            w.take_as(&d.wq, qd * dim, we);
            w.take_as(&d.wk, kvd * dim, we);
            w.take_as(&d.wv, kvd * dim, we);
            w.take_as(&d.wo, dim * qd, we);
            w.take(&d.ffn_norm, dim);
            const kvq_layer_weights *hl = &m->layers[l];
            if (hl->bq) {
                w.take(&d.bq, qd);
                w.take(&d.bk, kvd);
                w.take(&d.bv, kvd);
            }
            if (hl->bo) w.take(&d.bo, dim);
            if (hl->q_norm) {
                w.take(&d.q_norm, (size_t)hp->head_dim);
                w.take(&d.k_norm, (size_t)hp->head_dim);
            }
            w.take_as(&d.w_gate, hid * dim, we);
            w.take_as(&d.w_up, hid * dim, we);
            w.take_as(&d.w_down, dim * hid, we);
        }
        if (pass == 0) {
            g->weight_bytes = w.off;
            TRY(dev_alloc(g, &g->wbuf, w.off, g->bf16 ? "the bf16 weights" : "the fp32 weights", err));
            w.base = (char *)g->wbuf;
        }
    }
    if (tied && has_embd && has_head) g->output = g->tok_embd;
    std::vector<unsigned short> hb; // host bf16 staging of a block of rows
    std::vector<float> hf;          // host fp32 staging of a block of rows (matrices not stored in fp32)
    auto up = [&](float *d, const float *h, size_t nf) { return cudaMemcpy(d, h, nf * sizeof(float), cudaMemcpyHostToDevice); };
    // a weight matrix of any host storage (model.h kvq_mat) as fp32 or bf16 on the device, in blocks of rows
    auto upw = [&](float *d, const kvq_mat *mt) {
        const size_t cols = (size_t)mt->cols, rows = (size_t)mt->rows;
        const float *f = kvq_mat_f32(mt);
        if (f && !g->bf16) return up(d, f, rows * cols);
        if (g->bf16 && mt->type == KVQ_GGML_BF16 && mt->row_bytes == cols * sizeof(unsigned short))
            return cudaMemcpy(d, mt->data, rows * cols * sizeof(unsigned short), cudaMemcpyHostToDevice); // bf16 as stored
        const size_t nb = std::max<size_t>(1, ((size_t)1 << 24) / cols); // 64 MiB of fp32 rows at a time
        for (size_t r0 = 0; r0 < rows; r0 += nb) {
            const size_t n = std::min(nb, rows - r0), ne = n * cols;
            const float *src = f ? f + r0 * cols : NULL;
            if (!f) {
                hf.resize(ne);
                kvq_mat_rows(mt, (int)r0, (int)n, hf.data());
                src = hf.data();
            }
            cudaError_t e;
            if (g->bf16) {
                hb.resize(ne);
                unsigned short *hbp = hb.data();
#pragma omp parallel for schedule(static) if (ne > (1u << 16))
                for (size_t i = 0; i < ne; i++) hbp[i] = kvq_f32_to_bf16(src[i]);
                e = cudaMemcpy(reinterpret_cast<unsigned short *>(d) + r0 * cols, hb.data(), ne * sizeof(unsigned short), cudaMemcpyHostToDevice);
            } else {
                e = cudaMemcpy(d + r0 * cols, src, ne * sizeof(float), cudaMemcpyHostToDevice);
            }
            if (e != cudaSuccess) return e;
        }
        return cudaSuccess;
    };
    if (has_embd) CUI(upw(g->tok_embd, &m->tok_embd));
    if (has_head) CUI(up(g->out_norm, m->out_norm, dim));
    if (head_own) CUI(upw(g->output, &m->output));
    for (size_t l = (size_t)l0; l < (size_t)l1; l++) {
        const kvq_layer_weights *hl = &m->layers[l];
        dev_layer &d = g->L[l];
        CUI(up(d.attn_norm, hl->attn_norm, dim));
        CUI(upw(d.wq, &hl->wq));
        CUI(upw(d.wk, &hl->wk));
        CUI(upw(d.wv, &hl->wv));
        CUI(upw(d.wo, &hl->wo));
        CUI(up(d.ffn_norm, hl->ffn_norm, dim));
        if (d.bq) {
            CUI(up(d.bq, hl->bq, qd));
            CUI(up(d.bk, hl->bk, kvd));
            CUI(up(d.bv, hl->bv, kvd));
        }
        if (d.bo) CUI(up(d.bo, hl->bo, dim));
        if (d.q_norm) {
            CUI(up(d.q_norm, hl->q_norm, (size_t)hp->head_dim));
            CUI(up(d.k_norm, hl->k_norm, (size_t)hp->head_dim));
        }
        CUI(upw(d.w_gate, &hl->w_gate));
        CUI(upw(d.w_up, &hl->w_up));
        CUI(upw(d.w_down, &hl->w_down));
    }
    hb.clear();
    hb.shrink_to_fit();
    hf.clear();
    hf.shrink_to_fit();

    // ---- activations ----
    const size_t T = max_T, half = hp->rope_dim / 2 > 0 ? hp->rope_dim / 2 : 1, P = max_P;
    size_t vc = ((size_t)1 << (g->bf16 ? 26 : 28)) / T; // bf16: smaller blocks (their bf16 copy is staged too)
    if (vc > V) vc = V;
    if (vc < 256) vc = V < 256 ? V : 256;
    g->v_chunk = (int)vc;
    if (g->bf16) g->xb_elems = T * std::max(std::max(dim, qd), std::max(hid, vc));
    carve a;
    for (int pass = 0; pass < 2; pass++) {
        a.off = 0;
        a.take(&g->x, T * dim);
        a.take(&g->xn, T * dim);
        a.take(&g->q, T * qd);
        a.take(&g->k_pre, T * kvd);
        a.take(&g->k_post, T * kvd);
        a.take(&g->v, T * kvd);
        a.take(&g->k_att, T * kvd);
        a.take(&g->v_att, T * kvd);
        a.take(&g->k_alt, T * kvd);
        a.take(&g->v_alt, T * kvd);
        a.take(&g->att, T * qd);
        a.take(&g->gate, T * hid);
        a.take(&g->up, T * hid);
        a.take(&g->blk, T * vc);
        a.take(&g->row_max, T);
        a.take(&g->row_tgt, T);
        a.take(&g->row_sum, T);
        a.take(&g->rcos, T * half);
        a.take(&g->rsin, T * half);
        a.take(&g->pk, NL * P * kvd + 4);
        a.take(&g->pv, NL * P * kvd + 4);
        a.take(&g->tok, T);
        a.take(&g->tg, T);
        a.take(&g->kb, T);
        a.take(&g->vb, T);
        a.take(&g->cnt, 4);
        a.take(&g->lse, (size_t)hp->n_heads * T);
        a.take(&g->mass, (size_t)hp->n_heads * (T + P));
        a.take(&g->entropy, (size_t)hp->n_heads * T);
        if (g->bf16) a.take(&g->xb, g->xb_elems);
        if (pass == 0) {
            char what[160];
            snprintf(what, sizeof what, "activations of %d tokens (incl. an LM-head block of %zu x %zu logits)", max_T, T, vc);
            TRY(dev_alloc(g, &g->abuf, a.off, what, err));
            a.base = (char *)g->abuf;
        }
    }
    carve hbc;
    for (int pass = 0; pass < 2; pass++) {
        hbc.off = 0;
        hbc.take(&g->h_row_max, T);
        hbc.take(&g->h_row_tgt, T);
        hbc.take(&g->h_row_sum, T);
        hbc.take(&g->h_cos, T * half);
        hbc.take(&g->h_sin, T * half);
        hbc.take(&g->h_tok, T);
        hbc.take(&g->h_tg, T);
        hbc.take(&g->h_kb, T);
        hbc.take(&g->h_vb, T);
        hbc.take(&g->h_q, T * qd);
        hbc.take(&g->h_kpre, T * kvd);
        hbc.take(&g->h_kpost, T * kvd);
        hbc.take(&g->h_v, T * kvd);
        hbc.take(&g->h_katt, T * kvd);
        hbc.take(&g->h_vatt, T * kvd);
        hbc.take(&g->h_kalt, T * kvd);
        hbc.take(&g->h_valt, T * kvd);
        hbc.take(&g->h_cnt, 4);
        hbc.take(&g->h_mass, (size_t)hp->n_heads * (T + P));
        hbc.take(&g->h_ent, (size_t)hp->n_heads * T);
        if (pass == 0) {
            cudaError_t e = cudaMallocHost(&g->hbuf, hbc.off);
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                return fail(kvq_fail(err, KVQ_ENOMEM, "CUDA forward: cannot allocate %.1f MiB of pinned host memory for max_T %d: %s",
                                     hbc.off / 1048576.0, max_T, cudaGetErrorString(e)));
            }
            hbc.base = (char *)g->hbuf;
        }
    }
    // ---- checkpoints / activations kept for the backward ----
    if (flags & KVQ_FWD_SAVE_LAYER_INPUTS) {
        const bool acts = flags & KVQ_FWD_SAVE_ACTIVATIONS;
        const size_t nh = hp->n_heads, SL = (size_t)(l1 - l0); // the stage's layers: stores indexed l - l0
        carve sc;
        for (int pass = 0; pass < 2; pass++) {
            sc.off = 0;
            sc.take(&g->xs, (SL + 1) * T * dim);
            if (acts) {
                sc.take(&g->s_q, SL * T * qd);
                sc.take(&g->s_k, SL * T * kvd);
                sc.take(&g->s_v, SL * T * kvd);
                sc.take(&g->s_kq, SL * T * kvd);
                sc.take(&g->s_vq, SL * T * kvd);
                sc.take(&g->s_att, SL * T * qd);
                sc.take(&g->s_lse, SL * nh * T);
                sc.take(&g->s_xmid, SL * T * dim);
                sc.take(&g->s_gate, SL * T * hid);
                sc.take(&g->s_up, SL * T * hid);
                sc.take(&g->s_kb, SL * T);
                sc.take(&g->s_vb, SL * T);
            }
            if (pass == 0) {
                char what[200];
                snprintf(what, sizeof what, "the %s kept for the backward pass (%d tokens x %zu layers)",
                         acts ? "activations" : "layer-input checkpoints", max_T, SL);
                TRY(dev_alloc(g, &g->sbuf, sc.off, what, err));
                sc.base = (char *)g->sbuf;
            }
        }
        g->s_alt.assign(SL, 0);
    }
    *out = g;
    return KVQ_OK;
#undef TRY
#undef CUI
#undef CBI
}

extern "C" kvq_status kvq_forward_cuda_set_kv(kvq_forward_cuda *g, const kvq_kv_desc *d, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    if (g->has_desc && g->kv_state && g->desc.q.fam->cuda->release) g->desc.q.fam->cuda->release(g->kv_state);
    g->kv_state = NULL;
    g->has_desc = false;
    if (!d || kvq_kv_desc_is_identity(d)) return KVQ_OK;
    KVQ_TRY(kvq_kv_desc_validate(d, hp, err));
    const kvq_family_cuda *fc = kvq_kv_desc_cuda(d);
    if (!fc && d->rot.kind != KVQ_ROT_NONE)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "CUDA forward: a rotated scheme (+%s) has no native CUDA transform (run it as a "
                        "host transform hook)", kvq_rotation_kind_name(d->rot.kind));
    if (!fc)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "CUDA forward: the %s family has no native CUDA transform (run it as a host "
                        "transform hook)", d->q.fam->name);
    CU(cudaSetDevice(g->dev));
    if (fc->upload) KVQ_TRY(fc->upload(d, hp, &g->kv_state, err));
    g->desc = *d;
    g->desc.layers = NULL; // tables live on the device now
    g->desc.art = NULL;
    g->has_desc = true;
    return KVQ_OK;
}

namespace {

// Native transform of one layer (the family's CUDA part): fills the attention arguments' K/V (and alt).
kvq_status native_transform(kvq_forward_cuda *g, int l, int T, kvq_cu_attn *a, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const kvq_family_cuda *fc = g->desc.q.fam->cuda;
    const size_t kvd = kvq_kv_dim(hp), n = (size_t)T * kvd;
    const bool pre = g->desc.key_stage == KVQ_KEYS_PRE_ROPE;
    const float *ksrc = pre ? g->k_pre : g->k_post;
    const int nkv = hp->n_kv_heads, hd = hp->head_dim;
    kvq_cu_kv_args ka = {l, T, nkv, hd, kvd, ksrc, g->v, g->k_att, g->v_att, g->k_alt, g->v_alt, g->cnt, (void *)g->st};
    if (fc->alt) {
        KVQ_TRY(fc->transform(&g->desc, g->kv_state, &ka, err));
        if (pre) CU(kvq_cu_rope(g->k_alt, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
        a->k = g->k_post;
        a->v = g->v;
        a->kq = g->k_alt;
        a->vq = g->v_alt;
        a->kb = g->kb;
        a->vb = g->vb;
        return KVQ_OK;
    }
    CU(cudaMemcpyAsync(g->k_att, ksrc, n * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
    CU(cudaMemcpyAsync(g->v_att, g->v, n * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
    KVQ_TRY(fc->transform(&g->desc, g->kv_state, &ka, err));
    if (pre) CU(kvq_cu_rope(g->k_att, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
    a->k = g->k_att;
    a->v = g->v_att;
    return KVQ_OK;
}

// Generic transform callback on the host (copies down and up).
// A per-key schedule (forward.h kvq_kv_sched) runs its attention on the host (kvq_attention_sched:
// query rows in order, with the family's step decisions): q down, the attention output up.
kvq_status host_sched_attention(kvq_forward_cuda *g, const kvq_hooks *hk, const kvq_layer_ctx *ctx, int T, kvq_kv_sched *sc,
                                const kvq_prefix *px, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int nkv = hp->n_kv_heads, hd = hp->head_dim, l = ctx->layer, P = ctx->P;
    const size_t qn = (size_t)T * kvq_q_dim(hp), kvd = kvq_kv_dim(hp);
    if (g->s_q || g->xs)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: a scheme with a per-key schedule of representations has no backward "
                        "pass; use it for evaluation only", l);
    if (hk->observe) return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: observe hooks with a per-key schedule run on the CPU", l);
    if (hk->key_stage == KVQ_KEYS_PRE_ROPE)
        for (int r = 0; r < sc->n_k; r++) {
            bool seen = false;
            for (int r2 = 0; r2 < r; r2++) seen |= sc->k[r2] == sc->k[r];
            if (!seen) kvq_rope_apply(sc->k[r], T, nkv, hd, hp->rope_dim, g->h_cos, g->h_sin, 0);
        }
    KVQ_TRY(d2h(g, g->h_q, g->q, qn, err));
    CU(cudaStreamSynchronize(g->st));
    if (g->h_att.size() < qn) g->h_att.resize(qn);
    kvq_attn_args ha = {};
    ha.T = T;
    ha.P = P;
    ha.n_heads = hp->n_heads;
    ha.n_kv_heads = nkv;
    ha.head_dim = hd;
    ha.q = g->h_q;
    ha.out = g->h_att.data();
    if (P > 0) {
        ha.pk = px->k + (size_t)l * P * kvd;
        ha.pv = px->v + (size_t)l * P * kvd;
    }
    int nt = 1;
#ifdef _OPENMP
    nt = omp_get_max_threads();
#endif
    kvq_status s = kvq_attention_sched(&ha, sc, l, nt, err);
    if (s) return kvq_err_prefix(err, "layer %d", l);
    CU(cudaMemcpyAsync(g->att, g->h_att.data(), qn * sizeof(float), cudaMemcpyHostToDevice, g->st));
    CU(cudaStreamSynchronize(g->st)); // h_att is reused by the next layer
    return KVQ_OK;
}

// A schedule whose step has a declarative form (forward.h kvq_sched_imp): the representations up once,
// RoPE'd on the device when pre-RoPE, the policy and the attention on the device (cuda_sched.cuh); the final
// switch times and the realised counts down into the schedule (as the host steps leave them). Returns
// KVQ_EUNSUPPORTED without side effects when the shape does not fit (the caller takes the host path).
kvq_status device_sched_attention(kvq_forward_cuda *g, const kvq_hooks *hk, const kvq_layer_ctx *ctx, int T,
                                  kvq_kv_sched *sc, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int nkv = hp->n_kv_heads, hd = hp->head_dim, l = ctx->layer, P = ctx->P;
    const size_t kvd = kvq_kv_dim(hp), n = (size_t)T * kvd;
    const kvq_sched_imp *im = sc->imp;
    if (!im || sc->n_k != 3 || sc->n_v != 3 || !sc->k_from || sc->k_from != sc->v_from || !im->counts)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: the schedule has no declarative policy", l);
    const char *why = kvq_cu_sched_unsupported(T, P, hp->n_heads, nkv, hd, g->dev);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: device schedule: %s", l, why);
    if (!g->sched_buf) {
        const size_t mT = g->max_T, reps = 6 * mT * kvd * sizeof(float), fr = 2 * (size_t)nkv * mT * sizeof(int),
                     rows = 2 * (size_t)hp->n_heads * mT * sizeof(float), cnt = 4 * (size_t)nkv * sizeof(unsigned long long);
        KVQ_TRY(dev_alloc(g, &g->sched_buf, reps + fr + rows + cnt + 256, "the device schedule's representations", err));
        char *b = (char *)g->sched_buf;
        for (int r = 0; r < 3; r++) g->sd_k[r] = (float *)b, b += mT * kvd * sizeof(float);
        for (int r = 0; r < 3; r++) g->sd_v[r] = (float *)b, b += mT * kvd * sizeof(float);
        g->sd_m = (float *)b, b += (size_t)hp->n_heads * mT * sizeof(float);
        g->sd_s = (float *)b, b += (size_t)hp->n_heads * mT * sizeof(float);
        g->sd_cnt = (unsigned long long *)align_up((size_t)b, 16), b = (char *)(g->sd_cnt + 4 * (size_t)nkv);
        g->sd_from = (int *)b;
    }
    kvq_cu_sched_args sa = {};
    const bool pre = hk->key_stage == KVQ_KEYS_PRE_ROPE;
    for (int w = 0; w < 2; w++)
        for (int r = 0; r < 3; r++) {
            float *const *src = w ? sc->v : sc->k;
            float **dst = w ? g->sd_v : g->sd_k;
            const float **arg = w ? sa.v : sa.k;
            int same = -1;
            for (int r2 = 0; r2 < r; r2++)
                if (src[r2] == src[r]) same = r2;
            if (same >= 0) {
                arg[r] = arg[same];
                continue;
            }
            KVQ_TRY(h2d(g, dst[r], src[r], n, err));
            if (pre && !w) CU(kvq_cu_rope(dst[r], T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
            arg[r] = dst[r];
        }
    sa.T = T;
    sa.P = P;
    sa.n_heads = hp->n_heads;
    sa.n_kv_heads = nkv;
    sa.head_dim = hd;
    sa.q = g->q;
    if (P > 0) {
        sa.pk = g->pk + (size_t)l * P * kvd;
        sa.pv = g->pv + (size_t)l * P * kvd;
    }
    sa.out = g->att;
    sa.from = g->sd_from;
    sa.row_m = g->sd_m;
    sa.row_s = g->sd_s;
    sa.counts = g->sd_cnt;
    sa.budget = im->budget;
    sa.probe = im->probe;
    sa.window = im->window;
    sa.n_sink = im->n_sink;
    sa.normalise = im->normalise;
    if (g->sched_pre && !g->sd_S) {
        // the scores of all three representations ahead of the policy (2.6x faster per layer at T 2048 on an H200);
        // without the room, the policy computes them
        const size_t want = kvq_cu_sched_prescore_bytes(g->max_T, g->max_P, hp->n_heads);
        size_t free_b = 0, total_b = 0;
        if (!g->sched_pre_forced && (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess || want > free_b / 4)) {
            (void)cudaGetLastError();
            g->sched_pre = false;
        } else if (cudaMalloc(&g->sd_S, want) != cudaSuccess) {
            (void)cudaGetLastError();
            g->sd_S = NULL;
            g->sched_pre = false;
        }
    }
    sa.S = g->sched_pre ? g->sd_S : NULL;
    CU(kvq_cu_sched_attention(&sa, g->st, nullptr));
    g->h_sched_cnt.resize(4 * (size_t)nkv);
    CU(cudaMemcpyAsync(sc->k_from, g->sd_from, 2 * (size_t)nkv * T * sizeof(int), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_sched_cnt.data(), g->sd_cnt, 4 * (size_t)nkv * sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                       g->st));
    CU(cudaStreamSynchronize(g->st));
    for (size_t x = 0; x < 4 * (size_t)nkv; x++) im->counts[x] = g->h_sched_cnt[x];
    g->stats.device_scheds++;
    return KVQ_OK;
}

// The selection form's declarative step (forward.h kvq_sched_sel) on the device: one buffer of the parts below, for
// windows of up to mT tokens (the layout of the current T fits: every part is indexed by T <= mT).
enum { SP_REPS, SP_ROWS, SP_RING, SP_HIST, SP_SEL, SP_CNT, SP_RANGE, SP_UNIT, SP_ROOT, SP_NOUT, SP_N };
size_t ssel_plan(size_t *off, size_t mT, size_t nh, size_t nkv, size_t N, size_t nrep, size_t kvd)
{
    const size_t sz[SP_N] = {nrep * mT * kvd * sizeof(float), 2 * nh * mT * sizeof(float), nkv * N * mT * sizeof(float),
                             2 * nkv * mT * mT, 2 * nkv * mT, 10 * nkv * sizeof(unsigned long long), 2 * mT * nkv * sizeof(float),
                             2 * nkv * mT * sizeof(double), mT * sizeof(double), 2 * mT * nkv * sizeof(unsigned short)};
    size_t o = 0;
    for (int x = 0; x < SP_N; x++) off[x] = o, o = align_up(o + sz[x], 256);
    return o;
}

// Points a's buffers into base (ssel_plan's offsets for windows of mT tokens) and queues the uploads of the schedule's
// representations (each distinct host buffer once) and of its policy arrays on st. a's shape (T, P, heads) is set.
kvq_status ssel_bind(kvq_cu_ssel_args &a, char *base, const size_t *off, size_t mT, const kvq_kv_sched *sc, cudaStream_t st,
                     kvq_err *err)
{
    const kvq_sched_sel *p = sc->sel;
    const size_t T = a.T, nkv = a.n_kv_heads, kvd = nkv * a.head_dim, nh = a.n_heads;
    float *rb = (float *)(base + off[SP_REPS]);
    size_t slot = 0;
    a.n_k = sc->n_k, a.n_v = sc->n_v;
    for (int w = 0; w < 2; w++)
        for (int r = 0; r < (w ? sc->n_v : sc->n_k); r++) {
            float *const *src = w ? sc->v : sc->k;
            const float **arg = w ? a.v : a.k;
            int same = -1;
            for (int r2 = 0; r2 < r; r2++)
                if (src[r2] == src[r]) same = r2;
            if (same >= 0) {
                arg[r] = arg[same];
                continue;
            }
            float *d = rb + slot++ * mT * kvd;
            CU(cudaMemcpyAsync(d, src[r], T * kvd * sizeof(float), cudaMemcpyHostToDevice, st));
            arg[r] = d;
        }
    a.row_m = (float *)(base + off[SP_ROWS]);
    a.row_s = a.row_m + nh * mT;
    a.ring = (float *)(base + off[SP_RING]);
    a.hist = (signed char *)(base + off[SP_HIST]);
    a.sel = (signed char *)(base + off[SP_SEL]);
    a.counts = (unsigned long long *)(base + off[SP_CNT]);
    float *rg = (float *)(base + off[SP_RANGE]);
    double *un = (double *)(base + off[SP_UNIT]), *ro = (double *)(base + off[SP_ROOT]);
    unsigned short *no = (unsigned short *)(base + off[SP_NOUT]);
    CU(cudaMemcpyAsync(rg, p->range, 2 * T * nkv * sizeof(float), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(un, p->unit, 2 * nkv * T * sizeof(double), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(ro, p->root, T * sizeof(double), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(no, p->nout, 2 * T * nkv * sizeof(unsigned short), cudaMemcpyHostToDevice, st));
    a.range = rg, a.unit = un, a.root = ro, a.nout = no;
    a.n_sink = p->n_sink, a.window = p->window, a.young = p->young, a.n_lv = p->n_lv, a.lo = p->lo;
    a.attn[0] = p->attn[0], a.attn[1] = p->attn[1];
    return KVQ_OK;
}

// The device's decisions into the schedule as the host steps leave them (selections, counts; the trace when asked),
// queued on st (the caller synchronises).
kvq_status ssel_download(const kvq_cu_ssel_args &a, const kvq_kv_sched *sc, cudaStream_t st, kvq_err *err)
{
    const size_t T = a.T, nkv = a.n_kv_heads;
    CU(cudaMemcpyAsync(sc->k_sel, a.sel, nkv * T, cudaMemcpyDeviceToHost, st));
    CU(cudaMemcpyAsync(sc->v_sel, a.sel + nkv * T, nkv * T, cudaMemcpyDeviceToHost, st));
    CU(cudaMemcpyAsync(sc->sel->counts, a.counts, 10 * nkv * sizeof(uint64_t), cudaMemcpyDeviceToHost, st));
    if (sc->sel->trace) CU(cudaMemcpyAsync(sc->sel->trace, a.hist, 2 * nkv * T * T, cudaMemcpyDeviceToHost, st));
    return KVQ_OK;
}

// Is sc a selection-form schedule with a declarative step the device takes? (else the reason)
const char *ssel_form(const kvq_kv_sched *sc)
{
    const kvq_sched_sel *p = sc->sel;
    if (!p || !sc->k_sel || !sc->v_sel || !p->counts || !p->range || !p->unit || !p->root || !p->nout)
        return "the schedule has no declarative selection step";
    if (p->n_lv < 1 || sc->n_k != p->n_lv + 1 || sc->n_v != p->n_lv + 1 || p->young < 0 || p->young > p->n_lv || p->window < 1)
        return "the selection step does not match the schedule's representations";
    return 0;
}

// A selection-form schedule with a declarative step (forward.h kvq_sched_sel) on the device, as
// device_sched_attention does for kvq_sched_imp. Returns KVQ_EUNSUPPORTED without side effects when the shape does
// not fit (the caller takes the host path).
kvq_status device_ssel_attention(kvq_forward_cuda *g, const kvq_hooks *hk, const kvq_layer_ctx *ctx, int T, kvq_kv_sched *sc,
                                 kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int nkv = hp->n_kv_heads, hd = hp->head_dim, l = ctx->layer, P = ctx->P;
    const size_t kvd = kvq_kv_dim(hp);
    const char *why = ssel_form(sc);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: %s", l, why);
    why = kvq_cu_ssel_unsupported(T, P, hp->n_heads, nkv, hd, sc->n_k, sc->n_v, g->dev);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: device selection schedule: %s", l, why);
    const int N = sc->sel->window < T ? sc->sel->window : T;
    size_t off[SP_N];
    const size_t need = ssel_plan(off, g->max_T, hp->n_heads, nkv, N, sc->n_k + sc->n_v, kvd);
    if (g->ss_cap < need) {
        cudaFree(g->ss_buf);
        g->ss_buf = NULL;
        g->ss_cap = 0;
        KVQ_TRY(dev_alloc(g, &g->ss_buf, need, "the device selection schedule's representations", err));
        g->ss_cap = need;
    }
    kvq_cu_ssel_args sa = {};
    sa.T = T, sa.P = P, sa.n_heads = hp->n_heads, sa.n_kv_heads = nkv, sa.head_dim = hd;
    KVQ_TRY(ssel_bind(sa, (char *)g->ss_buf, off, g->max_T, sc, g->st, err));
    if (hk->key_stage == KVQ_KEYS_PRE_ROPE)
        for (int r = 0; r < sc->n_k; r++) {
            bool seen = false;
            for (int r2 = 0; r2 < r; r2++) seen |= sa.k[r2] == sa.k[r];
            if (!seen) CU(kvq_cu_rope((float *)sa.k[r], T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
        }
    sa.q = g->q;
    if (P > 0) {
        sa.pk = g->pk + (size_t)l * P * kvd;
        sa.pv = g->pv + (size_t)l * P * kvd;
    }
    sa.out = g->att;
    // every key representation's scores ahead of the policy where they fit a quarter of the free memory (or forced)
    const size_t want = kvq_cu_ssel_prescore_bytes(sc->n_k, g->max_T, g->max_P, hp->n_heads);
    if (g->sched_pre && g->ss_S_cap < want) {
        cudaFree(g->ss_S);
        g->ss_S = NULL;
        g->ss_S_cap = 0;
        size_t free_b = 0, total_b = 0;
        if (!g->sched_pre_forced && (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess || want > free_b / 4))
            (void)cudaGetLastError();
        else if (cudaMalloc(&g->ss_S, want) != cudaSuccess) {
            (void)cudaGetLastError();
            g->ss_S = NULL;
        } else
            g->ss_S_cap = want;
    }
    sa.S = g->sched_pre && g->ss_S_cap >= want ? g->ss_S : NULL;
    CU(kvq_cu_ssel_attention(&sa, g->st, nullptr));
    KVQ_TRY(ssel_download(sa, sc, g->st, err));
    CU(cudaStreamSynchronize(g->st));
    g->stats.device_scheds++;
    return KVQ_OK;
}

kvq_status host_transform(kvq_forward_cuda *g, const kvq_hooks *hk, const kvq_layer_ctx *ctx, int T, kvq_cu_attn *a,
                          const kvq_prefix *px, bool *attended, kvq_err *err)
{
    *attended = false;
    const kvq_hparams *hp = &g->m->hp;
    const size_t kvd = kvq_kv_dim(hp), n = (size_t)T * kvd;
    const bool pre = hk->key_stage == KVQ_KEYS_PRE_ROPE;
    KVQ_TRY(d2h(g, g->h_katt, pre ? g->k_pre : g->k_post, n, err));
    KVQ_TRY(d2h(g, g->h_vatt, g->v, n, err));
    CU(cudaStreamSynchronize(g->st));
    kvq_kv_alt alt = {g->h_kalt, g->h_kb, false, g->h_valt, g->h_vb, false, NULL};
    kvq_status s = hk->transform(hk->user, ctx, g->h_katt, g->h_vatt, &alt, err);
    if (s) return kvq_err_prefix(err, "layer %d: KV transform", ctx->layer);
    if (alt.sched) {
        kvq_status ds = KVQ_EUNSUPPORTED;
        if (alt.sched->imp && !g->sched_host && !hk->observe && !g->s_q && !g->xs) {
            ds = device_sched_attention(g, hk, ctx, T, alt.sched, err);
            if (ds && ds != KVQ_EUNSUPPORTED) return ds;
        } else if (alt.sched->sel && !g->sched_host && !hk->observe && !g->s_q && !g->xs) {
            ds = device_ssel_attention(g, hk, ctx, T, alt.sched, err);
            if (ds && ds != KVQ_EUNSUPPORTED) return ds;
        }
        if (ds) {
            KVQ_TRY(host_sched_attention(g, hk, ctx, T, alt.sched, px, err));
            g->stats.host_scheds++;
        }
        *attended = true;
        return KVQ_OK;
    }
    if (alt.use_k) KVQ_TRY(kvq_attn_check_bounds(g->h_kb, T, "k_bound", err));
    if (alt.use_v) KVQ_TRY(kvq_attn_check_bounds(g->h_vb, T, "v_bound", err));
    KVQ_TRY(h2d(g, g->k_att, g->h_katt, n, err));
    KVQ_TRY(h2d(g, g->v_att, g->h_vatt, n, err));
    const int nkv = hp->n_kv_heads, hd = hp->head_dim;
    if (pre) CU(kvq_cu_rope(g->k_att, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
    a->k = g->k_att;
    a->v = g->v_att;
    if (alt.use_k) {
        KVQ_TRY(h2d(g, g->k_alt, g->h_kalt, n, err));
        CU(cudaMemcpyAsync(g->kb, g->h_kb, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
        if (pre) CU(kvq_cu_rope(g->k_alt, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
        a->kq = g->k_alt;
        a->kb = g->kb;
    }
    if (alt.use_v) {
        KVQ_TRY(h2d(g, g->v_alt, g->h_valt, n, err));
        CU(cudaMemcpyAsync(g->vb, g->h_vb, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
        a->vq = g->v_alt;
        a->vb = g->vb;
    }
    // the pinned staging buffers are reused by the next layer: wait for the uploads
    CU(cudaStreamSynchronize(g->st));
    return KVQ_OK;
}

kvq_status host_observe(kvq_forward_cuda *g, const kvq_hooks *hk, const kvq_layer_ctx *ctx, int T, const kvq_cu_attn *a,
                        kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const size_t kvd = kvq_kv_dim(hp), n = (size_t)T * kvd;
    KVQ_TRY(d2h(g, g->h_q, g->q, (size_t)T * kvq_q_dim(hp), err));
    KVQ_TRY(d2h(g, g->h_kpre, g->k_pre, n, err));
    KVQ_TRY(d2h(g, g->h_kpost, g->k_post, n, err));
    KVQ_TRY(d2h(g, g->h_v, g->v, n, err));
    KVQ_TRY(d2h(g, g->h_katt, a->k, n, err));
    KVQ_TRY(d2h(g, g->h_vatt, a->v, n, err));
    if (a->kq) {
        KVQ_TRY(d2h(g, g->h_kalt, a->kq, n, err));
        CU(cudaMemcpyAsync(g->h_kb, a->kb, (size_t)T * sizeof(int), cudaMemcpyDeviceToHost, g->st));
    }
    if (a->vq) {
        KVQ_TRY(d2h(g, g->h_valt, a->vq, n, err));
        CU(cudaMemcpyAsync(g->h_vb, a->vb, (size_t)T * sizeof(int), cudaMemcpyDeviceToHost, g->st));
    }
    if (hk->attn_stats) {
        const size_t nh = hp->n_heads;
        CU(kvq_cu_attn_stats(a, a->lse, g->mass, g->entropy, g->st));
        KVQ_TRY(d2h(g, g->h_mass, g->mass, nh * (size_t)(a->P + T), err));
        KVQ_TRY(d2h(g, g->h_ent, g->entropy, nh * (size_t)T, err));
    }
    CU(cudaStreamSynchronize(g->st));
    kvq_layer_obs obs = {};
    if (hk->attn_stats) {
        obs.attn_mass = g->h_mass;
        obs.attn_entropy = g->h_ent;
    }
    obs.q = g->h_q;
    obs.k_pre = g->h_kpre;
    obs.k_post = g->h_kpost;
    obs.v = g->h_v;
    obs.k_att = g->h_katt;
    obs.v_att = g->h_vatt;
    obs.k_alt = a->kq ? g->h_kalt : NULL;
    obs.v_alt = a->vq ? g->h_valt : NULL;
    obs.k_bound = a->kq ? g->h_kb : NULL;
    obs.v_bound = a->vq ? g->h_vb : NULL;
    kvq_status s = hk->observe(hk->user, ctx, &obs, err);
    if (s) return kvq_err_prefix(err, "layer %d: observe hook", ctx->layer);
    return KVQ_OK;
}

kvq_status run_impl(kvq_forward_cuda *g, const kvq_fwd_io *io, const float *x_in, kvq_fwd_result *res, kvq_err *err)
{
    const kvq_model *m = g->m;
    const kvq_hparams *hp = &m->hp;
    const int T = io->T, dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim, V = hp->vocab_size;
    const int nkv = hp->n_kv_heads, hd = hp->head_dim;
    res->loss = NAN;
    res->n_scored = 0;
    if (T <= 0 || T > g->max_T)
        return kvq_fail(err, KVQ_EINVAL, "forward: window of %d tokens, expected 1..%d (max_T of the workspace)", T, g->max_T);
    const kvq_prefix *px = io->prefix;
    int P = px ? px->P : 0;
    if (P < 0 || P > g->max_P || (P > 0 && (!px->k || !px->v)))
        return kvq_fail(err, KVQ_EINVAL, "forward: prefix of %d entries, expected 0..%d with K and V", P, g->max_P);
    if (io->pos0 < 0 || io->pos0 > INT32_MAX - T) return kvq_fail(err, KVQ_EINVAL, "forward: pos0 %d out of range", io->pos0);
    for (int t = 0; t < T; t++)
        if (io->tokens[t] < 0 || io->tokens[t] >= V)
            return kvq_fail(err, KVQ_EINVAL, "forward: token %d at window index %d outside the vocabulary [0, %d)", io->tokens[t], t, V);
    const kvq_hooks *hk = io->hooks;
    const bool stats = hk && hk->observe && hk->attn_stats;
    const bool attend = hk && hk->attend; // an external cache (forward.h kvq_hooks.attend, device pointers here)
    if (attend && (hk->transform || hk->observe || P > 0 || g->has_desc || g->s_q || g->l0 > 0 || g->l1 < hp->n_layers))
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: an attend hook (external cache) runs without a transform, built-in "
                        "scheme, observe hook, prefix, activation store or pipeline stage");
    KVQ_TRY(kvq_fwd_check_pos(io, T, attend, err));
    g->T_last = 0;
    if (g->has_desc && hk && hk->transform)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: a built-in KV scheme is set and the hooks carry a transform too");
    int *tg = g->h_tg;
    for (int t = 0; t < T; t++) {
        tg[t] = io->targets ? io->targets[t] : (t + 1 < T ? io->tokens[t + 1] : -1);
        if (tg[t] >= V)
            return kvq_fail(err, KVQ_EINVAL, "forward: target %d at window index %d outside the vocabulary [0, %d)", tg[t], t, V);
        if (tg[t] < 0) tg[t] = -1;
        g->h_tok[t] = io->tokens[t];
    }
    CU(cudaSetDevice(g->dev));
    // the staging buffers may still be read by the previous run's copies: none in flight (run ends synchronised)
    const size_t half = hp->rope_dim / 2;
    if (io->pos) // per-row positions (independent sequences, kvq_hooks.attend)
        for (int t = 0; t < T; t++) kvq_rope_table(hp, io->pos[t], 1, g->h_cos + t * half, g->h_sin + t * half);
    else
        kvq_rope_table(hp, io->pos0, T, g->h_cos, g->h_sin);
    CU(cudaMemcpyAsync(g->tok, g->h_tok, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
    CU(cudaMemcpyAsync(g->tg, g->h_tg, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
    if (half) {
        KVQ_TRY(h2d(g, g->rcos, g->h_cos, (size_t)T * half, err));
        KVQ_TRY(h2d(g, g->rsin, g->h_sin, (size_t)T * half, err));
    }
    if (P > 0) {
        size_t pn = (size_t)hp->n_layers * P * kvd;
        CU(cudaMemcpyAsync(g->pk, px->k, pn * sizeof(float), cudaMemcpyHostToDevice, g->st));
        CU(cudaMemcpyAsync(g->pv, px->v, pn * sizeof(float), cudaMemcpyHostToDevice, g->st));
    }
    if (g->has_desc && kvq_kv_desc_alt_bounds(&g->desc, (size_t)T, g->h_kb, g->h_vb)) {
        CU(cudaMemcpyAsync(g->kb, g->h_kb, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
        CU(cudaMemcpyAsync(g->vb, g->h_vb, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, g->st));
    }
    CU(cudaMemsetAsync(g->cnt, 0, 4 * sizeof(unsigned long long), g->st));
    if (g->l0 > 0) { // a later pipeline stage: the residual stream entering layer l0 (received into g->x, or copied)
        if (!x_in) return kvq_fail(err, KVQ_EINVAL, "CUDA forward: a stage starting at layer %d needs the stream entering it", g->l0);
        if (x_in != g->x) CU(cudaMemcpyAsync(g->x, x_in, (size_t)T * dim * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
    } else if (g->bf16) {
        CU(kvq_cu_embed_bf16(g->x, reinterpret_cast<const unsigned short *>(g->tok_embd), g->tok, T, dim, g->st));
    } else {
        CU(kvq_cu_embed(g->x, g->tok_embd, g->tok, T, dim, g->st));
    }

    const size_t Tn = T, mT = g->max_T, nh = hp->n_heads;
    const bool acts = g->s_q != NULL;
    // device-to-device copy of n floats into the store
    auto keep = [&](float *dst, const float *src, size_t n) {
        return cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, g->st);
    };
    for (int l = g->l0; l < g->l1; l++) {
        const dev_layer &w = g->L[l];
        const size_t sl = (size_t)(l - g->l0); // the stage's store slot of layer l
        if (g->xs) CU(keep(g->xs + sl * mT * dim, g->x, Tn * dim));
        CU(kvq_cu_rmsnorm(g->xn, g->x, w.attn_norm, T, dim, hp->norm_eps, g->st));
        KVQ_TRY(linear(g, g->q, g->xn, w.wq, T, dim, qd, 0, err));
        KVQ_TRY(linear(g, g->k_pre, g->xn, w.wk, T, dim, kvd, 0, err));
        KVQ_TRY(linear(g, g->v, g->xn, w.wv, T, dim, kvd, 0, err));
        KVQ_TRY(qkv_finish(g, w, T, g->q, g->k_pre, g->v, true, err));
        CU(cudaMemcpyAsync(g->k_post, g->k_pre, (size_t)T * kvd * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
        CU(kvq_cu_rope(g->q, T, hp->n_heads, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
        CU(kvq_cu_rope(g->k_post, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
        kvq_cu_attn a = {};
        a.T = T;
        a.P = P;
        a.n_heads = hp->n_heads;
        a.n_kv_heads = nkv;
        a.head_dim = hd;
        a.q = g->q;
        a.k = g->k_post;
        a.v = g->v;
        a.out = g->att;
        a.lse = acts ? g->s_lse + sl * nh * mT : stats ? g->lse : NULL;
        a.window = kvq_layer_window(hp, l);
        a.pos0 = io->pos0;
        a.bf16_tc = g->attn_tc;
        if (P > 0) {
            a.pk = g->pk + (size_t)l * P * kvd;
            a.pv = g->pv + (size_t)l * P * kvd;
        }
        kvq_layer_ctx ctx = {l, T, io->pos0, P, hp->n_heads, nkv, hd, io->tokens, hp->n_layers};
        bool attended = false;
        if (attend) { // the external cache appends the new K/V and attends (device pointers, stream idle)
            CU(cudaStreamSynchronize(g->st));
            kvq_status s = hk->attend(hk->user, &ctx, g->q, g->k_pre, g->k_post, g->v, g->att, err);
            if (s) return kvq_err_prefix(err, "layer %d: attend hook", l);
            attended = true;
        } else if (g->has_desc) {
            KVQ_TRY(native_transform(g, l, T, &a, err));
            g->stats.native_transforms++;
        } else if (hk && hk->transform) {
            KVQ_TRY(host_transform(g, hk, &ctx, T, &a, px, &attended, err));
            g->stats.host_transforms++;
        }
        if (!attended) CU(kvq_cu_attention(&a, g->st));
        if (acts) {
            const size_t kvo = sl * mT * kvd, qo = sl * mT * qd;
            CU(keep(g->s_q + qo, g->q, Tn * qd));
            CU(keep(g->s_k + kvo, a.k, Tn * kvd));
            CU(keep(g->s_v + kvo, a.v, Tn * kvd));
            CU(keep(g->s_att + qo, g->att, Tn * qd));
            g->s_alt[sl] = (a.kq ? 1 : 0) | (a.vq ? 2 : 0);
            if (a.kq) {
                CU(keep(g->s_kq + kvo, a.kq, Tn * kvd));
                CU(cudaMemcpyAsync(g->s_kb + sl * mT, a.kb, Tn * sizeof(int), cudaMemcpyDeviceToDevice, g->st));
            }
            if (a.vq) {
                CU(keep(g->s_vq + kvo, a.vq, Tn * kvd));
                CU(cudaMemcpyAsync(g->s_vb + sl * mT, a.vb, Tn * sizeof(int), cudaMemcpyDeviceToDevice, g->st));
            }
        }
        if (hk && hk->observe) KVQ_TRY(host_observe(g, hk, &ctx, T, &a, err));
        KVQ_TRY(linear(g, g->x, g->att, w.wo, T, qd, dim, 1.0f, err));
        if (w.bo) CU(kvq_cu_add_bias(g->x, w.bo, T, dim, g->st));
        if (acts) CU(keep(g->s_xmid + sl * mT * dim, g->x, Tn * dim));
        CU(kvq_cu_rmsnorm(g->xn, g->x, w.ffn_norm, T, dim, hp->norm_eps, g->st));
        KVQ_TRY(linear(g, g->gate, g->xn, w.w_gate, T, dim, hid, 0, err));
        KVQ_TRY(linear(g, g->up, g->xn, w.w_up, T, dim, hid, 0, err));
        if (acts) {
            CU(keep(g->s_gate + sl * mT * hid, g->gate, Tn * hid));
            CU(keep(g->s_up + sl * mT * hid, g->up, Tn * hid));
        }
        CU(kvq_cu_swiglu(g->gate, g->gate, g->up, (size_t)T * hid, g->st));
        KVQ_TRY(linear(g, g->x, g->gate, w.w_down, T, hid, dim, 1.0f, err));
    }
    if (g->xs) CU(keep(g->xs + (size_t)(g->l1 - g->l0) * mT * dim, g->x, Tn * dim));
    int n_tg = 0;
    for (int t = 0; t < T; t++) n_tg += tg[t] >= 0;
    if (g->l1 < hp->n_layers || (!io->logits && (io->skip_loss || n_tg == 0))) {
        // no LM head: not the last pipeline stage (g->x is handed on), the caller computes the loss itself
        // (backward), or no row is scored
        CU(cudaMemcpyAsync(g->h_cnt, g->cnt, 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, g->st));
        CU(cudaStreamSynchronize(g->st));
        CU(cudaGetLastError());
        g->stats.k_outliers += g->h_cnt[0];
        g->stats.v_outliers += g->h_cnt[1];
        g->stats.k_clipped += g->h_cnt[2];
        g->stats.v_clipped += g->h_cnt[3];
        res->n_scored = n_tg;
        if (io->nll && !io->skip_loss && g->l1 == hp->n_layers)
            for (int t = 0; t < T; t++) io->nll[t] = NAN;
        g->T_last = T;
        g->P_last = P;
        return KVQ_OK;
    }
    CU(kvq_cu_rmsnorm(g->xn, g->x, g->out_norm, T, dim, hp->norm_eps, g->st));
    CU(kvq_cu_lse_init(g->row_max, g->row_sum, g->row_tgt, T, g->st));
    int r0 = T, r1 = -1; /* the scored rows' span: the blocked LM head computes their logits only (forward.c) */
    for (int t = 0; t < T; t++)
        if (tg[t] >= 0) {
            r0 = t < r0 ? t : r0;
            r1 = t;
        }
    const int span = r1 - r0 + 1;
    if (io->logits) {
        if (!g->logits) {
            size_t bytes = (size_t)g->max_T * V * sizeof(float);
            KVQ_TRY(dev_alloc(g, (void **)&g->logits, bytes, "the full [max_T][vocab] logits (requested by the caller)", err));
        }
        KVQ_TRY(linear(g, g->logits, g->xn, g->output, T, dim, V, 0, err));
        CU(kvq_cu_lse_block(g->logits, g->tg, 0, V, T, g->row_max, g->row_sum, g->row_tgt, g->st));
        CU(cudaMemcpyAsync(io->logits, g->logits, (size_t)T * V * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    } else if (io->head) {
        // kvq_fwd_head on the device: top tokens in the block kernel, the expectation as forward.c builds it
        // (running rescale + one GEMM per vocabulary block over the scored rows' span)
        kvq_fwd_head *hd = io->head;
        if (!g->d_arg) KVQ_TRY(dev_alloc(g, (void **)&g->d_arg, (size_t)g->max_T * sizeof(int), "the LM head's top tokens", err));
        if (hd->expect && !g->d_ex)
            KVQ_TRY(dev_alloc(g, (void **)&g->d_ex, (size_t)g->max_T * dim * sizeof(float), "the LM head's expectation (KL divergence)",
                              err));
        float *ex = hd->expect ? g->d_ex : NULL;
        CU(cudaMemsetAsync(g->d_arg, 0xff, (size_t)T * sizeof(int), g->st)); // -1
        if (ex && r1 >= r0) CU(cudaMemsetAsync(ex + (size_t)r0 * dim, 0, (size_t)(r1 - r0 + 1) * dim * sizeof(float), g->st));
        for (int v0 = 0; v0 < V; v0 += g->v_chunk) {
            int nv = V - v0 < g->v_chunk ? V - v0 : g->v_chunk;
            KVQ_TRY(linear(g, g->blk + (size_t)r0 * nv, g->xn + (size_t)r0 * dim, woff(g, g->output, (size_t)v0 * dim), span, dim, nv, 0,
                           err));
            CU(kvq_cu_lse_block_head(g->blk, g->tg, v0, nv, T, g->row_max, g->row_sum, g->row_tgt, g->d_arg, ex, dim, g->st));
            if (ex && r1 >= r0) // ex[r0..r1][dim] += exp(z - max)[r0..r1][nv] W_blk[nv][dim]
                KVQ_TRY(gemm_w(g, CUBLAS_OP_N, dim, r1 - r0 + 1, nv, woff(g, g->output, (size_t)v0 * dim), dim,
                               g->blk + (size_t)r0 * nv, nv, 1.0f, ex + (size_t)r0 * dim, dim, err));
        }
        if (hd->hidden) CU(cudaMemcpyAsync(hd->hidden, g->xn, (size_t)T * dim * sizeof(float), cudaMemcpyDeviceToHost, g->st));
        if (hd->argmax) CU(cudaMemcpyAsync(hd->argmax, g->d_arg, (size_t)T * sizeof(int), cudaMemcpyDeviceToHost, g->st));
        if (ex && r1 >= r0)
            CU(cudaMemcpyAsync(hd->expect + (size_t)r0 * dim, ex + (size_t)r0 * dim, (size_t)(r1 - r0 + 1) * dim * sizeof(float),
                               cudaMemcpyDeviceToHost, g->st));
    } else {
        for (int v0 = 0; v0 < V; v0 += g->v_chunk) {
            int nv = V - v0 < g->v_chunk ? V - v0 : g->v_chunk;
            KVQ_TRY(linear(g, g->blk + (size_t)r0 * nv, g->xn + (size_t)r0 * dim, woff(g, g->output, (size_t)v0 * dim), span, dim, nv, 0,
                           err));
            CU(kvq_cu_lse_block(g->blk, g->tg, v0, nv, T, g->row_max, g->row_sum, g->row_tgt, g->st));
        }
    }
    CU(cudaMemcpyAsync(g->h_row_max, g->row_max, (size_t)T * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_row_tgt, g->row_tgt, (size_t)T * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_row_sum, g->row_sum, (size_t)T * sizeof(double), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_cnt, g->cnt, 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, g->st));
    CU(cudaStreamSynchronize(g->st));
    CU(cudaGetLastError());
    g->stats.k_outliers += g->h_cnt[0];
    g->stats.v_outliers += g->h_cnt[1];
    g->stats.k_clipped += g->h_cnt[2];
    g->stats.v_clipped += g->h_cnt[3];

    if (io->head && io->logits) { // the full-logits path: the head outputs from the logits on the host
        if (io->head->hidden)
            CU(cudaMemcpy(io->head->hidden, g->xn, (size_t)T * dim * sizeof(float), cudaMemcpyDeviceToHost));
        KVQ_TRY(kvq_fwd_head_from_logits(g->m, io->logits, NULL, tg, T, io->head, err));
    } else if (io->head) { // the blocked path: lse from the running state, the expectation normalised
        kvq_fwd_head *hd = io->head;
        for (int t = 0; t < T; t++) {
            const bool sc = tg[t] >= 0;
            if (hd->lse) hd->lse[t] = sc ? (double)g->h_row_max[t] + log(g->h_row_sum[t]) : NAN;
            if (hd->argmax && !sc) hd->argmax[t] = -1;
            if (hd->expect && sc)
                for (int d = 0; d < dim; d++) hd->expect[(size_t)t * dim + d] = (float)((double)hd->expect[(size_t)t * dim + d] / g->h_row_sum[t]);
        }
    }
    double total = 0;
    int n_scored = 0, bad = -1;
    for (int t = 0; t < T; t++) {
        double nll = tg[t] >= 0 ? (double)g->h_row_max[t] + log(g->h_row_sum[t]) - (double)g->h_row_tgt[t] : NAN;
        if (io->nll) io->nll[t] = nll;
        if (tg[t] < 0) continue;
        if (!isfinite(nll) && bad < 0) bad = t;
        total += nll;
        n_scored++;
    }
    res->n_scored = n_scored;
    res->loss = n_scored ? total / n_scored : NAN;
    g->T_last = T;
    g->P_last = P;
    if (bad >= 0)
        return kvq_fail(err, KVQ_ENUMERIC, "forward: non-finite logits/NLL at window index %d (position %d)", bad, io->pos0 + bad);
    return KVQ_OK;
}

} // namespace

extern "C" kvq_status kvq_forward_cuda_run(kvq_forward_cuda *g, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    return kvq_forward_cuda_stage(g, io, NULL, res, err);
}

extern "C" float *kvq_forward_cuda_stage_x(kvq_forward_cuda *g) { return g->x; }
extern "C" void *kvq_forward_cuda_stream(kvq_forward_cuda *g) { return (void *)g->st; }
extern "C" int kvq_forward_cuda_gpu(const kvq_forward_cuda *g) { return g->dev; }

extern "C" kvq_status kvq_forward_cuda_stage(kvq_forward_cuda *g, const kvq_fwd_io *io, const float *x_in, kvq_fwd_result *res,
                                             kvq_err *err)
{
    double t0 = now_s();
    kvq_status s = run_impl(g, io, x_in, res, err);
    if (s != KVQ_OK) {
        // leave the stream idle so the workspace stays usable
        cudaStreamSynchronize(g->st);
        (void)cudaGetLastError();
    }
    g->stats.runs++;
    g->stats.seconds += now_s() - t0;
    return s;
}

extern "C" kvq_status kvq_forward_cuda_layer_input(kvq_forward_cuda *g, int l, float *out, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    if (!g->xs)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: layer inputs were not kept (the workspace needs KVQ_FWD_SAVE_LAYER_INPUTS)");
    if (g->T_last <= 0) return kvq_fail(err, KVQ_EINVAL, "CUDA forward: no successful run yet: no layer input to read");
    if (l < g->l0 || l > g->l1)
        return kvq_fail(err, KVQ_EINVAL, "CUDA forward: layer input %d, expected %d..%d", l, g->l0, g->l1);
    CU(cudaSetDevice(g->dev));
    CU(cudaMemcpyAsync(out, g->xs + (size_t)(l - g->l0) * g->max_T * hp->dim, (size_t)g->T_last * hp->dim * sizeof(float),
                       cudaMemcpyDeviceToHost, g->st));
    CU(cudaStreamSynchronize(g->st));
    return KVQ_OK;
}

extern "C" void kvq_forward_cuda_stats(const kvq_forward_cuda *g, kvq_cuda_stats *out) { *out = g->stats; }

extern "C" void kvq_forward_cuda_describe(const kvq_forward_cuda *g, char *buf, size_t n)
{
    snprintf(buf, n, "%s", g->name);
}

extern "C" kvq_status kvq_cuda_sgemm_rate(int device, int n, int reps, kvq_cuda_math math, double *flops_per_s,
                                          kvq_err *err)
{
    *flops_per_s = 0;
    if (n <= 0 || reps <= 0) return kvq_fail(err, KVQ_EINVAL, "sgemm rate: n %d / reps %d must be > 0", n, reps);
    CU(cudaSetDevice(device));
    size_t nn = (size_t)n * n;
    float *buf = NULL;
    cudaError_t e = cudaMalloc(&buf, 3 * nn * sizeof(float));
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_ENOMEM, "sgemm rate: cannot allocate 3 x %d x %d floats: %s", n, n, cudaGetErrorString(e));
    }
    cublasHandle_t h = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    kvq_status s = KVQ_OK;
    std::vector<float> ms;
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t bs;
    if ((e = kvq_cu_fill_random(buf, 3 * nn, 12345u, 0)) != cudaSuccess) { s = cu_fail(err, e, "fill_random", __FILE__, __LINE__); goto done; }
    if ((bs = cublasCreate(&h)) != CUBLAS_STATUS_SUCCESS) { s = cb_fail(err, bs, "cublasCreate", __FILE__, __LINE__); goto done; }
    if ((bs = cublasSetMathMode(h, math == KVQ_CUDA_TF32   ? CUBLAS_TF32_TENSOR_OP_MATH
                                   : math == KVQ_CUDA_BF16 ? CUBLAS_DEFAULT_MATH
                                                           : CUBLAS_PEDANTIC_MATH)) != CUBLAS_STATUS_SUCCESS) {
        s = cb_fail(err, bs, "cublasSetMathMode", __FILE__, __LINE__);
        goto done;
    }
    if ((e = cudaEventCreate(&e0)) != cudaSuccess || (e = cudaEventCreate(&e1)) != cudaSuccess) {
        s = cu_fail(err, e, "cudaEventCreate", __FILE__, __LINE__);
        goto done;
    }
    if (math == KVQ_CUDA_BF16) { // bf16 copies of the two operands in the first 2/3 of buf's first operand's space
        if ((e = kvq_cu_to_bf16(reinterpret_cast<unsigned short *>(buf), buf, 2 * nn, 0)) != cudaSuccess ||
            (e = cudaDeviceSynchronize()) != cudaSuccess) {
            s = cu_fail(err, e, "to_bf16", __FILE__, __LINE__);
            goto done;
        }
    }
    for (int r = -2; r < reps; r++) {
        cudaEventRecord(e0, 0);
        if (math == KVQ_CUDA_BF16) {
            const unsigned short *a16 = reinterpret_cast<const unsigned short *>(buf);
            bs = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a16, CUDA_R_16BF, n, a16 + nn, CUDA_R_16BF, n, &beta,
                              buf + 2 * nn, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        } else {
            bs = cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, buf, n, buf + nn, n, &beta, buf + 2 * nn, n);
        }
        if (bs != CUBLAS_STATUS_SUCCESS) { s = cb_fail(err, bs, "cublasSgemm", __FILE__, __LINE__); goto done; }
        cudaEventRecord(e1, 0);
        if ((e = cudaEventSynchronize(e1)) != cudaSuccess) { s = cu_fail(err, e, "cudaEventSynchronize", __FILE__, __LINE__); goto done; }
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        if (r >= 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    *flops_per_s = 2.0 * n * (double)n * n / (ms[ms.size() / 2] * 1e-3);
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (h) cublasDestroy(h);
    cudaFree(buf);
    (void)cudaGetLastError();
    return s;
}

// In the entry points below (kvq_cuda_attention, kvq_cuda_attention_sched): a CUDA call that
// fails records the error in st (e, st, err in scope) and jumps to their cleanup label `done`.
#define CU_OR_DONE(call)                                                  \
    do {                                                                  \
        if ((e = (call)) != cudaSuccess) {                                \
            st = cu_fail(err, e, #call, __FILE__, __LINE__);              \
            goto done;                                                    \
        }                                                                 \
    } while (0)

extern "C" kvq_status kvq_cuda_attention(int device, const kvq_cuda_attn_shape *s, kvq_cuda_math math, const float *q,
                                         const float *k, const float *v, const float *pk, const float *pv, float *out,
                                         float *lse, int reps, double *ms, kvq_err *err)
{
    if (ms) *ms = 0;
    if (s->T <= 0 || s->P < 0 || s->n_heads <= 0 || s->n_kv_heads <= 0 || s->n_heads % s->n_kv_heads || reps < 0 ||
        kvq_cu_attn_supported(s->head_dim) || (s->P > 0 && (!pk || !pv)))
        return kvq_fail(err, KVQ_EINVAL,
                        "attention: T %d, P %d (prefix %s), heads %d/%d, head_dim %d, reps %d: expected T > 0, P >= 0 with "
                        "pk/pv, n_heads a multiple of n_kv_heads, head_dim 8/16/32/64/128, reps >= 0",
                        s->T, s->P, pk && pv ? "given" : "missing", s->n_heads, s->n_kv_heads, s->head_dim, reps);
    CU(cudaSetDevice(device));
    const size_t nq = (size_t)s->T * s->n_heads * s->head_dim, nk = (size_t)s->T * s->n_kv_heads * s->head_dim,
                 np = (size_t)s->P * s->n_kv_heads * s->head_dim, nl = (size_t)s->n_heads * s->T;
    const size_t total = 2 * nq + 2 * nk + 2 * np + nl;
    float *buf = NULL;
    cudaError_t e = cudaMalloc(&buf, total * sizeof(float));
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_ENOMEM, "attention: cannot allocate %zu floats on the GPU: %s", total, cudaGetErrorString(e));
    }
    kvq_cu_attn a = {};
    a.T = s->T;
    a.P = s->P;
    a.n_heads = s->n_heads;
    a.n_kv_heads = s->n_kv_heads;
    a.head_dim = s->head_dim;
    a.window = s->window;
    a.pos0 = s->pos0;
    a.bf16_tc = math == KVQ_CUDA_BF16;
    float *dq = buf, *dk = dq + nq, *dv = dk + nk, *dpk = dv + nk, *dpv = dpk + np, *dout = dpv + np, *dlse = dout + nq;
    a.q = dq, a.k = dk, a.v = dv, a.out = dout, a.lse = dlse;
    if (s->P > 0) a.pk = dpk, a.pv = dpv;
    cudaEvent_t e0 = NULL, e1 = NULL;
    std::vector<float> t;
    kvq_status st = KVQ_OK;
    CU_OR_DONE(cudaMemcpy(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice));
    CU_OR_DONE(cudaMemcpy(dk, k, nk * sizeof(float), cudaMemcpyHostToDevice));
    CU_OR_DONE(cudaMemcpy(dv, v, nk * sizeof(float), cudaMemcpyHostToDevice));
    if (np) {
        CU_OR_DONE(cudaMemcpy(dpk, pk, np * sizeof(float), cudaMemcpyHostToDevice));
        CU_OR_DONE(cudaMemcpy(dpv, pv, np * sizeof(float), cudaMemcpyHostToDevice));
    }
    CU_OR_DONE(cudaEventCreate(&e0));
    CU_OR_DONE(cudaEventCreate(&e1));
    for (int r = -1; r < reps; r++) {
        CU_OR_DONE(cudaEventRecord(e0, 0));
        CU_OR_DONE(kvq_cu_attention(&a, 0));
        CU_OR_DONE(cudaEventRecord(e1, 0));
        CU_OR_DONE(cudaEventSynchronize(e1));
        float x = 0;
        CU_OR_DONE(cudaEventElapsedTime(&x, e0, e1));
        if (r >= 0) t.push_back(x);
    }
    CU_OR_DONE(cudaMemcpy(out, dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    if (lse) CU_OR_DONE(cudaMemcpy(lse, dlse, nl * sizeof(float), cudaMemcpyDeviceToHost));
    if (ms && !t.empty()) {
        std::sort(t.begin(), t.end());
        *ms = t[t.size() / 2];
    }
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(buf);
    (void)cudaGetLastError();
    return st;
}

// kvq_cuda_attention_sched for a selection-form schedule (kvq_sched_sel): every buffer of its own, freed at the end.
static kvq_status ssel_entry(int device, const kvq_cuda_attn_shape *s, const float *q, const float *pk, const float *pv,
                             kvq_kv_sched *sc, float *out, double *ms, kvq_err *err)
{
    const char *why = ssel_form(sc);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "attention schedule: %s", why);
    why = kvq_cu_ssel_unsupported(s->T, s->P, s->n_heads, s->n_kv_heads, s->head_dim, sc->n_k, sc->n_v, device);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "attention schedule on the device: %s", why);
    CU(cudaSetDevice(device));
    const size_t T = s->T, nkv = s->n_kv_heads, nq = T * s->n_heads * s->head_dim, np = (size_t)s->P * nkv * s->head_dim;
    const int N = sc->sel->window < s->T ? sc->sel->window : s->T;
    const char *pre_env = getenv("KVQ_SCHED_PRESCORE");
    const bool pre = pre_env && !strcmp(pre_env, "1");
    size_t off[SP_N];
    const size_t plan = ssel_plan(off, T, s->n_heads, nkv, N, sc->n_k + sc->n_v, nkv * s->head_dim);
    const size_t nS = pre ? kvq_cu_ssel_prescore_bytes(sc->n_k, s->T, s->P, s->n_heads) : 0;
    const size_t fo = align_up(plan, 256), bytes = fo + (2 * nq + 2 * np) * sizeof(float) + nS + 256;
    char *buf = NULL;
    cudaError_t e = cudaMalloc(&buf, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_ENOMEM, "attention schedule: cannot allocate %zu bytes on the GPU: %s", bytes, cudaGetErrorString(e));
    }
    kvq_cu_ssel_args a = {};
    a.T = s->T, a.P = s->P, a.n_heads = s->n_heads, a.n_kv_heads = s->n_kv_heads, a.head_dim = s->head_dim;
    float *dq = (float *)(buf + fo), *dout = dq + nq, *dpk = dout + nq, *dpv = dpk + np;
    a.q = dq, a.out = dout;
    if (s->P > 0) a.pk = dpk, a.pv = dpv;
    if (pre) a.S = (float *)align_up((size_t)(dpv + np), 256);
    cudaEvent_t e0 = NULL, e1 = NULL, em = NULL;
    kvq_status st = ssel_bind(a, buf, off, T, sc, 0, err);
    if (st) goto done;
    CU_OR_DONE(cudaMemcpy(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice));
    if (np) {
        CU_OR_DONE(cudaMemcpy(dpk, pk, np * sizeof(float), cudaMemcpyHostToDevice));
        CU_OR_DONE(cudaMemcpy(dpv, pv, np * sizeof(float), cudaMemcpyHostToDevice));
    }
    CU_OR_DONE(cudaEventCreate(&e0));
    CU_OR_DONE(cudaEventCreate(&e1));
    CU_OR_DONE(cudaEventCreate(&em));
    CU_OR_DONE(cudaEventRecord(e0, 0));
    CU_OR_DONE(kvq_cu_ssel_attention(&a, 0, em));
    CU_OR_DONE(cudaEventRecord(e1, 0));
    CU_OR_DONE(cudaEventSynchronize(e1));
    if (ms) {
        float x = 0, y = 0;
        CU_OR_DONE(cudaEventElapsedTime(&x, e0, em));
        CU_OR_DONE(cudaEventElapsedTime(&y, em, e1));
        ms[0] = x, ms[1] = y;
    }
    CU_OR_DONE(cudaMemcpy(out, dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    if ((st = ssel_download(a, sc, 0, err)) != KVQ_OK) goto done;
    CU_OR_DONE(cudaDeviceSynchronize());
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (em) cudaEventDestroy(em);
    cudaFree(buf);
    (void)cudaGetLastError();
    return st;
}

extern "C" kvq_status kvq_cuda_attention_sched(int device, const kvq_cuda_attn_shape *s, const float *q, const float *pk,
                                               const float *pv, kvq_kv_sched *sc, float *out, double *ms, kvq_err *err)
{
    if (ms) ms[0] = ms[1] = 0;
    if (s->T <= 0 || s->P < 0 || s->n_heads <= 0 || s->n_kv_heads <= 0 || s->n_heads % s->n_kv_heads ||
        (s->P > 0 && (!pk || !pv)))
        return kvq_fail(err, KVQ_EINVAL, "attention schedule: T %d, P %d (prefix %s), heads %d/%d", s->T, s->P,
                        pk && pv ? "given" : "missing", s->n_heads, s->n_kv_heads);
    if (sc->sel) return ssel_entry(device, s, q, pk, pv, sc, out, ms, err);
    const kvq_sched_imp *im = sc->imp;
    if (!im || sc->n_k != 3 || sc->n_v != 3 || !sc->k_from || sc->k_from != sc->v_from || !im->counts)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "attention schedule: no declarative policy (forward.h kvq_sched_imp)");
    const char *why = kvq_cu_sched_unsupported(s->T, s->P, s->n_heads, s->n_kv_heads, s->head_dim, device);
    if (why) return kvq_fail(err, KVQ_EUNSUPPORTED, "attention schedule on the device: %s", why);
    CU(cudaSetDevice(device));
    const size_t T = s->T, nkv = s->n_kv_heads, nq = T * s->n_heads * s->head_dim, nk = T * nkv * s->head_dim,
                 np = (size_t)s->P * nkv * s->head_dim, nr = (size_t)s->n_heads * T;
    const char *pre_env = getenv("KVQ_SCHED_PRESCORE");
    const bool pre = pre_env && !strcmp(pre_env, "1");
    const size_t nS = pre ? kvq_cu_sched_prescore_bytes(s->T, s->P, s->n_heads) / sizeof(float) : 0;
    const size_t floats = 2 * nq + 6 * nk + 2 * np + 2 * nr + nS, bytes = floats * sizeof(float) + 2 * nkv * T * sizeof(int) +
                                                                          4 * nkv * sizeof(unsigned long long) + 64;
    char *buf = NULL;
    cudaError_t e = cudaMalloc(&buf, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvq_fail(err, KVQ_ENOMEM, "attention schedule: cannot allocate %zu bytes on the GPU: %s", bytes,
                        cudaGetErrorString(e));
    }
    kvq_cu_sched_args a = {};
    a.T = s->T;
    a.P = s->P;
    a.n_heads = s->n_heads;
    a.n_kv_heads = s->n_kv_heads;
    a.head_dim = s->head_dim;
    a.budget = im->budget;
    a.probe = im->probe;
    a.window = im->window;
    a.n_sink = im->n_sink;
    a.normalise = im->normalise;
    unsigned long long *dcnt = (unsigned long long *)buf;
    float *f = (float *)(dcnt + 4 * nkv), *dq = f, *dout = dq + nq, *dpk = dout + nq, *dpv = dpk + np;
    float *dk = dpv + np, *dm = dk + 6 * nk, *ds = dm + nr;
    int *dfrom = (int *)(ds + nr + nS);
    if (pre) a.S = ds + nr;
    a.q = dq, a.out = dout, a.row_m = dm, a.row_s = ds, a.from = dfrom, a.counts = dcnt;
    if (s->P > 0) a.pk = dpk, a.pv = dpv;
    for (int r = 0; r < 3; r++) a.k[r] = dk + r * nk, a.v[r] = dk + (3 + r) * nk;
    cudaEvent_t e0 = NULL, e1 = NULL, em = NULL;
    kvq_status st = KVQ_OK;
    std::vector<unsigned long long> cnt(4 * nkv);
    CU_OR_DONE(cudaMemcpy(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice));
    for (int r = 0; r < 3; r++) {
        CU_OR_DONE(cudaMemcpy((float *)a.k[r], sc->k[r], nk * sizeof(float), cudaMemcpyHostToDevice));
        CU_OR_DONE(cudaMemcpy((float *)a.v[r], sc->v[r], nk * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (np) {
        CU_OR_DONE(cudaMemcpy(dpk, pk, np * sizeof(float), cudaMemcpyHostToDevice));
        CU_OR_DONE(cudaMemcpy(dpv, pv, np * sizeof(float), cudaMemcpyHostToDevice));
    }
    CU_OR_DONE(cudaEventCreate(&e0));
    CU_OR_DONE(cudaEventCreate(&e1));
    CU_OR_DONE(cudaEventCreate(&em));
    CU_OR_DONE(cudaEventRecord(e0, 0));
    CU_OR_DONE(kvq_cu_sched_attention(&a, 0, em));
    CU_OR_DONE(cudaEventRecord(e1, 0));
    CU_OR_DONE(cudaEventSynchronize(e1));
    if (ms) {
        float x = 0, y = 0;
        CU_OR_DONE(cudaEventElapsedTime(&x, e0, em));
        CU_OR_DONE(cudaEventElapsedTime(&y, em, e1));
        ms[0] = x, ms[1] = y;
    }
    CU_OR_DONE(cudaMemcpy(out, dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    CU_OR_DONE(cudaMemcpy(sc->k_from, dfrom, 2 * nkv * T * sizeof(int), cudaMemcpyDeviceToHost));
    CU_OR_DONE(cudaMemcpy(cnt.data(), dcnt, cnt.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    for (size_t x = 0; x < cnt.size(); x++) im->counts[x] = cnt[x];
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (em) cudaEventDestroy(em);
    cudaFree(buf);
    (void)cudaGetLastError();
    return st;
}
