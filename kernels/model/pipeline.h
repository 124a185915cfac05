/* pipeline.h — pipeline parallelism by layers (issue 47): the GPUs of one
 * host (or one GPU per process across hosts, MPI) each hold a contiguous range
 * of layers; the residual stream [T][dim] of a window goes from stage to stage
 * forward, its gradient dL/dx [T][dim] backward (GPipe, Huang et al. 2019 §2:
 * a batch of windows split into micro-batches so that stages overlap). This
 * header is plain C and device-free:
 *
 *  - --devices parsing (kvq_devices_parse): "all" or a list "cuda:0,1,3"
 *    (each item N or cuda:N), duplicates, bad and absent indices refused;
 *  - the partitioner (kvq_pipe_partition): layers to devices by memory, from
 *    the bytes each layer needs where it runs (weights + working memory per
 *    layer for the given windows, kvq_pipe_need_llama), the extras of the first
 *    device (embedding table) and of the last (final norm, LM head, its logit
 *    block), the layer-independent workspace every device needs, and each
 *    device's free memory; it refuses a model that does not fit, naming the
 *    numbers;
 *  - the stage transport (kvq_pipe_xport): the point-to-point interface the
 *    stage loop uses to hand activations and gradients between stages. NCCL
 *    (ncclSend / ncclRecv inside ncclGroupStart / ncclGroupEnd, one
 *    communicator rank per stage; kernels/cuda/pipeline_nccl.h) and a loopback
 *    for one process (kvq_pipe_loopback: tests, and the degenerate pipeline of
 *    one device) implement it with the same semantics: inside a group, sends
 *    and receives may be posted in any order; a receive buffer is filled only
 *    when the group ends; a receive with no matching send is an error (NCCL
 *    would hang);
 *  - the CPU stage loop (kvq_pipe_cpu_forward / kvq_pipe_cpu_backward): the
 *    forward and the backward of forward.h / backward.h run stage by stage over
 *    layer ranges (kvq_forward_stage, kvq_backward_stage_forward,
 *    kvq_backward_stage_backward) with the transport between them. They are the
 *    reference of the CUDA driver's structure and prove the staging exact: the
 *    staged run gives the unstaged run's bits (tests/test_pipeline.c).
 *
 * Memory model (bytes, kvq_pipe_need_llama; the CUDA forward's allocations,
 * forward_cuda.cu):
 *   layer l: weights  we * (2 q_dim dim + 2 kv_dim dim + 3 hidden_dim dim)
 *                     + 4 * (2 dim + biases + q/k norms)   (we = 4 fp32, 2 bf16)
 *            prefix   4 * 2 * P * kv_dim
 *            backward (Fisher) store per window in flight: 4 * T * (2 dim +
 *                     2 q_dim + 4 kv_dim + n_heads + 2 hidden_dim + 2)
 *   first:   embedding we * vocab * dim
 *   last:    final norm 4 dim, LM head we * vocab * dim (untied, or tied and
 *            on another device than the embedding), logit block 4 T v_chunk
 *   every device: activations of one window 4 T (6 dim + 3 q_dim + 7 kv_dim +
 *            2 hidden_dim + 4 n_heads + 16) + the backward workspace
 *            (4 T (4 dim + 4 q_dim + 8 kv_dim + 3 hidden_dim)) + per window in
 *            flight two [T][dim] transfer buffers + the reserve (CUDA
 *            context, cuBLAS and NCCL buffers; KVQ_PIPE_RESERVE default).
 */
#ifndef KVQ_PIPELINE_H
#define KVQ_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>

#include "backward.h"
#include "forward.h"
#include "model.h"
#include "status.h"

#define KVQ_PIPE_MAX_DEV 64
/* Device memory every stage leaves for the CUDA context, cuBLAS's and NCCL's
 * own buffers (bytes). */
#define KVQ_PIPE_RESERVE (1.5 * 1024.0 * 1024.0 * 1024.0)

/* Parse --devices: "all" (every one of the n_avail GPUs, in index order) or a
 * comma list whose items are GPU indices N or cuda:N ("cuda:0,1", "0,2",
 * "cuda:1,cuda:0"; order = pipeline order); "cuda" alone is cuda:0. Writes
 * ids[0..*n). n_avail: GPUs present (kvq_cuda_device_count). Errors:
 * KVQ_EINVAL (malformed item, duplicate, index >= n_avail, more than
 * max_ids), KVQ_EUNSUPPORTED (n_avail == 0: no GPU, the reason `why` if given,
 * else "no GPU"). `opt` names the option in messages ("--devices"). */
kvq_status kvq_devices_parse(const char *s, int n_avail, const char *why, const char *opt, int *ids, int max_ids, int *n,
                             kvq_err *err);

/* What a model needs on the devices of a pipeline (bytes; see the header comment). */
typedef struct {
    int n_layers;
    const double *layer_bytes; /* [n_layers] on the device holding layer l */
    double first_bytes;        /* on the device holding layer 0 */
    double last_bytes;         /* on the device holding layer n_layers-1 */
    double tied_bytes;         /* tied embeddings: the LM head's copy, needed on the last device only when it is not the first */
    double device_bytes;       /* on every device used */
} kvq_pipe_need;

