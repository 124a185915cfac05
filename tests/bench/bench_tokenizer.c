/* bench_tokenizer.c — byte-level BPE throughput on English text (one core):
 * tokenise ../shared/datasets/wikitext-2-raw/wiki.test.raw with the default
 * model's tokenizer (SmolLM2, pre "smollm") and the GPT-2 conformance vocab;
 * prints MB/s (1 MB = 1e6 bytes) and the token count. Target: >= 2 MB/s. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tokenizer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench(const char *tokpath, const char *text, size_t n)
{
    kvq_tokenizer *tok;
    kvq_err e = {0};
    if (kvq_tokenizer_load(tokpath, &tok, &e)) { fprintf(stderr, "skip %s: %s\n", tokpath, e.msg); return 0; }
    double best = 1e30;
    size_t nt = 0;
    for (int rep = 0; rep < 3; rep++) {
        int32_t *ids;
        double t0 = now();
        if (kvq_tokenizer_encode(tok, text, n, 0, &ids, &nt, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
        double dt = now() - t0;
        if (dt < best) best = dt;
        free(ids);
    }
    printf("%-44s %zu bytes -> %zu tokens: %.3f s, %.2f MB/s\n", kvq_tokenizer_describe(tok), n, nt, best, n / best / 1e6);
    kvq_tokenizer_free(tok);
    return 0;
}

int main(void)
{
    const char *path = "../shared/datasets/wikitext-2-raw/wiki.test.raw";
    FILE *f = fopen(path, "rb");
    if (!f) { printf("skip: %s absent\n", path); return 0; }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)sz + 1);
    if (!text || fread(text, 1, (size_t)sz, f) != (size_t)sz) { fclose(f); return 1; }
    fclose(f);
    int rc = bench("models/SmolLM2-135M-Instruct.Q4_1.gguf", text, (size_t)sz);
    rc |= bench("../shared/tokenizer-conformance/ggml-vocab-gpt-2.gguf", text, (size_t)sz);
    rc |= bench("../shared/tokenizer-conformance/ggml-vocab-llama-spm.gguf", text, (size_t)sz);
    free(text);
    return rc;
}
