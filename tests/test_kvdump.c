/* test_kvdump.c — the kvdump command end to end on the tiny aidreams260K
 * llama2.c model (../shared), checked against independent references: RoPE
 * recomputed here in double, attention mass summing to the number of queries,
 * tokens equal to the calibration windows; and every bad-input path of the
 * CLI (exit status, message, nothing overwritten). */
#include <math.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "backward.h"
#include "dump.h"
#include "model.h"
#include "kvq_test.h"
#include "text.h"
#include "tokenizer.h"

static char g_model[4096], g_tok[4096], g_text[4096], g_bin[4096];

static bool have_inputs(void)
{
    return kvq_test_shared(g_model, sizeof g_model, "models/llama2c/aidreams260K.bin") &&
           kvq_test_shared(g_tok, sizeof g_tok, "models/llama2c/aidreams-tok512.bin") &&
           kvq_test_shared(g_text, sizeof g_text, "datasets/wikitext-2/wiki.valid.tokens") &&
           kvq_test_bin(g_bin, sizeof g_bin, "kvdump");
}

/* Run a shell command; return its exit status, and its stderr in err_out. */
static int run(const char *cmd, char *err_out, size_t n)
{
    char full[20300], errf[128];
    snprintf(errf, sizeof errf, "/tmp/kvq_test_kvdump_err_%d.txt", (int)getpid());
    snprintf(full, sizeof full, "%s 2>%s", cmd, errf);
    int st = system(full);
    FILE *f = fopen(errf, "r");
    size_t got = f ? fread(err_out, 1, n - 1, f) : 0;
    err_out[got] = 0;
    if (f) fclose(f);
    unlink(errf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void tmpname(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/kvq_test_kvdump_%d_%s.h5", (int)getpid(), tag);
    unlink(buf);
    char p[4200];
    snprintf(p, sizeof p, "%s.partial", buf);
    unlink(p);
}

START_TEST(test_dump_values)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char out[256], cmd[20000], msg[8192];
    tmpname(out, sizeof out, "ok");
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 2 -L 64 --seed 3 --attn-stats --q --fisher --dtype f32 -o %s",
             g_bin, g_model, g_tok, g_text, out);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "kvdump failed: %s", msg);
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(out, &r, &e) == KVQ_OK, "%s", e.msg);
    const kvq_dump_meta *m = kvq_dump_reader_meta(r);
    ck_assert_int_eq(m->n_samples, 2);
    ck_assert_int_eq(m->seq_len, 64);
    ck_assert_int_eq(m->n_layers, 4);
    ck_assert_int_eq(m->head_dim, 16);
    ck_assert(m->has_attn_stats && m->has_q && m->has_fisher);
    /* tokens are the seeded calibration windows */
    kvq_tokenizer *tok;
    ck_assert(kvq_tokenizer_load(g_tok, &tok, &e) == KVQ_OK);
    kvq_text txt;
    ck_assert(kvq_text_read(g_text, KVQ_TEXT_WIKITEXT_TOKENS, KVQ_EOL_TO_LF, &txt, &e) == KVQ_OK);
    kvq_windows w;
    ck_assert(kvq_calib_windows(&txt, tok, 2, 64, 3, KVQ_BOS_MODEL, &w, &e) == KVQ_OK);
    int32_t toks[128];
    ck_assert(kvq_dump_read_tokens(r, 0, 2, toks, &e) == KVQ_OK);
    for (int i = 0; i < 128; i++) ck_assert_int_eq(toks[i], w.tokens[i]);
    for (int i = 0; i < 2; i++) ck_assert_int_eq(m->sample_offsets[i], (int64_t)w.offsets[i]);
    /* k = RoPE(k_pre) (interleaved pairs, theta 10000, rotary dim = head_dim) in double */
    int L = 64, H = m->n_kv_heads, D = m->head_dim;
    float *kp = malloc(sizeof(float) * L * H * D), *k = malloc(sizeof(float) * L * H * D), *am = malloc(sizeof(float) * m->n_heads * L);
    for (int layer = 0; layer < 4; layer++)
        for (int smp = 0; smp < 2; smp++) {
            ck_assert(kvq_dump_read(r, layer, KVQ_DUMP_K_PRE_ROPE, smp, kp, &e) == KVQ_OK);
            ck_assert(kvq_dump_read(r, layer, KVQ_DUMP_K, smp, k, &e) == KVQ_OK);
            double worst = 0;
            for (int t = 0; t < L; t++)
                for (int h = 0; h < H; h++)
                    for (int i = 0; i < D / 2; i++) {
                        double f = t * pow(10000.0, -2.0 * i / D), c = cos(f), s = sin(f);
                        const float *a = kp + ((size_t)t * H + h) * D + 2 * i;
                        const float *b = k + ((size_t)t * H + h) * D + 2 * i;
                        double r0 = a[0] * c - a[1] * s, r1 = a[0] * s + a[1] * c;
                        double sc = 1 + fabs(a[0]) + fabs(a[1]);
                        worst = fmax(worst, fmax(fabs(r0 - b[0]), fabs(r1 - b[1])) / sc);
                    }
            ck_assert_msg(worst < 1e-5, "layer %d sample %d: k vs RoPE(k_pre) rel err %g", layer, smp, worst);
            /* every query's attention sums to 1: per head, received mass sums to L */
            ck_assert(kvq_dump_read(r, layer, KVQ_DUMP_ATTN_RECEIVED, smp, am, &e) == KVQ_OK);
            for (int h = 0; h < m->n_heads; h++) {
                double sum = 0;
                for (int t = 0; t < L; t++) sum += am[h * L + t];
                ck_assert_msg(fabs(sum - L) < 1e-3, "layer %d head %d: mass %g != %d", layer, h, sum, L);
                /* causal: the last position is attended only by itself, at most 1 */
                ck_assert(am[h * L + L - 1] <= 1.0f + 1e-6f);
            }
        }
    /* Fisher information = squared gradients of each sample's mean next-token
     * cross-entropy, as a direct backward call gives them */
    kvq_model model;
    ck_assert(kvq_model_load(g_model, &model, &e) == KVQ_OK);
    kvq_backward bw;
    ck_assert(kvq_backward_init(&bw, &model, L, 0, &e) == KVQ_OK);
    size_t per = (size_t)4 * L * H * D;
    kvq_grad_store st = {.dk_pre = malloc(sizeof(float) * per), .dv = malloc(sizeof(float) * per)};
    float *fk = malloc(sizeof(float) * L * H * D), *fv = malloc(sizeof(float) * L * H * D);
    for (int smp = 0; smp < 2; smp++) {
        int ids[64];
        for (int t = 0; t < L; t++) ids[t] = toks[smp * L + t];
        kvq_fwd_io io = {.tokens = ids, .T = L};
        kvq_bwd_result res;
        ck_assert_msg(kvq_backward_xent(&bw, &io, &st, &res, &e) == KVQ_OK, "%s", e.msg);
        for (int layer = 0; layer < 4; layer++) {
            ck_assert(kvq_dump_read(r, layer, KVQ_DUMP_FISHER_K_PRE_ROPE, smp, fk, &e) == KVQ_OK);
            ck_assert(kvq_dump_read(r, layer, KVQ_DUMP_FISHER_V, smp, fv, &e) == KVQ_OK);
            double nz = 0;
            for (int i = 0; i < L * H * D; i++) {
                float gk = st.dk_pre[(size_t)layer * L * H * D + i], gv = st.dv[(size_t)layer * L * H * D + i];
                ck_assert_msg(fk[i] == gk * gk && fv[i] == gv * gv, "layer %d sample %d elem %d: fisher %g/%g vs grad^2 %g/%g",
                              layer, smp, i, fk[i], fv[i], gk * gk, gv * gv);
                nz += fk[i] > 0;
            }
            ck_assert_msg(nz > L * H * D / 2, "layer %d: Fisher mostly zero", layer);
        }
    }
    free(fk);
    free(fv);
    free(st.dk_pre);
    free(st.dv);
    kvq_backward_free(&bw);
    kvq_model_free(&model);
    free(kp);
    free(k);
    free(am);
    kvq_dump_close(r);
    kvq_windows_free(&w);
    kvq_text_free(&txt);
    kvq_tokenizer_free(tok);
    unlink(out);
}
END_TEST

