"""The jit kernels of the fused MSE search (``mse_search.py`` holds the
launcher and the algorithm's description).

Register path: ``_search_kernel`` (every step over whole groups held in
registers, improvement bits and per-step flags) and ``_choose_kernel`` (the
global stop step and each group's range). Split path: ``_minmax_part_kernel``
(per-split min/max) and ``_search_part_kernel`` (per-split partial errors,
finished by tickets: ``_finish_group`` per group, then the choice of every
group by the last group to finish). ``FAST`` selects the GPU's arithmetic
(quant.py's GPU section); the interpreter runs the exact emulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from obskernels.kernels import quant as Q
from obskernels.kernels._layout import load_flat, store_exact, widen

# Scalars that follow the search parameters (grid, maxshrink, patience) or the
# work split are not specialised on: one compiled variant per format and block
# shape, not one per grid or patience (== 1 and % 16 would each make one).
# Group counts and sizes stay specialised: % 16 lets the compiler vectorise
# the masks and saves registers (28 of 108 in int4 group-128 _search_kernel).
_PER_CALL = ["lim_r", "lim_e", "n_steps", "n_words", "patience", "K", "chunks_per_split",
             "grid_bits", "exact32"]


@triton.jit
def _shrink(i, grid32, grid_bits, exact32):
    """Step i's shrink p_i = fp32(1 - i / grid), with the bits of the
    reference's Python float: i / grid and 1 - (.) in fp64, one rounding to fp32.

    exact32 (a runtime flag, the same for every lane): the host checked that
    one fp32 division, div_rn(grid32 - i, grid32), gives those bits for every
    step of this call (``_fp32_steps_exact``; so for every integer grid in
    practice). Otherwise the fp64 formula itself, grid arriving as the int64
    bits of the Python float (a float argument would be passed as fp32); fp64
    division is correctly rounded on a GPU (div.rn.f64) and in numpy, but slow
    on GPUs with few fp64 units, hence the fp32 path.
    """
    if exact32 != 0:
        p = tl.math.div_rn(grid32 - i.to(tl.float32), grid32)
    else:
        grid = grid_bits.to(tl.int64).to(tl.float64, bitcast=True)
        p = (1.0 - i.to(tl.float64) / grid).to(tl.float32)
    return p


@triton.jit
def _block_errors(
    x, valid, w, bmin, bmax, si, smask,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits, exact32,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr,
):
    """Errors [BG, SB] of the steps si [SB] over the tile x [BG, BE]: fp32 sums,
    rounded to DTYPE when ROUND_SUM (a whole group, flavour "mse"). Candidate: rd(base * p_i)."""
    p = tl.where(smask, _shrink(si, grid32, grid_bits, exact32), 1.0)
    cmin = Q.rd(bmin[:, None] * p[None, :], DTYPE)
    cmax = Q.rd(bmax[:, None] * p[None, :], DTYPE)
    scale, zp = Q.qparams(
        cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
        DTYPE, SYM, SCALE, ZP,
    )
    x3 = x[:, None, :]
    dq = Q.fake_quant(x3, scale[:, :, None], zp[:, :, None], qmin, qmax, DTYPE, QTYPE)
    if IMATRIX:
        err = Q.abs_pow(tl.abs(dq - x3), norm, NORM_MODE, Q.F32)
        if HAS_W:
            err = err * w[:, None, :]
    else:
        err = Q.abs_pow(tl.abs(Q.rd(dq - x3, DTYPE)), norm, NORM_MODE, DTYPE)
    # NaN * 0 would leak from tile slots outside the group: select, not multiply
    err = tl.where(valid[:, None, :], err, 0.0)
    err = tl.sum(err, axis=2)
    if ROUND_SUM:
        err = Q.rd(err, DTYPE)
    return err


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _fake_quant_hw(x, scale, zp, qmin, qmax,
                   DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr):
    """quant.fake_quant with the GPU's conversions (FAST only), same roundings.

    Specialisations, exact by the format: symmetric formats have zp == 0, so
    y + zp and q - zp are y and q (signs of zero aside, which the error's
    abs() removes). Integer formats of <= 8 bits have |q - zp| <= 255, an
    integer that bf16 and fp16 hold exactly, so rounding it is skipped.
    The clamp is min/max, which drops NaN instead of keeping it: y is NaN
    only where the group's scale is NaN or inf (a non-finite group, or an
    overflowing range), and then every error of that group is NaN or inf at
    every step, so it never improves either way.
    """
    if DTYPE == Q.BF16:
        # bf16 x and scale: one reciprocal per group, a product per element,
        # whose bf16 rounding is the quotient's (quant.quot_bf16_hw's proof)
        lift, r = Q.recip_hw(scale)
        y = Q.rd_bf16_pair_hw(Q.quot_bf16_hw(x, lift, r))
    else:
        y = Q.rd_hw(tl.math.div_rn(x, scale), DTYPE)
    if not SYM:
        y = Q.rd_hw(y + zp, DTYPE)
    y = tl.minimum(tl.maximum(y, qmin), qmax)
    if QTYPE == Q.Q_FP8:
        q = Q.round_fp8e4m3_hw(y)
    elif QTYPE == Q.Q_FP4:
        q = Q.round_fp4e2m1(y)
    else:
        q = Q.rint_hw(y)
    if SYM:
        qz = q
    elif QTYPE == Q.Q_INT:
        qz = q - zp
    else:
        qz = Q.rd_hw(q - zp, DTYPE)
    return Q.rd_hw(qz * scale, DTYPE)


@triton.jit
def _step_errors(
    x, valid, w, bmin, bmax, p, tab_ptr,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    ROUND_SUM: tl.constexpr, FAST: tl.constexpr,
):
    """Errors [BG] of ONE step (shrink p, a scalar) over the tile x [BG, BE]:
    the same arithmetic as _block_errors on 2-D tiles, so the per-group sums
    keep the load's layout (each thread adds its own run of a group before
    any shuffle). FAST: the GPU's conversions (quant.py, GPU arithmetic)."""
    if FAST:
        cmin = Q.rd_hw(bmin * p, DTYPE)
        cmax = Q.rd_hw(bmax * p, DTYPE)
    else:
        cmin = Q.rd(bmin * p, DTYPE)
        cmax = Q.rd(bmax * p, DTYPE)
    scale, zp = Q.qparams(
        cmin, cmax, rng, half, qmin, qmax, eps, zlo, zhi, mx_offset,
        DTYPE, SYM, SCALE, ZP, FAST,
    )
    if FAST:
        dq = _fake_quant_hw(x, scale[:, None], zp[:, None], qmin, qmax, DTYPE, SYM, QTYPE)
        if IMATRIX:
            err = Q.abs_pow_hw(tl.abs(dq - x), norm, pw0, tab_ptr, NORM_MODE, Q.F32, Q.F32)
            if HAS_W:
                err = err * w
        else:
            d = tl.abs(Q.rd_hw(dq - x, DTYPE))
            err = Q.abs_pow_hw(d, norm, pw0, tab_ptr, NORM_MODE, DTYPE, DTYPE)
    else:
        dq = Q.fake_quant(x, scale[:, None], zp[:, None], qmin, qmax, DTYPE, QTYPE)
        if IMATRIX:
            err = Q.abs_pow(tl.abs(dq - x), norm, NORM_MODE, Q.F32)
            if HAS_W:
                err = err * w
        else:
            err = Q.abs_pow(tl.abs(Q.rd(dq - x, DTYPE)), norm, NORM_MODE, DTYPE)
    err = tl.sum(tl.where(valid, err, 0.0), axis=1)
    if ROUND_SUM:
        if FAST:
            err = Q.rd_hw(err, DTYPE)
        else:
            err = Q.rd(err, DTYPE)
    return err


