"""Reference E[x²] accumulation for the imatrix importance."""

from __future__ import annotations

import torch

from obskernels.validation import VALUE_DTYPES

__all__ = ["accumulate_sq"]


def check_accumulate_args(x, sum_buf, count_buf) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in VALUE_DTYPES:
        raise TypeError(
            f"x dtype must be float32, float16, bfloat16 or float64, got {x.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"x must be (..., channels) with at least one channel, got shape {tuple(x.shape)}"
        )
    if not isinstance(sum_buf, torch.Tensor) or sum_buf.dtype != torch.float32:
        raise TypeError("sum_buf must be a float32 torch.Tensor")
    if sum_buf.shape != (x.shape[-1],):
        raise ValueError(
            f"sum_buf must have shape ({x.shape[-1]},) to match x's last dim, "
            f"got {tuple(sum_buf.shape)}"
        )
    if not isinstance(count_buf, torch.Tensor) or count_buf.dtype != torch.int64:
        raise TypeError("count_buf must be an int64 torch.Tensor")
    if sum_buf.numel() > 1 and sum_buf.stride(0) == 0:
        raise ValueError(
            "sum_buf must not be an expanded (stride 0) view: its channels would "
            "share one memory location"
        )
    if count_buf.numel() != 1:
        raise ValueError(f"count_buf must hold one element, got shape {tuple(count_buf.shape)}")
    for name, buf in (("sum_buf", sum_buf), ("count_buf", count_buf)):
        if buf.device != x.device:
            raise ValueError(f"{name} is on {buf.device} but x is on {x.device}")


def accumulate_sq(x, sum_buf, count_buf):
    check_accumulate_args(x, sum_buf, count_buf)
    tokens = x.reshape(-1, x.shape[-1])
    sum_buf.add_(tokens.float().pow(2).sum(dim=0))
    count_buf.add_(tokens.shape[0])
