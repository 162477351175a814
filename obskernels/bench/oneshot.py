"""End to end: llm-compressor's own ``oneshot``, plain and with the drop-in.

    python -m obskernels.bench.oneshot                   # 6 Llama-3-8B-shaped layers (CUDA if present)
    python -m obskernels.bench.oneshot --hidden 128 --intermediate 256 --layers 2 --seq 16

Runs where llm-compressor 0.14 is importable (``make llmcompressor-env``, then
``PYTHONSAFEPATH=1 .venv-llmcompressor/bin/python -m obskernels.bench.oneshot``).
The model: ``--layers`` random-initialised Llama decoder layers shaped like
Llama-3-8B's (hidden 4096, intermediate 14336, 32 heads, 8 key/value heads; a
small vocabulary, ``lm_head`` ignored by the recipe), in bf16. Offline: the
config goes to a temporary folder (``oneshot`` reads it back), the tokenizer
is built in memory, the calibration data are seeded random token ids.

Each scheme (``SCHEME[:weight_observer]``; default W4A16 with memoryless_mse,
FP8 -- static per-tensor activation observers on every forward -- and NVFP4
with nvfp4_expanded_mse) runs in each mode: "plain" (llm-compressor as
installed) and "drop-in" (inside ``obskernels.integrations.llmcompressor.enabled(backend)``).
MEASURED, per (scheme, mode), in seconds of ``oneshot(...)`` (synchronised;
building the model is not timed): the first call in this process, the
median of the next ``--reps`` calls (after both modes' first calls, the
modes alternating), and the first call in a fresh process (a child running
one call: what a user's next session pays, kernels from triton's disk
cache), the median of ``--fresh-reps`` such processes per mode, the modes
taking turns (plain, drop-in, drop-in, plain, ...), what each call
compiled into Triton's disk cache (kernels, launchers) counted, and for a
fresh process the kernel variants it set up that this process never did
("2.180 (4 compiled, 1 unseen)": a fresh process should compile nothing).
Also: how many of the qparam tensors (scales, zero points, global scales)
the two modes produce bit-identically.
``--profile-fresh``: one more fresh process per (scheme, mode), its call
profiled (cProfile), summarised by part -- Triton's key, its compiles and
launch front end, the GPU module loads, the kernels' import -- and by
function in ``OUT/profiles/SCHEME-MODE.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

__all__ = ["Shape", "LLAMA3_8B", "DEFAULT_SCHEMES", "FRESH_REPS", "fresh_order", "run_once", "compare", "main"]


@dataclass(frozen=True)
class Shape:
    layers: int = 6
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 512
    samples: int = 16
    seq: int = 256


LLAMA3_8B = Shape()
DEFAULT_SCHEMES = ("W4A16:memoryless_mse", "FP8", "NVFP4:nvfp4_expanded_mse")
MODES = ("plain", "drop-in")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _model(shape: Shape, device: str, config_dir: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=max(shape.seq, 64),
    )
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(saved)
    model.config.save_pretrained(config_dir)  # oneshot reads the config back from here
    model.config._name_or_path = config_dir
    return model


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _data(shape: Shape):
    import torch
    from datasets import Dataset

    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(2, shape.vocab, (shape.seq,), generator=gen).tolist() for _ in range(shape.samples)]
    return Dataset.from_dict({"input_ids": ids})


def run_once(scheme: str, mode: str, shape: Shape, device: str, backend: str = "auto",
             pipeline: str = "basic", profile: Optional[str] = None) -> Dict:
    """One ``oneshot`` of ``scheme`` in ``mode``: {"seconds", "qparams",
    "variants"} (the qparam tensors of the quantized model, on the CPU; the
    kernel variants the call set up first in this process,
    ``launch.kernel_variants``, whose hook runs inside the timed call:
    0.1-0.6 ms per variant set up on the development CPU, Triton's JSON of
    the variant included, nothing per launch). ``profile``: a
    path the timed call's cProfile statistics are written to (its seconds
    then include the profiler's cost)."""
    import warnings

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from obskernels.bench.launch import kernel_variants

    from obskernels.integrations.llmcompressor import enabled

    name, _, observer = scheme.partition(":")
    with tempfile.TemporaryDirectory() as config_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(shape, device, config_dir)
        kwargs = {"weight_observer": observer} if observer else {}
        recipe = QuantizationModifier(targets="Linear", scheme=name, ignore=["lm_head"], **kwargs)
        data, processor = _data(shape), _tokenizer(shape.vocab)
        scope = enabled(backend) if mode == "drop-in" else contextlib.nullcontext()
        profiler = cProfile.Profile() if profile else None
        _sync(device)
        t0 = time.perf_counter()
        with scope, kernel_variants() as variants, (profiler or contextlib.nullcontext()):
            oneshot(model=model, processor=processor, dataset=data, recipe=recipe,
                    num_calibration_samples=shape.samples, pipeline=pipeline)
            _sync(device)
        seconds = time.perf_counter() - t0
        if profiler:
            profiler.dump_stats(profile)
    qparams = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
               if k.endswith(("_scale", "_zero_point", "global_scale"))}
    return {"seconds": seconds, "qparams": qparams, "variants": variants}


