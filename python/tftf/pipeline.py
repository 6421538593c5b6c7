"""The pipeline: a reader, a pipe, a writer.

``Pipeline(reader, pipe, writer).run()`` runs one of two ways, with the same result:

* **One Rust job** when every part is built in (our readers, built-in pipes, our writers): the
  pipe chain becomes ``tftf run`` sections and the Rust engine streams the checkpoint with
  bounded memory, on all cores (and a GPU when one is there and the op has a kernel), with the
  GIL released. Ctrl-C stops it and leaves the output as it was.
* **A Python stream** otherwise (a user's pipe, reader or writer subclass): metadata first
  (``process_meta`` → ``writer.prepare``), then one record at a time (``process`` →
  ``writer.write_record``). Built-in pipes at the head of such a chain run as one Rust job
  that hands its tensors over in memory (``_core.stream_records``); built-in pipes after a
  Python pipe run their Rust op on each record.
  An exception anywhere aborts the run with that exception and removes the partial output.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import weakref
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Union, runtime_checkable

from tftf import _core, _tensor
from tftf.io.gguf_writer import GGUFWriter
from tftf.io.merge_reader import MergeReader
from tftf.io.null_writer import NullWriter
from tftf.io.reader import SafetensorsReader
from tftf.io.sharded_reader import ShardedSafetensorsReader
from tftf.io.sharded_writer import ShardedWriter
from tftf.io.writer import StreamingWriter
from tftf.pipes.base import CompoundPipe, Pipe, TensorMeta, TensorRecord, rust_sections_of


logger = logging.getLogger(__name__)

_RUST_WRITERS = (StreamingWriter, ShardedWriter, NullWriter, GGUFWriter)
_RUST_READERS = (SafetensorsReader, ShardedSafetensorsReader, MergeReader)


def _reader_sections(reader) -> list:
    """The sections a reader itself contributes (a merge), before the pipes'."""
    return reader._rust_sections() if isinstance(reader, MergeReader) else []


@runtime_checkable
class ReaderProtocol(Protocol):
    """What a reader offers: metadata, records, file metadata and a tensor count."""

    def iter_meta(self) -> Iterator[TensorMeta]: ...
    def iter_records(self) -> Iterator[TensorRecord]: ...
    def metadata(self) -> dict: ...
    def num_tensors(self) -> int: ...


