"""The step math shared by the search's kernels: one step's (or, under the
interpreter, a block of steps') errors over a tile of groups, the GPU's fake
quantization (``FAST``), improvement bits, the importance weights as they are
loaded, and a group tile's load and NaN-propagating min/max.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from obskernels.kernels import quant, quant_pow
from obskernels.kernels._layout import load_flat, widen

# Scalars that follow the search parameters (grid, maxshrink, patience) or the
# work split are not specialised on: one compiled variant per format and block
# shape, not one per grid or patience (== 1 and % 16 would each make one).
# Group counts and sizes stay specialised: % 16 lets the compiler vectorise
# the masks and saves registers (28 of 108 in int4 group-128 _search_kernel).
_PER_CALL = ["lim_r", "lim_e", "n_steps", "n_words", "patience", "K", "chunks_per_split"]


class StepConstants(NamedTuple):
    """The format's and the error's runtime constants, one kernel argument:
    the qparams constants of ``quant.qparams`` (rng, half, qmin, qmax, eps,
    zlo, zhi, mx_offset), the norm (rounded as the reference's pow sees it)
    and the fast pow's window offset (``quant_pow.pow_window``, GPU only). Floats
    are never specialised; ``mx_offset`` is, as it was as its own argument."""

    rng: float
    half: float
    qmin: float
    qmax: float
    eps: float
    zlo: float
    zhi: float
    mx_offset: int
    norm: float
    pw0: float



@triton.jit
def _block_errors(
    x, valid, w, bmin, bmax, si, smask, c, shrink_ptr,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr, ABS_BASE: tl.constexpr = False,
):
    """Errors [BG, SB] of the steps si [SB] over the tile x [BG, BE]: fp32 sums,
    rounded to DTYPE when ROUND_SUM (a whole group, flavour "mse"). Candidate: rd(base * p_i)
    (ABS_BASE: see _candidate_qparams); p_i is shrink_ptr[i]."""
    p = tl.load(shrink_ptr + si, mask=smask, other=1.0)
    scale, zp = _candidate_qparams(bmin[:, None], bmax[:, None], p[None, :], c,
                                   DTYPE, SYM, SCALE, ZP, False, ABS_BASE)
    x3 = x[:, None, :]
    dq = quant.fake_quant(x3, scale[:, :, None], zp[:, :, None], c.qmin, c.qmax, DTYPE, QTYPE)
    if IMATRIX:
        err = quant_pow.abs_pow(tl.abs(dq - x3), c.norm, NORM_MODE, quant.F32)
        if HAS_W:
            err = err * w[:, None, :]
    else:
        err = quant_pow.abs_pow(tl.abs(quant.rd(dq - x3, DTYPE)), c.norm, NORM_MODE, DTYPE)
    # NaN * 0 would leak from tile slots outside the group: select, not multiply
    err = tl.where(valid[:, None, :], err, 0.0)
    err = tl.sum(err, axis=2)
    if ROUND_SUM:
        err = quant.rd(err, DTYPE)
    return err



@triton.jit
def _or(a, b):
    return a | b



# The GPU's conversions of the fake quantization (FAST only): ``cvt.rni`` is
# torch.round (half to even); ``cvt.rn.satfinite.e4m3x2`` rounds to nearest
# even e4m3 (its inputs are clamped to +-448 first: saturation never acts).
@triton.jit
def _rd_bf16_pair_hw(x):
    """rd(x, BF16) by ``cvt.rn.bf16x2.f32``, two elements per conversion: the
    FP32 pipe's packing conversion (F2FP) instead of one F2F each on the
    slow conversion pipe; same rounding (nearest even). GPU only. The
    conversion puts its first operand in the upper half, and triton's packed
    result holds element 0 in the lower half: hence $2 before $1."""
    h = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                  is_pure=True, pack=2)
    return h.to(tl.float32)


@triton.jit
def _rint_hw(x):
    """torch.round (half to even) by ``cvt.rni`` (GPU only)."""
    return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _round_fp8e4m3_hw(v):
    """round_fp8e4m3() by the hardware conversion, |v| <= 448 or NaN (GPU only)."""
    return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _quot_f16_hw(x, r):
    """x * r for fp16 x and r = div_rn(1, s), s a positive fp16 scale (or NaN,
    inf): rd_f16 of it is rd_f16(div_rn(x, s)) wherever that quotient is an
    fp16 normal (|x / s| >= 2^-14), NaN and inf included (GPU only).

    Why (as quot_bf16_hw's, with 11-bit significands): x * r is x / s within
    (1 + 2^-24)^2 - 1 relative (r and the product correctly rounded; s >=
    2^-24 keeps r <= 2^24, x * r <= 2^40). A rounding boundary M = K 2^c, K
    odd, 2^11 < K < 2^12, is at least |M| / (Y K) > |M| 2^-23 (1 + 2^-11)
    from x / s (x = X 2^a, s = Y 2^b, |X|, Y < 2^11), more than that error.
    Below 2^-14 fp16 is subnormal and a quotient can be a tie; there the two
    values differ by an fp16 subnormal step at most, and the fake
    quantization rounds both the same way: to 0 (a zero point of 0), or to
    the zero point, whose fp16 or fp8 neighbours are 2^-11 of it or more
    away. tests/kernels/test_kernels_quant.py checks every fp16 x against scales of
    every binade."""
    return x * r


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
    if DTYPE == quant.BF16:
        # bf16 x and scale: one reciprocal per group, a product per element,
        # whose bf16 rounding is the quotient's (quant.quot_bf16_hw's proof)
        lift, r = quant.recip_hw(scale)
        y = _rd_bf16_pair_hw(quant.quot_bf16_hw(x, lift, r))
    elif DTYPE == quant.F16:
        # fp16 x and scale: a reciprocal per group, a product per element
        # (_quot_f16_hw's argument)
        y = quant.rd_hw(_quot_f16_hw(x, tl.math.div_rn(scale * 0.0 + 1.0, scale)), DTYPE)
    else:
        y = quant.rd_hw(tl.math.div_rn(x, scale), DTYPE)
    if not SYM:
        y = quant.rd_hw(y + zp, DTYPE)
    y = tl.minimum(tl.maximum(y, qmin), qmax)
    if QTYPE == quant.Q_FP8:
        q = _round_fp8e4m3_hw(y)
    elif QTYPE == quant.Q_FP4:
        q = quant.round_fp4e2m1(y)  # clamped to [-6, 6] above
    else:
        q = _rint_hw(y)
    if SYM:
        qz = q
    elif QTYPE == quant.Q_INT:
        qz = q - zp
    else:
        qz = quant.rd_hw(q - zp, DTYPE)
    return quant.rd_hw(qz * scale, DTYPE)



@triton.jit
def _candidate_qparams(bmin, bmax, p, c, DTYPE: tl.constexpr, SYM: tl.constexpr,
                       SCALE: tl.constexpr, ZP: tl.constexpr, FAST: tl.constexpr,
                       ABS_BASE: tl.constexpr = False):
    """(scale, zero point) of the candidate range rd(bmin * p), rd(bmax * p)
    (p > 0). Symmetric: the scale depends on the range's absolute maximum
    only, quant.abs_max(cmin, cmax). As the product and the rounding are monotonic
    and odd (and rd(0) = 0) that is rd(quant.abs_max(bmin, bmax) * p): with
    ABS_BASE the caller passes quant.abs_max(bmin, bmax) as bmin (bmax unused),
    computed once per group, and a step takes one product and one rounding
    per group instead of two."""
    if SYM and ABS_BASE:
        amax = quant.rd_any(bmin * p, DTYPE, FAST)
        scale = quant.sym_scale(amax, c.half, c.eps, c.mx_offset, DTYPE, SCALE, FAST)
        return scale, tl.zeros_like(scale)
    return quant.qparams(
        quant.rd_any(bmin * p, DTYPE, FAST), quant.rd_any(bmax * p, DTYPE, FAST),
        c.rng, c.half, c.qmin, c.qmax, c.eps, c.zlo, c.zhi, c.mx_offset,
        DTYPE, SYM, SCALE, ZP, FAST,
    )


@triton.jit
def _step_errors(
    x, valid, w, bmin, bmax, p, tab_ptr, c,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr, FAST: tl.constexpr, ABS_BASE: tl.constexpr = False,
):
    """Errors [BG] of ONE step (shrink p, a scalar) over the tile x [BG, BE]:
    the same arithmetic as _block_errors on 2-D tiles, so the per-group sums
    keep the load's layout (each thread adds its own run of a group before
    any shuffle). FAST: the GPU's conversions (quant.py, GPU arithmetic)."""
    scale, zp = _candidate_qparams(bmin, bmax, p, c, DTYPE, SYM, SCALE, ZP, FAST, ABS_BASE)
    if FAST:
        dq = _fake_quant_hw(x, scale[:, None], zp[:, None], c.qmin, c.qmax, DTYPE, SYM, QTYPE)
        if IMATRIX:
            err = quant_pow.abs_pow_hw(tl.abs(dq - x), c.norm, c.pw0, tab_ptr, NORM_MODE,
                                   quant.F32, quant.F32)
            if HAS_W:
                err = err * w
        else:
            d = tl.abs(quant.rd_hw(dq - x, DTYPE))
            err = quant_pow.abs_pow_hw(d, c.norm, c.pw0, tab_ptr, NORM_MODE, DTYPE, DTYPE)
    else:
        dq = quant.fake_quant(x, scale[:, None], zp[:, None], c.qmin, c.qmax, DTYPE, QTYPE)
        if IMATRIX:
            err = quant_pow.abs_pow(tl.abs(dq - x), c.norm, NORM_MODE, quant.F32)
            if HAS_W:
                err = err * w
        else:
            err = quant_pow.abs_pow(tl.abs(quant.rd(dq - x, DTYPE)), c.norm, NORM_MODE, DTYPE)
    err = tl.sum(tl.where(valid, err, 0.0), axis=1)
    if ROUND_SUM:
        if FAST:
            err = quant.rd_hw(err, DTYPE)
        else:
            err = quant.rd(err, DTYPE)
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
def _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W: tl.constexpr):
    """(divisor, usable) of raw importance (NORM_W): the reference's fp32
    mean(w) + tiny, the mean being torch's own (one value, computed by the
    launcher), and whether the verdict at wcode_ptr lets the search use it."""
    if NORM_W:
        c = tl.load(wmean_ptr) + tiny
        ok = tl.load(wcode_ptr) == 0
    else:
        c = tiny
        ok = True
    return c, ok



