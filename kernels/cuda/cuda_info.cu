// cuda_info.cu — device discovery for the CUDA build (see cuda_info.h).
#include <cstdio>
#include <cuda_runtime.h>

extern "C" {
#include "cuda_info.h"
}

extern "C" int kvq_cuda_compiled(void) { return 1; }

extern "C" int kvq_cuda_device_count(char *why, size_t why_len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why && why_len) snprintf(why, why_len, "no usable CUDA device: %s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (n == 0 && why && why_len) snprintf(why, why_len, "no CUDA device found");
    return n;
}
