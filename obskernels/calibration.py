"""Calibration lifecycle: observers attached to a quantized model and fed by hooks.

Works on any ``torch.nn`` model to which compressed-tensors'
``apply_quantization_config`` was applied (each targeted module carries a
``quantization_scheme`` and ``<base>_scale`` / ``<base>_zero_point`` /
``<base>_global_scale`` parameters). The flow, as llm-compressor runs it::

    start_calibration(model)                   # observers, hooks, fused groups
    for batch in batches:
        model(**batch)                         # activations (and imatrix importance) observed
    modules = get_modules(model)               # a fixed order, the same on every rank
    sync_observer_stats(modules)               # DDP only: all-reduce activation statistics
    update_qparams(modules, ACTIVATION_BASE_NAMES)
    observe(modules, "weight")
    update_qparams(modules, "weight")
    end_calibration(model)                     # observers and hooks removed, quantization on

The building blocks (``initialize_observer``, the ``calibrate_*`` hooks,
``observe``, ``update_qparams``, ``freeze_module_quantization``) can be used
one by one, as llm-compressor's modifiers do.

Base names and the scheme field each reads: "weight" -> ``weights``,
"input" / "q" / "k" / "v" -> ``input_activations``, "output" ->
``output_activations``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable
from typing import Iterator, Optional, Sequence

import torch
from compressed_tensors.quantization import (
    DynamicType,
    QuantizationArgs,
    QuantizationStatus,
    QuantizationStrategy,
)
from compressed_tensors.utils import update_offload_parameter
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from obskernels.observers import Observer
from obskernels.spec.checks import check_base_name

__all__ = [
    "ACTIVATION_BASE_NAMES",
    "ALL_BASE_NAMES",
    "FUSED_LAYER_NAMES",
    "CalibrationWarning",
    "quantization_args_for",
    "initialize_observer",
    "calibrate_activations",
    "calibrate_input_hook",
    "calibrate_output_hook",
    "calibrate_query_hook",
    "calibrate_key_hook",
    "calibrate_value_hook",
    "register_calibration_hooks",
    "fuse_weight_observers",
    "start_calibration",
    "end_calibration",
    "calibrating",
    "observe",
    "update_qparams",
    "sync_observer_stats",
    "freeze_module_quantization",
    "get_modules",
    "weight_g_idx",
]

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
_HOOKS: "weakref.WeakKeyDictionary[Module, list[RemovableHandle]]" = weakref.WeakKeyDictionary()
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


# ------------------------------------------------------ observe / qparams


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


def weight_g_idx(module: Module) -> Optional[torch.Tensor]:
    """``module.weight_g_idx`` (activation ordering: column j belongs to group
    ``weight_g_idx[j]``), or None when the module has none or it holds only the
    -1 placeholder that older compressed-tensors allocate before GPTQ sets it."""
    g_idx = getattr(module, "weight_g_idx", None)
    if not isinstance(g_idx, torch.Tensor):
        return None
    if g_idx.numel() and g_idx.device.type != "meta" and bool((g_idx == -1).all()):
        return None
    return g_idx


def observe(module=None, base_name: str = "weight", *, modules=None) -> None:
    """Run ``<base_name>_observer`` of ``module`` (a module or an iterable of
    modules) on the module's tensor of that name; only "weight" names a tensor
    held by the module (activations are observed through the hooks). Modules
    without the observer are skipped. A module's ``weight_g_idx`` (activation
    ordering) is passed on, so GROUP weights are grouped as it says.
    ``modules=`` is the older keyword of ``module``."""
    module = _one_of(module, modules, "module", "modules", "observe")
    check_base_name(base_name)
    if base_name != "weight":
        raise ValueError(
            f"observe: base_name {base_name!r} is an activation, observed by the "
            "calibration hooks (calibrate_activations); observe() reads module.weight"
        )
    for m in _as_module_list(module, "observe"):
        observer = getattr(m, "weight_observer", None)
        if observer is None:
            continue
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"observe: module '{_label(m)}' has a weight observer but no weight")
        observer(weight, g_idx=weight_g_idx(m))


def _store(module: Module, name: str, value: torch.Tensor, only_update_onload: bool) -> None:
    if not only_update_onload:
        update_offload_parameter(module, name, value)
        return
    # the onloaded tensor only (an offloaded copy, if any, is left as it was)
    param = getattr(module, name)
    param.data = value.to(device=param.device, dtype=param.dtype)


def update_qparams(
    module=None,
    base_name=None,
    only_update_onload: bool = False,
    *,
    modules=None,
    base_names=None,
) -> None:
    """Compute each observer's qparams and store them on its module.

    ``module``: a module or an iterable of modules; ``base_name``: a base
    name or an iterable of them (``modules=`` / ``base_names=`` are their
    older keywords). Stores ``<base>_scale``, ``<base>_zero_point`` and, for
    TENSOR_GROUP, ``<base>_global_scale`` where the module has those
    parameters: through ``update_offload_parameter`` (the onloaded tensor and
    any offloaded copy), or, with ``only_update_onload=True``, into the
    onloaded tensor only (a temporary update, or a DDP rank that must not
    write the shared offload). Skipped: modules without the observer, fully
    dynamic args (no observer), and the scale / zero point of locally dynamic
    args (only their global scale is static). A weight observer not yet
    observed observes ``module.weight`` here. An activation observer that
    never saw data leaves the placeholders (scale 1, zero point 0) and raises
    a ``CalibrationWarning`` naming the module.
    """
    module = _one_of(module, modules, "module", "modules", "update_qparams")
    base_name = _one_of(base_name, base_names, "base_name", "base_names", "update_qparams")
    names = _as_base_names(base_name, "update_qparams")
    for m in _as_module_list(module, "update_qparams"):
        # every qparam of the module is computed first and stored together:
        # an exception (or Ctrl-C) leaves the module's qparams all old or all new
        pending: list[tuple[str, torch.Tensor]] = []
        settled: list[str] = []
        for base in names:
            observer = getattr(m, f"{base}_observer", None)
            if observer is None:
                continue
            args = observer.args
            if args.dynamic is True:
                continue
            if not observer.has_statistics and base == "weight":
                observe(m, "weight")
            if not observer.has_statistics:
                warnings.warn(
                    f"module '{_label(m)}' saw no {base} data during calibration: "
                    f"its {base} qparams keep the placeholders (scale 1, zero point 0). "
                    "Check that the calibration data reaches this module (e.g. that "
                    "every MoE expert receives tokens).",
                    CalibrationWarning,
                    stacklevel=2,
                )
                settled.append(base)
                continue
            qparams = observer.get_qparams()
            local_dynamic = args.dynamic == DynamicType.LOCAL
            for key, value in qparams.items():
                if value is None or (local_dynamic and key != "global_scale"):
                    continue
                pname = f"{base}_{key}"
                if isinstance(getattr(m, pname, None), torch.Tensor):
                    pending.append((pname, value))
            settled.append(base)
        _store_together(m, pending, only_update_onload)
        _SETTLED.setdefault(m, set()).update(settled)


def _store_together(
    module: Module, pending: list[tuple[str, torch.Tensor]], only_update_onload: bool
) -> None:
    """Store every (parameter name, value) on ``module`` (``_store``), or none
    of them: a failure part-way puts back the values already replaced."""
    old = {name: getattr(module, name).detach().clone() for name, _ in pending}
    done: list[str] = []
    try:
        for name, value in pending:
            _store(module, name, value, only_update_onload)
            done.append(name)
    except BaseException:
        for name in reversed(done):
            _store(module, name, old[name], only_update_onload)
        raise


def sync_observer_stats(modules, *, timeout: Optional[float] = None) -> None:
    """All-reduce the activation statistics of ``modules``' observers across
    DDP ranks and wait for them. Every rank must pass the same modules in the
    same order (see ``get_modules``). A no-op without a process group.

    ``timeout`` (seconds) bounds each collective (None: ``sync_timeout`` /
    OBSKERNELS_SYNC_TIMEOUT / the process group's timeout): a rank that exited
    or hangs raises ``DistributedSyncError`` naming the module, the observer
    and the collective on the other ranks instead of hanging them."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from obskernels.observers.sync import DistributedSyncError, sync_timeout

    handles = []
    seen: set[int] = set()
    with sync_timeout(timeout) if timeout is not None else contextlib.nullcontext():
        for module in _as_module_list(modules, "sync_observer_stats"):
            for base in ALL_BASE_NAMES:
                observer = getattr(module, f"{base}_observer", None)
                if observer is None or id(observer) in seen:
                    continue
                seen.add(id(observer))
                try:
                    started = observer.sync_activation_stats()
                except DistributedSyncError as exc:
                    raise DistributedSyncError(f"module '{_label(module)}' {base}_observer: {exc}") from exc
                handles.extend((module, base, h) for h in started)
    for module, base, handle in handles:
        try:
            handle.wait()
        except DistributedSyncError as exc:
            raise DistributedSyncError(f"module '{_label(module)}' {base}_observer: {exc}") from exc


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
