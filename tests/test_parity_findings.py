"""Regression tests for three findings of a randomized differential fuzz of
the triton backend (under the interpreter) against the reference and
llm-compressor (docs/spec.md, "Parity contract" and "Triton on a GPU versus
the interpreter"):

1. bfloat16 subnormals (|x| < 2^-126) loaded wrong: the interpreter's
   bf16 -> fp32 conversion mis-normalises them. The kernels widen bf16 by a
   16-bit shift of its bits (``_layout.widen``), exact everywhere.
2. Exact ties in the MSE search: when two grid steps have EXACTLY equal
   errors, which one the reference keeps depends on how torch.sum rounds its
   fp32 sum, and the kernel sums in another order. The per-group error bound
   of the parity contract holds; the candidate may differ.
3. TOKEN strategy with a changing sequence length: statistics are per
   sequence position; one position broadcasts as in llm-compressor, other
   length changes are refused with a message naming the token counts.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from obskernels import Observer, ops
from obskernels.backends import use_backend
from obskernels.spec.search import search_args

from helpers import call_backend, reference_flatten, reference_search

triton = pytest.importorskip("triton", reason="the Triton kernels need triton")
tl = triton.language
layout = importlib.import_module("obskernels.kernels._layout")
min_max_module = importlib.import_module("obskernels.kernels.min_max")
mse_module = importlib.import_module("obskernels.kernels.mse_search")


def _same(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# --------------------------------------------------------------------------- #
# 1. bfloat16 subnormals
# --------------------------------------------------------------------------- #
def every_bf16():
    """All 65,536 bf16 bit patterns (subnormals, zeros, infs, NaNs included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@triton.jit
def _round_trip_kernel(x_ptr, wide_ptr, back_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = layout.widen(tl.load(x_ptr + i, mask=ok, other=0.0))
    tl.store(wide_ptr + i, x, mask=ok)
    layout.store_exact(back_ptr + i, x, ok)


@pytest.mark.kernel
def test_widen_and_store_exact_on_every_bf16_pattern(device):
    x = every_bf16().to(device)
    wide = torch.empty(x.shape, dtype=torch.float32, device=device)
    back = torch.empty_like(x)
    _round_trip_kernel[(triton.cdiv(x.numel(), 4096),)](x, wide, back, x.numel(), BLOCK=4096)
    want = x.float()  # torch's widening is exact
    nan = torch.isnan(want)
    bad = ~((wide == want) | (nan & torch.isnan(wide)))
    assert not bad.any(), (
        f"{int(bad.sum())} bf16 values widen wrong, e.g. {x[bad][:4].tolist()} -> "
        f"{wide[bad][:4].tolist()}"
    )
    # non-NaN values come back with the same bits, NaN stays NaN
    assert torch.equal(back.view(torch.int16)[~nan], x.view(torch.int16)[~nan])
    assert torch.isnan(back[nan]).all()


def subnormal_bf16(shape, seed, device="cpu"):
    """bf16 values of random sign: mostly subnormals, a few normals and zeros
    (drawn on the CPU: the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randint(1, 128, shape, generator=g, dtype=torch.int32)  # exponent 0
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int32) << 15
    bits = (mant | sign).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    flat = x.view(-1)
    flat[::7] = 0.0
    flat[3::11] = torch.randn(flat[3::11].shape, generator=g).to(torch.bfloat16) * 1e-38
    return x.to(device)


SUBNORMAL_CASES = [
    ("weight", QuantizationArgs(num_bits=8, strategy="channel"), (5, 33)),
    ("weight", QuantizationArgs(num_bits=4, strategy="group", group_size=16), (3, 48)),
    ("weight", QuantizationArgs(num_bits=8, strategy="tensor"), (17, 9)),
    ("weight", QuantizationArgs(num_bits=8, strategy="block", block_structure=[4, 8]), (6, 12)),
    ("input", QuantizationArgs(num_bits=8, strategy="token", dynamic=True), (2, 5, 16)),
    ("input", QuantizationArgs(num_bits=8, strategy="tensor"), (2, 5, 16)),
]


@pytest.mark.kernel
def test_the_reported_subnormal_pair(device):
    x = torch.tensor([[1e-39, -2e-39]], dtype=torch.bfloat16, device=device)
    args = QuantizationArgs(num_bits=8, strategy="channel")
    want = (torch.amin(x, dim=1, keepdim=True), torch.amax(x, dim=1, keepdim=True))
    with use_backend("triton"):
        got = ops.min_max(x, "weight", args)
        qp = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)(x).get_qparams()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
    # the scale of this tiny range is the dtype's eps, not a subnormal
    want_scale, _ = calculate_qparams(want[0].reshape(1), want[1].reshape(1), args)
    assert torch.equal(qp["scale"].reshape(-1), want_scale.reshape(-1)), (qp["scale"], want_scale)


@pytest.mark.kernel
@pytest.mark.parametrize("split", (1, 3))
@pytest.mark.parametrize("case", range(len(SUBNORMAL_CASES)))
def test_min_max_of_bf16_subnormals(case, split, pin_launch, device):
    base_name, args, shape = SUBNORMAL_CASES[case]
    # a tiny tile and a split force the partials and their finish by the last program (bf16 partials)
    pin_launch("min_max", tile=16, split=split)
    x = subnormal_bf16(shape, seed=case, device=device)
    with use_backend("reference"):
        want = ops.min_max(x, base_name, args)
    with use_backend("triton"):
        got = ops.min_max(x, base_name, args)
    for g, w, what in zip(got, want, ("min", "max")):
        bad = ~((g == w) | (torch.isnan(g) & torch.isnan(w)))
        assert not bad.any(), f"{what}: groups {bad.nonzero().tolist()[:3]}: {g[bad][:3]} vs {w[bad][:3]}"


@pytest.mark.kernel
@pytest.mark.parametrize("layout_kind", ("block", "g_idx"))
def test_flatten_copies_bf16_subnormals_bit_for_bit(layout_kind, device):
    x = subnormal_bf16((6, 12), seed=11, device=device)
    if layout_kind == "block":
        args, g_idx = QuantizationArgs(num_bits=8, strategy="block", block_structure=[4, 8]), None
    else:
        args = QuantizationArgs(num_bits=4, strategy="group", group_size=4)
        g_idx = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1], dtype=torch.int32, device=device)
    with use_backend("reference"):
        want = ops.flatten_for_calibration(x, "weight", args, g_idx=g_idx)
    with use_backend("triton"):
        got = ops.flatten_for_calibration(x, "weight", args, g_idx=g_idx)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.kernel
@pytest.mark.parametrize("flavour", ("mse", "imatrix"))
@pytest.mark.parametrize("fmt", ("int8", "fp4"))
def test_mse_search_of_bf16_subnormals(fmt, flavour, device):
    if fmt == "int8":
        args = QuantizationArgs(num_bits=8, strategy="group", group_size=16, symmetric=False)
    else:
        args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=16)
    x = subnormal_bf16((4, 32), seed=7, device=device)
    kw = dict(maxshrink=0.2, patience=5, grid=100, norm=2.4, flavour=flavour)
    want = reference_search(x, "weight", args, **kw)
    got = call_backend(mse_module.mse_search, x, "weight", args, **kw)
    # the search's base range is min/max: it must see the same subnormals
    assert _same(got[0], want[0]) and _same(got[1], want[1]), (got, want)


@pytest.mark.kernel
def test_accumulate_sq_of_bf16_near_subnormal(device):
    # Squares of subnormals underflow in fp32, so the sum sees only the
    # normals next to them; the wide value must still be read exactly.
    x = subnormal_bf16((9, 24), seed=3, device=device) * torch.tensor(2.0**60, dtype=torch.bfloat16, device=device)
    sums = torch.zeros(24, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    with use_backend("triton"):
        ops.accumulate_sq(x, sums, count)
    want = (x.double() ** 2).sum(0)
    torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=0)
    assert int(count) == 9


# --------------------------------------------------------------------------- #
# 2. exact ties in the search
# --------------------------------------------------------------------------- #
# Parity-contract tolerance on the reference error of the kernel's choice.
TOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def candidate_errors(value, args, mins, maxs, *, norm, flavour):
    """Per group: the reference's fp32 (or observed-dtype) error of the range
    (mins, maxs) summed by torch on the value's device, and the same terms
    summed exactly (fsum); both on the CPU."""
    observed = reference_flatten(value, "weight", args)
    qargs, token_args = search_args(args)
    scale, zp = calculate_qparams(mins, maxs, qargs, None)
    q = fake_quantize(observed, scale.unsqueeze(-1), zp.unsqueeze(-1), token_args)
    if flavour == "mse":
        terms = (q.to(observed.dtype) - observed).abs().pow(norm)
    else:
        terms = (q.float() - observed.float()).abs().pow(norm)
    summed = terms.sum(dim=(0, -1)).double().flatten().cpu()
    per_group = terms.movedim(0, -2).reshape(summed.numel(), -1).double()
    exact = torch.tensor([math.fsum(row.tolist()) for row in per_group], dtype=torch.float64)
    return summed, exact


def check_tie_bound(value, args, **kw):
    """The parity bound per group; where the kernel's candidate differs from
    the reference's, both candidates' errors are equal when summed exactly
    (a tie that rounding broke differently). Returns the differing groups."""
    want = reference_search(value, "weight", args, **kw)
    got = call_backend(mse_module.mse_search, value, "weight", args, **kw)
    ekw = dict(norm=kw["norm"], flavour=kw.get("flavour", "mse"))
    e_ref, x_ref = candidate_errors(value, args, *want, **ekw)
    e_got, x_got = candidate_errors(value, args, *got, **ekw)
    tol = TOL[value.dtype]
    ok = e_got <= e_ref * (1 + tol)
    assert bool(ok.all()), f"groups {(~ok).nonzero().flatten().tolist()}: {e_got[~ok]} vs {e_ref[~ok]}"
    differ = ((got[0] != want[0]) | (got[1] != want[1])).flatten().cpu()
    assert torch.equal(x_got[differ], x_ref[differ]), (
        f"groups {differ.nonzero().flatten().tolist()} differ without an exact tie: "
        f"exact errors {x_got[differ].tolist()} vs {x_ref[differ].tolist()}"
    )
    return differ


FP4_TIE = [-0.51953125, 1.5625, 1.234375, 1.5, 0.47265625, 0.60546875, -0.87890625, -0.7421875,
           0.283203125, -1.5, -0.30859375, -0.60546875, -1.96875, -0.13671875, 1.8671875, 0.150390625]


@pytest.mark.kernel
def test_fp4_group_with_an_exact_tie(device):
    # One 16-value fp4 group, norm 1: steps 0-3 all have the exact error 1.25;
    # torch's fp32 sum makes step 1 (1.2499999) the reference's pick.
    x = torch.tensor([FP4_TIE], device=device)
    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=16)
    kw = dict(maxshrink=0.05, patience=1, grid=90, norm=1.0)
    lo, hi = torch.tensor([[min(FP4_TIE)]], device=device), torch.tensor([[max(FP4_TIE)]], device=device)
    exact = [candidate_errors(x, args, lo * (1 - i / 90), hi * (1 - i / 90), norm=1.0, flavour="mse")[1]
             for i in range(4)]
    assert all(float(e) == 1.25 for e in exact), exact  # the tie the test is about
    check_tie_bound(x, args, **kw)


@pytest.mark.kernel
def test_int2_imatrix_tensor_with_an_exact_tie(device):
    # 11x32 bf16, int2 asymmetric groups of 16, imatrix flavour, patience 0,
    # grid 65, maxshrink 0.848, norm 1: group 0 has two candidates 3.5%
    # apart in scale whose errors are equal when summed exactly.
    g = torch.Generator().manual_seed(124)
    x = (torch.randn(11, 32, generator=g) ** 3 * 2e4).bfloat16().to(device)
    args = QuantizationArgs(num_bits=2, symmetric=False, strategy="group", group_size=16)
    kw = dict(maxshrink=0.848, patience=0, grid=65, norm=1.0, flavour="imatrix")
    differ = check_tie_bound(x, args, **kw)
    assert int(differ.sum()) <= 1  # at most the tied group


# --------------------------------------------------------------------------- #
# 3. TOKEN strategy with a changing sequence length
# --------------------------------------------------------------------------- #
TOKEN = QuantizationArgs(num_bits=8, strategy="token", dynamic=True)


def token_stats(x):
    return torch.amin(x, dim=(0, -1)), torch.amax(x, dim=(0, -1))


@pytest.mark.parametrize("name", ("static_minmax", "minmax"))
def test_token_statistics_of_one_position_broadcast(backend, name, device):
    a, b = torch.randn(1, 1, 16).to(device), torch.randn(2, 5, 16).to(device)
    obs = Observer.load_from_registry(name, base_name="input", args=TOKEN.model_copy())
    obs(a)
    obs(b)
    (amin, amax), (bmin, bmax) = token_stats(a), token_stats(b)
    if name == "static_minmax":
        want = torch.minimum(amin, bmin), torch.maximum(amax, bmax)
    else:  # moving average with c = 0.01, written out as llm-compressor does
        want = amin * 0.99 + bmin * 0.01, amax * 0.99 + bmax * 0.01
    assert obs.min_vals.shape == (5,)
    assert torch.equal(obs.min_vals, want[0]) and torch.equal(obs.max_vals, want[1])
    assert obs._num_observed_tokens == 1 + 10


@pytest.mark.parametrize("name", ("static_minmax", "minmax", "mse"))
def test_token_statistics_of_another_length_are_refused(backend, name, device):
    obs = Observer.load_from_registry(name, base_name="input", args=TOKEN.model_copy())
    obs(torch.randn(1, 5, 16).to(device))
    held = obs.min_vals.clone()
    with pytest.raises(ValueError, match=r"this value of shape \(1, 3, 16\) has 3 token positions, "
                                         r"but the observer holds statistics for 5 positions"):
        obs(torch.randn(1, 3, 16).to(device))
    assert torch.equal(obs.min_vals, held) and obs._num_observed_tokens == 5
    obs(torch.randn(4, 5, 16).to(device))  # the same length still works
    assert obs._num_observed_tokens == 25
