"""Renaming tensors with regex rules (Python ``re`` syntax, ``\\1`` backreferences), applied in
order to every name. Two tensors renamed to the same name are refused."""

from __future__ import annotations

import re
from typing import Iterator, List, Optional, Tuple

from tftf.pipes.base import Pipe, TensorMeta, TensorRecord

# Python-only regex syntax the Rust engine lacks: lookaround and backreferences.
_PYTHON_ONLY = re.compile(r"\(\?<?[=!]|\\[1-9]|\(\?P=")


def _rust_replacement(repl: str) -> Optional[str]:
    """*repl* in the Rust engine's syntax (``\\1`` → ``${1}``, ``$`` escaped), or None."""
    out, i = [], 0
    while i < len(repl):
        c = repl[i]
        if c == "$":
            out.append("$$")
        elif c == "\\" and i + 1 < len(repl):
            m = re.match(r"\\(?:(\d+)|g<(\w+)>)", repl[i:])
            if not m:
                return None
            out.append("${" + (m.group(1) or m.group(2)) + "}")
            i += len(m.group(0))
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


class KeyRenamePipe(Pipe):
    """Applies ``(pattern, replacement)`` rules in order to every tensor name.

    Raises ``ValueError`` ("Invalid regex …") for a pattern that does not compile.
    """

    def __init__(self, rules: List[Tuple[str, str]]) -> None:
        self._rules = []
        for pattern, repl in rules:
            try:
                self._rules.append((re.compile(pattern), repl))
            except re.error as e:
                raise ValueError(f"Invalid regex {pattern!r}: {e}") from e

    def _rename(self, key: str) -> str:
        for pattern, repl in self._rules:
            key = pattern.sub(repl, key)
        return key

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        sources = {}
        for m in metas:
            new = self._rename(m.key)
            if new in sources:
                raise ValueError(f"KeyRenamePipe: {sources[new]!r} and {m.key!r} both map to the same key {new!r}")
            sources[new] = m.key
            yield TensorMeta(key=new, dtype=m.dtype, shape=m.shape, extra=m.extra)

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        for r in records:
            yield TensorRecord(key=self._rename(r.key), tensor=r.tensor, extra=r.extra)

    def _rust_sections(self) -> Optional[List[str]]:
        tokens: List[str] = []
        for pattern, repl in self._rules:
            rust = _rust_replacement(repl)
            if rust is None or _PYTHON_ONLY.search(pattern.pattern):
                return None
            tokens += ["--key-rename", "--rule", pattern.pattern, rust]
        return tokens

    def __repr__(self) -> str:
        return f"KeyRenamePipe(rules={[(p.pattern, r) for p, r in self._rules]!r})"
