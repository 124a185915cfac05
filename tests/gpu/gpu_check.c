/* gpu_check.c — CPU vs CUDA forward comparison and GPU perplexity benchmark
 * (issue 10). Not part of `make test` (CI has no GPU); built by `make gpu-tests`
 * and run by scripts/gpu_check_bench.sh.
 *
 *   gpu_check --synthetic
 *       random-weight models (head_dim 64 and 128, GQA, a prefix, windows that
 *       are not tile multiples): CPU vs GPU for every built-in KV scheme, the
 *       host-transform path, the observe hook and the LM-head outputs of
 *       kveval's KL divergence (kvq_fwd_head: hidden, lse, top token,
 *       expectation) with the per-row KL of fp32 vs an int scheme; then --attn.
 *   gpu_check --attn
 *       the bf16 mode's tensor-core attention forward vs the fp32 kernel on
 *       random inputs (head_dim 64/128, T off the tiles, GQA, prefixes,
 *       windows): output relative L2 and max |dlse| under forward_cuda.h's
 *       bounds; the two kernels' times alone at a Llama-3-8B layer's shape.
 *   gpu_check --sched
 *       the attention-importance schedule (hh, mikv, zipcache) and the
 *       selection schedule (qaq) on the device (kernels/cuda/cuda_sched.cuh)
 *       vs kvq_attention_sched with the host steps on random data: decisions,
 *       counts, outputs (see gpu_check_sched.c); one SmolLM2-shaped layer
 *       timed per scheme. Also run by
 *       --synthetic.
 *   gpu_check --model M --text wiki.test.raw [--ctx 2048] [--check-windows 2]
 *             [--max-windows 0] [--no-bench] [--device cuda|cpu]
 *       the real model: logits/PPL CPU vs GPU on the first windows for every
 *       scheme, then kveval-style perplexity (kvquant protocol) over the whole
 *       text per scheme on the GPU: seconds, PPL, FLOP/s and the fraction of
 *       the cuBLAS SGEMM rate measured in the same run.
 *   gpu_check --backward
 *       the synthetic models again: CPU vs GPU backward pass (kvq_engine_backward)
 *       for fp32, KIVI-2 (boundaries), nuq4-1% (native) and nuq4 through the host
 *       hook, with the prefix gradients and an upstream-gradient term; attention
 *       statistics (mass, entropy) CPU vs GPU.
 *   gpu_check --pipeline
 *       the pipeline stages of issue 47 (gpu_check_pipeline.c): two stage workspaces on one GPU against the
 *       whole model, forward and backward, bit for bit; with two GPUs and NCCL the kvq_pipe_cuda driver.
 *   gpu_check --families [DIR]
 *       the model families of tests/test_families.c (DIR, default
 *       tests/fixtures: hf-<name> HF checkpoints and their GGUF conversions:
 *       Llama-3.1 llama3 RoPE, YaRN, dynamic NTK, linear, Qwen2 biases, Qwen3
 *       q/k norms and decoupled head_dim, Mistral's sliding window), each in
 *       exact and native weights: GPU logits vs the CPU (<= 1e-5 relative L2)
 *       and vs transformers' float32 reference (ref.bin, <= 1e-4); the
 *       backward pass (loss, dK pre/post-RoPE, dV, Fisher, prefix and input
 *       embedding gradients, <= 1e-4) and the attention statistics CPU vs GPU
 *       with a 3-token prefix; then synthetic models with every new part at a
 *       size where the kernels tile (head_dim 64/128, q/k/v/o biases, q/k
 *       norms, sliding windows of 40 and 100 over 300 tokens after a prefix,
 *       YaRN RoPE, bf16 weights held on the host).
 *   gpu_check --decode [--model M --artifact A --scheme S --text T [--steps 256] [--prompt-len 64] [--prompts 3]]
 *       real greedy decoding on the packed KV cache (kernels/decode/decode.h), GPU (kvq_kvcache_cuda, the CUDA
 *       forward's attend hook) vs CPU, batch 1 and batch 3: tokens equal per prompt, the first step's logits, tokens/s
 *       on each device (gpu_check_decode.c); without --model on the tiny models with in-process nuq artifacts.
 *   gpu_check --model M --text T --fisher N
 *       Fisher information (squared dL/dK pre-RoPE and dL/dV of the mean
 *       cross-entropy) of N calibration windows of --ctx tokens, CPU vs GPU,
 *       relative L2 per layer (issue 10: <= 1e-3), and the attention statistics.
 * int-pc / nuq tables are SYNTHETIC here (per-channel 0.5%/99.5% percentiles
 * of the pre-RoPE keys of window 0, power-law levels), not kvcalib artifacts:
 * they exercise the same kernels; the PPL of those rows is not a paper number.
 * Exit status: 0 when (a) the unquantized forward matches (logits relative
 * L2 <= 1e-5, PPL relative difference <= 1e-5), (b) the observe hook sees the
 * same K/V, and (c) every native GPU KV transform is bit-exact against the CPU
 * reference applied to the GPU's own K/V. CPU-vs-GPU numbers of quantized
 * schemes are printed for information only: a last-bit difference upstream
 * (summation order) moves some values across a rounding boundary, and those
 * flips cascade through a deep model.
 * This file: the scheme lists, the CPU-vs-GPU comparison and main; the checks are in gpu_check_synth.c
 * (--synthetic, --backward) and gpu_check_models.c (--families, --model), what they share in gpu_check.h.
 */
