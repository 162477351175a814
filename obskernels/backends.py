"""Backend choice: which implementation computes an operation.

Names:
- "reference": the pure-PyTorch definitions in ``obskernels.reference``.
- "triton": the fused kernels in ``obskernels.kernels``; runs on CUDA tensors,
  and on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported.
- "auto" (default): triton where it can run for the given tensor, else reference.

The active name comes from the innermost ``use_backend`` block of the caller's
own thread / async task, else from ``set_backend`` (process-wide), else from
the environment variable OBSKERNELS_BACKEND, else "auto". Forcing a backend that
cannot run raises ``BackendUnavailableError`` saying why; it never falls back.

Scope: ``use_backend`` keeps its choice in a ``contextvars.ContextVar``, so
threads and asyncio tasks calibrating in parallel each see only their own block
and never restore each other's choice. A new thread starts outside any block
(it sees ``set_backend`` / the environment, not the block of the thread that
started it); an asyncio task starts with a copy of its creator's context (the
block around ``create_task`` applies, a block entered inside the task stays in
the task). ``set_backend`` changes the process-wide default; inside a
``use_backend`` block the block's choice still wins until the block exits.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType

import torch

from obskernels.spec.errors import KernelUnsupportedError

__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailableError",
    "KernelUnsupportedError",
    "available_backends",
    "get_backend",
    "set_backend",
    "use_backend",
    "resolve_backend",
    "backend_module",
    "triton_unavailable_reason",
]

BACKEND_NAMES = ("auto", "reference", "triton")
ENV_VAR = "OBSKERNELS_BACKEND"

logger = logging.getLogger("obskernels")

# process-wide choice (set_backend); None: the environment decides
_process_choice: str | None = None
# the innermost use_backend block of this thread / async task; None: outside any
_scoped_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "obskernels_backend", default=None
)


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return name.lower()


def _environ_dict():
    """(dict, key, decode) reading OBSKERNELS_BACKEND as ``os.environ.get``
    does, or None. Every operation asks when no backend was chosen, and a
    missing variable costs ``os.environ.get`` a raised KeyError (~0.7 us, a
    tenth of an activation forward's host path): CPython's ``os.environ``
    keeps its variables in a dict that each of its writes updates, read
    directly where it exists (None elsewhere: ``os.environ.get``)."""
    environ = os.environ
    data, encode, decode = (getattr(environ, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if not isinstance(data, dict) or not callable(encode) or not callable(decode):
        return None
    return data, encode(ENV_VAR), decode


_ENVIRON = _environ_dict()
# (the variable's last raw value, its checked name): one tuple, so that a
# thread never sees half an update
_environ_choice: tuple = (None, "auto")


def _environ_name(raw) -> str:
    if _ENVIRON is not None and raw is not None:
        raw = _ENVIRON[2](raw)
    return _check_name(raw or "auto")


def get_backend() -> str:
    """The requested backend name (may be "auto") for the calling thread / task."""
    global _environ_choice
    scoped = _scoped_choice.get()
    if scoped is not None:
        return scoped
    if _process_choice is not None:
        return _process_choice
    env = _ENVIRON
    raw = env[0].get(env[1]) if env is not None else os.environ.get(ENV_VAR)
    last, name = _environ_choice
    if raw != last:
        name = _environ_name(raw)  # an invalid value raises at every call
        _environ_choice = (raw, name)
    return name


def _checked(name: str) -> str:
    """A valid name whose runtime is present (triton importable)."""
    name = _check_name(name)
    if name == "triton":
        reason = triton_unavailable_reason(None)
        if reason is not None:
            raise BackendUnavailableError(f"backend 'triton' cannot run: {reason}")
    return name


def set_backend(name: str) -> None:
    """Select the backend for every later operation in this process (every
    thread and task outside a ``use_backend`` block).

    A forced name is checked at once for the runtime (triton importable); whether
    it fits a given tensor's device is checked when an operation runs.
    """
    global _process_choice
    _process_choice = _checked(name)


class use_backend:
    """Select the backend inside the block, for the calling thread or asyncio
    task only; the previous choice of that thread / task comes back on exit
    (exceptions included). Other threads and tasks are not affected.

    ``with use_backend(name): ...``; the name is checked on entering. A
    class rather than a generator context manager: callers that scope each
    call (a drop-in, a harness) pay a third of the host time."""

    __slots__ = ("_name", "_tokens")

    def __init__(self, name: str):
        self._name, self._tokens = name, []

    def __enter__(self) -> None:
        self._tokens.append(_scoped_choice.set(_checked(self._name)))

    def __exit__(self, *exc) -> bool:
        _scoped_choice.reset(self._tokens.pop())
        return False


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_MISSING = "triton is not installed"
_CPU_NEEDS_INTERPRETER = "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"

# Whether triton is installed, whether it and the kernels import, and whether
# triton built them for its interpreter, do not change in a process: found
# out once, then kept (every operation asks).
_triton_found: list = []  # [whether triton is installed] once asked
_runtime: list = []  # [(reason the kernels cannot run or None, interpreted)] once known


def _triton_installed() -> bool:
    if not _triton_found:
        _triton_found.append(importlib.util.find_spec("triton") is not None)
    return _triton_found[0]


def _release(version: str) -> tuple:
    """(major, minor) of a version string ("3.6.0", "2.4.0rc1", "3.7.0+git1a2b")."""
    parts = version.split(".")
    return int(parts[0]), int("".join(c for c in parts[1].split("+")[0] if c.isdigit()) or 0)


def interpreter_numpy_requirement(triton_version: str) -> str | None:
    """The numpy that triton's interpreter of ``triton_version`` needs to run
    the kernels, as a pip requirement ("numpy<2.4" before triton 3.7), or
    None. Triton 3.6's interpreter turns a loop's bound, a one-element array,
    into a Python int, which numpy 2.4 and later refuse: every kernel with a
    loop to a runtime bound fails in it."""
    return "numpy<2.4" if _release(triton_version) < (3, 7) else None


def interpreter_unfit_reason(triton_version: str, numpy_version: str) -> str | None:
    """Why triton's interpreter of ``triton_version`` cannot run the kernels
    beside numpy ``numpy_version`` (``interpreter_numpy_requirement``), or None."""
    if interpreter_numpy_requirement(triton_version) and _release(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter cannot run the kernels beside numpy "
                f"{numpy_version} (it turns one-element arrays into ints, which numpy 2.4 refuses): "
                "use triton 3.7 or later, or numpy below 2.4")
    return None


def _kernels_runtime() -> tuple:
    if not _runtime:
        if not _triton_installed():
            _runtime.append((_TRITON_MISSING, False))
            return _runtime[0]
        try:
            kernels = importlib.import_module("obskernels.kernels")
        except ImportError as exc:  # triton present but broken, or kernels missing
            _runtime.append((f"the kernels failed to import ({exc})", False))
        else:
            reason = None
            if kernels.INTERPRETED:  # the interpreter runs every launch, CUDA tensors' too
                import numpy
                import triton

                reason = interpreter_unfit_reason(triton.__version__, numpy.__version__)
            _runtime.append((reason, bool(kernels.INTERPRETED)))
    return _runtime[0]


_cuda_seen: list = []  # [True] once CUDA was found available: devices do not go away


def _cuda_available() -> bool:
    """torch.cuda.is_available(), asked until it says yes (every
    ``use_backend("triton")`` block asks)."""
    if _cuda_seen:
        return True
    if torch.cuda.is_available():
        _cuda_seen.append(True)
        return True
    return False


def triton_unavailable_reason(tensor: torch.Tensor | None) -> str | None:
    """Why the triton backend cannot run (for ``tensor``'s device), or None.

    CPU tensors need the kernels built for triton's interpreter, i.e.
    TRITON_INTERPRET=1 set before triton was imported."""
    if (tensor is not None and not _runtime and tensor.device.type == "cpu"
            and not _interpreter_on() and "obskernels.kernels" not in sys.modules):
        # imported now, the kernels would be built for a GPU (the interpreter
        # is off): a CPU tensor cannot take them, and a CPU-only caller under
        # "auto" need not pay their import (~0.1 s) to learn it
        return _CPU_NEEDS_INTERPRETER if _triton_installed() else _TRITON_MISSING
    reason, interpreted = _kernels_runtime()
    if reason is not None:
        return reason
    if tensor is None:
        if interpreted or _cuda_available() or _interpreter_on():
            return None
        return "no CUDA device and TRITON_INTERPRET=1 is not set"
    kind = tensor.device.type
    if kind == "cuda":
        return None
    if kind == "cpu":
        # kernels built for the interpreter; else the variable is read now (a
        # tool recording the launches of CPU tensors sets it: nothing runs)
        if interpreted or _interpreter_on():
            return None
        return _CPU_NEEDS_INTERPRETER
    return f"tensors on device {kind!r} are not supported"


def available_backends(tensor: torch.Tensor | None = None) -> list[str]:
    """Names that can run now (for ``tensor``'s device when given)."""
    names = ["auto", "reference"]
    if triton_unavailable_reason(tensor) is None:
        names.append("triton")
    return names


def resolve_backend(tensor: torch.Tensor) -> str:
    """The concrete backend ("reference" or "triton") for an operation on ``tensor``."""
    name = get_backend()
    if name == "reference":
        return "reference"
    reason = triton_unavailable_reason(tensor)
    if name == "triton":
        if reason is not None:
            raise BackendUnavailableError(f"backend 'triton' cannot run: {reason}")
        return "triton"
    return "triton" if reason is None else "reference"


def backend_module(name: str) -> ModuleType:
    """The module holding the operations of a concrete backend."""
    if name == "reference":
        return importlib.import_module("obskernels.reference")
    if name == "triton":
        return importlib.import_module("obskernels.kernels")
    raise ValueError(f"no concrete backend named {name!r}")
