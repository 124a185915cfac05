/* gpu_check_models.c — gpu_check --families (the model families' fixtures and synthetic models with their parts),
 * --model (the real model: logits/PPL CPU vs GPU, the perplexity benchmark) and --model --fisher; see gpu_check.c. */
#include "gpu_check.h"

/* ---- the model families: fixtures and synthetic models with the new parts ------------- */

/* fixture tokens and transformers' logits (tests/scripts/hf_family_fixtures.py ref.bin) */
typedef struct {
    int V, T;
    int32_t tokens[64];
    float *logits;
} fam_ref;

static int fam_ref_read(const char *path, fam_ref *r)
{
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char magic[8];
    int ok = fread(magic, 8, 1, f) == 1 && !memcmp(magic, "KVQREF1\0", 8) && fread(&r->V, 4, 1, f) == 1 && fread(&r->T, 4, 1, f) == 1 &&
             r->T > 0 && r->T <= 64 && r->V > 0 && fread(r->tokens, 4, (size_t)r->T, f) == (size_t)r->T;
    r->logits = ok ? malloc((size_t)r->T * r->V * 4) : NULL;
    ok = ok && r->logits && fread(r->logits, 4, (size_t)r->T * r->V, f) == (size_t)r->T * r->V;
    fclose(f);
    return ok;
}

/* observe: post-RoPE K and V of every layer into [n_layers][T][kv_dim] (a real prefix) */
typedef struct {
    float *k, *v;
} kv_cap;
static kvq_status kv_cap_observe(void *user, const kvq_layer_ctx *ctx, const kvq_layer_obs *obs, kvq_err *err)
{
    (void)err;
    kv_cap *c = user;
    size_t n = (size_t)ctx->T * ctx->n_kv_heads * ctx->head_dim;
    memcpy(c->k + (size_t)ctx->layer * n, obs->k_post, n * 4);
    memcpy(c->v + (size_t)ctx->layer * n, obs->v, n * 4);
    return KVQ_OK;
}

/* forward CPU vs GPU over tokens[0..Tfull) (and vs ref_logits when given); then the backward of window
 * tokens[P..P+Tb) after the prefix tokens[0..P) and the attention statistics, CPU vs GPU; returns pass */
static int family_check(const char *label, const kvq_model *m, const int32_t *tokens, int Tfull, const float *ref_logits, int Tb,
                        int P, kvq_device gdev)
{
    kvq_err err = {0};
    const kvq_hparams *hp = &m->hp;
    int ok = 1;
    {
        kvq_engine cpu, gpu;
        TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, m, Tfull, 0, 0, &err));
        TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, m, Tfull, 0, 0, &err));
        size_t n = (size_t)Tfull * hp->vocab_size;
        float *lc = malloc(n * 4), *lg = malloc(n * 4);
        kvq_fwd_io io = {.tokens = tokens, .T = Tfull, .pos0 = 0, .logits = lc};
        kvq_fwd_result rc, rg;
        TRYE(kvq_engine_run(&cpu, &io, &rc, &err));
        io.logits = lg;
        TRYE(kvq_engine_run(&gpu, &io, &rg, &err));
        double e = rel_l2(lg, lc, n), el = fabs(rg.loss - rc.loss) / fabs(rc.loss), er = ref_logits ? rel_l2(lg, ref_logits, n) : 0;
        int pass = e <= 1e-5 && el <= 1e-5 && er <= 1e-4;
        printf("\n%s: forward of %d tokens: GPU vs CPU logits rel L2 %.2e, loss %.2e; GPU vs transformers %s%.2e: %s\n\n", label, Tfull,
               e, el, ref_logits ? "" : "(no reference) ", er, pass ? "PASS" : "FAIL");
        ok &= pass;
        free(lc), free(lg);
        kvq_engine_free(&cpu);
        kvq_engine_free(&gpu);
    }
    size_t pn = (size_t)hp->n_layers * P * kvq_kv_dim(hp);
    float *pk = malloc(pn * 4 + 4), *pv = malloc(pn * 4 + 4);
    kvq_prefix px = {.P = P, .k = pk, .v = pv};
    if (P) {
        kvq_forward fw;
        TRYE(kvq_forward_init(&fw, m, P, 0, 0, &err));
        kv_cap c = {pk, pv};
        kvq_hooks hk = {.user = &c, .observe = kv_cap_observe};
        kvq_fwd_io io = {.tokens = tokens, .T = P, .pos0 = 0, .hooks = &hk};
        kvq_fwd_result r;
        TRYE(kvq_forward_run(&fw, &io, &r, &err));
        kvq_forward_free(&fw);
    }
    const kvq_prefix *pp = P ? &px : NULL;
    kvq_engine cpu, gpu;
    TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, m, Tb, P, KVQ_ENGINE_BACKWARD, &err));
    TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, m, Tb, P, KVQ_ENGINE_BACKWARD, &err));
    kvq_kv_desc fp = {0};
    fp.q.fam = KVQ_FAM("fp32");
    bwd_header();
    ok &= bwd_compare(&cpu, &gpu, hp, &fp, 0, label, tokens + P, Tb, pp, 1e-4);
    printf("\n| scheme | layer | mass | entropy | sum(mass)/(heads*T) | |\n|---|---|---|---|---|---|\n");
    for (int l = 0; l < hp->n_layers; l++) ok &= stats_check(&cpu, &gpu, hp, &fp, label, tokens + P, Tb, pp, l);
    kvq_engine_free(&cpu);
    kvq_engine_free(&gpu);
    free(pk), free(pv);
    return ok;
}

