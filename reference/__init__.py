"""Pure-PyTorch reference of every obskernels operation: the oracle.

Each function has the exact signature of its Triton twin in obskernels.kernels.
"""

from obskernels.reference.accumulate_sq import accumulate_sq
from obskernels.reference.flatten import flatten_for_calibration
from obskernels.reference.importance import importance
from obskernels.reference.min_max import min_max
from obskernels.reference.mse_search import mse_search
from obskernels.reference.qparams import calculate_qparams
from obskernels.reference.stats import combine_statistics

__all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams", "combine_statistics",
           "importance"]
