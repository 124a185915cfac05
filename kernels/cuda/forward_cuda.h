/* forward_cuda.h — the Llama forward of forward.h on one CUDA GPU, with the
 * same inputs, outputs and semantics (kvq_fwd_io / kvq_fwd_result, hooks,
 * prefix, alternative K/V with boundaries, loss-only LM head).
 *
 * What runs where:
 *  - GPU: embedding gather, RMSNorm (sum of squares in double), the linear
 *    layers through cuBLAS (column-major view of the row-major [out][in]
 *    weights: y^T = W · x^T), the attention biases and Qwen3's per-head q/k
 *    RMSNorm, RoPE (cos/sin tables computed on the host by kvq_rope_table, as
 *    the CPU does: every RoPE scaling, YaRN's attention factor included),
 *    causal GQA attention with prefix, boundaries and the model's sliding
 *    window (a fused flash-style kernel: online softmax over key tiles in
 *    shared memory, never a [T][T] matrix; tiles before a query block's
 *    window skipped; fp32 CUDA cores, bf16 tensor cores in the bf16 mode),
 *    SwiGLU, the LM head in vocabulary
 *    blocks with an online log-sum-exp in double (blockwise cross-entropy; the
 *    CPU's loss-only rule), and the built-in KV transforms of kv_desc.h
 *    (fp16, int, int-pc, nuq, kivi) natively, bit-for-bit the rules of
 *    quant.h (double arithmetic, no FMA contraction, round-half-to-even).
 *  - Host, labelled "host transform" in kvq_forward_cuda_stats: a generic
 *    kvq_hooks.transform callback (any scheme kv_desc.h does not describe,
 *    e.g. fp8 or llama.cpp block formats): the layer's K/V are copied back,
 *    the callback runs on the CPU, the results are copied up again. Exact but
 *    slower (two PCIe round trips per layer).
 *  - Host: the observe hook (kvdump), on copies of q/k/v/k_att/v_att/alt; with
 *    hooks->attn_stats the attention mass and entropy (attention.h) are
 *    computed on the GPU from the attention's per-row log-sum-exp
 *    (cuda_bwd_ops.cu) and copied with them.
 *  - An external KV cache: kvq_hooks.attend (forward.h) is called with device
 *    pointers (q, k_pre, k_post, v, out) after the forward's stream is
 *    synchronised, in place of the attention (kernels/decode: the packed
 *    cache kvcache_cuda.h appends and attends); io->pos gives the rows their
 *    own positions. Not with a transform, a built-in scheme, observe, a
 *    prefix, the activation store or a pipeline stage (KVQ_EINVAL).
 *  - Checkpoints: KVQ_FWD_SAVE_LAYER_INPUTS keeps the n_layers+1 residual
 *    streams on the device (kvq_forward_cuda_layer_input copies one out);
 *    KVQ_FWD_SAVE_ACTIVATIONS also every layer's activations (the CPU's
 *    kvq_fwd_layer_acts set), which kvq_forward_cuda_backward needs.
 *
 * Backward (kvq_forward_cuda_backward): kvq_backward_run's contract
 * (backward.h) on the GPU — cross-entropy and/or upstream gradients, the
 * grads callback per layer (n_layers-1 .. 0) with dL/dK pre/post-RoPE, dL/dV
 * and the prefix gradients, straight-through through the transform (native
 * or host), d_embd. The LM head is differentiated in vocabulary blocks (two
 * passes: log-sum-exp, then dz = scale (softmax - onehot) and dxn += dz W);
 * RMSNorm, SwiGLU, RoPE and attention have their own kernels (attention:
 * FlashAttention-2's backward, Dao 2023, Alg. 2: a query-side pass for dq and
 * a key-side pass for dK/dV summed over the GQA group, probabilities
 * recomputed from the forward's log-sum-exp, never stored); dX = dY W through
 * cuBLAS (exactness mode: FP32, TF32 off; in the fast modes the backward
 * uses the same TF32 / BF16 GEMMs as the forward: Fisher ~3e-3 (TF32) /
 * ~1e-2 (BF16) relative L2 from the exact CPU's on SmolLM2-135M,
 * docs/BENCHMARKS.md). Callbacks run on the host with
 * pinned copies (grads: 3 [T][kv_dim] arrays per layer; upstream: x_out and
 * dx_out [T][dim] down and dx_out up again). Activation store: the CPU's
 * formula, 4 B * T * n_layers * (2 q_dim + 4 kv_dim + dim + 2 hidden_dim +
 * n_heads) + residual streams (1.4 GB for SmolLM2-135M at T = 2048; 13 GB
 * for a Llama-2-7B shape).
 *
 * Math modes:
 *  - KVQ_CUDA_EXACT (default): fp32 weights, cuBLAS SGEMM with
 *    CUBLAS_PEDANTIC_MATH (no TF32, no reduced-precision reductions), accurate
 *    expf/exp. Matches the CPU forward to ~1e-6 relative (logits), not
 *    bit-for-bit: summation orders differ.
 *  - KVQ_CUDA_TF32 (fast): the same with CUBLAS_TF32_TENSOR_OP_MATH; ~1e-3
 *    relative; label results "TF32".
 *  - KVQ_CUDA_BF16 (fast): the GEMM weights (projections, MLP, LM head and the
 *    token embedding) are stored as bf16 (round to nearest even at upload:
 *    half the device memory), each GEMM's activation input is rounded to
 *    bf16 on the fly, cublasGemmEx accumulates in fp32 and writes fp32; the
 *    rest (norms, RoPE, softmax, KV transforms) stays fp32. ~1e-2
 *    relative on logits; label results "BF16".
 *    Attention forward at head_dim 64 and 128 without alternative K/V
 *    (kq/vq: KIVI-style boundaries): a FlashAttention-2 kernel on tensor
 *    cores (cuda_attn_tc.cu): q (times the softmax scale), k, v and the
 *    probabilities rounded to bf16, S = QK^T and O = PV accumulated in fp32,
 *    online softmax and the log-sum-exp in fp32. Tolerance against the fp32
 *    kernel (gpu_check --attn, random inputs with scores of standard
 *    deviation ~2, prefixes, windows, GQA): output relative L2 <= 2e-2
 *    (measured 3.5e-3 .. 4.3e-3 on an H100) and |lse difference| <= 5e-2
 *    (measured 7.6e-3 .. 1.4e-2). The backward, the attention statistics
 *    (mass, entropy) and every other head_dim use the fp32 kernels; the
 *    backward recomputes probabilities from this forward's lse, so they sum
 *    to 1 within that tolerance.
 *    KVQ_ATTN_TC=0 in the environment keeps the fp32 attention forward in
 *    this mode (same-run comparisons); the describe line names the kernel
 *    (", attention bf16 tensor cores" / ", attention fp32 (KVQ_ATTN_TC=0)").
 *
 * Memory (device): weights fp32 (4 bytes per parameter; bf16 mode: 2 for the GEMM weights; LM head shared when
 * tied; whatever the host holds, model.h kvq_weights fp32, bf16 or GGUF blocks, is converted in row blocks at
 * upload; biases and norms fp32) + activations of max_T tokens (about max_T * (6 dim + 3 q_dim +
 * 7 kv_dim + 2 hidden_dim) floats) + the LM-head block [max_T][v_chunk]
 * (v_chunk = min(vocab, 2^28 / max_T) floats) + full logits [max_T][vocab]
 * allocated on the first run that asks for logits. An allocation failure
 * reports what was being allocated, the GPU's free memory and how to shrink it
 * (a smaller --ctx / max_T; --device cpu).
 *
 * Streams: one CUDA stream per workspace; kvq_forward_cuda_run returns when
 * its results are on the host. Not thread-safe per workspace; separate
 * workspaces may run concurrently on one GPU.
 *
 * How kveval / kvdump use it (see device.h for the CPU/GPU dispatch):
 *    kvq_forward_cuda *g;
 *    KVQ_TRY(kvq_forward_cuda_init(&g, &model, ctx, P, 0, KVQ_CUDA_EXACT, 0, err));
 *    KVQ_TRY(kvq_forward_cuda_set_kv(g, &desc, err));   // built-in scheme, or NULL
 *    kvq_fwd_io io = {.tokens = w, .T = ctx, .targets = tg, .prefix = px, .hooks = NULL};
 *    KVQ_TRY(kvq_forward_cuda_run(g, &io, &res, err));  // res.loss, res.n_scored as on the CPU
 *    kvq_forward_cuda_free(g);
 * A scheme without a descriptor passes its kvq_hooks in io.hooks instead
 * (host transform). In a build without CUDA every function fails with
 * KVQ_EUNSUPPORTED ("built without CUDA").
 */
