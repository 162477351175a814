"""The llm-compressor drop-in: llm-compressor's observers, computing through
obskernels, give exactly the qparams llm-compressor gives on its own.

Runs where llm-compressor 0.14 is importable (`make test-llmcompressor` builds
that environment); elsewhere the module is skipped with the reason.
"""

import copy
import inspect
import math
import re

import pytest
import torch

llmcompressor = pytest.importorskip(
    "llmcompressor",
    reason="llm-compressor is not installed here; `make test-llmcompressor` runs these tests "
    "in their own environment (.venv-llmcompressor)",
)

from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer as LCObserver  # noqa: E402
from llmcompressor.observers import fuse_weight_observers  # noqa: E402

from obskernels.integrations import llmcompressor as drop_in  # noqa: E402
from obskernels.observers import ALL_OBSERVER_NAMES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ALL_NAMES = (
    "memoryless_minmax",
    "static_minmax",
    "minmax",
    "memoryless_mse",
    "mse",
    "nvfp4_expanded_mse",
    "imatrix_mse",
    "nvfp4_expanded_imatrix",
)

WEIGHT_ARGS = {
    "int8-channel": dict(num_bits=8, strategy="channel"),
    "int4-group16": dict(num_bits=4, strategy="group", group_size=16),
    "int4-group16-asym": dict(num_bits=4, strategy="group", group_size=16, symmetric=False),
    "nvfp4": dict(
        num_bits=4, type="float", strategy="tensor_group", group_size=16,
        scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn,
    ),
    "int8-tensor": dict(num_bits=8, strategy="tensor"),
    "fp8-block16-partial": dict(num_bits=8, type="float", strategy="block", block_structure=[16, 16]),
}
ACT_ARGS = {
    "int8-tensor": dict(num_bits=8, strategy="tensor"),
    "int8-tensor-asym": dict(num_bits=8, strategy="tensor", symmetric=False),
    "fp8-tensor": dict(num_bits=8, type="float", strategy="tensor"),
}
ATTN_ARGS = {
    "int8-tensor": dict(num_bits=8, strategy="tensor"),
    "fp8-attn-head": dict(num_bits=8, type="float", strategy="attn_head"),
}


# The seam is the same on both backends; the triton kernels run interpreted on
# the CPU here (slow), so they get a subset of the argument sets.
TRITON_WEIGHT_ARGS = ("int4-group16", "nvfp4")
TRITON_ACT_ARGS = ("int8-tensor",)


def _matrix(arg_names, triton_arg_names):
    cases = []
    for backend in ("reference", "triton"):
        for name in ALL_NAMES:
            for args_name in arg_names if backend == "reference" else triton_arg_names:
                for dtype in (torch.float32, torch.bfloat16):
                    cases.append(pytest.param(
                        backend, name, args_name, dtype,
                        id=f"{backend}-{name}-{args_name}-{str(dtype).split('.')[-1]}",
                    ))
    return cases


@pytest.fixture
def forced(request):
    """Forces the backend named by the test's ``backend_name`` parameter."""
    name = request.getfixturevalue("backend_name")
    if name == "triton":
        from obskernels.backends import triton_unavailable_reason

        reason = triton_unavailable_reason(None)
        if reason is not None:
            pytest.skip(f"triton backend unavailable: {reason}")
    from obskernels import use_backend

    with use_backend(name):
        yield name


@pytest.fixture(autouse=True)
def _restore_registry():
    yield
    drop_in.disable()


def _qparams(name, base_name, args_kw, values, enable):
    """Observe ``values`` with llm-compressor's observer ``name`` and return its qparams."""
    (drop_in.enable if enable else drop_in.disable)()
    obs = LCObserver.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**copy.deepcopy(args_kw))
    )
    assert ("ObsKernels" in type(obs).__name__) == enable
    for v in values:
        obs(v)
    return obs.get_qparams()


