"""Split path of the search (groups too large for registers):
``_minmax_part_kernel`` (per-split min/max, clears the counters) and
``_search_part_kernel`` (per-split partial errors of every step, finished in
the same launch by tickets: ``_finish_group`` per group, then the choice of
every group by the last group to finish).
"""

from __future__ import annotations

import triton
import triton.language as tl

from obskernels.kernels import quant
from obskernels.kernels import stats as ST
from obskernels.kernels._layout import store_exact
from obskernels.kernels.mse_search_details._choose import _last_improving, _stop_step, _write_choice
from obskernels.kernels.mse_search_details._step import (
    _PER_CALL,
    _block_errors,
    _importance_norm,
    _importance_weights,
    _improved,
    _load_group,
    _nan_minmax,
    _step_errors,
)


@triton.jit(do_not_specialize=_PER_CALL + ["observation"])
def _minmax_part_kernel(
    x_ptr, part_ptr, tickets_ptr, flags_ptr, status_ptr,
    G, NR, lim_r, lim_e, geo, group_numel,
    K, chunks_per_split, n_words, expand, observation,
    PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
    DTYPE: tl.constexpr, RECORD: tl.constexpr,
):
    """Program (g, k): NaN-propagating min/max of split k of group g (chunks
    k*cps .. (k+1)*cps - 1) -> part_ptr[0 or 1, g, k]. It also clears what
    the search launch counts and ORs into (group g's ticket; program (0, 0):
    the all-groups ticket and the step flags), so the host zeroes nothing.
    RECORD: the split's NaN / +-inf counts and whether its elements make the
    group's base range non-finite (a NaN or an infinity among them, or a
    finite min / max times ``expand`` overflowing: the group's base is not
    finite exactly when one of its splits' is) go into the record
    ``status_ptr`` as observation ``observation`` (kernels/stats.py)."""
    gid = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    g = gid + tl.arange(0, 1)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    # a running min / max and NaN flag per lane, reduced once after the loop
    # (min and max are exact in any order)
    lo = tl.full([1, BLOCK_E], float("inf"), tl.float32)
    hi = tl.full([1, BLOCK_E], float("-inf"), tl.float32)
    nan = tl.zeros([1, BLOCK_E], tl.int1)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, x_ptr, g, e, group_numel,
            G, NR, lim_r, lim_e, geo, PAD, False, False,
        )
        lo = tl.where(valid & (x < lo), x, lo)
        hi = tl.where(valid & (x > hi), x, hi)
        nan = nan | (valid & (x != x))
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    if RECORD:
        _record_split(x_ptr, status_ptr, g, k, e0, lo, hi, has_nan, group_numel, G, NR, lim_r,
                      lim_e, geo, chunks_per_split, expand, observation, PAD, BLOCK_E, DTYPE)
    mn = tl.where(has_nan, float("nan"), tl.min(lo, axis=1))
    mx = tl.where(has_nan, float("nan"), tl.max(hi, axis=1))
    tl.store(part_ptr + g * K + k, mn)
    tl.store(part_ptr + G * K + g * K + k, mx)
    first = (g * 0 + k) == 0
    tl.store(tickets_ptr + g, g * 0, mask=first)
    wv = tl.arange(0, BLOCK_W)
    origin = (wv * 0 + gid + k) == 0
    tl.store(flags_ptr + wv, wv * 0, mask=origin & (wv < n_words))
    tl.store(tickets_ptr + G + wv, wv * 0, mask=origin & (wv == 0))



