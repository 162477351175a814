"""Group layouts on the device, and the launchers' device context.

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
The streaming kernels (min_max, flatten) take their work as 4-D tiles
[BLOCK_A, BLOCK_B, BLOCK_R, BLOCK_E] over (qa, qb, r, e) instead:
``tile_blocks`` / ``tile_groups`` give a program its blocks of groups
without a division per lane or block, ``tile_rows`` a row's offset with only the row levels the layout uses,
``tile_offsets`` the element offsets and ``pad_inside`` the padding mask.
``widen`` and ``store_exact`` move values between the value's dtype and fp32
exactly on both a GPU and the interpreter (bf16 through its bits); every
kernel that loads or stores values in the value's dtype goes through them.
Every launcher (min_max, flatten, mse_search, combine_statistics) derives
its layout from the call's checked ``Flattening`` with ``group_layout``;
how it launches (blocks, warps, splits) is ``kernels/launch/``'s policy.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from obskernels.spec.errors import KernelUnsupportedError
from obskernels.spec.layout import Geometry, GroupLayout, coalesce, group_layout
from obskernels.spec.record import current_cuda_device

__all__ = [
    "Geometry",
    "GroupLayout",
    "on_device",
    "launch_context",
    "allocator",
    "check_kernel_dtype",
    "check_launchable",
    "group_layout",
    "coalesce",
    "group_coords",
    "group_base",
    "row_offsets",
    "layout_rows",
    "load_tile",
    "load_flat",
    "tile_blocks",
    "tile_groups",
    "tile_rows",
    "tile_lanes",
    "tile_offsets",
    "pad_inside",
    "load_tile_lanes",
    "widen",
    "store_exact",
    "INTERPRETED",
    "gpu_arith",
]


_NOTHING = contextlib.nullcontext()  # reusable: it holds no state


def _device_context(device: torch.device):
    """The context a launch runs in: the tensor's CUDA device (Triton launches
    on the current device and its current stream), nothing on the CPU."""
    if device.type == "cuda":
        return _cuda_context(_cuda_index(device))
    return _NOTHING


def _cuda_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_context(index: int):
    """Nothing where CUDA device ``index`` is already current (the common
    case: a ``torch.cuda.device`` block costs a device exchange on entry and
    on exit, each launch), else a ``torch.cuda.device`` block making it so."""
    if current_cuda_device() == index:
        return _NOTHING
    return torch.cuda.device(index)


def _no_context():
    return _NOTHING


def launch_context(device: torch.device):
    """``on_device`` prepared once for a launch's device: a function of no
    argument returning the context each launch runs in (on CUDA a
    ``torch.cuda.device`` block where the device is not current, which
    restores the device it replaces; the shared no-op context otherwise),
    without reading a tensor's device per call."""
    if device.type == "cuda":
        return functools.partial(_cuda_context, _cuda_index(device))
    return _no_context


def on_device(value: torch.Tensor):
    """Context for launching kernels on ``value``'s device: the launch runs
    with ``value.device`` current, whatever device the caller had current.
    (That every tensor of the call is on that device was checked with the
    call, in obskernels.spec.calls.)"""
    return _device_context(value.device)


def allocator(shape, dtype: torch.dtype, device: torch.device):
    """A function of no argument returning a new uninitialised contiguous
    tensor of ``shape``, ``dtype`` on ``device``: a launcher's output made
    once per call. It is ``torch.empty_like`` of a one-element tensor
    expanded to ``shape`` (made here, once per prepared launch), which skips
    the parsing of shape, dtype and device that ``torch.empty`` repeats at
    every call (about half its host time). Where that prototype would not
    give torch.empty's strides (checked here, once; a dimension of size one
    among them), a small output's prototype is a tensor of ``shape`` itself,
    a large one's is ``torch.empty``."""
    shape = tuple(shape)
    strides = torch.empty(shape, dtype=dtype, device="meta").stride()
    proto = torch.empty((), dtype=dtype, device=device).expand(shape)
    if not _like(proto, shape, strides):
        proto = None
        if math.prod(shape) <= _SMALL_PROTO:
            proto = torch.empty(shape, dtype=dtype, device=device)
            proto = proto if _like(proto, shape, strides) else None
    if proto is not None:
        return functools.partial(torch.empty_like, proto)
    return functools.partial(torch.empty, shape, dtype=dtype, device=device)


