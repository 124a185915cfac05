/* test_kvcache.c — the packed KV cache (kernels/kvcache/kvcache.h) against an
 * independent reference built here from kernels/quant/quant.h: the "kveval
 * simulation" (kvq_quant_nuq_keys / kvq_quant_nuq_values, kvq_kivi_keys /
 * kvq_kivi_values with the decode boundaries), RoPE after quantization, fp16
 * rows where the cache holds 16 bits, then attention in float64 written out
 * here. Also: packing round trips and bit positions, outlier-store growth and
 * clean failure, sink / IntactKV prefix rows in fp16, KIVI residual windows,
 * configuration errors, configuration from an artifact. */
#include <math.h>
#include <stdint.h>

#include "kvcache.h"
#include "family.h"
#include "kvq_test.h"
#include "quant.h"
#include "safetensors.h"

#define KVCACHE_SYNTH_SEED 0x9e3779b97f4a7c15ull
#include "kvcache_synth.h"

/* reference attention in double: q [n_heads][D], K, V [len][C] (keys post-RoPE) */
static void ref_attend(const float *q, size_t n_heads, size_t H, size_t D, const float *K, const float *V,
                       size_t len, float *out)
{
    size_t C = H * D, grp = n_heads / H;
    double *p = malloc(len * sizeof *p);
    for (size_t j = 0; j < n_heads; j++) {
        size_t h = j / grp;
        double m = -INFINITY, l = 0;
        for (size_t t = 0; t < len; t++) {
            double a = 0;
            for (size_t d = 0; d < D; d++) a += (double)q[j * D + d] * K[t * C + h * D + d];
            p[t] = a / sqrt((double)D);
            m = fmax(m, p[t]);
        }
        for (size_t t = 0; t < len; t++) { p[t] = exp(p[t] - m); l += p[t]; }
        for (size_t d = 0; d < D; d++) {
            double a = 0;
            for (size_t t = 0; t < len; t++) a += p[t] * V[t * C + h * D + d];
            out[j * D + d] = (float)(a / l);
        }
    }
    free(p);
}

static void round_rows(float *x, size_t n) { for (size_t i = 0; i < n; i++) x[i] = kvq_round_fp16(x[i]); }

/* the simulation of one sequence after tokens 0..len-1: Kr (post-RoPE) and Vr [len][C] */
static void nuq_reference(const kvq_kvcache_config *g, const float *prefk, const float *prefv, const float *K,
                          const float *V, size_t len, float *Kr, float *Vr)
{
    size_t C = g->n_kv_heads * g->head_dim, ne = g->n_sink > g->prefix_len ? g->n_sink : g->prefix_len;
    kvq_err err;
    memcpy(Kr, K, len * C * sizeof *Kr);
    memcpy(Vr, V, len * C * sizeof *Vr);
    kvq_nuq_lut kl = {g->k_bits, g->k_tables, g->head_dim, g->k_levels}, vl = {g->v_bits, g->v_tables, g->head_dim, g->v_levels};
    ck_assert_int_eq(kvq_quant_nuq_keys(Kr, Kr, len, C, &kl, g->k_lower, g->k_upper, g->outlier_frac > 0, ne, NULL, &err), KVQ_OK);
    ck_assert_int_eq(kvq_quant_nuq_values(Vr, Vr, len, C, &vl, g->outlier_frac, ne, NULL, &err), KVQ_OK);
    ck_assert_int_eq(kvq_rope_rotate(Kr, len, g->n_kv_heads, g->head_dim, &g->rope, 0, &err), KVQ_OK);
    size_t nex = len < ne ? len : ne;
    round_rows(Kr, nex * C);
    round_rows(Vr, nex * C);
    for (size_t p = 0; p < g->prefix_len && p < len; p++) {
        for (size_t c = 0; c < C; c++) {
            Kr[p * C + c] = kvq_round_fp16(prefk[p * C + c]);
            Vr[p * C + c] = kvq_round_fp16(prefv[p * C + c]);
        }
    }
}

