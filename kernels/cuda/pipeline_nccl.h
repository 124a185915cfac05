/* pipeline_nccl.h — the multi-GPU pipeline on CUDA (issue 47, pipeline.h):
 * the NCCL stage transport (ncclSend / ncclRecv between the GPUs that hold
 * consecutive layer ranges, inside ncclGroupStart / ncclGroupEnd, on each
 * stage's CUDA stream so that transfers are ordered with its kernels), the
 * multi-stage forward driver over micro-batches of windows (one host thread
 * per stage: stage s receives window m's residual stream from stage s-1,
 * runs its layers, sends it to stage s+1, and goes on to window m+1 while
 * the next stage works on m, GPipe's schedule), and the MPI bootstrap for one
 * process per GPU (rank 0 makes the ncclUniqueId, MPI_Bcast hands it to every
 * rank, ncclCommInitRank).
 *
 * Compiled when the build has NCCL (make NCCL=1, detected: the PyPI wheel
 * nvidia-nccl-cu13 that scripts/setup.sh installs, or the CUDA toolkit's
 * nccl.h + libnccl.so) and, for the bootstrap, MPI (make MPI=1, detected:
 * mpicc from Debian's libopenmpi-dev). Without them every function fails
 * with KVQ_EUNSUPPORTED naming what the build lacks, and
 * kvq_pipe_nccl_compiled() / kvq_pipe_mpi_compiled() return 0.
 *
 * NCCL's environment (NCCL_NVLS_ENABLE=0 on the lent machines: NVLink
 * multicast off) is read by NCCL itself; kvq sets no NCCL variable.
 */
#ifndef KVQ_PIPELINE_NCCL_H
#define KVQ_PIPELINE_NCCL_H

#include <stddef.h>

#include "forward.h"
#include "forward_cuda.h"
#include "model.h"
#include "pipeline.h"
#include "status.h"

/* 1 when built with NCCL / MPI (kvq_pipe_mpi_compiled: MPI with NCCL, for the GPU bootstrap). why (if non-NULL)
 * receives what is lacking otherwise. kvq_pipe_mpi_host_compiled: MPI alone (the host transport below). */
int kvq_pipe_mpi_host_compiled(char *why, size_t why_len);
int kvq_pipe_nccl_compiled(char *why, size_t why_len);
int kvq_pipe_mpi_compiled(char *why, size_t why_len);

typedef struct kvq_pipe_cuda kvq_pipe_cuda; /* opaque */

/* A pipeline over the GPUs gpus[0..n) of this process (stage s on gpus[s]),
 * layers split by kvq_pipe_partition from the GPUs' free memory (or `first`
 * [n+1] when non-NULL; with KVQ_FWD_SAVE_ACTIVATIONS in flags the plan counts
 * the backward's activation store), one CUDA forward workspace per stage
 * holding only its layers (kvq_forward_cuda_init_stage) and one NCCL communicator per GPU
 * (ncclCommInitAll). report (may be NULL, report_len > 0) receives one line
 * per stage: GPU, layers, bytes planned / free. Errors: those of the
 * partitioner and the CUDA forward; KVQ_EIO for NCCL failures (the call and
 * ncclGetErrorString); KVQ_EUNSUPPORTED without NCCL. */
kvq_status kvq_pipe_cuda_init(kvq_pipe_cuda **out, const kvq_model *m, const int *gpus, int n, const int *first, int max_T,
                              int max_P, unsigned flags, kvq_cuda_math math, char *report, size_t report_len, kvq_err *err);
void kvq_pipe_cuda_free(kvq_pipe_cuda *p);

/* Forward of n_windows windows (kvq_forward_run's contract for each: ios[i]
 * with its hooks, prefix and outputs, res[i]), pipelined: the windows are
 * the micro-batches. Hooks of layer l run on the host thread of the stage
 * holding l, so hooks of different stages run concurrently (for different
 * layers and windows): a hook's state must be per layer, or locked. */
kvq_status kvq_pipe_cuda_run(kvq_pipe_cuda *p, const kvq_fwd_io *ios, kvq_fwd_result *res, int n_windows, kvq_err *err);

