"""Drop-in: llm-compressor's observers compute through obskernels.

Two lines before running llm-compressor (``oneshot``, a modifier, ...)::

    from obskernels.integrations.llmcompressor import enable
    enable()                       # or: with enabled(): oneshot(...)

The seam: llm-compressor builds every observer by name, through its
``Observer`` registry (``Observer.load_from_registry(name, ...)``, a
compressed-tensors ``RegistryMixin``). ``enable()`` points each built-in name
(memoryless_minmax, static_minmax, minmax, memoryless_mse, mse,
nvfp4_expanded_mse, fouroversix, imatrix_mse, nvfp4_expanded_imatrix) at a
SUBCLASS of llm-compressor's own class for that name. A subclass overrides
only where numbers are computed:

- ``forward``: the min/max or the shrink-grid search of the raw value, via
  ``obskernels.ops.min_max`` / ``ops.mse_search`` (flattening happens inside
  the op, fused in the triton kernels), instead of llm-compressor's
  ``flatten_for_calibration`` + ``torch.amin/amax`` / grid search;
- imatrix_mse's E[x**2] hook: ``ops.accumulate_sq``;
- the running min / max (static_minmax) and the moving averages (minmax,
  mse): in the same op, ``held=`` / ``averaging_constant=`` (min_max's
  epilogue; ``ops.combine_statistics`` after a search), the numbers of
  llm-compressor's ``torch.min`` / ``lerp`` (docs/spec.md) without their two
  to six extra torch ops per observation, written into the held statistics
  in place (as llm-compressor's DDP sync updates them) rather than set anew.
  Held statistics of another shape, dtype or device, and an averaging
  constant outside [0, 1], are combined by llm-compressor's own torch code,
  as without the drop-in;
- ``get_qparams``: the scale and zero point from ``ops.calculate_qparams``
  (one launch on the triton backend) instead of compressed-tensors'
  ``calculate_qparams`` (a dozen torch ops), the same numbers; a weight's
  (not TENSOR_GROUP's, whose global scale is the fusion group's) computed
  with its statistics in the observation, ``ops.min_max_qparams`` /
  ``ops.mse_search_qparams`` without the widening (compressed-tensors'
  arithmetic; on the triton backend in the measuring launch), and taken
  by ``get_qparams`` while those statistics are unchanged.

Everything else is llm-compressor's own code, inherited unchanged: kwargs and
their defaults, statistics bookkeeping, fusion of q/k/v and gate/up global
scales (its ``FusionHandler``, and the global scale from its
``generate_gparam``), DDP synchronisation, importance validation and its
warnings, hook disabling through ``HooksMixin``. So the scales, zero points
and global scales are those llm-compressor computes without the drop-in
(tested bit for bit on the CPU, non-finite and overflowing statistics
included). ``disable()`` restores the registry.

Notes:
- Observers already constructed keep their class: enable before the
  modifier initializes (before ``oneshot``).
- Observers registered by users are adapted only when they inherit the
  computation unchanged; one overriding ``update_statistics_from_observed``
  (or ``forward``, ``attach``) keeps its own class.
- On CUDA, llm-compressor 0.14 sends its mse observers to a Triton kernel of
  its own whose per-group "buffered patience" (``triton_error_buffer``) can
  stop the search elsewhere than its eager code. The drop-in computes the
  eager semantics (docs/spec.md §4) on every device; ``triton_error_buffer`` is ignored.
- A value whose flattening differs from obskernels' (docs/spec.md §2) is
  observed by llm-compressor's own ``forward``: a weight that is not 2-D,
  an activation that is neither 2-D nor 3-D, attention states that are not
  4-D (obskernels refuses those shapes), and a 2-D activation in groups
  (GROUP, TENSOR_GROUP; an MoE expert's ``(tokens, hidden)`` input), whose
  tokens and hidden size llm-compressor groups together (one statistic of
  shape ``()``). Their qparams still come from ``ops.calculate_qparams``.
- The registry entries are replaced in compressed-tensors' registry dict
  directly, since ``register`` refuses to rebind a name.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import warnings
from typing import Iterator, Optional

import torch

from obskernels import ops
from obskernels.backends import use_backend
from obskernels.observers.base import DirectCall, hook_input
from obskernels.observers.mse import search_qparams_with, search_with
from obskernels.spec.checks import FLOAT_DTYPES, VALUE_DIMS
from obskernels.spec.errors import HeldStatisticsError

__all__ = ["enable", "disable", "enabled", "is_enabled", "SUPPORTED_VERSIONS"]

#: llm-compressor versions whose observer internals the adapters were written against.
SUPPORTED_VERSIONS = ("0.14.",)

# registry name -> the original value, while enabled
_originals: dict[str, object] = {}
_backend: Optional[str] = None


def _import_llmcompressor():
    try:
        lc_obs = importlib.import_module("llmcompressor.observers")
    except ImportError as exc:
        raise ImportError(
            "obskernels.integrations.llmcompressor needs llm-compressor 0.14, which "
            "pins an older compressed-tensors and transformers: install it in its own "
            "environment with `make llmcompressor-env` (in a checkout of obskernels; it "
            "creates .venv-llmcompressor with llm-compressor and obskernels) and run "
            "from there, rather than pip-installing it here, which would downgrade "
            "this environment's compressed-tensors. Importing it failed: " + str(exc)
        ) from exc
    import llmcompressor

    version = getattr(llmcompressor, "__version__", "?")
    if not str(version).startswith(SUPPORTED_VERSIONS):
        warnings.warn(
            f"obskernels' llm-compressor drop-in was written for llm-compressor "
            f"{SUPPORTED_VERSIONS}, found {version}",
            stacklevel=3,
        )
    return lc_obs


def _repeat_of(observer) -> "ops.Repeat":
    """The observer's ``ops.Repeat`` (what its last in-place combination was)."""
    state = observer.__dict__
    repeat = state.get("_obskernels_repeat")
    if repeat is None:
        repeat = state["_obskernels_repeat"] = ops.Repeat()
    return repeat


