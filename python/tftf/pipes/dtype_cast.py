"""Casting floating-point tensors to another float dtype, in the Rust core's rounding (to
nearest even, once). Integer and bool tensors keep their dtype, as ``tftf run --dtype-cast``
does (upstream casts them too, which silently turns token ids into floats)."""

from __future__ import annotations

from typing import Any, Iterator, List

from tftf import _core, _tensor
from tftf.pipes.base import Pipe, TensorMeta, TensorRecord


def cast_tensor(tensor: Any, dst: str) -> Any:
    """*tensor* (a float tensor) cast to safetensors dtype *dst* by the Rust op."""
    src = _tensor.dtype_of(tensor)
    if src == dst:
        return tensor
    data = bytes(_tensor.raw_bytes(tensor))
    return _tensor.from_buffer(_core.cast(data, src, dst), dst, _tensor.shape_of(tensor))


class DTypeCastPipe(Pipe):
    """Casts every floating-point tensor to *target_dtype*.

    Args:
        target_dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``,
            ``torch.float64``, or a string (``"bf16"``, ``"float16"``, ``"F32"``).
    """

    def __init__(self, target_dtype: Any) -> None:
        self._target = _tensor.st_name(target_dtype)
        if self._target not in _tensor.FLOATS:
            raise ValueError(f"target_dtype must be a float dtype (bf16, f16, f32, f64), not {target_dtype}")
        self.target_dtype = _tensor.to_dtype(self._target)

    def _applies(self, dtype: Any) -> bool:
        return _tensor.st_name(dtype) in _tensor.FLOATS

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        for m in metas:
            if self._applies(m.dtype):
                m = TensorMeta(key=m.key, dtype=self.target_dtype, shape=m.shape, extra=m.extra)
            yield m

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        for r in records:
            if self._applies(r.tensor.dtype):
                r = TensorRecord(key=r.key, tensor=cast_tensor(r.tensor, self._target), extra=r.extra)
            yield r

    def _rust_sections(self) -> List[str]:
        return ["--dtype-cast", f"--dtype={self._target.lower()}"]

    def __repr__(self) -> str:
        return f"DTypeCastPipe({str(self.target_dtype).replace('torch.', '')!r})"
