"""Non-finite input and range edges, on every backend.

- NaN / +-inf in an observed value: by default a ValueError naming the
  observer (class, base_name), the tensor and how many values are not finite.
  Nothing is read back while observing, on either backend: the operations
  record the non-finite input and get_qparams raises the error, dropping the
  statistics of the observations since the last get_qparams (``refuse``
  below). ``nonfinite="propagate"`` keeps llm-compressor's behaviour (NaN /
  inf in the statistics and the scales).
- All-zero tensors and groups: finite, positive scales (the eps rule of
  docs/spec.md §3) and a zero point that represents 0 exactly.
- Values near the top of bf16 (3.3e38) and fp16 (65504): finite, valid
  qparams, also where compressed-tensors' arithmetic in the statistics' dtype
  overflows (asymmetric: max - min); an expanded search range that overflows
  the dtype is a clear error instead of an infinite scale.

Expected values come from compressed-tensors (calculate_qparams,
fake_quantize) and torch reductions on the flattened value, not from the
observers.
"""

from __future__ import annotations

import re

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, calculate_range

import obskernels.observers.report as report_module
from obskernels import Observer

from helpers import formats, reference_flatten

NAMES = ("memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse")
MINMAX_FAMILY = ("memoryless_minmax", "static_minmax", "minmax")

FORMATS = {
    **formats("int8-sym", "int8-asym", "int4-asym", "fp8"),
    **formats("nvfp4", strategy="tensor_group", zp_dtype=torch.float8_e4m3fn),
}


def make_args(fmt="int8-asym", strategy="group", group_size=16):
    kw = dict(FORMATS[fmt])
    kw.setdefault("strategy", strategy)
    if kw["strategy"] in ("group", "tensor_group"):
        kw["group_size"] = group_size
    return QuantizationArgs(**kw)


def make(name, base_name="weight", fmt="int8-asym", **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=make_args(fmt), **kw)


def poisoned(kind, shape=(4, 32), dtype=torch.float32, device="cpu"):
    """A random value with non-finite entries; returns it and the expected counts."""
    x = torch.randn(shape, dtype=dtype).to(device)
    flat = x.view(-1)
    plan = {"nan": (2, 0, 0), "posinf": (0, 1, 0), "neginf": (0, 0, 3), "mixed": (1, 2, 1)}[kind]
    specials = [float("nan")] * plan[0] + [float("inf")] * plan[1] + [float("-inf")] * plan[2]
    positions = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))[: len(specials)]
    for p, v in zip(positions.tolist(), specials):
        flat[p] = v
    return x, plan


def refuse(backend, obs, x, match):
    """A refused value is observed without an error (nothing is read back
    while observing, on every backend); get_qparams raises it."""
    obs(x)
    with pytest.raises(ValueError, match=match):
        obs.get_qparams()


# --------------------------------------------------------------------------- #
# the default: a clear error, statistics untouched
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("base_name,kind", [
    ("weight", "nan"), ("weight", "posinf"), ("weight", "neginf"), ("weight", "mixed"), ("input", "mixed"),
])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_value_is_a_clear_error(backend, name, base_name, kind, device):
    obs = make(name, base_name)
    x, (nan, pos, neg) = poisoned(kind, device=device)
    cls = type(obs).__name__
    want = (
        rf"{cls}\(base_name='{base_name}'\): the observed {base_name} tensor \(shape \(4, 32\), "
        rf"torch.float32\) holds {nan + pos + neg} non-finite \({nan} NaN, {pos} \+inf, {neg} -inf\) "
        rf"of 128 values; expected finite values \(statistics dropped\)\. "
        rf"Pass the observer kwarg nonfinite='propagate'"
    )
    with pytest.warns() if name == "imatrix_mse" else _no_warning():
        refuse(backend, obs, x, want)
    assert not obs.has_statistics and obs._num_observed_tokens == 0


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ("static_minmax", "minmax", "mse"))
def test_nonfinite_after_finite_values_keeps_the_statistics(backend, name, device):
    obs = make(name, "input")
    good = torch.randn(3, 32).to(device)
    obs(good)
    held = (obs.min_vals.clone(), obs.max_vals.clone())
    bad = torch.randn(1, 32).to(device)
    bad[0, 7] = float("-inf")
    refuse(backend, obs, bad, r"holds 1 non-finite \(0 NaN, 0 \+inf, 1 -inf\) of 32 values")
    # raised by get_qparams: the statistics since the last one are dropped
    assert not obs.has_statistics and obs._num_observed_tokens == 0
    obs(good)
    assert torch.equal(obs.min_vals, held[0]) and torch.equal(obs.max_vals, held[1])
    assert obs._num_observed_tokens == 3
    assert torch.isfinite(obs.get_qparams()["scale"]).all()


