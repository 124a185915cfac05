/* capture.c — see capture.h. */
#include "capture.h"
#include "version.h"
#include "half.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backward.h"
#include "cuda_info.h"
#include "device.h"
#include "forward.h"
#include "model.h"
#include "progress.h"
#include "tokenizer.h"


kvq_capture_opts kvq_capture_opts_default(void)
{
    kvq_capture_opts o = {0};
    o.format = KVQ_TEXT_RAW;
    o.samples = 16;
    o.seq_len = 0; /* min(2048, context) */
    o.seed = 0;
    o.layer_first = -1;
    o.layer_last = -1;
    o.dtype = KVQ_DUMP_F16;
    o.deflate = KVQ_DUMP_DEFLATE_DEFAULT;
    o.write_behind = -1;
    return o;
}

/* One sample's captured tensors for layers [first, last]. With an f16 dump the
 * keys, values and queries wait for the backward pass (and the writer) as the
 * f16 the dump stores (h16: half the memory; the f16 -> f32 -> f16 round trip
 * through the writer is exact, and the range check the writer would make is
 * made at capture, with its message); Fisher and attention statistics stay f32. */
typedef struct {
    int first, last, L, kv_dim, q_dim, n_heads;
    bool want_q, want_attn;
    float *k_pre, *k, *v, *q;           /* [n][L][kv_dim] (q: [n][L][q_dim]); NULL with h16 */
    uint16_t *h16;                      /* f16 dump: [n][3 L kv_dim (+ L q_dim)]: k_pre, k, v (, q) of each layer */
    float *attn_recv, *attn_ent;        /* [n][n_heads][L] */
    float *fisher_k, *fisher_v;         /* [n][L][kv_dim] */
    float *arena;
    const kvq_dump_meta *meta;          /* for the range check's message (h16) */
    int64_t sample;                     /* the sample being captured (h16 messages) */
    /* direct (CPU, no write-behind, with --fisher): each layer is written from the grads callback as soon as its
     * Fisher information exists, so no sample-sized Fisher buffer is held (fisher_k/v NULL); fk1/fv1/wide: one
     * layer's Fisher and widened f16 tensors */
    kvq_dump_writer *direct;
    float *fk1, *fv1, *wide;
    double write_s; /* direct: seconds spent writing during the current sample's backward */
} capture_buf;

static size_t h16_per_layer(const capture_buf *b)
{
    return (size_t)b->L * (3 * (size_t)b->kv_dim + (b->want_q ? (size_t)b->q_dim : 0));
}

static float *slot(float *base, int idx, size_t per) { return base ? base + (size_t)idx * per : NULL; }

static kvq_status buf_init(capture_buf *b, const kvq_hparams *hp, int first, int last, int L, bool q, bool attn,
                           bool fisher, bool f16, kvq_dump_writer *direct, kvq_err *err)
{
    memset(b, 0, sizeof *b);
    b->first = first;
    b->last = last;
    b->L = L;
    b->kv_dim = kvq_kv_dim(hp);
    b->q_dim = kvq_q_dim(hp);
    b->n_heads = hp->n_heads;
    b->want_q = q;
    b->want_attn = attn;
    size_t n = (size_t)(last - first + 1), kv = (size_t)L * b->kv_dim, qd = (size_t)L * b->q_dim, at = (size_t)hp->n_heads * L;
    size_t n16 = f16 ? n * (3 * kv + (q ? qd : 0)) : 0; /* uint16 elements, carved after the floats */
    bool dfish = fisher && direct;                      /* one layer's Fisher (and widened tensors) instead of the sample's */
    size_t one = dfish ? 2 * kv + (f16 ? 3 * kv + (q ? qd : 0) : 0) : 0;
    size_t total = n * ((f16 ? 0 : 3 * kv + (q ? qd : 0)) + (attn ? 2 * at : 0) + (fisher && !dfish ? 2 * kv : 0)) + one +
                   (n16 + 1) / 2;
    b->arena = malloc(total * sizeof(float) + 16);
    if (!b->arena)
        return kvq_fail(err, KVQ_ENOMEM, "cannot allocate %.1f MiB for one sample's captured tensors (try --seq-len or --layers)",
                        total * 4.0 / (1 << 20));
    float *p = b->arena;
    if (!f16) {
        b->k_pre = p; p += n * kv;
        b->k = p; p += n * kv;
        b->v = p; p += n * kv;
        if (q) { b->q = p; p += n * qd; }
    }
    if (attn) { b->attn_recv = p; p += n * at; b->attn_ent = p; p += n * at; }
    if (fisher && !dfish) { b->fisher_k = p; p += n * kv; b->fisher_v = p; p += n * kv; }
    if (dfish) {
        b->direct = direct;
        b->fk1 = p; p += kv;
        b->fv1 = p; p += kv;
        if (f16) { b->wide = p; p += 3 * kv + (q ? qd : 0); }
    }
    if (f16) b->h16 = (uint16_t *)p;
    return KVQ_OK;
}

