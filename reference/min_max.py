"""Reference per-group min/max: amin/amax of the flattened value over (0, -1)."""

from __future__ import annotations

import torch

from obskernels.reference.flatten import flatten_for_calibration

__all__ = ["min_max"]


def min_max(value, base_name, args, g_idx=None):
    observed = flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
