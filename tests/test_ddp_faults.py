"""Distributed faults in a real gloo process group (no mocks).

What "correct" means after ``sync_activation_stats`` (obskernels.observers.sync):
- every rank holds the same statistics, including a rank that observed
  nothing (an unrouted expert): it joined the collectives with the identity
  of each reduction and received the result;
- MIN / MAX: the min / max over every value any rank observed;
- AVG (minmax, mse): the mean over the ranks that hold statistics of their
  moving averages (weight 0 for a rank that observed nothing); ranks may have
  observed different numbers of batches;
- SUM (imatrix): the x**2 sums and token counts of every forward on any rank,
  each counted once, however many times sync is called;
- a second sync with no observation in between changes nothing, bit for bit;
- statistics of different shapes on different ranks: the same ValueError on
  every rank, and the group stays usable;
- a process group of one behaves like no process group.

Three ranks: rank 0 observes two batches, rank 1 one, rank 2 none. Then all
sync twice; then rank 1 alone observes one more batch and all sync again.
Activations are random (min/max are exact whatever the order); the imatrix
inputs are small integers, so every fp32 sum of squares is exact in any order
and expectations are exact.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compressed_tensors.quantization import QuantizationArgs

from obskernels import Observer, set_backend, use_backend
from obskernels.reference.stats import moving_average

WORLD = 3
HIDDEN = 16
GROUP = dict(num_bits=8, symmetric=False, strategy="group", group_size=4)
# batches per rank in phase 1 (before the first sync) and phase 2 (before the third)
PHASE1 = {0: 2, 1: 1, 2: 0}
PHASE2 = {0: 0, 1: 1, 2: 0}
ACT_OBSERVERS = ("static", "minmax", "mse")
IMATRIX_OBSERVERS = ("imatrix", "imatrix_unattached")


def _activation(rank: int, phase: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * phase + 10 * rank + i)
    return torch.randn(2, 3, HIDDEN, generator=g) * (rank + 1) + rank


def _linear_input(rank: int, phase: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 100 * phase + 10 * rank + i)
    return torch.randint(-3, 4, (5, HIDDEN), generator=g).float()


def _linear() -> torch.nn.Linear:
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(HIDDEN, 6, bias=False)
    lin.weight.data = torch.randn(6, HIDDEN, generator=g)
    return lin


def _make(name: str, **kw) -> Observer:
    if name.startswith("imatrix"):
        args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
        return Observer.load_from_registry("imatrix_mse", base_name="weight", args=args, strict=True)
    registry = {"static": "static_minmax", "minmax": "minmax", "mse": "mse"}[name]
    return Observer.load_from_registry(registry, base_name="input", args=QuantizationArgs(**GROUP), **kw)


def _feed(rank, phase, batches, obs, lins):
    for i in range(batches[rank]):
        v = _activation(rank, phase, i)
        for name in ACT_OBSERVERS:
            if name == "mse" and phase == 2:
                continue  # mse stays clean in phase 2: its third sync must be skipped
            obs[name](v)
        x = _linear_input(rank, phase, i)
        for lin in lins.values():
            lin(x)


def _snapshot(obs):
    out = {}
    for name, o in obs.items():
        for attr in o._act_sync_dict:
            value = getattr(o, attr, None)
            out[f"{name}.{attr}"] = None if value is None else value.clone()
    return out


def _sync(obs):
    handles = []
    for o in obs.values():
        handles += o.sync_activation_stats()
    for h in handles:
        h.wait()


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    set_backend("reference")
    # a rank left out of a collective must fail the test, not hang it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        obs = {name: _make(name) for name in ACT_OBSERVERS + IMATRIX_OBSERVERS}
        lins = {"imatrix": _linear()}
        obs["imatrix"].attach(lins["imatrix"])
        if rank != 2:  # rank 2 never attaches this one: no sum buffer at all
            lins["imatrix_unattached"] = _linear()
            obs["imatrix_unattached"].attach(lins["imatrix_unattached"])
        res = {}
        _feed(rank, 1, PHASE1, obs, lins)
        res["before"] = _snapshot(obs)
        _sync(obs)
        res["first"] = _snapshot(obs)
        _sync(obs)
        res["second"] = _snapshot(obs)
        _feed(rank, 2, PHASE2, obs, lins)
        _sync(obs)
        res["third"] = _snapshot(obs)
        res["imatrix.scale"] = obs["imatrix"](lins["imatrix"].weight).get_qparams()["scale"]

        # an observer nobody fed: no collective needed, no statistics appear
        idle = _make("static")
        res["idle.handles"] = len(idle.sync_activation_stats())
        res["idle.has_statistics"] = idle.has_statistics

        # different hidden sizes on different ranks: the same error everywhere
        odd = _make("static")
        if rank < 2:
            odd(torch.randn(2, HIDDEN * (rank + 1)))
        try:
            odd.sync_activation_stats()
            res["mismatch"] = None
        except ValueError as exc:
            res["mismatch"] = str(exc)
        # ... and the group is still in step
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        res["after_mismatch"] = float(t)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _local(name, rank):
    """The statistics rank ``rank`` holds before the first sync (one process)."""
    o = _make(name)
    for i in range(PHASE1[rank]):
        o(_activation(rank, 1, i))
    return o


def _sq_sums(phases):
    total = torch.zeros(HIDDEN)
    count = 0
    for phase, batches in phases:
        for rank in range(WORLD):
            for i in range(batches[rank]):
                x = _linear_input(rank, phase, i)
                total += x.pow(2).sum(0)
                count += x.shape[0]
    return total, count


def _assert_equal(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{what}: {got} != {want}"


@pytest.mark.slow
def test_unrouted_rank_uneven_batches_and_repeated_sync(tmp_path):
    mp.start_processes(
        _worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD, join=True,
        # fork reuses this process's imports (torch, compressed-tensors: seconds
        # per rank under spawn); it is unsafe only once CUDA is initialised
        start_method="spawn" if torch.cuda.is_initialized() else "fork",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # the scenario is what it claims: rank 2 held no activation statistics
    assert ranks[2]["before"]["static.min_vals"] is None
    assert ranks[2]["before"]["imatrix_unattached._imatrix_sum"] is None
    assert int(ranks[2]["before"]["imatrix._imatrix_count"]) == 0

    with use_backend("reference"):
        # MIN / MAX over every value of every rank
        static = _make("static")
        for rank in range(WORLD):
            for i in range(PHASE1[rank]):
                static(_activation(rank, 1, i))
        want = {"static.min_vals": static.min_vals.clone(), "static.max_vals": static.max_vals.clone()}
        # AVG over the two ranks that observed (weight 0 for rank 2); / 2 is exact
        for name in ("minmax", "mse"):
            per_rank = [_local(name, r) for r in (0, 1)]
            for attr in ("min_vals", "max_vals"):
                want[f"{name}.{attr}"] = getattr(per_rank[0], attr) / 2 + getattr(per_rank[1], attr) / 2
        total, count = _sq_sums([(1, PHASE1)])
        for name in IMATRIX_OBSERVERS:
            want[f"{name}._imatrix_sum"] = total
            want[f"{name}._imatrix_count"] = torch.tensor(count)

        for r, res in enumerate(ranks):
            for key, w in want.items():
                _assert_equal(res["first"][key], w, f"rank {r} first sync {key}")
                # a second sync without observations changes nothing (SUM not doubled)
                _assert_equal(res["second"][key], res["first"][key], f"rank {r} second sync {key}")

        # third sync, after rank 1 alone observed one more batch
        static(_activation(1, 2, 0))
        third = {"static.min_vals": static.min_vals, "static.max_vals": static.max_vals}
        total, count = _sq_sums([(1, PHASE1), (2, PHASE2)])
        for name in IMATRIX_OBSERVERS:
            third[f"{name}._imatrix_sum"] = total
            third[f"{name}._imatrix_count"] = torch.tensor(count)
        for attr in ("min_vals", "max_vals"):
            third[f"mse.{attr}"] = want[f"mse.{attr}"]  # mse saw nothing new: skipped
        for r, res in enumerate(ranks):
            for key, w in third.items():
                _assert_equal(res["third"][key], w, f"rank {r} third sync {key}")
        # minmax: all three ranks hold statistics now; rank 1 moved its average.
        # The mean of the three (/ 3 is not exact: summation order is gloo's).
        first = {a: want[f"minmax.{a}"] for a in ("min_vals", "max_vals")}
        mm = _make("minmax")
        mm(_activation(1, 2, 0))
        for attr in ("min_vals", "max_vals"):
            moved = moving_average(first[attr], getattr(mm, attr), 0.01)
            mean = (2 * first[attr] + moved) / 3
            for r, res in enumerate(ranks):
                got = res["third"][f"minmax.{attr}"]
                torch.testing.assert_close(got, mean, rtol=2e-7, atol=0, msg=f"rank {r} minmax.{attr}")
                _assert_equal(got, ranks[0]["third"][f"minmax.{attr}"], f"rank {r} minmax.{attr} vs rank 0")

        # the weight's qparams after the syncs: one process that saw every batch
        single, lin = _make("imatrix"), _linear()
        single.attach(lin)
        for phase, batches in ((1, PHASE1), (2, PHASE2)):
            for rank in range(WORLD):
                for i in range(batches[rank]):
                    lin(_linear_input(rank, phase, i))
        want_scale = single(lin.weight).get_qparams()["scale"]
    for r, res in enumerate(ranks):
        _assert_equal(res["imatrix.scale"], want_scale, f"rank {r} imatrix scale")
        assert res["idle.handles"] == 0 and res["idle.has_statistics"] is False
        assert res["mismatch"] is not None and "differs across ranks" in res["mismatch"], res["mismatch"]
        assert "rank 0: (4,)" in res["mismatch"] and "rank 1: (8,)" in res["mismatch"], res["mismatch"]
        assert res["after_mismatch"] == 6.0


def test_process_group_of_one_is_like_no_group(tmp_path):
    assert not dist.is_initialized()
    with use_backend("reference"):
        plain = {name: _make(name) for name in ACT_OBSERVERS}
        grouped = {name: _make(name) for name in ACT_OBSERVERS}
        for obs in (plain, grouped):
            for i in range(2):
                for o in obs.values():
                    o(_activation(0, 1, i))
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
        )
        try:
            for o in grouped.values():
                assert o.sync_activation_stats() == []
        finally:
            dist.destroy_process_group()
        for name in ACT_OBSERVERS:
            for attr in ("min_vals", "max_vals"):
                _assert_equal(getattr(grouped[name], attr), getattr(plain[name], attr), f"{name}.{attr}")
            want, got = plain[name].get_qparams(), grouped[name].get_qparams()
            _assert_equal(got["scale"], want["scale"], f"{name} scale")
            _assert_equal(got["zero_point"], want["zero_point"], f"{name} zero_point")
