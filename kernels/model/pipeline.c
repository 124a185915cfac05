/* pipeline.c — --devices parsing, the layer partitioner, the loopback
 * transport and the CPU stage loop; see pipeline.h. */
#include "pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GIB (1024.0 * 1024.0 * 1024.0)

kvq_status kvq_devices_parse(const char *s, int n_avail, const char *why, const char *opt, int *ids, int max_ids, int *n,
                             kvq_err *err)
{
    *n = 0;
    if (!opt) opt = "--devices";
    if (!s || !*s) return kvq_fail(err, KVQ_EINVAL, "%s: expected all or a list cuda:N,M,..., found an empty value", opt);
    if (n_avail <= 0)
        return kvq_fail(err, KVQ_EUNSUPPORTED, "%s %s: %s (use --device cpu)", opt, s, why && *why ? why : "no GPU");
    if (!strcmp(s, "all")) {
        if (n_avail > max_ids)
            return kvq_fail(err, KVQ_EINVAL, "%s all: %d GPUs, at most %d supported", opt, n_avail, max_ids);
        for (int i = 0; i < n_avail; i++) ids[i] = i;
        *n = n_avail;
        return KVQ_OK;
    }
    const char *p = s;
    int k = 0;
    for (;;) {
        const char *item = p;
        if (!strncmp(p, "cuda", 4)) {
            p += 4;
            if (*p == ':') p++;
            else if (*p == 0 || *p == ',') { /* "cuda" = cuda:0 */
                if (k >= max_ids) return kvq_fail(err, KVQ_EINVAL, "%s %s: more than %d devices", opt, s, max_ids);
                ids[k++] = 0;
                goto next;
            }
        }
        {
            if (*p < '0' || *p > '9')
                return kvq_fail(err, KVQ_EINVAL, "%s: expected all or a list cuda:N,M,... of GPU indices, found '%.*s' in '%s'", opt,
                                (int)strcspn(item, ","), item, s);
            long v = 0;
            while (*p >= '0' && *p <= '9') {
                v = v * 10 + (*p++ - '0');
                if (v > 1000000) break;
            }
            if (*p && *p != ',')
                return kvq_fail(err, KVQ_EINVAL, "%s: expected all or a list cuda:N,M,... of GPU indices, found '%.*s' in '%s'", opt,
                                (int)strcspn(item, ","), item, s);
            if (v >= n_avail)
                return kvq_fail(err, KVQ_EINVAL, "%s %s: GPU index %ld, but only %d GPU(s) found (0..%d)", opt, s, v, n_avail, n_avail - 1);
            if (k >= max_ids) return kvq_fail(err, KVQ_EINVAL, "%s %s: more than %d devices", opt, s, max_ids);
            ids[k++] = (int)v;
        }
    next:
        for (int i = 0; i < k - 1; i++)
            if (ids[i] == ids[k - 1])
                return kvq_fail(err, KVQ_EINVAL, "%s %s: GPU %d listed twice (each GPU holds one pipeline stage)", opt, s, ids[k - 1]);
        if (*p == 0) break;
        p++; /* ',' */
        if (*p == 0) return kvq_fail(err, KVQ_EINVAL, "%s %s: a trailing comma (expected one more GPU index)", opt, s);
    }
    *n = k;
    return KVQ_OK;
}

