"""The older calibration surface (obskernels.legacy.calibration) and its quantized kv-cache.

End to end on a tiny random Llama: the older hooks with the quantized
kv-cache and the current q/k/v path (obskernels.calibration) give identical
k_scale / v_scale where they compute the same thing; the older moving
average is checked against a hand computation from the key / value states
captured through compressed-tensors' own hooks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from obskernels import legacy
from obskernels.calibration import (
    CalibrationWarning,
    end_calibration,
    get_modules,
    observe,
    start_calibration,
    update_qparams,
)
from obskernels.legacy.calibration import (
    calibrate_output_hook,
    call_observer,
    freeze_module_quantization,
    initialize_observer,
    initialize_quantized_kv_cache,
    prepare_calibration,
    update_weight_zp_scale,
)

from helpers import tiny_llama

transformers = pytest.importorskip("transformers", reason="the quantized kv-cache is a transformers Cache")
from compressed_tensors.modeling.kvcache import QuantizedKVCache, register_key_hook, register_value_hook  # noqa: E402

from obskernels.legacy.kv_cache import QuantizedKVParameterCache  # noqa: E402


def batches(n):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2, 5), generator=gen) for _ in range(n)]


def kv_model(kv_args, groups=None):
    model = tiny_llama()
    config = QuantizationConfig(config_groups=groups or {}, kv_cache_scheme=kv_args, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    return model


def run_current(kv_args, n):
    """The current path: k / v observers fed by compressed-tensors' key / value hooks."""
    model = kv_model(kv_args.model_copy(deep=True))
    attn = model.model.layers[0].self_attn
    seen = {"k": [], "v": []}
    capture = [
        register_key_hook(attn, lambda m, k: seen["k"].append(k.detach().clone())),
        register_value_hook(attn, lambda m, v: seen["v"].append(v.detach().clone())),
    ]
    start_calibration(model)
    with torch.no_grad():
        for ids in batches(n):
            model(ids)
    update_qparams(get_modules(model), ["k", "v"])
    end_calibration(model)
    for h in capture:
        h.remove()
    return attn, seen


def run_legacy(kv_args, n):
    """The older path: a QuantizedKVParameterCache passed to attention by the kv-cache hooks."""
    model = kv_model(kv_args.model_copy(deep=True))
    attn = model.model.layers[0].self_attn
    handles = prepare_calibration(model)
    assert isinstance(attn.kv_cache, QuantizedKVParameterCache)
    assert isinstance(attn.kv_cache, transformers.Cache)
    with torch.no_grad():
        for ids in batches(n):
            model(ids)
    cache = attn.kv_cache
    model.apply(freeze_module_quantization)
    for h in handles:
        h.remove()
    return attn, cache, model


KV_CASES = [
    ("fp8 one batch", dict(num_bits=8, type="float", strategy="tensor", symmetric=True), {}, 1),
    ("int8 asym, c=1, three batches", dict(num_bits=8, type="int", strategy="tensor", symmetric=False), {"averaging_constant": 1.0}, 3),
]


@pytest.mark.parametrize("case", KV_CASES, ids=[c[0] for c in KV_CASES])
def test_older_kv_hooks_and_current_qkv_path_give_identical_scales(backend, case):
    _, kw, obs_kw, n = case
    kv_args = QuantizationArgs(observer_kwargs=obs_kw, **kw)
    cur, seen = run_current(kv_args, n)
    old, cache, model = run_legacy(kv_args, n)
    for name in ("k_scale", "v_scale"):
        a, b = getattr(cur, name), getattr(old, name)
        assert torch.equal(a, b), f"{name}: current {a.tolist()} vs older hooks {b.tolist()}"
    # independently: each is the scale of the last batch's states (c == 1) or the only batch
    for base, name in (("k", "k_scale"), ("v", "v_scale")):
        x = seen[base][-1]
        want, _ = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), kv_args)
        assert torch.equal(getattr(old, name), want), name
    # after freezing: the quantized cache is gone, compressed-tensors' wrapper is back
    assert isinstance(old.kv_cache, QuantizedKVCache) and "kv_cache" in old._modules
    assert old.quantization_status == QuantizationStatus.FROZEN
    assert len(cache.k_scales) == 1 and cache.k_scales[0] is not None
    with torch.no_grad():
        model(batches(1)[0])  # the restored wrapper serves the frozen model


def test_older_kv_moving_average_by_hand():
    kv_args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    _, seen = run_current(kv_args, 3)  # the same key / value states reach layer 0 on both paths
    old, cache, _ = run_legacy(kv_args, 3)
    for base, name in (("k", "k_scale"), ("v", "v_scale")):
        xs = seen[base]
        mn, mx = xs[0].amin(), xs[0].amax()
        for x in xs[1:]:  # the older moving average, c = 0.01
            mn, mx = mn + 0.01 * (x.amin() - mn), mx + 0.01 * (x.amax() - mx)
        want, _ = calculate_qparams(mn, mx, kv_args)
        assert torch.equal(getattr(old, name), want.reshape(1)), name


def test_quantized_cache_update_pads_layers_and_fake_quantizes():
    args = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True)
    cache = QuantizedKVParameterCache(args)
    k, v = torch.randn(1, 2, 3, 8), 5 * torch.randn(1, 2, 3, 8)
    qk, qv = cache.update(k, v, 2)
    assert cache.k_scales[:2] == [None, None] and cache.v_zps[:2] == [None, None]
    for x, q, scale in ((k, qk, cache.k_scales[2]), (v, qv, cache.v_scales[2])):
        want_scale, want_zp = calculate_qparams(x.amin(), x.amax(), args)
        assert torch.equal(scale, want_scale)
        assert torch.equal(q, fake_quantize(x, want_scale, want_zp, args))
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="does not exist in the older observer API"):
        QuantizedKVParameterCache(QuantizationArgs(num_bits=8, observer="static_minmax"))


