"""One benchmark record: a frozen dataclass, one JSON object per line of results.jsonl.

A ``Record`` is one (target, case, backend, scope): what ran, and its figures in
groups -- ``CaseInfo`` (the value and its scheme), ``Timing`` (MEASURED),
``Traffic`` (the counters' bytes, launches and arithmetic) and ``Model`` (the
modelled time on the stated GPU) -- plus its status and where it ran
(``Provenance``). The runner builds records, ``model`` fills the traffic and
model groups, ``report`` reads them, ``to_dict`` writes a JSON line.

The JSON keys (``JSON_KEYS``, in the order written) are flat, as they have
always been: the group a key belongs to is in the table below, not in the
file. ``ALWAYS`` keys are in every line (null when not taken); the others are
written only when the record has them (see obskernels/bench/README.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

__all__ = [
    "CaseInfo",
    "Timing",
    "Traffic",
    "Model",
    "Provenance",
    "Record",
    "JSON_KEYS",
    "ALWAYS",
    "OPTIONAL",
]


@dataclass(frozen=True)
class CaseInfo:
    """The value a record ran on: the case at this record's shape."""

    label: str  # "case": e.g. "w128x128 bf16 int4-group128"
    kind: str  # "weight" or "activation"
    base_name: str  # "weight" or "input"
    shape: Tuple[int, int]
    full_shape: Tuple[int, int]  # the real size a scaled case stands for
    scaled: bool
    dtype: str
    strategy: str
    format: str
    scheme: str


@dataclass(frozen=True)
class Timing:
    """MEASURED: wall time of one call and its peak memory (None: not measured)."""

    measured_s: Optional[float] = None  # median
    measured_reps: Optional[int] = None
    measured_min_s: Optional[float] = None
    # with more than one pass over the run (``--rounds``): the median of each pass's calls
    measured_pass_s: Optional[Tuple[float, ...]] = None
    timer: Optional[str] = None
    throughput_gbs: Optional[float] = None  # compulsory bytes / measured_s
    peak_bytes: Optional[int] = None
    peak_pct: Optional[float] = None  # peak_bytes / the value's bytes, in %
    peak_method: Optional[str] = None
    # the work one call gives the device (``runner.device_split``, asked for by
    # ``--split``): seconds per call, and us per call by kernel or copy name
    device_s: Optional[float] = None
    device_ops: Optional[Dict[str, float]] = None
    device_method: Optional[str] = None
    # on CUDA, our rows (``runner.issued_samples``, medians): the host's
    # seconds from a call's start until its first kernel launch was issued,
    # from just before that launch to its last kernel's end (CUDA events), how
    issued_s: Optional[float] = None
    launched_s: Optional[float] = None
    issued_method: Optional[str] = None


@dataclass(frozen=True)
class Traffic:
    """MODELLED counts of one call: bytes, launches, arithmetic lanes."""

    bytes_moved: Optional[int] = None
    bytes_read: Optional[int] = None
    bytes_written: Optional[int] = None
    compulsory_bytes: Optional[int] = None
    traffic_ratio: Optional[float] = None  # bytes_moved / compulsory_bytes
    launches: Optional[int] = None
    flops: Optional[int] = None
    count_method: Optional[str] = None
    # breakdown, written when counted
    aten_ops: Optional[int] = None
    triton_launches: Optional[int] = None
    syncs: Optional[int] = None
    triton_unique_bytes: Optional[int] = None
    atomics: Optional[int] = None
    op_names: Optional[Dict[str, int]] = None
    triton_programs_at_counted_shape: Optional[int] = None
    search_steps: Optional[int] = None
    flops_per_element_step: Optional[float] = None


@dataclass(frozen=True)
class Model:
    """MODELLED time of one call on ``gpu`` (obskernels/bench/model.py)."""

    modelled_s: Optional[float] = None
    modelled_lanes_s: Optional[float] = None
    formula: Optional[str] = None  # "model": the formula and its compute source
    sass_per_elem_step: Optional[float] = None
    registers: Optional[int] = None
    spills: Optional[int] = None
    bound: Optional[str] = None
    gpu: Optional[str] = None  # "model_gpu": the GPU's parameters
    # breakdown, written when modelled
    sass_kernel: Optional[str] = None
    issue_efficiency: Optional[float] = None
    gpu_s: Optional[float] = None
    host_s: Optional[float] = None
    before_s: Optional[float] = None
    after_s: Optional[float] = None  # host after the last read (which waits for the GPU)
    sync_s: Optional[float] = None
    host_units: Optional[float] = None  # measured host path, units of a 1-element add_
    host_method: Optional[str] = None


@dataclass(frozen=True)
class Provenance:
    """Where and when a record was taken."""

    mode: str
    machine: Dict[str, Any] = field(default_factory=dict)
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    timestamp: Optional[str] = None


