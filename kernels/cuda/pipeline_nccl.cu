// pipeline_nccl.cu — the NCCL stage transport and the multi-GPU forward
// driver of pipeline_nccl.h. Compiled in every CUDA build; its body only with
// NCCL (make NCCL=1: -DKVQ_NCCL and nccl.h on the include path), the stubs of
// pipeline_nccl_stub.c otherwise.
#ifdef KVQ_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <thread>
#include <vector>

#include <nccl.h> // C++ parts (cuda_fp16.h) outside the extern "C" block; nccl.h declares its own linkage

extern "C" {
#include "nccl_api.h"
#include "pipeline_nccl.h"
}

#ifndef KVQ_NCCL_LIB
#define KVQ_NCCL_LIB "libnccl.so.2"
#endif

extern "C" kvq_status kvqi_nccl_load(kvqi_nccl_api *api, kvq_err *err)
{
    memset(api, 0, sizeof *api);
    const char *paths[2] = {KVQ_NCCL_LIB, "libnccl.so.2"};
    char tried[1024] = "";
    for (int i = 0; i < 2 && !api->lib; i++) {
        api->lib = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (!api->lib) {
            const char *de = dlerror();
            size_t k = strlen(tried);
            snprintf(tried + k, sizeof tried - k, "%s%s", k ? "; " : "", de ? de : paths[i]);
        }
    }
    if (!api->lib)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "NCCL: cannot load libnccl.so.2 (%s); install it (scripts/setup.sh: nvidia-nccl-cu13)",
                        tried);
    struct {
        void **dst;
        const char *name;
    } syms[] = {{(void **)&api->GetUniqueId, "ncclGetUniqueId"}, {(void **)&api->CommInitRank, "ncclCommInitRank"},
                {(void **)&api->CommInitAll, "ncclCommInitAll"},  {(void **)&api->CommDestroy, "ncclCommDestroy"},
                {(void **)&api->CommAbort, "ncclCommAbort"},      {(void **)&api->Send, "ncclSend"},
                {(void **)&api->Recv, "ncclRecv"},                {(void **)&api->GroupStart, "ncclGroupStart"},
                {(void **)&api->GroupEnd, "ncclGroupEnd"},        {(void **)&api->GetErrorString, "ncclGetErrorString"}};
    for (auto &s : syms) {
        *s.dst = dlsym(api->lib, s.name);
        if (!*s.dst) {
            dlclose(api->lib);
            api->lib = NULL;
            return kvq_fail(err, KVQ_EUNSUPPORTED, "NCCL: libnccl.so.2 lacks %s (NCCL >= 2.7 has ncclSend/ncclRecv)", s.name);
        }
    }
    return KVQ_OK;
}

extern "C" void kvqi_nccl_unload(kvqi_nccl_api *api)
{
    if (api->lib) dlclose(api->lib);
    memset(api, 0, sizeof *api);
}

extern "C" int kvq_pipe_nccl_compiled(char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    return 1;
}

// ---- the NCCL transport ----
namespace {
struct nccl_xp {
    kvq_pipe_comm *c;
    int own;
    cudaStream_t st;
};

#define NC(call, what)                                                                                          \
    do {                                                                                                        \
        ncclResult_t r_ = (call);                                                                               \
        if (r_ != ncclSuccess) return kvq_fail(err, KVQ_EIO, "NCCL: %s failed: %s", what, x->c->api.GetErrorString(r_)); \
    } while (0)

kvq_status xp_begin(void *user, kvq_err *err)
{
    nccl_xp *x = (nccl_xp *)user;
    NC(x->c->api.GroupStart(), "ncclGroupStart");
    return KVQ_OK;
}

kvq_status xp_end(void *user, kvq_err *err)
{
    nccl_xp *x = (nccl_xp *)user;
    NC(x->c->api.GroupEnd(), "ncclGroupEnd");
    return KVQ_OK;
}

kvq_status xp_send(void *user, int from, int to, const float *buf, size_t n, kvq_err *err)
{
    nccl_xp *x = (nccl_xp *)user;
    if (from != x->own) return KVQ_OK; // another process's (or thread's) stage
    char what[64];
    snprintf(what, sizeof what, "ncclSend stage %d -> %d", from, to);
    NC(x->c->api.Send(buf, n, ncclFloat32, to, x->c->comm, x->st), what);
    return KVQ_OK;
}

kvq_status xp_recv(void *user, int to, int from, float *buf, size_t n, kvq_err *err)
{
    nccl_xp *x = (nccl_xp *)user;
    if (to != x->own) return KVQ_OK;
    char what[64];
    snprintf(what, sizeof what, "ncclRecv stage %d <- %d", to, from);
    NC(x->c->api.Recv(buf, n, ncclFloat32, from, x->c->comm, x->st), what);
    return KVQ_OK;
}
#undef NC
} // namespace

