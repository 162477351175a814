"""The group layout of a value: the frozen object a flattening call is checked into.

Every observer operation reduces the flattened value of docs/spec.md §2,
``(num_observations, *qparam_shape, group_size)``, over dims (0, -1). The
kernels never build that flattened tensor. Instead ``group_layout`` describes,
for each base_name x strategy, where element ``(q, r, e)`` of the flattened
value lives in the RAW value's storage:

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
reductions rely on it.

``group_layout`` runs the flatten checks of ``obskernels.spec.checks`` (those
the reference's flattening runs, in its order) and describes the result; the
kernels address raw storage with it (kernels/_layout.py) and never build the
flattened tensor.
"""

from __future__ import annotations

import dataclasses
import math

import torch
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

__all__ = ["GroupLayout", "group_layout", "coalesce"]


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

    def scalar_args(self) -> tuple[int, ...]:
        """The runtime scalars, in the order the kernels take them:
        Q, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e."""
        lim_r, lim_e = self.pad_limits or (0, 0)
        return (
            self.num_groups,
            self.groups[1],
            *self.group_strides,
            self.rows[1],
            self.rows[2],
            *self.row_strides,
            self.num_rows,
            self.elems,
            self.elem_stride,
            lim_r,
            lim_e,
        )

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


def _whole(value: torch.Tensor, dims: list[tuple[int, int]], qshape, flat_shape, storage_order):
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


def group_layout(value, base_name, args, g_idx=None, *, storage_order=True,
                 float64: bool = False) -> GroupLayout:
    """The layout of ``flatten_for_calibration(value, base_name, args, g_idx)``.

    Runs the checks of obskernels.spec that the reference runs, in the same
    order, so bad input raises the same ValueError / TypeError on both backends
    before anything launches.
    For an empty value only the shapes mean something (the kernels launch
    nothing for it: obskernels.ops hands it to the reference).

    storage_order: for whole-value reductions (a single group reduced over
    every element), visit elements in memory order instead of the reference's
    flattened order. Order-insensitive reductions (min/max) want True.
    float64: whether the caller computes float64 values (the reference, which
    takes only the group shape from a layout); otherwise they raise
    KernelUnsupportedError after the other checks (``check_value``).
    """
    base_name, strategy = check_flatten(value, base_name, args, g_idx, float64=float64)
    shape, strides = tuple(value.shape), tuple(value.stride())

    if base_name == WEIGHT:
        (rows, cols), (sr, sc) = shape, strides
        if strategy == Strategy.TENSOR:
            return _whole(value, [(rows, sr), (cols, sc)], (1,), (1, 1, rows * cols), storage_order)
        if strategy == Strategy.CHANNEL:
            return GroupLayout(
                qshape=(rows, 1),
                flat_shape=(1, rows, 1, cols),
                groups=(rows, 1),
                group_strides=(sr, 0),
                rows=(1, 1, 1),
                row_strides=(0, 0, 0),
                elems=cols,
                elem_stride=sc,
            )
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, cols)
            perm = None
            if g_idx is not None:
                # the stable column order by group comes with the check (one sort)
                perm = check_g_idx(g_idx, value, g).to(torch.int32)
            return GroupLayout(
                qshape=(rows, cols // g),
                flat_shape=(1, rows, cols // g, g),
                groups=(rows, cols // g),
                group_strides=(sr, 0 if perm is not None else g * sc),
                rows=(1, 1, 1),
                row_strides=(0, 0, 0),
                elems=g,
                elem_stride=sc,
                perm=perm,
            )
        if strategy == Strategy.BLOCK:
            bh, bw = block_shape(args)
            nbr, nbc = -(-rows // bh), -(-cols // bw)
            partial = rows % bh != 0 or cols % bw != 0
            return GroupLayout(
                qshape=(nbr, nbc),
                flat_shape=(1, nbr, nbc, bh * bw),
                groups=(nbr, nbc),
                group_strides=(bh * sr, bw * sc),
                rows=(1, 1, bh),
                row_strides=(0, 0, sr),
                elems=bw,
                elem_stride=sc,
                pad_limits=(rows, cols) if partial else None,
            )
        raise unsupported(base_name, strategy)

    if base_name in ACTIVATIONS:
        hidden, sh = shape[-1], strides[-1]
        token_dims = list(zip(shape[:-1], strides[:-1]))
        tokens = math.prod(shape[:-1])
        if strategy == Strategy.TENSOR:
            return _whole(value, token_dims + [(hidden, sh)], (1,), (tokens, 1, hidden), storage_order)
        if strategy == Strategy.TOKEN:
            if value.dim() == 2:  # amin over (0, -1) of a 2-D value: a 0-d result
                return _whole(value, token_dims + [(hidden, sh)], (), shape, storage_order)
            (batch, sb), (seq, ss) = token_dims
            rows, row_strides = _rows([(batch, sb)])
            return GroupLayout(
                qshape=(seq,),
                flat_shape=shape,
                groups=(seq, 1),
                group_strides=(ss, 0),
                rows=rows,
                row_strides=row_strides,
                elems=hidden,
                elem_stride=sh,
            )
        if strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            g = group_size_of(args, hidden)
            rows, row_strides = _rows(token_dims)
            return GroupLayout(
                qshape=(hidden // g,),
                flat_shape=(tokens, hidden // g, g),
                groups=(hidden // g, 1),
                group_strides=(g * sh, 0),
                rows=rows,
                row_strides=row_strides,
                elems=g,
                elem_stride=sh,
            )
        raise unsupported(base_name, strategy)

    # attention q / k / v: (batch, heads, seq, head_dim)
    (batch, heads, seq, head_dim), (sb, shd, ss, sd) = shape, strides
    if strategy == Strategy.TENSOR:
        dims = [(batch, sb), (seq, ss), (heads, shd), (head_dim, sd)]
        return _whole(value, dims, (1,), (batch * seq, 1, heads * head_dim), storage_order)
    if strategy == Strategy.ATTN_HEAD:
        rows, row_strides = _rows([(batch, sb), (seq, ss)])
        return GroupLayout(
            qshape=(heads, 1, 1),
            flat_shape=(batch * seq, heads, 1, 1, head_dim),
            groups=(heads, 1),
            group_strides=(shd, 0),
            rows=rows,
            row_strides=row_strides,
            elems=head_dim,
            elem_stride=sd,
        )
    raise unsupported(base_name, strategy)
