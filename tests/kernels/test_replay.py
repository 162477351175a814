"""Launches replayed past Triton's front end (kernels/_replay.py), checked
against Triton's own launch without a GPU.

``replay_worker.py`` runs in a subprocess without TRITON_INTERPRET, under
each triton of ``compile_pythons()``: the kernels compile for sm_90 and a
recording driver (obskernels.bench.launch) stands in for Triton's C
launcher. Every launch a ``Replay`` makes is made again through Triton's
``kernel[grid](...)`` with the same arguments; the two must reach the
launcher with the same compiled kernel, grid and argument objects, but for
the tensors: a replay hands each one's data pointer (as on a GPU). A call
that Triton would specialise differently must take Triton's path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import compile_pythons, compiled_row, compiling_env, python_id, triton_version

pytestmark = pytest.mark.kernel

WORKER = os.path.join(os.path.dirname(__file__), "replay_worker.py")

# the probe kernel's cases and the path each must take
EXPECTED_PATHS = {
    "new tensors": "replay",
    "free int changes": "replay",  # a do_not_specialize int (an observation's index)
    "free int leaves i32": "triton",
    "free int becomes a bool": "triton",
    "float changes": "replay",
    "float becomes an int": "triton",
    "specialised int changes": "triton",
    "int 1 becomes True": "triton",
    "an equal new tuple": "replay",
    "tuple field becomes a bool": "triton",
    "dtype changes": "triton",
    "misaligned tensor": "triton",
    "misaligned tensor in a tuple": "triton",
    "new tensor in an equal tuple": "replay",
    "dtype changes in a tuple": "triton",
    "scalar beside a tensor in a tuple changes": "triton",  # matched as written: any change
    "tuple of tensors of another type": "triton",
    "aligned after a misaligned kept call": "triton",
    "constexpr changes": "triton",
    "default constexpr given": "triton",  # a call is matched as written: FLAG=False, not left out
    "the site's own keywords": "replay",
    "constexpr default changes": "triton",
    "launch option changes": "triton",
    "another device": "triton",
    "Triton debug knob": "triton",
    "launch hooks": "replay",  # handed what Triton's launch hands them
    "a hook in the default chain": "replay",  # the chain handed, as Triton hands it
    "no launch hooks": "replay",
    "a stream of its own": "replay",
    "a pre-run hook": "triton",
    "replays off": "triton",
    "pointers off": "replay",  # the tensors handed, as Triton hands them
    "a global rebound": "triton",
}


def _worker(python, part):
    assert os.access(python, os.X_OK), f"compile environment {python} does not exist (`make test` creates it)"
    assert triton_version(python), f"{python} has no triton"
    proc = subprocess.run([python, WORKER, part], env=compiling_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"replay worker under {python} failed:\n{proc.stderr[-4000:]}"
    return {row["case"]: row for row in map(json.loads, proc.stdout.splitlines())}


@pytest.fixture(scope="module", params=compile_pythons(), ids=python_id)
def python(request):
    return request.param


def test_a_replay_launches_what_triton_launches_and_only_where_it_would(python):
    rows = _worker(python, "probe")
    assert set(rows) == set(EXPECTED_PATHS)
    for case, want in EXPECTED_PATHS.items():
        row = rows[case]
        assert row["path"] == want, f"{case}: took {row['path']}'s path, expected {want}'s"
        if case == "a global rebound":  # Triton refuses the call; the replay did not launch it
            assert all(e and e.startswith("RuntimeError: Global variable _OFFSET") for e in row["errors"]), row
            continue
        assert row["errors"] == [None, None], f"{case}: {row['errors']}"
        assert row["same_function"] and row["same_grid"] and row["same_args"] and row["same_launch"], \
            f"{case}: the replay's launch differs from Triton's: {row}"
        # a replay hands the launcher its tensors' pointers, unless told not to
        assert row["pointers"] == (want == "replay" and case != "pointers off"), f"{case}: {row}"
        # and leaves out the default hook chain while it holds no hook
        assert row["hooks_dropped"] == (want == "replay" and case not in (
            "launch hooks", "a hook in the default chain", "no launch hooks")), f"{case}: {row}"


def test_every_repeated_observer_launch_is_replayed_as_triton_launches_it(python):
    """The host proxy's scenarios (every observer family, first observations
    with their qparams, repeated forwards, TENSOR_GROUP's global scale), the
    moving-average observers' repeated forwards (their observation index
    counting), an imatrix forward's accumulate_sq and a global scale from
    fused statistics of mixed dtypes (calculate_qparams' absmax launch per
    pair, its constexprs bound by the site): once every launch site
    has launched, no launch takes Triton's path, and each replayed one
    equals Triton's."""
    rows = _worker(python, "observers")
    assert {"minmax call", "activation forward", "memoryless_mse call", "nvfp4_expanded_mse call",
            "imatrix_mse call", "minmax forward", "mse forward", "accumulate_sq",
            "fused calculate_qparams"} <= set(rows)
    for case, row in rows.items():
        assert row["launches"] > 0, case
        assert row["triton_runs"] == 0, f"{case}: {row['triton_runs']} launches took Triton's path"
        assert len(row["replays"]) == row["launches"], case
        for rep in row["replays"]:
            assert rep["same_function"] and rep["same_grid"] and rep["same_args"] and rep["same_launch"], \
                f"{case}: {rep}"
            assert rep["pointers"], f"{case}: a replay handed the launcher a tensor: {rep}"
            assert rep["hooks_dropped"], f"{case}: a replay handed the launcher empty hook chains: {rep}"


