/* fuzz_tokenizer.c — libFuzzer entry for kvq_tokenizer_encode/decode over the
 * three conformance vocabularies (gpt-2, starcoder, llama-spm). Build and run:
 * scripts/fuzz_tokenizer.sh. The tokenizers are loaded once per process (the
 * only static state in kvq, confined to this harness). */
#include <stdint.h>
#include <stdio.h>

#include "fuzz_common.h"

static kvq_tokenizer *g_toks[3];
static int g_n;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    const char *dir = getenv("KVQ_SHARED") ? getenv("KVQ_SHARED") : "../shared";
    const char *names[3] = {"gpt-2", "starcoder", "llama-spm"};
    for (int i = 0; i < 3; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/tokenizer-conformance/ggml-vocab-%s.gguf", dir, names[i]);
        kvq_err e = {0};
        if (kvq_tokenizer_from_gguf(p, &g_toks[g_n], &e) != KVQ_OK) { fprintf(stderr, "%s\n", e.msg); abort(); }
        g_n++;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *bad = kvq_fuzz_one(g_toks, g_n, data, size);
    if (bad) { fprintf(stderr, "kvq fuzz: %s\n", bad); abort(); }
    return 0;
}
