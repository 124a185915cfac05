/* test_kvstat_e2e.c — kvstat end to end: the synthetic data of
 * kvstat_synth.h written as a real kvdump file (formats/dump.h), read back
 * through the dump source (same statistics as from memory, bit for bit), an
 * nuq artifact fitted on it with kernels/quant/tables.h, and bin/kvstat run on both:
 * JSON/HTML outputs, and the bad-input exits (layer out of range, attention
 * plot without attn_received, artifact for another model, another schema
 * version, bad option). The CLI part skips if bin/kvstat is not built. */
#include <hdf5.h>
#include <cjson/cJSON.h>
#include <dirent.h>
#include <sys/stat.h>

#include "artifact.h"
#include "dump.h"
#include "kvq_test.h"
#include "kvsrc.h"
#include "kvstat_synth.h"
#include "kvstats.h"
#include "tables.h"

static void tmpdir(char *b, size_t n)
{
    snprintf(b, n, "/tmp/kvq_e2e_XXXXXX");
    ck_assert(mkdtemp(b) != NULL);
}

/* KVQ_E2E_KEEP=1 keeps the temporary directory (to look at the page). */
static void rmdir_r(const char *d)
{
    if (getenv("KVQ_E2E_KEEP")) { fprintf(stderr, "kept %s\n", d); return; }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
    ck_assert(system(cmd) == 0);
}

static void write_dump(const char *path, const synth_t *y, bool attn)
{
    kvq_dump_meta m;
    memset(&m, 0, sizeof m);
    snprintf(m.kvq_version, sizeof m.kvq_version, "0.1.0-test");
    snprintf(m.model_path, sizeof m.model_path, "models/synthetic.gguf");
    snprintf(m.model_sha256, sizeof m.model_sha256, "%064d", 7);
    snprintf(m.model_arch, sizeof m.model_arch, "llama");
    kvq_hparams hp = {.n_layers = SY_NL, .dim = 64, .hidden_dim = 128, .n_heads = SY_H, .n_kv_heads = SY_HKV,
                      .head_dim = SY_D, .vocab_size = 4000, .ctx_len = 128, .rope_dim = SY_D, .rope_theta = 10000.0f,
                      .rope_scaling = KVQ_ROPE_SCALING_NONE, .rope_scale_factor = 1.0f};
    kvq_dump_meta_set_hparams(&m, &hp);
    snprintf(m.tokenizer, sizeof m.tokenizer, "test");
    snprintf(m.corpus_path, sizeof m.corpus_path, "synthetic");
    snprintf(m.corpus_sha256, sizeof m.corpus_sha256, "%064d", 9);
    snprintf(m.corpus_format, sizeof m.corpus_format, "raw");
    snprintf(m.bos_policy, sizeof m.bos_policy, "prepend");
    int64_t offs[SY_N] = {0, 100, 200};
    m.n_samples = SY_N;
    m.seq_len = SY_L;
    m.sample_offsets = offs;
    m.dtype = KVQ_DUMP_F32;
    m.has_fisher = true;
    m.has_attn_stats = attn;
    m.layer_first = 0;
    m.layer_last = SY_NL - 1;
    snprintf(m.command_line, sizeof m.command_line, "test_kvstat_e2e");
    kvq_dump_opts o = kvq_dump_opts_default();
    o.force = true;
    o.deflate_level = 0;
    kvq_dump_writer *w;
    kvq_err e = {0};
    ck_assert_msg(kvq_dump_create(path, &m, &o, &w, &e) == KVQ_OK, "%s", e.msg);
    float *ent = calloc((size_t)SY_H * SY_L, sizeof(float));
    size_t per = (size_t)SY_L * SY_KV, pa = (size_t)SY_H * SY_L;
    for (int s = 0; s < SY_N; s++) {
        kvq_dump_layer_data d[SY_NL];
        for (int j = 0; j < SY_NL; j++) {
            memset(&d[j], 0, sizeof d[j]);
            d[j].k_pre_rope = y->t[KVQ_KVT_K_PRE_ROPE][j] + s * per;
            d[j].k = y->t[KVQ_KVT_K][j] + s * per;
            d[j].v = y->t[KVQ_KVT_V][j] + s * per;
            d[j].fisher_k_pre_rope = y->t[KVQ_KVT_FISHER_K_PRE_ROPE][j] + s * per;
            d[j].fisher_v = y->t[KVQ_KVT_FISHER_V][j] + s * per;
            if (attn) { d[j].attn_received = y->t[KVQ_KVT_ATTN_RECEIVED][j] + s * pa; d[j].attn_entropy = ent; }
        }
        ck_assert_msg(kvq_dump_write_sample(w, s, y->tokens + s * SY_L, d, &e) == KVQ_OK, "%s", e.msg);
    }
    ck_assert_msg(kvq_dump_finish(w, &e) == KVQ_OK, "%s", e.msg);
    free(ent);
}

