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
#: half the tile of the single-pass kernels (see ``search_warps``); the
#: streaming kernels take 16 elements per thread and step (``STREAM_WARPS``).
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
# the streaming kernels (min_max, flatten): 4-D tiles over (qa, qb, r, e)
# --------------------------------------------------------------------------- #
#: warps of the streaming kernels: a 2048-element tile (their ``tile``) is 16
#: elements (2 to 4 16-byte loads) per thread and step, enough loads in flight
#: per SM at the occupancy their registers allow (8 warps per step cost more
#: per element: the once-per-program reduction and stores span more threads)
STREAM_WARPS = 4
#: their register ceiling (ptxas ``.maxnreg``): without one, ptxas may trade
#: a spill for occupancy at a threshold (triton 3.6's ptxas kept 48 registers
#: and 8 bytes of stack for an fp16 channel tile that needs ~60)
STREAM_MAXNREG = 128
#: lanes of one group in a step, in 16-byte vectors: a group that is one row
#: (weights) is walked in chunks this wide, so each thread keeps a few running
#: lanes per group and the reduction across lanes runs on few of them; a
#: group with rows keeps one warp's width (32 vectors) and walks its rows
GROUP_CHUNK_VECTORS = 2
ROW_CHUNK_VECTORS = 32
#: gathered (g_idx) columns: lanes per thread and step
GATHER_LANES = 4
#: a block that is one step holds no running lanes across steps: its tile is
#: this many times the op's ``tile`` (fewer steps for the same groups)
GROUP_LOOP_TILE = 2
#: programs of a launch that loops over blocks of groups, per fill_programs:
#: 2 x 528 stay resident at once on an H100 (one wave)
GROUP_LOOP_PROGRAMS = 2


@dataclasses.dataclass(frozen=True)
class StreamTile:
    """How a streaming kernel walks a layout: per step a [a, b, r, e] tile
    of (qa, qb, r, e) lanes; ``programs`` blocks of groups on grid axis 0,
    ``split`` row ranges of ``rows_per_split`` on axis 1; ``row_levels`` of
    the layout in use (0: one row); ``short_e``: one element chunk wider
    than the group; ``row_tail``: the rows end inside a row block;
    ``group_tail``: the groups end inside a block; ``group_loop``: a
    program loops over blocks of groups (``kernels._layout.tile_blocks``)."""

    a: int
    b: int
    r: int
    e: int
    row_levels: int
    short_e: bool
    row_tail: bool
    group_tail: bool
    group_loop: bool
    programs: int
    split: int
    rows_per_split: int
    warps: int = STREAM_WARPS

    def launch(self) -> dict:
        """The launch options: warps and the register ceiling."""
        return dict(num_warps=self.warps, maxnreg=STREAM_MAXNREG)

    def blocks(self) -> dict:
        """The kernels' constexpr arguments for this tile."""
        return dict(BLOCK_A=self.a, BLOCK_B=self.b, BLOCK_R=self.r, BLOCK_E=self.e,
                    ROW_LEVELS=self.row_levels, SHORT_E=self.short_e, ROW_TAIL=self.row_tail,
                    GROUP_TAIL=self.group_tail, GROUP_LOOP=self.group_loop)


