"""The benchmark harness: its traffic counters, its model and a tiny end-to-end run.

The counters are checked against byte counts worked out by hand for a known
Triton kernel and a known sequence of aten ops, not against themselves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import torch

from obskernels.bench import cases as bench_cases
from obskernels.bench.model import GpuModel, affine_extrapolate, compulsory_bytes
from obskernels.bench.runner import REQUIRED_KEYS, Options, count_call, model_counts, run
from obskernels.bench.traffic import AtenTraffic, count_traffic, dense_bytes

from helpers import compile_pythons, compiled_row, python_id

WORKER = os.path.join(os.path.dirname(__file__), "traffic_worker.py")

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(
    not (INTERPRETER and HAS_TRITON),
    reason="Triton counts are taken in triton's interpreter (TRITON_INTERPRET=1, no CUDA)",
)

if HAS_TRITON:
    import triton

    # defined at a module's top level: triton 3.7's interpreter cannot rewrite
    # a kernel defined in an indented block
    from counter_kernels import _even_lanes, _masked_copy


# ------------------------------------------------------------------ Triton counter


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.parametrize(
    "n, block, dtype, stride",
    [(100, 32, torch.float32, 1), (17, 16, torch.bfloat16, 1), (64, 64, torch.float16, 3)],
)
def test_triton_counter_masked_copy(n, block, dtype, stride):
    src = torch.randn(n * stride).to(dtype)
    dst = torch.zeros(n, dtype=dtype)
    with count_traffic("cpu", triton=True) as c:
        _masked_copy[(triton.cdiv(n, block),)](src, dst, n, stride, BLOCK=block)
    assert torch.equal(dst, src[::stride])
    size = torch.tensor([], dtype=dtype).element_size()
    # masked lanes of the last program are not counted
    assert (c.bytes_read, c.bytes_written) == (n * size, n * size)
    assert (c.launches, c.triton_launches, c.triton_programs) == (1, 1, triton.cdiv(n, block))
    # the interpreter's own host copies are not aten launches of the call
    assert c.aten_ops == 0
    assert c.triton_unique_bytes == 2 * n * size


@needs_interpreter
@pytest.mark.kernel
def test_triton_counter_counts_only_live_lanes():
    src, dst = torch.randn(64), torch.zeros(64)
    with count_traffic("cpu", triton=True) as c:
        _even_lanes[(1,)](src, dst, BLOCK=64)
        _even_lanes[(1,)](src, dst, BLOCK=64)
    assert (c.bytes_read, c.bytes_written, c.launches) == (2 * 32 * 4, 2 * 32 * 4, 2)
    assert c.flops > 0  # the interpreter's arithmetic lanes are counted


@pytest.mark.kernel
@pytest.mark.parametrize("python", compile_pythons(), ids=python_id)
def test_triton_counter_under_every_triton(python):
    """The counter hooks the interpreter's builder, whose load and store
    signatures differ between releases (3.9: one cache policy; 3.6-3.8: a
    cache modifier and an eviction policy): the same counts, worked out by
    hand, under each triton of the compile matrix."""
    row = compiled_row(python, WORKER, timeout=600, TRITON_INTERPRET="1")
    # 100 fp32 lanes live of 4 programs of 32
    assert row["copy"] == [400, 400, 1, 4] and row["copied"], row
    assert row["restored"], row
    from obskernels.backends import interpreter_unfit_reason

    if interpreter_unfit_reason(row["triton"], row["numpy"]):
        # triton 3.6's interpreter turns a loop bound into an int as numpy 2.4
        # refuses: the backend says so, where the kernel would fail inside
        assert "numpy 2.4" in row["unavailable"] and "triton 3.7" in row["unavailable"], row
        return
    # 48 x 272 bf16 read once, one bf16 min and max per row written, one launch
    assert row["min_max"] == [48 * 272 * 2, 2 * 48 * 2, 1, 0] and row["statistics"], row


@needs_interpreter
def test_triton_counter_restores_the_interpreter():
    from triton.runtime import interpreter as ti

    owners = (ti.InterpreterBuilder, ti.GridExecutor, ti.ReduceScanOpInterface)
    before = [dict(o.__dict__) for o in owners]
    with count_traffic("cpu", triton=True):
        assert ti.InterpreterBuilder.__dict__["create_masked_load"] is not before[0]["create_masked_load"]
        assert ti.InterpreterBuilder.__dict__["binary_op"] is not before[0]["binary_op"]
        assert ti.GridExecutor.__dict__["__call__"] is not before[1]["__call__"]
    after = [dict(o.__dict__) for o in owners]
    for o, b, a in zip(owners, before, after):
        changed = sorted(k for k in set(b) | set(a) if b.get(k) is not a.get(k))
        assert not changed, f"{o.__name__}: not restored: {changed}"


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.parametrize(
    "shape, scheme, groups_per_row",
    [((64, 256), "int4-group128", 2), ((48, 272), "int8-channel", 1)],
)
def test_triton_min_max_bytes_by_hand(shape, scheme, groups_per_row):
    """obskernels' min_max kernel reads every bf16 element once (rows x cols x 2
    bytes) and writes one bf16 min and one bf16 max per group, in one launch."""
    from obskernels import ops
    from obskernels.backends import triton_unavailable_reason, use_backend

    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    rows, cols = shape
    value = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    args = bench_cases.SCHEMES[scheme].qargs()
    with use_backend("triton"), count_traffic("cpu", triton=True) as c:
        mins, maxs = ops.min_max(value, "weight", args)
    groups = rows * groups_per_row
    assert mins.numel() == maxs.numel() == groups
    assert c.bytes_read == rows * cols * 2, c.bytes_read
    assert c.bytes_written == 2 * groups * 2, c.bytes_written
    assert (c.launches, c.triton_launches, c.aten_ops) == (1, 1, 0), c.op_names
    # every byte touched is distinct: the lower bound equals the count
    assert c.triton_unique_bytes == rows * cols * 2 + 2 * groups * 2


# -------------------------------------------------------------------- aten counter


def test_aten_counter_known_sequence():
    x = torch.randn(10, 20)  # exists before counting: not part of the peak
    with AtenTraffic("cpu") as mode:
        a = x * 2  # read 800, write 800
        v = a.t()  # a view: no launch, no bytes
        b = v.sum(1)  # read 800, write 80
        m = b.max()  # read 80, write 4
        m.item()  # read 4 (a device -> host sync)
    c = mode.counts
    assert c.op_names == {"mul": 1, "sum": 1, "max": 1, "_local_scalar_dense": 1}
    assert (c.bytes_read, c.bytes_written) == (800 + 800 + 80 + 4, 800 + 80 + 4)
    assert (c.launches, c.aten_ops, c.syncs) == (4, 4, 1)
    assert c.peak_bytes == 800 + 80 + 4


def test_aten_counter_broadcast_inputs_and_write_only_destinations():
    row = torch.randn(1, 256)
    wide = row.expand(64, 256)  # stride 0: reads 1 KiB, not 64 KiB
    assert dense_bytes(wide) == 256 * 4
    dst = torch.empty(64, 256)
    with AtenTraffic("cpu") as mode:
        dst.copy_(wide)  # the destination is written, not read
        dst.fill_(0.0)
    c = mode.counts
    assert c.bytes_read == 256 * 4
    assert c.bytes_written == 2 * 64 * 256 * 4
    assert c.launches == 2


def test_aten_counter_peak_tracks_frees():
    x = torch.randn(1000)
    with AtenTraffic("cpu") as mode:
        for _ in range(3):
            y = x + 1  # 4000 bytes live, the previous y freed on reassignment
            del y
    assert mode.counts.peak_bytes == 4000


# --------------------------------------------------------------------------- model


def test_issue_efficiency_from_occupancy():
    from obskernels.bench.model import issue_efficiency

    # 153 registers x 8 warps: one block per SM, 2 warps per scheduler (ncu: 45 % busy)
    assert issue_efficiency(153, 8) == pytest.approx(2 / 4.5)
    # 75 registers x 8 warps: 3 blocks, 6 warps per scheduler: the plateau,
    # llm-compressor's search at 12 warps per scheduler (ncu: 92 % busy)
    assert issue_efficiency(75, 8) == pytest.approx(0.92)
    assert issue_efficiency(32, 4) == pytest.approx(0.92)  # 16 blocks, 16 warps per scheduler
    assert issue_efficiency(255, 16) == pytest.approx(4 / 4.5)  # one block of 16 warps


def test_overlap_model_hand_computed():
    from obskernels.bench.model import overlap_model

    gpu = GpuModel("test", bandwidth=1e12, fp32_flops=1e13, aten_op_s=5e-6, triton_launch_s=7e-6,
                   host_unit_s=2e-6, sync_s=20e-6)
    # two memory-bound eager ops (1 ms, 2 ms) and one Triton launch: 4e6 bytes (4 us)
    # against 3 ms of SASS issue time
    per_launch = [["aten", "a", 1e9, 1e6], ["aten", "b", 2e9, 1e6], ["triton", "k", 4e6, 1e9]]
    m = overlap_model(per_launch, 1, gpu, [3e-3])
    assert m["gpu_s"] == pytest.approx(1e-3 + 2e-3 + 3e-3)
    assert m["host_s"] == pytest.approx(2 * 5e-6 + 7e-6) and m["before_s"] == 0
    assert m["modelled_s"] == pytest.approx(6e-3 + 20e-6)
    assert m["compute"] == "sass" and m["bound"] == "memory"
    # without SASS the Triton launch falls back to lanes: max(4 us, 100 us)
    m = overlap_model(per_launch, 0, gpu)
    assert m["gpu_s"] == pytest.approx(3e-3 + 1e-4) and m["compute"] == "lanes"
    # many tiny launches: the host issue time wins, it does not add to the GPU time
    tiny = [["aten", "t", 1e3, 1e3]] * 100
    m = overlap_model(tiny, 0, gpu)
    assert m["modelled_s"] == pytest.approx(100 * 5e-6) and m["bound"] == "host"
    # a measured host path: 300 units x 2 us + 1 launch x 7 us; the GPU starts after
    # the host's first 100 units (+ the launch's issue) and runs 3 ms
    host = {"units": 300.0, "before_units": 100.0, "aten_ops": 2}
    one = [["aten", "a", 1e3, 1e3], ["aten", "b", 1e3, 1e3], ["triton", "k", 0, 0]]
    m = overlap_model(one, 0, gpu, [3e-3], host)
    assert m["host_s"] == pytest.approx(600e-6 + 7e-6) and m["before_s"] == pytest.approx(207e-6)
    assert m["modelled_s"] == pytest.approx(207e-6 + 3e-3 + 2e-9) and m["bound"] == "compute"
    # a PyTorch path measured with 2 ops but 10 ops at the modelled shape: 5x the host
    m = overlap_model([["aten", "a", 1e3, 1e3]] * 10, 0, gpu, host=host)
    assert m["host_s"] == pytest.approx(5 * 600e-6) and m["bound"] == "host"
    # a read (one sync) after the launch, the host's last 50 units after it: the
    # read waits for the GPU, those units come after both
    read = dict(host, after_units=50.0)
    m = overlap_model(one, 1, gpu, [3e-3], read)
    assert m["after_s"] == pytest.approx(100e-6) and m["sync_s"] == pytest.approx(20e-6)
    assert m["modelled_s"] == pytest.approx(207e-6 + 3e-3 + 2e-9 + 20e-6 + 100e-6)
    # host-bound: the host until the read, then the sync and the rest
    m = overlap_model(one, 1, gpu, [1e-6], read)
    assert m["modelled_s"] == pytest.approx(607e-6 - 100e-6 + 20e-6 + 100e-6) and m["bound"] == "host"
    # no sync counted: nothing waits, the host after it overlaps like the rest
    m = overlap_model(one, 0, gpu, [3e-3], read)
    assert m["after_s"] == 0 and m["modelled_s"] == pytest.approx(207e-6 + 3e-3 + 2e-9)


@needs_interpreter
def test_host_path_is_measured_with_the_launches_stubbed():
    from obskernels.bench import hostcost
    from obskernels.tools.kernel_report.launches import discover_kernels

    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    obs = bench_cases.OBSERVERS["memoryless_minmax"]
    tri = hostcost.measure(case, obs, "triton", max_reps=8, budget_s=0.05)
    # measured at the smallest shape with the group structure; the GPU would
    # start at the first launch, after the host built and checked the call
    assert tri["shape"] == [2, 256] and tri["units"] > tri["before_units"] > 0
    # get_qparams reads the status after the launch; the rest of the call follows it
    assert tri["units"] - tri["before_units"] > tri["after_units"] > 0
    assert "stubbed" in tri["method"] and tri["unit_us"] > 0
    # a PyTorch path: no launch to wait for, its aten ops counted
    ref = hostcost.measure(case, obs, "reference", max_reps=8, budget_s=0.05)
    assert ref["before_units"] is None and ref["after_units"] is None
    assert ref["aten_ops"] > tri["aten_ops"]
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the counters' hooks undone
    assert torch.Tensor.numpy is torch._C.TensorBase.numpy
    # the kernels are themselves again afterwards
    assert not any(isinstance(getattr(m, a), hostcost._Stub) for m, a in discover_kernels().values())


def test_a_host_path_takes_the_quietest_of_its_rounds():
    """hostcost.quietest: the fastest call in microseconds over the fastest
    unit, not the record with the fewest units (a unit timed under load)."""
    from obskernels.bench import hostcost

    def rec(units, unit_us, reps=4):
        return {"units": units, "unit_us": unit_us, "before_units": units / 2,
                "after_units": units / 10, "aten_ops": 2, "shape": [2, 256], "reps": reps,
                "method": "m"}

    got = hostcost.quietest([rec(10.0, 2.5), rec(14.0, 2.0), rec(5.0, 6.0)])  # 25, 28, 30 us
    assert got["unit_us"] == 2.0 and got["units"] == pytest.approx(12.5)  # 25 us / 2 us
    assert got["before_units"] == pytest.approx(6.25) and got["after_units"] == pytest.approx(1.25)
    assert got["reps"] == 12 and "fastest of 12 calls in 3 rounds" in got["method"]


def test_host_paths_go_in_rounds_over_every_path(monkeypatch):
    """The model's host paths are measured in HOST_ROUNDS rounds over all
    of them in turn, each path once per scheme, one that cannot be measured
    left out after its first try."""
    from obskernels.bench import hostcost, runner

    order = []

    def measure(case, target, backend, budget_s, partner):
        assert budget_s == runner.HOST_BUDGET_S
        assert partner is None  # llm-compressor's backends cannot run: measured alone
        order.append((case.scheme, backend))
        if backend == "reference":
            raise ValueError("n/a")
        return {"units": 10.0 + len(order), "unit_us": 2.0, "before_units": 1.0,
                "after_units": None, "aten_ops": 0, "shape": [2, 256], "reps": 3, "method": "m"}

    monkeypatch.setattr(hostcost, "measure", measure)
    obs = bench_cases.OBSERVERS["memoryless_minmax"]
    a = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    b = bench_cases.Case("weight", (16, 256), "bf16", "int8-channel", (4096, 4096))
    a_full = dataclasses.replace(a, shape=(4096, 4096))  # the same scheme: measured once
    plan = [(a, obs, "triton"), (b, obs, "triton"), (a_full, obs, "triton"), (a, obs, "reference")]
    opts = Options(model=True, host=True, progress=None)
    monkeypatch.setattr(runner, "backend_unavailable_reason", lambda backend, device: "not here")
    got = runner._host_paths(plan, {"triton": None, "reference": None}, opts)
    assert order == [("int4-group128", "triton"), ("int8-channel", "triton"),
                     ("int4-group128", "reference")] + [("int4-group128", "triton"),
                                                        ("int8-channel", "triton")] * 2
    assert set(got) == {(a, obs, "triton"), (b, obs, "triton"), (a_full, obs, "triton")}
    assert got[(a, obs, "triton")]["units"] == 11.0 and got[(a, obs, "triton")]["reps"] == 9


def test_host_paths_take_turns_with_the_other_library_where_it_runs(monkeypatch):
    """Where llm-compressor can run, each host path is measured after a call
    of the other library's path for the same observer: its Triton search
    where it has one, else its eager body, for obskernels' paths; obskernels'
    triton backend for llm-compressor's. ``--host-alone``: none."""
    from obskernels.bench import hostcost, runner

    seen = {}

    def measure(case, target, backend, budget_s, partner):
        seen[(target.label, backend)] = partner
        return {"units": 10.0, "unit_us": 2.0, "before_units": None, "after_units": None,
                "aten_ops": 0, "shape": [2, 256], "reps": 3, "partner": partner, "method": "m"}

    monkeypatch.setattr(hostcost, "measure", measure)
    monkeypatch.setattr(runner, "backend_unavailable_reason", lambda backend, device: None)
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    minmax, mse = bench_cases.OBSERVERS["memoryless_minmax"], bench_cases.OBSERVERS["memoryless_mse"]
    plan = [(case, t, b) for t in (minmax, mse) for b in ("triton", "reference", "llmc-eager", "llmc-triton")]
    available = dict.fromkeys(("triton", "reference", "llmc-eager", "llmc-triton"))
    runner._host_paths(plan, available, Options(model=True, host=True, host_turns=False, progress=None))
    assert set(seen) == {(t.label, b) for _, t, b in plan} and set(seen.values()) == {None}  # --host-alone
    seen.clear()
    runner._host_paths(plan, available, Options(model=True, host=True, progress=None))
    assert seen == {
        (minmax.label, "triton"): "llmc-eager", (minmax.label, "reference"): "llmc-eager",
        (minmax.label, "llmc-eager"): "triton", (minmax.label, "llmc-triton"): "triton",
        (mse.label, "triton"): "llmc-triton", (mse.label, "reference"): "llmc-triton",
        (mse.label, "llmc-eager"): "triton", (mse.label, "llmc-triton"): "triton",
    }


