"""A sharded output: ``model-0000i-of-0000n.safetensors`` files and
``model.safetensors.index.json``, tensors packed in order into shards of at most
``max_shard_bytes`` (a tensor larger than that gets a shard of its own).

Shards are written under hidden temporary names and renamed, with the index last, only when
every tensor came.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

from tftf.io.writer import OutputFile, StreamingWriter, check_record, header_bytes, plan_tensors, temp_path
from tftf.pipes.base import TensorMeta, TensorRecord


class ShardedWriter(StreamingWriter):
    """A directory of shards with their index.

    Args:
        path: the output directory (created; a non-empty one is refused without ``force``).
        max_shard_bytes: the most tensor bytes per shard.
        filename_stem: shard names' prefix (``model`` → ``model-00001-of-00002.safetensors``).
        index_filename: the index's name.
        force: write into a non-empty directory, replacing files of the same names.
    """

    DEFAULT_MAX_SHARD_BYTES = 20 * 1024**3

    def __init__(
        self,
        path: Union[str, Path],
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        filename_stem: str = "model",
        index_filename: str = "model.safetensors.index.json",
        force: bool = False,
    ) -> None:
        super().__init__(path, force=force)
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
        self.max_shard_bytes = max_shard_bytes
        self.filename_stem = filename_stem
        self.index_filename = index_filename
        self._shards: List[list] = []
        self._paths: List[Path] = []
        self._shard = 0
        self._in_shard = 0
        self._written: List[Path] = []

    def prepare(self, metas: List[TensorMeta], file_metadata: Optional[Dict[str, str]] = None) -> None:
        """Packs *metas* into shards and writes each shard's header."""
        self._refuse_existing()
        groups: List[list] = []
        size = 0
        for p in plan_tensors(metas):
            if not groups or (groups[-1] and size + p[3] > self.max_shard_bytes):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p[3]
        n = len(groups)
        width = max(5, len(str(n)))
        self._paths = [self.path / f"{self.filename_stem}-{i + 1:0{width}d}-of-{n:0{width}d}.safetensors" for i in range(n)]
        self._shards, self._file_metadata = groups, file_metadata
        self.path.mkdir(parents=True, exist_ok=True)
        self._shard, self._in_shard, self._written = 0, 0, []
        if groups:
            self._open(0)

    def _refuse_existing(self) -> None:
        if self.path.is_dir() and any(self.path.iterdir()) and not self.force:
            raise FileExistsError(f"{self.path} is not empty; pass force=True to write into it")
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"{self.path} exists and is not a directory")

    def _open(self, i: int) -> None:
        self._fh = OutputFile(temp_path(self._paths[i]))
        self._written.append(self._paths[i])
        self._fh.write(header_bytes(self._shards[i], self._file_metadata))

    def write_record(self, record: TensorRecord) -> None:
        """Appends the next announced tensor to its shard."""
        if self._fh is None:
            raise RuntimeError("call prepare() before write_record()")
        while self._in_shard >= len(self._shards[self._shard]):
            if self._shard + 1 >= len(self._shards):
                raise ValueError(f"tensor {record.key!r} was not announced by process_meta")
            # Each shard is on disk before it is renamed into place with the others.
            self._fh.commit()
            self._fh = None
            self._shard, self._in_shard = self._shard + 1, 0
            self._open(self._shard)
        self._fh.write(check_record(record, self._shards[self._shard][self._in_shard]))
        self._in_shard += 1

    def finalize(self) -> None:
        """Checks every tensor came; renames the shards into place and writes the index."""
        if self._fh is None and not self._shards:
            return
        done = sum(len(g) for g in self._shards[: self._shard]) + self._in_shard
        total = sum(len(g) for g in self._shards)
        if done != total:
            self.abort()
            raise ValueError(f"{total - done} announced tensor(s) never came")
        if self._fh is not None:
            self._fh.commit()
            self._fh = None
        weight_map = {p[0]: path.name for g, path in zip(self._shards, self._paths) for p in g}
        total_size = sum(p[3] for g in self._shards for p in g)
        for path in self._paths:
            os.replace(temp_path(path), path)
        index = self.path / self.index_filename
        tmp = temp_path(index)
        tmp.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
        os.replace(tmp, index)
        self._shards = []

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for path in self._written:
            temp_path(path).unlink(missing_ok=True)
        self._written = []

    def _rust_output(self) -> Optional[dict]:
        if self.filename_stem != "model" or self.index_filename != "model.safetensors.index.json":
            return None
        return {"kind": "sharded", "path": str(self.path), "max_shard_size": self.max_shard_bytes, "outtype": None, "force": self.force, "arch": None, "vocab_pre": None}

    def _after_rust(self, report: dict) -> None:
        """Upstream's layout after a Rust run: the Rust writer names a one-shard output
        ``model.safetensors`` without an index (as ``save_pretrained`` does); this writer
        always writes numbered shards and the index."""
        single, index = self.path / "model.safetensors", self.path / self.index_filename
        if not single.exists() or index.exists():
            return
        from tftf.io.reader import SafetensorsReader

        shard = self.path / "model-00001-of-00001.safetensors"
        metas = list(SafetensorsReader(single).iter_meta())
        os.replace(single, shard)
        total = sum(p[3] for p in plan_tensors(metas))
        tmp = temp_path(index)
        tmp.write_text(json.dumps({"metadata": {"total_size": total},
                                   "weight_map": {m.key: shard.name for m in metas}}, indent=2))
        os.replace(tmp, index)

    def __repr__(self) -> str:
        return f"ShardedWriter({str(self.path)!r})"
