// fp16_cuda.cu — the fp16 family's native CUDA transform (fp.c): rows >= n_sink rounded to half.
#include "family_cuda.cuh"

static kvq_status transform(const kvq_kv_desc *d, const void *state, const kvq_cu_kv_args *a, kvq_err *err)
{
    (void)state;
    cudaStream_t st = (cudaStream_t)a->stream;
    KVQ_FCU(kvq_cu_q_fp16(a->k, a->T, a->kv_dim, d->q.n_sink, a->counters + 2, st));
    KVQ_FCU(kvq_cu_q_fp16(a->v, a->T, a->kv_dim, d->q.n_sink, a->counters + 3, st));
    return KVQ_OK;
}

extern "C" const kvq_family_cuda kvq_fp16_cuda = {false, nullptr, nullptr, transform};
