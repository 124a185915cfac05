#!/usr/bin/env bash
# gpu_kveval_fidelity.sh — issue 41's full runs on a GPU: every scheme over the whole WikiText-2 test
# split at ctx 2048 and at --ctx max (the model's trained context), with PPL, ΔPPL ± SE and the KL
# divergence columns, then the passkey task at 512 … the trained context; first gpu_check's
# synthetic comparison, whose LM-head row checks the GPU's KL-divergence outputs against the CPU's.
#
#   scripts/gpu_kveval_fidelity.sh MODEL TEXT ARTDIR OUTDIR
#     MODEL   the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf)
#     TEXT    wiki.test.raw (../shared/datasets/wikitext-2-raw/wiki.test.raw)
#     ARTDIR  kvcalib artifacts: nuq{4,3,2}.safetensors, nuq{4,3,2}-1pct.safetensors (method nuq),
#             fp8-tensor.safetensors, fp8-head.safetensors (method fp8, E4M3, --scale tensor / head),
#             e5m2-head.safetensors (--fp8-format e5m2 --scale head); e.g. from
#               bin/kvdump -m MODEL -t ../shared/datasets/wikitext-2/wiki.valid.tokens -n 16 -L 2048 --fisher -o d.h5
#               bin/kvcalib d.h5 --method nuq --bits B [--outliers 0] -o ARTDIR/nuqB[-1pct].safetensors
#               bin/kvcalib d.h5 --method fp8 --scale tensor|head [--fp8-format e5m2] -o ARTDIR/...
#     OUTDIR  ctx2048.md/.json, ctxmax.md/.json, passkey.md/.json, gpu_check.txt
# Environment: KVQ_KVEVAL (default bin/kveval), KVQ_GPU_CHECK (default build/gpu/gpu_check), KVQ_DEVICE (cuda),
# KVQ_FIDELITY_STEPS (default "ctx2048 ctxmax passkey", run in that order), KVQ_PASSKEY_SCHEMES (default
# every scheme), KVQ_PASSKEY_TRIALS (4), KVQ_PASSKEY_DEPTHS (0,25,50,75,100). On an H100 the ctx-2048 run
# takes ~5 min, the --ctx max run ~7 min (SmolLM2, 25 schemes, the whole split).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$1 TEXT=$2 ART=$3 OUT=$4
KVEVAL=${KVQ_KVEVAL:-bin/kveval}
CHECK=${KVQ_GPU_CHECK:-build/gpu/gpu_check}
DEV=${KVQ_DEVICE:-cuda}
mkdir -p "$OUT"
names=(nuq4-1pct nuq3-1pct nuq2-1pct nuq4 nuq3 nuq2 fp8-tensor fp8-head e5m2-head)
arts=()
for a in "${names[@]}"; do
    [ -r "$ART/$a.safetensors" ] || { echo "gpu_kveval_fidelity: missing artifact $ART/$a.safetensors" >&2; exit 2; }
    arts+=(--artifact "$ART/$a.safetensors")
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ -x "$CHECK" ]; then
    "$CHECK" --synthetic >"$OUT/gpu_check.txt" 2>&1 || { tail -40 "$OUT/gpu_check.txt" >&2; echo "gpu_check failed" >&2; exit 1; }
    grep -E "LM-head outputs|FAIL" "$OUT/gpu_check.txt" || true
fi
schemes=()
for s in fp16 int4+sink1 int3+sink1 int2+sink1 int4-pc-1% kivi4 kivi2 nuq4-1% nuq3-1% nuq2-1% nuq4 nuq3 nuq2 \
         fp8 e5m2 fp8-tensor fp8-head e5m2-head q8_0 q5_1 q5_0 q4_1 q4_0 iq4_nl; do schemes+=(--scheme "$s"); done
for step in ${KVQ_FIDELITY_STEPS:-ctx2048 ctxmax passkey}; do
    case "$step" in
    ctx2048|ctxmax)
        ctx=$([ "$step" = ctx2048 ] && echo 2048 || echo max)
        "$KVEVAL" --device "$DEV" --model "$MODEL" --text "$TEXT" --ctx "$ctx" "${arts[@]}" "${schemes[@]}" \
            --json "$OUT/$step.json" >"$OUT/$step.md" 2>"$OUT/$step.err" || { cat "$OUT/$step.err" >&2; exit 1; }
        cat "$OUT/$step.md" ;;
    passkey)
        pks=()
        if [ -n "${KVQ_PASSKEY_SCHEMES:-}" ]; then for s in $KVQ_PASSKEY_SCHEMES; do pks+=(--scheme "$s"); done; else pks=("${schemes[@]}"); fi
        "$KVEVAL" --device "$DEV" --task passkey --model "$MODEL" "${arts[@]}" --passkey-lengths 512,1024,2048,4096,max \
            --passkey-depths "${KVQ_PASSKEY_DEPTHS:-0,25,50,75,100}" --passkey-trials "${KVQ_PASSKEY_TRIALS:-4}" "${pks[@]}" \
            --json "$OUT/passkey.json" >"$OUT/passkey.md" 2>"$OUT/passkey.err" || { cat "$OUT/passkey.err" >&2; exit 1; }
        cat "$OUT/passkey.md" ;;
    *) echo "gpu_kveval_fidelity: unknown step $step" >&2; exit 2 ;;
    esac
done
