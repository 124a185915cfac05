/* ops.c — forward building blocks; see ops.h. */
#include "ops.h"

#include <cblas.h>
#include <math.h>

#include "simd.h"

void kvq_linear(float *y, const float *x, const float *w, int T, int in, int out, float beta)
{
    if (T <= 0 || out <= 0) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, out, in, 1.0f, x, in, w, in, beta, y, out);
}

void kvq_mat_block(const kvq_mat *w, int r0, int n, float *dst)
{
    if (n <= 0) return;
    const int per = n < 64 ? n : 16; /* rows per task */
    const int tasks = (n + per - 1) / per;
#pragma omp parallel for schedule(static) if (tasks > 1)
    for (int k = 0; k < tasks; k++) {
        int a = k * per, b = a + per < n ? a + per : n;
        kvq_mat_rows(w, r0 + a, b - a, dst + (size_t)a * w->cols);
    }
}

size_t kvq_model_wscratch_floats(const kvq_model *m)
{
    size_t best = 0;
    const kvq_mat *all[2] = {&m->tok_embd, &m->output};
    for (int i = 0; i < 2; i++) {
        const kvq_mat *w = all[i];
        if (w->type == KVQ_MAT_F32) continue;
        size_t nb = KVQ_WBLOCK_FLOATS / (size_t)w->cols;
        if (nb < 1) nb = 1;
        if (nb > (size_t)w->rows) nb = (size_t)w->rows;
        if (nb * w->cols > best) best = nb * w->cols;
    }
    for (int l = 0; l < m->hp.n_layers; l++) {
        const kvq_layer_weights *lw = &m->layers[l];
        const kvq_mat *ws[7] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down};
        for (int i = 0; i < 7; i++) {
            const kvq_mat *w = ws[i];
            if (w->type == KVQ_MAT_F32) continue;
            size_t nb = KVQ_WBLOCK_FLOATS / (size_t)w->cols;
            if (nb < 1) nb = 1;
            if (nb > (size_t)w->rows) nb = (size_t)w->rows;
            if (nb * w->cols > best) best = nb * w->cols;
        }
    }
    return best;
}

void kvq_linear_mat(float *y, const float *x, const kvq_mat *w, int T, float beta, float *scratch, size_t scratch_floats,
                    int row_invariant)
{
    const int in = w->cols, out = w->rows;
    if (T <= 0 || out <= 0) return;
    const float *wf = kvq_mat_f32(w);
    int nb = wf ? out : (int)(scratch_floats / (size_t)in);
    if (nb < 1) nb = 1; /* unreachable: scratch sized by kvq_model_wscratch_floats */
    for (int r0 = 0; r0 < out; r0 += nb) {
        int n = out - r0 < nb ? out - r0 : nb;
        const float *blk = wf ? wf : scratch;
        if (!wf) kvq_mat_block(w, r0, n, scratch);
        if (!row_invariant) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, n, in, 1.0f, x, in, blk, in, beta, y + r0, out);
        } else {
            for (int t = 0; t < T; t++)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, n, in, 1.0f, x + (size_t)t * in, in, blk, in, beta,
                            y + (size_t)t * out + r0, out);
        }
    }
}

void kvq_add_bias(float *y, const float *b, int T, int n)
{
    for (int t = 0; t < T; t++) {
        float *r = y + (size_t)t * n;
        for (int c = 0; c < n; c++) r[c] += b[c];
    }
}

void kvq_qkv_finish(const kvq_hparams *hp, const kvq_layer_weights *w, float *q, float *k, float *v, int T)
{
    const int qd = kvq_q_dim(hp), kvd = kvq_kv_dim(hp);
    if (w->bq) kvq_add_bias(q, w->bq, T, qd);
    if (w->bk) kvq_add_bias(k, w->bk, T, kvd);
    if (w->bv) kvq_add_bias(v, w->bv, T, kvd);
    if (w->q_norm) kvq_rmsnorm(q, q, w->q_norm, T * hp->n_heads, hp->head_dim, hp->norm_eps);
    if (w->k_norm) kvq_rmsnorm(k, k, w->k_norm, T * hp->n_kv_heads, hp->head_dim, hp->norm_eps);
}

/* Elementwise ops run on the calling thread: they cost well under 1% of a
 * layer, and every OpenMP region next to OpenBLAS's threads costs wake-ups. */
void kvq_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps)
{
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * dim;
        float *o = out + (size_t)t * dim;
        double ss = 0;
        for (int c = 0; c < dim; c++) ss += (double)xr[c] * xr[c];
        float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
        for (int c = 0; c < dim; c++) o[c] = xr[c] * r * g[c];
    }
}