static void make_nuq_config(kvq_kvcache_config *g, size_t B, size_t H, size_t D, int kb, int vb, size_t tables,
                            double f, size_t n_sink, size_t max_tokens, float *klev, float *vlev, float *lo, float *hi)
{
    memset(g, 0, sizeof *g);
    g->format = KVQ_KVCACHE_NUQ;
    g->n_seqs = B; g->n_kv_heads = H; g->head_dim = D; g->max_tokens = max_tokens;
    g->k_bits = kb; g->v_bits = vb; g->n_sink = n_sink; g->outlier_frac = f;
    g->rope.rope_dim = D % 2 ? D - 1 : D;
    g->rope.rope_theta = 10000;
    g->k_tables = g->v_tables = tables;
    for (size_t t = 0; t < tables; t++) {
        sorted_levels(klev + t * ((size_t)1 << kb), (size_t)1 << kb);
        sorted_levels(vlev + t * ((size_t)1 << vb), (size_t)1 << vb);
    }
    size_t C = H * D;
    for (size_t c = 0; c < C; c++) {
        double off = (double)(c % 3) - 1, sc = 1 + (double)(c % 4);
        lo[c] = (float)(off - 1.8 * sc);
        hi[c] = (float)(off + 1.8 * sc);
    }
    lo[1] = hi[1] = 0.25f; /* a zero-range channel */
    g->k_levels = klev; g->v_levels = vlev; g->k_lower = lo; g->k_upper = hi;
}

static void check_close(const float *a, const float *b, size_t n, double tol, const char *what)
{
    for (size_t i = 0; i < n; i++) ck_assert_msg(isfinite(a[i]), "%s: element %zu not finite", what, i);
    double e = kvq_test_rel_l2_f(a, b, n);
    ck_assert_msg(e <= tol, "%s: relative L2 error %g > %g", what, e, tol);
}

/* ---- packing -------------------------------------------------------------------- */

START_TEST(test_pack_roundtrip)
{
    uint8_t codes[256], back[256];
    uint32_t words[256];
    const int bits[3] = {2, 3, 4};
    const size_t ns[7] = {1, 7, 31, 64, 100, 128, 256};
    for (int bi = 0; bi < 3; bi++)
        for (int ni = 0; ni < 7; ni++) {
            size_t n = ns[ni];
            for (size_t j = 0; j < n; j++) codes[j] = (uint8_t)(unif() * (1 << bits[bi]));
            kvq_kvcache_pack(words, codes, n, bits[bi]);
            kvq_kvcache_unpack(back, words, n, bits[bi]);
            ck_assert_mem_eq(codes, back, n);
            /* padding channels are zero */
            size_t nw = kvq_kvcache_head_words(bits[bi], n), cap = nw / kvq_kvcache_unit_words(bits[bi]) * kvq_kvcache_unit_channels(bits[bi]);
            uint8_t full[512];
            kvq_kvcache_unpack(full, words, cap, bits[bi]);
            for (size_t j = n; j < cap; j++) ck_assert_uint_eq(full[j], 0);
        }
    ck_assert_uint_eq(kvq_kvcache_head_words(4, 128), 16);
    ck_assert_uint_eq(kvq_kvcache_head_words(2, 128), 8);
    ck_assert_uint_eq(kvq_kvcache_head_words(3, 128), 12);
    ck_assert_uint_eq(kvq_kvcache_head_words(3, 64), 6);
    ck_assert_uint_eq(kvq_kvcache_head_words(4, 72), 9);
    /* bit positions (formats/KVCACHE.md): LSB first */
    memset(codes, 0, sizeof codes);
    codes[3] = 0xA;
    kvq_kvcache_pack(words, codes, 8, 4);
    ck_assert_uint_eq(words[0], 0xA000u);
    memset(codes, 0, sizeof codes);
    codes[15] = 3;
    kvq_kvcache_pack(words, codes, 16, 2);
    ck_assert_uint_eq(words[0], 0xC0000000u);
    memset(codes, 0, sizeof codes);
    codes[10] = 7; /* bits 30..32: straddles words 0 and 1 */
    codes[21] = 5; /* bits 63..65: straddles words 1 and 2 (101b: bit 63 = 1, bit 65 = 1) */
    codes[31] = 6; /* bits 93..95 */
    kvq_kvcache_pack(words, codes, 32, 3);
    ck_assert_uint_eq(words[0], 0xC0000000u);
    ck_assert_uint_eq(words[1], 0x80000001u);
    ck_assert_uint_eq(words[2], 0x00000002u | 0xC0000000u);
}
END_TEST

