"""Observers attached to a model, and the hooks that feed them.

``initialize_observer`` attaches the observer a module's scheme names; the
``calibrate_*`` hooks feed activation observers during forward passes
(``register_calibration_hooks`` registers them, ``freeze_module_quantization``
removes exactly those); ``fuse_weight_observers`` links the TENSOR_GROUP
weight observers of fused layers so that they share one global scale.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.utils import update_offload_parameter
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from obskernels.calibration.modules import _NAMES, _label, quantization_args_for
from obskernels.observers import Observer
from obskernels.spec.checks import check_base_name

# Handles of the hooks registered by ``register_calibration_hooks``, per module,
# so that ``freeze_module_quantization`` can remove exactly those.
_HOOKS: "weakref.WeakKeyDictionary[Module, list[RemovableHandle]]" = weakref.WeakKeyDictionary()

__all__ = [
    "FUSED_LAYER_NAMES",
    "initialize_observer",
    "calibrate_activations",
    "calibrate_input_hook",
    "calibrate_output_hook",
    "calibrate_query_hook",
    "calibrate_key_hook",
    "calibrate_value_hook",
    "register_calibration_hooks",
    "fuse_weight_observers",
]

#: Sibling layers whose TENSOR_GROUP weight observers share one global scale
#: (vLLM runs each group as one fused matmul). llm-compressor's groups, plus
#: BERT's query/key/value, which vLLM fuses into one qkv projection as well.
FUSED_LAYER_NAMES: tuple[tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
    ("query", "key", "value"),
)

# Weight observers see the weight once; these stateful names would only keep
# a copy of statistics that never change, so weights get the memoryless kind.
_WEIGHT_OBSERVER_OVERRIDES = {
    "static_minmax": "memoryless_minmax",
    "minmax": "memoryless_minmax",
    "mse": "memoryless_mse",
}

# Handles of the hooks registered by ``register_calibration_hooks``, per module,
# so that ``freeze_module_quantization`` can remove exactly those.

def _observer_name(args: QuantizationArgs, base_name: str) -> str:
    name = args.observer
    if name is None:
        return "memoryless_minmax" if base_name == "weight" else "minmax"
    if base_name == "weight":
        return _WEIGHT_OBSERVER_OVERRIDES.get(name, name)
    return name


def _fill_placeholders(module: Module, base_name: str) -> None:
    """Defined values in place of the uninitialised memory compressed-tensors
    allocates (``torch.empty``): a module that never sees data must not carry
    whatever happened to be there. Scale 1, zero point 0, global scale 1."""
    for suffix, fill in (("scale", 1.0), ("zero_point", 0.0), ("global_scale", 1.0)):
        param = getattr(module, f"{base_name}_{suffix}", None)
        if isinstance(param, torch.Tensor):
            update_offload_parameter(module, f"{base_name}_{suffix}", torch.full_like(param, fill))


def initialize_observer(
    module: Module, base_name: str, *, name: Optional[str] = None
) -> Optional[Observer]:
    """Attach the observer named in ``module``'s scheme as ``<base_name>_observer``.

    Nothing is attached (None returned) when the module has no args for
    ``base_name`` or they are fully dynamic (scales computed at inference).
    Locally dynamic args (``DynamicType.LOCAL``) get an observer: it
    calibrates their global scale. Weights always get a memoryless observer
    (minmax / static_minmax -> memoryless_minmax, mse -> memoryless_mse).
    The module's qparams are reset to scale 1 / zero point 0 / global scale 1
    until ``update_qparams`` stores calibrated values. ``name`` is the module's
    qualified name, used in warnings.
    """
    if not isinstance(module, Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    args = quantization_args_for(module, base_name)
    if name is not None:
        _NAMES[module] = name
    if args is None or args.dynamic is True:
        return None
    observer = Observer.load_from_registry(
        _observer_name(args, base_name), base_name=base_name, args=args
    )
    module.register_module(f"{base_name}_observer", observer)
    observer.attach(module)
    _fill_placeholders(module, base_name)
    return observer


# ------------------------------------------------------------------ hooks


def calibrate_activations(module: Module, value: Optional[torch.Tensor], base_name: str) -> None:
    """Feed ``value`` to ``module``'s ``<base_name>_observer``.

    Skips None and empty values (an MoE expert that no token was routed to
    receives a (0, hidden) input) and modules without that observer.
    """
    check_base_name(base_name)
    if base_name == "weight":
        raise ValueError(
            "calibrate_activations: base_name 'weight' is not an activation; "
            "weights are observed with observe(modules, 'weight')"
        )
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"calibrate_activations: value must be a torch.Tensor, got {type(value).__name__}"
        )
    if value.numel() == 0:
        return
    observer = getattr(module, f"{base_name}_observer", None)
    if observer is not None:
        observer(value.detach())


def _first_tensor(value):
    if isinstance(value, (tuple, list)):
        return value[0] if value else None
    return value


def calibrate_input_hook(module: Module, args) -> None:
    """Forward-pre hook: observes the module's first positional input."""
    calibrate_activations(module, _first_tensor(args), "input")


