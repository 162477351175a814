"""The sm_90 hardware and its machine code, read as text.

The pipes an SASS opcode issues to (``PIPES``, ``pipe_of``) and the rate each
sustains on an H100 SXM (``issue_seconds``: the compute term of the GPU model);
sm_90's residency limits (``warps_per_sm``); the instruction targets of the
streaming kernels (``TARGETS``); reading a cuobjdump listing (``parse_sass``,
its loops, the hot loop, the path one program of a streaming kernel takes)
and a TTGIR listing (the innermost loop, its reductions across warps).

Plain text in, numbers out: nothing here compiles or needs triton.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional

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
# float64 arithmetic (with the ".F64" conversions and MUFU's "64H": ``double_precision``)
_FP64 = ("DADD", "DMUL", "DFMA", "DSETP", "DSET", "DMNMX", "DMMA")
# the instructions that read or write shared memory
_SHARED = ("LDS", "STS", "LDSM", "STSM", "ATOMS")

# sm_90's residency limits (CUDA occupancy calculator, compute capability 9.0)
_SM_REGISTERS = 65536
_REG_UNIT = 256  # registers are allocated per warp in units of 256
_SM_SHARED = 233472  # 228 KiB per SM
_BLOCK_SHARED_RESERVED = 1024
_SM_WARPS = 64
_SM_BLOCKS = 32


def ttgir_hot_loop(ttgir: str, streaming: bool = False) -> List[str]:
    """The lines of the innermost ``scf.for`` of a TTGIR listing with the most
    lines (nested regions such as ``scf.if`` included); [] without loops.
    ``streaming``: a streaming kernel's main loop instead, the first innermost
    loop that loads (as ``program_path`` finds it in the SASS), where it has
    one: the loop over a split's partials that its finishing program runs
    can be the larger."""
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
    if streaming:
        loading = [lines for lines in inner if any("tt.load" in line for line in lines)]
        if loading:
            return loading[0]
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


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse_sass(sass: str) -> List[tuple]:
    """[(address, opcode, operands)] of the instructions of a cuobjdump listing."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def _target_of(rest: str) -> Optional[int]:
    """The address a branch or call goes to (the last operand), or None."""
    m = re.search(r"0x([0-9a-f]+)\s*$", rest.strip())
    return int(m.group(1), 16) if m else None


def loops_of(instrs: List[tuple]) -> List[tuple]:
    """(first, last) index of every loop: a backward branch and its target
    (a branch to itself, the trap ptxas puts after the exit, is no loop)."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    loops = []
    for i, (addr, op, rest) in enumerate(instrs):
        if op.split(".")[0] != "BRA":
            continue
        target = _target_of(rest)
        if target is not None and target < addr and target in index:
            loops.append((index[target], i))
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


def subroutines(instrs: List[tuple]) -> List[tuple]:
    """(first, last) index of every subroutine: from a ``CALL``'s target to
    the first ``RET`` after it. In these kernels the only ones are ptxas's
    out-of-line slow paths of IEEE division (fp32, and fp64 in the float64
    redo), called only when an operand is out of the inline fast path's range
    (a conditional branch skips each call)."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    found = set()
    for _, op, rest in instrs:
        start = index.get(_target_of(rest)) if op.split(".")[0] == "CALL" else None
        if start is None:
            continue
        end = next((j for j in range(start, len(instrs)) if instrs[j][1].split(".")[0] == "RET"), None)
        if end is not None:
            found.add((start, end))
    return sorted(found)


# an operand addressed from the stack pointer R1 ([R1], [R1+0x8]; not R10..R19)
_STACK_ADDRESS = re.compile(r"\[R1(?![0-9])")