/* transformers' YaRN correction dimension of a number of rotations */
static double yarn_corr_dim(double rot, int dim, double base, double orig)
{
    return (dim * log(orig / (rot * 2 * M_PI))) / (2 * log(base));
}

void kvq_rope_freqs_at(const kvq_hparams *hp, int seq_len, double *freq)
{
    const int half = hp->rope_dim / 2, d = hp->rope_dim;
    const double factor = hp->rope_scale_factor > 0 ? hp->rope_scale_factor : 1.0;
    double base = hp->rope_theta;
    if (hp->rope_scaling == KVQ_ROPE_SCALING_DYNAMIC) {
        /* _compute_dynamic_ntk_parameters: seq_len = max(seq_len, max_position_embeddings) */
        double S = seq_len > hp->ctx_len ? seq_len : hp->ctx_len;
        base = base * pow(factor * S / hp->ctx_len - (factor - 1), (double)d / (d - 2));
    }
    double lo = 0, hi = 0;
    if (hp->rope_scaling == KVQ_ROPE_SCALING_YARN) {
        lo = yarn_corr_dim(hp->rope_beta_fast, d, base, hp->rope_orig_ctx);
        hi = yarn_corr_dim(hp->rope_beta_slow, d, base, hp->rope_orig_ctx);
        if (hp->rope_yarn_truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        lo = lo > 0 ? lo : 0;
        hi = hi < d - 1 ? hi : d - 1;
        if (lo == hi) hi += 0.001; /* transformers' linear_ramp_factor guard */
    }
    for (int i = 0; i < half; i++) {
        double f = pow(base, -2.0 * i / d);
        switch (hp->rope_scaling) {
        case KVQ_ROPE_SCALING_LINEAR: f /= factor; break;
        case KVQ_ROPE_SCALING_LLAMA3: {
            double lf = hp->rope_low_freq_factor, hf = hp->rope_high_freq_factor, old = hp->rope_orig_ctx;
            double wavelen = 2 * M_PI / f;
            if (wavelen > old / lf) {
                f /= factor;
            } else if (!(wavelen < old / hf)) {
                double smooth = (old / wavelen - lf) / (hf - lf);
                f = (1 - smooth) * f / factor + smooth * f;
            }
            break;
        }
        case KVQ_ROPE_SCALING_YARN: {
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extra = 1 - ramp; /* inv_freq_extrapolation_factor */
            f = (f / factor) * (1 - extra) + f * extra;
            break;
        }
        case KVQ_ROPE_SCALING_FREQ_FACTORS: f /= hp->rope_freq_factors[i]; break;
        default: break;
        }
        freq[i] = f;
    }
}

void kvq_rope_freqs(const kvq_hparams *hp, double *freq) { kvq_rope_freqs_at(hp, 0, freq); }

float kvq_rope_attn_scale(const kvq_hparams *hp)
{
    return hp->rope_scaling == KVQ_ROPE_SCALING_YARN && hp->rope_attn_factor > 0 ? hp->rope_attn_factor : 1.0f;
}

void kvq_rope_table(const kvq_hparams *hp, int pos0, int T, float *cos_t, float *sin_t)
{
    int half = hp->rope_dim / 2;
    double freq[half > 0 ? half : 1];
    kvq_rope_freqs_at(hp, pos0 + T, freq);
    const double m = kvq_rope_attn_scale(hp);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double a = (double)(pos0 + t) * freq[i];
            cos_t[(size_t)t * half + i] = (float)(cos(a) * m);
            sin_t[(size_t)t * half + i] = (float)(sin(a) * m);
        }
}

void kvq_rope_apply(float *x, int T, int n_heads, int head_dim, int rope_dim,
                    const float *cos_t, const float *sin_t, int inverse)
{
    int half = rope_dim / 2;
    float sg = inverse ? -1.0f : 1.0f;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)t * n_heads + h) * head_dim;
            for (int i = 0; i < half; i++) {
                float a = v[2 * i], b = v[2 * i + 1], si = sg * s[i];
                v[2 * i] = a * c[i] - b * si;
                v[2 * i + 1] = a * si + b * c[i];
            }
        }
    }
}

KVQ_HOT void kvq_swiglu(float *out, const float *gate, const float *up, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        kvq_v16 g, u, e;
        V16_LOAD(g, gate + i);
        V16_LOAD(u, up + i);
        KVQ_V16_EXP(e, -g);
        g = g / (1.0f + e) * u;
        V16_STORE(out + i, g);
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + kvq_exp_s(-gate[i])) * up[i];
}

void kvq_softmax(float *x, int n)
{
    if (n <= 0) return;
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

double kvq_token_nll(const float *logits, int V, int target)
{
    float mx = logits[0];
    for (int i = 1; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)logits[i] - mx);
    return (double)mx + log(sum) - (double)logits[target];
}
