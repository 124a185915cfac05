#!/usr/bin/env bash
# gpu_kveval_families.sh — the method-family tables of issues 43–45 (and 44's structural families) on a GPU: one calibration dump
# of the default model (KVQuant's set: 16 x 2048 tokens of wiki.valid.tokens, Fisher information,
# queries), every family's kvcalib artifact from it, then kveval over the whole WikiText-2 test split
# at ctx 2048 (kvquant protocol) with PPL, ΔPPL ± SE and the KL-divergence columns.
#
#   scripts/gpu_kveval_families.sh STEP MODEL CALIB TEXT WORK
#     STEP   calib   kvdump (GPU) + every kvcalib artifact into WORK/art (list below, 8 fits at a
#                    time), with timings in WORK/calib.log
#            eval    kveval in groups side by side on the one GPU (each group its own process with
#                    its own fp32 baseline pass, KVQ_GROUP_THREADS OpenMP threads (default 2; the schedule group KVQ_SCHED_THREADS, 6), killed after
#                    KVQ_EVAL_TIMEOUT s, default 400): by default five groups of transform families (in
#                    place or with per-query boundaries; the host-path ones transform on the CPU between
#                    GPU layers) over the whole split, and the attention-driven schedules (hh, mikv,
#                    zipcache, qaq: per-key schedules, their policy on the GPU where the device path takes
#                    the shape, else the host's attention for the layer) on the first KVQ_SCHED_WINDOWS
#                    windows (default 6) with baselines on the same windows; g6 (not in the default) the
#                    structural families' rows (low-rank heads, MiniCache). WORK/<group>.md/.json/.err
#     MODEL  models/SmolLM2-135M-Instruct.Q4_1.gguf
#     CALIB  ../shared/datasets/wikitext-2/wiki.valid.tokens (the calibration text)
#     TEXT   ../shared/datasets/wikitext-2-raw/wiki.test.raw (the evaluation text)
#     WORK   dump, artifacts (WORK/art) and outputs (WORK/<step>.md/.json/.err, WORK/calib.log)
# Environment: KVQ_BIN (folder with kvdump, kvcalib, kveval; default bin), KVQ_DEVICE (cuda), KVQ_ART
# (the artifacts' folder, default WORK/art: eval can use artifacts made elsewhere), KVQ_GROUPS (the eval
# groups, default "g1 g2 g3 g4 g5 sched"; g2a/g2b .. g6a/g6b are the halves of a host-path group, s:<spec> one
# scheme, m:<spec>,<spec>,... several schemes in one process, each group its own process, the s: and m: ones
# named s1, s2, ... in their order; KVQ_THREADS_<group> its OpenMP threads), KVQ_MAX_WINDOWS (the
# host-path groups g2..g6 on the first N windows; g1, the native baselines, always runs the whole split),
# and the above; for a smoke test on a small model: KVQ_SAMPLES, KVQ_SEQ_LEN (the dump, default
# 16 x 2048), KVQ_CTX (2048).
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
STEP=$1 MODEL=$2 CALIB=$3 TEXT=$4 WORK=$5
BIN=${KVQ_BIN:-bin}
DEV=${KVQ_DEVICE:-cuda}
ART=${KVQ_ART:-$WORK/art}
mkdir -p "$WORK" "$ART"
t() { local s0 s1; s0=$(date +%s.%N); "$@"; s1=$(date +%s.%N); awk -v a="$s0" -v b="$s1" -v c="${*:2:8}" 'BEGIN { printf "%8.1f s  %s\n", b - a, c }' >>"$WORK/calib.log"; }

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
    "wkvq|--method wkvq --bits 4"
    "cq-c4b4|--method cq --group 4 --bits 4"
    "cq-c4b6|--method cq --group 4 --bits 6"
    "cq-c8b8|--method cq --group 8 --bits 8"
    "cq-c4b8|--method cq --group 4 --bits 8"
    "cq-c2b8|--method cq --group 2 --bits 8"
    "qaq|--method qaq --bits 8"
    "lowrank-g1|--method lowrank --group 1"
    "minicache|--method minicache --bits 4"
)
# transform families over the whole split, in groups run side by side (each kveval process also runs
# its own fp32 baseline pass; the host-path families transform on the CPU cores between GPU layers)
G1=(fp16 int4+sink1 kivi2 kivi4 nuq4-1% nuq3-1% nuq2-1% fp8 q8_0 q4_0)
G2=(q4_0+hadamard q8_0+hadamard int4+hadamard int4-pth+hadamard nuq4-1%+hadamard nuq3-1%+hadamard int8-pth fp8-pth int4-pth)
G3=(turboquant-k8v4 turboquant-4bit-nc nvfp4 nvfp4-tensor turboquant-k3v4-nc turboquant-3bit-nc mxfp4 fp4_mx_block16)
G4=(wkvq4 wkvq3 wkvq2-g64 skvq2-w32 skvq3-w32 skvq4-w32 skvq2-w128)
G5=(cq-c4b4 cq-c4b6 cq-c8b8 cq-c4b8 cq-c2b8)
G6=(lowrank-g1-b2 lowrank-g1-b3 lowrank-g1-b4 minicache4-t0.6-g0.05-c64 minicache4-t0.6-g0.5-c64)
# attention-driven schedules (host attention for every layer): the first KVQ_SCHED_WINDOWS windows
SCHED=(kivi2 nuq2-1% nuq3-1% nuq4-1% hh4-20%-w32
       mikv-h8-l2-b20%-w32 mikv-h8-l3-b20%-w32 mikv-h4-l2-b20%-w32 mikv-h8-l2-b20%-w32-nobal
       zipcache-h4-l2-b10%-w32 zipcache-h3-l2-b20%-w64 zipcache-h4-l3-b20%-w64 qaq-k0.0003-v0.03 qaq-k0.001-v0.1)