void kvq_pipe_need_llama(const kvq_hparams *hp, int weight_bytes, int T, int P, int in_flight, bool backward, double reserve,
                         double *layer_bytes, kvq_pipe_need *need)
{
    const double we = weight_bytes, dim = hp->dim, qd = (double)hp->n_heads * hp->head_dim,
                 kvd = (double)hp->n_kv_heads * hp->head_dim, hid = hp->hidden_dim, V = hp->vocab_size, nh = hp->n_heads,
                 Td = T, inf = in_flight > 0 ? in_flight : 1;
    double vec = 2 * dim + (hp->attn_qkv_bias ? qd + 2 * kvd : 0) + (hp->attn_out_bias ? dim : 0) +
                 (hp->qk_norm ? 2.0 * hp->head_dim : 0);
    double per = we * (2 * qd * dim + 2 * kvd * dim + 3 * hid * dim) + 4 * vec + 4 * 2.0 * P * kvd;
    if (backward) per += inf * 4 * Td * (2 * dim + 2 * qd + 4 * kvd + nh + 2 * hid + 2);
    for (int l = 0; l < hp->n_layers; l++) layer_bytes[l] = per;
    double vc = floor((double)(1 << (weight_bytes == 2 ? 26 : 28)) / Td);
    if (vc > V) vc = V;
    if (vc < 256) vc = V < 256 ? V : 256;
    memset(need, 0, sizeof *need);
    need->n_layers = hp->n_layers;
    need->layer_bytes = layer_bytes;
    need->first_bytes = we * V * dim;
    need->last_bytes = 4 * dim + (hp->tied_embeddings ? 0 : we * V * dim) + 4 * Td * vc;
    need->tied_bytes = hp->tied_embeddings ? we * V * dim : 0;
    double work = 4 * Td * (6 * dim + 3 * qd + 7 * kvd + 2 * hid + 4 * nh + 16);
    if (backward) work += 4 * Td * (4 * dim + 4 * qd + 8 * kvd + 3 * hid);
    need->device_bytes = work + inf * 2 * 4 * Td * dim + reserve;
}

double kvq_pipe_device_bytes(const kvq_pipe_need *need, const int *first, int n_dev, int d)
{
    double b = need->device_bytes;
    for (int l = first[d]; l < first[d + 1]; l++) b += need->layer_bytes[l];
    if (first[d] == 0) b += need->first_bytes;
    if (first[d + 1] == need->n_layers) b += need->last_bytes + (n_dev > 1 ? need->tied_bytes : 0);
    return b;
}

/* bytes of layers a .. b-1 on device d of n */
static double range_bytes(const kvq_pipe_need *nd, int n_dev, int a, int b)
{
    double x = nd->device_bytes + (a == 0 ? nd->first_bytes : 0);
    for (int l = a; l < b; l++) x += nd->layer_bytes[l];
    if (b == nd->n_layers) x += nd->last_bytes + (n_dev > 1 ? nd->tied_bytes : 0);
    return x;
}

/* At most K layers per device: ok[d * (L + 1) + l] = devices d .. n-1 can
 * hold layers l .. L-1 (exact, by dynamic programming from the last device).
 * Then device d takes the most layers <= K that fit and leave a feasible rest.
 * Returns 1 and fills first when feasible; else 0 and *stuck = the first
 * device no feasible assignment gets past. */
static int fill(const kvq_pipe_need *nd, const double *fr, int n_dev, int K, int *first, int *stuck, unsigned char *ok)
{
    const int L = nd->n_layers, W = L + 1;
    memset(ok, 0, (size_t)(n_dev + 1) * W);
    ok[n_dev * W + L] = 1;
    for (int d = n_dev - 1; d >= 0; d--)
        for (int l = 0; l < L; l++)
            for (int c = 1; c <= K && l + c <= L; c++)
                if (ok[(d + 1) * W + l + c] && range_bytes(nd, n_dev, l, l + c) <= fr[d]) {
                    ok[d * W + l] = 1;
                    break;
                }
    if (!ok[0]) {
        /* the first device past which nothing is feasible: walk the sets of reachable starts */
        *stuck = 0;
        unsigned char *cur = calloc((size_t)W, 1), *nxt = calloc((size_t)W, 1);
        if (cur && nxt) {
            cur[0] = 1;
            for (int d = 0; d < n_dev; d++) {
                int any = 0;
                memset(nxt, 0, (size_t)W);
                for (int l = 0; l < L; l++)
                    if (cur[l])
                        for (int c = 1; c <= K && l + c <= L; c++)
                            if (range_bytes(nd, n_dev, l, l + c) <= fr[d]) nxt[l + c] = 1, any = 1;
                if (!any || (d == n_dev - 1 && !nxt[L])) {
                    *stuck = d;
                    break;
                }
                unsigned char *t = cur;
                cur = nxt, nxt = t;
            }
        }
        free(cur), free(nxt);
        return 0;
    }
    first[0] = 0;
    for (int d = 0, l = 0; d < n_dev; d++) {
        int c = K < L - l ? K : L - l;
        while (c > 0 && !(ok[(d + 1) * W + l + c] && range_bytes(nd, n_dev, l, l + c) <= fr[d])) c--;
        l += c;
        first[d + 1] = l;
    }
    return 1;
}

