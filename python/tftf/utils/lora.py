"""PEFT LoRA and DoRA adapters: their config, finding a base weight's A/B (and magnitude)
tensors, and the merge formulas.

Merges compute in f32 and round once back to the weight's dtype:

* linear (2-D): ``W + s·(B @ A)``; embedding: ``W + s·(A @ B)``;
* convolution (3-D and up): the kernel flattened, ``B₂ @ A₂`` reshaped to the weight;
* DoRA: the merged weight scaled per output row to the learned magnitude ``m``;
* stacked experts (PEFT ``target_parameters``): per expert ``e``, ``B[:, :, e] @ A[e]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Set, Tuple, Union

import numpy as np

from tftf import _core, _tensor
from tftf._tensor import torch

_PREFIXES = ("base_model.model.", "")


@dataclass
class LoRAConfig:
    """What merging needs from ``adapter_config.json``."""

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: Union[List[str], str] = field(default_factory=list)
    target_parameters: List[str] = field(default_factory=list)
    adapter_name: str = "default"

    @property
    def default_scale(self) -> float:
        """``lora_alpha / r``."""
        return self.lora_alpha / self.r

    def matches_module(self, module_name: str) -> bool:
        """PEFT's ``target_modules`` rule: none matches all; a string is a regex matched
        against the whole name; a list matches a name equal to or ending in ``.entry``."""
        tm = self.target_modules
        if not tm:
            return True
        if isinstance(tm, str):
            return re.fullmatch(tm, module_name) is not None
        return any(module_name == m or module_name.endswith("." + m) for m in tm)

    def matched_parameter(self, key: str) -> Optional[str]:
        """The ``target_parameters`` entry *key* is (equal, or ending in ``.entry``)."""
        return next((p for p in self.target_parameters if key == p or key.endswith("." + p)), None)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "LoRAConfig":
        """Parses *path*; ``ValueError`` for a ``target_modules`` or ``target_parameters`` of
        the wrong type."""
        cfg = json.loads(Path(path).read_text())
        tm = cfg.get("target_modules") or []
        if not isinstance(tm, (str, list)):
            raise ValueError(f"{path}: 'target_modules' must be a string or list, got {type(tm).__name__}")
        tp = cfg.get("target_parameters") or []
        if not isinstance(tp, list):
            raise ValueError(f"{path}: 'target_parameters' must be a list, got {type(tp).__name__}")
        return cls(r=int(cfg.get("r", 8)), lora_alpha=float(cfg.get("lora_alpha", 8.0)),
                   target_modules=tm, target_parameters=list(tp))

    @classmethod
    def default(cls) -> "LoRAConfig":
        return cls()


def _linear_suffixes(name: str) -> List[Tuple[str, str]]:
    return [(f".lora_A.{name}.weight", f".lora_B.{name}.weight"), (".lora_A.weight", ".lora_B.weight"),
            (f".lora_A.{name}", f".lora_B.{name}"), (".lora_A", ".lora_B")]


def _embedding_suffixes(name: str) -> List[Tuple[str, str]]:
    return [(f".lora_embedding_A.{name}", f".lora_embedding_B.{name}"), (".lora_embedding_A", ".lora_embedding_B")]


def find_lora_keys(base_key: str, adapter_key_set: Set[str], adapter_name: str = "default") -> Optional[Tuple[str, str, bool]]:
    """``(a_key, b_key, is_embedding)`` of *base_key*'s LoRA pair in the adapter, or None."""
    stem = base_key[: -len(".weight")] if base_key.endswith(".weight") else base_key
    for prefix in _PREFIXES:
        for suffixes, embedding in ((_linear_suffixes(adapter_name), False), (_embedding_suffixes(adapter_name), True)):
            for a, b in suffixes:
                if prefix + stem + a in adapter_key_set and prefix + stem + b in adapter_key_set:
                    return prefix + stem + a, prefix + stem + b, embedding
    return None


def find_grouped_lora_pairs(module_path: str, adapter_key_set: Set[str], adapter_name: str = "default") -> List[Tuple[str, str]]:
    """Every ``(a_key, b_key)`` hung on *module_path* by ``target_parameters`` (PEFT nests
    wrappers as ``.base_layer``, which are ignored)."""
    pairs: List[Tuple[str, str]] = []
    for prefix in _PREFIXES:
        for a_suf, b_suf in _linear_suffixes(adapter_name):
            for a_key in sorted(adapter_key_set):
                if not a_key.endswith(a_suf) or not a_key.startswith(prefix):
                    continue
                core = a_key[len(prefix): -len(a_suf)]
                reduced = core
                while reduced.endswith(".base_layer"):
                    reduced = reduced[: -len(".base_layer")]
                pair = (a_key, prefix + core + b_suf)
                if reduced == module_path and pair[1] in adapter_key_set and pair not in pairs:
                    pairs.append(pair)
    return pairs


