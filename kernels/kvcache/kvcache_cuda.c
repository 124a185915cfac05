/* CPU-only stubs of kvcache_cuda.h; the CUDA build uses kvcache_cuda.cu. */
#include "kvcache_cuda.h"

#ifndef KVQ_CUDA
#define NOCUDA(fn) kvq_fail(err, KVQ_EUNSUPPORTED, "%s: kvq was built without CUDA (CUDA=0 or no nvcc)", fn)
kvq_status kvq_kvcache_cuda_create(kvq_kvcache_cuda **out, const kvq_kvcache_config *cfg, kvq_err *err)
{
    (void)cfg;
    if (out) *out = NULL;
    return NOCUDA("kvq_kvcache_cuda_create");
}
void kvq_kvcache_cuda_free(kvq_kvcache_cuda *c) { (void)c; }
kvq_status kvq_kvcache_cuda_set_prefix(kvq_kvcache_cuda *c, size_t seq, const float *k_post_dev, const float *v_dev, kvq_err *err)
{
    (void)c; (void)seq; (void)k_post_dev; (void)v_dev;
    return NOCUDA("kvq_kvcache_cuda_set_prefix");
}
kvq_status kvq_kvcache_cuda_append(kvq_kvcache_cuda *c, size_t seq, const float *k_dev, const float *v_dev, size_t n, kvq_err *err)
{
    (void)c; (void)seq; (void)k_dev; (void)v_dev; (void)n;
    return NOCUDA("kvq_kvcache_cuda_append");
}
kvq_status kvq_kvcache_cuda_append_step(kvq_kvcache_cuda *c, const float *k_dev, const float *v_dev, kvq_err *err)
{
    (void)c; (void)k_dev; (void)v_dev;
    return NOCUDA("kvq_kvcache_cuda_append_step");
}
kvq_status kvq_kvcache_cuda_attend(kvq_kvcache_cuda *c, const float *q_dev, size_t n_heads, float scale, float *out_dev,
                                   size_t max_splits, int sync, kvq_err *err)
{
    (void)c; (void)q_dev; (void)n_heads; (void)scale; (void)out_dev; (void)max_splits; (void)sync;
    return NOCUDA("kvq_kvcache_cuda_attend");
}
kvq_status kvq_kvcache_cuda_download(const kvq_kvcache_cuda *c, kvq_kvcache *dst, kvq_err *err)
{
    (void)c; (void)dst;
    return NOCUDA("kvq_kvcache_cuda_download");
}
kvq_status kvq_kvcache_cuda_fill_random(kvq_kvcache_cuda *c, size_t len, size_t per_row, uint64_t seed, kvq_err *err)
{
    (void)c; (void)len; (void)per_row; (void)seed;
    return NOCUDA("kvq_kvcache_cuda_fill_random");
}
size_t kvq_kvcache_cuda_bytes_read(const kvq_kvcache_cuda *c) { (void)c; return 0; }
size_t kvq_fp16_attend_scratch(const kvq_fp16_cache *f, size_t n_heads, size_t max_splits)
{
    (void)f; (void)n_heads; (void)max_splits;
    return 0;
}
kvq_status kvq_fp16_attend(const kvq_fp16_cache *f, const float *q_dev, size_t n_heads, float scale, float *out_dev,
                           float *partial_dev, size_t max_splits, int sync, kvq_err *err)
{
    (void)f; (void)q_dev; (void)n_heads; (void)scale; (void)out_dev; (void)partial_dev; (void)max_splits; (void)sync;
    return NOCUDA("kvq_fp16_attend");
}
kvq_status kvq_cublas_create(kvq_cublas **out, kvq_err *err)
{
    if (out) *out = NULL;
    return NOCUDA("kvq_cublas_create");
}
void kvq_cublas_free(kvq_cublas *b) { (void)b; }
size_t kvq_cublas_attend_scratch(const kvq_fp16_cache *f, size_t n_heads) { (void)f; (void)n_heads; return 0; }
kvq_status kvq_cublas_attend(kvq_cublas *b, const kvq_fp16_cache *f, const float *q_dev, size_t n_heads, float scale,
                             float *out_dev, void *scratch_dev, int sync, kvq_err *err)
{
    (void)b; (void)f; (void)q_dev; (void)n_heads; (void)scale; (void)out_dev; (void)scratch_dev; (void)sync;
    return NOCUDA("kvq_cublas_attend");
}
kvq_status kvq_cuda_fill_half(uint16_t *dev, size_t n, uint64_t seed, kvq_err *err)
{
    (void)dev; (void)n; (void)seed;
    return NOCUDA("kvq_cuda_fill_half");
}
kvq_status kvq_cuda_round_fp16(float *dst_dev, const float *src_dev, size_t n, kvq_err *err)
{
    (void)dst_dev; (void)src_dev; (void)n;
    return NOCUDA("kvq_cuda_round_fp16");
}
kvq_status kvq_cuda_alloc(void **out, size_t bytes, kvq_err *err)
{
    (void)bytes;
    if (out) *out = NULL;
    return NOCUDA("kvq_cuda_alloc");
}
void kvq_cuda_free(void *dev) { (void)dev; }
#endif
