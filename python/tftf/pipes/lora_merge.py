"""Merging a PEFT adapter (``adapter_model.safetensors`` with ``adapter_config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Union

from tftf.io.reader import SafetensorsReader
from tftf.pipes._lora_base import LoRAMergeBase


class LoRAMergePipe(LoRAMergeBase):
    """Merges the adapter at *adapter_path* into the weights.

    Args:
        adapter_path: the adapter's folder or its ``adapter_model.safetensors``.
        config_path: its ``adapter_config.json`` (default: beside the weights; without one,
            ``r=8, lora_alpha=8``).
        adapter_name: the PEFT adapter name in the tensor names (``default``).
        scale: a factor on top of ``lora_alpha / r``.
        device: accepted for upstream's signature.
    """

    def __init__(self, adapter_path: Union[str, Path], config_path: Optional[Union[str, Path]] = None,
                 adapter_name: str = "default", scale: float = 1.0, device: str = "cpu") -> None:
        super().__init__(adapter_name=adapter_name, scale=scale, device=device)
        path = Path(adapter_path)
        self.adapter_path = path if path.name.endswith(".safetensors") else path / "adapter_model.safetensors"
        self._find_config(config_path, self.adapter_path.parent)

    def setup(self) -> None:
        self._config = self._load_config()
        reader = SafetensorsReader(self.adapter_path)
        self._lora_weights = {r.key: r.tensor for r in reader.iter_records()}
        self._adapter_key_set = set(self._lora_weights)

    def _rust_sections(self) -> Optional[List[str]]:
        # The Rust merge reads adapter_config.json beside the weights; another config, another
        # adapter name, a missing config or one without target_modules runs in Python.
        if self._explicit_config or self._config_path is None or self.adapter_name != "default":
            return None
        try:
            modules = json.loads(self._config_path.read_text()).get("target_modules")
        except (OSError, ValueError, AttributeError):
            return None  # the Python merge reports the config's problem
        if not modules:
            # Upstream reads no target_modules as "every module"; PEFT (and the Rust merge)
            # as "none".
            return None
        return ["--merge-lora", f"--adapter={self.adapter_path}", f"--scale={self.scale!r}"]

    def __repr__(self) -> str:
        n = len(self._lora_weights)
        return (f"LoRAMergePipe(adapter={self.adapter_path.name!r}, scale={self.scale}, device={self.device!r}, "
                f"{f'{n} tensors' if n else 'not loaded'})")
