"""How each benchmarked backend runs a (case, target): one callable per call.

Backends:
- "reference": obskernels' pure-PyTorch ops (``use_backend("reference")``);
- "triton": obskernels' Triton kernels (``use_backend("triton")``): on CUDA
  tensors, or on CPU tensors under triton's interpreter (modelling only).
  Where the default choice ("auto") picks the row's backend, its calls run
  without the block, as a user's do (the choice made per operation timed);
- "llmc": llm-compressor as installed, nothing switched: what its users get
  (on CUDA its own Triton MSE-search kernel where it registers one, on the CPU
  its eager body);
- "llmc-eager": llm-compressor's own observers and helpers, with its
  ``_grid_search_mse`` forced onto the eager PyTorch body;
- "llmc-triton": llm-compressor's compiled path, its Triton MSE-search kernel
  (``_grid_search_mse_triton``; note it uses per-group patience, not the global
  patience of docs/spec.md §4). Only the MSE targets have it.

``prepare(case, target, backend, shape, device)`` returns a ``Prepared``: an
untimed ``setup()`` before each call, the timed ``call()`` (``build()``, e.g.
constructing the observer, then ``fn()``) and the compulsory byte count of
what it read and returned. A target that a backend does not have raises ``NotApplicable``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from obskernels.bench.cases import Case, Target, make_importance, make_value
from obskernels.bench.model import compulsory_bytes

__all__ = [
    "BACKENDS",
    "LLMC_BACKENDS",
    "NotApplicable",
    "Prepared",
    "prepare",
    "llmc_available",
    "llmc_searches_in_triton",
    "llmc_path",
    "backend_unavailable_reason",
]

BACKENDS = ("reference", "triton", "llmc", "llmc-eager", "llmc-triton")
LLMC_BACKENDS = ("llmc", "llmc-eager", "llmc-triton")
_LLMC_TRITON_TARGETS = ("mse_search[mse]", "memoryless_mse", "mse", "nvfp4_expanded_mse")
# tokens of the activations fed to an imatrix observer before it observes its weight
IMATRIX_TOKENS = 64


def llmc_searches_in_triton(target: Union[Target, str]) -> bool:
    """Whether llm-compressor's default path on a GPU runs ``target`` (or the
    observer of that name) with its Triton MSE-search kernel (else its eager
    body)."""
    if isinstance(target, str):
        return target in _LLMC_TRITON_TARGETS
    return target.name in _LLMC_TRITON_TARGETS or target.label in _LLMC_TRITON_TARGETS


class NotApplicable(Exception):
    """This backend has no implementation of this target (not an error)."""


def llmc_available() -> bool:
    return importlib.util.find_spec("llmcompressor") is not None


def backend_unavailable_reason(backend: str, device: str) -> Optional[str]:
    """Why ``backend`` cannot run at all in this process (None when it can)."""
    if backend in LLMC_BACKENDS and not llmc_available():
        return (
            "llmcompressor is not importable in this environment (it pins compressed-tensors "
            "0.19); for these rows run `PYTHONSAFEPATH=1 .venv-llmcompressor/bin/python -m "
            "obskernels.bench` (that environment: scripts/llmcompressor_env.sh)"
        )
    if backend in ("triton", "llmc-triton"):
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device == "cpu":
            import os

            if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
                return "no CUDA device, and TRITON_INTERPRET=1 was not set before triton was imported"
            if backend == "triton" and _compiled_kernels():
                return ("triton was imported before TRITON_INTERPRET=1 was set: the kernels "
                        "are compiled for a GPU, the interpreter cannot run them")
    return None


def _compiled_kernels() -> bool:
    """True when obskernels' kernels were decorated for a GPU, not the interpreter."""
    import sys

    try:
        importlib.import_module("obskernels.kernels")
        from triton.runtime.jit import JITFunction
    except Exception:
        return False
    for name, mod in list(sys.modules.items()):
        if name.startswith("obskernels.kernels") and mod is not None:
            if any(isinstance(v, JITFunction) for v in vars(mod).values()):
                return True
    return False


@dataclass
class Prepared:
    fn: Callable[[], object]
    setup: Callable[[], None] = lambda: None  # untimed, before each call
    build: Optional[Callable[[], None]] = None  # timed, the call's first part (a new observer)
    reads: List[torch.Tensor] = field(default_factory=list)
    updated: List[torch.Tensor] = field(default_factory=list)
    outputs_of: Callable[[object], Sequence[Optional[torch.Tensor]]] = lambda out: []

    def call(self):
        """One timed call: ``build()`` (when there is one), then ``fn()``."""
        if self.build is not None:
            self.build()
        return self.fn()

    def compulsory(self, out) -> int:
        return compulsory_bytes(self.reads, self.outputs_of(out), updated=self.updated)


