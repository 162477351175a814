"""Helpers shared by the test modules (test modules never import each other).

pytest puts this folder on ``sys.path`` (rootdir conftest, no package), so a
test module imports them as ``from helpers import ...``. Nothing here imports
triton or ``obskernels.kernels``: a module that needs neither still runs
where triton is missing.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from obskernels.reference.flatten import flatten_for_calibration
from obskernels.reference.mse_search import broadcast_importance
from obskernels.reference.mse_search import mse_search as _reference_search
from obskernels.spec import calls
from obskernels.spec.search import search_args


# --------------------------------------------------------------------------- #
# a backend's operation, called directly
# --------------------------------------------------------------------------- #
def call_backend(fn, *args, **kwargs):
    """A backend's operation (``obskernels.reference.min_max``,
    ``obskernels.kernels.mse_search.mse_search``, ...) on the call that
    ``obskernels.ops`` would check and hand it: the checks of
    ``spec.calls.<fn name>`` run first, as in the front, and no backend
    choice or fallback is involved."""
    return fn(getattr(calls, fn.__name__)(*args, **kwargs))


def reference_flatten(value, base_name, args, g_idx=None):
    """The reference's flattening of (value, base_name, args, g_idx)."""
    return call_backend(flatten_for_calibration, value, base_name, args, g_idx)


def reference_search(value, base_name, args, **kw):
    """The reference search of (value, base_name, args, **search keywords)."""
    return call_backend(_reference_search, value, base_name, args, **kw)

# --------------------------------------------------------------------------- #
# inputs
# --------------------------------------------------------------------------- #
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The number formats of the parity tests: QuantizationArgs fields without the
# strategy, which each test picks (``formats`` takes the ones a test uses).
FORMATS = {
    "int8-sym": dict(num_bits=8, symmetric=True),
    "int8-asym": dict(num_bits=8, symmetric=False),
    "int4-sym": dict(num_bits=4, symmetric=True),
    "int4-asym": dict(num_bits=4, symmetric=False),
    "int2-asym": dict(num_bits=2, symmetric=False),
    "int1-sym": dict(num_bits=1, symmetric=True),
    "int3-asym-int32zp": dict(num_bits=3, symmetric=False, zp_dtype=torch.int32),
    "fp8": dict(num_bits=8, type="float", symmetric=True),
    "fp8-asym": dict(num_bits=8, type="float", symmetric=False),
    "fp4": dict(num_bits=4, type="float", symmetric=True),
    "nvfp4": dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.float8_e4m3fn),
    "mxfp4": dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.uint8),
    "mxfp8": dict(num_bits=8, type="float", symmetric=True, scale_dtype=torch.uint8),
    "int8-asym-bf16scale": dict(num_bits=8, symmetric=False, scale_dtype=torch.bfloat16),
    "int4-sym-fp16scale": dict(num_bits=4, symmetric=True, scale_dtype=torch.float16),
    "int8-fp32scale": dict(num_bits=8, symmetric=True, scale_dtype=torch.float32),
}


def formats(*names, **fields):
    """The named entries of FORMATS, in the order given, each with ``fields``
    added (e.g. the strategy a format needs)."""
    return {name: dict(FORMATS[name], **fields) for name in names}


def qargs(strategy="tensor", num_bits=8, symmetric=True, **kw):
    """8-bit symmetric QuantizationArgs of ``strategy``; token args are
    dynamic unless said otherwise (compressed-tensors refuses static ones)."""
    if strategy == "token":
        kw.setdefault("dynamic", True)
    return QuantizationArgs(num_bits=num_bits, symmetric=symmetric, strategy=strategy, **kw)


def nvfp4_args():
    return QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
        scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn,
    )


def make_value(shape, dtype, layout="contiguous", base=None, device="cpu"):
    """A value of ``shape`` on ``device`` whose storage is laid out as named
    (all views). ``base`` draws on the CPU, so every device gets the same values."""
    base = torch.randn if base is None else base
    if layout == "contiguous":
        return base(shape).to(device=device, dtype=dtype)
    if layout == "transposed":  # every dim's stride reversed
        dims = tuple(reversed(range(len(shape))))
        return base(tuple(shape[d] for d in dims)).to(device=device, dtype=dtype).permute(dims)
    if layout == "sliced":  # every other element of a larger tensor, offset by one
        big = base(tuple(2 * n + 1 for n in shape)).to(device=device, dtype=dtype)
        return big[tuple(slice(1, 1 + 2 * n, 2) for n in shape)]
    raise ValueError(layout)


