"""Reference flattening: (num_observations, *qparam_shape, group_size), docs/spec.md §2."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy as S

from obskernels.validation import (
    ACTIVATIONS,
    WEIGHT,
    check_base_name,
    check_g_idx,
    check_value,
    strategy_of,
)

__all__ = ["flatten_for_calibration", "block_shape", "group_size_of"]


def group_size_of(args: QuantizationArgs, cols: int, name: str = "value") -> int:
    g = args.group_size
    if not isinstance(g, int) or g <= 0:
        raise ValueError(f"args.group_size must be a positive integer, got {g!r}")
    if cols % g != 0:
        raise ValueError(
            f"{name} has {cols} columns, not divisible by group_size {g}"
        )
    return g


def block_shape(args: QuantizationArgs) -> tuple[int, int]:
    bs = args.block_structure
    if (
        not isinstance(bs, (list, tuple))
        or len(bs) != 2
        or not all(isinstance(b, int) and b > 0 for b in bs)
    ):
        raise ValueError(
            f"args.block_structure must be [block_height, block_width] of positive "
            f"integers, got {bs!r}"
        )
    return int(bs[0]), int(bs[1])


def _unsupported(base_name: str, strategy: S) -> ValueError:
    return ValueError(
        f"strategy {strategy.value!r} cannot be applied to base_name {base_name!r}"
    )


def flatten_for_calibration(value, base_name, args, g_idx=None):
    base_name = check_base_name(base_name)
    strategy = strategy_of(args)
    check_value(value, base_name, float64=True)
    if g_idx is not None and not (base_name == WEIGHT and strategy == S.GROUP):
        raise ValueError("g_idx applies only to weights with the 'group' strategy")

    if base_name == WEIGHT:
        rows, cols = value.shape
        if strategy == S.TENSOR:
            return value.reshape(1, 1, rows * cols)
        if strategy == S.CHANNEL:
            return value.reshape(1, rows, 1, cols)
        if strategy in (S.GROUP, S.TENSOR_GROUP):
            g = group_size_of(args, cols)
            if g_idx is not None:
                # check_g_idx returns the columns in stable order of g_idx
                value = value[:, check_g_idx(g_idx, value, g)]
            return value.reshape(1, rows, cols // g, g)
        if strategy == S.BLOCK:
            bh, bw = block_shape(args)
            padded = F.pad(value, (0, -cols % bw, 0, -rows % bh))
            R, C = padded.shape
            blocks = padded.reshape(R // bh, bh, C // bw, bw).transpose(1, 2)
            return blocks.reshape(1, R // bh, C // bw, bh * bw)
        raise _unsupported(base_name, strategy)

    if base_name in ACTIVATIONS:
        hidden = value.shape[-1]
        # explicit sizes, not -1: a (tokens, 0) value must reshape too
        n = math.prod(value.shape[:-1])
        tokens = value.reshape(n, hidden)
        if strategy == S.TENSOR:
            return tokens.reshape(n, 1, hidden)
        if strategy == S.TOKEN:
            return value
        if strategy in (S.GROUP, S.TENSOR_GROUP):
            g = group_size_of(args, hidden)
            return tokens.reshape(n, hidden // g, g)
        raise _unsupported(base_name, strategy)

    # attention q / k / v: (batch, heads, seq, head_dim)
    batch, heads, seq, head_dim = value.shape
    per_token = value.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    if strategy == S.TENSOR:
        return per_token.reshape(batch * seq, 1, heads * head_dim)
    if strategy == S.ATTN_HEAD:
        return per_token.reshape(batch * seq, heads, 1, 1, head_dim)
    raise _unsupported(base_name, strategy)
