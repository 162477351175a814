"""Input checks: one function (and one message) per rule, for every backend.

Each check raises ValueError or TypeError with a message that names the
argument and what was expected. ``obskernels.spec.calls`` runs them, once per
call, in the order each operation documents, and hands the backends a checked
call; neither backend checks anything itself, so bad input fails the same way
everywhere, before anything launches. Valid input that the kernels do not
cover (float64 values) is not an input error: the triton backend raises
``KernelUnsupportedError`` for it, so "auto" falls back to the reference with
one logged message and a forced "triton" reports it.

dtype policy:
- values: float32, float16, bfloat16 on every backend; float64 on the
  reference only (computed in float64, as llm-compressor does); integer, bool,
  complex and float8 values are a TypeError everywhere.
- accumulate_sq inputs: float32, float16, bfloat16 and float64 on every
  backend (each element is cast to float32 before squaring, as llm-compressor's
  imatrix hook does).
"""

from __future__ import annotations

import math

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

from obskernels.spec.errors import HeldStatisticsError
from obskernels.spec.record import STATUS_INIT

__all__ = [
    "FLOAT_DTYPES",
    "VALUE_DTYPES",
    "WEIGHT",
    "ACTIVATIONS",
    "ATTENTION",
    "VALUE_DIMS",
    "check_value",
    "check_same_device",
    "check_groups_nonempty",
    "check_base_name",
    "check_g_idx",
    "check_importance",
    "check_flatten",
    "group_size_of",
    "block_shape",
    "unsupported",
    "check_importance_target",
    "check_accumulate_args",
    "check_held",
    "check_out",
    "check_averaging",
    "check_status",
    "describe_nonfinite",
    "all_finite",
    "count_nonfinite",
    "strategy_of",
    "check_qparams_args",
    "check_importance_status",
    "check_importance_args",
    "check_combine_args",
    "check_statistics_shape",
    "check_statistics_pair",
    "HeldStatisticsError",
]

#: dtypes the triton kernels read
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: dtypes an observed value may have (float64: reference backend only)
VALUE_DTYPES = FLOAT_DTYPES + (torch.float64,)
WEIGHT = "weight"
ACTIVATIONS = ("input", "output")
ATTENTION = ("q", "k", "v")
#: the dims a value of each base name may have (docs/spec.md §2)
VALUE_DIMS = {WEIGHT: (2,), **dict.fromkeys(ACTIVATIONS, (2, 3)), **dict.fromkeys(ATTENTION, (4,))}

_STRATEGIES = tuple(s.value for s in QuantizationStrategy)


