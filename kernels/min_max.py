"""Per-group min/max straight from the raw value (docs/spec.md §2), in one pass.

    min_vals[q] = min over (r, e) of flat[q, r, e],  max_vals likewise

where flat is the flattened value of docs/spec.md §2 (padding zeros of a partial
block included), addressed through ``kernels._layout.group_layout``: no
flattened, padded, permuted or upcast copy is made. A group holding a NaN
gives NaN for both, as torch.amin / amax do. Results are exact (a min is one
of its inputs), so they equal the reference bit for bit.

Launches: one, or two when the rows of a group tile are split across
programs to fill a GPU (a whole-tensor reduction): the first writes one
partial min/max per (split, group), the second reduces the partials.
``prepare`` makes the launch of a call's signature once (obskernels.ops
keeps it for later calls of that signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from obskernels.kernels._layout import (
    check_kernel_dtype,
    check_launchable,
    group_base,
    group_layout,
    layout_rows,
    load_tile,
    on_device,
    store_exact,
    widen,
)
from obskernels.kernels.launch import (
    cdiv,
    choose_blocks,
    choose_split,
    config_token,
    current_config,
    finish_blocks,
    min_max_warps,
    num_warps_for,
)
from obskernels.kernels import stats as ST
from obskernels.kernels.quant import DTYPE_CODE
from obskernels.spec.calls import MinMaxCall

__all__ = ["min_max", "prepare"]


# Sizes that vary per call are not specialised on (one compiled variant per
# block shape and mode, not per tensor size); strides stay specialised so a
# unit stride is known at compile time and loads vectorise.
@triton.jit
def _epilogue(min_ptr, max_ptr, offs, lo_q, hi_q, qq, mask, held_min_ptr, held_max_ptr,
              avg_a, avg_c, MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr):
    """Groups qq's (min, max) combined with the held statistics (MODE, see
    kernels/stats.py) and stored at ``offs``; bf16 statistics through their bits."""
    if MODE != ST.MODE_REPLACE or BITS16:
        lo_q, hi_q = ST.combine(lo_q, hi_q, held_min_ptr, held_max_ptr, qq, mask, avg_a, avg_c,
                                MODE, DTYPE, BITS16)
        ST.store_stat(min_ptr, offs, lo_q, mask, BITS16)
        ST.store_stat(max_ptr, offs, hi_q, mask, BITS16)
    else:
        store_exact(min_ptr + offs, lo_q, mask)
        store_exact(max_ptr + offs, hi_q, mask)


@triton.jit(do_not_specialize=["Q", "NR", "lim_r", "lim_e", "rows_per_split", "observation"])
def _min_max_kernel(
    x_ptr, perm_ptr, min_ptr, max_ptr,
    Q, NR, lim_r, lim_e, geo,
    rows_per_split, held_min_ptr, held_max_ptr, status_ptr, avg_a, avg_c, observation,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    PAD: tl.constexpr, GATHER: tl.constexpr,
    MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr, RECORD: tl.constexpr,
):
    """Program (i, s): groups [i*BLOCK_Q, (i+1)*BLOCK_Q), rows
    [s*rows_per_split, (s+1)*rows_per_split), every element of those rows.

    Writes min/max of that slice to min_ptr[s*Q + q] / max_ptr[s*Q + q]
    (s is 0 without a split, then these are the results), in their dtype.
    Lanes keep running min/max in fp32 (exact for fp16/bf16/fp32 values) and
    reduce once at the end; NaN is tracked as a flag because min/max on a GPU
    drop NaN operands.

    Epilogue (kernels/stats.py), without a split only: MODE combines the
    results with the held statistics before they are stored (BITS16: bf16
    statistics addressed as their bits); RECORD adds this slice's NaN / +-inf
    counts to the observer's non-finite record.
    """
    pid_q = tl.program_id(0)
    pid_s = tl.program_id(1)
    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None, None]
    q_ok = q < Q
    qa, qb, gbase = group_base(q, geo)
    E = geo.E
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, NR)

    lo = tl.full([BLOCK_Q, BLOCK_R, BLOCK_E], float("inf"), tl.float32)
    hi = tl.full([BLOCK_Q, BLOCK_R, BLOCK_E], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_Q, BLOCK_R, BLOCK_E], tl.int1)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)[None, :, None]
        base = gbase + layout_rows(r, geo)
        qr_ok = q_ok & (r < r_hi)
        for e0 in range(0, E, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)[None, None, :]
            in_group = qr_ok & (e < E)
            x = load_tile(x_ptr, perm_ptr, base, qa, qb, r, e, in_group,
                          geo, NR, lim_r, lim_e, PAD, GATHER)
            x = widen(x)
            # Lanes outside the group must not win: +-inf are neutral.
            lo = tl.minimum(lo, tl.where(in_group, x, float("inf")))
            hi = tl.maximum(hi, tl.where(in_group, x, float("-inf")))
            nan = nan | (x != x)

    lo_q = tl.min(tl.min(lo, axis=2), axis=1)
    hi_q = tl.max(tl.max(hi, axis=2), axis=1)
    has_nan = tl.max(tl.max(nan.to(tl.int32), axis=2), axis=1) > 0
    lo_q = tl.where(has_nan, float("nan"), lo_q)
    hi_q = tl.where(has_nan, float("nan"), hi_q)
    qq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out = pid_s.to(tl.int64) * Q + qq
    if RECORD:
        # nothing extra in the hot loop: a NaN sets its lane's flag, +-inf
        # shows as a lane's max / min; counting re-reads this program's slice
        # only when it held a non-finite element (the error path)
        bad_lane = nan | (hi == float("inf")) | (lo == float("-inf"))
        any_bad = tl.max(tl.max(tl.max(bad_lane.to(tl.int32), axis=2), axis=1), axis=0)
        c_nan = any_bad.to(tl.int64) * 0
        c_pos = any_bad.to(tl.int64) * 0
        c_neg = any_bad.to(tl.int64) * 0
        if any_bad > 0:
            # one row and 16 elements at a time: a small tile keeps this
            # rarely taken branch from raising the kernel's register count
            for r0 in range(r_lo, r_hi):
                r = r0 + tl.arange(0, 1)[None, :, None]
                base = gbase + layout_rows(r, geo)
                qr_ok = q_ok & (r < r_hi)
                for e0 in range(0, E, 16):
                    e = e0 + tl.arange(0, 16)[None, None, :]
                    in_group = qr_ok & (e < E)
                    # counts only NaN / +-inf: the plain widening is exact for those
                    x = load_tile(x_ptr, perm_ptr, base, qa, qb, r, e, in_group,
                                  geo, NR, lim_r, lim_e, PAD, GATHER).to(tl.float32)
                    n1, p1, m1 = ST.count_nonfinite(x, in_group)
                    c_nan += n1
                    c_pos += p1
                    c_neg += m1
        ST.record(status_ptr, c_nan, c_pos, c_neg, any_bad > 0, observation)
    _epilogue(min_ptr, max_ptr, out, lo_q, hi_q, qq, qq < Q, held_min_ptr, held_max_ptr,
              avg_a, avg_c, MODE, DTYPE, BITS16)


@triton.jit(do_not_specialize=["Q", "SPLIT"])
def _min_max_finish_kernel(
    pmin_ptr, pmax_ptr, min_ptr, max_ptr, Q, SPLIT,
    held_min_ptr, held_max_ptr, avg_a, avg_c,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr,
    MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr,
):
    """min_vals[q] = min over s of pmin[s, q] (NaN if any partial is NaN); max alike.
    One program reduces BLOCK_Q groups over all SPLIT partials; the MODE
    epilogue as in _min_max_kernel."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
    lo = tl.full([BLOCK_S, BLOCK_Q], float("inf"), tl.float32)
    hi = tl.full([BLOCK_S, BLOCK_Q], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_S, BLOCK_Q], tl.int1)
    for s0 in range(0, SPLIT, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)[:, None]
        ok = (s < SPLIT) & (q < Q)
        offs = s.to(tl.int64) * Q + q
        a = widen(tl.load(pmin_ptr + offs, mask=ok, other=float("inf")))
        b = widen(tl.load(pmax_ptr + offs, mask=ok, other=float("-inf")))
        lo = tl.minimum(lo, a)
        hi = tl.maximum(hi, b)
        nan = nan | (a != a) | (b != b)
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    lo_q = tl.where(has_nan, float("nan"), tl.min(lo, axis=0))
    hi_q = tl.where(has_nan, float("nan"), tl.max(hi, axis=0))
    qq = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    _epilogue(min_ptr, max_ptr, qq, lo_q, hi_q, qq, qq < Q, held_min_ptr, held_max_ptr,
              avg_a, avg_c, MODE, DTYPE, BITS16)


