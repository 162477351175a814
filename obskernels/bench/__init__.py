"""obskernels.bench: the benchmark harness (``python -m obskernels.bench``).

Modules: ``cases`` (the sweep, shared with tests/ and benchmarks/), ``traffic``
(byte / launch counters: a TorchDispatchMode and triton-interpreter hooks),
``model`` (the roofline model and compulsory traffic), ``backends`` (how each
backend runs a case), ``records`` (one result: a frozen dataclass and its JSON
keys), ``runner`` (measure and model), ``report`` (table, JSONL, report.md,
plots). See README.md beside this file for how to read the output.
"""