def test_launch_proxy_cli_json_rows():
    """``python -m obskernels.bench.launch --json`` (run from this
    interpreted process: it re-runs itself without the interpreter): one row
    per host scenario, every launch replayed, both times measured."""
    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available

    env = dict(compiling_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "obskernels.bench.launch", "--json", "--reps", "3"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["scenario"] for r in rows] == [s.name for s in host.SCENARIOS
                                             if not s.drop_in or llmc_available()]
    for r in rows:
        assert r["launches"] >= 1 and r["triton_runs"] == 0, r
        assert r["replay_us"] > 0 and r["triton_us"] > 0 and r["unit_us"] > 0, r


def _first_use_row(python, scenario, device):
    """One fresh process of ``--first-use``, checked: the kernels are first
    imported in the timed part, Triton's key of its installation is made
    once, in the timed start-up (the calls' compiles neither make it again
    nor hash the installation), and the first call goes through Triton's
    launch path where the second is replayed past it. Returns the process's
    row."""
    row = compiled_row(python, "-m", "obskernels.bench.launch", "--first-use-child", scenario, device)
    assert row["scenario"] == scenario and row["device"] == device, row
    assert row["kernels_imported_before"] is False, row
    assert row["startup_keys"] == 1 and row["hashes_in_calls"] == 0, row
    first, second = row["triton_runs"]
    assert first >= 1 and second == 0, row
    return row


@pytest.mark.parametrize("scenario", ["minmax call", "memoryless_mse call"])
def test_first_use_parts_are_what_they_say(python, scenario):
    """One fresh process of ``python -m obskernels.bench.launch --first-use``
    under each triton: the parts are what they say (``_first_use_row``), and
    they add up (the "second call" is the steady call the first use is
    counted from)."""
    row = _first_use_row(python, scenario, "cpu")
    parts = row["import_s"] + row["triton_startup_s"] + row["first_call_s"] - row["second_call_s"]
    assert row["first_use_s"] == pytest.approx(parts) and row["first_use_s"] > 0, row


@pytest.mark.gpu
def test_first_use_parts_on_cuda():
    """``--first-use``'s CUDA path (``make gpu-check`` runs the command): in a
    fresh process on the GPU the parts are what they say, as on the CPU."""
    _first_use_row(sys.executable, "minmax call", "cuda")


def _compile_into(cache, key, name):
    """What a compile leaves in Triton's disk cache: an entry named by its
    key, holding the kernel's files and their list."""
    entry = cache / key
    entry.mkdir(parents=True)
    (entry / f"{name}.cubin").write_bytes(b"")
    (entry / f"__grp__{name}.json").write_text("{}")


