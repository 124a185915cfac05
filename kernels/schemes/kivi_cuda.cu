// kivi_cuda.cu — the kivi family's native CUDA transform (kivi.c): the quantized keys (per channel,
// G-token groups) and values (per token, G-channel groups) as the alternative; the forward reads
// them with the family's per-query boundaries (alt_bounds).
#include "family_cuda.cuh"

static kvq_status transform(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err)
{
    (void)state;
    const kvq_scheme *q = &d->q;
    cudaStream_t st = (cudaStream_t)a->stream;
    KVQ_FCU(kvq_cu_q_kivi_keys(a->k_alt, a->k_src, a->T, a->kv_dim, q->group, q->k_bits, q->n_sink, st));
    KVQ_FCU(kvq_cu_q_int_token(a->v_alt, a->v_src, a->T, a->kv_dim, q->group, q->v_bits, q->n_sink, st));
    return KVQ_OK;
}

extern "C" const kvq_family_cuda kvq_kivi_cuda = {true, nullptr, nullptr, transform};
