"""What the gen-gguf-*-goldens scripts share: llama.cpp's converter run as the reference; the
record of a GGUF file that tests/gguf_quant.rs compares against (the sha256 of every KV's type and
value bytes, in file order, the converter's naming fields left out; every tensor's name, type id,
ggml shape and the sha256 of its bytes); and `det_bf16`, weights the tests remake rather than read
from a committed file.

Import it after putting llama.cpp's gguf-py on sys.path (the scripts do, from LLAMA_CPP_DIR)."""
import hashlib
import os

import numpy as np

NAMING = ("general.name", "general.basename", "general.finetune", "general.version", "general.quantized_by")


def converter(lcp):
    """`python -c` source running `convert_hf_to_gguf.py` of the llama.cpp tree `lcp`, with the
    pre-tokenizer named "test-pre" (the test tokenizer is none llama.cpp knows)."""
    return f"""
import sys
sys.path[:0] = [{lcp!r}, {os.path.join(lcp, 'gguf-py')!r}]
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "test-pre"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()
"""


def sha(b):
    return hashlib.sha256(b).hexdigest()


def record(path):
    from gguf import GGUFReader

    r = GGUFReader(path)
    kvs = [[k, sha(b"".join(bytes(p) for p in f.parts[2:]))] for k, f in r.fields.items()
           if not k.startswith("GGUF.") and k not in NAMING]
    ts = [[t.name, int(t.tensor_type), [int(x) for x in t.shape], sha(np.asarray(t.data).tobytes())] for t in r.tensors]
    return {"kvs": kvs, "tensors": ts}


def fnv1a(name):
    h = 0x811C9DC5
    for c in name.encode():
        h = ((h ^ c) * 0x01000193) & 0xFFFFFFFF
    return h


def det_bf16(name, n, offset=0.0):
    """Deterministic BF16 weights, as tests/common/gguf.rs's `det_bf16` makes them: BF16 bits of
    element i: a 32-bit hash of (i, the name's FNV-1a), its low 24 bits as a uniform value in
    [-0.1, 0.1) (+ offset) in f32, truncated to BF16 (a torch tensor)."""
    i = np.arange(n, dtype=np.uint64)
    u = (i * np.uint64(0x9E3779B1) + np.uint64(fnv1a(name)) * np.uint64(0x85EBCA77)) & np.uint64(0xFFFFFFFF)
    u ^= u >> np.uint64(15)
    u = (u * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    u ^= u >> np.uint64(12)
    x = ((u & np.uint64(0xFFFFFF)).astype(np.float32) / np.float32(16777216.0) - np.float32(0.5)) * np.float32(0.2)
    x = x + np.float32(offset)
    bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
