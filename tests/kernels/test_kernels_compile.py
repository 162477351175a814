"""The kernels as an sm_90a GPU runs them, checked without a GPU.

``obskernels.tools.kernel_report`` (run here in a subprocess without
TRITON_INTERPRET) calls every launcher on representative shapes with the
GPU's launch configuration, records each launch (nothing runs), and compiles
each distinct specialisation to a cubin for sm_90a with triton's bundled
ptxas; triton's cache keeps the compiled variants between runs. The tests
assert on what the machine code says:

- every launched kernel of kernels/ is reached by some case, and compiles;
- no spill, no local memory, no instruction touching the stack (a frame
  ptxas reserves and leaves untouched is no traffic); registers within the
  budget of the kernel family (<= 128: two blocks of 256 threads per SM at least; the
  search <= 96 and >= 20 warps resident per SM, which it needs to issue at
  full rate: every step is a chain of dependent arithmetic);
- no layout conversion in the search's step loop, and shared memory there
  only for the sum of a group spread over several warps;
- approximate instructions and libdevice functions only where the exactness
  argument below admits them;
- the MSE search compiles one variant per kernel whatever the grid, patience,
  maxshrink, expand and (non-special) norm;
- the streaming kernels (min_max, flatten, accumulate_sq) issue at most the
  report's ``TARGETS`` instructions per element of the value a program covers
  (10 per 2-byte element, 16 per 4-byte one) at every real-size case, and
  those cases reach every layout mode their launchers choose.

Every assertion holds under each triton the project supports: run this file
with the interpreter of each environment (``.venv`` has triton 3.9,
``.venv-triton36``, ``-37`` and ``-38`` 3.6.0, 3.7.1 and 3.8.0, the tritons of
torch 2.10 to 2.14; register budgets and instruction counts differ between
versions, so one says nothing of the other).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import compile_pythons, compiling_env, python_id, triton_version

pytestmark = pytest.mark.kernel

# Registers per thread, per kernel family. 128 keeps >= 2 blocks of 8 warps
# (or 4 of 4 warps) resident per SM; memory-bound kernels need the occupancy
# to keep loads in flight.
REGISTER_BUDGET = {"min_max": 128, "flatten": 128, "accumulate_sq": 128, "mse_search": 96}
# the search's warps resident per SM (sm_90: 64 at most)
SEARCH_MIN_WARPS_PER_SM = 20
DEFAULT_REGISTER_BUDGET = 128

# Approximate instructions (PTX) and libdevice functions (LLVM IR) a kernel
# may use, and why the result stays exact in the sense of docs/spec.md §5.
#
# |d|**norm for a general norm (quant_pow.pow_pos) runs exp2(norm * log2(d)):
# libdevice log2f (accurate to ~1 ulp), ex2.approx.ftz.f32 (<= 2 ulp, on the
# reduced argument f in [0, 1), so the flush-to-zero never applies) and
# norm * e taken exactly as two products (norm's top 12 significand bits and
# the rest, each times an 8-bit integer). The per-element error is a few fp32 ulp
# (~2^-21 relative): after the bf16 / fp16 rounding of the "mse" flavour it
# flips a value only within that distance of a rounding boundary, and in fp32
# it stays far below the parity tolerance (1e-6 relative on the group's
# error); a group's choice can change only on such near-ties, which the
# parity rule (>= 99% identical choices, the rest within tolerance) admits.
# The interpreter runs numpy's exp2/log2 for the same code (docs/spec.md §6).
# floorf (cvt.rmi) and fmaf_rn (fma.rn) are exact by definition.
# Nothing else: div.full / rcp.approx / sqrt.approx would break the
# correctly rounded divisions and roots the bit-exact qparams rely on
# (div_rn, sqrt_rn), and no other kernel needs a transcendental.
_POW = {"approx": {"ex2.approx.ftz.f32"}, "libdevice": {"exp2f", "log2f", "floorf", "fmaf_rn"}}
_EXACT = {"approx": set(), "libdevice": {"floorf", "fmaf_rn"}}
ALLOWED = {
    "mse_search._search_kernel": _POW,
    "mse_search._search_part_kernel": _POW,
}
# The search's GPU arithmetic (FAST: what a CUDA tensor runs, never the
# interpreter). bf16 / fp16 errors: |d|**norm by MUFU lg2 / ex2 (approximate,
# error bound stated in quant_pow.pow_window); an element whose fast result lies
# within that bound of a rounding boundary of its dtype takes torch's own pow
# from a table built by torch on the device, so the rounded result is torch's
# (docs/spec.md §6). fp32 errors: libdevice powf, the CUDA math library
# function torch's CUDA pow calls (its helpers fadd_rn or fabsf / isinff /
# isnanf, and the rcp.approx inside powf's own argument reduction) - the same
# function, so the same bits as CUDA torch. Division stays div_rn (bf16 and
# fp16: a div_rn reciprocal per group and a product, whose 16-bit rounding is
# the quotient's: proved in mse_search_details/_step._quot_f16_hw and
# quant.quot_bf16_hw, checked by emulation in test_kernels_quant.py); sqrt
# stays sqrt_rn. No new approximate instruction.
_FAST_POW = {
    "approx": _POW["approx"] | {"lg2.approx.ftz.f32", "rcp.approx.ftz.f32"},
    # powf's own helpers, exact by definition: fadd_rn in triton 3.9's
    # libdevice, fabsf in 3.6's (its corner cases)
    "libdevice": _POW["libdevice"] | {"powf", "fadd_rn", "fabsf", "isinff", "isnanf"},
}
ALLOWED_FAST = {
    "mse_search._search_kernel": _FAST_POW,
    "mse_search._search_part_kernel": _FAST_POW,
}


_PROBES: dict = {}  # python -> the running probe (all started at the first use: they compile side by side)


def _start_probes():
    env = compiling_env()
    for python in compile_pythons():
        if os.access(python, os.X_OK):
            _PROBES[python] = subprocess.Popen(
                [python, "-m", "obskernels.tools.kernel_report", "--probe"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )


@pytest.fixture(scope="module", params=compile_pythons(), ids=python_id)
def probe(request):
    python = request.param
    # a configured environment that is missing or broken fails, it never skips
    assert os.access(python, os.X_OK), f"compile environment {python} does not exist (`make test` creates it)"
    assert triton_version(python), f"{python} has no triton"
    if not _PROBES:
        _start_probes()
    proc = _PROBES[python]
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"probe under {python} failed:\n{err[-4000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]), stderr=err)


def _ok(probe):
    return [v for v in probe["variants"] if not v["error"]]


def _name(v):
    return f"{v['kernel']} ({v['case']}; {v['variant']})"


def test_every_kernel_is_launched(probe):
    assert probe["kernels"], "no kernel discovered in kernels/"
    missing = sorted(set(probe["kernels"]) - {v["kernel"] for v in probe["variants"]})
    assert not missing, f"no probe case launches {missing}: add one to kernel_report.probe_cases.cases()"


def test_no_launch_leaves_fp_fusion_to_triton(probe):
    """Every launch states Triton's fp fusion (kernels/launch FUSED /
    UNFUSED): triton 3.9 warns at the first compile that does not, and 3.10
    builds such a kernel unfused. The probe compiles every variant with the
    default unset (helpers.compiling_env)."""
    assert "TRITON_DEFAULT_FP_FUSION" not in probe["stderr"], probe["stderr"][-2000:]


def test_every_variant_compiles_to_sm90a(probe):
    bad = [f"{_name(v)}: {v['error']}" for v in probe["variants"] if v["error"]]
    assert not bad, "\n".join(bad)


def test_no_spills_no_local_memory(probe):
    """No local memory, and nothing touching the stack: no spill stores or
    loads, no access from the stack pointer. A frame ptxas reserves and no
    instruction touches is no traffic (``machine.local_memory_ops``)."""
    bad = [f"{_name(v)}: stack {v['stack']} B, local {v['local']} B, "
           f"{v['local_ops']} instructions touching them"
           for v in _ok(probe) if v["local"] or v["local_ops"]]
    assert not bad, "\n".join(bad)
    assert all(v["spills"] == 0 for v in _ok(probe))  # the figure the bench reports


@pytest.mark.parametrize("line, touches", [
    ("/*0a10*/  STL [R1+0x4], R12 ;", True),
    ("/*0a20*/  LDL.LU R12, [R1+0x4] ;", True),
    ("/*0a30*/  ST.E [R1], R3 ;", True),
    ("/*0a40*/  LDL R5, [R20] ;", True),  # a local load whatever its base
    ("/*0a50*/  LDG.E R2, desc[UR4][R10.64] ;", False),
    ("/*0a60*/  STG.E desc[UR4][R12.64], R19 ;", False),
    ("/*0a70*/  VIADD R1, R1, 0xfffffff8 ;", False),  # the frame reserved, not touched
    ("/*0a80*/  LDC R1, c[0x0][0x28] ;", False),
    ("/*0a90*/  CALL.REL.NOINC 0x5620 ;", False),
])
def test_local_memory_ops_reads_sass(line, touches):
    from obskernels.tools.kernel_report.machine import local_memory_ops, parse_sass

    instrs = parse_sass(line)
    assert len(instrs) == 1, line
    assert local_memory_ops(instrs) == int(touches)


def test_registers_within_budget(probe):
    bad = []
    for v in _ok(probe):
        budget = REGISTER_BUDGET.get(v["kernel"].split(".")[0], DEFAULT_REGISTER_BUDGET)
        if v["registers"] > budget:
            bad.append(f"{_name(v)}: {v['registers']} registers > {budget}")
    assert not bad, "\n".join(bad)


# The kernels that stream the value. The finishing of a split (the last
# program of a block, in min_max and accumulate_sq alike) reduces its partials (at
# most a few hundred per group, a fixed cost per call, not per byte of the
# value) and is not held to the per-element targets.
STREAMING = ("min_max._min_max_kernel", "flatten._flatten_kernel", "accumulate_sq._sum_sq_kernel")

# One known miss, bounded instead: with g_idx the columns are gathered, and
# triton 3.6 lays a gathered tile's rows across threads (3.9 across registers),
# so every element loads its column from the permutation (3.9: one load per
# column for a thread's rows): 12.3 per bf16 element at 14336 x 4096 (3.9: 7.8).
GATHER_36_BOUND = 13.0


def _held(probe):
    variants = {v["key"]: v for v in probe["variants"]}
    return [(row, variants[row["key"]]) for row in probe["launches"]
            if row["targets"] and row["kernel"] in STREAMING]


def _target(probe, row, variant):
    from obskernels.tools.kernel_report.machine import TARGETS

    target = TARGETS[row["elem_bytes"]]
    if probe["triton"].startswith("3.6") and variant["constexprs"].get("GATHER"):
        target = max(target, GATHER_36_BOUND)
    return target


def test_streaming_kernels_within_instruction_targets(probe):
    held = _held(probe)
    assert {row["kernel"] for row, _ in held} == set(STREAMING), "a streaming kernel has no real-size case"
    bad = []
    for row, v in held:
        assert row["sass_per_elem_program"] is not None, f"{row['case']}: no program model"
        target = _target(probe, row, v)
        if row["sass_per_elem_program"] > target:
            bad.append(f"{row['kernel']} ({row['case']}; {v['variant']}): "
                       f"{row['sass_per_elem_program']:.1f} SASS per element > {target}")
    assert not bad, "\n".join(bad)


def test_real_size_cases_reach_every_layout_mode(probe):
    # every mode switch a streaming launcher sets, at a real size, in each element size
    seen: dict = {}
    for row, v in _held(probe):
        for name, value in v["constexprs"].items():
            seen.setdefault((row["kernel"], name), set()).add(value)
        seen.setdefault((row["kernel"], "elem_bytes"), set()).add(row["elem_bytes"])
    want = {
        ("min_max._min_max_kernel", "PAD"): {False, True},
        ("min_max._min_max_kernel", "GATHER"): {False, True},
        ("min_max._min_max_kernel", "GROUP_LOOP"): {False, True},
        ("min_max._min_max_kernel", "ROW_LEVELS"): {0, 1},
        ("min_max._min_max_kernel", "MODE"): {0, 1, 2},
        ("min_max._min_max_kernel", "RECORD"): {False, True},
        ("min_max._min_max_kernel", "elem_bytes"): {2, 4},
        ("flatten._flatten_kernel", "PAD"): {False, True},
        ("flatten._flatten_kernel", "GATHER"): {False, True},
        ("flatten._flatten_kernel", "elem_bytes"): {2, 4},
        ("accumulate_sq._sum_sq_kernel", "ADD"): {False},
        ("accumulate_sq._sum_sq_kernel", "elem_bytes"): {2, 4},
    }
    missing = {k: sorted(w - seen.get(k, set()), key=str) for k, w in want.items() if w - seen.get(k, set())}
    assert not missing, f"no real-size case reaches {missing}"


def test_approximate_and_libdevice_only_where_allowed(probe):
    bad = []
    for v in _ok(probe):
        allowed = (ALLOWED_FAST if v["fast"] else ALLOWED).get(v["kernel"], _EXACT)
        extra_a = set(v["approx"]) - allowed["approx"]
        extra_l = set(v["libdevice"]) - allowed["libdevice"]
        if extra_a or extra_l:
            bad.append(f"{_name(v)}: approx {sorted(extra_a)}, libdevice {sorted(extra_l)}")
    assert not bad, "\n".join(bad)


def test_no_extern_elementwise(probe):
    # extern calls (tl.extra.libdevice.*) do not run in the interpreter (docs/spec.md §6):
    # only the GPU arithmetic (FAST), which the interpreter never runs, may call one
    bad = [_name(v) for v in _ok(probe) if v["extern"] and not v["fast"]]
    assert not bad, f"extern elementwise calls in: {bad}"


def test_gpu_and_interpreter_arithmetic_both_compile(probe):
    # the search kernels are compiled with the GPU's arithmetic (what a CUDA
    # tensor runs) and with the interpreter's exact emulation
    search = [v for v in _ok(probe) if v["kernel"].endswith("._search_kernel")]
    assert {v["fast"] for v in search} == {True, False}


def test_search_loop_is_counted(probe):
    # the search kernels' step loop is found and counted per element and step
    search = [v for v in _ok(probe) if v["kernel"].endswith(("._search_kernel", "._search_part_kernel"))]
    assert search
    bad = [_name(v) for v in search if v["loop"] != "step" or not v["sass_per_elem_step"] > 0]
    assert not bad, bad
    for v in search:
        assert sum(v["pipes"].values()) == pytest.approx(v["sass_per_elem_step"])


def test_streaming_hot_loop_is_the_main_loop(probe):
    # a streaming kernel's reported loop is its main loop, the one its program
    # model prices (one step of it, ptxas unrolling it U times), not a larger
    # loop run rarely (the non-finite counting, the finishing of a split:
    # every split variant has one)
    streaming = [v for v in _ok(probe) if v["kernel"] in STREAMING and v["loop"] == "tile"]
    assert any(v["constexprs"].get("FINISH") for v in streaming), "no split variant probed"
    bad = []
    for v in streaming:
        step = sum(v["program_loop"].values())
        if not (step > 0 and v["loop_sass"] / step == pytest.approx(round(v["loop_sass"] / step))):
            bad.append(f"{_name(v)}: loop of {v['loop_sass']} vs a main-loop step of {step:.1f}")
    assert not bad, "\n".join(bad)


def test_search_keeps_enough_warps_resident(probe):
    # registers, shared memory and block size together: a latency-bound step
    # needs other warps to issue while one waits
    bad = [f"{_name(v)}: {v['warps_per_sm']} warps per SM ({v['registers']} registers, "
           f"{v['num_warps']} warps per block)" for v in _ok(probe)
           if v["kernel"].startswith("mse_search.") and v["warps_per_sm"] < SEARCH_MIN_WARPS_PER_SM]
    assert not bad, "\n".join(bad)


def test_no_layout_conversion_in_the_search_step_loop(probe):
    # A conversion moves a tile through shared memory at every step (triton
    # 3.6 did so three times per step for the fast pow's table lookup). The
    # one exchange allowed is a group's sum across the warps that hold it
    # (each warp's partial stored and the total read back: 2 shared-memory
    # instructions under triton 3.9, 4 under 3.6). The shared-memory count
    # holds the conversions to account in the machine code itself.
    search = [v for v in _ok(probe) if v["loop"] == "step"]
    assert search
    bad = []
    for v in search:
        if v["loop_conversions"] or v["loop_shared"] > 4 * v["loop_cross_warp"]:
            bad.append(f"{_name(v)}: {v['loop_conversions']} layout conversions, "
                       f"{v['loop_shared']} shared-memory instructions, "
                       f"{v['loop_cross_warp']} reductions across warps in the step loop")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("tag", ("params-small", "params-split"))
def test_search_parameters_do_not_recompile(probe, tag):
    # one variant per kernel, and per value of the register path's TRACK
    # switch (patience >= steps: the search cannot stop early, and each group
    # keeps its last improving step instead of storing improvement bits)
    per_kernel: dict[str, set] = {}
    tracks: dict[str, set] = {}
    for launch in probe["launches"]:
        if launch["tag"] == tag:
            track = re.search(r"\bTRACK=(\d)", launch["variant"])
            kernel = f"{launch['kernel']} TRACK={track.group(1) if track else '-'}"
            per_kernel.setdefault(kernel, set()).add(launch["key"])
            tracks.setdefault(launch["kernel"], set()).add(kernel)
    assert per_kernel, f"no launches tagged {tag}"
    many = {k: len(v) for k, v in per_kernel.items() if len(v) != 1}
    assert not many, f"{tag}: compiled variants per kernel {many} (want 1 each)"
    if tag == "params-small":  # patience 1000 over 111 steps, and smaller ones: both
        assert len(tracks["mse_search._search_kernel"]) == 2, tracks


# --------------------------------------------------------------------------- #
# the SASS reader itself, on a hand-written listing
# --------------------------------------------------------------------------- #
_LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MOV R2, RZ ;
        /*0020*/                   FFMA R3, R2, R2, R3 ;
        /*0030*/                   IMAD R4, R4, 0x2, RZ ;
        /*0040*/                   MUFU.EX2 R5, R3 ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   SHFL.BFLY PT, R6, R5, 0x1, 0x1f ;
        /*0070*/                   STG.E [R8.64], R6 ;
        /*0080*/                   EXIT ;
"""


