/* text.h — corpora → token windows for perplexity and calibration, with a
 * report of exactly what was scored.
 *
 * Reading (kvq_text_read):
 *  - KVQ_TEXT_RAW / KVQ_TEXT_WIKITEXT_TOKENS: bytes as stored. Line ends: with
 *    KVQ_EOL_TO_LF (default) every "\r\n" becomes "\n" (a lone "\r" is kept),
 *    and the number replaced is reported in crlf_replaced; KVQ_EOL_KEEP keeps
 *    the bytes. Rows are the lines, each INCLUDING its terminating "\n" (as in
 *    the HF datasets wikitext rows, e.g. " = Robert Boulter = \n"); a last line
 *    without "\n" is a row without it. Lines are never dropped or trimmed.
 *  - KVQ_TEXT_JSONL: one JSON object per non-blank line; rows are the string
 *    field "text" (C4 style), verbatim. A line that is not an object with a
 *    string "text" → KVQ_EFORMAT naming the line. (A "\u0000" escape truncates
 *    that row: cJSON strings are NUL-terminated.)
 *  - An empty file (0 bytes) → KVQ_EFORMAT. A file that is not text is refused
 *    (KVQ_EFORMAT naming the count and the first offset): more than
 *    KVQ_TEXT_BAD_PER_MILLE per mille of its bytes are NUL bytes or bytes of
 *    invalid UTF-8 sequences (binary garbage, UTF-16, a compressed file). Fewer
 *    are kept (the tokenizer's byte fallback handles them; see tokenizer.h) and
 *    counted in bad_bytes / first_bad, for the tools to warn about.
 *  The file's bytes_read, sha256 and CRLF count are always recorded.
 *
 * Protocols (kvq_ppl_windows):
 *  - KVQ_PPL_KVQUANT (GPTQ/KVQuant harness, docs/kvquant.md §9.1): the rows
 *    joined with "\n\n" between them (Python "\n\n".join(rows)), tokenised ONCE;
 *    BOS (per the policy) only at the very start of the stream; cut into
 *    floor(n_tokens / ctx) non-overlapping windows of ctx tokens; the tail is
 *    dropped. Window w = stream[w*ctx, (w+1)*ctx).
 *  - KVQ_PPL_LLAMACPP (llama.cpp tools/perplexity): the text as read (after the
 *    EOL policy) with ONE trailing "\n" removed (llama.cpp's `-f FILE` reads
 *    the bytes and pops a final "\n", common/arg.cpp; for JSONL the
 *    "\n\n"-joined rows, nothing removed), tokenised once with BOS (per the
 *    policy), cut into floor(n_tokens / ctx) chunks of ctx tokens, and the FIRST
 *    token of every chunk overwritten by BOS when BOS is on (llama.cpp does this
 *    iff the vocabulary's add_bos is set; the default policy reproduces that).
 *    Fewer than 2 x ctx tokens → KVQ_EFORMAT, as llama-perplexity refuses them
 *    ("you need at least 2*n_ctx tokens").
 * Newlines: which EOL policy a protocol reads with is the caller's choice
 * (kveval --newlines); kvq_ppl_default_eol gives each protocol's tool's: the
 * file's bytes for llamacpp (KVQ_EOL_KEEP: llama.cpp reads CRLF as is),
 * "\r\n" → "\n" for kvquant (KVQ_EOL_TO_LF: the harness joins the HF dataset's
 * rows, which carry "\n"). The windows record it (eol, crlf_in_file).
 * Calibration (kvq_calib_windows, KVQuant quant/datautils.py): the kvquant
 * stream; n windows of len tokens; window i starts at
 *    off_i = randint(0, n_tokens - len - 1)
 * drawn in order from Python's random module after random.seed(seed): MT19937
 * seeded by init_by_array(32-bit little-endian words of seed), randint(a, b) =
 * a + randbelow(b - a + 1), randbelow(m) = getrandbits(bit_length(m)) redrawn
 * while >= m, getrandbits(k <= 32) = genrand_uint32() >> (32 - k). So seed 0
 * gives KVQuant's exact offsets. Windows may overlap; offsets are returned.
 *
 * BOS policy: KVQ_BOS_MODEL (the tokenizer's add_bos metadata, as the upstream
 * tools do), KVQ_BOS_ALWAYS, KVQ_BOS_NEVER.
 */
#ifndef KVQ_TEXT_H
#define KVQ_TEXT_H

#include <stdint.h>
#include <stdio.h>

#include "sha256.h"
#include "status.h"
#include "tokenizer.h"

typedef enum { KVQ_TEXT_RAW = 0, KVQ_TEXT_WIKITEXT_TOKENS = 1, KVQ_TEXT_JSONL = 2 } kvq_text_format;
typedef enum { KVQ_EOL_TO_LF = 0, KVQ_EOL_KEEP = 1 } kvq_eol_mode;
typedef enum { KVQ_PPL_KVQUANT = 0, KVQ_PPL_LLAMACPP = 1 } kvq_ppl_protocol;
typedef enum { KVQ_BOS_MODEL = 0, KVQ_BOS_ALWAYS = 1, KVQ_BOS_NEVER = 2 } kvq_bos_policy;

/* A file with more bad bytes (NUL, invalid UTF-8) than this, per mille of its size, is not text. */
#define KVQ_TEXT_BAD_PER_MILLE 1