/* Forward then backward of one window (kvq_backward_run's contract; the
 * pipeline made with KVQ_FWD_SAVE_ACTIVATIONS, each stage keeping its
 * layers' activations): the stages' forwards in order, the residual stream
 * handed on with NCCL, then their backwards from the last (the LM head's
 * cross-entropy) to the first, dL/dx handed back; grads sees the layers
 * n_layers-1 .. 0 as on one GPU. One host thread, one window at a time (no
 * overlap between stages). A failure aborts the communicators (the pipeline
 * cannot run again). */
kvq_status kvq_pipe_cuda_backward(kvq_pipe_cuda *p, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                                  kvq_err *err);
/* The built-in KV transform of every stage (kvq_forward_cuda_set_kv). */
kvq_status kvq_pipe_cuda_set_kv(kvq_pipe_cuda *p, const kvq_kv_desc *d, kvq_err *err);
/* Counters summed over the stages (runs and seconds: the first stage's). */
void kvq_pipe_cuda_stats(const kvq_pipe_cuda *p, kvq_cuda_stats *out);
/* "pipeline of N GPUs (layers a..b on cuda:i, ...): " + the first stage's description. */
void kvq_pipe_cuda_describe(const kvq_pipe_cuda *p, char *buf, size_t n);

/* The layer range of each stage: first[0..n] (n+1 entries). */
void kvq_pipe_cuda_stages(const kvq_pipe_cuda *p, int *first, int *n);

/* An NCCL communicator with the library's entry points (NCCL is loaded at
 * run time, dlopen of libnccl.so.2: the path of the build's NCCL first, then
 * the loader's search path, so that a binary built with NCCL still starts
 * where it is absent and says so when several GPUs are asked for). */
typedef struct kvq_pipe_comm kvq_pipe_comm; /* opaque */

/* MPI bootstrap (one process per GPU, mpirun -np N): this process's rank and
 * size in MPI_COMM_WORLD and an NCCL communicator over all ranks (rank 0
 * creates the unique id, MPI_Bcast distributes it, ncclCommInitRank). The
 * process selects GPU `gpu` (under Open MPI: OMPI_COMM_WORLD_LOCAL_RANK)
 * before joining. Errors: KVQ_EUNSUPPORTED without MPI or NCCL; KVQ_EIO. */
kvq_status kvq_pipe_mpi_bootstrap(int *rank, int *size, int gpu, kvq_pipe_comm **out, kvq_err *err);
/* Destroy the communicator and finalize MPI. */
void kvq_pipe_mpi_finalize(kvq_pipe_comm *c);

/* MPI without GPUs (host buffers): MPI_Init when not yet done, this
 * process's rank and size in MPI_COMM_WORLD; and a stage transport in which
 * stage s is rank s and this process is stage `own` (sends and receives of
 * other stages skipped; inside a group MPI_Isend / MPI_Irecv, completed by
 * MPI_Waitall at the group's end, NCCL's semantics). For the CPU stage loop in
 * several processes on one host (tests/test_pipeline.c runs it under
 * mpirun -np 2), the layout the GPU processes use. kvq_pipe_mpi_done calls
 * MPI_Finalize. Errors: KVQ_EUNSUPPORTED without MPI; KVQ_EIO. */
kvq_status kvq_pipe_mpi_init(int *rank, int *size, kvq_err *err);
kvq_status kvq_pipe_mpi_xport(int own, kvq_pipe_xport *out, kvq_err *err);
void kvq_pipe_mpi_xport_free(kvq_pipe_xport *xp);
void kvq_pipe_mpi_done(void);

/* A stage transport over communicator c in which stage s is rank s and this
 * process (or thread) is stage `own`: sends from and receives into other
 * stages are skipped, so that the same stage loop runs in every process;
 * buffers are device pointers on own's GPU; stream (a cudaStream_t) orders
 * the transfers with the stage's kernels. The transport borrows c. */
kvq_status kvq_pipe_nccl_xport(kvq_pipe_comm *c, int own, void *stream, kvq_pipe_xport *out, kvq_err *err);

#endif
