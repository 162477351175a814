"""Input checks shared by every backend, so bad input fails the same way everywhere.

Each check raises ValueError or TypeError with a message that names the
argument and what was expected.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

__all__ = [
    "FLOAT_DTYPES",
    "WEIGHT",
    "ACTIVATIONS",
    "ATTENTION",
    "check_value",
    "check_base_name",
    "check_g_idx",
    "strategy_of",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT = "weight"
ACTIVATIONS = ("input", "output")
ATTENTION = ("q", "k", "v")


def check_base_name(base_name) -> str:
    if base_name == WEIGHT or base_name in ACTIVATIONS or base_name in ATTENTION:
        return base_name
    raise ValueError(
        f"base_name must be one of 'weight', 'input', 'output', 'q', 'k', 'v', "
        f"got {base_name!r}"
    )


def strategy_of(args) -> QuantizationStrategy:
    if not isinstance(args, QuantizationArgs):
        raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
    if args.strategy is None:
        raise ValueError("args.strategy is None; expected a QuantizationStrategy")
    return QuantizationStrategy(args.strategy)


def check_value(value, base_name: str, name: str = "value") -> None:
    """A floating tensor with the rank that ``base_name`` implies."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} dtype must be one of float32, float16, bfloat16, got {value.dtype}"
        )
    if base_name == WEIGHT and value.dim() != 2:
        raise ValueError(
            f"{name} of a weight must be 2-D (rows, cols), got shape {tuple(value.shape)}"
        )
    if base_name in ACTIVATIONS and value.dim() not in (2, 3):
        raise ValueError(
            f"{name} of an activation must be (tokens, hidden) or (batch, seq, hidden), "
            f"got shape {tuple(value.shape)}"
        )
    if base_name in ATTENTION and value.dim() != 4:
        raise ValueError(
            f"{name} of attention {base_name!r} must be (batch, heads, seq, head_dim), "
            f"got shape {tuple(value.shape)}"
        )


def check_g_idx(g_idx, value: torch.Tensor, group_size: int) -> None:
    """g_idx maps each column to a group; every group must hold group_size columns."""
    if not isinstance(g_idx, torch.Tensor):
        raise TypeError(f"g_idx must be a torch.Tensor, got {type(g_idx).__name__}")
    if g_idx.dtype.is_floating_point or g_idx.dtype.is_complex or g_idx.dtype == torch.bool:
        raise TypeError(f"g_idx must hold integers, got dtype {g_idx.dtype}")
    cols = value.shape[-1]
    if g_idx.dim() != 1 or g_idx.numel() != cols:
        raise ValueError(
            f"g_idx must be 1-D with one entry per column ({cols}), "
            f"got shape {tuple(g_idx.shape)}"
        )
    if g_idx.device != value.device:
        raise ValueError(
            f"g_idx is on {g_idx.device} but value is on {value.device}; "
            "expected the same device"
        )
    num_groups = cols // group_size
    if cols and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise ValueError(
            f"g_idx values must lie in [0, {num_groups}), got range "
            f"[{int(g_idx.min())}, {int(g_idx.max())}]"
        )
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    if cols and not bool((counts == group_size).all()):
        raise ValueError(
            f"g_idx must assign exactly group_size={group_size} columns to each group"
        )
