"""Reference E[x²] accumulation for the imatrix importance."""

from __future__ import annotations

from obskernels.spec.calls import AccumulateCall

__all__ = ["accumulate_sq"]


def accumulate_sq(call: AccumulateCall):
    """sum_buf += sum over tokens of fp32(x)**2; count_buf += tokens. In place."""
    tokens = call.x.reshape(-1, call.x.shape[-1])
    call.sum_buf.add_(tokens.float().pow(2).sum(dim=0))
    call.count_buf.add_(tokens.shape[0])
