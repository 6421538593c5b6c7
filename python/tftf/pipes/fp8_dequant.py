"""Dequantising FP8 block-scaled weights and dropping their scales.

``process_meta`` must see the whole metadata stream first (a weight's scale can be anywhere in
it); ``process`` then holds a weight or a scale only until its partner arrives, and fails,
naming the tensor, if one never does (upstream logs a warning and drops the weight).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from tftf import _tensor
from tftf.pipes.base import Pipe, TensorMeta, TensorRecord
from tftf.utils.fp8 import (
    _BLOCK,
    dequantize_fp8_weight,
    is_fp8_dtype,
    is_scale_key,
    scale_inv_key_for,
    scale_key_for,
    weight_key_for_scale,
)

_NOT_SCANNED = object()


class FP8DequantPipe(Pipe):
    """Dequantises FP8 weights with their block scales to *target_dtype* and drops the scales.

    Args:
        target_dtype: ``torch.bfloat16`` (default), ``torch.float16``, ``torch.float32`` or a
            string (``"bf16"``).
        block_size: the scale block's side (128).
        device: accepted for upstream's signature; the Rust core picks CPU or GPU.
    """

    def __init__(self, target_dtype: Any = "bf16", block_size: int = _BLOCK, device: str = "cpu") -> None:
        self._target = _tensor.st_name(target_dtype)
        if self._target not in ("BF16", "F16", "F32"):
            raise ValueError(f"target_dtype must be bfloat16, float16 or float32; got {target_dtype}")
        self.target_dtype = _tensor.to_dtype(self._target)
        self.block_size = block_size
        self.device = device
        self._fp8_weight_keys: Any = _NOT_SCANNED
        self._use_inv_scale: Dict[str, bool] = {}

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        metas = list(metas)
        keys = {m.key for m in metas}
        weights, inverse = set(), {}
        for m in metas:
            if is_scale_key(m.key):
                base = weight_key_for_scale(m.key)
                weights.add(base)
                inverse[base] = m.key.endswith("_scale_inv")
                continue
            has_inv, has_fwd = scale_inv_key_for(m.key) in keys, scale_key_for(m.key) in keys
            if has_inv or has_fwd or is_fp8_dtype(m.dtype):
                weights.add(m.key)
                inverse.setdefault(m.key, has_inv or not has_fwd)
        self._fp8_weight_keys, self._use_inv_scale = weights, inverse
        for m in metas:
            if is_scale_key(m.key):
                continue
            if m.key in weights:
                m = TensorMeta(key=m.key, dtype=self.target_dtype, shape=m.shape, extra=m.extra)
            yield m

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        if self._fp8_weight_keys is _NOT_SCANNED:
            raise RuntimeError("FP8DequantPipe.process() needs process_meta() first: "
                               "list(pipe.process_meta(reader.iter_meta()))")
        return self._stream(records)

    def _stream(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        pending: Dict[str, Dict[str, Any]] = {}
        for r in records:
            if is_scale_key(r.key):
                base, part = weight_key_for_scale(r.key), "scale"
            elif r.key in self._fp8_weight_keys:
                base, part = r.key, "weight"
            else:
                yield r
                continue
            slot = pending.setdefault(base, {})
            slot[part] = r
            if len(slot) == 2:
                del pending[base]
                yield self._dequant(base, slot["weight"], slot["scale"])
        for base, slot in pending.items():
            missing = "its scale" if "weight" in slot else "the weight"
            raise ValueError(f"FP8 weight {base!r}: {missing} never came")

    def _dequant(self, key: str, weight: TensorRecord, scale: TensorRecord) -> TensorRecord:
        try:
            t = dequantize_fp8_weight(weight.tensor, scale.tensor, self._target,
                                      invert_scale=not self._use_inv_scale.get(key, True), block_size=self.block_size)
        except ValueError as e:
            raise RuntimeError(f"FP8DequantPipe: dequantisation failed for {key!r}: {e}") from e
        return TensorRecord(key=key, tensor=t, extra=weight.extra)

    def _rust_sections(self) -> Optional[List[str]]:
        return ["--dequant-fp8", f"--dtype={self._target.lower()}", f"--block-size={self.block_size}x{self.block_size}"]

    def __repr__(self) -> str:
        state = "unscanned" if self._fp8_weight_keys is _NOT_SCANNED else f"{len(self._fp8_weight_keys)} fp8 key(s)"
        return (f"FP8DequantPipe(target_dtype={str(self.target_dtype).replace('torch.', '').lower()!r}, "
                f"block_size={self.block_size}, {state})")
