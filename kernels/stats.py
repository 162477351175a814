"""Statistics epilogues: combine new per-group statistics with those an
observer holds, and record non-finite observations, inside the kernels.

    running min / max (MODE_RUNNING):  min(new, held), max(new, held)   (NaN propagates)
    moving average (MODE_AVERAGE):     rd(rd(held * a) + rd(new * c)),  a = fp32(1 - c)

in the statistics' dtype, exactly as torch computes ``held * (1.0 - c) + new * c``
on the CPU (each product and the sum rounded once into the dtype; a Python
scalar enters as fp32). The non-finite record is the int64 array of
``spec.record.STATUS_INIT``: NaN, +inf and -inf counts (atomic adds: exact and
order-free), a flag for non-finite statistics and the first such observation
(atomic max / min). The caller reads it once, at get_qparams.

``combine_statistics`` (the operation) applies the epilogue to statistics that
another kernel produced (the MSE search): one launch; it re-reads the value
only in groups whose new statistics are not finite, to count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from obskernels.kernels import quant
from obskernels.kernels._layout import (
    allocator,
    check_kernel_dtype,
    group_base,
    group_layout,
    layout_rows,
    load_tile,
    launch_context,
    widen,
)
from obskernels.kernels._replay import Replay
from obskernels.kernels.launch import FUSED, UNFUSED, cdiv, combine_block
from obskernels.spec.calls import CombineCall
from obskernels.spec.record import STATUS_BAD_STATS, STATUS_FIRST_BAD, STATUS_NAN

__all__ = ["combine_statistics", "combine_modes", "prepare"]

MODE_REPLACE: tl.constexpr = tl.constexpr(0)
MODE_RUNNING: tl.constexpr = tl.constexpr(1)
MODE_AVERAGE: tl.constexpr = tl.constexpr(2)

_S_NAN: tl.constexpr = tl.constexpr(STATUS_NAN)
_S_BAD: tl.constexpr = tl.constexpr(STATUS_BAD_STATS)
_S_FIRST: tl.constexpr = tl.constexpr(STATUS_FIRST_BAD)


def mode_options(mode) -> dict:
    """The launch options a combine in ``mode`` needs: a moving average's
    products and sum rounded one at a time, as torch's three operations are
    (on a GPU, Triton would contract ``held * a + new * c`` into one FMA);
    min / max keep Triton's default (``launch.FUSED``: nothing to contract)."""
    return dict(UNFUSED if mode == MODE_AVERAGE.value else FUSED)


def combine_modes(held, averaging_constant):
    """(MODE, a, c) launch arguments: what to do with ``held`` statistics."""
    if held is None:
        return MODE_REPLACE.value, 0.0, 0.0
    if averaging_constant is None:
        return MODE_RUNNING.value, 0.0, 0.0
    # the Python floats torch turns into fp32 scalars
    return (MODE_AVERAGE.value, quant.round_host(1.0 - averaging_constant, torch.float32),
            quant.round_host(float(averaging_constant), torch.float32))


@triton.jit
def as_bits(ptr, BITS: tl.constexpr):
    """``ptr`` as a pointer to ``BITS`` (an unsigned integer type of its
    element's width): a bf16 or fp8 tensor's elements are stored and loaded
    as their bits. A pointer to ``BITS`` already is returned as it is."""
    return ptr.to(tl.pointer_type(BITS), bitcast=True)