#include "gpu_check.h"
#include "gpu_check_sched.h"

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ---- schemes ------------------------------------------------------------------ */

/* ascending power-law levels in [-1, 1]: sign(u) |u|^1.5 on a uniform grid */
static void power_levels(float *lv, int bits)
{
    int n = 1 << bits;
    for (int i = 0; i < n; i++) {
        double u = -1.0 + 2.0 * i / (n - 1);
        lv[i] = (float)(u < 0 ? -pow(-u, 1.5) : pow(u, 1.5));
    }
}

kvq_status calib_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    calib_user *cu = user;
    synth_tables *st = cu->st;
    size_t T = (size_t)ctx->T, kvd = st->kvd;
    float *col = malloc(T * sizeof(float));
    if (!col) return kvq_fail(err, KVQ_ENOMEM, "calib: out of memory");
    for (size_t c = 0; c < kvd; c++) {
        for (size_t t = 0; t < T; t++) col[t] = obs->k_pre[t * kvd + c];
        float lo, hi;
        kvq_percentile_pair_f32(col, T, 0.995, &lo, &hi);
        st->lower[(size_t)ctx->layer * kvd + c] = lo;
        st->upper[(size_t)ctx->layer * kvd + c] = hi;
    }
    free(col);
    return KVQ_OK;
}

/* Synthetic family tables in artifacts of their own (the seam's kvq_kv_table.ft): wkvq's channel shift and
 * scale, cq's codebooks (4 channels per 6-bit code) with deterministic pseudo-random centroids, lowrank's
 * per-KV-head bases (groups of one head: a Householder reflection I - 2 u uᵀ, orthonormal rows) and
 * descending eigenvalues. */