static int expect_fail(const char *args, const char *out, const char *needle)
{
    char cmd[20000], msg[8192];
    snprintf(cmd, sizeof cmd, "%s -q %s -o %s", g_bin, args, out);
    int rc = run(cmd, msg, sizeof msg);
    ck_assert_msg(rc != 0, "accepted: %s", cmd);
    ck_assert_msg(strstr(msg, needle), "'%s' not in: %s (cmd %s)", needle, msg, cmd);
    ck_assert_msg(!strstr(msg, "Sanitizer") && !strstr(msg, "HDF5-DIAG"), "noise: %s", msg);
    return rc;
}

START_TEST(test_bad_input)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char out[256], args[16384];
    tmpname(out, sizeof out, "bad");
    snprintf(args, sizeof args, "-m /nonexistent/m.bin --tokenizer %s -t %s -n 1 -L 32", g_tok, g_text);
    expect_fail(args, out, "/nonexistent/m.bin");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t /nonexistent/t.txt -n 1 -L 32", g_model, g_tok);
    expect_fail(args, out, "/nonexistent/t.txt");
    snprintf(args, sizeof args, "-m %s -t %s -n 1 -L 32", g_model, g_text);
    expect_fail(args, out, "--tokenizer");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 200", g_model, g_tok, g_text);
    expect_fail(args, out, "exceeds the model's context length 128");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32 --layers 2-9", g_model, g_tok, g_text);
    expect_fail(args, out, "inside 0-3");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32 --layers x", g_model, g_tok, g_text);
    expect_fail(args, out, "--layers");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 0", g_model, g_tok, g_text);
    ck_assert_int_eq(expect_fail(args, out, "--samples"), 2); /* the command line */
    /* a tokenizer larger than the model's vocabulary fails at load, naming both sizes (it used to
     * fail at sample 0 on an out-of-range id) */
    {
        char big[4096];
        if (kvq_test_shared(big, sizeof big, "tokenizer-conformance/ggml-vocab-starcoder.gguf")) {
            snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32", g_model, big, g_text);
            expect_fail(args, out, "tokenizer has 49152 tokens, the model's vocabulary only 512");
        }
    }
    /* corpus shorter than one window */
    char small[128];
    snprintf(small, sizeof small, "/tmp/kvq_test_kvdump_%d_small.txt", (int)getpid());
    FILE *f = fopen(small, "w");
    fputs("Once upon a time there was a cat.\n", f);
    fclose(f);
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 64", g_model, g_tok, small);
    ck_assert_int_eq(expect_fail(args, out, small), 1); /* the text's content: exit 1 as kveval (it was 2) */
    /* -o the text (or a directory), even with --force: refused before any work, the text intact (a
     * directory used to fail only after the whole dump, leaving DIR.partial) */
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 16 --force", g_model, g_tok, small);
    expect_fail(args, small, "the same file as --text");
    {
        char *t = kvq_test_slurp(small, NULL);
        ck_assert_msg(t && !strcmp(t, "Once upon a time there was a cat.\n"), "the text was modified");
        free(t);
    }
    char dirout[160], partial[200];
    snprintf(dirout, sizeof dirout, "/tmp/kvq_test_kvdump_%d_dir", (int)getpid());
    snprintf(partial, sizeof partial, "%s.partial", dirout);
    ck_assert_int_eq(mkdir(dirout, 0755), 0);
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32 --force", g_model, g_tok, g_text);
    expect_fail(args, dirout, "is a directory");
    ck_assert(access(partial, F_OK) != 0);
    rmdir(dirout);
    unlink(small);
    ck_assert(access(out, F_OK) != 0);
    /* output directory not writable / absent */
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32", g_model, g_tok, g_text);
    expect_fail(args, "/nonexistent/dir/x.h5", "/nonexistent/dir/x.h5");
}
END_TEST

