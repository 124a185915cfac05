#!/usr/bin/env bash
# gpu_nuq_kernel.sh — on a CUDA machine (H100/H200: sm_90): the NUQ decode kernel v5 against v4 in one run (issue 46;
# kernels/kvcache/kvcache_cuda_dec.cuh, chosen per call by KVQ_NUQ_KERNEL=v4|v5, default v5). First
# test_kvcache_cuda (the CUDA cache against the CPU reference; for 3-bit values also v5's outputs against v4's, bit
# for bit), then bench_kvcache_cuda's nuq3 rows for both kernels, alternating v4, v5, v4, v5 per row: Llama-2-7B heads
# B = 1 N = 128K, B = 8 N = 32K, B = 32 N = 32K, SmolLM2-135M heads B = 32 N = 32K; and the control row Llama-2-7B
# B = 32 N = 32K with the dense P·V left out (KVQ_DEC_PROF=4: the kernels then differ in nothing, so the two times
# must agree; outputs wrong). Results for docs/BENCHMARKS.md "NUQ decode (issue 46's kernel) against its
# size-matched copy". About 2 minutes with prebuilt binaries.
#
# usage: scripts/gpu_nuq_kernel.sh [OUTDIR]
#   OUTDIR      default $OUT/nuq_kernel when $OUT is set, else out/gpu_nuq_kernel; receives gpu.txt, test.log,
#               bench_<row>_<kernel>_<round>.{csv,log} and summary.txt (one line per run: row, kernel, nuq3 µs, the
#               size-matched copy's µs, copy / nuq3)
#   KVQ_PREBUILT=DIR  use DIR/test_kvcache_cuda and DIR/bench_kvcache_cuda (`make CUDA=1 gpu-tests`, then
#               scripts/gpu_carry_bins.sh DIR test_kvcache_cuda bench_kvcache_cuda); DIR/lib (or DIR/libs.tar.xz,
#               unpacked) goes on LD_LIBRARY_PATH. Without it: build/gpu/ of this checkout (nothing is built here).
#   KVQ_ROUNDS=N  rounds of v4, v5 per row (default 2; 1 halves the benchmark's time)
#   KVQ_NO_TEST=1 leave test_kvcache_cuda out (the caller ran it in the same call)
# Exit status: 0 done, 1 test_kvcache_cuda failed (the benchmark still runs), 2 a benchmark run failed or a usage error,
# 3 a binary is missing or does not start.
set -euo pipefail
case "${1:-}" in
-h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
-?*) echo "gpu_nuq_kernel: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
rounds=${KVQ_ROUNDS:-2}
[[ "$rounds" =~ ^[1-9]$ ]] || { echo "gpu_nuq_kernel: KVQ_ROUNDS: expected 1-9, found '$rounds'" >&2; exit 2; }
if [ $# -gt 0 ]; then out=$1; else out=${OUT:+$OUT/nuq_kernel}; out=${out:-out/gpu_nuq_kernel}; fi
mkdir -p "$out"
out=$(realpath "$out")
cd "$(dirname "$0")/.."
if [ -n "${KVQ_PREBUILT:-}" ]; then
    dir=$(realpath "$KVQ_PREBUILT")
    if [ ! -d "$dir/lib" ] && [ -f "$dir/libs.tar.xz" ]; then tar -xJf "$dir/libs.tar.xz" -C "$dir"; fi
    export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    dir=build/gpu
fi
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" && break
done
for b in test_kvcache_cuda bench_kvcache_cuda; do
    [ -x "$dir/$b" ] || { echo "gpu_nuq_kernel: $dir/$b is not an executable (make CUDA=1 gpu-tests)" >&2; exit 3; }
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/gpu.txt" || true
rc=0
if [ "${KVQ_NO_TEST:-0}" != 1 ]; then
    echo "== test_kvcache_cuda"
    if ! "$dir/test_kvcache_cuda" >"$out/test.log" 2>&1; then
        rc=1
        grep -m 20 FAIL "$out/test.log" || true
    fi
    tail -1 "$out/test.log"
fi
echo "== bench_kvcache_cuda nuq3: v4 and v5 alternating"
: >"$out/summary.txt"
# row name, model prefix, B, N, KVQ_DEC_PROF
rows=("llama2-7b_B1_N128K llama2 1 131072 0" "llama2-7b_B8_N32K llama2 8 32768 0" "llama2-7b_B32_N32K llama2 32 32768 0"
      "smollm2_B32_N32K smollm2 32 32768 0" "llama2-7b_B32_N32K_noPV llama2 32 32768 4")
for row in "${rows[@]}"; do
    read -r name model b n prof <<<"$row"
    for round in $(seq "$rounds"); do
        for k in v4 v5; do
            f="$out/bench_${name}_${k}_$round"
            if ! KVQ_NUQ_KERNEL=$k KVQ_DEC_PROF=$prof KVQ_BENCH_FORMAT=nuq KVQ_BENCH_BITS=3 KVQ_BENCH_MODEL=$model KVQ_BENCH_B=$b \
                KVQ_BENCH_N=$n "$dir/bench_kvcache_cuda" "$f.csv" >"$f.log" 2>&1; then
                echo "gpu_nuq_kernel: bench_kvcache_cuda failed for $name $k (see $f.log)" >&2
                tail -5 "$f.log" >&2
                exit 2
            fi
            awk -F, -v r="$name" -v k="$k" -v rd="$round" '$4 == "nuq3" { t = $5 } $4 == "copy-matched-nuq3" { c = $5 }
                END { if (t > 0) printf "%-26s %s round %s  nuq3 %9.1f us  copy %8.1f us  copy/nuq3 %.3f\n", r, k, rd, t, c, (c > 0 ? c / t : 0) }' \
                "$f.csv" | tee -a "$out/summary.txt"
        done
    done
done
exit $rc
