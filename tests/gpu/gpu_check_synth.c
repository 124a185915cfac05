/* gpu_check_synth.c — gpu_check --synthetic (random-weight models: every KV scheme CPU vs GPU, the LM-head outputs)
 * and --backward (the backward pass, Fisher information and attention statistics CPU vs GPU); see gpu_check.c. */
#include "gpu_check.h"
#include "scheme.h"

/* ---- synthetic models ------------------------------------------------------------ */

uint64_t rng_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
float rng_u(uint64_t *s) { return (float)((rng_next(s) >> 40) * (2.0 / 16777216.0) - 1.0); }

void fill(float *x, size_t n, float a, uint64_t *s)
{
    for (size_t i = 0; i < n; i++) x[i] = a * rng_u(s);
}

/* a synthetic model with biases, q/k norms, a sliding window and YaRN (any subset) */
void synth_model_ex(kvq_model *m, int n_layers, int dim, int n_heads, int n_kv, int head_dim, int hidden, int vocab,
                    int bias, int qk_norm, int window, int yarn, uint64_t seed)
{
    kvq_hparams hp = {.n_layers = n_layers, .dim = dim, .hidden_dim = hidden, .n_heads = n_heads, .n_kv_heads = n_kv,
                      .head_dim = head_dim, .vocab_size = vocab, .ctx_len = 4096, .rope_dim = head_dim,
                      .rope_theta = 10000.0f, .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1, .rope_attn_factor = 1,
                      .norm_eps = 1e-5f, .tied_embeddings = false, .attn_qkv_bias = bias, .attn_out_bias = bias,
                      .qk_norm = qk_norm, .sliding_window = window, .swa_first_layer = window ? 1 : 0};
    if (yarn) {
        hp.rope_scaling = KVQ_ROPE_SCALING_YARN;
        hp.rope_scale_factor = 4;
        hp.rope_orig_ctx = 64;
        hp.rope_beta_fast = 32;
        hp.rope_beta_slow = 1;
        hp.rope_yarn_truncate = true;
        hp.rope_attn_factor = (float)(0.1 * log(4.0) + 1.0);
    }
    kvq_err err = {0};
    TRYE(kvq_model_alloc(m, &hp, &err));
    uint64_t s = seed;
    size_t qd = kvq_q_dim(&hp), kvd = kvq_kv_dim(&hp);
    fill(kvq_mat_f32(&m->tok_embd), (size_t)vocab * dim, 1.0f, &s);
    fill(kvq_mat_f32(&m->output), (size_t)vocab * dim, sqrtf(3.0f / dim), &s);
    for (int i = 0; i < dim; i++) m->out_norm[i] = 1.0f + 0.1f * rng_u(&s);
    for (int l = 0; l < n_layers; l++) {
        kvq_layer_weights *w = &m->layers[l];
        for (int i = 0; i < dim; i++) w->attn_norm[i] = 1.0f + 0.1f * rng_u(&s), w->ffn_norm[i] = 1.0f + 0.1f * rng_u(&s);
        fill(kvq_mat_f32(&w->wq), qd * dim, 2 * sqrtf(3.0f / dim), &s);
        fill(kvq_mat_f32(&w->wk), kvd * dim, 2 * sqrtf(3.0f / dim), &s);
        fill(kvq_mat_f32(&w->wv), kvd * dim, sqrtf(3.0f / dim), &s);
        fill(kvq_mat_f32(&w->wo), dim * qd, sqrtf(3.0f / qd), &s);
        fill(kvq_mat_f32(&w->w_gate), (size_t)hidden * dim, sqrtf(3.0f / dim), &s);
        fill(kvq_mat_f32(&w->w_up), (size_t)hidden * dim, sqrtf(3.0f / dim), &s);
        fill(kvq_mat_f32(&w->w_down), (size_t)dim * hidden, sqrtf(3.0f / hidden), &s);
        if (bias) {
            fill(w->bq, qd, 0.5f, &s);
            fill(w->bk, kvd, 0.5f, &s);
            w->bk[3] += 8.0f; /* a Qwen2-like dominant key channel */
            fill(w->bv, kvd, 0.5f, &s);
            fill(w->bo, (size_t)dim, 0.2f, &s);
        }
        if (qk_norm)
            for (int i = 0; i < head_dim; i++) w->q_norm[i] = 1.0f + 0.3f * rng_u(&s), w->k_norm[i] = 1.0f + 0.3f * rng_u(&s);
    }
}

/* a plain Llama model (head_dim = dim / n_heads): synth_model_ex with no family parts (same weights, same draws) */
static void synth_model(kvq_model *m, int n_layers, int dim, int n_heads, int n_kv, int hidden, int vocab, uint64_t seed)
{
    synth_model_ex(m, n_layers, dim, n_heads, n_kv, dim / n_heads, hidden, vocab, 0, 0, 0, 0, seed);
}

