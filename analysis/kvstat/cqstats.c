/* cqstats.c — codebook usage and per-group error of a cq artifact; see cqstats.h. */
#include "cqstats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "progress.h"
#include "vq.h"

void kvq_cqstats_free(kvq_cqstats *c)
{
    if (!c) return;
    free(c->count_k);
    free(c->count_v);
    free(c->sse_k);
    free(c->sse_v);
    memset(c, 0, sizeof *c);
}

kvq_status kvq_cqstats_compute(const kvq_kvsrc *src, const kvq_artifact *a, bool quiet, kvq_cqstats *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    if (!a || a->p.method != kvq_family_find("cq") || !a->k || !a->v)
        return kvq_fail(err, KVQ_EINVAL, "codebook view: the artifact is not of method cq");
    size_t c = a->p.group_size, kvd = (size_t)src->n_kv_heads * (size_t)src->head_dim, K = (size_t)1 << a->p.k_bits;
    if (c == 0 || kvd % c || kvd != a->p.n_kv_heads * a->p.head_dim)
        return kvq_fail(err, KVQ_EINVAL, "codebook view: %zu channels per group against kv_dim %zu", c, kvd);
    size_t G = kvd / c, nl = (size_t)(src->layer_last - src->layer_first + 1), L = (size_t)src->seq_len;
    size_t ns = a->p.n_sink < L ? a->p.n_sink : L;
    out->n_stat_layers = (int)nl;
    out->layer_first = src->layer_first;
    out->n_groups = (int)G;
    out->c = (int)c;
    out->bits = a->p.k_bits;
    out->n_vectors = (uint64_t)src->n_samples * (L - ns);
    out->count_k = calloc(nl * G * K, sizeof(uint64_t));
    out->count_v = calloc(nl * G * K, sizeof(uint64_t));
    out->sse_k = calloc(nl * G, sizeof(double));
    out->sse_v = calloc(nl * G, sizeof(double));
    float *x = malloc(L * kvd * sizeof(float)), *cbt = malloc(G * K * c * sizeof(float)), *dist = malloc(K * sizeof(float));
    kvq_status st = KVQ_OK;
    if (!out->count_k || !out->count_v || !out->sse_k || !out->sse_v || !x || !cbt || !dist)
        st = kvq_fail(err, KVQ_ENOMEM, "codebook view: out of memory");
    kvq_progress prog;
    kvq_progress_init(&prog, "kvstat codebooks", "sample", (uint64_t)nl * (uint64_t)src->n_samples * 2, quiet);
    uint64_t done = 0;
    for (size_t j = 0; st == KVQ_OK && j < nl; j++) {
        int layer = src->layer_first + (int)j;
        for (int w = 0; st == KVQ_OK && w < 2; w++) {
            const kvq_fam_tensor *t = kvq_kv_table_get(w ? &a->v[layer] : &a->k[layer], "codebook");
            if (!t || kvq_fam_tensor_len(t) != G * K * c) {
                st = kvq_fail(err, KVQ_EINVAL, "codebook view: layers.%d.%c.codebook missing or misshapen", layer, w ? 'v' : 'k');
                break;
            }
            for (size_t g = 0; g < G; g++) kvq_vq_transpose(cbt + g * K * c, t->data + g * K * c, K, c);
            kvq_kvt kt = w ? KVQ_KVT_V : a->p.post_rope ? KVQ_KVT_K : KVQ_KVT_K_PRE_ROPE;
            uint64_t *cnt = (w ? out->count_v : out->count_k) + j * G * K;
            double *sse = (w ? out->sse_v : out->sse_k) + j * G;
            for (int64_t smp = 0; st == KVQ_OK && smp < src->n_samples; smp++) {
                st = src->read_rows(src->ctx, layer, kt, smp, 0, src->seq_len, x, err);
                if (st) {
                    kvq_err_prefix(err, "codebook view: layer %d %s sample %lld", layer, kvq_kvt_name(kt), (long long)smp);
                    break;
                }
                for (size_t tk = ns; tk < L; tk++)
                    for (size_t g = 0; g < G; g++) {
                        const float *xg = x + tk * kvd + g * c;
                        size_t k = kvq_vq_nearest_t(xg, cbt + g * K * c, K, c, dist);
                        cnt[g * K + k]++;
                        sse[g] += dist[k];
                    }
                kvq_progress_update(&prog, ++done);
            }
        }
    }
    kvq_progress_finish(&prog);
    free(x);
    free(cbt);
    free(dist);
    if (st) kvq_cqstats_free(out);
    return st;
}

void kvq_cqstats_summary(const kvq_cqstats *c, int j, char side, kvq_cq_summary *s)
{
    memset(s, 0, sizeof *s);
    size_t G = (size_t)c->n_groups, K = (size_t)1 << c->bits;
    const uint64_t *cnt = (side == 'v' ? c->count_v : c->count_k) + (size_t)j * G * K;
    const double *sse = (side == 'v' ? c->sse_v : c->sse_k) + (size_t)j * G;
    double n = (double)c->n_vectors;
    s->mse_worst = -1;
    for (size_t g = 0; g < G; g++) {
        double h = 0;
        size_t used = 0;
        for (size_t k = 0; k < K; k++)
            if (cnt[g * K + k]) {
                double p = (double)cnt[g * K + k] / n;
                h -= p * log2(p);
                used++;
            }
        double mse = n > 0 ? sse[g] / (n * c->c) : NAN;
        s->used += (double)used / (double)G;
        s->entropy_bits += h / (double)G;
        s->mse_mean += mse / (double)G;
        if (mse > s->mse_worst) {
            s->mse_worst = mse;
            s->worst_group = (int)g;
        }
    }
}
