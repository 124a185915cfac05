/* dump.h — the kvdump HDF5 file: streaming writer, chunked reader, f16 codec.
 *
 * Schema (version KVQ_DUMP_SCHEMA_VERSION) is documented in formats/DUMP.md:
 *   root attributes  = kvq_dump_meta (one attribute per field) + samples_done
 *   /tokens                          [N][L] int32
 *   /layers/<i>/k_pre_rope, k, v     [N][L][n_kv_heads][head_dim]  f16 or f32
 *   /layers/<i>/q           (opt.)   [N][L][n_heads][head_dim]     f16 or f32
 *   /layers/<i>/fisher_k_pre_rope, fisher_v (opt.) like k/v, always f32
 *   /layers/<i>/attn_received, attn_entropy (opt.) [N][n_heads][L] f32
 * N = n_samples, L = seq_len, i in [layer_first, layer_last]. All arrays are
 * row-major (C order), exactly as h5py shows them.
 *
 * Writer life cycle (streaming: one sample's tensors in memory at a time):
 *   kvq_dump_create / kvq_dump_resume → <path>.partial is open
 *   per sample s = samples_done, samples_done+1, ...:
 *       kvq_dump_write_layer for every layer in the range (any order), then
 *       kvq_dump_commit_sample (tokens + flush + samples_done := s+1)
 *     or kvq_dump_write_sample (all of it in one call)
 *   kvq_dump_finish  → all N samples committed: close, fsync, rename to <path>
 *   kvq_dump_abort   → close cleanly, keep <path>.partial (SIGINT/SIGTERM path)
 * The final name appears only through the rename in kvq_dump_finish, so a dump
 * is never left incomplete or corrupt under <path>, and a file already at
 * <path> is untouched until then (and is refused at create without force).
 *
 * HDF5's automatic error printing is switched off inside every function here
 * (saved and restored around the call, no global state of ours); HDF5
 * failures become kvq_err messages that quote HDF5's innermost error line
 * (which carries errno text such as "File too large" / "No space left").
 *
 * Not thread-safe: serial HDF5; use the writer/readers from one thread.
 *
 * Process-wide side effect: the first call into this module calls
 * H5dont_atexit() (see kvq_dump_write_layer for why); every file this module
 * opens is closed explicitly.
 */
#ifndef KVQ_DUMP_H
#define KVQ_DUMP_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "status.h"

#define KVQ_DUMP_SCHEMA_VERSION 1
#define KVQ_DUMP_PATH_MAX 4096
#define KVQ_DUMP_STR_MAX 256     /* short identity strings */
#define KVQ_DUMP_CMDLINE_MAX 8192
#define KVQ_DUMP_DEFLATE_DEFAULT 1 /* zlib level (0 = no filters); cost measured in DUMP.md "Storage" */
#define KVQ_DUMP_F16_MAX 65504.0f  /* largest finite IEEE binary16 */

/* Storage type of k_pre_rope, k, v, q (Fisher and attention stats are always f32). */
typedef enum { KVQ_DUMP_F32 = 0, KVQ_DUMP_F16 = 1 } kvq_dump_dtype;

/* The per-layer datasets. Shapes per sample:
 *   K_PRE_ROPE, K, V, FISHER_K_PRE_ROPE, FISHER_V : [L][n_kv_heads][head_dim]
 *   Q                                           : [L][n_heads][head_dim]
 *   ATTN_RECEIVED, ATTN_ENTROPY                 : [n_heads][L]  */