#: fresh processes per (scheme, mode): one each is not enough (NVFP4's
#: drop-in read 0.74 s slower than plain in one such pair on an H100's host,
#: and 0.35-0.92 s faster in each of two on an H200's)
FRESH_REPS = 2


def fresh_order(reps: int) -> List[str]:
    """The modes of ``reps`` fresh processes each, in the order they run:
    in turns, each pair reversed from the one before (plain, drop-in, drop-in,
    plain, ...), so that neither mode always runs first (the first process
    after the in-process calls, or after the other mode's)."""
    order: List[str] = []
    for k in range(reps):
        order += list(MODES) if k % 2 == 0 else list(reversed(MODES))
    return order


def _child(scheme: str, mode: str, shape: Shape, device: str, backend: str, pipeline: str,
           extra=()) -> Dict:
    """One ``oneshot`` call in a new interpreter (the first call there):
    {"seconds", "variants"} (``run_once``'s)."""
    cmd = [sys.executable, "-m", "obskernels.bench.oneshot", "--child", "--schemes", scheme,
           "--modes", mode, "--device", device, "--backend", backend, "--pipeline", pipeline,
           "--shape-json", json.dumps(asdict(shape)), *extra]
    from obskernels.bench.launch import fresh_process_env, run_fresh_process

    proc = run_fresh_process(cmd, fresh_process_env(PYTHONSAFEPATH="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"the fresh-process run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# what a fresh process's first call spends its time in, beyond oneshot's own work
FIRST_USE_PARTS = {
    "Triton's hash of its installation": ("/triton/runtime/cache.py", "triton_key"),
    "the key kept by obskernels": ("/kernels/_triton_key.py", "triton_key"),
    "Triton compile (a disk-cache hit included)": ("/triton/compiler/compiler.py", "compile"),
    "Triton's launch front end (JITFunction.run)": ("/triton/runtime/jit.py", "run"),
    "compiled kernels' GPU module loads": ("/triton/compiler/compiler.py", "_init_handles"),
    "obskernels.kernels import": ("/kernels/__init__.py", "<module>"),
}


def profile_summary(path: str, top: int = 40) -> str:
    """A profile of ``run_once(profile=...)`` as text: the parts of
    ``FIRST_USE_PARTS`` (cumulative seconds, calls), then the ``top``
    functions by cumulative time."""
    import io
    import pstats

    stats = pstats.Stats(path)
    lines = ["part: cumulative s (calls)"]
    for part, (file_end, name) in FIRST_USE_PARTS.items():
        hits = [(v[3], v[1]) for (file, _, fn), v in stats.stats.items()
                if fn == name and file.replace(os.sep, "/").endswith(file_end)]
        lines.append(f"  {part}: {sum(h[0] for h in hits):.4f} s ({sum(h[1] for h in hits)})")
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("cumulative").print_stats(top)
    return "\n".join(lines) + "\n\n" + out.getvalue()


def _profile_fresh(scheme: str, mode: str, shape: Shape, device: str, backend: str, pipeline: str,
                   out_dir: str) -> str:
    """One more fresh-process ``oneshot`` (not the timed one), profiled: its
    summary (``profile_summary``) written to ``out_dir`` and returned as
    the path."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{scheme.replace(':', '-')}-{mode}")
    _child(scheme, mode, shape, device, backend, pipeline, ["--profile", stem + ".prof"])
    with open(stem + ".txt", "w") as f:
        f.write(f"# a fresh process's oneshot, {scheme} {mode}, profiled (cProfile inflates the time)\n\n")
        f.write(profile_summary(stem + ".prof"))
    return stem + ".txt"


def profile_parts(path: str) -> List[str]:
    """The by-part lines of a summary ``_profile_fresh`` wrote."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = lines.index("part: cumulative s (calls)")
    return lines[start:start + 1 + len(FIRST_USE_PARTS)]


def _listed(variants: Optional[Dict]) -> Optional[List]:
    """``launch.kernel_variants``' {digest: [kernel, specialisation]} as a
    sorted list of its values (None stays None)."""
    return None if variants is None else sorted(variants.values())


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def compare(schemes=DEFAULT_SCHEMES, shape: Shape = LLAMA3_8B, device: str = "cpu", backend: str = "auto",
            pipeline: str = "basic", reps: int = 3, fresh: bool = True, progress=None,
            profile_dir: Optional[str] = None, fresh_reps: int = FRESH_REPS) -> List[Dict]:
    """One MEASURED row per (scheme, mode): first call in this process, the
    median of ``reps`` more, the median of ``fresh_reps`` first calls in a
    fresh process each (``fresh``; in ``fresh_order``, every sample in the
    row's ``fresh_process_samples``); and per scheme, the qparam tensors
    identical between the modes. What the first call and each fresh process
    compiled into Triton's disk cache (``launch.compiled_since``;
    None where it cannot be listed) are in ``first_in_process_compiled`` and
    ``fresh_process_compiled``: a fresh process should find everything
    the calls before it compiled. ``fresh_process_unseen``: per fresh
    process, the kernel variants it set up that this process never did
    ([kernel, Triton's specialisation], ``launch.kernel_variants``; None
    where not known): where a fresh process compiles, these say whether it
    asked for other variants or for the same ones under another key
    (``first_in_process_variants``, those the first call set up, to compare
    them with). The repeated
    calls alternate between the modes (plain, drop-in, plain, ...), each mode's
    first call made before: a process's calls keep getting faster for a while
    after its first (an H200 ran FP8 plain in 0.93, 0.29, 0.24 s), which a
    mode's calls made in one run would count against the mode run first.
    ``profile_dir``: also one profiled fresh process per row
    (``_profile_fresh``; its path in the row's ``fresh_profile``)."""
    from obskernels.bench.launch import compiled_kernels, compiled_since

    if fresh and fresh_reps < 1:
        raise ValueError(f"fresh_reps must be at least 1 (got {fresh_reps}); fresh=False skips them")
    rows = []
    here: Optional[Dict] = {}  # every kernel variant this process has set up (None: not known)

    def run(scheme, mode):
        nonlocal here
        r = run_once(scheme, mode, shape, device, backend, pipeline)
        here = None if here is None or r["variants"] is None else {**here, **r["variants"]}
        return r

    for scheme in schemes:
        first, first_compiled = {}, {}
        for mode in MODES:
            before = compiled_kernels()
            first[mode] = run(scheme, mode)
            first_compiled[mode] = compiled_since(before)
        again = {mode: [] for mode in MODES}
        for _ in range(reps):
            for mode in MODES:
                again[mode].append(run(scheme, mode))
        fresh_s = {mode: [] for mode in MODES}
        fresh_compiled = {mode: [] for mode in MODES}
        fresh_unseen = {mode: [] for mode in MODES}
        for mode in (fresh_order(fresh_reps) if fresh else []):
            before = compiled_kernels()
            child = _child(scheme, mode, shape, device, backend, pipeline)
            fresh_compiled[mode].append(compiled_since(before))
            fresh_s[mode].append(child["seconds"])
            # the variants the child set up that this process never did: a
            # specialisation of its own (another alignment, say)
            fresh_unseen[mode].append(None if here is None or child["variants"] is None else
                                      _listed({d: v for d, v in child["variants"].items() if d not in here}))
        for mode in MODES:
            times = [r["seconds"] for r in again[mode]]
            row = {"scheme": scheme, "mode": mode, "first_in_process_s": first[mode]["seconds"],
                   "first_in_process_compiled": first_compiled[mode],
                   "first_in_process_variants": _listed(first[mode]["variants"]),
                   "repeat_s": statistics.median(times) if times else None,
                   "reps": reps, "fresh_process_s": statistics.median(fresh_s[mode]) if fresh_s[mode] else None,
                   "fresh_process_samples": fresh_s[mode], "fresh_process_compiled": fresh_compiled[mode],
                   "fresh_process_unseen": fresh_unseen[mode]}
            if profile_dir:
                row["fresh_profile"] = _profile_fresh(scheme, mode, shape, device, backend, pipeline, profile_dir)
            rows.append(row)
            if progress:
                shown = {k: row[k] for k in row if k.endswith(("_s", "_compiled"))}
                progress.write(f"  {scheme} {mode}: {json.dumps(shown)}\n")
        plain, ours = ((again[m] or [first[m]])[-1]["qparams"] for m in MODES)
        same = sum(1 for k in plain if k in ours and _same(plain[k], ours[k]))
        for row in rows[-len(MODES):]:
            row.update(qparam_tensors=len(plain), qparams_identical=same,
                       qparams_keys_match=sorted(plain) == sorted(ours))
    return rows


def _provenance(device: str, shape: Shape, backend: str, pipeline: str) -> Dict:
    import importlib.metadata as md

    import torch

    versions = {}
    for dist in ("torch", "triton", "compressed-tensors", "llmcompressor", "transformers", "obskernels"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    machine = {"platform": platform.platform(), "cpu_cores": os.cpu_count(), "device": device,
               "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    return {"kind": "measured", "what": "seconds of llmcompressor.oneshot(...), synchronised",
            "shape": asdict(shape), "backend": backend, "pipeline": pipeline,
            "machine": machine, "versions": versions}


def table(rows: List[Dict], prov: Dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    fresh_n = max((len(r.get("fresh_process_samples") or ()) for r in rows), default=0)
    head = ["scheme", "mode", "first in process s", f"repeat s (median of {rows[0]['reps'] if rows else 0})",
            f"fresh process s (median of {fresh_n})", "fresh processes s", "qparams identical"]

    def compiled(x, names, unseen=None):
        # seconds, then how many compiles they made and how many variants
        # this process never set up, where there were any
        notes = [f"{len(n)} {what}" for n, what in ((names, "compiled"), (unseen, "unseen")) if n]
        return f(x) + (f" ({', '.join(notes)})" if notes else "")

    lines = [head]
    for r in rows:
        samples = r.get("fresh_process_samples") or ()
        made = r.get("fresh_process_compiled") or [None] * len(samples)
        unseen = r.get("fresh_process_unseen") or [None] * len(samples)
        samples = ", ".join(compiled(*sample) for sample in zip(samples, made, unseen)) or "-"
        first = compiled(r["first_in_process_s"], r.get("first_in_process_compiled"))
        lines.append([r["scheme"], r["mode"], first, f(r["repeat_s"]), f(r["fresh_process_s"]), samples,
                      f"{r['qparams_identical']}/{r['qparam_tensors']}"])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    m, s = prov["machine"], prov["shape"]
    out.append(f"MEASURED on {m['gpu'] or 'the CPU (' + str(m['cpu_cores']) + ' cores, no GPU)'}: "
               f"{s['layers']} Llama layers (hidden {s['hidden']}, intermediate {s['intermediate']}), "
               f"{s['samples']} samples x {s['seq']} tokens, pipeline {prov['pipeline']}, drop-in backend "
               f"{prov['backend']}; versions {json.dumps(prov['versions'])}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m obskernels.bench.oneshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help="comma list of SCHEME[:weight_observer]")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--backend", default="auto", help="the drop-in's obskernels backend (default auto)")
    ap.add_argument("--pipeline", default="basic", help="oneshot's pipeline (basic, sequential, datafree...)")
    ap.add_argument("--reps", type=int, default=3,
                    help="calls after the first, per (scheme, mode), alternating between the modes")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-process first calls")
    ap.add_argument("--fresh-reps", type=int, default=FRESH_REPS,
                    help="fresh processes per (scheme, mode), the modes taking turns (default %(default)s)")
    ap.add_argument("--profile-fresh", action="store_true",
                    help="one more fresh process per row, profiled: OUT/profiles/SCHEME-MODE.txt")
    for field, default in asdict(LLAMA3_8B).items():
        ap.add_argument(f"--{field}", type=int, default=default)
    ap.add_argument("--out", default="bench-out", help="writes oneshot.jsonl and oneshot.md there")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = Shape(**json.loads(a.shape_json)) if a.shape_json else Shape(
        **{k: getattr(a, k) for k in asdict(LLAMA3_8B)})
    schemes = [s for s in a.schemes.split(",") if s]
    if a.child:  # one call, the first in this process
        r = run_once(schemes[0], a.modes.split(",")[0], shape, device, a.backend, a.pipeline, a.profile)
        print(json.dumps({"seconds": r["seconds"], "variants": r["variants"]}))
        return 0
    prov = _provenance(device, shape, a.backend, a.pipeline)
    if a.fresh_reps < 1:
        ap.error(f"--fresh-reps must be at least 1 (got {a.fresh_reps}); --no-fresh skips them")
    rows = compare(schemes, shape, device, a.backend, a.pipeline, a.reps, not a.no_fresh, sys.stderr,
                   os.path.join(a.out, "profiles") if a.profile_fresh else None, a.fresh_reps)
    text = table(rows, prov)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "oneshot.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({**prov, **r}) + "\n")
    with open(os.path.join(a.out, "oneshot.md"), "w") as f:
        f.write("# oneshot: plain llm-compressor vs the drop-in (MEASURED)\n\n```\n" + text + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
