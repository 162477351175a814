"""Group layouts on the device, and the launchers' shared host-side policy.

The index map itself (``GroupLayout``, ``group_layout``: where element
(q, r, e) of the flattened value lives in the raw value's storage) is
obskernels.spec.layout's; it is re-exported here for the launchers.

Device side, ``group_base``, ``layout_rows`` and ``load_tile`` do this
arithmetic for a [BLOCK_Q, BLOCK_R, BLOCK_E] tile with int64 offsets, so a
value past 2^31 elements is addressed correctly; ``load_flat`` takes one flat
index k = r * E + e per element instead (mse_search walks groups that way).
A kernel takes the layout as ``GroupLayout.kernel_args()``: the extents
``Q, NR, lim_r, lim_e`` (unspecialised: one variant for every size) and one
``geo`` argument, the ``Geometry`` tuple of strides and inner sizes
(specialised field by field), which the helpers read by name.
``widen`` and ``store_exact`` move values between the value's dtype and fp32
exactly on both a GPU and the interpreter (bf16 through its bits); every
kernel that loads or stores values in the value's dtype goes through them.
Every launcher (min_max, flatten, mse_search, combine_statistics) derives
its layout from the call's checked ``Flattening`` with ``group_layout``;
``LaunchConfig`` and the block / split helpers below are the launchers'
shared host-side policy.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch
import triton
import triton.language as tl

from obskernels.spec.errors import KernelUnsupportedError
from obskernels.spec.layout import Geometry, GroupLayout, coalesce, group_layout

__all__ = [
    "Geometry",
    "GroupLayout",
    "LaunchConfig",
    "launch_config",
    "current_config",
    "on_device",
    "check_kernel_dtype",
    "check_launchable",
    "group_layout",
    "choose_blocks",
    "choose_split",
    "finish_blocks",
    "num_warps_for",
    "pow2_at_most",
    "coalesce",
    "group_coords",
    "group_base",
    "row_offsets",
    "layout_rows",
    "load_tile",
    "load_flat",
    "widen",
    "store_exact",
]


_MAX_GRID_1 = 65535  # CUDA's limit on grid axes 1 and 2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Host-side tuning of a launcher: fixed heuristics keyed on size, no autotuning.

    Each launcher module holds its defaults in a module-level ``CONFIG`` (a
    LaunchConfig) and reads it at every call through ``current_config``, which
    applies the fields set by an enclosing ``launch_config(...)`` block: that
    block is how a caller (a test, the compile check, the benchmark) passes a
    configuration in without rewriting a module's globals. Fields left None
    are chosen per call; pinning them makes a test take the same path on the
    CPU interpreter and on a GPU.

    tile: elements loaded per step by one program (power of two).
    split: programs sharing one group (its rows, or its chunks in mse_search)
        (None: from the amount of work, see ``choose_split``).
    fill_programs: how many programs a launch aims at when it splits. A
        constant (4 per SM of a 132-SM H100 SXM), NOT the device's SM count:
        the split decides the order of fp32 partial sums, so results stay the
        same on an H100 SXM, a PCIe card, a MIG slice and the CPU interpreter
        (a smaller GPU runs the same programs in more waves).
    min_elems_per_program: below this much work per program, do not split.
    max_reg_group (mse_search): largest group held whole in registers; larger
        groups take the split path.
    chunk (mse_search): elements per chunk on the split path (power of two).
    steps_per_iter (mse_search): grid steps evaluated together, a power of two
        <= 32 (None: 1 on a GPU, where registers are the limit; 32 under the
        interpreter, whose cost is per operation, not per element).
    gpu_arith (mse_search): use the GPU's hardware conversions (None: on a
        CUDA tensor outside the interpreter; True lets a compile check build
        that variant from CPU tensors, it cannot run in the interpreter).
    """

    tile: int = 4096
    split: int | None = None
    min_elems_per_program: int = 1 << 15
    max_reg_group: int = 4096
    chunk: int = 2048
    steps_per_iter: int | None = None
    fill_programs: int = 4 * 132
    gpu_arith: bool | None = None


_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("launch_config", default={})

# The launch configuration a GPU runs: one grid step per iteration of the
# search loop (the interpreter's default is 32). Splits need no pinning: they
# follow the work, the same on every device.
CUDA_LAUNCH = {"steps_per_iter": 1}