def _registers_nothing(observer) -> bool:
    """Whether nn.Module's attribute protocol is the instance dict for every
    name of ``observer``: no parameter, buffer or submodule registered
    (llm-compressor's observers register none)."""
    return not (observer._parameters or observer._buffers or observer._modules)


def _has_statistics(observer) -> bool:
    """llm-compressor's ``has_statistics`` (every statistic an attribute),
    read from the instance dict: without nn.Module's ``__getattr__`` raising
    an AttributeError per missing statistic (a weight's first observation),
    where nothing else could hold them."""
    state, names = observer.__dict__, observer._stats_attrs
    for name in names:
        if name not in state:
            break
    else:
        return True
    if _registers_nothing(observer) and not any(hasattr(type(observer), n) for n in names):
        return False
    return observer.has_statistics


def _set_statistics(observer, min_vals, max_vals) -> None:
    """``observer.min_vals, observer.max_vals = min_vals, max_vals``: where
    nothing is registered, the instance dict nn.Module's ``__setattr__``
    would write them to, without its checks."""
    if _registers_nothing(observer):
        state = observer.__dict__
        state["min_vals"], state["max_vals"] = min_vals, max_vals
    else:
        observer.min_vals, observer.max_vals = min_vals, max_vals


def _run(fn, *args):
    """``fn(*args)`` under the backend ``enable`` was given (if any) with grad
    disabled: torch.no_grad(), as llm-compressor's observers use it, without
    its Python frames (an activation observer runs on every forward)."""
    grad = torch.is_grad_enabled()
    if grad:
        torch._C._set_grad_enabled(False)
    try:
        if _backend is None:
            return fn(*args)
        with use_backend(_backend):
            return fn(*args)
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