static kvq_artifact *fam_tables(const kvq_hparams *hp)
{
    kvq_artifact *a = calloc(3, sizeof *a);
    if (!a) DIE("out of memory");
    size_t L = (size_t)hp->n_layers, kvd = (size_t)kvq_kv_dim(hp);
    uint32_t r = 12345;
    for (int w = 0; w < 2; w++) {
        a[w].p = (kvq_artifact_params){.method = KVQ_FAM(w ? "cq" : "wkvq"), .k_bits = w ? 6 : 4, .v_bits = w ? 6 : 4,
                                       .group_size = w ? 4 : 0, .n_layers = L, .n_kv_heads = (size_t)hp->n_kv_heads,
                                       .head_dim = (size_t)hp->head_dim};
        a[w].k = calloc(L, sizeof *a[w].k);
        a[w].v = calloc(L, sizeof *a[w].v);
        if (!a[w].k || !a[w].v) DIE("out of memory");
        for (size_t l = 0; l < L; l++)
            for (int side = 0; side < 2; side++) {
                kvq_kv_table *t = side ? &a[w].v[l] : &a[w].k[l];
                float *x;
                if (w) {
                    uint64_t sh[3] = {kvd / 4, 64, 4};
                    CHECK(kvq_kv_table_add(t, "codebook", 3, sh, &x, &e_));
                    for (size_t i = 0; i < kvd * 64; i++) {
                        r = r * 1664525u + 1013904223u;
                        x[i] = ((float)(r >> 8) / 16777216.0f - 0.5f) * (side ? 2.0f : 6.0f);
                    }
                } else {
                    uint64_t sh[1] = {kvd};
                    float *y;
                    CHECK(kvq_kv_table_add(t, "shift", 1, sh, &x, &e_));
                    CHECK(kvq_kv_table_add(t, "scale", 1, sh, &y, &e_));
                    for (size_t c = 0; c < kvd; c++) {
                        x[c] = 0.1f * (float)sin((double)c + (double)l);
                        y[c] = 1.0f + 0.5f * (float)cos((double)c);
                    }
                }
            }
    }
    size_t hd = (size_t)hp->head_dim, nh = (size_t)hp->n_kv_heads;
    a[2].p = (kvq_artifact_params){.method = KVQ_FAM("lowrank"), .k_bits = 8, .v_bits = 8, .group_size = 1, .post_rope = true,
                                   .n_layers = L, .n_kv_heads = nh, .head_dim = hd, .x = {90}};
    a[2].k = calloc(L, sizeof *a[2].k);
    a[2].v = calloc(L, sizeof *a[2].v);
    if (!a[2].k || !a[2].v) DIE("out of memory");
    for (size_t l = 0; l < L; l++)
        for (int side = 0; side < 2; side++) {
            kvq_kv_table *t = side ? &a[2].v[l] : &a[2].k[l];
            uint64_t sb[3] = {nh, hd, hd}, se[2] = {nh, hd};
            float *b, *ev;
            CHECK(kvq_kv_table_add(t, "basis", 3, sb, &b, &e_));
            CHECK(kvq_kv_table_add(t, "eigval", 2, se, &ev, &e_));
            for (size_t h = 0; h < nh; h++) {
                double u[512], n2 = 0;
                if (hd > 512) DIE("lowrank synthetic basis: head_dim %zu above 512", hd);
                for (size_t i = 0; i < hd; i++) {
                    u[i] = sin(1.0 + (double)(i + 3 * h + 7 * l + side));
                    n2 += u[i] * u[i];
                }
                for (size_t j = 0; j < hd; j++) {
                    ev[h * hd + j] = 1.0f / (float)(j + 1);
                    for (size_t i = 0; i < hd; i++) b[(h * hd + j) * hd + i] = (float)((i == j) - 2 * u[i] * u[j] / n2);
                }
            }
        }
    return a;
}

void synth_alloc(synth_tables *st, const kvq_hparams *hp, int bits)
{
    st->n_layers = hp->n_layers;
    st->kvd = (size_t)kvq_kv_dim(hp);
    st->lower = calloc((size_t)hp->n_layers * st->kvd, sizeof(float));
    st->upper = calloc((size_t)hp->n_layers * st->kvd, sizeof(float));
    st->k_levels = malloc(sizeof(float) << bits);
    st->v_levels = malloc(sizeof(float) << bits);
    st->lt = calloc((size_t)hp->n_layers, sizeof *st->lt);
    if (!st->lower || !st->upper || !st->k_levels || !st->v_levels || !st->lt) DIE("out of memory");
    power_levels(st->k_levels, bits);
    power_levels(st->v_levels, bits);
    for (int l = 0; l < hp->n_layers; l++) {
        st->lt[l].k_lower = st->lower + (size_t)l * st->kvd;
        st->lt[l].k_upper = st->upper + (size_t)l * st->kvd;
        st->lt[l].k_lut = (kvq_nuq_lut){.bits = bits, .n_tables = 1, .head_dim = (size_t)hp->head_dim, .levels = st->k_levels};
        st->lt[l].v_lut = (kvq_nuq_lut){.bits = bits, .n_tables = 1, .head_dim = (size_t)hp->head_dim, .levels = st->v_levels};
    }
    st->fam_art = fam_tables(hp);
}

