"""Shared test set-up.

Without CUDA, the Triton kernels run on the CPU through triton's interpreter,
which must be switched on before triton is first imported.

The parity tests build their tensors on the ``device`` fixture's device: the
CPU under the interpreter, CUDA where there is a GPU and the interpreter is
off (``make gpu-check``), so a GPU run checks the very cases the CPU run
does, with the reference computed by torch on the same GPU. A test that takes
``device`` is marked ``on_device``; ``make gpu-check`` runs those (and the
``gpu``-marked ones) with the kernels compiled for the GPU.
"""

import contextlib
import importlib
import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_lang_once_per_launch():
    """Test speed only: triton's interpreter re-patches triton.language (an
    inspect.getmembers walk) at every nested @jit call in every program, a
    third of the kernel tests' time; the launch has already patched the same
    modules. Nested calls reaching only those modules skip the repeat."""
    from triton.runtime import interpreter
    import triton.language as tl

    original = getattr(interpreter, "_patch_lang", None)
    if original is None:  # another triton version: run at its normal speed
        return
    launches = []

    class Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            launches.pop()
            self.scope.restore()

    class Nested:
        def restore(self):
            pass

    def patch_lang(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if launches and langs <= launches[-1]:
            return Nested()
        scope = original(fn)
        if launches:  # nested, reaching other modules: as triton does
            return scope
        launches.append(langs)
        return Launch(scope)

    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    _patch_lang_once_per_launch()

import pytest  # noqa: E402

from obskernels.backends import (  # noqa: E402
    interpreter_numpy_requirement,
    interpreter_unfit_reason,
    triton_unavailable_reason,
    use_backend,
)

BACKENDS = ("reference", "triton")


def _parity_device() -> str:
    """CUDA when there is a GPU and triton's interpreter is off (the kernels
    then compile for it); otherwise the CPU (the interpreter runs the kernels
    on CPU tensors)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"


#: the device of the parity tests' tensors in this run
DEVICE = _parity_device()


def pytest_configure(config):
    """A triton interpreter that cannot run the kernels beside this numpy
    (triton 3.6's beside numpy 2.4, say: torch 2.10's and 2.11's triton)
    stops the run at once, naming the fix, instead of failing every test
    that launches a kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not importlib.util.find_spec("triton"):
        return
    import numpy
    import triton

    reason = interpreter_unfit_reason(triton.__version__, numpy.__version__)
    if reason:
        pytest.exit(f"the suite runs the kernels in triton's interpreter, and {reason} "
                    f"(`pip install '{interpreter_numpy_requirement(triton.__version__)}'`, "
                    "as `make setup` does)", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.on_device)


@pytest.fixture(scope="session")
def device():
    """The device the test builds its tensors on (``DEVICE``): one value per
    run, so the CPU run's cases and ids are those without the fixture."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _launch_state() -> list:
    """(owner, attribute, value) of what launches a kernel, as the test
    starts: the launch sites' call and every @triton.jit function of the
    kernel modules imported so far (none before the kernels are)."""
    replay = sys.modules.get("obskernels.kernels._replay")
    if replay is None:
        return []
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    state = [(replay.Replay, "__call__", replay.Replay.__call__)]
    for name, module in list(sys.modules.items()):
        if name.startswith("obskernels.kernels.") and module is not None:
            state += [(module, attr, fn) for attr, fn in vars(module).items()
                      if isinstance(fn, (JITFunction, InterpretedFunction))]
    return state


@pytest.fixture(autouse=True)
def _launches_kept():
    """Fails a test that leaves a kernel or the launch sites' call replaced
    (a stub undone in the wrong order, say): every later launch of its
    worker would compute nothing, and hundreds of tests after it fail on
    wrong numbers. What it replaced is put back first."""
    state = _launch_state()
    yield
    left = [(owner, attr, value) for owner, attr, value in state if getattr(owner, attr) is not value]
    for owner, attr, value in left:
        setattr(owner, attr, value)
    if left:
        pytest.fail("the test left replaced (put back now): "
                    + ", ".join(f"{getattr(owner, '__name__', owner)}.{attr}" for owner, attr, _ in left))


@pytest.fixture
def pin_launch():
    """``pin_launch(op, **fields)``: launch operation ``op`` (a name of
    kernels/launch/'s DEFAULTS) with those LaunchConfig fields for the rest
    of the test, through ``launch_config`` (nothing global is rewritten)."""
    with contextlib.ExitStack() as stack:

        def pin(op, **fields):
            launch = importlib.import_module("obskernels.kernels.launch")
            stack.enter_context(launch.launch_config(ops=op, **fields))

        yield pin


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
