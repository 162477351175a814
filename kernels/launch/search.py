"""Launch policy of the MSE search: the warps of its register path, the
chunk and warps of its split path, and the fixed blocks of its kernels."""

from __future__ import annotations

from obskernels.kernels.launch import LaunchConfig


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
#: ... and their register ceiling (ptxas ``.maxnreg``): 64 registers, 32
#: warps per SM; without one, triton 3.6's ptxas spilled 8 bytes of stack
#: around the step loop to reach 36 warps with 56 (importance normalised as
#: loaded, int8 channel over 16,384 columns)
SPLIT_W_MAXNREG = 64
#: the split path keeps at most this many step errors per program
MAX_SPLIT_STEPS = 1024
#: the search's choose kernel: groups per iteration of its 4 warps (sm_90a:
#: 1024 took 93-98 registers, 512 keeps it near 60)
CHOOSE_BLOCK = 512
#: ... and at most this many programs, a block of groups each where there
#: are that few blocks. Each program ORs every search program's words first
#: (P x n_words int32 from L2: 32 KB for a 4096x4096 weight in groups of 128
#: and 20 steps, 16 MB for all 512 programs), then walks its blocks one after
#: another: 4 programs walking 64 blocks each of that weight's 131,072 groups
#: took 118 us on an H200, a fifth of the search. 512 programs of 4 warps at
#: ~60 registers are resident at once on 132 SMs (8 per SM).
CHOOSE_PROGRAMS = 512
