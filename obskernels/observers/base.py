"""The Observer base class: state, lifecycle and registry.

An observer watches values (a weight, activations or attention states),
keeps per-group statistics ``min_vals`` / ``max_vals`` and turns them into
quantization parameters with compressed-tensors' ``calculate_qparams``
(docs/spec.md §1). It holds state and calls ``obskernels.ops``; it never
chooses a backend nor computes a number itself. Subclasses decide two things:

- ``_measure_combined(...)``: the operations that measure one value and
  combine it with the held statistics (``ops.min_max``, whose epilogue
  combines; or ``ops.mse_search``, which records the value, then
  ``ops.combine_statistics`` where statistics are held);
- ``_combine_rule()``: what the held statistics are combined with, stated
  once: replace, running min / max, or a moving average.

One observation, on every backend: the operation measures the value,
combines it with the held statistics and, under ``nonfinite="error"``, adds
the value's non-finite elements to a small device array, the "record"
(``spec.record``); nothing is read back while observing. ``get_qparams``
computes scale, zero point and global scale with ``ops.calculate_qparams``
and reads the record and the scale flags once: a refused observation raises
there (``observers.report``).
"""

from __future__ import annotations

import collections
import math
from typing import Dict, List, Optional, Tuple, TypedDict

import torch
import torch.distributed as dist
from compressed_tensors import InternalModule
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.registry.registry import RegistryMixin

from obskernels import ops
from obskernels.observers.fusion import Fusion
from obskernels.observers.report import Report
from obskernels.observers.sync import SNAPSHOTS, SyncHandle, sync_statistics
from obskernels.spec.checks import (
    ACTIVATIONS,
    ATTENTION,
    WEIGHT,
    HeldStatisticsError,
    check_base_name,
)
from obskernels.spec.record import new_record

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


# (class asked, name) -> what the registry gave (Observer.load_from_registry)
_CONSTRUCTORS: dict = {}


def _module_state_maker():
    """A function returning the attributes ``nn.Module.__init__`` gives a
    module, made anew: the state of a fresh ``torch.nn.Module()``, read here
    once, its empty containers made again by their type at each call, its
    flags (bools, None) shared. None where that state holds anything else
    (then ``Observer.__init__`` calls ``nn.Module.__init__``). One dict update
    costs half of ``nn.Module.__init__``, which sets each attribute through a
    call of its own; an observer is made per weight."""
    made, shared = [], {}
    for name, value in torch.nn.Module().__dict__.items():
        kind = type(value)
        if kind in (dict, set, collections.OrderedDict) and not value:
            made.append((name, kind))
        elif value is None or kind is bool:
            shared[name] = value
        else:
            return None

    def state() -> dict:
        fresh = {name: kind() for name, kind in made}
        fresh.update(shared)
        return fresh

    return state


_MODULE_STATE = _module_state_maker()

# what nn.Module.__call__ checks before it calls forward directly: the
# global hooks (torch.nn.modules.module's dicts, updated in place). None
# where this torch names them otherwise: then every call is nn.Module's.
_GLOBAL_HOOK_NAMES = ("_global_backward_pre_hooks", "_global_backward_hooks",
                      "_global_forward_hooks", "_global_forward_pre_hooks")
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, n, None) for n in _GLOBAL_HOOK_NAMES)
if not all(isinstance(h, dict) for h in _GLOBAL_HOOKS):
    _GLOBAL_HOOKS = None


class DirectCall:
    """An nn.Module observer's call, ``observer(value)`` (``g_idx`` where
    given), without nn.Module.__call__'s two generic frames where that would
    call forward directly: no hook registered (on the module or globally),
    neither compiled nor traced (an activation observer is called on every
    forward). Otherwise nn.Module's own call, the arguments as given."""

    def __call__(self, value, g_idx=None):
        if (_GLOBAL_HOOKS is None or self._forward_pre_hooks or self._forward_hooks
                or self._backward_pre_hooks or self._backward_hooks or any(_GLOBAL_HOOKS)
                or self._compiled_call_impl is not None or torch._C._get_tracing_state()):
            if g_idx is None:  # hooks see the arguments as given
                return torch.nn.Module.__call__(self, value)
            return torch.nn.Module.__call__(self, value, g_idx)
        if g_idx is None:
            return self.forward(value)
        return self.forward(value, g_idx)


