"""Runs the sweep: measures what can be measured here, models every backend.

For each (case, target, backend) one record:
- MEASURED (``measured_s``, ``peak_bytes``, ``peak_pct``, ``throughput_gbs``):
  the PyTorch backends on any device; the Triton backends on CUDA only. Wall
  time of one call, synchronised (``torch.cuda.synchronize`` before and after
  on a GPU, the L2 wiped before), median of repeated calls after a warm-up,
  the backends of a case and target in turns (``interleaved_samples``), in
  ``Options.rounds`` passes over the whole run (``passes``; every other one
  backwards); an observer call includes constructing the observer
  (``Prepared.build``).
  Peak: the extra memory the call holds above what existed before, as bytes and
  as % of the value's bytes: on a GPU ``torch.cuda.max_memory_allocated``; on
  the CPU the live storage created by aten ops (``AtenTraffic``), for Triton
  rows over one call in triton's interpreter (up to ``PEAK_DIRECT_LIMIT``
  elements): what the launcher and the torch code around the kernels allocate.
- MODELLED (``bytes_moved``, ``launches``, ``flops``, ``modelled_s``; the
  counting lives in ``counting``, the host term in ``hostcost``): by default on
  a CPU, opt-in on CUDA (``Options.model``), where a run measures in minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, TextIO, Tuple

import torch

from obskernels.bench.backends import (
    BACKENDS,
    NotApplicable,
    backend_unavailable_reason,
    prepare,
)
from obskernels.bench import hostcost
from obskernels.bench.cases import OBSERVERS, OPS, Case, Target, make_value, sweep, targets_for
from obskernels.bench.counting import (
    count_call,
    model_counts,
    model_in_subprocess,
    sass_results,
    start_sass,
    search_steps,
)
from obskernels.bench.model import H100_SXM, GpuModel, model_call
from obskernels.bench.records import CaseInfo, Model, Provenance, Record, Timing
from obskernels.bench.traffic import peak_memory

__all__ = ["Options", "run", "count_call", "model_counts", "machine_info", "REQUIRED_KEYS"]

REQUIRED_KEYS = (
    "op",
    "backend",
    "shape",
    "dtype",
    "strategy",
    "format",
    "measured_s",
    "peak_bytes",
    "bytes_moved",
    "compulsory_bytes",
    "launches",
    "modelled_s",
    "modelled_lanes_s",
    "model",
    "sass_per_elem_step",
    "registers",
    "spills",
    "machine",
    "versions",
    "timestamp",
)

# Triton rows on the CPU: largest value whose peak memory is taken by one call in
# triton's interpreter (an MSE search there: about 5 s at 2^16 elements on 2 cores)
PEAK_DIRECT_LIMIT = 1 << 16


@dataclass
class Options:
    mode: str = "quick"
    ops: Tuple[str, ...] = tuple(OPS)
    observers: Tuple[str, ...] = tuple(OBSERVERS)
    backends: Tuple[str, ...] = BACKENDS
    out: str = "bench-out"
    gpu: GpuModel = H100_SXM
    device: str = "cpu"
    min_reps: int = 3
    max_reps: int = 5
    min_time_s: float = 0.2
    max_time_s: float = 1.5  # stop after this long even below min_reps (slow rows)
    project_full: bool = True  # quick mode: also model the full-size shapes
    model: bool = True  # count and model (the interpreter, sm_90a compiles, the host path)
    sass: bool = True  # compile the Triton calls for sm_90a: the model's compute term
    sass_python: Optional[str] = None  # compile with this interpreter's triton (default: this one's)
    host: bool = True  # measure each call's host path (the model's host term)
    # ... each call after the other library's, as the lead rows take turns
    # (False: alone, for measurements timed that way: the runs before the turns)
    host_turns: bool = True
    split: bool = False  # also profile each measured row's device work (``device_split``)
    warmup_s: float = 0.025  # untimed calls before the timed ones, for at least this long
    # passes over the whole run, each timing every row's share of its calls
    # (``passes``: a burst of host noise then slows one pass of a row, not the row)
    rounds: int = 1
    cases: Optional[List[Case]] = None  # overrides the sweep (tests)
    progress: Optional[TextIO] = field(default_factory=lambda: sys.stderr)


# ------------------------------------------------------------------ machine


def _versions() -> Dict[str, Optional[str]]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "compressed-tensors", "llmcompressor", "obskernels", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(device: str) -> Dict[str, object]:
    info: Dict[str, object] = {
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        info["loadavg"] = None
    return info


# -------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wipe_buffer(device: str):
    """On CUDA, 256 MB to zero before each timed call (more than any L2), else None."""
    return torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda") if device == "cuda" else None


def _before_call(prepared, device: str, flush=None) -> None:
    """What precedes every timed (or profiled) call, untimed: its setup, the
    L2 wiped (``flush``: ``_wipe_buffer``'s), the device synchronised."""
    prepared.setup()
    if flush is not None:
        flush.zero_()  # like triton.testing.do_bench: wipe the L2 first
    _sync(device)


def _one_call(prepared, device: str, flush=None) -> float:
    """Wall seconds of one synchronised call (with its observer's construction)."""
    _before_call(prepared, device, flush)
    t0 = time.perf_counter()
    prepared.call()
    _sync(device)
    return time.perf_counter() - t0


def _stats(times: List[float]) -> Tuple[float, int, float]:
    """(median, count, fastest) of some calls' seconds: the median of one
    call, how many calls were timed (after the warm-up), and the fastest (a
    guide when other work shares the machine)."""
    return statistics.median(times), len(times), min(times)


def interleaved_samples(prepared: List, device: str, opts: Options) -> List[List[float]]:
    """Per row of ``prepared`` (the rows of one case and target, one per
    backend), the seconds of each of its timed calls.

    The rows take turns, one call each, so that they are timed under the
    same state of the machine (the GPU's clocks, the host's load): timed one
    after another, two rows of the same kernels read 0.13 and 0.20 ms on an
    H200's host. A row stops as it did alone, on its own calls' time (each
    call with what precedes it, ``_before_call``): at ``opts.max_reps``, at
    ``opts.min_reps`` once ``opts.min_time_s`` is spent, or after
    ``opts.max_time_s``; the others go on taking turns.

    The warm-up: calls made as the timed ones, untimed, in the same turns,
    for ``opts.warmup_s`` (as triton.testing.do_bench's 25 ms), so that no
    row is timed while the GPU's clocks still climb from lighter work (a row
    of host-bound calls leaves a GPU mostly idle)."""
    flush = _wipe_buffer(device)
    start = time.perf_counter()
    while time.perf_counter() - start < opts.warmup_s:
        for p in prepared:
            _one_call(p, device, flush)
    times: List[List[float]] = [[] for _ in prepared]
    spent = [0.0] * len(prepared)
    running = list(range(len(prepared)))
    while running:
        for i in list(running):
            t0 = time.perf_counter()
            times[i].append(_one_call(prepared[i], device, flush))
            spent[i] += time.perf_counter() - t0
            n = len(times[i])
            if (n >= opts.max_reps or (n >= opts.min_reps and spent[i] >= opts.min_time_s)
                    or spent[i] >= opts.max_time_s):
                running.remove(i)
    return times


class LaunchWatch:
    """What the launch sites (``kernels/_replay.Replay``) note of a call while
    ``watching()``: ``issued_at``, when its first launch returned (None
    until one has), and with ``cuda`` the events ``start``, recorded before
    that launch, and ``end``, after its last. ``begin()`` before each call."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.begin()

    def begin(self) -> None:
        self.issued_at = None
        if self.cuda:  # made before the call starts: not in its time
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    @contextlib.contextmanager
    def watching(self):
        """Within the block every launch site's call is noted (a Python
        frame per launch; on CUDA an event recorded after each)."""
        from obskernels.kernels import _replay

        site_call = _replay.Replay.__call__

        def launch(site, *args, **kwargs):
            first, spent = self.issued_at is None, 0.0
            if first and self.cuda:
                t = time.perf_counter()
                self.start.record()
                spent = time.perf_counter() - t  # not the host's own time before the launch
            out = site_call(site, *args, **kwargs)
            if first:
                self.issued_at = time.perf_counter() - spent
            if self.cuda:
                self.end.record()
            return out

        _replay.Replay.__call__ = launch
        try:
            yield self
        finally:
            _replay.Replay.__call__ = site_call


class Issued(NamedTuple):
    """``issued_samples`` of one row: per timed call, the host's seconds
    until its first launch was issued and, on CUDA, the seconds from just
    before that launch was issued to the end of its last launch, on the
    device's clock (None where a call made no launch through a site, or off
    CUDA)."""

    host_s: List[Optional[float]]
    launched_s: List[Optional[float]]


class _Issued:
    """A prepared call noting what ``watch`` saw in each of its calls: the
    seconds until its first launch was issued (``host``) and, on CUDA, the
    events around its launches (``events``); None where it made none."""

    def __init__(self, prepared, watch: LaunchWatch):
        self.prepared, self.setup, self.watch, self.host, self.events = prepared, prepared.setup, watch, [], []

    def call(self):
        watch = self.watch
        watch.begin()
        t0 = time.perf_counter()
        out = self.prepared.call()
        launched = watch.issued_at is not None
        self.host.append(watch.issued_at - t0 if launched else None)
        self.events.append((watch.start, watch.end) if launched and watch.cuda else None)
        return out


def issued_samples(prepared: List, device: str, opts: Options,
                   marked: Sequence[bool]) -> List[Optional[Issued]]:
    """Per row of ``prepared`` that ``marked`` marks (obskernels' rows: their
    launches go through launch sites, ``kernels/_replay.Replay``), for each
    timed call: the host's seconds from the call's start until its first
    launch was issued (the site returned) and, on CUDA, the seconds from
    just before that launch was issued to the end of the call's last
    launch (CUDA events recorded around them, on the device's clock: the
    host's issue of the first launch, which an idle GPU waits for, the
    kernels, and the host's time between launches); None for a row not
    marked. The rows take turns as ``interleaved_samples`` times them (its
    warm-up, the L2 wiped, synchronised), in one more pass made for this
    only: the sites are wrapped within it (a Python frame per launch, an
    event recorded after each), no measured time comes from it. An idle GPU
    waits the first figure for work; the second less ``device_split``'s
    kernels (the device's work of the same calls, profiled) is the host's
    launching, as the timed calls meet it."""
    watch = LaunchWatch(device == "cuda")
    rows = [_Issued(p, watch) if m else p for p, m in zip(prepared, marked)]
    with watch.watching():
        times = interleaved_samples(rows, device, opts)
    out: List[Optional[Issued]] = []
    for row, m, t in zip(rows, marked, times):
        if not m:
            out.append(None)
            continue
        timed = len(row.host) - len(t)  # the timed calls (the warm-up's precede them)
        out.append(Issued(row.host[timed:], [None if e is None else e[0].elapsed_time(e[1]) * 1e-3
                                             for e in row.events[timed:]]))
    return out


#: the backends whose launches go through launch sites (``issued_samples``)
ISSUED_BACKENDS = ("triton",)

#: calls ``device_split`` profiles per row
SPLIT_CALLS = 5
#: the most kernel (or op) names a split keeps, the longest first
SPLIT_NAMES = 8


def device_split(prepared, device: str, calls: int = SPLIT_CALLS) -> Tuple[float, Dict[str, float]]:
    """The work one call gives the device: (seconds per call, {kernel or copy
    name: us per call}, at most ``SPLIT_NAMES`` of them, the longest first),
    by the torch profiler around ``calls`` calls made as the timed ones are
    (``_before_call``: setup, the L2 wiped, synchronised; synchronised after);
    the profiler starts after the wipe, so its kernel is not counted. On CUDA:
    the device time of the call's kernels, copies and fills, whatever issued
    them (Triton, aten, the driver). Beside a call's wall time it says how
    much of the call the GPU was working: the rest is the host, or the GPU
    waiting for it. On a CPU: the call's top-level aten ops (the work of a
    torch path there)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    flush = _wipe_buffer(device)
    spent: Dict[str, float] = {}
    for _ in range(calls):
        _before_call(prepared, device, flush)
        with profile(activities=activities) as prof:
            prepared.call()
            _sync(device)
        for e in prof.events():
            if cuda:
                if e.device_type != DeviceType.CUDA:
                    continue
                us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            elif e.cpu_parent is None and e.name.startswith("aten::"):
                us = e.cpu_time_total
            else:
                continue
            spent[e.name[:60]] = spent.get(e.name[:60], 0.0) + us / calls
    total = sum(spent.values())
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:SPLIT_NAMES]
    return total * 1e-6, {name: round(us, 2) for name, us in top}


