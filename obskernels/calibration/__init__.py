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

from obskernels.calibration.attach import (
    FUSED_LAYER_NAMES,
    calibrate_activations,
    calibrate_input_hook,
    calibrate_key_hook,
    calibrate_output_hook,
    calibrate_query_hook,
    calibrate_value_hook,
    fuse_weight_observers,
    initialize_observer,
    register_calibration_hooks,
)
from obskernels.calibration.lifecycle import (
    calibrating,
    end_calibration,
    freeze_module_quantization,
    start_calibration,
)
from obskernels.calibration.modules import (
    ACTIVATION_BASE_NAMES,
    ALL_BASE_NAMES,
    CalibrationWarning,
    get_modules,
    quantization_args_for,
)
from obskernels.calibration.qparams import observe, sync_observer_stats, update_qparams, weight_g_idx

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
