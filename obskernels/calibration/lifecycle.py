"""The calibration lifecycle: start, end, and calibration as a block.

``start_calibration`` attaches observers and hooks and switches quantization
off; ``end_calibration`` (``freeze_module_quantization`` on every module)
removes them and switches it back on; ``calibrating`` runs the two around a
block and leaves every module complete or as it was, whatever interrupts it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Sequence

import torch
from compressed_tensors.quantization import QuantizationStatus
from compressed_tensors.utils import update_offload_parameter
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from obskernels.calibration.attach import (
    _HOOKS,
    FUSED_LAYER_NAMES,
    fuse_weight_observers,
    initialize_observer,
    register_calibration_hooks,
)
from obskernels.calibration.modules import (
    _SETTLED,
    ALL_BASE_NAMES,
    CalibrationWarning,
    _label,
    _name_modules,
    get_modules,
)

__all__ = ["start_calibration", "end_calibration", "calibrating", "freeze_module_quantization"]

# ------------------------------------------------------------- lifecycle


def _is_hooked_attention(module: Module) -> bool:
    """An attention module compressed-tensors wrapped for q / k / v hooks."""
    return hasattr(module, "impl") or hasattr(module, "kv_cache")


def start_calibration(
    model: Module, *, fused_groups: Sequence[Sequence[str]] = FUSED_LAYER_NAMES
) -> list[RemovableHandle]:
    """Attach observers and calibration hooks to every module of ``model`` that
    has a quantization scheme, link fused weight observers, and switch
    quantization off so that calibration sees unquantized values.

    Attention modules hooked by compressed-tensors get q (with an attention
    implementation wrapper) and k / v (with a kv-cache wrapper) observers
    instead of an input observer. Returns the hook handles.
    """
    if not isinstance(model, Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _name_modules(model)
    handles: list[RemovableHandle] = []
    for module in get_modules(model, quantized_only=True):
        if _is_hooked_attention(module):
            if hasattr(module, "impl"):
                initialize_observer(module, "q")
            if hasattr(module, "kv_cache"):
                initialize_observer(module, "k")
                initialize_observer(module, "v")
        else:
            initialize_observer(module, "input")
        initialize_observer(module, "weight")
        initialize_observer(module, "output")
        handles.extend(register_calibration_hooks(module))
        module.quantization_enabled = False
        module.quantization_status = QuantizationStatus.CALIBRATION
    fuse_weight_observers(model, fused_groups)
    return handles


def end_calibration(model: Module) -> None:
    """``freeze_module_quantization`` on every module of ``model``."""
    model.apply(freeze_module_quantization)


_QPARAM_SUFFIXES = ("scale", "zero_point", "global_scale")
_ABSENT = object()


def _module_state(module: Module) -> dict:
    """What calibration may change on ``module``: its qparams (copies), status
    and quantization switch."""
    qparams = {}
    for base in ALL_BASE_NAMES:
        for suffix in _QPARAM_SUFFIXES:
            value = getattr(module, f"{base}_{suffix}", None)
            if isinstance(value, torch.Tensor):
                qparams[f"{base}_{suffix}"] = value.detach().clone()
    return {
        "qparams": qparams,
        "quantization_status": module.__dict__.get("quantization_status", _ABSENT),
        "quantization_enabled": module.__dict__.get("quantization_enabled", _ABSENT),
    }


def _restore_state(module: Module, state: dict) -> None:
    for name, value in state["qparams"].items():
        if isinstance(getattr(module, name, None), torch.Tensor):
            update_offload_parameter(module, name, value)
    for attr in ("quantization_status", "quantization_enabled"):
        if state[attr] is _ABSENT:
            module.__dict__.pop(attr, None)
        else:
            setattr(module, attr, state[attr])


@contextlib.contextmanager
def calibrating(
    model: Module, *, fused_groups: Sequence[Sequence[str]] = FUSED_LAYER_NAMES
) -> Iterator[Module]:
    """Calibration of ``model`` as a block, safe to interrupt::

        with calibrating(model):
            for batch in batches:
                model(**batch)
            modules = get_modules(model)
            update_qparams(modules, ACTIVATION_BASE_NAMES)
            update_qparams(modules, "weight")

    Entering runs ``start_calibration``. On ANY exit (normal, an exception,
    KeyboardInterrupt) every calibration hook and observer is removed, so a
    later forward pass observes nothing, and each quantized module ends in
    one of two states, never a mix within a module:

    - complete: ``update_qparams`` settled every base name it had an
      observer for (stored the calibrated qparams, or kept the placeholders
      with a ``CalibrationWarning`` for a module that saw no data): the module
      is frozen with quantization on, as ``end_calibration`` leaves it;
    - otherwise as it was before the block: its qparams, quantization status
      and quantization switch are put back (the placeholders of
      ``initialize_observer`` and any qparams of some of its base names are
      undone). On a normal exit this raises a ``CalibrationWarning`` naming
      the modules.

    ``update_qparams`` stores each module's qparams together, so an
    interruption inside it leaves that module all old or all new. Yields the
    model. A model that already carries observers is refused (RuntimeError):
    the block could not tell its own observers from the others.
    """
    if not isinstance(model, Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _name_modules(model)
    modules = get_modules(model, quantized_only=True)
    busy = [
        f"{_label(m)}.{b}_observer" for m in model.modules() for b in ALL_BASE_NAMES
        if getattr(m, f"{b}_observer", None) is not None
    ]
    if busy:
        raise RuntimeError(
            f"calibrating: the model already carries observers ({', '.join(busy[:5])}"
            f"{', ...' if len(busy) > 5 else ''}); end that calibration first (end_calibration)"
        )
    saved = {m: _module_state(m) for m in modules}
    for m in modules:
        _SETTLED.pop(m, None)
    started = exited_normally = False
    try:
        start_calibration(model, fused_groups=fused_groups)
        started = True
        yield model
        exited_normally = True
    finally:
        _end_calibrating(model, modules, saved, started=started, warn=exited_normally)


def _end_calibrating(model: Module, modules: list[Module], saved: dict, *, started: bool,
                     warn: bool) -> None:
    # a start that failed part-way (e.g. a fused group with mixed strategies)
    # completed nothing: every module goes back as it was
    required = {
        m: {b for b in ALL_BASE_NAMES if getattr(m, f"{b}_observer", None) is not None}
        if started else {"<not started>"}
        for m in modules
    }
    try:
        model.apply(freeze_module_quantization)  # hooks and observers gone, whatever follows
    finally:
        incomplete = []
        for m in modules:
            settled = _SETTLED.pop(m, set())
            if not required[m] <= settled:
                _restore_state(m, saved[m])
                incomplete.append(_label(m))
    if warn and incomplete:
        warnings.warn(
            f"calibrating: update_qparams did not store the qparams of {len(incomplete)} "
            f"module(s) ({', '.join(incomplete[:5])}{', ...' if len(incomplete) > 5 else ''}); "
            "they keep the qparams they had before calibration",
            CalibrationWarning,
            stacklevel=3,
        )


def freeze_module_quantization(module: Module) -> None:
    """End calibration for ``module``: remove its calibration hooks and
    observers (detaching them first), mark it FROZEN and switch quantization
    back on. Apply to a whole model with ``model.apply(...)``."""
    for handle in _HOOKS.pop(module, []):
        handle.remove()
    for base in ALL_BASE_NAMES:
        attr = f"{base}_observer"
        observer = getattr(module, attr, None)
        if observer is not None:
            observer.detach(module)
            delattr(module, attr)
    if getattr(module, "quantization_scheme", None) is not None:
        module.quantization_status = QuantizationStatus.FROZEN
        module.quantization_enabled = True
