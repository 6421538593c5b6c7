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

# Each public name, by the module that defines it (upstream's module paths).
_MODULES = """
tftf.pipeline: Pipeline ReaderProtocol
tftf.io.reader: SafetensorsReader
tftf.io.sharded_reader: ShardedSafetensorsReader
tftf.io.writer: StreamingWriter
tftf.io.sharded_writer: ShardedWriter
tftf.io.null_writer: NullWriter ValidationReport
tftf.io.gguf_writer: GGUFWriter
tftf.io.merge_reader: MergeReader
tftf.pipes.base: Pipe CompoundPipe TensorRecord TensorMeta
tftf.pipes.passthrough: PassthroughPipe
tftf.pipes.dtype_cast: DTypeCastPipe
tftf.pipes.key_filter: KeyFilterPipe
tftf.pipes.key_rename: KeyRenamePipe
tftf.pipes._lora_base: LoRAMergeBase
tftf.pipes.lora_merge: LoRAMergePipe
tftf.pipes.dcp_lora_merge: DCPLoRAMergePipe
tftf.pipes.fp8_dequant: FP8DequantPipe
tftf.pipes.extra: DequantPipe RepackFP4Pipe QuantizePipe
"""
_WHERE = {
    name: module
    for module, names in (line.split(":") for line in _MODULES.strip().splitlines())
    for name in names.split()
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
