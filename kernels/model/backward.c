/* backward.c — reverse-mode gradients through the forward with frozen
 * weights and per-layer recomputation; see backward.h. */
#include "backward.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "ops_backward.h"

kvq_status kvq_backward_init(kvq_backward *bw, const kvq_model *m, int max_T, int max_P, kvq_err *err)
{
    return kvq_backward_init_opts(bw, m, max_T, max_P, -1, err);
}

kvq_status kvq_backward_init_opts(kvq_backward *bw, const kvq_model *m, int max_T, int max_P, int keep_acts, kvq_err *err)
{
    memset(bw, 0, sizeof *bw);
    const kvq_hparams *hp = &m->hp;
    /* automatic: keep every layer's activations in the forward (no
     * recomputation) when they fit in KVQ_BWD_KEEP_ACTS_MAX bytes */
    double act_bytes = 4.0 * hp->n_layers * (double)max_T *
                       (2.0 * kvq_q_dim(hp) + 4.0 * kvq_kv_dim(hp) + hp->dim + 2.0 * hp->hidden_dim + hp->n_heads);
    bw->keep_acts = keep_acts < 0 ? act_bytes <= KVQ_BWD_KEEP_ACTS_MAX : keep_acts > 0;
    KVQ_TRY(kvq_forward_init(&bw->fw, m, max_T, max_P, bw->keep_acts ? KVQ_FWD_SAVE_ACTIVATIONS : KVQ_FWD_SAVE_LAYER_INPUTS, err));
    bw->m = m;
    bw->max_T = max_T;
    bw->max_P = max_P;
    bw->n_threads = bw->fw.n_threads;
    /* vocabulary block: about 4M logits */
    int vc = (int)(((size_t)1 << 22) / (size_t)max_T);
    if (vc > 8192) vc = 8192;
    if (vc < 256) vc = 256;
    if (vc > hp->vocab_size) vc = hp->vocab_size;
    bw->v_chunk = vc;
    size_t T = max_T, P = max_P, dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    size_t half = hp->rope_dim / 2, nh = hp->n_heads;
    /* qk_norm: the pre-norm q/k and their gradients; non-fp32 weights: a block of converted rows, and an LM-head
     * vocabulary block when the head is not fp32 */
    size_t qn = hp->qk_norm ? T * qd : 0, kn = hp->qk_norm ? T * kvd : 0;
    bw->wscratch_floats = bw->fw.wscratch_floats;
    size_t hb = kvq_mat_f32(&m->output) ? 0 : (size_t)vc * dim;
    /* gate and up: the forward's own buffers, idle once the forward has run (its activations, when kept, are
     * copies): [T][hidden] each that a large model does not hold twice */
    size_t sz[] = {T * dim, T * dim, T * dim, T * dim, T * qd, T * qd, T * qd, T * qd,
                   T * kvd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd,
                   0, 0, T * hid, P * kvd, P * kvd, nh * T, T * half, T * half, T * (size_t)vc, T, T,
                   qn, kn, qn, kn, hb};
    float **dst[] = {&bw->x_mid, &bw->xn, &bw->dx, &bw->dxn, &bw->q, &bw->att, &bw->datt, &bw->dq,
                     &bw->k_pre, &bw->k_att, &bw->v_att, &bw->k_alt, &bw->v_alt, &bw->dk, &bw->dv, &bw->dk_pre,
                     &bw->gate, &bw->up, &bw->dh, &bw->dpk, &bw->dpv, &bw->lse, &bw->rope_cos, &bw->rope_sin, &bw->zbuf,
                     &bw->rmax, &bw->rtgt, &bw->q_raw, &bw->k_raw, &bw->dq_raw, &bw->dk_raw, &bw->head_buf};
    size_t n = sizeof sz / sizeof *sz, total = 0;
    for (size_t i = 0; i < n; i++)
        if (kvq_add_size(total, sz[i], &total)) {
            kvq_backward_free(bw);
            return kvq_fail(err, KVQ_ENOMEM, "backward: workspace size overflows (max_T %d)", max_T);
        }
    bw->arena = malloc(total * sizeof(float));
    bw->iarena = malloc(3 * T * sizeof(int));
    bw->darena = malloc(2 * T * sizeof(double));
    if (!bw->arena || !bw->iarena || !bw->darena) {
        kvq_backward_free(bw);
        return kvq_fail(err, KVQ_ENOMEM, "backward: cannot allocate %.1f MiB for max_T %d", total * 4.0 / (1 << 20), max_T);
    }
    float *p = bw->arena;
    for (size_t i = 0; i < n; i++) {
        *dst[i] = sz[i] ? p : NULL;
        p += sz[i];
    }
    bw->wscratch = bw->fw.wscratch; /* shared: the forward and the backward never run at once */
    bw->gate = bw->fw.gate;
    bw->up = bw->fw.up;
    bw->k_bound = bw->iarena;
    bw->v_bound = bw->iarena + T;
    bw->targets = bw->iarena + 2 * T;
    bw->rsum = bw->darena;
    bw->nll = bw->darena + T;
    kvq_status s = kvq_attn_grad_ws_init(&bw->attn, max_T, max_P, hp->n_heads, hp->n_kv_heads, hp->head_dim, bw->n_threads,
                                         sizeof(float), err);
    if (!s) s = kvq_attn_ws_init(&bw->fattn, max_T, max_P, hp->n_kv_heads, hp->head_dim, bw->n_threads, err);
    if (s) kvq_backward_free(bw);
    return s;
}

