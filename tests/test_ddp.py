"""sync_activation_stats in a real two-process gloo group on the CPU (no mocks).

Two ranks observe different activations, all-reduce with the ops of
``_act_sync_dict``, and save what they hold; this process then computes, with
one set of observers, what a single process would hold and compares exactly:

- static_minmax (MIN / MAX): one process observing every value of both ranks.
- minmax and mse (AVG): the mean of the two ranks' moving averages, which is
  what docs/spec.md §1 defines. It equals one process observing both ranks' values
  only when each rank observed ONE value and c == 0.5 (then
  ``old * 0.5 + new * 0.5`` is the mean); that case is compared to one process
  too. With c = 0.01 and several values per rank the mean of the ranks'
  averages is compared, since no single-process order reproduces it.
- imatrix_mse (SUM of x**2 sums and token counts): one forward per rank, so
  that one process adding the two batches' sums performs the same single fp32
  addition; the weight's qparams after the sync are compared too.
- the qparams of the observers that saw one value per rank, computed with
  that value's statistics before the sync changed them.
AVG on gloo is a division by the world size (2: exact) followed by SUM.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compressed_tensors.quantization import QuantizationArgs

from obskernels import Observer, set_backend, use_backend

WORLD = 2
HIDDEN = 16


def _rank_values(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    # different ranges per rank so every reduce op has work to do
    return [torch.randn(2, 3, HIDDEN, generator=g) * (rank + 1) + rank for _ in range(3)]


def _linear():
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(HIDDEN, 6, bias=False)
    lin.weight.data = torch.randn(6, HIDDEN, generator=g)
    return lin


def _observers():
    group = dict(num_bits=8, symmetric=False, strategy="group", group_size=4)
    make = Observer.load_from_registry
    obs = {
        "static_minmax": make("static_minmax", base_name="input", args=QuantizationArgs(**group)),
        "static_minmax_once": make("static_minmax", base_name="input", args=QuantizationArgs(**group)),
        "minmax_one_half": make("minmax", base_name="input", args=QuantizationArgs(**group), averaging_constant=0.5),
        "minmax_default": make("minmax", base_name="input", args=QuantizationArgs(**group)),
        "mse_one_half": make("mse", base_name="input", args=QuantizationArgs(**group), averaging_constant=0.5),
        "imatrix": make(
            "imatrix_mse", base_name="weight",
            args=QuantizationArgs(num_bits=4, symmetric=True, strategy="channel"), strict=True,
        ),
    }
    return obs


#: observers whose qparams are compared after the sync: each rank's observed
#: one value, so its qparams were computed with that value's statistics;
#: the sync changes the statistics in place, and the qparams must follow
QPARAMS_AFTER_SYNC = ("static_minmax_once", "minmax_one_half", "mse_one_half")


def _feed(obs, lin, values):
    """One rank's (or one process's) observations."""
    for v in values:
        obs["static_minmax"](v)
        obs["minmax_default"](v)
    # one value each for the c = 0.5 observers; one forward for imatrix
    obs["static_minmax_once"](values[0])
    obs["minmax_one_half"](values[0])
    obs["mse_one_half"](values[0])
    lin(torch.cat(values))


def _snapshot(obs, skip=()):
    out = {}
    for name, o in obs.items():
        if name in skip:
            continue
        for attr in o._act_sync_dict:
            out[f"{name}.{attr}"] = getattr(o, attr).clone()
    return out


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    set_backend("reference")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        obs, lin = _observers(), _linear()
        obs["imatrix"].attach(lin)
        _feed(obs, lin, _rank_values(rank))
        handles = []
        for o in obs.values():
            handles += o.sync_activation_stats()
        for h in handles:
            h.wait()
        result = _snapshot(obs)
        qp = obs["imatrix"](lin.weight).get_qparams()
        result["imatrix.scale"] = qp["scale"]
        for name in QPARAMS_AFTER_SYNC:  # one observation each: qparams computed with it
            result[f"{name}.scale"] = obs[name].get_qparams()["scale"]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sync_activation_stats_two_ranks(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    with use_backend("reference"):
        values = [_rank_values(r) for r in range(WORLD)]
        # one process observing both ranks' values
        single, lin = _observers(), _linear()
        single["imatrix"].attach(lin)
        for v in values[0] + values[1]:
            single["static_minmax"](v)
        for r in range(WORLD):
            single["static_minmax_once"](values[r][0])
            single["minmax_one_half"](values[r][0])
            single["mse_one_half"](values[r][0])
            lin(torch.cat(values[r]))
        expected = _snapshot(single, skip=("minmax_default",))
        expected["imatrix.scale"] = single["imatrix"](lin.weight).get_qparams()["scale"]
        for name in QPARAMS_AFTER_SYNC:
            expected[f"{name}.scale"] = single[name].get_qparams()["scale"]

        # minmax with c = 0.01 over several values: the mean of the ranks' averages
        per_rank = []
        for r in range(WORLD):
            o = _observers()["minmax_default"]
            for v in values[r]:
                o(v)
            per_rank.append(o)
        for attr in ("min_vals", "max_vals"):
            expected[f"minmax_default.{attr}"] = (getattr(per_rank[0], attr) + getattr(per_rank[1], attr)) / 2

    assert set(ranks[0]) == set(expected)
    assert int(expected["imatrix._imatrix_count"]) == 2 * 18
    for r, got in enumerate(ranks):
        for key, want in expected.items():
            assert got[key].dtype == want.dtype, (r, key)
            assert torch.equal(got[key], want), f"rank {r} {key}: {got[key]} != {want}"
    # the ranks did see different data: the sync changed something
    assert not torch.equal(ranks[0]["static_minmax.min_vals"], _rank_min(values[0]))


def _rank_min(values):
    with use_backend("reference"):
        o = Observer.load_from_registry(
            "static_minmax", base_name="input",
            args=QuantizationArgs(num_bits=8, symmetric=False, strategy="group", group_size=4),
        )
        for v in values:
            o(v)
        return o.min_vals
