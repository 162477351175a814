"""What an observer call costs where a GPU user calls it: MEASURED on CUDA.

    python -m obskernels.bench.cuda_host            # a table
    python -m obskernels.bench.cuda_host --json     # one JSON object per line

The companion of ``obskernels.bench.host`` (the CPU proxy, launches stubbed):
the same scenarios, on CUDA tensors with the kernels compiled for the GPU,
timed on the wall, plus what the proxy and the bench's model take as given.

Every row gives four times in microseconds (the lead calls seven):
- ``loop_us``: ``n`` calls back to back, then one synchronisation, divided by
  ``n`` -- what a calibration loop pays per call, the host issuing while the
  GPU runs earlier work (the fastest of the rounds);
- ``sync_us``: one call and a synchronisation -- the latency of a single
  call (the quietest round's median, ``host.quiet_seconds``, of ``reps`` in
  all);
- ``wiped_us``: the same after the L2 is wiped (256 MB zeroed) and the
  device synchronised, as the bench's lead rows time a call
  (``runner._one_call``): the quietest round's median of ``reps``;
- ``issued_us``: in calls made as ``wiped_us``' (half as many, timed apart
  from those), the host's time from the call's start until its first kernel
  launch through a launch site (``kernels/_replay.Replay``) has been issued:
  what an idle GPU waits before it has work (the model's "host before the
  first launch"); None for a row with no such launch (the unit, the bare
  launch, a CUDA graph's replay, llm-compressor's own observer);
- ``turns_us``: as ``wiped_us``, each call right after llm-compressor's own
  call of the same observer on the same value (untimed, before the wipe),
  as the bench's lead rows take turns: what the other library's call,
  having pushed ours out of the host's caches, costs it; and
  ``turns_issued_us``, ``issued_us`` of such calls: whether that cost comes
  before the first launch (the host) or after it (the lead table's calls,
  where llm-compressor imports; also ``COLD_LAUNCH_ROWS``, the unit, the bare
  launch and the minmax call's replayed launch, each after llm-compressor's
  first lead call: what a launch alone costs cold; None elsewhere);
- ``swept_us``: as ``turns_us``, each call after a sweep of the host's
  caches (``host.sweep_host_caches``, before the wipe) instead of
  llm-compressor's call: where it reads as ``turns_us`` does, the other
  library's call costs ours the host caches it took and nothing more.
- ``turns_gc_per_1000``: the garbage collections that ran inside the
  timed calls of ``turns_us``, per 1,000 calls (llm-compressor's observers
  are reference cycles, which only a collection frees, and one may run
  inside our call after its call; ``host.counting_collections``).
The rows are timed in 5 rounds that go over all of them in turn
(``host.interleaved``), so that a stretch of other work on the GPU's host
slows one round of every row rather than every call of one.
``units``: ``loop_us`` over the GPU host's unit (the first row), comparable
with the proxy's units.

Rows:
- "unit: one-element CUDA add_": the GPU host's unit (the model's ``host_unit_s``);
- "bare Triton launch": a one-element Triton kernel (the model's ``triton_launch_s``);
- every scenario of ``obskernels.bench.host.SCENARIOS`` (its shapes; the
  drop-in's where llm-compressor imports), and the minmax call again with
  every launch through Triton's launch path (launch replays off,
  kernels/_replay.py), and again replayed but handing the launcher tensors
  instead of their data pointers (``_replay.POINTERS`` off: Triton's C
  launcher then asks the driver about each one);
- the lead table's min/max calls: a memoryless_minmax call (new, observe,
  get_qparams) on the bench's 4096x4096 bf16 value of each weight scheme
  and its 2048x4096 bf16 value of each activation scheme, so that a lead
  row reads beside the same call timed here;
- the minmax call's host pieces, each alone, back to back (``part_rows``):
  a new observer; one output allocated as the launch allocates its outputs;
  a fresh status (from the status pool); the call's one launch replayed
  with its own arguments (and with tensors handed to the launcher); the
  status read in ``get_qparams`` (a device-to-host copy; on CUDA also as a
  copy into pinned memory made once, ``PINNED_READ``). ``minmax_by_part``
  splits the minmax call's ``loop_us`` into them (the outputs counted in a
  call), the rest being its Python and torch's dispatch;
- printed after the table (``trace_rows``, not rows of it): the lead
  calls traced, each single call timed at the points between its pieces
  (``SPANS``: the new observer, observing up to the operation, the
  operation up to its launch, the launch, on to the status read, the read,
  the rest), after the L2 wipe and, where llm-compressor imports, right
  after its call: which piece a cold call (the lead rows' in turns) pays
  for, where the parts above are timed hot;
- printed after the trace (``kernel_rows``): our kernels' device time per
  lead call, profiled (torch profiler, our kernels by name) back to back,
  after the wipe and right after llm-compressor's call: whether the device
  runs them slower in turns, or the host alone pays for the turns;
- an fp8 activation's static_minmax forward at 2048x4096 bf16 (the
  calibration loop's repeated call): obskernels' observer eagerly (and with
  launch replays off, and with tensors to the launcher), the same forward
  captured in a CUDA graph and replayed (``nonfinite="propagate"``, the
  pattern of the README), and, where llm-compressor imports, its own
  observer plain and through the drop-in.

The default backend choice is timed ("auto", which picks triton for a CUDA
tensor). Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

__all__ = ["measure", "main", "ACTIVATION_SHAPE", "LEAD_WEIGHT_SHAPE", "loop_seconds", "sync_times",
           "sync_seconds", "issued_times", "part_rows", "minmax_by_part", "PARTS", "PINNED_READ",
           "traced_spans", "trace_rows", "SPANS", "kernel_rows", "kernel_times", "our_kernel_names",
           "ours_per_call_us", "KERNEL_SETTINGS", "COLD_LAUNCH_ROWS"]

try:  # the bare launch's kernel (this module imports without triton too)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency of the GPU rows only
    triton = None

if triton is not None:

    @triton.jit
    def _one_element(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

#: the activation of the bench's lead table (a2048x4096): tokens x hidden
ACTIVATION_SHAPE = (2048, 4096)
#: the weights of the bench's lead table (w4096x4096)
LEAD_WEIGHT_SHAPE = (4096, 4096)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def loop_seconds(fn: Callable[[], object], n: int, rounds: int = 5) -> float:
    """Seconds per call of ``n`` calls back to back and one synchronisation
    (the fastest of ``rounds``)."""
    best = math.inf
    for _ in range(rounds):
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def sync_times(fn: Callable[[], object], reps: int,
               wipe: Optional[Callable[[], object]] = None,
               collected: Optional[List[int]] = None) -> List[float]:
    """Seconds of ``reps`` single calls, each synchronised (and, with
    ``wipe``, made after ``wipe()``, the L2 wiped, and a synchronisation);
    with ``collected``, the garbage collections that ran inside the timed
    calls added to its one element."""
    from obskernels.bench.host import gc_collections

    times = []
    for _ in range(reps):
        if wipe is not None:
            wipe()
        _sync()
        c0 = gc_collections() if collected is not None else 0
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
        if collected is not None:
            collected[0] += gc_collections() - c0
    return times


def issued_times(fn: Callable[[], object], reps: int,
                 wipe: Callable[[], object]) -> List[Optional[float]]:
    """Per call of ``reps`` single calls, each after ``wipe()`` and a
    synchronisation: the seconds from its start until its first launch
    through a launch site (``Replay``) returned, None where it made none.
    The sites are watched (``runner.LaunchWatch``) only within this function."""
    from obskernels.bench.runner import LaunchWatch

    watch = LaunchWatch()
    times: List[Optional[float]] = []

    def call():
        watch.begin()
        t0 = time.perf_counter()
        fn()
        times.append(None if watch.issued_at is None else watch.issued_at - t0)

    with watch.watching():
        sync_times(call, reps, wipe)  # each call made as sync_times makes them
    return times


def sync_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of one call and a synchronisation."""
    return statistics.median(sync_times(fn, reps))


