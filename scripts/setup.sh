#!/usr/bin/env bash
# Installs obskernels (editable) and what its tests and benchmarks need into the
# environment of $PYTHON (the Makefile passes its project venv, .venv/bin/python).
# An installed torch is kept as it is. Without one, a machine with an NVIDIA GPU
# gets torch==$TORCH_VERSION from the configured index; a machine without one
# gets the CPU build: from $TORCH_CPU_INDEX if set (e.g.
# https://download.pytorch.org/whl/cpu, needed where the configured index serves
# the CUDA build, as PyPI does on Linux), else torch==$TORCH_VERSION from the
# configured index and find-links (a local CPU wheel is preferred there: its
# +cpu local version sorts above the plain one).
set -euo pipefail
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
cd "$(dirname "$0")/.."

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing torch $TORCH_VERSION (CUDA build)"
    pip_install "torch==$TORCH_VERSION"
elif [ -n "${TORCH_CPU_INDEX:-}" ]; then
    echo "setup: no GPU, installing CPU torch $TORCH_VERSION from $TORCH_CPU_INDEX"
    pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
else
    echo "setup: no GPU, installing torch $TORCH_VERSION (CPU build where the index provides one)"
    pip_install "torch==$TORCH_VERSION"
fi
# torch is present now, so the project's plain `torch>=` requirement installs nothing more.
pip_install -e ".[test,bench,example]"
# The suite runs the kernels in triton's interpreter on a CPU, and triton 3.6's
# (torch 2.10's and 2.11's) cannot run them beside numpy 2.4 or later: with such
# a triton here, numpy goes below that. The library needs no such bound (a GPU
# compiles the kernels), so only this environment gets it.
numpy_req=$(PYTHONSAFEPATH=1 "$PY" -c "
import importlib.metadata as m, importlib.util as u
from obskernels.backends import interpreter_numpy_requirement as need
print((need(m.version('triton')) or '') if u.find_spec('triton') else '')")
if [ -n "$numpy_req" ]; then
    echo "setup: this triton's interpreter (the suite's on a CPU) needs $numpy_req"
    pip_install "$numpy_req"
fi
PYTHONSAFEPATH=1 "$PY" -c "import torch, obskernels; print('setup: torch', torch.__version__, '| obskernels', obskernels.__version__, '| backends', obskernels.available_backends())"
