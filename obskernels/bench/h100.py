"""The model against the H100 measurements, side by side.

    python -m obskernels.bench.h100 bench-out/results.jsonl            # the latest run's figures
    python -m obskernels.bench.h100 --run first bench-out/results.jsonl

Two runs on one H100 80GB HBM3 (SXM), torch 2.11.0+cu130, triton 3.6.0,
llm-compressor 0.14.0.1 in the same process; wall time of one observer call (a
new observer, ``observer(value)``, ``get_qparams()``, synchronised), in ms;
weights 4096x4096 bf16, activations 2048x4096 bf16. ``MEASURED`` (first): the
first run, of the code before the thin host path, median after warm-up.
``MEASURED_LATEST``: the run of 2026-11-26, the harness's own lead rows
(``--full --device cuda --ops none --observers all --backends triton,llmc``:
the L2 wiped before each call, median of up to 5). "llmc" is
llm-compressor's default path there (its own Triton MSE search for
the MSE observers). The table puts each beside the model's full-size figure
from a bench run (``modelled_s`` of the triton row, and of llm-compressor's
default path as the model prices it: its Triton search where the row has one,
else its eager body), with the ratio model / measured. Both runs timed each
row alone (before the lead rows took turns with llm-compressor's): model
them with ``--host-alone``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["MEASURED", "MEASURED_LATEST", "RUNS", "rows", "markdown", "main"]

# (full-size case label, observer, (obskernels ms, llm-compressor default path ms) at the
# first run, the same at the run of 2026-11-26: this code's host path and kernels)
_FIGURES: Tuple[Tuple[str, str, Tuple[float, float], Tuple[float, float]], ...] = (
    ("w4096x4096 bf16 int4-group128", "memoryless_minmax", (0.734, 0.591), (0.333, 0.791)),
    ("w4096x4096 bf16 int4-group128", "static_minmax", (0.516, 0.739), (0.334, 0.659)),
    ("w4096x4096 bf16 int4-group128", "memoryless_mse", (1.762, 2.524), (0.934, 2.767)),
    ("w4096x4096 bf16 int4-group32-asym", "memoryless_minmax", (0.654, 0.539), (0.333, 0.645)),
    ("w4096x4096 bf16 int4-group32-asym", "memoryless_mse", (1.533, 2.698), (1.043, 3.059)),
    ("w4096x4096 bf16 int8-channel", "memoryless_minmax", (0.609, 0.444), (0.369, 0.691)),
    ("w4096x4096 bf16 int8-channel", "memoryless_mse", (1.367, 3.270), (0.802, 2.832)),
    ("w4096x4096 bf16 fp8-block128", "memoryless_minmax", (0.775, 0.495), (0.168, 0.474)),
    ("w4096x4096 bf16 fp8-block128", "memoryless_mse", (1.552, 2.679), (0.785, 2.845)),
    ("w4096x4096 bf16 nvfp4-tg16", "memoryless_minmax", (0.829, 0.858), (0.263, 1.193)),
    ("w4096x4096 bf16 nvfp4-tg16", "memoryless_mse", (1.642, 2.768), (1.170, 3.119)),
    ("w4096x4096 bf16 nvfp4-tg16", "nvfp4_expanded_mse", (6.499, 10.54), (4.681, 13.211)),
    ("a2048x4096 bf16 fp8-tensor-act", "static_minmax", (0.653, 0.445), (0.149, 0.400)),
    ("a2048x4096 bf16 fp8-tensor-act", "minmax", (0.660, 0.425), (0.156, 0.466)),
)

# each run's rows: (full-size case label, observer, obskernels ms, llm-compressor default path ms)
MEASURED = tuple((case, obs, *first) for case, obs, first, _ in _FIGURES)
MEASURED_LATEST = tuple((case, obs, *latest) for case, obs, _, latest in _FIGURES)
RUNS = {"first": MEASURED, "latest": MEASURED_LATEST}


def rows(records: List[Dict], measured=MEASURED) -> List[Dict]:
    """One row per figure of ``measured``: the model's ms for triton and for
    llm-compressor's default path (None where the run has no such record)."""
    full = {(r["case"], r["op"], r["backend"]): r for r in records
            if r["scope"] == "full-size projection" or (r["scope"] == "run" and not r["scaled"])}

    def modelled(case: str, obs: str, backend: str) -> Optional[Dict]:
        r = full.get((case, "obs:" + obs, backend))
        return r if r and r.get("modelled_s") else None

    out = []
    for case, obs, ours, theirs in measured:
        t = modelled(case, obs, "triton")
        llmc = modelled(case, obs, "llmc-triton") or modelled(case, obs, "llmc-eager")
        out.append(dict(
            case=case, observer=obs, measured_ms=ours, llmc_measured_ms=theirs,
            model_ms=t and t["modelled_s"] * 1e3, host_ms=t and t.get("model_host_s") and t["model_host_s"] * 1e3,
            bound=t and t.get("bound"), llmc_model_ms=llmc and llmc["modelled_s"] * 1e3,
            llmc_path=llmc and {"llmc-triton": "its Triton search", "llmc-eager": "eager"}[llmc["backend"]],
        ))
    return out


def markdown(table: List[Dict]) -> str:
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    lines = ["| case | observer | H100 ms | model ms | model / H100 | model host ms | bound "
             "| H100 llmc ms | model llmc ms | model / H100 | llmc priced as |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        ratio = r["model_ms"] and r["model_ms"] / r["measured_ms"]
        lratio = r["llmc_model_ms"] and r["llmc_model_ms"] / r["llmc_measured_ms"]
        lines.append(f"| {r['case'].replace(' bf16', '')} | {r['observer']} | {f(r['measured_ms'])} | "
                     f"{f(r['model_ms'])} | {f(ratio, '{:.2f}')} | {f(r['host_ms'])} | {r['bound'] or '-'} | "
                     f"{f(r['llmc_measured_ms'])} | {f(r['llmc_model_ms'])} | {f(lratio, '{:.2f}')} | "
                     f"{r['llmc_path'] or '-'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m obskernels.bench.h100", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a bench results.jsonl")
    ap.add_argument("--run", choices=sorted(RUNS), default="latest", help="which H100 run's figures")
    a = ap.parse_args(argv)
    with open(a.results) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(markdown(rows(records, RUNS[a.run])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
