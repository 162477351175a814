"""The bad-input matrix: every public operation and the observers,
on every backend.

Each row is either a correct result (checked against an independent
computation or the same operation on a contiguous copy) or a ValueError /
TypeError whose message names the argument and what was expected (the
``match`` column). Errors are raised before anything launches, so the
triton rows run no kernel; the messages are also compared across backends.

Documented outcomes that are not ValueError / TypeError:
- float64 values: the reference computes them (as llm-compressor does); the
  kernels raise KernelUnsupportedError, so "auto" falls back to the reference
  with one logged message and a forced "triton" reports it.
- a value on a device a forced backend cannot run on (meta for triton):
  BackendUnavailableError, as for any forced backend that cannot run.
- get_qparams without statistics: RuntimeError (a state error, not a bad
  argument; llm-compressor asserts).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels import Observer, ops
from obskernels.backends import (
    BackendUnavailableError,
    KernelUnsupportedError,
    triton_unavailable_reason,
    use_backend,
)

from helpers import outcome
from helpers import qargs as _qargs

MSE = dict(maxshrink=0.2, patience=5, grid=20, norm=2.4)
VALUE_OPS = ("flatten_for_calibration", "min_max", "mse_search")
#: and a first observation's statistics with its qparams: the same checks of the value
CHECKED_OPS = VALUE_OPS + ("min_max_qparams", "mse_search_qparams")


def qargs(strategy="channel", **kw):  # the rows below default to per-channel args
    return _qargs(strategy, **kw)


def unchecked(base="group", **update):
    """Args pydantic would refuse at construction, as assignment or model_copy make them."""
    fields = {"group": dict(group_size=4), "block": dict(block_structure=[2, 2])}.get(base, {})
    return qargs(base, **fields).model_copy(update=update)


def call(op, value, base_name, args, **kw):
    if op.startswith("mse_search"):
        return getattr(ops, op)(value, base_name, args, **{**MSE, **kw})
    return getattr(ops, op)(value, base_name, args, **kw)


def assert_same_error_on_every_backend(named_calls):
    """Each ``(name, fn)``: ``fn()`` raises a ValueError or TypeError, of the
    same type and message on the reference and the triton backend."""
    reason = triton_unavailable_reason(None)
    if reason is not None:
        pytest.skip(f"triton backend unavailable: {reason}")
    for name, fn in named_calls:
        got = {}
        for b in ("reference", "triton"):
            with use_backend(b):
                got[b] = outcome(fn)
        want = got["reference"]
        assert want is not None and want[0] in (ValueError, TypeError), (name, want)
        assert got["triton"] == want, f"{name}: triton {got['triton']} != reference {want}"


# --------------------------------------------------------------------------- #
# rows raising for every (value, base_name, args) operation
# --------------------------------------------------------------------------- #
W = lambda *shape: torch.randn(*shape)  # noqa: E731

ERRORS = [
    # id, value, base_name, args, error, match
    ("weight-3d", W(2, 3, 4), "weight", qargs(), ValueError, r"value of a weight must be 2-D"),
    ("weight-1d", W(8), "weight", qargs(), ValueError, r"value of a weight must be 2-D"),
    ("input-1d", W(8), "input", qargs("tensor"), ValueError, r"value of an activation must be"),
    ("input-4d", W(1, 2, 3, 4), "output", qargs("tensor"), ValueError, r"value of an activation must be"),
    ("q-3d", W(2, 3, 4), "q", qargs("tensor"), ValueError, r"value of attention 'q' must be \(batch, heads"),
    ("group-not-dividing-weight", W(4, 10), "weight", qargs("group", group_size=4), ValueError,
     r"value has 10 columns, not divisible by group_size 4"),
    ("group-not-dividing-input", W(2, 3, 10), "input", qargs("group", group_size=4), ValueError,
     r"value has 10 columns, not divisible by group_size 4"),
    ("group-size-none", W(4, 8), "weight", unchecked(group_size=None), ValueError,
     r"args.group_size must be a positive integer, got None"),
    ("group-size-zero", W(4, 8), "weight", unchecked(group_size=0), ValueError,
     r"args.group_size must be a positive integer, got 0"),
    ("block-zero", W(4, 8), "weight", unchecked("block", block_structure=[0, 2]), ValueError,
     r"args.block_structure must be \[block_height, block_width\]"),
    ("block-one-dim", W(4, 8), "weight", unchecked("block", block_structure=[2]), ValueError,
     r"args.block_structure must be"),
    ("block-negative", W(4, 8), "weight", unchecked("block", block_structure=[2, -2]), ValueError,
     r"args.block_structure must be"),
    ("block-none", W(4, 8), "weight", unchecked("block", block_structure=None), ValueError,
     r"args.block_structure must be"),
    ("block-string", W(4, 8), "weight", unchecked("block", block_structure="2x2"), ValueError,
     r"args.block_structure must be"),
    ("base-name-unknown", W(4, 8), "bias", qargs(), ValueError, r"base_name must be one of .* got 'bias'"),
    ("base-name-none", W(4, 8), None, qargs(), ValueError, r"base_name must be one of .* got None"),
    ("base-name-int", W(4, 8), 3, qargs(), ValueError, r"base_name must be one of .* got 3"),
    ("strategy-unknown", W(4, 8), "weight", unchecked("channel", strategy="rowwise"), ValueError,
     r"args.strategy must be one of .* got 'rowwise'"),
    ("strategy-none", W(4, 8), "weight", unchecked("channel", strategy=None), ValueError,
     r"args.strategy is None"),
    ("args-dict", W(4, 8), "weight", {"num_bits": 8}, TypeError, r"args must be a QuantizationArgs, got dict"),
    ("weight-token", W(4, 8), "weight", qargs("token"), ValueError,
     r"strategy 'token' cannot be applied to base_name 'weight'"),
    ("weight-attn_head", W(4, 8), "weight", qargs("attn_head"), ValueError,
     r"strategy 'attn_head' cannot be applied to base_name 'weight'"),
    ("input-channel", W(2, 8), "input", qargs("channel"), ValueError,
     r"strategy 'channel' cannot be applied to base_name 'input'"),
    ("output-block", W(2, 8), "output", qargs("block", block_structure=[2, 2]), ValueError,
     r"strategy 'block' cannot be applied to base_name 'output'"),
    ("input-attn_head", W(2, 8), "input", qargs("attn_head"), ValueError,
     r"strategy 'attn_head' cannot be applied to base_name 'input'"),
    ("q-group", W(1, 2, 3, 8), "q", qargs("group", group_size=4), ValueError,
     r"strategy 'group' cannot be applied to base_name 'q'"),
    ("k-channel", W(1, 2, 3, 8), "k", qargs("channel"), ValueError,
     r"strategy 'channel' cannot be applied to base_name 'k'"),
    ("v-token", W(1, 2, 3, 8), "v", qargs("token"), ValueError,
     r"strategy 'token' cannot be applied to base_name 'v'"),
    ("value-list", [[1.0, 2.0]], "weight", qargs(), TypeError, r"expected a torch.Tensor, got list"),
] + [
    (f"dtype-{str(dt).split('.')[-1]}", torch.ones(4, 8, dtype=dt), "weight", qargs(), TypeError,
     rf"value dtype must be one of float32, float16, bfloat16 .*got {dt}")
    for dt in (torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn)
]


@pytest.mark.parametrize("op", CHECKED_OPS)
@pytest.mark.parametrize("row", ERRORS, ids=[r[0] for r in ERRORS])
def test_value_op_rejects(backend, op, row):
    _, value, base_name, args, error, match = row
    with pytest.raises(error, match=match):
        call(op, value, base_name, args)


G_IDX = [
    # id, g_idx, error, match (value (4, 8), group_size 2: 4 groups)
    ("short", torch.arange(6) // 2, ValueError, r"g_idx must be 1-D with one entry per column \(8\), got shape \(6,\)"),
    ("2d", (torch.arange(8) // 2).reshape(1, 8), ValueError, r"g_idx must be 1-D with one entry per column"),
    ("above-range", torch.tensor([0, 0, 1, 1, 2, 2, 4, 4]), ValueError, r"g_idx values must lie in \[0, 4\), got range \[0, 4\]"),
    ("negative", torch.tensor([-1, -1, 1, 1, 2, 2, 3, 3]), ValueError, r"g_idx values must lie in \[0, 4\)"),
    ("uneven", torch.tensor([0, 0, 0, 1, 2, 2, 3, 3]), ValueError, r"g_idx must assign exactly group_size=2 columns"),
    ("float", torch.arange(8.0) // 2, TypeError, r"g_idx must hold integers, got dtype torch.float32"),
    ("bool", torch.ones(8, dtype=torch.bool), TypeError, r"g_idx must hold integers"),
    ("list", list(range(8)), TypeError, r"g_idx must be a torch.Tensor, got list"),
    ("meta", torch.arange(8, device="meta"), ValueError, r"g_idx is on meta but value is on cpu; expected the same device"),
]


@pytest.mark.parametrize("op", ("flatten_for_calibration", "min_max", "min_max_qparams"))
@pytest.mark.parametrize("row", G_IDX, ids=[r[0] for r in G_IDX])
def test_g_idx_rejected(backend, op, row):
    _, g_idx, error, match = row
    with pytest.raises(error, match=match):
        call(op, torch.randn(4, 8), "weight", qargs("group", group_size=2), g_idx=g_idx)


@pytest.mark.parametrize("op", ("flatten_for_calibration", "min_max", "min_max_qparams"))
def test_g_idx_with_another_strategy_rejected(backend, op):
    with pytest.raises(ValueError, match=r"g_idx applies only to weights with the 'group' strategy"):
        call(op, torch.randn(4, 8), "weight", qargs("channel"), g_idx=torch.arange(8) // 2)


IMPORTANCE = [
    # id, importance, base_name, args, error, match (value (4, 8) unless activation)
    ("short", torch.ones(5), "weight", qargs(), ValueError,
     r"importance must be 1-D with one entry per input column \(8\), got shape \(5,\)"),
    ("2d", torch.ones(1, 8), "weight", qargs(), ValueError, r"importance must be 1-D with one entry per input column"),
    ("negative", torch.tensor([1.0] * 7 + [-0.5]), "weight", qargs(), ValueError,
     r"importance must be non-negative, got minimum -0.5"),
    ("nan", torch.tensor([1.0] * 7 + [float("nan")]), "weight", qargs(), ValueError,
     r"importance must be finite, got 1 non-finite of 8"),
    ("inf", torch.tensor([float("inf")] * 2 + [1.0] * 6), "weight", qargs(), ValueError,
     r"importance must be finite, got 2 non-finite of 8"),
    ("complex", torch.ones(8, dtype=torch.complex64), "weight", qargs(), TypeError,
     r"importance must hold real numbers"),
    ("bool", torch.ones(8, dtype=torch.bool), "weight", qargs(), TypeError, r"importance must hold real numbers"),
    ("list", [1.0] * 8, "weight", qargs(), TypeError, r"importance must be a torch.Tensor, got list"),
    ("meta", torch.ones(8, device="meta"), "weight", qargs(), ValueError,
     r"importance is on meta but value is on cpu; expected the same device"),
    ("activation", torch.ones(8), "input", qargs("tensor"), ValueError,
     r"importance applies only to weights with the 'channel', 'group' or 'tensor_group' strategy"),
    ("tensor-strategy", torch.ones(8), "weight", qargs("tensor"), ValueError,
     r"importance applies only to weights"),
]


@pytest.mark.parametrize("row", IMPORTANCE, ids=[r[0] for r in IMPORTANCE])
def test_importance_rejected(backend, row):
    _, importance, base_name, args, error, match = row
    value = torch.randn(4, 8) if base_name == "weight" else torch.randn(3, 8)
    with pytest.raises(error, match=match):
        call("mse_search", value, base_name, args, importance=importance, flavour="imatrix")


def test_integer_importance_is_accepted(backend):
    value = torch.randn(4, 8)
    got = call("mse_search", value, "weight", qargs(), importance=torch.arange(1, 9), flavour="imatrix")
    with use_backend("reference"):
        want = call("mse_search", value, "weight", qargs(), importance=torch.arange(1.0, 9.0), flavour="imatrix")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


SEARCH_PARAMS = [
    (dict(grid=0), r"grid must be a finite number > 0, got 0"),
    (dict(grid=float("inf")), r"grid must be a finite number > 0"),
    (dict(patience=-1), r"patience must be an integer >= 0, got -1"),
    (dict(patience=1.5), r"patience must be an integer >= 0, got 1.5"),
    (dict(maxshrink=1.5), r"maxshrink must be in \[0, 1\], got 1.5"),
    (dict(norm=float("nan")), r"norm must be a finite positive number, got nan"),
    (dict(norm=0), r"norm must be a finite positive number, got 0"),
    (dict(expand=0.5), r"expand must be a finite number >= 1, got 0.5"),
    (dict(flavour="mae"), r"flavour must be one of \('mse', 'imatrix'\), got 'mae'"),
]


@pytest.mark.parametrize("kw,match", SEARCH_PARAMS, ids=[str(k) for k, _ in SEARCH_PARAMS])
def test_search_params_rejected(backend, kw, match):
    with pytest.raises(ValueError, match=match):
        call("mse_search", torch.randn(4, 8), "weight", qargs(), **kw)


def test_every_error_is_the_same_on_every_backend():
    """Same type and message, reference vs triton, for every row above."""
    calls = []
    for name, value, base_name, args, _, _ in ERRORS:
        for op in CHECKED_OPS:
            calls.append((f"{name} {op}", lambda op=op, v=value, b=base_name, a=args: call(op, v, b, a)))
    for name, g_idx, _, _ in G_IDX:
        for op in ("flatten_for_calibration", "min_max", "min_max_qparams"):
            calls.append((f"g_idx {name} {op}", lambda op=op, g=g_idx: call(
                op, torch.ones(4, 8), "weight", qargs("group", group_size=2), g_idx=g)))
    for name, imp, base_name, args, _, _ in IMPORTANCE:
        value = torch.ones(4, 8) if base_name == "weight" else torch.ones(3, 8)
        calls.append((f"importance {name}", lambda v=value, i=imp, b=base_name, a=args: call(
            "mse_search", v, b, a, importance=i, flavour="imatrix")))
    for kw, _ in SEARCH_PARAMS:
        calls.append((f"search {kw}", lambda kw=kw: call("mse_search", torch.ones(4, 8), "weight", qargs(), **kw)))
    assert_same_error_on_every_backend(calls)


# --------------------------------------------------------------------------- #
# accumulate_sq
# --------------------------------------------------------------------------- #
def count(n=0):
    return torch.full((1,), n, dtype=torch.int64)


ACC_ERRORS = [
    ("x-int", lambda: (torch.ones(4, 8, dtype=torch.int32), torch.zeros(8), count()), TypeError,
     r"x dtype must be float32, float16, bfloat16 or float64, got torch.int32"),
    ("x-bool", lambda: (torch.ones(4, 8, dtype=torch.bool), torch.zeros(8), count()), TypeError, r"x dtype must be"),
    ("x-complex", lambda: (torch.ones(4, 8, dtype=torch.complex64), torch.zeros(8), count()), TypeError, r"x dtype must be"),
    ("x-0d", lambda: (torch.tensor(1.0), torch.zeros(1), count()), ValueError,
     r"x must be \(\.\.\., channels\) with at least one channel, got shape \(\)"),
    ("x-no-channels", lambda: (torch.randn(4, 0), torch.zeros(0), count()), ValueError,
     r"x must be \(\.\.\., channels\) with at least one channel, got shape \(4, 0\)"),
    ("x-list", lambda: ([[1.0]], torch.zeros(1), count()), TypeError, r"expected a torch.Tensor, got list"),
    ("sum-fp16", lambda: (torch.randn(4, 8), torch.zeros(8, dtype=torch.float16), count()), TypeError,
     r"sum_buf must be a float32 torch.Tensor"),
    ("sum-shape", lambda: (torch.randn(4, 8), torch.zeros(9), count()), ValueError,
     r"sum_buf must have shape \(8,\) to match x's last dim, got \(9,\)"),
    ("sum-list", lambda: (torch.randn(4, 8), [0.0] * 8, count()), TypeError, r"sum_buf must be a float32"),
    ("sum-expanded", lambda: (torch.randn(4, 8), torch.zeros(1).expand(8), count()), ValueError,
     r"sum_buf must not be an expanded \(stride 0\) view"),
    ("sum-meta", lambda: (torch.randn(4, 8), torch.zeros(8, device="meta"), count()), ValueError,
     r"sum_buf is on meta but x is on cpu"),
    ("count-int32", lambda: (torch.randn(4, 8), torch.zeros(8), torch.zeros(1, dtype=torch.int32)), TypeError,
     r"count_buf must be an int64 torch.Tensor"),
    ("count-two", lambda: (torch.randn(4, 8), torch.zeros(8), torch.zeros(2, dtype=torch.int64)), ValueError,
     r"count_buf must hold one element, got shape \(2,\)"),
    ("count-meta", lambda: (torch.randn(4, 8), torch.zeros(8), torch.zeros(1, dtype=torch.int64, device="meta")),
     ValueError, r"count_buf is on meta but x is on cpu"),
]


@pytest.mark.parametrize("row", ACC_ERRORS, ids=[r[0] for r in ACC_ERRORS])
def test_accumulate_sq_rejects(backend, row):
    _, make, error, match = row
    x, sum_buf, count_buf = make()
    before = (sum_buf.clone(), count_buf.clone()) if isinstance(sum_buf, torch.Tensor) and sum_buf.device.type != "meta" else None
    with pytest.raises(error, match=match):
        ops.accumulate_sq(x, sum_buf, count_buf)
    if before is not None and count_buf.device.type != "meta":
        assert torch.equal(sum_buf, before[0]) and torch.equal(count_buf, before[1]), "buffers changed"


def test_accumulate_sq_errors_are_the_same_on_every_backend():
    assert_same_error_on_every_backend(
        [(name, lambda make=make: ops.accumulate_sq(*make())) for name, make, _, _ in ACC_ERRORS])


# combine_statistics: (value, base_name, args, new_min, new_max) -> error
COMBINE_ERRORS = [
    ("stats-of-another-shape", lambda: (torch.randn(8, 64), "weight", qargs("group", group_size=16),
                                        torch.zeros(8, 2), torch.ones(8, 2)),
     ValueError, r"new statistics of shape \(8, 2\) do not match the value's groups \(8, 4\)"),
    ("stats-of-two-shapes", lambda: (torch.randn(8, 64), "weight", qargs(), torch.zeros(8, 1), torch.ones(1, 8)),
     ValueError, r"new_min and new_max must have the same shape, got \(8, 1\) and \(1, 8\)"),
    ("bad-base-name", lambda: (torch.randn(8, 64), "bias", qargs(), torch.zeros(8, 1), torch.ones(8, 1)),
     ValueError, r"base_name must be one of"),
    ("weight-3d", lambda: (torch.randn(2, 8, 64), "weight", qargs(), torch.zeros(8, 1), torch.ones(8, 1)),
     ValueError, r"value of a weight must be 2-D"),
    ("group-not-dividing", lambda: (torch.randn(8, 10), "weight", qargs("group", group_size=4),
                                    torch.zeros(8, 2), torch.ones(8, 2)),
     ValueError, r"value has 10 columns, not divisible by group_size 4"),
]


@pytest.mark.parametrize("row", COMBINE_ERRORS, ids=[r[0] for r in COMBINE_ERRORS])
def test_combine_statistics_rejects(backend, row):
    # the statistics must be the value's: the same flatten checks and group
    # shape as min_max, on every backend
    _, make, error, match = row
    with pytest.raises(error, match=match):
        ops.combine_statistics(*make())


def test_combine_statistics_errors_are_the_same_on_every_backend():
    assert_same_error_on_every_backend(
        [(name, lambda make=make: ops.combine_statistics(*make())) for name, make, _, _ in COMBINE_ERRORS])


def test_combine_statistics_rejects_statistics_of_two_dtypes(backend):
    with pytest.raises(TypeError, match=r"new_min and new_max must have the same dtype, got "
                                        r"torch.bfloat16 and torch.float32"):
        ops.combine_statistics(torch.randn(8, 64), "weight", qargs(), torch.zeros(8, 1, dtype=torch.bfloat16),
                               torch.ones(8, 1))
    with pytest.raises(TypeError, match=r"new_min dtype must be one of .* got torch.int32"):
        ops.combine_statistics(torch.randn(8, 64), "weight", qargs(), torch.zeros(8, 1, dtype=torch.int32),
                               torch.ones(8, 1, dtype=torch.int32))


# Every tensor of a call on the value's device (the first tensor of the call):
# (id, op, make -> (positional, keyword arguments), match). The value is on
# the CPU, so every backend takes the call; the odd tensor is on meta.
def _on_meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device="meta")


def _record(device="cpu"):
    from obskernels.spec.record import STATUS_INIT

    return torch.tensor(STATUS_INIT, dtype=torch.int64, device=device)


DEVICE_ERRORS = [
    ("min_max held", "min_max",
     lambda: ((torch.randn(8, 64), "weight", qargs()), dict(held=(_on_meta(8, 1), _on_meta(8, 1)))),
     r"held statistics \(torch.float32 on meta\) must have the new statistics' dtype and device "
     r"\(torch.float32 on cpu\)"),
    ("min_max status", "min_max",
     lambda: ((torch.randn(8, 64), "weight", qargs()), dict(status=_record("meta"))),
     r"status is on meta but value is on cpu; expected the same device"),
    ("combine new_min", "combine_statistics",
     lambda: ((torch.randn(8, 64), "weight", qargs(), _on_meta(8, 1), _on_meta(8, 1)), {}),
     r"new_min is on meta but value is on cpu; expected the same device"),
    ("combine new_max", "combine_statistics",
     lambda: ((torch.randn(8, 64), "weight", qargs(), torch.zeros(8, 1), _on_meta(8, 1)), {}),
     r"new_max is on meta but new_min is on cpu; expected the same device"),
    ("combine status", "combine_statistics",
     lambda: ((torch.randn(8, 64), "weight", qargs(), torch.zeros(8, 1), torch.ones(8, 1)),
              dict(status=_record("meta"))),
     r"status is on meta but value is on cpu; expected the same device"),
    ("qparams max_vals", "calculate_qparams",
     lambda: ((torch.zeros(8, 1), _on_meta(8, 1), qargs()), {}),
     r"max_vals is on meta but min_vals is on cpu; expected the same device"),
    ("qparams global_scale", "calculate_qparams",
     lambda: ((torch.zeros(8, 1), torch.ones(8, 1), qargs()), dict(global_scale=_on_meta(1))),
     r"global_scale is on meta but min_vals is on cpu; expected the same device"),
    ("qparams carry", "calculate_qparams",
     lambda: ((torch.zeros(8, 1), torch.ones(8, 1), qargs()), dict(carry=_record("meta"))),
     r"carry is on meta but min_vals is on cpu; expected the same device"),
    ("qparams fused", "calculate_qparams",
     lambda: ((torch.zeros(8, 1), torch.ones(8, 1), qargs()),
              dict(fused=[(torch.zeros(3, 1), _on_meta(3, 1))])),
     r"fused max_vals is on meta but min_vals is on cpu; expected the same device"),
    ("importance count_buf", "importance",
     lambda: ((torch.ones(8), torch.ones(1, dtype=torch.int64, device="meta"), _record()), {}),
     r"count_buf is on meta but sum_buf is on cpu; expected the same device"),
    ("importance status", "importance",
     lambda: ((torch.ones(8), torch.ones(1, dtype=torch.int64), _record("meta")), {}),
     r"status is on meta but sum_buf is on cpu; expected the same device"),
]


@pytest.mark.parametrize("row", DEVICE_ERRORS, ids=[r[0] for r in DEVICE_ERRORS])
def test_tensors_of_a_call_on_another_device(backend, row):
    _, op, make, match = row
    args, kwargs = make()
    with pytest.raises(ValueError, match=match):
        getattr(ops, op)(*args, **kwargs)


def _call_op(op, make):
    args, kwargs = make()
    return getattr(ops, op)(*args, **kwargs)


def test_device_errors_are_the_same_on_every_backend():
    assert_same_error_on_every_backend(
        [(name, lambda op=op, make=make: _call_op(op, make)) for name, op, make, _ in DEVICE_ERRORS])


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("fp32", "fp64-fallback"))
@pytest.mark.parametrize("op", CHECKED_OPS + ("combine_statistics",))
def test_a_call_is_checked_once(op, dtype, monkeypatch):
    """The front checks a call once and hands the checked call down: the
    value's flatten checks run once per call on every backend, also when
    "auto" falls back from the kernels (float64) to the reference, and also
    for the search, which flattens the importance as well. A later call of
    the same signature is made from the checked one: no check at all (the
    search with checked importance values excepted: those are read each time)."""
    from obskernels import ops as ops_module

    import obskernels.spec.layout as spec_layout

    seen = []
    original = spec_layout.check_flatten

    def counting(*args, **kwargs):
        seen.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(spec_layout, "check_flatten", counting)
    w = torch.randn(8, 64, dtype=dtype)
    args = qargs("group", group_size=16)
    imp = torch.rand(64) + 0.5
    run = {
        "flatten_for_calibration": lambda: ops.flatten_for_calibration(w, "weight", args),
        "min_max": lambda: ops.min_max(w, "weight", args),
        "min_max_qparams": lambda: ops.min_max_qparams(w, "weight", args, record=True),
        "mse_search_qparams": lambda: ops.mse_search_qparams(w, "weight", args, record=True, **MSE),
        "mse_search": lambda: ops.mse_search(w, "weight", args, importance=imp, flavour="imatrix", **MSE),
        "combine_statistics": lambda: ops.combine_statistics(
            w, "weight", args, torch.zeros(8, 4, dtype=dtype), torch.ones(8, 4, dtype=dtype)),
    }[op]
    backends = ["reference", "auto"] + (["triton"] if triton_unavailable_reason(None) is None else [])
    for b in backends:
        if b == "triton" and dtype == torch.float64:
            continue  # a forced triton reports float64 instead (test_float64_forced_triton_...)
        seen.clear()
        monkeypatch.setattr(ops_module, "_PLANS", {})  # a signature not seen before
        with use_backend(b):
            run()
            assert seen == ["weight"], (b, seen)
            run()
        again = ["weight"] if op == "mse_search" else []  # normalised importance: its values
        assert seen == ["weight"] + again, (b, seen)


def test_fused_statistics_may_come_from_an_iterator(backend):
    # the call reads `fused` once and hands the pairs on: a generator gives
    # the global scale of the same pairs as a list
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                            group_size=16, scale_dtype=torch.float8_e4m3fn)
    mn, mx = -torch.rand(4, 2) * 3, torch.rand(4, 2) * 5
    pairs = [(mn, mx), (-torch.rand(3, 2) * 7, torch.rand(3, 2))]
    want = ops.calculate_qparams(mn, mx, args, fused=pairs)
    got = ops.calculate_qparams(mn, mx, args, fused=(p for p in pairs))
    for g, w in zip(got[:3], want[:3]):
        assert torch.equal(g.float(), w.float()), (g, w)


def test_accumulate_sq_x_on_meta(backend):
    x, s, c = torch.randn(4, 8, device="meta"), torch.zeros(8), count()
    if backend == "triton":
        # a forced backend that cannot run on the value's device says so first
        with pytest.raises(BackendUnavailableError, match=r"tensors on device 'meta' are not supported"):
            ops.accumulate_sq(x, s, c)
    else:
        with pytest.raises(ValueError, match=r"sum_buf is on cpu but x is on meta"):
            ops.accumulate_sq(x, s, c)


def fp64_sum_sq(x):
    """Independent E[x²] numerator: fp32 squares of the fp32-cast values, summed in fp64."""
    return x.float().double().pow(2).reshape(-1, x.shape[-1]).sum(0)


ACC_VIEWS = {
    "no-tokens": lambda: torch.randn(0, 3, 8),
    "transposed": lambda: torch.randn(8, 5).t(),
    "strided": lambda: torch.randn(5, 16)[:, ::2],
    "3d-transposed": lambda: torch.randn(3, 2, 8).transpose(0, 1),
    "expanded-tokens": lambda: torch.randn(1, 8).expand(6, 8),
    "expanded-batch": lambda: torch.randn(1, 3, 8).expand(4, 3, 8),
    "expanded-scalar": lambda: torch.tensor(1.5).expand(3, 4, 8),
    "bf16-transposed": lambda: torch.randn(8, 5, dtype=torch.bfloat16).t(),
    "fp64": lambda: torch.randn(5, 8, dtype=torch.float64) * 1e3,
}


@pytest.mark.parametrize("name", list(ACC_VIEWS))
def test_accumulate_sq_views_and_dtypes_are_correct(backend, name):
    x = ACC_VIEWS[name]()
    sum_buf = torch.full((16,), 0.25)[::2]  # a strided buffer is fine too
    start = sum_buf.clone()
    count_buf = count(3)
    ops.accumulate_sq(x, sum_buf, count_buf)
    want = start.double() + fp64_sum_sq(x)
    torch.testing.assert_close(sum_buf.double(), want, rtol=1e-5, atol=0)  # docs/spec.md §5
    assert int(count_buf) == 3 + x.numel() // 8


# --------------------------------------------------------------------------- #
# float64, empty values, views, devices
# --------------------------------------------------------------------------- #
def test_float64_reference_computes_in_float64():
    w = torch.randn(6, 8, dtype=torch.float64)
    with use_backend("reference"):
        mn, mx = ops.min_max(w, "weight", qargs("group", group_size=4))
        assert mn.dtype == torch.float64
        assert torch.equal(mn, w.reshape(6, 2, 4).amin(-1)) and torch.equal(mx, w.reshape(6, 2, 4).amax(-1))
        smin, smax = call("mse_search", w, "weight", qargs())
        # each row's choice is its fp64 range times one grid point p = 1 - i/20
        base_min, base_max = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        grid = torch.tensor([1 - i / 20 for i in range(4)], dtype=torch.float64)
        assert smin.dtype == torch.float64
        assert bool(((base_min * grid == smin) & (base_max * grid == smax)).any(1).all())


@pytest.mark.parametrize("op", CHECKED_OPS)
def test_float64_forced_triton_is_a_clear_error(op):
    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    args = qargs("block", block_structure=[2, 2]) if op == "flatten_for_calibration" else qargs()
    with use_backend("triton"), pytest.raises(KernelUnsupportedError, match=r"value dtype float64"):
        call(op, torch.randn(4, 8, dtype=torch.float64), "weight", args)


def test_float64_bad_input_still_names_the_argument_on_triton():
    # validation comes before the float64 verdict
    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    with use_backend("triton"), pytest.raises(ValueError, match=r"value of a weight must be 2-D"):
        ops.min_max(torch.randn(2, 4, 8, dtype=torch.float64), "weight", qargs())


@pytest.mark.parametrize("op", CHECKED_OPS)
def test_float64_auto_falls_back_once_with_a_log(op, monkeypatch, caplog):
    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    monkeypatch.setattr(ops, "_fallbacks_logged", set())
    w = torch.randn(4, 8, dtype=torch.float64)
    args = qargs("block", block_structure=[3, 3])
    with use_backend("reference"):
        want = call(op, w, "weight", args)
    with use_backend("auto"), caplog.at_level(logging.WARNING, logger="obskernels"):
        for _ in range(2):
            got = call(op, w, "weight", args)
            for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert (g is None and r is None) if r is None else torch.equal(g, r)
    logs = [r for r in caplog.records if "float64" in r.getMessage()]
    assert len(logs) == 1, [r.getMessage() for r in caplog.records]
    assert op in logs[0].getMessage() and "reference" in logs[0].getMessage()


EMPTY_FLATTEN = [
    # value, base_name, args, flattened shape
    (torch.randn(0, 16), "weight", qargs("channel"), (1, 0, 1, 16)),
    (torch.randn(4, 0), "weight", qargs("group", group_size=4), (1, 4, 0, 4)),
    (torch.randn(4, 0), "weight", qargs("block", block_structure=[2, 2]), (1, 2, 0, 4)),
    (torch.randn(0, 16), "weight", qargs("tensor"), (1, 1, 0)),
    (torch.randn(4, 0), "input", qargs("tensor"), (4, 1, 0)),
    (torch.randn(0, 16), "input", qargs("group", group_size=4), (0, 4, 4)),
    (torch.randn(2, 0, 8), "output", qargs("token"), (2, 0, 8)),
    (torch.randn(1, 2, 0, 4), "q", qargs("tensor"), (0, 1, 8)),
    (torch.randn(1, 2, 0, 4), "k", qargs("attn_head"), (0, 2, 1, 1, 4)),
]


@pytest.mark.parametrize("value,base_name,args,shape", EMPTY_FLATTEN, ids=[str(i) for i in range(len(EMPTY_FLATTEN))])
def test_empty_flatten_has_the_flattened_shape(backend, value, base_name, args, shape):
    assert tuple(ops.flatten_for_calibration(value, base_name, args).shape) == shape


@pytest.mark.parametrize("op", ("min_max", "mse_search"))
@pytest.mark.parametrize("value,base_name,args,shape", EMPTY_FLATTEN, ids=[str(i) for i in range(len(EMPTY_FLATTEN))])
def test_empty_reduction(backend, op, value, base_name, args, shape):
    """No groups (a 0 in the qparam shape): an empty result. Groups without
    elements: a ValueError naming the shape (an empty group has no min/max)."""
    qshape = shape[1:-1]
    if 0 in qshape:
        mn, mx = call(op, value, base_name, args)
        assert tuple(mn.shape) == qshape and tuple(mx.shape) == qshape and mn.dtype == value.dtype
    else:
        match = re.escape(f"value of shape {tuple(value.shape)}") + r" leaves its \d+ group\(s\) empty"
        with pytest.raises(ValueError, match=match):
            call(op, value, base_name, args)


def views():
    """(id, view, base_name, args): non-contiguous, transposed and stride-0 values."""
    rows = []
    weights = {
        "transposed": torch.randn(16, 8).t(),
        "strided": torch.randn(8, 32)[:, ::2],
        "expanded-rows": torch.randn(1, 16).expand(8, 16),
        "expanded-cols": torch.randn(8, 1).expand(8, 16),
        "expanded-scalar": torch.tensor(-0.75).expand(8, 16),
    }
    for name, w in weights.items():
        for sname, args in (
            ("tensor", qargs("tensor")),
            ("channel", qargs("channel")),
            ("group", qargs("group", group_size=4)),
            ("block", qargs("block", block_structure=[3, 5])),
        ):
            rows.append((f"weight-{name}-{sname}", w, "weight", args))
    acts = {
        "transposed": torch.randn(3, 2, 16).transpose(0, 1),
        "strided": torch.randn(2, 3, 32)[..., ::2],
        "expanded": torch.randn(1, 1, 16).expand(2, 3, 16),
    }
    for name, x in acts.items():
        for sname, args in (("tensor", qargs("tensor")), ("group", qargs("group", group_size=8)), ("token", qargs("token"))):
            rows.append((f"input-{name}-{sname}", x, "input", args))
    attn = {
        "bshd-transposed": torch.randn(1, 3, 2, 8).transpose(1, 2),
        "expanded-heads": torch.randn(1, 1, 3, 8).expand(1, 2, 3, 8),
    }
    for name, q in attn.items():
        for sname, args in (("tensor", qargs("tensor")), ("attn_head", qargs("attn_head"))):
            rows.append((f"k-{name}-{sname}", q, "k", args))
    return rows


VIEWS = views()


@pytest.mark.parametrize("op", ("flatten_for_calibration", "min_max"))
@pytest.mark.parametrize("row", VIEWS, ids=[r[0] for r in VIEWS])
def test_views_give_the_result_of_a_contiguous_copy(backend, op, row):
    _, view, base_name, args = row
    assert not view.is_contiguous()
    got = call(op, view, base_name, args)
    with use_backend("reference"):
        want = call(op, view.contiguous(), base_name, args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.shape == w.shape and torch.equal(g, w), f"{row[0]}: {g} != {w}"


MSE_VIEWS = [r for r in VIEWS if r[0].endswith(("-channel", "-group", "-attn_head"))]


@pytest.mark.parametrize("row", MSE_VIEWS, ids=[r[0] for r in MSE_VIEWS])
def test_mse_search_views_give_the_result_of_a_contiguous_copy(backend, row):
    """Layout does not change which elements form a group nor their order, so the
    same backend's answer on a contiguous copy is the oracle, bit for bit."""
    _, view, base_name, args = row
    got = call("mse_search", view, base_name, args)
    want = call("mse_search", view.contiguous(), base_name, args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), row[0]


