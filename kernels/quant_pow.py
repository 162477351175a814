"""|d| ** norm as torch computes it, the search's error term (kernels/quant.py
holds the roundings it ends with).

``abs_pow``: the exact emulation every backend can run (torch's special
exponents, otherwise ``pow_pos``, within a few fp32 ulp, then rounded into
the dtype). ``abs_pow_hw``: the GPU's (FAST only, never the interpreter): the
special exponents as CUDA torch computes them, fp32 pow by libdevice powf
(the function CUDA torch calls), and 16-bit pow by the MUFU with torch's own
pow as a table where the fast value might round differently (``pow16_hw``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from obskernels.kernels.quant import BF16, F32, pow2i, rd, rd_hw

# |d| ** norm, chosen from the norm's value the way torch.pow special-cases it
P_GENERAL: tl.constexpr = tl.constexpr(0)
P_SQUARE: tl.constexpr = tl.constexpr(1)
P_CUBE: tl.constexpr = tl.constexpr(2)
P_SQRT: tl.constexpr = tl.constexpr(3)
P_ONE: tl.constexpr = tl.constexpr(4)


@triton.jit
def pow_pos(d, n):
    """d ** n for d >= 0 in fp32, within a few ulp, without libdevice.

    d = m * 2^e with m in [1, 2): n * log2(d) = n*e + n*log2(m). The product
    n*e is taken exactly as two: n = n_hi + n_lo, the top 12 bits of n's
    significand and the rest, each times e (an integer of at most 8 bits)
    without a rounding; its integer part k is taken out before exp2, so
    exp2 only sees [0, 1) and the result is 2^f * 2^k. No fma: triton 3.8's
    interpreter and older round one twice. d = 0 gives 0, inf gives inf,
    NaN stays NaN.
    """
    tiny = d < 1.1754943508222875e-38
    ds = tl.where(tiny, d * 16777216.0, d)
    bits = ds.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127 - tl.where(tiny, 24, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    lg = tl.math.log2(m)
    ef = e.to(tl.float32)
    nf = tl.full([], n, tl.float32)  # a tensor also where n is a host float (the interpreter's)
    n_hi = (nf.to(tl.uint32, bitcast=True) & 0xFFFFF000).to(tl.float32, bitcast=True)
    a = n_hi * ef  # exact: 12 x 8 significant bits, a multiple of ulp(n_hi)
    c = (nf - n_hi) * ef + n * lg  # (n_lo * e, exact) + n log2(m)
    k = tl.floor(a + c)
    f = (a - k) + c  # a - k exact: both multiples of ulp(n_hi), |a - k| < |c| + 1
    r = tl.math.exp2(f)
    kc = tl.minimum(tl.maximum(k, -252.0), 254.0).to(tl.int32)
    k1 = kc >> 1
    r = (r * pow2i(k1)) * pow2i(kc - k1)
    r = tl.where(d == 0, 0.0, r)
    r = tl.where(d == float("inf"), d, r)
    return tl.where(d != d, d, r)


@triton.jit
def abs_pow(d, n, MODE: tl.constexpr, DTYPE: tl.constexpr):
    """torch ``d.pow(norm)`` for d >= 0 held in DTYPE, rounded into DTYPE.

    torch special-cases the exponents 2 (d*d), 3 (d*d*d: bf16 rounds the inner
    product, fp16/fp32 do not) and 0.5 (sqrt); otherwise it calls pow with the
    exponent rounded to the dtype (``n`` is passed already rounded).
    """
    if MODE == P_SQUARE:
        r = rd(d * d, DTYPE)
    elif MODE == P_CUBE:
        if DTYPE == BF16:
            r = rd(rd(d * d, DTYPE) * d, DTYPE)
        else:
            r = rd((d * d) * d, DTYPE)
    elif MODE == P_SQRT:
        r = rd(tl.sqrt_rn(d), DTYPE)
    elif MODE == P_ONE:
        r = d
    else:
        r = rd(pow_pos(d, n), DTYPE)
    return r


# ----- the GPU (FAST) ---------------------------------------------------------- #
@triton.jit
def lg2_approx(x):
    """MUFU log2 (``lg2.approx.ftz.f32``): subnormal inputs read as 0 (-> -inf)."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def ex2_approx(x):
    """MUFU 2^x (``ex2.approx.ftz.f32``): subnormal results flush to 0."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


# Window of the fast pow (pow16_hw), in fp32 ulps of the result, as
# W0 + W1 * |t| with t = n * log2(d); ``pow_window`` gives W0 for an exponent.
POW_W1: tl.constexpr = tl.constexpr(2.25)


def pow_window(n: float) -> float:
    """W0 of pow16_hw's window for exponent ``n`` (host side, a runtime scalar).

    Bounds assumed (the PTX ISA documents lg2.approx.f32 to 2^-22.6 absolute
    and ex2.approx.f32 to about 2 ulp; CUDA documents powf within a few ulp;
    each is taken here with a margin of 2x or more):
      |lg2(d) - log2(d)| <= 2^-21 + |log2 d| * 2^-23,
      |ex2(t) / 2^t - 1| <= 2^-21,
      torch's pow on the device within 8 ulp of the exact d^n.
    With t = fp32(n * lg2(d)): |t - n log2 d| <= n 2^-21 + |t| 2^-22.4, so the
    fast result is within ln2 (n 2^-21 + |t| 2^-22.4) + 2^-21 relative of d^n,
    i.e. within 2^24 times that in ulps: 5.6 n + 8 + 2.15 |t|. Adding torch's
    8 ulp and 1 for the final comparison gives W0 = 5.6 n + 17, W1 = 2.25.
    """
    return 5.6 * abs(float(n)) + 17.0


@triton.jit
def pow16_hw(d, n, w0, tab_ptr, DTYPE: tl.constexpr):
    """torch's ``d.pow(n)`` for d >= 0 held in bf16 / fp16, rounded into it (GPU only).

    Fast path: r = ex2(n * lg2(d)) on the MUFU, then rd(r). ``tab_ptr`` holds
    torch's own pow of every 16-bit pattern, computed by torch on this device
    and widened to fp32
    (the launcher's ``_pow_table``): the element takes the table's value when
    the fast r lies within the window W = w0 + POW_W1 * |t| (ulps, see
    ``pow_window``) of a rounding boundary of the dtype (then r and torch's
    pow might round differently), or when t is outside the range where the
    boundaries are the fixed bit patterns tested below (subnormal or
    overflowing results, d = 0, inf, NaN, subnormal d read as 0 by the MUFU).
    Elsewhere both lie strictly inside one rounding interval and round to
    the same value. The table is read only by those lanes (``_gather_hw``, a
    predicated load): a few per mille of the elements.

    Rounding boundaries of a positive fp32 r, as bit patterns: into bf16 the
    midpoints have low 16 bits 0x8000; into fp16 (results in [2^-14, 65504])
    low 13 bits 0x1000. Bit patterns of positive floats are monotone, and a
    window of W ulps never reaches the next midpoint (2^15 or 2^12 away).
    """
    t = n * lg2_approx(d)
    r = ex2_approx(t)
    bits = r.to(tl.int32, bitcast=True)
    # off = (low bits) - midpoint as an fp32, without an int -> float
    # conversion (the MUFU's slow pipe): the low bits put into the mantissa of
    # 2^23 (one byte permute) give the float 2^23 + low exactly, and
    # subtracting 2^23 + midpoint is exact (an integer below 2^16), so off
    # equals float(low - midpoint).
    if DTYPE == BF16:
        off = _low16_over_2p23(bits) - 8421376.0
        inside = (t > -125.0) & (t < 127.0)
        # d >= 0 with its sign bit clear (callers pass an abs()): no mask
        idx = d.to(tl.uint32, bitcast=True) >> 16
    else:
        off = ((bits & 0x1FFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8392704.0
        inside = (t > -13.9) & (t < 15.9)
        idx = d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    # |off| <= w0 + POW_W1 |t| as one FMA, |off| - POW_W1 |t| <= w0: rounded
    # once, and rounding is monotonic, so every r inside the window is caught
    near = tl.fma(tl.abs(t), -POW_W1, tl.abs(off)) <= w0
    slow = near | (not inside)
    if DTYPE == BF16:
        # where the fast value is used it is not within a window of a
        # midpoint (no tie) and is a normal number: nearest-even into bf16 is
        # adding half a bf16 ulp to the bits and truncating (integer pipe, no
        # conversion)
        fast = ((bits + 0x8000) & -65536).to(tl.float32, bitcast=True)
    else:
        fast = rd_hw(r, DTYPE)
    # the table's value where slow, else the fast one
    return _gather_hw(tab_ptr + idx, slow, fast)


@triton.jit
def _gather_hw(ptrs, mask, other):
    """fp32 ``*ptrs`` where ``mask``, else ``other`` (fp32), by a predicated
    ``ld.global.nc`` into a register holding ``other`` (GPU only; the table
    is read-only for the kernel's lifetime): no select after the load. An
    elementwise op keeps its operands' layout: a tl.load of these data-
    dependent addresses takes the layout triton's coalescing pass gives it,
    which triton 3.6 makes unlike the tile's, so every step converted three
    tiles through shared memory (16 KB each at int4 group 128)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, $2; @p ld.global.nc.b32 $0, [$1]; }",
        "=r,l,r,r", [ptrs.to(tl.int64), other.to(tl.int32, bitcast=True), mask.to(tl.int32)],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _low16_over_2p23(bits):
    """The fp32 2^23 + (bits & 0xFFFF): the low half of ``bits`` under the
    high half of 0x4B000000, by one ``prmt`` (GPU only)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4B000000, 0x7610;", "=r,r", [bits],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def abs_pow_hw(d, n, w0, tab_ptr, MODE: tl.constexpr, DTYPE: tl.constexpr, ERR_DTYPE: tl.constexpr):
    """abs_pow() as torch computes it on a CUDA device (GPU only).

    CUDA torch (PowKernel.cu) computes the special exponents in the tensor's
    dtype, each product rounded into it (fp16 cube included, unlike the CPU),
    and otherwise pow of the values converted to fp32 with the exponent
    rounded to the dtype, result rounded into the dtype. ERR_DTYPE is the
    dtype of the error tensor (F32 for the imatrix flavour, whose differences
    are fp32 values). Read from torch's CUDA source and compiled here, never
    run: equality with CUDA torch is to be confirmed on a GPU (the bf16 / fp16
    general exponent least depends on it: its fallback is torch's own pow).
    """
    if MODE == P_SQUARE:
        r = rd_hw(d * d, ERR_DTYPE)
    elif MODE == P_CUBE:
        r = rd_hw(rd_hw(d * d, ERR_DTYPE) * d, ERR_DTYPE)
    elif MODE == P_SQRT:
        r = rd_hw(tl.sqrt_rn(d), ERR_DTYPE)
    elif MODE == P_ONE:
        r = d
    elif ERR_DTYPE == F32:
        # the CUDA math library's powf, which torch's fp32 pow calls
        r = tl.extra.cuda.libdevice.pow(d, n)
    else:
        r = pow16_hw(d, n, w0, tab_ptr, ERR_DTYPE)
    return r
