"""The host term of the model: a call's host path, measured on this machine.

On a GPU an observer call is mostly the host's Python and op dispatch around
a few kernels (a 4096 x 4096 min/max observer call on an H100: ~0.73 ms of
host time for ~12 us of GPU work). ``measure`` runs the record's call on CPU
tensors of a small shape with the same group structure (``host_shape``),
every Triton kernel of the path replaced by a stub that runs nothing
(obskernels' kernels for "triton", llm-compressor's search kernels for
"llmc-triton"; the PyTorch paths have none), and times it as
``obskernels.bench.host`` does: in units of one one-element ``add_`` on a CPU
tensor timed on the same machine (``host.unit_seconds``). The model
(``model.overlap_model``) scales the units by the GPU host's unit (a small
torch CUDA op, ~10 us on the H100 host) and adds each Triton launch's issue
cost (~17 us there).

It also records the host time until the first Triton launch (what the GPU
waits for before it has work), on obskernels' triton backend the host time
after the call's last read of a value (``tolist`` / ``numpy``: an observer's
read of its status, which on a GPU waits for the call's kernels) where no
launch follows it, and the aten ops of the measured call: the
model scales a PyTorch path whose op count grows with the shape (a search
that stops early on small data) by the op count at the modelled shape.

The lead rows time a case's backends in turns, one call each
(``runner.interleaved_samples``), so each of their calls runs after the other
library's, which has pushed its code and data out of the host's caches.
The same shows on a CPU: each path stubbed here took
1.6-1.9x its time alone, right after llm-compressor's call of the same
observer (the development CPU, every lead case), and llm-compressor's call
before ours on an H200's host added 46-92 us to a 4096x4096 min/max call
that took 119-199 us alone. ``measure`` therefore times a path as the lead
rows do where the other library is installed: each call right after one
call of its ``turn_partner`` (stubbed as well, untimed).

A proxy: the CPU ops of the stubbed call run on small tensors (their compute
is part of the time), and a CPU host is not the GPU host; the unit carries
the machine's speed over.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import warnings
from typing import Dict, List, Optional, Tuple

from obskernels.bench.backends import LLMC_BACKENDS, llmc_searches_in_triton, prepare
from obskernels.bench.cases import Case, Target
from obskernels.bench.host import zero_integers
from obskernels.bench.traffic import count_traffic, host_reads_seen

__all__ = ["host_shape", "turn_partner", "kernel_stubs", "stubbed", "measure", "quietest", "METHOD"]

METHOD = ("stubbed host path: the call on CPU tensors of {shape}, Triton launches replaced by "
          "no-ops, {turns}fastest of {reps}, in units of a one-element add_ ({unit_us:.2f} us here)")


def host_shape(case: Case, backend: str) -> Tuple[int, int]:
    """The smallest value with the case's group structure (one 128 x 128 block,
    two rows of 256: whole groups, two channels or tokens), so that the CPU
    ops' own compute stays small beside their dispatch. For a whole tensor
    on obskernels' triton backend, 128 x 512: its reduction is split across
    programs as a real one's (one launch more); its stubbed path computes
    nothing on the value, while the PyTorch paths' CPU ops would."""
    strategy = case.spec.strategy
    if strategy == "block":
        return (128, 128)
    return (128, 512) if strategy == "tensor" and backend == "triton" else (2, 256)


def turn_partner(target: Target, backend: str) -> str:
    """The backend whose call precedes each of ``backend``'s in the lead rows'
    turns: llm-compressor's path as a GPU user gets it for obskernels' (its
    Triton search where it has one, else its eager body; "llmc" itself runs
    its eager search on a CPU), obskernels' triton backend for
    llm-compressor's."""
    if backend in LLMC_BACKENDS:
        return "triton"
    return "llmc-triton" if llmc_searches_in_triton(target) else "llmc-eager"


def _turns(partner) -> str:
    return "" if partner is None else f"each after a call of {partner}'s (untimed), "


