"""MSE observers: the range is chosen by the shrink-grid search of docs/spec.md §4."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist

from obskernels import ops
from obskernels.observers.base import MinMaxTuple, Observer, _number
from obskernels.observers.minmax import MovingAverageMixin
from obskernels.spec.search import (
    MSE_DEFAULTS,
    NVFP4_EXPANDED,
    check_search_params,
    default_triton_error_buffer,
)

__all__ = [
    "FourOverSixObserver",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "SearchKwargsMixin",
]


class SearchKwargsMixin:
    """Reads and validates the search kwargs at construction.

    ``_search_defaults`` names each kwarg's default; ``args.observer_kwargs``
    overrides them. Invalid values raise ValueError naming the kwarg (docs/spec.md §1).
    ``chunk_size`` is accepted and validated; it never changes the result.
    ``triton_error_buffer`` (llm-compressor 0.14.0.1: the slack of the
    per-group patience of its CUDA-only Triton search) is accepted and kept
    as ``self.triton_error_buffer``, llm-compressor's default when not given
    (``_default_triton_error_buffer``); it never changes the result either:
    obskernels always computes the eager search with GLOBAL patience, on
    every backend and device.
    """

    _search_defaults: Dict[str, Any] = {}

    def _default_triton_error_buffer(self):
        """llm-compressor's default for this observer; None where it has none."""
        return None

    def _init_search(self) -> None:
        kwargs = self.args.observer_kwargs
        try:
            key = (type(self), tuple(sorted(kwargs.items())))
            settings = _SETTINGS.get(key)
        except TypeError:  # an unhashable kwarg value: checked every time
            key, settings = None, None
        if settings is None:
            settings = self._search_settings({**self._search_defaults, **kwargs})
            if key is not None:
                _SETTINGS[key] = settings
        self.__dict__.update(settings)  # plain attributes
        if self.triton_error_buffer is None:
            # llm-compressor's default depends on the args, which the cache key leaves out
            self.triton_error_buffer = self._default_triton_error_buffer()

    def _search_settings(self, kw) -> Dict[str, Any]:
        """The checked search settings of ``kw`` (defaults merged in)."""
        out = dict(
            maxshrink=_number("maxshrink", kw["maxshrink"]),
            patience=_number("patience", kw["patience"], integer=True),
            grid=_number("grid", kw["grid"]),
            norm=_number("norm", kw["norm"]),
            expand=_number("expand", kw["expand"]),
        )
        check_search_params(out["maxshrink"], out["patience"], out["grid"], out["norm"],
                            out["expand"], "mse")
        buffer = kw.get("triton_error_buffer")
        if buffer is not None:
            _number("triton_error_buffer", buffer)
            if not math.isfinite(buffer) or buffer < 0:
                raise ValueError(
                    f"observer kwarg 'triton_error_buffer' must be a finite number >= 0, "
                    f"got {buffer!r}"
                )
        out["triton_error_buffer"] = buffer
        if "chunk_size" in self._search_defaults:
            out["chunk_size"] = _number("chunk_size", kw["chunk_size"], integer=True)
            if out["chunk_size"] <= 0:
                raise ValueError(
                    f"observer kwarg 'chunk_size' must be > 0, got {out['chunk_size']!r}"
                )
        return out

    def _search(self, value: torch.Tensor, flavour: str, g_idx=None, importance=None,
                importance_status=None, status=None, observation=0) -> MinMaxTuple:
        return search_with(self, value, flavour, importance, g_idx=g_idx,
                           importance_status=importance_status, status=status,
                           observation=observation)


def search_with(observer, value: torch.Tensor, flavour: str, importance=None, *, g_idx=None,
                importance_status=None, status=None, observation=0) -> MinMaxTuple:
    """``ops.mse_search`` with the search settings held by ``observer``
    (base_name, args, maxshrink, patience, grid, norm, expand): obskernels'
    observers and the llm-compressor adapters both search this way.

    A weight observed with a ``g_idx`` is searched with its columns in the
    stable order of g_idx, which is how docs/spec.md §2 groups them; the
    importance follows. ``importance_status``: ``importance`` is the raw
    E[x²] of ``ops.importance`` with its verdict in that record (the search
    normalises it, or searches uniformly when the verdict says so). ``status``:
    the non-finite record the search adds the value to (observation
    ``observation``), as ``ops.mse_search`` does."""
    if g_idx is not None:
        value, importance = gather_columns(value, observer.base_name, observer.args, g_idx, importance)
    return ops.mse_search(
        value,
        observer.base_name,
        observer.args,
        maxshrink=observer.maxshrink,
        patience=observer.patience,
        grid=observer.grid,
        norm=observer.norm,
        expand=observer.expand,
        importance=importance,
        flavour=flavour,
        importance_status=importance_status,
        status=status,
        observation=observation,
    )


