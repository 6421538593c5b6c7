"""Readers: a checkpoint as a stream of :class:`TensorMeta` (headers only) and of
:class:`TensorRecord` (one tensor read at a time by the Rust core).

:class:`SafetensorsReader` reads whatever ``tftf`` reads at *path*: a ``.safetensors`` file,
a directory of shards, PyTorch ``.bin`` files or a DCP checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Union

from tftf import _core, _tensor
from tftf.pipes.base import TensorMeta, TensorRecord


class SafetensorsReader:
    """A checkpoint read lazily: headers when asked for metadata, one tensor's bytes per
    record (the record's tensor views the buffer the Rust reader filled; no second copy).

    Args:
        path: the checkpoint (a ``.safetensors`` file, or anything ``tftf`` reads).
        device: where records' tensors go (``"cpu"``; a torch device with torch).
    """

    def __init__(self, path: Union[str, Path], device: str = "cpu") -> None:
        self.path = Path(path)
        self.device = device
        self._ckpt: Optional[_core.Checkpoint] = None

    def _checkpoint(self) -> "_core.Checkpoint":
        if self._ckpt is None:
            self._ckpt = _core.Checkpoint(str(self.path))
        return self._ckpt

    def keys(self) -> List[str]:
        """Tensor names in file order."""
        return [name for name, _, _ in self._checkpoint().tensors()]

    def metadata(self) -> Dict[str, str]:
        """The header's ``__metadata__`` (empty when there is none)."""
        raw = self._checkpoint().metadata_json()
        return {str(k): str(v) for k, v in json.loads(raw).items()} if raw else {}

    def num_tensors(self) -> int:
        return len(self._checkpoint().tensors())

    def iter_meta(self) -> Iterator[TensorMeta]:
        """Every tensor's name, dtype and shape, from the headers alone."""
        for name, dtype, shape in self._checkpoint().tensors():
            yield TensorMeta(key=name, dtype=_tensor.to_dtype(dtype), shape=_tensor.make_shape(shape))

    def iter_records(self) -> Iterator[TensorRecord]:
        """Every tensor with its data, one at a time, in file order."""
        yield from self._records(self._checkpoint(), None)

    def _records(self, ckpt: "_core.Checkpoint", keys: Optional[List[str]]) -> Iterator[TensorRecord]:
        infos = {name: (dtype, shape) for name, dtype, shape in ckpt.tensors()}
        for name in keys if keys is not None else list(infos):
            if name not in infos:
                raise KeyError(f"tensor {name!r} is not in {self.path}")
            dtype, shape = infos[name]
            tensor = _tensor.from_buffer(ckpt.read(name), dtype, shape)
            if self.device != "cpu" and _tensor.HAVE_TORCH:
                tensor = tensor.to(self.device)
            yield TensorRecord(key=name, tensor=tensor)
            del tensor

    def _rust_input(self) -> Optional[Path]:
        """The path a Rust job reads for this reader (``None``: only Python can)."""
        return self.path if self.device == "cpu" else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"