def test_sass_reader_finds_the_loop_and_pipes():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    instrs = report.parse_sass(_LISTING)
    assert [op for _, op, _ in instrs][:3] == ["LDC", "MOV", "FFMA"]
    assert report.hot_loop(instrs) == (2, 5)  # FFMA .. BRA
    assert [report.pipe_of(op) for _, op, _ in instrs[2:8]] == ["FP32", "INT", "MUFU", "other", "LSU", "LSU"]


# a main loop unrolled by 2 (two loads, two stores per pass), its remainder
# loop (one of each), and a cold loop further on (a load, no store)
_UNROLLED = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   STG.E.128 desc[UR4][R8.64], R4 ;
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64+0x10] ;
        /*0040*/                   STG.E.128 desc[UR4][R8.64+0x10], R4 ;
        /*0050*/               @P0 BRA 0x10 ;
        /*0060*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0070*/                   STG.E.128 desc[UR4][R8.64], R4 ;
        /*0080*/               @P1 BRA 0x60 ;
        /*0090*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00a0*/               @P2 BRA 0xd0 ;
        /*00b0*/                   LDG.E R6, desc[UR4][R2.64] ;
        /*00c0*/               @P3 BRA 0xb0 ;
        /*00d0*/                   EXIT ;
        /*00e0*/                   BRA 0xe0 ;