extern "C" kvq_status kvq_pipe_nccl_xport(kvq_pipe_comm *c, int own, void *stream, kvq_pipe_xport *out, kvq_err *err)
{
    if (!c || own < 0 || own >= c->size)
        return kvq_fail(err, KVQ_EINVAL, "NCCL transport: stage %d outside the communicator's %d ranks", own, c ? c->size : 0);
    nccl_xp *x = new nccl_xp{c, own, (cudaStream_t)stream};
    *out = kvq_pipe_xport{x, xp_begin, xp_send, xp_recv, xp_end};
    return KVQ_OK;
}

extern "C" void kvqi_nccl_xport_free(kvq_pipe_xport *xp)
{
    delete (nccl_xp *)xp->user;
    xp->user = NULL;
}

// ---- the multi-GPU forward driver ----
struct kvq_pipe_cuda {
    const kvq_model *m;
    int n;
    std::vector<int> gpus, first;
    std::vector<kvq_forward_cuda *> g;
    kvqi_nccl_api api;
    std::vector<ncclComm_t> comms;
    std::vector<kvq_pipe_comm> pc; // one per stage, sharing api
    bool broken;                   // a failed run aborted the communicators
};

extern "C" void kvq_pipe_cuda_free(kvq_pipe_cuda *p)
{
    if (!p) return;
    for (auto *g : p->g) kvq_forward_cuda_free(g);
    for (auto c : p->comms)
        if (c) (p->broken ? p->api.CommAbort : p->api.CommDestroy)(c);
    kvqi_nccl_unload(&p->api);
    delete p;
}

extern "C" kvq_status kvq_pipe_cuda_set_kv(kvq_pipe_cuda *p, const kvq_kv_desc *d, kvq_err *err)
{
    for (int s = 0; s < p->n; s++) {
        kvq_status st = kvq_forward_cuda_set_kv(p->g[s], d, err);
        if (st) return kvq_err_prefix(err, "pipeline stage %d (cuda:%d)", s, p->gpus[s]);
    }
    return KVQ_OK;
}

extern "C" void kvq_pipe_cuda_stats(const kvq_pipe_cuda *p, kvq_cuda_stats *out)
{
    memset(out, 0, sizeof *out);
    for (int s = 0; s < p->n; s++) {
        kvq_cuda_stats t;
        kvq_forward_cuda_stats(p->g[s], &t);
        if (s == 0) out->runs = t.runs, out->seconds = t.seconds;
        out->host_transforms += t.host_transforms;
        out->native_transforms += t.native_transforms;
        out->k_outliers += t.k_outliers;
        out->v_outliers += t.v_outliers;
        out->k_clipped += t.k_clipped;
        out->v_clipped += t.v_clipped;
    }
}

