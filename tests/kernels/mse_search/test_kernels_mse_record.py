"""The search's own non-finite record: ``mse_search(..., status=, observation=)``.

An observer with nothing held searches a value and records it in one
operation (no ``combine_statistics`` launch, no second read of the value).
The oracle is the reference's ``stats.record`` -- torch's NaN / +-inf counts
of the value and whether the reference search's statistics are finite --
applied to a record that starts as the observer's would; both backends must
leave exactly that record (int64, every field), on the register path, its
TRACK form (patience >= steps), the split path, and with importance.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels.reference.stats import record as reference_record
from obskernels.spec.record import STATUS_FIRST_BAD, new_record

from helpers import call_backend, reference_search

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

mse_module = importlib.import_module("obskernels.kernels.mse_search")
reference_module = importlib.import_module("obskernels.reference.mse_search")

MSE = dict(maxshrink=0.2, patience=5, grid=20, norm=2.4)
G16 = dict(num_bits=4, strategy="group", group_size=16, symmetric=True)
CHANNEL = dict(num_bits=8, strategy="channel")
PATHS = {
    "register": (G16, MSE, None),
    "track": (G16, dict(MSE, patience=1000), None),
    "split": (CHANNEL, MSE, dict(max_reg_group=16, chunk=16, split=2)),
    "imatrix": (G16, dict(MSE, flavour="imatrix", patience=0), None),
}


def _value(kind):
    v = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if kind == "nan":
        v[1, 3] = v[5, 60] = float("nan")
    elif kind == "inf":
        v[2, 7] = float("inf")
        v[3, 9] = v[3, 40] = float("-inf")
    elif kind == "nan row":
        v[6] = float("nan")
    elif kind == "overflow":  # finite, but expand makes the base infinite
        v[4, 4] = 3e38
    return v


def _start(prior_bad):
    """A record as an observer holds it: fresh, or with observation 1 refused."""
    status = new_record(torch.device("cpu"))
    if prior_bad:
        status[STATUS_FIRST_BAD] = 1
    return status


@pytest.mark.parametrize("prior_bad", [False, True])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf", "nan row", "overflow"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_search_records_what_combine_statistics_would(path, kind, prior_bad, pin_launch):
    fields, kw, config = PATHS[path]
    args = QuantizationArgs(**fields)
    kw = dict(kw, expand=1.5 if kind == "overflow" else 1.0)
    if path == "imatrix":
        kw["importance"] = torch.rand(64, generator=torch.Generator().manual_seed(4)) + 0.5
    if config is not None:
        pin_launch("mse_search", **config)
    value = _value(kind)
    mins, maxs = reference_search(value, "weight", args, **kw)
    expected = _start(prior_bad)
    reference_record(expected, value, mins, maxs, 3)
    for name, fn in (("reference", reference_module.mse_search), ("triton", mse_module.mse_search)):
        status = _start(prior_bad)
        got = call_backend(fn, value, "weight", args, status=status, observation=3, **kw)
        assert torch.equal(status, expected), f"{name}: {status.tolist()} != {expected.tolist()}"
        for g, w in zip(got, (mins, maxs)):  # (the search's parity is test_kernels_mse.py's)
            assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())
