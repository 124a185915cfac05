/* kvcalib — turn a kvdump file into quantization tables (nuqX datatypes,
 * per-channel pre-RoPE key thresholds, outlier thresholds; int / int-pc /
 * KIVI settings) in one calibration artifact (formats/ARTIFACT.md).
 *
 *   kvcalib DUMP --method M --bits B --out FILE [options]   calibrate (calib/calibrate.h)
 *   kvcalib DUMP --method fp8 --out FILE [--scale tensor|head] [--percentile P]
 *           [--fp8-format e4m3|e5m2] [--export-vllm FILE]     FP8 cache scales
 *   kvcalib export-vllm ARTIFACT --out FILE [--force]         vLLM k/v_scale safetensors
 *   kvcalib --inspect FILE                                   print an artifact
 *   kvcalib intactkv ...                                     IntactKV prefix (issue 9; not yet)
 *
 * Exit status: 0 success, 1 the calibration or I/O failed (message on
 * stderr, nothing written), 2 bad command line. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "artifact.h"
#include "calibrate.h"
#include "cli.h"
#include "cuda_info.h"
#include "progress.h"

#define PROG "kvcalib"
#define EXIT_USAGE 2

static const char SUMMARY[] =
    "Turn a kvdump HDF5 file into the tables a quantized KV cache needs, written as one\n"
    "calibration artifact (safetensors; formats/ARTIFACT.md).\n"
    "\n"
    "  kvcalib DUMP --method nuq|int|int-pc|kivi --bits B --out FILE [options]\n"
    "  kvcalib DUMP --method fp8 --out FILE [--scale tensor|head] [--percentile P] [--export-vllm FILE]\n"
    "  kvcalib export-vllm ARTIFACT --out FILE [--force]   k/v_scale tensors for a vLLM checkpoint\n"
    "  kvcalib --inspect FILE         print an artifact's summary\n"
    "  kvcalib intactkv ...           IntactKV prefix (not implemented yet)\n"
    "\n"
    "Methods: nuq = KVQuant nuqX (per-channel pre-RoPE keys with offline thresholds, per-token\n"
    "values, Fisher-weighted datatypes); int = uniform per-token K and V; int-pc = uniform with\n"
    "per-channel keys; kivi = KIVI (bits, group size, residual length only); fp8 = FP8 KV-cache scales\n"
    "(vLLM k_scale / v_scale = absmax or a percentile of |x| over post-RoPE keys / values, / 448 for E4M3;\n"
    "per tensor or per KV head; --bits is 8 and may be omitted; docs/fp8-vllm.md).\n"
    "Method defaults (option value -1): --outliers 0.01 for nuq, 0 otherwise; --sink 0 for kivi,\n"
    "1 otherwise; --group 32 for kivi, 0 (whole token) for int/int-pc; --residual 128 for kivi;\n"
    "keys pre-RoPE for nuq, post-RoPE otherwise (as the papers' baselines and KIVI).";

typedef struct {
    const char *method, *keys, *fit, *out, *inspect, *scale, *fp8_format, *export_vllm;
    long bits, sink, group, residual, bits_ctx, threads, seed;
    double outliers, percentile;
    bool no_fisher, per_head, force, quiet, version;
} cli_args;

static int option_table(cli_args *a, kvq_opt *t)
{
    const kvq_opt tab[] = {
        {"method", 'm', KVQ_OPT_CHOICE, &a->method, "M", "quantization scheme", "nuq|int|int-pc|kivi|fp8", 0, 0, false},
        {"bits", 'b', KVQ_OPT_INT, &a->bits, "B", "code bits of keys and values, 1..8 (required to calibrate)", NULL, 0, 0,
         false},
        {"outliers", 0, KVQ_OPT_FLOAT, &a->outliers, "F",
         "dense-and-sparse outlier fraction in [0, 0.5), both tails (-1: method default)", NULL, 0, 0, false},
        {"sink", 0, KVQ_OPT_INT, &a->sink, "N",
         "attention-sink tokens per sample excluded from calibration, kept exact (-1: method default)", NULL, -1, 1e9,
         false},
        {"keys", 0, KVQ_OPT_CHOICE, &a->keys, "POS",
         "keys before or after RoPE (default: pre-rope for nuq, post-rope otherwise)", "pre-rope|post-rope", 0, 0, false},
        {"no-fisher", 0, KVQ_OPT_FLAG, &a->no_fisher, NULL, "nuq: plain (unweighted) k-means instead of Fisher weights",
         NULL, 0, 0, false},
        {"per-head", 0, KVQ_OPT_FLAG, &a->per_head, NULL, "nuq: one datatype per KV head instead of per layer", NULL, 0,
         0, false},
        {"fit", 0, KVQ_OPT_CHOICE, &a->fit, "HOW",
         "nuq datatype fit: Lloyd's weighted k-means, the exact 1-D optimum, or the better of both", "auto|lloyd|exact", 0,
         0, false},
        {"group", 0, KVQ_OPT_INT, &a->group, "G", "int/int-pc: channels per token group; kivi: group size (-1: default)",
         NULL, -1, 1e9, false},
        {"residual", 0, KVQ_OPT_INT, &a->residual, "R", "kivi: full-precision recent tokens (-1: default)", NULL, -1, 1e9,
         false},
        {"scale", 0, KVQ_OPT_CHOICE, &a->scale, "GRAN", "fp8: one scale per layer tensor or per KV head (default tensor)",
         "tensor|head", 0, 0, false},
        {"percentile", 0, KVQ_OPT_FLOAT, &a->percentile, "P",
         "fp8: map this percentile of |x| to the format's max (default 100 = absmax)", NULL, 0, 0, false},
        {"fp8-format", 0, KVQ_OPT_CHOICE, &a->fp8_format, "FMT", "fp8: scales for E4M3FN (vLLM \"fp8\", default) or E5M2",
         "e4m3|e5m2", 0, 0, false},
        {"export-vllm", 0, KVQ_OPT_STRING, &a->export_vllm, "FILE",
         "fp8: also write model.layers.<i>.self_attn.k_scale/v_scale (safetensors) for vLLM", NULL, 0, 0, false},
        {"bits-ctx", 0, KVQ_OPT_INT, &a->bits_ctx, "N", "context length of the bits accounting (0: the dump's seq_len)",
         NULL, 0, 1e9, false},
        {"seed", 0, KVQ_OPT_INT, &a->seed, "S", "k-means++ seed", NULL, 0, 9e15, false},
        {"threads", 'j', KVQ_OPT_INT, &a->threads, "N", "worker threads (0: OpenMP default)", NULL, 0, 4096, false},
        {"out", 'o', KVQ_OPT_STRING, &a->out, "FILE", "artifact to write (required to calibrate)", NULL, 0, 0, false},
        {"force", 'f', KVQ_OPT_FLAG, &a->force, NULL, "replace an existing --out file", NULL, 0, 0, false},
        {"quiet", 'q', KVQ_OPT_FLAG, &a->quiet, NULL, "no progress or summary (errors only)", NULL, 0, 0, false},
        {"inspect", 0, KVQ_OPT_STRING, &a->inspect, "FILE", "print a readable summary of an artifact and exit", NULL, 0,
         0, false},
        {"version", 0, KVQ_OPT_FLAG, &a->version, NULL, "print the kvq version and build (CPU/CUDA)", NULL, 0, 0, false},
    };
    memcpy(t, tab, sizeof tab);
    return (int)(sizeof tab / sizeof *tab);
}

/* ---- progress ------------------------------------------------------------------ */

