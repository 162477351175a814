"""What an observer reports: its errors, and the one read of its record.

While observing, an observer reads nothing back: the operations write what
an observation has to report into the observer's device record
(``spec.record``: the NaN / +-inf counts of refused values, whether their
statistics came out non-finite and which observation was first, the
imatrix importance's verdict). ``get_qparams`` carries the record into
``ops.calculate_qparams``, whose status adds the non-finite-scale flags
after it (one word that any program sets where the status started from a
template, as every qparams computed with the observation's do; one per
program where the qparams kernel writes it whole), and reads that status
once (``Report._check_qparams``):

- under ``nonfinite="error"`` (the default) a recorded observation is the
  ValueError naming the observer, the first refused value's shape and dtype
  and every refused value's non-finite counts; the statistics of the
  observations since the last read are dropped (and their tokens);
- a scale that is still not finite after the float64 redo of overflowed
  groups is a ValueError too (statistics kept);
- ``nonfinite="propagate"`` reads nothing (unless a subclass has a verdict
  pending): NaN / inf flow into the qparams, as in llm-compressor.

The same moment on every backend: errors about a value's data come from
``get_qparams``; errors about its shape or device from ``forward``.
"""

from __future__ import annotations

import math

import torch

from obskernels.spec.checks import count_nonfinite, describe_nonfinite
from obskernels.spec.record import STATUS_BAD_STATS, STATUS_FIRST_BAD, STATUS_INIT, STATUS_NAN

__all__ = ["Report", "read_status"]

#: a status longer than this is judged through numpy: written whole by the
#: qparams kernel it holds one non-finite-scale flag per program after the
#: record (454 words for a 14336x4096 weight's in asymmetric groups of
#: 128), and as a Python list those cost the host ~13 us per thousand words
#: on the development CPU (numpy: ~3 us; a short status, as every one made
#: from a template, reads faster as a list)
LIST_READ_MAX = 128


def read_status(status: torch.Tensor) -> tuple:
    """The one read of a status: (its record as a list of ints, whether any
    program flagged a non-finite scale)."""
    n = len(STATUS_INIT)
    if status.numel() <= LIST_READ_MAX:
        words = status.tolist()
        return words[:n], any(words[n:])
    words = status.cpu().numpy()
    return words[:n].tolist(), bool(words[n:].any())


