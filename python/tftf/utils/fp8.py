"""FP8 block-scaled weights (DeepSeek-V3 style): key naming and dequantisation.

A weight ``X.weight`` of dtype ``float8_e4m3fn`` (or ``e5m2``) comes with a float scale per
128×128 block, ``X.weight_scale_inv`` (multiply) or ``X.weight_scale`` (divide, the old
convention). Dequantising computes ``w * s`` in f32 and rounds once to the target dtype, in
the Rust core (the same arithmetic as ``tftf dequant``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tftf import _core, _tensor
from tftf._tensor import torch

_FP8_DTYPES: set = set()
if torch is not None:
    for _name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"):
        if hasattr(torch, _name):
            _FP8_DTYPES.add(getattr(torch, _name))
_FP8_DTYPES.update({"F8_E4M3", "F8_E5M2"})

#: Whether this torch has FP8 dtypes.
HAS_FP8 = torch is not None and hasattr(torch, "float8_e4m3fn")

_BLOCK = 128
_INV, _FWD = "weight_scale_inv", "weight_scale"


def is_fp8_dtype(dtype: Any) -> bool:
    """Whether *dtype* is an FP8 dtype (a torch dtype, a safetensors name, or the numpy holder
    of FP8 codes)."""
    if dtype in _FP8_DTYPES:
        return True
    metadata = getattr(dtype, "metadata", None)
    return bool(metadata) and metadata.get("st") in _FP8_DTYPES


def is_scale_key(key: str) -> bool:
    """Whether *key* names an FP8 scale (``….weight_scale_inv`` or ``….weight_scale``; not
    ``rope_scale`` or a layernorm)."""
    return key.endswith("." + _INV) or key.endswith("." + _FWD) or key in (_INV, _FWD)


def weight_key_for_scale(scale_key: str) -> str:
    """``a.weight_scale_inv`` → ``a.weight``. Raises ``ValueError`` for other keys."""
    for suffix in (_INV, _FWD):
        if scale_key == suffix or scale_key.endswith("." + suffix):
            return scale_key[: -len(suffix)] + "weight"
    raise ValueError(f"Not a recognised scale key: {scale_key!r}")


def scale_inv_key_for(weight_key: str) -> str:
    """``a.weight`` → ``a.weight_scale_inv``."""
    return weight_key + "_scale_inv" if weight_key.endswith(".weight") else weight_key + "." + _INV


def scale_key_for(weight_key: str) -> str:
    """``a.weight`` → ``a.weight_scale``."""
    return weight_key + "_scale" if weight_key.endswith(".weight") else weight_key + "." + _FWD


def dequantize_fp8_weight(weight: Any, scale: Any, target_dtype: Any = "bf16",
                          invert_scale: bool = False, block_size: int = _BLOCK) -> Any:
    """Dequantises a 2-D FP8 *weight* with its ``(⌈rows/B⌉, ⌈cols/B⌉)`` block *scale* (a
    transposed scale is accepted) into *target_dtype*; ``invert_scale`` divides instead.

    Raises ``ValueError`` for a weight that is not 2-D or not FP8, or a scale of another shape.
    """
    shape = _tensor.shape_of(weight)
    if len(shape) != 2:
        raise ValueError(f"FP8 dequantisation expects a 2-D weight; got shape {list(shape)}")
    if not is_fp8_dtype(weight.dtype):
        raise ValueError(f"Expected an FP8 dtype; got {weight.dtype}")
    target = _tensor.st_name(target_dtype)
    if target not in ("BF16", "F16", "F32"):
        raise ValueError(f"FP8 weights dequantise to bf16, f16 or f32, not {target_dtype}")
    rows, cols = shape
    grid = (-(-rows // block_size), -(-cols // block_size))
    s = _tensor.to_f32(scale)
    if s.shape != grid:
        if s.shape == grid[::-1]:
            s = s.T
        else:
            raise ValueError(f"Scale shape {list(s.shape)} is inconsistent with weight shape {list(shape)} "
                             f"and block_size={block_size}; expected {list(grid)}")
    if invert_scale:
        s = np.float32(1.0) / s
    fmt = _tensor.dtype_of(weight)
    if fmt in ("F8_E4M3", "F8_E5M2"):
        data = bytes(_tensor.raw_bytes(weight))
        out = _core.dequant_fp8(data, fmt, rows, cols, np.ascontiguousarray(s, np.float32).reshape(-1).tolist(),
                                grid[1], (block_size, block_size), target)
        return _tensor.from_buffer(out, target, shape)
    # A float weight standing in for FP8 (a torch without FP8 dtypes): the same math in numpy.
    w = _tensor.to_f32(weight)
    full = np.repeat(np.repeat(s, block_size, 0), block_size, 1)[:rows, :cols]
    vals = np.ascontiguousarray(w * full, np.float32)
    return _tensor.from_buffer(_core.cast(vals.tobytes(), "F32", target) if target != "F32" else bytearray(vals.tobytes()), target, shape)