void kvq_backward_free(kvq_backward *bw)
{
    kvq_forward_free(&bw->fw);
    kvq_attn_grad_ws_free(&bw->attn);
    kvq_attn_ws_free(&bw->fattn);
    free(bw->arena);
    free(bw->iarena);
    free(bw->darena);
    memset(bw, 0, sizeof *bw);
}

static int all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

#define WS(bw) (bw)->wscratch, (bw)->wscratch_floats

/* q, k (pre-RoPE), v of layer w from its input x (forward.c's qkv_project:
 * norm, projections, biases, q/k norms); with q/k norms the pre-norm q and k
 * are kept in bw->q_raw / bw->k_raw for their backward. */
static void qkv_recompute(kvq_backward *bw, const kvq_layer_weights *w, const float *x, int T, float *q, float *k, float *v)
{
    const kvq_hparams *hp = &bw->m->hp;
    const int qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp);
    kvq_rmsnorm(bw->xn, x, w->attn_norm, T, hp->dim, hp->norm_eps);
    kvq_linear_mat(q, bw->xn, &w->wq, T, 0, WS(bw), 0);
    kvq_linear_mat(k, bw->xn, &w->wk, T, 0, WS(bw), 0);
    if (v) kvq_linear_mat(v, bw->xn, &w->wv, T, 0, WS(bw), 0);
    if (w->bq) kvq_add_bias(q, w->bq, T, qd);
    if (w->bk) kvq_add_bias(k, w->bk, T, kvd);
    if (v && w->bv) kvq_add_bias(v, w->bv, T, kvd);
    if (hp->qk_norm) {
        memcpy(bw->q_raw, q, (size_t)T * qd * sizeof(float));
        memcpy(bw->k_raw, k, (size_t)T * kvd * sizeof(float));
        kvq_rmsnorm(q, q, w->q_norm, T * hp->n_heads, hp->head_dim, hp->norm_eps);
        kvq_rmsnorm(k, k, w->k_norm, T * hp->n_kv_heads, hp->head_dim, hp->norm_eps);
    }
}

/* Recompute layer l's activations from its input x into bw (mirrors
 * kvq_forward_run / layer_attention); a->pk/pv are set by the caller. Used
 * when the forward did not keep the activations (KVQ_FWD_SAVE_ACTIVATIONS). */
