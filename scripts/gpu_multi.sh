#!/usr/bin/env bash
# gpu_multi.sh — the measurements of issue 47 (docs/MULTIGPU.md) on a machine with several GPUs (a
# multi-GPU kind: nvidia-h100-x2/x4/x8 or nvidia-h200-x*). Not run in CI; nothing here has been run yet.
#
#   scripts/gpu_multi.sh OUTDIR TEXT
#     OUTDIR  results: one log per run, gpu.txt, gpu_mem.txt (every GPU's memory every 0.5 s), summary.txt
#     TEXT    calibration/evaluation text (e.g. wiki.test.raw)
#
# Runs (each prints its wall time and the peak memory of every GPU it used):
#   1. a Llama-2-7B-shaped random model (tests/scripts/random_llama_model.py --shape llama2-7b, bf16
#      on disk): kveval (fp32 scheme, ctx 2048, $KVQ_WINDOWS windows, --math bf16) and kvdump 16 x 2048
#      (forward: K/V, --attn-stats) on 1, 2 and 4 GPUs (--device cuda:0 / --devices cuda:0,1 /
#      --devices cuda:0,1,2,3, as many as the machine has); kvdump --fisher on 1 and 2 GPUs, and
#      the two Fisher dumps compared (tests/scripts/check_dump_h5py.py-style: max relative difference);
#   2. a Llama-2-70B-shaped random model (--shape llama2-70b, 138 GB in bf16; needs >= 2 H100s for the
#      forward in bf16, 4 with --fisher): kvdump 16 x 2048 --fisher and without, kveval on
#      $KVQ_WINDOWS windows, over every GPU (--devices all), --math bf16;
#   then the pipeline's efficiency: the single-GPU time per layer (7B on one GPU: seconds / 32) times
#   the layers, against the pipelined time (summary.txt).
# Environment: KVQ_PREBUILT=DIR (kvdump, kveval built elsewhere), KVQ_WINDOWS (default 4), KVQ_MULTI_DIR
# (where the random models go, default /tmp), KVQ_STEPS (default "1 2").
# NCCL's environment stays the machine's (NVLink multicast off: NCCL_NVLS_ENABLE=0 where the lender sets it).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
OUT=$(realpath -m "$1") TEXT=$(realpath "$2")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [ -n "${KVQ_PREBUILT:-}" ]; then
    KVDUMP=$KVQ_PREBUILT/kvdump KVEVAL=$KVQ_PREBUILT/kveval
else
    make -j"$(nproc)" CUDA=1 all >/dev/null
    make config | tee "$OUT/build.txt"
    KVDUMP=bin/kvdump KVEVAL=bin/kveval
fi
NG=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m >>"$OUT/gpu.txt" 2>&1 || true
env | grep '^NCCL_' | tee -a "$OUT/gpu.txt" || true
WIN=${KVQ_WINDOWS:-4}
DIR=${KVQ_MULTI_DIR:-/tmp}
STEPS=" ${KVQ_STEPS:-1 2} "
MEMLOG=$OUT/gpu_mem.txt
(while :; do echo "$(date +%s.%N) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | tr '\n' ' ')"; sleep 0.5; done) \
    >"$MEMLOG" 2>/dev/null &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", b - a}'; }
