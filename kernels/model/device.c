/* device.c — device selection and the CPU/GPU forward engine; see device.h. */
#include "device.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_info.h"
#include "pipeline.h"
#include "pipeline_nccl.h"

kvq_status kvq_device_parse(const char *s, kvq_device *out, int *index, kvq_err *err)
{
    if (index) *index = 0;
    if (!s) s = "auto";
    char why[256] = "";
    if (!strcmp(s, "cpu")) {
        *out = KVQ_DEVICE_CPU;
        return KVQ_OK;
    }
    if (!strcmp(s, "auto")) {
        *out = kvq_cuda_device_count(why, sizeof why) > 0 ? KVQ_DEVICE_CUDA : KVQ_DEVICE_CPU;
        return KVQ_OK;
    }
    if (!strncmp(s, "cuda", 4) && (s[4] == 0 || s[4] == ':')) {
        int idx = 0;
        if (s[4] == ':') {
            char *end;
            long v = strtol(s + 5, &end, 10);
            if (end == s + 5 || *end || v < 0 || v > 1023)
                return kvq_fail(err, KVQ_EINVAL, "--device %s: expected cuda:N with a GPU index N >= 0", s);
            idx = (int)v;
        }
        int n = kvq_cuda_device_count(why, sizeof why);
        if (n <= 0) return kvq_fail(err, KVQ_EUNSUPPORTED, "--device %s: %s (use --device cpu)", s, why);
        if (idx >= n) return kvq_fail(err, KVQ_EINVAL, "--device %s: GPU index %d, but only %d GPU(s) found", s, idx, n);
        *out = KVQ_DEVICE_CUDA;
        if (index) *index = idx;
        return KVQ_OK;
    }
    return kvq_fail(err, KVQ_EINVAL, "--device: expected cpu, cuda, cuda:N or auto, found '%s'", s);
}

const char *kvq_device_name(kvq_device d) { return d == KVQ_DEVICE_CUDA ? "cuda" : "cpu"; }

kvq_status kvq_devices_resolve(const char *devices, const char *device, int *ids, int max_ids, int *n, char *one_dev,
                               size_t one_len, kvq_err *err)
{
    *n = 0;
    if (one_len) one_dev[0] = 0;
    if (device)
        return kvq_fail(err, KVQ_EINVAL, "--device %s and --devices %s: give one of them (--devices for several GPUs)", device,
                        devices);
    /* syntax and duplicates, whatever this machine has */
    int k = 0;
    if (strcmp(devices, "all")) KVQ_TRY(kvq_devices_parse(devices, KVQ_PIPE_MAX_DEV * 16, NULL, "--devices", ids, max_ids, &k, err));
    char why[512] = "";
    if (k > 1 && !kvq_pipe_nccl_compiled(why, sizeof why))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "--devices %s: %d GPUs need the multi-GPU pipeline, and %s; use one GPU (--device cuda:N)",
                        devices, k, why);
    int avail = kvq_cuda_device_count(why, sizeof why);
    KVQ_TRY(kvq_devices_parse(devices, avail, why, "--devices", ids, max_ids, &k, err));
    if (k > 1 && !kvq_pipe_nccl_compiled(why, sizeof why)) /* "all" on a machine with several GPUs */
        return kvq_fail(err, KVQ_EUNSUPPORTED, "--devices %s: %d GPUs need the multi-GPU pipeline, and %s; use one GPU (--device cuda:N)",
                        devices, k, why);
    *n = k;
    if (k == 1 && one_len) snprintf(one_dev, one_len, "cuda:%d", ids[0]);
    return KVQ_OK;
}

const char *kvq_cuda_math_name(kvq_cuda_math m)
{
    return m == KVQ_CUDA_TF32 ? "fast (TF32)" : m == KVQ_CUDA_BF16 ? "fast (BF16)" : "exact (fp32)";
}

