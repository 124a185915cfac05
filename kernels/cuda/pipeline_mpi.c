/* pipeline_mpi.c — the MPI bootstrap of pipeline_nccl.h: one process per GPU
 * (mpirun -np N), NCCL's unique id made by rank 0 and broadcast with
 * MPI_Bcast, then ncclCommInitRank on every rank (NCCL's documented "one
 * device per process" initialisation). Compiled with MPI and NCCL (make
 * MPI=1 NCCL=1, both detected); otherwise stubs that say what the build
 * lacks. */
#include "pipeline_nccl.h"

#include <stdio.h>

#if defined(KVQ_CUDA) && defined(KVQ_NCCL) && defined(KVQ_MPI)
#include <cuda_runtime.h>
#include <mpi.h>
#include <stdlib.h>

#include "nccl_api.h"

int kvq_pipe_mpi_compiled(char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    return 1;
}

kvq_status kvq_pipe_mpi_bootstrap(int *rank, int *size, int gpu, kvq_pipe_comm **out, kvq_err *err)
{
    *out = NULL;
    *rank = 0, *size = 1;
    KVQ_TRY(kvq_pipe_mpi_init(rank, size, err));
    kvq_pipe_comm *c = calloc(1, sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ENOMEM, "MPI rank %d: out of memory", *rank);
    kvq_status s = kvqi_nccl_load(&c->api, err);
    if (s) {
        free(c);
        return kvq_err_prefix(err, "MPI rank %d", *rank);
    }
    c->own_api = 1;
    c->rank = *rank;
    c->size = *size;
    cudaError_t ce = cudaSetDevice(gpu);
    ncclUniqueId id;
    ncclResult_t r = ncclSuccess;
    if (ce != cudaSuccess) {
        s = kvq_fail(err, KVQ_EIO, "MPI rank %d: cudaSetDevice(%d): %s", *rank, gpu, cudaGetErrorString(ce));
    } else if (*rank == 0 && (r = c->api.GetUniqueId(&id)) != ncclSuccess) {
        s = kvq_fail(err, KVQ_EIO, "MPI rank 0: ncclGetUniqueId: %s", c->api.GetErrorString(r));
    }
    /* every rank takes part in the broadcast (a failed rank 0 sends garbage, then everyone fails in init) */
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS && !s)
        s = kvq_fail(err, KVQ_EIO, "MPI rank %d: MPI_Bcast of the NCCL unique id failed", *rank);
    if (!s && (r = c->api.CommInitRank(&c->comm, *size, id, *rank)) != ncclSuccess)
        s = kvq_fail(err, KVQ_EIO, "MPI rank %d of %d: ncclCommInitRank: %s", *rank, *size, c->api.GetErrorString(r));
    if (s) {
        kvqi_nccl_unload(&c->api);
        free(c);
        return s;
    }
    *out = c;
    return KVQ_OK;
}

void kvq_pipe_mpi_finalize(kvq_pipe_comm *c)
{
    if (c) {
        if (c->comm) c->api.CommDestroy(c->comm);
        if (c->own_api) kvqi_nccl_unload(&c->api);
        free(c);
    }
    kvq_pipe_mpi_done();
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
kvq_status kvq_pipe_mpi_bootstrap(int *rank, int *size, int gpu, kvq_pipe_comm **out, kvq_err *err)
{
    (void)gpu;
    *rank = 0, *size = 1, *out = NULL;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "MPI bootstrap: %s", NO_MPI);
}
void kvq_pipe_mpi_finalize(kvq_pipe_comm *c) { (void)c; }
#endif

/* ---- MPI alone: the host transport ---- */
#if defined(KVQ_MPI)
#include <mpi.h>
#include <stdlib.h>

int kvq_pipe_mpi_host_compiled(char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    return 1;
}

kvq_status kvq_pipe_mpi_init(int *rank, int *size, kvq_err *err)
{
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(NULL, NULL) != MPI_SUCCESS) return kvq_fail(err, KVQ_EIO, "MPI: MPI_Init failed");
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    return KVQ_OK;
}

void kvq_pipe_mpi_done(void)
{
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
}

typedef struct {
    int own, depth;
    MPI_Request *req;
    int n_req, cap;
} mpi_xp;

