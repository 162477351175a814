"""Fused MSE shrink-grid search (SPEC §4), exact global patience.

For each group (a slice of the flattened ``(obs, *qparam_shape, group_size)``
view) and each step i, the candidate range is ``rd(base * p_i)`` with
``p_i = fp32(1 - i / grid)`` and the error is

    err_i = rd( sum_e  rd(|rd(fq(x_e) - x_e)| ** norm) )          flavour "mse"
    err_i = sum_e |fq(x_e) - x_e| ** norm * importance[col(e)]    flavour "imatrix" (fp32)

where ``fq`` is compressed-tensors' fake quantization with the candidate's
qparams (kernels/quant.py reproduces every rounding). A group improves at step
i when err_i is strictly below its best so far. The reference stops after
``patience`` steps in a row in which no group improved (global patience); the
step S at which it stops follows from the OR over groups of the improvement
bits, and each group's answer is its LAST improving step <= S (the unshrunk
base when there is none). So the kernels store one bit per (group, step) and
never store errors per element.

Groups are addressed in the raw value through ``kernels._layout.group_layout``
(the same index map as min_max and flatten, elements in the reference's
flattened order): no flattened or reshaped copy is made.

Two layouts of the work:
- small groups (<= ``CONFIG.max_reg_group`` elements, the common case): one
  launch of ``_search_kernel`` holds BLOCK_G whole groups in registers, takes
  their min/max itself, evaluates every step, writes the bits and ORs the
  per-step "any group improved" words into a global array (atomic OR, exact);
  ``_choose_kernel`` then derives S and writes each group's range.
  Launches: 2; the input is read once.
- large groups (TENSOR over a big weight, wide channels, activations with
  many observations): ``_minmax_part_kernel`` takes each split's min/max
  (and clears the counters the next launch uses), ``_search_part_kernel``
  has each (group, split) program evaluate every step over its chunks and
  write the per-(group, split, step) partial errors; the last of a group's
  programs to arrive (a ticket: an atomic counter) sums that group's
  partials in a fixed order and writes its improvement bits and flags, and
  the last group to finish derives S and writes every group's range.
  Launches: 2; the input is read twice.
Both are deterministic: sums run in a fixed order, only the OR and the
tickets are atomic (which program arrives last changes nothing it computes).
GPU arithmetic: on a CUDA tensor the step loop uses the hardware's
conversions (``FAST``, quant.py's GPU section: bf16/fp16/fp8 roundings,
round-half-even, a MUFU pow checked against rounding boundaries with torch's
own pow as the fallback table); the interpreter keeps the exact emulation,
and the tests compile both. One step per iteration on a GPU, 2-D tiles.

Host side, besides the importance checks (one read): no host read, no copy to
the device, and one aten op (zeroing the flags of the first layout); on a GPU
with a general norm, the pow table is built by torch once per (device,
dtype, norm). The
format's constants are Python floats (``quant.round_host``) and each step's
shrink factor is computed by the kernels (``_shrink``).
"""

from __future__ import annotations

import functools
import math
import os
import struct

import torch
import triton
import triton.language as tl
from compressed_tensors.quantization import QuantizationStrategy as S
from compressed_tensors.quantization import QuantizationType
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA, FP8_E4M3_DATA
from compressed_tensors.quantization.utils.mxfp_utils import should_generate_mx_scales

from obskernels.backends import KernelUnsupportedError
from obskernels.kernels import quant as Q
from obskernels.kernels._layout import (
    LaunchConfig,
    choose_split,
    group_layout,
    load_flat,
    num_warps_for,
    pow2_at_most,
)
from obskernels.reference.mse_search import (
    broadcast_importance,
    check_search_params,
    num_steps,
    search_args,
)
from obskernels.reference.mse_search import mse_search as _reference_mse_search
from obskernels.validation import WEIGHT, strategy_of

__all__ = ["mse_search", "CONFIG"]

# Block sizes and work split (kernels/_layout.py, LaunchConfig): tests pin
# smaller ones to reach the split path with tiny shapes. Only the work split
# changes with them: which candidate wins can change only through the order
# of fp32 partial sums (the split path's).
CONFIG = LaunchConfig()

_MAX_SPLIT_STEPS = 1024

# Scalars that follow the search parameters (grid, maxshrink, patience) or the
# work split are not specialised on: one compiled variant per format and block
# shape, not one per grid or patience (== 1 and % 16 would each make one).
# Group counts and sizes stay specialised: % 16 lets the compiler vectorise
# the masks and saves registers (28 of 108 in int4 group-128 _search_kernel).
_PER_CALL = ["lim_r", "lim_e", "n_steps", "n_words", "patience", "K", "chunks_per_split",
             "grid_bits", "exact32"]


