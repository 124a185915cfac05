#!/usr/bin/env bash
# fuzz_tokenizer.sh [SECONDS] — build tests/fuzz/fuzz_tokenizer.c with clang
# libFuzzer + ASan/UBSan and run it for SECONDS (default 180) on one core.
# Seeds: the conformance .inp strings. Crash inputs land in tests/fixtures/fuzz/
# (commit them: tests/test_tokenizer.c replays every file there).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-180}
CC=${FUZZ_CC:-clang}
command -v "$CC" >/dev/null || { echo "fuzz: $CC not found (apt-get install -y clang libclang-rt-14-dev)"; exit 1; }
out=build-fuzz
mkdir -p "$out/corpus" tests/fixtures/fuzz
# the tokenizer reaches into formats/ (model paths, GGUF, llama2.c sniffing): link both layers whole
"$CC" -std=c17 -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I. -Iformats -Idatasets \
  $(pkg-config --cflags hdf5 libpcre2-8 libcjson libcrypto) tests/fuzz/fuzz_tokenizer.c datasets/*.c formats/*.c \
  $(pkg-config --libs hdf5 libpcre2-8 libcjson libcrypto) -lz -lm -o "$out/fuzz_tokenizer"
shared=${KVQ_SHARED:-../shared}
if [ -d "$shared/tokenizer-conformance" ]; then
  python3 - "$shared/tokenizer-conformance" "$out/corpus" <<'PY'
import sys, os, hashlib
src, dst = sys.argv[1], sys.argv[2]
for i, name in enumerate(["gpt-2", "starcoder", "llama-spm"]):
    for s in open(os.path.join(src, "ggml-vocab-%s.gguf.inp" % name), "rb").read().split(b"\n__ggml_vocab_test__\n"):
        d = bytes([i]) + s
        open(os.path.join(dst, hashlib.sha1(d).hexdigest()), "wb").write(d)
PY
fi
"$out/fuzz_tokenizer" -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048 \
  -artifact_prefix=tests/fixtures/fuzz/ "$out/corpus"
