"""The probe's cases: every launcher called on representative shapes.

Each ``Case`` is one launcher call on CPU tensors whose values nothing reads
(no launch runs: the probe records them), under the GPU's launch
configuration plus the case's fields: the shapes observers see (docs/spec.md
§2-§4: a 4096 x 4096 weight in the formats the observers use, activations,
attention), every mode switch of each kernel at least once, and the real
sizes (>= 64 MB) whose streaming launches are held to the instruction
targets of the compile check (``Case.targets``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List


@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call. ``call(module)`` runs it (tensors on the CPU);
    ``config``: LaunchConfig fields on top of the GPU's launch configuration;
    ``tag`` groups calls whose launches must share one variant per kernel;
    ``targets``: a real size (>= 64 MB where the layout allows), whose
    streaming launches are held to the instructions-per-element targets of
    the compile check."""

    name: str
    module: str
    call: Callable
    config: Dict = dataclasses.field(default_factory=dict)
    tag: str = ""
    targets: bool = False


def cases() -> List[Case]:
    """The probe's calls: each kernel and each value of its mode switches at
    least once, at the shapes observers see (weights 4096 x 4096; the small
    shapes only where a mode needs them, e.g. the no-recompile sweeps)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs as QA

    from obskernels.spec import calls
    from obskernels.spec.record import STATUS_INIT

    def checked(launcher, *args, **kwargs):  # a launcher takes its call checked
        return launcher(getattr(calls, launcher.__name__)(*args, **kwargs))

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32

    def w(*shape, dtype=bf):  # nothing reads the values: no launch runs
        return torch.empty(*shape, dtype=dtype)

    W = (4096, 4096)
    mse = dict(maxshrink=0.2, patience=5, grid=100, norm=2.4)
    imx = dict(maxshrink=0.95, patience=5, grid=20, norm=3.0, flavour="imatrix")
    nvx = dict(maxshrink=1 - 0.8 / 1.8, patience=1000, grid=200, norm=2.4, expand=1.8)
    nvfp4 = dict(num_bits=4, type="float", symmetric=True, scale_dtype=torch.float8_e4m3fn)
    g128 = QA(num_bits=4, strategy="group", group_size=128)
    g_idx = (torch.arange(4096) // 128)[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    imp = torch.rand(4096, generator=torch.Generator().manual_seed(0)) + 0.5
    C = lambda *a, **k: Case(*a, **k)  # noqa: E731
    out = [
        C("weight int4 g128", "min_max", lambda m: checked(m.min_max, w(*W), "weight", g128)),
        C("weight tensor (split)", "min_max", lambda m: checked(m.min_max, w(*W), "weight", QA(num_bits=8, strategy="tensor"))),
        C("weight channel fp16", "min_max", lambda m: checked(m.min_max, w(*W, dtype=f16), "weight", QA(num_bits=8, strategy="channel"))),
        C("weight g_idx g128", "min_max", lambda m: checked(m.min_max, w(*W), "weight", g128, g_idx=g_idx)),
        C("qparams int4 g32 asym, record (small value: the epilogue)", "min_max", lambda m: checked(m.min_max_qparams, w(*W), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=32), record=True)),
        C("weight block 128 partial (pad)", "min_max", lambda m: checked(m.min_max, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("weight block 8x16 partial fp32 (pad)", "min_max", lambda m: checked(m.min_max, w(4097, 4095, dtype=f32), "weight", QA(num_bits=8, strategy="block", block_structure=[8, 16]))),
        C("weight block 128 transposed (pad)", "min_max", lambda m: checked(m.min_max, w(4000, 4000).t(), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("act token", "min_max", lambda m: checked(m.min_max, w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True))),
        C("attn_head q", "min_max", lambda m: checked(m.min_max, w(1, 2048, 32, 128).transpose(1, 2), "q", QA(num_bits=8, strategy="attn_head"))),
        C("block 128 partial (pad)", "flatten", lambda m: checked(m.flatten_for_calibration, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]))),
        C("g_idx g128", "flatten", lambda m: checked(m.flatten_for_calibration, w(*W), "weight", g128, g_idx=g_idx)),
        C("act (1, 7, 4096) add", "accumulate_sq", lambda m: checked(m.accumulate_sq, w(1, 7, 4096), torch.zeros(4096), torch.zeros(1, dtype=torch.int64))),
        C("act (8, 2048, 4096) split", "accumulate_sq", lambda m: checked(m.accumulate_sq, w(8, 2048, 4096), torch.zeros(4096), torch.zeros(1, dtype=torch.int64))),
        C("int4 g128 sym norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **mse)),
        C("int4 g128 asym norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=128), **mse)),
        C("int4 g128 norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **dict(mse, norm=2.0))),
        C("nvfp4 g16 (expanded)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **nvx)),
        C("imatrix int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, **imx)),
        C("int8 channel norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, strategy="channel"), **mse)),
        C("fp8 block 128 (split)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse)),
        C("fp8 block 128 partial (split, pad)", "mse_search", lambda m: checked(m.mse_search, w(4000, 4000), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse)),
        C("int8 block 4 partial (pad)", "mse_search", lambda m: checked(m.mse_search, w(10, 10), "weight", QA(num_bits=8, strategy="block", block_structure=[4, 4]), **mse)),
        C("fp8 asym channel fp16 norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f16), "weight", QA(num_bits=8, type="float", symmetric=False, strategy="channel"), **dict(mse, norm=2.0))),
        C("mxfp4 g32 fp32 norm 0.5", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f32), "weight", QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8), **dict(mse, norm=0.5))),
        C("imatrix int8 channel 16384 (split)", "mse_search", lambda m: checked(m.mse_search, w(512, 16384, dtype=f16), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(16384) + 0.5, **imx)),
    ]
    # Real sizes (>= 64 MB, 112 MB for a 14336 x 4096 bf16 weight): every layout
    # a streaming launcher can choose, in fp32 / fp16 / bf16, held to the
    # instructions-per-element targets of the compile check (``targets``).
    g_idx14 = (torch.arange(4096) // 128)[torch.randperm(4096, generator=torch.Generator().manual_seed(1))]
    blk = lambda h, w_, t="float": QA(num_bits=8, type=t, strategy="block", block_structure=[h, w_])  # noqa: E731
    held_stats = lambda n, dt: (torch.zeros(n, dtype=dt), torch.ones(n, dtype=dt))  # noqa: E731
    R = lambda *a, **k: Case(*a, targets=True, **k)  # noqa: E731
    mm = lambda name, value, base, args, **kw: R(  # noqa: E731
        f"64MB {name}", "min_max", lambda m: checked(m.min_max, value(), base, args, **kw))
    out += [
        mm("weight int4 g128 bf16 14336x4096", lambda: w(14336, 4096), "weight", g128),
        mm("weight int4 g32 asym bf16 14336x4096 (whole groups, one step)", lambda: w(14336, 4096), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=32)),
        mm("weight nvfp4 g16 bf16 14336x4096", lambda: w(14336, 4096), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4)),
        mm("weight mxfp4 g32 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8)),
        mm("weight int8 g64 fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), "weight", QA(num_bits=8, strategy="group", group_size=64)),
        mm("weight channel fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight channel fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight channel bf16 14336x4096 transposed", lambda: w(4096, 14336).t(), "weight", QA(num_bits=8, strategy="channel")),
        mm("weight tensor bf16 8192x4096 (split)", lambda: w(8192, 4096), "weight", QA(num_bits=8, strategy="tensor")),
        mm("weight tensor fp32 4096x4096 transposed (split)", lambda: w(4096, 4096, dtype=f32).t(), "weight", QA(num_bits=8, strategy="tensor")),
        mm("weight g_idx g128 bf16 14336x4096", lambda: w(14336, 4096), "weight", g128, g_idx=g_idx14),
        mm("weight block 128 bf16 8192x4096", lambda: w(8192, 4096), "weight", blk(128, 128)),
        mm("weight block 128 partial (pad) bf16 8000x4000", lambda: w(8000, 4000), "weight", blk(128, 128)),
        mm("weight block 128 transposed (pad) bf16 8000x4000", lambda: w(4000, 8000).t(), "weight", blk(128, 128)),
        mm("weight block 8x16 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), "weight", blk(8, 16, "int")),
        mm("weight block 128 partial (pad) fp16 4000x8000", lambda: w(4000, 8000, dtype=f16), "weight", blk(128, 128)),
        mm("act token 3-D bf16 (4, 2048, 4096)", lambda: w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True)),
        mm("act token 2-D fp16 (8192, 4096) (split)", lambda: w(8192, 4096, dtype=f16), "input", QA(num_bits=8, strategy="token", dynamic=True)),
        mm("act tensor bf16 (2, 4096, 4096) (split)", lambda: w(2, 4096, 4096), "input", QA(num_bits=8, strategy="tensor")),
        mm("act group g128 bf16 (2, 4096, 4096) (split)", lambda: w(2, 4096, 4096), "input", g128),
        mm("act tensor_group 16 fp32 (4096, 4096)", lambda: w(4096, 4096, dtype=f32), "input", QA(strategy="tensor_group", group_size=16, **nvfp4)),
        mm("attn_head q bf16 (4, 32, 2048, 128) (split)", lambda: w(4, 2048, 32, 128).transpose(1, 2), "q", QA(num_bits=8, strategy="attn_head")),
        mm("attn tensor k fp16 (4, 32, 2048, 128) (split)", lambda: w(4, 32, 2048, 128, dtype=f16), "k", QA(num_bits=8, strategy="tensor")),
        mm("act token 3-D bf16 running, record", lambda: w(4, 2048, 4096), "input", QA(num_bits=8, strategy="token", dynamic=True), held=held_stats(2048, bf), status=torch.tensor(STATUS_INIT, dtype=torch.int64), observation=3),
        mm("weight int4 g128 bf16 14336x4096 average", lambda: w(14336, 4096), "weight", g128, held=held_stats((14336, 32), bf), averaging_constant=0.01),
        mm("weight nvfp4 g16 bf16 14336x4096 running, record", lambda: w(14336, 4096), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), held=held_stats((14336, 256), bf), status=torch.tensor(STATUS_INIT, dtype=torch.int64), observation=4),
    ]

    def repeated(m, value, base, args, **kw):  # a forward repeated in place (ops.Repeat): its scratch
        launch = m.prepare(calls.min_max(value, base, args, **kw))
        return launch(calls.min_max(value, base, args, **kw), launch.new_scratch())

    act_tensor = QA(num_bits=8, type="float", strategy="tensor")
    out += [
        R(f"64MB act tensor bf16 (2, 4096, 4096) {what} (split, one launch: tickets)", "min_max",
          lambda m, kw=kw: repeated(m, w(2, 4096, 4096), "input", act_tensor, held=held_stats(1, bf), **kw))
        for what, kw in (("running, record", dict(status=torch.tensor(STATUS_INIT, dtype=torch.int64), observation=2)),
                         ("average", dict(averaging_constant=0.01)))
    ]
    # A first observation with its qparams in min_max's epilogue
    # (min_max_qparams: one launch where groups are large enough or the value
    # small, or where a reduction is split (its last programs finish it), else min_max and
    # calculate_qparams; TENSOR_GROUP: min_max's partial absolute maxima, then
    # the qparams kernel reducing them), the formats observers use
    mq = lambda name, value, args, **kw: R(  # noqa: E731
        f"64MB qparams {name}", "min_max", lambda m: checked(m.min_max_qparams, value(), "weight", args, **kw))
    out += [
        mq("int4 g128 bf16 14336x4096, record", lambda: w(14336, 4096), g128, record=True),
        mq("int4 g128 asym fp16 14336x4096, record (the epilogue, its redo compiled in)", lambda: w(14336, 4096, dtype=f16), QA(num_bits=4, symmetric=False, strategy="group", group_size=128), record=True),
        mq("int4 g128 asym bf16 14336x4096 (the epilogue, its redo compiled in)", lambda: w(14336, 4096), QA(num_bits=4, symmetric=False, strategy="group", group_size=128)),
        mq("int4 g32 asym bf16 14336x4096 (min_max, then qparams), record", lambda: w(14336, 4096), QA(num_bits=4, symmetric=False, strategy="group", group_size=32), record=True),
        mq("mxfp4 g32 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8)),
        mq("int8 channel fp16 8192x4096, record", lambda: w(8192, 4096, dtype=f16), QA(num_bits=8, strategy="channel"), record=True),
        mq("fp8 block 128 bf16 8192x4096, record", lambda: w(8192, 4096), blk(128, 128), record=True),
        mq("g_idx g128 bf16 14336x4096, record", lambda: w(14336, 4096), g128, g_idx=g_idx14, record=True),
        mq("fp8 tensor bf16 8192x4096 (split), record", lambda: w(8192, 4096), QA(num_bits=8, type="float", strategy="tensor"), record=True),
        mq("nvfp4 g16 bf16 14336x4096 (partial absmax, then qparams), record", lambda: w(14336, 4096), QA(strategy="tensor_group", group_size=16, **nvfp4), record=True),
        R("64MB qparams act tensor_group 16 fp32 (4096, 4096) (split: its last programs' partial absmax), record", "min_max",
          lambda m: checked(m.min_max_qparams, w(4096, 4096, dtype=f32), "input", QA(strategy="tensor_group", group_size=16, **nvfp4), record=True)),
        mq("int8 tensor asym fp16 8192x4096 (split, redo), record", lambda: w(8192, 4096, dtype=f16), QA(num_bits=8, symmetric=False, strategy="tensor"), record=True),
    ]
    fl = lambda name, value, args, **kw: R(  # noqa: E731
        f"64MB {name}", "flatten", lambda m: checked(m.flatten_for_calibration, value(), "weight", args, **kw))
    out += [
        fl("block 128 partial (pad) bf16 8000x4000", lambda: w(8000, 4000), blk(128, 128)),
        fl("block 128 transposed (pad) bf16 8000x4000", lambda: w(4000, 8000).t(), blk(128, 128)),
        fl("block 128 fp16 8192x4096", lambda: w(8192, 4096, dtype=f16), blk(128, 128)),
        fl("block 8x16 fp32 4096x4096", lambda: w(4096, 4096, dtype=f32), blk(8, 16, "int")),
        fl("g_idx g128 bf16 14336x4096", lambda: w(14336, 4096), g128, g_idx=g_idx14),
    ]
    acc = lambda name, value: R(  # noqa: E731
        f"64MB {name}", "accumulate_sq", lambda m: checked(m.accumulate_sq, value(), torch.zeros(value().shape[-1]), torch.zeros(1, dtype=torch.int64)))
    out += [
        acc("bf16 (4, 2048, 4096)", lambda: w(4, 2048, 4096)),
        acc("fp32 (2, 2048, 4096)", lambda: w(2, 2048, 4096, dtype=f32)),
        acc("fp16 (8192, 4096)", lambda: w(8192, 4096, dtype=f16)),
        acc("bf16 (4096, 8192) tokens contiguous", lambda: w(8192, 4096).t()),
    ]
    # qparams (every mode switch: formats, scale_dtype, global scale, widen,
    # carry) and the statistics epilogues (min_max's and combine_statistics')

    rn = torch.randn
    int4a = QA(num_bits=4, symmetric=False, strategy="group", group_size=16)
    nvfp4_tg = QA(strategy="tensor_group", group_size=16, **nvfp4)
    g_idx64 = (torch.arange(64) // 16)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]

    def rec():
        return torch.tensor(STATUS_INIT, dtype=torch.int64)

    def stats(n, dtype=f32):
        mn = rn(n, 4, dtype=dtype)
        return mn, mn + 1

    def held84():
        return torch.zeros(8, 4, dtype=bf), torch.ones(8, 4, dtype=bf)

    out += [
        C("int4 asym widen", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, bf), int4a, widen=True)),
        C("nvfp4 fused", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, bf), nvfp4_tg, fused=[stats(8, bf), stats(3, bf)], widen=True, carry=rec())),
        C("mxfp4", "qparams", lambda m: checked(m.calculate_qparams, *stats(8, f16), QA(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8), widen=True)),
        C("fp8 given global scale", "qparams", lambda m: checked(m.calculate_qparams, *stats(8), QA(num_bits=8, type="float", symmetric=False), torch.ones(1), widen=True)),
        C("bf16 scale_dtype", "qparams", lambda m: checked(m.calculate_qparams, *stats(8), QA(num_bits=8, symmetric=True, scale_dtype=torch.bfloat16))),
        C("average record", "stats", lambda m: checked(m.combine_statistics, rn(8, 64, dtype=bf), "weight", int4a, *held84(), held=held84(), averaging_constant=0.01, status=rec(), observation=1)),
        C("running block pad", "stats", lambda m: checked(m.combine_statistics, rn(10, 10), "weight", QA(num_bits=8, strategy="block", block_structure=[4, 4]), torch.zeros(3, 3), torch.ones(3, 3), held=(torch.zeros(3, 3), torch.ones(3, 3)), status=rec())),
        C("average record", "min_max", lambda m: checked(m.min_max, rn(8, 64, dtype=bf), "weight", int4a, held=held84(), averaging_constant=0.01, status=rec(), observation=2)),
        C("running g_idx", "min_max", lambda m: checked(m.min_max, rn(5, 64), "weight", QA(num_bits=8, strategy="group", group_size=16), g_idx=g_idx64, held=(torch.zeros(5, 4), torch.ones(5, 4)), status=rec())),
        C("split average", "min_max", lambda m: checked(m.min_max, rn(19, 40, dtype=bf), "input", QA(num_bits=8, strategy="tensor"), held=(torch.zeros(1, dtype=bf), torch.ones(1, dtype=bf)), averaging_constant=0.5, status=rec()), config=dict(tile=16, split=3)),
    ]
    # The search's exact emulation (what the interpreter runs, gpu_arith off) is
    # compiled too: both arithmetic paths must build for sm_90a.
    emu = dict(gpu_arith=False)
    out += [
        C("emulated int4 g128 norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, **mse), config=emu),
        C("emulated int4 g128 asym norm 2", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=4, symmetric=False, strategy="group", group_size=128), **dict(mse, norm=2.0)), config=emu),
        C("emulated nvfp4 g16", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **nvx), config=emu),
        C("emulated fp8 channel fp16", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f16), "weight", QA(num_bits=8, type="float", strategy="channel"), **mse), config=emu),
        C("emulated imatrix int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, **imx), config=emu),
        C("emulated fp8 block 128 (split)", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), **mse), config=emu),
        C("imatrix fp32 int8 g32 norm 2.4", "mse_search", lambda m: checked(m.mse_search, w(*W, dtype=f32), "weight", QA(num_bits=8, symmetric=False, strategy="group", group_size=32), importance=imp, **dict(imx, norm=2.4))),
    ]
    # The imatrix observer's path: raw importance (sum / count and its
    # verdict, one launch), normalised by the search as it loads it.
    out += [
        C("importance 4096", "importance", lambda m: checked(m.importance, torch.rand(4096) * 7, torch.full((), 7, dtype=torch.int64), rec())),
        C("imatrix raw int4 g128", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, importance_status=rec(), **imx)),
        C("imatrix raw int8 channel 16384 (split)", "mse_search", lambda m: checked(m.mse_search, w(512, 16384, dtype=f16), "weight", QA(num_bits=8, strategy="channel"), importance=torch.rand(16384) + 0.5, importance_status=rec(), **imx)),
    ]
    # An observer's search under nonfinite="error": the search records the
    # value itself (RECORD) on the register path, its TRACK form and the split path.
    out += [
        C("int4 g128 sym norm 2.4 qparams, record", "mse_search", lambda m: checked(m.mse_search_qparams, w(*W), "weight", g128, record=True, **mse)),
        C("int8 asym channel fp16 qparams (redo)", "mse_search", lambda m: checked(m.mse_search_qparams, w(*W, dtype=f16), "weight", QA(num_bits=8, symmetric=False, strategy="channel"), **mse)),
        C("int4 g128 sym norm 2.4 record", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, status=rec(), observation=1, **mse)),
        C("nvfp4 g16 (expanded) record", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), status=rec(), **nvx)),
        C("imatrix raw int4 g128 record", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", g128, importance=imp, importance_status=rec(), status=rec(), **imx)),
        C("fp8 block 128 (split) record", "mse_search", lambda m: checked(m.mse_search, w(*W), "weight", QA(num_bits=8, type="float", strategy="block", block_structure=[128, 128]), status=rec(), **mse)),
    ]
    # Search parameters only: same format, shape and mode switches each time.
    r = lambda *s: w(*s)  # noqa: E731
    for grid, patience, maxshrink, expand, norm in [
        (100, 5, 0.2, 1.0, 2.4), (80, 1, 0.2, 1.0, 2.4), (200, 1000, 1 - 0.8 / 1.8, 1.8, 1.7),
        (40, 0, 0.5, 1.2, 2.4), (32, 16, 0.5, 1.0, 7.3),
    ]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, expand=expand, norm=norm)
        out.append(C("nvfp4 params", "mse_search", lambda m, kw=kw: checked(m.mse_search,
            r(8, 64), "weight", QA(strategy="tensor_group", group_size=16, **nvfp4), **kw), tag="params-small"))
    # the split path's step buffers are sized by a power of two of the steps: stay in one
    split = dict(max_reg_group=64, chunk=64, split=2)
    for grid, patience, maxshrink in [(100, 5, 0.2), (90, 1, 0.2), (125, 16, 0.2), (17, 0, 1.0)]:
        kw = dict(grid=grid, patience=patience, maxshrink=maxshrink, norm=2.4)
        out.append(C("tensor params (split)", "mse_search", lambda m, kw=kw: checked(m.mse_search,
            r(9, 70), "weight", QA(num_bits=8, strategy="tensor"), **kw), config=split, tag="params-split"))
    # The split path at the real sizes (one tensor group: the search splits it
    # over programs): a 2048 x 4096 fp8 activation and a 4096 x 4096 int8 weight.
    for what, base, shape, qa in (("act 2048x4096 fp8", "input", (2048, 4096), QA(num_bits=8, type="float", strategy="tensor")),
                                  ("weight 4096x4096 int8", "weight", W, QA(num_bits=8, strategy="tensor"))):
        for norm in (2.4, 2.0):
            out.append(C(f"tensor {what} norm {norm:g} (split)", "mse_search", lambda m, b=base, s=shape, q=qa, n=norm:
                         checked(m.mse_search, w(*s), b, q, **dict(mse, norm=n))))
    return out
