/* kvcache.c — packed low-bit KV cache, CPU reference; see kvcache.h and
 * formats/KVCACHE.md. */
#include "kvcache.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "half.h"
#include "safetensors.h" /* kvq_f32_to_f16, kvq_f16_to_f32 */

struct kvq_kvcache {
    kvq_kvcache_config cfg;
    size_t C, n_exact, capq, kw, vw, ring, ent_cap, k_per_side;
    size_t *len, *kq, *vq;
    uint16_t *k16, *v16;
    uint32_t *kcodes, *vcodes;
    float *vscale, *kscale;
    float *klut, *vlevels, *klevels_copy, *k_lower, *k_upper;
    uint8_t *k_zcode, *v_zcode;
    uint32_t *krow, *vrow, *kent, *vent;
    uint16_t *kring, *vring;
    double *inv_freq;
    bool *prefix_set;
};

/* ---- packing ------------------------------------------------------------- */

size_t kvq_kvcache_unit_channels(int bits) { return bits == 2 ? 16 : bits == 3 ? 32 : bits == 4 ? 8 : 0; }
size_t kvq_kvcache_unit_words(int bits) { return bits == 3 ? 3 : (bits == 2 || bits == 4) ? 1 : 0; }
size_t kvq_kvcache_head_words(int bits, size_t head_dim)
{
    size_t uc = kvq_kvcache_unit_channels(bits);
    if (!uc) return 0;
    return (head_dim + uc - 1) / uc * kvq_kvcache_unit_words(bits);
}

void kvq_kvcache_pack(uint32_t *words, const uint8_t *codes, size_t n, int bits)
{
    size_t nw = kvq_kvcache_head_words(bits, n), uc = kvq_kvcache_unit_channels(bits),
           uw = kvq_kvcache_unit_words(bits);
    memset(words, 0, nw * sizeof *words);
    for (size_t j = 0; j < n; j++) {
        size_t u = j / uc, bit = (j % uc) * (size_t)bits;
        uint32_t *w = words + u * uw;
        uint64_t v = (uint64_t)(codes[j] & ((1u << bits) - 1)) << (bit % 32);
        w[bit / 32] |= (uint32_t)v;
        if ((bit % 32) + (size_t)bits > 32) w[bit / 32 + 1] |= (uint32_t)(v >> 32);
    }
}

void kvq_kvcache_unpack(uint8_t *codes, const uint32_t *words, size_t n, int bits)
{
    size_t uc = kvq_kvcache_unit_channels(bits), uw = kvq_kvcache_unit_words(bits);
    for (size_t j = 0; j < n; j++) {
        size_t u = j / uc, bit = (j % uc) * (size_t)bits;
        const uint32_t *w = words + u * uw;
        uint64_t v = w[bit / 32];
        if ((bit % 32) + (size_t)bits > 32) v |= (uint64_t)w[bit / 32 + 1] << 32;
        codes[j] = (uint8_t)((v >> (bit % 32)) & ((1u << bits) - 1));
    }
}

/* ---- RoPE ------------------------------------------------------------------ */

static kvq_status rope_check(const kvq_rope *r, size_t head_dim, kvq_err *err)
{
    if (!r) return kvq_fail(err, KVQ_EINVAL, "rope: NULL");
    if (r->rope_dim % 2 || r->rope_dim > head_dim)
        return kvq_fail(err, KVQ_EINVAL, "rope_dim: expected an even value <= head_dim %zu, found %zu", head_dim, r->rope_dim);
    if (r->rope_dim && !(r->rope_theta > 0 && isfinite(r->rope_theta)))
        return kvq_fail(err, KVQ_EINVAL, "rope_theta: expected > 0, found %g", r->rope_theta);
    if (!(r->scale >= 0 && isfinite(r->scale)))
        return kvq_fail(err, KVQ_EINVAL, "rope scale: expected >= 0 (0 = none), found %g", r->scale);
    return KVQ_OK;
}

static double rope_inv_freq(const kvq_rope *r, size_t i)
{
    double f = pow(r->rope_theta, -2.0 * (double)i / (double)r->rope_dim);
    return r->scale > 0 ? f / r->scale : f;
}

kvq_status kvq_rope_rotate(float *x, size_t n_rows, size_t n_heads, size_t head_dim,
                           const kvq_rope *rope, size_t pos0, kvq_err *err)
{
    KVQ_TRY(rope_check(rope, head_dim, err));
    size_t np = rope->rope_dim / 2;
    for (size_t i = 0; i < np; i++) {
        double f = rope_inv_freq(rope, i);
        for (size_t t = 0; t < n_rows; t++) {
            double a = (double)(pos0 + t) * f, cs = cos(a), sn = sin(a);
            for (size_t h = 0; h < n_heads; h++) {
                float *p = x + (t * n_heads + h) * head_dim + 2 * i;
                double u = p[0], w = p[1];
                p[0] = (float)(u * cs - w * sn);
                p[1] = (float)(u * sn + w * cs);
            }
        }
    }
    return KVQ_OK;
}

/* ---- configuration ----------------------------------------------------------- */

