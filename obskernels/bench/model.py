"""The roofline model of a call on a stated GPU, and the compulsory traffic.

predicted_s = max(bytes / bandwidth, flops / fp32_rate) + launches * launch_s

- bytes: what the traffic counters report (``traffic.Counts.bytes_moved``);
- flops: arithmetic lanes: for Triton, every elementwise arithmetic, compare,
  cast and reduction lane the interpreter evaluated (index math included);
  for the PyTorch paths, one lane per element of each aten op's largest operand;
- launches: aten ops (one op = one launch) plus Triton grids.

Default GPU: H100 SXM, 3.35 TB/s HBM3, 67 TFLOP/s fp32 (non-tensor-core),
4 us per launch (a launch plus its share of the host work between launches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

__all__ = [
    "GpuModel",
    "H100_SXM",
    "predict",
    "bound",
    "compulsory_bytes",
    "affine_extrapolate",
]


@dataclass(frozen=True)
class GpuModel:
    name: str = "H100 SXM"
    bandwidth: float = 3.35e12  # bytes / s
    fp32_flops: float = 67e12  # lanes / s
    launch_s: float = 4e-6

    def describe(self) -> str:
        return (
            f"{self.name}: {self.bandwidth / 1e12:g} TB/s, {self.fp32_flops / 1e12:g} "
            f"TFLOP/s fp32, {self.launch_s * 1e6:g} us/launch"
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