@needs_interpreter
def test_host_alone_reaches_the_runner(monkeypatch):
    """``--host-alone`` turns the host term's turns off; without it they are on."""
    from obskernels.bench import __main__ as cli, runner

    class Stop(Exception):
        pass

    got = []

    def run(opts):
        got.append(opts.host_turns)
        raise Stop

    monkeypatch.setattr(runner, "run", run)
    keep = ["--device", "cpu", "--tiny", "--quiet", "--threads", str(torch.get_num_threads())]
    for flags in ([], ["--host-alone"]):
        with pytest.raises(Stop):
            cli.main(keep + flags)
    assert got == [True, False]


@needs_interpreter
def test_a_host_path_in_turns_follows_each_call_of_its_partner(monkeypatch):
    """``hostcost.measure`` with a partner makes one partner call (untimed)
    right before every call it times, as the lead rows take turns; a partner
    without the call leaves the path measured alone, and the record says so."""
    from obskernels.bench import backends, hostcost

    events = []

    def prepare(case, target, backend, **kwargs):
        prepared = backends.prepare(case, target, backend, **kwargs)
        fn = prepared.fn

        def logged():
            events.append(backend)
            return fn()

        return dataclasses.replace(prepared, fn=logged)

    monkeypatch.setattr(hostcost, "prepare", prepare)
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    obs = bench_cases.OBSERVERS["memoryless_minmax"]
    got = hostcost.measure(case, obs, "triton", max_reps=6, budget_s=0.0, partner="reference")
    assert got["partner"] == "reference" and "each after a call of reference's" in got["method"]
    assert got["units"] > 0 and got["reps"] == 3
    # the partner's first try; the warm-up's and the timed calls each after a
    # partner call; between them the call counted for its aten ops, alone
    assert events == ["reference"] + ["reference", "triton"] * 3 + ["triton"] + ["reference", "triton"] * 3
    events.clear()
    alone = hostcost.measure(case, obs, "triton", max_reps=6, budget_s=0.0, partner="llmc-triton")
    assert alone["partner"] is None and "after a call" not in alone["method"]
    assert "llmc-triton" not in events


@needs_interpreter
def test_an_observers_read_of_its_status_is_counted_as_a_sync():
    """get_qparams reads the observer's status once (a ``tolist``, which on a
    CPU tensor dispatches no aten op): the counters take it as the sync it is
    on a GPU, and none under nonfinite="propagate", which reads nothing. The
    interpreter's own reads of a kernel's arguments are not counted."""
    from obskernels import Observer
    from obskernels.bench.traffic import count_traffic

    value = torch.randn(8, 256)
    for policy, syncs in (("error", 1), ("propagate", 0)):
        obs = Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                          args=bench_cases.SCHEMES["int4-group128"].qargs(),
                                          nonfinite=policy)
        with count_traffic("cpu", triton=True) as counts:
            obs(value)
            obs.get_qparams()
        assert counts.triton_launches >= 1 and counts.syncs == syncs, (policy, counts.syncs)
    # a read of a tensor elsewhere than the counted device is not the call's
    with count_traffic("cuda") as counts:
        torch.ones(3).tolist()
    assert counts.syncs == 0
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the counters' hooks undone
    assert torch.Tensor.numpy is torch._C.TensorBase.numpy


@needs_interpreter
def test_obskernels_rows_run_as_a_user_runs(monkeypatch):
    """A row of the backend the default choice picks ("auto" -> triton here)
    runs without a use_backend block, as a user's call does; another
    backend's row is forced by a block."""
    from obskernels import backends
    from obskernels.bench import backends as bench_backends

    monkeypatch.setattr(backends, "_process_choice", None)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    entered = []
    real = backends.use_backend

    class spy(real):
        def __enter__(self):
            entered.append(self._name)
            return super().__enter__()

    monkeypatch.setattr(backends, "use_backend", spy)
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    obs = bench_cases.OBSERVERS["memoryless_minmax"]
    for backend in ("triton", "reference"):
        prepared = bench_backends.prepare(case, obs, backend)
        prepared.setup()
        prepared.call()
    assert entered == ["reference"]


def test_compulsory_bytes():
    value = torch.zeros(8, 32, dtype=torch.bfloat16)
    mins, maxs = torch.zeros(8, 2, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.bfloat16)
    assert compulsory_bytes([value], [mins, maxs]) == 8 * 32 * 2 + 2 * 16 * 2
    # a view of the input needs no traffic at all
    assert compulsory_bytes([value], [value.reshape(1, 8, 2, 16)]) == 0
    buf = torch.zeros(32)
    assert compulsory_bytes([value], [], updated=[buf]) == 8 * 32 * 2 + 2 * 32 * 4


