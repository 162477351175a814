"""The Triton rounding helpers of kernels/quant.py and quant_pow.py against torch / compressed-tensors.

Each helper is applied elementwise by a tiny kernel (under TRITON_INTERPRET=1
on the CPU; compiled on CUDA in a GPU run) and compared bitwise with what
torch computes on the same device (the reference's arithmetic). The fp32 pow is the one place that is not bit-exact (torch's own
pow is not correctly rounded): a relative bound is asserted there.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.mxfp_utils import (
    generate_mx_scales,
    maybe_convert_from_mx_exp,
)
from compressed_tensors.quantization import QuantizationArgs
from helpers import compile_pythons, compiled_row, python_id

triton = pytest.importorskip("triton", reason="the Triton kernels need triton")
tl = triton.language
Q = importlib.import_module("obskernels.kernels.quant")
QP = importlib.import_module("obskernels.kernels.quant_pow")

pytestmark = pytest.mark.kernel

POW_WORKER = os.path.join(os.path.dirname(__file__), "pow_worker.py")

OP_RD, OP_FP8, OP_FP4, OP_POW, OP_RNE, OP_MX = range(6)


@triton.jit
def _apply(x_ptr, out_ptr, n, norm, mx_offset,
           OP: tl.constexpr, DTYPE: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if OP == 0:
        r = Q.rd(x, DTYPE)
    elif OP == 1:
        r = Q.round_fp8e4m3(x)
    elif OP == 2:
        r = Q.round_fp4e2m1(x)
    elif OP == 3:
        r = QP.abs_pow(x, norm, MODE, DTYPE)
    elif OP == 4:
        r = Q.rne_int(x)
    else:
        r = Q.mx_scale(x, mx_offset, DTYPE)
    tl.store(out_ptr + offs, r, mask=m)


def apply(x, op, dtype=torch.float32, mode=0, norm=1.0, mx_offset=2):
    x = x.float().contiguous()
    out = torch.empty_like(x)
    # compiled as mse_search compiles them: on a GPU, FP fusion would turn
    # pow_pos's a + n*lg into one FMA (the interpreter never fuses)
    _apply[(1,)](x, out, x.numel(), norm, mx_offset, OP=op, DTYPE=Q.DTYPE_CODE[dtype], MODE=mode,
                 BLOCK=triton.next_power_of_2(x.numel()), enable_fp_fusion=False)
    return out


def assert_bitwise(got, want):
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"element {i}: got {got[i].item()!r}, want {want[i].item()!r}")


def spread(n=4096, seed=0):
    """Values over many binades, plus NaN, +-inf, +-0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    return x


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_round_to_dtype(dtype, device):
    x = spread().to(device)
    assert_bitwise(apply(x, OP_RD, dtype), x.to(dtype).float())


def test_round_fp8_e4m3(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([
        (torch.randn(4096, generator=gen) * 100).clamp(-448, 448),
        torch.arange(-448, 448.01, 0.03125),  # every tie and every binade carry
        torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-9 * 0.5, 7.92, float("nan")]),
    ]).to(device)
    assert_bitwise(apply(x, OP_FP8), x.to(torch.float8_e4m3fn).float())


def test_round_fp4_e2m1(device):
    """The fake quantization's e2m1 rounding of values clamped to [-6, 6]
    (NaN kept) against compressed-tensors' cast_to_fp4: every fp16 value in
    the range (every tie, both sides of every band edge at fp16's
    resolution), the fp32 neighbours of every threshold and band edge,
    subnormals and zeros, random fp32 values, an eighth-step grid."""
    gen = torch.Generator().manual_seed(2)
    fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    fp16 = fp16[fp16.abs() <= 6]
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat([torch.nextafter(edges, edges * 0), edges,
                      torch.nextafter(edges, edges * 0 + 7).clamp(max=6)])
    tiny = torch.tensor([2.0**-149, 2.0**-126, 1e-30, 0.0, float("nan")])
    x = torch.cat([fp16, near, -near, tiny, -tiny, (torch.randn(4096, generator=gen) * 3).clamp(-6, 6),
                   (torch.rand(1 << 16, generator=gen) * 12 - 6), torch.arange(-6, 6.001, 0.125)])
    assert_bitwise(apply(x.to(device), OP_FP4), cast_to_fp4(x.clone()).to(device))


