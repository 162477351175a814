"""The layers' import rule, read from the source.

``kernels/`` (obskernels.kernels) and ``reference/`` (obskernels.reference)
stand on ``obskernels.spec`` only: neither imports the other (a kernel that
took its step count from the oracle it is tested against would pass parity
while both are wrong), nor the front (obskernels.ops, .backends, .observers,
.validation, ...). Besides, they may import torch, triton, numpy,
compressed-tensors and the standard library.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = {"torch", "triton", "numpy", "compressed_tensors"}
LAYERS = {"kernels": "obskernels.kernels", "reference": "obskernels.reference"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``, nested ones included;
    ``from obskernels import x`` counts as ``obskernels.x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the layer's own package
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module == "obskernels":
                found += [(node.lineno, f"obskernels.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def allowed(module: str, own: str) -> bool:
    if module.startswith("."):
        return True
    top = module.split(".")[0]
    if top == "obskernels":
        return any(module == p or module.startswith(p + ".") for p in ("obskernels.spec", own))
    if top == "__future__" or top in sys.stdlib_module_names:
        return True
    return top in THIRD_PARTY


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_backends_import_only_spec(folder):
    own = LAYERS[folder]
    files = sorted((ROOT / folder).rglob("*.py"))  # subpackages too (a details package)
    assert files, f"no modules found in {folder}/"
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module in imported_modules(path)
        if not allowed(module, own)
    ]
    assert not bad, f"{folder}/ may import only obskernels.spec and {own}:\n" + "\n".join(bad)


# What checks input: the rules of spec.checks, the flattening check and the
# call builders of spec.calls (lower-case; its call types are CamelCase).
CHECKING = re.compile(r"^(check_\w+|flattening|strategy_of|group_size_of|block_shape|unsupported)$")


def checking_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module.name) of every name ``path`` imports from obskernels.spec
    that checks input."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("obskernels.spec")):
            continue
        for alias in node.names:
            builder = (node.module == "obskernels.spec.calls" and alias.name[:1].islower()) or (
                node.module == "obskernels.spec" and alias.name == "calls")
            if CHECKING.match(alias.name) or builder:
                found.append((node.lineno, f"{node.module}.{alias.name}"))
    return found


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_backends_check_nothing(folder):
    """The front checks each call once (obskernels.spec.calls) and hands the
    checked call down: neither backend imports a check."""
    files = sorted((ROOT / folder).rglob("*.py"))
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in files
           for line, name in checking_imports(path)]
    assert not bad, f"{folder}/ imports input checks:\n" + "\n".join(bad)


def test_the_check_rule_catches_a_check(tmp_path):
    leak = tmp_path / "leak.py"
    leak.write_text(
        "from obskernels.spec.checks import check_status\n"
        "from obskernels.spec.record import STATUS_NAN\n"
        "from obskernels.spec.calls import MinMaxCall, min_max\n"
        "def f():\n    from obskernels.spec.layout import Flattening, flattening\n"
    )
    got = [name for _, name in checking_imports(leak)]
    assert got == ["obskernels.spec.checks.check_status", "obskernels.spec.calls.min_max",
                   "obskernels.spec.layout.flattening"]


def test_spec_stands_alone():
    """The bottom layer imports neither backend nor the front, and no triton
    (``import obskernels`` works without it)."""
    files = sorted((ROOT / "obskernels" / "spec").glob("*.py"))
    assert files
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module in imported_modules(path)
        if not allowed(module, "obskernels.spec") or module.split(".")[0] == "triton"
    ]
    assert not bad, "obskernels/spec may import only itself:\n" + "\n".join(bad)


def test_the_rule_catches_a_cross_import(tmp_path):
    """The reader above sees the forms a leak would take."""
    leak = tmp_path / "leak.py"
    leak.write_text(
        "from obskernels.reference.mse_search import num_steps\n"
        "def f():\n    from obskernels import ops\n    import obskernels.backends\n"
    )
    got = [m for _, m in imported_modules(leak) if not allowed(m, "obskernels.kernels")]
    assert got == ["obskernels.reference.mse_search", "obskernels.ops", "obskernels.backends"]


FRONT = ("obskernels.backends", "obskernels.observers", "obskernels.ops", "obskernels.tools",
         "obskernels.calibration", "obskernels.kernels")


def _loaded_after(statement: str) -> list[str]:
    code = (
        "import sys\n"
        f"{statement}\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('obskernels'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir())
    return out.stdout.split()


def test_importing_the_reference_loads_no_front():
    loaded = _loaded_after("import obskernels.reference")
    assert "obskernels.reference" in loaded and "obskernels.spec" in loaded
    leaked = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FRONT)]
    assert not leaked, f"import obskernels.reference loaded {leaked}"


def test_importing_the_kernels_loads_no_front():
    pytest.importorskip("triton")
    loaded = _loaded_after("import obskernels.kernels")
    front = [f for f in FRONT if f != "obskernels.kernels"] + ["obskernels.reference"]
    leaked = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in front)]
    assert not leaked, f"import obskernels.kernels loaded {leaked}"


SEARCH_MODULES = ("obskernels.kernels.mse_search", "obskernels.kernels.mse_search_details")


def test_the_search_kernels_are_imported_at_their_first_use():
    """Importing the kernels, and a min / max observation through them,
    leaves the search's modules unimported (a third of the kernels' import);
    ``obskernels.kernels.mse_search`` is the launcher whichever way the
    search is first imported: through the attribute, or as its submodule of
    the same name (the import system then binds the module to that name)."""
    pytest.importorskip("triton")
    after_min_max = _loaded_after(
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch, obskernels.kernels\n"
        "from compressed_tensors.quantization import QuantizationArgs\n"
        "from obskernels import ops\n"
        "from obskernels.backends import use_backend\n"
        "with use_backend('triton'):\n"
        "    ops.min_max_qparams(torch.randn(8, 32), 'weight', QuantizationArgs(num_bits=8, strategy='channel'))")
    assert "obskernels.kernels.min_max" in after_min_max, after_min_max
    assert not [m for m in after_min_max if m.startswith(SEARCH_MODULES)], after_min_max
    for first in ("import obskernels.kernels as k; k.mse_search",
                  "import importlib; importlib.import_module('obskernels.kernels.mse_search')"):
        loaded = _loaded_after(
            f"{first}\nimport obskernels.kernels as k, obskernels.kernels.mse_search\n"
            "m = sys.modules['obskernels.kernels.mse_search']\n"
            "assert k.mse_search is m.mse_search and k.mse_search_qparams is m.mse_search_qparams")
        assert "obskernels.kernels.mse_search" in loaded, (first, loaded)


@pytest.mark.parametrize("built, then", [("0", "1"), ("1", "0")])
def test_the_search_kernels_are_built_as_the_package_was(built, then):
    """Triton builds a kernel for its interpreter or its compiler by
    TRITON_INTERPRET at decoration: the search's kernels, imported at their
    first use, are built as the rest of the package was even where the
    variable changed in between (the compile report's tools switch it)."""
    pytest.importorskip("triton")
    code = (
        "import os, sys\n"
        f"os.environ['TRITON_INTERPRET'] = '{built}'\n"
        "import obskernels.kernels as k\n"
        f"os.environ['TRITON_INTERPRET'] = '{then}'\n"
        "from obskernels.kernels.mse_search import _search_kernel, _choose_kernel\n"
        "from obskernels.kernels.quant_pow import abs_pow\n"
        "from obskernels.kernels.min_max import _min_max_kernel\n"
        "kinds = {type(f).__name__ for f in (_search_kernel, _choose_kernel, abs_pow, _min_max_kernel)}\n"
        "assert kinds == {type(_min_max_kernel).__name__}, kinds\n"
        "assert os.environ['TRITON_INTERPRET'] == '" + then + "'\n"
        "print(type(_min_max_kernel).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("InterpretedFunction" if built == "1" else "JITFunction")


# The front's own rule: observers, calibration and the llm-compressor drop-in
# hold state and call obskernels.ops; they neither choose a backend nor reach
# a backend's code (one path for an observation: front -> ops -> backend).
FRONT_CALLERS = [ROOT / "obskernels" / "observers", ROOT / "obskernels" / "calibration",
                 ROOT / "obskernels" / "integrations" / "llmcompressor.py"]
FRONT_MAY_NOT = ("obskernels.backends.resolve_backend", "obskernels.reference", "obskernels.kernels")


def _front_files():
    for p in FRONT_CALLERS:
        yield from (sorted(p.rglob("*.py")) if p.is_dir() else [p])


def test_observers_compute_only_through_ops():
    bad = []
    for path in _front_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if any(name == m or name.startswith(m + ".") for m in FRONT_MAY_NOT):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
            if isinstance(node, ast.Name) and node.id == "resolve_backend":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses resolve_backend")
    assert not bad, "\n".join(bad)
