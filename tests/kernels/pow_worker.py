"""Worker of tests/kernels/test_kernels_quant.py's pow check under every
triton, run as a script WITH TRITON_INTERPRET=1 by the interpreter of each
triton environment (``helpers.compile_pythons()``): triton 3.8's interpreter
and older round a ``tl.fma`` twice, which ``quant_pow.pow_pos`` must not
depend on.

It computes fp32 ``|d| ** norm`` for general norms through
``quant_pow.abs_pow`` and prints one JSON object: per norm, the largest
relative difference from torch's fp32 pow over normal results, and whether
the special values (0, inf, NaN) came out as torch's. The test holds the
tolerance.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import importlib  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

QP = importlib.import_module("obskernels.kernels.quant_pow")
Q = importlib.import_module("obskernels.kernels.quant")


@triton.jit
def _pow(x_ptr, out_ptr, n, norm, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0)
    tl.store(out_ptr + offs, QP.abs_pow(x, norm, QP.P_GENERAL, Q.F32), mask=live)


def main() -> None:
    gen = torch.Generator().manual_seed(4)
    d = (torch.rand(8192, generator=gen) * torch.exp(torch.randn(8192, generator=gen) * 3)).float()
    d[:3] = torch.tensor([0.0, float("inf"), float("nan")])
    row = {"triton": triton.__version__}
    for norm in (2.4, 7.3):
        got = torch.empty_like(d)
        _pow[(1,)](d, got, d.numel(), norm, BLOCK=d.numel(), enable_fp_fusion=False)
        want = d.pow(norm)
        normal = torch.isfinite(want) & (want > 1e-30)
        special = (want == 0) | torch.isinf(want) | torch.isnan(want)
        row[str(norm)] = {
            "max_rel": ((got - want).abs() / want)[normal].max().item(),
            "special_equal": bool(((got == want) | (got.isnan() & want.isnan()))[special].all()),
        }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