/* Random window tokens [nw][T] and, when P > 0, a random prefix (pbuf owns its K and V; free it). */
static int32_t *synth_inputs(const kvq_hparams *hp, int T, int nw, int P, uint64_t seed, kvq_prefix *px, float **pbuf)
{
    uint64_t s = seed;
    int32_t *tokens = malloc((size_t)nw * T * sizeof(int32_t));
    if (!tokens) DIE("out of memory");
    for (int i = 0; i < nw * T; i++) tokens[i] = (int32_t)(rng_next(&s) % (uint64_t)hp->vocab_size);
    *px = (kvq_prefix){0};
    *pbuf = NULL;
    if (P) {
        size_t pn = (size_t)hp->n_layers * P * kvq_kv_dim(hp);
        *pbuf = malloc(2 * pn * sizeof(float));
        if (!*pbuf) DIE("out of memory");
        fill(*pbuf, 2 * pn, 1.0f, &s);
        *px = (kvq_prefix){.P = P, .k = *pbuf, .v = *pbuf + pn};
    }
    return tokens;
}

/* kvq_fwd_head (kveval's KL divergence) on the GPU against the CPU: the LM head's input, log-sum-exp,
 * top token and expectation of the scored rows (a span with a gap, the first rows unscored), for the
 * unquantized forward and a native scheme d; then KL(P_fp32 || Q_d) per row from each device's outputs.
 * PASS: for the unquantized forward hidden / expectation rel L2 <= 3e-5, lse within 1e-5, top tokens
 * equal on rows whose top-2 gap (CPU) exceeds 1e-4; mean KL within 1e-3 relative (+1e-7). The
 * scheme's hidden states and lse are printed, not bounded: its quantizer rounds the device's own K/V,
 * so a value at a rounding boundary may land on the other level (random-weight models have many:
 * ~1e-2 relative there, ~1e-6 on the default model). */
static int head_check(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const kvq_kv_desc *d, const char *dname,
                      const int32_t *tokens, int T, const kvq_prefix *px)
{
    const size_t dim = (size_t)hp->dim, V = (size_t)hp->vocab_size;
    int *tg = malloc((size_t)T * sizeof(int));
    float *lg = malloc((size_t)T * V * sizeof(float));
    float *h[2][2], *e[2];
    double *l[2][2];
    int *a[2][2];
    kvq_err err = {0};
    for (int t = 0; t < T; t++) tg[t] = t >= 3 && t + 1 < T && t != T / 2 ? tokens[t + 1] : -1;
    for (int dv = 0; dv < 2; dv++) {
        e[dv] = malloc((size_t)T * dim * sizeof(float));
        for (int sc = 0; sc < 2; sc++) {
            h[dv][sc] = malloc((size_t)T * dim * sizeof(float));
            l[dv][sc] = malloc((size_t)T * sizeof(double));
            a[dv][sc] = malloc((size_t)T * sizeof(int));
        }
    }
    kvq_engine *eng[2] = {cpu, gpu};
    for (int dv = 0; dv < 2; dv++)
        for (int sc = 0; sc < 2; sc++) {
            TRYE(kvq_engine_set_kv(eng[dv], sc ? d : NULL, &err));
            kvq_fwd_head hd = {.hidden = h[dv][sc], .lse = l[dv][sc], .argmax = a[dv][sc], .expect = sc ? NULL : e[dv]};
            kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = px ? px->P : 0, .prefix = px, .targets = tg, .head = &hd};
            kvq_fwd_result r;
            TRYE(kvq_engine_run(eng[dv], &io, &r, &err));
            if (!sc) { /* the top-2 gaps from the CPU's full logits */
                if (!dv) {
                    io.head = NULL;
                    io.logits = lg;
                    TRYE(kvq_engine_run(eng[dv], &io, &r, &err));
                }
            }
        }
    double eh = 0, ee = 0, el = 0, ehs = 0, els = 0, kc = 0, kg = 0;
    int top_bad = 0, n = 0;
    for (int t = 0; t < T; t++) {
        if (tg[t] < 0) continue;
        n++;
        eh = fmax(eh, rel_l2(h[1][0] + t * dim, h[0][0] + t * dim, dim));
        el = fmax(el, fabs(l[1][0][t] - l[0][0][t]));
        ehs = fmax(ehs, rel_l2(h[1][1] + t * dim, h[0][1] + t * dim, dim));
        els = fmax(els, fabs(l[1][1][t] - l[0][1][t]));
        ee = fmax(ee, rel_l2(e[1] + t * dim, e[0] + t * dim, dim));
        float m1 = -INFINITY, m2 = -INFINITY;
        for (size_t v = 0; v < V; v++) {
            const float z = lg[(size_t)t * V + v];
            if (z > m1) m2 = m1, m1 = z;
            else if (z > m2) m2 = z;
        }
        if (m1 - m2 > 1e-4f && a[1][0][t] != a[0][0][t]) top_bad++;
        for (int dv = 0; dv < 2; dv++) {
            double c = 0;
            for (size_t j = 0; j < dim; j++) c += ((double)h[dv][0][t * dim + j] - h[dv][1][t * dim + j]) * e[dv][t * dim + j];
            *(dv ? &kg : &kc) += c - l[dv][0][t] + l[dv][1][t];
        }
    }
    kc /= n;
    kg /= n;
    const int ok = eh <= 3e-5 && ee <= 3e-5 && el <= 1e-5 && top_bad == 0 && fabs(kg - kc) <= 1e-3 * kc + 1e-7;
    printf("\nLM-head outputs (KL divergence), fp32 and %s, %d scored rows: fp32 hidden rel L2 %.2e, expectation rel L2 %.2e, "
           "lse max diff %.2e, top tokens differing (gap > 1e-4) %d; %s hidden rel L2 %.2e, lse max diff %.2e; "
           "mean KL CPU %.6e GPU %.6e: %s\n",
           dname, n, eh, ee, el, top_bad, dname, ehs, els, kc, kg, ok ? "PASS" : "FAIL");
    for (int dv = 0; dv < 2; dv++) {
        free(e[dv]);
        for (int sc = 0; sc < 2; sc++) free(h[dv][sc]), free(l[dv][sc]), free(a[dv][sc]);
    }
    free(tg);
    free(lg);
    TRYE(kvq_engine_set_kv(cpu, NULL, &err));
    TRYE(kvq_engine_set_kv(gpu, NULL, &err));
    return ok;
}