# --------------------------------------------------------------------------- #
# kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _shrink(i, grid32, grid_bits, exact32):
    """Step i's shrink p_i = fp32(1 - i / grid), with the bits of the
    reference's Python float: i / grid and 1 - (.) in fp64, one rounding to fp32.

    exact32 (a runtime flag, the same for every lane): the host checked that
    one fp32 division, div_rn(grid32 - i, grid32), gives those bits for every
    step of this call (``_fp32_steps_exact``; so for every integer grid in
    practice). Otherwise the fp64 formula itself, grid arriving as the int64
    bits of the Python float (a float argument would be passed as fp32); fp64
    division is correctly rounded on a GPU (div.rn.f64) and in numpy, but slow
    on GPUs with few fp64 units, hence the fp32 path.
    """
    if exact32 != 0:
        p = tl.math.div_rn(grid32 - i.to(tl.float32), grid32)
    else:
        grid = grid_bits.to(tl.int64).to(tl.float64, bitcast=True)
        p = (1.0 - i.to(tl.float64) / grid).to(tl.float32)
    return p


@triton.jit
def _block_errors(
    x, valid, w, bmin, bmax, si, smask,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits, exact32,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr,
):
    """Errors [BG, SB] of the steps si [SB] over the tile x [BG, BE]: fp32 sums,
    rounded to DTYPE when ROUND_SUM (a whole group, flavour "mse"). Candidate: rd(base * p_i)."""
    p = tl.where(smask, _shrink(si, grid32, grid_bits, exact32), 1.0)
    cmin = Q.rd(bmin[:, None] * p[None, :], DTYPE)
    cmax = Q.rd(bmax[:, None] * p[None, :], DTYPE)
    scale, zp = Q.qparams(
        cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
        DTYPE, SYM, SCALE, ZP,
    )
    x3 = x[:, None, :]
    dq = Q.fake_quant(x3, scale[:, :, None], zp[:, :, None], qmin, qmax, DTYPE, QTYPE)
    if IMATRIX:
        err = Q.abs_pow(tl.abs(dq - x3), norm, NORM_MODE, Q.F32)
        if HAS_W:
            err = err * w[:, None, :]
    else:
        err = Q.abs_pow(tl.abs(Q.rd(dq - x3, DTYPE)), norm, NORM_MODE, DTYPE)
    # NaN * 0 would leak from tile slots outside the group: select, not multiply
    err = tl.where(valid[:, None, :], err, 0.0)
    err = tl.sum(err, axis=2)
    if ROUND_SUM:
        err = Q.rd(err, DTYPE)
    return err


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _fake_quant_hw(x, scale, zp, qmin, qmax,
                   DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr):
    """quant.fake_quant with the GPU's conversions (FAST only), same roundings.

    Specialisations, exact by the format: symmetric formats have zp == 0, so
    y + zp and q - zp are y and q (signs of zero aside, which the error's
    abs() removes). Integer formats of <= 8 bits have |q - zp| <= 255, an
    integer that bf16 and fp16 hold exactly, so rounding it is skipped.
    The clamp is min/max, which drops NaN instead of keeping it: y is NaN
    only where the group's scale is NaN or inf (a non-finite group, or an
    overflowing range), and then every error of that group is NaN or inf at
    every step, so it never improves either way.
    """
    y = Q.rd_hw(tl.math.div_rn(x, scale), DTYPE)
    if not SYM:
        y = Q.rd_hw(y + zp, DTYPE)
    y = tl.minimum(tl.maximum(y, qmin), qmax)
    if QTYPE == Q.Q_FP8:
        q = Q.round_fp8e4m3_hw(y)
    elif QTYPE == Q.Q_FP4:
        q = Q.round_fp4e2m1(y)
    else:
        q = Q.rint_hw(y)
    if SYM:
        qz = q
    elif QTYPE == Q.Q_INT:
        qz = q - zp
    else:
        qz = Q.rd_hw(q - zp, DTYPE)
    return Q.rd_hw(qz * scale, DTYPE)


@triton.jit
def _step_errors(
    x, valid, w, bmin, bmax, p, tab_ptr,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr, FAST: tl.constexpr,
):
    """Errors [BG] of ONE step (shrink p, a scalar) over the tile x [BG, BE]:
    the same arithmetic as _block_errors on 2-D tiles, so the per-group sums
    keep the load's layout (each thread adds its own run of a group before
    any shuffle). FAST: the GPU's conversions (quant.py, GPU arithmetic)."""
    cmin = Q.rd(bmin * p, DTYPE)
    cmax = Q.rd(bmax * p, DTYPE)
    scale, zp = Q.qparams(
        cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
        DTYPE, SYM, SCALE, ZP,
    )
    if FAST:
        dq = _fake_quant_hw(x, scale[:, None], zp[:, None], qmin, qmax, DTYPE, SYM, QTYPE)
        if IMATRIX:
            err = Q.abs_pow_hw(tl.abs(dq - x), norm, pw0, tab_ptr, NORM_MODE, Q.F32, Q.F32)
            if HAS_W:
                err = err * w
        else:
            d = tl.abs(Q.rd_hw(dq - x, DTYPE))
            err = Q.abs_pow_hw(d, norm, pw0, tab_ptr, NORM_MODE, DTYPE, DTYPE)
    else:
        dq = Q.fake_quant(x, scale[:, None], zp[:, None], qmin, qmax, DTYPE, QTYPE)
        if IMATRIX:
            err = Q.abs_pow(tl.abs(dq - x), norm, NORM_MODE, Q.F32)
            if HAS_W:
                err = err * w
        else:
            err = Q.abs_pow(tl.abs(Q.rd(dq - x, DTYPE)), norm, NORM_MODE, DTYPE)
    err = tl.sum(tl.where(valid, err, 0.0), axis=1)
    if ROUND_SUM:
        if FAST:
            err = Q.rd_hw(err, DTYPE)
        else:
            err = Q.rd(err, DTYPE)
    return err


