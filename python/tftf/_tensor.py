"""Tensors without a hard torch dependency.

Records carry torch tensors when torch is installed and numpy arrays otherwise. This module is
the one place that knows both: dtype names (safetensors spelling, torch dtypes, strings such as
``"bf16"`` or ``"torch.float16"``), wrapping a buffer read by the Rust core without a copy, and
the raw bytes a writer stores.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # torch is optional: the API works with numpy alone.
    import torch
except ImportError:  # pragma: no cover - exercised by the numpy-only test run
    torch = None

HAVE_TORCH = torch is not None

# safetensors name → (bytes per element, numpy dtype used to hold it without torch). numpy has
# no BF16 or FP8: their codes are held as uint16/uint8 whose dtype carries the real name in its
# metadata (kept by views and reshapes; arithmetic on the codes drops it, as it should).
_ST = {
    "F64": (8, np.float64),
    "F32": (4, np.float32),
    "F16": (2, np.float16),
    "BF16": (2, np.dtype(np.uint16, metadata={"st": "BF16"})),
    "I64": (8, np.int64),
    "I32": (4, np.int32),
    "U32": (4, np.uint32),
    "I16": (2, np.int16),
    "U16": (2, np.uint16),
    "I8": (1, np.int8),
    "U8": (1, np.uint8),
    "BOOL": (1, np.bool_),
    "F8_E4M3": (1, np.dtype(np.uint8, metadata={"st": "F8_E4M3"})),
    "F8_E5M2": (1, np.dtype(np.uint8, metadata={"st": "F8_E5M2"})),
    "F8_E8M0": (1, np.dtype(np.uint8, metadata={"st": "F8_E8M0"})),
}

_ALIASES = {
    "float64": "F64", "double": "F64", "fp64": "F64", "f64": "F64",
    "float32": "F32", "float": "F32", "fp32": "F32", "f32": "F32",
    "float16": "F16", "half": "F16", "fp16": "F16", "f16": "F16",
    "bfloat16": "BF16", "bf16": "BF16",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "uint32": "U32",
    "int16": "I16", "short": "I16", "uint16": "U16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "f8_e4m3": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "fp8_e5m2": "F8_E5M2", "f8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0", "f8_e8m0": "F8_E8M0",
}

FLOATS = ("F64", "F32", "F16", "BF16")


def st_name(dtype: Any) -> str:
    """The safetensors name (``"BF16"``) of a torch dtype, numpy dtype or dtype string.

    Raises ``ValueError`` naming the dtype when it has no safetensors spelling.
    """
    if isinstance(dtype, str):
        s = dtype.strip()
        if s.upper() in _ST:
            return s.upper()
        key = s.lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
        raise ValueError(f"unknown dtype {dtype!r} (bf16, f16, f32, f64, or a torch dtype)")
    if HAVE_TORCH and isinstance(dtype, torch.dtype):
        return st_name(str(dtype))
    metadata = getattr(dtype, "metadata", None)
    if metadata and "st" in metadata:
        return metadata["st"]
    try:
        return st_name(np.dtype(dtype).name)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def to_dtype(name: str) -> Any:
    """The dtype records use for safetensors name *name*: a torch dtype with torch, else the
    name itself (numpy has no bfloat16 or FP8)."""
    if not HAVE_TORCH:
        return name
    attr = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16",
        "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    }[name]
    if not hasattr(torch, attr):
        raise ValueError(f"this torch has no {attr}")
    return getattr(torch, attr)


def itemsize(name: str) -> int:
    """Bytes per element of safetensors dtype *name*."""
    return _ST[name][0]


def nbytes(dtype: Any, shape) -> int:
    """Bytes of a tensor of *dtype* and *shape*."""
    n = itemsize(st_name(dtype))
    for d in shape:
        n *= int(d)
    return n


def make_shape(dims):
    """A shape as records use it: ``torch.Size`` with torch, else a tuple."""
    dims = tuple(int(d) for d in dims)
    return torch.Size(dims) if HAVE_TORCH else dims


def from_buffer(buf: bytearray, name: str, shape) -> Any:
    """A tensor of safetensors dtype *name* and *shape* viewing *buf* (no copy)."""
    shape = tuple(int(d) for d in shape)
    if HAVE_TORCH:
        if len(buf) == 0:
            return torch.empty(shape, dtype=to_dtype(name))
        return torch.frombuffer(buf, dtype=to_dtype(name)).reshape(shape)
    return np.frombuffer(buf, dtype=_ST[name][1]).reshape(shape)


def dtype_of(tensor: Any) -> str:
    """The safetensors name of *tensor*'s dtype."""
    return st_name(tensor.dtype)


def raw_bytes(tensor: Any) -> memoryview:
    """*tensor*'s bytes in C order, little-endian, as a writer stores them (one copy at most)."""
    if HAVE_TORCH and isinstance(tensor, torch.Tensor):
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.view(torch.uint8).reshape(-1).numpy())
    a = np.ascontiguousarray(tensor)
    return memoryview(a.reshape(-1).view(np.uint8))


def shape_of(tensor: Any) -> tuple:
    """*tensor*'s shape as a tuple of ints."""
    return tuple(int(d) for d in tensor.shape)


def to_f32(tensor: Any) -> np.ndarray:
    """*tensor*'s values as a float32 numpy array (BF16 and FP8 codes decoded by the Rust core)."""
    if HAVE_TORCH and isinstance(tensor, torch.Tensor):
        return tensor.detach().to(torch.float32).cpu().numpy()
    name = dtype_of(tensor)
    if name in ("F32", "F64", "F16"):
        return np.asarray(tensor, dtype=np.float32)
    from tftf import _core

    return np.frombuffer(_core.cast(bytes(raw_bytes(tensor)), name, "F32"), np.float32).reshape(shape_of(tensor))
