"""The observer lifecycle end to end (docs/spec.md §1).

Statistics are checked against hand-computed values, against the moving
average formula applied to hand-known minima, or against the reference
search (``obskernels.reference``, called directly: itself checked in
test_reference.py) with the defaults of docs/spec.md §1, llm-compressor
0.14.0.1's, written out here.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

import obskernels
from obskernels import (
    IMatrixMSEObserver,
    ImportanceFallbackWarning,
    MemorylessMinMaxObserver,
    MemorylessMSEObserver,
    MinMaxObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedMSEObserver,
    Observer,
    StaticMinMaxObserver,
    get_observer_token_count,
    ops,
    use_backend,
)

from helpers import nvfp4_args, qargs, reference_search

CLASSES = {
    "memoryless_minmax": MemorylessMinMaxObserver,
    "static_minmax": StaticMinMaxObserver,
    "minmax": MinMaxObserver,
    "memoryless_mse": MemorylessMSEObserver,
    "mse": MovingAverageMSEObserver,
    "nvfp4_expanded_mse": NVFP4ExpandedMSEObserver,
    "imatrix_mse": IMatrixMSEObserver,
}
NAMES = tuple(CLASSES)
MSE_FAMILY = ("memoryless_mse", "mse", "nvfp4_expanded_mse", "imatrix_mse")


def make(name, base_name="weight", args=None, **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=args or qargs(), **kw)


def quiet(obs, value):
    """Observe, ignoring imatrix fallback warnings (tested on their own below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportanceFallbackWarning)
        return obs(value)


# ---------------------------------------------------------------------------
# registry, defaults, validation
# ---------------------------------------------------------------------------


def test_registry_loads_every_observer():
    for name, cls in CLASSES.items():
        obs = make(name)
        assert type(obs) is cls and isinstance(obs, torch.nn.Module)
        assert name.replace("_", "-") in Observer.registered_names()
    with pytest.raises(KeyError):
        make("no_such_observer")


def test_register_a_new_observer():
    @Observer.register("test_only_latest_minmax")
    class _Latest(MemorylessMinMaxObserver):
        pass

    obs = make("test_only_latest_minmax", base_name="input")
    assert isinstance(obs, _Latest)
    obs(torch.tensor([[1.0, -2.0]]))
    assert torch.equal(obs.min_vals, torch.tensor([-2.0]))


# llm-compressor 0.14.0.1's defaults (llmcompressor/observers/mse.py, imatrix.py,
# min_max.py), written out; chunk_size is obskernels' own keyword. The
# triton_error_buffer values are those of the int8 args ``make`` builds.
DEFAULTS = {
    "minmax": {"avg_constant": 0.01},
    "memoryless_mse": {"maxshrink": 0.20, "patience": 5, "grid": 100, "norm": 2.4, "expand": 1.0, "chunk_size": 5,
                       "triton_error_buffer": 0.3},
    "mse": {"maxshrink": 0.20, "patience": 5, "grid": 100, "norm": 2.4, "expand": 1.0, "chunk_size": 5, "avg_constant": 0.01,
            "triton_error_buffer": 0.3},
    "nvfp4_expanded_mse": {"maxshrink": 1 - 0.8 / 1.8, "patience": 1000, "grid": 200, "norm": 2.4, "expand": 1.8, "chunk_size": 5,
                           "triton_error_buffer": 1.0},
    "imatrix_mse": {"maxshrink": 0.95, "patience": 5, "grid": 20, "norm": 3.0, "expand": 1.0, "chunk_size": 5, "strict": False,
                    "triton_error_buffer": None},
    "nvfp4_expanded_imatrix": {"maxshrink": 1 - 0.8 / 1.8, "patience": 1000, "grid": 200, "norm": 2.4, "expand": 1.8,
                               "chunk_size": 5, "strict": False, "triton_error_buffer": None},
}


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_defaults(name):
    obs = make(name)
    for attr, value in DEFAULTS[name].items():
        assert getattr(obs, attr) == value, (name, attr)


