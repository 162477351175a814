"""`make gpu-check`: what only a machine with CUDA can show, in one command.

1. the `gpu`-marked tests, compiled for this GPU (no interpreter): the parity
   suite on CUDA tensors against the reference computed by torch on the same
   GPU, offsets past 2^31, the device guard across two GPUs when present;
2. the full benchmark (`python -m obskernels.bench --full --model`): every row
   measured (synchronised wall time, peak memory) next to the model's figures;
3. one summary file, gpu-check/summary.md (and summary.json): device, test
   counts and failures, the benchmark's full-size observer table.

Without CUDA it stops at once with exit status 2 and says so.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys


def _run(cmd, env, log_path):
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.write(proc.stdout)
    return proc.returncode, proc.stdout


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
               "devices": devices, "torch": torch.__version__}

    rc_tests, text = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           "-rfE", "tests"], env, os.path.join(out, "tests.log"))
    tail = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b", line)]
    summary["tests"] = {"returncode": rc_tests, "summary": tail[-1] if tail else "",
                        "failures": [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]}

    bench_out = os.path.join(out, "bench")
    rc_bench, text = _run([sys.executable, "-m", "obskernels.bench", "--full", "--model", "--device", "cuda",
                           "--out", bench_out, "--quiet"], env, os.path.join(out, "bench.log"))
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
        f"- devices: {', '.join(devices)}; torch {torch.__version__}",
        f"- started {summary['started']}, finished {summary['finished']}",
        f"- gpu tests (parity on CUDA vs torch on the same GPU): exit {rc_tests}: {summary['tests']['summary']}",
        *[f"  - {line}" for line in summary["tests"]["failures"][:50]],
        f"- full bench: exit {rc_bench}; records and plots in {bench_out}/ (report.md)", "",
        "## Observers at the full size (measured rows in the bench report)", "", "```", lead, "```", "",
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}/summary.md")
    return 0 if rc_tests == 0 and rc_bench == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
