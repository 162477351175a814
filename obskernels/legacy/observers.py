"""The older observer API (llm-compressor 0.6-0.8), computing through ``obskernels.ops``.

In that API an observer is built from the ``QuantizationArgs`` alone and
returns qparams directly: ``observer(value)`` gives ``(scale, zero_point)``
(or the global scale), and the latest pair is kept for ``get_qparams()``
without a value. Running statistics are held per ``tensor_id`` (a group
index, ``"block_i_j"``, or ``"default"`` for the whole value), so one
observer calibrates every group of a weight separately.

Every reduction runs through ``obskernels.ops`` on the active backend: a
value reduced over ``reduce_dims`` is laid out as (kept, reduced) and
handed to ``ops.min_max`` / ``ops.mse_search`` as a per-row ("channel")
weight, so the reference and the triton kernels both serve it.

Behaviour kept from that era, and where it differs from the current API:

- min/max statistics are reduced over the given dims of the raw value: a
  partial BLOCK is reduced over its real elements (the current API pads it
  with zeros, docs/spec.md §2);
- the moving average is ``old + c * (new - old)`` (the current API writes
  ``old * (1 - c) + new * c``; the roundings differ); ``c == 1.0`` keeps no
  statistics at all;
- GROUP / TENSOR_GROUP: one search per group (its own patience), columns
  taken in the stable order of ``g_idx`` when one is given (a ``g_idx``
  holding -1 means column order);
- the MSE search on a TENSOR_GROUP value drops ``scale_dtype`` and the
  global scale while searching, as the current API does (docs/spec.md §4); the
  global scale then applies to the qparams.

Where the two APIs compute the same thing (one observation of a weight; an
activation seen once; full blocks) the qparams are identical.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
from compressed_tensors import InternalModule
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy as Strategy
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.registry.registry import RegistryMixin
from torch import Tensor

from obskernels import ops
from obskernels.observers.base import _number, check_averaging_constant
from obskernels.spec.search import check_search_params

__all__ = [
    "Observer",
    "MinMaxObserver",
    "MovingAverageMSEObserver",
    "get_observer_token_count",
    "DEFAULT_TENSOR_ID",
]

#: the key of statistics observed without a tensor_id
DEFAULT_TENSOR_ID = "default"

QParams = Tuple[Tensor, Tensor]


def _key(tensor_id: Optional[Any]) -> Any:
    return DEFAULT_TENSOR_ID if tensor_id is None else tensor_id


def _reduce_layout(observed: Tensor, reduce_dims: Optional[Iterable[int]]):
    """(2-D view (kept, reduced), result shape): every element of one row of
    the view reduces into one statistic. No ``reduce_dims`` reduces everything
    into a 0-d result (``torch.aminmax``'s shape); otherwise the reduced dims
    keep size 1."""
    nd = observed.dim()
    if not reduce_dims:
        return observed.reshape(1, -1), ()
    dims = sorted({d % nd for d in reduce_dims})
    kept = [d for d in range(nd) if d not in dims]
    out_shape = tuple(1 if d in dims else observed.shape[d] for d in range(nd))
    rows = math.prod(observed.shape[d] for d in kept)
    cols = math.prod(observed.shape[d] for d in dims)
    return observed.permute(*kept, *dims).reshape(rows, cols), out_shape


def _row_args(args: QuantizationArgs) -> QuantizationArgs:
    """``args`` as a per-row ("channel") search: each row of the (kept,
    reduced) view is one group. TENSOR_GROUP searches without scale_dtype."""
    update: Dict[str, Any] = {"strategy": Strategy.CHANNEL, "group_size": None, "block_structure": None}
    if args.strategy == Strategy.TENSOR_GROUP:
        update["scale_dtype"] = None
    return args.model_copy(update=update)


class Observer(InternalModule, RegistryMixin):
    """Base class of the older API: subclasses define ``calculate_qparams``
    (and ``calculate_gparam`` for a TENSOR_GROUP global scale).

    Its registry is its own: ``obskernels.legacy.Observer.load_from_registry(
    name, quantization_args=...)`` knows "minmax" and "mse".
    """

    def __init__(self, quantization_args: QuantizationArgs, **kwargs):
        if not isinstance(quantization_args, QuantizationArgs):
            raise TypeError(
                f"quantization_args must be a QuantizationArgs, got {type(quantization_args).__name__}"
            )
        super().__init__()
        self.quantization_args = quantization_args
        self._scale: Optional[Tensor] = None
        self._zero_point: Optional[Tensor] = None
        self._num_observed_tokens: Optional[int] = None

    # ------------------------------------------------------------ entry points

    @torch.no_grad()
    def forward(
        self,
        observed: Tensor,
        g_idx: Optional[Tensor] = None,
        global_scale: Optional[Tensor] = None,
        should_calculate_gparam: bool = False,
    ):
        """Count tokens, then the global scale (``should_calculate_gparam``)
        or ``get_qparams(observed, g_idx, global_scale)``."""
        self.record_observed_tokens(observed)
        if should_calculate_gparam:
            return self.get_gparam(observed)
        return self.get_qparams(observed=observed, g_idx=g_idx, global_scale=global_scale)

    def calculate_qparams(
        self,
        observed: Tensor,
        reduce_dims: Optional[Tuple[int, ...]] = None,
        tensor_id: Optional[Any] = None,
        global_scale: Optional[Tensor] = None,
    ) -> QParams:
        """(scale, zero_point) of ``observed`` reduced over ``reduce_dims``
        (all dims when None), statistics kept under ``tensor_id``."""
        raise NotImplementedError(f"{type(self).__name__} does not define calculate_qparams")

    def calculate_gparam(self, observed: Tensor) -> Tensor:
        """The TENSOR_GROUP global scale of ``observed``."""
        raise NotImplementedError(f"{type(self).__name__} does not define calculate_gparam")

    def post_calculate_qparams(self) -> None:
        """Called by the older calibration after qparams were stored (no-op here)."""

    def get_gparam(self, observed: Tensor) -> Tensor:
        """``calculate_gparam(observed)``; only the TENSOR_GROUP strategy has one."""
        if self.quantization_args.strategy == Strategy.TENSOR_GROUP:
            return self.calculate_gparam(observed)
        raise NotImplementedError(
            f"a global scale exists for strategy 'tensor_group' only, got "
            f"{self.quantization_args.strategy!r}"
        )

    def get_qparams(
        self,
        observed: Optional[Tensor] = None,
        g_idx: Optional[Tensor] = None,
        global_scale: Optional[Tensor] = None,
    ) -> QParams:
        """Qparams of ``observed`` by strategy, kept as the latest; without a
        value, the latest pair (None, None before any).

        tensor: one pair over the whole value; channel: per row (dim 0);
        token: per (batch, token), reducing the last dim; group /
        tensor_group: per row and group of ``group_size`` columns, each group
        under its own tensor_id (the group index); block: per
        ``block_structure`` block (partial blocks at the edges), tensor_id
        ``"block_i_j"``.
        """
        if observed is None:
            return self._scale, self._zero_point
        if not isinstance(observed, Tensor):
            raise TypeError(f"observed must be a torch.Tensor, got {type(observed).__name__}")
        args = self.quantization_args
        strategy = Strategy(args.strategy)
        if strategy == Strategy.TENSOR:
            self._scale, self._zero_point = self.calculate_qparams(observed, global_scale=global_scale)
        elif strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            self._scale, self._zero_point = self._group_qparams(observed, g_idx, global_scale)
        elif strategy == Strategy.CHANNEL:
            self._scale, self._zero_point = self.get_qparams_along_dim(observed, 0, global_scale=global_scale)
        elif strategy == Strategy.TOKEN:
            self._scale, self._zero_point = self.get_qparams_along_dim(
                observed, {0, 1}, global_scale=global_scale
            )
        elif strategy == Strategy.BLOCK:
            self._scale, self._zero_point = self._block_qparams(observed)
        else:
            raise ValueError(f"the older observer API has no strategy {strategy.value!r}")
        return self._scale, self._zero_point

    def get_qparams_along_dim(
        self,
        observed: Tensor,
        dim: Union[int, Iterable[int]],
        tensor_id: Optional[Any] = None,
        global_scale: Optional[Tensor] = None,
    ) -> QParams:
        """``calculate_qparams`` reducing every dim except ``dim`` (an int or a set)."""
        keep = {dim} if isinstance(dim, int) else set(dim)
        keep = {d % observed.dim() for d in keep}
        reduce_dims = tuple(d for d in range(observed.dim()) if d not in keep)
        return self.calculate_qparams(
            observed, reduce_dims=reduce_dims, tensor_id=tensor_id, global_scale=global_scale
        )

    # ------------------------------------------------------------- strategies

    def _group_qparams(self, observed: Tensor, g_idx, global_scale) -> QParams:
        args = self.quantization_args
        if observed.dim() != 2:
            raise ValueError(
                f"strategy {args.strategy!r} in the older observer API takes a 2-D weight "
                f"(rows, cols), got shape {tuple(observed.shape)}"
            )
        g = args.group_size
        if not isinstance(g, int) or g <= 0:
            raise ValueError(f"args.group_size must be a positive integer, got {g!r}")
        rows, cols = observed.shape
        if g_idx is not None and not bool((g_idx == -1).any()):
            # activation order: the columns of group k are those with g_idx == k
            if g_idx.dim() != 1 or g_idx.numel() != cols:
                raise ValueError(
                    f"g_idx must be 1-D with one entry per column ({cols}), got shape {tuple(g_idx.shape)}"
                )
            groups, sizes = torch.unique(g_idx, return_counts=True)
            sizes = sizes[torch.argsort(groups)].tolist()
            observed = observed[:, torch.argsort(g_idx, stable=True).to(observed.device)]
        else:
            sizes = [g] * (cols // g) + ([cols % g] if cols % g else [])
        scales, zps = [], []
        start = 0
        for index, size in enumerate(sizes):
            s, z = self.get_qparams_along_dim(
                observed[:, start:start + size], 0, tensor_id=index, global_scale=global_scale
            )
            scales.append(s)
            zps.append(z)
            start += size
        return torch.cat(scales, dim=1), torch.cat(zps, dim=1)

    def _block_qparams(self, observed: Tensor) -> QParams:
        bs = self.quantization_args.block_structure
        if not (
            isinstance(bs, (list, tuple)) and len(bs) == 2
            and all(isinstance(b, int) and b > 0 for b in bs)
        ):
            raise ValueError(
                f"args.block_structure must be [block_rows, block_cols] of positive integers, got {bs!r}"
            )
        if observed.dim() != 2:
            raise ValueError(f"strategy 'block' takes a 2-D weight, got shape {tuple(observed.shape)}")
        (rows, cols), (br, bc) = observed.shape, bs
        n_r, n_c = -(-rows // br), -(-cols // bc)
        scale_rows, zp_rows = [], []
        for i in range(n_r):
            srow, zrow = [], []
            for j in range(n_c):
                s, z = self.calculate_qparams(
                    observed[i * br:(i + 1) * br, j * bc:(j + 1) * bc],
                    reduce_dims=(0, 1),
                    tensor_id=f"block_{i}_{j}",
                )
                srow.append(s.reshape(1))
                zrow.append(z.reshape(1))
            scale_rows.append(torch.cat(srow))
            zp_rows.append(torch.cat(zrow))
        return torch.stack(scale_rows), torch.stack(zp_rows)

    # ------------------------------------------------------------------ tokens

    def record_observed_tokens(self, batch_tensor: Tensor) -> None:
        """Add the rows of a 2-D (tokens, features) value to
        ``_num_observed_tokens``; a value of any other rank makes the count
        None (unknown), as documented for the older API."""
        if not isinstance(batch_tensor, Tensor):
            raise ValueError(f"expected the observed value to be a tensor, got {type(batch_tensor).__name__}")
        if batch_tensor.dim() != 2:
            self._num_observed_tokens = None
            return
        self._num_observed_tokens = (self._num_observed_tokens or 0) + int(batch_tensor.shape[0])

    def reset(self) -> None:
        """Forget the token count and the latest qparams."""
        self._num_observed_tokens = None
        self._scale = None
        self._zero_point = None


class _RunningMinMax:
    """Running (min, max) per tensor_id with the older moving average."""

    def _init_running(self, averaging_constant) -> None:
        self.averaging_constant = check_averaging_constant(averaging_constant)
        self.min_val: Dict[Any, Tensor] = {}
        self.max_val: Dict[Any, Tensor] = {}

    def _running_update(self, min_val: Tensor, max_val: Tensor, tensor_id) -> Tuple[Tensor, Tensor]:
        if self.averaging_constant == 1.0:
            return min_val, max_val  # no averaging: nothing kept
        key = _key(tensor_id)
        old_min, old_max = self.min_val.get(key), self.max_val.get(key)
        if old_min is not None and old_max is not None:
            c = self.averaging_constant
            min_val = old_min + c * (min_val - old_min)
            max_val = old_max + c * (max_val - old_max)
        self.min_val[key], self.max_val[key] = min_val, max_val
        return min_val, max_val

    def reset(self) -> None:
        super().reset()
        self.min_val = {}
        self.max_val = {}


@Observer.register("minmax")
class MinMaxObserver(_RunningMinMax, Observer):
    """Scale and zero point from the observed min and max, with a moving
    average over observations (``averaging_constant``, default 0.01; 1.0
    uses each value alone)."""

    def __init__(self, quantization_args: QuantizationArgs, averaging_constant: float = 0.01, **kwargs):
        super().__init__(quantization_args=quantization_args)
        self._init_running(averaging_constant)

    def calculate_updated_min_max(
        self,
        observed: Tensor,
        reduce_dims: Optional[Tuple[int, ...]] = None,
        tensor_id: Optional[Any] = None,
    ) -> Tuple[Tensor, Tensor]:
        """min / max of ``observed`` over ``reduce_dims`` (``ops.min_max``),
        merged into the running values under ``tensor_id``."""
        rows, shape = _reduce_layout(observed, reduce_dims)
        mn, mx = ops.min_max(rows, "weight", _row_args(self.quantization_args))
        return self._running_update(mn.reshape(shape), mx.reshape(shape), tensor_id)

    def calculate_qparams(self, observed, reduce_dims=None, tensor_id=None, global_scale=None) -> QParams:
        mn, mx = self.calculate_updated_min_max(observed, reduce_dims=reduce_dims, tensor_id=tensor_id)
        return calculate_qparams(
            min_vals=mn, max_vals=mx, quantization_args=self.quantization_args, global_scale=global_scale
        )

    def calculate_gparam(self, observed: Tensor) -> Tensor:
        """``generate_gparam`` of the running min / max of the whole value."""
        mn, mx = self.calculate_updated_min_max(observed)
        return generate_gparam(mn.reshape(1), mx.reshape(1))


@Observer.register("mse")
class MovingAverageMSEObserver(_RunningMinMax, Observer):
    """Scale and zero point from the MSE-clipped min and max (the shrink-grid
    search of docs/spec.md §4, flavour "mse"), with the moving average of
    ``MinMaxObserver``."""

    def __init__(
        self,
        quantization_args: QuantizationArgs,
        maxshrink: float = 0.2,
        patience: int = 5,
        averaging_constant: float = 0.01,
        grid: float = 100.0,
        norm: float = 2.4,
        **kwargs,
    ):
        super().__init__(quantization_args=quantization_args)
        self._init_running(averaging_constant)
        self.maxshrink = _number("maxshrink", maxshrink)
        self.patience = _number("patience", patience, integer=True)
        self.grid = _number("grid", grid)
        self.norm = _number("norm", norm)
        check_search_params(self.maxshrink, self.patience, self.grid, self.norm, 1.0, "mse")

    def calculate_mse_min_max(
        self,
        observed: Tensor,
        reduce_dims: Optional[Tuple[int, ...]] = None,
        global_scale: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """The (min, max) candidate with the least quantization error per
        reduced slice (``ops.mse_search``, global patience over the slices).
        ``global_scale`` is accepted for the older signature; the search runs
        without it (docs/spec.md §4)."""
        rows, shape = _reduce_layout(observed, reduce_dims)
        mn, mx = ops.mse_search(
            rows, "weight", _row_args(self.quantization_args),
            maxshrink=self.maxshrink, patience=self.patience, grid=self.grid, norm=self.norm,
        )
        return mn.reshape(shape), mx.reshape(shape)

    def calculate_updated_min_max(
        self,
        observed: Tensor,
        reduce_dims: Optional[Tuple[int, ...]] = None,
        tensor_id: Optional[Any] = None,
        global_scale: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """The searched (min, max), merged into the running values under ``tensor_id``."""
        mn, mx = self.calculate_mse_min_max(observed, reduce_dims, global_scale=global_scale)
        return self._running_update(mn, mx, tensor_id)

    def calculate_qparams(self, observed, reduce_dims=None, tensor_id=None, global_scale=None) -> QParams:
        mn, mx = self.calculate_updated_min_max(
            observed, reduce_dims=reduce_dims, tensor_id=tensor_id, global_scale=global_scale
        )
        return calculate_qparams(
            min_vals=mn, max_vals=mx, quantization_args=self.quantization_args, global_scale=global_scale
        )


def get_observer_token_count(module: torch.nn.Module) -> Counter:
    """Counter {module name: tokens its ``input_observer`` counted} over
    ``module.named_modules()`` (the older API's keys: the observed module's
    name, not the observer's). A count is None when the observer never saw a
    2-D value or last saw one of another rank."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    counts: Counter = Counter()
    suffix = ".input_observer"
    for name, sub in module.named_modules():
        if name.endswith(suffix) and hasattr(sub, "_num_observed_tokens"):
            counts[name[: -len(suffix)]] = sub._num_observed_tokens
    return counts
