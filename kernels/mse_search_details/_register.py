"""Register path of the search: ``_search_kernel`` holds whole groups in
registers and evaluates every step. When the search cannot stop early
(TRACK) it keeps each group's last improving step and writes its range: one
launch. Otherwise it writes each group's improvement bits and each program's
per-step flags, and ``_choose.py``'s ``_choose_kernel`` finishes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from obskernels.kernels import quant
from obskernels.kernels import stats as ST
from obskernels.kernels._layout import store_exact
from obskernels.kernels.mse_search_details._choose import _choice_range, _step_shrink
from obskernels.kernels.mse_search_details._step import (
    _PER_CALL,
    _block_errors,
    _importance_norm,
    _importance_weights,
    _improved,
    _load_group,
    _nan_minmax,
    _or,
    _step_errors,
)


@triton.jit(do_not_specialize=_PER_CALL + ["observation"])
def _search_kernel(
    x_ptr, w_ptr, wmean_ptr, wcode_ptr, tiny, tab_ptr, shrink_ptr, bits_ptr,
    flags_ptr, out_min_ptr, out_max_ptr, status_ptr,
    G, NR, lim_r, lim_e, geo, group_numel,
    n_steps, n_words, expand, best_init,
    consts, observation,
    DTYPE: tl.constexpr, SYM: tl.constexpr, QTYPE: tl.constexpr, SCALE: tl.constexpr,
    ZP: tl.constexpr, NORM_MODE: tl.constexpr, IMATRIX: tl.constexpr, HAS_W: tl.constexpr,
    PAD: tl.constexpr, FAST: tl.constexpr, NORM_W: tl.constexpr, TRACK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
    RECORD: tl.constexpr,
):
    """One program: BLOCK_G whole groups [BLOCK_G, BLOCK_E] in registers.

    With importance (weights, CHANNEL or GROUP: group g is column block
    g % QB of row g // QB), a program takes BLOCK_G // BLOCK_J rows of
    BLOCK_J column blocks and reads each column's importance once, shared by
    its rows, instead of once per element (NORM_W: normalised as it is loaded,
    ``_importance_weights``). Otherwise BLOCK_G consecutive groups.

    base = rd(amin * expand), rd(amax * expand);
    for every step i (BLOCK_S steps at a time: 1 on a GPU, more under the
    interpreter, whose cost is per operation): err_i per group (rounded to
    DTYPE for "mse"),
    improved = err_i < best (strict; NaN never), best updated.
    TRACK (patience >= n_steps: the reference stops, if at all, at the last
    step, so each group's answer is its last improving step): that step is
    kept in a register and out = rd(base * p_step), or base, is written.
    Otherwise out = base (the choose kernel reads it there); bit i of group
    g -> bits_ptr[i // 32, g]; the OR over this program's groups ->
    flags_ptr[pid, i // 32] (a plain store of every word: nothing needs
    clearing before the launch; _choose_kernel ORs the programs' words).
    On a GPU (BLOCK_S 1) the step loop is a loop of 32 steps inside a loop
    over the words, so the words' stores stay out of the loop every step runs.
    RECORD: the groups' NaN / +-inf counts and whether a base is not finite
    (then so is the chosen range: the shrink factors are in (0, 1]) go into
    the record ``status_ptr`` as observation ``observation`` (kernels/stats.py).
    """
    pid = tl.program_id(0)
    if HAS_W:
        ROWS: tl.constexpr = BLOCK_G // BLOCK_J
        n_jb = tl.cdiv(geo.QB, BLOCK_J)
        rb = pid // n_jb
        j0 = (pid - rb * n_jb) * BLOCK_J
        idx = tl.arange(0, BLOCK_G)
        row = rb * ROWS + idx // BLOCK_J
        j = j0 + idx % BLOCK_J
        g = tl.where((row < G // geo.QB) & (j < geo.QB), row.to(tl.int64) * geo.QB + j, G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, NR, lim_r, lim_e, geo, PAD, False, FAST,
        )
        # importance comes only with CHANNEL / GROUP layouts: element k of
        # column block j is input column j * E + k, no padding
        jj = j0 + tl.arange(0, BLOCK_J)
        kk = tl.arange(0, BLOCK_E)
        wm = (jj < geo.QB)[:, None] & (kk < group_numel)[None, :]
        w1 = tl.load(w_ptr + jj[:, None] * geo.E + kk[None, :], mask=wm, other=0.0)
        wc, wok = _importance_norm(wmean_ptr, wcode_ptr, tiny, NORM_W)
        w1 = _importance_weights(w1, wc, wok, NORM_W)
        w = tl.reshape(tl.broadcast_to(w1[None, :, :], (ROWS, BLOCK_J, BLOCK_E)),
                       (BLOCK_G, BLOCK_E))
    else:
        g = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < G
        x, w, valid = _load_group(
            x_ptr, w_ptr, g, tl.arange(0, BLOCK_E), group_numel,
            G, NR, lim_r, lim_e, geo, PAD, False, FAST,
        )
    mn, mx = _nan_minmax(x, valid)
    bmin = quant.rd(mn * expand, DTYPE)
    bmax = quant.rd(mx * expand, DTYPE)
    if RECORD:
        nan, pos, neg = ST.count_nonfinite(x, valid)
        finite = (tl.abs(bmin) < float("inf")) & (tl.abs(bmax) < float("inf"))  # NaN: False
        ST.record(status_ptr, nan, pos, neg, tl.max((gmask & ~finite).to(tl.int32), axis=0) > 0,
                  observation)
    if not TRACK:
        # the base goes where the choice will: a value of the output dtype
        store_exact(out_min_ptr + g, bmin, gmask)
        store_exact(out_max_ptr + g, bmax, gmask)

    # the base the candidates scale: a symmetric one depends on its absolute
    # maximum only (_candidate_qparams, ABS_BASE), one value per group
    if SYM:
        lo = quant.abs_max(bmin, bmax)
        hi = lo
    else:
        lo, hi = bmin, bmax
    # slots past the last group never improve (err < -inf is never true): the
    # step loop needs no group mask
    best = tl.where(gmask, best_init, float("-inf"))
    choice = tl.full([BLOCK_G], -1, tl.int32)
    # TRACK: the chosen step's p, kept with the choice where one step runs
    # per iteration (a gather from the table after the loop cost triton 3.6
    # 8 bytes of stack), read from the table after a loop of step blocks
    p_choice = tl.full([BLOCK_G], 1.0, tl.float32)
    if BLOCK_S == 1:
        # One step per iteration (the GPU's choice): 2-D tiles, and the OR over
        # the program's groups taken once per 32 steps from their words.
        if TRACK:
            for i in range(n_steps):
                p = tl.load(shrink_ptr + i)
                err = _step_errors(
                    x, valid, w, lo, hi, p, tab_ptr, consts,
                    DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX, FAST, SYM,
                )
                imp = err < best  # strict; NaN never improves
                best = tl.where(imp, err, best)
                choice = tl.where(imp, i, choice)
                p_choice = tl.where(imp, p, p_choice)
        else:
            for wi in range(n_words):
                word = tl.zeros([BLOCK_G], dtype=tl.int32)
                for i in range(wi * 32, tl.minimum(wi * 32 + 32, n_steps)):
                    p = tl.load(shrink_ptr + i)
                    err = _step_errors(
                        x, valid, w, lo, hi, p, tab_ptr, consts,
                        DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX, FAST, SYM,
                    )
                    imp = err < best
                    best = tl.where(imp, err, best)
                    word = word | (imp.to(tl.int32) << (i - wi * 32))
                tl.store(bits_ptr + wi * G + g, word, mask=g < G)
                tl.store(flags_ptr + pid * n_words + wi, tl.reduce(word, 0, _or))
    else:
        word = tl.zeros([BLOCK_G], dtype=tl.int32)
        fword = tl.max(word, axis=0)
        one = tl.arange(0, 1)
        for i0 in range(0, n_steps, BLOCK_S):
            si = i0 + tl.arange(0, BLOCK_S)
            smask = si < n_steps
            err = _block_errors(
                x, valid, w, lo, hi, si, smask, consts, shrink_ptr,
                DTYPE, SYM, QTYPE, SCALE, ZP, NORM_MODE, IMATRIX, HAS_W, not IMATRIX, SYM,
            )
            imp, best = _improved(err, best, gmask[:, None] & smask[None, :])
            if TRACK:
                choice = tl.maximum(choice, tl.max(tl.where(imp, si[None, :], -1), axis=1))
            else:
                # BLOCK_S divides 32, so a block never straddles two words;
                # distinct bits add without carries, so the sums are ORs
                sh = si % 32
                word = word | tl.sum(imp.to(tl.int32) << sh[None, :], axis=1)
                fword = fword | tl.sum(tl.max(imp.to(tl.int32), axis=0) << sh, axis=0)
                # flush after bit 31 and after the last step (vector masks: the
                # interpreter rejects scalar-bool store masks)
                i_end = i0 + BLOCK_S
                endv = ((word * 0 + i_end) % 32 == 0) | (word * 0 + i_end >= n_steps)
                wi = i0 // 32
                tl.store(bits_ptr + wi * G + g, word, mask=gmask & endv)
                fv = fword + one * 0
                end1 = ((one + i_end) % 32 == 0) | (one + i_end >= n_steps)
                tl.store(flags_ptr + pid * n_words + wi + one, fv, mask=end1)
                word = tl.where(endv, 0, word)
                fword = tl.where((i_end % 32 == 0) | (i_end >= n_steps), 0, fword)
        if TRACK:
            p_choice = _step_shrink(shrink_ptr, choice)
    if TRACK:
        omin, omax = _choice_range(bmin, bmax, choice, p_choice, DTYPE)
        store_exact(out_min_ptr + g, omin, gmask)
        store_exact(out_max_ptr + g, omax, gmask)