extern "C" void kvq_pipe_cuda_describe(const kvq_pipe_cuda *p, char *buf, size_t n)
{
    size_t k = (size_t)snprintf(buf, n, "pipeline of %d GPUs (", p->n);
    for (int s = 0; s < p->n && k < n; s++)
        k += (size_t)snprintf(buf + k, n - k, "%slayers %d..%d on cuda:%d", s ? ", " : "", p->first[s], p->first[s + 1] - 1, p->gpus[s]);
    if (k + 4 < n) {
        k += (size_t)snprintf(buf + k, n - k, "): ");
        kvq_forward_cuda_describe(p->g[0], buf + k, n - k);
    }
}

extern "C" void kvq_pipe_cuda_stages(const kvq_pipe_cuda *p, int *first, int *n)
{
    *n = p->n;
    for (int s = 0; s <= p->n; s++) first[s] = p->first[s];
}

extern "C" kvq_status kvq_pipe_cuda_init(kvq_pipe_cuda **out, const kvq_model *m, const int *gpus, int n, const int *first, int max_T,
                                         int max_P, unsigned flags, kvq_cuda_math math, char *report, size_t report_len, kvq_err *err)
{
    *out = NULL;
    if (report && report_len) report[0] = 0;
    const kvq_hparams *hp = &m->hp;
    if (n < 1 || n > KVQ_PIPE_MAX_DEV) return kvq_fail(err, KVQ_EINVAL, "pipeline: %d GPUs, expected 1..%d", n, KVQ_PIPE_MAX_DEV);
    kvq_pipe_cuda *p = new kvq_pipe_cuda();
    p->m = m;
    p->n = n;
    p->gpus.assign(gpus, gpus + n);
    p->first.assign((size_t)n + 1, 0);
    auto fail = [&](kvq_status s) {
        kvq_pipe_cuda_free(p);
        return s;
    };
    kvq_status s = kvqi_nccl_load(&p->api, err);
    if (s) return fail(s);
    std::vector<double> fr(n), lb(hp->n_layers);
    std::vector<char> names((size_t)n * 16);
    std::vector<const char *> np(n);
    for (int d = 0; d < n; d++) {
        size_t f = 0, t = 0;
        cudaError_t ce = cudaSetDevice(gpus[d]);
        if (ce == cudaSuccess) ce = cudaMemGetInfo(&f, &t);
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            return fail(kvq_fail(err, KVQ_EIO, "pipeline: GPU %d: %s", gpus[d], cudaGetErrorString(ce)));
        }
        fr[d] = (double)f;
        snprintf(&names[(size_t)d * 16], 16, "cuda:%d", gpus[d]);
        np[d] = &names[(size_t)d * 16];
    }
    kvq_pipe_need need;
    kvq_pipe_need_llama(hp, math == KVQ_CUDA_BF16 ? 2 : 4, max_T, max_P, 1, (flags & KVQ_FWD_SAVE_ACTIVATIONS) != 0,
                        KVQ_PIPE_RESERVE, lb.data(), &need);
    if (first) {
        for (int d = 0; d <= n; d++) p->first[d] = first[d];
        if (p->first[0] != 0 || p->first[n] != hp->n_layers)
            return fail(kvq_fail(err, KVQ_EINVAL, "pipeline: stages must cover layers 0..%d", hp->n_layers - 1));
        for (int d = 0; d < n; d++)
            if (p->first[d + 1] <= p->first[d]) return fail(kvq_fail(err, KVQ_EINVAL, "pipeline: stage %d has no layers", d));
    } else if ((s = kvq_pipe_partition(&need, fr.data(), np.data(), n, p->first.data(), err))) {
        return fail(s);
    }
    size_t k = 0;
    for (int d = 0; d < n; d++) {
        kvq_forward_cuda *g = NULL;
        s = kvq_forward_cuda_init_stage(&g, m, p->first[d], p->first[d + 1], max_T, max_P, flags, math, gpus[d], err);
        if (s) return fail(kvq_err_prefix(err, "pipeline stage %d (cuda:%d, layers %d..%d)", d, gpus[d], p->first[d], p->first[d + 1] - 1));
        p->g.push_back(g);
        if (report && k + 160 < report_len)
            k += (size_t)snprintf(report + k, report_len - k, "%sstage %d: cuda:%d layers %d..%d, %.2f GiB planned of %.2f GiB free",
                                  d ? "\n" : "", d, gpus[d], p->first[d], p->first[d + 1] - 1,
                                  kvq_pipe_device_bytes(&need, p->first.data(), n, d) / 1073741824.0, fr[d] / 1073741824.0);
    }
    p->comms.assign(n, (ncclComm_t)NULL);
    ncclResult_t r = p->api.CommInitAll(p->comms.data(), n, gpus);
    if (r != ncclSuccess) {
        p->comms.assign(n, (ncclComm_t)NULL);
        return fail(kvq_fail(err, KVQ_EIO, "pipeline: ncclCommInitAll over %d GPUs: %s", n, p->api.GetErrorString(r)));
    }
    p->pc.resize(n);
    for (int d = 0; d < n; d++) p->pc[d] = kvq_pipe_comm{p->api, p->comms[d], d, n, 0};
    *out = p;
    return KVQ_OK;
}

