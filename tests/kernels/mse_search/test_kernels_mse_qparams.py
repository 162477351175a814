"""A first observation's search and its qparams in one operation:
``mse_search_qparams`` (the search, then calculate_qparams(widen=True),
or without the widening where asked, carrying the value's record).

The oracle is the reference's two operations as an observer would call
them: ``mse_search`` into a fresh record, then ``calculate_qparams`` of its
ranges with that record carried. Both backends must give the same ranges,
scale and zero point bit for bit, the same record at the head of the status,
and a non-finite-scale flag after it exactly when the reference sets one. The
triton backend computes the qparams in the choice's epilogue where the
search makes a choose launch (the register path of a search that can stop
early), and makes the search's and calculate_qparams' launches otherwise;
both are taken here, and checked to be.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels.reference.mse_search import mse_search as reference_search
from obskernels.reference.qparams import calculate_qparams as reference_qparams
from obskernels.spec import calls
from obskernels.spec.record import STATUS_INIT, new_record

from helpers import RecordingKernel, assert_same, call_backend

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

kernel_module = importlib.import_module("obskernels.kernels.mse_search")
reference_module = importlib.import_module("obskernels.reference.mse_search")
N = len(STATUS_INIT)
MSE = dict(maxshrink=0.2, patience=5, grid=100, norm=2.4)  # 20 steps: the search can stop early

# name -> (args, search keywords, shape, dtype, launch config, qparams in the choice)
CASES = {
    "int4 g16 sym bf16": (dict(num_bits=4, strategy="group", group_size=16), MSE, (8, 64), torch.bfloat16, None, True),
    "int4 g16 asym fp16": (dict(num_bits=4, strategy="group", group_size=16, symmetric=False), MSE, (8, 64), torch.float16, None, True),
    "int8 channel fp32": (dict(num_bits=8, strategy="channel"), dict(MSE, norm=2.0), (8, 64), torch.float32, None, True),
    # 1,536 groups: three choose programs, each its block of 512 groups and its scale flag
    "int4 g16 sym bf16, three choose programs": (dict(num_bits=4, strategy="group", group_size=16), MSE, (48, 512), torch.bfloat16, None, True),
    "int4 g16 sym bf16, fp8 scale": (dict(num_bits=4, strategy="group", group_size=16, scale_dtype=torch.float8_e4m3fn), MSE, (8, 64), torch.bfloat16, None, True),
    "mxfp4 g32 bf16": (dict(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8), MSE, (8, 64), torch.bfloat16, None, True),
    "int4 g16 sym bf16, cannot stop early": (dict(num_bits=4, strategy="group", group_size=16), dict(MSE, patience=1000), (8, 64), torch.bfloat16, None, False),
    "int8 channel bf16 (split)": (dict(num_bits=8, strategy="channel"), MSE, (8, 64), torch.bfloat16, dict(max_reg_group=16, chunk=16, split=2), False),
    # a global scale needs every group's range: calculate_qparams after the search
    "nvfp4 tensor_group16 bf16": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16), MSE, (8, 64), torch.bfloat16, None, False),
}


def _value(shape, dtype, kind):
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    if kind == "nan":
        v[1, 3] = float("nan")
    elif kind == "inf":
        v[2, 5] = float("inf")
    elif kind == "wide":  # finite, but max - min overflows: the float64 redo
        big = torch.finfo(dtype).max
        v[0, 0], v[0, 1] = big, -big
    return v


def _oracle(value, args, kw, record, widen=True):
    status = new_record(value.device) if record else None
    mins, maxs = call_backend(reference_search, value, "weight", args, status=status, **kw)
    fused = ((mins, maxs),) if args.strategy == "tensor_group" else None
    scale, zp, gs, out = call_backend(reference_qparams, mins, maxs, args, fused=fused,
                                      widen=widen, carry=status)
    return mins, maxs, scale, zp, gs, out


# compressed-tensors' own MX scale of a non-finite group depends on the
# tensor's size on the CPU (2^-127 for larger tensors, inf for a few groups):
# there is no oracle for those at this size (test_kernels_qparams.py covers
# them at its sizes), so they are not among the rows
ROWS = [(name, kind) for name in sorted(CASES) for kind in ("finite", "nan", "inf", "wide")
        if not (name.startswith("mx") and kind in ("nan", "inf"))]


@pytest.mark.parametrize("record,widen", [(True, True), (False, True), (False, False)],
                         ids=["record", "no-record", "no-record-unwidened"])
@pytest.mark.parametrize("name,kind", ROWS, ids=[f"{n}-{k}" for n, k in ROWS])
def test_mse_search_qparams_is_the_search_then_calculate_qparams(name, kind, record, widen,
                                                                 pin_launch):
    fields, kw, shape, dtype, config, _ = CASES[name]
    if config is not None:
        pin_launch("mse_search", **config)
    args = QuantizationArgs(**fields)
    value = _value(shape, dtype, kind)
    want = _oracle(value, args, kw, record, widen)
    if not widen and kind == "wide" and name == "int4 g16 asym fp16":
        # the case tells the two apart: the float64 redo changes its scale
        assert not torch.equal(want[2], _oracle(value, args, kw, record)[2])
    for backend, module in (("reference", reference_module), ("triton", kernel_module)):
        got = call_backend(module.mse_search_qparams, value, "weight", args, record=record,
                           widen=widen, **kw)
        what = f"{backend} {name} {kind}"
        assert len(got) == 6, f"{what}: {len(got)} results"
        for part, g, w in zip(("min_vals", "max_vals", "scale", "zero_point"), got[:4], want[:4]):
            assert_same(g, w, f"{what}: {part}")
        if want[4] is None:
            assert got[4] is None, f"{what}: a global scale where none is defined"
        else:
            assert_same(got[4], want[4], f"{what}: global_scale")
        status, expected = got[5].tolist(), want[5].tolist()
        assert status[:N] == expected[:N], f"{what}: record {status[:N]} != {expected[:N]}"
        assert any(status[N:]) == any(expected[N:]), f"{what}: flags {status[N:]} vs {expected[N:]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_choice_computes_the_qparams_where_the_search_makes_one(name, pin_launch):
    fields, kw, shape, dtype, config, fused = CASES[name]
    if config is not None:
        pin_launch("mse_search", **config)
    call = calls.mse_search_qparams(torch.zeros(shape, dtype=dtype), "weight",
                                    QuantizationArgs(**fields), record=True, **kw)
    launch = kernel_module.prepare(call.measuring(new_record("cpu")), qparams=True)
    assert (launch is not None) == fused


class _Grids:
    """Stands in for a kernel: records each launch's grid, runs nothing."""

    def __init__(self, sink, name):
        self.sink, self.name = sink, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((self.name, tuple(grid)))


