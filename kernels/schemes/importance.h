/* importance.h — the attention-importance mixed-precision schedule shared by
 * the families that keep "important" tokens at a high precision and the rest
 * at a low one instead of evicting them: hh.c (H2O scores), mikv.c (MiKV,
 * arXiv 2402.18096 §3: H2O's importance + a query/key channel balancer) and
 * zipcache.c (ZipCache, arXiv 2405.14256 §4: normalised attention, probe
 * queries). Part of the scheme seam (family.h, contract form 3, kvq_kv_sched):
 * a family supplies its high- and low-precision representations of a layer's
 * window; the policy decides per (layer, KV head, token) which one every
 * query reads, from the attention the simulated cache itself produced at
 * earlier steps only (decode-equivalent).
 *
 * Decode semantics, per layer and KV head h (GQA: the group's query heads
 * vote together), for the query at window step i:
 *   - tokens j in (i - W, i] (the recent window) and sink tokens (j < n_sink)
 *     are exact;
 *   - after query i has attended, if query i votes (every query, or with
 *     probe > 0 only the probe queries, kvq_imp_is_probe), every window key
 *     j <= i gains s_j += sum over the group's query heads of p_ij (the
 *     probability as the simulated cache produced it, rounded to float; the
 *     sum over heads in double, in head order);
 *   - the importance of j is s_j, or with `normalise` s_j / n_j where n_j is
 *     the number of voting queries in [j, i] (the queries that could attend
 *     to j; 0 when n_j = 0);
 *   - then token e = i + 1 - W leaves the window (if e >= n_sink): with fewer
 *     than C(i + 2) = floor(f (i + 2)) important tokens it joins them (high
 *     precision from step i + 1 on); otherwise the token of lowest importance
 *     among them and e (ties: the lowest index) goes to the low precision from
 *     step i + 1 on, for good (never promoted back), and e takes its place
 *     unless it was e itself.
 *
 * The transform also describes the policy declaratively (forward.h kvq_sched_imp: budget, window, sink,
 * normalise, probe), so the CUDA forward runs these semantics on the device (kernels/cuda/cuda_sched.cuh:
 * the same sums in double in head order, the same capacity, hash and tie rule; its probabilities differ
 * from the CPU's in the last bits of expf and the row sums, so a near-tie may be decided the other way)
 * and writes back the switch times and counts the steps would have left.
 *
 * Realised counts (kvq_quant_counts, added to the run's k_counts / v_counts
 * once per layer): of the resting cache the window's last query read,
 * n_elems, n_sink, n_exact (window) and n_high (important tokens), per
 * element. */
#ifndef KVQ_IMPORTANCE_H
#define KVQ_IMPORTANCE_H

#include "family.h"

typedef struct {
    double budget;  /* f: the important share of the tokens in the cache, (0, 1] */
    size_t window;  /* W: the exact recent window, >= 1 */
    bool normalise; /* importance = accumulated attention / voting queries that could attend (ZipCache §4.3) */
    double probe;   /* 0: every query votes; (0, 1): only the probe queries (kvq_imp_is_probe) */
} kvq_imp_policy;

/* The family's representations of one layer's window, [T][kv_dim] each (keys in the descriptor's stage):
 * k_hi / v_hi what an important token holds, k_lo / v_lo what the others hold. */
typedef kvq_status (*kvq_imp_reps_fn)(const kvq_kv_desc *d, const kvq_layer_ctx *c, const float *k, const float *v,
                                      float *k_hi, float *k_lo, float *v_hi, float *v_lo, kvq_err *err);

/* The transform of a family built on the policy: fills alt->sched (three representations per key and
 * value: exact, high, low) and keeps its state in run->state (free it with kvq_imp_run_free, the
 * family's run_free). */
kvq_status kvq_imp_transform(kvq_kv_desc_run *run, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt,
                             const kvq_imp_policy *pol, kvq_imp_reps_fn reps, kvq_err *err);
/* Adds the last layer's counts and frees the state (the family's run_free). */
void kvq_imp_run_free(kvq_kv_desc_run *run);

/* floor(f n) with a margin for f n that should be an integer (0.29 * 100): the important-token capacity
 * of a cache of n tokens. */
int kvq_imp_capacity(double f, int n);

/* Is window query i a probe (ZipCache §4.4: a random subset of the queries stands in for all of them)?
 * A fixed hash of i against frac, so the CPU, the GPU host path and a decode loop agree; frac <= 0:
 * every query votes. */
bool kvq_imp_is_probe(int i, double frac);

/* Bits per element of one side: a low token `lo`, an important one `hi` (each with its own scales and
 * index), exact ones 16, plus `fixed` for every element (per-block or per-layer tables amortised). */
typedef struct {
    double lo, hi, fixed;
} kvq_imp_cost;

/* Effective bits (family.h kvq_bits_in): the sink and the window exact at any ctx; of the other tokens the
 * share a run kept at the high precision (realised counts: n_high / (n_elems - n_sink - n_exact)), else
 * the budget's min(floor(f ctx), ctx - n_sink - W). */
kvq_status kvq_imp_bits(const kvq_scheme *q, const kvq_imp_policy *pol, const kvq_imp_cost *k, const kvq_imp_cost *v,
                        const kvq_bits_in *in, kvq_bits *out, kvq_err *err);

/* kvstat's resting representation without attention at hand: the sink and the last W tokens exact, the
 * rest as `lo` (the family's low precision of the whole side, [T][kv_dim], computed by the caller into
 * out's rows); c counts elements, sink and exact tokens. Returns the first low row and its count. */
void kvq_imp_resting(const kvq_scheme *q, size_t T, size_t kvd, size_t *lo_first, size_t *lo_n, kvq_quant_counts *c);

#endif