arts=()
# eval: the artifacts present in ART (a run of a few groups carries only the ones it binds)
for a in "${ARTS[@]}"; do [ "$STEP" = calib ] || [ -f "$ART/${a%%|*}.safetensors" ] && arts+=(--artifact "$ART/${a%%|*}.safetensors"); done
schemes() { local s out=(); for s in "$@"; do out+=(--scheme "$s"); done; printf '%s\n' "${out[@]}"; }

run_group() { # name, window args..., --, schemes...
    local name=$1 win=() sc=()
    shift
    while [ "$1" != -- ]; do win+=("$1"); shift; done
    shift
    for x in "$@"; do sc+=(--scheme "$x"); done
    local tv="KVQ_THREADS_$name"
    OMP_NUM_THREADS=${!tv:-${THREADS:-${KVQ_GROUP_THREADS:-2}}} timeout "${KVQ_EVAL_TIMEOUT:-400}" "$BIN/kveval" --device "$DEV" --model "$MODEL" \
        --text "$TEXT" --ctx "${KVQ_CTX:-2048}" "${win[@]}" "${arts[@]}" "${sc[@]}" --quiet --json "$WORK/$name.json" >"$WORK/$name.md" \
        2>"$WORK/$name.err" || echo "$name: exit $? (see $name.err)" >>"$WORK/eval.status"
}

case "$STEP" in
calib)
    : >"$WORK/calib.log"
    t "$BIN/kvdump" --model "$MODEL" --text "$CALIB" --samples "${KVQ_SAMPLES:-16}" --seq-len "${KVQ_SEQ_LEN:-2048}" --fisher --q --device "$DEV" --force \
        --quiet -o "$WORK/dump.h5"
    pids=()
    for a in "${ARTS[@]}"; do
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=2 t "$BIN/kvcalib" "$WORK/dump.h5" ${a#*|} --force --quiet -o "$ART/${a%%|*}.safetensors" &
        pids+=($!)
        while [ "$(jobs -rp | wc -l)" -ge 8 ]; do sleep 0.2; done
    done
    for p in "${pids[@]}"; do wait "$p" || echo "kvcalib failed (calib.log)" >&2; done
    sort -k3 "$WORK/calib.log" ;;
eval)
    : >"$WORK/eval.status"
    s0=$(date +%s)
    all=()
    [ -z "${KVQ_MAX_WINDOWS:-}" ] || all=(--max-windows "$KVQ_MAX_WINDOWS")
    groups=${KVQ_GROUPS:-g1 g2 g3 g4 g5 sched}
    for g in $groups; do
        case "$g" in
        g1) run_group g1 -- "${G1[@]}" & ;;
        g2) run_group g2 "${all[@]}" -- "${G2[@]}" & ;;
        g3) run_group g3 "${all[@]}" -- "${G3[@]}" & ;;
        g4) run_group g4 "${all[@]}" -- "${G4[@]}" & ;;
        g5) run_group g5 "${all[@]}" -- "${G5[@]}" & ;;
        g6) run_group g6 "${all[@]}" -- "${G6[@]}" & ;;
        s:*) # one scheme in its own process (group name s<i>, i its place in KVQ_GROUPS)
            n_s=$((${n_s:-0} + 1))
            run_group "s$n_s" "${all[@]}" -- "${g#s:}" & ;;
        m:*) # several schemes, comma-separated, in one process (one fp32 pass; group name s<i> as above)
            n_s=$((${n_s:-0} + 1))
            IFS=, read -r -a members <<<"${g#m:}"
            run_group "s$n_s" "${all[@]}" -- "${members[@]}" & ;;
        g[2-6][ab])
            # half of a host-path group (its own process and fp32 pass): more processes on the CPU cores
            local_arr="G${g:1:1}[@]"
            members=("${!local_arr}")
            h=$(((${#members[@]} + 1) / 2))
            if [ "${g:2:1}" = a ]; then members=("${members[@]:0:$h}"); else members=("${members[@]:$h}"); fi
            run_group "$g" "${all[@]}" -- "${members[@]}" & ;;
        sched) THREADS=${KVQ_SCHED_THREADS:-6} run_group sched --max-windows "${KVQ_SCHED_WINDOWS:-6}" -- "${SCHED[@]}" & ;;
        *) echo "gpu_kveval_families: unknown group $g" >&2; exit 2 ;;
        esac
    done
    wait
    echo "eval: $(($(date +%s) - s0)) s for the groups ($groups) side by side" | tee -a "$WORK/eval.status"
    cat "$WORK/eval.status"
    n_s=0
    for g in $groups; do
        case "$g" in [sm]:*) n_s=$((n_s + 1)); g=s$n_s ;; esac
        echo "### $g"; cat "$WORK/$g.md"
    done ;;
*) echo "gpu_kveval_families: unknown step $STEP (calib, eval)" >&2; exit 2 ;;
esac
