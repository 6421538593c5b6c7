"""A GGUF file for llama.cpp, written by the Rust GGUF writer (as ``tftf gguf``): tensor names,
metadata and the tokenizer follow the architecture in the checkpoint's ``config.json``.

``arch`` and ``vocab_pre`` are ``tftf gguf``'s ``--arch`` and ``--vocab-pre``. GGUF needs the checkpoint's side files (config, tokenizer), so a pipeline with this writer must
read from a checkpoint path and run built-in pipes only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union


class GGUFWriter:
    """The GGUF output.

    Args:
        path: the ``.gguf`` file.
        outtype: tensor type, as ``tftf gguf --outtype``: ``"auto"`` (the checkpoint's
            BF16/F16), ``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``, or a llama-quantize type
            with its per-tensor choices (``"q4_k_m"``, ``"q6_k"``, ``"iq4_xs"`` …).
        force: replace an existing file.
        arch: treat the model as this architecture (``tftf gguf --arch``): a ``config.json``
            class name (``"LlamaForCausalLM"``) or a GGUF architecture (``"llama"``).
        vocab_pre: the ``tokenizer.ggml.pre`` to write (``tftf gguf --vocab-pre``) when
            llama.cpp does not know the tokenizer's pre-tokenizer by its hash.
    """

    def __init__(self, path: Union[str, Path], outtype: str = "auto", force: bool = False,
                 arch: Optional[str] = None, vocab_pre: Optional[str] = None) -> None:
        if not isinstance(outtype, str) or not outtype:
            raise ValueError(f"unknown GGUF outtype {outtype!r} (auto, f32, f16, bf16, q8_0, q4_k_m …)")
        self.path = Path(path)
        self.outtype = outtype
        self.force = force
        self.arch = arch
        self.vocab_pre = vocab_pre

    def _refuse_existing(self) -> None:
        if self.path.exists() and not self.force:
            raise FileExistsError(f"{self.path} exists; pass force=True to replace it")

    def _rust_output(self) -> Optional[dict]:
        return {"kind": "gguf", "path": str(self.path), "max_shard_size": None, "outtype": self.outtype, "force": self.force,
                "arch": self.arch, "vocab_pre": self.vocab_pre}

    def __repr__(self) -> str:
        return f"GGUFWriter({str(self.path)!r}, outtype={self.outtype!r})"