def test_affine_extrapolate():
    assert affine_extrapolate({100: 1_000 + 3 * 100, 200: 1_000 + 3 * 200}, 10_000) == 31_000
    assert affine_extrapolate({50: 100}, 500) == 1000


# --------------------------------------------------------------------------- cases


def test_quick_sweep_scales_the_full_shapes():
    quick, full = bench_cases.sweep("quick"), bench_cases.sweep("full")
    assert {c.full_shape for c in quick} == {c.shape for c in full}
    for c in quick:
        assert c.scaled and c.dtype == "bf16"
        assert c.shape[0] * bench_cases.QUICK_DIVISOR <= c.full_shape[0] * 1.0
        if c.spec.strategy == "block":
            assert c.shape[0] % 128 == 0 and c.shape[1] % 128 == 0
        if c.spec.strategy in ("group", "tensor_group"):
            args = c.spec.qargs()
            assert c.shape[1] % args.group_size == 0
    assert {c.dtype for c in full} == {"bf16", "fp32"}


def test_targets_follow_the_spec():
    ops, obs = list(bench_cases.OPS), list(bench_cases.OBSERVERS)
    block = bench_cases.Case("weight", (256, 256), "bf16", "fp8-block128")
    labels = {t.label for t in bench_cases.targets_for(block, ops, obs)}
    assert "mse_search[imatrix]" not in labels and "obs:imatrix_mse" not in labels
    assert "accumulate_sq" not in labels and "obs:nvfp4_expanded_mse" not in labels
    act = bench_cases.Case("activation", (16, 256), "bf16", "fp8-tensor-act")
    assert "accumulate_sq" in {t.label for t in bench_cases.targets_for(act, ops, obs)}


def test_stable_hash_is_fnv1a():
    # the published 32-bit FNV-1a test vectors
    assert bench_cases.hash_str("") == 0x811C9DC5
    assert bench_cases.hash_str("a") == 0xE40C292C
    assert bench_cases.hash_str("foobar") == 0xBF9CF968


