"""This package's own pipes, beyond upstream's: every dequantisation ``tftf dequant`` does, the
FP4 repack and quantisation. They run in the Rust job (a pipeline of built-in pipes)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional

from tftf.pipes.base import Pipe, TensorMeta, TensorRecord
from tftf.pipes.fp8_dequant import FP8DequantPipe


class DequantPipe(FP8DequantPipe):
    """Dequantises every quantised weight ``tftf dequant`` reads (FP8 with block, row or
    tensor scales, MXFP8, …) to *dtype* and drops the scales.

    Args:
        dtype: ``"bf16"`` (default), ``"f16"``, ``"f32"`` or a torch dtype.
        block_size: the scale block ``(rows, cols)``; default: from ``config.json``.
        scale_mode: ``"multiply"`` (``weight_scale_inv``) or ``"divide"``.
        keep_kv_scales: keep ``k_scale``/``v_scale`` tensors.

    On in-memory records (``process``) it dequantises FP8 block-scaled weights, as
    :class:`~tftf.pipes.fp8_dequant.FP8DequantPipe`.
    """

    def __init__(self, dtype: Any = "bf16", block_size: Optional[tuple] = None, scale_mode: str = "multiply",
                 keep_kv_scales: bool = False) -> None:
        if scale_mode not in ("multiply", "divide"):
            raise ValueError(f"scale_mode is multiply or divide, not {scale_mode!r}")
        rows, cols = block_size or (128, 128)
        if rows != cols:
            raise ValueError("in-memory dequantisation takes square blocks")
        super().__init__(dtype, block_size=rows)
        self._block = block_size
        self.scale_mode = scale_mode
        self.keep_kv_scales = keep_kv_scales

    def _rust_sections(self) -> List[str]:
        tokens = ["--dequant-fp8", f"--dtype={self._target.lower()}", f"--scale-mode={self.scale_mode}"]
        if self._block:
            tokens.append(f"--block-size={self._block[0]}x{self._block[1]}")
        if self.keep_kv_scales:
            tokens.append("--keep-kv-scales")
        return tokens

    def __repr__(self) -> str:
        return f"DequantPipe(dtype={self._target.lower()!r}, scale_mode={self.scale_mode!r})"


class _RustOnlyPipe(Pipe):
    """A whole-checkpoint op: it runs in the Rust job of a pipeline of built-in pipes only."""

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        raise TypeError(f"{type(self).__name__} runs in a Rust job only: use it in a Pipeline of built-in pipes")

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        raise TypeError(f"{type(self).__name__} runs in a Rust job only: use it in a Pipeline of built-in pipes")


class RepackFP4Pipe(_RustOnlyPipe):
    """Repacks MXFP4 experts to NVFP4 (``tftf run --repack-fp4``): a whole-checkpoint op that
    runs in the Rust job only.

    Args:
        experts: ``"nvfp4"`` (default) or ``"keep"``.
        engram: ``"fp4"`` (default) or ``"keep"``.
        require_lossless: fail instead of rounding a block that does not repack exactly.
    """

    def __init__(self, experts: str = "nvfp4", engram: str = "fp4", require_lossless: bool = False) -> None:
        if experts not in ("nvfp4", "keep") or engram not in ("fp4", "keep"):
            raise ValueError("experts is nvfp4 or keep; engram is fp4 or keep")
        self.experts, self.engram, self.require_lossless = experts, engram, require_lossless

    def _rust_sections(self) -> List[str]:
        tokens = ["--repack-fp4", f"--experts={self.experts}", f"--engram={self.engram}"]
        return tokens + (["--require-lossless"] if self.require_lossless else [])

    def __repr__(self) -> str:
        return f"RepackFP4Pipe(experts={self.experts!r}, engram={self.engram!r})"


class QuantizePipe(_RustOnlyPipe):
    """Quantises the weights as ``tftf quantize`` does (``tftf run --quantize``): a
    whole-checkpoint op (it writes the quantisation config) that runs in the Rust job only, as
    the last pipe.

    Args:
        scheme: an llm-compressor preset: ``"FP8_DYNAMIC"``, ``"FP8_BLOCK"``, ``"W8A16"``,
            ``"W4A16"``, ``"NVFP4A16"``, ``"MXFP4A16"`` or ``"MXFP8A16"``.
        format: ``"compressed-tensors"`` (default), ``"fp8-native"`` or ``"modelopt"``.
        ignore: modules to leave unquantised (globs, or ``re:REGEX`` on module names).
        default_ignore: leave ``lm_head`` and MoE routers unquantised (default).
    """

    def __init__(self, scheme: str, format: str = "compressed-tensors", ignore: Iterable[str] = (),
                 default_ignore: bool = True) -> None:
        if format not in ("compressed-tensors", "fp8-native", "modelopt"):
            raise ValueError(f"format is compressed-tensors, fp8-native or modelopt, not {format!r}")
        self.scheme, self.format = scheme, format
        self.ignore, self.default_ignore = list(ignore), default_ignore

    def _rust_sections(self) -> List[str]:
        tokens = ["--quantize", f"--scheme={self.scheme}", f"--format={self.format}"]
        tokens += [f"--ignore={g}" for g in self.ignore]
        return tokens + ([] if self.default_ignore else ["--no-default-ignore"])

    def __repr__(self) -> str:
        return f"QuantizePipe({self.scheme!r}, format={self.format!r})"
