/* forward.c — batched Llama forward with hooks; see forward.h. */
#include "forward.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

kvq_status kvq_forward_init(kvq_forward *fw, const kvq_model *m, int max_T, int max_P, unsigned flags, kvq_err *err)
{
    memset(fw, 0, sizeof *fw);
    const kvq_hparams *hp = &m->hp;
    if (max_T <= 0 || max_P < 0 || max_T > (1 << 24) || max_P > (1 << 24))
        return kvq_fail(err, KVQ_EINVAL, "forward: max_T %d / max_P %d out of range (1..2^24 / 0..2^24)", max_T, max_P);
    fw->m = m;
    fw->max_T = max_T;
    fw->max_P = max_P;
    if (flags & KVQ_FWD_SAVE_ACTIVATIONS) flags |= KVQ_FWD_SAVE_LAYER_INPUTS;
    fw->flags = flags;
    fw->n_threads = omp_get_max_threads();
    if (fw->n_threads < 1) fw->n_threads = 1;

    /* loss-only LM head: blocks of the vocabulary, about 4M logits per block */
    fw->v_chunk = (int)((size_t)(1 << 22) / (size_t)max_T);
    if (fw->v_chunk > 8192) fw->v_chunk = 8192;
    if (fw->v_chunk < 256) fw->v_chunk = 256;
    if (fw->v_chunk > hp->vocab_size) fw->v_chunk = hp->vocab_size;
    fw->v_chunk_max = fw->v_chunk;
    size_t T = max_T, dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    size_t half = hp->rope_dim / 2, nh = hp->n_heads, L = hp->n_layers, PT = (size_t)max_P + max_T;
    size_t acts = 0;
    if (flags & KVQ_FWD_SAVE_ACTIVATIONS) {
        fw->act_stride = T * (2 * qd + 4 * kvd + dim + 2 * hid + nh);
        if (kvq_mul_size(fw->act_stride, L, &acts))
            return kvq_fail(err, KVQ_ENOMEM, "forward: activation store size overflows (max_T %d)", max_T);
    }
    /* sizes in floats, in allocation order */
    fw->wscratch_floats = kvq_model_wscratch_floats(m);
    size_t sz[] = {T * dim, T * dim, T * qd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd, T * kvd,
                   T * qd, T * hid, T * hid, T * (size_t)fw->v_chunk_max, T, T, T * half, T * half, nh * PT, nh * T,
                   (flags & KVQ_FWD_SAVE_LAYER_INPUTS) ? (L + 1) * T * dim : 0, acts, fw->wscratch_floats};
    float **dst[] = {&fw->x, &fw->xn, &fw->q, &fw->k_pre, &fw->k_post, &fw->v, &fw->k_att, &fw->v_att, &fw->k_alt, &fw->v_alt,
                     &fw->att, &fw->gate, &fw->up, &fw->logit_blk, &fw->row_max, &fw->row_tgt, &fw->rope_cos, &fw->rope_sin, &fw->mass, &fw->entropy,
                     &fw->saved, &fw->acts, &fw->wscratch};
    size_t n = sizeof sz / sizeof *sz, total = 0;
    for (size_t i = 0; i < n; i++)
        if (kvq_add_size(total, sz[i], &total))
            return kvq_fail(err, KVQ_ENOMEM, "forward: workspace size overflows (max_T %d)", max_T);
    if (total > ((size_t)1 << 37))
        return kvq_fail(err, KVQ_ENOMEM, "forward: workspace of %zu floats for max_T %d is too large", total, max_T);
    fw->arena = malloc(total * sizeof(float));
    fw->iarena = malloc(3 * T * sizeof(int));
    fw->row_sum = malloc(T * sizeof(double));
    if (acts) {
        fw->act_bounds = malloc(L * 2 * T * sizeof(int));
        fw->act_alt = calloc(L, 1);
    }
    if (!fw->arena || !fw->iarena || !fw->row_sum || (acts && (!fw->act_bounds || !fw->act_alt))) {
        kvq_forward_free(fw);
        return kvq_fail(err, KVQ_ENOMEM, "forward: cannot allocate %.1f MiB of activations for max_T %d", total * 4.0 / (1 << 20), max_T);
    }
    float *p = fw->arena;
    for (size_t i = 0; i < n; i++) {
        *dst[i] = sz[i] ? p : NULL;
        p += sz[i];
    }
    fw->k_bound = fw->iarena;
    fw->v_bound = fw->iarena + T;
    fw->def_targets = fw->iarena + 2 * T;
    kvq_status s = kvq_attn_ws_init(&fw->attn, max_T, max_P, hp->n_kv_heads, hp->head_dim, fw->n_threads, err);
    if (s) kvq_forward_free(fw);
    return s;
}

