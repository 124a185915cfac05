/* test_lowrank.c — low-rank KV heads (kernels/schemes/lowrank.c, arXiv 2406.07056):
 *  - the fit against float64 references on a synthetic case: the (Fisher-weighted) second moment of the
 *    non-sink tokens and its eigendecomposition by a cyclic Jacobi method written here; eigenvalues,
 *    directions, the sign rule, groups of one and of two KV heads;
 *  - the projection: each token's group against U_r fp16(U_rᵀ x) in double, the mean squared error on the
 *    calibration tokens equal to the sum of the dropped eigenvalues (the optimality of the kept subspace),
 *    the explained-variance rank rule by hand;
 *  - spec parsing, canonical names, refusals (rank > G*head_dim, G not dividing n_kv_heads, budget above the
 *    coefficient bits), bits by hand from nominal and realised counts;
 *  - kvdump --fisher -> kvcalib --method lowrank -> kveval on both tiny models: decode equivalence of the
 *    in-place cache (post- and pre-RoPE keys, sink tokens, fp16 and int coefficients, the three rank rules)
 *    against a token-by-token loop whose reference projection and rank choices (a greedy budget
 *    allocation, not the family's sort) are written here; the realised stored-coefficient counts;
 *  - kvcalib's options and the artifact's validator, kveval's refusals through the binaries. */
#include <math.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "artifact.h"
#include "calibrate.h"
#include "family.h"
#include "family_env.h"
#include "kvq_test.h"
#include "quant.h"
#include "scheme.h"

size_t kvq_lowrank_ev_rank(const float *eig, size_t D, double ev);
kvq_status kvq_lowrank_apply(float *out, const float *in, size_t T, size_t kvd, size_t D, const float *basis, const float *eigval,
                             const size_t *ranks, int qbits, size_t n_sink, kvq_quant_counts *cnt, kvq_err *err);

static void tmp(char *buf, size_t n, const char *tag) { snprintf(buf, n, "/tmp/kvq_test_lowrank_%d_%s", (int)getpid(), tag); }

