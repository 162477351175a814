"""Property-based tests: hypothesis draws shapes, strategies,
formats, dtypes, layouts and observer sequences.

Checked on every draw:
- backends against each other (docs/spec.md §5): flatten and min/max bit for bit; the
  MSE search by the per-group rule (error within 1 + tol of the reference's
  best, >= 99% of groups exactly the reference's candidate);
- qparams from any range the operations return: scales finite and positive,
  zero points inside the quantized range, 0 dequantizes to exactly 0;
- the MSE choice is never worse than the min/max range by the search's own
  error measure (step 0 of the search IS the min/max range);
- observer sequences: min/max observers agree across backends bit for bit,
  static_minmax equals amin/amax over every value seen.

Deterministic (derandomize, no database) and cheap: example counts keep the
file well under a minute under the interpreter on one core.
"""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, calculate_range, generate_gparam
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from obskernels import Observer, ops
from obskernels.backends import triton_unavailable_reason, use_backend
from obskernels.spec.search import search_args

from helpers import DTYPES, TOL, assert_search_parity, formats, group_errors, reference_flatten

pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(None) is not None,
    reason=f"triton backend unavailable: {triton_unavailable_reason(None)}",
)


def fast(n):
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


FORMATS = formats("int8-sym", "int8-asym", "int4-sym", "int4-asym", "fp8")
NVFP4 = dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.float8_e4m3fn,
             zp_dtype=torch.float8_e4m3fn)
MXFP4 = dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.uint8)