def test_first_use_writes_each_process_as_it_ends(monkeypatch, tmp_path):
    """``--first-use`` reports every fresh process as it ends (a run cut short
    by a time limit keeps them), and the table's figures are the medians of
    the timed processes, the first (which may compile) left out; the key of
    Triton's installation is "kept" where every timed process read it; the
    kernels each process compiled are those it added to Triton's disk cache,
    the first process's apart."""
    import io

    from obskernels.bench import launch

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    _compile_into(cache, "k0", "_earlier_kernel")  # a kernel of an earlier session
    (cache / "obskernels").mkdir()  # not a compile: the kept key's folder
    parts = ("import_s", "triton_startup_s", "first_call_s", "second_call_s", "first_use_s")
    made = iter([[9.0] * 5, [0.1, 0.4, 0.05, 0.001, 0.55], [0.3, 0.2, 0.07, 0.003, 0.45],
                 [0.2, 0.3, 0.06, 0.002, 0.50]])
    compiles = iter([[("k1", "_min_max_kernel"), ("k2", "_qparams_kernel")], [], [("k3", "_min_max_kernel")], []])

    def fake_run(cmd, **kw):
        assert cmd[-3:] == ["--first-use-child", "minmax call", "cuda"]
        values = next(made)
        for key, name in next(compiles):
            _compile_into(cache, key, name)
        # the first process hashes Triton's installation and keeps the key for the others
        row = dict(zip(parts, values), triton_runs=[1, 0], triton_key_kept=values[0] != 9.0)
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    progress = io.StringIO()
    (row,) = launch.first_use(("minmax call",), runs=3, device="cuda", progress=progress)
    lines = progress.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("  minmax call: import 9000.0 ms")
    assert lines[0].endswith(", 2 compiled"), lines[0]
    assert lines[1] == ("  minmax call: import 100.0 ms, triton_startup 400.0 ms, first_call 50.0 ms, "
                        "second_call 1.0 ms, first_use 550.0 ms, 0 compiled")
    assert [row[k] for k in parts] == [0.2, 0.3, 0.06, 0.002, 0.5]
    assert row["triton_key"] == "kept", row
    assert row["filled"] == ["_min_max_kernel", "_qparams_kernel"], row
    assert row["compiled"] == ["_min_max_kernel"], row