static kvq_status layer_recompute(kvq_backward *bw, const kvq_fwd_io *io, int l, const float *x, kvq_attn_grad_args *a, kvq_err *err)
{
    const kvq_model *m = bw->m;
    const kvq_hparams *hp = &m->hp;
    const kvq_layer_weights *w = &m->layers[l];
    const int T = io->T, dim = hp->dim, kvd = kvq_kv_dim(hp);
    const int nh = hp->n_heads, nkv = hp->n_kv_heads, hd = hp->head_dim, rd = hp->rope_dim;
    const kvq_hooks *hk = io->hooks;
    const int P = io->prefix ? io->prefix->P : 0;
    const size_t kvn = (size_t)T * kvd;
    kvq_layer_ctx ctx = {.layer = l, .T = T, .pos0 = io->pos0, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                         .tokens = io->tokens, .n_layers = hp->n_layers};
    qkv_recompute(bw, w, x, T, bw->q, bw->k_pre, bw->v_att);
    kvq_rope_apply(bw->q, T, nh, hd, rd, bw->rope_cos, bw->rope_sin, 0);
    a->q = bw->q;
    a->k = bw->k_att;
    a->v = bw->v_att;
    a->out = bw->att;
    a->lse = bw->lse;
    bool pre = !hk || hk->key_stage == KVQ_KEYS_PRE_ROPE;
    memcpy(bw->k_att, bw->k_pre, kvn * sizeof(float));
    if (!pre) kvq_rope_apply(bw->k_att, T, nkv, hd, rd, bw->rope_cos, bw->rope_sin, 0);
    if (hk && hk->transform) {
        kvq_kv_alt alt = {.k = bw->k_alt, .k_bound = bw->k_bound, .v = bw->v_alt, .v_bound = bw->v_bound};
        kvq_status s = hk->transform(hk->user, &ctx, bw->k_att, bw->v_att, &alt, err);
        if (s) return kvq_err_prefix(err, "backward: layer %d: KV transform", l);
        if (alt.sched)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "backward: layer %d: a scheme with a per-key schedule of representations "
                            "has no backward pass (its decisions are not differentiable)", l);
        if (alt.use_k) {
            if (pre) kvq_rope_apply(bw->k_alt, T, nkv, hd, rd, bw->rope_cos, bw->rope_sin, 0);
            a->kq = bw->k_alt;
            a->kb = bw->k_bound;
        }
        if (alt.use_v) {
            a->vq = bw->v_alt;
            a->vb = bw->v_bound;
        }
    }
    if (pre) kvq_rope_apply(bw->k_att, T, nkv, hd, rd, bw->rope_cos, bw->rope_sin, 0);
    kvq_attn_args fa = {.T = T, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .q = a->q, .k = a->k, .v = a->v,
                        .pk = a->pk, .pv = a->pv, .kq = a->kq, .kb = a->kb, .vq = a->vq, .vb = a->vb, .out = bw->att, .lse = bw->lse,
                        .window = a->window, .pos0 = a->pos0};
    kvq_status s = kvq_attention(&fa, &bw->fattn, err);
    if (s) return kvq_err_prefix(err, "backward: layer %d", l);
    memcpy(bw->x_mid, x, (size_t)T * dim * sizeof(float));
    kvq_linear_mat(bw->x_mid, bw->att, &w->wo, T, 1.0f, WS(bw), 0);
    if (w->bo) kvq_add_bias(bw->x_mid, w->bo, T, dim);
    kvq_rmsnorm(bw->xn, bw->x_mid, w->ffn_norm, T, dim, hp->norm_eps);
    kvq_linear_mat(bw->gate, bw->xn, &w->w_gate, T, 0, WS(bw), 0);
    kvq_linear_mat(bw->up, bw->xn, &w->w_up, T, 0, WS(bw), 0);

    return KVQ_OK;
}

/* Differentiate layer l (activations kept by the forward, or recomputed
 * from its input x, the forward's checkpoint): on entry bw->dx =
 * dL/d(layer output), on return dL/d(layer input). */