def _assert_same(got, want, what):
    assert got.keys() == want.keys()
    for key in want:
        a, b = got[key], want[key]
        if b is None:
            assert a is None, f"{what}: {key} should be None"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {key} {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        diff = (a.float() != b.float()) & ~(a.float().isnan() & b.float().isnan())
        assert not diff.any(), (
            f"{what}: {key} differs at {diff.nonzero()[:5].tolist()}: "
            f"drop-in {a[diff][:5].tolist()} vs llm-compressor {b[diff][:5].tolist()}"
        )


@pytest.mark.parametrize("backend_name,name,args_name,dtype", _matrix(WEIGHT_ARGS, TRITON_WEIGHT_ARGS))
def test_weight_qparams_match(forced, backend_name, name, args_name, dtype):
    # 40 rows: a partial 16x16 block row for the BLOCK case
    weight = (torch.randn(40, 64) * torch.linspace(0.2, 3.0, 64)).to(dtype)
    kw = WEIGHT_ARGS[args_name]
    want = _qparams(name, "weight", kw, [weight], enable=False)
    got = _qparams(name, "weight", kw, [weight], enable=True)
    _assert_same(got, want, f"{name}/{args_name}/{dtype}")


@pytest.mark.parametrize("backend_name,name,args_name,dtype", _matrix(ACT_ARGS, TRITON_ACT_ARGS))
def test_activation_qparams_match(forced, backend_name, name, args_name, dtype):
    values = [torch.randn(2, 5, 64).to(dtype) * s for s in (1.0, 3.0, 0.5)]
    values.insert(1, torch.empty(0, 64, dtype=dtype))  # an unrouted expert's input
    kw = ACT_ARGS[args_name]
    want = _qparams(name, "input", kw, values, enable=False)
    got = _qparams(name, "input", kw, values, enable=True)
    _assert_same(got, want, f"{name}/{args_name}/{dtype}")


GROUPED_ACT_ARGS = {
    "int4-group16-asym": WEIGHT_ARGS["int4-group16-asym"],
    "nvfp4": WEIGHT_ARGS["nvfp4"],
}


@pytest.mark.parametrize("order", ["2-D", "3-D then 2-D", "2-D then 3-D"])
@pytest.mark.parametrize("args_name", list(GROUPED_ACT_ARGS))
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax", "mse"])
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_two_dim_grouped_activations_match(forced, backend_name, name, args_name, order):
    # an MoE expert's input is (tokens, hidden): llm-compressor groups its
    # tokens and hidden size together (one statistic for the value), where
    # obskernels' own flattening keeps hidden / group_size statistics
    # (docs/spec.md §2); the drop-in gives llm-compressor's numbers
    two = [torch.randn(5, 64) * s for s in (1.0, 3.0)]
    three = [torch.randn(2, 3, 64) * 2.0]
    values = {"2-D": two, "3-D then 2-D": three + two, "2-D then 3-D": two + three}[order]
    kw = GROUPED_ACT_ARGS[args_name]
    want = _qparams(name, "input", kw, values, enable=False)
    got = _qparams(name, "input", kw, values, enable=True)
    _assert_same(got, want, f"{name}/{args_name}/{order}")


OTHER_DIMS = {  # shapes llm-compressor observes and obskernels' flattening refuses
    "weight": ((64,), (3, 32, 64), (2, 2, 16, 32)),  # e.g. 3-D fused experts
    "input": ((64,), (2, 3, 4, 64), (2, 3, 4, 5, 64)),  # e.g. a vision tower's 4-D
    "q": ((3, 7, 32), (2, 2, 4, 7, 16)),
}
OTHER_DIMS_ARGS = {
    "weight": ("int8-channel", "int4-group16-asym", "nvfp4", "int8-tensor"),
    "input": ("int8-tensor", "int4-group16-asym", "nvfp4"),
    "q": ("int8-tensor", "fp8-attn-head"),
}


@pytest.mark.parametrize("base_name,shape,args_name", [
    pytest.param(base, shape, args_name, id=f"{base}-{'x'.join(map(str, shape))}-{args_name}")
    for base, shapes in OTHER_DIMS.items() for shape in shapes for args_name in OTHER_DIMS_ARGS[base]
])
@pytest.mark.parametrize("name", ["static_minmax", "memoryless_mse"])
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_values_of_other_dims_match(forced, backend_name, name, base_name, shape, args_name):
    # the drop-in leaves them to llm-compressor's own flattening and
    # statistics, as without it, where obskernels' would refuse them: the
    # same qparams, or the same error (a 1-D activation in groups)
    kw = {**WEIGHT_ARGS, **ACT_ARGS, **ATTN_ARGS}[args_name]
    values = [torch.randn(shape), torch.randn(shape) * 2.0]
    try:
        want = _qparams(name, base_name, kw, values, enable=False)
    except Exception as exc:  # noqa: BLE001 - the drop-in must raise the same
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            _qparams(name, base_name, kw, values, enable=True)
        return
    got = _qparams(name, base_name, kw, values, enable=True)
    _assert_same(got, want, f"{name}/{base_name}/{shape}/{args_name}")


@pytest.mark.parametrize("args_name", list(ATTN_ARGS))
@pytest.mark.parametrize("base_name", ["q", "k", "v"])
@pytest.mark.parametrize("name", ["static_minmax", "minmax", "memoryless_mse"])
def test_attention_qparams_match(backend, name, base_name, args_name):
    values = [torch.randn(2, 4, 7, 16) * s for s in (1.0, 2.0)]
    kw = ATTN_ARGS[args_name]
    want = _qparams(name, base_name, kw, values, enable=False)
    got = _qparams(name, base_name, kw, values, enable=True)
    _assert_same(got, want, f"{name}/{base_name}/{args_name}")


# ------------------------------------------------------------------------- #
# obskernels' own registry, name by name, against llm-compressor's
# ------------------------------------------------------------------------- #
# obskernels.Observer (not the drop-in) and llm-compressor's Observer, each
# loaded by name with its default kwargs, observe the same values through
# the same lifecycle (attach, forwards, detach, observe, get_qparams); the
# qparams must be bit-identical. llm-compressor is the oracle: its defaults
# are not written out here, so a default obskernels gets wrong shows.

REGISTRY_WEIGHT_ARGS = {
    "int4-group16": WEIGHT_ARGS["int4-group16"],
    "int8-channel": WEIGHT_ARGS["int8-channel"],
    "nvfp4": WEIGHT_ARGS["nvfp4"],  # tensor_group: a global scale
    # the imatrix observers fall back to uniform weights for BLOCK, both of them
    "fp8-block16": WEIGHT_ARGS["fp8-block16-partial"],
}
REGISTRY_ACT_ARGS = {
    "int8-tensor": ACT_ARGS["int8-tensor"],
    "fp8-tensor": ACT_ARGS["fp8-tensor"],
    "int4-group16": dict(num_bits=4, strategy="group", group_size=16, symmetric=False),
    "nvfp4": WEIGHT_ARGS["nvfp4"],
}
ACTIVATION_NAMES = ("static_minmax", "minmax", "mse")


def _registry_matrix(names, arg_sets):
    cases = []
    for backend in ("reference", "triton"):
        for name in names:
            for args_name in arg_sets:
                # bf16 on both backends; fp32 on the reference (the interpreter is slow)
                for dtype in (torch.bfloat16,) + ((torch.float32,) if backend == "reference" else ()):
                    cases.append(pytest.param(
                        backend, name, args_name, dtype,
                        id=f"{backend}-{name}-{args_name}-{str(dtype).split('.')[-1]}",
                    ))
    return cases


def _calibration_inputs(cols):
    """Token batches whose squares sum exactly in fp32 in any order (quarters
    up to 4, scaled per channel by a power of two), so llm-compressor's hook
    and obskernels' (torch or the kernel) hold the same E[x**2] sums; the
    channels' energies differ by up to 2^24, so importance moves the choice."""
    gen = torch.Generator().manual_seed(5)
    scale = 2.0 ** torch.randint(-6, 7, (cols,), generator=gen).float()
    return [torch.randint(-16, 17, shape, generator=gen).float() / 4 * scale
            for shape in ((2, 9, cols), (5, cols), (1, 3, cols))]


def _lifecycle_qparams(observer_cls, name, base_name, args_kw, values, layer=None, inputs=()):
    """Load ``name`` from ``observer_cls``' registry with its defaults, attach it
    to ``layer`` and run ``inputs`` through it (E[x**2] for the imatrix
    observers, nothing for the others), detach, observe ``values``, get_qparams."""
    obs = observer_cls.load_from_registry(
        name, base_name=base_name, args=QuantizationArgs(**copy.deepcopy(args_kw))
    )
    assert "ObsKernels" not in type(obs).__name__, "the drop-in is enabled"
    sums = None
    if layer is not None:
        obs.attach(layer)
        with torch.no_grad():
            for x in inputs:
                layer(x)
        obs.detach(layer)
        if getattr(obs, "_imatrix_sum", None) is not None:
            sums = (obs._imatrix_sum.clone(), obs._imatrix_count.clone())
    for v in values:
        obs(v)
    return sums, obs.get_qparams()


def _registry_run(backend_name, name, base_name, args_kw, values, with_layer):
    from obskernels import Observer as OKObserver
    from obskernels import use_backend

    drop_in.disable()
    theirs = ours = None
    inputs = ()
    if with_layer:
        torch.manual_seed(4)
        theirs = torch.nn.Linear(values[0].shape[-1], values[0].shape[0], bias=False)
        ours = copy.deepcopy(theirs)  # one each: obskernels leaves unused sums on its module
        inputs = _calibration_inputs(values[0].shape[-1])
    want_sums, want = _lifecycle_qparams(LCObserver, name, base_name, args_kw, values, theirs, inputs)
    with use_backend(backend_name):
        got_sums, got = _lifecycle_qparams(OKObserver, name, base_name, args_kw, values, ours, inputs)
    assert (got_sums is None) == (want_sums is None), f"{name}: importance gathered by one side only"
    if want_sums is not None:  # exact by construction of the inputs
        assert torch.equal(got_sums[0], want_sums[0]) and int(got_sums[1]) == int(want_sums[1]), name
    return got, want


@pytest.mark.parametrize("backend_name,name,args_name,dtype",
                         _registry_matrix(ALL_OBSERVER_NAMES, REGISTRY_WEIGHT_ARGS))
def test_registry_weight_qparams_equal_llmcompressor(forced, backend_name, name, args_name, dtype):
    weight = (torch.randn(40, 64, generator=torch.Generator().manual_seed(6))
              * torch.linspace(0.2, 3.0, 64)).to(dtype)
    got, want = _registry_run(backend_name, name, "weight", REGISTRY_WEIGHT_ARGS[args_name], [weight],
                              with_layer=True)
    _assert_same(got, want, f"obskernels' {name} vs llm-compressor's: weight {args_name} {dtype}")


@pytest.mark.parametrize("backend_name,name,args_name,dtype",
                         _registry_matrix(ACTIVATION_NAMES, REGISTRY_ACT_ARGS))
def test_registry_activation_qparams_equal_llmcompressor(forced, backend_name, name, args_name, dtype):
    gen = torch.Generator().manual_seed(7)
    values = [(torch.randn(2, 5, 64, generator=gen) * s).to(dtype) for s in (1.0, 3.0, 0.5)]
    got, want = _registry_run(backend_name, name, "input", REGISTRY_ACT_ARGS[args_name], values,
                              with_layer=False)
    _assert_same(got, want, f"obskernels' {name} vs llm-compressor's: input {args_name} {dtype}")


def test_registry_covers_every_name_llmcompressor_registers():
    """The nine names compared above are all that llm-compressor registers."""
    from compressed_tensors.registry import registry as ct_registry

    drop_in.disable()
    theirs = {k.replace("-", "_") for k in ct_registry._REGISTRY[LCObserver]}
    assert theirs == set(ALL_OBSERVER_NAMES)


def _imatrix_run(enable, args_kw, name="imatrix_mse"):
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 24, bias=False)
    (drop_in.enable if enable else drop_in.disable)()
    obs = LCObserver.load_from_registry(name, base_name="weight", args=QuantizationArgs(**args_kw))
    obs.attach(layer)
    # channels of very different energy, so that importance changes the choice
    scale = torch.logspace(-2, 1, 64)
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(2, 9, 64) * scale)
    importance = (obs._imatrix_sum.clone(), obs._imatrix_count.clone())
    obs(layer.weight)
    qparams = obs.get_qparams()
    obs.detach(layer)
    assert not layer._forward_pre_hooks, "detach must remove the E[x^2] hook"
    return importance, qparams


