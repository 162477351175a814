"""The Observer base class: lifecycle, registry, fusion and DDP synchronisation.

An observer watches values (a weight, activations or attention states),
keeps per-group statistics ``min_vals`` / ``max_vals`` and turns them into
quantization parameters with compressed-tensors' ``calculate_qparams`` (docs/spec.md §1).
Subclasses decide two things only:

- ``_measure(value)``: the (min_vals, max_vals) of one value, computed by an
  ``obskernels.ops`` operation (min/max or the MSE shrink-grid search);
- ``_accumulate(min_vals, max_vals)``: how those merge into what is held
  (replace, running min/max, moving average), stated once more as
  ``_combine_rule()`` for the kernels.

On the triton backend an observation is kernels only: the operation combines
the new statistics with the held ones in its epilogue and records non-finite
input into a small device array (the "record", ``spec.record.STATUS_INIT``);
nothing is read back while observing. ``get_qparams`` computes scale, zero
point and global scale with ``ops.calculate_qparams`` (one kernel) and reads
the record and the scale flags once: a refused observation raises there.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, Iterable, List, Optional, Tuple, TypedDict

import torch
import torch.distributed as dist
from compressed_tensors import InternalModule
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import generate_gparam
from compressed_tensors.registry.registry import RegistryMixin

from obskernels import ops
from obskernels.backends import resolve_backend
from obskernels.observers.sync import SNAPSHOTS, SyncHandle, sync_statistics
from obskernels.reference.stats import moving_average  # noqa: F401 (re-exported: minmax, tests)
from obskernels.spec.checks import (
    ACTIVATIONS,
    ATTENTION,
    WEIGHT,
    HeldStatisticsError,
    all_finite,
    check_base_name,
    count_nonfinite,
    describe_nonfinite,
)
from obskernels.spec.record import STATUS_BAD_STATS, STATUS_FIRST_BAD, STATUS_INIT, STATUS_NAN

__all__ = ["Observer", "QParamsDict", "MinMaxTuple", "NONFINITE_POLICIES", "UnknownObserverError",
           "hook_input"]

#: values of the ``nonfinite`` observer kwarg (the first is the default)
NONFINITE_POLICIES = ("error", "propagate")

MinMaxTuple = Tuple[torch.Tensor, torch.Tensor]


class QParamsDict(TypedDict, total=False):
    """What ``Observer.get_qparams`` returns."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: Optional[torch.Tensor]