/* forward observe hook: copy the layer's tensors into the sample buffer */
static kvq_status observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    capture_buf *b = user;
    /* NaN/Inf anywhere in the layer's K/V/Q is reported where it arises */
    const struct { const float *x; int heads; const char *name; } chk[] = {
        {obs->k_pre, ctx->n_kv_heads, "pre-RoPE key"}, {obs->v, ctx->n_kv_heads, "value"}, {obs->q, ctx->n_heads, "query"}};
    for (size_t c = 0; c < sizeof chk / sizeof *chk; c++) {
        size_t row, col;
        size_t width = (size_t)chk[c].heads * ctx->head_dim;
        if (kvq_dump_find_bad(chk[c].x, (size_t)ctx->T, width, 0, &row, &col))
            return kvq_fail(err, KVQ_ENUMERIC, "position %zu, head %zu, channel %zu: %s is %g (not finite)",
                            (size_t)ctx->pos0 + row, col / ctx->head_dim, col % ctx->head_dim, chk[c].name,
                            (double)chk[c].x[row * width + col]);
    }
    if (ctx->layer < b->first || ctx->layer > b->last) return KVQ_OK;
    int i = ctx->layer - b->first;
    size_t kv = (size_t)b->L * b->kv_dim;
    if (b->h16) { /* f16 dump: the writer's range check now, then store what it would store */
        const struct { kvq_dump_ds ds; const float *x; size_t n; } t[] = {
            {KVQ_DUMP_K_PRE_ROPE, obs->k_pre, kv}, {KVQ_DUMP_K, obs->k_post, kv}, {KVQ_DUMP_V, obs->v, kv},
            {KVQ_DUMP_Q, obs->q, (size_t)b->L * b->q_dim}};
        uint16_t *h = b->h16 + (size_t)i * h16_per_layer(b);
        for (int k = 0; k < (b->want_q ? 4 : 3); k++) {
            KVQ_TRY(kvq_dump_check_values(b->meta, t[k].ds, t[k].x, ctx->layer, b->sample, KVQ_DUMP_F16_MAX, err));
            for (size_t e = 0; e < t[k].n; e++) h[e] = kvq_f32_to_f16(t[k].x[e]);
            h += t[k].n;
        }
    } else {
    memcpy(slot(b->k_pre, i, kv), obs->k_pre, kv * sizeof(float));
    memcpy(slot(b->k, i, kv), obs->k_post, kv * sizeof(float));
    memcpy(slot(b->v, i, kv), obs->v, kv * sizeof(float));
    if (b->want_q) memcpy(slot(b->q, i, (size_t)b->L * b->q_dim), obs->q, (size_t)b->L * b->q_dim * sizeof(float));
    }
    if (b->want_attn) {
        size_t at = (size_t)b->n_heads * b->L;
        memcpy(slot(b->attn_recv, i, at), obs->attn_mass, at * sizeof(float));
        memcpy(slot(b->attn_ent, i, at), obs->attn_entropy, at * sizeof(float));
    }
    return KVQ_OK;
}

