/* pipeline_mpi.c — the MPI bootstrap of pipeline_nccl.h: one process per GPU
 * (mpirun -np N kvdump ...), NCCL's unique id made by rank 0 and broadcast
 * with MPI_Bcast, then ncclCommInitRank on every rank (NCCL's documented
 * "one device per process" initialisation). Compiled with MPI and NCCL
 * (make MPI=1 NCCL=1, both detected); otherwise stubs that say what the
 * build lacks. */
#include "pipeline_nccl.h"

#include <stdio.h>

#if defined(KVQ_CUDA) && defined(KVQ_NCCL) && defined(KVQ_MPI)
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

int kvq_pipe_mpi_compiled(char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    return 1;
}

kvq_status kvq_pipe_mpi_bootstrap(int *rank, int *size, int gpu, void **nccl_comm, kvq_err *err)
{
    *nccl_comm = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(NULL, NULL) != MPI_SUCCESS) return kvq_fail(err, KVQ_EIO, "MPI: MPI_Init failed");
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    cudaError_t ce = cudaSetDevice(gpu);
    if (ce != cudaSuccess)
        return kvq_fail(err, KVQ_EIO, "MPI rank %d: cudaSetDevice(%d): %s", *rank, gpu, cudaGetErrorString(ce));
    ncclUniqueId id;
    if (*rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) return kvq_fail(err, KVQ_EIO, "MPI rank 0: ncclGetUniqueId: %s", ncclGetErrorString(r));
    }
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        return kvq_fail(err, KVQ_EIO, "MPI rank %d: MPI_Bcast of the NCCL unique id failed", *rank);
    ncclComm_t comm;
    ncclResult_t r = ncclCommInitRank(&comm, *size, id, *rank);
    if (r != ncclSuccess)
        return kvq_fail(err, KVQ_EIO, "MPI rank %d of %d: ncclCommInitRank: %s", *rank, *size, ncclGetErrorString(r));
    *nccl_comm = comm;
    return KVQ_OK;
}

void kvq_pipe_mpi_finalize(void *nccl_comm)
{
    if (nccl_comm) ncclCommDestroy((ncclComm_t)nccl_comm);
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
}
#else
#if !defined(KVQ_CUDA)
#define NO_MPI "kvq was built without CUDA, so without the multi-GPU pipeline"
#elif !defined(KVQ_NCCL)
#define NO_MPI "kvq was built without NCCL (run scripts/setup.sh: nvidia-nccl-cu13; make NCCL=1)"
#else
#define NO_MPI "kvq was built without MPI (run scripts/setup.sh: Debian's libopenmpi-dev; make MPI=1)"
#endif
int kvq_pipe_mpi_compiled(char *why, size_t why_len)
{
    if (why && why_len) snprintf(why, why_len, "%s", NO_MPI);
    return 0;
}
kvq_status kvq_pipe_mpi_bootstrap(int *rank, int *size, int gpu, void **nccl_comm, kvq_err *err)
{
    (void)gpu;
    *rank = 0, *size = 1, *nccl_comm = NULL;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "MPI bootstrap: %s", NO_MPI);
}
void kvq_pipe_mpi_finalize(void *nccl_comm) { (void)nccl_comm; }
#endif