def test_values_come_from_torchs_generator_seeded_by_the_case():
    """A weight's value is torch's normal draw from a generator seeded by a
    stable hash of (kind, shape, scheme), made in fp32 and cast: rebuilt here
    from torch's own generator and the FNV-1a vectors above."""
    case = bench_cases.Case("weight", (24, 256), "bf16", "int4-group128")
    seed = (bench_cases.hash_str("weight(24, 256)int4-group128") ^ 0x5EED) & 0x7FFFFFFF
    expected = torch.randn((24, 256), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    got = bench_cases.make_value(case)
    assert got.dtype == torch.bfloat16 and got.shape == (24, 256)
    assert torch.equal(got, expected)
    # another shape, another scheme or another kind: other data
    same_seed = torch.randn((24, 128), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    assert not torch.equal(bench_cases.make_value(case, shape=(24, 128)), same_seed)
    other = bench_cases.make_value(bench_cases.Case("weight", (24, 256), "bf16", "int8-channel"))
    assert not torch.equal(other, got)
    # activations: the same draw with a few outlier columns scaled by 8
    act = bench_cases.Case("activation", (16, 256), "fp32", "fp8-tensor-act")
    a = bench_cases.make_value(act)
    seed = (bench_cases.hash_str("activation(16, 256)fp8-tensor-act") ^ 0x5EED) & 0x7FFFFFFF
    base = torch.randn((16, 256), generator=torch.Generator().manual_seed(seed))
    ratio = a / base
    scaled = (ratio == 8.0).all(0)
    assert ((ratio == 1.0).all(0) | scaled).all() and 1 <= int(scaled.sum()) <= 256 // 64


def test_values_are_the_same_in_every_process():
    """Seeds do not depend on Python's per-process string hash: two processes
    with different hash seeds build the same bytes as this one."""
    import hashlib
    import subprocess
    import sys

    code = (
        "import hashlib, sys\n"
        "from obskernels.bench import cases\n"
        "for c in cases.sweep('tiny'):\n"
        "    v = cases.make_value(c).float().numpy().tobytes()\n"
        "    print(hashlib.sha256(v).hexdigest())\n"
    )
    here = [hashlib.sha256(bench_cases.make_value(c).float().numpy().tobytes()).hexdigest()
            for c in bench_cases.sweep("tiny")]
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONSAFEPATH="1")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        assert out.stdout.split() == here, f"PYTHONHASHSEED={hash_seed}: {out.stderr[-500:]}"


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_a_fresh_process_ends_with_its_parent(tmp_path):
    """The harness's fresh processes (oneshot's and first use's): when the
    harness is stopped by SIGTERM (``timeout``), its waiting child is ended
    too, not left to run against what the machine runs next."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = ("import os, sys\n"
              "from obskernels.bench.launch import run_fresh_process\n"
              f"run_fresh_process([sys.executable, '-c', {child!r}], dict(os.environ))\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], env=dict(os.environ, PYTHONSAFEPATH="1"),
                            stderr=subprocess.PIPE, text=True)
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while child_pid is None and time.monotonic() < deadline and proc.poll() is None:
            text = pid_file.read_text() if pid_file.exists() else ""
            child_pid = int(text) if text else None
            time.sleep(0.05)
        assert child_pid is not None, f"the child never started: {proc.poll()} {proc.stderr.read()[-500:]}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # ended by the handler, not killed
        deadline = time.monotonic() + 10
        alive = True
        while alive and time.monotonic() < deadline:
            try:
                os.kill(child_pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                alive = False
        assert not alive, "the child outlived its parent's SIGTERM"
    finally:
        proc.kill()
        if child_pid is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------------- harness


def test_reference_min_max_counts_match_hand_count():
    case = bench_cases.Case("weight", (64, 256), "bf16", "int4-group128")
    from obskernels.bench.backends import prepare

    counts, comp, _ = count_call(prepare(case, bench_cases.OPS["min_max"], "reference"), "cpu", False)
    value, groups = 64 * 256 * 2, 64 * 2 * 2
    # amin and amax each read the value and write one bf16 per group
    assert (counts.bytes_read, counts.bytes_written, counts.launches) == (2 * value, 2 * groups, 2)
    assert comp == value + 2 * groups


@needs_interpreter
@pytest.mark.kernel
def test_reduced_shape_extrapolation_matches_a_direct_count():
    from obskernels.backends import triton_unavailable_reason

    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    case = bench_cases.Case("weight", (256, 256), "bf16", "int4-group128")
    target = bench_cases.OPS["min_max"]
    modelled = model_counts(case, target, "triton", case.shape)
    if modelled["status"].startswith("unsupported"):
        pytest.skip(modelled["status"])
    assert modelled["status"] == "ok", modelled["status"]
    assert "reduced shapes" in modelled["count_method"]
    from obskernels.bench.backends import prepare

    direct, comp, _ = count_call(prepare(case, target, "triton"), "cpu", triton=True)
    assert modelled["bytes_moved"] == direct.bytes_moved
    assert modelled["launches"] == direct.launches
    assert modelled["compulsory_bytes"] == comp


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.parametrize("scheme", ["fp8-tensor-act", "nvfp4-tg16-act"])
def test_reduced_shapes_keep_the_searchs_kernels(scheme):
    """An activation's search group spans every token (a whole tensor for
    TENSOR): the reduced shapes must take the split path the full shape takes
    (the model prices each kernel by name), so the extrapolated count has the
    direct count's kernels and launches (and, where whole groups are kept,
    its bytes)."""
    from obskernels.backends import triton_unavailable_reason

    if triton_unavailable_reason(None) is not None:
        pytest.skip(f"triton backend unavailable: {triton_unavailable_reason(None)}")
    from obskernels.bench.backends import prepare
    from obskernels.bench.counting import _pinned_search_steps

    case = bench_cases.Case("activation", (512, 128), "bf16", scheme)
    target = bench_cases.OBSERVERS["memoryless_mse"]
    modelled = model_counts(case, target, "triton", case.shape)
    assert modelled["status"] == "ok", modelled["status"]
    assert "reduced shapes" in modelled["count_method"]
    with _pinned_search_steps(target):  # as model_counts counts
        direct, _, _ = count_call(prepare(case, target, "triton"), "cpu", triton=True)
    assert "triton:_search_part_kernel" in direct.op_names  # the full shape's split path
    assert modelled["op_names"] == direct.op_names
    assert modelled["launches"] == direct.launches
    if scheme.startswith("nvfp4"):
        assert modelled["bytes_moved"] == direct.bytes_moved


# The keys of a results.jsonl line as obskernels/bench/README.md lists them
# ("Records"): in every line, and only when the record has them.
DOCUMENTED_KEYS = (
    "op target_kind backend case kind base_name shape full_shape scaled dtype strategy format "
    "scheme measured_s measured_reps measured_min_s timer throughput_gbs peak_bytes peak_pct peak_method "
    "bytes_moved bytes_read bytes_written compulsory_bytes traffic_ratio launches flops modelled_s "
    "modelled_lanes_s model sass_per_elem_step registers spills bound model_gpu count_method status "
    "note mode scope machine versions timestamp"
).split()
DOCUMENTED_OPTIONAL = (
    "aten_ops triton_launches syncs triton_unique_bytes atomics op_names "
    "triton_programs_at_counted_shape sass_kernel issue_efficiency model_gpu_s model_host_s model_before_s "
    "model_after_s model_sync_s host_units host_method search_steps flops_per_element_step device_s device_ops "
    "device_method measured_pass_s issued_s launched_s issued_method"
).split()


def test_bench_readme_documents_the_record_keys():
    readme = os.path.join(os.path.dirname(__file__), "..", "obskernels", "bench", "README.md")
    text = open(readme).read()
    missing = [k for k in DOCUMENTED_KEYS + DOCUMENTED_OPTIONAL if f"`{k}`" not in text]
    assert not missing, f"obskernels/bench/README.md does not list {missing}"


def test_record_json_keys_without_a_run():
    from obskernels.bench.records import CaseInfo, Provenance, Record, Traffic

    case = CaseInfo("w16x256 bf16 int4-group128", "weight", "weight", (16, 256), (4096, 4096), True,
                    "bf16", "group", "int4 sym g128", "int4-group128")
    rec = Record("min_max", "op", "reference", case, Provenance("tiny"), status="n/a: test")
    d = rec.to_dict()
    # a record that took no figure still has every documented key, null
    assert list(d) == DOCUMENTED_KEYS
    assert d["shape"] == [16, 256] and d["measured_s"] is None and d["scope"] == "run"
    # an optional key appears once the record has it, after the documented ones
    d = rec.replace(traffic=Traffic(bytes_moved=8, op_names={"amin": 1})).to_dict()
    assert list(d)[len(DOCUMENTED_KEYS):] == ["op_names"] and d["bytes_moved"] == 8
    assert Record.from_dict(json.loads(json.dumps(d))).to_dict() == d
    with pytest.raises(ValueError, match="status"):
        Record.from_dict({k: v for k, v in d.items() if k != "status"})


def test_tiny_harness_run_writes_valid_records(tmp_path):
    from obskernels.bench import report

    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    opts = Options(
        mode="tiny",
        ops=("flatten", "min_max"),
        observers=("static_minmax",),
        backends=("reference", "triton", "llmc-eager"),
        out=str(tmp_path),
        cases=[case],
        min_reps=1,
        max_reps=2,
        min_time_s=0.0,
        project_full=True,
        progress=None,
    )
    records = run(opts)
    paths = report.write_all(records, str(tmp_path))
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(records) > 0
    parsed = [json.loads(line) for line in lines]
    for r in parsed:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, f"record {r['op']}/{r['backend']} lacks {missing}"
        assert r["versions"]["torch"] and r["machine"]["cpu_cores"] and r["timestamp"]
        # the documented keys, in that order, then documented optional ones only
        assert list(r)[:len(DOCUMENTED_KEYS)] == DOCUMENTED_KEYS, (r["op"], r["backend"])
        extra = [k for k in list(r)[len(DOCUMENTED_KEYS):] if k not in DOCUMENTED_OPTIONAL]
        assert not extra, f"record {r['op']}/{r['backend']}: undocumented keys {extra}"
    assert any("op_names" in r and "model_gpu_s" in r for r in parsed)
    # a record read back from its line writes the same line
    back = report.read_jsonl(str(tmp_path / "results.jsonl"))
    assert [json.dumps(r.to_dict()) for r in back] == lines
    assert back == list(records)
    run_recs = {(r["op"], r["backend"]): r for r in parsed if r["scope"] == "run"}
    ref = run_recs[("min_max", "reference")]
    assert ref["measured_s"] > 0 and ref["bytes_moved"] > 0 and ref["modelled_s"] > 0
    assert ref["shape"] == [16, 256] and ref["full_shape"] == [4096, 4096] and ref["scaled"]
    flat = run_recs[("flatten", "reference")]
    assert flat["compulsory_bytes"] == 0 and flat["bytes_moved"] == 0 and flat["launches"] == 0
    tri = run_recs[("min_max", "triton")]
    assert tri["measured_s"] is None  # never timed on the CPU
    assert tri["status"].startswith(("modelled", "unsupported", "unavailable", "error"))
    if tri["status"] == "modelled":
        # the compute term comes from the kernel compiled for sm_90a
        assert "SASS" in tri["model"] and tri["sass_per_elem_step"] > 0
        assert 0 < tri["registers"] <= 128 and tri["spills"] == 0
        assert tri["modelled_lanes_s"] > 0
    assert "SASS" not in (ref["model"] or "") and ref["sass_per_elem_step"] is None
    llmc = run_recs[("min_max", "llmc-eager")]
    if importlib.util.find_spec("llmcompressor") is None:
        assert llmc["status"].startswith("unavailable") and llmc["measured_s"] is None
    else:
        assert llmc["measured_s"] > 0
    proj = [r for r in parsed if r["scope"] == "full-size projection"]
    assert proj and all(r["measured_s"] is None and r["shape"] == [4096, 4096] for r in proj)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# obskernels benchmark report")
    # the full-size observer rows lead; the scaled run comes after, flagged
    assert md.index("## Observers at the full size") < md.index("## This run")
    assert "OVERSTATE" in md[md.index("## This run"):]
    if importlib.util.find_spec("matplotlib") is not None:
        assert any(p.endswith(".png") for p in paths.values())


def test_h100_table_pairs_the_model_with_the_measurements():
    from obskernels.bench import h100

    def rec(backend, seconds, scope="full-size projection"):
        return {"case": "w4096x4096 bf16 int4-group128", "op": "obs:memoryless_mse", "backend": backend,
                "scope": scope, "scaled": False, "modelled_s": seconds, "model_host_s": 1e-3, "bound": "host"}

    records = [rec("triton", 1.5e-3), rec("llmc-eager", 30e-3), rec("llmc-triton", 2.0e-3),
               rec("triton", 9.0, scope="run") | {"scaled": True}]
    row = next(r for r in h100.rows(records) if r["observer"] == "memoryless_mse"
               and r["case"].endswith("int4-group128"))
    assert row["measured_ms"] == 1.762 and row["model_ms"] == pytest.approx(1.5)
    # llm-compressor's default path on a GPU is its Triton search where it has one
    assert row["llmc_model_ms"] == pytest.approx(2.0) and row["llmc_path"] == "its Triton search"
    text = h100.markdown(h100.rows(records))
    assert "| w4096x4096 int4-group128 | memoryless_mse | 1.762 | 1.500 | 0.85 |" in text
    # the latest run's figures: the same rows, the model beside this code's measurements
    latest = next(r for r in h100.rows(records, h100.MEASURED_LATEST) if r["observer"] == "memoryless_mse"
                  and r["case"].endswith("int4-group128"))
    assert (latest["measured_ms"], latest["llmc_measured_ms"]) == (0.934, 2.767)
    assert [r[:2] for r in h100.MEASURED_LATEST] == [r[:2] for r in h100.MEASURED]


# --------------------------------------------------------------------------- #
# obskernels.bench.cuda_host: the GPU's wall time per call
# --------------------------------------------------------------------------- #
class _FakeClock:
    """time.perf_counter for the harness: each call of the timed function
    costs ``step`` seconds, a synchronisation ``sync`` seconds."""

    def __init__(self, step, sync):
        self.now, self.step, self.sync = 0.0, step, sync

    def __call__(self):
        return self.now

    def call(self):
        self.now += self.step

    def synchronise(self):
        self.now += self.sync


def test_cuda_host_times_per_call_from_the_clock(monkeypatch):
    """Back to back: n calls and one synchronisation over n; single: one call
    and its synchronisation, the median."""
    from obskernels.bench import cuda_host

    clock = _FakeClock(step=3.0, sync=8.0)
    monkeypatch.setattr(cuda_host.time, "perf_counter", clock)
    monkeypatch.setattr(cuda_host, "_sync", clock.synchronise)
    assert cuda_host.loop_seconds(clock.call, n=4, rounds=2) == pytest.approx((4 * 3.0 + 8.0) / 4)
    assert cuda_host.sync_seconds(clock.call, reps=5) == pytest.approx(3.0 + 8.0)


def test_cuda_host_rounds_go_over_every_row_in_turn(monkeypatch, capsys):
    """cuda_host.measure times its rows in interleaved rounds (each round
    times every row), a row's loop figure the fastest round's and its sync
    and wiped figures the quietest round's median; units over the unit
    row's loop; issued: in separate wiped calls, the time until the call's
    first launch site returned (None for a row that launches through none);
    turns: wiped calls each after the row's partner's call (llm-compressor's,
    untimed; None for a row without one), and issued in such calls; swept:
    wiped calls each after a sweep of the host's caches, for the same rows;
    the garbage collections inside the timed calls in turns, per 1,000.
    Faked: CUDA, the L2 wipe, the launch sites, the rows' calls (each
    advancing a clock by its own cost, 0.5 more right after a wipe; the lead
    call's launch 2.0 after its start and 0.25 long, part of its cost; a
    collection in every lead call, three in every partner's, untimed)."""
    from obskernels.bench import cuda_host, host
    from obskernels.kernels import _replay

    clock = _FakeClock(step=0.0, sync=1.0)
    order = []
    wiped = [False]
    collected = [0]

    def wipe():
        order.append("wipe")
        wiped[0] = True
        clock.now += 100.0  # untimed

    def site(self, *args):
        clock.now += 0.25

    def sweep():
        order.append("sweep")
        clock.now += 30.0  # untimed

    def row(name, cost, quiet=None, launch_at=None):
        """A call costing ``cost``, or ``quiet`` in the second round;
        launching through a site ``launch_at`` after its start."""
        made = []

        def call():
            order.append(name)
            made.append(name)
            collected[0] += {"lead": 1, "partner": 3}.get(name, 0)
            second = quiet is not None and 5 + 7 < len(made) <= 5 + 14  # after 5 warm-up calls
            clock.now += (quiet if second else cost) + (0.5 if wiped[0] else 0.0)
            if launch_at is not None:
                clock.now -= cost - launch_at
                _replay.Replay.__call__(None)
                clock.now += cost - launch_at - 0.25
            wiped[0] = False
        return call

    minmax = next(sc for sc in host.SCENARIOS if sc.name == "minmax call")
    monkeypatch.setattr(cuda_host.time, "perf_counter", clock)
    monkeypatch.setattr(cuda_host, "_sync", clock.synchronise)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a fake GPU")
    monkeypatch.setattr(cuda_host, "_unit", lambda: row("unit", 2.0))
    monkeypatch.setattr(cuda_host, "_bare_launch", lambda: row("launch", 3.0))
    monkeypatch.setattr(cuda_host, "_through_triton", lambda fn: row("through triton", 7.0))
    monkeypatch.setattr(cuda_host, "_with_tensors", lambda fn: row("tensors", 6.0))
    monkeypatch.setattr(cuda_host, "_lead_rows", lambda: [
        ("lead call", row("lead", 9.0, launch_at=2.0), row("partner", 50.0))])
    monkeypatch.setattr(_replay.Replay, "__call__", site)
    monkeypatch.setattr(cuda_host, "_activation_rows", lambda: [])
    def no_parts(device):
        raise RuntimeError("no parts here")

    monkeypatch.setattr(cuda_host, "part_rows", no_parts)  # the other rows measured all the same
    monkeypatch.setattr(cuda_host, "_wipe", lambda: wipe)
    monkeypatch.setattr(host, "sweep_host_caches", sweep)
    monkeypatch.setattr(host, "gc_collections", lambda: collected[0])
    monkeypatch.setattr(host, "SCENARIOS", (minmax,))
    monkeypatch.setattr(host, "_call_of", lambda sc, device="cpu": row(sc.name, 5.0, quiet=4.0))
    rows = cuda_host.measure(n=2, reps=6, rounds=3)
    names = ["unit", "launch", "minmax call", "through triton", "tensors", "lead"]
    assert [r["row"] for r in rows] == ["unit: one-element CUDA add_", "bare Triton launch",
                                        "minmax call", "minmax call, Triton's launch path",
                                        "minmax call, tensors to Triton's launcher", "lead call"]
    warm, timed = order[:31], order[31:]
    assert warm == [name for name in names for _ in range(5)] + ["partner"]
    # a round: per row, 2 calls back to back, 2 single calls, 2 single calls
    # after a wipe each, then 1 more after a wipe (issued); the lead call
    # then 2 more, each after its partner's call and a wipe (turns), and 1
    # more so (issued in turns), and 2 more, each after a sweep and a wipe
    # (the unit and the bare launch as well, cold: after the lead call's partner)
    assert timed == [step for name in names for step in [name] * 4 + ["wipe", name] * 3
                     + (["partner", "wipe", name] * 3 + ["sweep", "wipe", name] * 2
                        if name in ("unit", "launch", "lead") else [])] * 3
    for r, cost in zip(rows, (2.0, 3.0, 4.0, 7.0, 6.0, 9.0)):  # the minmax call's quiet second round
        assert r["loop_us"] == pytest.approx((2 * cost + 1.0) / 2 * 1e6)  # one synchronisation timed
        assert r["sync_us"] == pytest.approx((cost + 1.0) * 1e6)
        assert r["wiped_us"] == pytest.approx((cost + 0.5 + 1.0) * 1e6)
        assert r["units"] == pytest.approx(r["loop_us"] / rows[0]["loop_us"])
    assert [r["issued_us"] for r in rows[:-1]] == [None] * 5
    assert rows[-1]["issued_us"] == pytest.approx((0.5 + 2.0 + 0.25) * 1e6)
    # in turns: the lead call, and the unit and the bare launch (cold launches), the partner untimed
    cold = [rows[0], rows[1], rows[-1]]
    assert [r["turns_us"] for r in cold] == pytest.approx([(c + 0.5 + 1.0) * 1e6 for c in (2.0, 3.0, 9.0)])
    assert [r["turns_us"] for r in rows[2:-1]] == [None] * 3
    assert [r["turns_issued_us"] for r in rows[:-1]] == [None] * 5  # no launch site in the unit or launch
    assert rows[-1]["turns_issued_us"] == pytest.approx((0.5 + 2.0 + 0.25) * 1e6)
    assert [r["swept_us"] for r in cold] == pytest.approx([(c + 0.5 + 1.0) * 1e6 for c in (2.0, 3.0, 9.0)])
    assert [r["swept_us"] for r in rows[2:-1]] == [None] * 3  # the sweep untimed
    assert [r["turns_gc_per_1000"] for r in cold] == [0.0, 0.0, 1000.0]  # the partner's not counted
    assert [r["turns_gc_per_1000"] for r in rows[2:-1]] == [None] * 3
    assert _replay.Replay.__call__ is site  # the sites unwrapped after
    assert "the minmax call's parts not timed: RuntimeError: no parts here" in capsys.readouterr().err


