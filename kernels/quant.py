"""Formats and roundings: compressed-tensors' qparams and fake quantization in Triton.

One set of codes for every kernel (observed dtype, element type, scale and
zero-point rounding, global scale) and one decoder of QuantizationArgs into
them and calculate_qparams' constants (``qformat``); |d| ** norm is quant_pow.py's.

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
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from compressed_tensors.quantization import QuantizationType
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA, FP8_E4M3_DATA
from compressed_tensors.quantization.utils.mxfp_utils import should_generate_mx_scales

from obskernels.spec.errors import KernelUnsupportedError

# dtype codes (constexpr mode switches)
F32: tl.constexpr = tl.constexpr(0)
F16: tl.constexpr = tl.constexpr(1)
BF16: tl.constexpr = tl.constexpr(2)
# host side: the DTYPE switch of an observed torch dtype
DTYPE_CODE = {torch.float32: F32.value, torch.float16: F16.value, torch.bfloat16: BF16.value}

# quantized element types
Q_INT: tl.constexpr = tl.constexpr(0)
Q_FP8: tl.constexpr = tl.constexpr(1)
Q_FP4: tl.constexpr = tl.constexpr(2)

# the scale's rounding after calculate_qparams' division (scale_dtype)
S_NONE: tl.constexpr = tl.constexpr(0)  # none: the scale stays in its dtype
S_FP8: tl.constexpr = tl.constexpr(1)  # float8_e4m3fn
S_MX: tl.constexpr = tl.constexpr(2)  # power-of-two E8M0 scales (uint8 scale_dtype)
S_BF16: tl.constexpr = tl.constexpr(3)  # a float scale_dtype: clamped to it, rounded into it
S_F16: tl.constexpr = tl.constexpr(4)
S_F32: tl.constexpr = tl.constexpr(5)
_FLOAT_SCALES = {torch.bfloat16: S_BF16, torch.float16: S_F16, torch.float32: S_F32}

# zero point rounding (zp_dtype)
Z_INT: tl.constexpr = tl.constexpr(0)
Z_FP8: tl.constexpr = tl.constexpr(1)

# global scale (calculate_qparams' global_scale)
GS_NONE: tl.constexpr = tl.constexpr(0)
GS_GIVEN: tl.constexpr = tl.constexpr(1)
GS_FUSED: tl.constexpr = tl.constexpr(2)  # generate_gparam of fused statistics, in the kernel


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


class Format(NamedTuple):
    """A quantization format as the kernels take it: the constexpr switches
    (``qtype`` Q_*, ``scale`` S_*, ``zp`` Z_*, ``sym``), calculate_qparams'
    constants as torch computes them (Python floats: calculate_range's fp32
    q_min / q_max, the range and its half in the statistics' dtype, eps in
    the scale's, zp_dtype's bounds, the MX exponent offset, a float
    scale_dtype's bound in the scale's dtype), the same unrounded for the
    float64 redo of overflowing scales (``wrng``, ``whalf``, ``sd_max64``,
    ``weps``), and zp_dtype."""

    qtype: int
    scale: int
    zp: int
    sym: bool
    rng: float
    half: float
    qmin: float
    qmax: float
    eps: float
    zlo: float
    zhi: float
    mx_offset: int
    sd_max: float
    sd_max64: float
    wrng: float
    whalf: float
    weps: float
    zp_dtype: torch.dtype


def qformat(args, dtype: torch.dtype, op: str, sdtype: torch.dtype | None = None) -> Format:
    """The ``Format`` of QuantizationArgs ``args`` for statistics of ``dtype``
    and scales of ``sdtype`` (default ``dtype``; float32 with a global scale),
    or KernelUnsupportedError, its message led by ``op``, naming what the
    kernels do not cover."""
    sdtype = dtype if sdtype is None else sdtype
    bits = args.num_bits
    if QuantizationType(args.type) == QuantizationType.INT:
        if not 1 <= bits <= 8:
            raise KernelUnsupportedError(f"{op}: int num_bits={bits} (kernel covers 1..8)")
        qtype, q_min, q_max = Q_INT, -(2.0**bits) / 2, (2.0**bits) / 2 - 1
    elif bits in (4, 8):
        if bits == 4 and not args.symmetric:
            raise KernelUnsupportedError(
                f"{op}: asymmetric fp4 (compressed-tensors does not support it either)")
        data = FP8_E4M3_DATA if bits == 8 else FP4_E2M1_DATA
        qtype, q_min, q_max = (Q_FP8 if bits == 8 else Q_FP4), float(data.min), float(data.max)
    else:
        raise KernelUnsupportedError(f"{op}: float num_bits={bits} (kernel covers 4 and 8)")

    scale_dtype = args.scale_dtype
    mx_offset, sd_max, sd_max64 = 0, 0.0, 0.0
    if should_generate_mx_scales(args):
        if not args.symmetric:
            raise KernelUnsupportedError(f"{op}: asymmetric MX scales")
        # eps of an integer (uint8) scale_dtype; the offset is floor(log2(type max))
        scale, eps, mx_offset = S_MX, 1.0, int(math.floor(math.log2(q_max)))
    elif scale_dtype is None:
        scale, eps = S_NONE, torch.finfo(sdtype).eps
    elif scale_dtype == torch.float8_e4m3fn:
        scale, eps, sd_max64 = S_FP8, 0.125, 448.0
    elif scale_dtype in _FLOAT_SCALES:
        info = torch.finfo(scale_dtype)
        if info.max > torch.finfo(sdtype).max:
            # compressed-tensors clamps to the scale_dtype's range in the
            # scale's dtype: torch refuses the bound (overflow)
            raise KernelUnsupportedError(
                f"{op}: scale_dtype {scale_dtype} is wider than the scales ({sdtype})")
        # clamp's bounds are rounded into the scale's dtype, as torch does
        scale, eps = _FLOAT_SCALES[scale_dtype], info.eps
        sd_max, sd_max64 = round_host(float(info.max), sdtype), float(info.max)
    else:
        raise KernelUnsupportedError(f"{op}: scale_dtype {scale_dtype}")

    zp_dtype = args.zp_dtype
    if zp_dtype == torch.float8_e4m3fn:
        zp, zlo, zhi = Z_FP8, -448.0, 448.0
    elif zp_dtype is not None and not zp_dtype.is_floating_point and zp_dtype != torch.bool:
        info = torch.iinfo(zp_dtype)
        if info.max > torch.finfo(dtype).max:
            # compressed-tensors clamps in the statistics' dtype: torch refuses the bound
            raise KernelUnsupportedError(
                f"{op}: zp_dtype {zp_dtype} is wider than the statistics ({dtype})")
        zp, zlo, zhi = Z_INT, float(info.min), float(info.max)
    else:
        raise KernelUnsupportedError(f"{op}: zp_dtype {zp_dtype}")

    # calculate_range makes fp32 scalars; calculate_qparams takes the range in
    # the statistics' dtype and halves it there (small integers or halves:
    # exact in every dtype, rounded anyway so the constants are torch's)
    q_min, q_max = round_host(q_min, torch.float32), round_host(q_max, torch.float32)
    rng = round_host(q_max - q_min, dtype)
    return Format(
        qtype=qtype.value, scale=scale.value, zp=zp.value, sym=bool(args.symmetric),
        rng=rng, half=round_host(rng / 2, dtype), qmin=q_min, qmax=q_max,
        eps=round_host(eps, sdtype), zlo=zlo, zhi=zhi, mx_offset=mx_offset,
        sd_max=sd_max, sd_max64=sd_max64, wrng=q_max - q_min, whalf=(q_max - q_min) / 2,
        # the float64 redo's eps: scale_dtype's, else float64's
        weps=eps if scale.value != S_NONE.value else torch.finfo(torch.float64).eps,
        zp_dtype=zp_dtype,
    )


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
    """compressed-tensors' cast_to_fp4 of a value the fake quantization
    clamped to e2m1's range first (|v| <= 6, or NaN): the nearest of 0, .5,
    1, 1.5, 2, 3, 4, 6, ties as its thresholds (0.25 -> 0, 0.75 -> 1, 1.25 ->
    1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), sign kept, NaN kept; in five
    instructions where the thresholds take fifteen. e2m1's step h is 0.5
    below 2, 1 below 4 and 2 up to 6, and adding M = 1.5 * 2^23 * h (a float
    whose ulp is h; |v| <= 6 cannot take v + M out of M's binade) rounds v to
    a multiple of h in fp32's round-to-nearest, ties to the even multiple (M
    is an even one), which are the thresholds' choices; a value just under a
    band's top rounds up to it (1.9 -> 2, 3.9 -> 4); removing M again is
    exact. M is made from the exponent of max(|v|, 1) (0, 1 or 2 for the
    three bands) plus 22, mantissa 1.5. NaN stays NaN (whatever M it gets);
    a zero's sign may differ from cast_to_fp4's (equal as values; the search
    takes |dq - x|)."""
    a = tl.maximum(tl.abs(v), 1.0)
    m = ((a.to(tl.int32, bitcast=True) & 0x7F800000) + 0x0B400000).to(tl.float32, bitcast=True)
    return (v + m) - m


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
def rd_any(x, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """rd(), by the hardware's conversion on the GPU (FAST)."""
    if FAST:
        return rd_hw(x, DTYPE)
    else:
        return rd(x, DTYPE)


