"""Weights observed, qparams computed and stored, statistics synced.

``observe`` runs weight observers on their module's weight (with its
activation order), ``update_qparams`` computes every observer's qparams and
stores a module's qparams together (all old or all new), and
``sync_observer_stats`` all-reduces activation statistics across DDP ranks.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from compressed_tensors.quantization import DynamicType
from compressed_tensors.utils import update_offload_parameter
from torch.nn import Module

from obskernels.calibration.modules import (
    _SETTLED,
    ALL_BASE_NAMES,
    CalibrationWarning,
    _as_base_names,
    _as_module_list,
    _label,
    _one_of,
)
from obskernels.spec.checks import check_base_name

__all__ = ["weight_g_idx", "observe", "update_qparams", "sync_observer_stats"]

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