typedef enum {
    KVQ_DUMP_K_PRE_ROPE = 0,
    KVQ_DUMP_K,                 /* post-RoPE key, as the cache holds it */
    KVQ_DUMP_V,
    KVQ_DUMP_Q,                 /* post-RoPE query (optional, has_q) */
    KVQ_DUMP_FISHER_K_PRE_ROPE, /* (dL/dK_pre-RoPE)^2, element-wise (optional, has_fisher) */
    KVQ_DUMP_FISHER_V,          /* (dL/dV)^2 (optional, has_fisher) */
    KVQ_DUMP_ATTN_RECEIVED,     /* attention mass each key position receives, summed over queries (has_attn_stats) */
    KVQ_DUMP_ATTN_ENTROPY,      /* entropy (nats) of each query position's attention distribution (has_attn_stats) */
    KVQ_DUMP_N_DS
} kvq_dump_ds;

/* Everything the root attributes record. Strings are NUL-terminated char
 * arrays (too long a string is an error at create, not a truncation).
 * Field name = attribute name (DUMP.md lists types). */
typedef struct {
    int schema_version;                     /* filled by the reader; the writer always writes KVQ_DUMP_SCHEMA_VERSION */
    char kvq_version[KVQ_DUMP_STR_MAX];     /* e.g. "0.1.0" or a git describe */
    /* model */
    char model_path[KVQ_DUMP_PATH_MAX];
    char model_sha256[65];                  /* 64 lowercase hex digits */
    char model_arch[KVQ_DUMP_STR_MAX];      /* "llama", "qwen2", "qwen3", "mistral" (model.h kvq_arch_name) */
    int n_layers, dim, hidden_dim, n_heads, n_kv_heads, head_dim, vocab_size, ctx_len;
    /* RoPE (see model.h: pairs are always adjacent channels after loading) */
    double rope_theta;
    int rope_dim;                           /* rotated channels per head (even, <= head_dim) */
    char rope_pairing[KVQ_DUMP_STR_MAX];    /* "interleaved": pairs (2i, 2i+1) within each head */
    char rope_scaling[KVQ_DUMP_STR_MAX];    /* "none" | "linear" | "llama3" | "yarn" | "dynamic" | "freq_factors" */
    double rope_scale_factor;               /* 1 when none */
    double rope_low_freq_factor, rope_high_freq_factor; /* llama3 only (0 otherwise) */
    int rope_orig_ctx;                      /* llama3 and yarn only (0 otherwise) */
    char rope_params[KVQ_DUMP_STR_MAX];     /* the parameters the fields above lack ("" when none):
                                               yarn "beta_fast=%.9g beta_slow=%.9g attn_factor=%.9g truncate=%d",
                                               freq_factors "n=%d min=%.9g max=%.9g sha256=<hex of the float32 factors>" */
    char attention[KVQ_DUMP_STR_MAX];       /* "" (full causal attention) or "sliding_window=%d first_layer=%d" */
    /* tokenizer + corpus */
    char tokenizer[KVQ_DUMP_STR_MAX];       /* identity, e.g. "gguf:gpt2 vocab=49152 sha256=..." */
    char corpus_path[KVQ_DUMP_PATH_MAX];
    char corpus_sha256[65];
    char corpus_format[KVQ_DUMP_STR_MAX];   /* "raw" | "wikitext-tokens" | "jsonl" */
    char bos_policy[KVQ_DUMP_STR_MAX];      /* e.g. "none", "prepend", "replace-first" */
    /* sampling */
    int64_t n_samples;                      /* N >= 1 */
    int64_t seq_len;                        /* L >= 1 */
    int64_t seed;
    const int64_t *sample_offsets;          /* [N] token offset of each sample in the tokenized corpus;
                                               writer: caller's memory (copied); reader: owned by the reader */
    /* content */
    kvq_dump_dtype dtype;                   /* attribute: "f16" | "f32" */
    bool has_q, has_fisher, has_attn_stats; /* attributes: int64 0/1 */
    int layer_first, layer_last;            /* inclusive range of dumped layers, 0-based */
    /* how the tensors were computed: math mode compared on resume (a dump never mixes modes);
     * device = provenance of the last writer, NOT compared (CPU and GPU agree in the exact mode) */
    char compute_mode[KVQ_DUMP_STR_MAX];    /* "exact" (fp32; the CPU, or a GPU with TF32 off) | "tf32" | "bf16";
                                               reader: "exact" when the attribute is absent (files of kvq <= 0.1.0) */
    char compute_device[KVQ_DUMP_STR_MAX];  /* e.g. "CPU (16 OpenMP threads, ...)" or "NVIDIA H200 (sm_90 ...)"; may be "" */
    char command_line[KVQ_DUMP_CMDLINE_MAX];/* provenance; NOT compared on resume */
} kvq_dump_meta;

