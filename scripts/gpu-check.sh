#!/usr/bin/env bash
# The GPU verification of issue 16, for a session that is lent an NVIDIA machine (the
# `run` tool). Everything is built here and carried, the CUDA library too when it could be
# built here (see pack).
#
#   scripts/gpu-check.sh pack     HERE. Needs the model, and `make build-cuda` (lib/): without
#                                 lib/ it packs ggml's sources and `run` builds the library on
#                                 the GPU machine first (nvcc 13.0 is there; costs device
#                                 minutes, so build here when the 2 cores allow). Builds
#                                 bin/polykv and the internal/app test binary (stripped), tars
#                                 them with lib/'s CUDA backend and the model, and splits the
#                                 archive into bundles .gpu/1, .gpu/2, ... (gitignored) of at
#                                 most 56 MiB, because one call carries at most 64 MiB; it
#                                 prints the calls to make. cuBLAS (570 MB) is not carried: the
#                                 H200 image has it in python's nvidia/cu13 packages, beside
#                                 driver 580 and CUDA 13.0, which the library is built with.
#   scripts/gpu-check.sh stage I  ON THE GPU MACHINE, one call per bundle but the last: carry
#                                 [".gpu/I"]; copies it to /tmp/polykv-gpu, which stays while
#                                 the machine is warm (30 s idle): make the calls back to back.
#   scripts/gpu-check.sh run K    ON THE GPU MACHINE, the last call: carry [".gpu/K"]; unpacks,
#                                 then measures and tests with -ngl all and writes everything
#                                 to $OUT (summary.txt, devices.txt, nvidia-smi.txt, bench-*.txt,
#                                 pool-tests.txt). At most about 9 minutes: timeout_s 590.
#
# What `run` records (issue 16's verification): the card and driver, --list-devices, the
# decode benchmark at B = 1..64, fan-out pooled vs unpooled at N up to 64, prefill at 2k and
# 16k tokens (the N=1 fan-out's TTFT, unpooled), and the real-model pool tests, the
# batch-shape test (it logs max |Δ logprob|) and TestGPUOffloadAllLayers with
# POLYKV_REQUIRE_GPU=1 (-ngl auto then means every layer on the GPU, and that test proves
# the GPU is there and /props says so).
set -uo pipefail
MODE="${1:?usage: gpu-check.sh pack | stage I | run K}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE=/tmp/polykv-gpu
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