void synth_free(synth_tables *st)
{
    free(st->lower);
    free(st->upper);
    free(st->k_levels);
    free(st->v_levels);
    free(st->lt);
    for (int w = 0; st->fam_art && w < 3; w++) kvq_artifact_free(&st->fam_art[w]);
    free(st->fam_art);
}

void add_scheme(scheme_list *L, const char *family, int bits, size_t group, size_t residual, double f, size_t sink,
                kvq_key_stage stage, const synth_tables *st, const char *suffix)
{
    if (L->n >= MAX_SCHEMES) DIE("scheme list full (MAX_SCHEMES %d)", MAX_SCHEMES);
    kvq_kv_desc *d = &L->d[L->n];
    const kvq_family *fam = KVQ_FAM(family);
    *d = (kvq_kv_desc){.q = {.fam = fam, .k_bits = bits, .v_bits = bits, .outlier_frac = f, .n_sink = sink, .group = group,
                             .residual = residual},
                       .key_stage = stage};
    if (fam == KVQ_FAM("int-pc") || fam == KVQ_FAM("nuq")) {
        d->layers = st->lt;
        d->n_layers = st->n_layers;
    }
    if (fam == KVQ_FAM("wkvq")) d->art = &st->fam_art[0];
    if (fam == KVQ_FAM("cq")) d->art = &st->fam_art[1];
    if (fam == KVQ_FAM("lowrank")) { /* groups of one KV head; `residual` is the rank, bits < 8 int coefficients, 8 fp16 */
        d->art = &st->fam_art[2];
        d->q.variant = 0;
        d->q.x[0] = (double)residual;
        d->q.x[1] = bits < 8 ? bits : 0;
        d->q.residual = 0;
    }
    kvq_kv_desc_name(d, L->name[L->n], sizeof L->name[L->n]);
    if (suffix) strncat(L->name[L->n], suffix, sizeof L->name[L->n] - strlen(L->name[L->n]) - 1);
    L->n++;
}

/* a family with sub-formats (kvq_scheme.variant): NVFP4 with unit per-tensor scales, OCP MXFP4, SGLang's
 * fp4_mx_block16; no native CUDA transform: the GPU forward runs the family's host transform */
void add_variant(scheme_list *L, const char *family, int bits, int variant, size_t sink, const char *suffix)
{
    if (L->n >= MAX_SCHEMES) DIE("scheme list full (MAX_SCHEMES %d)", MAX_SCHEMES);
    kvq_kv_desc *d = &L->d[L->n];
    *d = (kvq_kv_desc){.q = {.fam = KVQ_FAM(family), .k_bits = bits, .v_bits = bits, .n_sink = sink, .variant = variant},
                       .key_stage = KVQ_KEYS_POST_ROPE};
    kvq_kv_desc_name(d, L->name[L->n], sizeof L->name[L->n]);
    if (suffix) strncat(L->name[L->n], suffix, sizeof L->name[L->n] - strlen(L->name[L->n]) - 1);
    L->n++;
}

