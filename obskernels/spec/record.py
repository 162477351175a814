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

A record, and a status that a launch counts into, starts as a copy of a
template (``fresh_copy``). A CUDA one is taken from a chunk of
pre-initialised copies (``StatusPool``): one allocation and one device copy
per chunk of up to 256, where a ``template.clone()`` is an allocation and a
device copy issued before each launch, on the path an idle GPU waits on
(5-25 us of a min/max observer call on an H200's host, measured).
``OBSKERNELS_STATUS_POOL=0`` (read at import; ``POOL_ENABLED``) clones every
one instead; a CPU one is always a clone. The templates (``template_of``)
are kept for the process: a CUDA graph that captured a copy of one (a clone,
while its stream captures) reads it again at every replay, whatever became
of the launch plan that asked for it.
"""

from __future__ import annotations

import os

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
    "template_of",
    "zero_tickets",
    "fresh_copy",
    "StatusPool",
    "POOL_ENABLED",
    "current_cuda_device",
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


#: (words, device) -> the template holding them, kept for the process
_TEMPLATES: dict = {}


def template_of(words: tuple, device) -> torch.Tensor:
    """The int64 tensor of ``words`` on ``device`` that ``fresh_copy`` copies
    from (a fresh record, a status with its flags and tickets, zeroed
    tickets): made once per process and kept, never written."""
    key = (tuple(words), torch.device(device))
    kept = _TEMPLATES.get(key)
    if kept is None:  # (setdefault: two threads making one both get the kept one)
        kept = _TEMPLATES.setdefault(key, torch.tensor(key[0], dtype=torch.int64, device=device))
    return kept


def zero_tickets(n: int, device) -> torch.Tensor:
    """A template of at least ``n`` zeroed tickets, as many as the next power
    of two: a launch counts in the first ``n`` only, and a few kept templates
    serve every size (a split's blocks can follow a varying token count)."""
    return template_of((0,) * (1 << max(n - 1, 0).bit_length()), device)


# the fresh record's template per device as the callers name it, looked up
# without ``template_of``'s key (the words' tuple and a torch.device made per
# call): a new record is taken at every get_qparams that recorded something
_FRESH: dict = {}


def new_record(device) -> torch.Tensor:
    """A fresh record (``STATUS_INIT``, int64) on ``device``."""
    fresh = _FRESH.get(device)
    if fresh is None:
        fresh = _FRESH[device] = template_of(STATUS_INIT, device)
    return fresh_copy(fresh)


#: CUDA records and statuses taken from pre-initialised chunks (the module docstring)
POOL_ENABLED = os.environ.get("OBSKERNELS_STATUS_POOL", "1") != "0"
#: copies per chunk, and the most bytes a chunk takes (a status with a ticket
#: per program is long: fewer copies per chunk, down to one)
POOL_SLOTS = 256
POOL_CHUNK_BYTES = 64 << 10
#: templates pooled at once before the pool starts afresh
POOL_TEMPLATES = 256


class StatusPool:
    """Fresh copies of templates, taken from chunks made ahead.

    ``take(template)``: a contiguous tensor holding the template's words,
    one of a chunk of copies made at once (one allocation and one device
    copy per chunk), each copy 16-byte aligned as an allocation is (a
    launch's specialisation is unchanged) and written by nobody before it is
    taken. A chunk serves one template on one stream (``stream(device)``:
    its identity): it is made by a copy on that stream, so the launches of
    that stream that count into its copies come after that copy. Where
    ``unpooled(device)`` says so (a stream capturing a CUDA graph, whose
    replays must re-initialise what they count into: a copy outside the
    graph would be initialised once), ``template.clone()``. The copies are
    views of their chunk and share its version counter: a torch op writing
    one in place advances every copy's (a kernel's writes advance none), so
    a caller that compares versions (``ops.Repeat``) takes its usual path
    once more."""

    def __init__(self, unpooled, stream):
        self._unpooled, self._stream = unpooled, stream
        self._chunks: dict = {}  # (id(template), stream) -> (template, copies left)

    def take(self, template: torch.Tensor) -> torch.Tensor:
        device = template.device
        if self._unpooled(device):
            return template.clone()
        key = (id(template), self._stream(device))
        entry = self._chunks.get(key)
        if entry is not None and entry[0] is template:  # (an id is reused once its object is gone)
            try:
                return entry[1].pop()
            except IndexError:  # used up (by another thread, too)
                pass
        return self._refill(key, template).pop()

    def _refill(self, key, template: torch.Tensor) -> list:
        n, size = template.numel(), template.element_size()
        row = -(-n * size // 16) * 16 // size  # elements per 16-byte aligned copy
        slots = max(1, min(POOL_SLOTS, POOL_CHUNK_BYTES // (row * size)))
        chunk = template.new_empty((slots, row))
        chunk[:, :n] = template  # one copy on the current stream
        copies = list(chunk[:, :n].unbind(0))
        copies.reverse()
        if len(self._chunks) >= POOL_TEMPLATES:
            self._chunks.clear()
        self._chunks[key] = (template, copies)
        return copies


# torch.cuda.current_device() and is_current_stream_capturing() without their
# Python frames (three to four per call), for callers holding a CUDA tensor
# (CUDA is initialised then, which is all the frames make sure of)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def current_cuda_device() -> int:
    """``torch.cuda.current_device()``, once CUDA is initialised."""
    return _CURRENT_DEVICE() if _CURRENT_DEVICE is not None else torch.cuda.current_device()


def _cuda_unpooled(device) -> bool:
    """A CUDA copy that must be a clone: its device's current stream
    captures a graph, or the device is not the current one (whose stream
    torch reports the capture of)."""
    if device.index != current_cuda_device():
        return True
    return _CAPTURING() if _CAPTURING is not None else torch.cuda.is_current_stream_capturing()


# the current stream's handle without a Stream object (as Triton's launcher reads it)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cuda_stream(device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


#: the pool of a template's copies by whether the template is a CUDA tensor
#: (``is_cuda``: a device's ``type`` is a new string at every read, five
#: times the cost); none for another device
_POOLS = {True: StatusPool(_cuda_unpooled, _cuda_stream)}


def fresh_copy(template: torch.Tensor) -> torch.Tensor:
    """A new tensor holding ``template``'s words (a fresh record, a status
    template), for a launch to count into: from its device type's pool where
    ``POOL_ENABLED`` (CUDA's), else ``template.clone()``."""
    pool = _POOLS.get(template.is_cuda) if POOL_ENABLED else None
    return template.clone() if pool is None else pool.take(template)
