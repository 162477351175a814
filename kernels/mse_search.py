"""Fused MSE shrink-grid search (docs/spec.md §4), exact global patience.

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
  many observations): ``_minmax_part_kernel`` takes each split's min/max,
  ``_search_part_kernel`` has each (group, split) program evaluate every step
  over its chunks and write the per-(group, split, step) partial errors, and
  the single-program ``_finalize_part_kernel`` sums them in a fixed order,
  derives the improvement bits, S and the choices.
  Launches: 3; the input is read twice.
Both are deterministic: sums run in a fixed order, only the OR is atomic.
Host side, besides the importance checks (one read): no host read, no copy to
the device, and one aten op (zeroing the flags of the first layout). The
format's constants are Python floats (``quant.round_host``) and each step's
shrink factor is computed by the kernels (``_shrink``).
"""

from __future__ import annotations

import functools
import math
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
    store_exact,
    widen,
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
    x = widen(x)
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
    x_ptr, w_ptr, grid32, grid_bits, exact32, bits_ptr, flags_ptr, base_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    n_steps, n_words, expand, best_init,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program: BLOCK_G whole groups [BLOCK_G, BLOCK_E] in registers.

    base = rd(amin * expand), rd(amax * expand) -> base_ptr[2, G];
    for every step i (BLOCK_S steps at a time: 1 on a GPU, more under the
    interpreter, whose cost is per operation): err_i per group (rounded to
    DTYPE for "mse"),
    improved = err_i < best (strict; NaN never), best updated;
    bit i of group g -> bits_ptr[g, i // 32]; the OR over this program's
    groups -> atomic OR into flags_ptr[i // 32].
    """
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < G
    x, w, valid = _load_group(
        x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
        G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, HAS_W,
    )
    mn, mx = _nan_minmax(x, valid)
    bmin = Q.rd(mn * expand, DTYPE)
    bmax = Q.rd(mx * expand, DTYPE)
    tl.store(base_ptr + g, bmin, mask=gmask)
    tl.store(base_ptr + G + g, bmax, mask=gmask)

    best = tl.zeros([BLOCK_G], dtype=tl.float32) + best_init
    word = tl.zeros([BLOCK_G], dtype=tl.int32)
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
        f = (tl.load(flags_ptr + i // 32) >> (i % 32)) & 1
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
    choice = tl.full([BLOCK_G], -1, tl.int32)
    for wi in range(n_words):
        word = tl.load(bits_ptr + g * n_words + wi, mask=gmask, other=0)
        keep = S - wi * 32 + 1  # bits 0 .. keep-1 of this word are steps <= S
        lowmask = tl.where(keep >= 32, -1, (1 << tl.minimum(tl.maximum(keep, 0), 31)) - 1)
        word = word & lowmask
        choice = tl.where(word != 0, wi * 32 + _high_bit(word), choice)
    _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                  choice, DTYPE)


@triton.jit
def _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                  choice, DTYPE: tl.constexpr):
    """out = rd(base * p[choice]) of groups g, or the base where choice < 0."""
    bmin = tl.load(base_ptr + g, mask=gmask, other=0.0)
    bmax = tl.load(base_ptr + G + g, mask=gmask, other=0.0)
    p = _shrink(tl.maximum(choice, 0), grid32, grid_bits, exact32)
    omin = tl.where(choice >= 0, Q.rd(bmin * p, DTYPE), bmin)
    omax = tl.where(choice >= 0, Q.rd(bmax * p, DTYPE), bmax)
    # values are exact in the output dtype, so the store's cast cannot round
    store_exact(out_min_ptr + g, omin, gmask)
    store_exact(out_max_ptr + g, omax, gmask)


@triton.jit(do_not_specialize=_PER_CALL)
def _minmax_part_kernel(
    x_ptr, part_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split,
    PAD: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Program (g, k): NaN-propagating min/max of split k of group g (chunks
    k*cps .. (k+1)*cps - 1) -> part_ptr[0 or 1, g, k]."""
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


@triton.jit(do_not_specialize=_PER_CALL)
def _search_part_kernel(
    x_ptr, w_ptr, grid32, grid_bits, exact32, mm_ptr, part_ptr, base_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split, n_steps, expand,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_SB: tl.constexpr,
):
    """Program (g, k): base range of group g from the K split min/max, then
    for each chunk of split k (loaded once) and each step i, the chunk's error
    added to acc[i]; acc -> part_ptr[g, k, 0:n_steps] (fp32, unrounded)."""
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
        for i0 in range(0, n_steps, BLOCK_SB):
            si = i0 + tl.arange(0, BLOCK_SB)
            smask = si < n_steps
            err = _block_errors(
                x, valid, w, bmin, bmax, si, smask,
                rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits, exact32,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False,
            )
            e1 = tl.sum(err, axis=0)
            acc = acc + tl.sum(tl.where(sid[:, None] == si[None, :], e1[None, :], 0.0), axis=1)
    tl.store(part_ptr + (g * K + k) * n_steps + sid, acc, mask=sid < n_steps)


@triton.jit
def _step_improved(part_ptr, g, gmask, ks, K, n_steps, i, best,
                   DTYPE: tl.constexpr, IMATRIX: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """err[g, i] = sum over k of part[g, k, i] (blocks of BLOCK_K, always in
    the same order), rounded to DTYPE for "mse"; returns (err < best, new best)."""
    err = tl.zeros([BLOCK_G], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        m = gmask[:, None] & (kk < K)[None, :]
        v = tl.load(part_ptr + (g[:, None] * K + kk[None, :]) * n_steps + i, mask=m, other=0.0)
        err = err + tl.sum(v, axis=1)
    if not IMATRIX:
        err = Q.rd(err, DTYPE)
    imp = (err < best) & gmask
    return imp, tl.where(imp, err, best)


@triton.jit(do_not_specialize=_PER_CALL)
def _finalize_part_kernel(
    part_ptr, base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr,
    G, K, n_steps, patience, best_init,
    DTYPE: tl.constexpr, IMATRIX: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Single program. Pass 1 ORs the improvement bits of every group per step
    into flags and finds the stop step S from them; pass 2 recomputes the
    same errors (no [G, n_steps] buffer) and keeps each group's last
    improving step <= S."""
    sid = tl.arange(0, BLOCK_S)
    ks = tl.arange(0, BLOCK_K)
    flags = tl.zeros([BLOCK_S], dtype=tl.int32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G).to(tl.int64)
        gmask = g < G
        best = tl.zeros([BLOCK_G], dtype=tl.float32) + best_init
        for i in range(n_steps):
            imp, best = _step_improved(part_ptr, g, gmask, ks, K, n_steps, i, best,
                                       DTYPE, IMATRIX, BLOCK_G, BLOCK_K)
            flags = tl.where(sid == i, flags | tl.max(imp.to(tl.int32), axis=0), flags)
    stop = n_steps * 0 - 1
    stale = n_steps * 0
    for i in range(n_steps):
        f = tl.sum(tl.where(sid == i, flags, 0), axis=0)
        stop, stale = _patience_step(stop, stale, i, f != 0, patience)
    S = tl.where(stop < 0, n_steps - 1, stop)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G).to(tl.int64)
        gmask = g < G
        best = tl.zeros([BLOCK_G], dtype=tl.float32) + best_init
        choice = tl.full([BLOCK_G], -1, tl.int32)
        for i in range(n_steps):
            imp, best = _step_improved(part_ptr, g, gmask, ks, K, n_steps, i, best,
                                       DTYPE, IMATRIX, BLOCK_G, BLOCK_K)
            choice = tl.where(imp & (i <= S), i, choice)
        _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                      choice, DTYPE)


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
    """Triton twin of ``reference.mse_search`` (docs/spec.md §4); returns (min_vals, max_vals)."""
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
    steps_block = config.steps_per_iter
    if steps_block is None:
        steps_block = 1 if value.is_cuda else 32
    steps_block = max(1, min(steps_block, 32, triton.next_power_of_2(max(n_steps, 1))))
    if group_numel <= config.max_reg_group:
        block_e = max(triton.next_power_of_2(group_numel), 2)
        block_g = pow2_at_most(G, max(config.tile // block_e, 1))
        bits = torch.empty((G, max(n_words, 1)), dtype=torch.int32, device=dev)
        flags = torch.zeros(max(n_words, 1), dtype=torch.int32, device=dev)
        _search_kernel[(triton.cdiv(G, block_g),)](
            value, w, *steps, bits, flags, base, *geometry,
            n_steps, n_words, float(expand), best_init, **consts, **switches,
            BLOCK_G=block_g, BLOCK_E=block_e, BLOCK_S=steps_block,
            num_warps=num_warps_for(block_g * block_e), **launch,
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
    _minmax_part_kernel[(G, K)](value, mm, *geometry, K, cps, PAD=layout.pad, BLOCK_E=chunk,
                                **launch)
    block_k = triton.next_power_of_2(K)
    block_s = triton.next_power_of_2(max(n_steps, 1))
    part = torch.empty((G, K, max(n_steps, 1)), dtype=torch.float32, device=dev)
    _search_part_kernel[(G, K)](
        value, w, *steps, mm, part, base, *geometry, K, cps, n_steps, float(expand),
        **consts, **switches, BLOCK_E=chunk, BLOCK_K=block_k, BLOCK_S=block_s,
        BLOCK_SB=steps_block, num_warps=8, **launch,
    )
    _finalize_part_kernel[(1,)](
        part, base, *steps, out_min, out_max, G, K, n_steps, patience_eff, best_init,
        DTYPE=switches["DTYPE"], IMATRIX=imatrix,
        BLOCK_G=pow2_at_most(G, 256), BLOCK_K=min(64, block_k),
        BLOCK_S=block_s, **launch,
    )
    return out_min, out_max
