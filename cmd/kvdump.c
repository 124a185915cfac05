/* kvdump — run a model over calibration text and capture per-layer pre-/post-RoPE keys, values, attention statistics and Fisher information into HDF5. */
#include <stdio.h>
#include <string.h>

#include "cuda_info.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvdump [options]\n"
            "\n"
            "run a model over calibration text and capture per-layer pre-/post-RoPE keys, values, attention statistics and Fisher information into HDF5.\n"
            "\n"
            "options:\n"
            "  -h, --help     show this help and exit\n"
            "  --version      print the kvq version and build (CPU/CUDA)\n"
            "\n"
            "status: the kvdump pipeline step is not implemented in this build yet.\n");
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        if (!strcmp(argv[i], "--version")) {
            printf("kvdump (kvq) 0.1.0, %s build\n", kvq_cuda_compiled() ? "CUDA" : "CPU-only");
            return 0;
        }
    }
    fprintf(stderr, "kvdump: not implemented yet; see --help\n");
    return 2;
}
