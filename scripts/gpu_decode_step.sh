#!/usr/bin/env bash
# gpu_decode_step.sh — on a CUDA machine (H100/H200: sm_90): the decode step of a Llama-2-7B-shaped model
# (random bf16 weights) on the packed KV cache against an fp16 cache (issue 46; tests/gpu/bench_decode_step.c):
# build check, correctness checks (GEMM vs float64, one layer's attention vs the CPU cache), then tokens/s, the
# step's breakdown, bytes against the copy bound and device memory per (cache, B, N). Results for
# docs/BENCHMARKS.md "Decode step of a Llama-2-7B-shaped model (issue 46)".
#
# usage: scripts/gpu_decode_step.sh [--quick | --moonshot] [OUTDIR] [-- bench_decode_step options]
#   (default)   fp16, nuq4/3/2-1%, kivi2 at N = 4K, 32K, 128K and the longest N that fits, B = 1 and 32
#               (estimated 1-3 minutes with a prebuilt binary; rows that would start past 3/4 of the time limit
#               are listed as skipped)
#   --quick     fp16 and nuq3-1% at B = 1, N = 4K and 32K (under a minute)
#   --moonshot  nuq2-1% at B = 1, N = 1M and the longest N that fits (an H200: 139 GB; an 80 GB H100 skips 1M)
#   OUTDIR      default $OUT/decode_step when $OUT is set, else out/gpu_decode_step; receives gpu.txt, run.log,
#               decode_step.csv, decode_step.md
#   KVQ_PREBUILT=DIR  use DIR/bench_decode_step built elsewhere (`make CUDA=1 gpu-tests`, then
#               scripts/gpu_carry_bins.sh DIR bench_decode_step); DIR/lib (or DIR/libs.tar.xz, unpacked) goes on
#               LD_LIBRARY_PATH. Without it the script builds `make CUDA=1 CUDA_ARCH=sm_90 build/gpu/bench_decode_step`.
#   KVQ_TIMEOUT=S  the benchmark's time limit (default 560 s; rows start only within the first 3/4 of it):
#               e.g. 270 for each of two runs chained in one 600 s device call
# Exit status: that of bench_decode_step (0 done, 1 a check failed, 2 a CUDA/cuBLAS or usage error; 124 when
# KVQ_TIMEOUT ended it), 2 for an unknown option of this script, or 3 when the binary cannot be built or found.
set -euo pipefail
mode=()
limit=${KVQ_TIMEOUT:-560}
[[ "$limit" =~ ^[0-9]+$ ]] && [ "$limit" -ge 60 ] || { echo "gpu_decode_step: KVQ_TIMEOUT: expected seconds >= 60, found '$limit'" >&2; exit 2; }
budget=$((limit * 3 / 4))
case "${1:-}" in
--quick) mode=(--quick); budget=$((budget < 120 ? budget : 120)); shift ;;
--moonshot) mode=(--moonshot); shift ;;
-h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
case "${1:-}" in
-?*) [ "$1" = "--" ] || { echo "gpu_decode_step: unknown option '$1' (see --help; bench_decode_step's options go after --)" >&2; exit 2; } ;;
esac
if [ $# -gt 0 ] && [ "$1" != "--" ]; then out=$1; shift; else out=${OUT:+$OUT/decode_step}; out=${out:-out/gpu_decode_step}; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
out=$(realpath "$out")
[ -z "${KVQ_PREBUILT:-}" ] || KVQ_PREBUILT=$(realpath "$KVQ_PREBUILT")
cd "$(dirname "$0")/.."
echo "== build check"
if [ -n "${KVQ_PREBUILT:-}" ]; then
    bin=$KVQ_PREBUILT/bench_decode_step
    if [ ! -d "$KVQ_PREBUILT/lib" ] && [ -f "$KVQ_PREBUILT/libs.tar.xz" ]; then tar -xJf "$KVQ_PREBUILT/libs.tar.xz" -C "$KVQ_PREBUILT"; fi
    export LD_LIBRARY_PATH="$KVQ_PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    bin=build/gpu/bench_decode_step
    make -j"$(nproc)" CUDA=1 CUDA_ARCH=sm_90 build/gpu/bench_decode_step >"$out/build.log" 2>&1 ||
        { tail -30 "$out/build.log"; echo "gpu_decode_step: the build failed ($out/build.log)" >&2; exit 3; }
fi
[ -x "$bin" ] || { echo "gpu_decode_step: $bin is not an executable" >&2; exit 3; }
# cuBLAS (linked): make the toolkit's copy findable when it is not on the loader path
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" && break
done
"$bin" --help >/dev/null || { echo "gpu_decode_step: $bin does not start (missing libraries? ldd $bin)" >&2; exit 3; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/gpu.txt" || true
echo "== checks and benchmark"
rc=0
timeout "$limit" "$bin" "${mode[@]}" --budget "$budget" --csv "$out/decode_step.csv" --md "$out/decode_step.md" "$@" 2>&1 | tee "$out/run.log" ||
    rc=${PIPESTATUS[0]}
echo "gpu_decode_step: exit $rc; results in $out (decode_step.csv, decode_step.md, run.log)"
exit "$rc"