@st.composite
def cases(draw, base_names=("weight", "input", "q")):
    """(value, base_name, args): a layout docs/spec.md §2 accepts, in a drawn format."""
    base_name = draw(st.sampled_from(base_names))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    if base_name == "weight":
        strategy = draw(st.sampled_from(("tensor", "channel", "group", "tensor_group", "block")))
    elif base_name == "input":
        strategy = draw(st.sampled_from(("tensor", "token", "group", "tensor_group")))
    else:
        strategy = draw(st.sampled_from(("tensor", "attn_head")))

    extra = {}
    if strategy == "tensor_group":
        fmt = dict(NVFP4)
        extra["group_size"] = 16
    elif strategy == "group" and draw(st.booleans()):
        fmt = dict(MXFP4)
        extra["group_size"] = 32
    else:
        fmt = dict(FORMATS[draw(st.sampled_from(sorted(FORMATS)))])
        if strategy == "group":
            extra["group_size"] = draw(st.sampled_from((4, 8, 16)))
    if strategy == "block":
        extra["block_structure"] = [draw(st.integers(1, 5)), draw(st.integers(1, 5))]
    if strategy == "token":
        extra["dynamic"] = True
    args = QuantizationArgs(strategy=strategy, **fmt, **extra)

    g = extra.get("group_size", 1)
    if base_name == "weight":
        cols = g * draw(st.integers(1, 3)) if strategy in ("group", "tensor_group") else draw(st.integers(1, 24))
        shape = (draw(st.integers(1, 9)), cols)
    elif base_name == "input":
        hidden = g * draw(st.integers(1, 3)) if strategy in ("group", "tensor_group") else draw(st.integers(1, 24))
        lead = draw(st.sampled_from(((draw(st.integers(1, 6)),), (draw(st.integers(1, 3)), draw(st.integers(1, 4))))))
        shape = (*lead, hidden)
    else:
        shape = tuple(draw(st.integers(1, n)) for n in (2, 3, 3, 8))

    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.integers(-3, 3))
    value = torch.randn(shape, generator=gen) * scale
    pattern = draw(st.sampled_from(("plain", "zero-slice", "constant", "outliers", "all-zero")))
    if pattern == "zero-slice":
        value[..., : max(1, shape[-1] // 2)] = 0
    elif pattern == "constant":
        value.fill_(draw(st.sampled_from((-1.5, 0.25, 3.0))) * scale)
    elif pattern == "outliers":
        value = value + (torch.rand(shape, generator=gen) < 0.1) * torch.randn(shape, generator=gen) * 8 * scale
    elif pattern == "all-zero":
        value.zero_()
    value = value.to(dtype)
    if draw(st.booleans()) and value.dim() >= 2:
        # the same values through a non-contiguous layout
        value = value.transpose(-1, -2).contiguous().transpose(-1, -2)
    return value, base_name, args


def both(fn):
    out = {}
    for b in ("reference", "triton"):
        with use_backend(b):
            out[b] = fn()
    return out["reference"], out["triton"]


def global_scale(args, mn, mx):
    if args.strategy != "tensor_group":
        return None
    a = torch.maximum(mx.max(), -mn.min()).reshape(1)
    return generate_gparam(-a, a)


def assert_valid_qparams(mn, mx, args, dtype, what):
    gs = global_scale(args, mn, mx)
    scale, zp = calculate_qparams(mn, mx, args, gs)
    assert torch.isfinite(scale).all() and (scale > 0).all(), f"{what}: scale {scale.flatten()[:8]}"
    qmin, qmax = calculate_range(args, zp.device)
    assert ((zp.float() >= float(qmin)) & (zp.float() <= float(qmax))).all(), f"{what}: zp {zp.flatten()[:8]}"
    zeros = torch.zeros(scale.shape + (1,), dtype=dtype, device=scale.device)
    dq = fake_quantize(zeros, scale.unsqueeze(-1), zp.unsqueeze(-1), args.model_copy(update={"strategy": "token"}),
                       global_scale=gs)
    assert torch.equal(dq, torch.zeros_like(dq)), f"{what}: q(0) = {dq.flatten()[:8]}"


# --------------------------------------------------------------------------- #
# min/max and flatten: backends bit for bit, and valid qparams
# --------------------------------------------------------------------------- #
@fast(100)
@given(cases())
def test_min_max_backends_agree_and_give_valid_qparams(device, case):
    value, base_name, args = case
    value = value.to(device)
    ref, got = both(lambda: ops.min_max(value, base_name, args))
    for r, g, what in zip(ref, got, ("min", "max")):
        assert r.shape == g.shape and r.dtype == g.dtype and torch.equal(r, g), (
            f"{what}: triton {g.flatten()[:8]} != reference {r.flatten()[:8]}"
        )
    assert_valid_qparams(ref[0], ref[1], args, value.dtype, "min_max")


@fast(30)
@given(cases(base_names=("weight",)))
def test_flatten_backends_agree(device, case):
    value, base_name, args = case
    value = value.to(device)
    ref, got = both(lambda: ops.flatten_for_calibration(value, base_name, args))
    assert ref.shape == got.shape and torch.equal(ref, got)


@fast(20)
@given(cases(base_names=("weight",)), st.data())
def test_g_idx_backends_agree(device, case, data):
    value, _, _ = case
    value = value.to(device)
    g = data.draw(st.sampled_from([d for d in (1, 2, 4) if value.shape[1] % d == 0]))
    args = QuantizationArgs(num_bits=8, strategy="group", group_size=g)
    perm = torch.randperm(value.shape[1], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    g_idx = (perm // g).to(device)
    ref, got = both(lambda: ops.min_max(value, "weight", args, g_idx=g_idx))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    # each group's range is that of its columns
    for k in range(value.shape[1] // g):
        cols = value[:, g_idx == k]
        assert torch.equal(ref[0][:, k], cols.amin(1)) and torch.equal(ref[1][:, k], cols.amax(1))


# --------------------------------------------------------------------------- #
# the MSE search
# --------------------------------------------------------------------------- #
SEARCH = st.fixed_dictionaries({
    "maxshrink": st.sampled_from((0.0, 0.2, 0.5, 1.0)),
    "patience": st.integers(0, 4),
    "grid": st.sampled_from((4, 10, 20)),
    "norm": st.sampled_from((1.0, 2.0, 2.4, 3.0)),
})


def errors_no_worse(value, base_name, args, mins, maxs, kw, slack):
    """Per group: error(choice) <= error(min/max range) * (1 + slack), by the
    search's own measure (its qparams args, its error formula)."""
    observed = reference_flatten(value, base_name, args)
    base_min, base_max = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    ekw = dict(norm=kw["norm"], importance=kw.get("importance"), flavour=kw.get("flavour", "mse"))
    e_choice = group_errors(value, base_name, args, mins, maxs, **ekw).double().flatten()
    e_base = group_errors(value, base_name, args, base_min, base_max, **ekw).double().flatten()
    e_base = torch.where(torch.isnan(e_base), math.inf, e_base)  # NaN never improves: treat as worst
    ok = e_choice <= e_base * (1 + slack)
    assert bool(ok.all()), (
        f"group {int((~ok).nonzero()[0])}: choice error {e_choice[~ok][0].item()} > "
        f"min/max range error {e_base[~ok][0].item()}"
    )


@fast(60)
@given(cases(), SEARCH, st.sampled_from(("mse", "imatrix")), st.data())
def test_mse_search_backends_agree_and_never_beat_by_min_max(device, case, kw, flavour, data):
    value, base_name, args = case
    value = value.to(device)
    kw = dict(kw, flavour=flavour)
    if flavour == "imatrix" and base_name == "weight" and args.strategy in ("channel", "group", "tensor_group"):
        if data.draw(st.booleans()):
            w = torch.rand(value.shape[1], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
            kw["importance"] = ((w * 3) / (w * 3).mean().clamp(min=1e-6)).to(device)
    ref, got = both(lambda: ops.mse_search(value, base_name, args, **kw))
    assert_search_parity(value, base_name, args, got, **kw)
    errors_no_worse(value, base_name, args, *ref, kw, slack=0.0)
    errors_no_worse(value, base_name, args, *got, kw, slack=TOL[value.dtype])
    qparam_args, _ = search_args(args)
    assert_valid_qparams(ref[0], ref[1], qparam_args, value.dtype, "mse_search")


# --------------------------------------------------------------------------- #
# observer sequences
# --------------------------------------------------------------------------- #
@st.composite
def sequences(draw):
    name = draw(st.sampled_from(("memoryless_minmax", "static_minmax", "minmax")))
    kw = {"averaging_constant": draw(st.sampled_from((0.01, 0.5, 1.0)))} if name == "minmax" else {}
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    strategy = draw(st.sampled_from(("tensor", "group")))
    hidden = 8 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(DTYPES))
    extra = {"group_size": 8} if strategy == "group" else {}
    batches = []
    for i in range(draw(st.integers(1, 4))):
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), hidden) if draw(st.booleans()) else (draw(st.integers(1, 6)), hidden)
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        batches.append((torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-2, 2))).to(dtype))
    return name, kw, QuantizationArgs(strategy=strategy, **FORMATS[fmt], **extra), batches


@fast(40)
@given(sequences())
def test_observer_sequences_agree_across_backends(device, seq):
    name, kw, args, batches = seq
    batches = [x.to(device) for x in batches]
    results = {}
    for b in ("reference", "triton"):
        with use_backend(b):
            obs = Observer.load_from_registry(name, base_name="input", args=args.model_copy(deep=True), **kw)
            for x in batches:
                obs(x)
            stats = (obs.min_vals.clone(), obs.max_vals.clone())
            results[b] = (stats, obs.get_qparams(), obs._num_observed_tokens)
    (ref_stats, ref_qp, ref_tokens), (got_stats, got_qp, got_tokens) = results["reference"], results["triton"]
    assert torch.equal(ref_stats[0], got_stats[0]) and torch.equal(ref_stats[1], got_stats[1])
    assert torch.equal(ref_qp["scale"], got_qp["scale"]) and torch.equal(ref_qp["zero_point"], got_qp["zero_point"])
    assert ref_tokens == got_tokens == sum(x.numel() // x.shape[-1] for x in batches)
    assert_valid_qparams(*ref_stats, args, batches[0].dtype, name)
    if name == "static_minmax":
        flats = [reference_flatten(x, "input", args) for x in batches]
        want_min = torch.stack([f.amin(dim=(0, -1)) for f in flats]).amin(0)
        want_max = torch.stack([f.amax(dim=(0, -1)) for f in flats]).amax(0)
        assert torch.equal(ref_stats[0], want_min) and torch.equal(ref_stats[1], want_max)
