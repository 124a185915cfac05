/* passkey.h — a retrieval task on long contexts with the KV cache quantized by
 * each scheme: a number hidden at a chosen depth in filler text and asked for at
 * the end, answered by greedy decoding (kveval --task passkey).
 *
 * Prompt (Mohtashami & Jaggi 2023, "Landmark Attention", the passkey test as
 * their generate_prompt writes it; LongLoRA and others reuse it), lines joined
 * with "\n":
 *   There is an important info hidden inside a lot of irrelevant text. Find it
 *   and memorize them. I will quiz you about the important information there.
 *   <filler before>
 *   The pass key is KEY. Remember it. KEY is the pass key.
 *   <filler after>
 *   What is the pass key? The pass key is
 * The filler repeats the five sentences "The grass is green. The sky is blue. The
 * sun is yellow. Here we go. There and back again." joined by " "; depth d puts
 * round(d x F) of the F filler sentences before the key line. F is the largest
 * count whose prompt and answer fit in `length` tokens (BOS per the model's
 * tokenizer), so every case is within one sentence of its length. KEY: 5 digits,
 * drawn as random.randint(10000, 99999) after random.seed(seed) (kvq_pyrandom),
 * one per (length, depth, trial) in that order.
 *
 * Scoring, greedy and decode-equivalent: the window is the prompt followed by the
 * answer " KEY" as the tokenizer spells it after the prompt (the tokens of
 * prompt + " " + KEY past their common prefix with the prompt's). Greedy decoding
 * returns the key iff the top token at each answer position is the next answer
 * token and the top token after the last digit does not start with a digit (the
 * number does not go on) — one batched forward of that window with the scheme's
 * quantized cache, teacher-forced, is exactly that, because the batched window is
 * decode-equivalent (KVEVAL.md "Decode equivalence": every query sees the K/V a
 * decode step with a real quantized cache would hold; KIVI from the first token).
 * A continuation spelled with other tokens than the tokenizer's own counts as
 * wrong. The report keeps what the model wrote instead (the greedy tokens up to
 * the first wrong one).
 */
#ifndef KVQ_PASSKEY_H
#define KVQ_PASSKEY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "perplexity.h"
#include "scheme.h"
#include "tokenizer.h"

#define KVQ_PASSKEY_MAX 32 /* lengths, depths */

/* One prompt. */
typedef struct {
    size_t length;      /* the requested window length (tokens) */
    double depth;       /* 0 = the key line first, 1 = last */
    char key[16];
    int32_t *tokens;    /* [n]: the prompt, then the answer */
    size_t n, n_prompt, n_answer;
    size_t n_filler;    /* filler sentences */
    size_t key_token;   /* the token index where the key line starts */
} kvq_passkey_case;

/* Build a case for a window of at most `length` tokens. Errors: KVQ_EINVAL when
 * even a prompt without filler does not fit (length too small), the tokenizer's. */
kvq_status kvq_passkey_make(const kvq_tokenizer *tok, size_t length, double depth, const char *key, kvq_passkey_case *out,
                            kvq_err *err);
void kvq_passkey_case_free(kvq_passkey_case *c);

#define KVQ_PASSKEY_MAX_ANSWER 16 /* answer tokens kept per outcome */

/* What one scheme answered. */
typedef struct {
    bool correct;
    int top[KVQ_PASSKEY_MAX_ANSWER + 1]; /* the top token at each answer position and after it (teacher-forced), -1 past n_answer */
    int first_wrong;    /* answer step of the first top token that is not the answer's (n_answer: the number went on), -1 */
    char got[64];       /* the greedy continuation up to and including the first wrong token (decoded text) */
} kvq_passkey_outcome;

typedef struct {
    size_t n_lengths, n_depths, trials;
    size_t lengths[KVQ_PASSKEY_MAX];
    double depths[KVQ_PASSKEY_MAX];
    uint64_t seed;
    unsigned engine_flags; /* KVQ_FWD_* for the engine (tests: KVQ_FWD_ROW_INVARIANT, batch-invariant GEMMs); 0 */
} kvq_passkey_opts;

/* Every case (length-major, then depth, then trial) for every scheme. */
typedef struct {
    size_t n_cases, n_schemes;
    kvq_passkey_case *cases;      /* [n_cases] (tokens kept) */
    kvq_passkey_outcome *out;     /* [n_cases][n_schemes] */
    double seconds;
} kvq_passkey_result;

/* Run them: case by case, every scheme on the case's window (on the GPU one descriptor upload per
 * scheme and case). Lengths beyond the model's context less a scheme's IntactKV prefix are an error
 * (KVQ_EINVAL naming the length); the forward's errors prefixed with the scheme and the case. */
kvq_status kvq_passkey_run(kvq_ppl_exec *x, const kvq_model *m, const kvq_tokenizer *tok, const kvq_eval_scheme *schemes,
                           size_t n_schemes, const kvq_passkey_opts *o, kvq_progress *prog, kvq_passkey_result *res,
                           kvq_err *err);
void kvq_passkey_result_free(kvq_passkey_result *r);

/* The report. The first scheme is the reference (kveval puts fp16 first): a length where it
 * retrieves fewer than half of the keys is one the model cannot do, named in a note and left out
 * of the "summary" column (accuracy over the other lengths). Markdown: header lines, a table
 * scheme × length (correct / cases) plus summary, a table scheme × depth over the summary
 * lengths, the note. JSON: every case with its key, depth, token counts, and per scheme correct
 * and what it wrote; written through outfile (temporary name, renamed). */
kvq_status kvq_passkey_report_table(FILE *f, const kvq_model *m, const kvq_passkey_opts *o, const kvq_eval_scheme *schemes,
                                    const kvq_passkey_result *r, const kvq_ppl_exec *x, kvq_err *err);
kvq_status kvq_passkey_report_json(const char *path, const kvq_model *m, const kvq_tokenizer *tok, const kvq_passkey_opts *o,
                                   const kvq_eval_scheme *schemes, const kvq_passkey_result *r, const kvq_ppl_exec *x,
                                   kvq_err *err);

#endif