def permuted_g_idx(cols, group_size, dtype=torch.int64, device="cpu"):
    """Every group gets group_size columns, scattered by a random permutation."""
    return (torch.arange(cols) // group_size)[torch.randperm(cols)].to(device=device, dtype=dtype)


def tiny_llama(layers: int = 1):
    """A randomly initialised Llama small enough for the CPU (needs transformers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


# --------------------------------------------------------------------------- #
# comparisons
# --------------------------------------------------------------------------- #
def outcome(fn):
    """(exception type, message) of ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc), str(exc)
    return None


def assert_same(got, want, what, stats=None):
    """Same shape, dtype and values, NaN equal to NaN (docs/spec.md §5 where
    the math is exact). Values compare in float64, exact for every dtype
    compared here (float8 has no comparison of its own). The message names up
    to five differing groups with both values, and the (min, max) statistics
    they came from when ``stats`` is given."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g, w = got.double(), want.double()
    bad = (g.isnan() != w.isnan()) | (~w.isnan() & (g != w))
    if bool(bad.any()):
        g, w, flat = g.flatten(), w.flatten(), bad.flatten().nonzero().flatten()[:5].tolist()
        detail = "; ".join(
            f"group {tuple(int(x) for x in torch.unravel_index(torch.tensor(k), got.shape))}: "
            f"got {g[k].item()!r} want {w[k].item()!r}"
            + ("" if stats is None else
               f" (min {stats[0].flatten()[k].item()!r}, max {stats[1].flatten()[k].item()!r})")
            for k in flat
        )
        raise AssertionError(f"{what}: {int(bad.sum())} of {want.numel()} groups differ; {detail}")


# --------------------------------------------------------------------------- #
# the MSE search: per-group parity with the reference (docs/spec.md §5)
# --------------------------------------------------------------------------- #
MSE = dict(maxshrink=0.20, patience=5, grid=100, norm=2.4)  # memoryless_mse defaults
IMATRIX = dict(maxshrink=0.95, patience=5, grid=20, norm=3.0, flavour="imatrix")

# docs/spec.md §5: relative slack on the reference error of the kernel's choice. The
# kernel reproduces every rounding, but sums in another order than torch.sum
# (and fp32 pow differs from torch's by an ulp), so near-ties may flip.
TOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
EXACT_FRACTION = 0.99


def group_errors(value, base_name, args, mins, maxs, *, norm, importance=None, flavour="mse"):
    """Reference error of each group for the ranges (mins, maxs), as the
    reference search computes it for a candidate."""
    flat = calls.flatten_for_calibration(value, base_name, args)
    observed = flatten_for_calibration(flat)
    qparam_args, token_args = search_args(args)
    scale, zp = calculate_qparams(mins, maxs, qparam_args, None)
    q = fake_quantize(observed, scale.unsqueeze(-1), zp.unsqueeze(-1), token_args)
    if flavour == "mse":
        return torch.sum((q.to(observed.dtype) - observed).abs().pow(norm), dim=(0, -1))
    diff = (q.float() - observed.float()).abs().pow(norm)
    if importance is not None:
        diff = diff * broadcast_importance(importance, flat)
    return diff.sum(dim=(0, -1))


def _same(a, b):
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def assert_search_parity(value, base_name, args, got, **kw):
    """docs/spec.md §5 for the MSE search: ``got`` (a (min, max) pair from the
    code under test) against the reference search of the same call. Each
    group's error within (1 + TOL) of the reference's best, and at least
    EXACT_FRACTION of the groups on the reference's candidate; the message
    names the first failing group."""
    ref_min, ref_max = reference_search(value, base_name, args, **kw)
    got_min, got_max = got
    assert got_min.shape == ref_min.shape and got_max.shape == ref_max.shape
    assert got_min.dtype == ref_min.dtype and got_max.dtype == ref_max.dtype
    ekw = dict(norm=kw["norm"], importance=kw.get("importance"), flavour=kw.get("flavour", "mse"))
    e_ref = group_errors(value, base_name, args, ref_min, ref_max, **ekw).double().flatten()
    e_got = group_errors(value, base_name, args, got_min, got_max, **ekw).double().flatten()
    same = (_same(got_min, ref_min) & _same(got_max, ref_max)).flatten()
    tol = TOL[value.dtype]
    ok = same | (e_got <= e_ref * (1 + tol))
    if not bool(ok.all()):
        g = int((~ok).nonzero()[0])
        raise AssertionError(
            f"group {g}: kernel range ({got_min.flatten()[g].item()!r}, "
            f"{got_max.flatten()[g].item()!r}) has error {e_got[g].item()!r}, reference range "
            f"({ref_min.flatten()[g].item()!r}, {ref_max.flatten()[g].item()!r}) has "
            f"{e_ref[g].item()!r} (tol {tol}); {int((~ok).sum())} of {ok.numel()} groups fail"
        )
    frac = same.double().mean().item()
    assert frac >= EXACT_FRACTION, (
        f"only {frac:.4f} of {same.numel()} groups pick the reference's candidate; "
        f"first differing group {int((~same).nonzero()[0])}"
    )
    return frac


# --------------------------------------------------------------------------- #
# the README's python code blocks (run by test_readme and test_llmcompressor)
# --------------------------------------------------------------------------- #
README = Path(__file__).resolve().parent.parent / "README.md"
# A block whose first line says this needs the llm-compressor environment.
LLMC_MARK = "make llmcompressor-env"


@dataclasses.dataclass(frozen=True)
class Snippet:
    line: int  # line of the opening fence in README.md
    code: str

    @property
    def needs_llmcompressor(self) -> bool:
        return LLMC_MARK in self.code.splitlines()[0]

    def __str__(self):
        return f"README.md:{self.line}"


def python_snippets(path: Path = README) -> list[Snippet]:
    text = path.read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        out.append(Snippet(text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def run_snippet(snippet: Snippet, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs the block as a user would: a fresh interpreter (this one), in a
    directory that is not the repository root, with nothing switched on that
    the block does not switch on itself, and no network (offline hub)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH", "OBSKERNELS_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    script = cwd / f"readme_{snippet.line}.py"
    script.write_text(snippet.code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------------- #
# launches
# --------------------------------------------------------------------------- #
class RecordingKernel:
    """Wraps a triton kernel; records each launch as (kernel name, grid,
    arguments, keywords)."""

    def __init__(self, kernel, sink):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.sink.append((self.kernel.fn.__name__, grid, args, kwargs))
            return launch(*args, **kwargs)

        return run


def call_with_hooks(module, value):
    """``module(value)`` (which must return the module) with a forward
    pre-hook, a forward hook and a global forward hook registered: (what the
    hooks saw, in order; the module's two handles, still registered). The
    global hook is removed before returning."""
    from torch.nn.modules.module import register_module_forward_hook

    seen = []
    handles = (module.register_forward_pre_hook(lambda m, inp: seen.append(("pre", inp[0] is value))),
               module.register_forward_hook(lambda m, inp, out: seen.append(("post", out is m))))
    glob = register_module_forward_hook(lambda m, inp, out: seen.append(("global", m is module)))
    try:
        assert module(value) is module
    finally:
        glob.remove()
    return seen, handles


def assert_observer_call_runs_hooks(observer, oracle, value) -> None:
    """``observer(value)`` runs its hooks and the global ones exactly as
    ``oracle(value)`` does (an nn.Module calling through nn.Module.__call__),
    and, its hooks removed, none; the statistics are those of ``value``."""
    import torch

    expected, _ = call_with_hooks(oracle, value)
    seen, handles = call_with_hooks(observer, value)
    assert seen == expected and len(seen) == 3
    for handle in handles:
        handle.remove()
    assert observer(value) is observer and len(seen) == 3
    assert torch.equal(observer.max_vals, value.amax().reshape(observer.max_vals.shape))


# --------------------------------------------------------------------------- #
# the tritons the compiled-kernel checks run under
# --------------------------------------------------------------------------- #
def compile_pythons() -> list:
    """The interpreters a check of compiled kernels runs under (each in a
    subprocess without TRITON_INTERPRET): this one (the newest triton) and
    every one listed in OBSKERNELS_COMPILE_PYTHONS (':'-separated; `make test`
    lists the environments of the lowest triton pyproject.toml declares and
    of each minor release between it and this one's)."""
    extra = os.environ.get("OBSKERNELS_COMPILE_PYTHONS", "")
    return [sys.executable] + [p for p in extra.split(os.pathsep) if p.strip()]


def triton_version(python):
    """The triton version ``python`` imports, or None."""
    try:
        out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                             capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def python_id(python) -> str:
    """A test id for an interpreter of ``compile_pythons()``."""
    version = triton_version(python)
    return f"triton-{version}" if version else f"broken-{os.path.basename(os.path.dirname(os.path.dirname(python)))}"


def compiling_env() -> dict:
    """The environment of such a subprocess: triton compiles (no interpreter),
    its fp fusion default left unset (every launch states it: triton 3.9
    warns where one does not)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    for name in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION"):
        env.pop(name, None)
    return env


def compiled_row(python, *argv, timeout: int = 900, **env) -> dict:
    """``python *argv`` in a ``compiling_env()`` (plus ``env``), which must
    succeed: the JSON object its last line of output prints."""
    proc = subprocess.run([python, *argv], env=dict(compiling_env(), **env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def left_for_the_collector(call) -> list:
    """The objects made by ``call()`` that only the cyclic garbage collector
    would free (reference cycles no longer reachable), by type name. A
    collection that finds them runs inside whichever later call allocates
    past the collector's threshold, and until then they keep their tensors
    (on a GPU, device memory) alive."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        found = sorted(type(o).__name__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        if enabled:
            gc.enable()
        gc.collect()
    return found
