"""Instructions per observer call on the host, counted: a PROXY that does not move.

    python -m obskernels.bench.instructions                        # a table
    python -m obskernels.bench.instructions --json                 # one JSON object per line
    python -m obskernels.bench.instructions --scenario "minmax call" --calls 200

``obskernels.bench.host`` times the observer path with its launches stubbed;
on a shared machine its figures move by several per cent from run to run,
as much as a small change saves. This counts instead of timing: the same
calls (``host.SCENARIOS``, launches stubbed, triton's interpreter on, CPU
tensors) in one process under valgrind's callgrind, which counts every
instruction the host executes -- the Python interpreter's, torch's
dispatch and allocations, the stub's -- exactly. The process is made
repeatable (``PYTHONHASHSEED=0``, one OpenMP / BLAS thread); callgrind dumps
its counts whenever ``os.getppid`` is called (``--dump-before``), which the
child process calls right before and right after each scenario's counted
calls, so the count between the two is those calls' alone (the warm-up
calls, which plan and compile, come before). The unit is one one-element CPU
``add_`` (the host proxy's unit), counted the same way.

Instructions are not time: Python's interpreter and torch's C++ do not run
at the same instructions per cycle, so the units here and the host proxy's
timed units differ (a minmax call: ~12 here, ~9 timed). On one machine and
one set of versions, fewer instructions for the same call is less host
work, and a change of one per cent shows.

Needs valgrind (``valgrind`` on PATH): without it the command says so and
exits with status 2. Under callgrind Python runs ~50x slower; importing
torch takes most of the ~2 minutes of a run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

__all__ = ["count", "parse_dumps", "per_call", "main", "UNIT", "MARK"]

#: the row of the unit: one one-element CPU add_
UNIT = "unit: one-element CPU add_"
#: the C function callgrind dumps its counts before (``--dump-before``):
#: CPython's ``os.getppid``, which nothing in an observer call calls
MARK = "os_getppid"
#: calls before the counted ones (the first plans, compiles and allocates)
WARMUP = 20


def _child(names: Sequence[str], calls: int) -> None:
    """In the counted process: for the unit and each scenario, its warm-up,
    a mark, ``calls`` calls, a mark."""
    import torch

    from obskernels.bench import host

    one = torch.zeros(1)
    items = [(UNIT, lambda: one.add_(1))]
    by_name = {sc.name: sc for sc in host.SCENARIOS}
    items += [(name, host._call_of(by_name[name])) for name in names]
    with host.stubbed_launches():
        for _, fn in items:
            for _ in range(WARMUP):
                fn()
            os.getppid()
            for _ in range(calls):
                fn()
            os.getppid()


def parse_dumps(texts: Sequence[str]) -> List[int]:
    """The instruction totals of callgrind's numbered dumps, in order (each
    dump's ``totals:`` line; its ``summary:`` line where it has none)."""
    out = []
    for text in texts:
        total = None
        for line in text.splitlines():
            if line.startswith("totals:") or (total is None and line.startswith("summary:")):
                total = int(line.split()[1])
        if total is None:
            raise ValueError("a callgrind dump without a totals or summary line")
        out.append(total)
    return out


def per_call(totals: Sequence[int], names: Sequence[str], calls: int) -> Dict[str, float]:
    """Instructions per call of each name (the unit's first) from the dumps'
    totals: the first dump ends at the first mark (start-up and the first
    warm-up), then each name's counted calls, then the next one's warm-up."""
    if len(totals) < 2 * len(names):
        raise ValueError(f"{len(totals)} dumps for {len(names)} counted runs: a mark is missing")
    return {name: totals[2 * i + 1] / calls for i, name in enumerate(names)}


def count(names: Optional[Sequence[str]] = None, calls: int = 100,
          valgrind: Optional[str] = None) -> List[Dict]:
    """One row per scenario named (every host scenario this environment
    runs, by default): instructions per call and in units, counted in one
    process under callgrind (see the module docstring)."""
    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available

    valgrind = valgrind or shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (no `valgrind` on PATH)")
    if names is None:
        names = [sc.name for sc in host.SCENARIOS if not sc.drop_in or llmc_available()]
    known = {sc.name for sc in host.SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; the scenarios: {sorted(known)}")
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [valgrind, "--tool=callgrind", f"--dump-before={MARK}", f"--callgrind-out-file={out}",
               sys.executable, "-m", "obskernels.bench.instructions", "--child",
               "--calls", str(calls), *[arg for n in names for arg in ("--scenario", n)]]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the counted process failed (status {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        dumps = sorted((f for f in os.listdir(tmp) if f.startswith("callgrind.out.")),
                       key=lambda f: int(f.rsplit(".", 1)[1]))
        texts = []
        for f in dumps:
            with open(os.path.join(tmp, f)) as fh:
                texts.append(fh.read())
    counted = per_call(parse_dumps(texts), [UNIT, *names], calls)
    unit = counted[UNIT]
    return [{"scenario": name, "instructions": counted[name], "units": counted[name] / unit,
             "unit_instructions": unit, "calls": calls, "kind": "proxy (callgrind)"}
            for name in [UNIT, *names]]


def _print_table(rows: List[Dict]) -> None:
    unit = rows[0]["unit_instructions"] if rows else 0.0
    print(f"host instructions per call, launches stubbed (a proxy: callgrind; unit = one 1-element "
          f"add_ = {unit:,.0f} instructions; {rows[0]['calls'] if rows else 0} calls counted each)")
    print(f"{'scenario':34} {'instructions':>13} {'units':>7}")
    for r in rows:
        print(f"{r['scenario']:34} {r['instructions']:13,.0f} {r['units']:7.2f}")


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m obskernels.bench.instructions",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--calls", type=int, default=100, help="calls counted per scenario")
    ap.add_argument("--scenario", action="append", help="a host scenario (repeatable; default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(ns.scenario or [], ns.calls)
        return 0
    if shutil.which("valgrind") is None:
        print("obskernels.bench.instructions: valgrind is not installed (no `valgrind` on PATH); "
              "it counts under valgrind's callgrind. The timed proxy: python -m obskernels.bench.host",
              file=sys.stderr)
        return 2
    rows = count(ns.scenario, ns.calls)
    if ns.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