static void same_stats(const kvq_kvstats *a, const kvq_kvstats *b)
{
    ck_assert(a->n_stat_layers == b->n_stat_layers && a->kv_dim == b->kv_dim);
    for (int j = 0; j < a->n_stat_layers; j++) {
        for (int t = 0; t < KVQ_KVT_N_STAT; t++) {
            ck_assert(!memcmp(a->layers[j].t[t].chan, b->layers[j].t[t].chan, (size_t)a->kv_dim * sizeof(kvq_chan_stats)));
            ck_assert(!memcmp(a->layers[j].t[t].tok_norm, b->layers[j].t[t].tok_norm, (size_t)SY_N * SY_L * sizeof(float)));
            ck_assert_int_eq(a->layers[j].t[t].n_outliers, b->layers[j].t[t].n_outliers);
        }
        ck_assert_int_eq(a->layers[j].n_sinks, b->layers[j].n_sinks);
        ck_assert_int_eq(a->layers[j].top_pos, b->layers[j].top_pos);
    }
    ck_assert(!memcmp(a->tokens, b->tokens, sizeof(int32_t) * SY_N * SY_L));
}

START_TEST(test_dump_source_equals_memory)
{
    synth_t y;
    ck_assert(synth_init(&y, 1, 1) == 0);
    char dir[64], path[128];
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/d.h5", dir);
    write_dump(path, &y, true);
    kvq_kvsrc src;
    kvq_err e = {0};
    ck_assert_msg(kvq_kvsrc_dump_open(path, &src, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(src.has_attn && src.has_fisher && src.n_samples == SY_N && src.layer_last == SY_NL - 1);
    ck_assert_str_eq(src.model, "synthetic.gguf");
    ck_assert(kvq_kvsrc_dump_meta(&src) != NULL);
    { /* a copy whose model_sha256 attribute is corrupted (one hex digit -> 'z', the HDF5 attribute has no checksum):
       * refused naming the file and the field, as kvcalib refuses it */
        size_t n = 0;
        char *b = kvq_test_slurp(path, &n), want[65], bad[160];
        snprintf(want, sizeof want, "%064d", 7);
        char *at = b ? memmem(b, n, want, 64) : NULL;
        ck_assert_ptr_nonnull(at);
        at[10] = 'z';
        snprintf(bad, sizeof bad, "%s/bad.h5", dir);
        FILE *f = fopen(bad, "wb");
        ck_assert(f && fwrite(b, 1, n, f) == n && fclose(f) == 0);
        free(b);
        kvq_kvsrc sb;
        ck_assert_int_ne(kvq_kvsrc_dump_open(bad, &sb, &e), KVQ_OK);
        ck_assert_msg(strstr(e.msg, bad) && strstr(e.msg, "model_sha256: expected 64 hex digits"), "%s", e.msg);
    }
    kvq_kvstats_opts o = kvq_kvstats_opts_default();
    o.quiet = true;
    kvq_kvstats *a, *b;
    ck_assert_msg(kvq_kvstats_compute(&src, &o, &a, &e) == KVQ_OK, "%s", e.msg);
    ck_assert(kvq_kvstats_compute(&y.src, &o, &b, &e) == KVQ_OK);
    same_stats(a, b);
    ck_assert_int_eq(a->layers[1].t[0].outlier_chan[0], sy_outlier1(1));
    kvq_kvstats_free(a);
    kvq_kvstats_free(b);
    /* the dump's layer range is enforced by the reader */
    float buf[SY_L * SY_KV];
    ck_assert(src.read_rows(src.ctx, 7, KVQ_KVT_K, 0, 0, 4, buf, &e) != KVQ_OK);
    kvq_kvsrc_dump_close(&src);
    rmdir_r(dir);
    synth_free(&y);
}
END_TEST

static void build_artifact(const synth_t *y, int n_layers, kvq_artifact *a)
{
    memset(a, 0, sizeof *a);
    kvq_artifact_params *p = &a->p;
    p->method = KVQ_FAM("nuq");
    p->k_bits = p->v_bits = 3;
    p->outlier_frac = 0.02;
    p->n_sink = 1;
    snprintf(p->fit, sizeof p->fit, "auto");
    p->n_layers = (size_t)n_layers;
    p->n_kv_heads = SY_HKV;
    p->head_dim = SY_D;
    snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "%064d", 7);
    snprintf(p->dump_fingerprint, sizeof p->dump_fingerprint, "test");
    kvq_err e = {0};
    ck_assert_msg(kvq_calib_fill_bits(p, SY_L, &e) == KVQ_OK, "%s", e.msg);
    a->k = calloc((size_t)n_layers, sizeof *a->k);
    a->v = calloc((size_t)n_layers, sizeof *a->v);
    kvq_calib_opts o = {.bits = 3, .outlier_frac = 0.02, .n_sink = 1, .sample_len = SY_L, .n_kv_heads = SY_HKV, .head_dim = SY_D};
    for (int l = 0; l < n_layers; l++) {
        int j = l % SY_NL;
        ck_assert_msg(kvq_calib_keys(y->t[KVQ_KVT_K_PRE_ROPE][j], NULL, (size_t)SY_N * SY_L, &o, &a->k[l], &e) == KVQ_OK, "%s", e.msg);
        ck_assert_msg(kvq_calib_values(y->t[KVQ_KVT_V][j], NULL, (size_t)SY_N * SY_L, &o, &a->v[l], &e) == KVQ_OK, "%s", e.msg);
    }
}

/* Run a command, capture stdout+stderr into out; returns the exit status. */
static int run_cmd(const char *cmd, char *out, size_t n)
{
    char full[2048];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    ck_assert(p != NULL);
    size_t k = fread(out, 1, n - 1, p);
    out[k] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void set_schema_version(const char *path, int64_t v)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0);
    hid_t a = H5Aopen(f, "schema_version", H5P_DEFAULT);
    ck_assert(a >= 0);
    ck_assert(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a);
    H5Fclose(f);
}

