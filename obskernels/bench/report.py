"""Writes what a run produced: the console table, results.jsonl, report.md, PNG plots."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from obskernels.bench.records import Record

__all__ = ["console_table", "lead_table", "SCALED_NOTE", "write_jsonl", "read_jsonl", "write_report",
           "plot", "write_all", "legend"]

SCALED_NOTE = (
    "Scaled shapes (1/32 per side in quick mode): these OVERSTATE the search's speedup. "
    "At small shapes an eager path is bound by its per-launch cost, which does not shrink "
    "with the shape, while a fused kernel's compute does; at the real sizes the search "
    "kernel is compute-bound and the eager path streams at full bandwidth. Read the "
    "full-size table above for what a user will see."
)


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x * 1e3:.2f}" if x < 10 else f"{x * 1e3:.0f}")


def _us(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x * 1e6:.1f}" if x < 1e-3 else f"{x * 1e6:.0f}")


def _ratio(r: Optional[Record]) -> str:
    if r is None or r.traffic.bytes_moved is None:
        return "-"
    if not r.traffic.compulsory_bytes:
        return "view" if r.traffic.bytes_moved == 0 else "inf"
    return f"{r.traffic.bytes_moved / r.traffic.compulsory_bytes:.2f}"


def _short_status(r: Optional[Record]) -> str:
    if r is None:
        return "-"
    s = r.status or ""
    for key in ("unsupported", "unavailable", "n/a", "error", "not modelled"):
        if s.startswith(key):
            return key
    return ""


def _group(records: Iterable[Record], scope: str) -> "OrderedDict[Tuple[str, str], Dict[str, Record]]":
    rows: "OrderedDict[Tuple[str, str], Dict[str, Record]]" = OrderedDict()
    for r in records:
        if r.scope != scope:
            continue
        rows.setdefault((r.case.label, r.op), {})[r.backend] = r
    return rows


def _backends(records: Sequence[Record]) -> List[str]:
    order = ["reference", "llmc", "llmc-eager", "triton", "llmc-triton"]
    present = {r.backend for r in records}
    return [b for b in order if b in present]


def _scaled_run(records: Sequence[Record]) -> bool:
    """Whether the run's own rows (not the projection) are at scaled shapes."""
    return any(r.case.scaled for r in records if r.scope == "run")


def legend(records: Sequence[Record]) -> List[str]:
    """Lines explaining the columns and where each figure comes from."""
    if not records:
        return []
    r0 = records[0]
    m = r0.provenance.machine
    where = m.get("gpu") or (f"{m.get('cpu')} ({m.get('cpu_cores')} cores, no GPU; torch uses "
                             f"{m.get('torch_threads')} thread(s))")
    scaled = _scaled_run(records)
    lines = [
        f"machine: {where}; load average at start {m.get('loadavg')}, at end {m.get('loadavg_end')}",
        f"mode: {r0.provenance.mode}"
        + (" -- shapes SCALED DOWN (full sizes in the projection table / records' full_shape)" if scaled else ""),
        "MEASURED here: 'ms' (median wall time of one synchronised call after a warm-up; an observer"
        " call includes constructing it), 'GB/s' (compulsory bytes / that time), 'mem%' (peak extra"
        " memory of the call / the value's bytes). "
        + ("Triton rows are measured on this GPU." if m.get("device") == "cuda"
           else "No CUDA device: the Triton rows are MODELLED only (no time measured)."),
        "MODELLED: 'x' = bytes moved / compulsory bytes (input read once, outputs written once,"
        " 'view' when none is needed); 'L' = launches per call (aten ops + Triton grids);",
        f"  'GPU us' = modelled time on {r0.model.gpu}, the same formula for every backend:"
        " max(host until its last read, host before the first Triton launch + GPU time) + syncs x"
        " drain cost + host after that read (a read of a device value, as get_qparams' one read of"
        " its status, waits for the GPU); GPU time ="
        " sum over launches of max(bytes/bandwidth, compute); host = the call's host path measured"
        " here with launches stubbed (units of a one-element add_) x the GPU host's unit, + each"
        " Triton launch's issue cost (obskernels/bench/model.py).",
        "  compute: aten ops one lane per element at the fp32 rate; Triton launches the sm_90a"
        " SASS of their compiled variant (instructions per element and step, by pipe) --"
        " 'lanes us' is the same model with interpreter lanes as the Triton compute (a proxy).",
        "  PyTorch paths: aten ops counted exactly (TorchDispatchMode). Triton paths: every unmasked"
        " load/store lane counted in triton's interpreter (see count_method in results.jsonl).",
    ]
    return lines