def test_round_half_even(device):
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4096, generator=gen) * 50, torch.arange(-130, 130, 0.5)]).to(device)
    assert_bitwise(apply(x, OP_RNE), torch.round(x))


NORMS = [(2.4, QP.P_GENERAL), (2.0, QP.P_SQUARE), (3.0, QP.P_CUBE), (0.5, QP.P_SQRT),
         (1.0, QP.P_ONE), (1.7, QP.P_GENERAL), (7.3, QP.P_GENERAL)]


@pytest.mark.parametrize("norm,mode", NORMS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_abs_pow(dtype, norm, mode, device):
    """|d| ** norm as torch computes it on the CPU; the exponent is rounded to
    the dtype. abs_pow is the CPU's arithmetic (the interpreter's, and the
    search's off the GPU's fast path) on every device: CUDA torch rounds an
    fp16 cube's inner product where the CPU does not, and the GPU's search
    follows it with abs_pow_hw (its parity tests compare it with CUDA torch)."""
    gen = torch.Generator().manual_seed(4)
    d = (torch.rand(8192, generator=gen) * torch.exp(torch.randn(8192, generator=gen) * 3)).to(dtype)
    d[:3] = torch.tensor([0.0, float("inf"), float("nan")])
    d = d.to(device)
    n_dtype = float(torch.tensor(norm, dtype=torch.float64).to(dtype))
    got = apply(d, OP_POW, dtype, int(mode), n_dtype).cpu()
    want = d.cpu().pow(norm).float()
    if dtype == torch.float32:
        # torch's fp32 pow is itself ~1 ulp off the correctly rounded value
        normal = torch.isfinite(want) & (want > 1e-30)
        rel = ((got - want).abs() / want)[normal].max().item()
        assert rel < 1e-6, f"max relative difference {rel:.3g}"
        special = (want == 0) | torch.isinf(want) | torch.isnan(want)
        assert_bitwise(got[special], want[special])
    else:
        # torch rounds its fp32 pow into the dtype: bitwise but for the rare
        # value whose fp32 pow lands within an ulp of a rounding boundary
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        assert int((~same).sum()) <= 2


@pytest.mark.parametrize("python", compile_pythons(), ids=python_id)
def test_fp32_pow_under_every_triton_interpreter(python):
    """fp32 |d| ** norm (general norms) within 1e-6 of torch's under each
    triton's interpreter: pow_pos takes norm * e as two exact products, where
    an fma (rounded twice by triton 3.8's interpreter and older) put it 1.4e-6
    and 2.9e-6 off there."""
    row = compiled_row(python, POW_WORKER, timeout=600, TRITON_INTERPRET="1")
    for norm in ("2.4", "7.3"):
        assert row[norm]["max_rel"] < 1e-6, (norm, row)
        assert row[norm]["special_equal"], (norm, row)


@pytest.mark.parametrize("num_bits", (4, 8))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_mx_scale(dtype, num_bits, device):
    """Power-of-two scales: round_to_power_2 -> E8M0 -> 2^(e - 127) in the dtype."""
    x = spread(seed=5).abs().to(dtype)
    x = torch.cat([x, torch.tensor([2.0**-14 * 0.74, 2.0**-14 * 0.76, 65000.0, 57343.0]).to(dtype)])
    x = x[~torch.isnan(x)].to(device)
    args = QuantizationArgs(num_bits=num_bits, type="float", strategy="group", group_size=32,
                            scale_dtype=torch.uint8)
    exp = generate_mx_scales(x, num_bits)
    want = maybe_convert_from_mx_exp(args, torch.clamp(exp, 0, 255).round().to(torch.uint8).to(dtype))
    offset = 2 if num_bits == 4 else 8
    assert_bitwise(apply(x, OP_MX, dtype, mx_offset=offset), want.float())


# --------------------------------------------------------------------------- #
# The GPU's fast pow (quant_pow.pow16_hw) cannot run here: its argument is checked
# by emulation. The MUFU result is modelled as the exact d**n (fp64) off by
# the largest relative error pow_window assumes for it, in either direction
# (the worst cases for the boundary test); the device's pow is torch's.
# Claim: wherever the window test lets the fast value through, its rounding
# into the dtype equals torch's own pow of the dtype value.
# --------------------------------------------------------------------------- #
def _fast_pow_decision(d, n, dtype, sign):
    """(fast value rounded into dtype, slow mask) as pow16_hw decides them."""
    d64 = d.double()
    t = n * torch.log2(d64)
    # the fast path's assumed error (pow_window without torch's 8 ulp and the
    # final 1): ln2 (n 2^-21 + |t| 2^-22.4) + 2^-21, relative
    rel = math.log(2) * (n * 2.0**-21 + t.abs() * 2.0**-22.4) + 2.0**-21
    r = (torch.pow(d64, n) * (1 + sign * rel)).float()
    bits = r.view(torch.int32)
    t32 = t.float()
    if dtype == torch.bfloat16:
        off = (bits & 0xFFFF) - 0x8000
        inside = (t32 > -125.0) & (t32 < 127.0)
    else:
        off = (bits & 0x1FFF) - 0x1000
        inside = (t32 > -13.9) & (t32 < 15.9)
    # pow16_hw's one FMA, |off| - 2.25 |t| rounded once to fp32 (exact in
    # fp64 first: |off| is an integer below 2^16, 2.25 |t| has 28 bits)
    w0 = torch.tensor(QP.pow_window(n), dtype=torch.float32)
    near = (off.abs().double() - 2.25 * t32.abs().double()).float() <= w0
    slow = near | ~inside | torch.isnan(t32)
    if dtype == torch.bfloat16:
        # pow16_hw's bf16 rounding of the fast value: half an ulp added to the
        # bits, then truncated (valid away from ties, which the window catches)
        fast = ((bits + 0x8000) & -65536).view(torch.float32).to(dtype)
    else:
        fast = r.to(dtype)
    return fast, slow


@pytest.mark.parametrize("norm", (2.4, 1.7, 7.3, 0.3))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_fast_pow_window_argument(dtype, norm):
    """Every 16-bit non-negative value d: where the window lets the (worst
    case) fast value through, it rounds as torch's pow does; and the table
    is needed for a small fraction of the values a search sees."""
    d = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    d = d[torch.isfinite(d)]
    n = float(torch.tensor(norm, dtype=torch.float64).to(dtype))  # the exponent torch uses
    want = d.pow(norm)
    for sign in (-1.0, 1.0):
        fast, slow = _fast_pow_decision(d, n, dtype, sign)
        bad = ~slow & ~((fast == want) | (torch.isnan(fast) & torch.isnan(want)))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise AssertionError(f"d={d[i].item()!r}: fast {fast[i].item()!r} passed the "
                                 f"window, torch's pow gives {want[i].item()!r}")
    # the values a search sees: differences of a few quantisation steps. fp16
    # results below 2^-14 are subnormal, whose rounding boundaries are not a
    # fixed bit pattern: they always take the table (correct, slower).
    typical = (d > 2.0**-14) & (d < 4.0)
    if dtype == torch.float16:
        typical &= (want.float() > 2.0**-13) & (want.float() < 2.0**15)
    frac = slow[typical].double().mean().item()
    assert frac < (0.01 if dtype == torch.bfloat16 else 0.05), f"table fraction {frac:.4f}"


def test_fast_pow_offset_is_exact():
    """pow16_hw's distance to the midpoint as an fp32 from the low bits OR-ed
    into 2^23 (no int -> float conversion): every low-bit pattern gives the
    integer difference exactly, for bf16 (16 bits) and fp16 (13 bits)."""
    for width, mid, const in ((16, 0x8000, 8421376.0), (13, 0x1000, 8392704.0)):
        low = torch.arange(1 << width, dtype=torch.int32)
        f = (low | 0x4B000000).view(torch.float32) - torch.tensor(const, dtype=torch.float32)
        assert torch.equal(f.double(), (low - mid).double()), width


# --------------------------------------------------------------------------- #
# The GPU's bf16 quotient (quant.recip_hw + quot_bf16_hw) instead of a
# correctly rounded division per element, emulated instruction by instruction
# in fp32 (torch's CPU fp32 division and products are correctly rounded, like
# div.rn / mul.rn, and keep subnormals, as sm_90's non-ftz ones do). Claim:
# its bf16 rounding equals that of div_rn(x, s) for every bf16 x (NaN, inf,
# subnormals included) and every bf16 scale s >= 0 (subnormals, inf, NaN too).
# --------------------------------------------------------------------------- #
_BF16_ALL = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _gpu_quotient(x, s):
    """recip_hw then quot_bf16_hw, one fp32 operation at a time."""
    lift = torch.where(s < 2.0**-64, torch.tensor(2.0**64), torch.tensor(1.0))
    r = 1.0 / (s * lift)
    return (x * lift) * r


def _first_mismatch(s, quotient):
    """The first (x, s, got, want) where quotient(x, s) rounds into bf16 unlike
    div_rn(x, s), x every bf16 pattern, s the given scales; None if none."""
    x = _BF16_ALL[None, :]
    S = s[:, None]
    got = quotient(x, S).to(torch.bfloat16).float()
    want = (x / S).to(torch.bfloat16).float()
    bad = ~((got == want) | (got.isnan() & want.isnan()))
    if not bool(bad.any()):
        return None
    i, j = (int(v) for v in bad.nonzero()[0])
    return x[0, j].item(), S[i, 0].item(), got[i, j].item(), want[i, j].item()


def _scales_checked():
    """Every positive bf16 scale of the binades a search meets and of the
    edges: every subnormal, around the lift's 2^-64 threshold, near 1, the
    largest finite binade, inf; then 0 and NaN."""
    bits = torch.arange(1, 0x7F81, dtype=torch.int32)  # 2^-133 .. inf
    exp = bits >> 7
    keep = (exp == 0) | (exp >= 0xFE) | torch.isin(exp, torch.tensor(
        [1, 2, 60, 62, 63, 64, 65, 66, 100, 120, 124, 125, 126, 127, 128, 130, 140, 191, 192, 193, 250]))
    # 0 and NaN: the zero point divides by the scale before eps replaces a 0
    edges = torch.tensor([0.0, float("nan")])
    return torch.cat([bits[keep].to(torch.int16).view(torch.bfloat16).float(), edges])


def test_gpu_bf16_quotient_rounds_as_div_rn():
    """Every bf16 x against every scale of _scales_checked (run over every
    positive bf16 scale, 2^31 pairs, the same check finds no difference
    either; that takes minutes, so the suite keeps these binades)."""
    scales = _scales_checked()
    for i in range(0, scales.numel(), 128):
        bad = _first_mismatch(scales[i:i + 128], _gpu_quotient)
        assert bad is None, "x=%r s=%r: quotient rounds to %r, div_rn's to %r" % bad


def test_gpu_bf16_quotient_check_can_fail():
    """The same check catches a quotient one fp32 ulp off, and the
    reciprocal without the lift (1 / s overflows below 2^-128)."""
    scales = _scales_checked()

    def ulp_off(x, s):
        q = x / s
        return torch.where(q.abs() > 0, torch.nextafter(q, torch.zeros_like(q)), q)

    def no_lift(x, s):
        return x * (1.0 / s)

    assert _first_mismatch(scales[2000:2128], ulp_off) is not None  # a normal binade
    assert _first_mismatch(scales[:128], no_lift) is not None  # subnormal scales


def _every_format_args():
    """QuantizationArgs of every format the kernels take: int 1-8 bits
    symmetric and asymmetric, fp8 both, fp4 symmetric."""
    out = [QuantizationArgs(num_bits=b, type="int", symmetric=sym)
           for b in range(1, 9) for sym in (True, False)]
    out += [QuantizationArgs(num_bits=8, type="float", symmetric=sym) for sym in (True, False)]
    return out + [QuantizationArgs(num_bits=4, type="float", symmetric=True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_format_divisors_need_no_lift(dtype):
    """The premise of ``quant._div_rd``'s B_FORMAT (a format's rng and half
    divide without recip_hw's lift): every format's rng and half are at
    least 0.5, far above the lift's 2^-64 threshold, and bf16 values, so
    the quotient's claim above holds with lift 1 (the _scales_checked run)."""
    for args in _every_format_args():
        fmt = Q.qformat(args, dtype, "test")
        for name in ("rng", "half"):
            value = getattr(fmt, name)
            assert value >= 0.5 and value >= 2.0**-64, f"{args}: {name} = {value!r}"
            assert torch.tensor(value).to(torch.bfloat16).item() == value, f"{args}: {name} = {value!r}"


# --------------------------------------------------------------------------- #
# The GPU's fp16 quotient (mse_search_details/_step._quot_f16_hw): a
# correctly rounded reciprocal per group and one product per element, emulated
# in fp32 as above. Claim: its fp16 rounding equals that of div_rn(x, s) for
# every fp16 x (NaN, inf, subnormals) and positive fp16 scale s (inf, NaN
# too) wherever that quotient is an fp16 normal, 0, inf or NaN; below 2^-14
# both stay below 2^-14, within one fp16 subnormal step of each other (the
# fake quantization then rounds both to the same value, _quot_f16_hw).
# --------------------------------------------------------------------------- #
_F16_ALL = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()


def _f16_scales():
    """Every positive fp16 subnormal scale, the binades a search meets and
    the edges (2^-14 .. 2^-13, around 1, the largest finite binade), inf,
    0 and NaN."""
    bits = torch.arange(1, 0x7C01, dtype=torch.int32)  # 2^-24 .. inf
    exp = bits >> 10
    keep = (exp == 0) | (exp >= 0x1E) | torch.isin(exp, torch.tensor([1, 2, 8, 14, 15, 16, 20]))
    edges = torch.tensor([0.0, float("nan")])
    return torch.cat([bits[keep].to(torch.int16).view(torch.float16).float(), edges])


def _f16_mismatch(s, quotient):
    """The first (x, s, got, want) breaking the claim for scales s; None if none."""
    x = _F16_ALL[None, :]
    S = s[:, None]
    q = x / S
    got = quotient(x, S).to(torch.float16).float()
    want = q.to(torch.float16).float()
    same = (got == want) | (got.isnan() & want.isnan())
    tiny = (q.abs() > 0) & (q.abs() < 2.0**-14)
    close = (got.abs() <= 2.0**-14) & (want.abs() <= 2.0**-14) & ((got - want).abs() <= 2.0**-24)
    bad = ~same & ~(tiny & close)
    if not bool(bad.any()):
        return None
    i, j = (int(v) for v in bad.nonzero()[0])
    return x[0, j].item(), S[i, 0].item(), got[i, j].item(), want[i, j].item()


def test_gpu_f16_quotient_rounds_as_div_rn():
    scales = _f16_scales()
    for i in range(0, scales.numel(), 256):
        bad = _f16_mismatch(scales[i:i + 256], lambda x, s: x * (1.0 / s))
        assert bad is None, "x=%r s=%r: quotient rounds to %r, div_rn's to %r" % bad


def test_gpu_f16_quotient_check_can_fail():
    """The same check catches a quotient 2^-21 off (fp16's 11 bits leave
    midpoints as close as 2^-23 to a quotient), and a reciprocal rounded to
    fp16 (too coarse)."""
    scales = _f16_scales()

    def ulp_off(x, s):
        return (x / s) * (1 - 2.0**-21)

    def coarse(x, s):
        return x * (1.0 / s).to(torch.float16).float()

    assert _f16_mismatch(scales[1100:1356], ulp_off) is not None
    assert _f16_mismatch(scales[1100:1356], coarse) is not None