void kvq_forward_free(kvq_forward *fw)
{
    free(fw->arena);
    free(fw->iarena);
    free(fw->row_sum);
    free(fw->act_bounds);
    free(fw->act_alt);
    kvq_attn_ws_free(&fw->attn);
    memset(fw, 0, sizeof *fw);
}

const float *kvq_forward_layer_input(const kvq_forward *fw, int l)
{
    if (!fw->saved || l < 0 || l > fw->m->hp.n_layers) return NULL;
    return fw->saved + (size_t)l * fw->max_T * fw->m->hp.dim;
}

/* Per-layer activation slot: q, k, v, kq, vq, att, x_mid, gate, up, lse (max_T strides). */
static float *act_slot(const kvq_forward *fw, int l, int which)
{
    const kvq_hparams *hp = &fw->m->hp;
    size_t T = fw->max_T, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), dim = hp->dim, hid = hp->hidden_dim;
    size_t sz[] = {T * qd, T * kvd, T * kvd, T * kvd, T * kvd, T * qd, T * dim, T * hid, T * hid};
    float *p = fw->acts + (size_t)l * fw->act_stride;
    for (int i = 0; i < which; i++) p += sz[i];
    return p;
}
enum { ACT_Q, ACT_K, ACT_V, ACT_KQ, ACT_VQ, ACT_ATT, ACT_XMID, ACT_GATE, ACT_UP, ACT_LSE };

bool kvq_forward_layer_acts(const kvq_forward *fw, int l, kvq_fwd_layer_acts *out)
{
    if (!fw->acts || fw->T_last <= 0 || l < 0 || l >= fw->m->hp.n_layers) return false;
    int *kb = fw->act_bounds + (size_t)l * 2 * fw->max_T;
    unsigned alt = fw->act_alt[l];
    *out = (kvq_fwd_layer_acts){.q = act_slot(fw, l, ACT_Q), .k = act_slot(fw, l, ACT_K), .v = act_slot(fw, l, ACT_V),
                                .kq = (alt & 1) ? act_slot(fw, l, ACT_KQ) : NULL, .vq = (alt & 2) ? act_slot(fw, l, ACT_VQ) : NULL,
                                .kb = (alt & 1) ? kb : NULL, .vb = (alt & 2) ? kb + fw->max_T : NULL,
                                .att = act_slot(fw, l, ACT_ATT), .lse = act_slot(fw, l, ACT_LSE), .x_mid = act_slot(fw, l, ACT_XMID),
                                .gate = act_slot(fw, l, ACT_GATE), .up = act_slot(fw, l, ACT_UP)};
    return true;
}

double kvq_forward_flops(const kvq_hparams *hp, int T, int P)
{
    double dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp), hid = hp->hidden_dim;
    double per_layer = dim * qd * 2 + dim * kvd * 2 + 3 * dim * hid;
    double params = per_layer * hp->n_layers + (double)hp->vocab_size * dim;
    double keys = (double)T * P + (double)T * (T + 1) / 2; /* sum_i (P + i + 1) */
    return 2 * params * T + 4.0 * hp->n_heads * hp->head_dim * keys * hp->n_layers;
}

/* A transform that gave a per-key schedule (forward.h, kvq_kv_sched): RoPE the
 * pre-RoPE key representations (each distinct buffer once), attend row by row
 * (kvq_attention_sched), observe. No backward pass: a workspace that keeps
 * activations refuses it. */
