"""Counters of memory traffic, launches and arithmetic for one call of an operation.

Two counters, usable together:

- ``AtenTraffic`` (a ``TorchDispatchMode``): the PyTorch paths (the reference
  backend, llm-compressor's eager observers, and the host-side torch code around
  a Triton kernel). Every aten op that is not a view or a bare allocation counts
  as ONE launch; it moves the bytes of its tensor inputs (read) plus the bytes of
  its outputs (written). It also tracks the peak of live tensor storage created
  during the call (the CPU peak-memory figure: outputs of aten ops, by storage,
  until they are freed; the inputs that existed before the call are not counted).
- ``TritonTraffic``: Triton kernels run by triton's interpreter
  (TRITON_INTERPRET=1). It hooks the interpreter's masked load / store (every
  plain load, store, descriptor access and atomic load/store goes through
  them) and its atomics, counting the UNMASKED lanes times the pointer's element
  size; one launch per grid executed; one program per grid index; and one
  "op" per lane of every elementwise arithmetic, compare, cast and reduction the
  interpreter evaluates (its arithmetic count, used as the flop figure).

``count_traffic(device)`` runs both at once and pauses the aten counter while a
Triton kernel runs (the interpreter's own host copies are not traffic).
``peak_memory(device)`` tracks only the live-storage peak (no per-access
counting, so a kernel runs at the interpreter's plain speed): on the CPU the
peak extra memory of a Triton path, i.e. what its launcher and the torch code
around it allocate, the memory a GPU run would hold.

Byte counts are an upper bound on DRAM traffic: every access is counted as if it
missed the caches. ``TritonTraffic`` also reports the distinct bytes touched per
launch (a lower bound: each address once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "Counts",
    "AtenTraffic",
    "HOST_READS",
    "host_reads_seen",
    "TritonTraffic",
    "count_traffic",
    "tensor_bytes",
    "dense_bytes",
    "interpreter_active",
    "peak_memory",
]


@dataclasses.dataclass
class Counts:
    """What one counted call did. Bytes are per call; launches per call."""

    bytes_read: int = 0
    bytes_written: int = 0
    launches: int = 0  # aten ops + triton grids
    aten_ops: int = 0
    triton_launches: int = 0
    triton_programs: int = 0
    syncs: int = 0  # device -> host reads (.item(), bool(tensor), .tolist(), .numpy())
    flops: int = 0  # arithmetic lanes (see the module docstring)
    triton_bytes: int = 0
    triton_unique_bytes: int = 0
    atomics: int = 0
    peak_bytes: int = 0
    op_names: Dict[str, int] = dataclasses.field(default_factory=dict)
    # one [kind ("aten" | "triton"), name, bytes moved, arithmetic lanes] per launch,
    # in issue order: the GPU model takes max(memory, compute) launch by launch
    per_launch: List[List] = dataclasses.field(default_factory=list)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes_moved"] = self.bytes_moved
        return d


# ----------------------------------------------------------------------------- aten

# Ops that move no data and launch nothing: bare allocations and metadata.
_FREE_OPS = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "set_",
    "detach",
    "alias",
    "lift_fresh",
    "resize_",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
}
# Ops whose first argument is written without being read.
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}
# Ops that read a device value back to the host (a synchronisation on a GPU).
_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select"}


def tensor_bytes(t: torch.Tensor) -> int:
    """numel x element size: what writing ``t`` costs."""
    return t.numel() * t.element_size()


def dense_bytes(t: torch.Tensor) -> int:
    """Bytes of distinct memory ``t`` reads: broadcast (stride 0) dims count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    if t.numel() == 0:
        n = 0
    return n * t.element_size()


def _tensors(obj) -> List[torch.Tensor]:
    flat, _ = tree_flatten(obj)
    return [x for x in flat if isinstance(x, torch.Tensor)]


_state = threading.local()


def interpreter_active() -> bool:
    """True while a Triton grid is being executed by the counting interpreter hook."""
    return getattr(_state, "in_kernel", 0) > 0


