"""The observer operations, checked once and dispatched to the active backend.

Each function here checks its call with the function of the same name in
``obskernels.spec.calls`` (every input rule, one message each) and hands the
checked call to the backend: ``obskernels.reference`` or ``obskernels.kernels``,
whose twins take that same call and check nothing. Observers reach tensors
only through this module.

A call is checked once per signature. Every rule but g_idx's and a
normalised importance's reads only the call's signature (each tensor's
shape, strides, dtype and device, the scalars, the fields of ``args``
named by ``spec.calls.args_key``) and the requested backend, so the first
call of a signature is checked, and routed, and the backend prepares its
launch (``kernels.PREPARE``: layout, blocks, splits, launch constants; the
reference computes as it is). The plan is kept: a later call of the same
signature is made from the checked one with its own tensors and goes
straight to the prepared launch. Calls with g_idx, or with importance whose
values are checked, are checked every time. Activation observers see the
same shape thousands of times: their forward costs a dictionary lookup, not
a check.
"""

from __future__ import annotations

import functools
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
from obskernels.spec.record import STATUS_INIT
from obskernels.spec.calls import (
    AccumulateCall,
    CombineCall,
    Flattening,
    ImportanceCall,
    MinMaxCall,
    MinMaxQParamsCall,
    QParamsCall,
    SearchCall,
    SearchQParamsCall,
    args_key,
)

__all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams",
           "combine_statistics", "importance", "min_max_qparams", "mse_search_qparams", "Ahead",
           "Repeat"]

_fallbacks_logged: set[str] = set()

# Operations whose kernels have nothing to launch for an empty value: the
# reference computes those (its empty result, or its error), whichever backend
# was chosen -- not a fallback, the same answer.
_EMPTY_ON_REFERENCE = frozenset(
    ("flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "min_max_qparams",
     "mse_search_qparams"))

#: signature -> _Plan; at most _MAX_PLANS (then it starts afresh)
_PLANS: dict = {}
_MAX_PLANS = 4096


class _Plan:
    """A checked signature: where it runs, its prepared launch, and the
    tensor-free parts of its checked call (no tensor of the first call is
    kept). ``plan.run(call)`` launches a call made from them."""

    __slots__ = ("op", "name", "launch", "head", "rest", "extra")

    def __init__(self, op, name, launch, checked):
        self.op, self.name, self.launch = op, name, launch
        flat = checked if isinstance(checked, Flattening) else getattr(checked, "flat", None)
        # a Flattening is (value, base_name, strategy, args, *rest): rebuilt per call
        self.head = None if flat is None else flat[1:3]
        self.rest = None if flat is None else flat[4:]
        self.extra = checked.params if isinstance(checked, (SearchCall, SearchQParamsCall)) else None

    def run(self, call):
        try:
            return self.launch(call)
        except KernelUnsupportedError as exc:
            return _fall_back(self.op, exc, call)

    def run_with(self, call, scratch):
        """``run`` with the scratch a caller keeps for a split (``Repeat``)."""
        try:
            return self.launch(call, scratch)
        except KernelUnsupportedError as exc:
            return _fall_back(self.op, exc, call)


# Signatures. A key holds, for each argument, what the checks read of it:
# a tensor's type, shape, strides, dtype and device; args' key (and type); a
# scalar with its type (a float by its bits: -0.0 is not 0.0). Anything of
# another kind raises while the key is made: no key, the call is checked.
def _t(t):
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


def _pair(p):
    """Two tensors (held / new / out statistics): their signatures, and
    whether they share their data."""
    if type(p) is not tuple or len(p) != 2:
        raise TypeError
    a, b = p
    return (type(a), a.shape, a.stride(), a.dtype, a.device,
            type(b), b.shape, b.stride(), b.dtype, b.device, a.data_ptr() == b.data_ptr())


def _switches(record, widen):
    """Two switches of a first observation, keyed as ``_scalar`` keys them."""
    return type(record), record, type(widen), widen


def _opt(t):
    return None if t is None else _t(t)


def _scalar(x):
    kind = type(x)
    return (kind, x.hex() if kind is float else x)


def _out(out, *same):
    """``out`` as one of the pairs already described (its index), else its signature."""
    if out is None:
        return None
    if type(out) is not tuple or len(out) != 2:
        raise TypeError  # the check says what out must be
    for i, pair in enumerate(same):
        if pair is not None and out[0] is pair[0] and out[1] is pair[1]:
            return (i, out[0].data_ptr() == out[1].data_ptr())
    return _pair(out)