def _build_adapters(lc_obs) -> list[tuple[type, tuple[type, ...]]]:
    """[(llm-compressor observer class, the mixins its adapter puts in front)]."""
    from llmcompressor.observers.helpers import flatten_for_calibration, lerp
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from compressed_tensors.quantization import QuantizationStrategy

    TENSOR_GROUP = QuantizationStrategy.TENSOR_GROUP
    GROUPED = (QuantizationStrategy.GROUP, TENSOR_GROUP)

    MemorylessMinMax = lc_obs.MemorylessMinMaxObserver
    StaticMinMax = lc_obs.StaticMinMaxObserver
    MinMax = lc_obs.MinMaxObserver
    MemorylessMSE = lc_obs.mse.MemorylessMSEObserver
    MovingAverageMSE = lc_obs.MovingAverageMSEObserver
    IMatrixMSE = lc_obs.IMatrixMSEObserver

    class _OpsForward(DirectCall):
        """llm-compressor's ``Observer.forward`` with the statistics of the
        raw value computed by ``_measure_value`` (obskernels.ops); called
        without nn.Module's generic frames where no hook is registered
        (``DirectCall``: an activation observer is called on every forward)."""

        def forward(self, observed: torch.Tensor):
            if observed.numel() == 0:
                return self
            if self.base_name == "weight" and _has_statistics(self):  # (is_weight_obs)
                return self
            # obskernels' flattening (docs/spec.md §2) is llm-compressor's at
            # the dims it takes (VALUE_DIMS), but for a 2-D activation in
            # groups: llm-compressor's reshapes take other shapes too, which
            # obskernels refuses (weights of 1 or 3+ dims, activations of 1
            # or 4+, attention states of 3 or 5+), and group a 2-D
            # activation's tokens and hidden size together (one statistic for
            # an MoE expert's input, where obskernels keeps hidden /
            # group_size). Those values take llm-compressor's own code.
            dims, base_name = observed.dim(), self.base_name
            if dims not in VALUE_DIMS.get(base_name, ()) or (
                    dims == 2 and base_name != "weight" and self.args.strategy in GROUPED):
                return super().forward(observed)
            _run(self._observe_through_ops, observed)
            return self

        def _observe_through_ops(self, observed):
            self._update_from_value(observed)
            # llm-compressor's forward asks its fusion handler for the group's
            # statistics, which observes the partners still without; alone in
            # its group, an observer has nothing to ask for
            handler = self.fusion_handler
            if getattr(handler, "_group", True):
                handler.get_fused_statistics()

        def get_qparams(self):
            """llm-compressor's get_qparams, the qparams from
            ``ops.calculate_qparams`` (one launch on the triton backend where
            compressed-tensors' calculate_qparams makes a dozen torch ops); the
            global scale, as before, from llm-compressor's own code."""
            return _run(self._qparams_through_ops)

        def _qparams_through_ops(self):
            if not self.has_statistics:
                raise AssertionError("No statistics available. Call observer(value) first.")
            global_scale = self.get_global_scale()
            min_vals, max_vals = self.min_vals, self.max_vals
            # computed with the statistics (a weight's), which are unchanged
            ahead = self.__dict__.get("_obskernels_ahead")
            taken = None if ahead is None else ahead.take(min_vals, max_vals, self.args)
            if taken is None:
                taken = ops.calculate_qparams(min_vals, max_vals, self.args, global_scale)
            self.delete_statistics()
            return {"scale": taken[0], "zero_point": taken[1], "global_scale": global_scale}

        def delete_statistics(self, check_fused: bool = True) -> None:
            super().delete_statistics(check_fused)
            if "min_vals" not in self.__dict__:  # and the qparams computed with them
                self.__dict__.pop("_obskernels_ahead", None)

        def _update_from_value(self, value):
            # a weight, observed whole: its qparams in the same operation (on
            # the triton backend in the measuring launch), for get_qparams;
            # not for TENSOR_GROUP, whose global scale llm-compressor takes
            # over the fusion group
            state = self.__dict__
            state.pop("_obskernels_ahead", None)
            if self.base_name == "weight" and self.args.strategy != TENSOR_GROUP:
                result = self._measure_value_with_qparams(value)
                if result is not None:
                    _set_statistics(self, result[0], result[1])
                    state["_obskernels_ahead"] = ops.Ahead(result, self.args)
                    return
            _set_statistics(self, *self._measure_value(value))

        def _measure_value(self, value):
            return ops.min_max(value, self.base_name, self.args)

        def _measure_value_with_qparams(self, value):
            """``_measure_value`` and llm-compressor's qparams of its result
            (calculate_qparams without the widening): a ``min_max_qparams``
            result, or None where the observer has no such operation."""
            return ops.min_max_qparams(value, self.base_name, self.args, widen=False)

        def _measure_combined(self, value, held, c, torch_combine):
            # one launch: min_max's epilogue combines the new statistics into
            # held, in place, and a forward repeated so goes straight to its
            # plan (ops.Repeat); a held shape it cannot combine with raises
            # HeldStatisticsError before any launch
            return ops.min_max(value, self.base_name, self.args, held=held, averaging_constant=c,
                               out=held, repeat=_repeat_of(self))

        def _search_value(self, value, flavour, importance=None):
            return search_with(self, value, flavour, importance)

        def _update_combining(self, value, c, torch_combine):
            """The new statistics combined with those held: in the op where
            they match (shape, dtype, device), else by ``torch_combine`` (the
            torch code of llm-compressor, broadcasting or raising as it does)."""
            held = mn, mx = self.min_vals, self.max_vals
            repeat = self.__dict__.get("_obskernels_repeat")
            if repeat is not None and repeat.again(value, self.base_name, self.args, held, c) \
                    is not None:
                return  # the call last combined in place, with these statistics: checked then
            in_op = c is None or (not isinstance(c, bool) and isinstance(c, (int, float)) and 0 <= c <= 1)
            dtype, device = value.dtype, value.device
            if (in_op and mn.dtype == dtype and mx.dtype == dtype and mn.device == device
                    and mx.device == device):
                try:
                    new = self._measure_combined(value, held, c, torch_combine)
                except HeldStatisticsError:
                    pass
                else:
                    if new[0] is not held[0] or new[1] is not held[1]:  # not combined in place
                        _set_statistics(self, *new)
                    return
            _set_statistics(self, *torch_combine(*self._measure_value(value)))

    class _StaticUpdate:
        def _update_from_value(self, value):
            if not hasattr(self, "min_vals"):
                _set_statistics(self, *self._measure_value(value))
                return
            self._update_combining(value, None, lambda new_min, new_max: (
                torch.min(new_min, self.min_vals), torch.max(new_max, self.max_vals)))

    class _MovingAverageUpdate:
        def _update_from_value(self, value):
            if not hasattr(self, "min_vals") or self.avg_constant == 1.0:
                _set_statistics(self, *self._measure_value(value))
                return
            c = self.avg_constant
            self._update_combining(value, c, lambda new_min, new_max: (
                lerp(self.min_vals, new_min, c), lerp(self.max_vals, new_max, c)))

    class _MSEMeasure:
        def _measure_value(self, value):
            return self._search_value(value, "mse")

        def _measure_value_with_qparams(self, value):
            return search_qparams_with(self, value, widen=False)

        def _measure_combined(self, value, held, c, torch_combine):
            # the search, then one launch combining its statistics with held
            new_min, new_max = self._search_value(value, "mse")
            if new_min.shape != held[0].shape:
                return torch_combine(new_min, new_max)
            return ops.combine_statistics(value, self.base_name, self.args, new_min, new_max,
                                          held=held, averaging_constant=c, out=held)

    class _IMatrixMeasure:
        def _measure_value_with_qparams(self, value):
            return None  # (the search weighs by the importance gathered)

        def _measure_value(self, value):
            return self._search_value(value, "imatrix", importance=self._importance_vector(value))

        def _importance_vector(self, value):
            # llm-compressor's validation (and its fallback warnings) reads only
            # the flattened shape: flatten a meta copy, no data is touched.
            try:
                shape_only = flatten_for_calibration(value.detach().to("meta"), self.base_name, self.args)
            except ValueError:
                shape_only = value.detach().to("meta")
            imp = self._get_validated_importance(shape_only)
            if imp is None:
                return None
            imp = imp.to(device=value.device, dtype=torch.float32)
            # the normalisation of llm-compressor's _prepare_importance
            return imp / (imp.mean() + torch.finfo(torch.float32).tiny)

        def attach(self, module):
            # llm-compressor's attach allocates the buffers and registers its
            # hook; swap that hook for one accumulating through obskernels.
            super().attach(module)
            if self._imatrix_hook is None:
                return
            self._imatrix_hook.remove()
            observer = self

            def _hook(mod, args):
                if (
                    HooksMixin._HOOKS_DISABLED
                    and getattr(observer, "_imatrix_hook", None) not in HooksMixin._HOOKS_KEEP_ENABLED
                ):
                    return
                x = hook_input(args)
                if x is None or not isinstance(x, torch.Tensor):
                    return
                x = x.detach()
                observer._imatrix_sum = observer._imatrix_sum.to(x.device)
                observer._imatrix_count = observer._imatrix_count.to(x.device)
                if x.dtype in FLOAT_DTYPES and x.dim() >= 1:
                    _run(ops.accumulate_sq, x, observer._imatrix_sum, observer._imatrix_count)
                else:  # e.g. fp64 inputs: what llm-compressor does
                    x_f = x.to(torch.float32)
                    observer._imatrix_sum.add_(x_f.pow(2).sum(dim=list(range(x_f.dim() - 1))))
                    observer._imatrix_count += math.prod(x_f.shape[:-1])

            self._imatrix_hook = module.register_forward_pre_hook(_hook)

    # most specific first: a subclass of a listed class gets that class's mixins
    plan = [
        (IMatrixMSE, (_IMatrixMeasure, _OpsForward)),
        (MovingAverageMSE, (_MovingAverageUpdate, _MSEMeasure, _OpsForward)),
        (MemorylessMSE, (_MSEMeasure, _OpsForward)),
        (MinMax, (_MovingAverageUpdate, _OpsForward)),
        (StaticMinMax, (_StaticUpdate, _OpsForward)),
        (MemorylessMinMax, (_OpsForward,)),
    ]
    return plan


