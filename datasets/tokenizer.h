/* tokenizer.h — text <-> token ids, exactly as the model's own tokenizer.
 *
 * Two merge engines behind one opaque handle:
 *  - SentencePiece-style BPE with scores (GGUF tokenizer.ggml.model = "llama",
 *    llama2.c tokenizer.bin): text is split into UTF-8 characters, ' ' becomes
 *    U+2581 "▁", a "▁" is prepended when add_space_prefix is set (GGUF
 *    tokenizer.ggml.add_space_prefix, default true; llama2.c always), and the
 *    adjacent pair whose concatenation is a vocabulary token with the highest
 *    score is merged repeatedly (ties: leftmost). Characters that end up as no
 *    token are emitted as byte tokens "<0xNN>" (byte fallback), or as the
 *    unknown token when the vocabulary has no byte tokens.
 *    Reference: llama.cpp src/llama-vocab.cpp (llm_tokenizer_spm), llama2.c run.c encode().
 *  - Byte-level BPE with ranked merges (GGUF model "gpt2", HF tokenizer.json
 *    "BPE" + "ByteLevel"): the text is pre-tokenised with the regexes named by
 *    tokenizer.ggml.pre (PCRE2, UTF + Unicode properties), each piece's bytes
 *    are mapped through GPT-2's bytes_to_unicode table, and the adjacent pair
 *    with the lowest merge rank is merged repeatedly (ties: leftmost).
 *    Pre-tokenizers: "gpt2"/"gpt-2"/"default" = the GPT-2 pattern
 *      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *    "starcoder"/"smollm" = \p{N} (each digit its own piece), then the GPT-2
 *    pattern on every piece. Each regex is applied to every piece of the
 *    previous one; text between matches is kept as its own piece.
 *    Reference: Radford et al. 2019 (GPT-2 encoder.py); llama.cpp llm_tokenizer_bpe.
 *  - HF tokenizer.json with a BPE model whose normalizer is the Llama-2
 *    "Prepend ▁ + Replace ' '->'▁'" (Metaspace style, byte_fallback) uses the
 *    SentencePiece character path with merge ranks instead of scores.
 *
 * Special tokens. Control tokens (GGUF token_type 3, HF added tokens with
 * "special": true) are matched as whole tokens only with KVQ_TOK_PARSE_SPECIAL;
 * otherwise their text is tokenised like any text. User-defined tokens (GGUF
 * type 4, HF added tokens with "special": false) are always matched, as in
 * llama.cpp and HF. Matching follows llama.cpp: longest special text first,
 * every occurrence, left to right.
 *
 * Bad input. Text is (pointer, length); NUL bytes are ordinary bytes. Invalid
 * UTF-8 never fails and never crashes: in the byte-level path the invalid bytes
 * become pieces of their own and are encoded through the byte tokens, so
 * decode(encode(x)) == x still holds; in the SentencePiece path each invalid
 * byte is one character with no token and goes to "<0xNN>" byte fallback.
 * A byte without a byte token (kvq_tokenizer_byte_token() == -1) becomes the
 * unknown token (lossy) or, without one, KVQ_EUNSUPPORTED. In the SentencePiece
 * path a literal "▁" (U+2581) in the text is indistinguishable from an escaped
 * space and decodes as ' ' (as in SentencePiece itself); otherwise
 * decode(encode(x)) == x for any bytes x when special tokens are not parsed.
 * Vocabulary defects: a merge naming a token not in the vocabulary, a missing
 * merges array for a byte-level vocabulary, a BOS/EOS/UNK id out of range,
 * an unknown token type → KVQ_EFORMAT naming file, key and index. A token with
 * an empty text is kept (decodes to nothing) but never produced by encode. Duplicate
 * token texts are allowed (some vocabularies pad with them): text→id uses the
 * FIRST id; the count is in kvq_tokenizer_describe().
 *
 * Thread safety: a loaded tokenizer is read-only; encode/decode may be called
 * from several threads at once (each call allocates its own scratch).
 */
#ifndef KVQ_TOKENIZER_H
#define KVQ_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct kvq_tokenizer kvq_tokenizer;

