#!/usr/bin/env bash
# The GPU verification (the GPU issue), for a session that is lent an NVIDIA machine
# through the `run` tool: nothing can be fetched there and one call carries at most
# 64 MiB, so everything is built here, packed, and carried in bundles.
#
#   scripts/gpu-check.sh pack     HERE. Needs the models (make model) and the CUDA backend
#                                 in lib/ (make build-cuda CUDA_ARCHS=90; without it ggml's
#                                 sources go along and the last call builds it there, which
#                                 costs device minutes). Builds bin/polykv and the
#                                 internal/app test binary (stripped) and packs one gzip'd
#                                 tar, split into bundles .gpu/1, .gpu/2, ... (gitignored)
#                                 of at most 60 MiB (one call carries 64 MiB with the
#                                 repo): first the binaries, lib/ (libggml-cuda,
#                                 libggml-base, libcudart) with llama-server of the same
#                                 pin (make llama-tools; it loads lib/'s backend from its
#                                 own folder), then SmolLM2, then Gemma 3 270M, whose last
#                                 bundles may be left out. Prints the calls to make.
#   scripts/gpu-check.sh stage I  ON THE GPU MACHINE, one call per bundle but the last:
#                                 carry [".gpu/I"]; keeps it in /tmp/polykv-gpu, which lives
#                                 while the machine is warm (30 s idle): make the calls back
#                                 to back. As soon as the binaries, lib/ and SmolLM2 are
#                                 whole it runs a smoke check (the devices, one completion
#                                 with every layer on the GPU), so a broken library shows
#                                 before the long call.
#   scripts/gpu-check.sh run K    ON THE GPU MACHINE, the last call: carry [".gpu/K"]; unpacks
#                                 and runs the checks below, most important first, each
#                                 bounded so the whole stays under DEADLINE seconds (570);
#                                 writes $OUT/summary.txt and $OUT/logs.tgz (every step's
#                                 whole output). timeout_s 590.
#
# The checks (in this order): the card, the driver and --list-devices; the real-model pool
# tests with every layer on the GPU (POLYKV_REQUIRE_GPU=1: -ngl auto must then offload
# all) on SmolLM2 and, when its bundles came, Gemma 3 — create, extend/branch forks,
# attach, pooled == unpooled greedy, eviction to the tier and restore, the prefix cache,
# speculation, determinism under traffic, the batch-shape test that logs max |Δ logprob|;
# the hybrid (qwen35, lfm2) and MTP (qwen35mtp) random-weight models' tests;
# fan-out over HTTP against llama-server (scripts/http-fanout.sh, N = 1, 4, 16, 64) and
# one 2k and one 16k-token prompt through both servers (prefill, one token out); the
# decode benchmark at B = 1..64; fan-out pooled vs unpooled at N up to 64; prefill of 2k
# and 16k tokens (the N = 1 fan-out's TTFT, unpooled); determinism under traffic on Gemma 3.
set -uo pipefail
MODE="${1:?usage: gpu-check.sh pack | stage I | run K}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE=/tmp/polykv-gpu
. "$ROOT/scripts/http.sh" # no curl there, perhaps
SMOL=SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA=gemma-3-270m-q4_k_m.gguf
BUNDLE=60M

# unpack: extract the staged parts of the one archive as far as they go (the binaries and
# lib/ come first, Gemma 3 last), then write which files came whole, by the sizes in the
# manifest.
unpack() {
  local n have i
  n=$(cat "$STAGE/parts")
  have=0
  for i in $(seq "$n"); do [ -f "$STAGE/part.$i" ] && have=$((have + 1)) || break; done
  for i in $(seq "$have"); do cat "$STAGE/part.$i"; done | gzip -dc 2>/dev/null | tar -C "$STAGE" -xf - 2>/dev/null
  : > "$STAGE/whole"
  while read -r size f; do
    [ "$(stat -c %s "$STAGE/$f" 2>/dev/null)" = "$size" ] && echo "$f" >> "$STAGE/whole"
  done < "$STAGE/manifest"
}

# whole FILE...: every one of them came whole.
whole() { local f; for f; do grep -qxF "$f" "$STAGE/whole" || return 1; done; }

