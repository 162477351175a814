"""Fused MSE shrink-grid search (docs/spec.md §4), exact global patience.

For each group (a slice of the flattened ``(obs, *qparam_shape, group_size)``
view) and each step i, the candidate range is ``rd(base * p_i)`` with
``p_i = fp32(1 - i / grid)`` and the error is

    err_i = rd( sum_e  rd(|rd(fq(x_e) - x_e)| ** norm) )          flavour "mse"
    err_i = sum_e |fq(x_e) - x_e| ** norm * importance[col(e)]    flavour "imatrix" (fp32)

where ``fq`` is compressed-tensors' fake quantization with the candidate's
qparams (kernels/quant.py reproduces every rounding). A group improves at step
i when err_i is strictly below its best so far. The reference stops after
``patience`` steps in a row in which no group improved (global patience); the
step S at which it stops follows from the OR over groups of the improvement
bits, and each group's answer is its LAST improving step <= S (the unshrunk
base when there is none). So the kernels store one bit per (group, step) and
never store errors per element. With patience >= the number of steps the
reference can stop only at its last step, and a group's answer is simply its
last improving step: the kernel keeps it in a register and stores no bits.

Memory besides the outputs, which hold each group's unshrunk base range (a
value of their dtype) until its choice replaces it: one int32 word per group
and 32 steps when the search can stop early, nothing per group when it
cannot; the split path adds, per (group, split), its min/max and its partial
error of every step.

The jit kernels live in ``kernels/mse_search_details/``, a module per
algorithm (``_step``: the shared step math; ``_register``: the register
path; ``_split``: the split path; ``_choose``: the stop step and each group's
range); this module is the launcher. Groups are addressed in the raw value through ``kernels._layout.group_layout``
(the same index map as min_max and flatten, elements in the reference's
flattened order): no flattened or reshaped copy is made.

Two layouts of the work:
- small groups (<= ``LaunchConfig.max_reg_group`` elements, the common case): one
  launch of ``_search_kernel`` holds BLOCK_G whole groups in registers, takes
  their min/max itself, evaluates every step, writes the bits and stores its
  per-step "any of my groups improved" words (every word, so nothing is
  cleared beforehand); ``_choose_kernel`` ORs the programs' words, derives S
  and writes each group's range (a block of groups per choose program, at
  most ``CHOOSE_PROGRAMS``, each reading every search program's words).
  When the search cannot stop early the search kernel writes the ranges itself.
  Launches: 2 (1 when the search cannot stop early); the input is read once.
- large groups (TENSOR over a big weight, wide channels, activations with
  many observations): ``_minmax_part_kernel`` takes each split's min/max
  (and clears the counters the next launch uses), ``_search_part_kernel``
  has each (group, split) program evaluate every step over its chunks and
  write the per-(group, split, step) partial errors (with importance, a
  program takes one column block of a few rows, so each chunk's importance
  is read once for those rows); the last of a group's
  programs to arrive (a ticket: an atomic counter) sums that group's
  partials in a fixed order and writes its improvement bits and flags, and
  the last group to finish derives S and writes every group's range.
  Launches: 2; the input is read twice.
Both are deterministic: sums run in a fixed order, only the OR and the
tickets are atomic (which program arrives last changes nothing it computes).
GPU arithmetic: on a CUDA tensor the step loop uses the hardware's
conversions (``FAST``: bf16/fp16/fp8 roundings, round-half-even, a MUFU pow
checked against rounding boundaries with torch's own pow as the fallback
table, kernels/quant_pow.py); the interpreter keeps the exact emulation,
and the tests compile both. One step per iteration on a GPU, 2-D tiles.

Importance: given normalised (a user's per-column weights), its values were
checked with the call (obskernels.spec.calls: one read). Given raw with ``importance_status`` (the
imatrix observer: ``ops.importance``'s sum / count, whose verdict lies in that
record on the device), nothing is read: the launcher takes torch's own mean
of it (one aten op; the reference divides by that mean, and a kernel's own
summation order would not give its bits on every device) and the kernels
load w = div_rn(imp, mean + fp32 tiny), or 1.0 (every error unchanged) when
the verdict says the importance is unusable. One imatrix observation +
get_qparams: importance, search, choose, combine_statistics, qparams = 5
launches (6 with a TENSOR_GROUP global scale) + that mean, no read in
forward, one in get_qparams.

Host side otherwise: no host read, no copy to the device, no aten op; on a GPU
with a general norm, the pow table is built by torch once per (device,
dtype, norm). The
format's constants are Python floats (``quant.round_host``); the steps' shrink
factors are a table made once per (device, grid, steps) (``_shrink_table``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from obskernels.kernels import quant
from obskernels.kernels._layout import (
    INTERPRETED,
    GroupLayout,
    allocator,
    check_kernel_dtype,
    check_launchable,
    gpu_arith,
    group_layout,
    launch_context,
)
from obskernels.kernels._replay import Replay
from obskernels.kernels.launch import (
    CHOOSE_BLOCK,
    CHOOSE_PROGRAMS,
    MAX_SPLIT_STEPS,
    SPLIT_W_MAXNREG,
    SPLIT_W_ROWS,
    UNFUSED,
    LaunchConfig,
    cdiv,
    choose_split,
    config_token,
    current_config,
    minmax_part_warps,
    pow2_at_most,
    search_warps,
    split_blocks,
)
from obskernels.kernels.qparams import epilogue_plan, prepare_with_qparams
from obskernels.spec.calls import SearchCall, SearchQParamsCall
from obskernels.spec.layout import Strategy
from obskernels.spec.record import STATUS_IMPORTANCE
from obskernels.spec.errors import KernelUnsupportedError
from obskernels.spec.search import search_args

# obskernels.kernels imports this module at the search's first use. Triton
# builds a kernel for its interpreter or its compiler by TRITON_INTERPRET
# when decorating it: the search's are built as the rest of the package was
# (INTERPRETED), whatever the variable says by then (the compile report's
# tools switch it on around calls compiled for a GPU).
with triton.knobs.runtime.scope():
    triton.knobs.runtime.interpret = INTERPRETED
    from obskernels.kernels import quant_pow
    from obskernels.kernels.mse_search_details._choose import _choose_kernel
    from obskernels.kernels.mse_search_details._register import _search_kernel
    from obskernels.kernels.mse_search_details._split import _minmax_part_kernel, _search_part_kernel
    from obskernels.kernels.mse_search_details._step import StepConstants

__all__ = ["mse_search", "prepare", "mse_search_qparams", "prepare_qparams"]

# Block sizes and work split: kernels/launch/ (tests pin smaller ones with
# launch_config to reach the split path with tiny shapes). Only the work split
# changes with them: which candidate wins can change only through the order
# of fp32 partial sums (the split path's).
# fp32's smallest normal: the importance is divided by its mean plus this
_TINY = float(torch.finfo(torch.float32).tiny)


# --------------------------------------------------------------------------- #
# host side
# --------------------------------------------------------------------------- #
def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in host arithmetic."""
    return pow2_at_most(n, 1 << 62)


