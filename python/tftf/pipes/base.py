"""The pipe abstraction: a lazy stream of tensors, transformed one record at a time.

A run has two phases. ``process_meta`` maps the stream of :class:`TensorMeta` (names, dtypes,
shapes; no data) so the writer can lay out its files before any byte is written; ``process``
then maps the stream of :class:`TensorRecord` (the data), and must produce what
``process_meta`` announced, in the same order.

Built-in pipes also say which ``tftf run`` sections they are (``_rust_sections``): a
:class:`~tftf.pipeline.Pipeline` whose pipes all do runs as one Rust job.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional


@dataclass
class TensorMeta:
    """One tensor's name, dtype and shape; no data.

    ``dtype`` is a torch dtype when torch is installed, else the safetensors name (``"BF16"``).
    """

    key: str
    dtype: Any
    shape: Any
    extra: dict = field(default_factory=dict)


@dataclass
class TensorRecord:
    """One tensor in flight: its name, its data (a torch tensor, or a numpy array without
    torch) and free-form extras."""

    key: str
    tensor: Any
    extra: dict = field(default_factory=dict)


class Pipe(ABC):
    """A pipeline stage. Implement :meth:`process`; override :meth:`process_meta` when the pipe
    renames, drops, adds, reshapes or retypes tensors; :meth:`setup` and :meth:`teardown` run
    once around the data phase. Compose pipes with ``|``."""

    @abstractmethod
    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        """Map a lazy stream of records: take one, yield zero or more, hold none back."""

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        """Map the metadata stream as :meth:`process` maps the records (default: unchanged)."""
        yield from metas

    def setup(self) -> None:
        """Called once before :meth:`process`."""

    def teardown(self) -> None:
        """Called once after :meth:`process`, also when the run failed."""

    def __or__(self, other: "Pipe") -> "CompoundPipe":
        """``a | b``: ``a`` then ``b``."""
        return CompoundPipe([self, other])

    def _rust_sections(self) -> Optional[List[str]]:
        """The ``tftf run`` section tokens this pipe is, or ``None`` when it runs in Python
        (every user pipe)."""
        return None


class CompoundPipe(Pipe):
    """Pipes run left to right as one pipe (what ``a | b | c`` builds)."""

    def __init__(self, pipes: List[Pipe]) -> None:
        self.pipes = list(pipes)

    def setup(self) -> None:
        for p in self.pipes:
            p.setup()

    def teardown(self) -> None:
        for p in reversed(self.pipes):
            p.teardown()

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        for p in self.pipes:
            records = p.process(records)
        return records

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        for p in self.pipes:
            metas = p.process_meta(metas)
        return metas

    def __or__(self, other: Pipe) -> "CompoundPipe":
        tail = other.pipes if isinstance(other, CompoundPipe) else [other]
        return CompoundPipe(self.pipes + list(tail))

    def __repr__(self) -> str:
        return "(" + " | ".join(repr(p) for p in self.pipes) + ")"

    def _rust_sections(self) -> Optional[List[str]]:
        tokens: List[str] = []
        for p in self.pipes:
            own = rust_sections_of(p)
            if own is None:
                return None
            tokens += own
        return tokens


def rust_sections_of(pipe: Pipe) -> Optional[List[str]]:
    """A pipe's ``tftf run`` sections, or ``None`` when it must run in Python: a user's pipe,
    or a subclass of a built-in pipe that overrides what it does."""
    for klass in type(pipe).__mro__:
        if "_rust_sections" in klass.__dict__:
            break
        if any(m in klass.__dict__ for m in ("process", "process_meta", "setup")):
            return None
    return pipe._rust_sections()
