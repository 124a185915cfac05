/* capture.h — the kvdump pipeline: run a model over calibration windows and
 * stream what its KV cache would hold (pre-/post-RoPE keys, values,
 * optionally queries, attention statistics and Fisher information) into an
 * HDF5 dump (formats/dump.h, schema in formats/DUMP.md).
 *
 * Calibration windows follow KVQuant's sampling (datasets/text.h
 * kvq_calib_windows: N windows of L tokens at offsets drawn with Python's
 * random.seed(seed)), so dumps made by separate runs line up element for
 * element. Defaults: 16 samples x 2048 tokens (capped at the model's
 * context), seed 0 (KVQuant, Hooper et al. 2024, §4 "calibration").
 *
 * Fisher information (KVQuant §3.3): per sample, the element-wise square of
 * dL/dK_pre-RoPE and dL/dV, L = mean next-token cross-entropy over the
 * window's L-1 scored positions; stored per element, not summed.
 *
 * Memory: the model, one window's activations, and one sample's captured
 * tensors for the dumped layer range ([n_layers][L][kv_dim] x 3, plus q and
 * Fisher when asked); never the whole dump.
 */
#ifndef KVQ_CAPTURE_H
#define KVQ_CAPTURE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "dump.h"
#include "forward_cuda.h"
#include "status.h"
#include "text.h"

typedef struct {
    const char *model_path;
    const char *tokenizer_path;   /* NULL: the model file's own tokenizer (GGUF) */
    const char *text_path;
    kvq_text_format format;
    int64_t samples;              /* N >= 1 */
    int64_t seq_len;              /* L >= 2, <= model context; 0 = min(2048, context) */
    uint64_t seed;
    bool fisher, attn_stats, q;
    int layer_first, layer_last;  /* inclusive; -1 = all */
    kvq_dump_dtype dtype;
    int deflate;                  /* zlib level, 0 = none */
    bool resume, force, quiet;
    const char *out_path;
    const char *command_line;     /* provenance, stored in the dump */
    const volatile sig_atomic_t *stop; /* optional: set by a signal handler; the run then closes the dump cleanly */
    /* Where the forward runs (kernels/model/device.h): "cpu", "cuda", "cuda:N" or
     * "auto" (a GPU when present); NULL = "cpu". Forward, attention
     * statistics and the backward pass (Fisher information) run on the chosen
     * device (the GPU in the mode `math` selects, exactness by default: fp32,
     * TF32 off; with tf32/bf16 the backward uses the same fast GEMMs, which
     * are ~3e-3 (TF32) / ~1e-2 (BF16) from the exact Fisher — the dump's compute_mode records the
     * mode). "auto" falls back to the CPU, with a note, when the GPU cannot
     * run the model (kvq_engine_init_fallback). Resolved device in
     * kvq_capture_report.device. */
    const char *device;
    /* Several GPUs of this host (kvdump --devices, n_gpus > 1): the forward as a
     * pipeline by layers over gpus[0..n_gpus) (kvq_engine_init_pipe; device
     * is then ignored); with fisher the backward runs over the pipeline too. */
    const int *gpus;
    int n_gpus;
    /* Write sample i (HDF5, compression) in a background thread while sample
     * i+1 is computed, with two sample buffers: 1 on, 0 off, -1 auto (on when
     * the device is a GPU; on the CPU the writer would compete with the
     * forward for the cores). Either way the datasets hold the same values
     * (only the command_line attribute tells the runs apart). */
    int write_behind;
    /* GPU arithmetic (forward_cuda.h): KVQ_CUDA_EXACT (default), _TF32 or
     * _BF16 (fast modes; the report's device string says which). */
    kvq_cuda_math math;
    /* How the weight matrices are held (model.h kvq_weights; default AUTO:
     * fp32 for models whose fp32 matrices fit in 6 GiB, else as stored in the
     * file, fp32 files as bf16). Arithmetic is fp32 either way. */
    kvq_weights weights;
} kvq_capture_opts;

/* Defaults: 16 x min(2048, context), seed 0, f16, deflate KVQ_DUMP_DEFLATE_DEFAULT, all layers. */
kvq_capture_opts kvq_capture_opts_default(void);

typedef struct {
    int64_t samples_written;      /* this run */
    int64_t samples_done;         /* in the file */
    int64_t seq_len;              /* L used */
    double seconds_forward;       /* model forward (and backward) time */
    double seconds_write;         /* HDF5 writing time (write-behind: in the writer thread, overlapped with the next sample) */
    double seconds_wait;          /* write-behind: time the computation waited for the writer */
    bool write_overlapped;        /* the writes ran in the background (write_behind) */
    double seconds_total;
    double mean_loss;             /* mean NLL over the samples of this run (nats) */
    char device[256];             /* the engine that ran (kvq_engine_describe, "; with the backward pass" with Fisher) */
} kvq_capture_report;

/* Run the whole capture. Errors: anything the loaders, tokenizer, text reader,
 * forward/backward or dump writer report (each names its file/field), and
 * KVQ_EINVAL for options out of range (--seq-len above the model context,
 * --layers outside [0, n_layers), corpus shorter than one window). On any
 * error or interruption the dump stays at <out>.partial (resumable) and no
 * file appears under <out>. */
kvq_status kvq_capture_run(const kvq_capture_opts *o, kvq_capture_report *rep, kvq_err *err);

#endif