_UNKEYED = (AttributeError, TypeError, IndexError, ValueError, RuntimeError)


def _fall_back(op: str, exc: KernelUnsupportedError, call):
    """Under "auto", a kernel's KernelUnsupportedError (valid input it does
    not cover) runs the reference with the same checked call, logged once per
    reason; a forced "triton" raises it."""
    if get_backend() == "triton":
        raise exc
    key = f"{op}: {exc}"
    if key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        logger.warning("obskernels: %s; using the reference backend", key)
    return getattr(backend_module("reference"), op)(call)


def _dispatch(op: str, key, tensor: torch.Tensor, *args, **kwargs):
    """Resolve the backend for ``tensor`` (a forced backend that cannot run
    is an error first), check the call once, run it there; with a ``key``,
    keep the plan of its signature (``_Plan``). Under "auto" a kernel's
    KernelUnsupportedError falls back to the reference (``_fall_back``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    name = resolve_backend(tensor)
    call = getattr(calls, op)(tensor, *args, **kwargs)
    if tensor.numel() == 0 and op in _EMPTY_ON_REFERENCE:
        name = "reference"
    module = backend_module(name)
    fn: Callable = getattr(module, op)
    prepare = getattr(module, "PREPARE", {}).get(op)
    try:
        launch = prepare(call) if prepare is not None else fn
        _keep(key, _Plan(op, name, launch, call))
        return launch(call)
    except KernelUnsupportedError as exc:
        result = _fall_back(op, exc, call)  # a forced triton raises here
        # "auto": this signature runs on the reference from now on
        _keep(key, _Plan(op, "reference", getattr(backend_module("reference"), op), call))
        return result


def _keep(key, plan: _Plan) -> None:
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan


def flatten_for_calibration(value, base_name, args, g_idx=None):
    """(num_observations, *qparam_shape, group_size) view or copy of ``value``
    (docs/spec.md §2)."""
    try:
        key = None if g_idx is not None else (get_backend(), "flatten", _t(value), base_name,
                                              type(args), args_key(args))
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    if plan is not None:
        return plan.run(Flattening(value, *plan.head, args, *plan.rest))
    return _dispatch("flatten_for_calibration", key, value, base_name, args, g_idx=g_idx)


def min_max(value, base_name, args, g_idx=None, *, held=None, averaging_constant=None,
            status=None, observation=0, out=None, repeat=None):
    """(min_vals, max_vals) per group, with the qparam shape (docs/spec.md §2).

    ``held``: statistics held from earlier values, combined in: running min /
    max, or the moving average ``held * (1 - c) + new * c`` when
    ``averaging_constant`` c is given. ``status``: an observer's non-finite
    record (``spec.record.STATUS_INIT`` layout) that the value's NaN / +-inf
    counts are added to, as observation number ``observation``. ``out``:
    two contiguous tensors the results are written into (they may be ``held``
    itself: statistics updated in place) and returned. ``repeat``: a
    ``Repeat`` the caller keeps for a call it repeats in place (``out`` is
    ``held``): see there.
    """
    if repeat is not None and held is not None and out is held:
        result = repeat.again(value, base_name, args, held, averaging_constant, status, observation)
        if result is not None:
            return result
    try:
        key = None if g_idx is not None else (
            get_backend(), "min_max", _t(value), base_name, type(args), args_key(args),
            None if held is None else _pair(held),
            None if averaging_constant is None else _scalar(averaging_constant),
            None if status is None else _t(status), _out(out, held))
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    remember = repeat is not None and key is not None and held is not None and out is held
    if plan is not None:
        call = MinMaxCall(Flattening(value, *plan.head, args, *plan.rest), held,
                          averaging_constant, status, observation, out)
        if not remember:
            return plan.run(call)
        # remembered first: this launch takes the caller's tickets already
        repeat.remember(plan, value, base_name, args, held, averaging_constant, status)
        result = repeat.run(call)
        repeat.marks = repeat.marks_now()  # (the reference's torch ops advance versions)
        return result
    result = _dispatch("min_max", key, value, base_name, args, g_idx=g_idx, held=held,
                       averaging_constant=averaging_constant, status=status,
                       observation=observation, out=out)
    if remember:
        repeat.remember(_PLANS.get(key), value, base_name, args, held, averaging_constant, status)
    return result


def min_max_qparams(value, base_name, args, g_idx=None, *, record=False, widen=True):
    """(min_vals, max_vals, scale, zero_point, global_scale, status) of a
    first observation in one operation: ``min_max(value, ...)`` with nothing
    held (``record``: its non-finite elements counted into a fresh record),
    then ``calculate_qparams(min_vals, max_vals, args, widen=widen,
    carry=that record)`` (``widen=False``: compressed-tensors' own
    arithmetic, no float64 redo), for TENSOR_GROUP with ``fused=((min_vals,
    max_vals),)`` (the statistics' own global scale; None otherwise) -- the
    same tensors, bit for bit, as those two calls. The triton backend
    computes the qparams in min_max's one launch (in its epilogue; with a
    reduction split across programs, the last program of each block to
    arrive finishes it); for TENSOR_GROUP the launch giving the statistics
    writes partial absolute maxima and one more launch computes the global
    scale and the qparams. ``status`` is calculate_qparams': the record,
    then the scale flags; the caller reads it once."""
    try:
        key = None if g_idx is not None else (
            get_backend(), "min_max_qparams", _t(value), base_name, type(args), args_key(args),
            *_switches(record, widen))
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    if plan is not None:
        return plan.run(MinMaxQParamsCall(Flattening(value, *plan.head, args, *plan.rest),
                                          record, widen))
    return _dispatch("min_max_qparams", key, value, base_name, args, g_idx=g_idx, record=record,
                     widen=widen)


class Ahead:
    """The qparams of ``min_max_qparams`` / ``mse_search_qparams``, kept by
    the caller with the statistics they were computed from, until it calls
    for them:
    ``take(min_vals, max_vals, args)`` returns (scale, zero_point,
    global_scale, status) -- what ``calculate_qparams(min_vals, max_vals,
    args, widen=<the operation's widen>, carry=the record)`` would, for TENSOR_GROUP with
    ``fused=((min_vals, max_vals),)`` -- when those are the same statistics
    (the same objects, their version counters unchanged: no in-place change
    since), the args' key and the requested backend are the same; None
    otherwise (then the caller calls ``calculate_qparams``, carrying
    ``record()``)."""

    __slots__ = ("stats", "marks", "qparams")

    def __init__(self, result, args):
        self.stats, self.qparams = result[:2], result[2:]
        self.marks = self._marks(args)

    def _marks(self, args):
        mins, maxs = self.stats
        return (get_backend(), args_key(args), mins._version, maxs._version)

    def take(self, min_vals, max_vals, args):
        if min_vals is not self.stats[0] or max_vals is not self.stats[1]:
            return None
        try:
            same = self._marks(args) == self.marks
        except _UNKEYED:
            return None
        return self.qparams if same else None

    def record(self) -> torch.Tensor:
        """The record the observation was counted into: the head of status."""
        return self.qparams[3][:len(STATUS_INIT)]


class Repeat:
    """What a caller that repeats one ``min_max`` call in place keeps between
    calls (an observer's forward: its held statistics as ``out``, its record,
    its averaging constant; values of one signature): the plan of the call it
    last made and what that call's key was built from.

    ``min_max(..., repeat=r)`` compares a call with it: the requested
    backend, the value's signature, base_name, the args' key, the averaging
    constant, and the held statistics and the record as the same objects,
    unchanged since (their version counters, which every in-place torch
    operation on them advances -- a change of shape or strides included --,
    and their data pointers). Where all match, the call is the remembered
    signature's and goes to its plan without building the key (the key's
    hash and the held tensors' descriptions cost as much as the launch on
    the host); otherwise it takes the usual path and is remembered (before
    its launch where the signature's plan exists, so that the launch takes
    the tickets below already: another observer of the same shapes made it).
    ``r.again(...)`` is that comparison and launch alone, for a caller that
    would check more before ``min_max`` (None where the call does not match:
    the remembered call passed those checks with the same tensors). A kernel
    writes the statistics without advancing their versions, the reference
    backend's torch operations advance them: there every other call takes
    the usual path, which is only slower. It holds the tensors of the call
    it remembers (an observer's own); ``forget()`` lets them go.

    ``run``: the plan's run for a call. A triton reduction split across
    programs (a whole tensor) takes ``scratch`` kept here for its launch
    (``launch.new_scratch()``): one zeroed counter per block, with which it
    is ONE launch whose last program of each block finishes it (two
    without), and the blocks' partials, allocated once rather than at every
    forward. They are the caller's own, as its statistics are: no other call
    of the signature meets them (calls on two streams at once would race on
    the statistics first).
    """

    __slots__ = ("plan", "sig", "tensors", "marks", "scratch", "scratch_for", "run")

    def __init__(self):
        self.scratch = self.scratch_for = None
        self.forget()

    def forget(self) -> None:
        self.plan = self.sig = self.tensors = self.marks = self.run = None

    def marks_now(self):
        low, high, status = self.tensors
        marks = (low._version, low.data_ptr(), high._version, high.data_ptr())
        return marks if status is None else (*marks, status._version, status.data_ptr())

    @staticmethod
    def _signature(value, base_name, args, averaging_constant) -> tuple:
        """What the key reads of the call but its held tensors and record."""
        return (get_backend(), _t(value), base_name, type(args), args_key(args),
                None if averaging_constant is None else _scalar(averaging_constant))

    def remember(self, plan, value, base_name, args, held, averaging_constant, status) -> None:
        if plan is None:
            self.forget()
            return
        self.plan, self.tensors = plan, (held[0], held[1], status)
        self.sig = self._signature(value, base_name, args, averaging_constant)
        self.marks = self.marks_now()
        # a triton launch of a split reduction takes scratch to finish it in
        # one launch: made once per launch (its tickets zeroed, put back to
        # zero by every launch)
        new_scratch = getattr(plan.launch, "new_scratch", None)
        if new_scratch is None:
            self.run = plan.run
            return
        if self.scratch_for is not plan.launch:
            self.scratch, self.scratch_for = new_scratch(), plan.launch
        self.run = functools.partial(plan.run_with, scratch=self.scratch)

    def again(self, value, base_name, args, held, averaging_constant=None, status=None,
              observation=0):
        """``min_max(value, base_name, args, held=held, averaging_constant=...,
        status=..., observation=..., out=held)`` where that is the remembered
        call's signature (its result: ``held``); None, having run nothing,
        where it is not."""
        tensors = self.tensors
        if tensors is None or held[0] is not tensors[0] or held[1] is not tensors[1] \
                or status is not tensors[2]:
            return None
        try:
            sig = self._signature(value, base_name, args, averaging_constant)
        except _UNKEYED:
            return None
        if sig != self.sig or self.marks_now() != self.marks:
            return None
        plan = self.plan
        return self.run(MinMaxCall(Flattening(value, *plan.head, args, *plan.rest), held,
                                   averaging_constant, status, observation, held))


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
    status=None,
    observation=0,
):
    """(min_vals, max_vals) minimizing the shrink-grid error (docs/spec.md §4).
    ``importance_status``: ``importance`` is the raw E[x²] of ``importance()``
    with its verdict in this record; the search normalises it (uniform weights
    when the verdict says it is unusable), reading nothing on the triton backend.
    ``status``: a non-finite record, as ``min_max``'s, that the value's NaN /
    +-inf counts and the statistics' verdict are added to (observation number
    ``observation``) by the search itself."""
    key = plan = None
    if importance is None or importance_status is not None:  # no importance values to check
        try:
            key = (get_backend(), "mse_search", _t(value), base_name, type(args),
                   args_key(args),
                   _scalar(maxshrink), _scalar(patience), _scalar(grid), _scalar(norm),
                   _scalar(expand), flavour, _opt(importance), _opt(importance_status),
                   _opt(status))
            plan = _PLANS.get(key)
        except _UNKEYED:
            key = plan = None
    if plan is not None:
        return plan.run(SearchCall(Flattening(value, *plan.head, args, *plan.rest), plan.extra,
                                   importance, importance_status, status, observation))
    return _dispatch(
        "mse_search",
        key,
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
        status=status,
        observation=observation,
    )


def mse_search_qparams(value, base_name, args, *, maxshrink, patience, grid, norm, expand=1.0,
                       flavour="mse", record=False, widen=True):
    """``min_max_qparams`` for the search (no importance): (min_vals,
    max_vals, scale, zero_point, global_scale, status), the tensors of
    ``mse_search(..., status=a fresh record when record)`` then
    ``calculate_qparams(widen=widen, carry=that record)`` (for TENSOR_GROUP
    with the statistics' own global scale). The triton backend computes the
    qparams in the search's choice (no launch more) where it makes one
    (not for TENSOR_GROUP)."""
    try:
        key = (get_backend(), "mse_search_qparams", _t(value), base_name, type(args),
               args_key(args), _scalar(maxshrink), _scalar(patience), _scalar(grid),
               _scalar(norm), _scalar(expand), flavour, *_switches(record, widen))
        plan = _PLANS.get(key)
    except _UNKEYED:
        key = plan = None
    if plan is not None:
        return plan.run(SearchQParamsCall(Flattening(value, *plan.head, args, *plan.rest),
                                          plan.extra, record, widen))
    return _dispatch("mse_search_qparams", key, value, base_name, args, maxshrink=maxshrink,
                     patience=patience, grid=grid, norm=norm, expand=expand, flavour=flavour,
                     record=record, widen=widen)


def _on_tensors(op: str, call_type, *tensors):
    """An operation of tensors only, keyed by their signatures."""
    try:
        key = (get_backend(), op, *[_t(t) for t in tensors])
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    if plan is not None:
        return plan.run(call_type(*tensors))
    return _dispatch(op, key, *tensors)


def accumulate_sq(x, sum_buf, count_buf):
    """sum_buf += sum over tokens of x**2 (fp32); count_buf += tokens. In place."""
    return _on_tensors("accumulate_sq", AccumulateCall, x, sum_buf, count_buf)


def calculate_qparams(min_vals, max_vals, args, global_scale=None, *, fused=None, widen=False,
                      carry=None):
    """(scale, zero_point, global_scale, status): compressed-tensors'
    ``calculate_qparams`` on the statistics (docs/spec.md §3), with an observer's
    global scale from ``fused`` statistics, the float64 redo of overflowed
    groups (``widen``) and the non-finite record (``carry``) on request;
    ``status`` is read once by the caller (see ``reference.qparams``)."""
    if fused is not None and type(fused) is not tuple:
        fused = tuple(fused)  # read once, even from an iterator
    try:
        key = (get_backend(), "calculate_qparams", _t(min_vals), _t(max_vals), type(args),
               args_key(args),
               _opt(global_scale), None if fused is None else tuple(_pair(p) for p in fused),
               _scalar(widen), None if carry is None else _t(carry))
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    if plan is not None:
        return plan.run(QParamsCall(min_vals, max_vals, args, global_scale, fused, bool(widen),
                                    carry))
    return _dispatch(
        "calculate_qparams", key, min_vals, max_vals, args, global_scale,
        fused=fused, widen=widen, carry=carry,
    )


def combine_statistics(value, base_name, args, new_min, new_max, *, held=None,
                       averaging_constant=None, status=None, observation=0, out=None):
    """``min_max``'s epilogue for statistics another operation computed from
    ``value`` (the MSE search): combine with ``held``, record non-finite input,
    write into ``out`` (which may be the new or the held statistics)."""
    try:
        key = (get_backend(), "combine_statistics", _t(value), base_name, type(args),
               args_key(args), _t(new_min), _t(new_max), None if held is None else _pair(held),
               None if averaging_constant is None else _scalar(averaging_constant),
               None if status is None else _t(status), _out(out, held, (new_min, new_max)))
        plan = _PLANS.get(key)
    except _UNKEYED:  # not keyed (the check will say what is wrong), or unhashable
        key = plan = None
    if plan is not None:
        return plan.run(CombineCall(Flattening(value, *plan.head, args, *plan.rest), new_min,
                                    new_max, held, averaging_constant, status, observation, out))
    return _dispatch(
        "combine_statistics", key, value, base_name, args, new_min, new_max, held=held,
        averaging_constant=averaging_constant, status=status, observation=observation, out=out,
    )


def importance(sum_buf, count_buf, status):
    """The imatrix importance ``sum_buf / fp32(count_buf)`` (fp32, per input
    column); its verdict (spec.record.IMPORTANCE_*: usable, or why not) goes
    into ``status[STATUS_IMPORTANCE]``, on the device, unread."""
    return _on_tensors("importance", ImportanceCall, sum_buf, count_buf, status)
