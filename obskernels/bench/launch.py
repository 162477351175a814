"""Triton's launch path on the host, without a GPU: a PROXY.

    python -m obskernels.bench.launch              # a table
    python -m obskernels.bench.launch --json       # one JSON object per line
    python -m obskernels.bench.launch --first-use  # a first call in a fresh process

``obskernels.bench.host`` replaces every launch by a stub. This one keeps
the launch: the kernels compiled for sm_90 (Triton's own compiler and the
ptxas of its wheel), Triton's launch run for real up to its C launcher,
which a recording driver (``recording_driver()``) stands in for: it records
the launcher's arguments and runs nothing. So a call's time includes what
Triton does on the host per launch -- binding and specialising every
argument, the compiled-kernel lookup, the check of the kernel's globals,
the launch hooks -- but not the C launcher and the driver's launch.

Every scenario of ``obskernels.bench.host.SCENARIOS`` (the triton backend
on CPU tensors, which the recording driver lets it take) is timed twice in
one process, alternating: with the launches replayed past Triton's front
end where a launch site repeats its call (``kernels/_replay.py``, the
default) and through Triton's path at every launch (replays off). Times in
microseconds and in units of a one-element CPU ``add_`` (the host proxy's
unit); ``triton_runs``: launches per call that went through Triton's path.
Triton must compile here (no ``TRITON_INTERPRET`` when it was imported):
under the interpreter the command runs itself afresh without it.

``--first-use``: what a process's first call costs, kernels already in
Triton's disk cache (a user's second session): for a weight's minmax call,
an activation's call and a memoryless_mse call, each in fresh processes
(the median of 3, after one that fills the cache and writes any bytecode
missing, as an installed package has it), split into the kernels'
import, Triton's once-per-process start-up (the key of its own
installation that its first compile makes, taken ahead of the call to time
it apart: kept from an earlier process, or hashed where
``OBSKERNELS_TRITON_KEY_CACHE=0``), the first call and a second one; "first use" is the first three
less the second call. With CUDA the calls run there (MEASURED); without,
the kernels compile for sm_90 and the recording driver takes the launches
(a proxy, without the GPU's module loads and C launchers). Each row also
counts what its timed processes compiled, kernels and (triton 3.6)
their C launchers (``compiled_kernels``: the entries Triton's disk cache
gained while each ran), which is nothing where the first process filled the
cache as it should.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import zlib
from typing import Dict, List, Optional

from obskernels.bench.host import zero_integers

__all__ = ["RecordingDriver", "recording_driver", "triton_runs", "compiled_on_cpu", "measure",
           "fresh_process_env", "run_fresh_process", "compiled_kernels", "compiled_since",
           "kernel_variants", "main"]


class _Launcher:
    """Stands in for Triton's C launcher of one compiled kernel: records the
    launch and zero-fills the integer tensors it is handed (a record, flags,
    tickets: as ``obskernels.bench.host``'s stub, so that a call reads no
    garbage; their version counters unchanged, as a kernel's writes leave
    them); its own time is added to the driver's ``spent``."""

    def __init__(self, driver, name):
        self.driver, self.name = driver, name

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata,
                 enter_hook, exit_hook, *args):
        t0 = time.perf_counter()
        self.driver.sink.append((self.name, (gx, gy, gz), stream, function, args,
                                 (packed_metadata, launch_metadata, enter_hook, exit_hook)))
        zero_integers(args)
        self.driver.spent += time.perf_counter() - t0


class _Utils:
    """The driver utilities a compiled kernel's first launch asks for."""

    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills, max threads): the function
        # handle tells compiled variants apart
        return 1, zlib.crc32(kernel), 0, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                "mem_bus_width": 5120}


class RecordingDriver:
    """A Triton driver for an sm_90 target with no GPU behind it: kernels
    compile, and each launch is recorded into ``sink`` as (kernel name,
    grid, stream, function handle, the kernel's arguments, (packed
    metadata, launch metadata, enter hook, exit hook)) instead of running
    (``spent``: the seconds that took). ``device`` and ``stream``: what
    ``get_current_device()`` and ``get_current_stream()`` answer."""

    def __init__(self):
        self.sink: list = []
        self.spent = 0.0
        self.device = 0
        self.stream = 0
        self.utils = _Utils()

    def launcher_cls(self, src, metadata):
        return _Launcher(self, getattr(getattr(src, "fn", None), "__name__", str(src)))

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def recording_driver():
    """Within the block Triton's active driver is a ``RecordingDriver``
    (yielded). Triton must not be interpreting (kernels are JITFunctions)."""
    from triton.runtime import driver

    saved = driver._active  # None until a driver was made: restored as it was
    recorder = RecordingDriver()
    driver.set_active(recorder)
    try:
        yield recorder
    finally:
        driver._active = saved