@pytest.mark.parametrize("op", VALUE_OPS)
def test_value_on_meta(backend, op):
    value = torch.randn(4, 8, device="meta")
    if backend == "triton":
        with pytest.raises(BackendUnavailableError, match=r"tensors on device 'meta' are not supported"):
            call(op, value, "weight", qargs())
        return
    if op == "mse_search":
        with pytest.raises(ValueError, match=r"mse_search: value is on the meta device; expected a device with data"):
            call(op, value, "weight", qargs())
        return
    got = call(op, value, "weight", qargs())
    shapes = [tuple(t.shape) for t in (got if isinstance(got, tuple) else (got,))]
    assert all(t.device.type == "meta" for t in (got if isinstance(got, tuple) else (got,)))
    assert shapes == ([(1, 4, 1, 8)] if op == "flatten_for_calibration" else [(4, 1), (4, 1)])


# --------------------------------------------------------------------------- #
# observers
# --------------------------------------------------------------------------- #
NAMES = ("memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse")
ACCUMULATING = ("static_minmax", "minmax", "mse")


def make(name, base_name="input", args=None, **kw):
    return Observer.load_from_registry(
        name, base_name=base_name, args=args or qargs("group", group_size=4), **kw
    )


def state(obs):
    stats = {a: getattr(obs, a).clone() for a in obs._stats_attrs} if obs.has_statistics else None
    return stats, obs._num_observed_tokens


