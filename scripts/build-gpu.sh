#!/usr/bin/env bash
# Build one ggml GPU backend (cuda or vulkan) as a shared library from the pinned llama.cpp
# source (llama.cpp.pin, unpacked by scripts/llama.sh), and install it into lib/ beside
# bin/polykv, where the binary loads it at run time (internal/llama.LoadBackends). The Go
# binary itself is not rebuilt. Not yet run on a GPU with this llama.cpp (the GPU issue).
#
#   scripts/build-gpu.sh cuda     CUDA_ARCHS="80;86;89;90" (CMake's list), GPU_JOBS=2
#   scripts/build-gpu.sh vulkan   needs Debian's glslc and libvulkan-dev
#
# Build tree: build/<kind>/ (gitignored, reused by the next run: ninja rebuilds only what
# changed). Output: lib/libggml-<kind>.so, lib/libggml-base.so* and, for CUDA, the CUDA
# runtime and cuBLAS libraries the backend needs (RPATH $ORIGIN).
set -euo pipefail
KIND="${1:?usage: build-gpu.sh cuda|vulkan}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
"$ROOT/scripts/llama.sh" build >/dev/null # unpacks the pinned source (and builds the CPU libraries)
LLAMA_SRC="$("$ROOT/scripts/llama.sh" src)"
BUILD="$ROOT/build/$KIND"
LIB="$ROOT/lib"
JOBS="${GPU_JOBS:-2}"
# $ORIGIN: the backend finds libggml-base and the CUDA libraries beside itself in lib/.
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
  "-DCMAKE_INSTALL_RPATH=\$ORIGIN" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF)
start=$(date +%s)
case "$KIND" in
  cuda)
    TK="$("$ROOT/scripts/cuda-toolchain.sh")"
    ARCHS="${CUDA_ARCHS:-80;86;89;90}"
    # GGML_CUDA_NO_VMM: the virtual-memory pool links libcuda.so (the driver) at build time,
    # and the wheels carry no stub of it; the legacy pool needs only the runtime.
    cmake -S "$LLAMA_SRC" -B "$BUILD" "${common[@]}" \
      -DCMAKE_CUDA_COMPILER="$TK/bin/nvcc" -DCUDAToolkit_ROOT="$TK" \
      "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON
    cmake --build "$BUILD" --target ggml-cuda -j "$JOBS"
    mkdir -p "$LIB"
    cp -a "$BUILD"/bin/libggml-base.so* "$LIB/"
    cp -a "$BUILD"/bin/libggml-cuda.so "$LIB/"
    for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
      cp -L "$TK/lib/$so" "$LIB/$so"
    done
    ;;
  vulkan)
    command -v glslc >/dev/null || { echo "build-gpu: glslc not found (apt-get install glslc libvulkan-dev)" >&2; exit 1; }
    cmake -S "$LLAMA_SRC" -B "$BUILD" "${common[@]}" -DGGML_VULKAN=ON
    cmake --build "$BUILD" --target ggml-vulkan -j "$JOBS"
    mkdir -p "$LIB"
    cp -a "$BUILD"/bin/libggml-base.so* "$LIB/"
    cp -a "$BUILD"/bin/libggml-vulkan.so "$LIB/"
    ;;
  *) echo "build-gpu: unknown backend $KIND (cuda|vulkan)" >&2; exit 2 ;;
esac
echo "build-gpu: $KIND built in $(( $(date +%s) - start ))s; lib/:"
ls -la "$LIB"
du -shL "$LIB"
