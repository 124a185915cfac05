#!/usr/bin/env bash
# gpu_kvcache_bench.sh — on a CUDA machine (H200: sm_90): build, run the CUDA-vs-CPU
# checks of the packed KV cache (tests/gpu/test_kvcache_cuda.c), then the decode-attention
# benchmark (tests/gpu/bench_kvcache_cuda.c). Results for docs/BENCHMARKS.md.
#
# usage: scripts/gpu_kvcache_bench.sh [OUTDIR]        (default out/gpu_kvcache)
#   builds with `make CUDA=1 CUDA_ARCH=sm_90 gpu-tests` (needs the build dependencies);
#   KVQ_PREBUILT=DIR  use test_kvcache_cuda / bench_kvcache_cuda built elsewhere with that
#                     command (DIR/lib is put on LD_LIBRARY_PATH for libcjson), e.g. on a
#                     device image without hdf5/check; KVQ_BENCH_MEM=bytes caps the caches
#                     benchmarked at once (default 100e9).
#   KVQ_BENCH_BREAKDOWN=1  then where the NUQ decode kernel's time goes (breakdown.txt): Llama-2-7B heads at
#                     B = 32, N = 32K and B = 1, N = 128K, nuq2/3/4 with one phase left out at a time
#                     (KVQ_DEC_PROF: 1 dense keys, 2 sparse keys, 4 dense P·V, 8 sparse values; outputs then
#                     wrong) and without the L2 prefetches (16), next to the full kernel in the same run.
set -euo pipefail
out=${1:-out/gpu_kvcache}
mkdir -p "$out"
if [ -n "${KVQ_PREBUILT:-}" ]; then
    bin=$KVQ_PREBUILT
    export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    make -j"$(nproc)" CUDA=1 CUDA_ARCH=sm_90 gpu-tests
    bin=build/gpu
fi
# cuBLAS is dlopen'ed: make the toolkit's copy findable when it is not on the loader path
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" && break
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/gpu.txt" || true
echo "== CUDA vs CPU checks"
"$bin/test_kvcache_cuda" 2>&1 | tee "$out/test.log"
echo "== benchmark"
"$bin/bench_kvcache_cuda" "$out/bench.csv" "${KVQ_BENCH_MEM:-100e9}" 2>&1 | tee "$out/bench.txt"
if [ -n "${KVQ_BENCH_BREAKDOWN:-}" ]; then
    echo "== breakdown (KVQ_DEC_PROF)"
    for bn in "32 32768" "1 131072"; do
        set -- $bn
        for pf in 0 16 1 2 4 8; do
            echo "-- B=$1 N=$2 KVQ_DEC_PROF=$pf"
            KVQ_DEC_PROF=$pf KVQ_BENCH_FORMAT=nuq KVQ_BENCH_NO_FP16=1 KVQ_BENCH_MODEL=llama KVQ_BENCH_B=$1 KVQ_BENCH_N=$2 \
                "$bin/bench_kvcache_cuda" 2>&1 | grep -E '^llama' || true
        done
    done 2>&1 | tee "$out/breakdown.txt"
fi