@triton.jit
def _record_split(x_ptr, status_ptr, g, k, e0, lo, hi, has_nan, group_numel, G, NR, lim_r,
                  lim_e, geo, chunks_per_split, expand, observation,
                  PAD: tl.constexpr, BLOCK_E: tl.constexpr, DTYPE: tl.constexpr):
    """``_minmax_part_kernel``'s record (RECORD). An infinity shows in the
    running min / max, a NaN in its flag: only a split holding a non-finite
    element walks its chunks again, to count them (a finite split, the usual
    one, adds no pass and no per-element work)."""
    lo1 = tl.min(lo, axis=1)
    hi1 = tl.max(hi, axis=1)
    nonfinite = tl.max((has_nan | (lo1 == float("-inf")) | (hi1 == float("inf"))).to(tl.int32),
                       axis=0) > 0
    nan = tl.zeros([], tl.int64)
    pos = tl.zeros([], tl.int64)
    neg = tl.zeros([], tl.int64)
    if nonfinite:
        for c in range(chunks_per_split):
            e = (k * chunks_per_split + c) * BLOCK_E + e0
            x, w, valid = _load_group(
                x_ptr, x_ptr, g, e, group_numel,
                G, NR, lim_r, lim_e, geo, PAD, False, False,
            )
            n, p, m = ST.count_nonfinite(x, valid)
            nan += n
            pos += p
            neg += m
    # the base range of the finite elements (none: lo > hi), times expand
    seen = hi1 >= lo1
    blo = quant.rd(lo1 * expand, DTYPE)
    bhi = quant.rd(hi1 * expand, DTYPE)
    overflow = seen & ((tl.abs(blo) == float("inf")) | (tl.abs(bhi) == float("inf")))
    ST.record(status_ptr, nan, pos, neg, nonfinite | (tl.max(overflow.to(tl.int32), axis=0) > 0),
              observation)