def check_same_device(name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """One message for every "these tensors must share a device" rule."""
    if tensor.device != other.device:
        raise ValueError(
            f"{name} is on {tensor.device} but {other_name} is on {other.device}; "
            "expected the same device"
        )


def check_base_name(base_name) -> str:
    if isinstance(base_name, str) and (
        base_name == WEIGHT or base_name in ACTIVATIONS or base_name in ATTENTION
    ):
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
    try:
        return QuantizationStrategy(args.strategy)
    except ValueError:
        # pydantic validates at construction, not on assignment or model_copy
        raise ValueError(
            f"args.strategy must be one of {_STRATEGIES}, got {args.strategy!r}"
        ) from None


def check_value(value, base_name: str, name: str = "value") -> None:
    """A floating tensor with the rank that ``base_name`` implies."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in VALUE_DTYPES:
        raise TypeError(
            f"{name} dtype must be one of float32, float16, bfloat16 (or float64 on the "
            f"reference backend), got {value.dtype}"
        )
    dims = VALUE_DIMS.get(base_name)
    if dims is None or value.dim() in dims:  # (an unknown base_name: check_base_name's)
        return
    if base_name == WEIGHT:
        raise ValueError(
            f"{name} of a weight must be 2-D (rows, cols), got shape {tuple(value.shape)}"
        )
    if base_name in ACTIVATIONS:
        raise ValueError(
            f"{name} of an activation must be (tokens, hidden) or (batch, seq, hidden), "
            f"got shape {tuple(value.shape)}"
        )
    raise ValueError(
        f"{name} of attention {base_name!r} must be (batch, heads, seq, head_dim), "
        f"got shape {tuple(value.shape)}"
    )


def check_flatten(value, base_name, args, g_idx=None):
    """The checks every operation that flattens ``value`` (docs/spec.md §2) runs
    first, in this order; returns (base_name, strategy). The strategy's own
    arguments and the g_idx values come next (``spec.layout.flattening``)."""
    base_name = check_base_name(base_name)
    strategy = strategy_of(args)
    check_value(value, base_name)
    if g_idx is not None and not (base_name == WEIGHT and strategy == QuantizationStrategy.GROUP):
        raise ValueError("g_idx applies only to weights with the 'group' strategy")
    return base_name, strategy


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


def unsupported(base_name: str, strategy: QuantizationStrategy) -> ValueError:
    """The error for a strategy that docs/spec.md §2 does not define for ``base_name``."""
    return ValueError(
        f"strategy {strategy.value!r} cannot be applied to base_name {base_name!r}"
    )


def check_groups_nonempty(flat_shape, value: torch.Tensor, op: str) -> None:
    """Every group of a flattened value of shape ``flat_shape`` (obs,
    *qparam_shape, group) must hold an element: an empty group has no
    min/max. A value with no groups at all (a qparam shape with a 0) is fine:
    its result is empty. Observers skip empty values before they get here."""
    groups = math.prod(flat_shape[1:-1])
    if math.prod(flat_shape) == 0 and groups != 0:
        raise ValueError(
            f"{op}: value of shape {tuple(value.shape)} leaves its {groups} group(s) empty "
            f"(flattened shape {tuple(flat_shape)}); expected at least one element "
            "per group"
        )


def check_g_idx(g_idx, value: torch.Tensor, group_size: int) -> torch.Tensor:
    """g_idx maps each column to a group; every group must hold group_size columns.

    Returns the stable order of the columns by group (``torch.argsort(g_idx,
    stable=True)``, int64), which flattening needs anyway: the checks read it.
    Every column in [0, num_groups) and group_size columns per group together
    say that the sorted g_idx is 0 (group_size times), 1 (group_size times), ...
    -- one sort, one comparison and ONE read of the result on the valid path;
    the range is read only to word the error.
    """
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
    check_same_device("g_idx", g_idx, "value", value)
    sorted_groups, order = torch.sort(g_idx, stable=True)
    if not cols:
        return order
    num_groups = cols // group_size
    expected = torch.arange(num_groups, device=g_idx.device).unsqueeze(1)
    if bool((sorted_groups.view(num_groups, group_size) == expected).all()):
        return order
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(g_idx)).tolist())
    if lo < 0 or hi >= num_groups:
        raise ValueError(
            f"g_idx values must lie in [0, {num_groups}), got range [{lo}, {hi}]"
        )
    raise ValueError(
        f"g_idx must assign exactly group_size={group_size} columns to each group"
    )


def check_importance(importance, value: torch.Tensor, values: bool = True) -> None:
    """Per-input-column weights of the imatrix search: a real 1-D tensor with one
    finite, non-negative entry per column of ``value``, on ``value``'s device."""
    if not isinstance(importance, torch.Tensor):
        raise TypeError(
            f"importance must be a torch.Tensor, got {type(importance).__name__}"
        )
    if importance.dtype.is_complex or importance.dtype == torch.bool:
        raise TypeError(
            f"importance must hold real numbers (floating or integer), got dtype {importance.dtype}"
        )
    cols = value.shape[-1]
    if importance.dim() != 1 or importance.numel() != cols:
        raise ValueError(
            f"importance must be 1-D with one entry per input column ({cols}), "
            f"got shape {tuple(importance.shape)}"
        )
    check_same_device("importance", importance, "value", value)
    if not values or importance.device.type == "meta" or importance.numel() == 0:
        return  # no data to check
    # One reduction and ONE read: aminmax propagates NaN, so both values are
    # finite exactly when every entry is, and the minimum says the sign.
    lo, hi = (float(v) for v in torch.stack(torch.aminmax(importance)).tolist())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~torch.isfinite(importance)).sum())
        raise ValueError(
            f"importance must be finite, got {bad} non-finite of {importance.numel()} entries"
        )
    if lo < 0:
        raise ValueError(f"importance must be non-negative, got minimum {lo!r}")