def search_qparams_with(observer, value: torch.Tensor, *, record: bool = False,
                        widen: bool = True):
    """``ops.mse_search_qparams`` with the search settings held by
    ``observer``, as ``search_with`` (a first observation: no importance,
    no g_idx)."""
    return ops.mse_search_qparams(
        value, observer.base_name, observer.args, maxshrink=observer.maxshrink,
        patience=observer.patience, grid=observer.grid, norm=observer.norm,
        expand=observer.expand, record=record, widen=widen)


def gather_columns(value, base_name, args, g_idx, importance=None):
    """The weight's columns in the stable order of ``g_idx`` (and the
    importance in that order), through ``ops.flatten_for_calibration``, which
    validates ``g_idx`` and refuses it outside weights with the GROUP strategy."""
    grouped = ops.flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    value = grouped.reshape(value.shape[0], value.shape[1])
    if importance is not None:
        order = torch.argsort(g_idx, stable=True)
        importance = importance[order.to(importance.device)]
    return value, importance


_MSE_DEFAULTS = dict(MSE_DEFAULTS)
# (observer class, its kwargs) -> the checked search settings (SearchKwargsMixin)
_SETTINGS: Dict[tuple, Dict[str, Any]] = {}


@Observer.register("memoryless_mse")
class MemorylessMSEObserver(SearchKwargsMixin, Observer):
    """The search's (min_vals, max_vals) for the latest value.

    Kwargs: maxshrink 0.20, patience 5, grid 100, norm 2.4, expand 1.0, chunk_size 5,
    triton_error_buffer 1.0 for 4-bit floats, else 0.3 (kept, never used).
    """

    _act_sync_dict = {}
    _search_defaults = _MSE_DEFAULTS
    _qparams_ahead = True

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_search()

    def _measure_with_qparams(self, value, g_idx, record: bool):
        if g_idx is not None:
            value, _ = gather_columns(value, self.base_name, self.args, g_idx)
        return search_qparams_with(self, value, record=record)

    def _default_triton_error_buffer(self):
        return default_triton_error_buffer(self.args)

    def _measure(self, value: torch.Tensor, g_idx=None, status=None, observation=0) -> MinMaxTuple:
        return self._search(value, "mse", g_idx, status=status, observation=observation)


@Observer.register("mse")
class MovingAverageMSEObserver(MovingAverageMixin, MemorylessMSEObserver):
    """The search on each value, then a moving average as ``minmax`` (c = 0.01)."""

    _act_sync_dict = {"min_vals": dist.ReduceOp.AVG, "max_vals": dist.ReduceOp.AVG}

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_moving_average()


@Observer.register("nvfp4_expanded_mse")
class NVFP4ExpandedMSEObserver(MemorylessMSEObserver):
    """``memoryless_mse`` searching from 1.8x the range down to about 0.8x.

    Defaults: expand 1.8, maxshrink 1 - 0.8/1.8, grid 200, patience 1000,
    norm 2.4, triton_error_buffer 1.0.
    """

    _search_defaults = {**_MSE_DEFAULTS, **NVFP4_EXPANDED}

    def _default_triton_error_buffer(self):
        return default_triton_error_buffer(self.args, expanded=True)


@Observer.register("fouroversix")
class FourOverSixObserver(NVFP4ExpandedMSEObserver):
    """Deprecated name of ``nvfp4_expanded_mse`` (llm-compressor 0.14.0.1 keeps it).

    Loading it warns (``UserWarning``) and returns an
    ``NVFP4ExpandedMSEObserver`` built with the same arguments: the object is
    exactly what ``nvfp4_expanded_mse`` builds.
    """

    def __new__(cls, *args, **kwargs):
        warnings.warn(
            "observer 'fouroversix' is deprecated: it is the same observer as "
            "'nvfp4_expanded_mse'; load that name instead",
            UserWarning,
            stacklevel=3,
        )
        return NVFP4ExpandedMSEObserver(*args, **kwargs)