def calibrate_output_hook(module: Module, args, output) -> None:
    """Forward hook: observes the module's output.

    The output is returned unchanged: its scale is computed only by
    ``update_qparams``, so quantizing it here would use a placeholder.
    """
    calibrate_activations(module, _first_tensor(output), "output")


def calibrate_query_hook(module: Module, query_states: torch.Tensor) -> None:
    """Query hook (compressed-tensors' ``register_query_hook``): (batch, heads, seq, head_dim)."""
    calibrate_activations(module, query_states, "q")


def calibrate_key_hook(module: Module, key_states: torch.Tensor) -> None:
    """Key hook (compressed-tensors' ``register_key_hook``): post-RoPE key states."""
    calibrate_activations(module, key_states, "k")


def calibrate_value_hook(module: Module, value_states: torch.Tensor) -> None:
    """Value hook (compressed-tensors' ``register_value_hook``)."""
    calibrate_activations(module, value_states, "v")


def register_calibration_hooks(module: Module) -> list[RemovableHandle]:
    """Hooks that feed ``module``'s activation observers; removed again by
    ``freeze_module_quantization``. q / k / v go through the attention
    implementation and kv-cache wrappers compressed-tensors installs."""
    handles: list[RemovableHandle] = []
    if getattr(module, "input_observer", None) is not None:
        handles.append(module.register_forward_pre_hook(calibrate_input_hook))
    if getattr(module, "output_observer", None) is not None:
        handles.append(module.register_forward_hook(calibrate_output_hook))
    if getattr(module, "q_observer", None) is not None:
        from compressed_tensors.modeling.attention import register_query_hook

        handles.append(register_query_hook(module, calibrate_query_hook))
    if getattr(module, "k_observer", None) is not None or getattr(module, "v_observer", None) is not None:
        from compressed_tensors.modeling.kvcache import register_key_hook, register_value_hook

        if getattr(module, "k_observer", None) is not None:
            handles.append(register_key_hook(module, calibrate_key_hook))
        if getattr(module, "v_observer", None) is not None:
            handles.append(register_value_hook(module, calibrate_value_hook))
    if handles:
        _HOOKS.setdefault(module, []).extend(handles)
    return handles


# ----------------------------------------------------------------- fusion


def fuse_weight_observers(
    model: Module, groups: Sequence[Sequence[str]] = FUSED_LAYER_NAMES
) -> int:
    """Link the TENSOR_GROUP weight observers of each fused layer group so
    they share one global scale (``Observer.fuse``). Returns the number of
    groups linked.

    A group is a set of sibling attribute names (e.g. q_proj, k_proj, v_proj)
    present on one parent module. A group in which only some layers have a
    TENSOR_GROUP weight observer is a ValueError: the global scales could not
    be shared.
    """
    linked = 0
    for parent in model.modules():
        for group in groups:
            if not all(hasattr(parent, n) for n in group):
                continue
            pairs, missing, other = [], [], []
            for n in group:
                layer = getattr(parent, n)
                if not isinstance(layer, Module):
                    continue
                obs = getattr(layer, "weight_observer", None)
                if obs is None:
                    missing.append(n)
                elif obs.args.strategy != QuantizationStrategy.TENSOR_GROUP:
                    other.append(n)
                else:
                    pairs.append((obs, layer))
            if not pairs:
                continue
            if missing or other:
                raise ValueError(
                    f"fused layers {tuple(group)} under '{_label(parent)}' must all use "
                    f"'tensor_group' weight quantization to share a global scale; "
                    f"without a weight observer: {missing}, other strategy: {other}"
                )
            Observer.fuse(pairs)
            linked += 1
    return linked
