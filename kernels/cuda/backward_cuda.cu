// backward_cuda.cu — kvq_backward_run (backward.h) on one CUDA GPU: the
// forward keeps every layer's activations on the device
// (KVQ_FWD_SAVE_ACTIVATIONS), then the LM head + cross-entropy, the MLP, the
// attention (cuda_bwd_ops.cu) and the projections are differentiated layer by
// layer from the top, with cuBLAS for dX = dY W. See forward_cuda.h.
#include <math.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "backward.h"
#include "forward_cuda.h"
}
#include "cuda_ops.cuh"
#include "forward_cuda_impl.cuh"

namespace {

// dx[T][in] = beta dx + dy[T][out] W, W row-major [out][in] (column-major in x out, ld in).
kvq_status linear_bwd(kvq_forward_cuda *g, float *dx, const float *dy, const float *w, int T, int in, int out, float beta,
                      kvq_err *err)
{
    return gemm_w(g, CUBLAS_OP_N, in, T, out, w, in, dy, out, beta, dx, in, err);
}

// Allocated on the first backward; a failed attempt is completed by the next call (the pinned buffer comes
// last: its presence means everything is there).
kvq_status bwd_alloc(kvq_forward_cuda *g, kvq_err *err)
{
    if (g->hbbuf) return KVQ_OK;
    if (!g->b_ev) CU(cudaEventCreateWithFlags(&g->b_ev, cudaEventDisableTiming));
    const kvq_hparams *hp = &g->m->hp;
    const size_t T = g->max_T, P = g->max_P, dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    const size_t nh = hp->n_heads;
    carve c;
    for (int pass = 0; pass < 2; pass++) {
        c.off = 0;
        c.take(&g->b_dx, T * dim);
        c.take(&g->b_dxn, T * dim);
        c.take(&g->b_xn, T * dim);
        c.take(&g->b_dh, T * hid);
        c.take(&g->b_dup, T * hid);
        c.take(&g->b_datt, T * qd);
        c.take(&g->b_dq, T * qd);
        c.take(&g->b_dk, T * kvd);
        c.take(&g->b_dv, T * kvd);
        c.take(&g->b_dkpre, T * kvd);
        c.take(&g->b_dpk, P * kvd + 4);
        c.take(&g->b_dpv, P * kvd + 4);
        c.take(&g->b_D, nh * T);
        c.take(&g->b_lse, T);
        c.take(&g->b_flag, 1);
        if (hp->qk_norm) {
            c.take(&g->b_qraw, T * qd);
            c.take(&g->b_kraw, T * kvd);
            c.take(&g->b_dqraw, T * qd);
            c.take(&g->b_dkraw, T * kvd);
        }
        if (pass == 0) {
            char what[160];
            snprintf(what, sizeof what, "the backward pass's gradients (%d tokens)", g->max_T);
            if (!g->bbuf) KVQ_TRY(dev_alloc(g, &g->bbuf, c.off, what, err)); // kept from an attempt whose host half failed
            c.base = (char *)g->bbuf;
        }
    }
    carve h;
    for (int pass = 0; pass < 2; pass++) {
        h.off = 0;
        h.take(&g->hb_dkpre, T * kvd);
        h.take(&g->hb_dk, T * kvd);
        h.take(&g->hb_dv, T * kvd);
        h.take(&g->hb_dpk, P * kvd + 4);
        h.take(&g->hb_dpv, P * kvd + 4);
        h.take(&g->hb_x, T * dim);
        h.take(&g->hb_dx, T * dim);
        h.take(&g->hb_flag, 1);
        if (pass == 0) {
            cudaError_t e = cudaMallocHost(&g->hbbuf, h.off);
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                g->hbbuf = NULL;
                return kvq_fail(err, KVQ_ENOMEM, "CUDA backward: cannot allocate %.1f MiB of pinned host memory for max_T %d: %s",
                                h.off / 1048576.0, g->max_T, cudaGetErrorString(e));
            }
            h.base = (char *)g->hbbuf;
        }
    }
    return KVQ_OK;
}