@triton.jit
def _importance_weights(w, c, ok, NORM_W: tl.constexpr):
    """Search weights from loaded importance w. NORM_W: w is the raw E[x²]
    (kernels/importance.py) and the weight is w / c correctly rounded
    (div_rn), as the reference's fp32 division; 1.0, which leaves every
    error as it is, where the importance is not usable (``_importance_norm``)."""
    if NORM_W:
        w = tl.where(ok, tl.math.div_rn(w, c + tl.zeros_like(w)), 1.0)
    return w



@triton.jit
def _load_group(
    x_ptr, w_ptr, g, k, group_numel,
    G, NR, lim_r, lim_e, geo,
    PAD: tl.constexpr, HAS_W: tl.constexpr, FAST: tl.constexpr,
):
    """Elements k of groups g as an fp32 tile [len(g), len(k)] (k: position in
    the reference's flattened group, see ``_layout.load_flat``), the importance
    of each element's input column (HAS_W; else x again), and which slots are
    group elements (the padding zeros of a partial block are)."""
    valid = (g < G)[:, None] & (k < group_numel)[None, :]
    x, col = load_flat(
        x_ptr, x_ptr, g[:, None], k[None, :], valid,
        geo, NR, lim_r, lim_e, PAD, False,
    )
    if FAST:
        # the GPU's own widening is exact (subnormals too); in the step loop
        # sm_90a keeps it cheaper than the bit form (int4 g128: 58.3 vs 60.8
        # SASS per element and step)
        x = x.to(tl.float32)
    else:
        x = widen(x)  # bf16 through its bits: the interpreter's cast gets subnormals wrong
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
