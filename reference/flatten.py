"""Reference flattening: (num_observations, *qparam_shape, group_size), docs/spec.md §2."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationStrategy as Strategy

from obskernels.spec.checks import ACTIVATIONS, WEIGHT
from obskernels.spec.layout import Flattening

__all__ = ["flatten_for_calibration"]


def flatten_for_calibration(flat: Flattening) -> torch.Tensor:
    value, strategy = flat.value, flat.strategy

    if flat.base_name == WEIGHT:
        rows, cols = value.shape
        if strategy == Strategy.TENSOR:
            return value.reshape(1, 1, rows * cols)
        if strategy == Strategy.CHANNEL:
            return value.reshape(1, rows, 1, cols)
        if strategy == Strategy.BLOCK:
            bh, bw = flat.block
            padded = F.pad(value, (0, -cols % bw, 0, -rows % bh))
            R, C = padded.shape
            blocks = padded.reshape(R // bh, bh, C // bw, bw).transpose(1, 2)
            return blocks.reshape(1, R // bh, C // bw, bh * bw)
        # GROUP, TENSOR_GROUP: with g_idx, the columns in its stable order
        g = flat.group_size
        if flat.column_order is not None:
            value = value[:, flat.column_order]
        return value.reshape(1, rows, cols // g, g)

    if flat.base_name in ACTIVATIONS:
        hidden = value.shape[-1]
        # explicit sizes, not -1: a (tokens, 0) value must reshape too
        n = math.prod(value.shape[:-1])
        tokens = value.reshape(n, hidden)
        if strategy == Strategy.TENSOR:
            return tokens.reshape(n, 1, hidden)
        if strategy == Strategy.TOKEN:
            return value
        # GROUP, TENSOR_GROUP
        g = flat.group_size
        return tokens.reshape(n, hidden // g, g)

    # attention q / k / v: (batch, heads, seq, head_dim)
    batch, heads, seq, head_dim = value.shape
    per_token = value.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    if strategy == Strategy.TENSOR:
        return per_token.reshape(batch * seq, 1, heads * head_dim)
    # ATTN_HEAD
    return per_token.reshape(batch * seq, heads, 1, 1, head_dim)
