"""Launch policy of the streaming kernels: the tiles of min_max and flatten
(4-D tiles over (qa, qb, r, e) of a group layout) and of accumulate_sq
(token x channel), with their warps and register ceiling."""

from __future__ import annotations

import dataclasses

from obskernels.kernels.launch import LaunchConfig, choose_split, pow2_at_most

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
#: a group of one row at most this many vectors wide is read whole in a
#: step, so a block of groups is one step and a program loops over blocks:
#: what a program issues once (its prologue) is shared by many blocks
ONE_STEP_GROUP_VECTORS = 4
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


def min_max_tile(layout, itemsize: int, config: LaunchConfig, qparams: bool = False) -> StreamTile:
    """min_max's tile: a group that is one row in chunks of
    GROUP_CHUNK_VECTORS (its reduction across lanes is per group, so the
    running lanes per group are kept few), or whole in one step where it is
    at most ONE_STEP_GROUP_VECTORS wide; a group with rows a warp wide.
    ``qparams``: the launch may compute the qparams in its epilogue, which
    keeps the chunks (an epilogue in a loop over blocks of groups holds more
    registers for no fewer instructions)."""
    if layout.gather:
        # gathered columns: one lane per group and step, so a thread owns its
        # groups (no reduction across lanes) and reads a row's groups side by
        # side; at most GATHER_LANES per thread (each lane is a load)
        config = dataclasses.replace(config, tile=min(config.tile, 32 * STREAM_WARPS * GATHER_LANES))
        return stream_tile(layout, itemsize, config, 0, widen_e=False, group_loops=True)
    one_row = layout.num_rows == 1
    vectors = GROUP_CHUNK_VECTORS if one_row else ROW_CHUNK_VECTORS
    if one_row and not qparams and layout.elems * itemsize <= ONE_STEP_GROUP_VECTORS * 16:
        vectors = ONE_STEP_GROUP_VECTORS
    return stream_tile(layout, itemsize, config, vectors, group_loops=True)


def flatten_tile(layout, itemsize: int, config: LaunchConfig) -> StreamTile:
    """flatten's tile: a copy, no reduction, rows a warp wide."""
    return stream_tile(layout, itemsize, config, ROW_CHUNK_VECTORS, group_loops=True)


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