/* ---- NUQ equivalence with the kveval simulation --------------------------------------- */

static void run_nuq_equiv(size_t B, size_t H, size_t D, size_t grp, int kb, int vb, size_t tables, double f,
                          size_t n_sink, size_t prefix, bool chunks)
{
    size_t C = H * D, NT = 70, n_heads = H * grp;
    float klev[64], vlev[64], *lo = malloc(C * 4), *hi = malloc(C * 4);
    kvq_kvcache_config g;
    make_nuq_config(&g, B, H, D, kb, vb, tables, f, n_sink, NT + 5, klev, vlev, lo, hi);
    g.prefix_len = prefix;
    kvq_kvcache *c;
    kvq_err err;
    ck_assert_msg(kvq_kvcache_create(&c, &g, &err) == KVQ_OK, "%s", err.msg);
    float *K = malloc(B * NT * C * 4), *V = malloc(B * NT * C * 4), *Kr = malloc(NT * C * 4), *Vr = malloc(NT * C * 4);
    float *pk = malloc((prefix + 1) * C * 4), *pv = malloc((prefix + 1) * C * 4);
    float *q = malloc(B * n_heads * D * 4), *o = malloc(B * n_heads * D * 4), *ro = malloc(n_heads * D * 4);
    fill(K, B * NT, C, 1);
    fill(V, B * NT, C, 0);
    for (size_t i = 0; i < prefix * C; i++) { pk[i] = (float)gauss(); pv[i] = (float)gauss(); }
    for (size_t s = 0; s < B; s++) {
        if (prefix) ck_assert_msg(kvq_kvcache_set_prefix(c, s, pk, pv, &err) == KVQ_OK, "%s", err.msg);
        /* the prefix positions of K/V are not appended; fill them for the reference */
        for (size_t i = 0; i < prefix * C; i++) { K[s * NT * C + i] = pk[i]; V[s * NT * C + i] = pv[i]; }
    }
    const size_t steps[] = {1, 4, 13, 2, 1, 30, 19};
    size_t len = prefix;
    for (size_t si = 0; len < NT; si++) {
        size_t n = chunks ? steps[si % 7] : 1;
        if (n > NT - len) n = NT - len;
        for (size_t s = 0; s < B; s++)
            ck_assert_msg(kvq_kvcache_append(c, s, K + (s * NT + len) * C, V + (s * NT + len) * C, n, &err) == KVQ_OK,
                          "%s", err.msg);
        len += n;
        for (size_t i = 0; i < B * n_heads * D; i++) q[i] = (float)gauss();
        ck_assert_msg(kvq_kvcache_attend(c, q, n_heads, 0, o, &err) == KVQ_OK, "%s", err.msg);
        for (size_t s = 0; s < B; s++) {
            ck_assert_uint_eq(kvq_kvcache_len(c, s), len);
            nuq_reference(&g, pk, pv, K + s * NT * C, V + s * NT * C, len, Kr, Vr);
            ref_attend(q + s * n_heads * D, n_heads, H, D, Kr, Vr, len, ro);
            check_close(o + s * n_heads * D, ro, n_heads * D, 2e-6, "nuq decode vs simulation");
        }
    }
    /* the reconstruction itself: keys bit-exact up to RoPE rounding, values to fp32 */
    float *kd = malloc(NT * C * 4), *vd = malloc(NT * C * 4);
    ck_assert_int_eq(kvq_kvcache_dequant(c, B - 1, kd, vd, &err), KVQ_OK);
    nuq_reference(&g, pk, pv, K + (B - 1) * NT * C, V + (B - 1) * NT * C, NT, Kr, Vr);
    check_close(kd, Kr, NT * C, 1e-6, "keys");
    check_close(vd, Vr, NT * C, 1e-6, "values");
    kvq_kvcache_stats st;
    kvq_kvcache_stats_get(c, &st);
    ck_assert_uint_eq(st.n_tokens, B * NT);
    if (f > 0) ck_assert_msg(st.k_outliers > 0 && st.v_outliers > 0, "expected outliers, found %zu / %zu", st.k_outliers, st.v_outliers);
    else ck_assert_uint_eq(st.k_outliers + st.v_outliers, 0);
    free(kd); free(vd);
    free(K); free(V); free(Kr); free(Vr); free(pk); free(pv); free(q); free(o); free(ro); free(lo); free(hi);
    kvq_kvcache_free(c);
}

