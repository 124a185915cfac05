// family_cuda.cuh — what the families' native CUDA transforms (<family>_cuda.cu)
// share: the device-side error mapping and the upload of per-layer tables
// (per-channel key thresholds, nuq levels) into one device array per kind.
#ifndef KVQ_FAMILY_CUDA_CUH
#define KVQ_FAMILY_CUDA_CUH

#include <cuda_runtime.h>

extern "C" {
#include "family.h"
}
#include "cuda_ops.cuh"

#define KVQ_FCU(call)                                                                                     \
    do {                                                                                                  \
        cudaError_t ce_ = (call);                                                                         \
        if (ce_ != cudaSuccess) return kvq_fail(err, KVQ_EIO, "CUDA %s: %s", #call, cudaGetErrorString(ce_)); \
    } while (0)

// the tables of a descriptor on the device: per layer, lower/upper [kv_dim], levels [tables][2^bits]
struct kvq_cu_tables {
    float *lo = nullptr, *up = nullptr, *klv = nullptr, *vlv = nullptr;
    size_t kvd = 0, k_tables = 0, v_tables = 0;
};

static inline void kvq_cu_tables_free(kvq_cu_tables *t)
{
    if (!t) return;
    cudaFree(t->lo);
    cudaFree(t->up);
    cudaFree(t->klv);
    cudaFree(t->vlv);
    delete t;
}

// Upload the key thresholds of every layer and, with levels, the nuq levels (one table count for all layers).
static inline kvq_status kvq_cu_tables_upload(const kvq_kv_desc *d, const kvq_hparams *hp, bool levels, kvq_cu_tables **out,
                                              kvq_err *err)
{
    const size_t NL = (size_t)hp->n_layers, kvd = (size_t)kvq_kv_dim(hp);
    kvq_cu_tables *t = new kvq_cu_tables();
    t->kvd = kvd;
    kvq_status s = KVQ_OK;
    auto fail = [&](cudaError_t ce, const char *what) {
        s = kvq_fail(err, ce == cudaErrorMemoryAllocation ? KVQ_ENOMEM : KVQ_EIO, "CUDA forward: %s: %s", what,
                     cudaGetErrorString(ce));
    };
    cudaError_t ce;
    if ((ce = cudaMalloc((void **)&t->lo, NL * kvd * sizeof(float))) != cudaSuccess ||
        (ce = cudaMalloc((void **)&t->up, NL * kvd * sizeof(float))) != cudaSuccess)
        fail(ce, "key channel thresholds");
    for (size_t l = 0; !s && l < NL; l++)
        if ((ce = cudaMemcpy(t->lo + l * kvd, d->layers[l].k_lower, kvd * sizeof(float), cudaMemcpyHostToDevice)) != cudaSuccess ||
            (ce = cudaMemcpy(t->up + l * kvd, d->layers[l].k_upper, kvd * sizeof(float), cudaMemcpyHostToDevice)) != cudaSuccess)
            fail(ce, "key channel thresholds");
    if (!s && levels) {
        t->k_tables = d->layers[0].k_lut.n_tables;
        t->v_tables = d->layers[0].v_lut.n_tables;
        const size_t kn = t->k_tables << d->q.k_bits, vn = t->v_tables << d->q.v_bits;
        for (size_t l = 1; !s && l < NL; l++)
            if (d->layers[l].k_lut.n_tables != t->k_tables || d->layers[l].v_lut.n_tables != t->v_tables)
                s = kvq_fail(err, KVQ_EUNSUPPORTED, "CUDA forward: nuq tables: layer %zu has a different table count than layer 0", l);
        if (!s && ((ce = cudaMalloc((void **)&t->klv, NL * kn * sizeof(float))) != cudaSuccess ||
                   (ce = cudaMalloc((void **)&t->vlv, NL * vn * sizeof(float))) != cudaSuccess))
            fail(ce, "nuq levels");
        for (size_t l = 0; !s && l < NL; l++)
            if ((ce = cudaMemcpy(t->klv + l * kn, d->layers[l].k_lut.levels, kn * sizeof(float), cudaMemcpyHostToDevice)) != cudaSuccess ||
                (ce = cudaMemcpy(t->vlv + l * vn, d->layers[l].v_lut.levels, vn * sizeof(float), cudaMemcpyHostToDevice)) != cudaSuccess)
                fail(ce, "nuq levels");
    }
    if (s) {
        kvq_cu_tables_free(t);
        return s;
    }
    *out = t;
    return KVQ_OK;
}

#endif