@pytest.mark.parametrize("args_name", ["int4-group16", "int8-channel", "nvfp4", "int4-group16-asym"])
@pytest.mark.parametrize("name", ["imatrix_mse", "nvfp4_expanded_imatrix"])
def test_imatrix_hooks_and_qparams_match(backend, name, args_name):
    kw = WEIGHT_ARGS[args_name]
    (want_sum, want_count), want = _imatrix_run(False, kw, name)
    (got_sum, got_count), got = _imatrix_run(True, kw, name)
    assert torch.equal(got_count, want_count)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=0)
    _assert_same(got, want, f"{name}/{args_name}")


def test_imatrix_hook_respects_disabled_hooks():
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    drop_in.enable(backend="reference")
    layer = torch.nn.Linear(16, 8)
    obs = LCObserver.load_from_registry("imatrix_mse", base_name="weight", args=QuantizationArgs(num_bits=4, strategy="channel"))
    obs.attach(layer)
    with HooksMixin.disable_hooks():
        layer(torch.randn(3, 16))
    assert int(obs._imatrix_count) == 0
    layer(torch.randn(3, 16))
    assert int(obs._imatrix_count) == 3


def _fused_qparams(enable):
    torch.manual_seed(2)
    (drop_in.enable if enable else drop_in.disable)()
    attn = torch.nn.Module()
    for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
        layer = torch.nn.Linear(32, 16, bias=False)
        with torch.no_grad():
            layer.weight.mul_(1.0 + i)  # v_proj holds the largest values
        obs = LCObserver.load_from_registry(
            "memoryless_mse", base_name="weight", args=QuantizationArgs(**WEIGHT_ARGS["nvfp4"])
        )
        layer.register_module("weight_observer", obs)
        attn.register_module(n, layer)
    fuse_weight_observers(attn)
    attn.q_proj.weight_observer(attn.q_proj.weight)  # q's forward observes k and v too
    observed = [getattr(attn, n).weight_observer.has_statistics for n in ("k_proj", "v_proj")]
    return observed, [getattr(attn, n).weight_observer.get_qparams()
                      for n in ("q_proj", "k_proj", "v_proj")]


