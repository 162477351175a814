"""Runs the sweep: measures what can be measured here, models every backend.

For each (case, target, backend) one record:
- MEASURED (``measured_s``, ``peak_bytes``, ``throughput_gbs``): the PyTorch
  backends on any device; the Triton backends on CUDA only. Median wall time of
  repeated calls after a warm-up (perf_counter on the CPU; CUDA events around
  each call, after an L2 flush, on a GPU). CPU peak: live storage created by aten
  ops during the call (``AtenTraffic``); GPU peak: ``torch.cuda.max_memory_allocated``
  above what was allocated before the call. Triton rows on the CPU get a peak too
  (``peak_memory``: one call in triton's interpreter at the record's shape, up
  to ``PEAK_DIRECT_LIMIT`` elements): what the launcher and the torch code
  around the kernels allocate, i.e. the extra memory a GPU run holds.
- MODELLED (``bytes_moved``, ``launches``, ``flops``, ``modelled_s``): the
  PyTorch paths counted exactly at the record's shape by ``AtenTraffic``; the
  Triton paths counted by ``TritonTraffic`` in triton's interpreter, directly at
  the record's shape when it is small, else at two reduced shapes with the same
  group structure and extrapolated linearly in the element count (the record's
  ``count_method`` says which).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, TextIO, Tuple

import torch

from obskernels.bench.backends import (
    BACKENDS,
    NotApplicable,
    backend_unavailable_reason,
    prepare,
)
from obskernels.bench.cases import OBSERVERS, OPS, Case, Target, make_value, sweep, targets_for
from obskernels.bench.model import H100_SXM, GpuModel, affine_extrapolate, model_call
from obskernels.bench.records import CaseInfo, Model, Provenance, Record, Timing
from obskernels.bench.traffic import Counts, count_traffic, peak_memory
from obskernels.spec.search import IMATRIX_DEFAULTS, MSE_DEFAULTS, NVFP4_EXPANDED, num_steps

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

# a Triton count runs directly at the record's shape up to this many elements;
# above it, at two reduced shapes (the interpreter is slow)
DIRECT_COUNT_LIMIT = 1 << 12
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
    sass: bool = True  # compile the Triton calls for sm_90a: the model's compute term
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


def time_calls(prepared, device: str, opts: Options) -> Tuple[float, int, float]:
    """Median seconds of one call, how many calls were timed (after the warm-up),
    and the fastest call (a guide when other work shares the machine)."""
    times: List[float] = []
    start = time.perf_counter()
    flush = None
    if device == "cuda":
        # like triton.testing.do_bench: wipe the L2 before each call
        flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    while True:
        prepared.setup()
        if device == "cuda":
            flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            prepared.fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            prepared.fn()
            times.append(time.perf_counter() - t0)
        n = len(times)
        elapsed = time.perf_counter() - start
        if n >= opts.max_reps or (n >= opts.min_reps and elapsed >= opts.min_time_s):
            break
        if elapsed >= opts.max_time_s:
            break
    return statistics.median(times), len(times), min(times)


def cuda_peak(prepared) -> int:
    prepared.setup()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prepared.fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


# ------------------------------------------------------------------ counting


def count_call(prepared, device: str, triton: bool) -> Tuple[Counts, int, object]:
    """Runs one call under the counters: (counts, compulsory bytes, output)."""
    prepared.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_traffic(device, triton=triton) as counts:
            out = prepared.fn()
    return counts, prepared.compulsory(out), out


def _reduced_shapes(case: Case, shape: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Two small shapes with the group structure of ``shape``, for the interpreter.

    Whole groups are kept: a channel (or a whole-row TENSOR group) keeps the full
    row width, groups keep their size (rows of up to 1024 columns), 128x128
    blocks stay whole. The two shapes differ in rows only, so a count that is a
    constant plus a part proportional to the elements is recovered exactly.
    """
    rows, cols = shape
    strategy = case.spec.strategy
    if strategy == "block":
        return [(128, 128), (256, 128)]
    if strategy in ("group", "tensor_group"):
        c = min(cols, 1024)
        return [(2, c), (4, c)]
    return [(1, cols), (2, cols)]