#ifndef KVQ_FORWARD_CUDA_H
#define KVQ_FORWARD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "backward.h"
#include "forward.h"
#include "kv_desc.h"
#include "model.h"
#include "status.h"

typedef enum {
    KVQ_CUDA_EXACT = 0, /* fp32, TF32 off (exactness mode) */
    KVQ_CUDA_TF32 = 1,  /* fast mode: TF32 tensor cores for the GEMMs */
    KVQ_CUDA_BF16 = 2   /* fast mode: bf16 weights (half the memory), bf16 GEMM inputs, fp32 accumulation */
} kvq_cuda_math;

/* "exact (fp32)", "fast (TF32)", "fast (BF16)". */
const char *kvq_cuda_math_name(kvq_cuda_math m);
/* Parse "exact" | "tf32" | "bf16" (KVQ_EINVAL otherwise, naming the option `what`). */
kvq_status kvq_cuda_math_parse(const char *s, const char *what, kvq_cuda_math *out, kvq_err *err);

typedef struct kvq_forward_cuda kvq_forward_cuda; /* opaque */

/* Counters since init (for reports). */
typedef struct {
    uint64_t runs;
    uint64_t host_transforms;   /* layer calls whose transform ran on the host */
    uint64_t native_transforms; /* layer calls transformed on the GPU */
    uint64_t device_scheds;     /* layer calls whose per-key schedule (a declarative policy, forward.h kvq_sched_imp or kvq_sched_sel)
                                   ran on the GPU (kernels/cuda/cuda_sched.cuh) */
    uint64_t host_scheds;       /* layer calls whose per-key schedule ran on the host (kvq_attention_sched; also
                                   every schedule when the environment sets KVQ_SCHED_HOST=1) */
    uint64_t k_outliers, v_outliers; /* sparse outliers kept exact by native transforms */
    uint64_t k_clipped, v_clipped;   /* values saturated by native transforms (quant.h n_clipped) */
    double seconds;             /* wall time inside kvq_forward_cuda_run */
} kvq_cuda_stats;

