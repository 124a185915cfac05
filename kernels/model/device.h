/* device.h — choosing where the forward runs (--device cuda|cpu|auto) and
 * one forward "engine" that dispatches to the CPU forward (forward.h) or the
 * CUDA forward (forward_cuda.h) with the same calls, for kveval, kvdump and
 * IntactKV training.
 *
 * Engine semantics are those of kvq_forward_run on both devices. A built-in
 * KV scheme is given as a descriptor (kv_desc.h) through kvq_engine_set_kv:
 * on the CPU it runs as the kvq_kv_desc_transform hook (quant.h), on the GPU
 * natively; any other scheme is passed as io->hooks->transform (on the GPU:
 * host transform, see forward_cuda.h). io->hooks->observe works on both.
 *
 * kveval usage:
 *    kvq_device dev;
 *    KVQ_TRY(kvq_device_parse(opt_device ? opt_device : "auto", &dev, NULL, err));
 *    kvq_engine e;
 *    KVQ_TRY(kvq_engine_init(&e, dev, KVQ_CUDA_EXACT, &model, ctx, P, 0, err));
 *    fprintf(report, "device: %s\n", kvq_engine_describe(&e, buf, sizeof buf));
 *    for each scheme: kvq_engine_set_kv(&e, &desc or NULL, err); for each window: kvq_engine_run(&e, &io, &res, err);
 *    kvq_engine_free(&e);
 */
#ifndef KVQ_DEVICE_H
#define KVQ_DEVICE_H

#include <stdbool.h>
#include <stddef.h>

#include "backward.h"
#include "forward.h"
#include "forward_cuda.h"
#include "kv_desc.h"
#include "status.h"

typedef enum { KVQ_DEVICE_CPU = 0, KVQ_DEVICE_CUDA = 1 } kvq_device;

/* "cpu" → CPU; "cuda" (or "cuda:N" — N is the GPU index, returned in *index
 * when index is non-NULL) → CUDA, failing with KVQ_EUNSUPPORTED and the reason
 * when this build or machine has no usable GPU; "auto" → CUDA when
 * kvq_cuda_device_count() > 0, else CPU. Other strings → KVQ_EINVAL. */
kvq_status kvq_device_parse(const char *s, kvq_device *out, int *index, kvq_err *err);
const char *kvq_device_name(kvq_device d);

/* --devices LIST (pipeline.h kvq_devices_parse) beside --device DEV (NULL when
 * not given): both given is KVQ_EINVAL. The list's syntax and duplicates are
 * checked first, then (several GPUs) that the build has the NCCL pipeline
 * (KVQ_EUNSUPPORTED naming what it lacks), then the GPUs present
 * (KVQ_EUNSUPPORTED without any, KVQ_EINVAL for an absent index). On success
 * ids[0..*n) are the GPUs in pipeline order; *n == 1 is today's single-GPU
 * path: one_dev receives "cuda:N" for use as --device. */
kvq_status kvq_devices_resolve(const char *devices, const char *device, int *ids, int max_ids, int *n, char *one_dev,
                               size_t one_len, kvq_err *err);

/* kvq_engine_init flag (beside KVQ_FWD_*): make the engine able to run
 * kvq_engine_backward (CPU: a kvq_backward workspace, which owns the
 * forward; GPU: the activation store, KVQ_FWD_SAVE_ACTIVATIONS). */
enum { KVQ_ENGINE_BACKWARD = 1u << 8 };

typedef struct {
    kvq_device dev;
    const kvq_model *model;   /* the model of init */
    kvq_forward cpu;          /* dev == CPU, without KVQ_ENGINE_BACKWARD */
    kvq_backward bw;          /* dev == CPU, with KVQ_ENGINE_BACKWARD (its forward is bw.fw) */
    bool has_bw;
    kvq_forward_cuda *gpu;    /* dev == CUDA, one GPU */
    struct kvq_pipe_cuda *pipe; /* dev == CUDA, several GPUs (kvq_engine_init_pipe; gpu is NULL) */
    kvq_kv_desc desc;         /* current built-in transform (CPU side) */
    bool has_desc;
    kvq_kv_desc_run run;      /* CPU hook state */
    kvq_hooks merged;         /* CPU: descriptor transform + caller's observe */
    const kvq_hooks *caller;  /* the caller's hooks of the current run */
} kvq_engine;