static kvq_status sched_attention(kvq_forward *fw, const kvq_fwd_io *io, int l, const kvq_layer_ctx *ctx, kvq_attn_args *a,
                                  kvq_kv_sched *sc, bool pre, kvq_err *err)
{
    const kvq_hparams *hp = &fw->m->hp;
    const int T = io->T, nkv = hp->n_kv_heads, hd = hp->head_dim;
    const kvq_hooks *hk = io->hooks;
    if (fw->acts)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "layer %d: a scheme with a per-key schedule of representations has no backward "
                        "pass (its decisions are not differentiable); use it for evaluation only", l);
    if (pre)
        for (int r = 0; r < sc->n_k && r < KVQ_KV_MAX_REPS; r++) {
            bool seen = false;
            for (int r2 = 0; r2 < r; r2++) seen |= sc->k[r2] == sc->k[r];
            if (!seen && sc->k[r]) kvq_rope_apply(sc->k[r], T, nkv, hd, hp->rope_dim, fw->rope_cos, fw->rope_sin, 0);
        }
    a->k = a->v = NULL;
    bool stats = hk->observe && hk->attn_stats;
    if (stats) {
        a->mass = fw->mass;
        a->entropy = fw->entropy;
    }
    kvq_status s = kvq_attention_sched(a, sc, l, fw->n_threads, err);
    if (s) return kvq_err_prefix(err, "layer %d", l);
    if (hk->observe) {
        kvq_layer_obs obs = {.q = fw->q, .k_pre = fw->k_pre, .k_post = fw->k_post, .v = fw->v, .k_att = sc->k[0],
                             .v_att = sc->v[0], .sched = sc, .attn_mass = stats ? fw->mass : NULL,
                             .attn_entropy = stats ? fw->entropy : NULL};
        s = hk->observe(hk->user, ctx, &obs, err);
        if (s) return kvq_err_prefix(err, "layer %d: observe hook", l);
    }
    return KVQ_OK;
}