kvq_status kvq_cuda_math_parse(const char *s, const char *what, kvq_cuda_math *out, kvq_err *err)
{
    if (!strcmp(s, "exact")) *out = KVQ_CUDA_EXACT;
    else if (!strcmp(s, "tf32")) *out = KVQ_CUDA_TF32;
    else if (!strcmp(s, "bf16")) *out = KVQ_CUDA_BF16;
    else return kvq_fail(err, KVQ_EINVAL, "%s: expected exact, tf32 or bf16, found '%s'", what, s);
    return KVQ_OK;
}

kvq_status kvq_engine_init_at(kvq_engine *e, kvq_device dev, int gpu, kvq_cuda_math math, const kvq_model *m, int max_T,
                              int max_P, unsigned flags, kvq_err *err)
{
    memset(e, 0, sizeof *e);
    e->dev = dev;
    e->model = m;
    const bool bw = flags & KVQ_ENGINE_BACKWARD;
    flags &= ~(unsigned)KVQ_ENGINE_BACKWARD;
    if (dev == KVQ_DEVICE_CUDA)
        return kvq_forward_cuda_init(&e->gpu, m, max_T, max_P, flags | (bw ? KVQ_FWD_SAVE_ACTIVATIONS : 0), math, gpu, err);
    if (bw) {
        KVQ_TRY(kvq_backward_init(&e->bw, m, max_T, max_P, err));
        e->has_bw = true;
        return KVQ_OK;
    }
    return kvq_forward_init(&e->cpu, m, max_T, max_P, flags, err);
}

kvq_status kvq_engine_init_fallback(kvq_engine *e, kvq_device dev, bool fallback, int gpu, kvq_cuda_math math,
                                    const kvq_model *m, int max_T, int max_P, unsigned flags, char *note, size_t note_len,
                                    kvq_err *err)
{
    if (note && note_len) note[0] = 0;
    kvq_status s = kvq_engine_init_at(e, dev, gpu, math, m, max_T, max_P, flags, err);
    if (s != KVQ_EUNSUPPORTED || dev != KVQ_DEVICE_CUDA || !fallback) return s;
    if (note && note_len) snprintf(note, note_len, "no GPU run: %s; running on the CPU", err ? err->msg : "unsupported");
    return kvq_engine_init_at(e, KVQ_DEVICE_CPU, 0, KVQ_CUDA_EXACT, m, max_T, max_P, flags, err);
}

/* The CPU forward workspace of the engine. */
static kvq_forward *cpu_fw(kvq_engine *e) { return e->has_bw ? &e->bw.fw : &e->cpu; }

kvq_status kvq_engine_init(kvq_engine *e, kvq_device dev, kvq_cuda_math math, const kvq_model *m, int max_T, int max_P,
                           unsigned flags, kvq_err *err)
{
    return kvq_engine_init_at(e, dev, 0, math, m, max_T, max_P, flags, err);
}

kvq_status kvq_engine_init_pipe(kvq_engine *e, const int *gpus, int n, kvq_cuda_math math, const kvq_model *m, int max_T,
                                int max_P, unsigned flags, char *report, size_t report_len, kvq_err *err)
{
    if (n == 1) {
        if (report && report_len) report[0] = 0;
        return kvq_engine_init_at(e, KVQ_DEVICE_CUDA, gpus[0], math, m, max_T, max_P, flags, err);
    }
    memset(e, 0, sizeof *e);
    e->dev = KVQ_DEVICE_CUDA;
    const bool bw = flags & KVQ_ENGINE_BACKWARD;
    flags &= ~(unsigned)KVQ_ENGINE_BACKWARD;
    return kvq_pipe_cuda_init(&e->pipe, m, gpus, n, NULL, max_T, max_P, flags | (bw ? KVQ_FWD_SAVE_ACTIVATIONS : 0), math, report,
                              report_len, err);
}

