"""The older calibration functions (llm-compressor 0.6-0.8), on the older observers.

In that flow an observer returns qparams at every call, and each call
writes them straight onto the module: ``call_observer`` is the one place
that happens. Names follow that era, so this module is separate from
``obskernels.calibration`` (whose same-named functions follow the current
lifecycle: statistics first, qparams once at the end).

A model is prepared as that flow did (``prepare_calibration(model)`` runs
these steps and returns the hook handles)::

    for module in model.modules():          # modules with a quantization scheme
        if kv_cache_args(module) is not None:   # attention with kv-cache quantization
            initialize_quantized_kv_cache(module)
        else:
            initialize_observer(module, "input"); initialize_observer(module, "output")
        initialize_observer(module, "weight")
        module.quantization_status = QuantizationStatus.CALIBRATION
        module.quantization_enabled = False   # see below
    model.apply(update_weight_global_scale); model.apply(update_weight_zp_scale)
    # hooks (register_legacy_hooks): calibrate_input_hook (forward-pre),
    # calibrate_output_hook (forward), and on attention modules with a kv cache
    # calibrate_kv_cache_input_hook (forward-pre, with_kwargs=True) and
    # calibrate_kv_cache_output_hook (forward)
    for batch in batches: model(**batch)
    model.apply(freeze_module_quantization)   # then remove the hooks

Quantization is switched off while calibrating (``quantization_enabled =
False``; ``freeze_module_quantization`` switches it back on): the compressed-tensors
required here (0.19+) fake-quantizes a Linear's output inside its forward, before any hook
could calibrate it. So calibration sees unquantized inputs and weights (the
older releases quantized them with the scales calibrated so far), and
``calibrate_output_hook`` returns the output fake-quantized with the qparams
it just stored, as that flow did.

kv cache with the compressed-tensors required here (0.19+): ``apply_quantization_config`` gives
each attention module its own kv-cache wrapper (``module.kv_cache``, with
the kv args as ``input_activations``) and a hook that passes it as
``past_key_values``. ``initialize_quantized_kv_cache`` sets that wrapper
aside and puts a ``QuantizedKVParameterCache`` in its place;
``freeze_module_quantization`` removes the quantized cache and puts the
wrapper back. Older layouts (kv args as ``output_activations`` of the
attention module) work too.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from compressed_tensors.utils import align_module_device, update_offload_parameter
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from obskernels.calibration import CalibrationWarning, weight_g_idx
from obskernels.legacy.observers import Observer
from obskernels.observers.base import hook_input

__all__ = [
    "initialize_observer",
    "call_observer",
    "update_weight_global_scale",
    "update_weight_zp_scale",
    "calibrate_activations",
    "calibrate_input_hook",
    "calibrate_output_hook",
    "calibrate_kv_cache_input_hook",
    "calibrate_kv_cache_output_hook",
    "initialize_quantized_kv_cache",
    "kv_cache_args",
    "freeze_module_quantization",
    "register_legacy_hooks",
    "prepare_calibration",
]

KEY_SCALE, VALUE_SCALE = "k_scale", "v_scale"

# compressed-tensors' kv-cache wrapper set aside while a quantized cache stands in
_SET_ASIDE: "weakref.WeakKeyDictionary[Module, Module]" = weakref.WeakKeyDictionary()


def _args_field(base_name: str) -> str:
    return "weights" if base_name == "weight" else f"{base_name}_activations"


def _store(module: Module, name: str, value: torch.Tensor) -> None:
    """Write ``value`` into ``module.<name>`` (a 0-d value into a (1,) parameter)."""
    param = getattr(module, name, None)
    if isinstance(param, torch.Tensor) and param.shape != value.shape and param.numel() == value.numel():
        value = value.reshape(param.shape)
    update_offload_parameter(module, name, value)


def initialize_observer(module: Module, base_name: str) -> Optional[Observer]:
    """Attach the older-API observer named in the scheme's args for
    ``base_name`` ("weight" -> ``weights``, else ``<base_name>_activations``)
    as ``<base_name>_observer``; nothing for a module without a scheme,
    without those args, or with dynamic args. ``observer_kwargs`` are passed
    to the constructor."""
    from obskernels.legacy.kv_cache import legacy_observer_name

    scheme = getattr(module, "quantization_scheme", None)
    if not scheme:
        return None
    args: Optional[QuantizationArgs] = getattr(scheme, _args_field(base_name), None)
    if args is None or args.dynamic is True:
        return None
    observer = Observer.load_from_registry(
        legacy_observer_name(args), quantization_args=args, **(args.observer_kwargs or {})
    )
    module.register_module(f"{base_name}_observer", observer)
    return observer


def call_observer(
    module: Module,
    base_name: str,
    value: Optional[torch.Tensor] = None,
    should_calculate_gparam: bool = False,
    should_calculate_qparams: bool = True,
) -> None:
    """Run ``module.<base_name>_observer`` and write what it returns onto the
    module: ``<base_name>_scale`` / ``_zero_point`` (and ``_global_scale``
    with ``should_calculate_gparam``). "weight" observes ``module.weight``
    with its ``weight_g_idx``; other base names need ``value``."""
    with align_module_device(module):
        if base_name == "weight":
            value = module.weight
            g_idx = weight_g_idx(module)
        elif value is not None:
            g_idx = None
        else:
            raise ValueError(
                f"call_observer: base_name {base_name!r} needs a value to observe "
                "(only 'weight' reads the module's own tensor)"
            )
        observer = getattr(module, f"{base_name}_observer", None)
        if observer is None:
            raise ValueError(
                f"call_observer: the module has no {base_name}_observer (initialize_observer first)"
            )
        if should_calculate_gparam:
            global_scale = observer(value, should_calculate_gparam=True)
            _store(module, f"{base_name}_global_scale", global_scale)
        else:
            global_scale = getattr(module, f"{base_name}_global_scale", None)
        if should_calculate_qparams:
            scale, zero_point = observer(value, g_idx=g_idx, global_scale=global_scale)
            _store(module, f"{base_name}_scale", scale)
            _store(module, f"{base_name}_zero_point", zero_point)
            observer.post_calculate_qparams()


def _weights_args(module: Module) -> Optional[QuantizationArgs]:
    scheme = getattr(module, "quantization_scheme", None)
    return getattr(scheme, "weights", None) if scheme is not None else None


def update_weight_global_scale(module: Module) -> None:
    """TENSOR_GROUP weights: compute and store ``weight_global_scale``, then
    reset the observer (its qparams come next, with that global scale)."""
    args = _weights_args(module)
    if args is None or args.strategy != "tensor_group":
        return
    call_observer(module, "weight", should_calculate_gparam=True, should_calculate_qparams=False)
    module.weight_observer.reset()


def update_weight_zp_scale(module: Module) -> None:
    """Calibrate ``module``'s weight qparams now (``model.apply(...)`` for a
    whole model); warns when the module is not in calibration status."""
    if _weights_args(module) is None:
        return
    if getattr(module, "quantization_status", None) != QuantizationStatus.CALIBRATION:
        warnings.warn(
            "update_weight_zp_scale: calibrating the weights of a module that is not in "
            "calibration status",
            CalibrationWarning,
            stacklevel=2,
        )
    call_observer(module, "weight")


def calibrate_activations(module: Module, value: torch.Tensor, base_name: str) -> None:
    """``call_observer`` with an activation value; an empty value (an MoE
    expert that received no token) is skipped."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"calibrate_activations: value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() == 0:
        return
    call_observer(module, base_name, value=value)