/* Transform + attention + observe for one layer; q, k_pre, v are filled. */
static kvq_status layer_attention(kvq_forward *fw, const kvq_fwd_io *io, int l, kvq_err *err)
{
    const kvq_hparams *hp = &fw->m->hp;
    const int T = io->T, kvd = kvq_kv_dim(hp), nkv = hp->n_kv_heads, hd = hp->head_dim;
    const kvq_hooks *hk = io->hooks;
    const kvq_prefix *px = io->prefix;
    const int P = px ? px->P : 0;
    size_t kvn = (size_t)T * kvd;
    kvq_layer_ctx ctx = {.layer = l, .T = T, .pos0 = io->pos0, .P = P, .n_heads = hp->n_heads,
                         .n_kv_heads = nkv, .head_dim = hd, .tokens = io->tokens, .n_layers = hp->n_layers};

    memcpy(fw->k_post, fw->k_pre, kvn * sizeof(float));
    kvq_rope_apply(fw->q, T, hp->n_heads, hd, hp->rope_dim, fw->rope_cos, fw->rope_sin, 0);
    kvq_rope_apply(fw->k_post, T, nkv, hd, hp->rope_dim, fw->rope_cos, fw->rope_sin, 0);
    if (hk && hk->attend) { /* an external cache: it stores the new K/V and attends (forward.h kvq_hooks.attend) */
        kvq_status s = hk->attend(hk->user, &ctx, fw->q, fw->k_pre, fw->k_post, fw->v, fw->att, err);
        return s ? kvq_err_prefix(err, "layer %d: attend hook", l) : KVQ_OK;
    }

    kvq_attn_args a = {.T = T, .P = P, .n_heads = hp->n_heads, .n_kv_heads = nkv, .head_dim = hd,
                       .q = fw->q, .k = fw->k_post, .v = fw->v, .out = fw->att,
                       .window = kvq_layer_window(hp, l), .pos0 = io->pos0};
    if (P > 0) {
        size_t off = (size_t)l * P * kvd;
        a.pk = px->k + off;
        a.pv = px->v + off;
    }
    if (hk && hk->transform) {
        bool pre = hk->key_stage == KVQ_KEYS_PRE_ROPE;
        memcpy(fw->k_att, pre ? fw->k_pre : fw->k_post, kvn * sizeof(float));
        memcpy(fw->v_att, fw->v, kvn * sizeof(float));
        kvq_kv_alt alt = {.k = fw->k_alt, .k_bound = fw->k_bound, .v = fw->v_alt, .v_bound = fw->v_bound};
        kvq_status s = hk->transform(hk->user, &ctx, fw->k_att, fw->v_att, &alt, err);
        if (s) return kvq_err_prefix(err, "layer %d: KV transform", l);
        if (alt.sched) return sched_attention(fw, io, l, &ctx, &a, alt.sched, pre, err);
        if (pre) kvq_rope_apply(fw->k_att, T, nkv, hd, hp->rope_dim, fw->rope_cos, fw->rope_sin, 0);
        if (alt.use_k) {
            if (pre) kvq_rope_apply(fw->k_alt, T, nkv, hd, hp->rope_dim, fw->rope_cos, fw->rope_sin, 0);
            a.kq = fw->k_alt;
            a.kb = fw->k_bound;
        }
        if (alt.use_v) {
            a.vq = fw->v_alt;
            a.vb = fw->v_bound;
        }
        a.k = fw->k_att;
        a.v = fw->v_att;
    }
    if (fw->acts) a.lse = act_slot(fw, l, ACT_LSE);
    bool stats = hk && hk->observe && hk->attn_stats;
    if (stats) {
        a.mass = fw->mass;
        a.entropy = fw->entropy;
    }
    kvq_status s = kvq_attention(&a, &fw->attn, err);
    if (s) return kvq_err_prefix(err, "layer %d", l);
    if (fw->acts) {
        size_t qn = (size_t)T * kvq_q_dim(hp);
        int *kb = fw->act_bounds + (size_t)l * 2 * fw->max_T;
        memcpy(act_slot(fw, l, ACT_Q), a.q, qn * sizeof(float));
        memcpy(act_slot(fw, l, ACT_K), a.k, kvn * sizeof(float));
        memcpy(act_slot(fw, l, ACT_V), a.v, kvn * sizeof(float));
        memcpy(act_slot(fw, l, ACT_ATT), a.out, qn * sizeof(float));
        fw->act_alt[l] = (unsigned char)((a.kq ? 1 : 0) | (a.vq ? 2 : 0));
        if (a.kq) {
            memcpy(act_slot(fw, l, ACT_KQ), a.kq, kvn * sizeof(float));
            memcpy(kb, a.kb, (size_t)T * sizeof(int));
        }
        if (a.vq) {
            memcpy(act_slot(fw, l, ACT_VQ), a.vq, kvn * sizeof(float));
            memcpy(kb + fw->max_T, a.vb, (size_t)T * sizeof(int));
        }
    }
    if (hk && hk->observe) {
        kvq_layer_obs obs = {.q = fw->q, .k_pre = fw->k_pre, .k_post = fw->k_post, .v = fw->v, .k_att = a.k, .v_att = a.v,
                             .k_alt = a.kq, .v_alt = a.vq, .k_bound = a.kb, .v_bound = a.vb,
                             .attn_mass = stats ? fw->mass : NULL, .attn_entropy = stats ? fw->entropy : NULL};
        s = hk->observe(hk->user, &ctx, &obs, err);
        if (s) return kvq_err_prefix(err, "layer %d: observe hook", l);
    }
    return KVQ_OK;
}

/* y = x W^T for T rows: one GEMM, or one per row under KVQ_FWD_ROW_INVARIANT
 * (in, out: the matrix's cols, rows, kept at the call sites for reading) */
static void linear(const kvq_forward *fw, float *y, const float *x, const kvq_mat *w, int T, int in, int out, float beta)
{
    (void)in, (void)out;
    kvq_linear_mat(y, x, w, T, beta, fw->wscratch, fw->wscratch_floats, (fw->flags & KVQ_FWD_ROW_INVARIANT) != 0);
}

