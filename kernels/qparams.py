"""Scale, zero point and global scale in a kernel: compressed-tensors'
``calculate_qparams`` as an observer uses it (reference/qparams.py).

Per group q, in the statistics' dtype (kernels/quant.py rounds after every
operation where torch does):

    mn = min(min_vals[q], 0), mx = max(max_vals[q], 0)
    symmetric:  scale = max(|mn|, |mx|) / (range / 2)   (MX: a power of two), zp = 0
    asymmetric: scale = (mx - mn) / range, zp = clamp(qmin - mn / scale, qmin, qmax)
    scale = g * scale                    (fp32) with a global scale g
    scale = fp(clamp(scale))             with a floating scale_dtype
    scale = eps where scale == 0         (eps of scale_dtype, else of the scale)
    zp rounded into zp_dtype (half to even)

``g`` is given, or generate_gparam(-a, a) with a = max over the ``fused``
statistics of max(max_vals, -min_vals): ``_absmax_kernel`` writes one partial
maximum per program and per fused pair, and every program of
``_qparams_kernel`` reduces those few partials itself (program 0 writes g).
``PartsQParams``: the same from partials the kernel that measured the
statistics wrote (min_max's ABSMAX: a first observation's qparams, no
``_absmax_kernel`` launch).
``widen``: groups with finite statistics and a non-finite scale are redone in
float64 and cast back, as the reference does.

Launches: 1, plus 1 per fused pair for a global scale computed here. No host
read, no aten op besides the outputs' allocation: the status (the carried
non-finite record, then one non-finite-scale flag per program) is an output
the caller reads once. (A kernel computing qparams in its epilogue,
``epilogue_qparams``, flags them in one word instead: its status starts from
a template, ``epilogue_plan``, and the caller reads any word after the
record as the flag.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from obskernels.kernels import quant
from obskernels.kernels.quant import GS_FUSED, GS_GIVEN, GS_NONE, S_BF16, S_F16, S_F32, S_FP8, S_MX, S_NONE
from obskernels.kernels._layout import allocator, launch_context
from obskernels.kernels._replay import Replay
from obskernels.kernels.launch import (
    FUSED,
    QPARAMS_BLOCK,
    QPARAMS_MAX_PARTS,
    UNFUSED,
    cdiv,
    config_token,
    current_config,
    pow2_at_most,
)
from obskernels.kernels.stats import as_bits, load_stat
from obskernels.spec.calls import QParamsCall
from obskernels.spec.checks import FLOAT_DTYPES
from obskernels.spec.record import STATUS_FIRST_BAD, STATUS_INIT, fresh_copy, new_record, template_of
from obskernels.spec.errors import KernelUnsupportedError

__all__ = ["calculate_qparams", "prepare", "group_qparams", "store_qparams", "store_scale_flag",
           "flag_scale", "qparams_format",
           "QParamsConstants", "QParamsOut", "epilogue_qparams", "EpilogueQParams", "epilogue_plan",
           "prepare_with_qparams", "PartsQParams", "prepare_from_parts"]



class QParamsConstants(NamedTuple):
    """``_qparams_kernel``'s runtime constants, one argument: the format's
    (``quant.Format``: rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
    sd_max, and the float64 redo's wrng, whalf, sd_max64, weps) and the
    global scale's dtype's smallest normal (``tiny``, generate_gparam's clamp)."""

    rng: float
    half: float
    qmin: float
    qmax: float
    eps: float
    zlo: float
    zhi: float
    mx_offset: int
    tiny: float
    sd_max: float
    wrng: float
    whalf: float
    sd_max64: float
    weps: float


_RNE_MAGIC64: tl.constexpr = tl.constexpr(6755399441055744.0)  # 1.5 * 2^52
_N_STATUS: tl.constexpr = tl.constexpr(len(STATUS_INIT))
_FIRST_BAD: tl.constexpr = tl.constexpr(STATUS_FIRST_BAD)
_FIRST_BAD_INIT: tl.constexpr = tl.constexpr(STATUS_INIT[STATUS_FIRST_BAD])


@triton.jit
def _nan_max_reduce(x, mask):
    """max over axis 0 of x where mask, NaN if any is NaN, -inf when empty."""
    m = tl.max(tl.where(mask & (x == x), x, float("-inf")), axis=0)
    has_nan = tl.max((mask & (x != x)).to(tl.int32), axis=0) > 0
    return tl.where(has_nan, float("nan"), m)


@triton.jit(do_not_specialize=["N", "per_program", "part0"])
def _absmax_kernel(min_ptr, max_ptr, parts_ptr, N, per_program, part0,
                   BITS16: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: max over groups [p*per_program, (p+1)*per_program) of
    max(max_vals, -min_vals) (NaN propagating, exact in fp32) -> parts[part0 + p]."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * per_program
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int1)
    for start in range(0, per_program, BLOCK):
        offs = lo + start + tl.arange(0, BLOCK)
        m = (offs < N) & (start + tl.arange(0, BLOCK) < per_program)
        mn = load_stat(min_ptr, offs, m, BITS16)
        mx = load_stat(max_ptr, offs, m, BITS16)
        t = tl.maximum(mx, -mn)
        nan = nan | (m & ((mn != mn) | (mx != mx)))
        acc = tl.maximum(acc, tl.where(m, t, float("-inf")))
    a = tl.max(acc, axis=0)
    a = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, float("nan"), a)
    one = tl.arange(0, 1)
    tl.store(parts_ptr + part0 + pid + one, a + one * 0.0)


@triton.jit
def _gparam(a, tiny, ADTYPE: tl.constexpr):
    """generate_gparam(-a, a) as fp32 for the absmax ``a`` held in ADTYPE:
    m = max(|min(-a, 0)|, |max(a, 0)|) clamped below at tiny; g = 2688 / m
    computed as torch does (reciprocal, then times 2688, each rounded to
    ADTYPE); NaN and +-inf become 1."""
    m = tl.where(a < 0, 0.0, a)
    m = tl.where(m < tiny, tiny, m)
    g = quant.rd(quant.rd(tl.math.div_rn(1.0, m), ADTYPE) * 2688.0, ADTYPE)
    return tl.where((g != g) | (tl.abs(g) == float("inf")), 1.0, g)


@triton.jit
def _round_scale_dtype(scale, sd_max, SCALE: tl.constexpr, SDTYPE: tl.constexpr):
    """round_to_quantized_type_dtype(scale, scale_dtype) back in the scale's
    dtype (SCALE: the scale_dtype's code; S_NONE and S_MX leave it as it is)."""
    if SCALE == S_FP8:
        scale = quant.round_fp8e4m3(quant.nan_clamp(scale, -448.0, 448.0))
    elif SCALE == S_BF16:
        scale = quant.rd(quant.rd(quant.nan_clamp(scale, -sd_max, sd_max), quant.BF16), SDTYPE)
    elif SCALE == S_F16:
        scale = quant.rd(quant.rd(quant.nan_clamp(scale, -sd_max, sd_max), quant.F16), SDTYPE)
    elif SCALE == S_F32:
        scale = quant.nan_clamp(scale, -sd_max, sd_max)
    return scale


@triton.jit
def _e4m3_bits(v):
    """float8_e4m3fn bits (uint8) of fp32 ``v``, an e4m3 value or NaN."""
    a = tl.abs(v)
    b = a.to(tl.uint32, bitcast=True)
    normal = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7)
    sub = (a * 512.0).to(tl.uint32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(v < 0, code | 0x80, code)
    return tl.where(v != v, 0x7F, code).to(tl.uint8)


@triton.jit
def _pow2_f64(k):
    """2.0 ** k as float64 for int64 k in [-1022, 1023], from the bits."""
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _wide(mn, mx, g, c, SYM: tl.constexpr, SCALE: tl.constexpr, ZP: tl.constexpr,
          GS: tl.constexpr):
    """The same qparams from the statistics widened to float64: scale as fp32
    (torch casts a double through fp32; the caller rounds on into the scale's
    dtype) and zp (fp32 holding the zp_dtype value)."""
    mn64 = tl.where(mn > 0, 0.0, mn).to(tl.float64)
    mx64 = tl.where(mx < 0, 0.0, mx).to(tl.float64)
    zp = tl.zeros_like(mn)
    if SCALE == S_MX:
        # round_to_power_2 keeps the exponent, plus one from 0.75 of the binade
        # up; in float64 that carry no longer overflows
        amax = tl.maximum(tl.abs(mn), tl.abs(mx))
        bits = amax.to(tl.uint32, bitcast=True).to(tl.int64)
        e = ((bits + (1 << 21)) >> 23) - 127
        u = tl.minimum(tl.maximum(127 + e - c.mx_offset, 0), 255)
        s64 = _pow2_f64(u - 127)
    elif SYM:
        s64 = tl.maximum(tl.abs(mn64), tl.abs(mx64)) / c.whalf
    else:
        s64 = (mx64 - mn64) / c.wrng
        z64 = c.qmin - mn64 / s64
        z64 = tl.minimum(tl.maximum(z64, c.qmin), c.qmax)
        if ZP == quant.Z_FP8:
            zp = quant.round_fp8e4m3(quant.nan_clamp(z64.to(tl.float32), -448.0, 448.0))
        else:
            z64 = tl.minimum(tl.maximum(z64, c.zlo), c.zhi)
            zp = ((z64 + _RNE_MAGIC64) - _RNE_MAGIC64).to(tl.float32)
    if GS != GS_NONE:
        s64 = g.to(tl.float64) * s64
    if (SCALE != S_NONE) and (SCALE != S_MX):
        # clamp in float64 (the bounds are exact there), then into scale_dtype
        s64 = tl.where(s64 < -c.sd_max64, -c.sd_max64, tl.where(s64 > c.sd_max64, c.sd_max64, s64))
        s64 = _round_scale_dtype(s64.to(tl.float32), 3.4028234663852886e38, SCALE, quant.F32).to(tl.float64)
    s64 = tl.where(s64 == 0, c.weps, s64)
    return s64.to(tl.float32), zp


@triton.jit
def group_qparams(mn, mx, g, c, DTYPE: tl.constexpr, SDTYPE: tl.constexpr, SYM: tl.constexpr,
                  SCALE: tl.constexpr, ZP: tl.constexpr, GS: tl.constexpr, WIDEN: tl.constexpr,
                  FAST: tl.constexpr = False):
    """(scale, zp) of groups with statistics (mn, mx) (fp32 holding DTYPE
    values) and global scale ``g`` (GS): compressed-tensors' arithmetic, the
    scale rounded into SDTYPE; WIDEN: groups with finite statistics and a
    non-finite scale redone in float64. ``c``: ``QParamsConstants``; FAST:
    the GPU's conversions (``quant.qparams``), the same results."""
    # eps 0 keeps zeros: compressed-tensors replaces them only after the
    # global scale and the scale_dtype rounding
    # (the scale_dtype's rounding comes after the global scale)
    scale, zp = quant.qparams(
        mn, mx, c.rng, c.half, c.qmin, c.qmax, 0.0, c.zlo, c.zhi, c.mx_offset,
        DTYPE, SYM, S_MX if SCALE == S_MX else S_NONE, ZP, FAST,
    )
    if GS != GS_NONE:
        scale = g * scale
    scale = _round_scale_dtype(scale, c.sd_max, SCALE, SDTYPE)
    scale = tl.where(scale == 0, c.eps, scale)
    if WIDEN:
        finite = (mn == mn) & (mx == mx) & (tl.abs(mn) != float("inf")) & (tl.abs(mx) != float("inf"))
        redo = finite & ((scale != scale) | (tl.abs(scale) == float("inf")))
        if tl.max(redo.to(tl.int32)) > 0:  # rare (an overflowed range): float64 off the common path
            ws, wz = _wide(mn, mx, g, c, SYM, SCALE, ZP, GS)
            scale = tl.where(redo, quant.rd(ws, SDTYPE), scale)
            zp = tl.where(redo, wz, zp)
    return scale, zp


@triton.jit
def store_qparams(scale_ptr, zp_ptr, offs, scale, zp, mask, SDTYPE: tl.constexpr,
                  ZP: tl.constexpr):
    """Store scale (SDTYPE) and zp (zp_dtype); returns 1 where a stored
    scale is not finite (int64, 0 elsewhere and off ``mask``)."""
    # every value stored is exact in its dtype; bf16 and fp8 go as bits (the
    # interpreter flushes bf16 subnormals and mangles fp8 NaN in its casts)
    if SDTYPE == quant.BF16:
        tl.store(as_bits(scale_ptr, tl.uint16) + offs,
                 (scale.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=mask)
    else:
        tl.store(scale_ptr + offs, scale.to(scale_ptr.dtype.element_ty), mask=mask)
    if ZP == quant.Z_FP8:
        tl.store(as_bits(zp_ptr, tl.uint8) + offs, _e4m3_bits(zp), mask=mask)
    else:
        tl.store(zp_ptr + offs, zp.to(zp_ptr.dtype.element_ty), mask=mask)
    return (mask & ((scale != scale) | (tl.abs(scale) == float("inf")))).to(tl.int64)


@triton.jit(do_not_specialize=["N", "n_parts"])
def _qparams_kernel(
    min_ptr, max_ptr, scale_ptr, zp_ptr, gs_ptr, parts_ptr, gs_out_ptr, carry_ptr, status_ptr,
    N, n_parts, c,
    DTYPE: tl.constexpr, SDTYPE: tl.constexpr, ADTYPE: tl.constexpr, SYM: tl.constexpr,
    SCALE: tl.constexpr, ZP: tl.constexpr, GS: tl.constexpr,
    WIDEN: tl.constexpr, CARRY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    ONE_FLAG: tl.constexpr = False,
):
    """One program: BLOCK groups -> scale (SDTYPE), zp (zp_dtype), and its
    non-finite-scale flag -> status[_N_STATUS + pid] (ONE_FLAG: a status
    from a template, its one flag word set by any program, ``flag_scale``).
    Program 0 also writes the global scale (GS_FUSED) and moves the carried
    record to status[0:_N_STATUS], resetting it."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    mn = load_stat(min_ptr, offs, mask, DTYPE == quant.BF16)
    mx = load_stat(max_ptr, offs, mask, DTYPE == quant.BF16)
    g = 1.0
    if GS == GS_GIVEN:
        g = tl.load(gs_ptr)
    elif GS == GS_FUSED:
        pp = tl.arange(0, BLOCK_P)
        a = tl.full([BLOCK_P], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK_P], tl.int1)
        for p0 in range(0, n_parts, BLOCK_P):
            pm = p0 + pp < n_parts
            v = tl.load(parts_ptr + p0 + pp, mask=pm, other=float("-inf"))
            nan = nan | (v != v)
            a = tl.maximum(a, v)
        a = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, float("nan"), tl.max(a, axis=0))
        g = _gparam(a, c.tiny, ADTYPE)
        one = tl.arange(0, 1)
        tl.store(gs_out_ptr + one, g + one * 0.0, mask=(one + pid) == 0)
    scale, zp = group_qparams(mn, mx, g, c, DTYPE, SDTYPE, SYM, SCALE, ZP, GS, WIDEN)
    bad = store_qparams(scale_ptr, zp_ptr, offs, scale, zp, mask, SDTYPE, ZP)
    if ONE_FLAG:
        flag_scale(status_ptr, tl.max(bad, axis=0))
    else:
        store_scale_flag(status_ptr, pid, tl.max(bad, axis=0))
    one = tl.arange(0, 1)
    first = (one + pid) == 0
    for i in range(_N_STATUS):
        init = tl.where(i == _FIRST_BAD, _FIRST_BAD_INIT, 0) + one.to(tl.int64) * 0
        if CARRY:
            # reset, then moved: carry may be status itself (the record already in place)
            v = tl.load(carry_ptr + i + one, mask=first, other=0)
            tl.store(carry_ptr + i + one, init, mask=first)
            tl.store(status_ptr + i + one, v, mask=first)
        else:
            tl.store(status_ptr + i + one, init, mask=first)


@triton.jit
def store_scale_flag(status_ptr, pid, flag):
    """Program ``pid``'s non-finite-scale flag (a scalar, 0 or 1) at its
    place after the record in ``status``: one word per program, so no
    program's store meets another's (a status nobody zeroed: every program
    writes its word)."""
    one = tl.arange(0, 1)
    tl.store(status_ptr + _N_STATUS + pid + one, flag.to(tl.int64) + one * 0)


@triton.jit
def flag_scale(status_ptr, flag):
    """A non-finite scale (``flag``, a scalar, nonzero) in the ONE flag word
    after the record of a status made from ``epilogue_plan``'s template
    (zero at launch): a program that flags stores 1 there, the others store
    nothing, so the word is 1 when any program flagged, whichever stores
    first (they store the same value). The status read back stays as short
    as the record, whatever the launch's program count."""
    one = tl.arange(0, 1)
    tl.store(status_ptr + _N_STATUS + one, one.to(tl.int64) * 0 + 1,
             mask=(one * 0 + flag.to(tl.int32)) != 0)


class QParamsOut(NamedTuple):
    """A streaming or choosing kernel's qparams outputs (one argument,
    ``epilogue_qparams``): scale, zero point and the format's ``QParamsConstants``."""

    scale_ptr: torch.Tensor
    zp_ptr: torch.Tensor
    c: QParamsConstants


@triton.jit
def epilogue_qparams(mn, mx, offs, mask, qp, DTYPE: tl.constexpr, QP: tl.constexpr):
    """Another kernel's epilogue computing the qparams of the groups at
    ``offs`` from the statistics (mn, mx) it just wrote (fp32 holding DTYPE
    values), with no global scale: ``group_qparams``, stored through ``qp``
    (``QParamsOut``). Returns 1 (int64) where a scale is not finite. QP:
    (SDTYPE, SYM, SCALE, ZP, WIDEN, FAST), ``EpilogueQParams.switches``."""
    SDTYPE: tl.constexpr = QP[0]
    SYM: tl.constexpr = QP[1]
    SCALE: tl.constexpr = QP[2]
    ZP: tl.constexpr = QP[3]
    WIDEN: tl.constexpr = QP[4]
    FAST: tl.constexpr = QP[5]
    scale, zp = group_qparams(mn, mx, 1.0, qp.c, DTYPE, SDTYPE, SYM, SCALE, ZP, GS_NONE, WIDEN,
                              FAST)
    return store_qparams(qp.scale_ptr, qp.zp_ptr, offs, scale, zp, mask, SDTYPE, ZP)


# --------------------------------------------------------------------------- #
# host side
# --------------------------------------------------------------------------- #
def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous statistics (read at the flat index, whatever their shape;
    bf16 is read as its bits by the kernels, see stats.load_stat)."""
    return t if t.is_contiguous() else t.contiguous()


def qparams_format(args, dtype: torch.dtype, sdtype: torch.dtype, a_dtype: torch.dtype,
                   gs_mode: int, widen: bool):
    """(``quant.Format``, ``QParamsConstants``, switches SDTYPE / SYM / SCALE /
    ZP / WIDEN) of ``group_qparams`` for statistics of ``dtype``, scales of
    ``sdtype`` and a global scale (``gs_mode``) computed in ``a_dtype``; or
    KernelUnsupportedError for a format the kernels do not cover."""
    fmt = quant.qformat(args, dtype, "calculate_qparams", sdtype)
    if fmt.zp == quant.Z_INT.value and torch.iinfo(fmt.zp_dtype).bits > 16:
        # the stored integer of a NaN zero point: the integer's minimum on the CPU, 0 on a GPU
        raise KernelUnsupportedError(f"calculate_qparams: zp_dtype {fmt.zp_dtype}")
    if fmt.scale == S_MX.value and gs_mode != GS_NONE.value:
        raise KernelUnsupportedError("calculate_qparams: MX scales with a global scale")
    constants = QParamsConstants(fmt.rng, fmt.half, fmt.qmin, fmt.qmax, fmt.eps, fmt.zlo, fmt.zhi,
                                 fmt.mx_offset, float(torch.finfo(a_dtype).tiny), fmt.sd_max,
                                 fmt.wrng, fmt.whalf, fmt.sd_max64, fmt.weps)
    # a symmetric scale max(|mn|, |mx|) / half with half >= 1 and no global
    # scale is at most its finite statistics, kept (no scale_dtype) or clamped
    # to +-448 (fp8): it cannot overflow, and the float64 redo would never run
    # (a float scale_dtype can: its bound rounded into the scales' dtype may
    # exceed it, as fp16's 65504 does in bf16)
    bounded = (fmt.sym and gs_mode == GS_NONE.value and fmt.half >= 1
               and fmt.scale in (S_NONE.value, S_FP8.value))
    switches = dict(SDTYPE=quant.DTYPE_CODE[sdtype], SYM=fmt.sym, SCALE=fmt.scale, ZP=fmt.zp,
                    WIDEN=bool(widen) and not bounded)
    return fmt, constants, switches


class EpilogueQParams(NamedTuple):
    """A call's qparams computed in another kernel's epilogue (the host
    side of ``epilogue_qparams``), prepared once per signature: the
    constexpr switches, the format's constants, the outputs' allocators and
    the status template (a fresh record, then one zero flag word that any
    of the epilogue's programs sets, ``flag_scale``, then the zeroed
    tickets of a split finished by its last programs, if any)."""

    switches: tuple
    constants: QParamsConstants
    new_scale: object
    new_zero_point: object
    template: torch.Tensor

    def outputs(self):
        """(``QParamsOut`` of new outputs, a fresh status) for one call."""
        return (QParamsOut(self.new_scale(), self.new_zero_point(), self.constants),
                fresh_copy(self.template))


def _status_template(flags: int, tickets: int, device) -> torch.Tensor:
    """A fresh status: the record, ``flags`` zeroed flag words (one that any
    program sets, ``flag_scale``, or one per program), then ``tickets``
    zeroed tickets (a split finished by its last programs)."""
    return template_of(STATUS_INIT + (0,) * (flags + tickets), device)


def epilogue_plan(args, value: torch.Tensor, qshape, fast: bool, widen: bool = True,
                  tickets: int = 0) -> EpilogueQParams:
    """The ``EpilogueQParams`` of ``calculate_qparams(min_vals, max_vals,
    args, widen=widen)`` for statistics of ``value``'s dtype and device and
    shape ``qshape`` (``fast``: the GPU's conversions), the status ending in
    ``tickets`` zeroed tickets (a split finished by its last programs, at
    ``N_STATUS + 1``); KernelUnsupportedError for a format the kernels do not
    cover."""
    dtype, dev = value.dtype, value.device
    fmt, constants, switches = qparams_format(args, dtype, dtype, torch.float32, GS_NONE.value,
                                              widen=widen)
    shape = qshape if len(qshape) > 0 else (1,)
    return EpilogueQParams(
        (switches["SDTYPE"], switches["SYM"], switches["SCALE"], switches["ZP"], switches["WIDEN"],
         bool(fast)),
        constants, allocator(shape, dtype, dev),
        allocator(shape, fmt.zp_dtype, dev),
        _status_template(1, tickets, dev),  # one flag word (flag_scale)
    )


def prepare_with_qparams(call, prepare_measuring):
    """The launch of a ``*QParamsCall``'s signature (``min_max_qparams``,
    ``mse_search_qparams``): ``prepare_measuring(call.measuring(record),
    qparams=True, widen=call.widen)``, the measuring kernels computing the qparams in their
    epilogue, where it gives one; otherwise the measuring operation's launch
    and ``calculate_qparams``', the record carried between them (the
    statistics' prototype allocated, not computed: preparing launches nothing)."""
    flat = call.flat
    proto = new_record(flat.value.device) if call.record else None
    measuring = call.measuring(proto)
    fused = prepare_measuring(measuring, qparams=True, widen=call.widen)
    if fused is not None:
        return fused
    measure = prepare_measuring(measuring)
    stats = torch.empty(flat.qshape, dtype=flat.value.dtype, device=flat.value.device)
    qparams = prepare(call.qparams_of(stats, stats, proto))

    def launch(call):
        return call.by_parts(measure, qparams)

    return launch


def _kernel_plan(args, min_vals, a_dtype, gs_mode: int, widen: bool, n_parts: int, carry: bool):
    """``_qparams_kernel``'s launch for statistics like ``min_vals``: (qparams'
    shape, programs, runtime constants, constexpr switches, the scale's and
    zero point's allocators)."""
    dtype, dev = min_vals.dtype, min_vals.device
    sdtype = torch.float32 if gs_mode != GS_NONE.value else dtype
    fmt, qconstants, qswitches = qparams_format(args, dtype, sdtype, a_dtype, gs_mode, widen)
    # compressed-tensors' shapes: the scale broadcast with the global scale
    # (shape (1,)), a 0-d one made (1,), and the zero point the statistics'
    # (made (1,) with a 0-d scale: 0-d statistics and no global scale)
    shape = min_vals.shape if min_vals.dim() > 0 else (1,)
    zp_shape = shape if gs_mode == GS_NONE.value else min_vals.shape
    N = min_vals.numel()
    switches = dict(
        DTYPE=quant.DTYPE_CODE[dtype], ADTYPE=quant.DTYPE_CODE[a_dtype], **qswitches, GS=gs_mode,
        CARRY=carry,
        BLOCK=QPARAMS_BLOCK, BLOCK_P=pow2_at_most(max(n_parts, 1), 128), **UNFUSED,
    )
    return (shape, max(cdiv(N, QPARAMS_BLOCK), 1), (N, n_parts, qconstants), switches,
            allocator(shape, sdtype, dev), allocator(zp_shape, fmt.zp_dtype, dev))


class PartsQParams(NamedTuple):
    """``calculate_qparams(min_vals, max_vals, args, fused=((min_vals,
    max_vals),), widen=...)`` (TENSOR_GROUP statistics' qparams with their
    own global scale) in ONE launch of ``_qparams_kernel``, where the kernel
    that measured the statistics wrote ``n_parts`` partial absolute maxima
    (fp32, max(max_vals, -min_vals) over its groups, NaN propagating): every
    program reduces them itself, as it does ``_absmax_kernel``'s.
    ``prepare_from_parts`` makes it once per signature; ``status()`` gives a
    call's status: with ``record`` a fresh record at its head, for the
    measuring kernel to count into (the launch keeps it there), then ONE
    flag word, zero, that any program sets (``flag_scale``), then, where the
    measuring kernel finishes a split by tickets, that many zeroed tickets
    (zero again after it); without either, a status the launch writes
    whole: the record, then one flag per program, each program's own.
    ``flags``: the words of flags (where the tickets start)."""

    programs: int
    flags: int
    constants: tuple
    switches: dict
    new_scale: object
    new_zero_point: object
    new_parts: object
    new_gs: object
    template: torch.Tensor
    new_status: object
    fresh: bool  # the status starts as the template (a record, tickets)
    kernel: object  # the launch site (kernels/_replay.py)

    def status(self) -> torch.Tensor:
        return fresh_copy(self.template) if self.fresh else self.new_status()

    def launch(self, min_vals, max_vals, parts, status):
        """(scale, zero_point, global_scale) into new outputs; status: ``status()``'s."""
        scale, zero_point, gs = self.new_scale(), self.new_zero_point(), self.new_gs()
        self.kernel(min_vals, max_vals, scale, zero_point, status, parts, gs, status, status,
                    *self.constants)
        return scale, zero_point, gs


def prepare_from_parts(args, stats_like: torch.Tensor, n_parts: int, record: bool,
                       widen: bool = True, tickets: int = 0) -> PartsQParams:
    """The ``PartsQParams`` of TENSOR_GROUP statistics shaped and typed like
    ``stats_like`` (contiguous, non-empty), from ``n_parts`` partials
    (``widen``: calculate_qparams'), the status ending in ``tickets`` zeroed
    tickets; KernelUnsupportedError for a format the kernels do not cover."""
    dtype, dev = stats_like.dtype, stats_like.device
    if dtype not in FLOAT_DTYPES:
        raise KernelUnsupportedError(f"calculate_qparams: statistics of dtype {dtype}")
    _, programs, constants, switches, new_scale, new_zero_point = _kernel_plan(
        args, stats_like, dtype, GS_FUSED.value, widen, n_parts, record)
    # a status from the template (a record to count into, tickets) flags in
    # one word; one the launch writes whole, a word per program
    fresh = record or tickets > 0
    flags = 1 if fresh else programs
    template = _status_template(flags, tickets, dev)
    return PartsQParams(programs, flags, constants, switches, new_scale, new_zero_point,
                        allocator((n_parts,), torch.float32, dev),
                        allocator((1,), torch.float32, dev), template,
                        allocator(template.shape, torch.int64, dev), fresh,
                        Replay(globals(), "_qparams_kernel", (programs,), **switches,
                               ONE_FLAG=fresh))


def calculate_qparams(call: QParamsCall):
    """Triton twin of ``reference.qparams.calculate_qparams``: returns
    (scale, zero_point, global_scale, status), bit-identical."""
    return prepare(call)(call)


def prepare(call: QParamsCall):
    """The launch of ``call``'s signature (see kernels/min_max.py ``prepare``):
    the format's constants and switches, the fused pairs' split, the outputs'
    shapes; the returned function launches any call of that signature."""
    min_vals, args, global_scale, fused, widen, carry = (
        call.min_vals, call.args, call.global_scale, call.fused, call.widen, call.carry)
    dtype, dev = min_vals.dtype, min_vals.device
    if dtype not in FLOAT_DTYPES:
        raise KernelUnsupportedError(
            f"calculate_qparams: statistics of dtype {dtype} (the kernel covers float32, "
            "float16 and bfloat16; the reference backend computes float64)"
        )
    gs_mode, a_dtype, pairs = GS_NONE.value, torch.float32, []
    if global_scale is not None:
        if global_scale.dtype != torch.float32 or global_scale.shape != (1,) or global_scale.device != dev:
            raise KernelUnsupportedError(
                "calculate_qparams: a given global_scale must be float32 of shape (1,) on the "
                "statistics' device (what generate_gparam returns)"
            )
        gs_mode = GS_GIVEN.value
    elif fused is not None:
        pairs = list(fused)
        a_dtype = pairs[0][0].dtype
        for mn, mx in pairs:
            a_dtype = torch.promote_types(a_dtype, torch.promote_types(mn.dtype, mx.dtype))
        if a_dtype not in FLOAT_DTYPES:
            raise KernelUnsupportedError(f"calculate_qparams: fused statistics of dtype {a_dtype}")
        gs_mode = GS_FUSED.value
    # the split of each fused pair follows the work (and the configured fill), never the device
    token = config_token()
    fill = current_config("calculate_qparams").fill_programs
    counts = [max(1, min(cdiv(mn.numel(), 8 * QPARAMS_BLOCK), QPARAMS_MAX_PARTS, fill))
              for mn, _ in pairs]
    n_parts = sum(counts)
    shape, programs, constants, switches, new_scale, new_zero_point = _kernel_plan(
        args, min_vals, a_dtype, gs_mode, widen, n_parts, carry is not None)
    N, n_status = min_vals.numel(), len(STATUS_INIT) + programs
    new_status = allocator((n_status,), torch.int64, dev)
    context = launch_context(dev)
    if gs_mode == GS_FUSED.value:
        new_parts, new_gs = allocator((n_parts,), torch.float32, dev), allocator((1,), torch.float32, dev)
    # the statistics' strides are the signature's
    stats_contiguous = min_vals.is_contiguous() and call.max_vals.is_contiguous()
    kernel = Replay(globals(), "_qparams_kernel", (programs,), **switches)
    # per fused pair (its dtypes are the signature's: read as bits where bf16)
    absmax_k = [Replay(globals(), "_absmax_kernel", (p,), BLOCK=QPARAMS_BLOCK, **FUSED,
                       BITS16=(mn.dtype if mn.dtype == mx.dtype else a_dtype) == torch.bfloat16)
                for (mn, mx), p in zip(pairs, counts)]

    def launch(call: QParamsCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return calculate_qparams(call)
        min_vals, max_vals, global_scale, carry = (
            call.min_vals, call.max_vals, call.global_scale, call.carry)
        if not stats_contiguous:
            min_vals, max_vals = min_vals.contiguous(), max_vals.contiguous()
        scale, zero_point, status = new_scale(), new_zero_point(), new_status()
        parts = gs_out = status  # unread placeholders
        with context():
            if gs_mode == GS_FUSED.value:
                parts, gs_out = new_parts(), new_gs()
                part0 = 0
                for (mn, mx), p, absmax in zip(call.fused, counts, absmax_k):
                    n = mn.numel()
                    if mn.dtype != mx.dtype:
                        mn, mx = mn.to(a_dtype), mx.to(a_dtype)
                    absmax(_flat(mn), _flat(mx), parts, n, cdiv(n, p), part0)
                    part0 += p
                global_scale = gs_out
            if N:
                kernel(
                    min_vals, max_vals, scale, zero_point,
                    global_scale if gs_mode == GS_GIVEN.value else status, parts, gs_out,
                    carry if carry is not None else status, status, *constants,
                )
            else:  # no groups: nothing to launch, only the record to move
                fresh = torch.tensor(STATUS_INIT, device=dev)
                status[: len(STATUS_INIT)] = carry if carry is not None else fresh
                if carry is not None:
                    carry.copy_(fresh)
        return scale, zero_point, global_scale, status

    return launch