@triton.jit
def load_stat(ptr, offs, mask, BITS16: tl.constexpr):
    """Statistics as fp32; BITS16: bf16 statistics read as their uint16 bits
    (the interpreter's bf16 load flushes subnormals; bits are exact
    everywhere). The pointer is cast here, so the host passes the bf16
    tensor itself (a view per tensor and call less on the host)."""
    if BITS16:
        b = tl.load(as_bits(ptr, tl.uint16) + offs, mask=mask, other=0).to(tl.uint32)
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_stat(ptr, offs, v, mask, BITS16: tl.constexpr):
    """Store fp32 ``v`` (exact in the statistics' dtype); BITS16 as load_stat."""
    if BITS16:
        tl.store(as_bits(ptr, tl.uint16) + offs, (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16),
                 mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine(new_lo, new_hi, held_min_ptr, held_max_ptr, offs, mask, a, c,
            MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr):
    """(min, max) to hold after this observation (see the module docstring)."""
    if MODE == MODE_REPLACE:
        return new_lo, new_hi
    old_lo = load_stat(held_min_ptr, offs, mask, BITS16)
    old_hi = load_stat(held_max_ptr, offs, mask, BITS16)
    if MODE == MODE_RUNNING:
        return quant.nan_min(new_lo, old_lo), quant.nan_max(new_hi, old_hi)
    lo = quant.rd(quant.rd(old_lo * a, DTYPE) + quant.rd(new_lo * c, DTYPE), DTYPE)
    hi = quant.rd(quant.rd(old_hi * a, DTYPE) + quant.rd(new_hi * c, DTYPE), DTYPE)
    return lo, hi


@triton.jit
def count_nonfinite(x, valid):
    """(NaN, +inf, -inf) counts (int64 scalars) of x where valid."""
    # int32 within a tile (fewer registers), int64 across tiles
    nan = tl.sum((valid & (x != x)).to(tl.int32)).to(tl.int64)
    pos = tl.sum((valid & (x == float("inf"))).to(tl.int32)).to(tl.int64)
    neg = tl.sum((valid & (x == float("-inf"))).to(tl.int32)).to(tl.int64)
    return nan, pos, neg


@triton.jit
def record(status_ptr, nan, pos, neg, bad, observation):
    """Add the counts to the record; ``bad`` (a scalar bool): this
    observation's statistics are not finite (flag, first observation)."""
    one = tl.arange(0, 1)
    z = one.to(tl.int64) * 0
    tl.atomic_add(status_ptr + _S_NAN + one, z + nan, mask=(z + nan) > 0)
    tl.atomic_add(status_ptr + _S_NAN + 1 + one, z + pos, mask=(z + pos) > 0)
    tl.atomic_add(status_ptr + _S_NAN + 2 + one, z + neg, mask=(z + neg) > 0)
    b = (z + bad.to(tl.int64)) > 0
    tl.atomic_max(status_ptr + _S_BAD + one, z + 1, mask=b)
    tl.atomic_min(status_ptr + _S_FIRST + one, z + observation, mask=b)


@triton.jit(do_not_specialize=["Q", "NR", "lim_r", "lim_e", "observation"])
def _combine_kernel(
    x_ptr, new_min_ptr, new_max_ptr, held_min_ptr, held_max_ptr, out_min_ptr, out_max_ptr,
    status_ptr, a, c, observation,
    Q, NR, lim_r, lim_e, geo,
    MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr, RECORD: tl.constexpr,
    PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """One program: BLOCK_Q groups. Combine, store; with RECORD, groups whose
    new statistics are not finite are re-read from the value to count (the
    loop runs only when the block holds one)."""
    pid = tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = q < Q
    lo = load_stat(new_min_ptr, q, qm, BITS16)
    hi = load_stat(new_max_ptr, q, qm, BITS16)
    olo, ohi = combine(lo, hi, held_min_ptr, held_max_ptr, q, qm, a, c, MODE, DTYPE, BITS16)
    store_stat(out_min_ptr, q, olo, qm, BITS16)
    store_stat(out_max_ptr, q, ohi, qm, BITS16)
    if RECORD:
        bad = qm & ((lo != lo) | (hi != hi) | (tl.abs(lo) == float("inf"))
                    | (tl.abs(hi) == float("inf")))
        n_bad = tl.sum(bad.to(tl.int32))
        nan = n_bad.to(tl.int64) * 0
        pos = n_bad.to(tl.int64) * 0
        neg = n_bad.to(tl.int64) * 0
        if n_bad > 0:
            # the error path: 16 groups x 16 elements at a time (a small tile
            # keeps this branch from raising the kernel's register count)
            for q0 in range(0, BLOCK_Q, 16):
                qs = pid.to(tl.int64) * BLOCK_Q + q0 + tl.arange(0, 16)
                qsm = qs < Q
                slo = load_stat(new_min_ptr, qs, qsm, BITS16)
                shi = load_stat(new_max_ptr, qs, qsm, BITS16)
                sbad = qsm & ((slo != slo) | (shi != shi) | (tl.abs(slo) == float("inf"))
                              | (tl.abs(shi) == float("inf")))
                qq = qs[:, None, None].to(tl.int32)
                qa, qb, gbase = group_base(qq, geo)
                for r0 in range(0, NR):
                    r = r0 + tl.arange(0, 1)[None, :, None]
                    base = gbase + layout_rows(r, geo)
                    for e0 in range(0, geo.E, 16):
                        e = e0 + tl.arange(0, 16)[None, None, :]
                        inside = sbad[:, None, None] & (e < geo.E)
                        x = widen(load_tile(x_ptr, x_ptr, base, qa, qb, r, e, inside,
                                            geo, NR, lim_r, lim_e, PAD, False))
                        n1, p1, m1 = count_nonfinite(x, inside)
                        nan += n1
                        pos += p1
                        neg += m1
        record(status_ptr, nan, pos, neg, n_bad > 0, observation)


def combine_statistics(call: CombineCall):
    """Triton twin of ``reference.stats.combine_statistics``: (min_vals, max_vals)."""
    return prepare(call)(call)


def prepare(call: CombineCall):
    """The launch of ``call``'s signature (see kernels/min_max.py ``prepare``)."""
    value, new_min, held = call.flat.value, call.new_min, call.held
    check_kernel_dtype(value)
    check_kernel_dtype(new_min, "new_min")
    layout = group_layout(call.flat, storage_order=False)
    shape, dtype, dev = new_min.shape, new_min.dtype, new_min.device
    mode, a, c = combine_modes(held, call.averaging_constant)
    bits16 = dtype == torch.bfloat16
    Q = layout.num_groups
    block_q = combine_block(Q)
    grid = (cdiv(Q, block_q),)
    layout_args = layout.kernel_args()
    switches = dict(MODE=mode, DTYPE=quant.DTYPE_CODE[dtype], BITS16=bits16,
                    RECORD=call.status is not None, PAD=layout.pad, BLOCK_Q=block_q,
                    **mode_options(mode))

    # read at the groups' flat index: contiguous, whatever the shape (the
    # strides are the signature's); bf16 as its bits by the kernel itself
    inputs = (call.new_min, call.new_max) + (call.held or ()) + (call.out or ())
    contiguous = all(t.is_contiguous() for t in inputs)
    new_stats = allocator(shape, dtype, dev)
    context = launch_context(dev)
    kernel = Replay(globals(), "_combine_kernel", grid, **switches)

    def v(t):
        return t if contiguous else t.contiguous()

    def launch(call: CombineCall):
        value, new_min, new_max, held, status, out = (
            call.flat.value, call.new_min, call.new_max, call.held, call.status, call.out)
        if out is None:  # contiguous: the kernel writes them at the groups' flat index
            out_min, out_max = new_stats(), new_stats()
        else:
            out_min, out_max = out
        if Q == 0:
            return out_min, out_max
        # each tensor made ready once (held or out may be the new statistics themselves)
        nmin, nmax = v(new_min), v(new_max)
        hmin, hmax = (nmin, nmax) if held is None else (v(held[0]), v(held[1]))
        if out_min is new_min and out_max is new_max:
            omin, omax = nmin, nmax
        elif held is not None and out_min is held[0] and out_max is held[1]:
            omin, omax = hmin, hmax
        else:
            omin, omax = v(out_min), v(out_max)
        with context():
            kernel(
                value, nmin, nmax, hmin, hmax, omin, omax,
                status if status is not None else out_min, a, c, call.observation, *layout_args,
            )
        return out_min, out_max

    return launch