def _norm_mode(norm: float) -> int:
    """The NORM_MODE switch: the exponents torch.pow special-cases (quant_pow.abs_pow)."""
    special = {2.0: quant_pow.P_SQUARE, 3.0: quant_pow.P_CUBE, 0.5: quant_pow.P_SQRT, 1.0: quant_pow.P_ONE}
    return special.get(float(norm), quant_pow.P_GENERAL).value


@functools.lru_cache(maxsize=64)
def _shrink_table(device: torch.device, grid, n_steps: int) -> torch.Tensor:
    """Every step's shrink p_i = fp32(1 - i / grid), i < n_steps, the
    reference's Python float rounded once to fp32 (as torch rounds it where
    it scales the base), on ``device``: the search's kernels read step i's
    p from it. Made on the host (Python's own fp64 arithmetic, not a
    device's division; torch rounds each float to fp32 as it fills the
    tensor) and copied once per (device, grid, n_steps): 4 bytes a step."""
    return torch.tensor([1 - i / grid for i in range(n_steps)], dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=16)
def _pow_table(device: torch.device, dtype: torch.dtype, norm: float) -> torch.Tensor:
    """torch's own ``pow(norm)`` of every 16-bit pattern of ``dtype`` (bf16 or
    fp16), computed by torch on ``device``: the values the GPU's fast pow
    falls back to near a rounding boundary (quant_pow.pow16_hw), so the search
    rounds |d| ** norm exactly as the reference does on that device. Built
    once per (device, dtype, norm) and kept, widened to fp32 (exact) so the
    kernel reads it without a conversion: 128 KiB."""
    bits = torch.arange(1 << 15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(dtype).pow(norm).float().contiguous()


def mse_search(call: SearchCall):
    """Triton twin of ``reference.mse_search`` (docs/spec.md §4); returns (min_vals, max_vals)."""
    return prepare(call)(call)


def mse_search_qparams(call: SearchQParamsCall):
    """Triton twin of ``reference.mse_search.mse_search_qparams``: (min_vals,
    max_vals, scale, zero_point, global_scale, status), bit-identical."""
    return prepare_qparams(call)(call)


def prepare_qparams(call: SearchQParamsCall):
    """The launch of ``call``'s signature: the search with the qparams in its
    choice's epilogue (no launch more) where it makes a choice; otherwise the
    search's and ``calculate_qparams``' launches (``qparams.prepare_with_qparams``)."""
    return prepare_with_qparams(call, prepare)


class _Search(NamedTuple):
    """One search's launch arguments, shared by both paths: what ``prepare``
    derives from the call's signature, and (``None`` there) the tensors of
    the call being launched."""

    layout: GroupLayout  # the value's, elements in the reference's flattened order
    shrink: torch.Tensor  # step i's shrink p_i at [i] (``_shrink_table``)
    n_steps: int
    n_words: int
    patience: int  # the stale steps that stop the search, 0 made explicit
    expand: float
    best_init: float
    consts: StepConstants
    switches: dict  # the constexpr mode switches
    fast: bool  # the GPU's arithmetic
    steps_block: int  # grid steps per iteration of the step loop
    itemsize: int  # bytes per element of the value
    record: bool  # the call has a non-finite record to add to (RECORD)
    tab: torch.Tensor | None  # torch's pow of every 16-bit pattern (fast general pow), else None
    layout_device: torch.device  # the value's device
    value: torch.Tensor | None = None
    weights: tuple | None = None  # (w, wmean, wcode, tiny): the importance and its normalisation
    out_min: torch.Tensor | None = None  # each group's unshrunk base range until its choice replaces it
    out_max: torch.Tensor | None = None
    status: torch.Tensor | None = None  # the record (RECORD), else unread
    observation: int = 0

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def group_numel(self) -> int:
        return self.layout.num_rows * self.layout.elems

    def layout_args(self) -> tuple:
        """The layout as every search kernel takes it: G, NR, lim_r, lim_e,
        geo (``GroupLayout.kernel_args``), then the elements per group."""
        return (*self.layout.kernel_args(), self.group_numel)


def prepare(call: SearchCall, qparams: bool = False, widen: bool = True):
    """The launch of ``call``'s signature (see kernels/min_max.py ``prepare``):
    the layout, the format's constants, the step rule and the launch
    configuration are derived here once; the returned function launches any
    call of that signature.

    ``qparams`` (``prepare_qparams``): the launch of a ``SearchQParamsCall``
    of that signature (and ``widen``) whose choice computes the qparams in its epilogue;
    None where there is no choose launch (the split path, a search that
    cannot stop early) and for TENSOR_GROUP (a global scale needs every
    group's range: ``calculate_qparams`` after the search)."""
    flat, params = call.flat, call.params
    value = flat.value
    check_kernel_dtype(value)
    check_launchable(value, "mse_search")
    dtype, dev = value.dtype, value.device
    norm, grid = params.norm, params.grid
    # elements in the reference's flattened order
    layout = group_layout(flat, storage_order=False)
    qparam_args, _ = search_args(flat.args)
    fmt = quant.qformat(qparam_args, dtype, "mse_search")
    if fmt.scale not in (quant.S_NONE.value, quant.S_FP8.value, quant.S_MX.value):
        raise KernelUnsupportedError(f"mse_search: scale_dtype {qparam_args.scale_dtype}")
    imatrix = params.flavour == "imatrix"
    has_w = imatrix and call.importance is not None
    # raw importance: the kernels normalise it as they load it, by torch's own
    # mean (one reduction: its summation order is torch's, on this device),
    # and take uniform weights where the verdict says it is unusable
    norm_w = has_w and call.importance_status is not None

    n_steps = params.steps
    if imatrix:
        patience = params.patience if params.patience > 0 else n_steps + 1
        norm_run = quant.round_host(norm, torch.float32)
    else:
        patience = max(params.patience, 1)  # patience 0 stops at the first stale step too
        norm_run = quant.round_host(norm, dtype)
    switches = dict(
        DTYPE=quant.DTYPE_CODE[dtype], SYM=fmt.sym, QTYPE=fmt.qtype, SCALE=fmt.scale,
        ZP=fmt.zp, NORM_MODE=_norm_mode(float(norm)), IMATRIX=imatrix, HAS_W=has_w,
        PAD=layout.pad, NORM_W=norm_w,
    )

    token = config_token()
    config = current_config("mse_search")
    # The GPU's own conversions where they are exact by definition (FAST):
    # a CUDA tensor outside the interpreter, or a compile check pinning it.
    fast = gpu_arith(config, value, "mse_search")
    tab, pw0 = None, 0.0
    if fast and not imatrix and dtype != torch.float32 and switches["NORM_MODE"] == quant_pow.P_GENERAL.value:
        tab, pw0 = _pow_table(dev, dtype, float(norm)), quant_pow.pow_window(norm_run)
    steps_block = config.steps_per_iter
    if steps_block is None:
        steps_block = 1 if value.is_cuda else 32
    steps_block = max(1, min(steps_block, 32, pow2_at_most(n_steps, 1 << 30)))

    prepared = _Search(
        layout=layout, shrink=_shrink_table(dev, grid, n_steps), n_steps=n_steps,
        n_words=-(-n_steps // 32), patience=patience, expand=float(params.expand),
        best_init=float(torch.finfo(torch.float32 if imatrix else dtype).max),
        consts=StepConstants(fmt.rng, fmt.half, fmt.qmin, fmt.qmax, fmt.eps, fmt.zlo, fmt.zhi,
                             fmt.mx_offset, norm_run, pw0),
        switches=switches, fast=fast, steps_block=steps_block, itemsize=dtype.itemsize,
        record=call.status is not None, tab=tab, layout_device=dev,
    )
    path = _register_path if prepared.group_numel <= config.max_reg_group else _split_path
    run = path(prepared, config)
    new_stats = allocator(layout.qshape, dtype, dev)
    context = launch_context(dev)
    fixed = prepared[:_Search._fields.index("tab")]  # the fields before the call's own

    def search_of(value, weights, status, observation) -> _Search:
        """A call's search: its tensors, new outputs (the table is unread without the fast pow)."""
        return _Search(*fixed, value if tab is None else tab, dev, value, (*weights, _TINY),
                       new_stats(), new_stats(), status, observation)

    if qparams:
        # the choose kernel computes them (a run with one); TENSOR_GROUP's
        # global scale needs every group first
        if not getattr(run, "chooses", False) or flat.strategy == Strategy.TENSOR_GROUP:
            return None
        plan = epilogue_plan(flat.args, value, layout.qshape, fast, widen)

        def launch_qparams(call: SearchQParamsCall):
            if config_token() is not token:  # a launch_config block changed the policy
                return mse_search_qparams(call)
            qp, status = plan.outputs()
            value = call.flat.value
            search = search_of(value, (value, value, value), status, 0)  # no importance
            with context():
                run(search, (qp, plan.switches))
            return search.out_min, search.out_max, qp.scale_ptr, qp.zp_ptr, None, status

        return launch_qparams

    def launch(call: SearchCall):
        if config_token() is not token:  # a launch_config block changed the policy
            return mse_search(call)
        value, importance = call.flat.value, call.importance
        w = importance.to(torch.float32).contiguous() if has_w else value
        wmean = w.mean() if norm_w else w
        wcode = call.importance_status[STATUS_IMPORTANCE:] if norm_w else w
        search = search_of(value, (w, wmean, wcode), call.status, call.observation)
        with context():
            run(search)
        return search.out_min, search.out_max

    return launch


# Every search launch is UNFUSED: a GPU build would fuse a * b + c into one
# FMA (the interpreter never does), and rd(q - zp) * scale - x and pow_pos's
# sums would round once, not twice.


def _register_path(s: _Search, config: LaunchConfig):
    """Groups held whole in registers: _search_kernel, then (unless the
    search cannot stop early) _choose_kernel. Returns the launch of a call
    (``run(search)``), its sizes chosen here."""
    G, group_numel, dev = s.num_groups, s.group_numel, s.layout_device
    block_e = max(_next_pow2(group_numel), 2)
    tile = config.tile
    if s.fast and s.switches["NORM_MODE"] == quant_pow.P_SQRT.value:
        # sqrt_rn's slow path is a call: at 4096 elements per program sm_90a
        # saves a predicate register on the stack around it (8 bytes); half
        # the tile keeps it in registers
        tile = max(tile // 2, 1)
    block_g = pow2_at_most(G, max(tile // block_e, 1))
    # patience >= n_steps: the reference stops at the last step if at all, so
    # each group's answer is its last improving step, kept in a register: no
    # bits, no flags, no choose launch
    track = s.patience >= s.n_steps
    warps = search_warps(block_g * block_e, s.itemsize, s.fast)
    if s.switches["HAS_W"]:
        # two rows or more per program share each column's importance read
        # (a tile of two whole-row groups takes twice the threads)
        qa, qb = s.layout.groups
        if block_g == 1 and qa > 1:
            block_g = 2
            warps = search_warps(block_g * block_e, s.itemsize, s.fast)
        block_j = min(_next_pow2(qb), max(block_g // 2, 1))
        programs = cdiv(qa, block_g // block_j) * cdiv(qb, block_j)
    else:
        block_j, programs = block_g, cdiv(G, block_g)
    n_words = max(s.n_words, 1)
    layout_args = s.layout_args()
    search_tail = (s.n_steps, s.n_words, s.expand, s.best_init, s.consts)
    search_switches = dict(
        **s.switches, FAST=s.fast, TRACK=track, BLOCK_G=block_g, BLOCK_E=block_e,
        BLOCK_S=s.steps_block, BLOCK_J=block_j, RECORD=s.record, num_warps=warps, **UNFUSED,
    )
    # a block of groups per choose program, up to CHOOSE_PROGRAMS of them
    # (each ORs every search program's words first, from L2)
    choose_g = pow2_at_most(G, CHOOSE_BLOCK)
    n_choose = min(cdiv(G, choose_g), CHOOSE_PROGRAMS)
    per_program = cdiv(cdiv(G, n_choose), choose_g) * choose_g
    choose_grid = (cdiv(G, per_program),)
    choose_tail = (G, programs, per_program, s.n_steps, s.n_words, s.patience)
    choose_switches = dict(DTYPE=s.switches["DTYPE"], BLOCK_G=choose_g,
                           BLOCK_P=pow2_at_most(programs, 1024), **UNFUSED)

    if not track:
        # word-major: a program's words of one step range are contiguous
        new_bits = allocator((n_words, G), torch.int32, dev)
        # one word per (program, 32 steps), each stored by its program: no clearing
        new_flags = allocator((programs, n_words), torch.int32, dev)

    # a launch site each, its constexprs and options bound (kernels/_replay.py)
    search_k = Replay(globals(), "_search_kernel", (programs,), **search_switches)
    choose_k = Replay(globals(), "_choose_kernel", choose_grid, **choose_switches)
    # with the qparams' epilogue, half the groups per iteration (sm_90a: 96
    # registers at 512, and 8-11 bytes of stack under triton 3.6; ~55 at 256)
    choose_qp_k = Replay(globals(), "_choose_kernel", choose_grid,
                         **dict(choose_switches, BLOCK_G=max(choose_g // 2, 1)))

    def run(s: _Search, qparams=None) -> None:
        """``qparams``: (``QParamsOut``, its QP switches) for the choice's
        epilogue (``s.status``: the status, a record at its head)."""
        if track:
            bits = flags = s.value  # unread
        else:
            bits, flags = new_bits(), new_flags()
        search_k(
            s.value, *s.weights, s.tab, s.shrink, bits, flags, s.out_min, s.out_max,
            s.status if s.record else flags, *layout_args, *search_tail, s.observation,
        )
        if qparams is not None:
            choose_qp_k(bits, flags, s.shrink, s.out_min, s.out_max, *choose_tail,
                        status_ptr=s.status, qp=qparams[0], QP=qparams[1])
        elif not track:
            choose_k(bits, flags, s.shrink, s.out_min, s.out_max, *choose_tail)

    # whether a choose launch follows the search (it can compute the qparams)
    run.chooses = not track
    return run


def _split_path(s: _Search, config: LaunchConfig):
    """Groups split over programs: _minmax_part_kernel, then _search_part_kernel,
    whose last programs (tickets) finish each group and the choice. Returns
    the launch of a call (``run(search)``), its sizes chosen here."""
    G, group_numel, dev = s.num_groups, s.group_numel, s.layout_device
    if s.n_steps > MAX_SPLIT_STEPS:
        raise KernelUnsupportedError(
            f"mse_search: {s.n_steps} grid steps over groups of {group_numel} elements "
            f"(the split path keeps at most {MAX_SPLIT_STEPS} step errors per program)"
        )
    chunk, warps = split_blocks(config, s.itemsize, s.fast, bool(s.switches["PAD"]),
                                bool(s.switches["HAS_W"]))
    if s.switches["HAS_W"]:
        # ROWS rows of one column block per program share each chunk's
        # importance load (traffic: 4 / ROWS bytes per element, not 4); the
        # search takes a chunk as ROWS x (chunk / ROWS) elements, so its split
        # k covers the columns of the min/max's split k
        qa, qb = s.layout.groups
        rows = max(1, min(SPLIT_W_ROWS, _next_pow2(qa), chunk // 16))
        row_programs = cdiv(qa, rows) * qb
    else:
        rows, row_programs = 1, G
    # K programs per group (or row block), cps chunks each; an element costs every grid step
    K, cps = choose_split(cdiv(group_numel, chunk), 1, chunk * max(s.n_steps, 1),
                          row_programs, config)
    n_words = max(s.n_words, 1)
    block_k = _next_pow2(K)
    layout_args = s.layout_args()

    new_mm = allocator((2, G, K), torch.float32, dev)
    new_tickets = allocator((G + 1,), torch.int32, dev)
    new_bits, new_flags = allocator((n_words, G), torch.int32, dev), allocator((n_words,), torch.int32, dev)
    new_part = allocator((G, K, max(s.n_steps, 1)), torch.float32, dev)

    # a launch site each, its constexprs and options bound (kernels/_replay.py;
    # a call's search has the prepared one's switches, steps and record)
    minmax_k = Replay(globals(), "_minmax_part_kernel", (G, K),
                      PAD=s.switches["PAD"], BLOCK_E=chunk, BLOCK_W=_next_pow2(n_words),
                      DTYPE=s.switches["DTYPE"], RECORD=s.record,
                      num_warps=minmax_part_warps(chunk), **UNFUSED)
    search_k = Replay(globals(), "_search_part_kernel", (row_programs, K),
                      **s.switches, FAST=s.fast, ROWS=rows, BLOCK_E=chunk // rows, BLOCK_K=block_k,
                      BLOCK_KF=min(64, block_k), BLOCK_S=_next_pow2(max(s.n_steps, 1)),
                      BLOCK_SB=s.steps_block, BLOCK_C=pow2_at_most(G, CHOOSE_BLOCK),
                      num_warps=warps, **UNFUSED,
                      **(dict(maxnreg=SPLIT_W_MAXNREG) if s.switches["HAS_W"] else {}))

    def run(s: _Search) -> None:
        mm, tickets, bits, flags = new_mm(), new_tickets(), new_bits(), new_flags()
        minmax_k(s.value, mm, tickets, flags, s.status if s.record else flags, *layout_args, K,
                 cps, s.n_words, s.expand, s.observation)
        part = new_part()
        search_k(
            s.value, *s.weights, s.tab, s.shrink, mm, part, tickets, bits, flags,
            s.out_min, s.out_max, *layout_args, K, cps * rows, s.n_steps, s.n_words, s.patience,
            s.expand, s.best_init, s.consts,
        )

    return run
