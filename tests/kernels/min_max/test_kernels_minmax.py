"""Parity of the triton min_max kernel with the reference (docs/spec.md §2, §5).

min/max are exact, so the contract is bitwise: torch.equal on every group,
NaN exactly where the reference has NaN, the reference's shape and dtype.
Kernels run under TRITON_INTERPRET=1 on the CPU (set by conftest); shapes stay
tiny because every program instance costs milliseconds there.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from obskernels import ops
from obskernels.backends import use_backend

from helpers import DTYPES, RecordingKernel, assert_same, make_value, outcome, permuted_g_idx, qargs

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

min_max_module = importlib.import_module("obskernels.kernels.min_max")
layout_module = importlib.import_module("obskernels.kernels._layout")
launch_module = importlib.import_module("obskernels.kernels.launch")



@dataclasses.dataclass(frozen=True)
class Case:
    base_name: str
    strategy: str
    shape: tuple[int, ...]
    kw: tuple = ()  # extra QuantizationArgs fields as (name, value) pairs

    @property
    def args(self):
        return qargs(self.strategy, **dict(self.kw))

    def __str__(self):
        extra = "".join(f"-{k}{v}" for k, v in self.kw)
        return f"{self.base_name}-{self.strategy}{extra}-{'x'.join(map(str, self.shape))}"


G16 = (("group_size", 16),)
G32 = (("group_size", 32),)

CASES = [
    # weights: odd sizes (powers of two plus 17), single groups, wide channels
    Case("weight", "tensor", (17, 33)),
    Case("weight", "tensor", (64, 48)),  # one contiguous run, cut into rows
    Case("weight", "tensor", (1, 1)),
    Case("weight", "channel", (17, 33)),
    Case("weight", "channel", (3, 4113)),
    Case("weight", "channel", (1, 64)),
    Case("weight", "group", (17, 48), G16),
    Case("weight", "group", (1, 16), G16),
    Case("weight", "group", (5, 4128), G32),
    Case("weight", "tensor_group", (17, 48), G16),
    Case("weight", "block", (17, 33), (("block_structure", [8, 16]),)),  # partial both ways
    Case("weight", "block", (16, 32), (("block_structure", [8, 16]),)),  # exact blocks
    Case("weight", "block", (5, 7), (("block_structure", [8, 16]),)),  # one partial block
    Case("weight", "block", (130, 129), (("block_structure", [128, 128]),)),
    # activations, 2-D and 3-D; many observations
    Case("input", "tensor", (17, 48)),
    Case("output", "tensor", (2, 17, 48)),
    Case("input", "token", (17, 48)),
    Case("input", "token", (2, 17, 48)),
    Case("input", "token", (1, 1, 16)),
    Case("input", "group", (17, 48), G16),
    Case("output", "group", (3, 9, 64), G32),
    Case("input", "group", (513, 32), G16),
    Case("input", "tensor_group", (2, 17, 48), G16),
    # attention (batch, heads, seq, head_dim)
    Case("q", "tensor", (2, 3, 17, 16)),
    Case("k", "attn_head", (2, 3, 17, 16)),
    Case("v", "attn_head", (1, 1, 1, 8)),
    Case("q", "attn_head", (2, 4, 33, 64)),
]

LAYOUTS = ("contiguous", "transposed", "sliced")


def run_both(op, value, *args, **kwargs):
    with use_backend("reference"):
        want = getattr(ops, op)(value, *args, **kwargs)
    with use_backend("triton"):
        got = getattr(ops, op)(value, *args, **kwargs)
    return got, want


def check_min_max(value, case_or_base, args=None, g_idx=None, what=""):
    if isinstance(case_or_base, Case):
        base_name, args = case_or_base.base_name, case_or_base.args
    else:
        base_name = case_or_base
    (got_min, got_max), (want_min, want_max) = run_both("min_max", value, base_name, args, g_idx=g_idx)
    assert_same(got_min, want_min, f"{what} min")
    assert_same(got_max, want_max, f"{what} max")
    return want_min, want_max


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_min_max_matches_reference(case, dtype, layout, device):
    value = make_value(case.shape, dtype, layout, device=device)
    check_min_max(value, case, what=f"{case} {dtype} {layout}")


def test_attention_from_transposed_projection(device):
    # The usual q: (batch, seq, heads, head_dim) viewed as (batch, heads, seq, head_dim).
    value = torch.randn(2, 17, 3, 16).to(device=device, dtype=torch.bfloat16).transpose(1, 2)
    for strategy in ("tensor", "attn_head"):
        check_min_max(value, "q", qargs(strategy), what=f"q {strategy}")


def test_expanded_and_offset_views(device):
    # Stride-0 (broadcast) dims and a storage offset are addressed as they are.
    row = torch.randn(1, 48, dtype=torch.float16).to(device)
    expanded = row.expand(9, 48)
    for strategy, kw in (("tensor", {}), ("channel", {}), ("group", {"group_size": 16}),
                         ("block", {"block_structure": [4, 32]})):
        check_min_max(expanded, "weight", qargs(strategy, **kw), what=f"expanded {strategy}")
    offset = torch.randn(400, dtype=torch.bfloat16).to(device)[17:17 + 9 * 40].view(9, 40)
    check_min_max(offset, "weight", qargs("block", block_structure=[4, 32]), what="offset block")


BLOCK_CASES = [c for c in CASES if c.strategy == "block"]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
@pytest.mark.parametrize("sign", (1, -1))
def test_partial_block_padding_takes_part(case, sign, device):
    # All values of one sign: a partial block's min (max) must be the padding 0.
    value = make_value(case.shape, torch.bfloat16, "contiguous",
                       base=lambda s: sign * (torch.rand(s) + 0.5), device=device)
    want_min, want_max = check_min_max(value, case, what=f"{case} sign {sign}")
    bh, bw = dict(case.kw)["block_structure"]
    rows, cols = case.shape
    partial = (rows % bh != 0) or (cols % bw != 0)
    extreme = want_min if sign > 0 else want_max
    assert bool((extreme[-1, -1] == 0) == partial), "the reference's padding contract changed"


NAN_CASES = [
    Case("weight", "tensor", (17, 33)),
    Case("weight", "channel", (17, 33)),
    Case("weight", "group", (17, 48), G16),
    Case("weight", "block", (17, 33), (("block_structure", [8, 16]),)),
    Case("input", "token", (2, 17, 48)),
    Case("input", "group", (2, 17, 48), G16),
    Case("k", "attn_head", (2, 3, 17, 16)),
]


@pytest.mark.parametrize("case", NAN_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_propagate(case, dtype, device):
    value = make_value(case.shape, dtype, device=device).contiguous()
    flat = value.view(-1)
    n = flat.numel()
    flat[n // 3] = float("inf")
    flat[n // 2] = float("-inf")
    flat[(2 * n) // 3] = float("nan")
    flat[-1] = float("nan")
    want_min, _ = check_min_max(value, case, what=f"{case} {dtype} nan/inf")
    assert bool(torch.isnan(want_min).any())


def test_all_nan_and_all_inf_groups(device):
    value = torch.randn(4, 32, dtype=torch.float16).to(device)
    value[0] = float("nan")
    value[1] = float("inf")
    value[2] = float("-inf")
    value[3, 5] = float("nan")
    for strategy, kw in (("channel", {}), ("group", {"group_size": 16}), ("tensor", {})):
        check_min_max(value, "weight", qargs(strategy, **kw), what=f"{strategy} all-nan/inf")


@pytest.mark.parametrize(
    "shape,group_size", [((17, 48), 16), ((5, 96), 32), ((1, 16), 16), ((33, 64), 16)], ids=str
)
@pytest.mark.parametrize("layout", ("contiguous", "transposed"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_g_idx_gathered(shape, group_size, layout, dtype, device):
    value = make_value(shape, dtype, layout, device=device)
    g_idx = permuted_g_idx(shape[1], group_size, torch.int32 if layout == "transposed" else torch.int64,
                           device=device)
    check_min_max(value, "weight", qargs("group", group_size=group_size), g_idx=g_idx,
                  what=f"g_idx {shape} {dtype} {layout}")


class CountingKernel:
    """Wraps a triton kernel; counts launches (``kernel[grid](...)``)."""

    def __init__(self, kernel, counter):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        self.counter.append(grid)
        return self.kernel[grid]


def count_launches(monkeypatch):
    grids = []
    monkeypatch.setattr(min_max_module, "_min_max_kernel",
                        CountingKernel(min_max_module._min_max_kernel, grids))
    return grids


SPLIT_CASES = [
    Case("weight", "tensor", (19, 40)),
    Case("weight", "channel", (5, 40)),
    Case("input", "group", (2, 9, 32), G16),
    Case("input", "token", (3, 5, 24)),
    Case("q", "attn_head", (2, 2, 5, 16)),
    Case("weight", "block", (19, 12), (("block_structure", [8, 8]),)),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
@pytest.mark.parametrize("split", (1, 3, 64))
def test_split_reduction_and_small_tiles(case, split, monkeypatch, pin_launch, device):
    # A tiny tile forces the element and row loops; split > 1 the partials a
    # GPU takes for whole-tensor reductions, finished by the last program of
    # each block to arrive (fresh tickets: the caller keeps none). One launch.
    pin_launch("min_max", tile=16, split=split)
    grids = count_launches(monkeypatch)
    value = make_value(case.shape, torch.bfloat16, "sliced", device=device)
    check_min_max(value, case, what=f"{case} split {split}")
    assert len(grids) == 1, f"{len(grids)} launches"
    if split == 1 or case.strategy == "tensor":  # (a whole tensor has rows to split)
        assert (grids[0][1] > 1) == (split > 1), grids
    value[-1, ..., -1] = float("nan")  # one NaN, written through the strided view
    check_min_max(value, case, what=f"{case} split {split} nan")


def test_a_split_reduction_is_one_compiled_variant_for_every_split(monkeypatch, pin_launch, device):
    """The finishing program's lanes over the partials follow the block's
    groups, never the split (which follows the tensor's size): whole-tensor
    reductions of sizes that split 2 to 40 ways are one launch each with
    the same constexprs (one compiled variant, loaded once per process on a
    GPU), each exact."""
    pin_launch("min_max", tile=64, min_elems_per_program=64, fill_programs=40)
    sink = []
    monkeypatch.setattr(min_max_module, "_min_max_kernel",
                        RecordingKernel(min_max_module._min_max_kernel, sink))
    splits = set()
    for rows in (3, 9, 21, 40):
        sink.clear()
        check_min_max(make_value((rows, 64), torch.bfloat16, "contiguous", device=device),
                      "weight", qargs("tensor"), what=f"{rows} rows")
        ((_, grid, args, kwargs),) = sink
        assert kwargs["FINISH"], kwargs
        splits.add(grid[1])  # the programs over which the rows are split
        constexprs = {k: v for k, v in kwargs.items() if k.isupper() or k == "num_warps"}
        if rows == 3:
            first = constexprs
        assert constexprs == first, f"{rows} rows: {constexprs} != {first}"
    assert len(splits) == 4 and min(splits) >= 2, splits


def test_split_stays_within_the_cuda_grid():
    # The split is grid axis 1 in every launcher; CUDA allows 65535 programs there.
    config = launch_module.LaunchConfig(split=10**6)
    split, per_split = launch_module.choose_split(10**6, 1, 1, 1, config)
    assert split <= 65535 and split * per_split >= 10**6


def test_launch_count_default_config(monkeypatch, device):
    grids = count_launches(monkeypatch)
    check_min_max(torch.randn(17, 33).to(device), "weight", qargs("tensor"))
    assert len(grids) == 1  # too little work to split (on any device)


def test_no_flattened_copy(monkeypatch, device):
    # The kernel addresses the raw value: the reference's flatten is never called.
    reference_min_max = importlib.import_module("obskernels.reference.min_max")
    reference_flatten = importlib.import_module("obskernels.reference.flatten")

    def forbidden(*a, **k):
        raise AssertionError("the triton min_max used a flattened copy")

    value = torch.randn(17, 33).to(device)
    args = qargs("block", block_structure=[8, 16])
    with use_backend("reference"):
        want = ops.min_max(value, "weight", args)
    monkeypatch.setattr(reference_min_max, "flatten_for_calibration", forbidden)
    monkeypatch.setattr(reference_flatten, "flatten_for_calibration", forbidden)
    with use_backend("triton"):
        got = ops.min_max(value, "weight", args)
    assert_same(got[0], want[0], "min")
    assert_same(got[1], want[1], "max")


# --------------------------------------------------------------------------- #
# the tile paths a GPU takes (kernels/launch/'s policy is the same on every
# device): small shapes with pinned tiles and fill target reach each of them here
# --------------------------------------------------------------------------- #
BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# (id, shape, dtype, layout, base_name, args, g_idx group size or None, LaunchConfig pins)
TILE_PATHS = [
    ("group-loop", (64, 64), BF, "contiguous", "weight", qargs("group", group_size=16), None,
     dict(tile=64, fill_programs=2)),
    ("group-loop-tail", (17, 48), F16, "sliced", "weight", qargs("group", group_size=16), None,
     dict(tile=32, fill_programs=2)),
    ("chunk-shifted-back", (3, 4113), BF, "contiguous", "weight", qargs("channel"), None, dict(tile=64)),
    ("short-chunk", (5, 17), F32, "contiguous", "weight", qargs("channel"), None, {}),
    ("row-tail", (3, 9, 64), BF, "contiguous", "input", qargs("group", group_size=32), None, dict(tile=64)),
    ("two-row-levels", (3, 9, 48), F16, "sliced", "input", qargs("group", group_size=16), None,
     dict(tile=64)),
    ("three-row-levels", (2, 3, 17, 16), BF, "sliced", "q", qargs("tensor"), None, dict(tile=64)),
    ("rows-contiguous-pad", (130, 129), BF, "transposed", "weight",
     qargs("block", block_structure=[128, 128]), None, dict(tile=256)),
    ("groups-contiguous", (64, 40), BF, "transposed", "weight", qargs("channel"), None, dict(tile=64)),
    ("g_idx", (33, 64), BF, "contiguous", "weight", qargs("group", group_size=16), 16,
     dict(tile=64, fill_programs=2)),
    ("g_idx-one-step", (40, 32), F32, "transposed", "weight", qargs("group", group_size=2), 2,
     dict(tile=64, fill_programs=2)),
    # groups of one row of 64 bytes, read whole in a step (ONE_STEP_GROUP_VECTORS)
    ("whole-group-loop", (48, 96), BF, "contiguous", "weight", qargs("group", group_size=32), None,
     dict(tile=256, fill_programs=2)),
    ("whole-group-loop-tail", (17, 48), F32, "sliced", "weight", qargs("group", group_size=16), None,
     dict(tile=128, fill_programs=2)),
]


@pytest.mark.parametrize("dtype, group, whole", [
    (torch.bfloat16, 32, True), (torch.float16, 32, True), (torch.float32, 16, True),
    (torch.bfloat16, 16, True), (torch.bfloat16, 64, False), (torch.float32, 32, False),
])
def test_a_group_of_at_most_four_vectors_is_one_step(dtype, group, whole):
    """A group of one row of at most 64 bytes is read whole in one step, its
    blocks looped over by the programs (what a program issues once is then
    shared by many blocks), unless the launch may compute the qparams in its
    epilogue, which keeps 32-byte chunks; a wider group walks 32-byte chunks."""
    from obskernels.kernels._layout import group_layout
    from obskernels.kernels.launch import current_config, min_max_tile
    from obskernels.spec import calls

    value = torch.empty(4096, 4096, dtype=dtype)
    layout = group_layout(calls.min_max(value, "weight", qargs("group", group_size=group)).flat)
    config = current_config("min_max")
    tile = min_max_tile(layout, value.element_size(), config)
    assert (tile.e, tile.group_loop) == ((group, True) if whole else (32 // value.element_size(), False))
    chunked = min_max_tile(layout, value.element_size(), config, qparams=True)
    assert chunked.e == min(group, 32 // value.element_size())
    assert chunked.group_loop == (group * value.element_size() <= 32)


def _tile_path_value(shape, dtype, layout, g, device):
    value = make_value(shape, dtype, layout, device=device)
    g_idx = None if g is None else permuted_g_idx(shape[1], g, device=device)
    return value, g_idx


def _record_launches(monkeypatch):
    sink = []
    monkeypatch.setattr(min_max_module, "_min_max_kernel",
                        RecordingKernel(min_max_module._min_max_kernel, sink))
    return sink


@pytest.mark.parametrize("path", TILE_PATHS, ids=[p[0] for p in TILE_PATHS])
def test_tile_paths_match_reference(path, pin_launch, device):
    name, shape, dtype, layout, base_name, args, g, pins = path
    pin_launch("min_max", **pins)
    value, g_idx = _tile_path_value(shape, dtype, layout, g, device)
    check_min_max(value, base_name, args, g_idx=g_idx, what=name)
    # NaN and +-inf in the last group read: the flag and the error path
    flat_index = tuple(n - 1 for n in value.shape)
    value[flat_index] = float("nan")
    value[tuple(0 for _ in value.shape)] = float("inf")
    check_min_max(value, base_name, args, g_idx=g_idx, what=f"{name} nan")


@pytest.mark.parametrize("path", TILE_PATHS, ids=[p[0] for p in TILE_PATHS])
def test_tile_paths_record_nonfinite(path, pin_launch, device):
    # the non-finite record re-reads a program's slice (every block of a group
    # loop) and counts each element once
    from obskernels.spec.record import STATUS_INIT

    name, shape, dtype, layout, base_name, args, g, pins = path
    pin_launch("min_max", **pins)
    value, g_idx = _tile_path_value(shape, dtype, layout, g, device)
    value[tuple(n - 1 for n in value.shape)] = float("nan")
    value[tuple(0 for _ in value.shape)] = float("-inf")
    value[tuple(n // 2 for n in value.shape)] = float("inf")
    got = {}
    for backend in ("reference", "triton"):
        status = torch.tensor(STATUS_INIT, device=device)
        with use_backend(backend):
            ops.min_max(value, base_name, args, g_idx=g_idx, status=status, observation=3)
        got[backend] = status.tolist()
    counts = [int(torch.isnan(value).sum()), int(torch.isposinf(value).sum()), int(torch.isneginf(value).sum())]
    assert got["triton"] == got["reference"], name
    assert got["triton"][:3] == [a + b for a, b in zip(STATUS_INIT[:3], counts)], name


def test_tile_paths_reach_every_mode(monkeypatch, device):
    """The cases above reach every tile mode of the kernel as a GPU launches it."""
    sink = _record_launches(monkeypatch)
    for name, shape, dtype, layout, base_name, args, g, pins in TILE_PATHS:
        with launch_module.launch_config(ops="min_max", **pins):
            value, g_idx = _tile_path_value(shape, dtype, layout, g, device)
            with use_backend("triton"):
                ops.min_max(value, base_name, args, g_idx=g_idx)
    seen = {}
    looped = shifted = False
    for _, grid, args, kw in sink:
        for key in ("GROUP_LOOP", "GROUP_TAIL", "ROW_TAIL", "SHORT_E", "ROW_LEVELS", "PAD", "GATHER"):
            seen.setdefault(key, set()).add(kw[key])
        Q, geo = args[4], args[8]
        n_blocks = -(-(Q // geo.QB) // kw["BLOCK_A"]) * -(-geo.QB // kw["BLOCK_B"])
        looped |= bool(kw["GROUP_LOOP"]) and grid[0] < n_blocks  # several blocks per program
        shifted |= not kw["SHORT_E"] and geo.E > kw["BLOCK_E"] and geo.E % kw["BLOCK_E"] != 0
    want = {"GROUP_LOOP": {False, True}, "GROUP_TAIL": {False, True}, "ROW_TAIL": {False, True},
            "SHORT_E": {False, True}, "ROW_LEVELS": {0, 1, 2, 3}, "PAD": {False, True},
            "GATHER": {False, True}}
    missing = {k: w - seen.get(k, set()) for k, w in want.items() if w - seen.get(k, set())}
    assert not missing, f"tile modes not reached: {missing}"
    assert looped, "no program looped over several blocks of groups"
    assert shifted, "no last element chunk was shifted back"


BAD_INPUTS = [
    ("weight-token", lambda: (torch.randn(4, 16), "weight", qargs("token"), None)),
    ("weight-attn_head", lambda: (torch.randn(4, 16), "weight", qargs("attn_head"), None)),
    ("input-channel", lambda: (torch.randn(4, 16), "input", qargs("channel"), None)),
    ("input-block", lambda: (torch.randn(4, 16), "input", qargs("block", block_structure=[2, 2]), None)),
    ("q-group", lambda: (torch.randn(1, 2, 3, 16), "q", qargs("group", group_size=8), None)),
    ("cols-not-divisible", lambda: (torch.randn(4, 20), "weight", qargs("group", group_size=16), None)),
    ("hidden-not-divisible", lambda: (torch.randn(4, 20), "input", qargs("group", group_size=16), None)),
    ("bad-base-name", lambda: (torch.randn(4, 16), "bias", qargs("tensor"), None)),
    ("weight-3d", lambda: (torch.randn(2, 4, 16), "weight", qargs("tensor"), None)),
    ("input-4d", lambda: (torch.randn(1, 2, 4, 16), "input", qargs("tensor"), None)),
    ("int-value", lambda: (torch.ones(4, 16, dtype=torch.int32), "weight", qargs("tensor"), None)),
    ("args-not-qargs", lambda: (torch.randn(4, 16), "weight", {"strategy": "tensor"}, None)),
    ("g_idx-channel", lambda: (torch.randn(4, 16), "weight", qargs("channel"), torch.zeros(16, dtype=torch.long))),
    ("g_idx-float", lambda: (torch.randn(4, 16), "weight", qargs("group", group_size=8), torch.zeros(16))),
    ("g_idx-length", lambda: (torch.randn(4, 16), "weight", qargs("group", group_size=8), torch.zeros(8, dtype=torch.long))),
    ("g_idx-range", lambda: (torch.randn(4, 16), "weight", qargs("group", group_size=8), torch.arange(16) // 4)),
    ("g_idx-counts", lambda: (torch.randn(4, 16), "weight", qargs("group", group_size=8), (torch.arange(16) > 2).long())),
]


@pytest.mark.parametrize("make", [m for _, m in BAD_INPUTS], ids=[n for n, _ in BAD_INPUTS])
@pytest.mark.parametrize("op", ("min_max", "flatten_for_calibration"))
def test_bad_input_raises_like_reference(op, make, device):
    value, base_name, args, g_idx = make()
    value, g_idx = value.to(device), None if g_idx is None else g_idx.to(device)
    results = {}
    for name in ("reference", "triton"):
        with use_backend(name):
            results[name] = outcome(lambda: getattr(ops, op)(value, base_name, args, g_idx=g_idx))
    assert results["reference"] is not None, "the reference accepted a bad input"
    assert results["reference"][0] in (ValueError, TypeError)
    assert results["triton"] == results["reference"]


EMPTY = [
    ("weight-channel-0-rows", torch.randn(0, 16), "weight", qargs("channel")),
    ("weight-channel-0-cols", torch.randn(4, 0), "weight", qargs("channel")),
    ("weight-tensor", torch.randn(0, 16), "weight", qargs("tensor")),
    ("weight-group-0-rows", torch.randn(0, 16), "weight", qargs("group", group_size=8)),
    ("weight-block", torch.randn(0, 16), "weight", qargs("block", block_structure=[4, 4])),
    ("input-token-3d", torch.randn(0, 3, 16), "input", qargs("token")),
    ("k-attn_head", torch.randn(1, 0, 3, 16), "k", qargs("attn_head")),
]


@pytest.mark.parametrize("name,value,base_name,args", EMPTY, ids=[e[0] for e in EMPTY])
def test_empty_value_like_reference(name, value, base_name, args, device):
    value = value.to(device)
    results = {}
    for backend in ("reference", "triton"):
        with use_backend(backend):
            try:
                results[backend] = ops.min_max(value, base_name, args)
            except Exception as exc:  # noqa: BLE001
                results[backend] = (type(exc), str(exc))
    ref, got = results["reference"], results["triton"]
    if isinstance(ref[0], type):
        assert got == ref
    else:
        for g, w, what in zip(got, ref, ("min", "max")):
            assert_same(g, w, f"{name} {what}")


@pytest.mark.gpu
def test_offsets_past_2_pow_31_on_gpu():
    # 2^31 + 2^15 bf16 elements (4 GiB): the last rows sit past int32 offsets.
    value = torch.empty((1 << 16) + 1, 1 << 15, dtype=torch.bfloat16, device="cuda")
    value.normal_()
    value[-1, -1] = 1e4
    for strategy in ("channel", "tensor"):
        check_min_max(value, "weight", qargs(strategy), what=f"2^31 {strategy}")