START_TEST(test_cli_end_to_end)
{
    char kvstat[512];
    KVQ_SKIP_IF(!kvq_test_bin(kvstat, sizeof kvstat, "kvstat"), "the kvstat binary is not built (make all)");
    synth_t y;
    ck_assert(synth_init(&y, 1, 1) == 0);
    char dir[64], dump[128], noattn[128], art[128], art2[128], cmd[2048];
    static char out[1 << 20];
    tmpdir(dir, sizeof dir);
    snprintf(dump, sizeof dump, "%s/d.h5", dir);
    snprintf(noattn, sizeof noattn, "%s/noattn.h5", dir);
    snprintf(art, sizeof art, "%s/a.safetensors", dir);
    snprintf(art2, sizeof art2, "%s/other.safetensors", dir);
    write_dump(dump, &y, true);
    write_dump(noattn, &y, false);
    kvq_artifact a;
    kvq_err e = {0};
    build_artifact(&y, SY_NL, &a);
    ck_assert_msg(kvq_artifact_write(art, &a, &e) == KVQ_OK, "%s", e.msg);
    kvq_artifact_free(&a);
    build_artifact(&y, SY_NL + 2, &a);
    ck_assert(kvq_artifact_write(art2, &a, &e) == KVQ_OK);
    kvq_artifact_free(&a);

    /* a scheme whose window or sink covers the dump's samples (64 tokens) quantizes nothing: refused with the rule (it
     * printed an error of 0, and its bars were missing from the log-axis figure); one token shorter runs */
    {
        const struct { const char *spec, *needle; } cover[] = {
            {"hh2-w64", "recent window (64) must be shorter than the context (64 tokens)"},
            {"int4+sink64", "64 attention-sink tokens cover the dump's samples of 64 tokens"},
            {"zipcache-w63+sink1", "recent window (63) must be shorter"},
        };
        for (size_t i = 0; i < sizeof cover / sizeof *cover; i++) {
            snprintf(cmd, sizeof cmd, "%s '%s' --scheme '%s' --json '%s/c.json' -q", kvstat, dump, cover[i].spec, dir);
            int crc = run_cmd(cmd, out, sizeof out);
            ck_assert_msg(crc == 1 && strstr(out, cover[i].needle) && strstr(out, "the dump's samples of 64 tokens"), "%s: rc %d: %s",
                          cover[i].spec, crc, out);
        }
        snprintf(cmd, sizeof cmd, "%s '%s' --scheme hh2-w63 --json '%s/c.json' -q", kvstat, dump, dir);
        int crc = run_cmd(cmd, out, sizeof out);
        ck_assert_msg(crc == 0, "hh2-w63: rc %d: %s", crc, out);
    }
    /* an output that is an input is refused before any work, both intact (--json DUMP, --markdown
     * ARTIFACT used to replace them, exit 0) */
    {
        size_t nd0 = 0, nd1 = 0, na0 = 0, na1 = 0;
        char *d0 = kvq_test_slurp(dump, &nd0), *a0 = kvq_test_slurp(art, &na0);
        snprintf(cmd, sizeof cmd, "%s '%s' --json '%s' -q", kvstat, dump, dump);
        int orc = run_cmd(cmd, out, sizeof out);
        ck_assert_msg(orc == 2 && strstr(out, "--json") && strstr(out, "the same file as DUMP"), "rc %d: %s", orc, out);
        snprintf(cmd, sizeof cmd, "%s '%s' --artifact '%s' --markdown '%s/./a.safetensors' -q", kvstat, dump, art, dir);
        orc = run_cmd(cmd, out, sizeof out);
        ck_assert_msg(orc == 2 && strstr(out, "the same file as --artifact"), "rc %d: %s", orc, out);
        char *d1 = kvq_test_slurp(dump, &nd1), *a1 = kvq_test_slurp(art, &na1);
        ck_assert(d0 && d1 && nd0 == nd1 && !memcmp(d0, d1, nd0) && a0 && a1 && na0 == na1 && !memcmp(a0, a1, na0));
        free(d0);
        free(d1);
        free(a0);
        free(a1);
    }
    /* full run */
    snprintf(cmd, sizeof cmd, "%s '%s' --artifact '%s' --layer 2 --head 1 --sample 2 --html '%s/site' --json '%s/s.json' -q",
             kvstat, dump, art, dir, dir);
    int rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0, "rc %d: %s", rc, out);
    ck_assert_msg(strstr(out, "### Quantization error per layer") && strstr(out, "nuq3/3-2% (artifact)"), "%s", out);
    char p[256];
    snprintf(p, sizeof p, "%s/site/index.html", dir);
    FILE *f = fopen(p, "r");
    ck_assert(f != NULL);
    static char html[1 << 23];
    size_t n = fread(html, 1, sizeof html - 1, f);
    html[n] = 0;
    fclose(f);
    int imgs = 0;
    for (char *q = strstr(html, "<img"); q; q = strstr(q + 1, "<img")) imgs++;
    ck_assert_msg(imgs == 8, "%d images in the page", imgs); /* profile, heatmap, outliers, 2 attention, 2 hist, qerr */
    snprintf(p, sizeof p, "%s/site/heatmap_layer2_head1_sample2.svg", dir);
    ck_assert(access(p, R_OK) == 0);
    snprintf(p, sizeof p, "%s/s.json", dir);
    f = fopen(p, "r");
    n = fread(html, 1, sizeof html - 1, f);
    html[n] = 0;
    fclose(f);
    cJSON *root = cJSON_Parse(html);
    ck_assert(root != NULL);
    cJSON *sc = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "quant_error"), "schemes");
    ck_assert_int_eq(cJSON_GetArraySize(sc), 2); /* artifact's nuq3 + int3 per-token (head_dim 16: no KIVI G=32) */
    cJSON *s0 = cJSON_GetArrayItem(sc, 0), *s1 = cJSON_GetArrayItem(sc, 1);
    for (int j = 0; j < SY_NL; j++) {
        double nuq = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, "mse_k"), j)->valuedouble;
        double in3 = cJSON_GetArrayItem(cJSON_GetObjectItem(s1, "mse_k"), j)->valuedouble;
        ck_assert_msg(nuq > 0 && in3 > 0 && nuq < in3, "layer %d: nuq3 MSE %g vs int3 %g", j, nuq, in3);
        double fr = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, "outlier_frac_k"), j)->valuedouble;
        double cal = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, "calib_outlier_frac_k"), j)->valuedouble;
        ck_assert_msg(fabs(fr - cal) < 0.01, "realised %g vs calibrated %g", fr, cal); /* same data: nearly equal */
    }
    cJSON_Delete(root);
    /* every output written under a temporary name and renamed: none left in the page's folder */
    {
        snprintf(p, sizeof p, "%s/site", dir);
        DIR *dd = opendir(p);
        ck_assert(dd != NULL);
        int files = 0;
        for (struct dirent *de; (de = readdir(dd));) {
            ck_assert_msg(!strstr(de->d_name, ".tmp"), "left behind: %s", de->d_name);
            files += de->d_name[0] != '.';
        }
        closedir(dd);
        ck_assert_int_gt(files, 8);
    }
    /* --json - : stdout is the JSON alone (the markdown used to come first: no parser took it);
     * --markdown FILE beside it; both on stdout refused */
    snprintf(cmd, sizeof cmd, "%s '%s' --json - -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0 && out[0] == '{', "rc %d: %.200s", rc, out);
    root = cJSON_Parse(out);
    ck_assert_msg(root != NULL, "stdout is not JSON: %.300s", out);
    ck_assert(cJSON_IsArray(cJSON_GetObjectItem(root, "layers")) && cJSON_IsString(cJSON_GetObjectItem(root, "tool")));
    cJSON_Delete(root);
    snprintf(cmd, sizeof cmd, "%s '%s' --json - --markdown '%s/t.md' -q", kvstat, dump, dir);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0 && out[0] == '{', "rc %d: %.200s", rc, out);
    snprintf(p, sizeof p, "%s/t.md", dir);
    char *md = kvq_test_slurp(p, NULL);
    ck_assert_msg(md && strstr(md, "###"), "%s", md ? md : "(no markdown file)");
    free(md);
    snprintf(cmd, sizeof cmd, "%s '%s' --json - --markdown - -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "both on stdout"), "rc %d: %s", rc, out);
    /* an unfinished dump (kvdump's .partial) is reported with a note saying so (kvcalib refuses one) */
    snprintf(cmd, sizeof cmd, "cp '%s' '%s.partial' && %s '%s.partial' --markdown '%s/partial.md'", dump, dump, kvstat, dump, dir);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "is an unfinished dump: statistics over its 3 complete samples"), "rc %d: %s", rc, out);
    snprintf(p, sizeof p, "%s.partial", dump);
    unlink(p);

    /* bad input */
    struct { const char *args; int rc; const char *needle; } cases[] = {
        {"'%s' --layer 9", 1, "--layer 9: the dump has layers 0..3"},
        {"'%s' --head 2", 1, "the model has 2 KV heads"},
        {"'%s' --sample 3", 1, "the dump has 3 samples"},
        {"'%s' --outlier-mult 0.5", 2, "--outlier-mult"},
        {"'%s' --plot bogus", 2, "--plot: expected one of"},
        {"'%1$s' --plot qerr --plots '%1$s.figs'", 1, "need --artifact"},
        /* figure options without --plots / --html did nothing, exit 0 */
        {"'%s' --plot heatmap", 2, "--plot: selects figures, which only --plots DIR or --html DIR write"},
        {"'%s' --plot-format svg", 2, "--plot-format: selects figures"},
        {"'%s' --attn-scale linear", 2, "--attn-scale: selects figures"},
        {"'%s' extra.h5", 2, "expected one dump file"},
        /* an output directory that is a file or has no parent: refused before any work (a file failed
         * late with cairo's "error while writing to output stream") */
        {"'%1$s' --html '%1$s'", 2, "exists and is not a directory (expected a directory for the page and its figures)"},
        {"'%1$s' --plots '%1$s'", 2, "exists and is not a directory (expected a directory for the figures)"},
        {"'%s' --html /nonexistent/kvq/site", 2, "directory '/nonexistent/kvq' does not exist"},
        /* a trailing slash names the directory itself (README's `--html report/` was refused: "'report' does not exist") */
        {"'%s' --html /nonexistent/kvq/site/", 2, "directory '/nonexistent/kvq' does not exist"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char args[512];
        snprintf(args, sizeof args, cases[i].args, dump);
        snprintf(cmd, sizeof cmd, "%s %s -q", kvstat, args);
        rc = run_cmd(cmd, out, sizeof out);
        ck_assert_msg(rc == cases[i].rc && strstr(out, cases[i].needle), "case %zu: rc %d, output: %s", i, rc, out);
    }
    /* --scheme: a table-free family's resting error (zipcache: the last W tokens exact, the rest at L bits) beside
     * another, no artifact; a scheme that needs tables or does not fit the dump's head_dim is refused before the pass.
     * (Blocks of 4 tokens: with 2, every key is its block's channel min or max and 8-bit codes hit it exactly.) */
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme zipcache-h16-l8-w4 -s int2 --json - -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0 && out[0] == '{', "rc %d: %.300s", rc, out);
    root = cJSON_Parse(out);
    ck_assert(root != NULL);
    sc = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "quant_error"), "schemes");
    ck_assert_int_eq(cJSON_GetArraySize(sc), 2);
    s0 = cJSON_GetArrayItem(sc, 0);
    s1 = cJSON_GetArrayItem(sc, 1);
    ck_assert_str_eq(cJSON_GetObjectItem(s0, "name")->valuestring, "zipcache-h16-l8-b60%-w4-n4");
    for (int j = 0; j < SY_NL; j++)
        for (int w = 0; w < 2; w++) {
            double z = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, w ? "mse_v" : "mse_k"), j)->valuedouble;
            double i2 = cJSON_GetArrayItem(cJSON_GetObjectItem(s1, w ? "mse_v" : "mse_k"), j)->valuedouble;
            ck_assert_msg(z > 0 && z < i2, "layer %d %c: zipcache 8-bit resting MSE %g vs int2 %g", j, w ? 'v' : 'k', z, i2);
        }
    cJSON_Delete(root);
    /* the spec's key stage and rotation are honoured (they were dropped: every --scheme measured post-RoPE keys
     * unrotated): +pre-rope changes the keys' error and leaves the values' bit for bit; +hadamard changes both */
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme int3 --scheme int3+pre-rope --scheme int3+hadamard --json - -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 0 && out[0] == '{', "rc %d: %.300s", rc, out);
    root = cJSON_Parse(out);
    ck_assert(root != NULL);
    sc = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "quant_error"), "schemes");
    ck_assert_int_eq(cJSON_GetArraySize(sc), 3);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(sc, 1), "name")->valuestring, "int3+pre-rope");
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(sc, 2), "name")->valuestring, "int3+hadamard");
    for (int j = 0; j < SY_NL; j++) {
        double e[3][2];
        for (int t = 0; t < 3; t++)
            for (int w = 0; w < 2; w++)
                e[t][w] = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetArrayItem(sc, t), w ? "mse_v" : "mse_k"), j)->valuedouble;
        ck_assert_msg(e[0][0] > 0 && e[1][0] > 0 && e[0][0] != e[1][0], "layer %d: int3 K MSE %g vs +pre-rope %g", j, e[0][0], e[1][0]);
        ck_assert_msg(e[0][1] == e[1][1], "layer %d: V MSE %g vs +pre-rope %g (values have no stage)", j, e[0][1], e[1][1]);
        ck_assert_msg(e[2][0] != e[0][0] && e[2][1] != e[0][1], "layer %d: +hadamard K/V MSE %g/%g equal the unrotated", j,
                      e[2][0], e[2][1]);
    }
    cJSON_Delete(root);
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme int4+intactkv -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "+intactkv changes the prefix"), "rc %d: %s", rc, out);
    /* a spec that does not parse is a bad command line (exit 2, as kveval), before the dump is read */
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme foo4 -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "--scheme foo4") && strstr(out, "unknown scheme"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme zipcache-g5 -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "--scheme zipcache-g5") && strstr(out, "does not divide head_dim 16"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' --scheme mikv-h8-l2 -q", kvstat, dump);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "needs an artifact"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' --plot attention --plots '%s/p' -q", kvstat, noattn, dir);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "re-run kvdump with --attn-stats"), "rc %d: %s", rc, out);
    /* a figure whose data is absent is an error, as attention's (lowrank's wrote nothing, exit 0) */
    snprintf(cmd, sizeof cmd, "%s '%s' --plot lowrank --plots '%s/p' -q", kvstat, dump, dir);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "--plot lowrank needs --artifact FILE of method lowrank"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' --artifact '%s' --plot lowrank --plots '%s/p' -q", kvstat, dump, art, dir);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "; this one is nuq"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' --artifact '%s' -q", kvstat, dump, art2);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "artifact for another model: kvq.n_layers is 6 in the artifact but 4 in the dump"),
                  "rc %d: %s", rc, out);
    set_schema_version(noattn, 2);
    snprintf(cmd, sizeof cmd, "%s '%s' -q", kvstat, noattn);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1 && strstr(out, "schema"), "rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "%s '%s' -q", kvstat, art);
    rc = run_cmd(cmd, out, sizeof out);
    ck_assert_msg(rc == 1, "an artifact given as the dump: rc %d: %s", rc, out);
    rmdir_r(dir);
    synth_free(&y);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstat_e2e");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_dump_source_equals_memory);
    tcase_add_test(tc, test_cli_end_to_end);
    suite_add_tcase(s, tc);
    return s;
}

KVQ_TEST_MAIN(suite)
