"""Reference per-group min/max: amin/amax of the flattened value over (0, -1).

On request, the statistics held from earlier values are combined in
(``held``, ``averaging_constant``: see reference/stats.py) and the value's
non-finite elements are recorded into ``status``.
"""

from __future__ import annotations

import torch

from obskernels.reference.flatten import flatten_for_calibration
from obskernels.reference.stats import combine, record
from obskernels.spec.checks import check_averaging, check_groups_nonempty, check_status

__all__ = ["min_max"]


def min_max(value, base_name, args, g_idx=None, *, held=None, averaging_constant=None,
            status=None, observation=0):
    observed = flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    check_groups_nonempty(observed, value, "min_max")
    check_averaging(averaging_constant)
    check_status(status)
    if observed.numel() == 0:  # no groups: nothing to reduce
        qshape = observed.shape[1:-1]
        mn, mx = observed.new_empty(qshape), observed.new_empty(qshape)
    else:
        mn, mx = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    out = combine(mn, mx, held, averaging_constant)  # checks held first
    if status is not None:
        record(status, value, mn, mx, observation)
    return out
