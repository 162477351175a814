"""Host-side overhead of the triton path: aten ops, host reads and kernel launches per call.

Counted with the benchmark harness's own counters (``obskernels.bench.traffic``:
every aten op that moves data, every Triton grid run by the interpreter) plus
a count of the Python-level reads that turn a device value into a host value
(``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()``,
``__index__``): on a GPU each one waits for every queued kernel. The budgets
below are what each call needs, stated with the reason; a test fails when a
read, a host-side tensor op or a launch is added back.

Budgets (triton backend, kernels in the interpreter on the CPU):
- min_max, accumulate_sq: no aten op, no read, one launch.
- mse_search, groups held in registers: no aten op, no read, two launches
  (search, whose programs each store their per-step "any group improved"
  words, and choose, which ORs them). The qparams constants and the grid's
  steps are computed on the host in Python and in the kernels; nothing is
  copied to the device.
- mse_search, split path (large groups): no aten op, no read, two launches
  (min/max partials, which also clear the search's counters; then the search,
  whose last programs finish each group and the whole search by tickets).
  The partial min/max of a group split over several programs needs its own
  launch before the search can start (see the launcher's docstring).
- importance (imatrix) given normalised: its value checks (finite,
  non-negative) are one aminmax and ONE read. Given raw (``ops.importance``:
  sum / count and its verdict, one launch) with ``importance_status``: no
  read; one aten op, torch's mean of it (the reference's own rounding and
  summation order on the device), which the search's load divides by.
- g_idx: its value checks (range, group sizes) are one sort -- which also
  gives the column order -- one comparison and ONE read.
- observers on the triton backend: forward is kernels only (no aten op, no
  read; imatrix adds the importance's mean; an observer's first observation
  under nonfinite="error" makes its record, one device-to-device copy);
  get_qparams is kernels only with ONE read (the non-finite record, the
  importance's verdict and the scale flags), none under "propagate". See
  OBSERVER_FORWARD and test_forward_and_get_qparams_read_and_copy_nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import random
import shutil
import struct
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from obskernels import ops
from obskernels.backends import use_backend
from obskernels.bench.cases import SCHEMES, Case, make_importance, make_value
from obskernels.bench.traffic import count_traffic, host_reads_seen, interpreter_active
from obskernels.observers import Observer
from obskernels.spec.checks import all_finite, check_g_idx

from helpers import IMATRIX, MSE

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="Triton launches are counted in triton's interpreter (no CUDA here)"
)

mse_module = importlib.import_module("obskernels.kernels.mse_search")

# Python-level reads of a tensor's value (each a device -> host sync on a GPU)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
# groups of more than 64 elements take the search's split path
SPLIT_CONFIG = dict(max_reg_group=64, chunk=64)


@contextlib.contextmanager
def counted():
    """(counts, reads): the harness's Counts of the block and the host reads
    made in it, each as (method, 'file:line' of the caller)."""
    reads = []

    def read(name, tensor):
        if tensor.device.type != "meta" and not interpreter_active():
            frame = traceback.extract_stack(limit=3)[0]  # the caller of the read's method
            reads.append((name, f"{os.path.basename(frame.filename)}:{frame.lineno}"))

    # the counters' own hooks (a tolist counted as a sync) inside these, so
    # that a read's caller is the code under test
    with count_traffic("cpu", triton=True) as counts, host_reads_seen(read, READS):
        yield counts, reads


def value_of(kind, shape, scheme, dtype="bf16"):
    case = Case(kind, shape, dtype, scheme)
    return case, make_value(case)


def describe(counts, reads):
    return f"aten ops {dict(counts.op_names)}, reads {reads}"


# --------------------------------------------------------------------------- #
# operations
# --------------------------------------------------------------------------- #
# id, (kind, shape, scheme), prepare(value, args) -> the call, aten ops, reads, launches
# (prepare allocates the call's other inputs outside the count)
def _imatrix(v, a):
    importance = make_importance(v.shape[1])
    return lambda: ops.mse_search(v, "weight", a, importance=importance, **IMATRIX)


def _raw_imatrix(v, a):
    from obskernels.spec.record import STATUS_INIT

    sums, count = make_importance(v.shape[1]) * 3, torch.tensor(3)
    status = torch.tensor(STATUS_INIT)

    def call():
        imp = ops.importance(sums, count, status)
        return ops.mse_search(v, "weight", a, importance=imp, importance_status=status,
                              **IMATRIX)

    return call


def _g_idx(v, a):
    g_idx = torch.arange(v.shape[1]) % (v.shape[1] // a.group_size)
    return lambda: ops.min_max(v, "weight", a, g_idx=g_idx)


def _accumulate(v, a):
    sum_buf, count = torch.zeros(v.shape[1]), torch.zeros((), dtype=torch.int64)
    return lambda: ops.accumulate_sq(v, sum_buf, count)


OP_BUDGETS = [
    ("min_max int8-channel", ("weight", (8, 256), "int8-channel"),
     lambda v, a: lambda: ops.min_max(v, "weight", a), 0, 0, 1),
    ("min_max fp8-block128", ("weight", (128, 128), "fp8-block128"),
     lambda v, a: lambda: ops.min_max(v, "weight", a), 0, 0, 1),
    ("min_max act tensor", ("activation", (16, 256), "fp8-tensor-act"),
     lambda v, a: lambda: ops.min_max(v, "input", a), 0, 0, 1),
    ("mse int4-group128", ("weight", (8, 256), "int4-group128"),
     lambda v, a: lambda: ops.mse_search(v, "weight", a, **MSE), 0, 0, 2),
    ("mse nvfp4-tg16", ("weight", (8, 64), "nvfp4-tg16"),
     lambda v, a: lambda: ops.mse_search(v, "weight", a, **MSE), 0, 0, 2),
    ("mse act tensor", ("activation", (16, 256), "fp8-tensor-act"),
     lambda v, a: lambda: ops.mse_search(v, "input", a, **MSE), 0, 0, 2),
    ("imatrix int8-channel", ("weight", (8, 256), "int8-channel"), _imatrix, 2, 1, 2),
    ("imatrix raw int4-group128", ("weight", (8, 256), "int4-group128"), _raw_imatrix, 1, 0, 3),
    ("imatrix raw int8-channel", ("weight", (8, 256), "int8-channel"), _raw_imatrix, 1, 0, 3),
    ("imatrix uniform", ("weight", (8, 256), "int8-channel"),
     lambda v, a: lambda: ops.mse_search(v, "weight", a, **IMATRIX), 0, 0, 2),
    ("min_max g_idx", ("weight", (8, 256), "int4-group128"), _g_idx, 6, 1, 1),
    ("accumulate_sq", ("activation", (16, 256), "fp8-tensor-act"), _accumulate, 0, 0, 1),
]


@needs_interpreter
@pytest.mark.parametrize("row", OP_BUDGETS, ids=[r[0] for r in OP_BUDGETS])
def test_op_host_overhead(row):
    name, (kind, shape, scheme), prepare, max_ops, max_reads, launches = row
    case, value = value_of(kind, shape, scheme)
    call = prepare(value, case.spec.qargs())
    with use_backend("triton"):
        call()  # compiled and warm: only the call itself is counted
        with counted() as (counts, reads):
            call()
    what = f"{name}: {counts.triton_launches} launches; {describe(counts, reads)}"
    assert counts.triton_launches == launches, what
    assert counts.aten_ops <= max_ops, what
    assert len(reads) <= max_reads, what


@needs_interpreter
def test_mse_split_path_host_overhead(pin_launch):
    """Groups too large for registers: two launches, nothing on the host."""
    case, value = value_of("weight", (4, 256), "int8-channel")
    pin_launch("mse_search", **SPLIT_CONFIG)
    with use_backend("triton"):
        ops.mse_search(value, "weight", case.spec.qargs(), **MSE)
        with counted() as (counts, reads):
            ops.mse_search(value, "weight", case.spec.qargs(), **MSE)
    names = sorted(k for k in counts.op_names if k.startswith("triton:"))
    assert names == ["triton:_minmax_part_kernel", "triton:_search_part_kernel"], \
        describe(counts, reads)
    assert counts.triton_launches == 2, describe(counts, reads)
    assert counts.aten_ops == 0 and reads == [], describe(counts, reads)


@needs_interpreter
def test_mse_split_path_raw_importance_host_overhead(pin_launch):
    """Large groups with raw importance: the importance launch and the split
    path's two, torch's mean of the importance, no read."""
    case, value = value_of("weight", (4, 256), "int8-channel")
    pin_launch("mse_search", **SPLIT_CONFIG)
    call = _raw_imatrix(value, case.spec.qargs())
    with use_backend("triton"):
        call()
        with counted() as (counts, reads):
            call()
    names = sorted(k for k in counts.op_names if k.startswith("triton:"))
    assert names == ["triton:_importance_kernel", "triton:_minmax_part_kernel",
                     "triton:_search_part_kernel"], describe(counts, reads)
    assert counts.aten_ops == 1 and reads == [], describe(counts, reads)


# --------------------------------------------------------------------------- #
# observers: one call = observer(value) + get_qparams()
# --------------------------------------------------------------------------- #
# observer -> forward's (triton launches, aten ops, reads); get_qparams is one
# calculate_qparams launch (+ one for a TENSOR_GROUP global scale), no aten op
# and ONE read (the non-finite record and the scale flags) for every observer.
OBSERVER_FORWARD = {
    # min_max with its epilogue: combine with the held statistics, record
    "memoryless_minmax": (1, 0, 0),
    "static_minmax": (1, 0, 0),
    "minmax": (1, 0, 0),
    # mse_search (search + choose), which records the value itself; a search
    # that cannot stop early (nvfp4_expanded: patience 1000 over 111 steps)
    # writes its ranges itself, no choose launch
    "memoryless_mse": (2, 0, 0),
    "mse": (2, 0, 0),
    "nvfp4_expanded_mse": (1, 0, 0),
    # + the importance (sum / count and its verdict: one launch, no read; the
    # fallback warning comes at get_qparams, from its one read) and torch's
    # mean of it (one aten op: the reference's own summation order on the
    # device), which the search's importance load divides by
    "imatrix_mse": (3, 1, 0),
    "nvfp4_expanded_imatrix": (2, 1, 0),
}
# a min/max or MSE observer's weight is observed with its qparams
# (ops.min_max_qparams: in min_max's epilogue at these shapes;
# ops.mse_search_qparams: in the choice's, and where the search makes no
# choice, which nvfp4_expanded_mse's cannot, one calculate_qparams launch
# more in forward): its get_qparams launches nothing and still reads once.
# TENSOR_GROUP's global scale needs every group: min_max writes partials
# for one qparams launch more; a search is followed by calculate_qparams'
# two launches (absmax, qparams), as its get_qparams would make them
QPARAMS_AHEAD = {"memoryless_minmax", "static_minmax", "minmax", "memoryless_mse", "mse",
                 "nvfp4_expanded_mse"}
QPARAMS_LAUNCHED = {"nvfp4_expanded_mse"}
MINMAX_FAMILY = {"memoryless_minmax", "static_minmax", "minmax"}
# search observers whose later observations combine with held statistics:
# + one combine_statistics launch (the moving average, and the record)
SEARCH_COMBINES = {"mse"}
# one observation + get_qparams, in kernel launches (the targets:
# minmax family <= 3, MSE family <= 5, imatrix <= 6)
FAMILY_LAUNCHES = {"memoryless_minmax": 3, "static_minmax": 3, "minmax": 3,
                   "memoryless_mse": 5, "mse": 5, "nvfp4_expanded_mse": 5, "imatrix_mse": 6,
                   "nvfp4_expanded_imatrix": 6}
OBSERVER_CASES = [
    ("weight", (8, 256), "int4-group128"),
    ("weight", (8, 256), "int8-channel"),
    ("weight", (8, 64), "nvfp4-tg16"),
    ("activation", (16, 256), "fp8-tensor-act"),
    ("activation", (16, 64), "nvfp4-tg16-act"),
]


def _observer_rows():
    for kind, shape, scheme in OBSERVER_CASES:
        for name in OBSERVER_FORWARD:
            if "imatrix" in name and kind != "weight":
                continue
            yield pytest.param(kind, shape, scheme, name, id=f"{scheme}-{name}")


class _Imatrix(torch.nn.Identity):
    def __init__(self, in_features):
        super().__init__()
        self.in_features = in_features


@needs_interpreter
@pytest.mark.parametrize("kind,shape,scheme,name", list(_observer_rows()))
def test_observer_host_overhead(kind, shape, scheme, name):
    """forward: no host read (imatrix: its importance), statistics combined in
    the measuring kernels; get_qparams: kernels only, one read. Activations
    are observed twice so that the held statistics are combined."""
    case, value = value_of(kind, shape, scheme)

    def fresh():
        obs = Observer.load_from_registry(name, base_name=case.base_name, args=case.spec.qargs())
        if "imatrix" in name:
            module = _Imatrix(shape[1])
            obs.attach(module)
            module(torch.randn(4, shape[1]))
        return obs

    with use_backend("triton"):
        warm = fresh()
        for _ in range(2):
            warm(value)
        warm.get_qparams()
        obs = fresh()
        if kind == "activation":
            obs(value)  # the counted observation combines with these statistics
        with counted() as (fwd, fwd_reads):
            obs(value)
        with counted() as (qp, qp_reads):
            qparams = obs.get_qparams()
    assert qparams["scale"].numel() > 0
    launches, max_ops, max_reads = OBSERVER_FORWARD[name]
    launches += kind == "activation" and name in SEARCH_COMBINES  # its second observation
    tensor_group = case.spec.strategy == "tensor_group"
    ahead = kind == "weight" and name in QPARAMS_AHEAD
    if ahead and tensor_group:
        launches += 1 if name in MINMAX_FAMILY else 2
    else:
        launches += ahead and name in QPARAMS_LAUNCHED
    what = (f"{name} on {case.label}: forward {fwd.triton_launches} launches, "
            f"{describe(fwd, fwd_reads)}; get_qparams {qp.triton_launches} launches, "
            f"{describe(qp, qp_reads)}")
    assert fwd.triton_launches == launches, what
    # a weight's counted observation is the observer's first: it makes the
    # record (one device-to-device copy of a fresh one, spec.record.new_record)
    assert fwd.aten_ops <= max_ops + (kind == "weight"), what
    assert len(fwd_reads) <= max_reads, what
    assert fwd.syncs == 0, what
    assert qp.triton_launches == (0 if ahead else 1 + tensor_group), what
    assert qp.aten_ops == 0, what
    assert len(qp_reads) == 1, what
    assert fwd.triton_launches + qp.triton_launches <= FAMILY_LAUNCHES[name], what
    # launches in all, an aten op (imatrix: the importance's mean) counted as
    # one: within the target too, but for imatrix with a TENSOR_GROUP global
    # scale (its absmax launch makes 6 kernels, and the mean a seventh), and
    # a first observation's record
    assert fwd.launches + qp.launches <= FAMILY_LAUNCHES[name] + tensor_group + (kind == "weight"), what


@needs_interpreter
def test_observer_qparams_agree_across_backends():
    """The kernels-only path gives the reference observer's qparams, bit for
    bit (a combining observer over three observations, and a TENSOR_GROUP one)."""
    for kind, shape, scheme in OBSERVER_CASES:
        case, value = value_of(kind, shape, scheme)
        for name in ("static_minmax", "minmax", "mse"):
            got = {}
            for backend in ("reference", "triton"):
                with use_backend(backend):
                    obs = Observer.load_from_registry(name, base_name=case.base_name,
                                                      args=case.spec.qargs())
                    for k in range(3 if kind == "activation" else 1):
                        obs(value * (1 + k))
                    got[backend] = obs.get_qparams()
            for key in ("scale", "zero_point", "global_scale"):
                a, b = got["reference"][key], got["triton"][key]
                assert (a is None) == (b is None), key
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), (
                        f"{name} {scheme} {key}: {a.flatten()[:4]} != {b.flatten()[:4]}")


# --------------------------------------------------------------------------- #
# capturable: nothing read, nothing copied from the host (nonfinite="propagate")
# --------------------------------------------------------------------------- #
class HostData(TorchDispatchMode):
    """Counts the tensors a block makes from host data (``torch.tensor(...)``
    dispatches ``aten.lift_fresh``: on a GPU a host -> device copy) and the
    copies between devices; what a CUDA graph cannot capture."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name.startswith("aten.lift_fresh"):
            self.made.append(name)
        elif name in ("aten._to_copy", "aten.copy_"):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target else set())
            if len(devices) > 1:
                self.made.append(f"{name} {sorted(map(str, devices))}")
        return func(*args, **kwargs)


