"""The older llm-compressor API (its 0.6-0.8 releases), computing through ``obskernels.ops``.

Kept apart from the current API (``obskernels.Observer``,
``obskernels.calibration``) because the same names mean other things there:

- ``obskernels.legacy.Observer`` / ``MinMaxObserver`` /
  ``MovingAverageMSEObserver`` / ``get_observer_token_count``: observers built
  from ``QuantizationArgs`` alone that return ``(scale, zero_point)`` from
  ``observer(value)`` (``obskernels.legacy.observers``);
- ``obskernels.legacy.calibration``: ``initialize_observer``,
  ``call_observer``, ``update_weight_zp_scale``, the input / output / kv-cache
  hooks, ``initialize_quantized_kv_cache`` and ``freeze_module_quantization``
  of that era;
- ``obskernels.legacy.kv_cache.QuantizedKVParameterCache``: the quantized
  kv-cache those hooks use (a ``transformers`` Cache; needs transformers).

``import obskernels.legacy`` needs neither transformers nor triton.
"""

from obskernels.legacy.observers import (
    DEFAULT_TENSOR_ID,
    MinMaxObserver,
    MovingAverageMSEObserver,
    Observer,
    get_observer_token_count,
)

__all__ = [
    "DEFAULT_TENSOR_ID",
    "Observer",
    "MinMaxObserver",
    "MovingAverageMSEObserver",
    "get_observer_token_count",
]