kvq_status kvq_kvcache_config_validate(const kvq_kvcache_config *c, kvq_err *err)
{
    if (!c) return kvq_fail(err, KVQ_EINVAL, "kvcache config: NULL");
    if (c->format != KVQ_KVCACHE_NUQ && c->format != KVQ_KVCACHE_KIVI)
        return kvq_fail(err, KVQ_EINVAL, "format: unknown value %d", (int)c->format);
    if (c->n_seqs == 0) return kvq_fail(err, KVQ_EINVAL, "n_seqs: expected >= 1, found 0");
    if (c->n_kv_heads == 0) return kvq_fail(err, KVQ_EINVAL, "n_kv_heads: expected >= 1, found 0");
    if (c->head_dim == 0 || c->head_dim > KVQ_KVCACHE_MAX_HEAD_DIM)
        return kvq_fail(err, KVQ_EINVAL, "head_dim: expected 1..%d, found %zu", KVQ_KVCACHE_MAX_HEAD_DIM, c->head_dim);
    if (c->n_kv_heads > 65535) return kvq_fail(err, KVQ_EINVAL, "n_kv_heads: expected <= 65535, found %zu", c->n_kv_heads);
    if (c->max_tokens == 0 || c->max_tokens > ((size_t)1 << 31))
        return kvq_fail(err, KVQ_EINVAL, "max_tokens: expected 1..2^31, found %zu", c->max_tokens);
    for (int kv = 0; kv < 2; kv++) {
        int b = kv ? c->v_bits : c->k_bits;
        if (b != 2 && b != 3 && b != 4)
            return kvq_fail(err, KVQ_EUNSUPPORTED, "%s: the packed cache supports 2, 3 or 4 bits, found %d", kv ? "v_bits" : "k_bits", b);
    }
    size_t n_exact = c->n_sink > c->prefix_len ? c->n_sink : c->prefix_len;
    if (n_exact >= c->max_tokens)
        return kvq_fail(err, KVQ_EINVAL, "n_sink %zu / prefix_len %zu: expected < max_tokens %zu", c->n_sink, c->prefix_len, c->max_tokens);
    KVQ_TRY(rope_check(&c->rope, c->head_dim, err));
    size_t C = c->n_kv_heads * c->head_dim;
    if (c->format == KVQ_KVCACHE_NUQ) {
        if (!(c->outlier_frac >= 0 && c->outlier_frac < 0.5))
            return kvq_fail(err, KVQ_EINVAL, "outlier_frac: expected [0, 0.5), found %g", c->outlier_frac);
        if (!c->k_levels || !c->v_levels || !c->k_lower || !c->k_upper)
            return kvq_fail(err, KVQ_EINVAL, "nuq cache: k_levels, v_levels, k_lower and k_upper are required");
        for (int kv = 0; kv < 2; kv++) {
            size_t nt = kv ? c->v_tables : c->k_tables;
            if (nt != 1 && nt != c->n_kv_heads)
                return kvq_fail(err, KVQ_EINVAL, "%s: expected 1 or n_kv_heads %zu, found %zu", kv ? "v_tables" : "k_tables", c->n_kv_heads, nt);
            const float *lv = kv ? c->v_levels : c->k_levels;
            size_t nl = (size_t)1 << (kv ? c->v_bits : c->k_bits);
            for (size_t j = 0; j < nt * nl; j++)
                if (!isfinite(lv[j]) || lv[j] < -1 || lv[j] > 1 || (j % nl && lv[j] < lv[j - 1]))
                    return kvq_fail(err, KVQ_EINVAL, "%s[%zu][%zu]: expected finite, ascending, in [-1, 1], found %g",
                                    kv ? "v_levels" : "k_levels", j / nl, j % nl, (double)lv[j]);
        }
        for (size_t i = 0; i < C; i++)
            if (!isfinite(c->k_lower[i]) || !isfinite(c->k_upper[i]) || c->k_lower[i] > c->k_upper[i])
                return kvq_fail(err, KVQ_EINVAL, "channel %zu: thresholds must be finite with lower <= upper, found [%g, %g]",
                                i, (double)c->k_lower[i], (double)c->k_upper[i]);
    } else {
        if (c->group == 0 || c->head_dim % c->group)
            return kvq_fail(err, KVQ_EINVAL, "group: expected a divisor of head_dim %zu, found %zu", c->head_dim, c->group);
        if (c->residual % c->group)
            return kvq_fail(err, KVQ_EINVAL, "residual: expected a multiple of group %zu, found %zu", c->group, c->residual);
    }
    return KVQ_OK;
}

/* ---- create / free ------------------------------------------------------------- */

void kvq_kvcache_free(kvq_kvcache *c)
{
    if (!c) return;
    free(c->len); free(c->kq); free(c->vq);
    free(c->k16); free(c->v16); free(c->kcodes); free(c->vcodes);
    free(c->vscale); free(c->kscale); free(c->klut); free(c->vlevels); free(c->klevels_copy);
    free(c->k_lower); free(c->k_upper); free(c->k_zcode); free(c->v_zcode);
    free(c->krow); free(c->vrow); free(c->kent); free(c->vent);
    free(c->kring); free(c->vring); free(c->inv_freq); free(c->prefix_set);
    free(c);
}

/* calloc of a*b*c*d elements of size sz with overflow check */
static void *alloc4(size_t a, size_t b, size_t c2, size_t d, size_t sz, const char *what, kvq_err *err, kvq_status *st)
{
    size_t n = 1;
    if (kvq_mul_size(n, a, &n) || kvq_mul_size(n, b, &n) || kvq_mul_size(n, c2, &n) || kvq_mul_size(n, d, &n) ||
        kvq_mul_size(n, sz, &n)) {
        *st = kvq_fail(err, KVQ_ENOMEM, "kvcache: %s: size overflows", what);
        return NULL;
    }
    void *p = calloc(n ? n : 1, 1);
    if (!p) *st = kvq_fail(err, KVQ_ENOMEM, "kvcache: %s: cannot allocate %zu bytes", what, n);
    return p;
}

