"""A first observation's statistics and qparams in one operation:
``min_max_qparams`` (min_max, then calculate_qparams(widen=True) carrying the
value's record).

The oracle is the reference's two operations, called as an observer would:
``min_max`` into a fresh record, then ``calculate_qparams`` of those
statistics with that record carried. Both backends must give the same
statistics, scale and zero point bit for bit, the same record at the head of
the status, and a non-finite-scale flag after it exactly when the reference
sets one (the number of flags is the backend's: one per program). The
triton backend computes the qparams in min_max's one launch -- in the
epilogue of the streaming kernel where a program holds whole groups, large
enough ones in a value of 64 MB or more, in the last program of a block to
arrive where a group's rows are split across programs -- and makes
calculate_qparams' launch after min_max's otherwise (for TENSOR_GROUP after
min_max writes partial absolute maxima); every path is taken here (and
checked to be).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels.reference.min_max import min_max as reference_min_max
from obskernels.reference.qparams import calculate_qparams as reference_qparams
from obskernels.spec import calls
from obskernels.spec.calls import MinMaxCall
from obskernels.spec.record import STATUS_INIT, new_record

from helpers import RecordingKernel, assert_same, call_backend

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

kernel_module = importlib.import_module("obskernels.kernels.min_max")
reference_module = importlib.import_module("obskernels.reference.min_max")
N = len(STATUS_INIT)

# name -> (args, shape, dtype, the triton backend's launches for a value of
# QP_SMALL_GROUPS_BELOW bytes or more: ONE (the qparams in the streaming
# kernel's epilogue), SPLIT (one launch too: the last program of each block
# of a split reduction finishes it, FINISH), TWO (min_max, then
# calculate_qparams: groups too small for the epilogue) or PARTS
# (TENSOR_GROUP: a global scale over every group; min_max writing partial
# absolute maxima, then the qparams kernel reducing them, at any size). A
# smaller value's are ONE for TWO's formats too; each such format runs at
# both sizes ("large": the threshold set to 0, as the value's size would be
# at 64 MB)
ONE, SPLIT, TWO, PARTS = "one", "split", "two", "parts"
KERNELS = {ONE: ("_min_max_kernel",), SPLIT: ("_min_max_kernel",),
           TWO: ("_min_max_kernel", "_qparams_kernel"), PARTS: ("_min_max_kernel", "_qparams_kernel")}
FORMATS = {
    "nvfp4 tensor_group16 bf16": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16), (8, 256), torch.bfloat16, PARTS),
    "nvfp4 tensor_group16 fp32 (many programs)": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16), (96, 512), torch.float32, PARTS),
    "int4 tensor_group32 asym fp16": (dict(num_bits=4, strategy="tensor_group", group_size=32, symmetric=False), (16, 256), torch.float16, PARTS),
    "int4 g128 sym bf16": (dict(num_bits=4, strategy="group", group_size=128), (8, 512), torch.bfloat16, ONE),
    "int8 channel sym fp16": (dict(num_bits=8, strategy="channel"), (16, 512), torch.float16, ONE),
    "fp8 channel fp32": (dict(num_bits=8, type="float", strategy="channel"), (16, 256), torch.float32, ONE),
    "int8 channel asym fp16 (redo)": (dict(num_bits=8, strategy="channel", symmetric=False), (8, 512), torch.float16, ONE),
    "int8 channel asym bf16 (redo)": (dict(num_bits=8, strategy="channel", symmetric=False), (8, 1024), torch.bfloat16, ONE),
    "int1 channel sym bf16 (redo compiled: half 0.5)": (dict(num_bits=1, strategy="channel"), (8, 512), torch.bfloat16, ONE),
    "int8 channel sym bf16, fp16 scale (redo)": (dict(num_bits=8, strategy="channel", scale_dtype=torch.float16), (8, 512), torch.bfloat16, ONE),
    "int4 g128 fp8-scale bf16": (dict(num_bits=4, strategy="group", group_size=128, scale_dtype=torch.float8_e4m3fn), (8, 256), torch.bfloat16, ONE),
    "int4 g32 asym bf16 (small groups)": (dict(num_bits=4, strategy="group", group_size=32, symmetric=False), (8, 256), torch.bfloat16, TWO),
    "int4 g128 asym fp16 (redo)": (dict(num_bits=4, strategy="group", group_size=128, symmetric=False), (8, 256), torch.float16, ONE),
    "int4 g64 asym bf16 (small groups)": (dict(num_bits=4, strategy="group", group_size=64, symmetric=False), (8, 256), torch.bfloat16, TWO),
    "mxfp4 g32 fp32": (dict(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8), (8, 256), torch.float32, TWO),
    "fp8 tensor bf16 (split)": (dict(num_bits=8, type="float", strategy="tensor"), (64, 1024), torch.bfloat16, SPLIT),
    "int8 tensor asym fp16 (split, redo)": (dict(num_bits=8, strategy="tensor", symmetric=False), (64, 1024), torch.float16, SPLIT),
    "int4 tensor sym fp32 (split)": (dict(num_bits=4, strategy="tensor"), (256, 512), torch.float32, SPLIT),
    "fp8 block256 bf16 (split)": (dict(num_bits=8, type="float", strategy="block", block_structure=[256, 256]), (256, 512), torch.bfloat16, SPLIT),
}


def _value(shape, dtype, kind):
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    big = torch.finfo(dtype).max
    if kind == "nan":
        v[1, 3] = float("nan")
    elif kind == "inf":
        v[2, 5] = float("inf")
        v[3, 9] = float("-inf")
    elif kind == "wide":  # finite, but max - min overflows the dtype: the float64 redo
        v[0, 0], v[0, 1] = big, -big
        v[4, 2] = big
        v[4, 7] = -big / 2
    return v


def _oracle(value, args, record, base_name="weight", widen=True):
    """The reference's min_max into a fresh record, then calculate_qparams
    carrying it; for TENSOR_GROUP with the global scale of those statistics."""
    status = new_record(value.device) if record else None
    mins, maxs = call_backend(reference_min_max, value, base_name, args, status=status)
    fused = ((mins, maxs),) if args.strategy == "tensor_group" else None
    scale, zp, gs, out = call_backend(reference_qparams, mins, maxs, args, fused=fused,
                                      widen=widen, carry=status)
    return mins, maxs, scale, zp, gs, out


def _recorded_launches(monkeypatch) -> list:
    """The launches of min_max's kernel and calculate_qparams', recorded
    (name, grid, arguments, keywords) into the list returned; each still runs."""
    qparams_module = importlib.import_module("obskernels.kernels.qparams")
    sink = []
    for module, attr in ((kernel_module, "_min_max_kernel"), (qparams_module, "_qparams_kernel")):
        monkeypatch.setattr(module, attr, RecordingKernel(getattr(module, attr), sink))
    return sink


def _assert_matches(got, want, name):
    assert len(got) == 6, f"{name}: {len(got)} results"
    for what, g, w in zip(("min_vals", "max_vals", "scale", "zero_point"), got[:4], want[:4]):
        assert_same(g, w, f"{name}: {what}", stats=want[:2] if what == "scale" else None)
    if want[4] is None:
        assert got[4] is None, f"{name}: a global scale where none is defined"
    else:
        assert_same(got[4], want[4], f"{name}: global_scale")
    status, expected = got[5].tolist(), want[5].tolist()
    assert got[5].dtype == torch.int64
    assert status[:N] == expected[:N], f"{name}: record {status[:N]} != {expected[:N]}"
    assert any(status[N:]) == any(expected[N:]), f"{name}: scale flags {status[N:]} vs {expected[N:]}"


SIZED = [(name, size) for name in sorted(FORMATS)
         for size in (("small", "large") if FORMATS[name][3] == TWO else ("small",))]


def _sized(name, size, monkeypatch):
    """The launches FORMATS[name] makes at ``size``, the threshold set so."""
    launches = FORMATS[name][3]
    if size == "large":
        monkeypatch.setattr(kernel_module, "QP_SMALL_GROUPS_BELOW", 0)
        return launches
    return ONE if launches == TWO else launches


@pytest.mark.parametrize("record", [True, False], ids=["record", "no-record"])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf", "wide"])
@pytest.mark.parametrize("name,size", SIZED)
def test_min_max_qparams_is_min_max_then_calculate_qparams(name, size, kind, record, monkeypatch):
    _sized(name, size, monkeypatch)
    fields, shape, dtype, _ = FORMATS[name]
    args = QuantizationArgs(**fields)
    value = _value(shape, dtype, kind)
    want = _oracle(value, args, record)
    for backend, module in (("reference", reference_module), ("triton", kernel_module)):
        got = call_backend(module.min_max_qparams, value, "weight", args, record=record)
        _assert_matches(got, want, f"{backend} {name} {kind}")


@pytest.mark.parametrize("kind", ["finite", "wide"])
@pytest.mark.parametrize("name", ["int8 channel asym fp16 (redo)", "int8 tensor asym fp16 (split, redo)",
                                  "int4 g32 asym bf16 (small groups)", "int4 tensor_group32 asym fp16",
                                  "int4 g128 sym bf16"])
def test_min_max_qparams_without_widening_is_calculate_qparams_without_it(name, kind):
    """``widen=False`` (compressed-tensors' own arithmetic, what
    llm-compressor's get_qparams computes): the statistics, then
    calculate_qparams(widen=False), on both backends -- where statistics
    overflow the dtype that differs from the widened qparams, which it must not
    give."""
    fields, shape, dtype, _ = FORMATS[name]
    args = QuantizationArgs(**fields)
    value = _value(shape, dtype, kind)
    want = _oracle(value, args, False, widen=False)
    widened = _oracle(value, args, False)
    for backend, module in (("reference", reference_module), ("triton", kernel_module)):
        got = call_backend(module.min_max_qparams, value, "weight", args, widen=False)
        _assert_matches(got, want, f"{backend} {name} {kind}")
    if kind == "wide" and "asym" in name and "tensor_group" not in name:  # (sym: no redo)
        assert not torch.equal(want[2], widened[2]), "the case does not tell the two apart"


@pytest.mark.parametrize("name,size", SIZED)
def test_the_epilogue_is_taken_where_groups_are_whole_and_large_or_split(name, size, monkeypatch):
    """The triton backend's choice, structurally: qparams in an epilogue for
    the formats marked ONE or SPLIT (groups of 128 with or without the
    float64 redo compiled in), from min_max's partials for PARTS, the two
    operations' launches for groups under 128 elements in a large value, the
    epilogue for those too in a small one."""
    launches = _sized(name, size, monkeypatch)
    fields, shape, dtype, _ = FORMATS[name]
    flat = calls.flatten_for_calibration(torch.zeros(shape, dtype=dtype), "weight",
                                         QuantizationArgs(**fields))
    launch = kernel_module.prepare(MinMaxCall(flat, status=new_record("cpu")), qparams=True)
    assert (launch is not None) == (launches != TWO)


@pytest.mark.parametrize("name", ["int4 g128 sym bf16", "nvfp4 tensor_group16 bf16",
                                  "fp8 tensor bf16 (split)"])
def test_a_launch_is_made_once_per_signature_and_reused(name):
    """The prepared path gives each call its own outputs, a fresh record
    and (split) fresh tickets: two values in a row, the second NaN-free
    after a NaN one."""
    args, shape, dtype, _ = FORMATS[name]
    args = QuantizationArgs(**args)
    call_nan = calls.min_max_qparams(_value(shape, dtype, "nan"), "weight", args, record=True)
    launch = kernel_module.prepare_qparams(call_nan)
    first = launch(call_nan)
    clean = _value(shape, dtype, "finite")
    second = launch(calls.min_max_qparams(clean, "weight", args, record=True))
    assert first[5][0].item() == 1 and second[5].tolist()[:N] == list(STATUS_INIT)
    _assert_matches(second, _oracle(clean, args, True), "second call")
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second) if a is not None)


@pytest.mark.parametrize("name,size", SIZED)
def test_preparing_launches_nothing(name, size, monkeypatch):
    """Preparing a signature launches nothing of its own; a call makes the
    launches its format is marked with: the one launch computes the qparams
    where the format is ONE (its ``QP`` switches set) or SPLIT (and
    ``FINISH``: by the last program of a block, after the partials); for PARTS min_max
    writes the partials (``ABSMAX``) that the qparams kernel reads, with
    nothing between them."""
    sink = _recorded_launches(monkeypatch)
    launches = _sized(name, size, monkeypatch)
    fields, shape, dtype, _ = FORMATS[name]
    args = QuantizationArgs(**fields)
    call = calls.min_max_qparams(_value(shape, dtype, "finite"), "weight", args, record=True)
    launch = kernel_module.prepare_qparams(call)
    assert sink == [], f"preparing launched {len(sink)} kernel(s)"
    launch(call)
    assert tuple(name for name, _, _, _ in sink) == KERNELS[launches]
    assert [kwargs.get("QP") is not None for _, _, _, kwargs in sink] == [
        launches in (ONE, SPLIT)] + [False] * (len(sink) - 1)
    assert [kwargs.get("FINISH", False) for _, _, _, kwargs in sink] == [
        launches == SPLIT] + [False] * (len(sink) - 1)
    if launches == SPLIT:
        assert sink[0][1][1] > 1, "the rows were not split"
    assert [kwargs.get("ABSMAX", False) for _, _, _, kwargs in sink] == [
        launches == PARTS and i == 0 for i in range(len(sink))]
    if launches == PARTS:  # the partials written are the partials read
        (_, _, _, kw0), (_, _, args1, _) = sink
        assert kw0["absmax_ptr"] is args1[5]


@pytest.mark.parametrize("record", [True, False], ids=["record", "no-record"])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])
def test_tensor_group_split_across_programs_takes_the_partials_from_its_last_programs(
        kind, record, pin_launch, monkeypatch):
    """An activation's TENSOR_GROUP groups span every token: with their rows
    split across programs the last program of each block to arrive (its
    ticket after the status's one flag word) finishes the block
    and writes its partial absolute maximum, which the qparams kernel reads
    (two launches, where min_max then calculate_qparams make four); the
    results are the oracle's and the tickets are back at zero."""
    pin_launch("min_max", split=3)
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    value = _value((96, 64), torch.bfloat16, kind)
    want = _oracle(value, args, record, "input")
    got = call_backend(reference_module.min_max_qparams, value, "input", args, record=record)
    _assert_matches(got, want, f"reference {kind}")
    sink = _recorded_launches(monkeypatch)
    got = call_backend(kernel_module.min_max_qparams, value, "input", args, record=record)
    _assert_matches(got, want, f"triton {kind}")
    assert [name for name, _, _, _ in sink] == ["_min_max_kernel", "_qparams_kernel"]
    (_, grid0, _, kw0), (_, grid1, args1, _) = sink
    assert grid0[1] == 3, "the rows were not split"
    assert kw0["ABSMAX"] and kw0["FINISH"] and kw0["absmax_ptr"] is args1[5]
    status = got[5]
    # the record, one flag word whatever the qparams kernel's programs, a ticket per block
    assert kw0["tickets_ptr"] is status and kw0["ticket0"] == N + 1
    assert status.numel() == N + 1 + grid0[0]
    assert status[kw0["ticket0"]:].tolist() == [0] * grid0[0], "a ticket was not put back"


@pytest.mark.parametrize("name,base_name", [
    ("fp8 tensor bf16 (split)", "weight"), ("int8 tensor asym fp16 (split, redo)", "weight"),
    ("fp8 block256 bf16 (split)", "weight"), ("nvfp4 tensor_group16 bf16", "weight"),
    # an activation's groups span every token: split, its partial absolute maxima by tickets
    ("nvfp4 tensor_group16 bf16", "input"),
])
def test_values_in_a_row_on_the_device(name, base_name, device, pin_launch):
    """On the tests' device (CUDA in make gpu-check: there the split's last
    program takes its ticket under the hardware's memory ordering, which the
    interpreter, running programs one after another, cannot show), values in
    a row through one prepared launch, each the oracle's; the split forced
    wide, so many programs meet at each ticket."""
    fields, _, dtype, launches = FORMATS[name]
    cuda = device == "cuda"
    if launches == SPLIT or base_name == "input":
        pin_launch("min_max", split=64 if cuda else 4)
    args = QuantizationArgs(**fields)
    shape = (2048, 1024) if cuda else (64, 512)
    gen = torch.Generator().manual_seed(11)
    for i in range(16 if cuda else 2):
        value = (torch.randn(*shape, generator=gen) * (i + 1)).to(dtype).to(device)
        if i % 4 == 3:
            value[i % shape[0], 7] = float("nan")
        got = call_backend(kernel_module.min_max_qparams, value, base_name, args, record=True)
        _assert_matches(got, _oracle(value, args, True, base_name), f"{name}, value {i}")
