"""Reference imatrix importance: E[x²] per input column and its verdict.

``importance(sum_buf, count_buf, status)`` returns ``sum_buf / fp32(count_buf)``
(fp32, one entry per input column) and writes into ``status[STATUS_IMPORTANCE]``
(an observer's record, ``validation.STATUS_INIT`` layout) whether the search
may use it, checked in this order (the first that holds is the verdict):
no tokens (IMPORTANCE_NO_DATA), a NaN or +-inf entry (IMPORTANCE_NONFINITE), a
negative entry (IMPORTANCE_NEGATIVE), every entry zero, or none at all
(IMPORTANCE_ZEROS); otherwise IMPORTANCE_OK. Nothing is read to the host: the
observer reads the verdict with its other flags in get_qparams.
"""

from __future__ import annotations

import torch

from obskernels.validation import (
    IMPORTANCE_NEGATIVE,
    IMPORTANCE_NO_DATA,
    IMPORTANCE_NONFINITE,
    IMPORTANCE_OK,
    IMPORTANCE_ZEROS,
    STATUS_IMPORTANCE,
    STATUS_INIT,
)

__all__ = ["importance", "check_importance_args"]


def check_importance_args(sum_buf, count_buf, status) -> None:
    if not isinstance(sum_buf, torch.Tensor) or sum_buf.dtype != torch.float32:
        raise TypeError("sum_buf must be a float32 torch.Tensor")
    if sum_buf.dim() != 1:
        raise ValueError(f"sum_buf must be 1-D (one entry per input column), got shape "
                         f"{tuple(sum_buf.shape)}")
    if not isinstance(count_buf, torch.Tensor) or count_buf.dtype != torch.int64:
        raise TypeError("count_buf must be an int64 torch.Tensor")
    if count_buf.numel() != 1:
        raise ValueError(f"count_buf must hold one element, got shape {tuple(count_buf.shape)}")
    if (not isinstance(status, torch.Tensor) or status.dtype != torch.int64
            or tuple(status.shape) != (len(STATUS_INIT),)):
        raise TypeError(f"status must be an int64 tensor of shape ({len(STATUS_INIT)},)")
    for name, buf in (("count_buf", count_buf), ("status", status)):
        if buf.device != sum_buf.device:
            raise ValueError(f"{name} is on {buf.device} but sum_buf is on {sum_buf.device}")


def importance(sum_buf, count_buf, status):
    check_importance_args(sum_buf, count_buf, status)
    count = count_buf.reshape(()).to(torch.float32)
    imp = sum_buf / count
    verdict = torch.full((), IMPORTANCE_OK, dtype=torch.int64, device=imp.device)
    checks = (
        (count == 0, IMPORTANCE_NO_DATA),
        (~torch.isfinite(imp).all(), IMPORTANCE_NONFINITE),
        ((imp < 0).any(), IMPORTANCE_NEGATIVE),
        (~(imp != 0).any(), IMPORTANCE_ZEROS),
    )
    for failed, code in reversed(checks):  # the first failing check wins
        verdict = torch.where(failed, code, verdict)
    status[STATUS_IMPORTANCE] = verdict
    return imp