class _Stub:
    """One kernel replaced: ``kernel[grid](*args)`` runs nothing. It zero-fills
    the integer tensors it is handed (status records a host may read back) and
    keeps the call's clock: the time it spends itself is left out, and the
    host time at its first launch is noted."""

    def __init__(self, clock):
        self.clock = clock

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        t0 = time.perf_counter()
        self.clock.launch(t0)
        zero_integers(args)
        self.clock.spent += time.perf_counter() - t0


class _Clock:
    """A call's host clock: the stubs' own time left out, the host time at the
    first launch noted, and at the start of the last read that no launch
    follows (``read``; None without one)."""

    def __init__(self):
        self.start = self.spent = 0.0
        self.first = self.read = None

    def begin(self):
        self.spent, self.first, self.read = 0.0, None, None
        self.start = time.perf_counter()

    def launch(self, now):
        if self.first is None:
            self.first = now - self.start - self.spent
        self.read = None  # the GPU has work after that read

    def note_read(self, _name=None, _tensor=None):
        """A read starts now (``traffic.host_reads_seen``'s hook; its own time left out)."""
        now = time.perf_counter()
        self.read = now - self.start - self.spent
        self.spent += time.perf_counter() - now

    def host_seconds(self):
        return time.perf_counter() - self.start - self.spent


def unit_seconds(reps: int = 50, rounds: int = 101) -> float:
    """One ``t.add_(1)`` on a one-element CPU tensor: the fastest of ``rounds``
    short rounds, as short as a measured call (~0.1 ms): on a shared machine
    the fastest round and the fastest call are the ones no other work
    slowed down (a long round nearly always spans a preemption)."""
    import torch

    t = torch.zeros(1)
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            t.add_(1)
        per.append((time.perf_counter() - t0) / reps)
    return min(per)


def _kernels_of(backend: str) -> Dict:
    from obskernels.tools.kernel_report.launches import discover_kernels

    if backend == "triton":
        return discover_kernels()
    if backend == "llmc-triton":
        module = importlib.import_module("llmcompressor.observers.mse_quant")
        return discover_kernels({"mse_quant": module})
    return {}


def kernel_stubs(backend: str, clock: Optional[_Clock] = None):
    """A function returning a context within which ``backend``'s Triton
    kernels are stubs keeping ``clock`` (one of their own where None): the
    kernels are found once, here, not at each entry (an untimed partner's
    call enters it every time, and finding them is no part of that call)."""
    kernels = list(_kernels_of(backend).values())
    stub = _Stub(clock if clock is not None else _Clock())

    @contextlib.contextmanager
    def stubs():
        saved = [(module, attr, getattr(module, attr)) for module, attr in kernels]
        for module, attr, _ in saved:
            setattr(module, attr, stub)
        try:
            yield
        finally:
            for module, attr, fn in saved:
                setattr(module, attr, fn)

    return stubs


@contextlib.contextmanager
def stubbed(backend: str, clock: _Clock):
    """Within the block the backend's Triton kernels are stubs (and obskernels'
    triton backend takes CPU tensors)."""
    with contextlib.ExitStack() as stack:
        if backend == "triton":
            from obskernels.kernels._replay import Replay
            from obskernels.tools.kernel_report.launches import cpu_tensors_recorded

            stack.enter_context(cpu_tensors_recorded())
            saved = Replay.__call__
            # a whole launch site's call (its own matching is launch work):
            # a bound method, called without the site
            Replay.__call__ = _Stub(clock)._launch
            stack.callback(setattr, Replay, "__call__", saved)
        stack.enter_context(kernel_stubs(backend, clock)())
        yield


