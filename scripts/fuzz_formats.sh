#!/usr/bin/env bash
# fuzz_formats.sh [SECONDS] [JOBS] — build tests/fuzz/fuzz_formats.c with clang
# libFuzzer + ASan/UBSan and fuzz kvq's file readers (GGUF header and model,
# GGUF / llama2.c / HF tokenizers, llama2.c checkpoints, safetensors, HF
# checkpoints, text, calibration artifacts) for SECONDS (default 300) with JOBS workers (default 1).
# Seeds: the small fixtures in tests/fixtures (and ../shared's llama2.c
# tokenizer when present), each prefixed with its reader's selector byte.
# Inputs that trip a check land in tests/fixtures/fuzz-formats/ (commit them:
# tests/test_fuzz_formats.c replays every file there).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
jobs=${2:-1}
CC=${FUZZ_CC:-clang}
command -v "$CC" >/dev/null || { echo "fuzz: $CC not found (apt-get install -y clang libclang-rt-14-dev)"; exit 1; }
out=build-fuzz
mkdir -p "$out/corpus-formats" tests/fixtures/fuzz-formats
# the artifact reader lives with the scheme registry (kernels/schemes), which reaches the rest of the
# CPU library: compile every C source of it (no CUDA) with the fuzzer's instrumentation
dirs=$(find formats datasets kernels calib analysis -type d)
srcs=$(find formats datasets kernels calib analysis -name '*.c')
pkgs="hdf5 libcjson libpcre2-8 libcrypto cairo fontconfig openblas"
# shellcheck disable=SC2046,SC2086
"$CC" -std=c17 -g -O1 -fopenmp -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -D_GNU_SOURCE \
  -I. $(printf -- '-I%s ' $dirs) $(pkg-config --cflags $pkgs) \
  tests/fuzz/fuzz_formats.c $srcs \
  $(pkg-config --libs $pkgs) -lz -lm -o "$out/fuzz_formats"
shared=${KVQ_SHARED:-../shared}
# calibration artifacts of every method (and an IntactKV prefix) from a tiny dump of the
# llama2.c model, when a CPU build and ../shared are there
arts=$out/artifacts
S=$shared/models/llama2c
if [ -x bin-cpu/kvdump ] && [ -r "$S/aidreams260K.bin" ] && [ -r "$shared/datasets/wikitext-2/wiki.test.tokens" ]; then
  mkdir -p "$arts"
  bin-cpu/kvdump -m "$S/aidreams260K.bin" --tokenizer "$S/aidreams-tok512.bin" -t "$shared/datasets/wikitext-2/wiki.test.tokens" \
    -n 4 -L 64 --fisher -o "$arts/d.h5" -f -q
  i=0
  for m in "nuq --bits 4" "nuq --bits 2 --outliers 0.01 --sink 1" "int-pc --bits 4 --group 16" "kivi --bits 2 --group 8" "fp8"; do
    bin-cpu/kvcalib "$arts/d.h5" --method $m --out "$arts/a$i.kvq" -f -q
    i=$((i + 1))
  done
  bin-cpu/kvcalib intactkv --model "$S/aidreams260K.bin" --tokenizer "$S/aidreams-tok512.bin" --base "$arts/a3.kvq" --prefix bos \
    --out "$arts/intactkv.kvq" -f -q
else
  echo "fuzz: no bin-cpu/kvdump or ../shared: no artifact seeds (make CUDA=0 first)"
fi
python3 tests/scripts/fuzz_formats_seeds.py "$out/corpus-formats" "$shared" "$arts"
mkdir -p "$out/fuzz-tmp"
art=$PWD/tests/fixtures/fuzz-formats/
# from $out, so that the workers' logs (fuzz-N.log with JOBS > 1) stay there
cd "$out"
KVQ_FUZZ_TMP=fuzz-tmp ./fuzz_formats -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 \
  -malloc_limit_mb=1024 -timeout=10 -jobs="$jobs" -workers="$jobs" -artifact_prefix="$art" corpus-formats
