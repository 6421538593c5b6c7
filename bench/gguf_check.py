#!/usr/bin/env python3
"""Reads a `tftf gguf` output with gguf-py (`pip install gguf`) and checks it against the
safetensors checkpoint it came from: the file loads (gguf-py validates offsets and alignment),
every tensor's byte size matches its type and shape, and tensors kept in their source type
without a transform have the source bytes. With a second GGUF (the reference converter's
output), compares KVs (all but the folder-derived naming fields and `tftf.*`) and every tensor's name, type,
shape and bytes. Usage: gguf_check.py MODEL_DIR OURS.gguf [REFERENCE.gguf]"""
import json, os, struct, sys
import numpy as np
from gguf import GGUFReader

model, ours = sys.argv[1], sys.argv[2]
ref = sys.argv[3] if len(sys.argv) > 3 else None


def tensors(path):
    r = GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def source_bytes(model):
    idx = os.path.join(model, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    out = {}
    for f in files:
        p = os.path.join(model, f)
        with open(p, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        for k, v in h.items():
            if k != "__metadata__":
                out[k] = (p, 8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0], v["dtype"])
    return out


r, ts = tensors(ours)
src = source_bytes(model)
arch = r.fields["general.architecture"].contents()
print(f"{ours}: {arch}, {len(r.fields)} KVs, {len(ts)} tensors")
direct = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
for l in range(4096):
    for g, h in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                 ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
        direct[f"blk.{l}.{g}.weight"] = f"model.layers.{l}.{h}.weight"
checked = 0
for name, t in ts.items():
    data = np.asarray(t.data).tobytes()
    assert len(data) == t.n_bytes, name
    hf = direct.get(name)
    if hf in src and t.tensor_type.name == src[hf][3]:
        p, off, n, _ = src[hf]
        with open(p, "rb") as fh:
            fh.seek(off)
            assert fh.read(n) == data, f"{name} differs from {hf}"
        checked += 1
print(f"gguf-py read every tensor; {checked} unchanged tensors equal their source bytes")

if ref:
    rr, rts = tensors(ref)
    naming = ("general.name", "general.basename", "general.finetune", "general.version", "general.quantized_by")
    skip = lambda k: k in naming or k.startswith("tftf.")
    kv = lambda rd: {k: (f.types, [bytes(f.parts[i]) for i in f.data]) for k, f in rd.fields.items()
                     if not skip(k) and not k.startswith("GGUF.")}
    a, b = kv(r), kv(rr)
    assert a.keys() == b.keys(), f"KV keys differ: ours only {sorted(a.keys() - b.keys())}, reference only {sorted(b.keys() - a.keys())}"
    bad = [k for k in a if a[k] != b[k]]
    assert not bad, f"KVs differ: {bad}"
    assert ts.keys() == rts.keys(), f"tensor names differ: {sorted(ts.keys() ^ rts.keys())}"
    for name, t in ts.items():
        u = rts[name]
        assert (t.tensor_type, list(t.shape)) == (u.tensor_type, list(u.shape)), name
        assert np.asarray(t.data).tobytes() == np.asarray(u.data).tobytes(), f"{name}: bytes differ"
    print(f"same {len(a)} KVs and {len(ts)} tensors (names, types, shapes, bytes) as {ref}")
