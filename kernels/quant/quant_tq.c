/* quant_tq.c — vLLM's TurboQuant KV cache; see quant_tq.h. */
#include "quant_tq.h"

#include <math.h>
#include <string.h>

#include "hadamard.h"
#include "half.h"
#include "quant_fp8.h"

/* centroids.py: _gaussian_pdf and _trapz, term for term */
static double gpdf(double x, double sigma2)
{
    return (1.0 / sqrt(2 * 3.141592653589793 * sigma2)) * exp(-x * x / (2 * sigma2)); /* math.pi */
}

static double trapz(bool times_x, double a, double b, double sigma2)
{
    const int n = 200;
    double h = (b - a) / n;
    double fa = gpdf(a, sigma2), fb = gpdf(b, sigma2);
    if (times_x) fa *= a, fb *= b;
    double r = 0.5 * (fa + fb);
    for (int i = 1; i < n; i++) {
        double x = a + i * h, f = gpdf(x, sigma2);
        r += times_x ? x * f : f;
    }
    return r * h;
}

void kvq_tq_centroids(size_t d, int bits, float *out)
{
    const int n = 1 << bits;
    double sigma2 = 1.0 / (double)d, sigma = sqrt(sigma2), lo = -3.5 * sigma, hi = 3.5 * sigma;
    double c[1 << KVQ_TQ_MAX_BITS], nc[1 << KVQ_TQ_MAX_BITS], e[(1 << KVQ_TQ_MAX_BITS) + 1];
    for (int i = 0; i < n; i++) c[i] = lo + (hi - lo) * (i + 0.5) / n;
    for (int it = 0; it < 200; it++) {
        e[0] = lo * 3;
        for (int i = 0; i + 1 < n; i++) e[i + 1] = (c[i] + c[i + 1]) / 2.0;
        e[n] = hi * 3;
        double moved = 0;
        for (int i = 0; i < n; i++) {
            double num = trapz(true, e[i], e[i + 1], sigma2), den = trapz(false, e[i], e[i + 1], sigma2);
            nc[i] = den > 1e-15 ? num / den : c[i];
            moved = fmax(moved, fabs(nc[i] - c[i]));
        }
        if (moved < 1e-10) break; /* vLLM breaks before taking the last iterate */
        memcpy(c, nc, sizeof c);
    }
    for (int i = 0; i < n; i++) out[i] = (float)c[i];
}

/* y = x · H_d (normalised Sylvester; H symmetric, its own inverse), float64 butterflies */
static void hadamard(float *x, size_t d)
{
    kvq_fwht(x, d);
}

void kvq_tq_key(const float *k, float *kh, size_t d, int mse_bits, const float *cent, bool nc)
{
    if (mse_bits == 8) {
        for (size_t j = 0; j < d; j++) kh[j] = kvq_fp8_decode(KVQ_FP8_E4M3FN, kvq_fp8_encode(KVQ_FP8_E4M3FN, k[j]));
        return;
    }
    const int n = 1 << mse_bits;
    float mid[(1 << KVQ_TQ_MAX_BITS) - 1], y[KVQ_HADAMARD_MAX];
    for (int i = 0; i + 1 < n; i++) mid[i] = (cent[i] + cent[i + 1]) / 2;
    double ss = 0;
    for (size_t j = 0; j < d; j++) ss += (double)k[j] * k[j];
    float norm = (float)sqrt(ss), den = norm + 1e-8f;
    for (size_t j = 0; j < d; j++) y[j] = k[j] / den;
    hadamard(y, d);
    float c2 = 0;
    for (size_t j = 0; j < d; j++) {
        int idx = 0;
        while (idx < n - 1 && y[j] >= mid[idx]) idx++;
        y[j] = cent[idx];
        c2 += y[j] * y[j];
    }
    float n16 = kvq_f16_to_f32(kvq_f32_to_f16(norm)), inv = nc ? 1.0f / sqrtf(c2 + 1e-16f) : 1.0f;
    for (size_t j = 0; j < d; j++) y[j] = (nc ? y[j] * inv : y[j]) * n16;
    hadamard(y, d);
    memcpy(kh, y, d * sizeof *kh);
}

void kvq_tq_value(const float *v, float *vh, size_t d, int bits)
{
    float lo = INFINITY, hi = -INFINITY, qmax = (float)((1 << bits) - 1);
    for (size_t j = 0; j < d; j++) {
        lo = fminf(lo, v[j]);
        hi = fmaxf(hi, v[j]);
    }
    float scale = (hi - lo) / qmax;
    if (!(scale > 1e-8f)) scale = 1e-8f;
    float s16 = kvq_f16_to_f32(kvq_f32_to_f16(scale)), z16 = kvq_f16_to_f32(kvq_f32_to_f16(lo));
    for (size_t j = 0; j < d; j++) {
        int q = (int)((v[j] - lo) / scale + 0.5f); /* int32 conversion truncates; the argument is >= 0.5 */
        q = q < 0 ? 0 : q > (int)qmax ? (int)qmax : q;
        vh[j] = (float)q * s16 + z16;
    }
}