/* Upload the model's weights to GPU `device` and allocate activations for
 * windows of up to max_T tokens after up to max_P prefix entries.
 * flags: KVQ_FWD_* (checkpoints and activations kept on the device).
 * Errors: KVQ_EUNSUPPORTED (no CUDA build / no device / head_dim not in
 * {8, 16, 32, 64, 128}), KVQ_ENOMEM (device memory: the message names the
 * buffer, its size and the free memory), KVQ_EIO (any other CUDA/cuBLAS
 * failure, with the call and its error string), KVQ_EINVAL (sizes). */
kvq_status kvq_forward_cuda_init(kvq_forward_cuda **out, const kvq_model *m, int max_T, int max_P, unsigned flags,
                                 kvq_cuda_math math, int device, kvq_err *err);
void kvq_forward_cuda_free(kvq_forward_cuda *g);

/* Select the native KV transform for the next runs (NULL or FP32 = none).
 * Validates (kvq_kv_desc_validate) and uploads the tables; the descriptor
 * itself is copied, its tables need not outlive the call. */
kvq_status kvq_forward_cuda_set_kv(kvq_forward_cuda *g, const kvq_kv_desc *d, kvq_err *err);

/* Run one window: kvq_forward_run's contract (forward.h), on the GPU. With a
 * native transform set, io->hooks->transform must be NULL (KVQ_EINVAL);
 * io->hooks->observe may be set. Errors: those of kvq_forward_run, plus
 * KVQ_EIO / KVQ_ENOMEM for device failures. */
kvq_status kvq_forward_cuda_run(kvq_forward_cuda *g, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err);