int run_families(const char *dir, kvq_device gdev)
{
    static const char *const names[] = {"llama31", "llama-yarn", "llama-dynamic", "llama-linear", "qwen2", "qwen3", "mistral"};
    int all_ok = 1;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char ck[4096], gg[4096], rp[4200];
        snprintf(ck, sizeof ck, "%s/hf-%s", dir, names[i]);
        snprintf(gg, sizeof gg, "%s/hf-%s.gguf", dir, names[i]);
        snprintf(rp, sizeof rp, "%s/ref.bin", ck);
        fam_ref ref;
        if (!fam_ref_read(rp, &ref)) DIE("%s: cannot read the reference (tests/scripts/hf_family_fixtures.py writes it)", rp);
        const char *paths[2] = {ck, gg};
        for (int src = 0; src < 2; src++) {
            if (src == 1 && access(gg, R_OK) != 0) continue;
            for (int w = 0; w < 2; w++) {
                kvq_model m;
                kvq_err err = {0};
                kvq_load_opts lo = {.weights = w ? KVQ_WEIGHTS_NATIVE : KVQ_WEIGHTS_F32};
                TRYE(kvq_model_load_opts(paths[src], &lo, &m, &err));
                char label[256];
                snprintf(label, sizeof label, "%s (%s, %s weights)", names[i], src ? "GGUF" : "HF", m.weights_desc);
                printf("\n### family %s: %s, head_dim %d, RoPE %s, window %d\n", label, kvq_arch_name(m.hp.arch), m.hp.head_dim,
                       kvq_rope_scaling_name(m.hp.rope_scaling), m.hp.sliding_window);
                /* transformers' logits are for the HF weights; the llama3 GGUF's frequency table differs in the last bits */
                all_ok &= family_check(label, &m, ref.tokens, ref.T, ref.logits, 24, 3, gdev);
                kvq_model_free(&m);
            }
        }
        free(ref.logits);
    }
    /* synthetic models with every new part, sized so that the kernels' query and key tiles and the window's tile
     * skipping are exercised: head_dim 128 (16 queries per block) and 64 (32) */
    struct { int L, dim, nh, nkv, hd, hid, V, bias, qkn, win, yarn, T, P; } cfg[] = {
        {2, 256, 4, 2, 128, 512, 600, 1, 1, 40, 0, 300, 5},   /* Qwen3-like: q/k norm, head_dim 128 > dim/heads, window 40 */
        {3, 256, 4, 2, 64, 512, 500, 1, 0, 100, 1, 300, 5},   /* Qwen2-like biases, YaRN, window 100 (layers 1, 2) */
    };
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        kvq_model m;
        synth_model_ex(&m, cfg[c].L, cfg[c].dim, cfg[c].nh, cfg[c].nkv, cfg[c].hd, cfg[c].hid, cfg[c].V, cfg[c].bias, cfg[c].qkn,
                       cfg[c].win, cfg[c].yarn, 3000 + c);
        int Tall = cfg[c].T + cfg[c].P;
        uint64_t s = 555 + c;
        int32_t *tok = malloc((size_t)Tall * sizeof *tok);
        for (int i = 0; i < Tall; i++) tok[i] = (int32_t)(rng_next(&s) % (uint64_t)cfg[c].V);
        char label[200];
        snprintf(label, sizeof label, "synthetic %zu (head_dim %d, bias %d, q/k norm %d, window %d from layer 1, yarn %d)", c, cfg[c].hd,
                 cfg[c].bias, cfg[c].qkn, cfg[c].win, cfg[c].yarn);
        printf("\n### family %s\n", label);
        all_ok &= family_check(label, &m, tok, Tall, NULL, cfg[c].T, cfg[c].P, gdev);
        free(tok);
        kvq_model_free(&m);
    }
    return all_ok;
}

