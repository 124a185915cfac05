/* kveval — measure perplexity with the KV cache quantized by any scheme, side by side with the unquantized baseline. */
#include <stdio.h>
#include <string.h>

#include "cuda_info.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kveval [options]\n"
            "\n"
            "measure perplexity with the KV cache quantized by any scheme, side by side with the unquantized baseline.\n"
            "\n"
            "options:\n"
            "  -h, --help     show this help and exit\n"
            "  --version      print the kvq version and build (CPU/CUDA)\n"
            "\n"
            "status: the kveval pipeline step is not implemented in this build yet.\n");
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--version")) {
            printf("kveval (kvq) 0.1.0, %s build\n", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
            return 0;
        }
    }
    fprintf(stderr, "kveval: not implemented yet; see --help\n");
    return 2;
}
