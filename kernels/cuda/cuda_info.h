/* cuda_info.h — whether this build has CUDA and how many GPUs it sees.
 * Built from cuda_info.cu when the Makefile found nvcc (CUDA=1), else from the
 * CPU stub in cuda_info.c. */
#ifndef KVQ_CUDA_INFO_H
#define KVQ_CUDA_INFO_H

#include <stddef.h>

/* 1 if compiled with CUDA support. */
int kvq_cuda_compiled(void);
/* Number of usable CUDA devices (0 without a driver/GPU or in a CPU build).
 * When 0, `why` (if non-NULL) receives a one-line reason. Never fails. */
int kvq_cuda_device_count(char *why, size_t why_len);

#endif
