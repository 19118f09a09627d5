#!/usr/bin/env bash
# Fetch llama.cpp's real chat templates (models/templates/*.jinja) for the template corpus
# test. They come from the pinned PyPI sdist of llama-cpp-python, which vendors llama.cpp,
# checked by sha256, and are unpacked into the cache outside the repo: nothing is
# committed. No-op when present.
set -euo pipefail
CACHE="${POLYKV_CACHE:-$HOME/.cache/polykv}"
VER=0.3.36
SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DIR="$CACHE/templates/llama-cpp-python-$VER"
if [ -f "$DIR/.complete" ]; then
  echo "templates present: $DIR"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VER" -d "$tmp"
sdist="$tmp/llama_cpp_python-$VER.tar.gz"
if ! echo "$SHA  $sdist" | sha256sum -c --status; then
  echo "sha256 mismatch for $sdist" >&2
  exit 1
fi
rm -rf "$DIR.part"
mkdir -p "$DIR.part"
python3 - "$sdist" "$DIR.part" <<'PY'
import os, sys, tarfile
prefix = "vendor/llama.cpp/models/templates/"
n = 0
with tarfile.open(sys.argv[1]) as tf:
    for m in tf:
        parts = m.name.split("/", 1)
        if len(parts) == 2 and parts[1].startswith(prefix) and m.name.endswith(".jinja") and m.isfile():
            name = os.path.basename(m.name)
            with tf.extractfile(m) as src, open(os.path.join(sys.argv[2], name), "wb") as dst:
                dst.write(src.read())
            n += 1
if n == 0:
    sys.exit("no templates found in the sdist")
print(f"{n} templates")
PY
touch "$DIR.part/.complete"
rm -rf "$DIR"
mv "$DIR.part" "$DIR"
echo "templates fetched: $DIR"