kvq_status kvq_kvcache_create(kvq_kvcache **out, const kvq_kvcache_config *cfg, kvq_err *err)
{
    if (!out) return kvq_fail(err, KVQ_EINVAL, "kvcache create: NULL output");
    *out = NULL;
    KVQ_TRY(kvq_kvcache_config_validate(cfg, err));
    kvq_kvcache *c = calloc(1, sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ENOMEM, "kvcache: cannot allocate");
    c->cfg = *cfg;
    const size_t B = cfg->n_seqs, H = cfg->n_kv_heads, D = cfg->head_dim, C = H * D;
    c->C = C;
    c->n_exact = cfg->n_sink > cfg->prefix_len ? cfg->n_sink : cfg->prefix_len;
    c->capq = (cfg->max_tokens - c->n_exact + 31) / 32 * 32;
    c->kw = kvq_kvcache_head_words(cfg->k_bits, D);
    c->vw = kvq_kvcache_head_words(cfg->v_bits, D);
    kvq_status st = KVQ_OK;
#define A4(ptr, a, b, c3, d, what) do { (ptr) = alloc4((a), (b), (c3), (d), sizeof *(ptr), (what), err, &st); if (!(ptr)) goto fail; } while (0)
    A4(c->len, B, 1, 1, 1, "lengths");
    A4(c->kq, B, 1, 1, 1, "lengths");
    A4(c->vq, B, 1, 1, 1, "lengths");
    A4(c->prefix_set, B, 1, 1, 1, "lengths");
    A4(c->k16, B, H, c->n_exact ? c->n_exact : 1, D, "fp16 keys");
    A4(c->v16, B, H, c->n_exact ? c->n_exact : 1, D, "fp16 values");
    A4(c->kcodes, B, H, c->kw, c->capq, "key codes");
    A4(c->vcodes, B, H, c->capq, c->vw, "value codes");
    size_t np = cfg->rope.rope_dim / 2;
    A4(c->inv_freq, np ? np : 1, 1, 1, 1, "rope");
    for (size_t i = 0; i < np; i++) c->inv_freq[i] = rope_inv_freq(&cfg->rope, i);
    if (cfg->format == KVQ_KVCACHE_NUQ) {
        size_t nlk = (size_t)1 << cfg->k_bits, nlv = (size_t)1 << cfg->v_bits;
        A4(c->vscale, B, c->capq, 2, 1, "value scales");
        A4(c->klut, C, nlk, 1, 1, "key LUT");
        A4(c->vlevels, H, nlv, 1, 1, "value levels");
        A4(c->klevels_copy, H, nlk, 1, 1, "key levels");
        A4(c->k_lower, C, 1, 1, 1, "thresholds");
        A4(c->k_upper, C, 1, 1, 1, "thresholds");
        A4(c->k_zcode, H, 1, 1, 1, "zero codes");
        A4(c->v_zcode, H, 1, 1, 1, "zero codes");
        memcpy(c->k_lower, cfg->k_lower, C * sizeof(float));
        memcpy(c->k_upper, cfg->k_upper, C * sizeof(float));
        for (size_t h = 0; h < H; h++) {
            const float *kl = cfg->k_levels + (cfg->k_tables > 1 ? h : 0) * nlk;
            const float *vl = cfg->v_levels + (cfg->v_tables > 1 ? h : 0) * nlv;
            memcpy(c->klevels_copy + h * nlk, kl, nlk * sizeof(float));
            memcpy(c->vlevels + h * nlv, vl, nlv * sizeof(float));
            c->k_zcode[h] = (uint8_t)kvq_nuq_nearest(kl, nlk, 0.0f);
            c->v_zcode[h] = (uint8_t)kvq_nuq_nearest(vl, nlv, 0.0f);
            for (size_t d = 0; d < D; d++) {
                size_t ch = h * D + d;
                double zp = ((double)cfg->k_upper[ch] + (double)cfg->k_lower[ch]) * 0.5;
                double r = ((double)cfg->k_upper[ch] - (double)cfg->k_lower[ch]) * 0.5;
                for (size_t j = 0; j < nlk; j++)
                    c->klut[ch * nlk + j] = r == 0 ? (float)zp : (float)((double)kl[j] * r + zp);
            }
        }
        c->k_per_side = kvq_outliers_per_side(C, cfg->outlier_frac);
        size_t per_tok = 2 * (size_t)ceil(cfg->outlier_frac * (double)D) + 2; /* per (token, head) */
        size_t cap = cfg->outlier_cap;
        if (!cap && (kvq_mul_size(per_tok, cfg->max_tokens, &cap))) cap = (size_t)1 << 30;
        if (cfg->outlier_frac == 0 && !cfg->outlier_cap) cap = 1;
        if (cfg->outlier_max && cap > cfg->outlier_max) cap = cfg->outlier_max;
        if (cap > 0xffffffffu) cap = 0xffffffffu;
        c->ent_cap = cap ? cap : 1;
        A4(c->krow, B, H, c->capq + 1, 1, "outlier rows");
        A4(c->vrow, B, H, c->capq + 1, 1, "outlier rows");
        A4(c->kent, B, H, c->ent_cap, 1, "outlier entries");
        A4(c->vent, B, H, c->ent_cap, 1, "outlier entries");
    } else {
        size_t G = cfg->group, F = cfg->residual ? cfg->residual : G;
        c->ring = (F > cfg->residual ? F : cfg->residual) + 2;
        A4(c->vscale, B, H * c->capq, D / G, 2, "value scales"); /* [B][H][capq][D/G][2] */
        A4(c->kscale, B, c->capq / G + 1, C, 2, "key scales");
        A4(c->kring, B, c->ring, C, 1, "key residual");
        A4(c->vring, B, c->ring, C, 1, "value residual");
    }
#undef A4
    *out = c;
    return KVQ_OK;
fail:
    kvq_kvcache_free(c);
    return st;
}

