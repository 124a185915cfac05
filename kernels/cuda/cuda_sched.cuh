// cuda_sched.cuh — the attention-importance schedule (kernels/schemes/importance.h, declared to the
// forward as forward.h kvq_sched_imp) run on the device: attention over a per-key schedule of three
// representations (exact, high, low) with the policy's decisions taken on the GPU after every query
// row, instead of kvq_attention_sched's host step callback. Internal to kernels/cuda (cuda_sched.cu).
//
// Two kernels per layer:
//   1. policy (one block per KV head, query rows in order): scores of the group's query heads against
//      prefix keys and window keys 0..i in the representation each key holds at step i, softmax
//      (max, exp, sum), the row's max and sum kept; if query i votes, s_j += sum over the group's heads
//      of (float)(e_qj * (1.0 / sum_q)) in double, head order; then the window exit / capacity /
//      demotion of importance.h (the lowest importance, ties the lowest index; normalised by the voting
//      queries in [j, i] when asked; probes by the same hash as kvq_imp_is_probe).
//   2. output (one block per (query row, KV head)): the same scores in the final schedule's
//      representations (a decision at step i only sets switch times > i, so the final switch times give
//      every step's representations), p = expf(score - max) with the kept max, out = (sum_j p v) *
//      (1 / sum) in key order (prefix first).
// With args.S (KVQ_SCHED_PRESCORE=1 in the CUDA forward) a third kernel first computes the scores of all three
// representations for every (query row, key) in parallel with the same dot product, and kernels 1 and 2 read them:
// the same bits, the policy's sequential loop then reads one float per key and head instead of the key row.
// Numerics against the CPU (kvq_attention_sched): the scores are bit-identical (q * (1/sqrt(hd)) in
// fp32, then products and sums in d order without FMA contraction, as attention.c's -std=c17 build
// computes them); the exponentials are CUDA's expf (the CPU uses its own vector exp: ~1 ulp apart) and
// the row sums are a block tree (the CPU: 16 lanes then in order), so probabilities and outputs differ
// by a few ulp and a decision between two tokens whose importance differs by less than that may go the
// other way (gpu_check --sched reports the first such step and its margin). P.V in key order, as the CPU.
#ifndef KVQ_CUDA_SCHED_CUH
#define KVQ_CUDA_SCHED_CUH

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int T, P, n_heads, n_kv_heads, head_dim;
    const float *q;             // [T][n_heads][head_dim], post-RoPE
    const float *k[3], *v[3];   // exact, high, low: [T][n_kv_heads][head_dim], keys post-RoPE
    const float *pk, *pv;       // [P][n_kv_heads][head_dim] or NULL (P == 0)
    float *out;                 // [T][n_heads][head_dim]
    int *from;                  // out [2][n_kv_heads][T]: first query reading the high / low representation (T: never)
    float *row_m, *row_s;       // scratch [n_heads][T]: softmax max and sum of every row
    unsigned long long *counts; // out [n_kv_heads][4]: elements, sink, exact, high of the resting cache
    float *S;                   // NULL, or scratch [3][n_heads][T][P + T]: every representation's scores computed ahead
                                // of the policy by a parallel kernel (kvq_cu_sched_prescore_bytes), the same bits
    double budget, probe;       // kvq_sched_imp
    int window, n_sink;
    bool normalise;
} kvq_cu_sched_args;

// The selection form's declarative step (forward.h kvq_sched_sel, QAQ's rule) on the device: the same two kernels
// (and the third with S), for up to KVQ_CU_SSEL_MAXREP representations per side chosen per (side, KV head, token):
//   1. policy (one block per KV head, query rows in order): the scores of the group's heads against every key in
//      the representation it holds at step i (sel_k), softmax as above, the row's max and sum kept; the selections
//      query i read written to hist; a[j] = max over the group's heads of (float)(e_qj * (1.0 / sum_q)) into the
//      ring row i mod N; then every non-sink j <= i: `young` with fewer than N rows, else the width rule of
//      kvq_sched_sel in double on the host's units and roots (S_j = the ring's max);
//   2. output (one block per (query row, KV head)): the scores in the representations hist gives for row i (keys)
//      and P.V with hist's values, the kept max and sum.
// A value decision depends on probabilities only, and the probabilities on the keys' selections, which QAQ's rule
// takes from the token counts alone: a decision flipped by the last bits of a probability (a near-tie, reported by
// gpu_check --sched with its distance to the threshold) changes that value's representation only, no other decision.
#define KVQ_CU_SSEL_MAXREP 12
typedef struct {
    int T, P, n_heads, n_kv_heads, head_dim;
    int n_k, n_v;                                     // representations per side (1 + n_lv)
    const float *q;                                   // [T][n_heads][head_dim], post-RoPE
    const float *k[KVQ_CU_SSEL_MAXREP], *v[KVQ_CU_SSEL_MAXREP]; // [T][n_kv_heads][head_dim], keys post-RoPE
    const float *pk, *pv;                             // [P][n_kv_heads][head_dim] or NULL (P == 0)
    float *out;                                       // [T][n_heads][head_dim]
    float *row_m, *row_s;                             // scratch [n_heads][T]
    float *ring;                                      // scratch [n_kv_heads][N][T]
    signed char *hist;                                // out [2][n_kv_heads][T][T]: the representation query i read for key j <= i
    signed char *sel;                                 // out [2][n_kv_heads][T]: the selections the last step left
    unsigned long long *counts;                       // out [2][n_kv_heads][5] (kvq_sched_sel.counts)
    const float *range;                               // [2][T][n_kv_heads]
    const double *unit;                               // [2][n_kv_heads][T]
    const double *root;                               // [T]
    const unsigned short *nout;                       // [2][T][n_kv_heads]
    float *S;                                         // NULL, or scratch [n_k][n_heads][T][P + T] (kvq_cu_ssel_prescore_bytes)
    int n_sink, window, young, n_lv, lo;
    bool attn[2];
} kvq_cu_ssel_args;

static inline size_t kvq_cu_ssel_prescore_bytes(int n_k, int T, int P, int n_heads)
{
    return (size_t)n_k * (size_t)n_heads * (size_t)T * (size_t)(P + T) * sizeof(float);
}

// Bytes of kvq_cu_sched_args.S (3 n_heads T (P + T) floats).
static inline size_t kvq_cu_sched_prescore_bytes(int T, int P, int n_heads)
{
    return 3 * (size_t)n_heads * (size_t)T * (size_t)(P + T) * sizeof(float);
}

#ifndef KVQ_EMU // tests/gpu/emu/emu_sched.cc: the kernels (cuda_sched_kern.cuh) without the CUDA runtime
#include <cuda_runtime.h>

// 0 when the device path supports the shape (GQA group <= 8 query heads, head_dim a multiple of 4 up to
// 256, the policy kernel's shared memory within the device's opt-in limit), else a reason (static string).
const char *kvq_cu_sched_unsupported(int T, int P, int n_heads, int n_kv_heads, int head_dim, int device);
// mid (may be NULL): an event recorded between the policy and the output kernel (their times apart).
cudaError_t kvq_cu_sched_attention(const kvq_cu_sched_args *a, cudaStream_t st, cudaEvent_t mid);
// The selection form: 0 when supported (as above, and 1..KVQ_CU_SSEL_MAXREP representations per side), else a reason.
const char *kvq_cu_ssel_unsupported(int T, int P, int n_heads, int n_kv_heads, int head_dim, int n_k, int n_v, int device);
cudaError_t kvq_cu_ssel_attention(const kvq_cu_ssel_args *a, cudaStream_t st, cudaEvent_t mid);
#endif

#endif