/* --device: a bad name is a usage error (exit 2); cpu runs and says so; cuda
 * without a usable GPU fails naming --device cpu and leaves no file. */
START_TEST(test_device_option)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char out[256], cmd[20000], msg[8192];
    tmpname(out, sizeof out, "dev");
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 1 -L 32 --device gpu -o %s", g_bin, g_model, g_tok, g_text, out);
    ck_assert_int_eq(run(cmd, msg, sizeof msg), 2);
    ck_assert_msg(strstr(msg, "expected cpu, cuda, cuda:N or auto"), "%s", msg);
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 1 -L 32 --math fp8 -o %s", g_bin, g_model, g_tok, g_text, out);
    ck_assert_int_eq(run(cmd, msg, sizeof msg), 2);
    ck_assert_msg(strstr(msg, "--math") && strstr(msg, "fp8"), "%s", msg);
    ck_assert(access(out, F_OK) != 0);
    snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s -n 1 -L 32 --device cpu -o %s", g_bin, g_model, g_tok, g_text, out);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "%s", msg);
    ck_assert_msg(strstr(msg, "kvdump: device: CPU"), "%s", msg);
    unlink(out);
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 1 -L 32 --device cuda -o %s", g_bin, g_model, g_tok, g_text, out);
    int rc = run(cmd, msg, sizeof msg);
    if (rc != 0) { /* no usable GPU here (CI) */
        fprintf(stderr, "INFO kvdump --device cuda: exit %d: %s", rc, msg);
        ck_assert_int_eq(rc, 1);
        ck_assert_msg(strstr(msg, "--device cpu"), "%s", msg);
        ck_assert(access(out, F_OK) != 0);
    }
    unlink(out);
}
END_TEST

