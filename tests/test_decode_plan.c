/* test_decode_plan.c — the memory planner of the decode-step benchmark (tests/gpu/decode_plan.h) on the CPU:
 * the Llama-2-7B parameter count against the published one, the cache arrays against the allocation a CPU
 * kvq_kvcache of the same configuration reports (kvq_kvcache_view: the GPU cache has the same layout,
 * formats/KVCACHE.md), and the longest-context search against its own fit rule. */
#include "kvq_test.h"

#include "gpu/decode_plan.h"
#include "kvcache.h"

/* Llama-2-7B: 6,738,415,616 parameters (Touvron et al. 2023; the Hugging Face checkpoint's count), i.e. the
 * GEMM weights, the untied embedding and LM head, and 2 RMSNorm gains per layer plus the final one */
START_TEST(test_weights)
{
    const kvq_dp_model m = kvq_dp_llama2_7b();
    const uint64_t norms = (2 * m.n_layers + 1) * m.dim;
    ck_assert_uint_eq(kvq_dp_weight_params(&m) + norms, 6738415616ull);
    ck_assert_uint_eq(kvq_dp_weight_bytes(&m), 2 * kvq_dp_weight_params(&m) + 4 * norms);
    /* a step reads every GEMM weight, not the embedding table beyond its B rows */
    ck_assert_uint_eq(kvq_dp_weight_bytes_read(&m, 1), kvq_dp_weight_bytes(&m) - 2ull * 32000 * 4096 + 2 * 4096);
}
END_TEST

/* the sizes of the arrays a CPU cache of cfg allocated, from its view (the layout of kvcache.h's raw view) */
static uint64_t view_array_bytes(const kvq_kvcache_config *cfg)
{
    kvq_kvcache *c = NULL;
    kvq_err err;
    ck_assert_msg(kvq_kvcache_create(&c, cfg, &err) == KVQ_OK, "%s", err.msg);
    kvq_kvcache_view v;
    kvq_kvcache_view_get(c, &v);
    const uint64_t B = cfg->n_seqs, H = cfg->n_kv_heads, D = cfg->head_dim, C = H * D, ne = v.n_exact ? v.n_exact : 1;
    uint64_t b = 2 * B * H * ne * D * 2 + B * H * (v.k_head_words + v.v_head_words) * v.capq * 4;
    if (cfg->format == KVQ_KVCACHE_NUQ)
        b += 2 * B * H * (v.capq + 1) * 4 + 2 * B * H * v.ent_cap * 4 + B * v.capq * 2 * 4;
    else
        b += B * H * v.capq * (D / cfg->group) * 2 * 4 + B * (v.capq / cfg->group + 1) * C * 2 * 4 + 2 * B * v.ring * C * 2;
    kvq_kvcache_free(c);
    return b;
}

START_TEST(test_cache_arrays)
{
    float lo[8 * 64], hi[8 * 64];
    for (int i = 0; i < 8 * 64; i++) { lo[i] = -2; hi[i] = 2; }
    const size_t Ts[4] = {33, 1000, 4099, 8192}, Ds[2] = {64, 128};
    int n = 0;
    for (int di = 0; di < 2; di++)
        for (int ti = 0; ti < 4; ti++)
            for (int bits = 2; bits <= 4; bits++)
                for (int fmt = 0; fmt < 3; fmt++) {
                    const size_t D = Ds[di], T = Ts[ti], B = 3, H = 4;
                    const kvq_dp_model m = {1, H * D, H, H, D, 4 * H * D, 100};
                    kvq_kvcache_config cfg;
                    memset(&cfg, 0, sizeof cfg);
                    cfg.n_seqs = B; cfg.n_kv_heads = H; cfg.head_dim = D; cfg.max_tokens = T; cfg.k_bits = cfg.v_bits = bits;
                    cfg.rope.rope_dim = D; cfg.rope.rope_theta = 10000;
                    kvq_dp_cache pc;
                    memset(&pc, 0, sizeof pc);
                    pc.bits = bits;
                    if (fmt == 0) { /* NUQ, 1 sink, 1% outliers, the benchmark's entry capacity */
                        cfg.format = KVQ_KVCACHE_NUQ; cfg.n_sink = 1; cfg.outlier_frac = 0.01; cfg.k_tables = cfg.v_tables = 1;
                        cfg.k_lower = lo; cfg.k_upper = hi;
                        static float lv[3][16];
                        for (int j = 0; j < (1 << bits); j++) lv[bits - 2][j] = -1.0f + 2.0f * j / ((1 << bits) - 1);
                        cfg.k_levels = cfg.v_levels = lv[bits - 2];
                        cfg.outlier_cap = kvq_dp_ent_cap(T - 20, 1, 20);
                        pc.format = KVQ_DP_NUQ; pc.n_sink = 1; pc.ent_cap = cfg.outlier_cap;
                    } else { /* KIVI: group 32, residual 128; group = head_dim, residual 0 */
                        if (bits == 3) continue;
                        cfg.format = KVQ_KVCACHE_KIVI; cfg.post_rope = true;
                        cfg.group = fmt == 1 ? 32 : D; cfg.residual = fmt == 1 ? 128 : 0;
                        pc.format = KVQ_DP_KIVI; pc.group = cfg.group; pc.residual = cfg.residual;
                    }
                    const uint64_t want = view_array_bytes(&cfg), got = kvq_dp_cache_array_bytes(&m, &pc, B, T);
                    ck_assert_msg(got == want, "format %d bits %d D %zu T %zu: planner %llu bytes, the CPU cache allocates %llu", fmt, bits, D, T,
                                  (unsigned long long)got, (unsigned long long)want);
                    /* the tables are small next to the arrays and counted */
                    ck_assert_uint_gt(kvq_dp_cache_table_bytes(&m, &pc, B, T), 0);
                    ck_assert_uint_eq(kvq_dp_cache_bytes(&m, &pc, B, T), got + kvq_dp_cache_table_bytes(&m, &pc, B, T));
                    n++;
                }
    ck_assert_int_eq(n, 2 * 4 * (3 + 2 + 2));
}
END_TEST