def test_counting_happens_only_on_the_error_path(backend, monkeypatch, device):
    """The value is never scanned on the host for non-finite entries: the
    operations count them while they read the value, into the record."""
    calls = []

    def counting(t):
        calls.append(t.shape)
        return original(t)

    original = report_module.count_nonfinite
    monkeypatch.setattr(report_module, "count_nonfinite", counting)
    for name in NAMES:
        obs = make(name, "input")
        obs(torch.randn(3, 32).to(device))
        obs.get_qparams()
    assert calls == []
    refuse(backend, make("static_minmax", "input"), poisoned("nan", device=device)[0], "non-finite")
    assert calls == []


# --------------------------------------------------------------------------- #
# nonfinite="propagate": llm-compressor's behaviour
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", NAMES)
def test_propagate_keeps_llm_compressors_behaviour(backend, name, device):
    x = torch.randn(4, 32).to(device)
    x[1, 3] = float("nan")  # group (1, 0)
    x[2, 20] = float("inf")  # group (2, 1)
    args = make_args()
    obs = Observer.load_from_registry(name, base_name="weight", args=args, nonfinite="propagate")
    with pytest.warns() if name == "imatrix_mse" else _no_warning():
        obs(x)
    flat = reference_flatten(x, "weight", args)
    want_min, want_max = torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))
    bad = ~(torch.isfinite(want_min) & torch.isfinite(want_max))
    assert bad.sum() == 2
    got_bad = ~(torch.isfinite(obs.min_vals) & torch.isfinite(obs.max_vals))
    assert torch.equal(got_bad, bad), f"{got_bad} != {bad}"
    if name in MINMAX_FAMILY:
        same = (obs.min_vals == want_min) | (torch.isnan(obs.min_vals) & torch.isnan(want_min))
        assert bool(same.all())
    assert torch.isnan(obs.min_vals[1, 0]) and torch.isnan(obs.max_vals[1, 0])
    scale = obs.get_qparams()["scale"]
    assert torch.isnan(scale[1, 0])  # propagated, as llm-compressor does
    assert torch.isfinite(scale[0]).all()


# --------------------------------------------------------------------------- #
# all-zero tensors and groups
# --------------------------------------------------------------------------- #
def assert_valid_qparams(qp, args, value, what):
    scale, zp = qp["scale"], qp["zero_point"]
    assert torch.isfinite(scale).all() and (scale > 0).all(), f"{what}: scale {scale}"
    if not args.symmetric:
        qmin, qmax = calculate_range(args, zp.device)
        assert ((zp.float() >= qmin) & (zp.float() <= qmax)).all(), f"{what}: zero point {zp}"
    # 0 is representable: it quantizes and dequantizes to exactly 0
    zeros = torch.zeros(scale.shape + (1,), dtype=value.dtype, device=value.device)
    zargs = args.model_copy(update={"strategy": "token"})
    dq = fake_quantize(zeros, scale.unsqueeze(-1), zp.unsqueeze(-1), zargs, global_scale=qp["global_scale"])
    assert torch.equal(dq, torch.zeros_like(dq)), f"{what}: q(0) = {dq.flatten()[:4]}"


