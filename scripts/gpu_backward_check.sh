#!/usr/bin/env bash
# gpu_backward_check.sh — on a GPU machine, in one go (issue 10): build the CUDA
# path, check the GPU backward pass and attention statistics against the CPU, the
# Fisher information of the real model CPU vs GPU, and time kvdump --fisher.
#
#   scripts/gpu_backward_check.sh MODEL TEXT [OUTDIR]
#     MODEL   the model file (never downloaded here: pass a local copy)
#     TEXT    calibration text (e.g. wiki.train.raw or wiki.test.raw)
#     OUTDIR  where logs and the dump go (default out/gpu_backward)
# Steps:
#   1. gpu_check --synthetic   forward CPU vs GPU on random-weight models (regression)
#   2. gpu_check --backward    backward CPU vs GPU (fp32 within 1e-4; KIVI, nuq, host
#                              hook for information), upstream-gradient path, attention
#                              statistics
#   3. gpu_check --model MODEL --text TEXT --fisher N --ctx 2048
#                              Fisher information CPU vs GPU per layer (<= 1e-3)
#   4. kvdump --samples 16 --seq-len 2048 --fisher --device cuda   (target <= 60 s)
# Environment: KVQ_PREBUILT=DIR use DIR/gpu_check and DIR/kvdump built elsewhere
# (`make CUDA=1 all gpu-tests`), with DIR/lib on LD_LIBRARY_PATH (for a device image
# without our build dependencies); KVQ_FISHER_WINDOWS (default 2); CUDA_ARCH (sm_90).
# Exit status 0 when every check passes and the dump was written.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$(realpath "$1") TEXT=$(realpath "$2") OUT=$(realpath -m "${3:-out/gpu_backward}")
[ -r "$MODEL" ] || { echo "gpu_backward_check: cannot read model '$1'" >&2; exit 2; }
[ -r "$TEXT" ] || { echo "gpu_backward_check: cannot read text '$2'" >&2; exit 2; }
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [ -n "${KVQ_PREBUILT:-}" ]; then
    BIN=$(realpath "$KVQ_PREBUILT") KVDUMP=$BIN/kvdump CHECK=$BIN/gpu_check
    export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    chmod +x "$KVDUMP" "$CHECK"
else
    make -j"$(nproc)" CUDA=1 CUDA_ARCH="${CUDA_ARCH:-sm_90}" all gpu-tests
    KVDUMP=bin/kvdump CHECK=build/gpu/gpu_check
fi
# cuBLAS from the toolkit when the loader does not find it
if ldd "$CHECK" | grep -q 'libcublas.*not found'; then
    c=$(find /usr /opt -name 'libcublas.so.*' 2>/dev/null | head -1)
    [ -n "$c" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$c")"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt" || true
rc=0
echo "== 1. forward, synthetic models, CPU vs GPU"
"$CHECK" --synthetic >"$OUT/synthetic.md" 2>&1 || rc=1
tail -1 "$OUT/synthetic.md"
echo "== 2. backward and attention statistics, synthetic models, CPU vs GPU"
"$CHECK" --backward 2>&1 | tee "$OUT/backward.md" | grep -E '^\| (fp32|kivi|nuq)|upstream|gpu_check:' || true
grep -q 'ALL PASS' "$OUT/backward.md" || rc=1
echo "== 3. Fisher information of $MODEL, CPU vs GPU"
"$CHECK" --model "$MODEL" --text "$TEXT" --ctx 2048 --fisher "${KVQ_FISHER_WINDOWS:-2}" 2>&1 | tee "$OUT/fisher.md" || rc=1
echo "== 4. kvdump 16 x 2048 --fisher on the GPU"
rm -f "$OUT/dump16.h5"
start=$(date +%s%N)
"$KVDUMP" --model "$MODEL" --text "$TEXT" --samples 16 --seq-len 2048 --fisher --attn-stats --device cuda --force \
    -o "$OUT/dump16.h5" 2>"$OUT/kvdump.log" || { rc=1; tail -5 "$OUT/kvdump.log"; }
end=$(date +%s%N)
grep -v '^\s*$' "$OUT/kvdump.log" | tail -6
ms=$(((end - start) / 1000000))
echo "kvdump wall time: $((ms / 1000)).$(printf %03d $((ms % 1000))) s; dump $(du -h "$OUT/dump16.h5" 2>/dev/null | cut -f1)"
rm -f "$OUT/dump16.h5" # too large to bring back
exit $rc
