"""imatrix_mse: the shrink-grid search weighted by per-input-channel importance.

A forward-pre hook on the observed Linear accumulates, per input channel, the
sum over tokens of x**2 (fp32) and the token count (``ops.accumulate_sq``).
When the weight is observed, importance = (sum / count) / (mean + fp32 tiny)
weights each column's error in the search (docs/spec.md §1, flavour
"imatrix" of docs/spec.md §4).

The observation reads nothing back, on every backend: ``ops.importance``
computes sum / count and its verdict (usable, or why not) on the device,
the search normalises the importance as it loads it and searches with
uniform weights where the verdict says so, and the fallback warning (or the
strict error) of a verdict comes at ``get_qparams``, from its one read. The
reasons that need no value (a non-weight observer, the TENSOR strategy, no
sums at all) are reported while observing. ``_fallback_reasons`` states the
whole order once.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from compressed_tensors.quantization import QuantizationStrategy as Strategy

from obskernels import ops
from obskernels.observers.base import MinMaxTuple, Observer, hook_input
from obskernels.observers.mse import SearchKwargsMixin
from obskernels.spec.record import (
    IMPORTANCE_NEGATIVE,
    IMPORTANCE_NO_DATA,
    IMPORTANCE_NONFINITE,
    IMPORTANCE_ZEROS,
    STATUS_IMPORTANCE,
)
from obskernels.spec.search import IMATRIX_DEFAULTS, NVFP4_EXPANDED

__all__ = ["IMatrixMSEObserver", "ImportanceFallbackWarning", "NVFP4ExpandedIMatrixObserver"]

_IMPORTANCE_STRATEGIES = (Strategy.CHANNEL, Strategy.GROUP, Strategy.TENSOR_GROUP)


_NO_DATA = (ValueError, "no importance data (attach and run a forward first)")
#: the fallback of each verdict of ops.importance (IMPORTANCE_OK: none)
_VERDICTS = {
    IMPORTANCE_NO_DATA: _NO_DATA,
    IMPORTANCE_NONFINITE: (ValueError, "importance has non-finite values"),
    IMPORTANCE_NEGATIVE: (ValueError, "importance has negative values"),
    IMPORTANCE_ZEROS: (ValueError, "importance is all zeros"),
}


def _unpublish(module: torch.nn.Module) -> None:
    for name in ("_imatrix_sum", "_imatrix_count"):
        if name in module.__dict__:
            delattr(module, name)


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
    _search_defaults = dict(IMATRIX_DEFAULTS)

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_search()
        strict = self.args.observer_kwargs.get("strict", False)
        if not isinstance(strict, bool):
            raise TypeError(f"observer kwarg 'strict' must be a bool, got {strict!r}")
        # plain attributes, set in one go (nn.Module.__setattr__ costs a call each)
        self.__dict__.update(
            strict=strict,
            _imatrix_features=None,  # Optional[int]
            _imatrix_sum=None,  # Optional[torch.Tensor]
            _imatrix_count=torch.zeros((), dtype=torch.int64),
            _imatrix_hook=None,
            _imatrix_module=None,  # Optional[weakref.ref]
            # the fallback to report once get_qparams has read the verdict of
            # the observed importance; (None, None) when only a failing verdict
            # makes one (None: nothing pending)
            _importance_pending=None,
        )

    # ---------------------------------------------------------------- hooks
    #
    # The running sums are published on the hooked module as ``_imatrix_sum``
    # (fp32, one per input channel) and ``_imatrix_count`` (int64 tokens): the
    # observer and the module hold the same tensors, updated in place. So a
    # first pass can gather importance and a later observer, attached to the
    # same module, picks it up (llm-compressor's two-pass imatrix flow):
    #
    #   attach  - the module already holds ``_imatrix_sum``: take the sums over
    #             (they leave the module) and register no hook; otherwise start
    #             zero sums, publish them and register the forward-pre hook.
    #   detach  - remove the hook; sums not yet used stay on the module.
    #   get_qparams uses the sums: they leave the observer and the module.

    def attach(self, module: torch.nn.Module) -> None:
        """Take over sums left on ``module`` by an earlier pass, or register the
        E[x**2] hook on a module with ``in_features`` (else nothing)."""
        self._remove_hook()
        held = getattr(module, "_imatrix_sum", None)
        if isinstance(held, torch.Tensor) and held is not self._imatrix_sum:
            count = getattr(module, "_imatrix_count", None)
            if not isinstance(count, torch.Tensor):
                count = torch.tensor(0 if count is None else int(count), dtype=torch.int64)
            self._imatrix_sum = held
            self._imatrix_count = count.to(device=held.device, dtype=torch.int64).reshape(())
            self._imatrix_features = held.numel()
            _unpublish(module)
            self._imatrix_module = None
            return
        in_features = getattr(module, "in_features", None)
        if not isinstance(in_features, int):
            return
        param = next(module.parameters(), None)
        device = param.device if param is not None else None
        self._imatrix_features = in_features
        self._reset_importance(device)
        self._imatrix_module = weakref.ref(module)
        self._publish()
        self._imatrix_hook = module.register_forward_pre_hook(self._imatrix_pre_hook)

    def detach(self, module: torch.nn.Module) -> None:
        """Remove the hook; sums not used yet stay on the module for a later
        observer's ``attach``."""
        self._remove_hook()
        if self._imatrix_sum is not None and self._hooked_module() is module:
            self._publish()  # the latest tensors (a DDP sync may have replaced them)

    def _remove_hook(self) -> None:
        if self._imatrix_hook is not None:
            self._imatrix_hook.remove()
            self._imatrix_hook = None

    def _hooked_module(self) -> Optional[torch.nn.Module]:
        ref = getattr(self, "_imatrix_module", None)
        return ref() if ref is not None else None

    def _publish(self) -> None:
        module = self._hooked_module()
        if module is not None and self._imatrix_sum is not None:
            module._imatrix_sum = self._imatrix_sum
            module._imatrix_count = self._imatrix_count

    def _reset_importance(self, device=None) -> None:
        self._imatrix_sum = torch.zeros(self._imatrix_features, dtype=torch.float32, device=device)
        self._imatrix_count = torch.zeros((), dtype=torch.int64, device=device)

    def _imatrix_pre_hook(self, module, args) -> None:
        x = hook_input(args)
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return
        if self._imatrix_sum is None or self._imatrix_count is None:
            self._reset_importance(x.device)
            self._publish()
        elif self._imatrix_sum.device != x.device:
            self._imatrix_sum = self._imatrix_sum.to(x.device)
            self._imatrix_count = self._imatrix_count.to(x.device)
            self._publish()
        ops.accumulate_sq(x.detach(), self._imatrix_sum, self._imatrix_count)

    # ------------------------------------------------------------ statistics

    def _measure(self, value: torch.Tensor, g_idx=None, status=None, observation=0) -> MinMaxTuple:
        """The search with the importance, reading nothing: the reasons
        known without values are reported now; ``ops.importance`` writes the
        values' verdict into the record, which the search follows and
        get_qparams reads (``_judge_record``)."""
        self._importance_pending = None
        rec = dict(status=status, observation=observation)  # the value's non-finite record
        now, later = self._fallback_reasons(value)
        if now is not None:
            self._fallback(*now)
            return self._search(value, "imatrix", g_idx, **rec)
        sums, count = self._imatrix_sum, self._imatrix_count
        if sums.device != value.device or count.device != value.device:
            # importance gathered on another device than the weight's
            sums, count = sums.to(value.device), count.to(value.device)
        verdicts = self._record(value.device)
        imp = ops.importance(sums, count, verdicts)
        # reported once the values passed: (None, None) reports only a failing verdict
        self._importance_pending = later if later is not None else (None, None)
        if later is not None:
            return self._search(value, "imatrix", g_idx, **rec)
        return self._search(value, "imatrix", g_idx, importance=imp, importance_status=verdicts,
                            **rec)

    def _fallback_reasons(self, value: torch.Tensor):
        """(now, later): why the search falls back to uniform weights, as
        (error, reason) pairs, in llm-compressor's order of checks:

        1. a non-weight observer, 2. the TENSOR strategy, 3. no sums at all
           (``now``: known without reading a value);
        4. the importance's values, judged on the device by ``ops.importance``
           (no tokens, non-finite, negative, all zeros: ``_VERDICTS``);
        5. a strategy other than CHANNEL / GROUP / TENSOR_GROUP, 6. a size
           that does not match the weight's columns (``later``: reported
           only when the values passed, since 4 comes first).
        """
        if not self.is_weight_obs:
            return (NotImplementedError, "only weight observers use importance"), None
        strategy = Strategy(self.args.strategy)
        if strategy == Strategy.TENSOR:
            return (NotImplementedError, "strategy 'tensor' does not use importance"), None
        if self._imatrix_sum is None or self._imatrix_count is None:
            return _NO_DATA, None
        if strategy not in _IMPORTANCE_STRATEGIES:
            return None, (NotImplementedError, f"strategy {strategy.value!r} does not use importance")
        channels, cols = self._imatrix_sum.numel(), value.shape[-1]
        if channels != cols:
            return None, (ValueError, f"importance has {channels} channels, the weight {cols} columns")
        return None, None

    def _verdict_pending(self) -> bool:
        return self._importance_pending is not None

    def _judge_record(self, record) -> None:
        """get_qparams read the record: the fallback of this observation's
        verdict (a failing verdict first, then a pending strategy / size reason)."""
        pending, self._importance_pending = self._importance_pending, None
        if pending is None:
            return
        error, reason = _VERDICTS.get(record[STATUS_IMPORTANCE], pending)
        if reason is None:
            return
        if self.strict:
            self._drop_statistics()
        self._fallback(error, reason, stacklevel=6)

    def _drop_statistics(self) -> None:
        super()._drop_statistics()
        # the importance belongs to this weight's calibration: it goes too (and
        # is skipped by sync_activation_stats), from the module as well; the
        # hook starts afresh
        self._imatrix_sum = None
        self._imatrix_count = None
        self._importance_pending = None
        module = self._hooked_module()
        if module is not None:
            _unpublish(module)

    def _fallback(self, error: type, reason: str, stacklevel: int = 4) -> None:
        message = f"imatrix_mse: {reason}"
        if self.strict:
            raise error(message)
        warnings.warn(
            f"{message}; falling back to uniform weights", ImportanceFallbackWarning,
            stacklevel=stacklevel,
        )
        return None


@Observer.register("nvfp4_expanded_imatrix")
class NVFP4ExpandedIMatrixObserver(IMatrixMSEObserver):
    """``imatrix_mse`` searching from 1.8x the range down to about 0.8x, as
    ``nvfp4_expanded_mse`` does without importance.

    Defaults (llm-compressor 0.14.0.1's): expand 1.8, maxshrink 1 - 0.8/1.8,
    grid 200, patience 1000, norm 2.4 (not imatrix_mse's 3.0), strict False.
    """

    _search_defaults = {**IMatrixMSEObserver._search_defaults, **NVFP4_EXPANDED}