START_TEST(test_nuq_equiv)
{
    run_nuq_equiv(2, 2, 16, 3, 4, 3, 1, 0.1, 2, 0, true);   /* GQA 3, outliers, sink */
    run_nuq_equiv(1, 3, 12, 1, 2, 2, 3, 0.0, 0, 0, false);  /* per-head tables, no outliers, no sink */
    run_nuq_equiv(2, 1, 40, 2, 3, 4, 1, 0.2, 1, 0, true);   /* 3-bit keys over two units */
    run_nuq_equiv(1, 2, 9, 2, 4, 2, 2, 0.1, 1, 0, true);    /* odd head_dim: rope_dim 8 < head_dim */
}
END_TEST

START_TEST(test_prefix_and_sink)
{
    run_nuq_equiv(2, 2, 16, 2, 4, 4, 1, 0.1, 1, 3, true);   /* IntactKV prefix 3 > sink 1 */
    run_nuq_equiv(1, 2, 16, 1, 2, 2, 1, 0.1, 5, 2, false);  /* sink 5 > prefix 2 */
    /* sink rows are fp16 post-RoPE, not quantized: a non-fp16 input is rounded, nothing more */
    size_t H = 1, D = 8;
    float klev[16], vlev[16], lo[8], hi[8];
    kvq_kvcache_config g;
    make_nuq_config(&g, 1, H, D, 2, 2, 1, 0.0, 2, 16, klev, vlev, lo, hi);
    kvq_kvcache *c;
    kvq_err err;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_OK);
    float k[3 * 8], v[3 * 8], kd[3 * 8], vd[3 * 8], rot[3 * 8];
    for (int i = 0; i < 24; i++) { k[i] = 0.1f * (float)(i + 1); v[i] = -0.3f * (float)(i + 1); }
    ck_assert_int_eq(kvq_kvcache_append(c, 0, k, v, 3, &err), KVQ_OK);
    ck_assert_int_eq(kvq_kvcache_dequant(c, 0, kd, vd, &err), KVQ_OK);
    memcpy(rot, k, sizeof rot);
    ck_assert_int_eq(kvq_rope_rotate(rot, 3, H, D, &g.rope, 0, &err), KVQ_OK);
    for (int i = 0; i < 16; i++) {
        ck_assert_float_eq(kd[i], kvq_round_fp16(rot[i]));
        ck_assert_float_eq(vd[i], kvq_round_fp16(v[i]));
    }
    /* position 2 is quantized (2-bit): not equal to the fp16 row */
    int differ = 0;
    for (int i = 16; i < 24; i++) differ += vd[i] != kvq_round_fp16(v[i]);
    ck_assert_int_gt(differ, 0);
    /* position 1's rotation is by angle 1 * inv_freq: check one pair by hand */
    double a = 1.0, cs = cos(a), sn = sin(a);
    ck_assert_float_eq(rot[8], (float)((double)k[8] * cs - (double)k[9] * sn));
    kvq_kvcache_free(c);
}
END_TEST