def test_fused_global_scale_matches(backend):
    want_observed, want = _fused_qparams(False)
    got_observed, got = _fused_qparams(True)
    assert got_observed == want_observed == [True, True]  # llm-compressor's forward asks the group
    for g, w, n in zip(got, want, ("q", "k", "v")):
        _assert_same(g, w, f"fused {n}_proj")
    assert torch.equal(got[0]["global_scale"], got[2]["global_scale"])


def test_enable_disable_restore_registry():
    from compressed_tensors.registry import registry as ct_registry

    table = ct_registry._REGISTRY[LCObserver]
    before = dict(table)
    drop_in.enable()
    assert drop_in.is_enabled()
    for key in before:
        assert table[key] is not before[key], f"{key} was not adapted"
    drop_in.enable()  # idempotent
    drop_in.disable()
    assert not drop_in.is_enabled()
    assert table == before
    with drop_in.enabled(backend="reference"):
        obs = LCObserver.load_from_registry("minmax", base_name="input", args=QuantizationArgs())
        assert type(obs).__name__ == "ObsKernelsMinMaxObserver"
        assert isinstance(obs, llmcompressor.observers.MinMaxObserver)
    assert table == before
    with pytest.raises(ValueError, match="backend"):
        drop_in.enable(backend="cuda-please")
    assert table == before


def test_subclass_with_its_own_statistics_is_left_alone():
    from compressed_tensors.registry import registry as ct_registry

    @LCObserver.register("obskernels_test_custom")
    class Custom(llmcompressor.observers.MinMaxObserver):
        def update_statistics_from_observed(self, observed):
            self.min_vals, self.max_vals = observed.amin((0, -1)) * 2, observed.amax((0, -1)) * 2

    try:
        drop_in.enable()
        obs = LCObserver.load_from_registry("obskernels_test_custom", base_name="input", args=QuantizationArgs())
        assert type(obs) is Custom
    finally:
        drop_in.disable()
        del ct_registry._REGISTRY[LCObserver]["obskernels-test-custom"]


def test_fouroversix_alias_builds_the_adapter():
    drop_in.enable()
    with pytest.warns(UserWarning, match="fouroversix"):
        obs = LCObserver.load_from_registry(
            "fouroversix", base_name="weight", args=QuantizationArgs(**WEIGHT_ARGS["nvfp4"])
        )
    assert type(obs).__name__ == "ObsKernelsNVFP4ExpandedMSEObserver"
    assert obs.expand == 1.8