static kvq_status layer_backward(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l, const float *x, kvq_err *err)
{
    const kvq_model *m = bw->m;
    const kvq_hparams *hp = &m->hp;
    const kvq_layer_weights *w = &m->layers[l];
    const int T = io->T, dim = hp->dim, kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    const int nh = hp->n_heads, nkv = hp->n_kv_heads, hd = hp->head_dim, rd = hp->rope_dim;
    const kvq_prefix *px = io->prefix;
    const int P = px ? px->P : 0;
    const size_t kvn = (size_t)T * kvd;

    double t0 = omp_get_wtime();
    kvq_attn_grad_args a = {.T = T, .P = P, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .window = kvq_layer_window(hp, l),
                            .pos0 = io->pos0};
    if (P > 0) {
        size_t off = (size_t)l * P * kvd;
        a.pk = px->k + off;
        a.pv = px->v + off;
    }
    const float *x_mid = bw->x_mid, *gate = bw->gate, *up = bw->up;
    kvq_fwd_layer_acts acts;
    if (kvq_forward_layer_acts(&bw->fw, l, &acts)) {
        /* activations kept by the forward: no recomputation. kvq_attn_bwd
         * only reads out and lse (the casts drop const for its args type). */
        a.q = acts.q;
        a.k = acts.k;
        a.v = acts.v;
        a.kq = acts.kq;
        a.kb = acts.kb;
        a.vq = acts.vq;
        a.vb = acts.vb;
        a.out = (float *)acts.att;
        a.lse = (float *)acts.lse;
        x_mid = acts.x_mid;
        gate = acts.gate;
        up = acts.up;
        if (hp->qk_norm) qkv_recompute(bw, w, x, T, bw->q, bw->k_pre, NULL); /* the pre-norm q, k for the norm's backward */
    } else {
        KVQ_TRY(layer_recompute(bw, io, l, x, &a, err));
    }
    double t1 = omp_get_wtime();
    bw->t_recompute += t1 - t0;
    /* ---- backward: MLP ---- */
    kvq_linear_bwd_mat(bw->dh, bw->dx, &w->w_down, T, 0, WS(bw));
    kvq_swiglu_bwd(bw->gate, bw->up, bw->dh, gate, up, (size_t)T * hid); /* bw->gate, bw->up now hold their gradients */
    kvq_linear_bwd_mat(bw->dxn, bw->gate, &w->w_gate, T, 0, WS(bw));
    kvq_linear_bwd_mat(bw->dxn, bw->up, &w->w_up, T, 1, WS(bw));
    kvq_rmsnorm_bwd(bw->dx, bw->dxn, x_mid, w->ffn_norm, T, dim, hp->norm_eps, 1);

    /* ---- backward: attention ---- */
    kvq_linear_bwd_mat(bw->datt, bw->dx, &w->wo, T, 0, WS(bw));
    a.dout = bw->datt;
    a.dq = bw->dq;
    a.dk = bw->dk; /* straight-through: gradients of the alternative keys/values are added (dkq = dvq = NULL) */
    a.dv = bw->dv;
    a.dpk = P > 0 ? bw->dpk : NULL;
    a.dpv = P > 0 ? bw->dpv : NULL;
    double t2 = omp_get_wtime();
    kvq_status s = kvq_attn_bwd(&a, &bw->attn, err);
    if (s) return kvq_err_prefix(err, "backward: layer %d", l);
    double t3 = omp_get_wtime();
    bw->t_attn_bwd += t3 - t2;
    /* dk holds dL/dK post-RoPE (attention's keys); the pre-RoPE gradient is its inverse rotation */
    memcpy(bw->dk_pre, bw->dk, kvn * sizeof(float));
    kvq_rope_bwd(bw->dk_pre, T, nkv, hd, rd, bw->rope_cos, bw->rope_sin);
    kvq_rope_bwd(bw->dq, T, nh, hd, rd, bw->rope_cos, bw->rope_sin);
    if (!all_finite(bw->dk, kvn) || !all_finite(bw->dv, kvn))
        return kvq_fail(err, KVQ_ENUMERIC, "backward: layer %d: non-finite dL/dK or dL/dV", l);
    if (spec->grads) {
        kvq_layer_grads g = {.layer = l, .T = T, .P = P, .n_kv_heads = nkv, .head_dim = hd, .dk_pre = bw->dk_pre,
                             .dk_post = bw->dk, .dv = bw->dv, .dpk = a.dpk, .dpv = a.dpv};
        s = spec->grads(spec->user, &g, err);
        if (s) return kvq_err_prefix(err, "backward: layer %d: grads callback", l);
    }
    const float *dq_in = bw->dq, *dk_in = bw->dk_pre;
    if (hp->qk_norm) { /* back through the per-head q/k RMSNorm (Qwen3) */
        kvq_rmsnorm_bwd(bw->dq_raw, bw->dq, bw->q_raw, w->q_norm, T * nh, hd, hp->norm_eps, 0);
        kvq_rmsnorm_bwd(bw->dk_raw, bw->dk_pre, bw->k_raw, w->k_norm, T * nkv, hd, hp->norm_eps, 0);
        dq_in = bw->dq_raw;
        dk_in = bw->dk_raw;
    }
    kvq_linear_bwd_mat(bw->dxn, dq_in, &w->wq, T, 0, WS(bw));
    kvq_linear_bwd_mat(bw->dxn, dk_in, &w->wk, T, 1, WS(bw));
    kvq_linear_bwd_mat(bw->dxn, bw->dv, &w->wv, T, 1, WS(bw));
    kvq_rmsnorm_bwd(bw->dx, bw->dxn, x, w->attn_norm, T, dim, hp->norm_eps, 1);
    bw->t_other_bwd += (t2 - t1) + (omp_get_wtime() - t3);
    return KVQ_OK;
}

