"""Writers for runs that pass through Python pipes; a pipeline of built-in pipes hands the
writer's path to the Rust job instead (see :mod:`tftf.pipeline`).

A writer announces every tensor first (:meth:`StreamingWriter.prepare`, from the pipes'
``process_meta``), then takes the records in that order (:meth:`~StreamingWriter.write_record`)
and commits (:meth:`~StreamingWriter.finalize`). Bytes go to a hidden temporary file beside the
output, renamed into place only when every announced tensor was written; a failed run calls
:meth:`~StreamingWriter.abort`, which removes it. A record that is not the one announced (name,
dtype or shape) is refused, naming the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from tftf import _core, _tensor
from tftf.pipes.base import TensorMeta, TensorRecord

# (name, safetensors dtype, shape, bytes) of one announced tensor.
Planned = Tuple[str, str, Tuple[int, ...], int]


def plan_tensors(metas: List[TensorMeta]) -> List[Planned]:
    """Checks *metas* (known dtypes, unique names) and sizes each tensor."""
    planned, seen = [], set()
    for m in metas:
        if m.key in seen:
            raise ValueError(f"tensor {m.key!r} is announced twice")
        seen.add(m.key)
        try:
            name = _tensor.st_name(m.dtype)
        except ValueError:
            raise ValueError(f"tensor {m.key!r} has dtype {m.dtype}, which safetensors cannot store") from None
        shape = tuple(int(d) for d in m.shape)
        planned.append((m.key, name, shape, _tensor.nbytes(name, shape)))
    return planned


def header_bytes(planned: List[Planned], file_metadata: Optional[Dict[str, str]]) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to 8 bytes) of a file
    holding *planned* in order."""
    header: Dict[str, Any] = {}
    if file_metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in file_metadata.items()}
    offset = 0
    for key, dtype, shape, size in planned:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def temp_path(path: Path) -> Path:
    """The hidden temporary file *path* is written as until it is committed."""
    return path.with_name(f".{path.name}.tftf-partial")


class OutputFile:
    """A temporary output file written front to back. What is written is pushed to disk behind
    a window and leaves the page cache, as the Rust engine's writers do, so a big output
    neither fills memory with dirty pages nor costs fresh cache pages per tensor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "wb")
        try:
            self._behind = _core.WriteBehind(self._fh.fileno(), str(path), 0)
        except BaseException:
            self._fh.close()
            raise

    def write(self, data: Any) -> None:
        self._fh.write(data)
        self._fh.flush()
        self._behind.advance(self._fh.tell())

    def commit(self) -> None:
        """Puts everything written on disk (``fsync``) and closes the file."""
        self._fh.flush()
        self._behind.finish()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def close(self) -> None:
        """Closes the file as it is (a failed run then removes it)."""
        self._fh.close()


def check_record(record: TensorRecord, planned: Planned) -> memoryview:
    """The record's bytes, once it is what was announced."""
    key, dtype, shape, size = planned
    if record.key != key:
        raise ValueError(f"tensor {record.key!r} came where {key!r} was announced (process and process_meta disagree)")
    got = (_tensor.dtype_of(record.tensor), _tensor.shape_of(record.tensor))
    # numpy holds BF16 as uint16: the size is what must agree then.
    if got[1] != shape or (got[0] != dtype and not (_tensor.HAVE_TORCH is False and _tensor.itemsize(got[0]) == _tensor.itemsize(dtype))):
        raise ValueError(f"tensor {key!r}: announced {dtype} {list(shape)}, got {got[0]} {list(got[1])}")
    data = _tensor.raw_bytes(record.tensor)
    if data.nbytes != size:
        raise ValueError(f"tensor {key!r}: {data.nbytes} bytes where {size} were announced")
    return data


class StreamingWriter:
    """One ``.safetensors`` file, written tensor by tensor.

    Args:
        path: the output file.
        force: replace an existing file (without it an existing output is refused).
    """

    def __init__(self, path: Union[str, Path], force: bool = False) -> None:
        self.path = Path(path)
        self.force = force
        self._planned: List[Planned] = []
        self._next = 0
        self._fh = None

    def prepare(self, metas: List[TensorMeta], file_metadata: Optional[Dict[str, str]] = None) -> None:
        """Lays out the file for *metas* and writes its header (to the temporary file)."""
        self._refuse_existing()
        self._planned = plan_tensors(metas)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = OutputFile(temp_path(self.path))
        self._fh.write(header_bytes(self._planned, file_metadata))
        self._next = 0

    def _refuse_existing(self) -> None:
        """``FileExistsError`` when the output exists and ``force`` is not set."""
        if self.path.exists() and not self.force:
            raise FileExistsError(f"{self.path} exists; pass force=True to replace it")

    def write_record(self, record: TensorRecord) -> None:
        """Appends the next announced tensor."""
        if self._fh is None:
            raise RuntimeError("call prepare() before write_record()")
        if self._next >= len(self._planned):
            raise ValueError(f"tensor {record.key!r} was not announced by process_meta")
        self._fh.write(check_record(record, self._planned[self._next]))
        self._next += 1

    def finalize(self) -> None:
        """Checks every announced tensor came, and moves the file into place."""
        if self._fh is None:
            return
        missing = [p[0] for p in self._planned[self._next:]]
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} announced tensor(s) never came, first {missing[0]!r}")
        self._fh.commit()
        self._fh = None
        os.replace(temp_path(self.path), self.path)

    def abort(self) -> None:
        """Drops what was written: the output is left as it was."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            temp_path(self.path).unlink(missing_ok=True)

    def _rust_output(self) -> Optional[dict]:
        if self.path.suffix != ".safetensors":
            return None
        return {"kind": "file", "path": str(self.path), "max_shard_size": None, "outtype": None, "force": self.force, "arch": None, "vocab_pre": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"