def test_drop_in_computes_through_obskernels_ops(monkeypatch):
    """The adapters call obskernels.ops (not llm-compressor's own math)."""
    from obskernels import ops

    calls = []
    real = ops.min_max
    monkeypatch.setattr(ops, "min_max", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    drop_in.enable(backend="reference")
    obs = LCObserver.load_from_registry("static_minmax", base_name="input", args=QuantizationArgs())
    obs(torch.randn(3, 8))
    assert calls == ["input"]


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("name,combining,c", [
    ("static_minmax", "min_max", None), ("minmax", "min_max", 0.01), ("mse", "combine_statistics", 0.01),
])
def test_held_statistics_combine_in_the_op(forced, backend_name, monkeypatch, name, combining, c):
    """From the second value on, a static / moving-average observer hands its
    held statistics to the op (min_max's epilogue; combine_statistics after the
    search) instead of combining them with llm-compressor's torch.min / lerp,
    extra torch ops (extra launches on a GPU) at every calibration forward.
    The op combines into the held tensors in place (no new statistics, no
    module attribute set per forward); a second round after get_qparams
    starts afresh. Both rounds give llm-compressor's qparams."""
    from obskernels import ops

    seen, inside = [], []
    for op in ("min_max", "combine_statistics"):
        real = getattr(ops, op)

        def spy(*a, _op=op, _real=real, **k):
            seen.append((_op, k.get("held") is not None, k.get("averaging_constant")))
            inside.append(_op)
            try:
                return _real(*a, **k)
            finally:
                inside.pop()

        monkeypatch.setattr(ops, op, spy)
    real_again = ops.Repeat.again

    def again(self, value, base_name, args, held, averaging_constant=None, *rest):
        # the remembered min_max made again without ops.min_max: combined in the op too
        result = real_again(self, value, base_name, args, held, averaging_constant, *rest)
        if result is not None and not inside:
            seen.append(("min_max", True, averaging_constant))
        return result

    monkeypatch.setattr(ops.Repeat, "again", again)
    values = [torch.randn(2, 5, 64) * s for s in (1.0, 3.0, 0.5)]
    kw = ACT_ARGS["int8-tensor"]
    want = _qparams(name, "input", kw, values, enable=False)
    seen.clear()
    again = _qparams(name, "input", kw, values[::-1], enable=False)
    seen.clear()
    drop_in.enable()
    obs = LCObserver.load_from_registry(name, base_name="input", args=QuantizationArgs(**copy.deepcopy(kw)))
    for round_values, expected in ((values, want), (values[::-1], again)):
        obs(round_values[0])
        held = (obs.min_vals, obs.max_vals)
        for v in round_values[1:]:
            obs(v)
            assert obs.min_vals is held[0] and obs.max_vals is held[1], "not combined in place"
        _assert_same(obs.get_qparams(), expected, f"{name} ({backend_name})")
    assert seen.count((combining, True, c)) == 4, seen


@pytest.mark.parametrize("backend_name", ["triton"])
@pytest.mark.parametrize("name", ["static_minmax", "minmax"])
def test_a_repeated_drop_in_forward_goes_straight_to_its_launch(forced, backend_name, monkeypatch,
                                                                 name):
    """From the second combining forward on (the same signature, the same
    statistics unchanged but by its kernel), the adapter hands the value to
    the remembered launch (``ops.Repeat.again``) before llm-compressor's
    checks and ``ops.min_max``: those ran, with these statistics, on the
    call remembered. The statistics are llm-compressor's own after every
    forward."""
    from obskernels import ops

    calls = []
    real = ops.min_max
    monkeypatch.setattr(ops, "min_max", lambda *a, **k: calls.append(k.get("held") is not None)
                        or real(*a, **k))
    kw = ACT_ARGS["fp8-tensor"]
    values = [torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(s)) * (s + 1)
              for s in range(5)]
    drop_in.disable()
    lc = LCObserver.load_from_registry(name, base_name="input", args=QuantizationArgs(**kw))
    drop_in.enable()
    obs = LCObserver.load_from_registry(name, base_name="input", args=QuantizationArgs(**kw))
    for i, v in enumerate(values):
        lc(v)
        obs(v)
        torch.testing.assert_close(obs.min_vals, lc.min_vals, rtol=0, atol=0)
        torch.testing.assert_close(obs.max_vals, lc.max_vals, rtol=0, atol=0)
    # the first value measured, the second combined and remembered, then none
    assert calls == [False, True], calls


@pytest.mark.parametrize("registered", [False, True], ids=["plain", "buffers"])
@pytest.mark.parametrize("name,base_name", [("memoryless_minmax", "weight"),
                                            ("static_minmax", "input"), ("minmax", "input")])
def test_drop_in_statistics_live_where_nn_module_puts_them(name, base_name, registered):
    """The adapter reads and writes the statistics in the instance dict only
    where nothing is registered on the observer; with min_vals / max_vals
    registered as buffers they stay buffers, read and written as
    llm-compressor's own observer does (nn.Module's attribute protocol)."""
    args = QuantizationArgs(**(WEIGHT_ARGS["int8-channel"] if base_name == "weight"
                               else ACT_ARGS["int8-tensor"]))
    values = [torch.randn(4, 64, generator=torch.Generator().manual_seed(s)) * (s + 1)
              for s in range(3)]
    if base_name != "weight":
        values = [v.reshape(2, 2, 64) for v in values]

    def observe(enable):
        (drop_in.enable if enable else drop_in.disable)()
        obs = LCObserver.load_from_registry(name, base_name=base_name, args=args)
        seen = [obs.has_statistics]
        if registered:  # float64: the values' statistics are combined by torch and set
            obs.register_buffer("min_vals", torch.full((1,), -1.0, dtype=torch.float64))
            obs.register_buffer("max_vals", torch.full((1,), 1.0, dtype=torch.float64))
        for v in values:
            obs(v)
            seen.append((obs.has_statistics, "min_vals" in obs.__dict__,
                         sorted(k for k, _ in obs.named_buffers()),
                         obs.min_vals.clone(), obs.max_vals.clone()))
        return seen

    want, got = observe(False), observe(True)
    assert got[0] == want[0] is False
    for i, (g, w) in enumerate(zip(got[1:], want[1:])):
        assert g[:3] == w[:3], (i, g[:3], w[:3])
        torch.testing.assert_close(g[3], w[3], rtol=0, atol=0)
        torch.testing.assert_close(g[4], w[4], rtol=0, atol=0)