def _fit(n: int, cap: int) -> int:
    """The widest power-of-two block <= cap over n lanes that wastes at most
    an eighth of the blocks' lanes past n (lanes past the end repeat work)."""
    b = pow2_at_most(n, cap)
    while b > 1 and -(-n // b) * b * 8 > n * 9:
        b //= 2
    return b


def _e_block(E: int, cap: int, vec: int) -> int:
    """The element chunk: the widest power of two <= cap that divides E and
    spans a 32-byte sector at least (every chunk full: no element read
    twice); else one chunk over a group that fits (its lanes past E repeat
    element E - 1), or the widest chunk that wastes at most an eighth (the
    last chunk, shifted back, overlaps the one before)."""
    b = pow2_at_most(E, cap)
    while b >= 2 * vec:
        if E % b == 0:
            return b
        b //= 2
    return pow2_at_most(E, cap) if E <= cap else _fit(E, cap)


def stream_tile(layout, itemsize: int, config: LaunchConfig, e_vectors: int,
                widen_e: bool = True, group_loops: bool = False) -> StreamTile:
    """The tile of a streaming kernel over ``layout`` (a ``GroupLayout``).

    Axes are widened in order of increasing memory stride (ties: e, qb, qa,
    r), so a step's lanes run along contiguous memory first: e to at most
    ``e_vectors`` 16-byte vectors (0: one lane), the group axes to at most
    as many groups as leave 3/4 of ``config.fill_programs`` programs (or
    give a program ``config.min_elems_per_program``), r with the
    rest. Budget left (few groups, short rows) widens e (``widen_e``, for a
    group longer than the chunk), then r. ``group_loops``: where a block of
    groups is one step, a program loops over blocks (at most
    GROUP_LOOP_PROGRAMS x fill_programs programs), so what it issues once
    (its prologue) is shared by many. Rows are split over programs
    only when the groups alone do not fill the GPU (``choose_split``).
    """
    (QA, QB), NR, E = layout.groups, layout.num_rows, layout.elems
    big = 1 << 62
    sqa, sqb = layout.group_strides
    row_stride = next((s for n, s in zip(layout.rows[::-1], layout.row_strides[::-1]) if n > 1), big)
    if layout.gather:  # a row's groups together cover the row: read it whole
        sqb = E * layout.elem_stride
    strides = (abs(sqa) if QA > 1 else big, abs(sqb) if QB > 1 else big,
               abs(row_stride), abs(layout.elem_stride) if E > 1 else big)
    sizes = (QA, QB, NR, E)
    vec = max(16 // itemsize, 1)
    e_cap = max(e_vectors * vec, 1)
    one_step = group_loops and NR == 1 and E <= e_cap  # programs loop over blocks: no cap
    groups_cap = config.tile if one_step else 1
    while groups_cap * 2 * config.fill_programs * 3 <= QA * QB * 4:  # >= 3/4 of the fill
        groups_cap *= 2
    # but no program below min_elems_per_program: a small value takes few programs
    groups_cap = max(groups_cap, pow2_at_most(config.min_elems_per_program // max(E * NR, 1), 1 << 30))
    # a block that is one step keeps no running lanes: twice the lanes per step
    blocks, budget = [1, 1, 1, 1], config.tile * (GROUP_LOOP_TILE if one_step else 1)
    for a in sorted(range(4), key=lambda a: (strides[a], (3, 1, 0, 2).index(a))):
        cap = budget
        if a == 3:
            blocks[a] = _e_block(E, min(cap, e_cap), vec)
        else:
            if a < 2:
                cap = min(cap, groups_cap)
            blocks[a] = _fit(sizes[a], cap)
            if a < 2:
                groups_cap //= blocks[a]
        budget //= blocks[a]
    # e past its chunk only for a group longer than the chunk (a group of one
    # short row keeps its chunk: the tile stays smaller instead)
    for a in (3, 2) if widen_e and E > e_cap else (2,):
        # e stays a divisor of E where it is one (no overlapping last chunk)
        while budget > 1 and blocks[a] < sizes[a] and (a == 2 or E % blocks[a] or not E % (2 * blocks[a])):
            blocks[a], budget = blocks[a] * 2, budget // 2
    BA, BB, BR, BE = blocks
    programs = -(-QA // BA) * -(-QB // BB)
    split, rows_per_split = choose_split(NR, BR, BA * BB * E, programs, config)
    levels = layout.row_levels if NR > 1 else 0  # 0: one row, no row arithmetic at all
    # a block that is one step (one row, one chunk): programs loop over blocks
    group_loop = one_step and E <= BE
    if group_loop:  # a multiple of the block columns (``_layout.tile_blocks``)
        n_b = -(-QB // BB)
        programs = n_b * min(-(-QA // BA), max(1, GROUP_LOOP_PROGRAMS * config.fill_programs // n_b))
    return StreamTile(BA, BB, BR, BE, levels, E < BE, NR % BR != 0, QA % BA != 0 or QB % BB != 0,
                      group_loop, programs, split, rows_per_split)


def min_max_tile(layout, itemsize: int, config: LaunchConfig) -> StreamTile:
    """min_max's tile: a group that is one row in chunks of
    GROUP_CHUNK_VECTORS (its reduction across lanes is per group, so the
    running lanes per group are kept few), a group with rows a warp wide."""
    if layout.gather:
        # gathered columns: one lane per group and step, so a thread owns its
        # groups (no reduction across lanes) and reads a row's groups side by
        # side; at most GATHER_LANES per thread (each lane is a load)
        config = dataclasses.replace(config, tile=min(config.tile, 32 * STREAM_WARPS * GATHER_LANES))
        return stream_tile(layout, itemsize, config, 0, widen_e=False, group_loops=True)
    one_row = layout.num_rows == 1
    return stream_tile(layout, itemsize, config,
                       GROUP_CHUNK_VECTORS if one_row else ROW_CHUNK_VECTORS, group_loops=True)


def flatten_tile(layout, itemsize: int, config: LaunchConfig) -> StreamTile:
    """flatten's tile: a copy, no reduction, rows a warp wide."""
    return stream_tile(layout, itemsize, config, ROW_CHUNK_VECTORS, group_loops=True)


# --------------------------------------------------------------------------- #
# per operation
# --------------------------------------------------------------------------- #


#: accumulate_sq: plain steps a lane sums before a compensated add (a plain
#: chain of n positive fp32 terms is within n * 2^-24 relative: 64 keeps it
#: at 3.8e-6, under the 1e-5 of docs/spec.md with the tree and the finish)
ACCUMULATE_ROUND = 64


@dataclasses.dataclass(frozen=True)
class AccumulateTile:
    """accumulate_sq's launch: a [t, h] tile of (token, channel) lanes per
    step, ``programs`` channel blocks on grid axis 0, ``split`` token ranges
    of ``tokens_per_split`` on axis 1."""

    t: int
    h: int
    programs: int
    split: int
    tokens_per_split: int
    warps: int = STREAM_WARPS

    def launch(self) -> dict:
        """The launch options: warps and the register ceiling."""
        return dict(num_warps=self.warps, maxnreg=STREAM_MAXNREG)


def accumulate_tile(H: int, channel_stride: int, NT: int, token_stride: int, itemsize: int,
                    config: LaunchConfig) -> AccumulateTile:
    """The contiguous axis (channels, else tokens) a warp's width of 16-byte
    vectors wide, the other axis filling the tile; token ranges split over
    programs when the channel blocks alone do not fill the GPU."""
    lanes = 32 * max(16 // itemsize, 1)
    if channel_stride <= token_stride:
        BH = pow2_at_most(H, min(config.tile, lanes))
        BT = pow2_at_most(NT, config.tile // BH)
    else:
        BT = pow2_at_most(NT, min(config.tile, lanes))
        BH = pow2_at_most(H, config.tile // BT)
    programs = -(-H // BH)
    split, per = choose_split(NT, BT, BH, programs, config)
    return AccumulateTile(BT, BH, programs, split, per)


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
