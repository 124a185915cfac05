// cuda_ops.cuh — device kernels of the CUDA forward and backward (internal to
// kernels/*.cu; defined in cuda_ops.cu and cuda_bwd_ops.cu). Every launcher
// enqueues on `st` and returns cudaGetLastError(). Layouts are those of the
// CPU code (forward.h, attention.h, attention_backward.h, ops_backward.h,
// quant.h): row-major fp32, one row per token. Semantics: see those headers;
// the fp32 kernels differ from the CPU in summation order only; the bf16
// helpers (embedding gather from a bf16 table, fp32 -> bf16 conversion) serve
// the BF16 fast mode (forward_cuda.h) and round as they say.
#ifndef KVQ_CUDA_OPS_CUH
#define KVQ_CUDA_OPS_CUH

#include <cuda_runtime.h>
#include <stddef.h>

// x[t][:] = E[tok[t]][:]
cudaError_t kvq_cu_embed(float *x, const float *E, const int *tok, int T, int dim, cudaStream_t st);
// The same from a bf16 table E [vocab][dim] (bits, exact widening).
cudaError_t kvq_cu_embed_bf16(float *x, const unsigned short *E, const int *tok, int T, int dim, cudaStream_t st);
// dst[i] = bf16(src[i]) (round to nearest even), n elements.
cudaError_t kvq_cu_to_bf16(unsigned short *dst, const float *src, size_t n, cudaStream_t st);
// kvq_rmsnorm: sum of squares in double (block tree order), r = (float)(1/sqrt(ss/dim + eps)), out = x*r*g.
// out may equal x. Qwen3's per-head q/k norm: T * n_heads rows of head_dim.
cudaError_t kvq_cu_rmsnorm(float *out, const float *x, const float *g, int T, int dim, float eps, cudaStream_t st);
// kvq_rope_apply (forward rotation), same rounding (no FMA contraction).
cudaError_t kvq_cu_rope(float *x, int T, int nh, int hd, int rope_dim, const float *cos_t, const float *sin_t,
                        cudaStream_t st);
// kvq_rope_bwd: rotation by the negative angle (dL/d(unrotated) from dL/d(rotated)), in place.
cudaError_t kvq_cu_rope_inv(float *x, int T, int nh, int hd, int rope_dim, const float *cos_t, const float *sin_t,
                            cudaStream_t st);
// kvq_add_bias: y[t][c] += b[c] for T rows of n (attention biases), exact fp32 adds.
cudaError_t kvq_cu_add_bias(float *y, const float *b, int T, int n, cudaStream_t st);
// kvq_swiglu: out = g / (1 + expf(-g)) * u (CUDA expf, ~2 ulp; the CPU's Cephes exp ~1 ulp).
cudaError_t kvq_cu_swiglu(float *out, const float *gate, const float *up, size_t n, cudaStream_t st);
// Online log-sum-exp state: row_max = -inf, row_sum = 0, row_tgt = NaN.
cudaError_t kvq_cu_lse_init(float *row_max, double *row_sum, float *row_tgt, int T, cudaStream_t st);
// One vocabulary block z[T][nv] (logits v0..v0+nv-1): forward.c's loss-only update
// (float max; sum of exp((double)z - max) in double; target logit picked).
// Rows with tg[t] < 0 are skipped.
cudaError_t kvq_cu_lse_block(const float *z, const int *tg, int v0, int nv, int T, float *row_max, double *row_sum,
                             float *row_tgt, cudaStream_t st);
// kvq_cu_lse_block plus forward.c's kvq_fwd_head outputs: row_arg[t] = the first index of the largest
// logit so far (-1 before the first block: init it so), and when ex is non-NULL ([T][dim], zeroed
// before the first block) the running expectation: ex row *= exp(old max - new max) and z is turned
// into exp(z - new max) in place (fp32) for the caller's GEMM ex += z W_blk; rows with tg < 0 are
// zeroed in z then (they add nothing).
cudaError_t kvq_cu_lse_block_head(float *z, const int *tg, int v0, int nv, int T, float *row_max, double *row_sum,
                                  float *row_tgt, int *row_arg, float *ex, int dim, cudaStream_t st);

// Causal GQA attention of attention.h (prefix, alternative K/V with
// boundaries), fused: online softmax over key tiles, fp32, accurate expf.
struct kvq_cu_attn {
    int T, P, n_heads, n_kv_heads, head_dim;
    const float *q, *k, *v, *pk, *pv, *kq, *vq;
    const int *kb, *vb;
    float *out;
    float *lse; // optional [n_heads][T]: log sum_c exp(score_c) of each query row (scaled scores), for the backward
    int window; // > 0: sliding window (attention.h kvq_attn_key_lo): key position > query position - window
    int pos0;   // position of window query/key 0 (prefix entry j is at position j); used with window
    int bf16_tc; // 1: the bf16 tensor-core kernel (cuda_attn_tc.cu) where it applies (kvq_cu_attn_tc_supported);
                 // 0: the fp32 kernel. Only the KVQ_CUDA_BF16 math mode sets it; the backward ignores it.
};
// 0 if head_dim is supported (8, 16, 32, 64, 128), else -1.
int kvq_cu_attn_supported(int head_dim);
// The fp32 kernel (cuda_ops.cu attn_k), or with a->bf16_tc and kvq_cu_attn_tc_supported the bf16 one.
cudaError_t kvq_cu_attention(const kvq_cu_attn *a, cudaStream_t st);
// The bf16 tensor-core forward (cuda_attn_tc.cu): head_dim 64 or 128 without the alternative K/V (kq, vq);
// cudaErrorInvalidValue otherwise. kvq_cu_attn_tc_supported: 1 when it applies.
int kvq_cu_attn_tc_supported(const kvq_cu_attn *a);
cudaError_t kvq_cu_attention_tc(const kvq_cu_attn *a, cudaStream_t st);

