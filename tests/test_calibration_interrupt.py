"""``calibration.calibrating``: a calibration block that is safe to interrupt.

Whatever ends the block (normal exit, an exception, KeyboardInterrupt in the
middle of a batch or of ``update_qparams``), afterwards:
- no calibration hook and no observer is left on any module (hook counts are
  those from before the block; a later forward pass observes nothing);
- every quantized module's qparams are either exactly those it had before the
  block (with its quantization status and switch) or exactly those of an
  uninterrupted calibration on the same data, never a mix within a module.

Interruptions are injected by raising from a forward hook, from a patched
``update_offload_parameter`` (between two parameter writes of one module) and
from a patched ``get_qparams``. The uninterrupted result is itself checked
against plain torch min / max and compressed-tensors' calculate_qparams.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams

from obskernels import get_observer_token_count
from obskernels import calibration as calib
from obskernels.calibration import (
    ACTIVATION_BASE_NAMES,
    CalibrationWarning,
    calibrating,
    get_modules,
    start_calibration,
    update_qparams,
)

W_ARGS = QuantizationArgs(num_bits=4, strategy="group", group_size=8, observer="memoryless_minmax")
A_ARGS = QuantizationArgs(num_bits=8, strategy="tensor", observer="static_minmax")
QPARAMS = ("input_scale", "input_zero_point", "weight_scale", "weight_zero_point")


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 8),
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=W_ARGS, input_activations=A_ARGS)
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": scheme}), show_progress=False)
    # distinctive "before" values (compressed-tensors leaves torch.empty memory)
    for i, m in enumerate(get_modules(model, quantized_only=True)):
        for j, name in enumerate(QPARAMS):
            getattr(m, name).data.fill_(0.25 * (i + 1) + j if "scale" in name else j % 3)
    return model


def batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def state(model):
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        out[name] = {q: getattr(m, q).detach().clone() for q in QPARAMS}
        out[name]["status"] = m.__dict__.get("quantization_status")
        out[name]["enabled"] = m.__dict__.get("quantization_enabled")
    return out


def hook_counts(model):
    return {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}


def full_run(model, data):
    with calibrating(model):
        with torch.no_grad():
            for x in data:
                model(x)
        update_qparams(get_modules(model), ["input", "weight"])
    return state(model)


@pytest.fixture(scope="module")
def expected():
    """Before / after an uninterrupted calibration, the after checked by hand."""
    model = make_model()
    before = state(model)
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, a, _n=name: seen.setdefault(_n, []).append(a[0]))
    after = full_run(model, batches())
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        xs = torch.stack(seen[name])
        scale, zp = calculate_qparams(xs.amin().reshape(1), xs.amax().reshape(1), A_ARGS)
        assert torch.equal(after[name]["input_scale"], scale), name
        assert torch.equal(after[name]["input_zero_point"], zp.to(after[name]["input_zero_point"].dtype))
        w = m.weight.detach().reshape(m.out_features, -1, 8)
        scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), W_ARGS)
        assert torch.equal(after[name]["weight_scale"], scale.to(after[name]["weight_scale"].dtype)), name
        assert after[name]["status"] == QuantizationStatus.FROZEN and after[name]["enabled"] is True
    return before, after


def assert_clean(model, hooks_before):
    for name, m in model.named_modules():
        left = [b for b in calib.ALL_BASE_NAMES if hasattr(m, f"{b}_observer")]
        assert not left, f"observers left on {name!r}: {left}"
    assert hook_counts(model) == hooks_before, "calibration hooks left behind"
    # a later forward pass observes nothing
    with torch.no_grad():
        model(batches(1)[0])
    assert not get_observer_token_count(model)


def assert_each_module_old_or_new(got, before, after, want_new):
    for name in before:
        want = after[name] if name in want_new else before[name]
        which = "calibrated" if name in want_new else "pre-calibration"
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[name][key], value), (
                    f"module {name!r} {key}: {got[name][key]} is not its {which} value {value}"
                )
            else:
                assert got[name][key] == value, f"module {name!r} {key}: {got[name][key]} != {value}"


def test_normal_exit_is_the_full_calibration(expected):
    before, after = expected
    model = make_model()
    assert state(model).keys() == before.keys()
    hooks = hook_counts(model)
    assert full_run(model, batches()).keys() == after.keys()
    assert_each_module_old_or_new(state(model), before, after, want_new=set(after))
    assert_clean(model, hooks)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_mid_batch(expected, exc):
    before, after = expected
    model = make_model()
    calls = []

    def stop(module, args):
        calls.append(1)
        if len(calls) == 2:  # inside the second batch, after layer 0 observed it
            raise exc("stop")

    model[2].register_forward_pre_hook(stop)
    hooks = hook_counts(model)
    with pytest.raises(exc, match="stop"):
        with calibrating(model):
            assert hasattr(model[0], "input_observer")
            with torch.no_grad():
                for x in batches():
                    model(x)
            update_qparams(get_modules(model), ["input", "weight"])
    assert len(calls) == 2
    assert_each_module_old_or_new(state(model), before, after, want_new=set())
    assert_clean(model, hooks)


def test_interrupted_between_two_writes_of_one_module(expected, monkeypatch):
    """KeyboardInterrupt after module '2' stored its input scale, before its
    zero point: '0' stays calibrated, '2' is put back whole, '4' never started."""
    before, after = expected
    model = make_model()
    hooks = hook_counts(model)
    original = calib.qparams.update_offload_parameter
    writes = []

    def write(module, name, value):
        if armed and module is model[2]:
            writes.append(name)
            if len(writes) == 2:
                raise KeyboardInterrupt
        return original(module, name, value)

    monkeypatch.setattr(calib.qparams, "update_offload_parameter", write)
    armed = False
    with pytest.raises(KeyboardInterrupt):
        with calibrating(model):
            with torch.no_grad():
                for x in batches():
                    model(x)
            armed = True
            update_qparams(get_modules(model), ["input", "weight"])
    armed = False
    assert writes[:2] == ["input_scale", "input_zero_point"]
    assert_each_module_old_or_new(state(model), before, after, want_new={"0"})
    assert_clean(model, hooks)


def test_update_qparams_alone_stores_a_module_whole(monkeypatch):
    """Without the block too: a failing write puts back the module's earlier writes."""
    model = make_model()
    start_calibration(model)
    with torch.no_grad():
        model(batches(1)[0])
    placeholders = state(model)
    original = calib.qparams.update_offload_parameter
    calls = []

    def write(module, name, value):
        calls.append(name)
        if len(calls) == 3:  # weight_scale of the first module
            raise RuntimeError("disk full")
        return original(module, name, value)

    monkeypatch.setattr(calib.qparams, "update_offload_parameter", write)
    with pytest.raises(RuntimeError, match="disk full"):
        update_qparams(get_modules(model), ["input", "weight"])
    assert calls[:3] == ["input_scale", "input_zero_point", "weight_scale"]
    got = state(model)
    for key in QPARAMS:
        assert torch.equal(got["0"][key], placeholders["0"][key]), key
    calib.end_calibration(model)