/* Pipeline stages (pipeline.h, pipeline_nccl.h): a workspace on GPU `device`
 * that holds only layers l0 .. l1-1 (plus the embedding table when l0 == 0,
 * the final norm and LM head when l1 == n_layers; tied embeddings are
 * uploaded to both ends when they are different stages); init with 0 ..
 * n_layers is kvq_forward_cuda_init. A partial stage keeps no checkpoints
 * (KVQ_FWD_SAVE_* refused with KVQ_EUNSUPPORTED: no GPU backward over a
 * pipeline yet). kvq_forward_cuda_stage runs the stage's layers of window io
 * from x_in (device memory of this GPU, [T][dim], the stream entering l0;
 * may be kvq_forward_cuda_stage_x(g), where a transport receives it; ignored
 * when l0 == 0); after it, kvq_forward_cuda_stage_x(g) holds the stream
 * leaving l1-1 (device memory, valid until the next run), and the last
 * stage's res/io outputs are kvq_forward_cuda_run's. kvq_forward_cuda_run is
 * kvq_forward_cuda_stage(g, io, NULL, ...): one code path. The stream
 * (a cudaStream_t) orders a transport's transfers with the stage's kernels. */
kvq_status kvq_forward_cuda_init_stage(kvq_forward_cuda **out, const kvq_model *m, int l0, int l1, int max_T, int max_P,
                                       unsigned flags, kvq_cuda_math math, int device, kvq_err *err);
kvq_status kvq_forward_cuda_stage(kvq_forward_cuda *g, const kvq_fwd_io *io, const float *x_in, kvq_fwd_result *res,
                                  kvq_err *err);
float *kvq_forward_cuda_stage_x(kvq_forward_cuda *g);
void *kvq_forward_cuda_stream(kvq_forward_cuda *g);
int kvq_forward_cuda_gpu(const kvq_forward_cuda *g);

/* kvq_forward_cuda_backward of a pipeline stage (the CPU's kvq_backward_stage_*):
 * _forward runs the stage's forward from x_in (device memory, as
 * kvq_forward_cuda_stage) keeping its activations (the workspace needs
 * KVQ_FWD_SAVE_ACTIVATIONS) and allocates the gradients; _backward then
 * differentiates layers l1-1 .. l0, from the cross-entropy on the last stage,
 * else from dx_in (device memory [T][dim], dL/d(stream leaving l1-1); may be
 * kvq_forward_cuda_stage_dx(g), where a transport receives it). Afterwards
 * kvq_forward_cuda_stage_dx(g) holds dL/d(stream entering l0) (device memory).
 * The grads callback sees the stage's layers; d_embd is written by the first
 * stage. kvq_forward_cuda_backward is the two on the whole model. */
kvq_status kvq_forward_cuda_backward_stage_forward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                   const float *x_in, kvq_bwd_result *res, kvq_err *err);
kvq_status kvq_forward_cuda_backward_stage_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                    const float *dx_in, kvq_bwd_result *res, kvq_err *err);
float *kvq_forward_cuda_stage_dx(kvq_forward_cuda *g);

/* Copy the residual stream entering layer l of the last successful run
 * (l = n_layers: entering the final norm) into out [T][dim] (host memory).
 * Errors: KVQ_EINVAL without KVQ_FWD_SAVE_LAYER_INPUTS, before any run, or
 * for l outside 0..n_layers; KVQ_EIO on a device failure. */
kvq_status kvq_forward_cuda_layer_input(kvq_forward_cuda *g, int l, float *out, kvq_err *err);

/* Forward (io with its hooks, prefix and the native transform set with
 * kvq_forward_cuda_set_kv) then backward of the loss in spec: the contract
 * of kvq_backward_run (backward.h), results to ~1e-6 of the CPU's (summation
 * order) in the exactness mode. The workspace must have KVQ_FWD_SAVE_ACTIVATIONS (else
 * KVQ_EINVAL). Errors: those of kvq_backward_run and kvq_forward_cuda_run. */
kvq_status kvq_forward_cuda_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                     kvq_bwd_result *res, kvq_err *err);
/* Wall seconds of the last backward: its forward, the LM-head pass, the layers. */
void kvq_forward_cuda_backward_times(const kvq_forward_cuda *g, double *forward_s, double *head_s, double *layers_s);

