/* nccl_api.h — NCCL's entry points loaded at run time (dlopen), shared by
 * pipeline_nccl.cu and pipeline_mpi.c. Internal (kvqi_ prefix); needs nccl.h
 * and cuda_runtime.h, so only builds with KVQ_NCCL include it. */
#ifndef KVQ_NCCL_API_H
#define KVQ_NCCL_API_H

#include <cuda_runtime.h>
#include <nccl.h>

#include "status.h"

typedef struct {
    void *lib; /* dlopen handle */
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
} kvqi_nccl_api;

/* Load libnccl.so.2 (KVQ_NCCL_LIB, the build's, first; then the loader's
 * search path) and resolve the entry points. Errors: KVQ_EUNSUPPORTED naming
 * the paths tried and dlerror(). */
kvq_status kvqi_nccl_load(kvqi_nccl_api *api, kvq_err *err);
void kvqi_nccl_unload(kvqi_nccl_api *api);

/* Free the state of a transport made by kvq_pipe_nccl_xport. */
#include "pipeline.h"
void kvqi_nccl_xport_free(kvq_pipe_xport *xp);

/* One communicator (a rank of a pipeline) with its library. */
struct kvq_pipe_comm {
    kvqi_nccl_api api;
    ncclComm_t comm;
    int rank, size;
    int own_api; /* 1: api loaded for this communicator alone (MPI bootstrap) */
};

#endif