int run_synthetic(kvq_device gdev)
{
    struct { int L, dim, nh, nkv, hid, V, T, P, nwin; } cfg[] = {
        {3, 256, 4, 2, 512, 700, 300, 5, 2},   /* head_dim 64, GQA 2 */
        {2, 512, 4, 1, 768, 500, 257, 0, 1},   /* head_dim 128, MQA */
        {2, 128, 8, 8, 256, 300, 129, 3, 1},   /* head_dim 16, MHA */
    };
    int all_ok = 1;
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        kvq_model m;
        synth_model(&m, cfg[c].L, cfg[c].dim, cfg[c].nh, cfg[c].nkv, cfg[c].hid, cfg[c].V, 1000 + c);
        const kvq_hparams *hp = &m.hp;
        int T = cfg[c].T, P = cfg[c].P, nw = cfg[c].nwin;
        printf("\n### synthetic model %zu: %d layers, dim %d, heads %d/%d (head_dim %d), vocab %d, T %d, prefix %d, %d window(s)\n\n",
               c, hp->n_layers, hp->dim, hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->vocab_size, T, P, nw);
        kvq_prefix px;
        float *pbuf;
        int32_t *tokens = synth_inputs(hp, T, nw, P, 77 + c, &px, &pbuf);
        kvq_err err = {0};
        kvq_engine cpu, gpu;
        TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, P, 0, &err));
        TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, &m, T, P, 0, &err));
        /* tables from the CPU's pre-RoPE keys of window 0 */
        synth_tables st4, st3;
        synth_alloc(&st4, hp, 4);
        synth_alloc(&st3, hp, 3);
        calib_user cu = {&st4, T};
        kvq_hooks ch = {.user = &cu, .observe = calib_observe};
        kvq_fwd_io cio = {.tokens = tokens, .T = T, .pos0 = P, .prefix = P ? &px : NULL, .hooks = &ch};
        kvq_fwd_result cr;
        TRYE(kvq_engine_run(&cpu, &cio, &cr, &err));
        memcpy(st3.lower, st4.lower, (size_t)hp->n_layers * st4.kvd * sizeof(float));
        memcpy(st3.upper, st4.upper, (size_t)hp->n_layers * st4.kvd * sizeof(float));
        scheme_list L;
        default_schemes(&L, &st4, hp->head_dim, 4, 32);
        fix_bits(&L, &st3);
        float *lc = malloc((size_t)T * hp->vocab_size * sizeof(float)), *lg = malloc((size_t)T * hp->vocab_size * sizeof(float));
        header();
        for (int i = 0; i < L.n; i++) {
            int native = gpu_native(&L.d[i]);
            cmp_row r = compare(&cpu, &gpu, &L.d[i], tokens, nw, T, P ? &px : NULL, native ? 0 : 1, lc, lg);
            all_ok &= report_row(L.name[i], native ? "native" : "host hook", r, is_exact_scheme(&L.d[i]));
        }
        for (int i = 0; i < L.n; i++) {
            if ((L.d[i].q.fam != KVQ_FAM("kivi") && L.d[i].q.fam != KVQ_FAM("nuq")) || !gpu_native(&L.d[i])) continue;
            cmp_row r = compare(&cpu, &gpu, &L.d[i], tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            all_ok &= report_row(L.name[i], "host hook", r, is_exact_scheme(&L.d[i]));
        }
        /* heavy hitters: a per-key schedule decided by attention (kernels/schemes/hh.c); the host transform gives
         * the representations and the declarative policy, the GPU forward attends the layer and takes the
         * decisions on the device (kernels/cuda/cuda_sched.cuh). Decisions at near-ties may flip between the two
         * float paths: a loose check (PPL within 1%) that the plumbing holds, the semantics being the CPU's,
         * checked bit for bit against a token-by-token cache in tests/test_hh.c and kernel against CPU in
         * gpu_check --sched */
        {
            kvq_kv_desc hh = {.q = {.fam = KVQ_FAM("hh"), .k_bits = 2, .v_bits = 2, .residual = 8, .x = {0.25, 16}},
                              .key_stage = KVQ_KEYS_POST_ROPE};
            cmp_row r = compare(&cpu, &gpu, &hh, tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            report_row("hh2-25%-w8", "device sched", r, 0);
            int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu);
            printf("hh on the GPU (device schedule): PPL CPU %.6f GPU %.6f (rel %.2e): %s\n", r.ppl_cpu, r.ppl_gpu, r.ppl_rel,
                   ok ? "PASS" : "FAIL");
            all_ok &= ok;
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
        }
        /* mikv: the same device schedule with balanced keys (a fixed balancer table per layer, as kvcalib writes it) */
        {
            size_t kvd = (size_t)kvq_kv_dim(hp);
            kvq_artifact ma = {.p = {.method = KVQ_FAM("mikv"), .k_bits = 2, .v_bits = 2, .post_rope = true,
                                     .n_layers = (size_t)hp->n_layers, .n_kv_heads = (size_t)hp->n_kv_heads,
                                     .head_dim = (size_t)hp->head_dim}};
            ma.k = calloc((size_t)hp->n_layers, sizeof *ma.k);
            for (int l = 0; l < hp->n_layers; l++) {
                float *b;
                uint64_t shape[1] = {kvd};
                TRYE(kvq_kv_table_add(&ma.k[l], "balancer", 1, shape, &b, &err));
                for (size_t c = 0; c < kvd; c++) b[c] = 0.5f + 0.25f * (float)((c + (size_t)l) % 7);
            }
            kvq_kv_desc mk = {.q = {.fam = KVQ_FAM("mikv"), .k_bits = 2, .v_bits = 2, .residual = 8, .x = {0.25, 8, 1}},
                              .key_stage = KVQ_KEYS_POST_ROPE, .art = &ma};
            cmp_row r = compare(&cpu, &gpu, &mk, tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            report_row("mikv-h8-l2-b25%-w8", "device sched", r, 0);
            int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu);
            printf("mikv on the GPU (device schedule): PPL CPU %.6f GPU %.6f (rel %.2e): %s\n", r.ppl_cpu, r.ppl_gpu, r.ppl_rel,
                   ok ? "PASS" : "FAIL");
            all_ok &= ok;
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
            for (int l = 0; l < hp->n_layers; l++) kvq_kv_table_free(&ma.k[l]);
            free(ma.k);
        }
        /* zipcache: the same device schedule with normalised importance, probe votes and block-normalised
         * representations (kernels/schemes/zipcache.c: x = {salient share, high bits, probe share, block}) */
        {
            kvq_kv_desc zc = {.q = {.fam = KVQ_FAM("zipcache"), .k_bits = 2, .v_bits = 2, .residual = 8, .x = {0.25, 4, 0.5, 4}},
                              .key_stage = KVQ_KEYS_POST_ROPE};
            cmp_row r = compare(&cpu, &gpu, &zc, tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            report_row("zipcache-h4-l2-b25%-w8-n4-p50%", "device sched", r, 0);
            int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu);
            printf("zipcache on the GPU (device schedule): PPL CPU %.6f GPU %.6f (rel %.2e): %s\n", r.ppl_cpu, r.ppl_gpu, r.ppl_rel,
                   ok ? "PASS" : "FAIL");
            all_ok &= ok;
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
        }
        /* qaq: the selection form (kernels/schemes/qaq.c: x = {sigma_S, sigma_X, ||q||^2, L}) with its declarative
         * step (forward.h kvq_sched_sel), decided on the device (cuda_sched.cuh ssel_*): per (token, KV head) widths
         * 1..6 re-decided after every query row, down and back up, 1% outliers per token, a fixed query norm (no
         * artifact); value widths at near-ties may flip between the float paths: the same loose check */
        {
            kvq_kv_desc qa = {.q = {.fam = KVQ_FAM("qaq"), .k_bits = 6, .v_bits = 6, .outlier_frac = 0.01, .residual = 3,
                                    .x = {0.001, 0.05, 300, 1}},
                              .key_stage = KVQ_KEYS_POST_ROPE};
            kvq_cuda_stats s0, s1;
            kvq_engine_cuda_stats(&gpu, &s0);
            cmp_row r = compare(&cpu, &gpu, &qa, tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            kvq_engine_cuda_stats(&gpu, &s1);
            report_row("qaq-k0.001-v0.05-o1%-w3-l1-h6-q300", "device sched", r, 0);
            /* every layer of every window on the device path (not the host fallback) */
            const unsigned long long nd = (unsigned long long)(s1.device_scheds - s0.device_scheds),
                                     nh = (unsigned long long)(s1.host_scheds - s0.host_scheds);
            int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu) && nd == (unsigned long long)nw * hp->n_layers && nh == 0;
            printf("qaq on the GPU (device schedule): PPL CPU %.6f GPU %.6f (rel %.2e), %llu device / %llu host layer "
                   "schedules: %s\n", r.ppl_cpu, r.ppl_gpu, r.ppl_rel, nd, nh, ok ? "PASS" : "FAIL");
            all_ok &= ok;
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
        }
        /* skvq: the sliding-window boundaries with its tables (a reversed channel order, groups of head_dim / 2,
         * clip 0.95, as kvcalib --method skvq writes them), pre-RoPE keys, on the host between GPU layers */
        {
            size_t kvd = (size_t)kvq_kv_dim(hp), gsz = (size_t)hp->head_dim / 2, ng = kvd / gsz;
            kvq_artifact sa = {.p = {.method = KVQ_FAM("skvq"), .k_bits = 2, .v_bits = 2, .n_sink = 1, .group_size = gsz,
                                     .n_layers = (size_t)hp->n_layers, .n_kv_heads = (size_t)hp->n_kv_heads,
                                     .head_dim = (size_t)hp->head_dim}};
            sa.k = calloc((size_t)hp->n_layers, sizeof *sa.k);
            sa.v = calloc((size_t)hp->n_layers, sizeof *sa.v);
            for (int l = 0; l < hp->n_layers; l++)
                for (int w = 0; w < 2; w++) {
                    kvq_kv_table *t = w ? &sa.v[l] : &sa.k[l];
                    float *pm, *gs, *cl;
                    uint64_t sp[1] = {kvd}, sg[1] = {ng + 1}, sc[1] = {1};
                    TRYE(kvq_kv_table_add(t, "perm", 1, sp, &pm, &err));
                    TRYE(kvq_kv_table_add(t, "group_start", 1, sg, &gs, &err));
                    TRYE(kvq_kv_table_add(t, "clip", 1, sc, &cl, &err));
                    for (size_t c = 0; c < kvd; c++) pm[c] = (float)(kvd - 1 - c);
                    for (size_t g = 0; g <= ng; g++) gs[g] = (float)(g * gsz);
                    cl[0] = 0.95f;
                }
            kvq_kv_desc sk = {.q = {.fam = KVQ_FAM("skvq"), .k_bits = 2, .v_bits = 2, .n_sink = 1, .group = gsz, .residual = 8},
                              .key_stage = KVQ_KEYS_PRE_ROPE, .art = &sa};
            cmp_row r = compare(&cpu, &gpu, &sk, tokens, nw, T, P ? &px : NULL, 1, lc, lg);
            report_row("skvq2-w8+sink1 (synthetic tables)", "host hook", r, 0);
            int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu);
            printf("skvq on the GPU (host hook): PPL CPU %.6f GPU %.6f (rel %.2e): %s\n", r.ppl_cpu, r.ppl_gpu, r.ppl_rel,
                   ok ? "PASS" : "FAIL");
            all_ok &= ok;
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
            for (int l = 0; l < hp->n_layers; l++) {
                kvq_kv_table_free(&sa.k[l]);
                kvq_kv_table_free(&sa.v[l]);
            }
            free(sa.k);
            free(sa.v);
        }
        /* minicache: cross-layer merging, the window in steps (kvq_hooks.chunk) attending the cache the host transform
         * built as a prefix; engines with room for that prefix, no IntactKV prefix (steps refuse one). A loose check
         * (PPL within 1%, as hh): a last-bit difference moves an angular distance across the retention threshold; the
         * semantics are checked bit for bit against a step-by-step cache in tests/test_minicache.c */
        {
            kvq_engine mc, mg;
            TRYE(kvq_engine_init(&mc, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, T, 0, &err));
            TRYE(kvq_engine_init(&mg, gdev, KVQ_CUDA_EXACT, &m, T, T, 0, &err));
            const char *specs[] = {"minicache4-s0-c16", "minicache-s0-c1"}; /* -s0: the 2-layer models have one pair */
            for (int i = 0; i < 2; i++) {
                kvq_eval_scheme es;
                TRYE(kvq_eval_scheme_make(specs[i], NULL, hp, &es, &err));
                cmp_row r = compare(&mc, &mg, &es.desc, tokens, nw, T, NULL, 1, lc, lg);
                report_row(es.name, "host steps", r, 0);
                int ok = r.ppl_rel <= 1e-2 && isfinite(r.ppl_gpu);
                printf("%s on the GPU (host hook, windows in steps): PPL CPU %.6f GPU %.6f (rel %.2e): %s\n", es.name, r.ppl_cpu,
                       r.ppl_gpu, r.ppl_rel, ok ? "PASS" : "FAIL");
                all_ok &= ok;
            }
            kvq_engine_free(&mc);
            kvq_engine_free(&mg);
        }
        /* observe hook on the GPU: layer 0's k_att / v_att (fp32: the unquantized K/V) vs the CPU's */
        {
            size_t n = (size_t)T * kvq_kv_dim(hp);
            obs_rec rc = {.layer = 0, .k = malloc(n * 4), .v = malloc(n * 4), .n = n};
            obs_rec rg = {.layer = 0, .k = malloc(n * 4), .v = malloc(n * 4), .n = n};
            TRYE(kvq_engine_set_kv(&cpu, NULL, &err));
            TRYE(kvq_engine_set_kv(&gpu, NULL, &err));
            kvq_hooks hc = {.user = &rc, .observe = rec_observe}, hg = {.user = &rg, .observe = rec_observe};
            kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = P, .prefix = P ? &px : NULL, .hooks = &hc};
            kvq_fwd_result r1, r2;
            TRYE(kvq_engine_run(&cpu, &io, &r1, &err));
            io.hooks = &hg;
            TRYE(kvq_engine_run(&gpu, &io, &r2, &err));
            double ek = rel_l2(rg.k, rc.k, n), ev = rel_l2(rg.v, rc.v, n);
            int ok = rc.calls == hp->n_layers && rg.calls == hp->n_layers && ek <= 1e-5 && ev <= 1e-5;
            printf("\nobserve hook (fp32, layer 0): calls CPU %d GPU %d, k_att rel L2 %.2e, v_att rel L2 %.2e: %s\n", rc.calls,
                   rg.calls, ek, ev, ok ? "PASS" : "FAIL");
            all_ok &= ok;
            free(rc.k), free(rc.v), free(rg.k), free(rg.v);
        }
        all_ok &= bitexact_all(&gpu, hp, &L, tokens, T, P ? &px : NULL);
        for (int i = 0; i < L.n; i++)
            if (L.d[i].q.fam == KVQ_FAM("int") && gpu_native(&L.d[i])) {
                all_ok &= head_check(&cpu, &gpu, hp, &L.d[i], L.name[i], tokens, T, P ? &px : NULL);
                break;
            }
        free(lc), free(lg), free(tokens), free(pbuf);
        synth_free(&st4);
        synth_free(&st3);
        kvq_engine_free(&cpu);
        kvq_engine_free(&gpu);
        kvq_model_free(&m);
    }
    return all_ok;
}