static kvq_status mx_post(mpi_xp *x, MPI_Request r, kvq_err *err)
{
    if (x->n_req == x->cap) {
        int nc = x->cap ? 2 * x->cap : 8;
        MPI_Request *nr = realloc(x->req, (size_t)nc * sizeof *nr);
        if (!nr) {
            MPI_Cancel(&r);
            return kvq_fail(err, KVQ_ENOMEM, "MPI transport: out of memory");
        }
        x->req = nr, x->cap = nc;
    }
    x->req[x->n_req++] = r;
    return KVQ_OK;
}

static kvq_status mx_wait(mpi_xp *x, kvq_err *err)
{
    int rc = x->n_req ? MPI_Waitall(x->n_req, x->req, MPI_STATUSES_IGNORE) : MPI_SUCCESS;
    x->n_req = 0;
    return rc == MPI_SUCCESS ? KVQ_OK : kvq_fail(err, KVQ_EIO, "MPI transport: MPI_Waitall failed (stage %d)", x->own);
}

static kvq_status mx_begin(void *user, kvq_err *err)
{
    (void)err;
    ((mpi_xp *)user)->depth++;
    return KVQ_OK;
}

static kvq_status mx_end(void *user, kvq_err *err)
{
    mpi_xp *x = user;
    if (x->depth <= 0) return kvq_fail(err, KVQ_EINVAL, "MPI transport: group end without a group start");
    return --x->depth ? KVQ_OK : mx_wait(x, err);
}

static kvq_status mx_send(void *user, int from, int to, const float *buf, size_t n, kvq_err *err)
{
    mpi_xp *x = user;
    if (from != x->own) return KVQ_OK;
    if (n > (size_t)2147483647) return kvq_fail(err, KVQ_EINVAL, "MPI transport: %zu floats in one message", n);
    MPI_Request r;
    if (MPI_Isend(buf, (int)n, MPI_FLOAT, to, 0, MPI_COMM_WORLD, &r) != MPI_SUCCESS)
        return kvq_fail(err, KVQ_EIO, "MPI transport: MPI_Isend stage %d -> %d failed", from, to);
    KVQ_TRY(mx_post(x, r, err));
    return x->depth ? KVQ_OK : mx_wait(x, err);
}

static kvq_status mx_recv(void *user, int to, int from, float *buf, size_t n, kvq_err *err)
{
    mpi_xp *x = user;
    if (to != x->own) return KVQ_OK;
    if (n > (size_t)2147483647) return kvq_fail(err, KVQ_EINVAL, "MPI transport: %zu floats in one message", n);
    MPI_Request r;
    if (MPI_Irecv(buf, (int)n, MPI_FLOAT, from, 0, MPI_COMM_WORLD, &r) != MPI_SUCCESS)
        return kvq_fail(err, KVQ_EIO, "MPI transport: MPI_Irecv stage %d <- %d failed", to, from);
    KVQ_TRY(mx_post(x, r, err));
    return x->depth ? KVQ_OK : mx_wait(x, err);
}

kvq_status kvq_pipe_mpi_xport(int own, kvq_pipe_xport *out, kvq_err *err)
{
    mpi_xp *x = calloc(1, sizeof *x);
    if (!x) return kvq_fail(err, KVQ_ENOMEM, "MPI transport: out of memory");
    x->own = own;
    *out = (kvq_pipe_xport){.user = x, .group_begin = mx_begin, .send = mx_send, .recv = mx_recv, .group_end = mx_end};
    return KVQ_OK;
}

void kvq_pipe_mpi_xport_free(kvq_pipe_xport *xp)
{
    mpi_xp *x = xp->user;
    if (x) free(x->req);
    free(x);
    xp->user = NULL;
}
#else
#define NO_MPI_HOST "kvq was built without MPI (run scripts/setup.sh: Debian's libopenmpi-dev; make MPI=1)"
int kvq_pipe_mpi_host_compiled(char *why, size_t why_len)
{
    if (why && why_len) snprintf(why, why_len, "%s", NO_MPI_HOST);
    return 0;
}
kvq_status kvq_pipe_mpi_init(int *rank, int *size, kvq_err *err)
{
    *rank = 0, *size = 1;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "MPI: %s", NO_MPI_HOST);
}
void kvq_pipe_mpi_done(void) {}
kvq_status kvq_pipe_mpi_xport(int own, kvq_pipe_xport *out, kvq_err *err)
{
    (void)own, (void)out;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "MPI transport: %s", NO_MPI_HOST);
}
void kvq_pipe_mpi_xport_free(kvq_pipe_xport *xp) { (void)xp; }
#endif
