"""Fused Triton kernels for the observer operations.

One launcher per operation, each taking the checked call of
``obskernels.spec.calls`` that its twin in obskernels.reference takes; it
checks no input (the front checked the call once) and raises
KernelUnsupportedError only for valid input it does not cover (float64
values, a few formats). The rules both share (checks, errors, the search's
step rule, the group layout) come from obskernels.spec; this package never
imports the reference nor the front. Importing it requires triton; obskernels
imports it only when the triton backend is used.
"""

# This folder is installed as obskernels.kernels (pyproject.toml maps it). Run from
# the repository root, it is also visible as a top-level package named plain
# `kernels`: the name of an unrelated package (the hub's kernel loader) that
# transformers probes by importing it.
# Imported under any name but its own it stays empty: no functions, no
# version, and no import of obskernels in the middle of another package's
# import.
if __name__ == "obskernels.kernels":
    import importlib
    import sys
    import types

    from obskernels.kernels import _triton_key
    from obskernels.kernels._layout import INTERPRETED
    from obskernels.kernels.accumulate_sq import accumulate_sq
    from obskernels.kernels.flatten import flatten_for_calibration
    from obskernels.kernels.importance import importance
    from obskernels.kernels.min_max import min_max, min_max_qparams
    from obskernels.kernels.qparams import calculate_qparams
    from obskernels.kernels.stats import combine_statistics

    from obskernels.kernels.accumulate_sq import prepare as _prepare_accumulate_sq
    from obskernels.kernels.importance import prepare as _prepare_importance
    from obskernels.kernels.min_max import prepare as _prepare_min_max
    from obskernels.kernels.min_max import prepare_qparams as _prepare_min_max_qparams
    from obskernels.kernels.qparams import prepare as _prepare_qparams
    from obskernels.kernels.stats import prepare as _prepare_combine

    # The search's kernels (kernels/mse_search.py and mse_search_details/:
    # about a third of this package's import, Triton reading each jit
    # function's source) are imported at their first use: a process that
    # only reduces min / max (an FP8 calibration) never pays for them. The
    # launchers stay attributes of this package: ``mse_search`` is a
    # property of its module class, which also ignores the import system
    # binding the submodule of the same name here at the search's first
    # import (the launcher, as before, is what the name gives); it builds
    # its kernels as the rest of the package was built, see there.
    def _search():
        return importlib.import_module("obskernels.kernels.mse_search")

    def _prepare_mse_search(call):
        return _search().prepare(call)

    def _prepare_mse_search_qparams(call):
        return _search().prepare_qparams(call)

    class _Kernels(types.ModuleType):
        @property
        def mse_search(self):
            return _search().mse_search

        @mse_search.setter
        def mse_search(self, submodule):
            pass  # the import system's binding of kernels/mse_search.py

        @property
        def mse_search_qparams(self):
            return _search().mse_search_qparams

    sys.modules[__name__].__class__ = _Kernels

    #: operation -> ``prepare(call)``: the launch of the call's signature,
    #: made once and kept by obskernels.ops for later calls of that signature
    PREPARE = {
        "min_max": _prepare_min_max,
        "min_max_qparams": _prepare_min_max_qparams,
        "mse_search": _prepare_mse_search,
        "mse_search_qparams": _prepare_mse_search_qparams,
        "calculate_qparams": _prepare_qparams,
        "combine_statistics": _prepare_combine,
        "importance": _prepare_importance,
        "accumulate_sq": _prepare_accumulate_sq,
    }

    # Triton's hash of its installation, made once per installation (not per process)
    _triton_key.install()

    __all__ = ["flatten_for_calibration", "min_max", "mse_search", "accumulate_sq", "calculate_qparams", "combine_statistics",
               "importance", "min_max_qparams", "mse_search_qparams", "PREPARE", "INTERPRETED"]
else:
    __all__ = []