kvq_status kvq_pipe_partition(const kvq_pipe_need *need, const double *dev_free, const char *const *names, int n_dev,
                              int *first, kvq_err *err)
{
    const int L = need->n_layers;
    if (n_dev < 1 || n_dev > KVQ_PIPE_MAX_DEV)
        return kvq_fail(err, KVQ_EINVAL, "pipeline: %d devices, expected 1..%d", n_dev, KVQ_PIPE_MAX_DEV);
    if (L < n_dev)
        return kvq_fail(err, KVQ_EINVAL, "pipeline: %d devices for a model of %d layers (each device holds at least one layer)",
                        n_dev, L);
    int stuck = 0;
    unsigned char *ok = malloc((size_t)(n_dev + 1) * (L + 1));
    if (!ok) return kvq_fail(err, KVQ_ENOMEM, "pipeline: out of memory");
    /* smallest K (largest stage) for which an assignment exists; feasibility is monotone in K */
    int lo = (L + n_dev - 1) / n_dev, hi = L - n_dev + 1;
    if (!fill(need, dev_free, n_dev, hi, first, &stuck, ok)) {
        free(ok);
        double total = need->device_bytes * n_dev + need->first_bytes + need->last_bytes + (n_dev > 1 ? need->tied_bytes : 0), avail = 0,
               wmax = 0;
        for (int l = 0; l < L; l++) total += need->layer_bytes[l], wmax = need->layer_bytes[l] > wmax ? need->layer_bytes[l] : wmax;
        char devs[1024];
        size_t k = 0;
        for (int d = 0; d < n_dev && k + 64 < sizeof devs; d++) {
            avail += dev_free[d];
            char nm[32];
            if (!names || !names[d]) snprintf(nm, sizeof nm, "device %d", d);
            k += (size_t)snprintf(devs + k, sizeof devs - k, "%s%s %.2f GiB", d ? ", " : "", names && names[d] ? names[d] : nm,
                                  dev_free[d] / GIB);
        }
        char sn[32];
        if (!names || !names[stuck]) snprintf(sn, sizeof sn, "device %d", stuck);
        return kvq_fail(err, KVQ_ENOMEM,
                        "the model does not fit: %d layers need %.2f GiB in all (%.2f GiB per layer incl. its working memory for "
                        "these windows, %.2f GiB embedding, %.2f GiB LM head and logit block, %.2f GiB workspace per device); "
                        "free: %s (%.2f GiB together); %s cannot hold its share; use more GPUs, --math bf16, shorter windows "
                        "or fewer windows in flight",
                        L, total / GIB, wmax / GIB, need->first_bytes / GIB, (need->last_bytes + (n_dev > 1 ? need->tied_bytes : 0)) / GIB,
                        need->device_bytes / GIB, devs, avail / GIB, names && names[stuck] ? names[stuck] : sn);
    }
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (fill(need, dev_free, n_dev, mid, first, &stuck, ok)) hi = mid;
        else lo = mid + 1;
    }
    fill(need, dev_free, n_dev, lo, first, &stuck, ok); /* feasible at hi, hence at lo == hi */
    free(ok);
    return KVQ_OK;
}

/* ---- loopback transport ---- */
typedef struct kvq_pipe_msg {
    int from, to;
    bool is_send;
    float *data;       /* send: a copy */
    float *dst;        /* recv: where it goes */
    size_t n;
} kvq_pipe_msg;

void kvq_pipe_loopback_init(kvq_pipe_loopback *lb, int n_stages)
{
    memset(lb, 0, sizeof *lb);
    lb->n_stages = n_stages;
}

void kvq_pipe_loopback_free(kvq_pipe_loopback *lb)
{
    for (size_t i = 0; i < lb->n_msgs; i++) free(lb->msgs[i].data);
    free(lb->msgs);
    memset(lb, 0, sizeof *lb);
}

