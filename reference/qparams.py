"""Reference qparams: compressed-tensors' ``calculate_qparams`` as an observer uses it.

    scale, zero_point = calculate_qparams(min_vals, max_vals, args, global_scale)

with, on request, what an observer adds around that call (docs/spec.md §1, §3):

- ``fused``: TENSOR_GROUP's global scale ``generate_gparam(-a, a)``, where a is
  the largest ``max(max_vals, -min_vals)`` over every (min_vals, max_vals) pair
  given (an observer and those fused with it); NaN propagates.
- ``widen``: a group whose statistics are finite but whose scale is not (the
  arithmetic in the statistics' dtype overflowed: asymmetric max - min near the
  top of bf16 / fp16, a 1-bit symmetric range, an MX exponent that rounds up
  past the dtype) gets the qparams of the same call on float64 statistics,
  cast back to the dtypes compressed-tensors returned. Every other group keeps
  compressed-tensors' answer bit for bit.
- ``carry``: an observer's int64 non-finite record (``spec.record.STATUS_INIT``
  layout), copied to the front of the returned status and reset to its initial
  values.

Returns (scale, zero_point, global_scale, status): ``status`` is an int64
tensor, the carried record followed by flags that are non-zero where a scale is
not finite -- everything a caller needs to decide on errors, in one read.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization.utils import calculate_qparams as _ct_calculate_qparams
from compressed_tensors.quantization.utils import generate_gparam

from obskernels.spec.calls import QParamsCall
from obskernels.spec.record import STATUS_INIT

__all__ = ["calculate_qparams", "fused_absmax"]


def fused_absmax(fused) -> torch.Tensor:
    """max over the pairs of max(max_vals, -min_vals), NaN propagating (0-d)."""
    absmax = None
    for mn, mx in fused:
        a = torch.maximum(mx, -mn).max()
        absmax = a if absmax is None else torch.maximum(absmax, a)
    return absmax


def calculate_qparams(call: QParamsCall):
    min_vals, max_vals, args, global_scale, fused, widen, carry = (
        call.min_vals, call.max_vals, call.args, call.global_scale, call.fused, call.widen,
        call.carry)
    if fused is not None:
        absmax = fused_absmax(fused)
        global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, zero_point = _ct_calculate_qparams(
        min_vals=min_vals, max_vals=max_vals, quantization_args=args, global_scale=global_scale
    )
    if widen and min_vals.dtype != torch.float64 and scale.device.type != "meta":
        wide_scale, wide_zp = _ct_calculate_qparams(
            min_vals=min_vals.double(), max_vals=max_vals.double(), quantization_args=args,
            global_scale=None if global_scale is None else global_scale.double(),
        )
        redo = (
            torch.isfinite(min_vals) & torch.isfinite(max_vals)
        ).reshape(scale.shape) & ~torch.isfinite(scale)
        # select in fp32 (exact for every scale / zero-point dtype, fp8 included,
        # which torch.where does not take): each side is cast once into its dtype
        scale = torch.where(redo, wide_scale.to(scale.dtype).float(), scale.float()).to(scale.dtype)
        zero_point = torch.where(
            redo, wide_zp.to(zero_point.dtype).float(), zero_point.float()
        ).to(zero_point.dtype)
    flag = (~torch.isfinite(scale)).any().reshape(1).to(torch.int64)
    if carry is None:
        head = torch.tensor(STATUS_INIT, dtype=torch.int64, device=flag.device)
    else:
        head = carry.clone()
        carry.copy_(torch.tensor(STATUS_INIT, dtype=torch.int64, device=carry.device))
    return scale, zero_point, global_scale, torch.cat((head, flag))
