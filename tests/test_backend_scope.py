"""Backend choice per thread and per asyncio task.

``use_backend`` blocks entered concurrently must not see or restore each
other's choice. The tests force the interleaving that leaks with one
process-global variable (every block entered before any computes, blocks
left in a different order than entered), then check two things for each
worker: which backend module ``obskernels.ops`` actually dispatched to (a spy
on the dispatch, recording the calling thread / task), and that its qparams
equal those of the same observation run serially under the same backend.

Only one worker at a time runs the triton backend: triton's interpreter
(TRITON_INTERPRET=1, how these tests run kernels on the CPU) keeps per-launch
state in globals and is not itself thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels import Observer, backends, get_backend, ops, set_backend, use_backend
from helpers import compile_pythons, python_id

# triton installed but unable to run is a failure (use_backend raises), not a skip
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ARGS = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)


def _weight(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g)


def _qparams(seed: int) -> dict:
    obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=ARGS)
    return obs(_weight(seed)).get_qparams()


@pytest.fixture
def spy(monkeypatch):
    """(key, concrete backend) of every dispatched op, first calls of a
    signature and later ones alike; key: thread id or task name."""
    calls: list[tuple[object, str]] = []
    original = ops.backend_module

    def key():
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        return task.get_name() if task is not None else threading.get_ident()

    def recording(name):
        calls.append((key(), name))
        return original(name)

    # a signature seen before runs its kept plan (ops._Plan): its backend counts too
    run = ops._Plan.run

    def recording_run(plan, call):
        calls.append((key(), plan.name))
        return run(plan, call)

    monkeypatch.setattr(ops, "backend_module", recording)
    monkeypatch.setattr(ops._Plan, "run", recording_run)
    # a clean process-wide choice, restored afterwards
    monkeypatch.setattr(backends, "_process_choice", None)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    return calls


def _serial(choices: dict) -> dict:
    out = {}
    for seed, name in choices.items():
        if name is None:
            out[seed] = _qparams(seed)
        else:
            with use_backend(name):
                out[seed] = _qparams(seed)
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    for key in ("scale", "zero_point"):
        assert torch.equal(got[key], want[key]), f"{what} {key}: {got[key]} != {want[key]}"


@needs_triton
@pytest.mark.kernel
def test_threads_each_see_their_own_block(spy):
    set_backend("reference")  # process-wide: what a thread outside any block sees
    # seed -> the block its thread enters (None: no block)
    choices = {1: "triton", 2: "reference", 3: None, 4: "auto"}
    concrete = {"triton": "triton", "reference": "reference", None: "reference", "auto": "triton"}
    entered = threading.Barrier(len(choices))
    # computations take turns: with a leaking choice a reference worker would
    # run the triton interpreter, which is not thread-safe (a crash, not a
    # clean failure); the blocks themselves are all open at once
    turn = threading.Lock()
    results, seen, idents, errors = {}, {}, {}, []
    done = {s: threading.Event() for s in choices}

    def compute(seed, phase):
        with turn:
            seen[(seed, phase)] = get_backend()
            results[(seed, phase)] = _qparams(seed)

    def worker(seed, name):
        try:
            idents[seed] = threading.get_ident()
            block = use_backend(name) if name is not None else contextlib.nullcontext()
            with block:
                entered.wait(timeout=30)  # every block is open before anyone computes
                compute(seed, "all open")
                # leave in reverse seed order, computing again after every later
                # block was left: a restore must not touch other threads' blocks
                for s in choices:
                    if s > seed and not done[s].wait(timeout=60):
                        raise TimeoutError(f"worker {s} did not finish")
                compute(seed, "others left")
            done[seed].set()
            seen[(seed, "after")] = get_backend()
        except BaseException as exc:  # reported in the main thread
            errors.append((seed, exc))
            done[seed].set()
            entered.abort()

    threads = [threading.Thread(target=worker, args=(s, n)) for s, n in choices.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert get_backend() == "reference"

    for seed, name in choices.items():
        for phase in ("all open", "others left"):
            assert seen[(seed, phase)] == (name or "reference"), (seed, phase, seen[(seed, phase)])
        assert seen[(seed, "after")] == "reference", (seed, seen[(seed, "after")])
        used = {b for k, b in spy if k == idents[seed]}
        assert used == {concrete[name]}, f"thread {seed} ({name}) dispatched to {used}"

    spy.clear()
    want = _serial(choices)
    for seed, name in choices.items():
        for phase in ("all open", "others left"):
            _assert_same(results[(seed, phase)], want[seed], f"thread {seed} ({name}), {phase}")


@needs_triton
@pytest.mark.kernel
def test_asyncio_tasks_each_see_their_own_block(spy):
    choices = {1: "reference", 2: "triton", 3: "reference"}

    async def task(seed, name):
        with use_backend(name):
            await asyncio.sleep(0)  # every task enters its block before any computes
            await asyncio.sleep(0)
            assert get_backend() == name
            result = _qparams(seed)
            await asyncio.sleep(0)
        return result

    async def main():
        tasks = [asyncio.create_task(task(s, n), name=f"task{s}") for s, n in choices.items()]
        return dict(zip(choices, await asyncio.gather(*tasks)))

    results = asyncio.run(main())
    for seed, name in choices.items():
        used = {b for k, b in spy if k == f"task{seed}"}
        assert used == {name}, f"task {seed} ({name}) dispatched to {used}"
    assert get_backend() == "auto"
    want = _serial(choices)
    for seed, name in choices.items():
        _assert_same(results[seed], want[seed], f"task {seed} ({name})")


@needs_triton
def test_set_backend_is_process_wide_and_env_is_honoured(spy, monkeypatch):
    seen = {}

    def look(key):
        seen[key] = get_backend()

    def in_thread(key):
        t = threading.Thread(target=look, args=(key,))
        t.start()
        t.join()

    monkeypatch.setenv(backends.ENV_VAR, "reference")
    in_thread("env")
    set_backend("triton")
    in_thread("set")
    with use_backend("reference"):
        in_thread("block elsewhere")  # a block in this thread is not another thread's
        set_backend("auto")  # process-wide; the block still wins here until it exits
        seen["inside after set"] = get_backend()
    seen["after"] = get_backend()
    assert seen == {
        "env": "reference",
        "set": "triton",
        "block elsewhere": "triton",
        "inside after set": "reference",
        "after": "auto",
    }
    with pytest.raises(ValueError, match="backend must be one of"):
        with use_backend("cuda"):
            pass
    assert get_backend() == "auto"


def test_a_block_restores_the_previous_choice_on_error_and_when_nested():
    """The choice before a block comes back when it exits, by an exception
    too, and one block object entered twice (nested) unwinds in order."""
    before = get_backend()
    outer, inner = use_backend("reference"), use_backend("auto")
    with pytest.raises(KeyError):
        with outer:
            assert get_backend() == "reference"
            raise KeyError("inside")
    assert get_backend() == before
    with outer:
        with inner:
            assert get_backend() == "auto"
            with outer:
                assert get_backend() == "reference"
            assert get_backend() == "auto"
        assert get_backend() == "reference"
    assert get_backend() == before


class _PlainEnviron(dict):
    """An ``os.environ`` without CPython's internals (another implementation)."""