@pytest.mark.parametrize("fmt,dtype", [(f, torch.bfloat16) for f in FORMATS] + [("int8-asym", torch.float32)],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("name", NAMES)
def test_all_zero_tensors_and_groups(backend, name, fmt, dtype, device):
    x = torch.randn(4, 32, dtype=dtype).to(device)
    x[1] = 0  # two all-zero groups
    x[3, 16:] = 0  # and one more
    for what, value in (("zero groups", x), ("all zeros", torch.zeros(4, 32, dtype=dtype, device=device))):
        obs = make(name, "weight", fmt)
        with pytest.warns() if name == "imatrix_mse" else _no_warning():
            obs(value)
        qp = obs.get_qparams()
        assert_valid_qparams(qp, obs.args, value, f"{name} {fmt} {what}")
        if obs.args.scale_dtype is None:
            # docs/spec.md §3: a zero range gives scale eps of the statistics' dtype
            assert bool((qp["scale"][1] == torch.finfo(dtype).eps).all()), qp["scale"][1]


# --------------------------------------------------------------------------- #
# the top of the range
# --------------------------------------------------------------------------- #
TOP = {torch.bfloat16: 3.3e38, torch.float16: 65000.0}


def near_top(dtype, device="cpu"):
    x = torch.randn(4, 32).to(dtype)
    x[0, 0], x[0, 1] = TOP[dtype], -TOP[dtype]  # a group whose max - min overflows
    x[2, 5] = TOP[dtype]  # one-sided
    x[3] = -TOP[dtype] * torch.rand(32).to(dtype)
    return x.to(device)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", [n for n in NAMES if n != "nvfp4_expanded_mse"])
def test_values_near_the_top_of_the_range(backend, name, fmt, dtype, device):
    x = near_top(dtype, device)
    obs = make(name, "weight", fmt)
    with pytest.warns() if name == "imatrix_mse" else _no_warning():
        obs(x)
    mn, mx = obs.min_vals.clone(), obs.max_vals.clone()
    assert torch.isfinite(mn).all() and torch.isfinite(mx).all()
    qp = obs.get_qparams()
    assert_valid_qparams(qp, obs.args, x, f"{name} {fmt} {dtype}")
    ct_scale, _ = calculate_qparams(mn, mx, obs.args, qp["global_scale"])
    finite = torch.isfinite(ct_scale)
    # where compressed-tensors is finite the observer returns exactly its answer
    assert torch.equal(qp["scale"][finite], ct_scale[finite])
    if not bool(finite.all()):
        # elsewhere (max - min overflowed): the float64 answer, cast back
        wide, _ = calculate_qparams(mn.double(), mx.double(), obs.args, qp["global_scale"])
        assert torch.equal(qp["scale"][~finite], wide.to(ct_scale.dtype)[~finite])
        # the range still fits: its ends dequantize within one step of themselves
        flat = reference_flatten(x, "weight", obs.args)[0]
        zargs = obs.args.model_copy(update={"strategy": "token"})
        dq = fake_quantize(flat.double(), qp["scale"].double().unsqueeze(-1), qp["zero_point"].unsqueeze(-1), zargs)
        step = qp["scale"].double().unsqueeze(-1)
        assert bool(((dq - flat.double()).abs() <= step).all())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_expanded_search_overflow_is_a_clear_error(backend, dtype, device):
    """nvfp4_expanded_mse widens the range 1.8x before searching: near the top
    of the dtype that range is not representable."""
    x = near_top(dtype, device)
    obs = make("nvfp4_expanded_mse", "weight", "int8-sym")
    refuse(backend, obs, x, re.escape(
        f"NVFP4ExpandedMSEObserver(base_name='weight'): the observed weight tensor (shape (4, 32), "
        f"{dtype}) is finite but its statistics are not: the range times expand=1.8 overflows {dtype}"
    ))
    assert not obs.has_statistics
    if dtype == torch.float16:  # in a wider dtype it is fine
        obs(x.float())
        assert torch.isfinite(obs.get_qparams()["scale"]).all()


def test_qparams_backstop(backend, device):
    """Statistics that are not finite however they got there (set by hand,
    synced from a rank that propagates) never turn silently into scales."""
    obs = make("static_minmax", "input")
    obs(torch.randn(3, 32).to(device))
    obs.min_vals[1] = float("nan")
    with pytest.raises(ValueError, match=r"StaticMinMaxObserver\(base_name='input'\): the scale holds 1 non-finite \(1 NaN"):
        obs.get_qparams()
    assert obs.has_statistics  # kept
    obs.nonfinite = "propagate"
    assert torch.isnan(obs.get_qparams()["scale"][1])


@pytest.mark.parametrize("name", ("static_minmax", "minmax", "mse"))
def test_refused_values_are_recorded(backend, name, device):
    """Several observations before get_qparams: the error names the FIRST
    refused value's shape and counts every refused value's non-finite
    elements (counted here with torch); the observations after it are dropped
    with it, and the observer starts afresh, with the qparams of a fresh
    observer (on the reference backend: the oracle)."""
    from obskernels.backends import use_backend

    good, first, second = (torch.randn(s).to(device) for s in ((2, 3, 32), (5, 32), (1, 2, 32)))
    first[0, 1], first[3, 7] = float("nan"), float("inf")
    second[0, 1, 2] = float("-inf")
    values = (good, first, torch.randn(3, 32).to(device), second)
    nan = sum(int(torch.isnan(v).sum()) for v in values)
    pos = sum(int(torch.isposinf(v).sum()) for v in values)
    neg = sum(int(torch.isneginf(v).sum()) for v in values)
    obs = make(name, "input")
    for v in values:
        obs(v)  # nothing read back: no error yet
    with pytest.raises(ValueError, match=re.escape(
        f"the observed input tensor (shape (5, 32), torch.float32) holds {nan + pos + neg} "
        f"non-finite ({nan} NaN, {pos} +inf, {neg} -inf) of 160 values"
    )):
        obs.get_qparams()
    assert not obs.has_statistics and obs._num_observed_tokens == 0
    obs(good)
    qp = obs.get_qparams()
    with use_backend("reference"):
        want = make(name, "input")(good).get_qparams()
    assert torch.equal(qp["scale"], want["scale"]) and torch.equal(qp["zero_point"], want["zero_point"])
