"""The Observer base class: lifecycle, registry, fusion and DDP synchronisation.

An observer watches values (a weight, activations or attention states),
keeps per-group statistics ``min_vals`` / ``max_vals`` and turns them into
quantization parameters with compressed-tensors' ``calculate_qparams`` (docs/spec.md §1).
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

from obskernels.observers.sync import SNAPSHOTS, SyncHandle, sync_statistics
from obskernels.validation import (
    ACTIVATIONS,
    ATTENTION,
    WEIGHT,
    all_finite,
    check_base_name,
    count_nonfinite,
)

__all__ = ["Observer", "QParamsDict", "MinMaxTuple", "NONFINITE_POLICIES", "UnknownObserverError"]

#: values of the ``nonfinite`` observer kwarg (the first is the default)
NONFINITE_POLICIES = ("error", "propagate")

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


class UnknownObserverError(KeyError):
    """An observer name nobody registered. A KeyError like the registry's own,
    printed as written (a plain KeyError shows its message quoted, with
    literal \\n)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Observer(InternalModule, RegistryMixin):
    """Computes quantization parameters from observed values.

    :param base_name: "weight", "input", "output", "q", "k" or "v": how a value
        is flattened into groups (docs/spec.md §2).
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

    @classmethod
    def get_value_from_registry(cls, name: str):
        """The class registered as ``name`` ('_' and '-' are interchangeable);
        an unknown name is an ``UnknownObserverError`` (a KeyError, as the
        registry raises) listing the registered names one per line."""
        try:
            return super().get_value_from_registry(name=name)
        except KeyError:
            names = [n.replace("-", "_") for n in cls.registered_names()]
            listed = "".join(f"\n  {n}" for n in names)
            raise UnknownObserverError(
                f"no observer is registered as {name!r}; registered observers:{listed}"
            ) from None

    def __init__(self, base_name: str, args: QuantizationArgs, **observer_kwargs):
        super().__init__()
        check_base_name(base_name)
        if not isinstance(args, QuantizationArgs):
            raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
        self.base_name = base_name
        self.args = args
        self.args.observer_kwargs = self.args.observer_kwargs or {}
        self.args.observer_kwargs.update(observer_kwargs)
        nonfinite = self.args.observer_kwargs.get("nonfinite", NONFINITE_POLICIES[0])
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"observer kwarg 'nonfinite' must be one of {NONFINITE_POLICIES}, got {nonfinite!r}"
            )
        self.nonfinite: str = nonfinite

        self._num_observed_tokens = 0
        # fusion bookkeeping (TENSOR_GROUP global scale shared across observers)
        self._fused_with: List["Observer"] = []
        self._fused_module: Optional[weakref.ref] = None
        self._qparams_taken = False
        # set when get_qparams dropped the statistics, for the error of a second call
        self._consumed_by_get_qparams = False

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
        if not self.has_statistics and self._consumed_by_get_qparams:
            raise RuntimeError(
                f"{type(self).__name__} ({self.base_name!r}) holds no statistics: the "
                "previous get_qparams() consumed them (it drops the statistics it "
                "computes from); observe new values with observer(value) before "
                "calling get_qparams() again"
            )
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
        self._consumed_by_get_qparams = False
        self._count_tokens(value)
        # like llm-compressor: observing one fused weight also observes the
        # weights of the modules fused with it, while they are at hand
        self._observe_fused_modules()
        return self

    def _compute_statistics(self, value: torch.Tensor) -> MinMaxTuple:
        """The (min_vals, max_vals) of ONE value, before any accumulation.

        Every observation passes here and only here, so the checks that keep
        held statistics intact live here; each raises before anything is
        accumulated or counted, so an observer that refused a value keeps its
        previous statistics and stays usable:

        - a value whose statistics cannot merge with those held (another
          hidden size or device) is a ValueError naming both shapes;
        - ``nonfinite="error"`` (default): a value holding NaN or +-inf is a
          ValueError naming the observer, the tensor and how many values are
          not finite. A non-finite element always makes its group's min or
          max non-finite (NaN propagates, +-inf is the extreme), so the check
          reads only the qparam-sized statistics (``all_finite``: a few tiny
          ops, one host sync); the value itself is scanned only on the error
          path, to count.
          ``nonfinite="propagate"``: NaN / inf flow into the statistics and
          the qparams, as in llm-compressor (docs/spec.md §2).
        """
        min_vals, max_vals = self._measure(value)
        self._check_mergeable(value, min_vals)
        if self.nonfinite == "error" and min_vals.device.type != "meta":
            if not all_finite(min_vals, max_vals):
                self._raise_nonfinite(value, min_vals, max_vals)
        return min_vals, max_vals

    def _describe(self) -> str:
        return f"{type(self).__name__}(base_name={self.base_name!r})"

    def _check_mergeable(self, value: torch.Tensor, min_vals: torch.Tensor) -> None:
        # only observers that combine old and new statistics care: a memoryless
        # one replaces them (TOKEN statistics follow the sequence length)
        if not self.has_statistics or type(self)._accumulate is Observer._accumulate:
            return
        held = self.min_vals
        if min_vals.shape != held.shape and self.args.strategy == QuantizationStrategy.TOKEN:
            self._check_token_positions(value, min_vals, held)
        elif min_vals.shape != held.shape:
            raise ValueError(
                f"{self._describe()}: this value of shape {tuple(value.shape)} gives "
                f"statistics of shape {tuple(min_vals.shape)}, but the observer holds "
                f"statistics of shape {tuple(held.shape)} from earlier values; expected "
                "the same hidden size on every observation (statistics kept)"
            )
        if min_vals.device != held.device:
            raise ValueError(
                f"{self._describe()}: this value is on {value.device} but the observer "
                f"holds statistics on {held.device}; expected the same device on every "
                "observation (statistics kept)"
            )

    def _check_token_positions(self, value, min_vals, held) -> None:
        """TOKEN statistics hold one entry per sequence position, so a value
        with another sequence length gives another shape. Like llm-compressor
        (its running min/max and moving average are broadcasting torch ops),
        statistics of ONE position merge with any length (and any held length
        with a one-token value); other lengths cannot be merged."""
        try:
            torch.broadcast_shapes(min_vals.shape, held.shape)
            return
        except RuntimeError:
            pass
        raise ValueError(
            f"{self._describe()}: strategy 'token' keeps one statistic per sequence "
            f"position; this value of shape {tuple(value.shape)} has "
            f"{min_vals.numel()} token positions, but the observer holds statistics for "
            f"{held.numel()} positions from earlier values (the hidden size is not the "
            "problem). Observe values of the same sequence length (or of length 1, which "
            "broadcasts as in llm-compressor), or use memoryless_minmax, which keeps only "
            "the latest value (statistics kept)"
        )

    def _raise_nonfinite(self, value, min_vals, max_vals) -> None:
        what = f"the observed {self.base_name} tensor (shape {tuple(value.shape)}, {value.dtype})"
        bad, counts = count_nonfinite(value)
        if bad == 0:
            # finite values, non-finite statistics: the search range overflowed
            expand = getattr(self, "expand", 1.0)
            raise ValueError(
                f"{self._describe()}: {what} is finite but its statistics are not: the "
                f"range times expand={expand} overflows {value.dtype} (statistics "
                f"[{float(min_vals.min())}, {float(max_vals.max())}]); observe it in a "
                "wider dtype, or pass nonfinite='propagate' to keep the non-finite statistics"
            )
        raise ValueError(
            f"{self._describe()}: {what} holds {counts}; expected finite values "
            "(statistics not updated). Pass the observer kwarg nonfinite='propagate' to "
            "let them propagate into the statistics and scales as llm-compressor does"
        )

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
        scale, zero_point = self._calculate_qparams(global_scale)
        self.delete_statistics()
        self._consumed_by_get_qparams = not self.has_statistics
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    def _calculate_qparams(self, global_scale: Optional[torch.Tensor]):
        """compressed-tensors' ``calculate_qparams`` on the statistics, never
        silently non-finite from finite statistics.

        Its arithmetic runs in the statistics' dtype, so an asymmetric range
        wider than that dtype (bf16 near +-3.3e38, fp16 near +-65504: max - min
        overflows) gives an infinite scale from finite statistics. For those
        groups only, the qparams are recomputed from float64 statistics and
        cast back to the dtypes compressed-tensors returned; every other group
        keeps compressed-tensors' answer bit for bit. Under
        ``nonfinite="error"`` a scale that is still not finite is a ValueError
        (statistics kept).
        """
        mn, mx = self.min_vals, self.max_vals
        scale, zero_point = calculate_qparams(
            min_vals=mn, max_vals=mx, quantization_args=self.args, global_scale=global_scale
        )
        if scale.device.type == "meta" or all_finite(scale):
            return scale, zero_point
        if all_finite(mn, mx) and mn.dtype != torch.float64:
            wide_scale, wide_zp = calculate_qparams(
                min_vals=mn.double(), max_vals=mx.double(), quantization_args=self.args,
                global_scale=None if global_scale is None else global_scale.double(),
            )
            keep = torch.isfinite(scale)
            # select in fp32 (exact for every scale / zero-point dtype, fp8 included,
            # which torch.where does not take): each side is cast once into its dtype
            scale = torch.where(keep, scale.float(), wide_scale.to(scale.dtype).float()).to(scale.dtype)
            zero_point = torch.where(
                keep, zero_point.float(), wide_zp.to(zero_point.dtype).float()
            ).to(zero_point.dtype)
            if all_finite(scale):
                return scale, zero_point
        if self.nonfinite == "error":
            _, counts = count_nonfinite(scale)
            raise ValueError(
                f"{self._describe()}: the scale holds {counts} (statistics "
                f"[{float(mn.min())}, {float(mx.max())}], {mn.dtype}); expected finite "
                "scales (statistics kept). Pass nonfinite='propagate' to accept them"
            )
        return scale, zero_point

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
        # what the last sync saw is gone with the statistics
        self.__dict__.pop(SNAPSHOTS, None)

    # ------------------------------------------------------------------- DDP

    def sync_activation_stats(self) -> List[SyncHandle]:
        """All-reduce the statistics named in ``_act_sync_dict`` across ranks.

        Every rank must call it (for the same observers, in the same order),
        including ranks that observed nothing: they contribute the identity
        of the reduction and receive the result. AVG is the mean over the ranks
        that hold statistics (division by their count, then SUM; NCCL's native
        AVG when every rank holds them); a second sync with no observation in
        between changes nothing, and SUM statistics never count a value twice
        (``obskernels.observers.sync``). A group of one exchanges nothing.
        Returns handles; wait on them before reading the statistics.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "sync_activation_stats needs an initialized torch.distributed process group"
            )
        return sync_statistics(self, self._act_sync_dict)

    # ---------------------------------------------------------------- hooks

    def attach(self, module: torch.nn.Module) -> None:
        """Called when the observer is attached to ``module`` (no-op here)."""

    def detach(self, module: torch.nn.Module) -> None:
        """Called before the observer is removed from ``module`` (no-op here)."""

    def extra_repr(self) -> str:
        return f"base_name={self.base_name!r}, strategy={self.args.strategy!r}"