def test_minmax_call_parts_are_its_pieces():
    """bench.cuda_host's parts of the minmax call, made here on CPU tensors
    (the launch interpreted): the call allocates its four outputs (mins,
    maxs, scale, zero point), its one launch replays with the call's own
    arguments (writing the outputs again) and the status read reads a
    status; the split charges the outputs as many times as a call makes
    them and leaves the rest to the call's other work."""
    from obskernels.bench import cuda_host
    from obskernels.spec.record import STATUS_INIT

    rows, outputs = cuda_host.part_rows("cpu")
    assert [name for name, _ in rows] == list(cuda_host.PARTS)  # no pinned read off CUDA
    assert outputs == 4
    made = {name: fn() for name, fn in rows}
    assert type(made["part: a new observer"]).__name__ == "MemorylessMinMaxObserver"
    assert made["part: a fresh status"].tolist()[:len(STATUS_INIT)] == list(STATUS_INIT)
    record, scale_bad = made["part: the status read"]
    assert len(record) == len(STATUS_INIT) and scale_bad is False
    loops = dict(zip(cuda_host.PARTS, (10.0, 3.0, 2.0, 12.0, 15.0, 20.0)))
    timed = [{"row": "minmax call", "loop_us": 100.0}] + [{"row": n, "loop_us": v} for n, v in loops.items()]
    assert cuda_host.minmax_by_part(timed, outputs) == {
        "a new observer": 10.0, "4 outputs": 12.0, "a fresh status": 2.0, "the launch": 12.0,
        "the status read": 20.0, "the rest": 44.0}
    assert cuda_host.minmax_by_part(timed[:-1], outputs) is None  # a part missing


