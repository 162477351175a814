"""Pure-PyTorch reference of every obskernels operation: the oracle.

Each function takes the checked call of ``obskernels.spec.calls`` that its
Triton twin in obskernels.kernels takes, and checks nothing itself: the
front (``obskernels.ops``) checked the call once. This package never
imports the kernels nor the front.
"""

# This folder is installed as obskernels.reference (pyproject.toml maps it). Run from
# the repository root, it is also visible as a top-level package named plain
# `reference`.
# Imported under any name but its own it stays empty: no functions, no
# version, and no import of obskernels in the middle of another package's
# import.
if __name__ == "obskernels.reference":
    from obskernels.reference.accumulate_sq import accumulate_sq
    from obskernels.reference.flatten import flatten_for_calibration
    from obskernels.reference.importance import importance
    from obskernels.reference.min_max import min_max, min_max_qparams
    from obskernels.reference.mse_search import mse_search, mse_search_qparams
    from obskernels.reference.qparams import calculate_qparams
    from obskernels.reference.stats import combine_statistics

    __all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams", "combine_statistics",
               "importance", "min_max_qparams", "mse_search_qparams"]
else:
    __all__ = []
