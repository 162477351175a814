"""The host cost of an observer call, measured without a GPU (a proxy).

    python -m obskernels.bench.host            # a table
    python -m obskernels.bench.host --json     # one JSON object per line

On a GPU an observer call is the host's Python around a few kernels: what
the GPU computes takes microseconds, what the host spends choosing,
checking, allocating and launching can take longer. This module measures
that host part on any machine: it runs the triton backend's observer path
on CPU tensors (triton's interpreter switched on) with every kernel launch
replaced by a stub, so only the host's own work is timed. The backend is the
one a user gets without choosing ("auto", which picks triton for the tensor),
so the cost of that choice, made at each operation, is in the figure.

The stub runs no kernel. It zero-fills the integer tensors it is handed (an
observer's non-finite record, the qparams' status) so that host code reading
them back sees a clean record rather than uninitialised memory, without
advancing their version counters (a kernel's writes do not), and the time
it spends doing so is subtracted: launches cost nothing here. A launch made
through a launch site's ``Replay`` (kernels/_replay.py) is stubbed whole:
what the Replay does to launch is launch work, which
``obskernels.bench.launch`` measures with Triton's launch path kept. What
remains is the Python and the aten calls (allocations, views) of the call
itself.

Times are given in microseconds and in units of one one-element ``add_`` on
a CPU tensor timed on the same machine: the unit scales the figure to the
machine's Python and dispatch speed (on an H100 host a one-element CUDA op
costs ~10 us and includes the driver's launch; a CPU op, ~1-3 us here, does
not, which is why the unit is a CPU op: the stubbed path has no launch
either). The count of Python function calls per call is exact and does not
depend on the machine.

Scenarios (``SCENARIOS``): a minmax observer call (new observer, observe a
weight, get_qparams), an activation observer's repeated forward (the same
observer, the same shape each time, as in a calibration loop), a
memoryless_mse call, an activation observer's call (new, observe, get_qparams),
an imatrix observer's forward hook (E[x**2] of a Linear's input, at every
batch), one call of every registered observer, a minmax call at the full
size of a 4096x4096 weight in asymmetric groups of 32 (4,096 programs
compute its qparams; the status the call reads back is the record and one
flag word, as at any size), one at the size of a Llama-3-8B MLP weight
(14336x4096) in asymmetric groups of 128 (W4A16 asymmetric: its qparams in
min_max's epilogue too, one launch), and, where llm-compressor is installed
(``.venv-llmcompressor/bin/python -m obskernels.bench.host``), its
static_minmax activation forward, memoryless_minmax weight call and
static_minmax activation call (new, a first forward whose whole-tensor
reduction is split with no tickets kept yet, get_qparams) through the
drop-in.

These are a hot host's figures: each scenario called over and over. Where
llm-compressor is installed, the min/max and MSE scenarios are also timed in
turns (``turns_us``, ``turns_units``): each call right after
llm-compressor's own observer made the same call on a value of the same
shape (untimed; at most ``PARTNER_NUMEL`` elements of it), as the bench's
lead rows take turns with it, the other library's code and data having
pushed ours out of the host's caches. Its MSE observers take the path a GPU
user gets, their Triton search, its kernel stubbed as ours are (on a CPU
they would run their eager body). None for the drop-in's scenarios, the
forward hook and imatrix_mse (whose importance llm-compressor gathers in
hooks of its own). The same scenarios are timed once more after a sweep of
the host's caches instead (``swept_us``, ``swept_units``:
``sweep_host_caches``, untimed, before each call): where that reads as the
turns do, the other library's call costs ours no more than the host caches
it took.

Each row also counts the garbage collections that ran inside its timed
calls, per 1,000 calls (``gc_per_1000``, ``turns_gc_per_1000``): an
obskernels observer leaves no reference cycles, so alone its calls rarely
reach the collector's threshold, while llm-compressor 0.14's observers are
cycles (each holds a fusion handler that holds it) that only a collection
frees, and in turns some of those collections run inside our calls. A
scenario's time is a median, which such calls do not move while they are
few; the count says how few.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

__all__ = ["Scenario", "SCENARIOS", "stubbed_launches", "zero_integers", "unit_seconds", "quiet_seconds",
           "interleaved", "measure",
           "proxy_command", "emit", "main"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One measured call. ``observer``: a registered name; ``repeat``: the
    observer is built once and only its forward is timed (an activation
    observer in a calibration loop); otherwise new + forward + get_qparams.
    ``drop_in``: llm-compressor's observer of that name, computing through
    obskernels (``integrations.llmcompressor``); measured only where
    llm-compressor imports. ``hook``: the observer's forward hook, called as
    a module's forward calls it (the Linear's own work left out)."""

    name: str
    observer: str
    base_name: str
    args: Dict
    shape: tuple
    repeat: bool = False
    drop_in: bool = False  # llm-compressor's observer with the drop-in enabled
    # the observer's forward pre-hook on a Linear as wide as the value (an
    # imatrix observer's E[x**2] at every batch), the value its input
    hook: bool = False