@triton.jit
def _improved(err, best, ok):
    """Improvement bits [BG, SB] of a block of consecutive steps and the new
    best [BG]: step j improves when err_j < best and err_j < err_k for every
    earlier k of the block (strict; NaN never improves, nor counts as best)."""
    SB: tl.constexpr = err.shape[1]
    e = tl.where(ok & (err == err), err, float("inf"))
    j = tl.arange(0, SB)
    earlier = tl.where(j[None, :, None] > j[None, None, :], e[:, None, :], float("inf"))
    prev = tl.min(earlier, axis=2)
    imp = (e < best[:, None]) & (e < prev)
    return imp, tl.minimum(best, tl.min(e, axis=1))


@triton.jit
def _load_group(
    x_ptr, w_ptr, g, k, group_numel,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e,
    PAD: tl.constexpr, HAS_W: tl.constexpr,
):
    """Elements k of groups g as an fp32 tile [len(g), len(k)] (k: position in
    the reference's flattened group, see ``_layout.load_flat``), the importance
    of each element's input column (HAS_W; else x again), and which slots are
    group elements (the padding zeros of a partial block are)."""
    valid = (g < G)[:, None] & (k < group_numel)[None, :]
    x, col = load_flat(
        x_ptr, x_ptr, g[:, None], k[None, :], valid,
        QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False,
    )
    x = x.to(tl.float32)
    if HAS_W:
        # importance comes only with CHANNEL / GROUP layouts: col < cols, no padding
        w = tl.load(w_ptr + col, mask=valid, other=0.0)
    else:
        w = x
    return x, w, valid


@triton.jit
def _nan_minmax(x, valid):
    """(amin, amax) over axis 1 of the valid elements, NaN if any is NaN."""
    ok = valid & (x == x)
    mn = tl.min(tl.where(ok, x, float("inf")), axis=1)
    mx = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    has_nan = tl.max((valid & (x != x)).to(tl.int32), axis=1) > 0
    mn = tl.where(has_nan, float("nan"), mn)
    mx = tl.where(has_nan, float("nan"), mx)
    return mn, mx


