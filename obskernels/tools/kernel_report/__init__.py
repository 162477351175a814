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
  step loop; the main tile loop of the streaming kernels, the first
  innermost loop that loads, as ``machine.program_path`` finds it, not a
  larger one run rarely such as the non-finite counting or a split's
  finishing; the whole kernel when it has no loop) divided by the elements
  each thread handles per iteration:
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
- for the streaming kernels (min_max, flatten, accumulate_sq, a split's
  finishing included), ``sass_per_elem_program``: the instructions one program
  issues per element of the value it covers, at the case's shape: its main
  loop x the trips the launch's arguments give, plus everything it issues
  once (prologue, the reduction across lanes, the epilogue), per thread,
  divided by the elements per thread (``program_path``: the error paths,
  loops taken only when a slice held NaN or inf, count zero times);
  ``pipes_program`` the same by pipe, which the GPU model's compute term
  uses for those kernels;
- the approximate PTX instructions (``*.approx``, ``div.full``) and libdevice
  functions (``__nv_*`` in the LLVM IR) each variant uses.

The compile check (tests/kernels/test_kernels_compile.py) runs ``probe()`` in a
subprocess and asserts on the same records; the benchmark's GPU model takes
its compute term from ``issue_seconds``. Compiled kernels land in triton's
cache, so a second run recompiles nothing that did not change.

Modules: ``machine`` (the sm_90 hardware: pipes, issue rates, residency,
the instruction targets; reading SASS and TTGIR listings), ``probe_cases``
(the probe's launcher calls), ``launches`` (finding the kernels, recording
their launches), ``variants`` (compiling each variant, per-launch profiles,
``probe()``), ``cli`` (the tables and ``main``); the public names
(``__all__``) are re-exported here.

Importing this package needs triton, never a GPU. ``probe()`` must run without
TRITON_INTERPRET (the interpreter replaces the compiler).
"""

from __future__ import annotations

from obskernels.tools.kernel_report.cli import main
from obskernels.tools.kernel_report.launches import (
    cpu_tensors_recorded,
    discover_kernels,
    record,
    recording,
)
from obskernels.tools.kernel_report.machine import (
    H100_SXM_ISSUE,
    PIPES,
    TARGETS,
    cross_warp_reductions,
    issue_seconds,
    ttgir_hot_loop,
    warps_per_sm,
)
from obskernels.tools.kernel_report.probe_cases import Case, cases
from obskernels.tools.kernel_report.variants import (
    compile_variant,
    launch_work,
    probe,
    profile_launches,
)

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
