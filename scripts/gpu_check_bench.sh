#!/usr/bin/env bash
# gpu_check_bench.sh — build the CUDA path, compare it with the CPU forward and
# benchmark kveval-style perplexity on a GPU machine, in one go (issue 10).
#
#   scripts/gpu_check_bench.sh MODEL TEXT [gpu_check options...]
#     MODEL  a model file (GGUF / safetensors dir / llama2.c); never downloaded here
#     TEXT   e.g. wiki.test.raw (WikiText-2 raw test split)
#   options are passed to build/gpu/gpu_check (--ctx 2048, --check-windows 2,
#   --max-windows N, --no-bench; see tests/gpu/gpu_check.c).
#
# Environment:
#   KVQ_GPU_BIN=path   use a prebuilt gpu_check (machines without the build
#                      dependencies: build elsewhere with `make gpu-tests`, carry the
#                      binary and its shared libraries, set LD_LIBRARY_PATH)
#   CUDA_ARCH=sm_90    GPU architecture for the build (default sm_90, H100/H200)
# Output: markdown tables (synthetic-model checks, CPU vs GPU on the model,
# the benchmark, GPU vs CPU decoding on the packed cache when ../shared or
# $KVQ_SHARED holds the tiny models) on stdout; exit status 0 when every check passes.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$1 TEXT=$2
shift 2
[ -r "$MODEL" ] || { echo "gpu_check_bench: cannot read model '$MODEL' (pass the path of a local copy)" >&2; exit 2; }
[ -r "$TEXT" ] || { echo "gpu_check_bench: cannot read text '$TEXT'" >&2; exit 2; }
MODEL=$(realpath "$MODEL") TEXT=$(realpath "$TEXT")
cd "$(dirname "$0")/.."
if [ -n "${KVQ_GPU_BIN:-}" ]; then
    BIN=$KVQ_GPU_BIN
else
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "gpu_check_bench: nvcc not found" >&2; exit 2; }
    make -j"$(nproc)" CUDA=1 CUDA_ARCH="${CUDA_ARCH:-sm_90}" all gpu-tests
    BIN=build/gpu/gpu_check
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true
echo "== synthetic models: CPU vs GPU, every KV scheme, host-hook and observe paths"
rc=0
"$BIN" --synthetic || rc=1
echo "== $MODEL on $TEXT: CPU vs GPU, then the perplexity benchmark"
"$BIN" --model "$MODEL" --text "$TEXT" "$@" || rc=1
if [ -d "${KVQ_SHARED:-../shared}/models/llama2c" ]; then
    echo "== greedy decoding on the packed KV cache, GPU vs CPU (tiny models of ${KVQ_SHARED:-../shared})"
    "$BIN" --decode || rc=1
fi
exit $rc
