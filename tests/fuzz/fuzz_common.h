/* fuzz_common.h — one fuzz step shared by the libFuzzer harness
 * (tests/fuzz/fuzz_tokenizer.c) and the Check replay of saved inputs
 * (tests/test_tokenizer.c, tests/fixtures/fuzz/). Input byte 0 picks the
 * tokenizer (toks[b % n]) and flags; the rest is the text. Checks: encode
 * never fails on any bytes, ids are in range, and without special-token
 * parsing decode(encode(x)) == x whenever every byte of x has a byte token
 * (byte-level BPE and SentencePiece with byte fallback are then lossless). Returns 0 when fine, else a description. */
#ifndef KVQ_FUZZ_COMMON_H
#define KVQ_FUZZ_COMMON_H

#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

static inline const char *kvq_fuzz_one(kvq_tokenizer *const *toks, int n_toks, const uint8_t *data, size_t size)
{
    if (size < 1 || n_toks < 1) return 0;
    const kvq_tokenizer *tok = toks[data[0] % n_toks];
    unsigned sel = data[0] / (unsigned)n_toks;
    unsigned flags = (sel & 1 ? KVQ_TOK_PARSE_SPECIAL : 0) | (sel & 2 ? KVQ_TOK_ADD_BOS_DEFAULT : 0);
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t *ids;
    size_t n;
    kvq_err e = {0};
    if (kvq_tokenizer_encode(tok, text, len, flags, &ids, &n, &e) != KVQ_OK) return "encode failed";
    const char *bad = 0;
    for (size_t i = 0; i < n && !bad; i++)
        if (ids[i] < 0 || ids[i] >= kvq_tokenizer_n_vocab(tok)) bad = "id out of range";
    char *back = NULL;
    size_t bl = 0;
    if (!bad && kvq_tokenizer_decode(tok, ids, n, 0, &back, &bl, &e) != KVQ_OK) bad = "decode failed";
    int lossless = 1; /* bytes without a byte token encode as <unk> (documented, lossy) */
    for (size_t i = 0; i < len; i++) lossless &= kvq_tokenizer_byte_token(tok, (uint8_t)text[i]) >= 0;
    /* SentencePiece: a literal U+2581 in the text is the word-boundary symbol and decodes as ' ' */
    if (kvq_tokenizer_kind(tok) == KVQ_TOK_SPM && len >= 3 && memmem(text, len, "\xe2\x96\x81", 3)) lossless = 0;
    if (!bad && lossless && !(flags & KVQ_TOK_PARSE_SPECIAL) && (bl != len || memcmp(back, text, len) != 0)) bad = "round trip differs";
    free(back);
    free(ids);
    return bad;
}

#endif
