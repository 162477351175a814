"""Compiling each variant for sm_90a and profiling launches.

A launch is specialised as triton's runtime does it (``_specialise``: the
variant key), compiled for sm_90a with triton's bundled ptxas and read back
with its cuobjdump (``compile_variant``: registers, spills, shared memory,
SASS per element by pipe, the hot loop's shared memory and layout
conversions, approximate instructions). ``program_profile`` and
``launch_work`` scale a variant's counts by a launch's arguments (what one
program issues per element of the value; element-steps of the hot loop);
``profile_launches`` is the benchmark's entry, ``probe`` the compile
check's and the command line's: every case recorded, each variant compiled
once.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from typing import Dict, List, Optional

from obskernels.tools.kernel_report.launches import Launch, discover_kernels, record
from obskernels.tools.kernel_report.machine import (
    _SHARED,
    PIPES,
    cross_warp_reductions,
    hot_loop,
    issue_seconds,
    local_memory_ops,
    moving_conversion,
    parse_sass,
    pipe_of,
    program_path,
    ttgir_hot_loop,
    unroll_factor,
    warps_per_sm,
)
from obskernels.tools.kernel_report.probe_cases import cases


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _specialise(launch: Launch):
    """(variant key, ASTSource, options, constexprs by name) as JITFunction.run
    builds them for an sm_90 target."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from obskernels.kernels._cache_keys import settle

    backend = make_backend(_target())
    fn = launch.fn
    settle(fn)  # its cache key as a launch makes it
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    key = repr((launch.kernel, spec, sorted(options.items())))
    opts, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    names = {p.name: bound.get(p.name) for p in fn.params if p.is_constexpr}
    return key, src, opts, names


_APPROX = re.compile(r"\b([a-z0-9]+(?:\.[a-z0-9]+)*\.(?:approx|full)(?:\.[a-z0-9]+)*)\b")


# elements one iteration of the hot loop handles, by kernel (constexpr names
# multiplied); default: the product of every BLOCK_* constexpr
_ITER_ELEMS = {
    # BLOCK_J (groups sharing an importance read) tiles BLOCK_G: not a factor
    "_search_kernel": ("BLOCK_G", "BLOCK_E", "BLOCK_S"),
    "_search_part_kernel": ("ROWS", "BLOCK_E", "BLOCK_SB"),
    "_choose_kernel": ("BLOCK_G",),
    # BLOCK_S: the lanes of a split's finishing step, not of the main loop
    "_min_max_kernel": ("BLOCK_A", "BLOCK_B", "BLOCK_R", "BLOCK_E"),
}
# kernels whose hot loop is the search's step loop: counts are per element AND step
_SEARCH = ("_search_kernel", "_search_part_kernel")


def _iter_elems(kernel: str, constexprs: Dict) -> int:
    attr = kernel.split(".")[-1]
    names = _ITER_ELEMS.get(attr) or [n for n in constexprs if n.startswith("BLOCK_")]
    return math.prod(int(constexprs[n]) for n in names) if names else 1


# The streaming kernels' programs: (trips of the main loop, elements of the
# value one program covers) from a launch's bound arguments and grid, for the
# first program (full blocks of groups, a full row range).
def _groups(a):
    QB = int(a["geo"].QB)
    QA = int(a["Q"]) // QB
    return min(int(a["BLOCK_A"]), QA) * min(int(a["BLOCK_B"]), QB)


