"""Every operation's call, checked once: what the backends receive.

``obskernels.ops`` hands each call to the function of the same name here,
with the same arguments (``calls.min_max(value, base_name, args, ...)``),
which runs every input rule of ``spec.checks`` in the order below and returns
a frozen call object. Both backends take that object and check nothing
themselves: a rule has one place and one message, and a bad call fails the
same way whichever backend was chosen, before anything launches.

Order of the checks (the first rule broken is the error):
- flatten_for_calibration: the value's flattening (``spec.layout.flattening``).
- min_max: flattening, every group non-empty, averaging_constant, status,
  held statistics; every tensor on the value's device.
- mse_search: search parameters, importance_status, flattening, importance
  (its values too, unless they are raw with a verdict in importance_status),
  every group non-empty, a value with data (not on the meta device).
- combine_statistics: the statistics, held statistics, averaging_constant,
  status, then the value's flattening and one statistic per group.
- accumulate_sq, calculate_qparams, importance: their argument checks.

A backend called directly takes these objects too:
``obskernels.reference.min_max(calls.min_max(value, "weight", args))``.

Every check but g_idx's and a normalised importance's reads only the call's
signature: each tensor's shape, strides, dtype and device, the scalars, and
the fields of ``args`` that ``args_key`` lists. So ``obskernels.ops`` checks
a signature once and makes the calls of later values of it from the checked
one (the call objects are named tuples: ``call._replace(...)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from obskernels.spec.checks import (
    check_accumulate_args,
    check_averaging,
    check_combine_args,
    check_groups_nonempty,
    check_held,
    check_importance_args,
    check_importance_status,
    check_importance_target,
    check_out,
    check_qparams_args,
    check_same_device,
    check_statistics_shape,
    check_status,
)
from obskernels.spec.layout import Flattening, Strategy, flattening
from obskernels.spec.record import new_record
from obskernels.spec.search import SearchParams

__all__ = [
    "Flattening",
    "args_key",
    "MinMaxCall",
    "SearchCall",
    "CombineCall",
    "AccumulateCall",
    "QParamsCall",
    "MinMaxQParamsCall",
    "SearchQParamsCall",
    "ImportanceCall",
    "flatten_for_calibration",
    "min_max",
    "mse_search",
    "combine_statistics",
    "accumulate_sq",
    "calculate_qparams",
    "min_max_qparams",
    "mse_search_qparams",
    "importance",
]

Pair = tuple[torch.Tensor, torch.Tensor]


def args_key(args) -> tuple:
    """The fields of a ``QuantizationArgs`` that the operations read (every
    field but ``observer`` and ``observer_kwargs``), as a hashable tuple.
    ``QuantizationArgs`` is a mutable model: a checked call is reused only
    for args whose key is the same when the call is made."""
    bs = args.block_structure
    return (args.num_bits, args.type, args.symmetric, args.group_size, args.strategy,
            bs if bs is None else tuple(bs), args.dynamic, args.actorder, args.scale_dtype,
            args.zp_dtype)


#: the QuantizationArgs fields ``args_key`` leaves out: they configure the observer, not the op
ARGS_NOT_KEYED = ("observer", "observer_kwargs")


class MinMaxCall(NamedTuple):
    """``min_max``: the flattening, and what to combine the new statistics
    with; ``out``: where the results go (held statistics updated in place)."""

    flat: Flattening
    held: Pair | None = None
    averaging_constant: float | None = None
    status: torch.Tensor | None = None
    observation: int = 0
    out: Pair | None = None


class SearchCall(NamedTuple):
    """``mse_search``: the flattening, the search parameters and the importance.

    ``importance_status`` not None: ``importance`` is raw E[x²] (fp32) whose
    verdict lies in that record; its values were not read. ``status``: the
    record the value's non-finite elements and the statistics' are added
    to, as observation ``observation`` (as ``MinMaxCall``'s)."""

    flat: Flattening
    params: SearchParams
    importance: torch.Tensor | None = None
    importance_status: torch.Tensor | None = None
    status: torch.Tensor | None = None
    observation: int = 0


class CombineCall(NamedTuple):
    """``combine_statistics``: statistics computed from ``flat.value`` by
    another operation, and what to combine them with; ``out``: where the
    results go (the new or the held statistics may be overwritten)."""

    flat: Flattening
    new_min: torch.Tensor
    new_max: torch.Tensor
    held: Pair | None = None
    averaging_constant: float | None = None
    status: torch.Tensor | None = None
    observation: int = 0
    out: Pair | None = None


class AccumulateCall(NamedTuple):
    """``accumulate_sq``: x (..., channels), fp32 sums, one int64 count."""

    x: torch.Tensor
    sum_buf: torch.Tensor
    count_buf: torch.Tensor


class QParamsCall(NamedTuple):
    """``calculate_qparams``; ``fused`` as a tuple of (min_vals, max_vals) pairs."""

    min_vals: torch.Tensor
    max_vals: torch.Tensor
    args: object  # QuantizationArgs
    global_scale: torch.Tensor | None = None
    fused: tuple[Pair, ...] | None = None
    widen: bool = False
    carry: torch.Tensor | None = None


def _qparams_of(flat, mins, maxs, record, widen) -> QParamsCall:
    """The ``calculate_qparams`` call a ``*QParamsCall`` makes of the
    statistics it measured: widened as the call says, carrying ``record``, and for
    TENSOR_GROUP with the global scale of those statistics alone
    (``fused=((mins, maxs),)``: what ``get_qparams`` of an observer fused with
    no other returns)."""
    fused = ((mins, maxs),) if flat.strategy == Strategy.TENSOR_GROUP else None
    return QParamsCall(mins, maxs, flat.args, fused=fused, widen=widen, carry=record)


def _measured_then_qparams(call, measure, calculate_qparams):
    """A ``*QParamsCall`` as its definition, with a backend's two
    operations: ``measure`` of ``call.measuring(record)`` (a fresh record
    when ``call.record``), then ``calculate_qparams`` of the statistics
    (``qparams_of``). Returns (min_vals, max_vals, scale,
    zero_point, global_scale, status): min_max's result, then
    calculate_qparams'."""
    record = new_record(call.flat.value.device) if call.record else None
    mins, maxs = measure(call.measuring(record))
    return (mins, maxs, *calculate_qparams(call.qparams_of(mins, maxs, record)))


class MinMaxQParamsCall(NamedTuple):
    """``min_max_qparams``: the flattening of a first observation, whether
    its non-finite elements are recorded (into a fresh record), and whether
    the qparams are widened (``calculate_qparams``' ``widen``)."""

    flat: Flattening
    record: bool = False
    widen: bool = True

    def measuring(self, status=None) -> MinMaxCall:
        """The min_max alone, adding the value to ``status`` as observation 0."""
        return MinMaxCall(self.flat, status=status)

    def by_parts(self, min_max, calculate_qparams):
        """The operation as its definition (``_measured_then_qparams``)."""
        return _measured_then_qparams(self, min_max, calculate_qparams)

    def qparams_of(self, mins, maxs, record=None) -> QParamsCall:
        """The ``calculate_qparams`` call of the statistics measured (``_qparams_of``)."""
        return _qparams_of(self.flat, mins, maxs, record, self.widen)


class SearchQParamsCall(NamedTuple):
    """``mse_search_qparams``: the search of a first observation (no
    importance), whether its non-finite elements are recorded (into a fresh
    record), and whether the qparams are widened."""

    flat: Flattening
    params: SearchParams
    record: bool = False
    widen: bool = True

    def measuring(self, status=None) -> SearchCall:
        """The search alone, adding the value to ``status`` as observation 0."""
        return SearchCall(self.flat, self.params, None, None, status, 0)

    def by_parts(self, mse_search, calculate_qparams):
        """The operation as its definition (``_measured_then_qparams``)."""
        return _measured_then_qparams(self, mse_search, calculate_qparams)

    def qparams_of(self, mins, maxs, record=None) -> QParamsCall:
        """The ``calculate_qparams`` call of the statistics measured (``_qparams_of``)."""
        return _qparams_of(self.flat, mins, maxs, record, self.widen)


class ImportanceCall(NamedTuple):
    """``importance``: fp32 per-column sums, one int64 count, an observer's record."""

    sum_buf: torch.Tensor
    count_buf: torch.Tensor
    status: torch.Tensor


def _check_on_device(value: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None:
            check_same_device(name, t, "value", value)


def flatten_for_calibration(value, base_name, args, g_idx=None) -> Flattening:
    return flattening(value, base_name, args, g_idx)


def min_max(value, base_name, args, g_idx=None, *, held=None, averaging_constant=None,
            status=None, observation=0, out=None) -> MinMaxCall:
    flat = flattening(value, base_name, args, g_idx)
    check_groups_nonempty(flat.flat_shape, value, "min_max")
    check_averaging(averaging_constant)
    check_status(status)
    _check_on_device(value, status=status)
    if held is not None:
        check_held(held, flat.qshape, value.dtype, value.device)
    if out is not None:
        check_out(out, flat.qshape, value.dtype, value.device)
    return MinMaxCall(flat, held, averaging_constant, status, observation, out)


def mse_search(value, base_name, args, *, maxshrink, patience, grid, norm, expand=1.0,
               importance=None, flavour="mse", importance_status=None, status=None,
               observation=0) -> SearchCall:
    params = SearchParams(maxshrink, patience, grid, norm, expand, flavour)
    check_importance_status(importance, importance_status)
    check_status(status)
    flat = flattening(value, base_name, args)
    if importance is not None:
        # raw importance (with importance_status) is judged by its verdict on
        # the device, not read here: shape, dtype and device only
        check_importance_target(importance, value, flat.base_name, args,
                                values=importance_status is None)
    check_groups_nonempty(flat.flat_shape, value, "mse_search")
    if flat.has_elements and value.device.type == "meta":
        raise ValueError(
            "mse_search: value is on the meta device; expected a device with data "
            "(where the search stops depends on the values)"
        )
    _check_on_device(value, status=status)
    return SearchCall(flat, params, importance, importance_status, status, observation)


def combine_statistics(value, base_name, args, new_min, new_max, *, held=None,
                       averaging_constant=None, status=None, observation=0,
                       out=None) -> CombineCall:
    check_combine_args(new_min, new_max, held, averaging_constant, status)
    flat = flattening(value, base_name, args)
    check_statistics_shape(new_min, flat.qshape)
    _check_on_device(value, new_min=new_min, status=status)
    if out is not None:
        check_out(out, new_min.shape, new_min.dtype, new_min.device)
    return CombineCall(flat, new_min, new_max, held, averaging_constant, status, observation,
                       out)


def accumulate_sq(x, sum_buf, count_buf) -> AccumulateCall:
    check_accumulate_args(x, sum_buf, count_buf)
    return AccumulateCall(x, sum_buf, count_buf)


def calculate_qparams(min_vals, max_vals, args, global_scale=None, *, fused=None, widen=False,
                      carry=None) -> QParamsCall:
    fused = None if fused is None else tuple(fused)  # read once, even from an iterator
    check_qparams_args(min_vals, max_vals, args, global_scale, fused, carry)
    return QParamsCall(min_vals, max_vals, args, global_scale, fused, bool(widen), carry)


def _check_switches(record, widen) -> None:
    for name, flag in (("record", record), ("widen", widen)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def min_max_qparams(value, base_name, args, g_idx=None, *, record=False,
                    widen=True) -> MinMaxQParamsCall:
    flat = flattening(value, base_name, args, g_idx)
    check_groups_nonempty(flat.flat_shape, value, "min_max_qparams")
    _check_switches(record, widen)
    return MinMaxQParamsCall(flat, record, widen)


def mse_search_qparams(value, base_name, args, *, maxshrink, patience, grid, norm, expand=1.0,
                       flavour="mse", record=False, widen=True) -> SearchQParamsCall:
    search = mse_search(value, base_name, args, maxshrink=maxshrink, patience=patience, grid=grid,
                        norm=norm, expand=expand, flavour=flavour)
    _check_switches(record, widen)
    return SearchQParamsCall(search.flat, search.params, record, widen)


def importance(sum_buf, count_buf, status) -> ImportanceCall:
    check_importance_args(sum_buf, count_buf, status)
    return ImportanceCall(sum_buf, count_buf, status)