@pytest.mark.parametrize("environ", ["os.environ", "plain mapping"])
def test_the_environment_variable_is_read_at_each_operation(monkeypatch, environ):
    """OBSKERNELS_BACKEND as ``os.environ.get`` reads it, whichever reader
    get_backend uses: changes after import count, "" and unset mean "auto",
    case does not matter, and an invalid value is an error at every call
    (not only the first)."""
    monkeypatch.setattr(backends, "_process_choice", None)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    if environ == "plain mapping":
        plain = _PlainEnviron(os.environ)
        monkeypatch.setattr(backends.os, "environ", plain)
        assert backends._environ_dict() is None  # os.environ.get, then
        monkeypatch.setattr(backends, "_ENVIRON", None)
        env = plain
    else:
        assert backends._ENVIRON is not None  # CPython: its dict, read directly
        env = os.environ
    monkeypatch.setattr(backends, "_environ_choice", (None, "auto"))
    seen = []
    for value in (None, "reference", "TRITON", "", "auto", "cuda", "cuda", "Reference", None):
        if value is None:
            env.pop(backends.ENV_VAR, None)
        else:
            env[backends.ENV_VAR] = value
        try:
            seen.append(get_backend())
        except ValueError as exc:
            assert "backend must be one of" in str(exc)
            seen.append("error")
    env.pop(backends.ENV_VAR, None)
    assert seen == ["auto", "reference", "triton", "auto", "auto", "error", "error", "reference", "auto"]
    with use_backend("reference"):
        env[backends.ENV_VAR] = "cuda"  # a block wins: the variable is not read
        assert get_backend() == "reference"
    env.pop(backends.ENV_VAR, None)


