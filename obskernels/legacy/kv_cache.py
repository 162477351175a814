"""The quantized kv-cache of the older calibration flow, as a ``transformers`` Cache.

During calibration it stands in for the model's cache in each quantized
attention module (``calibrate_kv_cache_input_hook`` passes it as
``past_key_values``). Every ``update(key_states, value_states, layer_idx)``
observes the key and value states of that layer with an older-API observer
(``obskernels.legacy``, computing through ``obskernels.ops``), keeps the
resulting scales and zero points in ``k_scales`` / ``v_scales`` / ``k_zps`` /
``v_zps`` (indexed by ``layer_idx``), and returns the states quantized and
dequantized with them, as that flow did. Nothing is stored as cache content:
the attention runs with ``use_cache=False``.

Needs transformers (imported with this module).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from transformers import DynamicCache

from obskernels.legacy.observers import Observer

__all__ = ["QuantizedKVParameterCache", "legacy_observer_name"]


def legacy_observer_name(args: QuantizationArgs) -> str:
    """The older registry's name for ``args.observer`` (None -> "minmax");
    a name that registry does not hold is a ValueError."""
    name = args.observer or "minmax"
    known = [n.replace("-", "_") for n in Observer.registered_names()]
    if name.replace("-", "_") not in known:
        raise ValueError(
            f"observer {name!r} does not exist in the older observer API (it has {known}); "
            "use obskernels.calibration for the current observers"
        )
    return name


def _set_at(items: List[Any], index: int, value: Any) -> None:
    """``items[index] = value``, padding with None: layers can be skipped."""
    if len(items) <= index:
        items.extend([None] * (index + 1 - len(items)))
    items[index] = value


class QuantizedKVParameterCache(DynamicCache):
    """A Cache that calibrates and fake-quantizes key / value states per layer.

    :param quantization_args: the kv-cache ``QuantizationArgs``; its observer
        (None: "minmax") and ``observer_kwargs`` build one older-API observer
        per layer for keys and one for values.

    One instance per attention module (the older flow kept one for the whole
    process); the scale lists are indexed by ``layer_idx`` either way.
    """

    def __init__(self, quantization_args: QuantizationArgs):
        if not isinstance(quantization_args, QuantizationArgs):
            raise TypeError(
                f"quantization_args must be a QuantizationArgs, got {type(quantization_args).__name__}"
            )
        super().__init__()
        self.quantization_args = quantization_args
        self._observer_name = legacy_observer_name(quantization_args)
        self.k_observers: List[Optional[Observer]] = []
        self.v_observers: List[Optional[Observer]] = []
        self.k_scales: List[Optional[torch.Tensor]] = []
        self.v_scales: List[Optional[torch.Tensor]] = []
        self.k_zps: List[Optional[torch.Tensor]] = []
        self.v_zps: List[Optional[torch.Tensor]] = []

    def _observer(self) -> Observer:
        return Observer.load_from_registry(
            self._observer_name,
            quantization_args=self.quantization_args,
            **(self.quantization_args.observer_kwargs or {}),
        )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: Optional[Dict[str, Any]] = None,
        *args,
        **kwargs,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Observe this layer's key and value states; return them fake-quantized."""
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        if len(self.k_observers) <= layer_idx or self.k_observers[layer_idx] is None:
            _set_at(self.k_observers, layer_idx, self._observer())
            _set_at(self.v_observers, layer_idx, self._observer())
        keys = self._qdq(key_states, self.k_observers[layer_idx], self.k_scales, self.k_zps, layer_idx)
        values = self._qdq(value_states, self.v_observers[layer_idx], self.v_scales, self.v_zps, layer_idx)
        return keys, values

    def _qdq(self, states, observer, scales, zps, layer_idx) -> torch.Tensor:
        states = states.contiguous()
        scale, zero_point = observer(states)
        _set_at(scales, layer_idx, scale)
        _set_at(zps, layer_idx, zero_point)
        q = quantize(x=states, scale=scale, zero_point=zero_point, args=self.quantization_args)
        return dequantize(x_q=q, scale=scale, zero_point=zero_point, args=self.quantization_args)

    def add_past_key_values(self, past_key_values) -> None:
        """Accepts compressed-tensors' attention hook handing over the model's
        cache: this cache replaces it during calibration (nothing to keep)."""

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return 0  # nothing is cached

    def reset_states(self) -> None:
        """Drop the observers and the scales (a new calibration starts)."""
        for items in (self.k_observers, self.v_observers, self.k_scales, self.v_scales, self.k_zps, self.v_zps):
            items.clear()
