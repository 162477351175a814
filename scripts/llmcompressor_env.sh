#!/usr/bin/env bash
# Creates (or refreshes) a separate virtual environment with llm-compressor 0.14
# and obskernels installed side by side, for the drop-in tests
# (`make test-llmcompressor`) and for benchmark rows that run llm-compressor.
#
# It is separate from the main environment on purpose: llm-compressor 0.14 pins
# compressed-tensors 0.19 and transformers <= 5.17, older than the main one.
#
#   VENV=.venv-llmcompressor   where the environment goes (gitignored via .venv*/)
#   TORCH_VERSION=2.13.0       installed FIRST, so that llm-compressor's own
#                              torch requirement is already met and no other
#                              build (e.g. the CUDA wheels on a CPU machine) is pulled
#   TORCH_CPU_INDEX            optional index URL for a CPU torch build
#   LLMCOMPRESSOR_VERSION=0.14.0.1
#   WITH_TRITON=auto           auto: install triton when the main interpreter has
#                              it (the drop-in's triton backend); 0: never; 1: always
#
# Prints the environment's python path on its last line. Re-running is cheap: a
# stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Keeps the repo root off sys.path: its kernels/ folder must never be imported
# as a package named `kernels` (transformers probes for one).
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-llmcompressor}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LLMCOMPRESSOR_VERSION=${LLMCOMPRESSOR_VERSION:-0.14.0.1}
WITH_TRITON=${WITH_TRITON:-auto}

if [ "$WITH_TRITON" = auto ]; then
    if "$PY" -c "import triton" 2>/dev/null; then WITH_TRITON=1; else WITH_TRITON=0; fi
fi
TRITON_SPEC=""
if [ "$WITH_TRITON" = 1 ]; then
    TRITON_SPEC="triton==$("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo 3.9.0)"
fi

want="torch=$TORCH_VERSION llmcompressor=$LLMCOMPRESSOR_VERSION $TRITON_SPEC"
stamp="$VENV/.obskernels-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    # Only the editable obskernels needs refreshing (its metadata, not its code).
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e . >/dev/null
    echo "llmcompressor env: up to date ($want)" >&2
    echo "$VENV/bin/python"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

pip_install --upgrade pip >/dev/null 2>&1 || true
echo "llmcompressor env: torch $TORCH_VERSION" >&2
if [ -n "${TORCH_CPU_INDEX:-}" ]; then
    pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
else
    pip_install "torch==$TORCH_VERSION"
fi
if [ -n "$TRITON_SPEC" ]; then
    echo "llmcompressor env: $TRITON_SPEC" >&2
    pip_install "$TRITON_SPEC"
fi
echo "llmcompressor env: llmcompressor $LLMCOMPRESSOR_VERSION" >&2
# The constraint keeps the torch installed above (no silent swap of builds).
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
pip_install "llmcompressor==$LLMCOMPRESSOR_VERSION" -c "$VENV/constraints.txt"
# obskernels without its dependencies: keeps llm-compressor's compressed-tensors.
pip_install --no-deps -e .
pip_install "pytest>=7"
"$VPY" -c "import torch, compressed_tensors, llmcompressor, obskernels; print('llmcompressor env: torch', torch.__version__, '| compressed-tensors', compressed_tensors.__version__, '| llmcompressor', llmcompressor.__version__)" >&2
echo "$want" > "$stamp"
echo "$VPY"