"""


def test_program_path_counts_one_step_of_an_unrolled_loop():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    instrs = report.parse_sass(_UNROLLED)
    assert report.loops_of(instrs) == [(1, 5), (6, 8), (11, 12)]  # the trap at 0xe0 is no loop
    main, once = report.program_path(instrs)
    assert main == (1, 5) and report.unroll_factor(instrs, main) == 2
    # once: the prologue, the code between the loops and the exit; neither the
    # remainder nor the cold loop
    assert [instrs[i][1] for i in once] == ["LDC", "IADD3", "BRA", "EXIT", "BRA"]


# a streaming program's common path and what is off it: the main loop; a
# redo in float64 behind a forward branch (with a call to division's slow
# path inside it); a plain if (no float64: counted); a forward branch
# skipping float64 code AND an exit (not a rare block: counted); the exit,
# then a subroutine reached by CALL (up to its RET, not counted), code that
# nothing calls (counted) and the trap
_COMMON = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0020*/                   FMNMX R5, R5, R4, !PT ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/               @!P4 BRA 0xa0 ;
        /*0050*/                   F2F.F64.F32 R6, R5 ;
        /*0060*/                   DFMA R8, R6, R6, 1 ;
        /*0070*/              @P3 BRA P4, 0x90 ;
        /*0080*/                   CALL.REL.NOINC 0x120 ;
        /*0090*/                   F2F.F32.F64 R5, R8 ;
        /*00a0*/              @!P1 BRA 0xc0 ;
        /*00b0*/                   FADD R5, R5, 1 ;
        /*00c0*/                   STG.E desc[UR4][R2.64], R5 ;
        /*00d0*/              @P2 BRA 0x110 ;
        /*00e0*/                   DADD R10, R8, R8 ;
        /*00f0*/                   EXIT ;
        /*0100*/                   MUFU.RCP R7, R5 ;
        /*0110*/                   EXIT ;
        /*0120*/                   DMUL R12, R6, R6 ;
        /*0130*/                   RET.REL.NODEC R20 0x0 ;
        /*0140*/                   MUFU.RSQ R13, -QNAN ;
        /*0150*/                   RET.REL.NODEC R22 0x0 ;
        /*0160*/                   BRA 0x160 ;
"""