@triton.jit
def _improved(err, best, ok):
    """Improvement bits [BG, SB] of a block of consecutive steps and the new
    best [BG]: step j improves when err_j < best and err_j < err_k for every
    earlier k of the block (strict; NaN never improves, nor counts as best)."""
    SB: tl.constexpr = err.shape[1]
    e = tl.where(ok & (err == err), err, float("inf"))
    j = tl.arange(0, SB)
    earlier = tl.where(j[None, :, None] > j[None, None, :], e[:, None, :], float("inf"))
    prev = tl.min(earlier, axis=2)
    imp = (e < best[:, None]) & (e < prev)
    return imp, tl.minimum(best, tl.min(e, axis=1))


@triton.jit
def _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W: tl.constexpr):
    """(divisor, usable) of raw importance (NORM_W): the reference's fp32
    mean(w) + tiny, the mean being torch's own (one value, computed by the
    launcher), and whether the verdict at wcode_ptr lets the search use it."""
    if NORM_W:
        c = tl.load(wmean_ptr) + tiny
        ok = tl.load(wcode_ptr) == 0
    else:
        c = tiny
        ok = True
    return c, ok


@triton.jit
def _importance_weights(w, c, ok, NORM_W: tl.constexpr):
    """Search weights from loaded importance w. NORM_W: w is the raw E[x²]
    (kernels/importance.py) and the weight is w / c correctly rounded
    (div_rn), as the reference's fp32 division; 1.0, which leaves every
    error as it is, where the importance is not usable (``_importance_norm``)."""
    if NORM_W:
        w = tl.where(ok, tl.math.div_rn(w, c + tl.zeros_like(w)), 1.0)
    return w


