/* kvcache_cuda.h — the packed KV cache of kvcache.h on an NVIDIA GPU: the same
 * layout (formats/KVCACHE.md) in device memory, an append kernel that
 * quantizes new tokens with the artifact's tables, and split-K
 * (flash-decoding) decode attention with RoPE applied after dequantization
 * and the sparse outlier corrections. Plus the fp16 baselines the benchmark
 * compares against (a tuned fp16 split-K kernel and a cuBLAS batched-GEMM
 * path).
 *
 * Built only when the Makefile finds nvcc (CUDA=1); in a CPU-only build every
 * function returns KVQ_EUNSUPPORTED ("built without CUDA"). Both formats of
 * kvcache.h: NUQ and KIVI. All pointers named *_dev are device memory;
 * functions synchronise before returning unless stated.
 *
 * Semantics: as kvq_kvcache_append / kvq_kvcache_attend (kvcache.h), within
 * fp32 rounding: the codes, scales, sparse entries and KIVI residual rows an
 * append writes are bit-identical to the CPU cache's (tests/gpu/test_kvcache_cuda.c checks it;
 * keys rotated on the way in — sink rows, KIVI post-RoPE keys — use the device's
 * double cos/sin, which may differ from libm's by an ulp, so in rare cases an fp16 row
 * could differ by an ulp and a code word with it);
 * scores and softmax run in fp32 with RoPE factors composed from a two-level
 * table (pos = 64*hi + lo, computed in double, composed in fp32) and advanced a
 * few positions from each anchor (one complex multiply then the Chebyshev
 * recurrence, at most 7 steps). P·V (2-, 3- and 4-bit codes) on the tensor
 * cores with the value levels as fp16 operands and p·r in two fp16 parts,
 * fp32 sums: with fp16-number levels (artifacts' are: the loader rounds nuq's
 * value levels) the output matches kvq_kvcache_attend to ~1e-6 relative L2
 * (checked at 2e-5; formats/KVCACHE.md "Precision"); other levels are rounded
 * in the operands (~2e-4). KIVI: post-RoPE keys with 2/4-bit codes
 * and a power-of-two group of 16..128 run on the tensor cores with every fp16
 * operand split into a high and a low part (fp32-accurate: observed <= 7e-6,
 * checked at 2e-5), or, for 2-bit keys and values at group = head_dim = 128
 * with at most 2 query heads per KV head in a block, on the integer tensor
 * cores with the queries and weights as exact fixed-point digits (s32 sums);
 * any other KIVI configuration (pre-RoPE keys, 3-bit codes, other groups) and
 * the residual ring run in fp32 on the CUDA cores.
 * formats/KVCACHE.md "Decode attention (GPU)".
 */
#ifndef KVQ_KVCACHE_CUDA_H
#define KVQ_KVCACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvq_kvcache_cuda kvq_kvcache_cuda;

/* Allocate an empty device cache for cfg (validated as kvq_kvcache_create). */
kvq_status kvq_kvcache_cuda_create(kvq_kvcache_cuda **out, const kvq_kvcache_config *cfg, kvq_err *err);
void kvq_kvcache_cuda_free(kvq_kvcache_cuda *c);

/* Set the IntactKV prefix of an empty sequence, as kvq_kvcache_set_prefix:
 * k_post_dev (post-RoPE keys at positions 0..prefix_len-1) and v_dev, each
 * [prefix_len][kv_dim] float32 in device memory, stored in fp16 (saturating
 * at ±65504, as the CPU cache). Errors: sequence not empty, prefix_len == 0
 * in the configuration; inputs are not checked for NaN/Inf (device data). */
kvq_status kvq_kvcache_cuda_set_prefix(kvq_kvcache_cuda *c, size_t seq, const float *k_post_dev, const float *v_dev,
                                       kvq_err *err);

/* Append n tokens to sequence seq: k_dev (pre-RoPE), v_dev [n][kv_dim] float32
 * in device memory. Same rules and errors as kvq_kvcache_append, except that
 * inputs are not checked for NaN/Inf (device data; the caller's model must
 * produce finite K/V); with prefix_len > 0 the prefix must be set first
 * (kvq_kvcache_cuda_set_prefix, KVQ_EINVAL otherwise). The outlier store grows (cudaMalloc + copy) or the append fails with
 * KVQ_ENOMEM before writing the failing token. KIVI: new tokens are staged in
 * fp16 on the device (n·kv_dim·4 bytes, kept for later appends), the key
 * groups and values the decode boundaries of the last new position call for
 * are quantized from the staged tokens and the ring, then the ring takes the
 * last positions. */
