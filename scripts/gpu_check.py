"""`make gpu-check`: what only a machine with CUDA can show, in one command.

1. the parity suite on CUDA, compiled for this GPU (no interpreter): every
   test that takes the `device` fixture (marked `on_device` by
   tests/conftest.py: the kernel and observer parity tests, the same cases
   the CPU run checks, with the reference computed by torch on the same GPU)
   and the `gpu`-marked tests (full-size shapes, offsets past 2^31, the device
   guard across two GPUs when present);
2. the host path on the GPU (`python -m obskernels.bench.cuda_host`): wall
   time per observer call (the lead rows' memoryless_minmax weight calls
   among them, also after an L2 wipe, with the host's time until the first
   launch is issued) and per activation forward (eager, replayed from a
   CUDA graph, llm-compressor's own and through the drop-in where it
   imports), the GPU host's unit and a bare Triton launch; and a first call
   in a fresh process by part (`python -m obskernels.bench.launch --first-use`);
3. where llm-compressor imports, its own `oneshot` plain and with the drop-in
   (`python -m obskernels.bench.oneshot --profile-fresh`, 6 Llama-3-8B-shaped
   layers; the first call in a fresh process the median of two per mode,
   the modes alternated, and one more process's call profiled, by part;
   about 4 minutes on an H100);
4. the benchmark's lead rows (`python -m obskernels.bench --full --ops none
   --observers all --backends triton,llmc --cases` the 4096x4096 weights and
   2048x4096 activations in bf16 --split): one observer call of every
   observer, measured against llm-compressor's default path, and the device
   work of each call beside it (the torch profiler: its kernels and copies);
   in three passes over the cases (the bench's default on CUDA), the
   profiles taken after the last row is timed: 3-4 minutes on an H100
   (198 s with one pass, compiles included);
5. (asked for only: step "model") the full benchmark with the model beside
   every measured row (`--full --model`: every shape and dtype, tens of minutes);
6. one summary file, gpu-check/summary.md (and summary.json): device, test
   cases run / passed / failed / skipped per test file, the failures, the
   host path's table, oneshot's table, the benchmark's full-size observer table.

Without CUDA it stops at once with exit status 2 and says so.
`GPU_CHECK_STEPS`: a comma list of the steps to run, in this order, from
tests, host, oneshot, bench, model (default: all but model);
`GPU_CHECK_TESTS_ONLY=1` is `GPU_CHECK_STEPS=tests`.

Sized for a lent GPU's short session: the tests run on pytest-xdist's
workers where it is installed (2,410 cases in about 2 minutes on an H100
with 12), every step has a time limit (`GPU_CHECK_TIMEOUTS`, e.g.
`tests=300,oneshot=200`, seconds; defaults in TIMEOUTS), and every step
writes its log as it goes: a step stopped at its limit is interrupted
(SIGINT: pytest still prints its summary) and keeps what it printed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter

#: the tests run on the GPU: those that take the `device` fixture, and the gpu-marked ones
TEST_SELECTION = "on_device or gpu"
STEPS = ("tests", "host", "oneshot", "bench", "model")
#: the steps run when none are named ("model" takes tens of minutes)
DEFAULT_STEPS = ("tests", "host", "oneshot", "bench")
#: each step's time limit in seconds (GPU_CHECK_TIMEOUTS overrides); "first_use"
#: is the host step's second command
TIMEOUTS = {"tests": 600, "host": 300, "first_use": 240, "oneshot": 600, "bench": 600, "model": 3600}
#: the bench step's cases: the sizes the lead table compares
LEAD_CASES = "w4096x4096 bf16,a2048x4096 bf16"


def steps_of(environ) -> list:
    """The steps to run, in STEPS' order: GPU_CHECK_STEPS (a comma list),
    GPU_CHECK_TESTS_ONLY=1 (tests), else all; an unknown step is an error."""
    if environ.get("GPU_CHECK_TESTS_ONLY") == "1":
        return ["tests"]
    raw = environ.get("GPU_CHECK_STEPS", "")
    asked = [s.strip() for s in raw.split(",") if s.strip()] if raw else list(DEFAULT_STEPS)
    unknown = [s for s in asked if s not in STEPS]
    if unknown:
        raise ValueError(f"GPU_CHECK_STEPS: unknown step(s) {unknown}; the steps are {list(STEPS)}")
    return [s for s in STEPS if s in asked]


def timeouts_of(environ) -> dict:
    """TIMEOUTS with GPU_CHECK_TIMEOUTS's ``step=seconds`` pairs applied; an
    unknown step or a malformed pair is an error naming it."""
    out = dict(TIMEOUTS)
    for pair in (p.strip() for p in environ.get("GPU_CHECK_TIMEOUTS", "").split(",")):
        if not pair:
            continue
        step, _, seconds = pair.partition("=")
        if step.strip() not in out:
            raise ValueError(f"GPU_CHECK_TIMEOUTS: unknown step {step.strip()!r}; the steps are {list(out)}")
        try:
            out[step.strip()] = float(seconds)
        except ValueError:
            raise ValueError(f"GPU_CHECK_TIMEOUTS: {pair!r} is not step=seconds") from None
    return out


def pytest_workers(have_xdist: bool, cpus: int) -> list:
    """pytest-xdist's arguments for the tests step: up to 12 workers where it
    is installed and the machine has the cores, else none (one process)."""
    n = min(12, cpus - 1)
    return ["-n", str(n)] if have_xdist and n >= 2 else []


OUTCOMES = ("passed", "failed", "error", "skipped")


def _run(cmd, env, log_path, timeout=None):
    """Run ``cmd`` with its output written to ``log_path`` as it comes; past
    ``timeout`` seconds it is interrupted (SIGINT, then killed 30 s later) and
    the exit status is 124. Returns (status, the log's text)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.write(f"\ngpu-check: stopped after its {timeout:.0f} s limit (GPU_CHECK_TIMEOUTS)\n")
            rc = 124
    with open(log_path) as log:
        return rc, log.read()


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

    steps = steps_of(os.environ)
    limits = timeouts_of(os.environ)
    summary["steps"] = steps
    summary["timeouts_s"] = limits
    lines_tests, lines_host, lines_oneshot, lines_bench = [], [], [], []
    rc_all = 0

    if "tests" in steps:
        junit = os.path.join(out, "tests.xml")
        workers = pytest_workers(importlib.util.find_spec("xdist") is not None, os.cpu_count() or 1)
        rc, text = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", TEST_SELECTION,
                         *workers, "-rfEs", f"--junitxml={junit}", "tests"], env, os.path.join(out, "tests.log"),
                        limits["tests"])
        rc_all |= rc
        tail = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b", line)]
        per_file = case_counts(junit) if os.path.exists(junit) else {}
        summary["tests"] = {"returncode": rc, "selection": TEST_SELECTION, "summary": tail[-1] if tail else "",
                            "per_file": {k: dict(v) for k, v in per_file.items()},
                            "failures": [line for line in text.splitlines()
                                         if line.startswith(("FAILED", "ERROR"))]}
        lines_tests = [
            f"- tests on CUDA (`-m \"{TEST_SELECTION}\"`: the parity suite against torch on the same GPU, "
            f"and the gpu-marked tests): exit {rc}: {summary['tests']['summary']}",
            *[f"  - {line}" for line in summary["tests"]["failures"][:50]],
            "", "### Test cases per file", "", *counts_table(per_file), "",
        ]

    if "host" in steps:
        rc, text = _run([sys.executable, "-m", "obskernels.bench.cuda_host"], env,
                        os.path.join(out, "cuda_host.log"), limits["host"])
        rc_all |= rc
        summary["host"] = {"returncode": rc}
        lines_host = ["## The host path on the GPU (obskernels.bench.cuda_host, MEASURED)", "",
                      f"exit {rc}", "", "```", text.strip()[-6000:], "```", ""]
        rc, text = _run([sys.executable, "-m", "obskernels.bench.launch", "--first-use"], env,
                        os.path.join(out, "first_use.log"), limits["first_use"])
        rc_all |= rc
        summary["host"]["first_use_returncode"] = rc
        lines_host += ["## A first call in a fresh process (obskernels.bench.launch --first-use, MEASURED)", "",
                       f"exit {rc}", "", "```", text.strip()[-3000:], "```", ""]

    if "oneshot" in steps:
        from obskernels.bench.backends import llmc_available

        if not llmc_available():
            summary["oneshot"] = {"returncode": None, "why": "llm-compressor is not installed"}
            lines_oneshot = ["## oneshot: skipped (llm-compressor is not installed)", ""]
        else:
            oneshot_out = os.path.join(out, "oneshot")
            rc, text = _run([sys.executable, "-m", "obskernels.bench.oneshot", "--profile-fresh",
                             "--out", oneshot_out],
                            dict(env, HF_HUB_OFFLINE="1"), os.path.join(out, "oneshot.log"), limits["oneshot"])
            rc_all |= rc
            summary["oneshot"] = {"returncode": rc, "out": oneshot_out}
            table_lines = [line for line in text.splitlines() if not line.startswith("  ")]
            lines_oneshot = ["## oneshot, plain vs the drop-in (obskernels.bench.oneshot, MEASURED)", "",
                             f"exit {rc}", "", "```", "\n".join(table_lines[-12:]), "```", "",
                             "A fresh process's call by part (one more process per row, profiled):", ""]
            from obskernels.bench.oneshot import profile_parts

            profiles = os.path.join(oneshot_out, "profiles")
            for name in sorted(os.listdir(profiles)) if os.path.isdir(profiles) else ():
                if name.endswith(".txt"):
                    lines_oneshot += [f"- {name[:-4]}:", "```", *profile_parts(os.path.join(profiles, name)), "```"]
            lines_oneshot.append("")

    for step in ("bench", "model"):
        if step not in steps:
            continue
        from obskernels.bench.backends import llmc_available

        bench_out = os.path.join(out, step)
        if step == "bench":  # the lead rows: every observer at the lead sizes, against llm-compressor
            flags = ["--ops", "none", "--observers", "all", "--cases", LEAD_CASES, "--split",
                     "--backends", "triton,llmc" if llmc_available() else "triton"]
        else:
            flags = ["--model"]
        rc, text = _run([sys.executable, "-m", "obskernels.bench", "--full", "--device", "cuda", *flags,
                         "--out", bench_out], env, os.path.join(out, f"{step}.log"), limits[step])
        rc_all |= rc
        summary[step] = {"returncode": rc, "out": bench_out}
        lead = ""
        jsonl = os.path.join(bench_out, "results.jsonl")
        if os.path.exists(jsonl):
            from obskernels.bench import report

            records = report.read_jsonl(jsonl)
            lead = report.lead_table(records)
            summary[step]["observers_full_size"] = report.lead_speedups(records)
            summary[step]["measured_triton_rows"] = sum(
                1 for r in records if r.backend == "triton" and r.timing.measured_s)
        else:  # stopped at its limit: the rows it measured are in its log
            lead = "\n".join(line for line in text.splitlines() if " measured " in line)
        what = "lead rows" if step == "bench" else "full bench with the model"
        lines_bench += [f"- {what}: exit {rc}; records and plots in {bench_out}/ (report.md)", "",
                        f"## Observers at the full size ({what}, MEASURED rows)", "",
                        "```", lead, "```", ""]

    summary["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    lines = [
        "# gpu-check summary", "",
        f"- devices: {', '.join(devices)}; "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        f"- started {summary['started']}, finished {summary['finished']}; steps {', '.join(steps)}",
        *lines_tests, *lines_host, *lines_oneshot, *lines_bench,
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}/summary.md")
    return 0 if rc_all == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
