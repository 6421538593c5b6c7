"""Type stubs of the Rust extension (``python/src/``)."""

from typing import Callable, List, Optional, Sequence, Tuple, TypedDict

class TftfError(RuntimeError): ...

class WriterSpec(TypedDict):
    kind: str
    path: Optional[str]
    max_shard_size: Optional[int]
    outtype: Optional[str]
    force: bool
    arch: Optional[str]
    vocab_pre: Optional[str]

def cli_main(argv: Sequence[str]) -> int: ...
def run_pipeline(
    input: str,
    sections: Sequence[str],
    writer: WriterSpec,
    threads: Optional[int] = ...,
    memory_budget: Optional[int] = ...,
    device: str = ...,
    progress: Optional[Callable[[int, int, str], None]] = ...,
) -> str: ...
def cast(data: bytes, src: str, dst: str) -> bytearray: ...
def dequant_fp8(
    weight: bytes,
    fmt: str,
    rows: int,
    cols: int,
    scale: List[float],
    scale_cols: int,
    block: Tuple[int, int],
    dst: str,
) -> bytearray: ...

class Checkpoint:
    def __init__(self, path: str) -> None: ...
    def tensors(self) -> List[Tuple[str, str, List[int]]]: ...
    def metadata_json(self) -> Optional[str]: ...
    def files(self) -> List[str]: ...
    def read(self, name: str) -> bytearray: ...

class Lent:
    """A streamed tensor's in-memory file, to give back to the stream once nothing maps it."""
    def give_back(self) -> None: ...

class WriteBehind:
    """Pushes a sequentially written file to disk behind a window and drops it from the cache."""
    def __init__(self, fd: int, path: str, start: int) -> None: ...
    def advance(self, end: int) -> None: ...
    def finish(self) -> None: ...

class RecordStream:
    def tensors(self) -> List[Tuple[str, str, List[int]]]: ...
    def __iter__(self) -> "RecordStream": ...
    def __next__(self) -> Tuple[str, str, List[int], int, int, Lent]: ...
    def close(self) -> None: ...

def stream_records(
    input: str,
    sections: Sequence[str],
    threads: Optional[int] = ...,
    memory_budget: Optional[int] = ...,
    device: str = ...,
) -> RecordStream: ...

def merge_donor(config: str) -> str: ...
