/* test_pipeline.c — pipeline parallelism by layers (kernels/model/pipeline.h,
 * issue 47) on the CPU: --devices parsing, the layer partitioner against a
 * brute-force search over every assignment, the loopback transport's NCCL
 * semantics, and the staged forward / backward (stage loop over layer ranges,
 * one workspace per stage, activations and gradients handed on through the
 * transport) equal to the unstaged forward / backward bit for bit on the tiny
 * models, with hooks, a prefix and a transform with alternative K/V. */
#include <math.h>
#include <stdint.h>
#include <sys/wait.h>

#include "backward.h"
#include "device.h"
#include "forward.h"
#include "kvq_test.h"
#include "model.h"
#include "cuda_info.h"
#include "pipeline.h"
#include "pipeline_nccl.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* ---- --devices ---- */
static void dev_ok(const char *s, int n_avail, const int *want, int n_want)
{
    int ids[KVQ_PIPE_MAX_DEV], n = -1;
    kvq_err e = {0};
    ck_assert_msg(kvq_devices_parse(s, n_avail, NULL, "--devices", ids, KVQ_PIPE_MAX_DEV, &n, &e) == KVQ_OK, "%s: %s", s, e.msg);
    ck_assert_int_eq(n, n_want);
    for (int i = 0; i < n; i++) ck_assert_int_eq(ids[i], want[i]);
}

static void dev_bad(const char *s, int n_avail, kvq_status code, const char *msg_part)
{
    int ids[4], n = -1;
    kvq_err e = {0};
    ck_assert_int_eq(kvq_devices_parse(s, n_avail, n_avail ? NULL : "no CUDA driver", "--devices", ids, 4, &n, &e), code);
    ck_assert_msg(strstr(e.msg, msg_part), "'%s': message '%s' lacks '%s'", s ? s : "(null)", e.msg, msg_part);
    ck_assert_int_eq(n, 0);
}

START_TEST(test_devices_parse)
{
    dev_ok("all", 4, (int[]){0, 1, 2, 3}, 4);
    dev_ok("all", 1, (int[]){0}, 1);
    dev_ok("cuda:0,1", 2, (int[]){0, 1}, 2);
    dev_ok("cuda:3,1,0", 4, (int[]){3, 1, 0}, 3);
    dev_ok("cuda:1,cuda:0", 2, (int[]){1, 0}, 2);
    dev_ok("2,0", 3, (int[]){2, 0}, 2);
    dev_ok("cuda:0", 8, (int[]){0}, 1);
    dev_ok("cuda", 1, (int[]){0}, 1);
    dev_bad("cuda:0,0", 2, KVQ_EINVAL, "GPU 0 listed twice");
    dev_bad("cuda:1,0,cuda:1", 2, KVQ_EINVAL, "GPU 1 listed twice");
    dev_bad("cuda:2", 2, KVQ_EINVAL, "only 2 GPU(s) found");
    dev_bad("cuda:0,5", 4, KVQ_EINVAL, "GPU index 5");
    dev_bad("cuda:x", 2, KVQ_EINVAL, "found 'cuda:x'");
    dev_bad("cuda:0,", 2, KVQ_EINVAL, "trailing comma");
    dev_bad("cuda:0,,1", 2, KVQ_EINVAL, "found ''");
    dev_bad("cuda:-1", 2, KVQ_EINVAL, "found 'cuda:-1'");
    dev_bad("cuda:1a", 2, KVQ_EINVAL, "found 'cuda:1a'");
    dev_bad("cpu", 2, KVQ_EINVAL, "found 'cpu'");
    dev_bad("", 2, KVQ_EINVAL, "empty");
    dev_bad("cuda:0,1,2,3,0", 8, KVQ_EINVAL, "more than 4 devices");
    dev_bad("all", 0, KVQ_EUNSUPPORTED, "no CUDA driver");
    dev_bad("cuda:0", 0, KVQ_EUNSUPPORTED, "use --device cpu");
}
END_TEST

/* ---- partitioner ---- */
/* every contiguous assignment of L layers to n devices (each >= 1 layer),
 * independently of the greedy search: the smallest largest stage that fits */
static int brute_best(const kvq_pipe_need *nd, const double *fr, int n, int *first, int d, int best)
{
    const int L = nd->n_layers;
    if (d == n) {
        if (first[n] != L) return best;
        int mx = 0;
        for (int i = 0; i < n; i++) {
            if (kvq_pipe_device_bytes(nd, first, n, i) > fr[i]) return best;
            mx = first[i + 1] - first[i] > mx ? first[i + 1] - first[i] : mx;
        }
        return mx < best ? mx : best;
    }
    for (int c = 1; first[d] + c <= L - (n - 1 - d); c++) {
        if (d == n - 1 && first[d] + c != L) continue;
        first[d + 1] = first[d] + c;
        best = brute_best(nd, fr, n, first, d + 1, best);
    }
    return best;
}

static uint64_t rng_state = 88172645463325252ull;
static double urand(void)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