@triton.jit(do_not_specialize=_PER_CALL)
def _search_kernel(
    x_ptr, w_ptr, tab_ptr, grid32, grid_bits, exact32, bits_ptr, flags_ptr, base_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    n_steps, n_words, expand, best_init,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """One program: BLOCK_G whole groups [BLOCK_G, BLOCK_E] in registers.

    With importance (weights, CHANNEL or GROUP: group g is column block
    g % QB of row g // QB), a program takes BLOCK_G // BLOCK_J rows of
    BLOCK_J column blocks and reads each column's importance once, shared by
    its rows, instead of once per element. Otherwise BLOCK_G consecutive groups.

    base = rd(amin * expand), rd(amax * expand) -> base_ptr[2, G];
    for every step i (BLOCK_S steps at a time: 1 on a GPU, more under the
    interpreter, whose cost is per operation): err_i per group (rounded to
    DTYPE for "mse"),
    improved = err_i < best (strict; NaN never), best updated;
    bit i of group g -> bits_ptr[g, i // 32]; the OR over this program's
    groups -> atomic OR into flags_ptr[i // 32].
    """
    pid = tl.program_id(0)
    if HAS_W:
        ROWS: tl.constexpr = BLOCK_G // BLOCK_J
        n_jb = tl.cdiv(QB, BLOCK_J)
        rb = pid // n_jb
        j0 = (pid - rb * n_jb) * BLOCK_J
        idx = tl.arange(0, BLOCK_G)
        row = rb * ROWS + idx // BLOCK_J
        j = j0 + idx % BLOCK_J
        g = tl.where((row < G // QB) & (j < QB), row.to(tl.int64) * QB + j, G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False,
        )
        # importance comes only with CHANNEL / GROUP layouts: element k of
        # column block j is input column j * E + k, no padding
        jj = j0 + tl.arange(0, BLOCK_J)
        kk = tl.arange(0, BLOCK_E)
        wm = (jj < QB)[:, None] & (kk < group_numel)[None, :]
        w1 = tl.load(w_ptr + jj[:, None] * E + kk[None, :], mask=wm, other=0.0)
        w = tl.reshape(tl.broadcast_to(w1[None, :, :], (ROWS, BLOCK_J, BLOCK_E)),
                       (BLOCK_G, BLOCK_E))
    else:
        g = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False,
        )
    mn, mx = _nan_minmax(x, valid)
    bmin = Q.rd(mn * expand, DTYPE)
    bmax = Q.rd(mx * expand, DTYPE)
    tl.store(base_ptr + g, bmin, mask=gmask)
    tl.store(base_ptr + G + g, bmax, mask=gmask)

    best = tl.zeros([BLOCK_G], dtype=tl.float32) + best_init
    word = tl.zeros([BLOCK_G], dtype=tl.int32)
    if BLOCK_S == 1:
        # One step per iteration (the GPU's choice): 2-D tiles, and the OR over
        # the program's groups taken once per 32 steps from their words
        # instead of at every step.
        for i in range(n_steps):
            p = _shrink(n_steps * 0 + i, grid32, grid_bits, exact32)  # a tensor on both backends
            err = _step_errors(
                x, valid, w, bmin, bmax, p, tab_ptr,
                rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX, FAST,
            )
            imp = (err < best) & gmask  # strict; NaN never improves
            best = tl.where(imp, err, best)
            word = word | (imp.to(tl.int32) << (i % 32))
            if ((i + 1) % 32 == 0) | (i + 1 >= n_steps):
                wi = i // 32
                tl.store(bits_ptr + g * n_words + wi, word, mask=gmask)
                tl.atomic_or(flags_ptr + wi, tl.reduce(word, 0, _or))
                word = word * 0
    else:
        fword = tl.max(word, axis=0)
        one = tl.arange(0, 1)
        for i0 in range(0, n_steps, BLOCK_S):
            si = i0 + tl.arange(0, BLOCK_S)
            smask = si < n_steps
            err = _block_errors(
                x, valid, w, bmin, bmax, si, smask,
                rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits, exact32,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX,
            )
            imp, best = _improved(err, best, gmask[:, None] & smask[None, :])
            # BLOCK_S divides 32, so a block never straddles two words; distinct
            # bits add without carries, so the sums are ORs
            sh = si % 32
            word = word | tl.sum(imp.to(tl.int32) << sh[None, :], axis=1)
            fword = fword | tl.sum(tl.max(imp.to(tl.int32), axis=0) << sh, axis=0)
            # flush after bit 31 and after the last step (vector masks: the
            # interpreter rejects scalar-bool store masks)
            i_end = i0 + BLOCK_S
            endv = ((word * 0 + i_end) % 32 == 0) | (word * 0 + i_end >= n_steps)
            wi = i0 // 32
            tl.store(bits_ptr + g * n_words + wi, word, mask=gmask & endv)
            fv = fword + one * 0
            end1 = ((one + i_end) % 32 == 0) | (one + i_end >= n_steps)
            tl.atomic_or(flags_ptr + wi + one, fv, mask=end1 & (fv != 0))
            word = tl.where(endv, 0, word)
            fword = tl.where((i_end % 32 == 0) | (i_end >= n_steps), 0, fword)


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
def _last_improving(bits_ptr, g, gmask, n_words, S):
    """Each group's last improving step <= S from its bits (-1 if none)."""
    choice = tl.full(g.shape, -1, tl.int32)
    for wi in range(n_words):
        word = tl.load(bits_ptr + g * n_words + wi, mask=gmask, other=0, volatile=True)
        keep = S - wi * 32 + 1  # bits 0 .. keep-1 of this word are steps <= S
        lowmask = tl.where(keep >= 32, -1, (1 << tl.minimum(tl.maximum(keep, 0), 31)) - 1)
        word = word & lowmask
        choice = tl.where(word != 0, wi * 32 + _high_bit(word), choice)
    return choice


@triton.jit(do_not_specialize=_PER_CALL)
def _choose_kernel(
    bits_ptr, flags_ptr, base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr,
    G, n_steps, n_words, patience,
    DTYPE: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """One program: BLOCK_G groups. S from the OR-ed flags (every program
    computes the same S), then each group's last improving step <= S:
    out = rd(base * p_step), or base when the group never improved."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < G
    S = _stop_step(flags_ptr, n_steps, patience)
    choice = _last_improving(bits_ptr, g, gmask, n_words, S)
    _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                  choice, DTYPE)


@triton.jit
def _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                  choice, DTYPE: tl.constexpr):
    """out = rd(base * p[choice]) of groups g, or the base where choice < 0."""
    bmin = tl.load(base_ptr + g, mask=gmask, other=0.0, volatile=True)
    bmax = tl.load(base_ptr + G + g, mask=gmask, other=0.0, volatile=True)
    p = _shrink(tl.maximum(choice, 0), grid32, grid_bits, exact32)
    omin = tl.where(choice >= 0, Q.rd(bmin * p, DTYPE), bmin)
    omax = tl.where(choice >= 0, Q.rd(bmax * p, DTYPE), bmax)
    # values are exact in the output dtype, so the store's cast cannot round
    tl.store(out_min_ptr + g, omin.to(out_min_ptr.dtype.element_ty), mask=gmask)
    tl.store(out_max_ptr + g, omax.to(out_max_ptr.dtype.element_ty), mask=gmask)


@triton.jit(do_not_specialize=_PER_CALL)
def _minmax_part_kernel(
    x_ptr, part_ptr, tickets_ptr, flags_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split, n_words,
    PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (g, k): NaN-propagating min/max of split k of group g (chunks
    k*cps .. (k+1)*cps - 1) -> part_ptr[0 or 1, g, k]. It also clears what
    the search launch counts and ORs into (group g's ticket; program (0, 0):
    the all-groups ticket and the step flags), so the host zeroes nothing."""
    gid = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    g = gid + tl.arange(0, 1)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    mn = tl.full([1], float("inf"), tl.float32)
    mx = tl.full([1], float("-inf"), tl.float32)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, x_ptr, g, e, group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False,
        )
        cmn, cmx = _nan_minmax(x, valid)
        mn = Q.nan_min(mn, cmn)
        mx = Q.nan_max(mx, cmx)
    tl.store(part_ptr + g * K + k, mn)
    tl.store(part_ptr + G * K + g * K + k, mx)
    first = (g * 0 + k) == 0
    tl.store(tickets_ptr + g, g * 0, mask=first)
    wv = tl.arange(0, BLOCK_W)
    origin = (wv * 0 + gid + k) == 0
    tl.store(flags_ptr + wv, wv * 0, mask=origin & (wv < n_words))
    tl.store(tickets_ptr + G + wv, wv * 0, mask=origin & (wv == 0))


@triton.jit
def _finish_group(part_ptr, bits_ptr, flags_ptr, gid, K, n_steps, n_words, best_init,
                  DTYPE: tl.constexpr, IMATRIX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group gid's step errors from its K partials (blocks of BLOCK_K summed,
    then added, always in that order), rounded to DTYPE for "mse"; its
    improvement bits -> bits_ptr, OR-ed into flags_ptr (32 steps at a time)."""
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
                        other=0.0, volatile=True)
            err = err + tl.sum(v, axis=1)
        if not IMATRIX:
            err = Q.rd(err, DTYPE)
        imp, best = _improved(err[None, :], best, smask[None, :])
        word = tl.sum(imp.to(tl.int32) << j[None, :], axis=1)
        tl.store(bits_ptr + gid * n_words + wi + one, word)
        tl.atomic_or(flags_ptr + wi + one, word)


@triton.jit(do_not_specialize=_PER_CALL)
def _search_part_kernel(
    x_ptr, w_ptr, tab_ptr, grid32, grid_bits, exact32, mm_ptr, part_ptr, base_ptr,
    tickets_ptr, bits_ptr, flags_ptr, out_min_ptr, out_max_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split, n_steps, n_words, patience, expand, best_init,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_KF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SB: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (g, k): base range of group g from the K split min/max, then
    for each chunk of split k (loaded once) and each step i, the chunk's error
    added to acc[i]; acc -> part_ptr[g, k, 0:n_steps] (fp32, unrounded).

    Then two tickets (atomic counters, release/acquire) finish the search in
    this launch: the last of group g's K programs to arrive sums its
    partials in a fixed order and writes g's improvement bits and flags
    (``_finish_group``); the last group to be finished derives S and writes
    every group's choice, as ``_choose_kernel`` does. Which program arrives
    last varies; what it computes does not (fixed-order sums, OR of bits).
    """
    gid = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    g = gid + tl.arange(0, 1)
    ks = tl.arange(0, BLOCK_K)
    kmask = (ks < K)[None, :]
    pmn = tl.load(mm_ptr + g[:, None] * K + ks[None, :], mask=kmask, other=float("inf"))
    pmx = tl.load(mm_ptr + G * K + g[:, None] * K + ks[None, :], mask=kmask, other=float("-inf"))
    mn, _unused = _nan_minmax(pmn, kmask)
    _unused, mx = _nan_minmax(pmx, kmask)
    bmin = Q.rd(mn * expand, DTYPE)
    bmax = Q.rd(mx * expand, DTYPE)
    first = (g * 0 + k) == 0
    tl.store(base_ptr + g, bmin, mask=first)
    tl.store(base_ptr + G + g, bmax, mask=first)

    sid = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, e, group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, HAS_W,
        )
        if BLOCK_SB == 1:
            for i in range(n_steps):
                p = _shrink(n_steps * 0 + i, grid32, grid_bits, exact32)
                err = _step_errors(
                    x, valid, w, bmin, bmax, p, tab_ptr,
                    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
                    DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False, FAST,
                )
                acc = tl.where(sid == i, acc + tl.sum(err, axis=0), acc)
        else:
            for i0 in range(0, n_steps, BLOCK_SB):
                si = i0 + tl.arange(0, BLOCK_SB)
                smask = si < n_steps
                err = _block_errors(
                    x, valid, w, bmin, bmax, si, smask,
                    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits,
                    exact32, DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False,
                )
                e1 = tl.sum(err, axis=0)
                acc = acc + tl.sum(tl.where(sid[:, None] == si[None, :], e1[None, :], 0.0), axis=1)
    tl.store(part_ptr + (g * K + k) * n_steps + sid, acc, mask=sid < n_steps)

    # every thread's stores before the ticket (the atomic releases them)
    tl.debug_barrier()
    if tl.atomic_add(tickets_ptr + gid, 1) == K - 1:
        _finish_group(part_ptr, bits_ptr, flags_ptr, gid, K, n_steps, n_words, best_init,
                      DTYPE, IMATRIX, BLOCK_KF)
        tl.debug_barrier()
        if tl.atomic_add(tickets_ptr + G, 1) == G - 1:
            S = _stop_step(flags_ptr, n_steps, patience)
            for g0 in range(0, G, BLOCK_C):
                gg = g0 + tl.arange(0, BLOCK_C).to(tl.int64)
                gm = gg < G
                choice = _last_improving(bits_ptr, gg, gm, n_words, S)
                _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr,
                              gg, gm, G, choice, DTYPE)