typedef struct {
    char path[4096];
    kvq_text_format format;
    kvq_eol_mode eol;      /* the EOL policy it was read with */
    uint64_t bytes_read;   /* size of the file */
    char file_sha256[65];  /* hex sha256 of the file's bytes */
    size_t crlf_in_file;   /* "\r\n" pairs in the file's bytes (whatever the policy) */
    size_t bad_bytes;      /* NUL bytes and bytes of invalid UTF-8 sequences in the file (<= the limit above) */
    uint64_t first_bad;    /* file offset of the first bad byte (when bad_bytes > 0) */
    char *data;            /* text after the EOL policy, NUL-terminated, [len] bytes (may contain NULs) */
    size_t len;
    size_t crlf_replaced;  /* "\r\n" → "\n" replacements made */
    size_t n_rows;
    size_t *row_off, *row_len; /* [n_rows]: row r = rows_base[row_off[r] .. +row_len[r]) */
    char *rows_base;       /* data for RAW/TOKENS, a separate buffer for JSONL */
} kvq_text;

/* Read path in the given format. On failure nothing stays allocated. */
kvq_status kvq_text_read(const char *path, kvq_text_format fmt, kvq_eol_mode eol, kvq_text *out, kvq_err *err);
/* Format from the name: *.jsonl / *.json → JSONL, *.tokens → WIKITEXT_TOKENS, else RAW. */
kvq_text_format kvq_text_format_from_path(const char *path);
const char *kvq_text_format_name(kvq_text_format f);
/* "keep" / "lf" (kveval --newlines). */
const char *kvq_eol_name(kvq_eol_mode m);
/* The EOL policy of the tool a protocol is named after: llamacpp KVQ_EOL_KEEP, kvquant KVQ_EOL_TO_LF. */
kvq_eol_mode kvq_ppl_default_eol(kvq_ppl_protocol p);
/* Count NUL bytes and bytes of invalid UTF-8 sequences (overlong forms, surrogates, code points
 * above U+10FFFF, stray continuation bytes, truncated sequences) in d[n]; the offset of the
 * first goes to *first (n when none). */
size_t kvq_text_bad_bytes(const char *d, size_t n, size_t *first);
void kvq_text_free(kvq_text *t);

/* Token windows and what produced them. */
typedef struct {
    char protocol[32];      /* "kvquant", "llamacpp", "calib-kvquant" */
    char tokenizer[192];    /* kvq_tokenizer_describe() */
    char path[4096];
    uint64_t bytes_read;    /* file bytes */
    char file_sha256[65];
    uint64_t text_bytes;    /* bytes of the string that was tokenised (after joining / EOL) */
    char text_sha256[65];   /* sha256 of that string */
    size_t crlf_replaced;
    size_t crlf_in_file;    /* "\r\n" pairs in the file (kept under KVQ_EOL_KEEP) */
    kvq_eol_mode eol;       /* the EOL policy of the text */
    int final_lf_dropped;   /* llamacpp: 1 if a trailing "\n" was removed (llama.cpp -f) */
    size_t rows_joined;     /* rows joined with "\n\n" (kvquant, calibration, JSONL), 0 = the text as read */
    int bos;                /* 1 if BOS was used */
    size_t n_tokens;        /* tokens in the stream (incl. the leading BOS if any) */
    size_t ctx;             /* window length */
    size_t n_windows;
    size_t dropped_tail;    /* stream tokens in no window (ppl protocols) */
    uint64_t seed;          /* calibration only */
    size_t *offsets;        /* [n_windows] start of window w in the stream */
    int32_t *tokens;        /* [n_windows][ctx] row-major: the model input of each window
                               (llamacpp: element 0 is BOS when bos) */
} kvq_windows;

/* A text too short for one window (ppl: fewer than ctx tokens; calib: len + 1) is KVQ_EFORMAT
 * naming the file and both counts (a property of the file, like an empty one; kvdump exited 2 for
 * it and kveval 1); bad sizes (0 windows or tokens) are KVQ_EINVAL. */
kvq_status kvq_ppl_windows(const kvq_text *txt, const kvq_tokenizer *tok, kvq_ppl_protocol proto, size_t ctx,
                           kvq_bos_policy bos, kvq_windows *out, kvq_err *err);
kvq_status kvq_calib_windows(const kvq_text *txt, const kvq_tokenizer *tok, size_t n_windows, size_t len, uint64_t seed,
                             kvq_bos_policy bos, kvq_windows *out, kvq_err *err);
void kvq_windows_free(kvq_windows *w);
/* Print the report: one "key: value" line each for protocol, tokenizer, path,
 * bytes, sha256s, crlf, bos, tokens, ctx, windows, dropped, then one line per
 * window "window W offset O first F last L". */
void kvq_windows_report(const kvq_windows *w, FILE *f);

/* Python-compatible MT19937 (see above). State lives in the caller's struct. */
typedef struct { uint32_t mt[624]; int mti; } kvq_pyrandom;
void kvq_pyrandom_seed(kvq_pyrandom *r, uint64_t seed);
uint32_t kvq_pyrandom_u32(kvq_pyrandom *r);
/* random.randint(a, b) for 0 <= b - a < 2^32; requires a <= b. */
int64_t kvq_pyrandom_randint(kvq_pyrandom *r, int64_t a, int64_t b);


#endif