@contextlib.contextmanager
def triton_runs():
    """Counts the launches that go through Triton's own launch path within
    the block (``JITFunction.run``): yields a one-element list."""
    from triton.runtime.jit import JITFunction

    count = [0]
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        count[0] += 1
        return run(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        yield count
    finally:
        JITFunction.run = run


@contextlib.contextmanager
def compiled_on_cpu():
    """The block's triton-backend calls take CPU tensors, compile their
    kernels for sm_90 and record their launches (the GPU's launch
    configuration): yields the ``RecordingDriver``."""
    from obskernels.kernels.launch import CUDA_LAUNCH, launch_config
    from obskernels.tools.kernel_report.launches import cpu_tensors_recorded

    with recording_driver() as recorder, cpu_tensors_recorded(), \
            launch_config(**CUDA_LAUNCH, gpu_arith=True):
        yield recorder


def _best_seconds(fn, recorder, reps: int, rounds: int = 7) -> float:
    """The fastest round's seconds per call, the recording launcher's own excluded."""
    best = float("inf")
    for _ in range(rounds):
        recorder.spent = 0.0
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0 - recorder.spent) / reps)
        recorder.sink.clear()
    return best


def measure(scenarios=None, reps: int = 200) -> List[Dict]:
    """One record per scenario: host microseconds per call with replays and
    through Triton's path (the fastest of 7 rounds of ``reps`` calls, the
    two alternated twice), in units, launches and Triton runs per call."""
    import warnings

    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available
    from obskernels.kernels import _replay

    unit = host.unit_seconds()
    out = []
    with compiled_on_cpu() as recorder, triton_runs() as runs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sc in scenarios or host.SCENARIOS:
            if sc.drop_in and not llmc_available():
                continue
            fn = host._call_of(sc)
            best, per_call = {}, {}
            try:
                for replay in (False, True, False, True):
                    _replay.ENABLED = replay
                    for _ in range(10):
                        fn()
                    best[replay] = min(best.get(replay, float("inf")),
                                       _best_seconds(fn, recorder, reps))
                    recorder.sink.clear()
                    runs[0] = 0
                    fn()
                    per_call[replay] = (len(recorder.sink), runs[0])
            finally:
                _replay.ENABLED = True
            out.append({
                "scenario": sc.name, "observer": sc.observer,
                "replay_us": best[True] * 1e6, "triton_us": best[False] * 1e6,
                "replay_units": best[True] / unit, "triton_units": best[False] / unit,
                "launches": per_call[True][0], "triton_runs": per_call[True][1],
                "unit_us": unit * 1e6,
            })
    return out


# the first-use scenarios: a weight's call, an activation's, the search's
FIRST_USE = ("minmax call", "activation call", "memoryless_mse call")


def first_use_child(scenario: str, device: str = "cpu") -> Dict:
    """In a fresh process (run by ``first_use``): the first call of
    ``scenario``, in seconds by part -- the kernels' import (a first call's
    backend choice imports them), Triton's once-per-process start-up (the
    key of its installation, ``triton.runtime.cache.triton_key``, which
    Triton's first compile makes, a kernel found in its disk cache
    included; made here ahead of the call to time it apart: Triton's hash
    of its installation, or the key kept from an earlier process,
    obskernels.kernels._triton_key) and the call itself -- then a second
    call. On "cpu" the kernels compile for sm_90
    and their launches are recorded (``compiled_on_cpu``); on "cuda" they
    run (each call synchronised; CUDA initialised before, as a user's
    model did)."""
    import warnings

    import torch
    import triton  # noqa: F401 - a user's process has it before its first call
    import triton.runtime.cache as triton_cache

    from obskernels.bench import host

    sc = next(s for s in host.SCENARIOS if s.name == scenario)
    cuda = device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = host._call_of(sc, device=device)  # the inputs; the kernels are not imported yet

        def call():
            fn()
            if cuda:
                torch.cuda.synchronize()

        imported_before = "obskernels.kernels" in sys.modules
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if cuda:
                import obskernels.kernels  # noqa: F401
            else:
                stack.enter_context(compiled_on_cpu())  # imports the kernels
            triton_key = triton_cache.triton_key  # as the kernels' import left it
            own = getattr(triton_key, "obskernels_own", triton_key)  # Triton's hash
            t1 = time.perf_counter()
            triton_key()
            t2 = time.perf_counter()
            hashed = own.cache_info().misses
            with triton_runs() as first_runs:
                call()
            t3 = time.perf_counter()
            with triton_runs() as second_runs:
                call()
            t4 = time.perf_counter()
    return {"scenario": scenario, "device": device, "import_s": t1 - t0, "triton_startup_s": t2 - t1,
            "first_call_s": t3 - t2, "second_call_s": t4 - t3, "first_use_s": (t3 - t0) - (t4 - t3),
            # what makes the parts what they say: the kernels not imported before,
            # Triton's key made once, in the start-up part, the second call launching past Triton
            "kernels_imported_before": imported_before, "startup_keys": triton_key.cache_info().misses,
            "hashes_in_calls": own.cache_info().misses - hashed,
            "triton_key_kept": triton_key is not own and hashed == 0,
            "triton_runs": [first_runs[0], second_runs[0]]}