const kvq_kvcache_config *kvq_kvcache_config_of(const kvq_kvcache *c) { return &c->cfg; }
size_t kvq_kvcache_len(const kvq_kvcache *c, size_t seq) { return seq < c->cfg.n_seqs ? c->len[seq] : 0; }

/* ---- helpers --------------------------------------------------------------------- */

static inline uint16_t h16(float x) { return kvq_f32_to_f16(kvq_round_fp16(x)); }
static inline float f16(uint16_t h) { return kvq_f16_to_f32(h); }

/* store one exact-region position (post-RoPE key, value) */
static void put_exact(kvq_kvcache *c, size_t s, size_t pos, const float *kpost, const float *v)
{
    size_t H = c->cfg.n_kv_heads, D = c->cfg.head_dim;
    for (size_t h = 0; h < H; h++)
        for (size_t d = 0; d < D; d++) {
            size_t i = ((s * H + h) * c->n_exact + pos) * D + d;
            c->k16[i] = h16(kpost[h * D + d]);
            c->v16[i] = h16(v[h * D + d]);
        }
}

/* index of key code word j of (sequence s, head h, quantized position q) in kcodes (formats/KVCACHE.md):
 * NUQ token-minor [B][H][kw][capq]; KIVI in tiles of 16 positions [B][H][capq/16][kw][16] */
static size_t kword(const kvq_kvcache *c, size_t s, size_t q, size_t h, size_t j)
{
    size_t blk = (s * c->cfg.n_kv_heads + h) * c->kw * c->capq;
    if (c->cfg.format == KVQ_KVCACHE_KIVI) return blk + ((q >> 4) * c->kw + j) * 16 + (q & 15);
    return blk + j * c->capq + q;
}

/* scatter one token's packed head words into the key layout */
static void put_kcodes(kvq_kvcache *c, size_t s, size_t q, size_t h, const uint32_t *w)
{
    for (size_t j = 0; j < c->kw; j++) c->kcodes[kword(c, s, q, h, j)] = w[j];
}

static void get_kcodes(const kvq_kvcache *c, size_t s, size_t q, size_t h, uint32_t *w)
{
    for (size_t j = 0; j < c->kw; j++) w[j] = c->kcodes[kword(c, s, q, h, j)];
}

/* KIVI: offset (floats) of the (min, scale) pairs of head h at quantized position q of sequence s in vscale,
 * [B][H][capq][D/G][2] */
static size_t kivi_vscale_off(const kvq_kvcache *c, size_t s, size_t h, size_t q)
{
    return ((s * c->cfg.n_kv_heads + h) * c->capq + q) * (c->cfg.head_dim / c->cfg.group) * 2;
}

