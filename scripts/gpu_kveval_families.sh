#!/usr/bin/env bash
# gpu_kveval_families.sh — the method-family tables of issues 43–45 on a GPU: one calibration dump
# of the default model (KVQuant's set: 16 x 2048 tokens of wiki.valid.tokens, Fisher information,
# queries), every family's kvcalib artifact from it, then kveval over the whole WikiText-2 test split
# at ctx 2048 (kvquant protocol) with PPL, ΔPPL ± SE and the KL-divergence columns.
#
#   scripts/gpu_kveval_families.sh STEP MODEL CALIB TEXT WORK
#     STEP   calib   kvdump (GPU) + every kvcalib artifact into WORK/art (list below), with timings
#            eval    kveval of the transform families (in place / with boundaries) over the whole split
#            sched   kveval of the attention-driven schedule families (hh, mikv, zipcache): their
#                    attention runs on the host for every layer (host sched path), so they take the
#                    first KVQ_SCHED_WINDOWS windows (default 24) of the split, with the baselines
#                    again on the same windows
#     MODEL  models/SmolLM2-135M-Instruct.Q4_1.gguf
#     CALIB  ../shared/datasets/wikitext-2/wiki.valid.tokens (the calibration text)
#     TEXT   ../shared/datasets/wikitext-2-raw/wiki.test.raw (the evaluation text)
#     WORK   dump, artifacts (WORK/art) and outputs (WORK/<step>.md/.json/.err, WORK/calib.log)
# Environment: KVQ_BIN (folder with kvdump, kvcalib, kveval; default bin), KVQ_DEVICE (cuda).
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
STEP=$1 MODEL=$2 CALIB=$3 TEXT=$4 WORK=$5
BIN=${KVQ_BIN:-bin}
DEV=${KVQ_DEVICE:-cuda}
ART=$WORK/art
mkdir -p "$ART"
t() { local s0 s1; s0=$(date +%s.%N); "$@"; s1=$(date +%s.%N); printf '%8.1f s  %s\n' "$(echo "$s1 - $s0" | bc)" "${*:1:6}" >>"$WORK/calib.log"; }

# artifacts: name | kvcalib arguments
ARTS=(
    "nuq4-1pct|--method nuq --bits 4 --outliers 0.01"
    "nuq3-1pct|--method nuq --bits 3 --outliers 0.01"
    "nuq2-1pct|--method nuq --bits 2 --outliers 0.01"
    "nuq4-1pct-had|--method nuq --bits 4 --outliers 0.01 --rotate hadamard"
    "nuq3-1pct-had|--method nuq --bits 3 --outliers 0.01 --rotate hadamard"
    "nvfp4|--method nvfp4"
    "mikv|--method mikv --bits 2"
    "skvq2|--method skvq --bits 2 --group 32"
    "skvq3|--method skvq --bits 3 --group 32"
    "skvq4|--method skvq --bits 4 --group 32"
    "wkvq2|--method wkvq --bits 2"
    "wkvq3|--method wkvq --bits 3"
    "wkvq4|--method wkvq --bits 4"
    "cq-c2b8|--method cq --group 2 --bits 8"
    "cq-c4b8|--method cq --group 4 --bits 8"
    "cq-c8b8|--method cq --group 8 --bits 8"
)
# transform families, the whole split (the artifacts above bind by method and bits)
EVAL=(fp16 int4+sink1 int2+sink1 kivi4 kivi2 nuq4-1% nuq3-1% nuq2-1% nuq4-1%+hadamard nuq3-1%+hadamard
      fp8 q8_0 q4_0 q4_0+hadamard q4_0+rht int4+hadamard int3+hadamard kivi2+hadamard
      int8-pth fp8-pth int4-pth turboquant-k8v4 turboquant-4bit-nc turboquant-k3v4-nc turboquant-3bit-nc
      nvfp4 nvfp4-tensor mxfp4 fp4_mx_block16
      skvq2-w32 skvq3-w32 skvq4-w32 skvq2-w128 wkvq2 wkvq3 wkvq4 cq-c2b8 cq-c4b8 cq-c8b8)
SCHED=(kivi2 nuq2-1% nuq3-1% nuq4-1% hh3-20%-w32 hh4-20%-w32
       mikv-h8-l2-b20%-w32 mikv-h8-l3-b20%-w32 mikv-h8-l4-b20%-w32 mikv-h4-l2-b20%-w32 mikv-h8-l2-b20%-w32-nobal
       zipcache-h4-l2-b40% zipcache-h4-l3-b40% zipcache-h8-l4-b40%)

arts=()
for a in "${ARTS[@]}"; do arts+=(--artifact "$ART/${a%%|*}.safetensors"); done
schemes() { local s out=(); for s in "$@"; do out+=(--scheme "$s"); done; printf '%s\n' "${out[@]}"; }

case "$STEP" in
calib)
    : >"$WORK/calib.log"
    t "$BIN/kvdump" --model "$MODEL" --text "$CALIB" --samples 16 --seq-len 2048 --fisher --q --device "$DEV" --force \
        --quiet -o "$WORK/dump.h5"
    for a in "${ARTS[@]}"; do
        # shellcheck disable=SC2086
        t "$BIN/kvcalib" "$WORK/dump.h5" ${a#*|} --force --quiet -o "$ART/${a%%|*}.safetensors"
    done
    cat "$WORK/calib.log" ;;
eval|sched)
    if [ "$STEP" = eval ]; then list=("${EVAL[@]}") win=(); else list=("${SCHED[@]}") win=(--max-windows "${KVQ_SCHED_WINDOWS:-24}"); fi
    mapfile -t sc < <(schemes "${list[@]}")
    "$BIN/kveval" --device "$DEV" --model "$MODEL" --text "$TEXT" --ctx 2048 "${win[@]}" "${arts[@]}" "${sc[@]}" \
        --json "$WORK/$STEP.json" >"$WORK/$STEP.md" 2>"$WORK/$STEP.err" || { tail -20 "$WORK/$STEP.err" >&2; exit 1; }
    cat "$WORK/$STEP.md" ;;
*) echo "gpu_kveval_families: unknown step $STEP (calib, eval, sched)" >&2; exit 2 ;;
esac