def test_compiled_kernels_lists_tritons_disk_cache(monkeypatch, tmp_path):
    """``compiled_kernels``: a cache not made yet holds nothing; each entry
    with a kernel's file list is one compile, by the kernel's name, and each
    with a C module (triton 3.6's launcher of a kernel variant) one, by the
    module's name; other folders are not compiles; a cache kept by another
    kind of manager cannot be listed (None, as ``compiled_since`` then
    says)."""
    from triton.runtime.cache import FileCacheManager

    from obskernels.bench import launch

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert launch.compiled_kernels() == {}
    before = launch.compiled_kernels()
    _compile_into(cache, "a1", "_search_kernel")
    _compile_into(cache, "a2", "_search_kernel")
    (cache / "a3").mkdir()  # a kernel variant's launcher
    (cache / "a3" / "__triton_launcher.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (cache / "obskernels").mkdir()  # the kept key of Triton's installation: no compile
    (cache / "obskernels" / "triton-key-0123").write_text("3.6.0-hash")
    assert launch.compiled_kernels() == {"a1": "_search_kernel", "a2": "_search_kernel",
                                         "a3": "__triton_launcher"}
    assert launch.compiled_since(before) == ["__triton_launcher", "_search_kernel", "_search_kernel"]
    assert launch.compiled_since(launch.compiled_kernels()) == []
    assert launch.compiled_since(None) is None

    class Elsewhere(FileCacheManager):
        pass

    import triton.knobs

    monkeypatch.setattr(triton.knobs.cache, "manager_class", Elsewhere)
    assert launch.compiled_kernels() is None and launch.compiled_since({}) is None


KERNEL_VARIANTS = """
import json, warnings
import triton.knobs as knobs
from obskernels.bench import host, launch
earlier = []
set_before = knobs.runtime.jit_cache_hook = lambda **kw: earlier.append(kw["fn"].name)
sc = next(s for s in host.SCENARIOS if s.name == "minmax call")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    call = host._call_of(sc)
    with launch.compiled_on_cpu(), launch.kernel_variants() as seen:
        call()
        call()  # a variant is set up once per process
print(json.dumps({"seen": seen, "earlier": earlier, "restored": knobs.runtime.jit_cache_hook is set_before}))
"""


@pytest.mark.slow
def test_kernel_variants_are_the_same_in_every_process(python):
    """``kernel_variants``, under each triton, in two processes making the
    same call: each sees the minmax call's kernel variant once, with Triton's
    own specialisation of it (the value's bf16 pointer, the alignment
    attributes), under the same digest in both; a hook set before is called
    for it too and is in place again after the block."""
    runs = []
    for _ in range(2):
        runs.append(compiled_row(python, "-c", KERNEL_VARIANTS))
    first, second = runs
    assert first["seen"] == second["seen"], (first["seen"], second["seen"])
    assert [name for name, _ in first["seen"].values()] == ["_min_max_kernel"], first["seen"]
    ((digest, (_, data)),) = first["seen"].items()
    spec = json.loads(data)
    assert spec["name"].endswith("min_max._min_max_kernel") and spec["signature"]["x_ptr"] == "*bf16", spec
    assert len(digest) == 16 and first["earlier"] == ["_min_max_kernel"] and first["restored"], first


FIRST_USE_COUNTED = """
import json, sys
from obskernels.bench import launch
(row,) = launch.first_use(("minmax call",), runs=1, device="cpu")
print(json.dumps({"filled": row["filled"], "compiled": row["compiled"]}))
"""


@pytest.mark.slow
def test_a_fresh_process_finds_the_kernels_the_one_before_compiled(python, tmp_path):
    """``--first-use`` on an empty Triton cache, under each triton: its first
    process compiles the minmax call's kernel (Triton's key of its
    installation made afresh too, and kept), and the timed process after it
    compiles nothing, every kernel's key being the same in a new process."""
    row = compiled_row(python, "-c", FIRST_USE_COUNTED, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    assert "_min_max_kernel" in row["filled"], row
    assert row["compiled"] == [], row


PROFILED_FIRST_USE = """
import cProfile, sys
from obskernels.bench import launch, oneshot
profiler = cProfile.Profile()
with profiler:
    launch.first_use_child("minmax call", "cpu")
profiler.dump_stats(sys.argv[1])
print(oneshot.profile_summary(sys.argv[1]))
"""


def test_a_profiled_first_use_is_split_into_its_parts(tmp_path):
    """``obskernels.bench.oneshot``'s profile summary (``--profile-fresh``)
    finds the parts of a first use in a real one: a fresh process's first
    minmax call, the kernels compiled for sm_90 (Triton's compile from its
    disk cache, its launch front end, the compiled kernel's module load by
    the recording driver, the kernels' import, Triton's key of its
    installation, here kept or hashed) each found and timed (a module load
    by the recording driver is only counted: it loads nothing)."""
    proc = subprocess.run([sys.executable, "-c", PROFILED_FIRST_USE, str(tmp_path / "first.prof")],
                          env=compiling_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = {k: (float(t), int(n)) for k, t, n in re.findall(r"^  (.+): ([0-9.]+) s \((\d+)\)$",
                                                                proc.stdout, re.M)}
    from obskernels.bench import oneshot

    assert set(parts) == set(oneshot.FIRST_USE_PARTS), proc.stdout[:3000]
    hashed, kept = parts.pop("Triton's hash of its installation"), parts.pop("the key kept by obskernels")
    assert kept[1] == 1 and hashed[1] <= 1 and kept[0] >= hashed[0], proc.stdout[:3000]
    loads = parts.pop("compiled kernels' GPU module loads")  # the recording driver loads nothing
    assert loads[1] >= 1 and all(t > 0 and n >= 1 for t, n in parts.values()), proc.stdout[:3000]
