// emu_sched.cc — the device importance schedule (kernels/cuda/cuda_sched_kern.cuh: the policy and output kernels of
// the CUDA forward's path for a schedule with a declarative policy) run on the host through cuda_emu.h, against
// kvq_attention_sched with the families' host steps: the quick cases of gpu_check --sched (tests/gpu/gpu_check_sched.c:
// hh, mikv, zipcache with GQA, MQA, prefixes, sinks, windows, normalised importance, probes; switch times and counts
// identical or a near-tie, outputs within SCHED_OUT_REL), with the scores computed in the policy kernel and with
// them computed ahead of it (sched_score_k, KVQ_SCHED_PRESCORE=1 on the GPU). Built by `make tests` as build*/tests/test_sched_emu and run
// by `make test` (CI has no GPU: this checks the kernels' logic, indexing and reductions, with 64 threads a block (two warps) so
// that the cross-warp reductions see more than one warp and the strided loops wrap).
#include "cuda_emu.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" {
#include "forward.h"
#include "forward_cuda.h"
}
#include "cuda_sched_kern.cuh"
#include "gpu_check_sched.h"

template <int G> static void run_g(const kvq_cu_sched_args &a)
{
    const size_t sm1 = kvq_sched::sch_policy_smem(a.T, a.P, G, a.head_dim);
    const size_t sm2 = ((size_t)G * a.head_dim + (size_t)G * (a.P + a.T)) * sizeof(float) + (size_t)a.T;
    if (a.S) emu_launch({(unsigned)a.T, (unsigned)a.n_kv_heads, 3}, 32, (size_t)G * a.head_dim * sizeof(float),
                        [&a] { kvq_sched::sched_score_k<G>(a); });
    emu_launch({(unsigned)a.n_kv_heads, 1, 1}, 64, sm1, [&a] { kvq_sched::sched_policy_k<G>(a); });
    emu_launch({(unsigned)a.T, (unsigned)a.n_kv_heads, 1}, 32, sm2, [&a] { kvq_sched::sched_out_k<G>(a); });
}

static kvq_status emu_runner(void *user, const kvq_cuda_attn_shape *s, const float *q, const float *pk, const float *pv,
                             kvq_kv_sched *sc, float *out, double *ms, kvq_err *err)
{
    const kvq_sched_imp *im = sc->imp;
    if (!im) return kvq_fail(err, KVQ_EINVAL, "emu: no declarative policy");
    const size_t T = s->T, nkv = s->n_kv_heads;
    std::vector<float> rm((size_t)s->n_heads * T), rs((size_t)s->n_heads * T);
    std::vector<unsigned long long> cnt(4 * nkv);
    std::vector<float> S(*(const int *)user ? kvq_cu_sched_prescore_bytes(s->T, s->P, s->n_heads) / sizeof(float) : 0, NAN);
    kvq_cu_sched_args a = {};
    a.T = s->T, a.P = s->P, a.n_heads = s->n_heads, a.n_kv_heads = s->n_kv_heads, a.head_dim = s->head_dim;
    a.q = q, a.pk = pk, a.pv = pv, a.out = out, a.from = sc->k_from, a.row_m = rm.data(), a.row_s = rs.data();
    a.counts = cnt.data();
    a.S = S.empty() ? nullptr : S.data();
    for (int r = 0; r < 3; r++) a.k[r] = sc->k[r], a.v[r] = sc->v[r];
    a.budget = im->budget, a.probe = im->probe, a.window = im->window, a.n_sink = im->n_sink, a.normalise = im->normalise;
    switch (s->n_heads / s->n_kv_heads) {
    case 1: run_g<1>(a); break;
    case 2: run_g<2>(a); break;
    case 3: run_g<3>(a); break;
    case 4: run_g<4>(a); break;
    case 6: run_g<6>(a); break;
    case 8: run_g<8>(a); break;
    default: return kvq_fail(err, KVQ_EINVAL, "emu: group of %d query heads not instantiated here", s->n_heads / s->n_kv_heads);
    }
    for (size_t x = 0; x < cnt.size(); x++) im->counts[x] = cnt[x];
    if (ms) ms[0] = ms[1] = 0;
    return KVQ_OK;
}

int main()
{
    // the scores computed in the policy kernel, then ahead of it (sched_score_k)
    const int in_loop = 0, ahead = 1;
    int ok = sched_cases_run(emu_runner, (void *)&in_loop, 1);
    ok &= sched_cases_run(emu_runner, (void *)&ahead, 2);
    printf("emu sched: %s\n", ok ? "pass" : "FAIL");
    printf("%d%%: Checks: 1, Failures: %d, Errors: 0\n", ok ? 100 : 0, ok ? 0 : 1);
    return ok ? 0 : 1;
}
