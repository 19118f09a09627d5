#!/usr/bin/env bash
# The GPU verification of issue 16, for a session that is lent an NVIDIA machine (the
# `run` tool). Nothing is built on the GPU machine: everything is built here and carried.
#
#   scripts/gpu-check.sh pack     HERE. Needs `make build-cuda` (lib/) and the model. Builds
#                                 bin/polykv and the internal/app test binary and lays out
#                                 .gpu/ (gitignored), split in two
#                                 halves because one call carries at most 64 MiB:
#                                   .gpu/a: libggml-cuda.so, libggml-base.so, libcudart, half
#                                           of the model
#                                   .gpu/b: bin/polykv, app.test, the other half
#                                 (cuBLAS is not carried: 570 MB; the H200 image has it in
#                                 python's nvidia/cu13 packages, next to driver 580 and
#                                 CUDA 13.0, which is what the library is built with.)
#   scripts/gpu-check.sh stage-a  ON THE GPU MACHINE, call 1: carry [".gpu/a"]; copies it to
#                                 /tmp/polykv-gpu, which stays while the machine is warm
#                                 (30 s idle), so make call 2 straight after.
#   scripts/gpu-check.sh run      ON THE GPU MACHINE, call 2: carry [".gpu/b"]; joins the
#                                 model, then measures and tests with -ngl all and writes
#                                 everything to $OUT (devices.txt, nvidia-smi.txt, bench-*.txt,
#                                 pool-tests.txt, summary.txt). About 5 to 8 minutes; give
#                                 it timeout_s 590.
#
# What `run` records (issue 16's verification): the card and driver, --list-devices, the
# decode benchmark at B = 1..64, fan-out pooled vs unpooled at N up to 64, prefill at 2k and
# 16k tokens (the N=1 fan-out's TTFT, unpooled), and the real-model pool tests, the
# batch-shape test (it logs max |Δ logprob|) and TestGPUOffloadAllLayers with
# POLYKV_REQUIRE_GPU=1 (-ngl auto then means every layer on the GPU, and that test proves
# the GPU is there and /props says so).
set -uo pipefail
MODE="${1:?usage: gpu-check.sh pack|stage-a|run}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE=/tmp/polykv-gpu
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

case "$MODE" in
pack)
  set -e
  cd "$ROOT"
  [ -f lib/libggml-cuda.so ] || { echo "gpu-check: lib/libggml-cuda.so missing: make build-cuda CUDA_ARCHS=90" >&2; exit 1; }
  MODEL="${POLYKV_MODEL:-$HOME/.cache/polykv/models/$MODEL_NAME}"
  [ -f "$MODEL" ] || { echo "gpu-check: model missing: make model" >&2; exit 1; }
  eval "$(make -s env)"
  rm -rf .gpu && mkdir -p .gpu/a .gpu/b
  # -s -w: no symbol tables, so both binaries fit the 64 MiB beside the half model.
  go build -ldflags='-s -w' -o .gpu/b/polykv ./cmd/polykv
  go test -c -ldflags='-s -w' -o .gpu/b/app.test ./internal/app
  cp -a lib/libggml-cuda.so lib/libggml-base.so* lib/libcudart.so.13 .gpu/a/
  split -n 2 -d "$MODEL" .gpu/model.
  mv .gpu/model.00 .gpu/a/ && mv .gpu/model.01 .gpu/b/
  du -sh .gpu/a .gpu/b
  echo 'then: run(carry [".gpu/a"], command "bash scripts/gpu-check.sh stage-a", timeout_s 120)'
  echo '      run(carry [".gpu/b"], command "bash scripts/gpu-check.sh run", timeout_s 590)'
  ;;
stage-a)
  mkdir -p "$STAGE"
  cp -a "$ROOT"/.gpu/a/. "$STAGE/"
  nvidia-smi || true
  ls -la "$STAGE"
  ;;
run)
  OUT="${OUT:?run on the GPU machine, where OUT is set}"
  [ -f "$STAGE/model.00" ] || { echo "gpu-check: $STAGE is empty: call 1 (stage-a) first, straight before this one" >&2; exit 1; }
  cp -a "$ROOT"/.gpu/b/. "$STAGE/"
  cat "$STAGE/model.00" "$STAGE/model.01" > "$STAGE/$MODEL_NAME"
  mkdir -p "$STAGE/lib" && mv "$STAGE"/lib*.so* "$STAGE/lib/"
  export POLYKV_MODEL="$STAGE/$MODEL_NAME" POLYKV_LIBRARY_PATH="$STAGE/lib"
  # cuBLAS from the machine: python's nvidia/cu13 wheels (torch cu130), else a CUDA install.
  cublas="$(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null | head -1)"
  for d in "$cublas" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -n "$d" ] && [ -e "$d/libcublasLt.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee "$OUT/summary.txt"
  { nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$OUT/nvidia-smi.txt" 2>&1
  BIN="$STAGE/polykv"
  chmod +x "$BIN" "$STAGE/app.test"
  "$BIN" serve --list-devices > "$OUT/devices.txt" 2>&1
  cat "$OUT/devices.txt" | tee -a "$OUT/summary.txt"
  step() { # name, seconds, command...
    local name="$1" secs="$2"; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: rc $? in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    tail -n 15 "$OUT/$name.txt" >> "$OUT/summary.txt"
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
*) echo "gpu-check: unknown mode $MODE (pack|stage-a|run)" >&2; exit 2 ;;
esac
