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

void kvq_rope_freqs(const kvq_hparams *hp, double *freq)
{
    int half = hp->rope_dim / 2;
    double factor = hp->rope_scale_factor > 0 ? hp->rope_scale_factor : 1.0;
    for (int i = 0; i < half; i++) {
        double f = pow((double)hp->rope_theta, -2.0 * i / hp->rope_dim);
        if (hp->rope_scaling == KVQ_ROPE_SCALING_LINEAR) {
            f /= factor;
        } else if (hp->rope_scaling == KVQ_ROPE_SCALING_LLAMA3) {
            double lo = hp->rope_low_freq_factor, hi = hp->rope_high_freq_factor, old = hp->rope_orig_ctx;
            double wavelen = 2 * M_PI / f;
            if (wavelen > old / lo) {
                f /= factor;
            } else if (!(wavelen < old / hi)) {
                double smooth = (old / wavelen - lo) / (hi - lo);
                f = (1 - smooth) * f / factor + smooth * f;
            }
        }
        freq[i] = f;
    }
}

void kvq_rope_table(const kvq_hparams *hp, int pos0, int T, float *cos_t, float *sin_t)
{
    int half = hp->rope_dim / 2;
    double freq[half > 0 ? half : 1];
    kvq_rope_freqs(hp, freq);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double a = (double)(pos0 + t) * freq[i];
            cos_t[(size_t)t * half + i] = (float)cos(a);
            sin_t[(size_t)t * half + i] = (float)sin(a);
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
