#!/usr/bin/env bash
# gpu_carry_bins.sh — binaries of this CUDA build for a GPU machine that has the CUDA driver and
# cuBLAS but not our build dependencies (hdf5, cjson, openblas, pcre2, libcrypto, ...).
#
#   scripts/gpu_carry_bins.sh OUTDIR NAME...
#     NAME  a tool (kveval, kvdump, kvcalib, kvstat: linked from build/cmd/NAME.o and build/libkvq.a,
#           --as-needed, CUDA runtime static) or a GPU test binary (gpu_check, test_kvcache_cuda:
#           build/gpu/NAME copied; skipped with a note when not built)
# OUTDIR receives the binaries and libs.tar.xz (folder lib/: every shared library they need except
# glibc, libstdc++, libgcc_s and cuBLAS, which the GPU machine has). Run after `make CUDA=1 all`
# (and `gpu-tests` for the test binaries): the objects must match the library.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
OUT=$(realpath -m "$1")
shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
bins=()
for name in "$@"; do
    if [ -f "build/cmd/$name.o" ]; then
        # shellcheck disable=SC2046
        cc -std=c17 -O2 -fopenmp "build/cmd/$name.o" -Wl,--as-needed build/libkvq.a \
            $(pkg-config --libs hdf5 libcjson libpcre2-8 openblas libcrypto) -lz -lm -lpthread \
            -L"$CUDA_HOME/lib64" -lcublas -lcublasLt -lcudart_static -ldl -lrt -lstdc++ -o "$OUT/$name"
    elif [ -x "build/gpu/$name" ]; then
        cp "build/gpu/$name" "$OUT/"
    else
        echo "gpu_carry_bins: $name: neither build/cmd/$name.o nor build/gpu/$name (make CUDA=1 all gpu-tests); skipped" >&2
        continue
    fi
    bins+=("$OUT/$name")
done
[ ${#bins[@]} -gt 0 ] || { echo "gpu_carry_bins: nothing to carry" >&2; exit 1; }
rm -rf "$OUT/lib"
mkdir -p "$OUT/lib"
ldd "${bins[@]}" | awk '/=>/{print $1, $3}' | sort -u | while read -r name path; do
    case "$name" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libgcc_s.so.*|libstdc++.so.*|libresolv.so.*|libcublas*) ;;
    *) [ -e "$path" ] || { echo "gpu_carry_bins: $name not found here" >&2; exit 1; }; cp -L "$path" "$OUT/lib/" ;;
    esac
done
(cd "$OUT" && tar -cJf libs.tar.xz lib && rm -rf lib)
