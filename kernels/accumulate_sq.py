"""E[x²] accumulation for the imatrix importance, deterministic.

    sum_buf[h] += sum over tokens t of float32(x[t, h])**2
    count_buf  += number of tokens

x is read once in its own dtype (bf16 / fp16 / fp32, any leading dims, any
strides) and squared in fp32 registers; no fp32 copy is made. Every sum runs
in a fixed order, so repeated runs agree bit for bit: one program owns a
block of channels and a fixed range of tokens (per lane, plain sums of at
most ``ACCUMULATE_ROUND`` steps, one fused multiply-add per element, added up
with Kahan compensation; then a fixed-shape tree over lanes). When the tokens
are split across programs to fill a GPU, the partial sums land in a
(split, hidden) buffer and the last program of each channel block to arrive
(a ticket: an atomic counter, zero at launch, from a fresh copy of a zeroed
template, and put back to zero) adds the block's partials in split order,
in the same launch: which program arrives last changes nothing it computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from obskernels.kernels._layout import (
    allocator,
    check_launchable,
    coalesce,
    launch_context,
    row_offsets,
    widen,
)
from obskernels.kernels._replay import Replay
from obskernels.kernels.launch import (
    ACCUMULATE_ROUND,
    FUSED,
    accumulate_tile,
    config_token,
    current_config,
)
from obskernels.spec.calls import AccumulateCall
from obskernels.spec.record import fresh_copy, zero_tickets

__all__ = ["accumulate_sq", "prepare"]


@triton.jit
def _token_offsets(t, R1, R2, sr0, sr1, sr2, ROW_LEVELS: tl.constexpr):
    """int64 storage offset of tokens t = (t0 * R1 + t1) * R2 + t2, with only
    the inner ROW_LEVELS of the three levels in use (no division for one)."""
    if ROW_LEVELS == 1:
        return t.to(tl.int64) * sr2
    else:
        return row_offsets(t, R1, R2, sr0, sr1, sr2)


@triton.jit
def _finish_block(part_ptr, sum_ptr, count_ptr, ticket_ptr, H, s_sum, NT,
                  BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """The tokens' split finished in the launch of its partials: the last of
    channel block (program_id(0))'s programs to arrive -- a ticket, an atomic
    counter at ``ticket_ptr + block``, zero at launch -- adds the block's
    partials part[s, h] over every split to sum_buf (in split order,
    Kahan-compensated per lane, then a fixed tree over lanes), block 0's adds
    NT to the count, and it puts the ticket back to zero. The partials'
    stores come before the ticket (a barrier; the atomic releases them) and
    are read after it (it acquires them), as in min_max's ``_finish_tile``."""
    tl.debug_barrier()
    block = tl.program_id(0)
    split = tl.num_programs(1)
    if tl.atomic_add(ticket_ptr + block, 1) == split - 1:
        tl.debug_barrier()
        h = block * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
        acc = tl.zeros([BLOCK_S, BLOCK_H], tl.float32)
        comp = tl.zeros([BLOCK_S, BLOCK_H], tl.float32)
        for s0 in range(0, split, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)[:, None]
            y = tl.load(part_ptr + s.to(tl.int64) * H + h, mask=(s < split) & (h < H), other=0.0) - comp
            t = acc + y
            comp = (t - acc) - y
            comp = tl.where(comp == comp, comp, 0.0)
            acc = t
        hh = block * BLOCK_H + tl.arange(0, BLOCK_H)
        ptrs = sum_ptr + hh.to(tl.int64) * s_sum
        tl.store(ptrs, tl.load(ptrs, mask=hh < H, other=0.0) + tl.sum(acc - comp, axis=0), mask=hh < H)
        if block == 0:
            tl.store(count_ptr, tl.load(count_ptr) + NT)
        one = tl.arange(0, 1)
        tl.store(ticket_ptr + block + one, one.to(tl.int64) * 0)


