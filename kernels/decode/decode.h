/* decode.h — real token-by-token greedy decoding of the model with the packed
 * runtime KV cache (kernels/kvcache/kvcache.h) that a kvcalib artifact
 * configures: the decode engine behind kveval --task decode (docs/KVEVAL.md
 * "Real decoding").
 *
 * One step feeds one token of each of the B sequences (all at the same length
 * L, so at position L) through every layer with the CPU forward
 * (kernels/model/forward.h: the same projections, biases, q/k norms, RoPE of
 * the queries, output projection, SwiGLU MLP, final norm and LM head as every
 * other run of the model; the window's rows are the B sequences), and in each
 * layer, through the forward's attend hook (kvq_hooks.attend):
 *   - kvq_kvcache_append of the layer's new pre-RoPE keys k_pre and values v
 *     [B][n_kv_heads][head_dim] (row b to sequence b): NUQ keys are quantized
 *     pre-RoPE with the artifact's per-channel thresholds and levels, values
 *     per token online, dense-and-sparse outliers, the first n_sink positions
 *     in fp16; KIVI keys post-RoPE (the cache rotates them) in G-token groups,
 *     values per token, an fp16 residual of R tokens;
 *   - kvq_kvcache_attend of the post-RoPE queries [B][n_heads][head_dim] over
 *     each sequence's cache (RoPE applied to NUQ keys after dequantization,
 *     scores, softmax and weighted sum in double), which is the layer's
 *     attention output.
 * Prefill: token by token through the same step (decode-equivalent by
 * construction; the prompt's K/V enter the cache exactly as generated tokens'
 * do). Greedy: the next token is the first index of the largest logit
 * (llama.cpp's top token, as kveval's passkey task).
 *
 * Schemes: those whose family has a packed-cache format (family.h
 * `kvcache_config`: nuq, kivi). nuq reads its tables from the scheme's
 * artifact (kvq_kvcache_config_from_artifact, layer by layer); kivi takes G, R
 * and the bits from the spec. The spec's attention sink (+sink<N>, default the
 * artifact's) is the cache's n_sink. Refused with the rule named
 * (KVQ_EUNSUPPORTED): other families, +intactkv, +hadamard / +rht (the cache
 * has no rotation), a key stage the format does not quantize (kivi +pre-rope),
 * models with sliding-window layers (the cache attends every position), RoPE
 * scaling other than none / linear (the cache's kvq_rope), head_dim above
 * KVQ_KVCACHE_MAX_HEAD_DIM.
 *
 * Relation to kveval's simulation of the same scheme (a batched window with
 * the scheme's transform, decode-equivalent, kernels/schemes/scheme.h): the
 * cache holds what the simulation attends, except that (kvcache.h
 * "Semantics") every value the cache keeps at 16 bits (sink rows, sparse
 * outliers, KIVI's residual window) is rounded to fp16, RoPE of the keys is
 * computed in double from the dequantized key (the forward: float cos/sin
 * tables), and attention runs in double (the forward: fp32). For an fp32
 * model the logits therefore agree to a tolerance, not bit for bit
 * (tests/test_decode.c states it).
 *
 * Devices: the CPU (kvq_kvcache, kvq_forward) or one GPU (kvq_decoder_init_on:
 * kvq_kvcache_cuda, the CUDA forward in its exact mode, the same attend hook
 * with device pointers, the B sequences' new tokens appended in one
 * kvq_kvcache_cuda_append_step per layer, which needs no host synchronisation
 * in the steady state; the logits come back to the host every step). The
 * GPU cache attends in fp32 with P·V on the tensor cores (kvcache_cuda.h:
 * ~1e-4..5e-4 relative against the CPU cache), so GPU and CPU decoding agree
 * to that rounding, and then as far as quantization-code flips let them
 * (tests/gpu/gpu_check.c --decode).
 *
 * Memory: per layer one cache of capacity max_tokens positions for each of the
 * B sequences; a forward workspace for B rows; logits [B][vocab].
 * Not thread-safe: one decoder per thread.
 */
