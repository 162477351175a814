"""Reference per-group min/max: amin/amax of the flattened value over (0, -1).

On request, the statistics held from earlier values are combined in
(``held``, ``averaging_constant``: see reference/stats.py), the value's
non-finite elements are recorded into ``status`` and the results are copied
into ``out``.
"""

from __future__ import annotations

import torch

from obskernels.reference.flatten import flatten_for_calibration
from obskernels.reference.qparams import calculate_qparams
from obskernels.reference.stats import combine, deliver, record
from obskernels.spec.calls import MinMaxCall, MinMaxQParamsCall

__all__ = ["min_max", "min_max_qparams"]


def min_max(call: MinMaxCall):
    observed = flatten_for_calibration(call.flat)
    if observed.numel() == 0:  # no groups: nothing to reduce
        qshape = observed.shape[1:-1]
        mn, mx = observed.new_empty(qshape), observed.new_empty(qshape)
    else:
        mn, mx = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    result = combine(mn, mx, call.held, call.averaging_constant)
    if call.status is not None:
        record(call.status, call.flat.value, mn, mx, call.observation)
    return deliver(result, call.out)


def min_max_qparams(call: MinMaxQParamsCall):
    """(min_vals, max_vals, scale, zero_point, global_scale, status):
    ``min_max``, then ``calculate_qparams(widen=call.widen)`` carrying the value's
    record, for TENSOR_GROUP with the statistics' own global scale
    (``call.qparams_of``)."""
    return call.by_parts(min_max, calculate_qparams)