class AtenTraffic(TorchDispatchMode):
    """Counts aten ops (= launches), their bytes and the live-storage peak.

    :param device: only ops touching a tensor on this device type count (on a
        GPU run, ops on CPU scalars are not device launches).
    :param counts: where to add; a new ``Counts`` when None.
    """

    def __init__(self, device: str = "cpu", counts: Optional[Counts] = None):
        super().__init__()
        self.device = device
        self.counts = counts if counts is not None else Counts()
        self._live: Dict[int, tuple] = {}
        self._live_bytes = 0

    # peak memory: storages created by op outputs, until they are freed
    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self._live_bytes -= self._live.pop(key)[1]

    def _track(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor] = ()) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        # an in-place (or out=) op returns its input's storage: nothing new
        existing = {t.untyped_storage().data_ptr() for t in inputs if t.device.type == self.device}
        for t in outputs:
            if t.device.type != self.device:
                continue
            st = t.untyped_storage()
            nbytes = st.nbytes()
            key = st.data_ptr()
            if nbytes == 0 or key in self._live or key in existing:
                continue
            self._live[key] = (StorageWeakRef(st), nbytes)
            self._live_bytes += nbytes
        self.counts.peak_bytes = max(self.counts.peak_bytes, self._live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if interpreter_active():
            return func(*args, **kwargs)
        self._sweep()
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if not any(t.device.type == self.device for t in ins + outs):
            return out
        if name in _FREE_OPS or func.is_view:
            # a view shares its input's storage: nothing moves, nothing launches;
            # a bare allocation launches nothing but holds memory
            if name.startswith(("empty", "new_empty")):
                self._track(outs)
            return out
        c = self.counts
        # the destination of a write-only op (copy_, fill_, out=) is not read
        skip = set()
        if name in _WRITE_ONLY_SELF and args and isinstance(args[0], torch.Tensor):
            skip.add(id(args[0]))
        if isinstance(kwargs.get("out"), torch.Tensor):
            skip.add(id(kwargs["out"]))
        read = sum(dense_bytes(t) for t in ins if id(t) not in skip)
        written = sum(tensor_bytes(t) for t in outs)
        c.bytes_read += read
        c.bytes_written += written
        c.aten_ops += 1
        c.launches += 1
        # one arithmetic lane per element of the largest operand
        lanes = max([t.numel() for t in ins + outs] or [0])
        c.flops += lanes
        c.per_launch.append(["aten", name, read + written, lanes])
        if name in _SYNC_OPS:
            c.syncs += 1
        c.op_names[name] = c.op_names.get(name, 0) + 1
        self._track(outs, ins)
        return out


# --------------------------------------------------------------------------- triton


def _elem_bytes(tl_dtype) -> int:
    return max(1, math.ceil(tl_dtype.primitive_bitwidth / 8))


# Interpreter entry points that evaluate arithmetic: one "op" per lane of their
# result (the flop figure). Names a triton version lacks are skipped.
_ARITH_ENTRIES = (
    "binary_op",
    "unary_op",
    "ternary_op",
    "create_fma",
    "create_fabs",
    "cast_impl",
    "create_fp_to_fp",
    "create_idiv",
    "create_ashr",
    "create_umulhi",
    "create_erf",
    "create_rsqrt",
)


def _interpreter():
    """triton's interpreter module, when it is the one running kernels (else an error)."""
    from triton.runtime import interpreter as ti

    if not getattr(ti, "interpreter_builder", None):
        raise RuntimeError("triton's interpreter is not available")
    import triton.knobs

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("TritonTraffic needs TRITON_INTERPRET=1 set before triton is imported")
    return ti


def _kernel_name(executor) -> str:
    return getattr(executor.fn, "__name__", "kernel")


class TritonTraffic:
    """Counts the traffic, launches and arithmetic of kernels run by triton's interpreter.

    A context manager; while active it wraps these interpreter entry points
    (each wrapper is one ``_on_*`` method below) and restores them on exit:

    - ``create_masked_load`` / ``create_masked_store``: bytes read / written
      (``_on_load``, ``_on_store``);
    - ``create_atomic_rmw`` / ``create_atomic_cas``: a read and a write per
      lane, and the atomics count (``_on_atomic_rmw``, ``_on_atomic_cas``);
    - the arithmetic entries of ``_ARITH_ENTRIES`` and reductions: lanes
      (``_on_arith``, ``_on_reduce``);
    - ``set_grid_idx``: programs (``_on_program``);
    - ``GridExecutor.__call__``: launches and the per-launch breakdown
      (``_on_launch``);
    - ``Autotuner._bench``: timing runs are not counted (``_on_autotune``).

    Requires TRITON_INTERPRET=1 to have been set before triton was imported
    (otherwise kernels compile for a GPU and nothing would be counted: an error).
    """

    def __init__(self, counts: Optional[Counts] = None, unique: bool = True):
        self.counts = counts if counts is not None else Counts()
        self.unique = unique
        self._saved: List[tuple] = []
        self._addrs: Dict[int, list] = {}
        self._op_depth = 0  # > 0 inside an arithmetic entry (nested calls count once)

    # -- what one access, one arithmetic result and one launch add
    def _lanes(self, ptrs, mask):
        import numpy as np

        if mask is None:
            m = np.ones(np.shape(ptrs.data), dtype=bool)
        else:
            m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
        return m

    def _access(self, ptrs, mask, written: bool):
        import numpy as np

        m = self._lanes(ptrs, mask)
        size = _elem_bytes(ptrs.get_element_ty())
        nbytes = int(m.sum()) * size
        c = self.counts
        if written:
            c.bytes_written += nbytes
        else:
            c.bytes_read += nbytes
        c.triton_bytes += nbytes
        if self.unique and nbytes:
            addrs = np.asarray(ptrs.data).reshape(-1)[m.reshape(-1)].astype(np.uint64)
            self._addrs.setdefault(size, []).append(addrs)

    def _arith(self, result):
        import numpy as np

        if self._op_depth == 1:
            data = getattr(result, "data", None)
            self.counts.flops += int(np.size(data)) if data is not None else 1

    def _open_launch(self, executor):
        c = self.counts
        c.triton_launches += 1
        c.launches += 1
        name = f"triton:{_kernel_name(executor)}"
        c.op_names[name] = c.op_names.get(name, 0) + 1
        _state.in_kernel = getattr(_state, "in_kernel", 0) + 1
        return c.bytes_moved, c.flops

    def _close_launch(self, executor, start):
        import numpy as np

        _state.in_kernel -= 1
        c = self.counts
        if self.unique:
            for size, chunks in self._addrs.items():
                c.triton_unique_bytes += int(np.unique(np.concatenate(chunks)).size) * size
            self._addrs = {}
        b0, f0 = start
        c.per_launch.append(["triton", _kernel_name(executor), c.bytes_moved - b0, c.flops - f0])

    # -- the hooks: each takes the original entry point and returns its wrapper
    # the cache arguments after the mask differ between tritons (3.9: one
    # cache_policy; 3.6-3.8: cache_modifier, eviction_policy): passed on as given
    def _on_load(self, orig):
        def create_masked_load(builder, ptrs, mask, *cache_and_more):
            self._access(ptrs, mask, written=False)
            return orig(builder, ptrs, mask, *cache_and_more)

        return create_masked_load

    def _on_store(self, orig):
        def create_masked_store(builder, ptrs, value, mask, *cache):
            self._access(ptrs, mask, written=True)
            return orig(builder, ptrs, value, mask, *cache)

        return create_masked_store

    def _on_atomic_rmw(self, orig):
        def create_atomic_rmw(builder, rmwOp, ptr, val, mask, sem, scope):
            self._access(ptr, mask, written=False)
            self._access(ptr, mask, written=True)
            self.counts.atomics += int(self._lanes(ptr, mask).sum())
            return orig(builder, rmwOp, ptr, val, mask, sem, scope)

        return create_atomic_rmw

    def _on_atomic_cas(self, orig):
        def create_atomic_cas(builder, ptr, cmp, val, sem, scope):
            self._access(ptr, None, written=False)
            self._access(ptr, None, written=True)
            self.counts.atomics += int(self._lanes(ptr, None).sum())
            return orig(builder, ptr, cmp, val, sem, scope)

        return create_atomic_cas

    def _on_arith(self, orig):
        def op(builder, *args, **kwargs):
            self._op_depth += 1
            try:
                result = orig(builder, *args, **kwargs)
                self._arith(result)
                return result
            finally:
                self._op_depth -= 1

        return op

    def _on_reduce(self, orig):
        def apply(op, input):
            import numpy as np

            if self._op_depth == 0:
                items = input if isinstance(input, tuple) else (input,)
                self.counts.flops += sum(
                    int(np.size(t.handle.data)) for t in items if hasattr(t, "handle")
                )
            self._op_depth += 1
            try:
                return orig(op, input)
            finally:
                self._op_depth -= 1

        return apply

    def _on_program(self, orig):
        def set_grid_idx(builder, x, y, z):
            self.counts.triton_programs += 1
            return orig(builder, x, y, z)

        return set_grid_idx

    def _on_launch(self, orig):
        def __call__(executor, *args, **kwargs):
            start = self._open_launch(executor)
            try:
                return orig(executor, *args, **kwargs)
            finally:
                self._close_launch(executor, start)

        return __call__

    def _on_autotune(self, orig):
        """Timing runs of an autotuner are not part of the call: not counted."""

        def _bench(tuner, *args, **kwargs):
            saved = dataclasses.replace(self.counts)
            try:
                return orig(tuner, *args, **kwargs)
            finally:
                # drop whatever the timing runs added
                for f in dataclasses.fields(Counts):
                    setattr(self.counts, f.name, getattr(saved, f.name))

        return _bench

    def _hooks(self, ti):
        """(owner, attribute, hook) of every entry point wrapped while active."""
        B = ti.InterpreterBuilder
        hooks = [
            (B, "create_masked_load", self._on_load),
            (B, "create_masked_store", self._on_store),
            (B, "create_atomic_rmw", self._on_atomic_rmw),
            (B, "create_atomic_cas", self._on_atomic_cas),
        ]
        hooks += [(B, name, self._on_arith) for name in _ARITH_ENTRIES if name in B.__dict__]
        hooks += [
            (B, "set_grid_idx", self._on_program),
            (ti.GridExecutor, "__call__", self._on_launch),
            (ti.ReduceScanOpInterface, "apply", self._on_reduce),
        ]
        try:
            from triton.runtime.autotuner import Autotuner
        except ImportError:  # pragma: no cover - layout of another triton version
            Autotuner = None
        if Autotuner is not None and "_bench" in Autotuner.__dict__:
            hooks.append((Autotuner, "_bench", self._on_autotune))
        return hooks

    # -- context manager
    def __enter__(self):
        ti = _interpreter()
        self._op_depth = 0
        try:
            for owner, name, hook in self._hooks(ti):
                self._saved.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, hook(owner.__dict__[name]))
        except BaseException:
            self.__exit__()  # an entry point missing in this triton: restore the others
            raise
        return self

    def __exit__(self, *exc):
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        return False