def min_max(call: MinMaxCall):
    """(min_vals, max_vals) per group, shaped like the qparams, in value's dtype.

    The results of ``obskernels.reference.min_max`` for the same call;
    ``held`` / ``averaging_constant`` / ``status`` run the epilogue of
    kernels/stats.py in the same launch; ``out`` receives the results.
    """
    return prepare(call)(call)


def prepare(call: MinMaxCall):
    """The launch of ``call``, prepared from its signature: layout, blocks,
    split and warps are chosen here once; the returned function launches any
    call of the same signature (value, held, status and out of the same
    shapes, strides, dtypes and devices; the same args and options), reading
    only that call's tensors and observation index."""
    value, held = call.flat.value, call.held
    check_kernel_dtype(value)
    check_launchable(value, "min_max")
    layout = group_layout(call.flat)
    mode, avg_a, avg_c = ST.combine_modes(held, call.averaging_constant)
    bits16 = held is not None and value.dtype == torch.bfloat16
    token = config_token()
    config = current_config("min_max")
    Q, NR, E = layout.num_groups, layout.num_rows, layout.elems
    BQ, BR, BE = choose_blocks((Q, NR, E), layout.axis_strides(), config.tile)
    n_q = cdiv(Q, BQ)
    split, rows_per_split = choose_split(NR, BR, BQ * E, n_q, config)
    qshape, dtype, dev = layout.qshape, value.dtype, value.device
    perm, layout_args = layout.perm, (*layout.kernel_args(), rows_per_split)
    record = call.status is not None
    epilogue = dict(MODE=mode, DTYPE=DTYPE_CODE[dtype], BITS16=bits16)
    first = dict(
        BLOCK_Q=BQ, BLOCK_R=BR, BLOCK_E=BE, PAD=layout.pad, GATHER=layout.gather, RECORD=record,
        num_warps=min_max_warps(BQ * BR * BE, record),
        **(epilogue if split == 1 else dict(MODE=ST.MODE_REPLACE.value, DTYPE=epilogue["DTYPE"],
                                            BITS16=False)),
    )
    if split > 1:
        FQ, FS = finish_blocks(Q, split, config)
        finish = dict(BLOCK_Q=FQ, BLOCK_S=FS, **epilogue,
                      num_warps=num_warps_for(FQ * FS))  # 4 warps at 4096 lanes: 155 registers
        finish_grid = (cdiv(Q, FQ),)

    def bits(t):  # bf16 statistics as their bits in the epilogue (kernels/stats.py)
        return t.view(torch.uint16)

    def launch(call: MinMaxCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return min_max(call)
        value, held, status, out = call.flat.value, call.held, call.status, call.out
        if out is None:
            mins = torch.empty(qshape, dtype=dtype, device=dev)
            maxs = torch.empty(qshape, dtype=dtype, device=dev)
        else:
            mins, maxs = out
        if held is None:
            held_min, held_max = mins, maxs  # unread
        else:
            held_min, held_max = held  # read at the groups' flat index
            if not (held_min.is_contiguous() and held_max.is_contiguous()):
                held_min, held_max = held_min.contiguous(), held_max.contiguous()
        omin, omax = mins, maxs
        if bits16:  # (held and out are often the same tensors: viewed once)
            held_min, held_max = bits(held_min), bits(held_max)
            if out is held:
                omin, omax = held_min, held_max
            else:
                omin, omax = bits(mins), bits(maxs)
        if split == 1:
            pmin, pmax = omin, omax
        else:
            pmin = torch.empty((split, Q), dtype=dtype, device=dev)
            pmax = torch.empty((split, Q), dtype=dtype, device=dev)
        with on_device(value):
            _min_max_kernel[(n_q, split)](
                value, perm if perm is not None else value,  # perm: unread unless GATHER
                pmin, pmax, *layout_args, held_min, held_max,
                status if status is not None else pmin, avg_a, avg_c, call.observation, **first,
            )
            if split > 1:
                _min_max_finish_kernel[finish_grid](
                    pmin, pmax, omin, omax, Q, split, held_min, held_max, avg_a, avg_c, **finish,
                )
        return mins, maxs

    return launch
