"""Keeping or dropping tensors by name: shell-style globs (``fnmatch``) matched against the
whole name."""

from __future__ import annotations

import fnmatch
from typing import Iterator, List, Optional

from tftf.pipes.base import Pipe, TensorMeta, TensorRecord


class KeyFilterPipe(Pipe):
    """Keeps tensors matching any *include* glob (all, when there is none), then drops those
    matching any *exclude* glob."""

    def __init__(self, include: Optional[List[str]] = None, exclude: Optional[List[str]] = None) -> None:
        self.include = list(include or [])
        self.exclude = list(exclude or [])

    def _keep(self, key: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(key, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(key, g) for g in self.exclude)

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        return (m for m in metas if self._keep(m.key))

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        return (r for r in records if self._keep(r.key))

    def _rust_sections(self) -> List[str]:
        return ["--key-filter"] + [f"--include={g}" for g in self.include] + [f"--exclude={g}" for g in self.exclude]

    def __repr__(self) -> str:
        parts = [f"{n}={v!r}" for n, v in (("include", self.include), ("exclude", self.exclude)) if v]
        return f"KeyFilterPipe({', '.join(parts)})"
