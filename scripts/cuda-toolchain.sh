#!/usr/bin/env bash
# Install a CUDA 13 toolchain (nvcc, runtime, cuBLAS, CCCL headers) from NVIDIA's PyPI wheels
# into a cache outside the repo, and point $CUDA_CACHE/toolkit at the
# tree they form ({bin,include,lib,nvvm}), which CMake's FindCUDAToolkit and nvcc understand. Why wheels: no root, no apt repository of NVIDIA's, and the same
# pinned versions on every machine. Prints the toolkit root on stdout. Idempotent: a no-op
# when the pinned versions are already there.
set -euo pipefail
CUDA_CACHE="${CUDA_CACHE:-${POLYKV_CACHE:-$HOME/.cache/polykv}/cuda}"
# CUDA 13.0: NVIDIA's CUDA 12 nvcc wheels carry only ptxas (no nvcc, cicc or cudafe++); the
# CUDA 13 wheels are a full compiler laid out as one tree (nvidia/cu13/{bin,include,lib,nvvm}).
# 13.0 supports sm_75..sm_121 and gcc up to 14; the library needs an NVIDIA driver >= 580.
PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cublas==13.0.2.14
  nvidia-cuda-cccl==13.0.85
)
stamp="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -d' ' -f1)"
TK="$CUDA_CACHE/toolkit"
if [ -x "$TK/bin/nvcc" ] && [ "$(cat "$CUDA_CACHE/.pins" 2>/dev/null)" = "$stamp" ]; then
  echo "$TK"
  exit 0
fi
rm -rf "$CUDA_CACHE"
mkdir -p "$CUDA_CACHE"
python3 -m pip install --quiet --disable-pip-version-check --no-deps \
  --target "$CUDA_CACHE/site" "${PINS[@]}" >&2
# The cu13 wheels share one prefix, nvidia/cu13/{bin,include,lib,nvvm}; CMake's
# FindCUDAToolkit looks for lib64/ (or lib/) beside bin/nvcc, nvcc itself reads nvcc.profile.
ln -sfn "$CUDA_CACHE/site/nvidia/cu13" "$TK"
[ -e "$TK/lib64" ] || ln -s lib "$TK/lib64"
# The wheels ship only versioned sonames (libcudart.so.13); the linker wants the plain names.
( cd "$TK/lib"
  for f in lib*.so.*; do
    base="${f%%.so.*}.so"
    [ -e "$base" ] || ln -s "$f" "$base"
  done )
chmod +x "$TK"/bin/* "$TK"/nvvm/bin/* 2>/dev/null || true
echo "$stamp" > "$CUDA_CACHE/.pins"
echo "$TK"
