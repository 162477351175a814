#!/usr/bin/env bash
# Creates (or refreshes) an environment with an older triton for the compile
# check: tests/kernels/test_kernels_compile.py compiles every kernel variant for
# sm_90a under each triton the project supports (the main environment has the newest;
# these the lowest that pyproject.toml declares and each minor release between,
# one environment each: the Makefile's TRITON_LOW and TRITON_BETWEEN). Nothing
# runs a kernel, so torch is the CPU build, and no GPU is needed.
#
#   VENV=.venv-triton36        where the environment goes (gitignored via .venv*/)
#   TRITON_VERSION=3.6.0       the triton it holds
#   TORCH_VERSION=2.13.0       always pinned: a CPU build (local wheel or
#                              TORCH_CPU_INDEX) does not pull a triton of its own
#   TORCH_CPU_INDEX            optional index URL for the CPU torch build
#   BASE_PYTHON=python3        the interpreter that creates it
#
# Prints the environment's python on its last line; re-running is cheap (a
# stamp records what was installed; only the editable obskernels is refreshed).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1
VENV=${VENV:-.venv-triton36}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE_PYTHON=${BASE_PYTHON:-python3}

want="torch=$TORCH_VERSION triton=$TRITON_VERSION"
stamp="$VENV/.obskernels-triton-stamp"
VPY="$VENV/bin/python"
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VPY" ]; }; then
    [ -x "$VPY" ] || "$BASE_PYTHON" -m venv "$VENV"
    echo "triton env: $want in $VENV" >&2
    torch_index=()
    [ -n "${TORCH_CPU_INDEX:-}" ] && torch_index=(--extra-index-url "$TORCH_CPU_INDEX")
    pip_install "${torch_index[@]}" "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
        "compressed-tensors>=0.19" numpy "pytest>=7"
    echo "$want" > "$stamp"
fi
# obskernels without its dependencies: keeps the pinned triton
pip_install --no-deps -e . >/dev/null
got=$("$VPY" -c 'import importlib.metadata as m; print(m.version("triton"))')
if [ "$got" != "$TRITON_VERSION" ]; then
    echo "triton env: $VENV has triton $got, not $TRITON_VERSION" >&2
    exit 1
fi
echo "$VPY"
