/* select.c — quickselect and percentiles; see select.h. */
#include "select.h"

#include <math.h>

static void swapf(float *a, size_t i, size_t j) { float t = a[i]; a[i] = a[j]; a[j] = t; }

static void sift_down(float *a, size_t start, size_t end)
{
    size_t root = start;
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= end) return;
        if (child + 1 < end && a[child] < a[child + 1]) child++;
        if (a[root] >= a[child]) return;
        swapf(a, root, child);
        root = child;
    }
}

static void heap_sort(float *a, size_t n)
{
    if (n < 2) return;
    for (size_t i = n / 2; i-- > 0;) sift_down(a, i, n);
    for (size_t end = n - 1; end > 0; end--) {
        swapf(a, 0, end);
        sift_down(a, 0, end);
    }
}

static float median3(float x, float y, float z)
{
    if (x < y) { if (y < z) return y; return x < z ? z : x; }
    if (x < z) return x;
    return y < z ? z : y;
}

float kvq_select_f32(float *a, size_t n, size_t k)
{
    size_t lo = 0, hi = n; /* search in a[lo..hi) */
    int budget = 2 * 64;
    while (hi - lo > 16) {
        if (budget-- <= 0) { heap_sort(a + lo, hi - lo); return a[k]; }
        float p = median3(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        /* 3-way partition: [lo,lt) < p, [lt,gt) == p, [gt,hi) > p */
        size_t lt = lo, i = lo, gt = hi;
        while (i < gt) {
            if (a[i] < p) swapf(a, lt++, i++);
            else if (a[i] > p) swapf(a, i, --gt);
            else i++;
        }
        if (k < lt) hi = lt;
        else if (k >= gt) lo = gt;
        else return a[k];
    }
    /* insertion sort of the small remaining range */
    for (size_t i = lo + 1; i < hi; i++) {
        float v = a[i];
        size_t j = i;
        while (j > lo && a[j - 1] > v) { a[j] = a[j - 1]; j--; }
        a[j] = v;
    }
    return a[k];
}

/* smallest value of a[from..n) (n > from) */
static float min_from(const float *a, size_t from, size_t n)
{
    float m = a[from];
    for (size_t i = from + 1; i < n; i++) if (a[i] < m) m = a[i];
    return m;
}

static double lerp_np(double a, double b, double g)
{
    /* numpy's _lerp: a + (b-a)*g, but b - (b-a)*(1-g) for g >= 0.5 */
    double d = b - a;
    return g >= 0.5 ? b - d * (1.0 - g) : a + d * g;
}

float kvq_percentile_f32(float *a, size_t n, double q)
{
    if (q <= 0) q = 0;
    if (q >= 1) q = 1;
    double pos = q * (double)(n - 1);
    size_t i = (size_t)floor(pos);
    if (i >= n - 1) return kvq_select_f32(a, n, n - 1);
    double g = pos - (double)i;
    float lo = kvq_select_f32(a, n, i);
    if (g == 0) return lo;
    float hi = min_from(a, i + 1, n);
    double v = lerp_np(lo, hi, g);
    if (v < lo) v = lo;  /* keep within [s[i], s[i+1]] */
    if (v > hi) v = hi;
    return (float)v;
}

void kvq_percentile_pair_f32(float *a, size_t n, double t, float *lower, float *upper)
{
    if (t < 0.5) t = 0.5;
    if (t > 1) t = 1;
    /* upper first: it partitions so that the lower tail is in a[0..i] */
    *upper = kvq_percentile_f32(a, n, t);
    *lower = kvq_percentile_f32(a, n, 1.0 - t);
}