def nan_value():
    x = torch.randn(2, 3, 16)
    x[1, 2, 5] = float("nan")
    return x


REJECTED = [
    # id, bad value, error, match
    ("int-dtype", lambda: torch.ones(2, 3, 16, dtype=torch.int32), TypeError, r"value dtype must be one of"),
    ("complex", lambda: torch.ones(2, 3, 16, dtype=torch.complex64), TypeError, r"value dtype must be one of"),
    ("wrong-dims", lambda: torch.randn(16), ValueError, r"value of an activation must be"),
    ("group-not-dividing", lambda: torch.randn(2, 3, 18), ValueError, r"not divisible by group_size 4"),
    ("not-a-tensor", lambda: [[1.0] * 16], TypeError, r"value must be a torch.Tensor, got list"),
    ("nan", nan_value, ValueError, r"holds 1 non-finite \(1 NaN, 0 \+inf, 0 -inf\) of 96 values"),
]


@pytest.mark.parametrize("row", REJECTED, ids=[r[0] for r in REJECTED])
@pytest.mark.parametrize("name", ACCUMULATING + ("memoryless_minmax",))
def test_observer_that_rejected_a_value_keeps_its_statistics(backend, name, row):
    _, bad, error, match = row
    good = [torch.randn(2, 3, 16), torch.randn(4, 16) * 3]
    obs = make(name)
    obs(good[0])
    before = state(obs)
    if row[0] == "nan":
        # nothing is read back while observing, on any backend: the
        # operations record the non-finite value, get_qparams raises and drops
        # the statistics since the last get_qparams (their tokens too)
        obs(bad())
        with pytest.raises(error, match=match):
            obs.get_qparams()
        assert not obs.has_statistics and obs._num_observed_tokens == 0
        obs(good[1])
        fresh = make(name)
        fresh(good[1])
        for a in obs._stats_attrs:
            assert torch.equal(getattr(obs, a), getattr(fresh, a)), a
        return
    with pytest.raises(error, match=match):
        obs(bad())
    after = state(obs)
    assert after[1] == before[1], "tokens were counted for a rejected value"
    for a, v in before[0].items():
        assert torch.equal(after[0][a], v), f"{a} changed"
    # still usable: the same as an observer that never saw the bad value
    obs(good[1])
    fresh = make(name)
    for v in good:
        fresh(v)
    for a in obs._stats_attrs:
        assert torch.equal(getattr(obs, a), getattr(fresh, a)), a
    assert obs._num_observed_tokens == fresh._num_observed_tokens == 6 + 4
    q, want = obs.get_qparams(), fresh.get_qparams()
    assert torch.equal(q["scale"], want["scale"]) and torch.equal(q["zero_point"], want["zero_point"])