START_TEST(test_existing_output_kept)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char out[256], args[16384];
    tmpname(out, sizeof out, "exists");
    FILE *f = fopen(out, "w");
    fputs("precious", f);
    fclose(f);
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32", g_model, g_tok, g_text);
    expect_fail(args, out, "--force");
    char buf[32] = {0};
    f = fopen(out, "r");
    ck_assert(fread(buf, 1, sizeof buf - 1, f) == 8);
    fclose(f);
    ck_assert_str_eq(buf, "precious");
    unlink(out);
}
END_TEST

START_TEST(test_file_size_limit_then_resume)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char out[256], cmd[20000], msg[8192], partial[300];
    tmpname(out, sizeof out, "fsize");
    snprintf(partial, sizeof partial, "%s.partial", out);
    /* 3 samples x 128 tokens x 4 layers x 3 x 64 floats x 4 B = ~1.2 MB; cap at 900 KiB (bash counts 1024-byte blocks): 2 samples commit, the 3rd fails */
    snprintf(cmd, sizeof cmd,
             "bash -c 'ulimit -f 900; exec %s -q -m %s --tokenizer %s -t %s -n 3 -L 128 --dtype f32 --deflate 0 -o %s'",
             g_bin, g_model, g_tok, g_text, out);
    int rc = run(cmd, msg, sizeof msg);
    ck_assert_msg(rc != 0, "file-size limit not hit");
    ck_assert_msg(strstr(msg, out), "no path in: %s", msg);
    ck_assert_msg(access(out, F_OK) != 0, "final name appeared");
    ck_assert_msg(access(partial, F_OK) == 0, "no partial kept");
    /* resume with another seed is refused, naming the attribute */
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 3 -L 128 --dtype f32 --deflate 0 --seed 9 --resume -o %s",
             g_bin, g_model, g_tok, g_text, out);
    ck_assert(run(cmd, msg, sizeof msg) != 0);
    ck_assert_msg(strstr(msg, "seed") || strstr(msg, "sample_offsets"), "mismatch not named: %s", msg);
    /* the same request resumes and completes; --deflate there is noted, not silently ignored (the
     * resumed dump keeps the filters it records) */
    snprintf(cmd, sizeof cmd, "%s -m %s --tokenizer %s -t %s -n 3 -L 128 --dtype f32 --deflate 5 --resume -o %s",
             g_bin, g_model, g_tok, g_text, out);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "resume failed: %s", msg);
    ck_assert_msg(strstr(msg, "note: --deflate applies when a dump is created; the resumed dump keeps the filters it records"), "%s",
                  msg);
    /* the summary's loss is this run's (the 3rd sample), said so (it read as the mean over all 3) */
    ck_assert_msg(strstr(msg, "3 samples x 128 tokens (mean loss of the 1 samples this run computed "), "%s", msg);
    kvq_dump_reader *r;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_open(out, &r, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_reader_samples_done(r), 3);
    kvq_dump_close(r);
    unlink(out);
}
END_TEST

START_TEST(test_nan_activation_reported)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    /* a copy of aidreams260K with one NaN in layer 1's wk */
    FILE *in = fopen(g_model, "rb");
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    unsigned char *d = malloc(size);
    ck_assert(fread(d, 1, size, in) == (size_t)size);
    fclose(in);
    int32_t h[7];
    memcpy(h, d, sizeof h);
    size_t dim = h[0], L = h[2], V = h[5] < 0 ? -h[5] : h[5], kvd = (size_t)h[4] * (h[0] / h[3]);
    size_t off = 28 + 4 * (V * dim + L * dim + L * dim * dim + 1 * kvd * dim); /* wk of layer 1, element 0 */
    float nanv = NAN;
    memcpy(d + off, &nanv, 4);
    char bad[128], out[256], args[16384];
    snprintf(bad, sizeof bad, "/tmp/kvq_test_kvdump_%d_nan.bin", (int)getpid());
    FILE *o = fopen(bad, "wb");
    fwrite(d, 1, size, o);
    fclose(o);
    free(d);
    tmpname(out, sizeof out, "nan");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32", bad, g_tok, g_text);
    expect_fail(args, out, "layer 1");
    expect_fail(args, out, "sample 0");
    expect_fail(args, out, "position 0, head 0, channel 0: pre-RoPE key is nan");
    ck_assert(access(out, F_OK) != 0);
    unlink(bad);
}
END_TEST