void default_schemes(scheme_list *L, const synth_tables *st, int hd, int sink, size_t kivi2_r)
{
    L->n = 0;
    add_scheme(L, "fp32", 0, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "fp16", 0, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "int", 4, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "int", 2, (size_t)hd, 0, 0, (size_t)sink, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "kivi", 4, 32 <= hd ? 32 : (size_t)hd, 128, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    if (kivi2_r == 128) /* the model run: KIVI as published (post-RoPE keys, no sink) */
        add_scheme(L, "kivi", 2, 32, 128, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    else /* synthetic: the pre-RoPE and sink paths too */
        add_scheme(L, "kivi", 2, 32 <= hd ? 32 : (size_t)hd, kivi2_r, 0, (size_t)sink, KVQ_KEYS_PRE_ROPE, st, "+pre-rope");
    add_scheme(L, "int-pc", 4, 0, 0, 0.01, 0, KVQ_KEYS_PRE_ROPE, st, " (synthetic tables)");
    /* values in per-token groups of 16 channels (kvcalib --method int-pc --group 16) */
    add_scheme(L, "int-pc", 4, 16, 0, 0.01, 0, KVQ_KEYS_PRE_ROPE, st, " value groups of 16 (synthetic tables)");
    add_scheme(L, "nuq", 4, 0, 0, 0.01, (size_t)sink, KVQ_KEYS_PRE_ROPE, st, " (synthetic tables)");
    add_scheme(L, "nuq", 3, 0, 0, 0, 0, KVQ_KEYS_PRE_ROPE, st, " (synthetic tables)");
    /* FP4 block formats where head_dim is a multiple of the block (host transform) */
    if (hd % 16 == 0) {
        add_variant(L, "nvfp4", 4, KVQ_FP4_NVFP4, 0, " (host)");
        add_variant(L, "mxfp4", 4, KVQ_FP4_MX16_SGL, (size_t)sink, " (host)");
    }
    if (hd % 32 == 0) add_variant(L, "mxfp4", 4, KVQ_FP4_MXFP4, 0, " (host)");
    /* rotated (+hadamard / +rht): no native transform, the GPU runs the host path (kvq_kv_desc_cuda); kept last so
     * that the indices above stay what the callers use */
    add_scheme(L, "int", 4, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    rotate_last(L, (kvq_rotation){KVQ_ROT_HADAMARD, 0});
    add_scheme(L, "nuq", 4, 0, 0, 0.01, (size_t)sink, KVQ_KEYS_PRE_ROPE, st, NULL);
    rotate_last(L, (kvq_rotation){KVQ_ROT_RHT, 7});
    strncat(L->name[L->n - 1], " (synthetic tables)", sizeof L->name[L->n - 1] - strlen(L->name[L->n - 1]) - 1);
    /* vLLM's per-token-head caches (kernels/quant/quant_pth.h): no CUDA part, the host path */
    add_scheme(L, "int8-pth", 8, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "int4-pth", 4, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    add_scheme(L, "fp8-pth", 8, 0, 0, 0, (size_t)sink, KVQ_KEYS_POST_ROPE, st, NULL);
    /* vLLM's turboquant_k3v4_nc with one boundary layer each side (the synthetic models have 2-3 layers) */
    add_scheme(L, "turboquant", 4, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, st, NULL);
    L->d[L->n - 1].q.k_bits = 3;
    L->d[L->n - 1].q.x[0] = 1;
    kvq_kv_desc_name(&L->d[L->n - 1], L->name[L->n - 1], sizeof L->name[L->n - 1]);
    add_scheme(L, "wkvq", 4, 0, 0, 0, (size_t)sink, KVQ_KEYS_POST_ROPE, st, " (synthetic tables, host)");
    add_scheme(L, "cq", 6, 4, 0, 0, 0, KVQ_KEYS_PRE_ROPE, st, " (synthetic tables, host)");
    add_scheme(L, "lowrank", 8, 1, (size_t)(hd / 2 ? hd / 2 : 1), 0, 0, KVQ_KEYS_POST_ROPE, st, " (synthetic tables, host)");
    add_scheme(L, "lowrank", 4, 1, (size_t)(hd / 4 ? hd / 4 : 1), 0, (size_t)sink, KVQ_KEYS_POST_ROPE, st, " (synthetic tables, host)");
}

void rotate_last(scheme_list *L, kvq_rotation r)
{
    kvq_kv_desc *d = &L->d[L->n - 1];
    d->rot = r;
    kvq_kv_desc_name(d, L->name[L->n - 1], sizeof L->name[L->n - 1]);
}

int gpu_native(const kvq_kv_desc *d) { return kvq_kv_desc_is_identity(d) || kvq_kv_desc_cuda(d) != NULL; }

/* the 3-bit nuq row needs 3-bit levels: a second table set */
void fix_bits(scheme_list *L, synth_tables *st3)
{
    for (int i = 0; i < L->n; i++)
        if (L->d[i].q.fam == KVQ_FAM("nuq") && L->d[i].q.k_bits == 3) L->d[i].layers = st3->lt;
}

/* ---- comparison ------------------------------------------------------------- */

kvq_status rec_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    obs_rec *r = user;
    r->calls++;
    if (ctx->layer == r->layer) {
        memcpy(r->k, obs->k_att, r->n * sizeof(float));
        memcpy(r->v, obs->v_att, r->n * sizeof(float));
    }
    return KVQ_OK;
}

/* Bit-exactness of the GPU's native transforms: during a GPU run with a
 * descriptor set, the observe hook receives the GPU's own pre-transform K/V
 * (k_pre / k_post / v) and what attention used (k_att / v_att / alt); the CPU
 * reference (kvq_kv_desc_transform, then RoPE for pre-RoPE schemes) is applied
 * to the same inputs and every element compared bit for bit. */
typedef struct {
    const kvq_kv_desc *d;
    const kvq_hparams *hp;
    float *k, *v, *ka, *va, *cs, *sn;
    int *kb, *vb;
    long compared, mismatches;
    double max_abs;
} bx_user;

static void bx_cmp(bx_user *u, const float *want, const float *got, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t a, b;
        memcpy(&a, &want[i], 4);
        memcpy(&b, &got[i], 4);
        u->compared++;
        if (a != b) {
            u->mismatches++;
            double dd = fabs((double)want[i] - got[i]);
            if (dd > u->max_abs) u->max_abs = dd;
        }
    }
}

static kvq_status bx_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    bx_user *u = user;
    const kvq_hparams *hp = u->hp;
    size_t T = (size_t)ctx->T, n = T * (size_t)kvq_kv_dim(hp);
    bool pre = u->d->key_stage == KVQ_KEYS_PRE_ROPE;
    memcpy(u->k, pre ? obs->k_pre : obs->k_post, n * 4);
    memcpy(u->v, obs->v, n * 4);
    kvq_kv_desc_run run = {.d = u->d};
    kvq_kv_alt alt = {u->ka, u->kb, false, u->va, u->vb, false, NULL};
    KVQ_TRY(kvq_kv_desc_transform(&run, ctx, u->k, u->v, &alt, err));
    if (pre) {
        kvq_rope_table(hp, ctx->pos0, ctx->T, u->cs, u->sn);
        kvq_rope_apply(u->k, ctx->T, hp->n_kv_heads, hp->head_dim, hp->rope_dim, u->cs, u->sn, 0);
        if (alt.use_k) kvq_rope_apply(u->ka, ctx->T, hp->n_kv_heads, hp->head_dim, hp->rope_dim, u->cs, u->sn, 0);
    }
    bx_cmp(u, u->k, obs->k_att, n);
    bx_cmp(u, u->v, obs->v_att, n);
    if (alt.use_k != (obs->k_alt != NULL) || alt.use_v != (obs->v_alt != NULL)) {
        u->mismatches += (long)n;
        return KVQ_OK;
    }
    if (alt.use_k) {
        bx_cmp(u, u->ka, obs->k_alt, n);
        for (size_t i = 0; i < T; i++) u->mismatches += u->kb[i] != obs->k_bound[i];
    }
    if (alt.use_v) {
        bx_cmp(u, u->va, obs->v_alt, n);
        for (size_t i = 0; i < T; i++) u->mismatches += u->vb[i] != obs->v_bound[i];
    }
    return KVQ_OK;
}

/* One window on the GPU engine per scheme with the bit-exact observer; one
 * line per scheme; returns 1 if every element of every layer matches. */
int bitexact_all(kvq_engine *gpu, const kvq_hparams *hp, const scheme_list *L, const int *tokens, int T,
                 const kvq_prefix *px)
{
    kvq_err err = {0};
    size_t n = (size_t)T * kvq_kv_dim(hp), half = hp->rope_dim / 2 ? hp->rope_dim / 2 : 1;
    bx_user u = {.hp = hp, .k = malloc(n * 4), .v = malloc(n * 4), .ka = malloc(n * 4), .va = malloc(n * 4),
                 .cs = malloc((size_t)T * half * 4), .sn = malloc((size_t)T * half * 4), .kb = malloc((size_t)T * sizeof(int)),
                 .vb = malloc((size_t)T * sizeof(int))};
    if (!u.k || !u.v || !u.ka || !u.va || !u.cs || !u.sn || !u.kb || !u.vb) DIE("out of memory");
    int ok = 1;
    printf("\nnative GPU transforms vs the CPU reference on the GPU's own K/V (every layer, bit for bit):\n\n");
    printf("| scheme | elements compared | mismatches | max abs diff | result |\n|---|---|---|---|---|\n");
    for (int i = 0; i < L->n; i++) {
        if (L->d[i].q.fam == KVQ_FAM("fp32") || !gpu_native(&L->d[i])) continue; /* rotated: host path, compared below */
        u.d = &L->d[i];
        u.compared = u.mismatches = 0;
        u.max_abs = 0;
        TRYE(kvq_engine_set_kv(gpu, &L->d[i], &err));
        kvq_hooks h = {.user = &u, .observe = bx_observe};
        kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = px ? px->P : 0, .prefix = px, .hooks = &h};
        kvq_fwd_result r;
        TRYE(kvq_engine_run(gpu, &io, &r, &err));
        int good = u.mismatches == 0 && u.compared > 0;
        printf("| %s | %ld | %ld | %.3g | %s |\n", L->name[i], u.compared, u.mismatches, u.max_abs, good ? "PASS" : "FAIL");
        ok &= good;
    }
    free(u.k), free(u.v), free(u.ka), free(u.va), free(u.cs), free(u.sn), free(u.kb), free(u.vb);
    return ok;
}

