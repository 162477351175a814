"""Kernels whose traffic tests/test_bench.py and its worker (tests/traffic_worker.py)
work out by hand (imported where triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _masked_copy(src, dst, n, stride, BLOCK: tl.constexpr):
    """dst[i] = src[i * stride] for i < n: one load and one store per live lane."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    tl.store(dst + offs, tl.load(src + offs * stride, mask=live), mask=live)


@triton.jit
def _even_lanes(src, dst, BLOCK: tl.constexpr):
    """Copies the even lanes of one block: half the lanes are masked off."""
    offs = tl.arange(0, BLOCK)
    even = (offs % 2) == 0
    tl.store(dst + offs, tl.load(src + offs, mask=even, other=0.0), mask=even)