/* A pre-RoPE key beyond the f16 range with the default --dtype f16: refused where
 * it arises (kvdump holds an f16 dump's K/V/Q as f16 until the backward pass
 * is done: the writer's range check runs at capture, with the writer's
 * message); --dtype f32 takes it. */
START_TEST(test_f16_range_reported)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    FILE *in = fopen(g_model, "rb");
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    unsigned char *d = malloc(size);
    ck_assert(fread(d, 1, size, in) == (size_t)size);
    fclose(in);
    int32_t h[7];
    memcpy(h, d, sizeof h);
    size_t dim = h[0], L = h[2], V = h[5] < 0 ? -h[5] : h[5], kvd = (size_t)h[4] * (h[0] / h[3]);
    size_t off = 28 + 4 * (V * dim + L * dim + L * dim * dim + 1 * kvd * dim); /* wk of layer 1, row 0 */
    for (size_t c = 0; c < dim; c++) {
        float big = 1e7f;
        memcpy(d + off + 4 * c, &big, 4);
    }
    char bad[128], out[256], args[16384];
    snprintf(bad, sizeof bad, "/tmp/kvq_test_kvdump_%d_big.bin", (int)getpid());
    FILE *o = fopen(bad, "wb");
    fwrite(d, 1, size, o);
    fclose(o);
    free(d);
    tmpname(out, sizeof out, "big");
    snprintf(args, sizeof args, "-m %s --tokenizer %s -t %s -n 1 -L 32 --fisher", bad, g_tok, g_text);
    expect_fail(args, out, "k_pre_rope: layer 1, sample 0, position 0, head 0, channel 0");
    expect_fail(args, out, "exceeds the f16 range");
    ck_assert(access(out, F_OK) != 0);
    char cmd[4096 + 16384 + 512], err[4096];
    snprintf(cmd, sizeof cmd, "%s %s --dtype f32 -q -o %s", g_bin, args, out);
    ck_assert_msg(run(cmd, err, sizeof err) == 0, "--dtype f32: %s", err);
    unlink(out);
    unlink(bad);
}
END_TEST

/* The default storage is shuffle + deflate (written by kvq's own parallel
 * Huffman-only deflate, formats/DUMP.md): smaller than --deflate 0 and read
 * back to the same values. */
START_TEST(test_deflate_smaller_same_values)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char zout[256], rout[256], cmd[20000], msg[8192];
    tmpname(zout, sizeof zout, "z");
    tmpname(rout, sizeof rout, "raw");
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 2 -L 96 --fisher --attn-stats -o %s", g_bin, g_model,
             g_tok, g_text, zout);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "%s", msg);
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 2 -L 96 --fisher --attn-stats --deflate 0 -o %s", g_bin,
             g_model, g_tok, g_text, rout);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "%s", msg);
    struct stat sz, sr;
    ck_assert(stat(zout, &sz) == 0 && stat(rout, &sr) == 0);
    ck_assert_msg(sz.st_size < sr.st_size * 0.97, "deflate dump %lld bytes vs raw %lld", (long long)sz.st_size,
                  (long long)sr.st_size);
    kvq_dump_reader *a, *b;
    kvq_err e = {0};
    ck_assert(kvq_dump_open(zout, &a, &e) == KVQ_OK && kvq_dump_open(rout, &b, &e) == KVQ_OK);
    const kvq_dump_meta *m = kvq_dump_reader_meta(a);
    for (int ds = 0; ds < KVQ_DUMP_N_DS; ds++) {
        if (!kvq_dump_has(a, 0, (kvq_dump_ds)ds)) continue;
        size_t n = kvq_dump_ds_sample_elems(m, (kvq_dump_ds)ds);
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        for (int layer = 0; layer < m->n_layers; layer++)
            for (int smp = 0; smp < 2; smp++) {
                ck_assert(kvq_dump_read(a, layer, (kvq_dump_ds)ds, smp, x, &e) == KVQ_OK);
                ck_assert(kvq_dump_read(b, layer, (kvq_dump_ds)ds, smp, y, &e) == KVQ_OK);
                ck_assert_msg(memcmp(x, y, n * sizeof *x) == 0, "layer %d %s differs", layer, kvq_dump_ds_name((kvq_dump_ds)ds));
            }
        free(x);
        free(y);
    }
    kvq_dump_close(a);
    kvq_dump_close(b);
    unlink(zout);
    unlink(rout);
}
END_TEST

