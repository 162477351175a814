"""Parity of the triton flatten_for_calibration with the reference (docs/spec.md §2, §5).

The BLOCK layout (zero padded) and the g_idx reordering are copies written by
a kernel: they must equal the reference bit for bit (compared as integers, so
NaN payloads and -0.0 count). Every other strategy must be the reference's
own result (a view where the reference gives a view). Bad-input parity for
flatten shares the table in test_kernels_minmax.py (both ops run the same checks).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from obskernels import ops
from obskernels.backends import use_backend

from helpers import DTYPES, RecordingKernel, make_value, permuted_g_idx, qargs

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

flatten_module = importlib.import_module("obskernels.kernels.flatten")

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def with_specials(value):
    """Plant NaN, +-inf and -0.0 so a bitwise copy is really checked."""
    n = value.numel()
    for i, v in zip((0, n // 3, n // 2, n - 1), (float("nan"), float("inf"), -0.0, float("-inf"))):
        value[tuple(int(k) for k in torch.unravel_index(torch.tensor(i), value.shape))] = v
    return value


def flatten_both(value, base_name, args, g_idx=None):
    with use_backend("reference"):
        want = ops.flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    with use_backend("triton"):
        got = ops.flatten_for_calibration(value, base_name, args, g_idx=g_idx)
    return got, want


def assert_bitwise(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g, w = got.contiguous().view(BITS[got.dtype]), want.contiguous().view(BITS[want.dtype])
    bad = g != w
    if bool(bad.any()):
        idx = bad.nonzero().tolist()[:5]
        detail = ", ".join(
            f"index {tuple(i)} (group {tuple(i[:-1])}): got {got[tuple(i)].item()!r} "
            f"want {want[tuple(i)].item()!r}" for i in idx
        )
        raise AssertionError(f"{what}: {int(bad.sum())} of {want.numel()} elements differ; {detail}")


BLOCKS = [
    ((17, 33), [8, 16]),  # partial blocks both ways
    ((16, 32), [8, 16]),  # exact blocks
    ((5, 7), [8, 16]),  # one block, mostly padding
    ((130, 129), [128, 128]),
    ((3, 40), [1, 8]),
    ((1, 1), [4, 4]),
]


@pytest.mark.parametrize("layout", ("contiguous", "transposed", "sliced"))
@pytest.mark.parametrize("shape,block", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_layout_bitwise(shape, block, dtype, layout, device):
    value = with_specials(make_value(shape, dtype, layout, device=device))
    got, want = flatten_both(value, "weight", qargs("block", block_structure=block))
    assert_bitwise(got, want, f"block {block} {shape} {dtype} {layout}")
    assert got.is_contiguous()


@pytest.mark.parametrize("layout", ("contiguous", "transposed", "sliced"))
@pytest.mark.parametrize("shape,group_size", [((17, 48), 16), ((5, 96), 32), ((1, 16), 16)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_g_idx_reordering_bitwise(shape, group_size, dtype, layout, device):
    value = with_specials(make_value(shape, dtype, layout, device=device))
    g_idx = permuted_g_idx(shape[1], group_size, torch.int32 if layout == "sliced" else torch.int64,
                           device=device)
    got, want = flatten_both(value, "weight", qargs("group", group_size=group_size), g_idx)
    assert_bitwise(got, want, f"g_idx {shape} g{group_size} {dtype} {layout}")


def test_g_idx_ties_keep_column_order(device):
    # Stable order within a group: columns of one group keep their order.
    value = torch.arange(2 * 32, dtype=torch.float32, device=device).reshape(2, 32)
    g_idx = torch.tensor([1, 0] * 16, device=device)
    got, want = flatten_both(value, "weight", qargs("group", group_size=16), g_idx)
    assert_bitwise(got, want, "stable g_idx")
    assert got[0, 0, 0].tolist() == list(range(1, 32, 2))


@pytest.mark.parametrize("tile", (16, 64))
def test_small_tiles_loop_over_elements(tile, pin_launch, device):
    # A tile smaller than a block row forces the element loop and many programs.
    pin_launch("flatten", tile=tile)
    value = make_value((19, 70), torch.bfloat16, "sliced", device=device)
    got, want = flatten_both(value, "weight", qargs("block", block_structure=[4, 32]))
    assert_bitwise(got, want, f"tile {tile} block")
    g_idx = permuted_g_idx(64, 32, device=device)
    got, want = flatten_both(value[:, :64], "weight", qargs("group", group_size=32), g_idx)
    assert_bitwise(got, want, f"tile {tile} g_idx")


# (id, shape, dtype, layout, block or None, g_idx group size or None, LaunchConfig pins):
# the tile paths a GPU takes, on small shapes with pinned tiles and fill target
TILE_PATHS = [
    ("pad-tails", (17, 33), torch.bfloat16, "sliced", [8, 16], None, dict(tile=32)),
    ("rows-contiguous-pad", (130, 129), torch.float16, "transposed", [128, 128], None, dict(tile=256)),
    ("exact-blocks", (16, 32), torch.float32, "contiguous", [8, 16], None, dict(tile=64)),
    ("short-chunk", (9, 36), torch.bfloat16, "contiguous", [4, 12], None, dict(tile=64)),
    ("chunk-shifted-back", (6, 300), torch.float32, "contiguous", [3, 300], None, dict(tile=64)),
    ("row-tail", (10, 64), torch.float32, "sliced", [5, 16], None, dict(tile=64, min_elems_per_program=1)),
    ("g_idx-group-loop", (33, 64), torch.bfloat16, "contiguous", None, 16, dict(tile=64, fill_programs=2)),
    ("g_idx-chunks", (5, 96), torch.float16, "transposed", None, 48, dict(tile=32)),
]


def _flatten_path(path, device):
    name, shape, dtype, layout, block, g, pins = path
    value = with_specials(make_value(shape, dtype, layout, device=device))
    if block is not None:
        return value, qargs("block", block_structure=block), None
    return value, qargs("group", group_size=g), permuted_g_idx(shape[1], g, device=device)


@pytest.mark.parametrize("path", TILE_PATHS, ids=[p[0] for p in TILE_PATHS])
def test_tile_paths_bitwise(path, pin_launch, device):
    pin_launch("flatten", **path[-1])
    value, args, g_idx = _flatten_path(path, device)
    got, want = flatten_both(value, "weight", args, g_idx)
    assert_bitwise(got, want, path[0])


def test_tile_paths_reach_every_mode(monkeypatch, device):
    import importlib

    launch = importlib.import_module("obskernels.kernels.launch")
    sink = []
    monkeypatch.setattr(flatten_module, "_flatten_kernel", RecordingKernel(flatten_module._flatten_kernel, sink))
    for path in TILE_PATHS:
        with launch.launch_config(ops="flatten", **path[-1]):
            value, args, g_idx = _flatten_path(path, device)
            with use_backend("triton"):
                ops.flatten_for_calibration(value, "weight", args, g_idx=g_idx)
    seen, looped, shifted = {}, False, False
    for _, grid, a, kw in sink:
        for key in ("GROUP_LOOP", "GROUP_TAIL", "ROW_TAIL", "SHORT_E", "PAD", "GATHER"):
            seen.setdefault(key, set()).add(kw[key])
        Q, geo = a[3], a[7]
        n_blocks = -(-(Q // geo.QB) // kw["BLOCK_A"]) * -(-geo.QB // kw["BLOCK_B"])
        looped |= bool(kw["GROUP_LOOP"]) and grid[0] < n_blocks
        shifted |= not kw["SHORT_E"] and geo.E > kw["BLOCK_E"] and geo.E % kw["BLOCK_E"] != 0
    missing = {k: {False, True} - v for k, v in seen.items() if {False, True} - v}
    assert not missing, f"tile modes not reached: {missing}"
    assert looped, "no program looped over several blocks of groups"
    assert shifted, "no last element chunk was shifted back"


VIEW_CASES = [
    ("weight", "tensor", (17, 33), {}),
    ("weight", "channel", (17, 33), {}),
    ("weight", "group", (17, 48), {"group_size": 16}),
    ("weight", "tensor_group", (17, 48), {"group_size": 16}),
    ("input", "tensor", (2, 17, 48), {}),
    ("input", "token", (2, 17, 48), {}),
    ("output", "group", (17, 48), {"group_size": 16}),
    ("q", "tensor", (2, 3, 17, 16), {}),
    ("k", "attn_head", (2, 3, 17, 16), {}),
]


@pytest.mark.parametrize("layout", ("contiguous", "transposed"))
@pytest.mark.parametrize("base_name,strategy,shape,kw", VIEW_CASES, ids=lambda v: str(v))
def test_other_strategies_are_the_reference_view(base_name, strategy, shape, kw, layout, device):
    value = make_value(shape, torch.bfloat16, layout, device=device)
    got, want = flatten_both(value, base_name, qargs(strategy, **kw))
    assert_bitwise(got, want, f"{base_name} {strategy} {layout}")
    assert got.stride() == want.stride()
    shares = got.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    assert shares == (want.untyped_storage().data_ptr() == value.untyped_storage().data_ptr())
    if layout == "contiguous" and base_name not in ("q", "k", "v"):
        assert shares, "a contiguous weight or activation flattens to a view"


EMPTY = [
    ("block-0-rows", torch.randn(0, 16), qargs("block", block_structure=[4, 4]), None),
    ("block-0-cols", torch.randn(4, 0), qargs("block", block_structure=[4, 4]), None),
    ("g_idx-0-rows", torch.randn(0, 16), qargs("group", group_size=8), torch.arange(16) // 8),
]


@pytest.mark.parametrize("name,value,args,g_idx", EMPTY, ids=[e[0] for e in EMPTY])
def test_empty_value_like_reference(name, value, args, g_idx, device):
    value, g_idx = value.to(device), None if g_idx is None else g_idx.to(device)
    results = {}
    for backend in ("reference", "triton"):
        with use_backend(backend):
            try:
                results[backend] = ops.flatten_for_calibration(value, "weight", args, g_idx=g_idx)
            except Exception as exc:  # noqa: BLE001 - type and message are compared
                results[backend] = (type(exc), str(exc))
    ref, got = results["reference"], results["triton"]
    if isinstance(ref, tuple):
        assert got == ref
    else:
        assert_bitwise(got, ref, name)