kvq_status kvq_kvcache_set_prefix(kvq_kvcache *c, size_t seq, const float *k_post, const float *v, kvq_err *err)
{
    if (!c || !k_post || !v) return kvq_fail(err, KVQ_EINVAL, "kvcache set_prefix: NULL argument");
    if (seq >= c->cfg.n_seqs) return kvq_fail(err, KVQ_EINVAL, "kvcache set_prefix: sequence %zu: expected < %zu", seq, c->cfg.n_seqs);
    if (!c->cfg.prefix_len) return kvq_fail(err, KVQ_EINVAL, "kvcache set_prefix: prefix_len is 0 in the configuration");
    if (c->len[seq]) return kvq_fail(err, KVQ_EINVAL, "kvcache set_prefix: sequence %zu holds %zu positions; the prefix goes first", seq, c->len[seq]);
    size_t C = c->C;
    for (size_t i = 0; i < c->cfg.prefix_len * C; i++)
        if (!isfinite(k_post[i]) || !isfinite(v[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "kvcache set_prefix: position %zu channel %zu: not finite", i / C, i % C);
    for (size_t p = 0; p < c->cfg.prefix_len; p++) put_exact(c, seq, p, k_post + p * C, v + p * C);
    c->len[seq] = c->cfg.prefix_len;
    c->prefix_set[seq] = true;
    return KVQ_OK;
}

/* nuq code of one value, the rule of kernels/quant/quant.c nuq_one */
static inline uint8_t nuq_code(float x, double zp, double r, const float *lv, size_t nl)
{
    if (r == 0) return 0;
    double xn = ((double)x - zp) / r;
    if (!(xn >= lv[0])) xn = lv[0];
    if (xn > lv[nl - 1]) xn = lv[nl - 1];
    return (uint8_t)kvq_nuq_nearest(lv, nl, (float)xn);
}

static kvq_status grow_entries(kvq_kvcache *c, size_t need, size_t s, size_t pos, kvq_err *err)
{
    size_t cap = c->ent_cap;
    size_t lim = c->cfg.outlier_max ? c->cfg.outlier_max : 0xffffffffu;
    if (need > lim)
        return kvq_fail(err, KVQ_ENOMEM,
                        "kvcache: sequence %zu position %zu: sparse outlier store needs %zu entries, limit outlier_max %zu",
                        s, pos, need, lim);
    while (cap < need) cap = cap > lim / 2 ? lim : cap * 2;
    size_t B = c->cfg.n_seqs * c->cfg.n_kv_heads, n;
    if (kvq_mul_size(B, cap, &n) || kvq_mul_size(n, sizeof(uint32_t), &n))
        return kvq_fail(err, KVQ_ENOMEM, "kvcache: outlier store of %zu entries overflows", cap);
    uint32_t *ke = calloc(n, 1), *ve = calloc(n, 1);
    if (!ke || !ve) {
        free(ke); free(ve);
        return kvq_fail(err, KVQ_ENOMEM, "kvcache: cannot grow the outlier store to %zu entries", cap);
    }
    for (size_t i = 0; i < B; i++) {
        memcpy(ke + i * cap, c->kent + i * c->ent_cap, c->ent_cap * sizeof *ke);
        memcpy(ve + i * cap, c->vent + i * c->ent_cap, c->ent_cap * sizeof *ve);
    }
    free(c->kent); free(c->vent);
    c->kent = ke; c->vent = ve; c->ent_cap = cap;
    return KVQ_OK;
}

static kvq_status append_nuq_token(kvq_kvcache *c, size_t s, size_t pos, const float *k, const float *v,
                                   float *scratch, kvq_err *err)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C, q = pos - c->n_exact;
    const size_t nlk = (size_t)1 << g->k_bits, nlv = (size_t)1 << g->v_bits;
    const bool outl = g->outlier_frac > 0;
    uint8_t codes[KVQ_KVCACHE_MAX_HEAD_DIM];
    uint32_t words[KVQ_KVCACHE_MAX_HEAD_DIM];
    const size_t R = c->capq + 1;
    uint32_t *krow = c->krow + s * H * R, *vrow = c->vrow + s * H * R;
    /* count outliers per head first: the store grows (or the append fails) before anything is written */
    size_t need = 0;
    float lo = 0, hi = 0;
    kvq_token_range(v, C, outl ? c->k_per_side : 0, scratch, &lo, &hi);
    for (size_t h = 0; h < H && outl; h++) {
        size_t nk = 0, nv = 0;
        for (size_t d = 0; d < D; d++) {
            size_t i = h * D + d;
            nk += (k[i] > c->k_upper[i] || k[i] < c->k_lower[i]);
            nv += c->k_per_side && (v[i] < lo || v[i] > hi);
        }
        if (krow[h * R + q] + nk > need) need = krow[h * R + q] + nk;
        if (vrow[h * R + q] + nv > need) need = vrow[h * R + q] + nv;
    }
    if (need > c->ent_cap) KVQ_TRY(grow_entries(c, need, s, pos, err));
    /* keys */
    for (size_t h = 0; h < H; h++) {
        const float *lv = c->klevels_copy + h * nlk;
        uint32_t *kent = c->kent + (s * H + h) * c->ent_cap;
        size_t e = krow[h * R + q];
        for (size_t d = 0; d < D; d++) {
            size_t ch = h * D + d;
            float x = k[ch];
            if (outl && (x > c->k_upper[ch] || x < c->k_lower[ch])) {
                codes[d] = c->k_zcode[h];
                kent[e++] = (uint32_t)d << 16 | h16(x);
                continue;
            }
            double zp = ((double)c->k_upper[ch] + (double)c->k_lower[ch]) * 0.5;
            double r = ((double)c->k_upper[ch] - (double)c->k_lower[ch]) * 0.5;
            codes[d] = nuq_code(x, zp, r, lv, nlk);
        }
        kvq_kvcache_pack(words, codes, D, g->k_bits);
        put_kcodes(c, s, q, h, words);
        krow[h * R + q + 1] = (uint32_t)e;
    }
    /* values: per-token range over all kv_dim channels */
    double zp = ((double)hi + (double)lo) * 0.5, r = ((double)hi - (double)lo) * 0.5;
    c->vscale[(s * c->capq + q) * 2] = (float)zp;
    c->vscale[(s * c->capq + q) * 2 + 1] = (float)r;
    for (size_t h = 0; h < H; h++) {
        const float *lv = c->vlevels + h * nlv;
        uint32_t *vent = c->vent + (s * H + h) * c->ent_cap;
        size_t e = vrow[h * R + q];
        for (size_t d = 0; d < D; d++) {
            float x = v[h * D + d];
            if (c->k_per_side && (x < lo || x > hi)) {
                codes[d] = c->v_zcode[h];
                vent[e++] = (uint32_t)d << 16 | h16(x);
                continue;
            }
            codes[d] = nuq_code(x, zp, r, lv, nlv);
        }
        kvq_kvcache_pack(c->vcodes + ((s * H + h) * c->capq + q) * c->vw, codes, D, g->v_bits);
        vrow[h * R + q + 1] = (uint32_t)e;
    }
    return KVQ_OK;
}

/* KIVI: quantize key group [q0, q0 + G) of sequence s from the ring (the rule of
 * kvq_kivi_keys: per channel min/max over the G tokens, code with the double scale,
 * the scale stored as float). codes: scratch [G][C]. */
static void kivi_flush_keys(kvq_kvcache *c, size_t s, size_t q0, uint8_t *codes)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C, G = g->group;
    const double qmax = (double)((1u << g->k_bits) - 1);
    const uint16_t *ring = c->kring + s * c->ring * C;
    float *ks = c->kscale + (s * (c->capq / G + 1) + q0 / G) * C * 2;
    uint32_t words[KVQ_KVCACHE_MAX_HEAD_DIM];
    for (size_t ch = 0; ch < C; ch++) {
        float mn = INFINITY, mx = -INFINITY;
        for (size_t t = 0; t < G; t++) {
            float x = f16(ring[((c->n_exact + q0 + t) % c->ring) * C + ch]);
            if (x < mn) mn = x;
            if (x > mx) mx = x;
        }
        double den = ((double)mx - (double)mn) / qmax;
        ks[ch * 2] = mn;
        ks[ch * 2 + 1] = (float)den;
        for (size_t t = 0; t < G; t++) {
            double x = f16(ring[((c->n_exact + q0 + t) % c->ring) * C + ch]);
            double qq = den == 0 ? 0 : rint((x - mn) / den);
            if (qq < 0) qq = 0;
            if (qq > qmax) qq = qmax;
            codes[t * C + ch] = (uint8_t)qq;
        }
    }
    for (size_t t = 0; t < G; t++)
        for (size_t h = 0; h < H; h++) {
            kvq_kvcache_pack(words, codes + t * C + h * D, D, g->k_bits);
            put_kcodes(c, s, q0 + t, h, words);
        }
}