def test_cuda_host_refuses_without_cuda(monkeypatch, capsys):
    from obskernels.bench import cuda_host

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu-marked test runs it")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else it re-runs itself without
    assert cuda_host.main([]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_a_traced_call_puts_each_piece_in_its_span(monkeypatch):
    """cuda_host.traced_spans on a CPU minmax call, launches stubbed, the
    clock advancing only in the launch (2 ms), in the status read (5 ms) and
    in the observer's construction (1 ms): each lands in its own span, the
    others read zero; the wrapped functions are as they were afterwards."""
    from obskernels import ops
    from obskernels.bench import cuda_host, host
    from obskernels.kernels import _replay
    from obskernels.observers import Observer, report

    clock = _FakeClock(step=0.0, sync=0.0)
    sc = next(s for s in host.SCENARIOS if s.name == "minmax call")
    call = host._call_of(sc)
    real_site = _replay.Replay.__call__
    # the patches undone before the stubs (else the stub would stay in place after the test)
    with host.stubbed_launches(), monkeypatch.context() as patched:
        call()  # planned
        stub, read, load = _replay.Replay.__call__, report.read_status, Observer.load_from_registry.__func__

        def launch(*args, **kwargs):
            clock.now += 0.002
            return stub(*args, **kwargs)

        def slow_read(status):
            clock.now += 0.005
            return read(status)

        def slow_load(cls, *args, **kwargs):
            clock.now += 0.001
            return load(cls, *args, **kwargs)

        patched.setattr(_replay.Replay, "__call__", launch)
        patched.setattr(report, "read_status", slow_read)
        patched.setattr(Observer, "load_from_registry", classmethod(slow_load))
        patched.setattr(cuda_host.time, "perf_counter", clock)
        patched.setattr(cuda_host, "_sync", lambda: None)
        before = (Observer.__dict__["load_from_registry"], ops.min_max_qparams, report.read_status)
        spans = cuda_host.traced_spans(call, reps=3)
        assert (Observer.__dict__["load_from_registry"], ops.min_max_qparams, report.read_status) == before
        assert _replay.Replay.__call__ is launch
    assert _replay.Replay.__call__ is real_site
    assert list(spans) == list(cuda_host.SPANS)
    assert spans == pytest.approx({"new observer": 1000.0, "observe, before ops": 0.0,
                                   "ops, before the launch": 0.0, "the launch": 2000.0,
                                   "the launch to the read": 0.0, "the status read": 5000.0,
                                   "after the read": 0.0})
    # a call passing no launch site (every launch through another path) is not traced
    monkeypatch.setattr(cuda_host, "_sync", lambda: None)
    assert cuda_host.traced_spans(lambda: None, reps=2) is None


@pytest.mark.gpu
def test_cuda_host_measures_every_row():
    """On a GPU: every row measured (positive times), the unit row is the
    unit, the activation's forward is there eagerly, with every launch
    through Triton's launch path and replayed from a CUDA graph."""
    from obskernels.bench import cuda_host, host
    from obskernels.bench.backends import llmc_available

    rows = cuda_host.measure(n=3, reps=3)
    names = [r["row"] for r in rows]
    assert names[:2] == ["unit: one-element CUDA add_", "bare Triton launch"]
    scenarios = [s.name for s in host.SCENARIOS if not s.drop_in or llmc_available()]
    assert names[2:2 + len(scenarios)] == scenarios
    assert "activation forward 2048x4096, CUDA graph replay" in names
    assert [n for n in names if n.startswith("memoryless_minmax ")] == [
        f"memoryless_minmax w4096x4096 bf16 {scheme}" for scheme in bench_cases.WEIGHT_SCHEMES] + [
        f"memoryless_minmax a2048x4096 bf16 {scheme}" for scheme in bench_cases.ACTIVATION_SCHEMES]
    assert {"minmax call, Triton's launch path", "activation forward 2048x4096, Triton's launch path",
            "minmax call, tensors to Triton's launcher",
            "activation forward 2048x4096, tensors to Triton's launcher"} <= set(names)
    assert rows[0]["units"] == 1.0
    assert all(r["loop_us"] > 0 and r["sync_us"] > 0 and r["wiped_us"] > 0 and r["kind"] == "measured"
               for r in rows)
    # the first launch issued before the call's end; none in the unit, the bare launch, the graph
    lead = [r for r in rows if r["row"].startswith("memoryless_minmax ")]
    assert all(0 < r["issued_us"] < r["wiped_us"] for r in lead)
    # after llm-compressor's call where it imports; none where it does not, nor for other rows
    assert all((0 < r["turns_issued_us"] < r["turns_us"]) if llmc_available()
               else r["turns_us"] is r["turns_issued_us"] is None for r in lead)
    cold = [r for r in rows if r["row"] in cuda_host.COLD_LAUNCH_ROWS]  # the launches alone, in turns too
    assert [r["row"] for r in cold] == list(cuda_host.COLD_LAUNCH_ROWS)
    assert all((r["turns_us"] > 0 and r["swept_us"] > 0) if llmc_available()
               else r["turns_us"] is r["swept_us"] is None for r in cold)
    assert all(r["turns_us"] is r["turns_issued_us"] is None for r in rows if r not in lead + cold)
    assert all((r["swept_us"] > 0) if llmc_available() else r["swept_us"] is None for r in lead)
    assert all(r["swept_us"] is None for r in rows if r not in lead + cold)
    by_name = {r["row"]: r for r in rows}
    assert by_name["unit: one-element CUDA add_"]["issued_us"] is None
    assert by_name["activation forward 2048x4096, CUDA graph replay"]["issued_us"] is None
    # the minmax call's pieces, each timed alone, and its split into them
    assert set(cuda_host.PARTS) | {cuda_host.PINNED_READ} <= set(names)
    by_part = by_name["minmax call"]["by_part_us"]
    assert list(by_part)[-1] == "the rest" and all(v > 0 for k, v in by_part.items() if k != "the rest")
    # the lead calls traced: every span taken, wiped and (where llm-compressor imports) in turns
    traced = cuda_host.trace_rows(reps=3)
    assert [(r["row"], r["setting"]) for r in traced] == [
        (r["row"], setting) for r in lead for setting in (("wiped", "turns") if llmc_available() else ("wiped",))]
    assert all(list(r["spans_us"]) == list(cuda_host.SPANS) and all(v > 0 for v in r["spans_us"].values())
               for r in traced)
    # our kernels profiled in each setting: a device time for every lead call
    kernels = cuda_host.kernel_rows(reps=3)
    settings = cuda_host.KERNEL_SETTINGS if llmc_available() else cuda_host.KERNEL_SETTINGS[:2]
    assert [r["row"] for r in kernels] == [r["row"] for r in lead]
    assert all(list(r["kernels_us"]) == list(settings) and all(v > 0 for v in r["kernels_us"].values())
               for r in kernels), kernels


def test_cuda_host_lead_settings_put_the_partner_before_the_wipe(monkeypatch):
    """``trace_rows`` and ``kernel_rows`` take each lead call in its
    settings: after the wipe, and where llm-compressor's call exists, after
    it and then the wipe (``kernel_rows`` back to back too, nothing before);
    a call with no partner has no "turns"."""
    from obskernels.bench import cuda_host

    seen = []
    monkeypatch.setattr(cuda_host, "_lead_rows", lambda: [
        ("a", lambda: None, lambda: seen.append("partner")), ("b", lambda: None, None)])
    monkeypatch.setattr(cuda_host, "_wipe", lambda: lambda: seen.append("wipe"))

    def before_of(fn, reps, before, *names):
        seen.clear()
        before()
        return {"span": float(len(seen))} if not names else tuple(seen)

    monkeypatch.setattr(cuda_host, "traced_spans", before_of)
    monkeypatch.setattr(cuda_host, "kernel_times", before_of)
    traced = cuda_host.trace_rows(reps=1)
    assert [(r["row"], r["setting"], r["total_us"]) for r in traced] == [
        ("a", "wiped", 1.0), ("a", "turns", 2.0), ("b", "wiped", 1.0)]
    kernels = cuda_host.kernel_rows(reps=1)
    assert kernels[0]["kernels_us"] == {"back to back": (), "wiped": ("wipe",), "turns": ("partner", "wipe")}
    assert kernels[1]["kernels_us"] == {"back to back": (), "wiped": ("wipe",)}


def test_cuda_host_counts_only_our_kernels_in_a_profile():
    """``ours_per_call_us`` sums per call the device time of the profile's
    events whose kernel is ours (``our_kernel_names``: the launched kernels
    the compile report finds), leaving out the wipe's and the other
    library's, and gives None where none of ours ran."""
    from obskernels.bench import cuda_host

    names = cuda_host.our_kernel_names()
    assert {"_min_max_kernel", "_qparams_kernel", "_search_kernel"} <= names
    assert not any(n.startswith("aten") or "elementwise" in n for n in names)
    events = [("_min_max_kernel", 40.0), ("void at::native::vectorized_elementwise_kernel<4>", 100.0),
              ("_qparams_kernel", 20.0), ("Memcpy DtoH (Device -> Pageable)", 7.0)]
    assert cuda_host.ours_per_call_us(events, names, 4) == pytest.approx(15.0)
    assert cuda_host.ours_per_call_us(events[1::2], names, 4) is None


def test_oneshot_comparison_alternates_the_modes_repeated_calls(monkeypatch):
    """bench.oneshot's repeated calls come after both modes' first calls and
    alternate between the modes, so a process getting faster over its first
    calls is not counted against the mode measured first; each row's repeat
    figure is the median of its own mode's calls."""
    from obskernels.bench import oneshot

    order = []
    seconds = iter([9.0, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])

    def fake_run_once(scheme, mode, *args, **kwargs):
        order.append(mode)
        return {"seconds": next(seconds), "qparams": {"s": torch.ones(1)}, "variants": {}}

    monkeypatch.setattr(oneshot, "run_once", fake_run_once)
    rows = oneshot.compare(["FP8"], oneshot.LLAMA3_8B, "cpu", reps=3, fresh=False)
    assert order == ["plain", "drop-in"] * 4
    assert [(r["mode"], r["first_in_process_s"], r["repeat_s"]) for r in rows] == [
        ("plain", 9.0, 3.0), ("drop-in", 8.0, 4.0)]
    assert all(r["qparams_identical"] == 1 for r in rows)


def test_oneshot_fresh_processes_take_turns_and_give_their_median(monkeypatch):
    """bench.oneshot's fresh-process figure is the median of several
    processes per mode, the modes taking turns with each pair reversed
    (plain, drop-in, drop-in, plain, ...), after the in-process calls; every
    sample is kept in the row and shown in the table."""
    from obskernels.bench import oneshot

    events = []
    seconds = {"plain": iter([1.0, 3.0, 2.0]), "drop-in": iter([5.0, 4.0, 9.0])}

    def fake_run_once(scheme, mode, *args, **kwargs):
        events.append(("in process", mode))
        return {"seconds": 0.5, "qparams": {"s": torch.ones(1)}, "variants": {}}

    def fake_child(scheme, mode, *args, **kwargs):
        events.append(("fresh", mode))
        return {"seconds": next(seconds[mode]), "variants": {}}

    monkeypatch.setattr(oneshot, "run_once", fake_run_once)
    monkeypatch.setattr(oneshot, "_child", fake_child)
    rows = oneshot.compare(["FP8"], oneshot.LLAMA3_8B, "cpu", reps=1, fresh=True, fresh_reps=3)
    assert events == [("in process", "plain"), ("in process", "drop-in")] * 2 + [
        ("fresh", "plain"), ("fresh", "drop-in"), ("fresh", "drop-in"), ("fresh", "plain"),
        ("fresh", "plain"), ("fresh", "drop-in")]
    assert [(r["mode"], r["fresh_process_s"], r["fresh_process_samples"]) for r in rows] == [
        ("plain", 2.0, [1.0, 3.0, 2.0]), ("drop-in", 5.0, [5.0, 4.0, 9.0])]
    text = oneshot.table(rows, oneshot._provenance("cpu", oneshot.LLAMA3_8B, "auto", "basic"))
    assert "fresh process s (median of 3)" in text
    assert "1.000, 3.000, 2.000" in text and "5.000, 4.000, 9.000" in text
    with pytest.raises(ValueError, match="fresh_reps must be at least 1"):
        oneshot.compare(["FP8"], oneshot.LLAMA3_8B, "cpu", reps=0, fresh=True, fresh_reps=0)


# --------------------------------------------------------------------------- #
# --split: the device work of a call, beside its wall time
# --------------------------------------------------------------------------- #
def _known_work(device):
    """A Prepared making two matrix products and one add per call; its setup
    makes a tensor of its own (not the call's work)."""
    from obskernels.bench.backends import Prepared

    a = torch.randn(256, 256, device=device)
    made = []

    def setup():
        made.append(torch.ones(4, device=device))

    def fn():
        torch.mm(a, a)
        torch.mm(a, a)
        return a.add(1)

    return Prepared(fn, setup=setup), made


def test_split_profiles_the_call_and_not_its_setup():
    from obskernels.bench.runner import SPLIT_CALLS, device_split

    prepared, made = _known_work("cpu")
    seconds, ops = device_split(prepared, "cpu")
    assert len(made) == SPLIT_CALLS  # one setup per profiled call
    # the call's own aten ops, per call; setup's aten::ones is outside the window
    assert set(ops) == {"aten::mm", "aten::add"}, ops
    assert ops["aten::mm"] > 0 and ops["aten::add"] > 0
    assert seconds == pytest.approx(sum(ops.values()) * 1e-6, rel=1e-3)


def test_split_goes_into_the_record_and_the_lead_table():
    from obskernels.bench import report
    from obskernels.bench.records import CaseInfo, Provenance, Record, Timing
    from obskernels.bench.runner import Options, _measured, _stats, interleaved_samples, with_split

    prepared, _ = _known_work("cpu")
    quiet = Options(min_reps=1, max_reps=1, min_time_s=0.0, progress=None)
    timed = _measured(prepared, "cpu", _stats(interleaved_samples([prepared], "cpu", quiet)[0]), "")
    assert timed.device_s is None  # taken apart (with_split), after every row is timed
    timing = with_split(timed, prepared, "cpu")
    assert timing.measured_s == timed.measured_s
    assert timing.device_s > 0 and set(timing.device_ops) == {"aten::mm", "aten::add"}
    assert "aten ops" in timing.device_method
    case = CaseInfo("w4096x4096 bf16 int8-channel", "weight", "weight", (4096, 4096), (4096, 4096),
                    False, "bf16", "channel", "int8 sym channel", "int8-channel")
    prov = Provenance("full", machine={"gpu": "a GPU"})

    def rec(backend, ms, dev_us):
        return Record("obs:memoryless_minmax", "observer", backend, case, prov, status="measured",
                      timing=Timing(measured_s=ms * 1e-3, device_s=dev_us * 1e-6))

    text = report.lead_table([rec("triton", 0.13, 9.8), rec("llmc", 0.34, 61.5)])
    head, _, row = text.splitlines()[:3]
    assert "DEV tri us" in head and "DEV llmc us" in head
    assert row.split()[-5:-3] == ["9.8", "61.5"], row
    assert "DEV: the device work of one call" in text
    # without a split the columns are not shown
    assert "DEV" not in report.lead_table([rec("triton", 0.13, 9.8).replace(timing=Timing(measured_s=1e-4))])


def test_a_split_that_fails_leaves_the_rows_time_and_says_why(monkeypatch):
    from obskernels.bench import runner

    def broken(prepared, device):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(runner, "device_split", broken)
    prepared, _ = _known_work("cpu")
    opts = Options(min_reps=1, max_reps=1, min_time_s=0.0, progress=None)
    calls = runner.interleaved_samples([prepared], "cpu", opts)[0]
    timing = runner.with_split(runner._measured(prepared, "cpu", runner._stats(calls), ""), prepared, "cpu")
    assert timing.measured_s > 0 and timing.device_s is None and timing.device_ops is None
    assert timing.device_method == "not taken: RuntimeError: no profiler here"


def test_issued_is_the_host_before_a_calls_first_launch(monkeypatch):
    """``issued_samples``: per timed call of a marked row, the clock from the
    call's start until its first launch through a launch site returned (the
    second launch and the time after it not counted); the warm-up's calls
    left out; None for a row not marked and for a call with no launch; the
    launch sites as they were afterwards."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared
    from obskernels.kernels import _replay

    clock = _FakeClock(step=0.0, sync=0.0)
    launched = []

    def site(self, *args, **kwargs):  # a launch: 1 ms on the clock
        launched.append(args)
        clock.now += 0.001

    monkeypatch.setattr(_replay.Replay, "__call__", site)
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    calls = []

    def ours():  # 3 ms of host (8 ms in the first), a launch, 2 ms, another launch, 4 ms
        calls.append(clock.now)
        clock.now += 0.008 if len(calls) == 1 else 0.003
        _replay.Replay.__call__(None, "first")
        clock.now += 0.002
        _replay.Replay.__call__(None, "second")
        clock.now += 0.004

    def other():
        clock.now += 0.005

    opts = Options(min_reps=3, max_reps=3, min_time_s=0.0, warmup_s=0.025, progress=None)
    got = runner.issued_samples([Prepared(ours), Prepared(other), Prepared(other)], "cpu", opts,
                                [True, False, True])
    assert len(calls) == 1 + 3  # 25 ms of warm-up in turns (one turn: 16 + 5 + 5 ms), then 3 timed
    assert got[0].host_s == pytest.approx([0.004] * 3) and got[0].launched_s == [None] * 3  # no CUDA
    assert got[1] is None and got[2] == runner.Issued([None] * 3, [None] * 3)
    assert _replay.Replay.__call__ is site
    assert len(launched) == 2 * len(calls)


def test_cuda_host_issued_is_the_host_before_a_calls_first_launch(monkeypatch):
    """cuda_host.issued_times: per single call (after the wipe), the clock
    from its start until its first launch through a site returned; None for
    a call with no launch; the sites as they were afterwards."""
    from obskernels.bench import cuda_host
    from obskernels.kernels import _replay

    clock = _FakeClock(step=0.0, sync=0.0)

    def site(self, *args):
        clock.now += 0.001

    monkeypatch.setattr(_replay.Replay, "__call__", site)
    monkeypatch.setattr(cuda_host.time, "perf_counter", clock)
    monkeypatch.setattr(cuda_host, "_sync", lambda: None)
    wipes = []

    def call():  # 3 ms of host, a launch, 2 ms, another launch
        clock.now += 0.003
        _replay.Replay.__call__(None)
        clock.now += 0.002
        _replay.Replay.__call__(None)

    assert cuda_host.issued_times(call, 3, lambda: wipes.append(1)) == pytest.approx([0.004] * 3)
    assert cuda_host.issued_times(lambda: None, 2, lambda: wipes.append(1)) == [None, None]
    assert len(wipes) == 5 and _replay.Replay.__call__ is site


def test_issued_on_cuda_times_the_launches_with_events(monkeypatch):
    """On CUDA (faked: events reading the fake clock, each record taking
    0.5 ms of host): the device's span runs from an event before the first
    launch to one after the last, and the first event's recording is not
    counted as host time before the launch (still 3 ms + the 1-ms launch)."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared
    from obskernels.kernels import _replay

    clock = _FakeClock(step=0.0, sync=0.0)

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock.now
            clock.now += 0.0005

        def elapsed_time(self, end):  # ms, as torch's
            return (end.at - self.at) * 1e3

    def site(self, *args):
        clock.now += 0.001

    monkeypatch.setattr(_replay.Replay, "__call__", site)
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    monkeypatch.setattr(runner.torch.cuda, "Event", Event)
    monkeypatch.setattr(runner, "_sync", lambda device: None)
    monkeypatch.setattr(runner, "_wipe_buffer", lambda device: None)

    def ours():
        clock.now += 0.003
        _replay.Replay.__call__(None)
        clock.now += 0.002
        _replay.Replay.__call__(None)
        clock.now += 0.004

    opts = Options(min_reps=3, max_reps=3, min_time_s=0.0, warmup_s=0.0, progress=None)
    (got,) = runner.issued_samples([Prepared(ours)], "cuda", opts, [True])
    assert got.host_s == pytest.approx([0.004] * 3)
    # the fake events read the host's clock: from the start's record to the last end's,
    # 0.5 (that record) + 1 (the launch) + 0.5 (its end's record) + 2 + 1 (the second launch)
    assert got.launched_s == pytest.approx([0.005] * 3)


def test_issued_lands_in_the_rows_of_our_backend(monkeypatch):
    """``_issue_group`` takes ``issued_samples`` of the rows whose backend
    launches through launch sites (not llm-compressor's), and ``_timings``
    puts their median into those rows' timing, the others' left without;
    a failing pass leaves every row's time and says why in ours."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared
    from obskernels.bench.records import Record
    from obskernels.kernels import _replay

    clock = _FakeClock(step=0.0, sync=0.0)
    monkeypatch.setattr(_replay.Replay, "__call__", lambda self: None)
    monkeypatch.setattr(runner.time, "perf_counter", clock)

    def launching(host_s):
        def fn():
            clock.now += host_s
            _replay.Replay.__call__(None)
            clock.now += 0.010
        return Prepared(fn)

    case = bench_cases.Case("weight", (16, 256), "bf16", "int8-channel", (4096, 4096))
    target = bench_cases.OBSERVERS["memoryless_minmax"]
    rec = {b: Record("obs:memoryless_minmax", "observer", b, None, None) for b in ("llmc", "triton")}
    rows = [(rec["llmc"], runner._ToTime(launching(0.001))), (rec["triton"], runner._ToTime(launching(0.002)))]
    opts = Options(min_reps=3, max_reps=3, min_time_s=0.0, warmup_s=0.0, progress=None)
    group = runner._Group(case, target, rows, [r for _, r in rows], [[], []], [], [None, None])
    runner._sample_group(group, "cpu", opts)
    runner._issue_group(group, "cpu", opts)
    theirs, ours = runner._timings(group, "cpu", opts)
    assert theirs.issued_s is None and theirs.issued_method is None
    assert ours.issued_s == pytest.approx(0.002) and ours.measured_s == pytest.approx(0.012)

    def broken(*args, **kwargs):
        raise RuntimeError("no sites")

    monkeypatch.setattr(runner, "issued_samples", broken)
    runner._issue_group(group, "cpu", opts)
    theirs, ours = runner._timings(group, "cpu", opts)
    assert ours.measured_s == pytest.approx(0.012) and ours.issued_method == "not taken: RuntimeError: no sites"
    assert theirs.issued_method is None


def test_issued_sees_the_observers_real_launches():
    """The real launch sites (the interpreter's, here) are the ones wrapped:
    an obskernels observer call's first launch is seen, a reference call
    makes none."""
    from obskernels.bench import runner
    from obskernels.bench.backends import prepare
    from obskernels.bench.cases import OBSERVERS

    case = bench_cases.Case("weight", (16, 256), "bf16", "int8-channel", (4096, 4096))
    rows = [prepare(case, OBSERVERS["memoryless_minmax"], backend, device="cpu")
            for backend in ("triton", "reference")]
    opts = Options(min_reps=2, max_reps=2, min_time_s=0.0, warmup_s=0.0, progress=None)
    ours, reference = runner.issued_samples(rows, "cpu", opts, [True, True])
    assert len(ours.host_s) == 2 and all(t is not None and t > 0 for t in ours.host_s), ours
    assert reference == runner.Issued([None, None], [None, None])


def test_issued_goes_into_the_record_and_the_lead_table():
    from obskernels.bench import report, runner
    from obskernels.bench.records import CaseInfo, Provenance, Record, Timing

    timing = runner._with_issued(Timing(measured_s=2e-4), runner.Issued([60e-6, None, 70e-6, 90e-6],
                                                                         [20e-6, None, 30e-6, 25e-6]))
    assert timing.issued_s == pytest.approx(70e-6) and timing.launched_s == pytest.approx(25e-6)
    assert "median of 3 calls" in timing.issued_method and "(CUDA events)" in timing.issued_method
    off_cuda = runner._with_issued(Timing(), runner.Issued([60e-6], [None]))
    assert off_cuda.launched_s is None and "CUDA events" not in off_cuda.issued_method
    assert runner._with_issued(Timing(), runner.Issued([None, None], [None, None])).issued_method == (
        "no launch through a launch site")
    assert runner._with_issued(Timing(), RuntimeError("gone")).issued_method == "not taken: RuntimeError: gone"
    assert runner._with_issued(Timing(measured_s=1.0), None) == Timing(measured_s=1.0)
    case = CaseInfo("w4096x4096 bf16 int8-channel", "weight", "weight", (4096, 4096), (4096, 4096),
                    False, "bf16", "channel", "int8 sym channel", "int8-channel")
    prov = Provenance("full", machine={"gpu": "a GPU"})
    ours = Record("obs:memoryless_minmax", "observer", "triton", case, prov, status="measured", timing=timing)
    theirs = Record("obs:memoryless_minmax", "observer", "llmc", case, prov, status="measured",
                    timing=Timing(measured_s=5e-4))
    again = Record.from_dict(json.loads(json.dumps(ours.to_dict())))
    assert again.timing == timing
    text = report.lead_table([ours, theirs])
    head, _, row = text.splitlines()[:3]
    assert head.index("llmc/tri") < head.index("ISSUED tri us") < head.index("LAUNCHED tri us")
    assert row.split()[8:10] == ["70.0", "25.0"], row  # after the case (3 words), the op, 4 MEAS cells
    assert "ISSUED: the host's time in our call before its first kernel launch" in text
    assert "LAUNCHED: in the same calls, from just before our first launch was issued" in text
    assert "ISSUED" not in report.lead_table([ours.replace(timing=Timing(measured_s=2e-4)), theirs])


@pytest.mark.gpu
def test_a_cuda_run_gives_our_rows_the_host_before_their_first_launch():
    case = bench_cases.Case("weight", (256, 512), "bf16", "int8-channel", (4096, 4096))
    opts = Options(mode="tiny", ops=(), observers=("memoryless_minmax",), backends=("reference", "triton"),
                   cases=[case], device="cuda", min_reps=3, max_reps=3, min_time_s=0.0, model=False,
                   progress=None)
    records = {r.backend: r for r in run(opts) if r.scope == "run"}
    ours, reference = records["triton"].timing, records["reference"].timing
    assert 0 < ours.issued_s < ours.measured_s and 0 < ours.launched_s < ours.measured_s, ours
    assert reference.measured_s > 0 and reference.issued_s is None and reference.issued_method is None


@pytest.mark.gpu
def test_split_counts_the_calls_kernels_on_cuda():
    from obskernels.bench.runner import device_split

    prepared, _ = _known_work("cuda")
    seconds, ops = device_split(prepared, "cuda")
    # three kernels of a few us per call; the 256 MB wipe (~100 us) before
    # the profiler starts is not among them
    assert 0 < seconds < 50e-6 and 1 <= len(ops) <= 3, ops


def test_rows_are_timed_after_a_warm_up_of_their_own_calls(monkeypatch):
    """Calls of 10 ms on the clock: 25 ms of warm-up is three untimed calls,
    then the timed ones (min_reps of them, min_time_s 0)."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared

    clock = _FakeClock(step=0.010, sync=0.0)
    calls = []

    def fn():
        calls.append(clock.now)
        clock.call()

    monkeypatch.setattr(runner.time, "perf_counter", clock)
    opts = Options(min_reps=4, max_reps=4, min_time_s=0.0, warmup_s=0.025, progress=None)
    median, reps, fastest = runner._stats(runner.interleaved_samples([Prepared(fn)], "cpu", opts)[0])
    assert (len(calls), reps) == (3 + 4, 4)
    assert median == pytest.approx(0.010) and fastest == pytest.approx(0.010)
    calls.clear()
    runner.interleaved_samples([Prepared(fn)], "cpu", dataclasses.replace(opts, warmup_s=0.0))
    assert len(calls) == 4


def test_rows_of_a_case_take_turns_and_stop_on_their_own_time(monkeypatch):
    """Calls of 10 ms and 30 ms on the clock, timed together: one call each
    in turn until a row has its own min_time_s (50 ms at 2 calls or more)
    or max_reps (4); the 30-ms row stops after its 2nd call, the other goes
    on alone. The warm-up (25 ms) goes in the same turns."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared

    clock = _FakeClock(step=0.0, sync=0.0)
    order = []

    def row(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return Prepared(fn)

    monkeypatch.setattr(runner.time, "perf_counter", clock)
    opts = Options(min_reps=2, max_reps=4, min_time_s=0.05, warmup_s=0.025, progress=None)
    timed = [runner._stats(t) for t in
             runner.interleaved_samples([row("a", 0.010), row("b", 0.030)], "cpu", opts)]
    assert "".join(order) == "ab" + "abab" + "aa"
    assert timed == [pytest.approx((0.010, 4, 0.010)), pytest.approx((0.030, 2, 0.030))]


def test_splits_are_taken_after_every_row_is_timed(monkeypatch):
    """A CUDA profiler slows the process's later CUDA calls (CUPTI stays
    attached), so --split profiles no row before the last one is timed; each
    split still lands in its own row's record."""
    from obskernels.bench import runner

    order = []

    def fake_split(prepared, device):
        prepared.fn()  # which backend's call this is: the letter it logs
        letter = order.pop()
        order.append("S")
        return 1e-6, {letter: 1.0}

    monkeypatch.setattr(runner, "device_split", fake_split)
    case_b = bench_cases.Case("weight", (16, 256), "bf16", "int8-channel", (4096, 4096))
    records, _ = _two_backend_run(monkeypatch, split=True, more_cases=[case_b], log=order)
    order = "".join(order)
    assert order.count("S") == 4 and order.endswith("SSSS"), order  # 2 cases x 2 backends
    rows = [r for r in records if r.scope == "run"]
    assert len(rows) == 4 and len({r.case.label for r in rows}) == 2
    for r in rows:
        assert r.timing.measured_s is not None and r.timing.device_s == 1e-6
        assert set(r.timing.device_ops) == {r.backend[0]}, (r.backend, r.timing.device_ops)
        assert r.timing.device_method.startswith("torch profiler over")


def _burst_run(monkeypatch, rounds):
    """``run`` over three cases (A, B, C) of one op, two backends faked
    (10 ms a call; each warmed up by one call when prepared), six timed
    calls per row, with host noise in the first 1.45 s (a call then takes
    100 ms): as long as one case's rows take in one stretch. Returns the
    records and the cases' letters in call order."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared

    clock = _FakeClock(step=0.0, sync=0.0)
    order = []
    letters = {16: "A", 32: "B", 48: "C"}

    def fake_prepare(case, target, backend, device, value):
        def fn():
            order.append(letters[case.shape[0]])
            clock.now += 0.100 if clock.now < 1.45 else 0.010
        return Prepared(fn)

    monkeypatch.setattr(runner, "prepare", fake_prepare)
    monkeypatch.setattr(runner, "backend_unavailable_reason", lambda backend, device: None)
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    cases = [bench_cases.Case("weight", (rows, 256), "bf16", "int4-group128", (4096, 4096)) for rows in letters]
    opts = Options(mode="tiny", ops=("min_max",), observers=(), backends=("reference", "llmc-eager"),
                   cases=cases, min_reps=6, max_reps=6, min_time_s=0.0, max_time_s=60.0, warmup_s=0.0,
                   model=False, progress=None, rounds=rounds)
    return [r for r in run(opts) if r.scope == "run"], "".join(order)


def test_rounds_spread_each_rows_calls_over_passes_of_the_whole_run(monkeypatch):
    """--rounds: every row's calls are taken in passes over the whole run
    (A B C, then C B A, A B C, ...: every other pass backwards, so that a
    case's place in the run changes from pass to pass), each pass its share
    of the calls, the figure the median of all of them; so host noise
    lasting one case's stretch of the run slows one pass of each row it
    meets, not every call of one case."""
    records, order = _burst_run(monkeypatch, rounds=1)
    assert order == "A" * 14 + "B" * 14 + "C" * 14  # two warm-up calls each, then 2 x 6 in turns
    by_case = {r.case.label.split()[0]: r.timing for r in records}
    assert by_case["w16x256"].measured_s == pytest.approx(0.100)  # the noise took all of A's calls
    assert by_case["w32x256"].measured_s == pytest.approx(0.010)
    assert all(r.timing.measured_pass_s is None for r in records)  # one pass: nothing per pass

    records, order = _burst_run(monkeypatch, rounds=3)
    assert order == ("AA" + "A" * 4 + "BB" + "B" * 4 + "CC" + "C" * 4 + "C" * 4 + "B" * 4 + "A" * 4
                     + "A" * 4 + "B" * 4 + "C" * 4)
    assert len(records) == 6
    for r in records:
        assert r.timing.measured_reps == 6 and r.timing.measured_s == pytest.approx(0.010), r
        assert r.timing.measured_min_s == pytest.approx(0.010)
        assert r.timing.timer.endswith(", in turns with the case's other backends, 3 passes over the run")
    # each pass's median: the noise in A's and B's first pass, none after it
    passes = {r.case.label.split()[0]: r.timing.measured_pass_s for r in records if r.backend == "reference"}
    assert passes["w16x256"] == pytest.approx((0.100, 0.010, 0.010))
    assert passes["w32x256"] == pytest.approx((0.100, 0.010, 0.010))
    assert passes["w48x256"][1:] == pytest.approx((0.010, 0.010))
    again = records[0].from_dict(json.loads(json.dumps(records[0].to_dict())))
    assert again.timing.measured_pass_s == records[0].timing.measured_pass_s


def test_passes_share_the_calls_and_limits_and_refuse_no_rounds():
    from obskernels.bench import runner

    opts = Options(min_reps=5, max_reps=30, min_time_s=0.3, max_time_s=3.0, rounds=3)
    each = runner.passes(opts)
    assert (each.min_reps, each.max_reps, each.min_time_s, each.max_time_s) == (2, 10, pytest.approx(0.1),
                                                                                pytest.approx(1.0))
    assert runner.passes(dataclasses.replace(opts, rounds=1)).max_reps == 30
    few = runner.passes(Options(min_reps=3, max_reps=5, rounds=3))  # --reps 5: at most 5 calls in all
    assert (few.min_reps, few.max_reps) == (1, 1)
    two = runner.passes(Options(min_reps=3, max_reps=5, rounds=2))
    assert (two.min_reps, two.max_reps) == (2, 2)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        runner.passes(dataclasses.replace(opts, rounds=0))
    from obskernels.bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def _two_backend_run(monkeypatch, fail_b_at=None, split=False, more_cases=(), log=None, rounds=1):
    """``run`` over one case and one op with two backends faked: 'reference'
    calls of 10 ms, 'llmc-eager' of 30 ms (raising from its call number
    ``fail_b_at`` on); returns the records by backend and the order of the calls.
    ``more_cases``: further cases after the first (then the records as a list,
    and the order's list itself); ``log``: the list the calls log into."""
    from obskernels.bench import runner
    from obskernels.bench.backends import Prepared

    clock = _FakeClock(step=0.0, sync=0.0)
    order = [] if log is None else log

    def fake_prepare(case, target, backend, device, value):
        seconds = {"reference": 0.010, "llmc-eager": 0.030}[backend]

        def fn():
            order.append(backend[0])
            if backend == "llmc-eager" and fail_b_at is not None and order.count("l") >= fail_b_at:
                raise RuntimeError("the call broke")
            clock.now += seconds
        return Prepared(fn)

    monkeypatch.setattr(runner, "prepare", fake_prepare)
    monkeypatch.setattr(runner, "backend_unavailable_reason", lambda backend, device: None)
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    opts = Options(mode="tiny", ops=("min_max",), observers=(), backends=("reference", "llmc-eager"),
                   cases=[case, *more_cases], min_reps=2, max_reps=4, min_time_s=0.05, warmup_s=0.0,
                   model=False, split=split, progress=None, rounds=rounds)
    if more_cases:
        return run(opts), order
    records = {r.backend: r for r in run(opts) if r.scope == "run"}
    return records, "".join(order)


def test_a_cases_backends_are_timed_in_turns(monkeypatch):
    records, order = _two_backend_run(monkeypatch)
    # a warm-up call each as the rows are prepared, then the turns
    assert order == "rl" + "rlrl" + "rr"
    ref, llmc = records["reference"].timing, records["llmc-eager"].timing
    assert (ref.measured_s, ref.measured_reps) == (pytest.approx(0.010), 4)
    assert (llmc.measured_s, llmc.measured_reps) == (pytest.approx(0.030), 2)
    assert ref.timer == llmc.timer == "wall, synchronised, median (cpu), in turns with the case's other backends"
    assert records["reference"].status == records["llmc-eager"].status == "measured"


def test_a_row_that_fails_in_turns_leaves_the_others_timed_alone(monkeypatch):
    records, order = _two_backend_run(monkeypatch, fail_b_at=2)  # its first timed call
    assert order == "rl" + "rl" + "rrrr" + "l"
    ref, llmc = records["reference"], records["llmc-eager"]
    assert ref.status == "measured" and ref.timing.measured_reps == 4
    assert ref.timing.timer == "wall, synchronised, median (cpu)"  # alone
    assert llmc.status == "error: RuntimeError: the call broke" and llmc.timing.measured_s is None


def test_a_row_that_fails_in_a_later_pass_keeps_its_error_and_the_others_their_calls(monkeypatch):
    """--rounds 2: a row that fails in the second pass is an error, as in
    one pass; the other row keeps its calls of both passes, the second
    timed alone."""
    records, order = _two_backend_run(monkeypatch, fail_b_at=3, rounds=2)
    # warm-ups; pass 1 in turns (1-2 calls a row); pass 2 in turns until the
    # failure, then each row alone
    assert order == "rl" + "rlr" + "rl" + "rr" + "l"
    ref, llmc = records["reference"], records["llmc-eager"]
    assert llmc.status == "error: RuntimeError: the call broke" and llmc.timing.measured_s is None
    assert ref.status == "measured" and ref.timing.measured_reps == 4
    assert ref.timing.measured_s == pytest.approx(0.010) and len(ref.timing.measured_pass_s) == 2
    assert ref.timing.timer == "wall, synchronised, median (cpu), 2 passes over the run"  # alone in one


def test_the_sm90a_compiles_run_beside_the_counts_and_end_before_the_host_is_timed(monkeypatch):
    """The SASS worker starts before the interpreter's counts (a second core
    compiles meanwhile) and is collected before the host paths are timed
    (which a busy machine would slow)."""
    from obskernels.bench import runner

    events = []
    monkeypatch.setattr(runner, "start_sass",
                        lambda jobs, progress, python=None: events.append(("start", len(jobs))) or "run")
    monkeypatch.setattr(runner, "model_counts", lambda c, t, b, s: events.append("count") or {"status": "x"})
    monkeypatch.setattr(runner, "sass_results", lambda run: events.append(("collect", run)) or [{}])
    monkeypatch.setattr(runner, "_host_paths", lambda plan, unavailable, opts: events.append("host") or {})
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    run(Options(mode="tiny", ops=("min_max",), observers=(), backends=("triton",), cases=[case],
                project_full=False, min_reps=1, max_reps=1, min_time_s=0.0, progress=None))
    assert events == [("start", 1), "count", ("collect", "run"), "host"]


def test_a_sass_worker_that_fails_or_overruns_gives_every_job_its_status(tmp_path, monkeypatch):
    from obskernels.bench import counting

    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128")
    jobs = [(case, bench_cases.OPS["min_max"], "triton", case.shape)] * 2
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\nexit 3\n")
    stuck = tmp_path / "stuck"
    stuck.write_text("#!/bin/sh\nexec sleep 30\n")
    for script in (failing, stuck):
        script.chmod(0o755)
    got = counting.sass_results(counting.start_sass(jobs, None, str(failing)))
    assert got == [{"status": "error: the SASS worker exited with 3"}] * 2 and got[0] is not got[1]
    monkeypatch.setattr(counting, "SASS_TIMEOUT_S", 0.5)
    run = counting.start_sass(jobs, None, str(stuck))
    assert counting.sass_results(run) == [{"status": "error: the SASS worker timed out"}] * 2
    assert run.proc.returncode is not None  # killed, not left running


def test_a_run_that_fails_while_counting_stops_its_sass_worker(monkeypatch):
    from obskernels.bench import runner

    stopped = []

    class FakeRun:
        def stop(self):
            stopped.append(True)

    def broken(c, t, b, s):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "start_sass", lambda jobs, progress, python=None: FakeRun())
    monkeypatch.setattr(runner, "model_counts", broken)
    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128", (4096, 4096))
    with pytest.raises(KeyboardInterrupt):
        run(Options(mode="tiny", ops=("min_max",), observers=(), backends=("triton",), cases=[case],
                    project_full=False, progress=None))
    assert stopped == [True]