_INT4_G128 = dict(num_bits=4, strategy="group", group_size=128, symmetric=True)
_INT4_G32_ASYM = dict(num_bits=4, strategy="group", group_size=32, symmetric=False)
_INT4_G128_ASYM = dict(num_bits=4, strategy="group", group_size=128, symmetric=False)
_FP8_TENSOR = dict(num_bits=8, type="float", strategy="tensor", symmetric=True)
_NVFP4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
              scale_dtype="float8_e4m3fn", zp_dtype="float8_e4m3fn")

SCENARIOS = (
    Scenario("minmax call", "memoryless_minmax", "weight", _INT4_G128, (256, 256)),
    Scenario("activation forward", "static_minmax", "input", _FP8_TENSOR, (2, 16, 256), repeat=True),
    Scenario("memoryless_mse call", "memoryless_mse", "weight", _INT4_G128, (256, 256)),
    # large enough that the whole-tensor reduction is split across programs,
    # as a real activation's is (its last program computes the qparams)
    Scenario("activation call", "static_minmax", "input", _FP8_TENSOR, (4, 64, 256)),
    # measured where llm-compressor is installed (its own environment)
    Scenario("drop-in activation forward", "static_minmax", "input", _FP8_TENSOR, (4, 64, 256),
             repeat=True, drop_in=True),
    Scenario("drop-in minmax call", "memoryless_minmax", "weight", _INT4_G128, (256, 256),
             drop_in=True),
    # an activation's observer made anew, its first forward (split, no tickets
    # kept yet: what the drop-in makes for each activation observer of a
    # calibration), then get_qparams
    Scenario("drop-in activation call", "static_minmax", "input", _FP8_TENSOR, (4, 64, 256),
             drop_in=True),
    Scenario("imatrix forward hook", "imatrix_mse", "weight", _INT4_G128, (2, 16, 256), repeat=True,
             hook=True),
    Scenario("static_minmax call", "static_minmax", "weight", _INT4_G128, (256, 256)),
    Scenario("minmax (moving average) call", "minmax", "weight", _INT4_G128, (256, 256)),
    Scenario("mse call", "mse", "weight", _INT4_G128, (256, 256)),
    Scenario("nvfp4 memoryless_minmax call", "memoryless_minmax", "weight", _NVFP4, (256, 256)),
    Scenario("nvfp4_expanded_mse call", "nvfp4_expanded_mse", "weight", _NVFP4, (256, 256)),
    Scenario("imatrix_mse call", "imatrix_mse", "weight", _INT4_G128, (256, 256)),
    Scenario("minmax call 4096x4096 g32", "memoryless_minmax", "weight", _INT4_G32_ASYM, (4096, 4096)),
    Scenario("minmax call 14336x4096 g128 asym", "memoryless_minmax", "weight", _INT4_G128_ASYM,
             (14336, 4096)),
)


