"""An observer's device record: what the kernels write while observing and
the observer reads once, at ``get_qparams``.

Observing reads nothing back to the host (on a GPU every read waits for the
queued kernels), so what an observation has to report travels in a small
int64 tensor on the value's device, ``STATUS_INIT`` long, written by the
operations (``min_max``, ``combine_statistics``, ``importance``) and carried
into ``calculate_qparams``, whose status output the observer reads once:

- ``STATUS_NAN``, ``STATUS_POSINF``, ``STATUS_NEGINF``: NaN, +inf and -inf
  elements counted in refused observations (atomic adds: exact, order-free);
- ``STATUS_BAD_STATS``: set when an observation's statistics came out non-finite;
- ``STATUS_FIRST_BAD``: the index of the first such observation (atomic min;
  its initial value while there is none);
- ``STATUS_IMPORTANCE``: the imatrix importance's verdict, one of the
  ``IMPORTANCE_*`` codes (``IMPORTANCE_OK``: usable), written by the
  importance operation so that the fallback warning costs no read while observing.

Both backends write the same layout; ``spec.checks`` checks a record's type
and shape where an operation takes one.
"""

from __future__ import annotations

import torch

__all__ = [
    "STATUS_NAN",
    "STATUS_POSINF",
    "STATUS_NEGINF",
    "STATUS_BAD_STATS",
    "STATUS_FIRST_BAD",
    "STATUS_IMPORTANCE",
    "STATUS_INIT",
    "IMPORTANCE_OK",
    "IMPORTANCE_NO_DATA",
    "IMPORTANCE_NONFINITE",
    "IMPORTANCE_NEGATIVE",
    "IMPORTANCE_ZEROS",
    "new_record",
]

STATUS_NAN, STATUS_POSINF, STATUS_NEGINF = 0, 1, 2
STATUS_BAD_STATS = 3
STATUS_FIRST_BAD = 4
STATUS_IMPORTANCE = 5
#: a fresh record
STATUS_INIT = (0, 0, 0, 0, 1 << 62, 0)

#: verdicts on an imatrix importance (sums / count), in the order they are checked
IMPORTANCE_OK, IMPORTANCE_NO_DATA, IMPORTANCE_NONFINITE, IMPORTANCE_NEGATIVE, IMPORTANCE_ZEROS = (
    0, 1, 2, 3, 4)


# one fresh record per device, copied (device to device) for every new one:
# building each from the Python tuple would copy host -> device every time
_FRESH: dict = {}


def new_record(device) -> torch.Tensor:
    """A fresh record (``STATUS_INIT``, int64) on ``device``."""
    fresh = _FRESH.get(device)
    if fresh is None:
        fresh = _FRESH[device] = torch.tensor(STATUS_INIT, dtype=torch.int64, device=device)
    return fresh.clone()