def test_program_path_leaves_out_division_slow_paths_and_the_float64_redo():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    instrs = report.parse_sass(_COMMON)
    assert report.subroutines(instrs) == [(18, 19)]  # only the CALLed one, to its RET
    # the redo (0x50-0x90); not the range skipped at 0xd0, which holds an EXIT
    assert report.float64_branches(instrs) == [(5, 9)]
    main, once = report.program_path(instrs)
    assert main == (1, 3)
    assert [instrs[i][0] for i in once] == [
        0x00, 0x40, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x100, 0x110, 0x140, 0x150, 0x160]


_TTGIR = """
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [2, 16], warpsPerCTA = [4, 1], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, 4], order = [1, 0]}>
module {
  tt.func public @k() {
    %a = scf.for %w = %c0 to %n step %c1 iter_args(%x = %x0) -> (i32) : i32 {
      %b = scf.for %i = %c0 to %m step %c1 iter_args(%y = %y0) -> (i32) : i32 {
        %c = ttg.convert_layout %t : tensor<32x128xf32, #blocked> -> tensor<32x128xf32, #blocked1>
        %s = "tt.reduce"(%c) <{axis = 1 : i32}> ({
        ^bb0(%p: f32, %q: f32):
          %r = arith.addf %p, %q : f32
          tt.reduce.return %r : f32
        }) : (tensor<32x128xf32, #blocked1>) -> tensor<32xf32, #ttg.slice<{dim = 1, parent = #blocked1}>>
        %u = "tt.reduce"(%t) <{axis = 1 : i32}> ({
        ^bb0(%p: f32, %q: f32):
          %r = arith.addf %p, %q : f32
          tt.reduce.return %r : f32
        }) : (tensor<32x128xf32, #blocked>) -> tensor<32xf32, #ttg.slice<{dim = 1, parent = #blocked}>>
        scf.yield %y : i32
      }
      %d = ttg.convert_layout %t2 : tensor<32xi32, #blocked2> -> tensor<32xi32, #blocked3>
      scf.yield %x : i32
    }
    tt.return
  }
}
"""


