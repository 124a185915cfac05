/* lrstats.c — explained variance of a lowrank artifact's subspaces; see lrstats.h. */
#include "lrstats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "progress.h"

void kvq_lrstats_free(kvq_lrstats *s)
{
    if (!s) return;
    free(s->cal_k);
    free(s->cal_v);
    free(s->dump_k);
    free(s->dump_v);
    memset(s, 0, sizeof *s);
}

int kvq_lrstats_rank_at(const double *curve, int D, double ev)
{
    for (int j = 0; j < D; j++)
        if (curve[j] >= ev * (1 - 1e-12)) return j + 1;
    return D;
}

kvq_status kvq_lrstats_compute(const kvq_kvsrc *src, const kvq_artifact *a, bool quiet, kvq_lrstats *out, kvq_err *err)
{
    memset(out, 0, sizeof *out);
    if (!a || a->p.method != kvq_family_find("lowrank") || !a->k || !a->v)
        return kvq_fail(err, KVQ_EINVAL, "low-rank view: the artifact is not of method lowrank");
    size_t hd = (size_t)src->head_dim, kvd = (size_t)src->n_kv_heads * hd, D = a->p.group_size * hd;
    if (D == 0 || kvd % D || kvd != a->p.n_kv_heads * a->p.head_dim)
        return kvq_fail(err, KVQ_EINVAL, "low-rank view: %zu KV heads per group against kv_dim %zu", a->p.group_size, kvd);
    size_t G = kvd / D, nl = (size_t)(src->layer_last - src->layer_first + 1), L = (size_t)src->seq_len;
    size_t ns = a->p.n_sink < L ? a->p.n_sink : L;
    out->n_stat_layers = (int)nl;
    out->layer_first = src->layer_first;
    out->n_groups = (int)G;
    out->G = (int)a->p.group_size;
    out->D = (int)D;
    out->ev_target = a->p.x[0] / 100.0;
    out->n_vectors = (uint64_t)src->n_samples * (L - ns);
    size_t n = nl * G * D;
    out->cal_k = calloc(n, sizeof(double));
    out->cal_v = calloc(n, sizeof(double));
    out->dump_k = calloc(n, sizeof(double));
    out->dump_v = calloc(n, sizeof(double));
    float *x = malloc(L * kvd * sizeof(float));
    kvq_status st = KVQ_OK;
    if (!out->cal_k || !out->cal_v || !out->dump_k || !out->dump_v || !x)
        st = kvq_fail(err, KVQ_ENOMEM, "low-rank view: out of memory");
    kvq_progress prog;
    kvq_progress_init(&prog, "kvstat low-rank", "sample", (uint64_t)nl * (uint64_t)src->n_samples * 2, quiet);
    uint64_t done = 0;
    for (size_t j = 0; st == KVQ_OK && j < nl; j++) {
        int layer = src->layer_first + (int)j;
        for (int w = 0; st == KVQ_OK && w < 2; w++) {
            const kvq_kv_table *t = w ? &a->v[layer] : &a->k[layer];
            const kvq_fam_tensor *B = kvq_kv_table_get(t, "basis"), *E = kvq_kv_table_get(t, "eigval");
            if (!B || !E || kvq_fam_tensor_len(B) != G * D * D || kvq_fam_tensor_len(E) != G * D) {
                st = kvq_fail(err, KVQ_EINVAL, "low-rank view: layers.%d.%c.basis / eigval missing or misshapen", layer, w ? 'v' : 'k');
                break;
            }
            double *cal = (w ? out->cal_v : out->cal_k) + j * G * D, *dmp = (w ? out->dump_v : out->dump_k) + j * G * D;
            for (size_t g = 0; g < G; g++) {
                double tot = 0, cum = 0;
                for (size_t r = 0; r < D; r++) tot += E->data[g * D + r];
                for (size_t r = 0; r < D; r++) {
                    cum += E->data[g * D + r];
                    cal[g * D + r] = tot > 0 ? cum / tot : 1;
                }
            }
            kvq_kvt kt = w ? KVQ_KVT_V : a->p.post_rope ? KVQ_KVT_K : KVQ_KVT_K_PRE_ROPE;
            double *etot = calloc(G, sizeof(double)), *edir = calloc(G * D, sizeof(double));
            if (!etot || !edir) {
                free(etot);
                free(edir);
                st = kvq_fail(err, KVQ_ENOMEM, "low-rank view: out of memory");
                break;
            }
            for (int64_t smp = 0; st == KVQ_OK && smp < src->n_samples; smp++) {
                st = src->read_rows(src->ctx, layer, kt, smp, 0, src->seq_len, x, err);
                if (st) {
                    kvq_err_prefix(err, "low-rank view: layer %d %s sample %lld", layer, kvq_kvt_name(kt), (long long)smp);
                    break;
                }
                for (size_t tk = ns; tk < L; tk++)
                    for (size_t g = 0; g < G; g++) {
                        const float *xg = x + tk * kvd + g * D, *Bg = B->data + g * D * D;
                        for (size_t i = 0; i < D; i++) etot[g] += (double)xg[i] * xg[i];
                        for (size_t r = 0; r < D; r++) {
                            double c = 0;
                            for (size_t i = 0; i < D; i++) c += (double)Bg[r * D + i] * xg[i];
                            edir[g * D + r] += c * c;
                        }
                    }
                kvq_progress_update(&prog, ++done);
            }
            for (size_t g = 0; st == KVQ_OK && g < G; g++) {
                double cum = 0;
                for (size_t r = 0; r < D; r++) {
                    cum += edir[g * D + r];
                    dmp[g * D + r] = etot[g] > 0 ? cum / etot[g] : 1;
                }
            }
            free(etot);
            free(edir);
        }
    }
    kvq_progress_finish(&prog);
    free(x);
    if (st) kvq_lrstats_free(out);
    return st;
}
