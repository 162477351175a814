"""A kernel's cache key the same whatever the process ran before it
(kernels/_cache_keys.py): a process finds in Triton's disk cache the kernels
another made, though the two made their calls in other orders.

Triton 3.6 merges a callee's constexpr globals into its caller's key before
hashing the callee, so without ``settle`` the min/max kernel's key after a
memoryless_mse call (whose kernels hash helpers the min/max kernel calls
too) is not its key in a process that made the min/max call first, and the
second process compiles the min/max kernel again. Triton 3.9 hashes the
callee first; there the test checks that settling changes nothing it finds.
And ``settle`` finds at least the dependencies Triton's own hash walks into.

The subprocesses run under each triton of ``compile_pythons()``, without
TRITON_INTERPRET (the kernels compile for sm_90 and a recording driver takes
their launches), on a Triton cache directory of the test's own.
"""

from __future__ import annotations

import pytest
from helpers import compile_pythons, compiled_row, python_id

pytestmark = [pytest.mark.kernel, pytest.mark.slow]
pytest.importorskip("triton", reason="the Triton kernels need triton")

# the host scenarios named on the command line, in that order, each one call
# through the kernels compiled for sm_90; then what the calls compiled into
# Triton's disk cache, every hashed kernel function's key, and the constexpr
# globals of one name read with two values by one function (Triton 3.6 sorts
# a key's globals by name and by the id of the module's dict they come from,
# which differs from process to process)
WORKER = """
import collections, json, sys, warnings
warnings.simplefilter("ignore")
from triton.language.core import constexpr
from triton.runtime.jit import JITFunction
from obskernels.bench import host, launch

before = launch.compiled_kernels()
with launch.compiled_on_cpu():
    for name in sys.argv[1:]:
        host._call_of(next(s for s in host.SCENARIOS if s.name == name))()
keys, clashes = {}, []
for module in list(sys.modules.values()):
    for attr, fn in list(vars(module).items()):
        if isinstance(fn, JITFunction) and fn.__module__.startswith("obskernels") and fn.hash is not None:
            keys[f"{fn.__module__}.{attr}"] = fn.hash
            values = collections.defaultdict(set)
            for (var, _), (value, _) in fn.used_global_vals.items():
                if isinstance(value, constexpr):
                    values[var].add(repr(value))
            clashes += [f"{fn.__module__}.{attr}: {var}" for var, seen in values.items() if len(seen) > 1]
print(json.dumps({"compiled": launch.compiled_since(before), "keys": keys, "clashes": sorted(set(clashes))}))
"""


@pytest.fixture(scope="module", params=compile_pythons(), ids=python_id)
def python(request):
    return request.param


def _calls(python, cache_dir, *scenarios):
    return compiled_row(python, "-c", WORKER, *scenarios, TRITON_CACHE_DIR=str(cache_dir))


def test_a_process_finds_the_kernels_another_compiled_whatever_their_calls_order(python, tmp_path):
    """One process makes a memoryless_mse call, then a minmax call, on an
    empty cache: it compiles both calls' kernels. The next makes the same
    calls the other way round: it compiles nothing, and every kernel
    function hashed in both has the same key in both."""
    first = _calls(python, tmp_path, "memoryless_mse call", "minmax call")
    assert "_min_max_kernel" in first["compiled"] and len(first["compiled"]) >= 2, first["compiled"]
    second = _calls(python, tmp_path, "minmax call", "memoryless_mse call")
    assert second["compiled"] == [], second["compiled"]
    shared = sorted(set(first["keys"]) & set(second["keys"]))
    assert "obskernels.kernels.min_max._min_max_kernel" in shared, shared
    differ = [name for name in shared if first["keys"][name] != second["keys"][name]]
    assert differ == [], differ
    assert first["clashes"] == [] and second["clashes"] == [], (first["clashes"], second["clashes"])


# per kernel function of the package (the search's imported too), the jit
# functions Triton's own hash walks into (its DependenciesFinder, recording
# instead of hashing) that ``_cache_keys`` does not find
WALK = """
import importlib, inspect, json, sys
from triton.runtime.jit import DependenciesFinder, JITFunction
import obskernels.kernels
importlib.import_module("obskernels.kernels.mse_search")
from obskernels.kernels._cache_keys import _dependencies


class Recording(DependenciesFinder):
    def _update_hash(self, func):
        self.walked.append(func)


missed, functions = {}, {}
for module in list(sys.modules.values()):
    for fn in list(vars(module).values()):
        if isinstance(fn, JITFunction) and fn.__module__.startswith("obskernels"):
            functions[id(fn)] = fn
for fn in functions.values():
    walk = Recording(name=fn._fn_name, globals=fn.__globals__, nonlocals=inspect.getclosurevars(fn.fn).nonlocals,
                     src=fn.src)
    walk.walked = []
    walk.visit(fn.parse())
    found = {id(d) for d in _dependencies(fn)}
    lost = sorted({d.__name__ for d in walk.walked if id(d) not in found})
    if lost:
        missed[f"{fn.__module__}.{fn.__name__}"] = lost
print(json.dumps({"functions": len(functions), "missed": missed}))
"""


def test_the_dependencies_found_hold_every_one_tritons_hash_walks_into(python):
    """``_cache_keys`` finds a kernel function's dependencies in its code;
    Triton's hash finds them walking its source. For every kernel function
    of the package, each function Triton's walk hashes is among those found
    (else it would be hashed in Triton's order again, its key depending on
    what ran first)."""
    row = compiled_row(python, "-c", WALK, timeout=600)
    assert row["functions"] >= 100 and row["missed"] == {}, row
