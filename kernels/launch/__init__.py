"""Launch policy: every tuning choice of the launchers, as data in one place.

A launcher asks this package how to launch (block shapes, warps, how many
programs share a group, the fixed block sizes of the small kernels) and
passes the answer to its kernels as arguments; nothing here is read by a
kernel, and no launcher keeps a tuning constant of its own. The choices are
fixed heuristics keyed on size, no autotuning, so a call launches the same
way on every device (the fp32 sums' order depends on the split).

``LaunchConfig`` holds the tunable fields; ``DEFAULTS`` one per operation.
``launch_config(...)`` is how a caller (a test, the compile check, the
benchmark) passes another configuration in, for the calling thread / task,
without rewriting anything global; ``current_config(op)`` is what a
launcher reads at each call. A launch prepared once for a call's signature
(a launcher's ``prepare``) keeps the choices of the configuration it was
prepared under; ``config_token()`` tells it whether that is still the one in
force (the same object while no ``launch_config`` block is entered or left).

The package is the one place of that policy: this module holds the
configuration and the generic helpers (blocks, warps, splits, the small
kernels' fixed blocks); ``stream`` the streaming kernels'
tiles (min_max, flatten, accumulate_sq), ``search`` the MSE search's warps
and blocks. Launchers import every name from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from types import MappingProxyType

__all__ = [
    "LaunchConfig",
    "DEFAULTS",
    "CUDA_LAUNCH",
    "launch_config",
    "current_config",
    "config_token",
    "cdiv",
    "pow2_at_most",
    "choose_blocks",
    "num_warps_for",
    "choose_split",
    "StreamTile",
    "stream_tile",
    "min_max_tile",
    "flatten_tile",
    "STREAM_WARPS",
    "STREAM_MAXNREG",
    "AccumulateTile",
    "accumulate_tile",
    "ACCUMULATE_ROUND",
    "search_warps",
    "combine_block",
    "MAX_GRID_1",
    "SPLIT_W_ROWS",
    "SPLIT_W_MAXNREG",
    "split_blocks",
    "minmax_part_warps",
    "MAX_SPLIT_STEPS",
    "CHOOSE_BLOCK",
    "CHOOSE_PROGRAMS",
    "FUSED",
    "UNFUSED",
    "QPARAMS_BLOCK",
    "QPARAMS_MAX_PARTS",
    "IMPORTANCE_BLOCK",
]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Host-side tuning of a launcher. Fields left None are chosen per call;
    pinning them makes a test take the same path on the CPU interpreter and
    on a GPU.

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


#: each operation's launch configuration (read-only; ``launch_config`` overrides).
#: The search holds every group of its tile in registers for all its steps:
#: half the tile of the single-pass kernels (see ``search.search_warps``); the
#: streaming kernels take 16 elements per thread and step (``stream.STREAM_WARPS``).
DEFAULTS = MappingProxyType({
    **{op: LaunchConfig() for op in ("calculate_qparams", "combine_statistics", "importance")},
    **{op: LaunchConfig(tile=2048) for op in ("mse_search", "min_max", "flatten", "accumulate_sq")},
})

# The launch configuration a GPU runs: one grid step per iteration of the
# search loop (the interpreter's default is 32). Splits need no pinning: they
# follow the work, the same on every device.
CUDA_LAUNCH = MappingProxyType({"steps_per_iter": 1})

# the innermost launch_config block of this thread / task: op (None: every op) -> fields
_OVERRIDES: contextvars.ContextVar[tuple] = contextvars.ContextVar("launch_config", default=())


@contextlib.contextmanager
def launch_config(*, ops=None, **fields):
    """Within this block the launchers of ``ops`` (names of ``DEFAULTS``;
    None: every launcher) run with ``fields`` (LaunchConfig field names)
    replacing their defaults, e.g. ``with launch_config(**CUDA_LAUNCH): ...``
    runs the GPU's configuration under the interpreter. Blocks nest, the inner
    one winning. Unknown field or operation names are a TypeError."""
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"launch_config: unknown LaunchConfig fields {unknown}")
    if isinstance(ops, str):
        ops = (ops,)
    if ops is not None:
        bad = sorted(set(ops) - set(DEFAULTS))
        if bad:
            raise TypeError(f"launch_config: unknown operations {bad}; known: {sorted(DEFAULTS)}")
        ops = frozenset(ops)
    token = _OVERRIDES.set(_OVERRIDES.get() + ((ops, fields),))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


#: () -> the ``launch_config`` blocks in force in this thread / task: the
#: same object as long as none is entered or left (``()`` outside any)
config_token = _OVERRIDES.get


def current_config(op: str) -> LaunchConfig:
    """Operation ``op``'s configuration for this call: its default with the
    fields of the enclosing ``launch_config`` blocks applied."""
    config = DEFAULTS[op]
    for ops, fields in _OVERRIDES.get():
        if ops is None or op in ops:
            config = dataclasses.replace(config, **fields)
    return config


MAX_GRID_1 = 65535  # CUDA's limit on grid axes 1 and 2


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of integers (``triton.cdiv`` without its jit wrapper:
    host arithmetic, called on every launch)."""
    return -(-a // b)


def pow2_at_most(n: int, cap: int) -> int:
    """The smallest power of two >= n, capped at ``cap`` (a power of two)."""
    return min(1 << (max(int(n), 1) - 1).bit_length(), cap)


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
                 config: LaunchConfig) -> tuple[int, int]:
    """(split, rows_per_split): how many programs share the rows of one group
    tile (1: no split), and the rows each takes, a multiple of ``row_block``.

    Enough programs to reach ``config.fill_programs`` next to
    ``other_programs``, but no program with less than
    ``config.min_elems_per_program`` of work; the split is recounted so no
    program is left without rows. Every launcher puts the split on grid axis
    1, which CUDA caps at 65535 programs. The split follows the work only,
    never the device: the same call splits the same way on every GPU and
    under the interpreter, so the interpreter tests run the split and its
    finishing a GPU runs.
    """
    row_tiles = -(-work_rows // row_block)
    if config.split is not None:
        split = max(1, min(config.split, row_tiles))
    else:
        want = -(-config.fill_programs // max(other_programs, 1))
        worth = max(1, (work_rows * work_per_row) // config.min_elems_per_program)
        split = max(1, min(row_tiles, want, worth))
    split = min(split, MAX_GRID_1)
    per_split = cdiv(cdiv(work_rows, split), row_block) * row_block
    return cdiv(work_rows, per_split), per_split


def combine_block(groups: int) -> int:
    """Groups per program of combine_statistics' kernel: 16 to 1024."""
    return max(pow2_at_most(groups, 1024), 16)


#: Triton's contraction of ``a * b + c`` into one FMA (on a GPU; the
#: interpreter never contracts), stated by every launch: triton 3.9 warns
#: where a launch leaves it to its default, and triton 3.10 turns that
#: default off, which would change the code of a launch that does not say.
#: ``UNFUSED`` where the kernel's fp32 arithmetic must round as torch's
#: separate operations do (the qparams, the search, moving averages);
#: ``FUSED`` where nothing it computes depends on it (copies, min / max, sums
#: of squares compared within a tolerance): the code triton 3.6 - 3.9 build
#: by default. docs/spec.md §6.
FUSED = MappingProxyType({"enable_fp_fusion": True})
UNFUSED = MappingProxyType({"enable_fp_fusion": False})

#: calculate_qparams: groups per program, partial maxima per fused pair
QPARAMS_BLOCK = 1024
QPARAMS_MAX_PARTS = 64
#: importance: columns per iteration of its one program
IMPORTANCE_BLOCK = 1024


# The policy of the streaming kernels and of the search, kept in modules of
# their own; they build on the definitions above, so they are imported last.
from obskernels.kernels.launch.search import (  # noqa: E402
    CHOOSE_BLOCK,
    CHOOSE_PROGRAMS,
    MAX_SPLIT_STEPS,
    SPLIT_W_MAXNREG,
    SPLIT_W_ROWS,
    minmax_part_warps,
    search_warps,
    split_blocks,
)
from obskernels.kernels.launch.stream import (  # noqa: E402
    ACCUMULATE_ROUND,
    STREAM_MAXNREG,
    STREAM_WARPS,
    AccumulateTile,
    StreamTile,
    accumulate_tile,
    flatten_tile,
    min_max_tile,
    stream_tile,
)