static uint64_t rng_s = 777;
static double unif(void)
{
    uint64_t z = (rng_s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((double)((z ^ (z >> 31)) >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

/* Cyclic Jacobi eigendecomposition of the symmetric A[n][n] (destroyed): eigenvalues descending in w,
 * eigenvector j in V[j][*] (rows). */
static void jacobi(double *A, size_t n, double *w, double *V)
{
    double *Q = calloc(n * n, sizeof *Q);
    for (size_t i = 0; i < n; i++) Q[i * n + i] = 1;
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0;
        for (size_t p = 0; p < n; p++)
            for (size_t q = p + 1; q < n; q++) off += A[p * n + q] * A[p * n + q];
        if (off < 1e-30) break;
        for (size_t p = 0; p < n; p++)
            for (size_t q = p + 1; q < n; q++) {
                if (fabs(A[p * n + q]) < 1e-300) continue;
                double th = (A[q * n + q] - A[p * n + p]) / (2 * A[p * n + q]);
                double t = (th >= 0 ? 1 : -1) / (fabs(th) + sqrt(th * th + 1)), c = 1 / sqrt(t * t + 1), s = t * c;
                for (size_t k = 0; k < n; k++) { /* A <- Jᵀ A J */
                    double akp = A[k * n + p], akq = A[k * n + q];
                    A[k * n + p] = c * akp - s * akq;
                    A[k * n + q] = s * akp + c * akq;
                }
                for (size_t k = 0; k < n; k++) {
                    double apk = A[p * n + k], aqk = A[q * n + k];
                    A[p * n + k] = c * apk - s * aqk;
                    A[q * n + k] = s * apk + c * aqk;
                }
                for (size_t k = 0; k < n; k++) { /* Q <- Q J: columns are the eigenvectors */
                    double qp = Q[k * n + p], qq = Q[k * n + q];
                    Q[k * n + p] = c * qp - s * qq;
                    Q[k * n + q] = s * qp + c * qq;
                }
            }
    }
    size_t *idx = malloc(n * sizeof *idx);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            if (A[idx[j] * n + idx[j]] > A[idx[i] * n + idx[i]]) {
                size_t t = idx[i];
                idx[i] = idx[j];
                idx[j] = t;
            }
    for (size_t j = 0; j < n; j++) {
        w[j] = A[idx[j] * n + idx[j]];
        for (size_t k = 0; k < n; k++) V[j * n + k] = Q[k * n + idx[j]];
    }
    free(idx);
    free(Q);
}

/* a synthetic (layer, side) tensor: 4 samples of 50 tokens, 2 KV heads of head_dim 5, correlated channels with
 * well separated principal variances; Fisher weights positive */
enum { SY_S = 4, SY_L = 50, SY_H = 2, SY_HD = 5, SY_KVD = SY_H * SY_HD, SY_N = SY_S * SY_L };
static void synth(float *x, float *f)
{
    double M[SY_KVD][SY_KVD];
    for (int i = 0; i < SY_KVD; i++)
        for (int j = 0; j < SY_KVD; j++) M[i][j] = gauss();
    for (int t = 0; t < SY_N; t++) {
        double z[SY_KVD];
        for (int j = 0; j < SY_KVD; j++) z[j] = gauss() * 4.0 * pow(0.62, j);
        for (int i = 0; i < SY_KVD; i++) {
            double s = 0.3;
            for (int j = 0; j < SY_KVD; j++) s += M[i][j] * z[j];
            x[t * SY_KVD + i] = (float)s;
            f[t * SY_KVD + i] = (float)(0.05 + unif() * (t % 7 == 3 ? 20 : 1));
        }
    }
}

static void fit(size_t G, size_t sink, bool fisher, const float *x, const float *f, kvq_kv_table *t)
{
    kvq_artifact_params p = {.method = KVQ_FAM("lowrank"), .k_bits = 8, .v_bits = 8, .n_sink = sink, .group_size = G, .fisher = fisher,
                             .post_rope = true, .n_layers = 1, .n_kv_heads = SY_H, .head_dim = SY_HD, .x = {90}};
    float *xc = malloc(SY_N * SY_KVD * sizeof(float));
    memcpy(xc, x, SY_N * SY_KVD * sizeof(float));
    kvq_fit_input in = {.x = xc, .fisher = fisher ? f : NULL, .n_tokens = SY_N, .sample_len = SY_L, .n_kv_heads = SY_H, .head_dim = SY_HD};
    memset(t, 0, sizeof *t);
    kvq_err e = {0};
    ck_assert_msg(KVQ_FAM("lowrank")->calib->fit(&p, 'k', &in, t, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(KVQ_FAM("lowrank")->artifact->check_tensors(&p, 0, 'k', t, &e) == KVQ_OK, "%s", e.msg);
    free(xc);
}

START_TEST(test_lowrank_fit_vs_float64)
{
    float *x = malloc(SY_N * SY_KVD * sizeof(float)), *f = malloc(SY_N * SY_KVD * sizeof(float));
    synth(x, f);
    const struct { size_t G, sink; bool fisher; } cases[] = {{2, 0, false}, {2, 3, true}, {1, 1, false}, {1, 0, true}};
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        size_t G = cases[ci].G, D = G * SY_HD, ng = SY_KVD / D;
        kvq_kv_table t;
        fit(G, cases[ci].sink, cases[ci].fisher, x, f, &t);
        const kvq_fam_tensor *B = kvq_kv_table_get(&t, "basis"), *E = kvq_kv_table_get(&t, "eigval");
        ck_assert_uint_eq(B->shape[0], ng);
        ck_assert_uint_eq(B->shape[1], D);
        ck_assert_uint_eq(E->shape[1], D);
        ck_assert_uint_eq(t.n_elems, (uint64_t)SY_S * (SY_L - cases[ci].sink) * SY_KVD);
        for (size_t g = 0; g < ng; g++) {
            double C[SY_KVD * SY_KVD] = {0}, w[SY_KVD], V[SY_KVD * SY_KVD], ws = 0;
            for (int t0 = 0; t0 < SY_N; t0++) {
                if ((size_t)(t0 % SY_L) < cases[ci].sink) continue;
                double wt = 1;
                if (cases[ci].fisher) {
                    wt = 0;
                    for (size_t i = 0; i < D; i++) wt += f[t0 * SY_KVD + g * D + i];
                }
                ws += wt;
                for (size_t i = 0; i < D; i++)
                    for (size_t j = 0; j < D; j++) C[i * D + j] += wt * x[t0 * SY_KVD + g * D + i] * x[t0 * SY_KVD + g * D + j];
            }
            for (size_t i = 0; i < D * D; i++) C[i] /= ws;
            jacobi(C, D, w, V);
            for (size_t j = 0; j < D; j++) {
                double e = E->data[g * D + j];
                ck_assert_msg(fabs(e - w[j]) <= 2e-6 * w[0], "case %zu group %zu eigenvalue %zu: %.9g vs float64 %.9g", ci, g, j, e, w[j]);
                const float *b = B->data + (g * D + j) * D;
                double dot = 0;
                size_t im = 0;
                for (size_t i = 0; i < D; i++) {
                    dot += b[i] * V[j * D + i];
                    if (fabs(b[i]) > fabs(b[im])) im = i;
                }
                ck_assert_msg(fabs(fabs(dot) - 1) < 1e-5, "case %zu group %zu direction %zu: |<u, u_ref>| = %.9f", ci, g, j, fabs(dot));
                ck_assert_msg(b[im] > 0, "direction %zu: largest entry %g is negative (sign rule)", j, b[im]);
            }
        }
        /* Fisher weights change the fit (the heavy tokens pull the directions) */
        if (ci == 1) {
            kvq_kv_table tu;
            fit(G, cases[ci].sink, false, x, f, &tu);
            ck_assert(fabs(kvq_kv_table_get(&tu, "eigval")->data[0] - E->data[0]) > 1e-4 * E->data[0]);
            kvq_kv_table_free(&tu);
        }
        kvq_kv_table_free(&t);
    }
    free(x);
    free(f);
}
END_TEST

START_TEST(test_lowrank_projection)
{
    float *x = malloc(SY_N * SY_KVD * sizeof(float)), *f = malloc(SY_N * SY_KVD * sizeof(float));
    float *y = malloc(SY_N * SY_KVD * sizeof(float));
    synth(x, f);
    kvq_kv_table t;
    fit(2, 0, false, x, f, &t); /* one group of the whole 10 channels, every token */
    const float *B = kvq_kv_table_get(&t, "basis")->data, *E = kvq_kv_table_get(&t, "eigval")->data;
    kvq_err e = {0};
    for (size_t r = 1; r <= SY_KVD; r += 3) {
        kvq_quant_counts c = {0};
        ck_assert_msg(kvq_lowrank_apply(y, x, SY_N, SY_KVD, SY_KVD, B, E, &r, 0, 2, &c, &e) == KVQ_OK, "%s", e.msg);
        ck_assert_uint_eq(c.n_elems, SY_N * SY_KVD);
        ck_assert_uint_eq(c.n_sink, 2 * SY_KVD);
        ck_assert_uint_eq(c.n_coef, (SY_N - 2) * r);
        double sse = 0, tail = 0;
        for (size_t j = r; j < SY_KVD; j++) tail += E[j];
        for (int t0 = 0; t0 < SY_N; t0++) {
            const float *xt = x + t0 * SY_KVD;
            double ref[SY_KVD] = {0}, nx = 0;
            if (t0 < 2) {
                ck_assert(!memcmp(y + t0 * SY_KVD, xt, SY_KVD * sizeof(float))); /* sink tokens exact */
                continue;
            }
            for (size_t j = 0; j < r; j++) {
                double cj = 0;
                for (int i = 0; i < SY_KVD; i++) cj += (double)B[j * SY_KVD + i] * xt[i];
                cj = kvq_round_fp16((float)cj);
                for (int i = 0; i < SY_KVD; i++) ref[i] += cj * B[j * SY_KVD + i];
            }
            for (int i = 0; i < SY_KVD; i++) nx += (double)xt[i] * xt[i];
            for (int i = 0; i < SY_KVD; i++) {
                double d = y[t0 * SY_KVD + i] - ref[i];
                ck_assert_msg(fabs(d) <= 2e-3 * sqrt(nx), "token %d channel %d: %g vs reference %g", t0, i, y[t0 * SY_KVD + i], ref[i]);
                sse += pow(y[t0 * SY_KVD + i] - xt[i], 2);
            }
        }
        /* over the tokens the basis was fitted on, the mean squared error is the sum of the dropped eigenvalues
         * (+ the fp16 rounding of the coefficients, ~1e-7 relative); the sink tokens count as exact */
        double mse = sse / (SY_N - 2), want = tail;
        double tot = 0;
        for (size_t j = 0; j < SY_KVD; j++) tot += E[j];
        /* the two sink tokens are part of the fit but not of the error */
        double sink_part = 0;
        for (int t0 = 0; t0 < 2; t0++) {
            for (size_t j = r; j < SY_KVD; j++) {
                double cj = 0;
                for (int i = 0; i < SY_KVD; i++) cj += (double)B[j * SY_KVD + i] * x[t0 * SY_KVD + i];
                sink_part += cj * cj;
            }
        }
        want = (tail * SY_N - sink_part) / (SY_N - 2);
        ck_assert_msg(fabs(mse - want) <= 1e-4 * tot, "rank %zu: MSE %.9g, dropped eigenvalues %.9g", r, mse, want);
    }
    /* int coefficients, whitened: coefficient j within half a step of the whitened range times its own calibrated
     * spread sqrt(λ_j) (a range shared by the unwhitened coefficients would leave the trailing ones far coarser) */
    size_t r = 4;
    float *yq = malloc(SY_N * SY_KVD * sizeof(float));
    ck_assert(kvq_lowrank_apply(yq, x, SY_N, SY_KVD, SY_KVD, B, E, &r, 4, 0, NULL, &e) == KVQ_OK);
    ck_assert(kvq_lowrank_apply(y, x, SY_N, SY_KVD, SY_KVD, B, E, &r, 0, 0, NULL, &e) == KVQ_OK);
    ck_assert_uint_gt(fenv_bits_differ(y, yq, SY_N * SY_KVD), SY_N);
    for (int t0 = 0; t0 < SY_N; t0++) {
        double cq[SY_KVD], cf[SY_KVD], mn = INFINITY, mx = -INFINITY;
        for (size_t j = 0; j < r; j++) {
            cq[j] = cf[j] = 0;
            for (int i = 0; i < SY_KVD; i++) {
                cq[j] += (double)B[j * SY_KVD + i] * yq[t0 * SY_KVD + i];
                cf[j] += (double)B[j * SY_KVD + i] * x[t0 * SY_KVD + i];
            }
            mn = fmin(mn, cf[j] / sqrt(E[j]));
            mx = fmax(mx, cf[j] / sqrt(E[j]));
        }
        for (size_t j = 0; j < r; j++)
            ck_assert_msg(fabs(cq[j] - cf[j]) <= sqrt(E[j]) * (mx - mn) / 15 / 2 * 1.001 + 1e-4, "token %d coefficient %zu: %g vs %g", t0,
                          j, cq[j], cf[j]);
    }
    free(yq);
    /* the explained-variance rule */
    const float eig[] = {4, 3, 2, 1};
    const double ev[] = {0.1, 0.4, 0.41, 0.7, 0.71, 0.9, 0.91, 1.0};
    const size_t want[] = {1, 1, 2, 2, 3, 3, 4, 4};
    for (size_t i = 0; i < sizeof ev / sizeof *ev; i++) ck_assert_uint_eq(kvq_lowrank_ev_rank(eig, 4, ev[i]), want[i]);
    /* refusals of the primitive */
    ck_assert_int_eq(kvq_lowrank_apply(y, x, SY_N, SY_KVD, 3, B, E, &r, 0, 0, NULL, &e), KVQ_EINVAL);
    r = SY_KVD + 1;
    ck_assert_int_eq(kvq_lowrank_apply(y, x, SY_N, SY_KVD, SY_KVD, B, E, &r, 0, 0, NULL, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "rank 11 outside 1..10"), "%s", e.msg);
    kvq_kv_table_free(&t);
    free(x);
    free(f);
    free(y);
}
END_TEST

START_TEST(test_lowrank_spec_bits)
{
    kvq_scheme_spec sp;
    kvq_err e = {0};
    char name[64];
    const char *ok[][2] = {{"lowrank-g3-r96", "lowrank-g3-r96"}, {"lowrank-g1-ev95-q8", "lowrank-g1-ev95-q8"},
                           {"lowrank-g1-ev99.5", "lowrank-g1-ev99.5"}, {"lowrank-g3-b2.5-q4", "lowrank-g3-b2.5-q4"}};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        ck_assert_msg(kvq_scheme_parse(ok[i][0], &sp, &e) == KVQ_OK, "%s: %s", ok[i][0], e.msg);
        ck_assert_ptr_eq(sp.q.fam, KVQ_FAM("lowrank"));
        sp.q.fam->format(&sp.q, name, sizeof name);
        ck_assert_str_eq(name, ok[i][1]);
        ck_assert_int_eq(sp.key_stage, KVQ_KEYS_POST_ROPE);
    }
    const char *bad[][2] = {{"lowrank", "expected lowrank-g<G>-r<R>"},      {"lowrank-g0-r4", "KV heads per group after -g: expected 1..64"},
                            {"lowrank-g2-r0", "rank after -r"},             {"lowrank-g2-ev0", "explained variance after -ev"},
                            {"lowrank-g2-ev101", "expected a percentage"},   {"lowrank-g2-b17", "bits budget after -b"},
                            {"lowrank-g2-r4-q9", "coefficient bits after -q"}, {"lowrank-g2-r4x", "expected lowrank-g<G>"},
                            {"lowrank-g2-b9-q8", "bits budget: expected (0, 8]"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_eq(kvq_scheme_parse(bad[i][0], &sp, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, bad[i][1]), "%s: %s", bad[i][0], e.msg);
    }
    kvq_hparams hp = {.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .vocab_size = 100, .dim = 576};
    ck_assert(kvq_scheme_parse("lowrank-g2-r64", &sp, &e) == KVQ_OK);
    ck_assert_int_eq(sp.q.fam->check_model(&sp.q, "lowrank-g2-r64", &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "group: 2 KV heads per group do not divide n_kv_heads 3"), "%s", e.msg);
    ck_assert(kvq_scheme_parse("lowrank-g3-r193", &sp, &e) == KVQ_OK);
    ck_assert_int_eq(sp.q.fam->check_model(&sp.q, "lowrank-g3-r193", &hp, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "rank: 193 exceeds the group's G * head_dim = 3 * 64 = 192 channels"), "%s", e.msg);
    kvq_eval_scheme s;
    ck_assert_int_eq(kvq_eval_scheme_make("lowrank-g3-r96", NULL, &hp, &s, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "needs a kvcalib artifact of method lowrank with 3 KV heads per group (--group 3)"), "%s", e.msg);
    /* bits by hand: f = kept share, fp16 coefficients, the projections over ctx */
    kvq_bits b;
    kvq_bits_in in = {.ctx = 2048, .kv_dim = 192, .head_dim = 64, .n_layers = 30};
    ck_assert(kvq_scheme_parse("lowrank-g3-r96", &sp, &e) == KVQ_OK);
    ck_assert(kvq_scheme_bits_ex(&sp.q, &in, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 0.5 * 16 + 16 * 0.5 * 192 / 2048.0, 1e-12); /* 8.75 */
    ck_assert(kvq_scheme_parse("lowrank-g1-r16-q4", &sp, &e) == KVQ_OK);
    ck_assert(kvq_scheme_bits_ex(&sp.q, &in, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.v, 0.25 * (4 + 32.0 / 16) + 16 * 0.25 * 64 / 2048.0, 1e-12); /* 1.625 */
    ck_assert(kvq_scheme_parse("lowrank-g1-b3", &sp, &e) == KVQ_OK);
    ck_assert(kvq_scheme_bits_ex(&sp.q, &in, &b, &e) == KVQ_OK);
    ck_assert_double_eq_tol(b.k, 3 + 16 * (3 / 16.0) * 64 / 2048.0, 1e-12);
    /* realised counts: 1000 tokens of which 10 sink, 40 coefficients per token (of 192 elements) */
    kvq_quant_counts c = {.n_elems = 1000 * 192, .n_sink = 10 * 192, .n_coef = 990 * 40};
    in.k = in.v = &c;
    ck_assert(kvq_scheme_parse("lowrank-g1-ev90+sink10", &sp, &e) == KVQ_OK);
    in.ctx = 1000;
    ck_assert(kvq_scheme_bits_ex(&sp.q, &in, &b, &e) == KVQ_OK);
    double f = 40.0 / 192;
    ck_assert_double_eq_tol(b.k, ((f * 16 + 16 * f * 64 / 1000.0) * 990 + 16 * 10) / 1000, 1e-12);
}
END_TEST

/* ---- decode equivalence on the tiny models ---- */

typedef struct {
    const kvq_eval_scheme *s;
    int kvd, hd, L;
    size_t ranks[2][16][16]; /* [side][layer][group] chosen here */
} lref;

/* the ranks of every (side, layer, group) chosen independently: rank / explained variance by accumulation, the
 * budget by a greedy allocation (one direction at a time to the largest next normalised eigenvalue) */
static void ref_ranks(lref *r)
{
    const kvq_scheme *q = &r->s->s.q;
    size_t D = q->group * (size_t)r->hd, ng = (size_t)r->kvd / D;
    for (int w = 0; w < 2; w++) {
        for (int l = 0; l < r->L; l++)
            for (size_t g = 0; g < ng; g++) {
                const float *E = kvq_kv_table_get(w ? &r->s->art->v[l] : &r->s->art->k[l], "eigval")->data + g * D;
                double tot = 0, cum = 0;
                for (size_t j = 0; j < D; j++) tot += E[j];
                size_t k = D;
                if (q->variant == 0) k = (size_t)q->x[0];
                else if (q->variant == 1)
                    for (size_t j = 0; j < D; j++) {
                        cum += E[j];
                        if (cum >= q->x[0] * tot * (1 - 1e-12)) {
                            k = j + 1;
                            break;
                        }
                    }
                else
                    k = 1;
                r->ranks[w][l][g] = k;
            }
        if (q->variant == 2) {
            double cb = q->x[1] > 0 ? q->x[1] : 16;
            size_t keep = (size_t)floor(q->x[0] / cb * (double)(r->L * r->kvd) + 1e-9), have = (size_t)r->L * ng;
            for (; have < keep; have++) {
                double best = -1;
                int bl = -1;
                size_t bg = 0;
                for (int l = 0; l < r->L; l++)
                    for (size_t g = 0; g < ng; g++) {
                        size_t k = r->ranks[w][l][g];
                        if (k >= D) continue;
                        const float *E = kvq_kv_table_get(w ? &r->s->art->v[l] : &r->s->art->k[l], "eigval")->data + g * D;
                        double tot = 0;
                        for (size_t j = 0; j < D; j++) tot += E[j];
                        if (E[k] / tot > best) {
                            best = E[k] / tot;
                            bl = l;
                            bg = g;
                        }
                    }
                r->ranks[w][bl][bg]++;
            }
        }
    }
}

/* one token: every group x -> U_r Q(U_rᵀ x), the same fixed-order float loops a reduced-head cache would run */
static void lr_ref(void *ctx, int layer, char side, int pos, float *x)
{
    const lref *r = ctx;
    const kvq_scheme *q = &r->s->s.q;
    if ((size_t)pos < q->n_sink) return;
    size_t D = q->group * (size_t)r->hd, ng = (size_t)r->kvd / D;
    const kvq_kv_table *tb = side == 'k' ? &r->s->art->k[layer] : &r->s->art->v[layer];
    const float *B = kvq_kv_table_get(tb, "basis")->data, *E = kvq_kv_table_get(tb, "eigval")->data;
    for (size_t g = 0; g < ng; g++) {
        size_t k = r->ranks[side == 'v'][layer][g];
        const float *Bg = B + g * D * D;
        float c[256], y[256] = {0};
        for (size_t j = 0; j < k; j++) {
            float s = 0;
            for (size_t i = 0; i < D; i++) s += Bg[j * D + i] * x[g * D + i];
            c[j] = s;
        }
        kvq_err e = {0};
        if (q->x[1] > 0) { /* whitened by sqrt(λ_j) (1 where λ_j is 0) */
            float sg[256];
            for (size_t j = 0; j < k; j++) {
                sg[j] = sqrtf(E[g * D + j]);
                if (!(sg[j] > 0)) sg[j] = 1;
                c[j] /= sg[j];
            }
            ck_assert(kvq_quant_int_token(c, c, 1, k, 0, (int)q->x[1], 0, NULL, &e) == KVQ_OK);
            for (size_t j = 0; j < k; j++) c[j] *= sg[j];
        } else
            for (size_t j = 0; j < k; j++) c[j] = kvq_round_fp16(c[j]);
        for (size_t j = 0; j < k; j++)
            for (size_t i = 0; i < D; i++) y[i] += c[j] * Bg[j * D + i];
        memcpy(x + g * D, y, D * sizeof(float));
    }
}

static void calibrate(const char *dump, const char *out, size_t G, size_t sink, bool fisher, bool post_rope)
{
    kvq_calibrate_opts o = kvq_calibrate_defaults(KVQ_FAM("lowrank"));
    o.group_size = G;
    o.n_sink = sink;
    o.fisher = fisher;
    o.post_rope = post_rope;
    kvq_err e = {0};
    ck_assert_msg(kvq_calibrate_file(dump, out, true, &o, NULL, &e) == KVQ_OK, "%s", e.msg);
}

START_TEST(test_lowrank_decode)
{
    const char *models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};
    for (int mi = 0; mi < 2; mi++) {
        char mp[4096], dump[256], a0[256], a1[256], a2[256];
        tmp(dump, sizeof dump, "dump.h5");
        KVQ_SKIP_IF(!fenv_dump(models[mi], 4, 64, true, dump, mp, sizeof mp), "../shared tiny model or WikiText-2 absent");
        tmp(a0, sizeof a0, "g2.st");
        tmp(a1, sizeof a1, "g1pre.st");
        tmp(a2, sizeof a2, "g2f.st");
        calibrate(dump, a0, 2, 0, false, true);
        calibrate(dump, a1, 1, 1, false, false);
        calibrate(dump, a2, 2, 0, true, true);
        kvq_model m;
        kvq_err e = {0};
        ck_assert_msg(kvq_model_load(mp, &m, &e) == KVQ_OK, "%s", e.msg);
        char fp[65];
        ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
        const char *paths[] = {a0, a1, a2};
        kvq_artifact_set set;
        ck_assert_msg(kvq_artifact_set_load(&set, paths, 3, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
        int kvd = kvq_kv_dim(&m.hp), hd = m.hp.head_dim, L = m.hp.n_layers;
        /* the Fisher-weighted fit differs from the plain one */
        ck_assert(memcmp(kvq_kv_table_get(&set.a[0].k[0], "basis")->data, kvq_kv_table_get(&set.a[2].k[0], "basis")->data,
                         (size_t)kvd * 2 * hd * sizeof(float)));
        const struct { const char *spec; int stage; size_t sink; } specs[] = {
            {"lowrank-g2-r5", KVQ_KEYS_POST_ROPE, 0},      {"lowrank-g2-ev90-q4", KVQ_KEYS_POST_ROPE, 0},
            {"lowrank-g2-b4", KVQ_KEYS_POST_ROPE, 0},      {"lowrank-g1-r3+pre-rope", KVQ_KEYS_PRE_ROPE, 1},
            {"lowrank-g2-b3-q8+artifact3", KVQ_KEYS_POST_ROPE, 0}, {"lowrank-g1-ev80", KVQ_KEYS_PRE_ROPE, 1}};
        for (size_t i = 0; i < sizeof specs / sizeof *specs; i++) {
            kvq_eval_scheme s;
            ck_assert_msg(kvq_eval_scheme_make(specs[i].spec, &set, &m.hp, &s, &e) == KVQ_OK, "%s: %s", specs[i].spec, e.msg);
            ck_assert_int_eq(s.s.key_stage, specs[i].stage);
            ck_assert_uint_eq(s.s.q.n_sink, specs[i].sink);
            lref w = {.s = &s, .kvd = kvd, .hd = hd, .L = L};
            ref_ranks(&w);
            kvq_quant_counts c = fenv_decode_case(&m, &s, lr_ref, &w, false);
            uint64_t rs = 0;
            size_t D = s.s.q.group * (size_t)hd;
            for (int l = 0; l < L; l++)
                for (size_t g = 0; g < (size_t)kvd / D; g++) rs += w.ranks[0][l][g];
            ck_assert_uint_eq(c.n_elems, (uint64_t)L * 48 * kvd);
            ck_assert_uint_eq(c.n_sink, (uint64_t)L * specs[i].sink * kvd);
            ck_assert_uint_eq(c.n_coef, (48 - specs[i].sink) * rs);
            if (s.s.q.variant == 2) /* the budget: B / cb of the elements of every layer, at least one per group */
                ck_assert_uint_eq(rs, (uint64_t)floor(s.s.q.x[0] / (s.s.q.x[1] > 0 ? s.s.q.x[1] : 16) * L * kvd + 1e-9));
            kvq_bits b;
            ck_assert(kvq_eval_scheme_bits_run(&s, 48, &m.hp, &c, &c, &b, &e) == KVQ_OK);
            double f = (double)rs / (L * kvd), cb = s.s.q.x[1] > 0 ? s.s.q.x[1] + 32.0 / (f * D) : 16;
            ck_assert_double_eq_tol(b.k, ((f * cb + 16 * f * D / 48.0) * (48 - specs[i].sink) + 16.0 * specs[i].sink) / 48, 1e-9);
        }
        kvq_eval_scheme s;
        ck_assert_int_eq(kvq_eval_scheme_make("lowrank-g4-r8", &set, &m.hp, &s, &e), KVQ_EINVAL);
        ck_assert_msg(strstr(e.msg, "needs a kvcalib artifact of method lowrank with 4 KV heads per group (--group 4)"), "%s", e.msg);
        kvq_artifact_set_free(&set);
        kvq_model_free(&m);
        unlink(dump);
        unlink(a0);
        unlink(a1);
        unlink(a2);
    }
}
END_TEST

START_TEST(test_lowrank_artifact_and_cli)
{
    char mp[4096], dump[256], a[256], b[256], bad[256], cmd[20000], out[8192], bin[4096];
    tmp(dump, sizeof dump, "dump2.h5");
    KVQ_SKIP_IF(!fenv_dump("models/llama2c/aidreams260K.bin", 2, 32, false, dump, mp, sizeof mp), "../shared tiny model absent");
    tmp(a, sizeof a, "a.st");
    tmp(b, sizeof b, "b.st");
    tmp(bad, sizeof bad, "bad.st");
    calibrate(dump, a, 2, 0, false, true);
    kvq_artifact art;
    kvq_err e = {0};
    ck_assert_msg(kvq_artifact_read(a, &art, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_eq(art.p.method, KVQ_FAM("lowrank"));
    ck_assert_double_eq(art.p.x[0], 90);
    /* the validator: a non-unit direction, eigenvalues out of order */
    art.k[1].ft[0].data[5] *= 1.5f;
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.1.k.basis[0][0]: expected a unit vector"), "%s", e.msg);
    art.k[1].ft[0].data[5] /= 1.5f;
    float t0 = art.v[0].ft[1].data[3];
    art.v[0].ft[1].data[3] = art.v[0].ft[1].data[2] * 2 + 1;
    ck_assert_int_eq(kvq_artifact_validate(&art, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.0.v.eigval[0][3]: expected finite, >= 0 and descending"), "%s", e.msg);
    art.v[0].ft[1].data[3] = t0;
    ck_assert_msg(kvq_artifact_validate(&art, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_free(&art);
    fenv_rewrite(a, bad, "layers.1.k.eigval", false);
    ck_assert_int_eq(kvq_artifact_read(bad, &art, &e), KVQ_EFORMAT);
    ck_assert_msg(strstr(e.msg, "layers.1.k.eigval") && strstr(e.msg, "missing"), "%s", e.msg);
    const char *kvcalib = kvq_test_bin(bin, sizeof bin, "kvcalib");
    ck_assert_msg(kvcalib, "%s: kvcalib not built (KVQ_BIN_DIR)", bin);
    snprintf(cmd, sizeof cmd, "%s --inspect %s", kvcalib, a);
    ck_assert_int_eq(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "method        lowrank") && strstr(out, "2 KV heads per group (32 channels)") &&
                      strstr(out, "plain second moment of the post-RoPE keys") && strstr(out, "basis [2x32x32]"),
                  "%s", out);
    /* kvstat: the quantization-error view runs the artifact's own scheme; the explained-variance view on the
     * calibration dump itself (plain weights, no sink) realises exactly the calibrated curve */
    char kvstat_bin[4096], md[256], js[256];
    ck_assert_msg(kvq_test_bin(kvstat_bin, sizeof kvstat_bin, "kvstat"), "%s: kvstat not built", kvstat_bin);
    tmp(md, sizeof md, "kvstat.md");
    tmp(js, sizeof js, "kvstat.json");
    snprintf(cmd, sizeof cmd, "%s %s --artifact %s --markdown %s --json %s -q", kvstat_bin, dump, a, md, js);
    ck_assert_msg(fenv_run(cmd, out, sizeof out) == 0, "%s", out);
    char *rep = kvq_test_slurp(md, NULL);
    ck_assert_msg(rep && strstr(rep, "| 0 | lowrank-g2-ev90 post-RoPE (artifact) |") && strstr(rep, "### Low-rank KV heads: explained variance") &&
                      strstr(rep, "(groups of 2 KV heads, D = 32 channels)"),
                  "%s", rep ? rep : md);
    free(rep);
    char *jt = kvq_test_slurp(js, NULL);
    cJSON *root = cJSON_Parse(jt), *lj = cJSON_GetObjectItem(root, "lowrank_ev");
    ck_assert_ptr_nonnull(lj);
    ck_assert_int_eq(cJSON_GetObjectItem(lj, "channels_per_group")->valueint, 32);
    ck_assert_int_eq(cJSON_GetObjectItem(lj, "n_groups")->valueint, 2);
    for (int w = 0; w < 2; w++) {
        cJSON *side = cJSON_GetObjectItem(lj, w ? "v" : "k"), *cal = cJSON_GetObjectItem(side, "calibrated"),
              *real = cJSON_GetObjectItem(side, "realised");
        int n = cJSON_GetArraySize(cal);
        ck_assert_int_eq(n, 4 * 2 * 32);
        ck_assert_int_eq(cJSON_GetArraySize(real), n);
        for (int i = 0; i < n; i++) {
            double c = cJSON_GetArrayItem(cal, i)->valuedouble, rr = cJSON_GetArrayItem(real, i)->valuedouble;
            ck_assert_msg(fabs(c - rr) <= 1e-4, "%c entry %d: calibrated %.7f, realised on the same tokens %.7f", w ? 'v' : 'k', i, c, rr);
            if (i % 32 == 31) ck_assert_double_eq_tol(rr, 1.0, 1e-5);
            if (i % 32) ck_assert(c >= cJSON_GetArrayItem(cal, i - 1)->valuedouble);
        }
    }
    cJSON_Delete(root);
    free(jt);
    unlink(md);
    unlink(js);
    struct { const char *args; int code; const char *want; } cases[] = {
        {"--group 3", 1, "group_size: lowrank's KV heads per group must divide n_kv_heads 4"}, /* its rule, not int's */
        {"--group 8", 1, "group_size: lowrank's KV heads per group must divide n_kv_heads 4"},
        {"--bits 4", 2, "lowrank's tables do not depend on code bits"},
        {"--param ev=0", 1, "ev: expected a percentage in (0, 100]"},
        {"--fisher", 1, "--fisher"},
        {"--fisher --no-fisher", 2, "contradict"},
        {"--outliers 0.01", 2, "outlier fraction"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(cmd, sizeof cmd, "%s %s --method lowrank %s --out %s", kvcalib, dump, cases[i].args, b);
        int rc = fenv_run(cmd, out, sizeof out);
        ck_assert_msg(rc == cases[i].code && strstr(out, cases[i].want), "%s: exit %d: %s", cases[i].args, rc, out);
        ck_assert_int_ne(access(b, F_OK), 0);
    }
    /* kveval: impossible ranks refused before any work, naming the rule */
    char kveval[4096], tokf[4096], text[4096];
    ck_assert(kvq_test_bin(kveval, sizeof kveval, "kveval"));
    ck_assert(kvq_test_shared(tokf, sizeof tokf, "models/llama2c/aidreams-tok512.bin"));
    ck_assert(kvq_test_shared(text, sizeof text, "datasets/wikitext-2/wiki.valid.tokens"));
    snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s -c 32 -w 1 -a %s --scheme lowrank-g2-r33", kveval, mp, tokf, text, a);
    ck_assert_int_ne(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "rank: 33 exceeds the group's G * head_dim = 2 * 16 = 32 channels"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s -c 32 -w 1 -a %s --scheme lowrank-g3-r8", kveval, mp, tokf, text, a);
    ck_assert_int_ne(fenv_run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "3 KV heads per group do not divide n_kv_heads 4"), "%s", out);
    unlink(a);
    unlink(b);
    unlink(bad);
    unlink(dump);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("lowrank");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_lowrank_fit_vs_float64);
    tcase_add_test(tc, test_lowrank_projection);
    tcase_add_test(tc, test_lowrank_spec_bits);
    tcase_add_test(tc, test_lowrank_artifact_and_cli);
    tcase_add_test(tc, test_lowrank_decode);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