/* Write one captured sample (every layer, then the commit that makes it count). */
/* Layer l's data for the writer (the f16 tensors widened into wide, exact). */
static kvq_dump_layer_data layer_data(const capture_buf *b, int l, float *wide)
{
    const int i = l - b->first;
    const size_t kv = (size_t)b->L * b->kv_dim, at = (size_t)b->n_heads * b->L;
    kvq_dump_layer_data d = {
        .k_pre_rope = slot(b->k_pre, i, kv), .k = slot(b->k, i, kv), .v = slot(b->v, i, kv),
        .q = slot(b->q, i, (size_t)b->L * b->q_dim),
        .fisher_k_pre_rope = slot(b->fisher_k, i, kv), .fisher_v = slot(b->fisher_v, i, kv),
        .attn_received = slot(b->attn_recv, i, at), .attn_entropy = slot(b->attn_ent, i, at)};
    if (b->h16) {
        const size_t per = h16_per_layer(b);
        const uint16_t *h = b->h16 + (size_t)i * per;
        for (size_t e = 0; e < per; e++) wide[e] = kvq_f16_to_f32(h[e]);
        d.k_pre_rope = wide;
        d.k = wide + kv;
        d.v = wide + 2 * kv;
        d.q = b->want_q ? wide + 3 * kv : NULL;
    }
    return d;
}

/* Write one captured sample (every layer, then the commit that makes it count); in direct mode the
 * layers were written by the grads callback already. */
static kvq_status write_sample(kvq_dump_writer *w, const capture_buf *b, int64_t smp, const int32_t *ids, kvq_err *err)
{
    const size_t per = b->h16 ? h16_per_layer(b) : 0;
    kvq_status s = KVQ_OK;
    if (!b->direct) {
        float *wide = per ? malloc(per * sizeof *wide) : NULL;
        if (per && !wide) return kvq_fail(err, KVQ_ENOMEM, "out of memory");
        for (int l = b->first; l <= b->last && !s; l++) {
            kvq_dump_layer_data d = layer_data(b, l, wide);
            s = kvq_dump_write_layer(w, smp, l, &d, err);
        }
        free(wide);
    }
    if (s) return s;
    return kvq_dump_commit_sample(w, smp, ids, err);
}

/* Background HDF5 writer (GPU runs): the sample just computed is written and
 * committed by this thread while the GPU computes the next one into the other
 * buffer. Only this thread calls HDF5 while a job runs (serial HDF5 needs no
 * concurrent calls); the main thread waits for it before touching the dump. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    bool started, busy, quit;
    kvq_dump_writer *w;
    const capture_buf *buf; /* job */
    int64_t smp;
    int32_t *ids;           /* [L], the job's token ids */
    kvq_status status;      /* first failure */
    kvq_err err;
    double seconds;         /* time spent writing */
    int64_t written;        /* samples committed */
} bg_writer;

static void *bg_main(void *arg)
{
    bg_writer *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->busy && !b->quit) pthread_cond_wait(&b->cv, &b->mu);
        if (!b->busy) break;
        pthread_mutex_unlock(&b->mu);
        kvq_err e = {0};
        double t0 = kvq_now();
        kvq_status s = write_sample(b->w, b->buf, b->smp, b->ids, &e);
        double dt = kvq_now() - t0;
        pthread_mutex_lock(&b->mu);
        b->seconds += dt;
        if (s && !b->status) {
            b->status = s;
            b->err = e;
            kvq_err_prefix(&b->err, "sample %lld", (long long)b->smp);
        }
        if (!s) b->written++;
        b->busy = false;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static kvq_status bg_start(bg_writer *b, kvq_dump_writer *w, int L, kvq_err *err)
{
    memset(b, 0, sizeof *b);
    b->w = w;
    b->ids = malloc(sizeof(int32_t) * (size_t)L);
    if (!b->ids) return kvq_fail(err, KVQ_ENOMEM, "out of memory");
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    if (pthread_create(&b->th, NULL, bg_main, b)) {
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->cv);
        free(b->ids);
        b->ids = NULL;
        return kvq_fail(err, KVQ_EIO, "cannot start the HDF5 writer thread");
    }
    b->started = true;
    return KVQ_OK;
}

/* Wait until the writer is idle; its first failure (if any) is returned. */
static kvq_status bg_wait(bg_writer *b, kvq_err *err)
{
    pthread_mutex_lock(&b->mu);
    while (b->busy) pthread_cond_wait(&b->cv, &b->mu);
    kvq_status s = b->status;
    if (s) *err = b->err;
    pthread_mutex_unlock(&b->mu);
    return s;
}