/* ---- backward: CPU vs GPU ------------------------------------------------------- */


void grad_rec_alloc(grad_rec *g, const kvq_hparams *hp, int T, int P)
{
    g->n_layers = hp->n_layers;
    g->T = T;
    g->P = P;
    g->kvd = (size_t)kvq_kv_dim(hp);
    size_t n = (size_t)hp->n_layers * T * g->kvd, np = (size_t)hp->n_layers * (P ? P : 1) * g->kvd;
    g->st.dk_pre = calloc(n, 4);
    g->st.dk_post = calloc(n, 4);
    g->st.dv = calloc(n, 4);
    g->st.dpk = calloc(np, 4);
    g->st.dpv = calloc(np, 4);
    g->fk = calloc(n, 4);
    g->fv = calloc(n, 4);
    if (!g->st.dk_pre || !g->st.dk_post || !g->st.dv || !g->st.dpk || !g->st.dpv || !g->fk || !g->fv) DIE("out of memory");
}

void grad_rec_free(grad_rec *g)
{
    free(g->st.dk_pre), free(g->st.dk_post), free(g->st.dv), free(g->st.dpk), free(g->st.dpv), free(g->fk), free(g->fv);
}

void fisher_of(grad_rec *g)
{
    size_t n = (size_t)g->n_layers * g->T * g->kvd;
    for (size_t i = 0; i < n; i++) {
        g->fk[i] = g->st.dk_pre[i] * g->st.dk_pre[i];
        g->fv[i] = g->st.dv[i] * g->st.dv[i];
    }
}

