"""Worker of tests/kernels/test_replay.py, run as a script WITHOUT
TRITON_INTERPRET (the kernels must compile, for sm_90, with no GPU: a
recording driver stands in for the launcher, obskernels.bench.launch).

For each case it makes a launch through ``kernels/_replay.Replay`` and the
same launch through Triton's own ``kernel[grid](...)``, and prints one JSON
object per case: which path the Replay took ("replay": the kept kernel,
past Triton's front end; "triton": Triton's launch path, counted at
``JITFunction.run``), whether both launches reached the launcher with the
same compiled kernel (function handle), grid and arguments, or the error
each raised. The test holds the expectations.

A replay on a GPU hands the launcher each tensor's data pointer (an int)
where Triton's launch hands the tensor (``_replay.POINTERS``); here, on CPU
tensors, it does so because the worker says their launches take pointers
(``_replay._hands_pointers``), so that every replay is compared as a GPU's:
the same objects but for the tensors, each replaced by its ``data_ptr()``.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_OFFSET: tl.constexpr = tl.constexpr(1)


class _Pair(NamedTuple):
    ptr: torch.Tensor
    scale: int


@triton.jit(do_not_specialize=["free_n"])
def _probe(x_ptr, y_ptr, n, one, free_n, f, geo, pair, B: tl.constexpr, FLAG: tl.constexpr = False):
    offs = tl.arange(0, B)
    mask = offs < n
    out = tl.load(x_ptr + offs, mask=mask, other=0.0) * f + one + free_n + geo[0] + geo[1]
    out += tl.load(pair[0] + offs, mask=mask, other=0.0) * pair[1] + _OFFSET
    if FLAG:
        out += 1
    tl.store(y_ptr + offs, out, mask=mask)


def _launch_of(recorder, runs, call):
    """(path, record or error) of ``call()``."""
    before_runs, before = runs[0], len(recorder.sink)
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("triton" if runs[0] > before_runs else "replay"), f"{type(exc).__name__}: {exc}"
    path = "triton" if runs[0] > before_runs else "replay"
    records = recorder.sink[before:]
    return path, records[-1] if records else None


def _metadata(m):
    """A launch's metadata as a hook would read it (None without an enter hook)."""
    return None if m is None else (type(m).__name__, m.data, len(m.extras))


def _same_arg(x, y) -> bool:
    """Whether the replay's argument ``x`` is Triton's ``y``: the same object,
    or ``y``'s data pointer for a tensor (fieldwise in a tuple)."""
    if x is y:
        return True
    if isinstance(y, torch.Tensor):
        return type(x) is int and x == y.data_ptr()
    return (isinstance(y, tuple) and type(x) is tuple and len(x) == len(y)
            and all(map(_same_arg, x, y)))


def _holds_tensor(args) -> bool:
    return any(isinstance(a, torch.Tensor) or (isinstance(a, tuple) and _holds_tensor(a)) for a in args)


def _same(a, b) -> dict:
    """Facts about two launcher records (name, grid, stream, function, args,
    (packed metadata, launch metadata, enter hook, exit hook)): ``a`` the
    replay's, ``b`` Triton's."""
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return {"errors": [a if isinstance(a, str) else None, b if isinstance(b, str) else None],
                "same_function": False, "same_args": False, "same_grid": False, "same_launch": False,
                "pointers": False, "hooks_dropped": False}
    (packed_a, meta_a, *hooks_a), (packed_b, meta_b, *hooks_b) = a[5], b[5]
    # hooks that do nothing (None, or a chain holding none: Triton's default)
    # the replay may leave out, with the metadata only hooks read
    dropped = meta_a is None and hooks_a == [None, None] and all(
        h is None or (isinstance(h, triton.knobs.HookChain) and not h.calls) for h in hooks_b)
    same_hooks = _metadata(meta_a) == _metadata(meta_b) and all(x is y for x, y in zip(hooks_a, hooks_b))
    return {"errors": [None, None], "same_function": a[3] == b[3], "same_grid": a[1] == b[1],
            "same_args": len(a[4]) == len(b[4]) and all(map(_same_arg, a[4], b[4])),
            # whether the replay handed pointers only (Triton handed tensors)
            "pointers": _holds_tensor(b[4]) and not _holds_tensor(a[4]),
            # the stream, the packed metadata, the hooks and what they are handed
            "same_launch": a[2] == b[2] and packed_a is packed_b and (same_hooks or dropped),
            # whether the replay left out hooks that do nothing
            "hooks_dropped": dropped and any(h is not None for h in hooks_b)}


