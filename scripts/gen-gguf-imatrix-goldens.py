#!/usr/bin/env python3
"""Goldens for the --imatrix cases of tests/gguf_quant.rs: `llama-quantize --imatrix` (llama.cpp
0c1e570, the llama-cpp-python 0.3.36 sdist's vendored tree) applied to `convert_hf_to_gguf.py
--outtype f32` of the committed 4-layer Llama (tests/fixtures/gguf_quant/llama).

The importance matrices are synthesised (NumPy, seed 25), not made by llama-imatrix: random
positive sums for every matmul weight the model has (not token_embd), in both formats llama-quantize
reads — `imatrix.gguf` as llama-imatrix writes it (`NAME.in_sum2`, `NAME.counts`, the `imatrix.*`
KVs) and the legacy `imatrix.dat` — with one entry whose count is 0 (weights of 1 / the raw sums).
Both are committed beside the goldens; `imatrix.json` holds, per case (mix, file, extra options),
every KV and tensor of llama-quantize's output as e2e.json does. llama-quantize runs in the
folder of the imatrix and is given its bare file name, so `quantize.imatrix.file` is that name.

Usage: gen-gguf-imatrix-goldens.py LLAMA_CPP_DIR LLAMA_QUANTIZE WORK_DIR"""
import json, os, shutil, struct, subprocess, sys
import numpy as np

LCP, LQ, WORK = sys.argv[1:4]
sys.path.insert(0, os.path.join(LCP, "gguf-py"))
import gguf  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from llamacpp_goldens import converter, record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "tests", "fixtures", "gguf_quant")
TOK = os.path.join(HERE, "..", "tests", "fixtures", "gguf", "tokenizer")
REF = converter(LCP)
CASES = [(m, f, []) for m in ("q4_0", "q4_1", "q5_0", "q5_1") for f in ("imatrix.gguf", "imatrix.dat")] + [
    ("q4_0", "imatrix.gguf", ["--include-weights", "attn", "--include-weights", "output"]),
    ("q5_1", "imatrix.dat", ["--exclude-weights", "ffn_"]),
    # The k-quant cases (q4_k_m, q6_k … with 256-wide rows) go here once their encoders land.
]


def main():
    os.makedirs(WORK, exist_ok=True)
    d = os.path.join(WORK, "llama")
    shutil.copytree(os.path.join(FIX, "llama"), d, dirs_exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOK, f), d)
    ref = os.path.join(WORK, "ref.f32.gguf")
    subprocess.run([sys.executable, "-c", REF, d, "--outfile", ref, "--outtype", "f32"], check=True, capture_output=True)
    rng = np.random.default_rng(25)
    entries = []  # (name, sums, count)
    for t in GGUFReader(ref).tensors:
        if len(t.shape) >= 2 and t.name != "token_embd.weight":
            cols = int(t.shape[0])
            entries.append((t.name, (rng.random(cols) * 40 + 0.01).astype(np.float32), int(rng.integers(1, 9))))
    entries[1] = (entries[1][0], entries[1][1], 0)
    w = gguf.GGUFWriter(os.path.join(FIX, "imatrix.gguf"), arch=None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["tiny.txt"])
    w.add_uint32("imatrix.chunk_count", 5)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, sums, count in entries:
        w.add_tensor(name + ".in_sum2", sums.reshape(1, -1))
        w.add_tensor(name + ".counts", np.array([[count]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dat = struct.pack("<i", len(entries))
    for name, sums, count in entries:
        dat += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", count, len(sums)) + sums.tobytes()
    dat += struct.pack("<ii", 7, len("legacy.txt")) + b"legacy.txt"
    open(os.path.join(FIX, "imatrix.dat"), "wb").write(dat)
    cases = []
    for mix, f, args in CASES:
        shutil.copy(os.path.join(FIX, f), os.path.join(WORK, f))
        out = os.path.join(WORK, "out.gguf")
        r = subprocess.run([LQ, "--imatrix", f] + args + [ref, out, mix.upper()], cwd=WORK, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"llama-quantize {mix} {f} {args}: {r.stderr[-400:]}")
        cases.append(dict(record(out), mix=mix, imatrix=f, args=args))
    json.dump(cases, open(os.path.join(FIX, "imatrix.json"), "w"), indent=0)
    print("wrote", FIX)


main()