CAPTURED = [n for n in OBSERVER_FORWARD if "imatrix" not in n]


@needs_interpreter
@pytest.mark.parametrize("policy", ["propagate", "error"])
@pytest.mark.parametrize("kind,shape,scheme", OBSERVER_CASES, ids=[c[2] for c in OBSERVER_CASES])
def test_forward_and_get_qparams_read_and_copy_nothing(kind, shape, scheme, policy):
    """What a CUDA graph can capture: under nonfinite="propagate" an
    observation and get_qparams read nothing back and make no tensor from
    host data; under "error" get_qparams reads once (the record), forward
    nothing. Every observer but imatrix (its verdict is read at get_qparams);
    the first observation of an observer and a later one (activations)."""
    case, value = value_of(kind, shape, scheme)
    for name in CAPTURED:
        def fresh():
            return Observer.load_from_registry(name, base_name=case.base_name,
                                               args=case.spec.qargs(), nonfinite=policy)

        with use_backend("triton"):
            warm = fresh()
            warm(value)
            warm(value)
            warm.get_qparams()  # compiled, the plans and the fresh record made
            obs = fresh()
            for observation in range(2 if kind == "activation" else 1):
                host = HostData()
                with counted() as (fwd, fwd_reads), host:
                    obs(value)
                what = f"{name} {scheme} {policy}, observation {observation}"
                assert fwd_reads == [] and fwd.syncs == 0, f"{what}: forward reads {fwd_reads}"
                assert host.made == [], f"{what}: forward made {host.made}"
            host = HostData()
            with counted() as (qp, qp_reads), host:
                obs.get_qparams()
        assert host.made == [], f"{name} {scheme} {policy}: get_qparams made {host.made}"
        reads = [] if policy == "propagate" else [("tolist", "report.py")]
        assert [(m, where.split(":")[0]) for m, where in qp_reads] == reads, (
            f"{name} {scheme} {policy}: get_qparams reads {qp_reads}")


