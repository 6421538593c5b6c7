"""The models of a mergekit config, merged, as a reader."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Union

from tftf import _core, _tensor
from tftf.pipes.base import TensorMeta, TensorRecord


class MergeReader:
    """Reads the merge a mergekit YAML config describes, as ``tftf merge`` computes it: the
    config is read unchanged (every method, slices, gradients, ``tokenizer_source``, quantised
    inputs dequantised on the fly).

    In a :class:`~tftf.Pipeline` of built-in pipes the merge and the pipes run as one Rust job
    (``tftf run --merge CONFIG …``): ``Pipeline(MergeReader("merge.yml"),
    QuantizePipe("FP8_BLOCK", "compressed-tensors"), ShardedWriter(out))`` quantises the merged
    weights in the same pass, with no merged copy on disk. With Python pipes in the chain the
    merged tensors reach them one at a time, in order.

    Args:
        config: the mergekit YAML file.
        random_seed: seed of the stochastic methods (DARE, DELLA …), as ``--random-seed``.
        allow_crimes: merge models whose architectures differ.
        copy_tokenizer: copy the donor model's tokenizer files (``False``: as
            ``--no-copy-tokenizer``).

    The config is checked when the reader is made: a missing file or an invalid config raises
    ``FileNotFoundError``, ``ValueError`` or :class:`tftf.TftfError`; the models' tensors are
    checked when the run plans, before any output exists.
    """

    def __init__(self, config: Union[str, Path], *, random_seed: int = 0, allow_crimes: bool = False,
                 copy_tokenizer: bool = True) -> None:
        self.config = Path(config)
        self.random_seed = int(random_seed)
        self.allow_crimes = allow_crimes
        self.copy_tokenizer = copy_tokenizer
        #: The model whose ``config.json`` and side files the output takes (base, else first).
        self.path = Path(_core.merge_donor(str(self.config)))

    def _rust_input(self) -> Path:
        return self.path

    def _rust_sections(self) -> List[str]:
        tokens = ["--merge", f"--config={self.config}", f"--random-seed={self.random_seed}"]
        if self.allow_crimes:
            tokens.append("--allow-crimes")
        if not self.copy_tokenizer:
            tokens.append("--no-copy-tokenizer")
        return tokens

    def _stream(self):
        return _core.stream_records(str(self.path), self._rust_sections())

    def iter_meta(self) -> Iterator[TensorMeta]:
        """The merged tensors' names, dtypes and shapes, in output order."""
        stream = self._stream()
        try:
            tensors = stream.tensors()
        finally:
            stream.close()
        for name, dtype, shape in tensors:
            yield TensorMeta(key=name, dtype=_tensor.to_dtype(dtype), shape=_tensor.make_shape(shape))

    def iter_records(self) -> Iterator[TensorRecord]:
        """The merged tensors, computed one at a time in output order."""
        from tftf.pipeline import _streamed_records

        stream = self._stream()
        try:
            yield from _streamed_records(stream)
        finally:
            stream.close()

    def metadata(self) -> dict:
        return {}

    def num_tensors(self) -> int:
        return sum(1 for _ in self.iter_meta())

    def __repr__(self) -> str:
        return f"MergeReader({str(self.config)!r})"
