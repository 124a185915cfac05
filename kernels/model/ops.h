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
 * theta_i = base^(-2i/rope_dim); Llama-3.1, YaRN and dynamic-NTK frequency
 * scaling as in HF transformers `_compute_{llama3,yarn,dynamic_ntk}_parameters`. SwiGLU — Shazeer 2020, eq. 5.
 */
#ifndef KVQ_OPS_H
#define KVQ_OPS_H

#include <stddef.h>

#include "model.h"

/* y[T][out] = x[T][in] · W^T for W stored [out][in] (a kvq linear layer),
 * through cblas_sgemm. beta = 0 overwrites y, beta = 1 accumulates (residual
 * add). Threads: OpenBLAS's own (OPENBLAS_NUM_THREADS, default = cores). */
void kvq_linear(float *y, const float *x, const float *w, int T, int in, int out, float beta);

/* Rows r0 .. r0+n-1 of w as fp32 into dst[n][cols] (kvq_mat_rows, model.h),
 * spread over OpenMP threads (rows are independent: same bits whatever the
 * thread count). */
void kvq_mat_block(const kvq_mat *w, int r0, int n, float *dst);

/* Scratch floats kvq_linear_mat / kvq_linear_bwd_mat need for the matrices of
 * m: 0 when every matrix is fp32, else max over the matrices of
 * min(rows, max(1, KVQ_WBLOCK_FLOATS / cols)) * cols. */
#define KVQ_WBLOCK_FLOATS ((size_t)1 << 23) /* 32 MiB of fp32 rows per block */
size_t kvq_model_wscratch_floats(const kvq_model *m);

/* y[T][rows] = beta * y + x[T][cols] · W^T for a matrix W of any storage
 * (W.cols = in, W.rows = out). fp32 matrices: kvq_linear. Others: W's rows
 * are converted to fp32 in blocks of nb = scratch_floats / cols rows into
 * scratch, and each block is one sgemm into columns [r0, r0 + nb) of y: the
 * arithmetic is fp32 as in exact mode (each output element is the same dot
 * product; OpenBLAS may round a block's columns as it rounds the whole).
 * row_invariant: one M = 1 GEMM per token row per block (KVQ_FWD_ROW_INVARIANT). */
void kvq_linear_mat(float *y, const float *x, const kvq_mat *w, int T, float beta, float *scratch, size_t scratch_floats,
                    int row_invariant);

/* out[t] = x[t] / sqrt(mean_c x[t][c]^2 + eps) * g, rows of `dim`; the mean of
 * squares is accumulated in double. out may equal x. Qwen3's per-head q/k
 * norm is this with rows of head_dim (T * n_heads rows). */
void kvq_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps);

/* y[t][c] += b[c] for T rows of n (attention biases). */
void kvq_add_bias(float *y, const float *b, int T, int n);

/* The attention-projection tail shared by the forward, the backward's
 * recomputation and the GPU check: q [T][q_dim], k [T][kv_dim], v [T][kv_dim]
 * hold x Wq^T, x Wk^T, x Wv^T on entry; adds the biases (when present) and
 * applies the per-head q/k RMSNorm (when present; Qwen3: after the bias,
 * before RoPE). The keys that leave are the model's pre-RoPE keys. */
void kvq_qkv_finish(const kvq_hparams *hp, const kvq_layer_weights *w, float *q, float *k, float *v, int T);

/* Inverse frequencies of the rotary pairs, freq[i] for i in [0, rope_dim/2),
 * in radians per position, after the model's RoPE scaling (model.h
 * kvq_rope_scaling: linear, llama3, yarn, freq_factors; dynamic NTK as at
 * seq_len = ctx_len, i.e. unscaled: kvq_rope_freqs_at gives it for a longer
 * sequence). */
void kvq_rope_freqs(const kvq_hparams *hp, double *freq);

void kvq_rope_freqs_at(const kvq_hparams *hp, int seq_len, double *freq);

/* cos/sin tables [T][rope_dim/2] for positions pos0 .. pos0+T-1; the angle
 * pos*freq is computed in double, then rounded to float. YaRN multiplies both
 * by the attention factor (kvq_rope_attn_scale), so the "rotation" scales
 * every rotated pair by it (as HF's cos/sin do); dynamic NTK takes the
 * frequencies for seq_len = pos0 + T (kvq_rope_freqs_at). */
void kvq_rope_table(const kvq_hparams *hp, int pos0, int T, float *cos_t, float *sin_t);

/* The factor kvq_rope_table multiplies cos and sin by: rope_attn_factor for
 * YaRN, else 1. kvq_rope_apply with inverse != 0 on such tables is RoPE's
 * transpose (its backward), not its inverse; the inverse is the transpose
 * divided by the square of this factor. */
float kvq_rope_attn_scale(const kvq_hparams *hp);

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
