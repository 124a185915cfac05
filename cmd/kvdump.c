/* kvdump — run a model over calibration text and capture per-layer pre-/post-RoPE
 * keys, values, attention statistics and Fisher information into HDF5. */
#include <signal.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capture.h"
#include "cuda_info.h"
#include "device.h"
#include "pipeline.h"
#include "cli.h"

/* The one process-wide mutable: set by SIGINT/SIGTERM, read between samples
 * (a signal handler can reach nothing else). */
static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static const char *summary =
    "Run a model over calibration text and capture, per layer, what its KV cache would hold:\n"
    "pre-RoPE keys, post-RoPE keys and values (optionally queries, attention statistics and\n"
    "Fisher information = squared gradients of the LM loss w.r.t. pre-RoPE keys and values)\n"
    "into an HDF5 dump (schema: formats/DUMP.md). Windows are sampled as KVQuant does\n"
    "(N windows of L tokens at offsets from Python's random.seed(S)).\n"
    "The dump is written to OUT.partial and renamed when complete; SIGINT/SIGTERM close it\n"
    "cleanly and --resume continues it.";

int main(int argc, char **argv)
{
    kvq_capture_opts o = kvq_capture_opts_default();
    const char *model = NULL, *text = NULL, *out = NULL, *tokenizer = NULL, *format = NULL, *dtype = "f16",
               *layers = NULL, *device = NULL, *devices = NULL, *overlap = NULL, *math = NULL, *weights = NULL;
    long samples = o.samples, seq_len = 0, seed = 0, deflate = o.deflate, threads = 0;
    bool fisher = false, attn = false, q = false, resume = false, force = false, quiet = false, version = false;
    kvq_opt opts[] = {
        kvq_cli_common(KVQ_COPT_MODEL, &model, true),
        kvq_cli_common(KVQ_COPT_TEXT, &text, true),
        kvq_cli_common(KVQ_COPT_FORMAT, &format, false),
        kvq_cli_common(KVQ_COPT_TOKENIZER, &tokenizer, false),
        {"samples", 'n', KVQ_OPT_INT, &samples, "N", "calibration windows", NULL, 1, 1e6, false},
        {"seq-len", 'L', KVQ_OPT_INT, &seq_len, "L", "tokens per window; 0 = min(2048, model context)", NULL, 0, 1 << 20, false},
        {"seed", 0, KVQ_OPT_INT, &seed, "S", "sampling seed (Python random.seed)", NULL, 0, 2147483647.0, false},
        {"out", 'o', KVQ_OPT_STRING, &out, "FILE", "output dump (.h5)", NULL, 0, 0, true},
        {"fisher", 0, KVQ_OPT_FLAG, &fisher, NULL, "store Fisher information (squared dL/dK_pre-RoPE, dL/dV)", NULL, 0, 0, false},
        {"attn-stats", 0, KVQ_OPT_FLAG, &attn, NULL, "store attention received per key position and per-query entropy", NULL, 0, 0, false},
        {"q", 0, KVQ_OPT_FLAG, &q, NULL, "store post-RoPE queries", NULL, 0, 0, false},
        {"layers", 0, KVQ_OPT_STRING, &layers, "A-B", "dump only layers A..B (0-based, inclusive; default all)", NULL, 0, 0, false},
        {"dtype", 0, KVQ_OPT_CHOICE, &dtype, "T", "storage type of K/V/Q (Fisher is always f32)", "f16|f32", 0, 0, false},
        {"deflate", 0, KVQ_OPT_INT, &deflate, "N", "zlib level with byte shuffle (0 = uncompressed; --resume keeps the dump's own)", NULL,
         0, 9, false},
        {"resume", 0, KVQ_OPT_FLAG, &resume, NULL, "continue OUT.partial after checking it matches this request", NULL, 0, 0, false},
        {"force", 'f', KVQ_OPT_FLAG, &force, NULL, "overwrite an existing OUT (or OUT.partial)", NULL, 0, 0, false},
        kvq_cli_common(KVQ_COPT_DEVICE, &device, false),
        kvq_cli_common(KVQ_COPT_DEVICES, &devices, false),
        kvq_cli_common(KVQ_COPT_MATH, &math, false),
        kvq_cli_common(KVQ_COPT_WEIGHTS, &weights, false),
        kvq_cli_common(KVQ_COPT_THREADS, &threads, false),
        {"write-behind", 0, KVQ_OPT_CHOICE, &overlap, "W",
         "write sample i to HDF5 in a background thread while sample i+1 computes (default auto: on a GPU)", "auto|on|off", 0,
         0, false},
        kvq_cli_common(KVQ_COPT_QUIET, &quiet, false),
        kvq_cli_common(KVQ_COPT_VERSION, &version, false),
    };
    kvq_err e = {0};
    bool help = false;
    int given[sizeof opts / sizeof *opts] = {0};
    if (kvq_cli_parse_given("kvdump", summary, opts, (int)(sizeof opts / sizeof *opts), argc, argv, NULL, &help, given, &e)) {
        fprintf(stderr, "kvdump: %s\n", e.msg);
        return 2;
    }
    if (help) return 0;
    if (resume && !quiet && kvq_cli_given(opts, (int)(sizeof opts / sizeof *opts), given, "deflate")) /* (it was silently kept) */
        fprintf(stderr, "kvdump: note: --deflate applies when a dump is created; the resumed dump keeps the filters it records\n");
    if (version) {
        kvq_cli_print_version(stdout, "kvdump", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
        return 0;
    }
    if (threads > 0) omp_set_num_threads((int)threads);
    { /* the dump must be writable and replace no input (with --force it could replace --text) */
        const kvq_cli_file outs[1] = {{"--out", out}},
                           ins[3] = {{"--model", model}, {"--text", text}, {"--tokenizer", tokenizer}};
        if (kvq_cli_check_outputs(outs, 1, ins, 3, &e) || kvq_cli_check_renamed_outputs(outs, 1, &e)) {
            fprintf(stderr, "kvdump: %s\n", e.msg);
            return 2;
        }
    }
    o.model_path = model;
    o.text_path = text;
    o.out_path = out;
    o.tokenizer_path = tokenizer;
    o.format = format ? (!strcmp(format, "raw") ? KVQ_TEXT_RAW : !strcmp(format, "jsonl") ? KVQ_TEXT_JSONL : KVQ_TEXT_WIKITEXT_TOKENS)
                      : kvq_text_format_from_path(text);
    o.samples = samples;
    o.seq_len = seq_len; /* 0: capture picks min(2048, context) */
    o.seed = (uint64_t)seed;
    o.fisher = fisher;
    o.attn_stats = attn;
    o.q = q;
    o.dtype = !strcmp(dtype, "f32") ? KVQ_DUMP_F32 : KVQ_DUMP_F16;
    o.deflate = (int)deflate;
    o.resume = resume;
    o.force = force;
    o.quiet = quiet;
    char one_gpu[32];
    int dev_ids[KVQ_PIPE_MAX_DEV], n_dev = 0;
    if (devices) { /* several GPUs: the pipeline by layers; one: today's single-GPU path (--device cuda:N) */
        if (kvq_devices_resolve(devices, device, dev_ids, KVQ_PIPE_MAX_DEV, &n_dev, one_gpu, sizeof one_gpu, &e)) {
            fprintf(stderr, "kvdump: %s\n", e.msg);
            return e.code == KVQ_EINVAL ? 2 : 1;
        }
        if (n_dev == 1) device = one_gpu;
        o.gpus = dev_ids;
        o.n_gpus = n_dev;
    }
    o.device = device ? device : "auto";
    o.write_behind = !overlap || !strcmp(overlap, "auto") ? -1 : !strcmp(overlap, "on");
    if (weights && kvq_weights_parse(weights, "--weights", &o.weights, &e)) {
        fprintf(stderr, "kvdump: %s\n", e.msg);
        return 2;
    }
    if (math && kvq_cuda_math_parse(math, "--math", &o.math, &e)) {
        fprintf(stderr, "kvdump: %s\n", e.msg);
        return 2;
    }
    if (layers) {
        long a, b;
        char tail;
        if (sscanf(layers, "%ld-%ld%c", &a, &b, &tail) == 2 && a >= 0 && b >= a && b < 100000) {
            o.layer_first = (int)a;
            o.layer_last = (int)b;
        } else if (sscanf(layers, "%ld%c", &a, &tail) == 1 && a >= 0 && a < 100000) {
            o.layer_first = o.layer_last = (int)a;
        } else {
            fprintf(stderr, "kvdump: --layers: expected A-B or N (0-based), found '%s'\n", layers);
            return 2;
        }
    }
    /* provenance: the command line as typed */
    char cmdline[8192];
    size_t k = 0;
    for (int i = 0; i < argc && k + 2 < sizeof cmdline; i++)
        k += (size_t)snprintf(cmdline + k, sizeof cmdline - k, "%s%s", i ? " " : "", argv[i]);
    o.command_line = cmdline;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    /* past a file-size limit, writes fail with EFBIG (reported) instead of killing us */
    signal(SIGXFSZ, SIG_IGN);
    o.stop = &g_stop;

    kvq_capture_report rep;
    kvq_status s = kvq_capture_run(&o, &rep, &e);
    if (s) {
        fprintf(stderr, "kvdump: %s\n", e.msg);
        return s == KVQ_EINVAL ? 2 : 1;
    }
    /* after --resume the loss covers this run's samples only (the earlier ones' is not stored) */
    char lossw[96];
    if (rep.samples_written < rep.samples_done)
        snprintf(lossw, sizeof lossw, "mean loss of the %lld samples this run computed %.4f nats", (long long)rep.samples_written,
                 rep.mean_loss);
    else
        snprintf(lossw, sizeof lossw, "mean loss %.4f nats", rep.mean_loss);
    if (!quiet && rep.write_overlapped)
        fprintf(stderr, "kvdump: wrote %s: %lld samples x %lld tokens (%s); %s %.1f s, HDF5 %.1f s in the "
                        "background (waited %.1f s for it), total %.1f s\n",
                out, (long long)rep.samples_done, (long long)rep.seq_len, lossw, fisher ? "forward+backward" : "forward",
                rep.seconds_forward, rep.seconds_write, rep.seconds_wait, rep.seconds_total);
    else if (!quiet)
        fprintf(stderr, "kvdump: wrote %s: %lld samples x %lld tokens (%s); %s %.1f s, HDF5 %.1f s (%.0f%% of that), total %.1f s\n",
                out, (long long)rep.samples_done, (long long)rep.seq_len, lossw, fisher ? "forward+backward" : "forward",
                rep.seconds_forward, rep.seconds_write, rep.seconds_forward > 0 ? 100 * rep.seconds_write / rep.seconds_forward : 0,
                rep.seconds_total);
    return 0;
}
