"""Finding the kernels of kernels/ and recording their launches.

``discover_kernels`` finds every launched ``@triton.jit`` kernel;
``recording()`` replaces each by a recorder for the length of a block, under
the GPU's launch configuration (``kernels.launch.CUDA_LAUNCH``), so a
launcher's call binds its launches and runs none; ``record`` runs calls
(the probe's cases) that way and returns their ``Launch`` records.
``cpu_tensors_recorded`` lets the triton backend take CPU tensors inside
such a block (a front call recorded through obskernels.ops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pkgutil
import re
from typing import Dict, List

PACKAGE = "obskernels.kernels"
# modules and packages of kernels/ that launch no kernel of their own
# (_replay: how the launchers launch; launch: the launch policy;
# mse_search_details: the search's jit kernels, launched by mse_search)
_NOT_KERNEL_MODULES = {"_layout", "_replay", "launch", "quant", "quant_pow", "mse_search_details"}


def _kernel_modules() -> Dict[str, object]:
    pkg = importlib.import_module(PACKAGE)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_KERNEL_MODULES)
    return {n: importlib.import_module(f"{PACKAGE}.{n}") for n in names}


def discover_kernels(modules=None) -> Dict[str, tuple]:
    """Every launched @triton.jit kernel of kernels/: a JIT function of a
    module that the module's source launches as ``name[grid](...)`` or
    through a ``Replay(globals(), "name", grid)``.
    Returns {"module.name": (module, attribute)}."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # under TRITON_INTERPRET=1 a @triton.jit function is an InterpretedFunction
    kinds = (JITFunction, InterpretedFunction)
    found = {}
    for mname, module in (modules or _kernel_modules()).items():
        src = inspect.getsource(module)
        for attr, fn in vars(module).items():
            # launched as name[grid](...) or through kernels/_replay.py's
            # Replay(globals(), "name", ...)
            launched = (rf"\b{re.escape(attr)}\s*\[|"
                        rf"\bReplay\(\s*globals\(\),\s*\"{re.escape(attr)}\"")
            if isinstance(fn, kinds) and re.search(launched, src):
                found[f"{mname}.{attr}"] = (module, attr)
    return found


@dataclasses.dataclass
class Launch:
    case: str
    tag: str
    kernel: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, name, fn, sink):
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            self.sink.append((self.name, self.fn, tuple(int(v) for v in g), args, kwargs))
        return launch


@contextlib.contextmanager
def recording(kernels=None):
    """Within the block every kernel of kernels/ is a recorder; yields the
    list of (kernel, fn, grid, args, kwargs) launches (nothing runs), under
    the GPU's launch configuration."""
    from obskernels.kernels.launch import CUDA_LAUNCH, launch_config

    kernels = kernels or discover_kernels()
    sink: list = []
    saved = []
    for name, (module, attr) in kernels.items():
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, _Recorder(name, getattr(module, attr), sink))
    try:
        # what a GPU compiles: its launch shape and its arithmetic (gpu_arith)
        with launch_config(**CUDA_LAUNCH, gpu_arith=True):
            yield sink
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


@contextlib.contextmanager
def cpu_tensors_recorded():
    """Within the block the triton backend takes CPU tensors although the
    kernels were built for the compiler: for a caller that records a front
    call (an observer's, through obskernels.ops) inside ``recording()``, so
    that nothing runs. The backend takes CPU tensors where TRITON_INTERPRET
    is set, which it reads for each call signature it has not seen (the
    plans made in the block are dropped at its end); the kernels keep what
    triton built when they were imported (``kernels._layout.INTERPRETED``
    stays False)."""
    import obskernels.kernels  # noqa: F401 - built for the compiler before the switch

    from obskernels import ops

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
        # the plans kept for CPU tensors in the block took the triton backend,
        # which CPU tensors cannot take outside it
        ops._PLANS.clear()


def record(calls, kernels=None) -> List[Launch]:
    """Runs each ``(case, tag, module name, config fields, call)`` of ``calls``
    with every kernel replaced by a recorder, under the GPU's launch
    configuration plus the case's fields; returns the launches (nothing runs).
    The kernels are restored afterwards."""
    from obskernels.kernels.launch import launch_config

    launches = []
    with recording(kernels) as sink:
        for case, tag, mname, fields, call in calls:
            sink.clear()
            module = importlib.import_module(f"{PACKAGE}.{mname}")
            with launch_config(**fields):
                call(module)
            launches += [Launch(case, tag, n, f, g, a, k) for n, f, g, a, k in sink]
    return launches

