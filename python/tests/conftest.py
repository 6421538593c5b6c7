"""Helpers for the package's tests: small safetensors files written byte by byte (so the tests
do not depend on the code they test to make their inputs)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
          np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32"}


def write_safetensors(path: Path, tensors: dict, dtypes: dict = None, metadata: dict = None) -> Path:
    """Writes numpy arrays as a safetensors file; ``dtypes`` overrides a tensor's dtype name
    (``{"w": "F8_E4M3"}`` for uint8 bytes holding FP8)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        data = array.tobytes()
        header[name] = {"dtype": (dtypes or {}).get(name, _NAMES[array.dtype]), "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def read_safetensors(path: Path) -> dict:
    """``{name: (dtype name, shape, bytes)}`` of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]: v["data_offsets"][1]]) for k, v in header.items()}


@pytest.fixture
def model(tmp_path) -> Path:
    """A three-tensor F32 model with an int tensor."""
    rng = np.random.default_rng(7)
    return write_safetensors(tmp_path / "in" / "model.safetensors", {
        "model.layers.0.q_proj.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.k_proj.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.position_ids": np.arange(8, dtype=np.int64),
    })


@pytest.fixture
def boom():
    """``boom(k)``: a user pipe that passes records on and raises ``KeyError("boom at KEY")``
    at record ``k`` (0-based)."""
    from tftf import Pipe

    class Boom(Pipe):
        def __init__(self, at):
            super().__init__()
            self.at = at

        def process(self, records):
            for i, r in enumerate(records):
                if i == self.at:
                    raise KeyError(f"boom at {r.key}")
                yield r

    return Boom
