"""What the gen-gguf-*-goldens scripts share: llama.cpp's converter run as the reference, and the
record of a GGUF file that tests/gguf_quant.rs compares against (the sha256 of every KV's type and
value bytes, in file order, the converter's naming fields left out; every tensor's name, type id,
ggml shape and the sha256 of its bytes).

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