@pytest.mark.parametrize("name", ACCUMULATING)
def test_a_different_hidden_size_later_is_refused(backend, name):
    obs = make(name)
    obs(torch.randn(2, 3, 16))
    before = state(obs)
    with pytest.raises(ValueError, match=r"value of shape \(2, 3, 8\) gives statistics of shape \(2,\), "
                                         r"but the observer holds statistics of shape \(4,\)"):
        obs(torch.randn(2, 3, 8))
    assert torch.equal(obs.min_vals, before[0]["min_vals"]) and obs._num_observed_tokens == 6
    obs(torch.randn(5, 16))  # the right size still works
    assert obs._num_observed_tokens == 11


def test_a_memoryless_observer_takes_each_value_as_it_comes(backend):
    # it keeps only the latest statistics: a new shape replaces the old
    obs = make("memoryless_minmax", args=qargs("token"))
    obs(torch.randn(2, 3, 16))
    x = torch.randn(2, 5, 16)
    obs(x)
    assert torch.equal(obs.min_vals, x.amin(dim=(0, 2)))


def test_an_observation_on_another_device_is_refused():
    with use_backend("reference"):
        obs = make("static_minmax")
        obs(torch.randn(2, 3, 16))
        before = state(obs)
        with pytest.raises(ValueError, match=r"this value is on meta but the observer holds statistics on cpu"):
            obs(torch.randn(2, 3, 16, device="meta"))
        assert torch.equal(obs.max_vals, before[0]["max_vals"]) and obs._num_observed_tokens == 6


