"""Per-group min/max straight from the raw value (docs/spec.md §2), in one pass.

    min_vals[q] = min over (r, e) of flat[q, r, e],  max_vals likewise

where flat is the flattened value of docs/spec.md §2 (padding zeros of a partial
block included), addressed through ``kernels._layout.group_layout``: no
flattened, padded, permuted or upcast copy is made. A group holding a NaN
gives NaN for both, as torch.amin / amax do. Results are exact (a min is one
of its inputs), so they equal the reference bit for bit.

Launches: one. Where the rows of a group tile are split across programs to
fill a GPU (a whole-tensor reduction), each program writes one partial
min/max per group of its block and the last program of the block to arrive
(a ticket: an atomic counter, zero at launch and put back to zero) reduces
the block's partials (``_finish_tile``), runs the epilogue and, for
``min_max_qparams``, computes the qparams. The tickets and the partials are
the caller's where it keeps them for a call it repeats in place
(``ops.Repeat``: an observer's forward), else fresh copies of a zeroed
template (obskernels.spec.record's pool on CUDA: no launch per call) and
new allocations. ``min_max_qparams`` makes one launch, split or not: its
qparams come from the streaming kernel's epilogue, or its finishing
program's (TENSOR_GROUP: the launch giving the statistics writes one
partial absolute maximum per program, with a split per block by its last
program, and the qparams kernel reduces them into the global scale).
``prepare`` makes the launch of a call's signature once (obskernels.ops
keeps it for later calls of that signature).

Streaming at memory speed (what an instruction costs here is per element):
a program owns a block of groups (``_layout.tile_blocks``) and walks its rows
and element chunks with running min/max lanes, so the reduction across lanes
runs once per program, not once per tile. No load is masked except a padding
zero: lanes past the last group, row or element repeat one of their group's
elements (a repeat cannot change a min or a max) - the last element chunk of
a group is shifted back to end at the group's end, and a chunk wider than
the group repeats its last element. The running lanes propagate NaN
(``propagate_nan=ALL``: one instruction on the GPU, numpy's minimum in the
interpreter); the cross-lane reductions ignore NaN on both, so one flag per
group, from the lanes, puts it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from obskernels.kernels._layout import (
    allocator,
    check_kernel_dtype,
    check_launchable,
    gpu_arith,
    group_layout,
    load_tile_lanes,
    launch_context,
    pad_inside,
    store_exact,
    tile_blocks,
    tile_groups,
    tile_offsets,
    widen,
)
from obskernels.kernels.launch import (
    UNFUSED,
    config_token,
    current_config,
    min_max_tile,
)
from obskernels.kernels import stats as ST
from obskernels.kernels._replay import Replay
from obskernels.kernels.qparams import (
    epilogue_plan,
    epilogue_qparams,
    prepare_from_parts,
    prepare_with_qparams,
    flag_scale,
)
from obskernels.kernels.quant import DTYPE_CODE
from obskernels.spec.calls import MinMaxCall, MinMaxQParamsCall
from obskernels.spec.layout import Strategy
from obskernels.spec.record import STATUS_INIT, fresh_copy, zero_tickets

__all__ = ["min_max", "prepare", "min_max_qparams", "prepare_qparams"]

N_STATUS = len(STATUS_INIT)


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


@triton.jit
def _tile(x_ptr, perm_ptr, qa, qb, r0, c, r_hi, geo, lim_r, lim_e,
          BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, ROW_LEVELS: tl.constexpr,
          SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr, PAD: tl.constexpr, GATHER: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) x element chunk c of the groups (qa, qb), as
    fp32, every lane an element of its own group (``tile_lanes``)."""
    x, _r, _e = load_tile_lanes(x_ptr, perm_ptr, qa, qb, r0, c, r_hi, geo, lim_r, lim_e,
                                BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
    return widen(x)


@triton.jit
def _count_slice(x_ptr, perm_ptr, qa, qb, q_ok, r_lo, r_hi, geo, lim_r, lim_e,
                 BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, ROW_LEVELS: tl.constexpr,
                 PAD: tl.constexpr, GATHER: tl.constexpr):
    """(NaN, +inf, -inf) counts of the program's slice (the rarely taken error
    path), each element once: the steps of the tile, masked instead of
    repeating lanes."""
    c_nan = r_lo.to(tl.int64) * 0
    c_pos = c_nan
    c_neg = c_nan
    E = geo.E
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)[None, None, :, None]
        for e0 in range(0, E, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)[None, None, None, :]
            ok = q_ok & (r < r_hi) & (e < E)
            inside = ok
            if PAD:
                inside = ok & pad_inside(qa, qb, r, e, geo, lim_r, lim_e)
            offs = tile_offsets(perm_ptr, qa, qb, r, tl.minimum(e, E - 1), geo, ROW_LEVELS, GATHER)
            # counts only NaN / +-inf: the plain widening is exact for those
            x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            n1, p1, m1 = ST.count_nonfinite(x, ok)
            c_nan += n1
            c_pos += p1
            c_neg += m1
    return c_nan, c_pos, c_neg


