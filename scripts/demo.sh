#!/usr/bin/env bash
# demo.sh — the whole kvq pipeline on the default model and WikiText-2, ending with
# the results table. Run it through `make demo` (which installs and builds first).
#
#   kvdump  : calibration windows from WikiText-2 validation, with Fisher information
#             and attention statistics
#   kvcalib : nuq4/nuq3/nuq2 with 1% outliers and an attention sink (KVQuant), and
#             an IntactKV BOS prefix on top of nuq2-1%
#   kveval  : perplexity on WikiText-2 test for fp16, int4/3/2, KIVI-4/2, nuq4/3/2-1%
#             and nuq2-1% + IntactKV, next to the fp32 baseline of the same run
#   kvstat  : the outlier / sink report as one HTML page
#
# Sizes (defaults chosen so the pipeline takes 5–10 minutes on 2 CPU cores, after setup and build):
#   KVQ_DEMO_CALIB_N=4 KVQ_DEMO_CALIB_L=512   calibration windows x tokens
#   KVQ_DEMO_CTX=2048 KVQ_DEMO_WINDOWS=4      evaluation: first W windows of ctx tokens
#   FULL=1                                    evaluate every window of wiki.test.raw
#                                             (hours on a CPU; seconds per scheme on a GPU)
# Inputs and outputs:
#   KVQ_DATA=DIR      folder holding wikitext-2/wiki.valid.tokens and
#                     wikitext-2-raw/wiki.test.raw (default ../shared/datasets)
#   KVQ_DEMO_MODEL, KVQ_DEMO_TOKENIZER   another model (default: SmolLM2-135M-Instruct Q4_1)
#   KVQ_DEMO_SCHEMES="fp16 int4+sink1 ..."   the kveval schemes (nuq ones need the artifacts made here)
#   KVQ_DEMO_OUT=DIR  where everything goes (default out/demo)
#   KVQ_BIN_DIR=DIR   the binaries (default bin)
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${KVQ_DATA:-../shared/datasets}
VALID=$DATA/wikitext-2/wiki.valid.tokens
TEST=$DATA/wikitext-2-raw/wiki.test.raw
MODEL=${KVQ_DEMO_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TOKENIZER=${KVQ_DEMO_TOKENIZER:-}
OUT=${KVQ_DEMO_OUT:-out/demo}
BIN=${KVQ_BIN_DIR:-bin}
CALIB_N=${KVQ_DEMO_CALIB_N:-4}
CALIB_L=${KVQ_DEMO_CALIB_L:-512}
CTX=${KVQ_DEMO_CTX:-2048}
WINDOWS=${KVQ_DEMO_WINDOWS:-4}
[ "${FULL:-0}" = 1 ] && WINDOWS=0

for f in "$VALID" "$TEST"; do
  if [ ! -r "$f" ]; then
    cat >&2 <<MSG
demo.sh: cannot read $f.
  The demo needs WikiText-2: wikitext-2/wiki.valid.tokens (the tokenised validation split,
  for calibration) and wikitext-2-raw/wiki.test.raw (the raw test split, for perplexity),
  under one folder. Get them from the WikiText release (Salesforce, "WikiText-2") or the
  Hugging Face dataset "wikitext" (config wikitext-2-raw-v1), then run:
      KVQ_DATA=/path/to/that/folder make demo
MSG
    exit 1
  fi
done
[ -r "$MODEL" ] || { echo "demo.sh: model $MODEL missing (scripts/fetch_model.sh fetches the default one)" >&2; exit 1; }
for t in kvdump kvcalib kveval kvstat; do
  [ -x "$BIN/$t" ] || { echo "demo.sh: $BIN/$t is not built (run make)" >&2; exit 1; }
done
tokopt=()
[ -n "$TOKENIZER" ] && tokopt=(--tokenizer "$TOKENIZER")

mkdir -p "$OUT"
TIMES=$OUT/timings.md
echo "| step | seconds |" > "$TIMES"
echo "| --- | ---: |" >> "$TIMES"
step() { # step NAME CMD...: run, time, log
  local name=$1; shift
  echo "== $name: $*" >&2
  local t0=$SECONDS
  "$@"
  echo "| $name | $((SECONDS - t0)) |" >> "$TIMES"
}

step "kvdump (${CALIB_N} x ${CALIB_L} tokens, --fisher --attn-stats)" \
  "$BIN/kvdump" -m "$MODEL" "${tokopt[@]}" -t "$VALID" -n "$CALIB_N" -L "$CALIB_L" --fisher --attn-stats \
  -o "$OUT/dump.h5" --force

arts=()
for b in 4 3 2; do
  step "kvcalib nuq$b-1% (sink 1, Fisher-weighted)" \
    "$BIN/kvcalib" "$OUT/dump.h5" --method nuq --bits "$b" --outliers 0.01 --sink 1 -o "$OUT/nuq$b-1pct.safetensors" --force -q
  arts+=(--artifact "$OUT/nuq$b-1pct.safetensors")
done

read -r -a schemes <<< "${KVQ_DEMO_SCHEMES:-fp16 int4+sink1 int3+sink1 int2+sink1 kivi4 kivi2 nuq4-1% nuq3-1% nuq2-1%}"
if "$BIN/kvcalib" intactkv --help 2>/dev/null | grep -- --base >/dev/null; then  # not -q: an early exit would SIGPIPE the writer (pipefail)
  step "kvcalib intactkv (BOS prefix on nuq2-1%)" \
    "$BIN/kvcalib" intactkv --model "$MODEL" "${tokopt[@]}" --base "$OUT/nuq2-1pct.safetensors" --prefix bos \
    --out "$OUT/nuq2-1pct-intactkv.safetensors" --force --quiet
  arts+=(--artifact "$OUT/nuq2-1pct-intactkv.safetensors")
  schemes+=(nuq2-1%+intactkv)
fi

sargs=()
for s in "${schemes[@]}"; do sargs+=(--scheme "$s"); done
wopt=()
[ "$WINDOWS" != 0 ] && wopt=(--max-windows "$WINDOWS")
step "kveval (ctx $CTX, ${WINDOWS/#0/all} windows of wiki.test.raw, ${#schemes[@]} schemes + fp32)" \
  bash -c '"$@" > "'"$OUT"'/kveval.md"' _ "$BIN/kveval" -m "$MODEL" "${tokopt[@]}" -t "$TEST" --ctx "$CTX" "${wopt[@]}" \
  "${arts[@]}" "${sargs[@]}" --json "$OUT/kveval.json"

step "kvstat --html (with the nuq3-1% artifact)" \
  "$BIN/kvstat" "$OUT/dump.h5" --artifact "$OUT/nuq3-1pct.safetensors" --html "$OUT/report" --json "$OUT/kvstat.json" \
  --markdown "$OUT/kvstat.md" -q

python3 scripts/results_table.py "$OUT/kveval.json" > "$OUT/results.md"
{
  echo
  echo "Time per step (seconds, this machine: $(nproc) cores):"
  echo
  cat "$TIMES"
} >> "$OUT/results.md"

echo
cat "$OUT/results.md"
echo
echo "kvq demo: the kveval table with protocol details is $OUT/kveval.md (JSON: $OUT/kveval.json)"
echo "kvq demo: the kvstat report is $OUT/report/index.html (open it in a browser; tables: $OUT/kvstat.md)"
