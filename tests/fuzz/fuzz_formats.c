/* fuzz_formats.c — libFuzzer entry for kvq's file readers (GGUF, llama2.c,
 * safetensors, HF checkpoints and tokenizers, text); the step and its checks
 * are in fuzz_formats.h. Build and run: scripts/fuzz_formats.sh. The scratch
 * directory is created once per process (static state confined to this
 * harness). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz_formats.h"

static char g_dir[256];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    const char *base = getenv("KVQ_FUZZ_TMP") ? getenv("KVQ_FUZZ_TMP") : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/kvq-fuzz-XXXXXX", base);
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); abort(); }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *bad = kvq_fuzz_formats_one(g_dir, data, size);
    if (bad) { fprintf(stderr, "kvq fuzz: %s\n", bad); abort(); }
    return 0;
}
