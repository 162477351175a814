"""The observer operations, checked once and dispatched to the active backend.

Each function here checks its call with the function of the same name in
``obskernels.spec.calls`` (every input rule, one message each) and hands the
checked call to the backend: ``obskernels.reference`` or ``obskernels.kernels``,
whose twins take that same call and check nothing. Observers reach tensors
only through this module.
"""

from __future__ import annotations

from typing import Callable

import torch

from obskernels.backends import (
    KernelUnsupportedError,
    backend_module,
    get_backend,
    logger,
    resolve_backend,
)
from obskernels.spec import calls

__all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams",
           "combine_statistics", "importance"]

_fallbacks_logged: set[str] = set()

# Operations whose kernels have nothing to launch for an empty value: the
# reference computes those (its empty result, or its error), whichever backend
# was chosen -- not a fallback, the same answer.
_EMPTY_ON_REFERENCE = frozenset(("flatten_for_calibration", "min_max", "mse_search", "accumulate_sq"))


def _dispatch(op: str, tensor: torch.Tensor, *args, **kwargs):
    """Resolve the backend for ``tensor`` (a forced backend that cannot run
    is an error first), check the call once, run it there. Under "auto" a
    kernel's KernelUnsupportedError (valid input it does not cover) falls back
    to the reference with the same checked call, logged once per reason."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    name = resolve_backend(tensor)
    call = getattr(calls, op)(tensor, *args, **kwargs)
    if tensor.numel() == 0 and op in _EMPTY_ON_REFERENCE:
        name = "reference"
    fn: Callable = getattr(backend_module(name), op)
    if name == "reference":
        return fn(call)
    try:
        return fn(call)
    except KernelUnsupportedError as exc:
        if get_backend() == "triton":
            raise
        key = f"{op}: {exc}"
        if key not in _fallbacks_logged:
            _fallbacks_logged.add(key)
            logger.warning("obskernels: %s; using the reference backend", key)
        return getattr(backend_module("reference"), op)(call)


def flatten_for_calibration(value, base_name, args, g_idx=None):
    """(num_observations, *qparam_shape, group_size) view or copy of ``value`` (docs/spec.md §2)."""
    return _dispatch("flatten_for_calibration", value, base_name, args, g_idx=g_idx)


def min_max(value, base_name, args, g_idx=None, *, held=None, averaging_constant=None,
            status=None, observation=0):
    """(min_vals, max_vals) per group, with the qparam shape (docs/spec.md §2).

    ``held``: statistics held from earlier values, combined in: running min /
    max, or the moving average ``held * (1 - c) + new * c`` when
    ``averaging_constant`` c is given. ``status``: an observer's non-finite
    record (``spec.record.STATUS_INIT`` layout) that the value's NaN / +-inf
    counts are added to, as observation number ``observation``.
    """
    return _dispatch("min_max", value, base_name, args, g_idx=g_idx, held=held,
                     averaging_constant=averaging_constant, status=status,
                     observation=observation)


def mse_search(
    value,
    base_name,
    args,
    *,
    maxshrink,
    patience,
    grid,
    norm,
    expand=1.0,
    importance=None,
    flavour="mse",
    importance_status=None,
):
    """(min_vals, max_vals) minimizing the shrink-grid error (docs/spec.md §4).
    ``importance_status``: ``importance`` is the raw E[x²] of ``importance()``
    with its verdict in this record; the search normalises it (uniform weights
    when the verdict says it is unusable), reading nothing on the triton backend."""
    return _dispatch(
        "mse_search",
        value,
        base_name,
        args,
        maxshrink=maxshrink,
        patience=patience,
        grid=grid,
        norm=norm,
        expand=expand,
        importance=importance,
        flavour=flavour,
        importance_status=importance_status,
    )


def accumulate_sq(x, sum_buf, count_buf):
    """sum_buf += sum over tokens of x**2 (fp32); count_buf += tokens. In place."""
    return _dispatch("accumulate_sq", x, sum_buf, count_buf)


def calculate_qparams(min_vals, max_vals, args, global_scale=None, *, fused=None, widen=False,
                      carry=None):
    """(scale, zero_point, global_scale, status): compressed-tensors'
    ``calculate_qparams`` on the statistics (docs/spec.md §3), with an observer's
    global scale from ``fused`` statistics, the float64 redo of overflowed
    groups (``widen``) and the non-finite record (``carry``) on request;
    ``status`` is read once by the caller (see ``reference.qparams``)."""
    return _dispatch(
        "calculate_qparams", min_vals, max_vals, args, global_scale,
        fused=fused, widen=widen, carry=carry,
    )


def combine_statistics(value, base_name, args, new_min, new_max, *, held=None,
                       averaging_constant=None, status=None, observation=0):
    """``min_max``'s epilogue for statistics another operation computed from
    ``value`` (the MSE search): combine with ``held``, record non-finite input."""
    return _dispatch(
        "combine_statistics", value, base_name, args, new_min, new_max, held=held,
        averaging_constant=averaging_constant, status=status, observation=observation,
    )


def importance(sum_buf, count_buf, status):
    """The imatrix importance ``sum_buf / fp32(count_buf)`` (fp32, per input
    column); its verdict (spec.record.IMPORTANCE_*: usable, or why not) goes
    into ``status[STATUS_IMPORTANCE]``, on the device, unread."""
    return _dispatch("importance", sum_buf, count_buf, status)