@triton.jit
def _load_group(
    x_ptr, w_ptr, g, k, group_numel,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e,
    PAD: tl.constexpr, HAS_W: tl.constexpr, FAST: tl.constexpr,
):
    """Elements k of groups g as an fp32 tile [len(g), len(k)] (k: position in
    the reference's flattened group, see ``_layout.load_flat``), the importance
    of each element's input column (HAS_W; else x again), and which slots are
    group elements (the padding zeros of a partial block are)."""
    valid = (g < G)[:, None] & (k < group_numel)[None, :]
    x, col = load_flat(
        x_ptr, x_ptr, g[:, None], k[None, :], valid,
        QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False,
    )
    if FAST:
        # the GPU's own widening is exact (subnormals too); in the step loop
        # sm_90a keeps it cheaper than the bit form (int4 g128: 58.3 vs 60.8
        # SASS per element and step)
        x = x.to(tl.float32)
    else:
        x = widen(x)  # bf16 through its bits: the interpreter's cast gets subnormals wrong
    if HAS_W:
        # importance comes only with CHANNEL / GROUP layouts: col < cols, no padding
        w = tl.load(w_ptr + col, mask=valid, other=0.0)
    else:
        w = x
    return x, w, valid


@triton.jit
def _nan_minmax(x, valid):
    """(amin, amax) over axis 1 of the valid elements, NaN if any is NaN."""
    ok = valid & (x == x)
    mn = tl.min(tl.where(ok, x, float("inf")), axis=1)
    mx = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    has_nan = tl.max((valid & (x != x)).to(tl.int32), axis=1) > 0
    mn = tl.where(has_nan, float("nan"), mn)
    mx = tl.where(has_nan, float("nan"), mx)
    return mn, mx