kvq_status kvq_backward_run(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res, kvq_err *err)
{
    const int L = bw->m->hp.n_layers;
    KVQ_TRY(kvq_backward_stage_forward(bw, io, spec, 0, L, NULL, res, err));
    return kvq_backward_stage_backward(bw, io, spec, 0, L, NULL, res, err);
}

kvq_status kvq_backward_stage_forward(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l0, int l1,
                                      const float *x_in, kvq_bwd_result *res, kvq_err *err)
{
    res->loss = NAN;
    res->n_scored = 0;
    res->xent_loss = NAN;
    bw->st_l0 = bw->st_l1 = -1;
    if (!spec->xent && !spec->upstream)
        return kvq_fail(err, KVQ_EINVAL, "backward: nothing to differentiate (neither cross-entropy nor an upstream gradient)");
    bw->t_forward = bw->t_head = bw->t_recompute = bw->t_attn_bwd = bw->t_other_bwd = 0;
    double t0 = omp_get_wtime();
    /* with the cross-entropy, the loss (and io->nll) come from the backward's
     * own LM-head pass (the last stage's): the forward skips its LM head */
    kvq_fwd_io fio = *io;
    fio.skip_loss = spec->xent && !io->logits;
    KVQ_TRY(kvq_forward_stage(&bw->fw, &fio, l0, l1, x_in, &bw->st_fr, err));
    bw->t_forward = omp_get_wtime() - t0;
    res->loss = bw->st_fr.loss;
    res->n_scored = bw->st_fr.n_scored;
    if (spec->xent && bw->st_fr.n_scored == 0)
        return kvq_fail(err, KVQ_EINVAL, "backward: cross-entropy requested but no position of the %d-token window is scored", io->T);
    bw->st_skip = fio.skip_loss;
    bw->st_l0 = l0;
    bw->st_l1 = l1;
    return KVQ_OK;
}