@triton.jit
def _div_rd(a, b, DTYPE: tl.constexpr, FAST: tl.constexpr, B_FORMAT: tl.constexpr = False):
    """rd(div_rn(a, b)) of DTYPE values a, b (b >= 0, or NaN); on the GPU
    (FAST) in bf16 by quot_bf16_hw, whose rounding is the same. B_FORMAT: b
    is a format's constant (rng, half: 0.5 or more), for which recip_hw's
    lift is always 1, so none is computed or held."""
    if FAST and DTYPE == BF16:
        if B_FORMAT:
            return rd_hw(a * tl.math.div_rn(b * 0.0 + 1.0, b), DTYPE)
        lift, r = recip_hw(b)
        return rd_hw(quot_bf16_hw(a, lift, r), DTYPE)
    else:
        return rd_any(tl.math.div_rn(a, b), DTYPE, FAST)


@triton.jit
def qparams(
    cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
    DTYPE: tl.constexpr, SYM: tl.constexpr, SCALE: tl.constexpr, ZP: tl.constexpr,
    FAST: tl.constexpr = False,
):
    """calculate_qparams(cmin, cmax, args, global_scale=None) in DTYPE; SCALE
    is S_NONE, S_FP8 or S_MX. FAST (GPU only): the GPU's arithmetic, same
    results: hardware roundings, and bf16 quotients by quot_bf16_hw (rng and
    half are bf16 values: integers below 256 or their halves, 448, 6).

    mn = min(cmin, 0), mx = max(cmax, 0);
    symmetric: scale = max(|mn|, |mx|) / half (or the MX power of two), zp = 0;
    asymmetric: scale = (mx - mn) / rng, zp = clamp(qmin - mn / scale, qmin, qmax);
    scale_dtype fp8: scale rounded into e4m3; scale == 0 -> eps;
    zp rounded into zp_dtype (integers: clamp to its range, round half even;
    NaN converts to 0 as torch does on the CPU).
    """
    if SYM:
        scale = sym_scale(abs_max(cmin, cmax), half, eps, mx_offset, DTYPE, SCALE, FAST)
        # zero, in every zero point dtype (the rounding below leaves it)
        return scale, tl.zeros_like(scale)
    mn = tl.where(cmin > 0, 0.0, cmin)
    mx = tl.where(cmax < 0, 0.0, cmax)
    scale = _div_rd(rd_any(mx - mn, DTYPE, FAST), rng, DTYPE, FAST, True)
    zp = rd_any(qmin - _div_rd(mn, scale, DTYPE, FAST), DTYPE, FAST)
    zp = nan_clamp(zp, qmin, qmax)
    scale = _scale_dtype(scale, eps, SCALE)
    if ZP == Z_FP8:
        zp = round_fp8e4m3(nan_clamp(zp, -448.0, 448.0))
    else:
        zp = rne_int(nan_clamp(zp, zlo, zhi))
        zp = tl.where(zp != zp, 0.0, zp)
    return scale, zp