class Report:
    """The reporting half of ``Observer`` (a mixin: ``Observer`` inherits it)."""

    def _describe(self) -> str:
        return f"{type(self).__name__}(base_name={self.base_name!r})"

    # ----------------------------------------------------- at observation

    def _raise_mismatch(self, value, new_shape, held_shape) -> None:
        raise ValueError(
            f"{self._describe()}: this value of shape {tuple(value.shape)} gives "
            f"statistics of shape {tuple(new_shape)}, but the observer holds "
            f"statistics of shape {tuple(held_shape)} from earlier values; expected "
            "the same hidden size on every observation (statistics kept)"
        )

    def _raise_other_device(self, value, held) -> None:
        raise ValueError(
            f"{self._describe()}: this value is on {value.device} but the observer "
            f"holds statistics on {held.device}; expected the same device on every "
            "observation (statistics kept)"
        )

    def _raise_token_positions(self, value, positions: int, held_positions: int) -> None:
        raise ValueError(
            f"{self._describe()}: strategy 'token' keeps one statistic per sequence "
            f"position; this value of shape {tuple(value.shape)} has "
            f"{positions} token positions, but the observer holds statistics for "
            f"{held_positions} positions from earlier values (the hidden size is not the "
            "problem). Observe values of the same sequence length (or of length 1, which "
            "broadcasts as in llm-compressor), or use memoryless_minmax, which keeps only "
            "the latest value (statistics kept)"
        )

    # ------------------------------------------------------- at get_qparams

    def _record_pending(self) -> bool:
        """Whether get_qparams must carry the record into its read: the
        observations since the last read, or a subclass's pending verdict."""
        return bool(self._observations) or self._verdict_pending()

    def _verdict_pending(self) -> bool:
        """Whether a subclass waits for a verdict in the record (default: no)."""
        return False

    def _judge_record(self, record) -> None:
        """What a subclass reads in the record at get_qparams (default: nothing)."""

    def _check_qparams(self, scale: torch.Tensor, status: torch.Tensor) -> None:
        """Never silently non-finite: the errors of ``nonfinite="error"``.

        compressed-tensors' arithmetic runs in the statistics' dtype, so an
        asymmetric range wider than that dtype (bf16 near +-3.3e38, fp16 near
        +-65504: max - min overflows) gives an infinite scale from finite
        statistics; ``calculate_qparams(widen=True)`` recomputes those groups
        (and only those: every other group keeps compressed-tensors' answer
        bit for bit) from float64 statistics, cast back. A scale that is still
        not finite is a ValueError (statistics kept). Before that, an
        observation recorded as non-finite is the ValueError of a refused
        value; its statistics are dropped.
        """
        observations = self._observations
        self.__dict__["_observations"] = []  # (a plain attribute: see Observer.__setattr__)
        if scale.is_meta:
            return
        if self.nonfinite != "error" and not self._verdict_pending():
            return  # nothing to judge: no read
        record, scale_bad = read_status(status)  # the one read
        self._judge_record(record)
        if self.nonfinite != "error":
            return
        if observations and record[STATUS_BAD_STATS]:
            self._raise_recorded(observations, record)
        if scale_bad:
            mn, mx = self.min_vals, self.max_vals
            _, counts = count_nonfinite(scale)
            raise ValueError(
                f"{self._describe()}: the scale holds {counts} (statistics "
                f"[{float(mn.min())}, {float(mx.max())}], {mn.dtype}); expected finite "
                "scales (statistics kept). Pass nonfinite='propagate' to accept them"
            )

    def _raise_recorded(self, observations, record) -> None:
        """The error of a non-finite observation: the first refused value's
        shape and dtype, the NaN / +-inf counts of every refused one. The
        statistics (and the tokens) of the observations since the last
        get_qparams are dropped: the observer starts afresh."""
        shape, dtype, _ = observations[min(record[STATUS_FIRST_BAD], len(observations) - 1)]
        shape = tuple(shape)
        self._num_observed_tokens -= sum(t for _, _, t in observations)
        nan, pos, neg = record[STATUS_NAN:STATUS_NAN + 3]
        counts = describe_nonfinite(nan, pos, neg, math.prod(shape)) if nan + pos + neg else None
        low, high = float(self.min_vals.min()), float(self.max_vals.max())
        self._drop_statistics()
        raise self._nonfinite_error(shape, dtype, counts, low, high, "dropped")

    def _nonfinite_error(self, shape, dtype, counts, low, high, fate) -> ValueError:
        """The error of a refused observation of ``shape`` / ``dtype``: ``counts``
        describes its non-finite elements, None when the value was finite and
        only its statistics (range ``low`` .. ``high``) overflowed; ``fate``:
        what became of the held statistics."""
        what = f"the observed {self.base_name} tensor (shape {shape}, {dtype})"
        if counts is None:
            # finite values, non-finite statistics: the search range overflowed
            expand = getattr(self, "expand", 1.0)
            return ValueError(
                f"{self._describe()}: {what} is finite but its statistics are not: the "
                f"range times expand={expand} overflows {dtype} (statistics "
                f"[{low}, {high}]); observe it in a "
                "wider dtype, or pass nonfinite='propagate' to keep the non-finite statistics "
                f"(statistics {fate})"
            )
        return ValueError(
            f"{self._describe()}: {what} holds {counts}; expected finite values "
            f"(statistics {fate}). Pass the observer kwarg nonfinite='propagate' to "
            "let them propagate into the statistics and scales as llm-compressor does"
        )
