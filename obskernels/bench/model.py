"""The model of a call on a stated GPU, and the compulsory traffic.

The model every backend's ``modelled_s`` uses (``overlap_model``):

    modelled_s = max(host_s - after_s, before_s + gpu_s) + syncs * sync_s + after_s
    gpu_s      = sum over launches of max(bytes_i / bandwidth, compute_i)
    host_s     = host_units * host_unit_s + triton_launches * triton_launch_s
    before_s   = the host time until the first Triton launch (+ its issue)
    after_s    = the host time after the call's last read, where a read
                 (a sync) has no launch after it; 0 otherwise

The host issues work while the GPU runs earlier work, so host time and GPU
time overlap; the GPU cannot start before the host reaches the first launch
(an observer is constructed and checks its input first), a read of a device
value (an observer's one read of its status, in ``get_qparams``) waits until
the GPU is done, and what the host does after that read comes after both.
``host_units`` is the call's host path measured on the running machine with
every launch stubbed (``hostcost.measure``: units of a one-element CPU
``add_``; each call right after the other library's, as the lead rows take
turns, where llm-compressor is installed), scaled by the GPU host's unit (a small torch CUDA op: 10 us on
the H100 host); each Triton launch adds its issue cost (17 us there).
Without a host measurement the host is ``aten_ops * aten_op_s +
triton_launches * triton_launch_s``. A host sync (``.item()``, ``.tolist()``)
drains the queue and costs a round trip.

``compute_i``: for an aten op, one lane per element of its largest operand at
the fp32 rate; for a Triton launch, the SASS its variant issues on sm_90a
(``obskernels.tools.kernel_report``: instructions per element and step by pipe
x the launch's element-steps, at 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz,
INT at 1/2, MUFU and conversions at 1/8, load/store and shuffles at 1/4),
divided by the issue efficiency its occupancy allows (``issue_efficiency``),
or, where no SASS profile is at hand, the interpreter's arithmetic lanes at
the fp32 rate (a proxy: it counts index math and misses the emulation's real
cost) -- the ``modelled_lanes_s`` column always uses that proxy.

Default GPU: H100 SXM, 3.35 TB/s HBM3, 67 TFLOP/s fp32 (non-tensor-core),
33.45e12 lane-instructions/s issued, 10 us per host sync; host: 10 us per
unit and per aten op, 17 us per Triton launch (measured on the H100 host).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from obskernels.bench.records import Model, Traffic

__all__ = [
    "GpuModel",
    "H100_SXM",
    "issue_efficiency",
    "host_seconds",
    "overlap_model",
    "compulsory_bytes",
    "affine_extrapolate",
    "model_call",
    "MODEL",
    "MODEL_LANES",
]


@dataclass(frozen=True)
class GpuModel:
    name: str = "H100 SXM"
    bandwidth: float = 3.35e12  # bytes / s
    fp32_flops: float = 67e12  # lanes / s
    issue_rate: float = 132 * 4 * 32 * 1.98e9  # lane-instructions / s (SASS)
    sync_s: float = 10e-6
    host_unit_s: float = 10e-6  # the GPU host's unit: a small torch CUDA op
    triton_launch_s: float = 17e-6  # issuing a bare Triton launch
    aten_op_s: float = 10e-6  # an aten op, where the host path was not measured

    def describe(self) -> str:
        return (
            f"{self.name}: {self.bandwidth / 1e12:g} TB/s, {self.fp32_flops / 1e12:g} "
            f"TFLOP/s fp32, {self.issue_rate / 1e12:.1f}e12 SASS lane-instr/s, "
            f"host {self.host_unit_s * 1e6:g} us/unit, {self.triton_launch_s * 1e6:g} us/Triton "
            f"launch, {self.aten_op_s * 1e6:g} us/aten op (unmeasured host), {self.sync_s * 1e6:g} us/sync"
        )


H100_SXM = GpuModel()

# Occupancy -> issue efficiency: an SM issues from the warps resident on its
# 4 schedulers; with few warps per scheduler the search's dependent arithmetic
# stalls it. Calibrated on the H100 (ncu): the search at 153 registers x 8
# warps (one block per SM, 2 warps per scheduler) kept the issue slots 45 %
# busy; llm-compressor's search at 12 warps per scheduler, 92 %: the most
# any warp count reached, the plateau (the H200 then ran obskernels' search
# kernels, 9-10 warps per scheduler, at 63-86 % of the full rate).
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
WARPS_TO_HIDE_LATENCY = 4.5  # per scheduler
MAX_ISSUE_EFFICIENCY = 0.92


def issue_efficiency(registers: int, warps: int) -> float:
    """Share of the issue rate a kernel of ``registers`` per thread and
    ``warps`` per block reaches (``MAX_ISSUE_EFFICIENCY`` with enough
    resident warps)."""
    per_warp = -(-registers * 32 // 256) * 256  # registers are allocated 256 per warp at a time
    blocks = min(REGISTERS_PER_SM // max(per_warp * warps, 1), MAX_WARPS_PER_SM // warps, 32)
    return min(MAX_ISSUE_EFFICIENCY, max(blocks, 1) * warps / 4 / WARPS_TO_HIDE_LATENCY)


def _aliases(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    try:
        ptr = t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return any(ptr == i.untyped_storage().data_ptr() for i in inputs)


def compulsory_bytes(
    reads: Sequence[torch.Tensor],
    writes: Sequence[Optional[torch.Tensor]],
    *,
    updated: Sequence[torch.Tensor] = (),
) -> int:
    """The traffic no implementation can avoid: every input read once, every
    output written once.

    ``reads``: the tensors the call must read (the value; an importance vector).
    ``writes``: what it returns. An output that is a view of an input (the
    flattening of a contiguous value for every strategy but BLOCK) costs nothing,
    and a call whose every output is such a view needs no traffic at all (0).
    ``updated``: buffers updated in place (read once and written once).
    """
    outs = [t for t in writes if isinstance(t, torch.Tensor)]
    fresh = [t for t in outs if not _aliases(t, reads)]
    if outs and not fresh and not updated:
        return 0
    total = sum(t.numel() * t.element_size() for t in reads)
    total += sum(t.numel() * t.element_size() for t in fresh)
    total += 2 * sum(t.numel() * t.element_size() for t in updated)
    return int(total)


def affine_extrapolate(points: Dict[int, float], n: int) -> float:
    """Value at ``n`` of the line through two (size, value) points (a + b * size).

    Exact when a count is a constant plus a part proportional to the element
    count, which holds for the kernels' traffic when the reduced shapes keep the
    group structure (whole groups, whole blocks, full row width).
    """
    if len(points) == 1:
        ((n0, v0),) = points.items()
        return v0 * n / n0
    (n0, v0), (n1, v1) = sorted(points.items())[:2]
    slope = (v1 - v0) / (n1 - n0)
    return v0 + slope * (n - n0)


def host_seconds(per_launch: Sequence, gpu: GpuModel = H100_SXM,
                 host: Optional[Dict] = None) -> Tuple[float, float, float]:
    """(host seconds of the call, host seconds before the GPU has work, host
    seconds after the call's last read, which waits for the GPU: 0 where
    the measurement has none).

    ``host``: ``hostcost.measure``'s record (None: not measured; then each aten
    op and Triton launch costs its issue time). A PyTorch path (no Triton
    launch) whose op count differs between the measured shape and this one
    (a search stopping earlier on small data) is scaled by the op counts."""
    aten = sum(1 for k, *_ in per_launch if k == "aten")
    tri = sum(1 for k, *_ in per_launch if k == "triton")
    if host is None:
        return aten * gpu.aten_op_s + tri * gpu.triton_launch_s, 0.0, 0.0
    scale = aten / host["aten_ops"] if not tri and aten and host.get("aten_ops") else 1.0
    host_s = host["units"] * scale * gpu.host_unit_s + tri * gpu.triton_launch_s
    before = host.get("before_units")
    before_s = 0.0 if before is None or not tri else before * gpu.host_unit_s + gpu.triton_launch_s
    after = host.get("after_units")
    after_s = 0.0 if after is None or not tri else after * gpu.host_unit_s
    return host_s, before_s, after_s


def overlap_model(per_launch: Sequence, syncs: int, gpu: GpuModel = H100_SXM,
                  triton_compute: Optional[Sequence[Optional[float]]] = None,
                  host: Optional[Dict] = None) -> Dict:
    """The model above for one call.

    per_launch: [kind ("aten" | "triton"), name, bytes, lanes] in issue order;
    triton_compute: seconds of each Triton launch from its SASS (in order of
    the Triton launches; None entries and missing ones fall back to lanes);
    host: the measured host path (``host_seconds``).
    Returns modelled_s, gpu_s, host_s, before_s, sync_s, bound ("memory",
    "compute", "host" or "sync") and the compute source.
    """
    sass = list(triton_compute or [])
    gpu_s = mem_s = comp_s = 0.0
    t_index = 0
    used_sass = False
    for kind, _name, nbytes, lanes in per_launch:
        mem = nbytes / gpu.bandwidth
        comp = lanes / gpu.fp32_flops
        if kind == "triton":
            if t_index < len(sass) and sass[t_index] is not None:
                comp = sass[t_index]
                used_sass = True
            t_index += 1
        gpu_s += max(mem, comp)
        mem_s += mem if mem >= comp else 0.0
        comp_s += comp if comp > mem else 0.0
    host_s, before_s, after_s = host_seconds(per_launch, gpu, host)
    if not syncs:
        after_s = 0.0  # no read waits for the GPU: the host after it overlaps as the rest
    sync_s = syncs * gpu.sync_s
    busy_s = host_s - after_s  # the host until its last read
    terms = {"memory": mem_s, "compute": comp_s,
             "host": host_s if busy_s > before_s + gpu_s else 0.0, "sync": sync_s}
    return {
        "modelled_s": max(busy_s, before_s + gpu_s) + sync_s + after_s,
        "gpu_s": gpu_s,
        "host_s": host_s,
        "before_s": before_s,
        "after_s": after_s,
        "sync_s": sync_s,
        "bound": max(terms, key=terms.get),
        "compute": "sass" if used_sass else "lanes",
    }


MODEL = ("max(host until its last read, host before the first launch + GPU) + syncs x drain + host after "
         "the read; GPU = sum per launch of "
         "max(bytes/bandwidth, compute); Triton compute from sm_90a SASS")
MODEL_LANES = MODEL.replace("from sm_90a SASS", "from interpreter lanes (proxy)")

# counters a record keeps when the counts have them (Traffic's breakdown fields)
_BREAKDOWN = ("aten_ops", "triton_launches", "syncs", "triton_unique_bytes", "atomics", "op_names",
              "triton_programs_at_counted_shape")


def _issue_s(p: Optional[Dict]) -> Optional[float]:
    """A profiled launch's issue seconds at the efficiency its occupancy allows."""
    if not p or p.get("issue_s") is None:
        return None
    return p["issue_s"] / issue_efficiency(p["registers"], _warps(p.get("variant")))


