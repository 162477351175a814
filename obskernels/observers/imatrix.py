"""imatrix_mse: the shrink-grid search weighted by per-input-channel importance.

A forward-pre hook on the observed Linear accumulates, per input channel, the
sum over tokens of x**2 (fp32) and the token count. When the weight is
observed, importance = (sum / count) / (mean + fp32 tiny) weights each
column's error in the search (docs/spec.md §1, flavour "imatrix" of docs/spec.md §4).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from compressed_tensors.quantization import QuantizationStrategy as S

from obskernels import ops
from obskernels.observers.base import MinMaxTuple, Observer
from obskernels.observers.mse import SearchKwargsMixin

__all__ = ["IMatrixMSEObserver", "ImportanceFallbackWarning"]

_IMPORTANCE_STRATEGIES = (S.CHANNEL, S.GROUP, S.TENSOR_GROUP)


class ImportanceFallbackWarning(UserWarning):
    """imatrix_mse searched with uniform weights because importance was unusable."""


@Observer.register("imatrix_mse")
class IMatrixMSEObserver(SearchKwargsMixin, Observer):
    """MSE search weighted by E[x**2] of the module's inputs.

    Kwargs: maxshrink 0.95, patience 5, grid 20, norm 3.0, expand 1.0,
    chunk_size 5, strict False. Falls back to uniform weights, with one
    ImportanceFallbackWarning per observation (or an error when ``strict``), for:
    a non-weight observer or a TENSOR / BLOCK strategy (NotImplementedError
    when strict), and no data, non-finite, negative or all-zero importance, or
    a size that does not match the weight's columns (ValueError when strict).
    """

    _act_sync_dict = {
        "_imatrix_sum": dist.ReduceOp.SUM,
        "_imatrix_count": dist.ReduceOp.SUM,
    }
    _search_defaults = {
        "maxshrink": 0.95,
        "patience": 5,
        "grid": 20,
        "norm": 3.0,
        "expand": 1.0,
        "chunk_size": 5,
    }

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_search()
        strict = self.args.observer_kwargs.get("strict", False)
        if not isinstance(strict, bool):
            raise TypeError(f"observer kwarg 'strict' must be a bool, got {strict!r}")
        self.strict = strict
        self._imatrix_features: Optional[int] = None
        self._imatrix_sum: Optional[torch.Tensor] = None
        self._imatrix_count = torch.zeros((), dtype=torch.int64)
        self._imatrix_hook = None

    # ---------------------------------------------------------------- hooks

    def attach(self, module: torch.nn.Module) -> None:
        """Register the E[x**2] hook on a module with ``in_features`` (else nothing)."""
        self.detach(module)
        in_features = getattr(module, "in_features", None)
        if not isinstance(in_features, int):
            return
        param = next(module.parameters(), None)
        device = param.device if param is not None else None
        self._imatrix_features = in_features
        self._reset_importance(device)
        self._imatrix_hook = module.register_forward_pre_hook(self._imatrix_pre_hook)

    def detach(self, module: torch.nn.Module) -> None:
        """Remove the hook (the accumulated sums stay until get_qparams)."""
        if self._imatrix_hook is not None:
            self._imatrix_hook.remove()
            self._imatrix_hook = None

    def _reset_importance(self, device=None) -> None:
        self._imatrix_sum = torch.zeros(self._imatrix_features, dtype=torch.float32, device=device)
        self._imatrix_count = torch.zeros((), dtype=torch.int64, device=device)

    def _imatrix_pre_hook(self, module, args) -> None:
        x = args[0] if isinstance(args, tuple) and args else args
        if isinstance(x, tuple):
            x = x[0] if x else None
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return
        if self._imatrix_sum is None or self._imatrix_count is None:
            self._reset_importance(x.device)
        elif self._imatrix_sum.device != x.device:
            self._imatrix_sum = self._imatrix_sum.to(x.device)
            self._imatrix_count = self._imatrix_count.to(x.device)
        ops.accumulate_sq(x.detach(), self._imatrix_sum, self._imatrix_count)

    # ------------------------------------------------------------ statistics

    def _measure(self, value: torch.Tensor) -> MinMaxTuple:
        return self._search(value, "imatrix", importance=self._importance_for(value))

    def _drop_statistics(self) -> None:
        super()._drop_statistics()
        # the importance belongs to this weight's calibration: it goes too (and
        # is skipped by sync_activation_stats); the hook starts afresh
        self._imatrix_sum = None
        self._imatrix_count = None

    def _importance_for(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        """Normalised per-column importance for ``value``, or None (uniform)."""
        if not self.is_weight_obs:
            return self._fallback(NotImplementedError, "only weight observers use importance")
        # the order of these checks (and so which one reports) follows llm-compressor
        strategy = S(self.args.strategy)
        if strategy == S.TENSOR:
            return self._fallback(NotImplementedError, "strategy 'tensor' does not use importance")
        if self._imatrix_sum is None or self._imatrix_count is None:
            return self._fallback(ValueError, "no importance data (attach and run a forward first)")
        count = self._imatrix_count.to(torch.float32)
        imp = self._imatrix_sum / count
        # Every check below from ONE read of (count, min, max): no tokens is a
        # zero count (fp32 of a non-zero count is not 0); aminmax propagates
        # NaN, so min and max are finite exactly when every entry is; with no
        # negative entry, "all zeros" is max == 0.
        if imp.numel():
            stats = torch.stack((count.reshape(()), *torch.aminmax(imp)))
            n, lo, hi = stats.tolist()
        else:
            n, lo, hi = float(count), 0.0, 0.0
        if n == 0:
            return self._fallback(ValueError, "no importance data (attach and run a forward first)")
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return self._fallback(ValueError, "importance has non-finite values")
        if lo < 0:
            return self._fallback(ValueError, "importance has negative values")
        if hi == 0:
            return self._fallback(ValueError, "importance is all zeros")
        if strategy not in _IMPORTANCE_STRATEGIES:
            return self._fallback(
                NotImplementedError, f"strategy {strategy.value!r} does not use importance"
            )
        cols = value.shape[-1]
        if imp.numel() != cols:
            return self._fallback(
                ValueError, f"importance has {imp.numel()} channels, the weight {cols} columns"
            )
        imp = imp.to(device=value.device, dtype=torch.float32)
        return imp / (imp.mean() + torch.finfo(torch.float32).tiny)

    def _fallback(self, error: type, reason: str) -> None:
        message = f"imatrix_mse: {reason}"
        if self.strict:
            raise error(message)
        warnings.warn(
            f"{message}; falling back to uniform weights", ImportanceFallbackWarning, stacklevel=4
        )
        return None
