"""``python -m obskernels.bench``: every backend side by side, measured and modelled.

Examples:
    python -m obskernels.bench                      # --quick on a CPU, --full on a GPU (measured only)
    python -m obskernels.bench --full --model       # on a GPU: measured and modelled side by side
    python -m obskernels.bench --full --ops min_max,mse --observers none
    python -m obskernels.bench --backends reference,triton --out /tmp/b
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional


def _split(value: str) -> List[str]:
    return [v.strip() for v in value.split(",") if v.strip() and v.strip() != "none"]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from obskernels.bench.backends import BACKENDS
    from obskernels.bench.cases import OBSERVERS, OP_ALIASES

    p = argparse.ArgumentParser(prog="python -m obskernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="shapes divided by 32 per side, bf16 only (the default without CUDA; "
                           "5-8 minutes on a shared 2-core CPU)")
    size.add_argument("--full", action="store_true",
                      help="the real shapes (the default with CUDA)")
    size.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ops", default="all",
                   help=f"comma list of {sorted(OP_ALIASES)}, 'all' or 'none'")
    p.add_argument("--observers", default="all",
                   help=f"comma list of {sorted(OBSERVERS)}, 'all' or 'none'")
    p.add_argument("--backends", default="auto",
                   help=f"comma list of {BACKENDS}, 'all', or 'auto' (default: on CUDA triton, llmc "
                        "-- llm-compressor as installed -- llmc-eager and reference; on a CPU reference, "
                        "triton, llmc-eager, llmc-triton: llmc is llmc-eager there)")
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--reps", type=int, default=None, help="most timed calls per row")
    p.add_argument("--rounds", type=int, default=None,
                   help="passes over the run, each timing every row for its share of the calls "
                        "(default: 3 on CUDA, 1 elsewhere)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on a CPU: 1 -- on a shared machine, "
                        "multi-threaded aten ops stall at every parallel region)")
    p.add_argument("--no-projection", action="store_true",
                   help="quick mode: skip the modelled full-size projection")
    p.add_argument("--gpu-bandwidth", type=float, default=3.35, help="model: TB/s (default 3.35, H100 SXM)")
    p.add_argument("--gpu-tflops", type=float, default=67.0, help="model: fp32 TFLOP/s (default 67)")
    p.add_argument("--host-unit-us", type=float, default=10.0,
                   help="model: the GPU host's unit, a small torch CUDA op, in us (default 10: H100 host)")
    p.add_argument("--triton-launch-us", type=float, default=17.0,
                   help="model: us to issue a Triton launch (default 17: H100 host)")
    p.add_argument("--aten-op-us", type=float, default=10.0,
                   help="model: us per aten op where the host path was not measured (default 10)")
    p.add_argument("--model", action="store_true",
                   help="on CUDA: also model every row (interpreter counts, sm_90a compile, host path; "
                        "adds minutes). Always on without CUDA")
    p.add_argument("--no-host", action="store_true",
                   help="model: skip measuring the host paths (each aten op / launch at its issue cost)")
    p.add_argument("--host-alone", action="store_true",
                   help="model: time each host path's calls back to back, not each after the other "
                        "library's call (the lead rows' turns): to compare with rows timed alone")
    p.add_argument("--sass-python", default=None,
                   help="model: compile the kernels with this interpreter's triton (e.g. "
                        ".venv-triton36/bin/python for the triton an H100 run used)")
    p.add_argument("--gpu-name", default="H100 SXM", help="model: name printed with the parameters")
    p.add_argument("--split", action="store_true",
                   help="also profile each measured row (torch profiler, 5 more calls, once every "
                        "row is timed): the device work of one call beside its wall time (on CUDA its "
                        "kernels and copies; on a CPU its aten ops)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--cases", default=None,
                   help="comma list of substrings of the full-size case labels to keep, "
                        "e.g. 'w4096x4096' (default: the whole sweep)")
    p.add_argument("--count-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sass-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-sass", action="store_true",
                   help="model Triton compute from interpreter lanes only (skip the sm_90a compile)")
    args = p.parse_args(argv)

    def choose(value: str, every: List[str], aliases=None) -> List[str]:
        if value == "all":
            return list(every)
        out: List[str] = []
        for v in _split(value):
            names = (aliases or {}).get(v, [v])
            for n in names:
                if n not in every:
                    p.error(f"unknown name {v!r}; expected one of {sorted(aliases or every)}")
                if n not in out:
                    out.append(n)
        return out

    from obskernels.bench.cases import OPS

    args.ops = choose(args.ops, list(OPS), OP_ALIASES)
    args.observers = choose(args.observers, list(OBSERVERS))
    if args.backends != "auto":  # resolved by the device in main()
        args.backends = choose(args.backends, list(BACKENDS))
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be at least 1 (got {args.rounds})")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--count-worker" in argv:
        from obskernels.bench.counting import count_worker

        count_worker(sys.stdin, sys.stdout)
        return 0
    if "--sass-worker" in argv:
        from obskernels.bench.counting import sass_worker

        sass_worker(sys.stdin, sys.stdout)
        return 0
    import torch

    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # The Triton rows are modelled in triton's interpreter, which must be on
        # before triton is first imported -- and `import obskernels` (run before
        # this module by `python -m`) may already have imported it. Start again
        # with the interpreter on.
        env = dict(os.environ, TRITON_INTERPRET="1")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "obskernels.bench", *argv], env)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    elif device == "cpu":
        torch.set_num_threads(1)
    mode = "full" if args.full else "tiny" if args.tiny else "quick" if (args.quick or device == "cpu") else "full"

    from obskernels.bench import report
    from obskernels.bench.model import GpuModel
    from obskernels.bench.cases import QUICK_DIVISOR
    from obskernels.bench.runner import Options, run

    gpu = GpuModel(args.gpu_name, args.gpu_bandwidth * 1e12, args.gpu_tflops * 1e12,
                   host_unit_s=args.host_unit_us * 1e-6, triton_launch_s=args.triton_launch_us * 1e-6,
                   aten_op_s=args.aten_op_us * 1e-6)
    if args.backends == "auto":
        args.backends = (["triton", "llmc", "llmc-eager", "reference"] if device == "cuda"
                         else ["reference", "triton", "llmc-eager", "llmc-triton"])
    opts = Options(
        mode=mode,
        ops=tuple(args.ops),
        observers=tuple(args.observers),
        backends=tuple(args.backends),
        out=args.out,
        gpu=gpu,
        device=device,
        project_full=not args.no_projection,
        model=device != "cuda" or args.model,
        sass=not args.no_sass,
        sass_python=args.sass_python,
        host=not args.no_host,
        host_turns=not args.host_alone,
        split=args.split,
        progress=None if args.quiet else sys.stderr,
    )
    if args.cases:
        from obskernels.bench.cases import sweep

        keep = _split(args.cases)
        opts.cases = [c for c in sweep(mode)
                      if any(k in c.with_shape(c.full_shape or c.shape).label for k in keep)]
    if mode == "full":
        opts.min_reps, opts.max_reps, opts.min_time_s, opts.max_time_s = 5, 30, 0.1, 3.0
    if args.reps:
        opts.max_reps = args.reps
        opts.min_reps = min(opts.min_reps, args.reps)
    opts.rounds = args.rounds if args.rounds is not None else (3 if device == "cuda" else 1)
    t0 = time.perf_counter()
    print(f"obskernels bench: mode {mode}"
          + (f" (shapes scaled down by {QUICK_DIVISOR} per side, bf16 only; --full for the real sizes and fp32)" if mode == "quick" else "")
          + f", device {device}, backends {', '.join(opts.backends)}", file=sys.stderr)
    records = run(opts)
    paths = report.write_all(records, args.out)
    lead = report.lead_table(records)
    if lead:
        print()
        print("Observers at the full size vs llm-compressor's default path (see the legend: measured "
              "where a GPU ran them, modelled otherwise):")
        print(lead)
    print()
    for line in report.legend(records):
        print(line)
    print()
    if any(r.case.scaled for r in records if r.scope == "run"):
        print(report.SCALED_NOTE)
    print(report.console_table(records, "run"))
    proj = report.console_table(records, "full-size projection")
    if proj:
        print()
        print("Modelled at the full sizes (projection of the scaled cases; nothing measured):")
        print(proj)
    print()
    print(f"{len(records)} records in {time.perf_counter() - t0:.0f} s; wrote "
          + ", ".join(sorted(paths.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
