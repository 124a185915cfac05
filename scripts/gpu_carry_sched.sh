#!/usr/bin/env bash
# gpu_carry_sched.sh — package the device schedule check and benchmark (issue 43: hh, mikv and zipcache's
# importance policy and qaq's selection step on the GPU, kernels/cuda/cuda_sched.cuh) for a GPU machine
# without our build dependencies that receives one transfer of at most ~50 MB beside the repository's tree.
#
#   scripts/gpu_carry_sched.sh DEST TEXT
#     DEST  output folder (emptied): bin/ (kveval and gpu_check with libs.tar.xz, scripts/gpu_carry_bins.sh),
#           text.raw, random_llama_model.py, run.sh
#     TEXT  ../shared/datasets/wikitext-2-raw/wiki.test.raw
# On the GPU machine (one call):  bash DEST/run.sh OUT
#   1. gpu_check --sched: the device schedule vs kvq_attention_sched on random data (decisions, counts, outputs),
#      and one SmolLM2-135M-shaped layer at T 2048 timed: device schedule / CPU schedule / native attention
#      (OUT/sched.txt);
#   2. a random-weight model of SmolLM2-135M's shape (tests/scripts/random_llama_model.py --shape smollm2-135m,
#      generated there: the real model is two transfers), then kveval at ctx 2048: the schedule schemes on the
#      device path and, on the same window, on the host path (KVQ_SCHED_HOST=1): PPL, bits and seconds side by
#      side (OUT/kveval_dev1.txt, kveval_host1.txt), and the device path over more windows (kveval_dev.txt), also
#      with the scores of every representation computed ahead of the policy (KVQ_SCHED_PRESCORE=1, kveval_pre.txt);
#   3. gpu_check --synthetic under a time limit of SYNTH_S seconds (default 60; 0 skips it): every family's GPU
#      path vs the CPU (OUT/synthetic.txt).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
DEST=$(realpath -m "$1") TEXT=$(realpath "$2")
cd "$(dirname "$0")/.."
rm -rf "$DEST"
mkdir -p "$DEST/bin"
bash scripts/gpu_carry_bins.sh "$DEST/bin" kveval gpu_check
cp "$TEXT" "$DEST/text.raw"
cp tests/scripts/random_llama_model.py "$DEST/"
cat >"$DEST/run.sh" <<'EOF'
#!/usr/bin/env bash
# run.sh OUT — written by scripts/gpu_carry_sched.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/tmp/sched_out}
mkdir -p "$OUT"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$HERE/bin/libs.tar.xz" "$HERE/bin"
export LD_LIBRARY_PATH=$HERE/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
chmod +x "$HERE"/bin/*
if ldd "$HERE/bin/kveval" | grep 'libcublas.*not found' >/dev/null; then
    c=$(find /usr /opt -name 'libcublas.so.*' 2>/dev/null | head -1 || true)
    [ -n "$c" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$c")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true
rc=0
t0=$(date +%s)
echo "== gpu_check --sched"
timeout 240 "$HERE/bin/gpu_check" --sched >"$OUT/sched.txt" 2>&1 || rc=1
grep -E '^\||PASS|FAIL' "$OUT/sched.txt" | tail -24
echo "== random SmolLM2-135M-shaped model ($(($(date +%s) - t0)) s)"
python3 "$HERE/random_llama_model.py" --shape smollm2-135m --out /tmp/kvq_sm --dtype bf16 >"$OUT/model.txt" 2>&1 || rc=1
tail -1 "$OUT/model.txt"
M=/tmp/kvq_sm
S1=(-s hh2 -s zipcache-p10%+sink4 -s mikv-nobal+pre-rope -s qaq-k0.0003-v0.03-q300)
echo "== kveval, one window, device path ($(($(date +%s) - t0)) s)"
timeout 60 "$HERE/bin/kveval" -m $M -t "$HERE/text.raw" -c 2048 -w 1 --no-kld "${S1[@]}" >"$OUT/kveval_dev1.txt" 2>&1 || rc=1
cat "$OUT/kveval_dev1.txt" | grep -vi progress | tail -12
echo "== kveval, the same window, host path (KVQ_SCHED_HOST=1) ($(($(date +%s) - t0)) s)"
KVQ_SCHED_HOST=1 timeout 240 "$HERE/bin/kveval" -m $M -t "$HERE/text.raw" -c 2048 -w 1 --no-kld "${S1[@]}" \
    >"$OUT/kveval_host1.txt" 2>&1 || rc=1
cat "$OUT/kveval_host1.txt" | grep -vi progress | tail -12
echo "== kveval, 4 windows, device path ($(($(date +%s) - t0)) s)"
timeout 90 "$HERE/bin/kveval" -m $M -t "$HERE/text.raw" -c 2048 -w 4 --no-kld -s hh2 -s zipcache -s mikv-nobal \
    -s qaq-k0.0003-v0.03-q300 >"$OUT/kveval_dev.txt" 2>&1 || rc=1
cat "$OUT/kveval_dev.txt" | grep -vi progress | tail -12
echo "== kveval, 4 windows, device path, scores ahead of the policy (KVQ_SCHED_PRESCORE=1) ($(($(date +%s) - t0)) s)"
KVQ_SCHED_PRESCORE=1 timeout 90 "$HERE/bin/kveval" -m $M -t "$HERE/text.raw" -c 2048 -w 4 --no-kld -s hh2 -s zipcache \
    -s mikv-nobal -s qaq-k0.0003-v0.03-q300 >"$OUT/kveval_pre.txt" 2>&1 || rc=1
cat "$OUT/kveval_pre.txt" | grep -vi progress | tail -12
if [ "${SYNTH_S:-60}" != 0 ]; then # SYNTH_S=0: skip
    echo "== gpu_check --synthetic ($(($(date +%s) - t0)) s)"
    timeout "${SYNTH_S:-60}" "$HERE/bin/gpu_check" --synthetic >"$OUT/synthetic.txt" 2>&1 ||
        echo "gpu_check --synthetic: rc $? (124: stopped at its time limit)"
    grep -E 'sched|hh|mikv|zipcache|ALL PASS|FAIL' "$OUT/synthetic.txt" | tail -20
fi
echo "== done ($(($(date +%s) - t0)) s), rc $rc"
exit $rc
EOF
du -sh "$DEST" "$DEST"/*