kvq_status kvq_kvcache_cuda_append(kvq_kvcache_cuda *c, size_t seq, const float *k_dev, const float *v_dev,
                                   size_t n, kvq_err *err);

/* One decode step of every sequence at once: token s of k_dev (pre-RoPE keys)
 * and v_dev, each [n_seqs][n_kv_heads][head_dim] float32 in device memory,
 * appended to sequence s at its own position len(s) (sequences may differ in
 * length). The bytes written equal those of n_seqs calls
 * kvq_kvcache_cuda_append(c, s, k_dev + s·kv_dim, v_dev + s·kv_dim, 1) (and of
 * the CPU's kvq_kvcache_append); the same rules and errors, all checked for
 * every sequence before any work, so a refused step appends nothing: the
 * IntactKV prefix set first (KVQ_EINVAL), a full sequence (len == max_tokens:
 * KVQ_ENOMEM naming it), the outlier store limit (below). Asynchronous on the
 * default stream: no host synchronisation in the steady state; launch errors
 * are reported, a fault in the kernel surfaces at the next synchronising call.
 *
 * NUQ: one kernel (a block per sequence) writes the exact-region row (position
 * < max(n_sink, prefix_len)) or quantizes the token (value range, codes,
 * sparse entries), advances the sparse row pointers on the device (entries of
 * (sequence, head) from row[q] on, their end to row[q + 1]) and the device
 * lengths; the host's mirrors advance by one per sequence. The outlier store
 * (entries per (sequence, head)): the host keeps a bound of each sequence's
 * use, its exact count at the last synchronisation + head_dim per row
 * quantized since (a row adds at most head_dim entries to each store). Only
 * when that bound could exceed the capacity does the step synchronise once, to
 * read the exact use (a gather of the row pointers), and then grow the store
 * (cudaMalloc + copy) when this step's worst case (use + head_dim) does not
 * fit or fewer than 16 steps of headroom are left: to max(2·capacity, use +
 * 16·head_dim), clipped to what the remaining positions could ever need and to
 * outlier_max (geometric, so the synchronisations are amortised: with the
 * default capacity, once per ~(capacity − use) / head_dim steps). When even
 * the worst case exceeds outlier_max, the step counts its entries exactly
 * (a second synchronisation, every step from then on) and fails with
 * KVQ_ENOMEM, naming the sequence, position and counts, only if they do not
 * fit. kvq_kvcache_cuda_append, _bytes_read and _download read the exact
 * counts again after steps (one synchronisation).
 *
 * KIVI: its append decides its flushes from positions alone (no counts), so the
 * step runs it per sequence (stage, key / value flushes, ring write, a launch
 * of each; the length by a kernel), without synchronising: n_seqs × 3..5
 * launches per step, not one batched kernel. */
kvq_status kvq_kvcache_cuda_append_step(kvq_kvcache_cuda *c, const float *k_dev, const float *v_dev, kvq_err *err);

/* Decode attention, as kvq_kvcache_attend: q_dev [n_seqs][n_heads][head_dim]
 * float32 (post-RoPE), out_dev same shape. max_splits: upper bound on the
 * split-K partitions per (sequence, KV head) (0 = auto: NUQ picks the split
 * that minimises waves × chunk length for the blocks resident per SM). KIVI: the bound applies to each of its
 * two kernels separately, and the fp32 kernel's chunks hold at most 8192
 * positions, so a long range can take more splits than asked. Asynchronous on the
 * default stream when sync == 0. Errors: KVQ_EUNSUPPORTED at create when the
 * exact region (max(n_sink, prefix_len)) exceeds the GPU's limit (~40K
 * positions at head_dim 128). */
kvq_status kvq_kvcache_cuda_attend(kvq_kvcache_cuda *c, const float *q_dev, size_t n_heads, float scale,
                                   float *out_dev, size_t max_splits, int sync, kvq_err *err);

/* Copy the whole device state into a CPU cache created with the same
 * configuration (lengths, IntactKV prefix flags, codes, scales, sparse rows
 * and entries, fp16 rows, KIVI residual rings), so tests can compare it with
 * kvq_kvcache_append's and the CPU cache can go on appending. Errors:
 * KVQ_EMISMATCH for another configuration or a smaller outlier capacity. */