def _turn(case: Case, target: Target, partner: str):
    """One untimed call of ``target`` by ``partner`` (its launches stubbed
    while ``stubbed(partner, ...)`` is entered), or None where that backend
    has no such call (a target it does not implement) or its call fails."""
    try:
        other = prepare(case, target, partner, shape=host_shape(case, partner), device="cpu")
        with stubbed(partner, _Clock()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other.setup()
            other.call()
    except Exception:
        return None

    def turn():
        other.setup()
        other.call()

    return turn


def measure(case: Case, target: Target, backend: str, min_reps: int = 3, max_reps: int = 200,
            budget_s: float = 0.15, partner: Optional[str] = None) -> Dict:
    """Host cost of one call of ``target`` on ``case`` by ``backend``, launches
    stubbed: ``units`` (fastest host time / ``unit_seconds()``), ``before_units``
    (host time until the first Triton launch; None without one),
    ``after_units`` (obskernels' triton backend: host time after the last
    read that no launch follows; None without one, and on other backends,
    whose aten ops after a read would be GPU work), ``aten_ops`` of the call,
    ``unit_us``, the shape, ``partner`` and the method. With ``partner`` (a
    backend, see ``turn_partner``) each call is made right after one call of
    the same target by that backend, its launches stubbed too, untimed (alone,
    ``partner`` None in the record, where that backend has no such call)."""
    shape = host_shape(case, backend)
    clock = _Clock()
    prepared = prepare(case, target, backend, shape=shape, device="cpu")
    turn = None if partner is None else _turn(case, target, partner)
    if turn is None:
        partner = None

    def once():
        if turn is not None:
            turn()
        prepared.setup()
        clock.begin()
        prepared.call()
        return clock.host_seconds()

    with contextlib.ExitStack() as stack:
        stack.enter_context(stubbed(backend, clock))
        if partner is not None:
            stack.enter_context(stubbed(partner, _Clock()))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        for _ in range(3):  # warm-up: first-call caches
            once()
        prepared.setup()
        with count_traffic("cpu") as counts:
            prepared.call()
        # the unit before and after the calls (not between them: the add_ loop
        # would evict the call's code and data from the caches)
        units, times, firsts, afters = [unit_seconds(rounds=31)], [], [], []
        t_end = time.perf_counter() + budget_s
        with host_reads_seen(clock.note_read) if backend == "triton" else contextlib.nullcontext():
            while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < t_end):
                times.append(once())
                firsts.append(clock.first)
                afters.append(None if clock.read is None else times[-1] - clock.read)
        units.append(unit_seconds(rounds=31))
    # the fastest call and the fastest unit: what no other work on the machine slowed
    unit, fastest = min(units), min(range(len(times)), key=times.__getitem__)
    return {"units": times[fastest] / unit,
            "before_units": None if firsts[fastest] is None else firsts[fastest] / unit,
            "after_units": None if afters[fastest] is None else afters[fastest] / unit,
            "aten_ops": counts.aten_ops, "unit_us": unit * 1e6, "shape": list(shape),
            "reps": len(times), "partner": partner,
            "method": METHOD.format(shape=f"{shape[0]}x{shape[1]}", turns=_turns(partner), reps=f"{len(times)} calls",
                                    unit_us=unit * 1e6)}


def quietest(records: List[Dict]) -> Dict:
    """One path's host cost from several ``measure`` records taken apart (a
    shared machine's load comes and goes): the fastest call among them, in
    microseconds, over the fastest unit among them -- not the fewest units
    of one record, which a unit timed under load would make look fast."""
    best = min(records, key=lambda r: r["units"] * r["unit_us"])
    unit_us = min(r["unit_us"] for r in records)
    scale = best["unit_us"] / unit_us
    out = dict(best, units=best["units"] * scale, unit_us=unit_us, reps=sum(r["reps"] for r in records))
    for key in ("before_units", "after_units"):
        if out[key] is not None:
            out[key] *= scale
    out["method"] = METHOD.format(shape="x".join(map(str, out["shape"])), turns=_turns(out.get("partner")),
                                  reps=f"{out['reps']} calls in {len(records)} rounds", unit_us=unit_us)
    return out
