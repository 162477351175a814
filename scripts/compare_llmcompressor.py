"""Compare obskernels' observers with llm-compressor's own, on the CPU.

Run it with a Python that has llm-compressor 0.14 installed next to obskernels
(llm-compressor pins compressed-tensors 0.19, so use a separate environment):

    python3 -m venv /tmp/lcvenv
    /tmp/lcvenv/bin/pip install torch==2.13.0          # a CPU build where the index has one
    /tmp/lcvenv/bin/pip install llmcompressor==0.14.0.1
    /tmp/lcvenv/bin/pip install --no-deps -e .
    PYTHONSAFEPATH=1 /tmp/lcvenv/bin/python scripts/compare_llmcompressor.py

On CPU tensors llm-compressor runs its eager PyTorch path. For every
registered observer, strategy and dtype, both observers see the same values
(one weight, or three activations) and the script prints the largest
absolute difference of scale, zero point and global scale, and how many
entries differ. Exit status 1 if any differ (``--tolerance`` allows slack).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass, field

import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels.observers import OBSERVER_NAMES

NAMES = OBSERVER_NAMES


@dataclass(frozen=True)
class Case:
    label: str
    base_name: str
    args: dict
    shape: tuple
    observers: tuple = NAMES
    kwargs: dict = field(default_factory=dict)


INT8 = dict(num_bits=8, type="int")
INT4 = dict(num_bits=4, type="int")
NVFP4 = dict(
    num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
    scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn,
)
FP8 = dict(num_bits=8, type="float", symmetric=True)

CASES = [
    Case("w int8 sym tensor", "weight", dict(INT8, symmetric=True, strategy="tensor"), (48, 64)),
    Case("w int8 asym channel", "weight", dict(INT8, symmetric=False, strategy="channel"), (48, 64)),
    Case("w int4 sym channel", "weight", dict(INT4, symmetric=True, strategy="channel"), (48, 64)),
    Case("w int4 asym group32", "weight", dict(INT4, symmetric=False, strategy="group", group_size=32), (48, 64)),
    Case("w int4 sym group16", "weight", dict(INT4, symmetric=True, strategy="group", group_size=16), (33, 64)),
    Case("w int8 sym block[16,32] padded", "weight", dict(INT8, symmetric=True, strategy="block", block_structure=[16, 32]), (40, 72)),
    Case("w fp8 channel", "weight", dict(FP8, strategy="channel"), (48, 64)),
    Case("w nvfp4 tensor_group", "weight", NVFP4, (48, 64)),
    Case("in int8 asym tensor", "input", dict(INT8, symmetric=False, strategy="tensor"), (2, 5, 64)),
    Case("in int8 sym group16", "input", dict(INT8, symmetric=True, strategy="group", group_size=16), (2, 5, 64)),
    Case("in fp8 tensor", "input", dict(FP8, strategy="tensor"), (2, 5, 64)),
    Case("in nvfp4 tensor_group", "input", NVFP4, (2, 5, 64)),
    Case("q int8 sym attn_head", "q", dict(INT8, symmetric=True, strategy="attn_head"), (2, 4, 5, 16)),
    Case("k fp8 tensor", "k", dict(FP8, strategy="tensor"), (2, 4, 5, 16)),
]


def _values(case: Case, dtype, gen):
    shape = case.shape
    if case.base_name == "weight":
        w = torch.randn(shape, generator=gen)
        w[0, 0] = 6.0  # an outlier gives the searches something to clip
        return [w.to(dtype)]
    return [(torch.randn(shape, generator=gen) * (1 + i)).to(dtype) for i in range(3)]


def _run(Observer, name, case, dtype, values, inputs):
    args = QuantizationArgs(**case.args)
    obs = Observer.load_from_registry(name, base_name=case.base_name, args=args, **case.kwargs)
    if name == "imatrix_mse" and case.base_name == "weight":
        lin = torch.nn.Linear(case.shape[1], case.shape[0], bias=False)
        obs.attach(lin)
        with torch.no_grad():
            for x in inputs:
                lin(x)
        obs.detach(lin)
    for v in values:
        obs(v)
    return obs.get_qparams()


def _diff(a, b):
    if a is None or b is None:
        return (0.0, 0) if a is None and b is None else (float("inf"), -1)
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return float("inf"), -1
    d = (a - b).abs()
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    return float(d.max()) if d.numel() else 0.0, int((d != 0).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    import obskernels
    from llmcompressor.observers import Observer as LCObserver

    obskernels.set_backend("reference")
    warnings.simplefilter("ignore")
    worst: dict = {}
    failures = 0
    print(f"{'observer':20} {'case':32} {'dtype':9} {'scale':>10} {'zp':>10} {'gscale':>10}  differ")
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(opts.seed)
            values = _values(case, dtype, gen)
            # imatrix inputs: a few loud channels so the importance matters
            loud = torch.ones(case.shape[-1])
            loud[:4] = torch.tensor([20.0, 8.0, 4.0, 2.0])
            inputs = [torch.randn(3, 7, case.shape[-1], generator=gen) * loud for _ in range(2)]
            for name in case.observers:
                ours = _run(obskernels.Observer, name, case, dtype, values, inputs)
                theirs = _run(LCObserver, name, case, dtype, values, inputs)
                row, count = [], 0
                for key in ("scale", "zero_point", "global_scale"):
                    d, n = _diff(ours[key], theirs[key])
                    row.append(d)
                    count += n if n >= 0 else 1
                    worst[name] = max(worst.get(name, 0.0), d)
                bad = any(d > opts.tolerance for d in row)
                failures += bad
                print(
                    f"{name:20} {case.label:32} {str(dtype)[6:]:9} "
                    + " ".join(f"{d:10.3g}" for d in row)
                    + f"  {count}{'  <-- differs' if bad else ''}"
                )
    # the comparison can see a difference: importance changes imatrix_mse's scales
    case = CASES[2]
    gen = torch.Generator().manual_seed(opts.seed)
    values = _values(case, torch.float32, gen)
    loud = torch.ones(case.shape[-1])
    loud[:4] = torch.tensor([20.0, 8.0, 4.0, 2.0])
    inputs = [torch.randn(3, 7, case.shape[-1], generator=gen) * loud for _ in range(2)]
    weighted = _run(LCObserver, "imatrix_mse", case, torch.float32, values, inputs)
    uniform = _run(LCObserver, "imatrix_mse", case, torch.float32, values, [])
    d, n = _diff(weighted["scale"], uniform["scale"])
    print(f"\nsensitivity: llm-compressor's imatrix_mse with vs without importance "
          f"({case.label}): {n} scales differ, max {d:.3g}")
    print("\nmax abs difference per observer (scale, zero point, global scale together):")
    for name in NAMES:
        print(f"  {name:20} {worst.get(name, float('nan')):.3g}")
    print(f"\n{failures} of the compared rows differ beyond tolerance {opts.tolerance}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