@pytest.mark.parametrize("shape,group_size", [((4096, 4096), 128), ((4096, 4096), 32), ((48, 512), 16)])
def test_the_choice_spreads_its_groups(shape, group_size, monkeypatch):
    """The choose launch takes a block of groups per program, up to
    CHOOSE_PROGRAMS programs: a 4096x4096 weight's 131,072 groups of 128 are
    256 programs of 512 (4 of 32,768 took a fifth of the search on an H200),
    its 524,288 groups of 32 512 programs of 1,024."""
    from obskernels.kernels.launch import CHOOSE_BLOCK, CHOOSE_PROGRAMS

    sink = []
    for name in ("_search_kernel", "_choose_kernel"):
        monkeypatch.setattr(kernel_module, name, _Grids(sink, name))
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=group_size)
    call = calls.mse_search_qparams(torch.zeros(shape, dtype=torch.bfloat16), "weight", args,
                                    record=True, **MSE)
    kernel_module.mse_search_qparams(call)
    groups = shape[0] * shape[1] // group_size
    want = min(-(-groups // CHOOSE_BLOCK), CHOOSE_PROGRAMS)
    assert [n for n, _ in sink] == ["_search_kernel", "_choose_kernel"], sink
    assert sink[1][1][0] == want, f"{groups} groups: {sink[1][1]} choose programs, expected {want}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_preparing_launches_nothing(name, pin_launch, monkeypatch):
    """Preparing a signature runs no search of its own (its statistics'
    prototype is allocated, not computed)."""
    from obskernels.kernels.mse_search_details import _choose, _register, _split

    sink = []
    for module in (kernel_module, _register, _split, _choose):
        for attr in dir(module):
            if attr.endswith("_kernel") and not isinstance(getattr(module, attr), RecordingKernel):
                monkeypatch.setattr(module, attr, RecordingKernel(getattr(module, attr), sink))
    fields, kw, shape, dtype, config, _ = CASES[name]
    if config is not None:
        pin_launch("mse_search", **config)
    call = calls.mse_search_qparams(_value(shape, dtype, "finite"), "weight",
                                    QuantizationArgs(**fields), record=True, **kw)
    kernel_module.prepare_qparams(call)
    assert sink == [], f"preparing launched {[s[0] for s in sink]}"