/* KIVI: quantize value position q of sequence s from the ring */
static void kivi_flush_value(kvq_kvcache *c, size_t s, size_t q)
{
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C, G = g->group;
    const double qmax = (double)((1u << g->v_bits) - 1);
    const uint16_t *row = c->vring + (s * c->ring + (c->n_exact + q) % c->ring) * C;
    uint8_t codes[KVQ_KVCACHE_MAX_HEAD_DIM];
    for (size_t h = 0; h < H; h++) {
        float *vs = c->vscale + kivi_vscale_off(c, s, h, q);
        for (size_t g0 = 0; g0 < D; g0 += G) {
            size_t ch0 = h * D + g0;
            float mn = f16(row[ch0]), mx = mn;
            for (size_t j = 1; j < G; j++) {
                float y = f16(row[ch0 + j]);
                if (y < mn) mn = y;
                if (y > mx) mx = y;
            }
            double sc = ((double)mx - (double)mn) / qmax;
            vs[(g0 / G) * 2] = mn;
            vs[(g0 / G) * 2 + 1] = (float)sc;
            for (size_t j = 0; j < G; j++) {
                double qq = sc == 0 ? 0 : rint(((double)f16(row[ch0 + j]) - mn) / sc);
                if (qq < 0) qq = 0;
                if (qq > qmax) qq = qmax;
                codes[g0 + j] = (uint8_t)qq;
            }
        }
        kvq_kvcache_pack(c->vcodes + ((s * H + h) * c->capq + q) * c->vw, codes, D, g->v_bits);
    }
}