SHORT = {"reference": "ref", "llmc": "llmc", "llmc-eager": "eager", "triton": "triton", "llmc-triton": "llmc-tri"}


def _has_figures(r: Record) -> bool:
    return r.timing.measured_s is not None or r.model.modelled_s is not None


def _measured_s(r: Optional[Record]) -> Optional[float]:
    return None if r is None else r.timing.measured_s


def _device_s(r: Optional[Record]) -> Optional[float]:
    return None if r is None else r.timing.device_s


def _modelled_s(r: Optional[Record]) -> Optional[float]:
    return None if r is None else r.model.modelled_s


def console_table(records: Sequence[Record], scope: str = "run") -> str:
    """One line per (case, op): each backend's figures side by side.

    Columns: '<backend> ms' measured, 'GB/s' compulsory bytes / measured time;
    'x' traffic / compulsory and 'L' launches
    (modelled counts); 'GPU us' the model's time; the last, the model's speedup
    of triton over the reference.
    """
    rows = _group(records, scope)
    if not rows:
        return ""
    all_recs = [r for g in rows.values() for r in g.values()]
    backends = [b for b in _backends(all_recs) if any(_has_figures(r) for r in all_recs if r.backend == b)]
    measured_bk = [b for b in backends if any(_measured_s(g.get(b)) is not None for g in rows.values())]
    head = ["case", "op"]
    for b in measured_bk:
        head += [f"{SHORT[b]} ms", f"{SHORT[b]} GB/s"]
    peak_bk = [b for b in backends if any(r.timing.peak_pct is not None for r in all_recs if r.backend == b)]
    head += [f"{SHORT[b]} mem%" for b in peak_bk]
    for b in backends:
        head += [f"{SHORT[b]} x", f"{SHORT[b]} L"]
    head += [f"{SHORT[b]} GPU us" for b in backends]
    speedup = "triton" in backends and "reference" in backends
    if speedup:
        head.append("triton/ref")
    if "triton" in backends:
        head.append("triton bound")
    head.append("notes")
    table = [head]
    for (case, op), g in rows.items():
        line = [case, op]
        for b in measured_bk:
            r = g.get(b)
            line.append(_ms(_measured_s(r)))
            gbs = None if r is None else r.timing.throughput_gbs
            line.append("-" if gbs is None else f"{gbs:.3g}")
        for b in peak_bk:
            r = g.get(b)
            line.append("-" if r is None or r.timing.peak_pct is None else f"{r.timing.peak_pct:.1f}")
        for b in backends:
            r = g.get(b)
            line.append(_ratio(r))
            line.append("-" if r is None or r.traffic.launches is None else str(r.traffic.launches))
        for b in backends:
            line.append(_us(_modelled_s(g.get(b))))
        if speedup:
            t, ref = _modelled_s(g.get("triton")), _modelled_s(g.get("reference"))
            line.append(f"{ref / t:.1f}x" if t and ref else "-")
        if "triton" in backends:
            tri = g.get("triton")
            line.append((tri.model.bound if tri is not None else None) or "-")
        notes = sorted({f"{SHORT[b]} {_short_status(g[b])}" for b in g
                        if _short_status(g[b]) and _short_status(g[b]) != "unavailable"})
        line.append(", ".join(notes))
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out = []
    for k, row in enumerate(table):
        out.append("  ".join(c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths).rstrip())
    missing = sorted({(r.backend, r.status) for r in all_recs
                      if (r.status or "").startswith("unavailable")})
    for b, status in missing:
        out.append(f"({b} not run: {status[len('unavailable: '):]})")
    return "\n".join(out)