def cuda_peak(prepared) -> int:
    """Peak bytes allocated during one call above what was allocated before."""
    prepared.setup()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prepared.call()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


# -------------------------------------------------------------------- records

def _base_record(case: Case, target: Target, backend: str, shape, ctx: Dict) -> Record:
    """A record of ``target`` on ``case`` at ``shape`` with no figures yet."""
    spec = case.spec
    full = tuple(case.full_shape or shape)
    return Record(
        op=target.label,
        target_kind=target.kind,
        backend=backend,
        case=CaseInfo(
            label=case.with_shape(shape).label,
            kind=case.kind,
            base_name=case.base_name,
            shape=tuple(shape),
            full_shape=full,
            scaled=tuple(shape) != full,
            dtype=case.dtype,
            strategy=spec.strategy,
            format=spec.fmt,
            scheme=spec.name,
        ),
        provenance=Provenance(mode=ctx["mode"], machine=ctx["machine"], versions=ctx["versions"]),
        model=Model(gpu=ctx["gpu"].describe()),
    )

def _per_element(rec: Record, target: Target, shape) -> Record:
    steps = search_steps(target)
    if steps and rec.traffic.flops:
        per = round(rec.traffic.flops / (shape[0] * shape[1] * steps), 1)
        return rec.replace(traffic=dataclasses.replace(
            rec.traffic, search_steps=steps, flops_per_element_step=per))
    return rec

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

