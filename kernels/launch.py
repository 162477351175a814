"""Launch policy: every tuning choice of the launchers, as data in one place.

A launcher asks this module how to launch (block shapes, warps, how many
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
    "finish_blocks",
    "min_max_warps",
    "search_warps",
    "combine_block",
    "MAX_GRID_1",
    "SPLIT_W_ROWS",
    "split_blocks",
    "minmax_part_warps",
    "MAX_SPLIT_STEPS",
    "CHOOSE_BLOCK",
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
#: half the tile of the single-pass kernels (see ``search_warps``).
DEFAULTS = MappingProxyType({
    **{op: LaunchConfig()
       for op in ("min_max", "flatten", "accumulate_sq", "calculate_qparams",
                  "combine_statistics", "importance")},
    "mse_search": LaunchConfig(tile=2048),
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
    under the interpreter, so the interpreter tests run the split and finish
    kernels a GPU runs.
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


def finish_blocks(n: int, split: int, config: LaunchConfig) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_S) of a finish pass that reduces ``split`` partials of
    ``n`` outputs: up to 256 outputs per program, the partials in tile-sized steps."""
    block_n = pow2_at_most(n, 256)
    return block_n, pow2_at_most(split, max(config.tile // block_n, 1))


# --------------------------------------------------------------------------- #
# per operation
# --------------------------------------------------------------------------- #
def min_max_warps(tile_elems: int, record: bool = False) -> int:
    """Warps of the min/max kernel: 8 elements per thread at most. Each lane
    keeps a running min, max and NaN flag plus int64 offsets (and, padded, the
    block bounds): at 16 per thread (8 warps for 4096) sm_90a needs 200-237
    registers for padded and 3-D tiles, one block per SM; at 8 it needs
    <= 122 and the SASS per element does not grow. With the non-finite record
    (``record``) at least 8: at 4 warps on a small tile sm_90a keeps a 64-bit
    pointer of the rarely taken counting branch on the stack (8 bytes)."""
    return max(8 if record else 4, min(16, tile_elems // 256))


def search_warps(tile_elems: int, elem_size: int, fast: bool) -> int:
    """Warps of the search's register path for a tile of ``tile_elems``
    values of ``elem_size`` bytes: 16 elements per thread with the GPU
    arithmetic (``fast``) on 16-bit values, 8 otherwise (fp32 values, whose
    division is correctly rounded per element, and the exact emulation need
    more registers per element), at most 16 warps. With the search's default
    tile (2048) the register path runs 4-warp blocks on bf16 / fp16 (sm_90a,
    int4 group 128, triton 3.9 and 3.6: 64-72 registers, >= 28 warps per SM,
    40.4-40.8 SASS per element and step at norm 2.4; 8 warps of 4096 took 64
    registers and 4 bytes of stack in the asymmetric variant under 3.9's
    register allocation) and 8-warp blocks on fp32 (54-64 registers where
    16 elements per thread took 80-117 or spilled)."""
    per_thread = 16 if fast and elem_size <= 2 else 8
    return max(4, min(16, tile_elems // (32 * per_thread)))


def combine_block(groups: int) -> int:
    """Groups per program of combine_statistics' kernel: 16 to 1024."""
    return max(pow2_at_most(groups, 1024), 16)


def split_blocks(config: LaunchConfig, elem_size: int, fast: bool, pad: bool,
                 importance: bool) -> tuple[int, int]:
    """(chunk, warps) of the search's split path: elements a program loads
    and holds through every step at once, and its warps. As the register
    path (``search_warps``) on ``config.chunk`` elements, except: a padded
    layout and the rows sharing importance (``SPLIT_W_ROWS``) take half the
    chunk, 8 elements per thread (sm_90a, triton 3.9 / 3.6: 16 per thread
    took 118 / 96 registers padded, 127 / 126 with importance; 8 take
    56-80)."""
    per_thread = 16 if fast and elem_size <= 2 else 8
    chunk = config.chunk
    if importance or pad:
        chunk, per_thread = max(chunk // 2, 1), 8
    # a chunk smaller than 32 lanes' share takes one warp: more threads than
    # elements left layout conversions in the step loop
    return chunk, max(1, min(16, chunk // (32 * per_thread)))


def minmax_part_warps(chunk: int) -> int:
    """Warps of the split path's min/max: 8 elements per thread (each lane
    keeps a running min, max and NaN flag besides its int64 offsets; sm_90a:
    16 per thread took up to 129 registers)."""
    return max(1, min(16, chunk // 256))


#: the search's split path with importance: rows of one column block per
#: program, sharing each chunk's importance load (sm_90a: 16 and 8 rows left
#: 8-40 bytes of stack under triton 3.9 or 3.6; 4 none)
SPLIT_W_ROWS = 4
#: the split path keeps at most this many step errors per program
MAX_SPLIT_STEPS = 1024
#: the search's choose kernel: groups per iteration of its 4 warps (sm_90a:
#: 1024 took 93-98 registers, 512 keeps it near 60)
CHOOSE_BLOCK = 512
#: calculate_qparams: groups per program, partial maxima per fused pair
QPARAMS_BLOCK = 1024
QPARAMS_MAX_PARTS = 64
#: importance: columns per iteration of its one program
IMPORTANCE_BLOCK = 1024
