"""A value checked for flattening, and its group layout.

Every observer operation reduces the flattened value of docs/spec.md §2,
``(num_observations, *qparam_shape, group_size)``, over dims (0, -1).
``flattening`` checks a (value, base_name, args, g_idx) call against every
rule of §2, once, into a frozen ``Flattening``: the strategy, its group size
or block shape, g_idx's column order, and the shapes that come out. The
reference reshapes the value by it; the kernels never build the flattened
tensor. For them ``group_layout`` derives from a Flattening, for each
base_name x strategy, where element ``(q, r, e)`` of the flattened value
lives in the RAW value's storage:

- ``q`` in [0, Q): the group, i.e. the flat index into the qparam shape
  (``min_vals.reshape(-1)[q]``). It splits as ``q = qa * QB + qb``.
- ``r`` in [0, NR): a "row" of the group (an observation, a row of a block,
  ...). It splits into three levels ``r = (r0 * R1 + r1) * R2 + r2``.
- ``e`` in [0, E): an element within that row.

    offset(q, r, e) = qa*sqa + qb*sqb + r0*sr0 + r1*sr1 + r2*sr2 + e*se

Two modes change that formula:

- PAD (BLOCK strategy with partial blocks): the element is a padding zero
  unless ``qa*NR + r < lim_r`` and ``qb*E + e < lim_e`` (the block's row and
  column coordinates fall inside the weight).
- GATHER (weights with g_idx): the column comes from ``perm`` (the stable
  argsort of g_idx, int32), ``offset = qa*sqa + perm[qb*E + e]*se + rows``.

For every layout except the whole-value reductions (``storage_order=True``
with a single group), the order of (r, e) within a group is the reference's
flattened order, so ``r * E + e`` is the index along the last flattened dim
(after the observation dim) -- the flatten kernel and order-sensitive
reductions rely on it. ``group_layout`` checks nothing: its input was checked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
from compressed_tensors.quantization import QuantizationArgs
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

__all__ = ["Flattening", "flattening", "Geometry", "GroupLayout", "group_layout", "coalesce"]


class Flattening(NamedTuple):
    """A value checked for flattening (``flattening``), docs/spec.md §2.

    ``group_size``: GROUP and TENSOR_GROUP's; ``block``: BLOCK's (height,
    width); ``column_order``: a weight's columns in the stable order of its
    g_idx (int64, what ``check_g_idx`` returns), None without g_idx.
    ``qshape``: the shape of min_vals / max_vals; ``flat_shape``: the
    flattened value's (padding of partial blocks included).

    A named tuple, so that ``obskernels.ops`` can make the flattening of
    another value of a checked signature without checking it again
    (``flat._replace(value=other)``: nothing here but the value depends on
    more than the value's shape, strides, dtype and device and the args).
    """

    value: torch.Tensor
    base_name: str
    strategy: Strategy
    args: QuantizationArgs
    qshape: tuple[int, ...]
    flat_shape: tuple[int, ...]
    group_size: int | None = None
    block: tuple[int, int] | None = None
    column_order: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return math.prod(self.qshape)

    @property
    def has_elements(self) -> bool:
        """Whether the flattened value holds any element."""
        return math.prod(self.flat_shape) != 0

    def of(self, other: torch.Tensor) -> "Flattening":
        """The same flattening of ``other``, a tensor of the value's shape
        (the search's per-column importance, broadcast over the rows)."""
        if tuple(other.shape) != tuple(self.value.shape):
            raise ValueError(
                f"a flattening of shape {tuple(self.value.shape)} cannot take a tensor of "
                f"shape {tuple(other.shape)}"
            )
        return self._replace(value=other)


class Geometry(NamedTuple):
    """A layout's shape-and-stride scalars, one kernel argument (a tuple):
    group q = qa * QB + qb starts at qa*sqa + qb*sqb; row r = (r0 * R1 + r1)
    * R2 + r2 adds r0*sr0 + r1*sr1 + r2*sr2; element e adds e*se, for e < E.
    Triton specialises every field of a tuple argument (a 1 becomes a
    constant, a multiple of 16 is known aligned), as the kernels want for
    these; the per-size extents stay separate arguments (``kernel_args``)."""

    QB: int
    sqa: int
    sqb: int
    R1: int
    R2: int
    sr0: int
    sr1: int
    sr2: int
    E: int
    se: int


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Index map from flattened (group q, row r, element e) to raw storage offsets.

    See the module docstring for the formula. ``qshape`` is the shape of
    min_vals / max_vals; ``flat_shape`` the reference's flattened shape. With
    ``ordered``, flat element (n, q, k) is layout element (q, r, e) with
    n * (group size) + k == r * E + e: for weights (one observation) a
    contiguous copy written in (q, r, e) order IS the flattened tensor; for
    activations and attention the rows r are the observations n.
    """

    qshape: tuple[int, ...]
    flat_shape: tuple[int, ...]
    groups: tuple[int, int]  # (QA, QB)
    group_strides: tuple[int, int]  # (sqa, sqb); sqb is 0 under GATHER
    rows: tuple[int, int, int]  # (R0, R1, R2)
    row_strides: tuple[int, int, int]
    elems: int  # E
    elem_stride: int  # se
    pad_limits: tuple[int, int] | None = None  # (lim_r, lim_e) under PAD
    perm: torch.Tensor | None = None  # int32 column order under GATHER
    ordered: bool = True  # (r, e) follows the reference's flattened order

    @property
    def num_groups(self) -> int:
        return self.groups[0] * self.groups[1]

    @property
    def num_rows(self) -> int:
        return self.rows[0] * self.rows[1] * self.rows[2]

    @property
    def pad(self) -> bool:
        return self.pad_limits is not None

    @property
    def gather(self) -> bool:
        return self.perm is not None

    def geometry(self) -> "Geometry":
        """The shape-and-stride scalars, grouped as the kernels take them."""
        return Geometry(
            self.groups[1], *self.group_strides, self.rows[1], self.rows[2], *self.row_strides,
            self.elems, self.elem_stride,
        )

    def kernel_args(self) -> tuple:
        """What a kernel takes of the layout, in order: the extents
        (Q, NR, lim_r, lim_e), then the ``geometry()``. The extents vary with
        every size of value, so kernels leave them unspecialised (one compiled
        variant for every size); the geometry's fields are specialised
        (a stride or size of 1 is known at compile time, loads vectorise)."""
        lim_r, lim_e = self.pad_limits or (0, 0)
        return (self.num_groups, self.num_rows, lim_r, lim_e, self.geometry())

    @property
    def row_levels(self) -> int:
        """How many of the three row levels (inner ones) are in use: 1 when
        row r sits at r * sr2, 2 when r = r1 * R2 + r2, else 3."""
        return 3 if self.rows[0] > 1 else (2 if self.rows[1] > 1 else 1)

    def axis_strides(self) -> tuple[int, int, int]:
        """Memory stride along the tile's (Q, R, E) axes, to pick which to widen."""
        big = 1 << 62
        q = self.group_strides[1] if self.groups[1] > 1 else self.group_strides[0]
        if self.gather:
            q = big  # gathered columns: no contiguity to exploit across groups
        r = next((s for n, s in zip(self.rows[::-1], self.row_strides[::-1]) if n > 1), big)
        return abs(q), abs(r), abs(self.elem_stride)


def coalesce(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop size-1 dims and merge neighbours (outer, inner) that address one run:
    outer_stride == inner_stride * inner_size. Keeps the outer-to-inner order."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def _rows(dims: list[tuple[int, int]]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    dims = coalesce(dims)
    if len(dims) > 3:  # cannot happen for the spec's ranks (<= 3 row dims)
        raise AssertionError(f"more than 3 row levels: {dims}")
    dims = [(1, 0)] * (3 - len(dims)) + dims
    return tuple(n for n, _ in dims), tuple(s for _, s in dims)


def _whole(dims: list[tuple[int, int]], qshape, flat_shape, storage_order):
    """One group covering ``dims`` (size, stride), outer to inner in logical order.

    storage_order: visit elements in memory order (dims sorted by stride and
    merged), which reads a transposed or permuted view as one run where it can.
    """
    if storage_order:
        dims = sorted(dims, key=lambda d: -abs(d[1]))
    merged = coalesce(dims) or [(1, 0)]
    if storage_order and len(merged) == 1:
        # One run: cut it into rows so several programs can share it, by the
        # largest power-of-two divisor of its length (up to 4096); when that is
        # too short, keep the innermost dim apart as the row instead.
        elems, se = merged[0]
        run = min(elems & -elems, 4096)
        if run >= 256 and run < elems:
            merged = [(elems // run, run * se), (run, se)]
        else:
            merged = coalesce(dims[:-1]) + [d for d in dims[-1:] if d[0] > 1] or merged
    dims = merged
    elems, se = dims.pop()
    rows, row_strides = _rows(dims)
    return GroupLayout(
        qshape=qshape,
        flat_shape=flat_shape,
        groups=(1, 1),
        group_strides=(0, 0),
        rows=rows,
        row_strides=row_strides,
        elems=elems,
        elem_stride=se,
        ordered=not storage_order,
    )


def flattening(value, base_name, args, g_idx=None) -> Flattening:
    """``value`` checked for ``flatten_for_calibration(value, base_name, args,
    g_idx)``: every rule of docs/spec.md §2, in one order (base_name, strategy,
    value, g_idx's applicability, then the strategy's own arguments: group
    size and g_idx's values, or block shape), each with its message from
    obskernels.spec.checks. Every dtype of ``VALUE_DTYPES`` passes (the kernels
    raise KernelUnsupportedError for float64 themselves)."""
    base_name, strategy = check_flatten(value, base_name, args, g_idx)
    shape = tuple(value.shape)
    checked = functools.partial(Flattening, value, base_name, strategy, args)

    if base_name == WEIGHT:
        rows, cols = shape
        if strategy == Strategy.TENSOR:
            return checked((1,), (1, 1, rows * cols))
        if strategy == Strategy.CHANNEL:
            return checked((rows, 1), (1, rows, 1, cols))
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, cols)
            # the stable column order by group comes with the check (one sort)
            order = None if g_idx is None else check_g_idx(g_idx, value, g)
            return checked((rows, cols // g), (1, rows, cols // g, g), group_size=g,
                           column_order=order)
        if strategy == Strategy.BLOCK:
            bh, bw = block_shape(args)
            nbr, nbc = -(-rows // bh), -(-cols // bw)
            return checked((nbr, nbc), (1, nbr, nbc, bh * bw), block=(bh, bw))
        raise unsupported(base_name, strategy)

    if base_name in ACTIVATIONS:
        hidden = shape[-1]
        tokens = math.prod(shape[:-1])
        if strategy == Strategy.TENSOR:
            return checked((1,), (tokens, 1, hidden))
        if strategy == Strategy.TOKEN:
            # amin over (0, -1) of the value itself: a 0-d result for 2-D tokens
            return checked(() if len(shape) == 2 else (shape[1],), shape)
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, hidden)
            return checked((hidden // g,), (tokens, hidden // g, g), group_size=g)
        raise unsupported(base_name, strategy)

    # attention q / k / v: (batch, heads, seq, head_dim)
    batch, heads, seq, head_dim = shape
    if strategy == Strategy.TENSOR:
        return checked((1,), (batch * seq, 1, heads * head_dim))
    if strategy == Strategy.ATTN_HEAD:
        return checked((heads, 1, 1), (batch * seq, heads, 1, 1, head_dim))
    raise unsupported(base_name, strategy)


def group_layout(flat: Flattening, *, storage_order: bool = True) -> GroupLayout:
    """The index map of a checked flattening (``flattening``): where each
    element of the flattened value lives in the raw value's storage. Only
    arithmetic on shapes and strides (and g_idx's column order as int32).

    storage_order: for whole-value reductions (a single group reduced over
    every element), visit elements in memory order instead of the reference's
    flattened order. Order-insensitive reductions (min/max) want True.
    """
    value, strategy = flat.value, flat.strategy
    shape, strides = tuple(value.shape), tuple(value.stride())
    qshape, flat_shape = flat.qshape, flat.flat_shape

    if flat.base_name == WEIGHT:
        (rows, cols), (sr, sc) = shape, strides
        if strategy == Strategy.TENSOR:
            return _whole([(rows, sr), (cols, sc)], qshape, flat_shape, storage_order)
        if strategy == Strategy.CHANNEL:
            return GroupLayout(
                qshape=qshape,
                flat_shape=flat_shape,
                groups=(rows, 1),
                group_strides=(sr, 0),
                rows=(1, 1, 1),
                row_strides=(0, 0, 0),
                elems=cols,
                elem_stride=sc,
            )
        if strategy == Strategy.BLOCK:
            (bh, bw), (nbr, nbc) = flat.block, qshape
            return GroupLayout(
                qshape=qshape,
                flat_shape=flat_shape,
                groups=(nbr, nbc),
                group_strides=(bh * sr, bw * sc),
                rows=(1, 1, bh),
                row_strides=(0, 0, sr),
                elems=bw,
                elem_stride=sc,
                pad_limits=(rows, cols) if rows % bh != 0 or cols % bw != 0 else None,
            )
        # GROUP, TENSOR_GROUP
        g = flat.group_size
        perm = None if flat.column_order is None else flat.column_order.to(torch.int32)
        return GroupLayout(
            qshape=qshape,
            flat_shape=flat_shape,
            groups=qshape,
            group_strides=(sr, 0 if perm is not None else g * sc),
            rows=(1, 1, 1),
            row_strides=(0, 0, 0),
            elems=g,
            elem_stride=sc,
            perm=perm,
        )

    if flat.base_name in ACTIVATIONS:
        hidden, sh = shape[-1], strides[-1]
        token_dims = list(zip(shape[:-1], strides[:-1]))
        if strategy == Strategy.TENSOR or (strategy == Strategy.TOKEN and value.dim() == 2):
            return _whole(token_dims + [(hidden, sh)], qshape, flat_shape, storage_order)
        if strategy == Strategy.TOKEN:
            (batch, sb), (seq, ss) = token_dims
            rows, row_strides = _rows([(batch, sb)])
            return GroupLayout(
                qshape=qshape,
                flat_shape=flat_shape,
                groups=(seq, 1),
                group_strides=(ss, 0),
                rows=rows,
                row_strides=row_strides,
                elems=hidden,
                elem_stride=sh,
            )
        # GROUP, TENSOR_GROUP
        g = flat.group_size
        rows, row_strides = _rows(token_dims)
        return GroupLayout(
            qshape=qshape,
            flat_shape=flat_shape,
            groups=(hidden // g, 1),
            group_strides=(g * sh, 0),
            rows=rows,
            row_strides=row_strides,
            elems=g,
            elem_stride=sh,
        )

    # attention q / k / v: (batch, heads, seq, head_dim)
    (batch, heads, seq, head_dim), (sb, shd, ss, sd) = shape, strides
    if strategy == Strategy.TENSOR:
        dims = [(batch, sb), (seq, ss), (heads, shd), (head_dim, sd)]
        return _whole(dims, qshape, flat_shape, storage_order)
    # ATTN_HEAD
    rows, row_strides = _rows([(batch, sb), (seq, ss)])
    return GroupLayout(
        qshape=qshape,
        flat_shape=flat_shape,
        groups=(heads, 1),
        group_strides=(shd, 0),
        rows=rows,
        row_strides=row_strides,
        elems=head_dim,
        elem_stride=sd,
    )