/* Fill need (layer_bytes: caller's array [hp->n_layers]) for the CUDA forward
 * of hp: weight_bytes 4 (fp32) or 2 (bf16 math); windows of T tokens after P
 * prefix entries; in_flight windows (micro-batches) kept per stage; backward:
 * the Fisher information's activation store and workspace. reserve: bytes per
 * device for the CUDA context etc. (KVQ_PIPE_RESERVE). */
void kvq_pipe_need_llama(const kvq_hparams *hp, int weight_bytes, int T, int P, int in_flight, bool backward, double reserve,
                         double *layer_bytes, kvq_pipe_need *need);

/* Assign contiguous layer ranges to the n_dev devices in list order: device d
 * holds layers first[d] .. first[d+1]-1 (first[0] = 0, first[n_dev] =
 * n_layers, every device at least one layer). The assignment minimises the
 * largest number of layers on a device (the pipeline's slowest stage, layers
 * being equal in work) subject to each device's bytes <= dev_free[d]; among
 * those, earlier devices take as many layers as that bound allows (the last
 * device also holds the LM head). One device: every layer on it if it fits.
 * names[d] (may be NULL) label devices in messages. Errors: KVQ_EINVAL (n_dev
 * outside 1..KVQ_PIPE_MAX_DEV, fewer layers than devices), KVQ_ENOMEM (does
 * not fit: the message names the model's total, each device's free memory and
 * what the first device that ran out needed). */
kvq_status kvq_pipe_partition(const kvq_pipe_need *need, const double *dev_free, const char *const *names, int n_dev,
                              int *first, kvq_err *err);

/* Bytes device d needs under an assignment (for reports and tests). */
double kvq_pipe_device_bytes(const kvq_pipe_need *need, const int *first, int n_dev, int d);

/* ---- stage transport ---- */
typedef struct {
    void *user;
    kvq_status (*group_begin)(void *user, kvq_err *err);
    /* n floats of buf from stage `from` to stage `to` (buf in the memory of `from`'s device) */
    kvq_status (*send)(void *user, int from, int to, const float *buf, size_t n, kvq_err *err);
    /* n floats into buf (memory of `to`'s device), from stage `from`; filled when the group ends */
    kvq_status (*recv)(void *user, int to, int from, float *buf, size_t n, kvq_err *err);
    kvq_status (*group_end)(void *user, kvq_err *err);
} kvq_pipe_xport;

/* Loopback transport for one process: sends are copied into a mailbox per
 * (from, to) edge, receives are matched at group_end (calls outside a group
 * are groups of their own). */
typedef struct {
    int n_stages;
    int depth;           /* open groups */
    struct kvq_pipe_msg *msgs; /* posted, unmatched sends and receives */
    size_t n_msgs, cap;
    size_t bytes_moved;  /* counters for tests */
    int transfers;
} kvq_pipe_loopback;

void kvq_pipe_loopback_init(kvq_pipe_loopback *lb, int n_stages);
void kvq_pipe_loopback_free(kvq_pipe_loopback *lb);
kvq_pipe_xport kvq_pipe_loopback_xport(kvq_pipe_loopback *lb);

/* One send+receive pair as its own group: stage from's buf -> stage to's dst. */
kvq_status kvq_pipe_xfer(const kvq_pipe_xport *xp, int from, int to, const float *buf, float *dst, size_t n, kvq_err *err);

/* ---- the CPU stage loop ---- */
/* Forward of one window through n_stages stages, stage s running layers
 * first[s] .. first[s+1]-1 in workspace fw[s] (each made for the model, max_T
 * >= io->T; one workspace per stage as each GPU has its own), residual streams
 * handed on through xp into xbuf[s] (stage s's receive buffer, [max_T][dim],
 * s >= 1). res: the last stage's (kvq_forward_run's contract). */
kvq_status kvq_pipe_cpu_forward(kvq_forward *const *fw, float *const *xbuf, const int *first, int n_stages,
                                const kvq_pipe_xport *xp, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err);
/* Several processes (MPI, one stage each): fw[s] == NULL for the stages this
 * process does not run; the transport skips their sends and receives (an
 * "own stage" transport: kvq_pipe_mpi_xport, kvq_pipe_nccl_xport), so every
 * process runs the same loop; res is the run's in the last stage's process.
 * The same holds for kvq_pipe_cpu_backward (bw[s] == NULL). */
/* kvq_backward_run's contract staged the same way: the forward stage by stage,
 * then the backward from the last stage to the first, dL/dx handed back through
 * xp into dbuf[s] (stage s's receive buffer, [max_T][dim], s < n_stages-1).
 * spec->grads sees the layers in the order n_layers-1 .. 0, as unstaged. */
kvq_status kvq_pipe_cpu_backward(kvq_backward *const *bw, float *const *xbuf, float *const *dbuf, const int *first,
                                 int n_stages, const kvq_pipe_xport *xp, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                 kvq_bwd_result *res, kvq_err *err);

#endif
