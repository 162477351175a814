"""pytest-benchmark suite over the harness's cases at small sizes (``make bench-pytest``).

The cases and targets come from ``obskernels.bench.cases`` (the same definitions
as ``python -m obskernels.bench`` and tests/test_bench.py). Each benchmark times
one call of an op or of an observer (observe + get_qparams) with one backend.
Triton is timed only on CUDA: under the CPU interpreter its time means nothing
(``python -m obskernels.bench`` models it instead).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from obskernels.bench.backends import prepare
from obskernels.bench.cases import OBSERVERS, OPS, sweep, targets_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BACKENDS = ["reference", "triton", "llmc", "llmc-eager"]
PARAMS = [
    pytest.param(case, target, backend, id=f"{case.label}-{target.label}-{backend}".replace(" ", "_"))
    for case in sweep("tiny")
    for target in targets_for(case, list(OPS), list(OBSERVERS))
    for backend in BACKENDS
]


@pytest.mark.parametrize("case, target, backend", PARAMS)
def test_bench(benchmark, case, target, backend):
    if backend == "triton" and (DEVICE != "cuda" or INTERPRETED):
        pytest.skip("triton is timed on CUDA only, compiled (the interpreter's time means nothing)")
    if backend.startswith("llmc") and importlib.util.find_spec("llmcompressor") is None:
        pytest.skip("llmcompressor is not importable in this environment")
    prepared = prepare(case, target, backend, device=DEVICE)
    benchmark.group = f"{case.label} {target.label}"
    benchmark.extra_info.update(shape=list(case.shape), dtype=case.dtype, scheme=case.scheme)

    def run():  # an observer call includes constructing the observer (build)
        out = prepared.call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        benchmark.pedantic(run, setup=prepared.setup, rounds=5, warmup_rounds=1)