@triton.jit
def _reduce_store(lo, hi, qa, qb, q_ok, out_base, geo, min_ptr, max_ptr, held_min_ptr,
                  held_max_ptr, avg_a, avg_c, qp, MODE: tl.constexpr, DTYPE: tl.constexpr,
                  BITS16: tl.constexpr, RECORD: tl.constexpr, QP: tl.constexpr,
                  ABSMAX: tl.constexpr):
    """Reduce the running lanes to each group's (min, max) and store them
    through the epilogue at out_base + q; with QP (a first observation,
    nothing held), also its scale and zero point (``epilogue_qparams``). Returns,
    per group, (RECORD; else 0) the largest magnitude of a real group's
    result, NaN or +inf where it is not finite (a NaN, +inf or -inf was read;
    ``_nonfinite``), 0 for a lane past the last group: two NaN-propagating
    maxima, which a loop over blocks of groups folds with one more, (QP; else
    0) 1 where its scale is not finite, and (ABSMAX; else 0) max(max, -min)
    of a real group (NaN for a group holding one, -inf for a lane past the
    last group)."""
    # [BLOCK_A, BLOCK_B, 1, 1]: a NaN lane sets the flag (min and max hold it alike)
    has_nan = tl.max(tl.max((lo != lo).to(tl.int32), axis=3, keep_dims=True),
                     axis=2, keep_dims=True) > 0
    lo_q = tl.min(tl.min(lo, axis=3, keep_dims=True), axis=2, keep_dims=True)
    hi_q = tl.max(tl.max(hi, axis=3, keep_dims=True), axis=2, keep_dims=True)
    lo_q = tl.where(has_nan, float("nan"), lo_q)
    hi_q = tl.where(has_nan, float("nan"), hi_q)
    qq = qa * geo.QB + qb
    _epilogue(min_ptr, max_ptr, out_base + qq, lo_q, hi_q, qq, q_ok, held_min_ptr, held_max_ptr,
              avg_a, avg_c, MODE, DTYPE, BITS16)
    bad_scale = 0
    if QP is not None:
        bad_scale = epilogue_qparams(lo_q, hi_q, qq, q_ok, qp, DTYPE, QP)
    absmax = 0.0
    if ABSMAX:
        absmax = _group_absmax(lo_q, hi_q, has_nan, q_ok)
    if RECORD:
        # a real group's largest magnitude: NaN or +inf where it read a NaN,
        # +inf or -inf (``_nonfinite``), 0 for a lane that is no group
        bad = tl.where(q_ok, tl.maximum(tl.abs(lo_q), tl.abs(hi_q), propagate_nan=tl.PropagateNan.ALL),
                       0.0)
        return bad, bad_scale, absmax
    else:
        return 0, bad_scale, absmax


@triton.jit
def _group_absmax(lo_q, hi_q, has_nan, ok):
    """Each group's max(max, -min) (a global scale's absolute maximum): NaN
    for a group holding one, -inf for a lane that is no group."""
    return tl.where(ok, tl.where(has_nan, float("nan"), tl.maximum(hi_q, -lo_q)), float("-inf"))


@triton.jit
def _max4(x):
    """The max of a [BLOCK_A, BLOCK_B, 1, 1] tensor (a scalar; NaN ignored)."""
    return tl.max(tl.max(tl.max(tl.max(x, axis=3), axis=2), axis=1), axis=0)