def test_a_drop_in_observer_call_runs_every_hook_as_nn_module_does():
    """The adapter's call skips nn.Module.__call__'s frames only where no
    hook is registered: hooks of the observer and global hooks still run."""
    from helpers import assert_observer_call_runs_hooks

    args = QuantizationArgs(**ACT_ARGS["int8-tensor"])
    drop_in.disable()
    oracle = LCObserver.load_from_registry("static_minmax", base_name="input", args=args)
    drop_in.enable()
    obs = LCObserver.load_from_registry("static_minmax", base_name="input", args=args)
    assert "ObsKernels" in type(obs).__name__ and "ObsKernels" not in type(oracle).__name__
    assert_observer_call_runs_hooks(obs, oracle, torch.randn(3, 16))


@pytest.mark.parametrize("name,kw,shapes,dtypes,observer_kwargs", [
    # the held statistics' dtype differs: torch.min promotes
    ("static_minmax", ACT_ARGS["int8-tensor"], [(2, 5, 64)] * 2, [torch.float32, torch.bfloat16], {}),
    # an averaging constant outside [0, 1]: lerp extrapolates
    ("minmax", ACT_ARGS["int8-tensor"], [(2, 5, 64)] * 2, [torch.float32] * 2, {"averaging_constant": 2.0}),
    # statistics of another shape: torch.min's own error
    ("static_minmax", dict(num_bits=8, strategy="group", group_size=16), [(2, 5, 64), (2, 5, 32)],
     [torch.float32] * 2, {}),
    ("mse", dict(num_bits=8, strategy="group", group_size=16), [(2, 5, 64), (2, 5, 32)],
     [torch.float32] * 2, {}),
])
def test_held_statistics_the_op_does_not_combine_follow_llmcompressor(name, kw, shapes, dtypes, observer_kwargs):
    def outcome(enable):
        torch.manual_seed(4)
        values = [torch.randn(shape).to(dtype) for shape, dtype in zip(shapes, dtypes)]
        drop_in.enable(backend="reference") if enable else drop_in.disable()
        obs = LCObserver.load_from_registry(
            name, base_name="input", args=QuantizationArgs(**copy.deepcopy(kw)), **observer_kwargs
        )
        try:
            for v in values:
                obs(v)
        except Exception as exc:  # llm-compressor's own error, to be met alike
            return type(exc), str(exc)
        return obs.get_qparams()

    want, got = outcome(False), outcome(True)
    if isinstance(want, tuple):
        assert got == want
    else:
        _assert_same(got, want, name)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _tiny_tokenizer():
    """An in-memory word-level tokenizer: oneshot wants a processor, and nothing
    may be downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, 96)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _oneshot_state(enable, scheme, observer, config_dir):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe = QuantizationModifier(
        targets="Linear", scheme=scheme, ignore=["lm_head"], weight_observer=observer
    )
    return _oneshot_qparams(enable, _tiny_llama(), recipe, config_dir)


def _oneshot_qparams(enable, model, recipe, config_dir):
    """``model``'s qparam tensors after llm-compressor's ``oneshot`` with
    ``recipe`` on 4 random sequences, with the drop-in or without."""
    from datasets import Dataset
    from llmcompressor import oneshot

    # reference: under TRITON_INTERPRET=1, "auto" would run the kernels interpreted
    drop_in.enable(backend="reference") if enable else drop_in.disable()
    # oneshot re-reads the config from model.config.name_or_path: point it at a local copy
    model.config.save_pretrained(config_dir)
    model.config._name_or_path = str(config_dir)
    gen = torch.Generator().manual_seed(3)
    data = Dataset.from_dict(
        {"input_ids": [torch.randint(0, 96, (12,), generator=gen).tolist() for _ in range(4)]}
    )
    oneshot(
        model=model, processor=_tiny_tokenizer(), dataset=data, recipe=recipe,
        num_calibration_samples=4, pipeline="basic",
    )
    return {k: v.clone() for k, v in model.state_dict().items() if "scale" in k or "zero_point" in k}


@pytest.mark.parametrize(
    "scheme,observer",
    [("W4A16", "memoryless_mse"), ("NVFP4", "memoryless_minmax"), ("W8A8", "imatrix_mse")],
)
def test_oneshot_end_to_end_matches(scheme, observer, tmp_path, monkeypatch):
    from obskernels import ops

    calls = []
    for op in ("min_max", "mse_search", "min_max_qparams", "mse_search_qparams", "accumulate_sq"):
        real = getattr(ops, op)
        monkeypatch.setattr(ops, op, lambda *a, _op=op, _real=real, **k: calls.append(_op) or _real(*a, **k))
    want = _oneshot_state(False, scheme, observer, tmp_path)
    assert not calls, "llm-compressor alone must not reach obskernels"
    got = _oneshot_state(True, scheme, observer, tmp_path)
    # 14 quantized Linear layers: each weight went through obskernels, with
    # its qparams (W4A16's memoryless_mse; not NVFP4's global scale, taken
    # over the fusion group, nor imatrix's weighted search)
    expected_op = {"memoryless_mse": "mse_search_qparams", "memoryless_minmax": "min_max",
                   "imatrix_mse": "mse_search"}[observer]
    assert calls.count(expected_op) >= 14, sorted(set(calls))
    if observer == "imatrix_mse":
        assert "accumulate_sq" in calls
    assert want and got.keys() == want.keys()
    for key in want:
        _assert_same({"v": got[key]}, {"v": want[key]}, key)


def _moe_oneshot_state(enable, activation_observer, config_dir):
    """An MoE model's NVFP4 qparams after oneshot (4 experts, one layer):
    each expert's Linear layers see 2-D ``(tokens, hidden)`` inputs."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )).eval()
    nvfp4 = WEIGHT_ARGS["nvfp4"]
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**nvfp4, observer="memoryless_minmax"),
        input_activations=QuantizationArgs(**nvfp4, dynamic="local", observer=activation_observer),
    )
    recipe = QuantizationModifier(config_groups={"nvfp4": scheme}, ignore=["lm_head", "re:.*gate$"])
    return _oneshot_qparams(enable, model, recipe, config_dir)