/* ---- outlier store ---------------------------------------------------------------------- */

START_TEST(test_outlier_growth)
{
    size_t H = 2, D = 16, C = 32, NT = 40;
    float klev[16], vlev[16], lo[32], hi[32];
    kvq_kvcache_config g;
    make_nuq_config(&g, 2, H, D, 4, 4, 1, 0.3, 1, NT, klev, vlev, lo, hi);
    for (size_t i = 0; i < C; i++) { lo[i] = -0.5f; hi[i] = 0.5f; } /* most keys are outliers */
    g.outlier_cap = 4;
    kvq_kvcache *c;
    kvq_err err;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_OK);
    float *K = malloc(NT * C * 4), *V = malloc(NT * C * 4), *Kr = malloc(NT * C * 4), *Vr = malloc(NT * C * 4);
    float *kd = malloc(NT * C * 4), *vd = malloc(NT * C * 4);
    fill(K, NT, C, 1);
    fill(V, NT, C, 0);
    for (size_t t = 0; t < NT; t += 5) ck_assert_int_eq(kvq_kvcache_append(c, 1, K + t * C, V + t * C, 5, &err), KVQ_OK);
    kvq_kvcache_stats st;
    kvq_kvcache_stats_get(c, &st);
    /* capacity is per (sequence, head): grown from 4 to hold every head's entries of sequence 1 */
    ck_assert_msg(st.outlier_capacity * H >= st.k_outliers && st.outlier_capacity > 4 && st.k_outliers > 4 * 20,
                  "capacity %zu, key outliers %zu", st.outlier_capacity, st.k_outliers);
    ck_assert_int_eq(kvq_kvcache_dequant(c, 1, kd, vd, &err), KVQ_OK);
    nuq_reference(&g, NULL, NULL, K, V, NT, Kr, Vr);
    check_close(kd, Kr, NT * C, 1e-6, "keys after growth");
    check_close(vd, Vr, NT * C, 1e-6, "values after growth");
    kvq_kvcache_free(c);

    /* hard limit: the append fails cleanly, the tokens before stay, nothing overflows */
    g.outlier_cap = 4;
    g.outlier_max = 100;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_OK);
    kvq_status s = kvq_kvcache_append(c, 0, K, V, NT, &err);
    ck_assert_int_eq(s, KVQ_ENOMEM);
    ck_assert_msg(strstr(err.msg, "outlier_max 100") && strstr(err.msg, "sequence 0"), "message: %s", err.msg);
    size_t len = kvq_kvcache_len(c, 0);
    ck_assert_uint_gt(len, 1);
    ck_assert_uint_lt(len, NT);
    kvq_kvcache_stats_get(c, &st);
    ck_assert_uint_le(st.k_outliers, 100 * H);
    ck_assert_uint_le(st.outlier_capacity, 100);
    ck_assert_int_eq(kvq_kvcache_dequant(c, 0, kd, vd, &err), KVQ_OK);
    nuq_reference(&g, NULL, NULL, K, V, len, Kr, Vr);
    check_close(kd, Kr, len * C, 1e-6, "keys before the failure");
    /* and the next append fails the same way, the sequence untouched */
    ck_assert_int_eq(kvq_kvcache_append(c, 0, K + len * C, V + len * C, 1, &err), KVQ_ENOMEM);
    ck_assert_uint_eq(kvq_kvcache_len(c, 0), len);
    free(K); free(V); free(Kr); free(Vr); free(kd); free(vd);
    kvq_kvcache_free(c);
}
END_TEST

/* ---- KIVI --------------------------------------------------------------------------------- */