@pytest.mark.parametrize("name", NAMES)
def test_get_qparams_without_statistics_and_twice(backend, name):
    base = "weight" if name == "imatrix_mse" else "input"
    args = qargs("channel") if base == "weight" else qargs("group", group_size=4)
    obs = make(name, base_name=base, args=args)
    with pytest.raises(RuntimeError, match=r"holds no statistics: call observer\(value\) with a non-empty value first"):
        obs.get_qparams()
    obs(torch.randn(4, 16))
    first = obs.get_qparams()
    assert torch.isfinite(first["scale"]).all()
    with pytest.raises(RuntimeError, match=r"holds no statistics: the previous get_qparams\(\) consumed them"):
        obs.get_qparams()
    # and it starts afresh
    obs(torch.randn(4, 16))
    assert torch.isfinite(obs.get_qparams()["scale"]).all()


def test_invalid_nonfinite_kwarg():
    with pytest.raises(ValueError, match=r"observer kwarg 'nonfinite' must be one of \('error', 'propagate'\), got 'ignore'"):
        make("minmax", nonfinite="ignore")


@pytest.mark.parametrize("name", NAMES)
def test_float64_observers_under_auto_match_the_reference(name):
    base = "weight"
    x = torch.randn(4, 16, dtype=torch.float64)
    results = {}
    for b in ("reference", "auto"):
        with use_backend(b):
            obs = make(name, base_name=base, args=qargs("channel"))
            results[b] = obs(x).get_qparams()
    assert results["auto"]["scale"].dtype == torch.float64
    assert torch.equal(results["auto"]["scale"], results["reference"]["scale"])