void kvq_engine_cuda_stats(const kvq_engine *e, kvq_cuda_stats *out)
{
    memset(out, 0, sizeof *out);
    if (e->pipe) kvq_pipe_cuda_stats(e->pipe, out);
    else if (e->dev == KVQ_DEVICE_CUDA) kvq_forward_cuda_stats(e->gpu, out);
}

void kvq_engine_free(kvq_engine *e)
{
    kvq_kv_desc_run_free(&e->run);
    if (e->pipe) kvq_pipe_cuda_free(e->pipe);
    else if (e->dev == KVQ_DEVICE_CUDA) kvq_forward_cuda_free(e->gpu);
    else if (e->has_bw) kvq_backward_free(&e->bw);
    else kvq_forward_free(&e->cpu);
    memset(e, 0, sizeof *e);
}

kvq_status kvq_engine_set_kv(kvq_engine *e, const kvq_kv_desc *d, kvq_err *err)
{
    if ((e->pipe || e->dev == KVQ_DEVICE_CUDA) && kvq_kv_desc_chunk(d) > 0)
        /* the CUDA forward's own host hook has no steps: the caller's hooks do */
        return kvq_fail(err, KVQ_EUNSUPPORTED, "forward: a KV scheme that runs windows in steps (%s) is given to the GPU "
                                               "engine as hooks (kvq_kv_desc_hooks), not as its built-in scheme",
                        d->q.fam->name);
    if (e->pipe) {
        KVQ_TRY(kvq_pipe_cuda_set_kv(e->pipe, d, err));
    } else if (e->dev == KVQ_DEVICE_CUDA) {
        KVQ_TRY(kvq_forward_cuda_set_kv(e->gpu, d, err));
    } else if (d) {
        KVQ_TRY(kvq_kv_desc_validate(d, &cpu_fw(e)->m->hp, err));
    }
    kvq_kv_desc_run_free(&e->run);
    e->has_desc = d && !kvq_kv_desc_is_identity(d);
    if (e->has_desc) e->desc = *d;
    memset(&e->run, 0, sizeof e->run);
    e->run.d = &e->desc;
    return KVQ_OK;
}

/* CPU: forward the caller's observe hook with its own user pointer. */
static kvq_status merged_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    const kvq_engine *e = user;
    return e->caller->observe(e->caller->user, ctx, obs, err);
}

static kvq_status merged_transform(void *user, const kvq_layer_ctx *ctx, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    kvq_engine *e = user;
    return kvq_kv_desc_transform(&e->run, ctx, k, v, alt, err);
}

static kvq_status merged_cache(void *user, int P, kvq_prefix *out, kvq_err *err)
{
    kvq_engine *e = user;
    return kvq_kv_desc_cache(&e->run, P, out, err);
}

/* CPU with a descriptor: io2 = io with the descriptor's transform merged into the caller's hooks. */
static void merge_hooks(kvq_engine *e, const kvq_fwd_io *io, kvq_fwd_io *io2)
{
    e->run.d = &e->desc;
    e->caller = io->hooks;
    e->merged = (kvq_hooks){.user = e, .transform = merged_transform, .key_stage = e->desc.key_stage,
                            .chunk = kvq_kv_desc_chunk(&e->desc)};
    if (e->merged.chunk) e->merged.cache = merged_cache;
    if (io->hooks && io->hooks->observe) {
        e->merged.observe = merged_observe;
        e->merged.attn_stats = io->hooks->attn_stats;
    }
    *io2 = *io;
    io2->hooks = &e->merged;
}

static kvq_status engine_run_one(kvq_engine *e, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    if (e->pipe) return kvq_pipe_cuda_run(e->pipe, io, res, 1, err);
    if (e->dev == KVQ_DEVICE_CUDA) return kvq_forward_cuda_run(e->gpu, io, res, err);
    return kvq_forward_run(cpu_fw(e), io, res, err);
}

/* kvq_hooks.chunk: the window as calls of at most `chunk` tokens, each after the cache the hooks built for
 * the tokens before it (kvq_hooks.cache) as its prefix; per-position outputs land at their window rows. */