typedef struct {
    bool force;            /* replace <path>.partial at create; allow replacing <path> at finish */
    int deflate_level;     /* 0: no filters; 1..9: byte shuffle + zlib deflate at that level */
    const volatile sig_atomic_t *stop; /* optional: when *stop != 0, write/commit calls return KVQ_EIO
                                          ("interrupted") without writing; the caller then calls kvq_dump_abort */
} kvq_dump_opts;

/* force = false, deflate_level = KVQ_DUMP_DEFLATE_DEFAULT, stop = NULL. */
kvq_dump_opts kvq_dump_opts_default(void);

/* One layer of one sample, fp32, row-major. Pointers for datasets the meta
 * does not enable are ignored; enabled ones must be non-NULL.
 *   k_pre_rope, k, v, fisher_k_pre_rope, fisher_v : [L][n_kv_heads][head_dim]
 *   q                                            : [L][n_heads][head_dim]
 *   attn_received, attn_entropy                  : [n_heads][L] */
typedef struct {
    const float *k_pre_rope, *k, *v, *q;
    const float *fisher_k_pre_rope, *fisher_v;
    const float *attn_received, *attn_entropy;
} kvq_dump_layer_data;

typedef struct kvq_dump_writer kvq_dump_writer;
typedef struct kvq_dump_reader kvq_dump_reader;

/* ---- helpers -------------------------------------------------------------- */

/* "k_pre_rope", "k", "v", "q", "fisher_k_pre_rope", "fisher_v", "attn_received", "attn_entropy". */
const char *kvq_dump_ds_name(kvq_dump_ds ds);
/* Inverse of kvq_dump_ds_name; KVQ_EINVAL naming the string if unknown. */
kvq_status kvq_dump_ds_from_name(const char *name, kvq_dump_ds *out, kvq_err *err);
/* Whether the meta enables ds (k_pre_rope/k/v always). */
bool kvq_dump_ds_enabled(const kvq_dump_meta *m, kvq_dump_ds ds);
/* Per-sample shape of ds: *rank = 3 ([L][heads][head_dim]) or 2 ([n_heads][L]); dims in dims[]. */
void kvq_dump_ds_shape(const kvq_dump_meta *m, kvq_dump_ds ds, int *rank, int64_t dims[3]);
/* Elements of one sample of ds (product of kvq_dump_ds_shape). */
size_t kvq_dump_ds_sample_elems(const kvq_dump_meta *m, kvq_dump_ds ds);

/* Copy the architecture and RoPE fields of hp into m (n_layers ... rope_orig_ctx,
 * rope_pairing = "interleaved", rope_scaling name); other fields untouched. */
void kvq_dump_meta_set_hparams(kvq_dump_meta *m, const kvq_hparams *hp);

/* Check a meta for writing: positive dims, 1 <= rope_dim <= head_dim and even,
 * layer range inside [0, n_layers), sample_offsets non-NULL, strings
 * NUL-terminated. KVQ_EINVAL naming the field. */
kvq_status kvq_dump_meta_validate(const kvq_dump_meta *m, kvq_err *err);


/* Finite check of a row-major tensor [n_rows][row_len]: returns true and sets
 * *row / *col of the first NaN or ±Inf (or, when max_abs > 0, of the first
 * |x| > max_abs), false if none. */
bool kvq_dump_find_bad(const float *x, size_t n_rows, size_t row_len, float max_abs, size_t *row, size_t *col);