def fresh_process_env(**extra) -> Dict[str, str]:
    """The environment of a timed fresh process, as a user's: this one's,
    but writing bytecode, which a user's installed packages have (pip writes
    it at install): PYTHONDONTWRITEBYTECODE dropped, so the first such
    process writes what is missing for the next."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(extra)
    return env


def run_fresh_process(cmd: List[str], env: Dict[str, str]):
    """``cmd`` in a new interpreter, its output captured (a
    ``subprocess.CompletedProcess``). A SIGTERM to this process while it
    waits (``timeout``'s, a batch system's) ends the child too: Python's
    default is to die at once and leave the child running, timing itself
    against whatever runs next on the machine (and slowing it)."""
    import signal
    import subprocess
    import threading

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # subprocess.run kills its child on the way out

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if handled else None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def compiled_kernels() -> Optional[Dict[str, str]]:
    """What Triton compiled into its disk cache, {entry: name}: each compile
    is an entry (a folder named by its key), a kernel's holding its
    ``__grp__<kernel>.json`` (named by the kernel), a C module's its
    ``<module>.<suffix>.so`` (triton 3.6 builds a launcher,
    ``__triton_launcher``, for every kernel variant it loads, with the C
    compiler, and caches it the same way; named by the module). A process
    that finds an entry compiles nothing for it. {} where the cache has no
    folder yet; None where Triton does not import or keeps its cache
    elsewhere (a cache manager of another kind)."""
    try:
        import triton.knobs as knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        return None
    if knobs.cache.manager_class not in (None, FileCacheManager):  # None: Triton's default, that one
        return None
    found = {}
    try:
        entries = list(os.scandir(knobs.cache.dir))
    except OSError:  # no cache yet
        return found
    for entry in entries:
        try:
            names = os.listdir(entry.path) if entry.is_dir() else ()
        except OSError:  # gone, or not ours to read
            continue
        name = _compiled_name(names)
        if name is not None:
            found[entry.name] = name
    return found


def _compiled_name(files) -> Optional[str]:
    """The name of what a cache entry of ``files`` holds: a kernel (its
    file list's name, ``__grp__<kernel>.json``), else a C module
    (``<module>...so``); None for anything else."""
    modules = []
    for name in files:
        if name.startswith("__grp__") and name.endswith(".json"):
            return name[len("__grp__"):-len(".json")]
        if name.endswith(".so"):
            modules.append(name.split(".", 1)[0])
    return min(modules) if modules else None


def compiled_since(before: Optional[Dict[str, str]]) -> Optional[List[str]]:
    """The names of what was compiled into Triton's disk cache since
    ``before`` (a ``compiled_kernels()``: kernels and launchers), sorted, by
    every process using that cache; None where either listing is None."""
    now = compiled_kernels()
    if before is None or now is None:
        return None
    return sorted(name for entry, name in now.items() if entry not in before)


@contextlib.contextmanager
def kernel_variants():
    """Within the block, every kernel variant this process sets up, as
    Triton's ``jit_cache_hook`` sees it (once per variant and process, before
    Triton looks for it in its disk cache): yields {digest: [kernel,
    specialisation]}, the specialisation Triton's own JSON of the variant
    (signature, constexprs, argument attributes such as 16-byte alignment,
    compile options), the digest the first 16 hex digits of its SHA-256. Two
    processes that set up a variant of the same digest asked for the same
    compile. A hook set before is called as well, and its answer returned;
    yields None where Triton does not import."""
    try:
        import triton.knobs as knobs
    except ImportError:
        yield None
        return
    import hashlib

    seen: Dict[str, List[str]] = {}
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        data = kwargs["compile"]["specialization_data"]
        seen[hashlib.sha256(data.encode()).hexdigest()[:16]] = [kwargs["fn"].name, data]
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous


def first_use(scenarios=FIRST_USE, runs: int = 3, device: str = "cpu", progress=None) -> List[Dict]:
    """Per scenario: the median of ``runs`` fresh processes'
    ``first_use_child`` (after one untimed process, which fills Triton's
    disk cache where it was cold); each process's parts also written to
    ``progress`` (a stream) as it ends, so a run cut short keeps them."""
    import statistics

    env = fresh_process_env()

    def child(scenario):
        cmd = [sys.executable, "-m", "obskernels.bench.launch", "--first-use-child", scenario, device]
        before = compiled_kernels()
        proc = run_fresh_process(cmd, env)
        if proc.returncode != 0:
            raise RuntimeError(f"the first-use child failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["compiled"] = compiled_since(before)
        if progress:
            progress.write(f"  {scenario}: " + ", ".join(
                f"{k[:-2]} {1e3 * v:.1f} ms" for k, v in row.items() if k.endswith("_s"))
                + ("" if row["compiled"] is None else f", {len(row['compiled'])} compiled") + "\n")
            progress.flush()
        return row

    out = []
    for scenario in scenarios:
        filling = child(scenario)
        rows = [child(scenario) for _ in range(runs)]
        kept = {r["triton_key_kept"] for r in rows}
        compiled = [r["compiled"] for r in rows]
        out.append(dict({k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")},
                        scenario=scenario, device=device, runs=runs, triton_runs=rows[-1]["triton_runs"],
                        triton_key={frozenset({True}): "kept", frozenset({False}): "hashed"}.get(
                            frozenset(kept), "mixed"),
                        # what the timed processes compiled: nothing where the cache held it all
                        compiled=None if None in compiled else sorted(sum(compiled, [])),
                        filled=filling["compiled"]))
    return out


def _print_measured(rows, triton) -> None:
    unit = rows[0]["unit_us"] if rows else 0.0
    print(f"host cost per call with Triton's launch path up to its C launcher (a proxy; triton "
          f"{triton}; unit = one 1-element add_ = {unit:.2f} us)")
    print(f"{'scenario':32} {'launches':>8} {'replayed us':>12} {'units':>6} "
          f"{'Triton us':>10} {'units':>6} {'saved us':>9}")
    for r in rows:
        print(f"{r['scenario']:32} {r['launches']:8d} {r['replay_us']:12.1f} {r['replay_units']:6.1f} "
              f"{r['triton_us']:10.1f} {r['triton_units']:6.1f} {r['triton_us'] - r['replay_us']:9.1f}")


def _print_first_use(rows, triton) -> None:
    where = ("on CUDA (MEASURED)" if rows[0]["device"] == "cuda"
             else "Triton's launch path up to its C launcher (a proxy)")
    print(f"first call in a fresh process, {where}, kernels from Triton's disk cache "
          f"(triton {triton}; median of {rows[0]['runs']} processes; ms)")
    print(f"{'scenario':22} {'kernels import':>14} {'Triton start-up':>15} {'key':>6} {'first call':>10} "
          f"{'second call':>11} {'first use':>9} {'compiled':>8}")
    for r in rows:
        compiled = "-" if r.get("compiled") is None else str(len(r["compiled"]))
        print(f"{r['scenario']:22} {1e3 * r['import_s']:14.1f} {1e3 * r['triton_startup_s']:15.1f} "
              f"{r['triton_key']:>6} {1e3 * r['first_call_s']:10.1f} {1e3 * r['second_call_s']:11.2f} "
              f"{1e3 * r['first_use_s']:9.1f} {compiled:>8}")
    print("key: Triton's key of its installation kept from an earlier process (obskernels.kernels._triton_key) "
          "or hashed afresh (OBSKERNELS_TRITON_KEY_CACHE=0, or the installation changed)")
    print("compiled: kernels and launchers the timed processes compiled into Triton's disk cache (0: all found "
          "there; -: the cache could not be listed)")


def main(argv: Optional[List[str]] = None) -> int:
    from obskernels.bench.host import emit, proxy_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--first-use-child"]:  # one fresh process of --first-use
        print(json.dumps(first_use_child(*argv[1:3])))
        return 0
    # the kernels must compile: no interpreter
    ns, status = proxy_command("obskernels.bench.launch", __doc__, argv, reps=200, interpret=False,
                               flags={"--first-use": "the first call in a fresh process instead"})
    if ns is None:
        return status
    import triton

    if ns.first_use:
        import torch

        rows = first_use(device="cuda" if torch.cuda.is_available() else "cpu",
                         progress=None if ns.json else sys.stderr)
        return emit(rows, ns.json, _print_first_use, triton=triton.__version__)
    return emit(measure(reps=ns.reps), ns.json, _print_measured, triton=triton.__version__)


if __name__ == "__main__":
    sys.exit(main())