def local_memory_ops(instrs: List[tuple]) -> int:
    """Instructions that touch local memory: spill stores and loads (``STL``,
    ``LDL``) and any access addressed from the stack pointer. A stack frame
    that no instruction touches costs nothing: triton 3.7.1's sm_90a code
    for one search variant reserves 8 bytes around ptxas's division
    subroutines and never reads or writes them."""
    return sum(op.split(".")[0] in ("LDL", "STL") or bool(_STACK_ADDRESS.search(rest))
               for _, op, rest in instrs)


def double_precision(op: str) -> bool:
    """Whether an opcode computes or converts in float64 (DFMA, DADD,
    F2F.F64.F32, MUFU.RCP64H...)."""
    return op.split(".")[0] in _FP64 or ".F64" in op or "64H" in op


def float64_branches(instrs: List[tuple]) -> List[tuple]:
    """(first, last) index of the code a forward branch skips, where that code
    computes in float64: for each double-precision instruction outside the
    subroutines, the smallest such skipped range holding it, if that range
    has no loop and no ``EXIT``. In these kernels float64 is the redo of a
    group whose fp32 scale overflowed (``qparams.group_qparams``' WIDEN),
    behind a branch on the largest of the program's redo flags: a program
    takes it only where one of its groups overflowed."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    in_sub = {i for a, b in subroutines(instrs) for i in range(a, b + 1)}
    skipped = []
    for i, (addr, op, rest) in enumerate(instrs):
        target = _target_of(rest) if op.split(".")[0] == "BRA" else None
        if target is not None and target > addr and target in index and index[target] > i + 1:
            skipped.append((i + 1, index[target] - 1))
    loops = loops_of(instrs)
    found = set()
    for i, (_, op, _) in enumerate(instrs):
        if i in in_sub or not double_precision(op):
            continue
        around = [(a, b) for a, b in skipped if a <= i <= b]
        if not around:
            continue
        a, b = min(around, key=lambda ab: ab[1] - ab[0])
        loop_free = not any(a <= c <= b or a <= d <= b for c, d in loops)
        if loop_free and not any(instrs[j][1] == "EXIT" for j in range(a, b + 1)):
            found.add((a, b))
    return sorted(found)


def program_path(instrs: List[tuple]) -> tuple:
    """(main loop, instructions issued once) of a streaming kernel's program.

    The main loop is the first innermost loop, in address order, that loads
    from global memory (the kernels' step loop comes first in their source and
    ptxas keeps that order). Issued once: every instruction outside loops and
    the rest of the loops around the main loop (entered once at the probe's
    shapes), on the program's common path. Off it, counted zero times: the
    other loops, the rarely taken error paths (the non-finite counting) or the
    remainder of an unrolled main loop (``unroll_factor``); the subroutines
    (``subroutines``: division's slow paths); the float64 redo
    (``float64_branches``). Returns ((first, last) or None, [indices])."""
    loops = loops_of(instrs)
    main = next((ab for ab in sorted(_innermost(loops))
                 if any(op.startswith("LDG") for _, op, _ in instrs[ab[0]:ab[1] + 1])), None)
    cold = set()
    for a, b in loops:
        if main is None or not (a <= main[0] and main[1] <= b):
            cold.update(range(a, b + 1))
    for a, b in subroutines(instrs) + float64_branches(instrs):
        cold.update(range(a, b + 1))
    hot = set(range(main[0], main[1] + 1)) if main else set()
    return main, [i for i in range(len(instrs)) if i not in cold and i not in hot]


def issue_seconds(pipes_per_elem: Dict[str, float], elem_steps: float,
                  issue_rate: float = H100_SXM_ISSUE) -> float:
    """Seconds a GPU needs to issue ``elem_steps`` x the per-element counts:
    the larger of all instructions at the issue rate and each pipe's count at
    that pipe's rate (INT half, MUFU and conversions an eighth, LSU a quarter)."""
    total = sum(pipes_per_elem.values()) * elem_steps / issue_rate
    per_pipe = max(n * elem_steps / (issue_rate * PIPE_RATE[p]) for p, n in pipes_per_elem.items())
    return max(total, per_pipe)