def test_moe_oneshot_matches(tmp_path):
    # the moving average of the experts' 2-D inputs: llm-compressor groups
    # their tokens and hidden size together, and the global scale it stores
    # (input_global_scale) follows from that statistic (the drop-in gave
    # another for all 12 expert projections when it flattened them itself)
    want = _moe_oneshot_state(False, "minmax", tmp_path)
    got = _moe_oneshot_state(True, "minmax", tmp_path)
    assert sum("experts" in k and k.endswith("input_global_scale") for k in want) == 12
    assert got.keys() == want.keys()
    for key in want:
        _assert_same({"v": got[key]}, {"v": want[key]}, key)


def test_readme_oneshot_recipe_runs(tmp_path):
    """The README's offline oneshot recipe, as written, in this environment."""
    from helpers import python_snippets, run_snippet

    snippets = [s for s in python_snippets() if s.needs_llmcompressor]
    assert snippets, "the README lost its llm-compressor recipe"
    for snippet in snippets:
        done = run_snippet(snippet, tmp_path)
        assert done.returncode == 0, f"{snippet} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        assert "torch.Size([128, 1])" in done.stdout, done.stdout


@pytest.mark.parametrize("name", ("static_minmax", "minmax", "mse"))
def test_token_sequence_length_change_matches_llmcompressor(name):
    """TOKEN statistics are per sequence position: one position broadcasts
    against a longer sequence in llm-compressor, and obskernels' own
    observers give the same qparams; another change fails in both."""
    from obskernels import Observer

    kw = dict(num_bits=8, strategy="token", dynamic=True)
    values = [torch.randn(1, 1, 16), torch.randn(2, 5, 16)]
    want = _qparams(name, "input", kw, values, enable=False)
    ours = Observer.load_from_registry(name, base_name="input", args=QuantizationArgs(**kw))
    for v in values:
        ours(v)
    _assert_same(ours.get_qparams(), want, f"{name}: (1, 1, 16) then (2, 5, 16)")

    lc = LCObserver.load_from_registry(name, base_name="input", args=QuantizationArgs(**kw))
    lc(torch.randn(1, 5, 16))
    with pytest.raises(RuntimeError):  # torch's broadcasting error inside llm-compressor
        lc(torch.randn(1, 3, 16))
    ours = Observer.load_from_registry(name, base_name="input", args=QuantizationArgs(**kw))
    ours(torch.randn(1, 5, 16))
    with pytest.raises(ValueError, match="3 token positions"):
        ours(torch.randn(1, 3, 16))


def test_host_proxy_measures_the_drop_in_forward():
    """obskernels.bench.host's drop-in scenarios time llm-compressor's own
    observers computing through obskernels (their Python calls pinned, with
    room: the activation forward 20 measured, 25 through nn.Module's call and
    llm-compressor's checks, 56 before the in-place combination; the weight
    call 67, llm-compressor's construction and get_qparams included; the
    activation's call, its first forward split, 66), and
    leave the registry as they found it."""
    from obskernels.backends import triton_unavailable_reason
    from obskernels.bench import host

    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    drop_in.disable()
    budgets = {"drop-in activation forward": 25, "drop-in minmax call": 76,
               "drop-in activation call": 76}
    scenarios = [s for s in host.SCENARIOS if s.drop_in]
    assert sorted(s.name for s in scenarios) == sorted(budgets)
    rows = host.measure(scenarios, reps=3, warmup=2)
    assert [r["scenario"] for r in rows] == [s.name for s in scenarios]
    for row in rows:
        assert row["python_calls"] <= budgets[row["scenario"]], row
    assert not drop_in.is_enabled()


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_the_drop_in_leaves_the_collector_what_llmcompressor_leaves(name, backend_name, forced):
    """llm-compressor 0.14's observers are reference cycles (each holds a
    fusion handler that holds it), freed only by the cyclic garbage
    collector. An observer of the drop-in, built as llm-compressor builds
    one once the drop-in is enabled, observing and asked for its qparams,
    leaves the collector exactly what llm-compressor's own observer leaves
    (the oracle, the drop-in off), its class in place of llm-compressor's:
    the drop-in adds no cycle, so no tensor of its own waits for a
    collection. The triton backend's launches are stubbed: the
    interpreter's launch machinery leaves cycles of its own, which a GPU
    does not run."""
    from obskernels.bench import host

    from helpers import left_for_the_collector

    kw = WEIGHT_ARGS["nvfp4" if "nvfp4" in name else "int4-group16"]
    value = torch.randn(32, 64)

    def maker(enable):
        (drop_in.enable if enable else drop_in.disable)()
        cls = type(LCObserver.load_from_registry(name, base_name="weight",
                                                 args=QuantizationArgs(**copy.deepcopy(kw))))
        assert ("ObsKernels" in cls.__name__) == enable

        def call():
            obs = cls(base_name="weight", args=QuantizationArgs(**copy.deepcopy(kw)))
            obs(value)
            obs(value)
            obs.get_qparams()

        return cls, call

    base, plain = maker(enable=False)
    adapter, ours = maker(enable=True)
    with host.stubbed_launches():
        ours()  # the signature's plans, kept for the process
        theirs, left = left_for_the_collector(plain), left_for_the_collector(ours)
    assert base.__name__ in theirs, f"{name}: llm-compressor's observer left no cycle {theirs}"
    assert sorted(base.__name__ if t == adapter.__name__ else t for t in left) == theirs


