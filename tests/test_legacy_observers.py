"""The older observer API (obskernels.legacy) against the current one and by hand.

Where both APIs compute the same thing (a weight observed once, an
activation seen once, full blocks) the qparams must be identical to the
current observers'. Elsewhere (the older moving average, tensor_id-keyed
statistics, partial blocks, token counts) the figures are computed by hand.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

import obskernels
from obskernels import legacy

from helpers import nvfp4_args
from helpers import qargs as _qargs

C = 0.01


def qargs(strategy="tensor", num_bits=4, **kw):  # 4-bit unless said otherwise
    return _qargs(strategy, num_bits=num_bits, **kw)


def current(name, args, value, base_name="weight", g_idx=None):
    obs = obskernels.Observer.load_from_registry(name, base_name=base_name, args=args.model_copy(deep=True))
    return obs(value, g_idx=g_idx).get_qparams()


def assert_same(old, new, what):
    scale, zp = old
    assert scale.shape == new["scale"].shape, (what, scale.shape, new["scale"].shape)
    assert scale.dtype == new["scale"].dtype and zp.dtype == new["zero_point"].dtype, what
    assert torch.equal(scale, new["scale"]), f"{what}: scale {scale.flatten()[:4]} vs {new['scale'].flatten()[:4]}"
    assert torch.equal(zp, new["zero_point"]), f"{what}: zero point differs"


# ------------------------------------------------------------ construction


def test_constructors_and_their_own_registry():
    a = qargs()
    mm = legacy.Observer.load_from_registry("minmax", quantization_args=a)
    assert type(mm) is legacy.MinMaxObserver and mm.averaging_constant == 0.01
    assert mm.quantization_args is a and mm.min_val == {} and mm.max_val == {}
    mse = legacy.Observer.load_from_registry("mse", quantization_args=a, grid=50, norm=2.0)
    assert type(mse) is legacy.MovingAverageMSEObserver
    assert (mse.maxshrink, mse.patience, mse.averaging_constant, mse.grid, mse.norm) == (0.2, 5, 0.01, 50, 2.0)
    assert legacy.MinMaxObserver(a, averaging_constant=0.5, unused=1).averaging_constant == 0.5
    # the current registry is untouched by the older classes
    assert type(obskernels.Observer.load_from_registry("minmax", base_name="input", args=qargs())) is obskernels.MinMaxObserver
    with pytest.raises(TypeError, match="quantization_args"):
        legacy.MinMaxObserver("tensor")
    for kw, key in (({"grid": 0}, "grid"), ({"patience": -1}, "patience"), ({"maxshrink": 1.5}, "maxshrink"), ({"norm": float("nan")}, "norm")):
        with pytest.raises(ValueError, match=key):
            legacy.MovingAverageMSEObserver(a, **kw)
    with pytest.raises(ValueError, match="averaging_constant"):
        legacy.MinMaxObserver(a, averaging_constant=2.0)


# ------------------------------------------- identical to the current API


WEIGHT_CASES = [
    ("tensor", {}),
    ("channel", {}),
    ("group", {"group_size": 8}),
    ("block", {"block_structure": [4, 16]}),
]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("strategy,kw", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_minmax_weight_qparams_equal_the_current_api(backend, strategy, kw, symmetric):
    w = torch.randn(8, 32)
    args = qargs(strategy, symmetric=symmetric, **kw)
    old = legacy.MinMaxObserver(args)(w)
    assert_same(old, current("memoryless_minmax", args, w), f"minmax {strategy}")


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_mse_weight_qparams_equal_the_current_api(backend, strategy):
    w = torch.randn(8, 32)
    w[3, 4] = 6.0  # an outlier the search clips
    args = qargs(strategy, symmetric=False)
    old = legacy.MovingAverageMSEObserver(args)(w)
    assert_same(old, current("memoryless_mse", args, w), f"mse {strategy}")


def test_mse_group_searches_each_group_on_its_own(backend):
    w = torch.randn(6, 32)
    args = qargs("group", group_size=16)
    scale, zp = legacy.MovingAverageMSEObserver(args)(w)
    for g in range(2):
        part = w[:, 16 * g:16 * (g + 1)]
        want = current("memoryless_mse", qargs("channel"), part)
        assert torch.equal(scale[:, g:g + 1], want["scale"]), g
        assert torch.equal(zp[:, g:g + 1], want["zero_point"]), g


def test_activation_seen_once_equals_current_minmax(backend):
    x = torch.randn(5, 32)
    args = qargs("tensor", num_bits=8, symmetric=False)
    assert_same(legacy.MinMaxObserver(args)(x), current("minmax", args, x, base_name="input"), "activation")


def test_g_idx_groups_like_the_current_api(backend):
    w = torch.randn(4, 32)
    g_idx = torch.randperm(32, generator=torch.Generator().manual_seed(3)) // 8
    args = qargs("group", group_size=8)
    old = legacy.MinMaxObserver(args)(w, g_idx=g_idx)
    assert_same(old, current("memoryless_minmax", args, w, g_idx=g_idx), "g_idx")
    # a g_idx still holding -1 means column order
    placeholder = legacy.MinMaxObserver(args)(w, g_idx=torch.full((32,), -1))
    assert_same(placeholder, current("memoryless_minmax", args, w), "g_idx -1")


def test_tensor_group_global_scale_equals_the_current_api(backend):
    w = torch.randn(4, 32)
    w[1, 2] = -7.0
    args = nvfp4_args()
    obs = legacy.MinMaxObserver(args, averaging_constant=1.0)
    gscale = obs(w, should_calculate_gparam=True)
    a = w.abs().amax().reshape(1)
    assert torch.equal(gscale, generate_gparam(-a, a))
    assert torch.equal(obs.get_gparam(w), gscale)
    scale, zp = obs(w, global_scale=gscale)
    new = current("memoryless_minmax", args, w)
    assert torch.equal(new["global_scale"], gscale)
    assert_same((scale, zp), new, "nvfp4")
    with pytest.raises(NotImplementedError, match="tensor_group"):
        legacy.MinMaxObserver(qargs("channel")).get_gparam(w)
    with pytest.raises(NotImplementedError, match="calculate_gparam"):
        legacy.MovingAverageMSEObserver(args).get_gparam(w)


# ---------------------------------------------------------------- by hand


def test_moving_average_and_latest_qparams_by_hand():
    xs = [torch.randn(3, 16) * s for s in (1.0, 4.0, 0.5)]
    args = qargs("tensor", num_bits=8, symmetric=False)
    obs = legacy.MinMaxObserver(args)
    assert obs.get_qparams() == (None, None)
    for x in xs:
        last = obs(x)
    mn, mx = xs[0].min(), xs[0].max()
    for x in xs[1:]:  # the older formula: old + c * (new - old)
        mn, mx = mn + C * (x.min() - mn), mx + C * (x.max() - mx)
    scale, zp = calculate_qparams(mn, mx, args)
    assert torch.equal(last[0], scale) and torch.equal(last[1], zp)
    assert obs.get_qparams() is not None and obs.get_qparams()[0] is last[0]  # the latest, kept
    assert list(obs.min_val) == [legacy.DEFAULT_TENSOR_ID] and torch.equal(obs.min_val["default"], mn)
    obs.reset()
    assert obs.get_qparams() == (None, None) and obs.min_val == {} and obs._num_observed_tokens is None

    # c == 1.0: each value alone, nothing kept; the current minmax with c == 1.0 agrees
    one = legacy.MinMaxObserver(args, averaging_constant=1.0)
    cur = obskernels.Observer.load_from_registry("minmax", base_name="input", args=args.model_copy(deep=True), averaging_constant=1.0)
    for x in xs:
        got = one(x)
        cur(x)
    assert one.min_val == {}
    assert_same(got, cur.get_qparams(), "c = 1")


def test_mse_moving_average_by_hand():
    xs = [torch.randn(4, 16), 3 * torch.randn(4, 16)]
    args = qargs("channel", num_bits=8)
    obs = legacy.MovingAverageMSEObserver(args)
    for x in xs:
        got = obs(x)
    searched = [
        obskernels.ops.mse_search(x, "weight", args, maxshrink=0.2, patience=5, grid=100.0, norm=2.4)
        for x in xs
    ]
    mn = searched[0][0] + C * (searched[1][0] - searched[0][0])
    mx = searched[0][1] + C * (searched[1][1] - searched[0][1])
    assert torch.equal(got[0], calculate_qparams(mn, mx, args)[0])


def test_tensor_id_keyed_statistics():
    w = torch.randn(6, 24).abs() + 0.5  # all positive: padding zeros would show
    args = qargs("group", group_size=8)
    obs = legacy.MinMaxObserver(args)
    obs(w)
    assert sorted(obs.min_val) == [0, 1, 2]
    for g in range(3):
        assert torch.equal(obs.min_val[g], w[:, 8 * g:8 * (g + 1)].amin(1, keepdim=True))
        assert torch.equal(obs.max_val[g], w[:, 8 * g:8 * (g + 1)].amax(1, keepdim=True))

    block = legacy.MinMaxObserver(qargs("block", block_structure=[4, 16]))
    scale, _ = block(w)
    assert scale.shape == (2, 2)
    assert sorted(block.min_val) == ["block_0_0", "block_0_1", "block_1_0", "block_1_1"]
    edge = w[4:6, 16:24]  # a partial block: its real elements only
    assert torch.equal(block.min_val["block_1_1"], edge.amin().reshape(1, 1)) and edge.amin() > 0
    assert torch.equal(scale[1, 1], calculate_qparams(edge.amin(), edge.amax(), qargs("block", block_structure=[4, 16]))[0].reshape(()))


def test_calculate_qparams_over_reduce_dims():
    x = torch.randn(2, 3, 5)
    args = qargs("tensor", num_bits=8, symmetric=False)
    obs = legacy.MinMaxObserver(args, averaging_constant=1.0)
    scale, zp = obs.calculate_qparams(x, reduce_dims=(0, 2), tensor_id="t")
    assert scale.shape == (1, 3, 1)
    want = calculate_qparams(x.amin(dim=(0, 2), keepdim=True), x.amax(dim=(0, 2), keepdim=True), args)
    assert torch.equal(scale, want[0]) and torch.equal(zp, want[1])
    along = obs.get_qparams_along_dim(x, 1)
    assert torch.equal(along[0], scale)
    token_args = qargs("token", num_bits=8, dynamic=True)  # static token args are refused
    token = legacy.MinMaxObserver(token_args, averaging_constant=1.0)(x)
    assert token[0].shape == (2, 3, 1)
    assert torch.equal(token[0], calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), token_args)[0])


def test_token_counting_follows_the_two_dimensional_rule():
    obs = legacy.MinMaxObserver(qargs(num_bits=8))
    assert obs._num_observed_tokens is None
    obs(torch.randn(5, 16))
    obs(torch.randn(3, 16))
    assert obs._num_observed_tokens == 8
    obs(torch.randn(2, 3, 16))  # not 2-D: the count becomes unknown
    assert obs._num_observed_tokens is None
    with pytest.raises(ValueError, match="tensor"):
        obs.record_observed_tokens([1.0])

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    for i, layer in enumerate(model):
        layer.register_module("input_observer", legacy.MinMaxObserver(qargs(num_bits=8)))
        layer.input_observer(torch.randn(4 + i, 16))
    model[1].register_module("weight_observer", legacy.MinMaxObserver(qargs(num_bits=8)))
    assert legacy.get_observer_token_count(model) == Counter({"0": 4, "1": 5})
