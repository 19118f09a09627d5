#!/usr/bin/env python3
"""Write a layer-truncated copy of a GGUF model: a cheap draft model of the same
vocabulary for --model-draft (issue 23's benchmark). Keeps the blocks listed with
--keep (renumbered from 0), the embeddings, the output norm and head, and every
metadata key, with <arch>.block_count set to the blocks kept. Tensors are copied as
they are (quantized data untouched). Uses gguf-py from the pinned llama.cpp source:

  PYTHONPATH=~/.cache/polykv/llama.cpp/src-11434.0.0/llama.cpp/gguf-py \\
    python3 scripts/truncate-gguf.py IN.gguf OUT.gguf --keep 0-7,29

The output goes to the cache (~/.cache/polykv/draftmodels), never into the repository.
"""
import argparse
import re

import gguf


def parse_keep(spec, n):
    keep = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            keep += range(int(a), int(b) + 1)
        else:
            keep.append(int(part))
    if any(k < 0 or k >= n for k in keep) or len(set(keep)) != len(keep):
        raise SystemExit(f"--keep {spec}: blocks must be distinct, in 0..{n - 1}")
    return sorted(keep)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--keep", required=True, help="blocks to keep, e.g. 0-7,29")
    args = ap.parse_args()
    r = gguf.GGUFReader(args.src)
    arch = r.fields["general.architecture"].contents()
    n = r.fields[f"{arch}.block_count"].contents()
    keep = parse_keep(args.keep, n)
    renum = {old: new for new, old in enumerate(keep)}
    w = gguf.GGUFWriter(args.dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            w.add_uint32(name, len(keep))
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), vt)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        name = t.name
        if m:
            b = int(m.group(1))
            if b not in renum:
                continue
            name = f"blk.{renum[b]}.{m.group(2)}"
        w.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.dst}: {arch}, blocks {keep} of {n}")


if __name__ == "__main__":
    main()
