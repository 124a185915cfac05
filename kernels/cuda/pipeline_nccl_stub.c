/* Stubs of pipeline_nccl.h for builds without NCCL (or without CUDA); the
 * NCCL build uses pipeline_nccl.cu. */
#include "pipeline_nccl.h"

#include <stdio.h>
#include <string.h>

#if !defined(KVQ_CUDA) || !defined(KVQ_NCCL)
#ifndef KVQ_CUDA
#define NO_NCCL "kvq was built without CUDA (CUDA=0 or no nvcc), so without the multi-GPU pipeline"
#else
#define NO_NCCL "kvq was built without NCCL (NCCL=0, or neither the nvidia-nccl-cu13 wheel nor the CUDA toolkit's nccl.h was found: run scripts/setup.sh and rebuild)"
#endif

int kvq_pipe_nccl_compiled(char *why, size_t why_len)
{
    if (why && why_len) snprintf(why, why_len, "%s", NO_NCCL);
    return 0;
}

kvq_status kvq_pipe_cuda_init(kvq_pipe_cuda **out, const kvq_model *m, const int *gpus, int n, const int *first, int max_T,
                              int max_P, unsigned flags, kvq_cuda_math math, char *report, size_t report_len, kvq_err *err)
{
    (void)m, (void)gpus, (void)n, (void)first, (void)max_T, (void)max_P, (void)flags, (void)math, (void)report, (void)report_len;
    *out = NULL;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "multi-GPU pipeline: %s", NO_NCCL);
}
void kvq_pipe_cuda_free(kvq_pipe_cuda *p) { (void)p; }
kvq_status kvq_pipe_cuda_run(kvq_pipe_cuda *p, const kvq_fwd_io *ios, kvq_fwd_result *res, int n_windows, kvq_err *err)
{
    (void)p, (void)ios, (void)res, (void)n_windows;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "multi-GPU pipeline: %s", NO_NCCL);
}
kvq_status kvq_pipe_cuda_backward(kvq_pipe_cuda *p, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                                  kvq_err *err)
{
    (void)p, (void)io, (void)spec, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "multi-GPU pipeline: %s", NO_NCCL);
}
kvq_status kvq_pipe_cuda_set_kv(kvq_pipe_cuda *p, const kvq_kv_desc *d, kvq_err *err)
{
    (void)p, (void)d;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "multi-GPU pipeline: %s", NO_NCCL);
}
void kvq_pipe_cuda_stats(const kvq_pipe_cuda *p, kvq_cuda_stats *out)
{
    (void)p;
    memset(out, 0, sizeof *out);
}
void kvq_pipe_cuda_describe(const kvq_pipe_cuda *p, char *buf, size_t n)
{
    (void)p;
    if (n) snprintf(buf, n, "(no pipeline: %s)", NO_NCCL);
}
void kvq_pipe_cuda_stages(const kvq_pipe_cuda *p, int *first, int *n)
{
    (void)p, (void)first;
    *n = 0;
}
kvq_status kvq_pipe_nccl_xport(kvq_pipe_comm *c, int own, void *stream, kvq_pipe_xport *out, kvq_err *err)
{
    (void)c, (void)own, (void)stream, (void)out;
    return kvq_fail(err, KVQ_EUNSUPPORTED, "NCCL transport: %s", NO_NCCL);
}
#endif