def test_ttgir_reader_finds_the_step_loop_conversions_and_cross_warp_sums():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    loop = report.ttgir_hot_loop(_TTGIR)
    assert loop and "%b = scf.for" in loop[0] and "scf.yield %y" in loop[-2]
    # the outer loop's conversion is not the step loop's
    assert sum("ttg.convert_layout" in line for line in loop) == 1
    # #blocked1 spreads the 128 columns over 4 warps; #blocked keeps a row in one warp
    assert report.cross_warp_reductions(_TTGIR, loop) == 1
    assert report.ttgir_hot_loop("%x = arith.addf %a, %b : f32") == []


_TWO_LOOPS = """\
    %a = scf.for %i = %c0 to %n step %c1 iter_args(%x = %x0) -> (f32) : i32 {
      %v = tt.load %p : tensor<128x!tt.ptr<f32>, #blocked>
      scf.yield %x : f32
    }
    %b = scf.for %j = %c0 to %s step %c1 iter_args(%y = %y0) -> (f32) : i32 {
      %w = arith.addf %y, %y : f32
      %z = arith.subf %w, %y : f32
      %q = arith.mulf %z, %y : f32
      scf.yield %q : f32
    }
"""


def test_ttgir_reader_takes_a_streaming_kernels_first_loading_loop():
    # a split's finishing loop (no load of the value; larger) is not the
    # streaming kernel's hot loop; for the other kernels the largest loop is
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    assert "%b = scf.for" in report.ttgir_hot_loop(_TWO_LOOPS)[0]
    assert "%a = scf.for" in report.ttgir_hot_loop(_TWO_LOOPS, streaming=True)[0]