def hook_input(args, *, unwrap: bool = True):
    """The observed input among a forward-pre hook's ``args``: the first
    positional argument, None when there is none; with ``unwrap``, a tuple
    there stands for its first element (None when empty)."""
    if isinstance(args, tuple):
        args = args[0] if args else None
    if unwrap and isinstance(args, tuple):
        args = args[0] if args else None
    return args


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
        # g_idx of the value being observed (set by forward only while it measures)
        self._g_idx: Optional[torch.Tensor] = None
        # fusion bookkeeping (TENSOR_GROUP global scale shared across observers)
        self._fused_with: List["Observer"] = []
        self._fused_module: Optional[weakref.ref] = None
        self._qparams_taken = False
        # the kernels' non-finite record and, per observation since it was
        # last read, (shape, dtype, tokens) to word an error with
        self._status = torch.tensor(STATUS_INIT, dtype=torch.int64)
        self._observations: List[Tuple[tuple, torch.dtype, int]] = []
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
    def forward(self, value: torch.Tensor, g_idx: Optional[torch.Tensor] = None) -> "Observer":
        """Update the statistics from ``value``; returns the observer itself.

        ``g_idx`` (weights with the GROUP strategy only; activation ordering):
        column j belongs to group ``g_idx[j]`` (docs/spec.md §2). The min/max
        observers pass it to ``ops.min_max``, which reads the columns through
        gathered loads; the search observers search the columns in that
        order (their importance follows the same order).
        """
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}")
        if value.numel() == 0:
            return self
        # a weight does not change during calibration: observe it once
        if self.is_weight_obs and self.has_statistics:
            return self
        # a plain attribute even when g_idx is a Parameter (nn.Module would
        # register it as one of the observer's parameters)
        object.__setattr__(self, "_g_idx", g_idx)
        try:
            if value.device.type != "meta" and resolve_backend(value) == "triton":
                self._observe_in_kernels(value)
            else:
                self._accumulate(*self._compute_statistics(value))
        finally:
            object.__setattr__(self, "_g_idx", None)
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

    def _observe_in_kernels(self, value: torch.Tensor) -> None:
        """One observation with no host read: the operation measures, combines
        with the held statistics (``_combine_rule``) and, under
        nonfinite="error", adds the value's non-finite elements to the record,
        which get_qparams reads. Shape and device mismatches with the held
        statistics still raise here (host metadata only), statistics kept."""
        held, c = self._combine_rule()
        if held is not None and held[0].device != value.device:
            self._check_mergeable(value, held[0].new_empty(held[0].shape, device=value.device))
        status = None
        if self.nonfinite == "error":
            if self._status.device != value.device:
                self._status = self._status.to(value.device)
            status = self._status
        try:
            min_vals, max_vals = self._measure_combined(
                value, held, c, status, len(self._observations)
            )
        except HeldStatisticsError as exc:
            if self.args.strategy != QuantizationStrategy.TOKEN:
                self._raise_mismatch(value, exc.new_shape, held[0].shape)
            # TOKEN statistics of one position broadcast against any sequence
            # length, as in llm-compressor (another mismatch raises here): the
            # torch merge of _accumulate takes this rare case
            self._check_token_positions(value, torch.empty(exc.new_shape, device="meta"), held[0])
            self._accumulate(*self._compute_statistics(value))
            return
        if status is not None:
            self._observations.append((tuple(value.shape), value.dtype, self._tokens_of(value)))
        self.min_vals, self.max_vals = min_vals, max_vals

    def _combine_rule(self):
        """(held, averaging_constant): the held (min_vals, max_vals) to combine
        the next value's with (None: replace), and the moving average's
        constant (None: running min / max). Mirrors ``_accumulate``."""
        return None, None

    def _measure_combined(self, value, held, c, status, observation) -> MinMaxTuple:
        """``_measure`` with the combination and the record done by the
        operation's kernels (default: a second operation, combine_statistics)."""
        min_vals, max_vals = self._measure(value)
        if held is None and status is None:
            return min_vals, max_vals
        return ops.combine_statistics(
            value, self.base_name, self.args, min_vals, max_vals, held=held,
            averaging_constant=c, status=status, observation=observation,
        )

    def _describe(self) -> str:
        return f"{type(self).__name__}(base_name={self.base_name!r})"

    def _raise_mismatch(self, value, new_shape, held_shape) -> None:
        raise ValueError(
            f"{self._describe()}: this value of shape {tuple(value.shape)} gives "
            f"statistics of shape {tuple(new_shape)}, but the observer holds "
            f"statistics of shape {tuple(held_shape)} from earlier values; expected "
            "the same hidden size on every observation (statistics kept)"
        )

    def _check_mergeable(self, value: torch.Tensor, min_vals: torch.Tensor) -> None:
        # only observers that combine old and new statistics care: a memoryless
        # one replaces them (TOKEN statistics follow the sequence length)
        if not self.has_statistics or type(self)._accumulate is Observer._accumulate:
            return
        held = self.min_vals
        if min_vals.shape != held.shape and self.args.strategy == QuantizationStrategy.TOKEN:
            self._check_token_positions(value, min_vals, held)
        elif min_vals.shape != held.shape:
            self._raise_mismatch(value, min_vals.shape, held.shape)
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
        bad, counts = count_nonfinite(value)
        raise self._nonfinite_error(
            tuple(value.shape), value.dtype, counts if bad else None,
            float(min_vals.min()), float(max_vals.max()), "not updated",
        )

    def _nonfinite_error(self, shape, dtype, counts, low, high, fate) -> ValueError:
        """The error of a refused observation of ``shape`` / ``dtype``: ``counts``
        describes its non-finite elements, None when the value was finite and
        only its statistics (range ``low`` .. ``high``) overflowed; ``fate``:
        what became of the held statistics."""
        what = f"the observed {self.base_name} tensor (shape {shape}, {dtype})"
        if counts is None:
            # finite values, non-finite statistics: the search range overflowed
            expand = getattr(self, "expand", 1.0)
            return ValueError(
                f"{self._describe()}: {what} is finite but its statistics are not: the "
                f"range times expand={expand} overflows {dtype} (statistics "
                f"[{low}, {high}]); observe it in a "
                "wider dtype, or pass nonfinite='propagate' to keep the non-finite statistics "
                f"(statistics {fate})"
            )
        return ValueError(
            f"{self._describe()}: {what} holds {counts}; expected finite values "
            f"(statistics {fate}). Pass the observer kwarg nonfinite='propagate' to "
            "let them propagate into the statistics and scales as llm-compressor does"
        )

    def _measure(self, value: torch.Tensor) -> MinMaxTuple:
        """(min_vals, max_vals) of one value through an ``obskernels.ops`` operation."""
        raise NotImplementedError(f"{type(self).__name__} does not define _measure")

    def _accumulate(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        """Default: keep the latest value's statistics."""
        self.min_vals, self.max_vals = min_vals, max_vals

    def _tokens_of(self, value: torch.Tensor) -> int:
        if self.base_name in ACTIVATIONS:
            # (tokens, hidden) or (batch, seq, hidden)
            return int(value.numel() // value.shape[-1])
        if self.base_name in ATTENTION:
            # (batch, heads, seq, head_dim): a token spans every head
            return int(value.shape[0] * value.shape[2])
        return 0

    def _count_tokens(self, value: torch.Tensor) -> None:
        self._num_observed_tokens += self._tokens_of(value)

    # -------------------------------------------------------------- qparams

    @torch.no_grad()
    def get_qparams(self) -> QParamsDict:
        """Scale, zero point and global scale from the statistics, which are then dropped.

        ``ops.calculate_qparams``: compressed-tensors' ``calculate_qparams(
        min_vals, max_vals, args, global_scale)``, for TENSOR_GROUP with
        ``global_scale = generate_gparam(-a, a)``, ``a`` the absolute max over
        this observer and every observer fused with it; one kernel on the
        triton backend. Groups whose finite statistics overflow the
        statistics' dtype are redone in float64 (see ``_check_qparams``).
        Then ONE host read: the non-finite record of the observations (a
        refused value raises here on the triton backend) and the scale flags.
        """
        self._require_statistics()
        fused = None
        if self.args.strategy == QuantizationStrategy.TENSOR_GROUP:
            fused = [(st["min_vals"], st["max_vals"]) for st in self._fused_statistics()]
        carry = None
        if self._record_pending():
            if self._status.device != self.min_vals.device:
                self._status = self._status.to(self.min_vals.device)
            carry = self._status
        scale, zero_point, global_scale, status = ops.calculate_qparams(
            self.min_vals, self.max_vals, self.args, fused=fused, widen=True, carry=carry
        )
        self._check_qparams(scale, status)
        self.delete_statistics()
        self._consumed_by_get_qparams = not self.has_statistics
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    def _check_qparams(self, scale: torch.Tensor, status: torch.Tensor) -> None:
        """Never silently non-finite: the errors of ``nonfinite="error"``.

        compressed-tensors' arithmetic runs in the statistics' dtype, so an
        asymmetric range wider than that dtype (bf16 near +-3.3e38, fp16 near
        +-65504: max - min overflows) gives an infinite scale from finite
        statistics; ``calculate_qparams(widen=True)`` recomputes those groups
        (and only those: every other group keeps compressed-tensors' answer
        bit for bit) from float64 statistics, cast back. A scale that is still
        not finite is a ValueError (statistics kept). Before that, an
        observation the kernels recorded as non-finite is the ValueError
        forward raises on the reference backend; its statistics are dropped.
        """
        observations, self._observations = self._observations, []
        if scale.device.type == "meta":
            return
        flags = status.tolist()  # the one read
        record, scale_bad = flags[: len(STATUS_INIT)], any(flags[len(STATUS_INIT):])
        self._judge_record(record)
        if self.nonfinite != "error":
            return
        if observations and record[STATUS_BAD_STATS]:
            self._raise_recorded(observations, record)
        if scale_bad:
            mn, mx = self.min_vals, self.max_vals
            _, counts = count_nonfinite(scale)
            raise ValueError(
                f"{self._describe()}: the scale holds {counts} (statistics "
                f"[{float(mn.min())}, {float(mx.max())}], {mn.dtype}); expected finite "
                "scales (statistics kept). Pass nonfinite='propagate' to accept them"
            )

    def _record_pending(self) -> bool:
        """Whether get_qparams must carry the record into its one read: the
        observations since the last read (and what a subclass left there)."""
        return bool(self._observations)

    def _judge_record(self, record) -> None:
        """What a subclass reads in the record at get_qparams (default: nothing)."""

    def _raise_recorded(self, observations, record) -> None:
        """The error of a non-finite observation, raised at get_qparams (the
        triton backend reads nothing while observing): the first refused
        value's shape and dtype, the NaN / +-inf counts of every refused one.
        The statistics (and the tokens) of the observations since the last
        get_qparams are dropped: the observer starts afresh."""
        shape, dtype, _ = observations[min(record[STATUS_FIRST_BAD], len(observations) - 1)]
        # the statistics of every observation since the last read go, and their tokens
        self._num_observed_tokens -= sum(t for _, _, t in observations)
        nan, pos, neg = record[STATUS_NAN:STATUS_NAN + 3]
        counts = describe_nonfinite(nan, pos, neg, math.prod(shape)) if nan + pos + neg else None
        low, high = float(self.min_vals.min()), float(self.max_vals.max())
        self._drop_statistics()
        raise self._nonfinite_error(shape, dtype, counts, low, high, "dropped")

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
        if self._observations:
            # what was recorded belongs to the statistics dropped
            self._observations = []
            self._status = torch.tensor(STATUS_INIT, dtype=torch.int64, device=self._status.device)
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
