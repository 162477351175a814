"""Fused Triton kernels for the observer operations.

One launcher per operation, each with the signature of its twin in
obskernels.reference. Importing this package requires triton; obskernels
imports it only when the triton backend is used.
"""

from obskernels.kernels.accumulate_sq import accumulate_sq
from obskernels.kernels.flatten import flatten_for_calibration
from obskernels.kernels.importance import importance
from obskernels.kernels.min_max import min_max
from obskernels.kernels.mse_search import mse_search
from obskernels.kernels.qparams import calculate_qparams
from obskernels.kernels.stats import combine_statistics

__all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams", "combine_statistics",
           "importance"]
