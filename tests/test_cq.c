/* test_cq.c — coupled quantization (kernels/schemes/cq.c) and its
 * c-dimensional k-means (kernels/quant/vq.h):
 *  - vq: the nearest codeword against a brute-force double search; k-means
 *    recovers planted clusters, weights of 0 never move a centre, weights
 *    pull centres, deterministic, errors named; the bounded Lloyd equals a
 *    plain Lloyd written here (from a given codebook) and the exhaustive mode
 *    (from a seed) bit for bit on tie-heavy, subnormal and wide-range data,
 *    objective non-increasing and equal to a float64 recomputation;
 *  - kvdump --fisher -> kvcalib --method cq -> kveval on both tiny models:
 *    codebook shapes; the Fisher-weighted codebook has a lower Fisher-weighted
 *    error than the unweighted one on the calibration vectors (recomputed
 *    here from the dump); decode equivalence of the in-place cache (pre-RoPE
 *    keys, sink tokens) against a token-by-token loop whose reference
 *    quantizer is a brute-force nearest centroid written here;
 *  - the artifact: round trip byte for byte, --inspect, a missing / misshapen
 *    codebook refused, a spec whose c / b differ from the artifact's refused;
 *  - kvcalib --group / --param errors; spec parsing and bits by hand. */
#include <math.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "artifact.h"
#include "calibrate.h"
#include "dump.h"
#include "family.h"
#include "family_env.h"
#include "kv_desc.h"
#include "kvq_test.h"
#include "scheme.h"
#include "vq.h"

static void tmp(char *buf, size_t n, const char *tag) { snprintf(buf, n, "/tmp/kvq_test_cq_%d_%s", (int)getpid(), tag); }

