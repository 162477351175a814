"""Reference imatrix importance: E[x²] per input column and its verdict.

``importance(call)`` (``call = spec.calls.importance(sum_buf, count_buf,
status)``) returns ``sum_buf / fp32(count_buf)`` (fp32, one entry per input
column) and writes into ``status[STATUS_IMPORTANCE]`` (an observer's record,
``obskernels.spec.record.STATUS_INIT`` layout) whether the search may use it,
judged in this order (the first that holds is the verdict):
no tokens (IMPORTANCE_NO_DATA), a NaN or +-inf entry (IMPORTANCE_NONFINITE), a
negative entry (IMPORTANCE_NEGATIVE), every entry zero, or none at all
(IMPORTANCE_ZEROS); otherwise IMPORTANCE_OK. Nothing is read to the host: the
observer reads the verdict with its other flags in get_qparams.
"""

from __future__ import annotations

import torch

from obskernels.spec.calls import ImportanceCall
from obskernels.spec.record import (
    IMPORTANCE_NEGATIVE,
    IMPORTANCE_NO_DATA,
    IMPORTANCE_NONFINITE,
    IMPORTANCE_OK,
    IMPORTANCE_ZEROS,
    STATUS_IMPORTANCE,
)

__all__ = ["importance"]


def importance(call: ImportanceCall):
    count = call.count_buf.reshape(()).to(torch.float32)
    imp = call.sum_buf / count
    verdict = torch.full((), IMPORTANCE_OK, dtype=torch.int64, device=imp.device)
    checks = (
        (count == 0, IMPORTANCE_NO_DATA),
        (~torch.isfinite(imp).all(), IMPORTANCE_NONFINITE),
        ((imp < 0).any(), IMPORTANCE_NEGATIVE),
        (~(imp != 0).any(), IMPORTANCE_ZEROS),
    )
    for failed, code in reversed(checks):  # the first failing check wins
        verdict = torch.where(failed, code, verdict)
    call.status[STATUS_IMPORTANCE] = verdict
    return imp
