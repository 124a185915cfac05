/* kvcalib — turn a kvdump file into quantization tables (nuqX datatypes, per-channel pre-RoPE key scales, outlier thresholds, KIVI/IntactKV settings) in one calibration artifact. */
#include <stdio.h>
#include <string.h>

#include "cuda_info.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvcalib [options]\n"
            "\n"
            "turn a kvdump file into quantization tables (nuqX datatypes, per-channel pre-RoPE key scales, outlier thresholds, KIVI/IntactKV settings) in one calibration artifact.\n"
            "\n"
            "options:\n"
            "  -h, --help     show this help and exit\n"
            "  --version      print the kvq version and build (CPU/CUDA)\n"
            "\n"
            "status: the kvcalib pipeline step is not implemented in this build yet.\n");
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--version")) {
            printf("kvcalib (kvq) 0.1.0, %s build\n", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
            return 0;
        }
    }
    fprintf(stderr, "kvcalib: not implemented yet; see --help\n");
    return 2;
}