@triton.jit(do_not_specialize=["NT", "tokens_per_split"])
def _sum_sq_kernel(
    x_ptr, out_ptr, count_ptr,
    H, sh, NT, R1, R2, sr0, sr1, sr2, tokens_per_split, s_out_split, s_out_h,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ROUND: tl.constexpr,
    ROW_LEVELS: tl.constexpr, ADD: tl.constexpr,
    sum_ptr=None, s_sum=1, tickets_ptr=None, FINISH: tl.constexpr = False,
):
    """Program (i, s): channels [i*BLOCK_H, (i+1)*BLOCK_H), tokens
    [s*tokens_per_split, (s+1)*tokens_per_split).

    total[h] = sum over its tokens of x[t, h]**2 in fp32. Each (token lane,
    channel) sums ROUND steps plainly (x*x + acc, one instruction), then adds
    that round's sum to its total with Kahan compensation: a plain chain is at
    most ROUND terms long (relative error <= ROUND * 2^-24 for these positive
    terms), however many tokens a program has. The lanes' totals are then
    summed in a fixed-shape tree.
    ADD: out is sum_buf, out[h] += total[h], and program (0, 0) adds NT to
    the count. Otherwise out[s, h] = total[h], a partial, and FINISH (the
    tokens split) finishes the block into sum_ptr (``_finish_block``, its
    ticket at tickets_ptr[block], zero at launch).
    """
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    h_ok = h < H
    h_off = h.to(tl.int64) * sh
    t_lo = pid_s * tokens_per_split
    t_hi = tl.minimum(t_lo + tokens_per_split, NT)
    total = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    comp = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for r0 in range(t_lo, t_hi, BLOCK_T * ROUND):
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for t0 in range(r0, tl.minimum(r0 + BLOCK_T * ROUND, t_hi), BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)[:, None]
            offs = _token_offsets(t, R1, R2, sr0, sr1, sr2, ROW_LEVELS) + h_off
            x = widen(tl.load(x_ptr + offs, mask=(t < t_hi) & h_ok, other=0.0))
            acc += x * x
        y = acc - comp
        s = total + y
        comp = (s - total) - y
        # Once a lane holds inf or NaN, inf - inf would poison the compensation
        # (the reference's plain sum stays inf): drop it there.
        comp = tl.where(comp == comp, comp, 0.0)
        total = s
    result = tl.sum(total - comp, axis=0)
    hh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    if ADD:
        ptrs = out_ptr + hh.to(tl.int64) * s_out_h
        tl.store(ptrs, tl.load(ptrs, mask=hh < H, other=0.0) + result, mask=hh < H)
        if (pid_h == 0) & (pid_s == 0):
            tl.store(count_ptr, tl.load(count_ptr) + NT)
    else:
        ptrs = out_ptr + pid_s.to(tl.int64) * s_out_split + hh.to(tl.int64) * s_out_h
        tl.store(ptrs, result, mask=hh < H)
        if FINISH:
            _finish_block(out_ptr, sum_ptr, count_ptr, tickets_ptr, H, s_sum, NT, BLOCK_T, BLOCK_H)


def accumulate_sq(call: AccumulateCall):
    """sum_buf += sum over tokens of x**2 (fp32); count_buf += tokens. In place.

    The reference's result for the same call, to fp32 rounding.
    """
    return prepare(call)(call)


def prepare(call: AccumulateCall):
    """The launch of every call of ``call``'s signature (x, sum_buf and
    count_buf of the same shapes, strides, dtypes and devices): x's token
    levels, the tile, the split and the launch sites are chosen here once
    (an imatrix observer's forward hook repeats its call at every batch);
    the returned function reads only that call's tensors."""
    x, sum_buf = call.x, call.sum_buf
    check_launchable(x, "accumulate_sq")
    token = config_token()
    H = x.shape[-1]
    token_dims = coalesce(list(zip(x.shape[:-1], x.stride()[:-1])))
    # More leading dims than the kernel's three row levels, none mergeable:
    # each call gathers its tokens once, still in x's own dtype.
    gather = len(token_dims) > 3
    if gather:
        x = x.reshape(-1, H)
        token_dims = coalesce([(x.shape[0], x.stride(0))])
    sh = x.stride(-1)
    token_dims = [(1, 0)] * (3 - len(token_dims)) + token_dims
    (_, sr0), (R1, sr1), (R2, sr2) = token_dims
    NT = x.numel() // H
    config = current_config("accumulate_sq")
    tile = accumulate_tile(H, abs(sh), NT, abs(sr2) if R2 > 1 else 1 << 62, x.element_size(), config)
    levels = 1 if R1 == 1 and NT == R2 else 3  # one token level: no division
    rows = (H, sh, NT, R1, R2, sr0, sr1, sr2, tile.tokens_per_split)
    # sums of squares, compared within a tolerance: contracted (launch.FUSED)
    blocks = dict(BLOCK_T=tile.t, BLOCK_H=tile.h, ROUND=ACCUMULATE_ROUND, ROW_LEVELS=levels,
                  **tile.launch(), **FUSED)
    s_sum, split = sum_buf.stride(0), tile.split
    context = launch_context(x.device)
    # a launch site each, its constexprs and options bound (kernels/_replay.py)
    if split == 1:
        add_k = Replay(globals(), "_sum_sq_kernel", (tile.programs, 1), ADD=True, **blocks)
    else:  # partials, finished in the launch by the last program of each block
        new_part = allocator((split, H), torch.float32, x.device)
        no_tickets = zero_tickets(tile.programs, x.device)
        part_k = Replay(globals(), "_sum_sq_kernel", (tile.programs, split), ADD=False, FINISH=True,
                        **blocks)

    def launch(call: AccumulateCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return accumulate_sq(call)
        x, sum_buf, count_buf = call.x, call.sum_buf, call.count_buf
        if gather:
            x = x.reshape(-1, H)
        with context():
            if split == 1:
                add_k(x, sum_buf, count_buf, *rows, 0, s_sum)
            else:
                part_k(x, new_part(), count_buf, *rows, H, 1, sum_ptr=sum_buf, s_sum=s_sum,
                       tickets_ptr=fresh_copy(no_tickets))
        return None

    return launch
