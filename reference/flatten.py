"""Reference flattening: (num_observations, *qparam_shape, group_size), docs/spec.md §2."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationStrategy as Strategy

from obskernels.spec.checks import (
    ACTIVATIONS,
    WEIGHT,
    block_shape,
    check_flatten,
    check_g_idx,
    group_size_of,
    unsupported,
)

__all__ = ["flatten_for_calibration", "block_shape", "group_size_of"]


def flatten_for_calibration(value, base_name, args, g_idx=None):
    base_name, strategy = check_flatten(value, base_name, args, g_idx, float64=True)

    if base_name == WEIGHT:
        rows, cols = value.shape
        if strategy == Strategy.TENSOR:
            return value.reshape(1, 1, rows * cols)
        if strategy == Strategy.CHANNEL:
            return value.reshape(1, rows, 1, cols)
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, cols)
            if g_idx is not None:
                # check_g_idx returns the columns in stable order of g_idx
                value = value[:, check_g_idx(g_idx, value, g)]
            return value.reshape(1, rows, cols // g, g)
        if strategy == Strategy.BLOCK:
            bh, bw = block_shape(args)
            padded = F.pad(value, (0, -cols % bw, 0, -rows % bh))
            R, C = padded.shape
            blocks = padded.reshape(R // bh, bh, C // bw, bw).transpose(1, 2)
            return blocks.reshape(1, R // bh, C // bw, bh * bw)
        raise unsupported(base_name, strategy)

    if base_name in ACTIVATIONS:
        hidden = value.shape[-1]
        # explicit sizes, not -1: a (tokens, 0) value must reshape too
        n = math.prod(value.shape[:-1])
        tokens = value.reshape(n, hidden)
        if strategy == Strategy.TENSOR:
            return tokens.reshape(n, 1, hidden)
        if strategy == Strategy.TOKEN:
            return value
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, hidden)
            return tokens.reshape(n, hidden // g, g)
        raise unsupported(base_name, strategy)

    # attention q / k / v: (batch, heads, seq, head_dim)
    batch, heads, seq, head_dim = value.shape
    per_token = value.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    if strategy == Strategy.TENSOR:
        return per_token.reshape(batch * seq, 1, heads * head_dim)
    if strategy == Strategy.ATTN_HEAD:
        return per_token.reshape(batch * seq, heads, 1, 1, head_dim)
    raise unsupported(base_name, strategy)
