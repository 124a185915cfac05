// int_pc_cuda.cu — the int-pc family's native CUDA transform (int_pc.c): per-channel keys on the
// artifact's thresholds, per-token values in the artifact's groups.
#include "family_cuda.cuh"

static kvq_status upload(const kvq_kv_desc *d, const kvq_hparams *hp, void **state, kvq_err *err)
{
    kvq_cu_tables *t;
    KVQ_TRY(kvq_cu_tables_upload(d, hp, false, &t, err));
    *state = t;
    return KVQ_OK;
}

static void release(void *state) { kvq_cu_tables_free((kvq_cu_tables *)state); }

static kvq_status transform(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err)
{
    const kvq_cu_tables *t = (const kvq_cu_tables *)state;
    const kvq_scheme *q = &d->q;
    cudaStream_t st = (cudaStream_t)a->stream;
    const size_t off = (size_t)a->layer * a->kv_dim;
    KVQ_FCU(kvq_cu_q_int_channel(a->k, a->T, a->kv_dim, t->lo + off, t->up + off, q->k_bits, q->outlier_frac > 0, q->n_sink,
                                 a->counters, st));
    KVQ_FCU(kvq_cu_q_int_token(a->v, a->v, a->T, a->kv_dim, q->group, q->v_bits, q->n_sink, st));
    return KVQ_OK;
}

extern "C" const kvq_family_cuda kvq_int_pc_cuda = {false, upload, release, transform};