/* The writer's element check as a status: KVQ_ENUMERIC "<what>: layer <l>,
 * sample <s>, position <t>, head <h>, channel <c>: value <x> is not finite"
 * (or "... exceeds the f16 range ±65504; use --dtype f32" when max_abs > 0).
 * x is one sample of ds in its per-sample layout (see kvq_dump_ds_shape). */
kvq_status kvq_dump_check_values(const kvq_dump_meta *m, kvq_dump_ds ds, const float *x, int layer,
                                 int64_t sample, float max_abs, kvq_err *err);

/* ---- writer --------------------------------------------------------------- */

/* Create <path>.partial with every root attribute and every dataset (full
 * shape, chunked: one chunk never exceeds one sample x one layer tensor, nor
 * 1 MiB; shuffle+deflate when opts->deflate_level > 0). Refuses (KVQ_EIO,
 * nothing written) if <path> exists and !force, or if <path>.partial exists
 * and !force ("use --resume or --force"); with force an existing <path>.partial
 * is removed first, unless another process holds it open for writing (HDF5's
 * file lock: KVQ_EIO "in use by another process", the file untouched). Errors: KVQ_EINVAL (meta), KVQ_EIO
 * (cannot create: the message quotes the OS error), KVQ_ENOMEM. */
kvq_status kvq_dump_create(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                           kvq_dump_writer **out, kvq_err *err);

/* Reopen <path>.partial for appending. Every root attribute except
 * command_line and samples_done must equal the request, else KVQ_EMISMATCH
 * naming the first differing attribute with both values (the file is left as
 * it was). The dataset layout is verified too. opts->deflate_level is ignored
 * (the file's filters stay). Refuses if <path> exists and !force. */
kvq_status kvq_dump_resume(const char *path, const kvq_dump_meta *meta, const kvq_dump_opts *opts,
                           kvq_dump_writer **out, kvq_err *err);

/* Samples committed so far (the next sample to write). */
int64_t kvq_dump_writer_samples_done(const kvq_dump_writer *w);
/* The meta the writer was opened with (sample_offsets points into the writer). */
const kvq_dump_meta *kvq_dump_writer_meta(const kvq_dump_writer *w);

/* Write one layer of sample `sample` (must equal samples_done). Checks every
 * value first (KVQ_ENUMERIC naming dataset, layer, sample, position, head,
 * channel for NaN/Inf, and for |x| > 65504 when dtype is f16: no saturation),
 * converts to f16 with kvq_f32_to_f16 (half.h) when dtype is f16, and writes.
 * Errors: KVQ_EINVAL (sample/layer out of order or range, NULL data),
 * KVQ_ENUMERIC, KVQ_EIO (HDF5 write failed: disk full, file-size limit; the
 * message quotes the OS error). After an HDF5 write/flush failure the writer
 * refuses all further work; kvq_dump_abort / kvq_dump_finish then release it
 * WITHOUT closing the HDF5 file (a close would retry the failed flush, and
 * HDF5 1.10.8 crashes at exit after a failed close, HDFFV-11052), so the
 * .partial stays as of the last committed sample and is resumable. */
kvq_status kvq_dump_write_layer(kvq_dump_writer *w, int64_t sample, int layer, const kvq_dump_layer_data *d,
                                kvq_err *err);

/* Write the model's key biases (Qwen2; pre-RoPE, kvq's interleaved channel
 * order) as /k_bias, float32 [layer_last - layer_first + 1][n_kv_heads *
 * head_dim] (optional dataset, DUMP.md). Once per file, any time before
 * finish; on resume it rewrites the same values. Errors: KVQ_ENUMERIC
 * (NaN/Inf, naming layer and channel), KVQ_EIO. */
kvq_status kvq_dump_write_k_bias(kvq_dump_writer *w, const float *bias, kvq_err *err);