def _lead_records(records: Sequence[Record]) -> List[Record]:
    """Observer rows at the full size: the projection of scaled cases, or the
    run's own rows when they were not scaled (full mode)."""
    return [r for r in records if r.target_kind == "observer" and (
        r.scope == "full-size projection" or (r.scope == "run" and not r.case.scaled))]


def _llmc_default(g: Dict[str, Record]) -> Optional[Record]:
    """llm-compressor's default path on a GPU, modelled: its Triton search where
    the row has one (the MSE observers), else its eager body."""
    tri = g.get("llmc-triton")
    if tri is not None and tri.model.modelled_s is not None:
        return tri
    return g.get("llmc-eager")


def lead_speedups(records: Sequence[Record]) -> List[Dict]:
    """Per (case, observer) at the full size: measured ms of triton and of
    llm-compressor's default path ("llmc", on a GPU), the model's us of both
    (llm-compressor's default path modelled by its Triton search where it has
    one, else its eager body), the model's host part, and the peak memory
    of the call in % of the value (taken at the run's shape)."""
    rows: "OrderedDict[Tuple[str, str], Dict[str, Record]]" = OrderedDict()
    for r in _lead_records(records):
        rows.setdefault((r.case.label, r.op), {})[r.backend] = r
    peaks = {}
    for r in records:
        if r.scope == "run" and r.timing.peak_pct is not None:
            peaks[(r.case.kind, r.case.dtype, r.case.scheme, tuple(r.case.full_shape), r.op, r.backend)] = r
    out = []
    for (case, op), g in rows.items():
        t, ld, ref = g.get("triton"), _llmc_default(g), g.get("reference")
        any_r = next(iter(g.values()))
        pk = (any_r.case.kind, any_r.case.dtype, any_r.case.scheme, tuple(any_r.case.full_shape), op)

        def peak(backend):
            r = peaks.get(pk + (backend,))
            return None if r is None else r.timing.peak_pct

        ts, ls, rs = _modelled_s(t), _modelled_s(ld), _modelled_s(ref)
        tm, lm, em = _measured_s(t), _measured_s(g.get("llmc")), _measured_s(g.get("llmc-eager"))
        td, ldev = _device_s(t), _device_s(g.get("llmc"))
        ti, tl = (None, None) if t is None else (t.timing.issued_s, t.timing.launched_s)
        out.append(dict(
            case=case, op=op, triton_us=ts and ts * 1e6, llmc_us=ls and ls * 1e6,
            llmc_path=ld and ld.backend, reference_us=rs and rs * 1e6,
            triton_host_us=t and t.model.host_s and t.model.host_s * 1e6,
            speedup_vs_llmc=(ls / ts) if ls and ts else None,
            speedup_vs_reference=(rs / ts) if rs and ts else None,
            triton_launches=t and t.traffic.launches, triton_bound=t and t.model.bound,
            sass_per_elem_step=t and t.model.sass_per_elem_step, registers=t and t.model.registers,
            triton_measured_ms=tm and tm * 1e3, llmc_measured_ms=lm and lm * 1e3,
            eager_measured_ms=em and em * 1e3,
            measured_speedup=(lm / tm) if lm and tm else None,
            triton_device_us=td and td * 1e6, llmc_device_us=ldev and ldev * 1e6,
            triton_issued_us=ti and ti * 1e6, triton_launched_us=tl and tl * 1e6,
            triton_peak_pct=peak("triton"), eager_peak_pct=peak("llmc-eager"),
            llmc_peak_pct=peak("llmc") if peak("llmc") is not None else (ld and peak(ld.backend)),
        ))
    return out


