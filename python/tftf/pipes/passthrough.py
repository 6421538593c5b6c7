"""The identity pipe."""

from __future__ import annotations

from typing import Iterator, List

from tftf.pipes.base import Pipe, TensorMeta, TensorRecord


class PassthroughPipe(Pipe):
    """Every tensor unchanged (a plain copy)."""

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        yield from records

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        yield from metas

    def _rust_sections(self) -> List[str]:
        return []

    def __repr__(self) -> str:
        return "PassthroughPipe()"
