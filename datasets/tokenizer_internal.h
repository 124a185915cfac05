/* tokenizer_internal.h — what tokenizer.c and tokenizer_load.c share (not a public API): the tokenizer's state
 * and the vocabulary construction the loaders call. Each function is documented where it is defined
 * (tokenizer.c). */
#ifndef KVQ_TOKENIZER_INTERNAL_H
#define KVQ_TOKENIZER_INTERNAL_H

#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

enum { PRE_NONE = 0, PRE_GPT2 = 1, PRE_STARCODER = 2 };

struct kvq_tokenizer {
    kvq_tok_kind kind;
    int32_t n_vocab;
    char *blob;            /* all token texts, concatenated */
    size_t *off;           /* [n_vocab] offset into blob */
    uint32_t *len;         /* [n_vocab] */
    float *score;          /* [n_vocab] */
    uint8_t *type;         /* [n_vocab] kvq_toktype */
    int32_t *ht;           /* text -> id, open addressing, -1 empty */
    size_t ht_mask;
    /* merges: (left id, right id) -> rank, merged id */
    uint64_t *pk;
    int32_t *prank, *pmerged;
    size_t p_mask;
    int32_t n_merges;
    bool use_ranks;        /* SPM engine driven by merge ranks (HF Metaspace BPE) */
    int32_t bos, eos, unk;
    bool add_bos, add_eos, add_space_prefix;
    int pre;
    pcre2_code *re[2];
    int n_re;
    int32_t byte_tok[256]; /* byte -> token (SPM "<0xNN>", byte-level: bytes_to_unicode char) */
    uint16_t b2cp[256];    /* GPT-2 bytes_to_unicode */
    int16_t cp2b[324];     /* inverse, -1 if none */
    int32_t *special;      /* ids of control/unknown/user-defined tokens, text length descending */
    int32_t n_special;
    int32_t n_dup;
    char desc[192];
};

typedef struct { char *v; size_t n, cap; } bvec;

int kvqi_bvec_put(bvec *a, const char *s, size_t n);
kvq_tokenizer *kvqi_tok_alloc(int32_t n_vocab, size_t blob_cap);
kvq_status kvqi_tok_finish(kvq_tokenizer *t, const char *src, kvq_err *err);
kvq_status kvqi_merges_alloc(kvq_tokenizer *t, size_t n, const char *src, kvq_err *err);
kvq_status kvqi_merge_add(kvq_tokenizer *t, const char *a, size_t na, const char *b, size_t nb, int32_t rank,
                     const char *src, const char *field, kvq_err *err);
kvq_status kvqi_merge_add_line(kvq_tokenizer *t, const char *s, size_t n, int32_t rank, const char *src,
                          const char *field, kvq_err *err);

#endif
