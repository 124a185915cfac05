#!/usr/bin/env bash
# gpu_kveval.sh — the issue-7 acceptance table on a GPU: kveval over the full
# WikiText-2 test split (kvquant protocol, ctx 2048) with every scheme of the
# table, nuq tables from real kvcalib artifacts (docs/RESULTS.md).
#
#   scripts/gpu_kveval.sh MODEL TEXT ARTDIR OUTDIR
#     MODEL   the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf); never downloaded here
#     TEXT    wiki.test.raw (../shared/datasets/wikitext-2-raw/wiki.test.raw)
#     ARTDIR  kvcalib artifacts nuq{4,3,2}.safetensors and nuq{4,3,2}-1pct.safetensors
#     OUTDIR  results: acceptance.md / .json (exact fp32 mode), tf32.md / .json (fp32 in fast mode)
# Environment:
#   KVQ_KVEVAL=path   a prebuilt kveval (machines without the build dependencies: build
#                     elsewhere with `make`, carry it with its shared libraries and set
#                     LD_LIBRARY_PATH); default bin/kveval
#   KVQ_DEVICE=dev    --device (default cuda)
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$1 TEXT=$2 ART=$3 OUT=$4
KVEVAL=${KVQ_KVEVAL:-bin/kveval}
DEV=${KVQ_DEVICE:-cuda}
mkdir -p "$OUT"
for b in 4 3 2; do
    for f in "$ART/nuq$b.safetensors" "$ART/nuq$b-1pct.safetensors"; do
        [ -r "$f" ] || { echo "gpu_kveval: missing artifact $f (kvcalib DUMP --method nuq --bits $b ...)" >&2; exit 2; }
    done
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
arts=()
for b in 4 3 2; do arts+=(--artifact "$ART/nuq$b.safetensors" --artifact "$ART/nuq$b-1pct.safetensors"); done
schemes=()
for s in fp16 int4+sink1 int3+sink1 int2+sink1 kivi4 kivi2 nuq4 nuq4-1% nuq3 nuq3-1% nuq2 nuq2-1%; do schemes+=(--scheme "$s"); done
"$KVEVAL" --device "$DEV" --model "$MODEL" --text "$TEXT" --ctx 2048 "${arts[@]}" "${schemes[@]}" \
    --json "$OUT/acceptance.json" >"$OUT/acceptance.md" 2>"$OUT/acceptance.err" ||
    { cat "$OUT/acceptance.err" >&2; exit 1; }
cat "$OUT/acceptance.md"
"$KVEVAL" --device "$DEV" --fast --model "$MODEL" --text "$TEXT" --ctx 2048 --scheme fp32 --json "$OUT/tf32.json" \
    >"$OUT/tf32.md" 2>"$OUT/tf32.err" || { cat "$OUT/tf32.err" >&2; exit 1; }
cat "$OUT/tf32.md"
