"""Reference MSE shrink-grid search, docs/spec.md §4.

For step i the candidate range is (base_min * p, base_max * p) with
p = 1 - i / grid; each group keeps the candidate of smallest error, and the
search stops after ``patience`` consecutive steps in which no group improved.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from obskernels.reference.flatten import flatten_for_calibration
from obskernels.reference.qparams import calculate_qparams as qparams_of
from obskernels.reference.stats import record
from obskernels.spec.calls import SearchCall, SearchQParamsCall
from obskernels.spec.record import IMPORTANCE_OK, STATUS_IMPORTANCE
from obskernels.spec.layout import Flattening
from obskernels.spec.search import search_args

__all__ = ["mse_search", "mse_search_qparams", "broadcast_importance"]


def broadcast_importance(importance: torch.Tensor, flat: Flattening) -> torch.Tensor:
    """Per-column importance (fp32), broadcast over the weight's rows and
    flattened like it."""
    rows, cols = flat.value.shape
    full = importance.to(torch.float32).unsqueeze(0).expand(rows, cols)
    return flatten_for_calibration(flat.of(full))


def mse_search(call: SearchCall):
    """``call.importance``: per-input-column weights (flavour "imatrix"). With
    ``importance_status`` (an observer's record, ``spec.record.STATUS_INIT``
    layout, as ``importance()`` leaves it) the importance is the raw E[x²] per
    column and the search normalises it, ``importance / (mean + fp32 tiny)``
    as the imatrix observer does, when the record's verdict says it is usable;
    otherwise it searches with uniform weights."""
    flat, importance = call.flat, call.importance
    params = call.params
    patience, grid, norm, expand, flavour = (
        params.patience, params.grid, params.norm, params.expand, params.flavour)
    if call.importance_status is not None:
        if int(call.importance_status[STATUS_IMPORTANCE]) == IMPORTANCE_OK:
            importance = importance / (importance.mean() + torch.finfo(torch.float32).tiny)
        else:
            importance = None
    observed = flatten_for_calibration(flat)
    weights = None if importance is None else broadcast_importance(importance, flat)
    if observed.numel() == 0:  # no groups: nothing to search
        qshape = observed.shape[1:-1]
        return observed.new_empty(qshape), observed.new_empty(qshape)

    qparam_args, token_args = search_args(flat.args)
    base_min = torch.amin(observed, dim=(0, -1)) * expand
    base_max = torch.amax(observed, dim=(0, -1)) * expand
    error_dtype = observed.dtype if flavour == "mse" else torch.float32
    best_error = torch.full_like(
        base_min, torch.finfo(error_dtype).max, dtype=error_dtype
    )
    best_min, best_max = base_min.clone(), base_max.clone()

    stale = 0
    for i in range(params.steps):  # num_steps(maxshrink, grid, flavour)
        p = 1 - i / grid
        cand_min, cand_max = base_min * p, base_max * p
        scale, zero_point = calculate_qparams(cand_min, cand_max, qparam_args, None)
        q = fake_quantize(
            observed, scale.unsqueeze(-1), zero_point.unsqueeze(-1), token_args
        )
        if flavour == "mse":
            # every step in the observed dtype: bf16 stays bf16, the sum too
            err = torch.sum((q.to(observed.dtype) - observed).abs().pow(norm), dim=(0, -1))
        else:
            diff = (q.float() - observed.float()).abs().pow(norm)
            if weights is not None:
                diff = diff * weights
            err = diff.sum(dim=(0, -1))

        improved = err < best_error
        if bool(improved.any()):
            best_error[improved] = err[improved]
            best_min[improved] = cand_min[improved]
            best_max[improved] = cand_max[improved]
            stale = 0
        else:
            stale += 1
            if flavour == "mse" and stale >= patience:
                break
            if flavour == "imatrix" and patience > 0 and stale >= patience:
                break
    if call.status is not None:
        record(call.status, flat.value, best_min, best_max, call.observation)
    return best_min, best_max


def mse_search_qparams(call: SearchQParamsCall):
    """(min_vals, max_vals, scale, zero_point, global_scale, status):
    ``mse_search``, then ``calculate_qparams(widen=call.widen)`` carrying the value's
    record, for TENSOR_GROUP with the statistics' own global scale
    (``call.qparams_of``)."""
    return call.by_parts(mse_search, qparams_of)