@triton.jit
def abs_max(lo, hi):
    """max(-lo, hi, 0), NaN kept: the absolute maximum a symmetric range
    [lo, hi] is quantized by, max(|min(lo, 0)|, |max(hi, 0)|) (0 for the
    empty range (inf, -inf) of a tile slot past the last group)."""
    m = tl.maximum(-lo, hi, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(m, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def sym_scale(amax, half, eps, mx_offset, DTYPE: tl.constexpr, SCALE: tl.constexpr,
              FAST: tl.constexpr = False):
    """qparams' symmetric scale of a group whose range has absolute maximum
    amax (``abs_max``)."""
    if SCALE == S_MX:
        scale = mx_scale(amax, mx_offset, DTYPE)
    else:
        scale = _div_rd(amax, half, DTYPE, FAST, True)
    return _scale_dtype(scale, eps, SCALE)


@triton.jit
def _scale_dtype(scale, eps, SCALE: tl.constexpr):
    """A scale into the scale dtype (fp8: rounded into e4m3), 0 -> eps."""
    if SCALE == S_FP8:
        scale = round_fp8e4m3(nan_clamp(scale, -448.0, 448.0))
    return tl.where(scale == 0, eps, scale)


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
        q = round_fp4e2m1(y)  # clamped to [-6, 6] (fp4 is symmetric)
    else:
        q = rne_int(y)
    return rd(rd(q - zp, DTYPE) * scale, DTYPE)


# --------------------------------------------------------------------------- #
# The GPU's roundings (FAST: a CUDA tensor, never the interpreter, whose casts
# are not correctly rounded, docs/spec.md §6). On a GPU the hardware
# conversions ARE torch's roundings: ``cvt.rn.bf16.f32`` / ``cvt.rn.f16.f32``
# round to nearest even. The search's other GPU arithmetic is in
# mse_search_details/_step.py (fake quantization) and quant_pow.py (the pow).
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
    finds no difference; tests/kernels/test_kernels_quant.py runs it over every x
    and the scales of 25 binades, 0 and NaN.
    """
    return (x * lift) * r