def test_a_one_element_conversion_moves_nothing():
    # triton 3.6 converts a split search's per-row scalars (tensor<1x1>)
    # between two layouts of one element, which every thread holds whole:
    # no data moves (no shared memory), so not a conversion that counts
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    one = "%y = ttg.convert_layout %l : tensor<1x1xf32, #blocked3> -> tensor<1x1xf32, #blocked4> loc(#loc9)"
    tile = "%c = ttg.convert_layout %t : tensor<32x128xf32, #blocked> -> tensor<32x128xf32, #blocked1>"
    row = "%d = ttg.convert_layout %t2 : tensor<32xi32, #blocked2> -> tensor<32xi32, #blocked3>"
    assert not report.moving_conversion(one)
    assert report.moving_conversion(tile) and report.moving_conversion(row)
    assert not report.moving_conversion("%r = arith.addf %p, %q : f32")


def test_resident_warps():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    # 65536 registers per SM, allocated per warp in units of 256
    assert report.warps_per_sm(96, 1024, 4) == 20
    assert report.warps_per_sm(96, 1024, 8) == 16
    assert report.warps_per_sm(153, 16384, 8) == 8  # the triton 3.6 search before the fix
    assert report.warps_per_sm(32, 0, 4) == 64
    assert report.warps_per_sm(32, 100_000, 4) == 8  # two blocks' shared memory per SM


