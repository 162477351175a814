"""How many tokens each activation observer of a model has seen."""

from __future__ import annotations

from collections import Counter

import torch

from obskernels.observers.base import Observer

__all__ = ["get_observer_token_count"]


def get_observer_token_count(model: torch.nn.Module) -> Counter:
    """Counter {observer's qualified module name: tokens observed}.

    Every activation observer (input, output, q, k, v) found in
    ``model.named_modules()`` appears, even at 0; weight observers do not.
    A token is one row of an (tokens, hidden) or (batch, seq, hidden) value,
    or one (batch, seq) position of an attention state.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    counts: Counter = Counter()
    for name, module in model.named_modules():
        if isinstance(module, Observer) and not module.is_weight_obs:
            counts[name] = module._num_observed_tokens
    return counts