#ifndef KVQ_DECODE_H
#define KVQ_DECODE_H

#include <stdbool.h>
#include <stddef.h>

#include "device.h"
#include "forward.h"
#include "forward_cuda.h"
#include "kvcache.h"
#include "kvcache_cuda.h"
#include "model.h"
#include "progress.h"
#include "scheme.h"
#include "status.h"

/* The rules of the header that the spec alone decides (a family with a packed format, key and value bits 2..4, no
 * +intactkv, no rotation, no sliding-window layer, RoPE scaling none / linear for pre-RoPE keys), before any artifact
 * is read: 0 or
 * KVQ_EUNSUPPORTED naming the rule (name: the scheme as the user wrote it). kvq_decoder_cache_config applies them
 * too. */
kvq_status kvq_decoder_spec_check(const kvq_scheme_spec *sp, const char *name, const kvq_hparams *hp, kvq_err *err);

/* The packed-cache configuration of a bound scheme for `layer` of a model
 * with hyperparameters hp (n_seqs and max_tokens left 0; table pointers
 * borrowed from the scheme's artifact). Errors: KVQ_EUNSUPPORTED naming the
 * rule (see the header), KVQ_EINVAL for an artifact that disagrees with the
 * spec, those of kvq_kvcache_config_from_artifact. */
kvq_status kvq_decoder_cache_config(const kvq_eval_scheme *s, const kvq_hparams *hp, size_t layer, kvq_kvcache_config *cfg,
                                    kvq_err *err);

/* kvq_decoder_init flag (beside KVQ_FWD_ROW_INVARIANT): the layer's new values, and pre-RoPE keys where the
 * format quantizes them (NUQ), are rounded to fp16 before they are appended, as an fp16 model's K/V would be
 * (then the cache's own fp16 storage of sink rows, outliers and KIVI's residual changes nothing: the checks
 * against the simulation can be tight; kvq_decode_sim_logits rounds the same way). */
#define KVQ_DECODE_KV_FP16 (1u << 12)
/* kvq_decoder_init flag, a diagnostic (CPU only): attend with the forward's own fp32 attention (kvq_attention, the
 * simulation's kernel) over what the cache holds (kvq_kvcache_dequant: the dequantized keys rotated by the cache,
 * outliers and fp16 rows substituted) instead of the cache's decode attention (kvq_kvcache_attend, in double). It
 * separates the cache's contents from its attention arithmetic when the decode and the simulation part. */
#define KVQ_DECODE_DEQUANT_ATTN (1u << 13)

typedef struct {
    const kvq_model *m;
    kvq_device dev;         /* KVQ_DEVICE_CPU or KVQ_DEVICE_CUDA */
    size_t n_seqs;          /* B */
    size_t max_tokens;      /* positions per sequence (cache capacity) */
    kvq_kvcache **cache;    /* [n_layers] (CPU) */
    kvq_forward fw;         /* B rows (CPU) */
    kvq_kvcache_cuda **gcache; /* [n_layers] (CUDA) */
    kvq_forward_cuda *gpu;  /* B rows (CUDA) */
    size_t len;             /* positions every sequence holds */
    bool post_rope;         /* the format quantizes post-RoPE keys (KIVI): appended as the model rotated them */
    int *pos;               /* [B] positions of the current step's rows */
    int *targets;           /* [B] all -1 (no loss) */
    float *logits;          /* [B][vocab] of the last step */
    bool kv_fp16;           /* KVQ_DECODE_KV_FP16 */
    bool dequant_attn;      /* KVQ_DECODE_DEQUANT_ATTN */
    kvq_attn_ws aws;        /* its workspace: one query after max_tokens - 1 prefix keys */
    float *dk, *dv;         /* [max_tokens][kv_dim] its dequantized K/V of one sequence */
    float *kbuf, *vbuf;     /* [B][kv_dim] rounded copies (kv_fp16, CPU) */
    float *kbuf_dev, *vbuf_dev; /* the same in device memory (kv_fp16, CUDA) */
    double seconds;         /* wall time of the steps so far */
    size_t steps;           /* steps so far */
} kvq_decoder;