/* Fisher information of calibration windows on the real model, CPU vs GPU. */
int run_fisher_model(const char *model_path, const char *text_path, int ctx, int n_win, kvq_device gdev)
{
    kvq_err err = {0};
    kvq_model m;
    TRYE(kvq_model_load(model_path, &m, &err));
    kvq_tokenizer *tok;
    TRYE(kvq_tokenizer_load(model_path, &tok, &err));
    kvq_text txt;
    TRYE(kvq_text_read(text_path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &txt, &err));
    kvq_windows win;
    TRYE(kvq_calib_windows(&txt, tok, (size_t)n_win, (size_t)ctx, 0, KVQ_BOS_MODEL, &win, &err));
    const kvq_hparams *hp = &m.hp;
    kvq_engine cpu, gpu;
    TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, ctx, 0, KVQ_ENGINE_BACKWARD, &err));
    TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, &m, ctx, 0, KVQ_ENGINE_BACKWARD, &err));
    printf("\n## Fisher information, CPU vs GPU: %s, %d calibration window(s) of %d tokens (kvdump's sampling, seed 0)\n\n",
           model_path, n_win, ctx);
    printf("| window | loss CPU | loss GPU | Fisher K rel L2 (all layers) | worst layer | Fisher V rel L2 | worst layer | s CPU | s GPU |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    int ok = 1;
    grad_rec gc, gg;
    grad_rec_alloc(&gc, hp, ctx, 0);
    grad_rec_alloc(&gg, hp, ctx, 0);
    for (int w = 0; w < n_win; w++) {
        const int32_t *tk = win.tokens + (size_t)w * ctx;
        kvq_fwd_io io = {.tokens = tk, .T = ctx};
        kvq_bwd_spec sc = {.user = &gc.st, .xent = true, .grads = kvq_grad_store_cb};
        kvq_bwd_spec sg = {.user = &gg.st, .xent = true, .grads = kvq_grad_store_cb};
        kvq_bwd_result rc, rg;
        double t0 = now_s();
        TRYE(kvq_engine_backward(&cpu, &io, &sc, &rc, &err));
        double t1 = now_s();
        TRYE(kvq_engine_backward(&gpu, &io, &sg, &rg, &err));
        double t2 = now_s();
        fisher_of(&gc);
        fisher_of(&gg);
        size_t per = (size_t)ctx * gc.kvd, n = per * hp->n_layers;
        double ek = rel_l2(gg.fk, gc.fk, n), ev = rel_l2(gg.fv, gc.fv, n), wk = 0, wv = 0;
        int lk = 0, lv = 0;
        for (int l = 0; l < hp->n_layers; l++) {
            double a = rel_l2(gg.fk + l * per, gc.fk + l * per, per), b = rel_l2(gg.fv + l * per, gc.fv + l * per, per);
            if (a > wk) wk = a, lk = l;
            if (b > wv) wv = b, lv = l;
        }
        int pass = wk <= 1e-3 && wv <= 1e-3 && fabs(rg.loss - rc.loss) <= 1e-5 * fabs(rc.loss);
        ok &= pass;
        printf("| %d | %.6f | %.6f | %.2e | %.2e (layer %d) | %.2e | %.2e (layer %d) | %.1f | %.2f | %s\n", w, rc.loss, rg.loss, ek, wk,
               lk, ev, wv, lv, t1 - t0, t2 - t1, pass ? "PASS" : "FAIL");
        fflush(stdout);
    }
    if (gdev == KVQ_DEVICE_CUDA) {
        double tf, th, tl;
        kvq_forward_cuda_backward_times(gpu.gpu, &tf, &th, &tl);
        printf("\nGPU backward phases (last window): forward %.3f s, LM head %.3f s, layers %.3f s\n", tf, th, tl);
        /* the fast modes' Fisher against the exact CPU one (window 0; information, not a pass criterion) */
        printf("\nFisher information in the fast modes vs the exact CPU (window 0; information)\n\n");
        printf("| mode | loss | Fisher K rel L2 (all layers) | worst layer | Fisher V rel L2 | worst layer | s GPU |\n|---|---|---|---|---|---|---|\n");
        kvq_fwd_io io0 = {.tokens = win.tokens, .T = ctx};
        kvq_bwd_spec sc0 = {.user = &gc.st, .xent = true, .grads = kvq_grad_store_cb};
        kvq_bwd_result rc0;
        TRYE(kvq_engine_backward(&cpu, &io0, &sc0, &rc0, &err));
        fisher_of(&gc);
        for (int fm = 1; fm <= 2; fm++) {
            kvq_cuda_math mm = fm == 1 ? KVQ_CUDA_TF32 : KVQ_CUDA_BF16;
            kvq_engine fe;
            TRYE(kvq_engine_init(&fe, gdev, mm, &m, ctx, 0, KVQ_ENGINE_BACKWARD, &err));
            kvq_bwd_spec sf = {.user = &gg.st, .xent = true, .grads = kvq_grad_store_cb};
            kvq_bwd_result rf;
            double t0 = now_s();
            TRYE(kvq_engine_backward(&fe, &io0, &sf, &rf, &err));
            double t1 = now_s();
            fisher_of(&gg);
            size_t per = (size_t)ctx * gc.kvd, n = per * hp->n_layers;
            double wk = 0, wv = 0;
            int lk = 0, lv = 0;
            for (int l = 0; l < hp->n_layers; l++) {
                double a = rel_l2(gg.fk + l * per, gc.fk + l * per, per), b = rel_l2(gg.fv + l * per, gc.fv + l * per, per);
                if (a > wk) wk = a, lk = l;
                if (b > wv) wv = b, lv = l;
            }
            printf("| %s | %.6f (CPU %.6f) | %.2e | %.2e (layer %d) | %.2e | %.2e (layer %d) | %.2f |\n", kvq_cuda_math_name(mm), rf.loss,
                   rc0.loss, rel_l2(gg.fk, gc.fk, n), wk, lk, rel_l2(gg.fv, gc.fv, n), wv, lv, t1 - t0);
            kvq_engine_free(&fe);
        }
    }
    printf("\nattention statistics on the model, CPU vs GPU (window 0)\n\n");
    printf("| scheme | layer | mass | entropy | sum(mass)/(heads*T) | |\n|---|---|---|---|---|---|\n");
    kvq_kv_desc fp = {.q = {.fam = KVQ_FAM("fp32")}};
    for (int l = 0; l < hp->n_layers; l += hp->n_layers - 1) ok &= stats_check(&cpu, &gpu, hp, &fp, "fp32", win.tokens, ctx, NULL, l);
    grad_rec_free(&gc);
    grad_rec_free(&gg);
    kvq_engine_free(&cpu);
    kvq_engine_free(&gpu);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return ok;
}