/* q, k_pre, v of layer w from fw->xn: projections, biases, per-head q/k norms (ops.h kvq_qkv_finish) */
static void qkv_project(kvq_forward *fw, const kvq_layer_weights *w, int T)
{
    const kvq_hparams *hp = &fw->m->hp;
    const int dim = hp->dim, qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp);
    linear(fw, fw->q, fw->xn, &w->wq, T, dim, qd, 0);
    linear(fw, fw->k_pre, fw->xn, &w->wk, T, dim, kvd, 0);
    linear(fw, fw->v, fw->xn, &w->wv, T, dim, kvd, 0);
    kvq_qkv_finish(hp, w, fw->q, fw->k_pre, fw->v, T);
}

kvq_status kvq_fwd_check_pos(const kvq_fwd_io *io, int T, bool attend, kvq_err *err)
{
    if (!io->pos) return KVQ_OK;
    if (!attend)
        return kvq_fail(err, KVQ_EINVAL, "forward: per-row positions need an attend hook (rows of independent sequences)");
    for (int t = 0; t < T; t++)
        if (io->pos[t] < 0 || io->pos[t] == INT32_MAX)
            return kvq_fail(err, KVQ_EINVAL, "forward: position %d of row %d out of range", io->pos[t], t);
    return KVQ_OK;
}

kvq_status kvq_forward_run(kvq_forward *fw, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    return kvq_forward_stage(fw, io, 0, fw->m->hp.n_layers, NULL, res, err);
}