class _Progress:
    def __init__(self, stream: Optional[TextIO], total: int):
        self.stream, self.total, self.i, self.t0 = stream, total, 0, time.perf_counter()

    def __call__(self, rec: Record) -> None:
        self.i += 1
        if self.stream is None:
            return
        if rec.timing.measured_s is not None:
            what = f"measured {rec.timing.measured_s * 1e3:9.3f} ms"
            if rec.timing.device_s is not None:
                what += f" (device {rec.timing.device_s * 1e6:.1f} us)"
        elif rec.model.modelled_s is not None:
            what = f"modelled {rec.model.modelled_s * 1e6:9.1f} us on GPU"
        else:
            what = rec.status[:60]
        self.stream.write(
            f"[{self.i:4d}/{self.total}] {time.perf_counter() - self.t0:6.1f}s  "
            f"{rec.case.label:<34} {rec.op:<22} {rec.backend:<12} {what}\n"
        )
        self.stream.flush()

def _measured(prepared, device: str, timed: Tuple[float, int, float], timer: str,
              peak_bytes: Optional[int] = None, peak_method: Optional[str] = None) -> Timing:
    """The timing of ``prepared``: ``timed`` (``_stats`` of its timed calls,
    taken with ``timer``: how); the peak is CUDA's on a GPU, else the one
    given. The device work (``--split``) is not taken here: ``run`` profiles
    every row after the last one is timed (``with_split``)."""
    median, reps, fastest = timed
    if device == "cuda":
        peak_bytes, peak_method = cuda_peak(prepared), "torch.cuda.max_memory_allocated above the memory held before"
    return Timing(measured_s=median, measured_reps=reps, measured_min_s=fastest,
                  timer=f"wall, synchronised, median ({device}){timer}",
                  peak_bytes=peak_bytes, peak_method=peak_method)


