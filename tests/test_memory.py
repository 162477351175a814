"""Peak extra memory of one call: the triton path holds O(groups), the reference O(value).

Measured with the harness's ``peak_memory`` (bench/traffic.py): tensor storage
created during the call and alive at once, inputs that existed before not
counted, the interpreter's own host copies left out. On a GPU that is what the
launcher allocates (a kernel allocates nothing itself). The instrument is
checked first against allocations of known size.

The MSE search on the triton backend allocates, per group: its two outputs
(min, max in the value's dtype; they hold each group's unshrunk base range
until the choice replaces it) and, when the search can stop early (patience
below the number of steps), the improvement bits (one int32 word per 32 grid
steps): 8 bytes per group for bf16 with the default 20 steps, 12 for fp32.
When it cannot stop early (patience >= steps, as nvfp4_expanded's 1000 over
111 steps) the outputs alone: 4 bytes per bf16 group. Bound used here: 12
bytes per group + 256. Measured (this machine, CPU, triton's interpreter),
int4 group 128 on a 1024 x 1024 weight (8,192 groups):
- triton: 67,584 B for bf16 (3.2% of the 2 MiB value: the two outputs
  1.56%, the bits as much, one flag word per program), 100,352 B for fp32
  (2.4% of 4 MiB); with the base in a [2, G] fp32 buffer of its own it was
  131,076 B and 163,844 B;
- reference: 10,649,600 B for bf16 (5.08 x the value), 21,282,816 B for fp32
  (5.07 x): candidate ranges, quotients and errors of whole steps are tensors
  the size of the value.
Whole observer calls (the harness's rows, bf16 128 x 1024, each op's storage
freed when it returns, as on a GPU): nvfp4_expanded_mse on NVFP4 groups of 16
went from 87.7% of the weight to 28.2% (the held statistics, 12.5%, and
calculate_qparams' fp32 scales and zero points); the search itself now holds
the outputs only. (Triton's interpreter keeps each launch's arguments in
reference cycles until the next garbage collection, so the harness's CPU rows
can show a launch's scratch a little longer than a GPU holds it.)
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels import ops, use_backend
from obskernels.bench.traffic import peak_memory

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not (INTERPRETER and importlib.util.find_spec("triton")),
    reason="CPU peaks of the triton path are taken in triton's interpreter (TRITON_INTERPRET=1)",
)
SEARCH = dict(maxshrink=0.20, patience=5, grid=100, norm=2.4)  # memoryless_mse defaults
PER_GROUP_BOUND = 12
CONSTANT_BOUND = 256


def _args(group_size):
    return QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=group_size)


def _peak(backend, value, group_size):
    with use_backend(backend):
        with peak_memory("cpu") as counts:
            out = ops.mse_search(value, "weight", _args(group_size), **SEARCH)
    return counts.peak_bytes, out


def test_peak_memory_counts_what_is_created_and_alive():
    before = torch.randn(1000)
    with peak_memory("cpu") as counts:
        a = torch.empty(1000)  # 4,000 B
        b = torch.ones(500)  # 2,000 B: 6,000 alive
        del a
        c = torch.zeros(250, dtype=torch.float64)  # 2,000 B: 4,000 alive
        before.add_(1)  # in place on an input: nothing new
        view = before[:10]  # a view: nothing new
    assert counts.peak_bytes == 6000, counts.peak_bytes
    del b, c, view


@needs_interpreter
@pytest.mark.kernel
def test_interpreter_copies_are_not_counted():
    import triton
    import triton.language as tl

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    x = torch.ones(4096)
    with peak_memory("cpu") as counts:
        double[(4,)](x, 4096, BLOCK=1024)
    assert counts.peak_bytes == 0  # the kernel works in place; its host copies are the interpreter's
    assert torch.equal(x, torch.full((4096,), 2.0))


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_search_memory_grows_with_groups_not_elements(dtype):
    """Same group structure, then the same elements in 4x the groups: the
    peak is one cost per group (affine in the group count) within the bound,
    and the reference's grows with the value."""
    g = torch.Generator().manual_seed(0)
    shapes = {  # (rows, cols, group) -> groups
        (8, 1024, 128): 64,
        (16, 1024, 128): 128,
        (16, 1024, 32): 512,
    }
    peaks = {}
    for (rows, cols, group), groups in shapes.items():
        value = torch.randn(rows, cols, generator=g).to(dtype)
        peak, (mn, mx) = _peak("triton", value, group)
        assert mn.shape == (rows, cols // group)
        peaks[groups] = peak
        assert peak <= PER_GROUP_BOUND * groups + CONSTANT_BOUND, (
            f"{rows}x{cols} group {group} ({groups} groups): {peak} B > "
            f"{PER_GROUP_BOUND} B per group + {CONSTANT_BOUND}"
        )
        ref_peak, _ = _peak("reference", value, group)
        assert ref_peak >= 4 * value.numel() * value.element_size(), (ref_peak, value.shape)
    # affine in groups, up to the search's per-program step flags (one int32
    # word per program and 32 steps: a few programs here, at most 64 B)
    per_group = (peaks[512] - peaks[128]) // (512 - 128)
    assert per_group > 0
    for groups, peak in peaks.items():
        assert 0 <= peak - per_group * groups <= 64, (peaks, per_group)
    # the outputs (min, max) are part of it: at least 2 x element size per group
    assert per_group >= 2 * torch.finfo(dtype).bits // 8


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("patience,grid", [(1000, 200), (5, 25)])
def test_search_that_cannot_stop_early_allocates_its_outputs_only(dtype, patience, grid):
    """patience >= steps (nvfp4_expanded: 1000 over 111 steps; here also 5
    over 5): no per-step history and no base buffer, the peak of a call is
    exactly the two outputs. With patience below the steps the bits come on top: one
    int32 word per group and 32 steps (plus one per program)."""
    g = torch.Generator().manual_seed(2)
    value = torch.randn(16, 512, generator=g).to(dtype)
    groups = 16 * 512 // 16
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=16)
    kw = dict(maxshrink=0.2, patience=patience, grid=grid, norm=2.4)  # 40 or 5 steps
    steps = int(kw["maxshrink"] * grid)
    mse_module = importlib.import_module("obskernels.kernels.mse_search")
    mse_module._shrink_table.cache_clear()  # made by this test's first call
    with use_backend("triton"):
        with peak_memory("cpu") as first:
            ops.mse_search(value, "weight", args, **kw)
        with peak_memory("cpu") as counts:  # the signature's launch prepared
            mn, mx = ops.mse_search(value, "weight", args, **kw)
    # a signature's first call also makes its prepared launch's output
    # prototypes, one element each, kept with the launch (kernels._layout.allocator):
    # at most 4 (outputs, bits, flags) of at most 4 bytes; and the first
    # call of a (device, grid, steps) the steps' shrink table, 4 bytes a step
    extra = first.peak_bytes - counts.peak_bytes
    assert 0 <= extra <= 16 + 4 * steps, (first.peak_bytes, counts.peak_bytes)
    outputs = 2 * groups * value.element_size()
    assert mn.shape == (16, 32)
    if patience >= steps:
        assert counts.peak_bytes == outputs, (counts.peak_bytes, outputs)
    else:
        words = -(-steps // 32)
        assert outputs + 4 * words * groups <= counts.peak_bytes <= outputs + 4 * words * groups + 64


@needs_interpreter
@pytest.mark.kernel
@pytest.mark.slow
def test_int4_group128_1024x1024_weight():
    """The figures of the module docstring (bf16; the search runs about a
    minute in the interpreter)."""
    value = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    value_bytes = value.numel() * value.element_size()
    groups = 1024 * 1024 // 128
    peak, _ = _peak("triton", value, 128)
    ref_peak, _ = _peak("reference", value, 128)
    assert peak <= PER_GROUP_BOUND * groups + CONSTANT_BOUND, peak
    assert peak <= 0.035 * value_bytes, f"{peak} B is {peak / value_bytes:.2%} of the value"
    assert ref_peak >= 4 * value_bytes, ref_peak
    print(f"triton {peak} B ({peak / value_bytes:.2%} of the value), reference {ref_peak} B "
          f"({ref_peak / value_bytes:.2f}x)")


@needs_interpreter
@pytest.mark.kernel
def test_harness_records_a_peak_for_triton_rows(tmp_path):
    from obskernels.bench import cases as bench_cases
    from obskernels.bench.runner import Options, run

    case = bench_cases.Case("weight", (16, 256), "bf16", "int4-group128")
    records = run(Options(
        mode="tiny", ops=("mse_search[mse]",), observers=(), backends=("reference", "triton"),
        out=str(tmp_path), cases=[case], min_reps=1, max_reps=1, min_time_s=0.0,
        project_full=False, progress=None,
    ))
    rows = {r["backend"]: r for r in (rec.to_dict() for rec in records) if r["scope"] == "run"}
    tri, ref = rows["triton"], rows["reference"]
    assert tri["status"] == "modelled", tri["status"]
    groups = 16 * 256 // 128
    assert 0 < tri["peak_bytes"] <= PER_GROUP_BOUND * groups + CONSTANT_BOUND, tri["peak_bytes"]
    assert "interpreter" in tri["peak_method"]
    assert ref["peak_bytes"] >= 4 * 16 * 256 * 2
