/* decode_plan.h — the memory planner of tests/gpu/bench_decode_step.c (header only, host C, no CUDA):
 * the device bytes a decode step of a Llama-2-7B-shaped model needs for its bf16 weights and for one
 * KV cache per layer (fp16, or the packed NUQ / KIVI cache of kernels/kvcache/kvcache_cuda.h), and
 * the longest context that fits a given number of free bytes. Tested on the CPU by
 * tests/test_decode_plan.c against the allocation sizes a CPU kvq_kvcache reports (kvq_kvcache_view),
 * which has the GPU cache's layout (formats/KVCACHE.md).
 *
 * Cache bytes (per layer; B sequences, H KV heads, D = head_dim, C = H·D, T = capacity in positions,
 * n_exact = max(n_sink, prefix_len), capq = T − n_exact rounded up to 32, ne = max(n_exact, 1)):
 *  - fp16: 2 · B · H · T · D · 2 (post-RoPE keys and values, [B][H][T][D] half, kvq_fp16_cache);
 *  - NUQ (kvq_kvcache_cuda_create): fp16 exact rows 2 · B·H·ne·D·2, key and value codes
 *    B·H·capq·(kw + vw)·4 (kw, vw = kvq_kvcache_head_words), sparse row pointers 2 · B·H·(capq+1)·4,
 *    sparse entries 2 · B·H·ent_cap·4, value scales B·capq·2·4; tables (LUT, levels, thresholds, RoPE)
 *    are counted too (small);
 *  - KIVI: exact rows as NUQ, codes as NUQ, value scales B·capq·(C/G)·2·4, key scales
 *    B·(capq/G + 1)·C·2·4, residual rings 2 · B·ring·C·2 with ring = max(R, F) + 2, F = R or G when R = 0.
 * Not counted: the attention's split-K partials and the append scratch (grown on first use; a few MB to
 * ~100 MB at B = 32), which the caller's margin covers. */
#ifndef KVQ_DECODE_PLAN_H
#define KVQ_DECODE_PLAN_H

#include <stddef.h>
#include <stdint.h>

/* A Llama-family shape (Llama-2-7B: 32 layers, d_model 4096, 32 heads of 128, 32 KV heads, FFN 11008,
 * vocab 32000). */
typedef struct {
    size_t n_layers, dim, n_heads, n_kv_heads, head_dim, ffn, vocab;
} kvq_dp_model;

static inline kvq_dp_model kvq_dp_llama2_7b(void) { return (kvq_dp_model){32, 4096, 32, 32, 128, 11008, 32000}; }

/* bf16 weights: per layer Wq, Wk, Wv, Wo, W_gate, W_up, W_down; token embedding and LM head (untied);
 * plus fp32 RMSNorm gains (2 per layer, 1 final). */
static inline uint64_t kvq_dp_weight_params(const kvq_dp_model *m)
{
    const uint64_t d = m->dim, q = m->n_heads * m->head_dim, kv = m->n_kv_heads * m->head_dim;
    const uint64_t layer = d * q + 2 * d * kv + q * d + 3 * d * m->ffn;
    return m->n_layers * layer + 2 * (uint64_t)m->vocab * d;
}
static inline uint64_t kvq_dp_weight_bytes(const kvq_dp_model *m)
{
    return 2 * kvq_dp_weight_params(m) + 4 * (uint64_t)m->dim * (2 * m->n_layers + 1);
}
/* the bytes of weights one decode step reads (every GEMM weight; the embedding only for B rows) */
static inline uint64_t kvq_dp_weight_bytes_read(const kvq_dp_model *m, size_t B)
{
    return kvq_dp_weight_bytes(m) - 2 * (uint64_t)m->vocab * m->dim + 2 * (uint64_t)B * m->dim;
}

typedef enum { KVQ_DP_FP16 = 0, KVQ_DP_NUQ, KVQ_DP_KIVI } kvq_dp_format;

/* One cache per layer. bits: NUQ/KIVI key and value bits (2, 3, 4; KIVI 2 or 4). n_sink: fp16 exact
 * rows (NUQ attention sink; KIVI 0). ent_cap: NUQ sparse entries per (sequence, KV head) (see
 * kvq_dp_ent_cap). group, residual: KIVI G and R. */
typedef struct {
    kvq_dp_format format;
    int bits;
    size_t n_sink, ent_cap, group, residual;
} kvq_dp_cache;

/* words per (token, head) of b-bit codes at head_dim D: as kvq_kvcache_head_words (2-bit: 16 channels a word,
 * 4-bit: 8, 3-bit: 32 channels in 3 words) */
static inline uint64_t kvq_dp_head_words(int bits, size_t D)
{
    return bits == 2 ? (D + 15) / 16 : bits == 4 ? (D + 7) / 8 : bits == 3 ? (D + 31) / 32 * 3 : 0;
}

