"""Observers with llm-compressor's API, computing through ``obskernels.ops``.

Registered names (``Observer.load_from_registry(name, base_name=..., args=...)``):
memoryless_minmax, static_minmax, minmax, memoryless_mse, mse,
nvfp4_expanded_mse, imatrix_mse.
"""

from obskernels.observers.base import MinMaxTuple, Observer, QParamsDict
from obskernels.observers.imatrix import IMatrixMSEObserver, ImportanceFallbackWarning
from obskernels.observers.minmax import (
    MemorylessMinMaxObserver,
    MinMaxObserver,
    StaticMinMaxObserver,
)
from obskernels.observers.mse import (
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedMSEObserver,
)
from obskernels.observers.tokens import get_observer_token_count

#: Every name this package registers, in the order of the table in docs/spec.md §1.
OBSERVER_NAMES = (
    "memoryless_minmax",
    "static_minmax",
    "minmax",
    "memoryless_mse",
    "mse",
    "nvfp4_expanded_mse",
    "imatrix_mse",
)

__all__ = [
    "OBSERVER_NAMES",
    "Observer",
    "QParamsDict",
    "MinMaxTuple",
    "MemorylessMinMaxObserver",
    "StaticMinMaxObserver",
    "MinMaxObserver",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "IMatrixMSEObserver",
    "ImportanceFallbackWarning",
    "get_observer_token_count",
]
