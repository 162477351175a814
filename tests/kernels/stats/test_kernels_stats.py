"""The statistics epilogues against torch: running min / max, the moving
average ``held * (1 - c) + new * c`` in the statistics' dtype, and the
non-finite record -- in min_max's kernel (register and split paths) and in
combine_statistics -- bit for bit on both backends.

The oracle is written here with torch (amin / amax of the flattened value,
torch.minimum / maximum, the moving average as llm-compressor writes it, and
isnan / isposinf / isneginf counts), not taken from the code under test.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels import ops
from obskernels.backends import use_backend
from obskernels.spec.checks import HeldStatisticsError
from obskernels.spec.record import STATUS_INIT

from helpers import DTYPES, assert_same, reference_flatten

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

mm_module = importlib.import_module("obskernels.kernels.min_max")
SCHEMES = {
    "group16": ("weight", (8, 64), dict(num_bits=8, strategy="group", group_size=16)),
    "channel": ("weight", (9, 40), dict(num_bits=8, strategy="channel")),
    "block-pad": ("weight", (10, 10), dict(num_bits=8, strategy="block", block_structure=[4, 4])),
    "act-tensor": ("input", (3, 7, 48), dict(num_bits=8, strategy="tensor")),
    "act-group": ("input", (17, 32), dict(num_bits=8, strategy="group", group_size=8)),
}
MODES = [("replace", None, None), ("running", True, None), ("average", True, 0.01),
         ("average-0.37", True, 0.37), ("average-1", True, 1.0)]


def value_for(base_name, shape, dtype, seed, poison=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)).to(dtype).to(device)
    if poison:
        flat = x.view(-1)
        flat[3], flat[11], flat[-2], flat[-5] = float("nan"), float("inf"), float("-inf"), float("inf")
    return x


def oracle(value, base_name, args, held, c):
    flat = reference_flatten(value, base_name, args)
    mn, mx = torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))
    new = (mn, mx)
    if held is None:
        return new, new
    if c is None:
        return new, (torch.minimum(mn, held[0]), torch.maximum(mx, held[1]))
    return new, (held[0] * (1.0 - c) + mn * c, held[1] * (1.0 - c) + mx * c)


def oracle_record(value, new, observation):
    nan, pos, neg = (int(f(value).sum()) for f in (torch.isnan, torch.isposinf, torch.isneginf))
    bad = not (bool(torch.isfinite(new[0]).all()) and bool(torch.isfinite(new[1]).all()))
    init = list(STATUS_INIT)
    return [init[0] + nan, init[1] + pos, init[2] + neg, int(bad), observation if bad else init[4], init[5]]


def held_for(base_name, shape, args, dtype, device="cpu"):
    """Held statistics with subnormal and large entries (the dtype's edges)."""
    prev = value_for(base_name, shape, dtype, seed=7, poison=False, device=device)
    flat = reference_flatten(prev, base_name, args)
    mn, mx = torch.amin(flat, dim=(0, -1)).clone(), torch.amax(flat, dim=(0, -1)).clone()
    tiny = torch.finfo(dtype).tiny
    mn.view(-1)[0], mx.view(-1)[0] = -tiny / 8, tiny / 2
    return mn, mx


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split"])
@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_min_max_epilogue(backend, pin_launch, scheme, dtype, mode, split, device):
    base_name, shape, kw = SCHEMES[scheme]
    args = QuantizationArgs(**kw)
    if split:
        pin_launch("min_max", tile=16, split=3)
    _, with_held, c = mode
    held = held_for(base_name, shape, args, dtype, device) if with_held else None
    value = value_for(base_name, shape, dtype, seed=1, device=device)
    status = torch.tensor(STATUS_INIT, device=device)
    got = ops.min_max(value, base_name, args, held=held, averaging_constant=c, status=status,
                      observation=4)
    new, want = oracle(value, base_name, args, held, c)
    assert_same(got[0], want[0], f"{scheme} {mode[0]} min")
    assert_same(got[1], want[1], f"{scheme} {mode[0]} max")
    assert status.tolist() == oracle_record(value, new, 4)
    # a second, finite observation adds nothing to the record
    ops.min_max(value_for(base_name, shape, dtype, 2, poison=False, device=device), base_name, args,
                status=status, observation=5)
    assert status.tolist() == oracle_record(value, new, 4)


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_combine_statistics(backend, scheme, dtype, mode, device):
    """Statistics from elsewhere (here: amin / amax, expanded so that a finite
    value can give non-finite statistics, as the MSE search's expand does)."""
    base_name, shape, kw = SCHEMES[scheme]
    args = QuantizationArgs(**kw)
    _, with_held, c = mode
    held = held_for(base_name, shape, args, dtype, device) if with_held else None
    for poison in (True, False):
        value = value_for(base_name, shape, dtype, seed=3, poison=poison, device=device)
        flat = reference_flatten(value, base_name, args)
        big = torch.finfo(dtype).max / 2
        new = (torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1)) * 1)
        if not poison:
            new[1].view(-1)[-1] = big * 4 if dtype != torch.float32 else float("inf")
        status = torch.tensor(STATUS_INIT, device=device)
        got = ops.combine_statistics(value, base_name, args, *new, held=held, averaging_constant=c,
                                     status=status, observation=2)
        if held is None:
            want = new
        elif c is None:
            want = (torch.minimum(new[0], held[0]), torch.maximum(new[1], held[1]))
        else:
            want = (held[0] * (1.0 - c) + new[0] * c, held[1] * (1.0 - c) + new[1] * c)
        assert_same(got[0], want[0], f"{scheme} {mode[0]} min")
        assert_same(got[1], want[1], f"{scheme} {mode[0]} max")
        assert status.tolist() == oracle_record(value, new, 2), poison