/* upstream term: L_up = 0.5 * 1e-3 * sum x_out^2 over every layer output (any smooth function of x_out) */
typedef struct {
    kvq_grad_store *st;
    int dim;
} up_user;

static kvq_status up_cb(void *user, const kvq_layer_ctx *ctx, const float *x_out, float *dx_out, kvq_err *err)
{
    (void)err;
    const up_user *u = user;
    size_t n = (size_t)ctx->T * u->dim;
    for (size_t i = 0; i < n; i++) dx_out[i] += 1e-3f * x_out[i];
    return KVQ_OK;
}

static kvq_status up_grads_cb(void *user, const kvq_layer_grads *g, kvq_err *err)
{
    return kvq_grad_store_cb(((up_user *)user)->st, g, err);
}

/* attention statistics via observe: layer `layer`'s mass [nh][P+T] and entropy [nh][T] */
typedef struct {
    int layer;
    float *mass, *ent;
    size_t nm, ne;
    int got;
} stats_rec;

static kvq_status stats_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    stats_rec *r = user;
    if (ctx->layer != r->layer) return KVQ_OK;
    if (!obs->attn_mass || !obs->attn_entropy) return kvq_fail(err, KVQ_EINVAL, "observe: no attention statistics");
    memcpy(r->mass, obs->attn_mass, r->nm * 4);
    memcpy(r->ent, obs->attn_entropy, r->ne * 4);
    r->got = 1;
    return KVQ_OK;
}