def _linear_model(weights=None, output=None, inputs=None):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, output_activations=output, input_activations=inputs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": scheme}), show_progress=False)
    return model


def test_output_hook_returns_the_fake_quantized_output():
    out_args = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=False)
    model = _linear_model(output=out_args)
    lin = model[0]
    handles = prepare_calibration(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = model(x)
        raw = torch.nn.functional.linear(x, lin.weight, lin.bias)
    scale, zp = calculate_qparams(raw.amin(), raw.amax(), out_args)
    assert torch.equal(lin.output_scale, scale.reshape(lin.output_scale.shape))
    assert torch.equal(got, fake_quantize(raw, lin.output_scale, lin.output_zero_point, out_args))
    assert not torch.equal(got, raw)
    direct = calibrate_output_hook(lin, (x,), raw)
    assert torch.equal(direct, got)
    for h in handles:
        h.remove()


@pytest.mark.parametrize("with_g_idx", [False, True])
def test_weight_qparams_equal_the_current_api(backend, with_g_idx):
    w_args = QuantizationArgs(num_bits=4, strategy="group", group_size=4, observer="minmax")
    old_model, new_model = _linear_model(weights=w_args), _linear_model(weights=w_args.model_copy(deep=True))
    new_model.load_state_dict(old_model.state_dict())
    if with_g_idx:
        g_idx = torch.randperm(16, generator=torch.Generator().manual_seed(2)) // 4
        for m in (old_model, new_model):
            m[0].weight_g_idx = torch.nn.Parameter(g_idx.clone(), requires_grad=False)
    handles = prepare_calibration(old_model)  # update_weight_zp_scale runs here
    start_calibration(new_model)
    observe(get_modules(new_model), "weight")
    update_qparams(get_modules(new_model), "weight")
    end_calibration(new_model)
    assert torch.equal(old_model[0].weight_scale, new_model[0].weight_scale)
    assert torch.equal(old_model[0].weight_zero_point, new_model[0].weight_zero_point)
    for h in handles:
        h.remove()


def test_call_observer_and_update_weight_zp_scale_rules():
    in_args = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True)
    model = _linear_model(weights=QuantizationArgs(num_bits=8, strategy="channel"), inputs=in_args)
    lin = model[0]
    assert isinstance(initialize_observer(lin, "input"), legacy.MinMaxObserver)
    initialize_observer(lin, "weight")
    with pytest.raises(ValueError, match="needs a value"):
        call_observer(lin, "input")
    x = torch.randn(3, 16)
    call_observer(lin, "input", value=x)
    assert torch.equal(lin.input_scale, calculate_qparams(x.amin(), x.amax(), in_args)[0].reshape(1))
    with pytest.warns(CalibrationWarning, match="not in calibration status"):
        update_weight_zp_scale(lin)
    w = lin.weight.detach()
    want = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), lin.quantization_scheme.weights)[0]
    assert torch.equal(lin.weight_scale, want)
    plain = torch.nn.Linear(4, 4)
    update_weight_zp_scale(plain)  # no scheme: nothing happens
    # the older token count: 2-D inputs counted, keyed by the module's name
    lin.quantization_status = QuantizationStatus.CALIBRATION
    handles = prepare_calibration(model)
    with torch.no_grad():
        model(torch.randn(5, 16))
        model(torch.randn(2, 16))
    assert legacy.get_observer_token_count(model) == {"0": 5 + 2}
    with torch.no_grad():
        model(torch.randn(1, 2, 16))
    assert legacy.get_observer_token_count(model) == {"0": None}
    for h in handles:
        h.remove()


def test_freeze_returns_early_and_removes_observers():
    plain = torch.nn.Linear(4, 4)
    plain.register_module("input_observer", legacy.MinMaxObserver(QuantizationArgs(num_bits=8)))
    freeze_module_quantization(plain)  # no scheme: untouched
    assert hasattr(plain, "input_observer") and not hasattr(plain, "quantization_status")

    model = _linear_model(weights=QuantizationArgs(num_bits=8, strategy="channel"), inputs=QuantizationArgs(num_bits=8))
    lin = model[0]
    prepare_calibration(model)
    lin.quantization_status = QuantizationStatus.FROZEN
    freeze_module_quantization(lin)  # already frozen: nothing to do
    assert hasattr(lin, "input_observer") and hasattr(lin, "weight_observer")
    lin.quantization_status = QuantizationStatus.CALIBRATION
    freeze_module_quantization(lin)
    assert not hasattr(lin, "input_observer") and not hasattr(lin, "weight_observer")
    assert lin.quantization_status == QuantizationStatus.FROZEN


def test_initialize_quantized_kv_cache_only_on_kv_modules():
    model = kv_model(QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True))
    attn = model.model.layers[0].self_attn
    q_proj = attn.q_proj
    initialize_quantized_kv_cache(q_proj)
    assert not hasattr(q_proj, "kv_cache")
    initialize_quantized_kv_cache(attn)
    first = attn.kv_cache
    initialize_quantized_kv_cache(attn)
    assert attn.kv_cache is first and isinstance(first, QuantizedKVParameterCache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn.quantization_status = QuantizationStatus.CALIBRATION
    freeze_module_quantization(attn)
    assert isinstance(attn.kv_cache, QuantizedKVCache)
