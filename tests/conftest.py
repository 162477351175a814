"""Shared test set-up.

Without CUDA, the Triton kernels run on the CPU through triton's interpreter,
which must be switched on before triton is first imported.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from obskernels.backends import triton_unavailable_reason, use_backend  # noqa: E402

BACKENDS = ("reference", "triton")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test once per backend, with that backend forced."""
    name = request.param
    if name == "triton":
        reason = triton_unavailable_reason(None)
        if reason is not None:
            # Only a missing triton is a reason to skip; triton installed but
            # unusable (broken kernels, interpreter off on a CPU) is a failure.
            if importlib.util.find_spec("triton") is None:
                pytest.skip(f"triton backend unavailable: {reason}")
            pytest.fail(f"triton is installed but its backend cannot run: {reason}")
    with use_backend(name):
        yield name