kvq_status kvq_forward_stage(kvq_forward *fw, const kvq_fwd_io *io, int l0, int l1, const float *x_in, kvq_fwd_result *res,
                             kvq_err *err)
{
    const kvq_model *m = fw->m;
    const kvq_hparams *hp = &m->hp;
    const int T = io->T, dim = hp->dim, qd = kvq_q_dim(hp), hid = hp->hidden_dim, V = hp->vocab_size;
    res->loss = NAN;
    res->n_scored = 0;
    if (l0 < 0 || l1 <= l0 || l1 > hp->n_layers)
        return kvq_fail(err, KVQ_EINVAL, "forward: stage of layers %d..%d, expected 0 <= first < last <= %d", l0, l1 - 1,
                        hp->n_layers - 1);
    if (l0 > 0 && !x_in)
        return kvq_fail(err, KVQ_EINVAL, "forward: a stage starting at layer %d needs the residual stream entering it", l0);
    if (T <= 0 || T > fw->max_T)
        return kvq_fail(err, KVQ_EINVAL, "forward: window of %d tokens, expected 1..%d (max_T of the workspace)", T, fw->max_T);
    int P = io->prefix ? io->prefix->P : 0;
    if (P < 0 || P > fw->max_P || (P > 0 && (!io->prefix->k || !io->prefix->v)))
        return kvq_fail(err, KVQ_EINVAL, "forward: prefix of %d entries, expected 0..%d with K and V", P, fw->max_P);
    if (io->pos0 < 0 || io->pos0 > INT32_MAX - T)
        return kvq_fail(err, KVQ_EINVAL, "forward: pos0 %d out of range", io->pos0);
    for (int t = 0; t < T; t++)
        if (io->tokens[t] < 0 || io->tokens[t] >= V)
            return kvq_fail(err, KVQ_EINVAL, "forward: token %d at window index %d outside the vocabulary [0, %d)", io->tokens[t], t, V);
    const int *tg = io->targets;
    if (!tg) {
        for (int t = 0; t < T; t++) fw->def_targets[t] = t + 1 < T ? io->tokens[t + 1] : -1;
        tg = fw->def_targets;
    }
    for (int t = 0; t < T; t++)
        if (tg[t] >= V) return kvq_fail(err, KVQ_EINVAL, "forward: target %d at window index %d outside the vocabulary [0, %d)", tg[t], t, V);

    const bool attend = io->hooks && io->hooks->attend;
    if (attend && (io->hooks->transform || io->hooks->observe || P > 0 || fw->acts))
        return kvq_fail(err, KVQ_EINVAL, "forward: an attend hook (external cache) runs without a transform, observe hook, "
                        "prefix or activation store");
    KVQ_TRY(kvq_fwd_check_pos(io, T, attend, err));

    fw->T_last = 0; /* saved checkpoints/activations are invalid until this run has passed every layer */
    if (io->pos) {
        const size_t half = (size_t)hp->rope_dim / 2;
        for (int t = 0; t < T; t++) kvq_rope_table(hp, io->pos[t], 1, fw->rope_cos + t * half, fw->rope_sin + t * half);
    } else {
        kvq_rope_table(hp, io->pos0, T, fw->rope_cos, fw->rope_sin);
    }
    if (l0 == 0)
        for (int t = 0; t < T; t++) kvq_mat_rows(&m->tok_embd, io->tokens[t], 1, fw->x + (size_t)t * dim);
    else if (x_in != fw->x)
        memcpy(fw->x, x_in, (size_t)T * dim * sizeof(float));

    for (int l = l0; l < l1; l++) {
        const kvq_layer_weights *w = &m->layers[l];
        if (fw->saved) memcpy(fw->saved + (size_t)l * fw->max_T * dim, fw->x, (size_t)T * dim * sizeof(float));
        kvq_rmsnorm(fw->xn, fw->x, w->attn_norm, T, dim, hp->norm_eps);
        qkv_project(fw, w, T);
        KVQ_TRY(layer_attention(fw, io, l, err));
        linear(fw, fw->x, fw->att, &w->wo, T, qd, dim, 1.0f);
        if (w->bo) kvq_add_bias(fw->x, w->bo, T, dim);
        kvq_rmsnorm(fw->xn, fw->x, w->ffn_norm, T, dim, hp->norm_eps);
        linear(fw, fw->gate, fw->xn, &w->w_gate, T, dim, hid, 0);
        linear(fw, fw->up, fw->xn, &w->w_up, T, dim, hid, 0);
        if (fw->acts) {
            memcpy(act_slot(fw, l, ACT_XMID), fw->x, (size_t)T * dim * sizeof(float));
            memcpy(act_slot(fw, l, ACT_GATE), fw->gate, (size_t)T * hid * sizeof(float));
            memcpy(act_slot(fw, l, ACT_UP), fw->up, (size_t)T * hid * sizeof(float));
        }
        kvq_swiglu(fw->gate, fw->gate, fw->up, (size_t)T * hid);
        linear(fw, fw->x, fw->gate, &w->w_down, T, hid, dim, 1.0f);
    }
    if (fw->saved) memcpy(fw->saved + (size_t)l1 * fw->max_T * dim, fw->x, (size_t)T * dim * sizeof(float));
    fw->T_last = T;
    int n_tg = 0;
    for (int t = 0; t < T; t++) n_tg += tg[t] >= 0;
    if (l1 < hp->n_layers) { /* not the last stage: fw->x is handed on, the LM head is the last stage's */
        res->n_scored = n_tg;
        return KVQ_OK;
    }
    if (!io->logits && (io->skip_loss || n_tg == 0)) {
        /* no LM head: the caller computes the loss itself, or no row is scored */
        res->n_scored = n_tg;
        if (io->nll && !io->skip_loss)
            for (int t = 0; t < T; t++) io->nll[t] = NAN;
        return KVQ_OK;
    }
    kvq_rmsnorm(fw->xn, fw->x, m->out_norm, T, dim, hp->norm_eps);
    kvq_fwd_head *hd = io->head;
    if (hd && hd->hidden) memcpy(hd->hidden, fw->xn, (size_t)T * dim * sizeof(float));

    /* LM head and NLL (log-sum-exp in double) */
    double *nll = fw->row_sum; /* reused as the per-row NLL once the sums are done */
    if (io->logits) {
        linear(fw, io->logits, fw->xn, &m->output, T, dim, V, 0);
#pragma omp parallel for schedule(static) num_threads(fw->n_threads)
        for (int t = 0; t < T; t++) nll[t] = tg[t] >= 0 ? kvq_token_nll(io->logits + (size_t)t * V, V, tg[t]) : NAN;
        if (hd) KVQ_TRY(kvq_fwd_head_from_logits(m, io->logits, NULL, tg, T, hd, err));
    } else {
        const int vc = fw->v_chunk > 0 && fw->v_chunk <= fw->v_chunk_max ? fw->v_chunk : fw->v_chunk_max;
        int *am = hd ? hd->argmax : NULL;
        float *ex = hd ? hd->expect : NULL;
        int r0 = T, r1 = -1; /* span of the scored rows: the expectation GEMM runs over it */
        for (int t = 0; t < T; t++) {
            fw->row_max[t] = -INFINITY;
            fw->row_sum[t] = 0;
            fw->row_tgt[t] = NAN;
            if (am) am[t] = -1;
            if (tg[t] >= 0) {
                r0 = t < r0 ? t : r0;
                r1 = t;
            }
        }
        if (ex)
            for (int t = r0; t <= r1; t++)
                if (tg[t] >= 0) memset(ex + (size_t)t * dim, 0, (size_t)dim * sizeof(float));
        for (int v0 = 0; v0 < V; v0 += vc) {
            int nv = V - v0 < vc ? V - v0 : vc;
            /* the logits of the scored rows' span only (llamacpp scores half the window, passkey a few rows) */
            kvq_mat blk = kvq_mat_slice(&m->output, v0, nv);
            linear(fw, fw->logit_blk + (size_t)r0 * nv, fw->xn + (size_t)r0 * dim, &blk, r1 - r0 + 1, dim, nv, 0);
#pragma omp parallel for schedule(static) num_threads(fw->n_threads)
            for (int t = r0; t <= r1; t++) {
                float *z = fw->logit_blk + (size_t)t * nv;
                if (tg[t] < 0) {
                    if (ex && t > r0 && t < r1) memset(z, 0, (size_t)nv * sizeof(float)); /* adds nothing to e */
                    continue;
                }
                const float old = fw->row_max[t];
                float bmax = -INFINITY;
                int bi = -1;
                if (am) {
                    for (int i = 0; i < nv; i++)
                        if (z[i] > bmax) {
                            bmax = z[i];
                            bi = i;
                        }
                } else {
                    for (int i = 0; i < nv; i++) bmax = z[i] > bmax ? z[i] : bmax;
                }
                const float mx = bmax > old ? bmax : old;
                if (am && bi >= 0 && (bmax > old || am[t] < 0)) am[t] = v0 + bi; /* first index of the largest */
                if (tg[t] >= v0 && tg[t] < v0 + nv) fw->row_tgt[t] = z[tg[t] - v0];
                double sum = fw->row_sum[t] * exp((double)old - mx); /* first block: 0 * exp(-inf) = 0 */
                if (ex) { /* rescale the running expectation, and turn the block into exp(z - max) for its GEMM */
                    const float f = (float)exp((double)old - mx);
                    float *er = ex + (size_t)t * dim;
                    for (int d = 0; d < dim; d++) er[d] *= f;
                    for (int i = 0; i < nv; i++) {
                        const double q = exp((double)z[i] - mx);
                        sum += q;
                        z[i] = (float)q;
                    }
                } else {
                    for (int i = 0; i < nv; i++) sum += exp((double)z[i] - mx);
                }
                fw->row_max[t] = mx;
                fw->row_sum[t] = sum;
            }
            if (ex && r1 >= r0) { /* e[r0..r1] += exp(z - max)[r0..r1][nv] Wout[v0..v0+nv) */
                const float *wf = kvq_mat_f32(&blk);
                /* a matrix not held in fp32: its rows converted in blocks through the weight scratch */
                const int sb = wf ? nv : (int)(fw->wscratch_floats / (size_t)dim);
                for (int s0 = 0; s0 < nv; s0 += sb) {
                    const int ns = nv - s0 < sb ? nv - s0 : sb;
                    if (!wf) kvq_mat_block(&blk, s0, ns, fw->wscratch);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0 + 1, dim, ns, 1.0f,
                                fw->logit_blk + (size_t)r0 * nv + s0, nv, wf ? wf + (size_t)s0 * dim : fw->wscratch, dim, 1.0f,
                                ex + (size_t)r0 * dim, dim);
                }
            }
        }
        for (int t = 0; t < T; t++) { /* (nll aliases row_sum: the head outputs first) */
            if (hd && hd->lse) hd->lse[t] = tg[t] >= 0 ? (double)fw->row_max[t] + log(fw->row_sum[t]) : NAN;
            if (ex && tg[t] >= 0) {
                float *er = ex + (size_t)t * dim;
                for (int d = 0; d < dim; d++) er[d] = (float)((double)er[d] / fw->row_sum[t]);
            }
            nll[t] = tg[t] >= 0 ? (double)fw->row_max[t] + log(fw->row_sum[t]) - (double)fw->row_tgt[t] : NAN;
        }
    }
    double total = 0;
    int n_scored = 0, bad = -1;
    for (int t = 0; t < T; t++) {
        if (io->nll) io->nll[t] = nll[t];
        if (tg[t] < 0) continue;
        if (!isfinite(nll[t]) && bad < 0) bad = t;
        total += nll[t];
        n_scored++;
    }
    res->n_scored = n_scored;
    res->loss = n_scored ? total / n_scored : NAN;
    if (bad >= 0)
        return kvq_fail(err, KVQ_ENUMERIC, "forward: non-finite logits/NLL at window index %d (position %d)", bad, io->pos0 + bad);
    return KVQ_OK;
}

