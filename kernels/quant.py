"""Triton helpers that reproduce compressed-tensors' qparams and fake quantization.

Every helper works on fp32 registers that hold values of the observed dtype
(``DTYPE``: F32, F16 or BF16) and rounds after each operation exactly where
torch rounds on the CPU: torch computes a bf16/fp16 op in fp32 and rounds the
result once into the dtype, so ``rd(op(a, b))`` with a correctly rounded fp32
``op`` reproduces it bit for bit.

Rules that keep the helpers exact on the interpreter and on a GPU (docs/spec.md §6):
- bf16 rounding by integer bit arithmetic (the interpreter's cast truncates);
  fp16 through the cast (exact on both);
- fp8 e4m3 rounding built from the exponent bits (the interpreter's cast is
  wrong when rounding carries into the next binade);
- round half-to-even through the 1.5 * 2^23 add/sub (inputs are clamped to a
  few hundred at most);
- ``div_rn`` / ``sqrt_rn`` where fp32 must be correctly rounded; no libdevice.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

# dtype codes (constexpr mode switches)
F32: tl.constexpr = tl.constexpr(0)
F16: tl.constexpr = tl.constexpr(1)
BF16: tl.constexpr = tl.constexpr(2)
# host side: the DTYPE switch of an observed torch dtype
DTYPE_CODE = {torch.float32: F32.value, torch.float16: F16.value, torch.bfloat16: BF16.value}


def round_host(x: float, dtype: torch.dtype) -> float:
    """Python float ``x`` rounded into ``dtype`` (float32, float16 or bfloat16)
    exactly as ``float(torch.tensor(x, dtype=torch.float64).to(dtype))`` rounds
    it, without a tensor: torch converts a double to fp16 / bf16 through fp32,
    so fp32 first (nearest even), then the dtype (nearest even, bf16 by the
    same bit arithmetic as ``round_bf16``); overflow gives inf. The launchers'
    scalar constants come from here, so they cost no aten op."""
    try:
        f = struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # rounds past fp32's largest finite value
        f = math.copysign(math.inf, x)
    if dtype == torch.float16:
        try:
            return struct.unpack("<e", struct.pack("<e", f))[0]
        except OverflowError:
            return math.copysign(math.inf, f)
    if dtype == torch.bfloat16 and f == f:
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype not in DTYPE_CODE:
        raise TypeError(f"round_host: dtype {dtype} (expected float32, float16 or bfloat16)")
    return f


# quantized element types
Q_INT: tl.constexpr = tl.constexpr(0)
Q_FP8: tl.constexpr = tl.constexpr(1)
Q_FP4: tl.constexpr = tl.constexpr(2)

# scale rounding after calculate_qparams' step 3/4
S_NONE: tl.constexpr = tl.constexpr(0)
S_FP8: tl.constexpr = tl.constexpr(1)  # scale_dtype float8_e4m3fn
S_MX: tl.constexpr = tl.constexpr(2)  # power-of-two E8M0 scales (uint8 scale_dtype)

# zero point rounding (zp_dtype)
Z_INT: tl.constexpr = tl.constexpr(0)
Z_FP8: tl.constexpr = tl.constexpr(1)

# |d| ** norm, chosen from the norm's value the way torch.pow special-cases it
P_GENERAL: tl.constexpr = tl.constexpr(0)
P_SQUARE: tl.constexpr = tl.constexpr(1)
P_CUBE: tl.constexpr = tl.constexpr(2)
P_SQRT: tl.constexpr = tl.constexpr(3)
P_ONE: tl.constexpr = tl.constexpr(4)

# 1.5 * 2^23. A constexpr: the GPU compiler rejects plain module globals inside
# @jit functions (the interpreter does not), so every global used there is one.
_RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def round_bf16(x):
    """Nearest-even bf16 value of fp32 ``x`` (NaN and inf kept), as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def rd(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` into DTYPE (nearest even, overflow to inf); result in fp32."""
    if DTYPE == BF16:
        return round_bf16(x)
    elif DTYPE == F16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def rne_int(x):
    """torch.round: nearest integer, ties to even, for |x| < 2^22 (NaN kept)."""
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def pow2i(k):
    """2.0 ** k for int32 k in [-149, 128] built from bits (128 -> inf)."""
    normal = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << (tl.minimum(tl.maximum(k + 149, 0), 22))).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def round_fp8e4m3(v):
    """Nearest-even float8_e4m3fn value of ``v`` (|v| <= 448 or NaN), as fp32.

    The quantum is 2^(max(e, -6) - 3) for |v| in [2^e, 2^(e+1)); scaling by a
    power of two is exact, so one integer rounding gives the fp8 value, and a
    carry into the next binade lands on the right value by itself.
    """
    a = tl.abs(v)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    qe = tl.maximum(tl.minimum(e, 8), -6) - 3
    r = rne_int(a * pow2i(-qe)) * pow2i(qe)
    r = tl.where(v < 0, -r, r)
    return tl.where(v != v, v, r)


@triton.jit
def round_fp4e2m1(v):
    """compressed-tensors' cast_to_fp4: nearest value of 0, .5, 1, 1.5, 2, 3, 4, 6
    (ties as its thresholds: to the even mantissa), sign kept, NaN kept."""
    a = tl.abs(v)
    r = tl.where(
        a <= 0.25,
        0.0,
        tl.where(
            a < 0.75,
            0.5,
            tl.where(
                a <= 1.25,
                1.0,
                tl.where(
                    a < 1.75,
                    1.5,
                    tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, 6.0))),
                ),
            ),
        ),
    )
    r = tl.where(v < 0, -r, r)
    return tl.where(v != v, v, r)


@triton.jit
def nan_min(a, b):
    """torch.min(a, b): NaN if either is NaN."""
    m = tl.where(b < a, b, a)
    return tl.where(b != b, b, m)


@triton.jit
def nan_max(a, b):
    """torch.max(a, b): NaN if either is NaN."""
    m = tl.where(b > a, b, a)
    return tl.where(b != b, b, m)


@triton.jit
def nan_clamp(x, lo, hi):
    """torch.clamp(x, lo, hi) with NaN kept."""
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def pow_pos(d, n):
    """d ** n for d >= 0 in fp32, within a few ulp, without libdevice.

    d = m * 2^e with m in [1, 2): n * log2(d) = n*e + n*log2(m). The product
    n*e is split into its rounded value and its exact error (fma) and its
    integer part k is taken out before exp2, so exp2 only sees [0, 1) and the
    result is 2^f * 2^k. d = 0 gives 0, inf gives inf, NaN stays NaN.
    """
    tiny = d < 1.1754943508222875e-38
    ds = tl.where(tiny, d * 16777216.0, d)
    bits = ds.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127 - tl.where(tiny, 24, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    lg = tl.math.log2(m)
    ef = e.to(tl.float32)
    a = n * ef
    a_err = tl.fma(n, ef, -a)
    b = n * lg
    k = tl.floor(a + b)
    f = (a - k) + (a_err + b)
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


@triton.jit
def mx_scale(amax, offset, DTYPE: tl.constexpr):
    """compressed-tensors' MX scale of a group with absolute max ``amax``.

    round_to_power_2 (add half of the element mantissa step, keep sign and
    exponent bits) -> u = clamp(127 + log2(p) - offset, 0, 255) as uint8 ->
    2^(u - 127) in DTYPE. fp16 has its own exponent range, handled apart.
    """
    bits = amax.to(tl.uint32, bitcast=True)
    p2 = ((bits + (1 << 21)) & 0xFF800000).to(tl.float32, bitcast=True)
    if DTYPE == F16:
        # fp16 subnormals round to 0 or 2^-14; >= 1.75 * 2^15 carries into inf
        p2 = tl.where(amax < 6.103515625e-05, tl.where(amax >= 4.57763671875e-05, 6.103515625e-05, 0.0), p2)
        p2 = tl.where(p2 >= 65536.0, float("inf"), p2)
    pe = ((p2.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    # log2(0) = -inf -> u = 0; log2(inf) = inf -> u = 255; NaN -> uint8 0
    u = tl.minimum(tl.maximum(pe + 127 - offset, 0), 255)
    u = tl.where(p2 == 0, 0, u)
    u = tl.where(p2 == float("inf"), 255, u)
    u = tl.where(amax != amax, 0, u)
    return rd(pow2i(u - 127), DTYPE)


@triton.jit
def _rd_any(x, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """rd(), by the hardware's conversion on the GPU (FAST)."""
    if FAST:
        return rd_hw(x, DTYPE)
    else:
        return rd(x, DTYPE)


@triton.jit
def _div_rd(a, b, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """rd(div_rn(a, b)) of DTYPE values a, b (b >= 0, or NaN); on the GPU
    (FAST) in bf16 by quot_bf16_hw, whose rounding is the same."""
    if FAST and DTYPE == BF16:
        lift, r = recip_hw(b)
        return rd_hw(quot_bf16_hw(a, lift, r), DTYPE)
    else:
        return _rd_any(tl.math.div_rn(a, b), DTYPE, FAST)


@triton.jit
def qparams(
    cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
    DTYPE: tl.constexpr, SYM: tl.constexpr, SCALE: tl.constexpr, ZP: tl.constexpr,
    FAST: tl.constexpr = False,
):
    """calculate_qparams(cmin, cmax, args, global_scale=None) in DTYPE.

    FAST (GPU only): the GPU's arithmetic, same results: hardware roundings,
    and bf16 quotients by quot_bf16_hw (rng and half are bf16 values: integers
    below 256 or their halves, 448, 6).

    mn = min(cmin, 0), mx = max(cmax, 0);
    symmetric: scale = max(|mn|, |mx|) / half (or the MX power of two), zp = 0;
    asymmetric: scale = (mx - mn) / rng, zp = clamp(qmin - mn / scale, qmin, qmax);
    scale_dtype fp8: scale rounded into e4m3; scale == 0 -> eps;
    zp rounded into zp_dtype (integers: clamp to its range, round half even;
    NaN converts to 0 as torch does on the CPU).
    """
    mn = tl.where(cmin > 0, 0.0, cmin)
    mx = tl.where(cmax < 0, 0.0, cmax)
    if SYM:
        amax = nan_max(tl.abs(mn), tl.abs(mx))
        if SCALE == S_MX:
            scale = mx_scale(amax, mx_offset, DTYPE)
        else:
            scale = _div_rd(amax, half, DTYPE, FAST)
        zp = tl.zeros_like(scale)
    else:
        scale = _div_rd(_rd_any(mx - mn, DTYPE, FAST), rng, DTYPE, FAST)
        zp = _rd_any(qmin - _div_rd(mn, scale, DTYPE, FAST), DTYPE, FAST)
        zp = nan_clamp(zp, qmin, qmax)
    if SCALE == S_FP8:
        scale = round_fp8e4m3(nan_clamp(scale, -448.0, 448.0))
    scale = tl.where(scale == 0, eps, scale)
    if ZP == Z_FP8:
        zp = round_fp8e4m3(nan_clamp(zp, -448.0, 448.0))
    else:
        zp = rne_int(nan_clamp(zp, zlo, zhi))
        zp = tl.where(zp != zp, 0.0, zp)
    return scale, zp


@triton.jit
def fake_quant(x, scale, zp, qmin, qmax, DTYPE: tl.constexpr, QTYPE: tl.constexpr):
    """_quantize_dequantize: q = round(clamp(rd(rd(x / scale) + zp))),
    result rd(rd(q - zp) * scale), every step in DTYPE."""
    y = rd(tl.math.div_rn(x, scale), DTYPE)
    y = rd(y + zp, DTYPE)
    y = nan_clamp(y, qmin, qmax)
    if QTYPE == Q_FP8:
        q = round_fp8e4m3(y)
    elif QTYPE == Q_FP4:
        q = round_fp4e2m1(y)
    else:
        q = rne_int(y)
    return rd(rd(q - zp, DTYPE) * scale, DTYPE)


# --------------------------------------------------------------------------- #
# GPU arithmetic (the launchers' FAST switch: a CUDA tensor, not the interpreter)
#
# The helpers above emulate every rounding with bit arithmetic because the
# interpreter's casts are not correctly rounded (docs/spec.md §6). On a GPU the
# hardware conversions ARE the roundings torch makes, by definition:
# ``cvt.rn.bf16.f32`` / ``cvt.rn.f16.f32`` round to nearest even,
# ``cvt.rni.f32.f32`` is round half-to-even to an integer (torch.round),
# ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even e4m3 (inputs are
# clamped to +-448 first, so saturation never acts). These helpers are only
# ever compiled for a GPU; the interpreter keeps the exact emulation above, and
# the tests compile both.
# --------------------------------------------------------------------------- #
@triton.jit
def rd_hw(x, DTYPE: tl.constexpr):
    """rd() by the hardware's round-to-nearest-even conversion (GPU only)."""
    if DTYPE == BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == F16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def rd_bf16_pair_hw(x):
    """rd(x, BF16) by ``cvt.rn.bf16x2.f32``, two elements per conversion: the
    FP32 pipe's packing conversion (F2FP) instead of one F2F each on the
    slow conversion pipe; same rounding (nearest even). GPU only. The
    conversion puts its first operand in the upper half, and triton's packed
    result holds element 0 in the lower half: hence $2 before $1."""
    h = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                  is_pure=True, pack=2)
    return h.to(tl.float32)


@triton.jit
def rint_hw(x):
    """torch.round (half to even) by ``cvt.rni`` (GPU only)."""
    return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


# quot_bf16_hw's lift: groups whose scale is below 2^-64 divide 2^64 x by
# 2^64 scale (both exact), so the reciprocal stays a normal fp32 number
_LIFT: tl.constexpr = tl.constexpr(18446744073709551616.0)  # 2^64
_LIFT_BELOW: tl.constexpr = tl.constexpr(5.421010862427522e-20)  # 2^-64


@triton.jit
def recip_hw(scale):
    """(lift, r) of quot_bf16_hw for a scale s > 0 (NaN and inf kept): lift is
    2^64 where s < 2^-64, else 1; r = div_rn(1, s * lift). Computed once per
    group and step, not per element (GPU only)."""
    lift = tl.where(scale < _LIFT_BELOW, _LIFT, 1.0)
    r = tl.math.div_rn(lift * 0.0 + 1.0, scale * lift)
    return lift, r


@triton.jit
def quot_bf16_hw(x, lift, r):
    """A quotient v of bf16 x by a bf16 scale s >= 0 (or NaN) whose bf16
    rounding is that of div_rn(x, s), from the (lift, r) of recip_hw: two
    fp32 multiplications instead of a correctly rounded division (GPU only).

    Claim: rd_bf16(v) == rd_bf16(div_rn(x, s)) for every bf16 x (inf, NaN,
    subnormals included) and every such s.

    Why. v = fp32(fp32(x * lift) * r) is x / s within 2^-23 relative (x * lift
    is exact, r and the product are correctly rounded, lift keeps r normal;
    a huge s makes r subnormal, which costs at most 2^-22 more; overflow
    gives inf where x / s is past the largest fp32 value too). A bf16
    rounding boundary (a midpoint) of magnitude >= 2^-126 is M = K 2^c with K
    odd, 2^8 < K < 2^9; x = X 2^a, s = Y 2^b with integers |X|, Y < 2^8. So
    x / s - M = (X 2^a - Y K 2^(b+c)) / s is never 0 (the odd part of Y K is
    >= K > 2^8 > |X|'s) and, the numerator being a non-zero multiple of
    2^min(a, b+c), at least 1 / (Y K) > 2^-17 of |M| away. An approximation
    within 2^-23 of x / s therefore lies between the same two midpoints as
    x / s and as div_rn(x, s), and rounds to the same bf16 value. s = 0
    gives r = inf and s = inf gives r = 0: x * inf and x * 0 are the
    quotient's inf, 0 and NaN, signs included. Quotients below 2^-126 (where
    fp32 keeps 2^-149 steps) are covered by the check: an emulation of these
    instructions over every bf16 x and every positive bf16 s (2^31 pairs)
    finds no difference; tests/test_kernels_quant.py runs it over every x
    and the scales of 25 binades, 0 and NaN.
    """
    return (x * lift) * r


@triton.jit
def round_fp8e4m3_hw(v):
    """round_fp8e4m3() by the hardware conversion, |v| <= 448 or NaN (GPU only)."""
    return v.to(tl.float8e4nv).to(tl.float32)


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
    the same value. The table is read only by those lanes (a masked load): a
    few per mille of the elements.

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
    near = tl.abs(off) <= w0 + POW_W1 * tl.abs(t)
    slow = near | (not inside)
    exact = tl.load(tab_ptr + idx, mask=slow, other=0.0)
    if DTYPE == BF16:
        # where the fast value is used it is not within a window of a
        # midpoint (no tie) and is a normal number: nearest-even into bf16 is
        # adding half a bf16 ulp to the bits and truncating (integer pipe, no
        # conversion)
        fast = ((bits + 0x8000) & -65536).to(tl.float32, bitcast=True)
    else:
        fast = rd_hw(r, DTYPE)
    return tl.where(slow, exact, fast)


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

