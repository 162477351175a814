"""The kernels as a GPU compiler sees them, checked without a GPU.

The interpreter runs a kernel as Python, so it accepts what triton's compiler
rejects (a plain module global read inside @jit, a Python-only construct) and
never specialises launch arguments. This file runs itself as a script in a
subprocess without TRITON_INTERPRET: the launchers are called on tiny CPU
tensors with every kernel wrapped by a recorder (nothing runs), each launch is
bound and specialised as triton's runtime does it for an sm_90 target, and
each distinct specialisation is lowered by triton's front end to Triton IR
(no ptxas, no device). The tests then check that

- every kernel of kernels/ is launched by some case, and every variant lowers;
- no kernel calls libdevice (extern elementwise ops fail in the interpreter
  and docs/spec.md §6 rules them out);
- the MSE search compiles one variant per kernel whatever the grid, patience,
  maxshrink, expand and (non-special) norm: runtime scalars that follow the
  search parameters are not specialised on.

Register counts and spills need ptxas and take seconds per kernel: that check
is a one-off, reported in the review notes, not part of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kernel

KERNEL_MODULES = ("min_max", "flatten", "accumulate_sq", "mse_search")


@pytest.fixture(scope="module")
def probe():
    env = dict(os.environ, PYTHONSAFEPATH="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_is_launched(probe):
    missing = sorted(set(probe["kernels"]) - {v["kernel"] for v in probe["variants"]})
    assert not missing, f"no probe case launches {missing}: add one to _cases()"


def test_every_variant_lowers_to_triton_ir(probe):
    bad = [f"{v['kernel']} ({v['case']}): {v['error']}" for v in probe["variants"] if v["error"]]
    assert not bad, "\n".join(bad)


def test_no_libdevice(probe):
    bad = [f"{v['kernel']} ({v['case']})" for v in probe["variants"] if v["extern"]]
    assert not bad, f"libdevice (extern elementwise) calls in: {bad}"


@pytest.mark.parametrize("tag", ("params-small", "params-split"))
def test_search_parameters_do_not_recompile(probe, tag):
    per_kernel: dict[str, set] = {}
    for launch in probe["launches"]:
        if launch["tag"] == tag:
            per_kernel.setdefault(launch["kernel"], set()).add(launch["key"])
    assert per_kernel, f"no launches tagged {tag}"
    many = {k: len(v) for k, v in per_kernel.items() if len(v) != 1}
    assert not many, f"{tag}: compiled variants per kernel {many} (want 1 each)"


# --------------------------------------------------------------------------- #
# the probe (runs in the subprocess, without the interpreter)
# --------------------------------------------------------------------------- #
def _cases():
    """(case, tag, module, config fields, call) covering each kernel and each
    value of its mode switches at least once; tiny CPU tensors."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs as QA

    bf, f16 = torch.bfloat16, torch.float16
    r = torch.randn
    mse = dict(maxshrink=0.2, patience=5, grid=100, norm=2.4)
    imx = dict(maxshrink=0.95, patience=5, grid=20, norm=3.0, flavour="imatrix")
    gpu = dict(steps_per_iter=1)  # the choice a GPU makes
    split = dict(max_reg_group=64, chunk=64, split=2)
    g_idx = (torch.arange(64) // 16)[torch.randperm(64)]
    nvfp4 = dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.float8_e4m3fn)
    cases = [
        ("tensor", "", "min_max", {}, lambda m: m.min_max(r(17, 33, dtype=bf), "weight", QA(num_bits=8, strategy="tensor"))),
        ("channel", "", "min_max", {}, lambda m: m.min_max(r(9, 40, dtype=f16), "weight", QA(num_bits=8, strategy="channel"))),
        ("g_idx", "", "min_max", {}, lambda m: m.min_max(r(5, 64), "weight", QA(num_bits=8, strategy="group", group_size=16), g_idx=g_idx)),
        ("block", "", "min_max", {}, lambda m: m.min_max(r(17, 33), "weight", QA(num_bits=8, strategy="block", block_structure=[8, 16]))),
        ("attn_head", "", "min_max", {}, lambda m: m.min_max(r(2, 9, 3, 16, dtype=bf).transpose(1, 2), "q", QA(num_bits=8, strategy="attn_head"))),
        ("split", "", "min_max", dict(tile=16, split=3), lambda m: m.min_max(r(19, 40, dtype=bf), "weight", QA(num_bits=8, strategy="tensor"))),
        ("block", "", "flatten", {}, lambda m: m.flatten_for_calibration(r(17, 33, dtype=bf), "weight", QA(num_bits=8, strategy="block", block_structure=[8, 16]))),
        ("g_idx", "", "flatten", {}, lambda m: m.flatten_for_calibration(r(5, 64), "weight", QA(num_bits=8, strategy="group", group_size=16), g_idx=g_idx)),
        ("add", "", "accumulate_sq", {}, lambda m: m.accumulate_sq(r(2, 7, 48, dtype=bf), torch.zeros(48), torch.zeros(1, dtype=torch.int64))),
        ("split", "", "accumulate_sq", dict(tile=64, split=2), lambda m: m.accumulate_sq(r(26, 40, dtype=f16), torch.zeros(40), torch.zeros(1, dtype=torch.int64))),
        ("int4-asym", "", "mse_search", gpu, lambda m: m.mse_search(r(8, 64, dtype=bf), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=16), **mse)),
        ("fp8-asym", "", "mse_search", gpu, lambda m: m.mse_search(r(8, 33, dtype=f16), "weight", QA(num_bits=8, type="float", symmetric=False, strategy="channel"), **dict(mse, norm=2.0))),
        ("mxfp4", "", "mse_search", gpu, lambda m: m.mse_search(r(4, 64), "weight", QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8), **dict(mse, norm=0.5))),
        ("nvfp4-group", "", "mse_search", gpu, lambda m: m.mse_search(r(4, 64, dtype=bf), "weight", QA(strategy="group", group_size=16, **nvfp4), **dict(mse, norm=1.0))),
        ("imatrix", "", "mse_search", gpu, lambda m: m.mse_search(r(8, 48), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(48), **imx)),
        ("block-pad", "", "mse_search", gpu, lambda m: m.mse_search(r(10, 10, dtype=bf), "weight", QA(num_bits=8, strategy="block", block_structure=[4, 4]), **mse)),
        ("steps-4", "", "mse_search", dict(steps_per_iter=4), lambda m: m.mse_search(r(8, 64, dtype=bf), "weight", QA(num_bits=4, strategy="group", group_size=16), **mse)),
        ("split-block-pad", "", "mse_search", dict(split, **gpu), lambda m: m.mse_search(r(20, 20), "weight", QA(num_bits=4, symmetric=False, strategy="block", block_structure=[16, 16]), **imx)),
        ("split-importance", "", "mse_search", dict(split, **gpu), lambda m: m.mse_search(r(3, 300, dtype=f16), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(300), **imx)),
    ]
    # Search parameters only: same format, shape and mode switches each time.
    for grid, patience, maxshrink, expand, norm in [
        (100, 5, 0.2, 1.0, 2.4), (80, 1, 0.2, 1.0, 2.4), (200, 1000, 1 - 0.8 / 1.8, 1.8, 1.7),
        (40, 0, 0.5, 1.2, 2.4), (32, 16, 0.5, 1.0, 7.3),
    ]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, expand=expand, norm=norm)
        cases.append(("nvfp4", "params-small", "mse_search", gpu,
                      lambda m, kw=kw: m.mse_search(r(8, 64, dtype=bf), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **kw)))
    # the split path's step buffers are sized by a power of two of the steps: stay in one
    for grid, patience, maxshrink in [(100, 5, 0.2), (90, 1, 0.2), (125, 16, 0.2), (17, 0, 1.0)]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, norm=2.4)
        cases.append(("tensor", "params-split", "mse_search", dict(split, **gpu),
                      lambda m, kw=kw: m.mse_search(r(9, 70, dtype=bf), "weight", QA(num_bits=8, strategy="tensor"), **kw)))
    return cases


