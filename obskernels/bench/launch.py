"""Triton's launch path on the host, without a GPU: a PROXY.

    python -m obskernels.bench.launch            # a table
    python -m obskernels.bench.launch --json     # one JSON object per line

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
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import zlib
from typing import Dict, List, Optional

from obskernels.bench.host import zero_integers

__all__ = ["RecordingDriver", "recording_driver", "triton_runs", "compiled_on_cpu", "measure", "main"]


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
        self.driver.sink.append((self.name, (gx, gy, gz), stream, function, args))
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
    grid, stream, function handle, the launcher's arguments) instead of
    running (``spent``: the seconds that took). ``device``: what
    ``get_current_device()`` answers."""

    def __init__(self):
        self.sink: list = []
        self.spent = 0.0
        self.device = 0
        self.utils = _Utils()

    def launcher_cls(self, src, metadata):
        return _Launcher(self, getattr(getattr(src, "fn", None), "__name__", str(src)))

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 0

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


def main(argv: Optional[List[str]] = None) -> int:
    from obskernels.bench.host import proxy_command

    # the kernels must compile: no interpreter
    ns, status = proxy_command("obskernels.bench.launch", __doc__, argv, reps=200, interpret=False)
    if ns is None:
        return status
    import triton

    rows = measure(reps=ns.reps)
    if ns.json:
        for r in rows:
            print(json.dumps(dict(r, triton=triton.__version__)))
        return 0
    unit = rows[0]["unit_us"] if rows else 0.0
    print(f"host cost per call with Triton's launch path up to its C launcher (a proxy; triton "
          f"{triton.__version__}; unit = one 1-element add_ = {unit:.2f} us)")
    print(f"{'scenario':32} {'launches':>8} {'replayed us':>12} {'units':>6} "
          f"{'Triton us':>10} {'units':>6} {'saved us':>9}")
    for r in rows:
        print(f"{r['scenario']:32} {r['launches']:8d} {r['replay_us']:12.1f} {r['replay_units']:6.1f} "
              f"{r['triton_us']:10.1f} {r['triton_units']:6.1f} {r['triton_us'] - r['replay_us']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