static kvq_status lb_match(kvq_pipe_loopback *lb, kvq_err *err)
{
    /* every receive takes the oldest send of its edge (NCCL's order per peer) */
    kvq_status s = KVQ_OK;
    for (size_t i = 0; i < lb->n_msgs && !s; i++) {
        kvq_pipe_msg *r = &lb->msgs[i];
        if (r->is_send) continue;
        size_t j = 0;
        while (j < lb->n_msgs && !(lb->msgs[j].is_send && lb->msgs[j].from == r->from && lb->msgs[j].to == r->to && lb->msgs[j].data))
            j++;
        if (j == lb->n_msgs) {
            s = kvq_fail(err, KVQ_EINVAL, "pipeline transport: stage %d receives from stage %d, which sent nothing in this group "
                         "(NCCL would wait forever)", r->to, r->from);
            break;
        }
        kvq_pipe_msg *m = &lb->msgs[j];
        if (m->n != r->n) {
            s = kvq_fail(err, KVQ_EINVAL, "pipeline transport: stage %d sent %zu floats to stage %d, which receives %zu", m->from, m->n,
                         m->to, r->n);
            break;
        }
        memcpy(r->dst, m->data, m->n * sizeof(float));
        lb->bytes_moved += m->n * sizeof(float);
        lb->transfers++;
        free(m->data);
        m->data = NULL;
        r->dst = NULL;
    }
    for (size_t i = 0; i < lb->n_msgs && !s; i++)
        if (lb->msgs[i].is_send && lb->msgs[i].data)
            s = kvq_fail(err, KVQ_EINVAL, "pipeline transport: stage %d sent to stage %d, which received nothing in this group "
                         "(NCCL would wait forever)", lb->msgs[i].from, lb->msgs[i].to);
    for (size_t i = 0; i < lb->n_msgs; i++) free(lb->msgs[i].data);
    lb->n_msgs = 0;
    return s;
}

static kvq_status lb_begin(void *user, kvq_err *err)
{
    (void)err;
    ((kvq_pipe_loopback *)user)->depth++;
    return KVQ_OK;
}

static kvq_status lb_end(void *user, kvq_err *err)
{
    kvq_pipe_loopback *lb = user;
    if (lb->depth <= 0) return kvq_fail(err, KVQ_EINVAL, "pipeline transport: group end without a group start");
    if (--lb->depth) return KVQ_OK;
    return lb_match(lb, err);
}

/* takes ownership of m.data */
static kvq_status lb_post(kvq_pipe_loopback *lb, kvq_pipe_msg m, kvq_err *err)
{
    if (m.from < 0 || m.from >= lb->n_stages || m.to < 0 || m.to >= lb->n_stages || m.from == m.to) {
        free(m.data);
        return kvq_fail(err, KVQ_EINVAL, "pipeline transport: stages %d -> %d, expected two different stages of 0..%d", m.from, m.to,
                        lb->n_stages - 1);
    }
    if (lb->n_msgs == lb->cap) {
        size_t nc = lb->cap ? 2 * lb->cap : 8;
        kvq_pipe_msg *nm = realloc(lb->msgs, nc * sizeof *nm);
        if (!nm) {
            free(m.data);
            return kvq_fail(err, KVQ_ENOMEM, "pipeline transport: out of memory");
        }
        lb->msgs = nm;
        lb->cap = nc;
    }
    lb->msgs[lb->n_msgs++] = m;
    return lb->depth ? KVQ_OK : lb_match(lb, err);
}

static kvq_status lb_send(void *user, int from, int to, const float *buf, size_t n, kvq_err *err)
{
    float *c = malloc(n ? n * sizeof(float) : 1);
    if (!c) return kvq_fail(err, KVQ_ENOMEM, "pipeline transport: cannot copy %zu floats", n);
    memcpy(c, buf, n * sizeof(float));
    return lb_post(user, (kvq_pipe_msg){.from = from, .to = to, .is_send = true, .data = c, .n = n}, err);
}

static kvq_status lb_recv(void *user, int to, int from, float *buf, size_t n, kvq_err *err)
{
    return lb_post(user, (kvq_pipe_msg){.from = from, .to = to, .is_send = false, .dst = buf, .n = n}, err);
}

kvq_pipe_xport kvq_pipe_loopback_xport(kvq_pipe_loopback *lb)
{
    return (kvq_pipe_xport){.user = lb, .group_begin = lb_begin, .send = lb_send, .recv = lb_recv, .group_end = lb_end};
}

