"""llm-compressor 0.14.0.1's full observer registry and the current calibration
API as its documentation gives it: the nine registered names, the imatrix
two-pass pickup, ``observe`` / ``update_qparams`` / ``get_modules`` keywords,
and activation-ordered (``weight_g_idx``) GROUP weights.

Expected values are computed independently: importance and group min/max by
hand in torch, searches by the reference backend (called directly, no backend
choice) with llm-compressor 0.14.0.1's defaults written out here, qparams
through compressed-tensors' ``calculate_qparams`` / ``generate_gparam``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

import obskernels.calibration as calibration
import obskernels.calibration.qparams  # noqa: F401 (patched below)
from obskernels import (
    NVFP4ExpandedIMatrixObserver,
    NVFP4ExpandedMSEObserver,
    Observer,
    ops,
)
from obskernels.calibration import (
    end_calibration,
    get_modules,
    observe,
    start_calibration,
    update_qparams,
)
from obskernels.observers import ALL_OBSERVER_NAMES

from helpers import nvfp4_args, reference_search

# llm-compressor 0.14.0.1's NVFP4ExpandedMSEObserver / NVFP4ExpandedIMatrixObserver
# defaults (both search with norm 2.4)
NVFP4_EXPANDED = dict(expand=1.8, maxshrink=1 - 0.8 / 1.8, grid=200, patience=1000, norm=2.4)


def loud_inputs(n, cols, seed=1):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(cols)
    scale[:3] = torch.tensor([30.0, 10.0, 5.0])
    return torch.randn(n, cols, generator=gen) * scale


def hand_importance(*xs):
    """(sum of x**2 over tokens / tokens), normalised by its mean plus fp32 tiny."""
    total = sum(x.double().pow(2).sum(0) for x in xs)
    count = sum(x.shape[0] for x in xs)
    imp = (total / count).float()
    return imp / (imp.mean() + torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------- registry


def test_registry_holds_the_nine_names_of_llmcompressor_0_14():
    assert len(ALL_OBSERVER_NAMES) == 9
    registered = set(Observer.registered_names())
    for name in ALL_OBSERVER_NAMES:
        assert name.replace("_", "-") in registered, name


def test_nvfp4_expanded_imatrix_defaults():
    obs = Observer.load_from_registry("nvfp4_expanded_imatrix", base_name="weight", args=nvfp4_args())
    assert type(obs) is NVFP4ExpandedIMatrixObserver
    want = dict(NVFP4_EXPANDED, strict=False)
    assert {k: getattr(obs, k) for k in want} == want


def test_nvfp4_expanded_imatrix_searches_the_expanded_range_with_importance(backend):
    lin = torch.nn.Linear(32, 4, bias=False)
    w = lin.weight.detach().clone()
    w[1, 5] = -4.0
    with torch.no_grad():
        lin.weight.copy_(w)
    xs = loud_inputs(7, 32), loud_inputs(3, 32, seed=2)
    args = nvfp4_args()
    obs = Observer.load_from_registry("nvfp4_expanded_imatrix", base_name="weight", args=args)
    obs.attach(lin)
    with torch.no_grad():
        for x in xs:
            lin(x)
    obs.detach(lin)
    obs(w)
    imp = hand_importance(*xs)
    torch.testing.assert_close(obs._imatrix_sum.double(), sum(x.double().pow(2).sum(0) for x in xs), rtol=1e-5, atol=0)
    exp_min, exp_max = reference_search(w, "weight", args, importance=imp, flavour="imatrix", **NVFP4_EXPANDED)
    assert torch.equal(obs.min_vals, exp_min) and torch.equal(obs.max_vals, exp_max)
    plain = reference_search(w, "weight", args, flavour="imatrix", **NVFP4_EXPANDED)
    assert not torch.equal(plain[0], exp_min), "importance made no difference: weak test data"
    qp = obs.get_qparams()
    a = torch.maximum(exp_max.max(), -exp_min.min()).reshape(1)
    assert torch.equal(qp["global_scale"], generate_gparam(-a, a))
    scale, _ = calculate_qparams(exp_min, exp_max, args, global_scale=qp["global_scale"])
    assert torch.equal(qp["scale"], scale)


def test_fouroversix_is_a_deprecated_alias_of_nvfp4_expanded_mse():
    w = torch.randn(4, 32)
    with pytest.warns(UserWarning, match="'fouroversix' is deprecated.*nvfp4_expanded_mse"):
        alias = Observer.load_from_registry("fouroversix", base_name="weight", args=nvfp4_args())
    assert type(alias) is NVFP4ExpandedMSEObserver
    assert (alias.expand, alias.maxshrink, alias.grid, alias.patience) == (1.8, 1 - 0.8 / 1.8, 200, 1000)
    got = alias(w).get_qparams()
    exp_min, exp_max = reference_search(w, "weight", nvfp4_args(), **NVFP4_EXPANDED)
    a = torch.maximum(exp_max.max(), -exp_min.min()).reshape(1)
    gscale = generate_gparam(-a, a)
    assert torch.equal(got["global_scale"], gscale)
    assert torch.equal(got["scale"], calculate_qparams(exp_min, exp_max, nvfp4_args(), global_scale=gscale)[0])


# llm-compressor 0.14.0.1's default triton_error_buffer for the args below (int4
# group, or nvfp4 for the nvfp4_expanded names); its imatrix observers have none
DEFAULT_BUFFER = {"memoryless_mse": 0.3, "mse": 0.3, "nvfp4_expanded_mse": 1.0, "imatrix_mse": None,
                  "nvfp4_expanded_imatrix": None}


@pytest.mark.parametrize("name", list(DEFAULT_BUFFER))
def test_triton_error_buffer_is_accepted_and_changes_nothing(name):
    w = torch.randn(4, 32)
    args = nvfp4_args() if name.startswith("nvfp4") else QuantizationArgs(num_bits=4, strategy="group", group_size=16)
    results = []
    for kw in ({}, {"triton_error_buffer": 0.3}, {"triton_error_buffer": 1}):
        obs = Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True), **kw)
        assert obs.triton_error_buffer == kw.get("triton_error_buffer", DEFAULT_BUFFER[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # imatrix without data: uniform fallback
            results.append(obs(w).get_qparams()["scale"])
    assert all(torch.equal(results[0], r) for r in results[1:])
    with pytest.raises(ValueError, match="triton_error_buffer"):
        Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True), triton_error_buffer=-0.1)
    with pytest.raises(TypeError, match="triton_error_buffer"):
        Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True), triton_error_buffer="0.3")


# ------------------------------------------------------ imatrix two passes


def test_imatrix_second_pass_picks_up_the_sums_left_on_the_module(backend):
    lin = torch.nn.Linear(16, 6, bias=False)
    x1, x2 = loud_inputs(9, 16), loud_inputs(4, 16, seed=3)
    args = QuantizationArgs(num_bits=4, strategy="channel")
    gatherer = Observer.load_from_registry("imatrix_mse", base_name="weight", args=args.model_copy(deep=True))
    gatherer.attach(lin)
    with torch.no_grad():
        lin(x1)
    gatherer.detach(lin)
    assert len(lin._forward_pre_hooks) == 0
    # the raw sums stay on the module after detach
    torch.testing.assert_close(lin._imatrix_sum.double(), x1.double().pow(2).sum(0), rtol=1e-5, atol=0)
    assert int(lin._imatrix_count) == 9

    second = Observer.load_from_registry("imatrix_mse", base_name="weight", args=args.model_copy(deep=True))
    second.attach(lin)
    assert not hasattr(lin, "_imatrix_sum") and not hasattr(lin, "_imatrix_count")
    assert len(lin._forward_pre_hooks) == 0, "a second pass registers no hook"
    with torch.no_grad():
        lin(x2)  # not accumulated: the importance is the first pass's
    assert int(second._imatrix_count) == 9
    w = lin.weight.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to uniform weights
        # but triton 3.6's interpreter's own: a loop bound made an int from a
        # one-element array, which numpy 2.3 deprecates (docs/spec.md §6)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="triton")
        second(w)
    exp = reference_search(w, "weight", args, maxshrink=0.95, patience=5, grid=20, norm=3.0, importance=hand_importance(x1), flavour="imatrix")
    assert torch.equal(second.min_vals, exp[0]) and torch.equal(second.max_vals, exp[1])
    second.get_qparams()
    second.detach(lin)
    assert not hasattr(lin, "_imatrix_sum"), "used sums are not left behind"


def test_imatrix_sums_used_by_get_qparams_leave_the_module():
    lin = torch.nn.Linear(16, 6, bias=False)
    obs = Observer.load_from_registry("imatrix_mse", base_name="weight", args=QuantizationArgs(num_bits=4, strategy="channel"))
    obs.attach(lin)
    with torch.no_grad():
        lin(loud_inputs(5, 16))
    assert lin._imatrix_sum is obs._imatrix_sum  # one tensor, updated in place
    obs(lin.weight).get_qparams()
    assert not hasattr(lin, "_imatrix_sum")
    obs.detach(lin)
    assert not hasattr(lin, "_imatrix_sum")
    # attached again: a fresh first pass
    obs.attach(lin)
    with torch.no_grad():
        lin(loud_inputs(3, 16))
    assert int(obs._imatrix_count) == 3 and int(lin._imatrix_count) == 3


# ------------------------------------------ observe / update_qparams keywords


def _one_linear(observer="memoryless_minmax", strategy="channel", **kw):
    model = torch.nn.Sequential(torch.nn.Linear(32, 8, bias=False))
    args = QuantizationArgs(num_bits=4, strategy=strategy, observer=observer, **kw)
    config = QuantizationConfig(config_groups={"g": QuantizationScheme(targets=["Linear"], weights=args)})
    apply_quantization_config(model, config, show_progress=False)
    return model, args


def _hand_channel_scale(w, args):
    return calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)[0]


@pytest.mark.parametrize("call", [
    lambda m: update_qparams(m, "weight"),
    lambda m: update_qparams(module=m, base_name="weight"),
    lambda m: update_qparams(module=[m], base_name=["weight"], only_update_onload=False),
    lambda m: update_qparams(modules=[m], base_names="weight"),
    lambda m: update_qparams([m], "weight", True),
], ids=["positional", "seed-keywords", "seed-iterables", "older-keywords", "onload-only"])
def test_update_qparams_keywords(call):
    model, args = _one_linear()
    lin = model[0]
    start_calibration(model)
    observe(module=lin, base_name="weight")
    call(lin)
    assert torch.equal(lin.weight_scale, _hand_channel_scale(lin.weight.detach(), args).to(lin.weight_scale.dtype))


def test_update_qparams_onload_only_bypasses_the_offload_writer(monkeypatch):
    model, args = _one_linear()
    lin = model[0]
    start_calibration(model)

    def refuse(*a, **k):
        raise AssertionError("update_offload_parameter called with only_update_onload=True")

    monkeypatch.setattr(calibration.qparams, "update_offload_parameter", refuse)
    update_qparams(lin, "weight", only_update_onload=True)
    assert torch.equal(lin.weight_scale, _hand_channel_scale(lin.weight.detach(), args).to(lin.weight_scale.dtype))


def test_observe_and_update_qparams_argument_errors():
    model, _ = _one_linear()
    lin = model[0]
    start_calibration(model)
    with pytest.raises(TypeError, match="not both"):
        update_qparams(lin, "weight", modules=[lin])
    with pytest.raises(TypeError, match="missing argument 'base_name'"):
        update_qparams(lin)
    with pytest.raises(TypeError, match="not both"):
        observe(lin, modules=[lin])
    observe(modules=[lin])  # older keyword, default base name "weight"
    assert lin.weight_observer.has_statistics


# ------------------------------------------------------------- weight_g_idx


def _activation_order(cols, group_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(cols, generator=gen) // group_size).to(torch.int64)


@pytest.mark.parametrize("observer", ["memoryless_minmax", "memoryless_mse"])
def test_activation_ordered_group_weights_end_to_end(backend, observer):
    model, args = _one_linear(observer, "group", group_size=8)
    lin = model[0]
    g_idx = _activation_order(32, 8)
    lin.weight_g_idx = torch.nn.Parameter(g_idx, requires_grad=False)
    start_calibration(model)
    update_qparams(get_modules(model), "weight")  # observes the weight with its g_idx
    end_calibration(model)
    w = lin.weight.detach()
    if observer == "memoryless_minmax":
        # by hand: group g holds the columns j with g_idx[j] == g
        mins = torch.stack([w[:, g_idx == g].amin(1) for g in range(4)], 1)
        maxs = torch.stack([w[:, g_idx == g].amax(1) for g in range(4)], 1)
    else:
        ordered = w[:, torch.argsort(g_idx, stable=True)]
        mins, maxs = reference_search(ordered, "weight", args, maxshrink=0.2, patience=5, grid=100, norm=2.4)
    want = calculate_qparams(mins, maxs, args)[0]
    assert torch.equal(lin.weight_scale, want.to(lin.weight_scale.dtype))
    unordered = calculate_qparams(*ops.min_max(w, "weight", args), args)[0]
    assert not torch.equal(want, unordered), "g_idx made no difference: weak test data"


def test_activation_ordered_imatrix_weights_use_importance_in_group_order():
    model, args = _one_linear("imatrix_mse", "group", group_size=8)
    lin = model[0]
    g_idx = _activation_order(32, 8, seed=4)
    lin.weight_g_idx = torch.nn.Parameter(g_idx, requires_grad=False)
    xs = [loud_inputs(6, 32, seed=s) for s in (5, 6)]
    start_calibration(model)
    with torch.no_grad():
        for x in xs:
            model(x)
    update_qparams(get_modules(model), "weight")
    end_calibration(model)
    # independently: the permuted weight and permuted importance, no g_idx
    order = torch.argsort(g_idx, stable=True)
    w = lin.weight.detach()
    mins, maxs = reference_search(
        w[:, order], "weight", args, maxshrink=0.95, patience=5, grid=20, norm=3.0,
        importance=hand_importance(*xs)[order], flavour="imatrix",
    )
    assert torch.equal(lin.weight_scale, calculate_qparams(mins, maxs, args)[0].to(lin.weight_scale.dtype))


def test_g_idx_parameter_does_not_become_an_observer_parameter():
    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=QuantizationArgs(num_bits=4, strategy="group", group_size=8))
    g_idx = torch.nn.Parameter(_activation_order(16, 8), requires_grad=False)
    obs(torch.randn(4, 16), g_idx=g_idx)
    assert not dict(obs.named_parameters()) and not dict(obs.named_buffers())


def test_placeholder_g_idx_is_no_activation_order():
    model, args = _one_linear("memoryless_minmax", "group", group_size=8)
    lin = model[0]
    lin.weight_g_idx = torch.nn.Parameter(torch.full((32,), -1, dtype=torch.int64), requires_grad=False)
    start_calibration(model)
    update_qparams([lin], "weight")
    want = calculate_qparams(*ops.min_max(lin.weight.detach(), "weight", args), args)[0]
    assert torch.equal(lin.weight_scale, want.to(lin.weight_scale.dtype))


def test_g_idx_outside_group_weights_is_an_error():
    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=QuantizationArgs(num_bits=4, strategy="channel"))
    with pytest.raises(ValueError, match="g_idx"):
        obs(torch.randn(4, 16), g_idx=torch.zeros(16, dtype=torch.int64))
    obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=QuantizationArgs(num_bits=4, strategy="group", group_size=8))
    with pytest.raises(ValueError, match="g_idx"):
        obs(torch.randn(4, 16), g_idx=torch.zeros(16, dtype=torch.int64))  # 16 columns in group 0
    assert not obs.has_statistics
