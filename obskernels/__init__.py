"""obskernels: fast, exact observers for LLM quantization calibration.

``import obskernels`` needs neither CUDA nor triton: the kernels are imported
only when the triton backend is used. The public names below load their
modules on first use, so importing a backend alone (``obskernels.reference``,
``obskernels.kernels``) loads ``obskernels.spec`` and nothing of the front.
"""

import importlib
import importlib.util

from obskernels.spec.errors import KernelUnsupportedError

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "ops": "obskernels.ops",
    "available_backends": "obskernels.backends",
    "get_backend": "obskernels.backends",
    "set_backend": "obskernels.backends",
    "use_backend": "obskernels.backends",
    "BackendUnavailableError": "obskernels.backends",
    "Observer": "obskernels.observers",
    "QParamsDict": "obskernels.observers",
    "MemorylessMinMaxObserver": "obskernels.observers",
    "StaticMinMaxObserver": "obskernels.observers",
    "MinMaxObserver": "obskernels.observers",
    "MemorylessMSEObserver": "obskernels.observers",
    "MovingAverageMSEObserver": "obskernels.observers",
    "NVFP4ExpandedMSEObserver": "obskernels.observers",
    "IMatrixMSEObserver": "obskernels.observers",
    "NVFP4ExpandedIMatrixObserver": "obskernels.observers",
    "ImportanceFallbackWarning": "obskernels.observers",
    "get_observer_token_count": "obskernels.observers",
}

__all__ = [
    "ops",
    "available_backends",
    "get_backend",
    "set_backend",
    "use_backend",
    "BackendUnavailableError",
    "KernelUnsupportedError",
    "Observer",
    "QParamsDict",
    "MemorylessMinMaxObserver",
    "StaticMinMaxObserver",
    "MinMaxObserver",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "IMatrixMSEObserver",
    "NVFP4ExpandedIMatrixObserver",
    "ImportanceFallbackWarning",
    "get_observer_token_count",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        # a submodule (obskernels.observers, .backends, ...) reached as an attribute
        if name.startswith("_") or importlib.util.find_spec(f"obskernels.{name}") is None:
            raise AttributeError(f"module 'obskernels' has no attribute {name!r}")
        return importlib.import_module(f"obskernels.{name}")
    mod = importlib.import_module(module)
    value = mod if name == "ops" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