// Backward of kvq_cu_attention (attention_backward.h semantics; FlashAttention-2,
// Dao 2023, Algorithm 2): needs a->out and a->lse of the forward on the same
// inputs. Two kernels: a query-side pass (D = do.o, dq) and a key-side pass (dK,
// dV and the prefix gradients, summed over the GQA group's query heads). The
// gradient of an alternative representation (kq / vq) is added to dk / dv
// (straight-through). Outputs are overwritten. The statistics entry point fills
// attention.h's mass [n_heads][P+T] and entropy [n_heads][T] (either may be NULL)
// from the forward's lse.
struct kvq_cu_attn_grad {
    const float *dout;     // [T][n_heads][head_dim]
    float *D;              // [n_heads][T] scratch
    float *dq;             // [T][n_heads][head_dim]
    float *dk, *dv;        // [T][n_kv_heads][head_dim]
    float *dpk, *dpv;      // [P][n_kv_heads][head_dim], or NULL
    float *mass, *entropy; // statistics mode only
};
cudaError_t kvq_cu_attn_bwd(const kvq_cu_attn *a, const kvq_cu_attn_grad *b, cudaStream_t st);
cudaError_t kvq_cu_attn_stats(const kvq_cu_attn *a, const float *lse, float *mass, float *entropy, cudaStream_t st);
// kvq_rmsnorm_bwd (both row sums in double); accumulate: dx += result.
cudaError_t kvq_cu_rmsnorm_bwd(float *dx, const float *dy, const float *x, const float *g, int T, int dim, float eps,
                               int accumulate, cudaStream_t st);
// kvq_swiglu_bwd.
cudaError_t kvq_cu_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n,
                              cudaStream_t st);
// lse[t] = row_max[t] + log(row_sum[t]) (double) for scored rows (tg >= 0), after kvq_cu_lse_block over the vocabulary.
cudaError_t kvq_cu_lse_final(double *lse, const float *row_max, const double *row_sum, const int *tg, int T, cudaStream_t st);
// In place: logits block z[T][nv] (vocabulary rows v0..) -> scale * (softmax - onehot(tg)); unscored rows -> 0.
cudaError_t kvq_cu_xent_grad(float *z, const int *tg, int v0, int nv, int T, const double *lse, float scale, cudaStream_t st);
// *flag |= 1 when any of x[0..n) is not finite.
cudaError_t kvq_cu_nonfinite(const float *x, size_t n, int *flag, cudaStream_t st);

// ---- KV quantize→dequantize (quant.h rules, bit-exact: double arithmetic,
// ---- explicit _rn intrinsics so nothing is contracted into an FMA) ----
// Rows [ns, T) of x[T][n]: fp16 round trip with saturation at ±65504.
cudaError_t kvq_cu_q_fp16(float *x, size_t T, size_t n, size_t ns, unsigned long long *clipped, cudaStream_t st);
// kvq_quant_int_token: out may equal in; rows < ns copied.
cudaError_t kvq_cu_q_int_token(float *out, const float *in, size_t T, size_t kvd, size_t group, int bits, size_t ns,
                               cudaStream_t st);
// kvq_quant_int_channel in place on rows >= ns; outliers counted into *cnt.
cudaError_t kvq_cu_q_int_channel(float *x, size_t T, size_t kvd, const float *lo, const float *up, int bits,
                                 int outliers, size_t ns, unsigned long long *cnt, cudaStream_t st);
// kvq_quant_nuq_keys in place; levels [n_tables][2^bits], table = c / head_dim when n_tables > 1.
cudaError_t kvq_cu_q_nuq_keys(float *x, size_t T, size_t kvd, const float *levels, int bits, size_t n_tables,
                              size_t head_dim, const float *lo, const float *up, int outliers, size_t ns,
                              unsigned long long *cnt, cudaStream_t st);
// kvq_quant_nuq_values in place; k = outliers per side (kvq_outliers_per_side).
cudaError_t kvq_cu_q_nuq_values(float *x, size_t T, size_t kvd, const float *levels, int bits, size_t n_tables,
                                size_t head_dim, size_t k, size_t ns, unsigned long long *cnt, cudaStream_t st);
// kvq_kivi_keys: out (≠ in) gets complete G-token groups after ns quantized per channel, other rows copied.
cudaError_t kvq_cu_q_kivi_keys(float *out, const float *in, size_t T, size_t kvd, size_t group, int bits, size_t ns,
                               cudaStream_t st);

// Fill x[n] with deterministic pseudo-random values in [-1, 1) (benchmarks).
cudaError_t kvq_cu_fill_random(float *x, size_t n, unsigned seed, cudaStream_t st);

#endif