static uint64_t rng_s = 12345;
static double unif(void)
{
    uint64_t z = (rng_s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((double)((z ^ (z >> 31)) >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

/* brute force in double: the index of the smallest squared distance */
static size_t nearest_ref(const float *x, const float *cb, size_t K, size_t c)
{
    size_t best = 0;
    double bd = INFINITY;
    for (size_t k = 0; k < K; k++) {
        double s = 0;
        for (size_t d = 0; d < c; d++) s += ((double)x[d] - cb[k * c + d]) * ((double)x[d] - cb[k * c + d]);
        if (s < bd) {
            bd = s;
            best = k;
        }
    }
    return best;
}

START_TEST(test_vq_kmeans)
{
    enum { C = 4, K = 6, PER = 200, N = K * PER };
    float centres[K][C], x[N * C], w[N], cb[K * C], cbt[K * C], dist[K];
    for (int k = 0; k < K; k++)
        for (int d = 0; d < C; d++) centres[k][d] = (float)(10 * gauss());
    for (int i = 0; i < N; i++)
        for (int d = 0; d < C; d++) x[i * C + d] = centres[i % K][d] + (float)(0.1 * gauss());
    kvq_err e = {0};
    kvq_vq_opts o = {.max_iter = 50, .seed = 3};
    kvq_vq_report rep;
    ck_assert_msg(kvq_vq_kmeans(x, NULL, N, C, K, &o, cb, &rep, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(rep.n_used, K);
    /* every planted centre recovered (the mean of its 200 points: within 0.05) */
    for (int k = 0; k < K; k++) {
        size_t j = nearest_ref(centres[k], cb, K, C);
        for (int d = 0; d < C; d++) ck_assert_msg(fabs(cb[j * C + d] - centres[k][d]) < 0.05, "centre %d dim %d", k, d);
    }
    ck_assert_msg(rep.objective / N < 0.1 * 0.1 * C * 1.2, "objective %g", rep.objective);
    /* the nearest codeword against brute force on random points */
    kvq_vq_transpose(cbt, cb, K, C);
    for (int i = 0; i < 500; i++) {
        float p[C];
        for (int d = 0; d < C; d++) p[d] = (float)(10 * gauss());
        ck_assert_uint_eq(kvq_vq_nearest_t(p, cbt, K, C, dist), nearest_ref(p, cb, K, C));
    }
    /* ties to the lowest index */
    float tie[2 * C] = {1, 1, 1, 1, 1, 1, 1, 1}, tt[2 * C], z[C] = {0};
    kvq_vq_transpose(tt, tie, 2, C);
    ck_assert_uint_eq(kvq_vq_nearest_t(z, tt, 2, C, dist), 0);
    /* deterministic */
    float cb2[K * C];
    ck_assert(kvq_vq_kmeans(x, NULL, N, C, K, &o, cb2, NULL, &e) == KVQ_OK);
    ck_assert_int_eq(memcmp(cb, cb2, sizeof cb), 0);
    /* one centre, weights: the weighted mean; points of weight 0 do not count */
    for (int i = 0; i < N; i++) w[i] = i < N / 2 ? (float)(1 + i % 3) : 0.0f;
    ck_assert(kvq_vq_kmeans(x, w, N, C, 1, &o, cb2, &rep, &e) == KVQ_OK);
    for (int d = 0; d < C; d++) {
        double s = 0, sw = 0;
        for (int i = 0; i < N / 2; i++) {
            s += w[i] * x[i * C + d];
            sw += w[i];
        }
        ck_assert_double_eq_tol(cb2[d], s / sw, 1e-4 * (fabs(s / sw) + 1));
    }
    /* fewer distinct points than codewords: every point a centre, J = 0 */
    float cb8[8 * C]; /* 8 codewords: a buffer of 8 * C (the K-codeword cb2 is too small; ASan caught it) */
    ck_assert(kvq_vq_kmeans(x, NULL, 3, C, 8, &o, cb8, &rep, &e) == KVQ_OK);
    ck_assert_double_eq(rep.objective, 0);
    /* errors */
    for (int i = 0; i < N; i++) w[i] = 0;
    ck_assert_int_eq(kvq_vq_kmeans(x, w, N, C, K, &o, cb2, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "all 1200 points have weight 0"), "%s", e.msg);
    w[7] = -1;
    ck_assert_int_eq(kvq_vq_kmeans(x, w, N, C, K, &o, cb2, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "weight of point 7"), "%s", e.msg);
    ck_assert_int_eq(kvq_vq_kmeans(x, NULL, N, C, 0, &o, cb2, NULL, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_vq_kmeans(x, NULL, 0, C, K, &o, cb2, NULL, &e), KVQ_EINVAL);
}
END_TEST

/* Lloyd as vq.h documents it, written plainly: every point searched against every codeword each iteration
 * (float squared distance summed over d in order, ties to the lowest index), centres = weighted means in
 * double in point order, stop when at most 0.1% of the assignments change or after max_iter updates.
 * J[t] = the objective after assignment t; returns the number of updates. */
static int lloyd_ref(const float *x, const float *w, size_t n, size_t c, size_t K, int max_iter, float *cb, double *J)
{
    uint32_t *as = malloc(n * sizeof *as);
    double *sum = malloc(K * c * sizeof *sum), *sw = malloc(K * sizeof *sw);
    int it = 0;
    for (;;) {
        size_t changed = 0;
        J[it] = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t best = 0;
            float bd = INFINITY;
            for (size_t k = 0; k < K; k++) {
                float e = x[i * c] - cb[k * c], s = e * e;
                for (size_t d = 1; d < c; d++) {
                    e = x[i * c + d] - cb[k * c + d];
                    s += e * e;
                }
                if (k == 0 || s < bd) {
                    bd = s;
                    best = (uint32_t)k;
                }
            }
            if (it == 0 || best != as[i]) changed++;
            as[i] = best;
            J[it] += (w ? (double)w[i] : 1.0) * (double)bd;
        }
        if (changed * 1000 <= n || it == max_iter) break;
        memset(sum, 0, K * c * sizeof *sum);
        memset(sw, 0, K * sizeof *sw);
        for (size_t i = 0; i < n; i++) {
            double wi = w ? (double)w[i] : 1.0;
            if (wi <= 0) continue;
            sw[as[i]] += wi;
            for (size_t d = 0; d < c; d++) sum[as[i] * c + d] += wi * (double)x[i * c + d];
        }
        for (size_t k = 0; k < K; k++)
            if (sw[k] > 0)
                for (size_t d = 0; d < c; d++) cb[k * c + d] = (float)(sum[k * c + d] / sw[k]);
        it++;
    }
    free(as);
    free(sum);
    free(sw);
    return it;
}

/* J in float64: every point against its nearest codeword by a double brute force */
static double objective64(const float *x, const float *w, size_t n, size_t c, size_t K, const float *cb)
{
    double J = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = nearest_ref(x + i * c, cb, K, c);
        double s = 0;
        for (size_t d = 0; d < c; d++) s += ((double)x[i * c + d] - cb[k * c + d]) * ((double)x[i * c + d] - cb[k * c + d]);
        J += (w ? (double)w[i] : 1.0) * s;
    }
    return J;
}

/* The bounds (Hamerly) and the seeding's first assignment skip work, never change a result: against the
 * plain Lloyd above from the same initial codebook, and against the exhaustive mode from the same seed, the
 * codebook, iterations and objective are equal bit for bit, on data made to break float margins: heavy
 * ties (points and codewords on an integer grid, duplicated codewords), magnitudes whose squares are
 * subnormal, zero weights, clustered Fisher-like weights. Where squares are normal floats the objective
 * never increases over the iterations and the reported one is the float64 objective of the codebook. */
START_TEST(test_vq_kmeans_bounds_exact)
{
    enum { N = 1500, KMAX = 64, CMAX = 8, IT = 25 };
    static float x[N * CMAX], w[N], init[KMAX * CMAX], cb[KMAX * CMAX], ref[KMAX * CMAX], ex[KMAX * CMAX];
    static double J[IT + 1];
    struct {
        size_t c, K;
        int data; /* 0 clustered gaussian, 1 integer grid (ties), 2 subnormal squares, 3 wide dynamic range */
        bool weighted;
    } cases[] = {{2, 64, 0, true}, {4, 32, 1, false}, {8, 16, 1, true}, {2, 16, 2, true}, {4, 64, 3, true}, {1, 8, 1, false}};
    kvq_err e = {0};
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        size_t c = cases[t].c, K = cases[t].K;
        rng_s = 777 + t;
        for (size_t i = 0; i < N; i++) {
            size_t cl = (size_t)(unif() * 12);
            for (size_t d = 0; d < c; d++) {
                double v;
                switch (cases[t].data) {
                case 0: v = cl * 0.7 + 0.2 * gauss(); break;
                case 1: v = floor(3 * unif()) - 1; break;
                case 2: v = 1e-22 * (cl + gauss()); break;
                default: v = pow(10, 4 * unif() - 2) * gauss(); break;
                }
                x[i * c + d] = (float)v;
            }
            w[i] = (float)(i % 7 == 3 ? 0 : 1e-9 * exp(3 * gauss()));
        }
        const float *wt = cases[t].weighted ? w : NULL;
        /* initial codebook: points, with codeword 1 a copy of codeword 0 (exact ties between codewords) */
        for (size_t k = 0; k < K; k++) memcpy(init + k * c, x + ((k == 1 ? 0 : k) * 37 % N) * c, c * sizeof(float));
        memcpy(ref, init, K * c * sizeof(float));
        int it_ref = lloyd_ref(x, wt, N, c, K, IT, ref, J);
        for (int i = 1; i <= it_ref && cases[t].data != 2; i++) /* (subnormal squares round too coarsely to be monotone) */
            ck_assert_msg(J[i] <= J[i - 1] * (1 + 1e-6), "case %zu: J rose at iteration %d: %.17g -> %.17g", t, i,
                                                         J[i - 1], J[i]);
        kvq_vq_report rep, rep2;
        kvq_vq_opts o = {.max_iter = IT, .init = init};
        ck_assert_msg(kvq_vq_kmeans(x, wt, N, c, K, &o, cb, &rep, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(memcmp(cb, ref, K * c * sizeof(float)) == 0, "case %zu: codebook differs from the plain Lloyd", t);
        ck_assert_int_eq(rep.iterations, it_ref);
        ck_assert_msg(rep.objective == J[it_ref], "case %zu: J %.17g vs %.17g", t, rep.objective, J[it_ref]);
        double j64 = objective64(x, wt, N, c, K, cb);
        ck_assert_msg(cases[t].data == 2 || fabs(rep.objective - j64) <= 1e-5 * j64, "case %zu: J %.17g vs float64 %.17g", t, rep.objective, j64);
        /* from k-means++ seeding: bounds and the seeding's assignment against the exhaustive mode */
        for (uint64_t seed = 1; seed <= 3; seed++) {
            kvq_vq_opts a = {.max_iter = IT, .seed = seed}, b = {.max_iter = IT, .seed = seed, .exhaustive = true};
            ck_assert_msg(kvq_vq_kmeans(x, wt, N, c, K, &a, cb, &rep, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_msg(kvq_vq_kmeans(x, wt, N, c, K, &b, ex, &rep2, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_msg(memcmp(cb, ex, K * c * sizeof(float)) == 0, "case %zu seed %d: codebook differs from the exhaustive", t, (int)seed);
            ck_assert_int_eq(rep.iterations, rep2.iterations);
            ck_assert_msg(rep.objective == rep2.objective, "case %zu: %.17g vs %.17g", t, rep.objective, rep2.objective);
            ck_assert_uint_eq(rep.n_used, rep2.n_used);
        }
    }
    /* a non-finite initial codebook is refused, naming the codeword */
    init[5] = NAN;
    kvq_vq_opts o = {.max_iter = 3, .init = init};
    ck_assert_int_eq(kvq_vq_kmeans(x, NULL, N, 1, 8, &o, cb, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "initial codebook: codeword 5"), "%s", e.msg);
}
END_TEST

typedef struct {
    const kvq_eval_scheme *s;
    int kvd;
} cref;

/* one token: every group of c channels replaced by its nearest centroid, found by brute force */
static void cq_ref(void *ctx, int layer, char side, int pos, float *x)
{
    const cref *r = ctx;
    const kvq_scheme *q = &r->s->s.q;
    if ((size_t)pos < q->n_sink) return;
    const kvq_kv_table *t = side == 'k' ? &r->s->art->k[layer] : &r->s->art->v[layer];
    const float *cb = kvq_kv_table_get(t, "codebook")->data;
    size_t c = q->group, K = (size_t)1 << q->k_bits;
    for (size_t g = 0; g < (size_t)r->kvd / c; g++) {
        const float *cg = cb + g * K * c;
        size_t best = 0;
        float bd = INFINITY;
        for (size_t k = 0; k < K; k++) {
            float s = 0;
            for (size_t d = 0; d < c; d++) {
                float e = x[g * c + d] - cg[k * c + d];
                s += e * e;
            }
            if (s < bd) {
                bd = s;
                best = k;
            }
        }
        memcpy(x + g * c, cg + best * c, c * sizeof(float));
    }
}

static void calibrate(const char *dump, const char *out, size_t c, int b, size_t sink, bool fisher, bool post_rope)
{
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("cq"));
    o.group_size = c;
    o.k_bits = o.v_bits = b;
    o.n_sink = sink;
    o.fisher = fisher;
    o.post_rope = post_rope;
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
}

/* sum over the non-sink calibration vectors of layer l, side w, of weight * squared error under codebook t */
static double weighted_error(kvq_dump_reader *r, int l, int w, const kvq_kv_table *t, size_t c, size_t K, size_t ns)
{
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    size_t kvd = (size_t)m->n_kv_heads * (size_t)m->head_dim, L = (size_t)m->seq_len;
    float *x = malloc(L * kvd * sizeof(float)), *f = malloc(L * kvd * sizeof(float));
    const float *cb = kvq_kv_table_get(t, "codebook")->data;
    kvq_err e = {0};
    double J = 0;
    for (int64_t s = 0; s < m->n_samples; s++) {
        ck_assert(kvq_dump_read(r, l, w ? KVQ_DUMP_V : KVQ_DUMP_K_PRE_ROPE, s, x, &e) == KVQ_OK);
        ck_assert(kvq_dump_read(r, l, w ? KVQ_DUMP_FISHER_V : KVQ_DUMP_FISHER_K_PRE_ROPE, s, f, &e) == KVQ_OK);
        for (size_t t = ns; t < L; t++)
            for (size_t g = 0; g < kvd / c; g++) {
                const float *xg = x + t * kvd + g * c;
                size_t k = nearest_ref(xg, cb + g * K * c, K, c);
                double wt = 0, err = 0;
                for (size_t d = 0; d < c; d++) {
                    wt += f[t * kvd + g * c + d];
                    err += pow(xg[d] - cb[(g * K + k) * c + d], 2);
                }
                J += wt * err;
            }
    }
    free(x);
    free(f);
    return J;
}

START_TEST(test_cq_chain_decode)
{
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        char mp[4096], dump[256], a0[256], a1[256], au[256];
        tmp(dump, sizeof dump, "dump.h5");
        KVQ_SKIP_IF(!fenv_dump(models[mi], 4, 64, true, dump, mp, sizeof mp), "../shared tiny model or WikiText-2 absent");
        tmp(a0, sizeof a0, "c2b4.st");
        tmp(a1, sizeof a1, "c4b6.st");
        tmp(au, sizeof au, "c2b4u.st");
        calibrate(dump, a0, 2, 4, 0, true, false);
        calibrate(dump, a1, 4, 6, 1, true, false);
        calibrate(dump, au, 2, 4, 0, false, false);
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(mp, &m, &e) == KVQ_OK, "%s", e.msg);
        char fp[65];
        ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
        const char *paths[] = {a0, a1, au};
        kvq_artifact_set set;
        ck_assert_msg(kvq_artifact_set_load(&set, paths, 3, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
        int kvd = kvq_kv_dim(&m.hp);
        for (int l = 0; l < m.hp.n_layers; l++) {
            const kvq_fam_tensor *t = kvq_kv_table_get(&set.a[1].v[l], "codebook");
            ck_assert_uint_eq(t->n_dims, 3);
            ck_assert_uint_eq(t->shape[0], (uint64_t)kvd / 4);
            ck_assert_uint_eq(t->shape[1], 64);
            ck_assert_uint_eq(t->shape[2], 4);
        }
        /* Fisher-guided centroids: lower Fisher-weighted error on the calibration vectors than unweighted ones
         * (summed over layers and sides), and the two differ */
        kvq_dump_reader *r;
        ck_assert(kvq_dump_open(dump, &r, &e) == KVQ_OK);
        double jf = 0, ju = 0;
        for (int l = 0; l < m.hp.n_layers; l++)
            for (int w = 0; w < 2; w++) {
                jf += weighted_error(r, l, w, w ? &set.a[0].v[l] : &set.a[0].k[l], 2, 16, 0);
                ju += weighted_error(r, l, w, w ? &set.a[2].v[l] : &set.a[2].k[l], 2, 16, 0);
            }
        kvq_dump_close(r);
        fprintf(stderr, "INFO cq-c2b4 %s: Fisher-weighted error of the Fisher-guided codebooks %.6g, of unweighted ones %.6g\n",
                m.path, jf, ju);
        ck_assert_msg(jf < ju, "Fisher-guided %g vs unweighted %g", jf, ju);
        const char *specs[] = {"cq-c2b4", "cq-c4b6", "cq-c2b4+artifact3"};
        for (int i = 0; i < 3; i++) {
            kvq_eval_scheme s;
            ck_assert_msg(kvq_eval_scheme_make(specs[i], &set, &m.hp, &s, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_int_eq(s.s.key_stage, KVQ_KEYS_PRE_ROPE);
            cref w = {&s, kvd};
            kvq_quant_counts c = fenv_decode_case(&m, &s, cq_ref, &w, false);
            ck_assert_uint_eq(c.n_sink, (uint64_t)m.hp.n_layers * s.s.q.n_sink * kvd);
            ck_assert_uint_eq(c.n_elems, (uint64_t)m.hp.n_layers * 48 * kvd);
            if (i == 1) ck_assert_str_eq(s.name, "cq-c4b6+sink1");
        }
        /* c / b must match the artifact's */
        kvq_eval_scheme s;
        ck_assert_int_eq(kvq_eval_scheme_make("cq-c4b4", &set, &m.hp, &s, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, "needs a kvcalib artifact of method cq with 4 channels per group (--group 4) and 4-bit codes"),
                      "%s", e.msg);
        ck_assert_int_eq(kvq_eval_scheme_make("cq-c4b4+artifact2", &set, &m.hp, &s, &e), KVQ_EMISMATCH);
        kvq_artifact_set_free(&set);
        kvq_model_free(&m);
        unlink(dump);
        unlink(a0);
        unlink(a1);
        unlink(au);
    }
}
END_TEST

START_TEST(test_cq_artifact_and_cli)
{
    char mp[4096], dump[256], a[256], b[256], bad[256], cmd[8192], out[8192], bin[4096];
    tmp(dump, sizeof dump, "dump2.h5");
    KVQ_SKIP_IF(!fenv_dump("models/llama2c/aidreams260K.bin", 2, 32, true, dump, mp, sizeof mp), "../shared tiny model absent");
    tmp(a, sizeof a, "rt_a.st");
    tmp(b, sizeof b, "rt_b.st");
    tmp(bad, sizeof bad, "bad.st");
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("cq"));
    o.group_size = 4;
    o.k_bits = o.v_bits = 3;
    o.x[0] = 7;
    o.x[1] = 40;
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, a, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact art;
    ck_assert_msg(kvq_artifact_read(a, &art, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_eq(art.p.method, KVQ_FAM("cq"));
    ck_assert_double_eq(art.p.x[0], 7);
    ck_assert_double_eq(art.p.x[1], 40);
    ck_assert_uint_eq(art.k[0].n_points, 40 * (art.p.n_kv_heads * art.p.head_dim / 4)); /* at most `points` vectors per group */
    ck_assert_uint_eq(art.k[0].n_elems, 64 * art.p.n_kv_heads * art.p.head_dim);       /* 2 x 32 tokens, no sink */
    ck_assert_msg(kvq_artifact_write(b, &art, &e) == KVQ_OK, "%s", e.msg);
    snprintf(cmd, sizeof cmd, "cmp %s %s", a, b);
    ck_assert_msg(fenv_run(cmd, out, sizeof out) == 0, "round trip differs: %s", out);
    /* the validator: a codebook of the wrong shape, a non-finite centroid */
    art.v[1].ft[0].shape[1] = 4;
    art.v[1].ft[0].shape[0] *= 2;
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.1.v.codebook: expected shape [") && strstr(e.msg, ", 8, 4]"), "%s", e.msg);
    art.v[1].ft[0].shape[1] = 8;
    art.v[1].ft[0].shape[0] /= 2;
    art.k[0].ft[0].data[3] = NAN;
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.0.k.codebook[3]: not finite"), "%s", e.msg);
    kvq_artifact_free(&art);
    /* the reader: a missing codebook, a misshapen one */
    fenv_rewrite(a, bad, "layers.1.k.codebook", false);
    ck_assert_int_eq(kvq_artifact_read(bad, &art, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "layers.1.k.codebook") && strstr(e.msg, "missing"), "%s", e.msg);
    fenv_rewrite(a, bad, "layers.2.v.codebook", true);
    ck_assert_int_ne(kvq_artifact_read(bad, &art, &e), KVQ_OK);
    ck_assert_msg(strstr(e.msg, "layers.2.v.codebook: expected shape ["), "%s", e.msg);
    /* --inspect */
    const char *kvcalib = kvq_test_bin(bin, sizeof bin, "kvcalib");
    ck_assert_msg(kvcalib, "%s: kvcalib not built (KVQ_BIN_DIR)", bin);
    snprintf(cmd, sizeof cmd, "%s --inspect %s", kvcalib, a);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "method        cq") && strstr(out, "iters         7 (kvq.cq.iters)") &&
                      strstr(out, "points        40 (kvq.cq.points)") &&
                      strstr(out, "4 channels per 3-bit code (0.75 code bits per channel)") && strstr(out, "Fisher-weighted") &&
                      strstr(out, "codebook [") && strstr(out, "x8x4] in ["),
                  "%s", out);
    /* kvstat's quantization error through the family's quantize, labelled with the canonical spec, baselines at
     * the code bits per element (round(3 / 4) = 1: int1, kivi1) */
    char kvstat_bin[4096], md[256];
    ck_assert_msg(kvq_test_bin(kvstat_bin, sizeof kvstat_bin, "kvstat"), "%s: kvstat not built", kvstat_bin);
    tmp(md, sizeof md, "kvstat.md");
    char js[256];
    tmp(js, sizeof js, "kvstat.json");
    snprintf(cmd, sizeof cmd, "%s %s --artifact %s --markdown %s --json %s -q", kvstat_bin, dump, a, md, js);
    ck_assert_msg(fenv_run(cmd, out, sizeof out) == 0, "%s", out);
    char *rep = kvq_test_slurp(md, NULL);
    ck_assert_msg(rep && strstr(rep, "| 0 | cq-c4b3 (artifact) |") && strstr(rep, "| 0 | int1/1 per-token |") &&
                      strstr(rep, "### Coupled-quantization codebooks") && strstr(rep, "(4 channels per 3-bit code)"),
                  "%s", rep ? rep : md);
    free(rep);
    /* the codebook view (nearest codeword counts, per-group squared error) against the quantization-error view (the
     * family's quantize, x - x_hat): the mean over the groups of the per-group MSE is the layer's MSE */
    char *jt = kvq_test_slurp(js, NULL);
    cJSON *root = cJSON_Parse(jt);
    ck_assert_ptr_nonnull(root);
    cJSON *cqj = cJSON_GetObjectItem(root, "cq_codebooks"), *qe = cJSON_GetObjectItem(root, "quant_error");
    ck_assert_ptr_nonnull(cqj);
    ck_assert_ptr_nonnull(qe);
    int G = cJSON_GetObjectItem(cqj, "n_groups")->valueint, nl = cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(cqj, "k"), "used_mean"));
    cJSON *s0 = cJSON_GetArrayItem(cJSON_GetObjectItem(qe, "schemes"), 0);
    ck_assert_str_eq(cJSON_GetObjectItem(s0, "name")->valuestring, "cq-c4b3 (artifact)");
    for (int w = 0; w < 2; w++) {
        cJSON *side = cJSON_GetObjectItem(cqj, w ? "v" : "k"), *mse = cJSON_GetObjectItem(side, "mse_per_group");
        for (int j = 0; j < nl; j++) {
            double m = 0;
            for (int g = 0; g < G; g++) m += cJSON_GetArrayItem(mse, j * G + g)->valuedouble / G;
            double want = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, w ? "mse_v" : "mse_k"), j)->valuedouble;
            ck_assert_msg(fabs(m - want) <= 1e-5 * want, "layer %d %c: codebook view %g, quantization error %g", j, w ? 'v' : 'k', m, want);
            double used = cJSON_GetArrayItem(cJSON_GetObjectItem(side, "used_mean"), j)->valuedouble,
                   ent = cJSON_GetArrayItem(cJSON_GetObjectItem(side, "entropy_bits_mean"), j)->valuedouble;
            ck_assert_msg(used >= 1 && used <= 8 && ent > 0 && ent <= 3 + 1e-9, "layer %d: used %g, entropy %g", j, used, ent);
        }
    }
    cJSON_Delete(root);
    free(jt);
    unlink(js);
    unlink(md);
    /* kvcalib options: the rules named, nothing written */
    struct { const char *args; int code; const char *want; } cases[] = {
        {"--group 3", 1, "group_size: cq's channels per group must divide head_dim 16"}, /* cq's rule, not int's kv_dim one */
        {"--group 32", 1, "group_size: cq's channels per group must divide head_dim 16"},
        {"--group 4 --param iters=0", 1, "iters: expected an integer 1..1000"},
        {"--group 4 --param points=1.5", 1, "points: expected an integer 1..1e8"},
        /* fewer vectors than the 16 codewords: the fit made a codebook of copies (relative error ~2, worse than zeros) */
        {"--group 4 --param points=15", 1, "points: 15 calibration vectors per group cannot fit 16 codewords (4-bit codes)"},
        {"--group 4 --param seed=1", 2, "NAME one of method cq's parameters (iters, points)"},
        {"--group 4 --outliers 0.01", 2, "outlier fraction: method cq keeps no outliers"},
        {"--group 4 --residual 8", 2, "residual length: only kivi has one, method is cq"},
    };
    unlink(b);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(cmd, sizeof cmd, "%s %s --method cq --bits 4 %s --out %s", kvcalib, dump, cases[i].args, b);
        int rc = fenv_run(cmd, out, sizeof out);
        ck_assert_msg(rc == cases[i].code && strstr(out, cases[i].want), "%s: exit %d: %s", cases[i].args, rc, out);
        ck_assert_int_ne(access(b, F_OK), 0);
    }
    /* a dump without Fisher: the default (Fisher-guided) refused with the hint; --no-fisher works */
    char nof[256];
    tmp(nof, sizeof nof, "nofisher.h5");
    ck_assert(fenv_dump("models/llama2c/aidreams260K.bin", 2, 32, false, nof, mp, sizeof mp));
    snprintf(cmd, sizeof cmd, "%s %s --method cq --bits 4 --group 4 --out %s", kvcalib, nof, b);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "fisher_k_pre_rope") && strstr(out, "--no-fisher"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s %s --method cq --bits 4 --group 4 --no-fisher --quiet --out %s", kvcalib, nof, b);
    ck_assert_msg(fenv_run(cmd, out, sizeof out) == 0, "%s", out);
    unlink(nof);
    unlink(a);
    unlink(b);
    unlink(bad);
    unlink(dump);
}
END_TEST

START_TEST(test_cq_spec_bits)
{
    kvq_scheme_spec sp;
    kvq_err e = {0};
    ck_assert(kvq_scheme_parse("cq-c8b8", &sp, &e) == KVQ_OK);
    ck_assert_ptr_eq(sp.q.fam, KVQ_FAM("cq"));
    ck_assert_uint_eq(sp.q.group, 8);
    ck_assert_int_eq(sp.q.k_bits, 8);
    ck_assert_int_eq(sp.key_stage, KVQ_KEYS_PRE_ROPE);
    kvq_bits b;
    /* 8 bits per 8 channels + 256 fp16 centroids of 8 numbers per 8 channels over 2048 tokens = 1 + 2 */
    ck_assert(kvq_scheme_bits(&sp.q, 2048, 192, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 3.0, 1e-12);
    ck_assert_double_eq_tol(b.v, 3.0, 1e-12);
    ck_assert(kvq_scheme_parse("cq-c2b8+sink1", &sp, &e) == KVQ_OK);
    ck_assert(kvq_scheme_bits(&sp.q, 512, 192, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, ((4 + 16.0 * 256 / 512) * 511 + 16) / 512, 1e-12);
    const char *bad[][2] = {{"cq-c8", "expected cq-c<c>b<b>"},   {"cq-c0b8", "channels per group after -c: expected 1..64"},
                            {"cq-c8b9", "bits per code after b"}, {"cq-c8b8x", "expected cq-c<c>b<b>"},
                            {"cq8", "expected cq-c<c>b<b>"},      {"cq-c65b8", "expected 1..64"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_eq(kvq_scheme_parse(bad[i][0], &sp, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, bad[i][1]), "%s: %s", bad[i][0], e.msg);
    }
    kvq_hparams hp = {.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .vocab_size = 100, .dim = 576};
    ck_assert(kvq_scheme_parse("cq-c6b8", &sp, &e) == KVQ_OK);
    ck_assert_int_eq(KVQ_FAM("cq")->check_model(&sp.q, "cq-c6b8", &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "6 channels per group do not divide head_dim 64"), "%s", e.msg);
    kvq_eval_scheme s;
    ck_assert_int_eq(kvq_eval_scheme_make("cq-c8b8", NULL, &hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "needs a kvcalib artifact of method cq with 8 channels per group"), "%s", e.msg);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cq");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_vq_kmeans);
    tcase_add_test(tc, test_vq_kmeans_bounds_exact);
    tcase_add_test(tc, test_cq_spec_bits);
    tcase_add_test(tc, test_cq_artifact_and_cli);
    tcase_add_test(tc, test_cq_chain_decode);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
