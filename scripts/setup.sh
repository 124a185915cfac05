#!/usr/bin/env bash
# setup.sh — install kvq's build/test dependencies and fetch the default model.
# (Debian packages, the PyPI test tools, NCCL's wheel where nvcc is)
# Idempotent: does nothing that is already done. Options:
#   --no-model   skip the model download
#   --no-python  skip the PyPI test tools (numpy, gguf, safetensors, h5py)
# Environment: KVQ_MODELS_DIR (default models/).
set -euo pipefail
cd "$(dirname "$0")/.."

want_model=1
want_py=1
for a in "$@"; do
  case "$a" in
    --no-model) want_model=0 ;;
    --no-python) want_py=0 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown option '$a' (see --help)" >&2; exit 2 ;;
  esac
done

# libopenblas-dev: BLAS and the LAPACK routines OpenBLAS bundles (dsyevd for kernels/schemes/lowrank.c)
# libopenmpi-dev: MPI for the multi-GPU pipeline across hosts (docs/MULTIGPU.md; the build uses it when found)
DEB_PKGS=(build-essential pkg-config libhdf5-dev zlib1g-dev libopenblas-dev libcjson-dev libpcre2-dev
          libcairo2-dev check libssl-dev python3-pip unzip chromium libopenmpi-dev)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup.sh: these Debian packages are missing: ${missing[*]}" >&2
    echo "setup.sh: installing needs root: run 'sudo bash scripts/setup.sh' (or install them yourself)." >&2
    exit 1
  fi
  echo "setup.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    echo "setup.sh: apt-get failed (no network or no package mirror?). Install by hand: ${missing[*]}" >&2
    exit 1
  fi
fi

PY=${PYTHON:-python3}
if [ "$want_py" = 1 ] && command -v "$PY" >/dev/null; then
  if ! "$PY" -c 'import numpy, gguf, safetensors, h5py' 2>/dev/null; then
    echo "setup.sh: installing Python test tools (numpy gguf safetensors h5py)" >&2
    "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore --break-system-packages \
        numpy gguf safetensors h5py 2>/dev/null ||
    "$PY" -m pip install -q --disable-pip-version-check numpy gguf safetensors h5py ||
      echo "setup.sh: warning: could not pip-install numpy/gguf/safetensors/h5py; the scripts under tests/scripts need them" >&2
  fi
fi

# NCCL for the multi-GPU pipeline (docs/MULTIGPU.md): the PyPI wheel nvidia-nccl-cu13 (nccl.h and libnccl.so.2) for
# the CUDA 13 toolkit, only where nvcc is (CUDA builds); the Makefile finds it (make config)
NVCC_BIN=$(command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$NVCC_BIN" ] && command -v "$PY" >/dev/null && ! "$PY" -c 'import nvidia.nccl' 2>/dev/null; then
  echo "setup.sh: installing NCCL (PyPI nvidia-nccl-cu13)" >&2
  "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore --break-system-packages nvidia-nccl-cu13 2>/dev/null ||
  "$PY" -m pip install -q --disable-pip-version-check nvidia-nccl-cu13 ||
    echo "setup.sh: warning: could not pip-install nvidia-nccl-cu13; the build goes without the multi-GPU pipeline" >&2
fi

if [ "$want_model" = 1 ]; then
  bash scripts/fetch_model.sh
fi
echo "setup.sh: ok" >&2
