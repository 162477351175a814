"""Records and statuses from pre-initialised chunks (``spec.record.StatusPool``):
CUDA's by default, every copy a clone with ``OBSKERNELS_STATUS_POOL=0``.

On the CPU the pool is checked on CPU templates (its chunks, their copies'
words, alignment and independence, the capture and stream rules), and an
observer's path through the kernels with every record and status taken
from a CPU pool is checked against the reference backend without one (bit
for bit, the same errors). On a GPU (``gpu``): CUDA's own pool against
clones, on the current stream and on a side stream, and a captured
``get_qparams`` whose replays count afresh.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from obskernels.backends import use_backend
from obskernels.bench.cases import SCHEMES, Case, make_value
from obskernels.observers import Observer
from obskernels.observers import report
from obskernels.spec import record
from obskernels.spec.record import POOL_SLOTS, STATUS_INIT, StatusPool

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _template(words=1):
    """A status template: the record, then ``words`` zeroed words."""
    return torch.tensor(STATUS_INIT + (0,) * words, dtype=torch.int64)


def _pool(unpooled=lambda device: False, stream=lambda device: 0):
    return StatusPool(unpooled, stream)


@pytest.mark.parametrize("words", [1, 2])  # 7 and 8 words: a row padded to 16 bytes, and not
def test_a_pool_hands_out_fresh_aligned_copies_a_chunk_at_a_time(words):
    template = _template(words)
    pool = _pool()
    got = [pool.take(template) for _ in range(2 * POOL_SLOTS + 1)]
    assert all(g.tolist() == template.tolist() for g in got)
    assert all(g.shape == template.shape and g.dtype == template.dtype and g.is_contiguous() for g in got)
    assert len({g.data_ptr() for g in got}) == len(got)
    assert all(g.data_ptr() % 16 == 0 for g in got)  # as an allocation: a launch specialises alike
    assert len({g.untyped_storage().data_ptr() for g in got}) == 3  # a chunk per POOL_SLOTS copies
    got[0].add_(5)  # a launch counting into one copy
    got[-1][0] = 9
    assert got[1].tolist() == template.tolist() and got[-2].tolist() == template.tolist()
    assert template.tolist() == list(STATUS_INIT) + [0] * words


def test_a_pool_clones_where_a_copy_must_be_made_in_place():
    """Where the stream captures a graph (a replay must initialise the copy
    again), a clone of its own, no chunk."""
    template = _template()
    pool = _pool(unpooled=lambda device: True)
    got = pool.take(template)
    assert got.tolist() == template.tolist()
    assert got.untyped_storage().nbytes() == template.untyped_storage().nbytes()
    assert not pool._chunks


def test_a_pool_keeps_a_chunk_per_stream_and_template():
    template, other = _template(), _template(3)
    stream = [1]
    pool = _pool(stream=lambda device: stream[0])
    first = pool.take(template)
    stream[0] = 2
    second = pool.take(template)
    stream[0] = 1
    third = pool.take(template)
    fourth = pool.take(other)
    chunk = first.untyped_storage().data_ptr
    assert second.untyped_storage().data_ptr() != chunk()
    assert third.untyped_storage().data_ptr() == chunk()
    assert fourth.untyped_storage().data_ptr() not in (chunk(), second.untyped_storage().data_ptr())
    assert fourth.tolist() == other.tolist()


def test_a_pool_does_not_hand_out_another_templates_copies():
    """A chunk is kept under its template's id; a new template that takes
    the id of one gone gets copies of its own words."""
    old, new = _template(), torch.tensor((1, 2, 3, 4, 5, 6, 7), dtype=torch.int64)
    pool = _pool()
    pool._chunks[(id(new), 0)] = (old, [old.clone()])  # as if ``old`` had had new's id
    assert pool.take(new).tolist() == new.tolist()


def test_a_long_template_takes_a_chunk_of_its_own_per_copy():
    template = torch.zeros(record.POOL_CHUNK_BYTES // 8 + 1, dtype=torch.int64)
    pool = _pool()
    a, b = pool.take(template), pool.take(template)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() <= template.untyped_storage().nbytes() + 16


def test_fresh_copy_clones_without_a_pool(monkeypatch):
    """Off, every copy is a clone; on, a device type without a pool (the
    CPU) still clones."""
    template = _template()
    for enabled in (False, True):
        monkeypatch.setattr(record, "POOL_ENABLED", enabled)
        got = record.fresh_copy(template)
        assert got.tolist() == template.tolist()
        assert got.untyped_storage().data_ptr() != template.untyped_storage().data_ptr()
        assert got.untyped_storage().nbytes() == template.untyped_storage().nbytes()


def test_zeroed_tickets_come_in_powers_of_two_kept_once():
    """A split's zeroed tickets: at least one per block, as many as the next
    power of two, so that a handful of kept templates serve blocks counts
    that follow a varying token count."""
    sizes = {n: record.zero_tickets(n, "cpu") for n in (1, 2, 3, 4, 5, 8, 9, 1000)}
    assert {n: t.numel() for n, t in sizes.items()} == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16,
                                                        1000: 1024}
    assert sizes[3] is sizes[4] and sizes[5] is sizes[8] is record.zero_tickets(7, "cpu")
    assert all(t.dtype == torch.int64 and not t.any() for t in sizes.values())


@pytest.mark.skipif(not INTERPRETER, reason="the triton backend takes CPU tensors under TRITON_INTERPRET=1")
def test_templates_outlive_the_launch_plans_that_copy_them(monkeypatch, pin_launch):
    """A CUDA graph that captured a copy of a template (``fresh_copy`` clones
    while a stream captures) reads the template again at every replay, so
    the templates are kept for the process, not by the launch plans, which
    get dropped (ops' plans start afresh past their limit, a launch_config
    block prepares anew): a split min_max's zeroed tickets and a first
    observation's status alike, the same objects for plans made again."""
    import gc
    import importlib
    import weakref

    from compressed_tensors.quantization import QuantizationArgs

    from obskernels import ops

    copied = []
    for name in ("min_max", "qparams"):
        module = importlib.import_module(f"obskernels.kernels.{name}")

        def copy(template, _fresh_copy=module.fresh_copy):
            copied.append(template)
            return _fresh_copy(template)

        monkeypatch.setattr(module, "fresh_copy", copy)
    pin_launch("min_max", split=4, min_elems_per_program=1)
    monkeypatch.setattr(ops, "_PLANS", {})
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    value = torch.randn(64, 1024)[:, :512]  # rows (a contiguous value is one row: no split)

    def templates():
        ops._PLANS.clear()
        copied.clear()
        with use_backend("triton"):
            ops.min_max(value, "input", args)
            ops.min_max_qparams(value, "input", args, record=True)
        return list(copied)

    first = templates()
    assert [t.numel() for t in first] == [1, len(STATUS_INIT) + 2], first  # a ticket; status, flag, ticket
    kept = [weakref.ref(t) for t in first]
    del first
    gc.collect()
    again = templates()
    assert all(ref() is not None for ref in kept), "a template went with its plan"
    assert all(ref() is t for ref, t in zip(kept, again)), "plans made again copy other templates"