/* Run windows on both engines with logits; return the comparison. mode 0 = GPU native, 1 = GPU host transform. */
cmp_row compare(kvq_engine *cpu, kvq_engine *gpu, const kvq_kv_desc *d, const int32_t *tokens, int n_windows, int T,
                const kvq_prefix *px, int mode, float *lc, float *lg)
{
    kvq_err err = {0};
    const int V = cpu->cpu.m->hp.vocab_size;
    double nll_c = 0, nll_g = 0, num = 0, den = 0;
    long n_sc = 0;
    cmp_row r = {0};
    kvq_kv_desc_run hrun = {0};
    kvq_hooks hooks;
    TRYE(kvq_engine_set_kv(cpu, d, &err));
    if (mode == 0) {
        TRYE(kvq_engine_set_kv(gpu, d, &err));
    } else {
        TRYE(kvq_engine_set_kv(gpu, NULL, &err));
        kvq_kv_desc_hooks(&hrun, d, &hooks);
    }
    for (int w = 0; w < n_windows; w++) {
        int tok[T];
        for (int t = 0; t < T; t++) tok[t] = tokens[(size_t)w * T + t];
        kvq_fwd_io io = {.tokens = tok, .T = T, .pos0 = px ? px->P : 0, .prefix = px, .logits = lc};
        kvq_fwd_result rc, rg;
        double t0 = now_s();
        TRYE(kvq_engine_run(cpu, &io, &rc, &err));
        double t1 = now_s();
        io.logits = lg;
        if (mode == 1) io.hooks = &hooks;
        TRYE(kvq_engine_run(gpu, &io, &rg, &err));
        double t2 = now_s();
        r.sec_cpu += t1 - t0;
        r.sec_gpu += t2 - t1;
        for (size_t i = 0; i < (size_t)T * V; i++) {
            double dd = (double)lg[i] - lc[i];
            num += dd * dd;
            den += (double)lc[i] * lc[i];
        }
        nll_c += rc.loss * rc.n_scored;
        nll_g += rg.loss * rg.n_scored;
        n_sc += rc.n_scored;
    }
    kvq_kv_desc_run_free(&hrun);
    r.logit_rel = sqrt(num / den);
    r.ppl_cpu = exp(nll_c / n_sc);
    r.ppl_gpu = exp(nll_g / n_sc);
    r.ppl_rel = fabs(r.ppl_gpu - r.ppl_cpu) / r.ppl_cpu;
    return r;
}

