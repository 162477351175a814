"""The parity suite's device and `make gpu-check`'s accounting, checked on any machine.

- The ``device`` fixture (tests/conftest.py) is the CPU wherever the kernels
  run interpreted, and every test that takes it is marked ``on_device``,
  which is how `make gpu-check` selects the parity suite for CUDA.
- scripts/gpu_check.py counts the cases per test file from pytest's JUnit
  report: checked on a report written here by hand.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_is_the_cpu_without_cuda_or_under_the_interpreter(device):
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        assert device == "cpu"
    else:  # a GPU and the kernels compiled for it: the parity suite runs there
        assert device == "cuda"
    assert torch.empty(1, device=device).device.type == device


def test_a_test_taking_device_is_marked_on_device(request, device):
    assert request.node.get_closest_marker("on_device") is not None


def test_a_test_without_device_is_not_marked_on_device(request):
    assert request.node.get_closest_marker("on_device") is None
    assert "on_device" in _gpu_check().TEST_SELECTION


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.kernels.mse_search.test_kernels_mse" name="test_parity[a]" time="0.1"/>
<testcase classname="tests.kernels.mse_search.test_kernels_mse" name="test_parity[b]" time="0.1">
  <failure message="boom">trace</failure></testcase>
<testcase classname="tests.kernels.mse_search.test_kernels_mse" name="test_parity_on_cuda[c]" time="0.0">
  <skipped type="pytest.skip" message="needs a CUDA device"/></testcase>
<testcase classname="tests.test_observers" name="test_defaults[x]" time="0.1"/>
<testcase classname="tests.test_observers.TestGroup" name="test_in_a_class" time="0.1"/>
<testcase classname="tests.test_observers" name="test_setup_error" time="0.1">
  <error message="fixture">trace</error></testcase>
</testsuite></testsuites>
"""


def test_gpu_check_counts_cases_per_file(tmp_path):
    gpu_check = _gpu_check()
    path = tmp_path / "tests.xml"
    path.write_text(JUNIT)
    per_file = gpu_check.case_counts(str(path))
    assert {k: dict(v) for k, v in per_file.items()} == {
        "tests/kernels/mse_search/test_kernels_mse.py": {"passed": 1, "failed": 1, "skipped": 1},
        "tests/test_observers.py": {"passed": 2, "error": 1},
    }
    rows = gpu_check.counts_table(per_file)
    assert rows[2] == "| tests/kernels/mse_search/test_kernels_mse.py | 3 | 2 | 1 | 1 | 0 | 1 |"
    assert rows[3] == "| tests/test_observers.py | 3 | 3 | 2 | 0 | 1 | 0 |"
    assert rows[-1] == "| **all** | 6 | 5 | 3 | 1 | 1 | 1 |"


def test_gpu_check_steps_follow_the_environment():
    """Four steps by default (the full bench with the model, "model", only
    when named), in their order whatever the list's; the tests alone under
    GPU_CHECK_TESTS_ONLY=1; an unknown step is an error naming it (a typo
    never silently skips a measurement)."""
    steps_of = _gpu_check().steps_of
    assert steps_of({}) == ["tests", "host", "oneshot", "bench"]
    assert steps_of({"GPU_CHECK_TESTS_ONLY": "1", "GPU_CHECK_STEPS": "host"}) == ["tests"]
    assert steps_of({"GPU_CHECK_STEPS": "oneshot, host"}) == ["host", "oneshot"]
    assert steps_of({"GPU_CHECK_STEPS": "model,tests"}) == ["tests", "model"]
    with pytest.raises(ValueError, match="'hots'"):
        steps_of({"GPU_CHECK_STEPS": "hots,oneshot"})


def test_gpu_check_time_limits_follow_the_environment():
    gc = _gpu_check()
    assert gc.timeouts_of({}) == gc.TIMEOUTS
    got = gc.timeouts_of({"GPU_CHECK_TIMEOUTS": "tests=120, oneshot=90.5"})
    assert got["tests"] == 120 and got["oneshot"] == 90.5 and got["host"] == gc.TIMEOUTS["host"]
    with pytest.raises(ValueError, match="'test'"):
        gc.timeouts_of({"GPU_CHECK_TIMEOUTS": "test=120"})
    with pytest.raises(ValueError, match="'tests:120'"):
        gc.timeouts_of({"GPU_CHECK_TIMEOUTS": "tests:120"})


def test_gpu_check_runs_the_tests_on_workers_where_it_can():
    workers = _gpu_check().pytest_workers
    assert workers(True, 16) == ["-n", "12"]
    assert workers(True, 4) == ["-n", "3"]
    assert workers(True, 2) == [] and workers(False, 16) == []


def test_a_step_past_its_limit_is_interrupted_and_keeps_its_log(tmp_path):
    """The command is interrupted as pytest would be (SIGINT: it still writes
    what it has), its exit status is 124, and its log holds what it printed
    before the limit and the reason it stopped."""
    script = ("import sys, time\nprint('row 1', flush=True)\n"
              "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('summary so far', flush=True)\n    sys.exit(2)\n")
    log = tmp_path / "step.log"
    rc, text = _gpu_check()._run([sys.executable, "-c", script], None, str(log), timeout=3)
    assert rc == 124
    assert text.splitlines()[:2] == ["row 1", "summary so far"]
    assert "stopped after its 3 s limit" in text and log.read_text() == text
    rc, text = _gpu_check()._run([sys.executable, "-c", "print('done')"], None, str(log), timeout=30)
    assert (rc, text) == (0, "done\n")
