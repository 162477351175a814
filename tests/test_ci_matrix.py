"""The triton matrix of the compile check is what pyproject.toml declares.

pyproject.toml's lower bound on triton is the lowest triton the compile check
(tests/kernels/test_kernels_compile.py) runs under: the Makefile builds that
environment (TRITON_LOW, scripts/triton_env.sh), one for each minor release
between it and the newest (TRITON_BETWEEN: what torch 2.12 to 2.14 pin), and
lists them in OBSKERNELS_COMPILE_PYTHONS for `make test`; the newest triton
is the main environment's.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import pytest

from obskernels.backends import _release

REPO_ROOT = Path(__file__).resolve().parents[1]


def _declared_lowest_triton() -> str:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"triton>=([0-9.]+)[;"]', text)
    assert len(found) == 1, f"pyproject.toml should require triton>=X exactly once, found {found}"
    return found[0]


def _makefile_list(name: str) -> list:
    m = re.search(rf"^{name}\s*\?=\s*(.*)$", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert m and m.group(1).split(), f"the Makefile sets no {name}"
    return m.group(1).split()


def _makefile_var(name: str) -> str:
    return _makefile_list(name)[0]


def test_pyproject_declares_the_triton_the_makefile_tests():
    declared, tested = _declared_lowest_triton(), _makefile_var("TRITON_LOW")
    assert _release(declared) == _release(tested), (
        f"pyproject.toml requires triton>={declared} but `make test` compiles under {tested}")
    assert _release(declared) >= (3, 6), "triton below 3.6 was never tested"


def test_every_minor_triton_from_the_lowest_to_the_newest_is_compiled_under():
    """No triton a user's torch may pin is skipped: the lowest, each minor
    release between, and the main environment's (the newest)."""
    low, between = _makefile_var("TRITON_LOW"), _makefile_list("TRITON_BETWEEN")
    newest = importlib.metadata.version("triton")
    minors = sorted({_release(v) for v in [low, *between, newest]})
    assert len({major for major, _ in minors}) == 1, f"a new major triton: revise the matrix {minors}"
    first, last = minors[0][1], minors[-1][1]
    assert minors == [(minors[0][0], m) for m in range(first, last + 1)], (
        f"the compile matrix {minors} skips a minor release between triton {low} and {newest}")


def test_the_triton_environments_are_configured_by_make_test():
    """`make test` (and so CI) passes the lowest-triton environment and those
    between it and the newest to the compile check; outside make there may
    be none (a targeted run)."""
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env=dict(os.environ, MAKEFLAGS=""))
    assert dry.returncode == 0, dry.stderr
    m = re.search(r"OBSKERNELS_COMPILE_PYTHONS=(\S+)", dry.stdout)
    assert m, dry.stdout[-2000:]
    listed = m.group(1).split(":")
    assert listed[0] == f"{_makefile_var('TRITON_LOW_VENV')}/bin/python", listed
    for version in _makefile_list("TRITON_BETWEEN"):
        major, minor = _release(version)
        assert f".venv-triton{major}{minor}/bin/python" in listed, (version, listed)


def test_configured_compile_environments_hold_the_tritons_of_the_matrix():
    pythons = [p for p in os.environ.get("OBSKERNELS_COMPILE_PYTHONS", "").split(os.pathsep) if p]
    if not pythons:
        pytest.skip("no extra compile environment configured (`make test` configures them)")
    versions = []
    for python in pythons:
        out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"{python}: {out.stderr[-500:]}"
        versions.append(out.stdout.strip())
    configured = {_release(v) for v in versions}
    wanted = [_declared_lowest_triton(), *_makefile_list("TRITON_BETWEEN")]
    assert all(_release(v) in configured for v in wanted), (wanted, versions)
