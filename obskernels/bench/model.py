"""The model of a call on a stated GPU, and the compulsory traffic.

The model every backend's ``modelled_s`` uses (``overlap_model``):

    modelled_s = max(gpu_s, cpu_s) + syncs * sync_s
    gpu_s      = sum over launches of max(bytes_i / bandwidth, compute_i)
    cpu_s      = launches * launch_s

The CPU issues an eager op while the GPU runs earlier ones, so launch cost and
GPU time overlap instead of adding; a host sync (``.item()``) drains the queue
and costs a round trip. ``compute_i``: for an aten op, one lane per element of
its largest operand at the fp32 rate; for a Triton launch, the SASS its
variant issues on sm_90a (``obskernels.tools.kernel_report``: instructions per
element and step by pipe x the launch's element-steps, at 132 SMs x 4
schedulers x 32 lanes x 1.98 GHz, INT at 1/2, MUFU and conversions at 1/8,
load/store and shuffles at 1/4), or, where no SASS profile is at hand, the
interpreter's arithmetic lanes at the fp32 rate (a proxy: it counts index
math and misses the emulation's real cost) -- the ``modelled_lanes_s``
column always uses that proxy, so both are on record.

The older single roofline (``predict``) is kept for reference:
predicted_s = max(bytes / bandwidth, flops / fp32_rate) + launches * launch_s

- bytes: what the traffic counters report (``traffic.Counts.bytes_moved``);
- flops: arithmetic lanes: for Triton, every elementwise arithmetic, compare,
  cast and reduction lane the interpreter evaluated (index math included);
  for the PyTorch paths, one lane per element of each aten op's largest operand;
- launches: aten ops (one op = one launch) plus Triton grids.

Default GPU: H100 SXM, 3.35 TB/s HBM3, 67 TFLOP/s fp32 (non-tensor-core),
4 us per launch (a launch plus its share of the host work between launches),
33.45e12 lane-instructions/s issued, 10 us per host sync (drain + round trip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from obskernels.bench.records import Model, Traffic

__all__ = [
    "GpuModel",
    "H100_SXM",
    "predict",
    "overlap_model",
    "bound",
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
    launch_s: float = 4e-6
    issue_rate: float = 132 * 4 * 32 * 1.98e9  # lane-instructions / s (SASS)
    sync_s: float = 10e-6

    def describe(self) -> str:
        return (
            f"{self.name}: {self.bandwidth / 1e12:g} TB/s, {self.fp32_flops / 1e12:g} "
            f"TFLOP/s fp32, {self.issue_rate / 1e12:.1f}e12 SASS lane-instr/s, "
            f"{self.launch_s * 1e6:g} us/launch, {self.sync_s * 1e6:g} us/sync"
        )


H100_SXM = GpuModel()


def predict(bytes_moved: float, flops: float, launches: float, gpu: GpuModel = H100_SXM) -> float:
    """Predicted seconds: max(bytes / bandwidth, flops / rate) + launches * launch cost."""
    if min(bytes_moved, flops, launches) < 0:
        raise ValueError("bytes_moved, flops and launches must be >= 0")
    return max(bytes_moved / gpu.bandwidth, flops / gpu.fp32_flops) + launches * gpu.launch_s


def bound(bytes_moved: float, flops: float, launches: float, gpu: GpuModel = H100_SXM) -> str:
    """Which term sets the predicted time: "memory", "compute" or "launch"."""
    terms = {
        "memory": bytes_moved / gpu.bandwidth,
        "compute": flops / gpu.fp32_flops,
        "launch": launches * gpu.launch_s,
    }
    return max(terms, key=terms.get)


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


def overlap_model(per_launch: Sequence, syncs: int, gpu: GpuModel = H100_SXM,
                  triton_compute: Optional[Sequence[Optional[float]]] = None) -> Dict:
    """The model above for one call.

    per_launch: [kind ("aten" | "triton"), name, bytes, lanes] in issue order;
    triton_compute: seconds of each Triton launch from its SASS (in order of
    the Triton launches; None entries and missing ones fall back to lanes).
    Returns modelled_s, gpu_s, cpu_s, sync_s, bound ("memory", "compute",
    "launch" (CPU issue) or "sync") and the compute source.
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
    cpu_s = len(per_launch) * gpu.launch_s
    sync_s = syncs * gpu.sync_s
    terms = {"memory": mem_s, "compute": comp_s, "launch": cpu_s if cpu_s > gpu_s else 0.0, "sync": sync_s}
    return {
        "modelled_s": max(gpu_s, cpu_s) + sync_s,
        "gpu_s": gpu_s,
        "cpu_s": cpu_s,
        "sync_s": sync_s,
        "bound": max(terms, key=terms.get),
        "compute": "sass" if used_sass else "lanes",
    }


MODEL = ("max(GPU, CPU issue) + syncs x drain; GPU = sum per launch of max(bytes/bandwidth, "
         "compute); Triton compute from sm_90a SASS")
MODEL_LANES = MODEL.replace("from sm_90a SASS", "from interpreter lanes (proxy)")

# counters a record keeps when the counts have them (Traffic's breakdown fields)
_BREAKDOWN = ("aten_ops", "triton_launches", "syncs", "triton_unique_bytes", "atomics", "op_names",
              "triton_programs_at_counted_shape")


def model_call(counts: Dict, compulsory: Optional[int], gpu: GpuModel = H100_SXM,
               sass: Optional[Dict] = None) -> Tuple[Traffic, Model]:
    """A record's traffic and model groups from one call's counts.

    ``counts``: the counters' figures (``Counts.to_dict()`` or the runner's
    extrapolated dict) with ``per_launch`` and ``count_method``; ``sass``: the
    SASS worker's profile of the call's Triton launches (None: none taken).
    Every Triton launch is priced by the SASS of the launch with its kernel
    name, in order; a launch only the GPU configuration makes (a split's
    finish pass) joins with its compute and no counted bytes.
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
    lanes = overlap_model(per_launch, syncs, gpu)
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
            compute.append(hit.get("issue_s") if hit else None)
        per_launch = list(per_launch) + [["triton", p["kernel"], 0, 0] for p in pending]
        compute += [p.get("issue_s") for p in pending]
        result = overlap_model(per_launch, syncs, gpu, compute)
        ok = [p for p in profiled if not p.get("error")]
        if ok:
            heavy = max(ok, key=lambda p: p.get("issue_s") or 0.0)
            heavy_fields = dict(
                sass_per_elem_step=round(heavy["sass_per_elem_step"], 1),
                sass_kernel=heavy["kernel"],
                registers=max(p["registers"] for p in ok),
                spills=max(p["spills"] for p in ok),
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
        cpu_s=result["cpu_s"],
        sync_s=result["sync_s"],
        **heavy_fields,
    )
    return traffic, model