kvq_status kvq_engine_init(kvq_engine *e, kvq_device dev, kvq_cuda_math math, const kvq_model *m, int max_T, int max_P,
                           unsigned flags, kvq_err *err);
/* The same on GPU `gpu` (the N of cuda:N; ignored for the CPU).
 * kvq_engine_init is kvq_engine_init_at(..., gpu = 0, ...). */
kvq_status kvq_engine_init_at(kvq_engine *e, kvq_device dev, int gpu, kvq_cuda_math math, const kvq_model *m, int max_T,
                              int max_P, unsigned flags, kvq_err *err);
/* As kvq_engine_init_at, for a device that came from "auto": when fallback is
 * true and dev is CUDA but the GPU cannot run this model (KVQ_EUNSUPPORTED,
 * e.g. a head_dim the CUDA attention kernel lacks), the engine is made on the
 * CPU instead (e->dev says which) and note (if non-NULL, note_len > 0)
 * receives "no GPU run: <reason>; running on the CPU"; otherwise note is set
 * to "". Other errors are returned as they are. */
kvq_status kvq_engine_init_fallback(kvq_engine *e, kvq_device dev, bool fallback, int gpu, kvq_cuda_math math,
                                    const kvq_model *m, int max_T, int max_P, unsigned flags, char *note, size_t note_len,
                                    kvq_err *err);
/* The engine over several GPUs of this host (pipeline_nccl.h: layers split by
 * memory, NCCL between the stages; KVQ_ENGINE_BACKWARD: kvq_engine_backward
 * runs kvq_pipe_cuda_backward; kvq_engine_layer_input is not available).
 * n == 1 is kvq_engine_init_at on gpus[0]. report: kvq_pipe_cuda_init's. */
kvq_status kvq_engine_init_pipe(kvq_engine *e, const int *gpus, int n, kvq_cuda_math math, const kvq_model *m, int max_T,
                                int max_P, unsigned flags, char *report, size_t report_len, kvq_err *err);
/* The CUDA counters of the engine (summed over a pipeline's stages); zeros on the CPU. */
void kvq_engine_cuda_stats(const kvq_engine *e, kvq_cuda_stats *out);
void kvq_engine_free(kvq_engine *e);
/* Built-in KV transform for the next runs (NULL / FP32 = none). The
 * descriptor is copied; its tables must outlive the runs on the CPU. */
kvq_status kvq_engine_set_kv(kvq_engine *e, const kvq_kv_desc *d, kvq_err *err);
/* kvq_forward_run's contract; with a descriptor set, io->hooks->transform must be NULL. */
kvq_status kvq_engine_run(kvq_engine *e, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err);
/* n windows: on a pipeline (kvq_engine_init_pipe) as micro-batches, so that the stages overlap
 * (kvq_pipe_cuda_run; hooks of different stages then run concurrently, so a caller passes hooks only
 * when their state is per layer); elsewhere kvq_engine_run for each in turn. */
kvq_status kvq_engine_run_batch(kvq_engine *e, const kvq_fwd_io *ios, kvq_fwd_result *res, int n, kvq_err *err);
/* kvq_backward_run's contract (backward.h) on the engine's device, with the
 * descriptor's transform (straight-through) when one is set. Needs
 * KVQ_ENGINE_BACKWARD at init (else KVQ_EINVAL). */
kvq_status kvq_engine_backward(kvq_engine *e, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                               kvq_err *err);
/* Copy the residual stream entering layer l of the last run (l = n_layers:
 * entering the final norm) into out [T][dim]. Needs KVQ_FWD_SAVE_LAYER_INPUTS
 * or KVQ_ENGINE_BACKWARD at init. Errors: KVQ_EINVAL. */
kvq_status kvq_engine_layer_input(kvq_engine *e, int l, float *out, kvq_err *err);
/* "CPU (N OpenMP threads, OpenBLAS sgemm, fp32)" or the GPU description
 * (kvq_forward_cuda_describe). Returns buf. */
const char *kvq_engine_describe(const kvq_engine *e, char *buf, size_t n);

#endif