@triton.jit(do_not_specialize=_PER_CALL)
def _search_kernel(
    x_ptr, w_ptr, wmean_ptr, wcode_ptr, tiny, tab_ptr, grid32, grid_bits, exact32, bits_ptr,
    flags_ptr, base_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    n_steps, n_words, expand, best_init,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr, NORM_W: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """One program: BLOCK_G whole groups [BLOCK_G, BLOCK_E] in registers.

    With importance (weights, CHANNEL or GROUP: group g is column block
    g % QB of row g // QB), a program takes BLOCK_G // BLOCK_J rows of
    BLOCK_J column blocks and reads each column's importance once, shared by
    its rows, instead of once per element (NORM_W: normalised as it is loaded,
    ``_importance_weights``). Otherwise BLOCK_G consecutive groups.

    base = rd(amin * expand), rd(amax * expand) -> base_ptr[2, G];
    for every step i (BLOCK_S steps at a time: 1 on a GPU, more under the
    interpreter, whose cost is per operation): err_i per group (rounded to
    DTYPE for "mse"),
    improved = err_i < best (strict; NaN never), best updated;
    bit i of group g -> bits_ptr[g, i // 32]; the OR over this program's
    groups -> flags_ptr[pid, i // 32] (a plain store of every word: nothing
    needs clearing before the launch; _choose_kernel ORs the programs' words).
    """
    pid = tl.program_id(0)
    if HAS_W:
        ROWS: tl.constexpr = BLOCK_G // BLOCK_J
        n_jb = tl.cdiv(QB, BLOCK_J)
        rb = pid // n_jb
        j0 = (pid - rb * n_jb) * BLOCK_J
        idx = tl.arange(0, BLOCK_G)
        row = rb * ROWS + idx // BLOCK_J
        j = j0 + idx % BLOCK_J
        g = tl.where((row < G // QB) & (j < QB), row.to(tl.int64) * QB + j, G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False, FAST,
        )
        # importance comes only with CHANNEL / GROUP layouts: element k of
        # column block j is input column j * E + k, no padding
        jj = j0 + tl.arange(0, BLOCK_J)
        kk = tl.arange(0, BLOCK_E)
        wm = (jj < QB)[:, None] & (kk < group_numel)[None, :]
        w1 = tl.load(w_ptr + jj[:, None] * E + kk[None, :], mask=wm, other=0.0)
        wc, wok = _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W)
        w1 = _importance_weights(w1, wc, wok, NORM_W)
        w = tl.reshape(tl.broadcast_to(w1[None, :, :], (ROWS, BLOCK_J, BLOCK_E)),
                       (BLOCK_G, BLOCK_E))
    else:
        g = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False, FAST,
        )
    mn, mx = _nan_minmax(x, valid)
    bmin = Q.rd(mn * expand, DTYPE)
    bmax = Q.rd(mx * expand, DTYPE)
    tl.store(base_ptr + g, bmin, mask=gmask)
    tl.store(base_ptr + G + g, bmax, mask=gmask)

    best = tl.zeros([BLOCK_G], dtype=tl.float32) + best_init
    word = tl.zeros([BLOCK_G], dtype=tl.int32)
    if BLOCK_S == 1:
        # One step per iteration (the GPU's choice): 2-D tiles, and the OR over
        # the program's groups taken once per 32 steps from their words
        # instead of at every step.
        for i in range(n_steps):
            p = _shrink(n_steps * 0 + i, grid32, grid_bits, exact32)  # a tensor on both backends
            err = _step_errors(
                x, valid, w, bmin, bmax, p, tab_ptr,
                rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX, FAST,
            )
            imp = (err < best) & gmask  # strict; NaN never improves
            best = tl.where(imp, err, best)
            word = word | (imp.to(tl.int32) << (i % 32))
            if ((i + 1) % 32 == 0) | (i + 1 >= n_steps):
                wi = i // 32
                tl.store(bits_ptr + g * n_words + wi, word, mask=gmask)
                tl.store(flags_ptr + pid * n_words + wi, tl.reduce(word, 0, _or))
                word = word * 0
    else:
        fword = tl.max(word, axis=0)
        one = tl.arange(0, 1)
        for i0 in range(0, n_steps, BLOCK_S):
            si = i0 + tl.arange(0, BLOCK_S)
            smask = si < n_steps
            err = _block_errors(
                x, valid, w, bmin, bmax, si, smask,
                rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits, exact32,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX,
            )
            imp, best = _improved(err, best, gmask[:, None] & smask[None, :])
            # BLOCK_S divides 32, so a block never straddles two words; distinct
            # bits add without carries, so the sums are ORs
            sh = si % 32
            word = word | tl.sum(imp.to(tl.int32) << sh[None, :], axis=1)
            fword = fword | tl.sum(tl.max(imp.to(tl.int32), axis=0) << sh, axis=0)
            # flush after bit 31 and after the last step (vector masks: the
            # interpreter rejects scalar-bool store masks)
            i_end = i0 + BLOCK_S
            endv = ((word * 0 + i_end) % 32 == 0) | (word * 0 + i_end >= n_steps)
            wi = i0 // 32
            tl.store(bits_ptr + g * n_words + wi, word, mask=gmask & endv)
            fv = fword + one * 0
            end1 = ((one + i_end) % 32 == 0) | (one + i_end >= n_steps)
            tl.store(flags_ptr + pid * n_words + wi + one, fv, mask=end1)
            word = tl.where(endv, 0, word)
            fword = tl.where((i_end % 32 == 0) | (i_end >= n_steps), 0, fword)