extern "C" kvq_status kvq_pipe_cuda_run(kvq_pipe_cuda *p, const kvq_fwd_io *ios, kvq_fwd_result *res, int n_windows, kvq_err *err)
{
    if (p->broken) return kvq_fail(err, KVQ_EINVAL, "pipeline: an earlier run failed and aborted the NCCL communicators");
    const int S = p->n, dim = p->m->hp.dim;
    std::vector<kvq_err> errs(S);
    std::vector<kvq_status> st(S, KVQ_OK);
    std::atomic<bool> failed(false), aborted(false);
    std::atomic<int> first_fail(-1);
    // a failed stage leaves its peers waiting in NCCL (a send or receive that never completes): the first failure
    // aborts every communicator, which makes their operations return
    auto abort_all = [&](int s) {
        int none = -1;
        first_fail.compare_exchange_strong(none, s);
        failed = true;
        if (!aborted.exchange(true))
            for (auto c : p->comms) p->api.CommAbort(c);
    };
    auto stage = [&](int s) {
        kvq_err &e = errs[s];
        kvq_status &rs = st[s];
        if (cudaSetDevice(p->gpus[s]) != cudaSuccess) {
            rs = kvq_fail(&e, KVQ_EIO, "pipeline stage %d: cudaSetDevice(%d) failed", s, p->gpus[s]);
            abort_all(s);
            return;
        }
        kvq_forward_cuda *g = p->g[s];
        kvq_pipe_xport xp;
        if ((rs = kvq_pipe_nccl_xport(&p->pc[s], s, kvq_forward_cuda_stream(g), &xp, &e))) {
            abort_all(s);
            return;
        }
        float *x = kvq_forward_cuda_stage_x(g);
        for (int w = 0; w < n_windows && !failed; w++) {
            const size_t n = (size_t)ios[w].T * dim;
            kvq_fwd_result r;
            if (s > 0 && (rs = xp.group_begin(xp.user, &e)) == KVQ_OK) {
                rs = xp.recv(xp.user, s, s - 1, x, n, &e);
                kvq_status r2 = xp.group_end(xp.user, &e);
                rs = rs ? rs : r2;
            }
            if (!rs) rs = kvq_forward_cuda_stage(g, &ios[w], s > 0 ? x : NULL, &r, &e);
            if (!rs && s == S - 1) res[w] = r;
            if (!rs && s + 1 < S && (rs = xp.group_begin(xp.user, &e)) == KVQ_OK) {
                rs = xp.send(xp.user, s, s + 1, x, n, &e);
                kvq_status r2 = xp.group_end(xp.user, &e);
                rs = rs ? rs : r2;
            }
            if (rs) {
                kvq_err_prefix(&e, "pipeline stage %d (cuda:%d), window %d", s, p->gpus[s], w);
                abort_all(s); // the first failure's message is the run's (later ones may be the abort's)
            }
        }
        kvqi_nccl_xport_free(&xp);
    };
    std::vector<std::thread> th;
    for (int s = 1; s < S; s++) th.emplace_back(stage, s);
    stage(0);
    for (auto &t : th) t.join();
    if (failed) {
        p->broken = true;
        p->comms.assign(S, (ncclComm_t)NULL); // aborted
        const int f = first_fail.load();
        if (f >= 0 && st[f]) {
            if (err) *err = errs[f];
            return st[f];
        }
        return kvq_fail(err, KVQ_EIO, "pipeline: a stage failed");
    }
    return KVQ_OK;
}
// One window's forward and backward over the stages, from this one host thread: stage by stage forward (the
// residual stream handed on), then from the last stage back (dL/dx handed back). Each hand-over is one NCCL group
// with the send on the sending GPU's communicator and stream and the receive on the receiving GPU's (the
// single-thread, several-GPU use of ncclGroupStart / ncclGroupEnd); the receiving stage's kernels follow on its stream.
namespace {
kvq_status hand_over(kvq_pipe_cuda *p, int from, int to, const float *src, float *dst, size_t n, kvq_err *err)
{
    ncclResult_t r = p->api.GroupStart();
    if (r == ncclSuccess) {
        r = p->api.Send(src, n, ncclFloat32, to, p->comms[from], (cudaStream_t)kvq_forward_cuda_stream(p->g[from]));
        ncclResult_t r2 = r == ncclSuccess
                              ? p->api.Recv(dst, n, ncclFloat32, from, p->comms[to], (cudaStream_t)kvq_forward_cuda_stream(p->g[to]))
                              : ncclSuccess;
        ncclResult_t r3 = p->api.GroupEnd();
        r = r != ncclSuccess ? r : r2 != ncclSuccess ? r2 : r3;
    }
    if (r != ncclSuccess)
        return kvq_fail(err, KVQ_EIO, "pipeline: NCCL hand-over stage %d (cuda:%d) -> stage %d (cuda:%d): %s", from, p->gpus[from], to,
                        p->gpus[to], p->api.GetErrorString(r));
    return KVQ_OK;
}
} // namespace