typedef struct {
    double t0;
    bool quiet;
} progress_ctx;

static const char *chosen_name(uint8_t c)
{
    return c == KVQ_FIT_CHOSEN_LLOYD ? "lloyd" : c == KVQ_FIT_CHOSEN_EXACT ? "exact" : "none";
}

static void on_table(void *vctx, int done, int total, int layer, char kv, const kvq_kv_table *t, double seconds)
{
    progress_ctx *c = vctx;
    if (c->quiet) return;
    fprintf(stderr, "%s: [%d/%d] layer %d %c: %.2f s", PROG, done, total, layer, kv == 'k' ? 'K' : 'V', seconds);
    if (t->n_elems)
        fprintf(stderr, ", outliers %.3f%%", 100.0 * (double)t->n_outliers / (double)t->n_elems);
    for (size_t h = 0; h < t->n_tables; h++) {
        if (t->n_tables > 1) fprintf(stderr, "\n    head %zu:", h);
        fprintf(stderr, ", objective lloyd %.6g exact %.6g -> %s", t->obj_lloyd[h], t->obj_exact[h],
                chosen_name(t->chosen[h]));
    }
    fprintf(stderr, " (%.1f s elapsed)\n", kvq_now() - c->t0);
}

static void print_summary(FILE *f, const char *out, const kvq_artifact *a, double seconds, int threads)
{
    const kvq_artifact_params *p = &a->p;
    fprintf(f, "%s: wrote %s: %s K%d/V%d", PROG, out, kvq_method_name(p->method), p->k_bits, p->v_bits);
    if (p->outlier_frac > 0) fprintf(f, ", outliers %.4g%%", 100 * p->outlier_frac);
    fprintf(f, ", sink %zu, %s keys; %.4f / %.4f bits per K / V element at ctx %zu\n", p->n_sink,
            p->post_rope ? "post-RoPE" : "pre-RoPE", p->bits_k, p->bits_v, p->bits_ctx);
    double tl = 0, te = 0, tc = 0;
    size_t n = 0, exact = 0;
    uint64_t out_n = 0, out_e = 0;
    for (size_t i = 0; i < p->n_layers; i++)
        for (int w = 0; w < 2; w++) {
            const kvq_kv_table *t = w ? (a->v ? &a->v[i] : NULL) : (a->k ? &a->k[i] : NULL);
            if (!t) continue;
            if (w == 0) { out_n += t->n_outliers; out_e += t->n_elems; }
            for (size_t h = 0; h < t->n_tables; h++) {
                if (t->obj_lloyd[h] > 0) tl += t->obj_lloyd[h];
                if (t->obj_exact[h] > 0) te += t->obj_exact[h];
                tc += t->obj_exact[h] >= 0 && (t->obj_lloyd[h] < 0 || t->obj_exact[h] <= t->obj_lloyd[h]) ? t->obj_exact[h]
                                                                                                          : t->obj_lloyd[h];
                exact += t->chosen[h] == KVQ_FIT_CHOSEN_EXACT;
                n++;
            }
        }
    if (out_e) fprintf(f, "%s: key outliers realised %.4f%% of calibration elements\n", PROG, 100.0 * (double)out_n / (double)out_e);
    if (n) {
        fprintf(f, "%s: datatype objectives summed over %zu tables: lloyd %.6g, exact %.6g", PROG, n, tl, te);
        if (tl > 0 && te > 0) fprintf(f, " (exact/lloyd %.5f)", te / tl);
        fprintf(f, "; exact chosen for %zu\n", exact);
    }
    fprintf(f, "%s: calibration time %.2f s (%d thread%s)\n", PROG, seconds, threads, threads == 1 ? "" : "s");
}