#: the most elements of a prototype that ``allocator`` keeps as a tensor
_SMALL_PROTO = 4096


def _like(proto: torch.Tensor, shape, strides) -> bool:
    """Whether ``torch.empty_like(proto)`` is torch.empty's tensor of ``shape``."""
    made = torch.empty_like(proto)
    return made.shape == shape and made.is_contiguous() and made.stride() == strides


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


@triton.jit
def tile_blocks(Q, geo, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's blocks of BLOCK_A x BLOCK_B groups (qa, qb).

    The grid (axis 0) holds a multiple of n_b = cdiv(QB, BLOCK_B) programs:
    program p takes block column pb = p % n_b and block rows pa, pa + step,
    ... below n_a (pa = p // n_b, step = programs / n_b), so a program that
    loops over blocks needs no division per block. Returns (pa, pb, step,
    n_a, QA)."""
    n_b = tl.cdiv(geo.QB, BLOCK_B)
    pid = tl.program_id(0)
    QA = Q // geo.QB
    return pid // n_b, pid % n_b, tl.num_programs(0) // n_b, tl.cdiv(QA, BLOCK_A), QA


@triton.jit
def tile_groups(pa, pb, QA, geo, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                GROUP_TAIL: tl.constexpr):
    """Block (pa, pb)'s groups (``tile_blocks``).

    Returns (qa, qb, ok): [BLOCK_A, BLOCK_B, 1, 1] int32 lanes inside the
    layout and ``ok``, which lanes are groups of their own. GROUP_TAIL (the
    blocks do not divide QA x QB): lanes past the last group are clamped to
    it, so they read that group again and loads need no mask; without a tail
    the lanes stay a plain range (contiguous groups then vectorise)."""
    qa = pa * BLOCK_A + tl.arange(0, BLOCK_A)[:, None, None, None]
    qb = pb * BLOCK_B + tl.arange(0, BLOCK_B)[None, :, None, None]
    ok = (qa < QA) & (qb < geo.QB)
    if GROUP_TAIL:
        return tl.minimum(qa, QA - 1), tl.minimum(qb, geo.QB - 1), ok
    else:
        return qa, qb, ok


@triton.jit
def tile_rows(r, geo, ROW_LEVELS: tl.constexpr):
    """int64 storage offset of flat rows ``r`` when only the inner
    ROW_LEVELS of the three row levels are used (``GroupLayout.row_levels``;
    0 for a layout of one row): no division for one level, one for two."""
    if ROW_LEVELS == 0:  # a layout of one row
        return r.to(tl.int64) * 0
    elif ROW_LEVELS == 1:
        return r.to(tl.int64) * geo.sr2
    elif ROW_LEVELS == 2:
        r1 = r // geo.R2
        return r1.to(tl.int64) * geo.sr1 + (r - r1 * geo.R2).to(tl.int64) * geo.sr2
    else:
        return row_offsets(r, geo.R1, geo.R2, geo.sr0, geo.sr1, geo.sr2)


@triton.jit
def tile_lanes(r0, c, r_hi, E, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
               SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr):
    """(r, e) lanes of rows [r0, r0 + BLOCK_R) x element chunk c of a tile,
    every lane inside the layout: the last chunk is shifted back to end at E
    (overlapping the one before), a chunk wider than E (SHORT_E) repeats
    element E - 1, and rows past r_hi (ROW_TAIL: r_hi is not a multiple of
    BLOCK_R) repeat row r_hi - 1. A repeat reads an element of the same group
    again, so a min / max or a copy needs no mask; without a tail r0 is a
    multiple of BLOCK_R, which lets rows that are contiguous vectorise."""
    lane_e = tl.arange(0, BLOCK_E)[None, None, None, :]
    if SHORT_E:
        e = tl.minimum(lane_e, E - 1)
    else:
        e = tl.minimum(c * BLOCK_E, E - BLOCK_E) + lane_e
    lane_r = tl.arange(0, BLOCK_R)[None, None, :, None]
    if ROW_TAIL:
        r = tl.minimum(r0 + lane_r, r_hi - 1)
    else:
        r = tl.multiple_of(r0 + lane_r, [1, 1, BLOCK_R, 1])
    return r, e


@triton.jit
def tile_offsets(perm_ptr, qa, qb, r, e, geo, ROW_LEVELS: tl.constexpr, GATHER: tl.constexpr):
    """int64 storage offsets of elements (qa, qb, r, e) (broadcastable int32
    lanes, all inside the layout); under GATHER the column comes from perm."""
    offs = qa.to(tl.int64) * geo.sqa + tile_rows(r, geo, ROW_LEVELS)
    if GATHER:
        col = tl.load(perm_ptr + (qb * geo.E + e))
        return offs + col.to(tl.int64) * geo.se
    else:
        return offs + qb.to(tl.int64) * geo.sqb + e.to(tl.int64) * geo.se


@triton.jit
def pad_inside(qa, qb, r, e, geo, lim_r, lim_e):
    """Which elements of a PAD layout lie inside the value (the rest are the
    padding zeros of a partial block). A PAD layout's rows are one level of
    the block's height (R2, specialised like E), so a mask along contiguous
    rows or elements stays uniform over a vector when the limits are
    multiples of 16."""
    return (qa * geo.R2 + r < lim_r) & (qb * geo.E + e < lim_e)


@triton.jit
def load_tile_lanes(x_ptr, perm_ptr, qa, qb, r0, c, r_hi, geo, lim_r, lim_e,
                    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, ROW_LEVELS: tl.constexpr,
                    SHORT_E: tl.constexpr, ROW_TAIL: tl.constexpr, PAD: tl.constexpr,
                    GATHER: tl.constexpr):
    """(x, r, e): rows [r0, r0 + BLOCK_R) x element chunk c of the groups
    (qa, qb) as stored, every lane an element of its own group
    (``tile_lanes``); no mask but the padding zeros' (PAD)."""
    r, e = tile_lanes(r0, c, r_hi, geo.E, BLOCK_R, BLOCK_E, SHORT_E, ROW_TAIL)
    ptrs = x_ptr + tile_offsets(perm_ptr, qa, qb, r, e, geo, ROW_LEVELS, GATHER)
    if PAD:
        x = tl.load(ptrs, mask=pad_inside(qa, qb, r, e, geo, lim_r, lim_e), other=0.0)
    else:
        x = tl.load(ptrs)
    return x, r, e

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


#: Whether triton built these kernels for its interpreter (TRITON_INTERPRET=1
#: when triton decorated them): the kernels run on CPU tensors then, with the
#: interpreter's casts, never the GPU's hardware conversions.
INTERPRETED = not isinstance(widen, triton.runtime.JITFunction)


def gpu_arith(config, value: torch.Tensor, op: str) -> bool:
    """Whether a launch uses the GPU's own conversions, exact by definition
    (``quant``'s FAST): the launch configuration's ``gpu_arith``, by default
    on a CUDA tensor outside the interpreter (NVIDIA only: the GPU section of
    quant.py is PTX; a ROCm build keeps the emulation). Pinned on under the
    interpreter, whose casts are not the hardware's, it is a
    KernelUnsupportedError naming ``op``."""
    fast = config.gpu_arith
    if fast is None:
        return value.is_cuda and torch.version.hip is None and not INTERPRETED
    if fast and INTERPRETED:
        raise KernelUnsupportedError(
            f"{op}: the GPU arithmetic (gpu_arith=True) needs a GPU build; the "
            "interpreter's casts are not the hardware's"
        )
    return bool(fast)
