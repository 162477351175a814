"""Offsets and indices past 2^31 elements, mostly without
allocating such a tensor.

Three levels:
1. The device-side address arithmetic of kernels/_layout.py (``load_flat``,
   which every launcher reads through) on layouts of 2.8e9-element views
   whose storage is reserved but never touched: a probe kernel reads a few
   chosen (group, element) lanes, including the last one, whose storage
   offsets pass 2^31; each must equal the element torch reads at that index.
2. Every launcher, run for real under the interpreter, on few-element views
   whose strides put addresses past 2^31 (and past 2^31 products of two
   int32 numbers) in a lazily allocated 4 GiB storage; results against the
   reference on a contiguous copy.
3. Tensors of 2^31 + 17 elements for real, and a 2.8e9-element stride-0 view
   that drives the index counters past 2^31: the reference runs here where
   memory allows; the kernels need a GPU (the interpreter would take hours).

A lazily allocated storage costs address space, not memory: torch.empty does
not touch its pages and the interpreter hands CPU storages to kernels as they
are. Only the pages holding the few elements written are ever backed.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from obskernels import ops
from obskernels.backends import triton_unavailable_reason, use_backend
from obskernels.spec.layout import flattening

from helpers import assert_search_parity
from helpers import qargs as _qargs

triton = pytest.importorskip("triton", reason="the Triton kernels need triton")
tl = triton.language
_layout = importlib.import_module("obskernels.kernels._layout")
load_flat = _layout.load_flat


def group_layout(value, base_name, args, g_idx=None, **kw):
    """The kernels' index map of a checked flattening call."""
    return _layout.group_layout(flattening(value, base_name, args, g_idx), **kw)

pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(triton_unavailable_reason(None) is not None,
                       reason=f"triton backend unavailable: {triton_unavailable_reason(None)}"),
]

INT32_MAX = 2**31 - 1
BIG_ROWS, BIG_COLS = 70000, 40000  # 2.8e9 elements


def mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def qargs(strategy, **kw):
    return _qargs(strategy, symmetric=False, **kw)