kvq_status kvq_kvcache_append(kvq_kvcache *c, size_t seq, const float *k, const float *v, size_t n, kvq_err *err)
{
    if (!c || (n && (!k || !v))) return kvq_fail(err, KVQ_EINVAL, "kvcache append: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    if (seq >= g->n_seqs) return kvq_fail(err, KVQ_EINVAL, "kvcache append: sequence %zu: expected < %zu", seq, g->n_seqs);
    size_t len = c->len[seq], C = c->C;
    if (g->prefix_len && !c->prefix_set[seq])
        return kvq_fail(err, KVQ_EINVAL, "kvcache append: sequence %zu: the IntactKV prefix (%zu positions) must be set first", seq, g->prefix_len);
    if (n > g->max_tokens - len)
        return kvq_fail(err, KVQ_ENOMEM, "kvcache append: sequence %zu: %zu positions + %zu new exceed max_tokens %zu",
                        seq, len, n, g->max_tokens);
    for (size_t i = 0; i < n * C; i++)
        if (!isfinite(k[i]) || !isfinite(v[i]))
            return kvq_fail(err, KVQ_ENUMERIC, "kvcache append: sequence %zu: new token %zu channel %zu: not finite", seq, i / C, i % C);
    size_t G = g->format == KVQ_KVCACHE_KIVI ? g->group : 0;
    float *krow = malloc(2 * C * sizeof *krow + G * C);
    if (!krow) return kvq_fail(err, KVQ_ENOMEM, "kvcache append: cannot allocate %zu floats", 2 * C);
    float *scratch = krow + C;
    uint8_t *gcodes = (uint8_t *)(krow + 2 * C);
    kvq_status st = KVQ_OK;
    size_t pos = len;
    for (size_t t = 0; t < n; t++, pos++) {
        const float *kt = k + t * C, *vt = v + t * C;
        if (pos < c->n_exact) {
            memcpy(krow, kt, C * sizeof *krow);
            st = kvq_rope_rotate(krow, 1, g->n_kv_heads, g->head_dim, &g->rope, pos, err);
            if (st != KVQ_OK) break;
            put_exact(c, seq, pos, krow, vt);
            continue;
        }
        if (g->format == KVQ_KVCACHE_NUQ) {
            st = append_nuq_token(c, seq, pos, kt, vt, scratch, err);
            if (st != KVQ_OK) break;
            c->kq[seq] = c->vq[seq] = pos + 1 - c->n_exact;
            continue;
        }
        /* KIVI: residual ring (quantization domain), then flush by the decode boundaries */
        memcpy(krow, kt, C * sizeof *krow);
        if (g->post_rope) st = kvq_rope_rotate(krow, 1, g->n_kv_heads, g->head_dim, &g->rope, pos, err);
        if (st != KVQ_OK) break;
        uint16_t *kr = c->kring + (seq * c->ring + pos % c->ring) * C, *vr = c->vring + (seq * c->ring + pos % c->ring) * C;
        for (size_t i = 0; i < C; i++) { kr[i] = h16(krow[i]); vr[i] = h16(vt[i]); }
        size_t kb = kvq_kivi_key_boundary(pos, g->group, g->residual, c->n_exact) - c->n_exact;
        while (c->kq[seq] + g->group <= kb) { kivi_flush_keys(c, seq, c->kq[seq], gcodes); c->kq[seq] += g->group; }
        size_t vb = kvq_kivi_value_boundary(pos, g->residual, c->n_exact) - c->n_exact;
        while (c->vq[seq] < vb) { kivi_flush_value(c, seq, c->vq[seq]); c->vq[seq]++; }
    }
    free(krow);
    c->len[seq] = pos; /* on an error: the tokens before the failing one */
    return st;
}

/* ---- reconstruction and attention --------------------------------------------- */

kvq_status kvq_kvcache_dequant(const kvq_kvcache *c, size_t seq, float *ko, float *vo, kvq_err *err)
{
    if (!c || !ko || !vo) return kvq_fail(err, KVQ_EINVAL, "kvcache dequant: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    if (seq >= g->n_seqs) return kvq_fail(err, KVQ_EINVAL, "kvcache dequant: sequence %zu: expected < %zu", seq, g->n_seqs);
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C, len = c->len[seq];
    const size_t ne = len < c->n_exact ? len : c->n_exact;
    uint8_t codes[KVQ_KVCACHE_MAX_HEAD_DIM];
    uint32_t words[KVQ_KVCACHE_MAX_HEAD_DIM];
    for (size_t p = 0; p < ne; p++)
        for (size_t h = 0; h < H; h++)
            for (size_t d = 0; d < D; d++) {
                size_t i = ((seq * H + h) * c->n_exact + p) * D + d;
                ko[p * C + h * D + d] = f16(c->k16[i]);
                vo[p * C + h * D + d] = f16(c->v16[i]);
            }
    if (len <= c->n_exact) return KVQ_OK;
    const size_t nq = len - c->n_exact;
    float *kq = ko + c->n_exact * C, *vq = vo + c->n_exact * C;
    if (g->format == KVQ_KVCACHE_NUQ) {
        const size_t nlk = (size_t)1 << g->k_bits, nlv = (size_t)1 << g->v_bits;
        const size_t R = c->capq + 1;
        for (size_t q = 0; q < nq; q++) {
            double zp = c->vscale[(seq * c->capq + q) * 2], r = c->vscale[(seq * c->capq + q) * 2 + 1];
            for (size_t h = 0; h < H; h++) {
                get_kcodes(c, seq, q, h, words);
                kvq_kvcache_unpack(codes, words, D, g->k_bits);
                for (size_t d = 0; d < D; d++) kq[q * C + h * D + d] = c->klut[(h * D + d) * nlk + codes[d]];
                const uint32_t *kr = c->krow + (seq * H + h) * R, *ke = c->kent + (seq * H + h) * c->ent_cap;
                for (uint32_t e = kr[q]; e < kr[q + 1]; e++) kq[q * C + h * D + (ke[e] >> 16)] = f16((uint16_t)ke[e]);
                kvq_kvcache_unpack(codes, c->vcodes + ((seq * H + h) * c->capq + q) * c->vw, D, g->v_bits);
                for (size_t d = 0; d < D; d++)
                    vq[q * C + h * D + d] = r == 0 ? (float)zp : (float)((double)c->vlevels[h * nlv + codes[d]] * r + zp);
                const uint32_t *vr = c->vrow + (seq * H + h) * R, *ve = c->vent + (seq * H + h) * c->ent_cap;
                for (uint32_t e = vr[q]; e < vr[q + 1]; e++) vq[q * C + h * D + (ve[e] >> 16)] = f16((uint16_t)ve[e]);
            }
        }
    } else {
        const size_t G = g->group;
        for (size_t q = 0; q < nq; q++) {
            for (size_t h = 0; h < H; h++) {
                if (q < c->kq[seq]) {
                    const float *ks = c->kscale + (seq * (c->capq / G + 1) + q / G) * C * 2;
                    get_kcodes(c, seq, q, h, words);
                    kvq_kvcache_unpack(codes, words, D, g->k_bits);
                    for (size_t d = 0; d < D; d++) {
                        size_t ch = h * D + d;
                        kq[q * C + ch] = ks[ch * 2 + 1] == 0 ? ks[ch * 2]
                                         : (float)((double)codes[d] * ks[ch * 2 + 1] + ks[ch * 2]);
                    }
                } else {
                    const uint16_t *row = c->kring + (seq * c->ring + (c->n_exact + q) % c->ring) * C;
                    for (size_t d = 0; d < D; d++) kq[q * C + h * D + d] = f16(row[h * D + d]);
                }
                if (q < c->vq[seq]) {
                    const float *vs = c->vscale + kivi_vscale_off(c, seq, h, q);
                    kvq_kvcache_unpack(codes, c->vcodes + ((seq * H + h) * c->capq + q) * c->vw, D, g->v_bits);
                    for (size_t d = 0; d < D; d++) {
                        size_t gi = d / G;
                        vq[q * C + h * D + d] = vs[gi * 2 + 1] == 0 ? vs[gi * 2]
                                                : (float)((double)codes[d] * vs[gi * 2 + 1] + vs[gi * 2]);
                    }
                } else {
                    const uint16_t *row = c->vring + (seq * c->ring + (c->n_exact + q) % c->ring) * C;
                    for (size_t d = 0; d < D; d++) vq[q * C + h * D + d] = f16(row[h * D + d]);
                }
            }
        }
    }
    if (!g->post_rope) KVQ_TRY(kvq_rope_rotate(kq, nq, H, D, &g->rope, c->n_exact, err));
    return KVQ_OK;
}

kvq_status kvq_kvcache_attend(const kvq_kvcache *c, const float *q, size_t n_heads, float scale, float *out,
                              kvq_err *err)
{
    if (!c || !q || !out) return kvq_fail(err, KVQ_EINVAL, "kvcache attend: NULL argument");
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C;
    if (n_heads == 0 || n_heads % H)
        return kvq_fail(err, KVQ_EINVAL, "kvcache attend: n_heads %zu: expected a multiple of n_kv_heads %zu", n_heads, H);
    const size_t grp = n_heads / H;
    double sc = scale > 0 ? scale : 1.0 / sqrt((double)D);
    size_t maxlen = 0;
    for (size_t s = 0; s < g->n_seqs; s++) if (c->len[s] > maxlen) maxlen = c->len[s];
    size_t nb;
    if (kvq_mul_size(maxlen ? maxlen : 1, C, &nb) || kvq_mul_size(nb, 2 * sizeof(float), &nb))
        return kvq_fail(err, KVQ_ENOMEM, "kvcache attend: buffer size overflows");
    float *kbuf = malloc(nb);
    double *p = malloc((maxlen ? maxlen : 1) * sizeof *p);
    if (!kbuf || !p) { free(kbuf); free(p); return kvq_fail(err, KVQ_ENOMEM, "kvcache attend: cannot allocate %zu bytes", nb); }
    float *vbuf = kbuf + (maxlen ? maxlen : 1) * C;
    kvq_status st = KVQ_OK;
    for (size_t s = 0; s < g->n_seqs && st == KVQ_OK; s++) {
        size_t len = c->len[s];
        if (len) st = kvq_kvcache_dequant(c, s, kbuf, vbuf, err);
        if (st != KVQ_OK) break;
        for (size_t qh = 0; qh < n_heads; qh++) {
            size_t h = qh / grp;
            const float *qv = q + (s * n_heads + qh) * D;
            float *o = out + (s * n_heads + qh) * D;
            if (!len) { memset(o, 0, D * sizeof *o); continue; }
            double m = -INFINITY, l = 0;
            for (size_t t = 0; t < len; t++) {
                double a = 0;
                for (size_t d = 0; d < D; d++) a += (double)qv[d] * kbuf[t * C + h * D + d];
                p[t] = a * sc;
                if (p[t] > m) m = p[t];
            }
            for (size_t t = 0; t < len; t++) { p[t] = exp(p[t] - m); l += p[t]; }
            for (size_t d = 0; d < D; d++) {
                double a = 0;
                for (size_t t = 0; t < len; t++) a += p[t] * vbuf[t * C + h * D + d];
                o[d] = (float)(a / l);
            }
        }
    }
    free(kbuf);
    free(p);
    return st;
}

/* ---- stats and view ------------------------------------------------------------------- */

void kvq_kvcache_stats_get(const kvq_kvcache *c, kvq_kvcache_stats *s)
{
    memset(s, 0, sizeof *s);
    const kvq_kvcache_config *g = &c->cfg;
    const size_t H = g->n_kv_heads, D = g->head_dim, C = c->C;
    s->outlier_capacity = c->ent_cap;
    for (size_t i = 0; i < g->n_seqs; i++) {
        size_t len = c->len[i], ne = len < c->n_exact ? len : c->n_exact;
        size_t kq = c->kq[i], vq = c->vq[i], nq = len - ne;
        s->n_tokens += len;
        s->n_quant_k += kq;
        s->n_quant_v += vq;
        s->bytes_k += ne * C * 2 + kq * H * c->kw * 4 + (nq - kq) * C * 2;
        s->bytes_v += ne * C * 2 + vq * H * c->vw * 4 + (nq - vq) * C * 2;
        if (g->format == KVQ_KVCACHE_NUQ) {
            for (size_t h = 0; h < H; h++) {
                const uint32_t *kr = c->krow + (i * H + h) * (c->capq + 1), *vr = c->vrow + (i * H + h) * (c->capq + 1);
                s->k_outliers += kr[kq];
                s->v_outliers += vr[vq];
                s->bytes_k += (kq + 1) * 4 + kr[kq] * 4;
                s->bytes_v += (vq + 1) * 4 + vr[vq] * 4;
            }
            s->bytes_v += vq * 8;
        } else {
            s->bytes_k += (kq / g->group) * C * 8;
            s->bytes_v += vq * (C / g->group) * 8;
        }
    }
    (void)D;
}

void kvq_kvcache_view_get(const kvq_kvcache *c, kvq_kvcache_view *v)
{
    memset(v, 0, sizeof *v);
    v->n_exact = c->n_exact;
    v->capq = c->capq;
    v->k_head_words = c->kw;
    v->v_head_words = c->vw;
    v->ring = c->ring;
    v->len = c->len; v->kq = c->kq; v->vq = c->vq; v->prefix_set = c->prefix_set;
    v->k16 = c->k16; v->v16 = c->v16;
    v->kcodes = c->kcodes; v->vcodes = c->vcodes;
    v->vscale = c->vscale; v->kscale = c->kscale;
    v->klut = c->klut; v->vlevels = c->vlevels;
    v->k_zcode = c->k_zcode; v->v_zcode = c->v_zcode;
    v->krow = c->krow; v->vrow = c->vrow; v->kent = c->kent; v->vent = c->vent;
    v->ent_cap = c->ent_cap;
    v->kring = c->kring; v->vring = c->vring;
    v->inv_freq = c->inv_freq;
}