@pytest.mark.parametrize("triton_version, numpy_version, unfit", [
    ("3.6.0", "2.4.6", True),
    ("3.6.0+git1a2b3c", "2.5.0", True),
    ("3.6.0", "2.3.5", False),
    ("3.7.1", "2.4.6", False),
    ("3.9.0", "2.4.0rc1", False),
    ("3.10.0", "3.0.0", False),
])
def test_an_interpreter_unfit_for_the_kernels_is_named(triton_version, numpy_version, unfit):
    """Triton 3.6's interpreter turns a loop bound (a one-element array) into
    an int, which numpy 2.4 refuses: the kernels' loops would fail inside."""
    reason = backends.interpreter_unfit_reason(triton_version, numpy_version)
    if not unfit:
        assert reason is None
    else:
        assert triton_version in reason and numpy_version in reason and "triton 3.7" in reason, reason
    wants_numpy_below = "numpy<2.4" if triton_version.startswith("3.6") else None
    assert backends.interpreter_numpy_requirement(triton_version) == wants_numpy_below


@pytest.mark.slow
@pytest.mark.parametrize("python", compile_pythons(), ids=python_id)
def test_the_suite_stops_at_once_under_an_unfit_interpreter(python):
    """The suite under each triton of the compile matrix, its interpreter on:
    where that interpreter cannot run the kernels beside the environment's
    numpy (triton 3.6 beside numpy 2.4 or later, as the matrix's 3.6
    environment has it), it stops before its first test and names the numpy
    to install, instead of failing every test that launches a kernel;
    elsewhere the test asked for runs and passes."""
    versions = subprocess.run([python, "-c", "import numpy, triton; print(triton.__version__, numpy.__version__)"],
                              capture_output=True, text=True, timeout=120, check=True).stdout.split()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_backend_scope.py::test_an_interpreter_unfit_for_the_kernels_is_named"],
        cwd=root, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1"),
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    triton_release, numpy_release = (backends._release(v) for v in versions)
    if triton_release < (3, 7) and numpy_release >= (2, 4):
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
        assert "pip install 'numpy<2.4'" in out and "passed" not in out, out[-3000:]
    else:
        assert proc.returncode == 0 and "6 passed" in out, out[-3000:]


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the interpreter's case")
def test_an_unfit_interpreter_makes_the_triton_backend_unavailable(monkeypatch):
    """Forcing triton says why; "auto" computes with the reference instead."""
    why = backends.interpreter_unfit_reason("3.6.0", "2.4.6")
    backends.triton_unavailable_reason(None)  # the runtime found out, then replaced
    monkeypatch.setattr(backends, "_runtime", [(why, True)])
    value = _weight(3)
    assert "triton" not in backends.available_backends(value)
    assert "triton" not in backends.available_backends()
    with use_backend("auto"):
        assert backends.resolve_backend(value) == "reference"
        mins, _ = ops.min_max(value, "weight", ARGS)
    with use_backend("reference"):
        assert torch.equal(mins, ops.min_max(value, "weight", ARGS)[0])
    with pytest.raises(backends.BackendUnavailableError, match="numpy 2.4"):
        with use_backend("triton"):
            ops.min_max(value, "weight", ARGS)