START_TEST(test_fp16_and_moonshot_sizes)
{
    const kvq_dp_model m = kvq_dp_llama2_7b();
    const kvq_dp_cache f16 = {KVQ_DP_FP16, 0, 0, 0, 0, 0};
    /* the fp16 cache of 128K positions at B = 1 is 64 GiB (2 · 32 layers · 32 heads · 128 · 2 bytes per position) */
    ck_assert_uint_eq(kvq_dp_caches_bytes(&m, &f16, 1, 131072), 64ull << 30);
    /* nuq2-1% at 1M positions, B = 1: 2-bit codes (1 KiB a layer per position for K and for V), value scales, sparse row
     * pointers and ~1 entry per row: ~2.6 KiB a layer, ~88 GB in all — fits an H200 (139 GB) next to 13.5 GB of weights,
     * not an 80 GB H100 */
    const size_t N = 1048576, extra = 30;
    kvq_dp_cache nuq2 = {KVQ_DP_NUQ, 2, 1, kvq_dp_ent_cap(N, 1, extra), 0, 0};
    const uint64_t b = kvq_dp_caches_bytes(&m, &nuq2, 1, N + extra);
    ck_assert_uint_gt(b, 85e9);
    ck_assert_uint_lt(b, 92e9);
    ck_assert(kvq_dp_fits(&m, &nuq2, 1, N + extra, 125e9, 2ull << 30));
    ck_assert(!kvq_dp_fits(&m, &nuq2, 1, N + extra, 66e9, 2ull << 30));
}
END_TEST

START_TEST(test_longest)
{
    const kvq_dp_model m = kvq_dp_llama2_7b();
    const size_t extra = 30, step = 4096;
    const uint64_t frees[4] = {5e9, 66e9, 125e9, 1e12}, margin = 2ull << 30;
    for (int fi = 0; fi < 4; fi++)
        for (int fmt = 0; fmt < 4; fmt++)
            for (size_t B = 1; B <= 32; B += 31) {
                kvq_dp_cache c = {fmt == 0 ? KVQ_DP_FP16 : fmt == 3 ? KVQ_DP_KIVI : KVQ_DP_NUQ, fmt == 1 ? 3 : 2, fmt == 1 || fmt == 2, 0, 128, 128};
                const size_t N = kvq_dp_longest(&m, c, B, extra, 1, frees[fi], margin, step, (size_t)1 << 26);
                ck_assert_uint_eq(N % step, 0);
                kvq_dp_cache a = c, z = c;
                if (c.format == KVQ_DP_NUQ) {
                    a.ent_cap = kvq_dp_ent_cap(N, 1, extra);
                    z.ent_cap = kvq_dp_ent_cap(N + step, 1, extra);
                }
                if (N) ck_assert_msg(kvq_dp_fits(&m, &a, B, N + extra, frees[fi], margin), "fmt %d B %zu: N %zu does not fit", fmt, B, N);
                ck_assert_msg(!kvq_dp_fits(&m, &z, B, N + step + extra, frees[fi], margin), "fmt %d B %zu: N %zu + %zu fits too", fmt, B, N, step);
            }
    /* 5 GB hold no fp16 context of 4096 positions at B = 32 (2 GiB margin + 64 GiB of cache) */
    kvq_dp_cache f16 = {KVQ_DP_FP16, 0, 0, 0, 0, 0};
    ck_assert_uint_eq(kvq_dp_longest(&m, f16, 32, extra, 1, 5e9, margin, step, (size_t)1 << 26), 0);
    /* 66 GB free (an 80 GB H100 after the weights): fp16 at B = 1 stops short of 128K */
    const size_t n16 = kvq_dp_longest(&m, f16, 1, extra, 1, 66e9, margin, step, (size_t)1 << 26);
    ck_assert_uint_lt(n16, 131072);
    ck_assert_uint_gt(n16, 110000);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("decode_plan");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_weights);
    tcase_add_test(tc, test_cache_arrays);
    tcase_add_test(tc, test_fp16_and_moonshot_sizes);
    tcase_add_test(tc, test_longest);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
