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
#   4. kvdump --samples 16 --seq-len 2048 --fisher --attn-stats --device cuda   (target <= 60 s)
#   5. (when KVQ_IKV_BASE is set) kvcalib intactkv --train on the CPU and on the GPU with
#      the same small configuration (docs/RESULTS.md's: 8 x 256 tokens, 4 per step, 4
#      epochs, lr 4e-3): loss curves compared; then a GPU timing run with the reference's
#      window length and batch (--samples 128 --seq-len 1024 --accum 16, KVQ_IKV_STEPS
#      steps, default 20 of the reference's 160).
# Environment: KVQ_PREBUILT=DIR use DIR/gpu_check, DIR/kvdump and DIR/kvcalib built
# elsewhere (`make CUDA=1 all gpu-tests`), with DIR/lib on LD_LIBRARY_PATH (for a device
# image without our build dependencies); KVQ_FISHER_WINDOWS (default 2); CUDA_ARCH
# (sm_90); KVQ_IKV_BASE=artifact (a kvcalib artifact of MODEL, e.g. kivi2) and
# KVQ_IKV_TEXT=file (training text, default TEXT) for step 5.
# Exit status 0 when every check passes and the dump was written.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$(realpath "$1") TEXT=$(realpath "$2") OUT=$(realpath -m "${3:-out/gpu_backward}")
[ -r "$MODEL" ] || { echo "gpu_backward_check: cannot read model '$1'" >&2; exit 2; }
[ -r "$TEXT" ] || { echo "gpu_backward_check: cannot read text '$2'" >&2; exit 2; }
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [ -n "${KVQ_PREBUILT:-}" ]; then
    BIN=$(realpath "$KVQ_PREBUILT") KVDUMP=$BIN/kvdump CHECK=$BIN/gpu_check KVCALIB=$BIN/kvcalib
    export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    chmod +x "$KVDUMP" "$CHECK" "$KVCALIB"
else
    make -j"$(nproc)" CUDA=1 CUDA_ARCH="${CUDA_ARCH:-sm_90}" all gpu-tests
    KVDUMP=bin/kvdump CHECK=build/gpu/gpu_check KVCALIB=bin/kvcalib
fi
# cuBLAS from the toolkit when the loader does not find it
if ldd "$CHECK" | grep 'libcublas.*not found' >/dev/null; then
    c=$(find /usr /opt -name 'libcublas.so.*' 2>/dev/null | head -1 || true) # find fails on a missing /opt
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
if [ -n "${KVQ_IKV_BASE:-}" ]; then
    echo "== 5. IntactKV training, CPU vs GPU (8 x 256 tokens, 8 steps of 4 windows)"
    ITEXT=${KVQ_IKV_TEXT:-$TEXT}
    for dev in cpu cuda; do
        s0=$(date +%s%N)
        "$KVCALIB" intactkv --model "$MODEL" --base "$KVQ_IKV_BASE" --prefix bos --out "$OUT/ikv_$dev.safetensors" --force \
            --train --text "$ITEXT" --samples 8 --seq-len 256 --accum 4 --epochs 4 --lr 4e-3 --device "$dev" \
            --loss-csv "$OUT/ikv_$dev.csv" 2>"$OUT/ikv_$dev.log" || { rc=1; tail -3 "$OUT/ikv_$dev.log"; }
        s1=$(date +%s%N)
        echo "$dev: $(((s1 - s0) / 1000000)) ms; $(grep -E 'training loss over all' "$OUT/ikv_$dev.log")"
    done
    paste -d, "$OUT/ikv_cpu.csv" "$OUT/ikv_cuda.csv" | awk -F, 'NR > 1 { d = $2 - $6; if (d < 0) d = -d; r = d / $2; if (r > m) m = r;
        printf "step %s: loss CPU %.6f GPU %.6f\n", $1, $2, $6 } END { printf "max relative difference of the loss curves: %.2e\n", m;
        exit m > 1e-3 }' || rc=1
    echo "== 5b. IntactKV training on the GPU, the reference's batch: 128 x 1024 tokens, 16 per step, ${KVQ_IKV_STEPS:-20} steps"
    s0=$(date +%s%N)
    "$KVCALIB" intactkv --model "$MODEL" --base "$KVQ_IKV_BASE" --prefix bos --out "$OUT/ikv_ref.safetensors" --force \
        --train --text "$ITEXT" --samples 128 --seq-len 1024 --accum 16 --steps "${KVQ_IKV_STEPS:-20}" --lr 2e-4 --device cuda \
        --loss-csv "$OUT/ikv_ref.csv" 2>"$OUT/ikv_ref.log" || { rc=1; tail -3 "$OUT/ikv_ref.log"; }
    s1=$(date +%s%N)
    echo "wall $(((s1 - s0) / 1000000)) ms; $(grep -E 'training loss over all' "$OUT/ikv_ref.log")"
fi
exit $rc