static kvq_status run_chunked(kvq_engine *e, const kvq_fwd_io *io, const kvq_hooks *h, kvq_fwd_result *res, kvq_err *err)
{
    const int T = io->T, C = h->chunk;
    if (io->prefix && io->prefix->P > 0)
        return kvq_fail(err, KVQ_EINVAL, "forward: a transform that runs the window in steps of %d tokens cannot follow a "
                                         "prefix of %d entries (IntactKV)", C, io->prefix->P);
    if (!h->cache) return kvq_fail(err, KVQ_EINVAL, "forward: hooks with chunk %d have no cache callback", C);
    if (T < 1) return kvq_fail(err, KVQ_EINVAL, "forward: T: expected >= 1, found %d", T);
    if (e->dev != KVQ_DEVICE_CUDA && ((T - 1) / C) * C > cpu_fw(e)->max_P)
        return kvq_fail(err, KVQ_EINVAL, "forward: a window of %d tokens in steps of %d needs room for a prefix of up to %d "
                                         "entries, the workspace has %d", T, C, ((T - 1) / C) * C, cpu_fw(e)->max_P);
    int *tg = malloc((size_t)T * sizeof *tg);
    if (!tg) return kvq_fail(err, KVQ_ENOMEM, "forward: cannot allocate %d targets", T);
    for (int t = 0; t < T; t++) tg[t] = io->targets ? io->targets[t] : t + 1 < T ? io->tokens[t + 1] : -1;
    double sum = 0;
    int n_scored = 0;
    kvq_status st = KVQ_OK;
    for (int t0 = 0; t0 < T && !st; t0 += C) {
        int n = T - t0 < C ? T - t0 : C;
        kvq_prefix px = {0};
        if (t0 > 0 && (st = h->cache(h->user, t0, &px, err))) break;
        if (t0 > 0 && px.P != t0) {
            st = kvq_fail(err, KVQ_EINVAL, "forward: the hooks' cache holds %d entries, expected %d", px.P, t0);
            break;
        }
        kvq_fwd_io c = *io;
        c.tokens = io->tokens + t0;
        c.T = n;
        c.pos0 = io->pos0 + t0;
        c.targets = tg + t0;
        c.prefix = t0 > 0 ? &px : NULL;
        c.logits = io->logits ? io->logits + (size_t)t0 * (size_t)e->model->hp.vocab_size : NULL;
        c.nll = io->nll ? io->nll + t0 : NULL;
        kvq_fwd_head hd;
        if (io->head) {
            size_t dim = (size_t)e->model->hp.dim;
            hd = *io->head;
            if (hd.hidden) hd.hidden += (size_t)t0 * dim;
            if (hd.lse) hd.lse += t0;
            if (hd.argmax) hd.argmax += t0;
            if (hd.expect) hd.expect += (size_t)t0 * dim;
            c.head = &hd;
        }
        kvq_fwd_result r;
        st = engine_run_one(e, &c, &r, err);
        if (!st && r.n_scored > 0) {
            sum += r.loss * r.n_scored;
            n_scored += r.n_scored;
        }
        if (st) kvq_err_prefix(err, "tokens %d..%d of the window", t0, t0 + n - 1);
    }
    free(tg);
    if (st) return st;
    res->n_scored = n_scored;
    res->loss = n_scored && !io->skip_loss ? sum / n_scored : NAN;
    return KVQ_OK;
}