int stats_check(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const kvq_kv_desc *d, const char *name,
                const int32_t *tokens, int T, const kvq_prefix *px, int layer)
{
    kvq_err err = {0};
    int P = px ? px->P : 0;
    size_t nm = (size_t)hp->n_heads * (P + T), ne = (size_t)hp->n_heads * T;
    stats_rec rc = {.layer = layer, .mass = malloc(nm * 4), .ent = malloc(ne * 4), .nm = nm, .ne = ne};
    stats_rec rg = {.layer = layer, .mass = malloc(nm * 4), .ent = malloc(ne * 4), .nm = nm, .ne = ne};
    TRYE(kvq_engine_set_kv(cpu, d, &err));
    TRYE(kvq_engine_set_kv(gpu, d, &err));
    kvq_hooks hc = {.user = &rc, .observe = stats_observe, .attn_stats = true};
    kvq_hooks hg = {.user = &rg, .observe = stats_observe, .attn_stats = true};
    kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = P, .prefix = px, .hooks = &hc};
    kvq_fwd_result r;
    TRYE(kvq_engine_run(cpu, &io, &r, &err));
    io.hooks = &hg;
    TRYE(kvq_engine_run(gpu, &io, &r, &err));
    double em = rel_l2(rg.mass, rc.mass, nm), ee = rel_l2(rg.ent, rc.ent, ne);
    /* mass sums to the number of queries per head */
    double msum = 0;
    for (size_t i = 0; i < nm; i++) msum += rg.mass[i];
    double want = (double)hp->n_heads * T;
    int exact = d->q.fam == KVQ_FAM("fp32");
    int ok = rc.got && rg.got && fabs(msum - want) <= 1e-3 * want && (!exact || (em <= 1e-4 && ee <= 1e-4));
    printf("| %s | layer %d | %.2e | %.2e | %.6f | %s |\n", name, layer, em, ee, msum / want, ok ? "PASS" : "FAIL");
    free(rc.mass), free(rc.ent), free(rg.mass), free(rg.ent);
    return ok;
}

