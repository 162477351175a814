"""Fusion: observers sharing one TENSOR_GROUP global scale (e.g. q/k/v).

``Observer.fuse(observers)`` links observers whose layers vLLM runs as one
fused matmul, so that they share ``global_scale = generate_gparam(-a, a)``,
``a`` the absolute maximum over the whole group (docs/spec.md §1). A fused
observer may hold its module by weak reference: when the global scale is
needed and it holds no statistics, it observes ``module.weight`` then.
Statistics are dropped only once every observer of the group has called
``get_qparams``.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional

import torch
from compressed_tensors.quantization import QuantizationStrategy
from compressed_tensors.quantization.utils import generate_gparam

__all__ = ["Fusion"]


class Fusion:
    """The fusion half of ``Observer`` (a mixin: ``Observer`` inherits it)."""

    # set by Observer.__init__: the observers fused with this one, its
    # module (weak reference), whether it has taken its qparams this round
    _fused_with: List
    _fused_module: Optional[weakref.ref]
    _qparams_taken: bool

    @property
    def is_fused(self) -> bool:
        return bool(self._fused_with)

    @classmethod
    def fuse(cls, observers: Iterable) -> None:
        """Share one TENSOR_GROUP global scale among ``observers`` (e.g. q/k/v).

        Each item is an observer or an ``(observer, module)`` pair. With a
        module, an observer that holds no statistics when the global scale is
        needed observes ``module.weight`` (held by weak reference); without
        one, every fused observer must have been observed first. Statistics
        are dropped only once every fused observer has called ``get_qparams``.
        """
        members: List[Fusion] = []
        modules: List[Optional[torch.nn.Module]] = []
        for item in observers:
            obs, mod = item if isinstance(item, tuple) else (item, None)
            if not isinstance(obs, Fusion):
                raise TypeError(
                    f"Observer.fuse expects observers or (observer, module) pairs, "
                    f"got {type(obs).__name__}"
                )
            if obs.args.strategy != QuantizationStrategy.TENSOR_GROUP:
                raise ValueError(
                    "Observer.fuse: only 'tensor_group' observers share a global "
                    f"scale, got strategy {obs.args.strategy!r}"
                )
            if mod is not None and not isinstance(mod, torch.nn.Module):
                raise TypeError(f"Observer.fuse: module must be a torch.nn.Module, got {type(mod).__name__}")
            if any(obs is m for m in members):
                raise ValueError("Observer.fuse: the same observer appears twice")
            members.append(obs)
            modules.append(mod)
        for obs, mod in zip(members, modules):
            obs._fused_with = [m for m in members if m is not obs]
            obs._fused_module = weakref.ref(mod) if mod is not None else None
            obs._qparams_taken = False

    def _fusion_group(self) -> list:
        return [self] + self._fused_with

    def _fused_module_weight(self) -> Optional[torch.Tensor]:
        module = self._fused_module() if self._fused_module is not None else None
        return getattr(module, "weight", None) if module is not None else None

    def _observe_fused_modules(self) -> None:
        """Like llm-compressor: observing one fused weight also observes the
        weights of the modules fused with it, while they are at hand."""
        for obs in self._fused_with:
            if not obs.has_statistics:
                weight = obs._fused_module_weight()
                if weight is not None:
                    obs(weight)

    def _fused_statistics(self) -> List[Dict[str, torch.Tensor]]:
        stats = []
        for obs in self._fusion_group():
            if not obs.has_statistics:
                weight = obs._fused_module_weight()
                if weight is not None:
                    obs(weight)
            if not obs.has_statistics:
                raise RuntimeError(
                    f"fused {type(obs).__name__} ({obs.base_name!r}) holds no statistics: "
                    "every fused observer must be observed before get_qparams"
                )
            stats.append(obs.get_statistics())
        return stats

    def get_global_scale(self) -> Optional[torch.Tensor]:
        """``generate_gparam(-a, a)`` over the fusion group for TENSOR_GROUP, else None."""
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        absmax = None
        for stats in self._fused_statistics():
            # max(max_vals.max(), -min_vals.min()) in one reduction (NaN propagates either way)
            a = torch.maximum(stats["max_vals"], -stats["min_vals"]).max()
            absmax = a if absmax is None else torch.maximum(absmax, a)
        return generate_gparam(-absmax.reshape(1), absmax.reshape(1))

    def delete_statistics(self, check_fused: bool = True) -> None:
        """Drop the statistics; a fused observer waits for its whole group."""
        if not check_fused or not self.is_fused:
            self._drop_statistics()
            return
        self._qparams_taken = True
        group = self._fusion_group()
        if all(obs._qparams_taken for obs in group):
            for obs in group:
                obs._qparams_taken = False
                obs._drop_statistics()
