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

from obskernels.kernels._cache_keys import settle
from obskernels.kernels.launch import FUSED, current_config, flatten_tile
from obskernels.kernels._layout import (
    check_kernel_dtype,
    check_launchable,
    group_layout,
    load_tile_lanes,
    on_device,
    tile_blocks,
    tile_groups,
)
from obskernels.spec.checks import ATTENTION
from obskernels.spec.layout import Flattening

__all__ = ["flatten_for_calibration"]


@triton.jit
def _copy_step(x_ptr, perm_ptr, out_ptr, qa, qb, r0, c, r_hi, geo, NR, lim_r, lim_e,
               BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, ROW_LEVELS: tl.constexpr,
               SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr, PAD: tl.constexpr,
               GATHER: tl.constexpr):
    """Copy rows [r0, r0 + BLOCK_R) x element chunk c of groups (qa, qb)."""
    x, r, e = load_tile_lanes(x_ptr, perm_ptr, qa, qb, r0, c, r_hi, geo, lim_r, lim_e,
                              BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
    q = qa * geo.QB + qb
    tl.store(out_ptr + ((q.to(tl.int64) * NR + r) * geo.E + e), x)


@triton.jit(do_not_specialize=["Q", "NR", "rows_per_program"])
def _flatten_kernel(
    x_ptr, perm_ptr, out_ptr,
    Q, NR, lim_r, lim_e, geo, rows_per_program,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    ROW_LEVELS: tl.constexpr, SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr,
    GROUP_TAIL: tl.constexpr, GROUP_LOOP: tl.constexpr, PAD: tl.constexpr, GATHER: tl.constexpr,
):
    """out[(q*NR + r)*E + e] = flat[q, r, e] (padding zeros included).

    Program (i, s) copies the BLOCK_A x BLOCK_B groups of block i
    (``tile_blocks``) x rows [s*rows_per_program, (s+1)*rows_per_program),
    BLOCK_R rows x BLOCK_E elements per step (GROUP_LOOP, a block is one
    step: a program takes several blocks of a block column). No mask but the padding zeros':
    lanes past the end repeat an element of their group (``tile_lanes``) and
    store it again where it belongs, the same bits to the same place.
    """
    r_lo = tl.program_id(1) * rows_per_program
    r_hi = tl.minimum(r_lo + rows_per_program, NR)
    pa, pb, step, n_a, QA = tile_blocks(Q, geo, BLOCK_A, BLOCK_B)
    if GROUP_LOOP:  # a block is one step: a program copies several of a block column
        for blk in range(pa, n_a, step):
            qa, qb, _ = tile_groups(blk, pb, QA, geo, BLOCK_A, BLOCK_B, GROUP_TAIL)
            _copy_step(x_ptr, perm_ptr, out_ptr, qa, qb, r_lo, 0, r_hi, geo, NR, lim_r, lim_e,
                       BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
    else:
        qa, qb, _ = tile_groups(pa, pb, QA, geo, BLOCK_A, BLOCK_B, GROUP_TAIL)
        n_e = tl.cdiv(geo.E, BLOCK_E)
        r0 = r_lo
        c = 0
        for _ in tl.range(0, tl.cdiv(r_hi - r_lo, BLOCK_R) * n_e, loop_unroll_factor=1):
            _copy_step(x_ptr, perm_ptr, out_ptr, qa, qb, r0, c, r_hi, geo, NR, lim_r, lim_e,
                       BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
            c += 1
            wrap = c == n_e
            c = tl.where(wrap, 0, c)
            r0 = tl.where(wrap, r0 + BLOCK_R, r0)


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
    tile = flatten_tile(layout, value.element_size(), current_config("flatten"))
    perm = layout.perm if layout.gather else value  # unread unless GATHER
    settle(_flatten_kernel)  # its cache key as every process makes it (_cache_keys.py)
    with on_device(value):
        _flatten_kernel[(tile.programs, tile.split)](
            value, perm, out, *layout.kernel_args(), tile.rows_per_split,
            **tile.blocks(), PAD=layout.pad, GATHER=layout.gather, **tile.launch(), **FUSED,
        )
    return out
