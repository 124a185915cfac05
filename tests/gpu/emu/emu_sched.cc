// emu_sched.cc — the device importance schedule (kernels/cuda/cuda_sched_kern.cuh: the policy and output kernels of
// the CUDA forward's path for a schedule with a declarative policy) run on the host through cuda_emu.h, against
// kvq_attention_sched with the families' host steps: the quick cases of gpu_check --sched (tests/gpu/gpu_check_sched.c:
// hh, mikv, zipcache with GQA, MQA, prefixes, sinks, windows, normalised importance, probes; switch times and counts
// identical or a near-tie, outputs within SCHED_OUT_REL), with the scores computed in the policy kernel and with
// them computed ahead of it (sched_score_k, KVQ_SCHED_PRESCORE=1 on the GPU). Built by `make tests` as build*/tests/test_sched_emu and run
// by `make test` (CI has no GPU: this checks the kernels' logic, indexing and reductions, with 64 threads a block (two warps) so
// that the cross-warp reductions see more than one warp and the strided loops wrap). Then the selection form's kernels
// (ssel_*: forward.h kvq_sched_sel, QAQ's rule) on gpu_check --sched's quick QAQ cases, against qaq's host step: the
// selections every query read identical (or a value width within SCHED_TIE_REL of its threshold), outputs, counts.
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

template <int G> static void run_ssel_g(const kvq_cu_ssel_args &a)
{
    if (a.S) emu_launch({(unsigned)a.T, (unsigned)a.n_kv_heads, (unsigned)a.n_k}, 32, (size_t)G * a.head_dim * sizeof(float),
                        [&a] { kvq_sched::ssel_score_k<G>(a); });
    emu_launch({(unsigned)a.n_kv_heads, 1, 1}, 64, kvq_sched::ssel_policy_smem(a.T, a.P, G, a.head_dim),
               [&a] { kvq_sched::ssel_policy_k<G>(a); });
    emu_launch({(unsigned)a.T, (unsigned)a.n_kv_heads, 1}, 32, kvq_sched::ssel_out_smem(a.T, a.P, G, a.head_dim),
               [&a] { kvq_sched::ssel_out_k<G>(a); });
}

// the selection form (kvq_sched_sel): the forward's buffers on the host, the decisions written back as the CUDA path does
static kvq_status emu_ssel_runner(void *user, const kvq_cuda_attn_shape *s, const float *q, const float *pk, const float *pv,
                                  kvq_kv_sched *sc, float *out, double *ms, kvq_err *err)
{
    const kvq_sched_sel *p = sc->sel;
    if (!p) return kvq_fail(err, KVQ_EINVAL, "emu: no declarative selection step");
    const size_t T = s->T, nkv = s->n_kv_heads, N = p->window < s->T ? p->window : s->T;
    std::vector<float> rm((size_t)s->n_heads * T), rs((size_t)s->n_heads * T), ring(nkv * N * T, NAN);
    std::vector<signed char> hist(2 * nkv * T * T, 99), sel(2 * nkv * T, 99);
    std::vector<unsigned long long> cnt(10 * nkv);
    std::vector<float> S(*(const int *)user ? kvq_cu_ssel_prescore_bytes(sc->n_k, s->T, s->P, s->n_heads) / sizeof(float) : 0, NAN);
    kvq_cu_ssel_args a = {};
    a.T = s->T, a.P = s->P, a.n_heads = s->n_heads, a.n_kv_heads = s->n_kv_heads, a.head_dim = s->head_dim;
    a.n_k = sc->n_k, a.n_v = sc->n_v;
    for (int r = 0; r < sc->n_k; r++) a.k[r] = sc->k[r];
    for (int r = 0; r < sc->n_v; r++) a.v[r] = sc->v[r];
    a.q = q, a.pk = pk, a.pv = pv, a.out = out, a.row_m = rm.data(), a.row_s = rs.data(), a.ring = ring.data();
    a.hist = hist.data(), a.sel = sel.data(), a.counts = cnt.data();
    a.range = p->range, a.unit = p->unit, a.root = p->root, a.nout = p->nout;
    a.S = S.empty() ? nullptr : S.data();
    a.n_sink = p->n_sink, a.window = p->window, a.young = p->young, a.n_lv = p->n_lv, a.lo = p->lo;
    a.attn[0] = p->attn[0], a.attn[1] = p->attn[1];
    switch (s->n_heads / s->n_kv_heads) {
    case 1: run_ssel_g<1>(a); break;
    case 2: run_ssel_g<2>(a); break;
    case 3: run_ssel_g<3>(a); break;
    case 4: run_ssel_g<4>(a); break;
    case 8: run_ssel_g<8>(a); break;
    default: return kvq_fail(err, KVQ_EINVAL, "emu: group of %d query heads not instantiated here", s->n_heads / s->n_kv_heads);
    }
    memcpy(sc->k_sel, sel.data(), nkv * T);
    memcpy(sc->v_sel, sel.data() + nkv * T, nkv * T);
    for (size_t x = 0; x < cnt.size(); x++) p->counts[x] = cnt[x];
    if (p->trace) memcpy(p->trace, hist.data(), hist.size());
    if (ms) ms[0] = ms[1] = 0;
    return KVQ_OK;
}

int main()
{
    // the scores computed in the policy kernel, then ahead of it (sched_score_k)
    const int in_loop = 0, ahead = 1;
    int ok = sched_cases_run(emu_runner, (void *)&in_loop, 1);
    ok &= sched_cases_run(emu_runner, (void *)&ahead, 2);
    // the selection form (QAQ), both ways
    ok &= ssel_cases_run(emu_ssel_runner, (void *)&in_loop, 1);
    ok &= ssel_cases_run(emu_ssel_runner, (void *)&ahead, 2);
    printf("emu sched: %s\n", ok ? "pass" : "FAIL");
    printf("%d%%: Checks: 1, Failures: %d, Errors: 0\n", ok ? 100 : 0, ok ? 0 : 1);
    return ok ? 0 : 1;
}