def calibrate_input_hook(module: Module, args: Any) -> None:
    """Forward-pre hook: calibrates the first input before the module runs."""
    value = hook_input(args, unwrap=False)
    calibrate_activations(module, value, "input")


def calibrate_output_hook(module: Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: calibrates the output, then returns it fake-quantized with
    the qparams just stored (``forward_quantize``), as that flow did."""
    calibrate_activations(module, output, "output")
    return forward_quantize(
        module=module, value=output, base_name="output",
        args=module.quantization_scheme.output_activations,
    )


def _past_key_values_name(module: Module) -> str:
    params = inspect.signature(module.forward).parameters
    return "past_key_values" if "past_key_values" in params else "past_key_value"


def calibrate_kv_cache_input_hook(
    module: Module, args: Any, kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Forward-pre hook (``with_kwargs=True``) on an attention module: its
    quantized kv-cache is passed as the cache, with ``use_cache=False``."""
    kwargs[_past_key_values_name(module)] = getattr(module, "kv_cache")
    kwargs["use_cache"] = False
    return args, kwargs


def calibrate_kv_cache_output_hook(module: Module, _args: Any, _output: Any) -> None:
    """Forward hook on an attention module: stores the kv-cache's latest scales
    of this layer as ``k_scale`` / ``v_scale``."""
    kv_cache = getattr(module, "kv_cache")
    _store(module, KEY_SCALE, kv_cache.k_scales[module.layer_idx])
    _store(module, VALUE_SCALE, kv_cache.v_scales[module.layer_idx])


def kv_cache_args(module: Module) -> Optional[QuantizationArgs]:
    """The kv-cache ``QuantizationArgs`` of an attention module, or None.

    A module is a kv-cache target when it has ``k_scale`` and ``v_scale``
    parameters; its args are ``input_activations`` where compressed-tensors
    installed its kv-cache wrapper, else ``output_activations`` (the older layout).
    """
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is None or not all(isinstance(getattr(module, n, None), torch.Tensor) for n in (KEY_SCALE, VALUE_SCALE)):
        return None
    wrapped = module._modules.get("kv_cache") is not None or module in _SET_ASIDE
    return scheme.input_activations if wrapped else scheme.output_activations


def initialize_quantized_kv_cache(module: Module) -> None:
    """Give an attention module with kv-cache quantization a
    ``QuantizedKVParameterCache`` as ``module.kv_cache`` (nothing for other
    modules or when it already has one)."""
    from obskernels.legacy.kv_cache import QuantizedKVParameterCache

    if isinstance(getattr(module, "kv_cache", None), QuantizedKVParameterCache):
        return
    args = kv_cache_args(module)
    if args is None:
        return
    cache = QuantizedKVParameterCache(args)
    wrapper = module._modules.pop("kv_cache", None)
    if wrapper is not None:
        _SET_ASIDE[module] = wrapper
    module.kv_cache = cache


def freeze_module_quantization(module: Module) -> None:
    """End calibration of ``module`` (``model.apply(...)`` for a whole model):
    nothing to do without a scheme or when already FROZEN; otherwise the
    input / weight / output observers and the quantized kv-cache are removed
    (compressed-tensors' kv-cache wrapper comes back), the module is FROZEN
    and its quantization switched on (``prepare_calibration`` switched it off)."""
    from obskernels.legacy.kv_cache import QuantizedKVParameterCache

    if not getattr(module, "quantization_scheme", None):
        return
    if getattr(module, "quantization_status", None) == QuantizationStatus.FROZEN:
        return
    for name in ("input", "weight", "output"):
        if hasattr(module, f"{name}_observer"):
            delattr(module, f"{name}_observer")
    if isinstance(getattr(module, "kv_cache", None), QuantizedKVParameterCache):
        delattr(module, "kv_cache")
        wrapper = _SET_ASIDE.pop(module, None)
        if wrapper is not None:
            module.register_module("kv_cache", wrapper)
    module.quantization_status = QuantizationStatus.FROZEN
    module.quantization_enabled = True


def register_legacy_hooks(module: Module) -> list[RemovableHandle]:
    """The older flow's calibration hooks on ``module`` (by what it carries):
    input (an input observer), kv cache (a quantized kv-cache), output (an
    output observer, when not a kv-cache module)."""
    from obskernels.legacy.kv_cache import QuantizedKVParameterCache

    handles = []
    if hasattr(module, "input_observer"):
        handles.append(module.register_forward_pre_hook(calibrate_input_hook))
    if isinstance(getattr(module, "kv_cache", None), QuantizedKVParameterCache):
        handles.append(module.register_forward_pre_hook(calibrate_kv_cache_input_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(calibrate_kv_cache_output_hook))
    elif hasattr(module, "output_observer"):
        handles.append(module.register_forward_hook(calibrate_output_hook))
    return handles


def prepare_calibration(model: Module) -> list[RemovableHandle]:
    """The older flow's set-up on every module of ``model`` with a scheme
    (see the module docstring); returns the hook handles, to remove after
    ``model.apply(freeze_module_quantization)``."""
    handles: list[RemovableHandle] = []
    modules = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    for module in modules:
        if kv_cache_args(module) is not None:
            initialize_quantized_kv_cache(module)
        else:
            initialize_observer(module, "input")
            initialize_observer(module, "output")
        initialize_observer(module, "weight")
        module.quantization_status = QuantizationStatus.CALIBRATION
        # the compressed-tensors required here (0.19+) quantizes a Linear's output inside its
        # forward, before any forward hook: calibrate_output_hook must see the
        # raw output (it returns the fake-quantized one itself)
        module.quantization_enabled = False
    for module in modules:
        update_weight_global_scale(module)
        update_weight_zp_scale(module)
        handles.extend(register_legacy_hooks(module))
    return handles
