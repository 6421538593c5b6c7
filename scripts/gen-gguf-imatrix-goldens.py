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

The 1- and 2-bit mixes need whole 256-blocks, so their cases (`imatrix_iq.json`, same record)
use the 2-layer llama256 model of e2e_k.json (made by gen-gguf-quant-goldens.py's `k_goldens`,
run with ONLY_K=1 into WORK_DIR) and `imatrix256.gguf`, synthesised the same way (seed 26). They
hold every IQ1/IQ2 mix with it, an IQ2_XXS output tensor with it, and the output/token_embd
exemption without one (IQ2_S and IQ1_M there, which ggml encodes without weights); and
`refusals`: the runs llama-quantize refuses (no imatrix, an imatrix without the tensor's entry)
or aborts on (an IQ2_XXS token_embd without weights: ggml asserts them), with the tensor its
message names.

Usage: gen-gguf-imatrix-goldens.py LLAMA_CPP_DIR LLAMA_QUANTIZE WORK_DIR"""
import json, os, re, shutil, struct, subprocess, sys
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


# (mix, imatrix or None, extra options) on llama256.
IQ_CASES = [(m, "imatrix256.gguf", []) for m in ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")] + [
    ("q4_k_m", "imatrix256.gguf", ["--output-tensor-type", "iq2_xxs"]),
    ("q4_k_m", None, ["--output-tensor-type", "iq2_s", "--token-embedding-type", "iq1_m"]),
]

# (mix, imatrix or None, extra options) that llama-quantize refuses on llama256.
IQ_REFUSALS = [(m, None, []) for m in ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")] + [
    ("iq2_xxs", "imatrix256.gguf", ["--exclude-weights", "attn_k"]),
    ("q4_k_m", None, ["--token-embedding-type", "iq2_xxs"]),
]
REFUSED = re.compile(r"offending tensor: (\S+)|Missing importance matrix for tensor (\S+)|GGML_ASSERT\((imatrix != NULL)\)")


def write_imatrix(path, entries, dataset):
    w = gguf.GGUFWriter(path, arch=None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [dataset])
    w.add_uint32("imatrix.chunk_count", 5)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, sums, count in entries:
        w.add_tensor(name + ".in_sum2", sums.reshape(1, -1))
        w.add_tensor(name + ".counts", np.array([[count]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def synth_entries(ref, rng):
    """Random positive sums and counts for every matmul weight of `ref` (not token_embd)."""
    entries = []
    for t in GGUFReader(ref).tensors:
        if len(t.shape) >= 2 and t.name != "token_embd.weight":
            cols = int(t.shape[0])
            entries.append((t.name, (rng.random(cols) * 40 + 0.01).astype(np.float32), int(rng.integers(1, 9))))
    return entries


def iq_goldens():
    kwork = os.path.join(WORK, "k")
    subprocess.run([sys.executable, os.path.join(HERE, "gen-gguf-quant-goldens.py"), LCP, LQ, os.path.join(kwork, "out"), kwork],
                   check=True, capture_output=True, env=dict(os.environ, ONLY_K="1"))
    ref = os.path.join(kwork, "llama256.f32.gguf")
    write_imatrix(os.path.join(FIX, "imatrix256.gguf"), synth_entries(ref, np.random.default_rng(26)), "tiny256.txt")
    cases = []
    for mix, f, args in IQ_CASES:
        im = []
        if f:
            shutil.copy(os.path.join(FIX, f), os.path.join(WORK, f))
            im = ["--imatrix", f]
        out = os.path.join(WORK, "out.gguf")
        r = subprocess.run([LQ] + im + args + [ref, out, mix.upper()], cwd=WORK, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"llama-quantize {mix} {f} {args}: {r.stderr[-400:]}")
        cases.append(dict(record(out), mix=mix, imatrix=f, args=args))
    refusals = []
    for mix, f, args in IQ_REFUSALS:
        im = ["--imatrix", f] if f else []
        r = subprocess.run([LQ] + im + args + [ref, os.path.join(WORK, "no.gguf"), mix.upper()], cwd=WORK,
                           capture_output=True, text=True)
        m = REFUSED.search(r.stdout + r.stderr)
        if r.returncode == 0 or not m:
            raise SystemExit(f"llama-quantize {mix} {f} {args} did not refuse: {r.stderr[-400:]}")
        refusals.append(dict(mix=mix, imatrix=f, args=args, message=m.group(0), tensor=m.group(1) or m.group(2)))
    json.dump({"cases": cases, "refusals": refusals}, open(os.path.join(FIX, "imatrix_iq.json"), "w"), indent=0)


def main():
    os.makedirs(WORK, exist_ok=True)
    iq_goldens()
    if os.environ.get("ONLY_IQ"):
        return
    d = os.path.join(WORK, "llama")
    shutil.copytree(os.path.join(FIX, "llama"), d, dirs_exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOK, f), d)
    ref = os.path.join(WORK, "ref.f32.gguf")
    subprocess.run([sys.executable, "-c", REF, d, "--outfile", ref, "--outtype", "f32"], check=True, capture_output=True)
    entries = synth_entries(ref, np.random.default_rng(25))  # (name, sums, count)
    entries[1] = (entries[1][0], entries[1][1], 0)
    write_imatrix(os.path.join(FIX, "imatrix.gguf"), entries, "tiny.txt")
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