@triton.jit
def _finish_group(part_ptr, bits_ptr, flags_ptr, gid, G, K, n_steps, n_words, best_init,
                  DTYPE: tl.constexpr, IMATRIX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group gid's step errors from its K partials (blocks of BLOCK_K summed,
    then added, always in that order), rounded to DTYPE for "mse"; its
    improvement bits -> bits_ptr[:, gid], OR-ed into flags_ptr (32 steps at a time)."""
    ks = tl.arange(0, BLOCK_K)
    j = tl.arange(0, 32)
    one = tl.arange(0, 1)
    best = tl.zeros([1], dtype=tl.float32) + best_init
    for wi in range(n_words):
        si = wi * 32 + j
        smask = si < n_steps
        err = tl.zeros([32], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            m = smask[:, None] & (kk < K)[None, :]
            v = tl.load(part_ptr + (gid * K + kk[None, :]) * n_steps + si[:, None], mask=m,
                        volatile=True)
            # the masked lanes' zeros by a select, not by the load's `other`: the
            # same values in the same order, and triton 3.6's thread-locality
            # pass (which fails on a masked load's sum used twice after the
            # loop) leaves the loop alone
            err = err + tl.sum(tl.where(m, v, 0.0), axis=1)
        if not IMATRIX:
            err = quant.rd(err, DTYPE)
        imp, best = _improved(err[None, :], best, smask[None, :])
        word = tl.sum(imp.to(tl.int32) << j[None, :], axis=1)
        tl.store(bits_ptr + wi * G + gid + one, word)
        tl.atomic_or(flags_ptr + wi + one, word)



@triton.jit(do_not_specialize=_PER_CALL)
def _search_part_kernel(
    x_ptr, w_ptr, wmean_ptr, wcode_ptr, tiny, tab_ptr, shrink_ptr, mm_ptr,
    part_ptr, tickets_ptr, bits_ptr, flags_ptr, out_min_ptr, out_max_ptr,
    G, NR, lim_r, lim_e, geo, group_numel,
    K, chunks_per_split, n_steps, n_words, patience, expand, best_init,
    consts,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr, NORM_W: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KF: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_SB: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (b, k): split k of ROWS groups. Without importance (ROWS 1)
    group b; with it (weights, CHANNEL or GROUP: group g is column block
    g % QB of row g // QB) column block b % QB of rows (b // QB) * ROWS ..
    + ROWS - 1, so that each chunk's importance is loaded once (and
    normalised once, NORM_W) for ROWS rows instead of once per element.

    Base range of each group from its K split min/max, then for each chunk
    of split k (loaded once) and each step i, the chunk's error added to
    acc[group, i]; acc -> part_ptr[g, k, 0:n_steps] (fp32, unrounded).

    Then two tickets (atomic counters, release/acquire) finish the search in
    this launch: the last of group g's K programs to arrive sums its
    partials in a fixed order and writes g's improvement bits and flags
    (``_finish_group``); the last group to be finished derives S and writes
    every group's choice, as ``_choose_kernel`` does. Which program arrives
    last varies; what it computes does not (fixed-order sums, OR of bits).
    """
    pid = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, ROWS)
    if HAS_W:
        rb = pid // geo.QB
        j = pid - rb * geo.QB
        row = rb * ROWS + r
        g = tl.where(row < G // geo.QB, row.to(tl.int64) * geo.QB + j, G)
    else:
        g = pid.to(tl.int64) + r
    gmask = g < G
    ks = tl.arange(0, BLOCK_K)
    kmask = gmask[:, None] & (ks < K)[None, :]
    pmn = tl.load(mm_ptr + g[:, None] * K + ks[None, :], mask=kmask, other=float("inf"))
    pmx = tl.load(mm_ptr + G * K + g[:, None] * K + ks[None, :], mask=kmask, other=float("-inf"))
    mn, _unused = _nan_minmax(pmn, kmask)
    _unused, mx = _nan_minmax(pmx, kmask)
    bmin = quant.rd(mn * expand, DTYPE)
    bmax = quant.rd(mx * expand, DTYPE)
    first = gmask & ((g * 0 + k) == 0)
    # the base goes where the choice will (a value of the output dtype)
    store_exact(out_min_ptr + g, bmin, first)
    store_exact(out_max_ptr + g, bmax, first)

    wc, wok = _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W)
    sid = tl.arange(0, BLOCK_S)
    acc = tl.zeros([ROWS, BLOCK_S], dtype=tl.float32)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, x_ptr, g, e, group_numel,
            G, NR, lim_r, lim_e, geo, PAD, False, FAST,
        )
        if HAS_W:
            # importance comes only with CHANNEL / GROUP layouts: element e of
            # column block j is input column j * E + e, no padding
            w1 = tl.load(w_ptr + j * geo.E + e, mask=e < group_numel, other=0.0)
            w1 = _importance_weights(w1, wc, wok, NORM_W)
            w = tl.broadcast_to(w1[None, :], (ROWS, BLOCK_E))
        if BLOCK_SB == 1:
            # the rows' base as the tile holds its rows (a reduction over the
            # tile; the same values): every step's per-row qparams then meet
            # the tile without a layout conversion through shared memory
            rmin = tl.max(tl.zeros_like(x) + bmin[:, None], axis=1)
            rmax = tl.max(tl.zeros_like(x) + bmax[:, None], axis=1)
            for i in range(n_steps):
                p = tl.load(shrink_ptr + i)
                err = _step_errors(
                    x, valid, w, rmin, rmax, p, tab_ptr, consts,
                    DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False, FAST,
                )
                acc = tl.where(sid[None, :] == i, acc + err[:, None], acc)
        else:
            for i0 in range(0, n_steps, BLOCK_SB):
                si = i0 + tl.arange(0, BLOCK_SB)
                smask = si < n_steps
                err = _block_errors(
                    x, valid, w, bmin, bmax, si, smask, consts, shrink_ptr,
                    DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False,
                )
                hit = sid[None, :, None] == si[None, None, :]
                acc = acc + tl.sum(tl.where(hit, err[:, None, :], 0.0), axis=2)
    # this program's first group and its number of rows, from the program id
    # (scalars: no per-row index of the loop above stays live through it)
    if HAS_W:
        rb = pid // geo.QB
        g_first = (rb * ROWS).to(tl.int64) * geo.QB + (pid - rb * geo.QB)
        n_rows = G // geo.QB - rb * ROWS
    else:
        g_first = pid.to(tl.int64)
        n_rows = pid * 0 + 1
    pmask = (r < n_rows)[:, None] & (sid < n_steps)[None, :]
    pg = g_first + r.to(tl.int64) * geo.QB
    tl.store(part_ptr + (pg[:, None] * K + k) * n_steps + sid[None, :], acc, mask=pmask)

    # every thread's stores before the tickets (the atomic releases them)
    tl.debug_barrier()
    for ri in range(ROWS):
        # one scalar ticket per row, as for a single group
        gid = g_first + ri * geo.QB
        if ri < n_rows:
            if tl.atomic_add(tickets_ptr + gid, 1) == K - 1:
                _finish_group(part_ptr, bits_ptr, flags_ptr, gid, G, K, n_steps, n_words,
                              best_init, DTYPE, IMATRIX, BLOCK_KF)
                tl.debug_barrier()
                if tl.atomic_add(tickets_ptr + G, 1) == G - 1:
                    S = _stop_step(flags_ptr, n_steps, patience)
                    for g0 in range(0, G, BLOCK_C):
                        gg = g0 + tl.arange(0, BLOCK_C).to(tl.int64)
                        gm = gg < G
                        choice = _last_improving(bits_ptr, gg, gm, G, n_words, S)
                        _write_choice(shrink_ptr, out_min_ptr, out_max_ptr,
                                      gg, gm, choice, DTYPE)
