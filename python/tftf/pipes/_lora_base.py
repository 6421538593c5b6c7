"""What every LoRA merge pipe shares: the merge of each streamed weight with its adapter
tensors, and the checks that a merge did not silently do nothing.

Subclasses load the adapter in ``setup`` (filling ``_config``, ``_lora_weights`` and
``_adapter_key_set``). After the stream, the merge fails if the adapter has no LoRA pair, if no
base weight was merged (the output would equal the base model), if ``target_modules`` matched
nothing, or if a pair that targets a present module was never used.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from tftf import _tensor
from tftf.pipes.base import Pipe, TensorMeta, TensorRecord
from tftf.utils.lora import (
    LoRAConfig,
    find_grouped_lora_pairs,
    find_lora_keys,
    find_magnitude_key,
    merge_dora,
    merge_grouped_lora,
    merge_lora,
)

logger = logging.getLogger(__name__)


class LoRAMergeBase(Pipe):
    """Merges an adapter's LoRA (and DoRA) tensors into the weights streaming past; other
    tensors pass unchanged. Names, shapes and dtypes stay as they are."""

    def __init__(self, adapter_name: str = "default", scale: float = 1.0, device: str = "cpu") -> None:
        self.adapter_name = adapter_name
        self.scale = scale
        self.device = device
        self._config: Optional[LoRAConfig] = None
        self._lora_weights: Dict[str, Any] = {}
        self._adapter_key_set: Set[str] = set()

    @abstractmethod
    def setup(self) -> None:
        """Loads the adapter."""

    def _find_config(self, config_path, beside: Path) -> None:
        """The adapter's config: *config_path* when given, else ``adapter_config.json`` in
        *beside* if it exists."""
        self._explicit_config = config_path is not None
        if config_path is not None:
            self._config_path: Optional[Path] = Path(config_path)
        else:
            candidate = beside / "adapter_config.json"
            self._config_path = candidate if candidate.exists() else None

    def _load_config(self) -> LoRAConfig:
        if self._config_path is not None and self._config_path.exists():
            return LoRAConfig.from_file(self._config_path)
        logger.warning("%s: no adapter_config.json; using r=8, lora_alpha=8", self)
        return LoRAConfig.default()

    def teardown(self) -> None:
        self._lora_weights.clear()
        self._adapter_key_set.clear()
        self._config = None

    def process_meta(self, metas: Iterator[TensorMeta]) -> Iterator[TensorMeta]:
        yield from metas

    def process(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        if self._config is None:
            raise RuntimeError(f"{type(self).__name__}: setup() must be called before process() "
                               "(Pipeline.run() does it)")
        return self._stream(records)

    def _stream(self, records: Iterator[TensorRecord]) -> Iterator[TensorRecord]:
        cfg = self._config
        scale = self.scale * cfg.default_scale
        pairs = list(self._iter_adapter_pairs())
        used: Set[str] = set()
        merged_count = module_matched = 0
        for r in records:
            merged = None
            ndim = len(_tensor.shape_of(r.tensor))
            if cfg.matched_parameter(r.key) is not None and ndim == 3:
                candidates = self._select_grouped_pair(
                    find_grouped_lora_pairs(r.key.rsplit(".", 1)[0], self._adapter_key_set, self.adapter_name),
                    _tensor.shape_of(r.tensor))
                if len(candidates) > 1:
                    raise RuntimeError(f"{type(self).__name__}: ambiguous target_parameters LoRA for {r.key!r}: "
                                       f"{len(candidates)} adapter pairs match its shape; candidates {[a for a, _ in candidates]}")
                if candidates:
                    a_key, b_key = candidates[0]
                    merged = merge_grouped_lora(r.tensor, self._lora_weights[a_key], self._lora_weights[b_key], scale)
                    used.add(a_key)
            if merged is None:
                stem = r.key[: -len(".weight")] if r.key.endswith(".weight") else r.key
                if cfg.target_modules and not cfg.matches_module(stem):
                    yield r
                    continue
                module_matched += 1
                found = find_lora_keys(r.key, self._adapter_key_set, self.adapter_name)
                if found is None:
                    yield r
                    continue
                a_key, b_key, embedding = found
                a, b = self._lora_weights[a_key], self._lora_weights[b_key]
                magnitude = find_magnitude_key(r.key, self._adapter_key_set, self.adapter_name)
                if magnitude is not None:
                    merged = merge_dora(r.tensor, a, b, self._lora_weights[magnitude], scale, embedding)
                else:
                    merged = merge_lora(r.tensor, a, b, scale, embedding)
                used.add(a_key)
            merged_count += 1
            yield TensorRecord(key=r.key, tensor=merged, extra=r.extra)
            del merged
        self._validate_merge(pairs, used, merged_count, module_matched)

    def _iter_adapter_pairs(self) -> Iterator[Tuple[str, str, str, bool]]:
        """``(a_key, b_key, base module, is_parameter)`` of every A/B pair in the adapter."""
        for a_key in sorted(self._adapter_key_set):
            for a_mark, b_mark in ((".lora_A", ".lora_B"), (".lora_embedding_A", ".lora_embedding_B")):
                if a_mark in a_key:
                    b_key = a_key.replace(a_mark, b_mark)
                    if b_key in self._adapter_key_set:
                        stem = self._adapter_key_to_base_stem(a_key)
                        yield a_key, b_key, stem, self._is_parameter_stem(stem)
                    break

    @staticmethod
    def _adapter_key_to_base_stem(a_key: str) -> str:
        core = a_key[len("base_model.model."):] if a_key.startswith("base_model.model.") else a_key
        for mark in (".lora_A", ".lora_embedding_A"):
            if mark in core:
                core = core[: core.index(mark)]
                break
        while core.endswith(".base_layer"):
            core = core[: -len(".base_layer")]
        return core

    def _is_parameter_stem(self, stem: str) -> bool:
        owners = [p.rsplit(".", 1)[0] for p in self._config.target_parameters if "." in p]
        return any(stem == o or stem.endswith("." + o) for o in owners)

    def _select_grouped_pair(self, pairs: List[Tuple[str, str]], shape) -> List[Tuple[str, str]]:
        """The pairs whose stacked shapes fit a ``(E, out, in)`` or ``(E, in, out)`` weight."""
        experts, out = shape[0], []
        for a_key, b_key in pairs:
            a, b = _tensor.shape_of(self._lora_weights[a_key]), _tensor.shape_of(self._lora_weights[b_key])
            if len(a) != 2 or len(b) != 2 or b[1] != a[0] or experts == 0 or a[0] % experts:
                continue
            if tuple(shape) in ((experts, b[0], a[1]), (experts, a[1], b[0])):
                out.append((a_key, b_key))
        return out

    def _validate_merge(self, pairs: list, used: Set[str], merged: int, module_matched: int) -> None:
        name, cfg = type(self).__name__, self._config
        if not pairs:
            raise RuntimeError(f"{name}: the adapter contains no recognizable LoRA weights (no '.lora_A'/'.lora_B' "
                               f"pairs among {len(self._adapter_key_set)} tensors); is it a PEFT adapter?")
        if merged == 0:
            raise RuntimeError(f"{name}: LoRA merge matched ZERO base tensors, the output would equal the base model; "
                               f"the adapter's modules (e.g. {[p[2] for p in pairs[:3]]}) match no base weight")
        if cfg.target_modules and module_matched == 0 and not cfg.target_parameters:
            raise RuntimeError(f"{name}: target_modules {cfg.target_modules!r} matched no base tensors")
        missed = sorted({stem for a, _, stem, is_param in pairs
                         if a not in used and (is_param or cfg.matches_module(stem))})
        if missed:
            raise RuntimeError(f"{name}: {len(missed)} adapter LoRA module(s) were never merged despite targeting "
                               f"a present base weight: {missed[:8]}")

    def __repr__(self) -> str:
        n = len(self._lora_weights)
        return (f"{type(self).__name__}(adapter_name={self.adapter_name!r}, scale={self.scale}, "
                f"device={self.device!r}, {f'{n} tensors loaded' if n else 'not loaded'})")