/* Finish sample `sample`: write tokens[L] (int32), require every layer of the
 * range written, flush, set samples_done = sample + 1, flush again. */
kvq_status kvq_dump_commit_sample(kvq_dump_writer *w, int64_t sample, const int32_t *tokens, kvq_err *err);

/* kvq_dump_write_layer for layers[0 .. layer_last-layer_first] (layers[j] is
 * layer layer_first+j), then kvq_dump_commit_sample. */
kvq_status kvq_dump_write_sample(kvq_dump_writer *w, int64_t sample, const int32_t *tokens,
                                 const kvq_dump_layer_data *layers, kvq_err *err);

/* Require samples_done == n_samples (else KVQ_EINVAL) and no earlier write
 * error (else KVQ_EIO), close, fsync, rename <path>.partial → <path>
 * (no-replace unless force: KVQ_EIO if <path> appeared meanwhile), fsync the
 * directory. Frees w in every case; on failure the .partial is kept and
 * <path> is untouched. */
kvq_status kvq_dump_finish(kvq_dump_writer *w, kvq_err *err);

/* Close the file cleanly (committed samples stay readable and resumable),
 * keep <path>.partial, free w. NULL is a no-op. Call it from the main flow
 * after a signal flag was seen (HDF5 is not async-signal-safe: never call
 * this from the handler itself). */
kvq_status kvq_dump_abort(kvq_dump_writer *w, kvq_err *err);

/* ---- reader --------------------------------------------------------------- */

/* Open a dump (a final file or a .partial) read-only and read its meta.
 * Errors: KVQ_EIO (cannot open: OS/HDF5 reason), KVQ_EFORMAT (not a kvq dump,
 * missing/mistyped attribute, dataset of the wrong shape or type — naming
 * file, dataset, expected and found), KVQ_EUNSUPPORTED (schema_version other
 * than KVQ_DUMP_SCHEMA_VERSION, both numbers in the message). */
kvq_status kvq_dump_open(const char *path, kvq_dump_reader **out, kvq_err *err);
const kvq_dump_meta *kvq_dump_reader_meta(const kvq_dump_reader *r);
/* Samples committed in the file (== n_samples for a finished dump). */
int64_t kvq_dump_reader_samples_done(const kvq_dump_reader *r);
/* Whether /layers/<layer>/<ds> exists in the file. */
bool kvq_dump_has(const kvq_dump_reader *r, int layer, kvq_dump_ds ds);

/* /k_bias into out [layer_last - layer_first + 1][kv_dim] when the dump has
 * it (*present = true), else *present = false and out untouched. KVQ_EFORMAT
 * for a wrong shape or type, KVQ_EIO for a failed read. */
kvq_status kvq_dump_read_k_bias(kvq_dump_reader *r, float *out, bool *present, kvq_err *err);

/* Read token rows [t0, t0+n) of one sample of /layers/<layer>/<ds> as fp32
 * into out (f16 converted exactly):
 *   per-token datasets: out = [n][heads][head_dim]
 *   attn_received / attn_entropy: out = [n_heads][n] (positions t0..t0+n-1)
 * Errors: KVQ_EINVAL (layer/sample/range/ds absent, message names them),
 * KVQ_EIO (read or decompression failed). */
kvq_status kvq_dump_read_rows(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, int64_t t0,
                              int64_t n, float *out, kvq_err *err);
/* One whole sample: kvq_dump_read_rows with t0 = 0, n = L; out holds
 * kvq_dump_ds_sample_elems(meta, ds) floats. */
kvq_status kvq_dump_read(kvq_dump_reader *r, int layer, kvq_dump_ds ds, int64_t sample, float *out, kvq_err *err);
/* Token ids of samples [s0, s0+n): out = [n][L] int32. */
kvq_status kvq_dump_read_tokens(kvq_dump_reader *r, int64_t s0, int64_t n, int32_t *out, kvq_err *err);
void kvq_dump_close(kvq_dump_reader *r);

#endif