_IMPORTANCE_STRATEGIES = (
    QuantizationStrategy.CHANNEL, QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP,
)


def check_importance_target(importance, value: torch.Tensor, base_name: str, args,
                            values: bool = True) -> None:
    """Importance weighs the search of a weight whose groups lie within rows
    (CHANNEL, GROUP, TENSOR_GROUP); then ``check_importance``."""
    strategy = strategy_of(args)
    if base_name != WEIGHT or strategy not in _IMPORTANCE_STRATEGIES:
        raise ValueError(
            "importance applies only to weights with the 'channel', 'group' or "
            f"'tensor_group' strategy, got base_name {base_name!r} and strategy "
            f"{strategy.value!r}"
        )
    check_importance(importance, value, values)


def check_accumulate_args(x, sum_buf, count_buf) -> None:
    """Inputs of ``accumulate_sq``: x (..., channels), fp32 sums, one int64 count."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in VALUE_DTYPES:
        raise TypeError(
            f"x dtype must be float32, float16, bfloat16 or float64, got {x.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"x must be (..., channels) with at least one channel, got shape {tuple(x.shape)}"
        )
    if not isinstance(sum_buf, torch.Tensor) or sum_buf.dtype != torch.float32:
        raise TypeError("sum_buf must be a float32 torch.Tensor")
    if sum_buf.shape != (x.shape[-1],):
        raise ValueError(
            f"sum_buf must have shape ({x.shape[-1]},) to match x's last dim, "
            f"got {tuple(sum_buf.shape)}"
        )
    if not isinstance(count_buf, torch.Tensor) or count_buf.dtype != torch.int64:
        raise TypeError("count_buf must be an int64 torch.Tensor")
    if sum_buf.numel() > 1 and sum_buf.stride(0) == 0:
        raise ValueError(
            "sum_buf must not be an expanded (stride 0) view: its channels would "
            "share one memory location"
        )
    if count_buf.numel() != 1:
        raise ValueError(f"count_buf must hold one element, got shape {tuple(count_buf.shape)}")
    for name, buf in (("sum_buf", sum_buf), ("count_buf", count_buf)):
        check_same_device(name, buf, "x", x)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite, with ONE read to the host.

    ``x * 0`` is 0 for a finite x and NaN for NaN and +-inf, and a sum of zeros
    cannot overflow, so ``sum(x * 0)`` is 0 exactly when every x is finite:
    mul and sum (plus one ``cat`` for several tensors) before the read, where
    ``torch.isfinite(x).all()`` takes five ops (isfinite is abs, eq, ne, mul)
    for each tensor. Integer tensors are finite without a read; float8 is
    widened first (no CPU arithmetic for it). An empty tensor is finite.
    """
    parts = [t.reshape(-1) for t in tensors if t.dtype.is_floating_point and t.numel()]
    if not parts:
        return True
    x = parts[0] if len(parts) == 1 else torch.cat(parts)
    if x.dtype not in VALUE_DTYPES:
        x = x.float()  # float8: exact in fp32, NaN kept
    return (x * 0).sum().item() == 0


def count_nonfinite(t: torch.Tensor) -> tuple[int, str]:
    """(N, "N non-finite (a NaN, b +inf, c -inf) of M values"). Reads ``t`` three
    times: for error paths only."""
    nan = int(torch.isnan(t).sum())
    pos = int(torch.isposinf(t).sum())
    neg = int(torch.isneginf(t).sum())
    return nan + pos + neg, describe_nonfinite(nan, pos, neg, t.numel())


def describe_nonfinite(nan: int, pos: int, neg: int, numel: int) -> str:
    """"N non-finite (a NaN, b +inf, c -inf) of M values"."""
    return f"{nan + pos + neg} non-finite ({nan} NaN, {pos} +inf, {neg} -inf) of {numel} values"