def test_host_data_counter_counts():
    """The counter above sees what it is there to see."""
    host = HostData()
    with host:
        torch.tensor((1, 2, 3))
        torch.zeros(3).clone()
    assert host.made == ["aten.lift_fresh"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["static_minmax", "minmax", "memoryless_minmax", "mse"])
def test_cuda_graph_replays_forward_and_get_qparams(name):
    """An activation observer's forward captured once in a CUDA graph and
    replayed per batch (the calibration-loop pattern of the README) gives
    the statistics of the same observations made eagerly; a captured
    get_qparams replays to the eager qparams. nonfinite="propagate": nothing
    is read or copied from the host, as capture requires."""
    args = SCHEMES["fp8-tensor-act"].qargs()
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randn(4, 64, 256, device="cuda", generator=g).to(torch.bfloat16) * (1 + k)
               for k in range(6)]

    def fresh():
        return Observer.load_from_registry(name, base_name="input", args=args, nonfinite="propagate")

    with use_backend("triton"):
        eager = fresh()
        for b in batches:
            eager(b)
        want = {k: v.clone() for k, v in eager.get_statistics().items()}
        want_qp = eager.get_qparams()

        graphed, static = fresh(), batches[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks:
            graphed(batches[0])  # the first observation makes the statistics,
            graphed(batches[1])  # the second compiles the combining launch
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed(static)  # recorded, not run
        for b in batches[2:]:
            static.copy_(b)
            graph.replay()
        torch.cuda.synchronize()
        for k, v in graphed.get_statistics().items():
            assert torch.equal(v, want[k]), f"{name} {k}: {v} != {want[k]}"

        # get_qparams captured: the statistics are kept alive here (a replay
        # reads them, get_qparams drops only the observer's references)
        held = graphed.get_statistics()
        # its launch compiled outside the capture: two observations, so that
        # get_qparams calculates (a first one's qparams come with it)
        fresh()(batches[0])(batches[1]).get_qparams()
        qgraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(qgraph):
            qp = graphed.get_qparams()
        qgraph.replay()
        torch.cuda.synchronize()
        for k in ("scale", "zero_point"):
            assert torch.equal(qp[k], want_qp[k]), f"{name} {k}: {qp[k]} != {want_qp[k]}"
        # a replay reads the statistics as they are then: twice the range,
        # twice the scale (symmetric fp8: scale = absmax / 448, exact)
        held["min_vals"].mul_(2)
        held["max_vals"].mul_(2)
        qgraph.replay()
        torch.cuda.synchronize()
        assert torch.equal(qp["scale"], want_qp["scale"] * 2), (qp["scale"], want_qp["scale"])


# --------------------------------------------------------------------------- #
# the helpers that replaced host-side tensor work keep its exact results
# --------------------------------------------------------------------------- #
def test_round_host_matches_torch():
    """Q.round_host (the launchers' constants) against torch's own rounding of
    a double, including ties, double-rounding cases, subnormals and overflow."""
    from obskernels.kernels.quant import round_host

    rng = random.Random(0)
    values = [0.0, -0.0, 1.0, 2.4, 3.0, 1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-30, 65504.0,
              65519.99, 65520.0, 3.3895313892515355e38, 3.4028235e38, 3.5e38, -1e39,
              1e-40, 1e-46, 5e-324, math.inf, -math.inf, math.nan]
    values += [rng.choice((-1, 1)) * rng.random() * 2.0 ** rng.uniform(-140, 130)
               for _ in range(3000)]
    for _ in range(3000):  # next to the bf16 / fp16 midpoints
        base = (1 + rng.randrange(1 << 16) / 2**16) * 2.0 ** rng.randint(-20, 20)
        values.append(base * (1 + rng.choice((-1, 1)) * 2.0 ** -rng.randint(30, 52)))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        want = torch.tensor(values, dtype=torch.float64).to(dtype).tolist()
        for x, w in zip(values, want):
            got = round_host(x, dtype)
            same_sign = math.copysign(1, got) == math.copysign(1, w)
            same = (got == w and same_sign) or (got != got and w != w)
            assert same, f"{dtype}: round_host({x!r}) = {got!r}, torch gives {w!r}"


@pytest.mark.parametrize("grid", [100, 200, 20, 7, 1, 100.0, 16384, 24579, 38335, 7.3, 1 / 3, 0.37,
                                  12345.678, 1e-3])
def test_shrink_table_holds_the_references_steps(grid):
    """The kernels' step shrink p_i, read from the launcher's table, has the
    bits of the reference's Python float 1 - i / grid rounded once to fp32
    (struct's conversion here), for every step: integer grids and others,
    including grids where one fp32 division of fp32(grid) - i by fp32(grid)
    would differ (24579, 38335, 12345.678)."""
    n = min(int(grid) + 2, 1 << 16)
    table = mse_module._shrink_table(torch.device("cpu"), grid, n)
    assert table.dtype == torch.float32 and table.shape == (n,) and table.is_contiguous()
    got = table.view(torch.int32).tolist()
    for i in range(n):
        want = struct.unpack("<i", struct.pack("<f", 1 - i / grid))[0]
        assert got[i] == want, f"grid {grid}: step {i} gives {float(table[i])!r}, want {1 - i / grid!r}"


@needs_interpreter
@pytest.mark.parametrize("split", [False, True], ids=["registers", "split"])
@pytest.mark.parametrize("flavour", ["mse", "imatrix"])
@pytest.mark.parametrize("grid", [40, 39.3, 24579])
def test_searches_of_any_grid_match_the_reference(pin_launch, split, flavour, grid):
    """The search reads each step's shrink from the table: with integer and
    non-integer grids, on both paths, it picks the reference's ranges."""
    from helpers import reference_search

    if split:
        pin_launch("mse_search", **SPLIT_CONFIG)
    value = torch.randn(6, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    args = SCHEMES["int4-group32-asym"].qargs()
    kw = dict(MSE, grid=grid) if flavour == "mse" else dict(IMATRIX, grid=grid)
    if grid > 1000:
        kw["maxshrink"] = 40 / grid  # the reference's steps stay few
    with use_backend("triton"):
        got = ops.mse_search(value, "weight", args, **kw)
    want = reference_search(value, "weight", args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.float8_e4m3fn, torch.int32])
def test_all_finite_matches_isfinite(dtype):
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        a = torch.randn(5, 7, generator=g) * 10
        b = torch.randn(3, generator=g) * 10
        if dtype.is_floating_point:
            for t in (a, b):
                if torch.rand((), generator=g) < 0.4:
                    t.view(-1)[int(torch.randint(t.numel(), (), generator=g))] = \
                        [math.nan, math.inf, -math.inf][trial % 3]
        a, b = a.to(dtype), b.to(dtype)
        want = all(bool(torch.isfinite(t.float() if dtype.is_floating_point else t).all())
                   for t in (a, b))
        assert all_finite(a, b) == want, f"{dtype} trial {trial}: {a}, {b}"
        assert all_finite(a) == bool(torch.isfinite(a.float()).all())
    assert all_finite(torch.empty(0)) and all_finite()


def test_check_g_idx_returns_the_stable_order():
    value = torch.randn(3, 12)
    for g_idx in (torch.arange(12) % 3, torch.tensor([2, 0, 1, 1, 0, 2, 3, 3, 2, 1, 0, 3]),
                  (torch.arange(12) // 4).to(torch.int32), torch.arange(12).flip(0) // 3):
        group_size = 12 // (int(g_idx.max()) + 1)
        want = torch.argsort(g_idx, stable=True)
        assert torch.equal(check_g_idx(g_idx, value, group_size), want), g_idx


# --------------------------------------------------------------------------- #
# on a GPU: the operations that need no read must not synchronise
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("name,base_name,scheme,new_each_call", [
    ("static_minmax", "input", "fp8-tensor-act", False),  # a calibration loop's forward
    ("memoryless_minmax", "weight", "int4-group128", True),  # new, observe, get_qparams
    ("memoryless_mse", "weight", "int4-group128", True),
    ("memoryless_minmax", "weight", "nvfp4-tg16", True),  # a global scale: three launch sites
])
def test_repeated_calls_launch_past_tritons_front_end_on_cuda(name, base_name, scheme, new_each_call,
                                                              monkeypatch):
    """On CUDA, once a call's launches have run, the same call again makes
    every launch through its launch site's replay (kernels/_replay.py:
    Triton's launch path not taken, counted at JITFunction.run), handing
    Triton's C launcher data pointers, not tensors, and its results are the
    reference backend's, call after call."""
    from triton.runtime.jit import JITFunction

    from obskernels.kernels import _replay

    args = SCHEMES[scheme].qargs()
    g = torch.Generator(device="cuda").manual_seed(0)
    values = [torch.randn(64, 256, device="cuda", generator=g).to(torch.bfloat16) * (1 + k)
              for k in range(5)]

    def results(backend, count=None):
        out, obs = [], None
        with use_backend(backend):
            for k, v in enumerate(values):
                if obs is None or new_each_call:
                    obs = Observer.load_from_registry(name, base_name=base_name, args=args)
                if count is not None and k == 2:  # two calls made every launch once
                    torch.cuda.synchronize()
                    count[0] = 0
                obs(v)
                out.append({k2: t.clone() for k2, t in obs.get_qparams().items() if t is not None})
        return out

    count = [0]
    run = JITFunction.run

    def counted(self, *a, **k):
        count[0] += 1
        return run(self, *a, **k)

    handed = []  # per replayed launch: whether it handed the launcher a tensor
    matching = _replay._Kept._matching

    def spied(self, *a):
        vals = matching(self, *a)
        if vals is not None:
            handed.append(any(isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(
                isinstance(f, torch.Tensor) for f in v)) for v in vals))
        return vals

    monkeypatch.setattr(JITFunction, "run", counted)
    monkeypatch.setattr(_replay._Kept, "_matching", spied)
    got = results("triton", count)
    assert count[0] == 0, f"{count[0]} launches of the last three calls took Triton's launch path"
    assert handed and not any(handed), f"replays handing tensors: {handed}"
    want = results("reference")
    for k, (g_, w) in enumerate(zip(got, want)):
        for key in w:
            assert torch.equal(g_[key], w[key]), f"call {k} {key}: {g_[key]} != {w[key]}"


@pytest.mark.gpu
def test_no_sync_on_cuda():
    args = SCHEMES["int4-group128"].qargs()
    value = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    sum_buf = torch.zeros(256, device="cuda")
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    calls = [
        lambda: ops.min_max(value, "weight", args),
        lambda: ops.mse_search(value, "weight", args, **MSE),
        lambda: ops.mse_search(value, "weight", args, **IMATRIX),
        lambda: ops.accumulate_sq(x, sum_buf, count),
    ]
    # an observer's forward is kernels only too (its get_qparams reads once)
    observers = [Observer.load_from_registry(name, base_name="input", args=args)
                 for name in ("static_minmax", "minmax", "mse")]
    calls += [lambda obs=obs: obs(x) for obs in observers]
    with use_backend("triton"):
        for call in calls:
            call()  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for call in calls:
                call()
        finally:
            torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- #
# the host-cost proxy itself (obskernels.bench.host)
# --------------------------------------------------------------------------- #
def test_host_proxy_counts_python_calls_exactly():
    from obskernels.bench.host import _python_calls

    def leaf(x):
        return x + 1

    def branch():
        return leaf(1) + leaf(2) + len("abc")  # two Python calls, one builtin

    assert _python_calls(lambda: branch()) == 3  # branch and two leaves


def test_host_proxy_takes_the_quietest_rounds_median():
    from obskernels.bench.host import quiet_seconds

    # medians 2, 5 and 9: a round's one fast call does not make it the quietest
    assert quiet_seconds([[3.0, 1.0, 2.0], [5.0, 5.0, 5.0], [0.5, 9.0, 9.0]]) == 2.0
    assert quiet_seconds([[4.0]]) == 4.0


@needs_interpreter
def test_host_proxy_interleaves_its_rounds_over_the_scenarios(monkeypatch):
    """Each round times every scenario in turn: load on a shared machine
    falls on one round of each scenario, not on every call of one."""
    from obskernels.bench import host

    order = []
    monkeypatch.setattr(host, "unit_seconds", lambda: 1.0)
    monkeypatch.setattr(host, "check_default_is_triton", lambda: None)
    monkeypatch.setattr(host, "_call_of", lambda sc: lambda: order.append(sc.name))
    a, b = host.SCENARIOS[0], host.SCENARIOS[1]
    rows = host.measure((a, b), reps=6, warmup=1, rounds=3)
    assert [r["scenario"] for r in rows] == [a.name, b.name]
    warm, timed = order[:2], order[2:14]
    assert warm == [a.name, b.name]
    assert timed == [a.name, a.name, b.name, b.name] * 3
    assert order[14:] == [a.name, b.name]  # each call's Python calls, counted once


@needs_interpreter
def test_host_proxy_times_a_scenario_in_turns_after_its_partner(monkeypatch):
    """Where a scenario has a partner (llm-compressor's own observer making
    the same call), the proxy times it once more in each round, each call
    right after a partner call, untimed: the turns figures; and once more
    again, each call after a sweep of the host's caches, untimed: the swept
    figures; None for a scenario without a partner. The garbage collections
    counted are those inside the timed calls, not the partner's or the
    sweep's."""
    from obskernels.bench import host

    order, now, collected = [], [0.0], [0]
    costs = {"a": 2.0, "b": 3.0}
    after_partner, swept = [False], [False]

    def call_of(sc):
        def call():
            order.append(sc.name)
            # colder after the partner, less so after a sweep
            now[0] += costs[sc.name] + (5.0 if after_partner[0] else 0.0) + (4.0 if swept[0] else 0.0)
            # a collection in every b call, and in a's calls after the partner
            collected[0] += sc.name == "b" or after_partner[0]
            after_partner[0] = swept[0] = False
        return call

    def partner():
        order.append("partner")
        now[0] += 100.0  # untimed
        collected[0] += 3  # not ours
        after_partner[0] = True

    def sweep():  # colder too, by less
        order.append("sweep")
        now[0] += 50.0  # untimed
        collected[0] += 2  # not ours
        swept[0] = True

    monkeypatch.setattr(host, "unit_seconds", lambda: 1.0)
    monkeypatch.setattr(host, "check_default_is_triton", lambda: None)
    monkeypatch.setattr(host.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(host, "_python_calls", lambda fn: 0)
    monkeypatch.setattr(host, "_call_of", call_of)
    monkeypatch.setattr(host, "_partner_of", lambda sc: partner if sc.name == "a" else None)
    monkeypatch.setattr(host, "sweep_host_caches", sweep)
    monkeypatch.setattr(host, "gc_collections", lambda: collected[0])
    a, b = (dataclasses.replace(host.SCENARIOS[0], name=n) for n in ("a", "b"))
    rows = host.measure((a, b), reps=4, warmup=1, rounds=2)
    # warm-up: each call once, then its partner; each round: a and b alone,
    # then a in turns, then a after a sweep of the host's caches
    assert order == ["a", "partner", "b"] + (["a"] * 2 + ["b"] * 2 + ["partner", "a"] * 2
                                             + ["sweep", "a"] * 2) * 2
    assert [(r["scenario"], r["host_us"], r["turns_us"], r["swept_us"]) for r in rows] == [
        ("a", 2e6, 7e6, 6e6), ("b", 3e6, None, None)]
    assert rows[0]["turns_units"] == 7.0 and rows[1]["turns_units"] is None  # the unit: 1 s
    assert rows[0]["swept_units"] == 6.0 and rows[1]["swept_units"] is None
    assert [(r["gc_per_1000"], r["turns_gc_per_1000"]) for r in rows] == [(0.0, 1000.0), (1000.0, None)]


def test_host_proxy_counts_the_collections_started_within_its_block():
    """The proxies' collection counter counts each collection started
    inside ``counting_collections()``, every generation, and none outside,
    its callback gone after the block."""
    import gc

    from obskernels.bench import host

    before = host.gc_collections()
    with host.counting_collections():
        gc.collect(0)
        gc.collect()
        inside = host.gc_collections()
    gc.collect()
    assert inside - before == 2 and host.gc_collections() == inside
    assert host._count_collection not in gc.callbacks


@needs_interpreter
def test_host_proxy_stubs_every_kernel_and_restores_them():
    from obskernels.bench import host
    from obskernels.tools.kernel_report.launches import discover_kernels

    kernels = discover_kernels()
    before = {name: getattr(m, a) for name, (m, a) in kernels.items()}
    record = torch.full((6,), 7, dtype=torch.int64)
    with host.stubbed_launches():
        assert all(isinstance(getattr(m, a), host._Stub) for m, a in kernels.values())
        # a stubbed launch computes nothing; integer outputs read back are cleared
        mins, maxs = ops.min_max(torch.randn(4, 32), "weight", SCHEMES["int8-channel"].qargs(),
                                 status=record)
        assert record.tolist() == [0] * 6
    assert {name: getattr(m, a) for name, (m, a) in kernels.items()} == before


@needs_interpreter
def test_host_proxy_measures_the_default_backend_choice(monkeypatch):
    """The proxy times what a user runs without choosing a backend ("auto",
    which picks triton for the CPU tensor here, its choice made per
    operation): a chosen backend, even triton, is refused, not measured."""
    from obskernels import backends
    from obskernels.bench import host

    monkeypatch.setattr(backends, "_process_choice", None)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    host.check_default_is_triton()
    for name in ("triton", "reference"):
        with use_backend(name), pytest.raises(RuntimeError, match="default backend choice"):
            host.check_default_is_triton()
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    with pytest.raises(RuntimeError, match="found 'reference'"):
        host.measure(host.SCENARIOS[:1], reps=1, warmup=0)


# --------------------------------------------------------------------------- #
# the host's instructions per call, counted (obskernels.bench.instructions)
# --------------------------------------------------------------------------- #
def test_instruction_counts_are_read_between_the_marks():
    """The dumps callgrind writes at each mark: the first ends at the first
    mark (start-up, the first warm-up), then each counted run, then the next
    warm-up; a run's count over its calls is its instructions per call."""
    from obskernels.bench import instructions

    def dump(total, summary=None):
        head = f"summary: {summary}\n" if summary is not None else ""
        return f"version: 1\ncreator: callgrind\n{head}events: Ir\nfn=x\n1 5\ntotals: {total}\n"

    texts = [dump(10**9), dump(2000, summary=2000), dump(777), dump(50_000), dump(3)]
    assert instructions.parse_dumps(texts) == [10**9, 2000, 777, 50_000, 3]
    assert instructions.parse_dumps(["summary: 42\n"]) == [42]
    assert instructions.per_call([10**9, 2000, 777, 50_000, 3], ["unit", "call"], 100) == {
        "unit": 20.0, "call": 500.0}
    with pytest.raises(ValueError, match="a mark is missing"):
        instructions.per_call([10**9, 2000, 777], ["unit", "call"], 100)
    with pytest.raises(ValueError, match="without a totals"):
        instructions.parse_dumps(["events: Ir\n"])


#: instructions per call on the development CPU (launches stubbed), by
#: Python (major, minor): the budgets, a tenth above what the minmax call
#: and the activation forward counted when they were set (a callgrind count
#: does not move between runs), and the torch releases (major, minor) they
#: were counted under; a change that adds a tenth to either fails here.
#: Counted: Python 3.11 with torch 2.13.0 (CPU build, triton 3.9) 234,314
#: and 109,276, 2.14.1 (CUDA build, triton 3.8) 230,851 and 109,632, 2.15.0
#: (CUDA build, triton 3.9) 227,893 and 105,997; with torch 2.13.0 (CUDA
#: build, triton 3.7.1) Python 3.10 274,616 and 133,907, 3.12 244,143 and
#: 117,267, 3.13 235,952 and 115,531. Another stack counts otherwise.
INSTRUCTION_BUDGETS = {
    (3, 10): ({"minmax call": 302_000, "activation forward": 148_000}, {(2, 13)}),
    (3, 11): ({"minmax call": 258_000, "activation forward": 120_000}, {(2, 13), (2, 14), (2, 15)}),
    (3, 12): ({"minmax call": 269_000, "activation forward": 129_000}, {(2, 13)}),
    (3, 13): ({"minmax call": 260_000, "activation forward": 128_000}, {(2, 13)}),
}


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("valgrind"), reason="needs valgrind")
def test_host_instructions_per_call_within_budget():
    """The stubbed minmax call and activation forward counted under
    callgrind (obskernels.bench.instructions): within their budgets, the
    unit's row first, every row in units of it."""
    import sys

    from obskernels.backends import _release
    from obskernels.bench import instructions

    python, torch_release = sys.version_info[:2], _release(torch.__version__)
    budgets, counted_torch = INSTRUCTION_BUDGETS.get(python, ({}, set()))
    if torch_release not in counted_torch:
        pytest.skip(f"no budget counted for Python {python[0]}.{python[1]} with torch "
                    f"{torch.__version__}")
    rows = instructions.count(list(budgets), calls=50)
    assert [r["scenario"] for r in rows] == [instructions.UNIT, *budgets]
    unit = rows[0]["instructions"]
    assert 1_000 < unit < 100_000 and rows[0]["units"] == 1.0
    for r in rows[1:]:
        assert r["units"] == pytest.approx(r["instructions"] / unit)
        assert r["instructions"] <= budgets[r["scenario"]], \
            f"{r['scenario']}: {r['instructions']:,.0f} instructions per call, budget " \
            f"{budgets[r['scenario']]:,}"


def test_instruction_count_refuses_without_valgrind(monkeypatch, capsys):
    from obskernels.bench import instructions

    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    assert instructions.main([]) == 2
    assert "valgrind is not installed" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="valgrind is not installed"):
        instructions.count(["minmax call"])
    monkeypatch.setattr(instructions.shutil, "which", lambda name: "/bin/true")
    with pytest.raises(ValueError, match="unknown scenario"):
        instructions.count(["no such call"])