def _bare_launch() -> Callable[[], object]:
    import torch

    x = torch.zeros(1, device="cuda")
    return lambda: _one_element[(1,)](x)


def _unit() -> Callable[[], object]:
    import torch

    t = torch.zeros(1, device="cuda")
    return lambda: t.add_(1)


def _replay_switch_off(switch: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with kernels/_replay.py's module switch ``switch`` off during
    each call (on again after it)."""
    from obskernels.kernels import _replay

    def call():
        setattr(_replay, switch, False)
        try:
            return fn()
        finally:
            setattr(_replay, switch, True)

    return call


def _through_triton(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every launch through Triton's launch path (no replay past
    its front end, kernels/_replay.py): what the replays save."""
    return _replay_switch_off("ENABLED", fn)


def _with_tensors(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with its replayed launches handing the launcher tensors, not
    their data pointers (kernels/_replay.py's ``POINTERS``): what the
    pointers save."""
    return _replay_switch_off("POINTERS", fn)


#: the minmax call's pieces timed alone (``part_rows``), in ``minmax_by_part``'s order
PARTS = ("part: a new observer", "part: an output allocated", "part: a fresh status",
         "part: the launch, replayed", "part: the launch, tensors to Triton's launcher",
         "part: the status read")
#: the rows timed in turns too (after the first lead call's partner), besides
#: the lead calls: a torch op's launch, Triton's and ours, cold
COLD_LAUNCH_ROWS = ("unit: one-element CUDA add_", "bare Triton launch", PARTS[3])


def _allocations(fn: Callable[[], object]) -> int:
    """How many tensors one call of ``fn`` allocates (torch's ``empty*`` ops:
    a pooled status's chunk, ``new_empty``, is not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("empty"):
                count[0] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        fn()
    return count[0]


def part_rows(device: str = "cuda") -> tuple:
    """((name, call) per ``PARTS``, outputs): the host scenarios' minmax call
    (new observer, observe, get_qparams) in pieces, each made alone on
    ``device``'s tensors of the call: its observer's construction; one of
    its outputs allocated (the launch's allocator, the scale's shape and
    dtype); a fresh status from its template; its one launch, through its
    launch site with the arguments of a call (outputs and status written
    again); the same with tensors handed to Triton's launcher; the read of
    a status. ``outputs``: the tensors one call allocates."""
    import torch

    from obskernels import Observer
    from obskernels.bench import host
    from obskernels.kernels import _replay
    from obskernels.kernels._layout import allocator
    from obskernels.observers.report import read_status
    from obskernels.spec.record import STATUS_INIT, fresh_copy, template_of

    minmax = next(sc for sc in host.SCENARIOS if sc.name == "minmax call")
    call = host._call_of(minmax, device=device)
    for _ in range(3):
        call()  # compiled and planned
    site_call = _replay.Replay.__call__
    launches = []

    def seen(self, *args, **kwargs):
        launches.append((self, args, kwargs))
        return site_call(self, *args, **kwargs)

    with host.stubbed_launches():  # the call's own allocations, not a launch's (the interpreter's)
        outputs = _allocations(call)
    _replay.Replay.__call__ = seen
    try:
        qparams = call()
    finally:
        _replay.Replay.__call__ = site_call
    if len(launches) != 1:
        raise RuntimeError(f"the minmax call made {len(launches)} launches, not one")
    ((site, args, kwargs),) = launches
    status = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int64)
    # the template the launch's statuses are copied from (kept per words and device)
    template = template_of(STATUS_INIT + (0,) * (status.numel() - len(STATUS_INIT)), status.device)
    scale = qparams["scale"]
    new_output = allocator(tuple(scale.shape), scale.dtype, scale.device)
    qargs = host._qargs(minmax.args)
    rows = [
        (PARTS[0], lambda: Observer.load_from_registry(minmax.observer, base_name=minmax.base_name,
                                                       args=qargs)),
        (PARTS[1], new_output),
        (PARTS[2], lambda: fresh_copy(template)),
        (PARTS[3], lambda: site(*args, **kwargs)),
        (PARTS[4], _with_tensors(lambda: site(*args, **kwargs))),
        (PARTS[5], lambda: read_status(status)),
    ]
    if status.is_cuda:
        rows.append((PINNED_READ, _pinned_read(status)))
    return rows, outputs


#: a part timed on CUDA only: the status read into pinned host memory
PINNED_READ = "part: the status read, into pinned memory"


def _pinned_read(status) -> Callable[[], object]:
    """The status's words read as ``read_status`` reads them, but copied
    into a pinned host buffer made once (an asynchronous copy, then the
    stream synchronised) instead of ``tolist()``'s copy into new pageable
    memory: what a read could cost done so."""
    import torch

    buf = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(status.device)

    def read():
        buf.copy_(status, non_blocking=True)
        stream.synchronize()
        return buf.tolist()

    return read


def minmax_by_part(rows: List[Dict], outputs: int) -> Optional[Dict[str, float]]:
    """The minmax call's ``loop_us`` split into its pieces' (``PARTS``, each
    once but the output, ``outputs`` times; the launch replayed) and the
    rest; None where a row is missing."""
    loop = {r["row"]: r["loop_us"] for r in rows}
    if "minmax call" not in loop or not all(p in loop for p in PARTS):
        return None
    pieces = {"a new observer": loop[PARTS[0]], f"{outputs} outputs": outputs * loop[PARTS[1]],
              "a fresh status": loop[PARTS[2]], "the launch": loop[PARTS[3]],
              "the status read": loop[PARTS[5]]}
    pieces["the rest"] = loop["minmax call"] - sum(pieces.values())
    return pieces


#: the spans of a traced observer call (``traced_spans``), in call order
SPANS = ("new observer", "observe, before ops", "ops, before the launch", "the launch",
         "the launch to the read", "the status read", "after the read")
#: their columns in the printed table
_SPAN_HEADS = ("new", "observe", "ops", "launch", "to read", "read", "after")
#: the points between them (the call's start and end around them)
_POINTS = ("built", "ops", "launch", "launched", "read", "read back")


def traced_spans(fn: Callable[[], object], reps: int,
                 before: Optional[Callable[[], object]] = None) -> Optional[Dict[str, float]]:
    """Median microseconds per ``SPANS`` of ``reps`` observer calls ``fn``
    (a new observer, observe, get_qparams; each made as ``sync_times``
    makes them, after ``before()`` where given): each call timed at the
    points between its pieces -- the observer built
    (``Observer.load_from_registry`` returned), ``ops.min_max_qparams``
    entered, the first launch through a launch site entered and returned,
    the status read (``observers.report.read_status``) entered and
    returned -- so that a call made cold (after llm-compressor's) says which
    piece the host's caches slow, where the parts timed alone
    (``part_rows``) are hot. Each point is a wrapper, within this function
    only (a Python frame and a clock read, ~0.3-0.5 us each on the
    development CPU). None where no call passed every point (a call on
    another path)."""
    from obskernels import ops
    from obskernels.kernels import _replay
    from obskernels.observers import Observer, report

    marks: Dict[str, float] = {}

    def at(point: str) -> None:
        if point not in marks:
            marks[point] = time.perf_counter()

    load = Observer.__dict__["load_from_registry"]
    qparams, site, read_status = ops.min_max_qparams, _replay.Replay.__call__, report.read_status

    def built(cls, *args, **kwargs):
        out = load.__func__(cls, *args, **kwargs)
        at("built")
        return out

    def entered(*args, **kwargs):
        at("ops")
        return qparams(*args, **kwargs)

    def launched(self, *args, **kwargs):
        at("launch")
        out = site(self, *args, **kwargs)
        at("launched")
        return out

    def read(status):
        at("read")
        out = read_status(status)
        at("read back")
        return out

    spans: List[List[float]] = []

    def call():
        marks.clear()  # ``before`` may pass the points too
        t0 = time.perf_counter()
        fn()
        end = time.perf_counter()
        if all(p in marks for p in _POINTS):
            points = [t0] + [marks[p] for p in _POINTS] + [end]
            spans.append([(b - a) * 1e6 for a, b in zip(points, points[1:])])

    Observer.load_from_registry = classmethod(built)
    ops.min_max_qparams, _replay.Replay.__call__, report.read_status = entered, launched, read
    try:
        sync_times(call, reps, before)
    finally:
        Observer.load_from_registry = load
        ops.min_max_qparams, _replay.Replay.__call__, report.read_status = qparams, site, read_status
    if not spans:
        return None
    return {name: statistics.median(column) for name, column in zip(SPANS, zip(*spans))}


def trace_rows(reps: int = 20) -> List[Dict]:
    """The lead table's memoryless_minmax calls (``_lead_rows``) traced
    (``traced_spans``): each after the L2 wiped ("wiped"), and each right
    after llm-compressor's own call and the wipe ("turns", where it
    imports), as the lead rows take turns with it."""
    wipe = _wipe()
    out = []
    for name, fn, partner in _lead_rows():
        for setting, before in _lead_settings(fn, partner, wipe).items():
            spans = traced_spans(fn, reps, before)
            out.append({"row": name, "setting": setting, "spans_us": spans,
                        "total_us": None if spans is None else sum(spans.values()), "kind": "measured"})
    return out


#: the settings ``kernel_rows`` profiles our kernels in, in its order
KERNEL_SETTINGS = ("back to back", "wiped", "turns")


def our_kernel_names() -> frozenset:
    """The names of obskernels' launched Triton kernels (the compile
    report's ``discover_kernels``): how a profile's device events are told
    apart from the other library's and the wipe's."""
    from obskernels.tools.kernel_report.launches import discover_kernels

    return frozenset(attr for _, attr in discover_kernels().values())


def ours_per_call_us(events, names, calls: int) -> Optional[float]:
    """Per call, the device microseconds of the profiled ``events`` (pairs
    of a kernel's name and its total device us) whose kernel is one of
    ``names``; None where none is."""
    mine = [us for key, us in events if key in names]
    return sum(mine) / calls if mine else None


def kernel_times(fn: Callable[[], object], reps: int, before: Callable[[], object],
                 names) -> Optional[float]:
    """Our kernels' device time per call of ``fn`` (us), from the torch
    profiler over ``reps`` calls, each after ``before()`` and a
    synchronisation, synchronised after; the other work's kernels (the
    wipe's, the other library's) are in the profile but not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            before()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    events = [(e.key, e.self_device_time_total) for e in prof.key_averages()]
    return ours_per_call_us(events, names, reps)


def kernel_rows(reps: int = 20) -> List[Dict]:
    """Per lead call (``_lead_rows``), our kernels' device time per call
    (``kernel_times``) in ``KERNEL_SETTINGS``: calls back to back (the value
    still in the L2), after the L2 wipe, and right after llm-compressor's
    call and the wipe (where it imports), as the lead rows take turns: whether
    the device itself runs our kernels slower in turns (its clocks fallen
    while the other call kept it idle) or the host alone pays for the turns.
    Run last: a profiler that traced CUDA stays attached to the process."""
    wipe = _wipe()
    names = our_kernel_names()  # (the compile report's discovery imports every kernel module)
    out = []
    for name, fn, partner in _lead_rows():
        settings = {"back to back": lambda: None, **_lead_settings(fn, partner, wipe)}
        out.append({"row": name, "kernels_us": {setting: kernel_times(fn, reps, before, names)
                                                for setting, before in settings.items()},
                    "kind": "measured"})
    return out


def _lead_settings(fn, partner, wipe) -> Dict[str, Callable[[], object]]:
    """What precedes a lead call in its settings, after ``fn`` is compiled
    and planned (and ``partner`` called once): "wiped", the L2 wipe; "turns"
    (where llm-compressor imports: ``partner`` not None), its call of the
    same observer then the wipe, as the lead rows take turns."""
    for _ in range(5):
        fn()  # compiled and planned
    settings = {"wiped": wipe}
    if partner is not None:
        partner()

        def after_partner():
            partner()
            wipe()

        settings["turns"] = after_partner
    return settings


def _wipe() -> Callable[[], object]:
    """Zeroes 256 MB of the GPU (more than any L2), as the lead rows do."""
    from obskernels.bench.runner import _wipe_buffer

    return _wipe_buffer("cuda").zero_


def _lead_rows() -> List[tuple]:
    """(name, call, partner) of the lead table's memoryless_minmax calls: a
    new observer, observe, get_qparams on each weight scheme's 4096x4096
    bf16 bench value, then on each activation scheme's 2048x4096 one;
    ``partner`` the same call by llm-compressor's own observer (None where
    it does not import)."""
    from obskernels import Observer
    from obskernels.bench.backends import llmc_available
    from obskernels.bench.cases import ACTIVATION_SCHEMES, SCHEMES, WEIGHT_SCHEMES, Case, make_value
    from obskernels.bench.host import observer_call

    registry = None
    if llmc_available():
        from llmcompressor.observers import Observer as registry

    def call_of(observers, value, base_name, args):
        return observer_call(observers, "memoryless_minmax", base_name, args, value)

    cases = ([Case("weight", LEAD_WEIGHT_SHAPE, "bf16", name) for name in WEIGHT_SCHEMES]
             + [Case("activation", ACTIVATION_SHAPE, "bf16", name) for name in ACTIVATION_SCHEMES])
    rows = []
    for case in cases:
        value, args = make_value(case, device="cuda"), SCHEMES[case.scheme].qargs()
        rows.append((f"memoryless_minmax {case.label}", call_of(Observer, value, case.base_name, args),
                     None if registry is None else call_of(registry, value, case.base_name, args)))
    return rows


def _activation_value():
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(*ACTIVATION_SHAPE, device="cuda", generator=gen).to(torch.bfloat16)


def _activation_rows() -> List[tuple]:
    """(name, call) of the activation forwards at ACTIVATION_SHAPE."""
    import torch

    from obskernels import Observer
    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available

    args = host._qargs(host._FP8_TENSOR)
    value = _activation_value()
    eager = Observer.load_from_registry("static_minmax", base_name="input", args=args)
    rows = [("activation forward 2048x4096 (obskernels static_minmax)", lambda: eager(value)),
            ("activation forward 2048x4096, Triton's launch path", _through_triton(lambda: eager(value))),
            ("activation forward 2048x4096, tensors to Triton's launcher",
             _with_tensors(lambda: eager(value)))]

    graphed = Observer.load_from_registry("static_minmax", base_name="input", args=args,
                                          nonfinite="propagate")
    static = value.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks
        graphed(static)  # the first observation makes the statistics
        graphed(static)  # the second compiles the combining launch
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(static)
    rows.append(("activation forward 2048x4096, CUDA graph replay", graph.replay))

    if llmc_available():
        from llmcompressor.observers import Observer as registry

        from obskernels.integrations.llmcompressor import enabled

        plain = registry.load_from_registry("static_minmax", base_name="input", args=args)
        with enabled():
            dropped = registry.load_from_registry("static_minmax", base_name="input", args=args)
        rows.append(("activation forward 2048x4096 (llm-compressor)", lambda: plain(value)))
        rows.append(("activation forward 2048x4096 (llm-compressor, drop-in)", lambda: dropped(value)))
    return rows


def measure(n: int = 200, reps: int = 50, progress=None, rounds: int = 5) -> List[Dict]:
    """One record per row (see the module docstring), timed in ``rounds``
    interleaved rounds; each round's end written to ``progress`` (a stream)
    with every row's figures so far, so a run cut short keeps them."""
    import warnings

    import torch

    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    rows: List[tuple] = [("unit: one-element CUDA add_", _unit()), ("bare Triton launch", _bare_launch())]
    rounds = max(rounds, 1)
    per_round = max(reps // rounds, 1)
    with warnings.catch_warnings(), host.counting_collections():
        warnings.simplefilter("ignore")
        for sc in host.SCENARIOS:
            if sc.drop_in and not llmc_available():
                continue
            rows.append((sc.name, host._call_of(sc, device="cuda")))
        minmax = next(sc for sc in host.SCENARIOS if sc.name == "minmax call")
        rows.append(("minmax call, Triton's launch path",
                     _through_triton(host._call_of(minmax, device="cuda"))))
        rows.append(("minmax call, tensors to Triton's launcher",
                     _with_tensors(host._call_of(minmax, device="cuda"))))
        try:
            parts, outputs = part_rows("cuda")
        except Exception as exc:  # noqa: BLE001 - the other rows are measured all the same
            parts, outputs = [], 0
            print(f"obskernels.bench.cuda_host: the minmax call's parts not timed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
        rows += parts
        lead = _lead_rows()
        rows += [(name, fn) for name, fn, _ in lead]
        rows += _activation_rows()
        wipe = _wipe()
        partners = {id(fn): partner for _, fn, partner in lead if partner is not None}
        # the launch alone, cold as in the lead rows' turns: the unit (a torch
        # op), a bare Triton launch and the minmax call's replayed launch, each
        # after the first lead call's partner (llm-compressor's int8 channel call)
        first = next((partner for _, _, partner in lead if partner is not None), None)
        if first is not None:
            partners.update((id(fn), first) for name, fn in rows if name in COLD_LAUNCH_ROWS)
        for _, fn in rows:
            for _ in range(5):
                fn()  # compiled, planned and allocated before timing
        for partner in {id(p): p for p in partners.values()}.values():
            partner()  # each once

        def figures(done) -> Dict:
            loops, syncs, wipes, issues, turns, turns_issues, swept, turns_gc = zip(*done)
            return {"loop_us": min(loops) * 1e6,
                    "sync_us": host.quiet_seconds(syncs) * 1e6,
                    "wiped_us": host.quiet_seconds(wipes) * 1e6,
                    "issued_us": _issued_us(issues),
                    "turns_us": host.quiet_seconds(turns) * 1e6 if all(turns) else None,
                    "turns_issued_us": _issued_us(turns_issues),
                    "swept_us": host.quiet_seconds(swept) * 1e6 if all(swept) else None,
                    "turns_gc_per_1000": (sum(turns_gc) * 1000 / sum(map(len, turns))
                                          if all(turns) else None)}

        def time_round(fn):
            partner = partners.get(id(fn))

            def after_partner():
                partner()
                wipe()

            def after_sweep():
                host.sweep_host_caches()
                wipe()

            issued_reps = max(per_round // 2, 1)
            collected = [0]
            return (loop_seconds(fn, n, rounds=1), sync_times(fn, per_round),
                    sync_times(fn, per_round, wipe), issued_times(fn, issued_reps, wipe),
                    None if partner is None else sync_times(fn, per_round, after_partner, collected),
                    None if partner is None else issued_times(fn, issued_reps, after_partner),
                    None if partner is None else sync_times(fn, per_round, after_sweep),
                    collected[0])

        def report(r: int, timed) -> None:
            if progress:
                progress.write(f"  round {r + 1} of {rounds}:\n")
                for (name, _), done in zip(rows, timed):
                    f = figures(done)
                    progress.write(f"    {name}: loop {f['loop_us']:.1f} us, sync {f['sync_us']:.1f} us, "
                                   f"wiped {f['wiped_us']:.1f} us, issued {_us(f['issued_us'])}, "
                                   f"turns {_us(f['turns_us'])}, issued in turns {_us(f['turns_issued_us'])}, "
                                   f"swept {_us(f['swept_us'])}\n")
                progress.flush()

        timed = host.interleaved([fn for _, fn in rows], rounds, time_round, report)
    out = [dict(row=name, **figures(done)) for (name, _), done in zip(rows, timed)]
    unit = out[0]["loop_us"]
    device = torch.cuda.get_device_name(0)
    for r in out:
        r.update(units=r["loop_us"] / unit, unit_us=unit, device=device, kind="measured")
    by_part = minmax_by_part(out, outputs)
    if by_part is not None:  # on the minmax call's row
        next(r for r in out if r["row"] == "minmax call")["by_part_us"] = by_part
    return out


def _issued_us(rounds) -> Optional[float]:
    """``issued_us`` from the rounds' ``issued_times`` (None where a round is
    missing or made no launch through a site)."""
    from obskernels.bench import host

    if not all(rounds):
        return None
    issued = [[t for t in times if t is not None] for times in rounds]
    return host.quiet_seconds(issued) * 1e6 if all(issued) else None


def _us(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rows_or_none(rows: Callable[[], List[Dict]], failed: str) -> List[Dict]:
    """``rows()``, or none where it fails, saying so (the measured rows stand)."""
    try:
        return rows()
    except Exception as exc:  # noqa: BLE001 - reported, the other rows kept
        print(f"obskernels.bench.cuda_host: {failed}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m obskernels.bench.cuda_host",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--n", type=int, default=200, help="calls per back-to-back round")
    ap.add_argument("--reps", type=int, default=50, help="single synchronised calls")
    ns = ap.parse_args(argv)
    from obskernels.bench.host import interpreting, rerun

    if interpreting():  # the kernels must compile for the GPU: run afresh without the interpreter
        return rerun("obskernels.bench.cuda_host", argv, interpret=False)
    import torch

    if not torch.cuda.is_available():
        print("obskernels.bench.cuda_host: no CUDA device is available (torch.cuda.is_available() "
              "is False); it measures on a GPU. For the CPU proxy: python -m obskernels.bench.host",
              file=sys.stderr)
        return 2
    rows = measure(ns.n, ns.reps, progress=None if ns.json else sys.stderr)
    traced = _rows_or_none(trace_rows, "the lead calls not traced")
    kernels = _rows_or_none(kernel_rows, "our kernels not profiled")
    if ns.json:
        for r in rows + traced + kernels:
            print(json.dumps(r))
        return 0
    print(f"MEASURED on {rows[0]['device']}: wall time per call; unit = one 1-element CUDA add_ "
          f"= {rows[0]['unit_us']:.2f} us (back to back)")
    print(f"{'row':58} {'loop us':>9} {'sync us':>9} {'wiped us':>9} {'issued us':>9} {'turns us':>9} "
          f"{'t-issued':>9} {'swept us':>9} {'units':>7} {'t-gc/1k':>8}")
    for r in rows:
        gc_1k = r["turns_gc_per_1000"]
        print(f"{r['row']:58} {r['loop_us']:9.1f} {r['sync_us']:9.1f} {r['wiped_us']:9.1f} "
              f"{_us(r['issued_us']):>9} {_us(r['turns_us']):>9} {_us(r['turns_issued_us']):>9} "
              f"{_us(r['swept_us']):>9} {r['units']:7.1f} {'-' if gc_1k is None else f'{gc_1k:.0f}':>8}")
    print("t-gc/1k: garbage collections that ran inside the timed calls in turns, per 1,000 calls")
    for r in rows:
        if "by_part_us" in r:
            print("minmax call by part (loop us): " + ", ".join(
                f"{name} {us:.1f}" for name, us in r["by_part_us"].items()))
    if traced:
        print("the lead calls traced (us, median per span of single calls; wiped: after the L2 wipe, "
              "turns: after llm-compressor's call and the wipe)")
        print("  columns: " + "; ".join(f"{head}: {span}" for head, span in zip(_SPAN_HEADS, SPANS)))
        print(f"{'row':52} {'setting':7} " + " ".join(f"{h:>8}" for h in _SPAN_HEADS) + f" {'total':>8}")
        for r in traced:
            spans = r["spans_us"] or {}
            print(f"{r['row']:52} {r['setting']:7} "
                  + " ".join(f"{_us(spans.get(s)):>8}" for s in SPANS) + f" {_us(r['total_us']):>8}")
    if kernels:
        print("our kernels' device time per lead call (us, torch profiler over 20 calls; back to back: the "
              "value in the L2; wiped: after the L2 wipe; turns: after llm-compressor's call and the wipe)")
        print(f"{'row':52} " + " ".join(f"{h:>13}" for h in KERNEL_SETTINGS))
        for r in kernels:
            print(f"{r['row']:52} " + " ".join(f"{_us(r['kernels_us'].get(h)):>13}" for h in KERNEL_SETTINGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
