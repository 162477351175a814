"""Reference statistics combination and non-finite record (see kernels/stats.py).

- held (min_vals, max_vals) with ``averaging_constant`` None: running
  ``torch.minimum`` / ``torch.maximum``; with c: ``held * (1.0 - c) + new * c``
  (not torch.lerp: its rounding differs; llm-compressor writes it out this way).
- status (int64, ``spec.record.STATUS_INIT`` layout): the value's NaN / +inf /
  -inf counts are added; when the new statistics are not finite the flag is
  set and the first such observation kept. Tensor ops only, no host read.
- out: the results are copied there (and returned) instead of new tensors.
"""

from __future__ import annotations

import torch

from obskernels.spec.calls import CombineCall
from obskernels.spec.record import STATUS_BAD_STATS, STATUS_FIRST_BAD, STATUS_NAN

__all__ = ["combine", "record", "deliver", "combine_statistics", "moving_average"]


def moving_average(old: torch.Tensor, new: torch.Tensor, c: float) -> torch.Tensor:
    """``old * (1 - c) + new * c`` in the statistics' dtype."""
    return old * (1.0 - c) + new * c


def combine(new_min, new_max, held=None, averaging_constant=None):
    if held is None:
        return new_min, new_max
    old_min, old_max = held
    if averaging_constant is None:
        return torch.minimum(new_min, old_min), torch.maximum(new_max, old_max)
    c = averaging_constant
    return moving_average(old_min, new_min, c), moving_average(old_max, new_max, c)


def deliver(result, out):
    """``result`` (min_vals, max_vals), copied into ``out`` when given."""
    if out is None:
        return result
    out[0].copy_(result[0])
    out[1].copy_(result[1])
    return out


def record(status, value, new_min, new_max, observation) -> None:
    counts = torch.stack((torch.isnan(value).sum(), torch.isposinf(value).sum(),
                          torch.isneginf(value).sum()))
    status[STATUS_NAN:STATUS_NAN + 3] += counts
    bad = ~(torch.isfinite(new_min).all() & torch.isfinite(new_max).all())
    status[STATUS_BAD_STATS] = torch.maximum(status[STATUS_BAD_STATS], bad.to(torch.int64))
    first = torch.minimum(status[STATUS_FIRST_BAD], torch.tensor(observation, device=status.device))
    status[STATUS_FIRST_BAD] = torch.where(bad, first, status[STATUS_FIRST_BAD])


def combine_statistics(call: CombineCall):
    """(min_vals, max_vals) to hold: the new statistics combined with the held
    ones; records the value's non-finite elements into ``status``."""
    result = combine(call.new_min, call.new_max, call.held, call.averaging_constant)
    if call.status is not None:
        record(call.status, call.flat.value, call.new_min, call.new_max, call.observation)
    return deliver(result, call.out)