extern "C" kvq_status kvq_pipe_cuda_backward(kvq_pipe_cuda *p, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                                             kvq_err *err)
{
    if (p->broken) return kvq_fail(err, KVQ_EINVAL, "pipeline: an earlier run failed and aborted the NCCL communicators");
    const int S = p->n;
    const size_t n = (size_t)io->T * p->m->hp.dim;
    kvq_status s = KVQ_OK;
    int st = 0;
    for (st = 0; st < S && !s; st++) {
        kvq_forward_cuda *g = p->g[st];
        s = kvq_forward_cuda_backward_stage_forward(g, io, spec, st ? kvq_forward_cuda_stage_x(g) : NULL, res, err);
        if (!s && st + 1 < S) s = hand_over(p, st, st + 1, kvq_forward_cuda_stage_x(g), kvq_forward_cuda_stage_x(p->g[st + 1]), n, err);
    }
    kvq_bwd_result last = *res;
    for (st = S - 1; st >= 0 && !s; st--) {
        kvq_forward_cuda *g = p->g[st];
        kvq_bwd_result r = last;
        s = kvq_forward_cuda_backward_stage_backward(g, io, spec, st + 1 < S ? kvq_forward_cuda_stage_dx(g) : NULL, &r, err);
        if (!s && st == S - 1) last = r;
        if (!s && st > 0) s = hand_over(p, st, st - 1, kvq_forward_cuda_stage_dx(g), kvq_forward_cuda_stage_dx(p->g[st - 1]), n, err);
    }
    if (s) {
        // a hand-over may be left half-done on a stream: abort the communicators (the pipeline is unusable afterwards)
        for (auto c : p->comms) p->api.CommAbort(c);
        p->comms.assign(S, (ncclComm_t)NULL);
        p->broken = true;
        return s;
    }
    *res = last;
    return KVQ_OK;
}
#endif
