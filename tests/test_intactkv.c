/* test_intactkv.c — IntactKV prefixes (calib/intactkv.h, issue 9) on the tiny
 * llama2.c models (../shared/models/llama2c):
 *  - the prefix K/V equal the rows the forward computes for those tokens when
 *    they start a longer sequence (observe hook; pre-RoPE = RoPE^-1(post));
 *  - a window after the prefix gives the same NLL as prefix+window run as one
 *    sequence with the prefix positions unscored;
 *  - kveval's +intactkv (analysis/kveval/perplexity.h) with an untrained prefix
 *    equals prefix+window as one sequence, prefix positions unscored (fp32);
 *  - artifact round trip (bit-exact, byte-identical rewrite), inspect text;
 *  - bad input: prefix longer than the context, tokens outside the model's
 *    vocabulary / the unknown token, base artifact of another model, corrupt
 *    prefix tensors; the kvcalib intactkv command's exit codes and messages.
 */
#include <math.h>
#include <stdint.h>
#include <sys/wait.h>

#include "artifact.h"
#include "forward.h"
#include "identity.h"
#include "intactkv.h"
#include "kvq_test.h"
#include "model.h"
#include "ops.h"
#include "perplexity.h"
#include "safetensors.h"
#include "scheme.h"
#include "text.h"
#include "tokenizer.h"

#define TINY_TOK "models/llama2c/aidreams-tok512.bin"

static const char *const tiny_models[] = {"models/llama2c/stories260K.bin", "models/llama2c/aidreams260K.bin"};

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "/tmp/kvq_test_intactkv_%d_%s", (int)getpid(), name);
}

/* A fixed token sequence in [1, V). */
static void make_tokens(int32_t *tok, int n, int V)
{
    uint32_t s = 777;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        tok[i] = 1 + (int32_t)((s >> 8) % (uint32_t)(V - 1));
    }
}

typedef struct {
    int n, kvd;
    float *k_pre, *k_post, *v; /* [n_layers][n][kvd]: rows 0..n-1 of each layer */
} capture;

static kvq_status observe_rows(void *user, const kvq_layer_ctx *c, const kvq_layer_obs *o, kvq_err *err)
{
    (void)err;
    capture *cp = user;
    size_t n = (size_t)cp->n * cp->kvd, off = (size_t)c->layer * n;
    memcpy(cp->k_pre + off, o->k_pre, n * sizeof(float));
    memcpy(cp->k_post + off, o->k_post, n * sizeof(float));
    memcpy(cp->v + off, o->v, n * sizeof(float));
    return KVQ_OK;
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

static double max_abs(const float *a, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i]));
    return d;
}

/* ---- prefix K/V = the forward's own rows ------------------------------------------ */