def test_float64_observer_under_forced_triton_is_a_clear_error():
    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    with use_backend("triton"):
        obs = make("static_minmax")
        with pytest.raises(KernelUnsupportedError, match="float64"):
            obs(torch.randn(2, 16, dtype=torch.float64))
        assert not obs.has_statistics


def test_imatrix_hook_accepts_float64_activations(backend):
    lin = torch.nn.Linear(8, 4, bias=False).double()
    obs = make("imatrix_mse", base_name="weight", args=qargs("channel"), strict=True)
    obs.attach(lin)
    x = torch.randn(3, 8, dtype=torch.float64)
    lin(x)
    torch.testing.assert_close(obs._imatrix_sum.double(), fp64_sum_sq(x), rtol=1e-5, atol=0)
    assert int(obs._imatrix_count) == 3


def test_unknown_observer_name_lists_the_registered_names_one_per_line():
    from obskernels.observers import OBSERVER_NAMES

    with pytest.raises(KeyError) as info:  # a KeyError, as compressed-tensors' registry raises
        Observer.load_from_registry("no_such_observer", base_name="input", args=qargs())
    text = str(info.value)
    assert text.startswith("no observer is registered as 'no_such_observer'"), text
    assert "\\n" not in text  # real line breaks, not an escaped string
    listed = [line.strip() for line in text.splitlines()[1:]]
    assert set(OBSERVER_NAMES) <= set(listed), listed
    assert not any("-" in name for name in listed), listed  # the documented spellings


