/* CPU-only stub of cuda_info.h; the CUDA build uses cuda_info.cu. */
#include "cuda_info.h"

#ifndef KVQ_CUDA
#include <stdio.h>
int kvq_cuda_compiled(void) { return 0; }
int kvq_cuda_device_count(char *why, size_t why_len)
{
    if (why && why_len) snprintf(why, why_len, "kvq was built without CUDA (CUDA=0 or no nvcc)");
    return 0;
}
#endif
