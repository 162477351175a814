"""A launch site's repeated launches, past Triton's launch front end.

``kernel[grid](*args, **kwargs)`` on a GPU runs Triton's front end before
the launch itself: it binds the call to the kernel's signature, specialises
every argument (a tensor's dtype and 16-byte alignment, an integer's
divisibility by 16 or being 1, every constexpr), builds the compiled-kernel
cache key from that and looks it up, and checks the kernel's globals. Our
kernels take ~40 arguments: on the development CPU Triton's path costs
14-19 us per launch more than a replay below under triton 3.6, 26-31 us
under 3.9 (``python -m obskernels.bench.launch``), more than the rest of an
activation observer's forward.

A launcher's prepared launch (one call signature: shapes, strides, dtypes,
its block sizes) makes the same call every time but for its tensors: the
value, the outputs it allocates. ``Replay`` is such a launch site's kernel,
holding the site's own constexprs and launch options (the same at every
call): its first call goes through Triton (compiling if needed) and keeps
the compiled kernel with what its specialisation was built from; a later
call written the same way (as many positional arguments, the same keyword
names) whose other non-tensor arguments are equal (value and type, but for
the runtime scalars Triton does not specialise on), whose tensors have the
same dtypes and are 16-byte aligned exactly where the kept ones were, on
the same device with the same Triton knobs and kernel globals, launches
the compiled kernel directly (``CompiledKernel[grid]``, Triton's own
launcher for it: the stream, the launch hooks and the C launcher as
``kernel[grid]`` uses them). Any other call takes Triton's path and is
kept in its place. So a replayed launch runs the kernel Triton would have
chosen, with the same arguments; ``tests/kernels/test_replay.py`` checks
that against Triton's own launch with a recording driver.

A replayed launch hands the launcher each tensor's data pointer, an int,
where Triton's hands it the tensor: for a tensor Triton's C launcher calls
its ``data_ptr()`` and asks the driver whether the pointer is one the GPU
can access (``cuPointerGetAttribute``, to refuse a CPU tensor with a clear
error), one driver call per tensor argument per launch (3 to 12 in the
observers' launches); for an int it takes the value as the pointer. The
replay reads the pointers anyway (their alignment) and needs no such check:
the kept call passed it, and a prepared launch's tensors are the checked
call's, on the device of its signature (a plan's key holds every tensor's
device), or made on it. Only a GPU's launches take pointers
(``_hands_pointers``): the recording driver that stands in for the launcher
without a GPU (``obskernels.bench.launch``) zero-fills the integer tensors
it is handed, as a kernel writes them. ``POINTERS = False``
(``OBSKERNELS_REPLAY_POINTERS=0`` at import) hands the tensors everywhere.

Where the launch hooks do nothing (None, or Triton's default: a hook chain
holding no hook, in 3.6 as in 3.9) a replayed launch hands the launcher no
hooks and no launch metadata (which only hooks read): Triton's runner would
build the metadata and the C launcher call both empty chains, per launch.
A hook added to a chain, or set in its place, is handed as Triton hands it.

Under the interpreter (``TRITON_INTERPRET=1``), or where the kernel is
replaced (the host proxy's stubs, the compile report's recorders: the
kernel is looked up by name at each call), every call is ``kernel[grid]``.
``OBSKERNELS_REPLAY=0`` turns replays off (read at import).
"""

from __future__ import annotations

import functools
import operator
import os

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from obskernels.kernels._cache_keys import settle

__all__ = ["Replay", "ENABLED", "POINTERS"]

ENABLED = os.environ.get("OBSKERNELS_REPLAY", "1") != "0"
#: replayed launches hand the launcher data pointers, not tensors (see above)
POINTERS = os.environ.get("OBSKERNELS_REPLAY_POINTERS", "1") != "0"

_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_low_bits = (15).__and__


def _aligned(pointers) -> tuple:
    """Per data pointer, whether it is a multiple of 16 bytes."""
    return tuple(map(operator.not_, map(_low_bits, pointers)))


def _hands_pointers(tensors) -> bool:
    """Whether a kept call's launches hand the launcher pointers (``POINTERS``):
    where its tensors are a GPU's, which Triton's C launcher would check."""
    return all(t.is_cuda for t in tensors)


def _knobs():
    """The Triton knobs a launch reads into its compile options."""
    knobs = triton.knobs
    return (knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            getattr(knobs.compilation, "fpsan_homomorphic_casts", None))


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _is_i32(v) -> bool:
    return _I32_MIN <= v <= _I32_MAX