def _stream_program(a, grid, rows_name):
    E = int(a["geo"].E)
    if a.get("GROUP_LOOP"):  # a loop over the blocks of a block column, one step each
        QB = int(a["geo"].QB)
        n_b = _cdiv(QB, a["BLOCK_B"])
        per = _cdiv(_cdiv(int(a["Q"]) // QB, a["BLOCK_A"]), grid[0] // n_b)
        return per, per * _groups(a) * E
    rows = min(int(a[rows_name]), int(a["NR"]))
    steps = _cdiv(rows, a["BLOCK_R"]) * _cdiv(E, a["BLOCK_E"])
    return steps, _groups(a) * rows * E


_PROGRAM = {
    "_min_max_kernel": lambda a, g: _stream_program(a, g, "rows_per_split"),
    "_flatten_kernel": lambda a, g: _stream_program(a, g, "rows_per_program"),
    "_sum_sq_kernel": lambda a, g: (
        _cdiv(min(int(a["tokens_per_split"]), int(a["NT"])), a["BLOCK_T"]),
        min(int(a["tokens_per_split"]), int(a["NT"])) * min(int(a["BLOCK_H"]), int(a["H"]))),
}


def _bound(launch: Launch) -> Dict:
    """The launch's arguments by name, bound as triton's runtime binds them."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(_target()))
    return binder(*launch.args, **launch.kwargs)[0]


def program_profile(launch: Launch, variant: Dict) -> Optional[Dict]:
    """What one program of ``launch`` issues per element of the value it
    covers, from its variant's record (``program_loop`` / ``program_once``:
    instructions by pipe of the main loop and of the rest, per thread) and the
    launch's arguments: (main loop x trips + the rest) / elements per thread.
    None for kernels without a program model (the search's, qparams')."""
    model = _PROGRAM.get(launch.kernel.split(".")[-1])
    if model is None or variant.get("error") or "program_loop" not in variant:
        return None
    trips, elems = model(_bound(launch), launch.grid)
    per_thread = max(elems, 1) / (32 * variant["num_warps"])
    pipes = {p: (variant["program_loop"][p] * max(trips, 0) + variant["program_once"][p]) / per_thread
             for p in PIPES}
    return dict(sass_per_elem_program=sum(pipes.values()), pipes_program=pipes,
                program_trips=int(trips), program_elems=int(elems))


def _run(cmd: List[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _sass_cache_dir() -> str:
    return os.environ.get("OBSKERNELS_SASS_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "obskernels", "sass"))


def _disassemble(cubin: bytes) -> tuple:
    """(resource usage, SASS listing) of a cubin by the bundled cuobjdump, cached
    on disk by the cubin's hash (the tool costs a second or more per call on a
    loaded machine; a cubin's listing never changes)."""
    import hashlib

    key = hashlib.sha256(cubin).hexdigest()
    path = os.path.join(_sass_cache_dir(), key + ".json")
    try:
        with open(path) as f:
            cached = json.load(f)
        return cached["usage"], cached["sass"]
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        cub = os.path.join(tmp, "k.cubin")
        with open(cub, "wb") as f:
            f.write(cubin)
        text = _run([_bin("cuobjdump"), "-res-usage", "-sass", cub])
    usage = "\n".join(line for line in text.splitlines() if "REG:" in line)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp_path = f"{path}.{os.getpid()}"
        with open(tmp_path, "w") as f:
            json.dump({"usage": usage, "sass": text}, f)
        os.replace(tmp_path, path)
    except OSError:  # a read-only home: no cache, same result
        pass
    return usage, text


def compile_variant(launch: Launch) -> Dict:
    """Compiles the launch's variant for sm_90a and measures it (see the
    module docstring). Errors are returned in ``error``, not raised."""
    import triton

    key, src, opts, constexprs = _specialise(launch)
    rec = dict(kernel=launch.kernel, variant=_variant_name(launch, constexprs), case=launch.case,
               key=key, error=None, num_warps=int(opts.num_warps),
               constexprs={n: (v if isinstance(v, (bool, int, float, str)) else repr(v))
                           for n, v in constexprs.items() if v is not None})
    try:
        k = triton.compile(src, target=_target(), options=opts.__dict__)
    except Exception as exc:  # noqa: BLE001 - reported by the test and the report
        while exc.__cause__ is not None:  # the compiler's root cause names the line
            exc = exc.__cause__
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return rec
    usage, sass = _disassemble(k.asm["cubin"])
    res = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    instrs = parse_sass(sass)
    main, once = program_path(instrs)
    # the hot loop: a streaming kernel's main loop (the loop over a split's
    # partials, run by one program per block, can be larger), else the
    # largest innermost loop (the search's step loop)
    streaming = launch.kernel.split(".")[-1] in _PROGRAM
    loop = main if streaming and main else hot_loop(instrs)
    body = instrs[loop[0]:loop[1] + 1] if loop else instrs
    threads = 32 * rec["num_warps"]
    per_thread = max(_iter_elems(launch.kernel, constexprs) / threads, 1e-9)
    pipes = dict.fromkeys(PIPES, 0)
    for _, op, _ in body:
        pipes[pipe_of(op)] += 1

    def by_pipe(indices):
        counts = dict.fromkeys(PIPES, 0)
        for i in indices:
            counts[pipe_of(instrs[i][1])] += 1
        return counts

    local_ops = local_memory_ops(instrs)
    stack, local = int(res.get("STACK", 0)), int(res.get("LOCAL", 0))
    shared = max(int(res.get("SHARED", 0)), int(k.metadata.shared))
    hot_ir = ttgir_hot_loop(k.asm["ttgir"], streaming)
    rec.update(
        registers=int(res.get("REG", 0)),
        stack=stack,
        local=local,
        local_ops=local_ops,
        # local memory in use: its bytes and the instructions touching it (a
        # stack frame counts where some instruction does)
        spills=local + local_ops + (stack if local_ops else 0),
        shared=shared,
        warps_per_sm=warps_per_sm(int(res.get("REG", 0)), shared, rec["num_warps"]),
        sass_total=len(instrs),
        loop_sass=len(body),
        loop_shared=sum(op.split(".")[0] in _SHARED for _, op, _ in body) if loop else 0,
        loop_barriers=sum(op.split(".")[0] == "BAR" for _, op, _ in body) if loop else 0,
        loop_conversions=sum(moving_conversion(line) for line in hot_ir),
        loop_cross_warp=cross_warp_reductions(k.asm["ttgir"], hot_ir),
        loop="step" if loop and launch.kernel.split(".")[-1] in _SEARCH else ("tile" if loop else "none"),
        elems_per_thread=per_thread,
        sass_per_elem_step=len(body) / per_thread,
        pipes={p: n / per_thread for p, n in pipes.items()},
        approx=sorted(set(_APPROX.findall(k.asm["ptx"]))),
        # linked and inlined: the names survive in the labels (%__nv_exp2f.exit12)
        libdevice=sorted(set(re.findall(r"__nv_([a-z0-9_]+?)(?:\.|\b)", k.asm["llir"]))),
        extern="extern_elementwise" in k.asm["ttir"],
        fast=bool(constexprs.get("FAST", False)),
        # one step of the main loop (a pass of an unrolled one runs several)
        program_loop={p: n / (unroll_factor(instrs, main) if main else 1) for p, n in
                      by_pipe(range(main[0], main[1] + 1) if main else ()).items()},
        program_once=by_pipe(once),
    )
    rec.update(program_profile(launch, rec) or dict(sass_per_elem_program=None))
    return rec


def _cdiv(a, b) -> int:
    return -(-int(a) // max(int(b), 1))


def launch_work(launch: Launch) -> float:
    """Element-steps one launch issues the hot loop for: programs x elements per
    iteration x iterations (trip counts from the launch's arguments; the
    search's step loop runs every step). Multiply by ``sass_per_elem_step``
    for the instructions the launch issues (its loop; the prologue is left out)."""
    constexprs = _specialise(launch)[3]
    a = _bound(launch)
    attr = launch.kernel.split(".")[-1]
    trips = {
        "_search_kernel": lambda: _cdiv(a["n_steps"], a["BLOCK_S"]),
        "_search_part_kernel": lambda: int(a["chunks_per_split"]) * _cdiv(a["n_steps"], a["BLOCK_SB"]),
        "_minmax_part_kernel": lambda: int(a["chunks_per_split"]),
        "_min_max_kernel": lambda: _cdiv(a["rows_per_split"], a["BLOCK_R"]) * _cdiv(a["geo"].E, a["BLOCK_E"]),
        "_sum_sq_kernel": lambda: _cdiv(a["tokens_per_split"], a["BLOCK_T"]),
        "_choose_kernel": lambda: int(a["n_steps"]),
    }.get(attr, lambda: 1)
    n = trips()  # a kernel whose arguments were renamed fails here, not silently
    return math.prod(launch.grid) * _iter_elems(launch.kernel, constexprs) * max(n, 1)


def profile_launches(launches: List[Launch], cache: Optional[Dict] = None) -> List[Dict]:
    """Per launch: its variant's machine-code record (compiled once per key,
    ``cache`` shared between calls), element-steps, and modelled issue seconds
    on an H100 SXM."""
    cache = {} if cache is None else cache
    out = []
    for launch in launches:
        key = _specialise(launch)[0]
        if key not in cache:
            cache[key] = compile_variant(launch)
        v = cache[key]
        rec = {k: v.get(k) for k in ("kernel", "variant", "error", "registers", "spills",
                                     "sass_per_elem_step", "pipes", "loop", "loop_shared",
                                     "loop_conversions", "loop_cross_warp", "warps_per_sm")}
        if not v["error"]:
            prog = program_profile(launch, v)
            if prog is not None:  # the whole program: value elements x per-element counts
                rec["sass_per_elem_program"] = prog["sass_per_elem_program"]
                rec["elem_steps"] = _program_elements(launch, prog)
                rec["issue_s"] = issue_seconds(prog["pipes_program"], rec["elem_steps"])
            else:
                rec["elem_steps"] = launch_work(launch)
                rec["issue_s"] = issue_seconds(v["pipes"], rec["elem_steps"])
        out.append(rec)
    return out


def _program_elements(launch: Launch, prog: Dict) -> float:
    """Elements a launch's programs cover, all of them as full as the first
    (an upper bound where the last block or row range is partial)."""
    return math.prod(launch.grid) * prog["program_elems"]


def _variant_name(launch: Launch, constexprs: Dict) -> str:
    shown = ", ".join(f"{n}={int(v) if isinstance(v, bool) else v}" for n, v in constexprs.items()
                      if v is not None and not n.startswith("num_"))
    return f"{shown}, warps={launch.kwargs.get('num_warps', 4)}"


def _elem_bytes(launch: Launch) -> Optional[int]:
    """Bytes per element of the value a launch streams (its first argument)."""
    first = launch.args[0] if launch.args else None
    return first.element_size() if hasattr(first, "element_size") else None


def probe(selected: Optional[str] = None) -> Dict:
    """Records every case's launches, compiles each distinct variant once.
    Returns {"triton": its version, "kernels": [...discovered], "variants": [...records],
    "launches": [{"case", "tag", "kernel", "key", "variant", "targets", "elem_bytes",
    "sass_per_elem_program", "program_trips", "program_elems"}]}: per launch,
    what its program issues per element at that case's shape, and whether
    the case is held to the instruction targets (``Case.targets``)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("the compile probe must run without TRITON_INTERPRET")
    kernels = discover_kernels()
    calls = [(c.name, c.tag, c.module, c.config, c.call) for c in cases()
             if selected is None or selected in c.module]
    launches = record(calls, kernels)
    held = {(c.name, c.module) for c in cases() if c.targets}
    variants: Dict[str, Dict] = {}
    rows = []
    for launch in launches:
        key = _specialise(launch)[0]
        if key not in variants:
            variants[key] = compile_variant(launch)
            variants[key]["case"] = f"{launch.kernel.split('.')[0]} {launch.case}"
        prog = program_profile(launch, variants[key]) or {}
        rows.append(dict(case=launch.case, tag=launch.tag, kernel=launch.kernel, key=key,
                         variant=variants[key]["variant"],
                         targets=(launch.case, launch.kernel.split(".")[0]) in held,
                         elem_bytes=_elem_bytes(launch),
                         sass_per_elem_program=prog.get("sass_per_elem_program"),
                         program_trips=prog.get("program_trips"),
                         program_elems=prog.get("program_elems")))
    import triton

    return dict(kernels=sorted(kernels), variants=list(variants.values()), launches=rows,
                triton=triton.__version__)