/* Engine / origin, for describe() and callers that must branch. */
typedef enum {
    KVQ_TOK_SPM = 1,      /* SentencePiece-style (scores, or HF Metaspace ranks) */
    KVQ_TOK_BPE_BYTES = 2 /* byte-level BPE with merges */
} kvq_tok_kind;

/* Token types (GGUF tokenizer.ggml.token_type / llama.cpp llama_token_type). */
typedef enum {
    KVQ_TOKTYPE_UNDEFINED = 0, KVQ_TOKTYPE_NORMAL = 1, KVQ_TOKTYPE_UNKNOWN = 2,
    KVQ_TOKTYPE_CONTROL = 3, KVQ_TOKTYPE_USER_DEFINED = 4, KVQ_TOKTYPE_UNUSED = 5,
    KVQ_TOKTYPE_BYTE = 6
} kvq_toktype;

/* encode flags */
#define KVQ_TOK_ADD_BOS         0x01u /* prepend BOS (error if the vocab has none) */
#define KVQ_TOK_ADD_BOS_DEFAULT 0x02u /* prepend BOS iff the metadata says so (GGUF add_bos_token,
                                         default true for "llama", false for "gpt2"; llama2.c: true;
                                         HF json: post_processor template begins with BOS) */
#define KVQ_TOK_ADD_EOS         0x04u /* append EOS */
#define KVQ_TOK_ADD_EOS_DEFAULT 0x08u /* append EOS iff add_eos_token */
#define KVQ_TOK_PARSE_SPECIAL   0x10u /* recognise control tokens (e.g. "<|im_start|>") in the text */
/* decode flags */
#define KVQ_TOK_DECODE_SPECIAL  0x20u /* render control tokens as their text (default: render nothing) */
#define KVQ_TOK_KEEP_LEADING_SPACE 0x40u /* do not strip the space that add_space_prefix added */

/* Load from a GGUF file (tokenizer.ggml.* keys). */
kvq_status kvq_tokenizer_from_gguf(const char *path, kvq_tokenizer **out, kvq_err *err);
/* Load a llama2.c tokenizer.bin: uint32 max_token_length, then vocab_size records
 * {float32 score, int32 len, len bytes}; ' ' in token texts is the word-start
 * marker. Ids 0/1/2 are <unk>/BOS/EOS as llama2.c defines them; "<0xNN>" texts
 * are byte tokens. add_bos default true, add_space_prefix true (run.c encode()).
 * max_token_length must be at most 65536; an HDF5, GGUF or safetensors file or a
 * llama2.c model checkpoint is named as such (KVQ_EFORMAT, "... not a tokenizer"). */
kvq_status kvq_tokenizer_from_llama2c(const char *path, int32_t vocab_size, kvq_tokenizer **out, kvq_err *err);
/* Load an HF tokenizer.json whose "model" is {"type": "BPE"} (vocab + merges;
 * added_tokens; pre_tokenizer ByteLevel / Split+ByteLevel / Digits+ByteLevel
 * sequences, or the Llama-2 Metaspace normalizer; byte_fallback). Other models
 * (Unigram, WordPiece) → KVQ_EUNSUPPORTED.
 * BOS/EOS: by default from the post_processor (TemplateProcessing "single"
 * beginning / ending with a SpecialToken). When the file is named
 * "tokenizer.json" and a tokenizer_config.json lies beside it (an HF
 * checkpoint directory), that file's "bos_token" / "eos_token" (string or
 * {"content": string}; null = keep) set the BOS / EOS ids, and
 * "add_bos_token" / "add_eos_token" (when present) decide whether
 * KVQ_TOK_ADD_BOS_DEFAULT / _EOS_DEFAULT add them, as transformers'
 * LlamaTokenizerFast does. A token text not in the vocabulary, a non-boolean
 * flag, a flag set without its token, or invalid JSON → KVQ_EFORMAT naming
 * tokenizer_config.json and the key. Ids index arrays of (largest id + 1)
 * entries: an id of 2 × (vocab + added tokens) + 1024 or more is refused
 * (KVQ_EFORMAT), so memory stays bounded by the file's size. */