def _probe() -> dict:
    import dataclasses
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 64)
    backend = make_backend(target)
    modules = {n: importlib.import_module(f"obskernels.kernels.{n}") for n in KERNEL_MODULES}
    launches = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.fn, args, kwargs))

    kernels = []
    for mname, module in modules.items():
        for attr, fn in list(vars(module).items()):
            if isinstance(fn, JITFunction) and attr.endswith("_kernel"):
                kernels.append(f"{mname}.{attr}")
                setattr(module, attr, Recorder(f"{mname}.{attr}", fn))

    variants, rows = {}, []
    for case, tag, mname, fields, call in _cases():
        module = modules[mname]
        default = module.CONFIG
        module.CONFIG = dataclasses.replace(default, **fields)
        launches.clear()
        try:
            call(module)
        finally:
            module.CONFIG = default
        for name, fn, args, kwargs in launches:
            # bind and specialise exactly as JITFunction.run does
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            key = repr((name, spec, sorted(options.items())))
            rows.append(dict(tag=tag, kernel=name, key=key))
            if key in variants:
                continue
            opts, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            opts = backend.parse_options(dict(opts.__dict__))
            ctx = ir.context()
            ir.load_dialects(ctx)
            backend.load_dialects(ctx)
            error, extern = None, False
            try:
                src = ASTSource(fn, signature, constexprs, attrs)
                mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts),
                                  backend.get_module_map(), ctx)
                extern = "extern_elementwise" in str(mod)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                while exc.__cause__ is not None:  # the compiler's root cause names the line
                    exc = exc.__cause__
                error = f"{type(exc).__name__}: {exc}"[:2000]
            variants[key] = dict(kernel=name, case=f"{mname} {case}", error=error, extern=extern)
    return dict(kernels=kernels, variants=list(variants.values()), launches=rows)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET")
    print(json.dumps(_probe()))
