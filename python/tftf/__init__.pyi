"""Type stubs of the package's top level (its names are imported lazily)."""

from tftf._core import TftfError as TftfError
from tftf.io.gguf_writer import GGUFWriter as GGUFWriter
from tftf.io.merge_reader import MergeReader as MergeReader
from tftf.io.null_writer import NullWriter as NullWriter, ValidationReport as ValidationReport
from tftf.io.reader import SafetensorsReader as SafetensorsReader
from tftf.io.sharded_reader import ShardedSafetensorsReader as ShardedSafetensorsReader
from tftf.io.sharded_writer import ShardedWriter as ShardedWriter
from tftf.io.writer import StreamingWriter as StreamingWriter
from tftf.pipeline import Pipeline as Pipeline, ReaderProtocol as ReaderProtocol
from tftf.pipes._lora_base import LoRAMergeBase as LoRAMergeBase
from tftf.pipes.base import CompoundPipe as CompoundPipe, Pipe as Pipe, TensorMeta as TensorMeta, TensorRecord as TensorRecord
from tftf.pipes.dcp_lora_merge import DCPLoRAMergePipe as DCPLoRAMergePipe
from tftf.pipes.dtype_cast import DTypeCastPipe as DTypeCastPipe
from tftf.pipes.extra import DequantPipe as DequantPipe, QuantizePipe as QuantizePipe, RepackFP4Pipe as RepackFP4Pipe
from tftf.pipes.fp8_dequant import FP8DequantPipe as FP8DequantPipe
from tftf.pipes.key_filter import KeyFilterPipe as KeyFilterPipe
from tftf.pipes.key_rename import KeyRenamePipe as KeyRenamePipe
from tftf.pipes.lora_merge import LoRAMergePipe as LoRAMergePipe
from tftf.pipes.passthrough import PassthroughPipe as PassthroughPipe

__version__: str
__all__: list[str]