/* One backward CPU vs GPU; prints a table row; returns pass (exact schemes: every
 * gradient and the Fisher arrays within tol). */
int bwd_compare(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const kvq_kv_desc *d, int host_hook,
                const char *name, const int32_t *tokens, int T, const kvq_prefix *px, double tol)
{
    kvq_err err = {0};
    int P = px ? px->P : 0;
    grad_rec gc, gg;
    grad_rec_alloc(&gc, hp, T, P);
    grad_rec_alloc(&gg, hp, T, P);
    float *ec = malloc((size_t)T * hp->dim * 4), *eg = malloc((size_t)T * hp->dim * 4);
    kvq_kv_desc_run hr = {.d = d};
    kvq_hooks hh = {.user = &hr, .transform = kvq_kv_desc_transform, .key_stage = d->key_stage};
    const kvq_kv_desc *nd = host_hook ? NULL : d;
    TRYE(kvq_engine_set_kv(cpu, nd, &err));
    TRYE(kvq_engine_set_kv(gpu, nd, &err));
    kvq_bwd_spec sc = {.user = &gc.st, .xent = true, .grads = kvq_grad_store_cb, .d_embd = ec};
    kvq_bwd_spec sg = {.user = &gg.st, .xent = true, .grads = kvq_grad_store_cb, .d_embd = eg};
    kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = P, .prefix = px, .hooks = host_hook ? &hh : NULL};
    kvq_bwd_result rc, rg;
    double t0 = now_s();
    kvq_status s1 = kvq_engine_backward(cpu, &io, &sc, &rc, &err);
    if (s1) DIE("CPU backward (%s): %s", name, err.msg);
    double t1 = now_s();
    if (host_hook) hr = (kvq_kv_desc_run){.d = d};
    kvq_status s2 = kvq_engine_backward(gpu, &io, &sg, &rg, &err);
    if (s2) DIE("GPU backward (%s): %s", name, err.msg);
    double t2 = now_s();
    size_t n = (size_t)hp->n_layers * T * gc.kvd, np = (size_t)hp->n_layers * P * gc.kvd;
    fisher_of(&gc);
    fisher_of(&gg);
    double e_kpre = rel_l2(gg.st.dk_pre, gc.st.dk_pre, n), e_kpost = rel_l2(gg.st.dk_post, gc.st.dk_post, n);
    double e_v = rel_l2(gg.st.dv, gc.st.dv, n), e_fk = rel_l2(gg.fk, gc.fk, n), e_fv = rel_l2(gg.fv, gc.fv, n);
    double e_pk = P ? rel_l2(gg.st.dpk, gc.st.dpk, np) : 0, e_pv = P ? rel_l2(gg.st.dpv, gc.st.dpv, np) : 0;
    double e_emb = rel_l2(eg, ec, (size_t)T * hp->dim);
    double e_loss = fabs(rg.loss - rc.loss) / fabs(rc.loss);
    double worst = e_kpre;
    double all[] = {e_kpost, e_v, e_fk, e_fv, e_pk, e_pv, e_emb, e_loss};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) worst = all[i] > worst ? all[i] : worst;
    int ok = worst <= tol;
    printf("| %s%s | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e | %.2f / %.3f | %s |\n", name,
           host_hook ? " (host hook)" : "", e_loss, e_kpre, e_kpost, e_v, e_fk, e_fv, e_pk, e_pv, e_emb, t1 - t0, t2 - t1,
           tol > 0 ? (ok ? "PASS" : "FAIL") : "info");
    free(ec), free(eg);
    grad_rec_free(&gc);
    grad_rec_free(&gg);
    return tol > 0 ? ok : 1;
}