# --------------------------------------------------------------------------- #
# host side
# --------------------------------------------------------------------------- #
def _norm_mode(norm: float) -> int:
    """The NORM_MODE switch: the exponents torch.pow special-cases (quant.abs_pow)."""
    special = {2.0: Q.P_SQUARE, 3.0: Q.P_CUBE, 0.5: Q.P_SQRT, 1.0: Q.P_ONE}
    return special.get(float(norm), Q.P_GENERAL).value


@functools.lru_cache(maxsize=64)
def _fp32_steps_exact(grid, n_steps: int) -> bool:
    """Whether _shrink's fp32 formula, div_rn(fp32(grid) - i, fp32(grid)),
    gives the bits of the reference's p_i = fp32(1 - i / grid) for every step
    i < n_steps. Checked here, not assumed (it holds for integer grids up to
    2^14 at least); the kernels take the fp64 formula where it does not. The
    host emulation is exact: an fp32 sum or quotient rounded once from fp64
    is the correctly rounded fp32 one."""
    f32 = torch.float32
    g = Q.round_host(grid, f32)
    if not (math.isfinite(g) and g != 0):
        return False

    def bits(x):
        return struct.pack("<f", Q.round_host(x, f32))

    return all(
        bits(Q.round_host(g - i, f32) / g) == bits(1 - i / grid) for i in range(n_steps)
    )