kvq_status kvq_pipe_xfer(const kvq_pipe_xport *xp, int from, int to, const float *buf, float *dst, size_t n, kvq_err *err)
{
    KVQ_TRY(xp->group_begin(xp->user, err));
    kvq_status s = xp->send(xp->user, from, to, buf, n, err);
    if (!s) s = xp->recv(xp->user, to, from, dst, n, err);
    kvq_err e2 = {0};
    kvq_status s2 = xp->group_end(xp->user, s ? &e2 : err);
    return s ? s : s2;
}

/* ---- CPU stage loop ---- */
static kvq_status check_stages(const int *first, int n_stages, int L, kvq_err *err)
{
    if (n_stages < 1 || first[0] != 0 || first[n_stages] != L)
        return kvq_fail(err, KVQ_EINVAL, "pipeline: %d stages must cover layers 0..%d", n_stages, L - 1);
    for (int s = 0; s < n_stages; s++)
        if (first[s + 1] <= first[s]) return kvq_fail(err, KVQ_EINVAL, "pipeline: stage %d has no layers", s);
    return KVQ_OK;
}

kvq_status kvq_pipe_cpu_forward(kvq_forward *const *fw, float *const *xbuf, const int *first, int n_stages,
                                const kvq_pipe_xport *xp, const kvq_fwd_io *io, kvq_fwd_result *res, kvq_err *err)
{
    const kvq_forward *any = NULL;
    for (int s = 0; s < n_stages && !any; s++) any = fw[s];
    if (!any) return kvq_fail(err, KVQ_EINVAL, "pipeline: no stage of the %d has a workspace in this process", n_stages);
    const kvq_hparams *hp = &any->m->hp;
    KVQ_TRY(check_stages(first, n_stages, hp->n_layers, err));
    const size_t n = (size_t)io->T * hp->dim;
    for (int s = 0; s < n_stages; s++) {
        if (fw[s]) KVQ_TRY(kvq_forward_stage(fw[s], io, first[s], first[s + 1], s ? xbuf[s] : NULL, res, err));
        if (s + 1 < n_stages)
            KVQ_TRY(kvq_pipe_xfer(xp, s, s + 1, fw[s] ? kvq_forward_stage_output(fw[s]) : NULL, fw[s + 1] ? xbuf[s + 1] : NULL, n, err));
    }
    return KVQ_OK;
}

kvq_status kvq_pipe_cpu_backward(kvq_backward *const *bw, float *const *xbuf, float *const *dbuf, const int *first,
                                 int n_stages, const kvq_pipe_xport *xp, const kvq_fwd_io *io, const kvq_bwd_spec *spec,
                                 kvq_bwd_result *res, kvq_err *err)
{
    const kvq_backward *any = NULL;
    for (int s = 0; s < n_stages && !any; s++) any = bw[s];
    if (!any) return kvq_fail(err, KVQ_EINVAL, "pipeline: no stage of the %d has a workspace in this process", n_stages);
    const kvq_hparams *hp = &any->m->hp;
    KVQ_TRY(check_stages(first, n_stages, hp->n_layers, err));
    const size_t n = (size_t)io->T * hp->dim;
    for (int s = 0; s < n_stages; s++) {
        if (bw[s]) KVQ_TRY(kvq_backward_stage_forward(bw[s], io, spec, first[s], first[s + 1], s ? xbuf[s] : NULL, res, err));
        if (s + 1 < n_stages)
            KVQ_TRY(kvq_pipe_xfer(xp, s, s + 1, bw[s] ? kvq_forward_stage_output(&bw[s]->fw) : NULL, bw[s + 1] ? xbuf[s + 1] : NULL,
                                  n, err));
    }
    kvq_bwd_result last = *res;
    for (int s = n_stages - 1; s >= 0; s--) {
        kvq_bwd_result r = last; /* the last stage's loss fields are the run's */
        if (bw[s])
            KVQ_TRY(kvq_backward_stage_backward(bw[s], io, spec, first[s], first[s + 1], s + 1 < n_stages ? dbuf[s] : NULL, &r, err));
        if (s == n_stages - 1) last = r;
        if (s > 0)
            KVQ_TRY(kvq_pipe_xfer(xp, s, s - 1, bw[s] ? kvq_backward_stage_dx(bw[s]) : NULL, bw[s - 1] ? dbuf[s - 1] : NULL, n, err));
    }
    *res = last;
    return KVQ_OK;
}
