"""Which modules calibration touches, and their names.

The base names, the scheme field each reads, the modules of a model in a
fixed order (the same on every DDP rank), and the qualified names that
warnings use. Shared by the rest of ``obskernels.calibration``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Optional

from compressed_tensors.quantization import QuantizationArgs
from torch.nn import Module

from obskernels.spec.checks import check_base_name

__all__ = ["ACTIVATION_BASE_NAMES", "ALL_BASE_NAMES", "CalibrationWarning", "quantization_args_for",
           "get_modules"]

ACTIVATION_BASE_NAMES = ("input", "output", "q", "k", "v")
ALL_BASE_NAMES = ("input", "weight", "output", "q", "k", "v")

_ARGS_FIELD = {
    "weight": "weights",
    "input": "input_activations",
    "q": "input_activations",
    "k": "input_activations",
    "v": "input_activations",
    "output": "output_activations",
}

# Base names whose qparams ``update_qparams`` settled per module (stored, or
# kept as placeholders on purpose), so ``calibrating`` knows which are complete.
_SETTLED: "weakref.WeakKeyDictionary[Module, set[str]]" = weakref.WeakKeyDictionary()
# Qualified names, for warnings that say which module is meant.
_NAMES: "weakref.WeakKeyDictionary[Module, str]" = weakref.WeakKeyDictionary()


class CalibrationWarning(UserWarning):
    """Calibration could not compute a module's quantization parameters from data."""


def _label(module: Module) -> str:
    return _NAMES.get(module) or f"<unnamed {type(module).__name__}>"


def _name_modules(model: Module) -> None:
    for name, module in model.named_modules():
        _NAMES.setdefault(module, name or "<root>")


def quantization_args_for(module: Module, base_name: str) -> Optional[QuantizationArgs]:
    """The ``QuantizationArgs`` that calibrate ``base_name`` on ``module``, or None."""
    check_base_name(base_name)
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is None:
        return None
    return getattr(scheme, _ARGS_FIELD[base_name], None)


def _as_module_list(modules, what: str) -> list[Module]:
    if isinstance(modules, Module):
        return [modules]
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise TypeError(f"{what}: expected a module or an iterable of modules, got {type(modules).__name__}")
    out = list(modules)
    for m in out:
        if not isinstance(m, Module):
            raise TypeError(f"{what}: expected torch.nn.Module items, got {type(m).__name__}")
    return out


def _as_base_names(base_names, what: str) -> list[str]:
    names = [base_names] if isinstance(base_names, str) else list(base_names)
    for b in names:
        check_base_name(b)
    return names


def _one_of(value, alias, name: str, alias_name: str, what: str):
    """``value``, or the older keyword ``alias`` it may be given as (not both)."""
    if alias is not None:
        if value is not None:
            raise TypeError(f"{what}: pass {name!r} or its older name {alias_name!r}, not both")
        return alias
    if value is None:
        raise TypeError(f"{what}: missing argument {name!r}")
    return value


def get_modules(parents, *, quantized_only: bool = False) -> list[Module]:
    """Every module under ``parents`` (a module or an ordered sequence of
    modules), each once, in the order of ``parent.modules()`` over the
    parents in the order given (llm-compressor's ``get_modules``).

    The order depends only on the model's structure, so all DDP ranks agree
    on it; a set of parents is refused (TypeError) because its iteration order
    is not. With ``quantized_only=True`` only modules that carry a
    quantization scheme are returned.
    """
    if isinstance(parents, Module):
        parents = [parents]
    elif isinstance(parents, (set, frozenset)):
        raise TypeError(
            "get_modules: parents must be a module or an ordered sequence of modules; "
            "a set's iteration order differs between processes"
        )
    parents = _as_module_list(parents, "get_modules")
    seen: set[int] = set()
    out: list[Module] = []
    for parent in parents:
        for m in parent.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            if quantized_only and getattr(m, "quantization_scheme", None) is None:
                continue
            out.append(m)
    return out