static void run_kivi(size_t H, size_t D, size_t grp, int kb, int vb, size_t G, size_t R, size_t n_sink, bool post)
{
    size_t C = H * D, NT = 3 * (R ? R : G) + 2 * G + 5, n_heads = H * grp;
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_KIVI;
    g.n_seqs = 1; g.n_kv_heads = H; g.head_dim = D; g.max_tokens = NT;
    g.k_bits = kb; g.v_bits = vb; g.n_sink = n_sink; g.group = G; g.residual = R; g.post_rope = post;
    g.rope.rope_dim = D; g.rope.rope_theta = 500;
    kvq_kvcache *c;
    kvq_err err;
    ck_assert_msg(kvq_kvcache_create(&c, &g, &err) == KVQ_OK, "%s", err.msg);
    float *K = malloc(NT * C * 4), *V = malloc(NT * C * 4), *Kr = malloc(NT * C * 4), *Vr = malloc(NT * C * 4);
    float *Kq = malloc(NT * C * 4), *Vq = malloc(NT * C * 4), *Kp = malloc(NT * C * 4);
    float *q = malloc(n_heads * D * 4), *o = malloc(n_heads * D * 4), *ro = malloc(n_heads * D * 4);
    fill(K, NT, C, 1);
    fill(V, NT, C, 0);
    /* the quantization domain of keys: post-RoPE (rotated then fp16, as the cache's residual holds it) or pre */
    memcpy(Kp, K, NT * C * 4);
    if (post) { ck_assert_int_eq(kvq_rope_rotate(Kp, NT, H, D, &g.rope, 0, &err), KVQ_OK); round_rows(Kp, NT * C); }
    kvq_kvcache_view vw;
    for (size_t t = 0; t < NT; t++) {
        ck_assert_msg(kvq_kvcache_append(c, 0, K + t * C, V + t * C, 1, &err) == KVQ_OK, "%s", err.msg);
        size_t kbd = kvq_kivi_key_boundary(t, G, R, n_sink), vbd = kvq_kivi_value_boundary(t, R, n_sink);
        kvq_kvcache_view_get(c, &vw);
        ck_assert_uint_eq(vw.kq[0] + n_sink, t < n_sink ? n_sink : kbd);
        ck_assert_uint_eq(vw.vq[0] + n_sink, t < n_sink ? n_sink : vbd);
        /* residual never exceeds R (+1 value while attending), as KIVI's windows */
        ck_assert_uint_le(t + 1 - (vw.kq[0] + n_sink < t + 1 ? vw.kq[0] + n_sink : t + 1), R ? R : G);
        /* reference: quant.h on the whole window, boundaries select quantized vs fp16 rows */
        size_t len = t + 1;
        ck_assert_int_eq(kvq_kivi_keys(Kq, Kp, len, C, G, kb, n_sink, NULL, &err), KVQ_OK);
        ck_assert_int_eq(kvq_kivi_values(Vq, V, len, C, D, G, vb, n_sink, NULL, &err), KVQ_OK);
        for (size_t j = 0; j < len; j++) {
            bool kqz = j >= n_sink && j < kbd, vqz = j >= n_sink && j < vbd;
            for (size_t ch = 0; ch < C; ch++) {
                Kr[j * C + ch] = kqz ? Kq[j * C + ch] : kvq_round_fp16(Kp[j * C + ch]);
                Vr[j * C + ch] = vqz ? Vq[j * C + ch] : kvq_round_fp16(V[j * C + ch]);
            }
        }
        if (!post) ck_assert_int_eq(kvq_rope_rotate(Kr + n_sink * C, len > n_sink ? len - n_sink : 0, H, D, &g.rope, n_sink, &err), KVQ_OK);
        /* sink rows are stored post-RoPE in fp16 either way */
        float sk[64 * 8];
        for (size_t j = 0; j < n_sink && j < len; j++) {
            memcpy(sk, K + j * C, C * 4);
            ck_assert_int_eq(kvq_rope_rotate(sk, 1, H, D, &g.rope, j, &err), KVQ_OK);
            for (size_t ch = 0; ch < C; ch++) Kr[j * C + ch] = kvq_round_fp16(sk[ch]);
        }
        for (size_t i = 0; i < n_heads * D; i++) q[i] = (float)gauss();
        ck_assert_int_eq(kvq_kvcache_attend(c, q, n_heads, 0, o, &err), KVQ_OK);
        ref_attend(q, n_heads, H, D, Kr, Vr, len, ro);
        check_close(o, ro, n_heads * D, 2e-6, "kivi decode vs simulation");
    }
    free(K); free(V); free(Kr); free(Vr); free(Kq); free(Vq); free(Kp); free(q); free(o); free(ro);
    kvq_kvcache_free(c);
}