/* the upstream path: gradients of an upstream-only loss (no cross-entropy), CPU vs GPU */
static int upstream_compare(kvq_engine *cpu, kvq_engine *gpu, const kvq_hparams *hp, const int32_t *tokens, int T,
                            const kvq_prefix *px)
{
    kvq_err err = {0};
    int P = px ? px->P : 0;
    grad_rec gc, gg;
    grad_rec_alloc(&gc, hp, T, P);
    grad_rec_alloc(&gg, hp, T, P);
    TRYE(kvq_engine_set_kv(cpu, NULL, &err));
    TRYE(kvq_engine_set_kv(gpu, NULL, &err));
    up_user uc = {&gc.st, hp->dim}, ug = {&gg.st, hp->dim};
    kvq_bwd_spec sc = {.user = &uc, .upstream = up_cb, .grads = up_grads_cb};
    kvq_bwd_spec sg = {.user = &ug, .upstream = up_cb, .grads = up_grads_cb};
    kvq_fwd_io io = {.tokens = tokens, .T = T, .pos0 = P, .prefix = px};
    kvq_bwd_result rc, rg;
    TRYE(kvq_engine_backward(cpu, &io, &sc, &rc, &err));
    TRYE(kvq_engine_backward(gpu, &io, &sg, &rg, &err));
    size_t n = (size_t)hp->n_layers * T * gc.kvd, np = (size_t)hp->n_layers * P * gc.kvd;
    double e_v = rel_l2(gg.st.dv, gc.st.dv, n), e_k = rel_l2(gg.st.dk_pre, gc.st.dk_pre, n);
    double e_pk = P ? rel_l2(gg.st.dpk, gc.st.dpk, np) : 0, e_pv = P ? rel_l2(gg.st.dpv, gc.st.dpv, np) : 0;
    double worst = fmax(fmax(e_v, e_k), fmax(e_pk, e_pv));
    int ok = worst <= 1e-4;
    printf("\nupstream-only loss (IntactKV's entry point): dK_pre %.2e, dV %.2e, prefix dK %.2e, dV %.2e: %s\n", e_k, e_v, e_pk,
           e_pv, ok ? "PASS" : "FAIL");
    grad_rec_free(&gc);
    grad_rec_free(&gg);
    return ok;
}

void bwd_header(void)
{
    printf("| scheme | loss rel | dK_pre | dK_post | dV | Fisher K | Fisher V | prefix dK | prefix dV | d_embd | s CPU / GPU | |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

int run_backward_synthetic(kvq_device gdev)
{
    struct { int L, dim, nh, nkv, hid, V, T, P; } cfg[] = {
        {3, 256, 4, 2, 512, 700, 300, 5},   /* head_dim 64, GQA 2, prefix */
        {2, 512, 4, 1, 768, 500, 257, 0},   /* head_dim 128, MQA */
        {2, 128, 8, 8, 256, 300, 129, 3},   /* head_dim 16, MHA, prefix */
    };
    int all_ok = 1;
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        kvq_model m;
        synth_model(&m, cfg[c].L, cfg[c].dim, cfg[c].nh, cfg[c].nkv, cfg[c].hid, cfg[c].V, 2000 + c);
        const kvq_hparams *hp = &m.hp;
        int T = cfg[c].T, P = cfg[c].P;
        printf("\n### backward, synthetic model %zu: %d layers, dim %d, heads %d/%d (head_dim %d), vocab %d, T %d, prefix %d\n\n", c,
               hp->n_layers, hp->dim, hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->vocab_size, T, P);
        kvq_prefix px;
        float *pbuf;
        int32_t *tokens = synth_inputs(hp, T, 1, P, 99 + c, &px, &pbuf);
        kvq_err err = {0};
        kvq_engine cpu, gpu;
        TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, T, P, KVQ_ENGINE_BACKWARD, &err));
        TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, &m, T, P, KVQ_ENGINE_BACKWARD, &err));
        synth_tables st4;
        synth_alloc(&st4, hp, 4);
        calib_user cu = {&st4, T};
        kvq_hooks ch = {.user = &cu, .observe = calib_observe};
        kvq_fwd_io cio = {.tokens = tokens, .T = T, .pos0 = P, .prefix = P ? &px : NULL, .hooks = &ch};
        kvq_fwd_result cr;
        TRYE(kvq_engine_run(&cpu, &cio, &cr, &err));
        scheme_list L;
        L.n = 0;
        add_scheme(&L, "fp32", 0, 0, 0, 0, 0, KVQ_KEYS_POST_ROPE, &st4, NULL);
        add_scheme(&L, "kivi", 2, 32 <= hp->head_dim ? 32 : (size_t)hp->head_dim, 32, 0, 0, KVQ_KEYS_PRE_ROPE, &st4,
                   "+pre-rope");
        add_scheme(&L, "nuq", 4, 0, 0, 0.01, 2, KVQ_KEYS_PRE_ROPE, &st4, " (synthetic tables)");
        const kvq_prefix *pp = P ? &px : NULL;
        bwd_header();
        /* exact (fp32): every gradient within 1e-4; quantized: for information (a code flip moves a gradient) */
        all_ok &= bwd_compare(&cpu, &gpu, hp, &L.d[0], 0, L.name[0], tokens, T, pp, 1e-4);
        for (int i = 1; i < L.n; i++) all_ok &= bwd_compare(&cpu, &gpu, hp, &L.d[i], 0, L.name[i], tokens, T, pp, 0);
        all_ok &= bwd_compare(&cpu, &gpu, hp, &L.d[2], 1, L.name[2], tokens, T, pp, 0);
        all_ok &= upstream_compare(&cpu, &gpu, hp, tokens, T, pp);
        printf("\nattention statistics via observe, CPU vs GPU (rel L2; mass sums to the query count)\n\n");
        printf("| scheme | layer | mass | entropy | sum(mass)/(heads*T) | |\n|---|---|---|---|---|---|\n");
        for (int i = 0; i < L.n; i++) all_ok &= stats_check(&cpu, &gpu, hp, &L.d[i], L.name[i], tokens, T, pp, hp->n_layers - 1);
        free(tokens), free(pbuf);
        synth_free(&st4);
        kvq_engine_free(&cpu);
        kvq_engine_free(&gpu);
        kvq_model_free(&m);
    }
    return all_ok;
}