# --------------------------------------------------------------------------- #
# 1. address arithmetic on 2.8e9-element layouts
# --------------------------------------------------------------------------- #
@triton.jit
def _probe_kernel(x_ptr, perm_ptr, q_ptr, k_ptr, out_ptr, N, Q, NR, lim_r, lim_e, geo,
                  BLOCK: tl.constexpr, PAD: tl.constexpr, GATHER: tl.constexpr):
    """out[i] = flat[q[i], k[i]] read through load_flat (k int64)."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    q = tl.load(q_ptr + i, mask=ok, other=0)
    k = tl.load(k_ptr + i, mask=ok, other=0)
    x, col = load_flat(x_ptr, perm_ptr, q, k, ok, geo, NR, lim_r, lim_e, PAD, GATHER)
    tl.store(out_ptr + i, x, mask=ok)


@pytest.fixture(scope="module")
def huge_storage():
    """2.8e9 + 64 bf16 elements of address space (5.6 GB), pages untouched."""
    storage = torch.empty(BIG_ROWS * BIG_COLS + 64, dtype=torch.bfloat16)
    yield storage
    del storage


def big_views(storage):
    return {
        # weights (rows, cols): row-major, and column-major (a transposed view)
        "weight-rowmajor": storage.as_strided((BIG_ROWS, BIG_COLS), (BIG_COLS, 1)),
        "weight-colmajor": storage.as_strided((BIG_ROWS, BIG_COLS), (1, BIG_ROWS)),
        # activations (batch, seq, hidden) with the batch dim outermost in memory
        "input-3d": storage.as_strided((7, 10000, BIG_COLS), (10000 * BIG_COLS, BIG_COLS, 1)),
    }


def flat_index(shape, strategy, q, k, args):
    """(index into the value, or None for a padding zero) of flat[q, k]: docs/spec.md §2 by hand."""
    if len(shape) == 2 and strategy == "weight-channel":
        return (q, k)
    if len(shape) == 2 and strategy == "weight-group":
        g = args.group_size
        per_row = shape[1] // g
        return (q // per_row, (q % per_row) * g + k)
    if len(shape) == 2 and strategy == "weight-tensor":
        return (k // shape[1], k % shape[1])
    if len(shape) == 2 and strategy == "weight-block":
        bh, bw = args.block_structure
        nbc = -(-shape[1] // bw)
        i, j = (q // nbc) * bh + k // bw, (q % nbc) * bw + k % bw
        return (i, j) if i < shape[0] and j < shape[1] else None
    if strategy == "input-tensor":
        hidden = shape[-1]
        tok, h = k // hidden, k % hidden
        return (tok // shape[1], tok % shape[1], h)
    if strategy == "input-group":
        g = args.group_size
        tok, e = k // g, k % g
        return (tok // shape[1], tok % shape[1], q * g + e)
    raise AssertionError(strategy)


LAYOUTS = [
    # view, strategy, args
    ("weight-rowmajor", "weight-channel", qargs("channel")),
    ("weight-colmajor", "weight-channel", qargs("channel")),
    ("weight-colmajor", "weight-group", qargs("group", group_size=160)),
    ("weight-rowmajor", "weight-tensor", qargs("tensor")),
    ("weight-colmajor", "weight-tensor", qargs("tensor")),
    ("weight-colmajor", "weight-block", qargs("block", block_structure=[128, 96])),  # partial blocks
    ("input-3d", "input-tensor", qargs("tensor")),
    ("input-3d", "input-group", qargs("group", group_size=64)),
]


@pytest.mark.parametrize("row", LAYOUTS, ids=[f"{r[0]}-{r[1]}" for r in LAYOUTS])
def test_layout_addresses_past_2_pow_31(huge_storage, row):
    view_name, strategy, args = row
    value = big_views(huge_storage)[view_name]
    base_name = "weight" if strategy.startswith("weight") else "input"
    layout = group_layout(value, base_name, args, storage_order=False)
    Q, NR, E = layout.num_groups, layout.num_rows, layout.elems
    group_numel = NR * E
    # group indices are int32 lanes in the kernels; a group's element count
    # (k, read as int64 here) may pass 2^31, as it does for TENSOR
    assert Q <= INT32_MAX
    lanes = [(0, 0), (Q - 1, group_numel - 1), (Q // 2, group_numel // 3), (Q - 1, 0), (0, group_numel - 1)]
    gen = torch.Generator().manual_seed(0)
    lanes += [(int(torch.randint(Q, (1,), generator=gen)), int(torch.randint(group_numel, (1,), generator=gen)))
              for _ in range(11)]
    where = [flat_index(tuple(value.shape), strategy, q, k, args) for q, k in lanes]
    offsets = [None if w is None else sum(i * s for i, s in zip(w, value.stride())) for w in where]
    assert max(o for o in offsets if o is not None) > INT32_MAX, "the probe must reach past 2^31"
    # write distinct values where the lanes point (a few pages are touched)
    for n, w in enumerate(where):
        if w is not None:
            value[w] = float(n + 1)
    want = torch.tensor([0.0 if w is None else float(value[w]) for w in where], dtype=value.dtype)
    # the same lanes through the kernels' address arithmetic
    q_t = torch.tensor([q for q, _ in lanes], dtype=torch.int32)
    k_t = torch.tensor([k for _, k in lanes], dtype=torch.int64)
    out = torch.full((len(lanes),), -7.0, dtype=value.dtype)
    perm = layout.perm if layout.gather else value
    _probe_kernel[(1,)](value, perm, q_t, k_t, out, len(lanes), *layout.kernel_args(),
                        BLOCK=triton.next_power_of_2(len(lanes)), PAD=layout.pad,
                        GATHER=layout.gather)
    bad = (out != want).nonzero().flatten().tolist()
    assert not bad, [(lanes[i], offsets[i], float(out[i]), float(want[i])) for i in bad]


def test_gather_layout_addresses_past_2_pow_31(huge_storage):
    """GROUP with g_idx: columns come through a permutation, rows far apart."""
    value = big_views(huge_storage)["weight-colmajor"]
    g = 100
    g_idx = torch.randperm(BIG_COLS, generator=torch.Generator().manual_seed(1)) // g
    layout = group_layout(value, "weight", qargs("group", group_size=g), g_idx)
    perm = layout.perm.long()
    per_row = BIG_COLS // g
    lanes = [(BIG_ROWS * per_row - 1, g - 1), (0, 0), ((BIG_ROWS - 3) * per_row + 17, 42)]
    where = [(q // per_row, int(perm[(q % per_row) * g + k])) for q, k in lanes]
    assert max(i * value.stride(0) + j * value.stride(1) for i, j in where) > INT32_MAX
    for n, w in enumerate(where):
        value[w] = float(n + 1)
    want = torch.tensor([float(value[w]) for w in where], dtype=value.dtype)
    out = torch.zeros(len(lanes), dtype=value.dtype)
    _probe_kernel[(1,)](value, layout.perm, torch.tensor([q for q, _ in lanes], dtype=torch.int32),
                        torch.tensor([k for _, k in lanes], dtype=torch.int64), out, len(lanes),
                        *layout.kernel_args(), BLOCK=4, PAD=False, GATHER=True)
    assert torch.equal(out, want), (out, want)


# --------------------------------------------------------------------------- #
# 2. every launcher on few-element views addressed past 2^31
# --------------------------------------------------------------------------- #
STORAGE_ELEMS = 2**31 + 2**21  # 4 GiB of bf16 address space


@pytest.fixture(scope="module")
def storage_4g():
    storage = torch.empty(STORAGE_ELEMS, dtype=torch.bfloat16)
    yield storage
    del storage


S30 = 2**30 + 1  # int32 stride whose products with small int32 indices pass 2^31


def far_views(storage):
    """(name, base_name, view) with at least one element past 2^31 in storage."""
    return [
        ("weight-rows-far", "weight", storage.as_strided((3, 8), (S30, 1))),
        ("weight-cols-far", "weight", storage.as_strided((4, 4), (1, 715827883))),
        ("weight-stride-over-int32", "weight", storage.as_strided((2, 8), (2**31 + 5, 1))),
        ("input-3d-far", "input", storage.as_strided((2, 3, 8), (3 * 2**29, 2**28, 1))),
        ("k-heads-far", "k", storage.as_strided((1, 3, 2, 4), (4, S30 - 1, 16, 1))),
    ]


def fill(view, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(view.shape, generator=g).to(view.dtype)
    view.copy_(values)  # writes only the view's elements
    return values


STRATEGIES = {
    "weight": [qargs("channel"), qargs("group", group_size=4), qargs("tensor"),
               qargs("block", block_structure=[2, 3])],
    "input": [qargs("tensor"), qargs("group", group_size=4), qargs("token")],
    "k": [qargs("tensor"), qargs("attn_head")],
}


VIEW_NAMES = ["weight-rows-far", "weight-cols-far", "weight-stride-over-int32", "input-3d-far", "k-heads-far"]


def view_named(storage, name):
    return next((b, v) for n, b, v in far_views(storage) if n == name)


@pytest.mark.parametrize("split", (None, 2))
@pytest.mark.parametrize("name", VIEW_NAMES)
def test_min_max_and_flatten_past_2_pow_31(storage_4g, pin_launch, name, split):
    pin_launch("min_max", split=split, tile=16)
    base_name, view = view_named(storage_4g, name)
    contiguous = fill(view, seed=len(name))
    assert sum((d - 1) * s for d, s in zip(view.shape, view.stride())) > 2**31
    for args in STRATEGIES[base_name]:
        with use_backend("triton"):
            got = ops.min_max(view, base_name, args)
            flat = ops.flatten_for_calibration(view, base_name, args)
        with use_backend("reference"):
            want = ops.min_max(contiguous, base_name, args)
            want_flat = ops.flatten_for_calibration(contiguous, base_name, args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (args.strategy, got, want)
        assert torch.equal(flat, want_flat), args.strategy


@pytest.mark.parametrize("name", ["weight-rows-far", "weight-stride-over-int32"])
def test_g_idx_flatten_past_2_pow_31(storage_4g, name):
    _, view = view_named(storage_4g, name)
    contiguous = fill(view, seed=5)
    args = qargs("group", group_size=2)
    g_idx = torch.tensor([3, 0, 1, 2, 0, 3, 1, 2])
    with use_backend("triton"):
        got = ops.min_max(view, "weight", args, g_idx=g_idx)
        flat = ops.flatten_for_calibration(view, "weight", args, g_idx=g_idx)
    with use_backend("reference"):
        want = ops.min_max(contiguous, "weight", args, g_idx=g_idx)
        want_flat = ops.flatten_for_calibration(contiguous, "weight", args, g_idx=g_idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(flat, want_flat)


MSE = dict(maxshrink=0.5, patience=3, grid=8, norm=2.4)


@pytest.mark.parametrize("path", ("registers", "split"))
@pytest.mark.parametrize("name", VIEW_NAMES)
def test_mse_search_past_2_pow_31(storage_4g, pin_launch, name, path):
    if path == "split":  # groups of more than 4 elements take the chunked path
        pin_launch("mse_search", max_reg_group=4, chunk=4)
    base_name, view = view_named(storage_4g, name)
    contiguous = fill(view, seed=11)
    for args in STRATEGIES[base_name]:
        if args.strategy in ("block", "token"):
            continue  # min/max covers those layouts; keep the interpreter time down
        with use_backend("triton"):
            got = ops.mse_search(view, base_name, args, **MSE)
        assert_search_parity(contiguous, base_name, args, got, **MSE)


@pytest.mark.parametrize("split", (None, 2))
@pytest.mark.parametrize("name", ["weight-rows-far", "input-3d-far", "weight-stride-over-int32"])
def test_accumulate_sq_past_2_pow_31(storage_4g, pin_launch, name, split):
    pin_launch("accumulate_sq", split=split, tile=16)
    _, x = view_named(storage_4g, name)
    contiguous = fill(x, seed=13)
    hidden = x.shape[-1]
    sum_buf, count_buf = torch.zeros(hidden), torch.zeros(1, dtype=torch.int64)
    with use_backend("triton"):
        ops.accumulate_sq(x, sum_buf, count_buf)
    want = contiguous.float().double().pow(2).reshape(-1, hidden).sum(0)
    torch.testing.assert_close(sum_buf.double(), want, rtol=1e-5, atol=0)
    assert int(count_buf) == contiguous.numel() // hidden


# --------------------------------------------------------------------------- #
# 3. for real: 2^31 + 17 elements, and a 2.8e9-element stride-0 view
# --------------------------------------------------------------------------- #
REAL_SHAPE = (429496733, 5)  # 2^31 + 17 elements, as (tokens, hidden)
assert REAL_SHAPE[0] * REAL_SHAPE[1] == 2**31 + 17


def real_value(device):
    value = torch.zeros(REAL_SHAPE, dtype=torch.bfloat16, device=device)
    value[-1, -1] = 3.0  # the last element, past 2^31
    value[-2, 0] = -2.0  # also past 2^31
    value[0, 1] = 1.0
    return value


@pytest.mark.slow
def test_reference_on_2_pow_31_plus_17_elements():
    if mem_available_gib() < 9:
        pytest.skip(f"needs ~5 GiB free for a 4 GiB tensor, {mem_available_gib():.1f} GiB available")
    value = real_value("cpu")
    with use_backend("reference"):
        mn, mx = ops.min_max(value, "input", qargs("tensor"))
    assert float(mn) == -2.0 and float(mx) == 3.0
    del value


@pytest.mark.gpu
def test_kernels_on_2_pow_31_plus_17_elements():
    # Under the interpreter this is hours of numpy; on a GPU, seconds.
    value = real_value("cuda")
    with use_backend("triton"):
        mn, mx = ops.min_max(value, "input", qargs("tensor"))
        # groups of one column: each reduced over all 429,496,733 tokens
        gmn, gmx = ops.min_max(value, "input", qargs("group", group_size=1))
        s, c = torch.zeros(5, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
        ops.accumulate_sq(value, s, c)
        smin, smax = ops.mse_search(value, "input", qargs("tensor"), maxshrink=0.2, patience=1, grid=10, norm=2.0)
    assert float(mn) == -2.0 and float(mx) == 3.0
    assert torch.equal(gmn.cpu(), torch.tensor([-2.0, 0, 0, 0, 0], dtype=torch.bfloat16))
    assert torch.equal(gmx.cpu(), torch.tensor([0, 1.0, 0, 0, 3.0], dtype=torch.bfloat16))
    assert torch.equal(s.cpu(), torch.tensor([4.0, 1.0, 0.0, 0.0, 9.0])) and int(c) == REAL_SHAPE[0]
    with use_backend("reference"):
        rmin, rmax = ops.mse_search(value, "input", qargs("tensor"), maxshrink=0.2, patience=1, grid=10, norm=2.0)
    assert torch.equal(smin, rmin) and torch.equal(smax, rmax)


@pytest.mark.gpu
@pytest.mark.parametrize("args", [qargs("tensor"), qargs("channel"), qargs("group", group_size=400),
                                  qargs("block", block_structure=[128, 128])], ids=lambda a: a.strategy)
def test_kernels_count_past_2_pow_31_on_a_stride_0_view(args):
    """2.8e9 elements, one value: every loop counter and flat index passes
    2^31 while the memory read is one element."""
    value = torch.full((1, 1), 1.5, dtype=torch.bfloat16, device="cuda").expand(BIG_ROWS, BIG_COLS)
    with use_backend("triton"):
        mn, mx = ops.min_max(value, "weight", args)
    want_min = torch.full(mn.shape, 1.5, dtype=torch.bfloat16)
    if args.strategy == "block":  # partial blocks on both edges hold padding zeros
        want_min[-1, :] = 0
        want_min[:, -1] = 0
    assert torch.equal(mn.cpu(), want_min) and bool((mx == 1.5).all())
    if args.strategy == "tensor":
        with use_backend("triton"):
            s, c = torch.zeros(BIG_COLS, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
            ops.accumulate_sq(value, s, c)
        torch.testing.assert_close(s, torch.full_like(s, 2.25 * BIG_ROWS), rtol=1e-5, atol=0)
        assert int(c) == BIG_ROWS