def test_host_proxy_partners_are_llmcompressors_own_calls():
    """obskernels.bench.host times its min/max and MSE scenarios in turns
    after llm-compressor's own observer (the drop-in off) making the same
    call on a value of the scenario's shape, its rows cut to PARTNER_NUMEL
    elements where larger; an MSE observer's search on llm-compressor's
    Triton path (a GPU user's), its kernel stubbed for the call and restored
    after it; no partner for the drop-in, the hook, imatrix_mse."""
    from compressed_tensors.utils import impl_backend
    from llmcompressor.observers import Observer as registry
    import triton
    from llmcompressor.observers import mse_quant

    from obskernels.bench import host, hostcost

    drop_in.disable()
    made, searches = [], []
    real = registry.load_from_registry.__func__
    real_search = impl_backend.ImplBackend._backends["_grid_search_mse"]
    kernels = {name: fn for name, fn in vars(mse_quant).items()
               if isinstance(fn, triton.runtime.jit.KernelInterface)}  # jitted or interpreted
    assert kernels

    def load(cls, name, **kwargs):
        obs = real(cls, name, **kwargs)
        made.append((name, type(obs).__module__.split(".")[0]))
        return obs

    stub_launch = hostcost._Stub._launch

    def launch(self, *args, **kwargs):  # the partner's stub, launched
        searches.append(any(getattr(mse_quant, k) is self for k in kernels))
        stub_launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "load_from_registry", classmethod(load))
        mp.setattr(hostcost._Stub, "_launch", launch)
        for sc in host.SCENARIOS:
            partner = host._partner_of(sc)
            wanted = not (sc.drop_in or sc.hook or sc.observer == "imatrix_mse")
            assert (partner is not None) == wanted, sc.name
            if partner is None:
                continue
            call = inspect.getclosurevars(partner).nonlocals.get("call", partner)
            value = inspect.getclosurevars(call).nonlocals["value"]
            rows = host.PARTNER_NUMEL // sc.shape[-1]
            assert tuple(value.shape) == (sc.shape if math.prod(sc.shape) <= host.PARTNER_NUMEL
                                          else (rows, sc.shape[-1])), sc.name
            made.clear()
            searches.clear()
            out = partner()
            if sc.repeat:
                out = partner()  # its forward again, on the observer it made once
                assert made == [] and isinstance(out, torch.nn.Module)
            else:
                assert made == [(sc.observer, "llmcompressor")] and {"scale", "zero_point"} <= set(out)
            # a search launched llm-compressor's Triton kernel, stubbed; a min/max call nothing
            if "mse" in sc.observer:
                assert searches and all(searches), sc.name
            else:
                assert searches == [], sc.name
            assert all(getattr(mse_quant, k) is fn for k, fn in kernels.items())
            assert impl_backend.ImplBackend._backends["_grid_search_mse"] is real_search
    # the 4096x4096 scenario's partner works on 16 of its rows
    assert any(math.prod(sc.shape) > host.PARTNER_NUMEL for sc in host.SCENARIOS if host._partner_of(sc))
    assert not drop_in.is_enabled()


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf", "wide"])
@pytest.mark.parametrize("args_name", ["int8-channel", "int4-group16-asym", "nvfp4", "int8-tensor"])
@pytest.mark.parametrize("observer", ["memoryless_minmax", "memoryless_mse"])
def test_get_qparams_goes_through_ops_and_matches_llmcompressor(forced, backend_name, kind, args_name,
                                                                observer, monkeypatch):
    """The drop-in's get_qparams gives llm-compressor's own scale, zero
    point and global scale, non-finite and overflowing statistics included
    (no error: llm-compressor raises none), computed through ops: a weight's
    with its statistics in the observation (``min_max_qparams`` /
    ``mse_search_qparams`` without the widening, as compressed-tensors
    computes: on the triton backend in the measuring launch), TENSOR_GROUP's
    by ``calculate_qparams`` with llm-compressor's global scale."""
    from obskernels import ops

    value = torch.randn(8, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    big = torch.finfo(torch.bfloat16).max
    if kind == "nan":
        value[1, 3] = float("nan")
    elif kind == "inf":
        value[2, 5], value[3, 9] = float("inf"), float("-inf")
    elif kind == "wide":  # finite, but max - min overflows bf16
        value[0, 0], value[0, 1] = big, -big
    kw = WEIGHT_ARGS[args_name]
    want = _qparams(observer, "weight", kw, [value], enable=False)
    calls = []
    for op in ("calculate_qparams", "min_max_qparams", "mse_search_qparams"):
        real = getattr(ops, op)
        monkeypatch.setattr(ops, op, lambda *a, _op=op, _real=real, **k:
                            calls.append((_op, k.get("widen"))) or _real(*a, **k))
    got = _qparams(observer, "weight", kw, [value], enable=True)
    if args_name == "nvfp4":
        assert calls == [("calculate_qparams", None)], calls
    else:
        assert calls == [(observer.replace("memoryless_minmax", "min_max").replace(
            "memoryless_mse", "mse_search") + "_qparams", False)], calls
    _assert_same(got, want, f"get_qparams {observer} {args_name} {kind} ({backend_name})")
