"""Reference E[x²] accumulation for the imatrix importance."""

from __future__ import annotations

from obskernels.spec.checks import check_accumulate_args

__all__ = ["accumulate_sq"]


def accumulate_sq(x, sum_buf, count_buf):
    check_accumulate_args(x, sum_buf, count_buf)
    tokens = x.reshape(-1, x.shape[-1])
    sum_buf.add_(tokens.float().pow(2).sum(dim=0))
    count_buf.add_(tokens.shape[0])