# What an adapter replaces: a class that overrides any of these itself computes
# something of its own, and is left as it is.
_REPLACED_METHODS = ("forward", "update_statistics_from_observed", "attach", "_prepare_importance",
                     "get_qparams")


def _adapter_for(cls, plan, cache: dict) -> Optional[type]:
    if not isinstance(cls, type):
        return None
    if cls in cache:
        return cache[cls]
    for base, mixins in plan:
        if not issubclass(cls, base):
            continue
        if any(getattr(cls, m, None) is not getattr(base, m, None) for m in _REPLACED_METHODS):
            return None  # e.g. a user's subclass with statistics of its own
        adapter = type(
            f"ObsKernels{cls.__name__}",
            (*mixins, cls),
            {"__doc__": f"{cls.__name__} computing through obskernels.ops.", "__module__": __name__},
        )
        cache[cls] = adapter
        return adapter
    return None


def _registry(lc_obs) -> dict:
    from compressed_tensors.registry import registry as ct_registry

    return ct_registry._REGISTRY[lc_obs.Observer]


def is_enabled() -> bool:
    return bool(_originals)


def enable(backend: Optional[str] = None) -> None:
    """Make llm-compressor's built-in observers compute through obskernels.

    :param backend: optional obskernels backend ("reference", "triton",
        "auto") the observers use; None follows ``obskernels.set_backend`` /
        ``use_backend`` / OBSKERNELS_BACKEND at each call. A forced backend
        that cannot run raises at once.
    Calling it again only changes the backend.
    """
    global _backend
    lc_obs = _import_llmcompressor()
    if backend is not None:
        with use_backend(backend):  # validates the name and, for triton, the runtime
            pass
    _backend = backend
    if _originals:
        return
    registry = _registry(lc_obs)
    plan = _build_adapters(lc_obs)
    cache: dict = {}
    replaced: dict[str, object] = {}
    for name, value in list(registry.items()):
        adapter = _adapter_for(value, plan, cache)
        if adapter is not None:
            replaced[name] = value
            registry[name] = adapter
    # the deprecated "fouroversix" alias is a function building nvfp4_expanded_mse
    alias = registry.get("fouroversix")
    expanded = registry.get("nvfp4-expanded-mse")
    if alias is not None and not isinstance(alias, type) and expanded in cache.values():

        def _fouroversix(*args, _adapter=expanded, **kwargs):
            warnings.warn(
                "observer 'fouroversix' is a deprecated alias of 'nvfp4_expanded_mse'",
                UserWarning,
                stacklevel=2,
            )
            return _adapter(*args, **kwargs)

        replaced["fouroversix"] = alias
        registry["fouroversix"] = _fouroversix
    _originals.update(replaced)


def disable() -> None:
    """Restore llm-compressor's own observers in its registry."""
    global _backend
    if not _originals:
        return
    lc_obs = importlib.import_module("llmcompressor.observers")
    registry = _registry(lc_obs)
    registry.update(_originals)
    _originals.clear()
    _backend = None


@contextlib.contextmanager
def enabled(backend: Optional[str] = None) -> Iterator[None]:
    """``enable(backend)`` for the duration of a ``with`` block, then ``disable()``
    (unless it was already enabled before the block)."""
    was_enabled = is_enabled()
    previous = _backend
    enable(backend)
    try:
        yield
    finally:
        if was_enabled:
            enable(previous)
        else:
            disable()