/* ---- the real model ------------------------------------------------------------- */

int run_model(const char *model_path, const char *text_path, int ctx, int check_windows, int max_windows, int bench,
              kvq_device gdev)
{
    kvq_err err = {0};
    kvq_model m;
    double t0 = now_s();
    TRYE(kvq_model_load(model_path, &m, &err));
    kvq_tokenizer *tok;
    TRYE(kvq_tokenizer_load(model_path, &tok, &err));
    kvq_text txt;
    TRYE(kvq_text_read(text_path, KVQ_TEXT_RAW, KVQ_EOL_TO_LF, &txt, &err));
    kvq_windows win;
    TRYE(kvq_ppl_windows(&txt, tok, KVQ_PPL_KVQUANT, (size_t)ctx, KVQ_BOS_MODEL, &win, &err));
    const kvq_hparams *hp = &m.hp;
    printf("model: %s (%d layers, dim %d, heads %d/%d, head_dim %d, vocab %d)\n", model_path, hp->n_layers, hp->dim,
           hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->vocab_size);
    printf("text: %s, %zu tokens, ctx %d, %zu windows (kvquant protocol), bos %d; load+tokenize %.1f s\n", text_path,
           win.n_tokens, ctx, win.n_windows, win.bos, now_s() - t0);
    int nwin = (int)win.n_windows;
    if (max_windows > 0 && max_windows < nwin) nwin = max_windows;
    if (check_windows > nwin) check_windows = nwin;

    kvq_engine gpu;
    TRYE(kvq_engine_init(&gpu, gdev, KVQ_CUDA_EXACT, &m, ctx, 0, 0, &err));
    char desc[1024];
    printf("device: %s\n", kvq_engine_describe(&gpu, desc, sizeof desc));

    /* synthetic tables from window 0 (pre-RoPE keys; GPU observe path) */
    synth_tables st4, st3;
    synth_alloc(&st4, hp, 4);
    synth_alloc(&st3, hp, 3);
    {
        calib_user cu = {&st4, ctx};
        kvq_hooks ch = {.user = &cu, .observe = calib_observe};
        kvq_fwd_io io = {.tokens = win.tokens, .T = ctx, .hooks = &ch};
        kvq_fwd_result r;
        TRYE(kvq_engine_run(&gpu, &io, &r, &err));
        memcpy(st3.lower, st4.lower, (size_t)hp->n_layers * st4.kvd * sizeof(float));
        memcpy(st3.upper, st4.upper, (size_t)hp->n_layers * st4.kvd * sizeof(float));
    }
    scheme_list L;
    default_schemes(&L, &st4, hp->head_dim, 1, 128);
    fix_bits(&L, &st3);
    int all_ok = 1;
    all_ok &= bitexact_all(&gpu, hp, &L, win.tokens, ctx, NULL);

    if (check_windows > 0 && gdev == KVQ_DEVICE_CUDA) {
        kvq_engine cpu;
        TRYE(kvq_engine_init(&cpu, KVQ_DEVICE_CPU, KVQ_CUDA_EXACT, &m, ctx, 0, 0, &err));
        printf("\n## CPU vs GPU (exactness mode), %d window(s) of %d tokens, logits over the full vocabulary\n\n", check_windows, ctx);
        float *lc = malloc((size_t)ctx * hp->vocab_size * sizeof(float)), *lg = malloc((size_t)ctx * hp->vocab_size * sizeof(float));
        if (!lc || !lg) DIE("out of memory for logits");
        header();
        for (int i = 0; i < L.n; i++) {
            int native = gpu_native(&L.d[i]);
            cmp_row r = compare(&cpu, &gpu, &L.d[i], win.tokens, check_windows, ctx, NULL, native ? 0 : 1, lc, lg);
            all_ok &= report_row(L.name[i], native ? "native" : "host hook", r, is_exact_scheme(&L.d[i]));
            fflush(stdout);
        }
        cmp_row r = compare(&cpu, &gpu, &L.d[5], win.tokens, 1, ctx, NULL, 1, lc, lg);
        all_ok &= report_row(L.name[5], "host hook", r, 0);
        for (int fm = 1; fm <= 2; fm++) { /* the fast modes against the exact CPU forward (information) */
            kvq_engine fe;
            kvq_cuda_math mm = fm == 1 ? KVQ_CUDA_TF32 : KVQ_CUDA_BF16;
            TRYE(kvq_engine_init(&fe, gdev, mm, &m, ctx, 0, 0, &err));
            cmp_row rf = compare(&cpu, &fe, &L.d[0], win.tokens, check_windows, ctx, NULL, 0, lc, lg);
            report_row("fp32", kvq_cuda_math_name(mm), rf, 0);
            kvq_engine_free(&fe);
        }
        free(lc);
        free(lg);
        kvq_engine_free(&cpu);
    }

    if (bench) {
        double rate = 0, rate32 = 0, rate16 = 0;
        if (gdev == KVQ_DEVICE_CUDA) {
            TRYE(kvq_cuda_sgemm_rate(0, 8192, 7, KVQ_CUDA_EXACT, &rate, &err));
            TRYE(kvq_cuda_sgemm_rate(0, 8192, 7, KVQ_CUDA_TF32, &rate32, &err));
            TRYE(kvq_cuda_sgemm_rate(0, 8192, 7, KVQ_CUDA_BF16, &rate16, &err));
            printf("\ncuBLAS GEMM 8192^3 (median of 7): FP32 pedantic %.1f TFLOP/s, TF32 %.1f TFLOP/s, BF16 (fp32 accumulate) %.1f TFLOP/s\n",
                   rate / 1e12, rate32 / 1e12, rate16 / 1e12);
        }
        double flops_win = kvq_forward_flops(hp, ctx, 0);
        printf("\n## perplexity, kvquant protocol, ctx %d, %d windows (%ld scored tokens per scheme), %.3f TFLOP per scheme\n\n",
               ctx, nwin, (long)nwin * (ctx - 1), flops_win * nwin / 1e12);
        printf("| scheme | mode | PPL | seconds | TFLOP/s | fraction of cuBLAS SGEMM |\n|---|---|---|---|---|---|\n");
        int targets[ctx];
        for (int t = 0; t < ctx; t++) targets[t] = -2; /* placeholder, set per window */
        for (int i = 0; i <= L.n + 1; i++) {
            kvq_engine *e = &gpu, fast;
            const kvq_kv_desc *d = i < L.n ? &L.d[i] : &L.d[0];
            const char *mode = "exact (FP32)";
            if (i >= L.n) { /* fp32 in the fast modes (TF32, BF16), labelled */
                if (gdev != KVQ_DEVICE_CUDA) break;
                kvq_cuda_math mm = i == L.n ? KVQ_CUDA_TF32 : KVQ_CUDA_BF16;
                TRYE(kvq_engine_init(&fast, gdev, mm, &m, ctx, 0, 0, &err));
                e = &fast;
                mode = kvq_cuda_math_name(mm);
            }
            /* rotated schemes: no native transform, the host hook between GPU layers (as kveval runs them) */
            kvq_kv_desc_run hrun = {0};
            kvq_hooks hh = {0};
            int native = gpu_native(d);
            TRYE(kvq_engine_set_kv(e, native ? d : NULL, &err));
            if (!native) {
                kvq_kv_desc_hooks(&hrun, d, &hh);
                mode = "exact (FP32), host hook";
            }
            double nll = 0;
            long n_sc = 0;
            double t1 = now_s();
            for (int w = 0; w < nwin; w++) {
                const int32_t *wt = win.tokens + (size_t)w * ctx;
                for (int t = 0; t < ctx; t++) targets[t] = t + 1 < ctx ? wt[t + 1] : -1;
                kvq_fwd_io io = {.tokens = wt, .T = ctx, .targets = targets, .hooks = native ? NULL : &hh};
                kvq_fwd_result r;
                TRYE(kvq_engine_run(e, &io, &r, &err));
                nll += r.loss * r.n_scored;
                n_sc += r.n_scored;
            }
            double sec = now_s() - t1;
            kvq_kv_desc_run_free(&hrun);
            double fl = flops_win * nwin / sec;
            printf("| %s | %s | %.4f | %.2f | %.1f | %.2f |\n", i < L.n ? L.name[i] : "fp32", mode, exp(nll / n_sc), sec,
                   fl / 1e12, rate > 0 ? fl / (i == L.n ? rate32 : i > L.n ? rate16 : rate) : 0.0);
            fflush(stdout);
            if (i >= L.n) kvq_engine_free(&fast);
        }
        if (gdev == KVQ_DEVICE_CUDA) {
            kvq_cuda_stats s;
            kvq_forward_cuda_stats(gpu.gpu, &s);
            printf("\nGPU workspace: %llu runs, %llu native / %llu host transforms, %llu / %llu K/V outliers kept, %.1f s in run\n",
                   (unsigned long long)s.runs, (unsigned long long)s.native_transforms, (unsigned long long)s.host_transforms,
                   (unsigned long long)s.k_outliers, (unsigned long long)s.v_outliers, s.seconds);
        }
    }
    synth_free(&st4);
    synth_free(&st3);
    kvq_engine_free(&gpu);
    kvq_windows_free(&win);
    kvq_text_free(&txt);
    kvq_tokenizer_free(tok);
    kvq_model_free(&m);
    return all_ok;
}