@triton.jit
def _nonfinite(worst):
    """Whether any lane of a [BLOCK_A, BLOCK_B, 1, 1] tensor of magnitudes
    (``_reduce_store``'s record flag) is NaN or +inf (a scalar)."""
    return _any(((worst != worst) | (worst == float("inf"))).to(tl.int32))


@triton.jit
def _any(bad):
    """Whether any lane of a [BLOCK_A, BLOCK_B, 1, 1] flag tensor is set (a scalar)."""
    return _max4(bad) > 0


@triton.jit
def _store_absmax(absmax_ptr, pid, absmax):
    """absmax_ptr[pid] = the max of the program's [BLOCK_A, BLOCK_B, 1, 1]
    absolute maxima, NaN if one is NaN (the reduction across lanes ignores
    NaN: a flag puts it back)."""
    has_nan = _any((absmax != absmax).to(tl.int32))
    a = tl.where(has_nan, float("nan"), _max4(tl.where(absmax == absmax, absmax, float("-inf"))))
    one = tl.arange(0, 1)
    tl.store(absmax_ptr + pid + one, a + one * 0.0)


@triton.jit
def _finish_tile(pmin_ptr, pmax_ptr, min_ptr, max_ptr, held_min_ptr, held_max_ptr, avg_a, avg_c,
                 ticket_ptr, status_ptr, absmax_ptr, qa, qb, q_ok, geo, Q, qp,
                 MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr,
                 QP: tl.constexpr, ABSMAX: tl.constexpr, BLOCK_A: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    """A split reduction finished in its own launch: the last of block
    (program_id(0))'s programs to arrive -- a ticket, an atomic counter at
    ``ticket_ptr + block``, zero at launch -- reduces the block's partials
    over every split, stores the groups' (min, max) through the MODE
    epilogue (combined with the held statistics) and, with QP, their
    qparams and the status's non-finite-scale flag (ABSMAX: the block's
    absolute maximum to absmax_ptr[block]), and puts the ticket back to zero
    (ready for the next launch; a status holding it then reads as a fresh
    one's tail). The partials' stores come
    before the ticket (a barrier; the atomic releases them) and are read
    after it (it acquires them); which program arrives last changes nothing
    it computes."""
    tl.debug_barrier()
    block = tl.program_id(0)
    split = tl.num_programs(1)
    if tl.atomic_add(ticket_ptr + block, 1) == split - 1:
        tl.debug_barrier()
        qq = qa * geo.QB + qb
        lo = tl.full([BLOCK_A, BLOCK_B, BLOCK_S, 1], float("inf"), tl.float32)
        hi = tl.full([BLOCK_A, BLOCK_B, BLOCK_S, 1], float("-inf"), tl.float32)
        for s0 in range(0, split, BLOCK_S):
            sp = s0 + tl.arange(0, BLOCK_S)[None, None, :, None]
            ok = q_ok & (sp < split)
            offs = sp.to(tl.int64) * Q + qq
            lo = tl.minimum(lo, widen(tl.load(pmin_ptr + offs, mask=ok, other=float("inf"))),
                            propagate_nan=tl.PropagateNan.ALL)
            hi = tl.maximum(hi, widen(tl.load(pmax_ptr + offs, mask=ok, other=float("-inf"))),
                            propagate_nan=tl.PropagateNan.ALL)
        has_nan = tl.max((lo != lo).to(tl.int32), axis=2, keep_dims=True) > 0
        lo_q = tl.where(has_nan, float("nan"), tl.min(lo, axis=2, keep_dims=True))
        hi_q = tl.where(has_nan, float("nan"), tl.max(hi, axis=2, keep_dims=True))
        _epilogue(min_ptr, max_ptr, qq, lo_q, hi_q, qq, q_ok, held_min_ptr, held_max_ptr,
                  avg_a, avg_c, MODE, DTYPE, BITS16)
        if QP is not None:
            bad_scale = epilogue_qparams(lo_q, hi_q, qq, q_ok, qp, DTYPE, QP)
            flag_scale(status_ptr, _any(bad_scale))
        if ABSMAX:
            _store_absmax(absmax_ptr, block, _group_absmax(lo_q, hi_q, has_nan, q_ok))
        one = tl.arange(0, 1)
        tl.store(ticket_ptr + block + one, one.to(tl.int64) * 0)


# Sizes that vary per call are not specialised on (one compiled variant per
# block shape and mode, not per tensor size); strides and the padding limits
# stay specialised, so a unit stride is known at compile time and loads (and
# the padding masks of a width divisible by 16) vectorise.
@triton.jit(do_not_specialize=["Q", "NR", "rows_per_split", "observation", "ticket0"])
def _min_max_kernel(
    x_ptr, perm_ptr, min_ptr, max_ptr,
    Q, NR, lim_r, lim_e, geo,
    rows_per_split, held_min_ptr, held_max_ptr, status_ptr, avg_a, avg_c, observation,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    ROW_LEVELS: tl.constexpr, SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr,
    GROUP_TAIL: tl.constexpr, GROUP_LOOP: tl.constexpr, PAD: tl.constexpr, GATHER: tl.constexpr,
    MODE: tl.constexpr, DTYPE: tl.constexpr, BITS16: tl.constexpr, RECORD: tl.constexpr,
    qp=None, QP: tl.constexpr = None, absmax_ptr=None, ABSMAX: tl.constexpr = False,
    fin_min_ptr=None, fin_max_ptr=None, tickets_ptr=None, ticket0=0,
    FINISH: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
):
    """Program (i, s): the BLOCK_A x BLOCK_B groups of block i
    (``tile_groups``), rows [s*rows_per_split, (s+1)*rows_per_split), every
    element of those rows, BLOCK_R rows x BLOCK_E elements per step.
    GROUP_LOOP (a block is one step: one row, one chunk): a program takes
    several blocks of a block column instead (``tile_blocks``), one step each.

    Writes min/max of that slice to min_ptr[s*Q + q] / max_ptr[s*Q + q]
    (s is 0 without a split, then these are the results), in their dtype.
    Lanes keep running min/max in fp32 (exact for fp16/bf16/fp32 values),
    NaN propagating, and reduce once at the end.

    Epilogue (kernels/stats.py), without a split only: MODE combines the
    results with the held statistics before they are stored (BITS16: bf16
    statistics addressed as their bits); RECORD adds this slice's NaN / +-inf
    counts to the observer's non-finite record. QP (nothing held, no split):
    the groups' qparams too (``qp``: ``QParamsOut``), a non-finite scale
    flagged in the status's one flag word (``flag_scale``). ABSMAX: the
    max over the program's groups of max(max, -min), NaN propagating, to
    absmax_ptr[program] in fp32 (a global scale's partial,
    ``qparams.PartsQParams``). FINISH (a split; never with GROUP_LOOP,
    whose groups have one row): the programs store partials to min_ptr /
    max_ptr, and the last program of each block to arrive finishes it in
    this launch (``_finish_tile``, its ticket at tickets_ptr[ticket0 +
    block], zero at launch): results through the MODE epilogue to
    fin_min_ptr / fin_max_ptr, with QP their qparams and the flag,
    with ABSMAX the block's absolute maximum to absmax_ptr[block].
    """
    pid_s = tl.program_id(1)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(r_lo + rows_per_split, NR)
    out_base = pid_s.to(tl.int64) * Q
    epi = (geo, min_ptr, max_ptr, held_min_ptr, held_max_ptr, avg_a, avg_c, qp)
    pa, pb, step, n_a, QA = tile_blocks(Q, geo, BLOCK_A, BLOCK_B)
    if GROUP_LOOP:
        worst = tl.zeros([BLOCK_A, BLOCK_B, 1, 1], tl.float32)
        bad_scale = tl.zeros([BLOCK_A, BLOCK_B, 1, 1], tl.int64)
        absmax = tl.full([BLOCK_A, BLOCK_B, 1, 1], float("-inf"), tl.float32)
        for blk in range(pa, n_a, step):
            qa, qb, q_ok = tile_groups(blk, pb, QA, geo, BLOCK_A, BLOCK_B, GROUP_TAIL)
            x = _tile(x_ptr, perm_ptr, qa, qb, r_lo, 0, r_hi, geo, lim_r, lim_e,
                      BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
            b, bs, am = _reduce_store(x, x, qa, qb, q_ok, out_base, *epi, MODE, DTYPE, BITS16,
                                      RECORD, QP, ABSMAX)
            if RECORD:
                worst = tl.maximum(worst, b, propagate_nan=tl.PropagateNan.ALL)
            bad_scale = bad_scale | bs
            if ABSMAX:
                absmax = tl.maximum(absmax, am, propagate_nan=tl.PropagateNan.ALL)
        if RECORD:
            any_bad = _nonfinite(worst)
            c_nan = any_bad.to(tl.int64) * 0
            c_pos = c_nan
            c_neg = c_nan
            if any_bad:  # the error path: count, re-reading this program's blocks
                for blk in range(pa, n_a, step):
                    qa, qb, q_ok = tile_groups(blk, pb, QA, geo, BLOCK_A, BLOCK_B, GROUP_TAIL)
                    n1, p1, m1 = _count_slice(x_ptr, perm_ptr, qa, qb, q_ok, r_lo, r_hi, geo, lim_r,
                                              lim_e, BLOCK_R, BLOCK_E, ROW_LEVELS, PAD, GATHER)
                    c_nan += n1
                    c_pos += p1
                    c_neg += m1
            ST.record(status_ptr, c_nan, c_pos, c_neg, any_bad, observation)
    else:
        qa, qb, q_ok = tile_groups(pa, pb, QA, geo, BLOCK_A, BLOCK_B, GROUP_TAIL)
        n_e = tl.cdiv(geo.E, BLOCK_E)
        lo = tl.full([BLOCK_A, BLOCK_B, BLOCK_R, BLOCK_E], float("inf"), tl.float32)
        hi = tl.full([BLOCK_A, BLOCK_B, BLOCK_R, BLOCK_E], float("-inf"), tl.float32)
        # steps over (row block, element chunk), chunks inner
        r0 = r_lo
        c = 0
        for _ in range(0, tl.cdiv(r_hi - r_lo, BLOCK_R) * n_e):
            x = _tile(x_ptr, perm_ptr, qa, qb, r0, c, r_hi, geo, lim_r, lim_e,
                      BLOCK_R, BLOCK_E, ROW_LEVELS, SHORT_E, ROW_TAIL, PAD, GATHER)
            lo = tl.minimum(lo, x, propagate_nan=tl.PropagateNan.ALL)
            hi = tl.maximum(hi, x, propagate_nan=tl.PropagateNan.ALL)
            c += 1
            wrap = c == n_e
            c = tl.where(wrap, 0, c)
            r0 = tl.where(wrap, r0 + BLOCK_R, r0)
        if FINISH:  # partials: the epilogue and the qparams are the finishing program's
            bad, bad_scale, absmax = _reduce_store(lo, hi, qa, qb, q_ok, out_base, *epi,
                                                   ST.MODE_REPLACE, DTYPE, False, RECORD, None,
                                                   False)
        else:
            bad, bad_scale, absmax = _reduce_store(lo, hi, qa, qb, q_ok, out_base, *epi, MODE,
                                                   DTYPE, BITS16, RECORD, QP, ABSMAX)
        if RECORD:
            # nothing extra in the hot loop: a NaN, +inf or -inf shows in the
            # results; counting re-reads this program's slice only when one did
            any_bad = _nonfinite(bad)
            c_nan = any_bad.to(tl.int64) * 0
            c_pos = c_nan
            c_neg = c_nan
            if any_bad:
                c_nan, c_pos, c_neg = _count_slice(x_ptr, perm_ptr, qa, qb, q_ok, r_lo, r_hi, geo,
                                                   lim_r, lim_e, BLOCK_R, BLOCK_E, ROW_LEVELS, PAD,
                                                   GATHER)
            ST.record(status_ptr, c_nan, c_pos, c_neg, any_bad, observation)
        if FINISH:
            _finish_tile(min_ptr, max_ptr, fin_min_ptr, fin_max_ptr, held_min_ptr, held_max_ptr,
                         avg_a, avg_c, tickets_ptr + ticket0, status_ptr, absmax_ptr, qa, qb, q_ok,
                         geo, Q, qp, MODE, DTYPE, BITS16, QP, ABSMAX, BLOCK_A, BLOCK_B, BLOCK_S)
    if QP is not None and not FINISH:
        flag_scale(status_ptr, _any(bad_scale))
    if ABSMAX and not FINISH:
        _store_absmax(absmax_ptr, tl.program_id(0), absmax)


def min_max(call: MinMaxCall):
    """(min_vals, max_vals) per group, shaped like the qparams, in value's dtype.

    The results of ``obskernels.reference.min_max`` for the same call;
    ``held`` / ``averaging_constant`` / ``status`` run the epilogue of
    kernels/stats.py in the same launch; ``out`` receives the results.
    """
    return prepare(call)(call)


def prepare(call: MinMaxCall, qparams: bool = False, widen: bool = True):
    """The launch of ``call``, prepared from its signature: layout, blocks,
    split and warps are chosen here once; the returned function launches any
    call of the same signature (value, held, status and out of the same
    shapes, strides, dtypes and devices; the same args and options), reading
    only that call's tensors and observation index.

    ``qparams`` (``prepare_qparams``: nothing held, no out): the launch of a
    ``MinMaxQParamsCall`` of that signature (and ``widen``) computing the qparams in its
    one launch (where a group's rows are split across programs, the last
    program of each block to arrive: ``_finish_tile``), or None where the
    streaming kernel reduces whole groups that are small (``QP_MIN_GROUP``)
    or gathered (g_idx)."""
    value, held = call.flat.value, call.held
    check_kernel_dtype(value)
    check_launchable(value, "min_max")
    layout = group_layout(call.flat)
    mode, avg_a, avg_c = ST.combine_modes(held, call.averaging_constant)
    bits16 = held is not None and value.dtype == torch.bfloat16
    token = config_token()
    config = current_config("min_max")
    tile = min_max_tile(layout, value.element_size(), config, qparams)
    Q, split = layout.num_groups, tile.split
    qshape, dtype, dev = layout.qshape, value.dtype, value.device
    perm, layout_args = layout.perm, (*layout.kernel_args(), tile.rows_per_split)
    record = call.status is not None
    epilogue = dict(MODE=mode, DTYPE=DTYPE_CODE[dtype], BITS16=bits16, **ST.mode_options(mode))
    grid = (tile.programs, split)
    # (with a split the programs store plain partials, FINISH: the epilogue
    # is the finishing program's)
    first = dict(**tile.blocks(), PAD=layout.pad, GATHER=layout.gather, RECORD=record,
                 **tile.launch(), **epilogue)

    # outputs (contiguous); bf16 statistics are read and written as their
    # bits by the kernels themselves (kernels/stats.py), no view here
    new_stats = allocator(qshape, dtype, dev)
    context = launch_context(dev)
    if split > 1:
        new_parts = allocator((split, Q), dtype, dev)
    if qparams:
        return _qparams_launch(call.flat, layout, (grid, first),
                               (perm, layout_args, avg_a, avg_c), new_stats,
                               new_parts if split > 1 else None, context, token, widen)
    held_contiguous = call.held is None or (call.held[0].is_contiguous()
                                            and call.held[1].is_contiguous())
    if split > 1:
        # one launch: the last program of each block to arrive (a ticket,
        # zero at launch and put back to zero) finishes the block's split
        first = dict(first, FINISH=True, BLOCK_S=finish_lanes(first))
        # the tickets of a call whose caller keeps none (see ``new_scratch``)
        no_tickets = zero_tickets(grid[0], dev)

    # the launch site, its constexprs and options bound (kernels/_replay.py)
    kernel = Replay(globals(), "_min_max_kernel", grid, **first)

    def launch(call: MinMaxCall, scratch=None):
        if config_token() is not token:  # a launch_config block changed the policy
            return min_max(call)
        value, held, status, out = call.flat.value, call.held, call.status, call.out
        if out is None:
            mins, maxs = new_stats(), new_stats()
        else:
            mins, maxs = out
        if held is None:
            held_min, held_max = mins, maxs  # unread
        else:
            held_min, held_max = held  # read at the groups' flat index
            if not held_contiguous:  # (strides are the signature's)
                held_min, held_max = held_min.contiguous(), held_max.contiguous()
        with context():
            if split == 1:
                kernel(
                    value, perm if perm is not None else value,  # perm: unread unless GATHER
                    mins, maxs, *layout_args, held_min, held_max,
                    status if status is not None else mins, avg_a, avg_c, call.observation,
                )
                return mins, maxs
            if scratch is None:
                tickets, pmin, pmax = fresh_copy(no_tickets), new_parts(), new_parts()
            else:
                tickets, pmin, pmax = scratch
            kernel(
                value, perm if perm is not None else value, pmin, pmax, *layout_args,
                held_min, held_max, status if status is not None else pmin, avg_a, avg_c,
                call.observation, fin_min_ptr=mins, fin_max_ptr=maxs, tickets_ptr=tickets,
            )
        return mins, maxs

    # a caller that repeats this call in place (ops.Repeat) keeps scratch for
    # a split: a zeroed ticket per block (the launch then finishes the split
    # itself, putting them back to zero) and the partials, which every call
    # writes before its last programs read them (calls in stream order)
    if split > 1:
        launch.new_scratch = lambda: (torch.zeros(grid[0], dtype=torch.int64, device=dev),
                                      new_parts(), new_parts())
    else:
        launch.new_scratch = None
    return launch


# --------------------------------------------------------------------------- #
# min_max_qparams: a first observation's statistics and qparams
# --------------------------------------------------------------------------- #
def min_max_qparams(call: MinMaxQParamsCall):
    """Triton twin of ``reference.min_max.min_max_qparams``: (min_vals,
    max_vals, scale, zero_point, global_scale, status), bit-identical."""
    return prepare_qparams(call)(call)


#: The fewest elements per group for qparams in the epilogue of a large
#: value: each thread computes its group's qparams once after streaming the
#: group's elements (~550-700 SASS instructions on the common path, by the
#: compile report; the float64 redo compiled in for asymmetric and MX scales
#: is a branch a program takes only where one of its groups' fp32 scale
#: overflowed, and does not count). At 128, symmetric or asymmetric, a 64 MB
#: weight's program stays within the streaming kernels' instruction targets
#: (8.1-9.3 SASS per 2-byte element; the compile check's real-size cases);
#: at 64 it would not (12.5-15.0), so smaller groups take two launches.
QP_MIN_GROUP = 128

#: Values of fewer bytes take the epilogue whatever their groups' size: their
#: call is host-bound (by the bench's H100 terms, 32M bf16 elements at ~25
#: SASS each issue in about 25 us, a fifth of an observer call's host time),
#: and the launch and the operation the epilogue saves cost more than the
#: instructions it adds (modelled; no GPU has timed it).
#: From here up, QP_MIN_GROUP holds, and with it the compile check's
#: instruction targets, which count the cases of 64 MB and more.
QP_SMALL_GROUPS_BELOW = 64 << 20

#: Lanes of the step in which the last program of a split block reduces the
#: block's partials (``_finish_tile``): that many partials of a one-group
#: block per step, fewer per group for wider blocks.
FINISH_LANES = 256


def finish_lanes(first: dict) -> int:
    """``_finish_tile``'s BLOCK_S for a launch of the streaming kernel's options ``first``."""
    return max(FINISH_LANES // (first["BLOCK_A"] * first["BLOCK_B"]), 1)


def prepare_qparams(call: MinMaxQParamsCall):
    """The launch of ``call``'s signature: ONE launch of ``_min_max_kernel``
    computing the qparams where every program holds whole, large enough
    groups (in its epilogue, ``QP``) and where the groups' rows are split
    across programs (by the last program of each block, ``FINISH``);
    TENSOR_GROUP: that launch writing partial absolute maxima, then the
    qparams kernel; otherwise the launches of ``min_max`` and
    ``calculate_qparams`` (``qparams.prepare_with_qparams``)."""
    return prepare_with_qparams(call, prepare)


def _qparams_launch(flat, layout, main, launch_args, new_stats, new_parts, context, token,
                    widen):
    """``prepare(..., qparams=True)``'s launch (see there): the qparams in the
    one launch of ``_min_max_kernel`` (``main``: grid and options), with a
    split by the last program of each block (``new_parts``: the partials'
    allocator). None where the groups, reduced by the streaming
    kernel itself, are gathered, or too small for it (``QP_MIN_GROUP``) in a
    value of ``QP_SMALL_GROUPS_BELOW`` bytes or more."""
    value = flat.value
    grid, first = main
    split = grid[1]
    if flat.strategy == Strategy.TENSOR_GROUP:
        # a global scale needs every group first: the qparams in one launch more
        return _parts_qparams_launch(flat, layout, main, launch_args, new_stats, new_parts,
                                     context, token, widen)
    # the status: the record, then one scale flag word (with a split, after
    # it a ticket per block, see _finish_tile)
    plan = epilogue_plan(flat.args, value, layout.qshape,
                         gpu_arith(current_config("min_max"), value, "min_max"), widen,
                         tickets=grid[0] if split > 1 else 0)
    # a streaming thread computes its group's qparams once, after streaming
    # the group: worth it where that costs little per element of the group
    # or the value is small (a host-bound call), and not for gathered columns
    # (g_idx), whose loads take triton 3.6 to its bound; a split's last program
    # computes one group's per lane, at any size
    small_groups = value.numel() < layout.num_groups * QP_MIN_GROUP
    large = value.numel() * value.element_size() >= QP_SMALL_GROUPS_BELOW
    if split == 1 and (layout.gather or (small_groups and large)):
        return None
    perm, layout_args, avg_a, avg_c = launch_args
    # torch's roundings, one operation each, where the qparams are computed;
    # with a split the last program of each block finishes it (a split is
    # never a GROUP_LOOP: its groups have one row)
    first = dict(first, **UNFUSED, QP=plan.switches)
    if split > 1:  # the tickets after the flag
        first = dict(first, FINISH=True, BLOCK_S=finish_lanes(first), ticket0=N_STATUS + 1)

    kernel = Replay(globals(), "_min_max_kernel", grid, **first)

    def launch(call: MinMaxQParamsCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return min_max_qparams(call)
        value = call.flat.value
        mins, maxs = new_stats(), new_stats()
        qp, status = plan.outputs()
        with context():
            if split == 1:
                kernel(
                    value, perm if perm is not None else value, mins, maxs, *layout_args, mins,
                    maxs, status, avg_a, avg_c, 0, qp=qp,
                )
            else:  # the partials, finished in this launch into mins / maxs
                kernel(
                    value, perm if perm is not None else value, new_parts(), new_parts(),
                    *layout_args, mins, maxs, status, avg_a, avg_c, 0, qp=qp,
                    fin_min_ptr=mins, fin_max_ptr=maxs, tickets_ptr=status,
                )
        return mins, maxs, qp.scale_ptr, qp.zp_ptr, None, status

    return launch


def _parts_qparams_launch(flat, layout, main, launch_args, new_stats, new_parts, context, token,
                          widen):
    """``_qparams_launch`` of TENSOR_GROUP statistics, whose global scale
    needs every group: the launch of ``_min_max_kernel`` that gives the
    statistics writes each program's absolute maximum (ABSMAX; with a split,
    the last program of each block to arrive finishes the block and writes
    the block's, its ticket after the status's flags, ``PartsQParams.flags``)
    and counts the record into the status's head, then ONE ``_qparams_kernel``
    reduces those partials (``qparams.PartsQParams``): two launches, where
    ``min_max`` then ``calculate_qparams(fused=...)`` make three (four with a
    split)."""
    (grid, first), value = main, flat.value
    perm, layout_args, avg_a, avg_c = launch_args
    split = grid[1]
    stats = torch.empty(layout.qshape, dtype=value.dtype, device=value.device)
    plan = prepare_from_parts(flat.args, stats, grid[0], first["RECORD"], widen,
                              tickets=grid[0] if split > 1 else 0)
    first = dict(first, ABSMAX=True)
    if split > 1:
        first.update(FINISH=True, BLOCK_S=finish_lanes(first), ticket0=N_STATUS + plan.flags)

    kernel = Replay(globals(), "_min_max_kernel", grid, **first)

    def launch(call: MinMaxQParamsCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return min_max_qparams(call)
        value = call.flat.value
        mins, maxs, parts, status = new_stats(), new_stats(), plan.new_parts(), plan.status()
        with context():
            if split == 1:
                kernel(
                    value, perm if perm is not None else value, mins, maxs, *layout_args, mins,
                    maxs, status, avg_a, avg_c, 0, absmax_ptr=parts,
                )
            else:  # the partials, finished in this launch into mins / maxs
                kernel(
                    value, perm if perm is not None else value, new_parts(), new_parts(),
                    *layout_args, mins, maxs, status, avg_a, avg_c, 0,
                    absmax_ptr=parts, fin_min_ptr=mins, fin_max_ptr=maxs, tickets_ptr=status,
                )
            scale, zero_point, gs = plan.launch(mins, maxs, parts, status)
        return mins, maxs, scale, zero_point, gs, status

    return launch
