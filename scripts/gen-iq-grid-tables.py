#!/usr/bin/env python3
"""Writes src/ops/gguf/kquants/grids/*.txt: the lattice grids ggml's IQ1/IQ2/IQ3 encoders
quantise groups of 8 (IQ1/IQ2) or 4 (IQ3) to — `kgrid_2bit_256`, `kgrid_2bit_512`,
`kgrid_2bit_1024`, `kgrid_1bit_2048` of `iq2xs_init_impl` and `kgrid_256`, `kgrid_512` of
`iq3xs_init_impl` — read from llama.cpp 0c1e570's ggml/src/ggml-quants.c. The grids are data
(src/ops/gguf/kquants/grids.rs parses them at compile time); the neighbour maps are not
tabled: `iq2_grid.rs` and `iq3.rs` derive them from these as ggml does.

Usage: gen-iq-grid-tables.py LLAMA_CPP_DIR  (the standard library only)"""
import os
import re
import sys

NAMES = ["kgrid_2bit_256", "kgrid_2bit_512", "kgrid_2bit_1024", "kgrid_1bit_2048", "kgrid_256", "kgrid_512"]


def table(src, cname):
    m = re.search(r"static const uint16_t %s\[[^\]]*\] = \{(.*?)\};" % cname, src, re.S)
    if not m:
        sys.exit("%s not found" % cname)
    return [int(v) for v in m.group(1).replace("\n", " ").split(",") if v.strip()]


def main():
    src = open(os.path.join(sys.argv[1], "ggml/src/ggml-quants.c")).read()
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src/ops/gguf/kquants/grids")
    for cname in NAMES:
        vals = table(src, cname)
        n = int(cname.rsplit("_", 1)[1])
        assert len(vals) == n and vals == sorted(set(vals)), cname
        dst = os.path.normpath(os.path.join(out_dir, cname + ".txt"))
        with open(dst, "w") as f:
            for i in range(0, n, 16):
                f.write(", ".join(str(v) for v in vals[i : i + 16]) + "\n")
        print(dst)


if __name__ == "__main__":
    main()