START_TEST(test_partition_small)
{
    double lb[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int i = 0; i < 8; i++) lb[i] *= GIB;
    kvq_pipe_need nd = {.n_layers = 8, .layer_bytes = lb};
    int first[KVQ_PIPE_MAX_DEV + 1];
    kvq_err e = {0};
    /* one device: everything on it */
    ck_assert(kvq_pipe_partition(&nd, (double[]){8.5 * GIB}, NULL, 1, first, &e) == KVQ_OK);
    ck_assert(first[0] == 0 && first[1] == 8);
    /* two equal devices: 4 + 4 */
    ck_assert(kvq_pipe_partition(&nd, (double[]){10 * GIB, 10 * GIB}, NULL, 2, first, &e) == KVQ_OK);
    ck_assert(first[1] == 4 && first[2] == 8);
    /* uneven devices: the small one holds 2, so the large one takes 6 */
    ck_assert(kvq_pipe_partition(&nd, (double[]){6.5 * GIB, 2.5 * GIB}, NULL, 2, first, &e) == KVQ_OK);
    ck_assert(first[1] == 6 && first[2] == 8);
    /* small one first */
    ck_assert(kvq_pipe_partition(&nd, (double[]){2.5 * GIB, 6.5 * GIB}, NULL, 2, first, &e) == KVQ_OK);
    ck_assert(first[1] == 2 && first[2] == 8);
    /* the LM head (last device) and embedding (first): 3 equal devices, head worth 2 layers */
    nd.first_bytes = 0.5 * GIB;
    nd.last_bytes = 2 * GIB;
    ck_assert(kvq_pipe_partition(&nd, (double[]){4 * GIB, 4 * GIB, 4 * GIB}, NULL, 3, first, &e) == KVQ_OK);
    ck_assert_msg(first[1] == 3 && first[2] == 6 && first[3] == 8, "%d %d %d", first[1], first[2], first[3]);
    /* tied embeddings: the head's copy counts on the last device only when it is not the first */
    kvq_pipe_need tied = {.n_layers = 8, .layer_bytes = lb, .first_bytes = 1 * GIB, .tied_bytes = 1 * GIB};
    ck_assert(kvq_pipe_partition(&tied, (double[]){9 * GIB}, NULL, 1, first, &e) == KVQ_OK);
    ck_assert_msg(kvq_pipe_partition(&tied, (double[]){6 * GIB, 4.5 * GIB}, NULL, 2, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(first[1], 5); /* 4 + 4 would need 4 + 1 GiB on the second */
    tied.tied_bytes = 0;
    ck_assert(kvq_pipe_partition(&tied, (double[]){6 * GIB, 4.5 * GIB}, NULL, 2, first, &e) == KVQ_OK);
    ck_assert_int_eq(first[1], 4);
    /* refusals */
    ck_assert_int_eq(kvq_pipe_partition(&nd, (double[]){8 * GIB}, (const char *const[]){"cuda:0"}, 1, first, &e), KVQ_ENOMEM);
    ck_assert_msg(strstr(e.msg, "does not fit") && strstr(e.msg, "8 layers") && strstr(e.msg, "cuda:0 8.00 GiB"), "%s", e.msg);
    double lb2[2] = {GIB, GIB};
    kvq_pipe_need two = {.n_layers = 2, .layer_bytes = lb2};
    ck_assert_int_eq(kvq_pipe_partition(&two, (double[]){9 * GIB, 9 * GIB, 9 * GIB}, NULL, 3, first, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "3 devices for a model of 2 layers"), "%s", e.msg);
    ck_assert_int_eq(kvq_pipe_partition(&two, (double[]){9 * GIB}, NULL, 0, first, &e), KVQ_EINVAL);
}
END_TEST

/* random needs and devices: the partition is feasible exactly when some
 * assignment is, and its largest stage is the smallest possible */
START_TEST(test_partition_brute)
{
    int n_fit = 0, n_refused = 0;
    for (int c = 0; c < 400; c++) {
        const int L = 2 + (int)(urand() * 9), n = 1 + (int)(urand() * (L < 4 ? L : 4));
        double lb[12], fr[4];
        for (int l = 0; l < L; l++) lb[l] = (0.5 + urand()) * GIB;
        kvq_pipe_need nd = {.n_layers = L, .layer_bytes = lb, .first_bytes = urand() * GIB, .last_bytes = urand() * 2 * GIB,
                            .tied_bytes = c % 2 ? urand() * GIB : 0, .device_bytes = urand() * 0.5 * GIB};
        for (int d = 0; d < n; d++) fr[d] = (1 + urand() * (1.5 * L / n + 2)) * GIB;
        int bf[5] = {0}, first[5];
        int best = brute_best(&nd, fr, n, bf, 0, 1 << 30);
        kvq_err e = {0};
        kvq_status s = kvq_pipe_partition(&nd, fr, NULL, n, first, &e);
        if (best == 1 << 30) {
            ck_assert_msg(s == KVQ_ENOMEM && strstr(e.msg, "does not fit"), "case %d: expected a refusal, got %d", c, s);
            n_refused++;
            continue;
        }
        ck_assert_msg(s == KVQ_OK, "case %d: %s", c, e.msg);
        int mx = 0;
        ck_assert(first[0] == 0 && first[n] == L);
        for (int d = 0; d < n; d++) {
            ck_assert(first[d + 1] > first[d]);
            ck_assert(kvq_pipe_device_bytes(&nd, first, n, d) <= fr[d]);
            mx = first[d + 1] - first[d] > mx ? first[d + 1] - first[d] : mx;
        }
        ck_assert_msg(mx == best, "case %d: largest stage %d, best %d", c, mx, best);
        n_fit++;
    }
    ck_assert(n_fit > 100 && n_refused > 20); /* both outcomes exercised */
}
END_TEST

/* The memory model against published parameter counts: Llama-2-7B has
 * 6,738,415,616 parameters (Touvron et al. 2023, untied, norms included);
 * a 70B shape (Llama-2-70B: dim 8192, FFN 28672, 64 heads, 8 KV heads, 80
 * layers, 68,976,648,192 parameters) in bf16 does not fit one 80 GB H100,
 * fits two for the forward and needs four with the Fisher information's
 * activation store at 2048 tokens. */
START_TEST(test_need_llama)
{
    kvq_hparams h7 = {.n_layers = 32, .dim = 4096, .hidden_dim = 11008, .n_heads = 32, .n_kv_heads = 32, .head_dim = 128,
                      .vocab_size = 32000};
    double lb[80];
    kvq_pipe_need nd;
    kvq_pipe_need_llama(&h7, 4, 2048, 0, 1, false, 0, lb, &nd);
    double w = nd.first_bytes + nd.last_bytes - 4.0 * 2048 * 32000; /* the logit block: 2048 x min(vocab, 2^28 / 2048) */
    for (int l = 0; l < 32; l++) w += lb[l];
    ck_assert_msg(w == 4.0 * 6738415616.0, "%.0f", w / 4);
    kvq_hparams h70 = {.n_layers = 80, .dim = 8192, .hidden_dim = 28672, .n_heads = 64, .n_kv_heads = 8, .head_dim = 128,
                       .vocab_size = 32000};
    kvq_pipe_need_llama(&h70, 2, 2048, 0, 1, false, KVQ_PIPE_RESERVE, lb, &nd);
    w = nd.first_bytes + nd.last_bytes - 4.0 * 2048 * 32000;
    for (int l = 0; l < 80; l++) w += lb[l];
    ck_assert_msg(w == 2.0 * 68976648192.0 + 2.0 * 1318912, "%.0f", w / 2); /* the 161 norms' 1318912 weights stay fp32 */
    const double h100 = 79.1 * GIB;
    const char *const names[4] = {"cuda:0", "cuda:1", "cuda:2", "cuda:3"};
    int first[5];
    kvq_err e = {0};
    ck_assert_int_eq(kvq_pipe_partition(&nd, (double[]){h100}, names, 1, first, &e), KVQ_ENOMEM);
    ck_assert_msg(strstr(e.msg, "80 layers need 131.41 GiB") && strstr(e.msg, "cuda:0 79.10 GiB"), "%s", e.msg);
    ck_assert_msg(kvq_pipe_partition(&nd, (double[]){h100, h100}, names, 2, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(first[1] == 40 && first[2] == 80);
    kvq_pipe_need_llama(&h70, 2, 2048, 0, 1, true, KVQ_PIPE_RESERVE, lb, &nd);
    ck_assert_int_eq(kvq_pipe_partition(&nd, (double[]){h100, h100}, names, 2, first, &e), KVQ_ENOMEM);
    ck_assert_msg(strstr(e.msg, "cuda:1 79.10 GiB (158.20 GiB together)"), "%s", e.msg);
    ck_assert_msg(kvq_pipe_partition(&nd, (double[]){h100, h100, h100, h100}, names, 4, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(first[1] == 20 && first[2] == 40 && first[3] == 60 && first[4] == 80);
    /* uneven: an H200 (139.8 GiB) and an H100: 2.31 GiB per layer with the store; the H100 holds 32 (33 would need
       79.6 GiB with its workspace and the LM head) */
    ck_assert_msg(kvq_pipe_partition(&nd, (double[]){139.8 * GIB, h100}, names, 2, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(first[1], 48);
    ck_assert(kvq_pipe_device_bytes(&nd, first, 2, 1) <= h100 && kvq_pipe_device_bytes(&nd, (int[]){0, 47, 80}, 2, 1) > h100);
    kvq_pipe_need_llama(&h70, 2, 2048, 0, 1, false, KVQ_PIPE_RESERVE, lb, &nd);
    ck_assert_msg(kvq_pipe_partition(&nd, (double[]){139.8 * GIB, h100}, names, 2, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(first[1], 40); /* balance first: both hold 40 */
    ck_assert_msg(kvq_pipe_partition(&nd, (double[]){139.8 * GIB, 30 * GIB}, names, 2, first, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(first[1] > 60 && kvq_pipe_device_bytes(&nd, first, 2, 1) <= 30 * GIB, "%d", first[1]);
}
END_TEST

/* ---- loopback transport ---- */
START_TEST(test_loopback)
{
    kvq_pipe_loopback lb;
    kvq_pipe_loopback_init(&lb, 3);
    kvq_pipe_xport xp = kvq_pipe_loopback_xport(&lb);
    kvq_err e = {0};
    float a[4] = {1, 2, 3, 4}, b[4] = {0}, c[4] = {0};
    /* in a group: the receive may be posted first; the buffer is filled when the group ends */
    ck_assert(xp.group_begin(xp.user, &e) == KVQ_OK);
    ck_assert(xp.recv(xp.user, 1, 0, b, 4, &e) == KVQ_OK);
    ck_assert(xp.send(xp.user, 0, 1, a, 4, &e) == KVQ_OK);
    ck_assert(xp.send(xp.user, 1, 2, a + 1, 3, &e) == KVQ_OK);
    ck_assert(xp.recv(xp.user, 2, 1, c, 3, &e) == KVQ_OK);
    a[0] = 9; /* the send's data was taken at the send */
    ck_assert(b[0] == 0);
    ck_assert_msg(xp.group_end(xp.user, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(b[0] == 1 && b[3] == 4 && c[0] == 2 && c[2] == 4 && lb.transfers == 2);
    /* a receive outside a group with nothing sent: NCCL would hang; the loopback refuses */
    ck_assert_int_eq(xp.recv(xp.user, 1, 0, b, 4, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "wait forever"), "%s", e.msg);
    /* unmatched send, size mismatch, bad stages */
    ck_assert_int_eq(kvq_pipe_xfer(&xp, 0, 1, a, b, 4, &e), KVQ_OK);
    ck_assert(xp.group_begin(xp.user, &e) == KVQ_OK && xp.send(xp.user, 0, 2, a, 4, &e) == KVQ_OK);
    ck_assert_int_eq(xp.group_end(xp.user, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "received nothing"), "%s", e.msg);
    ck_assert(xp.group_begin(xp.user, &e) == KVQ_OK && xp.send(xp.user, 0, 2, a, 4, &e) == KVQ_OK &&
              xp.recv(xp.user, 2, 0, b, 3, &e) == KVQ_OK);
    ck_assert_int_eq(xp.group_end(xp.user, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "sent 4 floats to stage 2, which receives 3"), "%s", e.msg);
    ck_assert_int_eq(xp.send(xp.user, 0, 3, a, 4, &e), KVQ_EINVAL);
    ck_assert_int_eq(xp.group_end(xp.user, &e), KVQ_EINVAL);
    kvq_pipe_loopback_free(&lb);
}
END_TEST

/* ---- staged forward / backward == unstaged, bit for bit ---- */
typedef struct {
    double sum[64];  /* per layer: sum of k_pre, v, k_att (observe) */
    int calls[64];
    float step;      /* transform: round to multiples of step, alternative K/V with boundaries */
} hook_rec;

static kvq_status rec_observe(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    hook_rec *r = user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)o->k_pre[i] + 0.5 * o->v[i] + 0.25 * o->k_att[i];
    r->sum[c->layer] = s;
    r->calls[c->layer]++;
    return KVQ_OK;
}

static kvq_status rec_transform(void *user, const kvq_layer_ctx *c, float *k, float *v, kvq_kv_alt *alt, kvq_err *err)
{
    (void)err;
    hook_rec *r = user;
    size_t n = (size_t)c->T * c->n_kv_heads * c->head_dim;
    for (size_t i = 0; i < n; i++) {
        alt->k[i] = r->step * roundf(k[i] / r->step);
        alt->v[i] = r->step * roundf(v[i] / r->step);
        k[i] += 1e-3f * (float)((int)(i % 7) - 3);
    }
    for (int i = 0; i < c->T; i++) alt->k_bound[i] = (i / 4) * 4, alt->v_bound[i] = i > 2 ? i - 2 : 0;
    alt->use_k = alt->use_v = true;
    return KVQ_OK;
}

/* a transport that loses what it carries (the stages must really depend on it) */
static kvq_status lossy_send(void *user, int from, int to, const float *buf, size_t n, kvq_err *err)
{
    (void)buf;
    float *z = calloc(n ? n : 1, sizeof(float));
    kvq_pipe_xport lb = kvq_pipe_loopback_xport(user);
    kvq_status s = lb.send(user, from, to, z, n, err);
    free(z);
    return s;
}

static kvq_status up_cb(void *user, const kvq_layer_ctx *c, const float *x_out, float *dx_out, kvq_err *err)
{
    (void)user, (void)err;
    size_t n = (size_t)c->T * 8; /* dL/dx_out += 0.01 (l + 1) x_out on the first T * 8 entries (dim >= 8) */
    for (size_t i = 0; i < n; i++) dx_out[i] += 0.01f * x_out[i] * (float)(c->layer + 1);
    return KVQ_OK;
}

static void staged_case(const char *what, kvq_model *m, const int *tok, int T, int P)
{
    const kvq_hparams *hp = &m->hp;
    const int L = hp->n_layers, dim = hp->dim, kvd = kvq_kv_dim(hp), V = hp->vocab_size;
    kvq_err e = {0};
    /* a prefix: P entries of post-RoPE K/V per layer (arbitrary values; never transformed) */
    float *pk = NULL, *pv = NULL;
    if (P) {
        pk = malloc((size_t)L * P * kvd * 4), pv = malloc((size_t)L * P * kvd * 4);
        for (size_t i = 0; i < (size_t)L * P * kvd; i++) pk[i] = 0.3f * sinf(0.7f * (float)i), pv[i] = 0.2f * cosf(0.3f * (float)i);
    }
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    /* stage splits: 1 stage, every 2-stage split, 3 stages when L >= 3, one layer per stage */
    int splits[16][9], ns[16], nsp = 0;
    ns[nsp] = 1, splits[nsp][0] = 0, splits[nsp][1] = L, nsp++;
    for (int a = 1; a < L && nsp < 12; a++) ns[nsp] = 2, splits[nsp][0] = 0, splits[nsp][1] = a, splits[nsp][2] = L, nsp++;
    if (L >= 3) ns[nsp] = 3, splits[nsp][0] = 0, splits[nsp][1] = 1, splits[nsp][2] = L - 1, splits[nsp][3] = L, nsp++;
    if (L <= 8) {
        ns[nsp] = L;
        for (int l = 0; l <= L; l++) splits[nsp][l] = l;
        nsp++;
    }
    const size_t n = (size_t)L * T * kvd;
    for (int hooks = 0; hooks < 3; hooks++) {
        hook_rec r0 = {.step = 0.05f}, r1 = {.step = 0.05f};
        kvq_hooks h0 = {.user = &r0, .observe = rec_observe, .transform = hooks == 2 ? rec_transform : NULL,
                        .key_stage = KVQ_KEYS_PRE_ROPE},
                  h1 = h0;
        h1.user = &r1;
        kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = P, .prefix = P ? &px : NULL};
        /* unstaged reference */
        kvq_forward fw;
        ck_assert_msg(kvq_forward_init(&fw, m, T, P, 0, &e) == KVQ_OK, "%s", e.msg);
        float *lg0 = malloc((size_t)T * V * 4), *lg1 = malloc((size_t)T * V * 4);
        double nll0[64], nll1[64], bnll0[64], bnll1[64];
        kvq_fwd_result f0, f1;
        io.hooks = hooks ? &h0 : NULL;
        io.logits = lg0;
        io.nll = nll0;
        ck_assert_msg(kvq_forward_run(&fw, &io, &f0, &e) == KVQ_OK, "%s", e.msg);
        kvq_backward bw0;
        ck_assert_msg(kvq_backward_init(&bw0, m, T, P, &e) == KVQ_OK, "%s", e.msg);
        kvq_grad_store g0 = {.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4)}, g1 = g0;
        g1 = (kvq_grad_store){.dk_pre = malloc(n * 4), .dk_post = malloc(n * 4), .dv = malloc(n * 4)};
        float *de0 = malloc((size_t)T * dim * 4), *de1 = malloc((size_t)T * dim * 4);
        kvq_bwd_spec sp0 = {.user = &g0, .xent = true, .grads = kvq_grad_store_cb, .d_embd = de0}, sp1 = sp0;
        sp1.user = &g1, sp1.d_embd = de1;
        if (hooks == 1 && dim >= 8) sp0.upstream = sp1.upstream = up_cb; /* an upstream term as IntactKV's training adds */
        kvq_bwd_result b0, b1;
        kvq_fwd_io bio = io;
        bio.logits = NULL;
        bio.nll = bnll0;
        ck_assert_msg(kvq_backward_run(&bw0, &bio, &sp0, &b0, &e) == KVQ_OK, "%s", e.msg);
        for (int sc = 0; sc < nsp; sc++) {
            const int S = ns[sc], *first = splits[sc];
            kvq_forward *fws[8];
            kvq_backward *bws[8];
            float *xb[8], *db[8];
            for (int s = 0; s < S; s++) {
                fws[s] = malloc(sizeof(kvq_forward));
                bws[s] = malloc(sizeof(kvq_backward));
                ck_assert(kvq_forward_init(fws[s], m, T, P, 0, &e) == KVQ_OK);
                ck_assert(kvq_backward_init(bws[s], m, T, P, &e) == KVQ_OK);
                xb[s] = malloc((size_t)T * dim * 4);
                db[s] = malloc((size_t)T * dim * 4);
            }
            kvq_pipe_loopback lb;
            kvq_pipe_loopback_init(&lb, S);
            kvq_pipe_xport xp = kvq_pipe_loopback_xport(&lb);
            memset(&r1, 0, sizeof r1);
            r1.step = 0.05f;
            io.hooks = hooks ? &h1 : NULL;
            io.logits = lg1;
            io.nll = nll1;
            ck_assert_msg(kvq_pipe_cpu_forward(fws, xb, first, S, &xp, &io, &f1, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_int_eq(lb.transfers, S - 1);
            ck_assert_msg(f0.loss == f1.loss && f0.n_scored == f1.n_scored, "%s stages %d: loss %.9g vs %.9g", what, S, f0.loss, f1.loss);
            ck_assert_msg(!memcmp(lg0, lg1, (size_t)T * V * 4) && !memcmp(nll0, nll1, (size_t)T * 8), "%s: logits differ", what);
            if (hooks)
                for (int l = 0; l < L; l++) ck_assert(r1.calls[l] == 1 && r1.sum[l] == r0.sum[l]);
            /* backward */
            bio.hooks = io.hooks;
            bio.nll = bnll1;
            ck_assert_msg(kvq_pipe_cpu_backward(bws, xb, db, first, S, &xp, &bio, &sp1, &b1, &e) == KVQ_OK, "%s", e.msg);
            ck_assert_int_eq(lb.transfers, 3 * (S - 1));
            ck_assert_msg(b0.loss == b1.loss && b0.xent_loss == b1.xent_loss && b0.n_scored == b1.n_scored, "%s: %.9g vs %.9g", what,
                          b0.loss, b1.loss);
            ck_assert(!memcmp(g0.dk_pre, g1.dk_pre, n * 4) && !memcmp(g0.dk_post, g1.dk_post, n * 4) && !memcmp(g0.dv, g1.dv, n * 4));
            ck_assert(!memcmp(de0, de1, (size_t)T * dim * 4) && !memcmp(bnll0, bnll1, (size_t)T * 8));
            /* the stages really use what the transport carries: a lossy one changes the result */
            if (S > 1) {
                kvq_pipe_xport bad = xp;
                bad.send = lossy_send;
                ck_assert(kvq_pipe_cpu_forward(fws, xb, first, S, &bad, &io, &f1, &e) == KVQ_OK);
                ck_assert(memcmp(lg0, lg1, (size_t)T * V * 4) != 0);
                ck_assert(kvq_pipe_cpu_backward(bws, xb, db, first, S, &bad, &bio, &sp1, &b1, &e) == KVQ_OK);
                ck_assert(memcmp(g0.dv, g1.dv, n * 4) != 0);
            }
            kvq_pipe_loopback_free(&lb);
            for (int s = 0; s < S; s++) {
                kvq_forward_free(fws[s]);
                kvq_backward_free(bws[s]);
                free(fws[s]), free(bws[s]), free(xb[s]), free(db[s]);
            }
        }
        double gn = 0;
        for (size_t i = 0; i < n; i++) gn += (double)g0.dv[i] * g0.dv[i];
        ck_assert(gn > 0 && isfinite(f0.loss)); /* not vacuous */
        fprintf(stderr, "INFO %s hooks %d: %d stage splits equal the unstaged run bit for bit (loss %.6f)\n", what, hooks, nsp, f0.loss);
        kvq_forward_free(&fw);
        kvq_backward_free(&bw0);
        free(lg0), free(lg1), free(g0.dk_pre), free(g0.dk_post), free(g0.dv), free(g1.dk_pre), free(g1.dk_post), free(g1.dv);
        free(de0), free(de1);
    }
    free(pk), free(pv);
}

static void hf_case(const char *name)
{
    char dir[200];
    snprintf(dir, sizeof dir, "tests/fixtures/hf-%.64s", name);
    kvq_model m;
    kvq_err e = {0};
    kvq_load_opts o = {.weights = KVQ_WEIGHTS_F32};
    ck_assert_msg(kvq_model_load_opts(dir, &o, &m, &e) == KVQ_OK, "%s", e.msg);
    int tok[24];
    for (int i = 0; i < 24; i++) tok[i] = (i * 37 + 11) % m.hp.vocab_size;
    staged_case(name, &m, tok, 24, 3);
    kvq_model_free(&m);
}

START_TEST(test_staged_qwen2) { hf_case("qwen2"); }
END_TEST
START_TEST(test_staged_qwen3) { hf_case("qwen3"); }
END_TEST
START_TEST(test_staged_mistral) { hf_case("mistral"); }
END_TEST

START_TEST(test_staged_stories)
{
    char buf[4096];
    const char *p = kvq_test_shared(buf, sizeof buf, "models/llama2c/stories260K.bin");
    KVQ_SKIP_IF(!p, "../shared/models/llama2c absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(p, &m, &e) == KVQ_OK, "%s", e.msg);
    int tok[32];
    for (int i = 0; i < 32; i++) tok[i] = (i * 53 + 7) % m.hp.vocab_size;
    staged_case("stories260K", &m, tok, 32, 0);
    kvq_model_free(&m);
}
END_TEST

/* stage arguments refused before any work */
START_TEST(test_stage_args)
{
    kvq_model m;
    kvq_err e = {0};
    kvq_load_opts o = {.weights = KVQ_WEIGHTS_F32};
    ck_assert(kvq_model_load_opts("tests/fixtures/hf-qwen2", &o, &m, &e) == KVQ_OK);
    const int L = m.hp.n_layers;
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, 8, 0, 0, &e) == KVQ_OK);
    int tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvq_fwd_io io = {.tokens = tok, .T = 8};
    kvq_fwd_result r;
    ck_assert_int_eq(kvq_forward_stage(&fw, &io, 1, 1, fw.x, &r, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_forward_stage(&fw, &io, 0, L + 1, NULL, &r, &e), KVQ_EINVAL);
    ck_assert_int_eq(kvq_forward_stage(&fw, &io, 1, L, NULL, &r, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "residual stream entering"), "%s", e.msg);
    kvq_backward bw;
    ck_assert(kvq_backward_init(&bw, &m, 8, 0, &e) == KVQ_OK);
    kvq_bwd_spec sp = {.xent = true};
    kvq_bwd_result br;
    ck_assert_int_eq(kvq_backward_stage_backward(&bw, &io, &sp, 0, L, NULL, &br, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "without its forward"), "%s", e.msg);
    ck_assert(kvq_backward_stage_forward(&bw, &io, &sp, 0, 1, NULL, &br, &e) == KVQ_OK);
    ck_assert_int_eq(kvq_backward_stage_backward(&bw, &io, &sp, 0, 1, NULL, &br, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "needs dL/dx"), "%s", e.msg);
    int first_bad[3] = {0, 0, L};
    kvq_forward *fws[2] = {&fw, &fw};
    float *xb[2] = {fw.x, fw.x};
    kvq_pipe_loopback lb;
    kvq_pipe_loopback_init(&lb, 2);
    kvq_pipe_xport xp = kvq_pipe_loopback_xport(&lb);
    ck_assert_int_eq(kvq_pipe_cpu_forward(fws, xb, first_bad, 2, &xp, &io, &r, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "stage 0 has no layers"), "%s", e.msg);
    kvq_pipe_loopback_free(&lb);
    kvq_forward_free(&fw);
    kvq_backward_free(&bw);
    kvq_model_free(&m);
}
END_TEST

/* --devices in kvdump and kveval: refused before any work (nothing written),
 * with the library's message (kvq_devices_resolve) and exit 2 for a bad
 * request, 1 for what this build or machine lacks; --devices cuda:0,1 without
 * NCCL or GPUs says which. */
static void cli_case(const char *tool, const char *dev_args, int want_rc, const char *devices, const char *device)
{
    char bin[256];
    if (!kvq_test_bin(bin, sizeof bin, tool)) {
        kvq_test_skip_missing(tool, "binary not built");
        return;
    }
    char dir[128], cmd[256], errf[256], full[4096];
    snprintf(dir, sizeof dir, "/tmp/kvq_test_pipeline_%ld", (long)getpid());
    snprintf(errf, sizeof errf, "%s/err.txt", dir);
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    ck_assert(system(cmd) == 0);
    const bool dump = !strcmp(tool, "kvdump");
    snprintf(full, sizeof full, "%s --model %s/none.gguf --text %s/none.txt %s %s/%s %s 2> %s", bin, dir, dir,
             dump ? "--out" : "--scheme fp16 --json", dir, dump ? "x.h5" : "x.json", dev_args, errf);
    int st = system(full);
    ck_assert(st != -1 && WIFEXITED(st));
    size_t n = 0;
    char *msg = kvq_test_slurp(errf, &n);
    ck_assert(msg);
    int ids[KVQ_PIPE_MAX_DEV], nd = 0;
    char one[32];
    kvq_err e = {0};
    kvq_status s = kvq_devices_resolve(devices, device, ids, KVQ_PIPE_MAX_DEV, &nd, one, sizeof one, &e);
    if (s) {
        ck_assert_msg(WEXITSTATUS(st) == want_rc, "%s %s: exit %d, expected %d (%s)", tool, dev_args, WEXITSTATUS(st), want_rc, msg);
        ck_assert_msg(strstr(msg, e.msg), "%s %s: stderr '%s' lacks '%s'", tool, dev_args, msg, e.msg);
    } else {
        /* a machine with the GPUs asked for: the request passes --devices (and fails later on the absent model) */
        ck_assert(WEXITSTATUS(st) != 0 && !strstr(msg, "--devices"));
    }
    snprintf(full, sizeof full, "%s/x.h5", dir);
    ck_assert(access(full, F_OK) != 0);
    snprintf(full, sizeof full, "%s/x.json", dir);
    ck_assert(access(full, F_OK) != 0);
    free(msg);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ck_assert(system(cmd) == 0);
}

START_TEST(test_cli_devices)
{
    const char *tools[2] = {"kvdump", "kveval"};
    char why[512] = "";
    const bool nccl = kvq_pipe_nccl_compiled(why, sizeof why);
    for (int i = 0; i < 2; i++) {
        cli_case(tools[i], "--devices cuda:0,0", 2, "cuda:0,0", NULL);
        cli_case(tools[i], "--devices cuda:0,zz", 2, "cuda:0,zz", NULL);
        cli_case(tools[i], "--devices cuda:0 --device cpu", 2, "cuda:0", "cpu");
        cli_case(tools[i], "--devices cuda:0,1", 1, "cuda:0,1", NULL);
        cli_case(tools[i], "--devices all", 1, "all", NULL);
    }
    /* without NCCL the two-GPU request names what the build lacks */
    int ids[4], nd;
    char one[32];
    kvq_err e = {0};
    if (!nccl) {
        ck_assert_int_eq(kvq_devices_resolve("cuda:0,1", NULL, ids, 4, &nd, one, sizeof one, &e), KVQ_EUNSUPPORTED);
        ck_assert_msg(strstr(e.msg, "2 GPUs need the multi-GPU pipeline") && strstr(e.msg, why), "%s", e.msg);
    }
    /* one GPU: "cuda:N" for --device, today's path */
    if (kvq_cuda_device_count(NULL, 0) > 0) {
        ck_assert(kvq_devices_resolve("cuda:0", NULL, ids, 4, &nd, one, sizeof one, &e) == KVQ_OK);
        ck_assert(nd == 1 && !strcmp(one, "cuda:0"));
    }
}
END_TEST

/* ---- several processes (MPI) on one host ---- */
/* The worker: run by mpirun -np S as "test_pipeline --mpi-worker MODEL_DIR". Every
 * rank runs the same stage loop with only its own stage's workspace (the others
 * NULL) over the MPI host transport, and the whole unstaged model alone as the
 * reference; each rank checks what its stage produced, bit for bit: the last the
 * loss, NLL and logits, every rank the gradients of its layers, rank 0 dL/d(embeddings).
 * Prints "OK rank R of S" and exits 0, else prints the mismatch and exits 1. */
typedef struct {
    float *dk, *dv;
    int l0, l1, calls, bad_layer;
} own_grads;

static kvq_status own_grads_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    (void)err;
    own_grads *o = user;
    if (g->layer < o->l0 || g->layer >= o->l1) o->bad_layer = g->layer;
    size_t n = (size_t)g->T * g->n_kv_heads * g->head_dim;
    memcpy(o->dk + (size_t)g->layer * n, g->dk_pre, n * 4);
    memcpy(o->dv + (size_t)g->layer * n, g->dv, n * 4);
    o->calls++;
    return KVQ_OK;
}

static int mpi_worker(const char *dir)
{
    int rank = 0, size = 1;
    kvq_err e = {0};
    if (kvq_pipe_mpi_init(&rank, &size, &e)) {
        fprintf(stderr, "worker: %s\n", e.msg);
        return 1;
    }
    int fail = 0;
    kvq_model m;
    kvq_load_opts lo = {.weights = KVQ_WEIGHTS_F32};
    if (kvq_model_load_opts(dir, &lo, &m, &e)) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        kvq_pipe_mpi_done();
        return 1;
    }
    const int L = m.hp.n_layers, T = 20, dim = m.hp.dim, kvd = kvq_kv_dim(&m.hp), V = m.hp.vocab_size;
    int first[KVQ_PIPE_MAX_DEV + 1];
    for (int s = 0; s <= size; s++) first[s] = (int)((long)L * s / size);
    int tok[20];
    for (int i = 0; i < T; i++) tok[i] = (i * 41 + 5) % V;
    const size_t n = (size_t)L * T * kvd;
    /* reference: the whole model in this process */
    kvq_forward fw0;
    kvq_backward bw0;
    float *lg0 = malloc((size_t)T * V * 4), *lg1 = malloc((size_t)T * V * 4), *de0 = malloc((size_t)T * dim * 4),
          *de1 = malloc((size_t)T * dim * 4);
    double nll0[20], nll1[20];
    kvq_grad_store g0 = {.dk_pre = malloc(n * 4), .dv = malloc(n * 4)};
    own_grads g1 = {.dk = calloc(n, 4), .dv = calloc(n, 4), .l0 = first[rank], .l1 = first[rank + 1], .bad_layer = -1};
    kvq_fwd_io io = {.tokens = tok, .T = T, .logits = lg0, .nll = nll0};
    kvq_fwd_result f0, f1;
    kvq_bwd_spec sp0 = {.user = &g0, .xent = true, .grads = kvq_grad_store_cb, .d_embd = de0};
    kvq_bwd_spec sp1 = {.user = &g1, .xent = true, .grads = own_grads_cb, .d_embd = de1};
    kvq_bwd_result b0, b1;
    if (kvq_forward_init(&fw0, &m, T, 0, 0, &e) || kvq_forward_run(&fw0, &io, &f0, &e) || kvq_backward_init(&bw0, &m, T, 0, &e)) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        fail = 1;
    }
    kvq_fwd_io bio = {.tokens = tok, .T = T};
    if (!fail && kvq_backward_run(&bw0, &bio, &sp0, &b0, &e)) fail = 1;
    /* this rank's stage only */
    kvq_forward *fws[KVQ_PIPE_MAX_DEV] = {0};
    kvq_backward *bws[KVQ_PIPE_MAX_DEV] = {0};
    float *xb[KVQ_PIPE_MAX_DEV] = {0}, *db[KVQ_PIPE_MAX_DEV] = {0};
    kvq_forward fw1;
    kvq_backward bw1;
    xb[rank] = malloc((size_t)T * dim * 4), db[rank] = malloc((size_t)T * dim * 4);
    kvq_pipe_xport xp;
    if (!fail && (kvq_forward_init(&fw1, &m, T, 0, 0, &e) || kvq_backward_init(&bw1, &m, T, 0, &e) || kvq_pipe_mpi_xport(rank, &xp, &e)))
        fail = 1;
    fws[rank] = &fw1, bws[rank] = &bw1;
    io.logits = lg1, io.nll = nll1;
    if (!fail && kvq_pipe_cpu_forward(fws, xb, first, size, &xp, &io, &f1, &e)) fail = 1;
    if (!fail && kvq_pipe_cpu_backward(bws, xb, db, first, size, &xp, &bio, &sp1, &b1, &e)) fail = 1;
    if (fail) fprintf(stderr, "rank %d: %s\n", rank, e.msg);
    if (!fail && rank == size - 1 &&
        (f0.loss != f1.loss || memcmp(lg0, lg1, (size_t)T * V * 4) || memcmp(nll0, nll1, sizeof nll0) || b0.loss != b1.loss)) {
        fprintf(stderr, "rank %d: loss %.9g / %.9g, backward %.9g / %.9g: not the unstaged bits\n", rank, f0.loss, f1.loss, b0.loss, b1.loss);
        fail = 1;
    }
    size_t off = (size_t)first[rank] * T * kvd, len = (size_t)(first[rank + 1] - first[rank]) * T * kvd;
    if (!fail && (g1.calls != first[rank + 1] - first[rank] || g1.bad_layer >= 0 || memcmp(g0.dk_pre + off, g1.dk + off, len * 4) ||
                  memcmp(g0.dv + off, g1.dv + off, len * 4))) {
        fprintf(stderr, "rank %d: gradients of layers %d..%d differ from the unstaged run\n", rank, first[rank], first[rank + 1] - 1);
        fail = 1;
    }
    if (!fail && rank == 0 && memcmp(de0, de1, (size_t)T * dim * 4)) {
        fprintf(stderr, "rank 0: dL/d(embeddings) differ\n");
        fail = 1;
    }
    if (!fail) printf("OK rank %d of %d: layers %d..%d\n", rank, size, first[rank], first[rank + 1] - 1);
    fflush(stdout);
    kvq_pipe_mpi_xport_free(&xp);
    kvq_pipe_mpi_done();
    return fail;
}

START_TEST(test_mpi_processes)
{
    char why[512];
    if (!kvq_pipe_mpi_host_compiled(why, sizeof why)) {
        if (kvq_test_quick()) KVQ_SKIP_OPTIONAL_IF(1, "the sanitizer build has no MPI");
        kvq_test_skip_missing("test_mpi_processes", why);
        return;
    }
    if (system("command -v mpirun > /dev/null 2>&1") != 0) {
        kvq_test_skip_missing("test_mpi_processes", "mpirun absent (Debian's openmpi-bin, with libopenmpi-dev)");
        return;
    }
    char self[4096];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    ck_assert(k > 0);
    self[k] = 0;
    char cmd[8192], out[256];
    snprintf(out, sizeof out, "/tmp/kvq_test_pipeline_mpi_%ld.txt", (long)getpid());
    /* two processes, one layer each, on two 2-layer families (Qwen3: q/k norms; Qwen2: biases) */
    const char *models[2] = {"tests/fixtures/hf-qwen3", "tests/fixtures/hf-qwen2"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 "
                 "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "
                 "mpirun -np 2 %s --mpi-worker %s > %s 2>&1",
                 self, models[i], out);
        int st = system(cmd);
        size_t n = 0;
        char *txt = kvq_test_slurp(out, &n);
        ck_assert_msg(st == 0 && txt && strstr(txt, "OK rank 0 of 2: layers 0..0") && strstr(txt, "OK rank 1 of 2: layers 1..1"),
                      "mpirun (%s): status %d, output:\n%s", models[i], st, txt ? txt : "(none)");
        fprintf(stderr, "INFO %s: 2 processes over MPI, each its own stage, equal the unstaged run bit for bit\n", models[i]);
        free(txt);
    }
    unlink(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("pipeline");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_devices_parse);
    tcase_add_test(tc, test_partition_small);
    tcase_add_test(tc, test_partition_brute);
    tcase_add_test(tc, test_need_llama);
    tcase_add_test(tc, test_loopback);
    tcase_add_test(tc, test_stage_args);
    tcase_add_test(tc, test_cli_devices);
    tcase_add_test(tc, test_mpi_processes);
    tcase_add_test(tc, test_staged_qwen2);
    tcase_add_test(tc, test_staged_qwen3);
    tcase_add_test(tc, test_staged_mistral);
    tcase_add_test(tc, test_staged_stories);
    suite_add_tcase(s, tc);
    return s;
}

/* KVQ_TEST_MAIN's main, and the MPI worker mode (test_mpi_processes runs this binary under mpirun) */
int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--mpi-worker")) return mpi_worker(argv[2]);
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int nf = srunner_ntests_failed(sr);
    srunner_free(sr);
    return nf ? EXIT_FAILURE : EXIT_SUCCESS;
}