def with_split(timing: Timing, prepared, device: str) -> Timing:
    """``timing`` with the device work of ``prepared`` (``device_split``), or
    with why it was not taken (a split that fails leaves the time as it is).

    ``run`` profiles the rows only once the last one is timed. torch's
    profiler, having traced CUDA activities, leaves NVIDIA's CUPTI attached to
    the process (Kineto tears it down only when told to), and CUPTI's
    callbacks then ride on every later CUDA call: launches, allocations,
    copies. With each split taken right after its row, every later row was
    timed under them, which no user's call is. The price: each measured
    row's call, and the value it reads, is kept until the splits are taken."""
    try:
        seconds, ops = device_split(prepared, device)
    except Exception as exc:  # the row's time stands; only its split is missing, said why
        return dataclasses.replace(timing, device_method=f"not taken: {type(exc).__name__}: {str(exc)[:200]}")
    return dataclasses.replace(timing, device_s=seconds, device_ops=ops, device_method=(
        f"torch profiler over {SPLIT_CALLS} calls: "
        + ("device time of the call's kernels and copies" if device == "cuda" else "its top-level aten ops")))


class _ToTime(NamedTuple):
    """A row to time (``_sample_rows``): its prepared call, warmed up, and the
    peak memory already taken of it, if any, with its method."""

    prepared: object
    peak_bytes: Optional[int] = None
    peak_method: Optional[str] = None