/* Counters; one-line description ("NVIDIA H200 (sm_90, 139.8 GiB), fp32
 * weights, cuBLAS FP32 pedantic (TF32 off, exactness mode)"). */
void kvq_forward_cuda_stats(const kvq_forward_cuda *g, kvq_cuda_stats *out);
void kvq_forward_cuda_describe(const kvq_forward_cuda *g, char *buf, size_t n);

/* Measure cuBLAS's SGEMM rate on `device`: n x n x n, median of reps, after
 * a warm-up, in FLOP/s (2 n^3 per GEMM), with the given math mode. Random
 * (non-zero) operands. For "fraction of the cuBLAS rate" reports. */
kvq_status kvq_cuda_sgemm_rate(int device, int n, int reps, kvq_cuda_math math, double *flops_per_s, kvq_err *err);

/* One causal GQA attention forward on `device` from host arrays, the forward's kernel for the math mode
 * (for gpu_check --attn): KVQ_CUDA_BF16 the bf16 tensor-core kernel where it applies (head_dim 64 or 128;
 * KVQ_ATTN_TC is not read here), every other mode (and other head dims) the fp32 kernel.
 * q [T][n_heads][head_dim], k, v [T][n_kv_heads][head_dim], pk, pv [P][n_kv_heads][head_dim] (NULL when
 * P = 0; prefix entry j at position j, window token t at pos0 + t); window > 0: a key is seen when its
 * position > the query's - window (attention.h kvq_attn_key_lo). Out: out [T][n_heads][head_dim], lse
 * [n_heads][T] (natural log of the sum of exp of the scaled scores; may be NULL). *ms (may be NULL): the
 * median kernel time in milliseconds of `reps` timed calls after one warm-up (CUDA events); 0 when
 * reps = 0. Errors: KVQ_EINVAL (shapes, head_dim not 8/16/32/64/128), KVQ_ENOMEM, KVQ_EIO (CUDA),
 * KVQ_EUNSUPPORTED (no CUDA build). */
typedef struct {
    int T, P, n_heads, n_kv_heads, head_dim, window, pos0;
} kvq_cuda_attn_shape;
kvq_status kvq_cuda_attention(int device, const kvq_cuda_attn_shape *s, kvq_cuda_math math, const float *q, const float *k,
                              const float *v, const float *pk, const float *pv, float *out, float *lse, int reps,
                              double *ms, kvq_err *err);

/* The CUDA forward's device path for a per-key schedule with a declarative policy (forward.h kvq_sched_imp,
 * kernels/cuda/cuda_sched.cuh) alone, on GPU `device` (for gpu_check --sched): q [T][n_heads][head_dim] and
 * the schedule's key representations post-RoPE, pk, pv [P][n_kv_heads][head_dim] (NULL when P = 0);
 * s->window and s->pos0 are ignored (no sliding window, as kvq_attention_sched). Out: out
 * [T][n_heads][head_dim]; the final switch times into sched->k_from and the realised counts into
 * sched->imp->counts, as kvq_attention_sched's steps leave them (the step is not called). ms (may be
 * NULL): [2] the device times of the policy kernel and of the output kernel, milliseconds (CUDA events); with
 * KVQ_SCHED_PRESCORE=1 in the environment the scores of all three representations are computed ahead of the
 * policy (as the forward does by default where they fit; included in the first time). Errors:
 * KVQ_EUNSUPPORTED (no declarative policy, a shape the device path does not take, no CUDA build),
 * KVQ_EINVAL, KVQ_ENOMEM, KVQ_EIO (CUDA).
 * A selection-form schedule with a declarative step (sched->sel, forward.h kvq_sched_sel: QAQ) takes the device's
 * selection path instead: the selections the last step left into sched->k_sel / v_sel, the realised counts into
 * sched->sel->counts and, when sched->sel->trace is set, the selection every query row read for every key; with
 * KVQ_SCHED_PRESCORE=1 the scores of every key representation are computed ahead of the policy. */
kvq_status kvq_cuda_attention_sched(int device, const kvq_cuda_attn_shape *s, const float *q, const float *pk,
                                    const float *pv, kvq_kv_sched *sched, float *out, double *ms, kvq_err *err);

#endif