START_TEST(test_compute_matches_forward)
{
    char path[4096];
    KVQ_SKIP_IF(!kvq_test_shared(path, sizeof path, tiny_models[_i]), "tiny llama2.c model absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    const int P = 7, T = 40, L = m.hp.n_layers, kvd = kvq_kv_dim(&m.hp);
    int32_t ids[64];
    int tok[64];
    make_tokens(ids, P + T, m.hp.vocab_size);
    for (int i = 0; i < P + T; i++) tok[i] = ids[i];
    kvq_artifact_prefix px;
    ck_assert_msg(kvq_intactkv_compute(&m, ids, P, "test prefix", false, &px, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(px.P, P);
    for (int i = 0; i < P; i++) {
        ck_assert_int_eq(px.token_ids[i], ids[i]);
        ck_assert_int_eq(px.positions[i], i);
    }
    ck_assert_str_eq(px.text, "test prefix");
    ck_assert(!px.trained && !px.special);
    /* reference: the first P rows of a forward over P+T tokens (a different GEMM size) */
    size_t n = (size_t)L * P * kvd;
    capture cp = {.n = P, .kvd = kvd, .k_pre = malloc(n * 4), .k_post = malloc(n * 4), .v = malloc(n * 4)};
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, P + T, 0, 0, &e) == KVQ_OK);
    kvq_hooks hk = {.user = &cp, .observe = observe_rows};
    kvq_fwd_io io = {.tokens = tok, .T = P + T, .hooks = &hk};
    kvq_fwd_result r;
    ck_assert_msg(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK, "%s", e.msg);
    double dk = max_abs_diff(px.k, cp.k_post, n), dkp = max_abs_diff(px.k_pre, cp.k_pre, n), dv = max_abs_diff(px.v, cp.v, n);
    double sk = max_abs(cp.k_post, n), sv = max_abs(cp.v, n);
    fprintf(stderr, "INFO %s: prefix vs forward rows: max |dK_post| %.2e, |dK_pre| %.2e, |dV| %.2e (scale %.3g, %.3g)\n",
            tiny_models[_i], dk, dkp, dv, sk, sv);
    ck_assert(sk > 0.1 && sv > 0.01);
    ck_assert_msg(dk <= 1e-5 * sk && dkp <= 1e-5 * sk && dv <= 1e-5 * sv, "prefix K/V differ from the forward's rows");
    /* post-RoPE keys really are RoPE(pre-RoPE) at positions 0..P-1: layer 0, position > 0 rotated, position 0 not */
    ck_assert(max_abs_diff(px.k, px.k_pre, (size_t)kvd) == 0);          /* position 0: angle 0 */
    ck_assert(max_abs_diff(px.k + kvd, px.k_pre + kvd, (size_t)kvd) > 1e-4); /* position 1: rotated */
    /* sync_pre_rope: RoPE^-1 of the post-RoPE keys reproduces the pre-RoPE keys */
    float *keep = malloc(n * 4);
    memcpy(keep, px.k_pre, n * 4);
    memset(px.k_pre, 0, n * 4);
    ck_assert(kvq_intactkv_sync_pre_rope(&m.hp, &px, &e) == KVQ_OK);
    double dsync = max_abs_diff(px.k_pre, keep, n);
    ck_assert_msg(dsync <= 1e-6 * sk, "RoPE^-1(k_post) differs from k_pre by %.3e", dsync);
    free(keep);
    /* too long for the context */
    kvq_artifact_prefix bad;
    int32_t *big = calloc((size_t)m.hp.ctx_len + 1, sizeof *big);
    ck_assert_int_eq(kvq_intactkv_compute(&m, big, (size_t)m.hp.ctx_len + 1, "x", false, &bad, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "exceeds the model's context length"), "%s", e.msg);
    big[3] = m.hp.vocab_size;
    ck_assert_int_eq(kvq_intactkv_compute(&m, big, 5, "x", false, &bad, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "prefix token 3") && strstr(e.msg, "vocabulary"), "%s", e.msg);
    free(big);
    free(cp.k_pre);
    free(cp.k_post);
    free(cp.v);
    kvq_forward_free(&fw);
    kvq_artifact_prefix_free(&px);
    kvq_model_free(&m);
}
END_TEST

/* ---- window after the prefix == one sequence with the prefix unscored ---------------------- */

START_TEST(test_prefix_equals_one_sequence)
{
    char path[4096];
    KVQ_SKIP_IF(!kvq_test_shared(path, sizeof path, tiny_models[_i]), "tiny llama2.c model absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    const int P = 4, T = 60;
    int32_t ids[64];
    int tok[64], tg_full[64], tg_win[64];
    make_tokens(ids, P + T, m.hp.vocab_size);
    for (int i = 0; i < P + T; i++) tok[i] = ids[i];
    kvq_artifact_prefix px;
    ck_assert_msg(kvq_intactkv_compute(&m, ids, P, "p", false, &px, &e) == KVQ_OK, "%s", e.msg);
    /* one sequence: the prefix positions are not scored (and the last position
     * of the prefix predicts the first window token, which the window cannot) */
    for (int t = 0; t < P + T; t++) tg_full[t] = t >= P && t + 1 < P + T ? tok[t + 1] : -1;
    for (int t = 0; t < T; t++) tg_win[t] = t + 1 < T ? tok[P + t + 1] : -1;
    double nll_full[64], nll_win[64];
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, P + T, P, 0, &e) == KVQ_OK);
    kvq_fwd_result r1, r2;
    kvq_fwd_io io1 = {.tokens = tok, .T = P + T, .targets = tg_full, .nll = nll_full};
    ck_assert(kvq_forward_run(&fw, &io1, &r1, &e) == KVQ_OK);
    kvq_prefix pv = kvq_intactkv_view(&px);
    kvq_fwd_io io2 = {.tokens = tok + P, .T = T, .pos0 = P, .targets = tg_win, .prefix = &pv, .nll = nll_win};
    ck_assert_msg(kvq_forward_run(&fw, &io2, &r2, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(r1.n_scored, r2.n_scored);
    ck_assert_int_eq(r1.n_scored, T - 1);
    double d = 0;
    for (int t = 0; t < T - 1; t++) d = fmax(d, fabs(nll_win[t] - nll_full[P + t]));
    fprintf(stderr, "INFO %s: window after prefix vs one sequence: mean NLL %.6f vs %.6f, max |dNLL| %.2e\n", tiny_models[_i],
            r2.loss, r1.loss, d);
    ck_assert_msg(d < 1e-4, "max |dNLL| %.3e", d);
    ck_assert(fabs(r1.loss - r2.loss) < 1e-5);
    /* and the prefix matters: without it the window's NLL differs */
    kvq_fwd_io io3 = {.tokens = tok + P, .T = T, .pos0 = P, .targets = tg_win, .nll = nll_win};
    ck_assert(kvq_forward_run(&fw, &io3, &r2, &e) == KVQ_OK);
    ck_assert_msg(fabs(r2.loss - r1.loss) > 1e-3, "dropping the prefix changed the loss by only %.3e", fabs(r2.loss - r1.loss));
    kvq_forward_free(&fw);
    kvq_artifact_prefix_free(&px);
    kvq_model_free(&m);
}
END_TEST

/* ---- artifact round trip ----------------------------------------------------------- */

/* A KIVI base artifact for model m (metadata only), fingerprint fp. */
static void make_base(kvq_artifact *a, const kvq_model *m, const char *fp)
{
    memset(a, 0, sizeof *a);
    kvq_artifact_params *p = &a->p;
    p->method = KVQ_FAM("kivi");
    p->k_bits = p->v_bits = 2;
    p->post_rope = true;
    p->group_size = 8;
    p->residual_length = 16;
    p->n_layers = (size_t)m->hp.n_layers;
    p->n_kv_heads = (size_t)m->hp.n_kv_heads;
    p->head_dim = (size_t)m->hp.head_dim;
    p->bits_k = p->bits_v = 3;
    p->bits_ctx = 64;
    snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "%s", fp);
}

static void assert_prefix_equal(const kvq_artifact_prefix *a, const kvq_artifact_prefix *b, size_t n)
{
    ck_assert_uint_eq(a->P, b->P);
    ck_assert(memcmp(a->token_ids, b->token_ids, a->P * 4) == 0);
    ck_assert(memcmp(a->positions, b->positions, a->P * 4) == 0);
    ck_assert(memcmp(a->k, b->k, n * 4) == 0);
    ck_assert(memcmp(a->k_pre, b->k_pre, n * 4) == 0);
    ck_assert(memcmp(a->v, b->v, n * 4) == 0);
    ck_assert_str_eq(a->text, b->text);
    ck_assert(a->special == b->special && a->trained == b->trained);
    ck_assert_uint_eq(a->n_loss, b->n_loss);
    if (a->n_loss) ck_assert(memcmp(a->loss_curve, b->loss_curve, a->n_loss * sizeof(double)) == 0);
}

START_TEST(test_artifact_roundtrip)
{
    char path[4096];
    KVQ_SKIP_IF(!kvq_test_shared(path, sizeof path, tiny_models[0]), "tiny llama2.c model absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    char fp[65];
    ck_assert_msg(kvq_identity_model(&m, fp, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact a;
    make_base(&a, &m, fp);
    int32_t ids[5] = {1, 50, 60, 70, 80};
    a.prefix = calloc(1, sizeof *a.prefix);
    ck_assert_msg(kvq_intactkv_compute(&m, ids, 5, "<s>system: be nice", true, a.prefix, &e) == KVQ_OK, "%s", e.msg);
    size_t n = (size_t)m.hp.n_layers * 5 * kvq_kv_dim(&m.hp);
    char out[512], out2[512];
    tmp_path(out, sizeof out, "rt.st");
    tmp_path(out2, sizeof out2, "rt2.st");
    unlink(out);
    ck_assert_msg(kvq_intactkv_write(out, false, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_intactkv_write(out, false, &a, &e), KVQ_EIO);
    ck_assert_msg(strstr(e.msg, "already exists"), "%s", e.msg);
    kvq_artifact b;
    ck_assert_msg(kvq_artifact_read(out, &b, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_ptr_nonnull(b.prefix);
    assert_prefix_equal(a.prefix, b.prefix, n);
    ck_assert_ptr_eq(b.p.method, KVQ_FAM("kivi"));
    kvq_test_python("check_artifact.py", out); /* the prefix tensors, read with Python safetensors */
    ck_assert_str_eq(b.p.model_fingerprint, fp);
    /* the reserved tensor names kveval reads (ARTIFACT.md): [P, kv_dim] per layer */
    kvq_safetensors st;
    ck_assert(kvq_safetensors_open(out, &st, &e) == KVQ_OK);
    const kvq_st_tensor *t = kvq_safetensors_find(&st, "layers.4.intactkv.k");
    ck_assert(t && t->dtype == KVQ_ST_F32 && t->n_dims == 2 && t->shape[0] == 5 && t->shape[1] == (uint64_t)kvq_kv_dim(&m.hp));
    ck_assert(kvq_safetensors_find(&st, "layers.0.intactkv.k_pre_rope") && kvq_safetensors_find(&st, "intactkv.positions"));
    ck_assert_str_eq(kvq_safetensors_meta(&st, "kvq.intactkv.trained"), "false");
    kvq_safetensors_close(&st);

    /* trained: the loss curve and settings survive; rewriting gives the same bytes */
    a.prefix->trained = true;
    a.prefix->n_loss = 3;
    a.prefix->loss_curve = malloc(3 * sizeof(double));
    a.prefix->loss_curve[0] = 0.5;
    a.prefix->loss_curve[1] = 0.25;
    a.prefix->loss_curve[2] = 0.125 + 1e-17;
    kvq_prefix_training *tr = &a.prefix->train;
    snprintf(tr->scheme, sizeof tr->scheme, "kivi2-g8-r16");
    tr->steps = 3;
    tr->accum = 2;
    tr->samples = 4;
    tr->seq_len = 32;
    tr->lr = 2e-4;
    tr->beta1 = 0.9;
    tr->beta2 = 0.999;
    tr->eps = 1e-8;
    tr->clip = 0.3;
    tr->seed = 42;
    tr->loss_before = 0.6;
    tr->loss_after = 0.1;
    tr->seconds = 1.5;
    snprintf(tr->text_sha256, sizeof tr->text_sha256, "%064d", 7);
    ck_assert_msg(kvq_intactkv_write(out, true, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_free(&b);
    ck_assert_msg(kvq_artifact_read(out, &b, &e) == KVQ_OK, "%s", e.msg);
    assert_prefix_equal(a.prefix, b.prefix, n);
    ck_assert_str_eq(b.prefix->train.scheme, "kivi2-g8-r16");
    ck_assert(b.prefix->train.steps == 3 && b.prefix->train.accum == 2 && b.prefix->train.samples == 4 &&
              b.prefix->train.seq_len == 32 && b.prefix->train.seed == 42);
    ck_assert(b.prefix->train.lr == 2e-4 && b.prefix->train.clip == 0.3 && b.prefix->train.eps == 1e-8 &&
              b.prefix->train.loss_after == 0.1 && b.prefix->train.seconds == 1.5);
    ck_assert_msg(kvq_intactkv_write(out2, true, &b, &e) == KVQ_OK, "%s", e.msg);
    size_t nx, ny;
    unsigned char *x = kvq_test_slurp(out, &nx), *y = kvq_test_slurp(out2, &ny);
    ck_assert(x && y && nx == ny && memcmp(x, y, nx) == 0);
    free(x);
    free(y);
    /* inspect shows the prefix */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ck_assert(kvq_artifact_inspect(f, out, &e) == KVQ_OK);
    fclose(f);
    ck_assert_msg(strstr(buf, "prefix of 5 tokens at positions 0..4") && strstr(buf, "trained") &&
                      strstr(buf, "token ids 1 50 60 70 80") && strstr(buf, "kivi2-g8-r16") && strstr(buf, "0.125"),
                  "%s", buf);
    free(buf);

    /* invalid prefixes are refused by the writer, naming the field */
    a.prefix->positions[2] = 7;
    ck_assert_int_eq(kvq_intactkv_write(out2, true, &a, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "intactkv.positions[2]"), "%s", e.msg);
    a.prefix->positions[2] = 2;
    a.prefix->v[n - 1] = NAN;
    ck_assert_int_eq(kvq_intactkv_write(out2, true, &a, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "layers.4.intactkv.v[4]") && strstr(e.msg, "not finite"), "%s", e.msg);
    a.prefix->v[n - 1] = 0;
    a.prefix->loss_curve[1] = INFINITY;
    ck_assert_int_eq(kvq_intactkv_write(out2, true, &a, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "loss_curve[1]"), "%s", e.msg);

    /* a file with the prefix ids but a missing value tensor is rejected by the reader */
    {
        kvq_safetensors s2;
        ck_assert(kvq_safetensors_open(out, &s2, &e) == KVQ_OK);
        kvq_st_entry *te = calloc(s2.n_tensors, sizeof *te);
        kvq_st_kv *kv = calloc(s2.n_meta, sizeof *kv);
        size_t k = 0;
        for (size_t i = 0; i < s2.n_tensors; i++) {
            const kvq_st_tensor *ti = &s2.tensors[i];
            if (!strcmp(ti->name, "layers.2.intactkv.v")) continue;
            te[k] = (kvq_st_entry){ti->name, ti->dtype, ti->n_dims, {0}, ti->data};
            memcpy(te[k].shape, ti->shape, sizeof ti->shape);
            k++;
        }
        for (size_t i = 0; i < s2.n_meta; i++) kv[i] = (kvq_st_kv){s2.meta[i].key, s2.meta[i].value};
        ck_assert_msg(kvq_safetensors_write(out2, te, k, kv, s2.n_meta, &e) == KVQ_OK, "%s", e.msg);
        kvq_safetensors_close(&s2);
        free(te);
        free(kv);
        kvq_artifact c;
        ck_assert_int_eq(kvq_artifact_read(out2, &c, &e), KVQ_EFORMAT);
        ck_assert_msg(strstr(e.msg, "layers.2.intactkv.v") && strstr(e.msg, "missing"), "%s", e.msg);
    }

    /* base artifact of another model */
    ck_assert_int_eq(kvq_intactkv_check_base(&b, "b.st", &m, "0123", false, NULL, &e), KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, "another model") && strstr(e.msg, fp) && strstr(e.msg, "0123"), "%s", e.msg);
    ck_assert_int_eq(kvq_intactkv_check_base(&b, "b.st", &m, fp, false, NULL, &e), KVQ_OK);
    b.p.n_kv_heads = 2;
    ck_assert_int_eq(kvq_intactkv_check_base(&b, "b.st", &m, fp, false, NULL, &e), KVQ_EMISMATCH);
    ck_assert_msg(strstr(e.msg, "KV heads"), "%s", e.msg);
    b.p.n_kv_heads = (size_t)m.hp.n_kv_heads;
    unlink(out);
    unlink(out2);
    kvq_artifact_free(&a);
    kvq_artifact_free(&b);
    kvq_model_free(&m);
}
END_TEST

/* ---- tokenising the prefix --------------------------------------------------------- */

/* A llama2.c tokenizer.bin without byte tokens: <unk> <s> </s> then single letters. */
static void write_mini_tokenizer(const char *path)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    const char *v[] = {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "b", " a", "ab"};
    uint32_t maxlen = 8;
    fwrite(&maxlen, 4, 1, f);
    for (int i = 0; i < 8; i++) {
        float score = (float)-i;
        int32_t len = (int32_t)strlen(v[i]);
        fwrite(&score, 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(v[i], 1, (size_t)len, f);
    }
    fclose(f);
}

START_TEST(test_tokenize)
{
    char tp[4096];
    KVQ_SKIP_IF(!kvq_test_shared(tp, sizeof tp, TINY_TOK), "tiny tokenizer absent");
    kvq_tokenizer *tok;
    kvq_err e = {0};
    ck_assert_msg(kvq_tokenizer_load(tp, &tok, &e) == KVQ_OK, "%s", e.msg);
    int32_t *ids;
    size_t P;
    ck_assert_msg(kvq_intactkv_tokenize(tok, "bos", false, false, 512, 100, &ids, &P, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(P, 1);
    ck_assert_int_eq(ids[0], kvq_tokenizer_bos(tok));
    free(ids);
    /* text: the tokenizer's own encoding, optionally after BOS */
    int32_t *ref;
    size_t nref;
    ck_assert(kvq_tokenizer_encode(tok, "Once upon a time", 16, 0, &ref, &nref, &e) == KVQ_OK);
    ck_assert_msg(kvq_intactkv_tokenize(tok, "Once upon a time", false, true, 512, 100, &ids, &P, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_uint_eq(P, nref + 1);
    ck_assert_int_eq(ids[0], 1);
    ck_assert(memcmp(ids + 1, ref, nref * 4) == 0);
    free(ids);
    /* bad: empty, longer than allowed, outside the model's vocabulary */
    ck_assert_int_eq(kvq_intactkv_tokenize(tok, "", false, false, 512, 100, &ids, &P, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "empty"), "%s", e.msg);
    ck_assert_int_eq(kvq_intactkv_tokenize(tok, "Once upon a time", false, false, 512, 3, &ids, &P, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "more than the 3"), "%s", e.msg);
    int32_t mx = 0;
    for (size_t i = 0; i < nref; i++) mx = ref[i] > mx ? ref[i] : mx;
    ck_assert_int_eq(kvq_intactkv_tokenize(tok, "Once upon a time", false, false, mx, 100, &ids, &P, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "outside the model's vocabulary"), "%s", e.msg);
    ck_assert(ids == NULL && P == 0);
    free(ref);
    kvq_tokenizer_free(tok);
    /* the unknown token: a vocabulary without byte fallback cannot spell 'z' */
    char mini[512];
    tmp_path(mini, sizeof mini, "mini_tok.bin");
    write_mini_tokenizer(mini);
    ck_assert_msg(kvq_tokenizer_load(mini, &tok, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_intactkv_tokenize(tok, "ab a", false, false, 8, 100, &ids, &P, &e) == KVQ_OK, "%s", e.msg);
    free(ids);
    ck_assert_int_eq(kvq_intactkv_tokenize(tok, "ab z", false, false, 8, 100, &ids, &P, &e), KVQ_EINVAL);
    ck_assert_msg(strstr(e.msg, "unknown prefix token"), "%s", e.msg);
    kvq_tokenizer_free(tok);
    unlink(mini);
}
END_TEST

/* ---- kveval +intactkv == prefix + window as one sequence ------------------------------- */

START_TEST(test_kveval_prefix)
{
    char path[4096], tp[4096], txp[4096];
    KVQ_SKIP_IF(!kvq_test_shared(path, sizeof path, tiny_models[_i]) || !kvq_test_shared(tp, sizeof tp, TINY_TOK) ||
                    !kvq_test_shared(txp, sizeof txp, "datasets/wikitext-2/wiki.valid.tokens"),
                "tiny llama2.c model, tokenizer or wikitext-2 absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert_msg(kvq_model_load(path, &m, &e) == KVQ_OK, "%s", e.msg);
    kvq_tokenizer *tok;
    ck_assert(kvq_tokenizer_load(tp, &tok, &e) == KVQ_OK);
    kvq_text txt;
    ck_assert_msg(kvq_text_read(txp, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_TO_LF, &txt, &e) == KVQ_OK, "%s", e.msg);
    const size_t ctx = 48, nw = 3;
    kvq_windows win;
    ck_assert_msg(kvq_ppl_windows(&txt, tok, KVQ_PPL_KVQUANT, ctx, KVQ_BOS_MODEL, &win, &e) == KVQ_OK, "%s", e.msg);
    kvq_ppl_plan plan;
    ck_assert(kvq_ppl_plan_make(&win, KVQ_PPL_KVQUANT, nw, &plan, &e) == KVQ_OK);
    /* artifact: a base with a prefix "Once upon a time" (BOS first) */
    char fp[65];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    kvq_artifact a;
    make_base(&a, &m, fp);
    int32_t *ids;
    size_t P;
    ck_assert(kvq_intactkv_tokenize(tok, "Once upon a time", false, true, m.hp.vocab_size, 64, &ids, &P, &e) == KVQ_OK);
    a.prefix = calloc(1, sizeof *a.prefix);
    ck_assert(kvq_intactkv_compute(&m, ids, P, "Once upon a time", false, a.prefix, &e) == KVQ_OK);
    char ap[512];
    tmp_path(ap, sizeof ap, "eval.st");
    ck_assert_msg(kvq_intactkv_write(ap, true, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_set set;
    const char *paths[1] = {ap};
    ck_assert_msg(kvq_artifact_set_load(&set, paths, 1, &m, fp, false, NULL, &e) == KVQ_OK, "%s", e.msg);
    kvq_eval_scheme sch[2];
    ck_assert_msg(kvq_eval_scheme_make("fp32", &set, &m.hp, &sch[0], &e) == KVQ_OK, "%s", e.msg);
    ck_assert_msg(kvq_eval_scheme_make("fp32+intactkv", &set, &m.hp, &sch[1], &e) == KVQ_OK, "%s", e.msg);
    ck_assert(sch[1].prefix && (size_t)sch[1].prefix->P == P);
    kvq_ppl_result res[2];
    ck_assert_msg(kvq_ppl_run(&m, &win, &plan, sch, 2, NULL, res, &e) == KVQ_OK, "%s", e.msg);
    /* reference: the prefix tokens and the window as one sequence, the prefix not scored */
    size_t n = P + ctx;
    int *full = malloc(n * sizeof *full), *tg = malloc(n * sizeof *tg), *wt = malloc(ctx * sizeof *wt);
    double *nll = malloc(n * sizeof *nll), sum = 0;
    uint64_t cnt = 0;
    kvq_forward fw;
    ck_assert(kvq_forward_init(&fw, &m, (int)n, 0, 0, &e) == KVQ_OK);
    for (size_t w = 0; w < nw; w++) {
        const int32_t *x = win.tokens + w * ctx;
        kvq_ppl_targets(&plan, x, wt);
        for (size_t i = 0; i < P; i++) full[i] = ids[i], tg[i] = -1;
        for (size_t t = 0; t < ctx; t++) full[P + t] = x[t], tg[P + t] = wt[t];
        kvq_fwd_io io = {.tokens = full, .T = (int)n, .targets = tg, .nll = nll};
        kvq_fwd_result r;
        ck_assert(kvq_forward_run(&fw, &io, &r, &e) == KVQ_OK);
        for (size_t t = 0; t < n; t++)
            if (tg[t] >= 0) sum += nll[t], cnt++;
        double dw = fabs(res[1].window_nll[w] - r.loss);
        ck_assert_msg(dw < 1e-5, "window %zu: kveval +intactkv mean NLL %.9f, one sequence %.9f", w, res[1].window_nll[w], r.loss);
    }
    double ppl_ref = exp(sum / (double)cnt);
    fprintf(stderr, "INFO %s: kveval fp32 PPL %.5f, fp32+intactkv (P=%zu) %.5f, prefix+window as one sequence %.5f\n",
            tiny_models[_i], res[0].ppl, P, res[1].ppl, ppl_ref);
    ck_assert_uint_eq(res[1].n_scored, cnt);
    ck_assert_msg(fabs(res[1].ppl - ppl_ref) <= 1e-5 * ppl_ref, "PPL %.9g vs %.9g", res[1].ppl, ppl_ref);
    ck_assert_msg(fabs(res[0].ppl - res[1].ppl) > 1e-3 * res[0].ppl, "the prefix changed nothing");
    /* the report names the prefix and says it is untrained */
    kvq_ppl_report rep = {.m = &m, .win = &win, .text_format = "wikitext-tokens", .bos_policy = "model", .plan = &plan,
                          .arts = &set, .schemes = sch, .results = res, .n_schemes = 2, .baseline = 0};
    char *rb = NULL;
    size_t rl = 0;
    FILE *rf = open_memstream(&rb, &rl);
    ck_assert_msg(kvq_ppl_report_table(rf, &rep, &e) == KVQ_OK, "%s", e.msg);
    fclose(rf);
    char want[128];
    snprintf(want, sizeof want, "IntactKV prefix of %zu entr%s", P, P == 1 ? "y" : "ies");
    ck_assert_msg(strstr(rb, want) && strstr(rb, "(\"Once upon a time\", untrained)"), "%s", rb);
    free(rb);
    kvq_forward_free(&fw);
    kvq_ppl_results_free(res, 2);
    kvq_artifact_set_free(&set);
    free(full);
    free(tg);
    free(wt);
    free(nll);
    free(ids);
    unlink(ap);
    kvq_artifact_free(&a);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
}
END_TEST

/* ---- the command ------------------------------------------------------------------ */

static const char *kvcalib_bin(char *buf, size_t n) { return kvq_test_bin(buf, n, "kvcalib"); }

static int run_cmd(const char *cmd, char *out, size_t n)
{
    char full[16400];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    ck_assert_ptr_nonnull(p);
    size_t got = fread(out, 1, n - 1, p);
    out[got] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(test_cli)
{
    char bin[512], m0[4096], m1[4096], tp[4096];
    KVQ_SKIP_IF(!kvcalib_bin(bin, sizeof bin), "bin/kvcalib not built (run make)");
    KVQ_SKIP_IF(!kvq_test_shared(m0, sizeof m0, tiny_models[0]) || !kvq_test_shared(m1, sizeof m1, tiny_models[1]) ||
                    !kvq_test_shared(tp, sizeof tp, TINY_TOK),
                "tiny llama2.c models absent");
    kvq_model m;
    kvq_err e = {0};
    ck_assert(kvq_model_load(m0, &m, &e) == KVQ_OK);
    char fp[65];
    ck_assert(kvq_identity_model(&m, fp, &e) == KVQ_OK);
    kvq_artifact base;
    make_base(&base, &m, fp);
    char bp[512], out[512], cmd[16384];
    static char buf[1 << 16];
    tmp_path(bp, sizeof bp, "cli_base.st");
    tmp_path(out, sizeof out, "cli_out.st");
    ck_assert(kvq_intactkv_write(bp, true, &base, &e) == KVQ_OK);
    unlink(out);
    char longp[3000];
    size_t k = 0;
    for (int i = 0; i < 600; i++) k += (size_t)snprintf(longp + k, sizeof longp - k, "a ");
    struct {
        const char *model, *extra;
        int rc;
        const char *needles[3];
    } cases[] = {
        {m0, "--prefix bos", 0, {"wrote", "untrained prefix of 1 token", "1 '\\n<s>\\n'"}},
        {m0, "--prefix bos", 1, {"already exists", "--force"}},
        /* --special that matches no special token is named (it silently did nothing) */
        {m0, "--prefix 'Once upon a time' --special --force", 0, {"wrote", "warning: --special changed nothing"}},
        {m0, "--prefix 'Once upon a time' --special --force --quiet", 0, {NULL}},
        {m0, "--prefix 'Once upon a time' --force --quiet", 0, {NULL}},
        {m1, "--prefix bos --force", 1, {"calibrated for another model", fp}},
        {m0, "--prefix '' --force", 2, {"--prefix: expected a non-empty value"}},
        {m0, "--train --prefix bos --force", 2, {"--train needs --text"}},
        {m0, "--prefix bos --text x --force", 2, {"--text applies to --train only"}},
        {m0, "--prefix bos --lr 0 --force", 2, {"--lr"}},
        {m0, "--prefix bos --device cpu --force", 2, {"--device applies to --train only"}},
        {m0, "--prefix bos --samples 4 --force", 2, {"--samples applies to --train only"}},
        {m0, "--prefix bos --lr=0.1 --force", 2, {"--lr applies to --train only"}},
        {m0, "--prefix bos -L 64 --force", 2, {"-L applies to --train only"}},
        {m0, "--prefix bos --train --text x --device tpu --force", 2, {"--device", "tpu"}},
        /* each training option named with its value (one message listed every rule; --beta2 1.5 said
         * "expected 0..1", then 1 was refused too); --add-bos with --prefix bos did nothing */
        {m0, "--prefix bos --train --text x --beta2 1.5 --force", 2, {"--beta2: expected in [0, 1), found 1.5"}},
        {m0, "--prefix bos --train --text x --beta1 1 --force", 2, {"--beta1: expected in [0, 1), found 1"}},
        {m0, "--prefix bos --train --text x --eps 0 --force", 2, {"--eps: expected > 0, found 0"}},
        {m0, "--prefix bos --add-bos --force", 2, {"--add-bos: --prefix bos is the BOS token alone already"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(cmd, sizeof cmd, "%s intactkv --model %s --tokenizer %s --base %s --out %s %s", bin, cases[i].model, tp, bp, out,
                 cases[i].extra);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == cases[i].rc, "'%s': exit %d, expected %d; output:\n%s", cmd, rc, cases[i].rc, buf);
        for (int j = 0; j < 3 && cases[i].needles[j]; j++)
            ck_assert_msg(strstr(buf, cases[i].needles[j]), "'%s': output lacks '%s':\n%s", cmd, cases[i].needles[j], buf);
        if (strstr(cases[i].extra, "--quiet")) ck_assert_msg(buf[0] == 0, "--quiet printed:\n%s", buf);
    }
    /* --special that matches a control token (llama2.c's EOS text "\n</s>\n") gets no warning */
    snprintf(cmd, sizeof cmd, "%s intactkv --model %s --tokenizer %s --base %s --out %s.special --force --special --prefix \"$(printf "
             "'Once\\n</s>\\n upon')\"", bin, m0, tp, bp, out);
    ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    ck_assert_msg(strstr(buf, "wrote") && !strstr(buf, "--special changed nothing"), "%s", buf);
    {
        char sp[sizeof out + 16];
        snprintf(sp, sizeof sp, "%s.special", out);
        ck_assert_int_eq(unlink(sp), 0); /* written, and not left under /tmp */
    }
    /* the 'Once upon a time' artifact holds that text's tokens and the base's scheme */
    kvq_artifact r;
    ck_assert_msg(kvq_artifact_read(out, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(r.prefix && r.p.method == KVQ_FAM("kivi") && r.p.group_size == 8);
    ck_assert_str_eq(r.prefix->text, "Once upon a time");
    kvq_artifact_free(&r);
    /* prefix longer than the context: error, the existing file untouched */
    snprintf(cmd, sizeof cmd, "%s intactkv --model %s --tokenizer %s --base %s --out %s --force --prefix '%s'", bin, m0, tp, bp, out,
             longp);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
    ck_assert_msg(strstr(buf, "more than the") && strstr(buf, "context"), "%s", buf);
    ck_assert_msg(kvq_artifact_read(out, &r, &e) == KVQ_OK && r.prefix && !strcmp(r.prefix->text, "Once upon a time"), "%s", e.msg);
    const int P = r.prefix->P;
    kvq_artifact_free(&r);
    /* kveval with that prefix: the default window leaves room for it (it was min(2048, context):
     * "prefix of P + ctx 128 exceeds the model's context length 128" on the tiny models), an explicit
     * --ctx that does not is refused up front with the largest that fits */
    char kveval[512], txv[4096];
    if (kvq_test_bin(kveval, sizeof kveval, "kveval") && kvq_test_shared(txv, sizeof txv, "datasets/wikitext-2/wiki.valid.tokens")) {
        ck_assert(P > 1 && P < m.hp.ctx_len);
        snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s --artifact %s --scheme kivi2-g8-r16+intactkv --max-windows 1 -q --json -",
                 kveval, m0, tp, txv, out);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 0, "'%s': exit %d\n%s", cmd, rc, buf);
        char want[64];
        snprintf(want, sizeof want, "\"ctx\":\t%d,", m.hp.ctx_len - P);
        ck_assert_msg(strstr(buf, want), "'%s': output lacks '%s':\n%.2000s", cmd, want, buf);
        snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s --artifact %s --scheme kivi2-g8-r16+intactkv --max-windows 1 -q --ctx %d",
                 kveval, m0, tp, txv, out, m.hp.ctx_len);
        rc = run_cmd(cmd, buf, sizeof buf);
        snprintf(want, sizeof want, "use --ctx <= %d", m.hp.ctx_len - P);
        ck_assert_msg(rc == 1 && strstr(buf, want) && strstr(buf, "IntactKV prefix of"), "'%s': exit %d\n%s", cmd, rc, buf);
    }
    /* --train on the tiny model: a few steps, loss CSV, trained metadata */
    char csv[512], txp[4096];
    tmp_path(csv, sizeof csv, "cli_loss.csv");
    if (kvq_test_shared(txp, sizeof txp, "datasets/wikitext-2/wiki.valid.tokens")) {
        snprintf(cmd, sizeof cmd,
                 "%s intactkv --model %s --tokenizer %s --base %s --out %s --force --prefix bos --train --text %s --samples 3 "
                 "--seq-len 24 --accum 2 --steps 3 --lr 1e-2 --loss-csv %s",
                 bin, m0, tp, bp, out, txp, csv);
        int rc = run_cmd(cmd, buf, sizeof buf);
        ck_assert_msg(rc == 0, "'%s': exit %d\n%s", cmd, rc, buf);
        ck_assert_msg(strstr(buf, "against kivi2-g8-r16") && strstr(buf, "step 3/3 loss") && strstr(buf, "ETA") &&
                          strstr(buf, "training loss over all 3 windows") && strstr(buf, "trained prefix of 1 token"),
                      "%s", buf);
        ck_assert_msg(kvq_artifact_read(out, &r, &e) == KVQ_OK, "%s", e.msg);
        ck_assert(r.prefix && r.prefix->trained && r.prefix->n_loss == 3 && r.prefix->train.steps == 3 &&
                  r.prefix->train.accum == 2 && r.prefix->train.samples == 3 && r.prefix->train.seq_len == 24 &&
                  r.prefix->train.lr == 1e-2 && r.prefix->train.clip == 0.3);
        ck_assert_str_eq(r.prefix->train.scheme, "kivi2-g8-r16");
        FILE *f = fopen(csv, "r");
        ck_assert_ptr_nonnull(f);
        char line[256];
        int lines = 0;
        double l1 = 0;
        while (fgets(line, sizeof line, f)) {
            if (lines == 1) ck_assert(sscanf(line, "1,%lf,", &l1) == 1);
            lines++;
        }
        fclose(f);
        ck_assert_int_eq(lines, 4); /* header + 3 steps */
        ck_assert_msg(l1 == r.prefix->loss_curve[0] || fabs(l1 - r.prefix->loss_curve[0]) < 1e-8 * l1, "%.9g vs %.9g", l1,
                      r.prefix->loss_curve[0]);
        kvq_artifact_free(&r);
        unlink(csv);
        /* the training scheme derived from an fp8 base (the derivation had no fp8 case: "scheme
         * 'kivi8-g0-r0': group size ...", exit 1): a real fp8 artifact of this model, per head at
         * the 99.9th percentile */
        char kvdump[512], dump[512], fp8[512];
        if (kvq_test_bin(kvdump, sizeof kvdump, "kvdump")) {
            tmp_path(dump, sizeof dump, "cli_fp8.h5");
            tmp_path(fp8, sizeof fp8, "cli_fp8.st");
            snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s -n 2 -L 32 -o %s --force --quiet && %s %s --method fp8 --scale head "
                                      "--percentile 99.9 -o %s --force --quiet",
                     kvdump, m0, tp, txp, dump, bin, dump, fp8);
            ck_assert_msg(run_cmd(cmd, buf, sizeof buf) == 0, "'%s': %s", cmd, buf);
            snprintf(cmd, sizeof cmd,
                     "%s intactkv --model %s --tokenizer %s --base %s --out %s --force --prefix bos --train --text %s --samples 2 "
                     "--seq-len 16 --steps 1",
                     bin, m0, tp, fp8, out, txp);
            int frc = run_cmd(cmd, buf, sizeof buf);
            ck_assert_msg(frc == 0 && strstr(buf, "against fp8-head-p99.9") && strstr(buf, "trained prefix of 1 token"), "'%s': exit %d\n%s",
                          cmd, frc, buf);
            unlink(dump);
            unlink(fp8);
        }
        /* a training scheme must not itself carry +intactkv; a bad scheme is named */
        snprintf(cmd, sizeof cmd,
                 "%s intactkv --model %s --tokenizer %s --base %s --out %s --force --prefix bos --train --text %s --samples 2 "
                 "--seq-len 16 --steps 1 --scheme kivi2-g8-r16+intactkv",
                 bin, m0, tp, bp, out, txp);
        ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
        ck_assert_msg(strstr(buf, "+intactkv is what is being trained"), "%s", buf);
        snprintf(cmd, sizeof cmd,
                 "%s intactkv --model %s --tokenizer %s --base %s --out %s --force --prefix bos --train --text %s --scheme nuq3",
                 bin, m0, tp, bp, out, txp);
        ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 1);
        ck_assert_msg(strstr(buf, "nuq3") && strstr(buf, "artifact"), "%s", buf);
    }
    /* --inspect shows it */
    snprintf(cmd, sizeof cmd, "%s --inspect %s", bin, out);
    ck_assert_int_eq(run_cmd(cmd, buf, sizeof buf), 0);
    ck_assert_msg(strstr(buf, "intactkv      prefix of 1 token") && strstr(buf, "bos"), "%s", buf);
    unlink(bp);
    unlink(out);
    kvq_artifact_free(&base);
    kvq_model_free(&m);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("intactkv");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_compute_matches_forward, 0, 2);
    tcase_add_loop_test(tc, test_prefix_equals_one_sequence, 0, 2);
    tcase_add_loop_test(tc, test_kveval_prefix, 0, 2);
    tcase_add_test(tc, test_artifact_roundtrip);
    tcase_add_test(tc, test_tokenize);
    tcase_add_test(tc, test_cli);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