kvq_status kvq_backward_stage_backward(kvq_backward *bw, const kvq_fwd_io *io, const kvq_bwd_spec *spec, int l0, int l1,
                                       const float *dx_in, kvq_bwd_result *res, kvq_err *err)
{
    const kvq_model *m = bw->m;
    const kvq_hparams *hp = &m->hp;
    if (bw->st_l0 != l0 || bw->st_l1 != l1 || bw->fw.T_last != io->T)
        return kvq_fail(err, KVQ_EINVAL, "backward: stage of layers %d..%d without its forward (kvq_backward_stage_forward)", l0,
                        l1 - 1);
    if (l1 < hp->n_layers && !dx_in)
        return kvq_fail(err, KVQ_EINVAL, "backward: a stage ending before the last layer needs dL/dx of its output");
    bw->st_l0 = bw->st_l1 = -1; /* one backward per forward */
    const kvq_fwd_result fr = bw->st_fr;
    const int T = io->T, dim = hp->dim;
    kvq_rope_table(hp, io->pos0, T, bw->rope_cos, bw->rope_sin);

    double t0 = omp_get_wtime();
    if (l1 < hp->n_layers) {
        if (dx_in != bw->dx) memcpy(bw->dx, dx_in, (size_t)T * dim * sizeof(float));
    } else if (spec->xent) {
        const float *x_last = kvq_forward_layer_input(&bw->fw, hp->n_layers);
        const int *tg = io->targets;
        if (!tg) {
            for (int t = 0; t < T; t++) bw->targets[t] = t + 1 < T ? io->tokens[t + 1] : -1;
            tg = bw->targets;
        }
        kvq_rmsnorm(bw->xn, x_last, m->out_norm, T, dim, hp->norm_eps);
        double sum = kvq_lm_head_xent_bwd(bw->dxn, bw->nll, bw->xn, &m->output, bw->head_buf, tg, T, dim, hp->vocab_size, 1.0 / fr.n_scored,
                                          bw->v_chunk, bw->zbuf, bw->rmax, bw->rsum, bw->rtgt);
        res->xent_loss = sum / fr.n_scored;
        if (bw->st_skip) {
            res->loss = res->xent_loss;
            if (io->nll) memcpy(io->nll, bw->nll, (size_t)T * sizeof(double));
            for (int t = 0; t < T; t++)
                if (tg[t] >= 0 && !isfinite(bw->nll[t]))
                    return kvq_fail(err, KVQ_ENUMERIC, "backward: non-finite logits/NLL at window index %d (position %d)", t,
                                    io->pos0 + t);
        }
        kvq_rmsnorm_bwd(bw->dx, bw->dxn, x_last, m->out_norm, T, dim, hp->norm_eps, 0);
    } else {
        memset(bw->dx, 0, (size_t)T * dim * sizeof(float));
    }
    bw->t_head = omp_get_wtime() - t0;
    const int P = io->prefix ? io->prefix->P : 0;
    for (int l = l1 - 1; l >= l0; l--) {
        if (spec->upstream) {
            kvq_layer_ctx ctx = {.layer = l, .T = T, .pos0 = io->pos0, .P = P, .n_heads = hp->n_heads,
                                 .n_kv_heads = hp->n_kv_heads, .head_dim = hp->head_dim, .tokens = io->tokens,
                                 .n_layers = hp->n_layers};
            kvq_status s = spec->upstream(spec->user, &ctx, kvq_forward_layer_input(&bw->fw, l + 1), bw->dx, err);
            if (s) return kvq_err_prefix(err, "backward: layer %d: upstream callback", l);
        }
        KVQ_TRY(layer_backward(bw, io, spec, l, kvq_forward_layer_input(&bw->fw, l), err));
    }
    if (l0 == 0 && spec->d_embd) memcpy(spec->d_embd, bw->dx, (size_t)T * dim * sizeof(float));
    return KVQ_OK;
}

kvq_status kvq_grad_store_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    (void)err;
    kvq_grad_store *st = user;
    size_t row = (size_t)g->n_kv_heads * g->head_dim, n = (size_t)g->T * row, np = (size_t)g->P * row;
    if (st->dk_pre) memcpy(st->dk_pre + g->layer * n, g->dk_pre, n * sizeof(float));
    if (st->dk_post) memcpy(st->dk_post + g->layer * n, g->dk_post, n * sizeof(float));
    if (st->dv) memcpy(st->dv + g->layer * n, g->dv, n * sizeof(float));
    if (np && st->dpk) memcpy(st->dpk + g->layer * np, g->dpk, np * sizeof(float));
    if (np && st->dpv) memcpy(st->dpv + g->layer * np, g->dpv, np * sizeof(float));
    return KVQ_OK;
}

kvq_status kvq_backward_xent(kvq_backward *bw, const kvq_fwd_io *io, kvq_grad_store *store, kvq_bwd_result *res, kvq_err *err)
{
    kvq_bwd_spec spec = {.user = store, .xent = true, .grads = kvq_grad_store_cb};
    return kvq_backward_run(bw, io, &spec, res, err);
}