kvq_status kvq_engine_run(kvq_engine *e, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    if ((e->pipe || e->dev == KVQ_DEVICE_CUDA) && ((io->hooks && io->hooks->attend) || io->pos))
        return kvq_fail(err, KVQ_EUNSUPPORTED, "forward: an attend hook (external KV cache) is not run through the engine on "
                        "the GPU; kernels/decode drives the CUDA forward itself");
    if (e->has_desc && io->hooks && io->hooks->transform)
        return kvq_fail(err, KVQ_EINVAL, "forward: a built-in KV scheme is set and the hooks carry a transform too");
    if (e->pipe || e->dev == KVQ_DEVICE_CUDA || !e->has_desc) {
        if (io->hooks && io->hooks->chunk > 0 && io->hooks->chunk < io->T) return run_chunked(e, io, io->hooks, res, err);
        return engine_run_one(e, io, res, err);
    }
    kvq_fwd_io io2;
    merge_hooks(e, io, &io2);
    if (io2.hooks->chunk > 0 && io2.hooks->chunk < io->T) return run_chunked(e, &io2, io2.hooks, res, err);
    return kvq_forward_run(cpu_fw(e), &io2, res, err);
}

kvq_status kvq_engine_run_batch(kvq_engine *e, const kvq_fwd_io *ios, kvq_fwd_result *res, int n, kvq_err *err)
{
    if (e->pipe) {
        for (int i = 0; i < n; i++)
            if (e->has_desc && ios[i].hooks && ios[i].hooks->transform)
                return kvq_fail(err, KVQ_EINVAL, "forward: a built-in KV scheme is set and the hooks carry a transform too");
        return kvq_pipe_cuda_run(e->pipe, ios, res, n, err);
    }
    for (int i = 0; i < n; i++) KVQ_TRY(kvq_engine_run(e, &ios[i], &res[i], err));
    return KVQ_OK;
}

kvq_status kvq_engine_backward(kvq_engine *e, const kvq_fwd_io *io, const kvq_bwd_spec *spec, kvq_bwd_result *res,
                               kvq_err *err)
{
    if (e->has_desc && io->hooks && io->hooks->transform)
        return kvq_fail(err, KVQ_EINVAL, "backward: a built-in KV scheme is set and the hooks carry a transform too");
    if (e->pipe) return kvq_pipe_cuda_backward(e->pipe, io, spec, res, err);
    if (e->dev == KVQ_DEVICE_CUDA) return kvq_forward_cuda_backward(e->gpu, io, spec, res, err);
    if (!e->has_bw) return kvq_fail(err, KVQ_EINVAL, "backward: the engine was initialised without KVQ_ENGINE_BACKWARD");
    if (!e->has_desc) return kvq_backward_run(&e->bw, io, spec, res, err);
    kvq_fwd_io io2;
    merge_hooks(e, io, &io2);
    return kvq_backward_run(&e->bw, &io2, spec, res, err);
}

kvq_status kvq_engine_layer_input(kvq_engine *e, int l, float *out, kvq_err *err)
{
    if (e->pipe) return kvq_fail(err, KVQ_EUNSUPPORTED, "layer input %d: not read across a pipeline's stages", l);
    if (e->dev == KVQ_DEVICE_CUDA) return kvq_forward_cuda_layer_input(e->gpu, l, out, err);
    const kvq_forward *fw = cpu_fw(e);
    if (l < 0 || l > fw->m->hp.n_layers) return kvq_fail(err, KVQ_EINVAL, "layer input %d, expected 0..%d", l, fw->m->hp.n_layers);
    const float *x = kvq_forward_layer_input(fw, l);
    if (!x || fw->T_last <= 0)
        return kvq_fail(err, KVQ_EINVAL, "layer input %d: not kept (KVQ_FWD_SAVE_LAYER_INPUTS) or no run yet", l);
    memcpy(out, x, (size_t)fw->T_last * fw->m->hp.dim * sizeof(float));
    return KVQ_OK;
}

const char *kvq_engine_describe(const kvq_engine *e, char *buf, size_t n)
{
    if (e->pipe) kvq_pipe_cuda_describe(e->pipe, buf, n);
    else if (e->dev == KVQ_DEVICE_CUDA) kvq_forward_cuda_describe(e->gpu, buf, n);
    else snprintf(buf, n, "CPU (%d OpenMP threads, OpenBLAS sgemm, fp32)", e->has_bw ? e->bw.fw.n_threads : e->cpu.n_threads);
    return buf;
}