/* exact: the unquantized scheme (tolerance 1e-5, counts for the exit status).
 * Quantized schemes are reported for information: a last-bit difference in
 * K/V (summation order) can move a value across a rounding boundary, and in a
 * deep model those flips cascade; their semantics are checked bit for bit by
 * bitexact_all instead. */
int report_row(const char *name, const char *path, cmp_row r, int exact)
{
    int ok = r.logit_rel <= 1e-5 && r.ppl_rel <= 1e-5;
    printf("| %-34s | %-11s | %.3e | %.6f | %.6f | %.2e | %6.2f | %6.3f | %s |\n", name, path, r.logit_rel, r.ppl_cpu, r.ppl_gpu,
           r.ppl_rel, r.sec_cpu, r.sec_gpu, exact ? (ok ? "PASS" : "FAIL") : "info");
    return exact ? ok : 1;
}

void header(void)
{
    printf("| scheme                             | GPU path    | logits rel L2 | PPL CPU | PPL GPU | PPL rel | CPU s | GPU s | result |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
}

int is_exact_scheme(const kvq_kv_desc *d) { return d->q.fam == KVQ_FAM("fp32"); }

int main(int argc, char **argv)
{
    const char *model = NULL, *text = NULL, *dev = "auto", *artifact = NULL, *scheme = NULL;
    int ctx = 2048, check_windows = 2, max_windows = 0, bench = 1, synthetic = 0, attn = 0, backward = 0, fisher = 0,
        sched = 0, pipeline = 0, decode = 0, steps = 0, prompt_len = 0, prompts = 0;
    const char *families = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--synthetic")) synthetic = 1;
        else if (!strcmp(a, "--attn")) attn = 1;
        else if (!strcmp(a, "--sched")) sched = 1;
        else if (!strcmp(a, "--no-bench")) bench = 0;
        else if (!strcmp(a, "--backward")) backward = 1;
        else if (!strcmp(a, "--pipeline")) pipeline = 1;
        else if (!strcmp(a, "--families")) families = v && v[0] != '-' ? (i++, v) : "tests/fixtures";
        else if (!strcmp(a, "--fisher") && v) fisher = atoi(v), i++;
        else if (!strcmp(a, "--model") && v) model = v, i++;
        else if (!strcmp(a, "--text") && v) text = v, i++;
        else if (!strcmp(a, "--device") && v) dev = v, i++;
        else if (!strcmp(a, "--ctx") && v) ctx = atoi(v), i++;
        else if (!strcmp(a, "--check-windows") && v) check_windows = atoi(v), i++;
        else if (!strcmp(a, "--max-windows") && v) max_windows = atoi(v), i++;
        else if (!strcmp(a, "--decode")) decode = 1;
        else if (!strcmp(a, "--artifact") && v) artifact = v, i++;
        else if (!strcmp(a, "--scheme") && v) scheme = v, i++;
        else if (!strcmp(a, "--steps") && v) steps = atoi(v), i++;
        else if (!strcmp(a, "--prompt-len") && v) prompt_len = atoi(v), i++;
        else if (!strcmp(a, "--prompts") && v) prompts = atoi(v), i++;
        else DIE("unknown or incomplete option '%s'; see the header of tests/gpu/gpu_check.c", a);
    }
    kvq_err err = {0};
    kvq_device d;
    TRYE(kvq_device_parse(dev, &d, NULL, &err));
    printf("gpu_check: device %s (%s build)\n", kvq_device_name(d), kvq_cuda_compiled() ? "CUDA" : "CPU-only");
    int ok = 1;
    if (synthetic) ok &= run_synthetic(d);
    if (synthetic || attn) ok &= run_attn_check();
    if (synthetic || sched) ok &= run_sched_check();
    if (backward) ok &= run_backward_synthetic(d);
    if (pipeline) ok &= run_pipeline_check();
    if (families) ok &= run_families(families, d);
    if (decode) {
        if (d != KVQ_DEVICE_CUDA) DIE("--decode compares the GPU with the CPU: it needs a GPU (--device cuda)");
        ok &= run_decode_check(model, artifact, scheme, text, steps, prompt_len, prompts);
    } else if (model) {
        if (!text) DIE("--model needs --text");
        if (ctx < 2) DIE("--ctx must be >= 2");
        if (fisher > 0) ok &= run_fisher_model(model, text, ctx, fisher, d);
        else ok &= run_model(model, text, ctx, check_windows, max_windows, bench, d);
    }
    printf("\ngpu_check: %s\n", ok ? "ALL PASS" : "SOME CHECKS FAILED");
    return ok ? 0 : 1;
}