/* --write-behind on (a writer thread, two sample buffers) writes the same file
 * contents as off, and a write failure in the writer thread (file-size limit)
 * is reported with the path, leaves the committed samples resumable. */
START_TEST(test_write_behind_same_file)
{
    KVQ_SKIP_IF(!have_inputs(), "../shared tiny models/datasets or the kvdump binary absent");
    char aout[256], bout[256], cmd[20000], msg[8192];
    tmpname(aout, sizeof aout, "wb_on");
    tmpname(bout, sizeof bout, "wb_off");
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 3 -L 80 --fisher --attn-stats --q --write-behind on -o %s",
             g_bin, g_model, g_tok, g_text, aout);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "%s", msg);
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 3 -L 80 --fisher --attn-stats --q --write-behind off -o %s",
             g_bin, g_model, g_tok, g_text, bout);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "%s", msg);
    kvq_dump_reader *a, *b;
    kvq_err e = {0};
    ck_assert(kvq_dump_open(aout, &a, &e) == KVQ_OK && kvq_dump_open(bout, &b, &e) == KVQ_OK);
    const kvq_dump_meta *m = kvq_dump_reader_meta(a);
    ck_assert_int_eq(kvq_dump_reader_samples_done(a), 3);
    int compared = 0;
    for (int ds = 0; ds < KVQ_DUMP_N_DS; ds++) {
        if (!kvq_dump_has(a, 0, (kvq_dump_ds)ds)) continue;
        size_t n = kvq_dump_ds_sample_elems(m, (kvq_dump_ds)ds);
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        for (int layer = 0; layer < m->n_layers; layer++)
            for (int smp = 0; smp < 3; smp++) {
                ck_assert(kvq_dump_read(a, layer, (kvq_dump_ds)ds, smp, x, &e) == KVQ_OK);
                ck_assert(kvq_dump_read(b, layer, (kvq_dump_ds)ds, smp, y, &e) == KVQ_OK);
                ck_assert_msg(memcmp(x, y, n * sizeof *x) == 0, "layer %d sample %d %s differs", layer, smp,
                              kvq_dump_ds_name((kvq_dump_ds)ds));
                compared++;
            }
        free(x);
        free(y);
    }
    ck_assert_int_ge(compared, 3 * m->n_layers * 5); /* k_pre, k, v, q, Fisher, attention statistics */
    kvq_dump_close(a);
    kvq_dump_close(b);
    unlink(aout);
    unlink(bout);
    /* a failing write in the writer thread: reported, nothing under the final name, resumable */
    char out[256], partial[300];
    tmpname(out, sizeof out, "wb_fsize");
    snprintf(partial, sizeof partial, "%s.partial", out);
    snprintf(cmd, sizeof cmd,
             "bash -c 'ulimit -f 900; exec %s -q -m %s --tokenizer %s -t %s -n 3 -L 128 --dtype f32 --deflate 0 --write-behind on -o %s'",
             g_bin, g_model, g_tok, g_text, out);
    ck_assert_msg(run(cmd, msg, sizeof msg) != 0, "file-size limit not hit");
    ck_assert_msg(strstr(msg, out), "no path in: %s", msg);
    ck_assert_msg(access(out, F_OK) != 0, "final name appeared");
    snprintf(cmd, sizeof cmd, "%s -q -m %s --tokenizer %s -t %s -n 3 -L 128 --dtype f32 --deflate 0 --resume -o %s", g_bin,
             g_model, g_tok, g_text, out);
    ck_assert_msg(run(cmd, msg, sizeof msg) == 0, "resume failed: %s", msg);
    ck_assert_msg(kvq_dump_open(out, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert_int_eq(kvq_dump_reader_samples_done(a), 3);
    kvq_dump_close(a);
    unlink(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvdump");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_dump_values);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_device_option);
    tcase_add_test(tc, test_existing_output_kept);
    tcase_add_test(tc, test_file_size_limit_then_resume);
    tcase_add_test(tc, test_nan_activation_reported);
    tcase_add_test(tc, test_f16_range_reported);
    tcase_add_test(tc, test_deflate_smaller_same_values);
    tcase_add_test(tc, test_write_behind_same_file);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
