"""Merging a LoRA adapter saved as an FSDP DCP checkpoint (``pytorch_model_fsdp_0/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from tftf.pipes._lora_base import LoRAMergeBase
from tftf.utils.dcp import load_dcp_state_dict


class DCPLoRAMergePipe(LoRAMergeBase):
    """Merges the LoRA tensors of the DCP checkpoint in *checkpoint_dir*.

    Args:
        checkpoint_dir: the DCP directory (with ``.metadata``).
        config_path: ``adapter_config.json`` (default: the one beside *checkpoint_dir*).
        adapter_name, scale, device: as for :class:`~tftf.pipes.lora_merge.LoRAMergePipe`.
    """

    def __init__(self, checkpoint_dir: Union[str, Path], config_path: Optional[Union[str, Path]] = None,
                 adapter_name: str = "default", scale: float = 1.0, device: str = "cpu") -> None:
        super().__init__(adapter_name=adapter_name, scale=scale, device=device)
        self.checkpoint_dir = Path(checkpoint_dir)
        self._find_config(config_path, self.checkpoint_dir.parent)

    def setup(self) -> None:
        self._config = self._load_config()
        weights = load_dcp_state_dict(self.checkpoint_dir)
        for key, value in weights.items():
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(f"DCP checkpoint key {key!r} holds a {type(value).__name__}, not a tensor: "
                                f"{self.checkpoint_dir} looks like an optimizer state dict; pass the model's DCP "
                                "directory (e.g. pytorch_model_fsdp_0/)")
        self._lora_weights = weights
        self._adapter_key_set = set(self._lora_weights)

    def __repr__(self) -> str:
        n = len(self._lora_weights)
        return (f"DCPLoRAMergePipe(checkpoint_dir={self.checkpoint_dir.name!r}, scale={self.scale}, "
                f"device={self.device!r}, {f'{n} tensors' if n else 'not loaded'})")