kvq_status kvq_tokenizer_from_hf_json(const char *path, kvq_tokenizer **out, kvq_err *err);
/* Choose by content: "GGUF" magic → gguf; first non-space byte '{' → HF json;
 * otherwise llama2.c with the vocab size inferred by reading records to EOF. */
kvq_status kvq_tokenizer_load(const char *path, kvq_tokenizer **out, kvq_err *err);
/* The tokenizer of a model: kvq_model_tokenizer_path(model_path, tokenizer)
 * (formats/model.h: the --tokenizer FILE value when given, else the GGUF file
 * itself or the HF directory's tokenizer.json; llama2.c needs --tokenizer),
 * then kvq_tokenizer_load. */
kvq_status kvq_tokenizer_for_model(const char *model_path, const char *tokenizer, kvq_tokenizer **out, kvq_err *err);
void kvq_tokenizer_free(kvq_tokenizer *tok);

/* Tokenise text[0..len) (any bytes). *ids is malloc'd [*n] int32 (free()); on
 * error *ids = NULL, *n = 0. Deterministic; no state between calls. */
kvq_status kvq_tokenizer_encode(const kvq_tokenizer *tok, const char *text, size_t len, unsigned flags,
                                int32_t **ids, size_t *n, kvq_err *err);
/* ids → bytes. *text is malloc'd, NUL-terminated, [*len] bytes (free()).
 * Byte tokens "<0xNN>" and byte-level tokens yield raw bytes; control tokens
 * yield nothing unless KVQ_TOK_DECODE_SPECIAL; with add_space_prefix the single
 * leading space of the first text token is removed (SentencePiece decode).
 * An id outside [0, n_vocab) → KVQ_EINVAL naming the position. */
kvq_status kvq_tokenizer_decode(const kvq_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                                char **text, size_t *len, kvq_err *err);

int32_t kvq_tokenizer_n_vocab(const kvq_tokenizer *tok);
/* The tokenizer must belong to the model: its ids index the embedding (n_vocab <=
 * model_vocab: "<what>: tokenizer has N tokens, the model's vocabulary only M: wrong
 * --tokenizer?"), a llama2.c tokenizer has exactly model_vocab records (run.c reads that
 * many), and any other covers at least 90% of the rows (a model pads its vocabulary by a
 * few rows at most; a 512-token tokenizer on a 49152-row model used to run, exit 0).
 * Errors: KVQ_EMISMATCH naming both sizes (what: the tokenizer's file). */
kvq_status kvq_tokenizer_check_vocab(const kvq_tokenizer *tok, int32_t model_vocab, const char *what, kvq_err *err);
int32_t kvq_tokenizer_bos(const kvq_tokenizer *tok); /* -1 when the vocabulary has none */
int32_t kvq_tokenizer_eos(const kvq_tokenizer *tok); /* -1 when none */
bool kvq_tokenizer_add_bos_default(const kvq_tokenizer *tok);
kvq_tok_kind kvq_tokenizer_kind(const kvq_tokenizer *tok);
kvq_toktype kvq_tokenizer_token_type(const kvq_tokenizer *tok, int32_t id); /* UNDEFINED if out of range */
/* Stored text of a token (NOT NUL-terminated; "▁" / byte-level chars as in the
 * vocabulary), *len its length; NULL when id is out of range. */
const char *kvq_tokenizer_token_text(const kvq_tokenizer *tok, int32_t id, size_t *len);
/* The token that stands for raw byte b ("<0xNN>" in SentencePiece vocabularies,
 * the bytes_to_unicode character in byte-level ones), -1 if the vocabulary has
 * none (e.g. StarCoder lacks 0xF5..0xFF, which never occur in valid UTF-8):
 * such bytes encode as the unknown token, or fail with KVQ_EUNSUPPORTED when
 * there is no unknown token either. */
int32_t kvq_tokenizer_byte_token(const kvq_tokenizer *tok, uint8_t b);
/* Text → id of a whole token (exact stored text), -1 if absent. */
int32_t kvq_tokenizer_find(const kvq_tokenizer *tok, const char *text, size_t len);
/* Identity line for dump metadata, e.g. "gguf gpt2/smollm vocab 49152 merges 48900 bos 1 eos 2". */
const char *kvq_tokenizer_describe(const kvq_tokenizer *tok);

#endif