@pytest.mark.parametrize("name,args,want", [
    ("memoryless_mse", nvfp4_args(), 1.0),  # a 4-bit float
    ("mse", qargs("group", num_bits=4, group_size=16, type="float"), 1.0),
    ("memoryless_mse", qargs("group", num_bits=4, group_size=16), 0.3),  # int4
    ("mse", qargs(num_bits=8, type="float"), 0.3),  # fp8
    ("nvfp4_expanded_mse", qargs("channel", num_bits=4), 1.0),  # whatever the format
])
def test_triton_error_buffer_default_follows_llmcompressor(name, args, want):
    assert make(name, args=args).triton_error_buffer == want


def test_kwargs_merge_into_args():
    args = qargs(observer_kwargs={"grid": 50, "norm": 2.0})
    obs = make("mse", args=args, maxshrink=0.3, averaging_constant=0.5)
    assert args.observer_kwargs == {"grid": 50, "norm": 2.0, "maxshrink": 0.3, "averaging_constant": 0.5}
    assert (obs.grid, obs.norm, obs.maxshrink, obs.avg_constant, obs.patience) == (50, 2.0, 0.3, 0.5, 5)


BAD_SEARCH_KWARGS = [
    {"grid": 0},
    {"grid": -1.0},
    {"patience": -1},
    {"maxshrink": -0.01},
    {"maxshrink": 1.01},
    {"norm": 0},
    {"norm": -2.0},
    {"norm": float("inf")},
    {"norm": float("nan")},
    {"chunk_size": 0},
    {"chunk_size": -3},
    {"expand": 0.99},
]


@pytest.mark.parametrize("kw", BAD_SEARCH_KWARGS, ids=str)
@pytest.mark.parametrize("name", MSE_FAMILY)
def test_bad_search_kwargs_raise_at_construction(name, kw):
    key = next(iter(kw))
    with pytest.raises(ValueError, match=key):
        make(name, **kw)


@pytest.mark.parametrize("name", MSE_FAMILY)
def test_non_numbers_raise_type_error(name):
    for kw in ({"grid": "100"}, {"patience": 2.5}, {"chunk_size": None}, {"norm": True}):
        with pytest.raises(TypeError, match=next(iter(kw))):
            make(name, **kw)


def test_other_construction_errors():
    for name in ("minmax", "mse"):
        with pytest.raises(ValueError, match="averaging_constant"):
            make(name, averaging_constant=1.5)
    with pytest.raises(TypeError, match="strict"):
        make("imatrix_mse", strict="yes")
    with pytest.raises(ValueError, match="base_name"):
        make("minmax", base_name="bias")
    with pytest.raises(TypeError, match="QuantizationArgs"):
        Observer.load_from_registry("minmax", base_name="input", args={"num_bits": 8})


@pytest.mark.parametrize("name", MSE_FAMILY)
def test_chunk_size_is_accepted_and_never_changes_the_result(name):
    """docs/spec.md §1: ``chunk_size`` is accepted and validated (> 0, above)
    but is no search setting: whatever its value, the statistics are the
    reference search's with the observer's other defaults."""
    w = torch.randn(8, 32)
    args = nvfp4_args() if name == "nvfp4_expanded_mse" else qargs("group", group_size=16)
    kw = {k: v for k, v in DEFAULTS[name].items()
          if k not in ("chunk_size", "strict", "avg_constant", "triton_error_buffer")}
    flavour = "imatrix" if name == "imatrix_mse" else "mse"
    want_min, want_max = reference_search(w, "weight", args, flavour=flavour, **kw)
    for chunk in (1, 5, 7):
        obs = make(name, args=args.model_copy(deep=True), chunk_size=chunk)
        assert obs.chunk_size == chunk
        with use_backend("reference"):
            stats = quiet(obs, w).get_statistics()
        assert torch.equal(stats["min_vals"], want_min), (name, chunk)
        assert torch.equal(stats["max_vals"], want_max), (name, chunk)


def test_sync_dicts():
    MIN, MAX, AVG, SUM = dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.AVG, dist.ReduceOp.SUM
    expected = {
        "memoryless_minmax": {},
        "static_minmax": {"min_vals": MIN, "max_vals": MAX},
        "minmax": {"min_vals": AVG, "max_vals": AVG},
        "memoryless_mse": {},
        "mse": {"min_vals": AVG, "max_vals": AVG},
        "nvfp4_expanded_mse": {},
        "imatrix_mse": {"_imatrix_sum": SUM, "_imatrix_count": SUM},
    }
    for name, cls in CLASSES.items():
        assert cls._act_sync_dict == expected[name], name


