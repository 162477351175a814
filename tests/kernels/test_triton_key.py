"""Triton's key of its installation, kept across processes
(kernels/_triton_key.py): the kept string is Triton's own, a compile through
it finds the kernels a compile without it made, and a changed installation
is hashed again.

The subprocess test runs under each triton of ``compile_pythons()``, without
TRITON_INTERPRET (the kernels compile for sm_90 and a recording driver takes
their launches), each with a Triton cache directory of its own.
"""

from __future__ import annotations

import functools
import os

import pytest
from helpers import compile_pythons, compiled_row, python_id

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

from obskernels.kernels import _triton_key  # noqa: E402 - needs triton

# a fresh process's first minmax call (obskernels.bench.launch), then Triton's
# own hash made in the same process and the kernels compiled into the cache
WORKER = """
import json, os
import triton.runtime.cache as cache
from obskernels.bench import launch
row = launch.first_use_child("minmax call", "cpu")
own = getattr(cache.triton_key, "obskernels_own", cache.triton_key)
row["same_key"] = cache.triton_key() == own()
row["cache"] = sorted(os.listdir(os.environ["TRITON_CACHE_DIR"]))
print(json.dumps(row))
"""


def _process(python, cache_dir, keep):
    return compiled_row(python, "-c", WORKER, TRITON_CACHE_DIR=str(cache_dir),
                        OBSKERNELS_TRITON_KEY_CACHE="1" if keep else "0")


@pytest.mark.slow
@pytest.mark.parametrize("python", compile_pythons(), ids=python_id)
def test_a_kept_key_is_tritons_own_and_finds_the_same_compiled_kernels(python, tmp_path):
    """Three fresh processes on one Triton cache: without the kept key
    (Triton hashes its installation and compiles the minmax call's kernels),
    with it for the first time (Triton hashes, the key is kept), with it
    again (read, not hashed). Each process's key equals Triton's own hash
    made in the same process, and the later processes compile nothing new:
    every kernel's cache key, which the installation's key is part of, is
    the one the first process compiled under."""
    plain = _process(python, tmp_path, keep=False)
    assert not plain["triton_key_kept"] and plain["same_key"], plain
    compiled = plain["cache"]
    assert compiled and "obskernels" not in compiled, plain  # kernels, no key kept

    first = _process(python, tmp_path, keep=True)
    assert not first["triton_key_kept"] and first["same_key"], first
    assert first["cache"] == sorted(compiled + ["obskernels"]), first

    kept = _process(python, tmp_path, keep=True)
    assert kept["triton_key_kept"] and kept["same_key"], kept
    assert kept["startup_keys"] == 1 and kept["hashes_in_calls"] == 0, kept
    assert kept["cache"] == first["cache"], kept


def _tree(root):
    """A stand-in installation: sources, a library, bytecode."""
    for rel, text in {"cache.py": "a", "language/core.py": "bb", "_C/libtriton.so": "ccc",
                      "__pycache__/cache.cpython-311.pyc": "d"}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _counting(version):
    made = []

    def own():
        made.append(1)
        return f"{version}-hash{len(made)}"

    return own, made


def _edit(path, text):
    """Rewrites ``path`` as an editor or an installer would: new content, a
    later modification time."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_kept_key_is_read_until_the_installation_changes(tmp_path):
    """The key is made by Triton's function once and read after; any file
    of the installation edited or added, or another version, makes it
    again; bytecode written beside the sources does not. An installation
    back as it was finds the key kept for it."""
    root, cache = tmp_path / "triton", tmp_path / "cache"
    _tree(root)
    own, made = _counting("3.9.0")

    def key(version="3.9.0"):
        return _triton_key.kept_key(own, str(root), version, str(cache))

    assert key() == "3.9.0-hash1" and len(made) == 1
    assert key() == "3.9.0-hash1" and len(made) == 1
    _edit(root / "__pycache__" / "cache.cpython-311.pyc", "e")
    assert key() == "3.9.0-hash1" and len(made) == 1
    _edit(root / "language" / "core.py", "bc")  # same size
    assert key() == "3.9.0-hash2" and len(made) == 2
    (root / "language" / "semantic.py").write_text("f")
    assert key() == "3.9.0-hash3" and len(made) == 3
    (root / "language" / "semantic.py").unlink()
    assert key() == "3.9.0-hash2" and len(made) == 3  # the installation as it was: its key, kept
    own_36, made_36 = _counting("3.6.0")
    assert _triton_key.kept_key(own_36, str(root), "3.6.0", str(cache)) == "3.6.0-hash1" and len(made_36) == 1


def test_a_kept_key_that_cannot_be_read_or_written_is_made_by_triton(tmp_path):
    """A kept file that is not a key of this version is made again and
    replaced; a cache directory that cannot be written only means Triton's
    function runs every time (no error)."""
    root, cache = tmp_path / "triton", tmp_path / "cache"
    _tree(root)
    own, made = _counting("3.9.0")
    assert _triton_key.kept_key(own, str(root), "3.9.0", str(cache)) == "3.9.0-hash1"
    (kept,) = (cache / "obskernels").iterdir()
    kept.write_text("3.6.0-stale")
    assert _triton_key.kept_key(own, str(root), "3.9.0", str(cache)) == "3.9.0-hash2"
    assert kept.read_text() == "3.9.0-hash2" and len(made) == 2

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    for n in (3, 4):
        assert _triton_key.kept_key(own, str(root), "3.9.0", str(blocked)) == f"3.9.0-hash{n}"


def test_install_leaves_a_replaced_function_alone(monkeypatch):
    """Where the function is not Triton's own cached one any more (another
    tool put a key in its place, as Triton's compile workers do), or the
    kept key is turned off, ``install`` changes nothing; else it puts the
    kept key in place once, holding Triton's function."""
    import triton.runtime.cache as cache

    def elsewhere():
        return "x"

    monkeypatch.setattr(cache, "triton_key", elsewhere)
    _triton_key.install()
    assert cache.triton_key is elsewhere

    own = functools.lru_cache()(lambda: "3.9.0-own")  # as Triton's own is
    monkeypatch.setattr(cache, "triton_key", own)
    monkeypatch.setattr(_triton_key, "ENABLED", False)
    _triton_key.install()
    assert cache.triton_key is own
    monkeypatch.setattr(_triton_key, "ENABLED", True)
    _triton_key.install()
    installed = cache.triton_key
    assert installed is not own and installed.obskernels_own is own
    _triton_key.install()
    assert cache.triton_key is installed