START_TEST(test_kivi)
{
    run_kivi(2, 16, 2, 2, 2, 4, 8, 0, true);
    run_kivi(1, 32, 1, 4, 4, 8, 8, 1, true);
    run_kivi(2, 8, 3, 2, 4, 4, 0, 2, false);
    run_kivi(1, 24, 2, 3, 2, 4, 12, 0, false);
}
END_TEST

/* ---- errors and artifact ------------------------------------------------------------------- */

START_TEST(test_errors)
{
    float klev[16], vlev[16], lo[16], hi[16];
    kvq_kvcache_config g;
    kvq_kvcache *c;
    kvq_err err;
    make_nuq_config(&g, 1, 2, 8, 4, 4, 1, 0.1, 1, 8, klev, vlev, lo, hi);
    g.head_dim = 300;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    ck_assert_msg(strstr(err.msg, "head_dim: expected 1..256, found 300"), "%s", err.msg);
    g.head_dim = 8;
    g.k_bits = 5;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EUNSUPPORTED);
    ck_assert_msg(strstr(err.msg, "k_bits"), "%s", err.msg);
    g.k_bits = 4;
    klev[3] = 2;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    ck_assert_msg(strstr(err.msg, "k_levels[0][3]"), "%s", err.msg);
    klev[3] = klev[2];
    lo[5] = hi[5] + 1;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    ck_assert_msg(strstr(err.msg, "channel 5"), "%s", err.msg);
    lo[5] = hi[5];
    g.rope.rope_dim = 10;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    g.rope.rope_dim = 8;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_OK);
    float k[16 * 10] = {0}, v[16 * 10] = {0};
    for (int i = 0; i < 160; i++) { k[i] = (float)i / 7; v[i] = (float)i / 9; }
    ck_assert_int_eq(kvq_kvcache_append(c, 1, k, v, 1, &err), KVQ_EINVAL); /* no sequence 1 */
    ck_assert_int_eq(kvq_kvcache_append(c, 0, k, v, 9, &err), KVQ_ENOMEM); /* max_tokens 8 */
    ck_assert_msg(strstr(err.msg, "max_tokens 8"), "%s", err.msg);
    k[17] = NAN;
    ck_assert_int_eq(kvq_kvcache_append(c, 0, k, v, 3, &err), KVQ_ENUMERIC);
    ck_assert_msg(strstr(err.msg, "new token 1 channel 1"), "%s", err.msg);
    ck_assert_uint_eq(kvq_kvcache_len(c, 0), 0);
    k[17] = 0;
    ck_assert_int_eq(kvq_kvcache_set_prefix(c, 0, k, v, &err), KVQ_EINVAL); /* prefix_len 0 */
    float q[3 * 8], o[3 * 8];
    ck_assert_int_eq(kvq_kvcache_attend(c, q, 3, 0, o, &err), KVQ_EINVAL);  /* 3 heads over 2 KV heads */
    for (int i = 0; i < 24; i++) q[i] = 1;
    ck_assert_int_eq(kvq_kvcache_attend(c, q, 2, 0, o, &err), KVQ_OK);      /* empty sequence: zeros */
    for (int i = 0; i < 16; i++) ck_assert_float_eq(o[i], 0);
    kvq_kvcache_free(c);
    g.prefix_len = 2;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_OK);
    ck_assert_int_eq(kvq_kvcache_append(c, 0, k, v, 1, &err), KVQ_EINVAL);  /* prefix first */
    ck_assert_msg(strstr(err.msg, "prefix"), "%s", err.msg);
    kvq_kvcache_free(c);
    memset(&g, 0, sizeof g);
    g.format = KVQ_KVCACHE_KIVI; g.n_seqs = 1; g.n_kv_heads = 1; g.head_dim = 16; g.max_tokens = 8;
    g.k_bits = g.v_bits = 2; g.group = 6; g.residual = 12;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    ck_assert_msg(strstr(err.msg, "group"), "%s", err.msg);
    g.group = 4; g.residual = 6;
    ck_assert_int_eq(kvq_kvcache_create(&c, &g, &err), KVQ_EINVAL);
    ck_assert_msg(strstr(err.msg, "residual"), "%s", err.msg);
}
END_TEST