def passes(opts: Options) -> Options:
    """``opts`` for one of ``opts.rounds`` passes over the run: each pass
    times every row for its share of the calls (at least one call, and no
    more in all than ``max_reps``) and of the time limits. One pass after
    another, a row's calls are spread over the whole run: a burst of other
    work on the host (seconds, where a case's rows are timed in a fraction
    of one) slows one pass of a row rather than all of its calls."""
    r = opts.rounds
    if r < 1:
        raise ValueError(f"rounds must be at least 1 (got {r})")
    if r == 1:
        return opts
    most = max(1, opts.max_reps // r)
    return dataclasses.replace(opts, min_reps=min(-(-opts.min_reps // r), most), max_reps=most,
                               min_time_s=opts.min_time_s / r, max_time_s=opts.max_time_s / r)


class _Group(NamedTuple):
    """One case and target's rows (one per backend, ``(record, row to time
    or None)``) and, per row to time, the seconds of its calls in each pass
    so far (a list per pass) or the exception that stopped it; ``alone``:
    per pass so far, whether it timed them one by one (taking turns failed);
    ``issued``: per row to time, its ``issued_samples`` (None where not
    taken) or the exception that stopped them."""

    case: Case
    target: Target
    rows: List[Tuple[Record, Optional[_ToTime]]]
    timed: List[_ToTime]
    samples: List[object]
    alone: List[bool]
    issued: List[object]


def _sample_rows(rows: List[_ToTime], device: str, opts: Options) -> Tuple[List[object], bool]:
    """One pass over the rows of one case and target: per row the seconds
    of its timed calls, the rows taking turns (``interleaved_samples``);
    where that fails, each row timed alone, a row that fails giving its
    exception in its place (and True: timed alone)."""
    try:
        return interleaved_samples([r.prepared for r in rows], device, opts), False
    except Exception:  # find which, timing each alone
        out: List[object] = []
        for row in rows:
            try:
                out.append(interleaved_samples([row.prepared], device, opts)[0])
            except Exception as exc:
                out.append(exc)
        return out, True


def _sample_group(group: _Group, device: str, opts: Options) -> None:
    """One more pass over ``group``'s rows, its calls kept beside the earlier
    passes' (a row that failed in any pass keeps its exception)."""
    if not group.timed:
        return
    more, alone = _sample_rows(group.timed, device, opts)
    group.samples[:] = [old if isinstance(old, Exception) else new if isinstance(new, Exception)
                        else old + [new] for old, new in zip(group.samples, more)]
    group.alone.append(alone)


def _issue_group(group: _Group, device: str, opts: Options) -> None:
    """``group.issued``: ``issued_samples`` of its obskernels rows, the rows
    taking turns as in a timed pass; where that fails, the exception in
    each of those rows' place (their times stand)."""
    marked = [rec.backend in ISSUED_BACKENDS for rec, row in group.rows if row is not None]
    if not any(marked):
        return
    try:
        group.issued[:] = issued_samples([r.prepared for r in group.timed], device, opts, marked)
    except Exception as exc:
        group.issued[:] = [exc if m else None for m in marked]


def _with_issued(timing: Timing, issued) -> Timing:
    """``timing`` with its row's ``issued_samples`` (their median), or with
    why they were not taken."""
    if issued is None:
        return timing
    if isinstance(issued, Exception):
        return dataclasses.replace(timing, issued_method=f"not taken: {type(issued).__name__}: "
                                                         f"{str(issued)[:200]}")
    seen = [t for t in issued.host_s if t is not None]
    if not seen:
        return dataclasses.replace(timing, issued_method="no launch through a launch site")
    launched = [t for t in issued.launched_s if t is not None]
    return dataclasses.replace(
        timing, issued_s=statistics.median(seen), launched_s=statistics.median(launched) if launched else None,
        issued_method=(f"median of {len(seen)} calls in one more pass taking turns as the timed calls, "
                       "the launch sites wrapped: the host from the call's start until its first launch "
                       "was issued" + ("; from just before that launch was issued to the end of the "
                                       "last kernel (CUDA events)" if launched else "")))


def _timings(group: _Group, device: str, opts: Options) -> List[object]:
    """The ``Timing`` of each row of ``group`` to time, from its calls of
    every pass (their median, count and fastest; with more than one pass,
    each pass's median too), or its exception."""
    timer = ", in turns with the case's other backends" if len(group.timed) > 1 and not any(group.alone) else ""
    if opts.rounds > 1:
        timer += f", {opts.rounds} passes over the run"
    out: List[object] = []
    for row, per_pass, issued in zip(group.timed, group.samples, group.issued):
        if isinstance(per_pass, Exception):
            out.append(per_pass)
            continue
        try:
            timing = _measured(row.prepared, device, _stats([t for calls in per_pass for t in calls]),
                               timer, row.peak_bytes, row.peak_method)
        except Exception as exc:
            out.append(exc)
            continue
        if opts.rounds > 1:
            timing = dataclasses.replace(timing, measured_pass_s=tuple(map(statistics.median, per_pass)))
        out.append(_with_issued(timing, issued))
    return out


def _torch_path(case, target, backend, value, device, opts, rec: Record,
                host=None) -> Tuple[Record, List, _ToTime]:
    """A path whose every launch is an aten op: count exactly (when modelling).
    Returns the record, the call's per-launch counts (for the projection)
    and the row to time."""
    prepared = prepare(case, target, backend, device=device, value=value)
    if not opts.model or backend == "llmc":  # "llmc" is measured only (its GPU path is not all aten)
        _one_call(prepared, device)  # warm-up
        return rec, [], _ToTime(prepared)
    counts, comp, _ = count_call(prepared, device, triton=False)  # also the warm-up
    d = counts.to_dict()
    d["count_method"] = "exact: aten ops counted at this shape"
    traffic, model = model_call(d, comp, opts.gpu, host=host)
    return (rec.replace(traffic=traffic, model=model), d["per_launch"],
            _ToTime(prepared, counts.peak_bytes,
                    "live storage of aten outputs during the call (TorchDispatchMode)"))


def _triton_path(case, target, backend, value, device, opts, rec: Record, modelled: Dict,
                 sass: Optional[Dict] = None,
                 host: Optional[Dict] = None) -> Tuple[Record, Optional[_ToTime]]:
    """A Triton path: its model where it was modelled; on CUDA the row to
    time (None where there is none to time)."""
    if modelled.get("status") == "ok":
        traffic, model = model_call(modelled, modelled.get("compulsory_bytes"), opts.gpu, sass, host)
        rec = rec.replace(traffic=traffic, model=model, status="modelled")
    elif opts.model:
        rec = rec.replace(status=modelled.get("status", "not modelled"))
    if device != "cuda":
        if rec.status == "modelled":
            rec = rec.replace(note="not measured: no CUDA device (the interpreter's time means nothing)",
                              timing=_interpreter_peak(case, target, backend, value))
        return rec, None
    if (rec.status or "").startswith(("unsupported", "n/a")):
        return rec, None
    prepared = prepare(case, target, backend, device=device, value=value)
    _one_call(prepared, device)  # warm-up (compiles)
    return rec, _ToTime(prepared)


def interpreter_peak_bytes(prepared) -> int:
    """Peak extra memory of one call of a Triton path run by triton's interpreter."""
    prepared.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with peak_memory("cpu") as counts:
            prepared.call()
    return counts.peak_bytes

def _interpreter_peak(case, target, backend, value) -> Timing:
    if case.numel > PEAK_DIRECT_LIMIT:
        return Timing(peak_method=f"not taken: over {PEAK_DIRECT_LIMIT} elements for triton's interpreter")
    try:
        peak = interpreter_peak_bytes(prepare(case, target, backend, device="cpu", value=value))
    except Exception as exc:  # the modelled row stays; only its peak is missing
        return Timing(peak_method=f"not taken: {type(exc).__name__}: {str(exc)[:200]}")
    return Timing(peak_bytes=peak, peak_method=(
        "live storage created by torch during one call in triton's interpreter "
        "(launcher allocations and host code; the interpreter's own copies excluded)"))

def _with_peak_pct(rec: Record, case: Case) -> Record:
    """The peak as % of the value's bytes (the record's shape and dtype)."""
    if rec.timing.peak_bytes is None:
        return rec
    value = rec.case.shape[0] * rec.case.shape[1] * case.torch_dtype.itemsize
    return rec.replace(timing=dataclasses.replace(rec.timing, peak_pct=round(100 * rec.timing.peak_bytes / value, 2)))

def _projected_torch_counts(case: Case, src: Record, per_launch: List, n_full: int) -> Dict:
    """A PyTorch path's counts at the full size: the scaled run's, times the element ratio."""
    scale = n_full / case.numel
    t = src.traffic
    return {
        "bytes_moved": int(t.bytes_moved * scale),
        "bytes_read": int(t.bytes_read * scale),
        "bytes_written": int(t.bytes_written * scale),
        "launches": t.launches,
        "flops": int(t.flops * scale),
        "syncs": t.syncs or 0,
        "per_launch": [[k, nm, b * scale, f * scale] for k, nm, b, f in per_launch],
        "count_method": (
            f"aten counts at {case.shape[0]}x{case.shape[1]} scaled by the element "
            "count (approximate: the search's early stop depends on the data)"
        ),
    }

#: rounds of ``_host_paths`` over the paths to measure (``hostcost.quietest``),
#: and each measurement's time budget (a slow path's calls: ``hostcost.measure``)
HOST_ROUNDS = 3
HOST_BUDGET_S = 0.05


def _host_paths(plan, unavailable, opts: Options) -> Dict[Tuple, Dict]:
    """Each modelled (case, target, backend)'s host path, measured once per
    scheme (``hostcost.measure``; the host cost does not depend on the size)
    in each of ``HOST_ROUNDS`` rounds that go over all the paths in turn, a
    path's figure its ``hostcost.quietest`` of them: a stretch of other work
    on a shared machine slows one round of every path, not every call of one.
    Each call is measured right after a call of its ``hostcost.turn_partner``
    where that backend can run here, as the lead rows take turns with the
    other library; alone where it cannot, or with ``opts.host_turns`` off."""
    out: Dict[Tuple, Dict] = {}
    if not (opts.model and opts.host):
        return out
    todo = [(c, t, b) for c, t, b in plan if not unavailable[b] and b != "llmc"]
    keys = {(c, t, b): (c.kind, c.dtype, c.scheme, t, b) for c, t, b in todo}
    paths: Dict[Tuple, Tuple] = {}
    for call, key in keys.items():
        paths.setdefault(key, call)
    can_run: Dict[str, bool] = {}

    def partner_of(target, backend) -> Optional[str]:
        if not opts.host_turns:
            return None
        partner = hostcost.turn_partner(target, backend)
        if partner not in can_run:
            can_run[partner] = backend_unavailable_reason(partner, opts.device) is None
        return partner if can_run[partner] else None

    t0 = time.perf_counter()
    if opts.progress and todo:
        opts.progress.write(f"measuring the host path of {len(todo)} calls (launches stubbed)...\n")
    taken: Dict[Tuple, Optional[List[Dict]]] = {key: [] for key in paths}
    for _ in range(HOST_ROUNDS):
        for key, (case, target, backend) in paths.items():
            if taken[key] is None:
                continue
            try:
                taken[key].append(hostcost.measure(case, target, backend, budget_s=HOST_BUDGET_S,
                                                   partner=partner_of(target, backend)))
            except Exception:  # n/a, unsupported...: the row says why; no host term
                taken[key] = None
    done = {key: None if not got else hostcost.quietest(got) for key, got in taken.items()}
    for call, key in keys.items():
        if done[key] is not None:
            out[call] = done[key]
    if opts.progress and todo:
        opts.progress.write(f"  {len(done)} host paths measured in {HOST_ROUNDS} rounds in "
                            f"{time.perf_counter() - t0:.0f} s\n")
    return out


def _modelled(jobs, device: str, progress) -> Dict[Tuple, Dict]:
    """``model_counts`` of each job, by (case, target, backend, shape): in
    this process on a CPU (its progress written per job), in a child process
    with the interpreter on CUDA."""
    if not jobs:
        return {}
    if progress:
        progress.write(f"modelling {len(jobs)} Triton calls in triton's interpreter...\n")
    if device == "cuda":
        results = model_in_subprocess(jobs, progress)
    else:
        results = []
        for i, (c, t, b, s) in enumerate(jobs):
            results.append(model_counts(c, t, b, s))
            if progress:
                r = results[-1]
                progress.write(
                    f"  [{i + 1}/{len(jobs)}] {c.label} @ {s[0]}x{s[1]} {t.label} {b}: "
                    f"{r['status'][:70]}"
                    + (f" ({r['count_seconds']} s)" if "count_seconds" in r else "")
                    + "\n"
                )
    return {(c, t, b, tuple(s)): r for (c, t, b, s), r in zip(jobs, results)}


def _error(exc: Exception) -> str:
    """A row's status after ``exc``."""
    return f"error: {type(exc).__name__}: {str(exc)[:300]}"


def run(opts: Options) -> List[Record]:
    """Runs the sweep; writes nothing (see report.write_all). Returns the records."""
    device = opts.device
    cases = opts.cases if opts.cases is not None else sweep(opts.mode)
    ctx = {"gpu": opts.gpu, "mode": opts.mode, "machine": machine_info(device), "versions": _versions()}
    plan: List[Tuple[Case, Target, str]] = []
    for case in cases:
        for target in targets_for(case, opts.ops, opts.observers):
            for backend in opts.backends:
                plan.append((case, target, backend))

    unavailable = {b: backend_unavailable_reason(b, device) for b in opts.backends}
    triton_backends = [b for b in ("triton", "llmc-triton") if b in opts.backends and not unavailable[b]]

    # 1. model the Triton paths (the interpreter), in this process on a CPU
    jobs = [(c, t, b, c.shape) for c, t, b in plan if b in triton_backends] if opts.model else []
    projections: List[Tuple[Case, Target, str]] = []
    if opts.project_full and opts.model:
        seen = set()
        for c, t, b in plan:
            if c.scaled and b != "llmc" and (c, t, b) not in seen:
                seen.add((c, t, b))
                projections.append((c, t, b))
        jobs += [(c, t, b, c.full_shape) for c, t, b in projections if b in triton_backends]
    # 1b (started first, collected after 1). the same Triton calls recorded
    # with the GPU's launch configuration and compiled to sm_90a in a child
    # process, while this one counts: the compute term of the model
    sass_run = None
    if jobs and opts.sass:
        if opts.progress:
            opts.progress.write(f"compiling the kernels of {len(jobs)} Triton calls for sm_90a "
                                "in a child process, meanwhile...\n")
        sass_run = start_sass(jobs, opts.progress, opts.sass_python)
    try:
        modelled = _modelled(jobs, device, opts.progress)
    except BaseException:
        if sass_run is not None:
            sass_run.stop()  # no child left compiling after this process gives up
        raise
    sass: Dict[Tuple, Dict] = {}
    if sass_run is not None:
        if opts.progress:
            opts.progress.write("waiting for the sm_90a compiles...\n")
        for (c, t, b, s), r in zip(jobs, sass_results(sass_run)):
            sass[(c, t, b, tuple(s))] = r
    # 1c. the host path of every call, launches stubbed: the host term (timed
    # on a machine the compiles no longer share)
    hosts = _host_paths(plan, unavailable, opts)

    # 2. measure (and count the PyTorch paths exactly); a case and target's
    # backends are timed together, in turns, in ``opts.rounds`` passes over
    # the run (``passes``, ``_sample_group``)
    records: List[Record] = []
    torch_launches: Dict[Tuple, List] = {}  # per-launch counts of the PyTorch paths
    progress = _Progress(opts.progress, len(plan))
    value_cache: Dict[Case, torch.Tensor] = {}
    # (index in records, prepared call) of the rows to profile after the timing (--split)
    to_split: List[Tuple[int, object]] = []
    per_pass = passes(opts)
    groups: List[_Group] = []  # with more than one pass: the groups timed again

    def finish(group: _Group) -> None:
        """The group's records, their rows' calls of every pass timed."""
        timings = iter(_timings(group, device, opts))
        for rec, row in group.rows:
            if row is not None:
                timing = next(timings)
                rec = (rec.replace(status=_error(timing)) if isinstance(timing, Exception)
                       else rec.replace(timing=timing, status="measured"))
            rec = _with_peak_pct(_per_element(rec, group.target, group.case.shape), group.case)
            if rec.timing.measured_s and rec.traffic.compulsory_bytes:
                rec = rec.replace(timing=dataclasses.replace(
                    rec.timing, throughput_gbs=rec.traffic.compulsory_bytes / rec.timing.measured_s / 1e9))
            rec = rec.replace(provenance=dataclasses.replace(rec.provenance, timestamp=_now()))
            if opts.split and rec.status == "measured":
                to_split.append((len(records), row.prepared))
            records.append(rec)
            progress(rec)

    for (case, target), entries in itertools.groupby(plan, key=lambda entry: entry[:2]):
        if case not in value_cache:
            value_cache.clear()
            value_cache[case] = make_value(case, device=device)
        value = value_cache[case]
        rows: List[Tuple[Record, Optional[_ToTime]]] = []
        for _, _, backend in entries:
            rec, row = _base_record(case, target, backend, case.shape, ctx), None
            host = hosts.get((case, target, backend))
            try:
                if unavailable[backend]:
                    rec = rec.replace(status=f"unavailable: {unavailable[backend]}")
                elif backend in ("triton", "llmc-triton"):
                    key = (case, target, backend, tuple(case.shape))
                    rec, row = _triton_path(case, target, backend, value, device, opts, rec,
                                            modelled.get(key, {}), sass.get(key), host)
                else:
                    rec, torch_launches[(case, target, backend)], row = _torch_path(
                        case, target, backend, value, device, opts, rec, host)
            except NotApplicable as exc:
                rec = rec.replace(status=f"n/a: {exc}")
            except Exception as exc:
                rec = rec.replace(status=_error(exc))
            rows.append((rec, row))
        timed = [row for _, row in rows if row is not None]
        group = _Group(case, target, rows, timed, [[] for _ in timed], [], [None] * len(timed))
        _sample_group(group, device, per_pass)
        if device == "cuda":  # the host before the device has work (on a CPU the kernels run in it)
            _issue_group(group, device, per_pass)
        if opts.rounds == 1:
            finish(group)
        else:  # timed again in the later passes: its rows (and the value) kept until then
            groups.append(group)
    for k in range(1, opts.rounds):
        if opts.progress:
            opts.progress.write(f"timing pass {k + 1} of {opts.rounds}\n")
        # every other pass goes over the run backwards: a case timed early in
        # one pass is timed late in the next, so a row slow in every pass is
        # slow for its case, not for its place in the run
        for group in (groups[::-1] if k % 2 else groups):
            _sample_group(group, device, per_pass)
    for group in groups:
        finish(group)

    # 2b. --split: each measured row's device work, profiled once every row is
    # timed (``with_split``: a CUDA profiler would slow the rows timed after it)
    for i, prepared in to_split:
        records[i] = records[i].replace(timing=with_split(records[i].timing, prepared, device))

    # 3. full-size projections of the scaled (quick) cases: modelled only
    by_key = {(r.case.label, r.op, r.backend): r for r in records}
    for case, target, backend in projections:
        src = by_key.get((case.label, target.label, backend))
        full = case.full_shape
        rec = _base_record(case, target, backend, full, ctx).replace(scope="full-size projection")
        rec = rec.replace(provenance=dataclasses.replace(rec.provenance, timestamp=_now()))
        host = hosts.get((case, target, backend))
        if unavailable[backend]:
            continue
        if backend in triton_backends:
            key = (case, target, backend, tuple(full))
            m = modelled.get(key, {})
            if m.get("status") != "ok":
                rec = rec.replace(status=m.get("status", "not modelled"))
            else:
                traffic, model = model_call(m, m.get("compulsory_bytes"), opts.gpu, sass.get(key), host)
                rec = rec.replace(traffic=traffic, model=model, status="modelled")
        elif src and src.traffic.bytes_moved is not None:
            counts = _projected_torch_counts(case, src, torch_launches.get((case, target, backend)) or [],
                                             full[0] * full[1])
            comp = src.traffic.compulsory_bytes
            comp = int(comp * (full[0] * full[1] / case.numel)) if comp else comp
            traffic, model = model_call(counts, comp, opts.gpu, host=host)
            rec = rec.replace(traffic=traffic, model=model, status="modelled")
        else:
            continue
        records.append(_per_element(rec, target, full))
    end = machine_info(device)["loadavg"]
    return [r.replace(provenance=dataclasses.replace(
        r.provenance, machine=dict(r.provenance.machine, loadavg_end=end))) for r in records]