kvq_status kvq_fwd_head_from_logits(const kvq_model *m, const float *logits, const float *xn, const int *targets, int T,
                                    kvq_fwd_head *head, kvq_err *err)
{
    const int V = m->hp.vocab_size, dim = m->hp.dim;
    if (head->hidden && xn) memcpy(head->hidden, xn, (size_t)T * dim * sizeof(float));
    float *p = head->expect ? malloc((size_t)V * sizeof(float)) : NULL;
    const int wrows = (int)(KVQ_WBLOCK_FLOATS / (size_t)dim) < V ? (int)(KVQ_WBLOCK_FLOATS / (size_t)dim) : V;
    float *wblk = head->expect && !kvq_mat_f32(&m->output) ? malloc((size_t)wrows * dim * sizeof(float)) : NULL;
    if (head->expect && (!p || (!kvq_mat_f32(&m->output) && !wblk))) {
        free(p);
        free(wblk);
        return kvq_fail(err, KVQ_ENOMEM, "forward: out of memory for the LM-head expectation");
    }
    for (int t = 0; t < T; t++) {
        const bool scored = targets ? targets[t] >= 0 : t + 1 < T;
        if (!scored) {
            if (head->lse) head->lse[t] = NAN;
            if (head->argmax) head->argmax[t] = -1;
            continue;
        }
        const float *z = logits + (size_t)t * V;
        float mx = -INFINITY;
        int am = -1;
        for (int v = 0; v < V; v++)
            if (z[v] > mx) {
                mx = z[v];
                am = v;
            }
        double sum = 0;
        for (int v = 0; v < V; v++) sum += exp((double)z[v] - mx);
        const double lse = (double)mx + log(sum);
        if (head->lse) head->lse[t] = lse;
        if (head->argmax) head->argmax[t] = am;
        if (p) {
            for (int v = 0; v < V; v++) p[v] = (float)exp((double)z[v] - lse);
            float *e = head->expect + (size_t)t * dim;
            const float *wf = kvq_mat_f32(&m->output);
            if (wf) {
                cblas_sgemv(CblasRowMajor, CblasTrans, V, dim, 1.0f, wf, dim, p, 1, 0.0f, e, 1);
            } else { /* a matrix not held in fp32: its rows converted in blocks */
                for (int v0 = 0; v0 < V; v0 += wrows) {
                    const int nv = V - v0 < wrows ? V - v0 : wrows;
                    kvq_mat_block(&m->output, v0, nv, wblk);
                    cblas_sgemv(CblasRowMajor, CblasTrans, nv, dim, 1.0f, wblk, dim, p + v0, 1, v0 ? 1.0f : 0.0f, e, 1);
                }
            }
        }
    }
    free(p);
    free(wblk);
    return KVQ_OK;
}