case "$MODE" in
pack)
  set -e
  cd "$ROOT"
  MODEL="${POLYKV_MODEL:-$HOME/.cache/polykv/models/$MODEL_NAME}"
  [ -f "$MODEL" ] || { echo "gpu-check: model missing: make model" >&2; exit 1; }
  eval "$(make -s env)"
  rm -rf .gpu && mkdir -p .gpu/payload/lib
  go build -ldflags='-s -w' -o .gpu/payload/polykv ./cmd/polykv
  go test -c -ldflags='-s -w' -o .gpu/payload/app.test ./internal/app
  if [ -f lib/libggml-cuda.so ]; then
    cp -a lib/libggml-cuda.so lib/libggml-base.so* lib/libcudart.so.13 .gpu/payload/lib/
  else
    # Fallback when `make build-cuda` could not run here (it takes hours on 2 shared
    # cores): carry ggml's sources (9 MB) and build there with the image's nvcc 13.0 on
    # 16 cores (a few minutes of the device budget, recorded in build.txt).
    echo "gpu-check: lib/libggml-cuda.so missing: the sources go along and 'run' builds it there" >&2
    mkdir -p .gpu/payload/src
    cp -r "$(./scripts/llama.sh src)/ggml/." .gpu/payload/src/
  fi
  ln -s "$MODEL" ".gpu/payload/$MODEL_NAME"
  tar -C .gpu/payload -chf - . | gzip -1 | split -b 56M -d -a 1 - .gpu/part.
  rm -rf .gpu/payload
  k=0
  for f in .gpu/part.*; do
    k=$((k + 1)); mkdir -p ".gpu/$k"; mv "$f" ".gpu/$k/part"
  done
  du -sh .gpu/*/
  for i in $(seq 1 $((k - 1))); do
    echo "call $i: run(carry [\".gpu/$i\"], command \"bash scripts/gpu-check.sh stage $i\", timeout_s 120)"
  done
  echo "call $k: run(carry [\".gpu/$k\"], command \"bash scripts/gpu-check.sh run $k\", timeout_s 590)"
  ;;
stage)
  i="${2:?stage I}"
  mkdir -p "$STAGE"
  cp "$ROOT/.gpu/$i/part" "$STAGE/part.$i"
  ls -la "$STAGE"
  nvidia-smi -L || true
  ;;
run)
  k="${2:?run K}"
  OUT="${OUT:?run on the GPU machine, where OUT is set}"
  mkdir -p "$STAGE"
  cp "$ROOT/.gpu/$k/part" "$STAGE/part.$k"
  for i in $(seq 1 "$k"); do
    [ -f "$STAGE/part.$i" ] || { echo "gpu-check: $STAGE/part.$i missing: stage calls 1..$((k - 1)) first, back to back" >&2; exit 1; }
  done
  for i in $(seq 1 "$k"); do cat "$STAGE/part.$i"; done | gzip -dc | tar -C "$STAGE" -xf - || exit 1
  export POLYKV_MODEL="$STAGE/$MODEL_NAME" POLYKV_LIBRARY_PATH="$STAGE/lib"
  : > "$OUT/summary.txt"
  if [ ! -f "$STAGE/lib/libggml-cuda.so" ] && [ -d "$STAGE/src" ]; then
    # Same settings as scripts/build-gpu.sh, one architecture (the H200's).
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    t0=$SECONDS
    { cmake -S "$STAGE/src" -B "$STAGE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
        '-DCMAKE_INSTALL_RPATH=$ORIGIN' -DGGML_NATIVE=OFF -DCMAKE_CUDA_COMPILER="$NVCC" \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" -DGGML_CUDA_NO_VMM=ON -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON &&
      cmake --build "$STAGE/build" --target ggml-cuda -j "$(nproc)"; } > "$OUT/build.txt" 2>&1
    echo "== build on the device: rc $? in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    mkdir -p "$STAGE/lib"
    cp -a "$STAGE"/build/bin/libggml-cuda.so "$STAGE"/build/bin/libggml-base.so* "$STAGE/lib/" 2>>"$OUT/summary.txt"
    ls -la "$STAGE/lib" >> "$OUT/summary.txt"
  fi
  # cuBLAS (and, for a library built there, cudart) from the machine: python's nvidia/cu13
  # wheels (torch cu130), else a CUDA install.
  cublas="$(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null | head -1)"
  for d in "$cublas" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -n "$d" ] && [ -e "$d/libcublasLt.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee -a "$OUT/summary.txt"
  { nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$OUT/nvidia-smi.txt" 2>&1
  BIN="$STAGE/polykv"
  "$BIN" serve --list-devices > "$OUT/devices.txt" 2>&1
  cat "$OUT/devices.txt" | tee -a "$OUT/summary.txt"
  step() { # name, seconds, command...
    local name="$1" secs="$2"; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: rc $? in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    grep -E '^(--- |PASS|FAIL|ok )|logprob|offload:|device:' "$OUT/$name.txt" >> "$OUT/summary.txt"
    tail -n 12 "$OUT/$name.txt" >> "$OUT/summary.txt"
  }
  T=$(nproc)
  # Real-model tests first: correctness before speed.
  # From the package's folder, as go test runs it (tests may read files beside them).
  cd "$ROOT/internal/app"
  step pool-tests 200 env POLYKV_REQUIRE_MODEL=1 POLYKV_REQUIRE_GPU=1 "$STAGE/app.test" -test.count=1 -test.v -test.timeout 190s \
    -test.run 'TestGPUOffloadAllLayers|TestGreedySameAloneAndInABatch|TestZeroCopyProofByCapacity|TestPooledMatchesUnpooled|TestAutoPAndTree|TestFromSessionAndReclaim|TestSessionSecondTurnReusesCache'
  cd "$ROOT"
  step bench-decode 120 "$BIN" bench -m "$POLYKV_MODEL" -ngl all -t "$T" -c 16384 --workload decode --sessions 1,2,4,8,16,32,64 -n 128 --reps 1
  step bench-fanout 150 "$BIN" bench -m "$POLYKV_MODEL" -ngl all -t "$T" --workload fanout --fanout-agents 1,4,16,64
  step bench-prefill-2k 40 "$BIN" bench -m "$POLYKV_MODEL" -ngl all -t "$T" --workload fanout --fanout-agents 1 --fanout-root 2000 --fanout-gen 8
  step bench-prefill-16k 60 "$BIN" bench -m "$POLYKV_MODEL" -ngl all -t "$T" --workload fanout --fanout-agents 1 --fanout-root 16000 --fanout-gen 8
  ;;
*) echo "gpu-check: unknown mode $MODE (pack, stage I, run K)" >&2; exit 2 ;;
esac