// The LM head + mean cross-entropy: dxn = dL/d(normed final hidden states), in two
// passes over the vocabulary blocks (log-sum-exp, then the gradient), NLL per row.
kvq_status head_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, bool set_loss, int n_scored, kvq_bwd_result *res,
                         kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int T = io->T, dim = hp->dim, V = hp->vocab_size;
    const float *x_last = g->xs + (size_t)(g->l1 - g->l0) * g->max_T * dim; // (the last stage: l1 == n_layers)
    CU(kvq_cu_rmsnorm(g->b_xn, x_last, g->out_norm, T, dim, hp->norm_eps, g->st));
    CU(kvq_cu_lse_init(g->row_max, g->row_sum, g->row_tgt, T, g->st));
    for (int v0 = 0; v0 < V; v0 += g->v_chunk) {
        int nv = V - v0 < g->v_chunk ? V - v0 : g->v_chunk;
        KVQ_TRY(linear(g, g->blk, g->b_xn, woff(g, g->output, (size_t)v0 * dim), T, dim, nv, 0, err));
        CU(kvq_cu_lse_block(g->blk, g->tg, v0, nv, T, g->row_max, g->row_sum, g->row_tgt, g->st));
    }
    CU(kvq_cu_lse_final(g->b_lse, g->row_max, g->row_sum, g->tg, T, g->st));
    const float scale = (float)(1.0 / n_scored);
    for (int v0 = 0; v0 < V; v0 += g->v_chunk) {
        int nv = V - v0 < g->v_chunk ? V - v0 : g->v_chunk;
        KVQ_TRY(linear(g, g->blk, g->b_xn, woff(g, g->output, (size_t)v0 * dim), T, dim, nv, 0, err));
        CU(kvq_cu_xent_grad(g->blk, g->tg, v0, nv, T, g->b_lse, scale, g->st));
        const float beta = v0 == 0 ? 0.0f : 1.0f;
        // dxn[T][dim] (+)= dz[T][nv] W_blk[nv][dim]
        KVQ_TRY(gemm_w(g, CUBLAS_OP_N, dim, T, nv, woff(g, g->output, (size_t)v0 * dim), dim, g->blk, nv, beta, g->b_dxn, dim, err));
    }
    CU(cudaMemcpyAsync(g->h_row_max, g->row_max, (size_t)T * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_row_tgt, g->row_tgt, (size_t)T * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    CU(cudaMemcpyAsync(g->h_row_sum, g->row_sum, (size_t)T * sizeof(double), cudaMemcpyDeviceToHost, g->st));
    CU(cudaStreamSynchronize(g->st));
    double total = 0;
    int bad = -1;
    for (int t = 0; t < T; t++) {
        const int tg = g->h_tg[t];
        double nll = tg >= 0 ? (double)g->h_row_max[t] + log(g->h_row_sum[t]) - (double)g->h_row_tgt[t] : NAN;
        if (set_loss && io->nll) io->nll[t] = nll;
        if (tg < 0) continue;
        if (!isfinite(nll) && bad < 0) bad = t;
        total += nll;
    }
    res->xent_loss = total / n_scored;
    if (set_loss) res->loss = res->xent_loss;
    if (bad >= 0)
        return kvq_fail(err, KVQ_ENUMERIC, "backward: non-finite logits/NLL at window index %d (position %d)", bad, io->pos0 + bad);
    CU(kvq_cu_rmsnorm_bwd(g->b_dx, g->b_dxn, x_last, g->out_norm, T, dim, hp->norm_eps, 0, g->st));
    return KVQ_OK;
}

// Layer l: on entry b_dx = dL/d(layer output), on return dL/d(layer input).
kvq_status layer_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const dev_layer &w = g->L[l];
    const int T = io->T, P = g->P_last, dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    const int nh = hp->n_heads, nkv = hp->n_kv_heads, hd = hp->head_dim;
    const size_t mT = g->max_T, kvn = (size_t)T * kvd, sl = (size_t)(l - g->l0); // the stage's store slot of layer l
    const float *x_in = g->xs + sl * mT * dim, *x_mid = g->s_xmid + sl * mT * dim;
    // ---- MLP ----
    KVQ_TRY(linear_bwd(g, g->b_dh, g->b_dx, w.w_down, T, hid, dim, 0.0f, err));
    CU(kvq_cu_swiglu_bwd(g->b_dh, g->b_dup, g->b_dh, g->s_gate + sl * mT * hid, g->s_up + sl * mT * hid, (size_t)T * hid, g->st));
    KVQ_TRY(linear_bwd(g, g->b_dxn, g->b_dh, w.w_gate, T, dim, hid, 0.0f, err));
    KVQ_TRY(linear_bwd(g, g->b_dxn, g->b_dup, w.w_up, T, dim, hid, 1.0f, err));
    CU(kvq_cu_rmsnorm_bwd(g->b_dx, g->b_dxn, x_mid, w.ffn_norm, T, dim, hp->norm_eps, 1, g->st));
    // ---- attention ----
    KVQ_TRY(linear_bwd(g, g->b_datt, g->b_dx, w.wo, T, qd, dim, 0.0f, err));
    kvq_cu_attn a = {};
    a.T = T;
    a.P = P;
    a.n_heads = nh;
    a.n_kv_heads = nkv;
    a.head_dim = hd;
    a.q = g->s_q + sl * mT * qd;
    a.k = g->s_k + sl * mT * kvd;
    a.v = g->s_v + sl * mT * kvd;
    if (g->s_alt[sl] & 1) {
        a.kq = g->s_kq + sl * mT * kvd;
        a.kb = g->s_kb + sl * mT;
    }
    if (g->s_alt[sl] & 2) {
        a.vq = g->s_vq + sl * mT * kvd;
        a.vb = g->s_vb + sl * mT;
    }
    if (P > 0) {
        a.pk = g->pk + (size_t)l * P * kvd;
        a.pv = g->pv + (size_t)l * P * kvd;
    }
    a.out = g->s_att + sl * mT * qd;
    a.lse = g->s_lse + sl * (size_t)nh * mT;
    a.window = kvq_layer_window(hp, l);
    a.pos0 = io->pos0;
    kvq_cu_attn_grad b = {};
    b.dout = g->b_datt;
    b.D = g->b_D;
    b.dq = g->b_dq;
    b.dk = g->b_dk;
    b.dv = g->b_dv;
    b.dpk = P > 0 ? g->b_dpk : NULL;
    b.dpv = P > 0 ? g->b_dpv : NULL;
    CU(kvq_cu_attn_bwd(&a, &b, g->st));
    // dk holds dL/dK post-RoPE (the keys attention read); the pre-RoPE gradient is its inverse rotation
    CU(cudaMemcpyAsync(g->b_dkpre, g->b_dk, kvn * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
    CU(kvq_cu_rope_inv(g->b_dkpre, T, nkv, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
    CU(kvq_cu_rope_inv(g->b_dq, T, nh, hd, hp->rope_dim, g->rcos, g->rsin, g->st));
    CU(cudaMemsetAsync(g->b_flag, 0, sizeof(int), g->st));
    CU(kvq_cu_nonfinite(g->b_dk, kvn, g->b_flag, g->st));
    CU(kvq_cu_nonfinite(g->b_dv, kvn, g->b_flag, g->st));
    CU(cudaMemcpyAsync(g->hb_flag, g->b_flag, sizeof(int), cudaMemcpyDeviceToHost, g->st));
    if (spec->grads) {
        KVQ_TRY(d2h(g, g->hb_dkpre, g->b_dkpre, kvn, err));
        KVQ_TRY(d2h(g, g->hb_dk, g->b_dk, kvn, err));
        KVQ_TRY(d2h(g, g->hb_dv, g->b_dv, kvn, err));
        if (P > 0) {
            KVQ_TRY(d2h(g, g->hb_dpk, g->b_dpk, (size_t)P * kvd, err));
            KVQ_TRY(d2h(g, g->hb_dpv, g->b_dpv, (size_t)P * kvd, err));
        }
    }
    // the rest of the layer does not wait for the host
    const float *dq_in = g->b_dq, *dk_in = g->b_dkpre;
    if (hp->qk_norm) { // back through the per-head q/k RMSNorm (Qwen3): recompute the pre-norm q, k from the layer input
        CU(kvq_cu_rmsnorm(g->b_xn, x_in, w.attn_norm, T, dim, hp->norm_eps, g->st));
        KVQ_TRY(linear(g, g->b_qraw, g->b_xn, w.wq, T, dim, qd, 0, err));
        KVQ_TRY(linear(g, g->b_kraw, g->b_xn, w.wk, T, dim, kvd, 0, err));
        KVQ_TRY(qkv_finish(g, w, T, g->b_qraw, g->b_kraw, NULL, false, err));
        CU(kvq_cu_rmsnorm_bwd(g->b_dqraw, g->b_dq, g->b_qraw, w.q_norm, T * nh, hd, hp->norm_eps, 0, g->st));
        CU(kvq_cu_rmsnorm_bwd(g->b_dkraw, g->b_dkpre, g->b_kraw, w.k_norm, T * nkv, hd, hp->norm_eps, 0, g->st));
        dq_in = g->b_dqraw;
        dk_in = g->b_dkraw;
    }
    KVQ_TRY(linear_bwd(g, g->b_dxn, dq_in, w.wq, T, dim, qd, 0.0f, err));
    KVQ_TRY(linear_bwd(g, g->b_dxn, dk_in, w.wk, T, dim, kvd, 1.0f, err));
    KVQ_TRY(linear_bwd(g, g->b_dxn, g->b_dv, w.wv, T, dim, kvd, 1.0f, err));
    CU(cudaEventRecord(g->b_ev, g->st));
    CU(kvq_cu_rmsnorm_bwd(g->b_dx, g->b_dxn, x_in, w.attn_norm, T, dim, hp->norm_eps, 1, g->st));
    CU(cudaEventSynchronize(g->b_ev));
    if (*g->hb_flag) return kvq_fail(err, KVQ_ENUMERIC, "backward: layer %d: non-finite dL/dK or dL/dV", l);
    if (spec->grads) {
        kvq_layer_grads gr = {};
        gr.layer = l;
        gr.T = T;
        gr.P = P;
        gr.n_kv_heads = nkv;
        gr.head_dim = hd;
        gr.dk_pre = g->hb_dkpre;
        gr.dk_post = g->hb_dk;
        gr.dv = g->hb_dv;
        gr.dpk = P > 0 ? g->hb_dpk : NULL;
        gr.dpv = P > 0 ? g->hb_dpv : NULL;
        kvq_status s = spec->grads(spec->user, &gr, err);
        if (s) return kvq_err_prefix(err, "backward: layer %d: grads callback", l);
    }
    return KVQ_OK;
}

// The forward of a stage (all layers: the whole model) keeping what the backward needs.
kvq_status stage_forward_impl(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec, const float *x_in,
                              kvq_bwd_result *res, kvq_err *err)
{
    double t0 = now_s();
    g->bs_ready = false;
    kvq_fwd_io fio = *io;
    fio.skip_loss = spec->xent && !io->logits;
    kvq_fwd_result fr;
    KVQ_TRY(kvq_forward_cuda_stage(g, &fio, x_in, &fr, err));
    res->loss = fr.loss;
    res->n_scored = fr.n_scored;
    if (spec->xent && fr.n_scored == 0)
        return kvq_fail(err, KVQ_EINVAL, "backward: cross-entropy requested but no position of the %d-token window is scored", io->T);
    g->bs_fr = fr;
    g->bs_skip = fio.skip_loss;
    g->bs_ready = true;
    g->t_bwd_forward = now_s() - t0;
    return KVQ_OK;
}

// The backward of a stage: from the LM head (the last stage) or from dx_in (device, dL/d(stream leaving layer l1-1));
// on return b_dx = dL/d(stream entering layer l0).
kvq_status stage_backward_impl(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec, const float *dx_in,
                               kvq_bwd_result *res, kvq_err *err)
{
    const kvq_hparams *hp = &g->m->hp;
    const int T = io->T, dim = hp->dim;
    if (!g->bs_ready || g->T_last != T)
        return kvq_fail(err, KVQ_EINVAL, "CUDA backward: stage of layers %d..%d without its forward", g->l0, g->l1 - 1);
    g->bs_ready = false;
    CU(cudaSetDevice(g->dev));
    double t1 = now_s();
    const size_t mT = g->max_T, n = (size_t)T * dim;
    if (g->l1 < hp->n_layers) {
        if (!dx_in) return kvq_fail(err, KVQ_EINVAL, "CUDA backward: a stage ending before the last layer needs dL/dx of its output");
        if (dx_in != g->b_dx) CU(cudaMemcpyAsync(g->b_dx, dx_in, n * sizeof(float), cudaMemcpyDeviceToDevice, g->st));
    } else if (spec->xent) {
        KVQ_TRY(head_backward(g, io, g->bs_skip, g->bs_fr.n_scored, res, err));
    } else {
        CU(cudaMemsetAsync(g->b_dx, 0, n * sizeof(float), g->st));
    }
    CU(cudaStreamSynchronize(g->st));
    double t2 = now_s();
    g->t_bwd_head = t2 - t1;
    for (int l = g->l1 - 1; l >= g->l0; l--) {
        if (spec->upstream) {
            kvq_layer_ctx ctx = {l, T, io->pos0, g->P_last, hp->n_heads, hp->n_kv_heads, hp->head_dim, io->tokens,
                                 hp->n_layers};
            KVQ_TRY(d2h(g, g->hb_x, g->xs + (size_t)(l + 1 - g->l0) * mT * dim, n, err));
            KVQ_TRY(d2h(g, g->hb_dx, g->b_dx, n, err));
            CU(cudaStreamSynchronize(g->st));
            kvq_status s = spec->upstream(spec->user, &ctx, g->hb_x, g->hb_dx, err);
            if (s) return kvq_err_prefix(err, "backward: layer %d: upstream callback", l);
            KVQ_TRY(h2d(g, g->b_dx, g->hb_dx, n, err));
        }
        KVQ_TRY(layer_backward(g, io, spec, l, err));
    }
    if (g->l0 == 0 && spec->d_embd) {
        CU(cudaMemcpyAsync(spec->d_embd, g->b_dx, n * sizeof(float), cudaMemcpyDeviceToHost, g->st));
    }
    CU(cudaStreamSynchronize(g->st));
    CU(cudaGetLastError());
    g->t_bwd_layers = now_s() - t2;
    return KVQ_OK;
}

kvq_status bwd_check(kvq_forward_cuda *g, const kvq_bwd_spec *spec, kvq_bwd_result *res, kvq_err *err)
{
    res->loss = NAN;
    res->n_scored = 0;
    res->xent_loss = NAN;
    if (!spec->xent && !spec->upstream)
        return kvq_fail(err, KVQ_EINVAL, "backward: nothing to differentiate (neither cross-entropy nor an upstream gradient)");
    if (!g->s_q)
        return kvq_fail(err, KVQ_EINVAL,
                        "CUDA backward: the workspace keeps no activations (initialise it with KVQ_FWD_SAVE_ACTIVATIONS)");
    CU(cudaSetDevice(g->dev));
    return bwd_alloc(g, err);
}

kvq_status bwd_done(kvq_forward_cuda *g, kvq_status s)
{
    if (s != KVQ_OK) {
        cudaStreamSynchronize(g->st);
        (void)cudaGetLastError();
    }
    return s;
}

} // namespace

extern "C" kvq_status kvq_forward_cuda_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                kvq_bwd_result *res, kvq_err *err)
{
    KVQ_TRY(bwd_check(g, spec, res, err));
    kvq_status s = stage_forward_impl(g, io, spec, NULL, res, err);
    if (!s) s = stage_backward_impl(g, io, spec, NULL, res, err);
    return bwd_done(g, s);
}

extern "C" kvq_status kvq_forward_cuda_backward_stage_forward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                              const float *x_in, kvq_bwd_result *res, kvq_err *err)
{
    KVQ_TRY(bwd_check(g, spec, res, err));
    return bwd_done(g, stage_forward_impl(g, io, spec, x_in, res, err));
}

extern "C" kvq_status kvq_forward_cuda_backward_stage_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                               const float *dx_in, kvq_bwd_result *res, kvq_err *err)
{
    return bwd_done(g, stage_backward_impl(g, io, spec, dx_in, res, err));
}

extern "C" float *kvq_forward_cuda_stage_dx(kvq_forward_cuda *g) { return g->b_dx; }

extern "C" void kvq_forward_cuda_backward_times(const kvq_forward_cuda *g, double *forward_s, double *head_s, double *layers_s)
{
    *forward_s = g->t_bwd_forward;
    *head_s = g->t_bwd_head;
    *layers_s = g->t_bwd_layers;
}