@triton.jit
def _patience_step(stop, stale, i, improved, patience):
    """Step i of the reference's global patience counter: ``stale`` counts the
    steps in a row in which no group improved; ``stop`` becomes i at the first
    step ending a run of ``patience`` of them (-1 while the loop runs)."""
    stale = tl.where(improved, 0, stale + 1)
    stop = tl.where((stop < 0) & (stale >= patience), i, stop)
    return stop, stale


@triton.jit
def _stop_step(flags_ptr, n_steps, patience):
    """The step S at which the reference's loop breaks (n_steps - 1 if never),
    from the OR-ed improvement words flags_ptr[i // 32] (bit i % 32)."""
    stop = n_steps * 0 - 1
    stale = n_steps * 0
    for i in range(n_steps):
        f = (tl.load(flags_ptr + i // 32, volatile=True) >> (i % 32)) & 1
        stop, stale = _patience_step(stop, stale, i, f != 0, patience)
    return tl.where(stop < 0, n_steps - 1, stop)


@triton.jit
def _stop_step_parts(flags_ptr, P, n_words, n_steps, patience, BLOCK_P: tl.constexpr):
    """``_stop_step`` from per-program words flags_ptr[P, n_words]: word
    i // 32 is the OR over the P programs, formed when step i enters it."""
    stop = n_steps * 0 - 1
    stale = n_steps * 0
    word = n_steps * 0
    pp = tl.arange(0, BLOCK_P)
    for i in range(n_steps):
        if i % 32 == 0:
            acc = tl.zeros([BLOCK_P], tl.int32)
            for p0 in range(0, P, BLOCK_P):
                acc = acc | tl.load(flags_ptr + (p0 + pp) * n_words + i // 32,
                                    mask=p0 + pp < P, other=0)
            word = tl.reduce(acc, 0, _or)
        f = (word >> (i % 32)) & 1
        stop, stale = _patience_step(stop, stale, i, f != 0, patience)
    return tl.where(stop < 0, n_steps - 1, stop)


@triton.jit
def _high_bit(v):
    """Index of the highest set bit of a non-zero int32 (bit 31 included)."""
    u = v.to(tl.uint32, bitcast=True)
    r = tl.zeros_like(v)
    c = u >= 65536
    r = tl.where(c, r + 16, r)
    u = tl.where(c, u >> 16, u)
    c = u >= 256
    r = tl.where(c, r + 8, r)
    u = tl.where(c, u >> 8, u)
    c = u >= 16
    r = tl.where(c, r + 4, r)
    u = tl.where(c, u >> 4, u)
    c = u >= 4
    r = tl.where(c, r + 2, r)
    u = tl.where(c, u >> 2, u)
    c = u >= 2
    return tl.where(c, r + 1, r)


@triton.jit
def _last_improving(bits_ptr, g, gmask, n_words, S):
    """Each group's last improving step <= S from its bits (-1 if none)."""
    choice = tl.full(g.shape, -1, tl.int32)
    for wi in range(n_words):
        word = tl.load(bits_ptr + g * n_words + wi, mask=gmask, other=0, volatile=True)
        keep = S - wi * 32 + 1  # bits 0 .. keep-1 of this word are steps <= S
        lowmask = tl.where(keep >= 32, -1, (1 << tl.minimum(tl.maximum(keep, 0), 31)) - 1)
        word = word & lowmask
        choice = tl.where(word != 0, wi * 32 + _high_bit(word), choice)
    return choice


@triton.jit(do_not_specialize=_PER_CALL + ["P", "groups_per_program"])
def _choose_kernel(
    bits_ptr, flags_ptr, base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr,
    G, P, groups_per_program, n_steps, n_words, patience,
    DTYPE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One program: groups_per_program groups, BLOCK_G at a time. S from the
    search programs' words flags_ptr[P, n_words] (every program computes the
    same S), then each group's last improving step <= S:
    out = rd(base * p_step), or base when the group never improved."""
    pid = tl.program_id(0)
    S = _stop_step_parts(flags_ptr, P, n_words, n_steps, patience, BLOCK_P)
    for g0 in range(0, groups_per_program, BLOCK_G):
        gl = g0 + tl.arange(0, BLOCK_G)
        g = pid.to(tl.int64) * groups_per_program + gl
        gmask = (g < G) & (gl < groups_per_program)
        choice = _last_improving(bits_ptr, g, gmask, n_words, S)
        _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask,
                      G, choice, DTYPE)


@triton.jit
def _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr, out_max_ptr, g, gmask, G,
                  choice, DTYPE: tl.constexpr):
    """out = rd(base * p[choice]) of groups g, or the base where choice < 0."""
    bmin = tl.load(base_ptr + g, mask=gmask, other=0.0, volatile=True)
    bmax = tl.load(base_ptr + G + g, mask=gmask, other=0.0, volatile=True)
    p = _shrink(tl.maximum(choice, 0), grid32, grid_bits, exact32)
    omin = tl.where(choice >= 0, Q.rd(bmin * p, DTYPE), bmin)
    omax = tl.where(choice >= 0, Q.rd(bmax * p, DTYPE), bmax)
    # values are exact in the output dtype, so the store's cast cannot round
    store_exact(out_min_ptr + g, omin, gmask)
    store_exact(out_max_ptr + g, omax, gmask)


@triton.jit(do_not_specialize=_PER_CALL)
def _minmax_part_kernel(
    x_ptr, part_ptr, tickets_ptr, flags_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split, n_words,
    PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (g, k): NaN-propagating min/max of split k of group g (chunks
    k*cps .. (k+1)*cps - 1) -> part_ptr[0 or 1, g, k]. It also clears what
    the search launch counts and ORs into (group g's ticket; program (0, 0):
    the all-groups ticket and the step flags), so the host zeroes nothing."""
    gid = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    g = gid + tl.arange(0, 1)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    mn = tl.full([1], float("inf"), tl.float32)
    mx = tl.full([1], float("-inf"), tl.float32)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, x_ptr, g, e, group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False, False,
        )
        cmn, cmx = _nan_minmax(x, valid)
        mn = Q.nan_min(mn, cmn)
        mx = Q.nan_max(mx, cmx)
    tl.store(part_ptr + g * K + k, mn)
    tl.store(part_ptr + G * K + g * K + k, mx)
    first = (g * 0 + k) == 0
    tl.store(tickets_ptr + g, g * 0, mask=first)
    wv = tl.arange(0, BLOCK_W)
    origin = (wv * 0 + gid + k) == 0
    tl.store(flags_ptr + wv, wv * 0, mask=origin & (wv < n_words))
    tl.store(tickets_ptr + G + wv, wv * 0, mask=origin & (wv == 0))


@triton.jit
def _finish_group(part_ptr, bits_ptr, flags_ptr, gid, K, n_steps, n_words, best_init,
                  DTYPE: tl.constexpr, IMATRIX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group gid's step errors from its K partials (blocks of BLOCK_K summed,
    then added, always in that order), rounded to DTYPE for "mse"; its
    improvement bits -> bits_ptr, OR-ed into flags_ptr (32 steps at a time)."""
    ks = tl.arange(0, BLOCK_K)
    j = tl.arange(0, 32)
    one = tl.arange(0, 1)
    best = tl.zeros([1], dtype=tl.float32) + best_init
    for wi in range(n_words):
        si = wi * 32 + j
        smask = si < n_steps
        err = tl.zeros([32], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            m = smask[:, None] & (kk < K)[None, :]
            v = tl.load(part_ptr + (gid * K + kk[None, :]) * n_steps + si[:, None], mask=m,
                        other=0.0, volatile=True)
            err = err + tl.sum(v, axis=1)
        if not IMATRIX:
            err = Q.rd(err, DTYPE)
        imp, best = _improved(err[None, :], best, smask[None, :])
        word = tl.sum(imp.to(tl.int32) << j[None, :], axis=1)
        tl.store(bits_ptr + gid * n_words + wi + one, word)
        tl.atomic_or(flags_ptr + wi + one, word)


@triton.jit(do_not_specialize=_PER_CALL)
def _search_part_kernel(
    x_ptr, w_ptr, wmean_ptr, wcode_ptr, tiny, tab_ptr, grid32, grid_bits, exact32, mm_ptr,
    part_ptr, base_ptr, tickets_ptr, bits_ptr, flags_ptr, out_min_ptr, out_max_ptr,
    G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, group_numel,
    K, chunks_per_split, n_steps, n_words, patience, expand, best_init,
    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr, NORM_W: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KF: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_SB: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (b, k): split k of ROWS groups. Without importance (ROWS 1)
    group b; with it (weights, CHANNEL or GROUP: group g is column block
    g % QB of row g // QB) column block b % QB of rows (b // QB) * ROWS ..
    + ROWS - 1, so that each chunk's importance is loaded once (and
    normalised once, NORM_W) for ROWS rows instead of once per element.

    Base range of each group from its K split min/max, then for each chunk
    of split k (loaded once) and each step i, the chunk's error added to
    acc[group, i]; acc -> part_ptr[g, k, 0:n_steps] (fp32, unrounded).

    Then two tickets (atomic counters, release/acquire) finish the search in
    this launch: the last of group g's K programs to arrive sums its
    partials in a fixed order and writes g's improvement bits and flags
    (``_finish_group``); the last group to be finished derives S and writes
    every group's choice, as ``_choose_kernel`` does. Which program arrives
    last varies; what it computes does not (fixed-order sums, OR of bits).
    """
    pid = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, ROWS)
    if HAS_W:
        rb = pid // QB
        j = pid - rb * QB
        row = rb * ROWS + r
        g = tl.where(row < G // QB, row.to(tl.int64) * QB + j, G)
    else:
        g = pid.to(tl.int64) + r
    gmask = g < G
    ks = tl.arange(0, BLOCK_K)
    kmask = gmask[:, None] & (ks < K)[None, :]
    pmn = tl.load(mm_ptr + g[:, None] * K + ks[None, :], mask=kmask, other=float("inf"))
    pmx = tl.load(mm_ptr + G * K + g[:, None] * K + ks[None, :], mask=kmask, other=float("-inf"))
    mn, _unused = _nan_minmax(pmn, kmask)
    _unused, mx = _nan_minmax(pmx, kmask)
    bmin = Q.rd(mn * expand, DTYPE)
    bmax = Q.rd(mx * expand, DTYPE)
    first = gmask & ((g * 0 + k) == 0)
    tl.store(base_ptr + g, bmin, mask=first)
    tl.store(base_ptr + G + g, bmax, mask=first)

    wc, wok = _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W)
    sid = tl.arange(0, BLOCK_S)
    acc = tl.zeros([ROWS, BLOCK_S], dtype=tl.float32)
    e0 = tl.arange(0, BLOCK_E).to(tl.int64)
    for c in range(chunks_per_split):
        e = (k * chunks_per_split + c) * BLOCK_E + e0
        x, w, valid = _load_group(
            x_ptr, x_ptr, g, e, group_numel,
            G, QB, sqa, sqb, R1, R2, sr0, sr1, sr2, NR, E, se, lim_r, lim_e, PAD, False, FAST,
        )
        if HAS_W:
            # importance comes only with CHANNEL / GROUP layouts: element e of
            # column block j is input column j * E + e, no padding
            w1 = tl.load(w_ptr + j * E + e, mask=e < group_numel, other=0.0)
            w1 = _importance_weights(w1, wc, wok, NORM_W)
            w = tl.broadcast_to(w1[None, :], (ROWS, BLOCK_E))
        if BLOCK_SB == 1:
            for i in range(n_steps):
                p = _shrink(n_steps * 0 + i, grid32, grid_bits, exact32)
                err = _step_errors(
                    x, valid, w, bmin, bmax, p, tab_ptr,
                    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, pw0,
                    DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False, FAST,
                )
                acc = tl.where(sid[None, :] == i, acc + err[:, None], acc)
        else:
            for i0 in range(0, n_steps, BLOCK_SB):
                si = i0 + tl.arange(0, BLOCK_SB)
                smask = si < n_steps
                err = _block_errors(
                    x, valid, w, bmin, bmax, si, smask,
                    rng, half, qmin, qmax, eps, zlo, zhi, mx_offset, norm, grid32, grid_bits,
                    exact32, DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, False,
                )
                hit = sid[None, :, None] == si[None, None, :]
                acc = acc + tl.sum(tl.where(hit, err[:, None, :], 0.0), axis=2)
    pmask = gmask[:, None] & (sid < n_steps)[None, :]
    tl.store(part_ptr + (g[:, None] * K + k) * n_steps + sid[None, :], acc, mask=pmask)

    # every thread's stores before the tickets (the atomic releases them)
    tl.debug_barrier()
    # this program's first group and its number of rows, from the program id
    # (scalars: nothing of the loop above stays live through the tickets)
    if HAS_W:
        rb = pid // QB
        g_first = (rb * ROWS).to(tl.int64) * QB + (pid - rb * QB)
        n_rows = G // QB - rb * ROWS
    else:
        g_first = pid.to(tl.int64)
        n_rows = pid * 0 + 1
    for ri in range(ROWS):
        # one scalar ticket per row, as for a single group
        gid = g_first + ri * QB
        if ri < n_rows:
            if tl.atomic_add(tickets_ptr + gid, 1) == K - 1:
                _finish_group(part_ptr, bits_ptr, flags_ptr, gid, K, n_steps, n_words,
                              best_init, DTYPE, IMATRIX, BLOCK_KF)
                tl.debug_barrier()
                if tl.atomic_add(tickets_ptr + G, 1) == G - 1:
                    S = _stop_step(flags_ptr, n_steps, patience)
                    for g0 in range(0, G, BLOCK_C):
                        gg = g0 + tl.arange(0, BLOCK_C).to(tl.int64)
                        gm = gg < G
                        choice = _last_improving(bits_ptr, gg, gm, n_words, S)
                        _write_choice(base_ptr, grid32, grid_bits, exact32, out_min_ptr,
                                      out_max_ptr, gg, gm, G, choice, DTYPE)