def lead_table(records: Sequence[Record]) -> str:
    """What a user will see first: each observer call at the full size
    (4096 x 4096 and the other real shapes) against llm-compressor's default
    path: MEASURED where a GPU ran them, MODELLED (every backend under one
    formula) where the model ran, peak memory beside."""
    rows = lead_speedups(records)
    if not rows:
        return ""

    def f(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    measured = any(r["triton_measured_ms"] or r["llmc_measured_ms"] for r in rows)
    modelled = any(r["triton_us"] for r in rows)
    split = any(r["triton_device_us"] is not None or r["llmc_device_us"] is not None for r in rows)
    issued = any(r["triton_issued_us"] is not None for r in rows)
    launched = any(r["triton_launched_us"] is not None for r in rows)
    head = ["case (full size)", "observer"]
    if measured:
        head += ["MEAS tri ms", "MEAS llmc ms", "MEAS eager ms", "llmc/tri"]
    if issued:
        head += ["ISSUED tri us"]
    if launched:
        head += ["LAUNCHED tri us"]
    if split:
        head += ["DEV tri us", "DEV llmc us"]
    if modelled:
        head += ["MODEL tri us", "host us", "bound", "MODEL llmc us", "llmc path", "llmc/tri",
                 "SASS/el/step", "regs"]
    head += ["tri mem%", "llmc mem%", "eager mem%"]
    table = [head]
    for r in rows:
        line = [r["case"], r["op"]]
        if measured:
            line += [f(r["triton_measured_ms"], "{:.3f}"), f(r["llmc_measured_ms"], "{:.3f}"),
                     f(r["eager_measured_ms"], "{:.3f}"), f(r["measured_speedup"], "{:.2f}x")]
        if issued:
            line += [f(r["triton_issued_us"], "{:.1f}")]
        if launched:
            line += [f(r["triton_launched_us"], "{:.1f}")]
        if split:
            line += [f(r["triton_device_us"], "{:.1f}"), f(r["llmc_device_us"], "{:.1f}")]
        if modelled:
            line += [f(r["triton_us"]), f(r["triton_host_us"]), r["triton_bound"] or "-", f(r["llmc_us"]),
                     {"llmc-triton": "triton", "llmc-eager": "eager"}.get(r["llmc_path"], "-"),
                     f(r["speedup_vs_llmc"], "{:.2f}x"), f(r["sass_per_elem_step"], "{:.1f}"),
                     f(r["registers"])]
        line += [f(r["triton_peak_pct"], "{:.1f}"), f(r["llmc_peak_pct"], "{:.1f}"),
                 f(r["eager_peak_pct"], "{:.1f}")]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
           for row in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    m = records[0].provenance.machine
    where = m.get("gpu") or f"{m.get('cpu')} (no GPU)"
    if measured:
        out.append(f"MEAS: measured on {where}: wall time of one call (new observer + observer(value) + "
                   "get_qparams(), synchronised), median after warm-up; llmc = llm-compressor as installed")
    if issued:
        out.append("ISSUED: the host's time in our call before its first kernel launch was issued (median, "
                   "calls made as MEAS's, in turns, in one more pass with the launch sites wrapped): the "
                   "device has no work before it")
    if launched:
        out.append("LAUNCHED: in the same calls, from just before our first launch was issued to the end of "
                   "our last kernel, on the device's clock (CUDA events): the host issuing that launch (the "
                   "GPU idles until it arrives), our kernels, and the host's time between launches; minus "
                   "DEV (the kernels alone), the host's launching")
    if split:
        out.append("DEV: the device work of one call (torch profiler over 5 calls, timed as MEAS: on "
                   "CUDA the device time of its kernels and copies; on a CPU its aten ops); MEAS minus "
                   "DEV is the host, or the device waiting for it")
    if modelled:
        out.append("MODEL: modelled on " + (records[0].model.gpu or "the model GPU") + "; host us = the "
                   f"host term (host path measured on {where} with launches stubbed, in units of a "
                   "one-element add_, x the GPU host's unit); llmc path = what the model prices for "
                   "llm-compressor's GPU default (its Triton search, else eager)")
    out.append("mem% = peak extra memory of the call / the value's bytes, measured at the run's shape "
               "(CUDA: max_memory_allocated; CPU: live storage created by torch, Triton rows in the interpreter)")
    if not any(r["llmc_us"] or r["llmc_measured_ms"] for r in rows):
        out.append("(no llm-compressor rows: it is not importable here; run the bench from "
                   ".venv-llmcompressor, built by `make llmcompressor-env`)")
    return "\n".join(out)


def write_jsonl(records: Sequence[Record], path: str) -> None:
    """One JSON object per record and line (``Record.to_dict``)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict(), sort_keys=False) + "\n")


def read_jsonl(path: str) -> List[Record]:
    """The records of a results.jsonl written by ``write_jsonl``."""
    with open(path) as f:
        return [Record.from_dict(json.loads(line)) for line in f if line.strip()]


def _md_table(text: str) -> str:
    return "```\n" + text + "\n```\n"


def write_report(records: Sequence[Record], path: str, plots: Sequence[str]) -> None:
    statuses: Dict[str, int] = {}
    for r in records:
        key = (r.status or "").split(":")[0]
        statuses[key] = statuses.get(key, 0) + 1
    lines = ["# obskernels benchmark report", ""]
    if records:
        p = records[0].provenance
        lines += [f"- generated: {p.timestamp}", f"- versions: {json.dumps(p.versions)}",
                  f"- machine: {json.dumps(p.machine)}", ""]
    lead = lead_table(records)
    if lead:
        lines += ["## Observers at the full size vs llm-compressor's default path", "",
                  "One observer call (new observer + forward + get_qparams) per row, at the real "
                  "shapes: measured where a GPU ran it, modelled (every backend under one formula, "
                  "see How to read it) otherwise.", "", _md_table(lead)]
    lines += ["## How to read it", ""] + [f"- {x}" for x in legend(records)] + [""]
    lines += ["Record statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())), ""]
    problems = sorted({(r.backend, r.status) for r in records
                       if (r.status or "").startswith(("unsupported", "error", "unavailable"))})
    if problems:
        lines += ["Rows without figures, and why:", ""]
        lines += [f"- {b}: {s}" for b, s in problems[:40]]
        if len(problems) > 40:
            lines.append(f"- ... and {len(problems) - 40} more (see results.jsonl)")
        lines.append("")
    lines += ["## This run", ""] + ([SCALED_NOTE, ""] if _scaled_run(records) else []) + [_md_table(console_table(records, "run"))]
    proj = console_table(records, "full-size projection")
    if proj:
        lines += ["## Modelled at the full sizes (no measurement)", "",
                  "The scaled cases above, projected to their real sizes: Triton counts extrapolated "
                  "from interpreter runs, PyTorch counts scaled by the element count.", "",
                  _md_table(proj)]
    if plots:
        lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(records: Sequence[Record], out_dir: str) -> List[str]:
    """speedup.png and traffic.png (and projection.png when there are projections)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a bench extra
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    paths = []
    lead = [r for r in lead_speedups(records) if r["speedup_vs_llmc"] or r["speedup_vs_reference"]]
    if lead:
        fig, ax = plt.subplots(figsize=(14, 0.35 * len(lead) + 1.6))
        labels = [f"{r['case']}  {r['op']}" for r in lead]
        ys = range(len(lead))
        base = "llmc" if any(r["speedup_vs_llmc"] for r in lead) else "reference"
        sass_v = [(r["speedup_vs_llmc"] if base == "llmc" else r["speedup_vs_reference"]) or 0 for r in lead]
        ax.barh([y - 0.2 for y in ys], sass_v, 0.4, label="triton, modelled")
        if any(r["measured_speedup"] for r in lead):
            ax.barh([y + 0.2 for y in ys], [r["measured_speedup"] or 0 for r in lead], 0.4,
                    label="triton, MEASURED")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("speedup vs " + ("llm-compressor's default path" if base == "llmc" else "the reference"))
        ax.legend(fontsize=7)
        fig.suptitle("Observers at the full size (model: " + (records[0].model.gpu or "") + ")", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, "lead.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    for scope, name in (("run", "traffic"), ("run", "speedup"), ("full-size projection", "projection")):
        rows = _group(records, scope)
        if not rows:
            continue
        ops = list(OrderedDict.fromkeys(op for _, op in rows))
        cases = list(OrderedDict.fromkeys(case for case, _ in rows))
        recs = [r for g in rows.values() for r in g.values()]
        backends = [b for b in _backends(recs)
                    if any(_has_figures(r) for r in recs if r.backend == b)]
        if name in ("speedup", "projection"):
            shown = [b for b in backends if b != "reference"]
        else:
            shown = backends
        ncol = 2
        nrow = (len(ops) + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(16, 3.2 * nrow), squeeze=False)
        drew = False
        for ax, op in zip(axes.flat, ops):
            xs = [c for c in cases if (c, op) in rows]
            width = 0.8 / max(1, len(shown))
            positive = False
            for k, b in enumerate(shown):
                vals = []
                for c in xs:
                    g = rows[(c, op)]
                    r, ref = g.get(b), g.get("reference")
                    v = None
                    if r is not None and name == "traffic":
                        if r.traffic.bytes_moved is not None and r.traffic.compulsory_bytes:
                            v = r.traffic.bytes_moved / r.traffic.compulsory_bytes
                    elif r is not None and ref is not None:
                        if r.timing.measured_s and ref.timing.measured_s:
                            v = ref.timing.measured_s / r.timing.measured_s
                        elif r.model.modelled_s and ref.model.modelled_s:
                            v = ref.model.modelled_s / r.model.modelled_s
                    vals.append(v if v is not None else 0.0)
                pos = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(xs))]
                if any(vals):
                    drew = positive = True
                ax.bar(pos, vals, width, label=b)
            ax.set_title(op, fontsize=10)
            ax.set_xticks(range(len(xs)))
            ax.set_xticklabels(xs, rotation=35, ha="right", fontsize=6)
            if positive:
                ax.set_yscale("log")
                if name == "traffic":
                    ax.set_ylim(bottom=0.5)
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            if name == "traffic":
                ax.axhline(2.0, color="r", lw=0.6, ls=":")
                ax.set_ylabel("bytes / compulsory")
            else:
                ax.set_ylabel("x vs reference")
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(ops):]:
            ax.axis("off")
        titles = {
            "traffic": "Memory traffic per call / compulsory traffic (modelled counts; "
                       "dashed 1x, dotted 2x = the kernels' mse_search target)",
            "speedup": "SCALED shapes (overstate the search's speedup). Speedup vs the reference: "
                       "measured where both are measured, else the GPU model's ratio ("
                       + (records[0].model.gpu if records else "") + ")",
            "projection": "Full-size shapes: modelled GPU speedup vs the reference ("
                          + (records[0].model.gpu if records else "") + ")",
        }
        fig.suptitle(titles[name] + ("" if drew else "  [no figures for these backends yet]"), fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_all(records: Sequence[Record], out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, "results.jsonl")
    write_jsonl(records, jsonl)
    plots = plot(records, out_dir)
    md = os.path.join(out_dir, "report.md")
    write_report(records, md, plots)
    return {"jsonl": jsonl, "report": md, **{os.path.basename(p): p for p in plots}}
