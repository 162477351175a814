"""Triton's once-per-process start-up, made once per installation instead.

Before its first compile in a process (a kernel already in its disk cache
included) Triton hashes its own installation into every kernel's cache key:
``triton.runtime.cache.triton_key`` reads ~500 source files and its
400-500 MB library, 0.3-0.5 s on the development CPU and on an H100's host.
Every fresh process pays it, before its first triton-backend call, and it is
most of what such a first call costs.

``install()`` (run when obskernels.kernels is imported) puts in that
function's place, where Triton's ``get_cache_key`` looks it up at each
compile, one that returns the same string without hashing: the string Triton
made, kept in Triton's cache directory under the installation's signature
(Triton's version and path, the interpreter's extension suffix, and the
size, modification and change times and inode of every file of the triton
package but bytecode). A file replaced, rebuilt or edited changes the
signature: then Triton's own function makes the key and it is kept again.
So a kernel's cache key, and which compiled kernel Triton loads, are what
they would have been; ``tests/kernels/test_triton_key.py`` checks the kept
string against Triton's own and a compile through it against a compile
without it.

A kept key that cannot be read, or a cache directory that cannot be written,
only means Triton's own function runs. Where another tool replaced the
function already (Triton's own compile workers do) it is left alone.
``OBSKERNELS_TRITON_KEY_CACHE=0`` turns this off (read at import).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sysconfig

import triton
import triton.runtime.cache as _cache

__all__ = ["install", "ENABLED", "signature", "kept_key"]

ENABLED = os.environ.get("OBSKERNELS_TRITON_KEY_CACHE", "1") != "0"

_FORMAT = "obskernels-triton-key-1"


def signature(root: str, version: str) -> str:
    """The installation under ``root`` as its files stand: a sha256 of the
    version, the path, the extension suffix, and per file (sorted, bytecode
    left out) its relative path, size, mtime, ctime and inode."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\0{version}\0{os.path.abspath(root)}\0{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            st = os.stat(path)
            h.update(f"\0{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\0"
                     f"{st.st_ctime_ns}\0{st.st_ino}".encode())
    return h.hexdigest()


def kept_key(own, root: str, version: str, cache_dir: str) -> str:
    """Triton's key for the installation under ``root``: read from
    ``cache_dir`` where it was kept under the installation's signature,
    else made by ``own()`` (Triton's function) and kept there."""
    try:
        path = os.path.join(cache_dir, "obskernels", f"triton-key-{signature(root, version)}")
    except OSError:
        return own()
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read()
        if key.startswith(version) and len(key) > len(version):
            return key
    except (OSError, UnicodeDecodeError):
        pass
    key = own()
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(key)
        os.replace(tmp, path)  # whole or not at all, for another process reading it
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return key


def install() -> None:
    """Puts the kept key in place of ``triton.runtime.cache.triton_key``
    (once; not where ``ENABLED`` is off or the function was replaced
    before)."""
    own = _cache.triton_key
    if not ENABLED or not hasattr(getattr(triton, "knobs", None), "cache"):
        return
    if getattr(own, "obskernels_own", None) is not None or not hasattr(own, "cache_info"):
        return  # installed already, or not Triton's own cached function

    @functools.lru_cache(maxsize=None)
    def triton_key() -> str:
        return kept_key(own, os.path.dirname(os.path.abspath(triton.__file__)), triton.__version__,
                        triton.knobs.cache.dir)

    triton_key.obskernels_own = own  # Triton's function, which made the key
    _cache.triton_key = triton_key
