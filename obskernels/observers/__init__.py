"""Observers with llm-compressor's API, computing through ``obskernels.ops``.

Registered names (``Observer.load_from_registry(name, base_name=..., args=...)``):
memoryless_minmax, static_minmax, minmax, memoryless_mse, mse,
nvfp4_expanded_mse, imatrix_mse, nvfp4_expanded_imatrix, and the deprecated
alias fouroversix (warns, builds nvfp4_expanded_mse): llm-compressor
0.14.0.1's nine names.
"""

from obskernels.observers.base import MinMaxTuple, Observer, QParamsDict
from obskernels.observers.imatrix import (
    IMatrixMSEObserver,
    ImportanceFallbackWarning,
    NVFP4ExpandedIMatrixObserver,
)
from obskernels.observers.minmax import (
    MemorylessMinMaxObserver,
    MinMaxObserver,
    StaticMinMaxObserver,
)
from obskernels.observers.mse import (
    FourOverSixObserver,
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    NVFP4ExpandedMSEObserver,
)
from obskernels.observers.tokens import get_observer_token_count

#: The first seven rows of the table in docs/spec.md §1, in its order.
OBSERVER_NAMES = (
    "memoryless_minmax",
    "static_minmax",
    "minmax",
    "memoryless_mse",
    "mse",
    "nvfp4_expanded_mse",
    "imatrix_mse",
)

#: The table's last two rows, as llm-compressor 0.14.0.1 registers them: the
#: importance-weighted search over the NVFP4-expanded range, and the
#: deprecated alias of nvfp4_expanded_mse.
EXTRA_OBSERVER_NAMES = ("nvfp4_expanded_imatrix", "fouroversix")

#: Every name ``Observer.load_from_registry`` accepts (llm-compressor 0.14.0.1's nine).
ALL_OBSERVER_NAMES = OBSERVER_NAMES + EXTRA_OBSERVER_NAMES

__all__ = [
    "OBSERVER_NAMES",
    "EXTRA_OBSERVER_NAMES",
    "ALL_OBSERVER_NAMES",
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
    "NVFP4ExpandedIMatrixObserver",
    "FourOverSixObserver",
    "ImportanceFallbackWarning",
    "get_observer_token_count",
]
