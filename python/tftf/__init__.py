"""tftf: stream-convert huge LLM checkpoints, with upstream Python tftf's API on a Rust core.

A :class:`Pipeline` of built-in pipes runs as one Rust job (streaming, bounded memory, all
cores, the GIL released); user pipes (:class:`Pipe` subclasses) run in the same stream in
Python. Records carry torch tensors when torch is installed, numpy arrays otherwise.

The API's names are imported on first use: the ``tftf`` command starts without importing
numpy (or torch), so no library thread exists before it takes the signals over.
"""

from importlib import import_module
from typing import Any

from tftf._core import TftfError

__version__ = "0.1.0"

_WHERE = {
    "Pipeline": "tftf.pipeline", "ReaderProtocol": "tftf.pipeline",
    "SafetensorsReader": "tftf.io.reader", "ShardedSafetensorsReader": "tftf.io.sharded_reader",
    "StreamingWriter": "tftf.io.writer", "ShardedWriter": "tftf.io.sharded_writer",
    "NullWriter": "tftf.io.null_writer", "ValidationReport": "tftf.io.null_writer",
    "GGUFWriter": "tftf.io.gguf_writer", "MergeReader": "tftf.io.merge_reader",
    "Pipe": "tftf.pipes.base", "CompoundPipe": "tftf.pipes.base",
    "TensorRecord": "tftf.pipes.base", "TensorMeta": "tftf.pipes.base",
    "PassthroughPipe": "tftf.pipes.passthrough", "DTypeCastPipe": "tftf.pipes.dtype_cast",
    "KeyFilterPipe": "tftf.pipes.key_filter", "KeyRenamePipe": "tftf.pipes.key_rename",
    "LoRAMergeBase": "tftf.pipes._lora_base", "LoRAMergePipe": "tftf.pipes.lora_merge",
    "DCPLoRAMergePipe": "tftf.pipes.dcp_lora_merge", "FP8DequantPipe": "tftf.pipes.fp8_dequant",
    "DequantPipe": "tftf.pipes.extra", "RepackFP4Pipe": "tftf.pipes.extra",
    "QuantizePipe": "tftf.pipes.extra",
}

__all__ = [*_WHERE, "TftfError"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tftf' has no attribute {name!r}")


def __dir__():
    return sorted(__all__ + ["__version__"])
