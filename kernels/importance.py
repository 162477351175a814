"""imatrix importance: E[x²] per input column and its verdict, one launch.

    imp[h] = sum_buf[h] / fp32(count)          (fp32, correctly rounded: div_rn)
    status[STATUS_IMPORTANCE] = verdict        (spec.record.IMPORTANCE_* codes)

One program walks the columns in blocks: it writes imp and keeps, per lane,
whether an entry was NaN / +-inf, negative, or non-zero; the verdict follows
the reference's order (no tokens, non-finite, negative, all zeros). No host
read: the search takes the verdict from device memory (``mse_search`` with
``importance_status``) and the observer reads it with its other flags in
get_qparams. The importance of one Linear is a few thousand floats, so one
program is enough.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from obskernels.kernels._layout import allocator, launch_context
from obskernels.kernels._replay import Replay
from obskernels.kernels.launch import FUSED, IMPORTANCE_BLOCK
from obskernels.spec.calls import ImportanceCall
from obskernels.spec.record import (
    IMPORTANCE_NEGATIVE,
    IMPORTANCE_NO_DATA,
    IMPORTANCE_NONFINITE,
    IMPORTANCE_OK,
    IMPORTANCE_ZEROS,
    STATUS_IMPORTANCE,
)

__all__ = ["importance", "prepare"]

_SLOT: tl.constexpr = tl.constexpr(STATUS_IMPORTANCE)
_OK: tl.constexpr = tl.constexpr(IMPORTANCE_OK)
_NO_DATA: tl.constexpr = tl.constexpr(IMPORTANCE_NO_DATA)
_NONFINITE: tl.constexpr = tl.constexpr(IMPORTANCE_NONFINITE)
_NEGATIVE: tl.constexpr = tl.constexpr(IMPORTANCE_NEGATIVE)
_ZEROS: tl.constexpr = tl.constexpr(IMPORTANCE_ZEROS)


@triton.jit(do_not_specialize=["H", "sh"])
def _importance_kernel(sum_ptr, count_ptr, imp_ptr, status_ptr, H, sh, BLOCK: tl.constexpr):
    """One program: imp[h] = div_rn(sum[h], fp32(count)) for every column h,
    and the verdict -> status[_SLOT]."""
    one = tl.arange(0, 1)
    count = tl.load(count_ptr + one).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], tl.int32)
    neg = tl.zeros([BLOCK], tl.int32)
    nonzero = tl.zeros([BLOCK], tl.int32)
    for h0 in range(0, H, BLOCK):
        h = h0 + offs
        m = h < H
        s = tl.load(sum_ptr + h.to(tl.int64) * sh, mask=m, other=0.0)
        imp = tl.math.div_rn(s, count + tl.zeros_like(s))
        tl.store(imp_ptr + h, imp, mask=m)
        bad = bad | (m & ((imp != imp) | (tl.abs(imp) == float("inf")))).to(tl.int32)
        neg = neg | (m & (imp < 0)).to(tl.int32)
        nonzero = nonzero | (m & (imp != 0)).to(tl.int32)
    verdict = tl.where(tl.max(nonzero, axis=0) == 0, _ZEROS, _OK)
    verdict = tl.where(tl.max(neg, axis=0) != 0, _NEGATIVE, verdict)
    verdict = tl.where(tl.max(bad, axis=0) != 0, _NONFINITE, verdict)
    verdict = tl.where(count == 0, _NO_DATA, verdict)
    tl.store(status_ptr + _SLOT + one, verdict.to(tl.int64))


def importance(call: ImportanceCall):
    """Triton twin of ``reference.importance``: (imp, with the verdict written
    into ``status``)."""
    return prepare(call)(call)


def prepare(call: ImportanceCall):
    """The launch of ``call``'s signature (see kernels/min_max.py ``prepare``)."""
    shape, dev = call.sum_buf.shape, call.sum_buf.device
    H, stride = call.sum_buf.numel(), call.sum_buf.stride(0)

    new_importance = allocator(shape, torch.float32, dev)
    context = launch_context(dev)
    kernel = Replay(globals(), "_importance_kernel", (1,), BLOCK=IMPORTANCE_BLOCK, **FUSED)

    def launch(call: ImportanceCall):
        sum_buf = call.sum_buf
        imp = new_importance()
        with context():
            kernel(sum_buf, call.count_buf, imp, call.status, H, stride)
        return imp

    return launch
