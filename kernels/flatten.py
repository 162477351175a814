"""Flattening for calibration (docs/spec.md §2), with the copies written by a kernel.

Two layouts are not views of the value and must be materialised:
- BLOCK [bh, bw]: out[0, i, j, a*bw + b] = w[i*bh + a, j*bw + b], or 0 where
  that index falls past the weight (zero padding of a partial block);
- GROUP with g_idx: out[0, i, k, e] = w[i, perm[k*g + e]], perm the stable
  argsort of g_idx.
Both are written in one pass by ``_flatten_kernel``. Every other strategy is a
view of the value (a reshape, attention's after moving heads behind tokens),
returned as such.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compressed_tensors.quantization import QuantizationStrategy

from obskernels.kernels.launch import choose_blocks, current_config, num_warps_for
from obskernels.kernels._layout import (
    check_kernel_dtype,
    check_launchable,
    group_base,
    group_layout,
    layout_rows,
    load_tile,
    on_device,
)
from obskernels.spec.checks import ATTENTION
from obskernels.spec.layout import Flattening

__all__ = ["flatten_for_calibration"]


@triton.jit(do_not_specialize=["Q", "NR", "lim_r", "lim_e"])
def _flatten_kernel(
    x_ptr, perm_ptr, out_ptr,
    Q, NR, lim_r, lim_e, geo,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    PAD: tl.constexpr, GATHER: tl.constexpr,
):
    """out[(q*NR + r)*E + e] = flat[q, r, e] (padding zeros included).

    Program (i, j) copies groups [i*BLOCK_Q, (i+1)*BLOCK_Q) x rows
    [j*BLOCK_R, (j+1)*BLOCK_R), looping over the elements in BLOCK_E chunks.
    """
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None, None]
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :, None]
    qa, qb, gbase = group_base(q, geo)
    base = gbase + layout_rows(r, geo)
    E = geo.E
    qr_ok = (q < Q) & (r < NR)
    out_base = (q.to(tl.int64) * NR + r) * E
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)[None, None, :]
        in_group = qr_ok & (e < E)
        x = load_tile(x_ptr, perm_ptr, base, qa, qb, r, e, in_group,
                      geo, NR, lim_r, lim_e, PAD, GATHER)
        tl.store(out_ptr + out_base + e, x, mask=in_group)


def flatten_for_calibration(flat: Flattening):
    """The result of the reference's flatten_for_calibration for the same call.

    BLOCK and g_idx layouts come back as new contiguous tensors written by the
    kernel; every other strategy returns the reference's view.
    """
    value = flat.value
    check_kernel_dtype(value)
    check_launchable(value, "flatten_for_calibration")
    layout = group_layout(flat)
    if not (flat.strategy == QuantizationStrategy.BLOCK or layout.gather):
        # a view: the flattened order is the value's logical order (attention's
        # with heads behind tokens); TOKEN keeps the value as it is
        if flat.strategy == QuantizationStrategy.TOKEN:
            return value
        src = value.transpose(1, 2) if flat.base_name in ATTENTION else value
        return src.reshape(layout.flat_shape)
    out = torch.empty(layout.flat_shape, dtype=value.dtype, device=value.device)
    Q, NR, E = layout.num_groups, layout.num_rows, layout.elems
    BQ, BR, BE = choose_blocks((Q, NR, E), layout.axis_strides(), current_config("flatten").tile)
    perm = layout.perm if layout.gather else value  # unread unless GATHER
    with on_device(value):
        _flatten_kernel[(triton.cdiv(Q, BQ), triton.cdiv(NR, BR))](
            value, perm, out, *layout.kernel_args(),
            BLOCK_Q=BQ, BLOCK_R=BR, BLOCK_E=BE, PAD=layout.pad, GATHER=layout.gather,
            num_warps=num_warps_for(BQ * BR * BE),
        )
    return out
