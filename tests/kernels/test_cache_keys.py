"""A kernel's cache key the same whatever the process ran before it
(kernels/_cache_keys.py): a process finds in Triton's disk cache the kernels
another made, though the two made their calls in other orders.

Triton 3.6 merges a callee's constexpr globals into its caller's key before
hashing the callee, so without ``settle`` the min/max kernel's key after a
memoryless_mse call (whose kernels hash helpers the min/max kernel calls
too) is not its key in a process that made the min/max call first, and the
second process compiles the min/max kernel again. Triton 3.9 hashes the
callee first; there the test checks that settling changes nothing it finds.

The subprocesses run under each triton of ``compile_pythons()``, without
TRITON_INTERPRET (the kernels compile for sm_90 and a recording driver takes
their launches), on a Triton cache directory of the test's own.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import compile_pythons, compiling_env, python_id

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
    env = dict(compiling_env(), TRITON_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([python, "-c", WORKER, *scenarios], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