# gpu_env: the CUDA libraries ggml-cuda needs that are not carried (cuBLAS, 570 MB) come
# from the machine: python's nvidia/cu13 packages (torch cu130) or a CUDA install.
gpu_env() {
  export POLYKV_LIBRARY_PATH="$STAGE/lib" POLYKV_MODEL="$STAGE/$SMOL"
  local d cu13
  cu13="$(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null | head -1)"
  for d in "$cu13" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -n "$d" ] && [ -e "$d/libcublasLt.so.13" ]; then
      export LD_LIBRARY_PATH="$STAGE/lib:$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      return
    fi
  done
  export LD_LIBRARY_PATH="$STAGE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# smoke: the devices both programs see, and one greedy completion with every layer on the GPU.
smoke() {
  gpu_env
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$STAGE/bin/polykv" serve --list-devices
  (cd "$STAGE/lib" && ./llama-server --list-devices) 2>&1 | tail -5
  "$STAGE/bin/polykv" serve -m "$STAGE/$SMOL" -ngl all --port 18440 > "$STAGE/smoke.log" 2>&1 &
  local pid=$! i
  for i in $(seq 300); do
    http_ok 18440 /health && break
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.1
  done
  echo '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}' > "$STAGE/smoke.json"
  echo "completion: HTTP $(http_post 18440 /v1/completions "$STAGE/smoke.json" "$STAGE/smoke.out")"
  cat "$STAGE/smoke.out"; echo
  kill "$pid" 2> /dev/null; wait "$pid"
  grep -iE 'offload|device|cuda|error|running on' "$STAGE/smoke.log" | head -12
}

