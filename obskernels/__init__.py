"""obskernels: fast, exact observers for LLM quantization calibration.

``import obskernels`` needs neither CUDA nor triton: the kernels are imported
only when the triton backend is used.
"""

from obskernels import ops
from obskernels.backends import (
    BackendUnavailableError,
    KernelUnsupportedError,
    available_backends,
    get_backend,
    set_backend,
    use_backend,
)
from obskernels.observers import (
    IMatrixMSEObserver,
    ImportanceFallbackWarning,
    MemorylessMinMaxObserver,
    MemorylessMSEObserver,
    MinMaxObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedIMatrixObserver,
    NVFP4ExpandedMSEObserver,
    Observer,
    QParamsDict,
    StaticMinMaxObserver,
    get_observer_token_count,
)

__version__ = "0.1.0"

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
