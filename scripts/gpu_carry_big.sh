#!/usr/bin/env bash
# gpu_carry_big.sh — package step 3 of scripts/gpu_families_check.sh (kvdump and kveval of a random
# Llama-3-8B-shaped model, generated on the GPU machine) for a machine without our build
# dependencies. No model travels: about 9 MB in all.
#
#   scripts/gpu_carry_big.sh DEST TEXT
#     DEST  output folder (emptied): bin/ (kvdump, kveval, libs.tar.xz: scripts/gpu_carry_bins.sh),
#           scripts/gpu_families_check.sh and gpu_gemm_shapes.py, tests/scripts/random_llama_model.py,
#           text.raw, run.sh
#     TEXT  the calibration and evaluation text (wiki.test.raw)
# On the GPU machine (python3 with numpy; nvidia-smi):
#     bash DEST/run.sh OUTDIR
# unpacks the libraries and runs gpu_families_check.sh's step 3 with KVQ_PREBUILT=DEST/bin; its
# environment (KVQ_BIG_RUNS, KVQ_BIG_WINDOWS, KVQ_BIG_DIR, KVQ_DEADLINE) passes through.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
DEST=$(realpath -m "$1") TEXT=$(realpath "$2")
cd "$(dirname "$0")/.."
make -j"$(nproc)" CUDA=1 all >/dev/null || { echo "gpu_carry_big: the CUDA build failed (make CUDA=1 all)" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST/scripts" "$DEST/tests/scripts"
bash scripts/gpu_carry_bins.sh "$DEST/bin" kvdump kveval
cp scripts/gpu_families_check.sh scripts/gpu_gemm_shapes.py "$DEST/scripts/"
cp tests/scripts/random_llama_model.py "$DEST/tests/scripts/"
cp "$TEXT" "$DEST/text.raw"
cat >"$DEST/run.sh" <<'EOF'
#!/usr/bin/env bash
# run.sh OUTDIR — written by scripts/gpu_carry_big.sh: gpu_families_check.sh step 3 with these binaries
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$HERE/bin/libs.tar.xz" "$HERE/bin"
KVQ_STEPS=3 KVQ_PREBUILT="$HERE/bin" exec bash "$HERE/scripts/gpu_families_check.sh" "$1" "$HERE/text.raw"
EOF
du -sh "$DEST"
