"""The triton matrix of the compile check is what pyproject.toml declares.

pyproject.toml's lower bound on triton is the lowest triton the compile check
(tests/kernels/test_kernels_compile.py) runs under: the Makefile builds that
environment (TRITON_LOW, scripts/triton_env.sh) and lists it in
OBSKERNELS_COMPILE_PYTHONS for `make test`; the newest triton is the main
environment's.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _declared_lowest_triton() -> str:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"triton>=([0-9.]+)[;"]', text)
    assert len(found) == 1, f"pyproject.toml should require triton>=X exactly once, found {found}"
    return found[0]


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert m, f"the Makefile sets no {name}"
    return m.group(1)


def _minor(version: str) -> tuple:
    return tuple(int(x) for x in version.split(".")[:2])


def test_pyproject_declares_the_triton_the_makefile_tests():
    declared, tested = _declared_lowest_triton(), _makefile_var("TRITON_LOW")
    assert _minor(declared) == _minor(tested), (
        f"pyproject.toml requires triton>={declared} but `make test` compiles under {tested}")
    assert _minor(declared) >= (3, 6), "triton below 3.6 was never tested"


def test_the_lowest_triton_environment_is_configured_by_make_test():
    """`make test` (and so CI) passes the lowest-triton environment to the
    compile check; outside make there may be none (a targeted run)."""
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env=dict(os.environ, MAKEFLAGS=""))
    assert dry.returncode == 0, dry.stderr
    venv = _makefile_var("TRITON_LOW_VENV")
    assert f"OBSKERNELS_COMPILE_PYTHONS={venv}/bin/python" in dry.stdout, dry.stdout[-2000:]


def test_configured_compile_environments_hold_the_lowest_triton():
    pythons = [p for p in os.environ.get("OBSKERNELS_COMPILE_PYTHONS", "").split(os.pathsep) if p]
    if not pythons:
        pytest.skip("no extra compile environment configured (`make test` configures one)")
    versions = []
    for python in pythons:
        out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"{python}: {out.stderr[-500:]}"
        versions.append(out.stdout.strip())
    assert _minor(_declared_lowest_triton()) in {_minor(v) for v in versions}, versions