def find_magnitude_key(base_key: str, adapter_key_set: Set[str], adapter_name: str = "default") -> Optional[str]:
    """*base_key*'s DoRA magnitude vector in the adapter, or None (plain LoRA)."""
    stem = base_key[: -len(".weight")] if base_key.endswith(".weight") else base_key
    for prefix in _PREFIXES:
        for suffix in (f".lora_magnitude_vector.{adapter_name}.weight", ".lora_magnitude_vector.weight",
                       f".lora_magnitude_vector.{adapter_name}", ".lora_magnitude_vector"):
            if prefix + stem + suffix in adapter_key_set:
                return prefix + stem + suffix
    return None


def _like(values: np.ndarray, like: Any) -> Any:
    """f32 *values* rounded once to *like*'s dtype, as the same kind of tensor."""
    values = np.ascontiguousarray(values, np.float32)
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.from_numpy(values).to(like.dtype)
    name = _tensor.dtype_of(like)
    if name == "F32":
        return values
    return _tensor.from_buffer(_core.cast(values.tobytes(), "F32", name), name, values.shape)


def _delta(w: np.ndarray, a: np.ndarray, b: np.ndarray, is_embedding: bool, what: str) -> np.ndarray:
    if w.ndim == 2:
        return a @ b if is_embedding else b @ a
    if w.ndim >= 3:
        out_ch, r = b.shape[0], b.shape[1]
        return (b.reshape(out_ch, r) @ a.reshape(r, -1)).reshape((out_ch, a.shape[1]) + a.shape[2:])
    raise ValueError(f"{what}: weight has ndim={w.ndim}, shape={tuple(w.shape)}; expected ndim >= 2")


def merge_lora(weight: Any, lora_a: Any, lora_b: Any, scale: float, is_embedding: bool = False) -> Any:
    """*weight* with its LoRA merged (see the module docs); ``ValueError`` below 2-D."""
    w = _tensor.to_f32(weight)
    return _like(w + np.float32(scale) * _delta(w, _tensor.to_f32(lora_a), _tensor.to_f32(lora_b), is_embedding, "merge_lora"), weight)


def merge_dora(weight: Any, lora_a: Any, lora_b: Any, magnitude: Any, scale: float, is_embedding: bool = False) -> Any:
    """*weight* with its DoRA merged: the LoRA merge, each output row scaled to ``magnitude``."""
    w = _tensor.to_f32(weight)
    merged = w + np.float32(scale) * _delta(w, _tensor.to_f32(lora_a), _tensor.to_f32(lora_b), is_embedding, "merge_dora")
    norm = np.sqrt((merged.reshape(merged.shape[0], -1).astype(np.float32) ** 2).sum(axis=1))
    factor = _tensor.to_f32(magnitude).reshape(-1) / np.maximum(norm, np.float32(1e-8))
    return _like(factor.reshape((-1,) + (1,) * (merged.ndim - 1)) * merged, weight)


def merge_grouped_lora(weight: Any, lora_a: Any, lora_b: Any, scale: float) -> Any:
    """A stacked-expert weight ``(E, out, in)`` or ``(E, in, out)`` with its
    ``target_parameters`` LoRA merged (PEFT's layout: A ``(E·r, in)``, B ``(out, E·r)``)."""
    if len(_tensor.shape_of(weight)) != 3:
        raise ValueError(f"merge_grouped_lora: expected a 3-D stacked-expert weight, got shape {_tensor.shape_of(weight)}")
    w, a, b = _tensor.to_f32(weight), _tensor.to_f32(lora_a), _tensor.to_f32(lora_b)
    experts, er = w.shape[0], a.shape[0]
    if b.shape[1] != er:
        raise ValueError(f"merge_grouped_lora: lora_A rows ({er}) and lora_B cols ({b.shape[1]}) disagree")
    if er % experts:
        raise ValueError(f"merge_grouped_lora: stacked rank {er} is not divisible by num_experts {experts}")
    r, n_in, n_out = er // experts, a.shape[1], b.shape[0]
    a3, b3 = a.reshape(experts, r, n_in), b.reshape(n_out, r, experts)
    if w.shape == (experts, n_out, n_in):
        delta = np.einsum("ore,eri->eoi", b3, a3)
    elif w.shape == (experts, n_in, n_out):
        delta = np.einsum("ore,eri->eio", b3, a3)
    else:
        raise ValueError(f"merge_grouped_lora: cannot reconcile weight shape {tuple(w.shape)} with LoRA "
                         f"(experts={experts}, out={n_out}, in={n_in})")
    return _like(w + np.float32(scale) * delta, weight)
