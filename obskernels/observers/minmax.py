"""Min/max observers: the range is the observed per-group min and max."""

from __future__ import annotations

import torch
import torch.distributed as dist

from obskernels import ops
from obskernels.observers.base import MinMaxTuple, Observer, check_averaging_constant

__all__ = ["MemorylessMinMaxObserver", "StaticMinMaxObserver", "MinMaxObserver"]


@Observer.register("memoryless_minmax")
class MemorylessMinMaxObserver(Observer):
    """min_vals / max_vals of the latest value only."""

    _act_sync_dict = {}
    _qparams_ahead = True

    def _measure(self, value: torch.Tensor, g_idx=None, status=None, observation=0) -> MinMaxTuple:
        return ops.min_max(value, self.base_name, self.args, g_idx=g_idx, status=status,
                           observation=observation)

    def _measure_with_qparams(self, value, g_idx, record: bool):
        return ops.min_max_qparams(value, self.base_name, self.args, g_idx, record=record)

    def _measure_combined(self, value, g_idx, held, c, status, observation) -> MinMaxTuple:
        # one operation: min_max's epilogue combines (into the held statistics)
        # and records; a forward repeated in place goes straight to its plan
        # (ops.Repeat, kept while the statistics are)
        repeat = None
        if held is not None:
            repeat = self.__dict__.get("_repeat")
            if repeat is None:
                repeat = self.__dict__["_repeat"] = ops.Repeat()
        return ops.min_max(value, self.base_name, self.args, g_idx=g_idx, held=held,
                           averaging_constant=c, status=status, observation=observation,
                           out=held, repeat=repeat)


@Observer.register("static_minmax")
class StaticMinMaxObserver(MemorylessMinMaxObserver):
    """Running min of the mins and max of the maxes over every value seen."""

    _act_sync_dict = {"min_vals": dist.ReduceOp.MIN, "max_vals": dist.ReduceOp.MAX}

    def _combine_rule(self):
        held = (self.min_vals, self.max_vals) if self.has_statistics else None
        return held, None


class MovingAverageMixin:
    """``old * (1 - c) + new * c``; the first value is taken as is, c == 1.0 replaces.

    ``c`` is ``averaging_constant`` (default 0.01).
    """

    def _init_moving_average(self) -> None:
        # a plain attribute (nn.Module.__setattr__ would cost seven calls)
        self.__dict__["avg_constant"] = check_averaging_constant(
            self.args.observer_kwargs.get("averaging_constant", 0.01)
        )

    def _combine_rule(self):
        if self.has_statistics and self.avg_constant != 1.0:
            return (self.min_vals, self.max_vals), self.avg_constant
        return None, None


@Observer.register("minmax")
class MinMaxObserver(MovingAverageMixin, MemorylessMinMaxObserver):
    """Moving average of each value's min / max."""

    _act_sync_dict = {"min_vals": dist.ReduceOp.AVG, "max_vals": dist.ReduceOp.AVG}

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        self._init_moving_average()