case "$MODE" in
pack)
  set -e
  cd "$ROOT"
  MODELS="${POLYKV_CACHE:-$HOME/.cache/polykv}/models"
  for m in "$SMOL" "$GEMMA"; do
    [ -f "$MODELS/$m" ] || { echo "gpu-check: $MODELS/$m missing: make model" >&2; exit 1; }
  done
  eval "$(make -s env)"
  SERVER="$(./scripts/llama.sh tools | tail -1)" # llama-bench, then llama-server
  rm -rf .gpu && mkdir -p .gpu/p/bin .gpu/p/lib
  go build -ldflags='-s -w' -o .gpu/p/bin/polykv ./cmd/polykv
  go test -c -ldflags='-s -w' -o .gpu/p/bin/app.test ./internal/app
  cp "$SERVER" .gpu/p/lib/llama-server
  if [ -f lib/libggml-cuda.so ]; then
    cp -a lib/libggml-cuda.so lib/libggml-base.so* lib/libcudart.so.13 .gpu/p/lib/
  else
    echo "gpu-check: lib/libggml-cuda.so missing: ggml's sources go along and 'run' builds it there" >&2
    mkdir -p .gpu/p/src
    cp -r "$(./scripts/llama.sh src)/ggml/." .gpu/p/src/
  fi
  # Random-weight test models (make testmodels): hybrid (qwen35, lfm2) and MTP
  # (qwen35mtp) layers on CUDA, the llama one as their draft model; 24 MB.
  mkdir -p .gpu/p/testmodels
  for m in qwen35 lfm2 qwen35mtp llama; do
    f="${POLYKV_CACHE:-$HOME/.cache/polykv}/testmodels/$m.gguf"
    [ -f "$f" ] || { echo "gpu-check: $f missing: make testmodels" >&2; exit 1; }
    ln -s "$f" ".gpu/p/testmodels/$m.gguf"
  done
  ln -s "$MODELS/$SMOL" ".gpu/p/$SMOL"
  ln -s "$MODELS/$GEMMA" ".gpu/p/$GEMMA"
  # One archive, in this order: the binaries and lib/ (a partial archive already holds
  # them), SmolLM2, Gemma 3 (its parts may be left out).
  files=(bin/polykv bin/app.test $(cd .gpu/p && find lib $(ls -d src 2>/dev/null) testmodels -type f -o -type l | sort) "$SMOL" "$GEMMA")
  (cd .gpu/p && for f in "${files[@]}"; do echo "$(stat -L -c %s "$f") $f"; done) > .gpu/manifest
  tar -C .gpu/p -chf - "${files[@]}" | gzip -1 | split -b "$BUNDLE" -d -a 1 - .gpu/part.
  rm -rf .gpu/p
  k=0
  for f in .gpu/part.*; do
    k=$((k + 1))
    mkdir -p ".gpu/$k"
    mv "$f" ".gpu/$k/part.$k"
  done
  for i in $(seq "$k"); do echo "$k" > ".gpu/$i/parts"; cp .gpu/manifest ".gpu/$i/"; done
  # The part that completes SmolLM2: a run after it has everything but Gemma 3. Where
  # SmolLM2's bytes end in the tar (its header's block, plus its size) against how much of
  # the tar the first i parts hold.
  smol_end=$(tar -C .gpu -tvRf <(for j in $(seq "$k"); do cat ".gpu/$j/part.$j"; done | gzip -dc) |
    awk -v f="$SMOL" '$NF == f { sub(":", "", $2); print ($2 + 1) * 512 + $5 }')
  smol_part=$k
  for i in $(seq "$k"); do
    got=$(set +o pipefail; for j in $(seq "$i"); do cat ".gpu/$j/part.$j"; done | gzip -dc 2>/dev/null | wc -c)
    if [ "$got" -ge "$smol_end" ]; then smol_part=$i; break; fi
  done
  du -sh .gpu/*/
  for i in $(seq 1 $((k - 1))); do
    echo "call $i: run(carry [\".gpu/$i\"], command \"bash scripts/gpu-check.sh stage $i\", timeout_s 120)"
  done
  echo "call $k: run(carry [\".gpu/$k\"], command \"bash scripts/gpu-check.sh run $k\", timeout_s 590)"
  echo "(everything but Gemma 3 is whole after part $smol_part: 'run $smol_part' there runs without Gemma 3)"
  ;;
stage | run)
  i="${2:?$MODE I}"
  mkdir -p "$STAGE"
  cp "$ROOT/.gpu/$i/part.$i" "$ROOT/.gpu/$i/parts" "$ROOT/.gpu/$i/manifest" "$STAGE/"
  unpack
  # A binary rebuilt after packing (a fix found by the smoke check) travels beside the
  # part, as .gpu/fix/bin/... or .gpu/fix/lib/..., and replaces the packed one.
  [ -d "$ROOT/.gpu/fix" ] && cp -rv "$ROOT/.gpu/fix/." "$STAGE/"
  ls -la "$STAGE" | grep -v total
  if [ "$MODE" = stage ]; then
    if [ "$i" = 1 ]; then # what the machine has, before anything needs it
      nvidia-smi -L
      gpu_env
      echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
      ls -d /usr/local/cuda*/lib64 2> /dev/null
      command -v nvcc curl python3 || true
    fi
    if [ ! -f "$STAGE/smoked" ] && whole bin/polykv lib/llama-server lib/libggml-cuda.so "$SMOL"; then
      touch "$STAGE/smoked"
      smoke
    fi
    exit 0
  fi
  OUT="${OUT:?run on the GPU machine, where OUT is set}"
  whole bin/polykv bin/app.test lib/llama-server "$SMOL" || { echo "gpu-check: the binaries or SmolLM2 are not whole: stage the earlier parts first, back to back" >&2; exit 1; }
  LOGS="$STAGE/logs" SUMMARY="$OUT/summary.txt"
  mkdir -p "$LOGS"
  : > "$SUMMARY"
  DEADLINE=${DEADLINE:-570}
  T=$(nproc)
  step() { # name, seconds, command...: bounded by what is left before DEADLINE
    local name="$1" secs="$2"; shift 2
    local left=$((DEADLINE - SECONDS - 5))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left}s left" | tee -a "$SUMMARY"; return; fi
    [ "$secs" -gt "$left" ] && secs=$left
    local t0=$SECONDS
    timeout "$secs" "$@" > "$LOGS/$name.txt" 2>&1
    echo "== $name: rc $? in $((SECONDS - t0))s (limit ${secs}s)" | tee -a "$SUMMARY"
    grep -E '^(--- |FAIL|ok )|logprob|offload:|device:|diverge|polykv .*x llama|^(llama-server|polykv) +N=|^ *[0-9]+ +[0-9.]+|agents|sessions|TTFT|tok/s' "$LOGS/$name.txt" | head -80 >> "$SUMMARY"
    tail -n 6 "$LOGS/$name.txt" >> "$SUMMARY"
    finish # every step's log is back even if the call is cut short
  }
  finish() { tar -C "$STAGE" -czf "$OUT/logs.tgz" logs; }
  trap finish EXIT
  if [ ! -f "$STAGE/lib/libggml-cuda.so" ] && [ -d "$STAGE/src" ]; then
    # Same settings as scripts/build-gpu.sh, one architecture (the H200's).
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    step build-cuda 420 bash -c "cmake -S '$STAGE/src' -B '$STAGE/build' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=\$ORIGIN' -DGGML_NATIVE=OFF -DGGML_CUDA=ON \
      -DCMAKE_CUDA_COMPILER='$NVCC' -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NO_VMM=ON -DBUILD_SHARED_LIBS=ON \
      -DGGML_BACKEND_DL=ON && cmake --build '$STAGE/build' --target ggml-cuda -j $T && \
      cp -a '$STAGE'/build/bin/libggml-cuda.so '$STAGE'/build/bin/libggml-base.so* '$STAGE/lib/'"
  fi
  gpu_env
  { nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } > "$LOGS/nvidia-smi.txt" 2>&1
  tail -n 2 "$LOGS/nvidia-smi.txt" | tee -a "$SUMMARY"
  "$STAGE/bin/polykv" serve --list-devices 2>&1 | tee "$LOGS/devices.txt" >> "$SUMMARY"
  gemma=()
  if whole "$GEMMA"; then
    gemma=(POLYKV_MODEL_GEMMA="$STAGE/$GEMMA" POLYKV_REQUIRE_MODEL=1)
    echo "Gemma 3: carried" | tee -a "$SUMMARY"
  else
    echo "Gemma 3: not carried (its subtests skip)" | tee -a "$SUMMARY"
  fi
  TESTS='TestGPUOffloadAllLayers|TestGreedySameAloneAndInABatch|TestPooledMatchesUnpooled|TestZeroCopyProofByCapacity|TestAutoPAndTree|TestFromSessionAndReclaim|TestSessionSecondTurnReusesCache|TestPrefixCacheGreedyEqualsCold|TestTierRestoreEqualsPrefill|TestGreedyUnderTraffic|TestConcurrentStreams|TestGemmaSWABranchAfterWindowReuse|TestSpeculativeSameOutput'
  # From the package's folder, as go test runs it (tests read files beside them).
  cd "$ROOT/internal/app"
  step pool-tests 200 env POLYKV_REQUIRE_GPU=1 POLYKV_DET_ROUNDS=3 "${gemma[@]}" "$STAGE/bin/app.test" \
    -test.count=1 -test.v -test.timeout 195s -test.run "$TESTS"
  # Hybrid and MTP layers on CUDA (random-weight models: speculation's rollback of
  # recurrent state, the MTP mirror), each against the same request without speculation.
  step arch-tests 90 env POLYKV_REQUIRE_GPU=1 POLYKV_TESTMODELS="$STAGE/testmodels" "$STAGE/bin/app.test" \
    -test.count=1 -test.v -test.timeout 85s -test.run 'TestArchsPoolsAndTraffic|TestArchsSpeculativeSameOutput|TestArchsDraftModel|TestMTPServed'
  cd "$ROOT"
  step http-fanout 150 env POLYKV="$STAGE/bin/polykv" THREADS="$T" scripts/http-fanout.sh "$STAGE/$SMOL" "$STAGE/lib/llama-server" "1 4 16 64"
  step http-prefill 60 bash -c "for r in 2000 16000; do ROOT=\$r SUFFIX=0 GEN=1 POLYKV='$STAGE/bin/polykv' THREADS=$T \
    scripts/http-fanout.sh '$STAGE/$SMOL' '$STAGE/lib/llama-server' 1; done"
  step bench-decode 90 "$STAGE/bin/polykv" bench -m "$STAGE/$SMOL" -ngl all -t "$T" -c 16384 --workload decode --sessions 1,2,4,8,16,32,64 -n 128 --reps 1
  step bench-fanout 100 "$STAGE/bin/polykv" bench -m "$STAGE/$SMOL" -ngl all -t "$T" --workload fanout --fanout-agents 1,4,16,64
  step bench-prefill-2k 30 "$STAGE/bin/polykv" bench -m "$STAGE/$SMOL" -ngl all -t "$T" --workload fanout --fanout-agents 1 --fanout-root 2000 --fanout-gen 8
  step bench-prefill-16k 45 "$STAGE/bin/polykv" bench -m "$STAGE/$SMOL" -ngl all -t "$T" --workload fanout --fanout-agents 1 --fanout-root 16000 --fanout-gen 8
  if whole "$GEMMA"; then
    cd "$ROOT/internal/app"
    step gemma-traffic 60 env POLYKV_REQUIRE_GPU=1 POLYKV_DET_MODEL=gemma3 POLYKV_DET_ROUNDS=3 "${gemma[@]}" "$STAGE/bin/app.test" \
      -test.count=1 -test.v -test.timeout 55s -test.run 'TestGreedyUnderTraffic'
  fi
  echo "== total ${SECONDS}s" | tee -a "$SUMMARY"
  ;;
*) echo "gpu-check: unknown mode $MODE (pack, stage I, run K)" >&2; exit 2 ;;
esac
