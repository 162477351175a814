"""calculate_qparams on both backends against compressed-tensors, bit for bit.

The oracle is compressed-tensors itself: ``calculate_qparams`` and
``generate_gparam`` called here directly (and, for the float64 redo of
overflowed groups, the same call on float64 statistics cast back). Every
format of docs/spec.md §3 x statistics dtype x global-scale mode, with statistics that
include zero ranges, one-sided ranges, NaN, +-inf, values at the top of the
dtype (overflow), subnormals and tiny ranges (eps).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams as ct_qparams
from compressed_tensors.quantization.utils import generate_gparam

from obskernels import ops
from obskernels.backends import KernelUnsupportedError
from obskernels.spec.record import STATUS_INIT

from helpers import DTYPES, assert_same, formats

pytestmark = pytest.mark.kernel

FORMATS = {
    **formats("int8-sym", "int8-asym", "int4-sym", "int4-asym", "int2-asym", "int1-sym",
              "int3-asym-int32zp", "fp8", "fp8-asym", "fp4", "nvfp4"),
    **formats("mxfp4", "mxfp8", strategy="group", group_size=32),  # mx scales need groups of 32
    **formats("int8-asym-bf16scale", "int4-sym-fp16scale", "int8-fp32scale"),
}


def statistics(dtype, n=300, seed=0, device="cpu"):
    """(min_vals, max_vals): random ranges over many binades plus the edges
    (drawn on the CPU: the same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    hi = lo + torch.rand(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    top, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    inf, nan = float("inf"), float("nan")
    edges = [  # (min, max)
        (0, 0), (0.0, 0.0), (-top, top), (-top * 0.9, top * 0.8), (-top, -1.0), (2.0, top),
        (nan, 1.0), (1.0, nan), (-inf, 2.0), (0, inf), (-inf, inf), (-1e-30, 1e-30),
        (-tiny, tiny / 4), (3.0, 5.0), (-7.0, -2.0), (-1e-6, 1e-6), (-2.0**-9, 0.0),
        (-448.0, 448.0), (-6.0, 6.0), (-1.75 * 2**15, 1.8 * 2**15), (-65504.0, 65504.0),
    ]
    for i, (a, b) in enumerate(edges):
        lo[i], hi[i] = a, b
    return lo.to(dtype).to(device), hi.to(dtype).to(device)


def expected(mn, mx, args, global_scale, widen):
    """compressed-tensors' answer, and where widen asks for it the float64 one."""
    scale, zp = ct_qparams(mn, mx, args, global_scale)
    if widen:
        wide_s, wide_z = ct_qparams(mn.double(), mx.double(), args,
                                    None if global_scale is None else global_scale.double())
        redo = (torch.isfinite(mn) & torch.isfinite(mx)) & ~torch.isfinite(scale)
        scale = scale.clone()
        zp = zp.clone()
        scale[redo] = wide_s.to(scale.dtype)[redo]
        zp.view(torch.uint8 if zp.element_size() == 1 else zp.dtype)[redo] = \
            wide_z.to(zp.dtype).view(torch.uint8 if zp.element_size() == 1 else zp.dtype)[redo]
    return scale, zp


def _unsupported_by_ct(args, dtype):
    """compressed-tensors clamps into scale_dtype / zp_dtype's range in the
    statistics' dtype: torch refuses a bound that overflows it on the CPU (on
    a GPU it takes it, and the clamp does nothing); the kernels refuse it on
    every device."""
    sd, zd = args.scale_dtype, args.zp_dtype
    if sd is not None and sd.is_floating_point and sd != torch.float8_e4m3fn \
            and torch.finfo(sd).max > torch.finfo(dtype).max:
        return True
    return not zd.is_floating_point and torch.iinfo(zd).max > torch.finfo(dtype).max


@pytest.mark.parametrize("widen", [False, True], ids=["ct", "widen"])
@pytest.mark.parametrize("gmode", ["none", "given", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_calculate_qparams_matches_compressed_tensors(backend, fmt, dtype, gmode, widen, device):
    args = QuantizationArgs(**FORMATS[fmt])
    mn, mx = statistics(dtype, device=device)
    mn, mx = mn.reshape(20, 15), mx.reshape(20, 15)  # a 2-D qparam shape
    if _unsupported_by_ct(args, dtype) and (backend == "triton" or mn.device.type == "cpu"):
        with pytest.raises((RuntimeError, KernelUnsupportedError)):
            ops.calculate_qparams(mn, mx, args)
        return
    kw, g = {}, None
    if gmode == "given":
        g = torch.tensor([2688.0 / 3.7], device=device)
        kw = dict(global_scale=g)
    elif gmode == "fused":
        other = statistics(dtype, 40, seed=1, device=device)
        # the absmax of docs/spec.md §1 over the fused pairs, computed here
        pairs = [(mn[5:], mx[5:]), (other[0][20:], other[1][20:])]
        a = torch.stack([torch.maximum(b, -s).max() for s, b in pairs]).max()
        g = generate_gparam(-a.reshape(1), a.reshape(1))
        kw = dict(fused=pairs)
    should_generate = args.scale_dtype == torch.uint8
    if backend == "triton" and args.zp_dtype == torch.int32:
        with pytest.raises(KernelUnsupportedError, match="zp_dtype"):
            ops.calculate_qparams(mn, mx, args, widen=widen, **kw)
        return
    if should_generate and gmode != "none" and backend == "triton":
        with pytest.raises(KernelUnsupportedError, match="MX scales with a global scale"):
            ops.calculate_qparams(mn, mx, args, widen=widen, **kw)
        return
    scale, zp, gs, status = ops.calculate_qparams(mn, mx, args, widen=widen, **kw)
    want_s, want_z = expected(mn, mx, args, g, widen)
    assert_same(scale, want_s, f"{fmt} {dtype} {gmode} scale", (mn, mx))
    assert_same(zp, want_z, f"{fmt} {dtype} {gmode} zero_point", (mn, mx))
    if g is None:
        assert gs is None
    else:
        assert_same(gs, g, "global_scale", (mn, mx))
    assert status[: len(STATUS_INIT)].tolist() == list(STATUS_INIT)
    assert bool(status[len(STATUS_INIT):].any()) == (not bool(torch.isfinite(scale).all()))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("absmax", [0.0, 1e-45, 1e-40, 3e-5, 1.0, 2688.0, 65504.0, 3.3e38,
                                    float("inf"), float("nan"), -1.0])
def test_global_scale_matches_generate_gparam(backend, dtype, absmax, device):
    """generate_gparam at the clamp, overflow and NaN edges, fused over three pairs."""
    args = QuantizationArgs(**FORMATS["nvfp4"])
    base = torch.tensor([[0.5, -0.25]], dtype=dtype, device=device)
    edge = torch.tensor([absmax], dtype=torch.float32).to(dtype).to(device)
    pairs = [(base[:, :1], base[:, 1:]), (-edge.reshape(1, 1), edge.reshape(1, 1) * 0), (base, base)]
    a = torch.stack([torch.maximum(b, -s).max() for s, b in pairs]).max()
    want = generate_gparam(-a.reshape(1), a.reshape(1))
    _, _, gs, _ = ops.calculate_qparams(base, base, args, fused=pairs)
    assert_same(gs, want, f"global scale of absmax {absmax}", (a, a))


def test_carried_record_is_moved_and_reset(backend, device):
    args = QuantizationArgs(**FORMATS["int8-asym"])
    mn, mx = statistics(torch.float32, 2000, device=device)
    carry = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int64, device=device)
    _, _, _, status = ops.calculate_qparams(mn, mx, args, carry=carry)
    assert status[:6].tolist() == [1, 2, 3, 4, 5, 6]
    assert carry.tolist() == list(STATUS_INIT)


def test_noncontiguous_and_zero_dim(backend, device):
    args = QuantizationArgs(**FORMATS["int4-asym"])
    mn, mx = statistics(torch.bfloat16, 64, device=device)
    mn, mx = mn.reshape(8, 8).t(), mx.reshape(8, 8).t()
    scale, zp, _, _ = ops.calculate_qparams(mn, mx, args)
    want_s, want_z = ct_qparams(mn, mx, args)
    assert_same(scale, want_s, "transposed scale", (mn, mx))
    assert_same(zp, want_z, "transposed zp", (mn, mx))
    scale, zp, _, _ = ops.calculate_qparams(mn[2, 3], mx[2, 3], args)
    want_s, want_z = ct_qparams(mn[2, 3], mx[2, 3], args)
    assert_same(scale, want_s, "0-d scale", (mn, mx))
    assert_same(zp, want_z, "0-d zp", (mn, mx))


@pytest.mark.parametrize("gmode", ["given", "fused"])
def test_zero_dim_statistics_with_a_global_scale(backend, gmode, device):
    """0-d statistics (llm-compressor's of a 2-D grouped activation): the
    scale broadcasts with the global scale to (1,), the zero point keeps the
    statistics' 0-d shape, as compressed-tensors gives them."""
    args = QuantizationArgs(**FORMATS["nvfp4"])
    mn, mx = statistics(torch.bfloat16, 64, device=device)
    mn, mx = mn[13], mx[13]
    a = torch.maximum(mx, -mn).reshape(1)
    g = generate_gparam(-a, a)
    kw = dict(global_scale=g) if gmode == "given" else dict(fused=[(mn, mx)])
    scale, zp, gs, _ = ops.calculate_qparams(mn, mx, args, **kw)
    want_s, want_z = ct_qparams(mn, mx, args, g)
    assert (want_s.shape, want_z.shape) == ((1,), ())
    assert_same(scale, want_s, f"0-d {gmode} scale", (mn, mx))
    assert_same(zp, want_z, f"0-d {gmode} zp", (mn, mx))
    assert_same(gs, g, "global_scale", (mn, mx))


def test_bad_input(backend, device):
    args = QuantizationArgs(**FORMATS["int8-sym"])

    def zeros(n, **kw):
        return torch.zeros(n, device=device, **kw)

    with pytest.raises(ValueError, match="same shape"):
        ops.calculate_qparams(zeros(3), zeros(4), args)
    with pytest.raises(TypeError, match="dtype"):
        ops.calculate_qparams(zeros(3, dtype=torch.int32), zeros(3, dtype=torch.int32), args)
    with pytest.raises(ValueError, match="either global_scale or fused"):
        ops.calculate_qparams(zeros(3), zeros(3), args, torch.ones(1, device=device),
                              fused=[(zeros(3), zeros(3))])
    with pytest.raises(TypeError, match="QuantizationArgs"):
        ops.calculate_qparams(zeros(3), zeros(3), None)