#: Tensor methods that read a tensor's values into Python without an aten op
#: on a CPU tensor (``item`` and ``bool`` dispatch one: ``_SYNC_OPS``); on a
#: GPU each is a device-to-host copy that waits for the queued work (an
#: observer's one read of its status is a ``tolist``)
HOST_READS = ("tolist", "numpy")


@contextlib.contextmanager
def host_reads_seen(on_read: Callable[[str, torch.Tensor], None],
                    names=HOST_READS) -> Iterator[None]:
    """Within the block every call of a Tensor method of ``names`` (default
    ``HOST_READS``) first calls ``on_read(name, tensor)``; each method is
    restored as it was after it (one defined by torch's C class removed
    from ``torch.Tensor`` again)."""
    saved = [(name, torch.Tensor.__dict__.get(name)) for name in names]  # None: a C method

    def seeing(name, original):
        def read(tensor, *args, **kwargs):
            on_read(name, tensor)
            return original(tensor, *args, **kwargs)

        return read

    for name, _ in saved:
        setattr(torch.Tensor, name, seeing(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, own in saved:
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)


@contextlib.contextmanager
def count_traffic(device: str = "cpu", triton: bool = False) -> Iterator[Counts]:
    """Counts the aten ops of the block, its reads of values into Python
    (``HOST_READS``, as syncs), and the Triton kernels when ``triton``.

    Yields the ``Counts`` being filled. With ``triton=True`` the interpreter must
    be on (TRITON_INTERPRET=1); aten ops issued by the interpreter itself while
    it runs a kernel are not counted.
    """
    counts = Counts()
    with contextlib.ExitStack() as stack:
        if triton:
            stack.enter_context(TritonTraffic(counts))
        stack.enter_context(AtenTraffic(device, counts))

        def read(_name, tensor):  # a sync, unless triton's interpreter reads a kernel's argument
            if tensor.device.type == device and not interpreter_active():
                counts.syncs += 1

        stack.enter_context(host_reads_seen(read))
        yield counts


@contextlib.contextmanager
def _kernels_marked() -> Iterator[None]:
    """Marks Triton grids run by the interpreter as kernels (``interpreter_active``)
    so that the interpreter's own host-side torch work is not attributed to the
    call; nothing is counted. A no-op when the interpreter is off."""
    try:
        import triton.knobs
        from triton.runtime import interpreter as ti
    except ImportError:
        yield
        return
    if not triton.knobs.runtime.interpret:
        yield
        return
    original = ti.GridExecutor.__dict__["__call__"]

    def __call__(executor, *args, **kwargs):
        _state.in_kernel = getattr(_state, "in_kernel", 0) + 1
        try:
            return original(executor, *args, **kwargs)
        finally:
            _state.in_kernel -= 1

    ti.GridExecutor.__call__ = __call__
    try:
        yield
    finally:
        ti.GridExecutor.__call__ = original


@contextlib.contextmanager
def peak_memory(device: str = "cpu") -> Iterator[Counts]:
    """Tracks the peak of tensor storage created in the block and alive at once
    (``Counts.peak_bytes``): outputs and scratch, not the inputs that existed
    before. Under triton's interpreter, tensors the interpreter creates while
    it executes a kernel are left out (on a GPU a kernel allocates nothing)."""
    counts = Counts()
    with _kernels_marked(), AtenTraffic(device, counts):
        yield counts