kvq_status kvq_kvcache_cuda_download(const kvq_kvcache_cuda *c, kvq_kvcache *dst, kvq_err *err);

/* Benchmark support: set every sequence to `len` positions and fill the
 * quantized region with pseudo-random codes, value scales and `per_row`
 * sparse entries per (token, KV head) row (fp16 rows random too), from
 * `seed`; grows the outlier store as needed (KIVI: codes, key and value
 * scales, the residual ring; quantized positions as the decode boundaries of
 * position len - 1 give; per_row unused). Not a quantization: for timing. */
kvq_status kvq_kvcache_cuda_fill_random(kvq_kvcache_cuda *c, size_t len, size_t per_row, uint64_t seed,
                                        kvq_err *err);
/* Bytes one attention pass reads from the cache in its current state (codes,
 * scales, sparse rows and entries, fp16 rows and KIVI residual rows; tables
 * and queries excluded). */
size_t kvq_kvcache_cuda_bytes_read(const kvq_kvcache_cuda *c);

/* ---- fp16 baselines (benchmark) ----------------------------------------------
 * An fp16 KV cache: k16_dev (post-RoPE) and v16_dev [n_seqs][n_kv_heads][cap][head_dim]
 * half bits, every sequence holding len positions. */
typedef struct {
    size_t n_seqs, n_kv_heads, head_dim, cap, len;
    const uint16_t *k16_dev, *v16_dev;
} kvq_fp16_cache;

/* Tuned split-K decode over the fp16 cache; q/out as kvq_kvcache_cuda_attend.
 * partial_dev: scratch of at least kvq_fp16_attend_scratch floats. */
size_t kvq_fp16_attend_scratch(const kvq_fp16_cache *f, size_t n_heads, size_t max_splits);
kvq_status kvq_fp16_attend(const kvq_fp16_cache *f, const float *q_dev, size_t n_heads, float scale,
                           float *out_dev, float *partial_dev, size_t max_splits, int sync, kvq_err *err);

/* cuBLAS baseline: S = K q (cublasGemmStridedBatchedEx, fp16 in, fp32 out), a
 * softmax kernel writing fp16 probabilities, O = Vᵀ p (second batched GEMM).
 * One GEMM batch per (sequence, KV head) with g = n_heads / n_kv_heads query
 * columns. cuBLAS is loaded at run time (dlopen "libcublas.so.13", then
 * "libcublas.so"), so no build links it; kvq_cublas_create fails with
 * KVQ_EUNSUPPORTED when it cannot be loaded. Scratch: kvq_cublas_attend_scratch bytes. */
typedef struct kvq_cublas kvq_cublas;
kvq_status kvq_cublas_create(kvq_cublas **out, kvq_err *err);
void kvq_cublas_free(kvq_cublas *b);
size_t kvq_cublas_attend_scratch(const kvq_fp16_cache *f, size_t n_heads);
kvq_status kvq_cublas_attend(kvq_cublas *b, const kvq_fp16_cache *f, const float *q_dev, size_t n_heads,
                             float scale, float *out_dev, void *scratch_dev, int sync, kvq_err *err);

/* Fill n half values at dev with pseudo-random numbers in [-1, 1) (benchmark). */
kvq_status kvq_cuda_fill_half(uint16_t *dev, size_t n, uint64_t seed, kvq_err *err);

/* dst_dev[i] = src_dev[i] rounded to fp16 and back to float: round to nearest even, saturating at ±65504
 * (kvq_round_fp16's rule, quant.h; the cache's fp16 rows use the same), n floats in device memory, dst_dev may
 * equal src_dev; returns after the kernel completed. What the decoder's KVQ_DECODE_KV_FP16 appends on the GPU
 * (kernels/decode/decode.h). Errors: KVQ_EIO naming the CUDA error. */
kvq_status kvq_cuda_round_fp16(float *dst_dev, const float *src_dev, size_t n, kvq_err *err);
/* *out = bytes of device memory (cudaMalloc; NULL and KVQ_ENOMEM naming the size when it fails); kvq_cuda_free
 * releases it (NULL ignored). For callers in C that hold device scratch (the decoder). */
kvq_status kvq_cuda_alloc(void **out, size_t bytes, kvq_err *err);
void kvq_cuda_free(void *dev);

#ifdef __cplusplus
}
#endif

#endif