static kvq_status bg_submit(bg_writer *b, const capture_buf *buf, int64_t smp, const int32_t *ids, int L, kvq_err *err)
{
    KVQ_TRY(bg_wait(b, err));
    pthread_mutex_lock(&b->mu);
    memcpy(b->ids, ids, sizeof(int32_t) * (size_t)L);
    b->buf = buf;
    b->smp = smp;
    b->busy = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return KVQ_OK;
}

static void bg_stop(bg_writer *b)
{
    if (!b->started) return;
    pthread_mutex_lock(&b->mu);
    b->quit = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->th, NULL);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b->ids);
    b->started = false;
}

/* backward grads hook: Fisher information = element-wise squared gradient */
static kvq_status fisher_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    capture_buf *b = user;
    if (g->layer < b->first || g->layer > b->last) return KVQ_OK;
    size_t kv = (size_t)b->L * b->kv_dim;
    float *fk = b->direct ? b->fk1 : slot(b->fisher_k, g->layer - b->first, kv);
    float *fv = b->direct ? b->fv1 : slot(b->fisher_v, g->layer - b->first, kv);
    for (size_t i = 0; i < kv; i++) {
        fk[i] = g->dk_pre[i] * g->dk_pre[i];
        fv[i] = g->dv[i] * g->dv[i];
    }
    if (!b->direct) return KVQ_OK;
    /* direct: the layer goes to the dump now (any layer order within a sample; the commit counts it) */
    double t0 = kvq_now();
    kvq_dump_layer_data d = layer_data(b, g->layer, b->wide);
    d.fisher_k_pre_rope = fk;
    d.fisher_v = fv;
    kvq_status s = kvq_dump_write_layer(b->direct, b->sample, g->layer, &d, err);
    b->write_s += kvq_now() - t0;
    return s;
}

static bool stopped(const kvq_capture_opts *o) { return o->stop && *o->stop; }

