/* gpu_check_sched.h — the importance-schedule check of gpu_check --sched (gpu_check_sched.c), shared with the CUDA
 * emulator's run of the same kernels (tests/gpu/emu/emu_sched.cc). */
#ifndef KVQ_GPU_CHECK_SCHED_H
#define KVQ_GPU_CHECK_SCHED_H

#include "forward.h"
#include "forward_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device outputs vs the CPU's, relative to the largest |CPU output| (expf and the row sums' order differ: a few ulp). */
#define SCHED_OUT_REL 1e-5
/* A differing decision is a near-tie when the importances of the tokens involved, as the CPU accumulated them, lie
 * within this relative spread (sums of ~T float probabilities that differ in their last bits). */
#define SCHED_TIE_REL 1e-5

/* Runs the device path on one schedule (kvq_cuda_attention_sched's contract; ms: [2] policy and output kernel times). */
typedef kvq_status (*sched_dev_fn)(void *user, const kvq_cuda_attn_shape *s, const float *q, const float *pk,
                                   const float *pv, kvq_kv_sched *sc, float *out, double *ms, kvq_err *err);

/* The cases (quick 1: small ones for the emulator; 2: every other one of those, the prefix and the probe cases)
 * against kvq_attention_sched; prints a table, returns 1 when all pass. */
int sched_cases_run(sched_dev_fn dev, void *user, int quick);
/* The selection form's cases (kvq_sched_sel: QAQ specs; quick as above) against kvq_attention_sched with qaq's step. */
int ssel_cases_run(sched_dev_fn dev, void *user, int quick);
/* gpu_check --sched: the cases on GPU 0, then one SmolLM2-135M-shaped layer timed (device / CPU / native attention). */
int run_sched_check(void);

#ifdef __cplusplus
}
#endif

#endif
