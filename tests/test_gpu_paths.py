"""The paths a GPU takes, exercised on the CPU: the launch device and work-based splits.

- Every launcher enters a device context for ``value.device`` around its
  launches (Triton launches on the current CUDA device and stream, which may
  not be the value's device in a model spread over GPUs). (Tensors of one
  call on different devices are a ValueError of the checked call:
  tests/test_bad_input.py.)
- The work split (programs sharing one group) follows the amount of work, not
  the device's SM count, so a call splits the same way on every GPU and under
  the interpreter: the split and its finishing a GPU runs at a given shape
  run here at that shape, with the default configuration.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from obskernels.reference.accumulate_sq import accumulate_sq as reference_accumulate
from obskernels.reference.min_max import min_max as reference_min_max

from helpers import call_backend

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

layout_module = importlib.import_module("obskernels.kernels._layout")
launch_module = importlib.import_module("obskernels.kernels.launch")
min_max_module = importlib.import_module("obskernels.kernels.min_max")
flatten_module = importlib.import_module("obskernels.kernels.flatten")
accumulate_module = importlib.import_module("obskernels.kernels.accumulate_sq")
mse_module = importlib.import_module("obskernels.kernels.mse_search")
qparams_module = importlib.import_module("obskernels.kernels.qparams")
stats_module = importlib.import_module("obskernels.kernels.stats")

# every launched kernel of kernels/ (the report's discovery: a new kernel is
# watched without editing this file)
KERNELS = {}
for _module, _name in importlib.import_module("obskernels.tools.kernel_report.launches").discover_kernels().values():
    KERNELS.setdefault(_module, []).append(_name)


class DeviceProbe:
    """Stands in for ``_layout._device_context``: records the device entered
    and whether a context is active; kernels wrapped by ``watch`` record
    whether each launch happened inside one."""

    def __init__(self):
        self.entered, self.depth, self.launches = [], 0, []

    @contextlib.contextmanager
    def __call__(self, device):
        self.entered.append(device)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def watch(self, module, name, monkeypatch):
        kernel = getattr(module, name, None)
        if kernel is None:  # a kernel this revision does not have
            return
        probe = self

        class Watched:
            def __getitem__(self, grid):
                probe.launches.append((name, probe.depth > 0))
                return kernel[grid]

        monkeypatch.setattr(module, name, Watched())


def _calls():
    qa = QuantizationArgs
    x = torch.randn(19, 40)
    imp = torch.rand(40) + 0.5
    nvfp4 = qa(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
               scale_dtype=torch.float8_e4m3fn)
    return {
        "min_max": lambda: call_backend(min_max_module.min_max, x, "weight", qa(num_bits=8, strategy="channel")),
        "min_max split": lambda: call_backend(min_max_module.min_max,
            torch.randn(300, 512), "weight", qa(num_bits=8, strategy="tensor")),
        "flatten": lambda: call_backend(flatten_module.flatten_for_calibration,
            x, "weight", qa(num_bits=8, strategy="block", block_structure=[8, 16])),
        "accumulate_sq": lambda: call_backend(accumulate_module.accumulate_sq,
            torch.randn(2, 5, 40), torch.zeros(40), torch.zeros(1, dtype=torch.int64)),
        "mse_search": lambda: call_backend(mse_module.mse_search,
            x, "weight", qa(num_bits=4, strategy="group", group_size=8),
            maxshrink=0.2, patience=5, grid=20, norm=2.4),
        "mse_search imatrix split": lambda: _split_search(x, imp),
        "calculate_qparams fused": lambda: call_backend(qparams_module.calculate_qparams,
            torch.zeros(4, 2), torch.ones(4, 2), nvfp4, fused=[(torch.zeros(4, 2), torch.ones(4, 2))]),
        "combine_statistics": lambda: call_backend(stats_module.combine_statistics,
            x, "weight", qa(num_bits=8, strategy="channel"), torch.zeros(19, 1), torch.ones(19, 1),
            held=(torch.zeros(19, 1), torch.ones(19, 1))),
    }


def _split_search(x, imp):
    with launch_module.launch_config(max_reg_group=16, chunk=16, split=2):
        return call_backend(mse_module.mse_search,
            x, "weight", QuantizationArgs(num_bits=8, strategy="channel"), importance=imp,
            maxshrink=0.95, patience=5, grid=4, norm=3.0, flavour="imatrix")


@pytest.mark.parametrize("call", list(_calls()))
def test_every_launch_runs_on_the_values_device(call, monkeypatch):
    probe = DeviceProbe()
    # a launch's context: on_device's (per call) or launch_context's (prepared
    # with the launch, imported by the launcher)
    monkeypatch.setattr(layout_module, "_device_context", probe)
    for module, names in KERNELS.items():
        if hasattr(module, "launch_context"):
            monkeypatch.setattr(module, "launch_context", lambda device: functools.partial(probe, device))
        for name in names:
            probe.watch(module, name, monkeypatch)
    _calls()[call]()
    assert probe.entered and all(d == torch.device("cpu") for d in probe.entered), probe.entered
    assert probe.launches, f"{call}: no kernel launched"
    outside = [name for name, inside in probe.launches if not inside]
    assert not outside, f"{call}: launched outside the device context: {outside}"


@pytest.mark.parametrize("current", [0, 1])
def test_device_context_is_the_values_cuda_device(current, monkeypatch):
    """A launch on cuda:1 runs in a ``torch.cuda.device(1)`` block, or in no
    block where cuda:1 is already current (the current device stood in for
    where the launcher asks it: asked, never set, so no GPU is needed; a
    CUDA build of torch on a machine without one raises on torch's own)."""
    monkeypatch.setattr(layout_module, "current_cuda_device", lambda: current)
    for context in (layout_module._device_context(torch.device("cuda", 1)),
                    layout_module.launch_context(torch.device("cuda", 1))()):
        if current == 1:
            assert isinstance(context, contextlib.nullcontext)
        else:
            assert isinstance(context, torch.cuda.device) and context.idx == 1  # built, not entered
    for context in (layout_module._device_context(torch.device("cpu")),
                    layout_module.launch_context(torch.device("cpu"))()):
        assert isinstance(context, contextlib.nullcontext)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launches_on_the_values_gpu_not_the_current_one():
    with torch.cuda.device(0):
        x = torch.randn(64, 256, device="cuda:1")
        mins, maxs = call_backend(min_max_module.min_max, x, "weight", QuantizationArgs(num_bits=8, strategy="channel"))
        torch.cuda.synchronize(1)
    assert mins.device == x.device
    assert torch.equal(mins.squeeze(1), x.amin(dim=1)) and torch.equal(maxs.squeeze(1), x.amax(dim=1))


# --------------------------------------------------------------------------- #
# splits follow the work
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("work_rows,row_block,work_per_row,others", [
    (4096, 1, 4096, 1), (10**6, 4, 64, 3), (300, 1, 512, 1), (17, 1, 33, 1), (4096, 8, 4096, 600),
])
def test_split_follows_the_work(work_rows, row_block, work_per_row, others):
    # the split takes no device at all: the same on every GPU and the interpreter
    config = launch_module.LaunchConfig()
    split, per = launch_module.choose_split(work_rows, row_block, work_per_row, others, config)
    assert split * per >= work_rows and (split - 1) * per < work_rows
    # at least min_elems_per_program of work per program, no more programs than the fill target needs
    assert split == 1 or per * work_per_row >= config.min_elems_per_program
    assert split <= max(1, -(-config.fill_programs // others))


def test_default_split_runs_here_min_max():
    """A whole-tensor min/max big enough to split by default: one launch, its
    last program finishing the split, as on a GPU."""
    grids = []

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    x = torch.randn(300, 512, dtype=torch.bfloat16)
    args = QuantizationArgs(num_bits=8, strategy="tensor")
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(min_max_module, "_min_max_kernel", Counting(min_max_module._min_max_kernel))
        got = call_backend(min_max_module.min_max, x, "weight", args)
    finally:
        mp.undo()
    want = call_backend(reference_min_max, x, "weight", args)
    assert len(grids) == 1 and grids[0][1] > 1, grids
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_default_split_runs_here_accumulate_sq():
    x = torch.randn(4, 160, 256)
    s, c = torch.zeros(256), torch.zeros(1, dtype=torch.int64)
    call_backend(accumulate_module.accumulate_sq, x, s, c)
    want = x.double().pow(2).sum(dim=(0, 1))
    torch.testing.assert_close(s.double(), want, rtol=1e-5, atol=0)
    assert int(c) == 640
    s2, c2 = torch.zeros(256), torch.zeros(1, dtype=torch.int64)
    call_backend(reference_accumulate, x, s2, c2)
    assert int(c2) == int(c)


# --------------------------------------------------------------------------- #
# Triton's fp fusion (a * b + c into one FMA on a GPU) is stated by every
# launch: left to its default, triton 3.9 warns at the first compile of the
# process and triton 3.10 builds the kernel unfused. The launches are those of
# the compile report's cases (every kernel of kernels/, the GPU's launch
# launch shape), recorded, none run.
# --------------------------------------------------------------------------- #
def test_every_launch_states_its_fp_fusion():
    from obskernels.tools.kernel_report import probe_cases
    from obskernels.tools.kernel_report.launches import record

    # the interpreter's arithmetic (the recorder's default is the GPU's, which
    # the interpreter refuses); the options are the same
    calls = [(c.name, c.tag, c.module, dict(c.config, gpu_arith=False), c.call) for c in probe_cases.cases()]
    launches = record(calls)
    seen = {launch.kernel.split(".")[-1] for launch in launches}
    assert seen >= {name for names in KERNELS.values() for name in names}, "a kernel no case launches"
    unstated = sorted({(launch.kernel, launch.case) for launch in launches
                       if not isinstance(launch.kwargs.get("enable_fp_fusion"), bool)})
    assert not unstated, f"launches leaving fp fusion to triton's default: {unstated[:5]}"
    # the launches whose fp32 arithmetic must round as torch's separate
    # operations do (docs/spec.md §6) keep it off
    exact = {"mse_search._search_kernel", "mse_search._search_part_kernel",
             "mse_search._choose_kernel", "mse_search._minmax_part_kernel", "qparams._qparams_kernel"}
    fused = sorted({launch.kernel for launch in launches
                    if launch.kernel in exact and launch.kwargs["enable_fp_fusion"]})
    assert not fused, fused