def test_failure_in_get_qparams_of_a_later_module(expected, monkeypatch):
    before, after = expected
    model = make_model()
    hooks = hook_counts(model)
    with pytest.raises(RuntimeError, match="observer broke"):
        with calibrating(model):
            with torch.no_grad():
                for x in batches():
                    model(x)
            broken = model[4].weight_observer
            monkeypatch.setattr(broken, "get_qparams", lambda: (_ for _ in ()).throw(RuntimeError("observer broke")))
            update_qparams(get_modules(model), ["input", "weight"])
    assert_each_module_old_or_new(state(model), before, after, want_new={"0", "2"})
    assert_clean(model, hooks)


def test_activations_stored_but_weights_not(expected):
    """Interrupted between update_qparams(activations) and update_qparams(weight):
    no module is complete, so none keeps its new input scale."""
    before, after = expected
    model = make_model()
    hooks = hook_counts(model)
    with pytest.raises(KeyboardInterrupt):
        with calibrating(model):
            with torch.no_grad():
                for x in batches():
                    model(x)
            modules = get_modules(model)
            update_qparams(modules, ACTIVATION_BASE_NAMES)
            assert not torch.equal(model[0].input_scale, before["0"]["input_scale"])
            raise KeyboardInterrupt
    assert_each_module_old_or_new(state(model), before, after, want_new=set())
    assert_clean(model, hooks)


def test_normal_exit_without_update_warns_and_restores(expected):
    before, after = expected
    model = make_model()
    hooks = hook_counts(model)
    with pytest.warns(CalibrationWarning, match=r"did not store the qparams of 1 module\(s\) \(4\)"):
        with calibrating(model):
            with torch.no_grad():
                for x in batches():
                    model(x)
            update_qparams([model[0], model[2]], ["input", "weight"])
    assert_each_module_old_or_new(state(model), before, after, want_new={"0", "2"})
    assert_clean(model, hooks)


def test_refuses_a_model_already_calibrating():
    model = make_model()
    start_calibration(model)
    with pytest.raises(RuntimeError, match=r"already carries observers \(0\.input_observer"):
        with calibrating(model):
            pass
    calib.end_calibration(model)
    with pytest.warns(CalibrationWarning):  # once ended, it can be calibrated again
        with calibrating(model):
            pass


def test_a_start_that_fails_part_way_is_undone():
    """fused q/k/v with mixed strategies: start_calibration raises after it
    attached observers to some modules; nothing of it stays."""
    from compressed_tensors.quantization import preset_name_to_scheme

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, 32) for _ in range(3))

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Attention())
    nvfp4 = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    apply_quantization_config(model, QuantizationConfig(config_groups={
        "qk": QuantizationScheme(targets=["re:.*[qk]_proj$"], weights=nvfp4),
        "rest": QuantizationScheme(targets=["Linear"], weights=W_ARGS),
    }), show_progress=False)
    for i, m in enumerate(get_modules(model, quantized_only=True)):
        m.weight_scale.data.fill_(i + 0.5)
    before = {n: (m.weight_scale.clone(), m.quantization_status) for n, m in model.named_modules()
              if hasattr(m, "quantization_scheme")}
    hooks = hook_counts(model)
    with pytest.raises(ValueError, match="must all use 'tensor_group'"):
        with calibrating(model):
            pass
    for n, m in model.named_modules():
        assert not any(hasattr(m, f"{b}_observer") for b in calib.ALL_BASE_NAMES), n
        if n in before:
            assert torch.equal(m.weight_scale, before[n][0]), n
            assert m.quantization_status == before[n][1], (n, m.quantization_status)
    assert hook_counts(model) == hooks
