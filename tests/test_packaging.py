"""The installed package, imported from outside the source tree.

``pip install --target`` puts a non-editable build of this checkout in a
temporary folder; a subprocess with only that folder on its path (cwd there,
PYTHONSAFEPATH=1) must import ``obskernels`` and ``obskernels.reference`` from
it, and nothing named plain ``kernels`` or ``reference`` may be installed.
From the source root itself, with transformers installed, the import works too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
{prelude}
import obskernels, obskernels.reference, obskernels.observers
print(json.dumps({{
    "obskernels": obskernels.__file__,
    "reference": obskernels.reference.__file__,
    "observers": obskernels.observers.__file__,
    "backends": obskernels.available_backends(),
    "observer": type(obskernels.Observer.load_from_registry(
        "minmax", base_name="input",
        args=__import__("compressed_tensors").quantization.QuantizationArgs(num_bits=8),
    )).__name__,
    "triton_loaded": "triton" in sys.modules and sys.modules["triton"] is not None,
}}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "--target", str(target), str(REPO_ROOT)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return target


def _probe(target: Path, prelude: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OBSKERNELS_BACKEND")}
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=str(target), PYTHONNOUSERSITE="1")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(prelude=prelude)],
        cwd=target, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_installed_package_layout(installed):
    assert (installed / "obskernels" / "__init__.py").is_file()
    assert (installed / "obskernels" / "kernels" / "__init__.py").is_file()
    assert (installed / "obskernels" / "reference" / "__init__.py").is_file()
    assert not (installed / "kernels").exists()
    assert not (installed / "reference").exists()
    # every subpackage of the source tree is installed
    for init in (REPO_ROOT / "obskernels").glob("*/__init__.py"):
        assert (installed / "obskernels" / init.parent.name / "__init__.py").is_file(), init
    # and of the top-level backend folders (e.g. a kernel's details package)
    for folder in ("kernels", "reference"):
        for init in (REPO_ROOT / folder).glob("*/__init__.py"):
            assert (installed / "obskernels" / folder / init.parent.name / "__init__.py").is_file(), init


@pytest.mark.slow
def test_import_from_outside_the_source_tree(installed):
    found = _probe(installed)
    root = installed.resolve() / "obskernels"
    for key in ("obskernels", "reference", "observers"):
        assert Path(found[key]).resolve().is_relative_to(root), (key, found[key])
    assert found["observer"] == "MinMaxObserver"


@pytest.mark.slow
def test_import_without_triton(installed):
    # None in sys.modules makes `import triton` raise ImportError
    found = _probe(installed, prelude="sys.modules['triton'] = None")
    assert Path(found["obskernels"]).resolve().is_relative_to(installed.resolve() / "obskernels")
    assert "triton" not in found["backends"]
    assert found["backends"] == ["auto", "reference"]
    assert not found["triton_loaded"]


ROOT_PROBE = """
import importlib.util, json, sys
import obskernels, obskernels.reference
import transformers
from transformers.utils import is_kernels_available
from transformers import PreTrainedModel  # loads transformers' hub-kernels integration
if importlib.util.find_spec("triton") is not None:
    import obskernels.kernels
    assert callable(obskernels.kernels.mse_search)
top = sys.modules.get("kernels")
print(json.dumps({
    "obskernels": obskernels.__file__,
    "reference": obskernels.reference.__file__,
    "mse_search": callable(obskernels.reference.mse_search),
    "kernels_available": is_kernels_available(),
    "top_kernels": None if top is None else getattr(top, "__file__", None),
    "top_kernels_names": None if top is None else sorted(n for n in vars(top) if not n.startswith("_")),
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed: nothing probes a package named `kernels`")
def test_import_from_the_repository_root_with_transformers():
    """From the source root (cwd first on sys.path, no PYTHONSAFEPATH) the
    top-level kernels/ folder is visible as a package named plain `kernels`,
    which transformers imports to probe for the hub's kernel loader. The
    import must work, and the folder must not pass for that package."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "OBSKERNELS_BACKEND")}
    proc = subprocess.run(
        [sys.executable, "-c", ROOT_PROBE],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["obskernels"]).resolve().is_relative_to(REPO_ROOT / "obskernels")
    assert Path(found["reference"]).resolve().is_relative_to(REPO_ROOT / "reference")
    assert found["mse_search"]
    if found["top_kernels"] is not None and Path(found["top_kernels"]).resolve().is_relative_to(REPO_ROOT):
        # the probe imported our folder: it must be empty under that name
        assert found["top_kernels_names"] == [], found["top_kernels_names"]
        assert not found["kernels_available"]


@pytest.mark.slow
def test_suite_collects_without_triton():
    """Where triton is missing, the modules that need it skip at collection
    (each says why) and every other test is still collected: no collection
    error. ``None`` in sys.modules makes every ``import triton`` fail."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-rs', '-p', 'no:cacheprovider', 'tests']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OBSKERNELS_BACKEND")}
    env.update(PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "error" not in out.lower().split("short test summary info")[-1], out[-4000:]
    skipped = {line.split(".py")[0].rsplit("/", 1)[-1]  # the module's name, in any folder of tests/
               for line in out.splitlines() if line.startswith("SKIPPED") and "need triton" in line}
    assert "test_kernels_mse" in skipped and "test_kernels_quant" in skipped, skipped
    assert "tests/test_reference.py::" in out  # triton-free modules are collected


LAZY_PROBE = """
import json, os, sys, torch
import obskernels
from obskernels import ops
from compressed_tensors.quantization import QuantizationArgs
args = QuantizationArgs(num_bits=8, strategy="channel", symmetric=True)
value = torch.randn(4, 16)
mins, maxs = ops.min_max(value, "weight", args)
found = {
    "exact": torch.equal(mins.flatten(), value.amin(dim=1)) and torch.equal(maxs.flatten(), value.amax(dim=1)),
    "kernels_imported": "obskernels.kernels" in sys.modules,
}
os.environ["OBSKERNELS_BACKEND"] = "triton"
try:
    ops.min_max(value, "weight", args)
except obskernels.BackendUnavailableError as exc:
    found["forced"] = str(exc)
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_cpu_only_process_runs_the_reference_without_importing_the_kernels():
    """Without the interpreter, "auto" on a CPU tensor runs the reference and
    does not import the kernels (which would be built for a GPU, ~0.1 s, at
    the first operation); forcing triton there still says why it cannot run."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "OBSKERNELS_BACKEND", "TRITON_INTERPRET")}
    env.update(PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, "-c", LAZY_PROBE], cwd=REPO_ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["exact"] and not found["kernels_imported"], found
    assert found["forced"] == ("backend 'triton' cannot run: CPU tensors need TRITON_INTERPRET=1 set "
                               "before triton is imported"), found