/* An empty decoder for n_seqs sequences of up to max_tokens positions each
 * (max_tokens <= the model's context length) under scheme s, which must
 * outlive it. fwd_flags: KVQ_FWD_ROW_INVARIANT makes every sequence's
 * activations independent of B (tests), KVQ_DECODE_KV_FP16, KVQ_DECODE_DEQUANT_ATTN (above); 0 otherwise. Errors: KVQ_EINVAL
 * (n_seqs 0, max_tokens 0 or beyond the context), KVQ_EUNSUPPORTED
 * (kvq_decoder_cache_config), KVQ_ENOMEM. */
kvq_status kvq_decoder_init(kvq_decoder *d, const kvq_model *m, const kvq_eval_scheme *s, size_t n_seqs, size_t max_tokens,
                            unsigned fwd_flags, kvq_err *err);
/* The same on a device: KVQ_DEVICE_CPU is kvq_decoder_init; KVQ_DEVICE_CUDA on
 * GPU `gpu` (the N of cuda:N), KVQ_FWD_ROW_INVARIANT ignored, KVQ_DECODE_KV_FP16
 * rounding on the device (kvq_cuda_round_fp16, the CPU's rule), KVQ_DECODE_DEQUANT_ATTN
 * refused (KVQ_EUNSUPPORTED: CPU only). In a build without CUDA: KVQ_EUNSUPPORTED. */
kvq_status kvq_decoder_init_on(kvq_decoder *d, kvq_device dev, int gpu, const kvq_model *m, const kvq_eval_scheme *s,
                               size_t n_seqs, size_t max_tokens, unsigned fwd_flags, kvq_err *err);
void kvq_decoder_free(kvq_decoder *d);

/* Current length of every sequence (they advance together). */
size_t kvq_decoder_len(const kvq_decoder *d);

/* One step: tokens[b] of sequence b at position kvq_decoder_len(d) through
 * the model and the caches; d->logits [B][vocab] receives the next-token
 * logits. Errors: KVQ_EINVAL (token outside the vocabulary, the sequences
 * full: length max_tokens), the cache's (KVQ_ENOMEM outlier store limit,
 * non-finite K/V), the forward's. After an error the caches may hold the
 * step's token in some layers only: free the decoder. */
kvq_status kvq_decoder_step(kvq_decoder *d, const int *tokens, kvq_err *err);

/* The first index of the largest of x[0..n) (NaN never wins). */
int kvq_decoder_argmax(const float *x, size_t n);

/* Greedy generation from empty caches: prompts [B][P] (P >= 1) go in token by
 * token; out [B][steps] receives the generated tokens (out[b][0] = the argmax
 * after the last prompt token, out[b][s] the argmax after feeding
 * out[b][s-1]); logits, when non-NULL, [B][steps][vocab] the logits each was
 * chosen from. P + steps - 1 <= max_tokens. prefill_s / decode_s (optional):
 * wall seconds of the P prompt steps and of the steps - 1 decode steps. prog
 * (optional) counts the P + steps - 1 steps on from its current `done`. Errors: KVQ_EINVAL (P or steps 0, too long, caches
 * not empty), kvq_decoder_step's. */
kvq_status kvq_decoder_generate(kvq_decoder *d, const int *prompts, size_t P, size_t steps, int *out, float *logits,
                                double *prefill_s, double *decode_s, kvq_progress *prog, kvq_err *err);

/* Bytes of the caches now (all layers and sequences): packed = what an
 * attention pass reads (kvq_kvcache_stats bytes_k + bytes_v: codes, scales,
 * sparse outliers, fp16 rows; tables excluded; on the GPU
 * kvq_kvcache_cuda_bytes_read), fp16 = an fp16 K and V cache
 * of the same positions (n_layers * tokens * kv_dim * 2 * 2). */
void kvq_decoder_bytes(const kvq_decoder *d, size_t *packed, size_t *fp16);

#endif
