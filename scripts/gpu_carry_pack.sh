#!/usr/bin/env bash
# gpu_carry_pack.sh — package GPU runs for a machine that has the CUDA driver
# and cuBLAS but not our build dependencies (hdf5, cjson, openblas, ...) and
# that receives at most LIMIT MiB per transfer (the device tool: 64 MiB
# including the repository's own tree).
#
#   scripts/gpu_carry_pack.sh DEST MODEL TEXT ARTDIR [PART_MIB]
#     DEST     output folder (emptied): DEST/p1 .. DEST/pN, one per transfer
#     MODEL    the model file (split into PART_MIB-MiB pieces, default 38)
#     TEXT     the evaluation text (wiki.test.raw)
#     ARTDIR   kvcalib artifacts (every *.safetensors in it is carried): gpu_kveval.sh needs
#              nuq{4,3,2}.safetensors, nuq{4,3,2}-1pct.safetensors; gpu_kveval_fidelity.sh also
#              fp8-tensor, fp8-head, e5m2-head
# DEST/pN (the last transfer) also holds kveval and kvdump (linked --as-needed
# from this build's build/libkvq.a), gpu_check and test_kvcache_cuda when built
# (make gpu-tests), libs.tar.xz (scripts/gpu_carry_bins.sh: every shared library
# they need except glibc, libstdc++, libgcc_s and cuBLAS), the text, the
# artifacts, the run scripts and run.sh. On the GPU machine: copy p1 .. p(N-1)
# into STASH as they arrive, then with pN in place run
#     bash pN/run.sh STASH OUTDIR [STEPS]
# which reassembles the model, checks its sha256 against scripts/models.sha256,
# unpacks the libraries and runs STEPS (default "kveval"): "kveval" is
# scripts/gpu_kveval.sh; "checks" gpu_check --synthetic, test_kvcache_cuda and
# gpu_check --families tests/fixtures (run from a checkout); "fidelity"
# scripts/gpu_kveval_fidelity.sh (issue 41's tables and passkey).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
DEST=$(realpath -m "$1") MODEL=$(realpath "$2") TEXT=$(realpath "$3") ART=$(realpath "$4") PART=${5:-38}
cd "$(dirname "$0")/.."
# the objects must match the library: a kveval.o older than a header it includes reads the library's
# structures with the old layout (a heap corrupted on the GPU machine, nowhere else)
make -j"$(nproc)" CUDA=1 all gpu-tests >/dev/null || { echo "gpu_carry_pack: the CUDA build failed (make CUDA=1 all gpu-tests)" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST/tmp"
T=$DEST/tmp
bash scripts/gpu_carry_bins.sh "$T" kveval kvdump gpu_check test_kvcache_cuda
bins=()
for g in kveval kvdump gpu_check test_kvcache_cuda; do [ -x "$T/$g" ] && bins+=("$T/$g"); done
(cd "$T" && split -b "${PART}M" "$MODEL" model.part.)
parts=("$T"/model.part.*)
n=${#parts[@]}
for i in $(seq 1 "$n"); do mkdir -p "$DEST/p$i"; mv "${parts[$((i - 1))]}" "$DEST/p$i/"; done
L=$DEST/p$n
mkdir -p "$L/art"
cp "${bins[@]}" "$T/libs.tar.xz" "$L/"
cp "$TEXT" "$L/text.raw"
cp "$ART"/*.safetensors "$L/art/"
cp scripts/gpu_kveval.sh scripts/gpu_kveval_fidelity.sh "$L/"
sum=$(awk -v f="$(basename "$MODEL")" '$2 == f {print $1}' scripts/models.sha256)
cat >"$L/run.sh" <<EOF
#!/usr/bin/env bash
# run.sh STASH OUTDIR — written by scripts/gpu_carry_pack.sh
set -euo pipefail
HERE=\$(cd "\$(dirname "\$0")" && pwd)
STASH=\$1 OUT=\$2
mkdir -p "\$OUT" /tmp/kvq_model /tmp/kvq_libs
cat "\$STASH"/model.part.* "\$HERE"/model.part.* >/tmp/kvq_model/model.gguf
sha256sum /tmp/kvq_model/model.gguf | tee "\$OUT/sha256.txt"
[ -z "$sum" ] || grep -q "$sum" "\$OUT/sha256.txt" || { echo "run.sh: model sha256 differs from $sum" >&2; exit 1; }
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "\$HERE/libs.tar.xz" /tmp/kvq_libs
export LD_LIBRARY_PATH=/tmp/kvq_libs/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
chmod +x "\$HERE/kveval"
if ldd "\$HERE/kveval" | grep 'libcublas.so.13 => not found' >/dev/null; then
    c=\$(find /usr /opt -name libcublas.so.13 2>/dev/null | head -1 || true)
    [ -n "\$c" ] && export LD_LIBRARY_PATH=\$LD_LIBRARY_PATH:\$(dirname "\$c")
fi
if ldd "\$HERE/kveval" | grep 'not found'; then echo "run.sh: libraries missing" >&2; exit 1; fi
chmod +x "\$HERE"/kvdump "\$HERE"/gpu_check "\$HERE"/test_kvcache_cuda 2>/dev/null || true
rc=0
for step in \${3:-kveval}; do
    echo "== run.sh: \$step"
    case "\$step" in
    kveval) KVQ_KVEVAL=\$HERE/kveval bash "\$HERE/gpu_kveval.sh" /tmp/kvq_model/model.gguf "\$HERE/text.raw" "\$HERE/art" "\$OUT" || rc=1 ;;
    checks)
        "\$HERE/gpu_check" --synthetic >"\$OUT/synthetic.txt" 2>&1 || rc=1; tail -3 "\$OUT/synthetic.txt"
        "\$HERE/test_kvcache_cuda" >"\$OUT/test_kvcache_cuda.txt" 2>&1 || rc=1; tail -3 "\$OUT/test_kvcache_cuda.txt"
        "\$HERE/gpu_check" --families tests/fixtures >"\$OUT/families.txt" 2>&1 || rc=1; tail -3 "\$OUT/families.txt" ;;
    fidelity) KVQ_KVEVAL=\$HERE/kveval KVQ_GPU_CHECK=/nonexistent bash "\$HERE/gpu_kveval_fidelity.sh" /tmp/kvq_model/model.gguf \
                  "\$HERE/text.raw" "\$HERE/art" "\$OUT" || rc=1 ;;
    *) echo "run.sh: unknown step \$step" >&2; rc=2 ;;
    esac
done
exit \$rc
EOF
rm -rf "$T"
du -sh "$DEST"/p*
