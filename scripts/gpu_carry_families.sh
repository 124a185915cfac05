#!/usr/bin/env bash
# gpu_carry_families.sh — package scripts/gpu_kveval_families.sh (the method-family tables of issues
# 43–45) for a GPU machine without our build dependencies that receives at most ~60 MiB per transfer.
#
#   scripts/gpu_carry_families.sh DEST MODEL CALIB TEXT [ARTDIR]
#     DEST   output folder (emptied): DEST/p1, DEST/p2 (the model in two halves: with the repository's
#            ~13 MB tree a transfer holds ~50 MB) and DEST/p3 (kvdump / kvcalib / kveval / gpu_check as
#            bins.tar.xz, libs.tar.xz (scripts/gpu_carry_bins.sh), the two texts, the scripts, run.sh: ~38 MB)
#     MODEL  models/SmolLM2-135M-Instruct.Q4_1.gguf (checked against scripts/models.sha256 there)
#     CALIB  ../shared/datasets/wikitext-2/wiki.valid.tokens
#     TEXT   ../shared/datasets/wikitext-2-raw/wiki.test.raw
#     ARTDIR artifacts made by an earlier calib step (its WORK/art): DEST/art holds them as one more
#            transfer; copy it to STASH/art and run the eval step with KVQ_ART=STASH/art
# On the GPU machine: copy p1/model.part.* and p2/model.part.* into STASH (first and second call),
# then with p3 in place (third call, each within the machine's idle window after the previous one)
#     bash p3/run.sh STASH WORK [STEPS]
# reassembles the model, unpacks the libraries, starts gpu_check --synthetic (CPU vs GPU for every
# family's GPU path, WORK/synthetic.txt; KVQ_NO_CHECK=1 skips it) and runs gpu_kveval_families.sh for each of STEPS (default
# "calib eval"; see that script) beside it, with KVQ_BIN pointing at the carried binaries.
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
DEST=$(realpath -m "$1") MODEL=$(realpath "$2") CALIB=$(realpath "$3") TEXT=$(realpath "$4") ARTDIR=${5:-}
cd "$(dirname "$0")/.."
make -j"$(nproc)" CUDA=1 all gpu-tests >/dev/null || { echo "gpu_carry_families: the CUDA build failed (make CUDA=1 all gpu-tests)" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST/p1" "$DEST/p2" "$DEST/p3/bin"
half=$((($(stat -c %s "$MODEL") + 1) / 2))
head -c "$half" "$MODEL" >"$DEST/p1/model.part.a"
tail -c "+$((half + 1))" "$MODEL" >"$DEST/p2/model.part.b"
bash scripts/gpu_carry_bins.sh "$DEST/p3/bin" kvdump kvcalib kveval gpu_check
# the binaries (~80 MB with their CUDA kernels) as one xz archive (~25 MB), so p3 fits a transfer; run.sh unpacks it
tar -C "$DEST/p3/bin" -cf - kvdump kvcalib kveval gpu_check | xz -T2 -6 >"$DEST/p3/bin/bins.tar.xz"
rm -f "$DEST/p3/bin/kvdump" "$DEST/p3/bin/kvcalib" "$DEST/p3/bin/kveval" "$DEST/p3/bin/gpu_check"
cp scripts/gpu_kveval_families.sh "$DEST/p3/"
cp "$CALIB" "$DEST/p3/calib.tokens"
cp "$TEXT" "$DEST/p3/text.raw"
if [ -n "$ARTDIR" ]; then mkdir -p "$DEST/art" && cp "$ARTDIR"/*.safetensors "$DEST/art/"; fi
sum=$(awk -v f="$(basename "$MODEL")" '$2 == f {print $1}' scripts/models.sha256)
cat >"$DEST/p3/run.sh" <<EOF
#!/usr/bin/env bash
# run.sh STASH WORK [STEPS] — written by scripts/gpu_carry_families.sh
set -euo pipefail
HERE=\$(cd "\$(dirname "\$0")" && pwd)
STASH=\$1 WORK=\$2
mkdir -p "\$WORK" /tmp/kvq_model
cat "\$STASH"/model.part.a "\$STASH"/model.part.b >/tmp/kvq_model/model.gguf
sha256sum /tmp/kvq_model/model.gguf | tee "\$WORK/sha256.txt"
[ -z "$sum" ] || grep -q "$sum" "\$WORK/sha256.txt" || { echo "run.sh: model sha256 differs from $sum" >&2; exit 1; }
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "\$HERE/bin/libs.tar.xz" "\$HERE/bin"
[ -x "\$HERE/bin/kveval" ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "\$HERE/bin/bins.tar.xz" "\$HERE/bin"
export LD_LIBRARY_PATH=\$HERE/bin/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
chmod +x "\$HERE"/bin/*
if ldd "\$HERE/bin/kveval" | grep 'libcublas.*not found' >/dev/null; then
    c=\$(find /usr /opt -name 'libcublas.so.*' 2>/dev/null | head -1 || true)
    [ -n "\$c" ] && export LD_LIBRARY_PATH=\$LD_LIBRARY_PATH:\$(dirname "\$c")
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "\$WORK/gpu.txt" || true
rc=0
# the CPU-vs-GPU check of every family's GPU path (gpu_check --synthetic) beside the calibration
if [ -z "\${KVQ_NO_CHECK:-}" ]; then
    "\$HERE/bin/gpu_check" --synthetic >"\$WORK/synthetic.txt" 2>&1 &
    chk=\$!
else
    echo "gpu_check skipped (KVQ_NO_CHECK)" >"\$WORK/synthetic.txt"
    chk=
fi
for step in \${3:-calib eval}; do
    echo "== run.sh: \$step"
    KVQ_BIN=\$HERE/bin bash "\$HERE/gpu_kveval_families.sh" "\$step" /tmp/kvq_model/model.gguf "\$HERE/calib.tokens" \\
        "\$HERE/text.raw" "\$WORK" || rc=1
done
[ -z "\$chk" ] || wait "\$chk" || { rc=1; grep -E 'FAIL' "\$WORK/synthetic.txt" | head -20; }
tail -1 "\$WORK/synthetic.txt"
exit \$rc
EOF
du -sh "$DEST"/p*