@dataclass(frozen=True)
class Record:
    op: str  # the target's label: an op ("mse_search[mse]") or "obs:<observer>"
    target_kind: str  # "op" or "observer"
    backend: str
    case: CaseInfo
    provenance: Provenance
    timing: Timing = Timing()
    traffic: Traffic = Traffic()
    model: Model = Model()
    # "measured", "modelled", "unsupported: ...", "n/a: ...", "unavailable: ...", "error: ..."
    status: Optional[str] = None
    note: Optional[str] = None
    scope: str = "run"  # or "full-size projection"

    def replace(self, **changes) -> "Record":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """The record's JSON object (keys in ``JSON_KEYS`` order)."""
        out: Dict[str, Any] = {}
        for key, group, attr, always in JSON_KEYS:
            value = getattr(getattr(self, group) if group else self, attr)
            if value is None and not always:
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Record":
        """A record from its JSON object (as ``to_dict`` writes it)."""
        groups: Dict[str, Dict[str, Any]] = {g: {} for g in _GROUPS}
        top: Dict[str, Any] = {}
        for key, group, attr, always in JSON_KEYS:
            if key not in d:
                if always:
                    raise ValueError(f"record lacks the key {key!r}")
                continue
            value = d[key]
            if key in ("shape", "full_shape", "measured_pass_s"):
                value = tuple(value)
            (groups[group] if group else top)[attr] = value
        return cls(**top, **{g: _GROUPS[g](**kw) for g, kw in groups.items()})


_GROUPS = {"case": CaseInfo, "provenance": Provenance, "timing": Timing, "traffic": Traffic,
           "model": Model}

# (JSON key, group ("" = the record itself), attribute, in every line)
JSON_KEYS: Tuple[Tuple[str, str, str, bool], ...] = (
    ("op", "", "op", True),
    ("target_kind", "", "target_kind", True),
    ("backend", "", "backend", True),
    ("case", "case", "label", True),
    ("kind", "case", "kind", True),
    ("base_name", "case", "base_name", True),
    ("shape", "case", "shape", True),
    ("full_shape", "case", "full_shape", True),
    ("scaled", "case", "scaled", True),
    ("dtype", "case", "dtype", True),
    ("strategy", "case", "strategy", True),
    ("format", "case", "format", True),
    ("scheme", "case", "scheme", True),
    ("measured_s", "timing", "measured_s", True),
    ("measured_reps", "timing", "measured_reps", True),
    ("measured_min_s", "timing", "measured_min_s", True),
    ("timer", "timing", "timer", True),
    ("throughput_gbs", "timing", "throughput_gbs", True),
    ("peak_bytes", "timing", "peak_bytes", True),
    ("peak_pct", "timing", "peak_pct", True),
    ("peak_method", "timing", "peak_method", True),
    ("bytes_moved", "traffic", "bytes_moved", True),
    ("bytes_read", "traffic", "bytes_read", True),
    ("bytes_written", "traffic", "bytes_written", True),
    ("compulsory_bytes", "traffic", "compulsory_bytes", True),
    ("traffic_ratio", "traffic", "traffic_ratio", True),
    ("launches", "traffic", "launches", True),
    ("flops", "traffic", "flops", True),
    ("modelled_s", "model", "modelled_s", True),
    ("modelled_lanes_s", "model", "modelled_lanes_s", True),
    ("model", "model", "formula", True),
    ("sass_per_elem_step", "model", "sass_per_elem_step", True),
    ("registers", "model", "registers", True),
    ("spills", "model", "spills", True),
    ("bound", "model", "bound", True),
    ("model_gpu", "model", "gpu", True),
    ("count_method", "traffic", "count_method", True),
    ("status", "", "status", True),
    ("note", "", "note", True),
    ("mode", "provenance", "mode", True),
    ("scope", "", "scope", True),
    ("machine", "provenance", "machine", True),
    ("versions", "provenance", "versions", True),
    ("timestamp", "provenance", "timestamp", True),
    ("aten_ops", "traffic", "aten_ops", False),
    ("triton_launches", "traffic", "triton_launches", False),
    ("syncs", "traffic", "syncs", False),
    ("triton_unique_bytes", "traffic", "triton_unique_bytes", False),
    ("atomics", "traffic", "atomics", False),
    ("op_names", "traffic", "op_names", False),
    ("triton_programs_at_counted_shape", "traffic", "triton_programs_at_counted_shape", False),
    ("sass_kernel", "model", "sass_kernel", False),
    ("model_gpu_s", "model", "gpu_s", False),
    ("issue_efficiency", "model", "issue_efficiency", False),
    ("model_host_s", "model", "host_s", False),
    ("model_before_s", "model", "before_s", False),
    ("model_after_s", "model", "after_s", False),
    ("host_units", "model", "host_units", False),
    ("host_method", "model", "host_method", False),
    ("model_sync_s", "model", "sync_s", False),
    ("search_steps", "traffic", "search_steps", False),
    ("flops_per_element_step", "traffic", "flops_per_element_step", False),
    ("measured_pass_s", "timing", "measured_pass_s", False),
    ("device_s", "timing", "device_s", False),
    ("device_ops", "timing", "device_ops", False),
    ("device_method", "timing", "device_method", False),
    ("issued_s", "timing", "issued_s", False),
    ("launched_s", "timing", "launched_s", False),
    ("issued_method", "timing", "issued_method", False),
)
ALWAYS: Tuple[str, ...] = tuple(k for k, _, _, always in JSON_KEYS if always)
OPTIONAL: Tuple[str, ...] = tuple(k for k, _, _, always in JSON_KEYS if not always)


def _check_table() -> None:
    """Every field of every group has exactly one JSON key (an import-time check)."""
    seen = {(g, a) for _, g, a, _ in JSON_KEYS}
    fields = {("", f.name) for f in dataclasses.fields(Record) if f.name not in _GROUPS}
    for g, cls in _GROUPS.items():
        fields |= {(g, f.name) for f in dataclasses.fields(cls)}
    if seen != fields or len(seen) != len(JSON_KEYS):
        raise AssertionError(f"JSON_KEYS and the record's fields differ: {sorted(seen ^ fields)}")


_check_table()
