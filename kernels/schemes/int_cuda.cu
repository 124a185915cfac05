// int_cuda.cu — the int family's native CUDA transform (int.c): per-token groups, keys and values.
#include "family_cuda.cuh"

static kvq_status transform(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err)
{
    (void)state;
    const kvq_scheme *q = &d->q;
    cudaStream_t st = (cudaStream_t)a->stream;
    KVQ_FCU(kvq_cu_q_int_token(a->k, a->k, a->T, a->kv_dim, q->group, q->k_bits, q->n_sink, st));
    KVQ_FCU(kvq_cu_q_int_token(a->v, a->v, a->T, a->kv_dim, q->group, q->v_bits, q->n_sink, st));
    return KVQ_OK;
}

extern "C" const kvq_family_cuda kvq_int_cuda = {false, nullptr, nullptr, transform};