def _model(value):
    """What a tuple argument must match (Triton specialises each field): per
    field a tensor's dtype and alignment, a scalar's type and value; the
    tuple itself where it holds no tensor (a call passing the same object
    matches at once)."""
    if isinstance(value, torch.Tensor):
        return (_TENSOR, value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, tuple):
        fields = tuple(map(_model, value))
        holds_tensor = any(f[0] is _TENSOR or (f[0] is _TUPLE and f[1] is None) for f in fields)
        return (_TUPLE, None if holds_tensor else value, type(value), fields)
    return (_SCALAR, type(value), value)


_TENSOR, _TUPLE, _SCALAR = "tensor", "tuple", "scalar"


def _matches(value, model) -> bool:
    kind = model[0]
    if kind is _TENSOR:
        return (isinstance(value, torch.Tensor) and value.dtype == model[1]
                and (value.data_ptr() % 16 == 0) == model[2])
    if kind is _TUPLE:
        return value is model[1] or (type(value) is model[2] and len(value) == len(model[3])
                                     and all(map(_matches, value, model[3])))
    return type(value) is model[1] and value == model[2]


def _getter(positions):
    """vals -> tuple of vals[i] for i in positions (a tuple for any count;
    positions may be a dict's keys)."""
    if not positions:
        return lambda vals: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda vals: (vals[i],)
    return operator.itemgetter(*positions)


class _Fields:
    """A tuple argument holding tensors in its own fields (a kernel's
    output pointers with its constants): what a call's tuple in its place
    must match but for those tensors -- its type, length, and its other
    fields (the kept objects themselves, or fields matching their
    ``_model``) -- checked without walking it field by field; ``tensors``
    returns the tuple's tensors then (their dtypes and alignment are checked
    with the call's other tensors), None where it does not match."""

    __slots__ = ("type", "len", "tensors_of", "others_of", "others", "models", "count", "pointed_of")

    @classmethod
    def of(cls, value):
        """The ``_Fields`` of a tuple holding tensors in its own fields, none
        in deeper tuples; None for any other tuple."""
        kinds = [_model(v) for v in value]
        if not any(k[0] is _TENSOR for k in kinds) or any(k[0] is _TUPLE and k[1] is None for k in kinds):
            return None
        self = cls()
        self.type, self.len = type(value), len(value)
        held = [i for i, k in enumerate(kinds) if k[0] is _TENSOR]
        self.tensors_of, self.count = _getter(held), len(held)
        # a plain tuple of the fields with the tensors' pointers in their
        # places, picked from the tuple followed by those pointers
        self.pointed_of = _getter([self.len + held.index(i) if i in held else i
                                   for i in range(self.len)])
        others = [i for i, k in enumerate(kinds) if k[0] is not _TENSOR]
        self.others_of = _getter(others)
        self.others = self.others_of(value)
        self.models = tuple(kinds[i] for i in others)
        return self

    def tensors(self, value):
        if type(value) is not self.type or len(value) != self.len:
            return None
        others = self.others_of(value)
        if not all(map(operator.is_, others, self.others)) \
                and not all(map(_matches, others, self.models)):
            return None
        return self.tensors_of(value)


