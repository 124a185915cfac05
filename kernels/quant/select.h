/* select.h — deterministic order statistics and linear-interpolated
 * percentiles over float32 arrays (no sort of everything: 3-way quickselect
 * with a fixed median-of-three pivot, falling back to a heap sort of the
 * remaining range if the recursion budget runs out, so the worst case is
 * O(n log n) and the result never depends on a random seed).
 *
 * The percentile definition is numpy's default (`method="linear"`):
 *   pos = q * (n - 1), i = floor(pos), g = pos - i,
 *   value = s[i] + g * (s[i+1] - s[i])   (evaluated as numpy's _lerp: for
 *   g >= 0.5 it is s[i+1] - (s[i+1] - s[i]) * (1 - g)),
 * where s is the ascending sort of the data, computed in double and rounded
 * once to float32. Because s[i] <= value <= s[i+1] in double and rounding is
 * monotone, the float32 result stays between the two order statistics.
 * Inputs must not contain NaN (callers validate first).
 */
#ifndef KVQ_SELECT_H
#define KVQ_SELECT_H

#include <stddef.h>

/* Reorder a[0..n) so that a[k] holds the k-th smallest value (0-based),
 * a[0..k) <= a[k] <= a[k+1..n). Returns a[k]. Requires k < n. */
float kvq_select_f32(float *a, size_t n, size_t k);

/* numpy-linear percentile at fraction q in [0, 1] (not percent) of a[0..n),
 * n >= 1. a is used as scratch (reordered). */
float kvq_percentile_f32(float *a, size_t n, double q);

/* Both tails at once: lower = percentile(1 - t), upper = percentile(t) with
 * t in [0.5, 1]; a is reordered. */
void kvq_percentile_pair_f32(float *a, size_t n, double t, float *lower, float *upper);

#endif