@pytest.mark.parametrize("fast", [True, False])
def test_a_cuda_copy_is_pooled_on_the_current_device_outside_a_capture(monkeypatch, fast):
    """``_cuda_unpooled`` on torch's C functions where torch has them, else
    on ``torch.cuda``'s (faked here: the device current, the capture)."""
    state = {"device": 1, "capturing": False}
    if fast:
        monkeypatch.setattr(record, "_CURRENT_DEVICE", lambda: state["device"])
        monkeypatch.setattr(record, "_CAPTURING", lambda: state["capturing"])
    else:
        monkeypatch.setattr(record, "_CURRENT_DEVICE", None)
        monkeypatch.setattr(record, "_CAPTURING", None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    device = torch.device("cuda", 1)
    assert record.current_cuda_device() == 1
    assert not record._cuda_unpooled(device)
    state["capturing"] = True
    assert record._cuda_unpooled(device)
    state["capturing"], state["device"] = False, 0
    assert record.current_cuda_device() == 0
    assert record._cuda_unpooled(device)


@pytest.mark.parametrize("env,enabled", [(None, True), ("0", False), ("1", True)])
def test_the_pool_is_on_unless_switched_off(env, enabled):
    """``POOL_ENABLED`` as a fresh process reads OBSKERNELS_STATUS_POOL at import."""
    environ = {k: v for k, v in os.environ.items() if k != "OBSKERNELS_STATUS_POOL"}
    if env is not None:
        environ["OBSKERNELS_STATUS_POOL"] = env
    out = subprocess.run([sys.executable, "-c", "import obskernels.spec.record as r; print(r.POOL_ENABLED)"],
                         env=environ, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(enabled)


# observers whose records and statuses come from a template: a weight's first
# observation with its qparams (TENSOR_GROUP's two launches among them), an
# activation's record with a split reduction's tickets, the search
OBSERVED = [
    ("memoryless_minmax", "weight", (8, 256), "int4-group128"),
    ("memoryless_minmax", "weight", (8, 64), "nvfp4-tg16"),
    ("static_minmax", "weight", (8, 256), "int8-channel"),
    ("static_minmax", "activation", (4, 64, 256), "fp8-tensor-act"),
    ("static_minmax", "activation", (16, 64), "nvfp4-tg16-act"),
    ("memoryless_mse", "weight", (8, 256), "int4-group128"),
]


def _observe(name, kind, shape, scheme, poison=False, device="cpu"):
    """The observer's qparams after two observations of an activation (one
    of a weight) on ``device``, or the ValueError its get_qparams raises."""
    case = Case(kind, shape, "bf16", scheme)
    value = make_value(case, device=device)
    if poison:
        value = value.clone()
        value.view(-1)[3] = float("nan")
    obs = Observer.load_from_registry(name, base_name=case.base_name, args=SCHEMES[scheme].qargs())
    for _ in range(2 if kind == "activation" else 1):
        obs(value)
    try:
        return {k: v.clone() for k, v in obs.get_qparams().items() if v is not None}
    except ValueError as exc:
        return str(exc)


@pytest.mark.kernel
@pytest.mark.skipif(not INTERPRETER, reason="the kernels run in triton's interpreter here")
@pytest.mark.parametrize("name,kind,shape,scheme", OBSERVED)
def test_observers_counting_into_pooled_copies_agree_with_the_reference(monkeypatch, name, kind,
                                                                       shape, scheme):
    """Every record and status of the triton backend's path taken from a
    pool (a CPU one here: CUDA's rules, its chunks on the CPU): the qparams
    and the non-finite error of the reference backend without a pool, call
    after call (a copy counted into twice would count a NaN twice, or raise
    for a clean value after a poisoned one)."""
    pytest.importorskip("triton")
    want = {}
    for poison in (False, True):
        with use_backend("reference"):
            want[poison] = _observe(name, kind, shape, scheme, poison)
    pool = _pool()
    taken = []

    def take(template):
        taken.append(template.numel())
        return StatusPool.take(pool, template)

    monkeypatch.setattr(pool, "take", take)
    monkeypatch.setattr(record, "_POOLS", {False: pool})  # the pool of tensors not on CUDA
    monkeypatch.setattr(record, "POOL_ENABLED", True)
    for poison in (False, True, True, False):
        with use_backend("triton"):
            got = _observe(name, kind, shape, scheme, poison)
        if poison:
            assert isinstance(want[poison], str) and got == want[poison]
        else:
            assert not isinstance(got, str), got
            assert got.keys() == want[poison].keys()
            for key in got:
                assert got[key].dtype == want[poison][key].dtype, key
                assert torch.equal(got[key].view(torch.uint8), want[poison][key].view(torch.uint8)), key
    assert taken, "no record or status was taken from the pool"


# --------------------------------------------------------------------------- #
# on a GPU
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,kind,shape,scheme", OBSERVED)
def test_cuda_pool_agrees_with_clones(monkeypatch, name, kind, shape, scheme):
    """CUDA's pool, on the current stream and on a side stream: the qparams
    and errors of every record and status cloned (the pool off)."""
    def run(poison):
        return _observe(name, kind, shape, scheme, poison, device="cuda")

    monkeypatch.setattr(record, "POOL_ENABLED", False)
    want = {poison: run(poison) for poison in (False, True)}
    monkeypatch.setattr(record, "POOL_ENABLED", True)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for _ in range(3):  # copies of one chunk, one after another
                for poison in (False, True):
                    got = run(poison)
                    if poison:
                        assert got == want[poison]
                    else:
                        assert got.keys() == want[poison].keys()
                        for key in got:
                            assert torch.equal(got[key].view(torch.uint8), want[poison][key].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_first_observation_starts_from_a_fresh_status_at_every_replay(monkeypatch):
    """With the pool on (the default), a weight observer's first observation (its qparams
    computed with it) captured in a CUDA graph (``nonfinite="propagate"``):
    the status it writes is made in the graph (a clone, not a pooled copy
    initialised once at capture), so a replay over a value with an infinite
    element flags its scale and the next replay over a finite value does
    not, and that replay's qparams are the eager call's."""
    monkeypatch.setattr(record, "POOL_ENABLED", True)
    case = Case("weight", (64, 256), "bf16", "int4-group128")
    clean = make_value(case, device="cuda")
    bad = clean.clone()
    bad.view(-1)[5] = float("inf")
    args = SCHEMES["int4-group128"].qargs()

    def observe(value):
        obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args,
                                          nonfinite="propagate")
        obs(value)
        return obs

    eager = observe(clean).get_qparams()
    static = clean.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        observe(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        obs = observe(static)
    scale, zero_point, _, status = obs._ahead.qparams
    flags = []
    for value in (bad, clean, bad, clean):
        static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        flags.append(report.read_status(status)[1])
    assert flags == [True, False, True, False]
    assert torch.equal(scale, eager["scale"]) and torch.equal(zero_point, eager["zero_point"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_split_replays_after_its_plans_are_dropped(monkeypatch, pin_launch):
    """A whole-tensor min_max split across programs, captured with no tickets
    kept (``ops.min_max`` itself: its zeroed tickets cloned in the graph from
    their template), replayed after the launch plans were dropped and the
    memory they held was handed out again and written: the template the
    graph copies is kept for the process, so every replay's statistics are
    the reference's for the value copied in."""
    import gc

    from compressed_tensors.quantization import QuantizationArgs

    from obskernels import ops

    pin_launch("min_max", split=64)
    monkeypatch.setattr(ops, "_PLANS", {})
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    gen = torch.Generator().manual_seed(4)
    values = [(torch.randn(2048, 4096, generator=gen) * (1 + i)).to(torch.bfloat16).cuda()
              for i in range(3)]
    static = values[0].clone()
    with use_backend("triton"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops.min_max(static, "input", args)  # planned, compiled
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mins, maxs = ops.min_max(static, "input", args)
    ops._PLANS.clear()
    gc.collect()
    handed_out = [torch.full((1 << 14,), 7, dtype=torch.int64, device="cuda") for _ in range(256)]
    for value in values:
        static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        with use_backend("reference"):
            want = ops.min_max(value, "input", args)
        assert torch.equal(mins, want[0]) and torch.equal(maxs, want[1])
    del handed_out