def probe_cases(recorder, runs) -> list:
    from obskernels.kernels import _replay

    def base():
        x, y, p = (torch.zeros(64) for _ in range(3))
        return [x, y, 64, 1, 5, 0.5, (16, 1), (p, 2)], {"B": 64}

    def with_(i, v):
        def change(args, kw):
            args[i] = v
        return change

    def kw_(name, v):
        def change(args, kw):
            kw[name] = v
        return change

    buf = torch.zeros(80)
    cases = {
        "new tensors": lambda a, k: a.__setitem__(slice(0, 2), [torch.zeros(64), torch.zeros(64)]),
        "free int changes": with_(4, 7),
        "free int leaves i32": with_(4, 2**31),
        "free int becomes a bool": with_(4, True),
        "float changes": with_(5, 2.0),
        "float becomes an int": with_(5, 2),
        "specialised int changes": with_(2, 48),
        "int 1 becomes True": with_(3, True),  # equal in Python, not to Triton
        "an equal new tuple": with_(6, (16, 1)),
        "tuple field becomes a bool": with_(6, (16, True)),
        "dtype changes": with_(0, torch.zeros(64, dtype=torch.float16)),
        "misaligned tensor": with_(0, buf[1:65]),
        "misaligned tensor in a tuple": with_(7, (buf[1:65], 2)),
        "new tensor in an equal tuple": with_(7, (torch.zeros(64), 2)),
        "dtype changes in a tuple": with_(7, (torch.zeros(64, dtype=torch.float16), 2)),
        "scalar beside a tensor in a tuple changes": with_(7, (torch.zeros(64), 3)),
        "tuple of tensors of another type": with_(7, _Pair(torch.zeros(64), 2)),
        "constexpr changes": kw_("B", 128),
        "default constexpr given": kw_("FLAG", False),
        "constexpr default changes": kw_("FLAG", True),
        "launch option changes": kw_("num_warps", 8),
    }
    out = []

    def run_case(name, change=None, setup=None, teardown=None, kept=None, bound=None):
        """The base call (``kept`` applied) kept by a new Replay holding the
        keywords ``bound`` (its calls leave them out), then ``change``d and
        launched through the Replay and through Triton (``setup`` first)."""
        bound = bound or {}
        replay = _replay.Replay(globals(), "_probe", (1,), **bound)
        args, kw = base()
        kw = {k: v for k, v in kw.items() if k not in bound}
        if kept is not None:
            kept(args, kw)
        replay(*args, **kw)
        if change is not None:
            change(args, kw)
        if setup is not None:
            setup()
        try:
            path, rec = _launch_of(recorder, runs, lambda: replay(*args, **kw))
            _, ref = _launch_of(recorder, runs, lambda: _probe[(1,)](*args, **kw, **bound))
            same = _same(rec, ref)  # (before the teardown: a hook chain is changed in place)
        finally:
            if teardown is not None:
                teardown()
        out.append(dict(case=name, path=path, **same))

    for name, change in cases.items():
        run_case(name, change)
    # a misaligned call kept, then an aligned one: the aligned variant is Triton's choice
    run_case("aligned after a misaligned kept call", with_(0, torch.zeros(64)),
             kept=with_(0, buf[1:65]))
    # the site's own keywords (its constexprs, options), bound once
    run_case("the site's own keywords", with_(0, torch.zeros(64)),
             bound={"B": 64, "num_warps": 2})

    def set_device(d):
        recorder.device = d

    run_case("another device", setup=lambda: set_device(1), teardown=lambda: set_device(0))
    run_case("Triton debug knob", setup=lambda: setattr(triton.knobs.runtime, "debug", True),
             teardown=lambda: setattr(triton.knobs.runtime, "debug", False))

    def hooks(enter, exit_):
        triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook = enter, exit_

    # launch hooks of one's own, a hook added to the default chain, and none
    # (the default is triton's: a chain holding no hook, which the replay
    # leaves out with the launch metadata): the replay hands any hook what
    # Triton's launch does, the launch metadata too
    default = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    run_case("launch hooks", setup=lambda: hooks(lambda m: None, lambda m: None),
             teardown=lambda: hooks(*default))
    chained = lambda m: None  # noqa: E731
    run_case("a hook in the default chain", setup=lambda: default[0].add(chained),
             teardown=lambda: default[0].remove(chained))
    run_case("no launch hooks", setup=lambda: hooks(None, None), teardown=lambda: hooks(*default))
    run_case("a stream of its own", setup=lambda: setattr(recorder, "stream", 7),
             teardown=lambda: setattr(recorder, "stream", 0))
    hook = lambda *a, **k: None  # noqa: E731
    run_case("a pre-run hook", setup=lambda: _probe.pre_run_hooks.append(hook),
             teardown=lambda: _probe.pre_run_hooks.remove(hook))
    run_case("replays off", setup=lambda: setattr(_replay, "ENABLED", False),
             teardown=lambda: setattr(_replay, "ENABLED", True))
    run_case("pointers off", setup=lambda: setattr(_replay, "POINTERS", False),
             teardown=lambda: setattr(_replay, "POINTERS", True))
    saved = globals()["_OFFSET"]
    run_case("a global rebound", setup=lambda: globals().__setitem__("_OFFSET", tl.constexpr(2)),
             teardown=lambda: globals().__setitem__("_OFFSET", saved))
    return out