def check_statistics_pair(min_name: str, mins, max_name: str, maxs) -> None:
    """Per-group minima and maxima of one call (``calculate_qparams``'s
    min_vals / max_vals, ``combine_statistics``' new_min / new_max): floating
    tensors of one shape, dtype and device (the maxima checked against the
    minima)."""
    for name, t in ((min_name, mins), (max_name, maxs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in VALUE_DTYPES:
            raise TypeError(
                f"{name} dtype must be one of float32, float16, bfloat16 or float64, got {t.dtype}"
            )
    if mins.shape != maxs.shape:
        raise ValueError(
            f"{min_name} and {max_name} must have the same shape, got {tuple(mins.shape)} "
            f"and {tuple(maxs.shape)}"
        )
    if mins.dtype != maxs.dtype:
        raise TypeError(
            f"{min_name} and {max_name} must have the same dtype, got {mins.dtype} and {maxs.dtype}"
        )
    check_same_device(max_name, maxs, min_name, mins)


def check_qparams_args(min_vals, max_vals, args, global_scale=None, fused=None, carry=None) -> None:
    """Statistics and options of ``calculate_qparams``: the same checks on every backend."""
    check_statistics_pair("min_vals", min_vals, "max_vals", max_vals)
    if not isinstance(args, QuantizationArgs):
        raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
    if global_scale is not None and fused is not None:
        raise ValueError("pass either global_scale or fused statistics, not both")
    if global_scale is not None:
        if not isinstance(global_scale, torch.Tensor):
            raise TypeError(f"global_scale must be a torch.Tensor, got {type(global_scale).__name__}")
        check_same_device("global_scale", global_scale, "min_vals", min_vals)
    if fused is not None:
        pairs = list(fused)
        if not pairs:
            raise ValueError("fused must hold at least one (min_vals, max_vals) pair")
        for mn, mx in pairs:
            if not (isinstance(mn, torch.Tensor) and isinstance(mx, torch.Tensor)):
                raise TypeError("fused must hold (min_vals, max_vals) pairs of tensors")
            if mn.numel() == 0 or mn.shape != mx.shape:
                raise ValueError(
                    f"fused statistics must be non-empty pairs of one shape, got "
                    f"{tuple(mn.shape)} and {tuple(mx.shape)}"
                )
            for name, t in (("min_vals", mn), ("max_vals", mx)):
                check_same_device(f"fused {name}", t, "min_vals", min_vals)
    if carry is not None and (
        not isinstance(carry, torch.Tensor) or carry.dtype != torch.int64
        or carry.shape != (len(STATUS_INIT),)
    ):
        raise TypeError(f"carry must be an int64 tensor of shape ({len(STATUS_INIT)},)")
    if carry is not None:
        check_same_device("carry", carry, "min_vals", min_vals)


def check_held(held, qshape, dtype, device) -> None:
    """Held (min_vals, max_vals) must match the new statistics' shape, dtype, device."""
    if not (isinstance(held, tuple) and len(held) == 2
            and all(isinstance(t, torch.Tensor) for t in held)):
        raise TypeError("held must be a (min_vals, max_vals) pair of tensors")
    for t in held:
        if tuple(t.shape) != tuple(qshape):
            raise HeldStatisticsError(
                f"held statistics of shape {tuple(t.shape)} do not match the new statistics' "
                f"shape {tuple(qshape)}", qshape,
            )
        if t.dtype != dtype or t.device != device:
            raise ValueError(
                f"held statistics ({t.dtype} on {t.device}) must have the new statistics' "
                f"dtype and device ({dtype} on {device})"
            )


def check_out(out, qshape, dtype, device) -> None:
    """``out`` (min_vals, max_vals): two distinct contiguous tensors with the
    statistics' shape, dtype and device, which the results overwrite (they may
    be the held or the new statistics themselves: each group is read before
    it is written)."""
    if not (isinstance(out, tuple) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError("out must be a (min_vals, max_vals) pair of tensors")
    for t in out:
        if tuple(t.shape) != tuple(qshape) or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"out statistics ({tuple(t.shape)} {t.dtype} on {t.device}) must have the "
                f"statistics' shape, dtype and device ({tuple(qshape)} {dtype} on {device})"
            )
        if not t.is_contiguous():
            raise ValueError("out statistics must be contiguous")
    if out[0].numel() and device.type != "meta" and out[0].data_ptr() == out[1].data_ptr():
        raise ValueError("out must be two distinct tensors (min_vals, max_vals)")


def check_averaging(averaging_constant) -> None:
    if averaging_constant is not None and (
        isinstance(averaging_constant, bool) or not isinstance(averaging_constant, (int, float))
        or not 0 <= averaging_constant <= 1
    ):
        raise ValueError(f"averaging_constant must be a number in [0, 1], got {averaging_constant!r}")


def check_status(status) -> None:
    if status is not None and (
        not isinstance(status, torch.Tensor) or status.dtype != torch.int64
        or tuple(status.shape) != (len(STATUS_INIT),)
    ):
        raise TypeError(f"status must be an int64 tensor of shape ({len(STATUS_INIT)},)")


def check_combine_args(new_min, new_max, held, averaging_constant, status) -> None:
    check_statistics_pair("new_min", new_min, "new_max", new_max)
    if held is not None:
        check_held(held, new_min.shape, new_min.dtype, new_min.device)
    check_averaging(averaging_constant)
    check_status(status)


def check_statistics_shape(new_min, qshape) -> None:
    """``combine_statistics``: the new statistics have one entry per group of the value."""
    if tuple(new_min.shape) != tuple(qshape):
        raise ValueError(
            f"combine_statistics: new statistics of shape {tuple(new_min.shape)} do not match "
            f"the value's groups {tuple(qshape)}"
        )


def check_importance_status(importance, importance_status) -> None:
    """``importance_status`` of mse_search: None, or an observer's int64 record
    (``STATUS_INIT`` layout) holding the verdict on raw fp32 ``importance``."""
    if importance_status is None:
        return
    if importance is None:
        raise ValueError("importance_status is given without importance")
    if (
        not isinstance(importance_status, torch.Tensor)
        or importance_status.dtype != torch.int64
        or tuple(importance_status.shape) != (len(STATUS_INIT),)
    ):
        raise TypeError(
            f"importance_status must be an int64 tensor of shape ({len(STATUS_INIT)},)"
        )
    if isinstance(importance, torch.Tensor) and importance.dtype != torch.float32:
        raise TypeError(
            f"raw importance (with importance_status) must be float32, got {importance.dtype}"
        )
    if isinstance(importance, torch.Tensor):
        check_same_device("importance_status", importance_status, "importance", importance)


def check_importance_args(sum_buf, count_buf, status) -> None:
    """Inputs of ``importance``: fp32 per-column sums, one int64 count, and an
    observer's int64 record (``STATUS_INIT`` layout), all on one device."""
    if not isinstance(sum_buf, torch.Tensor) or sum_buf.dtype != torch.float32:
        raise TypeError("sum_buf must be a float32 torch.Tensor")
    if sum_buf.dim() != 1:
        raise ValueError(f"sum_buf must be 1-D (one entry per input column), got shape "
                         f"{tuple(sum_buf.shape)}")
    if not isinstance(count_buf, torch.Tensor) or count_buf.dtype != torch.int64:
        raise TypeError("count_buf must be an int64 torch.Tensor")
    if count_buf.numel() != 1:
        raise ValueError(f"count_buf must hold one element, got shape {tuple(count_buf.shape)}")
    if (not isinstance(status, torch.Tensor) or status.dtype != torch.int64
            or tuple(status.shape) != (len(STATUS_INIT),)):
        raise TypeError(f"status must be an int64 tensor of shape ({len(STATUS_INIT)},)")
    for name, buf in (("count_buf", count_buf), ("status", status)):
        check_same_device(name, buf, "sum_buf", sum_buf)