# the peak MiB of every GPU between two times: "cuda:0 12345 MiB, cuda:1 ..."
peaks() {
    awk -v a="$1" -v b="$2" '$1 >= a && $1 <= b + 0.6 {for (i = 2; i <= NF; i++) if ($i + 0 > m[i]) m[i] = $i + 0; n = NF}
        END {for (i = 2; i <= n; i++) printf "%scuda:%d %d MiB", (i > 2 ? ", " : ""), i - 2, m[i]}' "$MEMLOG"
}
SUM=$OUT/summary.txt
: >"$SUM"
# run NAME CMD...: wall time and per-GPU peaks into summary.txt
run() {
    local name=$1 s0 s1 rc=0
    shift
    s0=$(now)
    "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" || rc=$?
    s1=$(now)
    echo "$name: rc $rc, wall $(secs "$s0" "$s1") s, peak $(peaks "$s0" "$s1")" | tee -a "$SUM"
    grep -E '^kvdump: (device|stage|wrote)|pipeline|^- device' "$OUT/$name.log" "$OUT/$name.out" 2>/dev/null | head -8 || true
    [ $rc = 0 ] || tail -3 "$OUT/$name.log"
}
devs() { # the first N GPUs as a --devices list, or --device cuda:0 for one
    if [ "$1" = 1 ]; then echo "--device cuda:0"; else echo "--devices $(seq -s, 0 $(($1 - 1)) | sed 's/^/cuda:/')"; fi
}
model() { # shape dir
    if [ ! -r "$2/config.json" ]; then
        local s0
        s0=$(now)
        python3 tests/scripts/random_llama_model.py --shape "$1" --out "$2" --jobs "$(nproc)" | tail -1
        echo "$1 written in $(secs "$s0" "$(now)") s" | tee -a "$SUM"
    fi
}
if [[ "$STEPS" == *" 1 "* ]]; then
    M7=$DIR/kvq-llama2-7b
    model llama2-7b "$M7"
    for n in 1 2 4; do
        [ "$n" -le "$NG" ] || continue
        # shellcheck disable=SC2046
        run "7b_kveval_${n}gpu" "$KVEVAL" --model "$M7" --text "$TEXT" --format raw --ctx 2048 --max-windows "$WIN" --scheme fp32 \
            --math bf16 $(devs $n) --json "$OUT/7b_kveval_${n}gpu.json"
        # shellcheck disable=SC2046
        run "7b_kvdump_${n}gpu" "$KVDUMP" --model "$M7" --text "$TEXT" --format raw -n 16 -L 2048 --attn-stats --math bf16 \
            $(devs $n) --force -o "$OUT/dump7b_${n}.h5"
    done
    run 7b_kvdump_fisher_1gpu "$KVDUMP" --model "$M7" --text "$TEXT" --format raw -n 16 -L 2048 --fisher --math bf16 \
        --device cuda:0 --force -o "$OUT/dump7b_fisher.h5"
    if [ "$NG" -ge 2 ]; then
        run 7b_kvdump_fisher_2gpu "$KVDUMP" --model "$M7" --text "$TEXT" --format raw -n 16 -L 2048 --fisher \
            --math bf16 --devices cuda:0,1 --force -o "$OUT/dump7b_fisher2.h5"
        # one GPU and two run the same kernels in the same order per layer: the dumps should agree bit for bit
        python3 - "$OUT/dump7b_fisher.h5" "$OUT/dump7b_fisher2.h5" <<'PY' | tee -a "$SUM" || true
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
worst, n = 0.0, 0
def visit(name, obj):
    global worst, n
    if isinstance(obj, h5py.Dataset) and name in b:
        x, y = np.asarray(obj[()], dtype=np.float64), np.asarray(b[name][()], dtype=np.float64)
        d = np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-30) if x.size else 0.0
        worst, n = max(worst, d), n + 1
a.visititems(visit)
print(f"7B Fisher dump, 1 GPU vs 2 GPUs: {n} datasets, largest relative difference {worst:.3g}")
PY
    fi
    rm -f "$OUT"/dump7b_*.h5
fi
if [[ "$STEPS" == *" 2 "* ]] && [ "$NG" -ge 2 ]; then
    M70=$DIR/kvq-llama2-70b
    model llama2-70b "$M70"
    run 70b_kvdump_fisher "$KVDUMP" --model "$M70" --text "$TEXT" --format raw -n 16 -L 2048 --fisher --math bf16 --devices all \
        --force -o "$OUT/dump70b_fisher.h5"
    run 70b_kvdump "$KVDUMP" --model "$M70" --text "$TEXT" --format raw -n 16 -L 2048 --attn-stats --math bf16 --devices all \
        --force -o "$OUT/dump70b.h5"
    run 70b_kveval "$KVEVAL" --model "$M70" --text "$TEXT" --format raw --ctx 2048 --max-windows "$WIN" --scheme fp32 --math bf16 \
        --devices all --json "$OUT/70b_kveval.json"
    rm -f "$OUT"/dump70b*.h5
fi
# efficiency: the 7B's single-GPU time per layer x the run's layers, over (the pipelined time x its GPUs); 1 = perfect
# scaling (model load included in every time)
awk -v ng="$NG" '/^7b_kvdump_1gpu:/ {for (i = 1; i <= NF; i++) if ($i == "wall") t1 = $(i + 1)}
     /^(7b_kvdump_[24]gpu|70b_kvdump):/ {for (i = 1; i <= NF; i++) if ($i == "wall") t[$1] = $(i + 1)}
     END {if (t1) {printf "single-GPU time per layer (7B kvdump 16 x 2048): %.2f s\n", t1 / 32;
          for (k in t) {L = k ~ /70b/ ? 80 : 32; g = k ~ /70b/ ? ng : (k ~ /4gpu/ ? 4 : 2);
              printf "%s %.1f s on %d GPUs: efficiency %.2f (%.2f s per layer x %d layers / (%.1f s x %d))\n", k, t[k], g,
                  t1 / 32 * L / (t[k] * g), t1 / 32, L, t[k], g}}}' "$SUM" | tee -a "$SUM"
echo "gpu_multi: results in $OUT"
