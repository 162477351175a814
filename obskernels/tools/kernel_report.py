"""The kernels as an sm_90a GPU runs them, measured without a GPU.

    python -m obskernels.tools.kernel_report            # a table per compiled variant
    python -m obskernels.tools.kernel_report --json     # one JSON object per line

Every launcher is called on CPU tensors of representative shapes (docs/spec.md §2-§4:
a 4096 x 4096 weight in the formats the observers use, activations, attention)
with the launch configuration a GPU uses (``kernels.launch.CUDA_LAUNCH``: one grid
step per iteration of the search loop; splits follow the work, the same on
every device). Every kernel is replaced by a recorder, so nothing runs: each
launch is bound and specialised as triton's runtime does it, and each distinct
specialisation (a *variant*) is compiled by triton to a cubin for sm_90a with
its bundled ptxas. From the cubin (``cuobjdump``):

- registers per thread, stack and local memory (spills land there), static
  shared memory;
- the SASS: instructions of the hottest innermost loop (the search kernels'
  step loop; the tile loop of single-pass kernels; the whole kernel when it
  has no loop) divided by the elements each thread handles per iteration:
  ``sass_per_elem_step`` (per element and grid step for the search kernels,
  per element for single-pass kernels), split by the pipe that issues them;
- shared memory in the hot loop (``loop_shared``: its LDS / STS / LDSM /
  STSM / ATOMS instructions; a layout conversion or a reduction across warps
  goes through shared memory, and in the search's step loop it is paid at
  every step), its barriers (``loop_barriers``), and the layout conversions
  triton left in that loop (``loop_conversions``: ``ttg.convert_layout`` ops
  in the innermost loop of the TTGIR with the most operations; a tile's
  conversion costs a round trip of the tile through shared memory, where a
  reduction across warps exchanges one value per warp; a one-element
  tensor is held by every thread in every layout, so its conversion moves
  no data and is not counted) and its reductions
  across warps (``loop_cross_warp``: a group spread over several warps);
- the warps resident per SM (``warps_per_sm``), from the registers, the
  shared memory and the block size (sm_90: 64K registers allocated per warp
  in units of 256, 228 KiB of shared memory with 1 KiB reserved per block,
  at most 64 warps and 32 blocks);
- for the streaming kernels (min_max, flatten, accumulate_sq and their
  finish passes), ``sass_per_elem_program``: the instructions one program
  issues per element of the value it covers, at the case's shape: its main
  loop x the trips the launch's arguments give, plus everything it issues
  once (prologue, the reduction across lanes, the epilogue), per thread,
  divided by the elements per thread (``program_path``: the error paths,
  loops taken only when a slice held NaN or inf, count zero times);
  ``pipes_program`` the same by pipe, which the GPU model's compute term
  uses for those kernels;
- the approximate PTX instructions (``*.approx``, ``div.full``) and libdevice
  functions (``__nv_*`` in the LLVM IR) each variant uses.

The compile check (tests/test_kernels_compile.py) runs ``probe()`` in a
subprocess and asserts on the same records; the benchmark's GPU model takes
its compute term from ``issue_seconds``. Compiled kernels land in triton's
cache, so a second run recompiles nothing that did not change.

Importing this module needs triton, never a GPU. ``probe()`` must run without
TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional

__all__ = [
    "PIPES",
    "TARGETS",
    "H100_SXM_ISSUE",
    "Case",
    "cases",
    "discover_kernels",
    "record",
    "compile_variant",
    "probe",
    "issue_seconds",
    "warps_per_sm",
    "ttgir_hot_loop",
    "cross_warp_reductions",
    "recording",
    "cpu_tensors_recorded",
    "launch_work",
    "profile_launches",
    "main",
]

PACKAGE = "obskernels.kernels"
# modules of kernels/ that launch no kernel of their own (mse_search_details:
# the search's jit kernels, launched by mse_search)
_NOT_KERNEL_MODULES = {"_layout", "launch", "quant", "quant_pow", "mse_search_details"}

PIPES = ("FP32", "INT", "MUFU", "LSU", "other")

#: what a streaming kernel's program may issue per element of the value, by
#: the value's bytes per element: at 132 SMs x 4 schedulers x 1 instruction
#: per clock (1.98 GHz) a warp instruction covers 32 elements, so 2-byte
#: elements at 85 % of a 2.83 TB/s copy leave ~27 per element of issue and
#: 4-byte ones ~55; the targets keep a factor of ~2.7 / 3.4 for stalls
TARGETS = {2: 10.0, 4: 16.0}

# H100 SXM: 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz (boost) lane-instructions
# per second issued; per pipe, the share of that rate it sustains (sm_90's
# throughput table: FP32 128 lanes/clk/SM, INT 64, MUFU and conversions 16,
# load/store and shuffle 32).
H100_SXM_ISSUE = 132 * 4 * 32 * 1.98e9
PIPE_RATE = {"FP32": 1.0, "INT": 0.5, "MUFU": 1 / 8, "LSU": 1 / 4, "other": 1.0}

_FP32 = ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD",
         "F2FP", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2")
# the XU unit: special functions and the conversions that go through it
_MUFU = ("MUFU", "F2F", "F2I", "I2F", "FRND", "I2FP", "F2IP")
_INT = ("IMAD", "IADD3", "IADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP", "IMNMX", "LEA",
        "SEL", "PRMT", "IABS", "POPC", "FLO", "BREV", "BMSK", "IDP", "VIADD", "VIMNMX", "ISCADD",
        "UIADD3", "ULOP3", "USHF", "UIMAD", "ULEA", "USEL", "UISETP", "UPRMT", "UMOV")
_LSU = ("LD", "LDG", "LDS", "LDL", "LDC", "ULDC", "ST", "STG", "STS", "STL", "ATOM", "ATOMG",
        "ATOMS", "RED", "REDG", "SHFL", "LDSM", "STSM", "LDGSTS", "MATCH")
# the instructions that read or write shared memory
_SHARED = ("LDS", "STS", "LDSM", "STSM", "ATOMS")

# sm_90's residency limits (CUDA occupancy calculator, compute capability 9.0)
_SM_REGISTERS = 65536
_REG_UNIT = 256  # registers are allocated per warp in units of 256
_SM_SHARED = 233472  # 228 KiB per SM
_BLOCK_SHARED_RESERVED = 1024
_SM_WARPS = 64
_SM_BLOCKS = 32


def ttgir_hot_loop(ttgir: str) -> List[str]:
    """The lines of the innermost ``scf.for`` of a TTGIR listing with the most
    lines (nested regions such as ``scf.if`` included); [] without loops."""
    stack: List[dict] = []
    inner: List[List[str]] = []
    depth = 0
    for line in ttgir.splitlines():
        if re.search(r"\bscf\.for\b", line):
            for loop in stack:
                loop["leaf"] = False
            stack.append(dict(depth=depth, lines=[], leaf=True))
        for loop in stack:
            loop["lines"].append(line)
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1]["depth"]:
            loop = stack.pop()
            if loop["leaf"]:
                inner.append(loop["lines"])
    return max(inner, key=len, default=[])


_CONVERT = re.compile(r"ttg\.convert_layout .* -> tensor<([\dx]+)x\w+,")


def moving_conversion(line: str) -> bool:
    """Whether a TTGIR line converts a layout that moves data: every
    ``ttg.convert_layout`` but those of a one-element tensor (replicated in
    every thread whatever the layout: it moves no data, no shared memory)."""
    m = _CONVERT.search(line)
    if m is None:
        return "ttg.convert_layout" in line
    return math.prod(int(d) for d in m.group(1).split("x")) > 1


_BLOCKED = re.compile(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                      r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[([\d, ]+)\]")
_REDUCE = re.compile(r'"tt\.reduce"\(.*<\{axis = (\d+)')
_REDUCE_TYPE = re.compile(r"^\s*\}\) : \(tensor<([\dx]+)x\w+, (#\w+)>")


def cross_warp_reductions(ttgir: str, lines: List[str]) -> int:
    """Reductions among ``lines`` (TTGIR) whose reduced axis is spread over
    several warps (its blocked layout puts more than one warp on that axis
    and the axis is longer than one warp covers): each exchanges one value
    per warp through shared memory."""
    layouts = {}
    for line in ttgir.splitlines():
        m = _BLOCKED.match(line)
        if m:
            layouts[m.group(1)] = [[int(v) for v in g.split(",")] for g in m.groups()[1:]]
    count = 0
    for i, line in enumerate(lines):
        m = _REDUCE.search(line)
        if not m:
            continue
        axis = int(m.group(1))
        for close in lines[i + 1:]:
            t = _REDUCE_TYPE.match(close)
            if t:
                shape = [int(v) for v in t.group(1).split("x")]
                if t.group(2) in layouts:
                    size, threads, warps = (v[axis] for v in layouts[t.group(2)])
                    count += warps > 1 and shape[axis] > size * threads
                break
    return count


def warps_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Warps of a kernel resident on one sm_90 SM at once: whole blocks of
    ``num_warps``, as many as the registers, the shared memory and the SM's
    warp and block limits allow."""
    per_warp = -(-max(registers, 1) * 32 // _REG_UNIT) * _REG_UNIT
    by_regs = (_SM_REGISTERS // per_warp) // num_warps
    by_shared = _SM_SHARED // (shared + _BLOCK_SHARED_RESERVED)
    return min(by_regs, by_shared, _SM_WARPS // num_warps, _SM_BLOCKS) * num_warps


def pipe_of(opcode: str) -> str:
    """The pipe an SASS opcode (``FFMA``, ``LDG.E.64``...) issues to."""
    base = opcode.split(".")[0]
    if base in _FP32:
        return "FP32"
    if base in _MUFU:
        return "MUFU"
    if base in _INT:
        return "INT"
    if base in _LSU:
        return "LSU"
    return "other"


# --------------------------------------------------------------------------- #
# cases: every launcher on representative shapes
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call. ``call(module)`` runs it (tensors on the CPU);
    ``config``: LaunchConfig fields on top of the GPU's launch configuration;
    ``tag`` groups calls whose launches must share one variant per kernel;
    ``targets``: a real size (>= 64 MB where the layout allows), whose
    streaming launches are held to the instructions-per-element targets of
    the compile check."""

    name: str
    module: str
    call: Callable
    config: Dict = dataclasses.field(default_factory=dict)
    tag: str = ""
    targets: bool = False


def cases() -> List[Case]:
    """The probe's calls: each kernel and each value of its mode switches at
    least once, at the shapes observers see (weights 4096 x 4096; the small
    shapes only where a mode needs them, e.g. the no-recompile sweeps)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs as QA

    from obskernels.spec import calls
    from obskernels.spec.record import STATUS_INIT

    def checked(launcher, *args, **kwargs):  # a launcher takes its call checked
        return launcher(getattr(calls, launcher.__name__)(*args, **kwargs))

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32

    def w(*shape, dtype=bf):  # nothing reads the values: no launch runs
        return torch.empty(*shape, dtype=dtype)

    W = (4096, 4096)
    mse = dict(maxshrink=0.2, patience=5, grid=100, norm=2.4)
    imx = dict(maxshrink=0.95, patience=5, grid=20, norm=3.0, flavour="imatrix")
    nvx = dict(maxshrink=1 - 0.8 / 1.8, patience=1000, grid=200, norm=2.4, expand=1.8)
    nvfp4 = dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.float8_e4m3fn)
    g128 = QA(num_bits=4, strategy="group", group_size=128)
    g_idx = (torch.arange(4096) // 128)[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    imp = torch.rand(4096, generator=torch.Generator().manual_seed(0)) + 0.5
    C = lambda *a, **k: Case(*a, **k)  # noqa: E731
    out = [
        C("weight int4 g128", "min_max", lambda m: checked(m.min_max, w(*W), "weight", g128)),
        C("weight tensor (split)", "min_max", lambda m: checked(m.min_max, w(*W), "weight", QA(num_bits=8, strategy="tensor"))),
        C("weight channel fp16", "min_max", lambda m: checked(m.min_max, w(*W, dtype=f16), "weight", QA(num_bits=8, strategy="channel"))),
        C("weight g_idx g128", "min_max", lambda m: checked(m.min_max, w(*W), "weight", g128, g_idx=g_idx)),
        C("weight block 128 partial (pad)", "min_max", lambda m: checked(m.min_max, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("weight block 8x16 partial fp32 (pad)", "min_max", lambda m: checked(m.min_max, w(4097, 4095, dtype=f32), "weight", QA(num_bits=8, strategy="block", block_structure=[8, 16]))),
        C("weight block 128 transposed (pad)", "min_max", lambda m: checked(m.min_max, w(4000, 4000).t(), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("act token", "min_max", lambda m: checked(m.min_max, w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True))),
        C("attn_head q", "min_max", lambda m: checked(m.min_max, w(1, 2048, 32, 128).transpose(1, 2), "q", QA(num_bits=8, strategy="attn_head"))),
        C("block 128 partial (pad)", "flatten", lambda m: checked(m.flatten_for_calibration, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("g_idx g128", "flatten", lambda m: checked(m.flatten_for_calibration, w(*W), "weight", g128, g_idx=g_idx)),
        C("act (1, 7, 4096) add", "accumulate_sq", lambda m: checked(m.accumulate_sq, w(1, 7, 4096), torch.zeros(4096), torch.zeros(1, dtype=torch.int64))),
        C("act (8, 2048, 4096) split", "accumulate_sq", lambda m: checked(m.accumulate_sq, w(8, 2048, 4096), torch.zeros(4096), torch.zeros(1, dtype=torch.int64))),
        C("int4 g128 sym norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **mse)),
        C("int4 g128 asym norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=128), **mse)),
        C("int4 g128 norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **dict(mse, norm=2.0))),
        C("nvfp4 g16 (expanded)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **nvx)),
        C("imatrix int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, **imx)),
        C("int8 channel norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, strategy="channel"), **mse)),
        C("fp8 block 128 (split)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse)),
        C("fp8 block 128 partial (split, pad)", "mse_search", lambda m: checked(m.mse_search, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse)),
        C("int8 block 4 partial (pad)", "mse_search", lambda m: checked(m.mse_search, w(10, 10), "weight", QA(num_bits=8, strategy="block", block_structure=[4, 4]), **mse)),
        C("fp8 asym channel fp16 norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f16), "weight", QA(num_bits=8, type="float", symmetric=False, strategy="channel"), **dict(mse, norm=2.0))),
        C("mxfp4 g32 fp32 norm 0.5", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f32), "weight", QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8), **dict(mse, norm=0.5))),
        C("imatrix int8 channel 16384 (split)", "mse_search", lambda m: checked(m.mse_search, w(512, 16384, dtype=f16), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(16384) + 0.5, **imx)),
    ]
    # Real sizes (>= 64 MB, 112 MB for a 14336 x 4096 bf16 weight): every layout
    # a streaming launcher can choose, in fp32 / fp16 / bf16, held to the
    # instructions-per-element targets of the compile check (``targets``).
    g_idx14 = (torch.arange(4096) // 128)[torch.randperm(4096, generator=torch.Generator().manual_seed(1))]
    blk = lambda h, w_, t="float": QA(num_bits=8, type=t, strategy="block", block_structure=[h, w_])  # noqa: E731
    held_stats = lambda n, dt: (torch.zeros(n, dtype=dt), torch.ones(n, dtype=dt))  # noqa: E731
    R = lambda *a, **k: Case(*a, targets=True, **k)  # noqa: E731
    mm = lambda name, value, base, args, **kw: R(  # noqa: E731
        f"64MB {name}", "min_max", lambda m: checked(m.min_max, value(), base, args, **kw))
    out += [
        mm("weight int4 g128 bf16 14336x4096", lambda: w(14336, 4096), "weight", g128),
        mm("weight nvfp4 g16 bf16 14336x4096", lambda: w(14336, 4096), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4)),
        mm("weight mxfp4 g32 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8)),
        mm("weight int8 g64 fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), "weight", QA(num_bits=8, strategy="group", group_size=64)),
        mm("weight channel fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight channel fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight channel bf16 14336x4096 transposed", lambda: w(4096, 14336).t(), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight tensor bf16 8192x4096 (split)", lambda: w(8192, 4096), "weight", QA(num_bits=8, strategy="tensor")),
        mm("weight tensor fp32 4096x4096 transposed (split)", lambda: w(4096, 4096, dtype=f32).t(), "weight", QA(num_bits=8, strategy="tensor")),
        mm("weight g_idx g128 bf16 14336x4096", lambda: w(14336, 4096), "weight", g128, g_idx=g_idx14),
        mm("weight block 128 bf16 8192x4096", lambda: w(8192, 4096), "weight", blk(128, 128)),
        mm("weight block 128 partial (pad) bf16 8000x4000", lambda: w(8000, 4000), "weight", blk(128, 128)),
        mm("weight block 128 transposed (pad) bf16 8000x4000", lambda: w(4000, 8000).t(), "weight", blk(128, 128)),
        mm("weight block 8x16 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", blk(8, 16, "int")),
        mm("weight block 128 partial (pad) fp16 4000x8000", lambda: w(4000, 8000, dtype=f16), "weight", blk(128, 128)),
        mm("act token 3-D bf16 (4, 2048, 4096)", lambda: w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True)),
        mm("act token 2-D fp16 (8192, 4096) (split)", lambda: w(8192, 4096, dtype=f16), "input", QA(num_bits=8, strategy="token", dynamic=True)),
        mm("act tensor bf16 (2, 4096, 4096) (split)", lambda: w(2, 4096, 4096), "input", QA(num_bits=8, strategy="tensor")),
        mm("act group g128 bf16 (2, 4096, 4096) (split)", lambda: w(2, 4096, 4096), "input", g128),
        mm("act tensor_group 16 fp32 (4096, 4096)", lambda: w(4096, 4096, dtype=f32), "input", QA(strategy="tensor_group", group_size=16, **nvfp4)),
        mm("attn_head q bf16 (4, 32, 2048, 128) (split)", lambda: w(4, 2048, 32, 128).transpose(1, 2), "q", QA(num_bits=8, strategy="attn_head")),
        mm("attn tensor k fp16 (4, 32, 2048, 128) (split)", lambda: w(4, 32, 2048, 128, dtype=f16), "k", QA(num_bits=8, strategy="tensor")),
        mm("act token 3-D bf16 running, record", lambda: w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True), held=held_stats(2048, bf), status=torch.tensor(STATUS_INIT, dtype=torch.int64), observation=3),
        mm("weight int4 g128 bf16 14336x4096 average", lambda: w(14336, 4096), "weight", g128, held=held_stats((14336, 32), bf), averaging_constant=0.01),
        mm("weight nvfp4 g16 bf16 14336x4096 running, record", lambda: w(14336, 4096), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), held=held_stats((14336, 256), bf), status=torch.tensor(STATUS_INIT, dtype=torch.int64), observation=4),
    ]
    fl = lambda name, value, args, **kw: R(  # noqa: E731
        f"64MB {name}", "flatten", lambda m: checked(m.flatten_for_calibration, value(), "weight", args, **kw))
    out += [
        fl("block 128 partial (pad) bf16 8000x4000", lambda: w(8000, 4000), blk(128, 128)),
        fl("block 128 transposed (pad) bf16 8000x4000", lambda: w(4000, 8000).t(), blk(128, 128)),
        fl("block 128 fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), blk(128, 128)),
        fl("block 8x16 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), blk(8, 16, "int")),
        fl("g_idx g128 bf16 14336x4096", lambda: w(14336, 4096), g128, g_idx=g_idx14),
    ]
    acc = lambda name, value: R(  # noqa: E731
        f"64MB {name}", "accumulate_sq", lambda m: checked(m.accumulate_sq, value(), torch.zeros(value().shape[-1]), torch.zeros(1, dtype=torch.int64)))
    out += [
        acc("bf16 (4, 2048, 4096)", lambda: w(4, 2048, 4096)),
        acc("fp32 (2, 2048, 4096)", lambda: w(2, 2048, 4096, dtype=f32)),
        acc("fp16 (8192, 4096)", lambda: w(8192, 4096, dtype=f16)),
        acc("bf16 (4096, 8192) tokens contiguous", lambda: w(8192, 4096).t()),
    ]
    # qparams (every mode switch: formats, scale_dtype, global scale, widen,
    # carry) and the statistics epilogues (min_max's and combine_statistics')

    rn = torch.randn
    int4a = QA(num_bits=4, symmetric=False, strategy="group", group_size=16)
    nvfp4_tg = QA(strategy="tensor_group", group_size=16, **nvfp4)
    g_idx64 = (torch.arange(64) // 16)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]

    def rec():
        return torch.tensor(STATUS_INIT, dtype=torch.int64)

    def stats(n, dtype=f32):
        mn = rn(n, 4, dtype=dtype)
        return mn, mn + 1

    def held84():
        return torch.zeros(8, 4, dtype=bf), torch.ones(8, 4, dtype=bf)

    out += [
        C("int4 asym widen", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, bf), int4a, widen=True)),
        C("nvfp4 fused", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, bf), nvfp4_tg, fused=[stats(8, bf), stats(3, bf)], widen=True, carry=rec())),
        C("mxfp4", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, f16), QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8), widen=True)),
        C("fp8 given global scale", "qparams", lambda m: checked(m.calculate_qparams, *stats(8), QA(num_bits=8, type="float", symmetric=False), torch.ones(1), widen=True)),
        C("bf16 scale_dtype", "qparams", lambda m: checked(m.calculate_qparams, *stats(8), QA(num_bits=8, symmetric=True, scale_dtype=torch.bfloat16))),
        C("average record", "stats", lambda m: checked(m.combine_statistics, rn(8, 64, dtype=bf), "weight", int4a, *held84(), held=held84(), averaging_constant=0.01, status=rec(), observation=1)),
        C("running block pad", "stats", lambda m: checked(m.combine_statistics, rn(10, 10), "weight", QA(num_bits=8, strategy="block", block_structure=[4, 4]), torch.zeros(3, 3), torch.ones(3, 3), held=(torch.zeros(3, 3), torch.ones(3, 3)), status=rec())),
        C("average record", "min_max", lambda m: checked(m.min_max, rn(8, 64, dtype=bf), "weight", int4a, held=held84(), averaging_constant=0.01, status=rec(), observation=2)),
        C("running g_idx", "min_max", lambda m: checked(m.min_max, rn(5, 64), "weight", QA(num_bits=8, strategy="group", group_size=16), g_idx=g_idx64, held=(torch.zeros(5, 4), torch.ones(5, 4)), status=rec())),
        C("split average", "min_max", lambda m: checked(m.min_max, rn(19, 40, dtype=bf), "input", QA(num_bits=8, strategy="tensor"), held=(torch.zeros(1, dtype=bf), torch.ones(1, dtype=bf)), averaging_constant=0.5, status=rec()), config=dict(tile=16, split=3)),
    ]
    # The search's exact emulation (what the interpreter runs, gpu_arith off) is
    # compiled too: both arithmetic paths must build for sm_90a.
    emu = dict(gpu_arith=False)
    out += [
        C("emulated int4 g128 norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **mse), config=emu),
        C("emulated int4 g128 asym norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=128), **dict(mse, norm=2.0)), config=emu),
        C("emulated nvfp4 g16", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **nvx), config=emu),
        C("emulated fp8 channel fp16", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f16), "weight", QA(num_bits=8, type="float", strategy="channel"), **mse), config=emu),
        C("emulated imatrix int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, **imx), config=emu),
        C("emulated fp8 block 128 (split)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse), config=emu),
        C("imatrix fp32 int8 g32 norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f32), "weight", QA(num_bits=8, symmetric=False, strategy="group", group_size=32), importance=imp, **dict(imx, norm=2.4))),
    ]
    # The imatrix observer's path: raw importance (sum / count and its
    # verdict, one launch), normalised by the search as it loads it.
    out += [
        C("importance 4096", "importance", lambda m: checked(m.importance, torch.rand(4096) * 7, torch.full((), 7, dtype=torch.int64), rec())),
        C("imatrix raw int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, importance_status=rec(), **imx)),
        C("imatrix raw int8 channel 16384 (split)", "mse_search", lambda m: checked(m.mse_search, w(512, 16384, dtype=f16), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(16384) + 0.5, importance_status=rec(), **imx)),
    ]
    # Search parameters only: same format, shape and mode switches each time.
    r = lambda *s: w(*s)  # noqa: E731
    for grid, patience, maxshrink, expand, norm in [
        (100, 5, 0.2, 1.0, 2.4), (80, 1, 0.2, 1.0, 2.4), (200, 1000, 1 - 0.8 / 1.8, 1.8, 1.7),
        (40, 0, 0.5, 1.2, 2.4), (32, 16, 0.5, 1.0, 7.3),
    ]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, expand=expand, norm=norm)
        out.append(C("nvfp4 params", "mse_search", lambda m, kw=kw: checked(m.mse_search,
            r(8, 64), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **kw), tag="params-small"))
    # the split path's step buffers are sized by a power of two of the steps: stay in one
    split = dict(max_reg_group=64, chunk=64, split=2)
    for grid, patience, maxshrink in [(100, 5, 0.2), (90, 1, 0.2), (125, 16, 0.2), (17, 0, 1.0)]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, norm=2.4)
        out.append(C("tensor params (split)", "mse_search", lambda m, kw=kw: checked(m.mse_search,
            r(9, 70), "weight", QA(num_bits=8, strategy="tensor"), **kw), config=split, tag="params-split"))
    # The split path at the real sizes (one tensor group: the search splits it
    # over programs): a 2048 x 4096 fp8 activation and a 4096 x 4096 int8 weight.
    for what, base, shape, qa in (("act 2048x4096 fp8", "input", (2048, 4096), QA(num_bits=8, type="float", strategy="tensor")),
                                  ("weight 4096x4096 int8", "weight", W, QA(num_bits=8, strategy="tensor"))):
        for norm in (2.4, 2.0):
            out.append(C(f"tensor {what} norm {norm:g} (split)", "mse_search", lambda m, b=base, s=shape, q=qa, n=norm:
                         checked(m.mse_search, w(*s), b, q, **dict(mse, norm=n))))
    return out


# --------------------------------------------------------------------------- #
# recording launches
# --------------------------------------------------------------------------- #
def _kernel_modules() -> Dict[str, object]:
    pkg = importlib.import_module(PACKAGE)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_KERNEL_MODULES)
    return {n: importlib.import_module(f"{PACKAGE}.{n}") for n in names}


def discover_kernels(modules=None) -> Dict[str, tuple]:
    """Every launched @triton.jit kernel of kernels/: a JIT function of a
    module that the module's source launches as ``name[grid](...)``.
    Returns {"module.name": (module, attribute)}."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # under TRITON_INTERPRET=1 a @triton.jit function is an InterpretedFunction
    kinds = (JITFunction, InterpretedFunction)
    found = {}
    for mname, module in (modules or _kernel_modules()).items():
        src = inspect.getsource(module)
        for attr, fn in vars(module).items():
            if isinstance(fn, kinds) and re.search(rf"\b{re.escape(attr)}\s*\[", src):
                found[f"{mname}.{attr}"] = (module, attr)
    return found


@dataclasses.dataclass
class Launch:
    case: str
    tag: str
    kernel: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, name, fn, sink):
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            self.sink.append((self.name, self.fn, tuple(int(v) for v in g), args, kwargs))
        return launch


@contextlib.contextmanager
def recording(kernels=None):
    """Within the block every kernel of kernels/ is a recorder; yields the
    list of (kernel, fn, grid, args, kwargs) launches (nothing runs), under
    the GPU's launch configuration."""
    from obskernels.kernels.launch import CUDA_LAUNCH, launch_config

    kernels = kernels or discover_kernels()
    sink: list = []
    saved = []
    for name, (module, attr) in kernels.items():
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, _Recorder(name, getattr(module, attr), sink))
    try:
        # what a GPU compiles: its launch shape and its arithmetic (gpu_arith)
        with launch_config(**CUDA_LAUNCH, gpu_arith=True):
            yield sink
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


@contextlib.contextmanager
def cpu_tensors_recorded():
    """Within the block the triton backend takes CPU tensors although the
    kernels were built for the compiler: for a caller that records a front
    call (an observer's, through obskernels.ops) inside ``recording()``, so
    that nothing runs. The backend takes CPU tensors where TRITON_INTERPRET
    is set, which it reads for each call signature it has not seen (the
    plans made in the block are dropped at its end); the kernels keep what
    triton built when they were imported (``kernels._layout.INTERPRETED``
    stays False)."""
    import obskernels.kernels  # noqa: F401 - built for the compiler before the switch

    from obskernels import ops

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
        # the plans kept for CPU tensors in the block took the triton backend,
        # which CPU tensors cannot take outside it
        ops._PLANS.clear()


def record(calls, kernels=None) -> List[Launch]:
    """Runs each ``(case, tag, module name, config fields, call)`` of ``calls``
    with every kernel replaced by a recorder, under the GPU's launch
    configuration plus the case's fields; returns the launches (nothing runs).
    The kernels are restored afterwards."""
    from obskernels.kernels.launch import launch_config

    launches = []
    with recording(kernels) as sink:
        for case, tag, mname, fields, call in calls:
            sink.clear()
            module = importlib.import_module(f"{PACKAGE}.{mname}")
            with launch_config(**fields):
                call(module)
            launches += [Launch(case, tag, n, f, g, a, k) for n, f, g, a, k in sink]
    return launches


# --------------------------------------------------------------------------- #
# compiling and reading the machine code
# --------------------------------------------------------------------------- #
def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _specialise(launch: Launch):
    """(variant key, ASTSource, options, constexprs by name) as JITFunction.run
    builds them for an sm_90 target."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target())
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    key = repr((launch.kernel, spec, sorted(options.items())))
    opts, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    names = {p.name: bound.get(p.name) for p in fn.params if p.is_constexpr}
    return key, src, opts, names


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_APPROX = re.compile(r"\b([a-z0-9]+(?:\.[a-z0-9]+)*\.(?:approx|full)(?:\.[a-z0-9]+)*)\b")


def parse_sass(sass: str) -> List[tuple]:
    """[(address, opcode, operands)] of the instructions of a cuobjdump listing."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def loops_of(instrs: List[tuple]) -> List[tuple]:
    """(first, last) index of every loop: a backward branch and its target
    (a branch to itself, the trap ptxas puts after the exit, is no loop)."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    loops = []
    for i, (addr, op, rest) in enumerate(instrs):
        if op.split(".")[0] != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)\s*$", rest.strip())
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))
    return loops


def _innermost(loops: List[tuple]) -> List[tuple]:
    return [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]


def hot_loop(instrs: List[tuple]) -> Optional[tuple]:
    """(first, last) index of the largest innermost loop: a backward branch and
    its target, with no other backward branch inside. None without loops."""
    return max(_innermost(loops_of(instrs)), key=lambda ab: ab[1] - ab[0], default=None)


_HEAVY = ("LDG", "STG", "LDS", "STS", "FMNMX", "FADD", "FMUL", "FFMA", "SHFL")


def unroll_factor(instrs: List[tuple], main: tuple) -> int:
    """How many steps one pass of ``main`` runs: ptxas unrolls a short loop
    by U and leaves a remainder loop of one step right after it; the two
    bodies' loads, stores and float operations then differ by exactly U."""
    later = sorted(ab for ab in _innermost(loops_of(instrs)) if ab[0] > main[1])

    def heavy(ab):
        out: Dict[str, int] = {}
        for _, op, _ in instrs[ab[0]:ab[1] + 1]:
            base = op.split(".")[0]
            if base in _HEAVY:
                out[base] = out.get(base, 0) + 1
        return out

    if not later:
        return 1
    m, r = heavy(main), heavy(later[0])
    if not r or set(m) != set(r):
        return 1
    ratios = {m[k] / r[k] for k in m}
    u = ratios.pop() if len(ratios) == 1 else 1
    return int(u) if u > 1 and u == int(u) else 1


def program_path(instrs: List[tuple]) -> tuple:
    """(main loop, instructions issued once) of a streaming kernel's program.

    The main loop is the first innermost loop, in address order, that loads
    from global memory (the kernels' step loop comes first in their source and
    ptxas keeps that order). Issued once: every instruction outside loops and
    the rest of the loops around the main loop (entered once at the probe's
    shapes). Other loops are the rarely taken error paths (the non-finite
    counting), or the remainder of an unrolled main loop (``unroll_factor``),
    and count zero times. Returns ((first, last) or None, [indices])."""
    loops = loops_of(instrs)
    main = next((ab for ab in sorted(_innermost(loops))
                 if any(op.startswith("LDG") for _, op, _ in instrs[ab[0]:ab[1] + 1])), None)
    cold = set()
    for a, b in loops:
        if main is None or not (a <= main[0] and main[1] <= b):
            cold.update(range(a, b + 1))
    hot = set(range(main[0], main[1] + 1)) if main else set()
    return main, [i for i in range(len(instrs)) if i not in cold and i not in hot]


# elements one iteration of the hot loop handles, by kernel (constexpr names
# multiplied); default: the product of every BLOCK_* constexpr
_ITER_ELEMS = {
    # BLOCK_J (groups sharing an importance read) tiles BLOCK_G: not a factor
    "_search_kernel": ("BLOCK_G", "BLOCK_E", "BLOCK_S"),
    "_search_part_kernel": ("ROWS", "BLOCK_E", "BLOCK_SB"),
    "_choose_kernel": ("BLOCK_G",),
}
# kernels whose hot loop is the search's step loop: counts are per element AND step
_SEARCH = ("_search_kernel", "_search_part_kernel")


def _iter_elems(kernel: str, constexprs: Dict) -> int:
    attr = kernel.split(".")[-1]
    names = _ITER_ELEMS.get(attr) or [n for n in constexprs if n.startswith("BLOCK_")]
    return math.prod(int(constexprs[n]) for n in names) if names else 1


# The streaming kernels' programs: (trips of the main loop, elements of the
# value one program covers) from a launch's bound arguments and grid, for the
# first program (full blocks of groups, a full row range).
def _groups(a):
    QB = int(a["geo"].QB)
    QA = int(a["Q"]) // QB
    return min(int(a["BLOCK_A"]), QA) * min(int(a["BLOCK_B"]), QB)


def _stream_program(a, grid, rows_name):
    E = int(a["geo"].E)
    if a.get("GROUP_LOOP"):  # a loop over the blocks of a block column, one step each
        QB = int(a["geo"].QB)
        n_b = _cdiv(QB, a["BLOCK_B"])
        per = _cdiv(_cdiv(int(a["Q"]) // QB, a["BLOCK_A"]), grid[0] // n_b)
        return per, per * _groups(a) * E
    rows = min(int(a[rows_name]), int(a["NR"]))
    steps = _cdiv(rows, a["BLOCK_R"]) * _cdiv(E, a["BLOCK_E"])
    return steps, _groups(a) * rows * E


_PROGRAM = {
    "_min_max_kernel": lambda a, g: _stream_program(a, g, "rows_per_split"),
    "_flatten_kernel": lambda a, g: _stream_program(a, g, "rows_per_program"),
    "_sum_sq_kernel": lambda a, g: (
        _cdiv(min(int(a["tokens_per_split"]), int(a["NT"])), a["BLOCK_T"]),
        min(int(a["tokens_per_split"]), int(a["NT"])) * min(int(a["BLOCK_H"]), int(a["H"]))),
    "_min_max_finish_kernel": lambda a, g: (
        _cdiv(a["SPLIT"], a["BLOCK_S"]), min(int(a["BLOCK_Q"]), int(a["Q"])) * int(a["SPLIT"])),
    "_sum_sq_finish_kernel": lambda a, g: (
        _cdiv(a["SPLIT"], a["BLOCK_S"]), min(int(a["BLOCK_H"]), int(a["H"])) * int(a["SPLIT"])),
}


def _bound(launch: Launch) -> Dict:
    """The launch's arguments by name, bound as triton's runtime binds them."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(_target()))
    return binder(*launch.args, **launch.kwargs)[0]


def program_profile(launch: Launch, variant: Dict) -> Optional[Dict]:
    """What one program of ``launch`` issues per element of the value it
    covers, from its variant's record (``program_loop`` / ``program_once``:
    instructions by pipe of the main loop and of the rest, per thread) and the
    launch's arguments: (main loop x trips + the rest) / elements per thread.
    None for kernels without a program model (the search's, qparams')."""
    model = _PROGRAM.get(launch.kernel.split(".")[-1])
    if model is None or variant.get("error") or "program_loop" not in variant:
        return None
    trips, elems = model(_bound(launch), launch.grid)
    per_thread = max(elems, 1) / (32 * variant["num_warps"])
    pipes = {p: (variant["program_loop"][p] * max(trips, 0) + variant["program_once"][p]) / per_thread
             for p in PIPES}
    return dict(sass_per_elem_program=sum(pipes.values()), pipes_program=pipes,
                program_trips=int(trips), program_elems=int(elems))


def _run(cmd: List[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _sass_cache_dir() -> str:
    return os.environ.get("OBSKERNELS_SASS_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "obskernels", "sass"))


def _disassemble(cubin: bytes) -> tuple:
    """(resource usage, SASS listing) of a cubin by the bundled cuobjdump, cached
    on disk by the cubin's hash (the tool costs a second or more per call on a
    loaded machine; a cubin's listing never changes)."""
    import hashlib

    key = hashlib.sha256(cubin).hexdigest()
    path = os.path.join(_sass_cache_dir(), key + ".json")
    try:
        with open(path) as f:
            cached = json.load(f)
        return cached["usage"], cached["sass"]
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        cub = os.path.join(tmp, "k.cubin")
        with open(cub, "wb") as f:
            f.write(cubin)
        text = _run([_bin("cuobjdump"), "-res-usage", "-sass", cub])
    usage = "\n".join(line for line in text.splitlines() if "REG:" in line)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp_path = f"{path}.{os.getpid()}"
        with open(tmp_path, "w") as f:
            json.dump({"usage": usage, "sass": text}, f)
        os.replace(tmp_path, path)
    except OSError:  # a read-only home: no cache, same result
        pass
    return usage, text


def compile_variant(launch: Launch) -> Dict:
    """Compiles the launch's variant for sm_90a and measures it (see the
    module docstring). Errors are returned in ``error``, not raised."""
    import triton

    key, src, opts, constexprs = _specialise(launch)
    rec = dict(kernel=launch.kernel, variant=_variant_name(launch, constexprs), case=launch.case,
               key=key, error=None, num_warps=int(opts.num_warps),
               constexprs={n: (v if isinstance(v, (bool, int, float, str)) else repr(v))
                           for n, v in constexprs.items() if v is not None})
    try:
        k = triton.compile(src, target=_target(), options=opts.__dict__)
    except Exception as exc:  # noqa: BLE001 - reported by the test and the report
        while exc.__cause__ is not None:  # the compiler's root cause names the line
            exc = exc.__cause__
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return rec
    usage, sass = _disassemble(k.asm["cubin"])
    res = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    instrs = parse_sass(sass)
    loop = hot_loop(instrs)
    body = instrs[loop[0]:loop[1] + 1] if loop else instrs
    threads = 32 * rec["num_warps"]
    per_thread = max(_iter_elems(launch.kernel, constexprs) / threads, 1e-9)
    pipes = dict.fromkeys(PIPES, 0)
    for _, op, _ in body:
        pipes[pipe_of(op)] += 1
    main, once = program_path(instrs)

    def by_pipe(indices):
        counts = dict.fromkeys(PIPES, 0)
        for i in indices:
            counts[pipe_of(instrs[i][1])] += 1
        return counts

    spill_ops = sum(op.split(".")[0] in ("LDL", "STL") for _, op, _ in instrs)
    shared = max(int(res.get("SHARED", 0)), int(k.metadata.shared))
    hot_ir = ttgir_hot_loop(k.asm["ttgir"])
    rec.update(
        registers=int(res.get("REG", 0)),
        stack=int(res.get("STACK", 0)),
        local=int(res.get("LOCAL", 0)),
        spills=int(res.get("STACK", 0)) + int(res.get("LOCAL", 0)) + spill_ops,
        shared=shared,
        warps_per_sm=warps_per_sm(int(res.get("REG", 0)), shared, rec["num_warps"]),
        sass_total=len(instrs),
        loop_sass=len(body),
        loop_shared=sum(op.split(".")[0] in _SHARED for _, op, _ in body) if loop else 0,
        loop_barriers=sum(op.split(".")[0] == "BAR" for _, op, _ in body) if loop else 0,
        loop_conversions=sum(moving_conversion(line) for line in hot_ir),
        loop_cross_warp=cross_warp_reductions(k.asm["ttgir"], hot_ir),
        loop="step" if loop and launch.kernel.split(".")[-1] in _SEARCH else ("tile" if loop else "none"),
        elems_per_thread=per_thread,
        sass_per_elem_step=len(body) / per_thread,
        pipes={p: n / per_thread for p, n in pipes.items()},
        approx=sorted(set(_APPROX.findall(k.asm["ptx"]))),
        # linked and inlined: the names survive in the labels (%__nv_exp2f.exit12)
        libdevice=sorted(set(re.findall(r"__nv_([a-z0-9_]+?)(?:\.|\b)", k.asm["llir"]))),
        extern="extern_elementwise" in k.asm["ttir"],
        fast=bool(constexprs.get("FAST", False)),
        # one step of the main loop (a pass of an unrolled one runs several)
        program_loop={p: n / (unroll_factor(instrs, main) if main else 1) for p, n in
                      by_pipe(range(main[0], main[1] + 1) if main else ()).items()},
        program_once=by_pipe(once),
    )
    rec.update(program_profile(launch, rec) or dict(sass_per_elem_program=None))
    return rec


def _cdiv(a, b) -> int:
    return -(-int(a) // max(int(b), 1))


def launch_work(launch: Launch) -> float:
    """Element-steps one launch issues the hot loop for: programs x elements per
    iteration x iterations (trip counts from the launch's arguments; the
    search's step loop runs every step). Multiply by ``sass_per_elem_step``
    for the instructions the launch issues (its loop; the prologue is left out)."""
    constexprs = _specialise(launch)[3]
    a = _bound(launch)
    attr = launch.kernel.split(".")[-1]
    trips = {
        "_search_kernel": lambda: _cdiv(a["n_steps"], a["BLOCK_S"]),
        "_search_part_kernel": lambda: int(a["chunks_per_split"]) * _cdiv(a["n_steps"], a["BLOCK_SB"]),
        "_minmax_part_kernel": lambda: int(a["chunks_per_split"]),
        "_min_max_kernel": lambda: _cdiv(a["rows_per_split"], a["BLOCK_R"]) * _cdiv(a["geo"].E, a["BLOCK_E"]),
        "_sum_sq_kernel": lambda: _cdiv(a["tokens_per_split"], a["BLOCK_T"]),
        "_min_max_finish_kernel": lambda: _cdiv(a["SPLIT"], a["BLOCK_S"]),
        "_sum_sq_finish_kernel": lambda: _cdiv(a["SPLIT"], a["BLOCK_S"]),
        "_choose_kernel": lambda: int(a["n_steps"]),
    }.get(attr, lambda: 1)
    n = trips()  # a kernel whose arguments were renamed fails here, not silently
    return math.prod(launch.grid) * _iter_elems(launch.kernel, constexprs) * max(n, 1)


def profile_launches(launches: List[Launch], cache: Optional[Dict] = None) -> List[Dict]:
    """Per launch: its variant's machine-code record (compiled once per key,
    ``cache`` shared between calls), element-steps, and modelled issue seconds
    on an H100 SXM."""
    cache = {} if cache is None else cache
    out = []
    for launch in launches:
        key = _specialise(launch)[0]
        if key not in cache:
            cache[key] = compile_variant(launch)
        v = cache[key]
        rec = {k: v.get(k) for k in ("kernel", "variant", "error", "registers", "spills",
                                     "sass_per_elem_step", "pipes", "loop", "loop_shared",
                                     "loop_conversions", "loop_cross_warp", "warps_per_sm")}
        if not v["error"]:
            prog = program_profile(launch, v)
            if prog is not None:  # the whole program: value elements x per-element counts
                rec["sass_per_elem_program"] = prog["sass_per_elem_program"]
                rec["elem_steps"] = _program_elements(launch, prog)
                rec["issue_s"] = issue_seconds(prog["pipes_program"], rec["elem_steps"])
            else:
                rec["elem_steps"] = launch_work(launch)
                rec["issue_s"] = issue_seconds(v["pipes"], rec["elem_steps"])
        out.append(rec)
    return out


def _program_elements(launch: Launch, prog: Dict) -> float:
    """Elements a launch's programs cover, all of them as full as the first
    (an upper bound where the last block or row range is partial)."""
    return math.prod(launch.grid) * prog["program_elems"]


def _variant_name(launch: Launch, constexprs: Dict) -> str:
    shown = ", ".join(f"{n}={int(v) if isinstance(v, bool) else v}" for n, v in constexprs.items()
                      if v is not None and not n.startswith("num_"))
    return f"{shown}, warps={launch.kwargs.get('num_warps', 4)}"


def _elem_bytes(launch: Launch) -> Optional[int]:
    """Bytes per element of the value a launch streams (its first argument)."""
    first = launch.args[0] if launch.args else None
    return first.element_size() if hasattr(first, "element_size") else None


def probe(selected: Optional[str] = None) -> Dict:
    """Records every case's launches, compiles each distinct variant once.
    Returns {"triton": its version, "kernels": [...discovered], "variants": [...records],
    "launches": [{"case", "tag", "kernel", "key", "variant", "targets", "elem_bytes",
    "sass_per_elem_program", "program_trips", "program_elems"}]}: per launch,
    what its program issues per element at that case's shape, and whether
    the case is held to the instruction targets (``Case.targets``)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("the compile probe must run without TRITON_INTERPRET")
    kernels = discover_kernels()
    calls = [(c.name, c.tag, c.module, c.config, c.call) for c in cases()
             if selected is None or selected in c.module]
    launches = record(calls, kernels)
    held = {(c.name, c.module) for c in cases() if c.targets}
    variants: Dict[str, Dict] = {}
    rows = []
    for launch in launches:
        key = _specialise(launch)[0]
        if key not in variants:
            variants[key] = compile_variant(launch)
            variants[key]["case"] = f"{launch.kernel.split('.')[0]} {launch.case}"
        prog = program_profile(launch, variants[key]) or {}
        rows.append(dict(case=launch.case, tag=launch.tag, kernel=launch.kernel, key=key,
                         variant=variants[key]["variant"],
                         targets=(launch.case, launch.kernel.split(".")[0]) in held,
                         elem_bytes=_elem_bytes(launch),
                         sass_per_elem_program=prog.get("sass_per_elem_program"),
                         program_trips=prog.get("program_trips"),
                         program_elems=prog.get("program_elems")))
    import triton

    return dict(kernels=sorted(kernels), variants=list(variants.values()), launches=rows,
                triton=triton.__version__)


# --------------------------------------------------------------------------- #
# the compute term of the GPU model
# --------------------------------------------------------------------------- #
def issue_seconds(pipes_per_elem: Dict[str, float], elem_steps: float,
                  issue_rate: float = H100_SXM_ISSUE) -> float:
    """Seconds a GPU needs to issue ``elem_steps`` x the per-element counts:
    the larger of all instructions at the issue rate and each pipe's count at
    that pipe's rate (INT half, MUFU and conversions an eighth, LSU a quarter)."""
    total = sum(pipes_per_elem.values()) * elem_steps / issue_rate
    per_pipe = max(n * elem_steps / (issue_rate * PIPE_RATE[p]) for p, n in pipes_per_elem.items())
    return max(total, per_pipe)


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #
def _table(variants: List[Dict]) -> str:
    head = f"{'kernel':34} {'case':40} {'regs':>4} {'warps':>5} {'spill':>5} {'smem':>6} {'loop':>4} " \
        f"{'lds/sts':>7} {'sass/el':>8} {'/prog':>6} " + \
        " ".join(f"{p:>6}" for p in PIPES) + "  approx / libdevice"
    lines = [head, "-" * len(head)]
    for v in variants:
        if v["error"]:
            lines.append(f"{v['kernel']:34} {v['case'][:40]:40} ERROR {v['error'][:120]}")
            continue
        lines.append(
            f"{v['kernel']:34} {v['case'][:40]:40} {v['registers']:>4} {v['warps_per_sm']:>5} "
            f"{v['spills']:>5} {v['shared']:>6} {v['loop']:>4} {v['loop_shared']:>7} "
            f"{v['sass_per_elem_step']:8.1f} "
            + (f"{v['sass_per_elem_program']:6.1f} " if v.get("sass_per_elem_program") is not None
               else f"{'-':>6} ")
            + " ".join(f"{v['pipes'][p]:6.1f}" for p in PIPES)
            + "  " + " ".join(v["approx"] + v["libdevice"])
        )
    lines.append("sass/el: SASS instructions of the hot loop per element (per element and grid "
                 "step for the search's step loop), sm_90a, triton's bundled ptxas; by pipe after it. "
                 "warps: resident per SM; lds/sts: shared-memory instructions in the hot loop.")
    lines.append("/prog: what one program of the streaming kernels issues per element of the value "
                 "it covers at the case's shape (main loop x trips + the rest, per thread).")
    return "\n".join(lines)


def _launch_table(result: Dict) -> str:
    """Per launch of a streaming kernel: registers, what its program issues
    per element at its case's shape, and the target it is held to."""
    regs = {v["key"]: v.get("registers") for v in result["variants"]}
    head = f"{'kernel':34} {'case':58} {'regs':>4} {'/prog':>6} {'target':>6}"
    lines = [head, "-" * len(head)]
    for row in result["launches"]:
        if row.get("sass_per_elem_program") is None:
            continue
        target = TARGETS.get(row["elem_bytes"]) if row["targets"] else None
        lines.append(f"{row['kernel']:34} {row['case'][:58]:58} {regs.get(row['key']) or 0:>4} "
                     f"{row['sass_per_elem_program']:6.1f} {target if target else '-':>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m obskernels.tools.kernel_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per variant per line")
    ap.add_argument("--probe", action="store_true", help="one JSON document: kernels, variants, launches")
    ap.add_argument("--module", default=None, help="only the cases of this kernel module")
    ap.add_argument("--launches", action="store_true",
                    help="per launch: what its program issues per element at its case's shape")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        os.environ.pop("TRITON_INTERPRET")  # too late for this process: rerun without it
        return subprocess.call([sys.executable, "-m", "obskernels.tools.kernel_report", *(argv or sys.argv[1:])])
    result = probe(a.module)
    if a.probe:
        print(json.dumps(result))
    elif a.json:
        for v in result["variants"]:
            print(json.dumps(v))
    elif a.launches:
        print(_launch_table(result))
    else:
        print(_table(result["variants"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
