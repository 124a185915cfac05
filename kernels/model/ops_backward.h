/* ops_backward.h — reverse-mode (vector-Jacobian) products of the forward
 * building blocks in ops.h, for the backward pass (backward.h). Weights are
 * frozen: only gradients with respect to activations are computed.
 *
 * Every function exists in two builds of one source (ops_backward.inc):
 * fp32 (the names below, used by the backward pass) and float64 (suffix
 * _f64, same arguments with double tensors), which the tests check against
 * central finite differences at 1e-6 relative. Row-major, one row per token,
 * outputs first (llm.c convention); none allocates. Inner reductions of a row
 * are accumulated in double. Threads: GEMMs use OpenBLAS's; the elementwise
 * ops run on the calling thread (as in ops.h: OpenMP workers spinning between
 * regions would compete with OpenBLAS's threads); only the LM head's
 * per-row exponentials use an OpenMP loop.
 *
 * Derivations (y = forward output, dy = dL/dy):
 *  linear   y = x W^T (W [out][in])            dx = dy W
 *  RMSNorm  y_c = x_c r g_c, r = (mean x^2 + eps)^-1/2
 *           dx_c = r g_c dy_c - (r^3 / dim) x_c sum_k dy_k g_k x_k
 *  RoPE     y = R(theta) x (orthogonal)         dx = R(-theta) dy
 *  SwiGLU   y = silu(g) u, silu(g) = g s(g)     du = dy silu(g),
 *           dg = dy u s(g) (1 + g (1 - s(g)))  (s = logistic sigmoid)
 *  LM head + mean cross-entropy (softmax over the vocabulary, Goodfellow et
 *  al., Deep Learning §6.2.2.3): dz = scale (softmax(z) - onehot(target)),
 *  dxn = dz W, computed blockwise over the vocabulary with an online
 *  log-sum-exp so that only [T][v_chunk] logits exist at a time.
 */
#ifndef KVQ_OPS_BACKWARD_H
#define KVQ_OPS_BACKWARD_H

#include <stddef.h>

#include "model.h"

/* dx[T][in] = beta * dx + dy[T][out] · W, W stored [out][in] (the weight of
 * kvq_linear); cblas_sgemm / cblas_dgemm with OpenBLAS's threads. */
void kvq_linear_bwd(float *dx, const float *dy, const float *w, int T, int in, int out, float beta);
void kvq_linear_bwd_f64(double *dx, const double *dy, const double *w, int T, int in, int out, double beta);
/* The same for a matrix of any storage (model.h kvq_mat; in = cols, out =
 * rows): non-fp32 matrices are converted in blocks of scratch_floats / cols
 * rows (kvq_linear_mat's scheme), each block's product accumulated into dx. */
void kvq_linear_bwd_mat(float *dx, const float *dy, const kvq_mat *w, int T, float beta, float *scratch, size_t scratch_floats);

/* RMSNorm backward for rows of `dim` (forward: kvq_rmsnorm with the same x, g,
 * eps). accumulate != 0: dx += result (residual stream), else dx = result.
 * dx must not alias dy or x. */
void kvq_rmsnorm_bwd(float *dx, const float *dy, const float *x, const float *g, int T, int dim, float eps, int accumulate);
void kvq_rmsnorm_bwd_f64(double *dx, const double *dy, const double *x, const double *g, int T, int dim, double eps, int accumulate);

/* RoPE backward in place: x [T][n_heads][head_dim] holds dL/d(rotated) on
 * entry, dL/d(unrotated) on return (rotation by the negative angle of the
 * kvq_rope_table tables [T][rope_dim/2]; channels >= rope_dim untouched). */
void kvq_rope_bwd(float *x, int T, int n_heads, int head_dim, int rope_dim, const float *cos_t, const float *sin_t);
void kvq_rope_bwd_f64(double *x, int T, int n_heads, int head_dim, int rope_dim, const double *cos_t, const double *sin_t);

/* SwiGLU backward over n elements: dgate = dL/dgate, dup = dL/dup given dout
 * = dL/d(silu(gate) * up). dgate may equal gate and dup may equal up
 * (element i is read before it is written). */
void kvq_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);
void kvq_swiglu_bwd_f64(double *dgate, double *dup, const double *dout, const double *gate, const double *up, size_t n);

/* LM head + token cross-entropy, forward and backward in one blockwise pass.
 * xn [T][dim] (normed final hidden states), w [V][dim] (LM head / tied
 * embedding), targets [T] (< 0: row not scored). For scored rows:
 *   nll[t] = logsumexp(z_t) - z_t[target],  z_t = w xn_t,
 *   dxn[t] = scale * (sum_v softmax(z_t)_v w_v - w_target)   (= scale * dnll/dxn)
 * and dxn[t] = 0, nll[t] = NaN for unscored rows. Returns the sum of nll over
 * scored rows (double). The vocabulary is processed in blocks of v_chunk
 * rows: z_blk = xn w_blk^T into zbuf [T][v_chunk], exponentiated against a
 * running max, then accumulated as dxn += e_blk w_blk (row-rescaled when the
 * max grows), so two GEMMs per block and no [T][V] tensor. Scratch: zbuf
 * [T][v_chunk], rmax [T], rsum [T] (double), rtgt [T]. nll [T] (out) may be
 * NULL. fp32 build: the LM head is a kvq_mat (model.h); when it is not
 * stored in fp32 each vocabulary block is converted into wbuf [v_chunk][dim]
 * (NULL allowed for fp32 heads). */
double kvq_lm_head_xent_bwd(float *dxn, double *nll, const float *xn, const kvq_mat *w, float *wbuf, const int *targets, int T, int dim,
                            int V, double scale, int v_chunk, float *zbuf, float *rmax, double *rsum, float *rtgt);
double kvq_lm_head_xent_bwd_f64(double *dxn, double *nll, const double *xn, const double *w, const int *targets, int T, int dim,
                                int V, double scale, int v_chunk, double *zbuf, double *rmax, double *rsum, double *rtgt);

#endif
