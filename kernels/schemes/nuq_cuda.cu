// nuq_cuda.cu — the nuq family's native CUDA transform (nuq.c): keys on the offline thresholds and
// the key datatype, values per token with their datatype; dense-and-sparse outliers counted.
#include "family_cuda.cuh"

static kvq_status upload(const kvq_kv_desc *d, const kvq_hparams *hp, void **state, kvq_err *err)
{
    kvq_cu_tables *t;
    KVQ_TRY(kvq_cu_tables_upload(d, hp, true, &t, err));
    *state = t;
    return KVQ_OK;
}

static void release(void *state) { kvq_cu_tables_free((kvq_cu_tables *)state); }

static kvq_status transform(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err)
{
    const kvq_cu_tables *t = (const kvq_cu_tables *)state;
    const kvq_scheme *q = &d->q;
    cudaStream_t st = (cudaStream_t)a->stream;
    const size_t l = (size_t)a->layer, kvd = a->kv_dim, kn = t->k_tables << q->k_bits, vn = t->v_tables << q->v_bits;
    KVQ_FCU(kvq_cu_q_nuq_keys(a->k, a->T, kvd, t->klv + l * kn, q->k_bits, t->k_tables, a->head_dim, t->lo + l * kvd,
                              t->up + l * kvd, q->outlier_frac > 0, q->n_sink, a->counters, st));
    KVQ_FCU(kvq_cu_q_nuq_values(a->v, a->T, kvd, t->vlv + l * vn, q->v_bits, t->v_tables, a->head_dim,
                                kvq_outliers_per_side(kvd, q->outlier_frac), q->n_sink, a->counters + 1, st));
    return KVQ_OK;
}

extern "C" const kvq_family_cuda kvq_nuq_cuda = {false, upload, release, transform};