def test_sync_without_process_group_raises():
    obs = make("static_minmax", base_name="input")
    obs(torch.randn(3, 4))
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        obs.sync_activation_stats()


# ---------------------------------------------------------------------------
# observing and qparams
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("base_name,shape", [("weight", (0, 8)), ("input", (2, 0, 8)), ("q", (1, 2, 0, 4))])
def test_empty_value_is_a_no_op(name, base_name, shape, device):
    obs = make(name, base_name=base_name)
    assert obs(torch.empty(shape, device=device)) is obs
    assert not obs.has_statistics and obs._num_observed_tokens == 0
    with pytest.raises(RuntimeError, match="no statistics"):
        obs.get_qparams()


# three activations with hand-known ranges: (-1, 2), (-3, 4), (-0.5, 1)
VALUES = [
    torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.25]]),
    torch.tensor([[4.0, -3.0, 1.0], [0.0, 2.0, 3.0]]),
    torch.tensor([[-0.5, 1.0, 0.75], [0.25, 0.0, 0.5]]),
]


@pytest.mark.parametrize(
    "name,kw,expected",
    [
        ("memoryless_minmax", {}, (-0.5, 1.0)),
        ("static_minmax", {}, (-3.0, 4.0)),
        # c = 0.25: (-1, 2) -> (-1.5, 2.5) -> (-1.25, 2.125), exact in binary
        ("minmax", {"averaging_constant": 0.25}, (-1.25, 2.125)),
        ("minmax", {"averaging_constant": 1.0}, (-0.5, 1.0)),  # c == 1 replaces
    ],
)
def test_minmax_family_hand_computed(backend, name, kw, expected, device):
    obs = make(name, base_name="input", **kw)
    for v in VALUES:
        assert obs(v.to(device)) is obs
    assert torch.equal(obs.min_vals, torch.tensor([expected[0]], device=device))
    assert torch.equal(obs.max_vals, torch.tensor([expected[1]], device=device))
    qp = obs.get_qparams()
    # int8 symmetric: scale = max(|min|, |max|) / 127.5, zero point 0
    absmax = max(abs(expected[0]), abs(expected[1]))
    assert torch.equal(qp["scale"], torch.tensor([absmax], device=device) / 127.5)
    assert torch.equal(qp["zero_point"], torch.zeros(1, dtype=torch.int8, device=device))
    assert qp["global_scale"] is None
    assert not obs.has_statistics  # dropped
    obs(VALUES[1].to(device))  # starts afresh: the first value is taken as is
    assert torch.equal(obs.min_vals, torch.tensor([-3.0], device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_minmax_default_moving_average(backend, dtype, device):
    obs = make("minmax", base_name="input")
    for v in VALUES:
        obs(v.to(device=device, dtype=dtype))
    lo = hi = None
    for mn, mx in ((-1.0, 2.0), (-3.0, 4.0), (-0.5, 1.0)):
        mn, mx = torch.tensor([mn], dtype=dtype, device=device), torch.tensor([mx], dtype=dtype, device=device)
        lo = mn if lo is None else lo * (1 - 0.01) + mn * 0.01
        hi = mx if hi is None else hi * (1 - 0.01) + mx * 0.01
    assert obs.min_vals.dtype == dtype
    assert torch.equal(obs.min_vals, lo) and torch.equal(obs.max_vals, hi)
    asym = make("minmax", base_name="input", args=qargs(symmetric=False))
    for v in VALUES:
        asym(v.to(device=device, dtype=dtype))
    scale, zp = calculate_qparams(lo, hi, qargs(symmetric=False))
    qp = asym.get_qparams()
    assert torch.equal(qp["scale"], scale) and torch.equal(qp["zero_point"], zp)


def _search(value, base_name, args, flavour="mse", importance=None, **over):
    kw = dict(DEFAULTS["imatrix_mse" if flavour == "imatrix" else "memoryless_mse"])
    kw.update(over)
    for k in ("chunk_size", "strict", "triton_error_buffer"):
        kw.pop(k, None)
    return reference_search(value, base_name, args, importance=importance, flavour=flavour, **kw)


def test_mse_observers_call_the_search_with_their_defaults(backend, device):
    w = torch.randn(6, 32).to(device)
    args = qargs("group", group_size=16, symmetric=False)
    expected = _search(w, "weight", args)
    for name in ("memoryless_mse", "mse"):
        stats = make(name, args=args.model_copy(deep=True))(w).get_statistics()
        assert torch.equal(stats["min_vals"], expected[0]) and torch.equal(stats["max_vals"], expected[1])

    # "mse" on activations: the search per value, then the moving average
    a, b = torch.randn(2, 3, 32).to(device), 3 * torch.randn(4, 32).to(device)
    ra, rb = _search(a, "input", args), _search(b, "input", args)
    obs = make("mse", base_name="input", args=args.model_copy(deep=True))
    obs(a)(b)
    assert torch.equal(obs.min_vals, ra[0] * (1 - 0.01) + rb[0] * 0.01)
    assert torch.equal(obs.max_vals, ra[1] * (1 - 0.01) + rb[1] * 0.01)
    memoryless = make("memoryless_mse", base_name="input", args=args.model_copy(deep=True))
    memoryless(a)(b)
    assert torch.equal(memoryless.min_vals, rb[0]) and torch.equal(memoryless.max_vals, rb[1])


def test_nvfp4_expanded_mse_and_global_scale(device):
    w = torch.randn(4, 32).to(device)
    w[2, 7] = -5.0  # the absolute max
    args = nvfp4_args()
    obs = make("nvfp4_expanded_mse", args=args)
    obs(w)
    exp_min, exp_max = _search(w, "weight", args, expand=1.8, maxshrink=1 - 0.8 / 1.8, grid=200, patience=1000)
    assert torch.equal(obs.min_vals, exp_min) and torch.equal(obs.max_vals, exp_max)
    absmax = torch.maximum(exp_max.max(), -exp_min.min())
    qp = obs.get_qparams()
    assert torch.equal(qp["global_scale"], (2688.0 / absmax).reshape(1))
    scale, zp = calculate_qparams(exp_min, exp_max, args, global_scale=qp["global_scale"])
    assert torch.equal(qp["scale"], scale) and torch.equal(qp["zero_point"], zp)
    # scale_dtype fp8: every scale is an fp8 e4m3 number
    assert torch.equal(qp["scale"].to(torch.float8_e4m3fn).to(qp["scale"].dtype), qp["scale"])


@pytest.mark.parametrize("name", NAMES)
def test_weight_is_observed_once(name, device):
    w = torch.randn(8, 32).to(device)
    args = nvfp4_args() if name == "nvfp4_expanded_mse" else qargs("channel")
    obs = make(name, args=args)
    quiet(obs, w)
    first = {k: v.clone() for k, v in obs.get_statistics().items()}
    quiet(obs, 10 * w + 1)
    for k, v in obs.get_statistics().items():
        assert torch.equal(v, first[k]), (name, k)
    assert obs._num_observed_tokens == 0  # weights are not tokens


# ---------------------------------------------------------------------------
# TENSOR_GROUP global scale and fusion
# ---------------------------------------------------------------------------


def _qkv_weights(device="cpu"):
    ws = [(torch.rand(4, 32) - 0.5).to(device) for _ in range(3)]
    ws[0][0, 0] = 1.0  # absolute maxima 1, 3 (a minimum), 2
    ws[1][1, 3] = -3.0
    ws[2][2, 5] = 2.0
    return ws


def test_tensor_group_global_scale_of_one_observer(device):
    w = _qkv_weights(device)[1]
    qp = make("memoryless_minmax", args=nvfp4_args())(w).get_qparams()
    three = torch.tensor([3.0], device=device)
    assert torch.equal(qp["global_scale"], torch.tensor([2688.0], device=device) / three)
    assert torch.equal(qp["global_scale"], generate_gparam(-three, three))
    mn, mx = ops.min_max(w, "weight", nvfp4_args())
    scale, _ = calculate_qparams(mn, mx, nvfp4_args(), global_scale=qp["global_scale"])
    assert torch.equal(qp["scale"], scale)


def test_fused_observers_share_the_global_scale(device):
    ws = _qkv_weights(device)
    obs = [make("memoryless_minmax", args=nvfp4_args()) for _ in ws]
    Observer.fuse(obs)
    for o, w in zip(obs, ws):
        o(w)
    g = torch.tensor([2688.0], device=device) / torch.tensor([3.0], device=device)  # the largest |value| of all three
    for i, (o, w) in enumerate(zip(obs, ws)):
        qp = o.get_qparams()
        assert torch.equal(qp["global_scale"], g), i
        mn, mx = ops.min_max(w, "weight", nvfp4_args())
        assert torch.equal(qp["scale"], calculate_qparams(mn, mx, nvfp4_args(), global_scale=g)[0])
        # statistics stay until every fused observer has taken its qparams
        assert all(x.has_statistics for x in obs) == (i < 2)
    # a fresh round works the same
    for o, w in zip(obs, ws):
        o(w)
    assert all(torch.equal(o.get_qparams()["global_scale"], g) for o in obs)


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax", "memoryless_mse"])
def test_fusing_after_the_observation_takes_the_group_global_scale(name, backend, device):
    """A TENSOR_GROUP weight's first observation computes its qparams with
    its own global scale (the weight alone); fused after it, get_qparams
    computes them again with the group's, from the same statistics."""
    def gparam(stats):  # compressed-tensors' global scale of these statistics
        a = torch.stack([torch.maximum(mx.max(), -mn.min()) for mn, mx in stats]).max()
        return generate_gparam(-a.reshape(1), a.reshape(1))

    ws = _qkv_weights(device)
    obs = [make(name, args=nvfp4_args()) for _ in ws]
    for o, w in zip(obs, ws):
        o(w)
    stats = [(o.min_vals.clone(), o.max_vals.clone()) for o in obs]
    Observer.fuse(obs)
    g = gparam(stats)
    if name != "memoryless_mse":  # the largest |value| of all three (the search narrows it)
        assert torch.equal(g, torch.tensor([2688.0], device=device) / torch.tensor([3.0], device=device))
    for o, (mn, mx) in zip(obs, stats):
        qp = o.get_qparams()
        assert torch.equal(qp["global_scale"], g)
        assert torch.equal(qp["scale"], calculate_qparams(mn, mx, nvfp4_args(), global_scale=g)[0])
    # an observer alone keeps the global scale of its own weight's statistics
    alone = make(name, args=nvfp4_args())
    alone(ws[0])
    own = gparam([(alone.min_vals.clone(), alone.max_vals.clone())])
    assert not torch.equal(own, g)
    assert torch.equal(alone.get_qparams()["global_scale"], own)


def test_fused_observers_observe_their_modules(device):
    ws = _qkv_weights(device)
    mods = [torch.nn.Linear(32, 4, bias=False, device=device) for _ in ws]
    for m, w in zip(mods, ws):
        m.weight.data.copy_(w)
    obs = [make("memoryless_minmax", args=nvfp4_args()) for _ in ws]
    Observer.fuse(zip(obs, mods))
    obs[0](mods[0].weight)  # the other two observe their own module's weight
    assert all(o.has_statistics for o in obs)
    for o, w in zip(obs, ws):
        assert torch.equal(o.min_vals, ops.min_max(w, "weight", nvfp4_args())[0])
    g = torch.tensor([2688.0], device=device) / torch.tensor([3.0], device=device)
    assert all(torch.equal(o.get_qparams()["global_scale"], g) for o in obs)


def test_fusion_errors():
    a, b = (make("memoryless_minmax", args=nvfp4_args()) for _ in range(2))
    Observer.fuse([a, b])
    a(torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="fused"):
        a.get_qparams()
    with pytest.raises(ValueError, match="tensor_group"):
        Observer.fuse([make("minmax", args=qargs("group", group_size=16)), b])
    with pytest.raises(TypeError):
        Observer.fuse([a, "b"])
    assert make("minmax", args=qargs("group", group_size=16))(torch.randn(4, 32)).get_qparams()["global_scale"] is None


# ---------------------------------------------------------------------------
# imatrix_mse through a real nn.Linear
# ---------------------------------------------------------------------------


def _linear(in_features=16, out_features=6, device="cpu"):
    lin = torch.nn.Linear(in_features, out_features, bias=False)
    lin.weight.data = torch.randn(out_features, in_features)
    return lin.to(device)


def _inputs(in_features=16, device="cpu"):
    # a few columns far louder than the rest, so importance matters
    scale = torch.ones(in_features)
    scale[:3] = torch.tensor([30.0, 10.0, 5.0])
    return (torch.randn(2, 3, in_features) * scale).to(device), (torch.randn(5, in_features) * scale).to(device)


def test_imatrix_through_linear_forward(backend, device):
    lin = _linear(device=device)
    x3, x2 = _inputs(device=device)
    args = qargs("channel", num_bits=4)
    obs = make("imatrix_mse", args=args)
    obs.attach(lin)
    lin(x3)
    lin(x2)
    expected = x3.double().pow(2).sum(dim=(0, 1)) + x2.double().pow(2).sum(dim=0)
    torch.testing.assert_close(obs._imatrix_sum.double(), expected, rtol=1e-5, atol=0)
    assert int(obs._imatrix_count) == 11
    obs.detach(lin)
    before = obs._imatrix_sum.clone()
    lin(x3)  # no hook any more
    assert torch.equal(obs._imatrix_sum, before) and int(obs._imatrix_count) == 11

    # importance = (sum / count) / (mean + tiny), fp32
    imp = obs._imatrix_sum / 11.0
    imp = imp / (imp.mean() + torch.finfo(torch.float32).tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportanceFallbackWarning)
        obs(lin.weight)
    exp_min, exp_max = _search(lin.weight, "weight", args, flavour="imatrix", importance=imp)
    assert torch.equal(obs.min_vals, exp_min) and torch.equal(obs.max_vals, exp_max)
    uniform = _search(lin.weight, "weight", args, flavour="imatrix")
    assert not torch.equal(uniform[0], exp_min), "importance made no difference: weak test data"

    qp = obs.get_qparams()
    assert torch.equal(qp["scale"], calculate_qparams(exp_min, exp_max, args)[0])
    assert obs._imatrix_sum is None and obs._imatrix_count is None  # went with the statistics
    obs.attach(lin)
    lin(x2)
    assert int(obs._imatrix_count) == 5


def _setup_no_data(obs, lin):
    pass


def _setup_attached_no_forward(obs, lin):
    obs.attach(lin)


def _setup_forward(obs, lin):
    obs.attach(lin)
    lin(_inputs(device=lin.weight.device)[1])


def _setup_non_finite(obs, lin):
    _setup_forward(obs, lin)
    obs._imatrix_sum[0] = float("inf")


def _setup_negative(obs, lin):
    _setup_forward(obs, lin)
    obs._imatrix_sum[1] = -1.0


def _setup_zeros(obs, lin):
    obs.attach(lin)
    lin(torch.zeros(4, 16, device=lin.weight.device))


FALLBACKS = [
    # name, base_name, args, setup, value shape, error when strict, reason in the
    # message, whether it is reported at get_qparams (the importance's values
    # are judged on the device and read there; the reasons after them wait for
    # that verdict) rather than while observing, on every backend
    ("activation", "input", qargs("tensor"), _setup_no_data, (2, 3, 16), NotImplementedError,
     "only weight observers use importance", False),
    ("tensor strategy", "weight", qargs("tensor"), _setup_forward, (6, 16), NotImplementedError,
     "strategy 'tensor' does not use importance", False),
    ("block strategy", "weight", qargs("block", block_structure=[2, 8]), _setup_forward, (6, 16),
     NotImplementedError, "strategy 'block' does not use importance", True),
    ("no data", "weight", qargs("channel"), _setup_no_data, (6, 16), ValueError,
     "no importance data (attach and run a forward first)", False),
    ("no forward", "weight", qargs("channel"), _setup_attached_no_forward, (6, 16), ValueError,
     "no importance data (attach and run a forward first)", True),
    ("non-finite", "weight", qargs("channel"), _setup_non_finite, (6, 16), ValueError,
     "importance has non-finite values", True),
    ("negative", "weight", qargs("group", group_size=8), _setup_negative, (6, 16), ValueError,
     "importance has negative values", True),
    ("all zeros", "weight", qargs("channel"), _setup_zeros, (6, 16), ValueError,
     "importance is all zeros", True),
    ("size mismatch", "weight", qargs("channel"), _setup_forward, (6, 32), ValueError,
     "importance has 16 channels, the weight 32 columns", True),
    ("block strategy, no forward", "weight", qargs("block", block_structure=[2, 8]),
     _setup_attached_no_forward, (6, 16), ValueError,
     "no importance data (attach and run a forward first)", True),
]


def _fallbacks(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ImportanceFallbackWarning)]


@pytest.mark.parametrize("case", FALLBACKS, ids=lambda c: c[0])
def test_imatrix_fallback_warns_once(case, backend, device):
    """One warning per observation, with its reason, and the uniform search's
    range. Nothing is read while observing, on either backend: a reason that
    needs the importance's values (or comes after them) is reported at
    get_qparams, where their verdict is read; the others while observing."""
    _, base_name, args, setup, shape, _, reason, deferred = case
    obs = make("imatrix_mse", base_name=base_name, args=args.model_copy(deep=True))
    setup(obs, _linear(device=device))
    value = torch.randn(shape).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs(value)
    observing = _fallbacks(caught)
    exp_min, exp_max = _search(value, base_name, args, flavour="imatrix")  # uniform weights
    assert torch.equal(obs.min_vals, exp_min) and torch.equal(obs.max_vals, exp_max)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs.get_qparams()
    at_qparams = _fallbacks(caught)
    late = deferred
    assert (len(observing), len(at_qparams)) == ((0, 1) if late else (1, 0)), (
        observing, at_qparams)
    (message,) = observing + at_qparams
    assert message == f"imatrix_mse: {reason}; falling back to uniform weights", message


@pytest.mark.parametrize("case", FALLBACKS, ids=lambda c: c[0])
def test_imatrix_fallback_raises_when_strict(case, backend, device):
    _, base_name, args, setup, shape, error, reason, deferred = case
    obs = make("imatrix_mse", base_name=base_name, args=args.model_copy(deep=True), strict=True)
    setup(obs, _linear(device=device))
    with pytest.raises(error, match=re.escape(f"imatrix_mse: {reason}")):
        obs(torch.randn(shape).to(device))
        assert deferred, "observing should have raised"
        obs.get_qparams()
    assert not obs.has_statistics


def test_attach_to_module_without_in_features_adds_no_hook():
    obs = make("imatrix_mse", args=qargs("channel"))
    conv = torch.nn.Conv1d(4, 4, 1)
    obs.attach(conv)
    conv(torch.randn(1, 4, 3))
    assert obs._imatrix_hook is None and int(obs._imatrix_count) == 0


# ---------------------------------------------------------------------------
# token counting
# ---------------------------------------------------------------------------


def _observe_input(module, args):
    module.input_observer(args[0])  # returns None: the input is left as it is


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 8)
        self.fc2 = torch.nn.Linear(8, 4)
        for fc in (self.fc1, self.fc2):
            fc.register_module("input_observer", make("minmax", base_name="input"))
            fc.register_forward_pre_hook(_observe_input)
        self.fc1.register_module("weight_observer", make("memoryless_minmax"))
        self.q_observer = make("static_minmax", base_name="q")

    def forward(self, x, q=None):
        if q is not None:
            self.q_observer(q)
        return self.fc2(self.fc1(x))


def test_token_count():
    model = _Block()
    model(torch.randn(2, 3, 16), q=torch.randn(2, 4, 5, 8))  # 6 tokens; q: 2 * 5 tokens
    model(torch.randn(5, 16))
    model(torch.randn(0, 16))  # empty: nothing counted
    model.fc1.weight_observer(model.fc1.weight)
    counts = get_observer_token_count(model)
    assert isinstance(counts, Counter)
    assert counts == Counter({"fc1.input_observer": 11, "fc2.input_observer": 11, "q_observer": 10})
    assert obskernels.get_observer_token_count is get_observer_token_count