class UnknownObserverError(KeyError):
    """An observer name nobody registered. A KeyError like the registry's own,
    printed as written (a plain KeyError shows its message quoted, with
    literal \\n)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Observer(DirectCall, Fusion, Report, InternalModule, RegistryMixin):
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

    #: whether a first observation (nothing held) computes the qparams in
    #: the same operation (``_measure_with_qparams``); ``get_qparams`` takes
    #: them if the statistics are unchanged
    _qparams_ahead: bool = False

    @classmethod
    def load_from_registry(cls, name: str, **constructor_kwargs) -> "Observer":
        """The observer registered as ``name``, built with ``constructor_kwargs``
        (RegistryMixin's, with the name's lookup kept: compressed-tensors'
        registry never rebinds a name or an alias once registered)."""
        key = (cls, name)
        constructor = _CONSTRUCTORS.get(key)
        if constructor is None:
            constructor = cls.get_value_from_registry(name)
            if ":" not in name:  # not a module path, loaded afresh each time
                _CONSTRUCTORS[key] = constructor
        return constructor(**constructor_kwargs)

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
        if _MODULE_STATE is None:
            super().__init__()
        else:  # nn.Module.__init__'s attributes in one update (see _module_state_maker)
            self.__dict__.update(_MODULE_STATE())
        check_base_name(base_name)
        if not isinstance(args, QuantizationArgs):
            raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
        if observer_kwargs or not isinstance(args.observer_kwargs, dict):
            args.observer_kwargs = args.observer_kwargs or {}
            args.observer_kwargs.update(observer_kwargs)
        nonfinite = args.observer_kwargs.get("nonfinite", NONFINITE_POLICIES[0])
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"observer kwarg 'nonfinite' must be one of {NONFINITE_POLICIES}, got {nonfinite!r}"
            )
        # plain attributes, set in one go (nn.Module.__setattr__ costs a call each)
        self.__dict__.update(
            base_name=base_name,
            args=args,
            nonfinite=nonfinite,
            _num_observed_tokens=0,
            # the device record (spec.record), made on the device of the first
            # observation that needs one, and, per observation since it was
            # last read, (shape, dtype, tokens) to word an error with
            _status=None,
            _observations=[],
            # set when get_qparams dropped the statistics, for the error of a second call
            _consumed_by_get_qparams=False,
            # fusion (observers.fusion): the observers sharing a global scale
            _fused_with=[],
            _fused_module=None,
            _qparams_taken=False,
        )

    # ------------------------------------------------------------------ state

    def __setattr__(self, name: str, value) -> None:
        # The observer's state (statistics, record, settings) is plain
        # attributes; rebinding one skips nn.Module's parameter / buffer /
        # submodule bookkeeping, which costs more than an observation's own
        # work on the host. A new attribute goes through nn.Module.
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    @property
    def has_statistics(self) -> bool:
        held = self.__dict__  # plain attributes (what observing sets)
        for a in self._stats_attrs:
            if held.get(a) is None:
                return False
        return True

    @property
    def is_weight_obs(self) -> bool:
        return self.base_name == WEIGHT

    def get_statistics(self) -> Dict[str, torch.Tensor]:
        self._require_statistics()
        return {a: getattr(self, a) for a in self._stats_attrs}

    def _require_statistics(self) -> None:
        if self.has_statistics:
            return
        if self._consumed_by_get_qparams:
            raise RuntimeError(
                f"{type(self).__name__} ({self.base_name!r}) holds no statistics: the "
                "previous get_qparams() consumed them (it drops the statistics it "
                "computes from); observe new values with observer(value) before "
                "calling get_qparams() again"
            )
        raise RuntimeError(
            f"{type(self).__name__} ({self.base_name!r}) holds no statistics: "
            "call observer(value) with a non-empty value first"
        )

    def _record(self, device: torch.device) -> torch.Tensor:
        """The record on ``device`` (made there, or moved with what it holds;
        after an observation with qparams ahead, the record it counted into)."""
        status = self._status
        if status is None:
            ahead = self.__dict__.get("_ahead")
            status = new_record(device) if ahead is None else ahead.record()
        elif status.device != device:
            status = status.to(device)
        self.__dict__["_status"] = status
        return status

    # -------------------------------------------------------------- observing

    def forward(self, value: torch.Tensor, g_idx: Optional[torch.Tensor] = None) -> "Observer":
        """Update the statistics from ``value``; returns the observer itself.

        ``g_idx`` (weights with the GROUP strategy only; activation ordering):
        column j belongs to group ``g_idx[j]`` (docs/spec.md §2). The min/max
        observers pass it to ``ops.min_max``, which reads the columns through
        gathered loads; the search observers search the columns in that
        order (their importance follows the same order).

        Held statistics are updated in place (the same tensors, so a forward
        captured in a CUDA graph accumulates on every replay). A value whose
        statistics cannot merge with those held (another hidden size or
        device) is a ValueError naming both shapes, raised here; the held
        statistics are kept. A value holding NaN or +-inf is refused under
        ``nonfinite="error"`` (the default) when ``get_qparams`` reads the
        record (see ``observers.report``); ``nonfinite="propagate"`` lets NaN /
        inf flow into the statistics and the qparams, as in llm-compressor
        (docs/spec.md §2).
        """
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}")
        if value.numel() == 0:
            return self
        # a weight does not change during calibration: observe it once
        if self.base_name == WEIGHT and self.has_statistics:
            return self
        tokens = 0 if self.base_name == WEIGHT else self._tokens_of(value)
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python frames
        try:
            self._observe(value, g_idx, tokens)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        state = self.__dict__
        state["_consumed_by_get_qparams"] = False
        state["_num_observed_tokens"] += tokens
        if self._fused_with:
            self._observe_fused_modules()
        return self

    def _observe(self, value: torch.Tensor, g_idx: Optional[torch.Tensor], tokens: int) -> None:
        """One observation: measure, combine with the held statistics
        (``_combine_rule``, in place) and, under nonfinite="error", record the
        value's non-finite elements; the operations do all three. Shape and
        device mismatches with the held statistics raise here (host metadata
        only), statistics kept."""
        held, c = self._combine_rule()
        device = value.device
        if held is not None and held[0].device != device:
            self._raise_other_device(value, held[0])
        state = self.__dict__
        if held is None:
            # a first observation (a weight's only one; an activation's first
            # since construction or the last get_qparams): its qparams ahead
            if (self._qparams_ahead and not self._observations and not value.is_meta
                    and not self._fused_with  # (a fused global scale needs the whole group)
                    and (self.base_name == WEIGHT or state.get("min_vals") is None)):
                self._observe_with_qparams(value, g_idx, tokens)
                return
        elif "_ahead" in state:
            # the held statistics are combined into in place (kernels do not
            # advance version counters): the qparams ahead no longer hold
            self._drop_ahead()
        status = None
        # (is_meta, not device.type: a device's type is a new string, 5x the cost)
        if self.nonfinite == "error" and not value.is_meta:
            status = self._status
            if status is None or status.device != device:
                status = self._record(device)
        observation = len(self._observations)
        try:
            min_vals, max_vals = self._measure_combined(value, g_idx, held, c, status, observation)
        except HeldStatisticsError as exc:
            if self.args.strategy != QuantizationStrategy.TOKEN:
                self._raise_mismatch(value, exc.new_shape, held[0].shape)
            min_vals, max_vals = self._merge_token_positions(
                value, g_idx, held, c, status, observation, exc.new_shape)
        if status is not None:
            self._observations.append((value.shape, value.dtype, tokens))
        state["min_vals"], state["max_vals"] = min_vals, max_vals

    def _observe_with_qparams(self, value, g_idx, tokens: int) -> None:
        """A first observation (nothing held, no observation pending, not
        fused) that computes the qparams too (``_measure_with_qparams``: on
        the triton backend in the epilogue of the last kernel, no launch
        more; TENSOR_GROUP's global scale and qparams in one launch more), the
        value counted into a fresh record under nonfinite="error". The
        qparams wait in ``_ahead`` (``ops.Ahead``) for get_qparams; the
        record is the head of their status (``_record``)."""
        record = self.nonfinite == "error"
        result = self._measure_with_qparams(value, g_idx, record)
        if record:
            self._observations.append((value.shape, value.dtype, tokens))
        state = self.__dict__
        state["min_vals"], state["max_vals"] = result[0], result[1]
        state["_status"] = None  # the record is the qparams' status head (see _record)
        state["_ahead"] = ops.Ahead(result, self.args)

    def _drop_ahead(self) -> None:
        """Let the qparams computed ahead go (the statistics are about to
        change in place), keeping the record they carry at their status head."""
        state = self.__dict__
        ahead = state.pop("_ahead", None)
        if ahead is not None and state["_status"] is None:
            state["_status"] = ahead.record()

    def _combine_rule(self):
        """(held, averaging_constant): the held (min_vals, max_vals) to combine
        the next value's statistics with (None: replace them), and the moving
        average's constant (None: running min / max). The one statement of
        how an observer merges observations (default: keep the latest)."""
        return None, None

    def _measure(self, value: torch.Tensor, g_idx: Optional[torch.Tensor], status=None,
                 observation: int = 0) -> MinMaxTuple:
        """(min_vals, max_vals) of one value through an ``obskernels.ops``
        operation, which adds the value to the record ``status`` (when given)
        as observation ``observation``."""
        raise NotImplementedError(f"{type(self).__name__} does not define _measure")

    def _measure_with_qparams(self, value, g_idx, record: bool):
        """``_measure`` of a value with nothing held, and the qparams of its
        statistics (``ops.min_max_qparams`` / ``ops.mse_search_qparams``):
        (min_vals, max_vals, scale, zero_point, global_scale, status).
        Subclasses setting ``_qparams_ahead`` define it."""
        raise NotImplementedError(f"{type(self).__name__} does not define _measure_with_qparams")

    def _measure_combined(self, value, g_idx, held, c, status, observation) -> MinMaxTuple:
        """With nothing held, ``_measure`` (recording the value itself);
        otherwise ``_measure``, then ``ops.combine_statistics`` for the
        combination into the held statistics and the record."""
        if held is None:
            return self._measure(value, g_idx, status, observation)
        min_vals, max_vals = self._measure(value, g_idx)
        return ops.combine_statistics(
            value, self.base_name, self.args, min_vals, max_vals, held=held,
            averaging_constant=c, status=status, observation=observation, out=held,
        )

    def _merge_token_positions(self, value, g_idx, held, c, status, observation, new_shape):
        """TOKEN statistics hold one entry per sequence position, so a value
        with another sequence length gives another shape. Like llm-compressor
        (its running min/max and moving average are broadcasting torch ops),
        statistics of ONE position merge with any length (and any held length
        with a one-token value): the value's own statistics are measured (and
        recorded), then combined with the held ones, both broadcast to the
        longer length. Other lengths cannot be merged (ValueError)."""
        try:
            positions = torch.broadcast_shapes(tuple(new_shape), tuple(held[0].shape))
        except RuntimeError:
            self._raise_token_positions(value, math.prod(new_shape), held[0].numel())
        new_min, new_max = self._measure_combined(value, g_idx, None, None, status, observation)
        # the value as it would look with every position: the same statistics
        rows = value.reshape(-1, 1, value.shape[-1]) if value.dim() == 2 else value
        wide = rows.expand(rows.shape[0], positions[0], rows.shape[-1])
        stretched = tuple(t.expand(positions).contiguous() for t in (new_min, new_max, *held))
        return ops.combine_statistics(
            wide, self.base_name, self.args, stretched[0], stretched[1],
            held=stretched[2:], averaging_constant=c,
        )

    def _tokens_of(self, value: torch.Tensor) -> int:
        if self.base_name in ACTIVATIONS:
            # (tokens, hidden) or (batch, seq, hidden)
            return int(value.numel() // value.shape[-1])
        if self.base_name in ATTENTION:
            # (batch, heads, seq, head_dim): a token spans every head
            return int(value.shape[0] * value.shape[2])
        return 0

    # -------------------------------------------------------------- qparams

    def get_qparams(self) -> QParamsDict:
        """Scale, zero point and global scale from the statistics, which are then dropped.

        ``ops.calculate_qparams``: compressed-tensors' ``calculate_qparams(
        min_vals, max_vals, args, global_scale)``, for TENSOR_GROUP with
        ``global_scale = generate_gparam(-a, a)``, ``a`` the absolute max over
        this observer and every observer fused with it. Groups whose finite
        statistics overflow the statistics' dtype are redone in float64 (see
        ``observers.report``). Then, where something is to be judged, ONE
        host read: the record of the observations (a refused value raises
        here) and the scale flags. With ``nonfinite="propagate"`` and nothing
        recorded (no imatrix verdict pending) nothing is read: the call only
        queues work on the device.
        """
        self._require_statistics()
        state = self.__dict__
        min_vals, max_vals = state["min_vals"], state["max_vals"]
        ahead = state.get("_ahead")
        # computed with the statistics, which are unchanged, and their own
        # global scale, which is the scale's unless fused since
        taken = None if ahead is None or self._fused_with else ahead.take(min_vals, max_vals,
                                                                          self.args)
        if taken is not None:
            scale, zero_point, global_scale, status = taken
        else:
            scale, zero_point, global_scale, status = self._calculate_qparams(min_vals, max_vals)
        self._check_qparams(scale, status)
        if self._fused_with:
            self.delete_statistics()  # a fused observer waits for its group
        else:
            self._drop_statistics()
        self.__dict__["_consumed_by_get_qparams"] = not self.has_statistics
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    def _calculate_qparams(self, min_vals, max_vals):
        """``ops.calculate_qparams`` of the statistics (widened, fused, the
        record carried when one is pending)."""
        fused = None
        if self.args.strategy == QuantizationStrategy.TENSOR_GROUP:
            fused = tuple((st["min_vals"], st["max_vals"]) for st in self._fused_statistics())
        carry = self._record(min_vals.device) if self._record_pending() else None
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python frames
        try:
            return ops.calculate_qparams(min_vals, max_vals, self.args, fused=fused, widen=True,
                                         carry=carry)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    def get_global_scale(self) -> Optional[torch.Tensor]:
        """``generate_gparam(-a, a)`` over the fusion group for TENSOR_GROUP
        (``ops.calculate_qparams``' global scale), else None."""
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        fused = [(st["min_vals"], st["max_vals"]) for st in self._fused_statistics()]
        return ops.calculate_qparams(self.min_vals, self.max_vals, self.args, fused=fused)[2]

    def _drop_statistics(self) -> None:
        state = self.__dict__
        device = None if state.get("min_vals") is None else state["min_vals"].device
        for a in self._stats_attrs:
            state.pop(a, None)
        state.pop("_repeat", None)  # it holds the statistics dropped
        state.pop("_ahead", None)  # their qparams
        if self._observations:
            # what was recorded belongs to the statistics dropped
            self._observations = []
            status = self._status
            self._status = new_record(status.device if status is not None else device)
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
        self._drop_ahead()  # the statistics change in place
        return sync_statistics(self, self._act_sync_dict)

    # ---------------------------------------------------------------- hooks

    def attach(self, module: torch.nn.Module) -> None:
        """Called when the observer is attached to ``module`` (no-op here)."""

    def detach(self, module: torch.nn.Module) -> None:
        """Called before the observer is removed from ``module`` (no-op here)."""

    def extra_repr(self) -> str:
        return f"base_name={self.base_name!r}, strategy={self.args.strategy!r}"
