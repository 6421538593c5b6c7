"""PyTorch Distributed Checkpoint (DCP) directories, read by the Rust core (no
``torch.distributed`` needed): every tensor reassembled from its chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Union

from tftf import _core, _tensor


def load_dcp_state_dict(checkpoint_dir: Union[str, Path]) -> Dict[str, Any]:
    """The full tensors of the DCP checkpoint in *checkpoint_dir*, by name. A single wrapper
    level (axolotl's ``{"model": {...}}``) is removed from the names.

    Raises ``FileNotFoundError`` when the directory has no ``.metadata``.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").exists():
        raise FileNotFoundError(f"No .metadata file found in {checkpoint_dir}; is it a PyTorch DCP checkpoint directory?")
    ckpt = _core.Checkpoint(str(checkpoint_dir))
    tensors = {name: _tensor.from_buffer(ckpt.read(name), dtype, shape) for name, dtype, shape in ckpt.tensors()}
    heads = {name.split(".", 1)[0] for name in tensors}
    if len(heads) == 1 and all("." in n for n in tensors) and next(iter(heads)) in ("model", "state_dict"):
        tensors = {name.split(".", 1)[1]: t for name, t in tensors.items()}
    return tensors
