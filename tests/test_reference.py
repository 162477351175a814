"""Hand-computed checks of the four operations (docs/spec.md §2-§4), on every backend.

Expected values here are written out by hand or built by independent code
(index loops, a float64 search over an explicit candidate list); none is
produced by the code under test. Each op is reached through ``obskernels.ops``
under the forced backend of the ``backend`` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from obskernels import ops

from helpers import DTYPES, qargs



def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------
# flattening: expected layouts built element by element
# ---------------------------------------------------------------------------


def _weight_layout(w, strategy, group=None, block=None):
    rows, cols = len(w), len(w[0])
    if strategy == "tensor":
        return [[[w[r][c] for r in range(rows) for c in range(cols)]]]
    if strategy == "channel":
        return [[[[w[r][c] for c in range(cols)]] for r in range(rows)]]
    if strategy in ("group", "tensor_group"):
        return [
            [
                [[w[r][j * group + k] for k in range(group)] for j in range(cols // group)]
                for r in range(rows)
            ]
        ]
    if strategy == "block":
        bh, bw = block
        nbr, nbc = -(-rows // bh), -(-cols // bw)

        def at(r, c):  # zero padding beyond the edge
            return w[r][c] if r < rows and c < cols else 0.0

        return [
            [
                [[at(br * bh + i, bc * bw + j) for i in range(bh) for j in range(bw)] for bc in range(nbc)]
                for br in range(nbr)
            ]
        ]
    raise AssertionError(strategy)


WEIGHT_CASES = [
    # (shape, strategy, extra args)
    ((4, 6), "tensor", {}),
    ((5, 6), "channel", {}),
    ((4, 6), "group", {"group_size": 2}),
    ((5, 6), "group", {"group_size": 3}),
    ((3, 6), "group", {"group_size": 6}),  # a single group per row
    ((4, 6), "tensor_group", {"group_size": 3}),
    ((6, 4), "block", {"block_structure": [3, 2]}),  # divides
    ((5, 6), "block", {"block_structure": [2, 4]}),  # pads rows and cols
    ((3, 3), "block", {"block_structure": [4, 4]}),  # one block, mostly padding
    ((1, 17), "block", {"block_structure": [1, 16]}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strategy,extra", WEIGHT_CASES, ids=lambda v: str(v))
def test_flatten_weight_layout(backend, dtype, shape, strategy, extra):
    w = (torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape) - 7) / 4
    args = qargs(strategy, **extra)
    expected = t(
        _weight_layout(
            w.tolist(), strategy, extra.get("group_size"), extra.get("block_structure")
        ),
        dtype,
    )
    got = ops.flatten_for_calibration(w.to(dtype), "weight", args)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"{strategy} {shape}: {got} != {expected}"


def test_flatten_non_contiguous_weight(backend):
    w = torch.randn(6, 4).t()  # (4, 6), column-major
    assert not w.is_contiguous()
    args = qargs("group", group_size=3)
    expected = t(_weight_layout(w.double().tolist(), "group", 3))
    assert torch.equal(ops.flatten_for_calibration(w, "weight", args), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flatten_g_idx(backend, dtype):
    w = t([[10, 20, 30, 40, 50, 60], [1, 2, 3, 4, 5, 6]], dtype)
    g_idx = torch.tensor([1, 0, 2, 0, 1, 2])
    args = qargs("group", group_size=2)
    # stable order of g_idx: group 0 = cols 1, 3; group 1 = cols 0, 4; group 2 = cols 2, 5
    expected = t([[[[20, 40], [10, 50], [30, 60]], [[2, 4], [1, 5], [3, 6]]]], dtype)
    got = ops.flatten_for_calibration(w, "weight", args, g_idx=g_idx)
    assert torch.equal(got, expected)
    mn, mx = ops.min_max(w, "weight", args, g_idx=g_idx)
    assert torch.equal(mn, t([[20, 10, 30], [2, 1, 3]], dtype))
    assert torch.equal(mx, t([[40, 50, 60], [4, 5, 6]], dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 8)], ids=str)
@pytest.mark.parametrize("strategy", ["tensor", "token", "group", "tensor_group"])
def test_flatten_activation_layout(backend, dtype, shape, strategy):
    x = (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) - 9) / 2
    tokens = x.reshape(-1, 8).tolist()
    args = qargs(strategy, group_size=4) if "group" in strategy else qargs(strategy)
    if strategy == "tensor":
        expected = [[row] for row in tokens]
    elif strategy == "token":
        expected = x.tolist()
    else:
        expected = [[row[j * 4 : (j + 1) * 4] for j in range(2)] for row in tokens]
    for base_name in ("input", "output"):
        got = ops.flatten_for_calibration(x.to(dtype), base_name, args)
        assert torch.equal(got, t(expected, dtype)), (base_name, strategy, shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_flatten_attention_layout(backend, dtype, strategy):
    batch, heads, seq, hd = 2, 3, 4, 5
    x = torch.arange(batch * heads * seq * hd, dtype=torch.float64).reshape(batch, heads, seq, hd) / 8
    v = x.tolist()
    rows = [(b, s) for b in range(batch) for s in range(seq)]  # token n = b * seq + s
    if strategy == "tensor":
        expected = [[[v[b][h][s][d] for h in range(heads) for d in range(hd)]] for b, s in rows]
    else:
        expected = [[[[[v[b][h][s][d] for d in range(hd)]]] for h in range(heads)] for b, s in rows]
    for base_name in ("q", "k", "v"):
        got = ops.flatten_for_calibration(x.to(dtype), base_name, qargs(strategy))
        assert torch.equal(got, t(expected, dtype)), (base_name, strategy)


# ---------------------------------------------------------------------------
# every strategy x base_name that is not defined raises ValueError
# ---------------------------------------------------------------------------

ATTN = (2, 3, 4, 8)
INVALID = [
    ("weight", (4, 8), "token", {}),
    ("weight", (4, 8), "attn_head", {}),
    ("weight", (4, 6), "group", {"group_size": 4}),  # 6 columns, groups of 4
    ("weight", (4, 6), "tensor_group", {"group_size": 4}),
    ("weight", (2, 4, 8), "channel", {}),  # weights are 2-D
    ("input", (2, 3, 8), "channel", {}),
    ("input", (2, 3, 8), "block", {"block_structure": [2, 2]}),
    ("input", (2, 3, 8), "attn_head", {}),
    ("output", (2, 3, 8), "channel", {}),
    ("output", (2, 3, 6), "group", {"group_size": 4}),
    ("input", (8,), "tensor", {}),  # activations are 2-D or 3-D
    ("input", ATTN, "tensor", {}),
    ("q", ATTN, "channel", {}),
    ("k", ATTN, "group", {"group_size": 4}),
    ("v", ATTN, "tensor_group", {"group_size": 4}),
    ("q", ATTN, "block", {"block_structure": [2, 2]}),
    ("k", ATTN, "token", {}),
    ("v", (2, 3, 8), "tensor", {}),  # attention states are 4-D
    ("bias", (4, 8), "tensor", {}),  # unknown base_name
]


def _call(op, value, base_name, args):
    if op == "mse_search":
        return ops.mse_search(value, base_name, args, maxshrink=0.2, patience=5, grid=10, norm=2.4)
    return getattr(ops, op)(value, base_name, args)


@pytest.mark.parametrize("op", ["flatten_for_calibration", "min_max", "mse_search"])
@pytest.mark.parametrize("base_name,shape,strategy,extra", INVALID, ids=lambda v: str(v))
def test_invalid_combination_raises(backend, op, base_name, shape, strategy, extra):
    with pytest.raises(ValueError):
        _call(op, torch.randn(shape), base_name, qargs(strategy, **extra))


@pytest.mark.parametrize("op", ["flatten_for_calibration", "min_max", "mse_search"])
def test_bad_types_raise(backend, op):
    with pytest.raises(TypeError, match="dtype"):
        _call(op, torch.ones(4, 8, dtype=torch.int32), "weight", qargs())
    with pytest.raises(TypeError):
        _call(op, torch.ones(4, 8), "weight", {"strategy": "tensor"})


G_IDX_ERRORS = [
    (ValueError, "channel", torch.tensor([0, 0, 1, 1])),  # g_idx needs 'group'
    (ValueError, "group", torch.tensor([0, 0, 1])),  # one entry per column
    (ValueError, "group", torch.tensor([0, 0, 0, 1])),  # 3 columns in group 0
    (ValueError, "group", torch.tensor([0, 0, 2, 2])),  # group 2 does not exist
    (TypeError, "group", torch.tensor([0.0, 0.0, 1.0, 1.0])),
]


@pytest.mark.parametrize("op", ["flatten_for_calibration", "min_max"])
@pytest.mark.parametrize("error,strategy,g_idx", G_IDX_ERRORS)
def test_bad_g_idx_raises(backend, op, error, strategy, g_idx):
    args = qargs(strategy, group_size=2) if strategy == "group" else qargs(strategy)
    with pytest.raises(error, match="g_idx"):
        getattr(ops, op)(torch.randn(3, 4), "weight", args, g_idx=g_idx)


# ---------------------------------------------------------------------------
# min / max, hand-computed
# ---------------------------------------------------------------------------

W = [
    [1, -2, 3, 0, 4, -1],
    [5, 6, -7, 8, 2, 2],
    [-3, -3, -3, -3, -3, -3],
    [0.5, 0.25, -0.5, 1.5, 2.5, -4],
]
W_MIN_MAX = [
    ("tensor", {}, [-7], [8]),
    ("channel", {}, [[-2], [-7], [-3], [-4]], [[4], [8], [-3], [2.5]]),
    ("group", {"group_size": 3}, [[-2, -1], [-7, 2], [-3, -3], [-0.5, -4]], [[3, 4], [6, 8], [-3, -3], [0.5, 2.5]]),
    ("tensor_group", {"group_size": 2}, [[-2, 0, -1], [5, -7, 2], [-3, -3, -3], [0.25, -0.5, -4]], [[1, 3, 4], [6, 8, 2], [-3, -3, -3], [0.5, 1.5, 2.5]]),
    # 4x6 padded to 6x8: blocks (0,0) rows 0-2 cols 0-3, (0,1) cols 4-7 half padding,
    # (1,*) row 3 plus two padded rows
    ("block", {"block_structure": [3, 4]}, [[-7, -3], [-0.5, -4]], [[8, 4], [1.5, 2.5]]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy,extra,mn,mx", W_MIN_MAX, ids=lambda v: str(v))
def test_min_max_weight(backend, dtype, strategy, extra, mn, mx):
    got_min, got_max = ops.min_max(t(W, dtype), "weight", qargs(strategy, **extra))
    assert got_min.dtype == dtype and got_max.dtype == dtype
    assert torch.equal(got_min, t(mn, dtype)), got_min
    assert torch.equal(got_max, t(mx, dtype)), got_max


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_min_max_partial_block_counts_padding(backend, dtype):
    # a 3x3 of positive values in one 4x4 block: the padded zeros set the min
    w = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype)
    mn, mx = ops.min_max(w, "weight", qargs("block", block_structure=[4, 4]))
    assert torch.equal(mn, t([[0]], dtype)) and torch.equal(mx, t([[9]], dtype))
    # blocks [2, 2]: only the top-left block is full
    mn, mx = ops.min_max(w, "weight", qargs("block", block_structure=[2, 2]))
    assert torch.equal(mn, t([[1, 0], [0, 0]], dtype))
    assert torch.equal(mx, t([[5, 6], [8, 9]], dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_min_max_activation_and_attention(backend, dtype):
    # x[b, s, h] = 4 * (3b + s) + h - 10
    x = (torch.arange(24, dtype=torch.float64) - 10).reshape(2, 3, 4).to(dtype)
    mn, mx = ops.min_max(x, "input", qargs("tensor"))
    assert torch.equal(mn, t([-10], dtype)) and torch.equal(mx, t([13], dtype))
    mn, mx = ops.min_max(x, "output", qargs("group", group_size=2))
    assert torch.equal(mn, t([-10, -8], dtype)) and torch.equal(mx, t([11, 13], dtype))
    # TOKEN keeps (batch, seq, hidden): one range per sequence position
    mn, mx = ops.min_max(x, "input", qargs("token"))
    assert torch.equal(mn, t([-10, -6, -2], dtype)) and torch.equal(mx, t([5, 9, 13], dtype))

    q = (torch.arange(12, dtype=torch.float64) - 5).reshape(1, 2, 2, 3).to(dtype)
    mn, mx = ops.min_max(q, "k", qargs("tensor"))
    assert torch.equal(mn, t([-5], dtype)) and torch.equal(mx, t([6], dtype))
    mn, mx = ops.min_max(q, "k", qargs("attn_head"))
    assert torch.equal(mn, t([[[-5]], [[1]]], dtype)) and torch.equal(mx, t([[[0]], [[6]]], dtype))


def test_min_max_nan_propagates_to_its_group_only(backend):
    w = t(W)
    w[1, 2] = float("nan")
    mn, mx = ops.min_max(w, "weight", qargs("channel"))
    assert torch.isnan(mn[1]).all() and torch.isnan(mx[1]).all()
    keep = torch.tensor([0, 2, 3])
    assert torch.equal(mn[keep], t([[-2], [-3], [-4]]))
    assert torch.equal(mx[keep], t([[4], [-3], [2.5]]))


# ---------------------------------------------------------------------------
# E[x²] accumulation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_sq_hand_computed(backend, dtype):
    s = torch.zeros(2)
    n = torch.zeros(1, dtype=torch.int64)
    ops.accumulate_sq(t([[1, 2], [3, 4]], dtype), s, n)
    assert torch.equal(s, t([10, 20])) and int(n) == 2
    ops.accumulate_sq(t([[[1, 1]], [[0, 2]]], dtype), s, n)  # (batch, seq, hidden)
    assert torch.equal(s, t([11, 25])) and int(n) == 4
    # squares are taken in fp32: 255**2 = 65025 is not a bf16/fp16 number
    s.zero_()
    ops.accumulate_sq(t([[255, 0]], dtype), s, n)
    assert torch.equal(s, t([65025, 0]))


def test_accumulate_sq_random_fp64_and_repeatable(backend):
    x = torch.randn(3, 37, 17)
    s1, n1 = torch.zeros(17), torch.zeros(1, dtype=torch.int64)
    s2, n2 = torch.zeros(17), torch.zeros(1, dtype=torch.int64)
    ops.accumulate_sq(x, s1, n1)
    ops.accumulate_sq(x, s2, n2)
    exact = x.double().pow(2).sum(dim=(0, 1))
    torch.testing.assert_close(s1.double(), exact, rtol=1e-5, atol=0)
    assert torch.equal(s1, s2) and int(n1) == int(n2) == 3 * 37


@pytest.mark.parametrize(
    "error,sum_buf,count_buf",
    [
        (TypeError, torch.zeros(4, dtype=torch.float64), torch.zeros(1, dtype=torch.int64)),
        (ValueError, torch.zeros(5), torch.zeros(1, dtype=torch.int64)),
        (TypeError, torch.zeros(4), torch.zeros(1, dtype=torch.int32)),
        (ValueError, torch.zeros(4), torch.zeros(2, dtype=torch.int64)),
    ],
)
def test_accumulate_sq_bad_buffers_raise(backend, error, sum_buf, count_buf):
    with pytest.raises(error):
        ops.accumulate_sq(torch.randn(3, 4), sum_buf, count_buf)


# ---------------------------------------------------------------------------
# MSE shrink-grid search against an independent float64 search
# ---------------------------------------------------------------------------

# Two rows of a (2, 6) weight quantized per channel, int4 symmetric, norm 2,
# grid 20 (p = 1, .95, .9, ...). Independently worked out:
#   row A: errors .96, .2424, .9216, 1.488, ...   improves at step 1 only
#   row B: errors .84, .8616, .8976, .7536, ...   improves at step 3 only
# With GLOBAL patience 2, step 2 (nobody improves) is not enough to stop, so B
# reaches its step 3; a per-group patience of 2 would have stopped B at step 2.
ROW_A = [-7, -7, -9, 3, 8, 0]
ROW_B = [5, -3, 5, 5, -9, 6]


def _search_steps_fp64(rows, *, bits, grid, steps, norm, patience, flavour, weights=None, expand=1.0):
    """Chosen step per row (-1: no step ran), by the rule of docs/spec.md §4, in float64."""
    x = np.asarray(rows, dtype=np.float64)
    w = np.ones_like(x) if weights is None else np.broadcast_to(np.asarray(weights, np.float64), x.shape)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    base_min, base_max = x.min(1) * expand, x.max(1) * expand
    best = np.full(len(x), np.inf)
    choice = np.full(len(x), -1)
    stale = 0
    for i in range(steps):
        p = 1 - i / grid
        a = np.maximum(np.abs(np.minimum(base_min * p, 0)), np.maximum(base_max * p, 0))
        s = (a / ((qmax - qmin) / 2))[:, None]
        err = ((np.abs(np.clip(np.round(x / s), qmin, qmax) * s - x) ** norm) * w).sum(1)
        improved = err < best
        best[improved], choice[improved] = err[improved], i
        if improved.any():
            stale = 0
        else:
            stale += 1
            if flavour == "mse" and stale >= patience:
                break
            if flavour == "imatrix" and patience > 0 and stale >= patience:
                break
    return choice


def _expected_range(value, choice, grid, expand=1.0):
    base_min = value.amin(dim=1, keepdim=True) * expand
    base_max = value.amax(dim=1, keepdim=True) * expand
    mn, mx = base_min.clone(), base_max.clone()
    for r, i in enumerate(choice.tolist()):
        if i >= 0:
            p = 1 - i / grid
            mn[r], mx[r] = base_min[r] * p, base_max[r] * p
    return mn, mx


@pytest.mark.parametrize(
    "flavour,maxshrink,patience,expect",
    [
        ("mse", 0.4, 2, [1, 3]),  # global patience lets B improve at step 3
        ("mse", 0.4, 1, [1, 0]),  # stops after step 2
        ("mse", 0.4, 0, [1, 0]),  # patience 0: stops at the first stale step
        ("mse", 0.0, 5, [-1, -1]),  # no steps at all: the base
        ("imatrix", 0.4, 0, [1, 3]),  # never stops early, steps 0..8
        ("imatrix", 0.4, 1, [1, 0]),
        ("imatrix", 0.0, 5, [1, 0]),  # at least steps 0 and 1
    ],
)
def test_mse_search_patience_and_steps(backend, flavour, maxshrink, patience, expect):
    grid, bits = 20, 4
    steps = int(maxshrink * grid) if flavour == "mse" else max(1, int(maxshrink * grid)) + 1
    choice = _search_steps_fp64(
        [ROW_A, ROW_B], bits=bits, grid=grid, steps=steps, norm=2.0, patience=patience, flavour=flavour
    )
    assert choice.tolist() == expect  # the hand analysis above
    w = t([ROW_A, ROW_B])
    args = qargs("channel", num_bits=bits)
    got = ops.mse_search(
        w, "weight", args, maxshrink=maxshrink, patience=patience, grid=grid, norm=2.0, flavour=flavour
    )
    exp_min, exp_max = _expected_range(w, choice, grid)
    assert torch.equal(got[0], exp_min) and torch.equal(got[1], exp_max), (got, exp_min, exp_max)


def test_mse_search_importance_and_expand(backend):
    w = t([ROW_A, ROW_B])
    args = qargs("channel", num_bits=4)
    kw = dict(maxshrink=0.5, patience=3, grid=20, norm=2.0, flavour="imatrix")
    # uniform importance is the unweighted search, bit for bit
    plain = ops.mse_search(w, "weight", args, **kw)
    ones = ops.mse_search(w, "weight", args, importance=torch.ones(6), **kw)
    assert torch.equal(plain[0], ones[0]) and torch.equal(plain[1], ones[1])
    for importance, expand in (([8, 0.1, 0.1, 4, 0.1, 2], 1.0), ([1] * 6, 1.5)):
        choice = _search_steps_fp64(
            [ROW_A, ROW_B], bits=4, grid=20, steps=11, norm=2.0, patience=3,
            flavour="imatrix", weights=importance, expand=expand,
        )
        got = ops.mse_search(w, "weight", args, importance=t(importance), expand=expand, **kw)
        exp_min, exp_max = _expected_range(w, choice, 20, expand)
        assert torch.equal(got[0], exp_min) and torch.equal(got[1], exp_max), (importance, expand, choice)


def test_mse_search_exact_grid_keeps_base(backend):
    # 0..255 per row is exactly representable by asymmetric int8 at p = 1
    # (scale 1, zero point -128): every shrink adds error, the base wins
    for dtype in DTYPES:
        w = torch.arange(256, dtype=dtype).repeat(2, 1)
        mn, mx = ops.mse_search(
            w, "weight", qargs("channel", symmetric=False), maxshrink=0.2, patience=5, grid=100, norm=2.4
        )
        assert torch.equal(mn, t([[0], [0]], dtype)) and torch.equal(mx, t([[255], [255]], dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flavour", ["mse", "imatrix"])
def test_mse_search_result_is_a_grid_candidate(backend, dtype, flavour):
    w = torch.randn(4, 16).to(dtype)
    args = qargs("group", group_size=8)
    grid = 10
    mn, mx = ops.mse_search(w, "weight", args, maxshrink=0.5, patience=3, grid=grid, norm=2.4, flavour=flavour)
    assert mn.dtype == dtype and mn.shape == (4, 2)
    base_min, base_max = w.reshape(4, 2, 8).amin(-1), w.reshape(4, 2, 8).amax(-1)
    candidates = [(base_min * (1 - i / grid), base_max * (1 - i / grid)) for i in range(6)]
    for r in range(4):
        for g in range(2):
            assert any(
                c_min[r, g] == mn[r, g] and c_max[r, g] == mx[r, g] for c_min, c_max in candidates
            ), f"group ({r}, {g}) chose ({mn[r, g]}, {mx[r, g]}), not a candidate"


@pytest.mark.parametrize(
    "kw",
    [
        {"grid": 0},
        {"grid": -5},
        {"patience": -1},
        {"maxshrink": -0.1},
        {"maxshrink": 1.5},
        {"norm": 0},
        {"norm": float("inf")},
        {"norm": float("nan")},
        {"expand": 0.5},
        {"flavour": "l1"},
    ],
    ids=str,
)
def test_mse_search_bad_params_raise(backend, kw):
    params = {"maxshrink": 0.2, "patience": 5, "grid": 10, "norm": 2.4, **kw}
    with pytest.raises(ValueError):
        ops.mse_search(torch.randn(4, 8), "weight", qargs("channel"), **params)


@pytest.mark.parametrize(
    "error,base_name,shape,strategy,importance",
    [
        (ValueError, "weight", (4, 8), "channel", torch.ones(7)),
        (ValueError, "weight", (4, 8), "channel", -torch.ones(8)),
        (ValueError, "weight", (4, 8), "channel", torch.full((8,), float("nan"))),
        (ValueError, "weight", (4, 8), "tensor", torch.ones(8)),
        (ValueError, "input", (2, 8), "tensor", torch.ones(8)),
        (TypeError, "weight", (4, 8), "channel", [1.0] * 8),
    ],
)
def test_mse_search_bad_importance_raises(backend, error, base_name, shape, strategy, importance):
    with pytest.raises(error, match="importance"):
        ops.mse_search(
            torch.randn(shape), base_name, qargs(strategy), maxshrink=0.2, patience=5, grid=10,
            norm=2.4, importance=importance, flavour="imatrix",
        )
