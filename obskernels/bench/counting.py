"""What the harness counts and compiles to model a call (the runner measures).

- ``count_call``: one call under the counters (``traffic``): aten ops exactly,
  Triton kernels lane by lane in triton's interpreter;
- ``model_counts``: a Triton-path call's counts at a shape, directly when it is
  small, else at two reduced shapes with the same group structure and
  extrapolated linearly in the element count;
- the workers: ``count_worker`` (the counts, in a child with the interpreter
  on, used on a CUDA machine) and ``sass_worker`` (the same calls recorded
  with the GPU's launch configuration and compiled for sm_90a by
  ``obskernels.tools.kernel_report``: the model's compute term), each a
  ``python -m obskernels.bench`` child fed JSON jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, NamedTuple, Optional, TextIO, Tuple

from obskernels.bench.backends import NotApplicable, prepare
from obskernels.bench.cases import OBSERVERS, OPS, Case, Target
from obskernels.bench.model import affine_extrapolate
from obskernels.bench.traffic import Counts, count_traffic
from obskernels.spec.search import IMATRIX_DEFAULTS, MSE_DEFAULTS, NVFP4_EXPANDED, num_steps

__all__ = ["count_call", "model_counts", "search_steps", "count_worker", "sass_worker",
           "model_in_subprocess", "start_sass", "sass_results", "SassRun",
           "DIRECT_COUNT_LIMIT"]

# a Triton count runs directly at the record's shape up to this many elements;
# above it, at two reduced shapes (the interpreter is slow)
DIRECT_COUNT_LIMIT = 1 << 12


def count_call(prepared, device: str, triton: bool) -> Tuple[Counts, int, object]:
    """Runs one call under the counters: (counts, compulsory bytes, output)."""
    prepared.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_traffic(device, triton=triton) as counts:
            out = prepared.call()
    return counts, prepared.compulsory(out), out


def _reduced_shapes(case: Case, shape: Tuple[int, int], register_group: int = 0) -> List[Tuple[int, int]]:
    """Two small shapes with the group structure of ``shape``, for the interpreter.

    Whole groups are kept: a channel keeps the full row width, a weight's
    groups keep their size (rows of up to 1024 columns), 128x128 blocks stay
    whole, and an activation's groups, which span every token, keep every
    token (two and four groups' columns). The two shapes differ in one side
    only, so a count that is a constant plus a part proportional to the
    elements is recovered exactly -- when both take the kernels the full shape
    takes: a whole-tensor group (TENSOR) is cut, so both shapes hold more than
    ``register_group`` elements (the MSE search's largest group held in
    registers; a larger one takes the split path, as the full shape's does).
    """
    rows, cols = shape
    strategy = case.spec.strategy
    if strategy == "block":
        return [(128, 128), (256, 128)]
    if strategy in ("group", "tensor_group"):
        if case.kind == "activation":
            g = case.spec.qargs().group_size
            return [(rows, 2 * g), (rows, 4 * g)]
        c = min(cols, 1024)
        return [(2, c), (4, c)]
    if strategy == "tensor":
        r = register_group // cols + 1
        return [(r, cols), (2 * r, cols)]
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
    shapes = [shape] if n <= DIRECT_COUNT_LIMIT else _reduced_shapes(case, shape, _register_group(backend))
    points: Dict[int, Tuple[Counts, int]] = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        steps_note = stack.enter_context(_pinned_search_steps(target)) if backend == "triton" else None
        result = _count_points(case, target, backend, shapes, points)
    if result is not None:
        return result
    return _combine(points, shapes, n, t0, steps_note)


def _register_group(backend: str) -> int:
    """The largest group obskernels' MSE search holds in registers (0 for
    llm-compressor's backends, whose kernels do not depend on it)."""
    if backend != "triton":
        return 0
    return importlib.import_module("obskernels.kernels.launch").current_config("mse_search").max_reg_group


@contextlib.contextmanager
def _pinned_search_steps(target: Target):
    """Pins how many grid steps obskernels' MSE kernel evaluates per iteration.

    Its launcher evaluates 32 steps at a time under the interpreter (1 on a
    GPU), so with 20 steps 12 masked surplus steps would be counted as
    arithmetic. Pinning the largest power of two that leaves (almost) no surplus
    counts the arithmetic a GPU does; results do not change. The configuration
    is passed in through ``launch_config`` (kernels/launch/), not patched
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


#: the longest a SASS worker may take (its calls compiled one after another)
SASS_TIMEOUT_S = 1800


class SassRun(NamedTuple):
    """A ``--sass-worker`` child under way (``start_sass``): its process, the
    file its jobs are read from, how many jobs, and when it started."""

    proc: object
    jobs_file: object
    n_jobs: int
    started: float

    def stop(self) -> None:
        """Kills the child (if still running) and closes its jobs' file."""
        self.proc.kill()
        self.proc.communicate()
        self.jobs_file.close()


def start_sass(jobs: List[Tuple[Case, Target, str, Tuple[int, int]]], progress,
               python: Optional[str] = None) -> SassRun:
    """Starts ``sass_worker`` in a child process WITHOUT the interpreter: each
    Triton call is recorded at its shape with the GPU's launch configuration
    and its kernels compiled to sm_90a (obskernels.tools.kernel_report) by the
    triton of ``python`` (default: this interpreter; e.g. an environment with
    the triton the GPU runs). It runs while this process goes on (the
    interpreter's counts: a second core compiles meanwhile); ``sass_results``
    collects it."""
    payload = [
        {"case": dataclasses.asdict(c), "target": t.label if t.kind == "op" else t.name,
         "target_kind": t.kind, "backend": b, "shape": list(s)}
        for c, t, b, s in jobs
    ]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.pop("TRITON_INTERPRET", None)
    jobs_file = tempfile.TemporaryFile("w+")  # the jobs: no pipe to fill while the child waits
    json.dump(payload, jobs_file)
    jobs_file.seek(0)
    proc = subprocess.Popen(
        [python or sys.executable, "-m", "obskernels.bench", "--sass-worker"],
        stdin=jobs_file, stdout=subprocess.PIPE, text=True, env=env,
        stderr=subprocess.DEVNULL if progress is None else None,
    )
    return SassRun(proc, jobs_file, len(jobs), time.monotonic())


def sass_results(run: SassRun) -> List[Dict]:
    """The per-launch SASS profiles of a ``start_sass`` child, one per job
    (each an error status where the child failed or passed its time)."""
    left = max(SASS_TIMEOUT_S - (time.monotonic() - run.started), 1.0)
    try:
        out, _ = run.proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        run.stop()
        return [{"status": "error: the SASS worker timed out"} for _ in range(run.n_jobs)]
    run.jobs_file.close()
    if run.proc.returncode != 0:
        return [{"status": f"error: the SASS worker exited with {run.proc.returncode}"}
                for _ in range(run.n_jobs)]
    return json.loads(out.strip().splitlines()[-1])


def _decode_job(job: Dict) -> Tuple[Case, Target]:
    """(case, target) of a job the parent process sent as JSON to a worker."""
    c = job["case"]
    case = Case(c["kind"], tuple(c["shape"]), c["dtype"], c["scheme"],
                tuple(c["full_shape"]) if c.get("full_shape") else None)
    target = OPS[job["target"]] if job["target_kind"] == "op" else OBSERVERS[job["target"]]
    return case, target


def sass_worker(stdin: TextIO, stdout: TextIO) -> None:
    """Entry of the ``--sass-worker`` child: JSON jobs in, per-launch SASS profiles out."""
    from obskernels.tools.kernel_report.launches import Launch, cpu_tensors_recorded, recording
    from obskernels.tools.kernel_report.variants import profile_launches

    jobs = json.loads(stdin.read())
    cache: Dict = {}
    results = []
    for job in jobs:
        case, target = _decode_job(job)
        res: Dict = {"status": "ok"}
        try:
            prepared = prepare(case, target, job["backend"], shape=tuple(job["shape"]), device="cpu")
            # nothing runs (every kernel is a recorder): the triton backend takes CPU tensors
            with recording() as sink, cpu_tensors_recorded():
                prepared.setup()  # e.g. the imatrix hook's statistics: not part of the call
                sink.clear()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        prepared.call()
                except Exception as exc:  # outputs are not computed: later host code may object
                    res["note"] = f"call stopped after {len(sink)} launches: {type(exc).__name__}"
                launches = [Launch(case.label, "", n, f, g, a, k) for n, f, g, a, k in sink]
            res["launches"] = profile_launches(launches, cache)
        except Exception as exc:
            res = {"status": f"error: {type(exc).__name__}: {str(exc)[:200]}"}
        results.append(res)
        sys.stderr.write(f"  [sass {len(results)}/{len(jobs)}] {case.label} {target.label}: {res['status'][:60]}\n")
    stdout.write(json.dumps(results) + "\n")


def model_in_subprocess(jobs: List[Tuple[Case, Target, str, Tuple[int, int]]], progress) -> List[Dict]:
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
