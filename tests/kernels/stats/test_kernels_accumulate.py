"""The triton accumulate_sq against an fp64 sum and the reference (docs/spec.md §1, §5).

Contract: sum_buf (fp32) gains sum over tokens of x**2 within rtol 1e-5 of
the fp64 sum; count_buf gains the token count exactly; repeated runs are
bitwise identical (no order-dependent atomics).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from obskernels import ops
from obskernels.backends import use_backend

from helpers import DTYPES, outcome

pytestmark = pytest.mark.kernel
pytest.importorskip("triton", reason="the Triton kernels need triton")

accumulate_module = importlib.import_module("obskernels.kernels.accumulate_sq")

# fp32 accumulation of positive terms: docs/spec.md §5 asks 1e-5 relative to fp64.
RTOL = 1e-5


def make_x(shape, dtype, layout="contiguous", scale=1.0, device="cpu"):
    """Drawn on the CPU: the same values on every device."""
    if layout == "contiguous":
        return (torch.randn(shape) * scale).to(dtype).to(device)
    if layout == "transposed":  # channels strided, tokens contiguous
        dims = tuple(reversed(range(len(shape))))
        return (torch.randn(tuple(shape[d] for d in dims)) * scale).to(dtype).to(device).permute(dims)
    if layout == "sliced":
        big = (torch.randn(tuple(2 * n + 1 for n in shape)) * scale).to(dtype).to(device)
        return big[tuple(slice(1, 1 + 2 * n, 2) for n in shape)]
    raise ValueError(layout)


def fresh_buffers(hidden, device="cpu"):
    return (torch.rand(hidden) * 3).to(device), torch.tensor([7], dtype=torch.int64, device=device)


def run(backend, x, sum_buf, count_buf):
    sum_buf, count_buf = sum_buf.clone(), count_buf.clone()
    with use_backend(backend):
        assert ops.accumulate_sq(x, sum_buf, count_buf) is None
    return sum_buf, count_buf


def assert_close_fp64(got, start, x, what):
    want = start.double() + x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)
    err = (got.double() - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    bad = err > RTOL
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()[:5]
        detail = ", ".join(f"channel {i}: got {got[i].item()!r} fp64 {want[i].item()!r}" for i in idx)
        raise AssertionError(f"{what}: {int(bad.sum())} channels past rtol {RTOL}; {detail}")


SHAPES = [
    (5, 64),
    (17, 33),
    (2, 7, 48),
    (3, 4, 5, 17),  # 3 leading dims
    (1, 16),  # one token
    (1, 4113),  # wide hidden
    (1000, 16),  # many tokens
]


@pytest.mark.parametrize("layout", ("contiguous", "transposed", "sliced"))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_matches_fp64(shape, dtype, layout, device):
    x = make_x(shape, dtype, layout, device=device)
    sum0, count0 = fresh_buffers(shape[-1], device)
    got_sum, got_count = run("triton", x, sum0, count0)
    ref_sum, ref_count = run("reference", x, sum0, count0)
    assert_close_fp64(got_sum, sum0, x, f"{shape} {dtype} {layout}")
    assert_close_fp64(ref_sum, sum0, x, "reference")  # the oracle meets it too
    tokens = x.numel() // shape[-1]
    assert got_count.item() == ref_count.item() == 7 + tokens
    again_sum, again_count = run("triton", x, sum0, count0)
    assert torch.equal(again_sum, got_sum), "repeated runs differ"
    assert torch.equal(again_count, got_count)


def test_five_leading_dims_none_mergeable(device):
    # More non-mergeable leading dims than the kernel's 3 row levels.
    x = torch.randn(3, 4, 5, 2, 16).to(device).permute(3, 2, 1, 0, 4).to(torch.bfloat16)
    sum0, count0 = fresh_buffers(16, device)
    got_sum, got_count = run("triton", x, sum0, count0)
    assert_close_fp64(got_sum, sum0, x, "5-D permuted")
    assert got_count.item() == 7 + 120


@pytest.mark.parametrize("split", (2, 5, 64))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_split_tokens_one_launch(split, dtype, pin_launch, device, monkeypatch):
    # The path a GPU takes: token ranges split over programs, the partials
    # summed in fixed order by the last program of each channel block to
    # arrive, in the same launch (its tickets a fresh zeroed copy each call).
    from helpers import RecordingKernel

    pin_launch("accumulate_sq", tile=64, split=split)
    sink = []
    monkeypatch.setattr(accumulate_module, "_sum_sq_kernel",
                        RecordingKernel(accumulate_module._sum_sq_kernel, sink))
    x = make_x((2, 13, 40), dtype, "sliced", device=device)
    sum0, count0 = fresh_buffers(40, device)
    got_sum, got_count = run("triton", x, sum0, count0)
    ((_, grid, _, kwargs),) = sink
    assert grid[1] > 1 and kwargs["FINISH"], (grid, kwargs)
    assert_close_fp64(got_sum, sum0, x, f"split {split}")
    assert got_count.item() == 7 + 26
    again_sum, _ = run("triton", x, sum0, count0)
    assert torch.equal(again_sum, got_sum), "repeated runs differ"


def test_long_token_range_keeps_fp32_accuracy(pin_launch, device):
    # One lane sums every token. After a first square of 2^26, each later
    # square (3.9) is under half an ulp, so a plain fp32 running sum drops all
    # 239 of them: 1.4e-5 relative, past the tolerance. Compensation keeps them.
    pin_launch("accumulate_sq", tile=2)
    x = torch.full((240, 2), 3.9**0.5, device=device)
    x[0] = 8192.0
    sum0 = torch.zeros(2, device=device)
    got_sum, _ = run("triton", x, sum0, torch.zeros(1, dtype=torch.int64, device=device))
    assert_close_fp64(got_sum, sum0, x, "240 tokens in one lane")


def test_accumulates_over_calls_and_strided_sum_buf(device):
    x1, x2 = make_x((9, 24), torch.float16, device=device), make_x((4, 3, 24), torch.float16, device=device)
    storage = torch.zeros(48, device=device)
    sum_buf, count_buf = storage[::2], torch.zeros((), dtype=torch.int64, device=device)
    with use_backend("triton"):
        ops.accumulate_sq(x1, sum_buf, count_buf)
        ops.accumulate_sq(x2, sum_buf, count_buf)
    assert torch.equal(storage[1::2], torch.zeros(24, device=device)), "wrote outside the strided sum_buf"
    want = x1.double().pow(2).sum(0) + x2.reshape(-1, 24).double().pow(2).sum(0)
    torch.testing.assert_close(sum_buf.double(), want, rtol=RTOL, atol=0)
    assert count_buf.item() == 21


def _layout_of(path, seed, device):
    torch.manual_seed(seed)
    if path == "five leading dims":  # gathered at every call: no three row levels hold them
        return torch.randn(3, 4, 5, 2, 16).to(device).permute(3, 2, 1, 0, 4).to(torch.bfloat16)
    return make_x((2, 13, 40), torch.bfloat16, "sliced", device=device)


@pytest.mark.parametrize("path", ("one launch", "split", "five leading dims"))
def test_a_kept_plan_serves_new_values_of_its_signature(path, pin_launch, device, monkeypatch):
    # An imatrix hook repeats its call at every batch: the signature is planned
    # once (ops keeps the plan), later calls bring new values and accumulate.
    if path == "split":
        pin_launch("accumulate_sq", tile=64, split=5)
    kernels = importlib.import_module("obskernels.kernels")
    planned = []
    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setitem(kernels.PREPARE, "accumulate_sq",
                        lambda call: planned.append(call) or accumulate_module.prepare(call))
    xs = [_layout_of(path, seed, device) for seed in range(3)]
    hidden = xs[0].shape[-1]
    sum0, count0 = fresh_buffers(hidden, device)
    sum_buf, count_buf = sum0.clone(), count0.clone()
    with use_backend("triton"):
        for x in xs:
            ops.accumulate_sq(x, sum_buf, count_buf)
    assert len(planned) == 1, f"planned {len(planned)} times for one signature"
    everything = torch.cat([x.reshape(-1, hidden) for x in xs])
    assert_close_fp64(sum_buf, sum0, everything, f"{path}, three calls")
    assert count_buf.item() == 7 + everything.shape[0]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: inf - inf, x*x past fp32
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inf_and_nan_channels_like_reference(dtype, device):
    x = make_x((9, 20), dtype, device=device)
    x[3, 2] = float("inf")
    x[4, 5] = float("-inf")
    x[0, 7] = float("nan")
    x[8, 11] = torch.finfo(dtype).max  # squares past fp32 range for fp32 input
    sum0, count0 = fresh_buffers(20, device)
    got, _ = run("triton", x, sum0, count0)
    want, _ = run("reference", x, sum0, count0)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"NaN at {torch.isnan(got).nonzero().tolist()}"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"inf at {torch.isinf(got).nonzero().tolist()}"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=0)


BAD = [
    ("x-int", lambda: (torch.ones(4, 8, dtype=torch.int32), torch.zeros(8), torch.zeros(1, dtype=torch.long))),
    ("x-0d", lambda: (torch.tensor(1.0), torch.zeros(1), torch.zeros(1, dtype=torch.long))),
    ("sum-fp16", lambda: (torch.randn(4, 8), torch.zeros(8, dtype=torch.float16), torch.zeros(1, dtype=torch.long))),
    ("sum-shape", lambda: (torch.randn(4, 8), torch.zeros(9), torch.zeros(1, dtype=torch.long))),
    ("sum-not-tensor", lambda: (torch.randn(4, 8), [0.0] * 8, torch.zeros(1, dtype=torch.long))),
    ("count-int32", lambda: (torch.randn(4, 8), torch.zeros(8), torch.zeros(1, dtype=torch.int32))),
    ("count-two", lambda: (torch.randn(4, 8), torch.zeros(8), torch.zeros(2, dtype=torch.long))),
    ("hidden-0", lambda: (torch.randn(4, 0), torch.zeros(0), torch.zeros(1, dtype=torch.long))),
]


@pytest.mark.parametrize("make", [m for _, m in BAD], ids=[n for n, _ in BAD])
def test_bad_input_raises_like_reference(make, device):
    results = {}
    for name in ("reference", "triton"):
        x, sum_buf, count_buf = (t.to(device) if isinstance(t, torch.Tensor) else t for t in make())
        with use_backend(name):
            results[name] = outcome(lambda: ops.accumulate_sq(x, sum_buf, count_buf))
    assert results["reference"] is not None, "the reference accepted a bad input"
    assert results["triton"] == results["reference"]


def test_no_tokens_adds_nothing(device):
    x = torch.randn(0, 3, 16, dtype=torch.bfloat16, device=device)
    sum0, count0 = fresh_buffers(16, device)
    got_sum, got_count = run("triton", x, sum0, count0)
    assert torch.equal(got_sum, sum0)
    assert got_count.item() == 7


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_matches_fp64_on_cuda_at_full_size(dtype):
    """A full-size activation on CUDA (docs/spec.md §5: rtol 1e-5 against fp64,
    bitwise identical on repeated runs, the split path); test_accumulate_matches_fp64's
    shapes run on CUDA in the same run."""
    shape = (8, 2048, 4096)
    x = make_x(shape, dtype, device="cuda")
    sum0, count0 = fresh_buffers(shape[-1], "cuda")
    got_sum, got_count = run("triton", x, sum0, count0)
    assert_close_fp64(got_sum, sum0, x, f"cuda {shape} {dtype}")
    assert got_count.item() == 7 + x.numel() // shape[-1]
    again_sum, _ = run("triton", x, sum0, count0)
    assert torch.equal(again_sum, got_sum), "repeated runs differ"
