/* CPU-only stubs of forward_cuda.h; the CUDA build uses forward_cuda.cu. */
#include "forward_cuda.h"

#ifndef KVQ_CUDA
#include <stdio.h>

#define NO_CUDA "CUDA forward: kvq was built without CUDA (CUDA=0 or no nvcc); use --device cpu"

kvq_status kvq_forward_cuda_init(kvq_forward_cuda **out, const kvq_model *m, int max_T, int max_P, unsigned flags,
                                 kvq_cuda_math math, int device, kvq_err *err)
{
    (void)m, (void)max_T, (void)max_P, (void)flags, (void)math, (void)device;
    *out = NULL;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_init_stage(kvq_forward_cuda **out, const kvq_model *m, int l0, int l1, int max_T, int max_P,
                                       unsigned flags, kvq_cuda_math math, int device, kvq_err *err)
{
    (void)m, (void)l0, (void)l1, (void)max_T, (void)max_P, (void)flags, (void)math, (void)device;
    *out = NULL;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_stage(kvq_forward_cuda *g, const kvq_fwd_io *io, const float *x_in, kvq_fwd_result *res,
                                  kvq_err *err)
{
    (void)g, (void)io, (void)x_in, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_backward_stage_forward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                   const float *x_in, kvq_bwd_result *res, kvq_err *err)
{
    (void)g, (void)io, (void)spec, (void)x_in, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_backward_stage_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                                    const float *dx_in, kvq_bwd_result *res, kvq_err *err)
{
    (void)g, (void)io, (void)spec, (void)dx_in, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
float *kvq_forward_cuda_stage_dx(kvq_forward_cuda *g)
{
    (void)g;
    return NULL;
}
float *kvq_forward_cuda_stage_x(kvq_forward_cuda *g)
{
    (void)g;
    return NULL;
}
void *kvq_forward_cuda_stream(kvq_forward_cuda *g)
{
    (void)g;
    return NULL;
}
int kvq_forward_cuda_gpu(const kvq_forward_cuda *g)
{
    (void)g;
    return -1;
}
void kvq_forward_cuda_free(kvq_forward_cuda *g) { (void)g; }
kvq_status kvq_forward_cuda_set_kv(kvq_forward_cuda *g, const kvq_kv_desc *d, kvq_err *err)
{
    (void)g, (void)d;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_run(kvq_forward_cuda *g, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    (void)g, (void)io, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_layer_input(kvq_forward_cuda *g, int l, float *out, kvq_err *err)
{
    (void)g, (void)l, (void)out;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_forward_cuda_backward(kvq_forward_cuda *g, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                                     kvq_err *err)
{
    (void)g, (void)io, (void)spec, (void)res;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
void kvq_forward_cuda_backward_times(const kvq_forward_cuda *g, double *forward_s, double *head_s, double *layers_s)
{
    (void)g;
    *forward_s = *head_s = *layers_s = 0;
}
void kvq_forward_cuda_stats(const kvq_forward_cuda *g, kvq_cuda_stats *out)
{
    (void)g;
    *out = (kvq_cuda_stats){0};
}
void kvq_forward_cuda_describe(const kvq_forward_cuda *g, char *buf, size_t n)
{
    (void)g;
    snprintf(buf, n, "no CUDA in this build");
}
kvq_status kvq_cuda_sgemm_rate(int device, int n, int reps, kvq_cuda_math math, double *flops_per_s, kvq_err *err)
{
    (void)device, (void)n, (void)reps, (void)math;
    *flops_per_s = 0;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_cuda_attention(int device, const kvq_cuda_attn_shape *s, kvq_cuda_math math, const float *q, const float *k,
                              const float *v, const float *pk, const float *pv, float *out, float *lse, int reps,
                              double *ms, kvq_err *err)
{
    (void)device, (void)s, (void)math, (void)q, (void)k, (void)v, (void)pk, (void)pv, (void)out, (void)lse, (void)reps;
    if (ms) *ms = 0;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
kvq_status kvq_cuda_attention_sched(int device, const kvq_cuda_attn_shape *s, const float *q, const float *pk,
                                    const float *pv, kvq_kv_sched *sched, float *out, double *ms, kvq_err *err)
{
    (void)device, (void)s, (void)q, (void)pk, (void)pv, (void)sched, (void)out;
    if (ms) ms[0] = ms[1] = 0;
    return kvq_fail(err, KVQ_EUNSUPPORTED, NO_CUDA);
}
#endif
