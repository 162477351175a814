"""The command line: a table per compiled variant, JSON lines, the probe's
document, or a table per launch of the streaming kernels
(``python -m obskernels.tools.kernel_report``; see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

from obskernels.tools.kernel_report.machine import PIPES, TARGETS
from obskernels.tools.kernel_report.variants import probe


def _table(variants: List[Dict]) -> str:
    head = f"{'kernel':34} {'case':40} {'regs':>4} {'warps':>5} {'spill':>5} {'smem':>6} {'loop':>4} " \
        f"{'lds/sts':>7} {'sass/el':>8} {'/prog':>6} " + \
        " ".join(f"{p:>6}" for p in PIPES) + "  approx / libdevice"
    lines = [head, "-" * len(head)]
    for v in variants:
        if v["error"]:
            lines.append(f"{v['kernel']:34} {v['case'][:40]:40} ERROR {v['error'][:120]}")
            continue
        lines.append(
            f"{v['kernel']:34} {v['case'][:40]:40} {v['registers']:>4} {v['warps_per_sm']:>5} "
            f"{v['spills']:>5} {v['shared']:>6} {v['loop']:>4} {v['loop_shared']:>7} "
            f"{v['sass_per_elem_step']:8.1f} "
            + (f"{v['sass_per_elem_program']:6.1f} " if v.get("sass_per_elem_program") is not None
               else f"{'-':>6} ")
            + " ".join(f"{v['pipes'][p]:6.1f}" for p in PIPES)
            + "  " + " ".join(v["approx"] + v["libdevice"])
        )
    lines.append("sass/el: SASS instructions of the hot loop per element (per element and grid "
                 "step for the search's step loop), sm_90a, triton's bundled ptxas; by pipe after it. "
                 "warps: resident per SM; lds/sts: shared-memory instructions in the hot loop.")
    lines.append("/prog: what one program of the streaming kernels issues per element of the value "
                 "it covers at the case's shape (main loop x trips + the rest, per thread).")
    return "\n".join(lines)


def _launch_table(result: Dict) -> str:
    """Per launch of a streaming kernel: registers, what its program issues
    per element at its case's shape, and the target it is held to."""
    regs = {v["key"]: v.get("registers") for v in result["variants"]}
    head = f"{'kernel':34} {'case':58} {'regs':>4} {'/prog':>6} {'target':>6}"
    lines = [head, "-" * len(head)]
    for row in result["launches"]:
        if row.get("sass_per_elem_program") is None:
            continue
        target = TARGETS.get(row["elem_bytes"]) if row["targets"] else None
        lines.append(f"{row['kernel']:34} {row['case'][:58]:58} {regs.get(row['key']) or 0:>4} "
                     f"{row['sass_per_elem_program']:6.1f} {target if target else '-':>6}")
    return "\n".join(lines)


def _summary() -> str:
    """The first paragraph of the package's docstring."""
    from obskernels.tools import kernel_report

    return kernel_report.__doc__.split("\n\n")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m obskernels.tools.kernel_report", description=_summary())
    ap.add_argument("--json", action="store_true", help="one JSON object per variant per line")
    ap.add_argument("--probe", action="store_true", help="one JSON document: kernels, variants, launches")
    ap.add_argument("--module", default=None, help="only the cases of this kernel module")
    ap.add_argument("--launches", action="store_true",
                    help="per launch: what its program issues per element at its case's shape")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        os.environ.pop("TRITON_INTERPRET")  # too late for this process: rerun without it
        return subprocess.call([sys.executable, "-m", "obskernels.tools.kernel_report", *(argv or sys.argv[1:])])
    result = probe(a.module)
    if a.probe:
        print(json.dumps(result))
    elif a.json:
        for v in result["variants"]:
            print(json.dumps(v))
    elif a.launches:
        print(_launch_table(result))
    else:
        print(_table(result["variants"]))
    return 0