@functools.lru_cache(maxsize=16)
def _pow_table(device: torch.device, dtype: torch.dtype, norm: float) -> torch.Tensor:
    """torch's own ``pow(norm)`` of every 16-bit pattern of ``dtype`` (bf16 or
    fp16), computed by torch on ``device``: the values the GPU's fast pow
    falls back to near a rounding boundary (quant.pow16_hw), so the search
    rounds |d| ** norm exactly as the reference does on that device. Built
    once per (device, dtype, norm) and kept: 64 KiB."""
    bits = torch.arange(1 << 15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(dtype).pow(norm).contiguous()


def _format(args, dtype):
    """Constexpr switches and runtime constants of the quantization format, or
    KernelUnsupportedError naming what is not covered."""
    qtype = QuantizationType(args.type)
    bits = args.num_bits
    if qtype == QuantizationType.INT:
        if not 1 <= bits <= 8:
            raise KernelUnsupportedError(f"mse_search: int num_bits={bits} (kernel covers 1..8)")
        q = 0
    elif bits == 8:
        q = 1
    elif bits == 4:
        q = 2
        if not args.symmetric:
            raise KernelUnsupportedError(
                "mse_search: asymmetric fp4 (compressed-tensors does not support it either)"
            )
    else:
        raise KernelUnsupportedError(f"mse_search: float num_bits={bits} (kernel covers 4 and 8)")

    scale_kind, mx_offset = 0, 0
    if should_generate_mx_scales(args):
        if not args.symmetric:
            raise KernelUnsupportedError("mse_search: asymmetric MX scales")
        scale_kind = 2
        mx_offset = int(math.floor(math.log2(448.0 if bits == 8 else 6.0)))
        eps = 1.0
    elif args.scale_dtype is None:
        eps = torch.finfo(dtype).eps
    elif args.scale_dtype == torch.float8_e4m3fn:
        scale_kind = 1
        eps = 0.125
    else:
        raise KernelUnsupportedError(f"mse_search: scale_dtype {args.scale_dtype}")

    zp_dtype = args.zp_dtype
    if zp_dtype == torch.float8_e4m3fn:
        zp_kind, zlo, zhi = 1, -448.0, 448.0
    elif zp_dtype is not None and not zp_dtype.is_floating_point and zp_dtype != torch.bool:
        info = torch.iinfo(zp_dtype)
        zp_kind, zlo, zhi = 0, float(info.min), float(info.max)
    else:
        raise KernelUnsupportedError(f"mse_search: zp_dtype {zp_dtype}")

    # compressed-tensors' calculate_range, as Python floats: it makes fp32
    # scalars of these values, and calculate_qparams takes (q_max - q_min) in
    # the observed dtype, halves it there and rounds eps into it. All of them
    # are small integers, halves or powers of two, exact in every dtype: the
    # roundings are kept so that the constants are what torch would compute.
    if qtype == QuantizationType.INT:
        q_min, q_max = -(2.0**bits) / 2, (2.0**bits) / 2 - 1
    else:
        data = FP8_E4M3_DATA if bits == 8 else FP4_E2M1_DATA
        q_min, q_max = float(data.min), float(data.max)
    q_min, q_max = Q.round_host(q_min, torch.float32), Q.round_host(q_max, torch.float32)
    rng = Q.round_host(q_max - q_min, dtype)
    return dict(
        QTYPE=q, SCALE=scale_kind, ZP=zp_kind, SYM=bool(args.symmetric),
        rng=rng, half=Q.round_host(rng / 2, dtype), qmin=q_min, qmax=q_max,
        eps=Q.round_host(eps, dtype), zlo=zlo, zhi=zhi, mx_offset=mx_offset,
    )


def mse_search(
    value,
    base_name,
    args,
    *,
    maxshrink,
    patience,
    grid,
    norm,
    expand=1.0,
    importance=None,
    flavour="mse",
):
    """Triton twin of ``reference.mse_search`` (SPEC §4); returns (min_vals, max_vals)."""
    check_search_params(maxshrink, patience, grid, norm, expand, flavour)
    if isinstance(value, torch.Tensor) and value.numel() == 0:
        # nothing to launch (nor a layout to describe): the reference raises
        # what it raises for this empty value
        return _reference_mse_search(
            value, base_name, args, maxshrink=maxshrink, patience=patience, grid=grid,
            norm=norm, expand=expand, importance=importance, flavour=flavour,
        )
    # the reference's flatten checks, in its order; elements in its flattened order
    layout = group_layout(value, base_name, args, storage_order=False)
    if importance is not None:
        if base_name != WEIGHT or strategy_of(args) not in (S.CHANNEL, S.GROUP, S.TENSOR_GROUP):
            raise ValueError(
                "importance applies only to weights with the 'channel', 'group' or "
                f"'tensor_group' strategy, got base_name {base_name!r} and strategy "
                f"{strategy_of(args).value!r}"
            )
        broadcast_importance(importance, value, args)  # same checks, views only

    dtype = value.dtype
    qparam_args, _ = search_args(args)
    fmt = _format(qparam_args, dtype)
    imatrix = flavour == "imatrix"
    has_w = imatrix and importance is not None
    w = importance.to(torch.float32).contiguous() if has_w else value

    n_steps = num_steps(maxshrink, grid, flavour)
    dev = value.device
    # the kernels compute step i's p = fp32(1 - i / grid) themselves (_shrink):
    # no table to build on the host and copy to the device
    steps = (
        Q.round_host(grid, torch.float32),
        struct.unpack("<q", struct.pack("<d", float(grid)))[0],
        int(_fp32_steps_exact(grid, n_steps)),
    )
    err_dtype = torch.float32 if imatrix else dtype
    best_init = float(torch.finfo(err_dtype).max)
    if imatrix:
        patience_eff = patience if patience > 0 else n_steps + 1
        norm_run = Q.round_host(norm, torch.float32)
    else:
        patience_eff = max(patience, 1)  # patience 0 stops at the first stale step too
        norm_run = Q.round_host(norm, dtype)
    consts = dict(
        rng=fmt["rng"], half=fmt["half"], qmin=fmt["qmin"], qmax=fmt["qmax"],
        eps=fmt["eps"], zlo=fmt["zlo"], zhi=fmt["zhi"], mx_offset=fmt["mx_offset"],
        norm=norm_run,
    )
    switches = dict(
        DTYPE=Q.DTYPE_CODE[dtype], SYM=fmt["SYM"], QTYPE=fmt["QTYPE"], SCALE=fmt["SCALE"],
        ZP=fmt["ZP"], NORM_MODE=_norm_mode(float(norm)), IMATRIX=imatrix, HAS_W=has_w,
        PAD=layout.pad,
    )
    G, group_numel = layout.num_groups, layout.num_rows * layout.elems
    geometry = (*layout.scalar_args(), group_numel)
    out_min = torch.empty(layout.qshape, dtype=dtype, device=dev)
    out_max = torch.empty(layout.qshape, dtype=dtype, device=dev)
    base = torch.empty((2, G), dtype=torch.float32, device=dev)
    n_words = -(-n_steps // 32)
    # A GPU build fuses a * b + c into one FMA by default (the interpreter never
    # does): rd(q - zp) * scale - x and pow_pos's sums would round once, not twice.
    launch = dict(enable_fp_fusion=False)

    config = CONFIG
    # The GPU's own conversions where they are exact by definition (FAST):
    # a CUDA tensor outside the interpreter, or a compile check pinning it.
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    fast = config.gpu_arith
    if fast is None:
        fast = value.is_cuda and not interpreted
    elif fast and interpreted:
        raise KernelUnsupportedError(
            "mse_search: the GPU arithmetic (gpu_arith=True) needs a GPU build; the "
            "interpreter's casts are not the hardware's"
        )
    tab, pw0 = value, 0.0
    if fast and not imatrix and dtype != torch.float32 and switches["NORM_MODE"] == Q.P_GENERAL.value:
        tab, pw0 = _pow_table(dev, dtype, float(norm)), Q.pow_window(norm_run)
    steps_block = config.steps_per_iter
    if steps_block is None:
        steps_block = 1 if value.is_cuda else 32
    steps_block = max(1, min(steps_block, 32, triton.next_power_of_2(max(n_steps, 1))))
    if group_numel <= config.max_reg_group:
        block_e = max(triton.next_power_of_2(group_numel), 2)
        block_g = pow2_at_most(G, max(config.tile // block_e, 1))
        bits = torch.empty((G, max(n_words, 1)), dtype=torch.int32, device=dev)
        flags = torch.zeros(max(n_words, 1), dtype=torch.int32, device=dev)
        warps = num_warps_for(block_g * block_e)
        if has_w:
            # two rows or more per program share each column's importance read
            # (a tile of two whole-row groups takes twice the threads)
            qa, qb = layout.groups
            if block_g == 1 and qa > 1:
                block_g, warps = 2, 2 * warps
            block_j = min(triton.next_power_of_2(qb), max(block_g // 2, 1))
            programs = triton.cdiv(qa, block_g // block_j) * triton.cdiv(qb, block_j)
        else:
            block_j, programs = block_g, triton.cdiv(G, block_g)
        _search_kernel[(programs,)](
            value, w, tab, *steps, bits, flags, base, *geometry,
            n_steps, n_words, float(expand), best_init, **consts, pw0=pw0, **switches,
            FAST=fast, BLOCK_G=block_g, BLOCK_E=block_e, BLOCK_S=steps_block, BLOCK_J=block_j,
            num_warps=warps, **launch,
        )
        choose_g = pow2_at_most(G, 1024)
        _choose_kernel[(triton.cdiv(G, choose_g),)](
            bits, flags, base, *steps, out_min, out_max, G, n_steps, n_words, patience_eff,
            DTYPE=switches["DTYPE"], BLOCK_G=choose_g, **launch,
        )
        return out_min, out_max

    if n_steps > _MAX_SPLIT_STEPS:
        raise KernelUnsupportedError(
            f"mse_search: {n_steps} grid steps over groups of {group_numel} elements "
            f"(the split path keeps at most {_MAX_SPLIT_STEPS} step errors per program)"
        )
    chunk = config.chunk
    # K programs per group, cps chunks each; an element costs every grid step
    K, cps = choose_split(triton.cdiv(group_numel, chunk), 1, chunk * max(n_steps, 1), G,
                          dev, config)
    mm = torch.empty((2, G, K), dtype=torch.float32, device=dev)
    tickets = torch.empty(G + 1, dtype=torch.int32, device=dev)
    bits = torch.empty((G, max(n_words, 1)), dtype=torch.int32, device=dev)
    flags = torch.empty(max(n_words, 1), dtype=torch.int32, device=dev)
    _minmax_part_kernel[(G, K)](value, mm, tickets, flags, *geometry, K, cps, n_words,
                                PAD=layout.pad, BLOCK_E=chunk,
                                BLOCK_W=triton.next_power_of_2(max(n_words, 1)), **launch)
    block_k = triton.next_power_of_2(K)
    block_s = triton.next_power_of_2(max(n_steps, 1))
    part = torch.empty((G, K, max(n_steps, 1)), dtype=torch.float32, device=dev)
    _search_part_kernel[(G, K)](
        value, w, tab, *steps, mm, part, base, tickets, bits, flags, out_min, out_max,
        *geometry, K, cps, n_steps, n_words, patience_eff, float(expand), best_init,
        **consts, pw0=pw0, **switches, FAST=fast, BLOCK_E=chunk, BLOCK_K=block_k,
        BLOCK_KF=min(64, block_k), BLOCK_S=block_s, BLOCK_SB=steps_block,
        BLOCK_C=pow2_at_most(G, 1024), num_warps=8, **launch,
    )
    return out_min, out_max