def _tuple_outputs(out) -> Sequence[Optional[torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (tuple, list)):
        return list(out)
    return []


class _ImatrixModule(torch.nn.Identity):
    """A stand-in Linear for the imatrix hook: has in_features, returns its input."""

    def __init__(self, in_features: int):
        super().__init__()
        self.in_features = in_features


def _imatrix_acts(cols: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(99 + cols)
    return torch.randn(IMATRIX_TOKENS, cols, generator=g).to(device)


# ------------------------------------------------------------------ obskernels


def _obskernels(case: Case, target: Target, backend: str, value: torch.Tensor) -> Prepared:
    from obskernels import ops
    from obskernels.backends import get_backend, resolve_backend, use_backend

    base = case.base_name
    cols = value.shape[-1]

    if get_backend() == "auto" and resolve_backend(value) == backend:
        # what a user runs: no block, the default choice made per operation
        def under(f):
            return f
    else:
        def under(f):
            def run():
                with use_backend(backend):
                    return f()

            return run

    if target.kind == "op":
        args = case.spec.qargs()
        if target.name == "flatten":
            return Prepared(
                under(lambda: ops.flatten_for_calibration(value, base, args)),
                reads=[value],
                outputs_of=_tuple_outputs,
            )
        if target.name == "min_max":
            return Prepared(
                under(lambda: ops.min_max(value, base, args)),
                reads=[value],
                outputs_of=_tuple_outputs,
            )
        if target.name == "mse_search":
            kw = target.kwargs
            imp = make_importance(cols, value.device) if target.uses_importance else None
            return Prepared(
                under(lambda: ops.mse_search(value, base, args, importance=imp, **kw)),
                reads=[value] + ([imp] if imp is not None else []),
                outputs_of=_tuple_outputs,
            )
        if target.name == "accumulate_sq":
            sum_buf = torch.zeros(cols, dtype=torch.float32, device=value.device)
            count_buf = torch.zeros(1, dtype=torch.int64, device=value.device)
            return Prepared(
                under(lambda: ops.accumulate_sq(value, sum_buf, count_buf)),
                reads=[value],
                updated=[sum_buf, count_buf],
            )
        raise ValueError(f"unknown op target {target.name!r}")

    from obskernels.observers import Observer

    return _observer_prepared(Observer, case, target, value, under)


def _observer_prepared(registry, case: Case, target: Target, value, wrap) -> Prepared:
    """One observer call: a new observer (``build``), ``observer(value)`` and
    ``get_qparams()``; its quantization arguments are made untimed (``setup``),
    as a user's exist before. The importance observers are built untimed: their
    construction precedes the calibration pass that gathers the importance."""
    state = {}
    cols = value.shape[-1]
    importance_bytes: List[torch.Tensor] = []
    if target.uses_importance:
        # the search reads the accumulated fp32 sum (one value per column)
        importance_bytes.append(torch.empty(cols, dtype=torch.float32, device="meta"))

    def build():
        state["obs"] = registry.load_from_registry(target.name, base_name=case.base_name, args=state["args"])

    def setup():
        state["args"] = case.spec.qargs()  # a fresh copy: observers mutate observer_kwargs
        if target.uses_importance:
            build()
            module = _ImatrixModule(cols)
            state["obs"].attach(module)
            wrap(lambda: module(_imatrix_acts(cols, value.device)))()

    def observe():
        obs = state["obs"]
        obs(value)
        return obs.get_qparams()

    return Prepared(
        wrap(observe),
        setup=setup,
        build=None if target.uses_importance else build,
        reads=[value] + importance_bytes,
        outputs_of=_tuple_outputs,
    )


# ------------------------------------------------------------- llm-compressor


@contextlib.contextmanager
def llmc_path(path: Optional[str]):
    """Forces llm-compressor's ``_grid_search_mse`` onto "eager" or "triton"
    (None: as installed, nothing switched).

    compressed-tensors takes no argument for this: its only switches are its
    module flag ``ENFORCE_EAGER`` (read from CT_ENFORCE_EAGER at import) and
    its backend registry, so they are set for the call and restored after it.
    """
    if path is None:
        yield
        return
    from compressed_tensors.utils import impl_backend

    saved_flag = getattr(impl_backend, "ENFORCE_EAGER", False)
    saved = impl_backend.ImplBackend._backends.get("_grid_search_mse")
    try:
        if path == "eager":
            impl_backend.ENFORCE_EAGER = True
        else:
            if not saved:
                raise NotApplicable("this llm-compressor registers no Triton MSE search")
            impl_backend.ENFORCE_EAGER = False
            # its requirement accepts CUDA only; the interpreter runs it on the CPU
            impl_backend.ImplBackend._backends["_grid_search_mse"] = [
                (fn, (lambda *a, **k: True), prio) for fn, _, prio in saved
            ]
        yield
    finally:
        impl_backend.ENFORCE_EAGER = saved_flag
        if saved is not None:
            impl_backend.ImplBackend._backends["_grid_search_mse"] = saved


def _llmc(case: Case, target: Target, backend: str, value: torch.Tensor) -> Prepared:
    from compressed_tensors.quantization import QuantizationStrategy

    path = {"llmc": None, "llmc-eager": "eager", "llmc-triton": "triton"}[backend]
    if path == "triton" and not llmc_searches_in_triton(target):
        raise NotApplicable("llm-compressor has a Triton path for the MSE search only")

    def wrap(f):
        def run():
            with llmc_path(path):
                return f()

        return run

    from llmcompressor.observers import Observer
    from llmcompressor.observers.helpers import flatten_for_calibration

    base = case.base_name
    cols = value.shape[-1]
    if target.kind == "observer":
        return _observer_prepared(Observer, case, target, value, wrap)

    args = case.spec.qargs()
    if target.name == "flatten":
        return Prepared(
            wrap(lambda: flatten_for_calibration(value, base, args)),
            reads=[value],
            outputs_of=_tuple_outputs,
        )
    if target.name == "min_max":

        def min_max():
            observed = flatten_for_calibration(value, base, args)
            return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))

        return Prepared(wrap(min_max), reads=[value], outputs_of=_tuple_outputs)
    if target.name == "mse_search" and target.variant == "mse":
        from llmcompressor.observers.mse_quant import _grid_search_mse

        kw = target.kwargs
        token_args = args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})
        # llm-compressor's own default for its Triton path's per-group patience
        buffer = 1.0 if (args.type == "float" and args.num_bits == 4) else 0.30

        def search():
            observed = flatten_for_calibration(value, base, args)
            return _grid_search_mse(
                observed, args, token_args, kw["maxshrink"], kw["patience"], kw["grid"],
                kw["norm"], buffer, 1.0,
            )

        return Prepared(wrap(search), reads=[value], outputs_of=_tuple_outputs)
    if target.name == "mse_search" and target.variant == "imatrix":
        from llmcompressor.observers.imatrix import _grid_search

        kw = target.kwargs
        imp = make_importance(cols, value.device)

        def search():
            observed = flatten_for_calibration(value, base, args)
            # as IMatrixMSEObserver._prepare_importance: broadcast over rows, flatten
            full = imp.unsqueeze(0).expand(observed.shape[1], -1)
            weights = flatten_for_calibration(full, base, args)
            return _grid_search(
                observed, args, kw["maxshrink"], kw["patience"], kw["grid"], kw["norm"],
                expand=1.0, importance_weights=weights,
            )

        return Prepared(wrap(search), reads=[value, imp], outputs_of=_tuple_outputs)
    if target.name == "accumulate_sq":
        # llm-compressor accumulates E[x^2] in the imatrix observer's forward-pre hook
        obs = Observer.load_from_registry("imatrix_mse", base_name="weight", args=args)
        module = _ImatrixModule(cols).to(value.device)
        obs.attach(module)
        return Prepared(
            wrap(lambda: module(value)),
            reads=[value],
            updated=[obs._imatrix_sum, obs._imatrix_count],
        )
    raise ValueError(f"unknown op target {target.label!r}")


def prepare(
    case: Case,
    target: Target,
    backend: str,
    *,
    shape: Optional[Tuple[int, int]] = None,
    device: str = "cpu",
    value: Optional[torch.Tensor] = None,
) -> Prepared:
    """The callable running ``target`` on ``case`` (at ``shape``) with ``backend``."""
    if value is None:
        value = make_value(case, shape, device)
    if backend in ("reference", "triton"):
        return _obskernels(case, target, backend, value)
    if backend in LLMC_BACKENDS:
        return _llmc(case, target, backend, value)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
