"""The MSE shrink-grid search's parameters and rules (docs/spec.md §4), for every backend.

- ``check_search_params``: the bounds of maxshrink, patience, grid, norm,
  expand and the flavour (one message per rule; observers check their kwargs
  here too).
- ``num_steps``: how many grid steps a flavour may take.
- ``search_args``: the QuantizationArgs the search quantizes its candidates with.
- ``SearchParams``: the checked parameters of one search, frozen.
- ``MSE_DEFAULTS`` / ``IMATRIX_DEFAULTS`` / ``NVFP4_EXPANDED`` and
  ``default_triton_error_buffer``: the observers' defaults, llm-compressor
  0.14.0.1's (the benchmark's search targets use them too).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

from obskernels.spec.checks import strategy_of

__all__ = [
    "FLAVOURS",
    "SearchParams",
    "check_search_params",
    "num_steps",
    "search_args",
    "MSE_DEFAULTS",
    "IMATRIX_DEFAULTS",
    "NVFP4_EXPANDED",
    "default_triton_error_buffer",
]

FLAVOURS = ("mse", "imatrix")

# The defaults below are llm-compressor 0.14.0.1's, name by name
# (llmcompressor/observers/mse.py and imatrix.py); tests/test_llmcompressor.py
# compares every registered name with llm-compressor's on its defaults.

#: defaults of the "mse" observers (memoryless_mse, mse)
MSE_DEFAULTS = MappingProxyType({
    "maxshrink": 0.20,
    "patience": 5,
    "grid": 100.0,
    "norm": 2.4,
    "expand": 1.0,
    "chunk_size": 5,
})
#: defaults of imatrix_mse
IMATRIX_DEFAULTS = MappingProxyType({
    "maxshrink": 0.95,
    "patience": 5,
    "grid": 20,
    "norm": 3.0,
    "expand": 1.0,
    "chunk_size": 5,
})
#: what both nvfp4_expanded observers (nvfp4_expanded_mse, nvfp4_expanded_imatrix)
#: set over their base's defaults: search from 1.8x the range down to about
#: 0.8x, with norm 2.4 (nvfp4_expanded_imatrix's own setting, replacing
#: imatrix_mse's 3.0; nvfp4_expanded_mse has it from memoryless_mse)
NVFP4_EXPANDED = MappingProxyType({
    "expand": 1.8,
    "maxshrink": 1 - 0.8 / 1.8,
    "grid": 200.0,
    "patience": 1000,
    "norm": 2.4,
})


def default_triton_error_buffer(args, expanded: bool = False) -> float:
    """llm-compressor 0.14.0.1's default ``triton_error_buffer`` for the "mse"
    observers: 1.0 for nvfp4_expanded_mse (``expanded``) and for 4-bit floats,
    else 0.3. It is the slack of llm-compressor's CUDA-only per-group
    patience; obskernels keeps the value and never uses it (it computes the
    eager search with global patience). The imatrix observers have none."""
    if expanded or (args.type == QuantizationType.FLOAT and args.num_bits == 4):
        return 1.0
    return 0.3


def check_search_params(maxshrink, patience, grid, norm, expand, flavour) -> None:
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    if not isinstance(grid, (int, float)) or not math.isfinite(grid) or grid <= 0:
        raise ValueError(f"grid must be a finite number > 0, got {grid!r}")
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
        raise ValueError(f"patience must be an integer >= 0, got {patience!r}")
    if not isinstance(maxshrink, (int, float)) or not 0 <= maxshrink <= 1:
        raise ValueError(f"maxshrink must be in [0, 1], got {maxshrink!r}")
    if not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm <= 0:
        raise ValueError(f"norm must be a finite positive number, got {norm!r}")
    if not isinstance(expand, (int, float)) or not math.isfinite(expand) or expand < 1:
        raise ValueError(f"expand must be a finite number >= 1, got {expand!r}")


def num_steps(maxshrink: float, grid: float, flavour: str) -> int:
    """How many grid steps the search may take (i = 0 .. num_steps - 1):
    flavour "mse" int(maxshrink * grid), "imatrix" max(1, that) + 1."""
    if flavour == "mse":
        return int(maxshrink * grid)
    return max(1, int(maxshrink * grid)) + 1


def search_args(args):
    """(args for qparams, args for fake quantization) used during the search:
    TENSOR_GROUP searches without its scale_dtype; candidates are
    fake-quantized per token of the flattened value."""
    if strategy_of(args) == QuantizationStrategy.TENSOR_GROUP and args.scale_dtype is not None:
        args = args.model_copy(update={"scale_dtype": None})
    return args, args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})


@dataclasses.dataclass(frozen=True)
class SearchParams:
    """The checked parameters of one search; ``steps`` is ``num_steps`` of them."""

    maxshrink: float
    patience: int
    grid: float
    norm: float
    expand: float = 1.0
    flavour: str = "mse"

    def __post_init__(self):
        check_search_params(self.maxshrink, self.patience, self.grid, self.norm, self.expand,
                            self.flavour)

    @property
    def steps(self) -> int:
        return num_steps(self.maxshrink, self.grid, self.flavour)
