#!/usr/bin/env bash
# gpu_carry_decode.sh — package issue 46's GPU checks of real decoding for a GPU machine without our build
# dependencies, in three folders that each fit one device call's 64 MiB carry beside the ~13 MB tree (the default
# model, 98 MB, does not fit one):
#
#   scripts/gpu_carry_decode.sh DEST
#     DEST/p1/    the model's first 46 MB and stash.sh           (call 1: bash DEST/p1/stash.sh)
#     DEST/p2/    the rest of the model and stash.sh             (call 2: bash DEST/p2/stash.sh)
#     DEST/run/   binaries (scripts/gpu_carry_bins.sh: gpu_check, test_kvcache_cuda, bench_kvcache_cuda; xz),
#                 the tiny llama2.c models, the default model's nuq3-1% artifact (kvdump 4 x 512 --fisher
#                 --attn-stats of WikiText-2 validation, kvcalib nuq 3 bits 1% sink 1, as make demo), the first
#                 200 KB of WikiText-2 test, run.sh                (call 3: bash DEST/run/run.sh OUTDIR)
# The stash lives in /tmp/kvq_stash on the GPU machine, which keeps files ~30 s after a call: make the three calls
# back to back. run.sh (each step with its own time limit, logs in OUTDIR, a line per step on stdout):
#   1. test_kvcache_cuda (the CUDA cache against the CPU reference, every format)
#   2. gpu_check --decode on the tiny models (GPU decoding against the CPU decoder)
#   3. gpu_check --decode on the default model, nuq3-1%, 3 prompts x 64 tokens, 256 steps (issue 46's acceptance:
#      the tokens equal the decode-equivalent simulation's, or the first differing step within tolerance);
#      skipped with a note when the stash is incomplete (sha256 against scripts/models.sha256)
#   4. scripts/gpu_nuq_kernel.sh, one round (nuq3: v4 against v5)
# Run after `make CUDA=1 all gpu-tests` (the binaries must match the library). ../shared or KVQ_SHARED gives
# WikiText-2 and the tiny models.
set -euo pipefail
case "${1:-}" in
-h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
"") echo "usage: scripts/gpu_carry_decode.sh DEST (see --help)" >&2; exit 2 ;;
-?*) echo "gpu_carry_decode: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
DEST=$(realpath -m "$1")
cd "$(dirname "$0")/.."
SHARED=${KVQ_SHARED:-../shared}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
VALID=$SHARED/datasets/wikitext-2/wiki.valid.tokens
TEST=$SHARED/datasets/wikitext-2-raw/wiki.test.raw
for f in "$MODEL" "$VALID" "$TEST" "$SHARED/models/llama2c/stories260K.bin" bin/kvdump bin/kvcalib build/gpu/gpu_check \
         build/gpu/test_kvcache_cuda build/gpu/bench_kvcache_cuda; do
    [ -e "$f" ] || { echo "gpu_carry_decode: $f is missing (make CUDA=1 all gpu-tests; scripts/fetch_model.sh; ../shared)" >&2; exit 3; }
done
rm -rf "$DEST"
mkdir -p "$DEST/p1" "$DEST/p2" "$DEST/run/shared/models" "$DEST/run/art"
split -b 46000000 -d "$MODEL" "$DEST/p1/model.part"
mv "$DEST/p1/model.part01" "$DEST/p2/"
[ ! -e "$DEST/p1/model.part02" ] || mv "$DEST/p1/model.part02" "$DEST/p2/"
for p in p1 p2; do
    cat >"$DEST/$p/stash.sh" <<'EOF'
#!/usr/bin/env bash
# a part of the default model into /tmp/kvq_stash (gpu_carry_decode.sh)
set -eu
mkdir -p /tmp/kvq_stash
cp "$(dirname "$0")"/model.part* /tmp/kvq_stash/
ls -l /tmp/kvq_stash
EOF
done
bash scripts/gpu_carry_bins.sh "$DEST/run/bin" gpu_check test_kvcache_cuda bench_kvcache_cuda
xz -T0 -6 "$DEST/run/bin/gpu_check" "$DEST/run/bin/test_kvcache_cuda" "$DEST/run/bin/bench_kvcache_cuda"
cp -r "$SHARED/models/llama2c" "$DEST/run/shared/models/"
head -c 200000 "$TEST" >"$DEST/run/art/wiki.test.head.raw"
grep "$(basename "$MODEL")" scripts/models.sha256 >"$DEST/run/art/model.sha256"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin/kvdump -m "$MODEL" -t "$VALID" -n 4 -L 512 --fisher --attn-stats -o "$tmp/dump.h5" -q
bin/kvcalib "$tmp/dump.h5" --method nuq --bits 3 --outliers 0.01 --sink 1 -o "$DEST/run/art/nuq3-1pct.safetensors" -q
cp scripts/gpu_nuq_kernel.sh "$DEST/run/"
cat >"$DEST/run/run.sh" <<'EOF'
#!/usr/bin/env bash
# issue 46's GPU checks of real decoding (gpu_carry_decode.sh): bash run.sh OUTDIR
set -u
R=$(cd "$(dirname "$0")" && pwd)
O=${1:-${OUT:-/tmp/kvq_out}}
mkdir -p "$O"
W=/tmp/kvq_run
mkdir -p "$W"
for b in gpu_check test_kvcache_cuda bench_kvcache_cuda; do (xz -dc "$R/bin/$b.xz" >"$W/$b" && chmod +x "$W/$b") & done
tar -xJf "$R/bin/libs.tar.xz" -C "$W" & wait
export LD_LIBRARY_PATH=$W/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$O/gpu.txt" 2>&1
cat "$O/gpu.txt"
step() { # step NAME SECONDS CMD...: its log in $O/NAME.log, one line here
    local name=$1 lim=$2 t0=$SECONDS
    shift 2
    timeout "$lim" "$@" >"$O/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    grep -m 10 -i "fail" "$O/$name.log"
    tail -3 "$O/$name.log"
}
step test_kvcache_cuda 90 "$W/test_kvcache_cuda"
KVQ_SHARED=$R/shared step decode_tiny 90 "$W/gpu_check" --decode
M=/tmp/kvq_stash/SmolLM2-135M-Instruct.Q4_1.gguf
[ -e "$M" ] || cat /tmp/kvq_stash/model.part* >"$M" 2>/dev/null
if (cd /tmp/kvq_stash && sha256sum -c "$R/art/model.sha256" >/dev/null 2>&1); then
    step decode_smollm2 300 "$W/gpu_check" --decode --model "$M" --artifact "$R/art/nuq3-1pct.safetensors" --scheme 'nuq3-1%' \
        --text "$R/art/wiki.test.head.raw" --steps 256 --prompt-len 64 --prompts 3
else
    echo "== decode_smollm2: skipped: /tmp/kvq_stash lacks the model (the calls of p1/stash.sh and p2/stash.sh before this one)"
fi
KVQ_NO_TEST=1 KVQ_ROUNDS=1 KVQ_PREBUILT=$W step nuq_kernel 150 bash "$R/gpu_nuq_kernel.sh" "$W/nk"
cp "$W/nk/summary.txt" "$O/nuq_kernel_summary.txt" 2>/dev/null
cat "$O/nuq_kernel_summary.txt" 2>/dev/null
EOF
du -sh "$DEST"/*
echo "gpu_carry_decode: three calls, back to back: carry [\"${DEST#"$PWD"/}/p1\"] bash .../p1/stash.sh; the same with p2;" \
     "then carry [\"${DEST#"$PWD"/}/run\"] bash .../run/run.sh \$OUT (DEST must be a git-ignored folder of the checkout)"
