"""Reference per-group min/max: amin/amax of the flattened value over (0, -1)."""

from __future__ import annotations

import torch

from obskernels.reference.flatten import flatten_for_calibration
from obskernels.validation import check_groups_nonempty

__all__ = ["min_max"]


def min_max(value, base_name, args, g_idx=None):
    observed = flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    check_groups_nonempty(observed, value, "min_max")
    if observed.numel() == 0:  # no groups: nothing to reduce
        qshape = observed.shape[1:-1]
        return observed.new_empty(qshape), observed.new_empty(qshape)
    return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
