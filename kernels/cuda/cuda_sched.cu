// cuda_sched.cu — the attention-importance schedule on the device; see cuda_sched.cuh.
#include "cuda_sched_kern.cuh"

namespace {

using namespace kvq_sched;
constexpr int SCH_THREADS = 1024; // the policy kernel: one block per KV head
constexpr int OUT_THREADS = 128;  // the output kernel: one block per (query row, KV head)

template <int G>
cudaError_t sched_launch(const kvq_cu_sched_args *a, cudaStream_t st, cudaEvent_t mid)
{
    const size_t sm1 = sch_policy_smem(a->T, a->P, G, a->head_dim);
    const size_t sm2 = ((size_t)G * a->head_dim + (size_t)G * (a->P + a->T)) * sizeof(float) + (size_t)a->T;
    cudaError_t e = cudaFuncSetAttribute(sched_policy_k<G>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm1);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(sched_out_k<G>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm2);
    if (e != cudaSuccess) return e;
    if (a->S) sched_score_k<G><<<dim3(a->T, a->n_kv_heads, 3), OUT_THREADS, (size_t)G * a->head_dim * sizeof(float), st>>>(*a);
    sched_policy_k<G><<<a->n_kv_heads, SCH_THREADS, sm1, st>>>(*a);
    if (mid && (e = cudaEventRecord(mid, st)) != cudaSuccess) return e;
    sched_out_k<G><<<dim3(a->T, a->n_kv_heads), OUT_THREADS, sm2, st>>>(*a);
    return cudaGetLastError();
}

template <int G>
cudaError_t ssel_launch(const kvq_cu_ssel_args *a, cudaStream_t st, cudaEvent_t mid)
{
    const size_t sm1 = ssel_policy_smem(a->T, a->P, G, a->head_dim), sm2 = ssel_out_smem(a->T, a->P, G, a->head_dim);
    cudaError_t e = cudaFuncSetAttribute(ssel_policy_k<G>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm1);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(ssel_out_k<G>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm2);
    if (e != cudaSuccess) return e;
    if (a->S) ssel_score_k<G><<<dim3(a->T, a->n_kv_heads, a->n_k), OUT_THREADS, (size_t)G * a->head_dim * sizeof(float), st>>>(*a);
    ssel_policy_k<G><<<a->n_kv_heads, SCH_THREADS, sm1, st>>>(*a);
    if (mid && (e = cudaEventRecord(mid, st)) != cudaSuccess) return e;
    ssel_out_k<G><<<dim3(a->T, a->n_kv_heads), OUT_THREADS, sm2, st>>>(*a);
    return cudaGetLastError();
}

} // namespace

const char *kvq_cu_ssel_unsupported(int T, int P, int n_heads, int n_kv_heads, int head_dim, int n_k, int n_v, int device)
{
    if (T <= 0 || P < 0 || n_kv_heads <= 0 || n_heads % n_kv_heads) return "shape";
    if (n_k < 1 || n_v < 1 || n_k > KVQ_CU_SSEL_MAXREP || n_v > KVQ_CU_SSEL_MAXREP) return "more than 12 representations a side";
    const int G = n_heads / n_kv_heads;
    if (G > SCH_MAXG) return "GQA groups of more than 8 query heads";
    if (head_dim % 4 || head_dim > 256) return "head_dim not a multiple of 4 up to 256";
    int lim = 0;
    if (cudaDeviceGetAttribute(&lim, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return "no device attributes";
    }
    if (ssel_policy_smem(T, P, G, head_dim) + 2048 > (size_t)lim || ssel_out_smem(T, P, G, head_dim) > (size_t)lim)
        return "the window does not fit the policy kernel's shared memory";
    return 0;
}

cudaError_t kvq_cu_ssel_attention(const kvq_cu_ssel_args *a, cudaStream_t st, cudaEvent_t mid)
{
    switch (a->n_heads / a->n_kv_heads) {
    case 1: return ssel_launch<1>(a, st, mid);
    case 2: return ssel_launch<2>(a, st, mid);
    case 3: return ssel_launch<3>(a, st, mid);
    case 4: return ssel_launch<4>(a, st, mid);
    case 5: return ssel_launch<5>(a, st, mid);
    case 6: return ssel_launch<6>(a, st, mid);
    case 7: return ssel_launch<7>(a, st, mid);
    case 8: return ssel_launch<8>(a, st, mid);
    default: return cudaErrorInvalidValue;
    }
}

const char *kvq_cu_sched_unsupported(int T, int P, int n_heads, int n_kv_heads, int head_dim, int device)
{
    if (T <= 0 || P < 0 || n_kv_heads <= 0 || n_heads % n_kv_heads) return "shape";
    const int G = n_heads / n_kv_heads;
    if (G > SCH_MAXG) return "GQA groups of more than 8 query heads";
    if (head_dim % 4 || head_dim > 256) return "head_dim not a multiple of 4 up to 256";
    int lim = 0;
    if (cudaDeviceGetAttribute(&lim, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return "no device attributes";
    }
    const size_t sm2 = ((size_t)G * head_dim + (size_t)G * (P + T)) * sizeof(float) + (size_t)T;
    if (sch_policy_smem(T, P, G, head_dim) + 2048 > (size_t)lim || sm2 > (size_t)lim)
        return "the window does not fit the policy kernel's shared memory";
    return 0;
}

cudaError_t kvq_cu_sched_attention(const kvq_cu_sched_args *a, cudaStream_t st, cudaEvent_t mid)
{
    switch (a->n_heads / a->n_kv_heads) {
    case 1: return sched_launch<1>(a, st, mid);
    case 2: return sched_launch<2>(a, st, mid);
    case 3: return sched_launch<3>(a, st, mid);
    case 4: return sched_launch<4>(a, st, mid);
    case 5: return sched_launch<5>(a, st, mid);
    case 6: return sched_launch<6>(a, st, mid);
    case 7: return sched_launch<7>(a, st, mid);
    case 8: return sched_launch<8>(a, st, mid);
    default: return cudaErrorInvalidValue;
    }
}
