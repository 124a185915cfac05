/* ops.h — the elementwise and per-row building blocks of the Llama forward
 * (and, later, of its backward): linear layers through BLAS, RMSNorm, RoPE,
 * SwiGLU, softmax and token cross-entropy.
 *
 * All tensors are fp32, row-major, one row per token. Functions take outputs
 * first, then inputs, then sizes (llm.c convention). Elementwise ops run on
 * the calling thread (they are <1% of a layer; GEMMs use OpenBLAS's threads);
 * none allocates.
 *
 * Sources: RMSNorm — Zhang & Sennrich 2019, eq. 4 (Llama: y = x / sqrt(mean(x^2)
 * + eps) * g). RoPE — Su et al. 2021 (RoFormer) §3.4.2, interleaved pairs
 * (2i, 2i+1) as in Meta's Llama reference and llama.cpp rope mode 0;
 * theta_i = base^(-2i/rope_dim); Llama-3.1 frequency scaling as in HF
 * transformers `_compute_llama3_parameters`. SwiGLU — Shazeer 2020, eq. 5.
 */
#ifndef KVQ_OPS_H
#define KVQ_OPS_H

#include <stddef.h>

#include "model.h"

/* y[T][out] = x[T][in] · W^T for W stored [out][in] (a kvq linear layer),
 * through cblas_sgemm. beta = 0 overwrites y, beta = 1 accumulates (residual
 * add). Threads: OpenBLAS's own (OPENBLAS_NUM_THREADS, default = cores). */
void kvq_linear(float *y, const float *x, const float *w, int T, int in, int out, float beta);

/* out[t] = x[t] / sqrt(mean_c x[t][c]^2 + eps) * g, rows of `dim`; the mean of
 * squares is accumulated in double. out may equal x. */
void kvq_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps);

/* Inverse frequencies of the rotary pairs, freq[i] for i in [0, rope_dim/2),
 * in radians per position, after the model's RoPE scaling (linear: divided by
 * the factor; llama3: the Llama-3.1 piecewise rule). */
void kvq_rope_freqs(const kvq_hparams *hp, double *freq);

/* cos/sin tables [T][rope_dim/2] for positions pos0 .. pos0+T-1; the angle
 * pos*freq is computed in double, then rounded to float. */
void kvq_rope_table(const kvq_hparams *hp, int pos0, int T, float *cos_t, float *sin_t);

/* Rotate in place the first rope_dim channels of every head of x
 * [T][n_heads][head_dim]; pair (2i, 2i+1) of token t is rotated by the angle
 * of (cos_t, sin_t)[t][i]:  (a, b) -> (a c - b s, a s + b c).
 * inverse != 0 rotates by the negative angle (the transpose: RoPE's backward
 * and its exact inverse). Channels >= rope_dim are untouched. */
void kvq_rope_apply(float *x, int T, int n_heads, int head_dim, int rope_dim,
                    const float *cos_t, const float *sin_t, int inverse);

/* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)), exp by the
 * Cephes polynomial of kernels/model/simd.h (~1 ulp). out may equal gate. */
void kvq_swiglu(float *out, const float *gate, const float *up, size_t n);

/* Numerically stable in-place softmax of one row (max subtracted, fp32). */
void kvq_softmax(float *x, int n);

/* -log softmax(logits)[target] for one row of V logits; log-sum-exp in double. */
double kvq_token_nll(const float *logits, int V, int target);

#endif