def test_held_statistics_of_another_shape(backend, device):
    args = QuantizationArgs(num_bits=8, strategy="group", group_size=16)
    held = (torch.zeros(8, 2, device=device), torch.ones(8, 2, device=device))
    value = torch.randn(8, 64, device=device)
    with pytest.raises(HeldStatisticsError, match=r"do not match") as info:
        ops.min_max(value, "weight", args, held=held)
    assert info.value.new_shape == (8, 4)
    with pytest.raises(ValueError, match="averaging_constant"):
        ops.min_max(value, "weight", args, averaging_constant=1.5)
    with pytest.raises(TypeError, match="status"):
        ops.min_max(value, "weight", args, status=torch.zeros(5, device=device))


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split"])
def test_moving_average_launches_round_each_operation(pin_launch, monkeypatch, split):
    """On a GPU Triton contracts ``held * a + new * c`` into one FMA unless the
    launch says ``enable_fp_fusion=False`` (an H100 found fp32 averages 1 ulp
    off torch's three roundings); the interpreter never contracts, so the
    values cannot show it here: every launch site that averages is checked
    for the option instead, and the other modes for keeping the contraction
    (stated, as every launch states it)."""
    st_module = importlib.import_module("obskernels.kernels.stats")
    sites = []
    for module in (mm_module, st_module):
        def recording(scope, name, grid, _real=module.Replay, **bound):
            sites.append((name, bound))
            return _real(scope, name, grid, **bound)
        monkeypatch.setattr(module, "Replay", recording)
    # signatures no other test plans, so that they are prepared here
    if split:  # a whole tensor's rows split across programs: its last programs average
        pin_launch("min_max", tile=16, split=3)
        base_name, shape, args = "input", (5, 7, 48), QuantizationArgs(num_bits=8, strategy="tensor")
    else:
        base_name, shape, args = "weight", (11, 48), QuantizationArgs(num_bits=8, strategy="group", group_size=16)
    held = held_for(base_name, shape, args, torch.float32)
    value = value_for(base_name, shape, torch.float32, seed=5, poison=False)
    with use_backend("triton"):
        for c in (0.37, None):  # a moving average, then a running min / max
            ops.min_max(value, base_name, args, held=held, averaging_constant=c)
            ops.combine_statistics(value, base_name, args, *held, held=held, averaging_constant=c)
    average = st_module.MODE_AVERAGE.value
    averaging = [(n, b) for n, b in sites if b.get("MODE") == average]
    assert {n for n, _ in averaging} >= {"_combine_kernel", "_min_max_kernel"}
    assert not split or all(b.get("FINISH") for n, b in averaging if n == "_min_max_kernel"), averaging
    assert all(b.get("enable_fp_fusion") is False for _, b in averaging), averaging
    others = [(n, b) for n, b in sites if b.get("MODE") not in (None, average)]
    assert others and all(b.get("enable_fp_fusion") is True for _, b in others), others