def test_issue_time_takes_the_slowest_pipe():
    report = pytest.importorskip("obskernels.tools.kernel_report.machine")
    rate = 1e12
    # 8 MUFU per element at 1/8 rate: 64 issue slots' worth, more than 10 FP32
    t = report.issue_seconds({"FP32": 10, "INT": 0, "MUFU": 8, "LSU": 0, "other": 0}, 1e6, rate)
    assert t == pytest.approx(8 * 8 * 1e6 / rate)
    t = report.issue_seconds({"FP32": 100, "INT": 10, "MUFU": 1, "LSU": 0, "other": 0}, 1e6, rate)
    assert t == pytest.approx(111 * 1e6 / rate)


def test_report_cli_json_lines():
    """``python -m obskernels.tools.kernel_report --json``: one object per variant
    with the documented fields (flatten's cases only, to stay quick)."""
    env = compiling_env()
    proc = subprocess.run(
        [sys.executable, "-m", "obskernels.tools.kernel_report", "--json", "--module", "flatten"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and all(r["kernel"] == "flatten._flatten_kernel" for r in rows)
    for r in rows:
        for key in ("kernel", "variant", "registers", "spills", "shared", "sass_per_elem_step", "pipes",
                    "warps_per_sm", "loop_shared", "loop_conversions", "loop_cross_warp",
                    "sass_per_elem_program", "pipes_program", "program_trips", "program_elems"):
            assert key in r, f"{key} missing from {sorted(r)}"
        assert set(r["pipes"]) == {"FP32", "INT", "MUFU", "LSU", "other"}
        assert r["registers"] > 0 and r["sass_per_elem_step"] > 0
        assert r["sass_per_elem_program"] == pytest.approx(sum(r["pipes_program"].values()))
        assert r["program_elems"] > 0 and r["sass_per_elem_program"] > 0
