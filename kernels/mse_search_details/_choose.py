"""The choice: the global stop step S from the OR-ed improvement flags (the
reference's patience counter), each group's last improving step <= S from its
bits, and its range rd(base * p_step) (``_choose_kernel`` after the register
path; the split path's last program calls the same helpers). The search
kernels keep each group's unshrunk base range in the outputs themselves (it
is a value of the output dtype), and the choice replaces it there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from obskernels.kernels import quant
from obskernels.kernels._layout import store_exact, widen
from obskernels.kernels.mse_search_details._step import _PER_CALL, _or
from obskernels.kernels.qparams import epilogue_qparams, flag_scale


@triton.jit
def _patience_step(stop, stale, i, improved, patience):
    """Step i of the reference's global patience counter: ``stale`` counts the
    steps in a row in which no group improved; ``stop`` becomes i at the first
    step ending a run of ``patience`` of them (-1 while the loop runs)."""
    stale = tl.where(improved, 0, stale + 1)
    stop = tl.where((stop < 0) & (stale >= patience), i, stop)
    return stop, stale


@triton.jit
def _stop_step(flags_ptr, n_steps, patience):
    """The step S at which the reference's loop breaks (n_steps - 1 if never),
    from the OR-ed improvement words flags_ptr[i // 32] (bit i % 32)."""
    stop = n_steps * 0 - 1
    stale = n_steps * 0
    for i in range(n_steps):
        f = (tl.load(flags_ptr + i // 32, volatile=True) >> (i % 32)) & 1
        stop, stale = _patience_step(stop, stale, i, f != 0, patience)
    return tl.where(stop < 0, n_steps - 1, stop)


@triton.jit
def _stop_step_parts(flags_ptr, P, n_words, n_steps, patience, BLOCK_P: tl.constexpr):
    """``_stop_step`` from per-program words flags_ptr[P, n_words]: word
    i // 32 is the OR over the P programs, formed when step i enters it."""
    stop = n_steps * 0 - 1
    stale = n_steps * 0
    word = n_steps * 0
    pp = tl.arange(0, BLOCK_P)
    for i in range(n_steps):
        if i % 32 == 0:
            acc = tl.zeros([BLOCK_P], tl.int32)
            for p0 in range(0, P, BLOCK_P):
                acc = acc | tl.load(flags_ptr + (p0 + pp) * n_words + i // 32,
                                    mask=p0 + pp < P, other=0)
            word = tl.reduce(acc, 0, _or)
        f = (word >> (i % 32)) & 1
        stop, stale = _patience_step(stop, stale, i, f != 0, patience)
    return tl.where(stop < 0, n_steps - 1, stop)


@triton.jit
def _high_bit(v):
    """Index of the highest set bit of a non-zero int32 (bit 31 included)."""
    u = v.to(tl.uint32, bitcast=True)
    r = tl.zeros_like(v)
    c = u >= 65536
    r = tl.where(c, r + 16, r)
    u = tl.where(c, u >> 16, u)
    c = u >= 256
    r = tl.where(c, r + 8, r)
    u = tl.where(c, u >> 8, u)
    c = u >= 16
    r = tl.where(c, r + 4, r)
    u = tl.where(c, u >> 4, u)
    c = u >= 4
    r = tl.where(c, r + 2, r)
    u = tl.where(c, u >> 2, u)
    c = u >= 2
    return tl.where(c, r + 1, r)


@triton.jit
def _last_improving(bits_ptr, g, gmask, G, n_words, S):
    """Each group's last improving step <= S from its bits, word wi of group
    g at bits_ptr[wi, g] (-1 if none)."""
    choice = tl.full(g.shape, -1, tl.int32)
    for wi in range(n_words):
        word = tl.load(bits_ptr + wi * G + g, mask=gmask, other=0, volatile=True)
        keep = S - wi * 32 + 1  # bits 0 .. keep-1 of this word are steps <= S
        lowmask = tl.where(keep >= 32, -1, (1 << tl.minimum(tl.maximum(keep, 0), 31)) - 1)
        word = word & lowmask
        choice = tl.where(word != 0, wi * 32 + _high_bit(word), choice)
    return choice


@triton.jit(do_not_specialize=_PER_CALL + ["P", "groups_per_program"])
def _choose_kernel(
    bits_ptr, flags_ptr, shrink_ptr, out_min_ptr, out_max_ptr,
    G, P, groups_per_program, n_steps, n_words, patience,
    DTYPE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    status_ptr=None, qp=None, QP: tl.constexpr = None,
):
    """One program: groups_per_program groups, BLOCK_G at a time. S from the
    search programs' words flags_ptr[P, n_words] (every program computes the
    same S), then each group's last improving step <= S:
    out = rd(base * p_step), or base when the group never improved (the
    base read from out). QP (``epilogue_qparams``): the qparams of the
    chosen ranges too, a non-finite scale flagged in the status's one flag
    word (``flag_scale``)."""
    pid = tl.program_id(0)
    S = _stop_step_parts(flags_ptr, P, n_words, n_steps, patience, BLOCK_P)
    bad = tl.zeros([BLOCK_G], tl.int64)
    for g0 in range(0, groups_per_program, BLOCK_G):
        gl = g0 + tl.arange(0, BLOCK_G)
        g = pid.to(tl.int64) * groups_per_program + gl
        gmask = (g < G) & (gl < groups_per_program)
        choice = _last_improving(bits_ptr, g, gmask, G, n_words, S)
        omin, omax = _write_choice(shrink_ptr, out_min_ptr, out_max_ptr, g, gmask,
                                   choice, DTYPE)
        if QP is not None:
            bad = bad | epilogue_qparams(omin, omax, g, gmask, qp, DTYPE, QP)
    if QP is not None:
        flag_scale(status_ptr, tl.max(bad, axis=0))


@triton.jit
def _step_shrink(shrink_ptr, choice):
    """Step ``choice``'s shrink p (shrink_ptr[choice]; 1.0 where choice < 0)."""
    return tl.load(shrink_ptr + choice, mask=choice >= 0, other=1.0)


@triton.jit
def _choice_range(bmin, bmax, choice, p, DTYPE: tl.constexpr):
    """(rd(bmin * p), rd(bmax * p)) of step ``choice`` (its shrink ``p``), or
    the base where choice < 0."""
    omin = tl.where(choice >= 0, quant.rd(bmin * p, DTYPE), bmin)
    omax = tl.where(choice >= 0, quant.rd(bmax * p, DTYPE), bmax)
    return omin, omax


@triton.jit
def _write_choice(shrink_ptr, out_min_ptr, out_max_ptr, g, gmask, choice,
                  DTYPE: tl.constexpr):
    """out = rd(base * p[choice]) of groups g, or the base where choice < 0,
    the base read from out (written there by the search, in this launch on
    the split path: volatile)."""
    bmin = widen(tl.load(out_min_ptr + g, mask=gmask, other=0.0, volatile=True))
    bmax = widen(tl.load(out_max_ptr + g, mask=gmask, other=0.0, volatile=True))
    omin, omax = _choice_range(bmin, bmax, choice, _step_shrink(shrink_ptr, choice), DTYPE)
    # values are exact in the output dtype, so the store's cast cannot round
    store_exact(out_min_ptr + g, omin, gmask)
    store_exact(out_max_ptr + g, omax, gmask)
    return omin, omax