/* The sparse-entry capacity bench_decode_step.c gives a NUQ cache filled to N positions with per_row entries per
 * (token, head) row and then appended `extra` tokens: N·per_row plus 64 per appended token (the appended
 * tokens' keys and values are real activations: 1% outliers per side over kv_dim = 4096 channels are 41 per
 * token, ~1.3 a head on average, so 64 a head keeps the store from growing mid-timing). */
static inline size_t kvq_dp_ent_cap(size_t N, size_t per_row, size_t extra) { return N * per_row + 64 * extra + 64; }

/* device bytes of one layer's cache of capacity T positions for B sequences: the arrays that grow with B and T
 * (kvq_dp_cache_array_bytes) and the tables (kvq_dp_cache_table_bytes: per-channel LUT, levels, thresholds, zero
 * codes, RoPE tables, lengths) */
static inline uint64_t kvq_dp_cache_array_bytes(const kvq_dp_model *m, const kvq_dp_cache *c, size_t B, size_t T)
{
    const uint64_t H = m->n_kv_heads, D = m->head_dim, C = H * D;
    if (c->format == KVQ_DP_FP16) return 2ull * B * H * T * D * 2;
    const uint64_t ne0 = c->n_sink, ne = ne0 ? ne0 : 1, capq = (T - ne0 + 31) / 32 * 32;
    const uint64_t w = kvq_dp_head_words(c->bits, (size_t)D);
    uint64_t b = 2ull * B * H * ne * D * 2 + 2ull * B * H * capq * w * 4;
    if (c->format == KVQ_DP_NUQ)
        return b + 2ull * B * H * (capq + 1) * 4 + 2ull * B * H * (c->ent_cap ? c->ent_cap : 1) * 4 + (uint64_t)B * capq * 2 * 4;
    const uint64_t G = c->group, F = c->residual ? c->residual : G, ring = (F > c->residual ? F : c->residual) + 2;
    return b + (uint64_t)B * capq * (C / G) * 2 * 4 + (uint64_t)B * (capq / G + 1) * C * 2 * 4 + 2ull * B * ring * C * 2;
}
static inline uint64_t kvq_dp_cache_table_bytes(const kvq_dp_model *m, const kvq_dp_cache *c, size_t B, size_t T)
{
    if (c->format == KVQ_DP_FP16) return 0;
    const uint64_t H = m->n_kv_heads, D = m->head_dim, C = H * D, nl = 1ull << c->bits, np = (D + 1) / 2, nhi = T / 64 + 4;
    uint64_t b = 4 * (uint64_t)B + np * 64 * 8 + nhi * np * 8 + np * 8; /* lengths [4][B] int; RoPE tables (float2), inv_freq */
    if (c->format == KVQ_DP_NUQ) b += C * nl * 4 + 2 * H * nl * 4 + 2 * C * 4 + 2 * H; /* key LUT, levels, thresholds, zero codes */
    return b;
}
static inline uint64_t kvq_dp_cache_bytes(const kvq_dp_model *m, const kvq_dp_cache *c, size_t B, size_t T)
{
    return kvq_dp_cache_array_bytes(m, c, B, T) + kvq_dp_cache_table_bytes(m, c, B, T);
}

/* all n_layers caches */
static inline uint64_t kvq_dp_caches_bytes(const kvq_dp_model *m, const kvq_dp_cache *c, size_t B, size_t T)
{
    return m->n_layers * kvq_dp_cache_bytes(m, c, B, T);
}

/* Does a row fit: weights already resident, `free_bytes` left on the device, the caches of capacity T plus
 * `margin` bytes (activations, partials, cuBLAS workspace). */
static inline int kvq_dp_fits(const kvq_dp_model *m, const kvq_dp_cache *c, size_t B, size_t T, uint64_t free_bytes,
                              uint64_t margin)
{
    return kvq_dp_caches_bytes(m, c, B, T) + margin <= free_bytes;
}

/* The longest context N (a multiple of `step`, >= step) whose caches of capacity N + extra fit (kvq_dp_fits), the
 * NUQ entry capacity following N as kvq_dp_ent_cap(N, per_row, extra); 0 when not even `step` fits. Bisection on
 * the multiples of step up to max_n (the bytes grow with N). */
static inline size_t kvq_dp_longest(const kvq_dp_model *m, kvq_dp_cache c, size_t B, size_t extra, size_t per_row,
                                    uint64_t free_bytes, uint64_t margin, size_t step, size_t max_n)
{
    size_t lo = 0, hi = max_n / step; /* lo fits (0 = none), hi + 1 does not */
    while (lo < hi) {
        const size_t mid = lo + (hi - lo + 1) / 2, N = mid * step;
        if (c.format == KVQ_DP_NUQ) c.ent_cap = kvq_dp_ent_cap(N, per_row, extra);
        if (kvq_dp_fits(m, &c, B, N + extra, free_bytes, margin)) lo = mid;
        else hi = mid - 1;
    }
    return lo * step;
}

#endif