class _Stub:
    """Stands in for one kernel: ``kernel[grid](*args)`` runs nothing (see
    the module docstring); ``spent`` accumulates the stub's own time.
    ``_launch`` also stands in for a whole ``kernels._replay.Replay`` call
    (a launch site's launch: its own matching is launch work, which
    ``obskernels.bench.launch`` measures)."""

    spent = 0.0

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        t0 = time.perf_counter()
        zero_integers(args)
        _Stub.spent += time.perf_counter() - t0


def zero_integers(args) -> None:
    """What a stub writes: zeros into the integer tensors it is handed (a
    record, flags, tickets), the tensors' version counters unchanged, as a
    kernel's writes leave them."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and not a.dtype.is_floating_point and a.dtype != torch.bool:
            a.data.zero_()


@contextlib.contextmanager
def stubbed_launches():
    """Every kernel of obskernels.kernels is a ``_Stub``, and every launch
    through a ``Replay`` is ``_Stub._launch``, within the block."""
    from obskernels.kernels._replay import Replay
    from obskernels.tools.kernel_report.launches import discover_kernels

    saved = [(Replay, "__call__", Replay.__call__)]
    Replay.__call__ = staticmethod(_Stub._launch)  # called without the site
    for module, attr in discover_kernels().values():
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, _Stub())
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def unit_seconds(reps: int = 20000, rounds: int = 7) -> float:
    """Seconds of one ``t.add_(1)`` on a one-element CPU tensor (the fastest of
    ``rounds`` rounds of ``reps``)."""
    import torch

    t = torch.zeros(1)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            t.add_(1)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _qargs(spec: Dict):
    import torch
    from compressed_tensors.quantization import QuantizationArgs

    kw = {k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in spec.items()}
    return QuantizationArgs(**kw)


def _call_of(sc: Scenario, device: str = "cpu") -> Callable[[], object]:
    """The measured call, its inputs made beforehand (on ``device``)."""
    import torch

    from obskernels import Observer

    gen = torch.Generator().manual_seed(0)
    value = torch.randn(*sc.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    args = _qargs(sc.args)
    if sc.drop_in:
        from llmcompressor.observers import Observer as registry

        from obskernels.integrations.llmcompressor import enabled

        with enabled():  # the adapter class is chosen when the observer is built
            obs = registry.load_from_registry(sc.observer, base_name=sc.base_name, args=args)
        if sc.repeat:
            return lambda: obs(value)
        adapter = type(obs)  # as llm-compressor builds one per module (enable() done once)

        def drop_in_call():
            new = adapter(base_name=sc.base_name, args=args)
            new(value)
            return new.get_qparams()

        return drop_in_call
    if sc.hook:
        obs = Observer.load_from_registry(sc.observer, base_name=sc.base_name, args=args)
        module = torch.nn.Linear(value.shape[-1], value.shape[-1], bias=False, device=device)
        obs.attach(module)
        (hook,) = module._forward_pre_hooks.values()
        return lambda: hook(module, (value,))
    if sc.repeat:
        obs = Observer.load_from_registry(sc.observer, base_name=sc.base_name, args=args)
        return lambda: obs(value)

    def call():
        obs = Observer.load_from_registry(sc.observer, base_name=sc.base_name, args=args)
        if sc.observer.startswith(("imatrix", "nvfp4_expanded_imatrix")):
            # the importance a calibration pass would have gathered
            obs._imatrix_sum = torch.ones(value.shape[1], device=device)
            obs._imatrix_count = torch.full((), 4, dtype=torch.int64, device=device)
        obs(value)
        return obs.get_qparams()

    return call


def observer_call(registry, name: str, base_name: str, args, value) -> Callable[[], object]:
    """One observer call as the bench times it: ``registry``'s observer
    ``name`` made anew, ``value`` observed, its qparams returned."""

    def call():
        obs = registry.load_from_registry(name, base_name=base_name, args=args)
        obs(value)
        return obs.get_qparams()

    return call


#: the min/max observers whose scenarios are also timed in turns with
#: llm-compressor's own; so are the searches it runs in Triton on a GPU
#: (``backends.llmc_searches_in_triton``)
TURNS_OBSERVERS = ("memoryless_minmax", "static_minmax", "minmax")
#: the most elements the partner's value holds (see ``_partner_of``)
PARTNER_NUMEL = 65536
#: bytes ``sweep_host_caches`` goes over: more than a core's L2 cache on the
#: machines measured, a fraction of their last-level cache (a sweep of it
#: all, 32 MB and more on the development CPU, makes a minmax call 8x slower:
#: far colder than any call in turns)
SWEEP_BYTES = 8 << 20
_SWEPT = bytearray()


def sweep_host_caches() -> None:
    """Reads and writes a byte of every 64-byte line of a ``SWEEP_BYTES``
    buffer: the host caches another call would have taken, without the rest
    of what it does."""
    global _SWEPT
    if len(_SWEPT) != SWEEP_BYTES:
        _SWEPT = bytearray(SWEEP_BYTES)
    _SWEPT[::64] = _SWEPT[::64]


def _partner_of(sc: Scenario) -> Optional[Callable[[], object]]:
    """llm-compressor's own observer making ``sc``'s call (new, observe,
    get_qparams; a forward where ``sc`` repeats one) on a value of the same
    shape (of its last dimension and fewer rows where it is larger than
    ``PARTNER_NUMEL``): the call before each of ours in turns. A search
    takes llm-compressor's path as a GPU user gets it, its Triton search, the
    kernel stubbed as ours are (its eager body would run on a CPU). None
    where llm-compressor does not import, and for the drop-in's scenarios,
    the forward hook and the other observers (``TURNS_OBSERVERS``)."""
    import torch

    from obskernels.bench.backends import llmc_available, llmc_path, llmc_searches_in_triton

    searches = llmc_searches_in_triton(sc.observer)
    if (sc.drop_in or sc.hook or not (searches or sc.observer in TURNS_OBSERVERS)
            or not llmc_available()):
        return None
    from llmcompressor.observers import Observer as registry

    # at most PARTNER_NUMEL elements (rows dropped): on a CPU its eager call
    # computes on the value, and a large one would flush the host's caches
    # with data, which on a GPU stays on the device
    shape = sc.shape if math.prod(sc.shape) <= PARTNER_NUMEL else (
        max(1, PARTNER_NUMEL // sc.shape[-1]), sc.shape[-1])
    value = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    args = _qargs(sc.args)
    if sc.repeat:
        obs = registry.load_from_registry(sc.observer, base_name=sc.base_name, args=args)
        return lambda: obs(value)
    call = observer_call(registry, sc.observer, sc.base_name, args, value)
    if not searches:
        return call
    from obskernels.bench.hostcost import kernel_stubs  # here: hostcost imports this module

    stubs = kernel_stubs("llmc-triton")

    def searched():
        with llmc_path("triton"), stubs():
            return call()

    return searched


def _python_calls(fn: Callable[[], object]) -> int:
    """Python function calls made by one ``fn()`` (the stub's excluded)."""
    count = 0
    stub_codes = (_Stub._launch.__code__, zero_integers.__code__)

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code not in stub_codes:
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


def check_default_is_triton() -> None:
    """The scenarios run on the backend a user gets without choosing one
    ("auto": no ``use_backend`` block, no ``set_backend``, no
    OBSKERNELS_BACKEND), which must be the triton backend here."""
    import torch

    from obskernels.backends import get_backend, resolve_backend

    chosen = get_backend()
    if chosen != "auto" or resolve_backend(torch.zeros(1)) != "triton":
        raise RuntimeError(
            f"the host proxy measures the default backend choice, which must be 'auto' "
            f"resolving to triton for a CPU tensor (TRITON_INTERPRET=1 set before triton is "
            f"imported); found {chosen!r}: unset OBSKERNELS_BACKEND and leave set_backend alone")


def quiet_seconds(rounds: List[List[float]]) -> float:
    """A call's time from ``rounds`` of timed calls: the fastest round's
    median. The median keeps one round's slow calls (a collection, a cache
    miss) out; the fastest round keeps out a round timed while other work
    loaded the machine, as ``unit_seconds``' fastest round does for the
    unit."""
    return min(statistics.median(times) for times in rounds)


def interleaved(calls: List, rounds: int, time_round: Callable,
                progress=None) -> List[List]:
    """``time_round(fn)`` for every call of ``calls`` in each of ``rounds``
    rounds, the rounds going over the calls in turn (so a stretch of other
    work on a shared machine slows one round of every call rather than all
    of one); per call, the list of its rounds' results. ``progress(round,
    results so far)`` after each round, where given."""
    timed: List[List] = [[] for _ in calls]
    for r in range(max(rounds, 1)):
        for fn, done in zip(calls, timed):
            done.append(time_round(fn))
        if progress is not None:
            progress(r, timed)
    return timed


#: garbage collections started while ``counting_collections()`` is active
_STARTED = [0]


def _count_collection(phase: str, info: Dict) -> None:
    if phase == "start":
        _STARTED[0] += 1


@contextlib.contextmanager
def counting_collections():
    """Within the block, every garbage collection started is counted
    (``gc.callbacks``), so that a timed loop reads a counter
    (``gc_collections``) beside the call it times rather than asking the
    collector for its statistics there: a call timed cold must not follow
    other work of ours."""
    gc.callbacks.append(_count_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(_count_collection)


def gc_collections() -> int:
    """Garbage collections started so far within ``counting_collections()``."""
    return _STARTED[0]


def measure(scenarios=SCENARIOS, reps: int = 300, warmup: int = 20, rounds: int = 5) -> List[Dict]:
    """One record per scenario: host microseconds per call (``quiet_seconds``
    of ``rounds`` rounds of ``reps // rounds`` calls, stub time excluded,
    ``interleaved`` over the scenarios), the same in units of
    ``unit_seconds()``, the same again in turns where the scenario has a
    partner (``_partner_of``: each call right after the partner's, untimed;
    None otherwise) and after a sweep of the host's caches for those
    scenarios (``sweep_host_caches``, untimed), Python calls, and the
    garbage collections inside the timed calls per 1,000 calls, alone and
    in turns."""
    import warnings

    from obskernels.bench.backends import llmc_available

    check_default_is_triton()
    unit = unit_seconds()
    rounds = max(rounds, 1)
    per_round = max(reps // rounds, 1)

    collected: Dict[int, int] = {}  # id of a run -> collections inside its timed calls

    def time_round(timed) -> List[float]:
        fn, before = timed
        times = []
        ran = 0
        for _ in range(per_round):
            if before is not None:
                before()
            _Stub.spent = 0.0
            c0 = gc_collections()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0 - _Stub.spent)
            ran += gc_collections() - c0
        collected[id(timed)] = collected.get(id(timed), 0) + ran
        return times

    def per_1000(run) -> float:
        return collected.get(id(run), 0) * 1000 / (rounds * per_round)

    out = []
    with stubbed_launches(), counting_collections(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = [(sc, _call_of(sc)) for sc in scenarios if not (sc.drop_in and not llmc_available())]
        partners = [_partner_of(sc) for sc, _ in calls]
        for (_, fn), partner in zip(calls, partners):
            for _ in range(warmup):
                fn()
                if partner is not None:
                    partner()
        # each scenario alone, then in turns where it has a partner, then
        # after a cache sweep where it has one, in the same rounds
        solo = [(fn, None) for _, fn in calls]
        paired = [(fn, p) for (_, fn), p in zip(calls, partners) if p]
        runs = solo + paired + [(fn, sweep_host_caches) for fn, _ in paired]
        timed = iter(interleaved(runs, rounds, time_round))
        alone = [next(timed) for _ in calls]
        turns_of = iter([next(timed) for _ in paired])
        paired_of, swept_of = iter(paired), timed
        for (sc, fn), partner, done, run in zip(calls, partners, alone, solo):
            seconds = quiet_seconds(done)
            turns = None if partner is None else quiet_seconds(next(turns_of))
            swept = None if partner is None else quiet_seconds(next(swept_of))
            in_turns = None if partner is None else next(paired_of)
            out.append({
                "scenario": sc.name, "observer": sc.observer, "repeat": sc.repeat,
                "host_us": seconds * 1e6, "units": seconds / unit,
                "turns_us": None if turns is None else turns * 1e6,
                "turns_units": None if turns is None else turns / unit,
                "swept_us": None if swept is None else swept * 1e6,
                "swept_units": None if swept is None else swept / unit,
                "python_calls": _python_calls(fn), "unit_us": unit * 1e6,
                "gc_per_1000": per_1000(run),
                "turns_gc_per_1000": None if in_turns is None else per_1000(in_turns),
            })
    return out


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is on in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def rerun(module: str, argv: Optional[List[str]], interpret: bool) -> int:
    """``python -m module argv`` afresh, with triton's interpreter on or off
    (it must be set before triton is imported); its exit status."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])]
    return subprocess.call(cmd, env=env)


def proxy_command(module: str, doc: str, argv: Optional[List[str]], reps: int, interpret: bool,
                  flags: Optional[Dict[str, str]] = None):
    """The front of a proxy's command (``python -m module``): ``--json``,
    ``--reps`` and the command's own ``flags`` (option: help) parsed. Returns (the arguments, None) to measure in this
    process, or (None, exit status) where the command ran afresh with
    triton's interpreter on (``interpret``) or off, as it must be before
    triton is imported."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--reps", type=int, default=reps)
    for flag, text in (flags or {}).items():
        ap.add_argument(flag, action="store_true", help=text)
    ns = ap.parse_args(argv)
    if interpreting() != interpret:
        return None, rerun(module, argv, interpret)
    return ns, None


def emit(rows: List[Dict], as_json: bool, table: Callable[..., None], **extra) -> int:
    """A proxy command's output: one JSON object per row (``extra`` added to
    each), or ``table(rows, **extra)``; its exit status."""
    if as_json:
        for r in rows:
            print(json.dumps(dict(r, **extra)))
    else:
        table(rows, **extra)
    return 0


def _print_table(rows: List[Dict]) -> None:
    unit = rows[0]["unit_us"] if rows else 0.0
    print(f"host cost per call, launches stubbed (a proxy; unit = one 1-element add_ = {unit:.2f} us)")
    turns = any(r.get("turns_us") is not None for r in rows)
    print(f"{'scenario':32} {'observer':22} {'us':>8} {'units':>7} {'py calls':>9} {'gc/1k':>6}"
          + (f" {'in turns us':>12} {'units':>7} {'gc/1k':>6} {'swept us':>9} {'units':>7}"
             if turns else ""))
    for r in rows:
        line = (f"{r['scenario']:32} {r['observer']:22} {r['host_us']:8.1f} {r['units']:7.1f} "
                f"{r['python_calls']:9d} {r['gc_per_1000']:6.0f}")
        if turns:
            t, s = r.get("turns_us"), r.get("swept_us")
            line += (f" {'-':>12} {'-':>7} {'-':>6}" if t is None
                     else f" {t:12.1f} {r['turns_units']:7.1f} {r['turns_gc_per_1000']:6.0f}")
            line += f" {'-':>9} {'-':>7}" if s is None else f" {s:9.1f} {r['swept_units']:7.1f}"
        print(line)
    print("gc/1k: garbage collections that ran inside the timed calls, per 1,000 calls")
    if turns:
        print("in turns: each call right after llm-compressor's own observer made the same call "
              "(untimed; its MSE search on its Triton path, the kernel stubbed), as the bench's "
              "lead rows take turns; swept: each call after a sweep of the host's caches "
              f"({SWEEP_BYTES >> 20} MB, untimed) instead")


def main(argv: Optional[List[str]] = None) -> int:
    ns, status = proxy_command("obskernels.bench.host", __doc__, argv, reps=300, interpret=True)
    if ns is None:
        return status
    return emit(measure(reps=ns.reps), ns.json, _print_table)


if __name__ == "__main__":
    sys.exit(main())
