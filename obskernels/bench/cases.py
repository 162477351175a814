"""The benchmark sweep, as small frozen dataclasses shared by the harness, the
pytest-benchmark suite (benchmarks/) and the tests.

A ``Case`` is one value to calibrate: a weight (rows, cols) or activations
(tokens, hidden), a dtype and a quantization ``Scheme``. A ``Target`` is what is
run on it: an operation of ``obskernels.ops`` (with fixed search parameters) or
an observer by registry name. ``sweep(mode)`` builds the list of
(case, targets) pairs for "full", "quick" (the CPU default: shapes divided by 32
per side, bf16 only) or "tiny" (tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from obskernels.observers import OBSERVER_NAMES
from obskernels.spec.search import IMATRIX_DEFAULTS, MSE_DEFAULTS

__all__ = [
    "Scheme",
    "Case",
    "Target",
    "SCHEMES",
    "OPS",
    "OBSERVERS",
    "WEIGHT_SHAPES",
    "ACTIVATION_SHAPE",
    "QUICK_DIVISOR",
    "sweep",
    "targets_for",
    "make_value",
    "make_importance",
    "DTYPES",
]

DTYPES: Dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

WEIGHT_SHAPES: Tuple[Tuple[int, int], ...] = ((4096, 4096), (4096, 14336), (14336, 4096))
ACTIVATION_SHAPE: Tuple[int, int] = (2048, 4096)
QUICK_DIVISOR = 32


@dataclass(frozen=True)
class Scheme:
    """A quantization format and strategy, as compressed-tensors ``QuantizationArgs``.

    ``preset`` names the compressed-tensors preset scheme it starts from
    (``PRESET_SCHEMES[preset][role]``); ``update`` overrides fields of it.
    """

    name: str
    preset: str
    role: str  # "weights" or "input_activations"
    strategy: str
    fmt: str
    update: Tuple[Tuple[str, object], ...] = ()

    def qargs(self):
        """A fresh ``QuantizationArgs`` (observers mutate ``observer_kwargs``)."""
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        base = PRESET_SCHEMES[self.preset][self.role]
        return base.model_copy(deep=True, update=dict(self.update))


SCHEMES: Dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("int8-channel", "W8A8", "weights", "channel", "int8 sym"),
        Scheme("int4-group128", "W4A16", "weights", "group", "int4 sym g128"),
        Scheme(
            "int4-group32-asym", "W4A16_ASYM", "weights", "group", "int4 asym g32",
            (("group_size", 32),),
        ),
        Scheme("nvfp4-tg16", "NVFP4", "weights", "tensor_group", "nvfp4 g16 (fp8 scales)"),
        Scheme("fp8-block128", "FP8_BLOCK", "weights", "block", "fp8 e4m3 128x128"),
        Scheme("fp8-tensor-act", "FP8", "input_activations", "tensor", "fp8 e4m3 tensor"),
        Scheme("nvfp4-tg16-act", "NVFP4", "input_activations", "tensor_group", "nvfp4 g16 (fp8 scales)"),
    )
}
WEIGHT_SCHEMES = ("int8-channel", "int4-group128", "int4-group32-asym", "nvfp4-tg16", "fp8-block128")
ACTIVATION_SCHEMES = ("fp8-tensor-act", "nvfp4-tg16-act")


@dataclass(frozen=True)
class Case:
    """One value to calibrate."""

    kind: str  # "weight" or "activation"
    shape: Tuple[int, int]
    dtype: str  # key of DTYPES
    scheme: str  # key of SCHEMES
    full_shape: Optional[Tuple[int, int]] = None  # the real size a scaled case stands for

    @property
    def base_name(self) -> str:
        return "weight" if self.kind == "weight" else "input"

    @property
    def scaled(self) -> bool:
        return self.full_shape is not None and self.full_shape != self.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def spec(self) -> Scheme:
        return SCHEMES[self.scheme]

    @property
    def label(self) -> str:
        return f"{self.kind[0]}{self.shape[0]}x{self.shape[1]} {self.dtype} {self.scheme}"

    def with_shape(self, shape: Tuple[int, int]) -> "Case":
        return dataclasses.replace(self, shape=tuple(shape))

    def row_unit(self) -> int:
        """Rows of one quantization-group row (128 for 128x128 blocks, else 1)."""
        return 128 if self.spec.strategy == "block" else 1


@dataclass(frozen=True)
class Target:
    """What runs on a case: an op of ``obskernels.ops`` or an observer by name.

    ``params`` are the op's keyword arguments (the search parameters are the
    defaults of the observer that uses the op, docs/spec.md §1).
    """

    kind: str  # "op" or "observer"
    name: str  # op: flatten|min_max|mse_search|accumulate_sq ; observer: registry name
    variant: str = ""  # mse_search: "mse" | "imatrix"
    params: Tuple[Tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "op" and self.variant:
            return f"{self.name}[{self.variant}]"
        return self.name if self.kind == "op" else f"obs:{self.name}"

    @property
    def kwargs(self) -> Dict[str, object]:
        return dict(self.params)

    @property
    def uses_importance(self) -> bool:
        return self.variant == "imatrix" or self.name == "imatrix_mse"


# the observers' search defaults (obskernels.spec.search)
_SEARCH_KEYS = ("maxshrink", "patience", "grid", "norm")
MSE_PARAMS = tuple((k, MSE_DEFAULTS[k]) for k in _SEARCH_KEYS)
IMATRIX_PARAMS = tuple((k, IMATRIX_DEFAULTS[k]) for k in _SEARCH_KEYS)

OPS: Dict[str, Target] = {
    t.label: t
    for t in (
        Target("op", "flatten"),
        Target("op", "min_max"),
        Target("op", "mse_search", "mse", MSE_PARAMS + (("flavour", "mse"),)),
        Target("op", "mse_search", "imatrix", IMATRIX_PARAMS + (("flavour", "imatrix"),)),
        Target("op", "accumulate_sq"),
    )
}
OBSERVERS: Dict[str, Target] = {name: Target("observer", name) for name in OBSERVER_NAMES}
# short names accepted by --ops
OP_ALIASES = {
    "flatten": ["flatten"],
    "min_max": ["min_max"],
    "mse_search": ["mse_search[mse]", "mse_search[imatrix]"],
    "mse": ["mse_search[mse]"],
    "imatrix": ["mse_search[imatrix]"],
    "accumulate_sq": ["accumulate_sq"],
}


def targets_for(case: Case, ops: Sequence[str], observers: Sequence[str]) -> List[Target]:
    """The targets that apply to ``case`` among the selected ones.

    - importance (imatrix) only for weights with channel / group / tensor_group
      (docs/spec.md §1: other strategies fall back to uniform weights);
    - ``accumulate_sq`` only on activations, once per activation shape (it does
      not depend on the scheme: it is attached to the "tensor" scheme);
    - ``nvfp4_expanded_mse`` only on the nvfp4 schemes it is tuned for.
    """
    strategy = case.spec.strategy
    imatrix_ok = case.kind == "weight" and strategy in ("channel", "group", "tensor_group")
    out: List[Target] = []
    for label in ops:
        t = OPS[label]
        if t.uses_importance and not imatrix_ok:
            continue
        if t.name == "accumulate_sq" and (case.kind != "activation" or strategy != "tensor"):
            continue
        out.append(t)
    for name in observers:
        t = OBSERVERS[name]
        if t.uses_importance and not imatrix_ok:
            continue
        if name == "nvfp4_expanded_mse" and not case.scheme.startswith("nvfp4"):
            continue
        out.append(t)
    return out


def _scaled(shape: Tuple[int, int], divisor: int, unit: Tuple[int, int]) -> Tuple[int, int]:
    out = []
    for n, u in zip(shape, unit):
        u = max(u, 1)
        out.append(max(u, (n // divisor) // u * u))
    return tuple(out)


def sweep(mode: str = "quick") -> List[Case]:
    """The cases of a sweep mode: "full", "quick" or "tiny"."""
    if mode not in ("full", "quick", "tiny"):
        raise ValueError(f"mode must be 'full', 'quick' or 'tiny', got {mode!r}")
    cases: List[Case] = []
    if mode == "tiny":
        # small enough for the interpreter in tests: one of each kind
        cases.append(Case("weight", (128, 256), "bf16", "int4-group128", (4096, 4096)))
        cases.append(Case("weight", (128, 128), "fp32", "fp8-block128", (4096, 4096)))
        cases.append(Case("activation", (16, 256), "bf16", "fp8-tensor-act", ACTIVATION_SHAPE))
        return cases
    divisor = 1 if mode == "full" else QUICK_DIVISOR
    for i, shape in enumerate(WEIGHT_SHAPES):
        dtypes = ("bf16", "fp32") if mode == "full" else ("bf16",)
        for dtype in dtypes:
            for scheme in WEIGHT_SCHEMES:
                unit = (128, 128) if SCHEMES[scheme].strategy == "block" else (1, 128)
                cases.append(Case("weight", _scaled(shape, divisor, unit), dtype, scheme, shape))
    for dtype in (("bf16", "fp32") if mode == "full" else ("bf16",)):
        for scheme in ACTIVATION_SCHEMES:
            shape = _scaled(ACTIVATION_SHAPE, divisor, (1, 128))
            cases.append(Case("activation", shape, dtype, scheme, ACTIVATION_SHAPE))
    return cases


def make_value(case: Case, shape: Optional[Tuple[int, int]] = None, device="cpu") -> torch.Tensor:
    """The value of a case: seeded normal data (same bytes in every process).

    Generated on the CPU in fp32 with a generator seeded from the case, then
    cast and moved, so every backend and every environment sees the same input.
    """
    shape = tuple(shape or case.shape)
    seed = (hash_str(f"{case.kind}{shape}{case.scheme}") ^ 0x5EED) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if case.kind == "activation":
        # activations have outlier channels: scale a few columns up
        cols = torch.randint(0, shape[1], (max(1, shape[1] // 64),), generator=g)
        x[:, cols] *= 8.0
    return x.to(case.torch_dtype).to(device)


def make_importance(cols: int, device="cpu") -> torch.Tensor:
    """A per-input-column fp32 importance vector, normalised to mean 1."""
    g = torch.Generator().manual_seed(1234 + cols)
    imp = torch.rand(cols, generator=g, dtype=torch.float32) ** 2 + 0.05
    return (imp / imp.mean()).to(device)


def hash_str(s: str) -> int:
    """A stable string hash (Python's ``hash`` is salted per process)."""
    h = 2166136261
    for ch in s.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h