_COUNT_CACHE: Dict[Tuple, Tuple[Counts, int]] = {}

_COUNT_FIELDS = ("bytes_read", "bytes_written", "launches", "aten_ops", "triton_launches",
                 "syncs", "flops", "triton_bytes", "triton_unique_bytes", "atomics")


def model_counts(case: Case, target: Target, backend: str, shape: Tuple[int, int]) -> Dict:
    """Counts of a Triton-path call at ``shape``, run in triton's interpreter.

    Directly when the shape is small; else at two reduced shapes and
    extrapolated (affine in the element count). Returns a dict with the counts,
    ``compulsory_bytes`` (computed for ``shape``), ``count_method`` and
    ``status`` ("ok", "unsupported: ..." or "error: ...").
    """

    n = shape[0] * shape[1]
    shapes = [shape] if n <= DIRECT_COUNT_LIMIT else _reduced_shapes(case, shape)
    points: Dict[int, Tuple[Counts, int]] = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        steps_note = stack.enter_context(_pinned_search_steps(target)) if backend == "triton" else None
        result = _count_points(case, target, backend, shapes, points)
    if result is not None:
        return result
    return _combine(points, shapes, n, t0, steps_note)

@contextlib.contextmanager
def _pinned_search_steps(target: Target):
    """Pins how many grid steps obskernels' MSE kernel evaluates per iteration.

    Its launcher evaluates 32 steps at a time under the interpreter (1 on a
    GPU), so with 20 steps 12 masked surplus steps would be counted as
    arithmetic. Pinning the largest power of two that leaves (almost) no surplus
    counts the arithmetic a GPU does; results do not change. The configuration
    is passed in through ``launch_config`` (kernels/launch.py), not patched
    into the kernel module. A pin set by an enclosing ``launch_config`` block
    (a caller's own configuration) is left as it is.
    """
    steps = search_steps(target)
    launch = importlib.import_module("obskernels.kernels.launch")
    if not steps or launch.current_config("mse_search").steps_per_iter is not None:
        yield None
        return
    per_iter = 1
    for s in (32, 16, 8, 4, 2):
        if -(-steps // s) * s - steps <= steps // 32:
            per_iter = s
            break
    with launch.launch_config(ops="mse_search", steps_per_iter=per_iter):
        yield f"MSE kernel pinned to {per_iter} steps per iteration (no surplus steps counted)"

def _count_points(case, target, backend, shapes, points) -> Optional[Dict]:
    """Counts at each shape into ``points``; a status dict when it cannot."""
    from obskernels.backends import KernelUnsupportedError

    try:
        for s in shapes:
            # the count depends on the shape, not on which case asked for it
            key = (case.kind, case.dtype, case.scheme, target, backend, tuple(s))
            if key not in _COUNT_CACHE:
                prepared = prepare(case, target, backend, shape=s, device="cpu")
                counts, comp, _ = count_call(prepared, "cpu", triton=True)
                _COUNT_CACHE[key] = (counts, comp)
            points[s[0] * s[1]] = _COUNT_CACHE[key]
    except NotApplicable as exc:
        return {"status": f"n/a: {exc}"}
    except KernelUnsupportedError as exc:
        return {"status": f"unsupported: {exc}"}
    except Exception as exc:  # a kernel failing in the interpreter is reported, not fatal
        cause = exc
        while cause.__cause__ is not None and isinstance(cause, type(exc)):
            cause = cause.__cause__
        if isinstance(cause, KernelUnsupportedError):
            return {"status": f"unsupported: {cause}"}
        where = " in triton's interpreter" if "Interpreter" in type(exc).__name__ else ""
        return {"status": f"error{where}: {type(exc).__name__}: {str(exc)[:300]}"}
    return None

def _combine(points, shapes, n: int, t0: float, steps_note: Optional[str]) -> Dict:
    """The counts at ``n`` elements from the counted points (extrapolated when reduced)."""
    out: Dict[str, object] = {"status": "ok", "count_seconds": round(time.perf_counter() - t0, 3)}
    for f in _COUNT_FIELDS:
        vals = {k: getattr(c, f) for k, (c, _) in points.items()}
        v = affine_extrapolate(vals, n) if len(vals) > 1 else next(iter(vals.values()))
        out[f] = int(round(max(v, 0)))
    # launches must not depend on the size; report it if they do
    launch_set = {c.launches for c, _ in points.values()}
    if len(shapes) == 1:
        out["count_method"] = ("exact: interpreter run at this shape; kernel layout as its "
                               "launcher chose for the CPU interpreter")
    else:
        out["count_method"] = (
            "interpreter runs at reduced shapes "
            + ", ".join(f"{a}x{b}" for a, b in shapes)
            + ", extrapolated linearly in the element count; kernel layout as its "
            "launcher chose for the CPU interpreter (on a GPU it may split a reduction "
            "across more programs)"
        )
        if len(launch_set) > 1:
            out["count_method"] += f" (launch counts differ: {sorted(launch_set)})"
    if steps_note:
        out["count_method"] += "; " + steps_note
    out["bytes_moved"] = out["bytes_read"] + out["bytes_written"]
    comps = {k: comp for k, (_, comp) in points.items()}
    out["compulsory_bytes"] = int(round(
        affine_extrapolate(comps, n) if len(comps) > 1 else next(iter(comps.values()))
    ))
    op_names: Dict[str, int] = {}
    for c, _ in points.values():
        op_names = c.op_names  # the larger shape's (last) breakdown
    out["op_names"] = op_names
    out["per_launch"] = _extrapolate_launches(points, n)
    # programs follow the launcher's block choice for each shape: not extrapolated
    out["triton_programs_at_counted_shape"] = points[max(points)][0].triton_programs
    return out

def _extrapolate_launches(points, n: int) -> List[List]:
    """Per-launch [kind, name, bytes, lanes] at ``n`` elements: launch by launch
    (affine in the element count) when every counted shape issued the same
    launches, else the largest shape's list scaled by the element count."""
    lists = {k: c.per_launch for k, (c, _) in points.items()}
    ref = lists[max(lists)]
    same = all([(e[0], e[1]) for e in v] == [(e[0], e[1]) for e in ref] for v in lists.values())
    if len(lists) == 1 or not same:
        scale = n / max(lists)
        return [[k, name, b * scale, f * scale] for k, name, b, f in ref]
    out = []
    for i, (kind, name, _, _) in enumerate(ref):
        b = affine_extrapolate({k: v[i][2] for k, v in lists.items()}, n)
        f = affine_extrapolate({k: v[i][3] for k, v in lists.items()}, n)
        out.append([kind, name, max(b, 0.0), max(f, 0.0)])
    return out


def _sass_in_subprocess(jobs: List[Tuple[Case, Target, str, Tuple[int, int]]], progress) -> List[Dict]:
    """Runs ``sass_worker`` in a child process WITHOUT the interpreter: each
    Triton call is recorded at its shape with the GPU's launch configuration
    and its kernels compiled to sm_90a (obskernels.tools.kernel_report)."""
    payload = [
        {"case": dataclasses.asdict(c), "target": t.label if t.kind == "op" else t.name,
         "target_kind": t.kind, "backend": b, "shape": list(s)}
        for c, t, b, s in jobs
    ]
    env = dict(os.environ, PYTHONSAFEPATH="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "obskernels.bench", "--sass-worker"],
            input=json.dumps(payload), stdout=subprocess.PIPE, text=True, env=env,
            stderr=subprocess.DEVNULL if progress is None else None, timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return [{"status": "error: the SASS worker timed out"} for _ in jobs]
    if proc.returncode != 0:
        return [{"status": f"error: the SASS worker exited with {proc.returncode}"} for _ in jobs]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _decode_job(job: Dict) -> Tuple[Case, Target]:
    """(case, target) of a job the parent process sent as JSON to a worker."""
    c = job["case"]
    case = Case(c["kind"], tuple(c["shape"]), c["dtype"], c["scheme"],
                tuple(c["full_shape"]) if c.get("full_shape") else None)
    target = OPS[job["target"]] if job["target_kind"] == "op" else OBSERVERS[job["target"]]
    return case, target


def sass_worker(stdin: TextIO, stdout: TextIO) -> None:
    """Entry of the ``--sass-worker`` child: JSON jobs in, per-launch SASS profiles out."""
    import importlib

    report = importlib.import_module("obskernels.tools.kernel_report")
    jobs = json.loads(stdin.read())
    cache: Dict = {}
    results = []
    for job in jobs:
        case, target = _decode_job(job)
        res: Dict = {"status": "ok"}
        try:
            prepared = prepare(case, target, job["backend"], shape=tuple(job["shape"]), device="cpu")
            # nothing runs (every kernel is a recorder): the triton backend takes CPU tensors
            with report.recording() as sink, report.cpu_tensors_recorded():
                prepared.setup()  # e.g. the imatrix hook's statistics: not part of the call
                sink.clear()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        prepared.fn()
                except Exception as exc:  # outputs are not computed: later host code may object
                    res["note"] = f"call stopped after {len(sink)} launches: {type(exc).__name__}"
                launches = [report.Launch(case.label, "", n, f, g, a, k) for n, f, g, a, k in sink]
            res["launches"] = report.profile_launches(launches, cache)
        except Exception as exc:
            res = {"status": f"error: {type(exc).__name__}: {str(exc)[:200]}"}
        results.append(res)
        sys.stderr.write(f"  [sass {len(results)}/{len(jobs)}] {case.label} {target.label}: {res['status'][:60]}\n")
    stdout.write(json.dumps(results) + "\n")


def _model_in_subprocess(jobs: List[Tuple[Case, Target, str, Tuple[int, int]]], progress) -> List[Dict]:
    """Runs ``model_counts`` for each job in a child process with the interpreter on.

    Used on a CUDA machine, where this process's triton compiles for the GPU.
    """
    payload = [
        {"case": dataclasses.asdict(c), "target": t.label if t.kind == "op" else t.name,
         "target_kind": t.kind, "backend": b, "shape": list(s)}
        for c, t, b, s in jobs
    ]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [sys.executable, "-m", "obskernels.bench", "--count-worker"],
        input=json.dumps(payload), stdout=subprocess.PIPE, text=True, env=env,
        stderr=subprocess.DEVNULL if progress is None else None,
    )
    if proc.returncode != 0:
        return [{"status": f"error: the count worker exited with {proc.returncode}"} for _ in jobs]
    return json.loads(proc.stdout.strip().splitlines()[-1])

def count_worker(stdin: TextIO, stdout: TextIO) -> None:
    """Entry of the ``--count-worker`` child: JSON jobs in, JSON counts out."""
    jobs = json.loads(stdin.read())
    results = []
    for job in jobs:
        case, target = _decode_job(job)
        results.append(model_counts(case, target, job["backend"], tuple(job["shape"])))
        sys.stderr.write(f"  [{len(results)}/{len(jobs)}] {case.label} {target.label} "
                         f"{job['backend']}: {results[-1]['status'][:70]}\n")
    stdout.write(json.dumps(results) + "\n")

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

_OBSERVER_SEARCH = {  # (search defaults, flavour) of each searching observer
    "memoryless_mse": (MSE_DEFAULTS, "mse"),
    "mse": (MSE_DEFAULTS, "mse"),
    "nvfp4_expanded_mse": ({**MSE_DEFAULTS, **NVFP4_EXPANDED}, "mse"),
    "imatrix_mse": (IMATRIX_DEFAULTS, "imatrix"),
}

def search_steps(target: Target) -> Optional[int]:
    """Grid steps the search may take (the kernels evaluate all of them)."""
    if target.kind == "op":
        if target.name != "mse_search":
            return None
        kw = target.kwargs
        return num_steps(kw["maxshrink"], kw["grid"], kw["flavour"])
    if target.name in _OBSERVER_SEARCH:
        defaults, flavour = _OBSERVER_SEARCH[target.name]
        return num_steps(defaults["maxshrink"], defaults["grid"], flavour)
    return None

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
        elif rec.model.modelled_s is not None:
            what = f"modelled {rec.model.modelled_s * 1e6:9.1f} us on GPU"
        else:
            what = rec.status[:60]
        self.stream.write(
            f"[{self.i:4d}/{self.total}] {time.perf_counter() - self.t0:6.1f}s  "
            f"{rec.case.label:<34} {rec.op:<22} {rec.backend:<12} {what}\n"
        )
        self.stream.flush()

def _measured(prepared, device: str, opts: Options, peak_bytes: Optional[int] = None,
              peak_method: Optional[str] = None) -> Timing:
    """Times ``prepared``; the peak is CUDA's on a GPU, else the one given."""
    median, reps, fastest = time_calls(prepared, device, opts)
    if device == "cuda":
        peak_bytes, peak_method = cuda_peak(prepared), "torch.cuda.max_memory_allocated"
    return Timing(measured_s=median, measured_reps=reps, measured_min_s=fastest,
                  timer="cuda events, median" if device == "cuda" else "perf_counter, median",
                  peak_bytes=peak_bytes, peak_method=peak_method)

def _torch_path(case, target, backend, value, device, opts, rec: Record) -> Tuple[Record, List]:
    """A path whose every launch is an aten op: count exactly, then time.
    Returns the record and the call's per-launch counts (for the projection)."""
    prepared = prepare(case, target, backend, device=device, value=value)
    counts, comp, _ = count_call(prepared, device, triton=False)  # also the warm-up
    d = counts.to_dict()
    d["count_method"] = "exact: aten ops counted at this shape"
    traffic, model = model_call(d, comp, opts.gpu)
    timing = _measured(prepared, device, opts, counts.peak_bytes,
                       "live storage of aten outputs during the call (TorchDispatchMode)")
    return rec.replace(traffic=traffic, model=model, timing=timing, status="measured"), d["per_launch"]

def _triton_path(case, target, backend, value, device, opts, rec: Record, modelled: Dict,
                 sass: Optional[Dict] = None) -> Record:
    if modelled.get("status") == "ok":
        traffic, model = model_call(modelled, modelled.get("compulsory_bytes"), opts.gpu, sass)
        rec = rec.replace(traffic=traffic, model=model, status="modelled")
    else:
        rec = rec.replace(status=modelled.get("status", "not modelled"))
    if device != "cuda":
        if rec.status == "modelled":
            rec = rec.replace(note="not measured: no CUDA device (the interpreter's time means nothing)",
                              timing=_interpreter_peak(case, target, backend, value))
        return rec
    if rec.status.startswith(("unsupported", "n/a")):
        return rec
    prepared = prepare(case, target, backend, device=device, value=value)
    prepared.setup()
    prepared.fn()  # warm-up (compiles)
    return rec.replace(timing=_measured(prepared, device, opts), status="measured")

def interpreter_peak_bytes(prepared) -> int:
    """Peak extra memory of one call of a Triton path run by triton's interpreter."""
    prepared.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with peak_memory("cpu") as counts:
            prepared.fn()
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
    jobs = [(c, t, b, c.shape) for c, t, b in plan if b in triton_backends]
    projections: List[Tuple[Case, Target, str]] = []
    if opts.project_full:
        seen = set()
        for c, t, b in plan:
            if c.scaled and b != "llmc-triton" and (c, t, b) not in seen:
                seen.add((c, t, b))
                projections.append((c, t, b))
        jobs += [(c, t, b, c.full_shape) for c, t, b in projections if b in triton_backends]
    modelled: Dict[Tuple, Dict] = {}
    if jobs:
        if opts.progress:
            opts.progress.write(f"modelling {len(jobs)} Triton calls in triton's interpreter...\n")
        if device == "cuda":
            results = _model_in_subprocess(jobs, opts.progress)
        else:
            results = []
            for i, (c, t, b, s) in enumerate(jobs):
                results.append(model_counts(c, t, b, s))
                if opts.progress:
                    r = results[-1]
                    opts.progress.write(
                        f"  [{i + 1}/{len(jobs)}] {c.label} @ {s[0]}x{s[1]} {t.label} {b}: "
                        f"{r['status'][:70]}"
                        + (f" ({r['count_seconds']} s)" if "count_seconds" in r else "")
                        + "\n"
                    )
        for (c, t, b, s), r in zip(jobs, results):
            modelled[(c, t, b, tuple(s))] = r
    # 1b. the same Triton calls recorded with the GPU's launch configuration and
    # compiled to sm_90a: the compute term of the model
    sass: Dict[Tuple, Dict] = {}
    if jobs and opts.sass:
        if opts.progress:
            opts.progress.write(f"compiling the kernels of {len(jobs)} Triton calls for sm_90a...\n")
        for (c, t, b, s), r in zip(jobs, _sass_in_subprocess(jobs, opts.progress)):
            sass[(c, t, b, tuple(s))] = r

    # 2. measure (and count the PyTorch paths exactly)
    records: List[Record] = []
    torch_launches: Dict[Tuple, List] = {}  # per-launch counts of the PyTorch paths
    progress = _Progress(opts.progress, len(plan))
    value_cache: Dict[Case, torch.Tensor] = {}
    for case, target, backend in plan:
        if case not in value_cache:
            value_cache.clear()
            value_cache[case] = make_value(case, device=device)
        value = value_cache[case]
        rec = _base_record(case, target, backend, case.shape, ctx)
        try:
            if unavailable[backend]:
                rec = rec.replace(status=f"unavailable: {unavailable[backend]}")
            elif backend in ("triton", "llmc-triton"):
                m = modelled.get((case, target, backend, tuple(case.shape)), {})
                rec = _triton_path(case, target, backend, value, device, opts, rec, m,
                                   sass.get((case, target, backend, tuple(case.shape))))
            else:
                rec, torch_launches[(case, target, backend)] = _torch_path(
                    case, target, backend, value, device, opts, rec)
        except NotApplicable as exc:
            rec = rec.replace(status=f"n/a: {exc}")
        except Exception as exc:
            rec = rec.replace(status=f"error: {type(exc).__name__}: {str(exc)[:300]}")
        rec = _per_element(rec, target, case.shape)
        if rec.timing.measured_s and rec.traffic.compulsory_bytes:
            rec = rec.replace(timing=dataclasses.replace(
                rec.timing, throughput_gbs=rec.traffic.compulsory_bytes / rec.timing.measured_s / 1e9))
        rec = rec.replace(provenance=dataclasses.replace(rec.provenance, timestamp=_now()))
        records.append(rec)
        progress(rec)

    # 3. full-size projections of the scaled (quick) cases: modelled only
    by_key = {(r.case.label, r.op, r.backend): r for r in records}
    for case, target, backend in projections:
        src = by_key.get((case.label, target.label, backend))
        full = case.full_shape
        rec = _base_record(case, target, backend, full, ctx).replace(scope="full-size projection")
        rec = rec.replace(provenance=dataclasses.replace(rec.provenance, timestamp=_now()))
        if unavailable[backend]:
            continue
        if backend in triton_backends:
            m = modelled.get((case, target, backend, tuple(full)), {})
            if m.get("status") != "ok":
                rec = rec.replace(status=m.get("status", "not modelled"))
            else:
                traffic, model = model_call(m, m.get("compulsory_bytes"), opts.gpu,
                                            sass.get((case, target, backend, tuple(full))))
                rec = rec.replace(traffic=traffic, model=model, status="modelled")
        elif src and src.traffic.bytes_moved is not None:
            counts = _projected_torch_counts(case, src, torch_launches.get((case, target, backend)) or [],
                                             full[0] * full[1])
            comp = src.traffic.compulsory_bytes
            comp = int(comp * (full[0] * full[1] / case.numel)) if comp else comp
            traffic, model = model_call(counts, comp, opts.gpu)
            rec = rec.replace(traffic=traffic, model=model, status="modelled")
        else:
            continue
        records.append(_per_element(rec, target, full))
    end = machine_info(device)["loadavg"]
    return [r.replace(provenance=dataclasses.replace(
        r.provenance, machine=dict(r.provenance.machine, loadavg_end=end))) for r in records]