/* ---- subcommands ---------------------------------------------------------------- */

/* IntactKV (issue 9): will compute the pivot-token prefix's K/V and add
 * intactkv.* tensors to an artifact (ARTIFACT.md, "Reserved"). */
static int cmd_intactkv(int argc, char **argv)
{
    (void)argv;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s intactkv ...\n\nIntactKV prefix (issue 9): not implemented in this build yet.\n", PROG);
            return 0;
        }
    fprintf(stderr, "%s intactkv: not implemented yet (issue 9)\n", PROG);
    return EXIT_USAGE;
}

/* kvcalib export-vllm ARTIFACT --out FILE [--force] */
static int cmd_export_vllm(int argc, char **argv)
{
    const char *out = NULL;
    bool force = false, quiet = false;
    kvq_opt tab[] = {
        {"out", 'o', KVQ_OPT_STRING, &out, "FILE", "safetensors file to write (required)", NULL, 0, 0, true},
        {"force", 'f', KVQ_OPT_FLAG, &force, NULL, "replace an existing --out file", NULL, 0, 0, false},
        {"quiet", 'q', KVQ_OPT_FLAG, &quiet, NULL, "no summary", NULL, 0, 0, false},
    };
    kvq_strlist pos = {0};
    bool help = false;
    kvq_err e = {0};
    if (kvq_cli_parse(PROG " export-vllm",
                      "Write an fp8 artifact's scales as model.layers.<i>.self_attn.k_scale / v_scale (float32, shape []\n"
                      "or [n_kv_heads]) in a safetensors file to merge into a Hugging Face checkpoint for vLLM\n"
                      "(docs/fp8-vllm.md).\n\n  kvcalib export-vllm ARTIFACT --out FILE [--force]",
                      tab, (int)(sizeof tab / sizeof *tab), argc, argv, &pos, &help, &e)) {
        fprintf(stderr, "%s export-vllm: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    if (help) return 0;
    if (pos.n != 1) {
        fprintf(stderr, "%s export-vllm: expected one ARTIFACT file, found %d arguments\n", PROG, pos.n);
        return EXIT_USAGE;
    }
    kvq_artifact a;
    if (kvq_artifact_read(pos.v[0], &a, &e)) {
        fprintf(stderr, "%s export-vllm: %s\n", PROG, e.msg);
        return 1;
    }
    kvq_status s = kvq_calibrate_export_vllm(&a, out, force, &e);
    if (s) fprintf(stderr, "%s export-vllm: %s: %s\n", PROG, pos.v[0], e.msg);
    else if (!quiet)
        printf("%s: wrote %s: %zu layers, k_scale/v_scale %s\n", PROG, out, a.p.n_layers,
               a.p.per_head ? "[n_kv_heads] per KV head" : "[] per tensor");
    kvq_artifact_free(&a);
    return s ? 1 : 0;
}

static bool parse_method(const char *s, kvq_method *m)
{
    for (int i = 0; i < KVQ_METHOD_COUNT; i++)
        if (!strcmp(s, kvq_method_name((kvq_method)i))) { *m = (kvq_method)i; return true; }
    return false;
}

static int cmd_calibrate(int argc, char **argv)
{
    cli_args a = {.keys = NULL, .fit = "auto", .bits = 0, .sink = -1, .group = -1, .residual = -1,
                  .outliers = -1, .percentile = -1};
    kvq_opt tab[32];
    int n = option_table(&a, tab);
    kvq_strlist pos = {0};
    bool help = false;
    kvq_err e = {0};
    if (kvq_cli_parse(PROG, SUMMARY, tab, n, argc, argv, &pos, &help, &e)) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    if (help) return 0;
    if (a.version) {
        printf("kvcalib (kvq) 0.1.0, %s build\n", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
        return 0;
    }
    if (a.inspect) {
        if (pos.n || a.method || a.out) {
            fprintf(stderr, "%s: --inspect FILE takes no dump, --method or --out\n", PROG);
            return EXIT_USAGE;
        }
        if (kvq_artifact_inspect(stdout, a.inspect, &e)) {
            fprintf(stderr, "%s: %s\n", PROG, e.msg);
            return 1;
        }
        return 0;
    }
    if (pos.n != 1) {
        fprintf(stderr, "%s: expected one DUMP file, found %d arguments (see %s --help)\n", PROG, pos.n, PROG);
        return EXIT_USAGE;
    }
    if (!a.method) { fprintf(stderr, "%s: missing required option --method M (see --help)\n", PROG); return EXIT_USAGE; }
    bool fp8 = !strcmp(a.method, "fp8");
    if (fp8 && !a.bits) a.bits = 8;
    if (fp8 && a.bits != 8) {
        fprintf(stderr, "%s: --bits: fp8 stores 8-bit codes, found %ld (omit --bits)\n", PROG, a.bits);
        return EXIT_USAGE;
    }
    if (!fp8 && (a.scale || a.percentile != -1 || a.fp8_format || a.export_vllm)) {
        fprintf(stderr, "%s: --scale, --percentile, --fp8-format and --export-vllm apply to --method fp8 only\n", PROG);
        return EXIT_USAGE;
    }
    if (!a.bits) { fprintf(stderr, "%s: missing required option --bits B (see --help)\n", PROG); return EXIT_USAGE; }
    if (!a.out) { fprintf(stderr, "%s: missing required option --out FILE (see --help)\n", PROG); return EXIT_USAGE; }
    kvq_method m;
    if (!parse_method(a.method, &m)) { /* the option table already restricts it; kept for safety */
        fprintf(stderr, "%s: --method: unknown method '%s'\n", PROG, a.method);
        return EXIT_USAGE;
    }
    kvq_calibrate_opts o = kvq_calibrate_defaults(m);
    if (a.bits < 1 || a.bits > 8) {
        fprintf(stderr, "%s: --bits: expected 1..8, found %ld\n", PROG, a.bits);
        return EXIT_USAGE;
    }
    o.k_bits = o.v_bits = (int)a.bits;
    if (a.outliers != -1) o.outlier_frac = a.outliers;
    if (a.sink >= 0) o.n_sink = (size_t)a.sink;
    if (a.group >= 0) o.group_size = (size_t)a.group;
    if (a.residual >= 0) o.residual_length = (size_t)a.residual;
    if (a.keys) o.post_rope = !strcmp(a.keys, "post-rope");
    o.fisher = m == KVQ_METHOD_NUQ && !a.no_fisher;
    o.per_head = a.per_head;
    if (fp8) {
        if (a.per_head) {
            fprintf(stderr, "%s: --per-head is for nuq datatypes; fp8 takes --scale head\n", PROG);
            return EXIT_USAGE;
        }
        o.per_head = a.scale && !strcmp(a.scale, "head");
        if (a.percentile != -1) o.fp8_percentile = a.percentile;
        o.fp8_e5m2 = a.fp8_format && !strcmp(a.fp8_format, "e5m2");
        if (a.export_vllm && o.fp8_e5m2) {
            fprintf(stderr, "%s: --export-vllm: vLLM's fp8_e5m2 cache takes no checkpoint scales; export E4M3 scales\n", PROG);
            return EXIT_USAGE;
        }
        if (a.export_vllm && !a.force && access(a.export_vllm, F_OK) == 0) {
            fprintf(stderr, "%s: --export-vllm %s: already exists; not overwritten (use --force to replace it)\n", PROG,
                    a.export_vllm);
            return 1;
        }
    }
    o.fit.method = !strcmp(a.fit, "lloyd") ? KVQ_FIT_LLOYD : !strcmp(a.fit, "exact") ? KVQ_FIT_EXACT : KVQ_FIT_AUTO;
    o.fit.seed = (uint64_t)a.seed;
    o.bits_ctx = (size_t)a.bits_ctx;
    o.n_threads = (int)a.threads;
    if (kvq_calibrate_validate(&o, &e)) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return EXIT_USAGE;
    }
    progress_ctx pc = {.t0 = kvq_now(), .quiet = a.quiet};
    o.on_table = on_table;
    o.on_table_ctx = &pc;
    int threads = o.n_threads > 0 ? o.n_threads : omp_get_max_threads();
    if (!a.quiet)
        fprintf(stderr, "%s: %s -> %s: %s%d, %d thread%s\n", PROG, pos.v[0], a.out, a.method, o.k_bits, threads,
                threads == 1 ? "" : "s");
    kvq_artifact art;
    kvq_status s = kvq_calibrate_file(pos.v[0], a.out, a.force, &o, &art, &e);
    if (s) {
        fprintf(stderr, "%s: %s\n", PROG, e.msg);
        return 1;
    }
    double dt = kvq_now() - pc.t0;
    if (!a.quiet) print_summary(stdout, a.out, &art, dt, threads);
    if (fp8 && !a.quiet) {
        for (size_t i = 0; i < art.p.n_layers; i++) {
            printf("%s: layer %2zu fp8 scale K", PROG, i);
            for (size_t h = 0; h < art.k[i].n_fp8_scales; h++) printf(" %.6g", (double)art.k[i].fp8_scale[h]);
            printf(" V");
            for (size_t h = 0; h < art.v[i].n_fp8_scales; h++) printf(" %.6g", (double)art.v[i].fp8_scale[h]);
            printf(" (saturated %.4f%% / %.4f%%)\n",
                   art.k[i].n_elems ? 100.0 * (double)art.k[i].n_outliers / (double)art.k[i].n_elems : 0.0,
                   art.v[i].n_elems ? 100.0 * (double)art.v[i].n_outliers / (double)art.v[i].n_elems : 0.0);
        }
    }
    if (a.export_vllm) {
        s = kvq_calibrate_export_vllm(&art, a.export_vllm, a.force, &e);
        if (s) {
            fprintf(stderr, "%s: --export-vllm: %s (the artifact %s was written)\n", PROG, e.msg, a.out);
            kvq_artifact_free(&art);
            return 1;
        }
        if (!a.quiet) printf("%s: wrote %s (vLLM k_scale / v_scale)\n", PROG, a.export_vllm);
    }
    kvq_artifact_free(&art);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "intactkv")) return cmd_intactkv(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "export-vllm")) return cmd_export_vllm(argc - 1, argv + 1);
    return cmd_calibrate(argc, argv);
}