def test_llmcompressor_import_hint_points_to_its_own_environment(monkeypatch):
    import importlib

    from obskernels.integrations import llmcompressor as drop_in

    real_import = importlib.import_module

    def no_llmcompressor(name, *a, **kw):
        if name.startswith("llmcompressor"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(drop_in.importlib, "import_module", no_llmcompressor)
    with pytest.raises(ImportError) as info:
        drop_in.enable()
    text = str(info.value)
    assert "make llmcompressor-env" in text, text
    assert "pip install" not in text.replace("rather than pip-installing", ""), text


@pytest.mark.parametrize("switch", ["record", "widen"])
@pytest.mark.parametrize("op", ["min_max_qparams", "mse_search_qparams"])
def test_a_first_observation_switch_that_is_not_a_bool_is_refused(op, switch):
    """``record`` and ``widen`` say how the operation runs: 1 or "no" is a
    TypeError naming the switch, the same on every backend."""
    w = torch.randn(8, 64)
    args = qargs("group", group_size=16)
    for bad in (1, "no", None):
        with pytest.raises(TypeError, match=rf"{switch} must be a bool, got {type(bad).__name__}"):
            call(op, w, "weight", args, **{switch: bad})
    assert_same_error_on_every_backend(
        [(f"{op} {switch}={bad!r}", lambda bad=bad: call(op, w, "weight", args, **{switch: bad}))
         for bad in (1, "no")])
