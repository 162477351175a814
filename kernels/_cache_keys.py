"""A kernel's cache key the same in every process, whatever ran before it.

Triton finds a compiled kernel, in memory and in its disk cache, by a key
holding the kernel function's ``cache_key``: a hash of its source, of the
key of every jit function it calls, and of the constexpr globals they all
read (``used_global_vals``, merged up from the callees). Triton 3.6 (torch
2.10's and 2.11's) merges a callee's globals into its caller's *before* it
hashes the callee, so a callee that no kernel hashed before gives its caller
none of its globals. A kernel's key then depends on what the process hashed
first: ``_min_max_kernel``'s after a memoryless_mse call (whose search
kernels hash helpers the min/max kernel calls too) is not its key in a
process that made only min/max calls. Such a process misses in Triton's
disk cache every min/max kernel the other one compiled and compiles them
again: most likely why an FP8 ``oneshot`` in a fresh process took 1.3-1.6 s
more on an H200's host, after a process that had run a W4A16 calibration
first (that run counted no compiles; the development CPU reproduces it). Newer
Triton (3.9) hashes the callee first; its keys do not depend on the order.

``settle(fn)`` hashes ``fn``'s dependencies callee first (depth first, each
function after all of its own), then ``fn``. Every key then holds all of its
callees' globals, whatever was hashed before, as Triton 3.9 makes it; under
a Triton that orders it so itself this changes only when the hashing happens.
The launch sites call it before a kernel's first launch through Triton's
path (``_replay.Replay``, the flatten kernel's launch, the compile report's
variants). The dependencies are read from the function's code: the global
and closure names it loads, and the attributes of those names it reads (a
module's, a class's), a superset of what Triton's hash visits (hashing one
more function changes no key; ``tests/kernels/test_cache_keys.py`` checks the
superset against Triton's own walk). Triton's own modules and objects are
left out, as its hash leaves them.
"""

from __future__ import annotations

import types

from triton.runtime import jit as _jit

__all__ = ["settle"]

#: what Triton hashes as a dependency (jit and constexpr functions)
_CALLABLE = getattr(_jit, "JITCallable", _jit.JITFunction)

#: ids of the functions settled in this process (module-level functions,
#: alive for the process; a JITFunction's own ``__hash__`` is its key)
_SETTLED: set = set()


def _ours(value) -> bool:
    """Whether Triton's hash would follow ``value``: not Triton's own."""
    name = getattr(value, "__name__" if isinstance(value, types.ModuleType) else "__module__", "") or ""
    return not (name == "triton" or name.startswith("triton."))


def _names(code) -> set:
    """The names a function's code (and any code nested in it) loads."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _dependencies(fn) -> list:
    """The jit and constexpr functions ``fn``'s code may call."""
    py = fn.fn
    names = _names(py.__code__)
    closure = {}
    for name, cell in zip(py.__code__.co_freevars, py.__closure__ or ()):
        try:
            closure[name] = cell.cell_contents
        except ValueError:  # a cell not yet bound
            pass
    scope = py.__globals__
    values = [closure[n] if n in closure else scope[n] for n in names if n in closure or n in scope]
    values += list(py.__defaults__ or ()) + list((py.__kwdefaults__ or {}).values())
    found, holders = [], set()
    while values:
        value = values.pop()
        if isinstance(value, _CALLABLE):
            if _ours(value):
                found.append(value)
        elif hasattr(value, "__dict__") and id(value) not in holders and _ours(value):
            # a module, a class, a namespace: the attributes a kernel reads
            # from it, as its own dict holds them (no module class's property
            # run); Triton's hash follows them too
            holders.add(id(value))
            attrs = vars(value)
            values += [attrs[n] for n in names if n in attrs]
    return found


def settle(fn) -> None:
    """Hashes ``fn`` (a JITFunction; anything else is left alone) after every
    function it depends on, each after its own, unless done before."""
    if not isinstance(fn, _jit.JITFunction) or id(fn) in _SETTLED:
        return
    active = {id(fn)}
    stack = [(fn, iter(_dependencies(fn)))]
    while stack:
        node, pending = stack[-1]
        for dep in pending:
            # hashed already: settled, or by Triton before (nothing to mend)
            if id(dep) in _SETTLED or id(dep) in active or getattr(dep, "hash", None) is not None:
                continue
            active.add(id(dep))
            stack.append((dep, iter(_dependencies(dep))))
            break
        else:
            stack.pop()
            node.cache_key  # noqa: B018 - Triton's hash, its callees' made before
            _SETTLED.add(id(node))