class _Kept:
    """A compiled kernel and what a call must match to launch it directly.

    A call is taken as written: ``flat`` is its positional arguments, its
    keyword arguments' values (in their order), then the site's own keywords
    and the defaults of the parameters neither passes (``tail``); ``args_of``
    picks the kernel's arguments from it in signature order. Only the call's
    own part is compared: the site's keywords are the site's, the same
    objects at every call. ``pointed_of`` picks them with the tensors'
    pointers in their places (``POINTERS``)."""

    __slots__ = ("fn", "n_args", "keys", "tail", "args_of", "pointed_of", "spans", "pointers",
                 "fixed_of", "fixed", "fixed_types", "free_of", "free", "free_types", "ints_of",
                 "fields", "tuples", "tensors_of", "dtypes", "aligned", "all_aligned", "device",
                 "knobs", "globals", "runner", "kernel", "grid")

    def __init__(self, fn, kernel, grid, args, kwargs, bound, device):
        self.fn, self.device = fn, device
        params, defaults = fn.params, fn.signature.parameters
        names = [p.name for p in params]
        self.n_args, self.keys = len(args), tuple(kwargs)
        missing = [n for n in names[len(args):] if n not in kwargs and n not in bound]
        self.tail = tuple(bound.values()) + tuple(defaults[n].default for n in missing)
        flat_names = names[:len(args)] + list(kwargs) + list(bound) + missing
        self.args_of = _getter([flat_names.index(n) for n in names])
        flat = tuple(args) + tuple(kwargs.values()) + self.tail
        own = range(len(args) + len(kwargs))
        param = {i: params[names.index(flat_names[i])] if flat_names[i] in names else None
                 for i in own}  # None: a launch option (num_warps, ...)
        runtime = {i for i in own if param[i] is not None and not param[i].is_constexpr}
        tensors = [i for i in own if isinstance(flat[i], torch.Tensor)]
        tuples = [i for i in own if isinstance(flat[i], tuple)]
        scalars = [i for i in own if i not in tensors and i not in tuples]
        # runtime scalars whose value Triton does not specialise on (a float;
        # an int of a do_not_specialize parameter, as long as it stays an
        # i32): they may differ from call to call (an observation's index);
        # every other scalar (a constexpr, None, a specialised int, an
        # option) is fixed
        free_ints = [i for i in scalars if i in runtime and type(flat[i]) is int
                     and param[i].do_not_specialize and _is_i32(flat[i])]
        floats = [i for i in scalars if i in runtime and type(flat[i]) is float]
        fixed = [i for i in scalars if i not in free_ints and i not in floats]
        self.fixed_of, self.free_of, self.ints_of = map(_getter, (fixed, free_ints + floats, free_ints))
        self.fixed = self.fixed_of(flat)
        self.fixed_types = tuple(map(type, self.fixed))
        self.free = self.free_of(flat)
        self.free_types = tuple(map(type, self.free))
        # a tuple holding tensors in its own fields has them checked with the
        # call's other tensors (``_Fields``); any other tuple as a whole
        fields = [(i, _Fields.of(flat[i])) for i in tuples]
        self.fields = tuple(f for f in fields if f[1] is not None)
        self.tuples = tuple((i, _model(flat[i])) for i, f in fields if f is None)
        self.tensors_of = _getter(tensors)
        kept = self._tensors(flat)
        self.dtypes = tuple(map(_dtype, kept))
        # the launch with pointers (``POINTERS``): the kernel's arguments in
        # signature order picked from the call's flat arguments followed by
        # its tensors' pointers (``_tensors``' order: the plain ones, then
        # each tuple's) and its tuples holding tensors rebuilt with theirs
        # (``spans``: each such tuple's place and its pointers' slice)
        n_flat, start, spans = len(flat), len(tensors), []
        for i, fields in self.fields:
            spans.append((i, fields, start, start + fields.count))
            start += fields.count
        self.spans = tuple(spans)
        source = {f: n_flat + k for k, f in enumerate(tensors)}
        source.update((i, n_flat + len(kept) + k) for k, (i, _) in enumerate(self.fields))
        self.pointed_of = _getter([source.get(f, f) for f in (flat_names.index(n) for n in names)])
        self.pointers = bool(kept) and _hands_pointers(kept)
        # which tensors are 16-byte aligned, which Triton specialises on (the
        # compiled code may assume it): a call whose pattern differs takes its
        # path (where all were, one test of their pointers' bits together)
        self.aligned = _aligned(map(_data_ptr, kept))
        self.all_aligned = all(self.aligned)
        self.knobs = _knobs()
        # the globals the kernel read when it compiled, per module, as bound
        # now (Triton's launch has just checked them against their values then)
        scopes = {}
        for (name, _), (_, scope) in fn.used_global_vals.items():
            scopes.setdefault(id(scope), (scope, []))[1].append(name)
        self.globals = tuple((scope, _getter(names), _getter(names)(scope))
                             for scope, names in scopes.values())
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.kernel, self.runner = kernel, kernel[self.grid]

    def launch(self, args, kwargs, device) -> bool:
        """Launches the kept kernel where this call matches; False otherwise."""
        try:
            vals = self._matching(args, kwargs, device)
        except (KeyError, AttributeError, TypeError):  # a call Triton may take, or explain
            return False
        if vals is None:
            return False
        enter, leave = _runtime.launch_enter_hook, _runtime.launch_exit_hook
        if _no_hook(enter) and _no_hook(leave):
            # what the runner does, less the launch metadata only hooks read
            # and the calls of hook chains holding no hook (Triton's default:
            # two Python calls per launch)
            kernel, (gx, gy, gz) = self.kernel, self.grid
            kernel.run(gx, gy, gz, _stream(device), kernel.function, kernel.packed_metadata, None,
                       None, None, *vals)
        else:
            self.runner(*vals, stream=_stream(device))
        return True

    def _tensors(self, flat):
        """The call's tensor arguments, then those in the fields of its
        tuples that hold some (``fields``), in the kept call's order; None
        where such a tuple does not match its kept one but for its tensors."""
        tensors = self.tensors_of(flat)
        for i, fields in self.fields:
            held = fields.tensors(flat[i])
            if held is None:
                return None
            tensors += held
        return tensors

    def _matching(self, args, kwargs, device):
        """The call's kernel arguments in signature order where it matches
        (its tensors as their data pointers where ``POINTERS`` and the kept
        call's launches take them); None otherwise."""
        if len(args) != self.n_args or tuple(kwargs) != self.keys:
            return None
        flat = args + tuple(kwargs.values()) + self.tail if kwargs else args + self.tail
        fixed, free, tensors = self.fixed_of(flat), self.free_of(flat), self._tensors(flat)
        # scalars that are the kept call's own objects match at once (a
        # launcher's layout, an observation index that is a small int)
        if not (all(map(operator.is_, fixed, self.fixed)) and all(map(operator.is_, free, self.free))):
            ints = self.ints_of(flat)
            if (fixed != self.fixed
                    or tuple(map(type, fixed)) != self.fixed_types  # 1 == True == 1.0
                    or tuple(map(type, free)) != self.free_types
                    or (ints and not (_I32_MIN <= min(ints) and max(ints) <= _I32_MAX))):
                return None
        if tensors is None or tuple(map(_dtype, tensors)) != self.dtypes:
            return None
        pointers = tuple(map(_data_ptr, tensors))
        if ((functools.reduce(operator.or_, pointers, 0) & 15 if self.all_aligned
             else _aligned(pointers) != self.aligned)
                or device != self.device or _knobs() != self.knobs or self.fn.pre_run_hooks):
            return None
        for i, model in self.tuples:
            if not _matches(flat[i], model):
                return None
        # the kernel's globals unchanged since it compiled, as Triton checks at
        # each launch (the same objects compare at once)
        for scope, bound, values in self.globals:
            if bound(scope) != values:
                return None
        if not (POINTERS and self.pointers):
            return self.args_of(flat)
        for i, fields, start, stop in self.spans:
            pointers += (fields.pointed_of(flat[i] + pointers[start:stop]),)
        return self.pointed_of(flat + pointers)