def _warps(variant: str) -> int:
    found = re.search(r"warps=(\d+)", variant or "")
    return int(found.group(1)) if found else 4


def model_call(counts: Dict, compulsory: Optional[int], gpu: GpuModel = H100_SXM,
               sass: Optional[Dict] = None, host: Optional[Dict] = None) -> Tuple[Traffic, Model]:
    """A record's traffic and model groups from one call's counts.

    ``counts``: the counters' figures (``Counts.to_dict()`` or the runner's
    extrapolated dict) with ``per_launch`` and ``count_method``; ``sass``: the
    SASS worker's profile of the call's Triton launches (None: none taken);
    ``host``: the call's measured host path (``hostcost.measure``; None: not
    measured). Every Triton launch is priced by the SASS of the launch with its kernel
    name, in order; a launch only the GPU configuration makes joins with its
    compute and no counted bytes.
    """
    moved, launches, flops = counts.get("bytes_moved"), counts.get("launches"), counts.get("flops")
    traffic = Traffic(
        bytes_moved=moved,
        bytes_read=counts.get("bytes_read"),
        bytes_written=counts.get("bytes_written"),
        compulsory_bytes=compulsory,
        traffic_ratio=round(moved / compulsory, 3) if compulsory else None,
        launches=launches,
        flops=flops,
        count_method=counts.get("count_method"),
        **{k: counts[k] for k in _BREAKDOWN if k in counts},
    )
    per_launch = counts.get("per_launch")
    if per_launch is None:  # counts without a per-launch breakdown: one launch per op
        per_launch = [["aten", "op", moved / max(launches, 1), flops / max(launches, 1)]] * int(launches or 0)
    syncs = int(counts.get("syncs") or 0)
    lanes = overlap_model(per_launch, syncs, gpu, host=host)
    result, formula, heavy_fields = lanes, MODEL_LANES, {}
    profiled = (sass or {}).get("launches") or []
    if profiled:
        pending = list(profiled)
        compute = []
        for kind, name, _, _ in per_launch:
            if kind != "triton":
                continue
            hit = next((p for p in pending if p["kernel"].split(".")[-1] == name), None)
            if hit is not None:
                pending.remove(hit)
            compute.append(_issue_s(hit))
        per_launch = list(per_launch) + [["triton", p["kernel"], 0, 0] for p in pending]
        compute += [_issue_s(p) for p in pending]
        result = overlap_model(per_launch, syncs, gpu, compute, host)
        ok = [p for p in profiled if not p.get("error")]
        if ok:
            heavy = max(ok, key=lambda p: p.get("issue_s") or 0.0)
            heavy_fields = dict(
                sass_per_elem_step=round(heavy["sass_per_elem_step"], 1),
                sass_kernel=heavy["kernel"],
                registers=max(p["registers"] for p in ok),
                spills=max(p["spills"] for p in ok),
                issue_efficiency=round(issue_efficiency(heavy["registers"], _warps(heavy.get("variant"))), 2),
            )
        if result["compute"] == "sass":
            formula = MODEL
    elif (sass or {}).get("status") == "ok" and not any(k == "triton" for k, *_ in per_launch):
        formula = MODEL  # no Triton launch in the call: nothing for SASS to price
    model = Model(
        modelled_s=result["modelled_s"],
        modelled_lanes_s=lanes["modelled_s"],
        formula=formula,
        bound=result["bound"],
        gpu=gpu.describe(),
        gpu_s=result["gpu_s"],
        host_s=result["host_s"],
        before_s=result["before_s"],
        after_s=result["after_s"],
        sync_s=result["sync_s"],
        host_units=None if host is None else round(host["units"], 1),
        host_method=None if host is None else host["method"],
        **heavy_fields,
    )
    return traffic, model
