/* kv_desc.h — a bound scheme as the engines run it (kvq_kv_desc, family.h):
 * the CPU forward through a kvq_hooks.transform callback, the CUDA forward
 * natively (kernels/cuda/forward_cuda.h) when the family has a CUDA part, the
 * runtime-cache reference and kvstat through the family's quantize. One
 * description, one implementation per family (kernels/schemes/<family>.c).
 *
 * Per layer and window, on the window's rows k, v [T][kv_dim] (kv_dim =
 * n_kv_heads * head_dim, row-major fp32; keys in d->key_stage), the
 * transform is the family's (family.h, "the cache-simulation contract"):
 * in place by default (quantize of both sides), or an alternative with
 * per-query boundaries (KIVI), or a per-key schedule (heavy hitters).
 * With a rotation (d->rot, +hadamard / +rht; hadamard.h) every head vector
 * of k and v is rotated before the family's transform and every output
 * un-rotated after it; kvq_kv_desc_quantize likewise. Rotation is per token
 * and orthonormal: decode equivalence and the bits are unchanged.
 */
#ifndef KVQ_KV_DESC_H
#define KVQ_KV_DESC_H

#include <stdbool.h>

#include "family.h"
#include "forward.h"
#include "status.h"

/* Check the descriptor against the model shape: kvq_scheme_validate, the
 * family's model checks (group sizes that divide kv_dim / head_dim, block
 * sizes) and tables (present, finite, ascending levels of the right bit
 * width). Errors (KVQ_EINVAL; KVQ_EUNSUPPORTED where the format cannot apply)
 * name the layer and field. */
kvq_status kvq_kv_desc_validate(const kvq_kv_desc *d, const kvq_hparams *hp, kvq_err *err);

/* True when the descriptor leaves K/V unchanged (fp32 without a rotation, or no family). */
bool kvq_kv_desc_is_identity(const kvq_kv_desc *d);

/* The native CUDA transform the GPU forward runs for d: the family's `cuda` part, or NULL (no
 * such part, or a rotated descriptor: +hadamard / +rht run as the host transform, which rotates
 * around the family's CPU transform; the simple correct choice, no device rotation kernel). */
const kvq_family_cuda *kvq_kv_desc_cuda(const kvq_kv_desc *d);

/* Canonical short label, e.g. "int4-g64", "kivi2-g32-r128", "nuq4-1%+sink1", "q4_0+hadamard". */
void kvq_kv_desc_name(const kvq_kv_desc *d, char *buf, size_t n);

/* The per-query boundaries of a family whose transform gives alternatives
 * (KIVI), kb/vb [T] (both <= i + 1, as attention.h requires); false (nothing
 * written) for other families. Shared by the CPU hook and the CUDA forward. */
bool kvq_kv_desc_alt_bounds(const kvq_kv_desc *d, size_t T, int *kb, int *vb);

/* Per-run state (family.h kvq_kv_desc_run): init before the first transform,
 * free after the last (families with state allocate in init or lazily). */
kvq_status kvq_kv_desc_run_init(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_err *err);
void kvq_kv_desc_run_free(kvq_kv_desc_run *run);

/* The CPU transform callback (kvq_hooks.transform signature; user is a
 * kvq_kv_desc_run): the family's transform, or its quantize in place. */
kvq_status kvq_kv_desc_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt,
                                 kvq_err *err);

/* One side ('k' or 'v') of one layer through the family's quantize: what the
 * cache holds at rest (kvstat's error, the runtime-cache reference). */
kvq_status kvq_kv_desc_quantize(const kvq_kv_desc *d, int layer, char side, float *out, const float *in, size_t n_tokens,
                                size_t kv_dim, size_t head_dim, kvq_quant_counts *c, kvq_err *err);

/* Tokens per step of a family that runs windows in steps (family.h chunk; 0 = whole windows). */
int kvq_kv_desc_chunk(const kvq_kv_desc *d);
/* The kvq_hooks.cache callback (user is a kvq_kv_desc_run): the family's cache of the first P tokens. */
kvq_status kvq_kv_desc_cache(void *user, int P, kvq_prefix *out, kvq_err *err);

/* hooks = {transform = kvq_kv_desc_transform, user = run, key_stage = d->key_stage};
 * chunk, cache = the family's (kvq_kv_desc_chunk, kvq_kv_desc_cache);
 * an identity descriptor gives no transform at all. run->d is set; its
 * counters and state are left as they are (call kvq_kv_desc_run_init first). */
void kvq_kv_desc_hooks(kvq_kv_desc_run *run, const kvq_kv_desc *d, kvq_hooks *hooks);

/* Descriptor views of an artifact's per-layer tables: *out = [n_layers]
 * (pointers into a; zeroed where it has none), owned by the caller (free). */
kvq_status kvq_kv_layer_tables_view(const kvq_artifact *a, kvq_kv_layer_tables **out, kvq_err *err);

/* The artifact's own scheme as a descriptor: the family and its parameters
 * from the artifact (family.h from_params), keys as the artifact says
 * (post-RoPE for families whose artifacts are post-RoPE only), the artifact's
 * rotation (kvcalib --rotate), tables viewed
 * from it (*tables is owned by the caller: free). Errors: KVQ_EUNSUPPORTED
 * for a method that has no scheme of its own. Not validated against a model
 * (kvq_kv_desc_validate). */
kvq_status kvq_kv_desc_from_artifact(const kvq_artifact *a, kvq_kv_desc *d, kvq_kv_layer_tables **tables, kvq_err *err);

#endif