@contextlib.contextmanager
def launch_config(**fields):
    """Within this block every launcher runs with ``fields`` (LaunchConfig
    field names) replacing its module defaults, e.g.
    ``with launch_config(**CUDA_LAUNCH): ...`` runs the GPU's configuration
    under the interpreter. Unknown field names are a TypeError."""
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"launch_config: unknown LaunchConfig fields {unknown}")
    token = _OVERRIDES.set({**_OVERRIDES.get(), **fields})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def current_config(default: LaunchConfig) -> LaunchConfig:
    """A launcher's configuration for this call: its module default with the
    fields of the enclosing ``launch_config`` blocks applied."""
    fields = _OVERRIDES.get()
    return dataclasses.replace(default, **fields) if fields else default


def _device_context(device: torch.device):
    """The context a launch runs in: the tensor's CUDA device (Triton launches
    on the current device and its current stream), nothing on the CPU."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def on_device(value: torch.Tensor):
    """Context for launching kernels on ``value``'s device: the launch runs
    with ``value.device`` current, whatever device the caller had current.
    (That every tensor of the call is on that device was checked with the
    call, in obskernels.spec.calls.)"""
    return _device_context(value.device)


def check_kernel_dtype(value: torch.Tensor, name: str = "value") -> None:
    """KernelUnsupportedError for a float64 value: valid input (the reference
    computes it, as llm-compressor does) that the kernels do not cover."""
    if value.dtype == torch.float64:
        # a constant message: the "auto" fallback logs it once per operation
        raise KernelUnsupportedError(
            f"{name} dtype float64 (the triton kernels cover float32, float16 and "
            "bfloat16; the reference backend computes float64)"
        )


def check_launchable(value: torch.Tensor, op: str) -> None:
    """An empty value has nothing to launch (nor a layout to describe): the
    front (obskernels.ops) computes it with the reference on every backend;
    called here directly it is a KernelUnsupportedError."""
    if value.numel() == 0:
        raise KernelUnsupportedError(
            f"{op}: an empty value (shape {tuple(value.shape)}) has nothing to launch; "
            "obskernels.ops computes it with the reference"
        )


def pow2_at_most(n: int, cap: int) -> int:
    """The smallest power of two >= n, capped at ``cap`` (a power of two)."""
    return min(triton.next_power_of_2(max(int(n), 1)), cap)


def choose_blocks(
    sizes: tuple[int, int, int], strides: tuple[int, int, int], tile: int
) -> tuple[int, int, int]:
    """Power-of-two block sizes for the (Q, R, E) axes within ``tile`` elements.

    Axes are widened in order of increasing memory stride (ties: E, then Q,
    then R), so a tile's lanes run along contiguous memory first.
    """
    order = sorted(range(3), key=lambda a: (strides[a], (2, 0, 1).index(a)))
    blocks = [1, 1, 1]
    budget = tile
    for a in order:
        blocks[a] = pow2_at_most(sizes[a], budget)
        budget //= blocks[a]
    return tuple(blocks)


def num_warps_for(tile_elems: int) -> int:
    """Warps for a tile: about 16 lanes per thread at most (fp32 accumulators
    and int64 offsets per lane stay in registers)."""
    return 8 if tile_elems >= 2048 else 4


def choose_split(work_rows: int, row_block: int, work_per_row: int, other_programs: int,
                 device: torch.device, config: LaunchConfig) -> tuple[int, int]:
    """(split, rows_per_split): how many programs share the rows of one group
    tile (1: no split), and the rows each takes, a multiple of ``row_block``.

    Enough programs to reach ``config.fill_programs`` next to
    ``other_programs``, but no program with less than
    ``config.min_elems_per_program`` of work; the split is recounted so no
    program is left without rows. Every launcher puts the split on grid axis
    1, which CUDA caps at 65535 programs. The split follows the work only
    (``device`` is accepted for callers but not read): the same call splits
    the same way on every GPU and under the interpreter, so the interpreter
    tests run the split and finish kernels a GPU runs.
    """
    row_tiles = -(-work_rows // row_block)
    if config.split is not None:
        split = max(1, min(config.split, row_tiles))
    else:
        want = -(-config.fill_programs // max(other_programs, 1))
        worth = max(1, (work_rows * work_per_row) // config.min_elems_per_program)
        split = max(1, min(row_tiles, want, worth))
    split = min(split, _MAX_GRID_1)
    per_split = triton.cdiv(triton.cdiv(work_rows, split), row_block) * row_block
    return triton.cdiv(work_rows, per_split), per_split


def finish_blocks(n: int, split: int, config: LaunchConfig) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_S) of a finish pass that reduces ``split`` partials of
    ``n`` outputs: up to 256 outputs per program, the partials in tile-sized steps."""
    block_n = pow2_at_most(n, 256)
    return block_n, pow2_at_most(split, max(config.tile // block_n, 1))


@triton.jit
def group_coords(q, QB):
    """(qa, qb) of group q = qa * QB + qb (int32 lanes; callers widen to int64)."""
    qa = q // QB
    return qa, q - qa * QB


@triton.jit
def group_base(q, geo):
    """(qa, qb, offset): group q's coordinates and the int64 storage offset of
    its first element, qa*sqa + qb*sqb (``geo``: a ``Geometry``)."""
    qa, qb = group_coords(q, geo.QB)
    return qa, qb, qa.to(tl.int64) * geo.sqa + qb.to(tl.int64) * geo.sqb


@triton.jit
def row_offsets(r, R1, R2, sr0, sr1, sr2):
    """int64 storage offset of flat row r = (r0 * R1 + r1) * R2 + r2."""
    inner = R1 * R2
    r0 = r // inner
    rr = r - r0 * inner
    r1 = rr // R2
    r2 = rr - r1 * R2
    return r0.to(tl.int64) * sr0 + r1.to(tl.int64) * sr1 + r2.to(tl.int64) * sr2


@triton.jit
def layout_rows(r, geo):
    """``row_offsets`` of a layout's rows (``geo``: a ``Geometry``)."""
    return row_offsets(r, geo.R1, geo.R2, geo.sr0, geo.sr1, geo.sr2)


@triton.jit
def load_tile(x_ptr, perm_ptr, base, qa, qb, r, e, in_group, geo, NR, lim_r, lim_e,
              PAD: tl.constexpr, GATHER: tl.constexpr):
    """One tile of the flattened value, in the value's dtype.

    base: int64 offset of each (group, row) pair, ``group_base`` + ``layout_rows``;
    qa, qb, r, e: broadcastable int32 index tensors of the tile's axes;
    in_group: which lanes are elements of the flattened value; geo, NR,
    lim_r, lim_e: the layout (``GroupLayout.kernel_args``).
    Lanes outside in_group read 0; so do padding lanes of a partial block
    (PAD), which ARE group elements: docs/spec.md §2 pads with zeros before reducing.
    """
    if GATHER:
        col = tl.load(perm_ptr + (qb * geo.E + e), mask=in_group, other=0)
        offs = base + col.to(tl.int64) * geo.se
    else:
        offs = base + e.to(tl.int64) * geo.se
    inside = in_group
    if PAD:
        inside = inside & (qa.to(tl.int64) * NR + r < lim_r) & (qb.to(tl.int64) * geo.E + e < lim_e)
    return tl.load(x_ptr + offs, mask=inside, other=0.0)


@triton.jit
def load_flat(x_ptr, perm_ptr, q, k, in_group, geo, NR, lim_r, lim_e,
              PAD: tl.constexpr, GATHER: tl.constexpr):
    """Element k = r * E + e of group q, i.e. flat[q, r, e], through load_tile.

    q, k: broadcastable index tensors (int32, or int64 where k can pass 2^31);
    in_group: which lanes are elements of the flattened value. geo, NR,
    lim_r, lim_e: the layout (``GroupLayout.kernel_args``, Q left out). In an
    ordered layout k is the element's position in the reference's flattened
    group, so a kernel can walk a group as one run of k whatever its row
    levels. Returns (x, col), col = qb * E + e the element's column
    coordinate (a weight's input column for CHANNEL and GROUP layouts).
    """
    qa, qb, gbase = group_base(q, geo)
    r = k // geo.E
    e = k - r * geo.E
    base = gbase + layout_rows(r, geo)
    x = load_tile(x_ptr, perm_ptr, base, qa, qb, r, e, in_group, geo, NR, lim_r, lim_e, PAD, GATHER)
    return x, qb * geo.E + e


# The interpreter converts bf16 <-> fp32 with its own bit routine, which
# mis-normalises subnormals (|x| < 2^-126): bf16 1e-39 loads as 5.9e-39. A
# bf16 pattern is the top half of the fp32 pattern of the same value, so a
# 16-bit shift is exact everywhere (one integer op on a GPU, as cheap as the
# cast). fp16 <-> fp32 casts are exact on both.
@triton.jit
def widen(x):
    """``x`` (fp32, fp16 or bf16) as fp32, exactly, subnormals included."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def store_exact(ptr, x, mask):
    """Store fp32 ``x`` into ``ptr``'s dtype. ``x`` must be exactly
    representable there (or NaN): bf16 keeps the top 16 bits, so a value that
    needs rounding would be truncated (round first, e.g. ``quant.round_bf16``)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # any NaN stays a NaN (a payload only in the low half would not)
        bits = tl.where(x != x, 0x7FC00000, bits)
        tl.store(ptr, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