kvq_status kvq_capture_run(const kvq_capture_opts *o, kvq_capture_report *rep, kvq_err *err)
{
    memset(rep, 0, sizeof *rep);
    double t_start = kvq_now();
    if (o->samples < 1) return kvq_fail(err, KVQ_EINVAL, "--samples: expected >= 1, found %lld", (long long)o->samples);
    if (o->seq_len != 0 && o->seq_len < 2) return kvq_fail(err, KVQ_EINVAL, "--seq-len: expected >= 2, found %lld", (long long)o->seq_len);
    kvq_device dev;
    int gpu = 0;
    const char *dv = o->device ? o->device : "cpu";
    if (o->n_gpus > 1) dv = "cuda";
    KVQ_TRY(kvq_device_parse(dv, &dev, &gpu, err));
    if (!strcmp(dv, "auto") && dev == KVQ_DEVICE_CPU && kvq_cuda_compiled() && !o->quiet) {
        char why[256] = "";
        kvq_cuda_device_count(why, sizeof why);
        fprintf(stderr, "kvdump: --device auto: no usable GPU (%s); running on the CPU\n", why);
    }

    kvq_model m;
    kvq_load_opts lo = {.weights = o->weights};
    kvq_status s = kvq_model_load_opts(o->model_path, &lo, &m, err);
    if (s) return s;
    if (!o->quiet) fprintf(stderr, "kvdump: weights: %s\n", m.weights_desc);
    kvq_tokenizer *tok = NULL;
    kvq_text txt = {0};
    kvq_windows win = {0};
    kvq_engine eng;
    bool have_eng = false;
    capture_buf bufs[2] = {{0}, {0}};
    bg_writer bg = {0};
    kvq_dump_writer *w = NULL;
    kvq_dump_meta meta;
    memset(&meta, 0, sizeof meta);
    const kvq_hparams *hp = &m.hp;

    int64_t seq_len = o->seq_len ? o->seq_len : (hp->ctx_len < 2048 ? hp->ctx_len : 2048);
    if (seq_len > hp->ctx_len) {
        s = kvq_fail(err, KVQ_EINVAL, "--seq-len %lld exceeds the model's context length %d (%s)", (long long)o->seq_len,
                     hp->ctx_len, o->model_path);
        goto done;
    }
    int first = o->layer_first < 0 ? 0 : o->layer_first;
    int last = o->layer_last < 0 ? hp->n_layers - 1 : o->layer_last;
    if (first > last || last >= hp->n_layers) {
        s = kvq_fail(err, KVQ_EINVAL, "--layers %d-%d: expected a range inside 0-%d (the model has %d layers)", first, last,
                     hp->n_layers - 1, hp->n_layers);
        goto done;
    }
    /* --tokenizer FILE, else the GGUF itself or the HF checkpoint's tokenizer.json; llama2.c: error */
    if ((s = kvq_tokenizer_for_model(o->model_path, o->tokenizer_path, &tok, err))) goto done;
    /* (as kveval: else the first sample fails on an out-of-range id) */
    if ((s = kvq_tokenizer_check_vocab(tok, m.hp.vocab_size, o->tokenizer_path ? o->tokenizer_path : o->model_path, err))) goto done;
    if ((s = kvq_text_read(o->text_path, o->format, KVQ_EOL_TO_LF, &txt, err))) goto done;
    if (txt.bad_bytes && !o->quiet)
        fprintf(stderr, "kvdump: warning: %s: %zu byte%s NUL or invalid UTF-8 (the first at offset %llu); tokenised as byte tokens\n",
                o->text_path, txt.bad_bytes, txt.bad_bytes == 1 ? " is" : "s are", (unsigned long long)txt.first_bad);
    if ((s = kvq_calib_windows(&txt, tok, (size_t)o->samples, (size_t)seq_len, o->seed, KVQ_BOS_MODEL, &win, err))) goto done;

    int L = (int)seq_len;
    /* --fisher: the engine also runs the backward pass (CPU or GPU) */
    char note[320];
    note[0] = 0;
    if (o->n_gpus > 1) {
        char plan[2048];
        s = kvq_engine_init_pipe(&eng, o->gpus, o->n_gpus, o->math, &m, L, 0, o->fisher ? KVQ_ENGINE_BACKWARD : 0, plan, sizeof plan,
                                 err);
        for (char *ln = plan, *nx; !s && !o->quiet && ln && *ln; ln = nx) { /* one "kvdump: stage ..." line per stage */
            nx = strchr(ln, '\n');
            if (nx) *nx++ = 0;
            fprintf(stderr, "kvdump: %s\n", ln);
        }
    } else {
        s = kvq_engine_init_fallback(&eng, dev, !strcmp(dv, "auto"), gpu, o->math, &m, L, 0, o->fisher ? KVQ_ENGINE_BACKWARD : 0,
                                     note, sizeof note, err);
    }
    have_eng = s == KVQ_OK;
    if (s) goto done;
    if (note[0] && !o->quiet) fprintf(stderr, "kvdump: --device auto: %s\n", note);
    if (eng.dev == KVQ_DEVICE_CPU && o->math != KVQ_CUDA_EXACT && !o->quiet)
        fprintf(stderr, "kvdump: --math applies to the GPU only; the CPU runs exact fp32\n");
    dev = eng.dev;
    {
        char d[200];
        snprintf(rep->device, sizeof rep->device, "%s%s", kvq_engine_describe(&eng, d, sizeof d),
                 o->fisher ? "; with the backward pass (Fisher information)" : "");
    }
    if (!o->quiet) fprintf(stderr, "kvdump: device: %s\n", rep->device);
    /* root attributes */
    snprintf(meta.kvq_version, sizeof meta.kvq_version, "%s", KVQ_VERSION);
    snprintf(meta.model_path, sizeof meta.model_path, "%s", o->model_path);
    if ((s = kvq_sha256_path(o->model_path, meta.model_sha256, err))) goto done;
    snprintf(meta.model_arch, sizeof meta.model_arch, "llama");
    kvq_dump_meta_set_hparams(&meta, hp);
    snprintf(meta.tokenizer, sizeof meta.tokenizer, "%s", kvq_tokenizer_describe(tok));
    snprintf(meta.corpus_path, sizeof meta.corpus_path, "%s", o->text_path);
    memcpy(meta.corpus_sha256, txt.file_sha256, sizeof meta.corpus_sha256);
    snprintf(meta.corpus_format, sizeof meta.corpus_format, "%s", kvq_text_format_name(o->format));
    snprintf(meta.bos_policy, sizeof meta.bos_policy, "%s", win.bos ? "stream-start (kvquant stream: BOS once at the start of the tokenised corpus)" : "none");
    meta.n_samples = o->samples;
    meta.seq_len = seq_len;
    meta.seed = (int64_t)o->seed;
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)o->samples);
    if (!offs) { s = kvq_fail(err, KVQ_ENOMEM, "out of memory"); goto done; }
    for (int64_t i = 0; i < o->samples; i++) offs[i] = (int64_t)win.offsets[i];
    meta.sample_offsets = offs;
    meta.dtype = o->dtype;
    meta.has_q = o->q;
    meta.has_fisher = o->fisher;
    meta.has_attn_stats = o->attn_stats;
    meta.layer_first = first;
    meta.layer_last = last;
    snprintf(meta.command_line, sizeof meta.command_line, "%s", o->command_line ? o->command_line : "");
    /* how the tensors are computed: the math mode is compared on --resume, the device only recorded */
    snprintf(meta.compute_mode, sizeof meta.compute_mode, "%s",
             eng.dev == KVQ_DEVICE_CPU || o->math == KVQ_CUDA_EXACT ? "exact" : o->math == KVQ_CUDA_TF32 ? "tf32" : "bf16");
    kvq_engine_describe(&eng, meta.compute_device, sizeof meta.compute_device);

    kvq_dump_opts dopts = kvq_dump_opts_default();
    dopts.force = o->force;
    dopts.deflate_level = o->deflate;
    dopts.stop = o->stop;
    s = o->resume ? kvq_dump_resume(o->out_path, &meta, &dopts, &w, err) : kvq_dump_create(o->out_path, &meta, &dopts, &w, err);
    free(offs);
    meta.sample_offsets = NULL;
    if (s) goto done;
    if (m.layers[0].bk) { /* Qwen2's key biases, for kvstat (DUMP.md /k_bias) */
        size_t kvd = (size_t)kvq_kv_dim(hp), nl = (size_t)(last - first + 1);
        float *kb = malloc(nl * kvd * sizeof *kb);
        if (!kb) {
            s = kvq_fail(err, KVQ_ENOMEM, "kvdump: out of memory");
            goto done;
        }
        for (size_t j = 0; j < nl; j++) memcpy(kb + j * kvd, m.layers[first + (int)j].bk, kvd * sizeof *kb);
        s = kvq_dump_write_k_bias(w, kb, err);
        free(kb);
        if (s) goto done;
    }

    /* write-behind (default on a GPU): the HDF5 writing of sample i overlaps the computation of sample i+1 (two buffers) */
    const bool overlap = o->write_behind < 0 ? dev == KVQ_DEVICE_CUDA : o->write_behind > 0;
    rep->write_overlapped = overlap;
    const bool f16 = o->dtype == KVQ_DUMP_F16;
    /* without write-behind (the CPU default), --fisher writes each layer from the backward pass as it finishes */
    if ((s = buf_init(&bufs[0], hp, first, last, L, o->q, o->attn_stats, o->fisher, f16, overlap ? NULL : w, err))) goto done;
    if (overlap && (s = buf_init(&bufs[1], hp, first, last, L, o->q, o->attn_stats, o->fisher, f16, NULL, err))) goto done;
    bufs[0].meta = bufs[1].meta = kvq_dump_writer_meta(w);
    if (overlap && (s = bg_start(&bg, w, L, err))) goto done;

    kvq_hooks hooks = {0};
    hooks.observe = observe;
    hooks.attn_stats = o->attn_stats;
    int64_t start = kvq_dump_writer_samples_done(w);
    rep->samples_done = start;
    kvq_progress prog;
    kvq_progress_init(&prog, "kvdump", "tok", (uint64_t)(o->samples - start) * (uint64_t)L, o->quiet);
    if (!o->quiet && start > 0)
        fprintf(stderr, "kvdump: resuming %s.partial at sample %lld of %lld\n", o->out_path, (long long)start,
                (long long)o->samples);
    int *ids = malloc(sizeof(int) * (size_t)L);
    int32_t *ids32 = malloc(sizeof(int32_t) * (size_t)L);
    if (!ids || !ids32) { free(ids); free(ids32); s = kvq_fail(err, KVQ_ENOMEM, "out of memory"); goto done; }
    double loss_sum = 0;
    int cur = 0;
    bool interrupted = false;
    for (int64_t smp = start; smp < o->samples; smp++) {
        if (stopped(o)) { interrupted = true; break; }
        capture_buf *buf = &bufs[cur];
        buf->sample = smp;
        hooks.user = buf;
        for (int t = 0; t < L; t++) { ids32[t] = win.tokens[(size_t)smp * L + t]; ids[t] = ids32[t]; }
        kvq_fwd_io io = {0};
        io.tokens = ids;
        io.T = L;
        io.hooks = &hooks;
        double t0 = kvq_now(), loss;
        if (o->fisher) {
            /* Fisher information of the mean next-token cross-entropy of this sample */
            kvq_bwd_spec spec = {.user = buf, .xent = true, .grads = fisher_cb};
            kvq_bwd_result bres;
            s = kvq_engine_backward(&eng, &io, &spec, &bres, err);
            loss = bres.loss;
        } else {
            kvq_fwd_result res;
            s = kvq_engine_run(&eng, &io, &res, err);
            loss = res.loss;
        }
        if (s) { kvq_err_prefix(err, "sample %lld", (long long)smp); break; }
        double t1 = kvq_now();
        rep->seconds_forward += t1 - t0 - buf->write_s; /* direct mode: the layers written during the backward */
        rep->seconds_write += buf->write_s;
        buf->write_s = 0;
        loss_sum += loss;
        if (overlap) {
            /* hand the buffer to the writer (after it finished the previous sample) and compute into the other */
            s = bg_submit(&bg, buf, smp, ids32, L, err);
            if (s) break;
            cur ^= 1;
            rep->seconds_wait += kvq_now() - t1;
        } else {
            s = write_sample(w, buf, smp, ids32, err);
            rep->seconds_write += kvq_now() - t1;
            if (s) { kvq_err_prefix(err, "sample %lld", (long long)smp); break; }
            rep->samples_written++;
        }
        kvq_progress_update(&prog, (uint64_t)(smp + 1 - start) * (uint64_t)L);
    }
    if (overlap) {
        /* the last sample's write; a writer failure wins over a later compute failure */
        kvq_err e2 = {0};
        double t2 = kvq_now();
        kvq_status s2 = bg_wait(&bg, &e2);
        rep->seconds_wait += kvq_now() - t2;
        if (s2) {
            s = s2;
            *err = e2;
        }
        rep->samples_written = bg.written;
        rep->seconds_write = bg.seconds;
        bg_stop(&bg);
    }
    rep->samples_done = kvq_dump_writer_samples_done(w);
    if (!s && interrupted)
        s = kvq_fail(err, KVQ_EIO, "interrupted: %lld of %lld samples are in %s.partial (continue with --resume)",
                     (long long)rep->samples_done, (long long)o->samples, o->out_path);
    free(ids);
    free(ids32);
    if (!s) {
        kvq_progress_finish(&prog);
        s = kvq_dump_finish(w, err);
        w = NULL;
    }
    rep->mean_loss = rep->samples_written ? loss_sum / rep->samples_written : 0;
done:
    bg_stop(&bg); /* idle here; joined before the dump is closed */
    if (w) {
        kvq_err e2 = {0};
        int64_t committed = kvq_dump_writer_samples_done(w);
        kvq_dump_abort(w, &e2);
        /* a fresh dump that holds no sample is not worth resuming: remove it */
        if (committed == 0 && !o->resume) {
            char partial[KVQ_DUMP_PATH_MAX + 16];
            snprintf(partial, sizeof partial, "%s.partial", o->out_path);
            unlink(partial);
            /* the interruption's "(resume with --resume)" would point at the file just removed */
            if (stopped(o))
                s = kvq_fail(err, KVQ_EIO, "interrupted before the first of %lld samples was complete: nothing kept, nothing to resume (run again)",
                             (long long)o->samples);
        }
    }
    free(bufs[0].arena);
    free(bufs[1].arena);
    if (have_eng) kvq_engine_free(&eng);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    if (tok) kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    rep->seq_len = seq_len;
    rep->seconds_total = kvq_now() - t_start;
    return s;
}
