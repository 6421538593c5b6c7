"""A GGUF file for llama.cpp, written by the Rust GGUF writer (as ``tftf gguf``): tensor names,
metadata and the tokenizer follow the architecture in the checkpoint's ``config.json``.

GGUF needs the checkpoint's side files (config, tokenizer), so a pipeline with this writer must
read from a checkpoint path and run built-in pipes only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union


class GGUFWriter:
    """The GGUF output.

    Args:
        path: the ``.gguf`` file.
        outtype: tensor type: ``"auto"`` (the checkpoint's BF16/F16), ``"f32"``, ``"f16"``,
            ``"bf16"`` or ``"q8_0"``.
        force: replace an existing file.
    """

    def __init__(self, path: Union[str, Path], outtype: str = "auto", force: bool = False) -> None:
        if outtype not in ("auto", "f32", "f16", "bf16", "q8_0"):
            raise ValueError(f"unknown GGUF outtype {outtype!r} (auto, f32, f16, bf16, q8_0)")
        self.path = Path(path)
        self.outtype = outtype
        self.force = force

    def _refuse_existing(self) -> None:
        if self.path.exists() and not self.force:
            raise FileExistsError(f"{self.path} exists; pass force=True to replace it")

    def _rust_output(self) -> Optional[dict]:
        return {"kind": "gguf", "path": str(self.path), "max_shard_size": None, "outtype": self.outtype, "force": self.force}

    def __repr__(self) -> str:
        return f"GGUFWriter({str(self.path)!r}, outtype={self.outtype!r})"
