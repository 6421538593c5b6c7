"""A sharded model (``model.safetensors.index.json`` and its shards) as one reader.

Tensors come in the index's ``weight_map`` order, grouped by shard so each shard is opened
once. :meth:`ShardedSafetensorsReader.from_path` picks the reader for a directory, an index or
a single file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, List, Union

from tftf import _core
from tftf.io.reader import SafetensorsReader
from tftf.pipes.base import TensorMeta, TensorRecord

INDEX_NAMES = (
    "model.safetensors.index.json",
    "model.fp16.safetensors.index.json",
    "model.bf16.safetensors.index.json",
)


class ShardedSafetensorsReader(SafetensorsReader):
    """Reader over the shards an index names.

    Args:
        index_path: the ``*.safetensors.index.json`` file.
        device: where records' tensors go.
    """

    def __init__(self, index_path: Union[str, Path], device: str = "cpu") -> None:
        self.index_path = Path(index_path)
        self.path = self.index_path.parent
        self.device = device
        self._ckpt = None
        try:
            index = json.loads(self.index_path.read_text())
            weight_map = index["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.index_path}: not a safetensors index ({e})") from e
        self._file_metadata = {str(k): v for k, v in (index.get("metadata") or {}).items()}
        self._by_shard: Dict[str, List[str]] = {}
        for key, shard in weight_map.items():
            self._by_shard.setdefault(shard, []).append(key)

    @classmethod
    def from_path(cls, path: Union[str, Path], device: str = "cpu") -> SafetensorsReader:
        """The reader for *path*: a directory with an index (or only ``model.safetensors``),
        an index file, or a single ``.safetensors`` file.

        Raises ``ValueError`` for a directory with neither an index nor ``model.safetensors``.
        """
        p = Path(path)
        if p.is_dir():
            for name in INDEX_NAMES:
                if (p / name).exists():
                    return cls(p / name, device=device)
            if (p / "model.safetensors").exists():
                return SafetensorsReader(p / "model.safetensors", device=device)
            raise ValueError(
                f"{p}: no model.safetensors.index.json and no model.safetensors; "
                "Cannot determine how to read it"
            )
        if p.suffix == ".json":
            return cls(p, device=device)
        return SafetensorsReader(p, device=device)

    def keys(self) -> List[str]:
        return [k for keys in self._by_shard.values() for k in keys]

    def metadata(self) -> Dict[str, str]:
        return dict(self._file_metadata)

    def num_tensors(self) -> int:
        return len(self.keys())

    def shard_paths(self) -> List[Path]:
        """The shard files, in the order their tensors come."""
        return [self.path / name for name in self._by_shard]

    def iter_meta(self) -> Iterator[TensorMeta]:
        for shard, keys in self._by_shard.items():
            metas = {m.key: m for m in SafetensorsReader(self.path / shard).iter_meta()}
            for key in keys:
                if key not in metas:
                    raise KeyError(f"tensor {key!r} is listed in {self.index_path.name} but not in shard {shard!r}")
                yield metas[key]

    def iter_records(self) -> Iterator[TensorRecord]:
        for shard, keys in self._by_shard.items():
            yield from self._records(_core.Checkpoint(str(self.path / shard)), keys)

    def _rust_input(self):
        # The Rust reader finds the index itself, and orders tensors as the shards hold them.
        return self.index_path.parent if self.device == "cpu" and self.index_path.name == INDEX_NAMES[0] else None

    def __repr__(self) -> str:
        return f"ShardedSafetensorsReader({str(self.index_path)!r})"
