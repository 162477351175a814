"""All-reduce of observer statistics across DDP ranks, safe when ranks differ.

``Observer.sync_activation_stats`` calls :func:`sync_statistics`. What it
guarantees, for the statistics named in ``_act_sync_dict``:

- Every rank joins every collective, whether or not it holds the statistic
  (an expert that no token was routed to holds none): skipping the all-reduce
  on one rank would hang the others.
- A rank without the statistic contributes the identity of the reduction
  (+inf for MIN, -inf for MAX, 0 for SUM) and receives the result, so after
  the sync every rank holds the same statistics.
- AVG is the mean over the ranks that hold the statistic: each of the n such
  ranks divides by n and the contributions are summed (a rank that observed
  nothing has weight 0, it does not drag the mean towards 0). With n a power
  of two the division is exact; NCCL's native AVG is used only when every
  rank holds the statistic.
- Syncing again with no observation anywhere in between changes nothing
  (bit for bit: the all-reduce is skipped). For SUM statistics accumulated
  in place (imatrix's x**2 sums and token counts), a later sync adds only what
  each rank accumulated since the previous one, so nothing is counted twice
  (that delta is the value minus a copy taken when the previous sync was
  waited on: counts stay exact, fp32 sums within fp32 rounding; a statistic
  replaced by a new tensor since, e.g. after re-attaching, counts as new).
  MIN / MAX are idempotent by nature; AVG averages the ranks' current values.
- Ranks holding statistics of different shapes, dtypes or device types raise
  the same ValueError on every rank (no hang, no silent broadcast).

Cost per observer: one small blocking all_gather of headers (a few int64 per
statistic), then one async all_reduce per statistic that needs one.

Failing ranks: every collective is waited on with a timeout (``sync_timeout``,
else the environment variable OBSKERNELS_SYNC_TIMEOUT in seconds, else the
process group's own timeout). A rank that exited before a sync (its peers see
the connection close) or hangs (they see the timeout pass) makes the others
raise ``DistributedSyncError`` naming the observer (class, base_name), the
collective (the header all_gather, or the all_reduce of which statistic with
which op), this rank and the timeout: never a silent hang. The process group
is not usable after that error (its ranks are out of step): destroy it.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import math
import os
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "sync_statistics",
    "SyncHandle",
    "DistributedSyncError",
    "sync_timeout",
    "get_sync_timeout",
    "TIMEOUT_ENV",
]

TIMEOUT_ENV = "OBSKERNELS_SYNC_TIMEOUT"
_timeout: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar(
    "obskernels_sync_timeout", default=None
)


class DistributedSyncError(RuntimeError):
    """A collective of a statistics sync failed or did not complete in time
    (a rank exited or hangs). The process group is unusable afterwards."""


def _check_timeout(seconds, what: str) -> Optional[float]:
    if seconds is None:
        return None
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds > 0, got {seconds!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a number of seconds > 0, got {seconds!r}")
    return value


def get_sync_timeout() -> Optional[float]:
    """Seconds a sync waits for each collective: the innermost ``sync_timeout``
    block of this thread / task, else OBSKERNELS_SYNC_TIMEOUT, else None (the
    process group's own timeout)."""
    scoped = _timeout.get()
    if scoped is not None:
        return scoped
    env = os.environ.get(TIMEOUT_ENV, "").strip()
    return _check_timeout(env, TIMEOUT_ENV) if env else None


@contextlib.contextmanager
def sync_timeout(seconds: float) -> Iterator[None]:
    """Bound every collective of the syncs run in the block (this thread /
    async task only) to ``seconds``; a rank that exited or hangs then raises
    ``DistributedSyncError`` on the others within about that time."""
    token = _timeout.set(_check_timeout(seconds, "sync_timeout"))
    try:
        yield
    finally:
        _timeout.reset(token)


def _observer_label(observer) -> str:
    return f"{type(observer).__name__}(base_name={getattr(observer, 'base_name', '?')!r})"


def _wait(work, timeout: Optional[float], observer, collective: str) -> None:
    """``work.wait`` bounded by ``timeout``; a failure names what was waited for."""
    t0 = time.monotonic()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        world = dist.get_world_size() if dist.is_initialized() else "?"
        limit = f"timeout {timeout:g} s" if timeout is not None else "the process group's timeout"
        raise DistributedSyncError(
            f"sync_activation_stats: {_observer_label(observer)}: {collective} failed on rank "
            f"{rank} of {world} after {time.monotonic() - t0:.1f} s ({limit}): another rank "
            f"exited or hangs, or the ranks do not sync the same observers in the same order. "
            f"The process group is out of step now; destroy it. Cause: "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from exc

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_DEVICES = ("cpu", "cuda")
_MAX_DIMS = 6
# header per statistic: present, dtype, device type, ndim, dims..., clean, has_base
_H_PRESENT, _H_DTYPE, _H_DEVICE, _H_NDIM, _H_DIMS = 0, 1, 2, 3, 4
_H_CLEAN = _H_DIMS + _MAX_DIMS
_H_BASE = _H_CLEAN + 1
_H_LEN = _H_BASE + 1
_SHAPE_FIELDS = slice(_H_DTYPE, _H_CLEAN)

#: attribute on the observer: statistic name -> (tensor synced, copy of its value then)
SNAPSHOTS = "_sync_snapshots"


class SyncHandle:
    """An all-reduce in flight. ``wait()`` waits for it (bounded by the sync's
    timeout; ``DistributedSyncError`` when it fails or times out), then records
    the synced value (so a later sync knows what is new); also
    ``is_completed()`` and ``get_future()`` of the underlying ``dist.Work``."""

    def __init__(self, work, on_done: Callable[[], None], observer=None, collective: str = "all_reduce",
                 timeout: Optional[float] = None):
        self._work = work
        self._on_done: Optional[Callable[[], None]] = on_done
        self._observer = observer
        self._collective = collective
        self._timeout = timeout

    def wait(self, *args) -> bool:
        if args:  # an explicit dist.Work.wait(timeout) argument
            timeout = args[0].total_seconds() if isinstance(args[0], datetime.timedelta) else args[0]
        else:
            timeout = self._timeout
        _wait(self._work, timeout, self._observer, self._collective)
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


def _snapshots(observer) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    snaps = observer.__dict__.get(SNAPSHOTS)
    if snaps is None:
        snaps = {}
        object.__setattr__(observer, SNAPSHOTS, snaps)
    return snaps


def _header(value: Optional[torch.Tensor], snap) -> torch.Tensor:
    h = torch.zeros(_H_LEN, dtype=torch.int64)
    if value is None:
        return h
    h[_H_PRESENT] = 1
    if value.dtype not in _DTYPES or value.device.type not in _DEVICES or value.dim() > _MAX_DIMS:
        # reported after the gather, on every rank (raising here would leave
        # this rank out of the collective and hang the others)
        h[_H_DTYPE] = -1
        return h
    h[_H_DTYPE] = _DTYPES.index(value.dtype)
    h[_H_DEVICE] = _DEVICES.index(value.device.type)
    h[_H_NDIM] = value.dim()
    h[_H_DIMS:_H_DIMS + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    same_tensor = snap is not None and snap[0] is value
    h[_H_BASE] = int(same_tensor)
    h[_H_CLEAN] = int(same_tensor and torch.equal(value, snap[1]))
    return h


def _describe(headers: torch.Tensor, rank: int) -> str:  # headers of one statistic
    h = headers[rank]
    shape = tuple(int(d) for d in h[_H_DIMS:_H_DIMS + int(h[_H_NDIM])])
    return f"rank {rank}: {shape} {_DTYPES[int(h[_H_DTYPE])]} on {_DEVICES[int(h[_H_DEVICE])]}"


def _identity(op, dtype: torch.dtype) -> float:
    if op == dist.ReduceOp.MIN:
        return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max
    if op == dist.ReduceOp.MAX:
        return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min
    return 0


def _op_name(op) -> str:
    for name in ("SUM", "MIN", "MAX", "AVG", "PRODUCT"):
        if op == getattr(dist.ReduceOp, name, None):
            return name
    return str(op)


def _comm_device() -> torch.device:
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_statistics(observer, sync_dict, timeout: Optional[float] = None) -> List[SyncHandle]:
    """All-reduce ``observer``'s statistics named in ``sync_dict`` (name -> ReduceOp)
    across the default process group; see the module docstring. Returns handles
    to wait on before reading the statistics. ``timeout`` (seconds) bounds each
    collective; None: ``get_sync_timeout()``."""
    timeout = _check_timeout(timeout, "timeout") if timeout is not None else get_sync_timeout()
    names = list(sync_dict)
    world = dist.get_world_size()
    if not names or world == 1:
        return []  # nothing to exchange: a group of one is no group
    rank = dist.get_rank()
    snaps = _snapshots(observer)
    values = [getattr(observer, n, None) for n in names]
    local = torch.stack([_header(v, snaps.get(n)) for n, v in zip(names, values)])

    device = _comm_device()
    gathered = [torch.empty_like(local, device=device) for _ in range(world)]
    work = dist.all_gather(gathered, local.to(device), async_op=True)
    _wait(work, timeout, observer, f"all_gather of the statistic headers ({', '.join(names)})")
    headers = torch.stack([g.cpu() for g in gathered])  # (world, names, H)

    # decide everything from the headers first (every rank decides the same),
    # so an error leaves no collective half launched
    plan = []
    for i, name in enumerate(names):
        op = sync_dict[name]
        h = headers[:, i]
        present = h[:, _H_PRESENT].bool()
        if not bool(present.any()):
            continue
        ranks = present.nonzero().flatten().tolist()
        if bool((h[ranks, _H_DTYPE] < 0).any()):
            raise ValueError(
                f"sync_activation_stats: {type(observer).__name__}.{name} cannot be synced on "
                f"rank(s) {[r for r in ranks if int(h[r, _H_DTYPE]) < 0]}; expected one of "
                f"{[str(d) for d in _DTYPES]} on cpu or cuda with at most {_MAX_DIMS} dims"
            )
        first = h[ranks[0]]
        if any(not torch.equal(h[r, _SHAPE_FIELDS], first[_SHAPE_FIELDS]) for r in ranks):
            raise ValueError(
                f"sync_activation_stats: {type(observer).__name__}.{name} differs across "
                f"ranks ({'; '.join(_describe(h, r) for r in ranks)}); expected the same "
                "shape, dtype and device type on every rank that holds it"
            )
        if bool(present.all()) and bool(h[:, _H_CLEAN].all()):
            continue  # nobody observed anything since the last sync
        if op not in (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.AVG) \
                and len(ranks) != world:
            raise ValueError(
                f"sync_activation_stats: {type(observer).__name__}.{name} uses {op}, "
                "which has no identity here: every rank must hold it"
            )
        plan.append((name, values[i], op, h, ranks))

    native_avg = dist.get_backend() == "nccl"
    handles: List[SyncHandle] = []
    for name, value, op, h, ranks in plan:
        first = h[ranks[0]]
        split_avg = op == dist.ReduceOp.AVG and not (native_avg and len(ranks) == world)
        if value is None:
            shape = tuple(int(d) for d in first[_H_DIMS:_H_DIMS + int(first[_H_NDIM])])
            dtype = _DTYPES[int(first[_H_DTYPE])]
            dev = torch.device("cpu") if int(first[_H_DEVICE]) == 0 else _comm_device()
            value = torch.full(shape, _identity(op, dtype), dtype=dtype, device=dev)
            setattr(observer, name, value)
        elif op == dist.ReduceOp.SUM:
            # ranks holding the previous sync's total contribute only what they
            # added since; the lowest of them also contributes that total, once
            holders = h[:, _H_BASE].nonzero().flatten().tolist()
            if bool(h[rank, _H_BASE]) and rank != holders[0]:
                value.sub_(snaps[name][1])
        elif split_avg:
            value.div_(len(ranks))  # weight 1/n for each of the n holders, 0 elsewhere

        def record(name=name, value=value):
            snaps[name] = (value, value.clone())

        reduce_op = dist.ReduceOp.SUM if split_avg else op
        work = dist.all_reduce(value, op=reduce_op, async_op=True)
        handles.append(SyncHandle(work, record, observer, f"all_reduce({_op_name(reduce_op)}) of {name}",
                                  timeout))
    return handles
