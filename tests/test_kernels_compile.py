"""The kernels as an sm_90a GPU runs them, checked without a GPU.

``obskernels.tools.kernel_report`` (run here in a subprocess without
TRITON_INTERPRET) calls every launcher on representative shapes with the
GPU's launch configuration, records each launch (nothing runs), and compiles
each distinct specialisation to a cubin for sm_90a with triton's bundled
ptxas; triton's cache keeps the compiled variants between runs. The tests
assert on what the machine code says:

- every launched kernel of kernels/ is reached by some case, and compiles;
- no spill, no stack or local memory; registers within the budget of the
  kernel family (<= 128: two blocks of 256 threads per SM at least);
- approximate instructions and libdevice functions only where the exactness
  argument below admits them;
- the MSE search compiles one variant per kernel whatever the grid, patience,
  maxshrink, expand and (non-special) norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kernel

# Registers per thread, per kernel family. 128 keeps >= 2 blocks of 8 warps
# (or 4 of 4 warps) resident per SM; memory-bound kernels need the occupancy
# to keep loads in flight.
REGISTER_BUDGET = {"min_max": 128, "flatten": 128, "accumulate_sq": 128, "mse_search": 128}
DEFAULT_REGISTER_BUDGET = 128

# Approximate instructions (PTX) and libdevice functions (LLVM IR) a kernel
# may use, and why the result stays exact in the sense of docs/spec.md §5.
#
# |d|**norm for a general norm (quant_pow.pow_pos) runs exp2(norm * log2(d)):
# libdevice log2f (accurate to ~1 ulp), ex2.approx.ftz.f32 (<= 2 ulp, on the
# reduced argument f in [0, 1), so the flush-to-zero never applies) and an
# exact split of norm * e by fmaf_rn. The per-element error is a few fp32 ulp
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
# function torch's CUDA pow calls (its helpers fadd_rn / isinff / isnanf, and
# the rcp.approx inside powf's own argument reduction) - the same function, so
# the same bits as CUDA torch. Division stays div_rn (bf16: a div_rn reciprocal
# per group and a product, whose bf16 rounding is the quotient's: proved in
# quant.quot_bf16_hw, checked by emulation in test_kernels_quant.py); sqrt
# stays sqrt_rn. No new approximate instruction.
_FAST_POW = {
    "approx": _POW["approx"] | {"lg2.approx.ftz.f32", "rcp.approx.ftz.f32"},
    "libdevice": _POW["libdevice"] | {"powf", "fadd_rn", "isinff", "isnanf"},
}
ALLOWED_FAST = {
    "mse_search._search_kernel": _FAST_POW,
    "mse_search._search_part_kernel": _FAST_POW,
}


@pytest.fixture(scope="module")
def probe():
    env = dict(os.environ, PYTHONSAFEPATH="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "obskernels.tools.kernel_report", "--probe"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ok(probe):
    return [v for v in probe["variants"] if not v["error"]]


def _name(v):
    return f"{v['kernel']} ({v['case']}; {v['variant']})"


def test_every_kernel_is_launched(probe):
    assert probe["kernels"], "no kernel discovered in kernels/"
    missing = sorted(set(probe["kernels"]) - {v["kernel"] for v in probe["variants"]})
    assert not missing, f"no probe case launches {missing}: add one to report.cases()"


def test_every_variant_compiles_to_sm90a(probe):
    bad = [f"{_name(v)}: {v['error']}" for v in probe["variants"] if v["error"]]
    assert not bad, "\n".join(bad)


def test_no_spills_no_local_memory(probe):
    bad = [f"{_name(v)}: stack {v['stack']} B, local {v['local']} B, spill ops "
           f"{v['spills'] - v['stack'] - v['local']}" for v in _ok(probe) if v["spills"]]
    assert not bad, "\n".join(bad)


def test_registers_within_budget(probe):
    bad = []
    for v in _ok(probe):
        budget = REGISTER_BUDGET.get(v["kernel"].split(".")[0], DEFAULT_REGISTER_BUDGET)
        if v["registers"] > budget:
            bad.append(f"{_name(v)}: {v['registers']} registers > {budget}")
    assert not bad, "\n".join(bad)


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


@pytest.mark.parametrize("tag", ("params-small", "params-split"))
def test_search_parameters_do_not_recompile(probe, tag):
    per_kernel: dict[str, set] = {}
    for launch in probe["launches"]:
        if launch["tag"] == tag:
            per_kernel.setdefault(launch["kernel"], set()).add(launch["key"])
    assert per_kernel, f"no launches tagged {tag}"
    many = {k: len(v) for k, v in per_kernel.items() if len(v) != 1}
    assert not many, f"{tag}: compiled variants per kernel {many} (want 1 each)"


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
    report = pytest.importorskip("obskernels.tools.kernel_report")
    instrs = report.parse_sass(_LISTING)
    assert [op for _, op, _ in instrs][:3] == ["LDC", "MOV", "FFMA"]
    assert report.hot_loop(instrs) == (2, 5)  # FFMA .. BRA
    assert [report.pipe_of(op) for _, op, _ in instrs[2:8]] == ["FP32", "INT", "MUFU", "other", "LSU", "LSU"]


def test_issue_time_takes_the_slowest_pipe():
    report = pytest.importorskip("obskernels.tools.kernel_report")
    rate = 1e12
    # 8 MUFU per element at 1/8 rate: 64 issue slots' worth, more than 10 FP32
    t = report.issue_seconds({"FP32": 10, "INT": 0, "MUFU": 8, "LSU": 0, "other": 0}, 1e6, rate)
    assert t == pytest.approx(8 * 8 * 1e6 / rate)
    t = report.issue_seconds({"FP32": 100, "INT": 10, "MUFU": 1, "LSU": 0, "other": 0}, 1e6, rate)
    assert t == pytest.approx(111 * 1e6 / rate)


def test_report_cli_json_lines():
    """``python -m obskernels.tools.kernel_report --json``: one object per variant
    with the documented fields (flatten's cases only, to stay quick)."""
    env = dict(os.environ, PYTHONSAFEPATH="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "obskernels.tools.kernel_report", "--json", "--module", "flatten"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and all(r["kernel"] == "flatten._flatten_kernel" for r in rows)
    for r in rows:
        for key in ("kernel", "variant", "registers", "spills", "shared", "sass_per_elem_step", "pipes"):
            assert key in r, f"{key} missing from {sorted(r)}"
        assert set(r["pipes"]) == {"FP32", "INT", "MUFU", "LSU", "other"}
        assert r["registers"] > 0 and r["sass_per_elem_step"] > 0