def observer_cases(recorder, runs, calls: int = 4) -> list:
    """Each host-proxy scenario (and a few more) called ``calls`` times after
    three warm-up calls; every launch the Replay makes past Triton is made again through
    Triton with the same arguments and the two records compared."""
    from obskernels.bench import host
    from obskernels.bench.backends import llmc_available
    from obskernels.kernels import _replay

    checked = []
    original = _replay.Replay.__call__

    def checking(self, *args, **kwargs):
        before_runs, before = runs[0], len(recorder.sink)
        original(self, *args, **kwargs)
        if runs[0] == before_runs and len(recorder.sink) == before + 1:  # replayed
            rec = recorder.sink[-1]
            self.scope[self.name][self.grid](*args, **kwargs, **self.bound)
            checked.append(dict(kernel=self.name, **_same(rec, recorder.sink[-1])))
            recorder.sink.pop()
            runs[0] -= 1  # the check's own launch

    def accumulate():  # what an imatrix observer's forward hook calls, at another shape
        from obskernels import ops

        x = torch.randn(4, 64, 256, dtype=torch.bfloat16)
        total, count = torch.zeros(256), torch.zeros((), dtype=torch.int64)
        return lambda: ops.accumulate_sq(x, total, count)

    def fused_qparams():  # a global scale from fused statistics: one absmax launch per pair
        from obskernels import ops

        def pair(n, dtype):
            return -torch.rand(n, 16).to(dtype), torch.rand(n, 16).to(dtype)

        a, b, c = pair(256, torch.bfloat16), pair(128, torch.float32), pair(64, torch.bfloat16)
        mixed = (c[0], c[1].float())  # widened to the pairs' common dtype first
        args = host._qargs(host._NVFP4)
        return lambda: ops.calculate_qparams(a[0], a[1], args, fused=(a, b, mixed))

    # an activation observer's repeated forward, its observation index counting
    # (mse's: a whole tensor is one group, the search's split path)
    def forward(name):
        from obskernels import Observer

        obs = Observer.load_from_registry(name, base_name="input", args=host._qargs(host._FP8_TENSOR))
        x = torch.randn(4, 64, 256, dtype=torch.bfloat16)
        return lambda: obs(x)

    makers = [(sc.name, lambda sc=sc: host._call_of(sc)) for sc in host.SCENARIOS
              if not sc.drop_in or llmc_available()]
    makers += [(f"{name} forward", lambda name=name: forward(name)) for name in ("minmax", "mse")]
    out = []
    _replay.Replay.__call__ = checking
    try:
        for name, make in makers + [("accumulate_sq", accumulate), ("fused calculate_qparams", fused_qparams)]:
            fn = make()
            for _ in range(3):  # a repeated forward's third call is its first ticketed launch
                fn()
            checked.clear()
            runs[0], launches = 0, len(recorder.sink)
            for _ in range(calls):
                fn()
            out.append(dict(case=name, launches=len(recorder.sink) - launches,
                            triton_runs=runs[0], replays=list(checked)))
    finally:
        _replay.Replay.__call__ = original
    return out


def main() -> int:
    import warnings

    from obskernels.bench.launch import compiled_on_cpu, triton_runs

    from obskernels.kernels import _replay

    warnings.simplefilter("ignore")
    part = sys.argv[1]
    _replay._hands_pointers = lambda tensors: True  # every replay as a GPU's (see above)
    with compiled_on_cpu() as recorder, triton_runs() as runs:
        rows = probe_cases(recorder, runs) if part == "probe" else observer_cases(recorder, runs)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