class Pipeline:
    """Reads with *reader*, transforms with *pipe*, writes with *writer*.

    Args:
        reader: a reader (any :class:`ReaderProtocol`), or a checkpoint path.
        pipe: the transformation (built-in pipes, user pipes, or ``|`` chains of both).
        writer: :class:`StreamingWriter`, :class:`ShardedWriter`, :class:`NullWriter` or
            :class:`~tftf.io.gguf_writer.GGUFWriter`.
        threads: compute threads of a Rust run (default: all cores).
        memory_budget: bytes of tensor data a Rust run holds at most (default: a quarter of
            free memory, at most 4 GiB).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` for a Rust run.
    """

    def __init__(self, reader: Union[ReaderProtocol, str, Path], pipe: Pipe, writer: Any, *,
                 threads: Optional[int] = None, memory_budget: Optional[int] = None,
                 device: str = "auto") -> None:
        self.reader = SafetensorsReader(reader) if isinstance(reader, (str, Path)) else reader
        self.pipe = pipe
        self.writer = writer
        self.threads = threads
        self.memory_budget = memory_budget
        self.device = device
        #: The Rust job's report (the JSON ``tftf --report`` writes), after a Rust run.
        self.report: Optional[dict] = None

    def _rust_plan(self):
        """(input path, section tokens, writer spec) when the whole run can be one Rust job."""
        rust_input = getattr(self.reader, "_rust_input", None)
        if type(self.writer) not in _RUST_WRITERS or rust_input is None:
            return None
        if type(self.reader) not in _RUST_READERS:
            return None
        path, sections = rust_input(), rust_sections_of(self.pipe)
        if path is None or sections is None:
            return None
        return str(path), _reader_sections(self.reader) + sections, self.writer._rust_output()

    def runs_in_rust(self) -> bool:
        """Whether :meth:`run` runs as one Rust job."""
        plan = self._rust_plan()
        return plan is not None and plan[2] is not None

    def run(self, show_progress: bool = True, progress_desc: Optional[str] = None) -> None:
        """Runs the conversion. Raises the first error (a Python pipe's own exception, or
        :class:`tftf.TftfError` / ``ValueError`` / ``FileNotFoundError`` from the core); the
        output is then left as it was."""
        plan = self._rust_plan()
        if plan is not None and plan[2] is not None:
            self._run_rust(*plan, show_progress=show_progress, desc=progress_desc)
            return
        if isinstance(self.writer, GGUFWriter):
            raise ValueError("GGUFWriter needs a checkpoint reader and built-in pipes only (it runs as one Rust job)")
        self._run_python(show_progress, progress_desc)

    def _run_rust(self, path: str, sections: list, spec: dict, show_progress: bool, desc: Optional[str]) -> None:
        null = isinstance(self.writer, NullWriter)
        self.writer._refuse_existing()
        if null:
            try:
                self.writer.prepare(list(self.pipe.process_meta(self.reader.iter_meta())))
            except (_core.TftfError, OSError, ValueError) as e:
                # What stops the run is the dry run's finding, not its error.
                self.writer._after_rust({"status": "error", "error": str(e)})
                return
        bar = _progress_bar(show_progress and not null, desc or Path(spec["path"] or "out").name)
        try:
            report = _core.run_pipeline(path, sections, spec, threads=self.threads, memory_budget=self.memory_budget,
                                        device=self.device, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        self.report = json.loads(report)
        if hasattr(self.writer, "_after_rust"):
            self.writer._after_rust(self.report)

    def _run_python(self, show_progress: bool, desc: Optional[str]) -> None:
        stream, pipe = self._rust_prefix()
        if stream is not None:
            metas_in = (TensorMeta(key=n, dtype=_tensor.to_dtype(d), shape=_tensor.make_shape(s))
                        for n, d, s in stream.tensors())
            records_in = _streamed_records(stream)
        else:
            metas_in, records_in = self.reader.iter_meta(), None
        metas = list(pipe.process_meta(metas_in)) if pipe is not None else list(metas_in)
        self.writer.prepare(metas, file_metadata=self.reader.metadata() or None)
        finished = False
        if pipe is not None:
            pipe.setup()
        try:
            records = records_in if records_in is not None else self.reader.iter_records()
            stream_out = pipe.process(records) if pipe is not None else records
            if show_progress:
                stream_out = _tensor_bar(stream_out, len(metas), desc or getattr(self.writer.path, "name", "out"))
            for record in stream_out:
                self.writer.write_record(record)
                del record
            finished = True
        finally:
            if pipe is not None:
                pipe.teardown()
            if stream is not None:
                stream.close()
            if not finished and hasattr(self.writer, "abort"):
                self.writer.abort()
        self.writer.finalize()

    def _rust_prefix(self):
        """(record stream, the pipes left) when the chain starts with built-in pipes and the
        reader is ours: those pipes then run in the Rust engine (all cores, bounded memory, one
        rounding) and hand their tensors to the rest; else (None, the whole pipe)."""
        rust_input = getattr(self.reader, "_rust_input", None)
        if rust_input is None or type(self.reader) not in _RUST_READERS:
            return None, self.pipe
        pipes = self.pipe.pipes if isinstance(self.pipe, CompoundPipe) else [self.pipe]
        sections: list = _reader_sections(self.reader)
        k = 0
        while k < len(pipes) and (own := rust_sections_of(pipes[k])) is not None:
            sections += own
            k += 1
        path = rust_input()
        if (k == 0 and not isinstance(self.reader, MergeReader)) or path is None:
            return None, self.pipe
        rest = pipes[k:]
        pipe = None if not rest else rest[0] if len(rest) == 1 else CompoundPipe(rest)
        stream = _core.stream_records(str(path), sections, threads=self.threads, memory_budget=self.memory_budget,
                                      device=self.device)
        return stream, pipe


# The tensor's pages are mapped in one call rather than faulted in one by one as they are read.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _streamed_records(stream) -> Iterator[TensorRecord]:
    """The stream's tensors as records whose tensors view the engine's in-memory file of each
    (mapped, no copy); a record's memory goes when its tensor does, and the engine then reuses
    the file's pages for a later tensor."""
    for name, dtype, shape, fd, nbytes, lent in stream:
        try:
            buf = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS) if nbytes else bytearray()
        finally:
            os.close(fd)
        if nbytes:
            # Fires once the mapping is gone (every view of it dropped, the map closed).
            weakref.finalize(buf, lent.give_back)
        yield TensorRecord(key=name, tensor=_tensor.from_buffer(buf, dtype, shape))
        del buf


class _BytesBar:
    """A tqdm bar fed by the Rust job's progress callback (bytes written of bytes in all)."""

    def __init__(self, desc: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=0, unit="B", unit_scale=True, desc=desc, dynamic_ncols=True)

    def update(self, done: int, total: int, _file: str) -> None:
        self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress_bar(show: bool, desc: str) -> Optional[_BytesBar]:
    if not show or not sys.stderr.isatty():
        return None
    try:
        return _BytesBar(desc)
    except ImportError:
        return None


def _tensor_bar(stream: Iterator[TensorRecord], total: int, desc: str) -> Iterator[TensorRecord]:
    if not sys.stderr.isatty():
        return stream
    try:
        from tqdm import tqdm
    except ImportError:
        return stream
    return tqdm(stream, total=total, unit="tensor", desc=desc, dynamic_ncols=True)
