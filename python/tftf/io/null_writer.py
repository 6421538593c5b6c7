"""A dry run: :class:`NullWriter` takes the whole stream and writes nothing; its
:class:`ValidationReport` says whether a real run would succeed.

With Python pipes every record is checked against what ``process_meta`` announced. A pipeline
of built-in pipes runs the Rust dry run instead, which plans the job from the headers (the data
is not read) and reports what would stop it.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tftf import _tensor
from tftf.io.writer import StreamingWriter
from tftf.pipes.base import TensorMeta, TensorRecord


@dataclass
class ValidationReport:
    """What a dry run found. ``ok`` when nothing is wrong; :meth:`summary` for people."""

    n_tensors: int = 0
    total_bytes: int = 0
    dtype_counts: Dict[str, int] = field(default_factory=dict)
    mismatches: List[str] = field(default_factory=list)
    unsupported_dtypes: List[str] = field(default_factory=list)
    duplicate_keys: List[str] = field(default_factory=list)
    missing_keys: List[str] = field(default_factory=list)
    extra_keys: List[str] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    #: What would stop the run (from the Rust dry run: an unreadable input, an op that
    #: cannot apply).
    problems: List[str] = field(default_factory=list)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / 1024**3

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.unsupported_dtypes or self.duplicate_keys
                    or self.missing_keys or self.extra_keys or self.problems)

    def summary(self) -> str:
        dtypes = ", ".join(f"{k}={v}" for k, v in sorted(self.dtype_counts.items())) or "(none)"
        lines = [
            f"Tensors : {self.n_tensors}",
            f"Size    : {self.total_gib:.3f} GiB  ({self.total_bytes:,} bytes)",
            f"Elapsed : {self.elapsed_seconds:.2f}s",
            f"Dtypes  : {dtypes}",
        ]
        if self.ok:
            lines.append("Result  : OK — all checks passed.")
            return "\n".join(lines)
        lines.append("Result  : FAILED")
        for items, label in [
            (self.problems, "Problem"),
            (self.duplicate_keys, "Duplicate keys"),
            (self.unsupported_dtypes, "Unsupported dtypes"),
            (self.mismatches, "Shape/dtype mismatches"),
            (self.missing_keys, "Missing tensors (declared but not written)"),
            (self.extra_keys, "Extra tensors (written but not declared)"),
        ]:
            lines.extend(f"  [{label}]  {item}" for item in items)
        return "\n".join(lines)


class NullWriter(StreamingWriter):
    """Takes the stream and discards it, filling :attr:`report`."""

    def __init__(self) -> None:
        self.report = ValidationReport()
        self.path = types.SimpleNamespace(name="<dry-run>")
        self.force = False
        self._declared: Dict[str, TensorMeta] = {}
        self._written_keys: List[str] = []
        self._t0 = 0.0

    def prepare(self, metas: List[TensorMeta], file_metadata: Optional[Dict[str, str]] = None) -> None:
        self._t0 = time.monotonic()
        for m in metas:
            if m.key in self._declared:
                self.report.duplicate_keys.append(m.key)
            self._declared[m.key] = m
            try:
                name = _tensor.st_name(m.dtype)
                _tensor.itemsize(name)
            except (ValueError, KeyError):
                self.report.unsupported_dtypes.append(f"{m.key}: {m.dtype} not serialisable by safetensors")
                continue
            self.report.dtype_counts[name] = self.report.dtype_counts.get(name, 0) + 1
            self.report.total_bytes += _tensor.nbytes(name, m.shape)
        self.report.n_tensors = len(metas)

    def write_record(self, record: TensorRecord) -> None:
        self._written_keys.append(record.key)
        declared = self._declared.get(record.key)
        if declared is None:
            if record.key not in self.report.extra_keys:
                self.report.extra_keys.append(record.key)
            return
        shape = _tensor.shape_of(record.tensor)
        if shape != tuple(int(d) for d in declared.shape):
            self.report.mismatches.append(f"{record.key}: declared shape {tuple(declared.shape)} but got {shape}")
        if _tensor.dtype_of(record.tensor) != _tensor.st_name(declared.dtype):
            self.report.mismatches.append(f"{record.key}: declared dtype {declared.dtype} but got {record.tensor.dtype}")

    def finalize(self) -> None:
        self.report.elapsed_seconds = time.monotonic() - self._t0
        self.report.missing_keys = sorted(set(self._declared) - set(self._written_keys))

    def abort(self) -> None:
        """Nothing was written."""

    def _refuse_existing(self) -> None:
        """A dry run writes nothing, so nothing is in its way."""

    def _after_rust(self, report: dict) -> None:
        """The Rust dry run planned every declared tensor; what stops it is a problem."""
        self._written_keys = list(self._declared)
        if report.get("status") != "ok":
            self.report.problems.append(str(report.get("error", "the dry run failed")))
        self.finalize()

    def _rust_output(self) -> Optional[dict]:
        return {"kind": "null", "path": None, "max_shard_size": None, "outtype": None, "force": False, "arch": None, "vocab_pre": None}

    def __repr__(self) -> str:
        return "NullWriter()"
