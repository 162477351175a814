"""`make gpu-check`: what only a machine with CUDA can show, in one command.

1. the parity suite on CUDA, compiled for this GPU (no interpreter): every
   test that takes the `device` fixture (marked `on_device` by
   tests/conftest.py: the kernel and observer parity tests, the same cases
   the CPU run checks, with the reference computed by torch on the same GPU)
   and the `gpu`-marked tests (full-size shapes, offsets past 2^31, the device
   guard across two GPUs when present);
2. the full benchmark (`python -m obskernels.bench --full --model`): every row
   measured (synchronised wall time, peak memory) next to the model's figures;
3. one summary file, gpu-check/summary.md (and summary.json): device, test
   cases run / passed / failed / skipped per test file, the failures, the
   benchmark's full-size observer table.

Without CUDA it stops at once with exit status 2 and says so.
`GPU_CHECK_TESTS_ONLY=1` skips the benchmark.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter

#: the tests run on the GPU: those that take the `device` fixture, and the gpu-marked ones
TEST_SELECTION = "on_device or gpu"
OUTCOMES = ("passed", "failed", "error", "skipped")


def _run(cmd, env, log_path):
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.write(proc.stdout)
    return proc.returncode, proc.stdout


def _versions() -> dict:
    """The stack the run measured: torch (and its CUDA), triton, compressed-tensors,
    llm-compressor where installed."""
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "compressed-tensors", "llmcompressor"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def case_counts(junit_xml: str) -> dict:
    """{test file: Counter of OUTCOMES} from pytest's JUnit XML report."""
    per_file: dict = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # classname is the file's dotted path from the root (plus a class, if
        # any): tests.test_x[.Class], tests.kernels.min_max.test_y[.Class]
        parts = case.get("classname", "").split(".")
        end = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        module = "/".join(parts[1:end + 1] if parts[0] == "tests" else parts[end:end + 1]) or "?"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                break
        per_file.setdefault(f"tests/{module}.py", Counter())[outcome] += 1
    return per_file


def counts_table(per_file: dict) -> list:
    """Markdown rows: per file, cases, ran (not skipped), and each outcome."""
    rows = ["| file | cases | ran | passed | failed | errors | skipped |", "|---|---:|---:|---:|---:|---:|---:|"]
    total = Counter()
    for name in sorted(per_file):
        c = per_file[name]
        total.update(c)
        rows.append(_count_row(name, c))
    rows.append(_count_row("**all**", total))
    return rows


def _count_row(name, c) -> str:
    cases = sum(c[o] for o in OUTCOMES)
    return (f"| {name} | {cases} | {cases - c['skipped']} | {c['passed']} | {c['failed']} | "
            f"{c['error']} | {c['skipped']} |")


def main(argv=None) -> int:
    import torch

    out = os.environ.get("GPU_CHECK_OUT", "gpu-check")
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is available (torch.cuda.is_available() is False); "
              "this target needs a machine with an NVIDIA GPU. Nothing was run.", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.pop("TRITON_INTERPRET", None)  # the kernels must compile for this GPU
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    summary = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "devices": devices, "versions": _versions()}

    junit = os.path.join(out, "tests.xml")
    rc_tests, text = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", TEST_SELECTION,
                           "-rfEs", f"--junitxml={junit}", "tests"], env, os.path.join(out, "tests.log"))
    tail = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b", line)]
    per_file = case_counts(junit) if os.path.exists(junit) else {}
    summary["tests"] = {"returncode": rc_tests, "selection": TEST_SELECTION, "summary": tail[-1] if tail else "",
                        "per_file": {k: dict(v) for k, v in per_file.items()},
                        "failures": [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]}

    bench_out = os.path.join(out, "bench")
    rc_bench, bench_line = 0, "full bench: skipped (GPU_CHECK_TESTS_ONLY=1)"
    if os.environ.get("GPU_CHECK_TESTS_ONLY") != "1":
        rc_bench, text = _run([sys.executable, "-m", "obskernels.bench", "--full", "--model", "--device", "cuda",
                               "--out", bench_out, "--quiet"], env, os.path.join(out, "bench.log"))
        bench_line = f"full bench: exit {rc_bench}; records and plots in {bench_out}/ (report.md)"
    summary["bench"] = {"returncode": rc_bench, "out": bench_out}
    lead = ""
    jsonl = os.path.join(bench_out, "results.jsonl")
    if os.path.exists(jsonl):
        from obskernels.bench import report

        records = report.read_jsonl(jsonl)
        lead = report.lead_table(records)
        summary["bench"]["observers_full_size"] = report.lead_speedups(records)
        summary["bench"]["measured_triton_rows"] = sum(
            1 for r in records if r.backend == "triton" and r.timing.measured_s)

    summary["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    lines = [
        "# gpu-check summary", "",
        f"- devices: {', '.join(devices)}; "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        f"- started {summary['started']}, finished {summary['finished']}",
        f"- tests on CUDA (`-m \"{TEST_SELECTION}\"`: the parity suite against torch on the same GPU, "
        f"and the gpu-marked tests): exit {rc_tests}: {summary['tests']['summary']}",
        *[f"  - {line}" for line in summary["tests"]["failures"][:50]],
        "", "### Test cases per file", "", *counts_table(per_file), "",
        f"- {bench_line}", "",
        "## Observers at the full size (measured rows in the bench report)", "", "```", lead, "```", "",
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}/summary.md")
    return 0 if rc_tests == 0 and rc_bench == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
