"""The Observer base class: lifecycle, registry, fusion and DDP synchronisation.

An observer watches values (a weight, activations or attention states),
keeps per-group statistics ``min_vals`` / ``max_vals`` and turns them into
quantization parameters with compressed-tensors' ``calculate_qparams`` (SPEC §1).
Subclasses decide two things only:

- ``_measure(value)``: the (min_vals, max_vals) of one value, computed by an
  ``obskernels.ops`` operation (min/max or the MSE shrink-grid search);
- ``_accumulate(min_vals, max_vals)``: how those merge into what is held
  (replace, running min/max, moving average).
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, Iterable, List, Optional, Tuple, TypedDict

import torch
import torch.distributed as dist
from compressed_tensors import InternalModule
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.registry.registry import RegistryMixin

from obskernels.validation import ACTIVATIONS, ATTENTION, WEIGHT, check_base_name

__all__ = ["Observer", "QParamsDict", "MinMaxTuple"]

MinMaxTuple = Tuple[torch.Tensor, torch.Tensor]


class QParamsDict(TypedDict, total=False):
    """What ``Observer.get_qparams`` returns."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: Optional[torch.Tensor]


def _number(name: str, value, *, integer: bool = False):
    """``value`` as a Python number, or TypeError naming the keyword."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"observer kwarg {name!r} must be {kind}, got {value!r}")
    return value


def check_averaging_constant(c) -> float:
    _number("averaging_constant", c)
    if not math.isfinite(c) or not 0 <= c <= 1:
        raise ValueError(f"observer kwarg 'averaging_constant' must be in [0, 1], got {c!r}")
    return c


def moving_average(old: torch.Tensor, new: torch.Tensor, c: float) -> torch.Tensor:
    """``old * (1 - c) + new * c`` in the statistics' dtype (not torch.lerp:
    its rounding differs, and llm-compressor writes it out this way)."""
    return old * (1.0 - c) + new * c


class Observer(InternalModule, RegistryMixin):
    """Computes quantization parameters from observed values.

    :param base_name: "weight", "input", "output", "q", "k" or "v": how a value
        is flattened into groups (SPEC §2).
    :param args: compressed-tensors ``QuantizationArgs``; ``observer_kwargs`` are
        merged into ``args.observer_kwargs`` (the object is updated in place,
        as llm-compressor does).

    ``observer(value)`` updates the statistics and returns the observer;
    ``get_qparams()`` returns ``{"scale", "zero_point", "global_scale"}`` and
    drops them. Load by name with
    ``Observer.load_from_registry(name, base_name=..., args=..., **kwargs)``.
    """

    #: statistic name -> reduce op used by ``sync_activation_stats``
    _act_sync_dict: Dict[str, dist.ReduceOp] = {}

    #: attributes that make up the per-group statistics
    _stats_attrs: Tuple[str, ...] = ("min_vals", "max_vals")

    def __init__(self, base_name: str, args: QuantizationArgs, **observer_kwargs):
        super().__init__()
        check_base_name(base_name)
        if not isinstance(args, QuantizationArgs):
            raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
        self.base_name = base_name
        self.args = args
        self.args.observer_kwargs = self.args.observer_kwargs or {}
        self.args.observer_kwargs.update(observer_kwargs)

        self._num_observed_tokens = 0
        # fusion bookkeeping (TENSOR_GROUP global scale shared across observers)
        self._fused_with: List["Observer"] = []
        self._fused_module: Optional[weakref.ref] = None
        self._qparams_taken = False

    # ------------------------------------------------------------------ state

    @property
    def has_statistics(self) -> bool:
        return all(getattr(self, a, None) is not None for a in self._stats_attrs)

    @property
    def is_weight_obs(self) -> bool:
        return self.base_name == WEIGHT

    @property
    def is_fused(self) -> bool:
        return bool(self._fused_with)

    def get_statistics(self) -> Dict[str, torch.Tensor]:
        self._require_statistics()
        return {a: getattr(self, a) for a in self._stats_attrs}

    def _require_statistics(self) -> None:
        if not self.has_statistics:
            raise RuntimeError(
                f"{type(self).__name__} ({self.base_name!r}) holds no statistics: "
                "call observer(value) with a non-empty value first"
            )

    # -------------------------------------------------------------- observing

    @torch.no_grad()
    def forward(self, value: torch.Tensor) -> "Observer":
        """Update the statistics from ``value``; returns the observer itself."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}")
        if value.numel() == 0:
            return self
        # a weight does not change during calibration: observe it once
        if self.is_weight_obs and self.has_statistics:
            return self
        self._accumulate(*self._compute_statistics(value))
        self._count_tokens(value)
        # like llm-compressor: observing one fused weight also observes the
        # weights of the modules fused with it, while they are at hand
        self._observe_fused_modules()
        return self

    def _compute_statistics(self, value: torch.Tensor) -> MinMaxTuple:
        """The (min_vals, max_vals) of ONE value, before any accumulation.

        Every observation passes here and only here: a policy for inputs that
        are not finite (NaN / inf), should one be added, belongs in this method.
        Today NaN propagates as in torch.amin / amax (SPEC §2).
        """
        return self._measure(value)

    def _measure(self, value: torch.Tensor) -> MinMaxTuple:
        """(min_vals, max_vals) of one value through an ``obskernels.ops`` operation."""
        raise NotImplementedError(f"{type(self).__name__} does not define _measure")

    def _accumulate(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        """Default: keep the latest value's statistics."""
        self.min_vals, self.max_vals = min_vals, max_vals

    def _count_tokens(self, value: torch.Tensor) -> None:
        if self.base_name in ACTIVATIONS:
            # (tokens, hidden) or (batch, seq, hidden)
            tokens = value.numel() // value.shape[-1]
        elif self.base_name in ATTENTION:
            # (batch, heads, seq, head_dim): a token spans every head
            tokens = value.shape[0] * value.shape[2]
        else:
            return
        self._num_observed_tokens += int(tokens)

    # -------------------------------------------------------------- qparams

    @torch.no_grad()
    def get_qparams(self) -> QParamsDict:
        """Scale, zero point and global scale from the statistics, which are then dropped.

        ``calculate_qparams(min_vals, max_vals, args, global_scale)``; for
        TENSOR_GROUP ``global_scale = generate_gparam(-a, a)`` with ``a`` the
        absolute max over this observer and every observer fused with it.
        """
        self._require_statistics()
        global_scale = self.get_global_scale()
        scale, zero_point = calculate_qparams(
            min_vals=self.min_vals,
            max_vals=self.max_vals,
            quantization_args=self.args,
            global_scale=global_scale,
        )
        self.delete_statistics()
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    def get_global_scale(self) -> Optional[torch.Tensor]:
        """``generate_gparam(-a, a)`` over the fusion group for TENSOR_GROUP, else None."""
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        absmax = None
        for stats in self._fused_statistics():
            for a in (stats["max_vals"].max(), -stats["min_vals"].min()):
                absmax = a if absmax is None else torch.maximum(absmax, a)
        return generate_gparam(-absmax.reshape(1), absmax.reshape(1))

    # ---------------------------------------------------------------- fusion

    @classmethod
    def fuse(cls, observers: Iterable) -> None:
        """Share one TENSOR_GROUP global scale among ``observers`` (e.g. q/k/v).

        Each item is an observer or an ``(observer, module)`` pair. With a
        module, an observer that holds no statistics when the global scale is
        needed observes ``module.weight`` (held by weak reference); without
        one, every fused observer must have been observed first. Statistics
        are dropped only once every fused observer has called ``get_qparams``.
        """
        members: List[Observer] = []
        modules: List[Optional[torch.nn.Module]] = []
        for item in observers:
            obs, mod = item if isinstance(item, tuple) else (item, None)
            if not isinstance(obs, Observer):
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

    def _fusion_group(self) -> List["Observer"]:
        return [self] + self._fused_with

    def _fused_module_weight(self) -> Optional[torch.Tensor]:
        module = self._fused_module() if self._fused_module is not None else None
        return getattr(module, "weight", None) if module is not None else None

    def _observe_fused_modules(self) -> None:
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

    def _drop_statistics(self) -> None:
        for a in self._stats_attrs:
            if hasattr(self, a):
                delattr(self, a)

    # ------------------------------------------------------------------- DDP

    def sync_activation_stats(self) -> List[dist.Work]:
        """All-reduce the statistics named in ``_act_sync_dict`` across ranks.

        Returns the async handles; wait on them before reading the statistics.
        AVG is native on NCCL; on other backends (gloo has no AVG) each rank
        divides by the world size and the values are summed, which is exact
        for a power-of-two world size.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "sync_activation_stats needs an initialized torch.distributed process group"
            )
        native_avg = dist.get_backend() == "nccl"
        world = dist.get_world_size()
        handles = []
        for name, op in self._act_sync_dict.items():
            value = getattr(self, name, None)
            if value is None:
                continue
            if op == dist.ReduceOp.AVG and not native_avg:
                value.div_(world)
                op = dist.ReduceOp.SUM
            handles.append(dist.all_reduce(value, op=op, async_op=True))
        return handles

    # ---------------------------------------------------------------- hooks

    def attach(self, module: torch.nn.Module) -> None:
        """Called when the observer is attached to ``module`` (no-op here)."""

    def detach(self, module: torch.nn.Module) -> None:
        """Called before the observer is removed from ``module`` (no-op here)."""

    def extra_repr(self) -> str:
        return f"base_name={self.base_name!r}, strategy={self.args.strategy!r}"