START_TEST(test_from_artifact)
{
    kvq_artifact a;
    memset(&a, 0, sizeof a);
    float kl[2 * 4] = {-1, -0.2f, 0.3f, 1, -1, 0, 0.5f, 1}, vl[4] = {-1, -0.5f, 0.5f, 1}, lo[8], hi[8];
    for (int i = 0; i < 8; i++) { lo[i] = -1; hi[i] = 1 + (float)i; }
    kvq_kv_table kt = {0}, vt = {0};
    kt.bits = 2; kt.n_tables = 2; kt.kv_dim = 8; kt.levels = kl; kt.channel_lower = lo; kt.channel_upper = hi;
    vt.bits = 2; vt.n_tables = 1; vt.kv_dim = 8; vt.levels = vl;
    a.p.method = KVQ_FAM("nuq"); a.p.k_bits = 2; a.p.v_bits = 2; a.p.outlier_frac = 0.01; a.p.n_sink = 1;
    a.p.n_layers = 1; a.p.n_kv_heads = 2; a.p.head_dim = 4; a.p.per_head = true;
    a.k = &kt; a.v = &vt;
    kvq_kvcache_config g;
    memset(&g, 0, sizeof g);
    kvq_err err;
    ck_assert_int_eq(kvq_kvcache_config_from_artifact(&g, &a, 0, &err), KVQ_OK);
    ck_assert_int_eq(g.format, KVQ_KVCACHE_NUQ);
    ck_assert_uint_eq(g.k_tables, 2);
    ck_assert_ptr_eq(g.k_levels, kl);
    ck_assert_ptr_eq(g.k_upper, hi);
    ck_assert_uint_eq(g.n_sink, 1);
    ck_assert_double_eq(g.outlier_frac, 0.01);
    g.n_seqs = 1; g.max_tokens = 16; g.rope.rope_dim = 4; g.rope.rope_theta = 10000;
    kvq_kvcache *c;
    ck_assert_msg(kvq_kvcache_create(&c, &g, &err) == KVQ_OK, "%s", err.msg);
    kvq_kvcache_free(c);
    ck_assert_int_eq(kvq_kvcache_config_from_artifact(&g, &a, 1, &err), KVQ_EINVAL);
    a.p.method = KVQ_FAM("int");
    ck_assert_int_eq(kvq_kvcache_config_from_artifact(&g, &a, 0, &err), KVQ_EUNSUPPORTED);
    a.p.method = KVQ_FAM("kivi"); a.p.group_size = 2; a.p.residual_length = 4;
    ck_assert_int_eq(kvq_kvcache_config_from_artifact(&g, &a, 0, &err), KVQ_OK);
    ck_assert_int_eq(g.format, KVQ_KVCACHE_KIVI);
    ck_assert_uint_eq(g.group, 2);
    ck_assert_uint_eq(g.residual, 4);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvcache");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_pack_roundtrip);
    tcase_add_test(tc, test_nuq_equiv);
    tcase_add_test(tc, test_prefix_and_sink);
    tcase_add_test(tc, test_outlier_growth);
    tcase_add_test(tc, test_kivi);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_from_artifact);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