_runtime = triton.knobs.runtime
# Triton keeps its launch hooks in chains (3.6 and 3.9 alike; a new chain
# holds none); a Triton without them has None for no hook
_HookChain = getattr(triton.knobs, "HookChain", None)


def _no_hook(hook) -> bool:
    """Whether a launch hook does nothing: None, or a hook chain holding none."""
    return hook is None or (type(hook) is _HookChain and not hook.calls)


def _device():
    return triton.runtime.driver.active.get_current_device()


def _stream(device):
    return triton.runtime.driver.active.get_current_stream(device)


class Replay:
    """``Replay(scope, name, grid, **bound)(*args, **kwargs)``:
    ``scope[name][grid](*args, **kwargs, **bound)`` (``scope``: the launcher
    module's globals, read at each call; ``bound``: the site's own keyword
    arguments, the same at every call: its constexprs and launch options),
    replayed past Triton's front end where it matches the kept call (see the
    module docstring). One per launch site of a prepared launch."""

    __slots__ = ("scope", "name", "grid", "bound", "kept")

    def __init__(self, scope, name, grid, **bound):
        self.scope, self.name, self.grid, self.bound, self.kept = scope, name, tuple(grid), bound, None

    def __call__(self, *args, **kwargs):
        fn = self.scope[self.name]
        kept = self.kept
        if kept is not None and kept.fn is fn and ENABLED:
            device = _device()
            if kept.launch(args, kwargs, device):
                return
        settle(fn)  # its cache key as every process makes it (_cache_keys.py)
        kernel = fn[self.grid](*args, **kwargs, **self.bound)
        if ENABLED and isinstance(fn, JITFunction) and isinstance(kernel, CompiledKernel):
            self.kept = _Kept(fn, kernel, self.grid, args, kwargs, self.bound, _device())
